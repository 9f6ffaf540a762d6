"""The segment log shared by the broker's store and the producer's spool:
numbered append-only files `seg-NNNNNNNN.log` in one directory, each a run
of records

    [u32 magic 0x52534731 ("1GSR" as bytes)][u32 payload length][u32 CRC-32 of the payload][payload]

little endian. A record is located by (segment number, payload offset,
payload length): the offset is where its payload starts, `HEADER.size`
bytes past its header, and is the one every message names.

What the log owns: the record format and its checks, appending (several
records per `writev`, into blocks reserved ahead of the segment's end and
given back when it is finished, and written behind where the owner asks:
out to disk and out of the page cache a window at a time), reading and
verifying records at their locations, scanning a segment's records, cutting a torn tail (to an end its owner
knows, or to the end `scan` found), and rotation, numbering and removal of
files. What its owners keep: what a payload means, and when a finished
segment may go (the store counts referring rows, the spool settled frames).
Damage is raised as the owner's error type, naming the file and offset.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .codec import crc32_of
from .errors import InvalidState, RollstreamError

MAGIC = 0x52534731
HEADER = struct.Struct("<III")  # magic, payload length, CRC-32 of the payload
_PREFIX, _SUFFIX = "seg-", ".log"
_IOV_MAX = 512  # buffers per writev

Location = tuple[int, int, int]  # segment number, payload offset, payload length

# Blocks reserved past a segment's end before appends reach them. An append
# that makes the file system allocate its blocks costs several times the
# copy itself on ext4 (docs/performance.md); into space already reserved it
# is little more than the copy.
RESERVE_AHEAD = 16 << 20
_FALLOC_FL_KEEP_SIZE = 1  # linux/falloc.h: reserve blocks, leave the file's size alone


def _libc(name: str, *argtypes):
    """A Linux libc call by name with its argument types, or None (another
    platform, or a C library without it)."""
    if sys.platform != "linux":
        return None
    try:
        call = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), name)
    except (OSError, AttributeError):
        return None
    call.argtypes = list(argtypes)
    call.restype = ctypes.c_int
    return call


# `fallocate(2)`: `os.posix_fallocate` would grow the file's size, which the
# log reads as where its records end.
_FALLOCATE = _libc("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
# `sync_file_range(2)`, which Python's os module lacks.
_SYNC_FILE_RANGE = _libc("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writing the range out, without waiting for it

# Write-behind (an owner's choice): every `WRITE_BEHIND` bytes appended,
# the log starts writing them out and drops from the page cache what it
# appended before the previous window, whose write-out began a window
# ago. A log written once and read back only on recovery or a reload then
# keeps two or three windows of page cache, whose pages the next appends use again, instead of
# growing the cache by everything it writes: pages the kernel has to find
# fresh cost several times the copy into them (docs/performance.md), and
# the node's other files keep their cache. Nothing waits for the disk: a
# page still being written out when its window is dropped stays cached, as
# every page did without write-behind, until its segment is deleted.
WRITE_BEHIND = 8 << 20


class SegmentDamaged(RollstreamError, ValueError):
    """A record fails its checks (magic, length, CRC) or is cut short; the
    message names the segment file and the record's offset."""

    code = "internal"


@dataclass
class Scan:
    """A segment's records from its start: each whole record's location and
    payload, and `end`, where the last of them ends. `damage` says why the
    bytes at `end` are not a record (None: the file ends there), and `torn`
    whether they could be a final write cut short (the record runs past the
    end of the file, or it is the last one and fails its CRC)."""

    records: list[tuple[Location, memoryview]]
    end: int
    damage: str | None = None
    torn: bool = False


def _problem(magic: int, stored_length: int, crc: int, payload: memoryview, length: int) -> str | None:
    """Why a record with this header and payload is not the `length`-byte
    record expected, or None."""
    if magic != MAGIC:
        return f"bad magic {magic:#010x}, expected {MAGIC:#010x}"
    if stored_length != length:
        return f"header length {stored_length}, expected {length}"
    if len(payload) != length:
        return f"the file ends {length - len(payload)} bytes into its {length}-byte payload"
    actual = crc32_of([payload])
    if actual != crc:
        return f"CRC mismatch: header says {crc}, payload gives {actual}"
    return None


class SegmentLog:
    """Numbered record files in `directory`: appends go to the newest
    (`current`), which is finished and a new one started once it holds
    `max_bytes` (or after a failed write). Open for appends with
    `open_current` until `close`. `write_behind`: for an owner that reads
    records back only now and then (`WRITE_BEHIND`)."""

    def __init__(self, directory: Path, max_bytes: int, *, damaged: type[Exception] = SegmentDamaged,
                 write_behind: bool = False):
        self.directory = directory
        self.max_bytes = max_bytes
        self.damaged = damaged  # the owner's error type for damaged records
        directory.mkdir(parents=True, exist_ok=True)
        numbers = self.existing()
        self.current = numbers[-1] if numbers else 1
        self.size = 0  # of the current segment, from `open_current`
        self._fd: int | None = None  # the current segment's, from `open_current` until `close`
        self._closed_sizes: dict[int, int] = {}  # finished segments never grow, so their sizes are kept
        self._failed = False  # a write to the current segment failed: the next append starts a new one
        self._reserved = 0  # where the blocks reserved for the current segment end (`_reserve`)
        self._reserves = _FALLOCATE is not None  # until the file system says it cannot
        self._write_behind = write_behind and _SYNC_FILE_RANGE is not None  # until the kernel refuses it
        # The current segment's windows (`_written_behind`): write-out started before `_writing_from`, a window
        # ago before `_written_from`, and dropped from the page cache before `_dropped_to`.
        self._writing_from = self._written_from = self._dropped_to = 0

    @classmethod
    def read_only(cls, directory: Path, *, damaged: type[Exception] = SegmentDamaged) -> "SegmentLog":
        """A log read where it lies, records by location only (`read_many`):
        nothing made, nothing opened to write (a copy kept elsewhere, as an
        archive's)."""
        log = cls.__new__(cls)
        log.directory, log.damaged = directory, damaged
        return log

    # -- files ----------------------------------------------------------------
    def path(self, number: int) -> Path:
        return self.directory / f"{_PREFIX}{number:08d}{_SUFFIX}"

    def existing(self) -> list[int]:
        return sorted(int(p.name[len(_PREFIX) : -len(_SUFFIX)]) for p in self.directory.glob(f"{_PREFIX}*{_SUFFIX}"))

    def where(self, number: int, offset: int) -> str:
        """How messages name a record: its file and payload offset."""
        return f"segment file {self.path(number).name}, record at offset {offset}"

    def remove(self, number: int) -> None:
        """Delete a finished segment."""
        self.path(number).unlink(missing_ok=True)
        self._closed_sizes.pop(number, None)

    def closed_size(self, number: int) -> int:
        """A finished segment's size."""
        return self._closed_sizes[number]

    def bytes_on_disk(self) -> int:
        """Without listing the directory: the broker asks five times a second."""
        return sum(self._closed_sizes.values()) + self.size

    @property
    def reserve_step(self) -> int:
        """The most free space one reservation takes beyond the records it
        is made for (`_reserve`): a file system's free space may drop by
        this much before records fill those blocks. 0 where blocks are not
        reserved."""
        return min(RESERVE_AHEAD, self.max_bytes) if self._reserves else 0

    # -- appending --------------------------------------------------------------
    def open_current(self, end: int) -> None:
        """Open the newest segment for appends, cutting what follows `end`
        (a torn tail: the committed end its owner knows, or `Scan.end`)."""
        self._fd = fd = os.open(self.path(self.current), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        if os.fstat(fd).st_size >= end:  # at the end too: that gives back blocks a crash left reserved past it
            os.ftruncate(fd, end)
        self.size = self._reserved = self._writing_from = self._written_from = self._dropped_to = end
        self._closed_sizes = {n: self.path(n).stat().st_size for n in self.existing() if n != self.current}

    def append(self, records: list[tuple[list, int | None]]) -> list[Location]:
        """Write records (each a list of byte buffers, whose `len` is their
        size, and its CRC, or None to compute it) in as few syscalls as
        possible; returns each record's location. A failed write is cut off
        again and raised."""
        if self.size >= self.max_bytes or self._failed:
            self.rotate()
        fd = self._open_fd()
        locations, buffers, offset = [], [], self.size
        for parts, crc in records:
            length = sum(map(len, parts))
            buffers.append(HEADER.pack(MAGIC, length, crc32_of(parts) if crc is None else crc))
            buffers.extend(parts)
            locations.append((self.current, offset + HEADER.size, length))
            offset += HEADER.size + length
        start = self.size
        if offset > self._reserved:
            self._reserve(fd, offset)
        try:
            for i in range(0, len(buffers), _IOV_MAX):
                chunk = buffers[i : i + _IOV_MAX]
                expected = sum(map(len, chunk))
                written = os.writev(fd, chunk)
                if written != expected:  # a short write: finish it the slow way
                    os.write(fd, b"".join(bytes(memoryview(b)) for b in chunk)[written:])
        except OSError:
            os.ftruncate(fd, start)
            self._reserved = start
            # A file-size limit below `max_bytes` would fail every later
            # write here too: go on in a new file (an empty one never
            # rotates, so a full disk does not leave a file per attempt).
            self._failed = start > 0
            raise
        self.size = offset
        if self.size - self._writing_from >= WRITE_BEHIND and self._write_behind:
            self._written_behind(fd)
        return locations

    def _written_behind(self, fd: int) -> None:
        """Start writing out what was appended since the last call, and drop
        the pages of what came before the previous window (the kernel keeps
        those not written out yet). Best effort: where the kernel refuses,
        the pages stay cached as without it, and it is not asked again for
        this log."""
        assert _SYNC_FILE_RANGE is not None  # `_write_behind` is False without it
        start, end = self._writing_from, self.size
        if _SYNC_FILE_RANGE(fd, start, end - start, _SYNC_FILE_RANGE_WRITE) != 0:
            self._write_behind = False
            return
        if self._written_from > self._dropped_to:
            os.posix_fadvise(fd, self._dropped_to, self._written_from - self._dropped_to, os.POSIX_FADV_DONTNEED)
            self._dropped_to = self._written_from
        self._written_from, self._writing_from = start, end

    def _reserve(self, fd: int, end: int) -> None:
        """Reserve blocks from the segment's end to past `end`: at least
        `RESERVE_AHEAD`, not past `max_bytes` unless `end` is. Best effort:
        a file system that cannot is not asked again, and a reservation
        refused for want of space leaves the write to find out."""
        if not self._reserves:
            return
        target = max(end, min(self.size + RESERVE_AHEAD, self.max_bytes))
        assert _FALLOCATE is not None  # `_reserves` is False without it
        if _FALLOCATE(fd, _FALLOC_FL_KEEP_SIZE, self._reserved, target - self._reserved) == 0:
            self._reserved = target
        elif ctypes.get_errno() in (errno.EOPNOTSUPP, errno.ENOSYS):
            self._reserves = False

    def _release(self, fd: int) -> None:
        """Give back the blocks reserved past the segment's end (a cut to
        its own size frees them)."""
        if self._reserved > self.size:
            os.ftruncate(fd, self.size)
        self._reserved = self.size

    def rotate(self) -> None:
        """Finish the current segment and start the next."""
        fd = self._open_fd()
        self._release(fd)
        os.close(fd)
        self._closed_sizes[self.current] = self.size
        self._failed = False
        self.current += 1
        self._fd = os.open(self.path(self.current), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = self._reserved = self._writing_from = self._written_from = self._dropped_to = 0

    def _open_fd(self) -> int:
        if self._fd is None:
            raise InvalidState(f"the segments in {self.directory} are not open (open_current first; not after close)")
        return self._fd

    def sync(self) -> None:
        os.fdatasync(self._open_fd())

    @property
    def mark(self) -> tuple[int, int]:
        """Where the next record goes: `rewind` to it undoes what follows."""
        return self.current, self.size

    def rewind(self, mark: tuple[int, int]) -> None:
        """Cut what was appended since `mark`. Past a rotation the current
        segment holds only those records; in the older one they stay as
        bytes nothing refers to, deleted with it."""
        number, size = mark
        size = size if number == self.current else 0
        os.ftruncate(self._open_fd(), size)  # which frees the reserved blocks too
        self.size = self._reserved = size
        self._writing_from, self._written_from, self._dropped_to = (
            min(self._writing_from, size), min(self._written_from, size), min(self._dropped_to, size))

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        if self._fd is not None:
            self._release(self._fd)
            os.close(self._fd)
            self._fd = None

    # -- reading ----------------------------------------------------------------
    def read_many(self, locations: list[Location]) -> list[memoryview]:
        """Payloads in the order given, each verified, each segment opened
        once: rebuilding a trajectory costs its bytes, not a file open per
        record."""
        by_segment: dict[int, list[int]] = {}
        for i, (number, _, _) in enumerate(locations):
            by_segment.setdefault(number, []).append(i)
        out: list = [None] * len(locations)
        for number, indices in by_segment.items():
            fd = os.open(self.path(number), os.O_RDONLY)
            try:
                for i in indices:
                    _, offset, length = locations[i]
                    out[i] = self._checked(os.pread(fd, HEADER.size + length, offset - HEADER.size), locations[i])
            finally:
                os.close(fd)
        return out

    def verify(self, locations: Iterable[Location]) -> None:
        """Check every record at `locations` (an owner's start-up check),
        reading each segment once; a missing segment is damage too."""
        by_segment: dict[int, list[Location]] = {}
        for location in locations:
            by_segment.setdefault(location[0], []).append(location)
        for number, located in by_segment.items():
            path = self.path(number)
            if not path.exists():
                raise self.damaged(f"segment file {path.name} is missing but {len(located)} record(s) refer to it")
            data = path.read_bytes()
            for location in located:
                start = location[1] - HEADER.size
                self._checked(data[start : start + HEADER.size + location[2]], location)

    def _checked(self, data: bytes, location: Location) -> memoryview:
        """The payload of the record read at `location` (header included in
        `data`), or the owner's damage error naming file and offset."""
        number, offset, length = location
        if len(data) < HEADER.size:
            raise self.damaged(f"{self.where(number, offset)}: the file ends inside its header")
        payload = memoryview(data)[HEADER.size :]
        magic, stored_length, crc = HEADER.unpack_from(data)
        problem = _problem(magic, stored_length, crc, payload, length)
        if problem is not None:
            raise self.damaged(f"{self.where(number, offset)}: {problem}")
        return payload

    def scan(self, number: int) -> Scan:
        """Every whole record of segment `number` from its start, up to the
        end of the file or the first damaged record (see `Scan`)."""
        data = self.path(number).read_bytes()
        view, size = memoryview(data), len(data)
        records: list[tuple[Location, memoryview]] = []
        start = 0
        while start < size:
            offset = start + HEADER.size
            if offset > size:
                return Scan(records, start, f"{self.where(number, offset)}: the file ends inside its header", torn=True)
            magic, length, crc = HEADER.unpack_from(data, start)
            payload = view[offset : offset + length]
            problem = _problem(magic, length, crc, payload, length)
            if problem is not None:
                torn = magic == MAGIC and offset + length >= size  # runs past the end, or is the last and fails its CRC
                return Scan(records, start, f"{self.where(number, offset)}: {problem}", torn=torn)
            records.append(((number, offset, length), payload))
            start = offset + length
        return Scan(records, start)
