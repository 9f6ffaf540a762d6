"""A checkpointing consumer's position (`consumer.position.TrainingPosition`),
sans-I/O: what its state holds, how a resume and seals go to brokers, and
the rules on steps."""
import json

import pytest

from rollstream.common.errors import InvalidInput, InvalidState
from rollstream.consumer.position import STATE_FORMAT, TrainedBatch, TrainingPosition


def trained(step, *tids, nbytes=0):
    return TrainedBatch(step, tids, tuple(range(len(tids))), (None,) * len(tids), nbytes)


def test_the_state_is_plain_data_with_the_batches_since_the_last_seal():
    position = TrainingPosition(world_size=4)
    for step, tids in ((1, "ab"), (2, "cd"), (3, "ef")):
        position.committed(trained(step, *tids))
    assert [kind for _, kind, _ in position.seal(2, 2)] == ["seal", "seal"]
    state = position.state_dict()
    assert json.loads(json.dumps(state)) == state  # nothing but lists, numbers and strings
    assert (state["format"], state["step"], state["world_size"], state["epoch"]) == (STATE_FORMAT, 3, 4, 0)
    assert state["batches"] == [{"step": 3, "trajectory_ids": ["e", "f"], "sample_indices": [0, 1],
                                 "group_ids": [None, None]}]


def test_a_sealed_batch_stays_in_the_state_until_its_acks_are_answered():
    position = TrainingPosition()
    position.committed(trained(1, "a", "b"))
    position.committed(trained(2, "c"))
    position.seal(2, 1, unconfirmed={"b"})
    assert [b["step"] for b in position.state_dict()["batches"]] == [1]  # a resume from a later state records it
    position.confirmed(set())
    assert position.state_dict()["batches"] == []


def test_a_resume_is_a_new_lineage_of_the_same_run_and_tells_each_new_session():
    first = TrainingPosition()
    first.committed(trained(1, "a", "b"))
    state = first.state_dict()
    again = TrainingPosition(resume=state)
    assert (again.run, again.parent, again.resumed_from, again.epoch) == (first.run, first.lineage, 1, 1)
    assert again.lineage != first.lineage
    assert again.on_welcome(0) == [("resume", {"step": 1, "keep": 2, "trained": [[1, 0, "a"], [1, 1, "b"]]})]
    assert again.waiting_for_resume(1)
    again.resumed(0, [[3, 0, "d"], [2, 1, "c2"], [2, 0, "c1"]])
    assert not again.waiting_for_resume(1)
    assert again.next_replay() == (2, ["c1", "c2"])  # by step, then position
    again.handed(2)
    assert again.next_replay() == (3, ["d"])  # the trainer holds step 2's
    with pytest.raises(InvalidInput, match="a replayed batch is committed at the step it was trained at: expected 2"):
        again.commit_step(5, 2)
    with pytest.raises(InvalidState, match=r"steps \[2, 3\] are still to be trained again first"):
        again.commit_step(None, None)
    again.committed(trained(again.commit_step(None, 2), "c1", "c2"))
    again.resumed(0, [[2, 0, "c1"], [2, 1, "c2"], [3, 0, "d"]])  # sent again after a reconnect: step 2 is done
    assert again.replayed_steps() == [3]
    assert again.on_welcome(0)[0][0] == "resume"  # until all of it is back and trained again
    again.committed(trained(3, "d"))
    assert again.on_welcome(0) == [] and again.commit_step(None, None) == 4


def test_steps_go_forward_and_only_a_committed_step_can_be_sealed():
    position = TrainingPosition()
    assert position.commit_step(None, None) == 1
    position.committed(trained(5, "a"))
    with pytest.raises(InvalidInput, match="commit steps go forward: expected a step after 5, got 5"):
        position.commit_step(5, None)
    with pytest.raises(InvalidInput, match="at most the last committed one \\(5\\), got 6"):
        position.seal(6, 1)
    position.seal(5, 1)
    assert position.unsealed == 1 and position.on_welcome(0) == [("seal", {"step": 5, "keep": 2})]
    position.sealed(0, 5)
    assert position.unsealed == 0


def test_bad_states_are_refused_naming_the_field():
    good = TrainingPosition().state_dict()
    with pytest.raises(InvalidInput, match="format must be"):
        TrainingPosition(resume={**good, "format": "other/1"})
    with pytest.raises(InvalidInput, match="step must be an integer, got '3'"):
        TrainingPosition(resume={**good, "step": "3"})
    with pytest.raises(InvalidInput, match="one trajectory id"):
        TrainingPosition(resume={**good, "batches": [{"step": 1, "trajectory_ids": ["a"], "sample_indices": []}]})
    with pytest.raises(InvalidInput, match="keep_checkpoints must be at least 1, got 0"):
        TrainingPosition(keep_checkpoints=0)


def test_trained_data_nearing_a_brokers_unsealed_budget_is_said_once():
    position = TrainingPosition()
    position.budget(0, 1000)
    position.budget(1, 400)
    position.committed(trained(1, "a", nbytes=150))
    assert position.nearing_budget() is None
    position.committed(trained(2, "b", nbytes=100))
    assert "250 bytes trained since the last seal (step 0)" in position.nearing_budget()
    position.committed(trained(3, "c", nbytes=100))
    assert position.nearing_budget() is None  # said once


def test_a_trainer_that_never_seals_does_not_grow_its_state_without_end(monkeypatch):
    import rollstream.consumer.position as module

    monkeypatch.setattr(module, "MAX_MANIFEST_BATCHES", 3)
    position = TrainingPosition()
    warnings = [position.committed(trained(step, f"t{step}", nbytes=10)) for step in range(1, 6)]
    assert warnings[:3] == [None] * 3 and "no longer lists those before step 2" in warnings[3] and warnings[4] is None
    assert [b["step"] for b in position.state_dict()["batches"]] == [3, 4, 5]
