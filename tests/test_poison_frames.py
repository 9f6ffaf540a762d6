"""A `turn` frame whose mask offsets wrap around int64 killed the broker:
every support size read positive, the offsets started at 0 and ended at
`len(mask_ids)`, and the support check indexed 6.9e18 into nine ids. Found
by a coverage-guided fuzzer; held here at each layer it crossed: the
validation rules, `codec.decode`, a live broker and the consumer's
batch check. Offsets out of [0, len(ids)] break the rule of strictly increasing
offsets, whatever their differences wrap to."""
import base64

import msgpack
import numpy as np
import pytest
import zmq
from broker_process import BrokerProcess
from consumer_helpers import delivery, writable

from rollstream.common import codec
from rollstream.common.errors import RemoteProtocolError
from rollstream.common.messages import BROKER_TO_PRODUCER, PRODUCER_TO_BROKER
from rollstream.common.trajectory import Trajectory, Turn
from rollstream.common.validation import (
    RULE_NONEMPTY_SUPPORT,
    csr_problem,
    messages_content_valid,
    packed_flags,
    packed_violations,
)
from rollstream.common.wire import encode_turn
from rollstream.consumer import checked_batch

# The fuzzer's frames: a turn of 4 tokens and 8 ids with offsets
# [0, 6875716116560216066, -6524743456053107089, 6, 8] (every difference
# positive once wrapped around int64).
POISON = [base64.b64decode(frame) for frame in (
    "h6F2AaR0eXBlpHR1cm6tdHJhamVjdG9yeV9pZKF0pHR1cm4CpnN0YXR1c6ljb21wbGV0ZWSjc2VxAqZhcnJheXOVk6Z0b2tlbnOlaW50MzKRBJOpbG9n"
    "X3Byb2Jzp2Zsb2F0MzKRBJOobWFza19pZHOlaW50MzKRCJOsbWFza19vZmZzZXRzpWludDY0kQWTrWZvcmNlZF90b2tlbnOlaW50MzKRAg==",
    "r3QzMpEEk6lsb2dfcHJzZg==",
    "p2I4b2xvdL8AAAAqAAAAvw==",
    "rwAAALAAAAAtAwAALgMAiQIAA4oCAAAAkAMAAJEDAAA=",
    "AAAAAAAAAAACAAAAYXNrX29mZnNldHOlBgAAAAAAAAAIAAAAAAAAAA==",
    "BwCQAwAAAAA=",
)]
WRAPPED = np.array([0, 6875716116560216066, -6524743456053107089, 6, 8], np.int64)
# Three tokens, three ids, each token its own support's id, but offsets
# [0, 2**62 + 1, -2**62 - 1, 3]: sizes wrap to positive, the ends are right.
TOKENS = np.array([5, 6, 7], np.int32)
IDS = np.array([5, 6, 7], np.int32)
SMALL_WRAP = np.array([0, 2**62 + 1, -(2**62) - 1, 3], np.int64)


def test_the_fuzzers_offsets_wrap_to_positive_sizes():
    """What makes the case: a subtraction-based rule sees nothing wrong."""
    with np.errstate(over="ignore"):
        assert (np.diff(WRAPPED) > 0).all() and (np.diff(SMALL_WRAP) > 0).all()


@pytest.mark.parametrize("offsets", [SMALL_WRAP, np.array([0, 5, 1, 3], np.int64), np.array([0, -1, 2, 3], np.int64)],
                         ids=["wrapping", "past the end", "negative"])
def test_offsets_outside_the_ids_break_the_increasing_offsets_rule(offsets):
    arrays = {"tokens": TOKENS, "mask_ids": IDS, "mask_offsets": offsets}
    assert not messages_content_valid([arrays], 1000)
    assert not messages_content_valid([arrays, {"tokens": TOKENS, "mask_ids": IDS,
                                                "mask_offsets": np.arange(4, dtype=np.int64)}], 1000)
    assert RULE_NONEMPTY_SUPPORT in csr_problem(IDS, offsets)
    [violation] = packed_violations(TOKENS, [3], IDS, offsets, vocab_size=1000)
    assert violation.rule == RULE_NONEMPTY_SUPPORT


def test_the_same_offsets_fail_the_torch_verdict():
    torch = pytest.importorskip("torch")
    flags = packed_flags(torch.from_numpy(TOKENS), torch.tensor([3]), torch.from_numpy(IDS), torch.from_numpy(SMALL_WRAP),
                         vocab_size=1000)
    assert bool(flags.any())
    [violation] = packed_violations(torch.from_numpy(TOKENS), torch.tensor([3]), torch.from_numpy(IDS),
                                    torch.from_numpy(SMALL_WRAP), vocab_size=1000)
    assert violation.rule == RULE_NONEMPTY_SUPPORT


def test_valid_offsets_still_pass():
    arrays = {"tokens": TOKENS, "mask_ids": IDS, "mask_offsets": np.arange(4, dtype=np.int64)}
    assert messages_content_valid([arrays], 1000)
    assert csr_problem(IDS, arrays["mask_offsets"]) is None


def test_codec_refuses_the_fuzzers_frames_as_a_broken_mask():
    with pytest.raises(RemoteProtocolError) as refused:
        codec.decode(POISON, PRODUCER_TO_BROKER, vocab_size=1000)
    assert refused.value.code == "mask_invalid" and refused.value.seq == 2
    assert RULE_NONEMPTY_SUPPORT in refused.value.message and "6875716116560216066" in refused.value.message


def test_the_consumer_refuses_a_delivery_with_those_offsets_by_rule():
    """The consumer decodes deliveries unchecked and validates whole batches:
    a delivery with these offsets is named as a broken mask there."""
    trajectory = Trajectory("t", prompt_tokens=[1, 2], sample_index=0)
    trajectory.reward = 1.0
    trajectory.append_turn(Turn.build(TOKENS.tolist(), [-0.1] * 3, supports=[[5], [6], [7]]))
    poisoned = writable(delivery(trajectory), mask_offsets=SMALL_WRAP)
    _, found, _ = checked_batch([poisoned], vocab_size=1000)
    assert [(v.rule, v.sample) for v in found] == [(RULE_NONEMPTY_SUPPORT, 0)]


@pytest.mark.slow
def test_a_live_broker_nacks_the_fuzzers_frames_then_acks_a_well_formed_trajectory(tmp_path):
    with BrokerProcess(tmp_path, vocab_size=1000, log_level="error") as broker:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(broker.producer)
        try:
            sock.send_multipart(POISON)
            assert sock.poll(60_000), f"no reply to the fuzzer's frames; alive: {broker.proc.poll() is None}"
            nack = msgpack.unpackb(sock.recv_multipart()[0])
            assert (nack["type"], nack["code"], nack["seq"]) == ("nack", "mask_invalid", 2), nack
            sock.send_multipart(encode_turn("after", 0, Turn.build([5], [-0.1], supports=[[5]]), seq=3,
                                            prompt_tokens=np.array([1, 2], np.int32)))
            sock.send_multipart(codec.encode(PRODUCER_TO_BROKER, "end", {"seq": 4, "trajectory_id": "after", "reward": 1.0}))
            for seq in (3, 4):
                assert sock.poll(60_000), "no ack for the well-formed trajectory"
                ack = codec.decode(sock.recv_multipart(), BROKER_TO_PRODUCER)
                assert (ack.type, ack["seq"], ack["applied"]) == ("ack", seq, True)
            assert broker.proc.poll() is None
            assert broker.status()["queued"] == 1
        finally:
            sock.close()
