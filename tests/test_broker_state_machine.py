"""The merge engine, the dispatcher and the consumer's assembler driven
together by Hypothesis: random producer frames, credit, acks, nacks, lease
expiries, consumer losses and read-back failures, with the glue the broker
service puts between them (effects committed at once, ready units queued,
settlements applied). After every step: credit in use never exceeds the
credit granted, a group is delivered whole or not at all, every ended
trajectory is acked, dead-lettered, queued, leased or waiting for its group
(exactly one), and no trajectory is delivered more than `max_deliveries`
times."""
from broker_helpers import abort_msg, end_msg, turn_msg
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rollstream.broker.dispatch import Dispatcher, DispatchSettings
from rollstream.broker.engine import DEAD, ENDED, EngineSettings, MergeEngine
from rollstream.consumer.assembly import Assembler

ME = b"consumer"
LEASE_TIMEOUT, HEARTBEAT, MAX_DELIVERIES = 10.0, 1.0, 3
GROUPS = {"A": ("a0", "a1"), "B": ("b0", "b1", "b2")}
SINGLES = ("s0",)
GROUP_OF = {tid: (gid, len(members)) for gid, members in GROUPS.items() for tid in members}
TRAJECTORIES = (*SINGLES, *GROUP_OF)


class Pipeline(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.now = 0.0
        self.engine = MergeEngine(EngineSettings(trajectory_ttl=50.0, dedup_window=1e12))
        self.dispatcher = Dispatcher(DispatchSettings(LEASE_TIMEOUT, HEARTBEAT, MAX_DELIVERIES))
        self.assembler = Assembler(1, batch_size=1, unit="group", prefetch=3)
        self.turns = dict.fromkeys(TRAJECTORIES, 0)  # turns each producer has applied
        self.ended: set[str] = set()
        self.acked: set[str] = set()
        self.connected = False
        self.granted = 0  # group credit granted in this session
        self.charged = 0  # units delivered under it, and not retracted

    # -- glue (what broker/service.py does between the cores) ---------------
    def _queue_ready(self):
        for unit in self.engine.ready_units:
            self.dispatcher.enqueue(unit)
        self.engine.ready_units.clear()

    def _dead_letter(self, tids, reason):
        for tid in tids:
            self.engine.dead_letter(tid, reason, self.now)
            self.dispatcher.forget(tid)
        self._queue_ready()

    def _flush_outbox(self):
        for out in self.assembler.take_outbox():
            if out.type == "credit":
                continue
            leases = out.fields["leases"]
            known = [lease for lease in leases if lease in self.dispatcher.leases]
            stale = [lease for lease in leases if lease not in known]
            settled, _ = self.dispatcher.settle(known)
            tids = [lease.trajectory_id for lease in settled]
            if out.type == "ack":
                for tid in tids:
                    self.engine.delivered(tid, self.now)
                    self.dispatcher.forget(tid)
                self.acked.update(tids)
            elif out.fields["requeue"]:
                self._dead_letter(self.dispatcher.requeue(settled), "max_deliveries")
            else:
                self._dead_letter(tids, out.fields["reason"])
            self.assembler.settled(0, known)
            self.assembler.settled(0, stale, stale=True)

    def _grant(self):
        for _, n in self.assembler.credit_grants().items():
            self.dispatcher.credit(ME, n, "group")
            self.granted += n

    # -- producers ------------------------------------------------------------
    @rule(tid=st.sampled_from(TRAJECTORIES), tokens=st.integers(1, 3))
    def turn(self, tid, tokens):
        index = self.turns[tid]
        ids = list(range(10, 10 + tokens))
        message = turn_msg(tid, index, ids, [[t] for t in ids], group=GROUP_OF.get(tid), seq=index)
        reply = self.engine.handle(message, self.now)
        if reply.error is None and reply.fields.get("applied") and not reply.fields.get("duplicate"):
            self.turns[tid] += 1
        self._queue_ready()

    @rule(group=st.sampled_from(sorted(GROUPS)))
    def group_finishes(self, group):
        """Every member of a group sends a turn and ends (the rarest way to a
        delivery, drawn step by step)."""
        for tid in GROUPS[group]:
            self.turn(tid, 1)
            self.end(tid)

    @rule(tid=st.sampled_from(TRAJECTORIES))
    def end(self, tid):
        reply = self.engine.handle(end_msg(tid, reward=1.0), self.now)
        if reply.error is None and not reply.fields.get("duplicate") and reply.fields["applied"]:
            self.ended.add(tid)
        self._queue_ready()

    @rule(tid=st.sampled_from(TRAJECTORIES))
    def abort(self, tid):
        reply = self.engine.handle(abort_msg(tid), self.now)
        if reply.error is None and reply.fields["applied"]:
            self.turns[tid] = 0
        self._queue_ready()

    @rule()
    def trajectories_expire(self):
        self.now += 60.0
        if self.connected:
            self.dispatcher.seen(ME, self.now)
        self.engine.expire(self.now)
        self._queue_ready()

    # -- the consumer -----------------------------------------------------------
    @rule()
    def hello(self):
        self._dead_letter(self.dispatcher.hello(ME, "c", self.now), "max_deliveries")
        self.assembler.welcomed(0, LEASE_TIMEOUT)
        self.connected, self.granted, self.charged = True, 0, 0
        self._grant()

    @rule(read_back_fails=st.booleans())
    def deliver(self, read_back_fails):
        deliveries = self.dispatcher.deliveries(self.now)
        units = {}
        for delivery in deliveries:
            units.setdefault(id(delivery.unit), (delivery.unit, []))[1].append(delivery.trajectory_id)
        for unit, tids in units.values():
            assert tuple(tids) == unit.trajectory_ids, f"a unit goes whole: expected {unit.trajectory_ids}, sent {tids}"
        for delivery in deliveries:
            assert delivery.delivery_count <= MAX_DELIVERIES, (delivery.trajectory_id, delivery.delivery_count)
        if read_back_fails:  # the service gives them back, credit refunded, each unit whole
            self.dispatcher.retract([d.lease for d in deliveries], refund=True)
            return
        self.charged += len(units)
        for d in deliveries:
            fields = {"trajectory_id": d.trajectory_id, "lease": d.lease, "delivery_count": d.delivery_count,
                      **d.group_fields}
            self.assembler.delivered(0, fields, {}, self.now)
        self._flush_outbox()

    @rule(how=st.sampled_from(["commit", "reject", "release"]))
    def train(self, how):
        units = self.assembler.take(1)
        for unit in units:
            if unit.group_id is not None:
                assert unit.complete, f"group {unit.group_id} taken with {sorted(unit.members)} of {unit.expected}"
            tids = list(unit.members)
            if how == "commit":
                self.assembler.commit(tids)
            elif how == "reject":
                self.assembler.reject({tid: "bad" for tid in tids})
            else:
                self.assembler.release(tids)
        self._flush_outbox()
        if self.connected:
            self._grant()

    @rule()
    def leases_expire(self):
        self.now += LEASE_TIMEOUT + 1
        if self.connected:
            self.dispatcher.seen(ME, self.now)
        self._dead_letter(self.dispatcher.tick(self.now), "max_deliveries")
        self.assembler.expire(self.now)
        self._flush_outbox()

    @rule()
    def consumer_lost(self):
        self.now += 3 * HEARTBEAT + 0.5
        self._dead_letter(self.dispatcher.tick(self.now), "max_deliveries")
        if ME not in self.dispatcher.consumers:
            self.assembler.lost(0)
            self.connected = False

    # -- invariants -----------------------------------------------------------
    @invariant()
    def credit_in_use_never_exceeds_credit_granted(self):
        consumer = self.dispatcher.consumers.get(ME)
        if consumer is None:
            return
        assert consumer.group_credit >= 0
        assert self.charged + consumer.group_credit <= self.granted, (self.charged, consumer.group_credit, self.granted)

    @invariant()
    def queued_groups_are_whole_units(self):
        for unit in self.dispatcher.queue:
            if unit.group_id is not None:
                assert unit.group_left == unit.group_size - len(unit.trajectory_ids), unit

    @invariant()
    def every_ended_trajectory_is_in_exactly_one_place(self):
        queued = [tid for unit in self.dispatcher.queue for tid in unit.trajectory_ids]
        leased = [lease.trajectory_id for lease in self.dispatcher.leases.values()]
        for tid in self.ended:
            entry = self.engine.entries.get(tid)
            group = self.engine.groups.get(entry.group_id) if entry is not None and entry.group_id else None
            places = {
                "acked": tid in self.acked,
                "dead": entry is not None and entry.state == DEAD,
                "queued": queued.count(tid),
                "leased": leased.count(tid),
                "waiting for its group": entry is not None and entry.state == ENDED and group is not None
                and not group.released,
            }
            assert sum(places.values()) == 1, (tid, places)

    @invariant()
    def delivery_counts_stay_within_max_deliveries(self):
        assert all(count <= MAX_DELIVERIES for count in self.dispatcher.delivery_counts.values()), \
            self.dispatcher.delivery_counts


Pipeline.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_pipeline = Pipeline.TestCase
