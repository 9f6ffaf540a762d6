"""A consumer's `ack` or `nack` (docs/protocol.md §4), sans-I/O.

Settling takes two steps around the commit of the batch it arrived in:
`Settlement.prepare` splits the message's leases into those it settles and
stale ones, and asks the engine for the durable side (a delivered
trajectory is forgotten, a refused one dead-lettered); once that is
committed, `apply` updates the dispatcher (requeued leases go back, and
may run out of deliveries). The service only commits and answers, so the
whole decision is testable without sockets.
"""
from __future__ import annotations

from dataclasses import dataclass

from rollstream.common.codec import Message

from .dispatch import Dispatcher
from .engine import Effect, MergeEngine


@dataclass
class Settlement:
    """One consumer message's settlement, waiting for its batch to commit."""

    identity: bytes
    message: Message
    known: list[str]  # leases it settles
    stale: list[str]  # leases unknown, expired or settled earlier in the batch: they change nothing
    trajectory_ids: list[str]  # of the known leases
    requeue: bool
    effects: list[Effect]

    @classmethod
    def prepare(cls, identity: bytes, message: Message, dispatcher: Dispatcher, engine: MergeEngine, wall: float,
                claimed: set[str]) -> "Settlement":
        """Split the leases (each once; one `claimed` by an earlier message of
        the batch is stale) and take the engine's side at wall time `wall`."""
        leases = list(dict.fromkeys(message["leases"]))
        known = [lease for lease in leases if lease in dispatcher.leases and lease not in claimed]
        stale = [lease for lease in leases if lease not in known]
        tids = [dispatcher.leases[lease].trajectory_id for lease in known]
        requeue = message.type == "nack" and message["requeue"]
        if message.type == "ack":
            effects = [e for tid in tids for e in engine.delivered(tid, wall)]
        elif not requeue:
            effects = [e for tid in tids for e in engine.dead_letter(tid, message["reason"], wall)]
        else:
            effects = []
        return cls(identity, message, known, stale, tids, requeue, effects)

    def apply(self, dispatcher: Dispatcher) -> list[str]:
        """After the commit: settle the leases; a requeue puts them back, the
        rest are forgotten. Returns the trajectories a requeue left without
        deliveries (`max_deliveries`), to dead-letter."""
        settled, _ = dispatcher.end_leases(self.known)
        if self.requeue:
            return dispatcher.requeue(settled)
        for tid in self.trajectory_ids:
            dispatcher.forget(tid)
        return []
