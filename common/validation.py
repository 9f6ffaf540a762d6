"""Vectorised checks of sampling masks, one mask or a whole packed batch.

The checks are written once against a small array shim, so the same code
runs on numpy (producer and broker, which never import torch) and on torch
tensors on any device (the consumer's GPU batch validation). Each check
reduces to a flag where the arrays live, and a valid batch comes back to
the host as one read of those flags (`packed_flags`, `Verdict`): every
other read would wait on the device. Positions are searched, reading
freely, only when a flag is set (`locate_violations`).

The costliest check, each sampled token inside its support, compares every
id with its token, spread over the ids by a prefix sum of their steps; then
with numpy alone the hits are paired with the supports by position, and
where torch is loaded they are counted by a second prefix sum (torch's
counts booleans faster than numpy's, docs/performance.md; on the host they
run on numpy buffers the thread reuses).

A packed batch is `S` samples laid end to end: `tokens` holds every sample's
response tokens, `response_lengths` says how many belong to each, and the mask
is one CSR over all of them (`mask_offsets` has `sum(response_lengths) + 1`
entries).
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Mapping, Sequence

import numpy as np

from .buffers import join_contiguous
from .contract import LOG_PROB_TOLERANCE, NACK_CODES, SUPPORT_LOG_PROB_ARRAYS, TOKEN_LOG_PROB_ARRAYS
from .errors import InvalidInput, LocalProtocolError, RollstreamError

RULE_ALIGNED = "per-token fields aligned (one entry per response token)"
RULE_NONEMPTY_OFFSETS = "offsets non-empty (N + 1 entries)"
RULE_OFFSETS_START = "offsets[0] == 0"
RULE_OFFSETS_END = "offsets[-1] == len(ids)"
RULE_NONEMPTY_SUPPORT = "non-empty support (strictly increasing offsets)"
RULE_IN_SUPPORT = "sampled token inside its support"
RULE_MASK_VOCAB = "mask ids in [0, vocab_size)"
RULE_TOKEN_VOCAB = "token ids in [0, vocab_size)"
RULE_LOSS_MASK = "loss_mask values in {0, 1}"
RULE_WHOLE_BATCH = "every sample of a batch carries the field or none does"
RULE_FORCED_SINGLETON = "forced tokens (loss_mask 0, log_prob 0.0) have the singleton support [token]"
# One log-prob rule, named per field it keeps: `log_probs` and each optional log-prob array.
LOG_PROB_RULES = {name: f"{name} are finite and <= 0 (within {LOG_PROB_TOLERANCE} for rounding)"
                  for name in ("log_probs", *TOKEN_LOG_PROB_ARRAYS, *SUPPORT_LOG_PROB_ARRAYS)}
RULE_LOG_PROBS = LOG_PROB_RULES["log_probs"]
RULE_SUPPORT_ALIGNED = "per-support-id fields aligned with mask_ids (one entry per support id)"
RULE_SUPPORT_NORMALIZED = (f"each support's probabilities sum to 1 (within {LOG_PROB_TOLERANCE}) "
                           "when mask_log_probs_normalized")


def _log_probs_broken(values):
    """Whether any of `values` (non-empty, numpy or torch) breaks the
    log-prob rule (`LOG_PROB_RULES`), as one flag where they live: two
    reductions, and a NaN makes both NaN, which neither comparison passes."""
    return ~((values.max() <= LOG_PROB_TOLERANCE) & (values.min() > -np.inf))


def _breaks_log_prob_rule(values):
    """Per entry, whether it breaks the log-prob rule (NaN passes neither comparison)."""
    return ~((values <= LOG_PROB_TOLERANCE) & (values > -np.inf))


_LONG_SEGMENT = 32  # mean ids per support from which a per-segment reduction is the cheaper one


class _NumpyOps:
    @staticmethod
    def fast_running_sum() -> bool:
        """Whether `running_sum` counts hits fast: torch's prefix sum of a
        boolean array is, and is used on numpy buffers (zero-copy) once the
        process has loaded torch (the consumer; the broker and producer never
        do). numpy's is not, so without torch the hits are paired with their
        supports instead (`_paired`)."""
        return "torch" in sys.modules

    @staticmethod
    def scratch(name: str, n: int, dtype: str):
        """`n` items of a buffer this thread reuses on every call asking for
        `name`: a fresh large array is fresh pages, and faulting them in was a
        large share of the whole validation (docs/performance.md).
        The contents are undefined and the next call with `name` overwrites
        them, so a scratch buffer never leaves the function that took it."""
        buffers = _SCRATCH.__dict__
        need = n * np.dtype(dtype).itemsize
        held = buffers.get(name)
        if held is None or held.nbytes < need:
            held = buffers[name] = np.empty(max(need, 2 * (0 if held is None else held.nbytes)), dtype=np.uint8)
        return held[:need].view(dtype)

    def running_sum(self, values, dtype: str, name: str):
        """`[0, v0, v0 + v1, ...]` in `dtype` (wrapping on overflow), in the
        scratch buffer `name`: by torch's prefix sum into uint8 where torch
        is loaded (several times numpy's speed there), else by numpy's (as
        fast as torch's or faster into 4- and 8-byte integers)."""
        out = self.scratch(name, len(values) + 1, dtype)
        out[0] = 0
        source = values.view(np.uint8) if values.dtype == np.bool_ else values
        torch = sys.modules.get("torch")
        if torch is None or out.itemsize >= 4:
            source.cumsum(dtype=out.dtype, out=out[1:])
        else:
            torch.cumsum(torch.from_numpy(source), 0, dtype=getattr(torch, dtype), out=torch.from_numpy(out[1:]))
        return out

    def equal(self, a, b, name: str):
        return np.equal(a, b, out=self.scratch(name, len(a), "bool"))

    def empty(self, n: int, dtype: str, name: str, like):
        return self.scratch(name, n, dtype)

    def zeros(self, n: int, dtype: str, name: str, like):
        out = self.scratch(name, n, dtype)
        out.fill(0)
        return out

    @staticmethod
    def put(target, index, values) -> None:
        target[index] = values

    @staticmethod
    def gather(values, index):
        return values[index]

    @staticmethod
    def cast(values, dtype: str):
        return values.astype(dtype, copy=False)

    @staticmethod
    def largest(values) -> int:
        return int(np.iinfo(values.dtype).max)

    @classmethod
    def segment_any(cls, flags, offsets):
        """Per CSR segment, whether any flag is set. Short segments (top-k
        supports): the running count of set flags grows across the segment
        (a prefix sum read at the offsets, cheaper than
        `logical_or.reduceat`, whose cost is per segment). Long ones (top-p
        supports of thousands of ids): `logical_or.reduceat`, which then
        costs next to nothing, over the non-empty segments (it would read
        an empty one's next flag)."""
        segments = len(offsets) - 1
        if segments and len(flags) >= _LONG_SEGMENT * segments:
            out = np.zeros(segments, dtype=bool)
            nonempty = offsets[1:] > offsets[:-1]
            starts = offsets[:-1][nonempty]
            if len(starts):
                out[nonempty] = np.logical_or.reduceat(flags, starts)
            return out
        # Counted from uint8 flags into a reused buffer: a bool-to-int64 prefix
        # sum into fresh pages cost ten times as much here.
        counts = cls.scratch("segment counts", len(flags) + 1, "int32" if len(flags) < 2**31 else "int64")
        counts[0] = 0
        np.cumsum(flags.view(np.uint8), dtype=counts.dtype, out=counts[1:])
        at = counts[offsets]
        return at[1:] != at[:-1]

    @staticmethod
    def nonzero(flags):
        return np.flatnonzero(flags)

    @staticmethod
    def to_host(values) -> np.ndarray:
        return np.asarray(values)

    @staticmethod
    def take(values, host_index: np.ndarray):
        return values[host_index]

    @staticmethod
    def fits_int32(values) -> bool:
        return values.dtype.itemsize < 4 or (values.dtype == np.int32) or (
            int(values.min()) >= -(2**31) and int(values.max()) < 2**31)

    @staticmethod
    def count_dtype(sizes, n_ids: int) -> str:
        """Hits counted in uint8 (a faster prefix sum than int64's on the
        CPU) when no support has 256 ids, so each support's count modulo
        256 stays exact."""
        return "uint8" if not len(sizes) or int(sizes.max()) < 256 else "int64"

    @staticmethod
    def bounded(offsets, n_ids: int, broken):
        """`offsets`, or None when the CSR rules fail (`broken`): reading that
        costs nothing on the host, and the in-support check is then skipped."""
        return None if broken else offsets

    @staticmethod
    def out_of_range(offsets, n_ids: int):
        """Whether any offset lies outside [0, n_ids]: one reduction over
        int64 offsets read as uint64, where negative ones are >= 2**63."""
        return _offsets_out_of_range(offsets, n_ids)

    @classmethod
    def outside(cls, values, vocab_size: int | None):
        """Whether any id lies outside [0, vocab_size) (two reductions, or
        one over int32 read as uint32, where negative ids are >= 2**31)."""
        bound = _vocab_bound(cls, values, vocab_size)
        if values.dtype == np.int32:
            return _MAX(values.view(np.uint32)) >= (2**31 if bound is None else bound)
        return (values.min() < 0) | (bound is not None and values.max() >= bound)

    @staticmethod
    def flags(values: Sequence, like) -> np.ndarray:
        return np.array(values, dtype=bool).reshape(-1)

    @staticmethod
    def flags_of(parts: Sequence[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts)

    @staticmethod
    def verdict_copy(flags: np.ndarray):
        """The host copy of a verdict's flags and the event it is complete at (none on the host)."""
        return flags, None


class _TorchOps:
    def __init__(self):
        import torch

        self._torch = torch

    @staticmethod
    def fast_running_sum() -> bool:
        return True

    def running_sum(self, values, dtype: str, name: str):
        torch = self._torch
        out = torch.empty(len(values) + 1, dtype=getattr(torch, dtype), device=values.device)
        out[:1] = 0
        source = values.view(torch.uint8) if values.dtype == torch.bool else values
        torch.cumsum(source, 0, dtype=out.dtype, out=out[1:])
        return out

    @staticmethod
    def equal(a, b, name: str):
        return a == b

    def empty(self, n: int, dtype: str, name: str, like):
        return self._torch.empty(n, dtype=getattr(self._torch, dtype), device=like.device)

    def zeros(self, n: int, dtype: str, name: str, like):
        return self._torch.zeros(n, dtype=getattr(self._torch, dtype), device=like.device)

    @staticmethod
    def put(target, index, values) -> None:
        target.index_copy_(0, index, values)

    @staticmethod
    def gather(values, index):
        return values.index_select(0, index)

    def cast(self, values, dtype: str):
        return values.to(getattr(self._torch, dtype))

    def largest(self, values) -> int:
        return int(self._torch.iinfo(values.dtype).max)

    @staticmethod
    def nonzero(flags):
        return flags.nonzero().flatten()

    @staticmethod
    def to_host(values) -> np.ndarray:
        if isinstance(values, (np.ndarray, list, tuple)):
            return np.asarray(values)
        return values.detach().cpu().numpy()

    def take(self, values, host_index: np.ndarray):
        return values[self._torch.as_tensor(host_index, device=values.device)]

    def fits_int32(self, values) -> bool:
        """From the dtype alone: reading the values would wait on the device."""
        torch = self._torch
        return values.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32)

    def count_dtype(self, sizes, n_ids: int) -> str:
        """int32 whatever the support sizes (the largest is on the device)."""
        return "int32" if n_ids < 2**31 else "int64"

    @staticmethod
    def bounded(offsets, n_ids: int, broken):
        """`offsets` clamped into [0, n_ids], so the in-support check indexes
        safely whatever they hold, without reading whether the CSR rules hold
        (its result then means nothing, and `broken` says so)."""
        return offsets.clamp(0, n_ids)

    def out_of_range(self, offsets, n_ids: int):
        low, high = self._torch.aminmax(offsets)
        return (low < 0) | (high > n_ids)

    def outside(self, values, vocab_size: int | None):
        low, high = self._torch.aminmax(values)
        bound = _vocab_bound(self, values, vocab_size)
        return (low < 0) | (high >= bound) if bound is not None else low < 0

    def flags(self, values: Sequence, like):
        torch = self._torch
        return torch.stack([torch.as_tensor(v, dtype=torch.bool, device=like.device).reshape(()) for v in values])

    def flags_of(self, parts: Sequence):
        return self._torch.cat(list(parts))

    def verdict_copy(self, flags):
        """On CUDA, a non-blocking copy of the flags into pinned host memory
        and an event recorded behind it on the current stream: the host read
        then waits for this batch's checks alone."""
        torch = self._torch
        if flags.device.type != "cuda":
            return flags, None
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event


_NUMPY = _NumpyOps()
_SCRATCH = threading.local()


def _ops_for(array):
    return _NUMPY if isinstance(array, np.ndarray) else _TorchOps()


def _vocab_bound(ops, values, vocab_size: int | None) -> int | None:
    """`vocab_size`, or None when no value of `values`' integer dtype reaches
    it: torch compares a tensor with a Python int its dtype cannot hold as
    that int wrapped around (int32 ids against 2**31 all read as outside)."""
    return None if vocab_size is None or vocab_size > ops.largest(values) else vocab_size


@dataclass(frozen=True)
class Violation:
    """One rule broken by one sample: where it first fails and how often."""

    rule: str
    sample: int  # position of the sample in the batch
    position: int | None  # first failing token position in that sample's response
    count: int  # failing positions in that sample
    detail: str

    def describe(self, sample_name: str | None = None) -> str:
        who = f"sample {self.sample}" + (f" ({sample_name})" if sample_name else "")
        where = "" if self.position is None else f" token {self.position}"
        more = f" (and {self.count - 1} more)" if self.count > 1 else ""
        return f"{who}{where}: rule '{self.rule}' violated: {self.detail}{more}"


class BatchValidationError(RollstreamError, ValueError):
    """A batch broke one or more mask rules; `violations` lists each."""

    code = "invalid_batch"

    def __init__(self, violations: Sequence[Violation], sample_names: Sequence[str] | None = None):
        self.violations = list(violations)
        names: Sequence[str | None] = sample_names or [None] * (1 + max(v.sample for v in self.violations))
        lines = [v.describe(names[v.sample] if v.sample >= 0 else None) for v in self.violations]
        super().__init__(f"{len(self.violations)} mask violation(s):\n  " + "\n  ".join(lines))


def _group_by_sample(rule, global_positions, cu_host, detail_of) -> list[Violation]:
    """Turn failing global token positions into one Violation per sample."""
    positions = np.asarray(global_positions, dtype=np.int64)
    if positions.size == 0:
        return []
    samples = np.searchsorted(cu_host, positions, side="right") - 1
    starts = np.flatnonzero(np.concatenate(([True], samples[1:] != samples[:-1])))
    counts = np.diff(np.append(starts, positions.size))
    out = []
    for start, count in zip(starts.tolist(), counts.tolist()):
        g = int(positions[start])
        s = int(samples[start])
        out.append(Violation(rule, s, g - int(cu_host[s]), count, detail_of(g)))
    return out


def _cumsum0(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out


def _csr_violations(ops, ids, offsets, cu_host) -> tuple[list[Violation], Any]:
    """Structural CSR rules, and the support sizes when they hold (the
    per-token checks need them and are unsafe when a rule fails)."""
    if len(offsets) == 0:
        return [Violation(RULE_NONEMPTY_OFFSETS, 0, None, 1, "offsets is empty")], None
    found = []
    first, end = int(offsets[0]), int(offsets[-1])
    if first != 0:
        found.append(Violation(RULE_OFFSETS_START, 0, None, 1, f"expected 0, got {first}"))
    if end != len(ids):
        found.append(Violation(RULE_OFFSETS_END, max(len(cu_host) - 2, 0), None, 1, f"expected {len(ids)}, got {end}"))
    # Compared, not subtracted: the difference of far-apart int64 offsets wraps around.
    not_increasing = offsets[1:] <= offsets[:-1]
    if len(not_increasing) and bool(not_increasing.any()):
        host_offsets = ops.to_host(offsets)
        found += _group_by_sample(
            RULE_NONEMPTY_SUPPORT,
            ops.to_host(ops.nonzero(not_increasing)),
            cu_host,
            lambda g: f"offsets[{g}] = {int(host_offsets[g])}, offsets[{g + 1}] = {int(host_offsets[g + 1])}",
        )
    # Strictly increasing from 0 to len(ids): every offset lies in range, so no size wrapped.
    return found, None if found else offsets[1:] - offsets[:-1]


def _one_sample(offsets) -> np.ndarray:
    """The cumulative response lengths of a batch whose one sample is the mask's tokens."""
    return np.array([0, max(len(offsets) - 1, 0)])


def csr_problem(ids, offsets) -> str | None:
    """The first CSR rule a single mask breaks, as a message, or None."""
    found, _ = _csr_violations(_ops_for(offsets), ids, offsets, _one_sample(offsets))
    if not found:
        return None
    v = found[0]
    where = "" if v.position is None else f" at token {v.position}"
    return f"sampling mask rule '{v.rule}' violated{where}: {v.detail}"


_native: ModuleType | None
try:  # the support check compiled (common/_native.c), built with the package where a C compiler is at hand
    from . import _native
except ImportError:  # pragma: no cover - a build without one checks with numpy
    _native = None
_INT32, _INT64 = np.dtype(np.int32), np.dtype(np.int64)


def _compiled_inside(tokens, ids, offsets):
    """`inside_support` in one compiled pass, for numpy arrays or CPU torch
    tensors of the contract dtypes (int32 tokens and ids, int64 offsets); None
    for anything else."""
    torch = None
    if type(tokens) is not np.ndarray:
        torch = sys.modules.get("torch")
        if torch is None or not all(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in (tokens, ids, offsets)):
            return None
        tokens, ids, offsets = tokens.numpy(), ids.numpy(), offsets.numpy()
    elif type(ids) is not np.ndarray or type(offsets) is not np.ndarray:
        return None
    if tokens.dtype != _INT32 or ids.dtype != _INT32 or offsets.dtype != _INT64:
        return None
    inside = np.empty(len(tokens), dtype=bool)
    _native.inside_support(np.ascontiguousarray(tokens), np.ascontiguousarray(ids),  # type: ignore[union-attr]
                           np.ascontiguousarray(offsets), inside)
    return inside if torch is None else torch.from_numpy(inside)


def inside_support(tokens, ids, offsets, sizes=None):
    """Per token, whether `tokens[t]` is in `ids[offsets[t]:offsets[t+1]]`.

    One pass over the ids: compare each id with its own token, then OR the
    hits of each support (no per-token loop, no padding); compiled
    (`_native`) for numpy arrays of the contract dtypes when the package was
    built with it. The offsets must already satisfy the CSR rules (where
    they do not, the answer means nothing, but nothing is read out of range).
    """
    if _native is not None:
        inside = _compiled_inside(tokens, ids, offsets)
        if inside is not None:
            return inside
    ops = _ops_for(tokens)
    if sizes is None:
        sizes = offsets[1:] - offsets[:-1]
    if type(ids) is np.ndarray and type(tokens) is np.ndarray and _equal_and_long(sizes, offsets, len(ids)):
        # Every support equally long (top-k, a fixed top-p cut): the ids as a
        # (tokens, size) matrix against the tokens as a column, with no
        # spread copy of the tokens (cheaper, and far less memory traffic on
        # 4,096-id supports).
        return np.logical_or.reduce(np.equal(ids.reshape(len(sizes), -1), tokens[:, None]), axis=1)
    if not ops.fast_running_sum():  # one int32 prefix sum spreads the tokens (a third of a repeat's cost)
        hits = ids == _spread(ops, tokens, offsets, len(ids))
        if (inside := _paired(hits, offsets)) is not None:  # pairing, not a second prefix sum
            return inside
        return ops.segment_any(hits, offsets)
    return _inside_by_counts(ops, tokens, ids, offsets, sizes)


def _inside_by_counts(ops, tokens, ids, offsets, sizes):
    """`inside_support` as two running sums: the tokens spread over the ids,
    then the hits counted and compared at the support ends. Indexes only
    within [0, len(ids)], so offsets `bounded` by the ops are safe."""
    hits = ops.equal(ids, _spread(ops, tokens, offsets, len(ids)), "hits")
    running = ops.gather(ops.running_sum(hits, ops.count_dtype(sizes, len(ids)), "hit counts"), offsets)
    return running[1:] != running[:-1]


def _paired(hits: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
    """All true when every support holds a hit (valid data), found from the
    positions of the hits alone: with one hit per support the i-th lies in
    support i, which a per-support comparison shows, with no prefix sum
    over the ids (numpy's run at a few ns an id). A support holding its
    token twice shifts the pairing by one from there: the extra hit is
    skipped and the block compared again (blocks of `_PAIRING_BLOCK`
    supports keep that cheap), up to `_REPAIRS` times. None when a support
    lacks a hit, or after that many repairs: the count decides."""
    where = hits.nonzero()[0]  # the method: numpy's function wrapper costs more than small arrays' work
    starts, ends = offsets[:-1], offsets[1:]
    n, segment, match, repairs = len(starts), 0, 0, 0  # supports before `segment`, hits before `match` paired
    while segment < n:
        count = min(_PAIRING_BLOCK, n - segment)
        if len(where) - match < count:
            return None  # fewer hits left than supports
        found = where[match : match + count]
        paired = (found >= starts[segment : segment + count]) & (found < ends[segment : segment + count])
        if _ALL(paired):
            segment, match = segment + count, match + count
            continue
        first = int(np.argmin(paired))
        segment, match = segment + first, match + first
        if where[match] >= starts[segment] or repairs == _REPAIRS:
            return None  # past this support's end (it lacks a hit), or too many repairs
        match, repairs = match + 1, repairs + 1  # a second hit in the support before
    return np.ones(n, dtype=bool)


_PAIRING_BLOCK = 16384
_REPAIRS = 64  # supports holding their token twice that `_paired` pairs around


def _equal_and_long(sizes, offsets, total: int) -> bool:
    """Whether every support has the same size, of at least `_LONG_SEGMENT`
    ids (shorter ones are cheaper through the running count), laid end to
    end from 0."""
    return (len(sizes) > 0 and sizes[0] >= _LONG_SEGMENT and total == sizes[0] * len(sizes) and offsets[0] == 0
            and _MIN(sizes) == _MAX(sizes))


def _spread(ops, values, offsets, total: int):
    """`values[t]` at each of segment t's `total` positions, as the running
    sum of the steps between consecutive values, each step placed at its
    segment's start: about twice as fast as a repeat on the CPU, a GPU
    needs no output size from the host, and offsets the ops `bounded` (in
    range, in any order) index safely where a repeat would refuse their
    negative sizes. Steps and sums wrap around, so each segment still lands
    exactly on its value: in int32 when the values fit it, else in int64.
    The values are cast first (a narrow dtype's own steps would wrap in it).
    The result may be a scratch buffer."""
    if len(values) == 0:
        return values[:0]
    dtype = "int32" if ops.fits_int32(values) else "int64"
    values = ops.cast(values, dtype)
    steps = ops.empty(len(values), dtype, "steps", values)  # every entry is written next
    steps[:1] = values[:1]
    steps[1:] = values[1:] - values[:-1]
    # One slot past the end: bounded offsets of an empty last support point there.
    spread = ops.zeros(total + 1, dtype, "spread steps", values)
    ops.put(spread, offsets[:-1], steps)
    return ops.running_sum(spread[:total], dtype, "spread")[1:]


def _outside_vocab(values, vocab_size: int | None):
    """Flags of ids outside [0, vocab_size), or None when all are inside
    (decided with one or two reductions, so valid data costs no mask array)."""
    if len(values) == 0:
        return None
    bound = _vocab_bound(_ops_for(values), values, vocab_size)
    if isinstance(values, np.ndarray) and values.dtype == np.int32:
        if int(values.view(np.uint32).max()) < (2**31 if bound is None else bound):  # negative ids read as uint32 are >= 2**31
            return None
    elif int(values.min()) >= 0 and (bound is None or int(values.max()) < bound):
        return None
    return (values < 0) if bound is None else ((values < 0) | (values >= bound))


def packed_violations(
    tokens,
    response_lengths,
    mask_ids=None,
    mask_offsets=None,
    *,
    mask_lengths=None,
    vocab_size: int | None = None,
    loss_mask=None,
    log_probs=None,
    token_log_probs: Mapping[str, Any] | None = None,
    support_log_probs: Mapping[str, Any] | None = None,
    marks_forced: bool = True,
) -> list[Violation]:
    """Every rule each sample of a packed batch breaks (empty when valid).

    Without a mask only the token ids and the loss mask are checked.
    `mask_lengths`, when given, is each sample's mask length and is checked
    against `response_lengths`; otherwise only the totals are compared.
    `log_probs`, when given, must keep `RULE_LOG_PROBS`, and each array of
    `token_log_probs` (by name: `full_log_probs`) its rule of
    `LOG_PROB_RULES`, one entry per token as well, and each array of
    `support_log_probs` (`mask_log_probs`) its rule, one entry per support
    id (`RULE_SUPPORT_ALIGNED`). In merged
    trajectories (`marks_forced`), `log_probs` with `loss_mask` and a mask
    also mark the forced tokens (loss 0 and log-prob exactly 0.0,
    semantics.md §3), whose supports must be singletons (the in-support rule
    then makes the one id equal the token). A turn's tokens are all sampled
    (its forced tokens travel apart), so a turn is checked without it.
    Valid data costs a few whole-array reductions and one read of their
    flags (`packed_flags`, `Verdict`); positions are searched
    (`locate_violations`) only when a flag is set.
    """
    options = dict(mask_lengths=mask_lengths, vocab_size=vocab_size, loss_mask=loss_mask, log_probs=log_probs,
                   token_log_probs=token_log_probs, support_log_probs=support_log_probs, marks_forced=marks_forced)
    if Verdict(packed_flags(tokens, response_lengths, mask_ids, mask_offsets, **options)).passed():
        return []
    return locate_violations(tokens, response_lengths, mask_ids, mask_offsets, **options)


class Verdict:
    """Whether packed arrays broke any rule, as flags still where they were
    computed (one per check, `packed_flags`). A valid batch is the common
    case, so it costs one host read (`passed`); on CUDA the flags are copied
    into pinned host memory behind an event as soon as the verdict is made,
    so the checks can run ahead (on a side stream, say) and the read wait
    for them alone."""

    def __init__(self, *flags):
        ops = _ops_for(flags[0])
        self.flags = flags[0] if len(flags) == 1 else ops.flags_of(flags)
        self._host, self.event = ops.verdict_copy(self.flags)

    def passed(self) -> bool:
        """Whether no rule failed: the one read of the device."""
        if self.event is not None:
            self.event.synchronize()
        return not bool(self._host.any())


def _structure_problem(total: int, response_lengths_host, mask_ids, mask_offsets, mask_lengths, loss_mask, log_probs,
                       token_log_probs, support_log_probs) -> bool:
    """Whether a packed batch's shapes break a rule (host facts alone)."""
    if any(values is not None and len(values) != total for values in (loss_mask, log_probs)):
        return True
    if token_log_probs and any(len(values) != total for values in token_log_probs.values()):
        return True
    if support_log_probs and any(_support_misalignment(name, values, mask_ids)
                                 for name, values in support_log_probs.items()):
        return True
    if mask_offsets is None:
        return False
    if mask_lengths is not None and not np.array_equal(np.asarray(mask_lengths), response_lengths_host):
        return True
    return len(mask_offsets) != total + 1


def _support_misalignment(name: str, values, mask_ids) -> str | None:
    """How `values` (one per support id) break `RULE_SUPPORT_ALIGNED`
    beside `mask_ids` (None: no mask), or None when they keep it."""
    if mask_ids is None:
        return f"{name} has {len(values)} entries, no sampling mask"
    if len(values) != len(mask_ids):
        return f"{name} has {len(values)} entries, mask_ids has {len(mask_ids)}"
    return None


def _packed_total(ops, tokens, response_lengths) -> tuple[np.ndarray, int]:
    """The response lengths on the host and their sum, which `tokens` must hold."""
    lengths_host = ops.to_host(response_lengths).astype(np.int64, copy=False)
    total = int(lengths_host.sum())
    if len(tokens) != total:
        raise InvalidInput(f"packed batch: tokens must have as many entries as response_lengths sum to ({total}), "
                           f"it has {len(tokens)}")
    return lengths_host, total


def packed_flags(
    tokens,
    response_lengths,
    mask_ids=None,
    mask_offsets=None,
    *,
    mask_lengths=None,
    vocab_size: int | None = None,
    loss_mask=None,
    log_probs=None,
    token_log_probs: Mapping[str, Any] | None = None,
    support_log_probs: Mapping[str, Any] | None = None,
    marks_forced: bool = True,
):
    """`packed_violations`' checks as flags, one per check, set when it
    fails, computed where the arrays live without reading any value back
    (host facts, the lengths and shapes, decide the rest). Every check runs
    whatever the others found: on broken CSR offsets the in-support check
    still runs on offsets the ops bound into range and means nothing, but
    the CSR flag is set then, and `locate_violations` reports the CSR rules
    alone, as it always has."""
    ops = _ops_for(tokens)
    lengths_host, total = _packed_total(ops, tokens, response_lengths)
    if _structure_problem(total, lengths_host, mask_ids, mask_offsets, mask_lengths, loss_mask, log_probs,
                          token_log_probs, support_log_probs):
        return ops.flags([True], tokens)
    flags: list[Any] = []
    if mask_offsets is not None:
        mask_flags, sizes = _mask_checks(ops, mask_ids, mask_offsets, vocab_size)
        flags += mask_flags
        bounded = ops.bounded(mask_offsets, len(mask_ids), mask_flags[0])
        if total and bounded is not None:
            flags.append(~inside_support(tokens, mask_ids, bounded, sizes if bounded is mask_offsets else None).all())
        if marks_forced and loss_mask is not None and log_probs is not None and total:
            flags.append(((loss_mask == 0) & (log_probs == 0) & (sizes != 1)).any())
    if total:
        flags.append(ops.outside(tokens, vocab_size))
        if loss_mask is not None:
            flags.append((loss_mask.min() < 0) | (loss_mask.max() > 1))
        if log_probs is not None:
            flags.append(_log_probs_broken(log_probs))
        if token_log_probs:
            flags += [_log_probs_broken(values) for values in token_log_probs.values()]
    if support_log_probs and mask_ids is not None and len(mask_ids):
        flags += [_log_probs_broken(values) for values in support_log_probs.values()]
    return ops.flags(flags, tokens)


def _mask_checks(ops, ids, offsets, vocab_size: int | None) -> tuple[list[Any], Any]:
    """`csr_flags`' flags, the offsets' first, and the offsets' differences:
    the support sizes where the offsets keep the rules (wrapped around
    where they do not). `offsets` has at least one entry."""
    n_ids = len(ids)
    sizes = offsets[1:] - offsets[:-1]
    broken = (offsets[0] != 0) | (offsets[-1] != n_ids)
    if len(sizes):  # in range, sizes cannot wrap around, so positive ones mean strictly increasing offsets
        broken = broken | (sizes.min() <= 0) | ops.out_of_range(offsets, n_ids)
    return [broken, ops.outside(ids, vocab_size)] if n_ids else [broken], sizes


def csr_flags(ids, offsets, vocab_size: int | None = None):
    """A mask's own rules as flags where it lives, with no host read:
    offsets from 0 to `len(ids)`, strictly increasing, and ids in
    [0, vocab_size). `packed_flags` less its tokens, for a caller that
    checks them against the supports itself (rows that pick supports out
    of order); `locate_csr_violations` explains a failed verdict."""
    ops = _ops_for(offsets)
    if not len(offsets):
        return ops.flags([True], offsets)
    return ops.flags(_mask_checks(ops, ids, offsets, vocab_size)[0], offsets)


def locate_csr_violations(ids, offsets, vocab_size: int | None = None) -> list[Violation]:
    """`csr_flags`' rules as `locate_violations` reports them for a batch
    whose one sample is the mask's tokens (the CSR rules, else the ids
    outside the vocabulary), reading freely."""
    ops = _ops_for(offsets)
    cu_host = _one_sample(offsets)
    found, _ = _csr_violations(ops, ids, offsets, cu_host)
    return found or _mask_vocab_violations(ops, ids, offsets, vocab_size, cu_host)


def _mask_vocab_violations(ops, ids, offsets, vocab_size: int | None, cu_host) -> list[Violation]:
    """`RULE_MASK_VOCAB` per sample, at the first token whose support holds
    an id outside [0, vocab_size) (the offsets keep the CSR rules)."""
    bad_ids = _outside_vocab(ids, vocab_size)
    if bad_ids is None:
        return []
    bad_index = ops.to_host(ops.nonzero(bad_ids))
    bad_values = ops.to_host(ops.take(ids, bad_index))
    token_of_id = np.searchsorted(ops.to_host(offsets), bad_index, side="right") - 1
    bad_tokens, first = np.unique(token_of_id, return_index=True)
    first_bad = dict(zip(bad_tokens.tolist(), bad_values[first].tolist()))
    upper = "inf" if vocab_size is None else vocab_size
    return _group_by_sample(
        RULE_MASK_VOCAB, bad_tokens, cu_host, lambda g: f"its support holds id {first_bad[g]}, outside [0, {upper})"
    )


def locate_violations(
    tokens,
    response_lengths,
    mask_ids=None,
    mask_offsets=None,
    *,
    mask_lengths=None,
    vocab_size: int | None = None,
    loss_mask=None,
    log_probs=None,
    token_log_probs: Mapping[str, Any] | None = None,
    support_log_probs: Mapping[str, Any] | None = None,
    marks_forced: bool = True,
) -> list[Violation]:
    """`packed_violations` without its verdict: the search for each failing
    sample, position and rule, reading back whatever it needs. Run it once
    a `Verdict` failed."""
    ops = _ops_for(tokens)
    lengths_host, total = _packed_total(ops, tokens, response_lengths)
    cu_host = _cumsum0(lengths_host)
    log_prob_arrays = {"log_probs": log_probs, **(token_log_probs or {})}
    for name, values in (("loss_mask", loss_mask), *log_prob_arrays.items()):
        if values is not None and len(values) != total:
            return [Violation(RULE_ALIGNED, 0, None, 1, f"{name} has {len(values)} entries, expected {total}")]
    n_ids = 0 if mask_ids is None else len(mask_ids)
    for name, values in (support_log_probs or {}).items():
        problem = _support_misalignment(name, values, mask_ids)
        if problem:
            return [Violation(RULE_SUPPORT_ALIGNED, 0, None, 1, problem)]

    tokens_host = None

    def token_at(g):
        nonlocal tokens_host
        if tokens_host is None:
            tokens_host = ops.to_host(tokens)
        return int(tokens_host[g])

    upper = "inf" if vocab_size is None else vocab_size
    found: list[Violation] = []
    if mask_offsets is not None:
        if mask_lengths is not None:
            mask_lengths_host = ops.to_host(mask_lengths).astype(np.int64, copy=False)
            bad = np.flatnonzero(mask_lengths_host != lengths_host)
            if bad.size:
                return [
                    Violation(
                        RULE_ALIGNED, int(s), None, 1,
                        f"mask has {int(mask_lengths_host[s])} tokens, response has {int(lengths_host[s])}",
                    )
                    for s in bad
                ]
        if len(mask_offsets) != total + 1:
            return [Violation(RULE_ALIGNED, 0, None, 1, f"mask_offsets has {len(mask_offsets)} entries, expected {total + 1}")]
        found, sizes = _csr_violations(ops, mask_ids, mask_offsets, cu_host)
        if found:
            return found
        inside = inside_support(tokens, mask_ids, mask_offsets, sizes)
        if total and not bool(inside.all()):

            def support_at(g):
                lo, hi = int(mask_offsets[g]), int(mask_offsets[g + 1])
                shown = ops.to_host(mask_ids[lo : min(hi, lo + 8)]).tolist()
                return f"{shown}{'...' if hi - lo > 8 else ''}"

            found += _group_by_sample(
                RULE_IN_SUPPORT, ops.to_host(ops.nonzero(~inside)), cu_host,
                lambda g: f"token {token_at(g)} is not in its support {support_at(g)}",
            )
        if marks_forced and loss_mask is not None and log_probs is not None and total:
            not_singleton = (loss_mask == 0) & (log_probs == 0) & (sizes != 1)
            if bool(not_singleton.any()):
                host_sizes = ops.to_host(sizes)
                found += _group_by_sample(
                    RULE_FORCED_SINGLETON, ops.to_host(ops.nonzero(not_singleton)), cu_host,
                    lambda g: f"forced token {token_at(g)} has a support of {int(host_sizes[g])} ids, expected 1",
                )
        found += _mask_vocab_violations(ops, mask_ids, mask_offsets, vocab_size, cu_host)
    bad_tokens = _outside_vocab(tokens, vocab_size)
    if bad_tokens is not None:
        found += _group_by_sample(
            RULE_TOKEN_VOCAB, ops.to_host(ops.nonzero(bad_tokens)), cu_host,
            lambda g: f"token {token_at(g)} is outside [0, {upper})",
        )
    if loss_mask is not None and total and (int(loss_mask.min()) < 0 or int(loss_mask.max()) > 1):
        loss_host = ops.to_host(loss_mask)
        bad_loss = np.flatnonzero((loss_host != 0) & (loss_host != 1))
        found += _group_by_sample(RULE_LOSS_MASK, bad_loss, cu_host, lambda g: f"loss_mask is {int(loss_host[g])}")
    for name, values in log_prob_arrays.items():
        if values is not None and total and bool(_log_probs_broken(values)):
            found += _log_prob_violations(ops, name, values, cu_host)
    for name, values in (support_log_probs or {}).items():
        if n_ids and mask_offsets is not None and bool(_log_probs_broken(values)):
            found += _support_log_prob_violations(ops, name, values, mask_offsets, cu_host)
    return found


def _log_prob_violations(ops, name: str, values, cu_host) -> list[Violation]:
    """`name`'s rule of `LOG_PROB_RULES` per sample, at its first broken entry."""
    host = ops.to_host(values)
    return _group_by_sample(
        LOG_PROB_RULES[name], ops.to_host(ops.nonzero(_breaks_log_prob_rule(values))), cu_host,
        lambda g: f"{name.removesuffix('s')} is {float(host[g])}, expected finite and <= {LOG_PROB_TOLERANCE}",
    )


def _support_log_prob_violations(ops, name: str, values, offsets, cu_host) -> list[Violation]:
    """`name`'s rule of `LOG_PROB_RULES` per sample, at the first token
    whose support holds a broken entry."""
    host = ops.to_host(values)
    bad = ops.to_host(ops.nonzero(_breaks_log_prob_rule(values)))
    token_of_entry = np.searchsorted(ops.to_host(offsets), bad, side="right") - 1
    first_bad = dict(zip(token_of_entry[::-1].tolist(), host[bad[::-1]].tolist()))  # the first entry wins
    return _group_by_sample(
        LOG_PROB_RULES[name], np.unique(token_of_entry), cu_host,
        lambda g: f"its support holds a {name.removesuffix('s')} of {first_bad[g]}, expected finite and "
                  f"<= {LOG_PROB_TOLERANCE}",
    )


def pack_csr(ids_list: Sequence[np.ndarray], offsets_list: Sequence[np.ndarray],
             out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Lay CSR masks end to end: one ids array, one offsets array over all
    their tokens (a loop over masks, never over tokens). `out`, when given,
    is the pair of arrays to pack into (a pinned staging buffer, so nothing
    is copied twice): int32 ids and int64 offsets of the packed sizes."""
    if out is None:
        out = (np.empty(sum(len(i) for i in ids_list), np.int32),
               np.empty(1 + sum(len(o) - 1 for o in offsets_list), np.int64))
    ids, offsets = out
    if len(ids_list):
        np.concatenate(ids_list, out=ids, casting="same_kind")
    offsets[0] = 0
    base, pos = 0, 1
    for part_ids, part_offsets in zip(ids_list, offsets_list):
        n = len(part_offsets) - 1
        np.add(part_offsets[1:], base, out=offsets[pos : pos + n])
        base += len(part_ids)
        pos += n
    return ids, offsets


# The fast checks (the broker's per frame, packing's per sample) name the one optional per-token log-prob array
# and the one per-id array themselves: a loop over the table would cost every frame without them. Unpacked, so a
# second entry in the table fails here, at import.
(_FULL_LOG_PROBS,) = TOKEN_LOG_PROB_ARRAYS
(_MASK_LOG_PROBS,) = SUPPORT_LOG_PROB_ARRAYS
# The arrays `_native.pack_checked` reads from each sample, by role, in its order.
_SAMPLE_ROLES = ("tokens", "log_probs", "loss_mask", "mask_ids", "mask_offsets", "prompt_tokens", _FULL_LOG_PROBS,
                 _MASK_LOG_PROBS)


def pack_checked(samples: Sequence[Mapping[str, np.ndarray]], out: Sequence[np.ndarray | None],
                 vocab_size: int | None = None) -> bool | None:
    """Lay samples end to end into `out` (sequences: each sample's prompt
    then response tokens; response tokens; log-probs; loss mask; support ids
    and offsets as `pack_csr` lays them, both None for samples without a
    mask; full_log_probs and mask_log_probs, each None for samples without
    them) and check `packed_flags`' rules on each sample while its bytes are
    in cache, instead of a pass over the packed batch per rule afterwards
    (each sample's offsets run from 0 to its ids' end as well, a rule the
    packed offsets no longer show). True when every rule holds; False when
    one does not (the check of the packed batch then names it, or the
    consumer's per-sample check already did); None, with nothing written,
    where the compiled module cannot pack them (not built, an array of
    another dtype, or arrays that do not align: the caller packs them its
    own way)."""
    if _native is None or type(samples) is not list:
        return None
    bound = 2**31 if vocab_size is None else vocab_size  # negative int32 ids read as uint32 are >= 2**31
    try:
        return _native.pack_checked(samples, _SAMPLE_ROLES, tuple(out), bound, LOG_PROB_TOLERANCE)
    except (ValueError, TypeError, BufferError):
        return None


def validate_samples(
    tokens: Sequence[np.ndarray],
    masks: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    names: Sequence[str] | None = None,
    vocab_size: int | None = None,
    loss_masks: Sequence[np.ndarray] | None = None,
) -> None:
    """Check a batch of samples given as per-sample response tokens and
    `(ids, offsets)` masks in one vectorised pass; raise
    `BatchValidationError` naming every failing sample, position and rule."""
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    mask_lengths = np.array([len(offsets) - 1 for _, offsets in masks], dtype=np.int64)
    ids, offsets = pack_csr([m[0] for m in masks], [m[1] for m in masks])
    found = packed_violations(
        np.concatenate([np.empty(0, np.int32), *tokens]).astype(np.int32, copy=False),
        lengths,
        ids,
        offsets,
        mask_lengths=mask_lengths,
        vocab_size=vocab_size,
        loss_mask=None if loss_masks is None else np.concatenate([np.empty(0, np.uint8), *loss_masks]),
    )
    if found:
        raise BatchValidationError(found, names)


def whole_batch_problem(field: str, position: int, sample_index: Any, status: Any) -> str:
    """How docs/semantics.md §6's whole-batch rule reads when the sample at
    `position` lacks `field`."""
    return (f"the batch carries a {field} but the sample at position {position} "
            f"(sample_index={sample_index}, status={status}) has none")


def check_whole_batch_rule(
    has_field: Sequence[bool], sample_indices: Sequence[Any], statuses: Sequence[Any], field: str = "sampling mask"
) -> None:
    """docs/semantics.md §6: if any sample of a batch carries `field`, every sample must."""
    if any(has_field) and not all(has_field):
        position = list(has_field).index(False)
        raise InvalidInput(
            f"rule '{RULE_WHOLE_BATCH}' violated: "
            + whole_batch_problem(field, position, sample_indices[position], statuses[position])
        )


# Reply code of each rule, for refusing a single message (docs/protocol.md §2).
RULE_CODES = {
    RULE_ALIGNED: "misaligned",
    RULE_NONEMPTY_OFFSETS: "mask_invalid",
    RULE_OFFSETS_START: "mask_invalid",
    RULE_OFFSETS_END: "mask_invalid",
    RULE_NONEMPTY_SUPPORT: "mask_invalid",
    RULE_IN_SUPPORT: "mask_invalid",
    RULE_MASK_VOCAB: "out_of_vocab",
    RULE_TOKEN_VOCAB: "out_of_vocab",
    RULE_LOSS_MASK: "invalid_value",
    RULE_FORCED_SINGLETON: "mask_invalid",
    **dict.fromkeys(LOG_PROB_RULES.values(), "invalid_value"),
    RULE_SUPPORT_ALIGNED: "misaligned",
    RULE_SUPPORT_NORMALIZED: "invalid_value",
}
_CODE_ORDER = {code: i for i, code in enumerate(NACK_CODES)}


def _concat(parts: list[np.ndarray]) -> np.ndarray | None:
    """`_join(parts)`, or None when there are none."""
    return _join(parts) if parts else None


def _join(parts: list[np.ndarray]) -> np.ndarray:
    """1-D parts (at least one) of one (contract) dtype end to end (a batch has hundreds)."""
    if len(parts) == 1:
        return parts[0]
    joined = join_contiguous(parts, parts[0].dtype)
    return np.concatenate(parts) if joined is None else joined


_MIN, _MAX, _ALL = np.minimum.reduce, np.maximum.reduce, np.logical_and.reduce


def _tokens_in_supports(tokens: np.ndarray, ids: np.ndarray, offsets: np.ndarray) -> bool:
    """Every support non-empty and holding its token (`offsets` has one
    entry more than `tokens`, starts at 0 and ends at `len(ids)`). Offsets
    out of [0, len(ids)] fail first: their differences may wrap around into
    positive sizes, and the support check would index past the ids."""
    if _offsets_out_of_range(offsets, len(ids)):
        return False
    sizes = offsets[1:] - offsets[:-1]
    # ufunc reductions directly: the numpy function wrappers cost more than these arrays' work
    return _MIN(sizes) > 0 and bool(_ALL(inside_support(tokens, ids, offsets, sizes)))


def _offsets_out_of_range(offsets: np.ndarray, n_ids: int) -> bool:
    """Whether any offset lies outside [0, n_ids] (int64 offsets read as
    uint64, where negative ones are >= 2**63, take one reduction)."""
    if offsets.dtype == np.int64:
        return bool(_MAX(offsets.view(np.uint64)) > n_ids)
    return bool(int(_MIN(offsets)) < 0 or int(_MAX(offsets)) > n_ids)


# Support ids checked together at most: bounds the packed arrays and
# temporaries of one group (a batch of a hundred 5,000-id turns would
# otherwise allocate several MB of fresh pages per check).
_GROUP_IDS = 1 << 17


# The arrays `_native.messages_content_valid` reads, by role, in its order.
_CONTENT_ROLES = ("tokens", "log_probs", "loss_mask", _FULL_LOG_PROBS, "mask_ids", "mask_offsets", _MASK_LOG_PROBS,
                  "prompt_tokens", "forced_tokens")


def messages_content_valid(batch: Sequence[Mapping[str, np.ndarray]], vocab_size: int | None = None) -> bool:
    """Whether every message of `batch` passes every content rule.

    Compiled (`_native`), one call reads each array of the batch once, in
    place. Otherwise the messages' arrays are packed end to end, a bounded
    group of messages at a time (`_GROUP_IDS`), and each group is checked
    with a fixed handful of whole-array numpy calls, so the per-message cost
    is a few Python comparisons (the broker runs this on every batch of
    frames; a group of one is not packed at all). False only says that
    some message fails; `check_message_arrays` then finds which rule, per
    message.
    """
    bound = 2**31 if vocab_size is None else vocab_size  # negative int32 ids read as uint32 are >= 2**31
    if _native is not None and type(batch) is list:
        try:
            return _native.messages_content_valid(batch, _CONTENT_ROLES, bound, LOG_PROB_TOLERANCE)
        except (ValueError, TypeError, BufferError):  # an array not of its contract's dtype: numpy's way takes it
            pass
    start, held = 0, 0
    for end, arrays in enumerate(batch, 1):
        ids = arrays.get("mask_ids")
        held += 0 if ids is None else len(ids)
        if held >= _GROUP_IDS or end == len(batch):
            if not _group_content_valid(batch[start:end], bound):
                return False
            start, held = end, 0
    return True


def _group_content_valid(batch: Sequence[Mapping[str, np.ndarray]], bound: int) -> bool:
    tokens, ids, offsets, shifts, sizes, plain = [], [], [], [], [], []
    loss_masks, log_probs, other_ids = [], [], []
    base = 0
    for arrays in batch:
        message_tokens = arrays["tokens"]
        n = len(message_tokens)
        log_prob, loss_mask = arrays.get("log_probs"), arrays.get("loss_mask")
        if (log_prob is not None and len(log_prob) != n) or (loss_mask is not None and len(loss_mask) != n):
            return False
        if _FULL_LOG_PROBS in arrays:  # kept by the log-prob rule: checked with the log_probs
            full_log_prob = arrays[_FULL_LOG_PROBS]
            if len(full_log_prob) != n:
                return False
            log_probs.append(full_log_prob)
        message_ids, message_offsets = arrays.get("mask_ids"), arrays.get("mask_offsets")
        if _MASK_LOG_PROBS in arrays:  # kept by the log-prob rule too, one per support id
            mask_log_prob = arrays[_MASK_LOG_PROBS]
            if message_ids is None or len(mask_log_prob) != len(message_ids):
                return False
            log_probs.append(mask_log_prob)
        if message_offsets is None:
            plain.append(message_tokens)  # no support to imply their vocabulary check
        else:
            if (message_ids is None or len(message_offsets) != n + 1 or message_offsets[0] != 0
                    or message_offsets[-1] != len(message_ids)):
                return False
            if n:
                tokens.append(message_tokens)
                ids.append(message_ids)
                offsets.append(message_offsets)
                shifts.append(base)
                sizes.append(n)
                base += len(message_ids)
        for name in ("prompt_tokens", "forced_tokens"):
            if arrays.get(name) is not None:
                other_ids.append(arrays[name])
        if loss_mask is not None:
            loss_masks.append(loss_mask)
        if log_prob is not None:
            log_probs.append(log_prob)
    # Sampled tokens with a support lie inside it, so the support ids stand for them.
    if tokens and not _supports_valid(tokens, ids, offsets, shifts, sizes, bound):
        return False
    for values in (_concat(plain), _concat(other_ids)):
        if values is not None and len(values) and _MAX(values.view(np.uint32)) >= bound:
            return False
    loss_mask = _concat(loss_masks)
    if loss_mask is not None and len(loss_mask) and _MAX(loss_mask) > 1:
        return False
    log_prob = _concat(log_probs)
    return log_prob is None or not len(log_prob) or not _log_probs_broken(log_prob)


def _supports_valid(tokens: list, ids: list, offsets: list, shifts: list[int], sizes: list[int], bound: int) -> bool:
    """Whether each message's sampled tokens lie in their non-empty supports
    and every support id is below `bound` (messages whose offsets frame their
    ids: `shifts` are where each one's ids start once packed, `sizes` its
    tokens), with numpy over them packed."""
    if len(tokens) == 1:
        packed_ids = ids[0]
        if not _tokens_in_supports(tokens[0], packed_ids, offsets[0]):
            return False
    else:
        packed_ids = _join(ids)
        packed_offsets = np.empty(sum(sizes) + 1, dtype=np.int64)
        packed_offsets[0] = 0
        np.add(_join([o[1:] for o in offsets]), np.asarray(shifts, dtype=np.int64).repeat(sizes), out=packed_offsets[1:])
        if not _tokens_in_supports(_join(tokens), packed_ids, packed_offsets):
            return False
    return not (len(packed_ids) and _MAX(packed_ids.view(np.uint32)) >= bound)


def _check_supports_normalized(arrays: Mapping[str, np.ndarray]) -> None:
    """`RULE_SUPPORT_NORMALIZED` over a message whose other rules hold: the
    first token whose support's probabilities do not sum to 1."""
    values, offsets = arrays.get(_MASK_LOG_PROBS), arrays.get("mask_offsets")
    if values is None or offsets is None or len(offsets) < 2:
        return
    sums = np.add.reduceat(np.exp(values.astype(np.float64)), offsets[:-1])
    bad = np.flatnonzero(np.abs(sums - 1.0) > LOG_PROB_TOLERANCE)
    if bad.size:
        at = int(bad[0])
        raise LocalProtocolError("invalid_value", f"rule '{RULE_SUPPORT_NORMALIZED}' violated at token {at}: expected "
                                                  f"its {int(offsets[at + 1] - offsets[at])} probabilities to sum to 1, "
                                                  f"got {float(sums[at]):.6g}")


def check_message_structure(arrays: Mapping[str, np.ndarray]) -> None:
    """The rules of one message that need no pass over its arrays: per-token
    fields aligned with the tokens, mask offsets one longer than the tokens,
    from 0 to `len(mask_ids)` (`misaligned`, then `mask_invalid`). Enough to
    encode a frame the broker can read; `check_message_arrays` adds the
    content rules."""
    tokens = arrays["tokens"]
    n = len(tokens)
    for name in ("log_probs", "loss_mask", *TOKEN_LOG_PROB_ARRAYS):
        values = arrays.get(name)
        if values is not None and len(values) != n:
            raise LocalProtocolError("misaligned",
                                     f"rule '{RULE_ALIGNED}' violated: {name} has {len(values)} entries, tokens has {n}")
    offsets = arrays.get("mask_offsets")
    for name in SUPPORT_LOG_PROB_ARRAYS:
        values = arrays.get(name)
        problem = None if values is None else _support_misalignment(name, values, arrays.get("mask_ids"))
        if problem:
            raise LocalProtocolError("misaligned", f"rule '{RULE_SUPPORT_ALIGNED}' violated: {problem}")
    if offsets is None:
        return
    if len(offsets) != n + 1:
        raise LocalProtocolError("misaligned", f"rule '{RULE_ALIGNED}' violated: mask_offsets has {len(offsets)} entries, "
                                          f"expected {n + 1} (one more than the {n} tokens)")
    if offsets[0] != 0:
        raise LocalProtocolError("mask_invalid", f"rule '{RULE_OFFSETS_START}' violated: expected 0, got {int(offsets[0])}")
    if offsets[-1] != len(arrays["mask_ids"]):
        raise LocalProtocolError("mask_invalid", f"rule '{RULE_OFFSETS_END}' violated: expected {len(arrays['mask_ids'])}, "
                                            f"got {int(offsets[-1])}")


def check_message_arrays(arrays: Mapping[str, np.ndarray], *, vocab_size: int | None = None,
                         mask_log_probs_normalized: bool = False) -> None:
    """Content rules for the token arrays of one `turn` or `deliver` message.

    Raises the `LocalProtocolError` of the first failing rule in protocol
    order (`misaligned`, `mask_invalid`, `out_of_vocab`, `invalid_value`);
    a receiver of the arrays turns it into a `RemoteProtocolError`.
    `arrays` must already have contract dtypes and ranks. Valid arrays take
    the fast path; the per-rule search below only runs to explain a failure.
    With `mask_log_probs_normalized` (the sender says its `mask_log_probs`
    are renormalised over each support) their probabilities must sum to 1.
    """
    if messages_content_valid([arrays], vocab_size):
        if mask_log_probs_normalized:
            _check_supports_normalized(arrays)
        return
    check_message_structure(arrays)
    tokens = arrays["tokens"]
    n = len(tokens)
    found = packed_violations(
        tokens, [n], arrays.get("mask_ids"), arrays.get("mask_offsets"),
        vocab_size=vocab_size, loss_mask=arrays.get("loss_mask"), log_probs=arrays.get("log_probs"),
        token_log_probs={name: arrays[name] for name in TOKEN_LOG_PROB_ARRAYS if name in arrays}, marks_forced=False,
        support_log_probs={name: arrays[name] for name in SUPPORT_LOG_PROB_ARRAYS if name in arrays},
    )
    for name in ("prompt_tokens", "forced_tokens"):
        values = arrays.get(name)
        if values is not None and values.size:
            extra = packed_violations(values, [len(values)], vocab_size=vocab_size)
            found += [Violation(v.rule, v.sample, v.position, v.count, f"{name}: {v.detail}") for v in extra]
    if found:
        first = min(found, key=lambda v: _CODE_ORDER[RULE_CODES[v.rule]])
        where = "" if first.position is None else f" at token {first.position}"
        raise LocalProtocolError(RULE_CODES[first.rule], f"rule '{first.rule}' violated{where}: {first.detail}")
