"""The producer against a live broker subprocess on ipc:// endpoints:
merging exactly as docs/semantics.md says, broker and producer crashes, the
spool, backpressure, and the daemon's sources. Deliveries are read with a
raw zmq DEALER; expected trajectories are built here from plain lists."""
import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq
from engines import FakeSGLang, episode_turns
from waiting import wait_for

from rollstream.common import SamplingMask
from rollstream.common.codec import decode, encode
from rollstream.common.errors import ClientFailed, LocalProtocolError
from rollstream.common.messages import (
    ADMIN_REPLIES,
    ADMIN_REQUESTS,
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    CONSUMER_TO_BROKER,
    PRODUCER_TO_BROKER,
)
from rollstream.common.miles import (
    DEFAULT_FIELDS,
    FIELDS_WITH_MASK,
    MASK_FIELD,
    SessionField,
    decode_session_samples,
    encode_session_samples,
)
from rollstream.common.trajectory import Turn
from rollstream.common.wire import trajectory_from_deliver
from rollstream.producer import AsyncProducer, Halted, Producer, Receipt, Refused
from rollstream.producer.replay import ReplayError, turn_of
from rollstream.producer.session import BEFORE_WELCOME_WINDOW

PATIENCE = 90.0  # seconds before a wait gives up (only ever reached when something hangs)


# -- a broker subprocess and a raw consumer --------------------------------------------
class Broker:
    def __init__(self, root, *extra):
        self.root = root
        self.endpoints = {name: f"ipc://{root}/{name}.sock" for name in ("producer", "consumer", "admin")}
        self.extra = extra
        self.process = None

    def start(self):
        args = [sys.executable, "-m", "rollstream.app.cli", "broker",
                "--producer-endpoint", self.endpoints["producer"], "--consumer-endpoint", self.endpoints["consumer"],
                "--admin-endpoint", self.endpoints["admin"], "--data-dir", f"{self.root}/data", "--metrics-port", "0",
                "--log-level", "warning", *self.extra]
        with open(f"{self.root}/broker.log", "ab") as log:  # the child keeps its own copy of the descriptor
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
        self.status()  # wait until it answers
        return self

    def signal(self, signum):
        self.process.send_signal(signum)
        if signum in (signal.SIGKILL, signal.SIGTERM):
            self.process.wait(timeout=PATIENCE)

    def status(self):
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoints["admin"])
        try:
            deadline = time.monotonic() + PATIENCE
            while time.monotonic() < deadline:
                sock.send_multipart(encode(ADMIN_REQUESTS, "status", {"seq": 1}))
                if sock.poll(1000):
                    return decode(sock.recv_multipart(), ADMIN_REPLIES).fields
            raise AssertionError("the broker never answered status")
        finally:
            sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)


def drain(broker, count, *, settle=0.5):
    """Read deliveries until `count` distinct trajectories arrived, then a
    little longer to catch duplicates; ack them all. Returns (trajectories by
    id, number of deliveries)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(broker.endpoints["consumer"])
    sock.send_multipart(encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "test-consumer"}))
    sock.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": count + 100, "unit": "trajectory"}))
    got, deliveries = {}, 0
    deadline = time.monotonic() + PATIENCE
    quiet_until = None
    try:
        while time.monotonic() < deadline and (quiet_until is None or time.monotonic() < quiet_until):
            sock.send_multipart(encode(CONSUMER_TO_BROKER, "heartbeat", {}))
            if not sock.poll(200):
                continue
            message = decode(sock.recv_multipart(), BROKER_TO_CONSUMER)
            if message.type != "deliver":
                continue
            deliveries += 1
            trajectory = trajectory_from_deliver(message)
            got[trajectory.trajectory_id] = trajectory
            sock.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": [message["lease"]]}))
            if len(got) >= count and quiet_until is None:
                quiet_until = time.monotonic() + settle
    finally:
        sock.close()
    assert len(got) >= count, f"expected {count} trajectories, {len(got)} arrived"
    return got, deliveries


# -- expected merges, from plain lists (docs/semantics.md section 4) ----------------------------
def expected_merge(turns):
    """turns: dicts with tokens, supports, log_probs, forced. Returns the
    merged response, loss mask, log-probs and CSR mask as lists."""
    tokens, loss, log_probs, ids, offsets = [], [], [], [], [0]
    for turn in turns:
        for token, support, lp in zip(turn["tokens"], turn["supports"], turn["log_probs"]):
            tokens.append(token)
            loss.append(1)
            log_probs.append(float(np.float32(lp)))
            ids.extend(support)
            offsets.append(len(ids))
        for token in turn.get("forced", []):
            tokens.append(token)
            loss.append(0)
            log_probs.append(0.0)
            ids.append(token)
            offsets.append(len(ids))
    return {"tokens": tokens, "loss_mask": loss, "log_probs": log_probs, "mask_ids": ids, "mask_offsets": offsets}


def as_lists(trajectory):
    return {"tokens": trajectory.tokens.tolist(), "loss_mask": trajectory.loss_mask.tolist(),
            "log_probs": trajectory.log_probs.tolist(), "mask_ids": trajectory.mask.ids.tolist(),
            "mask_offsets": trajectory.mask.offsets.tolist()}


def plan(index, turns=3):
    """A deterministic trajectory: prompt and turns derived from `index`."""
    base = 1000 + 100 * index
    return {
        "prompt": [base, base + 1, base + 2],
        "turns": [{"tokens": [base + 10 * t, base + 10 * t + 1], "supports": [[base + 10 * t, 7], [base + 10 * t + 1]],
                   "log_probs": [-0.25 * (t + 1), -0.5], "forced": [] if t == turns - 1 else [base + 10 * t + 5]}
                  for t in range(turns)],
        "reward": float(index),
    }


async def send_plan(producer, tid, p, **identity):
    traj = producer.trajectory(tid, p["prompt"], **identity)
    futures = [await traj.turn(t["tokens"], t["log_probs"], supports=t["supports"], forced_tokens=t["forced"] or None)
               for t in p["turns"]]
    futures.append(await traj.end(p["reward"]))
    return futures


def check_delivered(trajectory, p):
    assert trajectory.prompt_tokens.tolist() == p["prompt"]
    assert as_lists(trajectory) == expected_merge(p["turns"])
    assert trajectory.reward == p["reward"] and trajectory.turns == len(p["turns"])


# -- the client against the broker -------------------------------------------------------------
@pytest.mark.slow
def test_a_multi_turn_trajectory_arrives_merged_exactly(tmp_path):
    """docs/semantics.md worked example 6 plus a third turn, with group fields;
    then a replay gap and a turn after it are reported, not raised."""
    async def main(broker):
        async with AsyncProducer(broker.endpoints["producer"], "p-merge") as producer:
            traj = producer.trajectory("t-6", [1, 2, 3], group_id="g", group_size=2, sample_index=0,
                                       metadata={"task": "demo"})
            receipts = [await f for f in [
                await traj.turn([10], [-0.5], supports=[[10, 4]], forced_tokens=[20, 21], weight_version="w1"),
                await traj.turn([30], [-0.25], mask=SamplingMask.from_supports([[30, 7, 8]]), forced_tokens=[40],
                                weight_version="w2"),
                await traj.turn([50, 51], [-1.0, -2.0], supports=[[50], [51, 9]], loss_mask=[1, 0]),
                await traj.end({"score": 1.5}),
            ]]
            gap = producer.trajectory("t-7", [1], group_id="g", group_size=2, sample_index=1)
            outcomes = [await f for f in [
                await gap.turn([10], [-0.5], supports=[[10, 4]], forced_tokens=[20]),
                await gap.turn([11], [-0.5], status="aborted"),  # no supports: a replay gap
                await gap.turn([12], [-0.5], supports=[[12]]),
                await gap.end(0.0),
            ]]
            return receipts, outcomes

    with Broker(tmp_path) as broker:
        receipts, outcomes = asyncio.run(main(broker))
        got, deliveries = drain(broker, 2)
    assert all(r.applied and not r.duplicate for r in receipts)
    assert [(r.kind, r.turn) for r in receipts] == [("turn", 0), ("turn", 1), ("turn", 2), ("end", None)]
    assert [(o.applied, o.reason) for o in outcomes] == [(True, None), (False, "replay_gap"), (False, "replay_gap"),
                                                         (True, None)]
    merged = got["t-6"]
    assert merged.tokens.tolist() == [10, 20, 21, 30, 40, 50, 51]
    assert merged.mask.ids.tolist() == [10, 4, 20, 21, 30, 7, 8, 40, 50, 51, 9]
    assert merged.mask.offsets.tolist() == [0, 2, 3, 4, 7, 8, 9, 11]
    assert merged.loss_mask.tolist() == [1, 0, 0, 1, 0, 1, 0]
    assert merged.log_probs.tolist() == [-0.5, 0.0, 0.0, -0.25, 0.0, -1.0, -2.0]
    assert merged.weight_versions == ["w1", "w2"] and merged.reward == {"score": 1.5}
    assert (merged.group_id, merged.group_size, merged.sample_index) == ("g", 2, 0)
    assert merged.metadata["task"] == "demo"
    cut = got["t-7"]  # example 7: cut after turn 0's sampled token, its forced token dropped
    assert cut.tokens.tolist() == [10] and cut.mask.offsets.tolist() == [0, 2]
    assert (cut.gap.turn, cut.gap.field, cut.status) == (1, "mask", "completed")
    assert deliveries == 2


def test_a_refusal_raises_with_its_code_and_an_end_of_the_unknown_is_refused(tmp_path):
    async def main(broker):
        async with AsyncProducer(broker.endpoints["producer"], "p-refuse") as producer:
            traj = producer.trajectory("t-vocab", [1, 2])
            bad = await traj.turn([5000], [-0.1], supports=[[5000, 3]])  # the broker knows vocab_size=1000
            with pytest.raises(Refused) as refused:
                await bad
            abort = await (await traj.abort("retry"))
            return refused.value, abort

    with Broker(tmp_path, "--vocab-size", "1000") as broker:
        refused, abort = asyncio.run(main(broker))
    assert (refused.code, refused.trajectory_id, refused.turn, refused.kind) == ("out_of_vocab", "t-vocab", 0, "turn")
    assert "out_of_vocab" in str(refused) and "1000" in refused.message
    assert (abort.applied, abort.reason) == (False, "unknown_trajectory")


@pytest.mark.parametrize("client", ["async", "blocking"])
def test_a_whole_trajectory_sent_on_a_handle_that_halts_is_given_up_at_a_refusal(tmp_path, client):
    """`send_trajectory(halts=True)`, from either client: turn 0 is outside
    the broker's vocabulary, so the trajectory is given up (aborted,
    `given_up` in the ledger), never its turn 1 taken as turn 0. Whether the
    call itself raised `Halted` hangs on when the refusal came back, which
    the test does not control. A trajectory sent after it goes through."""
    bad = [Turn.build([5000], [-0.5], supports=[[5000]]), Turn.build([7], [-0.5], supports=[[7]])]
    good = [Turn.build([8], [-0.5], supports=[[8, 9]])]
    ledger = tmp_path / "ledger.jsonl"

    async def send_async(endpoint):
        async with AsyncProducer(endpoint, "p-halts", ledger=str(ledger)) as producer:
            with contextlib.suppress(Halted):
                await producer.send_trajectory("bad", [1], bad, 1.0, halts=True)
            return [await future for future in await producer.send_trajectory("good", [2], good, 2.0, halts=True)]

    with Broker(tmp_path, "--vocab-size", "1000") as broker:
        endpoint = broker.endpoints["producer"]
        if client == "async":
            receipts = asyncio.run(send_async(endpoint))
        else:
            with Producer(endpoint, "p-halts", ledger=str(ledger)) as producer:
                with contextlib.suppress(Halted):
                    producer.send_trajectory("bad", [1], bad, 1.0, halts=True)
                receipts = [future.result(PATIENCE) for future in producer.send_trajectory("good", [2], good, 2.0,
                                                                                           halts=True)]
                assert producer.flush(PATIENCE)
        got, _ = drain(broker, 1)
        status = broker.status()
    assert all(receipt.applied for receipt in receipts) and set(got) == {"good"}
    assert got["good"].tokens.tolist() == [8]
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert {(r["id"], r["reason"]) for r in records if r["kind"] == "given_up"} == {("bad", "turn 0 refused: out_of_vocab")}
    assert status["open"] == 0


@pytest.mark.slow
def test_mask_log_probs_arrive_beside_their_ids_and_supports_said_renormalised_must_sum_to_one(tmp_path):
    """`turn(mask_log_probs=)`: one log-prob per support id, merged beside
    the mask's ids (0.0 at a forced token's singleton), from the async and
    the blocking client. A turn that says its supports are renormalised
    while one is not is refused: by the broker, or with `check_content`
    at the call, before anything is sent (Turn.build's LocalProtocolError)."""
    half = float(np.log(0.5))
    bad = dict(supports=[[10, 4]], mask_log_probs=[half, -2.0], mask_log_probs_normalized=True)  # 0.5 + 0.135

    async def main(broker):
        async with AsyncProducer(broker.endpoints["producer"], "p-support") as producer:
            traj = producer.trajectory("m-1", [1, 2])
            receipts = [await f for f in [
                await traj.turn([10, 11], [half, 0.0], supports=[[10, 4], [11]], mask_log_probs=[half, half, 0.0],
                                mask_log_probs_normalized=True, forced_tokens=[20]),
                # Not said renormalised, so not held to the sum rule (these sum to 1.05).
                await traj.turn([30], [-0.25], mask_ids=np.int32([30, 7, 8]), mask_offsets=np.int64([0, 3]),
                                mask_log_probs=np.float32([-0.25, -1.5, -3.0])),
                await traj.end(1.0),
            ]]
            refused_turn = await producer.trajectory("m-2", [1]).turn([10], [half], **bad)
            with pytest.raises(Refused) as refused:
                await refused_turn
            return receipts, refused.value

    with Broker(tmp_path) as broker:
        receipts, refused = asyncio.run(main(broker))
        with Producer(broker.endpoints["producer"], "p-support-checked", check_content=True) as producer:
            traj = producer.trajectory("m-3", [1])
            with pytest.raises(LocalProtocolError) as local:
                traj.turn([10], [half], **bad)
            assert traj.next_turn == 0 and producer.unsettled == 0  # nothing was sent
            blocking = [traj.turn([10], [half], supports=[[10, 4]], mask_log_probs=[half, half],
                                  mask_log_probs_normalized=True).result(PATIENCE), traj.end(0.5).result(PATIENCE)]
        got, deliveries = drain(broker, 2)
    assert all(r.applied for r in receipts + blocking) and deliveries == 2
    assert (refused.code, refused.trajectory_id, refused.turn) == ("invalid_value", "m-2", 0)
    assert "each support's probabilities sum to 1" in refused.message and "got 0.635" in refused.message
    assert local.value.code == "invalid_value"
    assert "rule 'each support's probabilities sum to 1" in str(local.value) and "got 0.635" in str(local.value)
    merged = got["m-1"]
    assert merged.tokens.tolist() == [10, 11, 20, 30]
    assert merged.mask.ids.tolist() == [10, 4, 11, 20, 30, 7, 8]
    assert merged.mask_log_probs.dtype == np.float32
    assert merged.mask_log_probs.tobytes() == np.float32([half, half, 0.0, 0.0, -0.25, -1.5, -3.0]).tobytes()
    assert got["m-3"].mask_log_probs.tobytes() == np.float32([half, half]).tobytes()
    assert "m-2" not in got


@pytest.mark.slow
def test_the_blocking_client_has_the_same_vocabulary(tmp_path):
    with Broker(tmp_path) as broker:
        with Producer(broker.endpoints["producer"], "p-blocking", window=2) as producer:
            futures = []
            for i in range(3):
                traj = producer.trajectory(f"b-{i}", plan(i)["prompt"])
                for t in plan(i)["turns"]:
                    futures.append(traj.turn(t["tokens"], t["log_probs"], supports=t["supports"],
                                             forced_tokens=t["forced"] or None))
                futures.append(traj.end(plan(i)["reward"]))
            receipts = [f.result(timeout=PATIENCE) for f in futures]
            assert producer.unsettled == 0
        got, _ = drain(broker, 3)
    assert all(isinstance(r, Receipt) and r.applied for r in receipts)
    for i in range(3):
        check_delivered(got[f"b-{i}"], plan(i))


@pytest.mark.slow
def test_broker_sigkill_and_restart_mid_stream_loses_and_duplicates_nothing(tmp_path):
    count = 24

    async def main(broker):
        async with AsyncProducer(broker.endpoints["producer"], "p-crash", window=8, reply_timeout=5.0) as producer:
            futures, restart = [], None
            for i in range(count):
                futures += await send_plan(producer, f"k-{i}", plan(i, turns=4))
                if i == count // 3:
                    await asyncio.gather(*futures)  # some are durable for sure, then the broker dies
                    broker.signal(signal.SIGKILL)
                    restart = asyncio.create_task(asyncio.to_thread(broker.start))  # while we keep sending
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
            await restart
            return outcomes, producer.metrics.totals

    with Broker(tmp_path) as broker:
        outcomes, totals = asyncio.run(main(broker))
        got, deliveries = drain(broker, count)
    assert not [o for o in outcomes if not isinstance(o, Receipt)]
    assert all(o.applied for o in outcomes)  # resent frames the broker had already made durable come back applied too
    assert totals.get("reconnects", 0) >= 1 and totals.get("resends", 0) >= 1
    assert sorted(got) == sorted(f"k-{i}" for i in range(count)) and deliveries == count
    for i in range(count):
        check_delivered(got[f"k-{i}"], plan(i, turns=4))


CHILD = r"""
import asyncio, sys
from rollstream.producer import AsyncProducer

def plan(index, turns=3):
    base = 1000 + 100 * index
    return {"prompt": [base, base + 1, base + 2],
            "turns": [{"tokens": [base + 10 * t, base + 10 * t + 1], "supports": [[base + 10 * t, 7], [base + 10 * t + 1]],
                       "log_probs": [-0.25 * (t + 1), -0.5], "forced": [] if t == turns - 1 else [base + 10 * t + 5]}
                      for t in range(turns)],
            "reward": float(index)}

async def main(endpoint, spool):
    async with AsyncProducer(endpoint, "p-spool", window=4, spool_dir=spool, reply_timeout=60.0) as producer:
        for i in range(10_000):
            p = plan(i)
            traj = producer.trajectory(f"s-{i}", p["prompt"])
            for t in p["turns"]:
                await traj.turn(t["tokens"], t["log_probs"], supports=t["supports"], forced_tokens=t["forced"] or None)
            await traj.end(p["reward"])
            print(f"submitted s-{i}", flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def read_lines(process, until, store):
    """Collect `submitted` lines from a child until `until(store)` holds
    (raw pipe reads, as in `wait_for_line`)."""
    fd = process.stdout.fileno()
    deadline = time.monotonic() + PATIENCE
    pending = ""
    while not until(store):
        assert time.monotonic() < deadline, f"child stalled after {len(store)} lines"
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, "child exited early"
            pending += chunk.decode()
            *lines, pending = pending.split("\n")
            store.extend(line.split()[1] for line in lines if line)


@pytest.mark.slow
def test_producer_sigkill_and_restart_resends_its_spool(tmp_path):
    """The child streams into a live broker, then into a frozen one (frames
    pile up in its spool, none acked), and is SIGKILLed. A new producer with
    the same id and spool resends them: every trajectory the child had
    accepted arrives once, exactly."""
    spool = tmp_path / "spool"
    with Broker(tmp_path) as broker:
        child = subprocess.Popen([sys.executable, "-c", CHILD, broker.endpoints["producer"], str(spool)],
                                 stdout=subprocess.PIPE, text=True)
        submitted = []
        try:
            read_lines(child, lambda s: len(s) >= 5, submitted)
            broker.signal(signal.SIGSTOP)
            read_lines(child, lambda s: len(s) >= 15, submitted)
        finally:
            child.kill()
            child.wait()
        submitted += [line.split()[1] for line in child.stdout.read().splitlines()]
        child.stdout.close()
        assert any(p.name.startswith("seg-") and p.stat().st_size for p in spool.iterdir())
        broker.signal(signal.SIGCONT)

        async def restart():
            async with AsyncProducer(broker.endpoints["producer"], "p-spool", spool_dir=str(spool)) as producer:
                assert producer.unsettled > 0
                assert await producer.flush(PATIENCE)
                return producer.metrics.totals

        totals = asyncio.run(restart())
        got, deliveries = drain(broker, len(submitted))
    assert sum(v for k, v in totals.items() if k.startswith("frames_sent")) > 0
    assert set(submitted) <= set(got)
    assert deliveries == len(got)  # nothing delivered twice
    for tid in submitted:
        check_delivered(got[tid], plan(int(tid.split("-")[1])))
    assert not [p for p in spool.iterdir() if p.name.startswith("seg-")]  # all settled: a clean close empties it


async def fill(producer, prefix, release):
    """Six one-turn trajectories (12 frames) against a broker that does not
    answer yet; `release()` lets it answer. Returns the peak of frames held in
    memory, how many senders were left waiting, how many frames were
    accepted before the release, and every outcome."""
    async def sender(i):
        return await send_plan(producer, f"{prefix}-{i}", plan(i, turns=1))

    tasks = [asyncio.create_task(sender(i)) for i in range(6)]
    peak = 0
    for _ in range(25):  # 0.5 s for every sender to get as far as it can: that the rest stay blocked takes time to show
        await asyncio.sleep(0.02)
        peak = max(peak, producer.held)
    waiting, accepted = sum(not t.done() for t in tasks), producer.unsettled
    release()
    while not all(t.done() for t in tasks):
        peak = max(peak, producer.held)
        await asyncio.sleep(0.01)
    return peak, waiting, accepted, [await f for t in tasks for f in t.result()]


@pytest.mark.slow
def test_a_full_window_blocks_instead_of_growing_memory(tmp_path):
    """No broker yet, so no welcome: the frames a window holds before a
    welcome (`BEFORE_WELCOME_WINDOW`, fewer than `window`) are accepted, the
    other senders wait; memory never holds more than the window."""
    broker = Broker(tmp_path)

    async def main():
        async with AsyncProducer(broker.endpoints["producer"], "p-full", window=3) as producer:
            return await fill(producer, "w", broker.start)

    try:
        peak, waiting, accepted, outcomes = asyncio.run(main())
    finally:
        broker.__exit__()
    assert accepted == BEFORE_WELCOME_WINDOW < 3 and waiting > 0 and peak <= 3  # the window, once welcomed
    assert len(outcomes) == 12 and all(o.applied for o in outcomes)


@pytest.mark.slow
def test_with_a_spool_frames_beyond_the_window_go_to_disk_until_its_budget(tmp_path):
    """A frozen broker: the window (2) fills, further frames are accepted
    into the spool until its byte budget is used, then senders wait; memory
    still holds only the window. After the broker thaws, all settle."""
    async def main(broker):
        async with AsyncProducer(broker.endpoints["producer"], "p-spool-full", window=2, spool_dir=str(tmp_path / "sp"),
                                 spool_bytes=1500) as producer:
            broker.signal(signal.SIGSTOP)
            return await fill(producer, "d", lambda: broker.signal(signal.SIGCONT))

    with Broker(tmp_path) as broker:
        peak, waiting, accepted, outcomes = asyncio.run(main(broker))
    assert peak == 2 and 2 < accepted < 12 and waiting > 0
    assert len(outcomes) == 12 and all(o.applied for o in outcomes)


@pytest.mark.slow
def test_heartbeats_notice_a_silent_broker_and_its_return(tmp_path):
    def broker_up(producer):
        return producer.metrics.registry.get_sample_value("rollstream_producer_broker_up")

    async def wait_until(condition):
        deadline = time.monotonic() + PATIENCE
        while not condition():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    async def main(broker):
        async with AsyncProducer(broker.endpoints["producer"], "p-beat", heartbeat_interval=0.1,
                                 heartbeat_timeout=0.5) as producer:
            await wait_until(lambda: broker_up(producer) == 1)
            broker.signal(signal.SIGSTOP)
            await wait_until(lambda: broker_up(producer) == 0)
            broker.signal(signal.SIGCONT)
            await wait_until(lambda: broker_up(producer) == 1)

    with Broker(tmp_path) as broker:
        asyncio.run(main(broker))


class FakeBroker:
    """A raw ROUTER in a thread that answers in order, as a broker does:
    `welcome`, `pong`, and an `ack` per frame, each `delay` seconds after
    the message came in; `drop_first_turn` loses the first turn's ack."""

    def __init__(self, *, delay=0.0, drop_first_turn=False):
        self.context = zmq.Context()
        self.endpoint = f"inproc://fake-broker-{id(self)}"
        self.router = self.context.socket(zmq.ROUTER)
        self.router.bind(self.endpoint)
        self.delay, self.drop_first_turn = delay, drop_first_turn
        self.seen: list[tuple[str, int | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _answer(self, message):
        seq = message.get("seq")
        if message.type == "hello":
            return encode(BROKER_TO_PRODUCER, "welcome", {"broker_id": "fake", "max_message_bytes": 2**26, "window": 64})
        if message.type == "ping":
            return encode(BROKER_TO_PRODUCER, "pong", {"seq": seq})
        if message.type == "turn" and self.drop_first_turn:
            self.drop_first_turn = False
            return None
        return encode(BROKER_TO_PRODUCER, "ack", {"seq": seq, "trajectory_id": message["trajectory_id"], "applied": True})

    def _serve(self):
        waiting = []  # (due, identity, reply), in arrival order
        while not self._stop.is_set():
            if self.router.poll(10):
                identity, *frames = self.router.recv_multipart()
                message = decode(frames, PRODUCER_TO_BROKER)
                self.seen.append((message.type, message.get("seq")))
                waiting.append((time.monotonic() + self.delay, identity, self._answer(message)))
            while waiting and waiting[0][0] <= time.monotonic():
                _, identity, reply = waiting.pop(0)
                if reply is not None:
                    self.router.send_multipart([identity, *reply])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.context.destroy(linger=0)


@pytest.mark.slow
def test_a_slow_broker_gets_no_resends_on_a_live_connection():
    """Every answer comes five reply timeouts late, in order, on a live
    connection: waiting loses nothing, so no frame is sent twice."""
    async def main(fake):
        async with AsyncProducer(fake.endpoint, "p-slow", context=fake.context, batch_acks=False, reply_timeout=0.3,
                                 heartbeat_interval=0.1, heartbeat_timeout=30.0) as producer:
            futures = []
            for i in range(8):
                futures += await send_plan(producer, f"slow{i}", plan(i))
            receipts = await asyncio.wait_for(asyncio.gather(*futures), PATIENCE)
            return receipts, producer.metrics.resends.values
    with FakeBroker(delay=1.5) as fake:
        receipts, resends = asyncio.run(main(fake))
    assert all(r.applied for r in receipts) and not sum(resends.values())
    frames = [seq for kind, seq in fake.seen if kind in ("turn", "end")]
    assert len(frames) == 32 and len(set(frames)) == 32


def test_a_reply_lost_before_an_answered_ping_is_resent_once():
    """A broker that lost one ack (its send failed) but answers the ping sent
    after that frame: the producer resends just that frame, and settles it
    from the second answer."""
    async def main(fake):
        async with AsyncProducer(fake.endpoint, "p-lost", context=fake.context, batch_acks=False, reply_timeout=60.0,
                                 heartbeat_interval=0.1, heartbeat_timeout=30.0) as producer:
            traj = producer.trajectory("t", [1, 2])
            receipt = await asyncio.wait_for(await traj.turn([5], [-0.5], supports=[[5, 6]]), PATIENCE)
            return receipt, producer.metrics.resends.values
    with FakeBroker(drop_first_turn=True) as fake:
        receipt, resends = asyncio.run(main(fake))
    assert receipt.applied and sum(resends.values()) == 1
    assert [kind for kind, _ in fake.seen].count("turn") == 2


def test_a_producer_whose_io_loop_dies_raises_client_failed():
    """The same type a consumer raises when its I/O thread dies: waiting for
    a settlement and sending both raise it, naming the producer and the cause."""
    def dies(now):
        raise OSError("the loop's socket broke")

    async def main(fake):
        async with AsyncProducer(fake.endpoint, "p-dies", context=fake.context, heartbeat_interval=0.1,
                                 heartbeat_timeout=30.0) as producer:
            traj = producer.trajectory("t", [1, 2])
            await traj.turn([5], [-0.5], supports=[[5, 6]])  # unanswered: the broker answers after PATIENCE
            producer._session.heartbeat.lost = dies
            with pytest.raises(ClientFailed, match=r"producer 'p-dies' stopped: its I/O loop failed with OSError") as err:
                await asyncio.wait_for(producer.flush(), PATIENCE)
            assert isinstance(err.value.__cause__, OSError)
            with pytest.raises(ClientFailed):
                await traj.turn([6], [-0.5], supports=[[6]])
    with FakeBroker(delay=PATIENCE) as fake:
        asyncio.run(main(fake))


# -- the daemon ---------------------------------------------------------------------------------------
def daemon(broker, *args, env=None):
    command = [sys.executable, "-m", "rollstream.app.cli", "producer", "--broker-endpoint",
               broker.endpoints["producer"], "--metrics-port", "0", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def finish(process):
    _, err = process.communicate(timeout=PATIENCE)
    assert process.returncode == 0, err
    return err


@pytest.mark.slow
def test_the_synthetic_daemon_streams_sampled_groups_with_config_and_env(tmp_path):
    config = tmp_path / "producer.toml"
    config.write_text("[producer]\ntop_k = 8\ntop_p = 0.9\nturns = 3\n")
    with Broker(tmp_path) as broker:
        process = daemon(broker, "--config", str(config), "--trajectories", "6", "--group-size", "2",
                         "--response-tokens", "16", "--tool-tokens", "4", "--prompt-tokens", "8",
                         "--vocab-size", "5000", "--abort-rate", "0.4", "--seed", "3",
                         env={"ROLLSTREAM_PRODUCER_WINDOW": "4"})
        log = finish(process)
        got, deliveries = drain(broker, 6)
    assert "window=4" in log and "unsettled=0" in log
    assert deliveries == 6
    groups = {}
    for traj in got.values():
        groups.setdefault(traj.group_id, []).append(traj.sample_index)
        assert traj.group_size == 2 and 1 <= traj.turns <= 3
        assert traj.mask.contains(traj.tokens).all()  # every token lies in its support
        assert traj.mask.support_sizes.max() <= 8  # top_k from the TOML file
        assert traj.mask.ids.max() < 5000 and traj.prompt_tokens.max() < 5000
        assert traj.log_probs[traj.loss_mask == 1].max() <= 0.0
        if traj.gap is not None:
            assert (traj.gap.field, traj.status) == ("mask", "completed")
    assert len(groups) == 3 and all(len(members) == 2 for members in groups.values())
    assert sorted(i for members in groups.values() for i in members) == list(range(6))


def wait_for_line(stream, text):
    """Wait for `text` on a child's pipe. Reads the file descriptor directly:
    `select` cannot see lines a buffered `readline` has already pulled in."""
    fd = stream.fileno()
    deadline = time.monotonic() + PATIENCE
    seen = ""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"stream closed before {text!r}: {seen}"
            seen += chunk.decode(errors="replace")
            if text in seen:
                return
    raise AssertionError(f"no {text!r} line: {seen}")


@pytest.mark.slow
def test_sigterm_stops_cleanly_leaving_nothing_open(tmp_path):
    """A daemon running forever gets SIGTERM: it aborts what it has open,
    waits for the acks, exits 0 and leaves an empty spool and no open
    trajectory at the broker."""
    spool = tmp_path / "spool"
    with Broker(tmp_path) as broker:
        # A shutdown allowed to wait as long as a busy machine may need: the test is of a clean stop, not of its timeout.
        process = daemon(broker, "--trajectories", "0", "--rate", "40", "--turns", "4", "--vocab-size", "5000",
                         "--spool-dir", str(spool), "--producer-id", "p-term", "--shutdown-timeout", str(PATIENCE / 2))
        wait_for_line(process.stderr, "producer daemon running")
        wait_for(lambda: broker.status()["queued"] >= 3, PATIENCE, "three trajectories ready at the broker")
        process.send_signal(signal.SIGTERM)
        log = finish(process)
        status = broker.status()
    assert "stopping" in log and "producer stopped" in log and "unsettled=0" in log
    assert status["open"] == 0 and status["queued"] >= 3
    assert not [p for p in spool.iterdir() if p.name.startswith("seg-")]


@pytest.mark.slow
@pytest.mark.parametrize("mask_log_probs", [False, True])
def test_the_sglang_daemon_drives_a_generate_endpoint_with_its_tool(tmp_path, mask_log_probs):
    """With `--mask-log-probs` the daemon asks for every support id's
    log-prob (sampling_logprobs_mode support) and the trajectories carry
    them, 0.0 at the tool's forced tokens."""
    # Answers are a function of the request: with seed 20, the daemon's prompts end one group completed after three
    # turns and one truncated after two.
    with FakeSGLang(vocab_size=1000, seed=20) as fake, Broker(tmp_path) as broker:
        process = daemon(broker, "--source", "sglang", "--sglang-url", fake.url, "--trajectories", "4",
                         "--group-size", "2", "--turns", "3", "--response-tokens", "4", "--tool-tokens", "2",
                         "--prompt-tokens", "6", "--vocab-size", "1000", "--concurrency", "2",
                         "--mask-log-probs", str(mask_log_probs).lower())
        finish(process)
        got, _ = drain(broker, 4)
    used = 0
    for traj in got.values():
        turns = episode_turns(fake.calls, traj.prompt_tokens.tolist(), traj.prompt_tokens.tolist() + traj.tokens.tolist())
        used += len(turns)
        assert turns and len(turns) == traj.turns
        assert as_lists(traj) == expected_merge(turns)
        for turn in turns[:-1]:  # the tool's observation sits between turns
            assert turn["finish"] == "stop" and turn["forced"][0] == 998 and turn["forced"][-1] == 999
        assert len(turns) == 3 or turns[-1]["finish"] == "length"
        assert traj.status == ("truncated" if turns[-1]["finish"] == "length" else "completed")
        assert traj.reward == (1.0 if turns[-1]["finish"] == "stop" else 0.0)
        assert traj.weight_versions == ["7"] * len(turns)
        if mask_log_probs:
            expected = [x for turn in turns for x in [*(x for row in turn["support_log_probs"] for x in row),
                                                      *[0.0] * len(turn["forced"])]]
            assert traj.mask_log_probs.tobytes() == np.asarray(expected, "<f4").tobytes()
        else:
            assert traj.mask_log_probs is None
    assert used == len(fake.calls)  # every engine call became a turn
    assert {t.status for t in got.values()} == {"completed", "truncated"}  # both ends covered (the seed chosen so)


@pytest.mark.slow
def test_the_replay_daemon_streams_jsonl_and_miles_payloads(tmp_path):
    recordings = tmp_path / "recorded"
    recordings.mkdir()
    events = [
        {"type": "turn", "trajectory_id": "r-1", "prompt_tokens": [1, 2], "tokens": [10, 11], "log_probs": [-0.5, -0.25],
         "supports": [[10, 3], [11]], "forced_tokens": [20], "weight_version": "v1", "metadata": {"source": "test"}},
        {"type": "turn", "trajectory_id": "r-2", "prompt_tokens": [5], "tokens": [50], "log_probs": [-1.0],
         "mask_ids": [50, 51], "mask_offsets": [0, 2]},
        {"type": "turn", "trajectory_id": "r-1", "turn": 1, "output_ids": [30],
         "meta_info": {"finish_reason": {"type": "length"}, "output_token_sampling_mask": [[30, 31]],
                       "output_token_sampling_logprobs": [-0.125]}},
        {"type": "abort", "trajectory_id": "r-2", "reason": "retry"},
        {"type": "end", "trajectory_id": "r-1", "reward": 2.0},
        {"type": "turn", "trajectory_id": "r-2", "prompt_tokens": [5], "tokens": [52], "log_probs": [-0.5],
         "supports": [[52]]},
        {"type": "end", "trajectory_id": "r-2", "reward": {"score": 1}},
        # Every support id's log-prob: native (said renormalised), then as SGLang's support mode sends them.
        {"type": "turn", "trajectory_id": "r-3", "prompt_tokens": [5], "tokens": [61], "log_probs": [float(np.log(0.75))],
         "supports": [[60, 61]], "mask_log_probs": [float(np.log(0.25)), float(np.log(0.75))],
         "mask_log_probs_normalized": True, "forced_tokens": [62]},
        {"type": "turn", "trajectory_id": "r-3", "output_ids": [70],
         "meta_info": {"output_token_sampling_mask": [[70, 71]],
                       "output_token_sampling_logprobs": [[float(np.log(0.625)), float(np.log(0.375))]]}},
        {"type": "end", "trajectory_id": "r-3", "reward": 1.0},
    ]
    (recordings / "a.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    samples = [
        {"tokens": np.array([7, 8, 60], np.int64), "response_length": 1, "loss_mask": np.ones(1, np.uint8),
         "rollout_log_probs": np.array([-0.75]), "rollout_sampling_mask": SamplingMask.from_supports([[60, 61]]),
         "status": "completed", "weight_versions": [], "metadata": {}},
        {"tokens": np.array([7, 8, 60, 70, 71, 80], np.int64), "response_length": 1, "loss_mask": np.ones(1, np.uint8),
         "rollout_log_probs": np.array([-0.5]), "rollout_sampling_mask": SamplingMask.from_supports([[80]]),
         "status": "completed", "weight_versions": [], "metadata": {}},
    ]
    payload = encode_session_samples(samples, {"trajectory_id": "m-1", "reward": 3.0}, fields=FIELDS_WITH_MASK)
    (recordings / "b.safetensors").write_bytes(payload)
    with Broker(tmp_path) as broker:
        finish(daemon(broker, "--source", "replay", "--replay-path", str(recordings), "--vocab-size", "1000"))
        got, deliveries = drain(broker, 4)
    assert deliveries == 4
    r1 = got["r-1"]
    assert r1.prompt_tokens.tolist() == [1, 2]
    assert as_lists(r1) == expected_merge([
        {"tokens": [10, 11], "supports": [[10, 3], [11]], "log_probs": [-0.5, -0.25], "forced": [20]},
        {"tokens": [30], "supports": [[30, 31]], "log_probs": [-0.125]},
    ])
    assert (r1.status, r1.reward, r1.weight_versions, r1.metadata["source"]) == ("truncated", 2.0, ["v1"], "test")
    r2 = got["r-2"]  # the aborted attempt is gone; the retry is what arrives
    assert r2.tokens.tolist() == [52] and r2.reward == {"score": 1} and r2.turns == 1
    assert r1.mask_log_probs is None
    r3 = got["r-3"]
    assert r3.tokens.tolist() == [61, 62, 70] and r3.mask.ids.tolist() == [60, 61, 62, 70, 71]
    assert r3.mask_log_probs.tobytes() == np.float32(np.log([0.25, 0.75, 1.0, 0.625, 0.375])).tobytes()
    assert r3.log_probs.tobytes() == np.float32(np.log([0.75, 1.0, 0.625])).tobytes()
    m1 = got["m-1"]
    assert m1.prompt_tokens.tolist() == [7, 8] and m1.reward == 3.0
    assert as_lists(m1) == expected_merge([
        {"tokens": [60], "supports": [[60, 61]], "log_probs": [-0.75], "forced": [70, 71]},
        {"tokens": [80], "supports": [[80]], "log_probs": [-0.5]},
    ])


@pytest.mark.slow
def test_a_recorded_trajectory_the_broker_refuses_is_given_up_and_the_replay_goes_on(tmp_path):
    """The broker's vocabulary is smaller than the producer's: a recorded
    turn with an id past it is refused. That trajectory (a line recording's,
    then a payload's) is given up, aborted and in the ledger; the rest of
    its recorded attempt is skipped, its retry after the recorded abort is
    sent, and the replay goes on to the others."""
    recordings = tmp_path / "recorded"
    recordings.mkdir()
    events = [
        {"type": "turn", "trajectory_id": "bad", "prompt_tokens": [1], "tokens": [5000], "log_probs": [-0.5],
         "supports": [[5000]]},
        {"type": "turn", "trajectory_id": "bad", "tokens": [7], "log_probs": [-0.5], "supports": [[7]]},
        {"type": "abort", "trajectory_id": "bad", "reason": "retry"},
        {"type": "turn", "trajectory_id": "bad", "prompt_tokens": [1], "tokens": [8], "log_probs": [-0.5],
         "supports": [[8, 9]]},
        {"type": "end", "trajectory_id": "bad", "reward": 1.0},
        {"type": "turn", "trajectory_id": "good", "prompt_tokens": [2], "tokens": [10], "log_probs": [-0.5],
         "supports": [[10]]},
        {"type": "end", "trajectory_id": "good", "reward": 2.0},
    ]
    (recordings / "a.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")
    sample = {"tokens": np.array([7, 8, 5001], np.int64), "response_length": 1, "loss_mask": np.ones(1, np.uint8),
              "rollout_log_probs": np.array([-0.75]), "rollout_sampling_mask": SamplingMask.from_supports([[5001]]),
              "status": "completed", "weight_versions": [], "metadata": {}}
    payload = encode_session_samples([sample], {"trajectory_id": "bad-payload", "reward": 3.0}, fields=FIELDS_WITH_MASK)
    (recordings / "b.safetensors").write_bytes(payload)
    ledger = tmp_path / "ledger.jsonl"
    with Broker(tmp_path, "--vocab-size", "1000") as broker:
        err = finish(daemon(broker, "--source", "replay", "--replay-path", str(recordings), "--ledger", str(ledger)))
        got, _ = drain(broker, 2)
        status = broker.status()
    assert set(got) == {"bad", "good"} and "Traceback" not in err
    assert got["bad"].tokens.tolist() == [8] and got["bad"].reward == 1.0  # the retry, not the refused attempt
    assert got["good"].tokens.tolist() == [10]
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    given_up = {(r["id"], r["reason"]) for r in records if r["kind"] == "given_up"}
    assert given_up == {("bad", "turn 0 refused: out_of_vocab"), ("bad-payload", "turn 0 refused: out_of_vocab")}
    assert status["open"] == 0


def test_a_recorded_turn_says_renormalised_with_true_or_false_and_is_held_to_it():
    event = {"tokens": [61], "log_probs": [-0.5], "supports": [[60, 61]], "mask_log_probs": [-1.0, -0.5]}
    assert not turn_of(event, None).mask_log_probs_normalized
    with pytest.raises(ReplayError, match="rule 'mask_log_probs_normalized is true or false' not met: got 'yes'"):
        turn_of(dict(event, mask_log_probs_normalized="yes"), None)
    with pytest.raises(LocalProtocolError, match="each support's probabilities sum to 1") as info:  # 0.37 + 0.61
        turn_of(dict(event, mask_log_probs_normalized=True), None)
    assert info.value.code == "invalid_value"


@pytest.mark.slow
def test_a_payload_as_a_newer_miles_writes_it_round_trips_and_replays_with_its_per_turn_versions(tmp_path):
    """Per-call weight-version spans (one sample holds two calls, one call
    spans two versions), a mask-less sample after masked ones (a replay
    gap), the top-k pair, routed experts and a JSON field this codec does
    not know: it decodes, re-encodes byte-identical, and a consumer gets the
    turns up to the gap with the version of each turn's first token."""
    def span(version, start, end):
        return {"version": version, "abs_start": start, "abs_end": end}

    def turn(tokens, response_length, spans, supports, **more):
        n = len(tokens)
        return {"tokens": np.array(tokens, np.int64), "response_length": response_length,
                "loss_mask": np.ones(response_length, np.uint8), "rollout_log_probs": np.full(response_length, -0.5),
                "rollout_topk_token_ids": np.zeros((response_length, 2), np.int32),
                "rollout_topk_log_probs": np.full((response_length, 2), -1.0, np.float32),
                "rollout_sampling_mask": None if supports is None else SamplingMask.from_supports(supports),
                "rollout_routed_experts": np.full((n - 1, 1, 1), n, np.int32), "status": "completed",
                "weight_versions": spans, "lineage_note": f"turn of {n}", **more}

    samples = [
        turn([7, 8, 60], 1, [[span("5", 2, 3)]], [[60, 61]]),
        turn([7, 8, 60, 70, 71, 80, 81], 2, [[span("5", 2, 3)], [span("6", 5, 6), span("7", 6, 7)]], [[80], [81, 82]]),
        turn([7, 8, 60, 70, 71, 80, 81, 90, 95], 1, [[span("8", 8, 9)]], None),
    ]
    fields = (*DEFAULT_FIELDS, "lineage_note", MASK_FIELD)
    payload = encode_session_samples(samples, {"trajectory_id": "m-2", "reward": 1.0}, fields=fields,
                                     unknown={"lineage_note": SessionField("json")})
    decoded = decode_session_samples(payload)
    assert list(decoded.unknown) == ["lineage_note"] and decoded.encode() == payload
    recordings = tmp_path / "recordings"
    recordings.mkdir()
    (recordings / "m-2.safetensors").write_bytes(payload)
    with Broker(tmp_path) as broker:
        finish(daemon(broker, "--source", "replay", "--replay-path", str(recordings), "--vocab-size", "1000"))
        got, deliveries = drain(broker, 1)
    m2 = got["m-2"]
    assert deliveries == 1 and m2.prompt_tokens.tolist() == [7, 8]
    assert m2.weight_versions == ["5", "6"]  # the gap turn (no mask) is recorded, not applied
    assert m2.weight_version_spans == [(("5", 0, 1),), (("6", 3, 4), ("7", 4, 5))]  # response positions
    assert m2.gap.turn == 2 and m2.tokens.tolist() == [60, 70, 71, 80, 81] and m2.loss_mask.tolist() == [1, 0, 0, 1, 1]
    assert m2.routed_experts.shape == (6, 1, 1)


@pytest.mark.slow
def test_the_model_daemon_streams_rollouts_a_trainer_replays_exactly(tmp_path):
    """Rollouts sampled from the small torch LM reach a consumer with their
    weight version, and the same weights recompute every delivered
    log-prob over the delivered supports; the reward is the environment's."""
    import torch

    from rollstream.app.tiny_lm import TinyLM
    from rollstream.consumer.primitives import masked_log_probs

    with Broker(tmp_path) as broker:
        finish(daemon(broker, "--source", "model", "--trajectories", "4", "--group-size", "2", "--turns", "2",
                      "--prompt-tokens", "8", "--response-tokens", "6", "--tool-tokens", "3", "--vocab-size", "5000",
                      "--top-k", "20", "--top-p", "0.9", "--temperature", "0.9", "--seed", "2"))
        got, deliveries = drain(broker, 4)
    assert deliveries == 4
    model = TinyLM(seed=2).eval()
    for traj in got.values():
        assert traj.weight_versions == ["seed-2"] * 2 and traj.group_size == 2 and traj.turns == 2  # one per turn
        assert len(traj.tokens) == 6 + 3 + 6 and traj.loss_mask.tolist() == [1] * 6 + [0] * 3 + [1] * 6
        sampled = traj.tokens[traj.loss_mask == 1]
        assert traj.reward == pytest.approx(float(np.mean(sampled % 8 == 0)))
        sequence = torch.as_tensor(np.concatenate([traj.prompt_tokens, traj.tokens]), dtype=torch.int64)[None]
        with torch.no_grad():
            logits = model(sequence)[0, len(traj.prompt_tokens) - 1:-1]
        rows = torch.as_tensor(np.flatnonzero(traj.loss_mask == 1))
        replayed = masked_log_probs(logits[rows], torch.as_tensor(sampled.copy()), torch.as_tensor(traj.mask.ids.copy()),
                                    torch.as_tensor(traj.mask.offsets.copy()), rows, temperature=0.9)
        np.testing.assert_allclose(replayed.numpy(), traj.log_probs[traj.loss_mask == 1], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_bad_settings_and_recordings_are_refused_with_the_rule(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "producer", "--turns", "0"],
                         capture_output=True, text=True, timeout=PATIENCE, check=False)
    assert bad.returncode == 2 and "turns must be a whole number of turns >= 1, got 0 (flag --turns) [rule: range]" in bad.stderr
    recording = tmp_path / "bad.jsonl"
    recording.write_text(json.dumps({"type": "turn", "trajectory_id": "x", "prompt_tokens": [1], "turn": 1,
                                     "tokens": [1], "log_probs": [0.0]}) + "\n")
    with Broker(tmp_path) as broker:
        process = daemon(broker, "--source", "replay", "--replay-path", str(recording))
        _, err = process.communicate(timeout=PATIENCE)
    assert process.returncode != 0
    assert f"{recording}:1: turn of 'x' must be 0 (line order), got 1" in err and "Traceback" not in err
    payload = tmp_path / "bad.safetensors"
    payload.write_bytes(b"not a safetensors payload")
    with Broker(tmp_path) as broker:
        process = daemon(broker, "--source", "replay", "--replay-path", str(payload))
        _, err = process.communicate(timeout=PATIENCE)
    assert process.returncode != 0
    assert f"{payload}: not a miles session payload: payload is not a valid safetensors container" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_producers_opened_and_closed_one_after_another_never_stall_the_context(tmp_path):
    """Closing a producer must not leave libzmq's I/O thread (shared by every
    socket of the context) blocked on a connection event for the closed
    monitor. Each round closes one producer at once, before its connection
    is even up, then sends a turn through a second: with the monitor closed
    first, the I/O thread stalled within a few dozen rounds, and every later
    hello went unanswered."""
    context = zmq.Context()

    async def one(broker, i):
        async with AsyncProducer(broker.endpoints["producer"], f"brief-{i}", context=context):
            pass
        async with AsyncProducer(broker.endpoints["producer"], f"p-{i}", context=context) as producer:
            receipt = await asyncio.wait_for(
                producer.trajectory(f"t-{i}", [1]).turn_and_wait(np.array([3], np.int32), np.array([-0.5], np.float32)),
                PATIENCE)
            return receipt.applied

    try:
        with Broker(tmp_path) as broker:
            assert all(asyncio.run(one(broker, i)) for i in range(150))
    finally:
        context.destroy(linger=0)


def test_admitted_waits_while_the_job_holds_its_staleness_capacity_and_goes_once_there_is_room(tmp_path):
    """A trainer publishes a capacity of one trajectory (max_staleness 0, a
    step of 1): the producer may start one, then waits until it is gone."""
    async def main(broker):
        async with AsyncProducer(broker.endpoints["producer"], "p-admit", heartbeat_interval=0.2) as producer, \
                AsyncProducer(broker.endpoints["producer"], "p-waits", heartbeat_interval=0.2) as waiting:
            assert await producer.admitted(timeout=5)
            traj = producer.trajectory("t0", [1, 2])
            await (await traj.turn([10], [-0.5], supports=[[10, 4]], weight_version="step-3"))
            async with asyncio.timeout(PATIENCE):  # until its next pong says the job holds 1 of 1
                while waiting.admission != 0:
                    await asyncio.sleep(0.05)
            waited = await waiting.admitted(timeout=1.0)
            await (await traj.abort("retry"))  # gone: room for one, which the waiting one hears of in a pong only
            return waited, await waiting.admitted(timeout=5)

    with Broker(tmp_path, "--max-staleness", "0") as broker:
        trainer = zmq.Context.instance().socket(zmq.DEALER)
        trainer.setsockopt(zmq.LINGER, 0)
        trainer.connect(broker.endpoints["consumer"])
        trainer.send_multipart(encode(CONSUMER_TO_BROKER, "hello", {"consumer_id": "trainer"}))
        trainer.send_multipart(encode(CONSUMER_TO_BROKER, "policy", {"version": 3, "per_step": 1}))
        assert trainer.poll(PATIENCE * 1000) and decode(trainer.recv_multipart(), BROKER_TO_CONSUMER).type == "welcome"
        assert trainer.poll(PATIENCE * 1000) and decode(trainer.recv_multipart(), BROKER_TO_CONSUMER).type == "policy"
        waited, admitted = asyncio.run(main(broker))
        trainer.close()
    assert (waited, admitted) == (False, True)


def test_a_reward_that_comes_later_from_the_producer_or_a_reward_service_reaches_the_trainer(tmp_path):
    async def main(broker):
        async with AsyncProducer(broker.endpoints["producer"], "p-rollout") as producer, \
                AsyncProducer(broker.endpoints["producer"], "p-verifier") as verifier:
            mine, theirs = producer.trajectory("mine", [1, 2]), producer.trajectory("theirs", [1, 2])
            for traj in (mine, theirs):
                await (await traj.turn([10], [-0.5], supports=[[10, 4]]))
                assert (await (await traj.end())).applied  # no reward yet
            early = await verifier.reward("nobody", 1.0)
            refused = None
            try:
                await early
            except Refused as error:
                refused = error.code
            later = [await (await mine.reward(0.25)), await (await verifier.reward("theirs", {"score": 1.0}))]
            return refused, later

    with Broker(tmp_path) as broker:
        refused, later = asyncio.run(main(broker))
        got, _ = drain(broker, 2)
    assert refused == "unknown_trajectory"
    assert [(r.kind, r.applied) for r in later] == [("reward", True), ("reward", True)]
    assert (got["mine"].reward, got["theirs"].reward) == (0.25, {"score": 1.0})
