"""The producer's disk spool: frames not yet settled by the broker, on disk,
so a producer that dies and restarts with the same `producer_id` and spool
resends them, and one that cannot reach its broker keeps accepting frames
until the spool's byte budget is used.

Layout of a spool directory (format 2):
- `PRODUCER`: the producer id the spool belongs to;
- `LOCK`: held (flock) by the one live producer using the spool;
- `seg-NNNNNNNN.log`: the segment log of `rollstream.common.segments` (the
  broker's store writes the same records).

Payloads: `F` + u64 seq + u32 frame count + (u32 length + bytes) per frame
(the encoded wire frames, verbatim: no pickle) for a frame, or `S` + u64 seq
when that frame was settled. Segments are deleted oldest first once every
frame in them is settled. A torn record at the very end (a crash mid-write)
is cut off on open; a bad record anywhere else is corruption and refuses the
open. A format 1 spool (`NNNNNNNNNNNNNNNN.seg` files of `[u32 length][u32
CRC-32]` records) is refused: spools are transient, so there is no upgrade.
"""
from __future__ import annotations

import os
import struct
from collections import deque
from pathlib import Path
from typing import Callable

from rollstream.common.dirlock import DirectoryHeld, hold
from rollstream.common.errors import InvalidInput, RollstreamError
from rollstream.common.segments import HEADER, Location, SegmentLog

FRAME_HEAD = struct.Struct("<cQI")  # b"F", seq, frame count
FRAME_LEN = struct.Struct("<I")
SETTLED = struct.Struct("<cQ")  # b"S", seq
FORMAT = "format 2 (seg-NNNNNNNN.log files of [u32 magic][u32 length][u32 CRC-32] records)"
_FORMAT_1 = "format 1 (NNNNNNNNNNNNNNNN.seg files of [u32 length][u32 CRC-32] records)"


class SpoolError(RollstreamError, RuntimeError):
    """The spool cannot be used (belongs to another producer, is locked, is
    of another format, or is corrupted); the message names the file and the
    rule."""

    code = "spool_unusable"


def record_bytes(frames: list) -> int:
    """Bytes a frame takes in the spool, framing included."""
    return HEADER.size + FRAME_HEAD.size + sum(FRAME_LEN.size + memoryview(f).nbytes for f in frames)


def default_segment_bytes(max_bytes: int) -> int:
    """A sixteenth of the budget (at most 64 MiB): space is freed a segment at
    a time, so segments must be well below the budget or a full spool could
    never free any."""
    return max(1, min(64 << 20, max_bytes // 16))


class Spool:
    """Append-only record log of unsettled frames with a backlog reader."""

    def __init__(self, directory: str | os.PathLike, producer_id: str, *, max_bytes: int,
                 segment_bytes: int | None = None, fsync: bool = False):
        if max_bytes <= 0:
            raise InvalidInput(f"spool max_bytes must be positive, got {max_bytes}")
        self.directory = Path(directory)
        self.producer_id = producer_id
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or default_segment_bytes(max_bytes)
        if self.segment_bytes > max_bytes // 2:
            raise InvalidInput(f"segment_bytes must be at most half of max_bytes={max_bytes} (space is freed a segment "
                             f"at a time), got {self.segment_bytes}")
        self.fsync = fsync
        self._log: SegmentLog | None = None  # from a successful open
        self._unsettled: dict[int, int] = {}  # unsettled frames by segment number, oldest first: every segment on disk
        self._where: dict[int, Location] = {}  # unsettled seq -> its record
        self._pending: deque[int] = deque()  # backlog: seqs spooled but not handed out, in order
        self._lock_fd: int | None = None
        self.last_seq = 0  # highest seq ever recorded
        try:
            self._open()
        except BaseException:
            self.close()  # a spool refused (held, of another owner or format, damaged) keeps no lock or file open
            raise

    @property
    def backlog(self) -> int:
        """Unsettled frames not yet handed out by `next_backlog`."""
        return len(self._pending)

    # -- opening and recovery -------------------------------------------------
    def _open(self) -> None:
        try:
            self._lock_fd = hold(self.directory)
        except DirectoryHeld as held:
            who = "another live producer" if held.holder is None else f"another live producer (pid {held.holder})"
            raise SpoolError(f"spool {self.directory} is in use by {who}: its LOCK is held") from None
        old = sorted(self.directory.glob("*.seg"))
        if old:
            raise SpoolError(f"spool {self.directory}: {old[0].name} is a spool file of {_FORMAT_1}, this producer reads "
                             f"{FORMAT}; spools are transient and not upgraded: let the old producer version resend it, "
                             "or delete the directory")
        owner_file = self.directory / "PRODUCER"
        if owner_file.exists():
            owner = owner_file.read_text(encoding="utf-8")
            if owner != self.producer_id:
                raise SpoolError(f"spool {self.directory} belongs to producer {owner!r}, not {self.producer_id!r}")
        else:
            owner_file.write_text(self.producer_id, encoding="utf-8")
        # Not written behind: a backlog is read back as soon as the window has room, from the page cache.
        log = SegmentLog(self.directory, self.segment_bytes, damaged=SpoolError)
        numbers = log.existing()
        end = 0
        for number in numbers:
            scan = log.scan(number)
            if scan.damage is not None and not (scan.torn and number == numbers[-1]):
                raise SpoolError(f"spool {self.directory}: {scan.damage}")
            self._unsettled[number] = 0
            for location, payload in scan.records:
                self._recover(location, payload, log)
            end = scan.end  # the last segment's torn record, if any, is cut here
        log.open_current(end)
        self._unsettled.setdefault(log.current, 0)
        self._pending.extend(self._where)  # nothing is handed out yet: every unsettled frame, oldest first
        self._log = log

    def _recover(self, location: Location, payload: memoryview, log: SegmentLog) -> None:
        kind, seq, _ = _parse(payload, lambda: log.where(*location[:2]))
        self.last_seq = max(self.last_seq, seq)
        if kind == b"F":
            self._where[seq] = location
            self._unsettled[location[0]] += 1
        elif seq in self._where:
            self._unsettled[self._where.pop(seq)[0]] -= 1

    # -- writing ----------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self._opened().bytes_on_disk()

    def fits(self, frames: list) -> bool:
        return self.nbytes + record_bytes(frames) <= self.max_bytes

    def append(self, seq: int, frames: list, *, handed_out: bool) -> None:
        """Record a new frame. `handed_out`: the caller keeps it in memory now
        (allowed only with no backlog), so the backlog reader skips it."""
        if seq <= self.last_seq:
            raise InvalidInput(f"spool seqs must increase: got {seq} after {self.last_seq}")
        if handed_out and self.backlog:
            raise InvalidInput(f"cannot hand out seq {seq} ahead of {self.backlog} older spooled frames")
        needed = record_bytes(frames)
        if needed > self.max_bytes:
            raise InvalidInput(f"a frame of {needed} spool bytes exceeds spool_bytes={self.max_bytes}")
        parts: list[bytes | memoryview] = [FRAME_HEAD.pack(b"F", seq, len(frames))]
        for frame in frames:
            view = memoryview(frame).cast("B")  # the log counts buffers by len
            parts += [FRAME_LEN.pack(len(view)), view]
        location = self._write(parts)
        self.last_seq = seq
        self._where[seq] = location
        self._unsettled[location[0]] += 1
        if not handed_out:
            self._pending.append(seq)

    def settle(self, seq: int) -> None:
        """The broker settled `seq` (acked or refused): it is not resent."""
        location = self._where.pop(seq, None)
        if location is None:
            return
        self._write([SETTLED.pack(b"S", seq)])
        self._unsettled[location[0]] -= 1
        if self._pending and seq >= self._pending[0]:  # settled before it was handed out (every later one is pending)
            self._pending.remove(seq)
        self._compact()

    def _write(self, parts: list) -> Location:
        log = self._opened()
        (location,) = log.append([(parts, None)])
        if self.fsync:
            log.sync()
        self._unsettled.setdefault(location[0], 0)
        return location

    def _compact(self) -> None:
        """Delete the oldest segments whose frames are all settled (never
        the one being written)."""
        log = self._opened()
        while len(self._unsettled) > 1:
            number = next(iter(self._unsettled))
            if number == log.current or self._unsettled[number]:
                return
            del self._unsettled[number]
            log.remove(number)

    def _opened(self) -> SegmentLog:
        """The log (after `close` still, for its byte count: appends to it raise)."""
        if self._log is None:
            raise SpoolError(f"spool {self.directory} failed to open")
        return self._log

    # -- reading the backlog ------------------------------------------------------
    def next_backlog(self) -> tuple[int, list[bytes]] | None:
        """The oldest unsettled frame not yet handed out, as (seq, frames)."""
        log = self._opened()
        if not self._pending:
            return None
        seq = self._pending.popleft()
        location = self._where[seq]
        (payload,) = log.read_many([location])
        _, _, frames = _parse(payload, lambda: log.where(*location[:2]))
        return seq, frames

    def close(self) -> None:
        """Close the spool; with nothing left unsettled its segments go too."""
        if self._log is not None and not self._log.closed:
            self._log.close()
            if not self._where:
                for number in self._log.existing():
                    self._log.remove(number)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _parse(payload: memoryview, where: Callable[[], str]) -> tuple[bytes, int, list[bytes]]:
    """(kind, seq, frames) of a record's payload (no frames for a settled
    one), or `SpoolError` naming `where()` (its file and offset) and the rule."""
    length = len(payload)
    kind = bytes(payload[:1])
    if kind == b"S" and length == SETTLED.size:
        return kind, SETTLED.unpack_from(payload)[1], []
    if kind != b"F" or length < FRAME_HEAD.size:
        raise SpoolError(f"{where()}: record kind must be F (frame) or S (settled) of a valid size, "
                         f"got {kind!r} of {length} bytes")
    _, seq, count = FRAME_HEAD.unpack_from(payload)
    frames: list[bytes] = []
    pos = FRAME_HEAD.size
    for _ in range(count):
        if pos + FRAME_LEN.size > length:
            raise SpoolError(f"{where()}: frame record of seq {seq} promises {count} frames but ends after {len(frames)}")
        (size,) = FRAME_LEN.unpack_from(payload, pos)
        pos += FRAME_LEN.size
        frames.append(bytes(payload[pos : pos + size]))
        pos += size
    if pos != length:
        raise SpoolError(f"{where()}: frame record of seq {seq} has {length} payload bytes, its frames account for {pos}")
    return kind, seq, frames
