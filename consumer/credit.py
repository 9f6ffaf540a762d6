"""Where a consumer's credit goes among its brokers, sans-I/O.

The consumer holds at most `budget` credit outstanding over all brokers (its
prefetch less a batch, so a full batch always has room). A broker that says
how many trajectories it holds queued (docs/protocol.md §4, `queued_counts`)
gets credit for what it holds, in chunks and round-robin, so a batch comes
from a few brokers and costs a few credit and ack messages, however many
brokers the consumer reads; one whose queue is empty keeps a standing window
of `budget // brokers` while there is room, so a trickle is delivered at
once, and gives it back (`revoke`) when a broker with trajectories needs it.
A broker that does not say keeps a fixed window of `budget // brokers`, which
the consumer's prefetch is sized for.
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

CHUNKS_PER_BUDGET = 4  # a broker with more queued than its credit waits for a quarter of the budget, not a unit


@dataclass
class BrokerCredit:
    """One broker as the consumer's credit sees it."""

    connected: bool = False  # welcomed, and not lost since
    outstanding: int = 0  # credit granted and not yet used
    queued: int | None = None  # what it last said it holds queued, in trajectories (None: it does not say)
    revoking: bool = False  # a `revoke` sent and not yet answered: its credit still counts, none is granted


class Credit:
    """Credit grants and revocations over `n_brokers`.

    Who calls what: the consumer's I/O thread alone changes it (`connected`,
    `lost`, `used`, `told`, `revoked`, `plan`, through the `Assembler` and
    `Sessions`); the trainer's thread only reads whether a broker is
    connected (`Assembler`'s settlements and `silent_brokers`), under the
    same lock (`ConsumerCore`).
    """

    def __init__(self, n_brokers: int, budget: int):
        self.budget = budget
        self.window = budget // n_brokers
        self.chunk = max(1, budget // CHUNKS_PER_BUDGET)
        self.brokers = [BrokerCredit() for _ in range(n_brokers)]
        self._next = 0  # where the next round-robin pass starts

    @property
    def outstanding(self) -> int:
        return sum(state.outstanding for state in self.brokers)

    def connected(self, broker: int, queued: int | None) -> None:
        """A new session with `broker`: no credit yet; `queued` as its welcome said (None: it does not say)."""
        self.brokers[broker] = BrokerCredit(connected=True, queued=queued)

    def lost(self, broker: int) -> None:
        """The broker dropped the session, and with it every credit."""
        self.brokers[broker] = BrokerCredit()

    def used(self, broker: int) -> None:
        state = self.brokers[broker]
        state.outstanding = max(0, state.outstanding - 1)

    def told(self, broker: int, queued: int) -> None:
        """What `broker` says it holds queued now (a `deliver` or a `queued` message)."""
        if self.brokers[broker].queued is not None:
            self.brokers[broker].queued = queued

    def revoked(self, broker: int, queued: int) -> None:
        """`broker` answered a revoke: every delivery it made on the old
        credit came before this answer, so nothing of it is outstanding."""
        state = self.brokers[broker]
        state.outstanding, state.revoking = 0, False
        self.told(broker, queued)

    def plan(self, free: int, *, per_unit: int = 1, withheld: Collection[int] = ()) -> tuple[dict[int, int], list[int]]:
        """Credit to grant now by broker, and the brokers to revoke from.
        `free`: the units the consumer may still buffer or promise;
        `per_unit`: trajectories per credit unit (a group's size, under
        group credit); `withheld` brokers get nothing."""
        room = min(free, self.budget - self.outstanding)
        grants: dict[int, int] = {}
        n = len(self.brokers)
        order = [(self._next + k) % n for k in range(n)]
        eligible = [b for b in order if self.brokers[b].connected and not self.brokers[b].revoking and b not in withheld]
        counting = [b for b in eligible if self.brokers[b].queued is not None]

        def give(broker: int, amount: int) -> None:
            nonlocal room
            self.brokers[broker].outstanding += amount
            grants[broker] = grants.get(broker, 0) + amount
            room -= amount

        for broker in eligible:  # the brokers that do not say what they hold: their fixed window
            state = self.brokers[broker]
            if state.queued is None and (amount := min(self.window - state.outstanding, room)) > 0:
                give(broker, amount)
        waiting = False  # a broker holds more than its credit covers and got none this time
        for broker in counting:
            state = self.brokers[broker]
            want = math.ceil(state.queued / per_unit) - state.outstanding  # type: ignore[operator]  # counting
            if want <= 0:
                continue
            if room < min(want, self.chunk):
                waiting = True
                continue
            give(broker, min(want, room))
            self._next = (broker + 1) % n
        if waiting:
            return grants, self._revoke_parked()
        for broker in counting:  # room left over: a standing window at each empty broker
            state = self.brokers[broker]
            if state.queued == 0 and (amount := min(self.window - state.outstanding, room)) > 0:
                give(broker, amount)
        return grants, []

    def _revoke_parked(self) -> list[int]:
        """Take back the credit parked at brokers that hold nothing queued."""
        parked = [b for b, state in enumerate(self.brokers)
                  if state.connected and state.queued == 0 and state.outstanding > 0 and not state.revoking]
        for broker in parked:
            self.brokers[broker].revoking = True
        return parked
