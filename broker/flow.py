"""How many frames in flight each producer connection may have.

Sans-I/O like the engine: the service says how many connections are active
and asks for a connection's grant whenever it answers that connection
(`welcome`, `pong`, `acks`); the grant rides on the answer.
"""
from __future__ import annotations

from rollstream.common.errors import InvalidInput


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
            raise InvalidInput(f"window and max_in_flight must be at least 1, got {window} and {max_in_flight}")
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


class DiskBudget:
    """Which producer frames the broker takes while its disk is short.

    Sans-I/O like `WindowGrants`: the service reports the store's size, the
    free space of its file system and whether consumers have something to
    take, and asks per frame. Over the disk budget a budget must slow the
    pipeline, never stop it: a consumer may hold leases while it waits for
    a full batch, and the `end`s that would complete that batch must get
    in. So only turns that would open a new trajectory wait (answered
    `unavailable`, and resent by their producer), and only while consumers
    have something to drain; `end`s, `abort`s and turns of open
    trajectories always enter. Below the free-space reserve no turn enters
    at all: the reserve is kept for what frees space (the rows an `end`
    adds, the deletes a consumer's ack causes), so the broker never fills
    its disk to where an ack can no longer be written. Both resume with a
    margin (below 90% of the budget, above 110% of the reserve), so the
    producers are not flipped at every batch."""

    RESUME_BELOW = (9, 10)  # of the budget
    RESUME_ABOVE = (11, 10)  # of the reserve

    def __init__(self, budget: int, reserve: int):
        if budget < 1 or reserve < 0:
            raise InvalidInput(f"the disk budget must be at least 1 byte and the reserve at least 0, got {budget} and {reserve}")
        self.budget = budget
        self.reserve = reserve
        self.new_trajectories = True  # turns that open a trajectory enter
        self.turns = True  # turns of open trajectories enter
        self._resume_used = budget * self.RESUME_BELOW[0] // self.RESUME_BELOW[1]
        self._resume_free = reserve * self.RESUME_ABOVE[0] // self.RESUME_ABOVE[1]
        self.used = 0
        self.free = 0

    @property
    def everything(self) -> bool:
        """Every frame enters (the common case: no per-frame question)."""
        return self.new_trajectories and self.turns

    def update(self, used: int, free: int, drainable: bool) -> bool:
        """The store holds `used` bytes and its file system has `free`;
        `drainable`: something is queued or leased, so consumers can free
        space. Returns whether what enters changed."""
        before = (self.new_trajectories, self.turns)
        self.used, self.free = used, free
        if free < self.reserve:
            self.turns = False
        elif free >= self._resume_free:
            self.turns = True
        if used > self.budget and drainable:
            self.new_trajectories = False
        elif used <= self._resume_used or not drainable:
            self.new_trajectories = True
        return (self.new_trajectories, self.turns) != before

    def lets_in(self, kind: str, trajectory_open: bool) -> bool:
        """Whether a producer frame of `kind` ("turn", "end", "abort") for a
        trajectory that is (or is not) open enters now."""
        if kind != "turn":
            return True
        return self.turns and (trajectory_open or self.new_trajectories)

    def refusal(self) -> str:
        """Why a turn is refused now: the rule, the limit and the figure."""
        if not self.turns:
            return (f"the disk is short of space: {self.free} bytes free, and the broker keeps "
                    f"{self.reserve} in reserve for ends and consumer acks; turns wait until "
                    f"{self._resume_free} bytes are free; resend later")
        return (f"over the disk budget: {self.used} bytes on disk, budget {self.budget}; new trajectories wait "
                f"until consumers bring it to {self._resume_used}; resend later")


class MemoryBudget:
    """When the broker reads producer frames, and how far it evicts, under a
    budget of trajectory bytes held in memory.

    Sans-I/O like `DiskBudget`: the service reports what the engine holds
    and asks. Over the budget it evicts (everything evicted is durable in
    the store) down to `RESUME_FRACTION` of it, what is out on a lease
    last; what it cannot evict pauses producer frames until memory is
    below `RESUME_FRACTION` again (hysteresis: the socket does not flap
    around the limit). While paused it keeps evicting above that mark:
    nothing else may ever free memory."""

    RESUME_FRACTION = 0.9

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise InvalidInput(f"max_memory_bytes must be at least 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self.reading = True

    @property
    def resume_at(self) -> float:
        return self.RESUME_FRACTION * self.max_bytes

    def evict_to(self, held: int) -> float | None:
        """How many bytes eviction should bring memory down to now, or None."""
        if held > self.max_bytes or (not self.reading and held > self.resume_at):
            return self.resume_at
        return None

    def over(self, held: int) -> bool:
        """Over the budget: stop taking producer frames (checked per frame read)."""
        return held > self.max_bytes

    def update(self, held: int) -> bool | None:
        """After eviction: True when producer frames resume now, False when
        they pause now, None when nothing changes."""
        if self.reading and held > self.max_bytes:
            self.reading = False
            return False
        if not self.reading and held <= self.resume_at:
            self.reading = True
            return True
        return None
