"""The time a decision is made at, read once and passed in.

Sans-I/O cores never read a clock: their shells read a `Clock` and hand it
to them, so a test drives them at any time it likes.
"""
from __future__ import annotations

from time import monotonic, time
from typing import NamedTuple


class Clock(NamedTuple):
    """The two times a decision runs on: `mono` (monotonic, never jumps) for
    leases, heartbeats, liveness and schedules; `wall` for what is persisted
    and compared across restarts (TTL, dedup windows, dead letters' times)."""

    mono: float
    wall: float

    @classmethod
    def read(cls) -> "Clock":
        return _make(cls, (monotonic(), time()))

    @staticmethod
    def monotonic() -> float:
        """The monotonic time alone, for a shell that needs no wall time
        (the producer's reads it several times a frame)."""
        return monotonic()


_make = tuple.__new__
