"""Fuzzing a live broker: at least 10,000 malformed frames on each
of its three sockets, interleaved with valid traffic. The broker must stay
up, answer every bad frame with the nack protocol.md gives it, deliver the
valid trajectories once each with the arrays this test sent, and still
answer `status`. The frames and their expected replies come from
`fuzz_frames`, written from the protocol page alone."""
from collections import Counter

import msgpack
import numpy as np
import pytest
from broker_process import BrokerProcess
from faults.fuzz_frames import (
    AdminFuzz,
    ConsumerFuzz,
    Expect,
    Message,
    ProducerFuzz,
    Taker,
    exchange,
    peer,
    receive,
    with_deep_metadata,
)

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


def receive_reply(sock, frames, broker):
    sock.send_multipart(frames)
    return checked(broker, receive, sock, REPLY_WAIT_MS)[0]


def checked(broker, call, *args):
    """`call`, with the broker's state and log when it timed out waiting."""
    try:
        return call(*args)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; broker alive: {broker.proc.poll() is None}\n{broker.log()[-3000:]}") from None


def send_all(sock, chunk, broker, failures):
    failures += checked(broker, exchange, sock, chunk, REPLY_WAIT_MS)
    assert broker.proc.poll() is None, f"the broker died:\n{broker.log()[-3000:]}"


def count(chunk, kind):
    return sum(e.type == kind for sent in chunk for e in sent.expects)


def nacks_counted(status, endpoint):
    prefix = f"nacks.{endpoint}."
    return sum(value for key, value in status["counters"].items() if key.startswith(prefix))


def assert_exactly_once(taker):
    """Every expected trajectory delivered once, as sent, its ack confirmed."""
    taker.wait_for(taker.expected)
    assert not taker.failures, "\n".join(taker.failures[:20])
    missing = sorted(taker.expected.keys() - taker.delivered.keys())
    assert not missing, f"{len(missing)} valid trajectories never delivered, e.g. {missing[:5]}"
    twice = [tid for tid, n in taker.delivered.items() if n > 1]
    assert not twice, f"delivered more than once: {twice[:5]}"
    assert taker.confirmed == taker.expected.keys() and taker.hellos == 1


def assert_healthy(broker, failures, endpoint, nacks_before, nacks_sent):
    assert not failures, f"{len(failures)} frames answered wrongly:\n" + "\n".join(failures[:20])
    assert broker.proc.poll() is None, broker.log()[-3000:]
    status = broker.status()
    assert (status["open"], status["queued"], status["leased"], status["dead"]) == (0, 0, 0, 0), status
    assert nacks_counted(status, endpoint) - nacks_before == nacks_sent


def test_producer_socket_fuzz(broker):
    """Bad turns, ends and batches from a producer that said hello, among its
    valid frames (some in the same batches), while a second producer that
    never said hello sends only valid ones (protocol.md §3 allows it)."""
    fuzz = ProducerFuzz(1401, VOCAB, MAX_MESSAGE_BYTES, prefix="p")
    quiet = ProducerFuzz(1402, VOCAB, MAX_MESSAGE_BYTES, prefix="q", valid_share=1.0)
    taker = Taker(broker.consumer, "taker", fuzz.expected, quiet.expected, wait_ms=REPLY_WAIT_MS)
    noisy, silent = peer(broker.producer), peer(broker.producer)
    noisy.send_multipart([msgpack.packb({"v": 1, "type": "hello", "producer_id": "fuzz", "batch_frames": True})])
    assert checked(broker, receive, noisy, REPLY_WAIT_MS)[0]["batch_frames"] is True
    before = nacks_counted(broker.status(), "producer")
    failures, bad, kinds = [], 0, Counter()
    while bad < BAD_FRAMES:
        chunk = [fuzz.next() for _ in range(CHUNK)]
        send_all(noisy, chunk, broker, failures)
        send_all(silent, [quiet.next() for _ in range(CHUNK // 10)], broker, failures)
        bad += count(chunk, "nack")
        kinds.update(sent.kind for sent in chunk)
        taker.drain()
    send_all(noisy, fuzz.finish(), broker, failures)
    send_all(silent, quiet.finish(), broker, failures)
    assert_exactly_once(taker)
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
    taker = Taker(broker.consumer, "taker", traffic.expected, wait_ms=REPLY_WAIT_MS)
    producer, stranger = peer(broker.producer), peer(broker.consumer)
    before = nacks_counted(broker.status(), "consumer")
    failures, bad, exact, wild = [], 0, Counter(), 0
    while bad < BAD_FRAMES:
        chunk = [fuzz.stranger() for _ in range(CHUNK)]
        send_all(stranger, chunk, broker, failures)
        bad += count(chunk, "nack")
        for sent in [fuzz.known() for _ in range(CHUNK // 5)]:
            taker.sock.send_multipart(sent.frames)
            (expect,) = sent.expects
            if len(expect.codes) == 1:
                exact.update(expect.codes)
            else:
                wild += 1
            bad += 1
        send_all(producer, [traffic.next() for _ in range(CHUNK // 10)], broker, failures)
        taker.drain(wait_ms=10)
    send_all(producer, traffic.finish(), broker, failures)
    assert_exactly_once(taker)
    while len(taker.others) < sum(exact.values()) + wild and taker.sock.poll(REPLY_WAIT_MS):
        taker.drain()
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
        send_all(admin, chunk, broker, failures)
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
    assert broker.status()["queued"] == 1


def test_expect_rejects_wrong_replies():
    """The checker itself: a wrong code, type, seq or a silent nack is a problem."""
    expect = Expect("nack", 3, frozenset({"schema"}))
    assert expect.problem({"type": "nack", "code": "schema", "message": "x", "seq": 3}) is None
    for reply in ({"type": "nack", "code": "shape", "message": "x", "seq": 3}, {"type": "ack", "seq": 3, "applied": True},
                  {"type": "nack", "code": "schema", "message": "x"}, {"type": "nack", "code": "schema", "seq": 3}):
        assert expect.problem(reply)
