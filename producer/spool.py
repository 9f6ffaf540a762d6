"""The producer's disk spool: frames not yet settled by the broker, on disk,
so a producer that dies and restarts with the same `producer_id` and spool
resends them, and one that cannot reach its broker keeps accepting frames
until the spool's byte budget is used.

Layout of a spool directory:
- `PRODUCER`: the producer id the spool belongs to;
- `LOCK`: held (flock) by the one live producer using the spool;
- `NNNNNNNNNNNNNNNN.seg`: append-only segments of records.

A record is `[u32 payload length][u32 CRC-32 of payload][payload]`, little
endian. Payloads: `F` + u64 seq + u32 frame count + (u32 length + bytes) per
frame (the encoded wire frames, verbatim: no pickle) for a frame, or
`S` + u64 seq when that frame was settled. Segments are deleted oldest first
once every frame in them is settled and the backlog reader is past them. A
torn record at the very end (a crash mid-write) is cut off on open; a bad
record anywhere else is corruption and refuses the open.
"""
from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from rollstream.common.codec import crc32_of

RECORD = struct.Struct("<II")  # payload length, crc32(payload)
FRAME_HEAD = struct.Struct("<cQI")  # b"F", seq, frame count
FRAME_LEN = struct.Struct("<I")
SETTLED = struct.Struct("<cQ")  # b"S", seq
SUFFIX = ".seg"


class SpoolError(RuntimeError):
    """The spool cannot be used (belongs to another producer, is locked, or is
    corrupted); the message names the file and the rule."""


@dataclass
class _Segment:
    path: Path
    size: int
    unsettled: int = 0


def record_bytes(frames: list) -> int:
    """Bytes a frame takes in the spool, framing included."""
    return RECORD.size + FRAME_HEAD.size + sum(FRAME_LEN.size + memoryview(f).nbytes for f in frames)


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
            raise ValueError(f"spool max_bytes must be positive, got {max_bytes}")
        self.directory = Path(directory)
        self.producer_id = producer_id
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or default_segment_bytes(max_bytes)
        if self.segment_bytes > max_bytes // 2:
            raise ValueError(f"segment_bytes must be at most half of max_bytes={max_bytes} (space is freed a segment "
                             f"at a time), got {self.segment_bytes}")
        self.fsync = fsync
        self._segments: dict[int, _Segment] = {}  # by number, oldest first
        self._where: dict[int, int] = {}  # unsettled seq -> segment number
        self._fd: int | None = None  # the segment being appended to
        self._lock_fd: int | None = None
        self._cursor: tuple[int, int] = (0, 0)  # backlog reader: segment number, offset
        self.backlog = 0  # unsettled frames not yet handed out by `next_backlog`
        self.last_seq = 0  # highest seq ever recorded
        self._open()

    # -- opening and recovery -------------------------------------------------
    def _open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SpoolError(f"spool {self.directory} is in use by another live producer (LOCK is held)") from None
        owner_file = self.directory / "PRODUCER"
        if owner_file.exists():
            owner = owner_file.read_text(encoding="utf-8")
            if owner != self.producer_id:
                self.close()
                raise SpoolError(f"spool {self.directory} belongs to producer {owner!r}, not {self.producer_id!r}")
        else:
            owner_file.write_text(self.producer_id, encoding="utf-8")
        numbers = sorted(int(p.stem) for p in self.directory.glob("*" + SUFFIX) if p.stem.isdigit())
        for i, number in enumerate(numbers):
            self._recover(number, last=i == len(numbers) - 1)
        self.backlog = len(self._where)
        if numbers:
            last = numbers[-1]
            self._cursor = (numbers[0], 0) if self.backlog else (last, self._segments[last].size)
            self._fd = os.open(self._path(last), os.O_WRONLY | os.O_APPEND)
        else:
            self._start_segment(0)

    def _path(self, number: int) -> Path:
        return self.directory / f"{number:016d}{SUFFIX}"

    def _recover(self, number: int, last: bool) -> None:
        path = self._path(number)
        data = path.read_bytes()
        segment = _Segment(path, len(data))
        self._segments[number] = segment
        offset = 0
        while offset < len(data):
            parsed = _parse(data, offset)
            if isinstance(parsed, _Bad):
                if not (last and parsed.torn):
                    raise SpoolError(f"spool segment {path} is corrupted at byte {offset}: {parsed.problem}")
                with open(path, "r+b") as f:  # the final write was cut short by a crash
                    f.truncate(offset)
                segment.size = offset
                break
            kind, seq, _, offset = parsed
            self.last_seq = max(self.last_seq, seq)
            if kind == b"F":
                self._where[seq] = number
                segment.unsettled += 1
            elif seq in self._where:
                self._segments[self._where.pop(seq)].unsettled -= 1

    def _start_segment(self, number: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = os.open(self._path(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._segments[number] = _Segment(self._path(number), 0)

    # -- writing ----------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return sum(segment.size for segment in self._segments.values())

    def fits(self, frames: list) -> bool:
        return self.nbytes + record_bytes(frames) <= self.max_bytes

    def append(self, seq: int, frames: list, *, handed_out: bool) -> None:
        """Record a new frame. `handed_out`: the caller keeps it in memory now
        (allowed only with no backlog), so the backlog reader skips it."""
        if seq <= self.last_seq:
            raise ValueError(f"spool seqs must increase: got {seq} after {self.last_seq}")
        if handed_out and self.backlog:
            raise ValueError(f"cannot hand out seq {seq} ahead of {self.backlog} older spooled frames")
        needed = record_bytes(frames)
        if needed > self.max_bytes:
            raise ValueError(f"a frame of {needed} spool bytes exceeds spool_bytes={self.max_bytes}")
        parts = [FRAME_HEAD.pack(b"F", seq, len(frames))]
        for frame in frames:
            parts += [FRAME_LEN.pack(memoryview(frame).nbytes), frame]
        number = self._write(parts)
        self.last_seq = seq
        self._where[seq] = number
        self._segments[number].unsettled += 1
        if handed_out:
            self._cursor = (number, self._segments[number].size)
        else:
            self.backlog += 1

    def settle(self, seq: int) -> None:
        """The broker settled `seq` (acked or refused): it is not resent."""
        number = self._where.pop(seq, None)
        if number is None:
            return
        self._write([SETTLED.pack(b"S", seq)])
        self._segments[number].unsettled -= 1
        self._compact()

    def _write(self, parts: list) -> int:
        payload_len = sum(memoryview(p).nbytes for p in parts)
        header = RECORD.pack(payload_len, crc32_of(parts))
        number = next(reversed(self._segments))
        assert self._fd is not None, "a segment is open from opening the spool until closing it"
        os.writev(self._fd, [header, *parts])
        if self.fsync:
            os.fsync(self._fd)
        self._segments[number].size += RECORD.size + payload_len
        if self._segments[number].size >= self.segment_bytes:
            self._start_segment(number + 1)
        return number

    def _compact(self) -> None:
        """Delete the oldest segments whose frames are all settled and that
        the backlog reader has left behind (never the one being written)."""
        current = next(reversed(self._segments))
        while len(self._segments) > 1:
            number = next(iter(self._segments))
            segment = self._segments[number]
            if number == current or segment.unsettled or number >= self._cursor[0]:
                return
            segment.path.unlink()
            del self._segments[number]

    # -- reading the backlog ------------------------------------------------------
    def next_backlog(self) -> tuple[int, list[bytes]] | None:
        """The oldest unsettled frame not yet handed out, as (seq, frames)."""
        while self.backlog:
            number, offset = self._cursor
            segment = self._segments.get(number)
            if segment is None or offset >= segment.size:
                following = [n for n in self._segments if n > number]
                if not following:
                    raise SpoolError(f"spool {self.directory} lost track of {self.backlog} backlog frame(s)")
                self._cursor = (following[0], 0)
                self._compact()
                continue
            with open(segment.path, "rb") as f:
                f.seek(offset)
                head = f.read(RECORD.size)
                length, _ = RECORD.unpack(head)
                data = head + f.read(length)
            parsed = _parse(data, 0)
            if isinstance(parsed, _Bad):
                raise SpoolError(f"spool segment {segment.path} is corrupted at byte {offset}: {parsed.problem}")
            kind, seq, frames, size = parsed
            self._cursor = (number, offset + size)
            if kind == b"F" and seq in self._where:
                self.backlog -= 1
                return seq, frames
        return None

    def close(self) -> None:
        """Release the spool; with nothing left unsettled its segments go too."""
        if self._fd is not None and not self._where:
            for segment in self._segments.values():
                segment.path.unlink(missing_ok=True)
        for fd in (self._fd, self._lock_fd):
            if fd is not None:
                os.close(fd)
        self._fd = self._lock_fd = None


@dataclass(frozen=True)
class _Bad:
    """Why the bytes at an offset are not a valid record; `torn` when they
    could be a write cut short (the record runs past the end of the file, or
    it is the last one and fails its CRC)."""

    problem: str
    torn: bool


def _parse(data: bytes, offset: int):
    """(kind, seq, frames, next offset) of the record at `offset`, or `_Bad`."""
    if offset + RECORD.size > len(data):
        return _Bad(f"record header needs {RECORD.size} bytes, {len(data) - offset} remain", torn=True)
    length, crc = RECORD.unpack_from(data, offset)
    start, end = offset + RECORD.size, offset + RECORD.size + length
    if end > len(data):
        return _Bad(f"record payload needs {length} bytes, {len(data) - start} remain", torn=True)
    payload = memoryview(data)[start:end]
    actual = crc32_of([payload])
    if actual != crc:
        return _Bad(f"record CRC-32 is {actual}, its header says {crc}", torn=end == len(data))
    kind = bytes(payload[:1])
    if kind == b"S" and length == SETTLED.size:
        return kind, SETTLED.unpack_from(payload)[1], None, end
    if kind != b"F" or length < FRAME_HEAD.size:
        return _Bad(f"record kind must be F (frame) or S (settled) of a valid size, got {kind!r} of {length} bytes", False)
    _, seq, count = FRAME_HEAD.unpack_from(payload)
    frames: list[bytes] = []
    pos = FRAME_HEAD.size
    for _ in range(count):
        if pos + FRAME_LEN.size > length:
            return _Bad(f"frame record of seq {seq} promises {count} frames but ends after {len(frames)}", False)
        (size,) = FRAME_LEN.unpack_from(payload, pos)
        pos += FRAME_LEN.size
        frames.append(bytes(payload[pos : pos + size]))
        pos += size
    if pos != length:
        return _Bad(f"frame record of seq {seq} has {length} payload bytes, its frames account for {pos}", False)
    return kind, seq, frames, end
