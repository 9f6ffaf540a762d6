"""Trainer primitives over the batch's CSR sampling mask (docs/semantics.md §6).

Rows of `logits` are response tokens: `positions[r]` is the row's token
position in the mask (for a `Batch`, on its response axis). The primitives
run as a few gathers and scatters on the logits' device, with no loop over
tokens or rows; every shape follows from the number of support ids the rows
cover (ids outside a rank's vocab slice are masked, never dropped).

None reads a device value back on the common call, `positions` omitted
with one row per mask token: the count is then `len(mask_ids)`. Otherwise
the count and the positions' bounds (checked) come from the host when the
offsets and the positions are host tensors, else from one device read.

All always refuse arguments of the wrong type, dtype, rank or length:
those are host facts, free to read. The mask's content is another matter:
a `Batch` from the `Consumer` was validated already, so only `check=True`
checks it (for masks from elsewhere), with batch validation's own rules
and flags (common/validation.py), computed where the logits live and read
back once.
"""
from __future__ import annotations

import math
import numbers

import torch
from torch.autograd.function import once_differentiable

from rollstream.common.contract import LOG_PROB_TOLERANCE
from rollstream.common.errors import InvalidInput, InvalidType
from rollstream.common.validation import (
    LOG_PROB_RULES,
    RULE_IN_SUPPORT,
    RULE_MASK_VOCAB,
    RULE_NONEMPTY_OFFSETS,
    RULE_NONEMPTY_SUPPORT,
    RULE_OFFSETS_END,
    RULE_OFFSETS_START,
    RULE_SUPPORT_ALIGNED,
    Verdict,
    Violation,
    csr_flags,
    inside_support,
    locate_csr_violations,
)

from .batch import ranges_index

_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# Mask ids travel as int32 (docs/protocol.md): no vocabulary is larger than int32's largest value.
_ID_RANGE = 2**31 - 1
# The argument each of the mask's own rules is about.
_ARGUMENT = {
    RULE_OFFSETS_START: "mask_offsets", RULE_OFFSETS_END: "mask_offsets", RULE_NONEMPTY_SUPPORT: "mask_offsets",
    RULE_MASK_VOCAB: "mask_ids",
}


def _described(value) -> str:
    """What a refused value is: its dtype, or its type."""
    return str(value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__


def _rows_and_columns(logits) -> tuple[int, int]:
    """`[R, V_local]` of floating-point logits."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise InvalidType(f"logits must be a floating-point tensor (the log-probs are differentiated through it), "
                          f"got {_described(logits)}")
    if logits.dim() != 2:
        raise InvalidInput(f"logits must be 2-D ([rows, vocab slice]), got shape {tuple(logits.shape)}")
    rows, columns = logits.shape
    return rows, columns


def _typed(name: str, values, why: str, *, floating: bool = False) -> torch.Tensor:
    """`values` as a tensor where it lies, refused unless its dtype is an
    integer one (a floating-point one with `floating`)."""
    kind = "a floating-point" if floating else "an integer"
    try:
        tensor = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidType(f"{name} must be {kind} tensor ({why}), got {type(values).__name__} ({exc})") from None
    if isinstance(values, (list, tuple)) and not tensor.numel() and not floating:  # torch makes an empty list float
        tensor = tensor.long()
    if not (tensor.is_floating_point() if floating else tensor.dtype in _INTEGERS):
        raise InvalidType(f"{name} must be {kind} tensor ({why}), got {tensor.dtype}")
    return tensor


def _one_per_row(name: str, values: torch.Tensor, rows: int) -> torch.Tensor:
    """`values` flattened, refused unless it holds one entry per row of the logits."""
    values = values.reshape(-1)
    if len(values) != rows:
        raise InvalidInput(f"{name} must align with the rows of logits (one entry per row): expected {rows}, "
                           f"got {len(values)}")
    return values


def _mask_arguments(mask_ids, mask_offsets, positions, rows: int):
    """The mask's ids and offsets and the rows' positions (None: row r is
    mask token r) as tensors, refused where a dtype, a rank or a length
    cannot be right."""
    ids = _typed("mask_ids", mask_ids, "support ids index the vocabulary")
    offsets = _typed("mask_offsets", mask_offsets, "offsets index mask_ids")
    for name, tensor, layout in (("mask_ids", ids, "every support's ids end to end"),
                                 ("mask_offsets", offsets, "N + 1 offsets for N tokens")):
        if tensor.dim() != 1:
            raise InvalidInput(f"{name} must be 1-D ({layout}), got shape {tuple(tensor.shape)}")
    if not len(offsets):
        raise InvalidInput(f"mask_offsets: rule '{RULE_NONEMPTY_OFFSETS}' violated: expected at least 1 entry, got 0")
    if positions is None:
        if len(offsets) != rows + 1:
            raise InvalidInput(f"mask_offsets must have one entry more than logits has rows when positions is omitted "
                               f"(row r is mask token r): expected {rows + 1}, got {len(offsets)}")
        return ids, offsets, None
    return ids, offsets, _one_per_row("positions", _typed("positions", positions, "rows' tokens in the mask"), rows)


def _log_probs_per_id(mask_log_probs, ids: torch.Tensor) -> torch.Tensor:
    """`mask_log_probs` as a float tensor, refused unless it holds one entry per mask id (a host fact)."""
    values = _typed("mask_log_probs", mask_log_probs, "the sampler's log-prob of each support id", floating=True)
    if values.dim() != 1:
        raise InvalidInput(f"mask_log_probs must be 1-D (aligned with mask_ids), got shape {tuple(values.shape)}")
    if len(values) != len(ids):
        raise InvalidInput(f"mask_log_probs: rule '{RULE_SUPPORT_ALIGNED}' violated: expected {len(ids)} "
                           f"(len(mask_ids)), got {len(values)}")
    return values


def _checked_temperature(temperature) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise InvalidType(f"temperature must be a number (a host value: a tensor's would be read back), "
                          f"got {_described(temperature)}")
    if not (float(temperature) > 0 and math.isfinite(temperature)):
        raise InvalidInput(f"temperature must be positive and finite (it divides the logits), got {temperature}")


def _vocabulary(columns: int, tp_rank, tp_group=None, vocab_size=None) -> tuple[int, str]:
    """The whole vocabulary's size, which `check=True` bounds the ids by,
    and where it comes from: `vocab_size` when the caller gives it; else the
    logits are the slice at `tp_rank` of a vocabulary split evenly over
    `tp_group`'s ranks; without a group, they are the whole vocabulary at
    rank 0, and a slice of an unknown one at a later rank (ids are then
    bounded by int32's range alone)."""
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, numbers.Integral):
        raise InvalidType(f"tp_rank must be an int (this rank's vocab slice), got {_described(tp_rank)}")
    ranks = None if tp_group is None else torch.distributed.get_world_size(tp_group)
    if int(tp_rank) < 0 or (ranks is not None and int(tp_rank) >= ranks):
        bound = "0 or more" if ranks is None else f"in [0, {ranks}) (the ranks of tp_group)"
        raise InvalidInput(f"tp_rank must be {bound}, got {tp_rank}")
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
            raise InvalidType(f"vocab_size must be an int (the whole vocabulary), got {_described(vocab_size)}")
        holds = columns * (int(tp_rank) + 1)
        if not holds <= int(vocab_size) <= _ID_RANGE:
            raise InvalidInput(f"vocab_size must be in [{holds}, {_ID_RANGE}] (at least the ids up to this rank's "
                               f"slice, logits.shape[1] = {columns} at tp_rank {tp_rank}; at most int32's), "
                               f"got {vocab_size}")
        return int(vocab_size), f"vocab_size = {vocab_size}"
    if ranks is not None:
        return min(columns * ranks, _ID_RANGE), f"logits.shape[1] = {columns} x {ranks} ranks of tp_group"
    if tp_rank == 0:
        return min(columns, _ID_RANGE), f"logits.shape[1] = {columns}, the whole vocabulary at tp_rank 0 without tp_group"
    return _ID_RANGE, f"int32's range: a vocab slice at tp_rank {tp_rank} without tp_group knows no whole vocabulary"


def _support_entries(ids, offsets, positions, rows: int, device,
                     along=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """For every support id of the rows: its row, the id (int64, on
    `device`) and, with `along` (values aligned with the ids), its value;
    and the rows' supports among those entries, as offsets. The offsets are
    bounded into the ids first, so that unchecked ones give meaningless
    entries but never index past the ids (nor have torch write past an
    output it sized from them)."""
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    if not rows:
        values = None if along is None else along[:0].to(device)
        return empty, empty, values, torch.zeros(1, dtype=torch.int64, device=device)
    if positions is None:  # row r is token r: an id's row is the count of supports begun before it, the ids stay in order
        offsets = offsets.to(device, torch.int64, non_blocking=True).clamp(0, len(ids))
        begun = torch.zeros(len(ids) + 1, dtype=torch.int64, device=device)
        begun.index_add_(0, offsets[1:-1], torch.ones(rows - 1, dtype=torch.int64, device=device))
        values = None if along is None else along.to(device, non_blocking=True)
        return begun.cumsum(0)[: len(ids)], ids.to(device, non_blocking=True).long(), values, offsets
    n_tokens = len(offsets) - 1
    # Host offsets and positions size the expansion on the host; otherwise on the device.
    on_host = offsets.device.type == "cpu" and positions.device.type == "cpu"
    where = torch.device("cpu") if on_host else device
    offsets = offsets.to(where, torch.int64, non_blocking=True).clamp(0, len(ids))
    positions = positions.to(where, torch.int64, non_blocking=True)
    starts = offsets[positions.clamp(0, n_tokens)]  # clamped: bad positions are reported below, never read out of bounds
    sizes = (offsets[(positions + 1).clamp(0, n_tokens)] - starts).clamp(min=0)
    # The entry count sizes the expansion: read on the host, or the one device read of a call.
    low, high, total = torch.stack([positions.min(), positions.max(), sizes.sum()]).tolist()
    if low < 0 or high >= n_tokens:
        raise InvalidInput(f"positions must be in [0, {n_tokens}) (the mask's tokens), got [{low}, {high}]")
    starts, sizes = starts.to(device, non_blocking=True), sizes.to(device, non_blocking=True)
    owner = torch.repeat_interleave(torch.arange(rows, device=device), sizes, output_size=total)
    entry_offsets = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    index = ranges_index(starts, sizes, total)
    values = None if along is None else along.to(device, non_blocking=True)[index]
    return owner, ids.to(device, non_blocking=True)[index].long(), values, entry_offsets


def _entries(ids, offsets, positions, rows: int, device, *, vocab=None, tokens=None,
             log_probs=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`_support_entries`' rows and ids, and each entry's value of
    `log_probs` (one per mask id) where given; with `vocab`
    (`check=True`), refused unless the mask keeps its own rules, the rows'
    `tokens`, where given, lie inside their supports, and the log-probs
    keep the log-prob rule."""
    owner, entry_ids, entry_log_probs, entry_offsets = _support_entries(ids, offsets, positions, rows, device, log_probs)
    if vocab is not None:
        _require_content(ids.to(device, non_blocking=True), offsets.to(device, torch.int64, non_blocking=True), vocab,
                         None if tokens is None else (tokens, positions, entry_ids, entry_offsets),
                         None if log_probs is None else log_probs.to(device, non_blocking=True))
    return owner, entry_ids, entry_log_probs


def _require_content(ids, offsets, vocab: tuple[int, str], rows=None, log_probs=None) -> None:
    """`check=True`: the mask's own rules as batch validation's flags
    (`csr_flags`) and, with `rows` (the rows' tokens and positions, their
    support entries and each row's offsets into those), each token inside
    its support, and with `log_probs` (one per mask id) the log-prob rule,
    computed where the logits live and read back once by a `Verdict`. A
    broken rule is then located, reading freely, and raised naming its
    argument, the rule, the expected and the actual value: the mask's rules
    first, as the rows' supports mean nothing when they fail."""
    bound, source = vocab
    flags = [csr_flags(ids, offsets, bound)]
    outside = broken = None
    if rows is not None:
        tokens, _, entry_ids, entry_offsets = rows
        outside = ~inside_support(tokens, entry_ids, entry_offsets)
        flags.append(outside.any().reshape(1))
    if log_probs is not None:  # a NaN passes neither comparison
        broken = ~((log_probs <= LOG_PROB_TOLERANCE) & (log_probs > -math.inf))
        flags.append(broken.any().reshape(1))
    if Verdict(*flags).passed():
        return
    found = locate_csr_violations(ids, offsets, bound)
    if found:
        raise _refusal(found[0], source)
    if outside is not None and bool(outside.any()):
        raise _outside_refusal(outside, rows, ids, offsets)
    raise _log_prob_refusal(broken, log_probs, ids, offsets)


def _outside_refusal(outside, rows, ids, offsets) -> InvalidInput:
    """The first row whose token lies outside its support."""
    tokens, positions, _, _ = rows
    bad = torch.nonzero(outside)[:, 0]
    row = int(bad[0])
    token, position = int(tokens[row]), row if positions is None else int(positions[row])
    start, end = (int(offset) for offset in offsets[position : position + 2])
    support = f"{ids[start : min(end, start + 8)].tolist()}{'...' if end - start > 8 else ''}"
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return InvalidInput(f"tokens: rule '{RULE_IN_SUPPORT}' violated at row {row}: token {token} is not in its support "
                        f"{support} (mask token {position}){more}")


def _log_prob_refusal(broken, log_probs, ids, offsets) -> InvalidInput:
    """The first mask id whose log-prob breaks the rule (the offsets keep the CSR rules)."""
    bad = torch.nonzero(broken)[:, 0]
    entry = int(bad[0])
    position = int(torch.searchsorted(offsets, bad[:1], right=True)[0]) - 1
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    return InvalidInput(f"mask_log_probs: rule '{LOG_PROB_RULES['mask_log_probs']}' violated at mask token {position}: "
                        f"mask_log_prob is {float(log_probs[entry])} (support id {int(ids[entry])}, entry {entry}), "
                        f"expected finite and <= {LOG_PROB_TOLERANCE}{more}")


def _refusal(violation: Violation, source: str) -> InvalidInput:
    where = "" if violation.position is None else f" at mask token {violation.position}"
    more = f" (and {violation.count - 1} more)" if violation.count > 1 else ""
    vocab = f"; vocab_size is {source}" if violation.rule == RULE_MASK_VOCAB else ""
    return InvalidInput(f"{_ARGUMENT[violation.rule]}: rule '{violation.rule}' violated{where}: {violation.detail}{more}{vocab}")


def _in_slice(ids: torch.Tensor, tp_rank: int, vocab_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each id in this rank's vocab slice (clamped into it, so that
    every id indexes a real column) and whether the id lies inside it."""
    local = ids - tp_rank * vocab_local
    return local.clamp(0, vocab_local - 1), (local >= 0) & (local < vocab_local)


def dense_support_mask(logits: torch.Tensor, mask_ids, mask_offsets, positions, *, tp_rank: int = 0,
                       check: bool = False, vocab_size: int | None = None) -> torch.Tensor:
    """Boolean `[R, V_local]`: True at `(row, id - tp_rank * V_local)` for
    every support id inside this rank's vocab slice; other ids are skipped.
    `check=True` checks the mask's content first (`masked_log_probs`)."""
    rows, vocab_local = _rows_and_columns(logits)
    vocab = _vocabulary(vocab_local, tp_rank, vocab_size=vocab_size)
    ids, offsets, positions = _mask_arguments(mask_ids, mask_offsets, positions, rows)
    owner, ids, _ = _entries(ids, offsets, positions, rows, logits.device, vocab=vocab if check else None)
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
    check: bool = False,
    vocab_size: int | None = None,
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

    Types, ranks and lengths are always checked (host facts). `check=True`
    also checks the content, for a mask that did not come through batch
    validation, at the cost of one read of the device: offsets from 0 to
    `len(mask_ids)`, strictly increasing; ids in the whole vocabulary
    (`vocab_size` when given, which a slice computed without its group
    should give; else `V_local` times the group's size with `tp_group`;
    without one, `V_local` at rank 0, whose logits are then the whole
    vocabulary, and int32's range at a later rank, which cannot know the
    whole); each token inside its support. Unchecked broken content gives meaningless values,
    but nothing indexes past an array.
    """
    rows, vocab_local = _rows_and_columns(logits)
    _checked_temperature(temperature)
    vocab = _vocabulary(vocab_local, tp_rank, tp_group, vocab_size)
    device = logits.device
    tokens = _one_per_row("tokens", _typed("tokens", tokens, "token ids index the vocabulary"), rows)
    tokens = tokens.to(device, torch.int64, non_blocking=True)
    ids, offsets, positions = _mask_arguments(mask_ids, mask_offsets, positions, rows)
    owner, ids, _ = _entries(ids, offsets, positions, rows, device, vocab=vocab if check else None, tokens=tokens)
    # The support entries, then one entry per row for its token.
    entry_rows = torch.cat([owner, torch.arange(rows, device=device)])
    columns, inside = _in_slice(torch.cat([ids, tokens]), tp_rank, vocab_local)
    return _LogProbOverSupport.apply(logits, entry_rows, columns, inside, ids == tokens[owner], temperature, tp_group)


def support_kl(
    logits: torch.Tensor,
    mask_ids,
    mask_offsets,
    mask_log_probs,
    positions=None,
    *,
    temperature: float = 1.0,
    tp_rank: int = 0,
    tp_group=None,
    check: bool = False,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """`KL(sampler || trainer)` over each row's support, differentiable in
    `logits`: how far the trainer's truncated distribution has drifted from
    the one the sampler drew from, over every id it could have emitted, not
    only the sampled one.

    The sampler's distribution is `mask_log_probs` (one per mask id, a
    constant) renormalised over the row's support, so log-probs that sum to
    less than 1 there give the same result; the trainer's is
    `softmax(logits / T)` restricted to the support and renormalised:

        KL = sum_i p_s(i) (log p_s(i) - log p_t(i))
           = sum_i p_s(i) log p_s(i) - sum_i p_s(i) z_i/T + logsumexp_i z_i/T

    Its gradient in `z_i` is `(p_t(i) - p_s(i)) / T`. An id the sampler
    gives no mass adds nothing; a row with an empty support (which batch
    validation refuses) gives 0.

    Entries, tensor parallelism, memory, device reads and `check` follow
    `masked_log_probs`: under `tp_group` each rank keeps its slice's ids
    (the others are -inf to it) and the trainer's maximum, sum of
    exponentials and `sum_i p_s(i) z_i/T` are all-reduced, while the
    sampler's terms, held whole by every rank, are not. `check=True` also
    checks that `mask_log_probs` are finite and at most
    `LOG_PROB_TOLERANCE`, in the same one device read; their dtype (a float
    one) and their length (`len(mask_ids)`) are host facts, always checked.
    """
    rows, vocab_local = _rows_and_columns(logits)
    _checked_temperature(temperature)
    vocab = _vocabulary(vocab_local, tp_rank, tp_group, vocab_size)
    ids, offsets, positions = _mask_arguments(mask_ids, mask_offsets, positions, rows)
    log_probs = _log_probs_per_id(mask_log_probs, ids)
    owner, ids, sampler = _entries(ids, offsets, positions, rows, logits.device, vocab=vocab if check else None,
                                   log_probs=log_probs)
    columns, inside = _in_slice(ids, tp_rank, vocab_local)
    return _SupportKL.apply(logits, owner, columns, inside, sampler, temperature, tp_group)


def _row_peak(values: torch.Tensor, owner: torch.Tensor, rows: int, group=None) -> torch.Tensor:
    """Each row's largest entry, over `group`'s ranks when given: the shift
    that keeps exp() in range (the closed-form backwards do not depend on it)."""
    peak = torch.full((rows,), float("-inf"), dtype=values.dtype, device=values.device)
    peak = peak.scatter_reduce(0, owner, values, "amax")
    if group is not None:
        torch.distributed.all_reduce(peak, torch.distributed.ReduceOp.MAX, group=group)
    return peak


class _GradientPerEntry(torch.autograd.Function):
    """The primitives' shared backward: each forward saves one gradient per
    gathered entry (`_save`), which the backward scales by its row's
    incoming gradient and scatters into a zeroed tensor like the logits; a
    dense float32 gradient per gather would be twice the logits' bytes at bf16.

    Under a group the forward's sums are all-reduced and the backward is the
    identity for them: every rank computes the same result from the summed
    values, so each already holds the full gradient of its own share
    (Megatron's reduce-from-parallel-region)."""

    @staticmethod
    def _save(ctx, logits, entry_rows, columns, shares) -> None:
        ctx.save_for_backward(entry_rows, columns, shares)
        ctx.logits_like = (logits.shape, logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        entry_rows, columns, shares = ctx.saved_tensors
        shape, dtype = ctx.logits_like
        entries = (grad[entry_rows] * shares).to(dtype)
        logits_grad = torch.zeros(shape, dtype=dtype, device=grad.device)
        return logits_grad.index_put_((entry_rows, columns), entries, accumulate=True), None, None, None, None, None, None


class _LogProbOverSupport(_GradientPerEntry):
    """The masked log-prob from gathered entries.

    The token's own cell gets one entry, `(1 - p_y) / T`, so that the
    difference is taken in float32 before the cast (two entries summed in
    bf16 would lose `1 - p_y` when `p_y` is near 1); its support entries get 0."""

    @staticmethod
    def forward(ctx, logits, entry_rows, columns, inside, at_token, temperature, group):
        rows = logits.shape[0]
        count = len(entry_rows) - rows  # support entries; the rows' tokens follow
        owner = entry_rows[:count]
        work = torch.promote_types(logits.dtype, torch.float32)
        gathered = logits[entry_rows, columns].to(work) / temperature
        support = torch.where(inside[:count], gathered[:count], float("-inf"))
        token = torch.where(inside[count:], gathered[count:], 0.0)
        peak = _row_peak(support, owner, rows, group)
        exps = torch.exp(support - peak[owner])
        totals = torch.stack([torch.zeros_like(peak).index_add(0, owner, exps), token])
        if group is not None:
            torch.distributed.all_reduce(totals, group=group)
        sums, token = totals
        probs = exps / sums[owner]
        token_prob = torch.zeros_like(peak).index_add(0, owner, torch.where(at_token, probs, 0.0))
        shares = torch.cat([torch.where(at_token, 0.0, -probs), torch.where(inside[count:], 1 - token_prob, 0.0)])
        _GradientPerEntry._save(ctx, logits, entry_rows, columns, shares / temperature)
        return token - (torch.log(sums) + peak)


class _SupportKL(_GradientPerEntry):
    """The support KL from gathered entries. The trainer's logits are taken
    relative to its row's peak, so that no term grows with the logits'
    scale (only with the KL and the support's size) and rounding stays small
    beside the result; each entry's gradient, `p_t - p_s`, is one
    difference taken in float32 before the cast."""

    @staticmethod
    def forward(ctx, logits, owner, columns, inside, sampler, temperature, group):
        rows = logits.shape[0]
        work = torch.promote_types(logits.dtype, torch.float32)
        zeros = torch.zeros(rows, dtype=work, device=logits.device)
        # The sampler's distribution over each whole support: every rank holds it, nothing to reduce.
        sampler = sampler.to(work)
        sampler_peak = _row_peak(sampler, owner, rows)
        sampler_exps = torch.exp(sampler - sampler_peak[owner])
        sampler_sums = zeros.index_add(0, owner, sampler_exps)
        p_s = sampler_exps / sampler_sums[owner]
        log_p_s = sampler - (sampler_peak + torch.log(sampler_sums))[owner]
        weighted = p_s > 0  # 0 log 0 is 0, and so is 0 times a -inf logit
        # The trainer's, over the ids of this rank's slice, reduced over the group.
        trainer = torch.where(inside, logits[owner, columns].to(work) / temperature, float("-inf"))
        shifted = trainer - _row_peak(trainer, owner, rows, group)[owner]
        exps = torch.exp(shifted)
        cross = torch.where(inside & weighted, p_s * shifted, 0.0)
        totals = torch.stack([zeros.index_add(0, owner, exps), zeros.index_add(0, owner, cross)])
        if group is not None:
            torch.distributed.all_reduce(totals, group=group)
        sums, cross_sums = totals
        own = zeros.index_add(0, owner, torch.where(weighted, p_s * log_p_s, 0.0))
        shares = torch.where(inside, exps / sums[owner] - p_s, 0.0)
        _GradientPerEntry._save(ctx, logits, owner, columns, shares / temperature)
        has_support = torch.zeros(rows, dtype=torch.bool, device=logits.device).index_fill_(0, owner, True)
        return torch.where(has_support, own - cross_sums + torch.log(sums), 0.0)
