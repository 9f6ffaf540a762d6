"""`rollstream history` over a broker's archive: how long one step's answer
and one trajectory's story take.

First an archive is built in this process, through the broker's own code:
`--trajectories` trajectories from four producers (ids and groups of 8 as
the producer daemon names them, so that ids do not sort by step), two
turns each of a few tokens with small supports and a weight version per
turn, merged by a `MergeEngine` and committed by a `Store` opened with
`Archiving()`, a batch of `--batch` at a time; each batch then trained by
one run at its step (position its place in the batch). The run's end
(`end_run`) hands every row to the archive, whose `Archiver` writes the
files a broker writes (`archive_file_rows` rows each, the default) and
then takes the segment files holding the records (those still in use
copied, as at a run's end). `--smoke` makes a small one.

Then each rep asks, interleaved: the steps trained first, in the middle
and last, with a fresh `History(root)` each time (what one `rollstream
history` command does, after its imports), then again with one `History`
reused; and the stories of three trajectories (first, middle and last
trained), fresh. Each answer is timed on the wall clock (what the user
waits for) and in the process's CPU time (pyarrow's threads included).
The first answer of the process is reported apart (`history_cold_step_s`:
pyarrow's lazy imports and first use), and so is the whole command in a
process of its own (`rollstream history --archive DIR --step N --run R
--json`, interpreter start and imports included). The archive's files sit
in the page cache (just written); figures are medians over `--reps`, with
the spread (min, max). The target (an answer within a second at 100,000
rows) is printed, never judged. The last line is one JSON object.

    .venv/bin/python bench/history.py [--trajectories 100000] [--reps 5] [--batch 64]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
from procs import parse_args
from stores import applied

from rollstream.broker.archive import Archiver
from rollstream.broker.engine import EngineSettings, MergeEngine, TrainedAt
from rollstream.broker.recovery import rebuild
from rollstream.broker.settings import BrokerSettings
from rollstream.broker.store import Archiving, Store
from rollstream.common.codec import decode, encode
from rollstream.common.messages import PRODUCER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn

SMOKE = {"trajectories": 2000, "reps": 1}  # the sizes of --smoke
PRODUCERS = 4
GROUP = 8  # samples per prompt
TOKENS = 8  # per turn
RUN, LINEAGE = "bench-run", "bench-lineage"
FILE_ROWS = next(f.default for f in fields(BrokerSettings) if f.name == "archive_file_rows")  # a broker's default
WALL = 1_800_000_000.0  # the build's wall clock starts here and moves a second per batch


def _turn(tid: str, index: int, tokens: np.ndarray, version: str, seq: int, **first) -> list:
    supports = [[int(t), int(t) + 1] if k % 3 else [int(t)] for k, t in enumerate(tokens)]
    turn = Turn.build(tokens, np.full(len(tokens), -0.5, np.float32), supports=supports, weight_version=version,
                      check_content=False)  # the broker's decode checks it
    return encode_turn(tid, index, turn, seq=seq, checked=False, **first)


def _messages(i: int, step: int, rng: np.random.Generator) -> tuple[str, str, list]:
    """Trajectory `i`'s frames (two turns, the second sampled a version
    later than the first, then its `end`), decoded as the broker reads
    them; its id and producer. Producer `i % PRODUCERS` names it as the
    daemon does: `<producer>-<run hex>-<prompt>-<sample>`, its group the
    prompt's."""
    producer = f"bench-host-{i % PRODUCERS}"
    nth = i // PRODUCERS
    prompt, sample = divmod(nth, GROUP)
    base = f"{producer}-{0xa5c0 + i % PRODUCERS:08x}"
    tid = f"{base}-{prompt}-{sample}"
    frames = [
        _turn(tid, 0, rng.integers(3, 30_000, TOKENS, dtype=np.int32), str(max(step - 1, 0)), 0,
              prompt_tokens=rng.integers(3, 30_000, 16, dtype=np.int32), group_id=f"{base}-{prompt}", group_size=GROUP,
              sample_index=sample),
        _turn(tid, 1, rng.integers(3, 30_000, TOKENS, dtype=np.int32), str(step), 1),
        encode(PRODUCER_TO_BROKER, "end", {"seq": 2, "trajectory_id": tid, "reward": float(rng.random())}),
    ]
    return tid, producer, [decode(f, PRODUCER_TO_BROKER) for f in frames]


def _finished(archiver: Archiver) -> list:
    """What the archive thread finished, waited for (a millisecond at a time, leaving it the CPU)."""
    while not (outcomes := archiver.finished()):
        time.sleep(0.001)
    for outcome in outcomes:
        if outcome.error is not None:
            raise RuntimeError(f"the archiver failed: {outcome.error}")
    return outcomes


def _settle(archiver: Archiver, store: Store) -> None:
    """Every archive file the store hands out written and its rows deleted,
    then every segment placed, as the broker's archive step does."""
    while True:
        batches = store.archive_work(FILE_ROWS, archiver.busy)
        if not batches:
            break
        for batch in batches:
            archiver.submit(batch)
        while archiver.busy:
            for outcome in _finished(archiver):
                store.archived(outcome.number)
    while handovers := store.handover(archiver.placing, copies=True):
        for handover in handovers:
            archiver.submit(handover)
        while archiver.placing:
            for outcome in _finished(archiver):
                store.handed_over(outcome.handover)


def build_archive(data_dir: Path, root: Path, trajectories: int, batch: int) -> tuple[float, list[str]]:
    """An archive under `root` of `trajectories` trained ones; its seconds
    and the trajectory ids in the order they were trained."""
    start = time.perf_counter()
    store = Store(data_dir, archive=Archiving())
    engine = MergeEngine(EngineSettings())
    engine.restore(*rebuild(store.open(), store).engine_state())
    rng = np.random.default_rng(0)
    trained: list[str] = []
    try:
        for first in range(0, trajectories, batch):
            step, wall = first // batch, WALL + first // batch
            effects, tids = [], []
            for i in range(first, min(first + batch, trajectories)):
                tid, producer, messages = _messages(i, step, rng)
                effects += applied(engine, tid, messages, wall, producer)
                tids.append(tid)
            store.commit(effects)
            engine.saved()
            effects = []
            for position, tid in enumerate(tids):
                engine.sent(tid, wall + 0.5)
                effects += engine.trained(tid, TrainedAt(RUN, LINEAGE, step, position, 0), wall + 0.5)
            store.commit(effects)
            trained += tids
        store.commit(engine.end_run(RUN, WALL + trajectories / batch + 1))
        archiver = Archiver(root, store.store_id)
        try:
            _settle(archiver, store)
        finally:
            archiver.close()
    finally:
        store.close()
    return time.perf_counter() - start, trained


def archive_shape(root: Path) -> dict:
    """The archive's Parquet files, their row groups and rows, and its bytes (facts and segments apart)."""
    import pyarrow.parquet as pq

    files = sorted(root.rglob("*.parquet"))
    metadata = [pq.ParquetFile(path).metadata for path in files]
    facts = sum(path.stat().st_size for path in files)
    everything = sum(path.stat().st_size for path in root.rglob("*") if path.is_file())
    return {"files": len(files), "row_groups": sum(m.num_row_groups for m in metadata),
            "rows": sum(m.num_rows for m in metadata), "facts_mb": facts / 1e6, "segments_mb": (everything - facts) / 1e6}


def timed(answer) -> tuple[float, float, object]:
    """`answer()`'s wall and process CPU seconds, and what it returned."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = answer()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def command_seconds(root: Path, step: int) -> float:
    """`rollstream history --step` in a process of its own, on the wall clock from its start to its exit."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "history", "--archive", str(root), "--step",
                           str(step), "--run", RUN, "--json"], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"rollstream history failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def _summary(samples: list[tuple[float, float]]) -> dict:
    walls, cpus = [s[0] for s in samples], [s[1] for s in samples]
    return {"s": round(statistics.median(walls), 4), "s_spread": [round(min(walls), 4), round(max(walls), 4)],
            "cpu_s": round(statistics.median(cpus), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=100_000, help="trajectories in the archive (2 turns each)")
    parser.add_argument("--reps", type=int, default=5, help="rounds of questions")
    parser.add_argument("--batch", type=int, default=64, help="trajectories a step trains")
    args = parse_args(parser, SMOKE)
    if args.trajectories < args.batch:
        parser.error(f"--trajectories is at least one batch ({args.batch}), got {args.trajectories}")
    temp = Path(tempfile.mkdtemp(prefix="rollstream-history-"))
    try:
        root = temp / "archive"
        built, trained = build_archive(temp / "data", root, args.trajectories, args.batch)
        shape = archive_shape(root)
        if shape["rows"] != args.trajectories:
            raise RuntimeError(f"the archive holds {shape['rows']} rows, expected {args.trajectories}")
        print(f"built an archive of {shape['rows']} trajectories in {built:.1f} s: {shape['files']} files, "
              f"{shape['row_groups']} row groups, {shape['facts_mb']:.1f} MB of facts, {shape['segments_mb']:.1f} MB of "
              "segments")

        from rollstream.app.history import History

        last = (args.trajectories - 1) // args.batch
        steps = [0, last // 2, last]
        ids = [trained[0], trained[len(trained) // 2], trained[-1]]

        def expect_step(rows: list, step: int) -> None:
            if len(rows) != min(args.batch, args.trajectories - step * args.batch) or any(
                    not r["weight_versions"] for r in rows):
                raise RuntimeError(f"step {step}'s answer is not its whole batch with its versions: {rows[:2]}")

        cold_wall, cold_cpu, rows = timed(lambda: History(root).step(steps[1], run=RUN))
        expect_step(rows, steps[1])
        print(f"first answer of the process (step {steps[1]}): {cold_wall:.3f} s, CPU {cold_cpu:.3f} s")
        fresh: list[tuple[float, float]] = []
        reused: list[tuple[float, float]] = []
        stories: list[tuple[float, float]] = []
        commands: list[float] = []
        history = History(root)
        for rep in range(args.reps):
            for step in steps:
                wall, cpu, rows = timed(lambda step=step: History(root).step(step, run=RUN))
                expect_step(rows, step)
                fresh.append((wall, cpu))
                wall, cpu, rows = timed(lambda step=step: history.step(step, run=RUN))
                expect_step(rows, step)
                reused.append((wall, cpu))
            for tid in ids:
                wall, cpu, told = timed(lambda tid=tid: History(root).trajectory(tid))
                if told["trajectory_id"] != tid or "trained" not in [event["event"] for event in told["events"]]:
                    raise RuntimeError(f"the story of {tid} is not its own: {told}")
                stories.append((wall, cpu))
            commands.append(command_seconds(root, steps[rep % len(steps)]))
            print(f"rep {rep}: step fresh {statistics.median(w for w, _ in fresh[-3:]):.3f} s, reused "
                  f"{statistics.median(w for w, _ in reused[-3:]):.3f} s, story "
                  f"{statistics.median(w for w, _ in stories[-3:]):.3f} s, command {commands[-1]:.2f} s")
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    step_figures, reused_figures, story_figures = _summary(fresh), _summary(reused), _summary(stories)
    print(f"step's answer (fresh History): {step_figures['s']:.3f} s (spread {step_figures['s_spread']}), CPU "
          f"{step_figures['cpu_s']:.3f} s; reused History: {reused_figures['s']:.3f} s; a story: {story_figures['s']:.3f} "
          f"s; the whole command: {statistics.median(commands):.2f} s; target: under 1 s at 100,000 rows")
    print(json.dumps({
        "history_step_s": step_figures["s"], "history_step_s_spread": step_figures["s_spread"],
        "history_step_cpu_s": step_figures["cpu_s"],
        "history_step_reused_s": reused_figures["s"], "history_step_reused_s_spread": reused_figures["s_spread"],
        "history_step_reused_cpu_s": reused_figures["cpu_s"],
        "history_trajectory_s": story_figures["s"], "history_trajectory_s_spread": story_figures["s_spread"],
        "history_trajectory_cpu_s": story_figures["cpu_s"],
        "history_cold_step_s": round(cold_wall, 4), "history_cold_step_cpu_s": round(cold_cpu, 4),
        "history_command_s": round(statistics.median(commands), 3),
        "history_command_s_spread": [round(min(commands), 3), round(max(commands), 3)],
        "rows": shape["rows"], "files": shape["files"], "row_groups": shape["row_groups"],
        "facts_mb": round(shape["facts_mb"], 2), "segments_mb": round(shape["segments_mb"], 2),
        "archive_mb": round(shape["facts_mb"] + shape["segments_mb"], 2), "batch": args.batch, "reps": args.reps,
        "build_s": round(built, 1),
    }))


if __name__ == "__main__":
    main()
