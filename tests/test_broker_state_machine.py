"""The whole broker, `BrokerCore`, driven by Hypothesis on a real store and
with the consumer's own core (`ConsumerCore`) on the other side: random producer frames, consumer credit, acks, nacks and
releases, lease expiries, consumers going silent, trajectories expiring,
commits that fail and reads back that fail. Nothing stands between the two
cores but encoding and decoding: what the core yields is performed by the
broker's own store side (`StoreIO`) or handed to the consumer as bytes.

After every step: credit in use never exceeds the credit granted, a lease is
out only for a delivery that went out, a group is delivered whole or not at all, every ended trajectory is acked,
dead-lettered, queued, leased or waiting for its group (exactly one), no
trajectory is delivered more than `max_deliveries` times, and another job's
trajectories with the same ids (an evaluation run's) are never handed to
the consumer, which reads the default job. Drawn with a staleness bound (the
trainer publishes versions as it trains, turns carry the version they were
sampled at, admission may hold new trajectories) and an equal-rewards
filter: no unit goes out behind the bound in force when it is sent. The
trainer also resumes, in a new lineage epoch: no unit goes out that weights
the lineage in force abandoned sampled."""
import shutil
import tempfile

import numpy as np
import pytest
from broker_helpers import abort_msg, end_msg, turn_msg
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rollstream.broker.core import PROBE_EVERY, BrokerCore, Commit, ReadBack, Send, Sent, drive
from rollstream.broker.engine import DEAD, ENDED, OPEN, TRAINED
from rollstream.broker.metrics import BrokerMetrics
from rollstream.broker.recovery import rebuild
from rollstream.broker.settings import BrokerSettings
from rollstream.broker.store import Store, StoreUnavailable
from rollstream.broker.store_io import StoreIO
from rollstream.common.clock import Clock
from rollstream.common.codec import decode, decode_header, encode
from rollstream.common.jobs import DEFAULT_JOB, job_key, job_of
from rollstream.common.messages import BROKER_TO_CONSUMER, BROKER_TO_PRODUCER, CONSUMER_TO_BROKER, PRODUCER_TO_BROKER
from rollstream.common.trajectory import Gap
from rollstream.common.validation import Violation
from rollstream.consumer.core import ConsumerCore, Form, HandOut, Refill

PRODUCER, CONSUMER = b"producer", b"consumer"
LEASE_TIMEOUT, HEARTBEAT, MAX_DELIVERIES = 10.0, 1.0, 3
GROUPS = {"A": ("a0", "a1"), "B": ("b0", "b1", "b2")}
SINGLES = ("s0",)
GROUP_OF = {tid: (gid, len(members)) for gid, members in GROUPS.items() for tid in members}
TRAJECTORIES = (*SINGLES, *GROUP_OF)


class Broker(RuleBasedStateMachine):
    @initialize(memory=st.sampled_from([1 << 30, 1]), checkpointed=st.booleans(), bound=st.sampled_from([None, 1]))
    def start(self, memory, checkpointed, bound=None):
        """A broker on a fresh store; with a budget of one byte, every
        trajectory not out on a lease is evicted and read back to deliver.
        A checkpointing consumer's commits keep what it trained until it
        seals a checkpoint. With a `bound`, a staleness bound and a filter
        of groups whose rewards all tie."""
        self.directory = tempfile.mkdtemp(prefix="rollstream-sm-")
        broker_settings = BrokerSettings(data_dir=self.directory, lease_timeout=LEASE_TIMEOUT,
                                         heartbeat_interval=HEARTBEAT, max_deliveries=MAX_DELIVERIES,
                                         trajectory_ttl=50.0, dedup_window=1e12, max_memory_bytes=memory,
                                         max_staleness=bound, group_filters="all_equal_rewards" if bound else "")
        metrics = BrokerMetrics()
        self.store = Store(self.directory)
        self.store_io = StoreIO(self.store, self.directory, metrics)
        self.core = BrokerCore(broker_settings, "sm", metrics, disk_reserve=0)
        self.core.restore(rebuild(self.store.open(), self.store), 0, 1 << 40)
        self.consumer = ConsumerCore(["inproc://broker"], consumer_id="c", batch_size=1, unit="group", prefetch=3,
                                     hello_timeout=5.0, checkpointed=checkpointed, keep_checkpoints=1,
                                     on_invalid="quarantine")
        self.now = 1000.0
        self.turns = dict.fromkeys(TRAJECTORIES, 0)  # turns each producer has applied
        self.ended: set[str] = set()
        self.ended_elsewhere: set[str] = set()  # the broker's keys of what another job ended
        self.granted = 0  # group credit the consumer granted since its last hello
        self.charged = 0  # units the broker delivered to it under that credit
        self.sent_leases: set[str] = set()  # leases whose delivery reached the consumer
        self.version = 0  # the trainer's policy version: what the producers sample with
        self.epoch = 0  # its lineage epoch (a resume starts the next)
        self.branches: list[list[int]] = []  # [epoch, step resumed from] per resume
        self.sampled: dict[str, set[tuple[int, int]]] = {tid: set() for tid in TRAJECTORIES}  # applied turns' weights
        self.applied: dict[str, list[int]] = {tid: [] for tid in TRAJECTORIES}  # the tokens of its applied turns
        # The full-vocabulary log-probs of its applied turns, and its supports' log-probs (one per support id), each
        # None when its first turn brought none (replay fields: turn 0 decides); whether a later turn without one
        # cut it at a replay gap; and the forced tokens its last applied turn ended with (a gap cuts them off).
        self.full: dict[str, list[float] | None] = dict.fromkeys(TRAJECTORIES)
        self.support: dict[str, list[float] | None] = dict.fromkeys(TRAJECTORIES)
        self.gapped: set[str] = set()
        self.forced_tail: dict[str, int] = dict.fromkeys(TRAJECTORIES, 0)
        self.named = False  # the producer's connection said hello

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- running the core: what it yields, performed ---------------------------
    def _run(self, steps, *, fail_commit=False, fail_read=False):
        """Perform every request of one core input (`drive`): the store side
        by the broker's own `StoreIO` (but the first commit fails with
        `fail_commit`, the first read back with `fail_read`), sends to the
        producer read back as replies, sends to the consumer handed to its
        core. Returns the producer's replies."""
        replies, units = [], set()

        def send(request):
            if request.socket == "producer":
                replies.append(decode(request.frames, BROKER_TO_PRODUCER))
                return Sent.TAKEN
            header = decode_header(request.frames[0])
            lease = header.get("lease")
            if lease is not None:  # a delivery: one charge per unit it belongs to
                out = self.core.dispatcher.leases[lease]
                units.add(id(out.unit))
                self.sent_leases.add(lease)
                below = self.core.freshness.stale_below(DEFAULT_JOB)
                assert out.replay or below is None or out.unit.version is None or \
                    out.unit.version >= below, f"{header['trajectory_id']} sent behind the bound"
                in_force = self.core.freshness.ancestry(DEFAULT_JOB).branches
                assert out.replay or not any(
                    step > min((at for e, at in in_force if e > epoch), default=step)
                    for tid in out.unit.trajectory_ids for epoch, step in self.sampled[tid]
                ), f"{header['trajectory_id']} sent though abandoned weights sampled it"
            self.consumer.received(0, decode(request.frames, BROKER_TO_CONSUMER), self.now)
            return Sent.TAKEN

        performers = {**self.store_io.performers, Send: send}
        if fail_commit:
            performers[Commit] = self._fails_once(Commit, StoreUnavailable("the disk went away (injected)"))
        if fail_read:
            performers[ReadBack] = self._fails_once(ReadBack, StoreUnavailable("a read failed (injected)"))
        drive(steps, performers)
        self.charged += len(units)
        return replies

    def _fails_once(self, kind, error):
        """A performer of `kind` that answers `error` the first time, then as the store does."""
        perform, failed = self.store_io.performers[kind], []

        def once(request):
            if failed:
                return perform(request)
            failed.append(request)
            return error

        return once

    @property
    def clock(self):
        return Clock(self.now, self.now)

    def _produce(self, message, store_fails=False, refusals=None):
        """The `ack` of `message`, or None; its `nack`s go to `refusals` when given."""
        replies = self._run(self.core.producer_read([(PRODUCER, message, None)], self.clock), fail_commit=store_fails)
        if refusals is not None:
            refusals += [reply for reply in replies if reply.type == "nack"]
        acks = [reply for reply in replies if reply.type in ("ack", "acks")]
        return acks[0] if acks and acks[0].type == "ack" else None

    def _consumer_sends(self, store_fails=False) -> bool:
        """The consumer sends what its core says is due (hello, heartbeat,
        credit, settlements); whether there was anything."""
        received = []
        for _, kind, fields in self.consumer.due(self.now):
            if kind == "hello":
                self.granted = self.charged = 0
            elif kind == "credit":
                self.granted += fields["n"]
            received.append((CONSUMER, decode(encode(CONSUMER_TO_BROKER, kind, fields), CONSUMER_TO_BROKER), None))
        self._run(self.core.consumer_read(received, self.clock), fail_commit=store_fails)
        return bool(received)

    def _consumer_speaks(self, store_fails=False, read_back_fails=False):
        """The consumer sends what is due, and the broker delivers what it may."""
        self._consumer_sends(store_fails)
        self._run(self.core.deliver(self.clock), fail_read=read_back_fails)

    # -- producers ------------------------------------------------------------
    @rule(tid=st.sampled_from(TRAJECTORIES), tokens=st.integers(1, 3), store_fails=st.booleans(), full=st.booleans(),
          support=st.booleans(), forced=st.booleans())
    def turn(self, tid, tokens, store_fails=False, full=False, support=False, forced=False):
        """A turn, with its tokens' full-vocabulary log-probs or without, with
        its supports' log-probs (two ids each) or without, and with a forced
        token after its sampled ones or without: one without a field the
        trajectory carries is a replay gap, which consumes the turn, ends its
        turns and cuts the forced tokens of the turn before; one bringing a
        field its applied turns lack is refused `mask_presence`."""
        index = self.turns[tid]
        ids = list(range(10, 10 + tokens))
        supports = [[t, t + 20] for t in ids]
        full_log_probs = [-t / 64 for t in ids] if full else None
        mask_log_probs = [-i / 32 for s in supports for i in s] if support else None
        forced_tokens = [30] if forced else []
        label = f"step-{self.version}" if self.epoch == 0 else f"e{self.epoch}:step-{self.version}"
        message = turn_msg(tid, index, ids, supports, forced=forced_tokens or None, group=GROUP_OF.get(tid), seq=index,
                           weight_version=label, full_log_probs=full_log_probs, mask_log_probs=mask_log_probs)
        carried = {"full_log_probs": self.full[tid] is not None and index > 0,
                   "mask_log_probs": self.support[tid] is not None and index > 0}
        brought = {"full_log_probs": full, "mask_log_probs": support}
        entry = self.core.engine.entries.get(tid)
        extends = (index > 0 and not self.core.unavailable and entry is not None and entry.state == OPEN
                   and index == entry.next_turn and entry.trajectory is not None and not entry.trajectory.terminal)
        starting = [name for name in ("full_log_probs", "mask_log_probs") if extends and brought[name] and not carried[name]]
        refusals: list = []
        ack = self._produce(message, store_fails, refusals)
        presence = [r for r in refusals if r["code"] == "mask_presence"]
        if starting:  # a later start: refused before anything is stored
            assert ack is None and len(presence) == 1, (tid, index, starting, refusals)
            assert f"carries {starting[0]} but the" in presence[0]["message"], presence[0]["message"]
            return
        assert not presence, (tid, index, presence)
        if ack is None or ack.get("duplicate"):
            return
        if not ack["applied"]:
            if ack.get("reason") == "replay_gap" and tid not in self.gapped:
                assert any(carried[name] and not brought[name] for name in carried), \
                    f"{tid} cut at turn {index}, which lacks no field it carries"
                self.gapped.add(tid)
                self.turns[tid] += 1  # the turn that revealed the gap counts as consumed
                cut = self.forced_tail[tid]  # the merged trajectory ends with the last turn's sampled tokens
                for kept in (self.applied[tid], self.full[tid], self.support[tid]):
                    if kept is not None and cut:
                        del kept[-cut:]
            return
        assert tid not in self.gapped and (index == 0 or carried == brought), f"{tid}: turn {index} applied"
        if index == 0:
            self.sampled[tid] = set()
            self.applied[tid] = []
            self.full[tid] = [] if full else None
            self.support[tid] = [] if support else None
        self.sampled[tid].add((self.epoch, self.version))
        self.applied[tid] += ids + forced_tokens
        if full_log_probs is not None:
            self.full[tid] += full_log_probs + [0.0] * len(forced_tokens)
        if mask_log_probs is not None:  # a forced token's singleton support is certain
            self.support[tid] += mask_log_probs + [0.0] * len(forced_tokens)
        self.forced_tail[tid] = len(forced_tokens)
        self.turns[tid] += 1

    @rule(group=st.sampled_from(sorted(GROUPS)))
    def group_finishes(self, group):
        """Every member of a group sends a turn and ends (the rarest way to a
        delivery, drawn step by step)."""
        for tid in GROUPS[group]:
            self.turn(tid, 1)
            self.end(tid)

    @rule(tid=st.sampled_from(TRAJECTORIES), store_fails=st.booleans(), reward=st.sampled_from([0.0, 1.0]))
    def end(self, tid, store_fails=False, reward=1.0):
        ack = self._produce(end_msg(tid, reward=reward), store_fails)
        if ack is not None and ack["applied"] and not ack.get("duplicate"):
            self.ended.add(tid)

    @rule(group=st.sampled_from(sorted(GROUPS)), store_fails=st.booleans())
    def another_job_finishes_a_group_of_the_same_ids(self, group, store_fails):
        """An evaluation job on the same broker sends the same group ids,
        each member one turn and its end, named with its job on every frame."""
        for i, tid in enumerate(GROUPS[group]):  # rewards that differ: no filter drops the group
            for message in (turn_msg(tid, 0, [20], [[20]], group=GROUP_OF[tid], seq=0, job="eval",
                                     weight_version=f"step-{self.version}"),
                            end_msg(tid, reward=float(i % 2), job="eval")):
                ack = self._produce(BrokerCore.keyed(message), store_fails)
            if ack is not None and ack["applied"] and ack["trajectory_id"] == tid:
                self.ended_elsewhere.add(job_key("eval", tid))

    @rule(tid=st.sampled_from(TRAJECTORIES), again=st.booleans())
    def abort(self, tid, again):
        ack = self._produce(abort_msg(tid, again=again))
        if ack is not None and ack["applied"]:
            self.turns[tid] = 0
            self.gapped.discard(tid)

    @rule()
    def producer_says_hello(self):
        """Its connection names the producer (frames sent before are its too)."""
        self._run(self.core.producer_read([(PRODUCER, decode(encode(PRODUCER_TO_BROKER, "hello", {
            "producer_id": "p", "seq": 0, "lists_open": True}), PRODUCER_TO_BROKER), None)], self.clock))
        self.named = True

    @rule(read=st.booleans())
    def a_restarted_producer_is_handed_back_what_it_has_open(self, read):
        """What a restarted producer is listed: every trajectory it has open
        that the broker has not given up, at the turn it reached, with the
        tokens of its applied turns; nothing ended."""
        if not self.named:
            return
        (listed,) = self._run(self.core.producer_read([(PRODUCER, decode(encode(PRODUCER_TO_BROKER, "list_open", {
            "seq": 1}), PRODUCER_TO_BROKER), None)], self.clock))
        entries = {item["trajectory_id"]: item for item in listed["trajectories"]}
        given_up = {tid for tid, entry in self.core.engine.entries.items() if entry.state == DEAD}
        expected = {tid for tid in TRAJECTORIES if self.turns[tid] and tid not in self.ended and tid not in given_up}
        assert set(entries) == expected
        for tid in expected:
            assert entries[tid]["next_turn"] == self.turns[tid]
            if read:
                (content,) = self._run(self.core.producer_read([(PRODUCER, decode(encode(
                    PRODUCER_TO_BROKER, "read_open", {"seq": 2, "trajectory_id": tid}), PRODUCER_TO_BROKER), None)],
                    self.clock))
                assert content.type == "open_trajectory", content.fields
                assert content.arrays["tokens"].tolist() == self.applied[tid]
                full = content.arrays.get("full_log_probs")
                assert (None if full is None else full.tolist()) == (
                    None if self.full[tid] is None else np.array(self.full[tid], np.float32).tolist())
                support = content.arrays.get("mask_log_probs")
                assert (None if support is None else support.tolist()) == (
                    None if self.support[tid] is None else np.array(self.support[tid], np.float32).tolist())
                assert support is None or len(support) == len(content.arrays["mask_ids"])
                assert content["state"] == ("terminal" if tid in self.gapped else "open")

    # -- the consumer -----------------------------------------------------------
    @rule(read_back_fails=st.booleans())
    def consumer_speaks(self, read_back_fails):
        self._consumer_speaks(read_back_fails=read_back_fails)

    @rule(how=st.sampled_from(["commit", "reject", "release"]), store_fails=st.booleans())
    def train(self, how, store_fails):
        """The trainer takes a batch of one unit (the core drops what aged
        in the prefetch buffer first), then commits it (checkpointing: at
        the next step, kept until sealed), finds every member invalid
        (quarantined: dead-lettered) or releases it."""
        form = self._take()
        if form is not None:
            groups = {d.fields.get("group_id") for d in form.deliveries} - {None}
            for gid in groups:  # whole: every member that did not leave (abort) the group
                members = [d for d in form.deliveries if d.fields.get("group_id") == gid]
                expected = members[0].fields["group_size"] - members[0].fields["group_left"]
                assert len(members) == expected, \
                    f"group {gid} taken with {sorted(d.trajectory_id for d in members)}, expected {expected} members"
            if how == "reject":
                violations = [Violation("bad", i, None, 1, "drawn invalid") for i in range(len(form.deliveries))]
                assert isinstance(self.consumer.formed(violations), Refill)
                self.consumer.abandon()  # nothing of the unit is left to refill with
            else:
                handed = self.consumer.formed([])
                assert isinstance(handed, HandOut)
                if how == "commit":
                    self.consumer.commit(handed.seq)
                else:
                    self.consumer.release(handed.seq)
        self._consumer_speaks(store_fails=store_fails)

    def _take(self) -> Form | None:
        """The next batch if one unit is complete now (`take` says `Wait` otherwise)."""
        taken = self.consumer.take(self.now, partial_at=self.now)
        return taken if isinstance(taken, Form) else None

    @rule(store_fails=st.booleans())
    def trainer_publishes_a_new_version(self, store_fails):
        """The trainer took a step: its version goes up and the broker hears of it."""
        self.version += 1
        self.consumer.publish(self.version)
        self._consumer_speaks(store_fails=store_fails)

    @rule(store_fails=st.booleans())
    def trainer_resumes_from_its_step_before(self, store_fails):
        """The trainer resumed from the checkpoint of its last step but one,
        in a new lineage epoch: what weights past that step sampled is
        abandoned, and must not be delivered."""
        if self.version == 0:
            return
        self.version -= 1
        self.epoch += 1
        self.branches.append([self.epoch, self.version])
        self.consumer.publish(self.version)
        sessions = self.consumer.sessions  # a resumed consumer's first policy names its lineage's branches
        assert sessions.policy is not None
        sessions.policy = {**sessions.policy, "branches": [list(b) for b in self.branches]}
        self._consumer_speaks(store_fails=store_fails)

    @rule(store_fails=st.booleans())
    def seal(self, store_fails):
        """The checkpoint of the last step trained is durable: the broker may reclaim what it trained."""
        position = self.consumer.position
        if position is None or not position.step:
            return
        self.consumer.seal(position.step)
        self._consumer_speaks(store_fails=store_fails)

    # -- time and failures --------------------------------------------------------
    @rule(seconds=st.sampled_from([PROBE_EVERY, 3 * HEARTBEAT + 0.5, LEASE_TIMEOUT + 1, 60.0]), waited=st.booleans())
    def time_passes(self, seconds, waited=False):
        """Time passes and a housekeeping pass runs: leases expire, the
        consumer goes silent, open trajectories expire, the store is probed.
        With `waited`, what the consumer had due (a heartbeat) waited behind
        the pass's first half and is handed to the core between the halves,
        as the service does: a connected consumer that spoke then stays."""
        self.now += seconds
        connected = CONSUMER in self.core.dispatcher.consumers
        self._run(self.core.housekeeping(self.clock))
        spoke = waited and self._consumer_sends()
        self._run(self.core.finish_housekeeping(self.clock))
        assert not (connected and spoke) or CONSUMER in self.core.dispatcher.consumers, \
            "dropped as silent though its message waited behind the pass"

    # -- invariants -----------------------------------------------------------
    @invariant()
    def credit_in_use_never_exceeds_credit_granted(self):
        consumer = self.core.dispatcher.consumers.get(CONSUMER)
        if consumer is None:
            return
        assert consumer.group_credit >= 0
        assert self.charged + consumer.group_credit <= self.granted, (self.charged, consumer.group_credit, self.granted)

    @invariant()
    def a_lease_is_out_only_for_a_delivery_that_went_out(self):
        unsent = set(self.core.dispatcher.leases) - self.sent_leases
        assert not unsent, f"leases out for deliveries never sent: {unsent}"

    @invariant()
    def queued_groups_are_whole_units(self):
        for unit in (u for queue in self.core.dispatcher.queues.values() for u in queue):
            if unit.group_id is not None:
                assert unit.group_left == unit.group_size - len(unit.trajectory_ids), unit

    @invariant()
    def every_ended_trajectory_is_in_exactly_one_place(self):
        engine, dispatcher = self.core.engine, self.core.dispatcher
        queued = [tid for queue in dispatcher.queues.values() for unit in queue for tid in unit.trajectory_ids]
        leased = [lease.trajectory_id for lease in dispatcher.leases.values()]
        for tid in self.ended:
            entry = engine.entries.get(tid)
            group = engine.groups.get(entry.group_id) if entry is not None and entry.group_id else None
            places = {
                "acked": entry is None and tid in engine.dedup,
                "dead": entry is not None and entry.state == DEAD,
                "trained, not sealed": entry is not None and entry.state == TRAINED,
                "queued": queued.count(tid),
                "leased": leased.count(tid),
                "waiting for its group": entry is not None and entry.state == ENDED and group is not None
                and not group.deliverable,
            }
            assert sum(places.values()) == 1, (tid, places)

    @invariant()
    def the_count_awaiting_a_group_is_every_ended_member_of_a_group_not_yet_deliverable(self):
        engine = self.core.engine
        awaiting = [tid for tid, e in engine.entries.items() if e.state == ENDED and e.group_id in engine.groups
                    and not engine.groups[e.group_id].deliverable]
        assert engine.awaiting_group() == len(awaiting), awaiting

    @invariant()
    def another_jobs_trajectories_wait_for_their_own_consumer(self):
        assert all(job_of(lease.trajectory_id) == DEFAULT_JOB for lease in self.core.dispatcher.leases.values())
        for key in self.ended_elsewhere:
            entry = self.core.engine.entries.get(key)
            assert entry is not None and entry.state == ENDED, (key, entry and entry.state)

    @invariant()
    def once_a_seal_is_answered_the_run_is_reclaimed_through_it(self):
        """(What an ack brings after the seal of its step waits for the next seal.)"""
        position = self.consumer.position
        if position is None or position.unsealed or not position.sealed_step:
            return
        run = self.core.engine.runs[position.run]
        assert run.reclaimed >= position.sealed_step, (run, position.sealed_step)

    @invariant()
    def delivery_counts_stay_within_max_deliveries(self):
        counts = self.core.dispatcher.delivery_counts
        assert all(count <= MAX_DELIVERIES for count in counts.values()), counts


Broker.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_broker = Broker.TestCase
test_broker.pytestmark = [pytest.mark.slow]


def test_an_ack_and_a_seal_in_one_batch_whose_seal_cannot_commit_lose_nothing():
    """Found by this machine: the consumer's next batch holds its commit of
    step 1 (by trajectory id, its session lost) and the seal of step 1. The
    seal's commit failed and rolled memory back to the store, the ack's then
    succeeded, and the group was in no place at all (in the store as
    trained, in memory as ready, queued nowhere). A seal now settles what
    came before it first."""
    machine = Broker()
    machine.start(memory=1 << 30, checkpointed=True)
    steps = [("consumer_speaks", {"read_back_fails": False}), ("group_finishes", {"group": "A"}),
             ("consumer_speaks", {"read_back_fails": False}), ("train", {"how": "commit", "store_fails": True}),
             ("time_passes", {"seconds": 3 * HEARTBEAT + 0.5}), ("consumer_speaks", {"read_back_fails": False}),
             ("seal", {"store_fails": True}), ("train", {"how": "commit", "store_fails": True})]
    try:
        for name, arguments in steps:
            getattr(machine, name)(**arguments)
            machine.every_ended_trajectory_is_in_exactly_one_place()
    finally:
        machine.teardown()


@pytest.mark.parametrize("memory", [1 << 30, 1], ids=["held", "evicted"])
def test_supports_log_probs_are_handed_back_cut_at_a_gap_naming_them_and_a_later_start_is_refused(memory):
    """The machine's steps, each checked as it checks them, through what a
    draw may not reach: a trajectory carrying its supports' log-probs (0.0
    at each forced token's singleton) is handed back with them, then cut
    at a turn without them (a gap naming them, the forced token before it
    cut off too); one whose first turn brought none is refused
    `mask_presence` when a later turn brings them, and goes on without."""
    machine = Broker()
    machine.start(memory=memory, checkpointed=False)
    read = ("a_restarted_producer_is_handed_back_what_it_has_open", {"read": True})
    steps = [("producer_says_hello", {}),
             ("turn", {"tid": "s0", "tokens": 2, "support": True, "forced": True}), read,
             ("turn", {"tid": "s0", "tokens": 1, "support": True, "forced": True}), read,
             ("turn", {"tid": "s0", "tokens": 1, "support": False}), read,
             ("turn", {"tid": "a0", "tokens": 1, "forced": True}),
             ("turn", {"tid": "a0", "tokens": 1, "support": True}), read,
             ("turn", {"tid": "a0", "tokens": 1}), read]
    try:
        for name, arguments in steps:
            getattr(machine, name)(**arguments)
            machine.every_ended_trajectory_is_in_exactly_one_place()
        assert machine.gapped == {"s0"} and machine.core.engine.entries["s0"].trajectory.gap == Gap(2, "mask_log_probs")
        assert machine.applied["s0"] == [10, 11, 30, 10]
        assert machine.support["s0"] == [-10 / 32, -30 / 32, -11 / 32, -31 / 32, 0.0, -10 / 32, -30 / 32]
        assert (machine.turns["a0"], machine.support["a0"], machine.applied["a0"]) == (2, None, [10, 30, 10])
    finally:
        machine.teardown()


@pytest.mark.parametrize("ahead", [False, True], ids=["checked-with-the-read", "checked-ahead"])
def test_a_turn_saying_its_supports_log_probs_are_renormalised_is_refused_when_they_do_not_sum_to_1(tmp_path, monkeypatch,
                                                                                                  ahead):
    """The service's content check (`_check_content`, or the check ahead of
    the read for a large turn): in one read, a turn that says its supports'
    log-probs are renormalised and whose second support's probabilities sum
    to 0.75 is refused `invalid_value` naming the rule and the token; the
    turns beside it, one renormalised and the same values not said to be,
    are applied."""
    import zmq

    import rollstream.broker.service as service_module
    from rollstream.broker.service import BrokerService
    from rollstream.broker.settings import BrokerSettings
    from rollstream.common.trajectory import Turn
    from rollstream.common.validation import RULE_SUPPORT_NORMALIZED
    from rollstream.common.wire import encode_turn

    if ahead:  # every turn is large enough to be checked on the checker's thread
        monkeypatch.setattr(service_module, "CHECK_AHEAD_FROM_BYTES", 0)
    half, quarter = float(np.log(np.float32(0.5))), float(np.log(np.float32(0.25)))
    supports = [[5, 6], [7, 8, 9]]

    def frames(tid, seq, values, normalized):
        turn = Turn.build([5, 7], [half, half], supports=supports, mask_log_probs=values,
                          mask_log_probs_normalized=normalized, check_content=False)
        return encode_turn(tid, 0, turn, seq=seq, prompt_tokens=np.array([1, 2], np.int32))

    short = [half, half, half, quarter, -8.0]  # token 1's support: 0.5 + 0.25 + e**-8
    context = zmq.Context()
    service = BrokerService(BrokerSettings(producer_endpoint="inproc://p", consumer_endpoint="inproc://c",
                                           admin_endpoint="inproc://a", data_dir=str(tmp_path / "data"),
                                           metrics_port=0, vocab_size=1000), context=context)
    service.start()
    sock = context.socket(zmq.DEALER)
    try:
        sock.connect("inproc://p")
        for message in (frames("good", 1, [half, half, half, quarter, quarter], True), frames("bad", 2, short, True),
                        frames("unsaid", 3, short, False)):
            sock.send_multipart(message)
        replies: dict[int, object] = {}
        for _ in range(1000):
            service.run_once(timeout_ms=10)
            while sock.poll(0):
                reply = decode(sock.recv_multipart(), BROKER_TO_PRODUCER)
                replies[reply["seq"]] = reply
            if len(replies) == 3:
                break
        assert [(replies[seq].type, replies[seq].get("applied")) for seq in (1, 3)] == [("ack", True)] * 2, replies
        refused = replies[2]
        assert (refused.type, refused["code"]) == ("nack", "invalid_value"), refused
        assert refused["message"].startswith(f"rule '{RULE_SUPPORT_NORMALIZED}' violated at token 1: expected its 3 "
                                             "probabilities to sum to 1, got 0.75"), refused["message"]
        assert set(service.core.engine.entries) == {"good", "unsaid"}
    finally:
        sock.close(linger=0)
        service.close()
        context.term()
