"""miles interop: the session samples payload (docs/semantics.md §7) and train
data (§6), checked against an independent reading of the format."""
import json
import re

import numpy as np
import pytest
import safetensors.numpy

from rollstream.common import SamplingMask, Trajectory, Turn
from rollstream.common.miles import (
    DEFAULT_FIELDS,
    FIELDS_WITH_MASK,
    MASK_KEYS,
    PAYLOAD_KEYS,
    decode_session_samples,
    encode_session_samples,
    metric_view,
    to_train_data,
)
from rollstream.common.validation import RULE_SUPPORT_ALIGNED


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
        "weight_versions": [[{"version": "3", "abs_start": 2, "abs_end": 4}]],
        "spec_info": {"spec_num_correct_drafts": 1, "spec_num_proposed_drafts": 2, "spec_verify_ct": 1,
                      "completion_tokens": 2},
        "prefix_cache_info": {"cached_tokens": 1, "total_prompt_tokens": 2},
        "metadata": {"turn": 1},
    }
    base.update(overrides)
    return base


# miles' session codec at sii-avalanche/miles@4d412b5, written out by hand from its field table: the
# fields in order (None: a JSON field), the defaults a fresh miles Sample holds, and the top-k pair
# it leaves out (no null marker) when a sample has none. The mask, when it crosses, goes after these.
MILES_LAYOUT = [("tokens", np.int64), ("response", None), ("response_length", None), ("loss_mask", np.uint8),
                ("rollout_log_probs", np.float64), ("rollout_topk_token_ids", np.int32),
                ("rollout_topk_log_probs", np.float32), ("rollout_routed_experts", np.int32),
                ("rollout_indexer_topk", np.int32), ("status", None), ("weight_versions", None), ("spec_info", None),
                ("prefix_cache_info", None), ("metadata", None)]
MILES_DEFAULTS = {"response": "", "weight_versions": [], "metadata": {},
                  "spec_info": {"spec_num_correct_drafts": 0, "spec_num_proposed_drafts": 0, "spec_verify_ct": 0,
                                "completion_tokens": 0},
                  "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0}}
LEFT_OUT_WHEN_NONE = {"rollout_topk_token_ids", "rollout_topk_log_probs"}


def miles_payload(samples, session_metadata, empty_reason=None, *, mask=False, left_out=(), extra_json=()):
    """What miles' encoder writes for these samples (a field a sample dict
    lacks is what a fresh miles Sample holds). `left_out`: fields an encoder
    from before them did not write; `extra_json`: JSON fields a newer one
    appends after its own."""
    layout = [(n, d) for n, d in MILES_LAYOUT if n not in left_out] + [(n, None) for n in extra_json]
    tensors, metas = {}, []
    for i, s in enumerate(samples):
        meta, nulls = {}, []
        for name, dtype in layout:
            value = s.get(name)
            if dtype is None:
                meta[name] = MILES_DEFAULTS.get(name) if value is None else value
            elif value is None:
                if name not in LEFT_OUT_WHEN_NONE:
                    nulls.append(name)
            else:
                tensors[f"{name}.{i}"] = np.asarray(value, dtype=dtype)
        if mask:
            if s.get("rollout_sampling_mask") is None:
                nulls.append("rollout_sampling_mask")
            else:
                tensors[f"rollout_sampling_mask.ids.{i}"] = s["rollout_sampling_mask"].ids
                tensors[f"rollout_sampling_mask.offsets.{i}"] = s["rollout_sampling_mask"].offsets
                if s.get("mask_log_probs") is not None:  # miles' mask with its support logprobs: float32 beside the ids
                    tensors[f"rollout_sampling_mask.logprobs.{i}"] = np.asarray(s["mask_log_probs"], np.float32)
        meta["nulls"] = nulls
        metas.append(meta)
    doc = json.dumps({"samples": metas, "session_metadata": session_metadata, "empty_reason": empty_reason},
                     ensure_ascii=False, separators=(",", ":")).encode()
    tensors["_samples_meta"] = np.frombuffer(doc, np.uint8)
    return safetensors.numpy.save(tensors)


def with_topk(s):
    return {**s, "rollout_topk_token_ids": np.array([[10, 3], [20, -1]], np.int32),
            "rollout_topk_log_probs": np.array([[-0.1, -2.0], [0.0, -np.inf]], np.float32)}


def test_default_payload_is_byte_identical_to_what_miles_writes():
    samples = [sample(), sample(mask=False, response="é"), with_topk(sample())]
    assert encode_session_samples(samples, {"sid": "s"}) == miles_payload(samples, {"sid": "s"})


def test_a_maskless_sample_among_masked_ones_is_byte_identical_with_the_mask_after_every_other_field():
    samples = [sample(), sample(mask=False), sample(rollout_routed_experts=np.ones((3, 2, 1), np.int32))]
    assert encode_session_samples(samples, {}, fields=FIELDS_WITH_MASK) == miles_payload(samples, {}, mask=True)


def test_a_sample_without_optional_fields_is_written_with_miles_defaults_never_null():
    """miles' decoder iterates `weight_versions` and reads `spec_info` as a
    dict: nulls there fail it (TypeError), its defaults do not."""
    bare = {k: v for k, v in sample().items()
            if k not in ("response", "weight_versions", "spec_info", "prefix_cache_info", "metadata")}
    payload = encode_session_samples([bare, {**sample(), "weight_versions": None}], {})
    assert payload == miles_payload([bare, {**sample(), "weight_versions": None}], {})
    meta = json.loads(bytes(safetensors.numpy.load(payload)["_samples_meta"]))["samples"][0]
    assert (meta["response"], meta["weight_versions"], meta["metadata"]) == ("", [], {})
    assert meta["spec_info"]["spec_verify_ct"] == 0 and meta["prefix_cache_info"]["total_prompt_tokens"] == 0
    with pytest.raises(ValueError, match=r"sample 0 lacks 'status': required"):
        encode_session_samples([{k: v for k, v in sample().items() if k != "status"}])


def test_newer_fields_are_carried_listed_and_written_back_byte_identical():
    """A newer miles: the top-k pair (known here), a JSON field and a tensor
    field appended after its own, and the mask."""
    samples = [with_topk(sample()), sample(mask=False)]
    payload = miles_payload(samples, {"sid": 1}, mask=True, extra_json=("lineage_note",))
    tensors = dict(safetensors.numpy.load(payload))
    tensors["draft_hidden.1"] = np.arange(6, dtype=np.float16).reshape(2, 3)
    payload = safetensors.numpy.save(tensors)
    decoded = decode_session_samples(payload)
    assert list(decoded.unknown) == ["lineage_note", "draft_hidden"]
    assert decoded.samples[1]["draft_hidden"].dtype == np.float16 and "draft_hidden" not in decoded.samples[0]
    assert decoded.samples[0]["lineage_note"] is None
    assert decoded.samples[0]["rollout_topk_token_ids"].tolist() == [[10, 3], [20, -1]]
    assert decoded.samples[1]["rollout_topk_token_ids"] is None
    assert decoded.encode() == payload


def test_a_known_field_in_a_dtype_the_contract_does_not_allow_is_still_refused():
    payload = miles_payload([with_topk(sample())], {})
    bad = _resave(payload, lambda t: t.__setitem__("rollout_topk_token_ids.0", t["rollout_topk_token_ids.0"].astype(np.int64)))
    with pytest.raises(ValueError, match="rollout_topk_token_ids must have dtype int32, got int64"):
        decode_session_samples(bad)


def test_errors_use_miles_words_and_a_missing_tensor_is_a_key_error():
    with pytest.raises(ValueError, match="rollout_routed_experts must have dtype int32"):
        encode_session_samples([sample(rollout_routed_experts=np.zeros((3, 2), np.int64))])
    payload = encode_session_samples([sample()])
    with pytest.raises(KeyError) as missing:
        decode_session_samples(_resave(payload, lambda t: t.pop("loss_mask.0")))
    assert isinstance(missing.value, ValueError) and "tensor 'loss_mask.0' is missing" in str(missing.value)


def test_mask_crosses_only_on_request():
    payload = encode_session_samples([sample()], {}, fields=FIELDS_WITH_MASK)
    tensors = safetensors.numpy.load(payload)
    assert tensors["rollout_sampling_mask.ids.0"].dtype == np.int32
    assert tensors["rollout_sampling_mask.offsets.0"].tolist() == [0, 2, 3]
    decoded = decode_session_samples(payload, fields=FIELDS_WITH_MASK)
    assert decoded.samples[0]["rollout_sampling_mask"] == SamplingMask.from_supports([[10, 3], [20]])
    assert "rollout_sampling_mask" not in decode_session_samples(
        encode_session_samples([sample()], {}), fields=DEFAULT_FIELDS).samples[0]


# One float32 per id of sample()'s mask ([[10, 3], [20]]), as miles' mask carries them (`logprobs`).
SUPPORT_LOG_PROBS = np.array([-0.25, -1.5, 0.0], np.float32)


def test_the_masks_support_log_probs_decode_and_write_back_byte_identical_to_what_miles_writes():
    """A mask with its support log-probs, one without them, and no mask: the
    payload is miles' byte for byte, each sample's `mask_log_probs` come back
    float32 as they went, and the decoded payload encodes to the same bytes."""
    samples = [sample(mask_log_probs=SUPPORT_LOG_PROBS), sample(), sample(mask=False)]
    payload = encode_session_samples(samples, {"sid": "s"}, fields=FIELDS_WITH_MASK)
    assert payload == miles_payload(samples, {"sid": "s"}, mask=True)
    assert safetensors.numpy.load(payload)["rollout_sampling_mask.logprobs.0"].dtype == np.float32
    decoded = decode_session_samples(payload)
    first, second, third = decoded.samples
    assert first["rollout_sampling_mask"] == SamplingMask.from_supports([[10, 3], [20]])
    assert first["mask_log_probs"].dtype == np.float32
    assert first["mask_log_probs"].tobytes() == SUPPORT_LOG_PROBS.tobytes()
    assert "mask_log_probs" not in second and "mask_log_probs" not in third
    assert decoded.encode() == payload
    assert decode_session_samples(payload, fields=FIELDS_WITH_MASK).encode() == payload
    # a float64 list that fits float32 unchanged is written as miles writes it
    assert encode_session_samples([sample(mask_log_probs=SUPPORT_LOG_PROBS.tolist())], {}, fields=FIELDS_WITH_MASK) == \
        miles_payload([sample(mask_log_probs=SUPPORT_LOG_PROBS)], {}, mask=True)


def test_support_log_probs_misaligned_with_their_mask_are_refused_naming_the_rule():
    payload = encode_session_samples([sample(), sample(mask_log_probs=SUPPORT_LOG_PROBS)], {}, fields=FIELDS_WITH_MASK)
    key = "rollout_sampling_mask.logprobs.1"
    short = _resave(payload, lambda t: t.__setitem__(key, t[key][:-1].copy()))
    expected = (rf"mask_log_probs of sample 1: rule '{re.escape(RULE_SUPPORT_ALIGNED)}' violated: expected 3 entries "
                r"\(one per mask id\), got shape \[2\]")
    with pytest.raises(ValueError, match=expected):
        decode_session_samples(short)
    with pytest.raises(ValueError, match=expected):
        encode_session_samples([sample(), sample(mask_log_probs=SUPPORT_LOG_PROBS[:-1])], {}, fields=FIELDS_WITH_MASK)
    wide = _resave(payload, lambda t: t.__setitem__(key, np.tile(t[key], (2, 1))))
    with pytest.raises(ValueError, match=r"got shape \[2, 3\]"):
        decode_session_samples(wide)
    double = _resave(payload, lambda t: t.__setitem__(key, t[key].astype(np.float64)))
    with pytest.raises(ValueError, match=r"rollout_sampling_mask logprobs must have dtype float32, got float64 \(tensor "
                                         r"'rollout_sampling_mask.logprobs.1'; never converted\)"):
        decode_session_samples(double)


def test_support_log_probs_without_their_mask_are_refused():
    """On the wire they are part of the mask: beside a null mask, or with
    the mask not read, they are tensors no sample refers to."""
    masked = encode_session_samples([sample(mask_log_probs=SUPPORT_LOG_PROBS)], {}, fields=FIELDS_WITH_MASK)
    with pytest.raises(ValueError, match=r"payload carries unreferenced tensors: .*'rollout_sampling_mask.logprobs.0'"):
        decode_session_samples(masked, fields=DEFAULT_FIELDS)
    nulled = encode_session_samples([sample(mask=False)], {}, fields=FIELDS_WITH_MASK)
    stray = _resave(nulled, lambda t: t.__setitem__("rollout_sampling_mask.logprobs.0", SUPPORT_LOG_PROBS))
    with pytest.raises(ValueError, match=r"unreferenced tensors: \['rollout_sampling_mask.logprobs.0'\]"):
        decode_session_samples(stray)
    with pytest.raises(ValueError, match=r"sample 0 holds mask_log_probs but no rollout_sampling_mask"):
        encode_session_samples([sample(mask=False, mask_log_probs=SUPPORT_LOG_PROBS)], {}, fields=FIELDS_WITH_MASK)


def test_round_trip_with_nulls():
    payload = encode_session_samples([sample(mask=False)], {"k": [1]}, "none", fields=FIELDS_WITH_MASK)
    decoded = decode_session_samples(payload, fields=FIELDS_WITH_MASK)
    s = decoded.samples[0]
    assert s["rollout_sampling_mask"] is None and s["rollout_routed_experts"] is None
    assert s["tokens"].dtype == np.int64 and s["tokens"].tolist() == [1, 2, 10, 20]
    assert s["rollout_log_probs"].dtype == np.float64
    assert s["weight_versions"] == [[{"version": "3", "abs_start": 2, "abs_end": 4}]]
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
    with pytest.raises(ValueError, match="rollout_sampling_mask must use int32 ids and int64 offsets, got int64 and int64"):
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
    with pytest.raises(ValueError, match="payload carries unreferenced tensors"):
        decode_session_samples(payload, fields=DEFAULT_FIELDS)  # named fields are read exactly: not the mask


def test_a_payload_written_without_optional_json_fields_decodes_them_to_their_defaults():
    """An encoder from before miles had `spec_info` and `prefix_cache_info`
    left them out. miles' own decoder raises KeyError on such a payload;
    this one fills what a fresh miles Sample holds (docs/data-model.md)."""
    older = miles_payload([sample()], {}, left_out=("spec_info", "prefix_cache_info", "rollout_topk_token_ids",
                                                     "rollout_topk_log_probs"))
    for fields in (None, DEFAULT_FIELDS):
        s = decode_session_samples(older, fields=fields).samples[0]
        assert s["spec_info"] == MILES_DEFAULTS["spec_info"] and s["prefix_cache_info"] == MILES_DEFAULTS["prefix_cache_info"]
        assert s["status"] == "completed" and s["metadata"] == {"turn": 1} and s["tokens"].tolist() == [1, 2, 10, 20]
    bare = miles_payload([sample()], {}, left_out=("response", "weight_versions", "metadata"))
    s = decode_session_samples(bare).samples[0]
    assert (s["response"], s["weight_versions"], s["metadata"]) == ("", [], {})


def test_a_sample_without_a_field_that_has_no_default_is_refused():
    without_status = [{k: v for k, v in sample().items() if k != "status"}]
    with pytest.raises(ValueError, match=r"sample 0 meta lacks field 'status', which has no default "
                                         r"\(required: \['response_length', 'status'\]"):
        decode_session_samples(miles_payload(without_status, {}, left_out=("status",)))


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
    with pytest.raises(ValueError, match=r"null markers reference non-tensor fields: \[.status.\]"):
        decode_session_samples(payload)


def test_decode_invalid_mask_is_an_error():
    payload = encode_session_samples([sample()], fields=FIELDS_WITH_MASK)
    bad = _resave(payload, lambda t: t.__setitem__("rollout_sampling_mask.offsets.0", np.array([0, 3, 3], np.int64)))
    with pytest.raises(ValueError, match="non-empty support"):
        decode_session_samples(bad, fields=FIELDS_WITH_MASK)


def _traj(i, mask=True, status="completed", sample_index=None, routed=False, metadata=None, support=False):
    traj = Trajectory(f"t{i}", [1, 2], sample_index=8 + i if sample_index is None else sample_index, metadata=metadata)
    traj.append_turn(Turn.build([10], [-0.5], supports=[[10, 4]] if mask else None, forced_tokens=[7], status=status,
                                routed_experts=np.full((3, 1, 1), i, np.int32) if routed else None,
                                mask_log_probs=[-0.5, -0.25 * i - 1] if support else None))
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


def test_train_data_has_miles_rollout_keys():
    """Two samples of one rollout (sample index 8) and one of another:
    every sample of a rollout carries the loss-mask total over all of them."""
    data = to_train_data([_traj(0), _traj(1, sample_index=8, status="truncated"), _traj(2, sample_index=5)])
    assert data["raw_reward"] == [0.0, 1.0, 2.0]
    assert data["truncated"].tolist() == [0, 1, 0] and data["truncated"].dtype == np.int64
    assert data["rollout_ids"].tolist() == [8, 8, 5] and data["rollout_ids"].dtype == np.int64
    assert data["rollout_mask_sums"].tolist() == [2, 2, 1] and data["rollout_mask_sums"].dtype == np.int64
    graded = to_train_data([_traj(0, metadata={"raw_reward": 0.25}), _traj(1, metadata={"raw_reward": 0.5})])
    assert graded["raw_reward"] == [0.25, 0.5] and graded["rewards"] == [0.0, 1.0]


def test_a_replay_field_follows_miles_rule_or_the_whole_batch_rule_when_strict():
    data = to_train_data([_traj(0, routed=True), _traj(1)])
    assert data["rollout_routed_experts"][0].shape == (3, 1, 1) and data["rollout_routed_experts"][1] is None
    assert "rollout_routed_experts" not in to_train_data([_traj(0), _traj(1, routed=True)])  # miles: the first decides
    with pytest.raises(ValueError, match=r"routed_experts.*position 1 \(sample_index=9"):
        to_train_data([_traj(0, routed=True), _traj(1)], strict_replay=True)


def test_train_data_carries_each_samples_support_log_probs_beside_its_mask_ids():
    """float32, one per id of the sample's `rollout_sampling_mask_ids` (the
    forced token's singleton 0.0), as miles hands them to the trainer; payload,
    never averaged; a replay field, so miles' rule (or, strict, the
    whole-batch rule) decides a batch where some samples lack them."""
    data = to_train_data([_traj(0, support=True), _traj(1, support=True)])
    assert [ids.tolist() for ids in data["rollout_sampling_mask_ids"]] == [[10, 4, 7]] * 2
    assert [v.tolist() for v in data["rollout_sampling_mask_log_probs"]] == [[-0.5, -1.0, 0.0], [-0.5, -1.25, 0.0]]
    assert all(v.dtype == np.float32 for v in data["rollout_sampling_mask_log_probs"])
    assert "rollout_sampling_mask_log_probs" in PAYLOAD_KEYS and "rollout_sampling_mask_log_probs" not in metric_view(data)
    assert "rollout_sampling_mask_log_probs" not in to_train_data([_traj(0), _traj(1)])
    mixed = to_train_data([_traj(0, support=True), _traj(1)])
    assert mixed["rollout_sampling_mask_log_probs"][1] is None
    with pytest.raises(ValueError, match=r"mask_log_probs.*position 1 \(sample_index=9"):
        to_train_data([_traj(0, support=True), _traj(1)], strict_replay=True)


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
