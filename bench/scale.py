"""The broker at scale, through the public API: open trajectories,
producer connections, support size and memory budget.

Every configuration runs on a fresh `rollstream broker` (durable defaults,
loopback TCP) fed by producer processes using the library's `AsyncProducer`
and drained by one library `Consumer` (batches of 32, validated,
committed; N is rounded up to whole batches). The configurations are interleaved, rep by rep, and medians
are reported.

- open: N trajectories of T turns of 256 tokens (8 ids per token), sent in
  waves of K interleaved trajectories (turn 0 of all K, then turn 1 of all
  K, ..., then their ends), so the broker holds K open at once. Every K
  sends the same N trajectories, so the per-frame figures compare the same
  work.
- conn: P producer connections (one process), each with its share of the
  trajectories, all sending at once: ack latency and resends at saturation.
- support: 64-token turns with S ids per token (S=4,096: 1 MiB turn
  frames): frame bytes per second of broker CPU, all of it (every thread,
  user and system time: what the broker costs the node), and of its main
  thread alone.
- budget: K=1,000 open trajectories under a memory budget, end to end.
- bound: K open trajectories whose turns carry a policy version, on a
  broker with a staleness bound its consumer publishes a version to
  (admission, version ordering and the stale check all run; the bound is
  too wide to drop or hold anything) against the same frames on a broker
  without one: what the bookkeeping costs per frame.

Printed per configuration: broker CPU per frame (its main thread; the whole
process, every thread, user + system; the system time in it), peak RSS
against the largest `bytes_in_memory` the broker reported, frames/s, ack
p50/p99 (from a frame accepted by the producer to its receipt), resends,
the time from the last `end` acked to the last trajectory committed
(drain), consumer redeliveries, and whether every trajectory was committed
exactly once with its full length. The last line
is one JSON object; its `support_4096_*` keys:

- `support_4096_gbps`: GB of frame bytes per second of the broker's whole
  CPU time (/proc/<pid>/stat utime + stime: every thread, user and system);
- `support_4096_gbps_main_thread`: the same over the main thread's CPU
  time alone (what the poll loop can carry, not what the broker costs);
- `support_4096_sys_share`: system time over the whole CPU time;
- `support_4096_{main_thread,other_threads,system}_us_per_turn`: the whole
  CPU time per 1 MiB turn frame split two ways: main thread + other threads
  (ZeroMQ's I/O thread, the content checker, the store's writer, pyzmq's
  zero-copy collector) = the whole, and the system time within it;
- `support_4096_minor_faults_per_turn`: the broker's minor page faults per
  turn frame (256 is a whole fresh 1 MiB buffer touched).

`--smoke` runs four small configurations once (conn, budget, and bound
off and on), to check the script end to end.

    .venv/bin/python bench/scale.py [--reps 2] [--open 10,10000,50000] [--trajectories 50000]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import statistics
import threading
import time

import numpy as np
import zmq
from procs import Broker, parse_args, peak_rss, process_times, thread_cpu

VOCAB = 151_936

# The sizes of --smoke: four small configurations, several connections, a budget below what is open, and the
# bound's pair (whose `off` side is an `open` run with versioned turns); `open` and `support` add nothing those lack.
SMOKE = {"reps": 1, "open": [], "trajectories": 64, "connections": [4], "conn_trajectories": 64, "supports": [],
         "budgets": ["1MiB"], "budget_trajectories": 64, "bound": [8]}


# -- the producer and consumer processes --------------------------------------
def turn_arrays(tokens: int, ids_per_token: int, seed: int) -> dict:
    """One turn's arrays: each token is the first id of its own support."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, tokens * ids_per_token, dtype=np.int32)
    offsets = np.arange(tokens + 1, dtype=np.int64) * ids_per_token
    return {"tokens": ids[offsets[:-1]].copy(), "log_probs": np.full(tokens, -0.5, np.float32),
            "mask_ids": ids, "mask_offsets": offsets}


def _producer_main(conn, endpoint: str, plan: dict) -> None:
    """Send `plan`: connections × their trajectories, in waves of `open`;
    report ack latencies, resends and the time of the last receipt."""
    from rollstream.producer import AsyncProducer

    arrays = [turn_arrays(plan["tokens"], plan["ids"], seed) for seed in range(4)]
    prompt = np.arange(64, dtype=np.int32)

    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 4 * plan["connections"] + 64)  # two sockets per producer (its own and its monitor)

    async def one(index: int, tids: list[str], latencies: list, state: dict) -> None:
        async with AsyncProducer(endpoint, f"scale-{plan['tag']}-{index}", context=context) as producer:
            loop = asyncio.get_running_loop()
            for start in range(0, len(tids), plan["open"]):
                wave = [producer.trajectory(tid, prompt) for tid in tids[start:start + plan["open"]]]
                for turn in range(plan["turns"]):
                    for k, traj in enumerate(wave):
                        part = arrays[(k + turn) % len(arrays)]
                        future = await traj.turn(part["tokens"], part["log_probs"], mask_ids=part["mask_ids"],
                                                 mask_offsets=part["mask_offsets"], weight_version=plan["version"])
                        accepted = loop.time()  # the wait for room in the window is not the broker's
                        future.add_done_callback(lambda _, at=accepted: latencies.append(loop.time() - at))
                for traj in wave:
                    await traj.end(0.0)
            await producer.flush()
            state["resends"] += int(sum(producer.metrics.resends.values.values()))
            state["last_ack"] = max(state["last_ack"], time.perf_counter())

    async def run() -> dict:
        shares = [plan["tids"][i::plan["connections"]] for i in range(plan["connections"])]
        latencies: list[float] = []
        state = {"resends": 0, "last_ack": 0.0}
        await asyncio.gather(*(one(i, share, latencies, state) for i, share in enumerate(shares) if share))
        latencies.sort()
        return {"p50": latencies[len(latencies) // 2], "p99": latencies[int(0.99 * (len(latencies) - 1))],
                "resends": state["resends"], "last_ack": state["last_ack"]}

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a few descriptors per connection
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    conn.send("ready")
    conn.recv()
    conn.send(asyncio.run(run()))


def _consumer_main(conn, endpoint: str, expected: int, publish: bool) -> None:
    from rollstream.consumer import Consumer

    with Consumer(endpoint, batch_size=BATCH, vocab_size=VOCAB, device="cpu") as consumer:
        if publish:  # the trainer's version, for the broker's staleness bound
            consumer.set_policy_version(0)
        conn.send("ready")
        lengths: dict[str, list[int]] = {}
        received, last = 0, 0.0
        while received < expected:
            batch = consumer.next_batch(timeout=1800)
            consumer.commit(batch)
            last = time.perf_counter()
            received += len(batch)
            for tid, length in zip(batch.trajectory_ids, batch.response_lengths.tolist()):
                lengths.setdefault(tid, []).append(length)
    conn.send({"lengths": lengths, "last": last})


# -- one configuration ------------------------------------------------------------
def _status(admin) -> dict:
    from rollstream.common.codec import decode, encode
    from rollstream.common.messages import ADMIN_REPLIES, ADMIN_REQUESTS

    admin.send_multipart(encode(ADMIN_REQUESTS, "status", {}))
    if not admin.poll(10_000):
        return {}
    return decode(admin.recv_multipart(), ADMIN_REPLIES).fields


def run_config(name: str, *, trajectories: int, open_at_once: int, turns: int, tokens: int, ids: int,
               connections: int = 1, broker_args: list[str] = (), version: str | None = None,
               publish: bool = False) -> dict:
    broker = Broker(VOCAB, list(broker_args))
    ctx = mp.get_context("spawn")
    tids = [f"{name}-{i}" for i in range(trajectories)]
    plan = {"tag": name, "tids": tids, "open": open_at_once, "turns": turns, "tokens": tokens, "ids": ids,
            "connections": connections, "version": version}
    producer_end, producer_child = ctx.Pipe()
    consumer_end, consumer_child = ctx.Pipe()
    children = [ctx.Process(target=_producer_main, args=(producer_child, broker.producer, plan), daemon=True),
                ctx.Process(target=_consumer_main, args=(consumer_child, broker.consumer, trajectories, publish),
                            daemon=True)]
    context = zmq.Context()
    admin = context.socket(zmq.DEALER)
    admin.connect(broker.admin)
    try:
        for child in children:
            child.start()
        for end in (producer_end, consumer_end):
            if not end.poll(300) or end.recv() != "ready":
                raise RuntimeError(f"{name}: a bench process did not start")
        largest = {"bytes_in_memory": 0}
        stop = threading.Event()

        def watch() -> None:  # the largest count the broker reports while it runs
            while not stop.wait(0.5):
                largest["bytes_in_memory"] = max(largest["bytes_in_memory"], _status(admin).get("bytes_in_memory", 0))

        main_cpu, whole = thread_cpu(broker.pid, broker.pid), process_times(broker.pid)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        started = time.perf_counter()
        producer_end.send("go")
        sent = producer_end.recv()
        got = consumer_end.recv()
        seconds = got["last"] - started
        stop.set()
        watcher.join()
        status = _status(admin)
        main_cpu, whole = thread_cpu(broker.pid, broker.pid) - main_cpu, process_times(broker.pid) - whole
        frames, turn_frames = trajectories * (turns + 1), trajectories * turns
        frame_bytes = turn_frames * sum(a.nbytes for a in turn_arrays(tokens, ids, 0).values())
        verified = (got["lengths"].keys() == set(tids)
                    and all(lengths == [turns * tokens] for lengths in got["lengths"].values()))
        return {
            "seconds": seconds, "frames_per_s": frames / seconds,
            "main_us_per_frame": main_cpu / frames * 1e6, "total_us_per_frame": whole.cpu / frames * 1e6,
            "sys_us_per_frame": whole.system / frames * 1e6,
            "main_us_per_turn": main_cpu / turn_frames * 1e6,
            "other_us_per_turn": max(0.0, whole.cpu - main_cpu) / turn_frames * 1e6,
            "sys_us_per_turn": whole.system / turn_frames * 1e6,
            "faults_per_turn": whole.minor_faults / turn_frames,
            "sys_share": whole.system / whole.cpu if whole.cpu else 0.0,
            "gbps": frame_bytes / whole.cpu / 1e9 if whole.cpu else 0.0,
            "main_gbps": frame_bytes / main_cpu / 1e9 if main_cpu else 0.0,
            "rss_mib": peak_rss(broker.pid) / 2**20, "bytes_in_memory_mib": largest["bytes_in_memory"] / 2**20,
            "ack_p50_s": sent["p50"], "ack_p99_s": sent["p99"], "resends": sent["resends"],
            "drain_s": max(0.0, got["last"] - sent["last_ack"]),
            "redeliveries": int(status.get("counters", {}).get("redeliveries", 0)), "verified": verified,
        }
    finally:
        for child in children:
            child.join(60)
            if child.is_alive():
                child.kill()
        context.destroy(linger=0)
        broker.close()


# -- the experiments --------------------------------------------------------------
BATCH = 32  # the consumer's batch size: it takes full batches only, so N is rounded up to a multiple
WIDE_BOUND = 1_000_000  # a staleness bound no run reaches: every check runs, nothing is dropped or held


def _whole_batches(n: int) -> int:
    return -(-n // BATCH) * BATCH


def configurations(args) -> dict[str, dict]:
    out = {}
    for k in args.open:
        out[f"open_{k}"] = dict(trajectories=_whole_batches(max(args.trajectories, k)), open_at_once=k, turns=8, tokens=256,
                                ids=8)
    for p in args.connections:
        out[f"conn_{p}"] = dict(trajectories=_whole_batches(args.conn_trajectories), open_at_once=8, turns=8, tokens=256, ids=8,
                                connections=p)
    for s in args.supports:
        out[f"support_{s}"] = dict(trajectories=_whole_batches(args.support_trajectories), open_at_once=16, turns=4, tokens=64,
                                   ids=s)
    for k in args.bound:  # the same versioned frames, without and with the bound
        for switch, extra in (("off", {}), ("on", {"broker_args": ["--max-staleness", str(WIDE_BOUND)], "publish": True})):
            out[f"bound_{switch}_{k}"] = dict(trajectories=_whole_batches(max(args.trajectories, k)), open_at_once=k,
                                              turns=8, tokens=256, ids=8, version="step-0", **extra)
    for label in args.budgets:
        out[f"budget_{label}"] = dict(trajectories=_whole_batches(args.budget_trajectories), open_at_once=1000, turns=8,
                                      tokens=256, ids=8, broker_args=["--max-memory-bytes", str(_bytes(label))])
    return out


def _bytes(label: str) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30}
    for suffix, scale in units.items():
        if label.lower().endswith(suffix):
            return int(float(label[: -len(suffix)]) * scale)
    return int(label)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--open", type=_ints, default=[10, 10_000, 50_000], help="open trajectories at once, K")
    parser.add_argument("--trajectories", type=int, default=50_000, help="trajectories per open configuration, N")
    parser.add_argument("--connections", type=_ints, default=[1, 128, 512], help="producer connections, P")
    parser.add_argument("--conn-trajectories", type=int, default=4096)
    parser.add_argument("--supports", type=_ints, default=[8, 512, 4096], help="ids per token, S")
    parser.add_argument("--support-trajectories", type=int, default=256)
    parser.add_argument("--budgets", type=lambda t: [x for x in t.split(",") if x], default=["2GiB", "64MiB", "16MiB"])
    parser.add_argument("--budget-trajectories", type=int, default=4000)
    parser.add_argument("--bound", type=_ints, default=[50_000], help="open trajectories at once with a staleness bound")
    parser.add_argument("--only", help="run only configurations whose name starts with one of these (comma-separated)")
    args = parse_args(parser, SMOKE)
    configs = configurations(args)
    if args.only:
        configs = {name: c for name, c in configs.items() if name.startswith(tuple(args.only.split(",")))}

    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for rep in range(args.reps):
        for name, config in configs.items():
            result = run_config(f"{name}-r{rep}", **config)
            runs[name].append(result)
            print(f"rep {rep} {name}: {result['seconds']:.1f} s, main {result['main_us_per_frame']:.0f} µs/frame, "
                  f"whole {result['total_us_per_frame']:.0f} µs/frame ({result['sys_share']:.0%} system), "
                  f"RSS {result['rss_mib']:.0f} MiB, ack p99 {result['ack_p99_s']:.2f} s, "
                  f"resends {result['resends']}" + ("" if result["verified"] else "  NOT VERIFIED"), flush=True)

    def med(name: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[name])

    fields = ("seconds", "frames_per_s", "main_us_per_frame", "total_us_per_frame", "sys_us_per_frame", "gbps",
              "main_gbps", "rss_mib",
              "bytes_in_memory_mib", "ack_p50_s", "ack_p99_s", "resends", "drain_s", "redeliveries")
    print(f"\n{'':<16}" + "".join(f"{f:>20}" for f in fields) + "  verified")
    for name in runs:
        print(f"{name:<16}" + "".join(f"{med(name, f):>20.3f}" for f in fields)
              + f"  {all(r['verified'] for r in runs[name])}")

    summary: dict = {}
    if "open_10" in runs:
        base = med("open_10", "main_us_per_frame")
        for k, key in ((10_000, "open_ratio_10k"), (50_000, "open_ratio_50k")):
            if f"open_{k}" in runs:
                summary[key] = round(med(f"open_{k}", "main_us_per_frame") / base, 3)
    if "open_50000" in runs:
        summary["drain_s_50k"] = round(med("open_50000", "drain_s"), 2)
        budget = 2 * 2**30 / 2**20  # the default budget, MiB
        summary["rss_over_budget_mib"] = round(med("open_50000", "rss_mib") - budget, 1)
        summary["rss_vs_bytes_in_memory_50k"] = round(
            med("open_50000", "rss_mib") / max(med("open_50000", "bytes_in_memory_mib"), 1e-9), 3)
    for p, key in ((128, "conn_p99_ack_s_128"), (512, "conn_p99_ack_s_512")):
        if f"conn_{p}" in runs:
            summary[key] = round(med(f"conn_{p}", "ack_p99_s"), 3)
    if "conn_512" in runs:
        summary["conn_resends_512"] = int(med("conn_512", "resends"))
    for k in args.bound:
        if f"bound_on_{k}" in runs and f"bound_off_{k}" in runs:
            summary[f"bound_ratio_{k // 1000}k" if k >= 1000 else f"bound_ratio_{k}"] = round(
                med(f"bound_on_{k}", "main_us_per_frame") / med(f"bound_off_{k}", "main_us_per_frame"), 3)
    if "support_4096" in runs:
        summary["support_4096_gbps"] = round(med("support_4096", "gbps"), 3)
        summary["support_4096_gbps_main_thread"] = round(med("support_4096", "main_gbps"), 3)
        summary["support_4096_sys_share"] = round(med("support_4096", "sys_share"), 3)
        for field, key in (("main_us_per_turn", "main_thread"), ("other_us_per_turn", "other_threads"),
                           ("sys_us_per_turn", "system")):
            summary[f"support_4096_{key}_us_per_turn"] = round(med("support_4096", field))
        summary["support_4096_minor_faults_per_turn"] = round(med("support_4096", "faults_per_turn"), 1)
    if "budget_16MiB" in runs and "budget_2GiB" in runs:
        summary["budget_16mib_slowdown"] = round(med("budget_16MiB", "seconds") / med("budget_2GiB", "seconds"), 3)
    summary["redeliveries"] = int(sum(r["redeliveries"] for reps in runs.values() for r in reps))
    summary["verified"] = all(r["verified"] for reps in runs.values() for r in reps)
    summary["reps"] = args.reps
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
