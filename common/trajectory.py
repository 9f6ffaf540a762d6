"""Turns and the growable trajectory they merge into (docs/semantics.md §3-§5).

A `Turn` is what one engine call produced: sampled tokens with their
log-probs and supports, then the forced tokens the environment appended.
A `Trajectory` is the prompt followed by merged turns. It grows in place
(geometric buffers), so appending costs O(tokens appended) however long the
trajectory already is, and no step loops over tokens in Python. A merged
turn's arrays are written at the next read, together with every other turn
merged since: the broker merges many turns into a trajectory and reads it
once, at delivery.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Mapping, NamedTuple

import numpy as np

from .buffers import NBYTES, GrowableArray, constant_run, counting_run
from .codec import crc32_joined
from .contract import (
    ARRAYS,
    CONTEXT_REPLAY_ARRAYS,
    REPLAY_FIELDS,
    STATUSES,
    SUPPORT_LOG_PROB_ARRAYS,
    TERMINAL_STATUSES,
    TOKEN_LOG_PROB_ARRAYS,
)
from .errors import InvalidInput, InvalidState, InvalidType, LocalProtocolError
from .mask import IDS_DTYPE, OFFSETS_DTYPE, SamplingMask, as_int_array, as_numpy, frozen, list_as_array, owned
from .validation import RULE_ALIGNED, RULE_SUPPORT_ALIGNED, check_message_arrays, check_message_structure

TOKEN_DTYPE = ARRAYS["tokens"].dtype
LOG_PROB_DTYPE = ARRAYS["log_probs"].dtype
LOSS_MASK_DTYPE = ARRAYS["loss_mask"].dtype
REPLAY_DTYPE = ARRAYS["routed_experts"].dtype
_PER_TOKEN_BYTES = TOKEN_DTYPE.itemsize + LOG_PROB_DTYPE.itemsize + LOSS_MASK_DTYPE.itemsize


def _shape_of(array: np.ndarray) -> np.ndarray:
    """An array of `array`'s shape and dtype that holds no memory (a shed
    trajectory checks context shapes against it)."""
    return np.broadcast_to(np.zeros(1, array.dtype), array.shape)


_native: ModuleType | None
try:  # `merge_into`'s compiled pass (common/_native.c)
    from . import _native
except ImportError:  # pragma: no cover - a build without one writes the turns with numpy
    _native = None

EMPTY_TOKENS = frozen(np.empty(0, TOKEN_DTYPE))
_LEADING_ZERO = frozen(np.zeros(1, OFFSETS_DTYPE))
EMPTY_LOG_PROBS = frozen(np.empty(0, LOG_PROB_DTYPE))


def _taken_as_is(values, dtype: np.dtype) -> bool:
    """Whether `values` is already a 1-D numpy array of exactly `dtype`."""
    return type(values) is np.ndarray and (values.dtype is dtype or values.dtype == dtype) and values.ndim == 1


def _as_float_array(values, name: str) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == LOG_PROB_DTYPE and values.ndim == 1:
        return values
    if type(values) is list:
        converted = list_as_array(values, LOG_PROB_DTYPE)
        if converted is not None:
            return converted
    arr = as_numpy(values)
    if arr.ndim != 1:
        raise LocalProtocolError("shape", f"rule '1-D real arrays' violated: {name} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "fiu" and arr.size:
        raise LocalProtocolError("dtype", f"rule '1-D real arrays' violated: {name} must hold real numbers, "
                                     f"got dtype {arr.dtype}")
    return arr.astype(LOG_PROB_DTYPE, copy=False)


def _as_loss_mask(values) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == LOSS_MASK_DTYPE and values.ndim == 1:
        return values
    arr = as_numpy(values)
    return as_int_array(arr.astype(LOSS_MASK_DTYPE) if arr.dtype == bool else values, LOSS_MASK_DTYPE, "loss_mask")


def _as_replay(values, name: str) -> np.ndarray:
    arr = as_numpy(values)
    if arr.ndim < 1:
        raise LocalProtocolError("shape", f"rule 'replay arrays are [k, ...]' violated: {name} must have at least 1 "
                                     "dimension, got a scalar")
    return as_int_array(arr.reshape(-1), REPLAY_DTYPE, name).reshape(arr.shape)


@dataclass(frozen=True)
class Gap:
    """Where a replay gap cut a trajectory: the turn that lacked `field`."""

    turn: int
    field: str

    def to_wire(self) -> dict:
        return {"turn": self.turn, "field": self.field}


@dataclass(frozen=True)
class TurnOutcome:
    """Result of offering a turn to a trajectory: applied, or why not."""

    applied: bool
    reason: str | None = None  # "after_terminal" | "replay_gap"


APPLIED = TurnOutcome(True)


def _checked_spans(spans, weight_version: str | None, tokens) -> tuple[str, tuple[tuple[str, int, int], ...]]:
    """A turn's weight-version spans as a tuple, checked by the rules of the
    `turn` message (non-empty versions, in token order, within the sampled
    tokens, the first being `weight_version` when that is given)."""
    try:
        out = tuple((str(version), int(start), int(end)) for version, start, end in spans)
    except (TypeError, ValueError):
        raise LocalProtocolError("schema", "weight_version_spans must be (version, start, end) triples, "
                                           f"got {spans!r:.120}") from None
    n = len(tokens)
    if not out or any(not v or not 0 <= s < e for v, s, e in out) or any(a[2] > b[1] for a, b in zip(out, out[1:])):
        raise LocalProtocolError("schema", "rule 'weight_version_spans are non-empty versions over 0 <= start < end, in "
                                           f"token order, not overlapping' violated: got {out}")
    if out[-1][2] > n:
        raise LocalProtocolError("misaligned", f"rule 'weight_version_spans lie within the turn's sampled tokens' "
                                               f"violated: expected ends <= {n}, got {out}")
    if weight_version is not None and weight_version != out[0][0]:
        raise LocalProtocolError("schema", f"rule 'a turn's weight_version is its first span's' violated: expected "
                                           f"{out[0][0]!r}, got {weight_version!r}")
    return out[0][0], out


# The arrays of a turn that carries no replay field but its mask (`Turn.from_arrays`).
_PLAIN_TURN_ARRAYS = frozenset(ARRAYS).difference(CONTEXT_REPLAY_ARRAYS, TOKEN_LOG_PROB_ARRAYS, SUPPORT_LOG_PROB_ARRAYS)
_NO_REPLAY_ARRAYS = (None, None, None, None)  # its routed_experts, indexer_topk, full_log_probs, mask_log_probs


class Turn(NamedTuple):
    """One engine call's output. Construct from untrusted data with
    `Turn.build`, which coerces and checks; the plain constructor trusts its
    arrays (contract dtypes, aligned, checked). Immutable: a named tuple,
    cheaper to make than a frozen dataclass (the producer and the broker
    make one per frame; docs/performance.md); two turns are equal only when
    they are the same turn."""

    tokens: np.ndarray
    log_probs: np.ndarray
    loss_mask: np.ndarray | None = None  # None: every sampled token trains
    mask: SamplingMask | None = None
    forced_tokens: np.ndarray = EMPTY_TOKENS
    routed_experts: np.ndarray | None = None
    indexer_topk: np.ndarray | None = None
    full_log_probs: np.ndarray | None = None  # each sampled token's log-prob under the whole vocabulary
    mask_log_probs: np.ndarray | None = None  # the sampler's log-prob of each support id, aligned with mask.ids
    status: str = "completed"
    weight_version: str | None = None
    mask_ids_crc32: int | None = None  # the CRC-32 of `mask.ids`' bytes, when a decoder verified it
    # Where the weights changed within the turn: (version, start, end) over its sampled tokens, in
    # token order, the first being `weight_version`; None: one version over all of them.
    weight_version_spans: tuple[tuple[str, int, int], ...] | None = None
    mask_log_probs_normalized: bool = False  # the sender says each support's probabilities sum to 1
    # The decoded message (`codec.Message`) that brought this first turn and its prompt, with its arrays'
    # verified CRC: while the turn is all its trajectory holds, a delivery forwards those frames as they are.
    arrived: Any = None

    @classmethod
    def build(
        cls,
        tokens,
        log_probs,
        *,
        mask: SamplingMask | None = None,
        supports=None,
        mask_ids=None,
        mask_offsets=None,
        loss_mask=None,
        forced_tokens=None,
        routed_experts=None,
        indexer_topk=None,
        full_log_probs=None,
        mask_log_probs=None,
        mask_log_probs_normalized: bool = False,
        status: str = "completed",
        weight_version: str | None = None,
        weight_version_spans=None,
        vocab_size: int | None = None,
        borrow: bool = False,
        check_content: bool = True,
    ) -> "Turn":
        """A checked turn: every rule a broker would apply to this frame
        alone, each checked once (one packed pass; a `mask` was checked when
        it was built). With `check_content=False` only the rules that need no
        pass over the arrays are checked (`check_message_structure`: the
        frame encodes and lines up), leaving the content rules to whoever
        receives it. The support comes as a `SamplingMask`, as CSR arrays
        `mask_ids` + `mask_offsets`, or as `supports` (one id list per token).
        `log_probs` are under the sampler's truncated distribution;
        `full_log_probs`, when the engine reports them, under the whole
        vocabulary's, kept by the same rules. `mask_log_probs` are the
        sampler's log-probs of every support id, aligned with the ids; with
        `mask_log_probs_normalized` each support's must sum to 1.

        Lists are converted; numpy arrays whose dtype fits are copied, or
        with `borrow` taken as they are (no copy: the caller leaves them
        unchanged while the turn is in use). `weight_version_spans` (version,
        start, end) place the versions of weights that changed within the
        turn; `weight_version` is then their first, given or not."""
        if weight_version_spans is not None:
            weight_version, weight_version_spans = _checked_spans(weight_version_spans, weight_version, tokens)
        if (borrow and mask is None and supports is None and forced_tokens is None and routed_experts is None
                and indexer_topk is None and _taken_as_is(tokens, TOKEN_DTYPE) and _taken_as_is(log_probs, LOG_PROB_DTYPE)
                and (loss_mask is None or _taken_as_is(loss_mask, LOSS_MASK_DTYPE))
                and (full_log_probs is None or _taken_as_is(full_log_probs, LOG_PROB_DTYPE))
                and (mask_log_probs is None or _taken_as_is(mask_log_probs, LOG_PROB_DTYPE))
                and (mask_ids is None if mask_offsets is None
                     else _taken_as_is(mask_ids, IDS_DTYPE) and _taken_as_is(mask_offsets, OFFSETS_DTYPE))
                and status in STATUSES):
            # The producer's common call: arrays already of the contract's dtypes, borrowed as they are.
            turn = cls(tokens, log_probs, loss_mask,
                       None if mask_ids is None else SamplingMask._wrap(mask_ids, mask_offsets), EMPTY_TOKENS,
                       full_log_probs=full_log_probs, mask_log_probs=mask_log_probs, status=status,
                       weight_version=weight_version, weight_version_spans=weight_version_spans,
                       mask_log_probs_normalized=bool(mask_log_probs_normalized))
            return turn._checked(check_content, vocab_size)
        if (mask is not None) + (supports is not None) + (mask_ids is not None) > 1:
            given = [name for name, value in (("mask", mask), ("supports", supports), ("mask_ids", mask_ids))
                     if value is not None]
            raise LocalProtocolError("schema", "give the support once, as `mask`, `supports` or `mask_ids` + "
                                          f"`mask_offsets`; got {given}")
        if (mask_ids is None) != (mask_offsets is None):
            raise LocalProtocolError("schema", "mask_ids and mask_offsets travel together; "
                                          f"got only {'mask_ids' if mask_offsets is None else 'mask_offsets'}")
        if status not in STATUSES:
            raise LocalProtocolError("schema", f"status must be one of {STATUSES}, got {status!r}")

        def take(values, arr):
            return owned(arr, values, borrow=borrow)

        if supports is not None:
            mask = SamplingMask.from_supports(supports)
        elif mask_ids is not None:  # checked below with the rest of the turn, not by the SamplingMask constructor
            mask = SamplingMask._wrap(take(mask_ids, as_int_array(mask_ids, IDS_DTYPE, "mask_ids")),
                                      take(mask_offsets, as_int_array(mask_offsets, OFFSETS_DTYPE, "mask_offsets")))
        elif mask is not None and not isinstance(mask, SamplingMask):
            raise InvalidType(f"mask must be a SamplingMask, got {type(mask).__name__}")
        turn = cls(
            tokens=take(tokens, as_int_array(tokens, TOKEN_DTYPE, "tokens")),
            log_probs=take(log_probs, _as_float_array(log_probs, "log_probs")),
            loss_mask=None if loss_mask is None else take(loss_mask, _as_loss_mask(loss_mask)),
            mask=mask,
            forced_tokens=(EMPTY_TOKENS if forced_tokens is None
                           else take(forced_tokens, as_int_array(forced_tokens, TOKEN_DTYPE, "forced_tokens"))),
            routed_experts=None if routed_experts is None else take(routed_experts, _as_replay(routed_experts, "routed_experts")),
            indexer_topk=None if indexer_topk is None else take(indexer_topk, _as_replay(indexer_topk, "indexer_topk")),
            full_log_probs=None if full_log_probs is None else take(full_log_probs,
                                                                    _as_float_array(full_log_probs, "full_log_probs")),
            mask_log_probs=None if mask_log_probs is None else take(mask_log_probs,
                                                                    _as_float_array(mask_log_probs, "mask_log_probs")),
            status=status,
            weight_version=weight_version,
            weight_version_spans=weight_version_spans,
            mask_log_probs_normalized=bool(mask_log_probs_normalized),
        )
        if mask_ids is None and mask is not None and len(mask) != turn.tokens.size:
            # Named as the caller gave it: the frame's rule would name mask_offsets, which the caller never passed.
            said = f"supports has {len(mask)} entries" if supports is not None else f"mask covers {len(mask)} tokens"
            raise LocalProtocolError("misaligned", f"rule '{RULE_ALIGNED}' violated: {said}, tokens has {turn.tokens.size}")
        return turn._checked(check_content, vocab_size)

    def _checked(self, check_content: bool, vocab_size: int | None) -> "Turn":
        """This turn, once its arrays pass every rule of one frame (or, with
        `check_content=False`, the rules that need no pass over them)."""
        if check_content:
            check_message_arrays(self.arrays(), vocab_size=vocab_size, mask_log_probs_normalized=self.mask_log_probs_normalized)
        else:
            check_message_structure(self.arrays())
        return self

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], *, status: str, weight_version: str | None = None,
                    weight_version_spans=None, crcs: Mapping[str, int] | None = None, arrived: Any = None) -> "Turn":
        """Trusted: arrays a decoder has already checked (contract names),
        with the CRCs it verified of some of them (`Message.array_crcs`),
        and the message they arrived in (`arrived`)."""
        mask = None
        if "mask_ids" in arrays:
            mask = SamplingMask._wrap(arrays["mask_ids"], arrays["mask_offsets"])
        replay: tuple[np.ndarray | None, ...]
        if arrays.keys() <= _PLAIN_TURN_ARRAYS:  # the common turn: no lookup of the arrays it cannot carry
            replay = _NO_REPLAY_ARRAYS
        else:
            get = arrays.get
            replay = (get("routed_experts"), get("indexer_topk"), get("full_log_probs"), get("mask_log_probs"))
        # Positional, in field order: the broker makes one per frame, and a keyword call matches every name.
        return cls(arrays["tokens"], arrays["log_probs"], arrays["loss_mask"] if "loss_mask" in arrays else None, mask,
                   arrays["forced_tokens"] if "forced_tokens" in arrays else EMPTY_TOKENS, *replay, status, weight_version,
                   None if crcs is None else crcs.get("mask_ids"),
                   None if weight_version_spans is None else tuple(map(tuple, weight_version_spans)), False, arrived)

    def carries(self, replay_field: str) -> bool:
        return getattr(self, replay_field) is not None

    def __eq__(self, other) -> bool:  # not field by field: fields are arrays
        return self is other

    def __ne__(self, other) -> bool:
        return self is not other

    def __hash__(self) -> int:  # by identity, as equality is
        return object.__hash__(self)

    def arrays(self) -> dict[str, np.ndarray]:
        """The turn's arrays under their contract names (absent ones left out)."""
        out = {"tokens": self.tokens, "log_probs": self.log_probs}
        if self.loss_mask is not None:
            out["loss_mask"] = self.loss_mask
        if self.mask is not None:
            out["mask_ids"], out["mask_offsets"] = self.mask._ids, self.mask._offsets
        if self.forced_tokens.size:
            out["forced_tokens"] = self.forced_tokens
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts
        if self.indexer_topk is not None:
            out["indexer_topk"] = self.indexer_topk
        if self.full_log_probs is not None:
            out["full_log_probs"] = self.full_log_probs
        if self.mask_log_probs is not None:
            out["mask_log_probs"] = self.mask_log_probs
        return out


def _with_forced_zeros(turns: list[Turn], name: str, zeros: np.ndarray) -> list[np.ndarray]:
    """Per-token log-prob array `name` of `turns`, each turn's sampled
    tokens' then 0.0 for its forced tokens, as `log_probs` is merged. A turn
    without it has no sampled tokens (`append_turn` cut a gap otherwise)."""
    parts = []
    for turn in turns:
        values = getattr(turn, name)
        parts.append(zeros[: len(turn.tokens)] if values is None else values)
        if turn.forced_tokens.size:
            parts.append(zeros[: turn.forced_tokens.size])
    return parts


# What `merge_into` reads of each pending turn: the tuple positions of its merged fields, its mask's attributes.
_MERGED_TURN_FIELDS = tuple(map(Turn._fields.index, ("tokens", "log_probs", "loss_mask", "mask", "forced_tokens")))
_MASK_ATTRIBUTES = ("ids", "offsets")


class _MaskBuffer:
    """The growing CSR of a trajectory: ids and offsets in geometric buffers,
    and the support's log-probs beside the ids when it carries them."""

    def __init__(self, ids: np.ndarray | None = None, offsets: np.ndarray = _LEADING_ZERO,
                 log_probs: np.ndarray | None = None, *, with_log_probs: bool = False):
        self.ids = GrowableArray(IDS_DTYPE)
        self.offsets = GrowableArray(OFFSETS_DTYPE)
        self.log_probs: GrowableArray | None = None
        if with_log_probs or log_probs is not None:
            self.log_probs = GrowableArray(LOG_PROB_DTYPE)
            if log_probs is not None:
                self.log_probs.extend(log_probs)
        if ids is not None:
            self.ids.extend(ids)
        self.offsets.extend(offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def append_turns(self, turns: list[Turn]) -> None:
        """Each turn's supports, then its forced tokens' singletons. The
        first turn of an empty mask brings its offsets whole, leading 0
        included, so a one-turn trajectory's CSR is that turn's own arrays."""
        ids, offsets, shifts, crcs, log_probs = [], [], [], [], []
        base = len(self.ids)
        first = base == 0 and len(self.offsets) == 1 and turns[0].mask is not None
        for turn in turns:
            if turn.mask is not None:
                ids.append(turn.mask.ids)
                crcs.append(turn.mask_ids_crc32)
                if first:
                    self.offsets.truncate(0)
                    offsets.append(turn.mask.offsets)
                    first = False
                else:
                    offsets.append(turn.mask.offsets[1:])  # the last offset is len(ids)
                shifts.append(base)
                base += len(turn.mask.ids)
                if self.log_probs is not None:  # a turn without them sampled nothing (`append_turn` cut a gap else)
                    log_probs.append(EMPTY_LOG_PROBS if turn.mask_log_probs is None else turn.mask_log_probs)
            forced = turn.forced_tokens
            if forced.size:
                ids.append(forced)
                crcs.append(None)
                offsets.append(counting_run(forced.size, OFFSETS_DTYPE))
                shifts.append(base)
                base += forced.size
                if self.log_probs is not None:  # a forced token's singleton is certain
                    log_probs.append(constant_run(0.0, forced.size, LOG_PROB_DTYPE))
        self.ids.extend_many(ids, crcs=crcs)
        self.offsets.extend_many(offsets, shifts)
        if self.log_probs is not None:
            self.log_probs.extend_many(log_probs)

    def truncate(self, n_tokens: int) -> None:
        n_ids = int(self.offsets.view()[n_tokens])
        self.ids.truncate(n_ids)
        if self.log_probs is not None:
            self.log_probs.truncate(n_ids)
        self.offsets.truncate(n_tokens + 1)


class Trajectory:
    """The prompt followed by merged turns; grows in place.

    Turns go through `append_turn`, which applies docs/semantics.md §4: forced
    tokens between turns, the status rule, mask presence, and replay gaps over
    every replay field.
    """

    def __init__(
        self,
        trajectory_id: str,
        prompt_tokens=(),
        *,
        group_id: str | None = None,
        group_size: int | None = None,
        sample_index: int | None = None,
        metadata: Mapping[str, Any] | None = None,
    ):
        self.trajectory_id = trajectory_id
        self.prompt_tokens = owned(as_int_array(prompt_tokens, TOKEN_DTYPE, "prompt_tokens"), prompt_tokens)
        self.group_id = group_id
        self.group_size = group_size
        self.sample_index = sample_index
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.reward: Any = None
        self._tokens = GrowableArray(TOKEN_DTYPE)
        self._loss_mask = GrowableArray(LOSS_MASK_DTYPE)
        self._log_probs = GrowableArray(LOG_PROB_DTYPE)
        self._reset_response()

    def _reset_response(self) -> None:
        self.is_shed = False  # True once `shed()`: only what merging needs is kept, the arrays are in the broker's store
        self._shed_length = 0  # response tokens merged while shed, or before
        self._pending: list[Turn] = []  # merged turns whose arrays are not written yet
        self._pending_length = 0
        self._pending_bytes = 0  # what they will add once written
        self._pending_ids = 0  # the support ids they will add (with a mask)
        self._tokens.truncate(0)
        self._loss_mask.truncate(0)
        self._log_probs.truncate(0)
        self._mask: _MaskBuffer | None = None
        self._context: dict[str, np.ndarray] = {}
        self._token_log_probs: dict[str, GrowableArray] = {}  # the `TOKEN_LOG_PROB_ARRAYS` it carries
        self._sampled_end = 0  # end of the last applied turn's sampled tokens
        self._terminal = False
        self.turns = 0
        self.status: str | None = None
        self.gap: Gap | None = None
        self.weight_versions: list[str] = []
        # Per entry of `weight_versions`, where its turn sampled with which weights:
        # (version, start, end) in response positions, the first being that entry.
        self.weight_version_spans: list[tuple[tuple[str, int, int], ...]] = []
        self.forced_spans: list[tuple[int, int]] = []  # (start, end) in response positions of each turn's forced tokens

    # -- reading ------------------------------------------------------------
    @property
    def response_length(self) -> int:
        return self._shed_length + len(self._tokens) + self._pending_length

    def shed(self) -> None:
        """Drop the arrays (the prompt too), keep what merging needs: lengths, status, gap,
        weight versions, which replay fields it carries and the context
        arrays' shapes. Later turns merge with the same outcomes and add
        only to those counts; the arrays are then read back from where the
        turns are stored (the broker's store), by replaying them into a new
        trajectory. Reading a shed trajectory's arrays is an error."""
        if self.is_shed:
            return
        self._shed_length = self.response_length
        self.prompt_tokens = EMPTY_TOKENS
        self._pending, self._pending_length, self._pending_bytes, self._pending_ids = [], 0, 0, 0
        self._tokens, self._loss_mask, self._log_probs = (
            GrowableArray(TOKEN_DTYPE), GrowableArray(LOSS_MASK_DTYPE), GrowableArray(LOG_PROB_DTYPE))
        if self._mask is not None:
            self._mask = _MaskBuffer(with_log_probs=self._mask.log_probs is not None)
        self._context = {name: _shape_of(array) for name, array in self._context.items()}
        self._token_log_probs = {name: GrowableArray(LOG_PROB_DTYPE) for name in self._token_log_probs}
        self.is_shed = True

    @property
    def tokens(self) -> np.ndarray:
        """Response tokens, sampled and forced (read-only view)."""
        self._write_pending()
        return self._tokens.view()

    @property
    def loss_mask(self) -> np.ndarray:
        self._write_pending()
        return self._loss_mask.view()

    @property
    def log_probs(self) -> np.ndarray:
        self._write_pending()
        return self._log_probs.view()

    @property
    def full_log_probs(self) -> np.ndarray | None:
        """Each response token's log-prob under the whole vocabulary (0.0 at
        forced tokens), or None when the trajectory does not carry them."""
        self._write_pending()
        buffer = self._token_log_probs.get("full_log_probs")
        return None if buffer is None else buffer.view()

    @property
    def mask_log_probs(self) -> np.ndarray | None:
        """The sampler's log-prob of every support id, aligned with the
        mask's ids (0.0 for a forced token's singleton), or None when the
        trajectory does not carry them."""
        self._write_pending()
        if self._mask is None or self._mask.log_probs is None:
            return None
        return self._mask.log_probs.view()

    @property
    def has_mask(self) -> bool:
        return self._mask is not None

    @property
    def mask(self) -> SamplingMask | None:
        """The whole response's supports (an owned snapshot), or None."""
        if self._mask is None:
            return None
        self._write_pending()
        return SamplingMask._wrap(self._mask.ids.copy(), self._mask.offsets.copy())

    @property
    def routed_experts(self) -> np.ndarray | None:
        return self._context_array("routed_experts")

    @property
    def indexer_topk(self) -> np.ndarray | None:
        return self._context_array("indexer_topk")

    def _context_array(self, name: str) -> np.ndarray | None:
        self._require_arrays()
        return self._context.get(name)

    def _require_arrays(self) -> None:
        """Reading a shed trajectory's arrays is a bug: they are in the store."""
        if self.is_shed:
            raise InvalidState(f"trajectory {self.trajectory_id!r} was shed: its arrays are in the store; read it back")

    @property
    def terminal(self) -> bool:
        """No later turn can be applied: a truncated/aborted turn or a gap."""
        return self._terminal

    def carries(self, replay_field: str) -> bool:
        if replay_field == "mask":
            return self._mask is not None
        if replay_field == "mask_log_probs":
            return self._mask is not None and self._mask.log_probs is not None
        return replay_field in self._context or replay_field in self._token_log_probs

    def arrays(self, *, parts_from: int | None = None) -> dict[str, np.ndarray | list[np.ndarray]]:
        """Read-only views under contract names; valid until the next change.
        With `parts_from`, an array still held as its turns' pieces, of at
        least that many bytes each on average, comes as the list of them
        (for `codec.encode` to send unjoined: joining copies every byte)."""
        self._write_pending()

        def read(buffer: GrowableArray):
            if parts_from is not None:
                parts = buffer.parts()
                if parts.large(parts_from):
                    return parts
            return buffer.view()

        out = {
            "prompt_tokens": self.prompt_tokens,
            "tokens": read(self._tokens),
            "loss_mask": read(self._loss_mask),
            "log_probs": read(self._log_probs),
        }
        for name, buffer in self._token_log_probs.items():
            out[name] = read(buffer)
        if self._mask is not None:
            out["mask_ids"], out["mask_offsets"] = read(self._mask.ids), self._mask.offsets.view()
            if self._mask.log_probs is not None:
                out["mask_log_probs"] = read(self._mask.log_probs)
        out.update(self._context)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays, counted without writing queued appends."""
        buffers = [self._tokens, self._loss_mask, self._log_probs, *self._token_log_probs.values()]
        if self._mask is not None:
            buffers += [self._mask.ids, self._mask.offsets]
            if self._mask.log_probs is not None:
                buffers.append(self._mask.log_probs)
        context = 0 if self.is_shed or not self._context else sum(map(NBYTES, self._context.values()))
        return self.prompt_tokens.nbytes + sum(map(NBYTES, buffers)) + context + self._pending_bytes

    def _count_pending(self, turn: Turn) -> None:
        """Count a pending turn: its tokens, the support ids and the bytes it
        adds to the buffers once written."""
        forced = turn.forced_tokens.size
        length = len(turn.tokens) + forced
        total = length * _PER_TOKEN_BYTES
        if self._token_log_probs:
            total += length * LOG_PROB_DTYPE.itemsize * len(self._token_log_probs)
        if self._mask is not None:
            ids = forced + (0 if turn.mask is None else turn.mask.ids.size)
            total += length * OFFSETS_DTYPE.itemsize + ids * IDS_DTYPE.itemsize
            if self._mask.log_probs is not None:
                total += ids * LOG_PROB_DTYPE.itemsize
            self._pending_ids += ids
        self._pending_length += length
        self._pending_bytes += total

    def merged_shapes(self) -> dict[str, tuple] | None:
        """The shape of each array `arrays()` would give, in its order, when
        `merge_into` can write them: the response is still only its pending
        turns (a trajectory read for the first time, as at its delivery),
        carrying no replay field but its supports (context arrays aside).
        None otherwise, or without the compiled module."""
        mask = self._mask
        if _native is None or not self._pending or len(self._tokens) or self._token_log_probs or self.is_shed \
                or (mask is not None and (mask.log_probs is not None or len(mask.ids))):
            return None
        length = self._pending_length
        shapes = {"prompt_tokens": self.prompt_tokens.shape, "tokens": (length,), "loss_mask": (length,),
                  "log_probs": (length,)}
        if mask is not None:
            shapes["mask_ids"], shapes["mask_offsets"] = (self._pending_ids,), (length + 1,)
        for name, array in self._context.items():
            shapes[name] = array.shape
        return shapes

    def merged_crcs(self) -> dict[str, int]:
        """The CRC-32 of each array `merge_into` writes that follows from
        CRCs verified on arrival, by name: those the message that brought
        the whole trajectory kept (`arrived_whole`: its arrays are the
        trajectory's); else the support ids', when each pending turn's
        arrived in a frame of its own, checked (a large one:
        `Turn.mask_ids_crc32`), and no forced token adds one (`merge_into`
        writes those ids as they arrived, end to end). Empty otherwise."""
        arrived = self.arrived_whole
        if arrived is not None:
            return dict(arrived.array_crcs or {})
        if self._mask is None or len(self._mask.ids):
            return {}
        parts = []
        for turn in self._pending:
            if turn.forced_tokens.size or turn.mask is None or turn.mask_ids_crc32 is None:
                return {}
            parts.append((turn.mask_ids_crc32, turn.mask.ids.nbytes))
        value = crc32_joined(parts)
        return {} if value is None else {"mask_ids": value}

    @property
    def arrived_whole(self) -> Any:
        """The message that brought the whole trajectory, its prompt and its
        one turn (`Turn.arrived`), when its arrays are that message's
        unchanged: nothing written or shed since, no forced token, and the
        turn's loss mask given, not filled in. None otherwise."""
        if len(self._pending) != 1 or len(self._tokens) or self.is_shed or self.gap is not None or self._context \
                or self._token_log_probs or (self._mask is not None and self._mask.log_probs is not None):
            return None
        # A turn's replay arrays other than its supports show above: a first turn carrying any starts its context
        # arrays, token log-probs or support log-probs (`append_turn`).
        turn = self._pending[0]
        if turn.forced_tokens.size or turn.loss_mask is None:
            return None
        return turn.arrived

    @property
    def pending_turns(self) -> int:
        """Turns merged since its arrays were last written (`merge_into` reads them, writing nothing)."""
        return len(self._pending)

    def merge_into(self, out: Mapping[str, np.ndarray]) -> None:
        """Write every array into `out` (writable arrays of `merged_shapes`):
        the pending turns' in one compiled pass, as `arrays()` would join
        them, leaving them pending."""
        _native.merge_turns(self._pending, _MERGED_TURN_FIELDS, _MASK_ATTRIBUTES,  # type: ignore[union-attr]
                            (out["tokens"], out["log_probs"], out["loss_mask"], out.get("mask_ids"),
                             out.get("mask_offsets")))
        out["prompt_tokens"][...] = self.prompt_tokens
        for name, array in self._context.items():
            out[name][...] = array

    def _write_pending(self) -> None:
        """Append the pending turns' arrays: one call per array for all of
        them, each turn's sampled tokens followed by its forced ones."""
        self._require_arrays()
        pending = self._pending
        if not pending:
            return
        longest = self._pending_length  # no turn has more sampled or forced tokens
        self._pending, self._pending_length, self._pending_bytes, self._pending_ids = [], 0, 0, 0
        ones, zeros = constant_run(1, longest, LOSS_MASK_DTYPE), constant_run(0, longest, LOSS_MASK_DTYPE)
        zero_log_probs = constant_run(0.0, longest, LOG_PROB_DTYPE)
        tokens, log_probs, loss_mask = [], [], []
        for turn in pending:
            tokens.append(turn.tokens)
            log_probs.append(turn.log_probs)
            loss_mask.append(ones[: len(turn.tokens)] if turn.loss_mask is None else turn.loss_mask)
            forced = turn.forced_tokens.size
            if forced:
                tokens.append(turn.forced_tokens)
                log_probs.append(zero_log_probs[:forced])
                loss_mask.append(zeros[:forced])
        self._tokens.extend_many(tokens)
        self._log_probs.extend_many(log_probs)
        self._loss_mask.extend_many(loss_mask)
        for name, buffer in self._token_log_probs.items():
            buffer.extend_many(_with_forced_zeros(pending, name, zero_log_probs))
        if self._mask is not None:
            self._mask.append_turns(pending)

    # -- building (docs/semantics.md §3) -----------------------------------------
    def start_mask(self) -> "_MaskBuffer":
        """Begin carrying supports; only before any response token exists."""
        if self._mask is not None:
            return self._mask
        if self.response_length:
            raise LocalProtocolError(
                "mask_presence",
                f"cannot initialise a sampling mask after response tokens: trajectory {self.trajectory_id!r} "
                f"already has {self.response_length} tokens without supports",
            )
        self._mask = _MaskBuffer()
        return self._mask

    def append_sampled(
        self, tokens: np.ndarray, log_probs: np.ndarray, loss_mask: np.ndarray | None, mask: SamplingMask | None
    ) -> None:
        """Sampled tokens (contract arrays, aligned with each other; copied,
        so later changes to them change nothing)."""
        if mask is not None:
            self.start_mask()
        elif self._mask is not None:
            raise LocalProtocolError(
                "misaligned",
                f"rule '{RULE_ALIGNED}' violated: trajectory {self.trajectory_id!r} carries a sampling mask, "
                f"{len(tokens)} sampled tokens without supports would misalign it",
            )
        if self._token_log_probs:
            raise LocalProtocolError(
                "misaligned",
                f"rule '{RULE_ALIGNED}' violated: trajectory {self.trajectory_id!r} carries {list(self._token_log_probs)}, "
                f"{len(tokens)} sampled tokens without them would misalign it (append them with `append_turn`)",
            )
        self._queue(Turn(owned(tokens, tokens), owned(log_probs, log_probs),
                         loss_mask=None if loss_mask is None else owned(loss_mask, loss_mask), mask=mask))

    def append_forced(self, tokens) -> None:
        """Environment tokens: singleton support, loss 0, log-prob 0.0."""
        forced = owned(as_int_array(tokens, TOKEN_DTYPE, "forced_tokens"), tokens)
        self._queue(Turn(EMPTY_TOKENS, EMPTY_LOG_PROBS, forced_tokens=forced))

    def _queue(self, turn: Turn) -> None:
        """Keep `turn` until the next read writes it (see _write_pending);
        shed, only count its tokens."""
        if self.is_shed:
            self._shed_length += len(turn.tokens) + turn.forced_tokens.size
            return
        self._pending.append(turn)
        self._count_pending(turn)

    # -- merging (docs/semantics.md §4) -----------------------------------------
    def append_turn(self, turn: Turn) -> TurnOutcome:
        """Merge the next turn. Raises `LocalProtocolError` (and changes nothing)
        when the turn is refused; returns why when it is valid but not applied."""
        if self._terminal:
            return TurnOutcome(False, "replay_gap" if self.gap else "after_terminal")
        spans = turn.weight_version_spans
        if spans is not None and spans[-1][2] > len(turn.tokens):
            raise LocalProtocolError("misaligned", "rule 'weight_version_spans lie within the turn's sampled tokens' "
                                                   f"violated: expected ends <= {len(turn.tokens)}, got {list(spans)}")
        if not self._context and turn.routed_experts is None and turn.indexer_topk is None \
                and turn.full_log_probs is None and not self._token_log_probs and turn.mask_log_probs is None \
                and (self._mask is None or self._mask.log_probs is None):
            # The common cases: the turn carries what the trajectory carries, or brings the supports a
            # trajectory with no response token yet starts with.
            if (turn.mask is None) == (self._mask is None):
                return self._apply(turn)
            if self._mask is None and not self.response_length:
                self.start_mask()
                return self._apply(turn)
        carried = [self.carries(name) for name in REPLAY_FIELDS]
        brought = [turn.carries(name) for name in REPLAY_FIELDS]
        if carried != brought:  # a field starts or goes missing
            for name, had, has in zip(REPLAY_FIELDS, carried, brought):
                if has and not had and self.response_length:
                    raise LocalProtocolError(
                        "mask_presence",
                        f"turn {self.turns} of {self.trajectory_id!r} carries {name} but the "
                        f"{self.response_length} response tokens before it do not (missing, then present)",
                    )
        for name in CONTEXT_REPLAY_ARRAYS:
            new, old = getattr(turn, name), self._context.get(name)
            if new is not None and old is not None and (new.shape[0] < old.shape[0] or new.shape[1:] != old.shape[1:]):
                raise LocalProtocolError(
                    "misaligned",
                    f"rule '{name} covers a growing context' violated: turn {self.turns} of {self.trajectory_id!r} "
                    f"has shape {tuple(new.shape)}, the trajectory already has {tuple(old.shape)}",
                )
        missing = [name for name, had, has in zip(REPLAY_FIELDS, carried, brought) if had and not has]
        if missing:
            self.cut_at_gap(Gap(self.turns, missing[0]))
            return TurnOutcome(False, "replay_gap")
        if turn.mask is not None:
            mask = self.start_mask()
            if turn.mask_log_probs is not None and mask.log_probs is None:  # started with the response empty
                mask.log_probs = GrowableArray(LOG_PROB_DTYPE)
        for name in CONTEXT_REPLAY_ARRAYS:
            if getattr(turn, name) is not None:
                self._context[name] = _shape_of(getattr(turn, name)) if self.is_shed else getattr(turn, name)
        for name in TOKEN_LOG_PROB_ARRAYS:  # started while the response is empty (a later start was refused above)
            if getattr(turn, name) is not None and name not in self._token_log_probs:
                self._token_log_probs[name] = GrowableArray(LOG_PROB_DTYPE)
        return self._apply(turn)

    def _apply(self, turn: Turn) -> TurnOutcome:
        """Queue an accepted turn and take its status and weight version."""
        start = self.response_length
        self._sampled_end = start + len(turn.tokens)
        if turn.forced_tokens.size:
            self.forced_spans.append((self._sampled_end, self._sampled_end + turn.forced_tokens.size))
        self._queue(turn)
        self.status = turn.status
        if turn.weight_version is not None:
            self.weight_versions.append(turn.weight_version)
            spans = turn.weight_version_spans
            if spans is None:  # its one version over its sampled tokens (none, when it sampled none)
                spans = ((turn.weight_version, 0, len(turn.tokens)),) if len(turn.tokens) else ()
            self.weight_version_spans.append(tuple((version, start + s, start + e) for version, s, e in spans))
        self.turns += 1
        self._terminal = turn.status in TERMINAL_STATUSES
        return APPLIED

    def cut_at_gap(self, gap: Gap) -> None:
        """Record a replay gap: drop everything after the last fully captured
        turn's sampled tokens; nothing later applies (also used to replay a
        stored gap)."""
        self._truncate_response(self._sampled_end)
        self.gap = gap
        self._terminal = True

    def _truncate_response(self, length: int) -> None:
        self.weight_version_spans = [tuple((v, s, min(e, length)) for v, s, e in spans if s < length)
                                     for spans in self.weight_version_spans]
        self.forced_spans = [(s, min(e, length)) for s, e in self.forced_spans if s < length]
        if self.is_shed:
            self._shed_length = min(self._shed_length, length)
            self._sampled_end = min(self._sampled_end, length)
            return
        self._write_pending()
        self._tokens.truncate(length)
        self._loss_mask.truncate(length)
        self._log_probs.truncate(length)
        for buffer in self._token_log_probs.values():
            buffer.truncate(length)
        if self._mask is not None:
            self._mask.truncate(length)
        self._sampled_end = min(self._sampled_end, length)

    # -- lifecycle (docs/semantics.md §5) ---------------------------------------
    def validate(self) -> None:
        """Every per-token field has `response_length` entries."""
        self._write_pending()
        n = self.response_length
        for name, arr in (("loss_mask", self._loss_mask), ("log_probs", self._log_probs), *self._token_log_probs.items()):
            if len(arr) != n:
                raise LocalProtocolError("misaligned", f"rule '{RULE_ALIGNED}' violated: {name} has {len(arr)} entries, "
                                                       f"response_length is {n}")
        if self._mask is not None and len(self._mask) != n:
            raise LocalProtocolError("misaligned", f"rule '{RULE_ALIGNED}' violated: mask covers {len(self._mask)} tokens, "
                                                   f"response_length is {n}")
        if self._mask is not None and self._mask.log_probs is not None and len(self._mask.log_probs) != len(self._mask.ids):
            raise LocalProtocolError("misaligned", f"rule '{RULE_SUPPORT_ALIGNED}' violated: mask_log_probs has "
                                                   f"{len(self._mask.log_probs)} entries, mask_ids has {len(self._mask.ids)}")
        past = [span for spans in self.weight_version_spans for span in spans if span[2] > n]
        if past:
            raise LocalProtocolError("misaligned", f"rule 'weight_version_spans lie within the response' violated: "
                                                   f"{past} end after response_length {n}")

    def strip_last_output_tokens(self, n: int) -> None:
        """Cut the last `n` response tokens from every per-token field."""
        if n <= 0:
            return
        if n > self.response_length:
            raise InvalidInput(f"cannot strip {n} tokens: at most response_length ({self.response_length}) can be stripped")
        self._truncate_response(self.response_length - n)

    def reset_for_retry(self) -> None:
        """Discard the response (and its replay capture) for a fresh attempt."""
        self._reset_response()
        self.status = "aborted"

    # -- restoring ----------------------------------------------------------
    @classmethod
    def from_arrays(
        cls,
        trajectory_id: str,
        arrays: Mapping[str, np.ndarray],
        *,
        status: str | None,
        turns: int,
        weight_versions=(),
        weight_version_spans=(),
        gap: Gap | None = None,
        sampled_end: int | None = None,
        terminal: bool | None = None,
        **identity,
    ) -> "Trajectory":
        """Rebuild a trajectory from its stored or delivered arrays."""
        traj = cls(trajectory_id, arrays.get("prompt_tokens", ()), **identity)
        traj._tokens.extend(arrays["tokens"])
        traj._loss_mask.extend(arrays["loss_mask"])
        traj._log_probs.extend(arrays["log_probs"])
        if "mask_ids" in arrays:
            traj._mask = _MaskBuffer(arrays["mask_ids"], arrays["mask_offsets"], arrays.get("mask_log_probs"))
        for name in TOKEN_LOG_PROB_ARRAYS:
            if name in arrays:
                traj._token_log_probs[name] = GrowableArray(LOG_PROB_DTYPE)
                traj._token_log_probs[name].extend(arrays[name])
        for name in CONTEXT_REPLAY_ARRAYS:
            if name in arrays:
                traj._context[name] = frozen(np.array(arrays[name]))
        traj.status = status
        traj.turns = turns
        traj.weight_versions = list(weight_versions)
        # (none from an older peer)
        traj.weight_version_spans = [tuple((v, s, e) for v, s, e in spans) for spans in weight_version_spans]
        traj.gap = gap
        traj._sampled_end = traj.response_length if sampled_end is None else sampled_end
        traj._terminal = (gap is not None or status in TERMINAL_STATUSES) if terminal is None else terminal
        traj.validate()
        return traj

    def __repr__(self) -> str:
        return (
            f"Trajectory({self.trajectory_id!r}, turns={self.turns}, response_length={self.response_length}, "
            f"status={self.status}, mask={self.has_mask}, gap={self.gap})"
        )
