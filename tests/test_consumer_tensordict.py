"""`Batch.to_tensordict` and `Batch.from_tensordict`: the TensorDict verl and
TransferQueue users index (jagged per-token fields, each sample's own CSR
supports, host values per sample), its tensors shared with the batch, an
exact round trip, and the error without the tensordict extra. Expected
values are written out from the turns built here."""
import dataclasses
import importlib.util
import sys

import numpy as np
import pytest
import torch
from consumer_helpers import assert_same_batch, delivery
from import_checks import assert_not_loaded

from rollstream.common.errors import ExtraMissing, InvalidInput, RollstreamError
from rollstream.common.trajectory import Gap, Trajectory, Turn
from rollstream.consumer import Batch

needs_tensordict = pytest.mark.skipif(importlib.util.find_spec("tensordict") is None,
                                      reason="needs the tensordict extra: pip install 'rollstream[tensordict]'")

# The supports of each sample's response tokens (a forced token's is itself alone); d's second turn came without
# one, so the merge cut d there (a replay gap).
SUPPORTS = [[[10, 4, 5], [11], [7], [12, 13]], [[20], [21, 30, 31, 32], [22, 40]], [[30, 1]], [[50], [51, 52]]]
EXPECTED = {
    "tokens": [[1, 2, 3, 10, 11, 7, 12], [4, 20, 21, 22], [5, 6, 30], [8, 9, 50, 51]],
    "response_tokens": [[10, 11, 7, 12], [20, 21, 22], [30], [50, 51]],
    "loss_mask": [[1, 1, 0, 1], [1, 1, 1], [1], [1, 1]],
    "log_probs": [[-0.5, -1.0, 0.0, -0.25], [-0.125, -0.75, -0.375], [-0.0625], [-0.5, -0.5]],
    "mask_ids": [[10, 4, 5, 11, 7, 12, 13], [20, 21, 30, 31, 32, 22, 40], [30, 1], [50, 51, 52]],
    "mask_offsets": [[0, 3, 4, 5, 7], [0, 1, 5, 7], [0, 2], [0, 1, 3]],
}
PER_SAMPLE = {"prompt_lengths": [3, 1, 2, 2], "response_lengths": [4, 3, 1, 2], "rewards": [1.0, -0.5, 0.0, 2.0],
              "sample_indices": [5, 6, 7, 8], "group_index": [0, 0, 1, 2]}
HOST = {
    "trajectory_ids": ("a", "b", "c", "d"),
    "statuses": ("completed", "truncated", "completed", "completed"),
    "gaps": (None, None, None, Gap(1, "mask")),
    "group_ids": ("g0", "g0", None, "g1"),
    "raw_rewards": (1.0, -0.5, {"score": 0.0, "tries": 3}, 2.0),
    "metadata": ({"source": "math"}, {}, {}, {}),
    "weight_versions": (("5", "6"), (), (), ()),
    "weight_version_spans": (((("5", 0, 2),), (("6", 3, 4),)), (), (), ()),
    "leases": (("lease-a",), ("lease-b",), ("lease-c",), ("lease-d",)),
    "positions": (0, 1, 2, 3),
}
# The whole batch's CSR: every response token's support end to end.
GLOBAL_MASK_OFFSETS = [0, 3, 4, 5, 7, 8, 12, 14, 16, 17, 19]


def masked_batch(seq: int = 9) -> Batch:
    a = Trajectory("a", [1, 2, 3], group_id="g0", group_size=2, sample_index=5, metadata={"source": "math"})
    a.append_turn(Turn.build([10, 11], [-0.5, -1.0], supports=SUPPORTS[0][:2], forced_tokens=[7], weight_version="5"))
    a.append_turn(Turn.build([12], [-0.25], supports=SUPPORTS[0][3:], weight_version="6"))
    b = Trajectory("b", [4], group_id="g0", group_size=2, sample_index=6)
    b.append_turn(Turn.build([20, 21, 22], [-0.125, -0.75, -0.375], supports=SUPPORTS[1], status="truncated"))
    c = Trajectory("c", [5, 6], sample_index=7)
    c.append_turn(Turn.build([30], [-0.0625], supports=SUPPORTS[2]))
    d = Trajectory("d", [8, 9], group_id="g1", group_size=1, sample_index=8)
    d.append_turn(Turn.build([50, 51], [-0.5, -0.5], supports=SUPPORTS[3], forced_tokens=[60]))
    d.append_turn(Turn.build([53], [-0.5]))
    for trajectory, reward in zip((a, b, c, d), HOST["raw_rewards"]):
        trajectory.reward = reward
    return Batch.from_deliveries([delivery(t) for t in (a, b, c, d)], seq=seq, reward_key="score")


def assert_expected(batch: Batch, samples=(0, 1, 2, 3)):
    """`batch` holds `samples` of the expected values, in that order, as one packed batch."""
    flat = {name: [value for i in samples for value in EXPECTED[name][i]] for name in EXPECTED}
    assert batch.tokens.tolist() == flat["tokens"] and batch.response_tokens.tolist() == flat["response_tokens"]
    assert batch.loss_mask.tolist() == flat["loss_mask"] and batch.log_probs.tolist() == flat["log_probs"]
    assert batch.mask_ids.tolist() == flat["mask_ids"]
    sizes = [len(support) for i in samples for support in SUPPORTS[i]]
    assert batch.mask_offsets.tolist() == np.concatenate([[0], np.cumsum(sizes)]).tolist()
    assert batch.cu_seqlens.tolist() == np.cumsum([0] + [len(EXPECTED["tokens"][i]) for i in samples]).tolist()
    assert batch.response_cu.tolist() == np.cumsum([0] + [len(EXPECTED["response_tokens"][i]) for i in samples]).tolist()
    for name in ("prompt_lengths", "response_lengths", "rewards", "sample_indices"):
        assert getattr(batch, name).tolist() == [PER_SAMPLE[name][i] for i in samples], name
    for name, values in HOST.items():
        assert getattr(batch, name) == tuple(values[i] for i in samples), name
    assert {key: values.tolist() for key, values in batch.lengths.items()} == {
        "prompt": [PER_SAMPLE["prompt_lengths"][i] for i in samples],
        "response": [PER_SAMPLE["response_lengths"][i] for i in samples],
        "sequence": [len(EXPECTED["tokens"][i]) for i in samples],
        "mask_ids": [len(EXPECTED["mask_ids"][i]) for i in samples],
    }


@needs_tensordict
def test_the_tensordict_holds_each_sample_unpadded_as_verl_indexes_it():
    td = masked_batch().to_tensordict()
    assert td.batch_size == torch.Size([4]) and td.device == torch.device("cpu")
    for name, samples in EXPECTED.items():
        assert td.get(name).is_nested and td.get(name).layout == torch.jagged, name
        assert [td[name][i].tolist() for i in range(4)] == samples, name
        assert [row[name].tolist() for row in td] == samples, name
    for i, supports in enumerate(SUPPORTS):  # response token k of sample i drew from ids[off[k]:off[k + 1]]
        ids, off = td["mask_ids"][i], td["mask_offsets"][i].tolist()
        assert [ids[off[k] : off[k + 1]].tolist() for k in range(len(supports))] == supports
    for name, values in PER_SAMPLE.items():
        assert not td.get(name).is_nested and td[name].tolist() == values, name
    for name, values in HOST.items():
        assert tuple(td.get(name).tolist()) == values and td[3][name] == values[3], name
    assert (td["seq"], td["token_budget"]) == (9, None)
    # Fields on one axis share its offsets, so per-token arithmetic works without padding.
    assert [row.tolist() for row in td["log_probs"] * td["loss_mask"]] == [[-0.5, -1.0, 0.0, -0.25], [-0.125, -0.75, -0.375],
                                                                          [-0.0625], [-0.5, -0.5]]
    assert td["response_tokens"].to_padded_tensor(-1).tolist() == [[10, 11, 7, 12], [20, 21, 22, -1], [30, -1, -1, -1],
                                                                   [50, 51, -1, -1]]


@needs_tensordict
def test_the_round_trip_rebuilds_every_field():
    batch = dataclasses.replace(masked_batch(), token_budget=32)
    back = Batch.from_tensordict(batch.to_tensordict())
    assert back.mask_offsets.tolist() == GLOBAL_MASK_OFFSETS
    assert_expected(back)
    assert back.group_index.tolist() == PER_SAMPLE["group_index"]
    assert (back.seq, back.token_budget, back.has_mask) == (9, 32, True)
    assert_same_batch(back, batch)


@needs_tensordict
def test_the_round_trip_of_a_batch_without_masks():
    a = Trajectory("a", [1, 2], sample_index=0)
    a.append_turn(Turn.build([10, 11], [-0.5, -0.25], forced_tokens=[7]))
    a.append_turn(Turn.build([12], [-0.125]))
    b = Trajectory("b", [3], sample_index=1)
    b.append_turn(Turn.build([20], [-1.0]))
    a.reward, b.reward = 1.0, 0.0
    td = Batch.from_deliveries([delivery(a), delivery(b)]).to_tensordict()
    assert "mask_ids" not in td.keys() and "mask_offsets" not in td.keys()
    back = Batch.from_tensordict(td)
    assert not back.has_mask and back.mask_ids is None
    assert back.tokens.tolist() == [1, 2, 10, 11, 7, 12, 3, 20] and back.cu_seqlens.tolist() == [0, 6, 8]
    assert back.response_tokens.tolist() == [10, 11, 7, 12, 20] and back.response_cu.tolist() == [0, 4, 5]
    assert back.loss_mask.tolist() == [1, 1, 0, 1, 1] and back.log_probs.tolist() == [-0.5, -0.25, 0.0, -0.125, -1.0]
    assert back.trajectory_ids == ("a", "b") and back.rewards.tolist() == [1.0, 0.0]


@needs_tensordict
def test_full_log_probs_are_jagged_on_the_response_axis_and_come_back():
    a = Trajectory("a", [1, 2], sample_index=0)
    a.append_turn(Turn.build([10, 11], [-0.5, -0.25], forced_tokens=[7], full_log_probs=[-0.75, -2.5]))
    a.append_turn(Turn.build([12], [-0.125], full_log_probs=[-0.375]))
    b = Trajectory("b", [3], sample_index=1)
    b.append_turn(Turn.build([20], [-1.0], full_log_probs=[-1.5]))
    a.reward, b.reward = 1.0, 0.0
    batch = Batch.from_deliveries([delivery(a), delivery(b)])
    td = batch.to_tensordict()
    assert [td["full_log_probs"][i].tolist() for i in range(2)] == [[-0.75, -2.5, 0.0, -0.375], [-1.5]]
    assert [row.tolist() for row in td["full_log_probs"] - td["log_probs"]] == [[-0.25, -2.25, 0.0, -0.25], [-0.5]]
    back = Batch.from_tensordict(td[1:])
    assert back.full_log_probs.tolist() == [-1.5] and back.trajectory_ids == ("b",)
    assert "full_log_probs" not in masked_batch().to_tensordict().keys()


@needs_tensordict
def test_mask_log_probs_are_jagged_beside_the_mask_ids_and_come_back():
    """One entry per support id, sharing `mask_ids`' offsets (a forced
    token's singleton 0.0); indexed, sliced or concatenated they stay beside
    their ids; written out from the turns built here."""
    a = Trajectory("a", [1, 2], sample_index=0)
    a.append_turn(Turn.build([10, 11], [-0.5, -0.25], supports=[[10, 4], [11]], forced_tokens=[7],
                             mask_log_probs=[-0.5, -1.0, 0.0]))
    a.append_turn(Turn.build([12], [-0.125], supports=[[12, 13, 14]], mask_log_probs=[-0.125, -2.5, -3.0]))
    b = Trajectory("b", [3], sample_index=1)
    b.append_turn(Turn.build([20], [-1.0], supports=[[20, 21]], mask_log_probs=[-1.0, -0.75]))
    a.reward, b.reward = 1.0, 0.0
    batch = Batch.from_deliveries([delivery(a), delivery(b)])
    td = batch.to_tensordict()
    assert td.get("mask_log_probs").layout == torch.jagged
    assert td.get("mask_log_probs").offsets().data_ptr() == td.get("mask_ids").offsets().data_ptr()
    assert td.get("mask_log_probs").values().data_ptr() == batch.mask_log_probs.data_ptr()
    assert [td["mask_ids"][i].tolist() for i in range(2)] == [[10, 4, 11, 7, 12, 13, 14], [20, 21]]
    assert [td["mask_log_probs"][i].tolist() for i in range(2)] == [[-0.5, -1.0, 0.0, 0.0, -0.125, -2.5, -3.0],
                                                                     [-1.0, -0.75]]
    back = Batch.from_tensordict(td[[1, 0]])
    assert back.mask_log_probs.tolist() == [-1.0, -0.75, -0.5, -1.0, 0.0, 0.0, -0.125, -2.5, -3.0]
    assert_same_batch(back, batch.select([1, 0]))
    assert_same_batch(Batch.from_tensordict(torch.cat([td[1:], td[:1]])), batch.select([1, 0]))
    assert "mask_log_probs" not in masked_batch().to_tensordict().keys()
    without_ids = td.exclude("mask_ids", "mask_offsets")
    with pytest.raises(InvalidInput, match="holds 'mask_log_probs' beside 'mask_ids' and 'mask_offsets', which it lacks"):
        Batch.from_tensordict(without_ids)
    short = td.clone()
    short["mask_log_probs"] = torch.nested.nested_tensor_from_jagged(td.get("mask_log_probs").values()[:-1],
                                                                     torch.tensor([0, 7, 8]))
    with pytest.raises(InvalidInput, match=r"'mask_log_probs' on the mask_ids axis.*expected per sample \[7, 2\], "
                                           r"got \[7, 1\]"):
        Batch.from_tensordict(short)


@needs_tensordict
def test_an_indexed_sliced_or_concatenated_tensordict_is_a_batch_of_those_samples():
    batch = masked_batch()
    td = batch.to_tensordict()
    picked = Batch.from_tensordict(td[[3, 0]])
    assert_expected(picked, samples=(3, 0))
    assert picked.mask_offsets.tolist() == [0, 1, 3, 6, 7, 8, 10] and picked.group_index.tolist() == [0, 1]
    assert_expected(Batch.from_tensordict(td[1:3]), samples=(1, 2))
    assert_expected(Batch.from_tensordict(td[torch.tensor([False, True, False, True])]), samples=(1, 3))
    joined = Batch.from_tensordict(torch.cat([td[2:], td[:1]]))
    assert_expected(joined, samples=(2, 3, 0))
    assert_same_batch(joined, batch.select([2, 3, 0]))
    other = masked_batch(seq=10).to_tensordict()
    assert Batch.from_tensordict(torch.cat([td[:1], other[1:2]])).seq == 9  # the first one's, as Batch.concat keeps


@needs_tensordict
def test_a_jagged_field_with_holes_is_read_by_its_lengths():
    td = masked_batch().to_tensordict()
    # Each sample's loss mask followed by a 9 it does not own, as a narrowed view leaves them.
    holes = torch.tensor([1, 1, 0, 1, 9, 1, 1, 1, 9, 1, 9, 1, 1, 9], dtype=torch.uint8)
    td["loss_mask"] = torch.nested.nested_tensor_from_jagged(holes, torch.tensor([0, 5, 9, 11, 14]),
                                                             lengths=torch.tensor([4, 3, 1, 2]))
    assert Batch.from_tensordict(td).loss_mask.tolist() == [value for mask in EXPECTED["loss_mask"] for value in mask]


@needs_tensordict
def test_the_tensordict_shares_the_batchs_tensors():
    batch = masked_batch()
    td = batch.to_tensordict()
    back = Batch.from_tensordict(td)
    for name, packed in batch.ragged().items():
        values = td.get(name).values()
        assert values.data_ptr() == packed.data_ptr(), name
        assert values.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr(), name
        assert back.ragged()[name].data_ptr() == packed.data_ptr(), name
    for name in PER_SAMPLE:
        assert td.get(name).data_ptr() == getattr(batch, name).data_ptr(), name
    assert td.get("log_probs").offsets().data_ptr() == batch.response_cu.data_ptr()
    td["log_probs"].values()[3] = 4.0  # a write through the TensorDict is a write to the batch
    assert batch.log_probs[3] == 4.0 and back.log_probs[3] == 4.0


@needs_tensordict
def test_replay_captures_are_jagged_along_their_first_dimension():
    captures = [np.arange(4 * 3 * 2).reshape(4, 3, 2), 100 + np.arange(5 * 3 * 2).reshape(5, 3, 2)]
    trajectories = []
    for i, (prompt, tokens) in enumerate([([1, 2], [3, 4]), ([1], [5, 6, 7, 8])]):
        trajectory = Trajectory(f"r{i}", prompt)
        trajectory.append_turn(Turn.build(tokens, [-0.5] * len(tokens), supports=[[t] for t in tokens],
                                          routed_experts=captures[i]))
        trajectory.reward = 0.0
        trajectories.append(trajectory)
    batch = Batch.from_deliveries([delivery(t) for t in trajectories])
    td = batch.to_tensordict()
    assert td.get("routed_experts").layout == torch.jagged and td.get("routed_experts").shape[2:] == (3, 2)
    for i, capture in enumerate(captures):
        assert np.array_equal(td["routed_experts"][i].numpy(), capture)
    assert td.get("routed_experts").values().data_ptr() == batch.replay["routed_experts"].data_ptr()
    back = Batch.from_tensordict(td[[1, 0]])
    assert np.array_equal(back.replay["routed_experts"].numpy(), np.concatenate([captures[1], captures[0]]))
    assert back.lengths["routed_experts"].tolist() == [5, 4]


@needs_tensordict
def test_a_tensordict_out_of_layout_is_refused_naming_the_rule():
    td = masked_batch().to_tensordict()
    with pytest.raises(InvalidInput, match=r"expected batch_size \[S\], got \[\]"):
        Batch.from_tensordict(td[0])
    with pytest.raises(InvalidInput, match=r"missing \['rewards'\]"):
        Batch.from_tensordict(td.exclude("rewards"))
    shifted = td.clone()
    shifted["loss_mask"] = torch.nested.nested_tensor_from_jagged(td.get("loss_mask").values(), torch.tensor([0, 3, 7, 8, 10]))
    with pytest.raises(InvalidInput, match=r"'loss_mask' on the response axis.*expected per sample \[4, 3, 1, 2\], "
                                           r"got \[3, 4, 1, 2\]"):
        Batch.from_tensordict(shifted)
    short = td.clone()
    local = td.get("mask_offsets").values().clone()
    local[4] = 6  # sample a's last offset: one id short of its 7
    short["mask_offsets"] = torch.nested.nested_tensor_from_jagged(local, td.get("mask_offsets").offsets())
    with pytest.raises(InvalidInput, match=r"span its mask_ids' broken: expected per sample \[7, 7, 2, 3\], got \[6, 7, 2, 3\]"):
        Batch.from_tensordict(short)


def test_without_tensordict_the_error_names_the_extra(monkeypatch):
    batch = masked_batch()
    monkeypatch.setitem(sys.modules, "tensordict", None)  # what an environment without it imports
    with pytest.raises(ExtraMissing) as caught:
        batch.to_tensordict()
    error = caught.value
    assert isinstance(error, ImportError) and isinstance(error, RollstreamError) and error.name == "tensordict"
    assert str(error) == ("Batch.to_tensordict needs the 'tensordict' package, which is not installed: "
                          "pip install 'rollstream[tensordict]'")
    assert error.code == "missing_extra" and not error.retriable


def test_the_consumer_loads_no_tensordict_at_import():
    assert_not_loaded(["rollstream.consumer"], "tensordict", reached="rollstream.consumer.tensordict_view")
