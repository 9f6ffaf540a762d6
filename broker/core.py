"""The broker's rules, composed: `BrokerCore`, sans-I/O.

The merge engine, the dispatcher, the hellos, settlement, the memory and
disk budgets and the window grants each decide one thing; `BrokerCore` is
their composition, as h11's `Connection` is for HTTP: what each producer
frame, consumer message, admin request and tick does, what is made durable
first and what goes out after. `broker/service.py` only moves bytes and
performs what the core asks for.

Each input is a generator. It yields, in order, the I/O it needs (the
requests below, each naming the type of its answer: make these effects
durable, send these frames, read this back from the store, ...) and is sent
each one's answer; it reads no clock (it is given a `Clock`), no socket and
no file, and what performs a request never calls back into the core. One
loop, `drive`, runs every input: the service's with its sockets and store,
a test's with whatever answers it likes (tests/broker_helpers.py), which is
how the state machine test runs the whole broker without either.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Collection, Generator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, NamedTuple, NewType, TypeVar, cast

from rollstream.common.clock import Clock
from rollstream.common.codec import Message, encode, encode_error
from rollstream.common.contract import LIVENESS_INTERVALS, SUPPORT_LOG_PROB_ARRAYS, TOKEN_LOG_PROB_ARRAYS
from rollstream.common.errors import ProtocolError, RemoteProtocolError
from rollstream.common.failures import FailureLimit, internal_error, log_internal
from rollstream.common.jobs import DEFAULT_JOB, SEPARATOR, job_key, job_of, wire_id
from rollstream.common.messages import ADMIN_REPLIES, BROKER_TO_CONSUMER, BROKER_TO_PRODUCER, OPEN_STATES
from rollstream.common.trajectory import Trajectory
from rollstream.common.versions import Ancestry
from rollstream.common.wire import encode_deliver

from .dispatch import Dispatch, Dispatcher, DispatchSettings
from .engine import (
    DEAD,
    ENDED,
    LEFT,
    NOTHING_STORED,
    OPEN,
    SCORING,
    TRAINED,
    DeadLetter,
    DeliveryUnit,
    EngineSettings,
    Entry,
    Forget,
    MergeEngine,
    OpenTrajectory,
    Producer,
    Reply,
    StoredDigests,
    TrainedAt,
)
from .filters import parse_filters
from .flow import DiskBudget, MemoryBudget, WindowGrants
from .hello import Hellos
from .metrics import BrokerMetrics
from .recovery import Rebuilt
from .settings import BrokerSettings
from .settlement import Settlement
from .staleness import Freshness, Policy
from .starvation import Starvation
from .store import StoreError

log = logging.getLogger("rollstream.broker")

PROBE_EVERY = 1.0  # seconds between store probes while unavailable
HOUSEKEEPING_EVERY = 0.2  # seconds between expiry, budget and share checks while producers send
PACED_FOR = 1.0  # seconds after a producer's last frame that housekeeping keeps that pace
# Seconds between housekeeping passes at most otherwise (the store working): only trajectory TTLs, dedup
# records, dead-letter budgets and disk space move then, besides the deadlines of leases, consumer heartbeats
# and producer liveness, which bring the next pass forward.
QUIET_HOUSEKEEPING_EVERY = 5.0
DISCARDS = ("filtered:", "stale")  # dead-letter reasons that throw a trajectory away on purpose (`Starvation`)
STARVING = {
    "filtered": "its group filters dropped nearly every complete group over the window (no learning signal left: "
                "rewards saturated?); loosen the filters or stop the run",
    "stale": "nearly everything became stale before delivery (producers far behind the trainer); raise max_staleness "
             "or add producers",
    "idle": "its consumer holds credit and nothing was queued for starvation_after seconds; are its producers running?",
}
DEDUP_PRUNE_EVERY = 60.0  # seconds between prunes of the stored dedup records
# The longest ping interval a producer is expected to use (they ping every
# second by default): with the broker's heartbeat interval it sets how long a
# producer connection stays live without a word (`producer_live_for`).
PRODUCER_PING_BOUND = 10.0
# Of the disk budget: above it, the store's WAL is checkpointed before the
# disk is measured for its budget (the WAL must not hold off a resume).
CHECKPOINT_ABOVE = 0.9


def producer_live_for(heartbeat_interval: float) -> float:
    """Seconds a producer connection counts as live after it was last heard:
    the one rule that window shares, `status` and forgetting a connection
    all use."""
    return LIVENESS_INTERVALS * max(heartbeat_interval, PRODUCER_PING_BOUND)


# -- what the core asks its driver to do, and what it is answered ---------------
A = TypeVar("A")  # a request's answer
R = TypeVar("R", bound="Request[Any]")
T = TypeVar("T")


class Request(Generic[A]):
    """I/O the core asks its driver for, answered with an `A` (the type
    each request names as its base). The core asks with `answer = yield
    from request`, so the answer has that type where it is used; the
    driver performs the request and sends the answer back (`drive`)."""

    __slots__ = ()

    def __iter__(self) -> Generator[Asked, Any, A]:
        return (yield self)  # type: ignore[misc]  # the one place a request becomes `Asked`

    @classmethod
    def answered_by(cls: type[R], perform: Callable[[R], A]) -> tuple[type[R], Callable[[R], A]]:
        """A driver's performer of this request type, as an entry of its
        `Performers`: mypy checks that `perform` takes this request and
        answers what it asks."""
        return cls, perform


# What the core's inputs yield: a request asked through `Request.__iter__`
# alone, so mypy refuses a bare `yield` of one, whose answer would be untyped.
Asked = NewType("Asked", Request[Any])
# One core input, or a part of one: it yields requests, is sent their answers, and returns a `T`.
Steps = Generator[Asked, Any, T]
# A driver's performer of each request type (`Request.answered_by`).
Performers = Mapping[type[Request[Any]], Callable[[Any], Any]]


def drive(steps: Steps[T], performers: Performers) -> T:
    """Run one core input to its end: perform each request it asks with
    the performer of its type and send it the answer; return what it
    returns. The service drives the core with this loop and its sockets
    and store, a test with answers of its own; no performer calls the core."""
    answer = None
    try:
        while True:
            request = steps.send(answer)
            answer = performers[type(request)](request)
    except StopIteration as done:
        return done.value


# Requests are slotted dataclasses, not frozen ones or named tuples: the core
# makes one per commit and per frame sent, and those build the fastest.
@dataclass(slots=True)
class Commit(Request[StoreError | None]):
    """Make `effects` durable in one transaction. Answer: None, or the
    `StoreError` that kept them from being durable."""

    effects: list


class Sent(Enum):
    """What became of a `Send`'s frames."""

    TAKEN = "taken"  # the socket queued them for the peer
    FULL = "full"  # dropped: the peer's queue is full (it is not reading)
    GONE = "gone"  # dropped: the peer's connection is gone


@dataclass(slots=True)
class Send(Request[Sent]):
    """Hand `frames` to `socket` for connection `identity` without waiting.
    Answer: what became of them; a producer connection found gone is
    forgotten (`producer_gone`)."""

    socket: str
    identity: bytes
    frames: list


@dataclass(slots=True)
class ReadDigests(Request[dict[tuple[str, int], bytes | StoreError]]):
    """Read the stored digests of these (trajectory id, turn) records.
    Answer: {key: digest, or the `StoreError` that kept it from being read}."""

    keys: list[tuple[str, int]]


@dataclass(slots=True)
class ReadBack(Request[Trajectory | StoreError]):
    """Read a queued trajectory the store alone holds. Answer: the
    `Trajectory`, or the `StoreError` that kept it from being read."""

    trajectory_id: str


@dataclass(slots=True)
class ReadHistory(Request[list[dict] | StoreError]):
    """Read held trajectories' rows for the admin `history` answer, with
    what their records hold, as the archive's columns (`history_row`,
    broker/facts.py). Answer: one row per id, in order, or the
    `StoreError` that kept them from being read."""

    trajectory_ids: list[str]


@dataclass(slots=True)
class Reload(Request[Rebuilt]):
    """Read everything the store holds, to roll memory back to it. Answer: `Rebuilt`."""


@dataclass(slots=True)
class Probe(Request[bool]):
    """Try whether the store reads and writes again. Answer: whether it does."""


@dataclass(slots=True)
class PruneDedup(Request[None]):
    """Delete stored dedup records that ran out before wall time `wall`. Answer: None."""

    wall: float


@dataclass(slots=True)
class MeasureDisk(Request[tuple[int, int]]):
    """Answer: (bytes the store takes, bytes free on its file system)."""


@dataclass(slots=True)
class Checkpoint(Request[None]):
    """Fold the store's write-ahead log into its database. Answer: None."""


class ArchiveState(NamedTuple):
    """How the archive stands: trajectories the store keeps for it, files
    and segments being written, why the last one failed (None: it did
    not), and segments holding archived records it lacks (they go to it
    when no row refers to them any more, or copied when a run ends)."""

    waiting: int
    writing: int
    failing: str | None
    lacking: int = 0


@dataclass(slots=True)
class ArchiveStep(Request[ArchiveState | None]):
    """Delete what the archive now holds durably and hand it what waits, at
    monotonic time `mono`; `complete`: also copy the segments still in use
    that hold archived records, once nothing else waits (a run ended).
    Answer: how it stands (None: no archive)."""

    mono: float
    complete: bool = False


# A decoded message with the refusal it already earned (decoding, content rules), or None.
Received = tuple[bytes, Message | None, ProtocolError | None]


@dataclass(slots=True)
class _Answer:
    """A producer message's answer, waiting for its read to commit."""

    identity: bytes
    frames: list | None = None  # ready to send (hello, refusals)
    ack: dict | None = None  # sent as `ack` (or within `acks`) if the commit succeeds
    message: Message | None = None
    pong: dict | None = None  # a ping's answer, sent with what the read left to `admit`
    read_open: Entry | None = None  # a `read_open`'s trajectory, read (back, when shed) once the read committed


def batched_acks(answers: list[_Answer], batch_acks: Collection[bytes], grant: Callable[[bytes], int]) -> dict[bytes, dict]:
    """One `acks` per connection in `batch_acks` (those that asked for them,
    docs/protocol.md §3): its acked seqs as ranges, the outcomes that are
    not a plain `applied` listed on their own, and its `grant`."""
    by_identity: dict[bytes, dict] = {}
    for answer in answers:
        ack = answer.ack
        if ack is None or answer.identity not in batch_acks:
            continue
        seq = ack["seq"]
        acks = by_identity.get(answer.identity)
        if acks is None:
            acks = by_identity[answer.identity] = {"ranges": [[seq, seq]], "window": grant(answer.identity)}
        else:
            last = acks["ranges"][-1]
            if seq == last[1] + 1:
                last[1] = seq
            else:
                acks["ranges"].append([seq, seq])
        if not ack["applied"] or "duplicate" in ack:
            outcome = {"seq": seq, "applied": ack["applied"]}
            outcome.update((key, ack[key]) for key in ("duplicate", "reason") if key in ack)
            acks.setdefault("outcomes", []).append(outcome)
    return by_identity


def _seq(message: Message) -> dict:
    """A reply's `seq`: the request's, when it had one."""
    return {"seq": message["seq"]} if "seq" in message.fields else {}


# Where a handed-back trajectory stands (docs/protocol.md §3): turns may follow, only its end, or only its reward.
STANDING_OPEN, STANDING_TERMINAL, STANDING_SCORING = OPEN_STATES


def _standing(entry: Entry, trajectory: Trajectory | None) -> dict[str, Any]:
    """Where a trajectory handed back to its producer stands, its id as the producer named it."""
    state = (STANDING_SCORING if entry.state == SCORING else
             STANDING_TERMINAL if trajectory is not None and trajectory.terminal else STANDING_OPEN)
    return {"trajectory_id": wire_id(entry.trajectory_id), "next_turn": entry.next_turn, "state": state}


def _open_entry(entry: Entry) -> dict[str, Any]:
    """An `open_list` entry: where it stands and its identity in its group."""
    fields = _standing(entry, entry.trajectory)
    if entry.group_id is not None:
        fields.update(group_id=wire_id(entry.group_id), group_size=entry.group_size)
    if entry.sample_index is not None:
        fields["sample_index"] = entry.sample_index
    return fields


def _wire_ids(trajectory: Trajectory) -> dict[str, str]:
    """The ids a `deliver` of another job's trajectory carries in place of the broker's keys."""
    if SEPARATOR not in trajectory.trajectory_id:
        return {}
    ids = {"trajectory_id": wire_id(trajectory.trajectory_id)}
    if trajectory.group_id is not None:
        ids["group_id"] = wire_id(trajectory.group_id)
    return ids


class BrokerCore:
    """Everything the broker decides, driven by its service (or a test).

    Threads. Caller: the service's thread, every method and input. Of what
    it composes only `metrics` is also touched elsewhere: the /metrics
    server's thread reads it (`BrokerMetrics`). The checker thread and the
    store's writer thread never touch the core."""

    def __init__(self, settings: BrokerSettings, broker_id: str, metrics: BrokerMetrics, *, disk_reserve: int):
        s = self.settings = settings
        self.broker_id = broker_id
        self.metrics = metrics
        # How stale a trajectory may be trained, and which lineage it must descend from.
        self.freshness = Freshness(s.max_staleness, s.dispatch_order, s.abandoned_lineage)
        self.engine = self._new_engine()
        self.starvation = Starvation(s.starvation_window, s.starvation_share, idle_after=s.starvation_after)
        self.dispatcher = Dispatcher(DispatchSettings(s.lease_timeout, s.heartbeat_interval, s.max_deliveries,
                                                      s.dispatch_order))
        if self.freshness.drops_abandoned:
            self.dispatcher.untrainable = self._abandoned
        self.memory = MemoryBudget(s.max_memory_bytes)  # when producer frames are read, how far to evict
        self.disk = DiskBudget(s.max_disk_bytes, disk_reserve)
        self.grants = WindowGrants(s.window, s.max_in_flight)  # frames in flight per producer connection
        self.hellos = Hellos(broker_id, max_message_bytes=s.max_message_bytes, lease_timeout=s.lease_timeout,
                             heartbeat_interval=s.heartbeat_interval)
        self.producers: dict[bytes, float] = {}  # producer connection -> when last heard (monotonic)
        self.last_producer_frame = -math.inf  # when any producer was last heard (monotonic)
        self.producer_jobs: dict[bytes, str] = {}  # producer connection -> the job its hello named
        self.producer_ids: dict[bytes, Producer] = {}  # producer connection -> the producer its hello named
        self.producer_keys: dict[bytes, str] = {}  # under CURVE: producer connection -> its key's fingerprint
        self.handed_back: set[str] = set()  # listed to a restarted producer, until it says what it does with them
        # Per producer connection: trajectories its frames opened before its hello (resent on a new connection, they
        # may come first), named its producer's once the hello comes; at most the frames one may have in flight.
        self.unnamed: dict[bytes, deque[str]] = {}
        self.producer_live_for = producer_live_for(s.heartbeat_interval)
        self.unavailable = False  # writes fail: producer frames are refused until a probe succeeds
        self.reads_failed = False  # a trajectory could not be read back: deliveries wait for the probe too
        self.memory_bytes = 0
        self.disk_bytes = 0
        self.archive: ArchiveState | None = None  # as the last housekeeping pass found it
        self.archive_completing = False  # a run ended: the archive gets everything archived, until it has it
        self.free_bytes = 0  # on the data dir's file system
        self.endpoints: dict[str, str] = {}  # as bound, for `status`
        self._next_probe = 0.0
        self._next_dedup_prune = 0.0
        self._redeliveries_seen = 0
        self.failures = FailureLimit()  # per (endpoint, connection): messages that failed inside the broker

    def _new_engine(self) -> MergeEngine:
        s = self.settings
        engine = MergeEngine(EngineSettings(s.trajectory_ttl, s.dedup_window, parse_filters(s.group_filters),
                                            s.filter_reward_key))
        engine.epochs = self.freshness.epochs
        return engine

    def _abandoned(self, unit: DeliveryUnit) -> bool:
        """Whether weights of a lineage its job's trainer abandoned sampled
        a member of `unit` (a replayed, trained one is exempt)."""
        job = job_of(unit.trajectory_ids[0])
        if job not in self.freshness.epochs:
            return False
        entries = self.engine.entries
        return any(self.freshness.abandoned(job, entry.sampled) for entry in map(entries.get, unit.trajectory_ids)
                   if entry is not None and entry.state == ENDED)

    def restore(self, rebuilt: Rebuilt, disk_bytes: int, free_bytes: int) -> None:
        """Start from what the store held (`recovery.rebuild`): its queued
        units queued, oldest first."""
        for unit in self._restore(rebuilt):
            self.dispatcher.enqueue(unit)
        self.disk_bytes, self.free_bytes = disk_bytes, free_bytes
        counts = self.engine.counts()
        log.info("store recovered", extra={"data_dir": self.settings.data_dir, "open": counts[OPEN],
                                           "queued": self.dispatcher.queued_trajectories, "dead": counts[DEAD]})

    def _restore(self, rebuilt: Rebuilt) -> list[DeliveryUnit]:
        """Fill the fresh engine and the policies from the store; the units to queue."""
        self.freshness.restore(rebuilt.policies)
        return self.engine.restore(*rebuilt.engine_state())

    @property
    def reading_producers(self) -> bool:
        """Whether producer frames are read at all now (the memory budget)."""
        return self.memory.reading

    # -- durability -----------------------------------------------------------
    def _commit(self, effects: list) -> Steps[bool]:
        """Make `effects` durable; on failure roll memory back to the store
        and refuse writes until a probe succeeds. Ready units join the
        queue once durable."""
        error = yield from Commit(effects)
        if error is not None:
            self._store_failed(f"commit failed: {error}")
            # Memory back to exactly what the store holds; committed units are
            # already with the dispatcher, so the rebuilt ones are not queued again.
            self.engine = self._new_engine()
            self._restore((yield from Reload()))
            return False
        engine = self.engine
        engine.saved()
        starvation = self.starvation
        for unit in engine.queued_units:
            self.dispatcher.enqueue(unit)
            starvation.kept(job_of(unit.trajectory_ids[0]), len(unit.trajectory_ids))
        engine.queued_units.clear()
        for effect in effects:
            if type(effect) is DeadLetter and effect.reason.startswith(DISCARDS):
                starvation.dropped(job_of(effect.trajectory_id), effect.reason.partition(":")[0], 1)
        return True

    def _store_failed(self, error: str) -> None:
        log.error("store failed; refusing writes until it recovers", extra={"error": error})
        self.unavailable = True
        self.metrics.unavailable.set(1)

    # -- producers ------------------------------------------------------------
    def failed_inside(self, endpoint: str, identity: bytes, exc: Exception, message_type: str | None, frames,
                      mono: float, *, seq: int | None = None) -> RemoteProtocolError:
        """A failure no rule foresaw while one message from `identity` was
        handled: counted, logged once, remembered against its connection
        (`limited`), and made that message's `internal` refusal."""
        self.metrics.inc(self.metrics.internal_errors, endpoint=endpoint)
        self.failures.failed((endpoint, identity), mono)
        log_internal(log, exc, endpoint, message_type, frames)
        return internal_error(exc, message_type, frames, seq=seq)

    def limited(self, endpoint: str, identity: bytes, mono: float) -> RemoteProtocolError | None:
        """The refusal of a connection whose messages keep failing inside the
        broker, while it lasts: its messages are then answered unread."""
        return self.failures.refusal((endpoint, identity), mono)

    def takes_more(self, frames: int, nbytes: int) -> bool:
        """Whether the producer read under way takes another frame: below
        `read_max_frames` frames and, once it has one, `read_max_bytes` (the frame
        crossing it is the last), and while memory is within its budget."""
        s = self.settings
        return (frames < s.read_max_frames and not self.memory.over(self.memory_bytes)
                and not (frames and nbytes >= s.read_max_bytes))

    def frame_arrived(self, identity: bytes, size: int, mono: float) -> None:
        """A producer frame of `size` bytes was read: its connection is live,
        and memory, disk and free space are estimated on until housekeeping
        measures them (no system call on the per-frame path)."""
        self.producers[identity] = self.last_producer_frame = mono
        self.memory_bytes += size
        self.disk_bytes += size
        self.free_bytes -= size
        disk = self.disk
        if disk.everything and (self.disk_bytes > disk.budget or self.free_bytes < disk.reserve):
            self._update_backpressure()  # from the next frame on, only what may enter is taken

    def writes_ahead(self, message: Message) -> bool:
        """Whether a turn's frames may go to the store's writer as soon as
        they are read (it will be merged unless refused)."""
        return not self.unavailable and self.disk_lets_in(message) and self._fresh_refusal(message) is None

    def _fresh_refusals_possible(self) -> bool:
        """Whether `Freshness` may keep a turn out: a job has a bound."""
        return bool(self.freshness.policies) or self.freshness.max_staleness is not None

    def _fresh_refusal(self, message: Message) -> RemoteProtocolError | None:
        """Why `Freshness` keeps a turn out: a version without an order
        under a bound, or a new trajectory over its job's capacity (resent
        later: the trainer frees room as it trains)."""
        if message.type != "turn" or not self._fresh_refusals_possible():
            return None
        job = message.get("job", DEFAULT_JOB)
        spans = message.get("weight_version_spans") or ()
        refusal = self.freshness.version_refusal(job, [message.get("weight_version"), *(span[0] for span in spans)])
        if refusal is not None:
            return RemoteProtocolError("invalid_value", refusal, seq=message["seq"])
        if message["turn"] == 0:
            entry = self.engine.entries.get(job_key(job, message["trajectory_id"]))
            untrained = self.engine.untrained[job]
            if (entry is None or entry.state == LEFT) and not self.freshness.admits_new(job, untrained):
                self.freshness.waiting[job] += 1
                return RemoteProtocolError("unavailable", self.freshness.admission_refusal(job, untrained),
                                           seq=message["seq"])
        return None

    def disk_lets_in(self, message: Message) -> bool:
        """Whether the disk lets a producer frame in now (`DiskBudget`)."""
        if self.disk.everything:
            return True
        entry = self.engine.entries.get(message["trajectory_id"])
        return self.disk.lets_in(message.type, entry is not None and entry.state == OPEN)

    @staticmethod
    def keyed(message: Message) -> Message:
        """A producer message with its trajectory and group ids as this
        broker keys them, in the namespace of the job it names
        (`rollstream.common.jobs`); the frames stay as they came."""
        job = message.get("job")
        if job is None or job == DEFAULT_JOB or "trajectory_id" not in message.fields:
            return message
        fields = {**message.fields, "trajectory_id": job_key(job, message["trajectory_id"])}
        if "group_id" in fields:
            fields["group_id"] = job_key(job, fields["group_id"])
        return Message(message.type, fields, message.arrays, message.frames, message.crc32, message.array_crcs)

    def producer_read(self, received: list[Received], now: Clock) -> Steps[None]:
        """Merge a read of producer messages, commit it once, then answer:
        an `ack` always means durable."""
        engine = self.engine
        stored, unread = NOTHING_STORED, {}
        keys = engine.stored_digests_needed(message for _, message, error in received if message is not None and error is None)
        if keys:  # resends of applied turns whose digests only the store holds
            read = yield from ReadDigests(keys)
            unread = {key: value for key, value in read.items() if isinstance(value, StoreError)}
            stored = {key: None if isinstance(value, StoreError) else value for key, value in read.items()}
        answers: list[_Answer] = []
        effects: list = []
        start = 0
        while start < len(received):
            end = self._stretch_end(received, start) if not unread else start + 1
            answers += self._answer_stretch(received[start:end], now, stored, unread, effects)
            start = end
        committed = yield from self._commit(effects)
        if committed:
            if self.handed_back:
                self._count_resumed(answers)
            self.metrics.count_effects(effects)
            self.metrics.count_outcomes([(answer.message.type, answer.ack) for answer in answers
                                         if answer.ack is not None and answer.message is not None])
            for identity, acks in batched_acks(answers, self.hellos.batch_acks, self.grants.grant).items():
                acks.update(self._job_fields(identity))
                sent = yield from Send("producer", identity, encode(BROKER_TO_PRODUCER, "acks", acks, checked=False))
                if sent is Sent.GONE:
                    self.producer_gone(identity)
        batch_acks = self.hellos.batch_acks
        for answer in answers:
            frames = answer.frames
            if answer.read_open is not None:
                frames = yield from self._open_trajectory(answer)
            elif answer.pong is not None:  # after the read: a pong never names room its turns took
                frames = encode(BROKER_TO_PRODUCER, "pong", {**answer.pong, **self._job_fields(answer.identity)})
            elif answer.ack is not None:
                if not committed:
                    unavailable = RemoteProtocolError("unavailable", "the broker cannot persist right now; resend later",
                                                      seq=answer.ack["seq"])
                    frames = self._refuse("producer", unavailable, answer.message)
                elif answer.identity in batch_acks:
                    continue  # in its connection's `acks`
                else:
                    frames = encode(BROKER_TO_PRODUCER, "ack", answer.ack, checked=False)
            assert frames is not None  # an answer without an ack or a pong is made with its frames
            if (yield from Send("producer", answer.identity, frames)) is Sent.GONE:
                self.producer_gone(answer.identity)
        self._apply_memory_budget()

    def _stretch_end(self, received: list[Received], start: int) -> int:
        """Where the turn stretch from `start` ends: the messages from `start`
        up to the one returned are decoded turns of one connection and
        trajectory, none but the first a turn 0, which the engine then
        handles together (`MergeEngine.handle_turns`). Whether each may
        enter is asked of all of them first, so only while that does not
        hang on the turns before it: while the disk lets everything in
        (`disk_lets_in`), and in a read whose resends' digests were all read
        (a failed read stops the store for the messages after it: `_merged`)."""
        identity, message, error = received[start]
        end = start + 1
        if message is None or error is not None or message.type != "turn" or not self.disk.everything:
            return end
        tid = message.fields["trajectory_id"]
        while end < len(received):
            identity_next, message_next, error_next = received[end]
            if (identity_next != identity or message_next is None or error_next is not None
                    or message_next.type != "turn" or message_next.fields["trajectory_id"] != tid
                    or message_next.fields["turn"] == 0):
                break
            end += 1
        return end

    def _answer_stretch(self, stretch: list[Received], now: Clock, stored: StoredDigests, unread: Mapping,
                        effects: list) -> list[_Answer]:
        """The answers to one message, or to a turn stretch (`_stretch_end`):
        each is first asked whether it may enter, then those that may go to
        the engine, together."""
        answered: list[_Answer | None]
        if len(stretch) > 1 and not self.unavailable and not self._fresh_refusals_possible():
            answered = [None] * len(stretch)  # decoded turns the disk lets in (`_stretch_end`): all may enter
        else:
            answered = []
            for identity, message, error in stretch:
                try:
                    answered.append(self._answered_before_merging(identity, message, error, now, effects))
                except Exception as exc:  # a failure no rule foresaw costs this message alone
                    answered.append(self._failed_answer(identity, message, exc, now))
        taken = [i for i, answer in enumerate(answered) if answer is None]
        if taken:
            identity = stretch[taken[0]][0]
            messages = [stretch[i][1] for i in taken]
            producer = self.producer_ids.get(identity)
            replies = self.engine.handle_turns(messages, now.wall, stored, producer=producer)  # type: ignore[arg-type]
            for i, message, reply in zip(taken, messages, replies):
                try:
                    if isinstance(reply, Exception):
                        raise reply
                    answered[i] = self._merged(identity, producer, message, reply, unread, effects)  # type: ignore[arg-type]
                except Exception as exc:
                    answered[i] = self._failed_answer(identity, message, exc, now)
        return cast(list[_Answer], answered)  # every message answered

    def _failed_answer(self, identity: bytes, message: Message | None, exc: Exception, now: Clock) -> _Answer:
        """The refusal of a message whose handling raised what no rule foresaw."""
        assert message is not None  # a received error is refused without raising
        failure = self.failed_inside("producer", identity, exc, message.type, message.frames, now.mono)
        return _Answer(identity, self._refuse("producer", failure, message))

    def _answered_before_merging(self, identity: bytes, message: Message | None, error: ProtocolError | None,
                                 now: Clock, effects: list) -> _Answer | None:
        """The answer to a producer message that the merge engine does not
        take (a hello, a ping, a question, a refusal), its effects added to
        the read's; None for one it takes."""
        if error is not None:
            return _Answer(identity, self._refuse("producer", error, message))
        assert message is not None  # one that failed to decode is received with its error
        if message.type == "hello":
            log.info("producer connected", extra={"producer_id": message["producer_id"]})
            self._count_live_producers(now.mono)
            self.producer_jobs[identity] = message.get("job", DEFAULT_JOB)
            named = self.producer_ids[identity] = Producer(message["producer_id"], self.producer_keys.get(identity))
            effects.extend(self.engine.name_producer(self.unnamed.pop(identity, ()), named))
            fields = self.hellos.welcome_producer(identity, message.fields, self.grants.grant(identity))
            return _Answer(identity, encode(BROKER_TO_PRODUCER, "welcome", {**fields, **self._job_fields(identity)}))
        if message.type == "ping":
            return _Answer(identity, pong={"seq": message["seq"], "window": self.grants.grant(identity)})
        if message.type in ("list_open", "read_open"):
            return self._hand_back(identity, message)
        if self.unavailable:
            error = RemoteProtocolError("unavailable", "the broker cannot persist right now; resend later", seq=message["seq"])
            return _Answer(identity, self._refuse("producer", error, message))
        if not self.disk_lets_in(message):  # resent by the producer; counted, not logged per frame (see DiskBudget)
            error = RemoteProtocolError("unavailable", self.disk.refusal(), seq=message["seq"])
            return _Answer(identity, self._refuse("producer", error, message, quiet=True))
        error = self._fresh_refusal(message)
        if error is not None:
            waits = error.code == "unavailable"  # the staleness capacity: resent until the trainer catches up
            if waits:
                self.metrics.inc(self.metrics.admission_waits)
            return _Answer(identity, self._refuse("producer", error, message, quiet=waits))
        return None

    def _merged(self, identity: bytes, producer: Producer | None, message: Message, reply: Reply, unread: Mapping,
                effects: list) -> _Answer:
        """The answer to a message the merge engine handled for `producer`
        (None before its hello), its effects added to the read's."""
        if producer is None and reply.effects and isinstance(reply.effects[0], OpenTrajectory):
            self.unnamed.setdefault(identity, deque(maxlen=self.settings.max_in_flight)).append(message["trajectory_id"])
        if reply.error is not None:
            key = (message["trajectory_id"], message.get("turn"))
            if key in unread:  # the digest to compare a resend with could not be read
                self._store_failed(f"cannot read turn {key[1]} of {key[0]!r} back to compare a resend: {unread[key]}")
            return _Answer(identity, self._refuse("producer", reply.error, message))
        effects.extend(reply.effects)
        ack = reply.fields
        assert ack is not None  # a reply without an error has its ack
        if SEPARATOR in ack["trajectory_id"]:  # the producer's own id, not the broker's key
            ack = {**ack, "trajectory_id": wire_id(ack["trajectory_id"])}
        return _Answer(identity, ack=ack, message=message)

    def _hand_back(self, identity: bytes, message: Message) -> _Answer:
        """A producer's own open trajectories, listed (`list_open`) or one of
        them with its content so far (`read_open`): what a restarted producer
        continues (docs/protocol.md §3, "Open trajectories handed back")."""
        producer = self.producer_ids.get(identity)
        if producer is None:
            error = RemoteProtocolError("schema", f"rule 'a {message.type} follows the connection's hello' not met: "
                                                  "expected a hello naming the producer first, got none", seq=message["seq"])
            return _Answer(identity, self._refuse("producer", error, message))
        job = self.producer_jobs.get(identity, DEFAULT_JOB)
        if message.type == "list_open":
            entries = self.engine.open_of(producer, job)
            # Those listed before that no restarted producer went on with and the broker no longer holds are let go.
            self.handed_back = {tid for tid in self.handed_back if tid in self.engine.entries}
            self.handed_back.update(entry.trajectory_id for entry in entries)
            self.metrics.inc(self.metrics.resumed, len(entries), action="listed")
            listed = [_open_entry(entry) for entry in entries]
            return _Answer(identity, encode(BROKER_TO_PRODUCER, "open_list", {"seq": message["seq"], "trajectories": listed}))
        tid = job_key(job, message["trajectory_id"])
        entry = self.engine.entries.get(tid)
        if entry is None or entry.producer != producer or entry.state not in (OPEN, SCORING):
            error = RemoteProtocolError("unknown_trajectory", f"rule 'a producer reads back its own open trajectories' "
                                        f"not met: {message['trajectory_id']!r} is not open at this broker for producer "
                                        f"{producer.producer_id!r} in job {job!r}", seq=message["seq"])
            return _Answer(identity, self._refuse("producer", error, message))
        return _Answer(identity, message=message, read_open=entry)

    def _open_trajectory(self, answer: _Answer) -> Steps[list]:
        """The `open_trajectory` answering a `read_open`: the trajectory's
        arrays so far, read back from the store when it was shed."""
        entry, message = answer.read_open, answer.message
        assert entry is not None and message is not None  # a `read_open`'s answer is made with both
        trajectory = entry.trajectory
        if trajectory is None or trajectory.is_shed:
            read = yield from ReadBack(entry.trajectory_id)
            if isinstance(read, StoreError):
                error = RemoteProtocolError("unavailable", f"the broker cannot read {message['trajectory_id']!r} back "
                                                           f"now; ask again later ({read})", seq=message["seq"])
                return self._refuse("producer", error, message)
            trajectory = read
        fields = {"seq": message["seq"], **_standing(entry, trajectory)}
        if trajectory.status is not None:
            fields["status"] = trajectory.status
        fields["forced_spans"] = [list(span) for span in trajectory.forced_spans]
        fields["weight_version_spans"] = [list(span) for spans in trajectory.weight_version_spans for span in spans]
        arrays = {"prompt_tokens": trajectory.prompt_tokens, "tokens": trajectory.tokens,
                  "log_probs": trajectory.log_probs, "loss_mask": trajectory.loss_mask}
        mask = trajectory.mask
        if mask is not None:
            arrays.update(mask_ids=mask.ids, mask_offsets=mask.offsets)
        for name in (*TOKEN_LOG_PROB_ARRAYS, *SUPPORT_LOG_PROB_ARRAYS):
            if trajectory.carries(name):
                arrays[name] = getattr(trajectory, name)
        return encode(BROKER_TO_PRODUCER, "open_trajectory", fields, arrays)

    def _count_resumed(self, answers: list[_Answer]) -> None:
        """What restarted producers did with the trajectories handed back to
        them, once durable: a turn, end or reward applied continued one; an
        abort restarted it (`again`) or gave it up."""
        for answer in answers:
            message, ack = answer.message, answer.ack
            if message is None or ack is None or message["trajectory_id"] not in self.handed_back:
                continue
            if not ack["applied"] or ack.get("duplicate"):
                continue
            self.handed_back.discard(message["trajectory_id"])
            action = ("continued" if message.type != "abort" else "restarted" if message.get("again") else "aborted")
            self.metrics.inc(self.metrics.resumed, action=action)

    def connection_key(self, identity: bytes, fingerprint: str) -> None:
        """Under CURVE: producer connection `identity` authenticated with the
        key of `fingerprint`; its trajectories are handed back over that key
        alone."""
        self.producer_keys[identity] = fingerprint

    def _job_fields(self, identity: bytes) -> dict:
        """What a producer's welcome, pongs and acks tell it of its job:
        `admit`, how many new trajectories the job has room for under its
        staleness capacity (none when it has no capacity), so a producer
        starts only what will enter (`AsyncProducer.admitted`); its branch,
        the epoch of a resumed trainer and the step it resumed from, so a
        producer reloads those weights (`AsyncProducer.branch`), named as
        the producer's hello asked (`Hellos.branch_field`)."""
        job = self.producer_jobs.get(identity, DEFAULT_JOB)
        fields: dict[str, Any] = {}
        capacity = self.freshness.capacity(job)
        if capacity is not None:
            fields["admit"] = max(0, capacity - self.engine.untrained[job])
        if job in self.freshness.epochs:
            ancestry = self.freshness.ancestry(job)
            fields[self.hellos.branch_field(identity)] = [ancestry.epoch, ancestry.resumed_from]
        return fields

    def producer_gone(self, identity: bytes) -> None:
        """A producer connection is gone (a send found it gone, or it fell
        silent; a reconnect comes with a new identity): its grant and its
        hello's choices are forgotten."""
        self.producers.pop(identity, None)
        self.producer_jobs.pop(identity, None)
        self.producer_ids.pop(identity, None)
        self.producer_keys.pop(identity, None)
        self.unnamed.pop(identity, None)
        self.hellos.forget_producer(identity)
        self.grants.forget(identity)

    def _count_live_producers(self, mono: float) -> None:
        """The grants share `max_in_flight` among the live connections, so
        frames queued at the broker, and so the wait for an ack, stay
        bounded however many producers there are; those no longer live are
        forgotten."""
        live_after = mono - self.producer_live_for
        silent = [identity for identity, heard in self.producers.items() if heard < live_after]
        for identity in silent:
            self.producer_gone(identity)
        self.grants.active(len(self.producers))

    # -- consumers ------------------------------------------------------------
    def consumer_read(self, received: list[Received], now: Clock) -> Steps[None]:
        """Handle a read of consumer messages; the acks and nacks among them
        are made durable together (one commit), then answered."""
        settling: list[Settlement] = []
        claimed: set[str] = set()  # leases settled by an earlier message of this read
        claimed_ids: set[str] = set()  # and the trajectories its acks settled
        for identity, message, error in received:
            if error is not None:
                yield from Send("consumer", identity, self._refuse("consumer", error, None))
                continue
            assert message is not None  # one that failed to decode is received with its error
            if message.type in ("hello", "resume", "seal"):  # they change leases or commit: settle what came before first
                yield from self._settle(settling, now)
                claimed.clear()
                claimed_ids.clear()
            try:
                settlement = yield from self._consumer_message(identity, message, now, claimed, claimed_ids)
            except Exception as exc:  # a failure no rule foresaw costs this message alone
                failure = self.failed_inside("consumer", identity, exc, message.type, message.frames, now.mono)
                yield from Send("consumer", identity, self._refuse("consumer", failure, message))
                continue
            if settlement is not None:
                settling.append(settlement)
        yield from self._settle(settling, now)

    def _consumer_message(self, identity: bytes, message: Message, now: Clock, claimed: set[str],
                          claimed_ids: set[str]) -> Steps[Settlement | None]:
        dispatcher = self.dispatcher
        if message.type == "hello":
            job = message.get("job", DEFAULT_JOB)
            run = message.get("run")
            yield from self._dead_letter(dispatcher.hello(identity, message["consumer_id"], now.mono,
                                                          None if run is None else job_key(job, run),
                                                          message.get("lineage"), job,
                                                          counts=bool(message.get("queued_counts"))),
                                         "max_deliveries", now)
            log.info("consumer connected", extra={"consumer_id": message["consumer_id"]})
            fields = self.hellos.welcome_consumer(identity, message.fields, dispatcher.consumers.keys())
            if (queued := dispatcher.tell(identity)) is not None:
                fields["queued"] = queued
            if "run" in message.fields:  # a checkpointing trainer: how much it may train between seals
                fields["max_unsealed_bytes"] = self.settings.max_unsealed_bytes
            yield from Send("consumer", identity, encode(BROKER_TO_CONSUMER, "welcome", fields))
            return None
        if not dispatcher.seen(identity, now.mono):
            error = RemoteProtocolError("unknown_consumer",
                                        "this connection has not said hello (or was dropped); send hello first")
            extra = {"leases": message["leases"]} if "leases" in message.fields else {}
            yield from Send("consumer", identity, self._refuse("consumer", error, message, **extra))
            return None
        consumer = dispatcher.consumers[identity]
        checkpointed = message.type in ("seal", "resume") or "step" in message.fields
        if checkpointed and consumer.run is None:
            error = RemoteProtocolError("not_checkpointed", f"a {message.type} with a step needs a session whose hello "
                                        "named its run and lineage; this one's did not")
            extra = {"leases": message["leases"]} if "leases" in message.fields else {}
            yield from Send("consumer", identity, self._refuse("consumer", error, message, **extra))
        elif message.type == "credit":
            dispatcher.credit(identity, message["n"], message["unit"])
        elif message.type == "revoke":
            yield from Send("consumer", identity, encode(BROKER_TO_CONSUMER, "revoked",
                                                    {"queued": dispatcher.revoke(identity), **_seq(message)}))
        elif message.type in ("ack", "nack"):
            if consumer.job != DEFAULT_JOB and "trajectory_ids" in message.fields:
                ids = [job_key(consumer.job, tid) for tid in message["trajectory_ids"]]
                message = Message(message.type, {**message.fields, "trajectory_ids": ids}, message.arrays)
            trainer = (None if consumer.run is None or consumer.lineage is None else
                       (consumer.run, consumer.lineage, self.freshness.ancestry(consumer.job).epoch))
            return Settlement.prepare(identity, message, dispatcher, self.engine, now.wall, claimed, claimed_ids,
                                      trainer)
        elif message.type == "policy":
            yield from self._publish(identity, message, now)
        elif message.type == "seal":
            yield from self._seal(identity, message, now)
        elif message.type == "resume":
            yield from self._resume(identity, message, now)
        return None

    def _publish(self, identity: bytes, message: Message, now: Clock) -> Steps[None]:
        """A trainer published its policy version (and bound, step size,
        this broker's share and the run's ancestry): kept durably, echoed
        with the bound in force and the job's demand here; what it makes
        stale is dropped before the next delivery, and a new branch gives up
        what weights it abandoned sampled (with `abort_stale`, also what is
        already too stale) while still unfinished."""
        job = self.dispatcher.consumers[identity].job
        try:
            ancestry = Ancestry.of(message.get("branches"))
        except ValueError as error:
            yield from Send("consumer", identity, self._refuse("consumer", RemoteProtocolError("invalid_value", str(error)),
                                                          message))
            return
        policy = Policy(message["version"], message.get("max_staleness"), message.get("per_step"), message.get("share"),
                        ancestry)
        resumed = ancestry != self.freshness.ancestry(job) and bool(ancestry.branches)
        if resumed:
            log.info("trainer resumed: a new lineage epoch", extra={"job": job, "epoch": ancestry.epoch,
                                                                    "resumed_from": ancestry.resumed_from})
        effect = self.freshness.publish(job, policy)
        if not (yield from self._commit([effect])):  # memory, the policies too, rolled back to the store
            yield from Send("consumer", identity, self._unavailable(message))
            return
        bound = self.freshness.bound(job)
        # What the job holds here and how often new trajectories were told to wait since the last publication:
        # the trainer shares the admission capacity out among its brokers by it.
        fields = {"version": policy.version, **({} if bound is None else {"max_staleness": bound}),
                  "held": self.engine.untrained[job], "waiting": self.freshness.waiting.pop(job, 0),
                  **_seq(message)}
        yield from Send("consumer", identity, encode(BROKER_TO_CONSUMER, "policy", fields))
        yield from self._drop_stale(job, now)
        engine, freshness = self.engine, self.freshness
        effects = []
        if resumed and freshness.drops_abandoned:  # unfinished ones now; queued ones as they are taken
            effects += engine.give_up(job, lambda entry: freshness.abandoned(job, entry.sampled), "abandoned", now.wall)
        below = freshness.stale_below(job)
        if self.settings.abort_stale and below is not None:  # their producers stop sampling what cannot be trained
            effects += engine.give_up(job, lambda entry: entry.version is not None and entry.version < below, "stale",
                                      now.wall)
        if effects and (yield from self._commit(effects)):
            self.metrics.count_effects(effects)

    def _drop_stale(self, job: str, now: Clock) -> Steps[None]:
        """Dead-letter `job`'s queued units older than its bound allows (`stale`)."""
        below = self.freshness.stale_below(job)
        if below is None:
            return
        units = self.dispatcher.take_stale(job, below)
        if units:
            tids = [tid for unit in units for tid in unit.trajectory_ids]
            log.info("stale trajectories dropped", extra={"job": job, "count": len(tids), "older_than": below})
            yield from self._dead_letter(tids, "stale", now)

    def _seal(self, identity: bytes, message: Message, now: Clock) -> Steps[None]:
        """A checkpointing trainer sealed a checkpoint: reclaim what it no longer needs."""
        consumer = self.dispatcher.consumers[identity]
        assert consumer.run is not None and consumer.lineage is not None  # checked by the caller
        effects = self.engine.seal(consumer.run, consumer.lineage, message["step"], message["keep"], now.wall)
        if not (yield from self._commit(effects)):
            yield from Send("consumer", identity, self._unavailable(message))
            return
        reclaimed = self._count_reclaimed(effects, "delivered")
        seq = _seq(message)
        yield from Send("consumer", identity, encode(BROKER_TO_CONSUMER, "sealed", {"step": message["step"],
                                                                              "reclaimed": reclaimed, **seq}))
        self._apply_memory_budget()

    def _resume(self, identity: bytes, message: Message, now: Clock) -> Steps[None]:
        """A trainer resumed from the checkpoint at `step`: what its state
        says it trained through that step is trained (whether or not its
        commits arrived), the checkpoint is sealed, and what its run trained
        after it in another lineage goes back to it, listed in `resumed`
        (with the job's lineage epoch as last published) and delivered
        without credit."""
        consumer, engine = self.dispatcher.consumers[identity], self.engine
        run, lineage, step = consumer.run, consumer.lineage, message["step"]
        assert run is not None and lineage is not None  # checked by the caller
        try:
            engine.resumable(run, step)
        except RemoteProtocolError as gone:
            yield from Send("consumer", identity, self._refuse("consumer", gone, message))
            return
        effects, recorded = [], set()
        for trained_step, position, wire in message["trained"]:
            tid = job_key(consumer.job, wire)
            entry = engine.entries.get(tid)
            if trained_step <= step and entry is not None and entry.state in (ENDED, TRAINED):
                effects += engine.trained(tid, TrainedAt(run, lineage, trained_step, position), now.wall)
                recorded.add(tid)
        effects += engine.seal(run, lineage, step, message["keep"], now.wall, resume=True)
        if not (yield from self._commit(effects)):
            yield from Send("consumer", identity, self._unavailable(message))
            return
        self._count_reclaimed(effects, "delivered")
        self.dispatcher.withdraw(recorded)
        replay = [e for e in engine.replayable(run, lineage, step) if e.trained is not None]
        entries: list[list] = [[e.trained.step, e.trained.position, wire_id(e.trajectory_id)] for e in replay
                               if e.trained is not None]  # (every one: mypy cannot see the filter above)
        seq = _seq(message)
        epoch = self.freshness.ancestry(consumer.job).epoch  # the resumed trainer's epoch must be above it
        yield from Send("consumer", identity, encode(BROKER_TO_CONSUMER, "resumed",
                                                {"step": step, "replay": entries, "epoch": epoch, **seq}))
        log.info("trainer resumed", extra={"run": run, "step": step, "replayed": len(entries)})
        yield from self._send_deliveries(self.dispatcher.replay(identity, [e.trajectory_id for e in replay], now.mono), now)

    def _settle(self, settling: list[Settlement], now: Clock) -> Steps[None]:
        """Commit the read's settlements at once, then update the
        dispatcher and answer each (or answer `unavailable`)."""
        if not settling:
            return
        effects = [e for s in settling for e in s.effects]
        committed = yield from self._commit(effects)
        if committed:
            self.metrics.count_effects(effects)
        for s in settling:
            if not committed:
                yield from Send("consumer", s.identity, self._unavailable(s.message, leases=s.accepted))
                continue
            yield from self._dead_letter(s.apply(self.dispatcher), "max_deliveries", now)
            if s.message.type == "ack":
                acked = len(s.trajectory_ids) + len(s.by_id)
                self.metrics.inc(self.metrics.trajectories_acked, acked)
                if s.trained is None:  # trained ones leave when sealed
                    self.metrics.inc(self.metrics.exits, acked, exit="delivered")
            if s.accepted:
                reply = "acked" if s.message.type == "ack" else "nacked"
                yield from Send("consumer", s.identity, encode(BROKER_TO_CONSUMER, reply, {"leases": s.accepted}))
            if s.stale:
                error = RemoteProtocolError("stale_lease",
                                            f"{len(s.stale)} lease(s) are unknown or expired; they changed nothing")
                yield from Send("consumer", s.identity, self._refuse("consumer", error, s.message, leases=s.stale))
        settling.clear()
        if committed:
            self._apply_memory_budget()  # delivered trajectories left memory: paused producers may go on

    def drop_consumer(self, identity: bytes, now: Clock) -> Steps[None]:
        """A consumer connection lost its right to connect (its key was
        removed): no more deliveries, its leases go back to the queue."""
        log.warning("dropped a consumer whose key was removed; its leases are requeued",
                    extra={"consumer_id": self.dispatcher.consumers[identity].consumer_id})
        yield from self._dead_letter(self.dispatcher.drop_consumer(identity), "max_deliveries", now)

    def _dead_letter(self, tids: list[str], reason: str, now: Clock) -> Steps[None]:
        if not tids:
            return
        effects = [e for tid in tids for e in self.engine.dead_letter(tid, reason, now.wall)]
        if (yield from self._commit(effects)):
            self.metrics.count_effects(effects)
            for tid in tids:
                self.dispatcher.forget(tid)
        else:  # not durable: keep them deliverable
            for tid in tids:
                self.dispatcher.enqueue(DeliveryUnit((tid,), version=self.engine.entries[tid].version), front=True)

    def deliver(self, now: Clock) -> Steps[None]:
        """Send queued trajectories to consumers with credit, also while
        writes fail: a consumer's ack deletes data, which is what frees a
        full disk (the reserve keeps room to write those deletes). Each
        delivered unit is read back whole before any of it is sent, so a
        group goes out whole or not at all; one that cannot be read back
        (`_read_unit`) ends the pass, and it and the rest go back to the
        front with the consumers' credit returned. Nothing is sent once a
        trajectory could not be read back, until the probe succeeds."""
        if self.reads_failed:
            return
        for job in list(self.freshness.policies.keys() & self.dispatcher.queues.keys()):
            yield from self._drop_stale(job, now)
        deliveries = self.dispatcher.deliveries(now.mono)
        if self.dispatcher.set_aside:
            yield from self._drop_abandoned(now)
        yield from self._send_deliveries(deliveries, now)
        for identity, queued in self.dispatcher.queued_news():
            yield from Send("consumer", identity, encode(BROKER_TO_CONSUMER, "queued", {"n": queued}))

    def _drop_abandoned(self, now: Clock) -> Steps[None]:
        """Dead-letter the units the dispatcher set aside: weights of a
        lineage their job's trainer abandoned sampled them (`abandoned`)."""
        units, self.dispatcher.set_aside = self.dispatcher.set_aside, []
        tids = [tid for unit in units for tid in unit.trajectory_ids]
        log.info("trajectories of an abandoned lineage dropped", extra={"count": len(tids)})
        yield from self._dead_letter(tids, "abandoned", now)

    def _send_deliveries(self, deliveries: list[Dispatch], now: Clock) -> Steps[None]:
        """Read back and send `deliveries`, unit by unit (see `deliver`)."""
        dispatcher = self.dispatcher
        refused: list[str] = []  # leases whose send the connection refused: retracted, their credit spent
        start = 0
        while start < len(deliveries):
            end = start + 1
            while end < len(deliveries) and deliveries[end].unit is deliveries[start].unit:
                end += 1
            if not (yield from self._read_unit(deliveries[start:end], now)):
                dispatcher.retract([d.lease for d in deliveries[start:] if d.lease in dispatcher.leases], refund=True)
                break
            version = deliveries[start].unit.version
            current = None if version is None else self.freshness.version(job_of(deliveries[start].trajectory_id))
            first = deliveries[start]
            if current is not None and not first.replay:
                self.metrics.staleness.observe(max(0, current - version))  # type: ignore[operator]
            if (not self.freshness.drops_abandoned and not first.replay and first.delivery_count == 1
                    and self._abandoned(first.unit)):
                self.metrics.inc(self.metrics.abandoned, end - start, action="kept")
            for delivery in deliveries[start:end]:
                options = self.hellos.options_of(delivery.identity)
                trajectory = self.engine.entries[delivery.trajectory_id].trajectory
                assert trajectory is not None  # `_read_unit` read it back
                counts = {} if (queued := dispatcher.tell(delivery.identity)) is None else {"queued": queued}
                frames = encode_deliver(trajectory, delivery.lease, may_pack="packed_arrays" in options,
                                        may_split="split_arrays" in options,
                                        **{**delivery.extra_fields, **_wire_ids(trajectory), **counts})
                if (yield from Send("consumer", delivery.identity, frames)) is not Sent.TAKEN:
                    refused.append(delivery.lease)
                else:
                    self.engine.sent(delivery.trajectory_id, now.wall)
            start = end
        if refused:
            dispatcher.retract(refused)

    def _read_unit(self, unit: list[Dispatch], now: Clock) -> Steps[bool]:
        """Whether every member of a delivered unit is in memory, evicted
        ones read back from the store. False when one cannot be read: a
        store that fails makes the store unavailable and deliveries wait for
        its probe; a member whose records are damaged does too, until it has
        failed `UNREADABLE_AFTER` reads, when it is dead-lettered
        `unreadable` and its lease dropped (the rest of its unit goes on)."""
        engine = self.engine
        for delivery in unit:
            tid = delivery.trajectory_id
            entry = engine.entries.get(tid)
            if entry is None or entry.state not in (ENDED, TRAINED):  # cannot happen; never send what has not ended
                log.error("queued trajectory has not ended", extra={"trajectory_id": tid})
                self.dispatcher.end_leases([delivery.lease])
                return False
            if not engine.needs_reload(entry):
                continue
            read = yield from ReadBack(tid)
            if isinstance(read, StoreError):
                if not read.retriable and engine.unreadable(tid):
                    log.error("stored trajectory cannot be read back", extra={"trajectory_id": tid, "error": str(read)})
                    self.dispatcher.end_leases([delivery.lease])
                    yield from self._dead_letter([tid], "unreadable", now)
                else:
                    self._store_failed(f"cannot read evicted trajectory {tid!r} back to deliver it: {read}")
                    self.reads_failed = True
                return False
            engine.reload(entry, read)
            self.metrics.inc(self.metrics.reloads)
        return True

    # -- admin ----------------------------------------------------------------
    def admin_request(self, identity: bytes, envelope: list, message: Message | None, error: ProtocolError | None,
                      now: Clock) -> Steps[None]:
        """Answer one admin request (`envelope`: a REQ peer's delimiter, sent back before the reply)."""
        if error is None:
            assert message is not None  # one that failed to decode is received with its error
            try:
                reply = yield from self._admin_reply(message, now)
            except ProtocolError as refusal:
                reply = self._refuse("admin", refusal, None)
            except Exception as exc:  # a failure no rule foresaw costs this request alone
                failure = self.failed_inside("admin", identity, exc, message.type, message.frames, now.mono)
                reply = self._refuse("admin", failure, message)
        else:
            reply = self._refuse("admin", error, None)
        yield from Send("admin", identity, [*envelope, *reply])

    def _admin_reply(self, message: Message, now: Clock) -> Steps[list]:
        seq = _seq(message)
        if message.type == "status":
            return encode(ADMIN_REPLIES, "status", {**self.status(now), **seq})
        if message.type == "end_run":
            effects = self.engine.end_run(job_key(message.get("job", DEFAULT_JOB), message["run"]), now.wall)
            if not (yield from self._commit(effects)):
                raise RemoteProtocolError("unavailable", "the broker cannot persist right now; retry later")
            reclaimed = self._count_reclaimed(effects, "delivered")
            self.archive_completing = True
            log.info("run ended", extra={"run": message["run"], "reclaimed": reclaimed})
            return encode(ADMIN_REPLIES, "run_ended", {"run": message["run"], "reclaimed": reclaimed, **seq})
        if message.type == "history":
            fields = yield from self._history(message)
            return encode(ADMIN_REPLIES, "history", {**fields, **seq})
        if message.type == "dead_letters":
            items = [{**item, "trajectory_id": wire_id(item["trajectory_id"]), "job": job_of(item["trajectory_id"])}
                     for item in self.engine.dead_letters(message.get("limit", 100), message.get("pruned", False))]
            return encode(ADMIN_REPLIES, "dead_letters", {"items": items, **seq})
        job = message.get("job", DEFAULT_JOB)
        revived = []  # the admin `requeue` (its wire name) revives dead letters
        effects = []
        for tid in dict.fromkeys(message["trajectory_ids"]):
            revive = self.engine.revive(job_key(job, tid), now.wall)
            if revive:
                effects += revive
                revived.append(tid)
        if not (yield from self._commit(effects)):
            raise RemoteProtocolError("unavailable", "the broker cannot persist right now; retry later")
        for tid in revived:
            log.info("dead letter revived", extra={"trajectory_id": tid, "job": job})
        return encode(ADMIN_REPLIES, "requeued", {"trajectory_ids": revived, **seq})

    def _history(self, message: Message) -> Steps[dict]:
        """The admin `history` answer: the rows of what the broker holds of
        a step (trained there, by `run` of `job` when named) or of a
        trajectory (in `job`, or in every job holding or remembering it);
        what it let go of is named, never guessed: the runs that reclaimed
        through the step, the jobs that remember the trajectory's id."""
        engine = self.engine
        job = message.get("job")
        fields: dict[str, Any] = {"held": len(engine.entries)}
        if "step" in message.fields:
            step, run = message["step"], message.get("run")

            def ran(key: str) -> bool:  # a run's key (its job's, as a trainer's hello named it) is the one asked for
                return (job is None or job_of(key) == job) and (run is None or wire_id(key) == run)

            keys, steps = [], []
            for key, entry in engine.trained_entries.items():
                if entry.trained is not None and ran(entry.trained.run):
                    steps.append(entry.trained.step)
                    if entry.trained.step == step:
                        keys.append(key)
            if steps:
                fields["steps"] = [min(steps), max(steps)]
            reclaimed = [{"job": job_of(key), "run": wire_id(key), "through": state.reclaimed}
                         for key, state in engine.runs.items() if state.reclaimed >= step and ran(key)]
            if reclaimed:
                fields["reclaimed"] = reclaimed
        else:
            tid = message["trajectory_id"]
            if job is not None:
                keys = [job_key(job, tid)]
            else:  # every job's: its id alone is the default job's key, another job's ends in U+001F and the id
                keyed = SEPARATOR + tid
                keys = list(dict.fromkeys(key for known in (engine.entries, engine.dedup) for key in known
                                          if key == tid or key.endswith(keyed)))
            let_go = []
            for key in keys:
                if key not in engine.entries and key in engine.dedup:
                    gone = {"job": job_of(key), "trajectory_id": tid}
                    if key in engine.pruned:  # a dead letter whose data was pruned
                        gone["reason"], gone["at"] = engine.pruned[key]
                    let_go.append(gone)
            keys = [key for key in keys if key in engine.entries]
            if let_go:
                fields["let_go"] = let_go
        rows = (yield from ReadHistory(keys)) if keys else []
        if isinstance(rows, StoreError):
            raise RemoteProtocolError("unavailable", f"the broker cannot read the rows asked for now; retry later ({rows})")
        return {"rows": rows, **fields}

    def status(self, now: Clock) -> dict:
        counts = self.engine.counts()
        oldest = self.engine.oldest_trained_step()
        live_after = now.mono - self.producer_live_for
        acks = self.metrics.ack_seconds
        return {
            "open": counts[OPEN],
            "scoring": counts[SCORING],
            "queued": (queued := self.dispatcher.queued_trajectories),
            "queued_by_job": (queued_by_job := self.dispatcher.queued()),
            "ready": queued,  # deprecated: the older name of `queued` (common/messages.py)
            "ready_by_job": queued_by_job,  # deprecated: the older name of `queued_by_job`
            "leased": len(self.dispatcher.leases),
            "awaiting_group": self.engine.awaiting_group(),
            "dead": counts[DEAD],
            "producers": sum(1 for heard in self.producers.values() if heard >= live_after),
            "consumers": len(self.dispatcher.consumers),
            "bytes_in_memory": self.memory_bytes,
            "bytes_on_disk": self.disk_bytes,
            "max_memory_bytes": self.settings.max_memory_bytes,
            "max_disk_bytes": self.settings.max_disk_bytes,
            "ack_seconds": {"bounds": list(acks.bounds), "counts": list(acks.counts), "sum": acks.sum},
            "counters": {key: int(value) for key, value in sorted(self.metrics.totals.items())},
            "endpoints": dict(self.endpoints),
            "unsealed": counts[TRAINED],
            "unsealed_bytes": self.engine.trained_bytes,
            **({} if oldest is None else {"oldest_unsealed_step": oldest}),
            **({"policies": self._policies()} if self.freshness.policies else {}),
            **({"starving": starving} if (starving := self.starvation.active()) else {}),
            **({} if self.archive is None else {"archive": self.archive._asdict()}),
            **({"resumed": resumed} if (resumed := self.metrics.resumed_counts()) else {}),
        }

    def _policies(self) -> dict:
        """Each job's published policy with its bound, capacity, lineage
        epoch (after a resume) and the staleness spread of what it has queued."""
        out = {}
        for job, policy in sorted(self.freshness.policies.items()):
            queue = self.dispatcher.queues.get(job)
            versions = None if queue is None else queue.versions()
            bound, capacity = self.freshness.bound(job), self.freshness.capacity(job)
            out[job] = {"version": policy.version, "untrained": self.engine.untrained[job],
                        **({} if bound is None else {"max_staleness": bound}),
                        **({} if capacity is None else {"capacity": capacity}),
                        **({} if not policy.ancestry.branches else
                           {"epoch": policy.ancestry.epoch, "resumed_from": policy.ancestry.resumed_from}),
                        **({} if versions is None else
                           {"staleness": [max(0, policy.version - versions[1]), max(0, policy.version - versions[0])]})}
        return out

    # -- time -------------------------------------------------------------------
    @property
    def quiet(self) -> bool:
        """No peer to answer within seconds: no producer or consumer
        connection remembered, no lease out, the store not being probed."""
        return not (self.producers or self.dispatcher.consumers or self.dispatcher.leases or self.unavailable)

    def paced(self, mono: float) -> bool:
        """Producers sent within `PACED_FOR`, or the store is being probed:
        housekeeping keeps the `HOUSEKEEPING_EVERY` pace (memory and disk
        measured, open trajectories' clocks, the probe)."""
        return self.unavailable or mono - self.last_producer_frame < PACED_FOR

    def housekeeping_every(self, mono: float) -> float:
        """Seconds from time `mono` to the next housekeeping pass:
        `HOUSEKEEPING_EVERY` while `paced`; otherwise the next deadline of
        a lease, of a consumer's heartbeats (`Dispatcher.next_deadline`) or
        of a producer's liveness, and at most `QUIET_HOUSEKEEPING_EVERY` or
        a tenth of `trajectory_ttl` (an expiry is late by a tenth of its TTL
        at most): an idle broker costs next to nothing, and one whose peers
        only wait costs their heartbeats."""
        if self.paced(mono):
            return HOUSEKEEPING_EVERY
        every = max(HOUSEKEEPING_EVERY, min(QUIET_HOUSEKEEPING_EVERY, self.settings.trajectory_ttl / 10))
        deadlines = [self.dispatcher.next_deadline()]
        if self.producers:
            deadlines.append(min(self.producers.values()) + self.producer_live_for)
        deadline = min((d for d in deadlines if d is not None), default=None)
        return every if deadline is None else min(every, max(HOUSEKEEPING_EVERY, deadline - mono))

    def housekeeping(self, now: Clock) -> Steps[None]:
        """The first half of a housekeeping pass, what time alone changes in
        what the broker holds: silent producers forgotten, idle trajectories
        expired, dead letters and trained data kept within their budgets.
        Its commits can take long, so the driver hands the core the consumer
        messages that waited meanwhile (`consumer_read`) before the second
        half (`finish_housekeeping`) judges leases and consumers' silence: a
        live consumer is never dropped unheard."""
        self._count_live_producers(now.mono)
        effects = self.engine.expire(now.wall)
        if (yield from self._commit(effects)):
            self.metrics.count_effects(effects)
        yield from self._prune_dead(now)
        yield from self._reclaim_unsealed(now)

    def finish_housekeeping(self, now: Clock) -> Steps[None]:
        """The second half of a housekeeping pass at `now` (after
        `housekeeping` and the consumer messages that waited behind it):
        lost leases and silent consumers requeued, the store probed while
        unavailable, dedup records pruned, memory and disk held to their
        budgets, starvation watched."""
        yield from self._dead_letter(self.dispatcher.tick(now.mono), "max_deliveries", now)
        new_redeliveries = self.dispatcher.redeliveries - self._redeliveries_seen
        if new_redeliveries:
            self.metrics.inc(self.metrics.redeliveries, new_redeliveries)
            self._redeliveries_seen = self.dispatcher.redeliveries
        if self.unavailable and now.mono >= self._next_probe:
            self._next_probe = now.mono + PROBE_EVERY
            if (yield from Probe()):
                self.unavailable = self.reads_failed = False
                self.metrics.unavailable.set(0)
                log.info("store available again")
        if now.mono >= self._next_dedup_prune:
            self._next_dedup_prune = now.mono + DEDUP_PRUNE_EVERY
            yield from PruneDedup(now.wall)
        self._evict_to_budget()
        self.archive = archive = yield from ArchiveStep(now.mono, self.archive_completing)
        if archive is None or not (archive.waiting or archive.writing or archive.lacking):
            self.archive_completing = False
        self.disk_bytes, self.free_bytes = yield from MeasureDisk()
        if self.disk_bytes > CHECKPOINT_ABOVE * self.settings.max_disk_bytes or self.free_bytes < self.disk.reserve:
            # also below the limit: the WAL (up to 16 MiB between checkpoints) must not hold off a resume
            yield from Checkpoint()
            self.disk_bytes, self.free_bytes = yield from MeasureDisk()
        self._update_backpressure()
        self._watch_starvation(now)
        self.update_gauges(now)

    def _prune_dead(self, now: Clock) -> Steps[None]:
        """Keep dead letters within `max_dead_letter_bytes`: the oldest go
        (their ids remembered), counted and logged by reason."""
        effects, gone = self.engine.prune_dead(self.settings.max_dead_letter_bytes, now.wall)
        if effects and (yield from self._commit(effects)):
            for reason, n in gone.items():
                self.metrics.inc(self.metrics.dead_pruned, n, reason=reason)
            log.info("oldest dead letters deleted to keep them within max_dead_letter_bytes",
                     extra={"deleted": dict(gone), "budget": self.settings.max_dead_letter_bytes})

    def _watch_starvation(self, now: Clock) -> None:
        """Say loudly when a job starves (`Starvation`), and when it no longer does."""
        waiting: dict[str, bool] = {}
        for consumer in self.dispatcher.consumers.values():
            waiting[consumer.job] = waiting.get(consumer.job, False) or bool(consumer.trajectory_credit
                                                                             or consumer.group_credit)
        queued = {job: 1 for job in self.dispatcher.queues}
        for alarm in self.starvation.check(now.mono, waiting, queued):
            self.metrics.starving.labels(job=alarm.job, cause=alarm.cause).set(int(alarm.started))
            extra = {"job": alarm.job, "cause": alarm.cause, **alarm.figures}
            if alarm.started:
                log.warning(f"job {alarm.job!r} is starving: {STARVING[alarm.cause]}", extra=extra)
            else:
                log.info(f"job {alarm.job!r} no longer starving ({alarm.cause})", extra=extra)

    # -- budgets ----------------------------------------------------------------
    def _reclaim_unsealed(self, now: Clock) -> Steps[None]:
        """Hold trained-but-unsealed data to its own budget: past it, the
        oldest trained steps are reclaimed as if sealed (the trainer can no
        longer fall back before them), loudly."""
        effects, through = self.engine.reclaim_over(self.settings.max_unsealed_bytes, now.wall)
        if not effects or not (yield from self._commit(effects)):
            return
        reclaimed = self._count_reclaimed(effects, "unsealed_reclaimed")
        log.warning("over the unsealed budget: reclaimed the oldest trained steps; a resume from before them is "
                    "refused (seal checkpoints sooner, or raise max_unsealed_bytes)",
                    extra={"reclaimed": reclaimed, "through": dict(through),
                           "max_unsealed_bytes": self.settings.max_unsealed_bytes})

    def _apply_memory_budget(self) -> None:
        """Evict down to the memory budget, then pause or resume producers.
        Run after every read, not only at housekeeping: the engine keeps its
        count as it changes, so producers resume as soon as room is made."""
        self._evict_to_budget()
        self._update_backpressure()

    def _evict_to_budget(self) -> None:
        """Evict (all of it durable in the store) as far as `MemoryBudget`
        says, what is out on a lease last."""
        engine = self.engine
        self.memory_bytes = engine.bytes_in_memory
        target = self.memory.evict_to(self.memory_bytes)
        if target is not None:
            evicted = engine.evict(target, leased={lease.trajectory_id for lease in self.dispatcher.leases.values()})
            for state, count in evicted.items():
                if count:
                    self.metrics.inc(self.metrics.evictions, count, state=state)
            self.memory_bytes = engine.bytes_in_memory

    def _update_backpressure(self) -> None:
        """Pause or resume reading producer frames as `MemoryBudget` says;
        tell `DiskBudget` the store's size and free space, logging when
        what enters changes."""
        change = self.memory.update(self.memory_bytes)
        if change is False:
            log.warning("over the memory budget: producer frames paused", extra={"bytes_in_memory": self.memory_bytes})
        elif change is True:
            log.info("back under the memory budget: producer frames resumed")
        disk = self.disk
        drainable = bool(self.dispatcher.queues or self.dispatcher.leases)
        # Trained data waits for the trainer's next checkpoint, which needs producers' data to reach: it has a
        # budget of its own (`_reclaim_unsealed`) and does not count against theirs.
        used = max(0, self.disk_bytes - self.engine.trained_bytes)
        if disk.update(used, self.free_bytes, drainable):
            figures = {"bytes_on_disk": self.disk_bytes, "bytes_free": self.free_bytes}
            if disk.everything:
                log.info("disk back under budget: every producer frame enters", extra=figures)
            else:
                log.warning("disk over budget: some producer frames wait", extra={**figures, "reason": disk.refusal()})
        self.metrics.backpressure.set(int(not (self.memory.reading and disk.everything)))

    # -- accounting ---------------------------------------------------------------
    def update_gauges(self, now: Clock) -> None:
        self.metrics.show(self.status(now))

    def _count_reclaimed(self, effects: list, exit_label: str) -> int:
        """Count the trained trajectories durable `effects` reclaimed (their `Forget`s) as leaving by `exit_label`."""
        reclaimed = sum(1 for e in effects if type(e) is Forget)
        self.metrics.inc(self.metrics.exits, reclaimed, exit=exit_label)
        return reclaimed

    def _unavailable(self, message: Message, **extra) -> list:
        """A consumer message refused because nothing can be made durable now (it changed nothing)."""
        error = RemoteProtocolError("unavailable", "the broker cannot persist right now; resend later")
        return self._refuse("consumer", error, message, **extra)

    def _refuse(self, endpoint: str, error: ProtocolError, message: Message | None, *, quiet: bool = False,
                **extra) -> list:
        """A `nack` for `error`, counted and logged (`quiet`: only counted,
        for refusals that repeat by design until a state changes, which is
        logged once)."""
        if error.seq is None and message is not None and "seq" in message.fields:  # protocol.md §2: answer its seq
            error = error.with_seq(message["seq"])
        self.metrics.inc(self.metrics.nacks, endpoint=endpoint, code=error.code)
        if not quiet:
            context = {"endpoint": endpoint, "code": error.code, "reason": error.message}
            if message is not None and "trajectory_id" in message.fields:
                context["trajectory_id"] = message["trajectory_id"]
                if "turn" in message.fields:
                    context["turn"] = message["turn"]
            log.warning("message refused", extra=context)
        schema = BROKER_TO_PRODUCER if endpoint == "producer" else BROKER_TO_CONSUMER if endpoint == "consumer" else ADMIN_REPLIES
        return encode_error(schema, error, **extra)
