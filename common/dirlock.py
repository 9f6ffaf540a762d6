"""One live owner per directory: an exclusive `flock` on `DIR/LOCK`, with
the owner's pid written in it so that a refusal names who holds it.

The kernel drops the lock when its holder exits, however it exits, so a
crashed owner never leaves the directory held; a second process (a double
start, an old child a supervisor lost track of) is refused while the first
lives. The broker's data directory and the producer's spool each take one.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import InvalidState


class DirectoryHeld(InvalidState):
    """Another live process holds the directory (`holder`: its pid, or None
    when it wrote none)."""

    def __init__(self, directory: Path, holder: int | None):
        self.directory, self.holder = directory, holder
        who = "another process" if holder is None else f"process {holder}"
        super().__init__(f"{directory} is held by {who} (its LOCK file is locked): one owner per directory")


def hold(directory: str | os.PathLike) -> int:
    """Lock `directory` (created if missing) for this process; the lock's
    file descriptor, to `os.close` when done. Raises `DirectoryHeld`."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        raise DirectoryHeld(path, int(text) if text.isdigit() else None) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
