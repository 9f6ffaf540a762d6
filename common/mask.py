"""The sampling-support mask in CSR form (docs/semantics.md §2).

Token `t`'s support, the ids a top-k/top-p sampler could have emitted at that
position, is `ids[offsets[t]:offsets[t+1]]`. Supports are ragged, so they are
never padded to `[tokens, top_k]`.
"""
from __future__ import annotations

import collections
import functools
import operator
import warnings
from typing import Collection, Sequence

import numpy as np

from .contract import ARRAYS
from .errors import InvalidInput, LocalProtocolError, OutOfRange
from .validation import RULE_ALIGNED, RULE_CODES, RULE_MASK_VOCAB, csr_problem, inside_support, pack_csr

IDS_DTYPE = ARRAYS["mask_ids"].dtype
OFFSETS_DTYPE = ARRAYS["mask_offsets"].dtype


def as_numpy(values) -> np.ndarray:
    """A numpy view of a numpy array, torch tensor (moved to host) or sequence."""
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    try:
        return np.asarray(values)
    except ValueError:  # a ragged or mixed sequence
        raise LocalProtocolError("shape", "rule 'arrays are rectangular' violated: got a sequence numpy cannot make "
                                          f"one array of: {values!r:.80}") from None


@functools.cache
def _iinfo(dtype: np.dtype) -> np.iinfo:
    return np.iinfo(dtype)


def list_as_array(values: list, dtype: np.dtype) -> np.ndarray | None:
    """A Python list converted by one `np.fromiter` (about twice as fast as
    `np.asarray` for the usual list of ids or log-probs), when that gives
    exactly what `as_int_array` (an integer `dtype`) or `_as_float_array`
    (a float one) would; None where it might not, for the caller's general
    path and its errors. `fromiter` alone would cast a float, bool or str
    silently, so the list's sum tells: a sum of plain ints is an int and of
    ints and floats with one float or more a float, while a complex, str or
    None makes it something else; an integer sum above the count rules out
    a list of bools (`as_int_array` refuses one). A value that does not fit
    `dtype` leaves it to the general path too."""
    try:
        total = sum(values)
    except (TypeError, OverflowError):
        return None
    if type(total) is not (float if dtype.kind == "f" else int) or (dtype.kind != "f" and total <= len(values)):
        return None
    try:
        return np.fromiter(values, dtype=dtype, count=len(values))
    except OverflowError:
        return None


def as_int_array(values, dtype: np.dtype, name: str) -> np.ndarray:
    """`values` as a 1-D array of `dtype`, refusing bools, floats, complex and
    values that do not fit (never cast or wrapped): `LocalProtocolError`
    `shape` or `dtype`, naming the field as `name`. May share memory."""
    if type(values) is np.ndarray and values.dtype == dtype and values.ndim == 1:
        return values  # already what is wanted (the common case on hot paths)
    if type(values) is list:
        converted = list_as_array(values, dtype)
        if converted is not None:
            return converted
    is_array = isinstance(values, np.ndarray) or hasattr(values, "detach")
    arr = as_numpy(values)
    if arr.ndim != 1:
        raise LocalProtocolError("shape", f"rule '1-D integer arrays' violated: {name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        # An empty Python sequence converts to float64; it carries no values to refuse.
        if not (arr.size == 0 and not is_array and arr.dtype.kind == "f"):
            raise LocalProtocolError(
                "dtype", f"rule '1-D integer arrays' violated: {name} must hold integers, got dtype {arr.dtype} "
                "(bool, float and complex are refused, never cast)"
            )
    elif arr.dtype != dtype and arr.size and not np.can_cast(arr.dtype, dtype, "safe"):
        info = _iinfo(dtype)
        low, high = arr.min(), arr.max()
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise LocalProtocolError(
                "dtype", f"rule 'values fit {dtype.name}' violated: {name} holds {int(bad)}, expected [{info.min}, {info.max}] "
                "(never wrapped)"
            )
    return arr.astype(dtype, copy=False)


def frozen(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


def owned(arr: np.ndarray, source, *, borrow: bool = False) -> np.ndarray:
    """`arr` made read-only, copied first unless it is memory numpy just
    allocated for it (so later changes to the caller's `source`, whatever
    buffer it is, change nothing, and the caller's own array stays writable).

    With `borrow`, a numpy `source` that already is the array wanted (its
    dtype fits) is taken as it is instead, the caller's own array: the
    caller promises to leave it unchanged while it is in use (the producer
    sends turns this way, zero-copy)."""
    if borrow and arr is source:
        return arr
    fresh = arr.flags.owndata and arr is not source and not hasattr(source, "detach")
    if not fresh or (isinstance(source, np.ndarray) and np.may_share_memory(arr, source)):
        arr = arr.copy()
    return frozen(arr)


def _refuse_negative_ids(ids: np.ndarray, offsets: np.ndarray, name: str) -> None:
    """A negative id is in no vocabulary, so a mask refuses it as a broker
    refuses it in a frame (an id past the vocabulary is left to whoever
    knows its size). One reduction; `offsets` must keep the CSR rules."""
    if ids.size and ids.min() < 0:
        at = int(np.flatnonzero(ids < 0)[0])
        token = int(np.searchsorted(offsets, at, side="right")) - 1
        raise LocalProtocolError(
            RULE_CODES[RULE_MASK_VOCAB], f"sampling mask rule '{RULE_MASK_VOCAB}' violated at token {token}: "
            f"{name} holds {int(ids[at])}, expected >= 0")


class SamplingMask:
    """Immutable CSR sampling mask: int32 `ids`, int64 `offsets` (N + 1).

    Every constructor refuses what a broker would refuse in a frame's mask
    with the same code (`dtype`, `shape`, `mask_invalid`, and `out_of_vocab`
    for a negative id), as a `LocalProtocolError` naming the argument the
    caller passed."""

    __slots__ = ("_ids", "_offsets")

    def __init__(self, ids, offsets):
        ids_arr = as_int_array(ids, IDS_DTYPE, "ids")
        offsets_arr = as_int_array(offsets, OFFSETS_DTYPE, "offsets")
        problem = csr_problem(ids_arr, offsets_arr)
        if problem:
            raise LocalProtocolError("mask_invalid", problem)
        _refuse_negative_ids(ids_arr, offsets_arr, "ids")
        self._ids = owned(ids_arr, ids)
        self._offsets = owned(offsets_arr, offsets)

    @classmethod
    def _wrap(cls, ids: np.ndarray, offsets: np.ndarray) -> "SamplingMask":
        """Trusted constructor: arrays already checked, of the contract dtypes
        and never written again (read-only frames, fresh buffers)."""
        mask = object.__new__(cls)
        mask._ids = ids if not ids.flags.writeable else frozen(ids.view())
        mask._offsets = offsets if not offsets.flags.writeable else frozen(offsets.view())
        return mask

    # -- construction -----------------------------------------------------
    @classmethod
    def empty(cls) -> "SamplingMask":
        return cls._wrap(frozen(np.empty(0, IDS_DTYPE)), frozen(np.zeros(1, OFFSETS_DTYPE)))

    @classmethod
    def from_supports(cls, supports: Sequence[Collection[int]]) -> "SamplingMask":
        """One support (a sequence of integer ids) per token, converted as
        `as_int_array` converts any list: a float, complex or str id is
        refused, never truncated."""
        try:
            sizes = np.fromiter(map(len, supports), dtype=OFFSETS_DTYPE, count=len(supports))
        except TypeError:
            raise LocalProtocolError("shape", "rule 'supports are one id list per token' violated: got "
                                              f"{supports!r:.80}") from None
        flat: list = []
        collections.deque(map(flat.extend, supports), 0)  # about twice as fast as list(itertools.chain(...))
        return cls._from_sizes(owned(as_int_array(flat, IDS_DTYPE, "supports"), flat), sizes, "supports", "supports")

    @classmethod
    def from_lengths(cls, flat_ids, lengths) -> "SamplingMask":
        """Flat ids plus the number of ids in each token's support."""
        ids = owned(as_int_array(flat_ids, IDS_DTYPE, "ids"), flat_ids)
        return cls._from_sizes(ids, as_int_array(lengths, OFFSETS_DTYPE, "lengths"), "lengths", "ids")

    @classmethod
    def _from_sizes(cls, ids: np.ndarray, sizes: np.ndarray, name: str, ids_name: str) -> "SamplingMask":
        """Offsets from support sizes (given as the caller's `name`); `ids`
        (the caller's `ids_name`) must be an owned int32 array."""
        if sizes.size and sizes.min() <= 0:
            t = int(np.flatnonzero(sizes <= 0)[0])
            raise LocalProtocolError(
                "mask_invalid", f"sampling mask rule 'non-empty support (strictly increasing offsets)' violated at "
                f"token {t}: {name}[{t}] gives {int(sizes[t])} ids, expected at least 1"
            )
        offsets = np.zeros(sizes.size + 1, dtype=OFFSETS_DTYPE)
        np.cumsum(sizes, out=offsets[1:])
        if offsets[-1] != ids.size:
            raise LocalProtocolError(
                "mask_invalid", f"sampling mask rule 'offsets[-1] == len(ids)' violated: {name} sum to {int(offsets[-1])}, "
                f"ids has {ids.size}"
            )
        _refuse_negative_ids(ids, offsets, ids_name)
        return cls._wrap(frozen(ids), frozen(offsets))

    @classmethod
    def from_bitset(cls, bits) -> "SamplingMask":
        """One packed row per token: uint8 `[tokens, ceil(V / 8)]`, id `j`
        set when bit `j % 8` (least significant first) of byte `j // 8` is
        (the form vLLM packs wide supports in on the GPU)."""
        rows = as_numpy(bits)
        if rows.ndim != 2 or rows.dtype != np.uint8:
            raise LocalProtocolError("shape", "rule 'a bitset mask is uint8 [tokens, bytes]' violated: got "
                                              f"{rows.dtype} of shape {tuple(rows.shape)}")
        token, ids = np.nonzero(np.unpackbits(rows, axis=1, bitorder="little"))
        sizes = np.bincount(token, minlength=rows.shape[0]).astype(OFFSETS_DTYPE)
        return cls._from_sizes(ids.astype(IDS_DTYPE), sizes, "bitset rows", "bitset")

    @classmethod
    def singletons(cls, tokens) -> "SamplingMask":
        """Support `[t]` for every token `t`: forced tokens were not sampled."""
        ids = owned(as_int_array(tokens, IDS_DTYPE, "tokens"), tokens)
        offsets = frozen(np.arange(ids.size + 1, dtype=OFFSETS_DTYPE))
        _refuse_negative_ids(ids, offsets, "tokens")
        return cls._wrap(ids, offsets)

    @classmethod
    def concatenate(cls, masks: Sequence["SamplingMask"]) -> "SamplingMask":
        """Supports of `masks` in order; no masks give the empty mask."""
        if not masks:
            return cls.empty()
        ids, offsets = pack_csr([m._ids for m in masks], [m._offsets for m in masks])
        return cls._wrap(frozen(ids), frozen(offsets))

    # -- access -------------------------------------------------------------
    def __len__(self) -> int:
        return self._offsets.size - 1

    def __getitem__(self, t) -> np.ndarray:
        n = len(self)
        index = t = operator.index(t)
        if t < 0:
            t += n
        if not 0 <= t < n:
            raise OutOfRange(f"token index must be in [-{n}, {n}) for a mask of {n} tokens, got {index}")
        return self._ids[self._offsets[t] : self._offsets[t + 1]]

    def prefix(self, n: int) -> "SamplingMask":
        """The first `n` tokens' supports; `0 <= n <= len(self)`."""
        n = operator.index(n)
        if not 0 <= n <= len(self):
            raise InvalidInput(f"prefix length must be in [0, {len(self)}], got {n}")
        end = int(self._offsets[n])
        return SamplingMask._wrap(self._ids[:end], self._offsets[: n + 1])

    # Read-only properties whose getters are compiled (a turn's mask is read several times a frame).
    ids = property(operator.attrgetter("_ids"), doc="All supports concatenated (read-only int32 view).")
    offsets = property(operator.attrgetter("_offsets"), doc="`N + 1` support boundaries (read-only int64 view).")

    @property
    def support_sizes(self) -> np.ndarray:
        return np.diff(self._offsets)

    @property
    def nbytes(self) -> int:
        return self._ids.nbytes + self._offsets.nbytes

    def contains(self, tokens) -> np.ndarray:
        """Per token, whether `tokens[t]` is inside support `t` (vectorised)."""
        tokens = as_int_array(tokens, IDS_DTYPE, "tokens")
        if tokens.size != len(self):
            raise LocalProtocolError("misaligned", f"rule '{RULE_ALIGNED}' violated: tokens has {tokens.size} entries, "
                                              f"the mask covers {len(self)}")
        return inside_support(tokens, self._ids, self._offsets)

    def to_torch(self, device=None):
        """`(ids, offsets)` as torch tensors; zero-copy on CPU. Treat them as
        read-only: they share this mask's memory."""
        import torch

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            ids, offsets = torch.from_numpy(self._ids), torch.from_numpy(self._offsets)
        if device is not None and torch.device(device).type != "cpu":
            ids, offsets = ids.to(device, non_blocking=True), offsets.to(device, non_blocking=True)
        return ids, offsets

    # -- value semantics ----------------------------------------------------
    def __eq__(self, other) -> bool:
        if not isinstance(other, SamplingMask):
            return NotImplemented
        return np.array_equal(self._offsets, other._offsets) and np.array_equal(self._ids, other._ids)

    # Unhashable (mutable arrays): Python sets __hash__ to None for a class that defines __eq__ without it.

    def __repr__(self) -> str:
        return f"SamplingMask(tokens={len(self)}, ids={self._ids.size})"
