"""`rollstream export` of a large store: Parquet bytes written per second
and the export's peak resident memory.

First a store is built in this process, fast: `--trajectories` trajectories
shaped like bench/pipeline.py's eight-turn ones (TransferQueue's workload:
a 512-token prompt, 5,000 response tokens sent as 8 turns of 625, supports
of size min(geometric(1/8), 64), each sample drawn fresh), merged by a
`MergeEngine` and committed by a `Store` as a broker would, then trained at
steps of 32 (a trained row carries its run, step and position). 100,000 of
them (the issue's size) make about 25 GB; `--smoke` makes a few hundred.

Then each rep runs the export in a child process of its own (`python -c`
calling `rollstream.broker.export.export`, as the command does), every
format of `--formats` in turn within a rep, so the formats share the
machine's state. The child times the export call alone (its interpreter's
start and imports aside, pyarrow's lazy ones included) and reports its own
peak RSS (`ru_maxrss`): that is the whole process's, the interpreter and
pyarrow included. `export_mb_per_s` is the Parquet file's bytes over those
seconds, median of `--reps` (with the spread, min and max);
`export_peak_rss_mb` the largest peak of any rep. The targets (issue 52)
are at least 200 MB/s and at most 512 MiB; the figures are printed, never
judged. `--from-archive` also ends the run on a copy of the store with
an archive (`--archive`: its rows' facts written, its segments moved) and
exports that archive too, in the same reps (`export_archive_*`: the
records read from the archive's segments and merged, as
`rollstream export --archive` does). The last line is one JSON object.

    .venv/bin/python bench/export.py [--trajectories 2000] [--reps 3] [--formats parquet,miles] [--from-archive]
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
from pathlib import Path

from pipeline import split_turns, workload
from procs import parse_args
from stores import applied

from rollstream.broker.engine import EngineSettings, MergeEngine, TrainedAt
from rollstream.broker.recovery import rebuild
from rollstream.broker.store import Archiving, Store
from rollstream.common.codec import decode, encode
from rollstream.common.messages import PRODUCER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn

SMOKE = {"trajectories": 300, "reps": 1}  # the sizes of --smoke
TURNS = 8
COMMIT_EVERY = 32  # trajectories per store commit and per training step
DRAW_EVERY = 64  # samples drawn at once (each fresh: a seed per draw)
FORMATS = ("parquet", "miles")

# The child: one export, timed after its imports (pyarrow's own lazy ones too, which its first table from Python
# lists makes: pandas, where installed), and its own peak RSS (ru_maxrss is in KiB on Linux).
CHILD = """
import json, resource, sys, time
import pyarrow
from rollstream.broker.export import export, export_archive
pyarrow.Table.from_pydict({"warm": [0]})
source, out, fmt, kind = sys.argv[1:5]
start = time.perf_counter()
result = (export if kind == "store" else export_archive)(source, out, fmt=fmt)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "rows": result.rows, "bytes": result.nbytes, "skipped": result.skipped,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _messages(tid: str, sample: dict) -> list:
    """The sample's frames as a producer sends them (8 turns, then `end`), decoded as the broker reads them."""
    out = []
    for k, part in enumerate(split_turns(sample, TURNS)):
        turn = Turn.build(part["tokens"], part["log_probs"], loss_mask=part["loss_mask"], mask_ids=part["mask_ids"],
                          mask_offsets=part["mask_offsets"], check_content=False)
        first = {"prompt_tokens": sample["prompt_tokens"]} if k == 0 else {}
        out.append(encode_turn(tid, k, turn, seq=k, checked=False, **first))
    out.append(encode(PRODUCER_TO_BROKER, "end", {"seq": TURNS, "trajectory_id": tid, "reward": 1.0}))
    return [decode(frames, PRODUCER_TO_BROKER, check_content=False) for frames in out]


def build_store(data_dir: Path, trajectories: int) -> float:
    """Fill a store at `data_dir` with `trajectories` trained ones; its seconds."""
    start = time.perf_counter()
    store = Store(data_dir)
    store.open()
    engine = MergeEngine(EngineSettings())
    wall = time.time()
    try:
        for first in range(0, trajectories, DRAW_EVERY):
            samples = workload(min(DRAW_EVERY, trajectories - first), seed=first)
            for batch in range(0, len(samples), COMMIT_EVERY):
                effects, tids = [], []
                for i, sample in enumerate(samples[batch : batch + COMMIT_EVERY], first + batch):
                    tid = f"t{i:07d}"
                    effects += applied(engine, tid, _messages(tid, sample), wall, "bench")
                    tids.append(tid)
                store.commit(effects)
                engine.saved()
                step = (first + batch) // COMMIT_EVERY
                store.commit([e for position, tid in enumerate(tids)
                              for e in engine.trained(tid, TrainedAt("bench-run", "bench-lineage", step, position), wall)])
    finally:
        store.close()
    return time.perf_counter() - start


def build_archive(data_dir: Path, archive: Path) -> float:
    """End the bench's run on the store at `data_dir` with an archive at
    `archive`: every trajectory's facts written, its segments placed; the
    seconds."""
    from rollstream.broker.archive import Archiver, archive_stopped  # pyarrow, as a broker with --archive imports it

    start = time.perf_counter()
    store = Store(data_dir, archive=Archiving())
    engine = MergeEngine(EngineSettings())
    engine.restore(*rebuild(store.open(), store).engine_state())
    archiver = Archiver(archive, store.store_id)
    try:
        store.commit(engine.end_run("bench-run", time.time()))
        archive_stopped(store, archiver)
    finally:
        archiver.close()
        store.close()
    return time.perf_counter() - start


def store_bytes(data_dir: Path) -> int:
    return sum(p.stat().st_size for p in data_dir.rglob("*") if p.is_file())


def run_export(source: Path, out: Path, fmt: str, kind: str = "store") -> dict:
    """One export (of a data directory, or `kind="archive"` of an archive) in
    a child process: its seconds, rows, bytes written and peak RSS."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(source), str(out), fmt, kind], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the export child failed ({done.returncode}):\n{done.stderr[-3000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if out.is_dir():
        shutil.rmtree(out)
    else:
        out.unlink()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=100_000, help="trajectories in the store (8 turns each)")
    parser.add_argument("--reps", type=int, default=3, help="exports of each format")
    parser.add_argument("--formats", default="parquet", help=f"comma-separated, of {list(FORMATS)}")
    parser.add_argument("--from-archive", action="store_true", help="also export the run's archive (parquet)")
    args = parse_args(parser, SMOKE)
    formats = [name for name in args.formats.split(",") if name]
    if not formats or set(formats) - set(FORMATS):
        parser.error(f"--formats takes names from {list(FORMATS)}, got {args.formats!r}")
    root = Path(tempfile.mkdtemp(prefix="rollstream-export-"))
    try:
        data_dir = root / "data"
        built = build_store(data_dir, args.trajectories)
        size = store_bytes(data_dir)
        print(f"built a store of {args.trajectories} trajectories of {TURNS} turns: {size / 1e9:.2f} GB in {built:.1f} s")
        sources = [("store", fmt, data_dir) for fmt in formats]
        if args.from_archive:
            shutil.copytree(data_dir, root / "ended")
            archived = build_archive(root / "ended", root / "archive")
            print(f"ended the run with an archive in {archived:.1f} s")
            sources.append(("archive", "parquet", root / "archive"))
        runs: dict[str, list[dict]] = {f"{kind}:{fmt}": [] for kind, fmt, _ in sources}
        for rep in range(args.reps):
            for kind, fmt, source in sources:
                figures = run_export(source, root / f"out-{kind}-{fmt}", fmt, kind)
                if (figures["rows"], figures["skipped"]) != (args.trajectories, 0):
                    raise RuntimeError(f"an export of a stopped {kind} wrote {figures['rows']} rows and skipped "
                                       f"{figures['skipped']}, expected {args.trajectories} and 0")
                runs[f"{kind}:{fmt}"].append(figures)
            print(f"rep {rep}: " + "  ".join(
                f"{fmt} {r[-1]['bytes'] / r[-1]['seconds'] / 1e6:.0f} MB/s in {r[-1]['seconds']:.2f} s, "
                f"peak RSS {r[-1]['peak_rss'] / 2**20:.0f} MiB" for fmt, r in runs.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary: dict = {}
    for name, reps in runs.items():
        kind, fmt = name.split(":")
        prefix = "export" + ("" if kind == "store" else f"_{kind}") + ("" if fmt == "parquet" else f"_{fmt}")
        rates = [r["bytes"] / r["seconds"] / 1e6 for r in reps]
        summary.update({
            f"{prefix}_mb_per_s": round(statistics.median(rates), 1),
            f"{prefix}_mb_per_s_spread": [round(min(rates), 1), round(max(rates), 1)],
            f"{prefix}_peak_rss_mb": round(max(r["peak_rss"] for r in reps) / 2**20, 1),
            f"{prefix}_trajectories_per_s": round(statistics.median(r["rows"] / r["seconds"] for r in reps), 1),
            f"{prefix}_output_mb": round(statistics.median(r["bytes"] for r in reps) / 1e6, 1),
        })
    summary.update(trajectories=args.trajectories, store_gb=round(size / 1e9, 3), reps=args.reps,
                   build_s=round(built, 1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
