"""Interop with miles: its session samples payload and its train-data dict.

The session payload (docs/semantics.md §7) is one safetensors blob: a rank-1
uint8 `_samples_meta` tensor holding compact UTF-8 JSON, plus `{field}.{i}`
tensors per sample and the mask as `rollout_sampling_mask.ids.{i}` /
`.offsets.{i}`. The mask crosses only when the caller asks for it, so a
payload encoded with the default fields from samples that carry each of them
is byte-identical to one from an encoder that never knew about masks
(docs/data-model.md says exactly which). Decoding fills a JSON field a
sample lacks with its default when miles has one for it, as miles does.

The train data (docs/semantics.md §6) is the per-sample dict miles' trainer reads.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import safetensors
import safetensors.numpy

from .errors import InvalidInput, InvalidType
from .mask import SamplingMask
from .trajectory import Trajectory
from .validation import check_whole_batch_rule


@dataclass(frozen=True)
class SessionField:
    """Wire contract of one field of a session sample."""

    codec: str  # "json" | "tensor" | "mask"
    dtype: np.dtype | None = None
    strict: bool = False  # encode refuses any other dtype instead of converting
    default: Callable[[], Any] | None = None  # a JSON field's value when a sample lacks it; None: required


SESSION_FIELDS: dict[str, SessionField] = {
    "tokens": SessionField("tensor", np.dtype("<i8")),
    "response": SessionField("json", default=str),
    "response_length": SessionField("json"),
    "loss_mask": SessionField("tensor", np.dtype("u1")),
    "rollout_log_probs": SessionField("tensor", np.dtype("<f8")),
    "rollout_sampling_mask": SessionField("mask"),
    "rollout_routed_experts": SessionField("tensor", np.dtype("<i4"), strict=True),
    "rollout_indexer_topk": SessionField("tensor", np.dtype("<i4"), strict=True),
    "status": SessionField("json"),
    "weight_versions": SessionField("json", default=list),
    "spec_info": SessionField("json", default=dict),
    "prefix_cache_info": SessionField("json", default=dict),
    "metadata": SessionField("json", default=dict),
}
MASK_FIELD = "rollout_sampling_mask"
DEFAULT_FIELDS = tuple(name for name in SESSION_FIELDS if name != MASK_FIELD)
FIELDS_WITH_MASK = tuple(SESSION_FIELDS)
META_KEY = "_samples_meta"
_TENSOR_FIELDS = frozenset(name for name, spec in SESSION_FIELDS.items() if spec.codec != "json")
# What rebuilding turns needs (the split of tokens, the status) has no default: a sample without it is refused.
_REQUIRED_JSON = [name for name, spec in SESSION_FIELDS.items() if spec.codec == "json" and spec.default is None]


@dataclass
class SessionSamples:
    """A decoded session payload. Samples are dicts keyed by field name;
    tensors stay numpy arrays, the mask is a `SamplingMask`, nulls are None."""

    samples: list[dict[str, Any]]
    session_metadata: Any
    empty_reason: str | None = None


def _check_fields(fields: Sequence[str]) -> None:
    unknown = [name for name in fields if name not in SESSION_FIELDS]
    if unknown:
        raise InvalidInput(f"unknown session field(s) {unknown}; expected names from {list(SESSION_FIELDS)}")


def _wire_tensor(name: str, value, spec: SessionField) -> np.ndarray:
    arr = np.asarray(value)
    assert spec.dtype is not None, f"{name}: a tensor field has a dtype"
    if arr.dtype == spec.dtype:
        return np.ascontiguousarray(arr)
    if spec.strict:
        raise InvalidInput(f"{name} must have dtype {spec.dtype.name}, got {arr.dtype} (strict: never converted)")
    converted = arr.astype(spec.dtype)
    if arr.dtype.kind not in "biuf" or not np.array_equal(converted, arr):
        raise InvalidInput(f"{name} values do not fit wire dtype {spec.dtype.name} unchanged (got dtype {arr.dtype})")
    return np.ascontiguousarray(converted)


def encode_session_samples(
    samples: Sequence[Mapping[str, Any]],
    session_metadata: Any = None,
    empty_reason: str | None = None,
    *,
    fields: Sequence[str] = DEFAULT_FIELDS,
) -> bytes:
    """One safetensors payload for `samples` (dicts keyed by field name).

    Only `fields` cross; JSON fields travel verbatim, tensor fields that are
    None become null markers. Pass `FIELDS_WITH_MASK` to send the mask."""
    _check_fields(fields)
    tensors: dict[str, np.ndarray] = {}
    metas = []
    for i, sample in enumerate(samples):
        meta: dict[str, Any] = {}
        nulls = []
        for name in fields:
            spec = SESSION_FIELDS[name]
            value = sample.get(name)
            if spec.codec == "json":
                meta[name] = value
            elif value is None:
                nulls.append(name)
            elif spec.codec == "mask":
                if not isinstance(value, SamplingMask):
                    raise InvalidType(f"{name} of sample {i} must be a SamplingMask, got {type(value).__name__}")
                tensors[f"{name}.ids.{i}"] = np.ascontiguousarray(value.ids)
                tensors[f"{name}.offsets.{i}"] = np.ascontiguousarray(value.offsets)
            else:
                tensors[f"{name}.{i}"] = _wire_tensor(f"{name} of sample {i}", value, spec)
        meta["nulls"] = nulls
        metas.append(meta)
    document = {"samples": metas, "session_metadata": session_metadata, "empty_reason": empty_reason}
    text = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    tensors[META_KEY] = np.frombuffer(text, dtype=np.uint8)
    return safetensors.numpy.save(tensors)


def _take(tensors: dict, key: str, dtype: np.dtype, what: str) -> np.ndarray:
    if key not in tensors:
        raise InvalidInput(f"payload promises {what} but tensor {key!r} is missing")
    arr = tensors.pop(key)
    if arr.dtype != dtype:
        raise InvalidInput(f"{key} must have dtype {dtype.name}, got {arr.dtype} (never converted)")
    return arr


def _carries_mask(tensors: Mapping[str, Any], sample_metas: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a payload was encoded with the mask field: it holds a mask
    tensor, or a sample's null markers name the mask."""
    prefix = MASK_FIELD + "."
    return any(key.startswith(prefix) for key in tensors) or any(MASK_FIELD in meta["nulls"] for meta in sample_metas)


def decode_session_samples(payload: bytes, *, fields: Sequence[str] | None = None) -> SessionSamples:
    """Strictly decode a session payload: wrong dtypes, missing promised
    tensors and tensors no sample refers to are all errors. A JSON field a
    sample lacks gets its default (`SessionField.default`); one without a
    default is an error.

    `fields` None reads what the payload carries: `DEFAULT_FIELDS`, plus the
    mask when the payload was encoded with it (`_carries_mask`). Named
    `fields` are read exactly (a mask the caller did not name is a tensor no
    sample refers to)."""
    if fields is not None:
        _check_fields(fields)
    try:
        tensors = dict(safetensors.numpy.load(payload))
    except (safetensors.SafetensorError, ValueError) as exc:
        raise InvalidInput(f"payload is not a valid safetensors container: {exc}") from None
    if META_KEY not in tensors:
        raise InvalidInput(f"payload has no {META_KEY} tensor")
    meta_arr = tensors.pop(META_KEY)
    if meta_arr.ndim != 1 or meta_arr.dtype != np.uint8:
        raise InvalidInput(f"{META_KEY} must be a rank-1 uint8 tensor, got {meta_arr.dtype} of rank {meta_arr.ndim}")
    try:
        document = json.loads(meta_arr.tobytes().decode("utf-8"))
        sample_metas = document["samples"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise InvalidInput(f"{META_KEY} is not the expected JSON document: {exc}") from None
    for i, meta in enumerate(sample_metas):
        if not isinstance(meta, dict) or not isinstance(meta.get("nulls"), list):
            raise InvalidInput(f"sample {i} meta must be an object with a 'nulls' list, got {meta!r:.80}")
        strays = set(meta["nulls"]) - _TENSOR_FIELDS
        if strays:
            raise InvalidInput(f"sample {i} null markers must name tensor fields {sorted(_TENSOR_FIELDS)}, "
                               f"they name non-tensor fields {sorted(strays)}")
    if fields is None:
        fields = FIELDS_WITH_MASK if _carries_mask(tensors, sample_metas) else DEFAULT_FIELDS
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
                ids = _take(tensors, f"{name}.ids.{i}", np.dtype("<i4"), f"{name} of sample {i}")
                offsets = _take(tensors, f"{name}.offsets.{i}", np.dtype("<i8"), f"{name} of sample {i}")
                sample[name] = SamplingMask(ids, offsets)
            else:
                assert spec.dtype is not None, f"{name}: a tensor field has a dtype"
                sample[name] = _take(tensors, f"{name}.{i}", spec.dtype, f"{name} of sample {i}")
        samples.append(sample)
    if tensors:
        raise InvalidInput(f"payload carries tensors no sample refers to: {sorted(tensors)}")
    return SessionSamples(samples, document.get("session_metadata"), document.get("empty_reason"))


# -- train data ------------------------------------------------------------
MASK_KEYS = ("rollout_sampling_mask_ids", "rollout_sampling_mask_offsets")
REPLAY_KEYS = {"rollout_routed_experts": "routed_experts", "rollout_indexer_topk": "indexer_topk"}
# Per-sample payload, never averaged into metrics.
PAYLOAD_KEYS = frozenset(MASK_KEYS) | frozenset(REPLAY_KEYS)

TRAIN_DTYPES = {
    "tokens": np.dtype(np.int32),
    "response_lengths": np.dtype(np.int64),
    "loss_masks": np.dtype(np.int32),
    "rollout_log_probs": np.dtype(np.float32),
    "sample_indices": np.dtype(np.int64),
    "rollout_sampling_mask_ids": np.dtype(np.int32),
    "rollout_sampling_mask_offsets": np.dtype(np.int64),
    "rollout_routed_experts": np.dtype(np.int32),
    "rollout_indexer_topk": np.dtype(np.int32),
}


def to_train_data(trajectories: Sequence[Trajectory]) -> dict[str, Any]:
    """miles' rollout data dict for a batch of merged trajectories.

    Per-sample keys are lists of arrays with miles' dtypes; `tokens` is the
    prompt followed by the response. The whole-batch rule applies to the mask
    and to each replay field: all samples carry it, or none does.
    A sample without a `sample_index` gets its batch position.
    """
    indices = [t.sample_index if t.sample_index is not None else i for i, t in enumerate(trajectories)]
    statuses = [t.status for t in trajectories]
    check_whole_batch_rule([t.has_mask for t in trajectories], indices, statuses)
    data: dict[str, Any] = {
        "tokens": [np.concatenate([t.prompt_tokens, t.tokens]).astype(np.int32) for t in trajectories],
        "response_lengths": np.array([t.response_length for t in trajectories], dtype=np.int64),
        "loss_masks": [t.loss_mask.astype(np.int32) for t in trajectories],
        "rollout_log_probs": [t.log_probs.astype(np.float32) for t in trajectories],
        "rewards": [t.reward for t in trajectories],
        "sample_indices": np.array(indices, dtype=np.int64),
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
    for key, name in REPLAY_KEYS.items():
        present = [getattr(t, name) is not None for t in trajectories]
        check_whole_batch_rule(present, indices, statuses, field=name)
        if trajectories and all(present):
            data[key] = [getattr(t, name) for t in trajectories]
    return data


def metric_view(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` without the mask and replay keys: what metrics may reduce."""
    return {key: value for key, value in data.items() if key not in PAYLOAD_KEYS}
