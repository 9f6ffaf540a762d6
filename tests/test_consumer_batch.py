"""Batch packing, miles train data, metrics, reshaping, partitioning and the
shard wire format, checked against the reference merge model and miles
conversion in rollstream.common and against brute force."""
import itertools
import re

import numpy as np
import pytest
import torch
from consumer_helpers import assert_same_batch, delivery, make_rollout, replaying_trajectories
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.common.errors import RemoteProtocolError
from rollstream.common.miles import MASK_KEYS, to_train_data
from rollstream.common.trajectory import Trajectory, Turn
from rollstream.consumer import Batch, partition
from rollstream.consumer.distributed import decode_shard, encode_shard
from rollstream.consumer.sharding import karmarkar_karp


def rollouts(seed, n, **kw):
    rng = np.random.default_rng(seed)
    groups = [f"g{k}" for k in range(max(1, n // 2))]
    out = []
    for i in range(n):
        group = (groups[int(rng.integers(len(groups)))], n) if i % 3 else None
        out.append(make_rollout(rng, f"t{i}", sample_index=100 + i, group=group, **kw))
    return out


def batch_of(trajectories, **kw):
    return Batch.from_deliveries([delivery(t) for t in trajectories], **kw)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6), mask=st.booleans(), full=st.booleans(),
       support=st.booleans())
def test_packed_batch_matches_the_merged_trajectories(seed, n, mask, full, support):
    support = support and mask  # the support log-probs lie beside a mask's ids
    trajectories = [r.merged() for r in rollouts(seed, n, mask=mask, full=full, mask_log_probs=support)]
    batch = batch_of(trajectories)
    assert (batch.full_log_probs is not None) == full
    assert (batch.mask_log_probs is not None) == support
    assert batch.cu_seqlens.dtype == torch.int32 and batch.mask_offsets is None or batch.mask_offsets.dtype == torch.int64
    for i, t in enumerate(trajectories):
        view = batch.sample(i)
        assert view["tokens"].tolist() == [*t.prompt_tokens.tolist(), *t.tokens.tolist()]
        assert view["response_tokens"].tolist() == t.tokens.tolist()
        assert view["loss_mask"].tolist() == t.loss_mask.tolist()
        assert view["log_probs"].tolist() == t.log_probs.tolist()
        if full:  # packed on the response axis, each sample's values byte for byte
            assert view["full_log_probs"].numpy().tobytes() == t.full_log_probs.tobytes()
        if mask:
            assert view["mask_ids"].tolist() == t.mask.ids.tolist()
            assert view["mask_offsets"].tolist() == t.mask.offsets.tolist()
        if support:  # packed beside the ids, each sample's values byte for byte (0.0 at forced tokens' singletons)
            assert view["mask_log_probs"].numpy().tobytes() == t.mask_log_probs.tobytes()
        assert int(batch.sample_indices[i]) == t.sample_index and float(batch.rewards[i]) == pytest.approx(t.reward)
    assert torch.equal(batch.tokens[batch.response_index()], batch.response_tokens)
    if mask:  # the whole batch is one CSR over every response token
        assert batch.mask_ids.dtype == torch.int32 and len(batch.mask_offsets) == int(batch.response_lengths.sum()) + 1
        assert batch.mask_offsets[-1] == len(batch.mask_ids)
    if support:
        assert batch.mask_log_probs.dtype == torch.float32 and batch.mask_log_probs.shape == batch.mask_ids.shape
        assert batch.mask_log_probs.device == batch.device


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), mask=st.booleans(), full=st.booleans(),
       support=st.booleans())
def test_train_data_equals_the_miles_conversion(seed, n, mask, full, support):
    support = support and mask
    trajectories = [r.merged() for r in rollouts(seed, n, mask=mask, full=full, mask_log_probs=support)]
    ours = batch_of(trajectories).to_train_data()
    reference = to_train_data(trajectories)
    assert ours.keys() == reference.keys() and ("rollout_full_log_probs" in ours) == full
    assert ("rollout_sampling_mask_log_probs" in ours) == support
    if support:  # each sample's as its mask ids are laid out: one float32 per id, byte for byte
        for got, ids, t in zip(ours["rollout_sampling_mask_log_probs"], ours["rollout_sampling_mask_ids"], trajectories):
            assert got.dtype == torch.float32 and got.shape == ids.shape
            assert got.cpu().numpy().tobytes() == t.mask_log_probs.tobytes()
    for key, expected in reference.items():
        got = ours[key]
        if isinstance(expected, list) and expected and isinstance(expected[0], np.ndarray):
            assert len(got) == len(expected), key
            for g, e in zip(got, expected):
                assert g.cpu().numpy().dtype == e.dtype and np.array_equal(g.cpu().numpy(), e), key
        elif isinstance(expected, np.ndarray):
            assert got.cpu().numpy().dtype == expected.dtype and np.array_equal(got.cpu().numpy(), expected), key
        else:
            assert got == pytest.approx(expected), key


def test_train_data_weight_versions_place_each_turn_in_absolute_positions_as_miles_does():
    versioned = Trajectory("v", [1, 2], sample_index=0)
    versioned.append_turn(Turn.build([10, 11], [-0.5, -0.5], forced_tokens=[7], weight_version="5"))
    versioned.append_turn(Turn.build([12], [-0.5], weight_version="6"))
    unversioned = Trajectory("u", [3], sample_index=1)
    unversioned.append_turn(Turn.build([20], [-0.5]))
    for t in (versioned, unversioned):
        t.reward = 0.0
    expected = [[[{"version": "5", "abs_start": 2, "abs_end": 4}], [{"version": "6", "abs_start": 5, "abs_end": 6}]], []]
    assert to_train_data([versioned, unversioned])["weight_versions"] == expected
    batch = batch_of([versioned, unversioned])  # through the deliver message
    assert batch.weight_version_spans == (((("5", 0, 2),), (("6", 3, 4),)), ())
    assert batch.to_train_data()["weight_versions"] == expected
    assert "weight_versions" not in to_train_data([unversioned])
    assert not any(key.startswith("weight_versions") for key in batch.metrics())


def test_metrics_never_reduce_the_mask():
    trajectories = [r.merged() for r in rollouts(7, 4, mask_log_probs=True)]
    batch = batch_of(trajectories)
    metrics = batch.metrics()
    assert not any(key.startswith(prefix) for key in metrics for prefix in (*MASK_KEYS, "rollout_sampling_mask"))
    rewards = [t.reward for t in trajectories]
    assert metrics["rewards/mean"] == pytest.approx(np.mean(rewards), rel=1e-6)
    assert metrics["samples"] == 4
    shifted = Batch._assemble(batch.seq, batch.device, {**batch.ragged(), "mask_ids": batch.mask_ids + 500},
                              {n: getattr(batch, n) for n in ("prompt_lengths", "response_lengths", "rewards", "sample_indices")},
                              batch.mask_offsets, batch.lengths, batch.host_fields())
    assert shifted.metrics() == metrics


def test_replay_arrays_travel_with_their_samples():
    trajectories = replaying_trajectories(np.random.default_rng(11))
    batch = batch_of(trajectories)
    data = batch.to_train_data()
    for got, t in zip(data["rollout_routed_experts"], trajectories):
        assert np.array_equal(got.cpu().numpy(), t.routed_experts)
    picked = batch.select([2, 0])
    assert np.array_equal(picked.sample(0)["routed_experts"].cpu().numpy(), trajectories[2].routed_experts)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 7), pieces=st.integers(1, 3), mask=st.booleans(),
       full=st.booleans(), support=st.booleans())
def test_select_and_concat_reassemble_the_batch(seed, n, pieces, mask, full, support):
    batch = batch_of([r.merged() for r in rollouts(seed, n, mask=mask, full=full, mask_log_probs=support and mask)])
    order = np.random.default_rng(seed).permutation(n)
    cuts = np.array_split(order, pieces)
    joined = Batch.concat([batch.select(cut) for cut in cuts])
    restored = joined.select(np.argsort(np.array(joined.positions)))
    assert_same_batch(restored, batch)


@pytest.mark.parametrize("full, support", [(False, False), (True, False), (False, True)])
def test_shard_wire_format_round_trips(full, support):
    batch = batch_of([r.merged() for r in rollouts(5, 5, full=full, mask_log_probs=support)])
    header, payload = encode_shard(batch.select([4, 1, 2]))
    assert payload.dtype == torch.uint8
    shard = decode_shard(header, payload.clone())
    assert_same_batch(shard, batch.select([4, 1, 2]))
    assert (shard.full_log_probs is not None) == full
    assert (shard.mask_log_probs is not None) == support
    if support:  # beside each sample's own mask ids, as it left
        for k, i in enumerate([4, 1, 2]):
            assert torch.equal(shard.sample(k)["mask_log_probs"], batch.sample(i)["mask_log_probs"])
            assert len(shard.sample(k)["mask_log_probs"]) == len(shard.sample(k)["mask_ids"])


def test_a_shard_whose_support_log_probs_miss_its_mask_ids_is_refused_naming_the_rule():
    import msgpack

    from rollstream.common.validation import RULE_SUPPORT_ALIGNED

    header, payload = encode_shard(batch_of([r.merged() for r in rollouts(5, 3, mask_log_probs=True)]))
    doc = msgpack.unpackb(header, raw=False)
    entry = next(e for e in doc["tensors"] if e[0] == "ragged.mask_log_probs")
    entry[2] = [entry[2][0] - 1]  # one entry short of the ids
    with pytest.raises(RemoteProtocolError, match=re.escape(f"rule '{RULE_SUPPORT_ALIGNED}' violated: shard tensor "
                                                            f"'mask_log_probs' has shape [{entry[2][0]}], mask_ids has shape")):
        decode_shard(msgpack.packb(doc, use_bin_type=True), payload)


def test_micro_batches_carry_their_samples_support_log_probs():
    batch = batch_of([r.merged() for r in rollouts(9, 6, mask_log_probs=True)])
    micro = batch.micro_batches(12, pad_to=8)
    assert len(micro) == 8 and all(m.mask_log_probs is not None for m in micro)
    for m in micro:
        assert m.mask_log_probs.shape == m.mask_ids.shape and m.mask_log_probs.dtype == torch.float32
        for k, position in enumerate(m.positions):
            assert torch.equal(m.sample(k)["mask_log_probs"], batch.sample(position)["mask_log_probs"])
    joined = Batch.concat(micro)
    assert_same_batch(joined.select(np.argsort(np.array(joined.positions))), batch)


# -- partitions ---------------------------------------------------------------
def _equal_count_partitions(n, ranks):
    """Every assignment of n items to ranks with counts differing by at most one."""
    for assignment in itertools.product(range(ranks), repeat=n):
        counts = np.bincount(assignment, minlength=ranks)
        if counts.max() - counts.min() <= 1:
            yield assignment


def _spread(weights, parts):
    sums = [sum(weights[i] for i in part) for part in parts]
    return max(sums), min(sums)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_balanced_partition_is_close_to_the_brute_force_optimum(ranks):
    rng = np.random.default_rng(ranks)
    ratios = []
    for _ in range(40):
        n = int(rng.integers(ranks, 9 if ranks == 2 else 8))
        weights = rng.integers(50, 4000, size=n).tolist()
        parts = partition(weights, ranks, "balanced")
        assert sorted(i for p in parts for i in p) == list(range(n))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        high, low = _spread(weights, parts)
        assert high - low <= max(weights)  # largest differencing never spreads wider than the heaviest item
        best = min(
            (max(sums) / min(sums))
            for assignment in _equal_count_partitions(n, ranks)
            for sums in [np.bincount(assignment, weights=weights, minlength=ranks)]
            if min(sums) > 0
        )
        ratios.append((high / low) / best)
    assert np.mean(ratios) < 1.05 and max(ratios) < 1.5, ratios


def test_partition_strategies():
    weights = [10, 1, 1, 1, 9, 2, 2, 2]
    assert partition(weights, 2, "round_robin") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    parts = partition(weights, 2, "group", groups)
    for part in parts:
        assert {groups[i] for i in part}.isdisjoint({groups[i] for p in parts if p is not part for i in p})
    assert sorted(map(len, parts)) == [4, 4]
    assert _spread(weights, parts) == (15, 13)  # groups weigh 11, 2, 11, 4: {11, 4} against {11, 2}
    assert sorted(map(len, partition([5], 4, "balanced"))) == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="strategy"):
        partition(weights, 2, "random")


def test_karmarkar_karp_beats_round_robin_on_sorted_lengths():
    weights = list(range(1, 65))
    parts = karmarkar_karp(weights, 4)
    high, low = _spread(weights, parts)
    rr_high, rr_low = _spread(weights, partition(weights, 4, "round_robin"))
    assert high - low < rr_high - rr_low and high - low <= 1


def test_devices_compare_by_index():
    """A bare `cuda` is the current CUDA device (0 without CUDA), so a
    consumer's batch and a decoded shard on one GPU are on the same device."""
    from rollstream.consumer.batch import same_device

    assert same_device(torch.device("cuda"), torch.device("cuda", 0))
    assert same_device("cpu", torch.device("cpu", 0))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not same_device("cpu", "cuda")


def test_concat_of_a_batch_and_a_shard_named_differently_on_one_device():
    """`Batch.concat` compares devices by index: `cuda` and `cuda:0` (how a
    consumer and a decoded shard name one GPU) are one device; so are `cpu`
    and `cpu:0`, which this checks without a GPU."""
    from dataclasses import replace

    batch = batch_of([r.merged() for r in rollouts(11, 4)], device="cpu")
    header, payload = encode_shard(batch.select([2, 3]))
    shard = replace(decode_shard(header, payload), device=torch.device("cpu", 0))
    joined = Batch.concat([batch.select([0, 1]), shard])
    assert_same_batch(joined, batch)
    elsewhere = replace(shard, device=torch.device("cuda", 1))
    with pytest.raises(ValueError, match="devices"):
        Batch.concat([batch, elsewhere])


def test_a_shard_takes_one_upload_and_digests_one_copy_per_field(monkeypatch):
    from rollstream.consumer import batch as batch_module

    batch = batch_of([r.merged() for r in rollouts(12, 5)])
    expected = batch.content_digests()
    uploads = []
    real_upload = batch_module._upload
    monkeypatch.setattr(batch_module, "_upload", lambda host, device: uploads.append(host) or real_upload(host, device))
    shard = batch.select([4, 1, 3])
    assert len(uploads) == 1
    assert shard.content_digests() == [expected[i] for i in (4, 1, 3)]
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(self) or real_cpu(self, *a, **k))
    batch.content_digests()
    assert len(copies) == len(batch.ragged()) + 1  # each packed field and the samples' own mask offsets
