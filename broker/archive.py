"""The run's data, kept: trajectories the broker is about to delete go to
the archive first (docs/archive.md), without their payload being read or
encoded again.

A forgotten trajectory (a commit deleted it, a seal reclaimed it, or a
pruned dead letter with `archive_dead_letters`) stays in the store marked
`archiving` (`Store.archive_work`). The `Archiver` writes those rows' facts
(ids, outcome, trained-at, rewards, times) and where each turn's record lies
to Parquet, a file at a time, on a thread of its own; only once a file is
durable (written beside its place, fsynced, renamed into place, its
directory fsynced) does the broker delete its rows (`Store.archived`). The
records themselves stay in the store's segment files, which are kept:
once no row refers to a segment any more, the archiver moves the file into
the archive whole (a rename where the archive shares the file system),
instead of the store deleting it; when a run ends, the segments still in
use are copied there, so that the archive holds everything archived. A
file's number is fixed in the store before it is written, so a broker
killed mid-file writes the same file again at its next start: never a row
lost, never one twice.

Layout: `job=<job>/outcome=<outcome>/<store id>-<number>.parquet` (Hive
partitions, which pyarrow, DuckDB and polars read as one table; the outcome
`trained`, `delivered` or `dead`), and the segments under
`_segments/<store id>/` (a name readers of the Parquet files skip).
`ArchiveReader` reads a row's records back and merges them, as
`rollstream export --archive` does to write the dataset with every token
(`DATASET_SCHEMA`, one file). pyarrow is imported here only: the broker
imports this module only with `--archive`.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rollstream.common.contract import ARRAYS, CONTEXT_REPLAY_ARRAYS, SUPPORT_LOG_PROB_ARRAYS, TOKEN_LOG_PROB_ARRAYS
from rollstream.common.errors import InvalidInput, RollstreamError
from rollstream.common.jobs import job_key, job_of, wire_id
from rollstream.common.segments import SegmentLog
from rollstream.common.trajectory import Trajectory

from .engine import State, TrainedAt
from .facts import TIMES, as_json, as_number, fact_row, left_as
from .recovery import load_trajectory
from .store import (
    ARCHIVE_COLUMNS,
    ARCHIVE_TURN_COLUMNS,
    ArchiveBatch,
    ArchiveOutcome,
    HandoverOutcome,
    SegmentHandover,
    Store,
    StoreCorrupted,
    StoredTrajectory,
    StoredTurn,
    StoreUnavailable,
    read_turn_records,
)

log = logging.getLogger("rollstream.broker")

# Each file's schema and its version, in its key-value metadata; docs/archive.md says what each version holds.
ARCHIVE_SCHEMA_VERSION = 2  # 1 held every token; 2 holds the facts and where the records lie
ARCHIVE_SCHEMA_KEY = b"rollstream:archive_schema"
DATASET_SCHEMA_VERSION = 3  # 2 adds per-token log-prob arrays (`full_log_probs`), 3 per-support-id ones (`mask_log_probs`)
DATASET_SCHEMA_KEY = b"rollstream:dataset_schema"
SEGMENTS = "_segments"  # the archive's segment files: `_` makes the Parquet readers skip them

_TIME = pa.timestamp("us", tz="UTC")
_SPAN = pa.struct([("start", pa.int32()), ("end", pa.int32())])
_VERSION_SPAN = pa.struct([("version", pa.string()), ("start", pa.int32()), ("end", pa.int32())])
_RECORD = pa.struct([("turn", pa.int32()), ("segment", pa.int64()), ("offset", pa.int64()), ("length", pa.int64()),
                     ("at", _TIME)])

# The trajectory's arrays, one list per row in the contract's dtype; the supports as the contract carries them
# (CSR: a row's `mask_offsets` start at 0, token i's ids are mask_ids[offsets[i]:offsets[i + 1]]), which costs the
# writer a fraction of what a list of lists per token does. The optional per-token log-probs, and the optional
# per-support-id ones (aligned with the row's `mask_ids`), are null for a row without them.
ARCHIVED_ARRAYS = ("prompt_tokens", "tokens", "log_probs", *TOKEN_LOG_PROB_ARRAYS, "loss_mask", "mask_ids", "mask_offsets",
                   *SUPPORT_LOG_PROB_ARRAYS)
# The context replay arrays (routed experts, indexer top-k; N-D): each row's values flattened, and its shape beside.
SHAPED_ARRAYS = CONTEXT_REPLAY_ARRAYS
# Columns a reader filters on: only these get statistics (and the small text ones dictionaries), which the large
# array columns would pay for on every value.
FILTERED = ("trajectory_id", "job", "run", "lineage", "step", "position", "outcome", "producer", "first_turn_at",
            "ended_at", "committed_at")
DICTIONARY = ("job", "run", "lineage", "outcome", "status", "producer", "dead_reason", "gap_field", "store_id")
# zstd's fastest level, whose Huffman-coded literals are what shrinks random token ids, and delta encoding for the
# two columns whose values step by little (each row's support offsets climb, the loss mask is runs of 0 and 1),
# which halves their cost and size (bench/export.py).
ZSTD_LEVEL = 1
DELTA_ENCODED = {f"{name}.list.element": "DELTA_BINARY_PACKED" for name in ("mask_offsets", "loss_mask")}

# What the store's rows say of a trajectory: the columns of both schemas.
_IDENTITY = [("trajectory_id", pa.string()), ("job", pa.string()), ("run", pa.string()), ("lineage", pa.string()),
             ("epoch", pa.int64()), ("step", pa.int64()), ("position", pa.int64()), ("group_id", pa.string()),
             ("group_size", pa.int32()), ("sample_index", pa.int32()), ("producer", pa.string()),
             ("outcome", pa.string()), ("dead_reason", pa.string())]
_ENDING = [("gap_turn", pa.int32()), ("gap_field", pa.string()), ("reward", pa.float64()), ("reward_json", pa.string()),
           ("metadata_json", pa.string())]
_TIMES = [("first_turn_at", _TIME), ("ended_at", _TIME), ("first_delivered_at", _TIME), ("committed_at", _TIME),
          ("dead_at", _TIME), ("deliveries", pa.int32())]

# The broker's archive: the facts, and each stored turn's record (its segment under `_segments/<store_id>/`).
ARCHIVE_SCHEMA = pa.schema([*_IDENTITY, *_ENDING, *_TIMES, ("ended", pa.bool_()), ("store_id", pa.string()),
                            ("records", pa.list_(_RECORD))],
                           metadata={ARCHIVE_SCHEMA_KEY: str(ARCHIVE_SCHEMA_VERSION).encode()})
# The dataset `rollstream export` writes: the facts and every token, merged.
DATASET_SCHEMA = pa.schema([
    *_IDENTITY, ("status", pa.string()), ("turns", pa.int32()), ("response_length", pa.int32()),
    *((name, pa.list_(pa.from_numpy_dtype(ARRAYS[name].dtype))) for name in ARCHIVED_ARRAYS),
    *(field for name in SHAPED_ARRAYS
      for field in ((name, pa.list_(pa.from_numpy_dtype(ARRAYS[name].dtype))), (f"{name}_shape", pa.list_(pa.int64())))),
    ("forced_spans", pa.list_(_SPAN)), *_ENDING, ("weight_versions", pa.list_(pa.string())),
    ("weight_version_spans", pa.list_(pa.list_(_VERSION_SPAN))), *_TIMES,
], metadata={DATASET_SCHEMA_KEY: str(DATASET_SCHEMA_VERSION).encode()})
# What `fact_row` gives: every fact but the end's metadata.
_FACT_ROW_COLUMNS = tuple(name for name, _ in (*_IDENTITY, *_ENDING, *_TIMES) if name != "metadata_json")
# What a dataset adds to the facts: read from the records, merged.
MERGED_COLUMNS = tuple(name for name in DATASET_SCHEMA.names if name not in ARCHIVE_SCHEMA.names)


def file_path(root: Path, job: str, outcome: str, store_id: str, number: int) -> Path:
    """Where archive file `number` goes: under its rows' job and outcome (`Store.archive_work` keeps them apart)."""
    return root / f"job={job}" / f"outcome={outcome}" / f"{store_id}-{number:08d}.parquet"


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


def _facts(stored: Sequence[StoredTrajectory]) -> dict[str, Any]:
    """The columns the store's rows give (`fact_row`, and the end's
    metadata), one value per trajectory."""
    rows = [fact_row(s) for s in stored]
    columns: dict[str, Any] = {name: [row[name] for row in rows] for name in _FACT_ROW_COLUMNS}
    columns.update({name: _times(columns[name]) for name in TIMES})
    columns["metadata_json"] = [as_json(s.metadata) for s in stored]
    return columns


def _unpacked(blob: bytes | None) -> Any:
    return None if blob is None else msgpack.unpackb(blob)


def archive_table(batch: ArchiveBatch, store_id: str) -> pa.Table:
    """One archive row per archiving trajectory of `batch`, in
    `ARCHIVE_SCHEMA`: its facts and where its turns' records lie, built
    column by column from the store's rows (nothing of the payload is
    read, no object made per row)."""
    n = len(batch.rows)
    c: dict[str, Sequence] = dict(zip(ARCHIVE_COLUMNS, zip(*batch.rows))) if n else dict.fromkeys(ARCHIVE_COLUMNS, ())
    bounds: dict[str, list[int]] = {}  # each trajectory's turns in `batch.turns`: [first, end)
    for i, turn in enumerate(batch.turns):
        bounds.setdefault(turn[0], [i, i])[1] = i + 1
    turns = batch.turns
    spans = [bounds.get(tid, (0, 0)) for tid in c["id"]]
    located = [[t for t in turns[a:b] if t[2] is not None] for a, b in spans]
    flat = [t for ts in located for t in ts]
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum([len(ts) for ts in located], out=offsets[1:])
    record_columns = list(zip(*flat)) if flat else [()] * len(ARCHIVE_TURN_COLUMNS)
    records = pa.StructArray.from_arrays(
        [pa.array(record_columns[1], pa.int32()), pa.array(record_columns[2], pa.int64()),
         pa.array(record_columns[3], pa.int64()), pa.array(record_columns[4], pa.int64()), _times(record_columns[5])],
        fields=list(_RECORD))
    rewards = [_unpacked(blob) for blob in c["reward"]]
    trained = c["trained_run"]
    columns: dict[str, Any] = {
        "trajectory_id": [wire_id(tid) for tid in c["id"]],
        "job": [job_of(tid) for tid in c["id"]],
        "run": [None if run is None else wire_id(run) for run in trained], "lineage": c["trained_lineage"],
        "epoch": c["trained_epoch"], "step": c["trained_step"],
        "position": c["trained_position"],
        "group_id": [None if gid is None else wire_id(gid) for gid in c["group_id"]],
        "group_size": c["group_size"], "sample_index": c["sample_index"], "producer": c["producer"],
        "outcome": [left_as(dead, run) for dead, run in zip(c["dead_reason"], trained)],
        "dead_reason": c["dead_reason"],
        "gap_turn": c["gap_turn"], "gap_field": c["gap_field"],
        "reward": [as_number(r) for r in rewards], "reward_json": [as_json(r) for r in rewards],
        "metadata_json": [as_json(_unpacked(blob)) for blob in c["metadata"]],
        "first_turn_at": _times([turns[a][5] if b > a else None for a, b in spans]),
        "ended_at": _times([turns[b - 1][5] if b > a else None for a, b in spans]),
        "first_delivered_at": _times(c["first_delivered_at"]), "committed_at": _times(c["committed_at"]),
        "dead_at": _times(c["dead_at"]), "deliveries": [d or 0 for d in c["deliveries"]],
        "ended": [digest is not None for digest in c["end_digest"]],
        "store_id": [store_id] * n,
        "records": pa.ListArray.from_arrays(pa.array(offsets), records),
    }
    return pa.Table.from_pydict({name: columns[name] for name in ARCHIVE_SCHEMA.names}, schema=ARCHIVE_SCHEMA)


def dataset_table(rows: Sequence[tuple[StoredTrajectory, Trajectory]]) -> pa.Table:
    """One dataset row per (stored rows, merged trajectory), in `DATASET_SCHEMA`."""
    stored = [s for s, _ in rows]
    merged = [t for _, t in rows]
    arrays: list[Mapping[str, Any]] = [t.arrays() for t in merged]  # whole arrays: no `parts_from`
    columns: dict[str, Any] = {
        **_facts(stored),
        "status": [t.status for t in merged],
        "turns": [t.turns for t in merged],
        "response_length": [t.response_length for t in merged],
        **{name: _lists(name, [a.get(name) for a in arrays]) for name in ARCHIVED_ARRAYS},
        **{name: _lists(name, [None if a.get(name) is None else np.ravel(a[name]) for a in arrays])
           for name in SHAPED_ARRAYS},
        **{f"{name}_shape": [None if a.get(name) is None else list(np.shape(a[name])) for a in arrays]
           for name in SHAPED_ARRAYS},
        "forced_spans": [[{"start": a, "end": b} for a, b in t.forced_spans] for t in merged],
        "weight_versions": [list(t.weight_versions) for t in merged],
        "weight_version_spans": [[[{"version": v, "start": a, "end": b} for v, a, b in spans]
                                  for spans in t.weight_version_spans] for t in merged],
    }
    return pa.Table.from_pydict({name: columns[name] for name in DATASET_SCHEMA.names}, schema=DATASET_SCHEMA)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def writer_options(schema: pa.Schema, compression: str = "zstd") -> dict[str, Any]:
    """How every file of `schema` (the archive's or the dataset's) is written."""
    names = set(schema.names)
    return {"compression": compression, "compression_level": ZSTD_LEVEL if compression == "zstd" else None,
            "use_dictionary": [n for n in DICTIONARY if n in names],
            "write_statistics": [n for n in FILTERED if n in names],
            "column_encoding": {n: e for n, e in DELTA_ENCODED.items() if n.split(".")[0] in names}}


def _made_durably(path: Path) -> None:
    """Make `path`'s directory and each one missing on the way, each entry durable."""
    made = [parent for parent in reversed(path.parents) if not parent.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    for directory in made:
        _fsync_directory(directory.parent)


def write_durably(table: pa.Table, path: Path, compression: str = "zstd") -> int:
    """Write `table` to `path` so that a reader sees all of it or nothing:
    a hidden file beside it (readers skip names that start with a dot),
    fsynced, renamed into place, the directory fsynced (each directory made
    on the way too). Returns the file's bytes."""
    _made_durably(path)
    hidden = path.with_name(f".{path.name}.tmp")
    with open(hidden, "wb") as f:
        pq.write_table(table, f, **writer_options(table.schema, compression))
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(hidden, path)
    _fsync_directory(path.parent)
    return size


def segments_of(root: Path, store_id: str) -> Path:
    """Where an archive keeps the segment files of the store `store_id`."""
    return root / SEGMENTS / store_id


def _copy_range(source: int, target: int, size: int, name: str) -> None:
    """Copy the first `size` bytes of file `source` (called `name`) to
    `target`, in the kernel where it can (`copy_file_range`), through
    memory where not."""
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(source, target, size - done, done, done)
            if n == 0:
                break
            done += n
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    while done < size:
        chunk = os.pread(source, min(size - done, 8 << 20), done)
        if not chunk:
            break
        done += os.pwrite(target, chunk, done)
    if done != size:
        raise StoreCorrupted(f"segment file {name} ends at {done} bytes: expected at least {size}, as far as the store "
                             "wrote it")


def place_segment(handover: SegmentHandover, directory: Path) -> int:
    """Put `handover`'s segment file into `directory` durably, under its
    own name; returns its bytes. A whole one is moved: renamed where the
    file system is the same, else copied and then deleted; a segment
    still in use is copied as far as `handover.size`. A copy is written
    beside its place under a hidden name, fsynced and renamed into place,
    so the archive never shows a part of one. A whole one found moved
    already (by a broker killed after the move) is taken as placed."""
    target = directory / handover.source.name
    _made_durably(target)
    if handover.whole:
        if not handover.source.exists() and target.exists():
            return target.stat().st_size
        try:
            os.replace(handover.source, target)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
        else:
            _fsync_directory(directory)
            _fsync_directory(handover.source.parent)
            return target.stat().st_size
    size = handover.source.stat().st_size if handover.whole else handover.size
    hidden = target.with_name(f".{target.name}.tmp")
    source = os.open(handover.source, os.O_RDONLY)
    try:
        out = os.open(hidden, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _copy_range(source, out, size, handover.source.name)
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(source)
    os.replace(hidden, target)
    _fsync_directory(directory)
    if handover.whole:
        handover.source.unlink()
    return size


class Archiver:
    """Writes archive files and places segment files on a thread of its
    own, so a slow or full archive disk never holds up the broker's loop.

    Caller: the broker's thread, every method. Affects: the files being
    written (`busy`) and the segments being placed (`placing`). Caller: the
    archive thread (`_run`), what it is handed: it writes under `root` from
    the rows it is given, and moves or copies the store's segment files it
    is given (a file no row refers to any more, or up to a committed
    size); its outcomes come back through `finished`."""

    def __init__(self, root: str | os.PathLike, store_id: str, *, compression: str = "zstd"):
        self.root, self.store_id, self.compression = Path(root), store_id, compression
        self.busy: set[int] = set()  # archive file numbers handed out and not yet finished
        self.placing: set[int] = set()  # segment numbers handed out and not yet finished
        self._work: queue.SimpleQueue[ArchiveBatch | SegmentHandover | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[ArchiveOutcome | HandoverOutcome] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="rollstream-archive", daemon=True)
        self._thread.start()

    def submit(self, work: ArchiveBatch | SegmentHandover) -> None:
        (self.placing if isinstance(work, SegmentHandover) else self.busy).add(work.number)
        self._work.put(work)

    def finished(self) -> list[ArchiveOutcome | HandoverOutcome]:
        """What finished since the last call."""
        out: list[ArchiveOutcome | HandoverOutcome] = []
        while True:
            try:
                result = self._done.get_nowait()
            except queue.Empty:
                return out
            if isinstance(result, HandoverOutcome):
                self.placing.discard(result.handover.number)
            else:
                self.busy.discard(result.number)
            out.append(result)

    def settled(self) -> bool:
        """Whether everything handed out is finished (its outcome waits for `finished`)."""
        return self._done.qsize() == len(self.busy) + len(self.placing)

    def close(self) -> None:
        """Stop after the work in hand; what is left is done at the next start."""
        self._work.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (work := self._work.get()) is not None:
            if isinstance(work, SegmentHandover):
                try:
                    self._done.put(HandoverOutcome(work, place_segment(work, segments_of(self.root, self.store_id))))
                except Exception as exc:  # the segment stays in the store, handed over again
                    self._done.put(HandoverOutcome(work, error=exc))
                continue
            try:
                table = archive_table(work, self.store_id)
                path = file_path(self.root, table["job"][0].as_py(), table["outcome"][0].as_py(), self.store_id,
                                 work.number)
                nbytes = write_durably(table, path, self.compression)
                self._done.put(ArchiveOutcome(work.number, len(work.rows), nbytes, path))
            except Exception as exc:  # the batch stays in the store, handed out again
                self._done.put(ArchiveOutcome(work.number, error=exc))


class ArchiveFailed(RollstreamError, RuntimeError):
    """An archive file or segment could not be written (`archive_stopped`;
    a running broker keeps what failed and tries again)."""

    code = "unavailable"


def archive_stopped(store: Store, archiver: Archiver, *, copies: bool = True) -> None:
    """All at once what the broker's archive steps do over many passes,
    for a store no broker runs (a bench, a test): every file its archiving
    rows make written and the rows deleted, then its segments placed (those
    still in use copied, with `copies`). A file or segment that cannot be
    written is raised (`ArchiveFailed`)."""
    while store.archive_waiting():
        for batch in store.archive_work(1024, archiver.busy):
            archiver.submit(batch)
        _settle(archiver, store)
    for handover in store.handover(archiver.placing, copies=copies):
        archiver.submit(handover)
    _settle(archiver, store)


def _settle(archiver: Archiver, store: Store) -> None:
    """Wait for what `archiver` holds and apply each outcome to `store`."""
    while not archiver.settled():
        time.sleep(0.001)
    for outcome in archiver.finished():
        if outcome.error is not None:
            raise ArchiveFailed(f"{outcome.what} could not be written: {outcome.error}") from outcome.error
        if isinstance(outcome, HandoverOutcome):
            store.handed_over(outcome.handover)
        else:
            store.archived(outcome.number)


def is_archive(root: Path) -> bool:
    """Whether the Parquet files under `root` are a broker's archive (the
    facts and records) rather than a dataset `rollstream export` wrote."""
    import pyarrow.dataset as ds

    return ARCHIVE_SCHEMA_KEY in (ds.dataset(root, format="parquet", partitioning="hive").schema.metadata or {})


class _ArchivedRecords:
    """One store's segment files in an archive, read as the store reads its
    own (`load_trajectory` asks it for `read_turns`)."""

    def __init__(self, directory: Path):
        self.segments = SegmentLog.read_only(directory, damaged=StoreCorrupted)

    def read_turns(self, locations: list[tuple[int, int, int]]):
        return read_turn_records(self.segments, locations)

    def lacks(self, locations: Sequence[tuple[int, int, int]]) -> bool:
        """Whether a record at `locations` lies past what the archive holds
        of its segment (none of it, or a copy made before it was archived)."""
        for number, offset, length in locations:
            path = self.segments.path(number)
            if not path.exists() or path.stat().st_size < offset + length:
                return True
        return False


def stored_of(row: Mapping[str, Any]) -> StoredTrajectory:
    """The store's view of an archive row (`ARCHIVE_SCHEMA`), as
    `load_trajectory` and `dataset_table` take it."""
    job = row["job"]
    trained = None if row["run"] is None else TrainedAt(job_key(job, row["run"]), row["lineage"], row["step"],
                                                        row["position"], row["epoch"])

    def seconds(value) -> float | None:
        return None if value is None else value.timestamp()

    turns = [StoredTurn(r["turn"], None, True, None, (r["segment"], r["offset"], r["length"]), r["at"].timestamp())
             for r in row["records"]]
    return StoredTrajectory(
        job_key(job, row["trajectory_id"]), State.ARCHIVING,
        None if row["group_id"] is None else job_key(job, row["group_id"]), row["group_size"], row["sample_index"],
        updated_at=0.0, end_digest=b"" if row["ended"] else None,
        reward=None if row["reward_json"] is None else json.loads(row["reward_json"]),
        metadata=None if row["metadata_json"] is None else json.loads(row["metadata_json"]), ready_seq=None,
        gap=None if row["gap_turn"] is None else (row["gap_turn"], row["gap_field"]),
        dead_reason=row["dead_reason"], dead_at=seconds(row["dead_at"]), trained=trained, turns=turns,
        producer=row["producer"], first_delivered_at=seconds(row["first_delivered_at"]), deliveries=row["deliveries"],
        committed_at=seconds(row["committed_at"]))


class ArchiveReader:
    """A broker's archive read back: its rows by a pyarrow filter (files and
    row groups pruned by partition and statistics), and their merged
    trajectories from the archive's segment files."""

    def __init__(self, root: str | os.PathLike):
        import pyarrow.dataset as ds

        self.root = Path(root)
        if not self.root.is_dir() or not is_archive(self.root):
            raise InvalidInput(f"a broker's archive is a directory of its Parquet files (`rollstream broker "
                               f"--archive`): expected one at {self.root}, found "
                               f"{'nothing' if not self.root.exists() else 'something else'}")
        self.dataset = ds.dataset(self.root, format="parquet", partitioning="hive")
        self._records: dict[str, _ArchivedRecords] = {}
        self.lacking = 0  # rows `load` found whose records the archive does not hold yet

    def batches(self, condition=None) -> Iterator[list[tuple[StoredTrajectory, str]]]:
        """The rows `condition` picks, a record batch at a time, as the
        store's rows, each with the id of the store whose segments hold its
        records."""
        for batch in self.dataset.to_batches(filter=condition, batch_size=256):
            yield [(stored_of(row), row["store_id"]) for row in batch.to_pylist()]

    def load(self, stored: StoredTrajectory, store_id: str) -> Trajectory | None:
        """The merged trajectory, or None (counted in `lacking`) when a
        segment of its records is not in the archive yet: it is moved there
        once no row of the broker refers to it, or copied when a run ends."""
        if not any(t.location for t in stored.turns):
            return Trajectory(stored.trajectory_id)  # nothing applied: no arrays
        records = self._records.setdefault(store_id, _ArchivedRecords(segments_of(self.root, store_id)))
        try:
            return load_trajectory(records, stored)  # type: ignore[arg-type]
        except (StoreUnavailable, StoreCorrupted):
            if not records.lacks([t.location for t in stored.turns if t.location]):
                raise
            self.lacking += 1
            return None
