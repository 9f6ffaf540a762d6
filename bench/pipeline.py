"""The whole pipeline against TransferQueue streaming the same samples, in one run.

Producer process(es) → `rollstream broker` (a daemon on its durable
defaults) → consumer process, on loopback TCP, moving the rollout samples of
TransferQueue's streaming benchmark: 256 samples of a 512-token prompt and
5,000 response tokens, supports of size min(geometric(1/8), 64), float32
log-probs, a 0/1 loss mask (63.2 MB). Both sides build them with
`bench/peers/tq_workload.py`, each response token moved inside its own
support (rollstream checks that rule), so both move the same bytes.

Each rollstream rep sends every sample as 1 turn (`t1`) or as 8 turns of 625
tokens (`t8`) with the library's `AsyncProducer` (or the blocking
`Producer`), from arrays built before the clock starts, as TransferQueue's
producer puts arrays built before its clock starts (and frozen out of the
garbage collector's passes, `gc.freeze()`, as a long-lived workload would
be); then `end`. The consumer
is the library's `Consumer` (batches of 32, validated, committed; with
`--batch-tokens N` also closed before N tokens, `Consumer(batch_tokens=)`).
A rep is timed from the first send to the last batch committed; its tail,
fewer samples than the largest batch so far, is taken as it arrives
(`partial_after=0`).

Saturated reps give latency under a backlog. After a mode's saturated reps,
the same system runs `--reps` more at half the capacity just measured
(samples / the round's median seconds, halved): the producer starts
trajectory i at first + i / rate (sleeping until then; its turns back to
back), so the figure is latency at a steady load the pipeline keeps up
with. At that rate a full batch takes batch-size / rate seconds to fill
(tenths of a second here), and that wait would be most of the figure; a
trainer that trains on what has arrived asks for a partial batch, so in
these reps the consumer takes whatever is ready once
`--paced-partial-after` seconds (0.005) pass without a full batch
(`next_batch(partial_after=)`), which adds up to that much to a
trajectory's latency. `--no-half-load` skips them.

With `--compare-checkpoint`, each mode also runs (interleaved, on its own
fresh broker) as a checkpointing trainer would: commits recorded as trained
at their step, and every `--checkpoint-every` batches the consumer's
`state_dict()` serialised (as a checkpoint would save it) and `sealed`;
the rest delete on commit. Its consumer and broker CPU per trajectory are
reported against delete-on-commit's.

With `--tq-python PATH` (the python of a virtualenv with transferqueue
0.1.11, made by `bench/peers/setup_tq.sh`), `bench/peers/tq_driver.py` runs
interleaved, as a subprocess of that python: each round runs TransferQueue
(a warm-up and `--reps` timed reps in one Ray session, its consumer a Ray
actor fetching while the producer puts, batches of `--batch-size`), then
`--reps` reps of t1 and of t8 on a fresh broker. Medians over every timed
rep are reported; TransferQueue's RSS is the sum of the peaks of its data
path's processes (producer, actors, raylet, gcs_server), with Ray's other
helpers reported apart. Without it, only rollstream runs.

Printed per mode: seconds, MB/s, tokens/s, CPU seconds of the producer
process(es), of the broker's main thread (and per frame, of every broker
thread: the store writer's, the checks ahead, ZeroMQ's) and of the
consumer process (and that split by thread: the trainer's, the consumer's
I/O thread, ZeroMQ's),
peak RSS of each, p50/p99 latency from a trajectory's `end` being handed to the
producer to its batch being committed, whether every delivered
trajectory was byte-equal to what was sent, exactly once, and the tokens per
batch (min, median and max over the batches a limit closed, tails and paced
reps left out); then the offered rate and p50/p99 latency at half load.
The consumer packs and validates its batches on `--device` (`cpu` by
default; `cuda` puts them on the GPU, as a trainer's consumer does, and the
CPU figures then count what the host still does: receiving, decoding,
packing into the staging buffers and launching the checks).
The last line is one JSON object. `--smoke` runs a tiny size (16 samples,
batches of 8, one round of one rep) to check the script end to end.

    .venv/bin/python bench/pipeline.py [--rounds 5] [--reps 3] [--batch-tokens N] [--no-half-load]
        [--tq-python .venv-tq/bin/python] [--device cuda]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from peers.tq_workload import make_samples, response_length, with_tokens_in_support
from procs import Broker, parse_args, peak_rss, process_times, thread_cpu

from rollstream.common.checker import check, read_records

TQ_DRIVER = Path(__file__).resolve().parent / "peers" / "tq_driver.py"
VOCAB = 151_936
FIELDS = ("prompt_tokens", "tokens", "log_probs", "loss_mask", "mask_ids", "mask_offsets")
SMOKE = {"rounds": 1, "reps": 1, "samples": 16, "batch_size": 8}  # the sizes of --smoke


# -- the workload -------------------------------------------------------------
def workload(samples: int, seed: int = 0) -> list[dict]:
    """The samples TransferQueue's driver puts, as rollstream trajectories:
    the prompt and the response, split out of `input_ids`."""
    out = []
    for sample in with_tokens_in_support(make_samples(samples, 5000, 512, seed), seed):
        cut = len(sample["input_ids"]) - response_length(sample)
        out.append({"prompt_tokens": sample["input_ids"][:cut], "tokens": sample["input_ids"][cut:],
                    "log_probs": sample["log_probs"], "loss_mask": sample["loss_mask"], "mask_ids": sample["mask_ids"],
                    "mask_offsets": sample["mask_offsets"]})
    return out


def split_turns(sample: dict, turns: int) -> list[dict]:
    """The sample's response as `turns` engine calls of equal length, each
    with its own CSR (offsets from 0), as an engine reports them."""
    n = len(sample["tokens"])
    bounds = np.linspace(0, n, turns + 1).astype(int)
    offsets = sample["mask_offsets"]
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        out.append({"tokens": sample["tokens"][a:b], "log_probs": sample["log_probs"][a:b],
                    "loss_mask": sample["loss_mask"][a:b], "mask_ids": sample["mask_ids"][offsets[a]:offsets[b]],
                    "mask_offsets": offsets[a:b + 1] - offsets[a]})
    return out


def digest(arrays: dict) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in FIELDS:
        array = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{array.dtype.str}:{array.size};".encode())
        h.update(array.view(np.uint8).data)
    return h.hexdigest()


# -- the processes --------------------------------------------------------------
def _producer_main(conn, endpoint: str, samples: int, share: range, turns: int, client: str, ledger: str | None) -> None:
    from rollstream.producer import AsyncProducer, Producer

    data = workload(samples)
    plan = [(i, data[i]["prompt_tokens"], split_turns(data[i], turns)) for i in share]
    del data
    gc.freeze()  # the workload is built before the clock starts: no collection need walk it
    producer_id = f"bench-producer-{share.start}"

    def sends(tag: str, rate: float | None, trajectory, sent: dict) -> Iterator[Any]:
        """One rep's calls, shared by both clients and both loads: yields what
        each call returned (an awaitable from the async client) and, paced at
        `rate` trajectories/s, a float: the seconds to sleep before the next
        trajectory starts. Fills `sent` with the rep's clock readings."""
        ends, frames = {}, 0
        first = time.perf_counter()
        for n, (i, prompt, parts) in enumerate(plan):
            if rate:
                yield first + n / rate - time.perf_counter()
            tid = f"{tag}-{i}"
            traj = trajectory(tid, prompt)
            for part in parts:
                yield traj.turn(part["tokens"], part["log_probs"], loss_mask=part["loss_mask"],
                                mask_ids=part["mask_ids"], mask_offsets=part["mask_offsets"])
            ends[tid] = time.perf_counter()
            yield traj.end(0.0)
            frames += len(parts) + 1
        sent.update(first=first, ends=ends, frames=frames)

    if client == "blocking":
        with Producer(endpoint, producer_id, ledger=ledger) as producer:
            conn.send("ready")
            while (job := conn.recv()) is not None:
                cpu, sent = time.process_time(), {}
                for step in sends(*job, producer.trajectory, sent):
                    if isinstance(step, float):
                        time.sleep(max(step, 0.0))
                producer.flush()
                conn.send({"cpu": time.process_time() - cpu, **sent})
        return

    async def run() -> None:
        async with AsyncProducer(endpoint, producer_id, ledger=ledger) as producer:
            loop = asyncio.get_running_loop()
            conn.send("ready")
            while (job := await loop.run_in_executor(None, conn.recv)) is not None:
                cpu, sent = time.process_time(), {}
                for step in sends(*job, producer.trajectory, sent):
                    if isinstance(step, float):
                        await asyncio.sleep(max(step, 0.0))
                    else:
                        await step
                await producer.flush()
                conn.send({"cpu": time.process_time() - cpu, **sent})

    asyncio.run(run())


def _thread_roles() -> dict[str, float]:
    """CPU seconds this process's threads have spent, by role: the trainer's
    (main), the consumer's I/O thread, ZeroMQ's threads and any other."""
    pid, spent = os.getpid(), dict.fromkeys(("main", "io", "zmq", "other"), 0.0)
    io_thread = next(t.native_id for t in threading.enumerate() if t.name.startswith("rollstream-consumer-"))
    for task in Path(f"/proc/{pid}/task").iterdir():
        tid = int(task.name)
        try:
            name = (task / "comm").read_text()
            seconds = thread_cpu(pid, tid)
        except OSError:  # the thread ended meanwhile
            continue
        role = "main" if tid == pid else "io" if tid == io_thread else "zmq" if name.startswith("ZMQ") else "other"
        spent[role] += seconds
    return spent


def _host(tensor) -> np.ndarray:
    """A batch tensor read on the host (a GPU batch's too)."""
    return tensor.cpu().numpy()


def _consumer_main(conn, endpoint: str, batch_size: int, batch_tokens: int | None, ledger: str | None,
                   checkpoint_every: int, device: str) -> None:
    from rollstream.consumer import Consumer

    with Consumer(endpoint, batch_size=batch_size, batch_tokens=batch_tokens, vocab_size=VOCAB, device=device,
                  ledger=ledger, checkpointed=checkpoint_every > 0) as consumer:
        conn.send("ready")
        while (job := conn.recv()) is not None:
            tag, expected, partial_after = job
            threads = _thread_roles()
            cpu = time.process_time()
            committed_at, kept, received = {}, [], 0
            full_batch_tokens, over_budget, widest = [], 0, 0
            while received < expected:
                tail = expected - received < widest  # no full batch is left: take what has arrived
                batch = consumer.next_batch(timeout=300, partial_after=0 if tail else partial_after)
                consumer.commit(batch)
                widest = max(widest, len(batch))
                if not tail and partial_after is None:
                    full_batch_tokens.append(batch.num_tokens)
                over_budget += batch.over_budget
                if checkpoint_every and consumer.position.step % checkpoint_every == 0:
                    json.dumps(consumer.state_dict())  # what a checkpoint saves
                    consumer.sealed(consumer.position.step)
                now = time.perf_counter()
                kept.append(batch)
                received += len(batch)
                for tid in batch.trajectory_ids:
                    committed_at[tid] = now
            cpu = time.process_time() - cpu
            threads = {role: seconds - threads[role] for role, seconds in _thread_roles().items()}
            seen: dict[str, list[str]] = {}
            for batch in kept:  # outside the clock: what the trainer got, sample by sample
                for i in range(len(batch)):
                    sample = batch.sample(i)
                    prompt = int(batch.prompt_lengths[i])
                    arrays = {"prompt_tokens": _host(sample["tokens"][:prompt]), "tokens": _host(sample["response_tokens"]),
                              "log_probs": _host(sample["log_probs"]), "loss_mask": _host(sample["loss_mask"]),
                              "mask_ids": _host(sample["mask_ids"]), "mask_offsets": _host(sample["mask_offsets"])}
                    seen.setdefault(sample["trajectory_id"], []).append(digest(arrays))
            conn.send({"cpu": cpu, "threads": threads, "committed": committed_at, "digests": seen,
                       "batch_tokens": full_batch_tokens, "over_budget": over_budget, "batches": len(kept)})


class Rollstream:
    """One broker, its producer process(es) and a consumer process, kept
    for a round of reps (each rep sends fresh trajectory ids)."""

    def __init__(self, samples: int, turns: int, producers: int, batch_size: int, batch_tokens: int | None,
                 client: str, broker_args: list[str] = (), ledgers: bool = False, checkpoint_every: int = 0,
                 device: str = "cpu"):
        self.samples, self.turns = samples, turns
        self.broker = Broker(VOCAB, broker_args)
        endpoints = [self.broker.producer, self.broker.consumer]
        ctx = mp.get_context("spawn")
        self.children = []
        self.consumer, child = ctx.Pipe()
        self.ledgers = Path(self.broker.data) / "ledgers" if ledgers else None
        ledger = (lambda name: str(self.ledgers / f"{name}.jsonl")) if ledgers else (lambda name: None)
        self.children.append(ctx.Process(target=_consumer_main,
                                         args=(child, endpoints[1], batch_size, batch_tokens, ledger("consumer"),
                                               checkpoint_every, device),
                                         daemon=True))
        self.producers, self.shares = [], []
        per = -(-samples // producers)
        for p in range(producers):
            share = range(p * per, min(samples, (p + 1) * per))
            self.shares.append(share)
            parent, child = ctx.Pipe()
            self.producers.append(parent)
            self.children.append(ctx.Process(target=_producer_main, args=(child, endpoints[0], samples, share, turns, client,
                                                                          ledger(f"producer-{p}")),
                                             daemon=True))
        for process in self.children:
            process.start()
        for conn in (self.consumer, *self.producers):
            if not conn.poll(300) or conn.recv() != "ready":
                raise RuntimeError("a bench process did not start")

    def rep(self, tag: str, expected: dict[str, str], rate: float | None = None,
            partial_after: float | None = None) -> dict:
        """One rep: saturated, or paced at `rate` trajectories/s in all (each
        producer offers its share's part) with the consumer taking what has
        arrived after `partial_after` seconds."""
        broker_cpu, broker_all = thread_cpu(self.broker.pid, self.broker.pid), process_times(self.broker.pid)
        self.consumer.send((tag, self.samples, partial_after))
        for conn, share in zip(self.producers, self.shares):
            conn.send((tag, rate and rate * len(share) / self.samples))
        sent = [conn.recv() for conn in self.producers]
        got = self.consumer.recv()
        broker_cpu = thread_cpu(self.broker.pid, self.broker.pid) - broker_cpu
        broker_all = (process_times(self.broker.pid) - broker_all).cpu
        first = min(s["first"] for s in sent)
        last = max(got["committed"].values())
        ends = {tid: at for s in sent for tid, at in s["ends"].items()}
        latencies = sorted(got["committed"][tid] - ends[tid] for tid in got["committed"])
        frames = sum(s["frames"] for s in sent)
        want = {f"{tag}-{i}": d for i, d in enumerate(expected.values())}
        verified = got["digests"].keys() == want.keys() and all(
            digests == [want[tid]] for tid, digests in got["digests"].items())
        return {"seconds": last - first, "producer_cpu": sum(s["cpu"] for s in sent), "broker_cpu": broker_cpu,
                "broker_all_cpu": broker_all,
                "consumer_cpu": got["cpu"], "consumer_threads": got["threads"], "frames": frames,
                "p50": latencies[len(latencies) // 2], "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                "verified": verified,
                "batch_tokens": got["batch_tokens"], "over_budget": got["over_budget"], "batches": got["batches"]}

    def checked(self) -> dict[str, int] | None:
        """With ledgers: the end-to-end checker over every rep so far (each
        acked trajectory committed once, byte-equal by its digest)."""
        if self.ledgers is None:
            return None
        return check(read_records([self.ledgers])).counts()

    def peak_rss(self) -> dict:
        return {"producer": sum(peak_rss(p.pid) for p in self.children[1:]),
                "broker": peak_rss(self.broker.pid), "consumer": peak_rss(self.children[0].pid)}

    def close(self) -> None:
        for conn in (*self.producers, self.consumer):
            conn.send(None)
        for process in self.children:
            process.join(30)
            if process.is_alive():
                process.kill()
        self.broker.close()


def run_tq(python: str, reps: int, samples: int, batch: int) -> dict:
    """One TransferQueue session (bench/peers/tq_driver.py under `python`):
    a warm-up and `reps` timed streaming reps."""
    with tempfile.TemporaryDirectory(prefix="tq-pipeline-") as work:
        out = Path(work) / "tq.json"
        done = subprocess.run([python, str(TQ_DRIVER), "--samples", str(samples), "--batch", str(batch), "--reps",
                               str(reps), "--warmup", "1", "--json", str(out)], capture_output=True, text=True)
        if not out.exists():  # it exits 2 with its figures written when a sample came back different
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise RuntimeError(f"{TQ_DRIVER.name} exited {done.returncode} without figures:\n{tail}")
        result = json.loads(out.read_text())
    return {"seconds": result["stream_e2e_s"], "rss_mib": result["peak_rss_mib"],
            "helpers_rss_mib": result["peak_rss_mib_ray_helpers"], "verified": result["verified"],
            "payload": result["payload_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (a fresh broker and TQ session each)")
    parser.add_argument("--reps", type=int, default=3, help="timed reps of each mode per round (after a warm-up)")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--producers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, help="also close each batch before this many tokens")
    parser.add_argument("--client", choices=("async", "blocking"), default="async")
    parser.add_argument("--modes", default="1,8", help="turns per sample to run, comma-separated")
    parser.add_argument("--tq-python", help="python of a virtualenv with transferqueue 0.1.11 and psutil")
    parser.add_argument("--ledgers", action="store_true", help="producers and consumer keep ledgers; the end-to-end "
                        "checker must find nothing (its cost is in the CPU figures)")
    parser.add_argument("--broker-arg", action="append", default=[], help="an extra `rollstream broker` argument (repeatable)")
    parser.add_argument("--compare-checkpoint", action="store_true",
                        help="also run each mode as a checkpointing trainer, interleaved, and compare its CPU")
    parser.add_argument("--checkpoint-every", type=int, default=4, help="batches between checkpoints (with the above)")
    parser.add_argument("--no-half-load", action="store_true",
                        help="skip the reps paced at half the measured capacity (latency at a steady load)")
    parser.add_argument("--paced-partial-after", type=float, default=0.005,
                        help="seconds the consumer waits for a full batch in a paced rep before taking what has arrived")
    parser.add_argument("--device", default="cpu",
                        help="where the consumer packs and validates its batches (cuda: on the GPU, as a trainer does)")
    args = parse_args(parser, SMOKE)
    modes = [int(m) for m in args.modes.split(",")]
    variants = [("", 0)] + ([("-ckpt", args.checkpoint_every)] if args.compare_checkpoint else [])

    data = workload(args.samples)
    expected = {str(i): digest(sample) for i, sample in enumerate(data)}
    payload = sum(sample[name].nbytes for sample in data for name in FIELDS)
    tokens = sum(len(sample["tokens"]) for sample in data)
    del data
    print(f"workload: {args.samples} samples, {tokens:,} response tokens, {payload / 1e6:.1f} MB "
          f"(rollstream fields; TransferQueue's input_ids are the same prompt + response)")

    runs: dict[str, list[dict]] = {f"t{m}{suffix}": [] for m in modes for suffix, _ in variants}
    paced: dict[str, list[dict]] = {key: [] for key in runs}  # the reps at half load, each with its offered rate
    tq_seconds, tq_rss, tq_helpers_rss, tq_verified = [], [], [], True
    rss: dict[str, dict] = {}
    checker_problems = 0
    for round_index in range(args.rounds):
        if args.tq_python:
            tq = run_tq(args.tq_python, args.reps, args.samples, args.batch_size)
            if tq["payload"] != payload:
                raise RuntimeError(f"TransferQueue moved {tq['payload']} bytes a rep and rollstream {payload}: "
                                   "not the same workload")
            tq_seconds += tq["seconds"]
            tq_rss.append(sum(tq["rss_mib"].values()))
            tq_helpers_rss.append(sum(tq["helpers_rss_mib"].values()))
            tq_verified &= tq["verified"]
            print(f"round {round_index}: TransferQueue {' '.join(f'{s:.3f}' for s in tq['seconds'])} s")
        for mode in modes:
            # The variants of a mode run side by side, each on its own broker, their reps alternating.
            systems = {}
            try:
                for suffix, every in variants:
                    systems[f"t{mode}{suffix}"] = Rollstream(args.samples, mode, args.producers, args.batch_size,
                                                             args.batch_tokens, args.client, args.broker_arg,
                                                             args.ledgers, every, args.device)
                for key, system in systems.items():
                    system.rep(f"r{round_index}-{key}-warmup", expected)
                reps: dict[str, list[dict]] = {key: [] for key in systems}
                for rep in range(args.reps):
                    for key, system in systems.items():
                        reps[key].append(system.rep(f"r{round_index}-{key}-{rep}", expected))
                # Half of the capacity just measured, offered steadily: the latency of a pipeline that keeps up.
                rates = {key: args.samples / statistics.median(r["seconds"] for r in reps[key]) / 2 for key in systems}
                half: dict[str, list[dict]] = {key: [] for key in systems}
                for rep in range(0 if args.no_half_load else args.reps):
                    for key, system in systems.items():
                        half[key].append({"rate": rates[key], **system.rep(
                            f"r{round_index}-{key}-half-{rep}", expected, rates[key], args.paced_partial_after)})
                peaks = {key: system.peak_rss() for key, system in systems.items()}
                verdicts = {key: system.checked() for key, system in systems.items()}
            finally:
                for system in systems.values():
                    system.close()
            for key in systems:
                verdict = verdicts[key]
                if verdict is not None:
                    checker_problems += sum(verdict.values())
                    print(f"round {round_index}: checker on {key}: " + "  ".join(f"{k} {v}" for k, v in verdict.items()))
                runs[key] += reps[key]
                paced[key] += half[key]
                rss[key] = {name: max(value, rss.get(key, {}).get(name, 0)) for name, value in peaks[key].items()}
                print(f"round {round_index}: rollstream {key} " + " ".join(f"{r['seconds']:.3f}" for r in reps[key])
                      + " s" + ("" if all(r["verified"] for r in reps[key]) else "  NOT VERIFIED"))
                if half[key]:
                    print(f"round {round_index}: rollstream {key} at {rates[key]:.1f} trajectories/s, p50/p99 "
                          + " ".join(f"{r['p50']:.3f}/{r['p99']:.3f}" for r in half[key]) + " s"
                          + ("" if all(r["verified"] for r in half[key]) else "  NOT VERIFIED"))

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[key])

    summary = {}
    print(f"\n{'':<14}{'seconds':>9}{'MB/s':>9}{'Mtok/s':>8}{'prod CPU':>10}{'broker':>8}{'cons':>7}"
          f"{'p50 s':>8}{'p99 s':>8}{'RSS MiB':>9}  verified")
    if tq_seconds:
        seconds = statistics.median(tq_seconds)
        print(f"{'TransferQueue':<14}{seconds:>9.3f}{payload / seconds / 1e6:>9.0f}{tokens / seconds / 1e6:>8.2f}"
              f"{'':>49}{max(tq_rss):>9.0f}  {tq_verified}")
        summary["tq_stream_s"] = round(seconds, 4)
        summary["tq_total_peak_rss_mb"] = round(max(tq_rss), 1)
        summary["tq_ray_helpers_peak_rss_mb"] = round(max(tq_helpers_rss), 1)
        print(f"{'':<14}RSS: TransferQueue's data path (producer, actors, raylet, gcs_server); Ray's agents, "
              f"dashboard and log monitor add {max(tq_helpers_rss):.0f} MiB")
    for key, reps in runs.items():
        seconds = med(key, "seconds")
        frames = reps[0]["frames"]
        verified = all(r["verified"] for r in reps)
        total_rss = sum(rss[key].values()) / 2**20
        print(f"{'rollstream ' + key:<14}{seconds:>9.3f}{payload / seconds / 1e6:>9.0f}{tokens / seconds / 1e6:>8.2f}"
              f"{med(key, 'producer_cpu'):>10.3f}{med(key, 'broker_cpu'):>8.3f}{med(key, 'consumer_cpu'):>7.3f}"
              f"{med(key, 'p50'):>8.3f}{statistics.median(r['p99'] for r in reps):>8.3f}{total_rss:>9.0f}  {verified}")
        print(f"{'':<14}frames {frames}, producer {med(key, 'producer_cpu') / frames * 1e6:.0f} µs/frame, "
              f"broker main thread {med(key, 'broker_cpu') / frames * 1e6:.0f} µs/frame, every thread "
              f"{med(key, 'broker_all_cpu') / frames * 1e6:.0f} µs/frame; peak RSS MiB "
              + ", ".join(f"{name} {value / 2**20:.0f}" for name, value in rss[key].items()))
        summary[f"rs_stream_s_{key}"] = round(seconds, 4)
        if tq_seconds:
            summary[f"rs_vs_tq_{key}"] = round(summary["tq_stream_s"] / seconds, 3)
        summary[f"producer_us_per_frame_{key}"] = round(med(key, "producer_cpu") / frames * 1e6, 1)
        summary[f"broker_us_per_frame_{key}"] = round(med(key, "broker_cpu") / frames * 1e6, 1)
        summary[f"broker_all_threads_us_per_frame_{key}"] = round(med(key, "broker_all_cpu") / frames * 1e6, 1)
        summary[f"consumer_cpu_s_{key}"] = round(med(key, "consumer_cpu"), 3)
        by_thread = {role: round(statistics.median(r["consumer_threads"][role] for r in reps), 4)
                     for role in reps[0]["consumer_threads"]}
        summary[f"consumer_cpu_by_thread_s_{key}"] = by_thread
        print(f"{'':<14}consumer CPU by thread (s): " + ", ".join(f"{role} {value:.3f}" for role, value in by_thread.items()))
        summary[f"p50_latency_s_{key}"] = round(med(key, "p50"), 4)
        summary[f"p99_latency_s_{key}"] = round(statistics.median(r["p99"] for r in reps), 4)
        summary[f"rs_peak_rss_mb_{key}"] = round(total_rss, 1)
        if paced[key]:
            at_half = {field: statistics.median(r[field] for r in paced[key]) for field in ("rate", "p50", "p99")}
            mean_batch = args.samples * len(paced[key]) / sum(r["batches"] for r in paced[key])
            print(f"{'':<14}at half load, {at_half['rate']:.1f} trajectories/s offered (batches taken after "
                  f"{args.paced_partial_after} s, {mean_batch:.1f} trajectories each): p50 {at_half['p50']:.3f} s, "
                  f"p99 {at_half['p99']:.3f} s, verified {all(r['verified'] for r in paced[key])}")
            summary[f"half_load_traj_per_s_{key}"] = round(at_half["rate"], 2)
            summary[f"p50_latency_half_load_s_{key}"] = round(at_half["p50"], 4)
            summary[f"p99_latency_half_load_s_{key}"] = round(at_half["p99"], 4)
    for key in [k for k in runs if k.endswith("-ckpt")]:
        base = key.removesuffix("-ckpt")
        for role in ("consumer", "broker"):
            ratio = med(key, f"{role}_cpu") / med(base, f"{role}_cpu")
            summary[f"checkpoint_{role}_cpu_ratio_{base}"] = round(ratio, 3)
        print(f"checkpoint every {args.checkpoint_every} batches vs delete on commit, {base}: consumer CPU "
              f"{med(key, 'consumer_cpu') / args.samples * 1e6:.0f} vs {med(base, 'consumer_cpu') / args.samples * 1e6:.0f}"
              f" µs/trajectory (x{summary[f'checkpoint_consumer_cpu_ratio_{base}']}), broker main thread "
              f"{med(key, 'broker_cpu') / args.samples * 1e6:.0f} vs {med(base, 'broker_cpu') / args.samples * 1e6:.0f}"
              f" µs/trajectory (x{summary[f'checkpoint_broker_cpu_ratio_{base}']})")
    per_batch = [tokens for reps in runs.values() for r in reps for tokens in r["batch_tokens"]]
    summary["batch_tokens"] = args.batch_tokens
    summary["consumer_device"] = args.device
    summary["tokens_per_batch"] = {"min": min(per_batch), "median": statistics.median(per_batch),
                                   "max": max(per_batch)} if per_batch else None
    summary["over_budget_batches"] = sum(r["over_budget"] for reps in runs.values() for r in reps)
    print(f"tokens per batch (tails left out), batch_tokens {args.batch_tokens}: {summary['tokens_per_batch']}, "
          f"{summary['over_budget_batches']} over the budget")
    summary["p99_latency_s"] = max(v for k, v in summary.items() if k.startswith("p99_latency_s_"))
    summary["rs_total_peak_rss_mb"] = max(v for k, v in summary.items() if k.startswith("rs_peak_rss_mb_"))
    summary["verified"] = (all(r["verified"] for reps in (*runs.values(), *paced.values()) for r in reps)
                           and tq_verified and not checker_problems)
    if not args.no_half_load:
        summary["paced_partial_after_s"] = args.paced_partial_after
    if args.ledgers:
        summary["checker_problems"] = checker_problems
    summary["reps"] = args.rounds * args.reps
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
