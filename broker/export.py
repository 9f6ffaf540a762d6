"""`rollstream export`: the trajectories a broker's data directory or its
archive holds, as a dataset with every token (Parquet in `DATASET_SCHEMA`,
broker/archive.py) or as miles session payloads, from a stopped broker's
store, a live one's, or an archive (`ArchiveReader`).

A live broker is neither held up nor changed: the export takes no directory
lock and writes no file of the store. It opens SQLite read-only and copies
the selected rows and their turns' rows, in one read transaction (so WAL
gives it one snapshot: each trajectory whole, as a commit left it, or not at
all), into a file of its own beside the output; the transaction lasts as
long as that copy, milliseconds per thousand trajectories, so the broker's
WAL is never held back for the export's length. Turn records are then read
by offset from the segment files, which are append-only: a record never
changes while a row refers to it. A segment file the live broker retired
after the snapshot means that every trajectory with a record in it was
deleted meanwhile: such a trajectory is skipped and counted, never written
in part. (SQLite itself may create the empty `-wal` and `-shm` files beside
a stopped store's database, as any reader of a WAL database does.)

Memory stays bounded whatever the store holds: rows are read out of the
copy a page of `chunk_rows` at a time, by id, and written as Parquet row
groups of at most `chunk_rows` trajectories and about `chunk_bytes` of
records, each written on a thread of its own while the next is read.

pyarrow is imported here: the command imports this module only when it runs.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow.parquet as pq

from rollstream.common.errors import InternalError, InvalidInput
from rollstream.common.jobs import DEFAULT_JOB, SEPARATOR, job_of, wire_id
from rollstream.common.mask import SamplingMask
from rollstream.common.miles import DEFAULT_FIELDS, FIELDS_WITH_MASK, MASK_LOG_PROBS, encode_session_samples
from rollstream.common.trajectory import Trajectory

from .archive import DATASET_SCHEMA, ArchiveReader, dataset_table, writer_options
from .engine import State
from .facts import outcome_of
from .recovery import load_trajectory
from .store import SCHEMA_VERSION, Segments, Store, StoreCorrupted, StoredTrajectory, StoreUnavailable

FORMATS = ("parquet", "miles")
CHUNK_ROWS = 256  # trajectories per page of rows read and per row group written, at most
# Records per row group, about: a group closes once it holds this much. Groups this small stay in the CPU's
# caches from the read to the write; 64 MB ones were slower and took twice the memory (bench/export.py).
CHUNK_BYTES = 16 << 20

_TRAINED = (f"(state = '{State.TRAINED}' OR (state = '{State.ARCHIVING}' AND dead_reason IS NULL "
            "AND trained_run IS NOT NULL))")
_QUEUED = f"state = '{State.ENDED}'"
_DEAD = f"(state = '{State.DEAD}' OR (state = '{State.ARCHIVING}' AND dead_reason IS NOT NULL))"
_ANY = f"state != '{State.LEFT}'"
_WITH_DATA = "EXISTS (SELECT 1 FROM turns WHERE trajectory_id = trajectories.id AND segment IS NOT NULL)"


@dataclass(frozen=True)
class Selection:
    """Which trajectories to export. The state filters add up (a union):
    `trained` (with `steps`, only those trained at a step in that inclusive
    range), `queued` (ended, waiting for delivery), `dead_letters`; none
    means every trajectory with data, open ones too. `job` and `since` (the
    last turn arrived at or after this wall time) narrow what they select."""

    job: str | None = None
    steps: tuple[int, int] | None = None
    trained: bool = False
    queued: bool = False
    dead_letters: bool = False
    since: float | None = None

    def condition(self) -> tuple[str, tuple]:
        """SQL over the `trajectories` table and its arguments."""
        states: list[str] = []
        args: list[object] = []
        if self.trained or self.steps is not None:
            states.append(_TRAINED if self.steps is None else f"({_TRAINED} AND trained_step BETWEEN ? AND ?)")
            args += self.steps or ()
        if self.queued:
            states.append(_QUEUED)
        if self.dead_letters:
            states.append(_DEAD)
        parts = [f"({' OR '.join(states)})" if states else _ANY, _WITH_DATA]
        if self.job == DEFAULT_JOB:
            parts.append("instr(id, char(31)) = 0")
        elif self.job is not None:  # its keys are `job` U+001F `id`: one range of the primary key
            parts.append("id >= ? AND id < ?")
            args += [self.job + SEPARATOR, self.job + chr(ord(SEPARATOR) + 1)]
        if self.since is not None:
            parts.append("EXISTS (SELECT 1 FROM turns WHERE trajectory_id = trajectories.id AND at >= ?)")
            args.append(self.since)
        return " AND ".join(parts), tuple(args)

    def archive_condition(self):
        """The same selection as a pyarrow filter over an archive's rows
        (which are never queued: the broker archives what it lets go of)."""
        import datetime

        import pyarrow.dataset as ds

        if self.queued:
            raise InvalidInput("an archive holds what the broker let go of, never a queued trajectory: expected "
                               "--trained, --steps or --dead-letters, got --queued")
        outcomes = []
        if self.trained or self.steps is not None:
            trained = ds.field("outcome") == "trained"
            if self.steps is not None:
                trained &= (ds.field("step") >= self.steps[0]) & (ds.field("step") <= self.steps[1])
            outcomes.append(trained)
        if self.dead_letters:
            outcomes.append(ds.field("outcome") == "dead")
        condition = None
        for outcome in outcomes:
            condition = outcome if condition is None else condition | outcome
        narrowing = []
        if self.job is not None:
            narrowing.append(ds.field("job") == self.job)
        if self.since is not None:
            narrowing.append(ds.field("ended_at") >= datetime.datetime.fromtimestamp(self.since, datetime.timezone.utc))
        for narrow in narrowing:
            condition = narrow if condition is None else condition & narrow
        return condition


class Exported(NamedTuple):
    """What an export wrote."""

    rows: int
    nbytes: int  # of the file written (Parquet) or of the payloads (miles)
    skipped: int  # deleted by the live broker between the snapshot and the read of their records


def _deletes_nothing(path: Path) -> None:
    raise InternalError(f"an export never deletes a segment file: expected no delete, asked to delete {path}")


class StoreSnapshot(Store):
    """A broker's store read where it lies, stopped or live, without a lock
    and without writing to it: the selected rows copied out in one read
    transaction (`take`), records read by offset through descriptors of its
    own. `Store.__init__` is not run: it takes the data directory's lock and
    opens the store to write."""

    def __init__(self, data_dir: str | os.PathLike):
        self.data_dir = Path(data_dir)
        self.db_path = self.data_dir / "state.sqlite"
        for path, kind in ((self.db_path, "file"), (self.data_dir / "segments", "directory")):
            if not (path.is_file() if kind == "file" else path.is_dir()):
                raise InvalidInput(f"a broker's data directory holds state.sqlite and segments/: expected a {kind} "
                                   f"at {path}, found {'nothing' if not path.exists() else 'something else'}")
        self.segments = Segments(self.data_dir / "segments", 1 << 62, _deletes_nothing)
        self.db = self._read_only()
        self._verdicts: dict[int, bool] = {}  # missing segment -> whether no row refers to it any more
        self.skipped = 0  # trajectories `load` found deleted since the snapshot

    def _read_only(self) -> sqlite3.Connection:
        return sqlite3.connect(f"{self.db_path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)

    def take(self, selection: Selection, copy: Path) -> int:
        """Copy the rows `selection` picks and their turns' rows into a new
        SQLite file `copy`, in one read transaction of the store, and read
        them from there on (`Store._load_trajectories` reads `self.db`);
        how many trajectories."""
        condition, args = selection.condition()
        db = self.db
        with self._readable():
            db.execute("ATTACH ? AS copy", (f"{copy.resolve().as_uri()}?mode=rwc",))
            db.execute("PRAGMA copy.journal_mode=OFF")  # a file of this process's, removed after
            db.execute("BEGIN")
            try:
                version = db.execute("SELECT value FROM main.meta WHERE key='schema_version'").fetchone()
                if version is None or int(version[0]) != SCHEMA_VERSION:
                    raise StoreCorrupted(
                        f"{self.db_path}: export reads stores of schema version {SCHEMA_VERSION}, this one has "
                        f"{None if version is None else version[0]} (a broker started on it upgrades it in place)")
                db.execute(f"CREATE TABLE copy.trajectories AS SELECT * FROM main.trajectories WHERE {condition}", args)
                db.execute("CREATE TABLE copy.turns AS SELECT * FROM main.turns "
                           "WHERE trajectory_id IN (SELECT id FROM copy.trajectories)")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")  # the store's snapshot ends here: its WAL is the broker's again
            db.close()
            self.db = sqlite3.connect(copy, isolation_level=None)
            self.db.execute("CREATE UNIQUE INDEX trajectories_by_id ON trajectories (id)")
            self.db.execute("CREATE INDEX turns_by_trajectory ON turns (trajectory_id, turn)")
            return self.db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0]

    def pages(self, rows: int) -> Iterator[list[StoredTrajectory]]:
        """The rows taken, `rows` trajectories at a time, in id order."""
        after = ""
        while True:
            # `? < id`, not `id > ?`: `Store._load_trajectories` renames `WHERE id` to read the turns.
            page = self._load_trajectories("WHERE id IN (SELECT id FROM trajectories WHERE ? < id ORDER BY id LIMIT ?)",
                                           (after, rows))
            if not page:
                return
            page.sort(key=lambda stored: stored.trajectory_id)
            after = page[-1].trajectory_id
            yield page

    def load(self, stored: StoredTrajectory) -> Trajectory | None:
        """The merged trajectory, or None (counted in `skipped`) when the
        live broker deleted it after the snapshot: a segment file of its
        records is gone and no row refers to that segment now. A segment
        file missing while a row still refers to it is damage:
        `StoreCorrupted`."""
        try:
            return load_trajectory(self, stored)
        except StoreUnavailable as exc:
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise
            missing = {number for number, _, _ in (t.location for t in stored.turns if t.location)
                       if not self.segments.path(number).exists()}
            if not missing or not all(self._retired(number) for number in missing):
                raise StoreCorrupted(f"{self.db_path}: trajectory {stored.trajectory_id!r} has records in segment "
                                     f"file(s) {sorted(self.segments.path(n).name for n in missing)}, which are missing "
                                     "while rows still refer to them (`rollstream salvage` on the stopped broker "
                                     "drops what cannot be read)") from None
            self.skipped += 1
            return None

    def _retired(self, number: int) -> bool:
        """Whether no row refers to segment `number` now, read outside the
        snapshot: the broker deletes a segment file only after that."""
        if number not in self._verdicts:
            fresh = self._read_only()
            try:
                self._verdicts[number] = fresh.execute("SELECT 1 FROM turns WHERE segment = ? LIMIT 1",
                                                       (number,)).fetchone() is None
            finally:
                fresh.close()
        return self._verdicts[number]

    def close(self) -> None:
        self.db.close()


def check_out(out: Path, source: Path, fmt: str) -> None:
    """Refuse an output path the export cannot or must not write, naming the rule."""
    if fmt not in FORMATS:
        raise InvalidInput(f"the format must be one of {list(FORMATS)}, got {fmt!r}")
    resolved, read = out.resolve(), source.resolve()
    if resolved == read or read in resolved.parents:
        raise InvalidInput(f"an export writes nothing in what it reads: expected a path outside {read}, got {out}")
    if not resolved.parent.is_dir():
        raise InvalidInput(f"the output's directory must exist: expected a directory at {resolved.parent}, found "
                           f"{'nothing' if not resolved.parent.exists() else 'a file'}")
    if fmt == "parquet" and resolved.is_dir():
        raise InvalidInput(f"the Parquet format writes one file: expected a file path, got the directory {out}")
    if fmt == "miles" and resolved.exists() and (not resolved.is_dir() or any(resolved.iterdir())):
        raise InvalidInput(f"the miles format writes a directory of payloads, one per trajectory: expected a new or "
                           f"empty directory, got {'a file' if not resolved.is_dir() else 'a directory with files'} "
                           f"at {out}")


def _groups(loaded: Iterator[tuple[StoredTrajectory, Trajectory | None]], chunk_rows: int,
            chunk_bytes: int) -> Iterator[list[tuple[StoredTrajectory, Trajectory]]]:
    """The trajectories read back, in groups of at most `chunk_rows` and
    about `chunk_bytes` of records (those that could not be, None, left out)."""
    group: list[tuple[StoredTrajectory, Trajectory]] = []
    size = 0
    for stored, trajectory in loaded:
        if trajectory is None:
            continue
        group.append((stored, trajectory))
        size += sum(t.location[2] for t in stored.turns if t.location)
        if len(group) >= chunk_rows or size >= chunk_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


@contextlib.contextmanager
def _fewer_collections(young_threshold: int = 10_000) -> Iterator[None]:
    """Run the cyclic garbage collector rarely meanwhile, over what was made
    meanwhile only: reading makes several containers per record, nearly
    all freed by reference counting, and the default thresholds had the
    collector's passes take a sixth of the reading thread (bench/export.py).
    The settings before are restored after."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(young_threshold, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def export(data_dir: str | os.PathLike, out: str | os.PathLike, selection: Selection = Selection(), *,
           fmt: str = "parquet", chunk_rows: int = CHUNK_ROWS, chunk_bytes: int = CHUNK_BYTES,
           progress: Callable[[int, int], None] | None = None) -> Exported:
    """Write the selected trajectories of the store in `data_dir` to `out`:
    one Parquet file in the archive's schema, or (`fmt="miles"`) a directory
    of miles session payloads, `NNNNNNNN.safetensors`, one trajectory each,
    which the producer's `replay` source reads back. What is written goes
    beside `out` under a hidden name and is renamed into place once whole.
    `progress(done, total)` is told the rows selected, then after each group."""
    data_dir, out = Path(data_dir), Path(out)
    check_out(out, data_dir, fmt)
    rows_copy = out.with_name(f".{out.name}.{os.getpid()}.rows.sqlite")
    snapshot = StoreSnapshot(data_dir)
    try:
        total = snapshot.take(selection, rows_copy)
        loaded = ((stored, snapshot.load(stored)) for page in snapshot.pages(chunk_rows) for stored in page)
        rows, nbytes = _write(loaded, total, out, fmt, chunk_rows, chunk_bytes, progress)
    finally:
        snapshot.close()
        rows_copy.unlink(missing_ok=True)
    return Exported(rows, nbytes, snapshot.skipped)


def export_archive(root: str | os.PathLike, out: str | os.PathLike, selection: Selection = Selection(), *,
                   fmt: str = "parquet", chunk_rows: int = CHUNK_ROWS, chunk_bytes: int = CHUNK_BYTES,
                   progress: Callable[[int, int], None] | None = None) -> Exported:
    """As `export`, from a broker's archive (`rollstream broker --archive`):
    its rows' records read from the archive's segment files and merged. A
    row whose records the archive lacks yet (their segment is still in the
    broker's use) is skipped and counted (`Exported.skipped`)."""
    root, out = Path(root), Path(out)
    check_out(out, root, fmt)
    reader = ArchiveReader(root)
    condition = selection.archive_condition()
    loaded = ((stored, reader.load(stored, store_id)) for page in reader.batches(condition)
              for stored, store_id in page)
    rows, nbytes = _write(loaded, reader.dataset.count_rows(filter=condition), out, fmt, chunk_rows, chunk_bytes,
                          progress)
    return Exported(rows, nbytes, reader.lacking)


def _write(loaded: Iterator[tuple[StoredTrajectory, Trajectory | None]], total: int, out: Path, fmt: str,
           chunk_rows: int, chunk_bytes: int, progress: Callable[[int, int], None] | None) -> tuple[int, int]:
    """Write what `loaded` gives to `out` in `fmt`, beside it under a hidden
    name first and renamed into place once whole; (rows, bytes)."""
    hidden = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    if progress is not None:
        progress(0, total)
    try:
        with _fewer_collections():
            groups = _groups(loaded, chunk_rows, chunk_bytes)
            write = _write_parquet if fmt == "parquet" else _write_miles
            rows, nbytes = write(groups, hidden, lambda done: progress(done, total) if progress else None)
        os.replace(hidden, out)
    except BaseException:
        if hidden.is_dir():
            shutil.rmtree(hidden, ignore_errors=True)
        else:
            hidden.unlink(missing_ok=True)
        raise
    return rows, nbytes


def _write_parquet(groups: Iterator[list[tuple[StoredTrajectory, Trajectory]]], path: Path,
                   done: Callable[[int], None]) -> tuple[int, int]:
    """Each group one row group of `path`, written on a thread of its own
    while the next group is read (pyarrow's writer releases the GIL as it
    encodes and compresses), one table at most waiting for it; (rows,
    bytes of the file)."""
    written = 0
    with pq.ParquetWriter(path, DATASET_SCHEMA, **writer_options(DATASET_SCHEMA)) as writer, \
            ThreadPoolExecutor(1, thread_name_prefix="rollstream-export") as pool:
        writing: tuple[Future, int] | None = None
        for group in groups:
            table = dataset_table(group)
            if writing is not None:
                writing[0].result()
                written += writing[1]
                done(written)
            writing = pool.submit(writer.write_table, table, row_group_size=len(group)), len(group)
        if writing is not None:
            writing[0].result()
            written += writing[1]
            done(written)
    return written, path.stat().st_size


def _write_miles(groups: Iterator[list[tuple[StoredTrajectory, Trajectory]]], path: Path,
                 done: Callable[[int], None]) -> tuple[int, int]:
    """One payload per trajectory under the directory `path`, numbered in
    export order (the replay source reads a directory in name order)."""
    path.mkdir()
    rows = nbytes = 0
    for group in groups:
        for stored, trajectory in group:
            payload = miles_payload(stored, trajectory)
            (path / f"{rows:08d}.safetensors").write_bytes(payload)
            rows += 1
            nbytes += len(payload)
        done(rows)
    return rows, nbytes


def _json_safe(value: Any) -> Any:
    """`value` as JSON holds it (what JSON cannot hold as its repr), as the archive's JSON columns write it."""
    return json.loads(json.dumps(value, default=repr))


def _sample_bounds(forced_spans: Sequence[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """The response positions each miles sample answers with: from the end
    of the forced tokens before it to the start of those after it. Forced
    tokens that end the response stay in the last sample's response (loss
    0, log-prob 0, each its own support), as miles appends a tool's output:
    miles has no sample after them to hold them as an observation."""
    bounds, start = [], 0
    for forced_start, forced_end in forced_spans:
        if forced_end == length:
            break
        bounds.append((start, forced_start))
        start = forced_end
    bounds.append((start, length))
    return bounds


def _mask_slice(mask: SamplingMask, start: int, end: int) -> SamplingMask:
    offsets = mask.offsets[start : end + 1]
    return SamplingMask(mask.ids[offsets[0] : offsets[-1]], offsets - offsets[0])


def miles_payload(stored: StoredTrajectory, trajectory: Trajectory) -> bytes:
    """A merged trajectory as the miles session payload of its per-turn
    samples (docs/semantics.md §7): sample k's `tokens` are the prompt and
    the response up to its own sampled tokens, whose count is its
    `response_length`; what lies between two samples is the forced tokens
    the replay source derives back. The session metadata names the
    trajectory, its group, reward, metadata and store facts."""
    prompt = trajectory.prompt_tokens
    tokens = np.concatenate([prompt, trajectory.tokens]).astype(np.int64)
    loss_mask, log_probs, mask = trajectory.loss_mask, trajectory.log_probs, trajectory.mask
    support_log_probs = trajectory.mask_log_probs  # aligned with the mask's ids, when carried
    metadata = _json_safe(trajectory.metadata)
    replay = {"rollout_routed_experts": trajectory.routed_experts, "rollout_indexer_topk": trajectory.indexer_topk}
    bounds = _sample_bounds(trajectory.forced_spans, trajectory.response_length)
    samples = []
    for k, (start, end) in enumerate(bounds):
        context = len(prompt) + end
        samples.append({
            "tokens": tokens[:context], "response_length": end - start, "loss_mask": loss_mask[start:end],
            "rollout_log_probs": log_probs[start:end].astype(np.float64),
            "rollout_sampling_mask": None if mask is None else _mask_slice(mask, start, end),
            "status": trajectory.status if k == len(bounds) - 1 else "completed",
            "weight_versions": [[{"version": version, "abs_start": len(prompt) + a, "abs_end": len(prompt) + b}
                                 for version, a, b in call] for call in trajectory.weight_version_spans
                                if call and call[0][1] < end],
            "metadata": metadata,
            **{name: None if array is None else array[: context - 1].astype(np.int32, copy=False)
               for name, array in replay.items()},
        })
        if mask is not None and support_log_probs is not None:
            samples[-1][MASK_LOG_PROBS] = support_log_probs[mask.offsets[start]:mask.offsets[end]]
    trained = stored.trained
    session = {
        "trajectory_id": wire_id(stored.trajectory_id), "job": job_of(stored.trajectory_id),
        "group_id": None if stored.group_id is None else wire_id(stored.group_id), "group_size": stored.group_size,
        "sample_index": stored.sample_index, "reward": _json_safe(stored.reward), "metadata": metadata,
        "outcome": outcome_of(stored), "producer": stored.producer, "run": trained and trained.run,
        "lineage": trained and trained.lineage, "step": trained and trained.step,
        "position": trained and trained.position,
    }
    return encode_session_samples(samples, session, fields=DEFAULT_FIELDS if mask is None else FIELDS_WITH_MASK)
