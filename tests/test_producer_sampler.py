"""The synthetic source's sampler against a reference written here, one
position at a time in plain Python: SGLang's truncation order (top-k, then
top-p on the exclusive cumulative probability, then min-p relative to the
top probability), applied to the same logits."""
import math

import numpy as np
import pytest

from rollstream.producer.sampler import SamplingParams, ZipfLogits, sample

PARAMS = [
    SamplingParams(1.0, 20, 0.95, 0.0),
    SamplingParams(0.7, -1, 0.9, 0.0),
    SamplingParams(1.3, 50, 1.0, 0.05),
    SamplingParams(1.0, 5, 0.5, 0.1),
    SamplingParams(0.5, -1, 1.0, 0.0),
    SamplingParams(1.0, 1, 1.0, 0.0),
]


def reference_support(row_logits, ids, params):
    """Token ids of one position's support, most likely first."""
    scaled = [z / params.temperature for z in row_logits]
    top = max(scaled)
    weights = [math.exp(z - top) for z in scaled]
    total = sum(weights)
    ranked = sorted(range(len(scaled)), key=lambda c: -scaled[c])
    support, before = [], 0.0
    for rank, c in enumerate(ranked):
        p = weights[c] / total
        if params.top_k > 0 and rank >= params.top_k:
            break
        if params.top_p < 1 and before > params.top_p:  # top_p = 1 disables the filter, as in engines
            break
        if p < params.min_p * weights[ranked[0]] / total:
            break
        support.append(int(ids[c]))
        before += p
    return support, {int(ids[c]): weights[c] / total for c in ranked}


@pytest.mark.parametrize("params", PARAMS, ids=repr)
def test_supports_match_the_reference_and_hold_their_tokens(params):
    rng = np.random.default_rng(7)
    logits, ids = ZipfLogits(5000, rng, candidates=128)(300)
    out = sample(logits, params, np.random.default_rng(1), ids)
    assert len(out.mask) == 300 and out.tokens.dtype == np.int32 and out.log_probs.dtype == np.float32
    for t in range(300):
        support, probs = reference_support(logits[t], ids[t], params)
        assert out.mask[t].tolist() == support, f"position {t}"
        token = int(out.tokens[t])
        assert token in support, f"position {t}: sampled {token} outside its support"
        expected = math.log(probs[token] / sum(probs[i] for i in support))
        assert out.log_probs[t] == pytest.approx(expected, rel=1e-5, abs=1e-6)
        lo, hi = int(out.mask.offsets[t]), int(out.mask.offsets[t + 1])
        mass = sum(probs[i] for i in support)
        assert out.mask_log_probs[lo:hi].tolist() == pytest.approx([math.log(probs[i] / mass) for i in support],
                                                                   rel=1e-5, abs=1e-6), f"position {t}"
    assert out.mask_log_probs.dtype == np.float32 and len(out.mask_log_probs) == len(out.mask.ids)


def test_dense_logits_use_column_numbers_as_token_ids():
    logits = np.array([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 5.0, 0.0]])
    out = sample(logits, SamplingParams(1.0, 2, 1.0, 0.0), np.random.default_rng(0))
    assert out.mask[0].tolist() == [0, 1]
    assert out.mask[1].tolist()[0] == 2 and len(out.mask[1]) == 2


def test_the_log_prob_is_taken_under_the_truncated_distribution():
    """Logits [2, -1, 0.5, -2] with top-k 2 keep {0, 2}; T = 1 gives
    log p(0) = 2 - ln(e^2 + e^0.5) (docs/semantics.md section 6's formula)."""
    logits = np.array([[2.0, -1.0, 0.5, -2.0]])
    for seed in range(50):
        out = sample(logits, SamplingParams(1.0, 2, 1.0, 0.0), np.random.default_rng(seed))
        assert out.mask[0].tolist() == [0, 2]
        if out.tokens[0] == 0:
            assert out.log_probs[0] == pytest.approx(2 - math.log(math.exp(2) + math.exp(0.5)), rel=1e-6)
            return
    pytest.fail("token 0 (probability ~0.82) never drawn in 50 tries")


def test_draws_follow_the_truncated_distribution():
    """Many draws at one position: frequencies match the renormalised
    probabilities of the support (a loose chi-square bound)."""
    n = 20_000
    row = np.array([3.0, 2.5, 2.0, 1.0, 0.0, -1.0])
    out = sample(np.tile(row, (n, 1)), SamplingParams(1.0, 4, 1.0, 0.0), np.random.default_rng(3))
    support, probs = reference_support(row, np.arange(6), SamplingParams(1.0, 4, 1.0, 0.0))
    assert support == [0, 1, 2, 3]
    mass = sum(probs[i] for i in support)
    counts = np.bincount(out.tokens, minlength=6)
    assert counts[4] == counts[5] == 0
    chi2 = sum((counts[i] - n * probs[i] / mass) ** 2 / (n * probs[i] / mass) for i in support)
    assert chi2 < 25.0  # 3 degrees of freedom: p < 1e-4 of failing by chance


def test_zipf_logits_give_distinct_in_vocab_candidates_and_mixed_support_sizes():
    logits, ids = ZipfLogits(1000, np.random.default_rng(0), candidates=64)(500)
    assert logits.shape == ids.shape == (500, 64)
    assert ids.min() >= 0 and ids.max() < 1000
    assert all(len(set(row)) == 64 for row in ids.tolist())
    sizes = sample(logits, SamplingParams(1.0, 20, 0.95, 0.0), np.random.default_rng(0), ids).mask.support_sizes
    assert sizes.min() == 1 and sizes.max() > 5  # confident and uncertain positions both occur


@pytest.mark.parametrize("bad, match", [
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
])
def test_bad_parameters_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)
