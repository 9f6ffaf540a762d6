"""Group filters (`rollstream.broker.filters`): a complete group without a
learning signal is dead-lettered `filtered:<name>` before it takes a batch
slot, counted per filter, and its room returns; the rest are delivered as
before. The rules by hand, then `BrokerCore` on a real store."""
import pytest
from broker_helpers import end_msg, turn_msg
from test_broker_checkpoint import Node

from rollstream.broker.filters import GroupFilter, parse_filters, scalar_reward
from rollstream.broker.settings import BrokerSettings, broker_problems
from rollstream.common.errors import InvalidInput

P = b"producer"


def test_filters_are_read_as_written_and_bad_ones_name_the_rule():
    assert parse_filters("all_equal_rewards, reward_std_below:0.05,min_members:3") == (
        GroupFilter("all_equal_rewards", 1e-6), GroupFilter("reward_std_below", 0.05), GroupFilter("min_members", 3.0))
    assert parse_filters("") == () and parse_filters("all_equal_rewards:0.1") == (GroupFilter("all_equal_rewards", 0.1),)
    for text, says in (("dapo", "a group filter is one of ('all_equal_rewards', 'reward_std_below', 'min_members')"),
                       ("min_members", "min_members needs a threshold"),
                       ("reward_std_below:x", "threshold is a number, got 'reward_std_below:x'"),
                       ("min_members:-1", "finite number >= 0")):
        with pytest.raises(InvalidInput, match=says.replace("(", r"\(").replace(")", r"\)")):
            parse_filters(text)
    [problem] = broker_problems(BrokerSettings(group_filters="all_equal"))
    assert problem.key == "group_filters" and "got 'all_equal'" in problem.actual


@pytest.mark.parametrize("rule, rewards, dropped", [
    ("all_equal_rewards", [1.0, 1.0, 1.0], True),
    ("all_equal_rewards", [1.0, 1.0, 0.0], False),
    ("all_equal_rewards:0.1", [1.0, 1.05, 0.95], True),
    ("reward_std_below:0.1", [0.0, 0.0, 0.1], True),  # std 0.047
    ("reward_std_below:0.1", [0.0, 1.0], False),  # std 0.5
    ("min_members:3", [1.0, 0.0], True),
    ("min_members:3", [1.0, 0.0, 1.0], False),
    ("all_equal_rewards", [1.0, None], False),  # a reward it cannot read: kept
])
def test_each_filter_drops_what_its_rule_says(rule, rewards, dropped):
    (group_filter,) = parse_filters(rule)
    assert group_filter.drops(rewards) is dropped


def test_a_map_reward_is_compared_by_its_key():
    assert scalar_reward({"score": 0.5, "len": 3}, "score") == 0.5
    assert scalar_reward({"score": 0.5}, None) is None and scalar_reward(True, None) is None
    assert scalar_reward(2, None) == 2.0


def group(node: Node, gid: str, rewards: list, seq: int = 0) -> None:
    messages = []
    for i, reward in enumerate(rewards):
        tid = f"{gid}-{i}"
        messages += [turn_msg(tid, 0, seq=seq + 2 * i, group=(gid, len(rewards))),
                     end_msg(tid, seq=seq + 2 * i + 1, reward=reward)]
    node.run(node.core.producer_read([(P, m, None) for m in messages], node.clock))


def test_a_group_with_equal_rewards_is_dead_lettered_filtered_and_the_others_are_delivered(tmp_path):
    node = Node(tmp_path / "data", group_filters="min_members:2,all_equal_rewards", filter_reward_key="score")
    group(node, "flat", [1.0, 1.0, 1.0])
    group(node, "signal", [{"score": 1.0}, {"score": 0.0}])
    group(node, "alone", [0.5])
    status = node.core.status(node.clock)
    assert status["dead"] == 4 and status["queued"] == 2 and status["open"] == 0
    counters = status["counters"]
    assert counters["trajectories.filtered"] == 4
    assert (counters["filtered.all_equal_rewards"], counters["filtered.min_members"]) == (3, 1)
    assert {item["reason"] for item in node.core.engine.dead_letters(10)} == {"filtered:all_equal_rewards",
                                                                                "filtered:min_members"}
    node.hello(run=None)
    assert sorted(tid for tid, _ in node.take(5)) == ["signal-0", "signal-1"]
    node.restart()  # the verdict is durable: nothing filtered comes back
    status = node.core.status(node.clock)
    assert (status["dead"], status["queued"], status["open"]) == (4, 2, 0)


def test_without_filters_a_flat_group_is_delivered(tmp_path):
    node = Node(tmp_path / "data")
    group(node, "flat", [1.0, 1.0])
    node.hello(run=None)
    assert sorted(tid for tid, _ in node.take(5)) == ["flat-0", "flat-1"]


def test_dead_letters_are_kept_within_their_budget_oldest_deleted_first_their_ids_remembered(tmp_path):
    from test_broker_checkpoint import Node

    from rollstream.broker.engine import DEAD

    node = Node(tmp_path / "data")
    node.produce("a", "b")
    node.hello(run=None)
    for (tid, lease), now in zip(node.take(2), (20.0, 30.0)):
        node.now = now
        node.say("nack", leases=[lease], reason="bad", requeue=False)  # dead-lettered "bad", a before b
    assert [node.core.engine.entries[t].state for t in ("a", "b")] == [DEAD, DEAD]
    held = node.core.engine.dead_bytes
    assert held > 1
    node.settings["max_dead_letter_bytes"] = held - 1  # one of the two fits
    node.restart()
    node.housekeep()
    assert "a" not in node.core.engine.entries and node.core.engine.entries["b"].state == DEAD  # the oldest went
    assert "a" in node.core.engine.dedup  # a resend of it is answered as a duplicate, never merged again
    assert node.core.metrics.totals["dead_letters_pruned.bad"] == 1
    node.restart()  # deleted from the store too
    engine = node.core.engine
    assert "a" not in engine.entries and engine.dead_bytes == engine.entries["b"].stored_bytes < held
    # still accounted for (the checker's "dead-lettered", not "lost") while its id is remembered
    listed = [(item["trajectory_id"], item["reason"], item.get("pruned")) for item in engine.dead_letters(10, pruned=True)]
    assert listed == [("a", "bad", True), ("b", "bad", None)]
    assert [item["trajectory_id"] for item in engine.dead_letters(10)] == ["b"]
