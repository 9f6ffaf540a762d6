"""A consumer's ack or nack settled with the engine and dispatcher alone
(`broker.settlement.Settlement`): which leases count, what the store must
make durable, and what the dispatcher does once it is."""
from broker_helpers import end_msg, turn_msg

from rollstream.broker.dispatch import Dispatcher, DispatchSettings
from rollstream.broker.engine import DEAD, DeadLetter, Forget, MergeEngine
from rollstream.broker.settlement import Settlement
from rollstream.common.codec import Message

C = b"consumer"


def ready(*tids: str, max_deliveries: int = 3) -> tuple[MergeEngine, Dispatcher, dict[str, str]]:
    """An engine with `tids` ended and a dispatcher that leased each to C; their leases by id."""
    engine, dispatcher = MergeEngine(), Dispatcher(DispatchSettings(lease_timeout=10.0, max_deliveries=max_deliveries))
    for tid in tids:
        engine.handle(turn_msg(tid, 0), 1.0)
        engine.handle(end_msg(tid), 1.0)
    for unit in engine.queued_units:
        dispatcher.enqueue(unit)
    dispatcher.hello(C, "c", mono=0.0)
    dispatcher.credit(C, len(tids), "trajectory")
    return engine, dispatcher, {d.trajectory_id: d.lease for d in dispatcher.deliveries(mono=0.0)}


def settle(kind: str, leases: list[str], **fields) -> Message:
    return Message(kind, {"leases": leases, **fields}, {})


def test_an_ack_settles_its_known_leases_once_and_calls_the_rest_stale():
    engine, dispatcher, leases = ready("a", "b")
    message = settle("ack", [leases["a"], "L-unknown", leases["a"], leases["b"]])
    s = Settlement.prepare(C, message, dispatcher, engine, wall=5.0, claimed={leases["b"]},
                           claimed_ids=set())
    assert s.known == [leases["a"]] and s.stale == ["L-unknown", leases["b"]]  # b was settled earlier in the batch
    assert s.trajectory_ids == ["a"] and not s.requeue
    assert [type(e) for e in s.effects] == [Forget] and s.effects[0].trajectory_id == "a"
    assert s.apply(dispatcher) == []
    assert leases["a"] not in dispatcher.leases and leases["b"] in dispatcher.leases


def test_a_nack_without_requeue_dead_letters_with_the_consumers_reason():
    engine, dispatcher, leases = ready("a")
    s = Settlement.prepare(C, settle("nack", [leases["a"]], reason="bad mask", requeue=False), dispatcher, engine,
                           wall=5.0, claimed=set(), claimed_ids=set())
    assert [(type(e), e.reason, e.at) for e in s.effects] == [(DeadLetter, "bad mask", 5.0)]
    assert engine.entries["a"].state == DEAD
    assert s.apply(dispatcher) == [] and not dispatcher.leases


def test_a_requeue_changes_nothing_durable_and_puts_the_trajectory_back_until_it_runs_out():
    engine, dispatcher, leases = ready("a", max_deliveries=1)
    s = Settlement.prepare(C, settle("nack", [leases["a"]], reason="later", requeue=True), dispatcher, engine,
                           wall=5.0, claimed=set(), claimed_ids=set())
    assert s.effects == [] and s.requeue
    assert s.apply(dispatcher) == ["a"]  # delivered once already, the most it may be: dead-letter it


def requeued(*tids: str) -> tuple[MergeEngine, Dispatcher, dict[str, str]]:
    """As `ready`, then C's connection is dropped (as when the broker restarts): its leases are stale and
    the trajectories queued again."""
    engine, dispatcher, leases = ready(*tids)
    dispatcher.drop_consumer(C)
    dispatcher.hello(C, "c", mono=1.0)
    return engine, dispatcher, leases


def test_an_ack_naming_its_trajectories_settles_stale_leases_by_id_and_takes_them_off_the_queue():
    engine, dispatcher, leases = requeued("a", "b", "c")
    message = settle("ack", [leases["a"], leases["b"]], trajectory_ids=["a", "b"])
    s = Settlement.prepare(C, message, dispatcher, engine, wall=5.0, claimed=set(), claimed_ids=set())
    assert s.known == [] and s.stale == [] and s.by_id == {leases["a"]: "a", leases["b"]: "b"}
    assert [(type(e), e.trajectory_id) for e in s.effects] == [(Forget, "a"), (Forget, "b")]
    s.apply(dispatcher)
    assert [u.trajectory_ids for u in dispatcher.queues.get("default", ())] == [("c",)] and dispatcher.queued_trajectories == 1
    assert s.accepted == [leases["a"], leases["b"]]


def test_settling_by_id_ends_the_lease_a_redelivery_took():
    engine, dispatcher, leases = requeued("a")
    dispatcher.credit(C, 1, "trajectory")
    [again] = dispatcher.deliveries(mono=2.0)
    s = Settlement.prepare(C, settle("ack", [leases["a"]], trajectory_ids=["a"]), dispatcher, engine, wall=5.0,
                           claimed=set(), claimed_ids=set())
    s.apply(dispatcher)
    assert again.lease not in dispatcher.leases and not dispatcher.queues
    later = Settlement.prepare(C, settle("ack", [again.lease], trajectory_ids=["a"]), dispatcher, engine, wall=6.0,
                               claimed=set(), claimed_ids=set())
    assert later.settled_before == [again.lease] and later.effects == []  # answered acked, nothing twice


def test_an_ack_of_both_leases_of_one_trajectory_forgets_it_once():
    engine, dispatcher, leases = requeued("a")
    dispatcher.credit(C, 1, "trajectory")
    [again] = dispatcher.deliveries(mono=2.0)
    message = settle("ack", [leases["a"], again.lease], trajectory_ids=["a", "a"])
    s = Settlement.prepare(C, message, dispatcher, engine, wall=5.0, claimed=set(), claimed_ids=set())
    assert [type(e) for e in s.effects] == [Forget] and sorted(s.accepted) == sorted([leases["a"], again.lease])


def test_settling_by_id_keeps_a_partly_settled_group_unit_whole_with_its_count():
    engine, dispatcher = MergeEngine(), Dispatcher(DispatchSettings(lease_timeout=10.0))
    for tid in ("g0", "g1", "g2"):
        engine.handle(turn_msg(tid, 0, group=("g", 3)), 1.0)
        engine.handle(end_msg(tid), 1.0)
    for unit in engine.queued_units:
        dispatcher.enqueue(unit)
    s = Settlement.prepare(C, settle("ack", ["L-old"], trajectory_ids=["g1"]), dispatcher, engine, wall=5.0,
                           claimed=set(), claimed_ids=set())
    s.apply(dispatcher)
    [unit] = dispatcher.queues["default"]
    assert unit.trajectory_ids == ("g0", "g2") and unit.group_left == 1


def test_an_ack_by_id_of_an_unknown_trajectory_or_a_nack_of_a_stale_lease_is_stale():
    engine, dispatcher, leases = requeued("a")
    ack = Settlement.prepare(C, settle("ack", ["L-x"], trajectory_ids=["nobody"]), dispatcher, engine, wall=5.0,
                             claimed=set(), claimed_ids=set())
    nack = Settlement.prepare(C, settle("nack", [leases["a"]], reason="bad", requeue=False), dispatcher, engine,
                              wall=5.0, claimed=set(), claimed_ids=set())
    assert ack.stale == ["L-x"] and nack.stale == [leases["a"]] and not ack.effects and not nack.effects
