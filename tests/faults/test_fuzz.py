"""Fuzzing a live broker (issue 14): at least 10,000 malformed frames on each
of its three sockets, interleaved with valid traffic. The broker must stay
up, answer every bad frame with the nack protocol.md gives it, deliver the
valid trajectories once each with the arrays this test sent, and still
answer `status`. The frames and their expected replies come from
`fuzz_frames`, written from the protocol page alone."""
import zlib
from collections import ChainMap, Counter

import msgpack
import numpy as np
import pytest
import zmq
from broker_process import BrokerProcess
from faults.fuzz_frames import (CONTRACT, NUMPY, AdminFuzz, ConsumerFuzz, Expect, Message, ProducerFuzz,
                                with_deep_metadata)

VOCAB = 1000
MAX_MESSAGE_BYTES = 64 << 10
BAD_FRAMES = 10_000  # per socket
CHUNK = 250  # messages sent before their replies are read: well under every queue's bound
REPLY_WAIT_MS = 20_000


@pytest.fixture
def broker(tmp_path):
    with BrokerProcess(tmp_path, vocab_size=VOCAB, max_message_bytes=MAX_MESSAGE_BYTES, heartbeat_interval=2,
                       log_level="error") as b:
        yield b


def peer(endpoint):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def receive(sock, broker):
    """The next reply's header (a REQ envelope stripped), failing when the
    broker died or said nothing."""
    if not sock.poll(REPLY_WAIT_MS):
        alive = broker.proc.poll() is None
        raise AssertionError(f"no reply within {REPLY_WAIT_MS} ms; broker alive: {alive}\n{broker.log()[-3000:]}")
    frames = sock.recv_multipart()
    if len(frames) > 1 and frames[0] == b"":
        frames = frames[1:]
    return msgpack.unpackb(frames[0]), frames[1:]


def exchange(sock, chunk, broker, failures):
    """Send a chunk, then read its replies: on one connection the broker
    answers in the order it read (a batch by its messages' order)."""
    for sent in chunk:
        sock.send_multipart(sent.frames)
    for sent in chunk:
        for expect in sent.expects:
            problem = expect.problem(receive(sock, broker)[0])
            if problem:
                failures.append(f"{sent.kind}: {problem}")
    assert broker.proc.poll() is None, f"the broker died:\n{broker.log()[-3000:]}"


def count(chunk, kind):
    return sum(e.type == kind for sent in chunk for e in sent.expects)


def nacks_counted(status, endpoint):
    prefix = f"nacks.{endpoint}."
    return sum(value for key, value in status["counters"].items() if key.startswith(prefix))


class Taker:
    """A raw consumer: takes deliveries, checks each against the trajectory
    the test sent, acks it, and keeps any other reply."""

    def __init__(self, broker, name, *expected):
        self.broker, self.expected = broker, ChainMap(*expected)  # the fuzzers' records, growing as they send
        self.sock = peer(broker.consumer)
        self.sock.send_multipart([msgpack.packb({"v": 1, "type": "hello", "consumer_id": name, "packed_arrays": True})])
        assert receive(self.sock, broker)[0]["type"] == "welcome"
        self.sock.send_multipart([msgpack.packb({"v": 1, "type": "credit", "n": 10_000, "unit": "trajectory"})])
        self.delivered: Counter = Counter()
        self.acked: set = set()
        self.others: list = []
        self.failures: list = []

    def drain(self, wait_ms=0):
        while self.sock.poll(wait_ms):
            header, bufs = receive(self.sock, self.broker)
            if header["type"] == "deliver":
                self.check(header, bufs)
                self.sock.send_multipart([msgpack.packb({"v": 1, "type": "ack", "leases": [header["lease"]]})])
            elif header["type"] == "acked":
                self.acked.update(header["leases"])
            else:
                self.others.append(header)
            wait_ms = 0

    def check(self, header, bufs):
        tid = header["trajectory_id"]
        self.delivered[tid] += 1
        traj = self.expected.get(tid)
        if traj is None:
            self.failures.append(f"delivered {tid!r}, which no valid traffic sent")
            return
        if header["crc32"] != zlib.crc32(b"".join(bufs)):
            self.failures.append(f"{tid}: crc32 of the delivery does not match its frames")
        arrays = unpack(header, bufs)
        for name in traj.arrays.keys() | arrays.keys():
            want = traj.arrays.get(name)
            got = arrays.get(name)
            if want is None or got is None or got.tobytes() != np.asarray(want, NUMPY[CONTRACT[name]]).tobytes():
                self.failures.append(f"{tid}: {name} delivered {got!r:.200}, sent {want!r:.200}")
        fields = (header["reward"], header["turns"], header["status"], header["response_length"], header["delivery_count"])
        if fields != (traj.reward, traj.turns, "completed", len(traj.arrays["tokens"]), 1):
            self.failures.append(f"{tid}: delivered reward, turns, status, length, count {fields}")

    def wait_for_all(self):
        """Deliveries until every expected trajectory came (or the broker
        sends nothing for a while), then the acks' confirmations."""
        while self.delivered.keys() < self.expected.keys() and self.sock.poll(REPLY_WAIT_MS):
            self.drain()
        while len(self.acked) < sum(self.delivered.values()) and self.sock.poll(REPLY_WAIT_MS):
            self.drain()

    def assert_exactly_once(self):
        assert not self.failures, "\n".join(self.failures[:20])
        missing = sorted(self.expected.keys() - self.delivered.keys())
        assert not missing, f"{len(missing)} valid trajectories never delivered, e.g. {missing[:5]}"
        twice = [tid for tid, n in self.delivered.items() if n > 1]
        assert not twice, f"delivered more than once: {twice[:5]}"
        assert len(self.acked) == len(self.expected), "every ack confirmed"


def unpack(header, bufs):
    """The arrays of a delivery, one frame per array or packed (protocol.md §2)."""
    if header.get("packed"):
        whole, bufs, start = bufs[0], [], 0
        for _, dtype, shape in header["arrays"]:
            end = start + np.dtype(NUMPY[dtype]).itemsize * int(np.prod(shape))
            bufs.append(whole[start:end])
            start = end
    return {name: np.frombuffer(buf, NUMPY[dtype]) for (name, dtype, _), buf in zip(header["arrays"], bufs)}


def assert_healthy(broker, failures, endpoint, nacks_before, nacks_sent):
    assert not failures, f"{len(failures)} frames answered wrongly:\n" + "\n".join(failures[:20])
    assert broker.proc.poll() is None, broker.log()[-3000:]
    status = broker.status()
    assert (status["open"], status["ready"], status["leased"], status["dead"]) == (0, 0, 0, 0), status
    assert nacks_counted(status, endpoint) - nacks_before == nacks_sent


def test_producer_socket_fuzz(broker):
    """Bad turns, ends and batches from a producer that said hello, among its
    valid frames (some in the same batches), while a second producer that
    never said hello sends only valid ones (protocol.md §3 allows it)."""
    fuzz = ProducerFuzz(1401, VOCAB, MAX_MESSAGE_BYTES, prefix="p")
    quiet = ProducerFuzz(1402, VOCAB, MAX_MESSAGE_BYTES, prefix="q", valid_share=1.0)
    taker = Taker(broker, "taker", fuzz.expected, quiet.expected)
    noisy, silent = peer(broker.producer), peer(broker.producer)
    noisy.send_multipart([msgpack.packb({"v": 1, "type": "hello", "producer_id": "fuzz", "batch_frames": True})])
    assert receive(noisy, broker)[0]["batch_frames"] is True
    before = nacks_counted(broker.status(), "producer")
    failures, bad, kinds = [], 0, Counter()
    while bad < BAD_FRAMES:
        chunk = [fuzz.next() for _ in range(CHUNK)]
        exchange(noisy, chunk, broker, failures)
        exchange(silent, [quiet.next() for _ in range(CHUNK // 10)], broker, failures)
        bad += count(chunk, "nack")
        kinds.update(sent.kind for sent in chunk)
        taker.drain()
    exchange(noisy, fuzz.finish(), broker, failures)
    exchange(silent, quiet.finish(), broker, failures)
    taker.wait_for_all()
    taker.assert_exactly_once()
    assert not taker.others, taker.others[:5]
    assert len(quiet.expected) > 50 and len(fuzz.expected) > 200
    assert_healthy(broker, failures, "producer", before, bad)
    assert {"random_bytes", "flipped_header", "frame_missing", "wrong_dtype", "csr_token_outside", "oversize",
            "deep_header", "batch_mixed", "batch_short_body", "turn_out_of_order"} <= kinds.keys(), kinds


def test_consumer_socket_fuzz(broker):
    """Bad frames from a connection that never said hello (well-formed ones
    too: `unknown_consumer`), and rule-breaking frames from the live
    consumer that takes the valid trajectories meanwhile."""
    traffic = ProducerFuzz(1403, VOCAB, MAX_MESSAGE_BYTES, prefix="c", valid_share=1.0)
    fuzz = ConsumerFuzz(1404, VOCAB, MAX_MESSAGE_BYTES, prefix="c")
    taker = Taker(broker, "taker", traffic.expected)
    producer, stranger = peer(broker.producer), peer(broker.consumer)
    before = nacks_counted(broker.status(), "consumer")
    failures, bad, exact, wild = [], 0, Counter(), 0
    while bad < BAD_FRAMES:
        chunk = [fuzz.stranger() for _ in range(CHUNK)]
        exchange(stranger, chunk, broker, failures)
        bad += count(chunk, "nack")
        for sent in [fuzz.known() for _ in range(CHUNK // 5)]:
            taker.sock.send_multipart(sent.frames)
            (expect,) = sent.expects
            if len(expect.codes) == 1:
                exact.update(expect.codes)
            else:
                wild += 1
            bad += 1
        exchange(producer, [traffic.next() for _ in range(CHUNK // 10)], broker, failures)
        taker.drain(wait_ms=10)
    exchange(producer, traffic.finish(), broker, failures)
    taker.wait_for_all()
    while len(taker.others) < sum(exact.values()) + wild and taker.sock.poll(REPLY_WAIT_MS):
        taker.drain()
    taker.assert_exactly_once()
    got = Counter(reply["code"] for reply in taker.others if reply["type"] == "nack")
    assert len(taker.others) == sum(got.values()) == sum(exact.values()) + wild, taker.others[:5]
    assert not exact - got, f"codes the live consumer's bad frames lacked: {exact - got}"
    assert_healthy(broker, failures, "consumer", before, bad)


def test_admin_socket_fuzz(broker):
    """Bad requests, some behind a REQ peer's empty delimiter, among valid
    ones: every request answered once, in order."""
    fuzz = AdminFuzz(1405, VOCAB, MAX_MESSAGE_BYTES, prefix="a")
    admin = peer(broker.admin)
    before = nacks_counted(broker.status(), "admin")
    failures, bad, valid = [], 0, 0
    while bad < BAD_FRAMES:
        chunk = [fuzz.next() for _ in range(CHUNK)]
        exchange(admin, chunk, broker, failures)
        bad += count(chunk, "nack")
        valid += len(chunk) - sum(sent.bad for sent in chunk)
    assert valid > 500
    assert_healthy(broker, failures, "admin", before, bad)


def test_regressions_found_by_the_fuzz(broker):
    """Each of these once killed the broker or was answered against
    protocol.md; one frame of each, then the broker must still work."""
    producer, consumer, admin = peer(broker.producer), peer(broker.consumer), peer(broker.admin)
    opened = Message("turn", {"seq": 1, "trajectory_id": "r", "turn": 0, "status": "completed"},
                     {"tokens": np.array([5], np.int32), "log_probs": np.array([-1.0], np.float32),
                      "prompt_tokens": np.array([1], np.int32)})
    assert receive_reply(producer, opened.frames(), broker)["type"] == "ack"
    end = [msgpack.packb({"v": 1, "type": "end", "seq": 2, "trajectory_id": "r", "reward": 1.0})]
    reply = receive_reply(producer, with_deep_metadata(end, 600), broker)  # RecursionError in content_digest
    assert (reply["code"], "seq" in reply) == ("malformed", False), reply
    assert "at most 32 levels deep, this one nests 601" in reply["message"]
    for key, value in (("sample_index", 2**64 - 1), ("group_size", 2**63)):  # OverflowError in the SQLite commit
        group = {"group_id": "g"} if key == "group_size" else {}
        huge = Message("turn", dict(opened.header, trajectory_id=key, **group, **{key: value}), opened.arrays)
        reply = receive_reply(producer, huge.frames(), broker)
        assert (reply["code"], reply["seq"]) == ("schema", 1), reply
        assert f"{key} must be a" in reply["message"] and "below 2**63" in reply["message"] and str(value) in reply["message"]
    reply = receive_reply(consumer, [msgpack.packb({"v": 1, "type": "credit", "n": 1, "unit": "group", "seq": 9})], broker)
    assert (reply["code"], reply.get("seq")) == ("unknown_consumer", 9), reply  # the seq was dropped
    padded = [msgpack.packb({"v": 1, "type": "status", "seq": 3, "padding": bytes(MAX_MESSAGE_BYTES)})]
    reply = receive_reply(admin, padded, broker)  # was answered with a status
    assert (reply["type"], reply["code"], reply["seq"]) == ("nack", "too_large", 3), reply
    assert receive_reply(producer, end, broker)["applied"] is True
    assert broker.status()["ready"] == 1


def receive_reply(sock, frames, broker):
    sock.send_multipart(frames)
    return receive(sock, broker)[0]


def test_expect_rejects_wrong_replies():
    """The checker itself: a wrong code, type, seq or a silent nack is a problem."""
    expect = Expect("nack", 3, frozenset({"schema"}))
    assert expect.problem({"type": "nack", "code": "schema", "message": "x", "seq": 3}) is None
    for reply in ({"type": "nack", "code": "shape", "message": "x", "seq": 3}, {"type": "ack", "seq": 3, "applied": True},
                  {"type": "nack", "code": "schema", "message": "x"}, {"type": "nack", "code": "schema", "seq": 3}):
        assert expect.problem(reply)
