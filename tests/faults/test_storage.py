"""Storage faults, against real broker processes on ipc://
endpoints: a disk budget that must slow the pipeline but never stop it, a
disk that really fills, a file-size limit that makes writes fail, and a
damaged store."""
from __future__ import annotations

import errno
import json
import os
import re
import resource
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from broker_process import BrokerProcess
from disks import tmpfs
from waiting import wait_for

from rollstream.common.codec import decode, encode
from rollstream.common.messages import BROKER_TO_CONSUMER, BROKER_TO_PRODUCER, CONSUMER_TO_BROKER, PRODUCER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn

# How long a reply or a state may take on a machine running other work: a
# bound on a failing wait, not a timing assertion.
PATIENCE = 120.0


def rollstream(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollstream.app.cli", *args]


class Processes:
    """Producer daemons and consumers started by a scenario, killed at its end."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        out = open(self.directory / f"{name}.out", "wb")
        err = open(self.directory / f"{name}.log", "wb")
        proc = subprocess.Popen(rollstream(*args), stdout=out, stderr=err)
        self.procs.append(proc)
        return proc

    def producer(self, broker: BrokerProcess, name: str, *args: str) -> subprocess.Popen:
        return self.start(name, "producer", "--broker-endpoint", broker.producer, "--producer-id", name,
                          "--metrics-port", "0", *args)

    def output(self, name: str) -> str:
        return (self.directory / f"{name}.out").read_text() + (self.directory / f"{name}.log").read_text()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.close()


def test_a_disk_budget_slows_the_pipeline_but_never_stops_it(tmp_path, processes):
    """A 4 MiB disk budget in 256 KiB segments, two producers with the
    default window sending 100-400-token turns, and a consumer of batches of
    3 that starts once the broker is over the budget (it logs so). Over the
    budget, with two trajectories leased to a consumer that waits for a
    third, the `end`s that would finish the open trajectories must still get
    in."""
    with BrokerProcess(tmp_path, max_disk_bytes="4MiB", segment_bytes="256KiB") as broker:
        for name in ("p0", "p1"):
            processes.producer(broker, name, "--response-tokens", "250", "--concurrency", "100")
        wait_for(lambda: "disk over budget" in broker.log(), 120, "the producers to fill the 4 MiB disk budget")
        consumer = processes.start("consumer", "consume", "--endpoint", broker.consumer, "--batch-size", "3",
                                   "--batches", "30", "--timeout", "60", "--device", "cpu")
        try:
            consumer.wait(600)
        except subprocess.TimeoutExpired:
            pass
        status = broker.status(timeout=PATIENCE)
        batches = [json.loads(line) for line in (tmp_path / "consumer.out").read_text().splitlines() if line.strip()]
        assert len(batches) == 30, (f"the pipeline stopped after {len(batches)} batches: open {status['open']}, "
                                    f"queued {status['queued']}, leased {status['leased']}, bytes on disk "
                                    f"{status['bytes_on_disk']}\n{processes.output('consumer')[-2000:]}")
        assert "over budget" in broker.log()


def dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def call(sock: zmq.Socket, frames: list, schema=BROKER_TO_PRODUCER, timeout: float = PATIENCE):
    sock.send_multipart(frames)
    assert sock.poll(int(timeout * 1000)), f"no reply within {timeout} s"
    return decode(sock.recv_multipart(), schema)


def turn(tid: str, seq: int, n: int = 1500) -> list:
    """A first turn of about 36 KB (n tokens, two ids in each support)."""
    tokens = list(range(10, 10 + n))
    return encode_turn(tid, 0, Turn.build(tokens, [-0.1] * n, supports=[[t, t + 1] for t in tokens]), seq=seq,
                       prompt_tokens=np.array([1, 2], np.int32))


def end(tid: str, seq: int) -> list:
    return encode(PRODUCER_TO_BROKER, "end", {"seq": seq, "trajectory_id": tid, "reward": 1.0})


class Drain:
    """A raw consumer that acks every delivery and records what happened."""

    RESEND_AFTER = 0.2  # seconds before an ack the broker could not make durable is sent again

    def __init__(self, broker: BrokerProcess):
        self.sock = dealer(broker.consumer)
        call(self.sock, encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "drain"}), BROKER_TO_CONSUMER)
        self.sock.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": 10_000, "unit": "trajectory"}))
        self.delivered: set[str] = set()
        self.unacked: dict[str, str] = {}  # lease -> trajectory, until the broker confirms the ack
        self.refused_acks = 0
        self.resend: list[tuple[float, list]] = []  # (when, leases) of refused acks
        self.seen: list = []

    def pump(self, seconds: float, until) -> None:
        deadline = time.monotonic() + seconds
        while not until() and time.monotonic() < deadline:
            self.sock.send_multipart(encode(CONSUMER_TO_BROKER, "heartbeat", {}))  # or it is dropped as silent
            now = time.monotonic()
            due = [leases for when, leases in self.resend if when <= now]
            self.resend = [(when, leases) for when, leases in self.resend if when > now]
            for leases in due:
                self.sock.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": leases}))
            if not self.sock.poll(100):
                continue
            message = decode(self.sock.recv_multipart(), BROKER_TO_CONSUMER)
            self.seen.append((message.type, message.get("code"), message.get("message")))
            if message.type == "deliver":
                self.delivered.add(message["trajectory_id"])
                self.unacked[message["lease"]] = message["trajectory_id"]
                self.sock.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [message["lease"]]}))
            elif message.type == "acked":
                for lease in message["leases"]:
                    self.unacked.pop(lease, None)
            elif message.type == "nack" and message["code"] == "unavailable":  # the ack was not durable: again
                self.refused_acks += 1
                self.resend.append((time.monotonic() + self.RESEND_AFTER, message["leases"]))


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (`tmpfs`)."""
    with tmpfs(tmp_path / "disk", "16m") as path:
        yield path


def free_bytes(path: Path) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


def fill(path: Path) -> Path:
    """Write a file on `path`'s file system until it is full."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(1 << 16))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def fill_until_refused(producer: zmq.Socket, disk: Path) -> list[str]:
    """Send 36 KB trajectories (a turn, then its `end`) until a turn is
    refused; the ids acked. The refusal must be the free-space reserve's,
    with the reserve still free on the disk: the broker itself never
    writes into it (the blocks its store takes ahead of the bytes it is
    sent count against it), so no write of its own fails first."""
    acked = []
    for i in range(1000):
        reply = call(producer, turn(f"t{i}", 2 * i))
        if reply.type != "ack":
            assert reply["code"] == "unavailable", reply["message"]
            assert "short of space" in reply["message"], reply["message"]  # not a failed write
            reserve = int(re.search(r"keeps (\d+) in reserve", reply["message"])[1])
            assert free_bytes(disk) >= reserve, f"{free_bytes(disk)} bytes free: the broker wrote into its reserve"
            return acked
        assert call(producer, end(f"t{i}", 2 * i + 1)).type == "ack"
        acked.append(f"t{i}")
    raise AssertionError("the small disk took a thousand 36 KB turns")


def test_a_disk_that_really_fills_keeps_delivering_and_picks_up_again_by_itself(tmp_path, small_disk):
    """The disk budget (1 GiB) is far above the 16 MiB the disk has. The
    broker stops taking turns while it still has its free-space reserve;
    then another process takes the rest of the disk, and the trajectories
    acked so far are still delivered and their acks taken; once space is
    free again the broker takes turns again without a restart."""
    broker = BrokerProcess(tmp_path, max_disk_bytes="1GiB", segment_bytes="1MiB")
    broker.data_dir = small_disk / "data"
    with broker:
        producer = dealer(broker.producer)
        acked = fill_until_refused(producer, small_disk)
        filler = fill(small_disk)  # someone else fills the disk
        assert call(producer, turn("late", 5000))["code"] == "unavailable"

        drain = Drain(broker)
        drain.pump(PATIENCE, lambda: drain.delivered >= set(acked))
        assert drain.delivered >= set(acked), f"{len(set(acked) - drain.delivered)} acked trajectories not delivered"

        filler.unlink()
        drain.pump(PATIENCE, lambda: not drain.unacked)
        assert not drain.unacked, f"{len(drain.unacked)} consumer acks never confirmed"
        replies = []
        wait_for(lambda: replies.append(call(producer, turn("late", 5000))) or replies[-1].type == "ack", PATIENCE,
                 "the broker to take turns again", interval=0.2)
        # The delivered trajectories' segments go, deleted off the commit's path.
        segments = lambda: sorted(p.name for p in (broker.data_dir / "segments").iterdir())  # noqa: E731
        wait_for(lambda: len(segments()) <= 2, PATIENCE, "the delivered trajectories' segments to be deleted")


@pytest.mark.parametrize("size", ["12m", "13m", "15m"])
def test_whatever_the_disk_size_the_broker_stops_turns_before_its_own_writes_reach_the_reserve(tmp_path, size):
    """Where a disk's free space falls between two segments' reservations
    (1 MiB each here, more than the 5% reserve of these disks) decides
    nothing: the refusal is the reserve's and the reserve is still free."""
    with tmpfs(tmp_path / "disk", size) as disk:
        broker = BrokerProcess(tmp_path, max_disk_bytes="1GiB", segment_bytes="1MiB")
        broker.data_dir = disk / "data"
        with broker:
            producer = dealer(broker.producer)
            fill_until_refused(producer, disk)


def limit_file_size(limit: int = 300_000):
    """A preexec_fn: writes past `limit` bytes in any one file fail (EFBIG),
    as on a full disk, for the broker only and without root."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return apply


def test_a_file_size_limit_answers_unavailable_keeps_what_it_acked_and_recovers_by_itself(tmp_path):
    """Writes past 300 KB in any file fail, with segments of 512 KiB (they
    can never fill) and a WAL that reaches the limit too. The broker answers
    `unavailable` and recovers on its own, under the same limit; failed
    probes leave no files behind; deliveries and consumer acks go on
    throughout; after a SIGKILL every trajectory it acked is there."""
    broker = BrokerProcess(tmp_path, segment_bytes="512KiB")
    broker.start(preexec_fn=limit_file_size())
    try:
        producer, drain = dealer(broker.producer), Drain(broker)
        acked, refused = set(), 0
        for i in range(60):
            tid, seq = f"t{i}", 2 * i
            deadline = time.monotonic() + PATIENCE
            while (reply := call(producer, turn(tid, seq))).type != "ack":
                assert reply["code"] == "unavailable", reply["message"]
                assert time.monotonic() < deadline, f"turn of {tid} still refused: {reply['message']}"
                refused += 1
                drain.pump(0.3, lambda: False)
            while (reply := call(producer, end(tid, seq + 1))).type != "ack":
                assert reply["code"] == "unavailable" and time.monotonic() < deadline, reply["message"]
                refused += 1
                drain.pump(0.3, lambda: False)
            acked.add(tid)
            drain.pump(0.01, lambda: False)
        assert refused, "the file-size limit never made a write fail"
        assert "store failed" in broker.log() and "store available again" in broker.log()

        # Failed probes leave nothing behind: a broker kept unavailable for a
        # few seconds holds as many segment files as before.
        unended = None  # a trajectory whose turn was acked and whose end was refused: ended below
        for i in range(60, 200):
            if call(producer, turn(f"t{i}", 2 * i)).type != "ack":
                break
            if call(producer, end(f"t{i}", 2 * i + 1)).type != "ack":
                unended = i
                break
            acked.add(f"t{i}")
        before = sorted((broker.data_dir / "segments").iterdir())
        drain.pump(4, lambda: False)
        after = sorted((broker.data_dir / "segments").iterdir())
        assert len(after) <= len(before) + 1, (before, after)
        if unended is not None:  # sent again until acked, or it would stay open
            deadline = time.monotonic() + PATIENCE
            while (reply := call(producer, end(f"t{unended}", 2 * unended + 1))).type != "ack":
                assert reply["code"] == "unavailable" and time.monotonic() < deadline, reply["message"]
                drain.pump(0.3, lambda: False)
            acked.add(f"t{unended}")

        drain.pump(PATIENCE, lambda: drain.delivered >= acked and not drain.unacked)
        assert drain.delivered >= acked and not drain.unacked, [m for m in drain.seen if m[0] != "deliver"][-10:]
        broker.kill()
        broker.start(timeout=PATIENCE)  # without the limit
        status = broker.status(timeout=PATIENCE)
        assert status["queued"] + status["leased"] == 0 and status["open"] == 0  # every ack the consumer saw was durable
    finally:
        broker.proc.kill()


def test_a_flipped_byte_of_a_stored_reward_is_reported_at_start(tmp_path):
    """State kept only in SQLite (an ended trajectory's reward and metadata)
    is checked like the segment records: one flipped byte of a reward is
    reported with its table and trajectory instead of being delivered."""
    with BrokerProcess(tmp_path) as broker:
        producer = dealer(broker.producer)
        assert call(producer, turn("t", 0)).type == "ack"
        reward = encode(PRODUCER_TO_BROKER, "end", {"seq": 1, "trajectory_id": "t", "reward": 0.5,
                                                     "metadata": {"judge": "ok"}})
        assert call(producer, reward).type == "ack"
        broker.terminate()
    db = sqlite3.connect(broker.data_dir / "state.sqlite")
    (blob,) = db.execute("SELECT reward FROM trajectories WHERE id='t'").fetchone()
    flipped = bytearray(blob)
    flipped[-1] ^= 0x01  # 0.5 becomes another float: still valid msgpack
    db.execute("UPDATE trajectories SET reward=? WHERE id='t'", (bytes(flipped),))
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match=r"state\.sqlite.*trajectories row 't'.*CRC mismatch"):
        broker.start()


def test_a_damaged_store_is_named_at_start_and_salvage_keeps_what_is_intact(tmp_path):
    """One record of a segment flipped, another segment cut short: the
    broker refuses to start, naming the file and the offset; `rollstream
    salvage` drops the two trajectories they held, lists them, and the
    broker then delivers the other ones whole."""
    with BrokerProcess(tmp_path, segment_bytes=100_000) as broker:
        producer = dealer(broker.producer)
        for i in range(8):  # about 36 KB each: three segments
            assert call(producer, turn(f"t{i}", 2 * i)).type == "ack"
            assert call(producer, end(f"t{i}", 2 * i + 1)).type == "ack"
        broker.terminate()
    db = sqlite3.connect(broker.data_dir / "state.sqlite")
    where = dict(db.execute("SELECT trajectory_id, segment || ':' || offset FROM turns"))
    db.close()
    segment, offset = map(int, where["t1"].split(":"))
    path = broker.data_dir / "segments" / f"seg-{segment:08d}.log"
    data = bytearray(path.read_bytes())
    data[offset + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=rf"refusing to start: segment file {path.name}, record at offset {offset}: "
                                           "CRC mismatch"):
        broker.start()

    last = max(int(w.split(":")[0]) for w in where.values())
    cut = [tid for tid, w in where.items() if int(w.split(":")[0]) == last]
    tail = broker.data_dir / "segments" / f"seg-{last:08d}.log"
    tail.write_bytes(tail.read_bytes()[:-1000])  # the newest segment cut short: its last record loses its end
    result = subprocess.run(rollstream("salvage", "--data-dir", str(broker.data_dir)), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    dropped = {cut[-1], "t1"}
    for tid in dropped:
        assert f"dropped trajectory {tid!r}" in result.stdout
    assert f"kept {8 - len(dropped)} trajectories, dropped {len(dropped)}" in result.stdout

    with broker:
        drain = Drain(broker)
        intact = {f"t{i}" for i in range(8)} - dropped
        drain.pump(PATIENCE, lambda: drain.delivered >= intact and not drain.unacked)
        assert drain.delivered == intact and not drain.unacked
