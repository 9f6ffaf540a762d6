"""The merge engine on its own (no sockets, files or clocks): every ordering,
idempotence, merge, group, TTL and dedup rule of docs/protocol.md §3 and
docs/semantics.md §3-§5."""
import pytest
from broker_helpers import abort_msg, end_msg, reward_msg, turn_msg
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.broker import engine as engine_module
from rollstream.broker.core import BrokerCore
from rollstream.broker.engine import (
    DEAD,
    ENDED,
    CloseGroup,
    DeadLetter,
    DeliveryUnit,
    DropTrajectory,
    EndTrajectory,
    EngineSettings,
    Forget,
    GroupDeliverable,
    MergeEngine,
    OpenTrajectory,
    Producer,
    PutTurn,
    Revive,
)
from rollstream.common import SamplingMask
from rollstream.common.jobs import DEFAULT_JOB


@pytest.fixture
def engine():
    return MergeEngine(EngineSettings(trajectory_ttl=100.0, dedup_window=1000.0))


def ack(reply):
    assert reply.error is None, reply.error
    return reply.fields


def refused(reply):
    assert reply.error is not None and reply.fields is None
    return reply.error


def test_turns_in_order_are_applied_and_persisted(engine):
    r0 = engine.handle(turn_msg("t", 0, [10], [[10, 4]], forced=[20, 21]), wall=1)
    assert ack(r0) == {"seq": 0, "trajectory_id": "t", "turn": 0, "applied": True}
    assert [type(e) for e in r0.effects] == [OpenTrajectory, PutTurn]
    r1 = engine.handle(turn_msg("t", 1, [30], [[30, 7, 8]]), wall=2)
    assert ack(r1)["applied"] and isinstance(r1.effects[0], PutTurn) and r1.effects[0].message is not None
    traj = engine.entries["t"].trajectory
    # docs/semantics.md §8 example 6 through the engine
    assert traj.mask.ids.tolist() == [10, 4, 20, 21, 30, 7, 8] and traj.mask.offsets.tolist() == [0, 2, 3, 4, 7]
    assert traj.loss_mask.tolist() == [1, 0, 0, 1]


def test_identical_resend_is_a_duplicate_repeating_the_outcome(engine):
    engine.handle(turn_msg("t", 0, [10], [[10]]), wall=1)
    reply = engine.handle(turn_msg("t", 0, [10], [[10]], seq=9), wall=2)
    assert ack(reply) == {"seq": 9, "trajectory_id": "t", "turn": 0, "applied": True, "duplicate": True}
    assert reply.effects == () and engine.entries["t"].trajectory.response_length == 1


def test_an_end_that_counts_a_turn_the_broker_never_saw_is_out_of_order_and_changes_nothing(engine):
    engine.handle(turn_msg("t", 0, [10], [[10]]), wall=1)
    engine.handle(turn_msg("t", 1, [11], [[11]]), wall=2)
    error = refused(engine.handle(end_msg("t", turns=3, seq=7), wall=3))  # turn 2 was lost on the way
    assert (error.code, error.expected, error.seq) == ("out_of_order", 2, 7)
    assert "says 3 turns were sent" in error.message and "consumed 2" in error.message
    assert engine.entries["t"].state == "open" and not engine.queued_units
    engine.handle(turn_msg("t", 2, [12], [[12]]), wall=4)  # the resent turn, then the end again
    reply = engine.handle(end_msg("t", turns=3, seq=8), wall=5)
    assert ack(reply)["applied"] and [type(e) for e in reply.effects] == [EndTrajectory]
    assert engine.entries["t"].state == ENDED and engine.entries["t"].trajectory.tokens.tolist() == [10, 11, 12]
    assert ack(engine.handle(end_msg("t", turns=3, seq=9), wall=6))["duplicate"] is True


def test_an_end_that_counts_fewer_turns_than_were_consumed_is_a_conflict(engine):
    engine.handle(turn_msg("t", 0, [10], [[10]]), wall=1)
    engine.handle(turn_msg("t", 1, [11], [[11]]), wall=2)
    error = refused(engine.handle(end_msg("t", turns=1), wall=3))
    assert error.code == "conflict" and "says 1 turns were sent" in error.message
    assert engine.entries["t"].state == "open"


def test_an_end_may_count_turns_a_terminal_trajectory_answered_after_terminal(engine):
    engine.handle(turn_msg("t", 0, [10], [[10]], status="truncated"), wall=1)
    late = ack(engine.handle(turn_msg("t", 1, [11], [[11]]), wall=2))
    assert (late["applied"], late["reason"]) == (False, "after_terminal")
    assert ack(engine.handle(end_msg("t", turns=2), wall=3))["applied"] is True
    assert engine.entries["t"].state == ENDED


def test_an_end_without_turns_ends_whatever_was_consumed(engine):
    engine.handle(turn_msg("t", 0, [10], [[10]]), wall=1)
    assert ack(engine.handle(end_msg("t"), wall=2))["applied"] is True


def test_different_content_for_an_earlier_turn_is_conflict(engine):
    engine.handle(turn_msg("t", 0, [10], [[10]]), wall=1)
    error = refused(engine.handle(turn_msg("t", 0, [11], [[11]], seq=5), wall=2))
    assert error.code == "conflict" and error.seq == 5


def test_later_turn_is_out_of_order_with_expected(engine):
    error = refused(engine.handle(turn_msg("t", 2), wall=1))
    assert (error.code, error.expected) == ("out_of_order", 0)
    engine.handle(turn_msg("t", 0), wall=1)
    error = refused(engine.handle(turn_msg("t", 3), wall=1))
    assert (error.code, error.expected) == ("out_of_order", 1)
    assert "t" in engine.entries and engine.entries["t"].next_turn == 1


def test_example_7_replay_gap(engine):
    engine.handle(turn_msg("t", 0, [10], [[10, 4]], forced=[20]), wall=1)
    reply = engine.handle(turn_msg("t", 1, [30], None, status="aborted"), wall=2)
    assert ack(reply) == {"seq": 1, "trajectory_id": "t", "turn": 1, "applied": False, "reason": "replay_gap"}
    put, mark = reply.effects
    assert put.message is None and not put.applied and (mark.gap.turn, mark.gap.field) == (1, "mask")
    assert engine.entries["t"].trajectory.tokens.tolist() == [10]
    later = engine.handle(turn_msg("t", 2, [40], [[40]]), wall=3)
    assert ack(later)["reason"] == "replay_gap" and later.effects == ()
    resend = engine.handle(turn_msg("t", 1, [30], None, status="aborted", seq=7), wall=3)
    assert ack(resend) == {"seq": 7, "trajectory_id": "t", "turn": 1, "applied": False, "reason": "replay_gap", "duplicate": True}


def test_example_8_mask_presence_refused_unchanged(engine):
    engine.handle(turn_msg("t", 0, [10], None), wall=1)
    error = refused(engine.handle(turn_msg("t", 1, [30], [[30]]), wall=2))
    assert error.code == "mask_presence"
    assert engine.entries["t"].next_turn == 1
    assert ack(engine.handle(turn_msg("t", 1, [30], None), wall=2))["applied"]


def test_after_truncated_turn_later_turns_are_not_applied(engine):
    engine.handle(turn_msg("t", 0, [10], status="truncated"), wall=1)
    reply = engine.handle(turn_msg("t", 1, [11]), wall=2)
    assert ack(reply)["reason"] == "after_terminal" and reply.effects == ()


def test_replay_array_shrinking_is_misaligned(engine):
    import numpy as np

    engine.handle(turn_msg("t", 0, [10], routed_experts=np.zeros((4, 2), np.int32)), wall=1)
    error = refused(engine.handle(turn_msg("t", 1, [11], routed_experts=np.zeros((3, 2), np.int32)), wall=2))
    assert error.code == "misaligned"


def test_end_makes_a_ready_unit_and_is_idempotent(engine):
    engine.handle(turn_msg("t", 0), wall=1)
    reply = engine.handle(end_msg("t", reward=0.5, metadata={"k": 1}), wall=2)
    assert ack(reply) == {"seq": 100, "trajectory_id": "t", "applied": True}
    (effect,) = reply.effects
    assert isinstance(effect, EndTrajectory) and effect.reward == 0.5 and effect.metadata == {"k": 1}
    assert list(engine.queued_units) == [DeliveryUnit(("t",))]
    again = engine.handle(end_msg("t", reward=0.5, metadata={"k": 1}, seq=101), wall=3)
    assert ack(again)["duplicate"] and again.effects == ()
    assert refused(engine.handle(end_msg("t", reward=0.7), wall=3)).code == "conflict"
    late = engine.handle(turn_msg("t", 1), wall=3)
    assert ack(late)["reason"] == "after_terminal"


def test_end_for_unknown_trajectory(engine):
    assert refused(engine.handle(end_msg("nope"), wall=1)).code == "unknown_trajectory"


def test_abort_discards_and_allows_a_fresh_turn_zero(engine):
    engine.handle(turn_msg("t", 0, [10]), wall=1)
    reply = engine.handle(abort_msg("t"), wall=2)
    assert ack(reply)["applied"] and reply.effects == (DropTrajectory("t", False),)
    assert "t" not in engine.entries
    again = engine.handle(abort_msg("t", seq=201), wall=2)
    assert ack(again) == {"seq": 201, "trajectory_id": "t", "applied": False, "reason": "unknown_trajectory"}
    fresh = engine.handle(turn_msg("t", 0, [99]), wall=3)
    assert ack(fresh)["applied"] and engine.entries["t"].trajectory.tokens.tolist() == [99]


def test_abort_after_end_is_conflict(engine):
    engine.handle(turn_msg("t", 0), wall=1)
    engine.handle(end_msg("t"), wall=1)
    assert refused(engine.handle(abort_msg("t"), wall=2)).code == "conflict"


def test_delivered_ids_are_remembered_for_the_dedup_window(engine):
    engine.handle(turn_msg("t", 0), wall=1)
    engine.handle(end_msg("t"), wall=1)
    (forget,) = engine.delivered("t", wall=10)
    assert forget == Forget("t", 1010.0, committed_at=10)
    for message in (turn_msg("t", 0), end_msg("t"), abort_msg("t")):
        reply = engine.handle(message, wall=20)
        assert ack(reply)["applied"] is False and ack(reply)["duplicate"] is True and reply.effects == ()
    engine.expire(wall=2000)
    assert "t" not in engine.dedup
    assert ack(engine.handle(turn_msg("t", 0), wall=2001))["applied"]


def test_dedup_records_expire_in_time_order_whatever_order_they_came_in(engine):
    engine.remember({f"r{i}": float(1000 - i) for i in range(1000)})  # a restore: in any order
    engine.remember({"a": 300.5, "b": 100.5})
    engine.remember({"c": 200.5})
    engine.remember({"b": 400.5})  # remembered again, for longer
    engine.expire(wall=250)
    assert set(engine.dedup) == {"a", "b"} | {f"r{i}" for i in range(1000) if 1000 - i >= 250}
    assert engine.dedup["b"] == 400.5
    engine.expire(wall=350)
    assert set(engine.dedup) == {"b"} | {f"r{i}" for i in range(1000) if 1000 - i >= 350}
    engine.expire(wall=1001)
    assert engine.dedup == {}
    assert ack(engine.handle(turn_msg("b", 0), wall=1001))["applied"]


def test_idle_open_trajectory_expires_to_dead_letters(engine):
    engine.handle(turn_msg("t", 0), wall=1)
    engine.handle(turn_msg("u", 0), wall=90)
    effects = engine.expire(wall=150)
    assert effects == [DeadLetter("t", "expired", 150, dedup_until=1150.0)]
    assert engine.entries["t"].state == DEAD and engine.entries["u"].state == "open"
    assert engine.dead_letters(10) == [{"trajectory_id": "t", "reason": "expired", "at": 150}]
    late = ack(engine.handle(turn_msg("t", 1), wall=151))
    assert (late["applied"], late["reason"]) == (False, "expired") and "duplicate" not in late
    assert engine.revive("t", wall=152) == []  # never delivered as if complete


@pytest.mark.parametrize("together", [False, True])
def test_each_applied_turn_restarts_its_trajectory_s_idle_clock(engine, together):
    """Continued at 80, "t" is idle from 80 (trajectory_ttl 100), behind
    "u", which is expired first although it started after "t"; alike
    whether its turns come one by one or as a stretch (`handle_turns`)."""
    engine.handle(turn_msg("t", 0), wall=1)
    engine.handle(turn_msg("u", 0), wall=50)
    later = [turn_msg("t", 1), turn_msg("t", 2, (11,))]
    if together:
        assert all(reply.fields["applied"] for reply in engine.handle_turns(later, wall=80))
    else:
        assert all(engine.handle(message, wall=80).fields["applied"] for message in later)
    assert engine.expire(wall=160) == [DeadLetter("u", "expired", 160, dedup_until=1160.0)]
    assert engine.entries["t"].state == "open"
    assert engine.expire(wall=181) == [DeadLetter("t", "expired", 181, dedup_until=1181.0)]


def test_dead_letter_and_revive(engine):
    engine.handle(turn_msg("t", 0), wall=1)
    engine.handle(end_msg("t"), wall=1)
    engine.queued_units.clear()
    assert engine.dead_letter("t", "bad batch", wall=5) == [DeadLetter("t", "bad batch", 5)]
    assert engine.counts()[DEAD] == 1
    assert engine.revive("t", wall=6) == [Revive("t")]
    assert engine.entries["t"].state == ENDED and list(engine.queued_units) == [DeliveryUnit(("t",), None, None, 0)]


def test_a_dead_letter_given_up_before_its_end_or_its_reward_is_never_revived(engine):
    engine.handle(turn_msg("open", 0), wall=1)
    engine.handle(turn_msg("scoring", 0), wall=1)
    engine.handle(end_msg("scoring", reward=None), wall=2)
    engine.give_up(DEFAULT_JOB, lambda entry: True, "stale", wall=3)
    assert engine.counts()[DEAD] == 2
    assert engine.revive("open", wall=4) == [] and engine.revive("scoring", wall=4) == []
    assert engine.counts()[DEAD] == 2 and not engine.queued_units


def test_a_revived_member_of_a_closed_group_makes_it_deliverable_again_until_it_goes(engine):
    engine.handle(turn_msg("a", 0, group=("G", 2)), wall=1)
    engine.handle(turn_msg("b", 0, group=("G", 2)), wall=1)
    engine.handle(end_msg("a"), wall=2)
    engine.handle(end_msg("b", seq=101), wall=2)
    engine.queued_units.clear()
    engine.delivered("a", wall=3)
    assert CloseGroup("G") in engine.dead_letter("b", "refused", wall=3)
    assert engine.revive("b", wall=4) == [Revive("b"), GroupDeliverable("G", 2)]
    assert list(engine.queued_units) == [DeliveryUnit(("b",), "G", 2, 1)]
    assert engine.groups["G"].deliverable and engine.awaiting_group() == 0
    assert CloseGroup("G") in engine.delivered("b", wall=5) and "G" not in engine.groups


def test_a_revived_member_of_a_deliverable_group_keeps_the_group_open_until_it_goes(engine):
    for tid in "abc":
        engine.handle(turn_msg(tid, 0, group=("G", 3)), wall=1)
        engine.handle(end_msg(tid), wall=2)
    engine.queued_units.clear()
    engine.dead_letter("a", "refused", wall=3)
    assert engine.revive("a", wall=4) == [Revive("a")]
    assert list(engine.queued_units) == [DeliveryUnit(("a",), "G", 3, 2)]
    engine.delivered("b", wall=5)
    engine.delivered("c", wall=5)
    assert "G" in engine.groups
    assert CloseGroup("G") in engine.delivered("a", wall=6) and "G" not in engine.groups


def test_ended_members_await_their_group_until_it_is_deliverable_or_expires(engine):
    engine.handle(turn_msg("a", 0, group=("G", 3)), wall=1)
    engine.handle(turn_msg("b", 0, group=("G", 3)), wall=1)
    engine.handle(turn_msg("x", 0, group=("H", 2)), wall=1)
    engine.handle(turn_msg("y", 0, group=("H", 2)), wall=1)
    assert engine.awaiting_group() == 0
    engine.handle(end_msg("a"), wall=2)
    engine.handle(end_msg("x"), wall=2)
    assert engine.awaiting_group() == 2
    engine.handle(end_msg("b", reward=None), wall=3)  # scoring: not ended yet
    assert engine.awaiting_group() == 2
    engine.handle(reward_msg("b", 0.5), wall=4)
    assert engine.awaiting_group() == 3
    engine.handle(abort_msg("y"), wall=5)  # H complete: x is ready
    assert engine.awaiting_group() == 2 and [unit.trajectory_ids for unit in engine.queued_units] == [("x",)]
    engine.expire(wall=200)  # G idle past the TTL: delivered without its third member
    assert engine.awaiting_group() == 0 and [unit.trajectory_ids for unit in engine.queued_units] == [("x",), ("a", "b")]


def test_a_pruned_dead_letter_is_listed_as_pruned_until_its_id_is_forgotten(engine):
    for tid, wall in (("a", 1), ("b", 2)):
        engine.handle(turn_msg(tid, 0), wall=wall)
        engine.handle(end_msg(tid), wall=wall)
        engine.dead_letter(tid, "refused", wall=wall)
    effects, gone = engine.prune_dead(engine.entries["b"].stored_bytes, wall=10)
    assert effects == [Forget("a", 1010.0, "refused", 1)] and gone == {"refused": 1}
    assert engine.dead_letters(1, pruned=True) == [{"trajectory_id": "a", "reason": "refused", "at": 1, "pruned": True}]
    assert [item["trajectory_id"] for item in engine.dead_letters(5)] == ["b"]
    engine.expire(wall=1011)  # its dedup window is over
    assert "a" not in engine.dedup and [item["trajectory_id"] for item in engine.dead_letters(5, pruned=True)] == ["b"]


def test_group_is_deliverable_when_every_member_ended_or_left(engine):
    for i in range(3):
        engine.handle(turn_msg(f"g{i}", 0, group=("G", 3)), wall=1)
    engine.handle(end_msg("g0"), wall=2)
    engine.handle(end_msg("g2"), wall=2)
    assert not engine.queued_units
    reply = engine.handle(abort_msg("g1"), wall=3)
    assert ack(reply)["applied"]
    assert DropTrajectory("g1", True) in reply.effects and GroupDeliverable("G", 3) in reply.effects
    assert list(engine.queued_units) == [DeliveryUnit(("g0", "g2"), "G", 3, 1)]
    assert refused(engine.handle(turn_msg("g1", 0, group=("G", 3)), wall=4)).code == "conflict"
    engine.delivered("g0", wall=5)
    effects = engine.delivered("g2", wall=5)
    assert CloseGroup("G") in effects and "G" not in engine.groups and "g1" not in engine.entries


def test_group_membership_rules(engine):
    engine.handle(turn_msg("a", 0, group=("G", 2)), wall=1)
    assert refused(engine.handle(turn_msg("b", 0, group=("G", 3)), wall=1)).code == "conflict"
    engine.handle(turn_msg("b", 0, group=("G", 2)), wall=1)
    assert refused(engine.handle(turn_msg("c", 0, group=("G", 2)), wall=1)).code == "conflict"


def test_aborted_member_may_rejoin_before_the_group_is_deliverable(engine):
    engine.handle(turn_msg("a", 0, group=("G", 2)), wall=1)
    engine.handle(turn_msg("b", 0, group=("G", 2)), wall=1)
    engine.handle(abort_msg("a"), wall=2)
    assert ack(engine.handle(turn_msg("a", 0, group=("G", 2)), wall=3))["applied"]
    engine.handle(end_msg("a"), wall=4)
    engine.handle(end_msg("b", seq=101), wall=4)
    assert list(engine.queued_units) == [DeliveryUnit(("a", "b"), "G", 2, 0)]


def test_idle_incomplete_group_is_made_deliverable_with_missing_members_left(engine):
    engine.handle(turn_msg("a", 0, group=("G", 4)), wall=1)
    engine.handle(end_msg("a"), wall=2)
    assert engine.expire(wall=50) == []
    effects = engine.expire(wall=200)
    assert GroupDeliverable("G", 4) in effects
    assert list(engine.queued_units) == [DeliveryUnit(("a",), "G", 4, 3)]


def test_expired_member_counts_as_left(engine):
    engine.handle(turn_msg("a", 0, group=("G", 2)), wall=1)
    engine.handle(turn_msg("b", 0, group=("G", 2)), wall=150)
    engine.handle(end_msg("b"), wall=150)
    engine.expire(wall=160)
    assert list(engine.queued_units) == [DeliveryUnit(("b",), "G", 2, 1)]


def test_refused_turn_zero_leaves_no_trace(engine):
    engine.handle(turn_msg("a", 0, group=("G", 1)), wall=1)
    error = refused(engine.handle(turn_msg("b", 0, group=("G", 1)), wall=1))
    assert error.code == "conflict" and "b" not in engine.entries
    assert list(engine.groups["G"].members) == ["a"]


def test_mask_through_the_engine_matches_concatenation(engine):
    engine.handle(turn_msg("t", 0, [1, 2], [[1, 5], [2]], forced=[7]), wall=1)
    engine.handle(turn_msg("t", 1, [3], [[3, 9]]), wall=1)
    expected = SamplingMask.concatenate(
        [SamplingMask.from_supports([[1, 5], [2]]), SamplingMask.singletons([7]), SamplingMask.from_supports([[3, 9]])]
    )
    assert engine.entries["t"].trajectory.mask == expected


def test_a_ready_trajectory_is_unreadable_only_after_bounded_failed_reads_and_a_revive_starts_afresh(engine):
    from rollstream.broker.engine import UNREADABLE_AFTER

    engine.handle(turn_msg("t", 0, [10], [[10]]), wall=1)
    engine.handle(end_msg("t"), wall=2)
    assert [engine.unreadable("t") for _ in range(UNREADABLE_AFTER)] == [False] * (UNREADABLE_AFTER - 1) + [True]
    engine.dead_letter("t", "unreadable", wall=3)
    with pytest.raises(ValueError, match="expected ended"):
        engine.unreadable("t")  # only an ended trajectory is read back
    assert engine.revive("t", wall=4) == [Revive("t")]
    assert engine.unreadable("t") is False  # revived by an operator (the record repaired): counted afresh


def test_only_a_ready_trajectory_is_delivered_or_dead_lettered(engine):
    engine.handle(turn_msg("open", 0), 1.0)
    with pytest.raises(ValueError, match=r"only an ended trajectory can be delivered: 'open' is open, expected ended"):
        engine.delivered("open", 2.0)
    with pytest.raises(ValueError, match=r"only an ended trajectory can be dead-lettered: 'gone' is unknown, expected ended"):
        engine.dead_letter("gone", "max_deliveries", 2.0)
    engine.handle(end_msg("open"), 3.0)
    engine.dead_letter("open", "max_deliveries", 4.0)
    with pytest.raises(ValueError, match="'open' is dead, expected ended"):
        engine.delivered("open", 5.0)
    assert engine.counts()["dead"] == 1


def test_a_frame_of_an_expired_trajectory_is_answered_expired_not_duplicate():
    """A producer whose spool resends an `end` after its trajectory expired
    must not count the trajectory as taken: it was never delivered."""
    engine = MergeEngine(EngineSettings(trajectory_ttl=10.0))
    engine.handle(turn_msg("t", 0, seq=1), 0.0)
    engine.expire(20.0)
    reply = engine.handle(end_msg("t", seq=2), 21.0)
    assert reply.fields["applied"] is False and reply.fields["reason"] == "expired" and "duplicate" not in reply.fields


@pytest.mark.parametrize("again", [False, True])
def test_an_abort_to_go_again_keeps_a_group_waiting_for_its_member(again):
    """A member aborted to be produced again from turn 0 (`again`) is waited
    for like an open one; aborted for good, it leaves and its group goes
    out without it."""
    engine = MergeEngine()
    engine.handle(turn_msg("a", 0, group=("G", 2)), wall=1)
    engine.handle(turn_msg("b", 0, group=("G", 2)), wall=1)
    assert engine.handle(abort_msg("b", again=again), wall=2).fields["applied"] is True
    engine.handle(end_msg("a"), wall=3)
    if not again:
        assert list(engine.queued_units) == [DeliveryUnit(("a",), "G", 2, 1)]
        return
    assert not engine.queued_units
    assert engine.expire(wall=2 + engine.settings.trajectory_ttl - 1) == [] and not engine.queued_units
    engine.handle(turn_msg("b", 0, group=("G", 2)), wall=4)
    engine.handle(end_msg("b", seq=101), wall=5)
    assert list(engine.queued_units) == [DeliveryUnit(("a", "b"), "G", 2, 0)]


def test_an_aborted_member_to_go_again_that_never_comes_back_lets_its_group_go_at_the_ttl():
    engine = MergeEngine()
    engine.handle(turn_msg("a", 0, group=("G", 2)), wall=1)
    engine.handle(turn_msg("b", 0, group=("G", 2)), wall=1)
    engine.handle(abort_msg("b", again=True), wall=2)
    engine.handle(end_msg("a"), wall=3)
    engine.expire(wall=3 + engine.settings.trajectory_ttl + 1)
    assert list(engine.queued_units) == [DeliveryUnit(("a",), "G", 2, 1)]


def test_a_producer_is_handed_back_only_what_it_opened_in_its_job():
    engine = MergeEngine()
    engine.handle(turn_msg("a", 0), wall=1, producer=Producer("p1"))
    engine.handle(turn_msg("b", 0), wall=1, producer=Producer("p1", "key-1"))
    engine.handle(turn_msg("c", 0), wall=1, producer=Producer("p2"))
    engine.handle(BrokerCore.keyed(turn_msg("d", 0, job="other")), wall=1, producer=Producer("p1"))
    engine.handle(turn_msg("e", 0), wall=1, producer=Producer("p1"))
    engine.handle(end_msg("e"), wall=2)
    engine.handle(turn_msg("f", 0), wall=1, producer=Producer("p1"))
    engine.handle(end_msg("f", reward=None), wall=2)
    assert [e.trajectory_id for e in engine.open_of(Producer("p1"), DEFAULT_JOB)] == ["a", "f"]
    assert [e.trajectory_id for e in engine.open_of(Producer("p1", "key-1"), DEFAULT_JOB)] == ["b"]
    assert [e.trajectory_id for e in engine.open_of(Producer("p1"), "other")] == ["other\x1fd"]


def _engine_state(engine: MergeEngine) -> dict:
    """What the per-turn index updates leave behind: expiry and eviction
    order, bytes held, entries' clocks and outcomes, groups' clocks."""
    return {
        "open": list(engine._open), "resident_open": list(engine._resident_open),
        "idle_groups": list(engine._idle_groups), "bytes": engine.bytes_in_memory,
        "entries": {tid: (e.state, e.updated_at, e.held, e.stored_bytes, e.version, e.outcomes)
                    for tid, e in engine.entries.items()},
        "groups": {gid: (g.updated_at, dict(g.members)) for gid, g in engine.groups.items()},
    }


def _reply_summary(reply) -> tuple:
    return (reply.fields, None if reply.error is None else (reply.error.code, str(reply.error)),
            [(type(effect).__name__, getattr(effect, "turn", None)) for effect in reply.effects])


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 3), st.lists(st.tuples(st.integers(0, 6), st.sampled_from(["same", "other", "aborted"])),
                                   min_size=1, max_size=8))
def test_a_turn_stretch_is_answered_and_leaves_the_engine_as_turn_by_turn_handling_does(applied_before, sent):
    """`handle_turns` against `handle` called per turn on an engine in the
    same state: the same replies and effects per turn, and the same
    indexes after the stretch (turns in order, resent, conflicting, out of
    order, terminal, for a trajectory in a group beside another one)."""
    def content(index, variant):
        tokens = (10 + index,) if variant == "same" else (40 + index,)
        return turn_msg("t", index, tokens, supports=[list(tokens)], group=("g", 2), seq=index,
                        status="aborted" if variant == "aborted" else "completed")

    engines = [MergeEngine(), MergeEngine()]
    for engine in engines:
        engine.handle(turn_msg("other", 0, group=("g", 2)), 5.0)
        for index in range(applied_before):
            engine.handle(content(index, "same"), 10.0 + index)
        engine.handle(turn_msg("other", 1), 20.0)  # "t" is no longer the latest continued
    messages = [content(index, variant) for index, variant in sent]
    one_by_one = [engines[0].handle(message, 30.0) for message in messages]
    together = engines[1].handle_turns(messages, 30.0)
    assert [_reply_summary(reply) for reply in together] == [_reply_summary(reply) for reply in one_by_one]
    assert _engine_state(engines[1]) == _engine_state(engines[0])


class Unforeseen(Exception):
    """A failure no rule foresaw (a bug), raised on purpose."""


@pytest.mark.parametrize("together", [False, True])
def test_a_failure_no_rule_foresaw_leaves_none_of_its_effects_to_the_next_message(engine, monkeypatch, together):
    """The end completing a group queues the group's effect, then its filter
    raises: the next message's effects are its own, alone or in a stretch."""
    engine.handle(turn_msg("g1", 0, group=("g", 1)), wall=1)

    def failing(*args):
        raise Unforeseen("a group filter failed")

    monkeypatch.setattr(engine_module, "first_dropping", failing)
    if together:
        [failed] = engine.handle_turns([end_msg("g1")], wall=2)
        assert isinstance(failed, Unforeseen)
    else:
        with pytest.raises(Unforeseen):
            engine.handle(end_msg("g1"), wall=2)
    monkeypatch.undo()
    reply = engine.handle(turn_msg("next", 0), wall=3)
    assert [type(effect) for effect in reply.effects] == [OpenTrajectory, PutTurn]
