"""One staleness bound kept by the broker (`rollstream.broker.staleness`):
a trainer publishes its policy version, new trajectories wait at admission
while the job holds what the trainer can train within the bound, queued
units go out oldest version first, and a unit that fell behind the bound
is dead-lettered `stale` instead of delivered. `BrokerCore` on a real store
(the published version survives a restart), with raw consumer messages."""
import pytest
from broker_helpers import end_msg, turn_msg
from test_broker_checkpoint import Node

from rollstream.broker.staleness import Freshness, Policy
from rollstream.common.codec import decode
from rollstream.common.errors import InvalidInput

P = b"producer"


def produce(node: Node, *items, open_only=False) -> list:
    """Trajectories `(id, weight_version)`, each one turn and (unless `open_only`) its end; the producer's
    answers as (type, trajectory id or code, message)."""
    messages = []
    for seq, (tid, version) in enumerate(items):
        messages.append(turn_msg(tid, 0, seq=2 * seq, **({} if version is None else {"weight_version": version})))
        if not open_only:
            messages.append(end_msg(tid, seq=2 * seq + 1))
    return [(m.type, m["trajectory_id"] if m.type == "ack" else m["code"], m.get("message", ""))
            for m in node.producer_says(*messages)]


def publish(node: Node, version: int, **fields) -> dict:
    """The trainer's `policy` message; the broker's echo."""
    [echo, *_] = node.say("policy", version=version, **fields)
    assert echo.type == "policy", echo.fields
    return echo.fields


def test_the_bound_capacity_and_stale_line_as_the_rule_states_them():
    freshness = Freshness(max_staleness=2)
    assert freshness.bound("default") == 2 and freshness.stale_below("default") is None  # no version yet
    freshness.publish("default", Policy(10, max_staleness=1, per_step=8, share=0.5))
    assert freshness.bound("default") == 1  # the trainer lowers the broker's bound
    assert freshness.stale_below("default") == 9  # version 9 is 1 behind 10: fresh; 8 is stale
    assert freshness.capacity("default") == 8  # (1 + 1) x 8 per step x 0.5
    assert freshness.admits_new("default", 7) and not freshness.admits_new("default", 8)
    freshness.publish("default", Policy(10, max_staleness=5))
    assert freshness.bound("default") == 2  # never raised above the broker's
    assert Freshness().capacity("default") is None and Freshness().admits_new("default", 10**9)
    with pytest.raises(InvalidInput, match="max_staleness must be at least 0"):
        Freshness(max_staleness=-1)
    with pytest.raises(InvalidInput, match="dispatch_order must be one of"):
        Freshness(order="newest")


def test_queued_units_behind_the_bound_are_dead_lettered_stale_and_the_rest_go_oldest_first(tmp_path):
    node = Node(tmp_path / "data")
    produce(node, ("none", None))  # admitted before the bound was set
    node.settings["max_staleness"] = 1
    node.restart()
    produce(node, ("v5", "step-5"), ("v2", "step-2"), ("v4", "4"))
    node.hello(run=None)
    assert publish(node, 5) == {"version": 5, "max_staleness": 1, "held": 4, "waiting": 0}  # v2 still held
    status = node.core.status(node.clock)
    assert status["dead"] == 1 and status["counters"]["trajectories.stale"] == 1
    assert node.core.engine.entries["v2"].dead_reason == "stale"
    assert status["policies"] == {"default": {"version": 5, "max_staleness": 1, "untrained": 3, "staleness": [0, 1]}}
    # oldest version first; one without an ordered version (admitted before the bound) counts as oldest, never stale
    assert [tid for tid, _ in node.take(3)] == ["none", "v4", "v5"]


def test_freshest_first_hands_the_newest_version_out_first(tmp_path):
    node = Node(tmp_path / "data", dispatch_order="freshest_first")
    produce(node, ("a", "3"), ("b", "5"), ("c", "4"), ("d", "5"))
    node.hello(run=None)
    assert [tid for tid, _ in node.take(4)] == ["b", "d", "c", "a"]


def test_a_unit_that_falls_behind_while_queued_is_dropped_at_the_next_publication(tmp_path):
    node = Node(tmp_path / "data", max_staleness=2)
    node.hello(run=None)
    publish(node, 3)
    produce(node, ("a", "1"), ("b", "3"))
    assert node.core.status(node.clock)["counters"].get("trajectories.stale", 0) == 0  # 3 - 1 = 2: within
    publish(node, 4)  # now a is 3 behind
    assert node.core.engine.entries["a"].dead_reason == "stale"
    assert [tid for tid, _ in node.take(5)] == ["b"]


def test_new_trajectories_wait_while_the_job_holds_its_capacity_and_enter_once_one_is_trained(tmp_path):
    node = Node(tmp_path / "data", max_staleness=0)
    node.hello(run=None)
    publish(node, 7, per_step=2)  # capacity (0 + 1) x 2 = 2 untrained
    assert produce(node, ("a", "7"), ("b", "7"), open_only=True) == [("ack", "a", ""), ("ack", "b", "")]
    [refused] = produce(node, ("c", "7"), open_only=True)
    assert refused[:2] == ("nack", "unavailable")
    assert "2 trajectories admitted and not yet trained, capacity (max_staleness 0 + 1) x 2 per step" in refused[2]
    assert node.core.metrics.totals["admission_waits"] == 1
    # what is already admitted goes on: a second turn and the ends of open trajectories enter
    more = produce_turn(node, "a", 1, "7") + produce(node, ("a", None), ("b", None), open_only=False)[1::2]
    assert [kind for kind, *_ in more] == ["ack", "ack", "ack"]
    [(tid, lease)] = node.take(1)
    node.say("ack", leases=[lease])  # trained: room for one
    assert produce(node, ("c", "7"), open_only=True) == [("ack", "c", "")]
    assert node.core.status(node.clock)["policies"]["default"]["capacity"] == 2


def produce_turn(node, tid, index, version):
    sent = node.producer_says(turn_msg(tid, index, seq=50 + index, weight_version=version))
    return [(m.type, m.get("trajectory_id", m.get("code")), "") for m in sent]


def test_under_a_bound_a_turn_without_an_ordered_version_is_refused_naming_the_rule(tmp_path):
    node = Node(tmp_path / "data", max_staleness=3)
    [(kind, code, message)] = produce(node, ("a", "checkpoint-final-b"), open_only=True)
    assert (kind, code) == ("nack", "invalid_value")
    assert "an ordered weight_version is an integer, or text ending in one" in message
    assert "max_staleness 3 is on" in message and "got 'checkpoint-final-b'" in message
    [(kind, code, message)] = produce(node, ("b", None), open_only=True)
    assert (kind, code) == ("nack", "invalid_value") and "got None" in message
    assert produce(Node(tmp_path / "free"), ("a", "checkpoint-final-b"), open_only=True)[0][:2] == ("ack", "a")


def test_the_published_version_and_bound_survive_a_restart(tmp_path):
    node = Node(tmp_path / "data", max_staleness=4)
    node.hello(run=None)
    publish(node, 9, max_staleness=2, per_step=16, share=0.25)
    node.restart()
    assert node.core.freshness.policies == {"default": Policy(9, 2, 16, 0.25)}
    assert node.core.freshness.capacity("default") == 12  # (2 + 1) x 16 x 0.25
    produce(node, ("old", "6"), ("ok", "7"))
    node.hello(run=None)
    assert [tid for tid, _ in node.take(5)] == ["ok"]  # 9 - 6 = 3 > 2: dropped before delivery
    assert node.core.engine.entries["old"].dead_reason == "stale"


def producer_says(node: Node, kind: str, **fields) -> dict:
    from rollstream.common.codec import encode
    from rollstream.common.messages import PRODUCER_TO_BROKER

    [reply] = node.producer_says(decode(encode(PRODUCER_TO_BROKER, kind, fields), PRODUCER_TO_BROKER))
    return reply.fields


def test_producers_are_told_how_many_new_trajectories_the_job_has_room_for(tmp_path):
    node = Node(tmp_path / "data", max_staleness=1)
    assert "admit" not in producer_says(node, "hello", producer_id="p")  # no capacity before a step size is known
    node.hello(run=None)
    publish(node, 3, per_step=2)  # capacity (1 + 1) x 2 = 4
    assert producer_says(node, "ping", seq=1)["admit"] == 4
    produce(node, ("a", "3"), ("b", "3"), ("c", "3"), open_only=True)
    assert producer_says(node, "ping", seq=2)["admit"] == 1
    assert producer_says(node, "hello", producer_id="q")["admit"] == 1


def test_the_echo_says_what_the_job_holds_and_how_many_opens_waited_since_the_last_publication(tmp_path):
    node = Node(tmp_path / "data", max_staleness=0)
    node.hello(run=None)
    publish(node, 7, per_step=2)
    produce(node, ("a", "7"), ("b", "7"), open_only=True)
    produce(node, ("c", "7"), open_only=True)  # told to wait, twice (its producer resends)
    produce(node, ("c", "7"), open_only=True)
    echo = publish(node, 7, per_step=2)
    assert (echo["held"], echo["waiting"]) == (2, 2)
    assert publish(node, 7, per_step=2)["waiting"] == 0  # counted since the last publication
