"""The consumer side of the broker: credit, leases, liveness, redelivery.

Sans-I/O like the merge engine: the service passes consumer messages and the
time in, and gets back which trajectories to send to whom, which leases were
settled, and which trajectories ran out of deliveries. Delivery is
at-least-once: a lease not acked within `lease_timeout`, or held by a
consumer that went silent for three heartbeat intervals, is redelivered.
Each job has a queue of its own, and a consumer is handed only its job's
units (`rollstream.common.jobs`); within a job, units go out by their
policy version (oldest first by default) and in arrival order within one.
"""
from __future__ import annotations

import bisect
import itertools
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from rollstream.common.contract import LIVENESS_INTERVALS, CreditUnit
from rollstream.common.errors import NotFound
from rollstream.common.jobs import DEFAULT_JOB, job_of

from .engine import DeliveryUnit


@dataclass
class ConsumerState:
    """A consumer connection as the dispatcher keeps it: its credit and leases."""

    consumer_id: str
    last_seen: float
    trajectory_credit: int = 0
    group_credit: int = 0
    leases: set[str] = field(default_factory=set)
    run: str | None = None  # a checkpointing trainer's run (keyed in its job) and lineage (its hello named them)
    lineage: str | None = None
    job: str = DEFAULT_JOB
    told: int | None = None  # the queued count it was last told (None: its hello did not ask for counts)


@dataclass
class Lease:
    lease: str
    trajectory_id: str
    unit: DeliveryUnit
    identity: bytes
    expires_at: float
    credit: CreditUnit = CreditUnit.TRAJECTORY  # the kind of credit the delivery used
    replay: bool = False  # a trained trajectory handed back to a resumed trainer: never queued again


@dataclass(frozen=True)
class Dispatch:
    """Send `trajectory_id` to `identity` under `lease`."""

    identity: bytes
    lease: str
    trajectory_id: str
    unit: DeliveryUnit
    delivery_count: int
    replay: bool = False

    @property
    def extra_fields(self) -> dict:
        """Its `deliver` fields beyond the trajectory's own."""
        unit = self.unit
        if self.replay:
            return {"replay": True}
        if unit.group_id is None:
            return {"delivery_count": self.delivery_count}
        return {"delivery_count": self.delivery_count, "group_id": unit.group_id, "group_size": unit.group_size,
                "group_left": unit.group_left}


@dataclass
class DispatchSettings:
    lease_timeout: float = 60.0
    heartbeat_interval: float = 1.0
    max_deliveries: int = 10
    order: str = "oldest_first"  # or "freshest_first": which policy version goes out first


_UNVERSIONED = -1  # the bucket of units without an ordered version: oldest, never stale


class JobQueue:
    """One job's queued units in buckets by policy version, so that taking
    the oldest or freshest version and dropping every stale one cost what
    they move, not what is queued; arrival order within a bucket, units put
    back in front."""

    def __init__(self) -> None:
        self._buckets: dict[int, deque[DeliveryUnit]] = {}
        self._keys: list[int] = []  # sorted

    def put(self, unit: DeliveryUnit, front: bool = False) -> None:
        key = _UNVERSIONED if unit.version is None else unit.version
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = deque()
            bisect.insort(self._keys, key)
        (bucket.appendleft if front else bucket.append)(unit)

    def take(self, order: str) -> DeliveryUnit:
        key = self._keys[-1] if order == "freshest_first" else self._keys[0]
        bucket = self._buckets[key]
        unit = bucket.popleft()
        if not bucket:
            self._drop(key)
        return unit

    def take_below(self, version: int) -> list[DeliveryUnit]:
        """Every unit versioned below `version` (the stale ones); unversioned ones stay."""
        cut = bisect.bisect_left(self._keys, version)
        stale = [key for key in self._keys[:cut] if key != _UNVERSIONED]
        units = [unit for key in stale for unit in self._buckets[key]]
        for key in stale:
            self._drop(key)
        return units

    def versions(self) -> tuple[int, int] | None:
        """The oldest and freshest version queued, or None."""
        keys = [key for key in self._keys if key != _UNVERSIONED]
        return (keys[0], keys[-1]) if keys else None

    def _drop(self, key: int) -> None:
        del self._buckets[key]
        self._keys.remove(key)

    def __iter__(self) -> Iterator[DeliveryUnit]:
        for key in self._keys:
            yield from self._buckets[key]

    def __bool__(self) -> bool:
        return bool(self._keys)


class Dispatcher:
    def __init__(self, settings: DispatchSettings | None = None):
        self.settings = settings or DispatchSettings()
        self.consumers: dict[bytes, ConsumerState] = {}
        # Each job's units; changed only by `enqueue`, `_take` and `take_stale` (they keep the counts).
        self.queues: dict[str, JobQueue] = {}
        self.queued_trajectories = 0
        self._queued_by_job: dict[str, int] = {}  # trajectories in each job's queue
        self.leases: dict[str, Lease] = {}
        self.delivery_counts: dict[str, int] = {}
        self.redeliveries = 0
        self._epoch = os.urandom(4).hex()
        self._counter = itertools.count(1)
        self._rotation = 0  # round-robin start among consumers
        # Units that must not be handed out (the broker's judge, if any), taken from the queue into `set_aside`
        # for the broker to dead-letter.
        self.untrainable: Callable[[DeliveryUnit], bool] | None = None
        self.set_aside: list[DeliveryUnit] = []

    # -- queue ---------------------------------------------------------------
    def enqueue(self, unit: DeliveryUnit, front: bool = False) -> None:
        queue = self.queues.get(job := job_of(unit.trajectory_ids[0]))
        if queue is None:
            queue = self.queues[job] = JobQueue()
        queue.put(unit, front)
        self._count(job, len(unit.trajectory_ids))

    def _count(self, job: str, change: int) -> None:
        self.queued_trajectories += change
        left = self._queued_by_job.get(job, 0) + change
        if left:
            self._queued_by_job[job] = left
        else:
            self._queued_by_job.pop(job, None)

    def _take(self, job: str) -> DeliveryUnit | None:
        """`job`'s next unit to hand out; those `untrainable` judges go to
        `set_aside` on the way (None: the queue held no other)."""
        while (queue := self.queues.get(job)) is not None:
            unit = queue.take(self.settings.order)
            if not queue:
                del self.queues[job]
            self._count(job, -len(unit.trajectory_ids))
            if self.untrainable is None or not self.untrainable(unit):
                return unit
            self.set_aside.append(unit)
        return None

    def take_stale(self, job: str, below: int) -> list[DeliveryUnit]:
        """Take `job`'s queued units versioned below `below` out of the queue."""
        queue = self.queues.get(job)
        if queue is None:
            return []
        units = queue.take_below(below)
        if not queue:
            del self.queues[job]
        self._count(job, -sum(len(unit.trajectory_ids) for unit in units))
        return units

    def queued(self) -> dict[str, int]:
        """Trajectories queued, by job."""
        return dict(sorted(self._queued_by_job.items()))

    def queued_in(self, job: str) -> int:
        """Trajectories of `job` queued now."""
        return self._queued_by_job.get(job, 0)

    def tell(self, identity: bytes) -> int | None:
        """The queued count to tell connection `identity` now, remembered as
        told (None: it did not ask for counts)."""
        consumer = self.consumers[identity]
        if consumer.told is None:
            return None
        consumer.told = self.queued_in(consumer.job)
        return consumer.told

    def queued_news(self) -> list[tuple[bytes, int]]:
        """The connections that asked for counts and were last told their
        job's queue was empty when it holds some now, or the reverse, each
        with the count now (told from here on). Nothing more: a consumer
        learns the rest from its deliveries, so a busy broker adds no
        messages, and one whose queue empties and fills adds two per
        connection."""
        news = []
        for identity, consumer in self.consumers.items():
            if consumer.told is not None and (consumer.told == 0) != ((now := self.queued_in(consumer.job)) == 0):
                consumer.told = now
                news.append((identity, now))
        return news

    # -- consumer messages ---------------------------------------------------
    def hello(self, identity: bytes, consumer_id: str, mono: float, run: str | None = None,
              lineage: str | None = None, job: str = DEFAULT_JOB, counts: bool = False) -> list[str]:
        """Register a connection (`counts`: it asked to be told how many
        trajectories wait queued); an older connection of the same consumer
        is dropped and its leases requeued. Returns ids that ran out of deliveries."""
        exhausted = []
        for old_identity, consumer in list(self.consumers.items()):
            if consumer.consumer_id == consumer_id and old_identity != identity:
                exhausted += self.drop_consumer(old_identity)
        if identity in self.consumers:
            exhausted += self.drop_consumer(identity)
        self.consumers[identity] = ConsumerState(consumer_id, mono, run=run, lineage=lineage, job=job,
                                                 told=0 if counts else None)
        return exhausted

    def seen(self, identity: bytes, mono: float) -> bool:
        """Any message counts as a heartbeat; False for an unknown connection."""
        consumer = self.consumers.get(identity)
        if consumer is None:
            return False
        consumer.last_seen = mono
        return True

    def credit(self, identity: bytes, n: int, unit: str) -> None:
        consumer = self.consumers[identity]
        if unit == CreditUnit.GROUP:
            consumer.group_credit += n
        else:
            consumer.trajectory_credit += n

    def revoke(self, identity: bytes) -> int:
        """The consumer takes back the credit this connection still holds
        (it wants it where trajectories wait); returns its job's queued
        count, told from here on to a connection that asked for counts."""
        consumer = self.consumers[identity]
        consumer.trajectory_credit = consumer.group_credit = 0
        told = self.tell(identity)
        return self.queued_in(consumer.job) if told is None else told

    def end_leases(self, lease_ids: list[str]) -> tuple[list[Lease], list[str]]:
        """Remove `lease_ids`, whatever ended them (settled, expired, their
        consumer dropped, retracted): returns the leases that were out and
        the stale ids."""
        valid, stale = [], []
        for lease_id in lease_ids:
            lease = self.leases.pop(lease_id, None)
            if lease is None:
                stale.append(lease_id)
                continue
            valid.append(lease)
            consumer = self.consumers.get(lease.identity)
            if consumer is not None:
                consumer.leases.discard(lease_id)
        return valid, stale

    def requeue(self, leases: list[Lease]) -> list[str]:
        """Put settled or lost leases' trajectories back at the front, unit
        by unit (`_put_back`); returns the ids that have used up
        `max_deliveries`, which are not put back."""
        leases = [lease for lease in leases if not lease.replay]
        limit = self.settings.max_deliveries
        exhausted = [lease.trajectory_id for lease in leases if self.delivery_counts.get(lease.trajectory_id, 0) >= limit]
        again = [lease for lease in leases if self.delivery_counts.get(lease.trajectory_id, 0) < limit]
        self._put_back(again)
        self.redeliveries += len(again)
        return exhausted

    def retract(self, lease_ids: list[str], refund: bool = False) -> None:
        """Deliveries that never left: undo their leases and delivery counts
        and put them back in front (`_put_back`). `refund` gives the
        consumers back the credit they used, for deliveries the broker
        itself could not make (a trajectory did not read back): one
        trajectory credit per trajectory, one group credit per delivered
        unit, as `deliveries` charged them. A send the consumer's connection
        refused (gone, or its queue full) keeps the credit spent, so a dead
        peer is not retried on every pass until its heartbeats time out."""
        leases, stale = self.end_leases(lease_ids)
        if stale:
            raise NotFound(f"retract takes leases that are out now; {stale} are not")
        leases = [lease for lease in leases if not lease.replay]  # nothing to put back: the resume hands them out again
        for lease in leases:
            self.delivery_counts[lease.trajectory_id] -= 1
        if refund:  # one charge per group unit, one per trajectory on trajectory credit
            charges = {(lease.identity, id(lease.unit)) if lease.credit == CreditUnit.GROUP else lease.lease: lease
                       for lease in leases}
            for lease in charges.values():
                if lease.identity in self.consumers:
                    self.credit(lease.identity, 1, lease.credit)
        self._put_back(leases)

    def _put_back(self, leases: list[Lease]) -> None:
        """The one way trajectories return to the queue: at the front, in
        the order given, each delivered unit whole (its members that are
        back, with `group_left` recomputed for what is redelivered)."""
        by_unit: dict[int, tuple[DeliveryUnit, list[str]]] = {}
        for lease in leases:
            by_unit.setdefault(id(lease.unit), (lease.unit, []))[1].append(lease.trajectory_id)
        for unit, tids in reversed(list(by_unit.values())):
            left = 0
            if unit.group_id is not None:
                assert unit.group_size is not None  # a group's unit carries its size
                left = unit.group_size - len(tids)
            self.enqueue(DeliveryUnit(tuple(tids), unit.group_id, unit.group_size, left, unit.version), front=True)

    def withdraw(self, trajectory_ids: set[str]) -> None:
        """Take trajectories settled by their id out of the dispatcher
        wherever they are: their leases end (a later settlement of one is
        stale) and queued units lose them. Rare (a lease outlived by its
        trajectory), so it may scan."""
        self.end_leases([lease.lease for lease in self.leases.values() if lease.trajectory_id in trajectory_ids])
        for job in {job_of(tid) for tid in trajectory_ids} & self.queues.keys():
            queue = self.queues[job]
            if not any(tid in trajectory_ids for unit in queue for tid in unit.trajectory_ids):
                continue
            del self.queues[job]
            self._count(job, -sum(len(unit.trajectory_ids) for unit in queue))
            for unit in queue:
                kept = tuple(tid for tid in unit.trajectory_ids if tid not in trajectory_ids)
                if kept:
                    left = unit.group_left + len(unit.trajectory_ids) - len(kept)
                    self.enqueue(DeliveryUnit(kept, unit.group_id, unit.group_size, left if unit.group_id else 0,
                                              unit.version))

    def forget(self, trajectory_id: str) -> None:
        self.delivery_counts.pop(trajectory_id, None)

    # -- time ----------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """When `tick` next has something to do at the earliest: the oldest
        lease's expiry (leases are made in time order and never extended)
        or the moment the longest-silent consumer would be silent too long;
        None when neither is out."""
        deadlines = [min(c.last_seen for c in self.consumers.values()) + LIVENESS_INTERVALS * self.settings.heartbeat_interval
                     ] if self.consumers else []
        if self.leases:
            deadlines.append(next(iter(self.leases.values())).expires_at)
        return min(deadlines, default=None)

    def tick(self, mono: float) -> list[str]:
        """Requeue expired leases and the leases of silent consumers; returns
        ids that ran out of deliveries."""
        exhausted = []
        silent_after = LIVENESS_INTERVALS * self.settings.heartbeat_interval
        for identity in [i for i, c in self.consumers.items() if c.last_seen + silent_after < mono]:
            exhausted += self.drop_consumer(identity)
        expired = [lease.lease for lease in self.leases.values() if lease.expires_at < mono]
        if expired:
            valid, _ = self.end_leases(expired)
            exhausted += self.requeue(valid)
        return exhausted

    def drop_consumer(self, identity: bytes) -> list[str]:
        """Forget a connection and requeue its leases (it went silent, said
        hello again, or lost its right to connect); returns ids that ran out
        of deliveries."""
        consumer = self.consumers.pop(identity)
        valid, _ = self.end_leases(sorted(consumer.leases))
        return self.requeue(valid)

    # -- sending -------------------------------------------------------------
    def deliveries(self, mono: float) -> list[Dispatch]:
        """Hand queued units to consumers with credit, round-robin."""
        out: list[Dispatch] = []
        identities = list(self.consumers)
        if not identities:
            return out
        progress = True
        while self.queues and progress:
            progress = False
            for k in range(len(identities)):
                if not self.queues:
                    break
                identity = identities[(self._rotation + k) % len(identities)]
                consumer = self.consumers[identity]
                if consumer.job not in self.queues:
                    continue
                if consumer.group_credit <= 0 and consumer.trajectory_credit <= 0:
                    continue
                unit = self._take(consumer.job)
                if unit is None:
                    continue
                if consumer.group_credit > 0:
                    consumer.group_credit -= 1
                    tids = unit.trajectory_ids
                    credit = CreditUnit.GROUP
                else:
                    take = min(consumer.trajectory_credit, len(unit.trajectory_ids))
                    tids = unit.trajectory_ids[:take]
                    if take < len(unit.trajectory_ids):
                        rest = DeliveryUnit(unit.trajectory_ids[take:], unit.group_id, unit.group_size, unit.group_left,
                                        unit.version)
                        self.enqueue(rest, front=True)
                    consumer.trajectory_credit -= take
                    credit = CreditUnit.TRAJECTORY
                progress = True
                for tid in tids:
                    out.append(self._lease(identity, consumer, tid, unit, mono, credit))
            self._rotation = (self._rotation + 1) % len(identities)
        return out

    def replay(self, identity: bytes, trajectory_ids: list[str], mono: float) -> list[Dispatch]:
        """Lease trained trajectories to the resumed trainer on `identity`,
        without credit (it asked for them by resuming). Their leases end
        without requeueing: a replayed trajectory is trained, not queued."""
        self.withdraw(set(trajectory_ids))
        consumer = self.consumers[identity]
        out = []
        for tid in trajectory_ids:
            lease_id = f"{self._epoch}-{next(self._counter)}"
            unit = DeliveryUnit((tid,))
            self.leases[lease_id] = Lease(lease_id, tid, unit, identity, mono + self.settings.lease_timeout, replay=True)
            consumer.leases.add(lease_id)
            out.append(Dispatch(identity, lease_id, tid, unit, 1, replay=True))
        return out

    def _lease(self, identity: bytes, consumer: ConsumerState, tid: str, unit: DeliveryUnit, mono: float,
               credit: CreditUnit) -> Dispatch:
        lease_id = f"{self._epoch}-{next(self._counter)}"
        self.leases[lease_id] = Lease(lease_id, tid, unit, identity, mono + self.settings.lease_timeout, credit)
        consumer.leases.add(lease_id)
        count = self.delivery_counts.get(tid, 0) + 1
        self.delivery_counts[tid] = count
        return Dispatch(identity, lease_id, tid, unit, count)
