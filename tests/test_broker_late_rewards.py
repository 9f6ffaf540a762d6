"""Rewards that come later: an `end` without a reward leaves the
trajectory `scoring` (ended, not deliverable, nor its group), a `reward`
message makes it ready, and one that never comes expires after the TTL as
`reward_expired`, counted. Ended members of a group not complete yet are
counted `awaiting_group`, and the checker reads both as still to deliver.
`BrokerCore` on a real store (a restart keeps a scoring trajectory
waiting), with raw producer and consumer messages."""
from broker_helpers import end_msg, reward_msg, turn_msg
from test_broker_checkpoint import Node

from rollstream.common.checker import broker_backlog, check
from rollstream.common.codec import decode, encode
from rollstream.common.messages import ADMIN_REPLIES

P = b"producer"


def send(node: Node, *messages) -> list[tuple]:
    """Producer messages in one batch; each answer as (type, outcome or code)."""
    sent = node.producer_says(*messages)
    return [(m.type, "duplicate" if m.get("duplicate") else m["applied"]) if m.type == "ack" else (m.type, m["code"])
            for m in sent]



def delivered(node: Node) -> dict:
    """Every delivery the consumer's credit brings: trajectory id -> reward."""
    return {m["trajectory_id"]: m["reward"] for m in node.say("credit", n=10, unit="trajectory") if m.type == "deliver"}


def test_a_trajectory_ended_without_its_reward_waits_for_it_and_is_delivered_with_it(tmp_path):
    node = Node(tmp_path / "data")
    node.hello(run=None)
    assert send(node, turn_msg("t", 0, seq=1), end_msg("t", reward=None, seq=2)) == [("ack", True), ("ack", True)]
    assert node.core.status(node.clock)["scoring"] == 1 and delivered(node) == {}
    assert send(node, turn_msg("t", 1, seq=3)) == [("ack", False)]  # ended: no more turns (after_terminal)
    assert send(node, reward_msg("t", {"score": 0.75}, seq=4)) == [("ack", True)]
    assert send(node, reward_msg("t", {"score": 0.75}, seq=5)) == [("ack", "duplicate")]
    assert send(node, reward_msg("t", 0.1, seq=6)) == [("nack", "conflict")]
    status = node.core.status(node.clock)
    assert (status["scoring"], status["queued"]) == (0, 1)
    assert delivered(node) == {"t": {"score": 0.75}}


def test_a_reward_before_its_end_or_for_an_unknown_trajectory_is_refused(tmp_path):
    node = Node(tmp_path / "data")
    assert send(node, turn_msg("t", 0, seq=1), reward_msg("t", 1.0, seq=2)) == [("ack", True), ("nack", "out_of_order")]
    assert send(node, reward_msg("nobody", 1.0, seq=3)) == [("nack", "unknown_trajectory")]


def test_a_group_waits_for_every_members_reward_and_is_filtered_on_them(tmp_path):
    node = Node(tmp_path / "data", group_filters="all_equal_rewards")
    node.hello(run=None)
    for g in ("same", "differ"):
        send(node, *(m for i in range(2) for m in (turn_msg(f"{g}{i}", 0, seq=10 * i, group=(g, 2)),
                                                   end_msg(f"{g}{i}", reward=None, seq=10 * i + 1))))
    send(node, reward_msg("same0", 1.0, seq=50), reward_msg("differ0", 1.0, seq=51))
    assert delivered(node) == {}  # each group still waits for a reward
    node.restart()  # scoring survives a restart
    node.hello(run=None)
    assert node.core.status(node.clock)["scoring"] == 2
    send(node, reward_msg("same1", 1.0, seq=52), reward_msg("differ1", 0.0, seq=53))
    assert delivered(node) == {"differ0": 1.0, "differ1": 0.0}
    assert {item["reason"] for item in node.core.engine.dead_letters(10)} == {"filtered:all_equal_rewards"}


def test_a_reward_that_never_comes_expires_after_the_ttl_and_its_group_goes_on(tmp_path):
    node = Node(tmp_path / "data", trajectory_ttl=30.0)
    node.hello(run=None)
    send(node, turn_msg("a", 0, seq=1, group=("g", 2)), end_msg("a", reward=0.5, seq=2),
         turn_msg("b", 0, seq=3, group=("g", 2)), end_msg("b", reward=None, seq=4))
    node.now += 31.0
    node.housekeep()
    status = node.core.status(node.clock)
    assert (status["scoring"], status["dead"], status["counters"]["trajectories.reward_expired"]) == (0, 1, 1)
    assert node.core.engine.entries["b"].dead_reason == "reward_expired"
    node.hello(run=None)
    assert delivered(node) == {"a": 0.5}  # the group goes on with the member that has its reward
    assert send(node, reward_msg("b", 1.0, seq=5)) == [("ack", False)]  # too late: not applied, and it says why
    assert node.core.engine.handle(reward_msg("b", 1.0, seq=6), node.clock.wall).fields["reason"] == "reward_expired"


def test_after_a_restart_a_group_of_members_still_scoring_waits_for_all_of_them(tmp_path):
    node = Node(tmp_path / "data")
    send(node, *(m for i in range(2) for m in (turn_msg(f"g{i}", 0, seq=10 * i, group=("g", 2)),
                                               end_msg(f"g{i}", reward=None, seq=10 * i + 1))))
    node.restart()
    node.hello(run=None)
    send(node, reward_msg("g0", 1.0, seq=50))
    assert delivered(node) == {}
    send(node, reward_msg("g1", 0.0, seq=51))
    assert delivered(node) == {"g0": 1.0, "g1": 0.0}


def wire_status(node: Node) -> dict:
    """The status as an admin client reads it: through the reply's schema."""
    return decode(encode(ADMIN_REPLIES, "status", node.core.status(node.clock)), ADMIN_REPLIES).fields


def test_ended_members_of_an_incomplete_group_are_counted_awaiting_it_and_not_lost(tmp_path):
    """Neither ready nor leased, but durable and still to deliver: the
    status counts them, across a restart, and the checker's backlog from
    that status makes an acked one unseen rather than lost."""
    node = Node(tmp_path / "data")
    node.hello(run=None)
    send(node, turn_msg("a", 0, seq=1, group=("g", 3)), end_msg("a", reward=1.0, seq=2),
         turn_msg("b", 0, seq=3, group=("g", 3)), end_msg("b", reward=None, seq=4),
         turn_msg("c", 0, seq=5, group=("g", 3)))
    status = wire_status(node)
    assert (status["awaiting_group"], status["scoring"], status["open"], status["queued"], status["leased"]) == \
        (1, 1, 1, 0, 0)
    acked = [{"kind": "acked", "id": "a", "applied": True}]
    assert check(acked, broker_backlog=broker_backlog(status)).unseen == ["a"]
    assert check(acked, broker_backlog=status["queued"] + status["leased"]).lost == ["a"]  # what the demo read
    node.restart()
    node.hello(run=None)
    assert wire_status(node)["awaiting_group"] == 1
    send(node, end_msg("c", reward=0.0, seq=6))
    assert wire_status(node)["awaiting_group"] == 2  # a and c; b still scoring
    send(node, reward_msg("b", 0.5, seq=7))
    status = wire_status(node)
    assert (status["awaiting_group"], status["scoring"], status["queued"]) == (0, 0, 3)
    assert delivered(node) == {"a": 1.0, "b": 0.5, "c": 0.0}
