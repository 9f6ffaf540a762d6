"""Disks the fault tests fill for real."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of `size` at `path`: a disk that really fills. Mounting needs
    root, so elsewhere the test is skipped (the file-size-limit scenario
    below makes writes fail without it)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a disk that really fills) needs root")
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)
