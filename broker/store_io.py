"""The core's store requests performed on a `Store`: the half of the broker's
I/O shell that the sockets do not need, so that a test can run `BrokerCore`
on a real store without sockets (tests/test_broker_state_machine.py)."""
from __future__ import annotations

import logging
import os
from typing import Protocol

from rollstream.common.clock import Clock
from rollstream.common.errors import ProtocolError
from rollstream.common.trajectory import Trajectory

from .core import (
    ArchiveState,
    ArchiveStep,
    Checkpoint,
    Commit,
    MeasureDisk,
    Performers,
    Probe,
    PruneDedup,
    ReadBack,
    ReadDigests,
    ReadHistory,
    Reload,
)
from .facts import history_row
from .metrics import BrokerMetrics
from .recovery import Rebuilt, load_trajectory, rebuild
from .store import ArchiveBatch, ArchiveOutcome, HandoverOutcome, SegmentHandover, Store, StoreCorrupted, StoreError

log = logging.getLogger("rollstream.broker")

ARCHIVE_RETRY_EVERY = 5.0  # seconds after a failed archive file before its rows are handed out again


class Archiving(Protocol):
    """What `StoreIO` asks of the archive's writer (broker/archive.py's `Archiver`)."""

    busy: set[int]  # archive files being written
    placing: set[int]  # segments being moved or copied

    def submit(self, work: ArchiveBatch | SegmentHandover) -> None: ...

    def finished(self) -> list[ArchiveOutcome | HandoverOutcome]: ...


def free_space(directory: str | os.PathLike) -> int:
    """Bytes free to an unprivileged writer on `directory`'s file system."""
    fs = os.statvfs(directory)
    return fs.f_bavail * fs.f_frsize


class StoreIO:
    """Answers `Commit`, `ReadDigests`, `ReadBack`, `ReadHistory`, `Reload`,
    `Probe`, `PruneDedup`, `MeasureDisk`, `Checkpoint` and `ArchiveStep`
    (broker/core.py) from `store` and its `archiver` (None: no archive);
    `performers` maps each request type to its method."""

    def __init__(self, store: Store, data_dir: str | os.PathLike, metrics: BrokerMetrics, *,
                 archiver: Archiving | None = None, archive_file_rows: int = 1024, archive_linger: float = 0.0):
        self.store, self.data_dir, self.metrics = store, data_dir, metrics
        self.archiver, self.archive_file_rows, self.archive_linger = archiver, archive_file_rows, archive_linger
        self._waiting_since: float | None = None  # when trajectories last began to wait for the archive
        self._archive_failing: str | None = None
        self._archive_retry_at = 0.0
        self.performers: Performers = dict([
            Commit.answered_by(self.commit), ReadDigests.answered_by(self.read_digests),
            ReadBack.answered_by(self.read_back), ReadHistory.answered_by(self.read_history),
            Reload.answered_by(self.reload), Probe.answered_by(self.probe),
            PruneDedup.answered_by(self.prune_dedup), MeasureDisk.answered_by(self.measure_disk),
            Checkpoint.answered_by(self.checkpoint), ArchiveStep.answered_by(self.archive_step),
        ])

    def commit(self, request: Commit) -> StoreError | None:
        store = self.store
        if not request.effects and not store.writing_ahead:
            return None
        started = Clock.monotonic()
        try:
            store.commit(request.effects)
        except StoreError as exc:
            return exc
        self.metrics.commit_seconds.observe(Clock.monotonic() - started)
        return None

    def read_digests(self, request: ReadDigests) -> dict[tuple[str, int], bytes | StoreError]:
        read: dict[tuple[str, int], bytes | StoreError] = {}
        for trajectory_id, turn in request.keys:
            try:
                read[(trajectory_id, turn)] = self.store.turn_digest(trajectory_id, turn)
            except StoreError as exc:
                read[(trajectory_id, turn)] = exc
        return read

    def read_back(self, request: ReadBack) -> Trajectory | StoreError:
        try:
            return load_trajectory(self.store, self.store.load_one(request.trajectory_id))
        except StoreError as exc:
            return exc

    def read_history(self, request: ReadHistory) -> list[dict] | StoreError:
        """The rows asked for; each one's records are read (for its weight
        versions, status and length) only where it has any."""
        store = self.store
        try:
            return [history_row(stored, load_trajectory(store, stored) if any(t.location for t in stored.turns) else None)
                    for stored in store.load_many(request.trajectory_ids)]
        except StoreError as exc:
            return exc
        except ProtocolError as exc:  # a stored turn the merge refuses: the store's damage, not the asker's
            return StoreCorrupted(f"a trajectory asked for cannot be read back: {exc}")

    def reload(self, _request: Reload) -> Rebuilt:
        return rebuild(self.store.reload(), self.store)

    def probe(self, _request: Probe) -> bool:
        try:
            self.store.probe()
        except StoreError:
            return False
        return True

    def prune_dedup(self, request: PruneDedup) -> None:
        try:
            self.store.prune_dedup(request.wall)
        except StoreError as exc:  # a failed prune only delays pruning
            log.warning("dedup prune failed", extra={"error": str(exc)})

    def measure_disk(self, _request: MeasureDisk) -> tuple[int, int]:
        """The store's size, and the free space it can count on: until the
        next measurement the core takes each producer frame's bytes off it,
        which leaves out the blocks a new segment reserves and the pages
        the WAL grows by. Those come off here, so that the store itself
        never writes into the free-space reserve unseen (`DiskBudget`)."""
        return self.store.bytes_on_disk(), max(0, free_space(self.data_dir) - self.store.unseen_growth())

    def checkpoint(self, _request: Checkpoint) -> None:
        try:
            self.store.checkpoint()
        except StoreError as exc:  # a failed checkpoint only leaves the WAL larger
            log.warning("WAL checkpoint failed", extra={"error": str(exc)})

    def archive_step(self, request: ArchiveStep) -> ArchiveState | None:
        """Delete the rows of each archive file now durable and let go of
        each segment now in the archive, then hand the archiver the next
        segments and files (not before `ARCHIVE_RETRY_EVERY` after a
        failure: a full archive disk is tried again, not hammered). Files
        are handed out once a whole file's rows wait, or what waits has
        waited `archive_linger`, or a run ended (`request.complete`): each
        file costs a fixed amount, so fuller files cost less per row. What
        failed stays in the store, counted and reported. Copies of segments
        in use (`request.complete`) are handed out only while no file is
        written or waits, and no file while they are made: a file finished
        meanwhile could add records the copy has not got."""
        archiver, store, metrics = self.archiver, self.store, self.metrics
        if archiver is None:
            return None
        try:
            for outcome in archiver.finished():
                if outcome.error is not None:
                    metrics.inc(metrics.archive_failures)
                    if self._archive_failing is None:
                        log.warning("archive file or segment not written; what it holds is kept and written again",
                                    extra={"what": outcome.what, "error": str(outcome.error)})
                    self._archive_failing = f"{type(outcome.error).__name__}: {outcome.error}"
                    self._archive_retry_at = request.mono + ARCHIVE_RETRY_EVERY
                    continue
                if isinstance(outcome, HandoverOutcome):
                    store.handed_over(outcome.handover)
                else:
                    store.archived(outcome.number)
                    metrics.inc(metrics.archive_rows, outcome.rows)
                metrics.inc(metrics.archive_bytes, outcome.nbytes)
                self._archive_failing = None
            waiting = store.archive_waiting()
            if not waiting:
                self._waiting_since = None
            elif self._waiting_since is None:
                self._waiting_since = request.mono
            if request.mono >= self._archive_retry_at:
                copies = request.complete and not waiting and not archiver.busy
                for handover in store.handover(archiver.placing, copies=copies):
                    archiver.submit(handover)
                due = (waiting >= self.archive_file_rows or request.complete or self._waiting_since is not None
                       and request.mono - self._waiting_since >= self.archive_linger)
                if not archiver.busy and not copies and due:
                    for batch in store.archive_work(self.archive_file_rows, archiver.busy):
                        archiver.submit(batch)
                    self._waiting_since = request.mono  # what comes after lingers afresh
            lacking = store.archive_lacking()
        except StoreError as exc:  # a durable file's rows are deleted at a later step (written again, the same)
            log.warning("archive step failed", extra={"error": str(exc)})
            return ArchiveState(0, len(archiver.busy) + len(archiver.placing), f"the store: {exc}")
        metrics.archive_waiting.set(waiting)
        return ArchiveState(waiting, len(archiver.busy) + len(archiver.placing), self._archive_failing, lacking)
