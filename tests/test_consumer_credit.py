"""Where a consumer's credit goes (`consumer.credit.Credit`), alone and
between the two real sans-I/O cores of a fan-in: one consumer's `Sessions`
reading many brokers' `Dispatcher`s, wired by hand without sockets or
clocks, the way the broker's core wires its dispatcher (welcome, deliveries
and news carry the queued count; a revoke is answered with it)."""
from __future__ import annotations

import itertools
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.broker.dispatch import Dispatcher
from rollstream.broker.engine import DeliveryUnit
from rollstream.common.codec import Message
from rollstream.common.jobs import DEFAULT_JOB
from rollstream.consumer.assembly import Assembler
from rollstream.consumer.credit import Credit
from rollstream.consumer.session import Sessions

CONNECTION = b"consumer"


# -- the policy alone -----------------------------------------------------------
def test_a_broker_holding_trajectories_gets_the_budget_in_one_grant_and_the_next_one_comes_in_a_chunk():
    credit = Credit(64, budget=64)
    for broker in range(64):
        credit.connected(broker, queued=64)
    assert credit.plan(free=128) == ({0: 64}, [])
    for left in range(63, 53, -1):  # ten of broker 0's arrive: ten units of room are not worth a message
        credit.used(0)
        credit.told(0, left)
    assert credit.plan(free=128) == ({}, [])
    for _ in range(6):
        credit.used(0)
    assert credit.plan(free=128) == ({1: 16}, [])  # a quarter of the budget, to the next broker in turn


def test_a_broker_that_does_not_say_keeps_its_fixed_window_and_empty_ones_get_a_standing_window():
    credit = Credit(4, budget=8)
    credit.connected(0, queued=None)  # an older broker: it never says what it holds
    credit.connected(1, queued=0)
    credit.connected(2, queued=0)
    assert credit.plan(free=100) == ({0: 2, 1: 2, 2: 2}, [])  # broker 3 has not welcomed us
    credit.told(0, 50)  # ignored: it said nothing at its welcome
    assert credit.plan(free=100) == ({}, [])


def test_credit_parked_at_empty_brokers_is_revoked_when_a_broker_with_trajectories_waits():
    credit = Credit(4, budget=8)
    for broker in range(4):
        credit.connected(broker, queued=0)
    assert credit.plan(free=100) == ({0: 2, 1: 2, 2: 2, 3: 2}, [])
    credit.used(3)
    credit.told(3, 40)  # broker 3 is busy now; the budget sits at 0, 1 and 2
    assert credit.plan(free=100) == ({}, [0, 1, 2])
    assert credit.plan(free=100) == ({}, [])  # asked once; the credit counts until the answers come
    credit.revoked(0, 0)
    credit.revoked(1, 0)
    assert credit.plan(free=100) == ({3: 5}, [])  # broker 2's two still count until it answers
    credit.revoked(2, 0)
    assert credit.plan(free=100) == ({3: 2}, [])


def test_group_credit_asks_for_units_not_trajectories():
    credit = Credit(2, budget=16)
    credit.connected(0, queued=20)
    assert credit.plan(free=100, per_unit=4) == ({0: 5}, [])


# -- a consumer fanning in from real dispatchers ----------------------------------
class Node:
    """A broker's consumer side: its real `Dispatcher`, answering as the core does."""

    def __init__(self, index: int):
        self.index = index
        self.dispatcher = Dispatcher()
        self.ids = (f"b{index}-t{k}" for k in itertools.count())
        self.arrived: dict[str, int] = {}  # trajectory id -> the step it was queued at
        self.stolen: set[str] = set()  # what another consumer took
        self.race = 0  # how many another consumer takes just before our next credit arrives

    def arrive(self, n: int, step: int = 0) -> None:
        for _ in range(n):
            tid = next(self.ids)
            self.arrived[tid] = step
            self.dispatcher.enqueue(DeliveryUnit((tid,)))

    def steal(self, n: int) -> None:
        """Another consumer's connection takes `n` of the queue."""
        other = self.dispatcher.consumers.get(b"other")
        if other is None:
            self.dispatcher.hello(b"other", "other", 0.0)
        self.dispatcher.credit(b"other", n, "trajectory")

    def answer(self, kind: str, fields: dict) -> list[Message]:
        d = self.dispatcher
        if kind == "hello":
            d.hello(CONNECTION, fields["consumer_id"], 0.0, counts=bool(fields.get("queued_counts")))
            return [Message("welcome", {"broker_id": f"b{self.index}", "lease_timeout": 60.0, "heartbeat_interval": 1.0,
                                        "queued_counts": True, "queued": d.tell(CONNECTION)}, {})]
        if kind == "credit":
            if self.race:
                self.steal(self.race)
                self.race = 0
                for dispatch in d.deliveries(0.0):
                    d.end_leases([dispatch.lease])
                    self.stolen.add(dispatch.trajectory_id)
            d.credit(CONNECTION, fields["n"], fields["unit"])
        elif kind == "revoke":
            d.revoke(CONNECTION)
            return [Message("revoked", {"queued": d.tell(CONNECTION)}, {})]
        elif kind == "ack":
            d.end_leases(fields["leases"])
            return [Message("acked", {"leases": fields["leases"]}, {})]
        return []

    def pump(self) -> list[Message]:
        d = self.dispatcher
        out = []
        for dispatch in d.deliveries(0.0):
            if dispatch.identity == CONNECTION:
                out.append(Message("deliver", {"lease": dispatch.lease, "trajectory_id": dispatch.trajectory_id,
                                               "queued": d.tell(CONNECTION)}, {}))
            else:
                d.end_leases([dispatch.lease])  # the other consumer trains it at once
                self.stolen.add(dispatch.trajectory_id)
        return out + [Message("queued", {"n": n}, {}) for identity, n in d.queued_news() if identity == CONNECTION]


class FanIn:
    """One consumer over `nodes`; `step` is one pass of its I/O loop and of each broker's."""

    def __init__(self, nodes: list[Node], batch_size: int, prefetch: int | None = None):
        self.nodes = nodes
        self.batch_size = batch_size
        self.assembler = Assembler(len(nodes), batch_size=batch_size, prefetch=prefetch)
        self.sessions = Sessions(self.assembler, [f"ipc://b{n.index}" for n in nodes], consumer_id="c",
                                 hello_timeout=5.0)
        self.sent: dict[str, int] = {}
        self.received: dict[str, int] = {}  # trajectory id -> the step it was taken into a batch at
        self.batches: list[int] = []

    def step(self, now: float) -> None:
        for broker, kind, fields in self.sessions.due(now, closing=False):
            self.sent[kind] = self.sent.get(kind, 0) + 1
            for message in self.nodes[broker].answer(kind, fields):
                self.sessions.received(broker, message, now)
        for node in self.nodes:
            for message in node.pump():
                self.sessions.received(node.index, message, now)

    def train(self, step: int) -> bool:
        """Take and commit a full batch if one is there."""
        if not self.assembler.fills(self.batch_size):
            return False
        units = self.assembler.take(self.batch_size)
        tids = [tid for unit in units for tid in unit.members]
        assert not self.received.keys() & set(tids), "a trajectory came twice"
        self.received.update(dict.fromkeys(tids, step))
        self.batches.append(len(tids))
        self.assembler.commit(tids)
        return True

    def promised(self) -> int:
        return self.assembler.credit.outstanding


def test_a_consumer_over_64_brokers_sends_a_few_messages_per_batch_not_one_per_broker():
    nodes = [Node(i) for i in range(64)]
    for node in nodes:
        node.arrive(32)
    fan = FanIn(nodes, batch_size=32)
    for step in range(1000):
        fan.step(step * 0.001)
        fan.train(step)
        if len(fan.received) == 64 * 32:
            break
    assert len(fan.received) == 64 * 32 and fan.batches == [32] * 64
    # Credit and acks per batch of 32: a handful, where one window per broker made it one of each per trajectory.
    assert fan.sent["credit"] <= 2 * 64 and fan.sent["ack"] <= 3 * 64, fan.sent
    assert "revoke" not in fan.sent  # every broker held trajectories: no credit was ever parked


def test_one_busy_broker_and_63_nearly_empty_ones_every_batch_fills_and_none_starves():
    """The busy broker always holds more than the whole budget; each other
    broker gets one or two trajectories now and then. Batches are always
    full, and every trajectory of a nearly empty broker is in a batch within
    (prefetch + credit budget) / batch size + 1 batches of its arrival: what
    is buffered ahead of it, and one turn of the round-robin."""
    rng = random.Random(7)
    nodes = [Node(i) for i in range(64)]
    busy, quiet = nodes[0], nodes[1:]
    busy.arrive(500)
    for node in quiet:
        node.arrive(1)
    fan = FanIn(nodes, batch_size=16)
    bound = (fan.assembler.prefetch + fan.assembler.credit.budget) // 16 + 1
    batches_at: list[int] = []  # the step of each batch
    for step in range(3000):
        if step % 10 == 0:
            busy.arrive(16, step)
        for node in rng.sample(quiet, 2) if step % 25 == 0 else ():
            node.arrive(rng.randint(1, 2), step)
        fan.step(step * 0.001)
        if fan.train(step):
            batches_at.append(step)
    assert len(fan.batches) > 100 and set(fan.batches) == {16}  # the busy broker alone fills every batch
    late = []
    for node in quiet:
        for tid, arrived in node.arrived.items():
            taken = fan.received.get(tid)
            if taken is None or sum(arrived < at <= taken for at in batches_at) > bound:
                late.append((tid, arrived, taken))
    # The last few arrivals may still be on their way when the run stops.
    assert all(arrived > batches_at[-bound] for _, arrived, taken in late if taken is None), late
    assert not [entry for entry in late if entry[2] is not None], late
    assert sum(tid.startswith("b0-") for tid in fan.received) > len(fan.received) * 0.8


def test_credit_parked_at_a_broker_another_consumer_emptied_is_revoked_and_the_batch_fills():
    nodes = [Node(i) for i in range(4)]
    nodes[1].arrive(8)
    nodes[1].race = 8  # another consumer takes all eight as our credit for them is on its way
    fan = FanIn(nodes, batch_size=8, prefetch=16)  # a budget of 8
    fan.step(0.0)  # hellos and welcomes
    fan.step(0.001)
    assert fan.promised() == 8 and fan.assembler.credit.brokers[1].queued == 0  # all of it parked at broker 1
    nodes[3].arrive(20)
    for step in range(2, 40):
        fan.step(step * 0.001)
        if fan.train(step):
            break
    assert fan.batches == [8] and fan.sent["revoke"] == 1
    assert all(tid.startswith("b3-") for tid in fan.received) and len(nodes[1].stolen) == 8


@settings(max_examples=60, deadline=None)
@given(
    n_brokers=st.integers(1, 5),
    batch_size=st.integers(1, 6),
    extra=st.integers(0, 6),
    ops=st.lists(st.tuples(st.sampled_from(["arrive", "steal", "step", "train"]), st.integers(0, 9)), max_size=60),
)
def test_credit_stays_within_the_prefetch_and_everything_queued_reaches_a_batch(n_brokers, batch_size, extra, ops):
    """Whatever arrives where, and whatever another consumer takes, the
    consumer never holds or promises more than its prefetch, never promises
    more than the prefetch less a batch, and in the end every trajectory
    still queued reaches one of its batches."""
    nodes = [Node(i) for i in range(n_brokers)]
    prefetch = batch_size + 1 + extra  # less than a unit per broker beyond a batch: they all say what they hold
    fan = FanIn(nodes, batch_size=batch_size, prefetch=prefetch)
    clock = itertools.count()

    def step() -> None:
        fan.step(next(clock) * 0.001)
        assert fan.assembler.complete + fan.promised() <= prefetch
        assert fan.promised() <= prefetch - batch_size

    for op, arg in ops:
        node = nodes[arg % n_brokers]
        if op == "arrive":
            node.arrive(arg)
        elif op == "steal":
            node.steal(arg)
        elif op == "train":
            fan.train(0)
        step()
    for node in nodes:  # the other consumer leaves; what it had not taken stays queued for ours
        node.dispatcher.consumers.pop(b"other", None)
    for _ in range(200):
        step()
        while fan.train(0):
            pass
    assert not any(node.dispatcher.queued_in(DEFAULT_JOB) for node in nodes), "trajectories stayed queued"
    buffered = {tid for unit in fan.assembler.take(batch_size) for tid in unit.members}  # less than a batch
    for node in nodes:
        assert set(node.arrived) == (set(fan.received) | buffered | node.stolen) & set(node.arrived)
