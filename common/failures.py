"""The last wall of a receive loop: a failure no rule foresaw (a bug, in
short) while one message was handled costs that message, never the daemon.

A message that breaks a rule gets its `ProtocolError` at the rule's check.
Any other exception raised while one message is handled becomes an
`internal` refusal of that message alone (`internal_error`), logged once
with what identifies the frames (`log_internal`), while the rest of the
batch keeps its outcomes. A peer whose messages keep failing is refused
unread for a while (`FailureLimit`), so one that resends them is not served
forever.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import xxhash

from .errors import RemoteProtocolError

RULE_LIMIT = "a peer whose messages keep failing inside the receiver is refused unread for a while"


def frames_digest(frames: Sequence) -> str:
    """XXH3-64 of the frames, each length-prefixed, in hex: names a
    message in a log line and in its refusal without carrying its bytes."""
    digest = xxhash.xxh3_64()
    for frame in frames:
        view = memoryview(frame)
        digest.update(view.nbytes.to_bytes(8, "little"))
        digest.update(view)
    return digest.hexdigest()


def internal_error(exc: BaseException, message_type: str | None, frames: Sequence, *,
                   seq: int | None = None) -> RemoteProtocolError:
    """The refusal of one message whose handling raised `exc`: nothing it
    carried was applied."""
    what = f"a {message_type} message" if message_type else "a message"
    return RemoteProtocolError(
        "internal",
        f"handling {what} (frames digest {frames_digest(frames)}) failed inside the receiver with "
        f"{type(exc).__name__}: {str(exc)[:200]}; nothing it carried was applied",
        seq=seq,
    )


def log_internal(log: logging.Logger, exc: BaseException, endpoint: str, message_type: str | None,
                 frames: Sequence) -> None:
    """One error line with the traceback and what identifies the frames
    (their digest and sizes), never their bytes."""
    log.error("internal error handling a message; refused it and kept serving", exc_info=exc,
              extra={"endpoint": endpoint, "type": message_type, "digest": frames_digest(frames),
                     "frame_sizes": [memoryview(frame).nbytes for frame in frames]})


@dataclass(frozen=True)
class Limited:
    """A peer refused unread until `until` (monotonic seconds)."""

    failures: int
    until: float

    def error(self, window: float, allowed: int, mono: float) -> RemoteProtocolError:
        return RemoteProtocolError(
            "internal",
            f"rule '{RULE_LIMIT}': at most {allowed} failures within {window:g} s, this connection had "
            f"{self.failures}; its messages are refused unread for another {max(0.0, self.until - mono):.1f} s",
        )


class FailureLimit:
    """Per peer, the times of its recent internal failures: with more than
    `allowed` of them within `window` seconds, the peer is refused unread
    until the oldest of those is `window` seconds old. Sans-I/O: the caller
    passes the clock."""

    def __init__(self, *, allowed: int = 8, window: float = 60.0):
        self.allowed, self.window = allowed, window
        self._failures: dict[Hashable, deque[float]] = {}

    def failed(self, peer: Hashable, mono: float) -> None:
        times = self._failures.setdefault(peer, deque(maxlen=self.allowed + 1))
        times.append(mono)
        self._forget_before(mono - self.window)

    def limited(self, peer: Hashable, mono: float) -> Limited | None:
        """The peer's refusal while it is limited, else None."""
        times = self._failures.get(peer)
        if times is None or len(times) <= self.allowed or times[0] < mono - self.window:
            return None
        return Limited(len(times), times[0] + self.window)

    def refusal(self, peer: Hashable, mono: float) -> RemoteProtocolError | None:
        limited = self.limited(peer, mono)
        return None if limited is None else limited.error(self.window, self.allowed, mono)

    def _forget_before(self, oldest: float) -> None:
        """Peers whose last failure is out of the window: the table stays as
        small as the set of peers failing now."""
        for peer in [peer for peer, times in self._failures.items() if times[-1] < oldest]:
            del self._failures[peer]
