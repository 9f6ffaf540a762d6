"""Bad input on every socket, a full disk, budgets, shutdown and settings,
against a live broker subprocess."""
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
from broker_process import BrokerProcess

from rollstream.broker.service import BrokerService
from rollstream.broker.settings import BrokerSettings
from rollstream.common.codec import decode, encode
from rollstream.common.messages import (
    ADMIN_REPLIES,
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    CONSUMER_TO_BROKER,
    PRODUCER_TO_BROKER,
)
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn


def dealer(endpoint, context=None):
    sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def call(sock, frames, timeout=10_000):
    sock.send_multipart(frames)
    assert sock.poll(timeout), "no reply"
    return sock.recv_multipart()


def header(frames):
    return msgpack.unpackb(frames[0])


def good_turn(tid, index=0, seq=1, n=4, first=10):
    tokens = list(range(first, first + n))
    turn = Turn.build(tokens, [-0.1] * n, supports=[[t, t + 1] for t in tokens])
    extra = {"prompt_tokens": np.array([1, 2], np.int32)} if index == 0 else {}
    return encode_turn(tid, index, turn, seq=seq, **extra)


def with_header(frames, **changes):
    h = msgpack.unpackb(frames[0])
    h.update(changes)
    return [msgpack.packb(h)] + list(frames[1:])


@pytest.fixture
def broker(tmp_path):
    with BrokerProcess(tmp_path, vocab_size=100, max_message_bytes=100_000) as b:
        yield b


def producer_bad_inputs():
    good = good_turn("t")
    h = msgpack.unpackb(good[0])
    wrong_dtype = dict(h, arrays=[[n, "int64" if n == "tokens" else d, s] for n, d, s in h["arrays"]])
    bad_support = Turn.build([10], [-0.1], supports=[[10]])
    bad_support_frames = encode_turn("t", 0, bad_support, seq=1, prompt_tokens=np.array([1], np.int32))
    bad_support_frames[3] = np.array([11], np.int32).tobytes()  # mask_ids no longer hold the token
    return [
        ("garbage", [b"\x00\xffgarbage"], "malformed"),
        ("not a map", [msgpack.packb([1, 2])], "malformed"),
        ("no version", [msgpack.packb({"type": "ping", "seq": 1})], "version"),
        ("unknown type", [msgpack.packb({"v": 1, "type": "explode", "seq": 1})], "schema"),
        ("missing frame", good[:-1], "schema"),
        ("extra frame", good + [b"1234"], "schema"),
        ("huge", with_header(good_turn("t", n=20_000)), "too_large"),
        ("bad crc", with_header(good, crc32=12345), "crc_mismatch"),
        ("wrong dtype", [msgpack.packb(wrong_dtype)] + good[1:], "dtype"),
        ("short frame", good[:1] + [good[1][:-2]] + good[2:], "shape"),
        ("support without token", bad_support_frames, "mask_invalid"),
        ("out of vocab", good_turn("t", n=200), "out_of_vocab"),
    ]


def test_bad_producer_input_is_refused_and_changes_nothing(broker):
    sock = dealer(broker.producer)
    for name, frames, code in producer_bad_inputs():
        reply = decode(call(sock, frames), BROKER_TO_PRODUCER)
        assert (reply.type, reply["code"]) == ("nack", code), name
        assert reply["message"], name
    # nothing was stored, and the broker still works
    status = broker.status()
    assert status["open"] == 0
    assert sum(v for k, v in status["counters"].items() if k.startswith("nacks.producer.")) == 12
    reply = decode(call(sock, good_turn("t")), BROKER_TO_PRODUCER)
    assert reply.type == "ack" and reply["applied"]
    assert broker.status()["open"] == 1


def test_bad_consumer_and_admin_input(broker):
    consumer = dealer(broker.consumer)
    for frames, code in (([b"junk"], "malformed"),
                         ([msgpack.packb({"v": 1, "type": "credit", "n": -1, "unit": "trajectory"})], "schema"),
                         ([msgpack.packb({"v": 1, "type": "credit", "n": 1, "unit": "bytes"})], "schema"),
                         ([msgpack.packb({"v": 2, "type": "heartbeat"})], "version"),
                         (encode(CONSUMER_TO_BROKER, "ack", {"leases": ["x"]}), "unknown_consumer")):
        reply = decode(call(consumer, frames), BROKER_TO_CONSUMER)
        assert reply["code"] == code
    call(consumer, encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "c"}))
    reply = decode(call(consumer, encode(CONSUMER_TO_BROKER, "ack", {"leases": ["x"]})), BROKER_TO_CONSUMER)
    assert (reply["code"], reply["leases"]) == ("stale_lease", ["x"])
    admin = dealer(broker.admin)
    for frames, code in (([b"\xc1"], "malformed"), ([msgpack.packb({"v": 1, "type": "shutdown"})], "schema")):
        assert decode(call(admin, frames), ADMIN_REPLIES)["code"] == code
    assert broker.status()["consumers"] == 1


@pytest.mark.slow
def test_disk_full_answers_unavailable_then_recovers(tmp_path):
    """RLIMIT_FSIZE makes writes past 300 KB fail (EFBIG) like a full disk;
    raising it from outside must bring the broker back without a restart."""

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.RLIM_INFINITY))

    broker = BrokerProcess(tmp_path, segment_bytes=10_000_000)
    broker.start(preexec_fn=limit_file_size)
    try:
        sock = dealer(broker.producer)
        acked, unavailable = [], []
        for i in range(60):
            reply = decode(call(sock, good_turn(f"t{i}", n=500)), BROKER_TO_PRODUCER)
            (acked if reply.type == "ack" else unavailable).append((i, reply))
        assert acked and unavailable
        assert all(r["code"] == "unavailable" for _, r in unavailable)
        assert broker.proc.poll() is None
        resource.prlimit(broker.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        deadline = time.monotonic() + 20
        retried = {}
        while time.monotonic() < deadline and len(retried) < len(unavailable):
            for i, _ in unavailable:
                if i not in retried:
                    reply = decode(call(sock, good_turn(f"t{i}", n=500)), BROKER_TO_PRODUCER)
                    if reply.type == "ack":
                        retried[i] = reply
            time.sleep(0.2)
        assert len(retried) == len(unavailable)
        status = broker.status()
        assert status["open"] == 60 and status["counters"]["nacks.producer.unavailable"] >= len(unavailable)
        assert status["counters"]["frames.turn.applied"] == 60  # a frame refused unavailable is not counted applied
        broker.kill()
        broker.start()
        assert broker.status()["open"] == 60  # every acked turn survived
    finally:
        broker.proc.kill()


@pytest.mark.slow
def test_disk_budget_refuses_new_trajectories_until_consumers_drain(tmp_path):
    """Over the disk budget with trajectories ready, a turn that would open
    a new trajectory is answered `unavailable`, naming the budget, and
    enters once a consumer has drained the store below it."""

    def send(i):
        producer.send_multipart(good_turn(f"t{i}", seq=i, n=1500))
        producer.send_multipart(encode(PRODUCER_TO_BROKER, "end", {"seq": 1000 + i, "trajectory_id": f"t{i}", "reward": 1.0}))

    with BrokerProcess(tmp_path, max_disk_bytes=400_000, segment_bytes=50_000) as broker:
        producer = dealer(broker.producer)
        for i in range(40):
            send(i)
        acked, refused = set(), set()
        while producer.poll(1500):
            reply = decode(producer.recv_multipart(), BROKER_TO_PRODUCER)
            if reply.type == "ack":
                acked.add(reply["seq"])
            elif reply["code"] == "unavailable":
                assert "over the disk budget" in reply["message"] and "budget 400000" in reply["message"]
                refused.add(reply["seq"])
        assert refused, "the broker took new trajectories past its disk budget"
        assert all(i in acked and 1000 + i in acked for i in range(40) if i not in refused)
        assert "disk over budget: some producer frames wait" in broker.log()
        consumer = dealer(broker.consumer)
        call(consumer, encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "drain"}))
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 100, "unit": "trajectory"}))
        delivered = set()
        deadline = time.monotonic() + 60
        while (refused or len(delivered) < 40) and time.monotonic() < deadline:
            for i in sorted(refused):  # resent as a producer does: the turn, then (once it is acked) the end
                reply = decode(call(producer, good_turn(f"t{i}", seq=i, n=1500)), BROKER_TO_PRODUCER)
                if reply.type == "ack":
                    assert decode(call(producer, encode(PRODUCER_TO_BROKER, "end", {
                        "seq": 1000 + i, "trajectory_id": f"t{i}", "reward": 1.0})), BROKER_TO_PRODUCER).type == "ack"
                    refused.discard(i)
            while consumer.poll(50):
                message = decode(consumer.recv_multipart(), BROKER_TO_CONSUMER)
                if message.type == "deliver":
                    delivered.add(message["trajectory_id"])
                    consumer.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [message["lease"]]}))
        assert not refused and len(delivered) == 40


def test_open_trajectories_over_the_disk_budget_still_get_their_ends_read(tmp_path):
    """Ten open trajectories fill twice the disk budget and none is ready:
    only their ends can free the store, so the broker must keep reading
    rather than pause forever (a consumer is there all along)."""
    with BrokerProcess(tmp_path, max_disk_bytes=200_000, segment_bytes=50_000) as broker:
        consumer = dealer(broker.consumer)
        call(consumer, encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "drain"}))
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 10, "unit": "trajectory"}))
        producer = dealer(broker.producer)
        for i in range(10):  # ~36 KB each, all open
            assert decode(call(producer, good_turn(f"t{i}", seq=i, n=1500)), BROKER_TO_PRODUCER)["applied"]
        assert broker.status()["bytes_on_disk"] > 200_000
        for i in range(10):
            producer.send_multipart(encode(PRODUCER_TO_BROKER, "end", {"seq": 100 + i, "trajectory_id": f"t{i}",
                                                                       "reward": 1.0}))
        acked, delivered = 0, set()
        deadline = time.monotonic() + 30
        while (acked < 10 or len(delivered) < 10) and time.monotonic() < deadline:
            if producer.poll(10):
                acked += decode(producer.recv_multipart(), BROKER_TO_PRODUCER).type == "ack"
            if consumer.poll(10):
                message = decode(consumer.recv_multipart(), BROKER_TO_CONSUMER)
                if message.type == "deliver":
                    delivered.add(message["trajectory_id"])
                    consumer.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [message["lease"]]}))
        assert acked == 10 and delivered == {f"t{i}" for i in range(10)}


@pytest.mark.slow
def test_sigterm_acks_what_it_read_and_stops_cleanly(tmp_path):
    broker = BrokerProcess(tmp_path).start()
    sock = dealer(broker.producer)
    call(sock, encode(PRODUCER_TO_BROKER, "hello", {"producer_id": "p"}))
    for i in range(50):
        sock.send_multipart(good_turn(f"t{i}"))
    broker.proc.send_signal(signal.SIGTERM)
    acked = 0
    while sock.poll(3000):
        acked += decode(sock.recv_multipart(), BROKER_TO_PRODUCER).type == "ack"
    assert broker.proc.wait(20) == 0
    assert "broker stopped" in broker.log()
    broker.start()
    assert broker.status()["open"] == acked  # every ack was durable; nothing unacked was kept
    broker.terminate()


@pytest.mark.slow
def test_status_command_and_config_precedence(tmp_path):
    config = tmp_path / "broker.toml"
    config.write_text('[broker]\nwindow = 7\nlease_timeout = 12.5\nmax_memory_bytes = "1GiB"\n')
    # The consumer below sends no heartbeats: half an hour between them keeps it counted until `status` answers.
    broker = BrokerProcess(tmp_path, config=str(config), heartbeat_interval=1800)
    env = dict(os.environ, ROLLSTREAM_BROKER_WINDOW="9")
    log = open(broker.log_path, "ab")
    broker.proc = subprocess.Popen(broker.command(), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                broker.status(timeout=0.5)
                break
            except TimeoutError:
                assert time.monotonic() < deadline, broker.log()
        producer = dealer(broker.producer)
        welcome = decode(call(producer, encode(PRODUCER_TO_BROKER, "hello", {"producer_id": "p"})), BROKER_TO_PRODUCER)
        assert welcome["window"] == 9  # environment beats the config file
        consumer = dealer(broker.consumer)
        welcome = decode(call(consumer, encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "c"})), BROKER_TO_CONSUMER)
        assert welcome["lease_timeout"] == 12.5  # the config file beats the default
        out = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "status", "--admin", broker.admin, "--json"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        report = json.loads(out)
        assert report["consumers"] == 1 and report["dead_letters"] == []
        text = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "status", "--admin", broker.admin],
                              capture_output=True, text=True, timeout=60, check=True).stdout
        assert "consumers" in text and "counters" in text
    finally:
        broker.proc.kill()
        broker.proc.wait()


def test_unknown_config_key_is_refused(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("windw = 3\n")
    result = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "broker", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "windw" in result.stderr


@pytest.mark.slow
def test_corrupted_store_refuses_to_start(tmp_path):
    broker = BrokerProcess(tmp_path).start()
    call(dealer(broker.producer), good_turn("t"))
    broker.terminate()
    for segment in (broker.data_dir / "segments").glob("*.log"):
        data = bytearray(segment.read_bytes())
        data[-3] ^= 0xFF
        segment.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="CRC mismatch"):
        broker.start()


def test_memory_budget_evicts_open_trajectories(tmp_path):
    """Thirty open trajectories need about 1 MB and the budget is 100 KB.
    The broker moves open trajectories out of memory (they are in the
    store) as each batch goes over, so their second turns and ends are
    still read instead of waiting behind a paused socket forever; each
    trajectory comes back from the store with its own tokens."""
    n = 1500  # ~36 KB per turn
    with BrokerProcess(tmp_path, max_memory_bytes=100_000) as broker:
        producer = dealer(broker.producer)
        for i in range(30):
            producer.send_multipart(good_turn(f"open{i}", seq=i, n=n, first=i))
        for i in range(30):  # a second turn merges into a trajectory that may have been evicted
            producer.send_multipart(good_turn(f"open{i}", index=1, seq=100 + i, n=2, first=i + n))
        for i in range(30):
            producer.send_multipart(encode(PRODUCER_TO_BROKER, "end", {"seq": 200 + i, "trajectory_id": f"open{i}",
                                                                       "reward": float(i)}))
        replies = []
        deadline = time.monotonic() + 60
        while len(replies) < 90 and time.monotonic() < deadline:
            if producer.poll(100):
                replies.append(decode(producer.recv_multipart(), BROKER_TO_PRODUCER))
        assert len(replies) == 90 and all(r.type == "ack" and r["applied"] for r in replies)
        counters = broker.status()["counters"]
        assert counters["evictions.open"] >= 20 and "reloads" not in counters  # merged shed: nothing read back yet
        assert broker.status()["queued"] == 30

        consumer = dealer(broker.consumer)
        call(consumer, encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "c"}))
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 30, "unit": "trajectory"}))
        seen = set()
        while len(seen) < 30 and consumer.poll(10_000):
            message = decode(consumer.recv_multipart(), BROKER_TO_CONSUMER)
            if message.type != "deliver":
                continue
            i = int(message["trajectory_id"][4:])
            assert message.arrays["tokens"].tolist() == list(range(i, i + n + 2))
            assert message.arrays["mask_ids"].tolist() == [v for t in range(i, i + n + 2) for v in (t, t + 1)]
            assert message["reward"] == float(i)
            seen.add(i)
            consumer.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [message["lease"]]}))
        assert seen == set(range(30)) and broker.status()["counters"]["reloads"] >= 20

@contextlib.contextmanager
def threaded_broker(tmp_path, **settings):
    """A broker service on inproc endpoints, run on a thread of this
    process, so a test can break its store's methods while it runs."""
    context = zmq.Context()
    service = BrokerService(BrokerSettings(producer_endpoint="inproc://p", consumer_endpoint="inproc://c",
                                           admin_endpoint="inproc://a", data_dir=str(tmp_path / "data"), metrics_port=0,
                                           **settings), context=context)
    service.start()
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        yield service, thread, context
    finally:
        service.stop()
        thread.join(10)
    assert not thread.is_alive()


def test_an_evicted_open_trajectory_merges_without_reading_the_store_and_is_read_back_whole(tmp_path):
    """Open trajectories over the budget are shed: their next turn and end
    are merged with no read from the store (here it cannot be read at all),
    and the delivery reads back every turn, the one merged while shed too."""
    with threaded_broker(tmp_path, max_memory_bytes=100_000) as (service, thread, context):
        producer = dealer("inproc://p", context)
        for i in range(4):  # ~144 KB of open trajectories against a 100 KB budget
            assert decode(call(producer, good_turn(f"t{i}", seq=i, n=1500, first=i)), BROKER_TO_PRODUCER)["applied"]
        deadline = time.monotonic() + 10
        while not service.core.engine.evicted_open() and time.monotonic() < deadline:
            time.sleep(0.05)
        tid = sorted(service.core.engine.evicted_open())[0]
        first = int(tid[1:])
        real_read = service.store.segments.read_many

        def unreadable(locations):
            raise OSError(5, "Input/output error")

        service.store.segments.read_many = unreadable  # a passing I/O error: the store wraps it as unavailable
        reply = decode(call(producer, good_turn(tid, index=1, seq=10, n=2, first=first + 1500)), BROKER_TO_PRODUCER)
        assert reply.type == "ack" and reply["applied"]
        end = encode(PRODUCER_TO_BROKER, "end", {"seq": 11, "trajectory_id": tid, "reward": 1.0})
        assert decode(call(producer, end), BROKER_TO_PRODUCER)["applied"]
        assert service.core.engine.entries[tid].trajectory.is_shed and not service.core.unavailable
        service.store.segments.read_many = real_read
        consumer = dealer("inproc://c", context)
        call(consumer, encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "c"}))
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 1, "unit": "trajectory"}))
        assert consumer.poll(10_000)
        message = decode(consumer.recv_multipart(), BROKER_TO_CONSUMER)
        assert message.type == "deliver" and message["trajectory_id"] == tid
        assert message.arrays["tokens"].tolist() == list(range(first, first + 1502))
        assert thread.is_alive()


READY_TOKENS = 1500  # per trajectory: four of them (~144 KB) against a 100 KB memory budget


def queued_and_partly_evicted(service, context) -> list[str]:
    """Four ready trajectories `t0`..`t3` (tokens i..i+READY_TOKENS) sent to
    an in-process broker with a 100 KB memory budget; the ones it evicted."""
    producer = dealer("inproc://p", context)
    for i in range(4):
        assert decode(call(producer, good_turn(f"t{i}", seq=i, n=READY_TOKENS, first=i)), BROKER_TO_PRODUCER)["applied"]
        end = encode(PRODUCER_TO_BROKER, "end", {"seq": 10 + i, "trajectory_id": f"t{i}", "reward": float(i)})
        assert decode(call(producer, end), BROKER_TO_PRODUCER)["applied"]
    deadline = time.monotonic() + 10
    evicted: list[str] = []
    while not evicted and time.monotonic() < deadline:
        evicted = [tid for tid, e in list(service.core.engine.entries.items()) if e.trajectory is None]
        time.sleep(0.05)
    assert evicted
    return evicted


@pytest.mark.slow
def test_a_ready_trajectory_that_cannot_be_read_back_waits_for_the_store(tmp_path):
    """An evicted queued trajectory whose read-back fails at delivery: the
    daemon keeps running, reports the store unavailable, and delivers it
    (under the consumer's original credit) once the store reads again."""
    with threaded_broker(tmp_path, max_memory_bytes=100_000) as (service, thread, context):
        evicted = queued_and_partly_evicted(service, context)
        real_read = service.store.segments.read_many

        def unreadable(locations):
            raise OSError(5, "Input/output error")

        service.store.segments.read_many = unreadable  # a passing I/O error: the store wraps it as unavailable
        consumer = dealer("inproc://c", context)
        call(consumer, encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "c"}))
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 4, "unit": "trajectory"}))
        delivered = {}

        def receive(timeout_ms):
            while consumer.poll(timeout_ms):
                message = decode(consumer.recv_multipart(), BROKER_TO_CONSUMER)
                if message.type == "deliver":
                    delivered[message["trajectory_id"]] = message

        deadline = time.monotonic() + 10
        while not service.core.unavailable and time.monotonic() < deadline:
            receive(50)
        assert service.core.unavailable and thread.is_alive()
        receive(300)
        assert set(evicted).isdisjoint(delivered)  # nothing it could not read went out
        service.store.segments.read_many = real_read
        deadline = time.monotonic() + 10
        while len(delivered) < 4 and time.monotonic() < deadline:  # the next probe clears the failure
            receive(100)
        assert sorted(delivered) == ["t0", "t1", "t2", "t3"]  # no new credit was needed
        for tid, message in delivered.items():
            i = int(tid[1:])
            assert message.arrays["tokens"].tolist() == list(range(i, i + READY_TOKENS))
            assert message["delivery_count"] == 1
        assert thread.is_alive()


@pytest.mark.slow
def test_a_queued_trajectory_whose_record_is_damaged_is_dead_lettered_unreadable_after_bounded_reads(tmp_path):
    """A damaged record (a flipped byte: its CRC fails) can never be read
    back: after `UNREADABLE_AFTER` failed reads, each waiting for the
    store's probe, it is dead-lettered `unreadable` and counted, the store
    is available again and the rest are delivered, instead of the store
    turning unavailable after every probe."""
    with threaded_broker(tmp_path, max_memory_bytes=100_000) as (service, thread, context):
        evicted = queued_and_partly_evicted(service, context)
        damaged = evicted[0]
        segment, offset, _ = service.store.load_one(damaged).turns[0].location
        with open(service.store.segments.path(segment), "r+b") as f:  # flip a byte of its payload
            f.seek(offset + 100)
            byte = f.read(1)
            f.seek(offset + 100)
            f.write(bytes([byte[0] ^ 0xFF]))
        consumer = dealer("inproc://c", context)
        call(consumer, encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "c"}))
        consumer.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 4, "unit": "trajectory"}))
        delivered = {}
        deadline = time.monotonic() + 15
        while len(delivered) < 3 and time.monotonic() < deadline:
            while consumer.poll(100):
                message = decode(consumer.recv_multipart(), BROKER_TO_CONSUMER)
                if message.type == "deliver":
                    delivered[message["trajectory_id"]] = message
        assert sorted(delivered) == sorted({"t0", "t1", "t2", "t3"} - {damaged})
        assert [(d["trajectory_id"], d["reason"]) for d in service.core.engine.dead_letters(10)] == [(damaged, "unreadable")]
        assert service.metrics.totals.get("trajectories.unreadable") == 1
        # The store stays available: watched over 1.5 s, past the broker's next store probe (every second while
        # unavailable), the span in which an unavailable flag set by another read and cleared by a probe would show.
        # A claim about a stretch of time: a window to watch, not a condition to wait for.
        watched_until = time.monotonic() + 1.5
        while time.monotonic() < watched_until:
            assert not service.core.unavailable, "the store turned unavailable after the unreadable trajectory was dead-lettered"
            time.sleep(0.01)
        assert thread.is_alive()


def test_a_resend_whose_stored_turn_cannot_be_read_is_refused_unavailable_then_recognised(tmp_path):
    """An applied turn's digest comes from its record when it is resent; a
    record that cannot be read makes the store unavailable and the resend
    comes again, never judged a conflict or a duplicate blindly."""
    with threaded_broker(tmp_path) as (service, thread, context):
        producer = dealer("inproc://p", context)
        assert decode(call(producer, good_turn("t", seq=1)), BROKER_TO_PRODUCER)["applied"]
        real_read = service.store.segments.read_many

        def unreadable(locations):
            raise OSError(5, "Input/output error")

        service.store.segments.read_many = unreadable  # a passing I/O error: the store wraps it as unavailable
        reply = decode(call(producer, good_turn("t", seq=2)), BROKER_TO_PRODUCER)
        assert (reply.type, reply["code"], reply["seq"]) == ("nack", "unavailable", 2)
        assert thread.is_alive() and service.core.unavailable
        service.store.segments.read_many = real_read
        deadline = time.monotonic() + 10
        while service.core.unavailable and time.monotonic() < deadline:
            time.sleep(0.05)
        reply = decode(call(producer, good_turn("t", seq=3)), BROKER_TO_PRODUCER)
        assert reply.type == "ack" and reply["duplicate"] is True and reply["applied"] is True


def large_turn(tid, seq, token_inside=True, n=300, size=1000):
    """Turn 0 of `n` tokens with `size`-id supports (1.2 MB of ids by
    default); with `token_inside=False` the first token's support lacks it
    (the library would refuse to send that)."""
    tokens = np.arange(n, dtype=np.int32) * 3 + 1
    ids = (np.arange(size, dtype=np.int32)[None, :] + tokens[:, None]).ravel()
    turn = Turn.build(tokens, np.full(n, -0.5, np.float32), mask_ids=ids,
                      mask_offsets=np.arange(n + 1, dtype=np.int64) * size)
    frames = encode_turn(tid, 0, turn, seq=seq, prompt_tokens=np.array([1], np.int32))
    if not token_inside:
        at = 1 + [entry[0] for entry in header(frames)["arrays"]].index("mask_ids")
        bad = np.frombuffer(frames[at], np.int32).copy()
        bad[0] = 0
        frames[at] = bad.tobytes()
    return frames


@pytest.mark.slow
def test_large_turns_written_ahead_keep_refusals_out_of_the_store(tmp_path):
    """Turns over the write-ahead threshold reach the segment before their
    content check: one that fails it is still refused, the good one of the
    same burst is acked, and after a restart only the good one is there."""
    n, size = 300, 1000
    big_turn = large_turn

    with BrokerProcess(tmp_path, vocab_size=5000) as broker:
        sock = dealer(broker.producer)
        sock.send_multipart(big_turn("refused", 1, token_inside=False))
        sock.send_multipart(big_turn("kept", 2))
        replies = {}
        while len(replies) < 2:
            assert sock.poll(10_000), "no reply"
            reply = decode(sock.recv_multipart(), BROKER_TO_PRODUCER)
            replies[reply["seq"]] = reply
        assert (replies[1].type, replies[1]["code"]) == ("nack", "mask_invalid")
        assert replies[2].type == "ack" and replies[2]["applied"]
        written = sum(path.stat().st_size for path in (tmp_path / "data" / "segments").glob("*.log"))
        assert written > 2 * n * size * 4  # the refused turn was written ahead too, unreferenced
        sock.close()
        broker.terminate()
        broker.start()  # start-up verifies every record a row refers to
        assert broker.status()["open"] == 1


def test_large_turns_are_checked_ahead_on_their_own_thread_and_refused_by_rule(tmp_path, monkeypatch):
    """A turn frame of `CHECK_AHEAD_FROM_BYTES` or more is checked on the
    checker thread while the batch is read; smaller ones on the main
    thread, packed. Either way a culprit is refused with its rule's code
    and its own seq, and the rest of the burst is acked."""
    from rollstream.broker import service as service_module

    checked = []
    real = service_module._content_error

    def recording(arrays, vocab_size, normalized=False):
        checked.append((len(arrays["mask_ids"]), threading.current_thread().name))
        return real(arrays, vocab_size, normalized)

    monkeypatch.setattr(service_module, "_content_error", recording)
    small_bad = encode_turn("small-bad", 0, Turn.build([5], [-0.5], supports=[[6, 7]], check_content=False),
                            seq=3, prompt_tokens=np.array([1], np.int32))
    with threaded_broker(tmp_path, vocab_size=5000) as (service, thread, context):
        producer = dealer("inproc://p", context)
        for frames in (large_turn("big-bad", 1, token_inside=False), large_turn("big-good", 2), small_bad,
                       large_turn("big-good-2", 4)):
            producer.send_multipart(frames)
        replies = {}
        while len(replies) < 4:
            assert producer.poll(10_000), "no reply"
            reply = decode(producer.recv_multipart(), BROKER_TO_PRODUCER)
            replies[reply["seq"]] = reply
        assert {seq: (r.type, r.get("code")) for seq, r in replies.items()} == {
            1: ("nack", "mask_invalid"), 2: ("ack", None), 3: ("nack", "mask_invalid"), 4: ("ack", None)}
        assert thread.is_alive()
    on_checker = [(ids, name.startswith("rollstream-checker")) for ids, name in checked]
    assert sorted(on_checker) == [(2, False), *[(300 * 1000, True)] * 3]  # every large turn, good ones too


def rollstream_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "rollstream.app.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_port_zero_endpoints_are_reported_bound_in_the_endpoints_file_and_status(tmp_path):
    """Every endpoint on port 0: the broker writes the ports it got to
    --endpoints-file once it listens, `status --endpoints-file --wait`
    finds it there while it starts, peers connect through the file, and
    the file goes away when the broker stops."""
    endpoints_file = tmp_path / "endpoints.json"
    endpoints_file.write_text('{"producer": "tcp://127.0.0.1:1", "consumer": "x", "admin": "tcp://127.0.0.1:1"}')  # stale
    broker = BrokerProcess(tmp_path, endpoints_file=str(endpoints_file))
    broker.producer = broker.consumer = broker.admin = "tcp://127.0.0.1:0"
    log = open(broker.log_path, "ab")
    broker.proc = subprocess.Popen(broker.command(), stdout=log, stderr=subprocess.STDOUT)
    try:
        waited = rollstream_cli("status", "--endpoints-file", str(endpoints_file), "--wait", "30", "--json")
        assert waited.returncode == 0, waited.stderr + broker.log()
        report = json.loads(waited.stdout)
        written = json.loads(endpoints_file.read_text())
        assert report["endpoints"] == written and sorted(written) == ["admin", "consumer", "producer"]
        ports = {name: int(endpoint.rsplit(":", 1)[1]) for name, endpoint in written.items()}
        assert all(endpoint.startswith("tcp://127.0.0.1:") for endpoint in written.values())
        assert len(set(ports.values())) == 3 and 1 not in ports.values()
        welcome = decode(call(dealer(written["producer"]), encode(PRODUCER_TO_BROKER, "hello", {"producer_id": "p"})),
                         BROKER_TO_PRODUCER)
        assert welcome.type == "welcome"
        text = rollstream_cli("status", "--endpoints-file", str(endpoints_file)).stdout
        assert ["producer", "endpoint", written["producer"]] in [line.split() for line in text.splitlines()]
        broker.proc.send_signal(signal.SIGTERM)
        assert broker.proc.wait(30) == 0
        assert not endpoints_file.exists()
    finally:
        if broker.proc.poll() is None:
            broker.proc.kill()
            broker.proc.wait()


@pytest.mark.slow
def test_status_wait_gives_up_after_its_seconds_naming_the_broker():
    started = time.monotonic()
    result = rollstream_cli("status", "--admin", "tcp://127.0.0.1:1", "--wait", "1", "--timeout", "0.3")
    assert result.returncode == 1 and time.monotonic() - started >= 1.0
    assert "did not answer within --wait 1.0 s" in result.stderr and "tcp://127.0.0.1:1" in result.stderr
    missing = rollstream_cli("status", "--endpoints-file", "/nonexistent/endpoints.json")
    assert missing.returncode == 1 and "endpoints file /nonexistent/endpoints.json does not exist" in missing.stderr
