"""miles interop: the session samples payload (docs/semantics.md §7) and train
data (§6), checked against an independent reading of the format."""
import json

import numpy as np
import pytest
import safetensors.numpy

from rollstream.common import SamplingMask, Trajectory, Turn
from rollstream.common.miles import (
    DEFAULT_FIELDS,
    FIELDS_WITH_MASK,
    MASK_KEYS,
    decode_session_samples,
    encode_session_samples,
    metric_view,
    to_train_data,
)


def sample(mask=True, **overrides):
    base = {
        "tokens": [1, 2, 10, 20],
        "response": "hi",
        "response_length": 2,
        "loss_mask": [1, 0],
        "rollout_log_probs": [-0.5, 0.0],
        "rollout_sampling_mask": SamplingMask.from_supports([[10, 3], [20]]) if mask else None,
        "rollout_routed_experts": None,
        "rollout_indexer_topk": np.zeros((3, 2), np.int32),
        "status": "completed",
        "weight_versions": [{"engine": "e0", "version": 3}],
        "spec_info": {},
        "prefix_cache_info": {"cached_tokens": 0},
        "metadata": {"turn": 1},
    }
    base.update(overrides)
    return base


def reference_payload(samples, session_metadata, empty_reason=None):
    """What an encoder that never knew about masks writes, built by hand.
    A field the samples lack is left out, as an encoder from before that
    field existed leaves it out."""
    tensors, metas = {}, []
    for i, s in enumerate(samples):
        meta, nulls = {}, []
        for name in ["tokens", "response", "response_length", "loss_mask", "rollout_log_probs",
                     "rollout_routed_experts", "rollout_indexer_topk", "status", "weight_versions",
                     "spec_info", "prefix_cache_info", "metadata"]:
            dtypes = {"tokens": np.int64, "loss_mask": np.uint8, "rollout_log_probs": np.float64,
                      "rollout_routed_experts": np.int32, "rollout_indexer_topk": np.int32}
            if name not in s:
                continue
            if name not in dtypes:
                meta[name] = s[name]
            elif s[name] is None:
                nulls.append(name)
            else:
                tensors[f"{name}.{i}"] = np.asarray(s[name], dtype=dtypes[name])
        meta["nulls"] = nulls
        metas.append(meta)
    doc = json.dumps({"samples": metas, "session_metadata": session_metadata, "empty_reason": empty_reason},
                     ensure_ascii=False, separators=(",", ":")).encode()
    tensors["_samples_meta"] = np.frombuffer(doc, np.uint8)
    return safetensors.numpy.save(tensors)


def test_default_payload_is_byte_identical_to_a_maskless_encoder():
    samples = [sample(), sample(mask=False, response="é")]
    assert encode_session_samples(samples, {"sid": "s"}) == reference_payload(samples, {"sid": "s"})


def test_mask_crosses_only_on_request():
    payload = encode_session_samples([sample()], {}, fields=FIELDS_WITH_MASK)
    tensors = safetensors.numpy.load(payload)
    assert tensors["rollout_sampling_mask.ids.0"].dtype == np.int32
    assert tensors["rollout_sampling_mask.offsets.0"].tolist() == [0, 2, 3]
    decoded = decode_session_samples(payload, fields=FIELDS_WITH_MASK)
    assert decoded.samples[0]["rollout_sampling_mask"] == SamplingMask.from_supports([[10, 3], [20]])
    assert "rollout_sampling_mask" not in decode_session_samples(
        encode_session_samples([sample()], {}), fields=DEFAULT_FIELDS).samples[0]


def test_round_trip_with_nulls():
    payload = encode_session_samples([sample(mask=False)], {"k": [1]}, "none", fields=FIELDS_WITH_MASK)
    decoded = decode_session_samples(payload, fields=FIELDS_WITH_MASK)
    s = decoded.samples[0]
    assert s["rollout_sampling_mask"] is None and s["rollout_routed_experts"] is None
    assert s["tokens"].dtype == np.int64 and s["tokens"].tolist() == [1, 2, 10, 20]
    assert s["rollout_log_probs"].dtype == np.float64 and s["weight_versions"] == [{"engine": "e0", "version": 3}]
    assert decoded.session_metadata == {"k": [1]} and decoded.empty_reason == "none"


def test_encode_refuses_lossy_conversion_and_strict_fields():
    with pytest.raises(ValueError, match="loss_mask"):
        encode_session_samples([sample(loss_mask=[-1, 0])])
    with pytest.raises(ValueError, match="int32"):
        encode_session_samples([sample(rollout_indexer_topk=np.zeros((3, 2), np.int64))])


def _resave(payload, change):
    tensors = dict(safetensors.numpy.load(payload))
    change(tensors)
    return safetensors.numpy.save(tensors)


def test_decode_wrong_dtype_is_an_error():
    payload = encode_session_samples([sample()], fields=FIELDS_WITH_MASK)
    name = "rollout_sampling_mask.ids.0"
    bad = _resave(payload, lambda t: t.__setitem__(name, t[name].astype(np.int64)))
    with pytest.raises(ValueError, match="int32"):
        decode_session_samples(bad, fields=FIELDS_WITH_MASK)
    bad = _resave(payload, lambda t: t.__setitem__("tokens.0", t["tokens.0"].astype(np.int32)))
    with pytest.raises(ValueError, match="int64"):
        decode_session_samples(bad, fields=FIELDS_WITH_MASK)


def test_decode_missing_promised_tensor_is_an_error():
    payload = encode_session_samples([sample()], fields=FIELDS_WITH_MASK)
    with pytest.raises(ValueError, match="missing"):
        decode_session_samples(_resave(payload, lambda t: t.pop("loss_mask.0")), fields=FIELDS_WITH_MASK)


def test_decode_unreferenced_tensor_is_an_error():
    payload = encode_session_samples([sample()], fields=FIELDS_WITH_MASK)
    with pytest.raises(ValueError, match="no sample refers to"):
        decode_session_samples(payload, fields=DEFAULT_FIELDS)  # named fields are read exactly: not the mask


def test_a_payload_written_without_optional_json_fields_decodes_them_to_their_defaults():
    """An encoder from before miles had `spec_info` and `prefix_cache_info`
    (or one that leaves optional fields out): miles fills them with their
    defaults when it reads the samples, and so does the decoder."""
    older = [{k: v for k, v in sample().items() if k not in ("spec_info", "prefix_cache_info")}]
    for fields in (None, DEFAULT_FIELDS):
        s = decode_session_samples(reference_payload(older, {}), fields=fields).samples[0]
        assert s["spec_info"] == {} and s["prefix_cache_info"] == {}
        assert s["status"] == "completed" and s["metadata"] == {"turn": 1} and s["tokens"].tolist() == [1, 2, 10, 20]
    bare = [{k: v for k, v in sample().items() if k not in ("response", "weight_versions", "metadata")}]
    s = decode_session_samples(reference_payload(bare, {})).samples[0]
    assert (s["response"], s["weight_versions"], s["metadata"]) == ("", [], {})


def test_a_sample_without_a_field_that_has_no_default_is_refused():
    without_status = [{k: v for k, v in sample().items() if k != "status"}]
    with pytest.raises(ValueError, match=r"sample 0 meta lacks field 'status', which has no default "
                                         r"\(required: \['response_length', 'status'\]"):
        decode_session_samples(reference_payload(without_status, {}))


def test_decode_reads_the_mask_when_the_payload_carries_it():
    with_mask = decode_session_samples(encode_session_samples([sample()], fields=FIELDS_WITH_MASK)).samples[0]
    assert with_mask["rollout_sampling_mask"] == SamplingMask.from_supports([[10, 3], [20]])
    all_null = decode_session_samples(encode_session_samples([sample(mask=False)], fields=FIELDS_WITH_MASK)).samples[0]
    assert "rollout_sampling_mask" in all_null and all_null["rollout_sampling_mask"] is None
    assert "rollout_sampling_mask" not in decode_session_samples(encode_session_samples([sample()])).samples[0]


def test_decode_rejects_bad_meta_and_containers():
    with pytest.raises(ValueError, match="safetensors"):
        decode_session_samples(b"not a payload")
    payload = _resave(encode_session_samples([sample()]), lambda t: t.__setitem__("_samples_meta", np.zeros((2, 2), np.uint8)))
    with pytest.raises(ValueError, match="rank-1 uint8"):
        decode_session_samples(payload)
    doc = json.dumps({"samples": [{"nulls": ["status"]}]}).encode()
    payload = safetensors.numpy.save({"_samples_meta": np.frombuffer(doc, np.uint8)})
    with pytest.raises(ValueError, match="non-tensor"):
        decode_session_samples(payload)


def test_decode_invalid_mask_is_an_error():
    payload = encode_session_samples([sample()], fields=FIELDS_WITH_MASK)
    bad = _resave(payload, lambda t: t.__setitem__("rollout_sampling_mask.offsets.0", np.array([0, 3, 3], np.int64)))
    with pytest.raises(ValueError, match="non-empty support"):
        decode_session_samples(bad, fields=FIELDS_WITH_MASK)


def _traj(i, mask=True, status="completed"):
    traj = Trajectory(f"t{i}", [1, 2], sample_index=8 + i)
    traj.append_turn(Turn.build([10], [-0.5], supports=[[10, 4]] if mask else None, forced_tokens=[7], status=status))
    traj.reward = float(i)
    return traj


def test_train_data_keys_and_dtypes():
    data = to_train_data([_traj(0), _traj(1)])
    assert [t.tolist() for t in data["tokens"]] == [[1, 2, 10, 7]] * 2
    assert data["tokens"][0].dtype == np.int32
    assert data["response_lengths"].tolist() == [2, 2] and data["response_lengths"].dtype == np.int64
    assert data["loss_masks"][0].tolist() == [1, 0] and data["loss_masks"][0].dtype == np.int32
    assert data["rollout_log_probs"][0].dtype == np.float32
    assert data["rewards"] == [0.0, 1.0] and data["sample_indices"].tolist() == [8, 9]
    assert data["rollout_sampling_mask_ids"][0].dtype == np.int32
    assert data["rollout_sampling_mask_offsets"][0].tolist() == [0, 2, 3]


def test_example_9_whole_batch_rule_names_the_sample():
    with pytest.raises(ValueError, match=r"position 1 \(sample_index=9, status=aborted\)"):
        to_train_data([_traj(0), _traj(1, mask=False, status="aborted")])


def test_batch_without_masks_has_no_mask_keys():
    data = to_train_data([_traj(0, mask=False)])
    assert not set(MASK_KEYS) & set(data)


def test_metric_view_drops_mask_keys():
    data = to_train_data([_traj(0)])
    view = metric_view(data)
    assert not set(MASK_KEYS) & set(view) and "rewards" in view
