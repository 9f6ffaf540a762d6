"""Trainer primitives over the batch's CSR sampling mask (docs/semantics.md §6).

Both run as a few gathers and scatters on the logits' device; no loop over
tokens or rows. Rows of `logits` are response tokens: `positions[r]` is the
row's token position in the mask (for a `Batch`, on its response axis).
"""
from __future__ import annotations

import torch

from rollstream.common.errors import InvalidInput

from .batch import ranges_index


def _supports(mask_ids: torch.Tensor, mask_offsets: torch.Tensor, positions, rows: int, device):
    """For every support id of the rows: its row and the id (int64)."""
    positions = torch.as_tensor(positions, dtype=torch.int64, device=device).reshape(-1)
    if len(positions) != rows:
        raise InvalidInput(f"rows and positions must align: logits has {rows} rows, positions has {len(positions)}")
    mask_offsets = mask_offsets.to(device)
    n_tokens = len(mask_offsets) - 1
    if rows and (int(positions.min()) < 0 or int(positions.max()) >= n_tokens):
        raise InvalidInput(
            f"positions must be in [0, {n_tokens}) (the mask's tokens), got [{int(positions.min())}, {int(positions.max())}]"
        )
    starts = mask_offsets[positions]
    sizes = mask_offsets[positions + 1] - starts
    total = int(sizes.sum())
    owner = torch.repeat_interleave(torch.arange(rows, device=device), sizes, output_size=total)
    ids = mask_ids.to(device)[ranges_index(starts, sizes, total)].long()
    return owner, ids


def dense_support_mask(logits: torch.Tensor, mask_ids, mask_offsets, positions, *, tp_rank: int = 0) -> torch.Tensor:
    """Boolean `[R, V_local]`: True at `(row, id - tp_rank * V_local)` for
    every support id inside this rank's vocab slice; other ids are skipped."""
    rows, vocab_local = logits.shape
    owner, ids = _supports(mask_ids, mask_offsets, positions, rows, logits.device)
    local = ids - tp_rank * vocab_local
    inside = (local >= 0) & (local < vocab_local)
    dense = torch.zeros(rows, vocab_local, dtype=torch.bool, device=logits.device)
    dense[owner[inside], local[inside]] = True
    return dense


def masked_log_probs(
    logits: torch.Tensor,
    tokens,
    mask_ids,
    mask_offsets,
    positions=None,
    *,
    temperature: float = 1.0,
    tp_rank: int = 0,
    tp_group=None,
) -> torch.Tensor:
    """`log p(y) = z_y/T - logsumexp over the support of z_v/T` per row,
    differentiable in `logits` (computed in at least float32; the tokens must
    be inside their supports, which batch validation guarantees).

    With `tp_group`, `logits` is this rank's vocab slice `[R, V_local]`
    starting at `tp_rank * V_local`: the support maximum, the sum of
    exponentials and the token's logit are all-reduced over the group; the
    gradient reaching each rank's slice is that of the replicated result.
    """
    if temperature <= 0:
        raise InvalidInput(f"temperature must be positive, got {temperature}")
    rows, vocab_local = logits.shape
    device = logits.device
    if positions is None:
        positions = torch.arange(rows, device=device)
    tokens = torch.as_tensor(tokens, dtype=torch.int64, device=device).reshape(-1)
    if len(tokens) != rows:
        raise InvalidInput(f"rows and tokens must align: logits has {rows} rows, tokens has {len(tokens)}")
    owner, ids = _supports(mask_ids, mask_offsets, positions, rows, device)
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    first = tp_rank * vocab_local
    inside = (ids >= first) & (ids < first + vocab_local)
    owner, local = owner[inside], ids[inside] - first
    values = scaled[owner, local]
    with torch.no_grad():  # the shift only keeps exp() in range; its gradient cancels
        peak = torch.full((rows,), float("-inf"), dtype=scaled.dtype, device=device).scatter_reduce(0, owner, values, "amax")
        if tp_group is not None:
            torch.distributed.all_reduce(peak, torch.distributed.ReduceOp.MAX, group=tp_group)
    sums = torch.zeros(rows, dtype=scaled.dtype, device=device).index_add(0, owner, torch.exp(values - peak[owner]))
    token_local = tokens - first
    owns_token = (token_local >= 0) & (token_local < vocab_local)
    token_logit = torch.where(
        owns_token,
        scaled[torch.arange(rows, device=device), token_local.clamp(0, vocab_local - 1)],
        torch.zeros((), dtype=scaled.dtype, device=device),
    )
    if tp_group is not None:
        sums = _SumOverRanks.apply(sums, tp_group)
        token_logit = _SumOverRanks.apply(token_logit, tp_group)
    return token_logit - (torch.log(sums) + peak)


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: every tensor-parallel rank
    computes the same loss from the summed value, so each already holds the
    full gradient of its own share (Megatron's reduce-from-parallel-region)."""

    @staticmethod
    def forward(ctx, values, group):
        values = values.clone()
        torch.distributed.all_reduce(values, group=group)
        return values

    @staticmethod
    def backward(ctx, grad):
        return grad, None
