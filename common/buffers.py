"""Growable numpy buffers: appends cost amortised O(appended) because the
capacity doubles, so a 1,000-turn trajectory is never re-concatenated."""
from __future__ import annotations

import operator

import numpy as np

from .errors import InvalidInput

_RUNS: dict[tuple, np.ndarray] = {}  # shared read-only runs, by dtype and kind
NBYTES = operator.attrgetter("nbytes")  # an array's (or a buffer's) size in bytes, for `sum(map(NBYTES, ...))`


def _shared_run(key: tuple, count: int) -> np.ndarray:
    """`count` items of the run `key` = (dtype, value) for a constant run,
    (dtype, None) for counting; grown by doubling, never written in place."""
    run = _RUNS.get(key)
    if run is None or len(run) < count:
        dtype, value = key
        n = max(2 * count, 1024)
        run = _RUNS[key] = np.arange(1, n + 1, dtype=dtype) if value is None else np.full(n, value, dtype=dtype)
        run.flags.writeable = False
    return run[:count]


def constant_run(value, count: int, dtype: np.dtype) -> np.ndarray:
    """`count` copies of `value`, read-only: a view of a shared buffer (no
    allocation once the buffer is long enough)."""
    return _shared_run((dtype, value), count)


def counting_run(count: int, dtype: np.dtype) -> np.ndarray:
    """`[1, 2, ..., count]`, read-only, a view of a shared buffer."""
    return _shared_run((dtype, None), count)


def join_contiguous(parts: list, dtype: np.dtype) -> np.ndarray | None:
    """1-D arrays of `dtype` end to end in a new, writable array, joined as
    bytes: for the many small parts of a trajectory or of a batch about
    twice as fast as `np.concatenate`, whose cost is per part. None when a
    part is not contiguous (a strided view is not bytes-like)."""
    try:
        return np.frombuffer(bytearray().join(parts), dtype=dtype)
    except (TypeError, BufferError, ValueError):
        return None


class Pieces(list):
    """An array's pieces in order, not joined, with each piece's CRC-32
    where it is known (`crcs[i]`, None where not): `codec.encode` combines
    a known CRC instead of reading the piece again."""

    __slots__ = ("crcs",)

    def __init__(self, parts, crcs):
        super().__init__(parts)
        self.crcs = crcs

    def large(self, each: int) -> bool:
        """Several pieces, of at least `each` bytes on average: worth sending
        a frame per piece rather than joining them first."""
        return len(self) > 1 and sum(map(NBYTES, self)) >= each * len(self)


class GrowableArray:
    """A 1-D numpy array that grows geometrically on append.

    Appends are queued and written together, in one concatenation, when the
    array is next read or cut: the broker appends several parts per frame
    but reads a trajectory once, at delivery, so most numpy calls move from
    per part to per read. A writable array, or one of another dtype (cast
    as numpy's `same_kind` allows), is copied when appended; a read-only
    one is taken to be frozen (turn arrays are, and so are `constant_run`
    fills). Queued parts therefore always have the buffer's dtype, and a
    lone frozen part written into an empty array becomes its buffer as it
    is (copied only when something is appended after it)."""

    __slots__ = ("_buf", "_len", "_parts", "_shifts", "_crcs", "_queued")

    def __init__(self, dtype: np.dtype, capacity: int = 0):
        self._buf = np.empty(capacity, dtype=dtype)
        self._len = 0
        self._parts: list[np.ndarray] = []
        self._shifts: list | None = None  # per queued part, a value added to it; None while all are 0
        self._crcs: list | None = None  # per queued part, its bytes' CRC-32 or None; None while none is known
        self._queued = 0

    def __len__(self) -> int:
        return self._len + self._queued

    def extend(self, values: np.ndarray) -> None:
        self.extend_many([values])

    def extend_many(self, parts: list, shifts: list | None = None, crcs: list | None = None) -> None:
        """Append each of `parts` in order, plus its entry of `shifts` when
        given (one call for a whole trajectory's pending turns). `crcs`
        gives parts' CRC-32s where known (a verified received frame), kept
        for `parts()` while the part is held as it is."""
        if crcs is not None and self._crcs is None and any(crc is not None for crc in crcs):
            self._crcs = [None] * len(self._parts)
        if self._crcs is not None:
            self._crcs += crcs if crcs is not None else [None] * len(parts)
        if shifts is not None and self._shifts is None:
            if not any(shifts):
                shifts = None
            else:
                self._shifts = [0] * len(self._parts)
        if self._shifts is not None:
            self._shifts += shifts if shifts is not None else [0] * len(parts)
        dtype = self._buf.dtype
        start = len(self._parts)
        self._parts += [part if part.dtype == dtype and not part.flags.writeable else part.astype(dtype, casting="same_kind")
                        for part in parts]
        if self._crcs is not None:  # a converted part's bytes are new
            for i, (given, kept) in enumerate(zip(parts, self._parts[start:]), start):
                if kept is not given:
                    self._crcs[i] = None
        self._queued += sum(map(len, parts))

    def _flush(self) -> None:
        parts = self._parts
        if not parts:
            return
        start, end = self._len, self._len + self._queued
        if start == 0 and len(parts) == 1 and self._shifts is None and not parts[0].flags.writeable:
            self._buf = parts[0]  # one frozen part is the whole array: no copy (a single-turn trajectory)
        elif start == 0 and end > len(self._buf) and self._join(parts):
            pass  # a first write (a trajectory read once): exactly its size
        else:
            if end > len(self._buf) or not self._buf.flags.writeable:  # doubling; or the buffer is a frozen part
                grown = np.empty(max(2 * end, 2 * len(self._buf)), dtype=self._buf.dtype)
                grown[:start] = self._buf[:start]
                self._buf = grown
            np.concatenate(parts, out=self._buf[start:end])
        target = self._buf[start:end]
        if self._shifts is not None:
            target += np.array(self._shifts, dtype=self._buf.dtype).repeat([len(part) for part in parts])
        self._len, self._parts, self._shifts, self._crcs, self._queued = end, [], None, None, 0

    def _join(self, parts: list) -> bool:
        """The parts joined into a new, exactly sized buffer (queued parts
        have the buffer's dtype). False (nothing changed) when a part is not
        contiguous."""
        joined = join_contiguous(parts, self._buf.dtype)
        if joined is None:
            return False
        self._buf = joined
        return True

    def truncate(self, length: int) -> None:
        if not 0 <= length <= len(self):
            raise InvalidInput(f"truncate length must be in [0, {len(self)}], got {length}")
        self._flush()
        self._len = length

    def view(self) -> np.ndarray:
        """Read-only view of the filled part; valid until the next append or truncate."""
        self._flush()
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    def parts(self) -> Pieces:
        """The filled part as read-only pieces, not joined: the queued
        appends themselves while nothing has been written yet (a trajectory
        read once: its turns' own arrays, with the CRCs given for them),
        otherwise `[view()]`."""
        if self._len == 0 and self._shifts is None and len(self._parts) > 1:
            return Pieces(self._parts, self._crcs or [None] * len(self._parts))
        return Pieces([self.view()], [None])

    def copy(self) -> np.ndarray:
        """An owned, read-only copy of the filled part."""
        self._flush()
        out = self._buf[: self._len].copy()
        out.flags.writeable = False
        return out

    @property
    def nbytes(self) -> int:
        return (self._len + self._queued) * self._buf.itemsize
