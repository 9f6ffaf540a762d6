"""`Batch.token_versions`: per response token, the ordered version of the
weights that sampled it, so a trainer can correct for off-policy tokens.
Expected values are written out by hand from the turns below."""
from dataclasses import replace

import pytest
import torch
from consumer_helpers import delivery

from rollstream.common.errors import RemoteProtocolError
from rollstream.common.trajectory import Trajectory, Turn
from rollstream.consumer import Batch, Delivery
from rollstream.consumer.distributed import decode_shard, encode_shard


def _ended(trajectory: Trajectory) -> Trajectory:
    trajectory.reward = 0.0
    return trajectory


def _spanned() -> Trajectory:
    """Response [10, 11, 7, 12, 13, 14]: turn 0 sampled two tokens with step-5
    and gave no spans (the broker spans its sampled tokens), then a forced 7;
    turn 1's weights changed within it: v6 for two tokens, v7 for the last."""
    t = Trajectory("spanned", [1, 2])
    t.append_turn(Turn.build([10, 11], [-0.5, -0.5], forced_tokens=[7], weight_version="step-5"))
    t.append_turn(Turn.build([12, 13, 14], [-0.5] * 3, weight_version_spans=[("v6", 0, 2), ("v7", 2, 3)]))
    return _ended(t)


def _unordered() -> Trajectory:
    """Response [20, 21, 8, 9, 22]: an unordered version ("opaque") over two
    sampled tokens, two forced ones, then one sampled with version 3."""
    t = Trajectory("unordered", [3])
    t.append_turn(Turn.build([20, 21], [-0.5, -0.5], forced_tokens=[8, 9], weight_version="opaque"))
    t.append_turn(Turn.build([22], [-0.5], weight_version="3"))
    return _ended(t)


def _without_spans() -> Delivery:
    """Response [30, 31] sampled with version 9, delivered as an older broker
    does: `weight_versions` without `weight_version_spans`, so no position is known."""
    t = Trajectory("old-broker", [4])
    t.append_turn(Turn.build([30, 31], [-0.5, -0.5], weight_version="9"))
    d = delivery(_ended(t))
    fields = {name: value for name, value in d.fields.items() if name != "weight_version_spans"}
    return Delivery(d.trajectory_id, fields, d.arrays, d.broker, d.leases)


SPANNED = [5, 5, -1, 6, 6, 7]
UNORDERED = [-1, -1, -1, -1, 3]
WITHOUT_SPANS = [-1, -1]


@pytest.fixture
def batch() -> Batch:
    return Batch.from_deliveries([delivery(_spanned()), delivery(_unordered()), _without_spans()], device="cpu")


def _versions(batch: Batch) -> list[int]:
    versions = batch.token_versions
    assert versions.dtype == torch.int64 and versions.device == batch.device, \
        f"token_versions must be int64 on the batch's device {batch.device}, got {versions.dtype} on {versions.device}"
    assert len(versions) == len(batch.response_tokens), \
        f"token_versions has one entry per response token: expected {len(batch.response_tokens)}, got {len(versions)}"
    return versions.tolist()


def test_each_response_token_gets_the_ordered_version_that_sampled_it(batch):
    """Spans place versions within a turn; forced tokens, unordered versions
    and a sample without spans are -1."""
    assert _versions(batch) == SPANNED + UNORDERED + WITHOUT_SPANS


def test_selected_and_concatenated_batches_keep_each_tokens_version(batch):
    """The versions follow their samples through select and concat, which
    build new batches from the fields they carry."""
    assert _versions(batch.select([2, 0])) == WITHOUT_SPANS + SPANNED
    assert _versions(Batch.concat([batch.select([1]), batch.select([0])])) == UNORDERED + SPANNED


def test_a_shard_sent_to_another_rank_keeps_each_tokens_version(batch):
    """A shard crosses torch.distributed as its fields; the versions come back from them."""
    header, payload = encode_shard(batch.select([1, 0]))
    assert _versions(decode_shard(header, payload.clone())) == UNORDERED + SPANNED


def test_a_span_past_its_samples_response_is_refused_naming_the_rule(batch):
    """A span that ends past the sample's response would mark tokens of the
    next sample: refused, not written there."""
    broken = replace(batch, weight_version_spans=(((("step-5", 0, 7),),), *batch.weight_version_spans[1:]))
    with pytest.raises(RemoteProtocolError, match=r"weight_version_spans lie within the response.*'spanned'.*"
                                                  r"expected ends <= 6, got span \['step-5', 0, 7\]"):
        broken.token_versions
