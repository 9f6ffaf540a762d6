"""Crash recovery: SIGKILL the broker while a producer and a consumer run,
restart it on the same data dir, and check that every acked trajectory is
delivered, byte for byte, and the consumer sees each one once after
deduplicating by id."""
import threading
import time

import numpy as np
import pytest
import zmq
from broker_process import BrokerProcess
from waiting import wait_for

from rollstream.common.codec import ProtocolError, decode, encode
from rollstream.common.messages import BROKER_TO_CONSUMER, BROKER_TO_PRODUCER, CONSUMER_TO_BROKER, PRODUCER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn

TRAJECTORIES, TURNS, WINDOW = 30, 3, 8


def workload(seed=0):
    """Per trajectory: prompt and turns (sampled tokens, supports, forced)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(TRAJECTORIES):
        turns = []
        for t in range(TURNS):
            n = int(rng.integers(1, 40))
            sizes = rng.integers(1, 6, size=n)
            supports = [list(rng.integers(0, 5000, size=s)) for s in sizes]
            sampled = [s[0] for s in supports]
            forced = list(rng.integers(0, 5000, size=int(rng.integers(0, 5)))) if t < TURNS - 1 else []
            turns.append((sampled, supports, forced))
        out[f"traj-{i}"] = (list(rng.integers(0, 5000, size=8)), turns)
    return out


def expected_arrays(prompt, turns):
    tokens, ids, sizes, loss = [], [], [], []
    for sampled, supports, forced in turns:
        tokens += sampled + forced
        ids += [i for s in supports for i in s] + forced
        sizes += [len(s) for s in supports] + [1] * len(forced)
        loss += [1] * len(sampled) + [0] * len(forced)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return {"prompt_tokens": prompt, "tokens": tokens, "mask_ids": ids, "mask_offsets": offsets.tolist(), "loss_mask": loss}


class Producer(threading.Thread):
    """Windowed sender that resends every unacked frame, in order, whenever
    replies stop coming (as after a broker crash), and holds each `end`
    until its trajectory's turns are settled, as docs/protocol.md asks.
    It starts no trajectory past the first `allowed` (the test raises it),
    so a kill lands before the stream ends however slow the test's thread is."""

    def __init__(self, endpoint, work):
        super().__init__(daemon=True)
        self.endpoint, self.work = endpoint, work
        self.acked_ends: set[str] = set()
        self.errors: list[str] = []
        self.allowed = len(work)

    def frames(self):
        seq = 0
        for number, (tid, (prompt, turns)) in enumerate(self.work.items()):
            for index, (sampled, supports, forced) in enumerate(turns):
                turn = Turn.build(sampled, [-0.25] * len(sampled), supports=supports, forced_tokens=forced or None)
                extra = {"prompt_tokens": np.array(prompt, np.int32)} if index == 0 else {}
                seq += 1
                yield seq, tid, encode_turn(tid, index, turn, seq=seq, **extra), False, number if index == 0 else None
            seq += 1
            end = encode(PRODUCER_TO_BROKER, "end", {"seq": seq, "trajectory_id": tid, "reward": float(len(tid))})
            yield seq, tid, end, True, None

    def run(self):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        pending: dict[int, tuple[str, list]] = {}
        source = self.frames()
        exhausted, held = False, None
        last_reply = time.monotonic()
        while not exhausted or pending:
            while not exhausted and len(pending) < WINDOW:
                item = held or next(source, None)
                if item is None:
                    exhausted = True
                    break
                seq, tid, frames, is_end, starts = item
                if starts is not None and starts >= self.allowed:  # not yet: the test has a kill to make first
                    held = item
                    break
                if is_end and any(t == tid for t, _ in pending.values()):
                    # the producer duty (docs/protocol.md): an end goes once every earlier frame of its
                    # trajectory is settled, or a turn lost in a crash could be overtaken by it
                    held = item
                    break
                held = None
                pending[seq] = (tid, frames)
                sock.send_multipart(frames)
            if sock.poll(200):
                reply = decode(sock.recv_multipart(), BROKER_TO_PRODUCER)
                last_reply = time.monotonic()
                if reply.type == "nack" and reply["code"] in ("unavailable", "out_of_order", "unknown_trajectory"):
                    # a frame (turn or end) that overtook earlier ones lost in the crash: keep it; the
                    # in-order resend puts it in place
                    continue
                if reply.type == "nack":
                    self.errors.append(f"{reply.fields}")
                entry = pending.pop(reply.get("seq"), None)
                if entry is not None and reply.type == "ack" and "turn" not in reply.fields:
                    self.acked_ends.add(entry[0])
            elif time.monotonic() - last_reply > 1.0:
                for seq in sorted(pending):  # resend everything unacked, in order
                    sock.send_multipart(pending[seq][1])
                last_reply = time.monotonic()
        sock.close()


class Consumer(threading.Thread):
    def __init__(self, endpoint):
        super().__init__(daemon=True)
        self.endpoint = endpoint
        self.deliveries: dict[str, list[dict]] = {}
        self.stop = threading.Event()

    def run(self):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)

        def hello():
            sock.send_multipart(encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "crash-test"}))
            sock.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 4, "unit": "trajectory"}))

        hello()
        next_beat = time.monotonic()
        while not self.stop.is_set():
            if time.monotonic() >= next_beat:
                sock.send_multipart(encode(CONSUMER_TO_BROKER, "heartbeat", {}))
                next_beat = time.monotonic() + 0.2
            if not sock.poll(100):
                continue
            frames = sock.recv_multipart()
            try:
                message = decode(frames, BROKER_TO_CONSUMER)
            except ProtocolError as error:
                raise AssertionError(f"corrupt delivery: {error}")
            if message.type == "nack" and message["code"] == "unknown_consumer":
                hello()
            elif message.type == "deliver":
                arrays = {name: arr.tolist() for name, arr in message.arrays.items()}
                self.deliveries.setdefault(message["trajectory_id"], []).append({"arrays": arrays, "reward": message["reward"]})
                sock.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [message["lease"]]}))
                sock.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 1, "unit": "trajectory"}))
        sock.close()


# A tiny memory budget makes the broker evict open and ready trajectories
# all the time and rebuild them from the store as frames and deliveries need.
@pytest.mark.slow
@pytest.mark.parametrize("flags", [{}, {"max_memory_bytes": 1000}], ids=["default", "tiny-memory-budget"])
def test_broker_sigkill_loses_nothing_acked(tmp_path, flags):
    work = workload()
    broker = BrokerProcess(tmp_path, lease_timeout=3.0, **flags).start()
    producer, consumer = Producer(broker.producer, work), Consumer(broker.consumer)
    producer.allowed = TRAJECTORIES // 4 + WINDOW // TURNS
    producer.start()
    consumer.start()
    try:
        for progress in (TRAJECTORIES // 4, TRAJECTORIES // 2):  # kill mid-stream, twice
            producer.allowed = progress + WINDOW // TURNS
            wait_for(lambda: len(producer.acked_ends) >= progress, 60, f"{progress} acked ends", interval=0.005)
            assert len(producer.acked_ends) < TRAJECTORIES
            broker.kill()
            time.sleep(0.2)  # down a moment, as after a crash, before it restarts (start waits until it answers)
            broker.start()
        producer.allowed = TRAJECTORIES
        producer.join(60)
        assert not producer.is_alive(), "producer did not finish"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(consumer.deliveries) < TRAJECTORIES:
            time.sleep(0.1)
    finally:
        consumer.stop.set()
        consumer.join(10)
        broker.terminate()
    assert producer.errors == []
    assert producer.acked_ends == set(work)
    assert set(consumer.deliveries) == set(work), f"missing: {set(work) - set(consumer.deliveries)}"
    for tid, (prompt, turns) in work.items():
        expected = expected_arrays(prompt, turns)
        copies = consumer.deliveries[tid]
        for copy in copies:  # redeliveries, if any, are byte-identical
            for name, values in expected.items():
                assert copy["arrays"][name] == list(map(int, values)), (tid, name)
            assert copy["reward"] == float(len(tid))
    assert broker.proc.returncode == 0
