"""The producer's cheap path and its API: numpy arrays taken without copies,
batched acknowledgements (against a scripted broker), a handle that stays
usable after a refusal, the one-step `*_and_wait` forms, local content
checks on request, a blocking client that does not wait for its I/O thread,
and refusals logged with the trajectory and the code in the text."""
import asyncio
import logging
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from test_producer_live import PATIENCE, Broker, drain

from rollstream.common.codec import decode, split_batch
from rollstream.common.messages import PRODUCER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn
from rollstream.producer import AsyncProducer, Producer, Receipt, Refused

TOKENS = np.array([17, 4, 9], dtype=np.int32)
MASK_IDS = np.array([17, 3, 4, 9, 12, 30], dtype=np.int32)  # supports [17, 3], [4], [9, 12, 30]
MASK_OFFSETS = np.array([0, 2, 3, 6], dtype=np.int64)
LOG_PROBS = np.array([-0.4, 0.0, -1.2], dtype=np.float32)
LOSS_MASK = np.array([1, 1, 0], dtype=np.uint8)


def numpy_turn(**extra):
    return dict(mask_ids=MASK_IDS, mask_offsets=MASK_OFFSETS, loss_mask=LOSS_MASK, **extra)


# -- arrays in -------------------------------------------------------------------------------
def test_contract_dtype_arrays_are_borrowed_and_framed_without_copies():
    turn = Turn.build(TOKENS, LOG_PROBS, borrow=True, **numpy_turn())
    assert turn.tokens is TOKENS and turn.log_probs is LOG_PROBS and turn.loss_mask is LOSS_MASK
    assert np.shares_memory(turn.mask.ids, MASK_IDS) and np.shares_memory(turn.mask.offsets, MASK_OFFSETS)
    frames = encode_turn("t", 1, turn, seq=1)
    names = [entry[0] for entry in msgpack.unpackb(frames[0])["arrays"]]
    sources = {"tokens": TOKENS, "log_probs": LOG_PROBS, "loss_mask": LOSS_MASK, "mask_ids": MASK_IDS,
               "mask_offsets": MASK_OFFSETS}
    for name, frame in zip(names, frames[1:]):
        assert np.shares_memory(np.frombuffer(frame, np.uint8), sources[name]), name
    copied = Turn.build(TOKENS, LOG_PROBS, **numpy_turn())  # without borrow, the turn owns copies
    assert not np.shares_memory(copied.tokens, TOKENS) and not np.shares_memory(copied.mask.ids, MASK_IDS)


def test_csr_arrays_build_the_turn_the_supports_lists_build():
    supports = [[17, 3], [4], [9, 12, 30]]
    from_arrays = Turn.build(TOKENS, LOG_PROBS, mask_ids=MASK_IDS, mask_offsets=MASK_OFFSETS, borrow=True)
    from_lists = Turn.build(TOKENS.tolist(), LOG_PROBS.tolist(), supports=supports)
    for name in ("tokens", "log_probs", "mask_ids", "mask_offsets"):
        a, b = from_arrays.arrays()[name], from_lists.arrays()[name]
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name


def test_the_structure_of_a_turn_is_always_checked_and_its_content_only_on_request():
    with pytest.raises(ValueError, match="mask_offsets has 3 entries, expected 4"):
        Turn.build(TOKENS, LOG_PROBS, mask_ids=MASK_IDS, mask_offsets=MASK_OFFSETS[:3], check_content=False)
    with pytest.raises(ValueError, match=r"offsets\[-1\] == len\(ids\)"):
        Turn.build(TOKENS, LOG_PROBS, mask_ids=MASK_IDS[:5], mask_offsets=MASK_OFFSETS, check_content=False)
    with pytest.raises(ValueError, match="log_probs has 2 entries, tokens has 3"):
        Turn.build(TOKENS, LOG_PROBS[:2], check_content=False)
    outside = np.array([17, 5, 9], dtype=np.int32)  # 5 is not in the support [4]
    Turn.build(outside, LOG_PROBS, mask_ids=MASK_IDS, mask_offsets=MASK_OFFSETS, check_content=False)
    with pytest.raises(ValueError, match="sampled token inside its support"):
        Turn.build(outside, LOG_PROBS, mask_ids=MASK_IDS, mask_offsets=MASK_OFFSETS)
    with pytest.raises(ValueError, match="give the support once"):
        Turn.build(TOKENS, LOG_PROBS, supports=[[17], [4], [9]], mask_ids=MASK_IDS, mask_offsets=MASK_OFFSETS)
    with pytest.raises(ValueError, match="travel together"):
        Turn.build(TOKENS, LOG_PROBS, mask_ids=MASK_IDS)


# -- batched acknowledgements, against a scripted broker ---------------------------------------
class ScriptedBroker:
    """A ROUTER on inproc that answers hello and acknowledges by script."""

    def __init__(self, context, endpoint):
        self.sock = context.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.identity = self.hello = None

    def receive(self):
        assert self.sock.poll(int(PATIENCE * 1000)), "the producer sent nothing"
        identity, *frames = self.sock.recv_multipart()
        self.last_frame_count = len(frames)
        return identity, decode(frames, PRODUCER_TO_BROKER, check_content=False)

    def handshake(self, **welcome):
        self.identity, self.hello = self.receive()
        self.reply("welcome", broker_id="scripted", max_message_bytes=1 << 20, window=64, batch_acks=True, **welcome)

    async def welcomed(self, producer, **welcome):
        """Once the producer has read the welcome (its window is granted)."""
        self.handshake(**welcome)
        deadline = time.monotonic() + PATIENCE
        while producer.window < 64:
            assert time.monotonic() < deadline, "the producer never read the welcome"
            await asyncio.sleep(0.001)

    def frames(self, count):
        got = []
        while len(got) < count:
            _, message = self.receive()
            if message.type != "ping":
                got.append(message)
        return got

    def reply(self, mtype, **fields):
        self.sock.send_multipart([self.identity, msgpack.packb({"v": 1, "type": mtype, **fields})])


def test_the_library_asks_for_batched_acks_and_settles_each_frame_from_them():
    context = zmq.Context()
    broker = ScriptedBroker(context, "inproc://scripted-acks")

    async def main():
        async with AsyncProducer("inproc://scripted-acks", "p-batched", context=context) as producer:
            broker.handshake()
            traj = producer.trajectory("t", [1, 2])
            futures = [await traj.turn(TOKENS, LOG_PROBS, **numpy_turn()) for _ in range(3)]
            futures.append(await traj.end(1.0))
            turns = await asyncio.to_thread(broker.frames, 3)
            seqs = [m["seq"] for m in turns]
            broker.reply("acks", ranges=[[seqs[0], seqs[2]]],
                         outcomes=[{"seq": seqs[1], "applied": False, "reason": "replay_gap"}])
            (end,) = await asyncio.to_thread(broker.frames, 1)  # sent only once its turns are settled
            broker.reply("acks", ranges=[[end["seq"], end["seq"]]])
            return [await f for f in futures], [m["turn"] for m in turns], end

    receipts, turn_indices, end = asyncio.run(main())
    context.destroy(linger=0)
    assert broker.hello.fields == {"producer_id": "p-batched", "batch_acks": True, "batch_frames": True,
                                   "reads_branch": True, "lists_open": True}
    assert turn_indices == [0, 1, 2] and end["turns"] == 3
    assert [(r.kind, r.turn, r.applied, r.reason) for r in receipts] == [
        ("turn", 0, True, None), ("turn", 1, False, "replay_gap"), ("turn", 2, True, None), ("end", None, True, None)]


LONG = 8192  # tokens: 8192 * (4 + 4 + 1 + 4 + 8) bytes of arrays, past the 64 KiB that are packed


@pytest.mark.parametrize("pack_arrays,tokens,packed", [(True, 3, True), (False, 3, False), (True, LONG, False)])
def test_small_turns_go_packed_in_one_frame_unless_asked_not_to(pack_arrays, tokens, packed):
    context = zmq.Context()
    endpoint = f"inproc://scripted-pack-{pack_arrays}-{tokens}"
    broker = ScriptedBroker(context, endpoint)
    ids = np.arange(tokens, dtype=np.int32)
    arrays = dict(mask_ids=ids, mask_offsets=np.arange(tokens + 1, dtype=np.int64),
                  loss_mask=np.ones(tokens, np.uint8))

    async def main():
        async with AsyncProducer(endpoint, "p-pack", context=context, pack_arrays=pack_arrays) as producer:
            broker.handshake()
            await producer.trajectory("t", [1, 2]).turn(ids, np.zeros(tokens, np.float32), **arrays)
            (turn,) = await asyncio.to_thread(broker.frames, 1)
            broker.reply("acks", ranges=[[turn["seq"], turn["seq"]]])
            await producer.flush()
            return turn

    turn = asyncio.run(main())
    context.destroy(linger=0)
    assert broker.last_frame_count == (2 if packed else 1 + len(turn.arrays))
    assert turn.arrays["mask_ids"].tolist() == ids.tolist() and turn.arrays["tokens"].tolist() == ids.tolist()
    assert turn.arrays["prompt_tokens"].tolist() == [1, 2]


# -- against a live broker -----------------------------------------------------------------
@pytest.mark.slow
def test_a_refused_turn_rewinds_the_handle_so_the_corrected_turn_goes_under_its_index(tmp_path, caplog):
    async def main(broker):
        async with AsyncProducer(broker.endpoints["producer"], "p-rewind") as producer:
            traj = producer.trajectory("t-rewind", [1, 2])
            first = await traj.turn_and_wait(TOKENS, LOG_PROBS, **numpy_turn())
            bad = np.array([17, 4, 5000], dtype=np.int32)  # the broker knows vocab_size=1000
            bad_ids = np.array([17, 3, 4, 5000, 12, 30], dtype=np.int32)
            with caplog.at_level(logging.WARNING, logger="rollstream.producer"):
                with pytest.raises(Refused) as refused:
                    await traj.turn_and_wait(bad, LOG_PROBS, mask_ids=bad_ids, mask_offsets=MASK_OFFSETS)
            rewound = traj.next_turn
            fixed = await traj.turn_and_wait(TOKENS, LOG_PROBS, **numpy_turn())
            end = await traj.end_and_wait(1.0)
            return first, refused.value, rewound, fixed, end

    with Broker(tmp_path, "--vocab-size", "1000") as broker:
        first, refused, rewound, fixed, end = asyncio.run(main(broker))
        got, _ = drain(broker, 1)
    assert (refused.code, refused.turn) == ("out_of_vocab", 1) and rewound == 1
    assert isinstance(first, Receipt) and (fixed.turn, fixed.applied) == (1, True) and end.applied
    assert got["t-rewind"].tokens.tolist() == [17, 4, 9, 17, 4, 9] and got["t-rewind"].turns == 2
    line = next(r.getMessage() for r in caplog.records if "refused" in r.getMessage())
    assert "'t-rewind'" in line and "turn 1" in line and "out_of_vocab" in line


def test_content_is_checked_at_the_call_only_when_asked(tmp_path):
    outside = np.array([17, 5, 9], dtype=np.int32)

    async def main(broker):
        async with AsyncProducer(broker.endpoints["producer"], "p-strict", check_content=True) as strict:
            traj = strict.trajectory("t-strict", [1])
            with pytest.raises(ValueError, match="sampled token inside its support"):
                await traj.turn(outside, LOG_PROBS, **numpy_turn())
            assert traj.next_turn == 0 and strict.unsettled == 0  # nothing was sent
        async with AsyncProducer(broker.endpoints["producer"], "p-default") as producer:
            traj = producer.trajectory("t-default", [1])
            with pytest.raises(Refused) as refused:
                await traj.turn_and_wait(outside, LOG_PROBS, **numpy_turn())
            return refused.value

    with Broker(tmp_path) as broker:
        refused = asyncio.run(main(broker))
    assert refused.code == "mask_invalid" and "token 1" in refused.message


@pytest.mark.slow
def test_a_blocking_send_does_not_wait_for_the_io_thread(tmp_path):
    """With the producer's event loop held up, a send still returns its
    future at once: it never waits on the loop. The frame goes out when the
    loop runs again."""
    with Broker(tmp_path) as broker:
        with Producer(broker.endpoints["producer"], "p-nohop") as producer:
            traj = producer.trajectory("t-nohop", [1, 2])
            assert traj.turn_and_wait(TOKENS, LOG_PROBS, timeout=PATIENCE, **numpy_turn()).applied
            held, release = threading.Event(), threading.Event()

            def hold():
                held.set()
                release.wait(10.0)  # a send that waits for the loop would wait this long, then find its frame sent

            producer._loop.call_soon_threadsafe(hold)
            assert held.wait(PATIENCE)
            try:
                futures = [traj.turn(TOKENS, LOG_PROBS, **numpy_turn()) for _ in range(3)]
                futures.append(traj.end(2.0))
                assert not any(f.done() for f in futures) and traj.next_turn == 4
            finally:
                release.set()
            receipts = [f.result(PATIENCE) for f in futures]
            assert traj.end_and_wait(2.0, timeout=PATIENCE).duplicate  # the same end again: idempotent
        got, _ = drain(broker, 1)
    assert all(r.applied for r in receipts) and got["t-nohop"].turns == 4


def test_a_blocking_send_times_out_when_there_is_no_room():
    context = zmq.Context()
    with Producer("inproc://nobody-listens", "p-full", window=1, context=context) as producer:
        traj = producer.trajectory("t-full", [1])
        traj.turn(TOKENS, LOG_PROBS, **numpy_turn())  # holds the one place in the window
        with pytest.raises(TimeoutError, match="no room"):
            traj.turn(TOKENS, LOG_PROBS, timeout=0.2, **numpy_turn())
        producer.close(timeout=0.1)
    context.destroy(linger=0)


def test_turns_accepted_without_yielding_go_out_a_burst_at_a_time_or_when_the_loop_runs():
    context = zmq.Context()
    broker = ScriptedBroker(context, "inproc://scripted-burst")

    async def main():
        async with AsyncProducer("inproc://scripted-burst", "p-burst", send_burst=3, context=context) as producer:
            await broker.welcomed(producer)
            traj = producer.trajectory("t", [1])
            sent = []
            for _ in range(4):  # no await below yields: room is there
                await traj.turn(TOKENS, LOG_PROBS, **numpy_turn())
                sent.append(producer.metrics.totals.get("frames_sent.turn", 0))
            await asyncio.sleep(0)  # the loop runs: the fourth goes too
            sent.append(producer.metrics.totals.get("frames_sent.turn", 0))
            got = await asyncio.to_thread(broker.frames, 4)
            broker.reply("acks", ranges=[[got[0]["seq"], got[-1]["seq"]]])
            await producer.flush(PATIENCE)
            return sent, [m["turn"] for m in got]

    sent, turns = asyncio.run(main())
    context.destroy(linger=0)
    assert sent == [0, 0, 3, 3, 4] and turns == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="send_burst must be at least 1"):
        AsyncProducer("inproc://x", "p", send_burst=0)


def test_small_frames_ready_together_go_as_one_batch_once_the_broker_says_it_reads_them():
    """Welcomed with `batch_frames`, the producer sends a burst of small
    turns as one batch (the large turn alone, unjoined); each carried
    message is the frame it would have sent alone. A frame ready alone
    goes as itself."""
    context = zmq.Context()
    broker = ScriptedBroker(context, "inproc://scripted-batch")
    ids = np.arange(LONG, dtype=np.int32)
    large = dict(mask_ids=ids, mask_offsets=np.arange(LONG + 1, dtype=np.int64), loss_mask=np.ones(LONG, np.uint8))

    def received(count):
        """The next `count` messages other than pings, with their frame counts."""
        got = []
        while len(got) < count:
            _, message = broker.receive()
            if message.type != "ping":
                got.append((message, broker.last_frame_count))
        return got

    async def main():
        async with AsyncProducer("inproc://scripted-batch", "p-batch", send_burst=4, context=context) as producer:
            await broker.welcomed(producer, batch_frames=True)
            small = producer.trajectory("s", [1])
            for _ in range(3):
                await small.turn(TOKENS, LOG_PROBS, **numpy_turn())
            await producer.trajectory("l", [1]).turn(ids, np.zeros(LONG, np.float32), **large)  # the 4th: a burst
            burst = await asyncio.to_thread(received, 2)
            broker.reply("acks", ranges=[[burst[1][0]["seq"] - 3, burst[1][0]["seq"]]])
            await small.end(1.0)  # nothing else is ready: it goes as itself
            (end, _), = await asyncio.to_thread(received, 1)
            broker.reply("acks", ranges=[[end["seq"], end["seq"]]])
            await producer.flush(PATIENCE)
            return burst, end

    ((batch, batch_frames), (large_turn, large_frames)), end = asyncio.run(main())
    context.destroy(linger=0)
    assert batch.type == "batch" and batch_frames == 2
    carried = [decode(frames, PRODUCER_TO_BROKER) for frames in split_batch(batch)]
    first = carried[0]["seq"]
    assert [(m.type, m["trajectory_id"], m["turn"], m["seq"]) for m in carried] == [
        ("turn", "s", 0, first), ("turn", "s", 1, first + 1), ("turn", "s", 2, first + 2)]
    assert all(m.arrays["mask_ids"].tolist() == MASK_IDS.tolist() for m in carried)
    assert large_turn.type == "turn" and large_turn["seq"] == first + 3 and large_frames == 1 + len(large_turn.arrays)
    assert end.type == "end" and end["turns"] == 3
