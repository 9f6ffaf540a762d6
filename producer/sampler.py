"""A vectorised top-k / top-p / min-p sampler and Zipf-like synthetic logits.

The synthetic source samples with this instead of inventing supports, so
support sizes are the ones a real engine's truncation produces. Semantics
follow SGLang's sampler: probabilities from `logits / temperature`, then on
the sorted distribution drop ranks `>= top_k`, tokens whose *exclusive*
cumulative probability exceeds `top_p`, and tokens below `min_p` times the
top probability (`top_k <= 0`, `top_p = 1` and `min_p = 0` disable their
filter); the sampled token is drawn from what remains,
renormalised, and its log-probability is taken under that truncated
distribution (docs/semantics.md §6). Every filter keeps a prefix of the sorted
order (the most likely token always survives), so a support is the first
`size` sorted candidates.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollstream.common.errors import InvalidInput
from rollstream.common.mask import SamplingMask


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1  # <= 0: no limit
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if not self.temperature > 0:
            raise InvalidInput(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidInput(f"min_p must be in [0, 1], got {self.min_p}")


@dataclass(frozen=True)
class Sampled:
    """One sampled token per row, its truncated log-prob and its support,
    with the truncated log-prob of every support id (renormalised over the
    support: each support's probabilities sum to 1)."""

    tokens: np.ndarray  # int32 [n]
    log_probs: np.ndarray  # float32 [n]
    mask: SamplingMask
    mask_log_probs: np.ndarray  # float32, aligned with mask.ids


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           candidate_ids: np.ndarray | None = None) -> Sampled:
    """Sample one token per row of `logits` `[n, C]`. Column `c` of row `r`
    is token `candidate_ids[r, c]` (default: token `c`, a dense vocabulary)."""
    logits = np.asarray(logits, dtype=np.float64)
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise InvalidInput(f"logits must be [n, candidates] with candidates >= 1, got shape {logits.shape}")
    n, width = logits.shape
    if candidate_ids is None:
        candidate_ids = np.broadcast_to(np.arange(width, dtype=np.int32), (n, width))
    elif candidate_ids.shape != logits.shape:
        raise InvalidInput(f"candidate_ids must match logits' shape {logits.shape}, got {candidate_ids.shape}")
    scaled = logits / params.temperature
    weights = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    total_weight = weights.sum(axis=1, keepdims=True)
    if 0 < params.top_k < width:  # only the top_k can survive: partition, then sort just those
        top = np.argpartition(-scaled, params.top_k - 1, axis=1)[:, : params.top_k]
        order = np.take_along_axis(top, np.argsort(-np.take_along_axis(scaled, top, axis=1), axis=1, kind="stable"),
                                   axis=1)
    else:
        order = np.argsort(-scaled, axis=1, kind="stable")
    probs = np.take_along_axis(weights, order, axis=1) / total_weight
    keep = np.ones(probs.shape, dtype=bool)
    if params.top_p < 1:  # 1 disables it, as in engines (rounding could otherwise cut the tail)
        keep &= np.cumsum(probs, axis=1) - probs <= params.top_p
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs[:, :1]
    sizes = keep.sum(axis=1)
    kept = np.where(keep, probs, 0.0)
    total = kept.sum(axis=1)
    draw = rng.random(n) * total
    choice = np.minimum((np.cumsum(kept, axis=1) <= draw[:, None]).sum(axis=1), sizes - 1)
    rows = np.arange(n)
    sorted_ids = np.take_along_axis(np.asarray(candidate_ids), order, axis=1)
    mask = SamplingMask.from_lengths(sorted_ids[keep].astype(np.int32), sizes)
    log_total = np.log(total)
    log_probs = np.log(kept[rows, choice]) - log_total
    support_log_probs = np.log(kept[keep]) - np.repeat(log_total, sizes)  # row-major, as the mask's ids
    return Sampled(sorted_ids[rows, choice].astype(np.int32), log_probs.astype(np.float32), mask,
                   support_log_probs.astype(np.float32))


class ZipfLogits:
    """Synthetic next-token logits: for each position, `candidates` distinct
    token ids with logit `-s * log(rank)` plus a little noise, where the
    sharpness `s` varies per position, so confident positions (support 1)
    mix with uncertain ones as in a language model's output."""

    def __init__(self, vocab_size: int, rng: np.random.Generator, *, candidates: int = 128):
        if not 1 <= candidates <= vocab_size:
            raise InvalidInput(f"candidates must be in [1, vocab_size={vocab_size}], got {candidates}")
        self.vocab_size = vocab_size
        self.candidates = candidates
        self.rng = rng
        permutation = rng.permutation(vocab_size).astype(np.int32)
        # row s is the `candidates` ids that follow position s of a fixed permutation (wrapping around)
        self._windows = np.lib.stride_tricks.sliding_window_view(np.concatenate([permutation, permutation[:candidates]]),
                                                                 candidates)
        self._log_rank = np.log(np.arange(1, candidates + 1, dtype=np.float64))

    def __call__(self, n: int, rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`(logits [n, C], candidate_ids [n, C])` for `n` positions, drawn
        from `rng` (default: the one it was made with)."""
        rng = self.rng if rng is None else rng
        sharpness = 0.8 + rng.gamma(2.0, 0.8, size=(n, 1))
        noise = rng.standard_normal(size=(n, self.candidates), dtype=np.float32)
        logits = -sharpness * self._log_rank + 0.3 * noise
        return logits, self._windows[rng.integers(0, self.vocab_size, size=n)]
