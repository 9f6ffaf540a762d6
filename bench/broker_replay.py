"""The broker's CPU per frame on a recorded run, replayed in process:
figures that hold still where a live pipeline's move with the machine's load.

First a real run: TransferQueue's workload (`bench/pipeline.py`'s samples,
each sent as `--turns` turns, 8 of 625 tokens by default, by an
`AsyncProducer`, then `end`) goes
through a `BrokerService` in this process to a `Consumer` (batches of 32,
committed), the producer and the consumer in processes of their own; every
message the broker reads is kept, with the serving pass that read it. Then
each rep replays that recording into a fresh broker on a fresh store, in
this process: the same messages in the same passes, its reads served from
the recording and its sends dropped, nothing else running, its garbage
collector tuned as `rollstream broker` tunes it once started. The figure is
this process's CPU time (every thread: the store's writer too) per
producer frame, the median of `--reps`.

`--ablate` (by default `check,store,deliver`) also replays, interleaved
with the full replay in every rep, with one phase stubbed out: `check`
(the content check passes every turn), `store` (commits and writes ahead
write nothing) or `deliver` (a delivery encodes to one empty frame). Each
phase's share is 1 - (that replay's CPU / the full replay's). Run under
`valgrind --tool=callgrind` with `--reps 1 --ablate ''` it gives
instruction counts, which repeat to within a fraction of a percent.

Beside the CPU figure, one more full replay counts the function calls
(Python's and builtins', by `cProfile`) the serving thread makes per
producer frame: `calls_per_frame` does not move with the machine's load,
so a change can be judged on a busy machine. With `--instructions` the
full replay is also run once more in a process of its own under
`valgrind --tool=callgrind`, counting the instructions of that replay
alone (every thread, the store writer's too; the warm-up replay before it
not counted): `replay_instructions_per_frame`.

`--seal-every N` records a checkpointing consumer that seals every N
batches (its seals reclaim what it trained); `--archive` then also replays,
interleaved with the full replay in every rep, into a broker with an
archive (`--archive DIR`), whose files are written within the count (the
archive thread's CPU too, and a housekeeping pass every
`HOUSEKEEP_EVERY_PASSES` passes in both, as a live broker's loop runs one):
`archive_ratio` is that replay's CPU over the full one's (medians; its
spread, the lowest and highest ratio of one rep's pair). With
`--instructions` the archive replay's instructions are counted too:
`archive_instructions_ratio` holds still where the CPU figures move with
the machine's load.

The last line is one JSON object. `--smoke` records 8 samples and replays
them once.

    .venv/bin/python bench/broker_replay.py [--samples 64] [--turns 8] [--reps 5] [--ablate check,store,deliver]
        [--instructions] [--seal-every 2 --archive]
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import json
import multiprocessing as mp
import pstats
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import msgpack
import zmq
from pipeline import VOCAB, split_turns, workload
from procs import callgrind_counting, callgrind_instructions, parse_args

from rollstream.broker.cli import tune_garbage_collector
from rollstream.broker.service import BrokerService
from rollstream.broker.settings import BrokerSettings
from rollstream.broker.store import Store
from rollstream.common.clock import Clock

SMOKE = {"samples": 8, "reps": 1}  # the sizes of --smoke
HOUSEKEEP_EVERY_PASSES = 16
TURNS = 8  # by default, as `bench/pipeline.py`'s `t8`
ANY_PORT = "tcp://127.0.0.1:0"
try:  # what a send the replay drops answers: an older broker (a baseline the figures compare with) took a bool
    from rollstream.broker.core import Sent
    SEND_TAKEN: object = Sent.TAKEN
except ImportError:
    SEND_TAKEN = True


def _settings(data_dir: str, archive: str | None = None) -> BrokerSettings:
    archiving = {} if archive is None else {"archive": archive}  # an older broker has no archive setting
    return BrokerSettings(producer_endpoint=ANY_PORT, consumer_endpoint=ANY_PORT, admin_endpoint=ANY_PORT,
                          data_dir=data_dir, metrics_port=0, vocab_size=VOCAB, **archiving)


class RecordingBroker(BrokerService):
    """A broker that keeps every message it reads, by serving pass."""

    def __init__(self, settings: BrokerSettings):
        super().__init__(settings)
        self.passes: list[tuple[str, list[list[bytes]]]] = []
        self._read: list[list[bytes]] = []

    def _receive(self, name, now):
        frames = super()._receive(name, now)
        if frames is not None:
            self._read.append([bytes(frame) for frame in frames])
        return frames

    def _serve_producers(self, now) -> None:
        self._read = []
        super()._serve_producers(now)
        self.passes.append(("producer", self._read))

    def _serve_consumers(self, now) -> None:
        self._read = []
        super()._serve_consumers(now)
        self.passes.append(("consumer", self._read))


class ReplayedBroker(BrokerService):
    """A broker whose reads come from `queue` and whose sends go nowhere."""

    def __init__(self, settings: BrokerSettings):
        super().__init__(settings)
        self.queue: deque[list[bytes]] = deque()

    def _receive(self, name, now):
        if not self.queue:
            raise zmq.Again()
        return self.queue.popleft()

    def _send(self, request):
        return SEND_TAKEN


def _producer_main(endpoint: str, samples: int, turns: int) -> None:
    from rollstream.producer import AsyncProducer

    data = workload(samples)

    async def run() -> None:
        async with AsyncProducer(endpoint, "replay-producer") as producer:
            for i, sample in enumerate(data):
                trajectory = producer.trajectory(f"t{i}", sample["prompt_tokens"])
                for part in split_turns(sample, turns):
                    await trajectory.turn(part["tokens"], part["log_probs"], loss_mask=part["loss_mask"],
                                          mask_ids=part["mask_ids"], mask_offsets=part["mask_offsets"])
                await trajectory.end(0.0)
            await producer.flush()

    asyncio.run(run())


def _consumer_main(endpoint: str, samples: int, seal_every: int) -> None:
    from rollstream.consumer import Consumer

    with Consumer(endpoint, batch_size=32, vocab_size=VOCAB, device="cpu") as consumer:
        received = batches = 0
        while received < samples:
            batch = consumer.next_batch(timeout=120, partial_after=0 if samples - received < 32 else None)
            consumer.commit(batch)
            received += len(batch)
            batches += 1
            if seal_every and batches % seal_every == 0:
                consumer.sealed(consumer.position.step)
        consumer.flush(60)


def record(samples: int, seal_every: int, turns: int = TURNS) -> tuple[list, str]:
    """A real run's reads, by pass, and the lease prefix its broker gave
    (the recorded acks name leases by it)."""
    with tempfile.TemporaryDirectory(prefix="rollstream-replay-") as data_dir:
        broker = RecordingBroker(_settings(data_dir))
        broker.start()
        ctx = mp.get_context("spawn")
        children = [ctx.Process(target=_producer_main, args=(broker.endpoints["producer"], samples, turns)),
                    ctx.Process(target=_consumer_main, args=(broker.endpoints["consumer"], samples, seal_every))]
        for child in children:
            child.start()
        while any(child.is_alive() for child in children):
            broker.run_once(timeout_ms=50)
        if any(child.exitcode for child in children):
            raise RuntimeError(f"a recording process failed: exit codes {[child.exitcode for child in children]}")
        epoch = broker.core.dispatcher._epoch
        broker.close()
    return broker.passes, epoch


def producer_frames(passes: list) -> int:
    """The frames the producer sent: a batch counts the messages it carries."""
    count = 0
    for name, messages in passes:
        if name == "producer":
            for frames in messages:
                header = msgpack.unpackb(frames[1])
                count += len(header["messages"]) if header.get("type") == "batch" else 1
    return count


@contextlib.contextmanager
def _passing_check():
    with mock.patch("rollstream.broker.service.messages_content_valid", lambda batch, vocab=None: True):
        yield


@contextlib.contextmanager
def _idle_store():
    with mock.patch.object(Store, "commit", lambda self, effects: None), \
            mock.patch.object(Store, "write_ahead", lambda self, message: None):
        yield


@contextlib.contextmanager
def _empty_deliveries():
    with mock.patch("rollstream.broker.core.encode_deliver", lambda trajectory, lease, **_: [b""]):
        yield


ABLATIONS = {"check": _passing_check, "store": _idle_store, "deliver": _empty_deliveries}


def _housekeep(broker: ReplayedBroker) -> None:
    now = Clock.read()
    broker._drive(broker.core.housekeeping(now))
    if hasattr(broker.core, "finish_housekeeping"):  # an older broker's pass was one
        broker._drive(broker.core.finish_housekeeping(now))


def replay(passes: list, epoch: str, ablation: str | None, archive: bool = False,
           counting: Callable[[bool], None] | None = None) -> float:
    """CPU seconds of one replay into a fresh broker, `ablation` stubbed
    out; with `archive`, into a broker with an archive, until it holds all
    it was given; `counting(True)` and `counting(False)` bracket what the
    CPU figure counts (a counter of instructions or calls)."""
    stub = ABLATIONS[ablation]() if ablation else contextlib.nullcontext()
    with tempfile.TemporaryDirectory(prefix="rollstream-replay-") as data_dir, stub:
        broker = ReplayedBroker(_settings(data_dir, f"{data_dir}/archive" if archive else None))
        broker.start()
        thresholds = gc.get_threshold()
        tune_garbage_collector()  # as `rollstream broker` does once started (the archive's pyarrow imported)
        broker.core.dispatcher._epoch = epoch  # the recorded acks name the recording broker's leases
        serve = {"producer": broker._serve_producers, "consumer": broker._serve_consumers}
        if counting:
            counting(True)
        cpu = time.process_time()
        for i, (name, messages) in enumerate(passes):
            broker.queue.extend(messages)
            now = Clock.read()
            serve[name](now)
            broker._drive(broker.core.deliver(now))
            if i % HOUSEKEEP_EVERY_PASSES == HOUSEKEEP_EVERY_PASSES - 1:
                _housekeep(broker)
        if archive:  # what lingers for a fuller file is written now (the segments in use are not copied, as a
            broker._store_io.archive_linger = 0.0  # run's end would: once a run, that is no part of a steady state's cost)
        _housekeep(broker)
        while archive and (broker.core.archive.waiting or broker.core.archive.writing):
            while not broker._archiver.settled():
                time.sleep(0.001)  # the archive thread writes; its CPU counts, the wait's does not
            _housekeep(broker)
        broker.store.wait_writes()
        cpu = time.process_time() - cpu
        if counting:
            counting(False)
        archived = int(broker.metrics.totals.get("archive_rows", 0))
        broker.close()
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    if archive and not archived:
        raise RuntimeError("the archive replay archived nothing: record with --seal-every so that seals reclaim")
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64, help="trajectories recorded")
    parser.add_argument("--turns", type=int, default=TURNS, help="turns each trajectory is sent as (1 to 5000)")
    parser.add_argument("--reps", type=int, default=5, help="replays of each kind")
    parser.add_argument("--ablate", default="check,store,deliver", help="phases to stub out, comma-separated ('' for none)")
    parser.add_argument("--seal-every", type=int, default=0, help="the recorded consumer seals every N batches (0: never)")
    parser.add_argument("--archive", action="store_true", help="also replay into a broker with an archive")
    parser.add_argument("--instructions", action="store_true",
                        help="also count the replay's instructions under callgrind (each kind's, with --archive)")
    parser.add_argument("--replay-file", help=argparse.SUPPRESS)  # a process under callgrind: replay this recording
    parser.add_argument("--kind", choices=["full", "archive"], help=argparse.SUPPRESS)
    args = parse_args(parser, SMOKE)
    if args.replay_file:
        _replay_counted(args.replay_file, args.kind == "archive")
        return
    ablations = [name for name in args.ablate.split(",") if name]
    unknown = sorted(set(ablations) - set(ABLATIONS))
    if unknown:
        parser.error(f"--ablate takes {sorted(ABLATIONS)}, got {unknown}")

    if not 1 <= args.turns <= 5000:  # a sample's 5,000 response tokens cut into turns of at least one token each
        parser.error(f"--turns must be in [1, 5000], got {args.turns}")
    passes, epoch = record(args.samples, args.seal_every, args.turns)
    frames = producer_frames(passes)
    print(f"recorded {args.samples} trajectories of {args.turns} turns: {frames} producer frames in {len(passes)} passes")
    cpu: dict[str | None, list[float]] = {None: [], **{name: [] for name in ablations},
                                          **({"archive": []} if args.archive else {})}
    if args.archive:  # pyarrow's first write loads what later ones reuse, as a long-running broker's would
        replay(passes, epoch, None, archive=True)
    for rep in range(args.reps):
        for ablation in cpu:
            cpu[ablation].append(replay(passes, epoch, None, archive=True) if ablation == "archive"
                                 else replay(passes, epoch, ablation))
        print(f"rep {rep}: " + "  ".join(f"{name or 'full'} {values[-1] / frames * 1e6:.0f} µs/frame"
                                          for name, values in cpu.items()))
    full = statistics.median(cpu[None])
    summary: dict = {"replay_us_per_frame": round(full / frames * 1e6, 1)}
    for name in ablations:
        summary[f"share_{name}"] = round(1 - statistics.median(cpu[name]) / full, 3)
    if args.archive:
        archived = statistics.median(cpu["archive"])
        paired = [a / f for a, f in zip(cpu["archive"], cpu[None])]  # each rep's two replays ran one after the other
        summary.update(replay_archive_us_per_frame=round(archived / frames * 1e6, 1),
                       archive_ratio=round(archived / full, 3),
                       archive_ratio_spread=[round(min(paired), 3), round(max(paired), 3)])
    summary["calls_per_frame"] = round(_calls(passes, epoch) / frames, 1)
    if args.instructions:
        counted = {kind: _instructions(passes, epoch, kind) for kind in ("full", "archive") if kind == "full" or args.archive}
        summary["replay_instructions_per_frame"] = round(counted["full"] / frames)
        if args.archive:
            summary.update(archive_instructions_per_frame=round(counted["archive"] / frames),
                           archive_instructions_ratio=round(counted["archive"] / counted["full"], 3))
    summary.update(frames=frames, turns=args.turns, reps=args.reps, seal_every=args.seal_every)
    print(json.dumps(summary))


def _calls(passes: list, epoch: str) -> int:
    """The function calls (Python's and builtins') one full replay makes on
    the serving thread, counted by `cProfile`: a figure the machine's load
    does not move (the store writer's thread is not counted)."""
    profile = cProfile.Profile()
    replay(passes, epoch, None, counting=lambda on: profile.enable() if on else profile.disable())
    return sum(calls for _, calls, *_ in pstats.Stats(profile).stats.values())  # type: ignore[attr-defined]


def _replay_counted(path: str, archive: bool) -> None:
    """Under callgrind (counting off at start): a warm-up replay, then one counted."""
    with open(path, "rb") as f:
        passes, epoch = msgpack.unpackb(f.read(), use_list=True)
    passes = [(name, messages) for name, messages in passes]
    replay(passes, epoch, None, archive=archive)
    replay(passes, epoch, None, archive=archive, counting=callgrind_counting)


def _instructions(passes: list, epoch: str, kind: str) -> int:
    """The instructions one replay of `kind` takes, counted by callgrind in a process of its own."""
    with tempfile.TemporaryDirectory(prefix="rollstream-replay-") as work:
        recording = Path(work) / "recording.msgpack"
        recording.write_bytes(msgpack.packb([passes, epoch]))
        return callgrind_instructions([sys.executable, __file__, "--replay-file", str(recording), "--kind", kind], work)


if __name__ == "__main__":
    main()
