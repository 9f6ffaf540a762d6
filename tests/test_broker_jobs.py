"""Jobs kept apart on one broker (`rollstream.common.jobs`), driven through
the broker's core without sockets: the same trajectory and group ids in two
jobs are two trajectories, each handed only to its own job's consumers,
settled and resumed in its own job, and named with its job to an operator."""
from broker_helpers import drive, end_msg, turn_msg

from rollstream.broker.core import BrokerCore, Send
from rollstream.broker.metrics import BrokerMetrics
from rollstream.broker.recovery import Rebuilt
from rollstream.broker.settings import BrokerSettings
from rollstream.common.clock import Clock
from rollstream.common.codec import decode, encode
from rollstream.common.messages import (
    ADMIN_REPLIES,
    ADMIN_REQUESTS,
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    CONSUMER_TO_BROKER,
)

P, A, B = b"producer", b"consumer-default", b"consumer-eval"


def core() -> BrokerCore:
    broker = BrokerCore(BrokerSettings(), "b-1", BrokerMetrics(), disk_reserve=0)
    broker.restore(Rebuilt([], (), {}, {}, {}), 0, 1 << 40)
    return broker


def at(t: float) -> Clock:
    return Clock(t, 1000.0 + t)


def produce(broker: BrokerCore, messages, t: float = 0.0) -> list:
    """The producer's messages as the service hands them in (ids keyed by job); the replies, decoded."""
    for _ in messages:
        broker.frame_arrived(P, 100, t)
    asked = drive(broker.producer_read([(P, BrokerCore.keyed(m), None) for m in messages], at(t)))
    replies = [decode(r.frames, BROKER_TO_PRODUCER) for r in asked if isinstance(r, Send)]
    return [(a["trajectory_id"], a["applied"]) for r in replies for a in ([r.fields] if r.type == "ack" else r["acks"])]


def consume(broker: BrokerCore, identity: bytes, messages: list[tuple[str, dict]], t: float = 1.0, **answers) -> list:
    received = [(identity, decode(encode(CONSUMER_TO_BROKER, kind, fields), CONSUMER_TO_BROKER), None)
                for kind, fields in messages]
    asked = drive(broker.consumer_read(received, at(t)), **answers)
    asked += drive(broker.deliver(at(t)), **answers)
    return [decode(r.frames, BROKER_TO_CONSUMER) for r in asked if isinstance(r, Send) and r.identity == identity]


def a_group_in(job):
    return [turn_msg("t0", 0, group=("g", 2), job=job, seq=1), end_msg("t0", seq=2, job=job),
            turn_msg("t1", 0, group=("g", 2), job=job, seq=3), end_msg("t1", seq=4, job=job)]


def test_the_same_ids_in_two_jobs_are_two_groups_each_handed_to_its_own_job_only():
    broker = core()
    assert produce(broker, a_group_in(None)) == [("t0", True), ("t0", True), ("t1", True), ("t1", True)]
    assert produce(broker, a_group_in("eval")) == [("t0", True), ("t0", True), ("t1", True), ("t1", True)]
    status = broker.status(at(1.0))
    assert status["queued"] == 4 and status["queued_by_job"] == {"default": 2, "eval": 2}
    # their older names, kept beside them for one version so that an older `rollstream status` or `top` reads them
    assert (status["ready"], status["ready_by_job"]) == (status["queued"], status["queued_by_job"])
    hello = {"consumer_id": "c", "packed_arrays": True}
    [welcome_a] = consume(broker, A, [("hello", hello)])
    assert "job" not in welcome_a.fields
    [welcome_b] = consume(broker, B, [("hello", {**hello, "consumer_id": "e", "job": "eval"})])
    assert welcome_b["job"] == "eval"  # the broker says it keeps jobs apart
    eval_deliveries = consume(broker, B, [("credit", {"n": 10, "unit": "trajectory"})])
    assert [(d["trajectory_id"], d["group_id"], d["group_size"]) for d in eval_deliveries] == [("t0", "g", 2), ("t1", "g", 2)]
    assert broker.status(at(1.0))["queued_by_job"] == {"default": 2}  # the default job's group is still waiting
    default_deliveries = consume(broker, A, [("credit", {"n": 10, "unit": "trajectory"})])
    assert [d["trajectory_id"] for d in default_deliveries] == ["t0", "t1"]
    assert not broker.dispatcher.queues


def test_a_settlement_by_id_and_a_resume_touch_their_own_job_only():
    broker = core()
    produce(broker, a_group_in(None))
    produce(broker, a_group_in("eval"))
    stored = {key: entry.trajectory for key, entry in broker.engine.entries.items()}  # what a store would read back
    consume(broker, A, [("hello", {"consumer_id": "c"}), ("credit", {"n": 10, "unit": "trajectory"})])
    eval_deliveries = consume(broker, B, [("hello", {"consumer_id": "e", "job": "eval", "run": "r", "lineage": "l"}),
                                          ("credit", {"n": 10, "unit": "trajectory"})])
    leases = {d["trajectory_id"]: d["lease"] for d in eval_deliveries if d.type == "deliver"}
    held_by_a = set(broker.dispatcher.consumers[A].leases)
    # eval trains t0 at step 1, naming it by id: the default job's t0 (leased to A) is not touched
    consume(broker, B, [("ack", {"leases": [leases["t0"]], "trajectory_ids": ["t0"], "step": 1, "positions": [0]})])
    assert broker.dispatcher.consumers[A].leases == held_by_a
    assert broker.engine.entries["t0"].trained is None and broker.engine.entries["eval\x1ft0"].trained is not None
    # a resume from step 0 of eval's run hands back eval's t0, by its own id
    consume(broker, B, [("hello", {"consumer_id": "e", "job": "eval", "run": "r", "lineage": "l2"})])
    replies = consume(broker, B, [("resume", {"step": 0, "keep": 2, "trained": []})],
                      ReadBack=lambda request: stored[request.trajectory_id])
    resumed = next(r for r in replies if r.type == "resumed")
    assert resumed["replay"] == [[1, 0, "t0"]]
    assert [(r["trajectory_id"], r.get("replay")) for r in replies if r.type == "deliver"] == [("t0", True)]


def test_a_dead_letter_is_listed_with_its_job_and_requeued_in_it():
    broker = core()
    produce(broker, a_group_in("eval"))
    produce(broker, a_group_in(None))
    deliveries = consume(broker, B, [("hello", {"consumer_id": "e", "job": "eval"}),
                                     ("credit", {"n": 10, "unit": "trajectory"})])
    t1 = next(d for d in deliveries if d.type == "deliver" and d["trajectory_id"] == "t1")
    consume(broker, B, [("nack", {"leases": [t1["lease"]], "reason": "invalid", "requeue": False})])

    def admin(kind, fields):
        request = decode(encode(ADMIN_REQUESTS, kind, fields), ADMIN_REQUESTS)
        [reply] = [r for r in drive(broker.admin_request(b"op", [b""], request, None, at(2.0))) if isinstance(r, Send)]
        return decode(reply.frames[1:], ADMIN_REPLIES)

    items = admin("dead_letters", {})["items"]
    assert [(item["trajectory_id"], item["job"]) for item in items] == [("t1", "eval")]
    assert admin("requeue", {"trajectory_ids": ["t1"]})["trajectory_ids"] == []  # the default job's t1 is not dead
    assert admin("requeue", {"trajectory_ids": ["t1"], "job": "eval"})["trajectory_ids"] == ["t1"]
    assert broker.status(at(3.0))["queued_by_job"] == {"default": 2, "eval": 1}
