"""Lineage epochs: a resumed trainer starts a new epoch from its checkpoint's
step; versions are (epoch, step); what weights of the abandoned lineage
sampled (steps newer than the checkpoint, in an older epoch) is dropped
`abandoned` or kept by `abandoned_lineage`, counted either way; the
lineage survives a broker restart and producers are told which checkpoint
to serve. The rule on its own, then `BrokerCore` on a real store, then the
consumer's side (`TrainingPosition`, `Sessions`)."""
import pytest
from broker_helpers import end_msg, turn_msg
from test_broker_checkpoint import Node
from test_broker_staleness import produce, producer_says, publish

from rollstream.common.codec import Message
from rollstream.common.errors import InvalidInput
from rollstream.common.versions import Ancestry, Version, add_sampled, parse_version, version_label
from rollstream.consumer.assembly import Assembler
from rollstream.consumer.position import TrainingPosition
from rollstream.consumer.session import Sessions


@pytest.mark.parametrize("text, expected", [
    ("12", Version(None, 12)), ("step-12", Version(None, 12)), ("e1:12", Version(1, 12)),
    ("e3:step-7", Version(3, 7)), ("e12", Version(None, 12)), ("e1:", None), ("seed-x", None), ("", None),
])
def test_a_version_names_its_step_and_perhaps_its_epoch(text, expected):
    assert parse_version(text) == expected


def test_labels_name_the_epoch_once_there_is_one():
    assert (version_label(12), version_label(12, 0), version_label(12, 2)) == ("12", "12", "e2:12")


def test_an_abandoned_lineage_is_what_came_after_a_later_epoch_resumed():
    # epoch 1 resumed from step 10 of epoch 0, epoch 2 from step 12 of epoch 1
    ancestry = Ancestry.of([[1, 10], [2, 12]])
    assert (ancestry.epoch, ancestry.resumed_from) == (2, 12)
    assert (ancestry.cut(0), ancestry.cut(1), ancestry.cut(2)) == (10, 12, None)
    assert not ancestry.abandoned(((0, 10),))  # the checkpoint epoch 1 resumed from
    assert ancestry.abandoned(((0, 11),))  # epoch 0 went on past it: abandoned
    assert not ancestry.abandoned(((1, 12),)) and ancestry.abandoned(((1, 13),))
    assert not ancestry.abandoned(((2, 40),))  # the current epoch
    assert ancestry.abandoned(((0, 9), (1, 13)))  # any turn of it
    assert not Ancestry().abandoned(((0, 99),))  # no resume: nothing abandoned
    with pytest.raises(InvalidInput, match="lineage epochs rise from 1"):
        Ancestry.of([[2, 5], [2, 6]])
    with pytest.raises(InvalidInput, match=r"\[epoch, step\] branches"):
        Ancestry.of([[1]])


def test_sampled_keeps_the_newest_step_per_epoch_and_takes_unnamed_ones_as_the_epoch_given():
    versions = [Version(None, 4), Version(None, 6), Version(0, 9), Version(None, 5)]
    assert add_sampled(((0, 7),), versions, 1) == ((0, 9), (1, 6))


def test_what_the_abandoned_lineage_sampled_is_dropped_and_counted_and_the_rest_goes_out(tmp_path):
    node = Node(tmp_path / "data")
    node.hello(run=None)
    publish(node, 12)
    produce(node, ("old", "9"), ("ckpt", "step-10"), ("ahead", "12"))  # sampled in epoch 0
    assert publish(node, 10, branches=[[1, 10]])["version"] == 10  # a trainer resumed from step 10
    # after the resume: a version without an epoch is of epoch 1; one naming epoch 0 past 10 is abandoned
    produce(node, ("new", "11"), ("late", "e0:11"), ("named", "e1:12"))
    assert sorted(tid for tid, _ in node.take(10)) == ["ckpt", "named", "new", "old"]
    entries = node.core.engine.entries
    assert (entries["ahead"].dead_reason, entries["late"].dead_reason) == ("abandoned", "abandoned")
    assert node.core.metrics.totals["abandoned.dropped"] == 2
    assert node.core.status(node.clock)["counters"]["trajectories.abandoned"] == 2


def test_with_abandoned_lineage_keep_it_is_delivered_and_counted_kept(tmp_path):
    node = Node(tmp_path / "data", abandoned_lineage="keep")
    node.hello(run=None)
    produce(node, ("ahead", "12"), ("old", "9"))
    publish(node, 10, branches=[[1, 10]])
    assert sorted(tid for tid, _ in node.take(10)) == ["ahead", "old"]
    assert node.core.metrics.totals["abandoned.kept"] == 1


def test_the_lineage_and_what_sampled_an_ended_trajectory_survive_a_restart(tmp_path):
    node = Node(tmp_path / "data")
    produce(node, ("ahead", "12"), ("old", "9"))  # ended before the resume, each stored with what sampled it
    produce(node, ("open", "13"), open_only=True)
    node.restart()
    node.hello(run=None)
    publish(node, 10, branches=[[1, 10]])
    node.restart()
    assert node.core.freshness.ancestry("default") == Ancestry(((1, 10),))
    # "open" was given up; "old" (9) and "ahead" (12) are queued, 1 and 0 behind
    assert node.core.status(node.clock)["policies"]["default"] == {"version": 10, "untrained": 2, "epoch": 1,
                                                                   "resumed_from": 10, "staleness": [0, 1]}
    assert producer_says(node, "hello", producer_id="p", reads_branch=True)["branch"] == [1, 10]  # serve step 10's
    older = producer_says(node, "hello", producer_id="older")  # a producer before `reads_branch`: the older name
    assert older["lineage"] == [1, 10] and "branch" not in older
    node.producer_says(end_msg("open", seq=900))
    node.hello(run=None)
    assert [tid for tid, _ in node.take(10)] == ["old"]
    assert {tid: node.core.engine.entries[tid].dead_reason for tid in ("ahead", "open")} == {
        "ahead": "abandoned", "open": "abandoned"}


def test_branches_whose_epochs_do_not_rise_is_refused_naming_the_rule(tmp_path):
    node = Node(tmp_path / "data")
    node.hello(run=None)
    [refusal] = node.say("policy", version=3, branches=[[1, 2], [1, 3]])
    assert refusal.type == "nack" and refusal["code"] == "invalid_value"
    assert "lineage epochs rise from 1" in refusal["message"]


def test_a_replayed_batch_is_not_judged_abandoned(tmp_path):
    node = Node(tmp_path / "data")
    node.hello(lineage="L1")
    produce(node, ("a", "11"), ("b", "12"))
    node.train(11, node.take(2))  # trained at step 11 by lineage L1, never sealed
    node.hello(lineage="L2")
    publish(node, 10, branches=[[1, 10]])
    [resumed, *replayed] = node.say("resume", step=10, keep=2, trained=[])
    assert resumed.type == "resumed" and [m["trajectory_id"] for m in replayed] == ["a", "b"]


# -- the consumer's side -----------------------------------------------------
def _position(epoch=0, branches=(), step=10) -> TrainingPosition:
    state = TrainingPosition().state_dict()
    return TrainingPosition(resume={**state, "step": step, "epoch": epoch, "branches": [list(b) for b in branches]})


def test_a_resume_starts_an_epoch_above_the_saved_one_and_any_a_broker_has_seen():
    position = _position(epoch=1, branches=[(1, 4)])
    assert position.ancestry == Ancestry(((1, 4), (2, 10)))
    assert position.state_dict()["branches"] == [[1, 4], [2, 10]]
    # a broker that saw epoch 2 (an earlier resume from this same checkpoint that died): this one is 3
    assert position.resumed(0, [], epoch=2) is True
    assert position.ancestry == Ancestry(((1, 4), (3, 10)))
    assert position.resumed(1, [], epoch=1) is False
    assert position.resumed(0, [], epoch=3) is False  # a later answer may know this lineage's own epoch
    with pytest.raises(InvalidInput, match="resume state: branches"):
        _position(branches=[(0, 3)])


def test_sessions_publish_the_lineage_to_a_broker_only_once_it_answered_the_resume():
    position = _position()
    sessions = Sessions(Assembler(2, batch_size=1), ["a", "b"], consumer_id="c", hello_timeout=5.0, position=position)
    sessions.publish(10)
    for broker in (0, 1):
        sessions.received(broker, Message("welcome", {"broker_id": "x", "heartbeat_interval": 1.0,
                                                      "lease_timeout": 60.0}, {}), 0.0)
    policies = [(b, f) for b, kind, f in sessions.due(0.0, closing=False) if kind == "policy"]
    assert policies == []  # neither answered the resume: the epoch is not known yet
    sessions.received(1, Message("resumed", {"step": 10, "replay": [], "epoch": 1}, {}), 0.0)
    policies = [(b, f) for b, kind, f in sessions.due(0.0, closing=False) if kind == "policy"]
    assert policies == [(1, {"version": 10, "share": 0.5, "branches": [[2, 10]]})]


def test_an_unfinished_trajectory_of_the_abandoned_lineage_is_dropped_at_once_and_its_next_turn_told_so(tmp_path):
    node = Node(tmp_path / "data")
    node.hello(run=None)
    produce(node, ("running", "12"), ("fine", "10"), open_only=True)
    publish(node, 10, branches=[[1, 10]])
    assert node.core.engine.entries["running"].dead_reason == "abandoned"
    assert node.core.engine.untrained["default"] == 1  # its admission room is back
    [ack] = node.producer_says(turn_msg("running", 1, seq=40, weight_version="12"))
    assert (ack.type, ack["applied"], ack["reason"]) == ("ack", False, "abandoned")
    [ack] = node.producer_says(turn_msg("fine", 1, seq=41, weight_version="11"))
    assert (ack.type, ack["applied"]) == ("ack", True)


def test_with_abort_stale_an_open_trajectory_past_the_bound_is_given_up_and_its_producer_told(tmp_path):
    node = Node(tmp_path / "data", max_staleness=1, abort_stale=True)
    node.hello(run=None)
    publish(node, 3)
    produce(node, ("slow", "2"), ("quick", "3"), open_only=True)
    publish(node, 4)  # slow is 2 behind: it can no longer be trained within the bound
    assert [node.core.engine.entries[t].dead_reason for t in ("slow", "quick")] == ["stale", None]
    [ack] = node.producer_says(turn_msg("slow", 1, seq=40, weight_version="4"))
    assert (ack["applied"], ack["reason"]) == (False, "stale")


def test_without_abort_stale_an_open_trajectory_past_the_bound_runs_on_until_it_ends(tmp_path):
    node = Node(tmp_path / "data", max_staleness=1)
    node.hello(run=None)
    publish(node, 3)
    produce(node, ("slow", "2"), open_only=True)
    publish(node, 4)
    [ack] = node.producer_says(turn_msg("slow", 1, seq=40, weight_version="4"))
    assert ack["applied"] is True


def test_a_resumed_consumer_grants_a_broker_credit_only_after_its_policy_reached_it():
    position = _position()
    sessions = Sessions(Assembler(1, batch_size=1), ["a"], consumer_id="c", hello_timeout=5.0, position=position)
    sessions.publish(10)
    sessions.received(0, Message("welcome", {"broker_id": "x", "heartbeat_interval": 1.0, "lease_timeout": 60.0}, {}),
                      0.0)
    assert [kind for _, kind, _ in sessions.due(0.0, closing=False)] == ["resume"]  # no credit: nothing new yet
    sessions.received(0, Message("resumed", {"step": 10, "replay": [], "epoch": 0}, {}), 0.0)
    # the policy with the lineage first, then credit: the broker judges new data by the resumed lineage
    assert [kind for _, kind, _ in sessions.due(0.1, closing=False)] == ["policy", "credit"]
