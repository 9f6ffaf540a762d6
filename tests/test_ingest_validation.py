"""SGLang ingest and whole-batch validation helpers."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.common import BatchValidationError, ProtocolError, SamplingMask, Trajectory
from rollstream.common.contract import LOG_PROB_TOLERANCE
from rollstream.common.ingest import turn_from_sglang
from rollstream.common.trajectory import Gap
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


def test_sglang_weight_version_spans_become_the_turns_spans_its_first_version_the_turns():
    """SGLang names the newest version `weight_version` and places each over
    output tokens in `weight_versions`; a rollstream turn's version is its
    first span's, and an empty span (SGLang keeps one at 0) is left out."""
    m = {**meta([[5], [6], [7]], [-0.1, -0.2, -0.3]), "weight_version": "13",
         "weight_versions": [{"version": "12", "start": 0, "end": 2}, {"version": "13", "start": 2, "end": 3}]}
    turn = turn_from_sglang([5, 6, 7], m)
    assert (turn.weight_version, turn.weight_version_spans) == ("12", (("12", 0, 2), ("13", 2, 3)))
    one = {**m, "weight_versions": [{"version": "13", "start": 0, "end": 3}]}
    assert (turn_from_sglang([5, 6, 7], one).weight_version, turn_from_sglang([5, 6, 7], one).weight_version_spans) == \
        ("13", None)  # one version over the whole turn: the turn's own, no spans
    empty = {**meta([], [], "abort"), "weight_version": "13", "weight_versions": [{"version": "13", "start": 0, "end": 0}]}
    assert turn_from_sglang([], empty, require_mask=False).weight_version == "13"
    with pytest.raises(ProtocolError) as bad:
        turn_from_sglang([5, 6, 7], {**m, "weight_versions": [["12", 0]]})
    assert bad.value.code == "schema" and "meta_info.weight_versions is a list of {version, start, end}" in str(bad.value)
    with pytest.raises(ProtocolError) as beyond:  # spans past the sampled tokens
        turn_from_sglang([5, 6, 7], {**m, "weight_versions": [{"version": "12", "start": 0, "end": 5}]})
    assert beyond.value.code == "misaligned"


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
    """docs/semantics.md example 7 straight from an engine abort: no workaround flags."""
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
    "token 1000": lambda a: a.__setitem__(
        "tokens", np.where(np.arange(len(a["tokens"])) == 0, 1000, a["tokens"]).astype(np.int32)),
    "negative forced token": lambda a: a.__setitem__("forced_tokens", np.array([-1], np.int32)),
    "loss mask 2": lambda a: a.__setitem__("loss_mask", np.full(len(a["tokens"]), 2, np.uint8)),
    "nan log prob": lambda a: a.__setitem__("log_probs", np.full(len(a["tokens"]), np.nan, np.float32)),
    "+0.5 log prob": lambda a: a.__setitem__("log_probs", np.full(len(a["tokens"]), 0.5, np.float32)),
    "-inf log prob": lambda a: a.__setitem__("log_probs", np.full(len(a["tokens"]), -np.inf, np.float32)),
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


def _reference_valid(arrays, vocab_size):
    """Every content rule of one message, token by token in plain Python."""
    tokens = arrays["tokens"].tolist()
    n = len(tokens)
    if any(len(arrays[name]) != n for name in ("log_probs", "loss_mask") if name in arrays):
        return False
    if any(value not in (0, 1) for value in arrays.get("loss_mask", np.zeros(0)).tolist()):
        return False
    if not all(-np.inf < value <= LOG_PROB_TOLERANCE for value in arrays.get("log_probs", np.zeros(0)).tolist()):
        return False
    in_vocab = lambda values: all(0 <= value < vocab_size for value in values)  # noqa: E731
    if not all(in_vocab(arrays[name].tolist()) for name in ("prompt_tokens", "forced_tokens") if name in arrays):
        return False
    if "mask_offsets" not in arrays:
        return in_vocab(tokens)
    ids, offsets = arrays["mask_ids"].tolist(), arrays["mask_offsets"].tolist()
    if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != len(ids):
        return False
    supports = [ids[offsets[i]:offsets[i + 1]] for i in range(n)]
    if any(offsets[i + 1] <= offsets[i] for i in range(n)):
        return False
    return all(token in support for token, support in zip(tokens, supports)) and in_vocab(ids)


def _break_rule(arrays, rule, vocab):
    """One content rule broken in a valid message (those that have the field to break)."""
    n = len(arrays["tokens"])
    masked = "mask_offsets" in arrays
    if rule == "empty support" and masked and n:
        offsets = arrays["mask_offsets"].copy()
        offsets[1] = 0  # the first support is empty; its ids go to the next
        arrays["mask_offsets"] = offsets
    elif rule == "token outside its support" and n:
        tokens = arrays["tokens"].copy()
        tokens[-1] = vocab - 1 if not masked else next(
            (t for t in range(vocab) if t not in arrays["mask_ids"][arrays["mask_offsets"][-2]:].tolist()), vocab)
        arrays["tokens"] = tokens
    elif rule == "id outside the vocabulary" and masked and n:
        ids = arrays["mask_ids"].copy()
        ids[0] = -1 if ids[0] else vocab
        arrays["mask_ids"] = ids
    elif rule == "loss mask 2" and n:
        arrays["loss_mask"] = np.full(n, 2, np.uint8)
    elif rule == "NaN log-prob" and n:
        arrays["log_probs"] = np.where(np.arange(n) == n - 1, np.nan, arrays["log_probs"]).astype(np.float32)
    elif rule == "+inf log-prob" and n:
        arrays["log_probs"] = np.full(n, np.inf, np.float32)
    elif rule == "-inf log-prob" and n:
        arrays["log_probs"] = np.where(np.arange(n) == 0, -np.inf, arrays["log_probs"]).astype(np.float32)
    elif rule == "+0.5 log-prob" and n:
        arrays["log_probs"] = np.where(np.arange(n) == n - 1, 0.5, arrays["log_probs"]).astype(np.float32)
    elif rule == "forced token -1":
        arrays["forced_tokens"] = np.array([-1], np.int32)
    elif rule == "log-probs one short" and n:
        arrays["log_probs"] = arrays["log_probs"][:-1]


_RULES_TO_BREAK = ["empty support", "token outside its support", "id outside the vocabulary", "loss mask 2",
                   "NaN log-prob", "+inf log-prob", "-inf log-prob", "+0.5 log-prob", "forced token -1",
                   "log-probs one short"]


@st.composite
def _content_batches(draw):
    """Batches of small valid messages (supports with repeated ids, ids at
    the vocabulary's edges, log-probs a rounding above 0), each one
    possibly made to break one content rule."""
    vocab = 8
    messages = []
    for _ in range(draw(st.integers(1, 7))):
        n = draw(st.integers(0, 4))
        supports = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3)) for _ in range(n)]
        log_probs = st.sampled_from([-0.5, 0.0, 1e-6, LOG_PROB_TOLERANCE])
        arrays = {"tokens": np.array([draw(st.sampled_from(support)) for support in supports], np.int32),
                  "log_probs": np.array(draw(st.lists(log_probs, min_size=n, max_size=n)), np.float32),
                  "loss_mask": np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), np.uint8)}
        if draw(st.booleans()):
            mask = SamplingMask.from_supports(supports)
            arrays["mask_ids"], arrays["mask_offsets"] = np.array(mask.ids), np.array(mask.offsets)
        if draw(st.booleans()):
            arrays["forced_tokens"] = np.array(draw(st.lists(st.integers(0, vocab - 1), max_size=2)), np.int32)
        if draw(st.integers(0, 3)) == 0:
            _break_rule(arrays, draw(st.sampled_from(_RULES_TO_BREAK)), vocab)
        messages.append(arrays)
    return vocab, messages


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(_content_batches(), st.integers(1, 6))
def test_batched_content_check_accepts_exactly_what_the_rules_accept(case, group_ids):
    """Any batch, checked in groups of any size (small groups put messages
    of one batch in several), is valid exactly when each message is."""
    from rollstream.common import validation

    vocab, batch = case
    expected = all(_reference_valid(arrays, vocab) for arrays in batch)
    original = validation._GROUP_IDS
    validation._GROUP_IDS = group_ids
    try:
        assert validation.messages_content_valid(batch, vocab_size=vocab) == expected
    finally:
        validation._GROUP_IDS = original
    assert validation.messages_content_valid(batch, vocab_size=vocab) == expected
