"""Rollouts from a torch language model (`common.tiny_lm`): each step's
next-token logits go through the producer's top-k/top-p/min-p sampler, so
every sampled token comes with the support the sampler could have drawn it
from and its log-prob under that truncated, renormalised distribution, as
an engine reporting its sampling mask does."""
from __future__ import annotations

import numpy as np
import torch

from rollstream.common.mask import SamplingMask
from rollstream.common.tiny_lm import TinyLM

from .sampler import Sampled, SamplingParams, sample


@torch.no_grad()
def generate(model: TinyLM, contexts: np.ndarray, steps: int, params: SamplingParams,
             rng: np.random.Generator) -> list[Sampled]:
    """`steps` tokens after each row of `contexts` (`[rows, length]`, rows
    of one length: a group's members, which share a prompt and grow in
    step), one `Sampled` per row with its `steps` tokens, log-probs and
    supports."""
    contexts = np.asarray(contexts)
    if contexts.ndim != 2 or contexts.shape[1] == 0:
        raise ValueError(f"contexts must be [rows, length] with length >= 1, got shape {contexts.shape}")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    sequence = torch.as_tensor(contexts, dtype=torch.int64)
    drawn = []
    for _ in range(steps):
        logits = model(sequence)[:, -1, :].double().numpy()
        step = sample(logits, params, rng)
        drawn.append(step)
        sequence = torch.cat([sequence, torch.as_tensor(step.tokens, dtype=torch.int64)[:, None]], dim=1)
    return _by_row(drawn, len(contexts))


def _by_row(drawn: list[Sampled], rows: int) -> list[Sampled]:
    """Per-step samples (one entry per row each) regrouped per row: the
    support ids reordered from (step, row) to (row, step) in one stable sort."""
    sizes = np.stack([np.diff(step.mask.offsets) for step in drawn], axis=1)  # [rows, steps]
    ids = np.concatenate([step.mask.ids for step in drawn])
    owner = np.concatenate([np.repeat(np.arange(rows), sizes[:, i]) for i in range(len(drawn))])
    ids = ids[np.argsort(owner, kind="stable")]  # within a row the steps stay in order
    bounds = np.concatenate([[0], np.cumsum(sizes.sum(axis=1))])
    tokens = np.stack([step.tokens for step in drawn], axis=1)
    log_probs = np.stack([step.log_probs for step in drawn], axis=1)
    return [Sampled(tokens[r], log_probs[r], SamplingMask.from_lengths(ids[bounds[r]:bounds[r + 1]], sizes[r]))
            for r in range(rows)]
