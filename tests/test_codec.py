"""Wire codec: docs/protocol.md §2, every reply code in its check order, and
every message type of §3-§5."""
import zlib

import msgpack
import numpy as np
import pytest

from rollstream.common import ProtocolError, Trajectory, Turn
from rollstream.common.buffers import Pieces
from rollstream.common.codec import (
    CRC_KEPT_FROM_BYTES,
    check_values,
    content_digest,
    decode,
    decode_trusted,
    encode,
    encode_batch,
    encode_error,
    number_header,
    split_batch,
)
from rollstream.common.messages import (
    ADMIN_REPLIES,
    ADMIN_REQUESTS,
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    CONSUMER_TO_BROKER,
    PRODUCER_TO_BROKER,
)
from rollstream.common.wire import encode_deliver, encode_turn, trajectory_from_deliver, turn_from_message


def raw_turn(header_extra=None, arrays=None, drop=()):
    """A turn built with raw msgpack + numpy bytes, as a third-party peer would."""
    arrays = arrays or {
        "prompt_tokens": np.array([1, 2], "<i4"),
        "tokens": np.array([10, 11], "<i4"),
        "log_probs": np.array([-0.1, -0.2], "<f4"),
        "mask_ids": np.array([10, 4, 11], "<i4"),
        "mask_offsets": np.array([0, 2, 3], "<i8"),
    }
    header = {
        "v": 1,
        "type": "turn",
        "seq": 7,
        "trajectory_id": "t-1",
        "turn": 0,
        "status": "completed",
        "arrays": [[name, arr.dtype.name, list(arr.shape)] for name, arr in arrays.items()],
    }
    header.update(header_extra or {})
    for key in drop:
        header.pop(key, None)
    return [msgpack.packb(header)] + [arr.tobytes() for arr in arrays.values()]


def code_of(frames, schema=PRODUCER_TO_BROKER, **kw):
    with pytest.raises(ProtocolError) as err:
        decode(frames, schema, **kw)
    return err.value


def test_raw_peer_message_decodes_zero_copy():
    frames = raw_turn()
    message = decode(frames, PRODUCER_TO_BROKER)
    assert message.type == "turn" and message["trajectory_id"] == "t-1"
    assert message.arrays["mask_offsets"].dtype == np.int64
    assert message.arrays["tokens"].tolist() == [10, 11]
    assert not message.arrays["tokens"].flags.writeable
    assert np.shares_memory(message.arrays["tokens"], np.frombuffer(frames[2], np.uint8))


@pytest.mark.parametrize("as_type", [bytes, memoryview, bytearray])
def test_a_packed_message_decodes_zero_copy_whatever_buffer_its_frame_is(as_type):
    """Its arrays are read-only views of the frame it arrived in (a batch's
    carried frames are bytes: slicing those would copy every array)."""
    turn = Turn.build([5, 6, 7], [-0.1, -0.2, -0.3], supports=[[5], [6, 1], [7]], loss_mask=[1, 0, 1])
    header, body = encode_turn("b", 1, turn, seq=4, crc=True, may_pack=True)
    frame = as_type(bytes(body))
    message = decode([header, frame], PRODUCER_TO_BROKER)
    whole = np.frombuffer(frame, np.uint8)
    for name, array in message.arrays.items():
        assert np.shares_memory(array, whole), name
        assert not array.flags.writeable, name
    assert message.arrays["mask_ids"].tolist() == [5, 6, 1, 7]


def test_unknown_header_keys_are_ignored():
    message = decode(raw_turn({"future_field": [1, 2]}), PRODUCER_TO_BROKER)
    assert "future_field" not in message.fields


@pytest.mark.parametrize("header", [b"\xc1", b"\x93\x01\x02\x03", msgpack.packb([1, 2]), msgpack.packb({1: 2}), b""])
def test_malformed_header_has_no_seq(header):
    err = code_of([header])
    assert err.code == "malformed" and err.seq is None


def test_empty_message_is_malformed():
    assert code_of([]).code == "malformed"


@pytest.mark.parametrize("version", [None, 2, True, 1.0, "1"])
def test_version(version):
    frames = raw_turn({"v": version}) if version is not None else raw_turn(drop=("v",))
    err = code_of(frames)
    assert err.code == "version" and err.seq == 7


@pytest.mark.parametrize(
    "extra, drop",
    [
        ({"type": "bogus"}, ()),
        ({"type": 5}, ()),
        ({}, ("trajectory_id",)),
        ({"turn": -1}, ()),
        ({"turn": True}, ()),
        ({"status": "done"}, ()),
        ({"trajectory_id": ""}, ()),
        ({"arrays": "x"}, ()),
        ({"group_size": 0}, ()),
        ({"metadata": [1]}, ()),
        ({"crc32": -1}, ()),
        ({"turn": 1}, ()),  # prompt_tokens on a later turn
    ],
)
def test_schema(extra, drop):
    assert code_of(raw_turn(extra, drop=drop)).code == "schema"


def test_schema_array_rules():
    arrays = {"tokens": np.array([1], "<i4"), "log_probs": np.array([0.0], "<f4")}
    assert code_of(raw_turn(arrays=arrays)).code == "schema"  # turn 0 without prompt
    arrays["prompt_tokens"] = np.array([1], "<i4")
    arrays["mask_ids"] = np.array([1], "<i4")
    assert code_of(raw_turn(arrays=arrays)).code == "schema"  # mask_ids without offsets
    frames = raw_turn()
    assert code_of(frames[:-1]).code == "schema"  # a listed frame is missing
    assert code_of(frames + [b""]).code == "schema"  # an extra frame
    header = msgpack.unpackb(frames[0])
    header["arrays"].append(list(header["arrays"][0]))
    assert code_of([msgpack.packb(header)] + frames[1:] + [frames[1]]).code == "schema"  # listed twice
    header = msgpack.unpackb(frames[0])
    header["arrays"][0][0] = "secret"
    assert code_of([msgpack.packb(header)] + frames[1:]).code == "schema"  # unknown name


def test_too_large_is_checked_after_schema():
    assert code_of(raw_turn(), max_message_bytes=50).code == "too_large"
    assert code_of(raw_turn({"type": "bogus"}), max_message_bytes=50).code == "schema"


def test_crc_mismatch_before_dtype():
    frames = raw_turn()
    crc = 0
    for frame in frames[1:]:
        crc = zlib.crc32(frame, crc)
    assert decode(raw_turn({"crc32": crc}), PRODUCER_TO_BROKER).type == "turn"
    bad = raw_turn({"crc32": crc ^ 1})
    assert code_of(bad).code == "crc_mismatch"
    header = msgpack.unpackb(frames[0])
    header["arrays"][1][1] = "float32"
    header["crc32"] = crc ^ 1
    assert code_of([msgpack.packb(header)] + frames[1:]).code == "crc_mismatch"


def test_dtype_is_never_converted():
    arrays = {
        "prompt_tokens": np.array([1], "<i4"),
        "tokens": np.array([10], "<i8"),
        "log_probs": np.array([-0.1], "<f4"),
    }
    err = code_of(raw_turn(arrays=arrays))
    assert err.code == "dtype" and "int32" in err.message and "int64" in err.message


def test_shape_byte_length_and_rank():
    frames = raw_turn()
    frames[2] = frames[2][:-1]
    assert code_of(frames).code == "shape"
    arrays = {
        "prompt_tokens": np.array([[1]], "<i4"),
        "tokens": np.array([10], "<i4"),
        "log_probs": np.array([-0.1], "<f4"),
    }
    assert code_of(raw_turn(arrays=arrays)).code == "shape"


@pytest.mark.parametrize(
    "arrays, code",
    [
        ({"tokens": [10, 11], "log_probs": [-0.1]}, "misaligned"),
        ({"tokens": [10], "log_probs": [-0.1], "loss_mask": [1, 1]}, "misaligned"),
        ({"tokens": [10, 11], "log_probs": [-0.1, -0.1], "mask_ids": [10], "mask_offsets": [0, 1]}, "misaligned"),
        ({"tokens": [10], "log_probs": [-0.1], "mask_ids": [10], "mask_offsets": [1, 1]}, "mask_invalid"),
        ({"tokens": [10], "log_probs": [-0.1], "mask_ids": [9], "mask_offsets": [0, 1]}, "mask_invalid"),
        ({"tokens": [10, 11], "log_probs": [-0.1, -0.1], "mask_ids": [10, 11], "mask_offsets": [0, 2, 2]}, "mask_invalid"),
        ({"tokens": [-1], "log_probs": [-0.1]}, "out_of_vocab"),
        ({"tokens": [10], "log_probs": [-0.1], "forced_tokens": [-5]}, "out_of_vocab"),
        ({"tokens": [10], "log_probs": [-0.1], "loss_mask": [2]}, "invalid_value"),
        ({"tokens": [10], "log_probs": [float("nan")]}, "invalid_value"),
        ({"tokens": [10, 11], "log_probs": [-0.1, -0.1], "full_log_probs": [-0.2]}, "misaligned"),
        ({"tokens": [10], "log_probs": [-0.1], "full_log_probs": [float("nan")]}, "invalid_value"),
        ({"tokens": [10], "log_probs": [-0.1], "full_log_probs": [0.5]}, "invalid_value"),
        ({"tokens": [10], "log_probs": [-0.1], "full_log_probs": [float("-inf")]}, "invalid_value"),
    ],
)
def test_content_codes(arrays, code):
    dtypes = {"tokens": "<i4", "log_probs": "<f4", "loss_mask": "u1",
              "mask_ids": "<i4", "mask_offsets": "<i8", "forced_tokens": "<i4", "full_log_probs": "<f4"}
    typed = {"prompt_tokens": np.array([1], "<i4")}
    typed.update({name: np.array(values, dtypes[name]) for name, values in arrays.items()})
    assert code_of(raw_turn(arrays=typed)).code == code


def test_vocab_size_bounds_every_token_array():
    assert decode(raw_turn(), PRODUCER_TO_BROKER, vocab_size=12).type == "turn"
    err = code_of(raw_turn(), vocab_size=11)
    assert err.code == "out_of_vocab" and err.seq == 7
    err = code_of(raw_turn(), vocab_size=3)  # prompt token 2 fits, token 10 does not
    assert err.code == "out_of_vocab"


def test_misaligned_wins_over_mask_invalid_and_vocab():
    arrays = {
        "prompt_tokens": np.array([1], "<i4"),
        "tokens": np.array([-1, 5], "<i4"),
        "log_probs": np.array([-0.1], "<f4"),
        "mask_ids": np.array([7], "<i4"),
        "mask_offsets": np.array([0, 1], "<i8"),
    }
    assert code_of(raw_turn(arrays=arrays)).code == "misaligned"


def test_turn_round_trip_through_helpers():
    t = Turn.build([10, 11], [-0.1, -0.2], supports=[[10, 4], [11]], forced_tokens=[20], weight_version="w3",
                   routed_experts=np.arange(12, dtype=np.int32).reshape(3, 2, 2))
    frames = encode_turn("t", 0, t, seq=1, prompt_tokens=np.array([1, 2], np.int32), group_id="g", group_size=4,
                         sample_index=2, metadata={"k": "v"}, crc=True)
    message = decode(frames, PRODUCER_TO_BROKER)
    assert message["group_id"] == "g" and message["weight_version"] == "w3" and message["metadata"] == {"k": "v"}
    back = turn_from_message(message)
    assert back.mask == t.mask and back.forced_tokens.tolist() == [20]
    assert back.routed_experts.shape == (3, 2, 2) and back.routed_experts.sum() == 66


@pytest.mark.parametrize("packed, crc", [(False, False), (True, True), (False, True)])
def test_full_log_probs_cross_every_array_message_byte_for_byte(packed, crc):
    """A turn's, a delivery's and an open trajectory's `full_log_probs`
    come back as sent, read-only and in the contract dtype."""
    full = np.array([-0.125, -7.5], np.float32)
    t = Turn.build([10, 11], [-0.1, -0.2], supports=[[10, 4], [11]], forced_tokens=[20], full_log_probs=full)
    frames = encode_turn("t", 0, t, seq=1, prompt_tokens=np.array([1], np.int32), crc=crc, may_pack=packed)
    back = turn_from_message(decode(frames, PRODUCER_TO_BROKER))
    assert back.full_log_probs.tobytes() == full.tobytes() and not back.full_log_probs.flags.writeable
    traj = Trajectory("t", [1])
    traj.append_turn(back)
    traj.reward = 0.5
    message = decode(encode_deliver(traj, "l", may_pack=packed), BROKER_TO_CONSUMER)
    assert message.arrays["full_log_probs"].tobytes() == np.array([-0.125, -7.5, 0.0], np.float32).tobytes()
    opened = decode(encode(BROKER_TO_PRODUCER, "open_trajectory", {
        "seq": 2, "trajectory_id": "t", "next_turn": 1, "state": "open"}, {
        **{name: traj.arrays()[name] for name in ("prompt_tokens", "tokens", "log_probs", "loss_mask")},
        "full_log_probs": traj.full_log_probs}), BROKER_TO_PRODUCER)
    assert opened.arrays["full_log_probs"].tobytes() == traj.full_log_probs.tobytes()


def test_deliver_round_trip():
    traj = Trajectory("t", [1, 2], group_id="g", group_size=2, sample_index=0)
    traj.append_turn(Turn.build([10], [-0.1], supports=[[10, 4]], forced_tokens=[20]))
    traj.append_turn(Turn.build([11], [-0.3]))  # replay gap
    traj.reward = {"score": 1.0}
    message = decode(encode_deliver(traj, "lease-1", group_left=0), BROKER_TO_CONSUMER)
    assert "crc32" not in message.fields and message["gap"] == {"turn": 1, "field": "mask"}
    back = trajectory_from_deliver(message)
    assert back.mask == traj.mask and back.gap == traj.gap and back.reward == {"score": 1.0}
    assert back.tokens.tolist() == [10] and back.group_id == "g" and back.terminal


def test_deliver_response_length_must_match():
    traj = Trajectory("t", [1])
    traj.append_turn(Turn.build([10], [-0.1]))
    traj.reward = 0.0
    frames = encode_deliver(traj, "l")
    header = msgpack.unpackb(frames[0])
    header["response_length"] = 2
    err = code_of([msgpack.packb(header)] + frames[1:], BROKER_TO_CONSUMER)
    assert err.code == "misaligned"


MESSAGES = [
    (PRODUCER_TO_BROKER, "hello", {"producer_id": "p"}),
    (PRODUCER_TO_BROKER, "hello", {"producer_id": "p", "seq": 0, "batch_acks": True}),
    (PRODUCER_TO_BROKER, "end", {"seq": 2, "trajectory_id": "t", "reward": 0.5, "turns": 3}),
    (PRODUCER_TO_BROKER, "end", {"seq": 2, "trajectory_id": "t", "reward": 1.5, "metadata": {"a": 1}}),
    (PRODUCER_TO_BROKER, "end", {"seq": 2, "trajectory_id": "t", "reward": {"acc": 1}}),
    (PRODUCER_TO_BROKER, "abort", {"seq": 3, "trajectory_id": "t", "reason": "retry"}),
    (PRODUCER_TO_BROKER, "ping", {"seq": 4}),
    (BROKER_TO_PRODUCER, "welcome", {"broker_id": "b", "max_message_bytes": 100, "window": 8}),
    (BROKER_TO_PRODUCER, "ack", {"seq": 1, "trajectory_id": "t", "turn": 0, "applied": False, "duplicate": True}),
    (BROKER_TO_PRODUCER, "ack", {"seq": 1, "trajectory_id": "t", "applied": False, "reason": "replay_gap"}),
    (BROKER_TO_PRODUCER, "nack", {"seq": 1, "code": "out_of_order", "message": "m", "expected": 0}),
    (BROKER_TO_PRODUCER, "pong", {"seq": 4}),
    (BROKER_TO_PRODUCER, "welcome", {"broker_id": "b", "max_message_bytes": 100, "window": 8, "batch_acks": True}),
    (BROKER_TO_PRODUCER, "acks", {"ranges": [[1, 3], [7, 7]]}),
    (BROKER_TO_PRODUCER, "acks", {"ranges": [[1, 3]], "outcomes": [{"seq": 2, "applied": False, "reason": "replay_gap"},
                                                                  {"seq": 3, "applied": True, "duplicate": True}]}),
    (CONSUMER_TO_BROKER, "hello", {"consumer_id": "c"}),
    (CONSUMER_TO_BROKER, "heartbeat", {}),
    (CONSUMER_TO_BROKER, "credit", {"n": 4, "unit": "group"}),
    (CONSUMER_TO_BROKER, "ack", {"leases": ["a", "b"]}),
    (CONSUMER_TO_BROKER, "nack", {"leases": ["a"], "reason": "bad", "requeue": False}),
    (BROKER_TO_CONSUMER, "welcome", {"broker_id": "b", "lease_timeout": 30.0, "heartbeat_interval": 1}),
    (BROKER_TO_CONSUMER, "acked", {"leases": ["a"]}),
    (BROKER_TO_CONSUMER, "nacked", {"leases": ["a"]}),
    (BROKER_TO_CONSUMER, "nack", {"code": "stale_lease", "message": "m", "leases": ["x"]}),
    (ADMIN_REQUESTS, "status", {}),
    (ADMIN_REQUESTS, "dead_letters", {"limit": 10}),
    (ADMIN_REQUESTS, "requeue", {"trajectory_ids": ["t"]}),
    (ADMIN_REPLIES, "status", {"open": 1, "queued": 2, "ready": 2, "leased": 0, "dead": 0, "producers": 1, "consumers": 1,
                               "bytes_in_memory": 10, "bytes_on_disk": 20, "counters": {"frames": 3}}),
    (ADMIN_REPLIES, "dead_letters", {"items": [{"trajectory_id": "t", "reason": "expired", "at": 1.0}]}),
    (ADMIN_REPLIES, "requeued", {"trajectory_ids": ["t"]}),
]


@pytest.mark.parametrize("schema, mtype, fields", MESSAGES)
def test_every_message_type_round_trips(schema, mtype, fields):
    frames = encode(schema, mtype, fields)
    assert len(frames) == 1
    raw = msgpack.unpackb(frames[0])
    assert raw["v"] == 1 and raw["type"] == mtype
    message = decode(frames, schema)
    assert message.type == mtype and dict(message.fields) == fields


@pytest.mark.parametrize("schema, mtype, fields", MESSAGES)
def test_every_required_field_is_enforced(schema, mtype, fields):
    for name in schema.specs[mtype].required:
        partial = {k: v for k, v in fields.items() if k != name}
        with pytest.raises(ProtocolError) as err:
            encode(schema, mtype, partial)
        assert err.value.code == "schema" and name in err.value.message


def test_encode_refuses_wrong_dtype_instead_of_casting():
    with pytest.raises(ProtocolError) as err:
        encode(PRODUCER_TO_BROKER, "turn", {"seq": 1, "trajectory_id": "t", "turn": 1, "status": "completed"},
               {"tokens": np.array([1], np.int64), "log_probs": np.array([0.0], np.float32)})
    assert err.value.code == "dtype"


def test_encode_error_carries_seq_and_expected():
    frames = encode_error(BROKER_TO_PRODUCER, ProtocolError("out_of_order", "turn 3, expected 1", seq=9, expected=1))
    message = decode(frames, BROKER_TO_PRODUCER)
    assert message.fields == {"code": "out_of_order", "message": "turn 3, expected 1", "seq": 9, "expected": 1}


def test_content_digest_ignores_seq_and_map_order_only():
    a = decode(raw_turn({"metadata": {"x": 1, "y": 2}}), PRODUCER_TO_BROKER)
    b = decode(raw_turn({"seq": 99, "metadata": {"y": 2, "x": 1}}), PRODUCER_TO_BROKER)
    assert content_digest(a) == content_digest(b)
    c = decode(raw_turn({"status": "truncated"}), PRODUCER_TO_BROKER)
    assert content_digest(a) != content_digest(c)
    frames = raw_turn({"metadata": {"x": 1, "y": 2}})
    frames[3] = np.array([-0.1, -0.25], "<f4").tobytes()
    assert content_digest(decode(frames, PRODUCER_TO_BROKER)) != content_digest(a)


def test_zmq_frames_are_accepted():
    zmq = pytest.importorskip("zmq")
    frames = [zmq.Frame(f) for f in raw_turn()]
    assert decode(frames, PRODUCER_TO_BROKER)["turn"] == 0


@pytest.mark.parametrize("fields, problem", [
    ({"ranges": [[3, 1]]}, "first <= last"),
    ({"ranges": [[1]]}, "first <= last"),
    ({"ranges": [[1, 2]], "outcomes": [{"seq": 1}]}, "applied: boolean"),
    ({"ranges": [[1, 2]], "outcomes": [{"seq": 1, "applied": True, "reason": ""}]}, "reason?: non-empty string"),
])
def test_batched_acks_are_checked(fields, problem):
    with pytest.raises(ProtocolError) as err:
        decode([msgpack.packb({"v": 1, "type": "acks", **fields})], BROKER_TO_PRODUCER)
    assert err.value.code == "schema" and problem in err.value.message


@pytest.mark.parametrize("keys", [1, 14, 15, 16, 40])
def test_number_header_adds_seq_at_a_fixed_width_to_maps_of_any_size(keys):
    header = msgpack.packb({f"k{i}": i for i in range(keys)})
    numbered = [number_header(header, seq) for seq in (0, 1, 2**40, 2**63)]
    assert len({len(n) for n in numbered}) == 1  # the size is known before the number
    for seq, frame in zip((0, 1, 2**40, 2**63), numbered):
        assert msgpack.unpackb(frame) == {**{f"k{i}": i for i in range(keys)}, "seq": seq}


def test_an_unnumbered_turn_numbered_later_decodes_as_one_encoded_numbered():
    turn = Turn.build([5, 6], [-0.1, -0.2], supports=[[5], [6, 1]])
    later = encode_turn("t", 2, turn, seq=None, crc=True)
    later[0] = number_header(later[0], 41)
    got, want = decode(later, PRODUCER_TO_BROKER), decode(encode_turn("t", 2, turn, seq=41, crc=True), PRODUCER_TO_BROKER)
    assert got.fields == want.fields and got.fields["seq"] == 41
    assert {k: v.tobytes() for k, v in got.arrays.items()} == {k: v.tobytes() for k, v in want.arrays.items()}


def test_check_values_refuses_a_field_as_decoding_would():
    check_values(PRODUCER_TO_BROKER, "turn", {"trajectory_id": "t", "group_size": None})
    with pytest.raises(ProtocolError) as err:
        check_values(PRODUCER_TO_BROKER, "turn", {"trajectory_id": ""})
    assert err.value.code == "schema" and "turn.trajectory_id must be a non-empty string" in err.value.message
    with pytest.raises(ProtocolError, match="group_size must be a positive integer"):
        check_values(PRODUCER_TO_BROKER, "turn", {"group_size": 0})


def raw_packed_turn(header_extra=None, arrays=None):
    """`raw_turn`'s message with its arrays end to end in one frame, as a peer would pack them."""
    frames = raw_turn({"packed": True, **(header_extra or {})}, arrays)
    return [frames[0], b"".join(frames[1:])]


def test_a_packed_message_decodes_as_its_one_frame_per_array_form():
    packed, plain = raw_packed_turn(), raw_turn()
    a, b = decode(packed, PRODUCER_TO_BROKER), decode(plain, PRODUCER_TO_BROKER)
    assert a.fields == b.fields
    assert {k: v.tobytes() for k, v in a.arrays.items()} == {k: v.tobytes() for k, v in b.arrays.items()}
    assert content_digest(a) == content_digest(b)
    assert not a.arrays["tokens"].flags.writeable


def test_a_packed_crc_covers_the_arrays_as_the_frames_do():
    plain = raw_turn()
    crc = zlib.crc32(b"".join(plain[1:]))
    packed = raw_packed_turn({"crc32": crc})
    assert decode(packed, PRODUCER_TO_BROKER).arrays["tokens"].tolist() == [10, 11]
    damaged = [packed[0], packed[1][:-1] + bytes([packed[1][-1] ^ 1])]
    with pytest.raises(ProtocolError) as err:
        decode(damaged, PRODUCER_TO_BROKER)
    assert err.value.code == "crc_mismatch"


@pytest.mark.parametrize("value", [1, 0, "yes", None, [True]])
def test_packed_must_be_a_boolean(value):
    with pytest.raises(ProtocolError) as err:
        decode(raw_packed_turn({"packed": value}), PRODUCER_TO_BROKER)
    assert err.value.code == "schema" and "packed must be a boolean" in err.value.message and err.value.seq == 7


def test_packed_false_is_the_one_frame_per_array_form():
    assert decode(raw_turn({"packed": False}), PRODUCER_TO_BROKER).arrays["tokens"].tolist() == [10, 11]


def test_a_packed_message_has_one_array_frame():
    header, body = raw_packed_turn()
    for frames in ([header, body, body], [header]):
        with pytest.raises(ProtocolError) as err:
            decode(frames, PRODUCER_TO_BROKER)
        assert err.value.code == "schema" and "packed message" in err.value.message
    with pytest.raises(ProtocolError) as err:  # the arrays as separate frames under a packed header
        decode([header, *raw_turn()[1:]], PRODUCER_TO_BROKER)
    assert err.value.code == "schema"


@pytest.mark.parametrize("cut", [-1, 1])
def test_a_packed_frame_must_hold_exactly_the_listed_arrays(cut):
    header, body = raw_packed_turn()
    body = body[:cut] if cut < 0 else body + b"\0" * cut
    with pytest.raises(ProtocolError) as err:
        decode([header, body], PRODUCER_TO_BROKER)
    assert err.value.code == "shape"
    assert f"the packed frame has {len(body)}" in err.value.message and f"need {len(body) - cut}" in err.value.message


def test_in_a_packed_message_a_dtype_error_outranks_the_frame_length():
    header, body = raw_packed_turn()
    edited = msgpack.unpackb(header)
    edited["arrays"][1][1] = "int64"  # tokens: the wrong dtype, and the frame no longer adds up
    with pytest.raises(ProtocolError) as err:
        decode([msgpack.packb(edited), body], PRODUCER_TO_BROKER)
    assert err.value.code == "dtype" and "tokens" in err.value.message


def test_a_packed_message_without_arrays_is_its_header():
    frames = [msgpack.packb({"v": 1, "type": "end", "seq": 3, "trajectory_id": "t", "reward": 1.0, "packed": True})]
    assert decode(frames, PRODUCER_TO_BROKER)["reward"] == 1.0
    assert len(encode(PRODUCER_TO_BROKER, "end", {"seq": 3, "trajectory_id": "t", "reward": 1.0}, packed=True)) == 1


def test_encode_packs_the_widest_items_first():
    frames = encode(PRODUCER_TO_BROKER, "turn", {"seq": 1, "trajectory_id": "t", "turn": 0, "status": "completed"},
                    {"prompt_tokens": np.array([1], "<i4"), "tokens": np.array([10], "<i4"),
                     "log_probs": np.array([-0.5], "<f4"), "loss_mask": np.array([1], np.uint8),
                     "mask_ids": np.array([10], "<i4"), "mask_offsets": np.array([0, 1], "<i8")}, packed=True)
    header = msgpack.unpackb(frames[0])
    assert header["packed"] is True and len(frames) == 2
    assert [entry[0] for entry in header["arrays"]] == ["mask_offsets", "prompt_tokens", "tokens", "log_probs",
                                                         "mask_ids", "loss_mask"]
    assert frames[1] == (np.array([0, 1], "<i8").tobytes() + np.array([1, 10], "<i4").tobytes()
                         + np.array([-0.5], "<f4").tobytes() + np.array([10], "<i4").tobytes() + b"\x01")


def _experts_turn():
    arrays = {"prompt_tokens": np.array([1], "<i4"), "tokens": np.array([5, 6], "<i4"),
              "log_probs": np.array([-0.5, -0.25], "<f4"), "routed_experts": np.arange(12, dtype="<i4").reshape(2, 3, 2)}
    return raw_turn(arrays=arrays)


@pytest.mark.parametrize("frames", [raw_turn(), raw_packed_turn(), _experts_turn(), raw_turn({"metadata": {"k": 1}})],
                         ids=["frames", "packed", "3-d", "metadata"])
def test_a_trusted_decode_reads_what_decode_reads(frames):
    trusted, checked = decode_trusted(frames, PRODUCER_TO_BROKER), decode(frames, PRODUCER_TO_BROKER)
    assert trusted.type == checked.type == "turn" and trusted.fields == checked.fields
    assert {k: (v.dtype, v.shape, v.tobytes()) for k, v in trusted.arrays.items()} == \
        {k: (v.dtype, v.shape, v.tobytes()) for k, v in checked.arrays.items()}
    assert not trusted.arrays["tokens"].flags.writeable
    assert any(np.shares_memory(trusted.arrays["tokens"], np.frombuffer(f, np.uint8)) for f in frames[1:])  # zero-copy


def test_a_trusted_decode_of_what_it_does_not_expect_is_decode_with_its_error():
    frames = raw_turn()
    frames[2] = frames[2][:-1]  # tokens a byte short
    with pytest.raises(ProtocolError) as err:
        decode_trusted(frames, PRODUCER_TO_BROKER)
    assert err.value.code == "shape"
    assert decode_trusted(raw_turn({"x-extension": 1}), PRODUCER_TO_BROKER)["trajectory_id"] == "t-1"  # not a plain header


def _split_turn(**kw):
    ids = [np.array([10, 4], np.int32), np.array([11], np.int32), np.array([12, 3, 5], np.int32)]
    arrays = {"prompt_tokens": np.array([1], np.int32), "tokens": np.array([10, 11, 12], np.int32),
              "log_probs": np.array([-0.5] * 3, np.float32), "mask_ids": ids,
              "mask_offsets": np.array([0, 2, 3, 6], np.int64)}
    return encode(PRODUCER_TO_BROKER, "turn", {"seq": 1, "trajectory_id": "t", "turn": 0, "status": "completed"},
                  arrays, **kw)


def test_an_array_sent_in_parts_is_one_array_to_the_receiver():
    frames = _split_turn(crc=True)
    header = msgpack.unpackb(frames[0])
    assert ["mask_ids", "int32", [6], 3] in header["arrays"] and len(frames) == 1 + 4 + 3
    assert header["crc32"] == zlib.crc32(b"".join(bytes(memoryview(f)) for f in frames[1:]))
    message = decode(frames, PRODUCER_TO_BROKER)
    assert message.arrays["mask_ids"].tolist() == [10, 4, 11, 12, 3, 5]
    assert message.arrays["mask_offsets"].tolist() == [0, 2, 3, 6] and not message.arrays["mask_ids"].flags.writeable
    packed = _split_turn(packed=True)  # packed: the parts simply follow each other in the one frame
    assert len(packed) == 2 and all(len(entry) == 3 for entry in msgpack.unpackb(packed[0])["arrays"])
    assert decode(packed, PRODUCER_TO_BROKER).arrays["mask_ids"].tolist() == [10, 4, 11, 12, 3, 5]
    assert content_digest(decode(packed, PRODUCER_TO_BROKER)) == content_digest(message)


def _one_wide_support(ids: int, crc: bool = True) -> list:
    """A one-token turn whose support has `ids` ids (token 0 among them)."""
    arrays = {"tokens": np.array([0], "<i4"), "log_probs": np.array([-0.5], "<f4"),
              "mask_ids": np.arange(ids, dtype="<i4"), "mask_offsets": np.array([0, ids], "<i8")}
    header = {"turn": 1, **({"crc32": zlib.crc32(b"".join(a.tobytes() for a in arrays.values()))} if crc else {})}
    return raw_turn(header, arrays)


def test_a_verified_frame_of_the_kept_size_keeps_its_own_crc():
    """So that a delivery sending those bytes on as a piece needs no second
    pass over them; smaller frames, or no CRC to verify, keep none."""
    wide = CRC_KEPT_FROM_BYTES // 4
    message = decode(_one_wide_support(wide), PRODUCER_TO_BROKER)
    assert message.array_crcs == {"mask_ids": zlib.crc32(np.arange(wide, dtype="<i4").tobytes())}
    assert message.crc32 == msgpack.unpackb(_one_wide_support(wide)[0])["crc32"]
    assert turn_from_message(message).mask_ids_crc32 == message.array_crcs["mask_ids"]
    assert decode(_one_wide_support(wide - 1), PRODUCER_TO_BROKER).array_crcs is None
    assert decode(_one_wide_support(wide, crc=False), PRODUCER_TO_BROKER).array_crcs is None
    damaged = _one_wide_support(wide)
    damaged[3] = damaged[3][:-1] + b"\x01"
    assert code_of(damaged).code == "crc_mismatch"  # a kept CRC is still checked against the header


def test_a_piece_with_a_known_crc_is_combined_into_the_message_crc_not_read():
    first, second = np.arange(5000, dtype=np.int32), np.arange(7, dtype=np.int32)
    arrays = {"tokens": np.array([0], np.int32), "log_probs": np.array([-1.0], np.float32),
              "mask_offsets": np.array([0, 5007], np.int64)}
    fields = {"seq": 1, "trajectory_id": "t", "turn": 1, "status": "completed"}
    whole = zlib.crc32(b"".join(a.tobytes() for a in (*arrays.values(), first, second)))  # mask_ids goes last
    for crcs in ([zlib.crc32(first.tobytes()), None], [None, None]):
        frames = encode(PRODUCER_TO_BROKER, "turn", fields, {**arrays, "mask_ids": Pieces([first, second], crcs)},
                        crc=True)
        assert msgpack.unpackb(frames[0])["crc32"] == whole
        assert decode(frames, PRODUCER_TO_BROKER).arrays["mask_ids"].tolist() == [*range(5000), *range(7)]
    lying = encode(PRODUCER_TO_BROKER, "turn", fields, {**arrays, "mask_ids": Pieces([first, second], [1, None])},
                   crc=True)
    assert msgpack.unpackb(lying[0])["crc32"] != whole  # the given CRC was used: the bytes were not read for it


def _with_entry(frames, name, entry):
    header = msgpack.unpackb(frames[0])
    header["arrays"] = [entry if e[0] == name else e for e in header["arrays"]]
    return [msgpack.packb(header), *frames[1:]]


@pytest.mark.parametrize("entry, cut, code, words", [
    (["mask_ids", "int32", [6], 3], 1, "schema", "in 7 frame(s), message has 6"),  # a part missing
    (["mask_ids", "int32", [6], 0], 0, "schema", "integer >= 1"),
    (["mask_ids", "int32", [6], True], 0, "schema", "integer >= 1"),
    (["mask_ids", "int32", [6], 2], 0, "schema", "message has 7"),  # says 2, sends 3
    (["mask_ids", "int32", [7], 3], 0, "shape", "needs 28 bytes"),
    (["mask_ids", "int32", [3, 2], 3], 0, "schema", "must be 1-D"),
])
def test_an_array_in_parts_is_checked_like_any_other(entry, cut, code, words):
    frames = _with_entry(_split_turn(), "mask_ids", entry)
    frames = frames[: len(frames) - cut]
    error = code_of(frames)
    assert error.code == code and words in error.message, error.message


def test_parts_are_refused_in_a_packed_message_and_for_an_array_that_is_not_1d():
    header = msgpack.unpackb(_split_turn(packed=True)[0])
    header["arrays"] = [e + [1] if e[0] == "tokens" else e for e in header["arrays"]]
    error = code_of([msgpack.packb(header), _split_turn(packed=True)[1]])
    assert error.code == "schema" and "packed" in error.message
    with pytest.raises(ProtocolError, match="only a 1-D array travels in parts"):
        encode(PRODUCER_TO_BROKER, "turn", {"seq": 1, "trajectory_id": "t", "turn": 1, "status": "completed"},
               {"tokens": np.array([1], np.int32), "log_probs": np.array([-1.0], np.float32),
                "routed_experts": [np.zeros((1, 2), np.int32)]})


# -- batched frames (docs/protocol.md §3) ------------------------------------------
def _batchable():
    """A packed turn 0 (odd-sized arrays: 3 tokens, a 1-byte loss mask),
    an unpacked turn 1 and an end, numbered, as a producer holds them."""
    turn0 = encode_turn("b", 0, Turn.build([5, 6, 7], [-0.1, -0.2, -0.3], supports=[[5], [6, 1], [7]], loss_mask=[1, 0, 1]),
                        seq=1, prompt_tokens=np.array([1, 2], np.int32), crc=True, may_pack=True)
    turn1 = encode_turn("b", 1, Turn.build([8], [-0.5]), seq=2, crc=True)
    end = encode(PRODUCER_TO_BROKER, "end", {"seq": 3, "trajectory_id": "b", "reward": 1.0, "turns": 2})
    return [turn0, turn1, end]


def test_a_batch_carries_messages_that_decode_as_sent_with_every_frame_aligned():
    messages = _batchable()
    batch = encode_batch(messages)
    assert len(batch) == 2
    header = msgpack.unpackb(batch[0])
    assert header["type"] == "batch" and [m[0] for m in header["messages"]] == [m[0] for m in messages]
    assert [m[1] for m in header["messages"]] == [[len(f) for f in m[1:]] for m in messages]
    offset, body = 0, bytes(batch[1])
    for message in messages:  # each frame at the next multiple of 8, its bytes unchanged
        for frame in message[1:]:
            offset += -offset % 8
            assert body[offset:offset + len(frame)] == bytes(frame)
            offset += len(frame)
    assert offset == len(body)
    carried = split_batch(decode(batch, PRODUCER_TO_BROKER))
    assert [[bytes(f) for f in m] for m in carried] == [[bytes(f) for f in m] for m in messages]
    for got, sent in zip(carried, messages):
        assert content_digest(decode(got, PRODUCER_TO_BROKER)) == content_digest(decode(sent, PRODUCER_TO_BROKER))


def test_a_batched_message_keeps_no_reference_to_the_batch():
    batch = encode_batch(_batchable())
    carried = split_batch(decode(batch, PRODUCER_TO_BROKER))
    assert all(type(frame) is bytes for message in carried for frame in message)


def _batch_with(messages=None, body=None, **header_extra):
    good = encode_batch(_batchable())
    header = msgpack.unpackb(good[0])
    if messages is not None:
        header["messages"] = messages
    header.update(header_extra)
    return [msgpack.packb(header), good[1] if body is None else body]


@pytest.mark.parametrize("frames, code, words", [
    (lambda: _batch_with(messages=[]), "schema", "non-empty list"),
    (lambda: _batch_with(messages=[["not bytes", [1]]]), "schema", "header: bytes"),
    (lambda: _batch_with(messages=[[b"\x80", [-1]]]), "schema", "non-negative"),
    (lambda: _batch_with()[:1], "schema", "a batch is a header and one body frame, this one has 0"),
    (lambda: _batch_with() + [b"x"], "schema", "this one has 2"),
    (lambda: _batch_with(arrays=[["tokens", "int32", [1]]]), "schema", "a batch lists no arrays"),
])
def test_a_malformed_batch_is_refused_by_rule(frames, code, words):
    error = code_of(frames())
    assert error.code == code and words in error.message, error.message
    assert error.seq is None


@pytest.mark.parametrize("change, words", [
    (lambda body: body[:-1], "the body has"),
    (lambda body: body + b"\0", "the batched messages take"),
])
def test_a_batch_body_that_is_not_its_frames_is_a_shape_error(change, words):
    frames = _batch_with()
    frames[1] = change(bytes(frames[1]))
    with pytest.raises(ProtocolError) as err:
        split_batch(decode(frames, PRODUCER_TO_BROKER))
    assert err.value.code == "shape" and words in err.value.message


def test_a_batch_body_may_carry_a_crc_and_decoding_checks_it():
    frames = _batch_with(crc32=zlib.crc32(bytes(_batch_with()[1])))
    assert decode(frames, PRODUCER_TO_BROKER).type == "batch"
    assert code_of(_batch_with(crc32=1)).code == "crc_mismatch"


def test_the_common_packed_messages_take_the_fast_decoder_raw_fields_and_all():
    """A delivery always carries its metadata and reward, fields msgspec
    keeps raw, and a first turn may carry metadata: the fast decoder reads
    them (a message it gives up on costs a second header decode and the
    checked path, and nothing else would show it)."""
    from rollstream.common import codec

    traj = Trajectory("t", [1, 2])
    traj.append_turn(Turn.build([10, 11], [-0.1, -0.2], supports=[[10, 4], [11]]))
    traj.reward, traj.metadata = {"score": 1.0}, {"env": "math", "tags": ["a"]}
    deliver = encode_deliver(traj, "e-1", may_pack=True)
    turn = encode_turn("t", 0, Turn.build([10], [-0.1], supports=[[10]]), seq=3, prompt_tokens=np.array([1, 2], "<i4"),
                       metadata={"env": "math"}, crc=True, may_pack=True)
    for frames, schema, metadata in ((deliver, BROKER_TO_CONSUMER, traj.metadata), (turn, PRODUCER_TO_BROKER, {"env": "math"})):
        decoded = codec._decoded_fast(frames, schema, 1 << 30)
        assert decoded is not None, schema.name
        assert decoded[1].fields["metadata"] == metadata and decoded[1].fields == decode(frames, schema).fields


@pytest.mark.parametrize("length", [2**62, 2**63, 2**64 - 1])
def test_a_packed_array_longer_than_any_buffer_is_refused_naming_its_shape(length):
    header, body = raw_packed_turn()
    fields = msgpack.unpackb(header)
    fields["arrays"] = [[name, dtype, [length if name == "tokens" else size]] for name, dtype, (size,) in fields["arrays"]]
    with pytest.raises(ProtocolError) as err:
        decode([msgpack.packb(fields), body], PRODUCER_TO_BROKER)
    assert err.value.code == "shape" and err.value.seq == 7


def test_packing_takes_strided_arrays_and_pieces_as_their_contiguous_forms():
    tokens, log_probs = np.arange(20, dtype=np.int32)[::2], np.linspace(-1, 0, 20, dtype=np.float32)[::-2]
    ids = np.arange(30, dtype=np.int32)
    arrays = {"tokens": tokens, "log_probs": log_probs, "mask_ids": Pieces([ids[:12:2], ids[20:]], [None, None]),
              "mask_offsets": np.arange(11, dtype=np.int64).reshape(11, 1)[:, 0]}
    joined = {"tokens": tokens.copy(), "log_probs": log_probs.copy(), "mask_ids": np.concatenate([ids[:12:2], ids[20:]]),
              "mask_offsets": np.arange(11, dtype=np.int64)}
    fields = {"trajectory_id": "t", "turn": 1, "status": "completed", "seq": 3}
    got = encode(PRODUCER_TO_BROKER, "turn", fields, arrays, crc=True, packed=True)
    assert got == encode(PRODUCER_TO_BROKER, "turn", fields, joined, crc=True, packed=True)
    assert {name: array.tolist() for name, array in decode(got, PRODUCER_TO_BROKER, check_content=False).arrays.items()} == \
        {name: array.tolist() for name, array in joined.items()}
