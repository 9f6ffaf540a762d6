"""A peer written from docs/protocol.md with raw zmq + msgpack + numpy only
(no rollstream imports) drives a live broker through every message type."""
import zlib

import msgpack
import numpy as np
import pytest
import zmq
from broker_process import BrokerProcess
from faults.fuzz_frames import batch_frames

I32, I64, F32, U8 = "<i4", "<i8", "<f4", "u1"


def frames(mtype, arrays=None, crc=False, **fields):
    header = {"v": 1, "type": mtype, **fields}
    bufs = []
    if arrays:
        header["arrays"] = []
        for name, (values, dtype) in arrays.items():
            arr = np.asarray(values, dtype=dtype)
            header["arrays"].append([name, arr.dtype.name, list(arr.shape)])
            bufs.append(arr.tobytes())
        if crc:
            value = 0
            for buf in bufs:
                value = zlib.crc32(buf, value)
            header["crc32"] = value
    return [msgpack.packb(header)] + bufs


def turn(seq, tid, index, tokens, supports=None, forced=None, status="completed", prompt=None, **fields):
    arrays = {"tokens": (tokens, I32), "log_probs": ([-0.5] * len(tokens), F32)}
    if supports is not None:
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in supports])])
        arrays["mask_ids"] = ([i for s in supports for i in s], I32)
        arrays["mask_offsets"] = (offsets, I64)
    if forced:
        arrays["forced_tokens"] = (forced, I32)
    if prompt is not None:
        arrays["prompt_tokens"] = (prompt, I32)
    return frames("turn", arrays, crc=True, seq=seq, trajectory_id=tid, turn=index, status=status, **fields)


class Peer:
    def __init__(self, endpoint):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def call(self, message):
        self.sock.send_multipart(message)
        return self.recv()

    def recv(self, timeout=10_000):
        assert self.sock.poll(timeout), "no reply from the broker"
        parts = self.sock.recv_multipart()
        return msgpack.unpackb(parts[0]), parts[1:]


@pytest.fixture
def broker(tmp_path):
    with BrokerProcess(tmp_path, vocab_size=1000, window=8) as b:
        yield b


def test_the_in_flight_bound_is_shared_among_producers_as_they_join(tmp_path):
    """`max_in_flight` 8 with `window` 8: the first producer may have all 8
    frames in flight; those joining while it holds them start with 1; the
    first learns its share of 2 (of three) from its next pong, and the room
    it gives back goes to the others with theirs."""
    with BrokerProcess(tmp_path, window=8, max_in_flight=8) as b:
        peers = [Peer(b.producer) for _ in range(3)]
        grants = [peer.call(frames("hello", producer_id=f"p{i}", seq=0))[0]["window"] for i, peer in enumerate(peers)]
        assert grants == [8, 1, 1]
        pongs = [peer.call(frames("ping", seq=1))[0] for peer in peers]
        assert [(pong["type"], pong["window"]) for pong in pongs] == [("pong", 2)] * 3


def test_producer_and_consumer_conversation(broker):
    producer = Peer(broker.producer)
    welcome, _ = producer.call(frames("hello", producer_id="raw-peer", seq=0))
    assert welcome["type"] == "welcome" and welcome["window"] == 8 and welcome["seq"] == 0
    assert welcome["max_message_bytes"] == 256 * 1024 * 1024

    reply, _ = producer.call(turn(1, "t1", 0, [10, 11], [[10, 4], [11]], forced=[20, 21], prompt=[1, 2, 3],
                                  group_id="G", group_size=1, sample_index=7, weight_version="w1"))
    assert reply == {"v": 1, "type": "ack", "seq": 1, "trajectory_id": "t1", "turn": 0, "applied": True}
    reply, _ = producer.call(turn(2, "t1", 1, [30], [[30, 7, 8]], weight_version="w2"))
    assert reply["applied"] is True
    reply, _ = producer.call(turn(3, "t1", 1, [30], [[30, 7, 8]], weight_version="w2"))
    assert reply["duplicate"] is True and reply["applied"] is True
    reply, _ = producer.call(turn(4, "t1", 1, [31], [[31]]))
    assert reply["type"] == "nack" and reply["code"] == "conflict" and reply["seq"] == 4
    reply, _ = producer.call(turn(5, "t1", 5, [31], [[31]]))
    assert (reply["code"], reply["expected"]) == ("out_of_order", 2)
    reply, _ = producer.call(frames("end", seq=6, trajectory_id="t1", reward={"score": 0.75}, metadata={"env": "x"}))
    assert reply["applied"] is True
    reply, _ = producer.call(frames("ping", seq=7))
    assert reply == {"v": 1, "type": "pong", "seq": 7, "window": 8}

    consumer = Peer(broker.consumer)
    welcome, _ = consumer.call(frames("hello", consumer_id="raw-consumer"))
    assert welcome["type"] == "welcome" and welcome["lease_timeout"] > 0
    consumer.sock.send_multipart(frames("credit", n=1, unit="group"))
    header, bufs = consumer.recv()
    assert header["type"] == "deliver" and header["trajectory_id"] == "t1"
    crc = 0
    for buf in bufs:
        crc = zlib.crc32(buf, crc)
    assert header["crc32"] == crc
    arrays = {name: np.frombuffer(buf, dtype=dtype).reshape(shape)
              for (name, dtype, shape), buf in zip(header["arrays"], bufs)}
    # docs/semantics.md example 6, built by hand
    assert arrays["tokens"].tolist() == [10, 11, 20, 21, 30]
    assert arrays["mask_ids"].tolist() == [10, 4, 11, 20, 21, 30, 7, 8]
    assert arrays["mask_offsets"].tolist() == [0, 2, 3, 4, 5, 8]
    assert arrays["loss_mask"].tolist() == [1, 1, 0, 0, 1]
    assert arrays["prompt_tokens"].tolist() == [1, 2, 3]
    assert header["reward"] == {"score": 0.75} and header["metadata"] == {"env": "x"}
    assert header["weight_versions"] == ["w1", "w2"] and header["status"] == "completed"
    assert (header["group_id"], header["group_size"], header["group_left"], header["sample_index"]) == ("G", 1, 0, 7)
    assert header["response_length"] == 5 and header["delivery_count"] == 1

    consumer.sock.send_multipart(frames("ack", leases=[header["lease"], "not-a-lease"]))
    replies = [consumer.recv()[0], consumer.recv()[0]]
    assert {"type": "acked", "leases": [header["lease"]], "v": 1} in replies
    stale = next(r for r in replies if r["type"] == "nack")
    assert stale["code"] == "stale_lease" and stale["leases"] == ["not-a-lease"]

    reply, _ = producer.call(turn(8, "t1", 0, [10, 11], [[10, 4], [11]], prompt=[1, 2, 3]))
    assert reply["applied"] is False and reply["duplicate"] is True

    admin = Peer(broker.admin)
    status, _ = admin.call(frames("status", seq=1))
    assert status["type"] == "status" and status["seq"] == 1
    assert status["open"] == 0 and status["queued"] == 0 and status["counters"]["trajectories.delivered"] == 1


def test_gap_abort_and_dead_letters(broker):
    producer = Peer(broker.producer)
    reply, _ = producer.call(turn(1, "g", 0, [10], [[10]], forced=[5], prompt=[1]))
    reply, _ = producer.call(turn(2, "g", 1, [11], None, status="aborted"))
    assert (reply["applied"], reply["reason"]) == (False, "replay_gap")
    reply, _ = producer.call(turn(3, "g", 2, [12], [[12]]))
    assert reply["reason"] == "replay_gap"
    producer.call(frames("end", seq=4, trajectory_id="g", reward=1))

    reply, _ = producer.call(turn(5, "a", 0, [10], prompt=[1]))
    reply, _ = producer.call(frames("abort", seq=6, trajectory_id="a", reason="retry"))
    assert reply["applied"] is True
    reply, _ = producer.call(frames("abort", seq=7, trajectory_id="a", reason="retry"))
    assert (reply["applied"], reply["reason"]) == (False, "unknown_trajectory")
    reply, _ = producer.call(frames("end", seq=8, trajectory_id="never", reward=1))
    assert reply["code"] == "unknown_trajectory"

    consumer = Peer(broker.consumer)
    consumer.call(frames("hello", consumer_id="c"))
    consumer.sock.send_multipart(frames("credit", n=5, unit="trajectory"))
    header, bufs = consumer.recv()
    assert header["gap"] == {"turn": 1, "field": "mask"} and header["response_length"] == 1
    reply, _ = consumer.call(frames("nack", leases=[header["lease"]], reason="bad reward", requeue=False))
    assert reply == {"v": 1, "type": "nacked", "leases": [header["lease"]]}

    admin = zmq.Context.instance().socket(zmq.REQ)  # a REQ peer on the admin endpoint
    admin.setsockopt(zmq.LINGER, 0)
    admin.connect(broker.admin)
    admin.send(msgpack.packb({"v": 1, "type": "dead_letters", "limit": 5}))
    assert admin.poll(10_000)
    dead = msgpack.unpackb(admin.recv())
    assert [(i["trajectory_id"], i["reason"]) for i in dead["items"]] == [("g", "bad reward")]
    admin.send(msgpack.packb({"v": 1, "type": "requeue", "trajectory_ids": ["g", "unknown"]}))
    assert admin.poll(10_000)
    assert msgpack.unpackb(admin.recv())["trajectory_ids"] == ["g"]
    header, _ = consumer.recv()
    assert header["trajectory_id"] == "g" and header["delivery_count"] == 1  # a revived dead letter starts the count afresh
    admin.close()


def test_unknown_consumer_must_say_hello(broker):
    consumer = Peer(broker.consumer)
    reply, _ = consumer.call(frames("credit", n=1, unit="trajectory"))
    assert reply["code"] == "unknown_consumer"
    welcome, _ = consumer.call(frames("hello", consumer_id="late"))
    assert welcome["type"] == "welcome"


def test_batched_acks_cover_a_commit_and_refusals_stay_per_frame(broker):
    """A peer that asks in its hello gets one `acks` per commit: seq ranges,
    with the outcomes that are not a plain applied listed on their own."""
    producer = Peer(broker.producer)
    welcome, _ = producer.call(frames("hello", producer_id="batched", seq=0, batch_acks=True))
    assert welcome["batch_acks"] is True and welcome["seq"] == 0
    # Pipelined as one burst: the broker reads them together and commits once.
    burst = [turn(1, "b1", 0, [10], [[10, 4]], prompt=[1]), turn(2, "b1", 1, [11], [[11]]),
             turn(3, "b2", 0, [12], [[12]], prompt=[1], status="truncated"), turn(4, "b2", 1, [13], [[13]]),
             turn(5, "b1", 1, [11], [[11]]), turn(6, "b1", 2, [5000], [[5000]]),  # a resend; an id outside vocab 1000
             turn(7, "b1", 2, [14], [[14]]),
             frames("end", seq=8, trajectory_id="b1", reward=1.0, turns=3)]
    for message in burst:
        producer.sock.send_multipart(message)
    acked, nacked = {}, {}
    while len(acked) + len(nacked) < len(burst):
        reply, _ = producer.recv()
        if reply["type"] == "acks":
            assert set(reply) <= {"v", "type", "ranges", "outcomes", "window"}
            assert all(first <= last for first, last in reply["ranges"])
            others = {o["seq"]: o for o in reply.get("outcomes", [])}
            for first, last in reply["ranges"]:
                for seq in range(first, last + 1):
                    acked[seq] = others.pop(seq, {"seq": seq, "applied": True})
            assert not others  # every listed outcome lies inside a range
        else:
            assert reply["type"] == "nack", reply  # never a per-frame ack on this connection
            nacked[reply["seq"]] = reply
    assert sorted(acked) == [1, 2, 3, 4, 5, 7, 8] and sorted(nacked) == [6]
    assert nacked[6]["code"] == "out_of_vocab"
    assert acked[4] == {"seq": 4, "applied": False, "reason": "after_terminal"}
    assert acked[5] == {"seq": 5, "applied": True, "duplicate": True}
    assert all(acked[seq] == {"seq": seq, "applied": True} for seq in (1, 2, 3, 7, 8))

    plain = Peer(broker.producer)  # a peer that does not ask keeps getting one ack per frame
    plain.call(frames("hello", producer_id="plain"))
    reply, _ = plain.call(turn(1, "p1", 0, [10], [[10]], prompt=[1]))
    assert reply == {"v": 1, "type": "ack", "seq": 1, "trajectory_id": "p1", "turn": 0, "applied": True}


def test_an_end_counting_a_lost_turn_is_refused_out_of_order(broker):
    producer = Peer(broker.producer)
    producer.call(turn(1, "e", 0, [10], [[10]], prompt=[1]))
    reply, _ = producer.call(frames("end", seq=2, trajectory_id="e", reward=1.0, turns=2))  # turn 1 never came
    assert (reply["type"], reply["code"], reply["expected"], reply["seq"]) == ("nack", "out_of_order", 1, 2)
    reply, _ = producer.call(turn(3, "e", 1, [11], [[11]]))
    assert reply["applied"] is True
    reply, _ = producer.call(frames("end", seq=4, trajectory_id="e", reward=1.0, turns=2))
    assert reply["applied"] is True
    reply, _ = producer.call(frames("end", seq=5, trajectory_id="e", reward=1.0, turns=1))
    assert reply["code"] == "conflict"  # a different end than the one applied


def packed(message):
    """A message's arrays end to end in one frame under `packed: true`."""
    header = msgpack.unpackb(message[0])
    header["packed"] = True
    return [msgpack.packb(header), b"".join(message[1:])]


def unpack(header, bufs):
    """The arrays of a received message, any layout: one frame per array,
    packed, or an array split over the frames its entry's fourth element says."""
    assert header["crc32"] == zlib.crc32(b"".join(bufs))
    if header.get("packed"):
        assert len(bufs) == 1
        whole, bufs, start = bufs[0], [], 0
        for _, dtype, shape in header["arrays"]:
            end = start + np.dtype(dtype).itemsize * int(np.prod(shape))
            bufs.append(whole[start:end])
            start = end
        assert start == len(whole)
    spans = [entry[3] if len(entry) == 4 else 1 for entry in header["arrays"]]
    assert len(bufs) == sum(spans)
    arrays, start = {}, 0
    for (name, dtype, shape, *_), span in zip(header["arrays"], spans):
        arrays[name] = np.frombuffer(b"".join(bufs[start:start + span]), dtype=dtype).reshape(shape).tolist()
        start += span
    return arrays


def delivery_to(broker, consumer_id, **hello):
    """A new consumer connection saying `hello` (the layout flags asked for;
    those not asked for are left out), checked as the welcome echoes them,
    given one credit: the connection and its delivery."""
    consumer = Peer(broker.consumer)
    welcome, _ = consumer.call(frames("hello", consumer_id=consumer_id, **{flag: True for flag, asked in hello.items() if asked}))
    assert all(welcome.get(flag, False) is asked for flag, asked in hello.items())
    consumer.sock.send_multipart(frames("credit", n=1, unit="trajectory"))
    header, bufs = consumer.recv()
    assert header["type"] == "deliver"
    return consumer, header, bufs


def test_large_supports_go_unjoined_to_consumers_that_read_split_arrays(broker):
    """A trajectory whose turns carry 256 KiB of support ids each reaches a
    consumer whose hello says `split_arrays` with `mask_ids` in one frame
    per turn, as the turns brought them (the broker joins nothing); any
    other consumer gets it one frame per array. Same bytes, same CRC."""
    producer = Peer(broker.producer)
    producer.call(frames("hello", producer_id="wide"))
    supports = [list(range(1000)) for _ in range(66)]  # 66 tokens x 1,000 ids: over 256 KiB per turn
    tokens = [7 * i for i in range(66)]
    for index in range(3):
        message = turn(index + 1, "wide", index, tokens, supports, prompt=[1] if index == 0 else None)
        if index == 0:  # a producer may split an array too: the broker reads it as one
            header = msgpack.unpackb(message[0])
            at = 1 + [entry[0] for entry in header["arrays"]].index("mask_ids")
            header["arrays"][at - 1].append(2)
            whole = message[at]
            message = [msgpack.packb(header), *message[1:at], whole[:1000], whole[1000:], *message[at + 1:]]
        reply, _ = producer.call(message)
        assert reply["applied"] is True, reply
    producer.call(frames("end", seq=9, trajectory_id="wide", reward=0.0, turns=3))
    expected_ids = [i for _ in range(3) for s in supports for i in s]
    for asks in (True, False):
        consumer, header, bufs = delivery_to(broker, f"split-{asks}", split_arrays=asks)
        entries = {entry[0]: entry for entry in header["arrays"]}
        assert entries["mask_ids"] == (["mask_ids", "int32", [3 * 66000], 3] if asks else ["mask_ids", "int32", [3 * 66000]])
        assert len(bufs) == len(header["arrays"]) + (2 if asks else 0)  # mask_ids in 3 frames, the rest in 1 each
        joined = unpack(header, bufs)
        assert joined["mask_ids"] == expected_ids and joined["tokens"] == tokens * 3
        consumer.sock.send_multipart(frames("nack", leases=[header["lease"]], reason="again", requeue=True))


def test_packed_turns_are_read_and_packed_deliveries_go_to_consumers_that_ask(broker):
    """A producer may send any message packed; a consumer that asks in its
    hello gets its deliveries packed, the others one frame per array."""
    producer = Peer(broker.producer)
    producer.call(frames("hello", producer_id="packer"))
    for tid in ("k1", "k2"):
        reply, _ = producer.call(packed(turn(1, tid, 0, [10, 11], [[10, 4], [11]], forced=[20], prompt=[1, 2])))
        assert reply["applied"] is True, reply
        reply, _ = producer.call(packed(turn(2, tid, 1, [30], [[30, 7]])))
        assert reply["applied"] is True, reply
        reply, _ = producer.call(frames("end", seq=3, trajectory_id=tid, reward=1.0, turns=2, packed=True))
        assert reply["applied"] is True, reply
    short = packed(turn(4, "k3", 0, [10], [[10]], prompt=[1]))
    reply, _ = producer.call([short[0], short[1][:-1]])
    assert (reply["code"], reply["seq"]) == ("crc_mismatch", 4)  # the CRC covers the packed frame as it would the arrays

    expected = {"tokens": [10, 11, 20, 30], "mask_ids": [10, 4, 11, 20, 30, 7], "mask_offsets": [0, 2, 3, 4, 6],
                "loss_mask": [1, 1, 0, 1], "prompt_tokens": [1, 2], "log_probs": [-0.5, -0.5, 0.0, -0.5]}
    for asks in (True, False):
        consumer, header, bufs = delivery_to(broker, f"asks-{asks}", packed_arrays=asks)
        assert header.get("packed", False) is asks
        assert len(bufs) == (1 if asks else len(header["arrays"]))
        assert unpack(header, bufs) == expected
        consumer.sock.send_multipart(frames("ack", leases=[header["lease"]]))
        assert consumer.recv()[0]["type"] == "acked"

    # Over 512 KiB of arrays held whole (one turn's) a delivery goes a frame per array, as they arrived, even to a
    # consumer that reads packed ones.
    long = list(range(900)) * 30  # 27,000 tokens: 21 bytes each with their supports
    reply, _ = producer.call(packed(turn(5, "big", 0, long, [[t] for t in long], prompt=[1])))
    assert reply["applied"] is True, reply
    producer.call(frames("end", seq=6, trajectory_id="big", reward=0.0, turns=1))
    consumer, header, bufs = delivery_to(broker, "reads-packed", packed_arrays=True)
    assert header["trajectory_id"] == "big" and "packed" not in header and len(bufs) == len(header["arrays"])
    assert unpack(header, bufs)["tokens"] == long


def batch(*messages):
    """Messages in one `batch` (the fuzz's raw builder, also free of rollstream imports)."""
    return batch_frames(list(messages))


def test_a_batch_is_handled_as_its_messages_one_after_another_each_answered_by_its_seq(broker):
    producer = Peer(broker.producer)
    welcome, _ = producer.call(frames("hello", producer_id="batcher", batch_frames=True))
    assert welcome["batch_frames"] is True
    producer.sock.send_multipart(batch(
        turn(1, "c1", 0, [10, 11, 12], [[10, 4], [11], [12]], prompt=[1, 2, 3]),  # 3 tokens: frames of 12 and 3 bytes
        packed(turn(2, "c1", 1, [13], [[13]])),
        turn(3, "c1", 2, [5000], [[5000]]),  # outside vocab 1000: refused alone
        frames("ping", seq=4),  # not a frame a batch carries
        frames("end", seq=5, trajectory_id="c1", reward=1.0, turns=2)))
    replies = [producer.recv()[0] for _ in range(5)]
    assert [(r["type"], r["seq"]) for r in replies] == [("ack", 1), ("ack", 2), ("nack", 3), ("nack", 4), ("ack", 5)]
    assert all(replies[i]["applied"] is True for i in (0, 1, 4))
    assert replies[2]["code"] == "out_of_vocab"
    assert replies[3]["code"] == "schema" and "ping" in replies[3]["message"]

    consumer, header, bufs = delivery_to(broker, "batch-reader")
    arrays = unpack(header, bufs)
    assert arrays["prompt_tokens"] == [1, 2, 3] and arrays["tokens"] == [10, 11, 12, 13]
    assert arrays["mask_ids"] == [10, 4, 11, 12, 13]


def test_a_mixed_batch_is_answered_frame_by_frame_as_if_each_came_alone(tmp_path):
    """One batch of good, duplicate, conflicting, out-of-order, malformed,
    corrupted and out-of-vocabulary frames over two trajectories: each is
    answered by its own reply, in order, as docs/protocol.md answers it
    alone (the refused ones change nothing: what follows them is judged
    against what was applied), and the trajectory delivered holds exactly
    the applied turns."""
    with BrokerProcess(tmp_path, vocab_size=1000) as broker:
        producer = Peer(broker.producer)
        welcome, _ = producer.call(frames("hello", producer_id="mixed", batch_frames=True))
        assert welcome["batch_frames"] is True
        corrupted = turn(9, "m2", 1, [14], [[14]])
        corrupted[1] = b"\x0f" + corrupted[1][1:]  # tokens changed after the CRC was taken
        producer.sock.send_multipart(batch(
            turn(1, "m1", 0, [10, 11], [[10, 4], [11]], prompt=[1, 2]),
            packed(turn(2, "m1", 1, [12], [[12]])),
            packed(turn(3, "m1", 1, [12], [[12]])),  # the same turn again
            turn(4, "m1", 1, [13], [[13]]),  # turn 1 again, other content
            turn(5, "m1", 3, [15], [[15]]),  # turn 2 is next
            [b"\xc1not msgpack"],  # no header to read, not even its seq
            turn(6, "m2", 0, [5000], [[5000]], prompt=[1]),  # outside vocab 1000
            turn(7, "m2", 0, [20], [[20, 21]], prompt=[3]),  # turn 0 again: the refused one was never applied
            turn(8, "m2", 2, [22], [[22]]),  # turn 1 is next
            corrupted,
            turn(10, "m1", 2, [16, 17], [[16], [17, 3]]),  # the conflict changed nothing: turn 2 is next
            frames("end", seq=11, trajectory_id="m1", reward=1.0, turns=3),
            frames("end", seq=12, trajectory_id="m2", reward=0.5, turns=1)))
        replies = [producer.recv()[0] for _ in range(13)]
    expected = [
        ("ack", 1, True, None), ("ack", 2, True, None), ("ack", 3, True, None), ("nack", 4, None, "conflict"),
        ("nack", 5, None, "out_of_order"), ("nack", None, None, "malformed"), ("nack", 6, None, "out_of_vocab"),
        ("ack", 7, True, None), ("nack", 8, None, "out_of_order"), ("nack", 9, None, "crc_mismatch"),
        ("ack", 10, True, None), ("ack", 11, True, None), ("ack", 12, True, None),
    ]
    assert [(r["type"], r.get("seq"), r.get("applied"), r.get("code")) for r in replies] == expected, replies
    assert replies[2].get("duplicate") is True and "duplicate" not in replies[1]
    assert replies[4]["expected"] == 2 and replies[8]["expected"] == 1
    with BrokerProcess(tmp_path, vocab_size=1000) as broker:  # what was applied, read back after a restart
        delivered = {}
        consumer = Peer(broker.consumer)
        consumer.call(frames("hello", consumer_id="mixed-reader"))
        consumer.sock.send_multipart(frames("credit", n=2, unit="trajectory"))
        for _ in range(2):
            header, bufs = consumer.recv()
            assert header["type"] == "deliver"
            delivered[header["trajectory_id"]] = unpack(header, bufs)
    assert delivered["m1"]["prompt_tokens"] == [1, 2] and delivered["m1"]["tokens"] == [10, 11, 12, 16, 17]
    assert delivered["m1"]["mask_ids"] == [10, 4, 11, 12, 16, 17, 3]
    assert delivered["m2"]["prompt_tokens"] == [3] and delivered["m2"]["tokens"] == [20]
    assert delivered["m2"]["mask_ids"] == [20, 21]


def test_a_batch_that_cannot_be_read_is_refused_whole_and_applies_nothing(broker):
    producer = Peer(broker.producer)
    producer.call(frames("hello", producer_id="broken-batch"))
    whole = batch(turn(1, "c2", 0, [10], [[10]], prompt=[1]), turn(2, "c2", 1, [11], [[11]]))
    reply, _ = producer.call([whole[0], whole[1][:-4]])  # the body ends before the last frame does
    assert reply["type"] == "nack" and reply["code"] == "shape" and "seq" not in reply
    reply, _ = producer.call(turn(3, "c2", 1, [11], [[11]]))
    assert (reply["type"], reply["code"], reply["expected"]) == ("nack", "out_of_order", 0), reply  # turn 0 never applied
    reply, _ = producer.call(turn(4, "c2", 0, [10], [[10]], prompt=[1]))
    assert reply["type"] == "ack" and reply["applied"] is True and "duplicate" not in reply


@pytest.mark.slow
def test_a_checkpointing_session_trains_seals_and_resumes_and_a_broker_restart_settles_by_id(tmp_path):
    """docs/protocol.md §4, checkpointing sessions, from a raw peer: acks
    with a step keep the trajectories as trained; a seal reclaims through
    the oldest kept checkpoint; a resume of a new lineage records its
    checkpoint's manifest, lists what was trained after it and hands that
    back (`replay: true`, no credit); after a restart an ack naming its
    trajectory settles a lease the broker no longer knows; a session
    without a run is refused a step; an admin `end_run` reclaims the rest
    of the run, whose resume is refused afterwards."""
    with BrokerProcess(tmp_path, vocab_size=1000) as broker:
        producer = Peer(broker.producer)
        producer.call(frames("hello", producer_id="raw", seq=0))
        for k, tid in enumerate(["a", "b", "c", "d"]):
            assert producer.call(turn(2 * k + 1, tid, 0, [10], [[10, 4]], prompt=[1]))[0]["applied"]
            assert producer.call(frames("end", seq=2 * k + 2, trajectory_id=tid, reward=1.0))[0]["applied"]

        trainer = Peer(broker.consumer)
        welcome, _ = trainer.call(frames("hello", consumer_id="t", run="R", lineage="L1"))
        assert welcome["max_unsealed_bytes"] > 0
        trainer.sock.send_multipart(frames("credit", n=3, unit="trajectory"))
        leases = {}
        for _ in range(3):
            header, _ = trainer.recv()
            leases[header["trajectory_id"]] = header["lease"]
        assert sorted(leases) == ["a", "b", "c"]
        for step, tids in ((1, ["a"]), (2, ["b", "c"])):
            reply, _ = trainer.call(frames("ack", leases=[leases[t] for t in tids], trajectory_ids=tids, step=step,
                                           positions=list(range(len(tids)))))
            assert reply == {"v": 1, "type": "acked", "leases": [leases[t] for t in tids]}
        status, _ = Peer(broker.admin).call(frames("status"))
        assert (status["unsealed"], status["oldest_unsealed_step"], status["queued"]) == (3, 1, 1)
        reply, _ = trainer.call(frames("seal", step=1, keep=1, seq=5))
        assert reply == {"v": 1, "type": "sealed", "step": 1, "reclaimed": 1, "seq": 5}

        broker.kill()
        broker.start()
        again = Peer(broker.consumer)
        again.call(frames("hello", consumer_id="t", run="R", lineage="L2"))
        again.sock.send_multipart(frames("resume", step=1, keep=1, trained=[[1, 0, "a"]], seq=9))
        resumed, _ = again.recv()
        assert resumed == {"v": 1, "type": "resumed", "step": 1, "replay": [[2, 0, "b"], [2, 1, "c"]], "epoch": 0,
                           "seq": 9}
        replayed = [again.recv()[0] for _ in range(2)]
        assert [(h["trajectory_id"], h["replay"]) for h in replayed] == [("b", True), ("c", True)]
        assert all("group_id" not in h and "delivery_count" not in h for h in replayed)

        again.sock.send_multipart(frames("credit", n=1, unit="trajectory"))
        d, _ = again.recv()
        assert d["trajectory_id"] == "d" and "replay" not in d
        broker.kill()
        broker.start()
        last = Peer(broker.consumer)
        last.call(frames("hello", consumer_id="t", run="R", lineage="L2"))
        reply, _ = last.call(frames("ack", leases=[d["lease"]], trajectory_ids=["d"], step=2, positions=[0]))
        assert reply["type"] == "acked" and reply["leases"] == [d["lease"]]  # a lease of the killed broker, by id

        plain = Peer(broker.consumer)
        plain.call(frames("hello", consumer_id="plain"))
        reply, _ = plain.call(frames("seal", step=3, keep=1))
        assert (reply["type"], reply["code"]) == ("nack", "not_checkpointed")
        status, _ = Peer(broker.admin).call(frames("status"))
        assert (status["queued"], status["leased"], status["unsealed"]) == (0, 0, 3)

        # The run is over (admin `end_run`): all it trained is reclaimed, the steps no seal reclaimed included.
        ended, _ = Peer(broker.admin).call(frames("end_run", run="R", seq=11))
        assert ended == {"v": 1, "type": "run_ended", "run": "R", "reclaimed": 3, "seq": 11}
        status, _ = Peer(broker.admin).call(frames("status"))
        assert status["unsealed"] == 0
        resume, _ = last.call(frames("resume", step=1, keep=1, trained=[], seq=12))
        assert (resume["type"], resume["code"]) == ("nack", "checkpoint_gone")


def test_an_admin_history_request_answers_rows_names_what_was_let_go_of_and_refuses_two_questions(broker):
    """docs/protocol.md §5, `history`, from a raw admin peer: a step is
    answered with the rows of what the broker holds trained there (the
    archive's column names, times as Unix seconds), a trajectory with its
    row; once a seal reclaimed them, the step names the run reclaimed
    through it and the trajectory the job that remembers its id; a request
    asking both is refused `schema`, naming the rule."""
    producer = Peer(broker.producer)
    producer.call(frames("hello", producer_id="raw", seq=0))
    for k, tid in enumerate(["a", "b"]):
        assert producer.call(turn(2 * k + 1, tid, 0, [10], [[10, 4]], prompt=[1], weight_version="3"))[0]["applied"]
        assert producer.call(frames("end", seq=2 * k + 2, trajectory_id=tid, reward=0.5))[0]["applied"]
    trainer = Peer(broker.consumer)
    trainer.call(frames("hello", consumer_id="t", run="R", lineage="L"))
    trainer.sock.send_multipart(frames("credit", n=2, unit="trajectory"))
    leases = dict((h["trajectory_id"], h["lease"]) for h, _ in (trainer.recv() for _ in range(2)))
    reply, _ = trainer.call(frames("ack", leases=[leases["b"], leases["a"]], trajectory_ids=["b", "a"], step=4,
                                   positions=[0, 1]))
    assert reply["type"] == "acked"

    admin = Peer(broker.admin)
    answer, _ = admin.call(frames("history", step=4, seq=21))
    assert (answer["type"], answer["seq"], answer["held"], answer["steps"]) == ("history", 21, 2, [4, 4])
    rows = sorted(answer["rows"], key=lambda row: row["position"])
    assert [(r["trajectory_id"], r["job"], r["run"], r["step"], r["position"], r["producer"], r["outcome"], r["reward"])
            for r in rows] == [("b", "default", "R", 4, 0, "raw", "trained", 0.5), ("a", "default", "R", 4, 1, "raw",
                                                                                   "trained", 0.5)]
    assert rows[0]["weight_version_spans"] == [[{"version": "3", "start": 0, "end": 1}]]
    assert isinstance(rows[0]["first_turn_at"], float) and rows[0]["committed_at"] >= rows[0]["first_turn_at"]
    answer, _ = admin.call(frames("history", trajectory_id="a", job="default", seq=22))
    assert [(r["trajectory_id"], r["deliveries"], r["turns"]) for r in answer["rows"]] == [("a", 1, 1)]

    assert trainer.call(frames("seal", step=4, keep=1))[0]["reclaimed"] == 2
    answer, _ = admin.call(frames("history", step=4))
    assert (answer["rows"], answer["reclaimed"], "steps" in answer) == ([], [{"job": "default", "run": "R",
                                                                              "through": 4}], False)
    answer, _ = admin.call(frames("history", trajectory_id="a"))
    assert (answer["rows"], answer["let_go"]) == ([], [{"job": "default", "trajectory_id": "a"}])

    refused, _ = admin.call(frames("history", step=4, trajectory_id="a", seq=23))
    assert (refused["type"], refused["code"], refused["seq"]) == ("nack", "schema", 23)
    assert "expected exactly one of step and trajectory_id" in refused["message"], refused["message"]


def test_two_jobs_keep_their_ids_apart_and_spans_place_each_version(broker):
    producer = Peer(broker.producer)
    welcome, _ = producer.call(frames("hello", producer_id="eval-peer", job="eval"))
    assert welcome["job"] == "eval"  # the broker keeps jobs apart
    for seq, job, tokens in ((1, None, [10]), (3, "eval", [30, 31])):
        named = {} if job is None else {"job": job}
        spans = {} if job is None else {"weight_version": "w5", "weight_version_spans": [["w5", 0, 1], ["w6", 1, 2]]}
        reply, _ = producer.call(turn(seq, "t1", 0, tokens, [[t] for t in tokens], prompt=[1], group_id="G",
                                      group_size=1, **named, **spans))
        assert reply["applied"] is True and reply["trajectory_id"] == "t1"
        reply, _ = producer.call(frames("end", seq=seq + 1, trajectory_id="t1", reward=1.0, **named))
        assert reply["applied"] is True and reply["trajectory_id"] == "t1"
    reply, _ = producer.call(turn(5, "a\x1fb", 0, [10], [[10]], prompt=[1]))
    assert reply["code"] == "schema" and "U+001F" in reply["message"]
    reply, _ = producer.call(turn(6, "t2", 0, [10, 11], [[10], [11]], prompt=[1], weight_version="w1",
                                  weight_version_spans=[["w2", 0, 2]]))
    assert reply["code"] == "schema" and "a turn's weight_version is its first span's" in reply["message"]

    def first_delivery(**hello):
        consumer = Peer(broker.consumer)
        welcome, _ = consumer.call(frames("hello", consumer_id=f"c-{hello.get('job')}", **hello))
        assert welcome.get("job") == hello.get("job")
        consumer.sock.send_multipart(frames("credit", n=5, unit="trajectory"))
        header, bufs = consumer.recv()
        tokens = np.frombuffer(bufs[[a[0] for a in header["arrays"]].index("tokens")], dtype=I32)
        assert not consumer.sock.poll(500)  # nothing of the other job follows
        return header, tokens.tolist()

    header, tokens = first_delivery(job="eval")
    assert (header["trajectory_id"], header["group_id"], tokens) == ("t1", "G", [30, 31])
    assert header["weight_versions"] == ["w5"] and header["weight_version_spans"] == [[["w5", 0, 1], ["w6", 1, 2]]]
    header, tokens = first_delivery()
    assert (header["trajectory_id"], header["group_id"], tokens) == ("t1", "G", [10])


def test_a_published_policy_version_bounds_staleness_at_admission_and_delivery(tmp_path):
    with BrokerProcess(tmp_path, max_staleness=1, dispatch_order="oldest_first") as b:
        producer = Peer(b.producer)
        producer.call(frames("hello", producer_id="versioned", seq=0))
        reply, _ = producer.call(turn(1, "x", 0, [10], [[10]], prompt=[1], weight_version="final"))
        assert (reply["type"], reply["code"], reply["seq"]) == ("nack", "invalid_value", 1)
        assert "an ordered weight_version is an integer, or text ending in one" in reply["message"]
        for seq, (tid, version) in enumerate((("new", "3"), ("old", "step-1"), ("mid", "v2")), start=2):
            reply, _ = producer.call(turn(2 * seq, tid, 0, [10], [[10]], prompt=[1], weight_version=version))
            assert reply["applied"] is True
            reply, _ = producer.call(frames("end", seq=2 * seq + 1, trajectory_id=tid, reward=1.0))
            assert reply["applied"] is True

        consumer = Peer(b.consumer)
        consumer.call(frames("hello", consumer_id="trainer"))
        echo, _ = consumer.call(frames("policy", version=3, per_step=2, seq=9))
        assert echo == {"v": 1, "type": "policy", "version": 3, "max_staleness": 1, "held": 3, "waiting": 0, "seq": 9}
        consumer.sock.send_multipart(frames("credit", n=5, unit="trajectory"))
        delivered = [consumer.recv()[0]["trajectory_id"] for _ in range(2)]
        assert delivered == ["mid", "new"]  # oldest version first; "old" is 2 behind: stale, never delivered
        assert not consumer.sock.poll(500)

        # capacity (1 + 1) x 2 = 4 untrained: two are leased, so two more open and the fifth waits
        for seq, tid in enumerate(("a", "b", "c"), start=20):
            reply, _ = producer.call(turn(seq, tid, 0, [10], [[10]], prompt=[1], weight_version="3"))
            assert (reply["type"], reply.get("code")) == (("nack", "unavailable") if tid == "c" else ("ack", None))
        assert "capacity (max_staleness 1 + 1) x 2 per step" in reply["message"]
        pong, _ = producer.call(frames("ping", seq=30))
        assert pong["admit"] == 0  # the job holds its capacity: start nothing new

        status, _ = Peer(b.admin).call(frames("status"))
        assert status["counters"]["trajectories.stale"] == 1 and status["counters"]["admission_waits"] == 1
        assert status["policies"] == {"default": {"version": 3, "max_staleness": 1, "capacity": 4, "untrained": 4}}
        dead, _ = Peer(b.admin).call(frames("dead_letters"))
        assert [(item["trajectory_id"], item["reason"]) for item in dead["items"]] == [("old", "stale")]


def test_an_end_without_a_reward_waits_for_a_reward_message_from_any_connection(broker):
    producer, verifier = Peer(broker.producer), Peer(broker.producer)
    producer.call(frames("hello", producer_id="rollout"))
    verifier.call(frames("hello", producer_id="verifier"))
    assert producer.call(turn(1, "t", 0, [10], [[10]], prompt=[1]))[0]["applied"] is True
    assert producer.call(frames("end", seq=2, trajectory_id="t"))[0]["applied"] is True
    status, _ = Peer(broker.admin).call(frames("status"))
    assert (status["scoring"], status["queued"]) == (1, 0)
    reply, _ = verifier.call(frames("reward", seq=1, trajectory_id="t", reward={"score": 0.5}))
    assert reply == {"v": 1, "type": "ack", "seq": 1, "trajectory_id": "t", "applied": True}
    status, _ = Peer(broker.admin).call(frames("status"))
    assert (status["scoring"], status["queued"]) == (0, 1)
    consumer = Peer(broker.consumer)
    consumer.call(frames("hello", consumer_id="c"))
    consumer.sock.send_multipart(frames("credit", n=1, unit="trajectory"))
    header, _ = consumer.recv()
    assert (header["trajectory_id"], header["reward"]) == ("t", {"score": 0.5})


def test_a_resumed_lineage_drops_what_abandoned_weights_sampled_and_tells_producers(broker):
    producer = Peer(broker.producer)
    producer.call(frames("hello", producer_id="lineage", seq=0))
    for seq, (tid, version) in enumerate((("kept", "10"), ("ahead", "12")), start=1):
        reply, _ = producer.call(turn(2 * seq, tid, 0, [10], [[10]], prompt=[1], weight_version=version))
        assert reply["applied"] is True
        reply, _ = producer.call(frames("end", seq=2 * seq + 1, trajectory_id=tid, reward=1.0))
    reply, _ = producer.call(turn(10, "running", 0, [10], [[10]], prompt=[1], weight_version="11"))
    assert reply["applied"] is True

    consumer = Peer(broker.consumer)
    consumer.call(frames("hello", consumer_id="trainer"))
    refusal, _ = consumer.call(frames("policy", version=10, branches=[[1, 10], [1, 11]], seq=4))
    assert (refusal["type"], refusal["code"]) == ("nack", "invalid_value")
    echo, _ = consumer.call(frames("policy", version=10, branches=[[1, 10]], seq=5))
    assert echo == {"v": 1, "type": "policy", "version": 10, "held": 3, "waiting": 0, "seq": 5}

    reply, _ = producer.call(turn(11, "running", 1, [10], [[10]], weight_version="11"))
    assert (reply["applied"], reply["reason"]) == (False, "abandoned")  # given up at the resume: stop sampling it
    pong, _ = producer.call(frames("ping", seq=12))
    assert pong["lineage"] == [1, 10]  # serve the checkpoint of step 10
    reply, _ = producer.call(turn(13, "after", 0, [10], [[10]], prompt=[1], weight_version="e1:11"))
    assert reply["applied"] is True
    producer.call(frames("end", seq=14, trajectory_id="after", reward=1.0))

    consumer.sock.send_multipart(frames("credit", n=5, unit="trajectory"))
    delivered = sorted(consumer.recv()[0]["trajectory_id"] for _ in range(2))
    assert delivered == ["after", "kept"]
    assert not consumer.sock.poll(500)
    dead, _ = Peer(broker.admin).call(frames("dead_letters"))
    assert sorted((item["trajectory_id"], item["reason"]) for item in dead["items"]) == [
        ("ahead", "abandoned"), ("running", "abandoned")]


def test_queued_counts_reach_a_consumer_that_asks_and_no_other(broker):
    """A raw peer whose hello says `queued_counts` hears the count in its
    welcome and each delivery, a `queued` message when the queue turns
    empty or not, and `revoked` with it after a `revoke`; a peer that does
    not ask sees none of the fields."""
    producer = Peer(broker.producer)
    producer.call(frames("hello", producer_id="counted"))
    for k in range(3):
        assert producer.call(turn(2 * k + 1, f"q{k}", 0, [5], prompt=[1]))[0]["applied"] is True
        assert producer.call(frames("end", seq=2 * k + 2, trajectory_id=f"q{k}", reward=1.0))[0]["applied"] is True
    plain, header, _ = delivery_to(broker, "plain")
    assert "queued" not in header
    counted = Peer(broker.consumer)
    welcome, _ = counted.call(frames("hello", consumer_id="counted", queued_counts=True))
    assert welcome["queued_counts"] is True and welcome["queued"] == 2
    counted.sock.send_multipart(frames("credit", n=1, unit="trajectory"))
    header, _ = counted.recv()
    assert header["type"] == "deliver" and header["queued"] == 1
    plain.sock.send_multipart(frames("credit", n=1, unit="trajectory"))  # takes the last one
    news, _ = counted.recv()
    assert news["type"] == "queued" and news["n"] == 0
    counted.sock.send_multipart(frames("credit", n=4, unit="trajectory"))
    revoked, _ = counted.call(frames("revoke", seq=9))
    assert revoked == {"v": 1, "type": "revoked", "queued": 0, "seq": 9}


def test_a_restarted_producer_is_handed_back_its_own_open_trajectories_with_their_content(tmp_path):
    """The broker lists a producer's open trajectories to a connection whose
    hello names the same producer id and job, and sends one's content so far:
    prompt, merged tokens with forced ones, supports, spans of each version.
    Another producer, or the same id in another job, gets none of them; an
    abort with `again` keeps a group member waited for, and the broker
    counts what the producer did with what it was handed back."""
    with BrokerProcess(tmp_path, vocab_size=1000, window=8) as b:
        first = Peer(b.producer)
        first.call(frames("hello", producer_id="p1", seq=0))
        group = dict(group_id="g", group_size=2)
        first.call(turn(1, "a", 0, [5, 6], supports=[[5, 9], [6]], forced=[7], prompt=[1, 2], weight_version="3",
                        sample_index=0, **group))
        first.call(turn(2, "a", 1, [8], supports=[[8]], weight_version="4"))
        first.call(turn(3, "b", 0, [5], supports=[[5]], prompt=[1, 2], sample_index=1, status="truncated", **group))
        first.call(turn(4, "c", 0, [5], prompt=[3], job="other"))
        other = Peer(b.producer)
        other.call(frames("hello", producer_id="p2", seq=0))
        other.call(turn(1, "d", 0, [5], prompt=[3]))
        first.sock.close()

        again = Peer(b.producer)
        welcome, _ = again.call(frames("hello", producer_id="p1", seq=0, lists_open=True))
        assert welcome["lists_open"] is True
        listed, _ = again.call(frames("list_open", seq=1))
        assert listed["type"] == "open_list" and listed["seq"] == 1
        assert sorted(listed["trajectories"], key=lambda t: t["trajectory_id"]) == [
            {"trajectory_id": "a", "next_turn": 2, "state": "open", "group_id": "g", "group_size": 2, "sample_index": 0},
            {"trajectory_id": "b", "next_turn": 1, "state": "terminal", "group_id": "g", "group_size": 2,
             "sample_index": 1},
        ]
        header, bufs = again.call(frames("read_open", seq=2, trajectory_id="a"))
        assert header["type"] == "open_trajectory" and header["next_turn"] == 2 and header["state"] == "open"
        arrays = {name: np.frombuffer(buf, dtype=dtype) for (name, dtype, _), buf in zip(header["arrays"], bufs)}
        assert arrays["prompt_tokens"].tolist() == [1, 2]
        assert arrays["tokens"].tolist() == [5, 6, 7, 8]
        assert arrays["loss_mask"].tolist() == [1, 1, 0, 1]
        assert arrays["mask_ids"].tolist() == [5, 9, 6, 7, 8] and arrays["mask_offsets"].tolist() == [0, 2, 3, 4, 5]
        assert header["forced_spans"] == [[2, 3]]
        assert header["weight_version_spans"] == [["3", 0, 2], ["4", 3, 4]]
        refused, _ = again.call(frames("read_open", seq=3, trajectory_id="d"))
        assert (refused["type"], refused["code"], refused["seq"]) == ("nack", "unknown_trajectory", 3)

        # `b` is restarted: aborted with `again`, its group waits for it; `a` continues.
        assert again.call(frames("abort", seq=4, trajectory_id="b", reason="restart", again=True))[0]["applied"] is True
        assert again.call(turn(5, "a", 2, [9], supports=[[9]]))[0]["applied"] is True
        assert again.call(frames("end", seq=6, trajectory_id="a", reward=1.0, turns=3))[0]["applied"] is True
        assert again.call(turn(7, "b", 0, [5], supports=[[5]], prompt=[1, 2], sample_index=1, **group))[0]["applied"]
        assert again.call(frames("end", seq=8, trajectory_id="b", reward=0.0, turns=1))[0]["applied"] is True
        admin = Peer(b.admin)
        status, _ = admin.call(frames("status", seq=1))
        assert status["resumed"] == {"listed": 2, "continued": 1, "restarted": 1}
        other_job = Peer(b.producer)
        other_job.call(frames("hello", producer_id="p1", seq=0, job="other", lists_open=True))
        assert [t["trajectory_id"] for t in other_job.call(frames("list_open", seq=1))[0]["trajectories"]] == ["c"]


def test_trajectories_opened_before_a_connections_hello_are_its_producers(tmp_path):
    """Frames resent on a new connection may come before its hello (ZeroMQ
    sends what was queued as soon as it reconnects): what they opened is
    handed back to the producer the hello then names, after a broker
    restart too."""
    with BrokerProcess(tmp_path, vocab_size=1000, window=8) as b:
        peer = Peer(b.producer)
        assert peer.call(turn(1, "early", 0, [5], prompt=[1]))[0]["applied"] is True
        peer.call(frames("hello", producer_id="p1", seq=2, lists_open=True))
        assert [t["trajectory_id"] for t in peer.call(frames("list_open", seq=3))[0]["trajectories"]] == ["early"]
        b.kill()
        b.start()
        again = Peer(b.producer)
        again.call(frames("hello", producer_id="p1", seq=0, lists_open=True))
        assert [t["trajectory_id"] for t in again.call(frames("list_open", seq=1))[0]["trajectories"]] == ["early"]
