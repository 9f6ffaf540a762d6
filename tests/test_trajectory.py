"""Trajectory merging and lifecycle: docs/semantics.md §3-§5, examples 6-8."""
import zlib
from contextlib import nullcontext
from unittest import mock

import msgpack
import numpy as np
import pytest
import zmq

from rollstream.common import ProtocolError, SamplingMask, Trajectory, Turn, sockets
from rollstream.common.buffers import GrowableArray, constant_run
from rollstream.common.codec import decode
from rollstream.common.messages import BROKER_TO_CONSUMER, PRODUCER_TO_BROKER
from rollstream.common.trajectory import Gap, TurnOutcome
from rollstream.common.wire import encode_deliver, encode_turn, trajectory_from_deliver, turn_from_message


def turn(tokens, supports=None, forced=None, status="completed", **kw):
    return Turn.build(tokens, [-0.5] * len(tokens), supports=supports, forced_tokens=forced, status=status, **kw)


def test_example_6_forced_tokens_between_turns():
    traj = Trajectory("t", [1, 2])
    assert traj.append_turn(turn([10], [[10, 4]], forced=[20, 21])) == TurnOutcome(True)
    assert traj.append_turn(turn([30], [[30, 7, 8]])) == TurnOutcome(True)
    assert traj.mask.ids.tolist() == [10, 4, 20, 21, 30, 7, 8]
    assert traj.mask.offsets.tolist() == [0, 2, 3, 4, 7]
    assert traj.loss_mask.tolist() == [1, 0, 0, 1]
    assert traj.log_probs.tolist() == [-0.5, 0.0, 0.0, -0.5]
    assert traj.tokens.tolist() == [10, 20, 21, 30]
    assert traj.response_length == 4 and traj.turns == 2


def test_example_7_replay_gap_cuts_at_last_captured_turn():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10, 11], [[10], [11, 3]], forced=[20, 21]))
    outcome = traj.append_turn(turn([30], None, status="aborted"))
    assert outcome == TurnOutcome(False, "replay_gap")
    assert traj.gap == Gap(turn=1, field="mask")
    assert traj.tokens.tolist() == [10, 11]  # trailing forced tokens dropped
    assert traj.mask == SamplingMask.from_supports([[10], [11, 3]])
    assert traj.status == "completed"  # status of the last applied turn
    assert traj.terminal
    assert traj.append_turn(turn([40], [[40]])) == TurnOutcome(False, "replay_gap")
    traj.validate()


def test_example_8_missing_then_present_is_refused_and_changes_nothing():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10], None, forced=[5]))
    with pytest.raises(ProtocolError) as err:
        traj.append_turn(turn([30], [[30]]))
    assert err.value.code == "mask_presence" and "(missing, then present)" in err.value.message
    assert traj.tokens.tolist() == [10, 5] and not traj.has_mask and traj.turns == 1


def test_mask_may_start_while_response_is_empty():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([], None))
    traj.append_turn(turn([7], [[7, 8]]))
    assert traj.mask.offsets.tolist() == [0, 2]


def test_start_mask_after_tokens_is_an_error():
    traj = Trajectory("t", [1])
    traj.append_forced([3])
    with pytest.raises(ValueError, match="cannot initialise a sampling mask after response tokens"):
        traj.start_mask()


def test_forced_tokens_get_singleton_support_loss_zero_logprob_zero():
    traj = Trajectory("t", [1])
    traj.start_mask()
    traj.append_forced([8, 9])
    assert traj.mask == SamplingMask.singletons([8, 9])
    assert traj.loss_mask.tolist() == [0, 0] and traj.log_probs.tolist() == [0.0, 0.0]


def test_sampled_tokens_without_support_cannot_join_a_masked_trajectory():
    traj = Trajectory("t", [1])
    traj.start_mask()
    with pytest.raises(ProtocolError) as err:
        traj.append_sampled(np.array([1], np.int32), np.array([-1.0], np.float32), None, None)
    assert err.value.code == "misaligned"


@pytest.mark.parametrize("status", ["truncated", "aborted"])
def test_after_truncated_or_aborted_nothing_applies_but_trailing_forced_kept(status):
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10], [[10]], forced=[20], status=status))
    assert traj.terminal and traj.status == status
    assert traj.append_turn(turn([11], [[11]])) == TurnOutcome(False, "after_terminal")
    assert traj.tokens.tolist() == [10, 20] and traj.gap is None


def test_no_mask_anywhere_gives_no_mask():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10], forced=[20]))
    traj.append_turn(turn([11]))
    assert traj.mask is None and traj.tokens.tolist() == [10, 20, 11]


@pytest.mark.parametrize("field", ["routed_experts", "indexer_topk"])
def test_replay_gap_on_context_fields(field):
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10], forced=[20], **{field: np.zeros((3, 2), np.int32)}))
    assert traj.append_turn(turn([11])) == TurnOutcome(False, "replay_gap")
    assert traj.gap == Gap(1, field) and traj.tokens.tolist() == [10]


@pytest.mark.parametrize("field", ["routed_experts", "indexer_topk"])
def test_context_field_missing_then_present_is_mask_presence(field):
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10]))
    with pytest.raises(ProtocolError) as err:
        traj.append_turn(turn([11], **{field: np.zeros((3, 2), np.int32)}))
    assert err.value.code == "mask_presence"


def test_context_fields_keep_latest_and_must_not_shrink():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10], routed_experts=np.zeros((4, 2), np.int32)))
    traj.append_turn(turn([11], routed_experts=np.ones((6, 2), np.int32)))
    assert traj.routed_experts.shape == (6, 2) and traj.routed_experts.sum() == 12
    with pytest.raises(ProtocolError) as err:
        traj.append_turn(turn([12], routed_experts=np.ones((5, 2), np.int32)))
    assert err.value.code == "misaligned"
    with pytest.raises(ProtocolError):
        traj.append_turn(turn([12], routed_experts=np.ones((7, 3), np.int32)))
    assert traj.turns == 2


def test_gap_reports_first_missing_field_in_contract_order():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10], [[10]], routed_experts=np.zeros((2, 1), np.int32)))
    traj.append_turn(turn([11]))
    assert traj.gap.field == "mask"


def test_weight_versions_concatenate():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([1], weight_version="v1"))
    traj.append_turn(turn([2], weight_version="v2"))
    assert traj.weight_versions == ["v1", "v2"]


def test_weight_version_spans_place_each_version_in_the_response_and_survive_a_strip_and_the_wire():
    """A turn whose weights changed after its first token, then a turn of
    one version after an observation."""
    traj = Trajectory("t", [1])
    traj.append_turn(Turn.build([10, 11, 12], [-0.5] * 3, forced_tokens=[20],
                                weight_version_spans=[("v1", 0, 1), ("v2", 1, 3)]))
    traj.append_turn(turn([13], weight_version="v3"))
    assert traj.weight_versions == ["v1", "v3"]
    assert traj.weight_version_spans == [(("v1", 0, 1), ("v2", 1, 3)), (("v3", 4, 5),)]
    traj.reward = 0.0
    again = trajectory_from_deliver(decode(encode_deliver(traj, "lease"), BROKER_TO_CONSUMER))
    assert again.weight_version_spans == traj.weight_version_spans
    traj.strip_last_output_tokens(4)  # into the first turn's second span; the second turn's is gone
    assert traj.weight_version_spans == [(("v1", 0, 1),), ()]
    with pytest.raises(ProtocolError, match="weight_version_spans has one entry per weight version"):
        message = encode_deliver(again, "lease")
        header = msgpack.unpackb(message[0])
        header["weight_version_spans"] = header["weight_version_spans"][:1]
        decode([msgpack.packb(header), *message[1:]], BROKER_TO_CONSUMER)


@pytest.mark.parametrize("spans, text", [
    ([["v1", 0, 2], ["v2", 1, 2]], "weight_version_spans are in token order and do not overlap"),
    ([["v0", 0, 1]], "a turn's weight_version is its first span's: expected 'v0', got 'v1'"),
    ([], "weight_version_spans, when sent, holds at least one span"),
])
def test_a_turn_message_whose_spans_break_a_rule_is_refused_naming_it(spans, text):
    frames = encode_turn("t", 1, Turn.build([1, 2], [-0.5, -0.5], weight_version_spans=[("v1", 0, 2)]), seq=3)
    header = msgpack.unpackb(frames[0])
    header["weight_version_spans"] = spans
    with pytest.raises(ProtocolError, match=text):
        decode([msgpack.packb(header), *frames[1:]], PRODUCER_TO_BROKER)


def test_a_turn_whose_spans_run_past_its_tokens_is_refused_and_changes_nothing():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10], weight_version="v1"))
    frames = encode_turn("t", 1, Turn.build([1, 2], [-0.5, -0.5], weight_version_spans=[("v1", 0, 2)]), seq=3)
    header = msgpack.unpackb(frames[0])
    header["weight_version_spans"] = [["v1", 0, 3]]
    late = turn_from_message(decode([msgpack.packb(header), *frames[1:]], PRODUCER_TO_BROKER))
    with pytest.raises(ProtocolError, match=r"weight_version_spans lie within the turn's sampled tokens' violated: "
                                            r"expected ends <= 2"):
        traj.append_turn(late)
    assert traj.weight_version_spans == [(("v1", 0, 1),)] and traj.response_length == 1


def test_custom_loss_mask_is_kept():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([1, 2], loss_mask=[0, 1]))
    assert traj.loss_mask.tolist() == [0, 1]


def test_strip_last_output_tokens():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10, 11], [[10, 1], [11]], forced=[20]))
    traj.strip_last_output_tokens(0)
    traj.strip_last_output_tokens(-2)
    assert traj.response_length == 3
    traj.strip_last_output_tokens(2)
    assert traj.tokens.tolist() == [10] and traj.mask.ids.tolist() == [10, 1]
    assert traj.loss_mask.tolist() == [1] and traj.log_probs.tolist() == [-0.5]
    with pytest.raises(ValueError, match="cannot strip"):
        traj.strip_last_output_tokens(2)
    traj.validate()


def test_reset_for_retry_clears_response_and_allows_a_fresh_attempt():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10], [[10]], status="truncated"))
    traj.reset_for_retry()
    assert traj.status == "aborted" and traj.response_length == 0 and traj.mask is None
    assert traj.append_turn(turn([5])) == TurnOutcome(True)
    assert traj.tokens.tolist() == [5]


def test_validate_detects_misalignment():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10]))
    traj._log_probs.extend(np.zeros(1, np.float32))  # corrupt on purpose
    with pytest.raises(ValueError, match="log_probs has 2 entries"):
        traj.validate()


def test_from_arrays_restores_state():
    traj = Trajectory("t", [1, 2], group_id="g", group_size=2, sample_index=3)
    traj.append_turn(turn([10], [[10]], forced=[20]))
    copy = Trajectory.from_arrays(
        "t", traj.arrays(), status=traj.status, turns=traj.turns, group_id="g", group_size=2, sample_index=3
    )
    assert copy.mask == traj.mask and copy.tokens.tolist() == [10, 20]
    assert copy.group_id == "g" and copy.sample_index == 3 and not copy.terminal
    assert copy.append_turn(turn([11], [[11]])).applied


def test_mask_snapshot_is_immune_to_later_changes():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10, 11], [[10], [11]]))
    snapshot = traj.mask
    traj.strip_last_output_tokens(1)
    traj.append_turn(turn([12], [[12]]))
    assert snapshot == SamplingMask.from_supports([[10], [11]])


def test_growable_array_grows_geometrically_when_read_between_appends():
    """Amortised O(appended) even when every append is followed by a read:
    a thousand appends reallocate only O(log n) times."""
    arr = GrowableArray(np.int32)
    reallocations, last = 0, None
    for i in range(1000):
        arr.extend(np.arange(100, dtype=np.int32))
        assert arr.view()[-1] == 99 and len(arr.view()) == 100 * (i + 1)
        if arr._buf is not last:
            reallocations, last = reallocations + 1, arr._buf
    assert len(arr) == 100_000 and reallocations <= 14
    assert arr.view()[-100:].tolist() == list(range(100))


def test_growable_array_queued_appends_keep_their_values_and_order():
    """Appends are written at the next read: a writable source changed in
    between changes nothing, shifts and fills land where they were queued."""
    arr = GrowableArray(np.int64)
    source = np.array([1, 2, 3], np.int64)
    arr.extend(source)
    source[:] = -1
    frozen_part = np.array([7, 8], np.int64)
    frozen_part.flags.writeable = False
    arr.extend_many([frozen_part], [100])
    arr.extend(constant_run(5, 2, np.dtype(np.int64)))
    assert len(arr) == 7
    assert arr.view().tolist() == [1, 2, 3, 107, 108, 5, 5]
    arr.extend(np.array([9], np.int64))
    arr.truncate(4)
    assert arr.view().tolist() == [1, 2, 3, 107]
    arr.extend_many([np.array([1], np.int64)], [10])
    assert arr.copy().tolist() == [1, 2, 3, 107, 11] and arr.nbytes == 5 * 8
    with pytest.raises(ValueError, match="truncate"):
        arr.truncate(6)


def test_growable_array_casts_other_dtypes_and_takes_strided_parts():
    """The first write joins the parts' bytes, so a part of another dtype
    must be cast when queued (not reinterpreted) and a strided one must be
    read element by element."""
    arr = GrowableArray(np.int32)
    strided = np.arange(10, dtype=np.int32)[::3]
    strided.flags.writeable = False
    arr.extend_many([np.array([2**40 + 5, -1], np.int64), strided, np.array([True], bool)])
    assert arr.view().tolist() == [5, -1, 0, 3, 6, 9, 1]  # int64 wraps like numpy's same_kind cast
    with pytest.raises(TypeError):
        arr.extend(np.array([1.5], np.float32))  # float into int: refused, as numpy refuses
    floats = GrowableArray(np.float32)
    floats.extend_many([np.array([1, 2], np.int32), np.array([0.5], np.float64)])
    assert floats.view().tolist() == [1.0, 2.0, 0.5]


def test_turn_build_checks_what_a_broker_would():
    with pytest.raises(ProtocolError) as err:
        turn([10], [[11]])
    assert err.value.code == "mask_invalid"
    with pytest.raises(ProtocolError) as err:
        Turn.build([10], [-1.0, -2.0])
    assert err.value.code == "misaligned"
    with pytest.raises(ProtocolError) as err:
        turn([10], [[10]], vocab_size=10)
    assert err.value.code == "out_of_vocab"
    with pytest.raises(ProtocolError) as err:
        turn([1], forced=[-3])
    assert err.value.code == "out_of_vocab"
    with pytest.raises(ValueError, match="status"):
        turn([1], status="done")


@pytest.mark.parametrize("kwargs, code, text", [
    (dict(tokens=[1.0]), "dtype", "tokens must hold integers, got dtype float64"),
    (dict(tokens=[2**31]), "dtype", r"'values fit int32' violated: tokens holds 2147483648, expected \[-2147483648, "),
    (dict(tokens=[[1]]), "shape", r"tokens must be 1-D, got shape \(1, 1\)"),
    (dict(log_probs=["a"]), "dtype", "log_probs must hold real numbers, got dtype <U1"),
    (dict(log_probs=[[-0.5]]), "shape", r"log_probs must be 1-D, got shape \(1, 1\)"),
    (dict(supports=[[1.5]]), "dtype", "supports must hold integers, got dtype float64"),
    (dict(supports=[[2**40]]), "dtype", "supports holds 1099511627776"),
    (dict(supports=[[]]), "mask_invalid", r"at token 0: supports\[0\] gives 0 ids, expected at least 1"),
    (dict(supports=[[1], [2]]), "misaligned", "supports has 2 entries, tokens has 1"),
    (dict(mask=SamplingMask.from_supports([[1], [2]])), "misaligned", "mask covers 2 tokens, tokens has 1"),
    (dict(mask_ids=[1], mask_offsets=[0, 1, 1]), "misaligned", "mask_offsets has 3 entries, expected 2"),
    (dict(status="done"), "schema", r"status must be one of \('completed', 'truncated', 'aborted'\), got 'done'"),
    (dict(supports=[[1]], mask_ids=[1], mask_offsets=[0, 1]), "schema", r"give the support once.*got \['supports', 'mask_ids'\]"),
    (dict(mask_ids=[1]), "schema", "mask_ids and mask_offsets travel together; got only mask_ids"),
    (dict(forced_tokens=[0.5]), "dtype", "forced_tokens must hold integers"),
    (dict(routed_experts=3), "shape", "routed_experts must have at least 1 dimension, got a scalar"),
    (dict(indexer_topk=[[0.5]]), "dtype", "indexer_topk must hold integers"),
    (dict(weight_version_spans=[("v1", 0, 2)]), "misaligned",
     r"rule 'weight_version_spans lie within the turn's sampled tokens' violated: expected ends <= 1"),
    (dict(weight_version_spans=[("v1", 0, 1)], weight_version="v0"), "schema",
     r"rule 'a turn's weight_version is its first span's' violated: expected 'v1', got 'v0'"),
    (dict(weight_version_spans=[]), "schema", "rule 'weight_version_spans are non-empty versions"),
    (dict(full_log_probs=[-0.5, -0.25]), "misaligned",
     r"rule 'per-token fields aligned \(one entry per response token\)' violated: full_log_probs has 2 entries, tokens has 1"),
    *((dict(full_log_probs=[bad]), "invalid_value",
       rf"rule 'full_log_probs are finite and <= 0 \(within 0.0009765625 for rounding\)' violated at token 0: "
       rf"full_log_prob is {bad}, expected finite and <= 0.0009765625")
      for bad in (float("nan"), float("inf"), float("-inf"), 0.5, 2.0**-9)),
    (dict(full_log_probs=["a"]), "dtype", "full_log_probs must hold real numbers, got dtype <U1"),
    (dict(full_log_probs=[[-0.5]]), "shape", r"full_log_probs must be 1-D, got shape \(1, 1\)"),
    (dict(supports=[[1, 4]], mask_log_probs=[-0.5]), "misaligned",
     r"rule 'per-support-id fields aligned with mask_ids \(one entry per support id\)' violated: mask_log_probs has 1 "
     r"entries, mask_ids has 2"),
    (dict(mask_log_probs=[-0.5]), "misaligned", "mask_log_probs has 1 entries, no sampling mask"),
    *((dict(supports=[[1, 4]], mask_log_probs=[-0.5, bad]), "invalid_value",
       rf"rule 'mask_log_probs are finite and <= 0 \(within 0.0009765625 for rounding\)' violated at token 0: "
       rf"its support holds a mask_log_prob of {bad}, expected finite and <= 0.0009765625")
      for bad in (float("nan"), float("inf"), float("-inf"), 0.5, 2.0**-9)),
    (dict(supports=[[1, 4]], mask_log_probs=[-0.1, -0.1], mask_log_probs_normalized=True), "invalid_value",
     r"rule 'each support's probabilities sum to 1 \(within 0.0009765625\) when mask_log_probs_normalized' violated "
     r"at token 0: expected its 2 probabilities to sum to 1, got 1.80967"),
    (dict(supports=[[1, 4]], mask_log_probs=["a", "b"]), "dtype", "mask_log_probs must hold real numbers, got dtype <U1"),
], ids=lambda v: None if isinstance(v, dict) else str(v))
def test_every_refusal_of_turn_build_is_a_protocol_error_naming_the_callers_field(kwargs, code, text):
    """docs/data-model.md: `Turn.build` refuses with the code a broker would
    answer, naming the field as the caller gave it."""
    given = {"tokens": [1], "log_probs": [-0.5], **kwargs}
    with pytest.raises(ProtocolError, match=text) as err:
        Turn.build(given.pop("tokens"), given.pop("log_probs"), **given)
    assert err.value.code == code


def test_full_log_probs_are_kept_as_log_probs_are():
    """Within the rounding tolerance above 0 they are taken, as log-probs
    are; a borrowed array of the contract dtype is the turn's own; without
    content checks only their alignment is checked."""
    assert Turn.build([1], [-0.5], full_log_probs=[2.0**-11]).full_log_probs.tolist() == [2.0**-11]
    borrowed = np.array([-0.25, -0.5], np.float32)
    tokens, log_probs = np.array([1, 2], np.int32), np.array([-0.5, -0.5], np.float32)
    assert Turn.build(tokens, log_probs, full_log_probs=borrowed, borrow=True).full_log_probs is borrowed
    assert Turn.build(tokens, log_probs, full_log_probs=[np.nan, 1.0], check_content=False).carries("full_log_probs")
    with pytest.raises(ProtocolError, match="full_log_probs has 1 entries, tokens has 2") as err:
        Turn.build(tokens, log_probs, full_log_probs=[-0.5], check_content=False)
    assert err.value.code == "misaligned"
    assert not Turn.build(tokens, log_probs).carries("full_log_probs")


def test_full_log_probs_merge_per_response_position_with_zero_at_forced_tokens():
    traj = Trajectory("t", [1])
    first, second = np.array([-0.25, -3.5], np.float32), np.array([-1.0e-7], np.float32)
    traj.append_turn(turn([10, 11], [[10, 4], [11]], forced=[20, 21], full_log_probs=first))
    traj.append_turn(turn([30], [[30]], forced=[22], full_log_probs=second))
    expected = np.concatenate([first, np.zeros(2, np.float32), second, np.zeros(1, np.float32)])
    assert traj.full_log_probs.dtype == np.float32 and traj.full_log_probs.tobytes() == expected.tobytes()
    assert traj.log_probs.tolist() == [-0.5, -0.5, 0.0, 0.0, -0.5, 0.0]
    assert traj.arrays()["full_log_probs"].tobytes() == expected.tobytes()
    assert traj.nbytes == sum(a.nbytes for a in traj.arrays().values())
    copy = Trajectory.from_arrays("t", traj.arrays(), status=traj.status, turns=traj.turns)
    assert copy.full_log_probs.tobytes() == expected.tobytes() and copy.carries("full_log_probs")
    traj.reward = 1.0
    back = trajectory_from_deliver(decode(encode_deliver(traj, "l"), BROKER_TO_CONSUMER))
    assert back.full_log_probs.tobytes() == expected.tobytes()
    traj.strip_last_output_tokens(2)
    assert traj.full_log_probs.tolist() == [-0.25, -3.5, 0.0, 0.0]
    traj.reset_for_retry()
    assert traj.full_log_probs is None and not traj.carries("full_log_probs")
    assert Trajectory("u", [1]).full_log_probs is None


def test_a_turn_without_full_log_probs_is_a_replay_gap_where_the_trajectory_carries_them():
    """Turn 0 decides, as for the mask: a later turn lacking them cuts the
    trajectory after the last turn's sampled tokens (also once shed)."""
    for shed in (False, True):
        traj = Trajectory("t", [1])
        traj.append_turn(turn([10, 11], forced=[20], full_log_probs=[-0.5, -0.75]))
        if shed:
            traj.shed()
        assert traj.append_turn(turn([12], forced=[21])) == TurnOutcome(False, "replay_gap")
        assert traj.gap == Gap(1, "full_log_probs") and traj.response_length == 2 and traj.terminal
        if not shed:
            assert traj.tokens.tolist() == [10, 11] and traj.full_log_probs.tolist() == [-0.5, -0.75]
            traj.validate()


def test_full_log_probs_missing_then_present_is_mask_presence_unless_the_response_is_empty():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10]))
    with pytest.raises(ProtocolError, match="turn 1 of 't' carries full_log_probs but the 1 response tokens") as err:
        traj.append_turn(turn([11], full_log_probs=[-0.5]))
    assert err.value.code == "mask_presence" and traj.turns == 1 and traj.full_log_probs is None
    late = Trajectory("u", [1])
    late.append_turn(turn([]))
    late.append_turn(turn([7], forced=[8], full_log_probs=[-0.5]))
    assert late.full_log_probs.tolist() == [-0.5, 0.0]
    with pytest.raises(ProtocolError, match="carries \\['full_log_probs'\\], 1 sampled tokens without them") as err:
        late.append_sampled(np.array([1], np.int32), np.array([-1.0], np.float32), None, None)
    assert err.value.code == "misaligned"


def test_example_11_mask_log_probs_merge_beside_the_ids_with_zero_for_forced_singletons():
    """docs/semantics.md §8 example 11, then the arrays' round trips,
    truncation and retry."""
    traj = Trajectory("t", [1])
    first, second = np.array([-0.1, -2.4], np.float32), np.array([-0.5, -0.9], np.float32)
    traj.append_turn(turn([10], [[10, 4]], forced=[20], mask_log_probs=first))
    traj.append_turn(turn([30], [[30, 7]], mask_log_probs=second))
    expected = np.array([-0.1, -2.4, 0.0, -0.5, -0.9], np.float32)
    assert traj.mask.ids.tolist() == [10, 4, 20, 30, 7]
    assert traj.mask_log_probs.dtype == np.float32 and traj.mask_log_probs.tobytes() == expected.tobytes()
    assert traj.arrays()["mask_log_probs"].tobytes() == expected.tobytes() and traj.carries("mask_log_probs")
    assert traj.nbytes == sum(a.nbytes for a in traj.arrays().values())
    copy = Trajectory.from_arrays("t", traj.arrays(), status=traj.status, turns=traj.turns)
    assert copy.mask_log_probs.tobytes() == expected.tobytes() and copy.carries("mask_log_probs")
    traj.reward = 1.0
    back = trajectory_from_deliver(decode(encode_deliver(traj, "l"), BROKER_TO_CONSUMER))
    assert back.mask_log_probs.tobytes() == expected.tobytes()
    traj.strip_last_output_tokens(1)
    assert traj.mask_log_probs.tolist() == pytest.approx([-0.1, -2.4, 0.0]) and traj.mask.ids.tolist() == [10, 4, 20]
    traj.validate()
    traj.reset_for_retry()
    assert traj.mask_log_probs is None and not traj.carries("mask_log_probs")
    assert Trajectory("u", [1]).mask_log_probs is None


def test_mask_log_probs_travel_in_the_turn_frame_with_the_renormalised_flag():
    sent = turn([10], [[10, 4]], mask_log_probs=np.log([0.75, 0.25]), mask_log_probs_normalized=True)
    got = turn_from_message(decode(encode_turn("t", 0, sent, seq=1, prompt_tokens=np.array([1], np.int32)),
                                   PRODUCER_TO_BROKER))
    assert got.mask_log_probs.tobytes() == sent.mask_log_probs.tobytes() and got.mask_log_probs.dtype == np.float32
    header = decode(encode_turn("t", 0, sent, seq=1, prompt_tokens=np.array([1], np.int32)), PRODUCER_TO_BROKER)
    assert header.get("mask_log_probs_normalized") is True
    plain = decode(encode_turn("t", 0, turn([10], [[10]]), seq=1, prompt_tokens=np.array([1], np.int32)),
                   PRODUCER_TO_BROKER)
    assert plain.get("mask_log_probs_normalized") is None and "mask_log_probs" not in plain.arrays


def test_mask_log_probs_summing_to_one_pass_the_sum_rule_within_the_tolerance():
    near = np.log(np.array([0.5, 0.25, 0.25 + 2.0**-12]))
    assert Turn.build([1], [-0.5], supports=[[1, 2, 3]], mask_log_probs=near,
                      mask_log_probs_normalized=True).mask_log_probs_normalized
    # Not said renormalised: any support-mass below 1 is taken (the sampler's log-probs under the whole distribution).
    assert Turn.build([1], [-0.5], supports=[[1, 2]], mask_log_probs=[-3.0, -4.0]).carries("mask_log_probs")


def test_a_turn_without_mask_log_probs_is_a_replay_gap_where_the_trajectory_carries_them():
    for shed in (False, True):
        traj = Trajectory("t", [1])
        traj.append_turn(turn([10], [[10, 4]], forced=[20], mask_log_probs=[-0.5, -1.5]))
        if shed:
            traj.shed()
        assert traj.append_turn(turn([12], [[12]], forced=[21])) == TurnOutcome(False, "replay_gap")
        assert traj.gap == Gap(1, "mask_log_probs") and traj.response_length == 1 and traj.terminal
        if not shed:
            assert traj.mask_log_probs.tolist() == [-0.5, -1.5] and traj.mask.ids.tolist() == [10, 4]
            traj.validate()


def test_mask_log_probs_missing_then_present_is_mask_presence_unless_the_response_is_empty():
    traj = Trajectory("t", [1])
    traj.append_turn(turn([10], [[10]]))
    with pytest.raises(ProtocolError, match="turn 1 of 't' carries mask_log_probs but the 1 response tokens") as err:
        traj.append_turn(turn([11], [[11]], mask_log_probs=[-0.5]))
    assert err.value.code == "mask_presence" and traj.turns == 1 and traj.mask_log_probs is None
    late = Trajectory("u", [1])
    late.append_turn(turn([]))
    late.append_turn(turn([7], [[7, 9]], forced=[8], mask_log_probs=[-0.5, -1.0]))
    assert late.mask_log_probs.tolist() == [-0.5, -1.0, 0.0]
    empty_mask = Trajectory("v", [1])  # an empty first turn with a mask but without them, still pending
    empty_mask.append_turn(turn([], []))
    empty_mask.append_turn(turn([5], [[5, 6]], mask_log_probs=[-0.5, -1.0]))
    assert empty_mask.mask_log_probs.tolist() == [-0.5, -1.0] and empty_mask.mask.ids.tolist() == [5, 6]
    empty_mask.validate()


def test_nbytes_counts_every_array_without_writing_queued_appends():
    traj = Trajectory("t", [1, 2, 3])
    traj.append_turn(turn([10, 11], [[10, 4], [11]], forced=[20]))
    traj.append_turn(turn([30], [[30, 7, 8]]))
    expected = 3 * 4 + 4 * 4 + 4 * 1 + 4 * 4 + 7 * 4 + 5 * 8  # prompt, tokens, loss, log-probs, ids, offsets
    assert traj.nbytes == expected
    assert len(traj._pending) == 2  # counting wrote nothing
    assert sum(a.nbytes for a in traj.arrays().values()) == expected


def test_pieces_carry_the_crcs_their_turns_arrived_with():
    """A turn decoded with a verified CRC for its support ids hands it on
    with the piece; a forced-token piece, a piece copied on append, or a
    buffer already written has none to hand on."""
    ids = [np.arange(i, 1000 + i, dtype=np.int32) for i in range(3)]
    offsets = np.arange(0, 1001, 100, dtype=np.int64)
    tokens = np.arange(0, 1000, 100, dtype=np.int32)

    def decoded(part, crc, forced=None):
        return Turn.build(tokens + part[0], np.full(10, -0.5, np.float32), mask_ids=part, mask_offsets=offsets,
                          forced_tokens=forced, borrow=True)._replace(mask_ids_crc32=crc)

    traj = Trajectory("t", [1])
    traj.append_turn(decoded(ids[0], 111, forced=[5]))
    traj.append_turn(decoded(ids[1], 222))
    pieces = traj.arrays(parts_from=1)["mask_ids"]
    assert [p.tolist()[:2] for p in pieces] == [[0, 1], [5], [1, 2]] and pieces.crcs == [111, None, 222]
    assert traj.arrays()["mask_ids"].size == 2001  # read whole: written
    assert type(traj.arrays(parts_from=1)["mask_ids"]) is np.ndarray  # one written buffer, its CRC unknown

    buffer = GrowableArray(np.int32)
    frozen = ids[0].copy()
    frozen.flags.writeable = False
    buffer.extend_many([frozen, ids[2]], crcs=[1, 2])  # the writable part is copied: its CRC is not kept
    assert buffer.parts().crcs == [1, None]
    buffer.extend(frozen)
    assert buffer.parts().crcs == [1, None, None]


def test_arrays_in_parts_are_the_turns_own_pieces_unjoined():
    ids = [np.arange(1000, dtype=np.int32) for _ in range(3)]
    offsets = np.arange(0, 1001, 100, dtype=np.int64)
    turns = [Turn.build(np.arange(0, 1000, 100, dtype=np.int32), np.full(10, -0.5, np.float32), mask_ids=part,
                        mask_offsets=offsets, borrow=True) for part in ids]
    traj = Trajectory("t", [1])
    for turn in turns:
        traj.append_turn(turn)
    split = traj.arrays(parts_from=4000)  # 4,000-byte pieces: mask_ids qualifies, the 40-byte token pieces do not
    assert isinstance(split["mask_ids"], list) and len(split["mask_ids"]) == 3
    assert all(np.shares_memory(piece, turn.mask.ids) for piece, turn in zip(split["mask_ids"], turns))
    assert type(split["tokens"]) is np.ndarray and type(split["mask_offsets"]) is np.ndarray
    assert type(traj.arrays(parts_from=4001)["mask_ids"]) is np.ndarray  # pieces smaller than asked: joined
    traj = Trajectory("t", [1])
    for turn in turns:
        traj.append_turn(turn)
    assert np.concatenate(split["mask_ids"]).tolist() == traj.arrays()["mask_ids"].tolist() == list(range(1000)) * 3
    assert type(traj.arrays(parts_from=4000)["mask_ids"]) is np.ndarray  # once joined, it is one array


def _in_turns(ids_per_turn: int, turns: int = 3) -> Trajectory:
    """A trajectory of `turns` frozen turns of 10 tokens whose supports hold `ids_per_turn` ids in all."""
    traj = Trajectory("t", [1])
    per = ids_per_turn // 10
    for _ in range(turns):
        ids = np.arange(ids_per_turn, dtype=np.int32)
        tokens = np.arange(0, ids_per_turn, per, dtype=np.int32)
        for array in (ids, tokens):
            array.flags.writeable = False
        traj.append_turn(Turn.build(tokens, np.full(10, -0.5, np.float32), mask_ids=ids,
                                    mask_offsets=np.arange(0, ids_per_turn + 1, per, dtype=np.int64), borrow=True))
    traj.reward = 1.0
    return traj


def test_a_delivery_is_packed_from_its_pieces_or_when_small_unless_they_travel_unjoined():
    # 3 turns of 40 KB of ids: 120 KB, over the 64 KiB packing size, but the pieces would be joined to go a frame each.
    frames = encode_deliver(_in_turns(10_000), "lease", may_pack=True, may_split=True)
    assert len(frames) == 2 and msgpack.unpackb(frames[0])["packed"] is True
    arrays = decode(frames, BROKER_TO_CONSUMER).arrays
    assert arrays["mask_ids"].tolist() == list(range(10_000)) * 3
    assert arrays["tokens"].tolist() == list(range(0, 10_000, 1000)) * 3
    assert arrays["mask_offsets"].tolist() == list(range(0, 30_001, 1000))
    traj = _in_turns(10_000)
    encode_deliver(traj, "lease", may_pack=True)
    assert isinstance(traj.arrays(parts_from=0)["mask_ids"], list), "packing left the trajectory's pieces unjoined"
    # A consumer that reads no packed deliveries: a frame per array.
    assert len(encode_deliver(_in_turns(10_000), "lease")) == 1 + 6
    # 400 KB pieces travel unjoined, a frame each (`may_split`); without it they are joined and packed.
    large = encode_deliver(_in_turns(100_000), "lease", may_pack=True, may_split=True)
    assert "packed" not in msgpack.unpackb(large[0]) and len(large) == 1 + 5 + 3
    assert decode(large, BROKER_TO_CONSUMER).arrays["mask_ids"].tolist() == list(range(100_000)) * 3
    assert len(encode_deliver(_in_turns(100_000), "lease", may_pack=True)) == 2
    # One turn: packed up to PACK_DELIVERY_UP_TO_BYTES in all (300 KB here), else its arrays as they arrived.
    assert len(encode_deliver(_in_turns(75_000, turns=1), "lease", may_pack=True, may_split=True)) == 2
    whole = encode_deliver(_in_turns(150_000, turns=1), "lease", may_pack=True, may_split=True)
    assert len(whole) == 1 + 6 and decode(whole, BROKER_TO_CONSUMER).arrays["mask_ids"].tolist() == list(range(150_000))


def _arrived(ids: int, *, pack: bool = False, loss_mask: bool = True, forced: bool = False, **replay) -> tuple:
    """A first turn of 10 tokens whose supports hold `ids` ids (and the
    `replay` arrays), as a broker decodes it (its arrays CRC'd, its prompt
    carried, packed when `pack` and `worth_packing` agree, or `pack="always"`,
    else a frame per array), and the trajectory it starts there."""
    per = ids // 10
    turn = Turn.build(np.arange(0, ids, per, dtype=np.int32), np.full(10, -0.5, np.float32),
                      mask_ids=np.arange(ids, dtype=np.int32), mask_offsets=np.arange(0, ids + 1, per, dtype=np.int64),
                      loss_mask=np.ones(10, np.uint8) if loss_mask else None,
                      forced_tokens=np.array([7], np.int32) if forced else None, **replay)
    with mock.patch("rollstream.common.wire.worth_packing", lambda arrays: True) if pack == "always" else nullcontext():
        frames = encode_turn("t", 0, turn, seq=1, prompt_tokens=np.array([1, 2], np.int32), crc=True, may_pack=bool(pack))
    message = decode(frames, PRODUCER_TO_BROKER)
    traj = Trajectory("t", message.arrays["prompt_tokens"])
    traj.append_turn(turn_from_message(message))
    traj.reward = 1.0
    return message, traj


def _delivered_arrays(frames: list) -> dict:
    return {name: array.tolist() for name, array in decode(frames, BROKER_TO_CONSUMER).arrays.items()}


@pytest.mark.parametrize("pack", [False, True])
def test_a_trajectory_one_message_brought_whole_is_delivered_in_the_frames_it_came_in(pack):
    # Packed (4 KB of ids), or a frame per array of more than PACK_DELIVERY_UP_TO_BYTES (600 KB of ids).
    message, traj = _arrived(150_000 if not pack else 1_000, pack=pack)
    frames = encode_deliver(traj, "lease", may_pack=True, may_split=True)
    assert len(frames) == len(message.frames) and all(sent is got for sent, got in zip(frames[1:], message.frames[1:]))
    header = msgpack.unpackb(frames[0])
    assert header["crc32"] == message.crc32 and header.get("packed", False) is pack
    # What the consumer reads is what the merge would have sent: the trajectory read the long way round.
    merged = Trajectory.from_arrays("t", traj.arrays(), status=traj.status, turns=1)
    merged.reward = 1.0
    assert traj.arrived_whole is None  # read: its turn is written into its arrays
    assert _delivered_arrays(frames) == _delivered_arrays(encode_deliver(merged, "lease", may_pack=True))


REPLAY_CHANGES = {"full log-probs": {"full_log_probs": np.full(10, -0.5, np.float32)},
                  "support log-probs": {"mask_log_probs": np.full(150_000, -10.0, np.float32)},
                  "routed experts": {"routed_experts": np.zeros((12, 2), np.int32)}}


@pytest.mark.parametrize("change", ["no loss mask", "forced tokens", "a second turn", "shed", "consumer reads no packing",
                                    "a frame per array of packing size", "packed over the packing size", *REPLAY_CHANGES])
def test_a_trajectory_its_message_does_not_hold_as_delivered_is_merged_as_before(change):
    message, traj = _arrived(20_000 if change == "a frame per array of packing size" else 150_000,
                             loss_mask=change != "no loss mask", forced=change == "forced tokens",
                             pack="always" if change == "packed over the packing size" else False,
                             **REPLAY_CHANGES.get(change, {}))
    if change == "a second turn":
        traj.append_turn(Turn.build(np.array([3], np.int32), np.array([-0.5], np.float32), mask_ids=np.array([3], np.int32),
                                    mask_offsets=np.array([0, 1], np.int64), loss_mask=np.ones(1, np.uint8)))
    if change == "shed":
        traj.shed()
        assert traj.arrived_whole is None
        return
    assert traj.arrived_whole is None or change in ("consumer reads no packing", "a frame per array of packing size",
                                                    "packed over the packing size")
    frames = encode_deliver(traj, "lease", may_pack=change != "consumer reads no packing", may_split=True)
    assert not any(sent is got for sent in frames[1:] for got in message.frames[1:])
    if change == "a frame per array of packing size":  # 80 KB of ids: one frame costs the consumer less
        assert len(frames) == 2 and msgpack.unpackb(frames[0])["packed"] is True
    arrays = _delivered_arrays(frames)
    assert arrays["prompt_tokens"] == [1, 2] and len(arrays["loss_mask"]) == len(arrays["tokens"])
    if change == "forced tokens":
        assert arrays["tokens"][-1] == 7 and arrays["loss_mask"][-1] == 0
    if change == "no loss mask":
        assert arrays["loss_mask"] == [1] * 10


@pytest.mark.parametrize("turns, damaged", [(1, "mask_ids"), (1, "mask_offsets"), (2, "mask_ids")])
def test_a_packed_delivery_combines_the_crcs_its_arrays_arrived_with(turns, damaged):
    """Arrays that arrived a frame each, their CRCs verified, go into a
    packed delivery under those CRCs, combined rather than read again
    (every such array of a trajectory one message brought whole, the
    support ids of several turns): bytes changed between arrival and
    delivery are caught where it is decoded."""
    tokens = np.arange(10_000, dtype=np.int32)  # 80 KB of offsets and of ids: each keeps its own CRC on arrival
    turn = Turn.build(tokens, np.full(10_000, -0.5, np.float32), mask_ids=np.repeat(tokens, 2),
                      mask_offsets=np.arange(0, 20_001, 2, dtype=np.int64), loss_mask=np.ones(10_000, np.uint8))
    traj, kept = None, {}
    for index in range(turns):
        frames = encode_turn("t", index, turn, seq=index + 1, crc=True,
                             prompt_tokens=np.array([1, 2], np.int32) if index == 0 else None)
        names = [entry[0] for entry in msgpack.unpackb(frames[0])["arrays"]]
        for name in ("mask_ids", "mask_offsets"):
            kept[name] = frames[1 + names.index(name)] = bytearray(frames[1 + names.index(name)])
        message = decode(frames, PRODUCER_TO_BROKER)
        assert {"mask_ids", "mask_offsets"} <= set(message.array_crcs)
        traj = traj or Trajectory("t", message.arrays["prompt_tokens"])
        traj.append_turn(turn_from_message(message))
    traj.reward = 1.0
    assert set(traj.merged_crcs()) == ({"mask_ids", "mask_offsets"} if turns == 1 else {"mask_ids"})
    frames = encode_deliver(traj, "lease", may_pack=True, may_split=True)
    assert len(frames) == 2 and msgpack.unpackb(frames[0])["crc32"] == zlib.crc32(frames[1])
    assert _delivered_arrays(frames)["mask_ids"] == np.repeat(tokens, 2).tolist() * turns

    kept[damaged][8:12] = (3).to_bytes(4, "little")  # a changed id or offset after its CRC was verified
    damaged_frames = encode_deliver(traj, "lease", may_pack=True, may_split=True)
    with pytest.raises(ProtocolError) as caught:
        decode(damaged_frames, BROKER_TO_CONSUMER)
    assert caught.value.code == "crc_mismatch"


def test_a_delivery_reads_the_crc_of_ids_whose_arrival_crc_does_not_cover_them():
    """Forced tokens' singletons among the ids, or ids that came packed (no
    CRC of their own): the delivery's CRC is read over the bytes sent."""
    for forced in (False, True):
        message, traj = _arrived(1_000, pack=not forced, forced=forced)
        traj.append_turn(Turn.build(np.array([3], np.int32), np.array([-0.5], np.float32),
                                    mask_ids=np.array([3], np.int32), mask_offsets=np.array([0, 1], np.int64)))
        assert traj.merged_crcs() == {}
        frames = encode_deliver(traj, "lease", may_pack=True)
        assert msgpack.unpackb(frames[0])["crc32"] == zlib.crc32(frames[1])


@pytest.fixture
def pair():
    """Two connected sockets: what one sends the other receives as a broker does, a frame per part."""
    context = zmq.Context()
    a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    a.bind("inproc://trajectory-tests")
    b.connect("inproc://trajectory-tests")
    yield a, b
    context.destroy(linger=0)


def test_a_frame_forwarded_whole_goes_by_reference_and_a_part_of_one_is_copied(pair):
    a, b = pair
    a.send(bytes(range(256)) * 100)
    received = b.recv(copy=False)
    view = received.buffer
    whole, part = np.frombuffer(view, np.int32), np.frombuffer(view, np.int32, 10, 4)  # arrays decoding makes
    with mock.patch("rollstream.common.sockets._send_part", wraps=sockets._send_part) as sent:
        sockets.send_frames(b, [view, view[1:], whole.data.cast("B"), part.data.cast("B")])
    assert sent.call_args_list[0].args[1] is received  # the frame itself: ZeroMQ shares its bytes
    assert type(sent.call_args_list[1].args[1]) is memoryview  # a part of one: copied
    assert sent.call_args_list[2].args[1] is received  # an array over all of it: the frame
    assert type(sent.call_args_list[3].args[1]) is memoryview
    data = bytes(range(256)) * 100
    assert a.recv_multipart() == [data, data[1:], data, data[4:44]]


def test_the_pieces_a_delivery_sends_unjoined_are_the_frames_its_turns_came_in(pair):
    a, b = pair
    traj, came_in = None, []
    for index in range(2):  # two turns of 280 KB of ids each: over SPLIT_FROM_BYTES, they travel unjoined
        turn = Turn.build(np.arange(0, 70_000, 7_000, dtype=np.int32), np.full(10, -0.5, np.float32),
                          mask_ids=np.arange(70_000, dtype=np.int32),
                          mask_offsets=np.arange(0, 70_001, 7_000, dtype=np.int64), loss_mask=np.ones(10, np.uint8))
        a.send_multipart(encode_turn("t", index, turn, seq=index + 1, crc=True,
                                     prompt_tokens=np.array([1, 2], np.int32) if index == 0 else None))
        message = decode(sockets.recv_parts(b, 0), PRODUCER_TO_BROKER)
        traj = traj or Trajectory("t", message.arrays["prompt_tokens"])
        traj.append_turn(turn_from_message(message))
        came_in.append(message.arrays["mask_ids"].base.obj)  # the received frame its ids are a view of
    traj.reward = 1.0
    frames = encode_deliver(traj, "lease", may_pack=True, may_split=True)
    forwarded = [sockets._whole_received(frame) for frame in frames[1:] if type(frame) is memoryview]
    assert all(any(frame is received for frame in forwarded) for received in came_in)
    assert decode(frames, BROKER_TO_CONSUMER).arrays["mask_ids"].tolist() == list(range(70_000)) * 2
