"""The dispatcher on its own: credit, leases, liveness and redelivery."""
import pytest

from rollstream.broker.dispatch import Dispatcher, DispatchSettings
from rollstream.broker.engine import DeliveryUnit

A, B = b"conn-a", b"conn-b"


@pytest.fixture
def d():
    return Dispatcher(DispatchSettings(lease_timeout=10.0, heartbeat_interval=1.0, max_deliveries=3))


def test_nothing_is_sent_without_credit(d):
    d.hello(A, "a", mono=0)
    d.enqueue(DeliveryUnit(("t1",)))
    assert d.deliveries(mono=0) == []
    d.credit(A, 1, "trajectory")
    (out,) = d.deliveries(mono=0)
    assert (out.identity, out.trajectory_id, out.delivery_count) == (A, "t1", 1)
    d.enqueue(DeliveryUnit(("t2",)))
    assert d.deliveries(mono=0) == []  # credit used up


def test_round_robin_between_consumers(d):
    for identity in (A, B):
        d.hello(identity, identity.decode(), mono=0)
        d.credit(identity, 2, "trajectory")
    for i in range(4):
        d.enqueue(DeliveryUnit((f"t{i}",)))
    sent = d.deliveries(mono=0)
    assert sorted(x.trajectory_id for x in sent) == ["t0", "t1", "t2", "t3"]
    assert sum(x.identity == A for x in sent) == 2 and sum(x.identity == B for x in sent) == 2


def test_group_credit_takes_whole_units_and_trajectory_credit_splits(d):
    d.hello(A, "a", mono=0)
    d.enqueue(DeliveryUnit(("g0", "g1", "g2"), "G", 3, 0))
    d.credit(A, 2, "trajectory")
    first = d.deliveries(mono=0)
    assert [x.trajectory_id for x in first] == ["g0", "g1"]
    assert first[0].extra_fields == {"delivery_count": 1, "group_id": "G", "group_size": 3, "group_left": 0}
    d.credit(A, 1, "group")
    assert [x.trajectory_id for x in d.deliveries(mono=0)] == ["g2"]


def test_ended_leases_leave_and_unknown_ones_are_stale(d):
    d.hello(A, "a", mono=0)
    d.credit(A, 1, "trajectory")
    d.enqueue(DeliveryUnit(("t",)))
    (out,) = d.deliveries(mono=0)
    valid, stale = d.end_leases([out.lease, "nope"])
    assert [lease.trajectory_id for lease in valid] == ["t"] and stale == ["nope"]
    assert d.end_leases([out.lease]) == ([], [out.lease])


def test_expired_lease_is_redelivered(d):
    d.hello(A, "a", mono=0)
    d.credit(A, 5, "trajectory")
    d.enqueue(DeliveryUnit(("t",)))
    first = d.deliveries(mono=0)[0]
    d.seen(A, mono=4)
    assert d.tick(mono=5) == [] and first.lease in d.leases
    d.seen(A, mono=9)
    d.tick(mono=11)
    assert first.lease not in d.leases and d.redeliveries == 1
    second = d.deliveries(mono=11)[0]
    assert second.trajectory_id == "t" and second.lease != first.lease and second.delivery_count == 2


def test_silent_consumer_loses_leases_and_credit(d):
    d.hello(A, "a", mono=0)
    d.hello(B, "b", mono=0)
    d.credit(A, 1, "trajectory")
    d.enqueue(DeliveryUnit(("t",)))
    d.deliveries(mono=0)
    d.seen(B, mono=3)
    d.tick(mono=3.5)  # A silent for 3.5 s > 3 heartbeat intervals
    assert A not in d.consumers and B in d.consumers
    assert [u.trajectory_ids for u in d.queues.get("default", ())] == [("t",)]
    d.credit(B, 1, "trajectory")
    assert d.deliveries(mono=4)[0].identity == B


def test_hello_with_same_consumer_id_drops_the_old_connection(d):
    d.hello(A, "worker", mono=0)
    d.credit(A, 1, "trajectory")
    d.enqueue(DeliveryUnit(("t",)))
    d.deliveries(mono=0)
    d.hello(B, "worker", mono=1)
    assert A not in d.consumers and [u.trajectory_ids for u in d.queues.get("default", ())] == [("t",)]


def test_max_deliveries_exhausts(d):
    d.hello(A, "a", mono=0)
    d.enqueue(DeliveryUnit(("t",)))
    now = 0
    for attempt in range(3):
        d.credit(A, 1, "trajectory")
        (out,) = d.deliveries(now)
        now += 11
        d.seen(A, now)
        exhausted = d.tick(now)
    assert exhausted == ["t"] and not d.queues


def test_requeue_keeps_group_together_with_its_size(d):
    d.hello(A, "a", mono=0)
    d.credit(A, 1, "group")
    d.enqueue(DeliveryUnit(("g0", "g1", "g2"), "G", 4, 1))
    sent = d.deliveries(mono=0)
    valid, _ = d.end_leases([sent[0].lease, sent[2].lease])
    d.requeue(valid)
    (unit,) = d.queues["default"]
    assert unit == DeliveryUnit(("g0", "g2"), "G", 4, 2)


def test_unknown_connection_is_not_seen(d):
    assert d.seen(A, mono=0) is False


def test_a_delivery_that_never_left_does_not_count(d):
    d.hello(A, "a", mono=0)
    d.credit(A, 2, "trajectory")
    d.enqueue(DeliveryUnit(("t",)))
    (out,) = d.deliveries(mono=0)
    d.retract([out.lease])
    assert out.lease not in d.leases and d.redeliveries == 0
    (again,) = d.deliveries(mono=0)
    assert again.trajectory_id == "t" and again.delivery_count == 1


@pytest.mark.parametrize("kind", ["trajectory", "group"])
def test_a_retracted_delivery_refunds_its_credit_only_when_asked(d, kind):
    d.hello(A, "a", mono=0)
    d.credit(A, 1, kind)
    d.enqueue(DeliveryUnit(("t",)))
    (out,) = d.deliveries(mono=0)
    d.retract([out.lease])  # the connection refused it: the credit stays spent
    assert d.deliveries(mono=0) == []
    d.credit(A, 1, kind)
    (again,) = d.deliveries(mono=0)
    d.retract([again.lease], refund=True)  # the broker could not make it: the consumer keeps its credit
    (third,) = d.deliveries(mono=0)
    assert third.trajectory_id == "t" and third.delivery_count == 1
    assert d.deliveries(mono=0) == []  # one credit, one delivery


def test_a_retracted_group_refunds_one_group_credit_and_goes_back_whole(d):
    """A group costs one group credit; a delivery of it that never left
    refunds that one credit, and the group comes back as one unit."""
    d.hello(A, "a", mono=0)
    d.credit(A, 1, "group")
    d.enqueue(DeliveryUnit(("g0", "g1", "g2", "g3"), "G", 4, 0))
    sent = d.deliveries(mono=0)
    d.retract([out.lease for out in sent], refund=True)
    assert d.consumers[A].group_credit == 1
    assert list(d.queues["default"]) == [DeliveryUnit(("g0", "g1", "g2", "g3"), "G", 4, 0)]
    again = d.deliveries(mono=0)
    assert [x.trajectory_id for x in again] == ["g0", "g1", "g2", "g3"]
    assert {x.unit.group_left for x in again} == {0} and {x.delivery_count for x in again} == {1}
    assert d.deliveries(mono=0) == [] and d.consumers[A].group_credit == 0


def test_retracting_part_of_a_unit_puts_that_part_back_as_one_unit(d):
    """Trajectory credit refunds one per trajectory; the retracted members
    go back together with `group_left` recomputed for them."""
    d.hello(A, "a", mono=0)
    d.credit(A, 3, "trajectory")
    d.enqueue(DeliveryUnit(("g0", "g1", "g2"), "G", 4, 1))
    sent = d.deliveries(mono=0)
    d.retract([sent[1].lease, sent[2].lease], refund=True)
    assert d.consumers[A].trajectory_credit == 2 and list(d.leases) == [sent[0].lease]
    assert list(d.queues["default"]) == [DeliveryUnit(("g1", "g2"), "G", 4, 2)] and d.queued_trajectories == 2
