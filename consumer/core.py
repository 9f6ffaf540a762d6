"""The consumer's whole composition, sans-I/O: `ConsumerCore`.

As `BrokerCore` is for the broker, and h11's `Connection` for HTTP, every
decision between what the brokers say and what the trainer is handed lives
here, over the parts it composes: `Sessions` (each broker connection's
conduct: hellos, heartbeats, what a reply means, the published policy), the
`Assembler` (deliveries, deduplication, groups, credit, settlements) and,
for a checkpointing consumer, the `TrainingPosition` (run, steps, seals,
what a resume hands back). A shell feeds it inputs with the time and
performs what comes back; a batching, refill or commit rule goes here (or
into the part it concerns), never into a shell.

Inputs, by the thread of the `Consumer` shell that calls them:
- its I/O thread: `received` (a decoded message), `undecodable` (one that
  did not decode), and `due(now)`, which returns every `Outgoing` message to
  send now (the `Assembler`'s outbox included);
- its trainer's thread: `take` (a `Form`: pack and check these deliveries as
  batch `seq`; or a `Wait`), `formed` (the check's violations: `HandOut`, or
  `Refill` after a quarantine), `abandon`, `commit_step`, `commit`,
  `release`, `seal`, `publish`, `shard_over`, `state_dict`, `close`.

It owns no socket, thread, lock or clock and never touches torch: the shell
passes `now` in, builds and checks each batch on its device (the core gets
the verdict), and serialises the two threads' calls with one lock. Each
input's docstring says who calls it (Caller) and what it changes (Affects).
Another shell drives it the same way: tests/test_consumer_core.py scripts
the brokers' messages, and an offline source of batches (from an archive,
say) would hand its stored deliveries to `received` behind a welcome of its
own and answer, or drop, what `due` returns.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, NamedTuple, Sequence

from rollstream.common.codec import Message
from rollstream.common.contract import CreditUnit
from rollstream.common.errors import (
    ClientClosed,
    InvalidInput,
    InvalidState,
    Refused,
    RemoteProtocolError,
    RollstreamError,
    TimedOut,
)
from rollstream.common.jobs import DEFAULT_JOB, check_job
from rollstream.common.validation import BatchValidationError, Violation

from .assembly import POLICIES, Assembler, Delivery, Outgoing, Unit
from .position import TrainedBatch, TrainingPosition
from .session import Sessions

log = logging.getLogger("rollstream.consumer")


class ConsumerClosed(ClientClosed):
    """The consumer was closed; no more batches."""


# -- what `take` and `formed` return ----------------------------------------------
class Wait(NamedTuple):
    """Nothing to hand out yet: `take` again once something arrived, or at
    `until` at the latest (a deadline or the `partial_at` of the take; None:
    no time of its own)."""

    until: float | None


class Form(NamedTuple):
    """Pack these deliveries, in this order, as batch `seq`, check it, and
    tell `formed` what the check found. `replayed_step`: a batch handed back
    by a resume, which keeps the step it was trained at and validates whole."""

    seq: int
    deliveries: list[Delivery]
    replayed_step: int | None


class HandOut(NamedTuple):
    """Batch `seq` is the trainer's, awaiting its `commit` or `release`."""

    seq: int


class Refill(NamedTuple):
    """The batch's failing trajectories were quarantined (dead-lettered with
    their violations); `take` again for a batch of the rest and new units."""

    rejected: tuple[str, ...]


@dataclass(frozen=True)
class _Handed:
    """A batch handed to the trainer and not yet committed."""

    trajectory_ids: tuple[str, ...]
    replayed_step: int | None  # a batch handed back by a resume: the step it must be trained at again
    # What a checkpointing commit records (`TrainedBatch`); left empty when deleting on commit.
    sample_indices: tuple[int | None, ...] = ()
    group_ids: tuple[str | None, ...] = ()
    nbytes: int = 0  # of its deliveries' arrays


@dataclass
class _Forming:
    """The batch `take` is putting together: its units so far, and the
    deliveries of the `Form` awaiting its verdict."""

    seq: int
    units: list[Unit] = field(default_factory=list)
    past_replay: bool = False  # nothing handed back by a resume is due first: new data
    form: Form | None = None


class ConsumerCore:
    """One consumer's brokers, buffer and data position, between the shell's
    inputs and what it must send or hand out (module docstring).

    `endpoints` name the brokers (in logs and errors; a message's `broker`
    is an index into them). The other arguments are `Consumer`'s, with
    `keep` its `filter`.
    """

    def __init__(self, endpoints: Sequence[str], *, consumer_id: str, batch_size: int | None = None,
                 batch_tokens: int | None = None, unit: str = CreditUnit.TRAJECTORY, prefetch: int | None = None,
                 on_invalid: str = "raise", dedup_capacity: int = 100_000, hello_timeout: float = 5.0,
                 checkpointed: bool = True, keep_checkpoints: int = 2, resume: Mapping[str, Any] | None = None,
                 world_size: int | None = None, job: str = DEFAULT_JOB, max_staleness: int | None = None,
                 keep: Callable[[list[Mapping[str, Any]]], bool] | None = None):
        if on_invalid not in POLICIES:
            raise InvalidInput(f"on_invalid must be one of {POLICIES}, got {on_invalid!r}")
        if resume is not None and not checkpointed:
            raise InvalidInput("resume needs checkpointed=True: a consumer that deletes on commit keeps no position")
        if max_staleness is not None and (type(max_staleness) is not int or max_staleness < 0):
            raise InvalidInput(f"max_staleness is an integer >= 0 (policy versions), got {max_staleness!r}")
        self.job = check_job(job)  # brokers hand it this job's trajectories only (`rollstream.common.jobs`)
        self.endpoints = list(endpoints)
        self.on_invalid = on_invalid
        self.assembler = Assembler(len(self.endpoints), batch_size=batch_size, batch_tokens=batch_tokens, unit=unit,
                                   prefetch=prefetch, dedup_capacity=dedup_capacity, keep=keep)
        self.batch_size = self.assembler.batch_size  # given, or the unit cap of a `batch_tokens` batch
        self.batch_tokens = batch_tokens
        # The data-parallel ranks its batches are sharded to: 1 until a `DistributedConsumer` sets its group's size
        # (`shard_over`), unless given here.
        self.world_size = 1 if world_size is None else world_size
        self._world_size_fixed = False
        self.position = (TrainingPosition(keep_checkpoints=keep_checkpoints, world_size=self.world_size, resume=resume,
                                          job=job) if checkpointed else None)
        if world_size is not None:
            self._fix_world_size(world_size)
        self.sessions = Sessions(self.assembler, self.endpoints, consumer_id=consumer_id, hello_timeout=hello_timeout,
                                 position=self.position, job=job)
        self.sessions.max_staleness = max_staleness  # the trainer's own bound: lowers its brokers'
        if self.position is not None and self.position.resumed_from is not None:
            # The weights resumed are the checkpoint's, in a new lineage epoch: brokers learn both at once.
            self.sessions.publish(self.position.resumed_from)
        self.closing = False
        self._seq = itertools.count()
        self._forming: _Forming | None = None
        self._awaiting: dict[int, _Handed] = {}  # batch seq -> what the trainer holds of it

    # -- what the brokers say (the I/O thread) ------------------------------------------
    def received(self, broker: int, message: Message, now: float) -> None:
        """A decoded message from `broker`. A failure no rule foresaw while
        it is handled costs this message alone (`Sessions.failed_inside`);
        a rule this consumer enforces on purpose raises.

        Caller: the I/O thread.
        Affects: the session's handshake, policy and bound (`Sessions`);
        buffered deliveries, credit and settlements (`Assembler`); resume
        answers, seals and budgets (`TrainingPosition`)."""
        try:
            self.sessions.received(broker, message, now)
        except RollstreamError:
            raise
        except Exception as exc:
            self.sessions.failed_inside(broker, message.type, message.fields, message.frames, exc)

    def undecodable(self, broker: int, header: Mapping[str, Any], error: RemoteProtocolError, frames) -> None:
        """A message from `broker` that did not decode: `header`, what of its
        header could be read, and its `frames`. A delivery's lease goes back.

        Caller: the I/O thread.
        Affects: credit, settlements and counters (`Assembler`)."""
        try:
            self.sessions.undecodable(broker, header, error)
        except RollstreamError:
            raise
        except Exception as exc:
            message_type = header.get("type")
            self.sessions.failed_inside(broker, message_type if isinstance(message_type, str) else None, header,
                                        frames, exc)

    def due(self, now: float) -> list[Outgoing]:
        """Every message to send now: hellos, the policy, credit,
        settlements and seals (the `Assembler`'s outbox), resumes and
        heartbeats. Once closing: no hello and no credit, and deliveries
        still arriving go straight back.

        Caller: the I/O thread, on every pass.
        Affects: each session's hello and heartbeat times (`Sessions`); the
        outbox, expired units and credit (`Assembler`)."""
        return self.sessions.due(now, closing=self.closing)

    @property
    def handshaking(self) -> bool:
        """Whether some broker has not welcomed its current session yet.

        Caller: the I/O thread (it watches the handshakes closely meanwhile)."""
        return self.sessions.welcomed_sessions < len(self.endpoints)

    # -- batches (the trainer's thread) ---------------------------------------------------
    def take(self, now: float, *, deadline: float | None = None, partial_at: float | None = None) -> Wait | Form:
        """The next batch to form: first, after a resume, each batch handed
        back, whole and in order, once every broker answered and all of it
        is here; then `batch_size` complete units (within `batch_tokens`),
        or, from `partial_at` on, the complete ones that fit. Units whose leases
        ran out while buffered, and (with a staleness bound) those too old to
        train now, are dropped first. Raises `TimedOut` from `deadline` on
        (what the batch held goes back), `Refused` when a broker cannot
        resume, and `ConsumerClosed` once closing.

        Caller: the trainer's thread, again after each `Wait` and `Refill`.
        Affects: the batch being formed and its sequence number; units taken,
        expired or dropped stale, and their settlements (`Assembler`); the
        replayed steps with the trainer (`TrainingPosition`)."""
        self._check_open()
        forming = self._forming
        if forming is None:
            forming = self._forming = _Forming(next(self._seq))
        elif forming.form is not None:
            raise InvalidState(f"batch seq={forming.seq} awaits its verdict (`formed`) before another take")
        if not forming.past_replay:
            replay = self._take_replayed(forming, now, deadline)
            if replay is not None:
                return replay
        assembler = self.assembler
        # A trainer that stalled past a lease must not get that unit: the broker redelivers it.
        assembler.drop_expired(now)
        below = self.sessions.stale_below()
        if below is not None:
            assembler.drop_stale(below)  # prefetched units age too
        held, n = forming.units, self.batch_size - len(forming.units)
        complete = assembler.complete
        if assembler.fills(n, held) or (partial_at is not None and now >= partial_at and (complete or held)):
            held += assembler.take(n, held)
            forming.form = Form(forming.seq, [d for unit in held for d in unit.members.values()], None)
            return forming.form
        if deadline is not None and now >= deadline:
            self.abandon()
            budget = "" if self.batch_tokens is None else f" (or {self.batch_tokens} tokens)"
            raise TimedOut(f"no full batch within the timeout: {complete} of {n} units{budget} complete")
        until = deadline
        if partial_at is not None and partial_at > now:
            until = partial_at if until is None else min(until, partial_at)
        return Wait(until)

    def _take_replayed(self, forming: _Forming, now: float, deadline: float | None) -> Wait | Form | None:
        """After a resume: the next batch handed back, or a `Wait` for it;
        None (from then on) when nothing is left to train again."""
        position = self.position
        if position is None:
            forming.past_replay = True
            return None
        if position.failure is not None:  # a broker cannot resume: its batches were reclaimed
            self._forming = None
            code, message = position.failure
            raise Refused(code, f"cannot resume from step {position.resumed_from}: {message}")
        if not position.waiting_for_resume(len(self.endpoints)):
            replay = position.next_replay()
            if replay is None:
                forming.past_replay = True
                return None
            step, tids = replay
            if self.assembler.replayed(tids):
                position.handed(step)
                forming.form = Form(forming.seq, self.assembler.take_replayed(tids), step)
                return forming.form
        if deadline is not None and now >= deadline:
            self._forming = None
            raise TimedOut(f"the batches to train again after resuming from step {position.resumed_from} are not all "
                           f"back within the timeout (steps {position.replayed_steps()})")
        return Wait(deadline)

    def formed(self, violations: Sequence[Violation]) -> HandOut | Refill:
        """The verdict on the batch of the last `Form`: the violations its
        check found (`sample`: a position in the form's deliveries). None:
        the trainer has it. Otherwise, under `on_invalid="quarantine"`, the
        failing trajectories go to their brokers' dead letters with their
        violations and the rest of their units stay for a refill (a group
        keeps its valid members); under "raise", and always for a batch
        handed back by a resume, the whole batch goes back and
        `BatchValidationError` names every violation.

        Caller: the trainer's thread, after packing and checking the form.
        Affects: the batches awaiting commit; rejected or released
        trajectories and their settlements (`Assembler`)."""
        self._check_open()
        forming = self._forming
        if forming is None or forming.form is None:
            raise InvalidState("no batch awaits a verdict: `take` hands out a `Form` first")
        deliveries = forming.form.deliveries
        if not violations:
            self._forming = None
            self._awaiting[forming.seq] = self._handed(deliveries, forming.form.replayed_step)
            return HandOut(forming.seq)
        if forming.form.replayed_step is not None or self.on_invalid == "raise":
            self.abandon()
            raise BatchValidationError(violations, [d.trajectory_id for d in deliveries])
        reasons: dict[str, list[str]] = {}
        for v in violations:
            tid = deliveries[v.sample].trajectory_id
            reasons.setdefault(tid, []).append(v.describe(tid))
        log.warning("quarantined invalid trajectories", extra={"trajectory_ids": sorted(reasons)})
        self.assembler.reject({tid: "; ".join(lines) for tid, lines in reasons.items()})
        # The whole candidate set is formed and checked again (the whole-batch rule spans it).
        refilled = (replace(u, members={t: d for t, d in u.members.items() if t not in reasons}) for u in forming.units)
        forming.units = [u for u in refilled if u.members]
        forming.form = None
        return Refill(tuple(sorted(reasons)))

    def _handed(self, deliveries: list[Delivery], replayed_step: int | None) -> _Handed:
        tids = tuple(d.trajectory_id for d in deliveries)
        if self.position is None:  # deleting on commit: no manifest to record
            return _Handed(tids, replayed_step)
        return _Handed(tids, replayed_step, tuple(d.fields.get("sample_index") for d in deliveries),
                       tuple(d.fields.get("group_id") for d in deliveries),
                       sum(a.nbytes for d in deliveries for a in d.arrays.values()))

    def abandon(self) -> None:
        """The batch being formed will not be handed out (its packing
        failed, or the trainer's wait was interrupted): what it held goes
        back, new units released to their brokers, a batch handed back by a
        resume kept to be the next again. Nothing when no batch is formed.

        Caller: the trainer's thread.
        Affects: the batch being formed; released or kept trajectories
        (`Assembler`, `TrainingPosition`)."""
        forming, self._forming = self._forming, None
        if forming is None or self.closing:  # closing released everything
            return
        if forming.form is not None and forming.form.replayed_step is not None:
            self._give_back(forming.form.replayed_step, [d.trajectory_id for d in forming.form.deliveries])
        elif forming.units:
            self.assembler.release([tid for unit in forming.units for tid in unit.members])

    def _give_back(self, step: int, trajectory_ids: list[str]) -> None:
        """A replayed batch not trained: it is the next to hand out again."""
        assert self.position is not None  # only a checkpointing consumer replays
        self.assembler.give_back_replayed(trajectory_ids)
        self.position.handed(step, back=True)

    # -- the trainer's answers ------------------------------------------------------------
    def commit_step(self, seq: int, step: int | None = None) -> int | None:
        """The step a commit of batch `seq` records (None: it deletes on
        commit): a replayed batch's own, else `step`, else the next; raises
        what refuses the commit. Changes nothing (a shell that writes a
        ledger asks first, so its record precedes the acks).

        Caller: the trainer's thread.
        Affects: nothing."""
        if self.position is None and step is not None:
            raise InvalidInput("commit takes a step only when checkpointed (checkpointed=True)")
        handed = self._awaiting_commit(seq)
        return None if self.position is None else self.position.commit_step(step, handed.replayed_step)

    def commit(self, seq: int, step: int | None = None) -> int | None:
        """The trainer trained batch `seq`: checkpointing, it is recorded as
        the batch of its step (`commit_step`), kept by its brokers until
        sealed; otherwise they delete it. Every lease of it is acked. Returns
        the step.

        Caller: the trainer's thread.
        Affects: the batches awaiting commit; the manifest and last step
        (`TrainingPosition`); the dedup memory and the acks to send
        (`Assembler`)."""
        step = self.commit_step(seq, step)
        handed = self._awaiting.pop(seq)
        if self.position is not None:
            assert step is not None  # `commit_step` chose it
            warning = self.position.committed(TrainedBatch(step, handed.trajectory_ids, handed.sample_indices,
                                                           handed.group_ids, handed.nbytes))
            if (warning := warning or self.position.nearing_budget()) is not None:
                log.warning(warning)
        self.assembler.commit(handed.trajectory_ids, step)
        return step

    def release(self, seq: int) -> None:
        """Give the uncommitted batch `seq` back for redelivery (a batch
        handed back by a resume is the next one again).

        Caller: the trainer's thread.
        Affects: the batches awaiting commit; the nacks to send
        (`Assembler`); replayed steps with the trainer (`TrainingPosition`)."""
        handed = self._awaiting_commit(seq)
        del self._awaiting[seq]
        if handed.replayed_step is not None:
            self._give_back(handed.replayed_step, list(handed.trajectory_ids))
        else:
            self.assembler.release(handed.trajectory_ids)

    def _awaiting_commit(self, seq: int) -> _Handed:
        if self.closing:  # (another thread closed it while the trainer held the batch)
            raise ConsumerClosed(f"the consumer is closed: batch seq={seq} went back to its brokers for redelivery "
                                 "when it closed")
        handed = self._awaiting.get(seq)
        if handed is None:
            raise InvalidInput(f"batch seq={seq} is not awaiting commit here (already committed or released, or from "
                               "another consumer)")
        return handed

    def seal(self, step: int) -> None:
        """The checkpoint saved after `step` is durable: every broker is
        told (after the acks queued before it) and may reclaim what was
        trained up to it.

        Caller: the trainer's thread.
        Affects: the sealed step and seals awaiting answers
        (`TrainingPosition`); the outbox (`Assembler`)."""
        position = self.require_position("sealed")
        if self.closing:
            raise ConsumerClosed(f"the consumer is closed: the seal of step {step} was not sent (a resume from that "
                                 "checkpoint seals through it)")
        seals = position.seal(step, len(self.endpoints), self.assembler.unanswered_acks())
        self.assembler.outbox += [Outgoing(broker, kind, fields) for broker, kind, fields in seals]

    def state_dict(self) -> dict:
        """The data position to save with the model's checkpoint (plain
        lists, numbers and strings).

        Caller: the trainer's thread.
        Affects: the manifest drops the sealed batches whose acks were all
        answered (`TrainingPosition.confirmed`)."""
        position = self.require_position("state_dict")
        position.confirmed(self.assembler.unanswered_acks())
        return position.state_dict()

    def publish(self, version: int) -> None:
        """The trainer's policy version now, for every broker, with this
        consumer's `max_staleness` and a step's size (in groups, known once a
        group was delivered; until then brokers admit freely).

        Caller: the trainer's thread.
        Affects: the policy `due` sends and the admission shares (`Sessions`)."""
        if type(version) is not int or version < 0:
            raise InvalidInput(f"a policy version is an integer >= 0 (a trainer step), got {version!r}")
        assembler = self.assembler
        group_size = 1 if assembler.unit == CreditUnit.TRAJECTORY else assembler.group_size
        self.sessions.publish(version, None if group_size is None else assembler.batch_size * group_size)

    def shard_over(self, world_size: int) -> None:
        """The size of the data-parallel group the batches are sharded over,
        which `state_dict` records; refused when given at construction, or
        set by an earlier group, as another.

        Caller: the trainer's thread.
        Affects: `world_size` (and the position's)."""
        if self._world_size_fixed and world_size != self.world_size:
            raise InvalidInput(f"the source's Consumer(world_size=...), or the group it was first sharded over, must "
                               f"have the group's world size {world_size}, got {self.world_size}")
        self._fix_world_size(world_size)

    def _fix_world_size(self, world_size: int) -> None:
        if type(world_size) is not int or world_size < 1:
            raise InvalidInput(f"world_size is an integer >= 1 (data-parallel ranks), got {world_size!r}")
        position = self.position
        if (position is not None and position.resumed_from is not None and not self._world_size_fixed
                and position.saved_world_size != world_size):
            log.warning("resumed at another world size: replayed batches are sharded again at the new one",
                        extra={"saved": position.saved_world_size, "now": world_size})
        self.world_size, self._world_size_fixed = world_size, True
        if position is not None:
            position.world_size = world_size

    def close(self) -> None:
        """Stop: every uncommitted trajectory goes back to its broker (the
        batches the trainer holds included), and from now on nothing is
        handed out, committed or sealed; `due` sends no hello or credit.

        Caller: any thread (the trainer's, or a stop handler's).
        Affects: `closing`; the batch being formed and those awaiting
        commit; everything buffered or held, released (`Assembler`)."""
        self.closing = True
        self._forming = None
        self._awaiting.clear()
        self.assembler.release()

    def _check_open(self) -> None:
        if self.closing:
            raise ConsumerClosed("the consumer is closed")

    # -- what the shell reads ---------------------------------------------------------
    def require_position(self, what: str) -> TrainingPosition:
        """The position of a checkpointing consumer; `InvalidState` naming `what` needs one otherwise."""
        if self.position is None:
            raise InvalidState(f"{what} needs a checkpointing consumer (checkpointed=True); this one deletes on commit")
        return self.position

    @property
    def checkpointed(self) -> bool:
        """Whether commits record batches as trained until sealed (else they delete)."""
        return self.position is not None

    @property
    def resumed_from(self) -> int | None:
        """The step of the checkpoint this consumer resumed from, if any."""
        return None if self.position is None else self.position.resumed_from

    @property
    def epoch(self) -> int:
        """The lineage epoch of the weights this trainer makes (0 until a resume)."""
        return 0 if self.position is None else self.position.epoch

    @property
    def pending(self) -> bool:
        """Whether messages wait in the outbox for the next `due` (the shell
        wakes its I/O thread for them)."""
        return bool(self.assembler.outbox)

    @property
    def silent_brokers(self) -> list[int]:
        """The brokers (by index) that have not welcomed the current session."""
        return self.assembler.silent_brokers

    @property
    def unsettled(self) -> int:
        """Settlements sent and not yet answered."""
        return self.assembler.unsettled

    @property
    def unsealed(self) -> int:
        """Seals sent and not yet answered."""
        return 0 if self.position is None else self.position.unsealed

    def stats(self) -> dict[str, int]:
        """The counters (`Assembler.stats`) and, now, `complete` units
        buffered (also as `ready`, their older name, kept for one version),
        `held` by the trainer and `unsettled` settlements."""
        assembler = self.assembler
        stats = dict(vars(assembler.stats))
        stats.update(complete=assembler.complete, ready=assembler.complete, held=assembler.held,
                     unsettled=assembler.unsettled)
        return stats
