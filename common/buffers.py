"""Growable numpy buffers: appends cost amortised O(appended) because the
capacity doubles, so a 1,000-turn trajectory is never re-concatenated."""
from __future__ import annotations

import numpy as np


class GrowableArray:
    """A 1-D numpy array that grows geometrically on append."""

    __slots__ = ("_buf", "_len")

    def __init__(self, dtype: np.dtype, capacity: int = 0):
        self._buf = np.empty(max(capacity, 16), dtype=dtype)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _grow(self, needed: int) -> None:
        grown = np.empty(max(2 * needed, 2 * len(self._buf)), dtype=self._buf.dtype)
        grown[: self._len] = self._buf[: self._len]
        self._buf = grown

    # The capacity test is inlined in each append: these run several times
    # per frame on the broker's hot path.
    def extend(self, values: np.ndarray) -> None:
        start = self._len
        end = start + len(values)
        if end > len(self._buf):
            self._grow(end)
        self._buf[start:end] = values
        self._len = end

    def extend_shifted(self, values: np.ndarray, shift) -> None:
        """Append `values + shift` without building a temporary."""
        start = self._len
        end = start + len(values)
        if end > len(self._buf):
            self._grow(end)
        np.add(values, shift, out=self._buf[start:end])
        self._len = end

    def extend_fill(self, value, count: int) -> None:
        """Append `count` copies of `value` without building a temporary."""
        start = self._len
        end = start + count
        if end > len(self._buf):
            self._grow(end)
        self._buf[start:end] = value
        self._len = end

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._len:
            raise ValueError(f"truncate length must be in [0, {self._len}], got {length}")
        self._len = length

    @property
    def last(self):
        return self._buf[self._len - 1]

    def view(self) -> np.ndarray:
        """Read-only view of the filled part; valid until the next append or truncate."""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    def copy(self) -> np.ndarray:
        """An owned, read-only copy of the filled part."""
        out = self._buf[: self._len].copy()
        out.flags.writeable = False
        return out

    @property
    def nbytes(self) -> int:
        return self._len * self._buf.itemsize
