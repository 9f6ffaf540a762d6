"""Trainer primitives over the batch's CSR sampling mask (docs/semantics.md §6).

Rows of `logits` are response tokens: `positions[r]` is the row's token
position in the mask (for a `Batch`, on its response axis). Both primitives
run as a few gathers and scatters on the logits' device, with no loop over
tokens or rows; every shape follows from the number of support ids the rows
cover (ids outside a rank's vocab slice are masked, never dropped).

Neither reads a device value back on the common call, `positions` omitted
with one row per mask token: the count is then `len(mask_ids)`. Otherwise
the count and the positions' bounds (checked) come from the host when the
offsets and the positions are host tensors, else from one device read.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from rollstream.common.errors import InvalidInput

from .batch import ranges_index


def _support_entries(mask_ids, mask_offsets, positions, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For every support id of the rows: its row and the id (int64, on `device`)."""
    offsets = torch.as_tensor(mask_offsets)
    n_tokens = len(offsets) - 1
    in_order = positions is None and rows == n_tokens
    if positions is None:  # row r is token r
        positions = torch.arange(rows, device=offsets.device)
    positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
    if len(positions) != rows:
        raise InvalidInput(f"rows and positions must align: logits has {rows} rows, positions has {len(positions)}")
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    if not rows:
        return empty, empty
    # Host offsets and positions size the expansion on the host; otherwise on the device.
    on_host = offsets.device.type == "cpu" and positions.device.type == "cpu"
    where = torch.device("cpu") if on_host else device
    offsets, positions = offsets.to(where, non_blocking=True), positions.to(where, non_blocking=True)
    starts = offsets[positions.clamp(0, n_tokens)]  # clamped: bad positions are reported below, never read out of bounds
    sizes = offsets[(positions + 1).clamp(0, n_tokens)] - starts
    if in_order:  # the CSR invariants offsets[0] == 0 and offsets[-1] == len(ids) give the count
        total = len(mask_ids)
    else:  # the entry count sizes the expansion: read on the host, or the one device read of a call
        low, high, total = torch.stack([positions.min(), positions.max(), sizes.sum()]).tolist()
        if low < 0 or high >= n_tokens:
            raise InvalidInput(f"positions must be in [0, {n_tokens}) (the mask's tokens), got [{low}, {high}]")
    starts, sizes = starts.to(device, non_blocking=True), sizes.to(device, non_blocking=True)
    owner = torch.repeat_interleave(torch.arange(rows, device=device), sizes, output_size=total)
    ids = torch.as_tensor(mask_ids).to(device, non_blocking=True)[ranges_index(starts, sizes, total)].long()
    return owner, ids


def _in_slice(ids: torch.Tensor, tp_rank: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each id in this rank's vocab slice (clamped into it, so that
    every id indexes a real column) and whether the id lies inside it."""
    local = ids - tp_rank * vocab_local
    return local.clamp(0, vocab_local - 1), (local >= 0) & (local < vocab_local)


def dense_support_mask(logits: torch.Tensor, mask_ids, mask_offsets, positions, *, tp_rank: int = 0) -> torch.Tensor:
    """Boolean `[R, V_local]`: True at `(row, id - tp_rank * V_local)` for
    every support id inside this rank's vocab slice; other ids are skipped."""
    rows, vocab_local = logits.shape
    owner, ids = _support_entries(mask_ids, mask_offsets, positions, rows, logits.device)
    columns, inside = _in_slice(ids, tp_rank, vocab_local)
    cells = rows * vocab_local  # ids outside the slice all land on one spare cell past the end
    flat = torch.zeros(cells + 1, dtype=torch.bool, device=logits.device)
    flat.index_fill_(0, torch.where(inside, owner * vocab_local + columns, cells), True)
    return flat[:cells].view(rows, vocab_local)


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
    differentiable in `logits` (the tokens must be inside their supports,
    which batch validation guarantees).

    Only the support entries and the tokens' logits are gathered, then
    computed in at least float32; the backward writes their gradients into
    one tensor of the logits' dtype and shape, so nothing `[R, V]` is
    allocated beyond the logits' own gradient.

    With `tp_group`, `logits` is this rank's vocab slice `[R, V_local]`
    starting at `tp_rank * V_local`: the support maximum, the sum of
    exponentials and the token's logit are all-reduced over the group; the
    gradient reaching each rank's slice is that of the replicated result.
    Every rank expands all support ids and keeps its slice's: a support's ids
    come in no set order, so a rank cannot find its own by bisection, and
    compacting to them would read their count back from the device. With
    `tp_rank` but no group, each row is this slice's share alone (its token's
    logit where the slice holds it, else 0, less the log of the slice's sum),
    NaN for a row whose support has no id in the slice.
    """
    if temperature <= 0:
        raise InvalidInput(f"temperature must be positive, got {temperature}")
    rows, vocab_local = logits.shape
    device = logits.device
    tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
    if len(tokens) != rows:
        raise InvalidInput(f"rows and tokens must align: logits has {rows} rows, tokens has {len(tokens)}")
    tokens = tokens.to(device, non_blocking=True)
    owner, ids = _support_entries(mask_ids, mask_offsets, positions, rows, device)
    # The support entries, then one entry per row for its token.
    entry_rows = torch.cat([owner, torch.arange(rows, device=device)])
    columns, inside = _in_slice(torch.cat([ids, tokens]), tp_rank, vocab_local)
    return _LogProbOverSupport.apply(logits, entry_rows, columns, inside, ids == tokens[owner], temperature, tp_group)


class _LogProbOverSupport(torch.autograd.Function):
    """The masked log-prob from gathered entries. Its backward scatters one
    gradient per entry into a zeroed tensor like the logits: a dense float32
    gradient per gather would be twice the logits' bytes at bf16.

    The token's own cell gets one entry, `(1 - p_y) / T`, so that the
    difference is taken in float32 before the cast (two entries summed in
    bf16 would lose `1 - p_y` when `p_y` is near 1); its support entries get 0.

    Under a group the forward's sums are all-reduced and the backward is the
    identity for them: every rank computes the same loss from the summed
    values, so each already holds the full gradient of its own share
    (Megatron's reduce-from-parallel-region)."""

    @staticmethod
    def forward(ctx, logits, entry_rows, columns, inside, at_token, temperature, group):
        rows = logits.shape[0]
        count = len(entry_rows) - rows  # support entries; the rows' tokens follow
        owner = entry_rows[:count]
        work = torch.promote_types(logits.dtype, torch.float32)
        gathered = logits[entry_rows, columns].to(work) / temperature
        support = torch.where(inside[:count], gathered[:count], float("-inf"))
        token = torch.where(inside[count:], gathered[count:], 0.0)
        # The shift only keeps exp() in range; the closed-form backward below does not depend on it.
        peak = torch.full((rows,), float("-inf"), dtype=work, device=logits.device).scatter_reduce(0, owner, support, "amax")
        if group is not None:
            torch.distributed.all_reduce(peak, torch.distributed.ReduceOp.MAX, group=group)
        exps = torch.exp(support - peak[owner])
        totals = torch.stack([torch.zeros_like(peak).index_add(0, owner, exps), token])
        if group is not None:
            torch.distributed.all_reduce(totals, group=group)
        sums, token = totals
        probs = exps / sums[owner]
        token_prob = torch.zeros_like(peak).index_add(0, owner, torch.where(at_token, probs, 0.0))
        shares = torch.cat([torch.where(at_token, 0.0, -probs), torch.where(inside[count:], 1 - token_prob, 0.0)])
        ctx.save_for_backward(entry_rows, columns, shares / temperature)
        ctx.logits_like = (logits.shape, logits.dtype)
        return token - (torch.log(sums) + peak)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        entry_rows, columns, shares = ctx.saved_tensors
        shape, dtype = ctx.logits_like
        entries = (grad[entry_rows] * shares).to(dtype)
        logits_grad = torch.zeros(shape, dtype=dtype, device=grad.device)
        return logits_grad.index_put_((entry_rows, columns), entries, accumulate=True), None, None, None, None, None, None
