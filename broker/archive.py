"""The run's data as a dataset: trajectories the broker is about to delete
are first written to Parquet files another tool can read (docs/archive.md).

A forgotten trajectory (a commit deleted it, a seal reclaimed it, or a
pruned dead letter with `archive_dead_letters`) stays in the store marked
`archiving` (`Store.archive_work`). The `Archiver` writes those rows, a
file at a time, on a thread of its own; only once a file is durable
(written beside its place, fsynced, renamed into place, its directory
fsynced) does the broker delete its rows (`Store.archived`). A file's
number is fixed in the store before it is written, so a broker killed
mid-file writes the same file again at its next start: never a row lost,
never one twice.

Files are partitioned the Hive way, which pyarrow, DuckDB and polars read
as one table: `job=<job>/outcome=<outcome>/<store id>-<number>.parquet`,
the outcome `trained`, `delivered` (deleted on commit) or `dead`. Both keys
are also columns of every file (Hugging Face `datasets` reads the files
alone), and never null: a partition key that is null in every file leaves
a reader unable to tell its type. A run, lineage and step are columns,
which a reader's filter prunes by row-group statistics. pyarrow is imported
here only: the broker imports this module only with `--archive`.
"""
from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollstream.common.contract import ARRAYS
from rollstream.common.jobs import job_of, wire_id
from rollstream.common.trajectory import Trajectory

from .engine import State
from .recovery import load_trajectory
from .store import ArchiveBatch, ArchiveOutcome, Store, StoredTrajectory

log = logging.getLogger("rollstream.broker")

# The archive's schema, in each file's key-value metadata; docs/archive.md says what each version holds.
SCHEMA_VERSION = 1
SCHEMA_KEY = b"rollstream:archive_schema"

_TIME = pa.timestamp("us", tz="UTC")
_SPAN = pa.struct([("start", pa.int32()), ("end", pa.int32())])
_VERSION_SPAN = pa.struct([("version", pa.string()), ("start", pa.int32()), ("end", pa.int32())])

# The trajectory's arrays, one list per row in the contract's dtype; the supports as the contract carries them
# (CSR: a row's `mask_offsets` start at 0, token i's ids are mask_ids[offsets[i]:offsets[i + 1]]), which costs the
# writer a fraction of what a list of lists per token does.
ARCHIVED_ARRAYS = ("prompt_tokens", "tokens", "log_probs", "loss_mask", "mask_ids", "mask_offsets")
# Columns a reader filters on: only these get statistics (and the small text ones dictionaries), which the large
# array columns would pay for on every value.
FILTERED = ("trajectory_id", "job", "run", "lineage", "step", "position", "outcome", "producer", "first_turn_at",
            "ended_at", "committed_at")
DICTIONARY = ("job", "run", "lineage", "outcome", "status", "producer", "dead_reason", "gap_field")
# zstd's fastest level, whose Huffman-coded literals are what shrinks random token ids, and delta encoding for the
# two columns whose values step by little (each row's support offsets climb, the loss mask is runs of 0 and 1),
# which halves their cost and size (bench/export.py).
ZSTD_LEVEL = 1
DELTA_ENCODED = {f"{name}.list.element": "DELTA_BINARY_PACKED" for name in ("mask_offsets", "loss_mask")}

SCHEMA = pa.schema([
    ("trajectory_id", pa.string()), ("job", pa.string()), ("run", pa.string()), ("lineage", pa.string()),
    ("epoch", pa.int64()), ("step", pa.int64()), ("position", pa.int64()), ("group_id", pa.string()), ("group_size", pa.int32()),
    ("sample_index", pa.int32()), ("producer", pa.string()), ("outcome", pa.string()), ("dead_reason", pa.string()),
    ("status", pa.string()), ("turns", pa.int32()), ("response_length", pa.int32()),
    *((name, pa.list_(pa.from_numpy_dtype(ARRAYS[name].dtype))) for name in ARCHIVED_ARRAYS),
    ("forced_spans", pa.list_(_SPAN)), ("gap_turn", pa.int32()), ("gap_field", pa.string()),
    ("reward", pa.float64()), ("reward_json", pa.string()), ("metadata_json", pa.string()),
    ("weight_version_spans", pa.list_(_VERSION_SPAN)), ("first_turn_at", _TIME), ("ended_at", _TIME),
    ("first_delivered_at", _TIME), ("committed_at", _TIME), ("dead_at", _TIME), ("deliveries", pa.int32()),
], metadata={SCHEMA_KEY: str(SCHEMA_VERSION).encode()})


# What a row the broker still holds reports (`rollstream export`): its state, an ended one as `queued`.
_HELD_OUTCOMES = {State.OPEN: "open", State.SCORING: "scoring", State.ENDED: "queued", State.TRAINED: "trained",
                  State.DEAD: "dead", State.LEFT: "left"}


def outcome_of(stored: StoredTrajectory) -> str:
    """How an archiving row left the broker: trained at a step, delivered
    (deleted on commit) or dead; a row still held reports its state."""
    if stored.state != State.ARCHIVING:
        return _HELD_OUTCOMES[stored.state]
    if stored.dead_reason is not None:
        return "dead"
    return "trained" if stored.trained is not None else "delivered"


def file_path(root: Path, stored: StoredTrajectory, store_id: str, number: int) -> Path:
    """Where archive file `number` goes: under its rows' job and outcome (`Store.archive_work` keeps them apart)."""
    return root / f"job={job_of(stored.trajectory_id)}" / f"outcome={outcome_of(stored)}" / f"{store_id}-{number:08d}.parquet"


def _lists(name: str, arrays: Sequence[np.ndarray | None]) -> pa.Array:
    """Contract array `name` of each row as one list column: the values
    joined once, the offsets from their lengths (no Python list per
    element); None: a null row (a trajectory without supports)."""
    dtype = ARRAYS[name].dtype
    offsets = np.zeros(len(arrays) + 1, np.int32)
    np.cumsum([0 if a is None else len(a) for a in arrays], out=offsets[1:])
    present = [a for a in arrays if a is not None]
    values = np.concatenate(present).astype(dtype, copy=False) if present else np.empty(0, dtype)
    null = pa.array([a is None for a in arrays], pa.bool_()) if len(present) < len(arrays) else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.from_numpy_dtype(dtype)), mask=null)


def _times(seconds: Sequence[float | None]) -> pa.Array:
    return pa.array([None if s is None else int(s * 1_000_000) for s in seconds], pa.int64()).cast(_TIME)


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True, default=repr)


def _number(value: Any) -> float | None:
    """A reward as a number, where it is one (a structured reward stays in `reward_json`)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def archive_table(rows: Sequence[tuple[StoredTrajectory, Trajectory]]) -> pa.Table:
    """One archive row per (stored rows, merged trajectory), in `SCHEMA`."""
    stored = [s for s, _ in rows]
    merged = [t for _, t in rows]
    arrays: list[Mapping[str, Any]] = [t.arrays() for t in merged]  # whole arrays: no `parts_from`
    trained = [s.trained for s in stored]
    columns: dict[str, Any] = {
        "trajectory_id": [wire_id(s.trajectory_id) for s in stored],
        "job": [job_of(s.trajectory_id) for s in stored],
        "run": [t and t.run for t in trained],
        "lineage": [t and t.lineage for t in trained],
        "epoch": [t and t.epoch for t in trained],
        "step": [t and t.step for t in trained],
        "position": [t and t.position for t in trained],
        "group_id": [None if s.group_id is None else wire_id(s.group_id) for s in stored],
        "group_size": [s.group_size for s in stored],
        "sample_index": [s.sample_index for s in stored],
        "producer": [s.producer for s in stored],
        "outcome": [outcome_of(s) for s in stored],
        "dead_reason": [s.dead_reason for s in stored],
        "status": [t.status for t in merged],
        "turns": [t.turns for t in merged],
        "response_length": [t.response_length for t in merged],
        **{name: _lists(name, [a.get(name) for a in arrays]) for name in ARCHIVED_ARRAYS},
        "forced_spans": [[{"start": a, "end": b} for a, b in t.forced_spans] for t in merged],
        "gap_turn": [None if s.gap is None else s.gap[0] for s in stored],
        "gap_field": [None if s.gap is None else s.gap[1] for s in stored],
        "reward": [_number(s.reward) for s in stored],
        "reward_json": [_json(s.reward) for s in stored],
        "metadata_json": [_json(s.metadata) for s in stored],
        "weight_version_spans": [[{"version": v, "start": a, "end": b} for spans in t.weight_version_spans
                                  for v, a, b in spans] for t in merged],
        "first_turn_at": _times([s.turns[0].at if s.turns else None for s in stored]),
        "ended_at": _times([s.turns[-1].at if s.turns else None for s in stored]),
        "first_delivered_at": _times([s.first_delivered_at for s in stored]),
        "committed_at": _times([s.committed_at for s in stored]),
        "dead_at": _times([s.dead_at for s in stored]),
        "deliveries": [s.deliveries for s in stored],
    }
    return pa.Table.from_pydict({name: columns[name] for name in SCHEMA.names}, schema=SCHEMA)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writer_options(compression: str = "zstd") -> dict[str, Any]:
    """How every file in the archive's schema is written (the archive's and `rollstream export`'s)."""
    return {"compression": compression, "compression_level": ZSTD_LEVEL if compression == "zstd" else None,
            "use_dictionary": list(DICTIONARY), "write_statistics": list(FILTERED), "column_encoding": DELTA_ENCODED}


def write_durably(table: pa.Table, path: Path, compression: str = "zstd") -> int:
    """Write `table` to `path` so that a reader sees all of it or nothing:
    a hidden file beside it (readers skip names that start with a dot),
    fsynced, renamed into place, the directory fsynced (each directory made
    on the way too). Returns the file's bytes."""
    made = [parent for parent in reversed(path.parents) if not parent.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    for directory in made:
        _fsync_directory(directory.parent)
    hidden = path.with_name(f".{path.name}.tmp")
    with open(hidden, "wb") as f:
        pq.write_table(table, f, **writer_options(compression))
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(hidden, path)
    _fsync_directory(path.parent)
    return size


class Archiver:
    """Writes archive files on a thread of its own, so a slow or full
    archive disk never holds up the broker's loop.

    Caller: the broker's thread, every method. Affects: the files being
    written (`busy`). Caller: the archive thread (`_run`), what it is handed:
    it reads the batch's records from the store's segments (through
    descriptors of its own, at offsets its rows keep referenced) and writes
    under `root`; its outcomes come back through `finished`."""

    def __init__(self, root: str | os.PathLike, store: Store, store_id: str, *, compression: str = "zstd"):
        self.root, self.store, self.store_id, self.compression = Path(root), store, store_id, compression
        self.busy: set[int] = set()  # numbers handed out and not yet finished
        self._work: queue.SimpleQueue[ArchiveBatch | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[ArchiveOutcome] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rollstream-archive", daemon=True)
        self._thread.start()

    def submit(self, batch: ArchiveBatch) -> None:
        self.busy.add(batch.number)
        self._work.put(batch)

    def finished(self) -> list[ArchiveOutcome]:
        """The files finished since the last call."""
        out: list[ArchiveOutcome] = []
        while True:
            try:
                result = self._done.get_nowait()
            except queue.Empty:
                return out
            self.busy.discard(result.number)
            out.append(result)

    def close(self) -> None:
        """Stop after the file being written; what is left is written at the next start."""
        self._work.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (batch := self._work.get()) is not None:
            try:
                self._done.put(self._write(batch))
            except Exception as exc:  # the batch stays in the store, handed out again
                self._done.put(ArchiveOutcome(batch.number, error=exc))

    def _write(self, batch: ArchiveBatch) -> ArchiveOutcome:
        rows = [(stored, load_trajectory(self.store, stored) if any(t.location for t in stored.turns)
                 else Trajectory(stored.trajectory_id)) for stored in batch.trajectories]  # none applied: no arrays
        path = file_path(self.root, batch.trajectories[0], self.store_id, batch.number)
        return ArchiveOutcome(batch.number, len(rows), write_durably(archive_table(rows), path, self.compression), path)
