"""Trainer primitives: the dense vocab-shard mask and the masked,
temperature-scaled log-prob (docs/semantics.md §6), against direct definitions."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.common.mask import SamplingMask
from rollstream.consumer import dense_support_mask, masked_log_probs


def csr(supports):
    mask = SamplingMask.from_supports(supports)
    return torch.from_numpy(mask.ids.copy()), torch.from_numpy(mask.offsets.copy())


def test_worked_example():
    ids, offsets = csr([[0, 2]])
    got = masked_log_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), [0], ids, offsets, [0], temperature=1.0)
    assert float(got) == pytest.approx(2 - math.log(math.e**2 + 1), abs=1e-6)
    assert float(got) == pytest.approx(-0.1269, abs=1e-4)


@st.composite
def problems(draw):
    vocab = draw(st.integers(2, 12))
    n_tokens = draw(st.integers(1, 6))
    supports = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=vocab, unique=True)) for _ in range(n_tokens)]
    positions = draw(st.lists(st.integers(0, n_tokens - 1), min_size=0, max_size=6))
    return vocab, supports, positions


@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from([1, 2, 4]))
def test_dense_mask_of_every_vocab_shard(problem, tp_size):
    vocab, supports, positions = problem
    local = -(-vocab // tp_size)
    ids, offsets = csr(supports)
    shards = [dense_support_mask(torch.zeros(len(positions), local), ids, offsets, positions, tp_rank=r) for r in range(tp_size)]
    for rank, dense in enumerate(shards):
        for row, position in enumerate(positions):
            expected = {i - rank * local for i in supports[position] if rank * local <= i < (rank + 1) * local}
            assert set(torch.nonzero(dense[row]).flatten().tolist()) == expected


@settings(max_examples=60, deadline=None)
@given(problems(), st.floats(0.25, 4.0), st.integers(0, 2**31 - 1))
def test_masked_log_prob_matches_its_definition_with_gradient(problem, temperature, seed):
    vocab, supports, positions = problem
    if not positions:
        return
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(positions), vocab, generator=gen, dtype=torch.float64).requires_grad_()
    picks = torch.randint(0, 10**6, (len(positions),), generator=gen).tolist()
    tokens = [supports[p][k % len(supports[p])] for p, k in zip(positions, picks)]
    ids, offsets = csr(supports)
    got = masked_log_probs(logits, tokens, ids, offsets, positions, temperature=temperature)
    reference = torch.stack([
        logits[r, tokens[r]] / temperature - torch.logsumexp(logits[r, supports[p]] / temperature, 0)
        for r, p in enumerate(positions)
    ])
    assert torch.allclose(got.double(), reference, atol=1e-5)
    (grad,) = torch.autograd.grad(got.sum(), logits)
    (expected_grad,) = torch.autograd.grad(reference.sum(), logits)
    assert torch.allclose(grad.double(), expected_grad, atol=1e-5)


def test_dense_mask_and_log_prob_agree():
    """The masked log-softmax through the dense mask gives the same values."""
    rng = np.random.default_rng(2)
    supports = [rng.choice(50, size=int(rng.integers(1, 10)), replace=False).tolist() for _ in range(8)]
    ids, offsets = csr(supports)
    logits = torch.randn(8, 50)
    tokens = [s[0] for s in supports]
    dense = dense_support_mask(logits, ids, offsets, torch.arange(8))
    via_dense = torch.log_softmax(logits.masked_fill(~dense, float("-inf")), -1)[torch.arange(8), tokens]
    assert torch.allclose(masked_log_probs(logits, tokens, ids, offsets), via_dense, atol=1e-5)


def test_rows_and_positions_are_checked():
    ids, offsets = csr([[1], [2, 3]])
    with pytest.raises(ValueError, match="align"):
        dense_support_mask(torch.zeros(3, 4), ids, offsets, [0, 1])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        dense_support_mask(torch.zeros(1, 4), ids, offsets, [2])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        masked_log_probs(torch.zeros(1, 4), [1], ids, offsets, [-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the primitives on CUDA")
def test_primitives_on_the_gpu_match_the_cpu():
    rng = np.random.default_rng(8)
    supports = [rng.choice(64, size=int(rng.integers(1, 12)), replace=False).tolist() for _ in range(32)]
    ids, offsets = csr(supports)
    logits = torch.randn(32, 64)
    tokens = [s[-1] for s in supports]
    on_cpu = masked_log_probs(logits, tokens, ids, offsets, temperature=0.8)
    on_gpu = masked_log_probs(logits.cuda(), tokens, ids.cuda(), offsets.cuda(), temperature=0.8)
    assert torch.allclose(on_gpu.cpu(), on_cpu, atol=1e-5)
    dense = dense_support_mask(logits.cuda()[:, 32:], ids.cuda(), offsets.cuda(), torch.arange(32).cuda(), tp_rank=1)
    assert torch.equal(dense.cpu(), dense_support_mask(logits[:, 32:], ids, offsets, torch.arange(32), tp_rank=1))
