"""The consumer client: the I/O shell around `Assembler`.

One background thread owns every socket (a DEALER per broker plus an inproc
wake-up pair) and runs one poll loop: it reads replies and deliveries, says
hello again when a broker has forgotten us, grants credit, resends
settlements, and sends heartbeats. The thread exists because heartbeats must
keep flowing while the trainer computes: a training step easily outlasts
three heartbeat intervals, after which the broker would call the consumer
dead and hand its leases to someone else. Polling inside `next()` cannot do
that. The thread never touches torch: the calling thread builds, validates
(on CUDA on a stream of its own, `UploadStream`) and returns batches, and its
`commit`/`release` only queue settlements in the shared, lock-guarded
`Assembler` and wake the loop.
"""
from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
from dataclasses import dataclass, replace
from dataclasses import fields as dataclass_fields
from typing import Any, Callable, Mapping, Sequence

import zmq

from rollstream.common.checker import Ledger
from rollstream.common.clock import Clock
from rollstream.common.codec import decode, decode_header, encode
from rollstream.common.contract import DEFAULT_MAX_MESSAGE_BYTES, CreditUnit
from rollstream.common.curve import ClientCurve, HandshakeWatch
from rollstream.common.errors import (
    ClientClosed,
    ClientFailed,
    InvalidInput,
    InvalidState,
    Refused,
    RemoteProtocolError,
    RollstreamError,
    TimedOut,
)
from rollstream.common.failures import internal_error, log_internal
from rollstream.common.jobs import DEFAULT_JOB, check_job
from rollstream.common.messages import BROKER_TO_CONSUMER, CONSUMER_TO_BROKER
from rollstream.common.sockets import context_for, dealer, recv_parts
from rollstream.common.versions import version_label

from .assembly import POLICIES, Assembler, Outgoing, Unit
from .batch import Batch, as_device
from .position import TrainedBatch, TrainingPosition
from .session import Sessions
from .stream import UploadStream
from .validate import checked_batch, violation_error

log = logging.getLogger("rollstream.consumer")
MONITOR_SWEEP_EVERY = 1.0  # seconds between reads of the handshake monitors once every broker has welcomed us


class ConsumerClosed(ClientClosed):
    """The consumer was closed; no more batches."""


@dataclass(frozen=True)
class _Handed:
    """A batch handed to the trainer and not yet committed."""

    trajectory_ids: tuple[str, ...]
    sample_indices: tuple[int | None, ...]
    group_ids: tuple[str | None, ...]
    replayed_step: int | None  # a batch handed back by a resume: the step it must be trained at again
    nbytes: int  # of its deliveries' arrays


class Consumer:
    """Pulls batches from one or many brokers (fan-in), validates them, and
    acks what the trainer commits.

    >>> with Consumer(["tcp://node0:5556", "tcp://node1:5556"], batch_size=64, vocab_size=151936) as consumer:
    ...     for batch in consumer:
    ...         train_step(batch)
    ...         consumer.commit(batch)

    `unit="group"` makes batches of `batch_size` whole groups (and grants
    group credit); `prefetch` bounds the units buffered or promised by credit
    (by default `max(2 * batch_size, batch_size + brokers)`; as low as
    `batch_size + 1` when every broker sends queued counts, as this
    version's do).
    `batch_tokens` closes a batch before the unit that would take it past
    that many prompt + response tokens (units are never split; one over the
    budget comes alone, `Batch.over_budget`); with `batch_size` too, at
    whichever limit comes first. Alone, it caps batches at
    `min(batch_tokens, TOKEN_BATCH_UNITS)` (256) units, which also sizes the
    prefetch.
    `on_invalid="quarantine"` sends failing trajectories to the broker's dead
    letters with the reason and refills the batch; `"raise"` gives the whole
    batch back for redelivery and raises `BatchValidationError`.
    A batch not committed within the brokers' `lease_timeout` of its delivery
    is redelivered (at-least-once), so the lease timeout must cover the wait
    in the prefetch buffer plus a training step; redeliveries are
    deduplicated by trajectory id (the last `dedup_capacity` settled ids are
    remembered, and a late redelivery of one is settled at once). Units whose
    leases ran out while still buffered are dropped, not trained.

    `filter`: a predicate only the trainer can judge, called once per unit
    as it completes with its members' `deliver` fields (`trajectory_id`,
    `reward`, `metadata`, `response_length`, `weight_versions`, ...); a unit
    it returns False for is dead-lettered `filtered:consumer` at its broker
    and never handed out (`stats()["filtered"]`). The brokers' own group
    filters run before delivery and cost no transfer.

    Staleness: `set_policy_version(v)` (or `commit(..., policy_version=v)`)
    publishes the trainer's version to every broker; with a bound (this
    consumer's `max_staleness`, or a broker's) brokers admit and deliver
    only what fits it, and a prefetched unit more than the bound behind `v`
    when a batch is formed is dead-lettered `stale`, not handed out
    (docs/consumer.md, "Staleness").

    Checkpointing (the default): `commit(batch)` records the batch as
    trained at its step, and brokers keep it until `sealed(step)` says a
    checkpoint after it is durable. Save `state_dict()` with each
    checkpoint; `Consumer(..., resume=state)` then hands back first what was
    trained after that checkpoint, batch by batch, then new data
    (docs/consumer.md). `checkpointed=False` deletes on commit instead:
    at-least-once across trainer restarts.

    `world_size`: the data-parallel ranks its batches are sharded to,
    recorded in `state_dict()`. Leave it out: a `DistributedConsumer` over
    this consumer sets its group's size (`shard_over`), and a consumer
    used alone is 1.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        batch_size: int | None = None,
        batch_tokens: int | None = None,
        unit: str = "trajectory",
        prefetch: int | None = None,
        device=None,
        vocab_size: int | None = None,
        on_invalid: str = "raise",
        reward_key: str | None = None,
        consumer_id: str | None = None,
        dedup_capacity: int = 100_000,
        hello_timeout: float = 5.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        ledger: str | os.PathLike | None = None,
        curve_secret_key: str | os.PathLike | None = None,
        curve_server_key: str | os.PathLike | None = None,
        context: zmq.Context | None = None,
        checkpointed: bool = True,
        keep_checkpoints: int = 2,
        resume: dict | None = None,
        world_size: int | None = None,
        job: str = DEFAULT_JOB,
        max_staleness: int | None = None,
        filter: Callable[[list[Mapping[str, Any]]], bool] | None = None,
    ):
        if on_invalid not in POLICIES:
            raise InvalidInput(f"on_invalid must be one of {POLICIES}, got {on_invalid!r}")
        if resume is not None and not checkpointed:
            raise InvalidInput("resume needs checkpointed=True: a consumer that deletes on commit keeps no position")
        self.job = check_job(job)  # brokers hand it this job's trajectories only (`rollstream.common.jobs`)
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise InvalidInput(f"give at least one broker endpoint, got {endpoints!r}")
        self.device = as_device(device)
        self._upload = UploadStream(self.device)  # batches are built and checked beside the trainer's step
        self.vocab_size = vocab_size
        self.on_invalid = on_invalid
        self.reward_key = reward_key
        self.consumer_id = consumer_id or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.max_message_bytes = max_message_bytes
        # Over CURVE: this consumer's key pair and the brokers' public key (brokers of one job share it).
        self._curve = ClientCurve.from_files(curve_secret_key, curve_server_key)
        # What the trainer was handed and committed, for the end-to-end checker (`rollstream.common.checker`):
        self.ledger = None if ledger is None else Ledger(ledger)
        self._assembler = Assembler(len(self.endpoints), batch_size=batch_size, batch_tokens=batch_tokens, unit=unit,
                                    prefetch=prefetch, dedup_capacity=dedup_capacity, keep=filter)
        self.batch_size = self._assembler.batch_size  # given, or the unit cap of a `batch_tokens` batch
        self.batch_tokens = batch_tokens
        # The data-parallel ranks its batches are sharded to: 1 until a `DistributedConsumer` sets its group's size
        # (`shard_over`), unless given here.
        self.world_size = 1 if world_size is None else world_size
        self._world_size_fixed = False
        self._position = (TrainingPosition(keep_checkpoints=keep_checkpoints, world_size=self.world_size, resume=resume,
                                           job=job) if checkpointed else None)
        if world_size is not None:
            self._fix_world_size(world_size)
        self._sessions = Sessions(self._assembler, self.endpoints, consumer_id=self.consumer_id,
                                  hello_timeout=hello_timeout, position=self._position, job=job)  # the I/O thread drives it
        if max_staleness is not None and (type(max_staleness) is not int or max_staleness < 0):
            raise InvalidInput(f"max_staleness is an integer >= 0 (policy versions), got {max_staleness!r}")
        self._sessions.max_staleness = max_staleness  # the trainer's own bound: lowers its brokers'
        if self._position is not None and self._position.resumed_from is not None:
            # The weights resumed are the checkpoint's, in a new lineage epoch: brokers learn both at once.
            self._sessions.publish(self._position.resumed_from)
            if self.ledger is not None:
                self._position.record_resume(self.ledger)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # A DEALER and a handshake monitor's pair per broker, and the wake-up pair: past zmq's default limit at a
        # few hundred brokers, when the consumer makes a context of its own.
        sockets = 3 * len(self.endpoints) + 2
        self._context, self._own_context = ((context, False) if context is not None
                                            else context_for(sockets, descriptors=2 * sockets + 64))
        self._seq = itertools.count()
        self._awaiting_commit: dict[int, _Handed] = {}
        self._closing = False
        self._stopping = False
        self._error: BaseException | None = None
        wake_address = f"inproc://rollstream-consumer-{id(self)}-{os.urandom(4).hex()}"
        self._wake_in = self._context.socket(zmq.PAIR)
        self._wake_in.bind(wake_address)
        self._wake_out = self._context.socket(zmq.PAIR)
        self._wake_out.connect(wake_address)
        # Each broker socket's handshakes (made by the I/O thread): a refused one is logged and named by
        # `wait_ready`, not left to look like a silent broker.
        self._watches: list[HandshakeWatch] = []
        self._thread = threading.Thread(target=self._run, name=f"rollstream-consumer-{self.consumer_id}", daemon=True)
        self._thread.start()

    # -- the trainer's side ---------------------------------------------------
    def __iter__(self) -> "Consumer":
        return self

    def __next__(self) -> Batch:
        try:
            return self.next_batch()
        except ConsumerClosed:
            raise StopIteration from None

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def next_batch(self, timeout: float | None = None, *, partial_after: float | None = None) -> Batch:
        """The next validated batch; blocks up to `timeout` seconds
        (`TimedOut`, a `TimeoutError`), raises `ConsumerClosed` once closed. With
        `partial_after`, a batch of the units ready once that many seconds
        passed without a full batch (the tail of a run): smaller, never empty."""
        now = Clock.monotonic()
        deadline = None if timeout is None else now + timeout
        partial_at = None if partial_after is None else now + partial_after
        seq = next(self._seq)
        if self._position is not None:
            replayed = self._take_replayed(deadline)
            if replayed is not None:
                return self._hand(seq, *replayed)
        units: list[Unit] = []
        while True:
            units += self._take(self.batch_size - len(units), deadline, units, partial_at)
            deliveries = [d for unit in units for d in unit.members.values()]
            try:
                batch, violations = self._checked(deliveries, seq)
                if violations and self.on_invalid == "raise":
                    raise violation_error(violations, deliveries)
            except BaseException:  # nothing stays taken without a batch to commit
                self._settle(release=[d.trajectory_id for d in deliveries])
                raise
            if not violations:
                break
            reasons: dict[str, list[str]] = {}
            for v in violations:
                tid = deliveries[v.sample].trajectory_id
                reasons.setdefault(tid, []).append(v.describe(tid))
            log.warning("quarantined invalid trajectories", extra={"trajectory_ids": sorted(reasons)})
            self._settle(reject={tid: "; ".join(lines) for tid, lines in reasons.items()})
            # Refill: the rest of each unit stays (a group keeps its valid members),
            # and the whole candidate set is checked again (the whole-batch rule spans it).
            units = [replace(u, members={t: d for t, d in u.members.items() if t not in reasons}) for u in units]
            units = [u for u in units if u.members]
        return self._handing(batch, deliveries, None)

    def _checked(self, deliveries: list, seq: int) -> tuple[Batch, list]:
        """The batch of `deliveries` and its violations (`checked_batch`),
        built and checked on the consumer's upload stream."""
        with self._upload.side():
            batch, violations, _ = checked_batch(deliveries, device=self.device, seq=seq, vocab_size=self.vocab_size,
                                                 reward_key=self.reward_key)
        return batch, violations

    def _hand(self, seq: int, step: int, deliveries: list) -> Batch:
        """A batch handed back by a resume, as it was: it must validate whole."""
        try:
            batch, violations = self._checked(deliveries, seq)
            if violations:
                raise violation_error(violations, deliveries)
        except BaseException:
            self._give_back(step, [d.trajectory_id for d in deliveries])
            raise
        return self._handing(batch, deliveries, step)

    def _give_back(self, step: int, trajectory_ids: list[str]) -> None:
        """A replayed batch not trained: it is the next to hand out again."""
        assert self._position is not None  # only a checkpointing consumer replays
        with self._lock:
            self._assembler.give_back_replayed(trajectory_ids)
            self._position.handed(step, back=True)

    def _handing(self, batch: Batch, deliveries: list, replayed_step: int | None) -> Batch:
        batch = self._upload.hand_over(batch)
        if self.batch_tokens is not None:  # the budget `Batch.over_budget` compares with
            batch = replace(batch, token_budget=self.batch_tokens)
        by_id = {d.trajectory_id: d.fields for d in deliveries}
        handed = _Handed(batch.trajectory_ids, tuple(by_id[t].get("sample_index") for t in batch.trajectory_ids),
                         batch.group_ids, replayed_step,
                         sum(a.nbytes for d in deliveries for a in d.arrays.values()))
        with self._lock:
            self._awaiting_commit[batch.seq] = handed
        if self.ledger is not None:
            batch.record(self.ledger, "handed", consumer=self.consumer_id)
        return batch

    def _take_replayed(self, deadline: float | None) -> tuple[int, list] | None:
        """After a resume: the next batch handed back (its step and
        deliveries in their order), once every broker has answered and all
        of it is here; None when nothing is left to train again."""
        position, n = self._position, len(self.endpoints)
        assert position is not None
        with self._changed:
            while True:
                self._check_open()
                if position.failure is not None:  # a broker cannot resume: its batches were reclaimed
                    code, message = position.failure
                    raise Refused(code, f"cannot resume from step {position.resumed_from}: {message}")
                if not position.waiting_for_resume(n):
                    replay = position.next_replay()
                    if replay is None:
                        return None
                    step, tids = replay
                    if self._assembler.replayed(tids):
                        position.handed(step)
                        return step, self._assembler.take_replayed(tids)
                remaining = None if deadline is None else deadline - Clock.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimedOut(f"the batches to train again after resuming from step {position.resumed_from} are "
                                   f"not all back within the timeout (steps {position.replayed_steps()})")
                self._changed.wait(1.0 if remaining is None else min(remaining, 1.0))

    def _check_open(self) -> None:
        """Raise what ends a wait for batches: the I/O thread's failure, or closing."""
        if self._error is not None:
            raise ClientFailed(f"consumer {self.consumer_id!r}", self._error) from self._error
        if self._closing:
            raise ConsumerClosed("the consumer is closed")

    def _take(self, n: int, deadline: float | None, held: list[Unit], partial_at: float | None) -> list[Unit]:
        """`n` more complete units, or after `partial_at` whatever is ready
        (when that and `held` make at least one); on timeout the `held`
        ones go back too."""
        with self._changed:
            while True:
                self._check_open()
                now = Clock.monotonic()
                # A trainer that stalled past a lease must not get that unit: the broker redelivers it.
                self._assembler.drop_expired(now)
                below = self._sessions.stale_below()
                if below is not None and self._assembler.drop_stale(below):  # prefetched units age too
                    self._wake()
                ready = self._assembler.ready
                if self._assembler.fills(n, held) or (partial_at is not None and now >= partial_at and (ready or held)):
                    return self._assembler.take(n, held)
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    self._assembler.release([tid for unit in held for tid in unit.members])
                    self._wake()
                    budget = "" if self.batch_tokens is None else f" (or {self.batch_tokens} tokens)"
                    raise TimedOut(f"no full batch within the timeout: {ready} of {n} units{budget} ready")
                waits = [1.0 if remaining is None else remaining]
                if partial_at is not None and partial_at > now:
                    waits.append(partial_at - now)
                self._changed.wait(min(waits))

    def set_policy_version(self, version: int) -> None:
        """The trainer's policy version now (its step, as the weights it
        serves carry it): published to every broker, with this consumer's
        `max_staleness` and a step's size, so they bound staleness at
        admission and delivery; batches handed out from now on hold nothing
        more than the bound behind it."""
        if type(version) is not int or version < 0:
            raise InvalidInput(f"a policy version is an integer >= 0 (a trainer step), got {version!r}")
        with self._lock:
            assembler = self._assembler
            # A step's trajectories: in groups, known once a group was delivered (until then brokers admit freely).
            group_size = 1 if assembler.unit == CreditUnit.TRAJECTORY else assembler.group_size
            self._sessions.publish(version, None if group_size is None else assembler.batch_size * group_size)
            self._wake()

    def version_label(self, step: int) -> str:
        """The `weight_version` to serve the weights this trainer made at
        `step` under: `12`, or after a resume `e1:12`, which names the
        lineage epoch so brokers tell them from what weights of an abandoned
        lineage sampled (docs/consumer.md, "Lineage")."""
        return version_label(step, 0 if self._position is None else self._position.epoch)

    def commit(self, batch: Batch, step: int | None = None, *, policy_version: int | None = None) -> None:
        """After the training step: the batch is trained. Checkpointing, it
        is recorded as the batch of `step` (by default the step after the
        last; a batch handed back by a resume keeps its own) and kept until
        sealed; otherwise it is deleted. `policy_version`: then
        `set_policy_version` (the weights the step made)."""
        position = self._position
        with self._lock:
            handed = self._awaiting_commit.get(batch.seq)
            if handed is not None and position is not None:
                step = position.commit_step(step, handed.replayed_step)
            elif step is not None and position is None:
                raise InvalidInput("commit takes a step only when checkpointed (checkpointed=True)")
        handed = self._claim(batch)
        if self.ledger is not None:
            lineage = {} if position is None else {"run": position.run, "lineage": position.lineage, "step": step}
            batch.record(self.ledger, "committed", consumer=self.consumer_id, **lineage)
        with self._lock:
            warning = None
            if position is not None:
                assert step is not None  # `commit_step` chose it
                warning = position.committed(TrainedBatch(step, handed.trajectory_ids, handed.sample_indices,
                                                          handed.group_ids, handed.nbytes)) or position.nearing_budget()
            self._assembler.commit(handed.trajectory_ids, step)
            self._wake()
        if warning is not None:
            log.warning(warning)
        if policy_version is not None:
            self.set_policy_version(policy_version)

    def sealed(self, step: int) -> None:
        """The checkpoint saved after step `step` is durable: brokers may
        reclaim what was trained up to it (keeping `keep_checkpoints`
        checkpoints to fall back on). `flush` waits for their answers."""
        position = self._require_position("sealed")
        with self._lock:
            if self._closing:
                raise ConsumerClosed(f"the consumer is closed: the seal of step {step} was not sent (a resume from "
                                     "that checkpoint seals through it)")
            for broker, kind, fields in position.seal(step, len(self.endpoints), self._assembler.unanswered_acks()):
                self._assembler.outbox.append(Outgoing(broker, kind, fields))
            self._wake()
        if self.ledger is not None:
            self.ledger.write("sealed", run=position.run, lineage=position.lineage, step=step)

    def state_dict(self) -> dict:
        """The data position to save with the model's checkpoint: plain
        lists, numbers and strings (`Consumer(..., resume=state)`)."""
        position = self._require_position("state_dict")
        with self._lock:
            position.confirmed(self._assembler.unanswered_acks())
            return position.state_dict()

    def shard_over(self, world_size: int) -> None:
        """The size of the data-parallel group a `DistributedConsumer`
        shards this consumer's batches over, which `state_dict()` records.
        Refused when the constructor's `world_size`, or an earlier group, set
        another."""
        if self._world_size_fixed and world_size != self.world_size:
            raise InvalidInput(f"the source's Consumer(world_size=...), or the group it was first sharded over, must "
                               f"have the group's world size {world_size}, got {self.world_size}")
        self._fix_world_size(world_size)

    def _fix_world_size(self, world_size: int) -> None:
        if type(world_size) is not int or world_size < 1:
            raise InvalidInput(f"world_size is an integer >= 1 (data-parallel ranks), got {world_size!r}")
        position = self._position
        if (position is not None and position.resumed_from is not None and not self._world_size_fixed
                and position.saved_world_size != world_size):
            log.warning("resumed at another world size: replayed batches are sharded again at the new one",
                        extra={"saved": position.saved_world_size, "now": world_size})
        self.world_size, self._world_size_fixed = world_size, True
        if position is not None:
            position.world_size = world_size

    @property
    def checkpointed(self) -> bool:
        """Whether commits record batches as trained until sealed (else they delete)."""
        return self._position is not None

    @property
    def position(self) -> TrainingPosition:
        """Where this checkpointing consumer stands: run, lineage, last step."""
        return self._require_position("position")

    @property
    def resumed_from(self) -> int | None:
        """The step of the checkpoint this consumer resumed from, if any."""
        return None if self._position is None else self._position.resumed_from

    def _require_position(self, what: str) -> TrainingPosition:
        if self._position is None:
            raise InvalidState(f"{what} needs a checkpointing consumer (checkpointed=True); this one deletes on commit")
        return self._position

    def release(self, batch: Batch) -> None:
        """Give an uncommitted batch back for redelivery: it will not be
        trained on (a batch handed back by a resume is the next one again)."""
        handed = self._claim(batch)
        if handed.replayed_step is not None:
            self._give_back(handed.replayed_step, list(handed.trajectory_ids))
        else:
            self._settle(release=handed.trajectory_ids)

    def _claim(self, batch: Batch) -> _Handed:
        with self._lock:
            if self._closing:  # (another thread closed it while the trainer held the batch)
                raise ConsumerClosed(f"the consumer is closed: batch seq={batch.seq} went back to its brokers "
                                     "for redelivery when it closed")
            handed = self._awaiting_commit.pop(batch.seq, None)
        if handed is None:
            raise InvalidInput(f"batch seq={batch.seq} is not awaiting commit here (already committed or released, "
                               "or from another consumer)")
        return handed

    def _settle(self, *, reject=None, release=()) -> None:
        with self._lock:
            self._assembler.reject(reject or {})
            if release:
                self._assembler.release(release)
            self._wake()

    def stats(self) -> dict[str, int]:
        """The client's counters (the `Assembler`'s `stats`, listed in
        docs/consumer.md) and, at the moment of the call, `ready` units
        buffered, `held` by the trainer and `unsettled` settlements
        awaiting their broker's answer."""
        with self._lock:
            stats = self._assembler.stats
            out = {f.name: getattr(stats, f.name) for f in dataclass_fields(stats)}
            out.update(ready=self._assembler.ready, held=self._assembler.held, unsettled=self._assembler.unsettled)
        return out

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every broker has welcomed this consumer (credit is
        then on its way); `TimedOut` (a `TimeoutError`) naming those still
        silent."""
        def describe() -> str:
            silent = self._assembler.silent_brokers
            failures = [watch.failure for i, watch in enumerate(self._watches) if i in silent and watch.failure]
            return (f"no welcome within {timeout} s from {[self.endpoints[i] for i in silent]}"
                    + "".join(f"; {failure}" for failure in failures))

        self._wait_until(lambda: not self._assembler.silent_brokers, timeout, describe)

    def flush(self, timeout: float | None = None) -> None:
        """Block until the brokers have confirmed every commit, release and
        seal made so far (each is then durable at its broker); `TimedOut` (a
        `TimeoutError`) saying how many are unconfirmed."""
        position = self._position
        seals = (lambda: 0) if position is None else (lambda: position.unsealed)
        self._wait_until(lambda: not self._assembler.unsettled and not seals(), timeout,
                         lambda: f"{self._assembler.unsettled} settlement(s) and {seals()} seal(s) unconfirmed "
                                 f"after {timeout} s")

    def _wait_until(self, done, timeout: float | None, describe) -> None:
        deadline = None if timeout is None else Clock.monotonic() + timeout
        with self._changed:
            while not done():
                if self._error is not None:
                    raise ClientFailed(f"consumer {self.consumer_id!r}", self._error) from self._error
                if self._stopping:
                    raise ConsumerClosed("the consumer is closed")
                remaining = None if deadline is None else deadline - Clock.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimedOut(describe())
                self._changed.wait(1.0 if remaining is None else min(remaining, 1.0))

    def close(self, timeout: float = 5.0) -> None:
        """Give back every uncommitted trajectory, wait up to `timeout` for
        the brokers to confirm pending settlements, then stop."""
        with self._changed:
            if self._stopping:
                return
            self._closing = True
            self._awaiting_commit.clear()
            self._assembler.release()
            self._wake()
            deadline = Clock.monotonic() + timeout
            while self._assembler.unsettled and self._error is None:
                remaining = deadline - Clock.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            self._stopping = True
            self._interrupt()  # the loop sees `_stopping` and ends
        self._thread.join(timeout)
        self._wake_out.close(linger=0)
        if self._own_context and not self._thread.is_alive():
            self._context.term()
        if self.ledger is not None:
            self.ledger.close()

    # -- the I/O thread -------------------------------------------------------
    def _wake(self) -> None:
        """Interrupt the poll loop (caller holds the lock, which serialises this
        socket; once stopping, the loop has ended and `close` closes it)."""
        if not self._stopping:
            self._interrupt()

    def _interrupt(self) -> None:
        try:
            self._wake_out.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # a wake-up is already pending
            pass

    def _run(self) -> None:
        watches = self._watches

        def secure(endpoint: str):
            def configure(sock: zmq.Socket) -> None:
                if self._curve is not None:
                    self._curve.apply(sock)
                watches.append(HandshakeWatch(sock, endpoint, self._curve))
            return configure

        socks = [dealer(self._context, endpoint, max_message_bytes=self.max_message_bytes, secure=secure(endpoint))
                 for endpoint in self.endpoints]
        index = {sock: i for i, sock in enumerate(socks)}
        poller = zmq.Poller()
        for sock in (*socks, self._wake_in):
            poller.register(sock, zmq.POLLIN)
        next_sweep = 0.0
        try:
            while True:
                events = dict(poller.poll(100))
                if events.get(self._wake_in):
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                now = Clock.monotonic()
                # The handshake monitors stay out of the poll (a poll over twice the sockets): read on every pass
                # while a broker has not welcomed us, else every `MONITOR_SWEEP_EVERY`.
                if now >= next_sweep or self._sessions.ready < len(socks):
                    next_sweep = now + MONITOR_SWEEP_EVERY
                    for watch in watches:
                        if (failure := watch.read()) is not None:
                            log.error(failure, extra={"endpoint": watch.report.endpoint})
                received = [(index[sock], frames) for sock in events if sock in index for frames in _drain(sock)]
                decoded = [(i, *self._decode(frames)) for i, frames in received]
                with self._changed:
                    if self._stopping:
                        break
                    for (broker, frames), (_, message, header, error) in zip(received, decoded):
                        try:
                            if message is None:
                                self._sessions.undecodable(broker, header, error)
                            else:
                                self._sessions.received(broker, message, now)
                        except RollstreamError:  # a rule this client enforces on purpose: surfaced to the trainer
                            raise
                        except Exception as exc:  # a failure no rule foresaw costs this message alone
                            fields = header if message is None else message.fields
                            self._sessions.failed_inside(broker, fields.get("type") if message is None else message.type,
                                                         fields, frames, exc)
                    outgoing = self._sessions.due(now, closing=self._closing)
                    self._changed.notify_all()
                for broker, mtype, fields in outgoing:
                    try:
                        socks[broker].send_multipart(encode(CONSUMER_TO_BROKER, mtype, fields), zmq.NOBLOCK)
                    except zmq.Again:  # the broker is not reading; heartbeats and resends try again
                        log.warning("message to broker not sent", extra={"endpoint": self.endpoints[broker], "type": mtype})
        except BaseException as exc:  # surfaced to the trainer by next_batch
            log.exception("consumer I/O thread failed")
            with self._changed:
                self._error = exc
                self._changed.notify_all()
        finally:
            for watch in watches:
                watch.close()
            for sock in socks:
                sock.close(linger=200)
            self._wake_in.close(linger=0)

    def _decode(self, frames: list) -> tuple:
        """`(message, header, error)`: the decoded message, or the raw header
        and the reason it could not be decoded."""
        try:
            return decode(frames, BROKER_TO_CONSUMER, max_message_bytes=self.max_message_bytes, check_content=False), None, None
        except Exception as exc:  # a failure no rule foresaw is refused like a broken rule, as `internal`
            try:
                header = decode_header(frames[0])
            except Exception:  # unreadable
                header = {}
            if isinstance(exc, RemoteProtocolError):
                return None, header, exc
            message_type = header.get("type") if isinstance(header.get("type"), str) else None
            log_internal(log, exc, "broker", message_type, frames)
            return None, header, internal_error(exc, message_type, frames)  # counted where it is refused


def _drain(sock: zmq.Socket):
    while True:
        try:
            yield recv_parts(sock)
        except zmq.Again:
            return
