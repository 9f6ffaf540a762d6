"""SGLang ingest and whole-batch validation helpers."""
import numpy as np
import pytest

from rollstream.common import BatchValidationError, ProtocolError, SamplingMask, Trajectory
from rollstream.common.trajectory import Gap
from rollstream.common.ingest import turn_from_sglang
from rollstream.common.validation import (
    RULE_ALIGNED,
    RULE_IN_SUPPORT,
    RULE_LOSS_MASK,
    RULE_MASK_VOCAB,
    RULE_NONEMPTY_SUPPORT,
    RULE_TOKEN_VOCAB,
    packed_violations,
    validate_samples,
)


def meta(supports, log_probs, finish="stop"):
    return {
        "output_token_sampling_mask": supports,
        "output_token_sampling_logprobs": log_probs,
        "finish_reason": {"type": finish},
    }


def test_sglang_response_becomes_a_turn():
    turn = turn_from_sglang([5, 9], meta([[5, 1], [9]], [-0.1, -0.2], "length"), forced_tokens=[3])
    assert turn.mask == SamplingMask.from_supports([[5, 1], [9]])
    assert turn.status == "truncated" and turn.forced_tokens.tolist() == [3]
    assert turn.log_probs.dtype == np.float32


@pytest.mark.parametrize(
    "tokens, m, code",
    [
        ([5, 9], meta([[5]], [-0.1, -0.2]), "misaligned"),
        ([5], meta([[5]], [-0.1, -0.2]), "misaligned"),
        ([5], meta([[6, 7]], [-0.1]), "mask_invalid"),
        ([5], meta([[]], [-0.1]), None),
    ],
)
def test_sglang_ingest_refusals(tokens, m, code):
    with pytest.raises(ValueError) as err:
        turn_from_sglang(tokens, m)
    if code:
        assert isinstance(err.value, ProtocolError) and err.value.code == code


def test_sglang_without_mask():
    with pytest.raises(ProtocolError):
        turn_from_sglang([5], {"output_token_sampling_logprobs": [-0.1]})
    turn = turn_from_sglang([5], {"output_token_sampling_logprobs": [-0.1]}, require_mask=False)
    assert turn.mask is None and turn.status == "completed"


def test_an_sglang_abort_without_tokens_supports_or_log_probs_is_an_aborted_turn_without_mask():
    """SEMANTICS.md example 7 straight from an engine abort: no workaround flags."""
    abort = turn_from_sglang([], {"finish_reason": {"type": "abort", "message": "client disconnected"}})
    assert (abort.status, abort.mask, len(abort.tokens), len(abort.log_probs)) == ("aborted", None, 0, 0)
    traj = Trajectory("t", [1])
    traj.append_turn(turn_from_sglang([5], meta([[5, 6]], [-0.1]), forced_tokens=[9]))
    outcome = traj.append_turn(abort)
    assert (outcome.applied, outcome.reason) == (False, "replay_gap")
    assert traj.gap == Gap(1, "mask") and traj.tokens.tolist() == [5]  # turn 0 alone, its forced token dropped
    with pytest.raises(ProtocolError, match="no output_token_sampling_logprobs for its 1 sampled tokens"):
        turn_from_sglang([5], {"finish_reason": {"type": "abort"}})  # tokens need their log-probs
    with pytest.raises(ProtocolError, match="request it with return_sampling_mask"):
        turn_from_sglang([5], {"output_token_sampling_logprobs": [-0.1], "finish_reason": {"type": "stop"}})


def test_sglang_vocab_and_finish_reason():
    with pytest.raises(ProtocolError) as err:
        turn_from_sglang([5], meta([[5, 200]], [-0.1]), vocab_size=100)
    assert err.value.code == "out_of_vocab"
    with pytest.raises(ValueError, match="finish_reason"):
        turn_from_sglang([5], meta([[5]], [-0.1], "exploded"))
    assert turn_from_sglang([5], meta([[5]], [-0.1], "abort")).status == "aborted"


def batch():
    masks = [SamplingMask.from_supports([[1, 2], [3]]), SamplingMask.from_supports([[4], [5, 6], [7]])]
    tokens = [np.array([2, 3], np.int32), np.array([4, 5, 7], np.int32)]
    return tokens, [(m.ids, m.offsets) for m in masks]


def test_valid_batch_passes():
    tokens, masks = batch()
    validate_samples(tokens, masks, vocab_size=8)
    assert packed_violations(np.concatenate(tokens), [2, 3], np.array([1, 2, 3, 4, 5, 6, 7], np.int32),
                             np.array([0, 2, 3, 4, 6, 7], np.int64)) == []


def test_violations_name_sample_position_and_rule():
    tokens, masks = batch()
    tokens[1] = np.array([4, 9, 7], np.int32)
    with pytest.raises(BatchValidationError) as err:
        validate_samples(tokens, masks, names=["a", "b"], vocab_size=8)
    found = {(v.rule, v.sample, v.position) for v in err.value.violations}
    assert found == {(RULE_IN_SUPPORT, 1, 1), (RULE_TOKEN_VOCAB, 1, 1)}
    assert "(b)" in str(err.value) and "token 1" in str(err.value)


def test_every_failing_sample_is_named():
    tokens, masks = batch()
    tokens = [np.array([9, 3], np.int32), np.array([4, 5, 9], np.int32)]
    with pytest.raises(BatchValidationError) as err:
        validate_samples(tokens, masks)
    assert [(v.sample, v.position) for v in err.value.violations if v.rule == RULE_IN_SUPPORT] == [(0, 0), (1, 2)]


def test_alignment_and_csr_violations():
    tokens, masks = batch()
    with pytest.raises(BatchValidationError) as err:
        validate_samples([tokens[0][:1], tokens[1]], masks)
    assert err.value.violations[0].rule == RULE_ALIGNED and err.value.violations[0].sample == 0
    broken = (np.array([4, 5, 6, 7], np.int32), np.array([0, 1, 1, 4], np.int64))
    with pytest.raises(BatchValidationError) as err:
        validate_samples([tokens[0], np.array([4, 5, 7], np.int32)], [masks[0], broken])
    v = err.value.violations[0]
    assert (v.rule, v.sample, v.position) == (RULE_NONEMPTY_SUPPORT, 1, 1)


def test_mask_vocab_and_loss_mask():
    tokens, masks = batch()
    with pytest.raises(BatchValidationError) as err:
        validate_samples(tokens, masks, vocab_size=7, loss_masks=[np.array([1, 3], np.uint8), np.array([1, 0, 1], np.uint8)])
    rules = {(v.rule, v.sample, v.position) for v in err.value.violations}
    assert (RULE_MASK_VOCAB, 1, 2) in rules and (RULE_TOKEN_VOCAB, 1, 2) in rules and (RULE_LOSS_MASK, 0, 1) in rules


def test_validation_runs_on_torch_tensors():
    torch = pytest.importorskip("torch")
    tokens, masks = batch()
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 3, 4, 6, 7])
    good = torch.tensor([2, 3, 4, 5, 7], dtype=torch.int32)
    assert packed_violations(good, torch.tensor([2, 3]), ids, offsets) == []
    bad = torch.tensor([2, 3, 4, 9, 7], dtype=torch.int32)
    found = packed_violations(bad, torch.tensor([2, 3]), ids, offsets, vocab_size=8)
    assert {(v.rule, v.sample, v.position) for v in found} == {(RULE_IN_SUPPORT, 1, 1), (RULE_TOKEN_VOCAB, 1, 1)}


def _turn_arrays(seed, masked=True):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 20))
    supports = [list(rng.integers(0, 50, size=int(rng.integers(1, 5)))) for _ in range(n)]
    arrays = {
        "tokens": np.array([s[-1] for s in supports], np.int32),
        "log_probs": -rng.random(n).astype(np.float32),
        "loss_mask": np.ones(n, np.uint8),
        "forced_tokens": rng.integers(0, 50, size=3).astype(np.int32),
    }
    if masked:
        mask = SamplingMask.from_supports(supports)
        arrays["mask_ids"], arrays["mask_offsets"] = mask.ids, mask.offsets
    return arrays


CORRUPTIONS = {
    # outside its support when masked, outside the vocabulary either way
    "token 1000": lambda a: a.__setitem__("tokens", np.where(np.arange(len(a["tokens"])) == 0, 1000, a["tokens"]).astype(np.int32)),
    "negative forced token": lambda a: a.__setitem__("forced_tokens", np.array([-1], np.int32)),
    "loss mask 2": lambda a: a.__setitem__("loss_mask", np.full(len(a["tokens"]), 2, np.uint8)),
    "nan log prob": lambda a: a.__setitem__("log_probs", np.full(len(a["tokens"]), np.nan, np.float32)),
    "short log probs": lambda a: a.__setitem__("log_probs", a["log_probs"][:-1]),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.parametrize("victim", [0, 3, 5])
def test_batched_content_check_agrees_with_the_per_message_check(corruption, victim):
    from rollstream.common.validation import check_message_arrays, messages_content_valid

    batch = [_turn_arrays(seed, masked=seed % 2 == 0) for seed in range(6)]
    assert messages_content_valid(batch, vocab_size=1000)
    CORRUPTIONS[corruption](batch[victim])
    assert not messages_content_valid(batch, vocab_size=1000)
    for i, arrays in enumerate(batch):
        if i == victim:
            with pytest.raises(ProtocolError):
                check_message_arrays(arrays, vocab_size=1000)
        else:
            check_message_arrays(arrays, vocab_size=1000)


def test_batched_content_check_honours_the_vocabulary():
    from rollstream.common.validation import messages_content_valid

    batch = [_turn_arrays(1), _turn_arrays(2, masked=False)]
    assert messages_content_valid(batch, vocab_size=50)
    assert not messages_content_valid(batch, vocab_size=10)
