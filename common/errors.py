"""rollstream's one error vocabulary.

Every error rollstream raises on purpose derives from `RollstreamError` and
carries a `code`: the protocol's reply code when a peer was (or would be)
refused (`contract.NACK_CODES`, docs/protocol.md §3), or one of the local
codes below for what no reply carries. Whether an error is worth retrying is
read from one table, `RETRIABLE`, never decided where it is raised.
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
    "invalid_input",  # a local input (a recording, per-turn samples, an endpoints file, a key file) cannot be used as it is
    "no_answer",      # a peer did not answer in time (an admin call, a broker not yet listening)
    "spool_unusable", # a producer's spool belongs to another, is locked, of another format, or damaged
    "window_full",    # the resend window holds its limit of unsettled frames
)

# Whether the same request, made again unchanged, may later succeed. A
# refusal of the content (or of a handle that is gone) is not retriable; only
# the broker's passing state is: `unavailable` (it cannot persist now) and
# `out_of_order` (an earlier frame of the trajectory is still unsettled:
# resend in order, docs/protocol.md §3).
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
    "unavailable": True,
    "internal": False,
    "closed": False,
    "client_failed": False,
    "invalid_batch": False,
    "handshake_refused": False,
    "invalid_input": False,
    "no_answer": True,
    "spool_unusable": False,
    "window_full": True,
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
            raise TypeError(f"{type(self).__name__} needs a code: pass code= or set it on the class")

    @property
    def retriable(self) -> bool:
        return RETRIABLE.get(self.code, False)


class ProtocolError(RollstreamError, ValueError):
    """Input refused under a protocol rule; nothing was changed.

    `code` is one of `contract.NACK_CODES`; `seq` is the sender's sequence
    number when it could be read; `expected` carries the next expected turn
    for `out_of_order`. It is also a `ValueError`: it refuses a value, and
    callers of the data model (`Turn.build`, `SamplingMask`) catch it as one.
    """

    def __init__(self, code: str, message: str, *, seq: int | None = None, expected: int | None = None):
        if code not in NACK_CODES:
            raise ValueError(f"unknown reply code {code!r}; expected one of {NACK_CODES}")
        super().__init__(f"{code}: {message}", code=code)
        self.message = message
        self.seq = seq
        self.expected = expected

    def with_seq(self, seq: int | None) -> "ProtocolError":
        """The same refusal, answering the sender's `seq`."""
        return ProtocolError(self.code, self.message, seq=seq, expected=self.expected)


class ClientFailed(RollstreamError, RuntimeError):
    """A producer's or consumer's I/O loop died: nothing more will be sent,
    received or settled through it. The loop's exception is `__cause__`."""

    code = "client_failed"

    def __init__(self, client: str, cause: BaseException):
        super().__init__(f"{client} stopped: its I/O loop failed with {cause!r}")
