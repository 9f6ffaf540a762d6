"""A consumer's `ack` or `nack` (docs/protocol.md §4), sans-I/O.

Settling takes two steps around the commit of the batch it arrived in:
`Settlement.prepare` sorts the message's leases, and asks the engine for
the durable side (a delivered trajectory is forgotten, a refused one
dead-lettered); once that is committed, `apply` updates the dispatcher
(requeued leases go back, and may run out of deliveries). The service only
commits and answers, so the whole decision is testable without sockets.

An `ack` that names each lease's trajectory settles by trajectory id what
its lease no longer can: a lease of a broker incarnation that has since
restarted, or one that expired while the trainer held it. The trajectory
the trainer used is then settled wherever it is (queued again, or out on
another lease), so exactly-once does not rest on the consumer remembering
what it settled.

An `ack` with a `step`, from a checkpointing trainer, records its
trajectories as trained at that step instead of deleting them: they stay
until the trainer seals a checkpoint after it (`MergeEngine.seal`), and a
trainer resumed from an earlier checkpoint gets them back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rollstream.common.codec import Message

from .dispatch import Dispatcher
from .engine import ENDED, TRAINED, Effect, MergeEngine, TrainedAt


@dataclass
class Settlement:
    """One consumer message's settlement, waiting for its batch to commit."""

    identity: bytes
    message: Message
    known: list[str]  # leases it settles
    stale: list[str]  # leases that change nothing: unknown, expired, or settled earlier in the batch
    trajectory_ids: list[str]  # of the known leases
    requeue: bool
    effects: list[Effect]
    by_id: dict[str, str] = field(default_factory=dict)  # lease -> trajectory settled by its id (an ack)
    settled_before: list[str] = field(default_factory=list)  # leases of trajectories already settled (an ack)
    trained: int | None = None  # the step an ack recorded its trajectories as trained at

    @property
    def accepted(self) -> list[str]:
        """The leases answered `acked`/`nacked`."""
        return [*self.known, *self.by_id, *self.settled_before]

    @classmethod
    def prepare(cls, identity: bytes, message: Message, dispatcher: Dispatcher, engine: MergeEngine, wall: float,
                claimed: set[str], claimed_ids: set[str],
                trainer: tuple[str, str, int] | None = None) -> "Settlement":
        """Sort the leases (each once; one `claimed` by an earlier message of
        the batch is stale, and an ack of a trajectory in `claimed_ids` is
        answered as settled) and take the engine's side at wall time `wall`.
        Adds what it settles to `claimed` and `claimed_ids`. `trainer`: the
        run, lineage and its job's lineage epoch of a checkpointing session,
        which an ack with a step needs."""
        leases = list(dict.fromkeys(message["leases"]))
        named = dict(zip(message["leases"], message.get("trajectory_ids", ())))
        positions = dict(zip(message["leases"], message.get("positions", ())))
        step = message.get("step") if message.type == "ack" else None
        settles = (ENDED,) if step is None else (ENDED, TRAINED)  # a resumed trainer trains trained ones again
        is_ack = message.type == "ack"
        known: list[str] = []
        stale: list[str] = []
        tids: list[str] = []
        by_id: dict[str, str] = {}
        before: list[str] = []
        for lease in leases:
            out = dispatcher.leases.get(lease)
            tid = out.trajectory_id if out is not None and lease not in claimed else named.get(lease)
            entry = None if tid is None else engine.entries.get(tid)
            if tid is None or not (is_ack or out is not None):
                stale.append(lease)
            elif is_ack and tid in claimed_ids:
                before.append(lease)
            elif out is not None and lease not in claimed and entry is not None and entry.state in settles:
                known.append(lease)
                tids.append(tid)
            elif not is_ack:
                stale.append(lease)
            elif entry is not None and entry.state in settles:
                by_id[lease] = tid
            elif entry is None and tid in engine.dedup:
                before.append(lease)
            elif entry is not None and entry.state == TRAINED:  # a plain ack of what a step already recorded
                before.append(lease)
            else:
                stale.append(lease)
            claimed.add(lease)
            if is_ack and tid is not None and lease not in stale:
                claimed_ids.add(tid)
        requeue = message.type == "nack" and message["requeue"]
        if step is not None:
            assert trainer is not None  # the core refuses a step from a session that named no run
            run, lineage, epoch = trainer
            lease_of = {**dict(zip(tids, known)), **{tid: lease for lease, tid in by_id.items()}}
            effects = [e for tid, lease in lease_of.items()
                       for e in engine.trained(tid, TrainedAt(run, lineage, step, positions[lease], epoch), wall)]
        elif is_ack:
            effects = [e for tid in (*tids, *by_id.values()) for e in engine.delivered(tid, wall)]
        elif not requeue:
            effects = [e for tid in tids for e in engine.dead_letter(tid, message["reason"], wall)]
        else:
            effects = []
        return cls(identity, message, known, stale, tids, requeue, effects, by_id, before, step)

    def apply(self, dispatcher: Dispatcher) -> list[str]:
        """After the commit: settle the leases; a requeue puts them back, the
        rest are forgotten, those settled by id taken from wherever they are
        now. Returns the trajectories a requeue left without deliveries
        (`max_deliveries`), to dead-letter."""
        settled, _ = dispatcher.end_leases(self.known)
        if self.requeue:
            return dispatcher.requeue(settled)
        if self.by_id:
            dispatcher.withdraw(set(self.by_id.values()))
        for tid in (*self.trajectory_ids, *self.by_id.values()):
            dispatcher.forget(tid)
        return []
