"""The demo's mock trainer rank: its step over a whole shard at once, and
the shard it steps on."""
import math

import numpy as np
import pytest
import torch
from consumer_helpers import deliveries

from rollstream.app.demo_rank import mock_step, on_device
from rollstream.consumer import Batch


def test_the_mock_step_takes_each_tokens_log_prob_over_its_own_support_in_one_pass():
    """Row r's random logits are over its support (column j its j-th id):
    the step's loss is the mean, over trained tokens, of minus the token's
    logit less the log-sum-exp of its row's support columns."""
    batch = Batch.from_deliveries(deliveries(np.random.default_rng(3), 6), device="cpu")
    got = mock_step(batch, torch.Generator().manual_seed(11))
    sizes = batch.support_sizes()
    logits = torch.randn(len(sizes), int(sizes.max()), generator=torch.Generator().manual_seed(11))
    total = 0.0
    for row, (start, end) in enumerate(zip(batch.mask_offsets[:-1].tolist(), batch.mask_offsets[1:].tolist())):
        support = batch.mask_ids[start:end].tolist()
        column = max(j for j, id_ in enumerate(support) if id_ == int(batch.response_tokens[row]))
        logp = logits[row, column] - torch.logsumexp(logits[row, :len(support)], 0)
        total -= float(logp) * int(batch.loss_mask[row])
    assert got == pytest.approx(total / int(batch.loss_mask.sum()), rel=1e-5)


def test_a_shard_without_masks_or_tokens_takes_no_step():
    empty = Batch.from_deliveries(deliveries(np.random.default_rng(3), 2), device="cpu").select([])
    assert mock_step(empty, torch.Generator()) == 0.0


def test_a_shard_already_on_the_device_is_stepped_on_as_it_is():
    shard = Batch.from_deliveries(deliveries(np.random.default_rng(3), 2), device="cpu")
    assert on_device(shard, torch.device("cpu")) is shard


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: a shard received in host memory, moved to CUDA")
def test_a_shard_received_in_host_memory_moves_to_cuda_whole():
    shard = Batch.from_deliveries(deliveries(np.random.default_rng(3), 4), device="cpu")
    moved = on_device(shard, torch.device("cuda"))
    assert moved.tokens.is_cuda and moved.mask_offsets.is_cuda and moved.trajectory_ids == shard.trajectory_ids
    assert torch.equal(moved.mask_ids.cpu(), shard.mask_ids) and torch.equal(moved.log_probs.cpu(), shard.log_probs)
    assert math.isfinite(mock_step(moved, torch.Generator(device="cuda").manual_seed(0)))
