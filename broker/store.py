"""The broker's durable store: state in SQLite (WAL), turn payloads in
append-only segment files (`rollstream.common.segments`: a magic, length and
CRC-32 per record).

Why two places: appending turn payloads to a plain file is much cheaper
than committing them to SQLite as blobs (docs/performance.md); trajectory
state rows are small and want SQLite's transactions. A
batch is written segment-first, then the SQLite transaction that refers to it
commits, so a crash between the two leaves only an unreferenced tail, which
start-up cuts off. `sync="full"` adds an fdatasync of the segment and
`PRAGMA synchronous=FULL` before the commit returns.

Large turns are written ahead (`Store.write_ahead`): their records go to the
segment on a writer thread as soon as they are decoded, while the broker
checks and merges the rest of the batch, and the commit then only waits for
them, writes the small ones and adds its rows. A turn refused after its
write leaves an unreferenced record, which costs disk until its segment is
retired like any other.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import struct
import uuid
import zlib
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import msgpack

from rollstream.common.codec import Message, content_digest, crc32_continued, decode_trusted, encode
from rollstream.common.dirlock import hold
from rollstream.common.errors import InternalError, InvalidInput, RollstreamError
from rollstream.common.jobs import job_of
from rollstream.common.messages import PRODUCER_TO_BROKER
from rollstream.common.segments import SegmentLog
from rollstream.common.versions import Ancestry, Sampled

from .engine import (
    CloseGroup,
    DeadLetter,
    DropTrajectory,
    Effect,
    EndTrajectory,
    Forget,
    GroupDeliverable,
    MarkGap,
    MarkTrained,
    NameProducer,
    OpenTrajectory,
    PutTurn,
    Revive,
    Run,
    SealRun,
    SetReward,
    State,
    TrainedAt,
)
from .staleness import Policy, SetPolicy

log = logging.getLogger("rollstream.broker")

SCHEMA_VERSION = 13  # 2: turn digests are XXH3-128; 3: an applied turn's digest is empty, its record stands for it;
# 4: an ended trajectory's row carries a CRC-32 of its end (`end_crc`); 5: trained trajectories and runs;
# 6: an ended trajectory's ordered policy version, each job's published policy, and the `scoring` state;
# 7: what sampled an ended trajectory (lineage epochs and steps), and each job's ancestry (its branches);
# 8: a pruned dead letter's reason and time, kept with its remembered id;
# 9: a trajectory's producer, its deliveries, commit time and lineage epoch, and the archive file it waits for;
# 10: the segments holding archived records, which go to the archive instead of being deleted;
# 11: the CURVE key its producer connected with, to which its producer alone is handed it back;
# 12: turn records may carry `full_log_probs` and a gap may name it, which a broker before it cannot read;
# 13: turn records may carry `mask_log_probs` and a gap may name it, which a broker before it cannot read
_READABLE_VERSIONS = (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)  # an older store is upgraded in place (`Store._upgrade`)

_IDS_PER_QUERY = 500  # ids bound in one `IN (...)`, well under SQLite's limit on a statement's variables

# A turn this large (long top-p supports) is written ahead on the writer
# thread; smaller ones are written inline by their commit, where handing them
# to a thread costs about what the copy it moves off the broker's loop does.
WRITE_AHEAD_FROM_BYTES = 1 << 20

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB);
CREATE TABLE IF NOT EXISTS trajectories (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    group_id TEXT,
    group_size INTEGER,
    sample_index INTEGER,
    updated_at REAL NOT NULL,
    end_digest BLOB,
    reward BLOB,
    metadata BLOB,
    ready_seq INTEGER,
    gap_turn INTEGER,
    gap_field TEXT,
    dead_reason TEXT,
    dead_at REAL,
    end_crc INTEGER,
    trained_run TEXT,
    trained_lineage TEXT,
    trained_step INTEGER,
    trained_position INTEGER,
    trained_epoch INTEGER,
    version INTEGER,
    sampled BLOB,
    producer TEXT,
    producer_key TEXT,
    first_delivered_at REAL,
    deliveries INTEGER,
    committed_at REAL,
    archive_file INTEGER
);
CREATE TABLE IF NOT EXISTS turns (
    trajectory_id TEXT NOT NULL,
    turn INTEGER NOT NULL,
    digest BLOB NOT NULL,
    applied INTEGER NOT NULL,
    reason TEXT,
    segment INTEGER,
    offset INTEGER,
    length INTEGER,
    at REAL NOT NULL,
    PRIMARY KEY (trajectory_id, turn)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS dedup (id TEXT PRIMARY KEY, until REAL NOT NULL, dead_reason TEXT, dead_at REAL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS dedup_until ON dedup (until);
CREATE TABLE IF NOT EXISTS released_groups (id TEXT PRIMARY KEY, size INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS runs (id TEXT PRIMARY KEY, lineage TEXT NOT NULL, seals BLOB NOT NULL,
                                 reclaimed INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS archive_segments (segment INTEGER PRIMARY KEY, in_archive INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS policies (job TEXT PRIMARY KEY, version INTEGER NOT NULL, max_staleness INTEGER,
                                     per_step INTEGER, share REAL, branches BLOB) WITHOUT ROWID;
"""
# Columns later versions added, by table: an older store gets them as it is upgraded.
_ADDED_COLUMNS = {"trajectories": ("trained_run TEXT", "trained_lineage TEXT", "trained_step INTEGER",
                                   "trained_position INTEGER", "version INTEGER", "sampled BLOB", "producer TEXT",
                                   "first_delivered_at REAL", "deliveries INTEGER", "committed_at REAL",
                                   "archive_file INTEGER", "trained_epoch INTEGER", "producer_key TEXT"),
                  "policies": ("branches BLOB",), "dedup": ("dead_reason TEXT", "dead_at REAL")}


# States are stored as `State`'s values, written into the statements once.
_OPEN = ("INSERT OR REPLACE INTO trajectories (id, state, group_id, group_size, sample_index, updated_at, producer, "
         f"producer_key) VALUES (?, '{State.OPEN}', ?, ?, ?, ?, ?, ?)")
_END = ("UPDATE trajectories SET state=?, updated_at=?, end_digest=?, reward=?, metadata=?, ready_seq=?, "
        "end_crc=?, version=?, sampled=? WHERE id=?")


_STATE_VALUES = frozenset(State)


def _end_crc(trajectory_id: str, digest: bytes, reward: bytes, metadata: bytes) -> int:
    """CRC-32 of what an ended trajectory's row alone holds (its end's
    digest, reward and metadata), as segment records have theirs: a damaged
    row is reported, never delivered."""
    return zlib.crc32(msgpack.packb([trajectory_id, digest, reward, metadata]))
_TURN = "INSERT INTO turns VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
_TRAINED = (f"UPDATE trajectories SET state='{State.TRAINED}', trained_run=?, trained_lineage=?, trained_step=?, "
            "trained_position=?, trained_epoch=?, committed_at=?, first_delivered_at=COALESCE(first_delivered_at, ?), "
            "deliveries=? "
            "WHERE id=?")
# A forgotten trajectory the archive must hold first: kept, marked, with what it records of its consumption.
_ARCHIVING = (f"UPDATE trajectories SET state='{State.ARCHIVING}', first_delivered_at=COALESCE(first_delivered_at, ?), "
              "deliveries=MAX(COALESCE(deliveries, 0), ?), committed_at=COALESCE(committed_at, ?) WHERE id=?")


class _DeferredRows:
    """The batch's common statements, run as one executemany each: new
    trajectories, then ends (an end may follow its own open in a batch),
    then turns (another table), then trained ones (a trajectory is trained
    only after the batch that ended it), then forgotten trajectories
    (delivered or sealed ones: no later effect of a batch can concern a
    forgotten id, which the engine answers as a duplicate; one the archive
    must hold first is only marked `archiving`). Any other effect may touch
    the same rows, so the deferred rows run before it, keeping the batch's
    order."""

    def __init__(self) -> None:
        self.opens: list[tuple] = []
        self.ends: list[tuple] = []
        self.turns: list[tuple] = []
        self.trained: list[tuple] = []  # `_TRAINED`'s arguments
        self.forgets: list[tuple] = []  # (id, dedup until, dead reason, dead at)
        self.archiving: list[tuple] = []  # of the forgotten, those kept for the archive: `_ARCHIVING`'s arguments

    def execute(self, db: sqlite3.Connection, records_gone: list[int]) -> None:
        """Run the rows; segments that lose a record are added to `records_gone`."""
        for statement, rows in ((_OPEN, self.opens), (_END, self.ends), (_TURN, self.turns),
                                (_TRAINED, self.trained)):
            if rows:
                db.executemany(statement, rows)
                rows.clear()
        if self.forgets:
            kept = {row[-1] for row in self.archiving}
            tids = [forget[0] for forget in self.forgets if forget[0] not in kept]
            records_gone += _delete_trajectories(db, tids)
            db.executemany(_ARCHIVING, self.archiving)
            db.executemany("INSERT OR REPLACE INTO dedup VALUES (?, ?, ?, ?)", self.forgets)
            self.forgets.clear()
            self.archiving.clear()


_IN_CHUNK = 500  # ids per `IN (...)` query, under SQLite's variable limit


def _delete_trajectories(db: sqlite3.Connection, tids: list[str]) -> list[int]:
    """Delete `tids`' rows and their turns' rows (`_delete_turns`)."""
    segments = _delete_turns(db, tids)
    db.executemany("DELETE FROM trajectories WHERE id=?", [(tid,) for tid in tids])
    return segments


def _delete_turns(db: sqlite3.Connection, tids: list[str]) -> list[int]:
    """Delete the turn rows of `tids`; returns the segment of each stored
    record they referred to (one lookup per chunk of ids)."""
    segments = []
    for i in range(0, len(tids), _IN_CHUNK):
        chunk = tids[i : i + _IN_CHUNK]
        segments += [row[0] for row in db.execute(
            f"SELECT segment FROM turns WHERE trajectory_id IN ({','.join('?' * len(chunk))}) AND segment IS NOT NULL",
            chunk)]
    db.executemany("DELETE FROM turns WHERE trajectory_id=?", [(tid,) for tid in tids])
    return segments


class StoreError(RollstreamError, RuntimeError):
    """The root of the store's errors. At its boundary the store wraps what
    its files and SQLite raise (`OSError`, `sqlite3.Error`) and failed
    lookups into these, so callers catch store errors by type: a
    `StoreUnavailable` may pass (`retriable`), a `StoreCorrupted` will not."""


class StoreUnavailable(StoreError):
    """The store cannot read or persist right now (disk full, I/O error):
    nothing of a failed batch is durable; retry later."""

    code = "unavailable"


class StoreCorrupted(StoreError):
    """The data directory is damaged (a record or row fails its checks, or
    is missing); the broker refuses to start on it, and a queued trajectory
    whose records fail so can never be delivered."""

    code = "internal"


@contextlib.contextmanager
def _unavailable_on_failure(what: str):
    """What the files and SQLite raise, as `StoreUnavailable` naming `what`
    was being done (the store's own errors pass unchanged)."""
    try:
        yield
    except (OSError, sqlite3.Error) as exc:
        raise StoreUnavailable(f"{what}: {exc}") from exc


@dataclass
class StoredTurn:
    turn: int
    digest: bytes | None  # None: the turn was applied, and its record gives its digest
    applied: bool
    reason: str | None
    location: tuple[int, int, int] | None  # segment, offset, length
    at: float = 0.0  # wall time it arrived


@dataclass
class StoredTrajectory:
    trajectory_id: str
    state: State
    group_id: str | None
    group_size: int | None
    sample_index: int | None
    updated_at: float
    end_digest: bytes | None
    reward: object
    metadata: dict | None
    ready_seq: int | None
    gap: tuple[int, str] | None
    dead_reason: str | None
    dead_at: float | None
    trained: TrainedAt | None = None
    turns: list[StoredTurn] = field(default_factory=list)
    version: int | None = None  # ended: its oldest turn's ordered policy version
    sampled: Sampled = ()  # ended: the lineage epochs and steps whose weights sampled it
    producer: str | None = None  # the producer id its first turn came from (unknown before schema 9)
    producer_key: str | None = None  # the CURVE key fingerprint of that producer's connection (None: no CURVE)
    first_delivered_at: float | None = None
    deliveries: int = 0
    committed_at: float | None = None
    archive_file: int | None = None  # archiving: the archive file it was given to (None: not yet)


@dataclass(frozen=True)
class Archiving:
    """A store whose forgotten trajectories the archive holds before they
    are deleted: every one a commit or a seal lets go, and pruned dead
    letters too with `dead_letters`."""

    dead_letters: bool = False


# The columns of an archiving trajectory's row the archive writes (`ArchiveBatch.rows`), in this order.
ARCHIVE_COLUMNS = ("id", "group_id", "group_size", "sample_index", "producer", "dead_reason", "dead_at", "gap_turn",
                   "gap_field", "reward", "metadata", "end_digest", "first_delivered_at", "deliveries", "committed_at",
                   "trained_run", "trained_lineage", "trained_step", "trained_position", "trained_epoch")
# And of each of its turns' rows (`ArchiveBatch.turns`).
ARCHIVE_TURN_COLUMNS = ("trajectory_id", "turn", "segment", "offset", "length", "at")


class ArchiveBatch(NamedTuple):
    """Archiving trajectories given one archive file: `number` names it,
    so that one written again after a crash replaces it. Their rows as
    SQLite gives them, which the archive turns into columns without an
    object per row: `rows` (`ARCHIVE_COLUMNS`, in the file's order, the
    reward and metadata msgpack) and `turns` (`ARCHIVE_TURN_COLUMNS`, by
    trajectory id and turn)."""

    number: int
    rows: list[tuple]
    turns: list[tuple]

    @property
    def ids(self) -> list[str]:
        return [row[0] for row in self.rows]


class SegmentHandover(NamedTuple):
    """A segment file for the archive: `whole`, no row refers to it and it
    is moved there; otherwise its first `size` bytes are copied (records
    still in use are in it: it is moved once they are gone)."""

    number: int
    source: Path
    whole: bool
    size: int


class ArchiveOutcome(NamedTuple):
    """An archive file written durably (`error` None: its rows may be
    deleted) or not (`error`: its rows stay and are handed out again)."""

    number: int
    rows: int = 0
    nbytes: int = 0
    path: Path | None = None
    error: Exception | None = None

    @property
    def what(self) -> str:
        return f"archive file {self.number}"


class HandoverOutcome(NamedTuple):
    """A segment placed in the archive durably (`error` None) or not (it
    stays in the store and is handed over again)."""

    handover: SegmentHandover
    nbytes: int = 0
    error: Exception | None = None

    @property
    def what(self) -> str:
        return f"segment {self.handover.source.name} ({'moved' if self.handover.whole else 'copied'})"


@dataclass
class Recovered:
    """Everything a store held at start-up."""

    trajectories: list[StoredTrajectory]
    dedup: dict[str, float]
    deliverable_groups: dict[str, int]  # stored in the table `released_groups`, its first name
    runs: dict[str, Run] = field(default_factory=dict)
    policies: dict[str, Policy] = field(default_factory=dict)  # each job's published policy
    pruned: dict[str, tuple[str, float]] = field(default_factory=dict)  # dead letters pruned: id -> (reason, at)


_FRAME_TABLES: dict[int, struct.Struct] = {}  # by frame count: the record's frame-length table


def _pack_frames(frames) -> list:
    """Record payload: frame count, frame lengths, then the frames (bytes or
    byte memoryviews, whose `len` is their size)."""
    count = len(frames)
    table = _FRAME_TABLES.get(count)
    if table is None:
        table = _FRAME_TABLES[count] = struct.Struct(f"<H{count}I")
    return [table.pack(count, *map(len, frames)), *frames]


def _unpack_frames(payload: memoryview) -> list[memoryview]:
    """The frames of a record payload `_pack_frames` wrote; `StoreCorrupted`
    naming the rule when its frame count and lengths do not account for its
    bytes exactly (a record whose CRC holds but whose content does not)."""
    size = len(payload)
    if size < 2:
        raise StoreCorrupted(f"a turn record starts with a 2-byte frame count, this one has {size} byte(s)")
    (count,) = struct.unpack_from("<H", payload)
    table = 2 + 4 * count
    if table > size:
        raise StoreCorrupted(f"a turn record of {count} frame(s) needs {table} bytes for its frame lengths, it has {size}")
    lengths = struct.unpack_from(f"<{count}I", payload, 2)
    if table + sum(lengths) != size:
        raise StoreCorrupted(f"a turn record's {count} frame(s) take {sum(lengths)} bytes after their {table}-byte "
                             f"table, the record has {size - table}")
    frames, pos = [], table
    for length in lengths:
        frames.append(payload[pos : pos + length])
        pos += length
    return frames


def read_turn_records(segments: SegmentLog, locations: list[tuple[int, int, int]]) -> list[Message]:
    """Stored applied turns at `locations` of `segments` (the store's, or
    an archive's copy of them), each record's CRC verified, then parsed."""
    with _unavailable_on_failure(f"cannot read {len(locations)} turn record(s) from {segments.directory}"):
        records = segments.read_many(locations)
    turns = []
    for (number, offset, _), record in zip(locations, records):
        try:
            message = decode_trusted(_unpack_frames(record), PRODUCER_TO_BROKER)
        except StoreCorrupted as exc:
            raise StoreCorrupted(f"{segments.where(number, offset)}: {exc}") from None
        if message.type != "turn":
            raise StoreCorrupted(f"{segments.where(number, offset)}: a stored turn's record holds a "
                                 f"{message.type} message")
        turns.append(message)
    return turns


def _unlink_logged(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:  # nothing refers to it: the next start-up deletes it
        log.warning(f"cannot delete segment file {path}: {exc}; it is deleted at the next start-up",
                    extra={"path": str(path), "error": str(exc)})


class Segments(SegmentLog):
    """The store's segment log, with a live record count per segment: a
    finished segment goes when no row refers to it any more, deleted, or
    moved into the archive when it holds archived records (`kept`)."""

    def __init__(self, directory: Path, max_bytes: int, unlink: Callable[[Path], None]):
        # Written behind: the broker delivers from memory and reads a record back only to reload or recover.
        super().__init__(directory, max_bytes, damaged=StoreCorrupted, write_behind=True)
        self.live: dict[int, int] = {}
        self.kept: set[int] = set()  # hold records of archived trajectories: the archive takes them, not a delete
        self.to_move: list[int] = []  # kept, finished, and no row refers to them: waiting to be moved
        self._rotated: list[int] = []  # finished since the last `retire_unreferenced`
        self._unlink = unlink

    def remove(self, number: int) -> None:
        """Let go of a finished segment no row refers to: one the archive
        needs waits in `to_move` (its bytes still counted on disk);
        otherwise its file is deleted off the commit's path (`unlink`). A
        file a crash leaves behind is found at the next start-up, as nothing
        refers to it."""
        if number in self.kept:
            if number not in self.to_move:
                self.to_move.append(number)
            return
        self._closed_sizes.pop(number, None)
        self._unlink(self.path(number))

    def moved(self, number: int) -> None:
        """A kept segment's file is in the archive now."""
        self.kept.discard(number)
        self.to_move.remove(number)
        self._closed_sizes.pop(number, None)

    def rotate(self) -> None:
        self._rotated.append(self.current)
        super().rotate()

    def read(self, location: tuple[int, int, int]) -> memoryview:
        return self.read_many([location])[0]

    def record_gone(self, number: int) -> None:
        """One record fewer in `number`; unlink a finished segment at zero."""
        self.live[number] -= 1
        if self.live[number] == 0 and number != self.current:
            del self.live[number]
            self.remove(number)

    def retire_unreferenced(self) -> None:
        """Delete the segments finished since the last call that no record
        refers to: one whose records were all gone while it was
        current, or held only refused turns written ahead. Called between
        commits, when every record written is either referenced or not."""
        for number in self._rotated:
            if not self.live.get(number):
                self.live.pop(number, None)
                self.remove(number)
        self._rotated.clear()


class Store:
    """Durable broker state under `data_dir`.

    Caller: the broker's thread (the service, `StoreIO`), every public
    method. Affects: everything here. Caller: the writer thread
    (`_writing`), what it is handed: `_append_turn` for each write ahead
    and the unlink of a retired segment file. Affects: the current segment
    file and `segments`' size (a rotation, its number). The broker's thread
    touches `segments` only while no write ahead is pending (the first of a
    batch reads its `mark`; `commit` waits for them all before it appends)
    and meanwhile reads records only at committed offsets, through
    descriptors of its own (`turn_digest`)."""

    def __init__(self, data_dir: str | os.PathLike, *, sync: str = "normal", segment_bytes: int = 64 << 20,
                 write_ahead_from: int = WRITE_AHEAD_FROM_BYTES, archive: Archiving | None = None):
        if sync not in ("normal", "full"):
            raise InvalidInput(f"sync must be 'normal' or 'full', got {sync!r}")
        self.data_dir = Path(data_dir)
        self.sync = sync
        self.archive = archive
        # Before anything is read or written: one broker (or `rollstream salvage`) per data directory.
        self._lock_fd: int | None = hold(self.data_dir, what="data directory", owner="broker")
        self.segments = Segments(self.data_dir / "segments", segment_bytes, self._unlink_behind)
        self.db_path = self.data_dir / "state.sqlite"
        self.db = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False)
        self._next_ready_seq = 1
        self.write_ahead_from = write_ahead_from
        self._writer: ThreadPoolExecutor | None = None  # started by the first write ahead or unlink
        self._writes: list[tuple[Future, Message]] = []  # this batch's writes ahead, in order
        self._ahead_mark = (0, 0)  # where this batch's records start (while `_writes` holds any)

    # -- start-up -----------------------------------------------------------
    def open(self) -> "Recovered":
        """Check integrity, cut a torn tail, and return what was stored. A
        store that fails to open is closed (its data directory free again)."""
        try:
            return self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> "Recovered":
        with self._readable():
            self._prepare()
            recovered = self.reload()

        trajectories = recovered.trajectories
        locations = [t.location for traj in trajectories for t in traj.turns if t.location]
        for number, _, _ in locations:
            self.segments.live[number] = self.segments.live.get(number, 0) + 1
        self.segments.verify(locations)
        current = self.segments.current
        committed_end = max((off + length for seg, off, length in locations if seg == current), default=0)
        self.segments.open_current(committed_end)
        self.segments.kept = {n for (n,) in self.db.execute("SELECT segment FROM archive_segments")}
        existing = self.segments.existing()
        for number in existing:  # segments no record refers to any more
            if number != current and number not in self.segments.live:
                self.segments.remove(number)
        # A kept segment whose file is gone was moved before a crash: the archive finds it there.
        self.segments.to_move += sorted(self.segments.kept - set(existing))
        self._next_ready_seq = 1 + max((t.ready_seq or 0 for t in trajectories), default=0)
        return recovered

    @contextlib.contextmanager
    def _readable(self):
        """SQLite's own errors on a damaged file, as `StoreCorrupted`."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            raise StoreCorrupted(f"{self.db_path} is not a readable rollstream store: {exc}") from None

    def _prepare(self) -> None:
        """Pragmas, SQLite's quick_check, the schema and its version."""
        db = self.db
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={'FULL' if self.sync == 'full' else 'NORMAL'}")
        db.execute(f"PRAGMA journal_size_limit={16 << 20}")  # the WAL shrinks back after checkpoints
        result = db.execute("PRAGMA quick_check").fetchone()[0]
        if result != "ok":
            raise StoreCorrupted(f"{self.db_path} failed its integrity check: {result}")
        db.executescript(_SCHEMA)
        version = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if version is None:
            db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
        elif int(version[0]) not in _READABLE_VERSIONS:
            raise StoreCorrupted(f"{self.db_path} has schema version {version[0]}, this broker reads "
                                 f"{' or '.join(map(str, _READABLE_VERSIONS))}")
        elif int(version[0]) != SCHEMA_VERSION:
            self._upgrade()
        # What waits for the archive is found without a scan of every trajectory (after the upgrade: the column).
        db.execute(f"CREATE INDEX IF NOT EXISTS trajectories_archiving ON trajectories (archive_file) "
                   f"WHERE state='{State.ARCHIVING}'")
        # Names this store's archive files apart from another broker's, the same across restarts.
        db.execute("INSERT OR IGNORE INTO meta VALUES ('store_id', ?)", (uuid.uuid4().hex[:12],))

    def salvage(self) -> list[str]:
        """Drop every trajectory the store cannot give back intact (an end
        row whose CRC fails, a turn record that is missing, cut short or
        fails its CRC, turn rows without their trajectory) and keep the
        rest; returns one line per thing dropped. `open` then starts on
        what is left. Damage SQLite itself reports (its quick_check) is not
        salvaged here: SQLite's `.recover` is the tool for that."""
        with self._readable():
            self._prepare()
            damaged: dict[str, str] = {}
            trajectories = self._load_trajectories(damaged=damaged)
            for traj in trajectories:
                for turn in traj.turns:
                    if turn.location is None:
                        continue
                    try:
                        self.segments.read(turn.location)
                    except (StoreCorrupted, OSError) as exc:
                        damaged[traj.trajectory_id] = f"turn {turn.turn}: {exc}"
                        break
            db = self.db
            db.execute("BEGIN")
            _delete_trajectories(db, list(damaged))
            db.execute("COMMIT")
        return [f"dropped trajectory {tid!r}: {reason}" for tid, reason in damaged.items()]

    def _upgrade(self) -> None:
        """An older store becomes the current version: a version 2 or 3
        store's ended rows get the CRC of their end as they stand (nothing
        checked them before), and tables get the columns added since (a
        trajectory ended before has no version: unknown, never stale, and
        nothing recorded of what sampled it: never abandoned)."""
        db = self.db
        db.execute("BEGIN")
        columns = {row[1] for row in db.execute("PRAGMA table_info(trajectories)")}
        if "end_crc" not in columns:
            db.execute("ALTER TABLE trajectories ADD COLUMN end_crc INTEGER")
            rows = db.execute("SELECT id, end_digest, reward, metadata FROM trajectories "
                              "WHERE end_digest IS NOT NULL").fetchall()
            db.executemany("UPDATE trajectories SET end_crc=? WHERE id=?", [(_end_crc(*row), row[0]) for row in rows])
        for table, added in _ADDED_COLUMNS.items():
            present = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
            for column in added:
                if column.split()[0] not in present:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (SCHEMA_VERSION,))
        db.execute("COMMIT")

    def reload(self) -> Recovered:
        """Every state row as committed (also used to roll memory back after
        a failed commit)."""
        return Recovered(
            self._load_trajectories(),
            dict(self.db.execute("SELECT id, until FROM dedup")),
            dict(self.db.execute("SELECT id, size FROM released_groups")),
            {run: Run(lineage, list(msgpack.unpackb(seals)), reclaimed)
             for run, lineage, seals, reclaimed in self.db.execute("SELECT id, lineage, seals, reclaimed FROM runs")},
            {job: Policy(version, max_staleness, per_step, share, Ancestry.of(msgpack.unpackb(branches) if branches else ()))
             for job, version, max_staleness, per_step, share, branches in self.db.execute(
                "SELECT job, version, max_staleness, per_step, share, branches FROM policies")},
            {tid: (reason, at) for tid, reason, at in self.db.execute(
                "SELECT id, dead_reason, dead_at FROM dedup WHERE dead_reason IS NOT NULL")},
        )

    def load_one(self, trajectory_id: str) -> StoredTrajectory:
        """One trajectory's rows, checked as at start-up."""
        with _unavailable_on_failure(f"cannot read trajectory {trajectory_id!r} from {self.db_path}"):
            found = self._load_trajectories("WHERE id = ?", (trajectory_id,))
        if not found:
            raise StoreCorrupted(f"{self.db_path}: trajectory {trajectory_id!r} is held by the broker but has no row")
        return found[0]

    def load_many(self, trajectory_ids: Sequence[str]) -> list[StoredTrajectory]:
        """These trajectories' rows, checked as at start-up, in the order
        asked (an admin answer reads a few, not the whole store); one without
        a row is `StoreCorrupted`, as in `load_one`."""
        found: dict[str, StoredTrajectory] = {}
        ids = list(dict.fromkeys(trajectory_ids))
        with _unavailable_on_failure(f"cannot read {len(ids)} trajectories from {self.db_path}"):
            for i in range(0, len(ids), _IDS_PER_QUERY):
                chunk = ids[i : i + _IDS_PER_QUERY]
                where = f"WHERE id IN ({', '.join('?' * len(chunk))})"
                found.update((s.trajectory_id, s) for s in self._load_trajectories(where, tuple(chunk)))
        missing = [tid for tid in ids if tid not in found]
        if missing:
            raise StoreCorrupted(f"{self.db_path}: trajectories {missing[:5]!r} are held by the broker but have no row")
        return [found[tid] for tid in ids]

    def _load_trajectories(self, where: str = "", args: tuple = (), *,
                           damaged: dict[str, str] | None = None) -> list[StoredTrajectory]:
        """Rows as stored, each end checked against its CRC; a damaged one
        raises `StoreCorrupted`, or with `damaged` is named there (with the
        reason) and left out."""
        rows = {}
        for row in self.db.execute(
            "SELECT id, state, group_id, group_size, sample_index, updated_at, end_digest, reward, metadata, "
            "ready_seq, gap_turn, gap_field, dead_reason, dead_at, end_crc, version, sampled, producer, producer_key, "
            "first_delivered_at, deliveries, committed_at, archive_file, trained_run, trained_lineage, trained_step, "
            "trained_position, trained_epoch FROM trajectories " + where, args
        ):
            (tid, state, gid, gsize, sidx, updated, end_digest, reward, metadata, ready_seq, gap_turn, gap_field,
             dead_reason, dead_at, end_crc, version, sampled, producer, producer_key, first_delivered_at, deliveries,
             committed_at,
             archive_file, *trained) = row
            error = None
            if state not in _STATE_VALUES:
                error = f"state must be one of {sorted(map(str, _STATE_VALUES))}, got {state!r}"
            elif end_digest is not None and (crc := _end_crc(tid, end_digest, reward, metadata)) != end_crc:
                error = f"CRC mismatch over its end (digest, reward, metadata): stored {end_crc}, computed {crc}"
            if error is not None:
                error = f"{self.db_path}: trajectories row {tid!r}: {error}"
                if damaged is None:
                    raise StoreCorrupted(error)
                damaged[tid] = error
                continue
            rows[tid] = StoredTrajectory(
                tid, State(state), gid, gsize, sidx, updated, end_digest,
                msgpack.unpackb(reward) if reward is not None else None,
                msgpack.unpackb(metadata) if metadata is not None else None,
                ready_seq, (gap_turn, gap_field) if gap_turn is not None else None, dead_reason, dead_at,
                TrainedAt(*trained) if state == State.TRAINED or (state == State.ARCHIVING and trained[0] is not None)
                else None, version=version,
                sampled=tuple(map(tuple, msgpack.unpackb(sampled))) if sampled else (), producer=producer,
                producer_key=producer_key, first_delivered_at=first_delivered_at, deliveries=deliveries or 0,
                committed_at=committed_at, archive_file=archive_file,
            )
        turn_where = where.replace("WHERE id", "WHERE trajectory_id")
        for tid, turn, digest, applied, reason, seg, off, length, at in self.db.execute(
            "SELECT trajectory_id, turn, digest, applied, reason, segment, offset, length, at FROM turns "
            + turn_where + " ORDER BY trajectory_id, turn", args
        ):
            if tid not in rows:
                if damaged is None:
                    raise StoreCorrupted(f"turn {turn} refers to trajectory {tid!r}, which has no state row")
                damaged.setdefault(tid, f"turn {turn} has no state row")
                continue
            stored = rows[tid]
            stored.turns.append(StoredTurn(turn, digest or None, bool(applied), reason,  # empty: from the record
                                           (seg, off, length) if seg is not None else None, at))
            stored.updated_at = max(stored.updated_at, at)
        return list(rows.values())

    def read_turn(self, location: tuple[int, int, int]) -> Message:
        """A stored applied turn, decoded (it was checked when it arrived)."""
        return self.read_turns([location])[0]

    def read_turns(self, locations: list[tuple[int, int, int]]) -> list[Message]:
        """Stored applied turns, read in one pass (`Segments.read_many`) and
        parsed: each was checked when it arrived, and its record CRC has just
        been verified."""
        return read_turn_records(self.segments, locations)

    # -- writing ------------------------------------------------------------
    @property
    def writing_ahead(self) -> bool:
        """Turns were written ahead: the next `commit` must wait for them, even
        one without effects."""
        return bool(self._writes)

    def write_ahead(self, message: Message) -> None:
        """Start writing a received turn's record before its batch commits,
        when it is at least `write_ahead_from` bytes (a smaller one is written
        by the commit that puts it). Nothing refers to the record until a
        `commit` puts the turn; whether its batch commits or not, that
        commit waits for every write ahead first."""
        if sum(map(len, message.frames)) < self.write_ahead_from:
            return
        if not self._writes:
            self._ahead_mark = self.segments.mark
        self._writes.append((self._writing().submit(self._append_turn, message), message))

    def _writing(self) -> ThreadPoolExecutor:
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="rollstream-store-writer")
        return self._writer

    def wait_writes(self) -> None:
        """Wait until the writer thread has done everything handed to it
        (writes ahead, segment unlinks)."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def _unlink_behind(self, path: Path) -> None:
        """Delete a segment file on the writer thread: an unlink costs the
        file system's work on the freed blocks, which the commit need not wait for."""
        self._writing().submit(_unlink_logged, path)

    def _append_turn(self, message: Message) -> tuple[int, int, int]:
        return self.segments.append([self._turn_record(message)])[0]

    def _written_ahead(self) -> dict[int, tuple[int, int, int]]:
        """Wait for the writes ahead: each written turn's location, by the
        message's id."""
        writes, self._writes = self._writes, []
        located: dict[int, tuple[int, int, int]] = {}
        failure = None
        for future, message in writes:
            try:
                located[id(message)] = future.result()
            except OSError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        return located

    def commit(self, effects: list) -> None:
        """Make `effects` durable as one batch, or raise `StoreUnavailable` with
        nothing of the batch persisted. It waits for the writes ahead first."""
        start = self._ahead_mark if self.writing_ahead else self.segments.mark
        if not effects and not self.writing_ahead:
            return
        # The applied turns' messages, whose records the rows refer to.
        puts = [e.message for e in effects if type(e) is PutTurn and e.message is not None]
        try:
            located = self._written_ahead()
            if not effects:
                self.segments.retire_unreferenced()
                return  # what was written ahead was all refused: unreferenced records
            inline = [m for m in puts if id(m) not in located]
            if inline:
                located.update(zip(map(id, inline), self.segments.append([self._turn_record(m) for m in inline])))
            if self.sync == "full" and puts:
                self.segments.sync()
        except OSError as exc:
            self._rewind(start)
            raise StoreUnavailable(f"cannot append to {self.segments.path(self.segments.current)}: {exc}") from None
        locations = [located[id(m)] for m in puts]
        stored = iter(locations)  # in the order of `puts`, which is the effects' order
        records_gone: list[int] = []
        try:
            self.db.execute("BEGIN")
            rows = _DeferredRows()
            for effect in effects:
                self._put(effect, rows, stored, records_gone)
            rows.execute(self.db, records_gone)
            self.db.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self._rewind(start)
            raise StoreUnavailable(f"cannot commit to {self.db_path}: {exc}") from None
        for number, _, _ in locations:
            self.segments.live[number] = self.segments.live.get(number, 0) + 1
        for number in records_gone:
            self.segments.record_gone(number)
        self.segments.retire_unreferenced()

    def _rewind(self, mark: tuple[int, int]) -> None:
        try:
            self.segments.rewind(mark)
            self.segments.retire_unreferenced()
        except OSError:
            pass  # the unreferenced tail is cut at the next start-up

    @staticmethod
    def _turn_record(message: Message) -> tuple[list, int]:
        """A turn's record: the frames it arrived in (or an encoding of it
        when built in memory) and their CRC. The array frames' share of the
        CRC comes from the message's own verified `crc32` when it has one,
        so large frames are not read again for it."""
        parts = _pack_frames(message.frames or encode(PRODUCER_TO_BROKER, "turn", message.fields, message.arrays))
        return parts, crc32_continued(parts[:2], parts[2:], message.crc32)  # no crc32 without received frames

    @staticmethod
    def _turn_row(effect: PutTurn, location) -> tuple:
        seg, off, length = location if location else (None, None, None)
        return (effect.trajectory_id, effect.turn, effect.digest or b"", int(effect.applied), effect.reason, seg, off,
                length, effect.at)

    def turn_digest(self, trajectory_id: str, turn: int) -> bytes:
        """The content digest of a stored applied turn, from its record (a
        resend is compared with it)."""
        with _unavailable_on_failure(f"cannot read turn {turn} of {trajectory_id!r} from {self.db_path}"):
            row = self.db.execute("SELECT segment, offset, length FROM turns WHERE trajectory_id=? AND turn=?",
                                  (trajectory_id, turn)).fetchone()
        if row is None or row[0] is None:
            raise StoreCorrupted(f"turn {turn} of {trajectory_id!r} was applied but has no stored record")
        return content_digest(self.read_turn(row))

    def _put(self, effect: Effect, rows: "_DeferredRows", stored: Iterator, records_gone: list[int]) -> None:
        """One effect into the open transaction: the common ones (turns,
        starts, ends, forgotten ids) as rows run together at the end; any
        other runs now, after the rows so far (it may touch the same rows)."""
        db = self.db
        match effect:
            case PutTurn():
                rows.turns.append(self._turn_row(effect, next(stored) if effect.message is not None else None))
            case OpenTrajectory(replaces=False):
                rows.opens.append((effect.trajectory_id, effect.group_id, effect.group_size, effect.sample_index, effect.at,
                                   effect.producer, effect.producer_key))
            case EndTrajectory():
                reward, metadata = msgpack.packb(effect.reward), msgpack.packb(effect.metadata)
                rows.ends.append((State.SCORING if effect.scoring else State.ENDED, effect.at, effect.digest, reward,
                                  metadata, None if effect.scoring else self._take_ready_seq(),
                                  _end_crc(effect.trajectory_id, effect.digest, reward, metadata), effect.version,
                                  msgpack.packb(effect.sampled) if effect.sampled else None, effect.trajectory_id))
            case Forget():
                rows.forgets.append((effect.trajectory_id, effect.dedup_until, effect.dead_reason, effect.dead_at))
                if self.archive is not None and (effect.dead_reason is None or self.archive.dead_letters):
                    rows.archiving.append((effect.first_delivered_at, effect.deliveries, effect.committed_at,
                                           effect.trajectory_id))
            case OpenTrajectory():  # one replacing a LEFT marker
                rows.execute(db, records_gone)
                records_gone += _delete_turns(db, [effect.trajectory_id])
                db.execute(_OPEN, (effect.trajectory_id, effect.group_id, effect.group_size, effect.sample_index, effect.at,
                                   effect.producer, effect.producer_key))
            case NameProducer():
                rows.execute(db, records_gone)
                db.execute("UPDATE trajectories SET producer=?, producer_key=? WHERE id=?",
                           (effect.producer, effect.producer_key, effect.trajectory_id))
            case MarkGap():
                rows.execute(db, records_gone)
                db.execute("UPDATE trajectories SET gap_turn=?, gap_field=? WHERE id=?",
                           (effect.gap.turn, effect.gap.field, effect.trajectory_id))
            case DropTrajectory():
                rows.execute(db, records_gone)
                records_gone += _delete_turns(db, [effect.trajectory_id])
                if effect.keep_marker:
                    db.execute(f"UPDATE trajectories SET state='{State.LEFT}' WHERE id=?", (effect.trajectory_id,))
                else:
                    db.execute("DELETE FROM trajectories WHERE id=?", (effect.trajectory_id,))
            case DeadLetter():
                rows.execute(db, records_gone)
                db.execute(f"UPDATE trajectories SET state='{State.DEAD}', dead_reason=?, dead_at=? WHERE id=?",
                           (effect.reason, effect.at, effect.trajectory_id))
                if effect.dedup_until is not None:
                    db.execute("INSERT OR REPLACE INTO dedup (id, until) VALUES (?, ?)",
                               (effect.trajectory_id, effect.dedup_until))
            case SetReward(trajectory_id=tid):  # its end's row gets the reward, and the CRC over it
                rows.execute(db, records_gone)
                digest, metadata = db.execute("SELECT end_digest, metadata FROM trajectories WHERE id=?", (tid,)).fetchone()
                reward = msgpack.packb(effect.reward)
                db.execute(f"UPDATE trajectories SET state='{State.ENDED}', reward=?, end_crc=?, ready_seq=?, updated_at=? "
                           "WHERE id=?", (reward, _end_crc(tid, digest, reward, metadata), self._take_ready_seq(),
                                          effect.at, tid))
            case Revive():
                rows.execute(db, records_gone)
                db.execute(f"UPDATE trajectories SET state='{State.ENDED}', dead_reason=NULL, dead_at=NULL, ready_seq=? "
                           "WHERE id=?", (self._take_ready_seq(), effect.trajectory_id))
            case MarkTrained(trajectory_id=tid, trained=at):
                rows.trained.append((at.run, at.lineage, at.step, at.position, at.epoch, effect.committed_at,
                                     effect.first_delivered_at, effect.deliveries, tid))
            case SetPolicy(job=job, policy=policy):
                db.execute("INSERT OR REPLACE INTO policies VALUES (?, ?, ?, ?, ?, ?)",
                           (job, policy.version, policy.max_staleness, policy.per_step, policy.share,
                            msgpack.packb(policy.ancestry.to_wire()) if policy.ancestry.branches else None))
            case SealRun():
                rows.execute(db, records_gone)
                db.execute("INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?)",
                           (effect.run, effect.lineage, msgpack.packb(list(effect.seals)), effect.reclaimed))
            case GroupDeliverable():  # the table keeps its first name, `released_groups`
                rows.execute(db, records_gone)
                db.execute("INSERT OR REPLACE INTO released_groups VALUES (?, ?)", (effect.group_id, effect.size))
            case CloseGroup():
                rows.execute(db, records_gone)
                db.execute("DELETE FROM released_groups WHERE id=?", (effect.group_id,))
                db.execute(f"DELETE FROM trajectories WHERE group_id=? AND state='{State.LEFT}'", (effect.group_id,))
            case _:
                raise InternalError(f"every store effect has a case here, {type(effect).__name__} has none")

    def _take_ready_seq(self) -> int:
        seq = self._next_ready_seq
        self._next_ready_seq += 1
        return seq

    # -- the archive ----------------------------------------------------------
    @property
    def store_id(self) -> str:
        return str(self.db.execute("SELECT value FROM meta WHERE key='store_id'").fetchone()[0])

    def archive_waiting(self) -> int:
        """Trajectories kept until the archive holds them."""
        with _unavailable_on_failure(f"cannot count the archiving trajectories in {self.db_path}"):
            return self.db.execute(f"SELECT COUNT(*) FROM trajectories WHERE state='{State.ARCHIVING}'").fetchone()[0]

    def archive_work(self, rows: int, busy: Collection[int] = (), files: int = 2) -> list[ArchiveBatch]:
        """The archive files to write next: those given out before and not
        yet `archived` (after a restart, the same rows again), then the
        archiving trajectories not given one yet, in files of at most `rows`
        of one job and outcome (trained, delivered or dead), in the order
        they were trained. A file's number is durable before it
        is handed out, so a file written twice holds the same rows. `busy`:
        the numbers being written now; at most `files` are handed out (what
        is held in memory for the archive stays bounded)."""
        db = self.db
        with _unavailable_on_failure(f"cannot hand out archive work from {self.db_path}"):
            pending = db.execute(f"SELECT id, trained_run IS NOT NULL, dead_reason IS NOT NULL FROM trajectories WHERE state="
                                 f"'{State.ARCHIVING}' AND archive_file IS NULL ORDER BY trained_run, trained_lineage, "
                                 "trained_step, trained_position, id").fetchall()
            if pending:
                groups: dict[tuple, list[str]] = {}
                for tid, trained, dead in pending:
                    groups.setdefault((job_of(tid), trained, dead), []).append(tid)
                row = db.execute("SELECT value FROM meta WHERE key='archive_next_file'").fetchone()
                number = int(row[0]) if row else 0
                assigned = []
                for tids in groups.values():
                    for i in range(0, len(tids), rows):
                        assigned += [(number, tid) for tid in tids[i : i + rows]]
                        number += 1
                db.execute("BEGIN")
                db.executemany("UPDATE trajectories SET archive_file=? WHERE id=?", assigned)
                db.execute("INSERT OR REPLACE INTO meta VALUES ('archive_next_file', ?)", (number,))
                db.execute("COMMIT")
            numbers = [n for (n,) in db.execute(f"SELECT DISTINCT archive_file FROM trajectories WHERE state="
                                                 f"'{State.ARCHIVING}' AND archive_file IS NOT NULL ORDER BY 1")
                       if n not in busy][:files]
            return [self._archive_batch(n) for n in numbers]

    def _archive_batch(self, number: int) -> ArchiveBatch:
        """Archive file `number`'s rows, each end checked against its CRC
        (a damaged one is `StoreCorrupted`, never archived as if whole)."""
        where = f"state='{State.ARCHIVING}' AND archive_file=?"
        db = self.db
        rows = []
        for *row, end_crc in db.execute(f"SELECT {', '.join(ARCHIVE_COLUMNS)}, end_crc FROM trajectories WHERE {where} "
                                        "ORDER BY trained_run, trained_lineage, trained_step, trained_position, id",
                                        (number,)):
            tid, reward, metadata, end_digest = row[0], row[9], row[10], row[11]
            if end_digest is not None and (crc := _end_crc(tid, end_digest, reward, metadata)) != end_crc:
                raise StoreCorrupted(f"{self.db_path}: trajectories row {tid!r}: CRC mismatch over its end (digest, "
                                     f"reward, metadata): stored {end_crc}, computed {crc}")
            rows.append(tuple(row))
        turns = db.execute(f"SELECT {', '.join(ARCHIVE_TURN_COLUMNS)} FROM turns WHERE trajectory_id IN (SELECT id FROM "
                           f"trajectories WHERE {where}) ORDER BY trajectory_id, turn", (number,)).fetchall()
        return ArchiveBatch(number, rows, turns)

    def archived(self, number: int) -> int:
        """Archive file `number` is durable: its trajectories' rows are
        deleted (their ids stay remembered), and the segments holding their
        records are kept for the archive (`handover`), not deleted. A
        current segment left with nothing else is finished, so that it can
        go too. Returns how many trajectories."""
        db = self.db
        archiving = f"SELECT id FROM trajectories WHERE state='{State.ARCHIVING}' AND archive_file=?"
        with _unavailable_on_failure(f"cannot delete archived trajectories from {self.db_path}"):
            tids = [tid for (tid,) in db.execute(archiving, (number,))]
            kept = [n for (n,) in db.execute(f"SELECT DISTINCT segment FROM turns WHERE segment IS NOT NULL AND "
                                             f"trajectory_id IN ({archiving})", (number,))]
            db.execute("BEGIN")
            try:
                db.executemany("INSERT INTO archive_segments VALUES (?, 0) ON CONFLICT (segment) DO UPDATE "
                               "SET in_archive=0", [(n,) for n in kept])
                records_gone = _delete_trajectories(db, tids)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        segments = self.segments
        segments.kept.update(kept)
        for segment in records_gone:
            segments.record_gone(segment)
        if segments.current in segments.kept and not segments.live.get(segments.current) and not self.writing_ahead:
            segments.rotate()
        segments.retire_unreferenced()
        return len(tids)

    def handover(self, busy: Collection[int] = (), *, copies: bool = False) -> list[SegmentHandover]:
        """The segment files to give the archive: each kept one no row
        refers to any more, to move; with `copies`, also a copy of each
        still in use whose archived records the archive lacks (as far as
        the segment is written now), so that it holds everything archived
        so far. `busy`: those being placed now."""
        segments = self.segments
        out = [SegmentHandover(n, segments.path(n), True, 0) for n in segments.to_move if n not in busy]
        if copies:
            with _unavailable_on_failure(f"cannot read the archive's segments from {self.db_path}"):
                lacking = [n for (n,) in self.db.execute("SELECT segment FROM archive_segments WHERE in_archive=0")]
            out += [SegmentHandover(n, segments.path(n), False,
                                    segments.size if n == segments.current else segments.closed_size(n))
                    for n in lacking if n not in busy and n not in segments.to_move]
        return out

    def handed_over(self, handover: SegmentHandover) -> None:
        """`handover` is durable in the archive: a moved segment is
        forgotten, a copied one marked as held there (until it is moved)."""
        with _unavailable_on_failure(f"cannot record a segment the archive took in {self.db_path}"):
            if handover.whole:
                self.db.execute("DELETE FROM archive_segments WHERE segment=?", (handover.number,))
                self.segments.moved(handover.number)
            else:
                self.db.execute("UPDATE archive_segments SET in_archive=1 WHERE segment=?", (handover.number,))

    def archive_lacking(self) -> int:
        """Segments holding archived records that the archive lacks (neither moved nor copied since)."""
        with _unavailable_on_failure(f"cannot count the archive's segments in {self.db_path}"):
            return self.db.execute("SELECT COUNT(*) FROM archive_segments WHERE in_archive=0").fetchone()[0]

    def probe(self) -> None:
        """A small real write to both files; raises `StoreUnavailable` while the
        cause of an earlier failure (disk full, I/O error) persists."""
        with _unavailable_on_failure("store still unavailable"):
            self.checkpoint()  # a WAL that reached a file-size limit or filled the disk starts again, empty
            start = self.segments.mark
            self.segments.append([([bytes(4096)], None)])
            self.segments.rewind(start)
            self.segments.retire_unreferenced()
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('probe', randomblob(4096))")
            self.db.execute("DELETE FROM meta WHERE key = 'probe'")

    def checkpoint(self) -> None:
        """Fold the WAL into the database and truncate it (reclaims disk)."""
        with _unavailable_on_failure(f"cannot checkpoint the WAL of {self.db_path}"):
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def prune_dedup(self, now: float) -> None:
        with _unavailable_on_failure(f"cannot prune remembered ids in {self.db_path}"):
            self.db.execute("DELETE FROM dedup WHERE until < ?", (now,))

    def bytes_on_disk(self) -> int:
        """Segment files, the SQLite pages in use, and its WAL: freed pages
        are reused, so they do not count against the disk budget."""
        pages, free, page_size = (self.db.execute(f"PRAGMA {name}").fetchone()[0]
                                  for name in ("page_count", "freelist_count", "page_size"))
        wal = Path(f"{self.db_path}-wal")
        return self.segments.bytes_on_disk() + (pages - free) * page_size + (wal.stat().st_size if wal.exists() else 0)

    def unseen_growth(self) -> int:
        """Free space the store may still take beyond the bytes of the
        records and rows it is given: the blocks the segment log's next
        reservation takes ahead of its records (`SegmentLog.reserve_step`)
        and the WAL's room to grow to the size at which SQLite checkpoints
        it (its header, then a 24-byte header and a page per frame)."""
        frames, page_size = (self.db.execute(f"PRAGMA {name}").fetchone()[0] for name in ("wal_autocheckpoint", "page_size"))
        wal = Path(f"{self.db_path}-wal")
        room = 32 + frames * (24 + page_size) - (wal.stat().st_size if wal.exists() else 0)
        return self.segments.reserve_step + max(0, room)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown()
        self.segments.close()
        self.db.close()
        if self._lock_fd is not None:  # the data directory is free for the next broker
            os.close(self._lock_fd)
            self._lock_fd = None
