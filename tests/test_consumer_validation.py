"""Batch validation: every kind of corruption of a valid batch is caught and
names the right trajectory, position and rule; valid batches pass. Runs the
shared checks both on numpy views (the CPU path) and as torch ops (the path
a GPU takes)."""
import re

import numpy as np
import pytest
import torch
from consumer_helpers import VOCAB, deliveries, delivery, make_rollout, writable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollstream.common import validation as validation_module
from rollstream.common.mask import SamplingMask
from rollstream.common.trajectory import Trajectory, Turn
from rollstream.common.validation import (
    LOG_PROB_RULES,
    RULE_ALIGNED,
    RULE_FORCED_SINGLETON,
    RULE_IN_SUPPORT,
    RULE_LOG_PROBS,
    RULE_LOSS_MASK,
    RULE_MASK_VOCAB,
    RULE_NONEMPTY_SUPPORT,
    RULE_OFFSETS_END,
    RULE_OFFSETS_START,
    RULE_SUPPORT_ALIGNED,
    RULE_TOKEN_VOCAB,
    RULE_WHOLE_BATCH,
    BatchValidationError,
)
from rollstream.consumer import Batch, checked_batch, validate_batch
from rollstream.consumer import validate as validate_module


@pytest.fixture(params=["numpy", "torch"])
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(validate_module, "_on_device_array", lambda tensor: tensor)
    return request.param


def _with_support(d, p, support):
    """Replace token p's support in a delivery's CSR (its support log-probs too, when it carries them: -1.0 each)."""
    ids, offsets = d.arrays["mask_ids"], d.arrays["mask_offsets"]
    lo, hi = offsets[p], offsets[p + 1]
    new_ids = np.concatenate([ids[:lo], np.asarray(support, np.int32), ids[hi:]]).astype(np.int32)
    new_offsets = offsets.copy()
    new_offsets[p + 1 :] += len(support) - (hi - lo)
    beside = {}
    if "mask_log_probs" in d.arrays:
        values = d.arrays["mask_log_probs"]
        beside["mask_log_probs"] = np.concatenate([values[:lo], np.full(len(support), -1.0, np.float32), values[hi:]])
    return writable(d, mask_ids=new_ids, mask_offsets=new_offsets, **beside)


def corrupt(kind, d, draw):
    """`(corrupted delivery, expected rule, expected position)`."""
    a = d.arrays
    n = len(a["tokens"])
    p = draw(st.integers(0, n - 1))
    offsets = a["mask_offsets"]
    support = a["mask_ids"][offsets[p] : offsets[p + 1]]
    if kind == "token_outside_support":
        choices = sorted(set(range(VOCAB)) - set(support.tolist()))
        tokens = np.array(a["tokens"])
        tokens[p] = choices[draw(st.integers(0, len(choices) - 1))]
        return writable(d, tokens=tokens), RULE_IN_SUPPORT, p
    if kind == "mask_id_out_of_vocab":
        bad = draw(st.sampled_from([-1, -(2**31), VOCAB, VOCAB + 7, 2**31 - 1]))
        return _with_support(d, p, [*support.tolist(), bad]), RULE_MASK_VOCAB, p
    if kind == "token_out_of_vocab":
        tokens = np.array(a["tokens"])
        tokens[p] = draw(st.sampled_from([-3, VOCAB, VOCAB * 10]))
        return writable(d, tokens=tokens), RULE_TOKEN_VOCAB, p
    if kind == "loss_mask_value":
        loss = np.array(a["loss_mask"])
        loss[p] = draw(st.integers(2, 255))
        return writable(d, loss_mask=loss), RULE_LOSS_MASK, p
    if kind == "empty_support":
        return _with_support(d, p, []), RULE_NONEMPTY_SUPPORT, p
    if kind == "log_prob_value":
        log_probs = np.array(a["log_probs"])
        log_probs[p] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 0.5]))
        return writable(d, log_probs=log_probs), RULE_LOG_PROBS, p
    if kind == "forced_not_singleton":
        loss, log_probs = np.array(a["loss_mask"]), np.array(a["log_probs"])
        loss[p], log_probs[p] = 0, 0.0
        widened = _with_support(d, p, [*support.tolist(), (int(a["tokens"][p]) + 1) % VOCAB])
        return writable(widened, loss_mask=loss, log_probs=log_probs), RULE_FORCED_SINGLETON, p
    if kind == "offsets_start":
        shifted = np.array(offsets)
        shifted[0] = draw(st.integers(1, 3))
        return writable(d, mask_offsets=shifted), RULE_OFFSETS_START, None
    if kind == "offsets_end":  # one id short (and its log-prob: the offsets alone are wrong)
        beside = {"mask_log_probs": np.array(a["mask_log_probs"][:-1])} if "mask_log_probs" in a else {}
        return writable(d, mask_ids=np.array(a["mask_ids"][:-1]), **beside), RULE_OFFSETS_END, None
    if kind == "misaligned":
        name = draw(st.sampled_from([name for name in ("loss_mask", "log_probs", "mask_offsets", "full_log_probs")
                                     if name in a]))
        return writable(d, **{name: np.array(a[name][:-1])}), RULE_ALIGNED, None
    if kind == "full_log_prob_value":
        full = np.array(a["full_log_probs"])
        full[p] = draw(st.sampled_from([np.nan, np.inf, -np.inf, 0.5]))
        return writable(d, full_log_probs=full), LOG_PROB_RULES["full_log_probs"], p
    if kind == "missing_full_log_probs":
        stripped = {k: v for k, v in a.items() if k != "full_log_probs"}
        return type(d)(d.trajectory_id, d.fields, stripped, d.broker, d.leases), RULE_WHOLE_BATCH, None
    if kind == "mask_log_prob_value":  # one entry of token p's support: the rule names token p
        values = np.array(a["mask_log_probs"])
        values[draw(st.integers(int(offsets[p]), int(offsets[p + 1]) - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf, 0.5]))
        return writable(d, mask_log_probs=values), LOG_PROB_RULES["mask_log_probs"], p
    if kind == "mask_log_probs_misaligned":
        cut = draw(st.integers(1, len(a["mask_log_probs"])))
        return writable(d, mask_log_probs=np.array(a["mask_log_probs"][:-cut])), RULE_SUPPORT_ALIGNED, None
    if kind == "missing_mask_log_probs":
        stripped = {k: v for k, v in a.items() if k != "mask_log_probs"}
        return type(d)(d.trajectory_id, d.fields, stripped, d.broker, d.leases), RULE_WHOLE_BATCH, None
    if kind == "prompt_out_of_vocab":
        prompt = np.array(a["prompt_tokens"])
        prompt[draw(st.integers(0, len(prompt) - 1))] = VOCAB + 1
        return writable(d, prompt_tokens=prompt), RULE_TOKEN_VOCAB, None
    if kind == "missing_mask":
        stripped = {k: v for k, v in a.items() if k not in ("mask_ids", "mask_offsets", "mask_log_probs")}
        return type(d)(d.trajectory_id, d.fields, stripped, d.broker, d.leases), RULE_WHOLE_BATCH, None
    raise AssertionError(kind)


KINDS = [
    "token_outside_support", "mask_id_out_of_vocab", "token_out_of_vocab", "loss_mask_value", "empty_support",
    "log_prob_value", "forced_not_singleton", "offsets_start", "offsets_end", "misaligned", "prompt_out_of_vocab",
    "missing_mask", "full_log_prob_value", "missing_full_log_probs", "mask_log_prob_value", "mask_log_probs_misaligned",
    "missing_mask_log_probs",
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(2, 6), kind=st.sampled_from(KINDS), data=st.data())
def test_every_corruption_is_caught_with_trajectory_and_position(backend, seed, size, kind, data):
    """On batches carrying `full_log_probs` and `mask_log_probs` as well (every sample, as the whole-batch rule has it)."""
    batch = deliveries(np.random.default_rng(seed), size, full=True, mask_log_probs=True)
    victim = data.draw(st.integers(0, size - 1))
    batch[victim], rule, position = corrupt(kind, batch[victim], data.draw)
    _, found, packed = checked_batch(batch, vocab_size=VOCAB)
    assert {v.sample for v in found} == {victim}, found
    assert any(v.rule == rule and v.position == position for v in found), (rule, position, found)
    error = BatchValidationError(found, [d.trajectory_id for d in batch])
    assert batch[victim].trajectory_id in str(error) and rule in str(error)


# The corruptions a batch without `full_log_probs` and `mask_log_probs` can carry (packing checks a batch with them
# too: the test above runs on such batches).
PLAIN_KINDS = [
    "token_outside_support", "mask_id_out_of_vocab", "token_out_of_vocab", "loss_mask_value", "empty_support",
    "log_prob_value", "forced_not_singleton", "offsets_start", "offsets_end", "misaligned", "prompt_out_of_vocab",
    "missing_mask",
]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(2, 6), kind=st.sampled_from(PLAIN_KINDS), data=st.data())
def test_every_corruption_of_a_batch_packing_checks_is_caught_with_trajectory_and_position(seed, size, kind, data):
    batch = deliveries(np.random.default_rng(seed), size)
    victim = data.draw(st.integers(0, size - 1))
    batch[victim], rule, position = corrupt(kind, batch[victim], data.draw)
    _, found, packed = checked_batch(batch, vocab_size=VOCAB)
    assert {v.sample for v in found} == {victim}, found
    assert any(v.rule == rule and v.position == position for v in found), (rule, position, found)


@pytest.mark.parametrize("mask", [True, False])
def test_packing_on_the_cpu_checks_a_plain_batch_itself_and_packs_it_as_from_deliveries_does(mask):
    """What spares the packed batch's check, and only where packing saw the
    rules kept: a token past the vocabulary is seen; a batch carrying
    log-probs beside `log_probs` is packed and checked the same way."""
    batch = deliveries(np.random.default_rng(8), 4, mask=mask)
    packed, seen_valid = Batch.checked_from_deliveries(batch, vocab_size=VOCAB)
    assert seen_valid is (validation_module._native is not None)
    plain = Batch.from_deliveries(batch)
    for name in ("tokens", "response_tokens", "loss_mask", "log_probs", "mask_ids", "mask_offsets"):
        got, expected = getattr(packed, name), getattr(plain, name)
        assert (got is None and expected is None) or (got.dtype == expected.dtype and torch.equal(got, expected)), name
    tokens = np.array(batch[2].arrays["tokens"])
    tokens[1] = VOCAB + 1
    broken = [*batch[:2], writable(batch[2], tokens=tokens), batch[3]]
    assert Batch.checked_from_deliveries(broken, vocab_size=VOCAB)[1] is False
    full = deliveries(np.random.default_rng(8), 4, mask=mask, full=True, mask_log_probs=mask)
    packed, seen_valid = Batch.checked_from_deliveries(full, vocab_size=VOCAB)
    assert seen_valid is (validation_module._native is not None)
    plain = Batch.from_deliveries(full)
    for name in ("full_log_probs", "mask_log_probs"):
        got, expected = getattr(packed, name), getattr(plain, name)
        assert (got is None and expected is None) or torch.equal(got, expected), name


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(1, 6), mask=st.booleans(), turns=st.integers(1, 4),
       full=st.booleans(), support=st.booleans())
def test_valid_batches_pass(backend, seed, size, mask, turns, full, support):
    batch_deliveries = deliveries(np.random.default_rng(seed), size, mask=mask, turns=turns, full=full,
                                  mask_log_probs=support and mask)
    batch, found, packed = checked_batch(batch_deliveries, vocab_size=VOCAB)
    assert found == [] and packed == list(range(size))
    validate_batch(batch, vocab_size=VOCAB)


def test_several_failures_are_all_named(backend):
    rng = np.random.default_rng(3)
    batch = deliveries(rng, 4)
    tokens = np.array(batch[1].arrays["tokens"])
    tokens[-1] = VOCAB + 5
    batch[1] = writable(batch[1], tokens=tokens)
    loss = np.array(batch[3].arrays["loss_mask"])
    loss[0] = 7
    batch[3] = writable(batch[3], loss_mask=loss)
    packed_batch = Batch.from_deliveries(batch)
    with pytest.raises(BatchValidationError) as err:
        validate_batch(packed_batch, vocab_size=VOCAB)
    rules = {(v.rule, v.sample, v.position) for v in err.value.violations}
    last = len(tokens) - 1
    assert {(RULE_TOKEN_VOCAB, 1, last), (RULE_IN_SUPPORT, 1, last), (RULE_LOSS_MASK, 3, 0)} <= rules
    assert "t1" in str(err.value) and "t3" in str(err.value) and "t0" not in str(err.value)


def test_whole_batch_rule_names_position_sample_index_and_status():
    rng = np.random.default_rng(4)
    with_mask = delivery(make_rollout(rng, "a", sample_index=8).merged())
    without = delivery(make_rollout(rng, "b", sample_index=9, mask=False).merged())
    _, found, _ = checked_batch([with_mask, without])
    (violation,) = found
    assert violation.rule == RULE_WHOLE_BATCH and violation.sample == 1
    text = str(BatchValidationError(found, ["a", "b"]))
    assert "position 1" in text and "sample_index=9" in text and "status=completed" in text
    with pytest.raises(ValueError):  # BatchValidationError is the ValueError docs/semantics.md §6 asks for
        raise BatchValidationError(found, ["a", "b"])


def test_a_batch_mixing_samples_with_and_without_full_log_probs_refuses_those_without():
    """The whole-batch rule of a replay field: a trainer never gets a batch
    whose `full_log_probs` cover some samples only."""
    rng = np.random.default_rng(4)
    with_full = delivery(make_rollout(rng, "a", sample_index=8, full=True).merged())
    without = delivery(make_rollout(rng, "b", sample_index=9).merged())
    batch, found, packed = checked_batch([with_full, without], vocab_size=VOCAB)
    (violation,) = found
    assert (violation.rule, violation.sample, packed) == (RULE_WHOLE_BATCH, 1, [0])
    assert "carries a full_log_probs but the sample at position 1 (sample_index=9, status=completed)" in violation.detail
    assert batch.full_log_probs is not None and len(batch) == 1
    alone, found, _ = checked_batch([without], vocab_size=VOCAB)
    assert found == [] and alone.full_log_probs is None and "rollout_full_log_probs" not in alone.to_train_data()


def test_a_batch_mixing_samples_with_and_without_mask_log_probs_refuses_those_without():
    """The whole-batch rule holds the support log-probs too: refused naming
    the rule, the field and the sample; a batch of samples without them has
    none, and its train data no key for them."""
    rng = np.random.default_rng(4)
    with_them = delivery(make_rollout(rng, "a", sample_index=8, mask_log_probs=True).merged())
    without = delivery(make_rollout(rng, "b", sample_index=9).merged())
    batch, found, packed = checked_batch([without, with_them], vocab_size=VOCAB)
    (violation,) = found
    assert (violation.rule, violation.sample, packed) == (RULE_WHOLE_BATCH, 0, [1])
    assert "carries a mask_log_probs but the sample at position 0 (sample_index=9, status=completed)" in violation.detail
    assert batch.mask_log_probs is not None and len(batch) == 1 and batch.trajectory_ids == ("a",)
    with pytest.raises(BatchValidationError, match=r"sample 0 \(b\).*" + re.escape(RULE_WHOLE_BATCH)):
        raise BatchValidationError(found, ["b", "a"])
    alone, found, _ = checked_batch([without], vocab_size=VOCAB)
    assert found == [] and alone.mask_log_probs is None and "rollout_sampling_mask_log_probs" not in alone.to_train_data()


def test_support_log_probs_misaligned_with_their_mask_ids_are_refused_naming_the_rule_and_the_sample():
    """Checked per sample before packing: the others are packed, each beside its own ids."""
    rng = np.random.default_rng(10)
    batch = deliveries(rng, 4, mask_log_probs=True)
    short = batch[2].arrays["mask_log_probs"][:-1]
    batch[2] = writable(batch[2], mask_log_probs=np.array(short))
    packed_batch, found, packed = checked_batch(batch, vocab_size=VOCAB)
    assert [(v.rule, v.sample, v.position) for v in found] == [(RULE_SUPPORT_ALIGNED, 2, None)] and packed == [0, 1, 3]
    assert found[0].detail == f"mask_log_probs has {len(short)} entries, mask_ids has {len(short) + 1}"
    assert "sample 2 (t2)" in str(BatchValidationError(found, [d.trajectory_id for d in batch]))
    for k, i in enumerate(packed):
        assert packed_batch.sample(k)["mask_log_probs"].numpy().tobytes() == batch[i].arrays["mask_log_probs"].tobytes()


def test_support_log_probs_without_a_mask_are_refused_naming_the_rule():
    rng = np.random.default_rng(8)
    d = delivery(make_rollout(rng, "a", mask_log_probs=True).merged())
    stripped = {k: v for k, v in d.arrays.items() if k not in ("mask_ids", "mask_offsets")}
    _, found, packed = checked_batch([type(d)(d.trajectory_id, d.fields, stripped, d.broker, d.leases)])
    assert [(v.rule, v.sample) for v in found] == [(RULE_SUPPORT_ALIGNED, 0)] and packed == []
    assert found[0].detail == f"mask_log_probs has {len(d.arrays['mask_log_probs'])} entries, no sampling mask"


def test_a_broken_support_log_prob_is_named_with_its_sample_and_token(backend):
    """NaN, or above 0 beyond the tolerance, anywhere in a support: refused
    naming the log-prob rule of `mask_log_probs`, the trajectory and the
    token whose support holds it; within the tolerance it passes."""
    from rollstream.common.contract import LOG_PROB_TOLERANCE

    rng = np.random.default_rng(9)
    batch = deliveries(rng, 3, mask_log_probs=True)
    offsets = batch[1].arrays["mask_offsets"]
    values = np.array(batch[1].arrays["mask_log_probs"])
    values[offsets[2] + 0] = np.nan
    values[offsets[3]] = 2 * LOG_PROB_TOLERANCE
    batch[1] = writable(batch[1], mask_log_probs=values)
    rounding = np.array(batch[2].arrays["mask_log_probs"])
    rounding[-1] = LOG_PROB_TOLERANCE / 2
    batch[2] = writable(batch[2], mask_log_probs=rounding)
    with pytest.raises(BatchValidationError) as err:
        validate_batch(Batch.from_deliveries(batch), vocab_size=VOCAB)
    (violation,) = err.value.violations
    rule = LOG_PROB_RULES["mask_log_probs"]
    assert (violation.rule, violation.sample, violation.position, violation.count) == (rule, 1, 2, 2)
    assert "its support holds a mask_log_prob of nan" in violation.detail
    assert re.search(rf"sample 1 \(t1\) token 2.*{re.escape(rule)}", str(err.value))


def test_forced_tokens_from_the_merge_model_pass():
    """Forced tokens between turns are singletons with loss 0 and log-prob 0.0."""
    rng = np.random.default_rng(5)
    d = delivery(make_rollout(rng, "f", turns=4).merged())
    forced = (np.asarray(d.arrays["loss_mask"]) == 0) & (np.asarray(d.arrays["log_probs"]) == 0)
    assert forced.any()
    _, found, _ = checked_batch([d], vocab_size=VOCAB)
    assert found == []


def test_a_log_prob_above_0_stored_by_an_older_broker_is_refused_by_the_consumer(backend):
    """A broker does not check stored turns again when it recovers them, so
    a turn an older broker took under a looser log-prob rule is delivered
    as stored. The consumer's batch validation names that trajectory alone:
    `on_invalid="raise"` raises, "quarantine" dead-letters it and keeps the rest."""
    rng = np.random.default_rng(7)
    old = Trajectory("old", [1, 2])
    old.append_turn(Turn(np.array([5, 6], np.int32), np.array([-0.5, 0.5], np.float32), None,
                         SamplingMask.from_supports([[5, 9], [6]])))  # trusted, as a recovered turn is
    old.reward = 0.0
    batch = [delivery(make_rollout(rng, "good0").merged()), delivery(old), delivery(make_rollout(rng, "good1").merged())]
    _, found, _ = checked_batch(batch, vocab_size=VOCAB)
    assert [(v.rule, v.sample, v.position) for v in found] == [(RULE_LOG_PROBS, 1, 1)]
    assert "log_prob is 0.5" in found[0].detail
    with pytest.raises(BatchValidationError, match=r"sample 1 \(old\) token 1") as err:
        validate_batch(Batch.from_deliveries(batch), vocab_size=VOCAB)
    assert RULE_LOG_PROBS in str(err.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the validation pass as torch ops on CUDA")
def test_gpu_batch_is_validated_on_the_device():
    rng = np.random.default_rng(6)
    batch = deliveries(rng, 5)
    tokens = np.array(batch[2].arrays["tokens"])
    tokens[1] = VOCAB + 1
    batch[2] = writable(batch[2], tokens=tokens)
    packed_batch, found, _ = checked_batch(batch, device="cuda", vocab_size=VOCAB)
    assert packed_batch.tokens.is_cuda and packed_batch.mask_offsets.is_cuda
    assert {(v.rule, v.sample, v.position) for v in found} >= {(RULE_TOKEN_VOCAB, 2, 1), (RULE_IN_SUPPORT, 2, 1)}
    clean = packed_batch.select([0, 1, 3, 4])
    validate_batch(clean, vocab_size=VOCAB)
    cpu = checked_batch([batch[i] for i in (0, 1, 3, 4)], device="cpu")[0]
    assert torch.equal(clean.mask_ids.cpu(), cpu.mask_ids) and torch.equal(clean.mask_offsets.cpu(), cpu.mask_offsets)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the support log-probs packed and checked on CUDA")
def test_gpu_batch_carries_and_checks_the_support_log_probs_on_the_device():
    rng = np.random.default_rng(11)
    batch = deliveries(rng, 5, mask_log_probs=True)
    values = np.array(batch[2].arrays["mask_log_probs"])
    values[batch[2].arrays["mask_offsets"][1]] = np.nan  # token 1's support
    batch[2] = writable(batch[2], mask_log_probs=values)
    packed_batch, found, _ = checked_batch(batch, device="cuda", vocab_size=VOCAB)
    assert packed_batch.mask_log_probs.is_cuda and packed_batch.mask_log_probs.shape == packed_batch.mask_ids.shape
    assert [(v.rule, v.sample, v.position) for v in found] == [(LOG_PROB_RULES["mask_log_probs"], 2, 1)]
    clean = packed_batch.select([0, 1, 3, 4])
    validate_batch(clean, vocab_size=VOCAB)
    data = clean.to_train_data()
    for k, i in enumerate((0, 1, 3, 4)):
        got = data["rollout_sampling_mask_log_probs"][k]
        assert got.is_cuda and got.cpu().numpy().tobytes() == batch[i].arrays["mask_log_probs"].tobytes()
