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
    when it wrote none). The one error for a held directory, whoever holds
    it: `what` names the directory and `owner` its kind of owner in the
    message (a broker's data directory, a producer's spool)."""

    def __init__(self, directory: Path, holder: int | None, *, what: str = "directory", owner: str = "process"):
        self.directory, self.holder = directory, holder
        who = f"another {owner}" + ("" if holder is None else f" (pid {holder})")
        super().__init__(f"{what} {directory} is held by {who}, its LOCK file locked: one {owner} per {what}; "
                         f"stop that one first")


def hold(directory: str | os.PathLike, *, what: str = "directory", owner: str = "process") -> int:
    """Lock `directory` (created if missing) for this process; the lock's
    file descriptor, to `os.close` when done. Raises `DirectoryHeld`
    (`what` and `owner` word its message)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        raise DirectoryHeld(path, int(text) if text.isdigit() else None, what=what, owner=owner) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
