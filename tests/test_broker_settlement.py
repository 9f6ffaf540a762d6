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
    for unit in engine.ready_units:
        dispatcher.enqueue(unit)
    dispatcher.hello(C, "c", mono=0.0)
    dispatcher.credit(C, len(tids), "trajectory")
    return engine, dispatcher, {d.trajectory_id: d.lease for d in dispatcher.deliveries(mono=0.0)}


def settle(kind: str, leases: list[str], **fields) -> Message:
    return Message(kind, {"leases": leases, **fields}, {})


def test_an_ack_settles_its_known_leases_once_and_calls_the_rest_stale():
    engine, dispatcher, leases = ready("a", "b")
    message = settle("ack", [leases["a"], "L-unknown", leases["a"], leases["b"]])
    s = Settlement.prepare(C, message, dispatcher, engine, wall=5.0, claimed={leases["b"]})
    assert s.known == [leases["a"]] and s.stale == ["L-unknown", leases["b"]]  # b was settled earlier in the batch
    assert s.trajectory_ids == ["a"] and not s.requeue
    assert [type(e) for e in s.effects] == [Forget] and s.effects[0].trajectory_id == "a"
    assert s.apply(dispatcher) == []
    assert leases["a"] not in dispatcher.leases and leases["b"] in dispatcher.leases


def test_a_nack_without_requeue_dead_letters_with_the_consumers_reason():
    engine, dispatcher, leases = ready("a")
    s = Settlement.prepare(C, settle("nack", [leases["a"]], reason="bad mask", requeue=False), dispatcher, engine,
                           wall=5.0, claimed=set())
    assert [(type(e), e.reason, e.at) for e in s.effects] == [(DeadLetter, "bad mask", 5.0)]
    assert engine.entries["a"].state == DEAD
    assert s.apply(dispatcher) == [] and not dispatcher.leases


def test_a_requeue_changes_nothing_durable_and_puts_the_trajectory_back_until_it_runs_out():
    engine, dispatcher, leases = ready("a", max_deliveries=1)
    s = Settlement.prepare(C, settle("nack", [leases["a"]], reason="later", requeue=True), dispatcher, engine,
                           wall=5.0, claimed=set())
    assert s.effects == [] and s.requeue
    assert s.apply(dispatcher) == ["a"]  # delivered once already, the most it may be: dead-letter it
