"""Fan-in: one consumer reading from N brokers, and what an idle broker costs.

For each N of `--brokers`, the same `--trajectories` queued single-turn
trajectories (256 tokens, 4 ids per token) are spread evenly over N fresh
`rollstream broker` processes on loopback (filled first, each broker's
status read until it holds its share queued). Then one library `Consumer`
over all N consumer endpoints (its own process) takes batches of
`--batch-size` and commits each until it has them all. Its CPU (every
thread, user and system: `time.process_time` in that process) and its wall
time are counted from its first `next_batch` to its last commit, per
trajectory; every trajectory must arrive exactly once. The Ns run
interleaved, `--reps` times, and medians are reported.

The idle figure: one fresh broker with nothing connected, its whole CPU
(every thread's, from the scheduler's nanosecond counts) over
`--idle-seconds`, as a share of one core.

The last line is one JSON object: `fanin_cpu_ratio_<N>` and
`fanin_wall_ratio_<N>` (N brokers' consumer CPU and wall per trajectory over
one broker's), `consumer_cpu_us_per_traj_<N>`, `consumer_wall_us_per_traj_<N>`,
`idle_broker_cpu_share`, and `received_once` (every rep of every N got
every trajectory exactly once).

    .venv/bin/python bench/fanin.py [--brokers 1,8,32,64] [--trajectories 4096] [--reps 3] [--idle-seconds 60]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zmq
from procs import Broker, parse_args, thread_cpu

from rollstream.common.admin import AdminClient

VOCAB = 151_936
TOKENS = 256
IDS_PER_TOKEN = 4
SMOKE = {"brokers": "1,4", "trajectories": 128, "reps": 1, "idle_seconds": 2.0}


def _fill(endpoints: list[str], trajectories: int, tag: str) -> None:
    """Send `trajectories` single-turn trajectories, dealt round-robin over
    the brokers' producer `endpoints`, and wait for every ack."""
    from rollstream.producer import AsyncProducer

    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, TOKENS * IDS_PER_TOKEN, dtype=np.int32)
    offsets = np.arange(TOKENS + 1, dtype=np.int64) * IDS_PER_TOKEN
    tokens, log_probs = ids[offsets[:-1]].copy(), np.full(TOKENS, -0.5, np.float32)
    prompt = np.arange(32, dtype=np.int32)
    context = zmq.Context()

    async def one(index: int, endpoint: str) -> None:
        async with AsyncProducer(endpoint, f"fanin-{tag}-{index}", context=context) as producer:
            for number in range(index, trajectories, len(endpoints)):
                trajectory = producer.trajectory(f"{tag}-t{number}", prompt)
                await trajectory.turn(tokens, log_probs, mask_ids=ids, mask_offsets=offsets)
                await trajectory.end(0.0)
            await producer.flush()

    async def run() -> None:
        await asyncio.gather(*(one(i, endpoint) for i, endpoint in enumerate(endpoints)))

    asyncio.run(run())
    context.term()


def _wait_queued(brokers: list[Broker], trajectories: int, timeout: float = 120.0) -> None:
    """Until the brokers hold every trajectory queued (each its share)."""
    deadline = time.monotonic() + timeout
    while True:
        queued = 0
        for broker in brokers:
            with AdminClient(broker.admin, timeout=10.0) as admin:
                queued += admin.status()["queued"]
        if queued >= trajectories:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the brokers must hold {trajectories} queued trajectories within {timeout} s, hold {queued}")
        time.sleep(0.1)


def _consume(conn, endpoints: list[str], trajectories: int, batch_size: int) -> None:
    """The measured consumer: every trajectory, in committed batches; its
    CPU and wall seconds from the first request to the last commit, and
    how many it got, and how many of them were distinct."""
    from rollstream.consumer import Consumer

    with Consumer(endpoints, batch_size=batch_size, vocab_size=VOCAB, device="cpu") as consumer:
        conn.send("ready")
        conn.recv()
        ids: list[str] = []
        cpu, wall = time.process_time(), time.perf_counter()
        while len(ids) < trajectories:
            batch = consumer.next_batch(timeout=120, partial_after=0 if trajectories - len(ids) < batch_size else None)
            consumer.commit(batch)
            ids += batch.trajectory_ids
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    conn.send({"cpu": cpu, "wall": wall, "received": len(ids), "distinct": len(set(ids))})


def one_run(count: int, trajectories: int, batch_size: int, tag: str) -> dict:
    """N=`count` fresh brokers filled, drained by one consumer: its figures."""
    with ThreadPoolExecutor(8) as pool:
        brokers = list(pool.map(lambda _: Broker(VOCAB), range(count)))
    try:
        ctx = mp.get_context("spawn")
        filler = ctx.Process(target=_fill, args=([b.producer for b in brokers], trajectories, tag))
        filler.start()
        filler.join()
        if filler.exitcode:
            raise RuntimeError(f"the filling producer failed with exit code {filler.exitcode}")
        _wait_queued(brokers, trajectories)
        ours, theirs = ctx.Pipe()
        consumer = ctx.Process(target=_consume, args=(theirs, [b.consumer for b in brokers], trajectories, batch_size))
        consumer.start()
        if not ours.poll(120):
            raise RuntimeError("the consumer must connect within 120 s")
        ours.recv()
        ours.send("go")
        if not ours.poll(600):
            raise RuntimeError("the consumer must receive every trajectory within 600 s")
        result = ours.recv()
        consumer.join()
        return result
    finally:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(Broker.close, brokers))


def _all_threads_cpu(pid: int) -> float:
    """CPU seconds of every thread the process has now, at the scheduler's
    nanosecond resolution (an idle broker spends less than a clock tick a
    second, which /proc/<pid>/stat counts in)."""
    return sum(thread_cpu(pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task"))


def idle_share(seconds: float) -> float:
    """One fresh broker's whole CPU over `seconds` with nothing connected, as a share of a core."""
    broker = Broker(VOCAB)
    try:
        time.sleep(1.0)  # past start-up (the first housekeeping, the store's first measures)
        before, start = _all_threads_cpu(broker.pid), time.perf_counter()
        time.sleep(seconds)
        return (_all_threads_cpu(broker.pid) - before) / (time.perf_counter() - start)
    finally:
        broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--brokers", default="1,8,32,64", help="broker counts, comma-separated (the first is the baseline)")
    parser.add_argument("--trajectories", type=int, default=4096, help="queued trajectories in all, spread over the brokers")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="interleaved rounds over the broker counts")
    parser.add_argument("--idle-seconds", type=float, default=60.0, help="how long the idle broker is measured")
    args = parse_args(parser, SMOKE)
    counts = [int(n) for n in str(args.brokers).split(",")]

    per: dict[int, list[dict]] = {n: [] for n in counts}
    for rep in range(args.reps):
        for n in counts:
            result = one_run(n, args.trajectories, args.batch_size, f"r{rep}n{n}")
            per[n].append(result)
            print(f"rep {rep}: {n:>3} brokers: consumer {result['cpu'] / args.trajectories * 1e6:7.1f} µs CPU, "
                  f"{result['wall'] / args.trajectories * 1e6:7.1f} µs wall per trajectory; "
                  f"received {result['received']}, distinct {result['distinct']}", flush=True)
    idle = idle_share(args.idle_seconds)
    print(f"idle broker: {idle * 100:.3f}% of a core over {args.idle_seconds:.0f} s")

    summary: dict = {}
    base = counts[0]
    cpu = {n: statistics.median(r["cpu"] for r in per[n]) / args.trajectories for n in counts}
    wall = {n: statistics.median(r["wall"] for r in per[n]) / args.trajectories for n in counts}
    for n in counts:
        summary[f"consumer_cpu_us_per_traj_{n}"] = round(cpu[n] * 1e6, 1)
        summary[f"consumer_wall_us_per_traj_{n}"] = round(wall[n] * 1e6, 1)
    for n in counts[1:]:
        summary[f"fanin_cpu_ratio_{n}"] = round(cpu[n] / cpu[base], 3)
        summary[f"fanin_wall_ratio_{n}"] = round(wall[n] / wall[base], 3)
    summary["idle_broker_cpu_share"] = round(idle, 5)
    summary["received_once"] = all(r["received"] == r["distinct"] == args.trajectories for rs in per.values() for r in rs)
    summary.update(trajectories=args.trajectories, batch_size=args.batch_size, reps=args.reps)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
