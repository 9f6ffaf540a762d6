"""The consumer's CPU per delivery on a recorded run, replayed in one
thread: figures that hold still where a live pipeline's move with the
machine's load.

First a real run: TransferQueue's workload (`bench/pipeline.py`'s samples,
each sent as `--turns` turns, 8 of 625 tokens by default, by an
`AsyncProducer` in a process of its own) goes through a `rollstream
broker` daemon to a `Consumer` in this process (batches of 32, committed),
which keeps every message its I/O thread decodes. Then each rep replays
that recording into a fresh `ConsumerCore` in this thread, doing what the
consumer's two threads do with them, one after the other: the I/O thread's
part (each message decoded and handed to the core, the core asked what is
due) and the trainer's (each batch the core forms packed and checked on the
CPU, then committed). Nothing is sent and no socket is read. The figure is
this process's CPU time per delivery (one per trajectory), the median of
`--reps`; `io_share` is the I/O thread's part of it.

What the live consumer pays besides (ZeroMQ's thread receiving, the
polls, sends and wake-ups, first touches of what arrived) is not here:
`bench/pipeline.py` counts that, over every thread.

Beside the CPU figure, one more replay counts the function calls (Python's
and builtins', by `cProfile`) per delivery: `calls_per_delivery` does not
move with the machine's load, so a change can be judged on a busy machine.
With `--instructions` the replay is also run once more in a process of its
own under `valgrind --tool=callgrind`, counting the instructions of that
replay alone (a warm-up replay before it not counted):
`instructions_per_delivery`.

The replay drives the consumer's core (`ConsumerCore`, consumer/core.py)
and batch check (`checked_batch`) as `Consumer` does; a tree from before
that core was split out of `Consumer` cannot be replayed.

The last line is one JSON object. `--smoke` records 8 samples and replays
them once.

    .venv/bin/python bench/consumer_replay.py [--samples 256] [--turns 8] [--reps 5] [--instructions]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
from broker_replay import TURNS, _producer_main
from pipeline import VOCAB
from procs import Broker, callgrind_counting, callgrind_instructions, parse_args

from rollstream.common.codec import decode
from rollstream.common.messages import BROKER_TO_CONSUMER
from rollstream.consumer import Consumer
from rollstream.consumer.core import ConsumerCore, HandOut, Wait
from rollstream.consumer.validate import checked_batch

SMOKE = {"samples": 8, "reps": 1}  # the sizes of --smoke
BATCH_SIZE = 32
TICK = 1e-4  # seconds of the replay's clock between recorded messages


class RecordingConsumer(Consumer):
    """A consumer that keeps every message its I/O thread decodes."""

    def __init__(self, *args, **kwargs):
        self.recorded: list[list[bytes]] = []
        super().__init__(*args, **kwargs)

    def _decode(self, frames: list) -> tuple:
        self.recorded.append([bytes(frame) for frame in frames])
        return super()._decode(frames)


def record(samples: int, turns: int) -> list[list[bytes]]:
    """The messages a real run's consumer decoded, in order."""
    broker = Broker(VOCAB)
    try:
        producer = mp.get_context("spawn").Process(target=_producer_main, args=(broker.producer, samples, turns))
        producer.start()
        with RecordingConsumer(broker.consumer, batch_size=BATCH_SIZE, vocab_size=VOCAB, device="cpu") as consumer:
            received = 0
            while received < samples:
                batch = consumer.next_batch(timeout=120, partial_after=0 if samples - received < BATCH_SIZE else None)
                consumer.commit(batch)
                received += len(batch)
            consumer.flush(60)
        producer.join(120)
        if producer.exitcode:
            raise RuntimeError(f"the recording's producer failed: exit code {producer.exitcode}")
    finally:
        broker.close()
    return consumer.recorded


def deliveries_in(recorded: list[list[bytes]]) -> int:
    return sum(1 for frames in recorded if msgpack.unpackb(frames[0]).get("type") == "deliver")


def replay(recorded: list[list[bytes]], counting: Callable[[bool], None] | None = None) -> tuple[float, float]:
    """CPU seconds of one replay into a fresh core, and of them the I/O
    thread's part; `counting(True)` and `counting(False)` bracket what they
    count (a counter of instructions or calls)."""
    core = ConsumerCore(["tcp://127.0.0.1:1"], consumer_id="replay", batch_size=BATCH_SIZE)
    now = 0.0
    core.due(now)  # the hello, as the I/O thread's first pass
    io = 0.0
    if counting:
        counting(True)
    start = time.process_time()
    for i, frames in enumerate(recorded):
        now += TICK
        began = time.process_time()
        core.received(0, decode(frames, BROKER_TO_CONSUMER, check_content=False), now)
        core.due(now)
        io += time.process_time() - began
        last = i == len(recorded) - 1
        while not isinstance(form := core.take(now, partial_at=now if last else None), Wait):
            batch, violations, _ = checked_batch(form.deliveries, device="cpu", seq=form.seq, vocab_size=VOCAB)
            if violations or not isinstance(core.formed(violations), HandOut):
                raise RuntimeError(f"the replay's batch {form.seq} was refused: {violations}")
            core.commit(form.seq)
            began = time.process_time()
            core.due(now)
            io += time.process_time() - began
    cpu = time.process_time() - start
    if counting:
        counting(False)
    return cpu, io


def _calls(recorded: list[list[bytes]]) -> int:
    """The function calls (Python's and builtins') one replay makes, counted by `cProfile`."""
    profile = cProfile.Profile()
    replay(recorded, counting=lambda on: profile.enable() if on else profile.disable())
    return sum(calls for _, calls, *_ in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]


def _replay_counted(path: str) -> None:
    """Under callgrind (counting off at start): a warm-up replay, then one counted."""
    recorded = msgpack.unpackb(Path(path).read_bytes())
    replay(recorded)
    replay(recorded, counting=callgrind_counting)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256, help="trajectories recorded")
    parser.add_argument("--turns", type=int, default=TURNS, help="turns each trajectory is sent as (1 to 5000)")
    parser.add_argument("--reps", type=int, default=5, help="replays")
    parser.add_argument("--instructions", action="store_true", help="also count the replay's instructions under callgrind")
    parser.add_argument("--replay-file", help=argparse.SUPPRESS)  # a process under callgrind: replay this recording
    args = parse_args(parser, SMOKE)
    if args.replay_file:
        _replay_counted(args.replay_file)
        return
    if not 1 <= args.turns <= 5000:  # a sample's 5,000 response tokens cut into turns of at least one token each
        parser.error(f"--turns must be in [1, 5000], got {args.turns}")
    if not 1 <= args.samples <= 4096:
        parser.error(f"--samples must be in [1, 4096], got {args.samples}")
    if not 1 <= args.reps <= 1000:
        parser.error(f"--reps must be in [1, 1000], got {args.reps}")

    recorded = record(args.samples, args.turns)
    deliveries = deliveries_in(recorded)
    print(f"recorded {args.samples} trajectories of {args.turns} turns: {len(recorded)} messages, "
          f"{deliveries} deliveries, {sum(len(frame) for frames in recorded for frame in frames) / 1e6:.1f} MB")
    replay(recorded)  # warm-up: the first replay pays for imports and first allocations
    runs = []
    for rep in range(args.reps):
        runs.append(replay(recorded))
        cpu, io = runs[-1]
        print(f"rep {rep}: {cpu / deliveries * 1e6:.0f} µs/delivery, I/O thread's part {io / cpu:.2f}")
    cpus = [cpu for cpu, _ in runs]
    summary: dict = {"consumer_us_per_delivery": round(statistics.median(cpus) / deliveries * 1e6, 1),
                     "consumer_us_per_delivery_spread": [round(min(cpus) / deliveries * 1e6, 1),
                                                         round(max(cpus) / deliveries * 1e6, 1)],
                     "io_share": round(statistics.median(io / cpu for cpu, io in runs), 3),
                     "calls_per_delivery": round(_calls(recorded) / deliveries, 1)}
    if args.instructions:
        with tempfile.TemporaryDirectory(prefix="rollstream-replay-") as work:
            recording = Path(work) / "recording.msgpack"
            recording.write_bytes(msgpack.packb(recorded))
            counted = callgrind_instructions([sys.executable, __file__, "--replay-file", str(recording)], work)
        summary["instructions_per_delivery"] = round(counted / deliveries)
    summary.update(deliveries=deliveries, messages=len(recorded), turns=args.turns, reps=args.reps)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
