"""How many frames in flight each producer connection may have.

Sans-I/O like the engine: the service says how many connections are active
and asks for a connection's grant whenever it answers that connection
(`welcome`, `pong`, `acks`); the grant rides on the answer.
"""
from __future__ import annotations


class WindowGrants:
    """Shares `max_in_flight` frames among the active producer connections:
    each is granted its fair share `max_in_flight / active` (at most
    `window`, at least 1), but never more than what the grants last told to
    the others leave over. A producer keeps what it was told until its next
    answer, so a connection that joins while the earlier ones still hold
    large grants starts small and grows to its share as theirs shrink: the
    frames in flight stay near the bound even when hundreds connect at once."""

    def __init__(self, window: int, max_in_flight: int):
        if window < 1 or max_in_flight < 1:
            raise ValueError(f"window and max_in_flight must be at least 1, got {window} and {max_in_flight}")
        self.window = window
        self.max_in_flight = max_in_flight
        self.fair = window
        self._told: dict[bytes, int] = {}
        self._told_total = 0

    def active(self, connections: int) -> None:
        """How many producer connections are sending now."""
        self.fair = max(1, min(self.window, self.max_in_flight // max(1, connections)))

    def grant(self, identity: bytes) -> int:
        """The grant to tell `identity` with this answer (and remember)."""
        before = self._told.get(identity, 0)
        left = self.max_in_flight - (self._told_total - before)
        grant = max(1, min(self.fair, left))
        self._told[identity] = grant
        self._told_total += grant - before
        return grant

    def forget(self, identity: bytes) -> None:
        self._told_total -= self._told.pop(identity, 0)

    @property
    def told(self) -> int:
        """Frames the grants last told add up to."""
        return self._told_total
