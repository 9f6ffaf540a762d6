"""The consumer's protocol state, with no sockets, clocks or threads.

`Sessions` feeds it what the brokers said (`welcomed`, `delivered`,
`settled`, ...) with the current time, and `due` sends what collects in
`outbox`. The trainer's side (`ConsumerCore`) takes complete units (a
trajectory, or a whole group) and later commits or rejects them. Everything at-least-once delivery needs lives
here: deduplication by trajectory id, the leases each trajectory was
delivered under (several after a redelivery), group completion, bounded
credit across brokers, and resending settlements the broker could not
persist.
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from rollstream.common.contract import CreditUnit
from rollstream.common.errors import InvalidInput, InvalidState, NotFound
from rollstream.common.versions import delivery_version

from .credit import Credit

POLICIES = ("raise", "quarantine")  # what to do with a trajectory that fails batch validation
ACKED = "acked"  # outcome of a committed trajectory in the dedup memory
STALE = "stale"  # outcome (and dead-letter reason) of one too old to train when it would be handed out
FILTERED_BY_CONSUMER = "filtered:consumer"  # of a unit the trainer's `keep` predicate dropped


class Settle(StrEnum):
    """How a lease is settled: `ack` (trained), `nack` (refused: dead letter)
    or `release` (a `nack` with requeue: deliver it again)."""

    ACK = "ack"
    NACK = "nack"
    RELEASE = "release"

RETRY_AFTER = 1.0  # seconds before resending a settlement answered `unavailable`


@dataclass(eq=False)
class Delivery:
    """One delivered trajectory: its `deliver` header fields and arrays, and
    every `(broker, lease)` it is currently held under."""

    trajectory_id: str
    fields: Mapping[str, Any]
    arrays: Mapping[str, np.ndarray]
    broker: int
    leases: set[tuple[int, str]] = field(default_factory=set)
    received_at: float = 0.0


@dataclass(eq=False)
class Unit:
    """What a batch is counted in: one trajectory, or one group's members
    (`expected` = `group_size - group_left` of its delivery)."""

    broker: int
    members: dict[str, Delivery]
    expected: int
    group_id: str | None = None

    @property
    def complete(self) -> bool:
        return len(self.members) >= self.expected

    @property
    def received_at(self) -> float:
        return max(d.received_at for d in self.members.values())

    @property
    def version(self) -> int | None:
        """The oldest ordered policy version its members' turns hold (`rollstream.common.versions`)."""
        return min((v for v in (delivery_version(d.fields) for d in self.members.values()) if v is not None),
                   default=None)

    @property
    def tokens(self) -> int:
        """Prompt plus response tokens of its members (what `batch_tokens` counts)."""
        return sum(len(d.arrays["prompt_tokens"]) + len(d.arrays["tokens"]) for d in self.members.values())


class Outgoing(NamedTuple):
    """A message for broker `broker`: `type` and header `fields`."""

    broker: int
    type: str
    fields: dict


@dataclass
class _Broker:
    lease_timeout: float = math.inf
    burst: tuple[str, int] | None = None  # group being delivered: (group_id, members still to come)


@dataclass
class Stats:
    delivered: int = 0
    duplicates: int = 0
    committed: int = 0
    acked: int = 0
    stale_leases: int = 0
    rejected: int = 0
    released: int = 0
    expired_in_buffer: int = 0
    stale: int = 0  # dropped as too old when they would have been handed out
    filtered: int = 0  # dropped by the trainer's `keep` predicate
    undecodable: int = 0
    internal_errors: int = 0  # messages whose handling failed inside this client (a bug): logged, refused
    resent_settlements: int = 0


TOKEN_BATCH_UNITS = 256  # the unit cap of a batch given by `batch_tokens` alone (credit is granted in units)


def _count(name: str, value: int | None) -> None:
    """`value`, when given, must be an int of at least 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidInput(f"{name} must be an int of at least 1, got {value!r}")


class Assembler:
    """Deduplicating, group-completing buffer of deliveries from `n_brokers`.

    Credit: the consumer never holds more than `prefetch` units buffered or
    promised (credit granted, not yet used), and never more than
    `prefetch - batch_size` promised, so credit parked at idle brokers can
    never keep a batch from filling: `batch_size` units of room always
    remain for the brokers that have data. `Credit` decides which brokers
    get it.

    Batches close at `batch_size` units or, with `batch_tokens`, before the
    unit that would take them past that many tokens, whichever comes first;
    a unit over the budget alone makes a batch of its own. Credit stays in
    units: given `batch_tokens` alone, `batch_size` is
    `min(batch_tokens, TOKEN_BATCH_UNITS)`, a cap on the units of a batch
    that also sizes the prefetch.

    Two threads reach it, only through `ConsumerCore` and under its shell's
    lock (who calls what):
    - the I/O thread (`ConsumerCore.received`, `undecodable`, `due`, through
      `Sessions`) calls `welcomed`, `lost`, `delivered` (and with it the
      `keep` predicate), `undecodable`, `holds`, `settled`, `unavailable`,
      `expire`, `release` (all, once closing), `credit_grants`,
      `take_outbox` and `credit`'s inputs. Affects: the buffer (`_complete`,
      `_assembling`, `_buffered`), the leases of held trajectories, the
      dedup memory (`_done`), settlements (`_settling`, `_retry`), credit,
      `group_size`, `stats` and `outbox`.
    - the trainer's thread (`ConsumerCore.take`, `formed`, `abandon`,
      `commit`, `release`, `seal`, `state_dict`, `close`, `stats`) calls
      `drop_expired`, `drop_stale`, `fills`, `take`, `replayed`,
      `take_replayed`, `give_back_replayed`, `commit`, `reject`, `release`
      and `unanswered_acks`, and appends seals to `outbox`. Affects: the
      buffer, what the trainer holds (`_taken`, `_replayed`), the dedup
      memory, settlements, `stats` and `outbox`.
    """

    def __init__(
        self,
        n_brokers: int,
        *,
        batch_size: int | None = None,
        batch_tokens: int | None = None,
        unit: str = CreditUnit.TRAJECTORY,
        prefetch: int | None = None,
        dedup_capacity: int = 100_000,
        keep: Callable[[list[Mapping[str, Any]]], bool] | None = None,
    ):
        if unit not in set(CreditUnit):
            raise InvalidInput(f"unit must be one of {[str(u) for u in CreditUnit]}, got {unit!r}")
        _count("batch_tokens", batch_tokens)
        if batch_size is None:
            if batch_tokens is None:
                raise InvalidInput("a batch needs a limit: give batch_size (units), batch_tokens (tokens) or both, "
                                   "got neither")
            batch_size = min(batch_tokens, TOKEN_BATCH_UNITS)
        if batch_size < 1 or n_brokers < 1:
            raise InvalidInput(f"batch_size and the broker count must be positive, got {batch_size} and {n_brokers}")
        prefetch = max(2 * batch_size, batch_size + n_brokers) if prefetch is None else prefetch
        if prefetch < batch_size + 1:
            raise InvalidInput(f"prefetch must be at least batch_size + 1 = {batch_size + 1} (a unit of credit beyond "
                               f"a full batch), got {prefetch}")
        self.unit = CreditUnit(unit)
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens
        self.prefetch = prefetch
        self.dedup_capacity = dedup_capacity
        self.credit = Credit(n_brokers, prefetch - batch_size)
        self._brokers = [_Broker() for _ in range(n_brokers)]
        self._complete: deque[Unit] = deque()
        self._assembling: dict[str, Unit] = {}  # group id -> incomplete group
        self._buffered: dict[str, Unit] = {}  # trajectory id -> its unit, not yet taken
        self._taken: dict[str, Delivery] = {}  # handed to the trainer, not committed
        self._replayed: dict[str, Delivery] = {}  # trained before a resume, handed back to train again (no credit)
        self._done: OrderedDict[str, str] = OrderedDict()  # id -> ACKED or the rejection reason
        # No buffered unit's lease runs out before this (`drop_expired` looks at none until then).
        self._first_expiry = math.inf
        self.keep = keep  # the trainer's predicate on a complete unit's members (`Consumer(filter=...)`)
        self.group_size: int | None = None  # the largest group delivered so far (how big a step is, in groups)
        self._settling: dict[tuple[int, str], Outgoing] = {}  # lease -> the ack/nack awaiting a reply
        self._retry: list[tuple[float, tuple[int, str]]] = []
        self.outbox: list[Outgoing] = []
        self.stats = Stats()

    # -- broker sessions ------------------------------------------------------
    def welcomed(self, broker: int, lease_timeout: float, queued: int | None = None) -> None:
        """A (re)started session (`queued`: what the broker holds queued, when
        it says): the broker released every lease and all credit of the
        previous one, so drop what it had delivered and is not yet with the
        trainer (it is redelivered to us or to another consumer).
        Settlements still unanswered go to the new session: an ack names
        its trajectories, which the broker settles by id."""
        if queued is None and self.credit.window < 1:
            raise InvalidState(
                f"rule 'prefetch covers brokers that send no queued counts' not met: broker {broker} sends none, so it "
                f"needs a fixed window of credit: prefetch must be at least batch_size + brokers = "
                f"{self.batch_size + len(self._brokers)}, got {self.prefetch}")
        self.lost(broker)
        self._brokers[broker].lease_timeout = lease_timeout
        self.credit.connected(broker, queued)
        pending = [out for lease, out in self._settling.items() if lease[0] == broker]
        self.stats.resent_settlements += len(pending)
        self.outbox += pending

    def lost(self, broker: int) -> None:
        """The broker no longer knows this connection (`unknown_consumer`).
        What the trainer holds keeps its leases, and unanswered settlements
        wait for the next welcome: an ack of them settles by trajectory id."""
        self.credit.lost(broker)
        self._brokers[broker].burst = None
        for unit in self._units():
            if unit.broker == broker:
                self._drop(unit)
        self._retry = [(due, lease) for due, lease in self._retry if lease[0] != broker]

    def credit_grants(self, withheld: Collection[int] = ()) -> dict[int, int]:
        """Credit to send now, per connected broker not `withheld` (already
        counted as outstanding); a `revoke` for each broker whose parked
        credit is wanted elsewhere goes to the outbox."""
        free = self.prefetch - len(self._complete) - len(self._assembling) - self.credit.outstanding
        per_unit = (self.group_size or 1) if self.unit == CreditUnit.GROUP else 1
        grants, revokes = self.credit.plan(free, per_unit=per_unit, withheld=withheld)
        self.outbox += [Outgoing(broker, "revoke", {}) for broker in revokes]
        return grants

    # -- deliveries -----------------------------------------------------------
    def delivered(self, broker: int, fields: Mapping[str, Any], arrays: Mapping[str, np.ndarray], now: float) -> None:
        """A decoded `deliver` message."""
        self.stats.delivered += 1
        tid = fields["trajectory_id"]
        lease = (broker, fields["lease"])
        if fields.get("replay"):  # no credit, no units: `take_replayed` takes them by id, in their batch's order
            if tid in self._done:  # committed again already; that ack records it
                self.stats.duplicates += 1
                return
            held = self._replayed.get(tid) or self._taken.get(tid)
            if held is not None:
                held.leases.add(lease)
            else:
                self._replayed[tid] = Delivery(tid, fields, arrays, broker, {lease}, now)
            return
        self._use_credit(broker, fields)
        if "queued" in fields:
            self.credit.told(broker, fields["queued"])
        outcome = self._done.get(tid)
        if outcome is not None:
            self.stats.duplicates += 1
            self._settle(lease, Settle.ACK if outcome == ACKED else Settle.NACK, outcome, tid)
            return
        held = self._taken.get(tid) or self._member(tid)
        if held is not None:  # a redelivery while we still hold it: keep every lease
            self.stats.duplicates += 1
            held.leases.add(lease)
            held.received_at = now
            return
        delivery = Delivery(tid, fields, arrays, broker, {lease}, now)
        # Its unit's lease runs out no sooner (a unit is as late as its latest member).
        self._first_expiry = min(self._first_expiry, now + self._brokers[broker].lease_timeout)
        group_id = fields.get("group_id")
        if group_id is not None:
            self.group_size = max(self.group_size or 0, fields.get("group_size", 1))
        if self.unit == CreditUnit.TRAJECTORY or group_id is None:
            self._buffer(Unit(broker, {tid: delivery}, 1))
            self._judge(self._complete[-1])
            return
        unit = self._assembling.get(group_id)
        if unit is None:
            unit = Unit(broker, {}, fields.get("group_size", 1) - fields.get("group_left", 0), group_id)
            self._assembling[group_id] = unit
        unit.members[tid] = delivery
        self._buffered[tid] = unit
        if unit.complete:
            del self._assembling[group_id]
            self._complete.append(unit)
            self._judge(unit)

    def _judge(self, unit: Unit) -> None:
        """A unit just became complete: the trainer's `keep` predicate (its
        members' deliver fields) may drop it, as `filtered:consumer`."""
        if self.keep is not None and not self.keep([d.fields for d in unit.members.values()]):
            self._discard([unit], FILTERED_BY_CONSUMER)

    def undecodable(self, broker: int, header: Mapping[str, Any], reason: str, *, requeue: bool) -> None:
        """A `deliver` whose arrays could not be read (bad CRC, dtype, ...):
        it used credit; hand its lease back (requeue) or dead-letter it."""
        self._use_credit(broker, header)
        self.stats.undecodable += 1
        self._settle((broker, header["lease"]), Settle.RELEASE if requeue else Settle.NACK, reason)

    def holds(self, tid: str) -> bool:
        """Whether a delivery of `tid` is buffered, held by the trainer or settled here."""
        return tid in self._done or tid in self._taken or tid in self._replayed or self._member(tid) is not None

    def _use_credit(self, broker: int, fields: Mapping[str, Any]) -> None:
        """Trajectory credit pays per message; group credit per delivery unit,
        whose members a broker sends back to back."""
        state = self._brokers[broker]
        group_id = fields.get("group_id")
        if self.unit == CreditUnit.GROUP and group_id is not None:
            if state.burst is not None and state.burst[0] == group_id:
                left = state.burst[1] - 1
                state.burst = (group_id, left) if left > 0 else None
                return
            left = fields.get("group_size", 1) - fields.get("group_left", 0) - 1
            state.burst = (group_id, left) if left > 0 else None
        self.credit.used(broker)

    def _buffer(self, unit: Unit) -> None:
        for tid in unit.members:
            self._buffered[tid] = unit
        self._complete.append(unit)

    def _member(self, tid: str) -> Delivery | None:
        unit = self._buffered.get(tid)
        return None if unit is None else unit.members[tid]

    def _units(self) -> list[Unit]:
        return [*self._complete, *self._assembling.values()]

    def _drop(self, unit: Unit) -> None:
        """Forget a buffered unit entirely (its leases are gone)."""
        if unit.group_id is not None and self._assembling.get(unit.group_id) is unit:
            del self._assembling[unit.group_id]
        else:
            self._complete.remove(unit)
        for tid in unit.members:
            self._buffered.pop(tid, None)

    def expire(self, now: float) -> None:
        """Drop buffered units whose leases ran out, and resend settlements
        that are due again."""
        self.drop_expired(now)
        due = [lease for when, lease in self._retry if when <= now]
        self._retry = [(when, lease) for when, lease in self._retry if when > now]
        for lease in due:
            if lease in self._settling:
                self.stats.resent_settlements += 1
                self.outbox.append(self._settling[lease])

    def drop_expired(self, now: float) -> None:
        """Drop buffered units whose leases ran out: the broker is
        redelivering them, so training one would train it twice. Units are
        looked at only once the earliest expiry may have passed (the trainer
        asks before every batch, the I/O thread on every pass)."""
        if now <= self._first_expiry:
            return
        first = math.inf
        for unit in self._units():
            expiry = unit.received_at + self._brokers[unit.broker].lease_timeout
            if now > expiry:
                self.stats.expired_in_buffer += len(unit.members)
                self._drop(unit)
            else:
                first = min(first, expiry)
        self._first_expiry = first

    def drop_stale(self, below: int) -> list[str]:
        """Complete buffered units whose version is below `below` (behind
        the trainer by more than the staleness bound: prefetched, they aged
        while they waited) are never handed out: each goes to its broker's
        dead letters as `stale`. Returns their ids."""
        return self._discard([unit for unit in self._complete if (version := unit.version) is not None and version < below],
                             STALE)

    def _discard(self, units: list[Unit], reason: str) -> list[str]:
        """Buffered `units` are never handed out: every member goes to its
        broker's dead letters with `reason` (a redelivery is settled alike). Their ids."""
        dropped = []
        for unit in units:
            self._drop(unit)
            for tid, held in unit.members.items():
                if reason == STALE:
                    self.stats.stale += 1
                else:
                    self.stats.filtered += 1
                self._remember(tid, reason)
                for lease in sorted(held.leases):
                    self._settle(lease, Settle.NACK, reason, tid)
                dropped.append(tid)
        return dropped

    # -- trainer side ---------------------------------------------------------
    def replayed(self, trajectory_ids: list[str]) -> bool:
        """Whether every one of these handed-back trajectories is here."""
        return all(tid in self._replayed for tid in trajectory_ids)

    def take_replayed(self, trajectory_ids: list[str]) -> list[Delivery]:
        """Handed-back trajectories, now with the trainer, in this order."""
        taken = [self._replayed.pop(tid) for tid in trajectory_ids]
        for delivery in taken:
            self._taken[delivery.trajectory_id] = delivery
        return taken

    def give_back_replayed(self, trajectory_ids: Iterable[str]) -> None:
        """Handed-back trajectories the trainer did not train: kept to hand out again."""
        for tid in trajectory_ids:
            self._replayed[tid] = self._taken.pop(tid)

    @property
    def complete(self) -> int:
        """Complete units waiting to be taken."""
        return len(self._complete)

    def _fitting(self, n: int, held: Sequence[Unit]) -> tuple[int, bool]:
        """How many complete units, from the front, join a batch that already
        holds the units `held` (at most `n`, within `batch_tokens`), and
        whether the batch is then full: `n` reached, the budget reached, or
        the next unit does not fit. With nothing held, a first unit over the
        budget goes alone and fills the batch."""
        if self.batch_tokens is None:
            count = min(n, len(self._complete))
            return count, count == n
        count, tokens = 0, sum(unit.tokens for unit in held)
        for unit in itertools.islice(self._complete, n):
            size = unit.tokens
            if tokens + size > self.batch_tokens and (count or held):
                return count, True
            count, tokens = count + 1, tokens + size
            if tokens >= self.batch_tokens:  # reached, or a unit over the budget alone
                return count, True
        return count, count == n

    def fills(self, n: int, held: Sequence[Unit] = ()) -> bool:
        """Whether the complete units fill a batch: `n` more units, or, with
        `batch_tokens`, as many as fit next to the units `held` in it."""
        return self._fitting(n, held)[1]

    def take(self, n: int, held: Sequence[Unit] = ()) -> list[Unit]:
        """Up to `n` complete units in arrival order, now with the trainer:
        with `batch_tokens`, those that fit next to the units `held` in the
        batch already (a unit over the budget comes alone)."""
        count, _ = self._fitting(n, held)
        units = [self._complete.popleft() for _ in range(count)]
        for unit in units:
            for tid, delivery in unit.members.items():
                del self._buffered[tid]
                self._taken[tid] = delivery
        return units

    def commit(self, trajectory_ids: Iterable[str], step: int | None = None) -> None:
        """The trainer used these: ack every lease they were delivered under
        (with `step`, as the batch trained at that step, in this order)."""
        for position, tid in enumerate(trajectory_ids):
            self.stats.committed += 1
            self._finish(tid, ACKED, None if step is None else (step, position))

    def reject(self, reasons: Mapping[str, str]) -> None:
        """Quarantine: move each trajectory to the broker's dead letters with its reason."""
        for tid, reason in reasons.items():
            self.stats.rejected += 1
            self._finish(tid, reason)

    def release(self, trajectory_ids: Iterable[str] | None = None) -> None:
        """Give trajectories back for redelivery (all held ones when None):
        the trainer will not use them. A buffered group goes back whole.
        Handed-back (replayed) ones are only let go: a resume brings them back."""
        if trajectory_ids is None:
            trajectory_ids = [*self._taken, *self._buffered]
            self._replayed.clear()
        released: dict[str, Delivery] = {}
        for tid in trajectory_ids:
            if tid in self._taken:
                released[tid] = self._taken.pop(tid)
            elif tid in self._buffered:
                unit = self._buffered[tid]
                self._drop(unit)
                released.update(unit.members)
        self.stats.released += len(released)
        for held in released.values():
            for lease in sorted(held.leases):
                self._settle(lease, Settle.RELEASE, "released by the consumer")

    def _finish(self, tid: str, outcome: str, trained_at: tuple[int, int] | None = None) -> None:
        held = self._taken.pop(tid, None)
        if held is None:
            raise NotFound(f"trajectory {tid!r} is not held by the trainer (already committed, or never taken)")
        self._remember(tid, outcome)
        for lease in sorted(held.leases):
            self._settle(lease, Settle.ACK if outcome == ACKED else Settle.NACK, outcome, tid, trained_at)

    def _remember(self, tid: str, outcome: str) -> None:
        """`tid` is done with `outcome`: a redelivery of it is settled the same way (up to `dedup_capacity`)."""
        self._done[tid] = outcome
        self._done.move_to_end(tid)
        while len(self._done) > self.dedup_capacity:
            self._done.popitem(last=False)

    def _settle(self, lease: tuple[int, str], how: Settle, reason: str, tid: str | None = None,
                trained_at: tuple[int, int] | None = None) -> None:
        broker, lease_id = lease
        if how == Settle.ACK:
            assert tid is not None  # an ack always names its trajectory
            out = Outgoing(broker, "ack", {"leases": [lease_id], "trajectory_ids": [tid]})
            if trained_at is not None:
                out.fields.update(step=trained_at[0], positions=[trained_at[1]])
        else:
            out = Outgoing(broker, "nack", {"leases": [lease_id], "reason": reason, "requeue": how == Settle.RELEASE})
        self._settling[lease] = out
        if self.credit.brokers[broker].connected:  # otherwise the next welcome sends it
            self.outbox.append(out)

    def take_outbox(self) -> list[Outgoing]:
        """Pending messages, settlements of one kind merged per broker and
        sent first: a broker seals what it has recorded as trained, so a
        seal must follow the acks of the commits made before it."""
        merged: dict[tuple, Outgoing] = {}
        others = []
        for out in self.outbox:
            if out.type in ("ack", "nack"):
                key = (out.broker, out.type, out.fields.get("reason"), out.fields.get("requeue"), out.fields.get("step"))
                lists = [name for name in ("leases", "trajectory_ids", "positions") if name in out.fields]
                if key in merged:
                    for name in lists:
                        merged[key].fields[name].extend(out.fields[name])
                else:
                    merged[key] = Outgoing(out.broker, out.type, {**out.fields, **{n: list(out.fields[n]) for n in lists}})
            else:
                others.append(out)
        self.outbox = []
        return [*merged.values(), *others]

    # -- replies --------------------------------------------------------------
    def settled(self, broker: int, leases: Iterable[str], *, stale: bool = False) -> None:
        """`acked`/`nacked` (or `nack stale_lease`) for these leases."""
        for lease_id in leases:
            out = self._settling.pop((broker, lease_id), None)
            if out is None:
                continue
            if stale:
                self.stats.stale_leases += 1
            elif out.type == "ack":
                self.stats.acked += 1

    def unavailable(self, broker: int, leases: Iterable[str], now: float) -> None:
        """The broker could not persist a settlement: resend it later."""
        for lease_id in leases:
            if (broker, lease_id) in self._settling:
                self._retry.append((now + RETRY_AFTER, (broker, lease_id)))

    @property
    def silent_brokers(self) -> list[int]:
        """The brokers (by index) that have not welcomed the current session."""
        return [i for i, state in enumerate(self.credit.brokers) if not state.connected]

    def unanswered_acks(self) -> set[str]:
        """The trajectories whose ack its broker has not answered yet."""
        return {tid for out in self._settling.values() if out.type == "ack" for tid in out.fields["trajectory_ids"]}

    @property
    def unsettled(self) -> int:
        """Settlements sent and not yet answered."""
        return len(self._settling)

    @property
    def held(self) -> int:
        """Trajectories with the trainer, not committed."""
        return len(self._taken)
