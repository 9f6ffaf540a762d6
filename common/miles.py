"""Interop with miles: its session samples payload and its train-data dict.

The session payload (docs/semantics.md §7) is one safetensors blob: a rank-1
uint8 `_samples_meta` tensor holding compact UTF-8 JSON, plus `{field}.{i}`
tensors per sample and the mask as `rollout_sampling_mask.ids.{i}` /
`.offsets.{i}`, with the sampler's log-prob of each support id beside them as
`.logprobs.{i}` (float32, one per id) when the mask carries them: a decoded
sample holds those as `mask_log_probs`. The field table, its order, its defaults and its nulls are
miles' as of the commit `MILES_COMMIT` names, so what `encode_session_samples`
writes is byte-identical to what miles' encoder writes for the same samples,
and miles' decoder reads it. The mask crosses only when the caller asks for
it, appended after the other fields as miles appends it.

Fields a newer miles adds are carried, not refused: decoding keeps them on
the samples (`SessionSamples.unknown` lists them) and `SessionSamples.encode`
writes them back byte-identical. Where miles' decoder and this one differ
(a JSON field a sample lacks takes its default here; miles raises
`KeyError`), docs/data-model.md says so.

The train data (docs/semantics.md §6) is the per-sample dict miles' trainer reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import safetensors
import safetensors.numpy

from .contract import SUPPORT_LOG_PROB_ARRAYS, TOKEN_LOG_PROB_ARRAYS
from .errors import InvalidInput, InvalidType
from .mask import SamplingMask
from .trajectory import Trajectory
from .validation import RULE_SUPPORT_ALIGNED, check_whole_batch_rule

MILES_COMMIT = "sii-avalanche/miles@4d412b5"  # the tree whose codec, defaults and train data these match


@dataclass(frozen=True)
class SessionField:
    """Wire contract of one field of a session sample."""

    codec: str  # "json" | "tensor" | "mask"
    dtype: np.dtype | None = None
    strict: bool = False  # encode refuses any other dtype instead of converting
    default: Callable[[], Any] | None = None  # a JSON field's value when a sample lacks it; None: required
    left_out_when_none: bool = False  # a tensor written not at all (no null marker) when None, as miles' top-k


def _spec_info() -> dict:
    return {"spec_num_correct_drafts": 0, "spec_num_proposed_drafts": 0, "spec_verify_ct": 0, "completion_tokens": 0}


def _prefix_cache_info() -> dict:
    return {"cached_tokens": 0, "total_prompt_tokens": 0}


# In miles' order; a JSON field's default is what a fresh miles `Sample` holds (its `to_dict()` form).
SESSION_FIELDS: dict[str, SessionField] = {
    "tokens": SessionField("tensor", np.dtype("<i8")),
    "response": SessionField("json", default=str),
    "response_length": SessionField("json"),
    "loss_mask": SessionField("tensor", np.dtype("u1")),
    "rollout_log_probs": SessionField("tensor", np.dtype("<f8")),
    "rollout_topk_token_ids": SessionField("tensor", np.dtype("<i4"), strict=True, left_out_when_none=True),
    "rollout_topk_log_probs": SessionField("tensor", np.dtype("<f4"), strict=True, left_out_when_none=True),
    "rollout_sampling_mask": SessionField("mask"),
    "rollout_routed_experts": SessionField("tensor", np.dtype("<i4"), strict=True),
    "rollout_indexer_topk": SessionField("tensor", np.dtype("<i4"), strict=True),
    "status": SessionField("json"),
    "weight_versions": SessionField("json", default=list),
    "spec_info": SessionField("json", default=_spec_info),
    "prefix_cache_info": SessionField("json", default=_prefix_cache_info),
    "metadata": SessionField("json", default=dict),
    "reward": SessionField("json", default=lambda: None),  # the second version of the wire only
}
MASK_FIELD = "rollout_sampling_mask"
# The sample key of the mask's support log-probs (miles keeps them on its mask, as `logprobs`): float32, aligned with
# the mask's ids, crossing as `rollout_sampling_mask.logprobs.{i}` beside them. Unpacked: a second support log-prob
# array in the contract would need a wire name of its own, so it fails here, at import.
(MASK_LOG_PROBS,) = SUPPORT_LOG_PROB_ARRAYS
_MASK_LOG_PROBS_SPEC = SessionField("tensor", np.dtype("<f4"))
REWARD_FIELD = "reward"
DEFAULT_FIELDS = tuple(name for name in SESSION_FIELDS if name not in (MASK_FIELD, REWARD_FIELD))
FIELDS_WITH_MASK = (*DEFAULT_FIELDS, MASK_FIELD)
FIELDS_WITH_REWARD = (*DEFAULT_FIELDS, REWARD_FIELD)  # with the mask: (*FIELDS_WITH_REWARD, MASK_FIELD)
META_KEY = "_samples_meta"
_TENSOR_FIELDS = frozenset(name for name, spec in SESSION_FIELDS.items() if spec.codec != "json")
# What rebuilding turns needs (the split of tokens, the status) has no default: a sample without it is refused.
_REQUIRED_JSON = [name for name, spec in SESSION_FIELDS.items() if spec.codec == "json" and spec.default is None]


class MissingTensor(InvalidInput, KeyError):
    """A tensor the payload promises is not in it (a `KeyError` too, as miles raises)."""


@dataclass
class SessionSamples:
    """A decoded session payload. Samples are dicts keyed by field name;
    tensors stay numpy arrays, the mask is a `SamplingMask`, nulls are None.

    `fields` are the payload's fields in its order; `unknown` those this
    codec does not know (a newer miles'), kept on the samples as read: JSON
    values, or tensors with the dtype they came in."""

    samples: list[dict[str, Any]]
    session_metadata: Any
    empty_reason: str | None = None
    fields: tuple[str, ...] = DEFAULT_FIELDS
    unknown: dict[str, SessionField] = field(default_factory=dict)

    def encode(self) -> bytes:
        """The payload again, byte-identical to the one decoded (unknown fields included)."""
        return encode_session_samples(self.samples, self.session_metadata, self.empty_reason, fields=self.fields,
                                      unknown=self.unknown)


def _specs(fields: Sequence[str], unknown: Mapping[str, SessionField]) -> list[tuple[str, SessionField]]:
    out = []
    for name in fields:
        spec = SESSION_FIELDS.get(name) or unknown.get(name)
        if spec is None:
            raise InvalidInput(f"unknown session field {name!r}; expected names from {list(SESSION_FIELDS)} "
                               f"or the unknown fields a decoded payload carried ({sorted(unknown)})")
        out.append((name, spec))
    return out


def _wire_tensor(name: str, i: int, value, spec: SessionField) -> np.ndarray:
    arr = np.asarray(value)
    assert spec.dtype is not None, f"{name}: a tensor field has a dtype"
    if arr.dtype == spec.dtype:
        return np.ascontiguousarray(arr)
    if spec.strict:
        raise InvalidInput(f"{name} must have dtype {spec.dtype.name}, got {arr.dtype} (sample {i}; strict: never "
                           "converted)")
    converted = arr.astype(spec.dtype)
    if arr.dtype.kind not in "biuf" or not np.array_equal(converted, arr):
        raise InvalidInput(f"{name} values do not fit wire dtype {spec.dtype.name} unchanged (sample {i}, dtype "
                           f"{arr.dtype})")
    return np.ascontiguousarray(converted)


def encode_session_samples(
    samples: Sequence[Mapping[str, Any]],
    session_metadata: Any = None,
    empty_reason: str | None = None,
    *,
    fields: Sequence[str] = DEFAULT_FIELDS,
    unknown: Mapping[str, SessionField] | None = None,
) -> bytes:
    """One safetensors payload for `samples` (dicts keyed by field name).

    Only `fields` cross, in their order: JSON fields verbatim (one a sample
    lacks, or holds as None, as miles' default for it; `response_length`
    and `status` are required), tensor fields that are None as null markers
    (the top-k fields not at all, as miles leaves them out). Pass
    `FIELDS_WITH_MASK` to send the mask, with a sample's `mask_log_probs`
    (one per mask id) beside it when the sample holds them; `unknown` are
    the specs of fields a decoded payload carried (`SessionSamples.unknown`)."""
    specs = _specs(fields, unknown or {})
    tensors: dict[str, np.ndarray] = {}
    metas = []
    for i, sample in enumerate(samples):
        meta: dict[str, Any] = {}
        nulls = []
        for name, spec in specs:
            value = sample.get(name)
            if spec.codec == "json":
                if name in SESSION_FIELDS and value is None:
                    if spec.default is None:
                        raise InvalidInput(f"sample {i} lacks {name!r}: required, it has no default (required: "
                                           f"{_REQUIRED_JSON})")
                    value = spec.default()
                elif name not in sample:
                    continue  # an unknown field this sample did not carry
                meta[name] = value
            elif value is None:
                if spec.codec == "mask" and sample.get(MASK_LOG_PROBS) is not None:
                    raise InvalidInput(f"sample {i} holds {MASK_LOG_PROBS} but no {name}: the support log-probs "
                                       "cross beside the mask's ids")
                if not spec.left_out_when_none and (name in SESSION_FIELDS or name in sample):
                    nulls.append(name)
            elif spec.codec == "mask":
                if not isinstance(value, SamplingMask):
                    raise InvalidType(f"{name} of sample {i} must be a SamplingMask, got {type(value).__name__}")
                tensors[f"{name}.ids.{i}"] = np.ascontiguousarray(value.ids)
                tensors[f"{name}.offsets.{i}"] = np.ascontiguousarray(value.offsets)
                log_probs = sample.get(MASK_LOG_PROBS)
                if log_probs is not None:
                    log_probs = _wire_tensor(MASK_LOG_PROBS, i, log_probs, _MASK_LOG_PROBS_SPEC)
                    _check_support_aligned(log_probs, value.ids, i)
                    tensors[f"{name}.logprobs.{i}"] = log_probs
            else:
                tensors[f"{name}.{i}"] = _wire_tensor(name, i, value, spec)
        meta["nulls"] = nulls
        metas.append(meta)
    document = {"samples": metas, "session_metadata": session_metadata, "empty_reason": empty_reason}
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    tensors[META_KEY] = np.frombuffer(text, dtype=np.uint8)
    return safetensors.numpy.save(tensors)


def _take(tensors: dict, key: str, name: str, dtype: np.dtype | None, i: int) -> np.ndarray:
    """The tensor `key`, which the payload promises, in `dtype` (None: the caller checks)."""
    if key not in tensors:
        raise MissingTensor(f"payload promises {name} of sample {i} but tensor {key!r} is missing")
    arr = tensors.pop(key)
    if dtype is not None and arr.dtype != dtype:
        raise InvalidInput(f"{name} must have dtype {dtype.name}, got {arr.dtype} (tensor {key!r}; never converted)")
    return arr


def _check_support_aligned(log_probs: np.ndarray, ids: np.ndarray, i: int) -> None:
    if log_probs.ndim != 1 or len(log_probs) != len(ids):
        raise InvalidInput(f"{MASK_LOG_PROBS} of sample {i}: rule '{RULE_SUPPORT_ALIGNED}' violated: expected "
                           f"{len(ids)} entries (one per mask id), got shape {list(log_probs.shape)}")


def _carries_mask(tensors: Mapping[str, Any], sample_metas: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a payload was encoded with the mask field: it holds a mask
    tensor, or a sample's null markers name the mask."""
    prefix = MASK_FIELD + "."
    return any(key.startswith(prefix) for key in tensors) or any(MASK_FIELD in meta["nulls"] for meta in sample_metas)


def _unknown_tensors(tensors: Mapping[str, np.ndarray], n: int) -> dict[tuple[str, int], np.ndarray]:
    """The tensors no known field took, by (field, sample) as `{field}.{i}`
    names them; one that names no sample is refused."""
    out = {}
    for key, arr in tensors.items():
        name, _, index = key.rpartition(".")
        if not name or name.split(".")[0] in SESSION_FIELDS or not index.isdigit() or int(index) >= n:
            raise InvalidInput(f"payload carries unreferenced tensors: {sorted(tensors)} (no sample refers to "
                               f"{key!r}: a tensor is '{{field}}.{{sample}}' for one of the {n} samples, and a known "
                               "field's only where the caller reads that field)")
        out[(name, int(index))] = arr
    return out


def decode_session_samples(payload: bytes, *, fields: Sequence[str] | None = None) -> SessionSamples:
    """Strictly decode a session payload: wrong dtypes, missing promised
    tensors (`MissingTensor`, a `KeyError` too) and tensors no sample can
    refer to are errors; so are a mask's support log-probs (`.logprobs.{i}`,
    a sample's `mask_log_probs`) unless float32 and one per id
    (`RULE_SUPPORT_ALIGNED`). A known JSON field a sample lacks gets its default
    (`SessionField.default`); one without a default is an error. Fields this
    codec does not know are carried (`SessionSamples.unknown`).

    `fields` None reads what the payload carries: `DEFAULT_FIELDS`, plus
    `reward` and the mask when the payload carries them. Named `fields` are
    read exactly (a mask the caller did not name is a tensor no sample
    refers to)."""
    if fields is not None:
        _specs(fields, {})
    try:
        tensors = dict(safetensors.numpy.load(payload))
    except (safetensors.SafetensorError, ValueError) as exc:
        raise InvalidInput(f"payload is not a valid safetensors container: {exc}") from None
    if META_KEY not in tensors:
        raise MissingTensor(f"payload has no {META_KEY} tensor")
    meta_arr = tensors.pop(META_KEY)
    if meta_arr.ndim != 1 or meta_arr.dtype != np.uint8:
        raise InvalidInput(f"{META_KEY} must be a rank-1 uint8 tensor, got {meta_arr.dtype} of rank {meta_arr.ndim}")
    try:
        document = json.loads(meta_arr.tobytes().decode("utf-8"))
        sample_metas = document["samples"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InvalidInput(f"{META_KEY} is not the expected JSON document: {exc}") from None
    if not isinstance(sample_metas, list):
        raise InvalidInput(f"{META_KEY}'s 'samples' must be a list, got {type(sample_metas).__name__} {sample_metas!r:.80}")
    known_json = {name for name, spec in SESSION_FIELDS.items() if spec.codec == "json"}
    for i, meta in enumerate(sample_metas):
        nulls = meta.get("nulls") if isinstance(meta, dict) else None
        if not isinstance(nulls, list) or not all(isinstance(name, str) for name in nulls):
            raise InvalidInput(f"sample {i} meta must be an object with a 'nulls' list of field names, got {meta!r:.80}")
        strays = known_json & set(meta["nulls"])
        if strays:
            raise InvalidInput(f"null markers reference non-tensor fields: {sorted(strays)} (sample {i})")
    if fields is None:
        fields = FIELDS_WITH_REWARD if any(REWARD_FIELD in meta for meta in sample_metas) else DEFAULT_FIELDS
        if _carries_mask(tensors, sample_metas):
            fields = (*fields, MASK_FIELD)
    samples = []
    for i, meta in enumerate(sample_metas):
        nulls = set(meta["nulls"])
        sample: dict[str, Any] = {}
        for name in fields:
            spec = SESSION_FIELDS[name]
            if spec.codec == "json":
                if name in meta:
                    sample[name] = meta[name]
                elif spec.default is not None:
                    sample[name] = spec.default()
                else:
                    raise InvalidInput(f"sample {i} meta lacks field {name!r}, which has no default (required: "
                                       f"{_REQUIRED_JSON}; the other JSON fields take their default when left out)")
            elif name in nulls:
                sample[name] = None
            elif spec.codec == "mask":
                ids = _take(tensors, f"{name}.ids.{i}", f"{name} ids", None, i)
                offsets = _take(tensors, f"{name}.offsets.{i}", f"{name} offsets", None, i)
                if ids.dtype != np.dtype("<i4") or offsets.dtype != np.dtype("<i8"):
                    raise InvalidInput(f"{name} must use int32 ids and int64 offsets, got {ids.dtype} and "
                                       f"{offsets.dtype} (sample {i}; never converted)")
                sample[name] = SamplingMask(ids, offsets)
                if f"{name}.logprobs.{i}" in tensors:  # the support's log-probs, when the mask carries them
                    log_probs = _take(tensors, f"{name}.logprobs.{i}", f"{name} logprobs", _MASK_LOG_PROBS_SPEC.dtype, i)
                    _check_support_aligned(log_probs, ids, i)
                    sample[MASK_LOG_PROBS] = log_probs
            elif spec.left_out_when_none and f"{name}.{i}" not in tensors:
                sample[name] = None  # left out by an encoder that did not collect it
            else:
                assert spec.dtype is not None, f"{name}: a tensor field has a dtype"
                sample[name] = _take(tensors, f"{name}.{i}", name, spec.dtype, i)
        samples.append(sample)
    unknown = _carry_unknown(samples, sample_metas, _unknown_tensors(tensors, len(samples)))
    ordered = [name for name in fields if name != MASK_FIELD] + list(unknown)
    if MASK_FIELD in fields:
        ordered.append(MASK_FIELD)
    return SessionSamples(samples, document.get("session_metadata"), document.get("empty_reason"), tuple(ordered),
                          unknown)


def _carry_unknown(samples: list[dict], sample_metas: Sequence[Mapping[str, Any]],
                   tensors: Mapping[tuple[str, int], np.ndarray]) -> dict[str, SessionField]:
    """Put the fields no known spec reads on the samples, as read; their
    specs, in the payload's order (JSON keys and null markers as they come,
    then tensors by name)."""
    unknown: dict[str, SessionField] = {}
    for i, (sample, meta) in enumerate(zip(samples, sample_metas)):
        for name, value in meta.items():
            if name != "nulls" and name not in SESSION_FIELDS:
                unknown.setdefault(name, SessionField("json"))
                sample[name] = value
        for name in meta["nulls"]:
            if name not in SESSION_FIELDS:
                unknown.setdefault(name, SessionField("tensor"))
                sample[name] = None
    for (name, i), arr in sorted(tensors.items()):
        spec = unknown.get(name)
        if spec is not None and spec.codec == "json":
            raise InvalidInput(f"unknown field {name!r} is a JSON value and a tensor ({name}.{i}) at once")
        if spec is None or spec.dtype is None:
            unknown[name] = SessionField("tensor", arr.dtype, strict=True)
        elif spec.dtype != arr.dtype:
            raise InvalidInput(f"unknown field {name!r} must keep one dtype across samples: {spec.dtype.name}, "
                               f"got {arr.dtype} in sample {i}")
        samples[i][name] = arr
    for name, spec in unknown.items():
        if spec.codec == "tensor" and spec.dtype is None:  # null in every sample: the dtype never shows
            unknown[name] = SessionField("tensor", np.dtype("u1"), strict=True)
    return unknown


# -- train data ------------------------------------------------------------
MASK_KEYS = ("rollout_sampling_mask_ids", "rollout_sampling_mask_offsets")
REPLAY_KEYS = {"rollout_routed_experts": "routed_experts", "rollout_indexer_topk": "indexer_topk"}
# The per-token log-prob arrays beyond `log_probs`, as `rollout_log_probs` is named (metrics average them as they do it).
TOKEN_LOG_PROB_KEYS = {f"rollout_{name}": name for name in TOKEN_LOG_PROB_ARRAYS}
# The per-support-id log-prob arrays beside the mask's keys (`rollout_sampling_mask_log_probs`): per sample, aligned
# with its `rollout_sampling_mask_ids`. Payload of the mask, as its ids are.
SUPPORT_LOG_PROB_KEYS = {f"rollout_sampling_{name}": name for name in SUPPORT_LOG_PROB_ARRAYS}
# Per-sample payload, never averaged into metrics.
PAYLOAD_KEYS = frozenset(MASK_KEYS) | frozenset(REPLAY_KEYS) | frozenset(SUPPORT_LOG_PROB_KEYS) | {"weight_versions"}

TRAIN_DTYPES: dict[str, np.dtype] = {  # miles' rollout-data dtypes
    "tokens": np.dtype(np.int32),
    "response_lengths": np.dtype(np.int64),
    "loss_masks": np.dtype(np.int32),
    "rollout_log_probs": np.dtype(np.float32),
    **dict.fromkeys(TOKEN_LOG_PROB_KEYS, np.dtype(np.float32)),
    "sample_indices": np.dtype(np.int64),
    "truncated": np.dtype(np.int64),
    "rollout_ids": np.dtype(np.int64),
    "rollout_mask_sums": np.dtype(np.int64),
    "rollout_sampling_mask_ids": np.dtype(np.int32),
    "rollout_sampling_mask_offsets": np.dtype(np.int64),
    **dict.fromkeys(SUPPORT_LOG_PROB_KEYS, np.dtype(np.float32)),
    "rollout_routed_experts": np.dtype(np.int32),
    "rollout_indexer_topk": np.dtype(np.int32),
}


def rollout_keys(rewards: Sequence[Any], statuses: Sequence[str | None], indices: Sequence[int],
                 mask_totals: Sequence[int], metadata: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The train-data keys miles derives from per-sample facts: `raw_reward`
    (the rewards, or each sample's `metadata["raw_reward"]` when the first
    sample's metadata holds one), `truncated`, `rollout_ids` (a sample's
    rollout: its sample index, as miles falls back to it) and
    `rollout_mask_sums` (every sample of a rollout carries the loss-mask
    total over all of them)."""
    totals: dict[int, int] = {}
    for rollout, total in zip(indices, mask_totals):
        totals[rollout] = totals.get(rollout, 0) + int(total)
    raw = (list(rewards) if not metadata or "raw_reward" not in (metadata[0] or {})
           else [m["raw_reward"] for m in metadata])
    return {
        "raw_reward": raw,
        "truncated": np.array([status == "truncated" for status in statuses], dtype=TRAIN_DTYPES["truncated"]),
        "rollout_ids": np.array(indices, dtype=TRAIN_DTYPES["rollout_ids"]),
        "rollout_mask_sums": np.array([totals[r] for r in indices], dtype=TRAIN_DTYPES["rollout_mask_sums"]),
    }


def weight_version_calls(versions: Sequence[Sequence[str]], spans: Sequence[Sequence[Sequence[tuple[str, int, int]]]],
                         prompt_lengths: Sequence[int]) -> list[list[list[dict]]] | None:
    """miles' `weight_versions` train-data key: per sample, one engine call
    per versioned turn (a miles sample holding several calls became a turn
    per call where it was read), its spans in absolute token positions.
    None when no sample has a version, or when one came without its spans
    (from an older broker)."""
    if not any(versions) or any(len(v) != len(s) for v, s in zip(versions, spans)):
        return None
    return [[[{"version": version, "abs_start": prompt + start, "abs_end": prompt + end} for version, start, end in turn]
             for turn in sample_spans]
            for sample_spans, prompt in zip(spans, prompt_lengths)]


def to_train_data(trajectories: Sequence[Trajectory], *, strict_replay: bool = False) -> dict[str, Any]:
    """miles' rollout data dict for a batch of merged trajectories.

    Per-sample keys are lists of arrays with miles' dtypes; `tokens` is the
    prompt followed by the response. The whole-batch rule applies to the
    mask: all samples carry it, or none does. A replay field (the context
    replay arrays, `full_log_probs` as `rollout_full_log_probs`, and
    `mask_log_probs` as `rollout_sampling_mask_log_probs`, each sample's
    aligned with its `rollout_sampling_mask_ids`) follows miles' rule:
    present when the first sample carries it, with a None row for a sample
    that does not (`strict_replay` refuses such a batch instead, naming the
    sample). A sample without a `sample_index` gets its batch position.
    """
    indices = [t.sample_index if t.sample_index is not None else i for i, t in enumerate(trajectories)]
    statuses = [t.status for t in trajectories]
    check_whole_batch_rule([t.has_mask for t in trajectories], indices, statuses)
    loss_masks = [t.loss_mask.astype(np.int32) for t in trajectories]
    rewards = [t.reward for t in trajectories]
    data: dict[str, Any] = {
        "tokens": [np.concatenate([t.prompt_tokens, t.tokens]).astype(np.int32) for t in trajectories],
        "response_lengths": np.array([t.response_length for t in trajectories], dtype=np.int64),
        "loss_masks": loss_masks,
        "rollout_log_probs": [t.log_probs.astype(np.float32) for t in trajectories],
        "rewards": rewards,
        "sample_indices": np.array(indices, dtype=np.int64),
        **rollout_keys(rewards, statuses, indices, [int(m.sum()) for m in loss_masks],
                       [t.metadata for t in trajectories]),
    }
    if trajectories and trajectories[0].has_mask:
        ids: list[np.ndarray] = []
        offsets: list[np.ndarray] = []
        for t in trajectories:
            mask = t.mask
            assert mask is not None, "the whole-batch rule: every sample carries a mask"
            ids.append(mask.ids)
            offsets.append(mask.offsets)
        data["rollout_sampling_mask_ids"], data["rollout_sampling_mask_offsets"] = ids, offsets
    for key, name in {**REPLAY_KEYS, **TOKEN_LOG_PROB_KEYS, **SUPPORT_LOG_PROB_KEYS}.items():
        rows = [getattr(t, name) for t in trajectories]
        if strict_replay:
            check_whole_batch_rule([row is not None for row in rows], indices, statuses, field=name)
        if rows and rows[0] is not None:
            data[key] = rows
    calls = weight_version_calls([t.weight_versions for t in trajectories], [t.weight_version_spans for t in trajectories],
                                 [len(t.prompt_tokens) for t in trajectories])
    if calls is not None:
        data["weight_versions"] = calls
    return data


def metric_view(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` without the mask and replay keys: what metrics may reduce."""
    return {key: value for key, value in data.items() if key not in PAYLOAD_KEYS}
