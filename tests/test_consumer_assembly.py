"""The consumer's sans-I/O core: deduplication, leases, groups, credit,
session loss and settlement retries, driven deterministically."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.common.errors import InvalidState
from rollstream.consumer.assembly import RETRY_AFTER, Assembler, Outgoing


def fields(tid, lease, **extra):
    return {"trajectory_id": tid, "lease": lease, **extra}


def welcomed(n_brokers=1, lease_timeout=30.0, **kw):
    assembler = Assembler(n_brokers, **kw)
    for broker in range(n_brokers):
        assembler.welcomed(broker, lease_timeout)
    return assembler


def sent(assembler):
    return [(o.broker, o.type, sorted(o.fields.get("leases", [])), o.fields.get("requeue")) for o in assembler.take_outbox()]


def test_redelivery_before_take_is_one_unit_and_commit_acks_every_lease():
    a = welcomed(batch_size=2)
    a.delivered(0, fields("t1", "L1"), {}, 0.0)
    a.delivered(0, fields("t1", "L2"), {}, 1.0)
    a.delivered(0, fields("t2", "L3"), {}, 1.0)
    assert a.complete == 2 and a.stats.duplicates == 1
    units = a.take(2)
    assert [list(u.members) for u in units] == [["t1"], ["t2"]]
    a.commit(["t1", "t2"])
    assert sent(a) == [(0, "ack", ["L1", "L2", "L3"], None)]


def test_a_seal_queued_after_a_commit_goes_out_after_its_ack():
    """A broker seals what it has recorded as trained: a seal sent ahead of
    the ack would leave that batch unsealed."""
    a = welcomed(batch_size=1)
    a.delivered(0, fields("t1", "L1"), {}, 0.0)
    a.take(1)
    a.commit(["t1"], step=1)
    a.outbox.append(Outgoing(0, "seal", {"step": 1, "keep": 2}))  # as `Consumer.sealed` queues it
    assert [(o.type, o.fields.get("step")) for o in a.take_outbox()] == [("ack", 1), ("seal", 1)]


def test_redelivery_while_with_the_trainer_adds_its_lease():
    a = welcomed(batch_size=1)
    a.delivered(0, fields("t1", "L1"), {}, 0.0)
    a.take(1)
    a.delivered(0, fields("t1", "L2"), {}, 5.0)
    assert a.complete == 0
    a.commit(["t1"])
    assert sent(a) == [(0, "ack", ["L1", "L2"], None)]


def test_redelivery_after_commit_is_acked_at_once_and_never_offered_again():
    a = welcomed(batch_size=1)
    a.delivered(0, fields("t1", "L1"), {}, 0.0)
    a.take(1)
    a.commit(["t1"])
    a.take_outbox()
    a.delivered(0, fields("t1", "L9"), {}, 1.0)
    assert a.complete == 0 and sent(a) == [(0, "ack", ["L9"], None)]
    with pytest.raises(KeyError):
        a.commit(["t1"])


def test_rejected_trajectory_is_dead_lettered_again_when_redelivered():
    a = welcomed(batch_size=1)
    a.delivered(0, fields("bad", "L1"), {}, 0.0)
    a.take(1)
    a.reject({"bad": "rule x violated"})
    out = a.take_outbox()
    assert [(o.type, o.fields["reason"], o.fields["requeue"]) for o in out] == [("nack", "rule x violated", False)]
    a.delivered(0, fields("bad", "L2"), {}, 1.0)
    (again,) = a.take_outbox()
    assert again.type == "nack" and again.fields["leases"] == ["L2"] and not again.fields["requeue"]


def test_groups_complete_with_the_members_that_ended():
    a = welcomed(batch_size=2, unit="group")
    a.delivered(0, fields("g1-a", "L1", group_id="g1", group_size=3, group_left=1), {}, 0.0)
    assert a.complete == 0
    a.delivered(0, fields("g1-b", "L2", group_id="g1", group_size=3, group_left=1), {}, 0.0)
    a.delivered(0, fields("solo", "L3"), {}, 0.0)
    assert a.complete == 2
    group, solo = a.take(2)
    assert sorted(group.members) == ["g1-a", "g1-b"] and group.group_id == "g1" and list(solo.members) == ["solo"]


def test_trajectory_unit_ignores_groups():
    a = welcomed(batch_size=2)
    a.delivered(0, fields("g1-a", "L1", group_id="g1", group_size=3), {}, 0.0)
    assert a.complete == 1


def test_lost_session_drops_buffered_units_and_the_next_session_settles_held_ones_by_id():
    a = welcomed(2, batch_size=1)
    a.delivered(0, fields("t0", "A1"), {}, 0.0)
    a.delivered(1, fields("t1", "B1"), {}, 0.0)
    a.delivered(0, fields("t2", "A2"), {}, 0.0)
    a.take(1)  # t0, now with the trainer
    a.lost(0)
    assert a.complete == 1  # t1 from broker 1 stays; t2 from broker 0 is being redelivered
    assert a.credit_grants().keys() <= {1}  # no credit to a broker we are not connected to
    a.commit(["t0"])
    assert sent(a) == []  # nothing goes to a broker that does not know us
    a.welcomed(0, 30.0)
    out = a.take_outbox()  # the old lease, named with its trajectory: the broker settles it by id
    assert [(o.broker, o.type, o.fields) for o in out] == [(0, "ack", {"leases": ["A1"], "trajectory_ids": ["t0"]})]
    a.delivered(0, fields("t2", "A3"), {}, 1.0)  # redelivery is a fresh unit, not a duplicate
    assert a.stats.duplicates == 0


def test_an_unanswered_ack_is_resent_to_the_next_session():
    a = welcomed(batch_size=1)
    a.delivered(0, fields("t0", "A1"), {}, 0.0)
    a.take(1)
    a.commit(["t0"])
    assert sent(a) == [(0, "ack", ["A1"], None)]
    a.lost(0)  # the broker restarted before answering
    a.welcomed(0, 30.0)
    assert sent(a) == [(0, "ack", ["A1"], None)] and a.unsettled == 1
    a.settled(0, ["A1"])
    assert a.unsettled == 0


def test_buffered_unit_expires_with_its_lease():
    a = welcomed(lease_timeout=10.0, batch_size=1)
    a.delivered(0, fields("t1", "L1"), {}, 0.0)
    a.expire(5.0)
    assert a.complete == 1
    a.expire(10.5)
    assert a.complete == 0 and a.stats.expired_in_buffer == 1
    a.delivered(0, fields("t1", "L2"), {}, 11.0)
    assert a.complete == 1


def test_each_buffered_unit_expires_with_its_own_brokers_lease_whatever_came_before_it():
    """The assembler looks at its units only once the earliest expiry may
    have passed: a later unit from a broker with shorter leases (or with a
    shorter lease timeout since a new welcome) moves that time earlier."""
    a = welcomed(n_brokers=2, lease_timeout=100.0, batch_size=4)
    a.welcomed(1, 1.0)
    a.delivered(0, fields("slow", "L1"), {}, 0.0)
    a.expire(50.0)  # nothing due: the next look is at 100
    a.delivered(1, fields("fast", "L2"), {}, 60.0)
    a.expire(61.5)
    assert a.complete == 1 and a.stats.expired_in_buffer == 1  # the fast broker's unit went, at its own lease
    a.welcomed(0, 5.0)  # the slow broker's new session: what it delivered before is dropped; leases are short now
    a.delivered(0, fields("late", "L3"), {}, 70.0)
    a.expire(75.5)
    assert a.complete == 0 and a.stats.expired_in_buffer == 2


def test_unavailable_settlement_is_resent():
    a = welcomed(batch_size=1)
    a.delivered(0, fields("t1", "L1"), {}, 0.0)
    a.take(1)
    a.commit(["t1"])
    a.take_outbox()
    a.unavailable(0, ["L1"], 100.0)
    a.expire(100.0 + RETRY_AFTER / 2)
    assert sent(a) == []
    a.expire(100.0 + RETRY_AFTER * 1.5)
    assert sent(a) == [(0, "ack", ["L1"], None)]
    a.settled(0, ["L1"])
    assert a.unsettled == 0 and a.stats.acked == 1


def test_release_gives_back_held_and_buffered_groups_whole():
    a = welcomed(batch_size=1, unit="group")
    a.delivered(0, fields("x", "L0"), {}, 0.0)
    a.take(1)
    a.delivered(0, fields("g-a", "L1", group_id="g", group_size=2), {}, 0.0)
    a.delivered(0, fields("g-b", "L2", group_id="g", group_size=2), {}, 0.0)
    a.release(["g-a"])  # a buffered group goes back whole
    assert sent(a) == [(0, "nack", ["L1", "L2"], True)]
    a.release()
    assert sent(a) == [(0, "nack", ["L0"], True)] and a.held == 0 and a.complete == 0


def test_prefetch_must_leave_room_for_a_batch_and_one_credit_per_broker_that_sends_no_queued_counts():
    with pytest.raises(ValueError, match=r"prefetch must be at least batch_size \+ 1 = 5"):
        Assembler(3, batch_size=4, prefetch=4)
    a = Assembler(3, batch_size=4, prefetch=6)
    a.welcomed(0, 30.0, queued=0)  # brokers that say what they hold need no window each
    with pytest.raises(InvalidState, match=r"prefetch covers brokers that send no queued counts.*at least "
                                           r"batch_size \+ brokers = 7, got 6"):
        a.welcomed(1, 30.0)


@settings(max_examples=60, deadline=None)
@given(
    n_brokers=st.integers(1, 4),
    batch_size=st.integers(1, 6),
    extra=st.integers(0, 8),
    ops=st.lists(st.tuples(st.sampled_from(["deliver", "take", "idle", "lose"]), st.integers(0, 3)), max_size=80),
)
def test_credit_stays_bounded_and_a_batch_always_fills(n_brokers, batch_size, extra, ops):
    """Whatever the brokers do, buffered plus promised units never exceed
    `prefetch`; and when every broker with data delivers what its credit
    allows, a full batch forms even if the other brokers hoard credit."""
    prefetch = batch_size + n_brokers + extra
    a = welcomed(n_brokers, batch_size=batch_size, prefetch=prefetch)
    credit = [0] * n_brokers  # what each broker believes it may send
    counter = iter(range(10**6))

    def grant():
        for broker, n in a.credit_grants().items():
            credit[broker] += n
        buffered = a.complete
        promised = a.credit.outstanding
        assert buffered + promised <= prefetch

    def deliver(broker):
        while credit[broker]:
            credit[broker] -= 1
            k = next(counter)
            a.delivered(broker, fields(f"t{k}", f"L{k}"), {}, 0.0)

    grant()
    for op, arg in ops:
        broker = arg % n_brokers
        if op == "deliver":
            deliver(broker)
        elif op == "take":
            a.commit([tid for unit in a.take(batch_size) for tid in unit.members])
        elif op == "lose":
            a.lost(broker)
            credit[broker] = 0
            a.welcomed(broker, 30.0)
        grant()
    # Only the last broker (the last offered credit) has data; the others
    # never deliver: a batch must still form.
    for _ in range(batch_size + 1):
        deliver(n_brokers - 1)
        grant()
    assert a.complete >= batch_size


def test_prefetched_units_behind_the_bound_are_dead_lettered_stale_and_a_redelivery_is_settled_alike():
    a = welcomed(batch_size=4, unit="group")
    a.delivered(0, fields("old", "L1", weight_versions=["step-3", "step-9"]), {}, 0.0)  # its oldest turn: 3
    a.delivered(0, fields("new", "L2", weight_versions=["7"]), {}, 0.0)
    a.delivered(0, fields("g0", "L3", group_id="G", group_size=2, weight_versions=["8"]), {}, 0.0)
    a.delivered(0, fields("g1", "L4", group_id="G", group_size=2, weight_versions=["6"],
                          weight_version_spans=[[["4", 0, 2], ["6", 2, 5]]]), {}, 0.0)  # a span of version 4
    a.delivered(0, fields("plain", "L5"), {}, 0.0)  # no ordered version: never stale
    assert a.drop_stale(5) == ["old", "g0", "g1"]  # the group goes whole, at its oldest member's version
    assert a.complete == 2 and a.stats.stale == 3
    assert sent(a) == [(0, "nack", ["L1", "L3", "L4"], False)]
    a.delivered(0, fields("old", "L9", weight_versions=["3"]), {}, 1.0)
    assert a.complete == 2 and sent(a) == [(0, "nack", ["L9"], False)]
    assert a.drop_stale(5) == []


def test_a_unit_the_trainers_filter_refuses_is_dead_lettered_once_complete_and_never_offered():
    seen = []

    def keep(members):
        seen.append(sorted(m["trajectory_id"] for m in members))
        return any(m["reward"] > 0 for m in members)

    a = welcomed(batch_size=4, unit="group", keep=keep)
    a.delivered(0, fields("z0", "L1", group_id="Z", group_size=2, reward=0.0), {}, 0.0)
    assert seen == []  # judged only once complete
    a.delivered(0, fields("z1", "L2", group_id="Z", group_size=2, reward=0.0), {}, 0.0)
    a.delivered(0, fields("w0", "L3", group_id="W", group_size=2, reward=0.0), {}, 0.0)
    a.delivered(0, fields("w1", "L4", group_id="W", group_size=2, reward=1.0), {}, 0.0)
    a.delivered(0, fields("s", "L5", reward=0.0), {}, 0.0)  # a trajectory outside a group is a unit of its own
    assert seen == [["z0", "z1"], ["w0", "w1"], ["s"]]
    assert a.complete == 1 and a.stats.filtered == 3
    outbox = [(o.type, sorted(o.fields["leases"]), o.fields.get("reason")) for o in a.take_outbox()]
    assert outbox == [("nack", ["L1", "L2", "L5"], "filtered:consumer")]
    a.delivered(0, fields("z0", "L9", group_id="Z", group_size=2, reward=0.0), {}, 1.0)  # a redelivery: settled alike
    assert sent(a) == [(0, "nack", ["L9"], False)] and seen == [["z0", "z1"], ["w0", "w1"], ["s"]]
