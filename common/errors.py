"""rollstream's one error vocabulary.

Every error rollstream raises derives from `RollstreamError` and carries a
`code`: the protocol's reply code when a peer was (or would be) refused
(`contract.NACK_CODES`, docs/protocol.md §3), or one of the local codes
below for what no reply carries. Whether an error is worth retrying is read
from one table, `RETRIABLE`, never decided where it is raised. Each keeps
the builtin base its callers catch (`ValueError`, `RuntimeError`,
`TimeoutError`, ...) as its second base.

A protocol rule broken is a `ProtocolError`, and who broke it decides the
type, as in h11: `LocalProtocolError` for this process's own input (a
caller's turn, mask or message, refused before anything is sent),
`RemoteProtocolError` for what arrived (a peer's message, or a record read
back) and `Refused` for a peer's refusal of what this process sent (a
`nack`), the same type in the producer and the consumer. The shared rule
checks raise `LocalProtocolError`; a receiving side turns it into a
`RemoteProtocolError` (`ProtocolError.as_remote`).
"""
from __future__ import annotations

from .contract import NACK_CODES

# Codes of errors that no reply carries: raised by a client in its caller's
# thread.
LOCAL_CODES = (
    "closed",         # the client was closed by its owner: no more frames or batches
    "client_failed",  # the client's I/O loop died: nothing more will be sent or settled
    "invalid_batch",  # a delivered batch broke the mask rules (BatchValidationError)
    "handshake_refused",  # the broker refused this client's CURVE handshake (its key, or CURVE on one end only)
    "invalid_input",  # a local input (an argument, a setting, a recording, a key file) cannot be used as it is
    "invalid_state",  # a call its object's state does not allow now (before start, after close, on shed arrays)
    "not_found",      # a key the caller named is not held (a lease, a trajectory the trainer does not hold)
    "timed_out",      # a blocking call's own timeout passed (no room for a frame, no full batch)
    "no_answer",      # a peer did not answer in time (an admin call, a broker not yet listening)
    "spool_unusable", # a producer's spool belongs to another, is locked, of another format, or damaged
    "window_full",    # the resend window holds its limit of unsettled frames
    "missing_extra",  # a call needs an optional dependency (an extra) that is not installed
    "support_overflow",  # an engine refused a request: a sampled token's support exceeded its cap
)

# Whether the same request, made again unchanged, may later succeed. A
# refusal of the content (or of a handle that is gone) is not retriable; only
# the broker's passing state is: `unavailable` (it cannot persist now) and
# `out_of_order` (an earlier frame of the trajectory is still unsettled:
# resend in order, docs/protocol.md §3), and a wait that may end later.
RETRIABLE: dict[str, bool] = {
    "malformed": False,
    "version": False,
    "schema": False,
    "too_large": False,
    "crc_mismatch": False,
    "dtype": False,
    "shape": False,
    "misaligned": False,
    "mask_invalid": False,
    "out_of_vocab": False,
    "invalid_value": False,
    "out_of_order": True,
    "conflict": False,
    "mask_presence": False,
    "unknown_trajectory": False,
    "stale_lease": False,
    "unknown_consumer": False,
    "not_checkpointed": False,
    "checkpoint_gone": False,
    "unavailable": True,
    "internal": False,
    "closed": False,
    "client_failed": False,
    "invalid_batch": False,
    "handshake_refused": False,
    "invalid_input": False,
    "invalid_state": False,
    "not_found": False,
    "timed_out": True,
    "no_answer": True,
    "spool_unusable": False,
    "window_full": True,
    "missing_extra": False,
    "support_overflow": False,
}


class RollstreamError(Exception):
    """The root of rollstream's errors.

    `code` is a reply code (`contract.NACK_CODES`) or a local one
    (`LOCAL_CODES`); subclasses with one meaning set it as a class attribute,
    the others pass `code=`. `retriable` says whether the same request, made
    again unchanged, may later succeed (`RETRIABLE`; a code this version does
    not know, a newer peer's, is not retriable).
    """

    code: str

    def __init__(self, *args, code: str | None = None):
        super().__init__(*args)
        if code is not None:
            self.code = code
        elif not hasattr(self, "code"):
            raise InvalidType(f"{type(self).__name__} needs a code: pass code= or set it on the class")

    @property
    def retriable(self) -> bool:
        return RETRIABLE.get(self.code, False)

    def __str__(self) -> str:  # KeyError, a second base of some, would quote the message
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class InvalidInput(RollstreamError, ValueError):
    """An argument or setting a caller passed cannot be used as it is (the
    rule, the expected and the actual value are in the message)."""

    code = "invalid_input"


class InvalidType(InvalidInput, TypeError):
    """An argument of the wrong type."""


class OutOfRange(InvalidInput, IndexError):
    """An index past the end (also what ends iteration by index)."""


class ExtraMissing(RollstreamError, ImportError):
    """A call needs an optional dependency that is not installed; the
    message names the extra that installs it."""

    code = "missing_extra"

    def __init__(self, module: str, extra: str, needed_by: str):
        super().__init__(f"{needed_by} needs the {module!r} package, which is not installed: "
                         f"pip install 'rollstream[{extra}]'")
        self.name = module


class SupportOverflow(RollstreamError, ValueError):
    """An engine refused a request because a sampled token's support grew
    past its cap (SGLang's `--sampling-mask-max-tokens`), before the token
    was committed: the same request fails again; a narrower sampler may not.
    `support` and `cap` are what the engine said, None where it did not."""

    code = "support_overflow"

    def __init__(self, message: str, *, support: int | None = None, cap: int | None = None):
        super().__init__(message)
        self.support, self.cap = support, cap


class InvalidState(RollstreamError, RuntimeError):
    """A call its object's state does not allow now (before `start`, on a
    shed trajectory's arrays, a collective out of step)."""

    code = "invalid_state"


class NotFound(RollstreamError, KeyError):
    """A key the caller named is not held."""

    code = "not_found"


class TimedOut(RollstreamError, TimeoutError):
    """A blocking call's own timeout passed; calling again may succeed."""

    code = "timed_out"


class InternalError(RollstreamError, RuntimeError):
    """An invariant of rollstream's own broke: a bug to report."""

    code = "internal"


class ProtocolError(RollstreamError, ValueError):
    """A rule of the protocol or of the data model is broken; nothing was
    changed. Raised as one of its three kinds (the module's docstring).

    `code` is one of `contract.NACK_CODES`; `seq` is the sender's sequence
    number when it could be read; `expected` carries the next expected turn
    for `out_of_order`. It is also a `ValueError`: it refuses a value, and
    callers of the data model (`Turn.build`, `SamplingMask`) catch it as one.
    """

    def __init__(self, code: str, message: str, *, seq: int | None = None, expected: int | None = None):
        if code not in NACK_CODES:
            raise InvalidInput(f"unknown reply code {code!r}; expected one of {NACK_CODES}")
        super().__init__(f"{code}: {message}", code=code)
        self.message = message
        self.seq = seq
        self.expected = expected

    def with_seq(self, seq: int | None) -> "ProtocolError":
        """The same refusal, answering the sender's `seq`."""
        return type(self)(self.code, self.message, seq=seq, expected=self.expected)

    def as_remote(self) -> "RemoteProtocolError":
        """The same rule, broken by what arrived rather than by a caller."""
        if isinstance(self, RemoteProtocolError):
            return self
        return RemoteProtocolError(self.code, self.message, seq=self.seq, expected=self.expected)


class LocalProtocolError(ProtocolError):
    """This process's own input breaks a rule (a caller's turn, mask or
    message): refused before anything was sent."""


class RemoteProtocolError(ProtocolError):
    """What arrived breaks a rule (a peer's message, a record read back):
    the receiver refuses it (`nack`) or drops it."""


class Refused(ProtocolError):
    """A peer refused what this process sent (a `nack`); it changed nothing
    there. The same type in the producer and the consumer.

    `code` is the reply code (a newer peer's code is kept as it came),
    `message` the peer's explanation, `expected` the next turn it wanted
    (for `out_of_order`); `kind`, `trajectory_id` and `turn` name what was
    refused when one frame was (a producer's turn, end or abort).
    """

    def __init__(self, code: str, message: str, *, kind: str | None = None, trajectory_id: str | None = None,
                 turn: int | None = None, seq: int | None = None, expected: int | None = None):
        where = "a message" if kind is None else f"{kind} of {trajectory_id!r}" + (
            f" turn {turn}" if turn is not None else "")
        RollstreamError.__init__(self, f"broker refused {where}: {code}: {message}", code=code)
        self.message = message
        self.kind = kind
        self.trajectory_id = trajectory_id
        self.turn = turn
        self.seq = seq
        self.expected = expected

    def with_seq(self, seq: int | None) -> "Refused":
        return Refused(self.code, self.message, kind=self.kind, trajectory_id=self.trajectory_id, turn=self.turn,
                       seq=seq, expected=self.expected)


class ClientClosed(RollstreamError, RuntimeError):
    """A client (a producer or a consumer) was closed by its owner: no more
    frames or batches through it."""

    code = "closed"


class ClientFailed(RollstreamError, RuntimeError):
    """A producer's or consumer's I/O loop died: nothing more will be sent,
    received or settled through it. The loop's exception is `__cause__`."""

    code = "client_failed"

    def __init__(self, client: str, cause: BaseException):
        super().__init__(f"{client} stopped: its I/O loop failed with {cause!r}")
