"""The broker's merge engine: producer frames in, replies and effects out.

Sans-I/O: no sockets, files or clocks. The service feeds it decoded `turn`,
`end` and `abort` messages with the current time and gets back, per message,
the reply to send once durable and the effects to persist first. Refused
frames change nothing. Deliverable units (a finished trajectory, or a whole
group) are queued for the dispatcher in `queued_units`.
"""
from __future__ import annotations

import heapq
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, NamedTuple

from rollstream.common.codec import Message, content_digest
from rollstream.common.errors import InternalError, InvalidInput, ProtocolError, RemoteProtocolError
from rollstream.common.jobs import job_of
from rollstream.common.trajectory import Gap, Trajectory
from rollstream.common.versions import Sampled, add_sampled, parse_version
from rollstream.common.wire import turn_from_message

from .filters import GroupFilter, first_dropping, scalar_reward
from .staleness import SetPolicy


class State(StrEnum):
    """Where a trajectory stands (stored in SQLite as these values). `left`
    marks an aborted group member kept so the group can count it; it holds
    no data. `trained`: a checkpointing trainer trained it at a step; its
    data stays until a checkpoint after that step is sealed. `scoring`: it
    ended without a reward, which a `reward` message brings later; until
    then it is not deliverable (nor its group), and it expires like an open
    one. `archiving`: forgotten by the broker (its id remembered), its rows
    and records kept only until the archive holds them durably; the engine
    never holds one."""

    OPEN = "open"
    ENDED = "ended"
    DEAD = "dead"
    LEFT = "left"
    TRAINED = "trained"
    SCORING = "scoring"
    ARCHIVING = "archiving"


OPEN, ENDED, DEAD, LEFT, TRAINED, SCORING, ARCHIVING = (State.OPEN, State.ENDED, State.DEAD, State.LEFT, State.TRAINED,
                                                        State.SCORING, State.ARCHIVING)
# The states an engine entry can be in (an `archiving` trajectory is only the store's).
STATES = tuple(state for state in State if state is not State.ARCHIVING)
# Admitted and still to be trained: what a staleness bound's capacity counts.
UNTRAINED = frozenset({OPEN, ENDED, SCORING})
# Dead-letter reasons of trajectories given up unfinished: a later frame of one is answered not applied, with it.
GIVEN_UP = ("expired", "reward_expired", "abandoned", "stale")

# What a trajectory held in memory costs beyond its arrays' bytes, so that
# `bytes_in_memory` (the budget's measure) follows the process's RSS: per
# merged turn, the message, turn and array objects and the allocator's slack
# (more when a frame is held zero-copy); per trajectory, its entry, buffers
# and outcome list. Set from measured RSS (docs/performance.md).
TRAJECTORY_OVERHEAD_BYTES = 2048
TURN_OVERHEAD_BYTES = 4096

# Reads back from the store that may find an ended trajectory's records
# damaged (`unreadable`) before it is dead-lettered with that reason: each
# failed read waits for the store's probe, so a record that can never be
# read costs a few probes, not one after another forever.
UNREADABLE_AFTER = 3


# -- effects: what must be durable before the reply goes out ------------------
@dataclass(frozen=True, slots=True)
class OpenTrajectory:
    trajectory_id: str
    group_id: str | None
    group_size: int | None
    sample_index: int | None
    at: float
    replaces: bool = False  # a LEFT marker of the same id exists (a brand-new id has nothing to clear)
    producer: str | None = None  # the producer id its first turn came from (its hello's)
    producer_key: str | None = None  # the CURVE key fingerprint of that producer's connection (None: no CURVE)


class PutTurn(NamedTuple):
    """A consumed turn: its outcome, and `message` when it was applied or
    else its digest (an applied turn's record is its digest's source). (A
    named tuple: one is made per frame, and it is cheaper to make than a
    frozen dataclass.)"""

    trajectory_id: str
    turn: int
    digest: bytes | None
    applied: bool
    reason: str | None
    message: Message | None
    at: float


@dataclass(frozen=True, slots=True)
class NameProducer:
    """Who opened a trajectory, learnt after its first turn: frames resent on
    a new connection may come before that connection's hello."""

    trajectory_id: str
    producer: str
    producer_key: str | None


@dataclass(frozen=True, slots=True)
class MarkGap:
    """A replay gap cut the trajectory here."""

    trajectory_id: str
    gap: Gap


@dataclass(frozen=True, slots=True)
class EndTrajectory:
    trajectory_id: str
    reward: Any
    metadata: dict
    digest: bytes
    at: float
    version: int | None = None  # its oldest turn's ordered policy version (`rollstream.common.versions`)
    scoring: bool = False  # ended without its reward: `scoring` until a `SetReward`
    sampled: Sampled = ()  # the lineage epochs and steps whose weights sampled it


@dataclass(frozen=True, slots=True)
class SetReward:
    """A `scoring` trajectory's reward came: it is ended, and deliverable."""

    trajectory_id: str
    reward: Any
    at: float


@dataclass(frozen=True, slots=True)
class DropTrajectory:
    """Aborted: data discarded; a group member stays as a LEFT marker."""

    trajectory_id: str
    keep_marker: bool


@dataclass(frozen=True, slots=True)
class DeadLetter:
    trajectory_id: str
    reason: str
    at: float
    dedup_until: float | None = None  # expired ids are remembered


@dataclass(frozen=True, slots=True)
class Revive:
    """An operator sent a dead letter back to the queue."""

    trajectory_id: str


@dataclass(frozen=True, slots=True)
class GroupDeliverable:
    """A group is complete: its ended members are deliverable together."""

    group_id: str
    size: int


@dataclass(frozen=True, slots=True)
class CloseGroup:
    """Every ended member of a deliverable group is gone: forget the group."""

    group_id: str


@dataclass(frozen=True, slots=True)
class Forget:
    """Delivered and acked (or trained and sealed), or a dead letter pruned:
    data deleted, id remembered until `dedup_until` (a pruned dead letter's
    with its reason and time, so that it is still accounted for)."""

    trajectory_id: str
    dedup_until: float
    dead_reason: str | None = None
    dead_at: float | None = None
    # What the archive records of its consumption: when a trainer first got it, how often it was sent, when a
    # commit took it (this one's time when an ack deletes it; a trained one's came with `MarkTrained`).
    first_delivered_at: float | None = None
    deliveries: int = 0
    committed_at: float | None = None


@dataclass(frozen=True, slots=True)
class TrainedAt:
    """Where a trajectory was trained: by which run and lineage of a
    trainer, at which step, at which position of that step's batch, and
    in which lineage epoch of its job (None: not known, as for the
    batches a resume records from its checkpoint)."""

    run: str
    lineage: str
    step: int
    position: int
    epoch: int | None = None


@dataclass(frozen=True, slots=True)
class MarkTrained:
    trajectory_id: str
    trained: TrainedAt
    committed_at: float | None = None
    first_delivered_at: float | None = None
    deliveries: int = 0


@dataclass
class Run:
    """A checkpointing trainer's run as the broker keeps it: its current
    lineage, the checkpoints it sealed, and the step through which its
    trained trajectories are reclaimed (-1: none yet)."""

    lineage: str
    seals: list[int] = field(default_factory=list)
    reclaimed: int = -1


@dataclass(frozen=True, slots=True)
class SealRun:
    """A run's seals and reclaimed step, as they now stand."""

    run: str
    lineage: str
    seals: tuple[int, ...]
    reclaimed: int


# What the engine (and `Freshness`, a job's policy) asks to be made durable, in order; the store and the
# service's counters each dispatch on it with one `match`.
Effect = (OpenTrajectory | PutTurn | MarkGap | EndTrajectory | DropTrajectory | DeadLetter | Revive | GroupDeliverable
          | CloseGroup | Forget | MarkTrained | SealRun | SetPolicy | SetReward | NameProducer)


# -- deliverable units --------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DeliveryUnit:
    """What a consumer receives together: one trajectory, or a group's
    ended members with how many left."""

    trajectory_ids: tuple[str, ...]
    group_id: str | None = None
    group_size: int | None = None
    group_left: int = 0
    version: int | None = None  # the oldest ordered policy version among its members (None: unknown)


# Stored digests read for `MergeEngine.handle`, by (trajectory id, turn); None: the read failed.
StoredDigests = Mapping[tuple[str, int], bytes | None]
NOTHING_STORED: StoredDigests = MappingProxyType({})


class Reply(NamedTuple):
    """The answer to one message: `fields` of an `ack`, or a refusal."""

    fields: dict | None = None
    error: ProtocolError | None = None
    effects: tuple = ()


# -- state --------------------------------------------------------------------
class Producer(NamedTuple):
    """Who opened a trajectory: its producer's id, and under CURVE the key
    fingerprint of that producer's connection (None without CURVE)."""

    producer_id: str
    key: str | None = None


@dataclass
class Entry:
    trajectory_id: str
    state: State
    group_id: str | None = None
    group_size: int | None = None
    sample_index: int | None = None
    # Per consumed turn; None: applied, digest from its record.
    outcomes: list[tuple[bytes | None, bool, str | None]] = field(default_factory=list)
    end_digest: bytes | None = None
    updated_at: float = 0.0
    trajectory: Trajectory | None = None  # merged state; None once evicted to the store
    dead_reason: str | None = None
    dead_at: float | None = None
    held: int = 0  # bytes counted in `MergeEngine.bytes_in_memory` for its trajectory
    unreadable: int = 0  # reads back that found its stored records damaged (see UNREADABLE_AFTER)
    trained: TrainedAt | None = None  # once TRAINED
    stored_bytes: int = 0  # of its applied turns' frames (about what its records hold on disk)
    version: int | None = None  # its oldest applied turn's ordered policy version (None: none holds one)
    sampled: Sampled = ()  # per lineage epoch, the newest step of the weights that sampled its applied turns
    reward: Any = None  # once ended, as its end gave it (what group filters judge)
    first_delivered_at: float | None = None  # wall time it was first sent to a consumer (`sent`)
    deliveries: int = 0  # times it was sent
    producer: Producer | None = None  # who opened it: handed back to that producer alone (`open_of`)

    @property
    def next_turn(self) -> int:
        return len(self.outcomes)


@dataclass
class Group:
    size: int
    members: dict[str, State] = field(default_factory=dict)  # trajectory id -> state
    updated_at: float = 0.0
    pending: set[str] | None = None  # once deliverable: ended members not yet delivered

    @property
    def deliverable(self) -> bool:
        return self.pending is not None

    @property
    def complete(self) -> bool:
        return len(self.members) == self.size and OPEN not in self.members.values() \
            and SCORING not in self.members.values()


@dataclass
class EngineSettings:
    trajectory_ttl: float = 3600.0
    dedup_window: float = 86_400.0
    group_filters: tuple[GroupFilter, ...] = ()  # run on every group as it completes (broker/filters.py)
    reward_key: str | None = None  # which entry of a map reward the filters compare


def _ack(message: Message, applied: bool, *, reason: str | None = None, duplicate: bool = False) -> dict:
    given = message.fields
    fields = {"seq": given["seq"], "trajectory_id": given["trajectory_id"], "applied": applied}
    if "turn" in given:
        fields["turn"] = given["turn"]
    if reason is not None:
        fields["reason"] = reason
    if duplicate:
        fields["duplicate"] = True
    return fields


class MergeEngine:
    """Turn ordering, idempotence, merging, groups, TTL and dedup."""

    def __init__(self, settings: EngineSettings | None = None):
        self.settings = settings or EngineSettings()
        # An applied turn's digest is only needed when the turn is resent, so
        # it is not computed as it arrives: it comes from the message while
        # the turn is not yet durable (`_unsaved`, until `saved()`), then from
        # its record, which the caller reads for `handle` when
        # `stored_digests_needed` names it.
        self._unsaved: dict[tuple[str, int], Message] = {}
        # Every entry and group is also indexed so that periodic work costs
        # what changed, not what is held: counts by state, open entries and
        # groups not yet deliverable, least recently continued first (expiry looks at
        # the front only), and the trajectories in memory in eviction order.
        # Entries change state only through the methods below.
        self.entries: dict[str, Entry] = {}
        self.groups: dict[str, Group] = {}
        self._counts: dict[State, int] = dict.fromkeys(STATES, 0)
        self.untrained: Counter[str] = Counter()  # per job: open or ended (admitted, not yet trained or gone)
        self._open: OrderedDict[str, Entry] = OrderedDict()
        self._scoring: OrderedDict[str, Entry] = OrderedDict()  # ended without a reward, longest waiting first
        self._idle_groups: OrderedDict[str, Group] = OrderedDict()
        self._awaiting_group = 0  # ended members of the idle groups, kept as they change
        self._resident_ended: OrderedDict[str, Entry] = OrderedDict()  # ended, in memory, oldest first (evicted newest first)
        self._resident_open: OrderedDict[str, Entry] = OrderedDict()  # open, in memory, least recently continued first
        self._dead: OrderedDict[str, Entry] = OrderedDict()  # dead letters, oldest first (`prune_dead`)
        self.dead_bytes = 0  # their `stored_bytes`, kept as they change
        self.bytes_in_memory = 0  # of the trajectories in memory (arrays and overheads), kept as they change
        self.dedup: dict[str, float] = {}  # trajectory id -> remembered until
        self.pruned: dict[str, tuple[str, float]] = {}  # dead letters pruned, while remembered: id -> (reason, at)
        self._dedup_expiry: list[tuple[float, str]] = []  # a heap of (until, id): expiry without scanning every id
        self.queued_units: deque[DeliveryUnit] = deque()
        self.trained_entries: dict[str, Entry] = {}  # the TRAINED ones, for seals and resumes
        self.trained_bytes = 0  # their `stored_bytes`, kept as they change
        self._trained_steps: Counter[int] = Counter()  # how many of them each step holds (`oldest_trained_step`)
        self.runs: dict[str, Run] = {}  # checkpointing trainers' runs by id
        # Each job's lineage epoch now (`Freshness.epochs`, shared): a version that names none is of it.
        self.epochs: Mapping[str, int] = {}
        self._effects: list = []  # effects of the call in progress
        self._continuing: Entry | None = None  # the entry the call in progress appends turns to (`_continued`)

    def _drain(self, *first) -> tuple:
        effects, self._effects = (*first, *self._effects), []
        return effects

    # -- producer messages --------------------------------------------------
    def handle(self, message: Message, wall: float, stored: StoredDigests = NOTHING_STORED, *,
               producer: Producer | None = None) -> Reply:
        """Apply one decoded `turn`, `end`, `abort` or `reward` at wall time `wall`
        from `producer` (its hello's id, and its key under CURVE, recorded
        with a new trajectory).
        `stored` holds the digests `stored_digests_needed` named, read from
        the store (None: the read failed, and a resend that needs it is
        refused `unavailable`)."""
        try:
            return self._handle(message, wall, stored, producer)
        finally:
            if self._continuing is not None:
                self._continued(wall)

    def handle_turns(self, messages: list[Message], wall: float, stored: StoredDigests = NOTHING_STORED, *,
                     producer: Producer | None = None) -> list[Reply | Exception]:
        """`handle` each of `messages` (one message, or consecutive `turn`s of
        one trajectory), in order, each answered as `handle` answers it
        alone; the trajectory's indexes (expiry and eviction order, the bytes
        it holds, its group's clock) are brought up to date once, after the
        last, instead of per turn. A failure no rule foresaw is given back in
        its message's place, and the messages after it are handled on."""
        results: list[Reply | Exception] = []
        try:
            for message in messages:
                try:
                    results.append(self._handle(message, wall, stored, producer))
                except Exception as exc:
                    results.append(exc)
        finally:
            if self._continuing is not None:
                self._continued(wall)
        return results

    def _handle(self, message: Message, wall: float, stored: StoredDigests, producer: Producer | None) -> Reply:
        kind = message.type
        if kind not in ("turn", "end", "abort", "reward"):
            raise InvalidInput(f"the merge engine takes turn, end, abort and reward messages, got {kind!r}")
        tid = message.fields["trajectory_id"]
        entry = self.entries.get(tid)
        if entry is not None and entry.state == DEAD and entry.dead_reason in GIVEN_UP:
            # Not a duplicate of anything applied: the producer must not count its end (or reward) as taken.
            return Reply(_ack(message, False, reason=entry.dead_reason))
        remembered = self.dedup.get(tid)
        if (remembered is not None and remembered >= wall) or (entry is not None and entry.state == TRAINED):
            # Taken for good: one answer from the trainer's ack on, whether a seal has reclaimed the data yet or
            # not (docs/protocol.md, "Remembered ids").
            return Reply(_ack(message, False, duplicate=True))
        try:
            if kind == "turn":
                fields, effects = self._turn(message, wall, stored, producer)
            elif kind == "end":
                fields, effects = self._end(message, wall)
            elif kind == "reward":
                fields, effects = self._reward(message, wall)
            else:
                fields, effects = self._abort(message, wall)
        except ProtocolError as error:
            self._effects.clear()
            return Reply(error=error.as_remote().with_seq(message["seq"]))
        except Exception:
            self._effects.clear()  # a failure no rule foresaw leaves none of its effects to the next message
            raise
        return Reply(fields, effects=self._drain(*effects))

    def stored_digests_needed(self, messages: Iterable[Message]) -> list[tuple[str, int]]:
        """The (trajectory id, turn) of every resent applied turn among
        `messages` whose digest only the store holds now: read them for
        `handle` (a resend is compared with what was applied)."""
        needed = []
        entries, unsaved = self.entries, self._unsaved
        for message in messages:
            if message.type != "turn":
                continue
            fields = message.fields
            tid, index = fields["trajectory_id"], fields["turn"]
            entry = entries.get(tid)
            if (entry is not None and entry.state not in (LEFT, TRAINED) and index < entry.next_turn
                    and entry.outcomes[index][0] is None and (tid, index) not in unsaved):
                needed.append((tid, index))
        return needed

    def _turn(self, message: Message, wall: float, stored: StoredDigests, producer: Producer | None) -> tuple[dict, tuple]:
        fields = message.fields
        tid, index = fields["trajectory_id"], fields["turn"]
        entry = self.entries.get(tid)
        if entry is None or entry.state == LEFT:
            if index != 0:
                raise RemoteProtocolError("out_of_order", f"trajectory {tid!r} is unknown; expected turn 0, got {index}",
                                          expected=0)
            return self._start(message, wall, entry is not None, producer)
        next_turn = entry.next_turn
        if index < next_turn:
            earlier, applied, reason = entry.outcomes[index]
            if (earlier if earlier is not None else self._applied_digest(tid, index, stored)) != content_digest(message):
                raise RemoteProtocolError("conflict", f"turn {index} of {tid!r} was already received with different content")
            return _ack(message, applied, reason=reason, duplicate=True), ()
        if entry.state != OPEN:
            return _ack(message, False, reason="after_terminal"), ()
        traj = entry.trajectory
        assert traj is not None  # an open entry always holds its trajectory (at most shed)
        if traj.terminal:
            return _ack(message, False, reason="replay_gap" if traj.gap else "after_terminal"), ()
        if index > next_turn:
            raise RemoteProtocolError("out_of_order", f"turn {index} of {tid!r} arrived before turn {next_turn}",
                                      expected=next_turn)
        outcome = traj.append_turn(turn_from_message(message))
        if outcome.applied:
            entry.stored_bytes += sum(map(len, message.frames))
            self._versions(entry, message)
        digest = self._digest_unless_applied(message, index, outcome.applied)
        entry.outcomes.append((digest, outcome.applied, outcome.reason))
        self._continuing = entry  # its indexes follow once the call is done (`_continued`)
        effects: tuple[Effect, ...] = (
            PutTurn(tid, index, digest, outcome.applied, outcome.reason, message if outcome.applied else None, wall),
        )
        if outcome.reason == "replay_gap":
            gap = traj.gap
            assert gap is not None  # `append_turn` cut it there
            effects += (MarkGap(tid, gap),)
        return _ack(message, outcome.applied, reason=outcome.reason), effects

    def _continued(self, wall: float) -> None:
        """The indexes of the open entry turns were just appended to, as they
        are after its latest turn: continued at `wall`, last in expiry and
        eviction order, its bytes counted again (a gap can also shrink them)
        and its group touched."""
        entry, self._continuing = self._continuing, None
        assert entry is not None and entry.trajectory is not None  # set by `_turn` for an open, held entry
        tid = entry.trajectory_id
        entry.updated_at = wall
        self._open.move_to_end(tid)
        if tid in self._resident_open:
            self._resident_open.move_to_end(tid)
        self._grow(entry, entry.trajectory)
        self._touch_group(entry, wall)

    def _start(self, message: Message, wall: float, replaces: bool, producer: Producer | None) -> tuple[dict, tuple]:
        tid = message["trajectory_id"]
        group_id, group_size = message.get("group_id"), message.get("group_size")
        if group_id is not None:
            self._check_join(tid, group_id, group_size)
        traj = Trajectory(
            tid,
            message.arrays["prompt_tokens"],
            group_id=group_id,
            group_size=group_size,
            sample_index=message.get("sample_index"),
            metadata=message.get("metadata"),
        )
        outcome = traj.append_turn(turn_from_message(message))  # raises, changing nothing, when refused
        digest = self._digest_unless_applied(message, 0, outcome.applied)
        entry = Entry(tid, OPEN, group_id, group_size, message.get("sample_index"), [(digest, outcome.applied, outcome.reason)],
                      updated_at=wall, stored_bytes=sum(map(len, message.frames)), producer=producer)
        if outcome.applied:
            self._versions(entry, message)
        if replaces:
            self._remove(tid)
        self._add(entry)
        self._hold(entry, traj)
        if group_id is not None:
            group = self.groups.get(group_id)
            if group is None:
                group = self.groups[group_id] = self._idle_groups[group_id] = Group(group_size)
            self._set_member(group, tid, OPEN)
            self._touch_group(entry, wall)
        effects = (
            OpenTrajectory(tid, group_id, group_size, entry.sample_index, wall, replaces,
                           None if producer is None else producer.producer_id, None if producer is None else producer.key),
            PutTurn(tid, 0, digest, outcome.applied, outcome.reason, message, wall),
        )
        return _ack(message, outcome.applied, reason=outcome.reason), effects

    def _versions(self, entry: Entry, message: Message) -> None:
        """An applied turn's versions join its entry's oldest step and what sampled it."""
        fields = message.fields
        if "weight_version" not in fields and "weight_version_spans" not in fields:
            return  # sampled by weights it does not name
        versions = [v for v in map(parse_version, turn_versions(message)) if v is not None]
        if versions:
            oldest = min(v.step for v in versions)
            entry.version = oldest if entry.version is None else min(entry.version, oldest)
            entry.sampled = add_sampled(entry.sampled, versions, self.epochs.get(job_of(entry.trajectory_id), 0))

    def _digest_unless_applied(self, message: Message, index: int, applied: bool) -> bytes | None:
        """None for an applied turn (kept until `saved()`; its record stands
        for it after that); the digest of one that was consumed unapplied,
        which is stored nowhere else."""
        if applied:
            self._unsaved[(message.fields["trajectory_id"], index)] = message
            return None
        return content_digest(message)

    def _applied_digest(self, tid: str, index: int, stored: StoredDigests) -> bytes:
        unsaved = self._unsaved.get((tid, index))
        if unsaved is not None:
            return content_digest(unsaved)
        try:
            digest = stored[(tid, index)]
        except KeyError:
            raise InternalError(f"turn {index} of {tid!r} was saved, and its digest was not read for this call "
                                f"(stored_digests_needed names every one a message needs)") from None
        if digest is None:
            raise RemoteProtocolError("unavailable", f"the broker cannot read turn {index} of {tid!r} back from its "
                                                     f"store to compare the resend; resend later")
        return digest

    def saved(self) -> None:
        """Everything handled so far is durable: applied turns' digests now
        come from the store."""
        self._unsaved.clear()

    def _check_join(self, tid: str, group_id: str, group_size: int) -> None:
        group = self.groups.get(group_id)
        if group is None:
            return
        if group.size != group_size:
            raise RemoteProtocolError("conflict",
                                f"group {group_id!r} has group_size {group.size}, turn 0 of {tid!r} says {group_size}")
        if tid not in group.members and len(group.members) >= group.size:
            raise RemoteProtocolError("conflict", f"group {group_id!r} already has its {group.size} members; {tid!r} is not one")
        if group.deliverable:
            raise RemoteProtocolError("conflict", f"group {group_id!r} is already complete and deliverable")

    def _end(self, message: Message, wall: float) -> tuple[dict, tuple]:
        tid = message["trajectory_id"]
        entry = self.entries.get(tid)
        if entry is None or entry.state == LEFT:
            raise RemoteProtocolError("unknown_trajectory", f"end for trajectory {tid!r}, which this broker does not hold")
        digest = content_digest(message)
        if entry.state != OPEN:
            if entry.end_digest == digest:
                return _ack(message, True, duplicate=True), ()
            raise RemoteProtocolError("conflict", f"trajectory {tid!r} already ended with a different end message")
        traj = entry.trajectory
        assert traj is not None  # an open entry always holds its trajectory (at most shed)
        self._check_turn_count(message, entry, traj)
        traj.metadata.update(message.get("metadata") or {})
        entry.end_digest, entry.updated_at = digest, wall
        if "reward" not in message.fields:  # its reward comes later, in a `reward` message
            self._set_state(entry, SCORING)
            return _ack(message, True), (EndTrajectory(tid, None, traj.metadata, digest, wall, entry.version, True,
                                                         entry.sampled),)
        traj.reward = entry.reward = message["reward"]
        self._set_state(entry, ENDED)
        effect = EndTrajectory(tid, traj.reward, traj.metadata, digest, wall, entry.version, sampled=entry.sampled)
        self._member_done(entry, ENDED, wall)
        return _ack(message, True), (effect,)

    def _reward(self, message: Message, wall: float) -> tuple[dict, tuple]:
        """A `scoring` trajectory's reward: it is queued (its group, once complete)."""
        tid, reward = message["trajectory_id"], message["reward"]
        entry = self.entries.get(tid)
        if entry is None or entry.state == LEFT:
            raise RemoteProtocolError("unknown_trajectory", f"reward for trajectory {tid!r}, which this broker does not hold")
        if entry.state == OPEN:
            raise RemoteProtocolError("out_of_order", f"reward for trajectory {tid!r} before its end: send it once the "
                                      "end is acknowledged")
        if entry.state != SCORING:
            if entry.reward == reward:
                return _ack(message, True, duplicate=True), ()
            raise RemoteProtocolError("conflict", f"trajectory {tid!r} already has reward {entry.reward!r}, got {reward!r}")
        entry.reward, entry.updated_at = reward, wall
        if entry.trajectory is not None:
            entry.trajectory.reward = reward
        self._set_state(entry, ENDED)
        self._member_done(entry, ENDED, wall)
        return _ack(message, True), (SetReward(tid, reward, wall),)

    @staticmethod
    def _check_turn_count(message: Message, entry: Entry, traj: Trajectory) -> None:
        """An `end` that says how many turns its producer sent must find
        them all consumed, so a lost turn can never end a trajectory short.
        Turns sent after the trajectory became terminal were answered
        `after_terminal` without being consumed, so a terminal trajectory
        may have consumed fewer."""
        sent = message.get("turns")
        if sent is None:
            return
        consumed = entry.next_turn
        if sent < consumed:
            raise RemoteProtocolError("conflict", f"end of {entry.trajectory_id!r} says {sent} turns were sent, "
                                            f"the broker has consumed {consumed}")
        if sent > consumed and not traj.terminal:
            raise RemoteProtocolError("out_of_order", f"end of {entry.trajectory_id!r} says {sent} turns were sent, "
                                                f"the broker has consumed {consumed}; resend turn {consumed} first",
                                expected=consumed)

    def _abort(self, message: Message, wall: float) -> tuple[dict, tuple]:
        tid = message["trajectory_id"]
        entry = self.entries.get(tid)
        if entry is None or entry.state == LEFT:
            return _ack(message, False, reason="unknown_trajectory"), ()
        if entry.state != OPEN:
            raise RemoteProtocolError("conflict", f"trajectory {tid!r} already ended; it can no longer be aborted")
        keep = entry.group_id is not None
        self._remove(tid)
        if keep:
            self._add(Entry(tid, LEFT, entry.group_id, entry.group_size, entry.sample_index, updated_at=wall))
            if message.get("again"):  # produced again from turn 0: its group waits for it as for an open member
                self._touch_group(entry, wall)
            else:
                self._member_done(entry, LEFT, wall)
        return _ack(message, True), (DropTrajectory(tid, keep),)

    # -- groups -------------------------------------------------------------
    def _touch_group(self, entry: Entry, wall: float) -> None:
        if entry.group_id is not None:
            self.groups[entry.group_id].updated_at = wall
            if entry.group_id in self._idle_groups:
                self._idle_groups.move_to_end(entry.group_id)

    def _member_done(self, entry: Entry, state: State, wall: float) -> None:
        if entry.group_id is None:
            if state == ENDED:
                self.queued_units.append(DeliveryUnit((entry.trajectory_id,), version=entry.version))
            return
        group = self.groups[entry.group_id]
        self._set_member(group, entry.trajectory_id, state)
        self._touch_group(entry, wall)
        if group.complete:
            self._make_deliverable(entry.group_id, group, wall)

    def _set_member(self, group: Group, tid: str, state: State) -> None:
        """Every member state change comes here, so `awaiting_group` stays counted."""
        if not group.deliverable:
            self._awaiting_group += (state == ENDED) - (group.members.get(tid) == ENDED)
        group.members[tid] = state

    def _leave_idle(self, group_id: str, group: Group) -> None:
        """The group becomes deliverable or closes: its ended members no longer await it."""
        if self._idle_groups.pop(group_id, None) is not None:
            self._awaiting_group -= sum(1 for state in group.members.values() if state == ENDED)

    def _make_deliverable(self, group_id: str, group: Group, wall: float) -> None:
        """The group is complete: its ended members are queued together, or
        dead-lettered `filtered:<filter>` when a group filter drops them."""
        ended = tuple(tid for tid, state in group.members.items() if state == ENDED)
        self._leave_idle(group_id, group)
        group.pending = set(ended)
        self._effects.append(GroupDeliverable(group_id, group.size))
        dropping = first_dropping(self.settings.group_filters, [
            scalar_reward(self.entries[tid].reward, self.settings.reward_key) for tid in ended])
        if dropping is not None:
            for tid in ended:
                self._effects.append(DeadLetter(tid, f"filtered:{dropping.name}", wall))
                entry = self.entries[tid]
                self._kill(entry, f"filtered:{dropping.name}", wall)
                self._done_in_group(entry)
            if group_id in self.groups:  # no ended member: nothing closed it
                self._close_group(group_id)
        elif ended:
            self.queued_units.append(DeliveryUnit(ended, group_id, group.size, group.size - len(ended),
                                                 self.oldest(ended)))
        else:
            self._close_group(group_id)

    def _close_group(self, group_id: str) -> None:
        """Every ended member is gone: drop the group and its LEFT markers."""
        group = self.groups.pop(group_id)
        self._leave_idle(group_id, group)
        self._effects.append(CloseGroup(group_id))
        for tid in group.members:
            entry = self.entries.get(tid)
            if entry is not None and entry.state == LEFT:
                self._remove(tid)

    def _done_in_group(self, entry: Entry) -> None:
        """An ended member of a deliverable group was delivered or dead-lettered."""
        group_id = entry.group_id
        if not group_id:
            return
        group = self.groups.get(group_id)
        if group is None or group.pending is None:  # not deliverable
            return
        group.pending.discard(entry.trajectory_id)
        if not group.pending:
            self._close_group(group_id)

    # -- time ---------------------------------------------------------------
    def expire(self, wall: float) -> list:
        """Expire idle open trajectories (dead letter `expired`), close idle
        incomplete groups, and forget dedup records past their window."""
        ttl = self.settings.trajectory_ttl
        for index, reason in ((self._open, "expired"), (self._scoring, "reward_expired")):
            for _, entry in _idle_since(index, wall - ttl):
                self._give_up(entry, reason, wall)
        for group_id, group in _idle_since(self._idle_groups, wall - ttl):
            if any(getattr(self.entries.get(tid), "state", None) in (OPEN, SCORING) for tid, state in group.members.items()
                   if state in (OPEN, SCORING)):  # its frames touch its group (not one aborted to go again)
                continue
            self._make_deliverable(group_id, group, wall)  # members that never started count as left
        expiry = self._dedup_expiry
        while expiry and expiry[0][0] < wall:
            until, tid = heapq.heappop(expiry)
            if self.dedup.get(tid) == until:  # not remembered again since
                del self.dedup[tid]
                self.pruned.pop(tid, None)
        return list(self._drain())

    def give_up(self, job: str, judge: Callable[[Entry], bool], reason: str, wall: float) -> list:
        """Dead-letter `job`'s open and scoring trajectories that `judge`
        says can no longer be trained (weights of an abandoned lineage
        sampled them, or they are already too stale): their producers'
        further frames are answered not applied, with `reason`."""
        for index in (self._open, self._scoring):
            for tid, entry in list(index.items()):
                if job_of(tid) == job and judge(entry):
                    self._give_up(entry, reason, wall)
        return list(self._drain())

    def prune_dead(self, budget: int, wall: float) -> tuple[list, Counter[str]]:
        """Forget the oldest dead letters (data deleted, id remembered) while
        they hold more than `budget` bytes: dead letters are kept for
        inspection, not without end. Returns the effects and how many went,
        by reason."""
        gone: Counter[str] = Counter()
        effects: list = []
        while self.dead_bytes > budget and self._dead:
            tid, entry = next(iter(self._dead.items()))
            reason = entry.dead_reason or "dead"
            gone[reason] += 1
            effects.append(self._forget(tid, wall, dead=(reason, entry.dead_at or wall)))
        return effects, gone

    def _give_up(self, entry: Entry, reason: str, wall: float) -> None:
        """An unfinished trajectory is dead-lettered; its id is remembered,
        so its producer's later frames are answered with `reason`."""
        until = wall + self.settings.dedup_window
        self._effects.append(DeadLetter(entry.trajectory_id, reason, wall, dedup_until=until))
        self.remember({entry.trajectory_id: until})
        self._kill(entry, reason, wall)

    def _kill(self, entry: Entry, reason: str, wall: float) -> None:
        was_open = entry.state in (OPEN, SCORING)  # its group still counted it as to come
        entry.dead_reason, entry.dead_at = reason, wall
        self._drop_arrays(entry)
        self._set_state(entry, DEAD)
        if was_open:
            self._member_done(entry, LEFT, wall)

    def remember(self, records: Mapping[str, float]) -> None:
        """Refuse these trajectory ids as duplicates until their times (also
        how recovery restores the dedup records)."""
        self.dedup.update(records)
        expiry = self._dedup_expiry
        if len(records) > len(expiry):
            expiry += [(until, tid) for tid, until in records.items()]
            heapq.heapify(expiry)
        else:
            for tid, until in records.items():
                heapq.heappush(expiry, (until, tid))

    # -- consumer outcomes --------------------------------------------------
    def _ended_entry(self, tid: str, what: str) -> Entry:
        """`tid`'s entry, which must be ended (not yet delivered) for `what`."""
        entry = self.entries.get(tid)
        if entry is None or entry.state != ENDED:
            raise InvalidInput(f"only an ended trajectory can be {what}: {tid!r} is "
                             f"{'unknown' if entry is None else entry.state}, expected {ENDED}")
        return entry

    def sent(self, tid: str, wall: float) -> None:
        """`tid` went out to a consumer at wall time `wall` (what the archive records of its deliveries)."""
        entry = self.entries[tid]
        entry.deliveries += 1
        if entry.first_delivered_at is None:
            entry.first_delivered_at = wall

    def delivered(self, tid: str, wall: float) -> list:
        """A consumer committed `tid`: forget its data, remember its id."""
        self._ended_entry(tid, "delivered")
        self._done_in_group(self.entries[tid])
        return [self._forget(tid, wall, committed=True), *self._drain()]

    def _forget(self, tid: str, wall: float, dead: tuple[str, float] | None = None, committed: bool = False) -> Forget:
        """Delete `tid`'s data and remember its id; `dead`: a dead letter's
        reason and time; `committed`: a commit deletes it now."""
        entry = self.entries[tid]
        self._remove(tid)
        trained = self.trained_entries.pop(tid, None)
        if trained is not None:
            self.trained_bytes -= trained.stored_bytes
            self._untrain_step(trained)
        until = wall + self.settings.dedup_window
        self.remember({tid: until})
        reason, dead_at = (None, None) if dead is None else dead
        if dead is not None:
            self.pruned[tid] = dead
        return Forget(tid, until, reason, dead_at, entry.first_delivered_at, entry.deliveries,
                      wall if committed else None)

    def trained(self, tid: str, at: TrainedAt, wall: float | None = None) -> list:
        """A checkpointing trainer trained `tid` (ended, or trained before
        and now trained again by a resumed lineage): keep its data, out of
        memory, until a seal reclaims it."""
        entry = self.entries.get(tid)
        if entry is None or entry.state not in (ENDED, TRAINED):
            raise InvalidInput(f"only an ended or trained trajectory can be trained: {tid!r} is "
                               f"{'unknown' if entry is None else entry.state}, expected {ENDED} or {TRAINED}")
        self._drop_arrays(entry)
        if entry.state == ENDED:
            self._set_state(entry, TRAINED)
            self._done_in_group(entry)
            self.trained_entries[tid] = entry
            self.trained_bytes += entry.stored_bytes
        else:
            self._untrain_step(entry)
        entry.trained = at
        self._trained_steps[at.step] += 1
        return [MarkTrained(tid, at, wall, entry.first_delivered_at, entry.deliveries), *self._drain()]

    def _untrain_step(self, entry: Entry) -> None:
        """`entry` no longer counts at the step it was trained at."""
        assert entry.trained is not None  # a TRAINED entry records where
        step = entry.trained.step
        self._trained_steps[step] -= 1
        if not self._trained_steps[step]:
            del self._trained_steps[step]

    def seal(self, run: str, lineage: str, step: int, keep: int, wall: float, *, resume: bool = False) -> list:
        """Checkpoint `step` of `run` is durable: reclaim what the run
        trained at or before its `keep`-th latest sealed checkpoint. A
        resume's seal from a lineage new to the broker first drops the
        seals the abandoned lineage made after `step`."""
        state = self.runs.setdefault(run, Run(lineage))
        if resume and state.lineage != lineage:
            state.seals = [s for s in state.seals if s <= step]
            state.lineage = lineage
        if step not in state.seals:
            state.seals = sorted([*state.seals, step])
        effects: list = []
        if len(state.seals) >= keep and state.seals[-keep] > state.reclaimed:
            effects = self._reclaim(run, state.seals[-keep], wall)
        state.seals = state.seals[-keep:]
        return [*effects, SealRun(run, state.lineage, tuple(state.seals), state.reclaimed), *self._drain()]

    def _reclaim(self, run: str, through: int, wall: float) -> list:
        """Forget what `run` trained at or before step `through`."""
        self.runs[run].reclaimed = max(self.runs[run].reclaimed, through)
        gone = [tid for tid, e in self.trained_entries.items()
                if e.trained is not None and e.trained.run == run and e.trained.step <= through]
        return [self._forget(tid, wall) for tid in gone]

    def end_run(self, run: str, wall: float) -> list:
        """`run` is over: reclaim everything it trained, the steps no seal
        reclaimed yet included (a resume of it is then `checkpoint_gone`).
        Nothing for a run this broker holds nothing of."""
        steps = [e.trained.step for e in self.trained_entries.values() if e.trained is not None and e.trained.run == run]
        if not steps:
            return []
        state = self.runs.setdefault(run, Run(""))
        effects = self._reclaim(run, max(steps), wall)
        return [*effects, SealRun(run, state.lineage, tuple(state.seals), state.reclaimed), *self._drain()]

    def reclaim_over(self, budget: int, wall: float) -> tuple[list, list[tuple[str, int]]]:
        """Over `budget` trained bytes: reclaim the oldest steps (a run's
        resume from before them is then refused `checkpoint_gone`) down to
        nine tenths of it. Returns the effects and each (run, step) reclaimed through."""
        if self.trained_bytes <= budget:
            return [], []
        by_step = sorted((e.trained.step, e.trained.run, e.stored_bytes) for e in self.trained_entries.values()
                         if e.trained is not None)
        through: dict[str, int] = {}
        left = self.trained_bytes
        for step, run, size in by_step:
            if left <= budget * 9 // 10:
                break
            through[run] = step
            left -= size
        effects = []
        for run, step in through.items():
            state = self.runs.setdefault(run, Run(""))
            effects += self._reclaim(run, step, wall)
            effects.append(SealRun(run, state.lineage, tuple(state.seals), state.reclaimed))
        return [*effects, *self._drain()], sorted(through.items())

    def oldest_trained_step(self) -> int | None:
        """The earliest step any trajectory held as trained was trained at."""
        return min(self._trained_steps, default=None)

    def resumable(self, run: str, step: int) -> None:
        """Raise `checkpoint_gone` when `run`'s trajectories trained after
        `step` may already be reclaimed."""
        state = self.runs.get(run)
        if state is not None and step < state.reclaimed:
            raise RemoteProtocolError("checkpoint_gone", f"checkpoint at step {step} of run {run!r} is gone: this broker "
                                      f"reclaimed what the run trained through step {state.reclaimed} (keep_checkpoints)")

    def replayable(self, run: str, lineage: str, after: int) -> list[Entry]:
        """What `run` trained after `step` in another lineage than
        `lineage`: a resumed trainer's batches to train again, by step and
        position."""
        found = [e for e in self.trained_entries.values() if e.trained is not None and e.trained.run == run
                 and e.trained.step > after and e.trained.lineage != lineage]
        return sorted(found, key=lambda e: (e.trained.step, e.trained.position))  # type: ignore[union-attr]

    def dead_letter(self, tid: str, reason: str, wall: float) -> list:
        """A consumer refused `tid` (or it ran out of deliveries, or it cannot be read back)."""
        entry = self._ended_entry(tid, "dead-lettered")
        self._kill(entry, reason, wall)
        self._done_in_group(entry)
        return list(self._drain(DeadLetter(tid, reason, wall)))

    def unreadable(self, tid: str) -> bool:
        """Reading ended `tid` back from the store found its records damaged
        (not a passing I/O error). True on the `UNREADABLE_AFTER`th time:
        dead-letter it (reason `unreadable`); until then it is read again
        once the store's probe succeeds."""
        entry = self.entries[tid]
        if entry.state != ENDED:
            raise InvalidInput(f"only an ended trajectory is read back to be delivered; {tid!r} is {entry.state}, "
                               f"expected {ENDED}")
        entry.unreadable += 1
        return entry.unreadable >= UNREADABLE_AFTER

    def revive(self, tid: str, wall: float) -> list:
        """Move a dead letter back to the queue, if it had ended with its reward:
        one given up unfinished (expired, or stale or abandoned before its
        end or reward came) never comes back, lest it be delivered as if
        complete. A group member goes back to its group: one still forming
        counts it ended; a deliverable one waits for it too; a closed one is
        made deliverable again, with it alone, so a restart finds it queued."""
        entry = self.entries.get(tid)
        if entry is None or entry.state != DEAD or entry.reward is None:
            return []
        entry.dead_reason, entry.dead_at, entry.unreadable = None, None, 0
        self._set_state(entry, ENDED)
        self._effects.append(Revive(tid))
        group_id, size = entry.group_id, entry.group_size
        group = None if group_id is None else self.groups.get(group_id)
        if group_id is None:
            self.queued_units.append(DeliveryUnit((tid,), version=entry.version))
        elif group is not None and not group.deliverable:
            self._member_done(entry, ENDED, wall)
        else:
            assert size is not None  # stored with its group id
            if group is None:
                group = self.groups[group_id] = Group(size, updated_at=wall, pending=set())
                self._effects.append(GroupDeliverable(group_id, size))
            assert group.pending is not None  # deliverable
            self._set_member(group, tid, ENDED)
            group.pending.add(tid)
            self.queued_units.append(DeliveryUnit((tid,), group_id, size, size - 1, entry.version))
        return list(self._drain())

    # -- memory -------------------------------------------------------------
    def evict(self, target: float, leased: set[str] | frozenset = frozenset()) -> dict[State, int]:
        """Drop merged trajectories' arrays from memory (all are durable in
        the store) until at most `target` bytes are held: ended ones first,
        newest first (consumers take the oldest first, so these are needed
        last), then open ones, least recently continued first, and last
        those in `leased` (out on a lease: most are acked before they are
        needed again), newest first. Each is read back when delivered (again).
        An open one keeps merging its next frames meanwhile, shed
        (`Trajectory.shed`: what the merge rules need, no arrays), so a
        busy broker with more open trajectories than its budget holds never
        rebuilds one to merge into it. Open ones must be evictable: were the
        budget full of trajectories waiting for their `end`, and producer
        frames paused, those ends would never be read; leased ones too, or a
        consumer's prefetch would hold the broker over its budget. Costs what
        it evicts (plus the leased ones it passes). Returns how many of each
        state."""
        evicted = dict.fromkeys((ENDED, OPEN), 0)
        ended, open_ = self._resident_ended, self._resident_open
        passes = (lambda: [e for e in reversed(ended.values()) if e.trajectory_id not in leased],
                  lambda: list(open_.values()),
                  lambda: [e for e in reversed(ended.values()) if e.trajectory_id in leased])
        for resident in passes:  # each listed when reached: evicting changes what is resident
            for entry in resident():
                if self.bytes_in_memory <= target:
                    return evicted
                if entry.state == OPEN:
                    self._shed(entry)
                else:  # ended (or scoring: ended, its reward to come)
                    self._drop_arrays(entry)
                evicted[OPEN if entry.state == OPEN else ENDED] += 1
        return evicted

    def needs_reload(self, entry: Entry) -> bool:
        """Its arrays are only in the store (evicted, or not loaded at start)."""
        return entry.trajectory is None or entry.trajectory.is_shed

    def evicted_open(self) -> set[str]:
        """Open trajectories whose arrays are only in the store (a scan of
        the open ones: for inspection, not for the hot path)."""
        return {tid for tid, entry in self._open.items() if self.needs_reload(entry)}

    def reload(self, entry: Entry, trajectory: Trajectory) -> None:
        """An evicted trajectory read back from the store."""
        self._hold(entry, trajectory)

    def restore(self, entries: Iterable[Entry], deliverable_groups: Collection[str], dedup: Mapping[str, float],
                order: Mapping[str, int], runs: Mapping[str, Run] = MappingProxyType({}),
                pruned: Mapping[str, tuple[str, float]] = MappingProxyType({})) -> list[DeliveryUnit]:
        """Fill this empty engine with stored `entries` (open ones holding
        their replayed trajectories): groups rebuilt from their members,
        those in `deliverable_groups` deliverable again, `dedup` remembered
        (`pruned`: the dead letters among them, with reason and time).
        Returns the units to deliver, by `order` (queue sequence) of their
        first member: an ended trajectory outside a group, or the ended
        members of a deliverable group."""
        if self.entries or self.groups:
            raise InvalidInput(f"restore fills an empty engine; this one holds {len(self.entries)} trajectories")
        for entry in entries:
            self.entries[entry.trajectory_id] = entry
            if entry.group_id is not None:
                assert entry.group_size is not None  # stored with its group id
                group = self.groups.setdefault(entry.group_id, Group(entry.group_size))
                group.members[entry.trajectory_id] = LEFT if entry.state == DEAD else entry.state
                group.updated_at = max(group.updated_at, entry.updated_at)
        self.remember(dedup)
        self.pruned.update((tid, dead) for tid, dead in pruned.items() if tid in self.dedup)
        self.runs.update(runs)
        self.trained_entries.update((e.trajectory_id, e) for e in self.entries.values() if e.state == TRAINED)
        self.trained_bytes = sum(e.stored_bytes for e in self.trained_entries.values())
        self._trained_steps = Counter(e.trained.step for e in self.trained_entries.values() if e.trained is not None)
        queued: list[tuple[int, DeliveryUnit]] = []
        for group_id, group in self.groups.items():
            if group_id in deliverable_groups:  # made deliverable in the commit of the frame that completed the group
                ended = tuple(tid for tid, state in group.members.items() if state == ENDED)
                group.pending = set(ended)
                if ended:
                    queued.append((min(order[tid] for tid in ended),
                                  DeliveryUnit(ended, group_id, group.size, group.size - len(ended),
                                               self.oldest(ended))))
        self._reindex()
        for entry in self.entries.values():
            if entry.state == ENDED and entry.group_id is None:
                queued.append((order[entry.trajectory_id], DeliveryUnit((entry.trajectory_id,), version=entry.version)))
        return [unit for _, unit in sorted(queued, key=lambda pair: pair[0])]

    def _reindex(self) -> None:
        """Rebuild the indexes from `entries` and `groups` as `restore`
        filled them: counts, recency by `updated_at`, residency and bytes."""
        self._counts = dict.fromkeys(STATES, 0)
        self.untrained.clear()
        self._open.clear()
        self._scoring.clear()
        self._dead.clear()
        self.dead_bytes = 0
        self._idle_groups.clear()
        self._resident_ended.clear()
        self._resident_open.clear()
        self.bytes_in_memory = 0
        for entry in sorted(self.entries.values(), key=lambda e: e.updated_at):
            trajectory, entry.trajectory, entry.held = entry.trajectory, None, 0
            self._index(entry)
            if trajectory is not None:
                self._hold(entry, trajectory)
        self._awaiting_group = 0
        for group_id, group in sorted(self.groups.items(), key=lambda item: item[1].updated_at):
            if not group.deliverable:
                self._idle_groups[group_id] = group
                self._awaiting_group += sum(1 for state in group.members.values() if state == ENDED)
        self._dead = OrderedDict(sorted(self._dead.items(), key=lambda item: item[1].dead_at or 0.0))

    def _add(self, entry: Entry) -> None:
        self.entries[entry.trajectory_id] = entry
        self._index(entry)

    def _index(self, entry: Entry) -> None:
        self._counts[entry.state] += 1
        if entry.state in UNTRAINED:
            self.untrained[job_of(entry.trajectory_id)] += 1
        if entry.state == OPEN:
            self._open[entry.trajectory_id] = entry
        elif entry.state == SCORING:
            self._scoring[entry.trajectory_id] = entry
        elif entry.state == DEAD:
            self._dead[entry.trajectory_id] = entry
            self.dead_bytes += entry.stored_bytes

    def _remove(self, tid: str) -> Entry:
        entry = self.entries.pop(tid)
        self._drop_arrays(entry)
        self._counts[entry.state] -= 1
        if entry.state in UNTRAINED:
            self.untrained[job_of(tid)] -= 1
        if self._dead.pop(tid, None) is not None:
            self.dead_bytes -= entry.stored_bytes
        self._open.pop(tid, None)
        self._scoring.pop(tid, None)
        return entry

    def _set_state(self, entry: Entry, state: State) -> None:
        tid = entry.trajectory_id
        self._counts[entry.state] -= 1
        self._counts[state] += 1
        if (entry.state in UNTRAINED) != (state in UNTRAINED):
            self.untrained[job_of(tid)] += 1 if state in UNTRAINED else -1
        if entry.state == OPEN:
            self._open.pop(tid, None)
            if self._resident_open.pop(tid, None) is not None and state in (ENDED, SCORING):
                self._resident_ended[tid] = entry
        if entry.state == SCORING:
            self._scoring.pop(tid, None)
        elif state == SCORING:
            self._scoring[tid] = entry
        if entry.state == DEAD:  # revived
            self._dead.pop(tid, None)
            self.dead_bytes -= entry.stored_bytes
        elif state == DEAD:
            self._dead[tid] = entry
            self.dead_bytes += entry.stored_bytes
        entry.state = state

    def _hold(self, entry: Entry, trajectory: Trajectory) -> None:
        self._drop_arrays(entry)
        entry.trajectory, entry.held = trajectory, 0
        self._grow(entry, trajectory)
        if not trajectory.is_shed:
            (self._resident_open if entry.state == OPEN else self._resident_ended)[entry.trajectory_id] = entry

    def _grow(self, entry: Entry, trajectory: Trajectory) -> None:
        """Count the entry's trajectory as it is now (O(1): it keeps its own size)."""
        held = held_bytes(trajectory)
        self.bytes_in_memory += held - entry.held
        entry.held = held

    def _shed(self, entry: Entry) -> None:
        trajectory = entry.trajectory
        assert trajectory is not None  # only resident trajectories are shed
        trajectory.shed()
        self._resident_open.pop(entry.trajectory_id, None)
        self._grow(entry, trajectory)

    def _drop_arrays(self, entry: Entry) -> None:
        if entry.trajectory is None:
            return
        self.bytes_in_memory -= entry.held
        entry.trajectory, entry.held = None, 0
        self._resident_open.pop(entry.trajectory_id, None)
        self._resident_ended.pop(entry.trajectory_id, None)

    # -- reading ------------------------------------------------------------
    def counts(self) -> dict[State, int]:
        return dict(self._counts)

    def awaiting_group(self) -> int:
        """Ended members of groups not complete yet: durable, and delivered
        with their group (or without the missing members once it idles for
        `trajectory_ttl`), but neither queued nor leased until then."""
        return self._awaiting_group

    def oldest(self, trajectory_ids: Iterable[str]) -> int | None:
        """The oldest ordered policy version among `trajectory_ids` (a unit's version)."""
        versions = [v for v in (self.entries[tid].version for tid in trajectory_ids) if v is not None]
        return min(versions, default=None)

    def name_producer(self, trajectory_ids: Iterable[str], producer: Producer) -> list:
        """Those of `trajectory_ids` opened before their connection's hello
        named `producer` (and not ended meanwhile) are its."""
        effects = []
        for tid in trajectory_ids:
            entry = self.entries.get(tid)
            if entry is not None and entry.producer is None and entry.state in (OPEN, SCORING):
                entry.producer = producer
                effects.append(NameProducer(tid, producer.producer_id, producer.key))
        return effects

    def open_of(self, producer: Producer, job: str) -> list[Entry]:
        """The trajectories `producer` opened in `job` that may still be
        finished: open (a terminal one may still end) or ended waiting for
        its reward; what a restarted producer is handed back. Under CURVE
        only those opened over the same key."""
        return [entry for entries in (self._open, self._scoring) for entry in entries.values()
                if entry.producer == producer and job_of(entry.trajectory_id) == job]

    def dead_letters(self, limit: int, pruned: bool = False) -> list[dict]:
        """The oldest `limit` dead letters; with `pruned`, those pruned (data
        deleted) come first, marked, while their ids are remembered."""
        gone = [{"trajectory_id": tid, "reason": reason, "at": at, "pruned": True}
                for tid, (reason, at) in sorted(self.pruned.items(), key=lambda item: item[1][1])] if pruned else []
        dead = sorted((e for e in self.entries.values() if e.state == DEAD), key=_dead_at)
        kept = [{"trajectory_id": e.trajectory_id, "reason": e.dead_reason, "at": e.dead_at} for e in dead]
        return (gone + kept)[:limit]


def turn_versions(message: Message) -> list:
    """A turn message's weight versions: its spans', or its `weight_version`."""
    spans = message.get("weight_version_spans")
    return [span[0] for span in spans] if spans else [message.get("weight_version")]


def held_bytes(trajectory: Trajectory) -> int:
    """What a trajectory in memory counts against the budget: its arrays and
    the objects that hold them. A shed one counts nothing, as an entry's
    own bookkeeping never does (about a kilobyte, outside the budget): were
    it counted, enough open trajectories could hold the broker over a small
    budget with nothing left to evict, and their ends would never be read."""
    if trajectory.is_shed:
        return 0
    return TRAJECTORY_OVERHEAD_BYTES + TURN_OVERHEAD_BYTES * trajectory.turns + trajectory.nbytes


def _dead_at(entry: Entry) -> float:
    assert entry.dead_at is not None  # set whenever an entry becomes DEAD
    return entry.dead_at


def _idle_since(ordered: OrderedDict, since: float) -> list:
    """The (key, item) pairs at the front of `ordered` (least recently
    updated first) not updated since `since`: expiry looks at no more than
    it expires."""
    out = []
    for key, item in ordered.items():
        if item.updated_at >= since:
            break
        out.append((key, item))
    return out


