"""Run a command on a busy machine: N processes spin the CPU for as long as the command runs.

    python tests/load.py N -- COMMAND [ARG...]

Starts N busy processes (each a Python interpreter in a tight loop, at normal
priority, so they compete with the command for the cores), runs COMMAND with
this terminal's stdin, stdout and stderr, then stops the busy processes and
exits with COMMAND's exit status (128 + the signal's number if a signal ended
it). Ctrl-C or SIGTERM stops the command and the busy processes alike.

Used to check that tests wait on conditions rather than on timing: for example
``python tests/load.py 2 -- .venv/bin/python -m pytest tests/faults/test_roles.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import NoReturn

USAGE = "usage: python tests/load.py N -- COMMAND [ARG...]"
SPIN = "while True:\n    pass\n"


def parse(argv: list[str]) -> tuple[int, list[str]]:
    """N and the command from ``N -- COMMAND...``; SystemExit(2) with the usage on anything else."""
    if len(argv) < 3 or argv[1] != "--":
        usage_error(f"expected N, then --, then a command; got {argv!r}")
    busy = int(argv[0]) if argv[0].isdigit() else -1
    if busy < 0:
        usage_error(f"N must be a whole number of busy processes >= 0; got {argv[0]!r}")
    return busy, argv[2:]


def usage_error(message: str) -> NoReturn:
    print(f"{USAGE}\n{message}", file=sys.stderr)
    sys.exit(2)


def exit_status(returncode: int) -> int:
    """A shell's exit status for a child's return code: a signal's negative code becomes 128 + its number."""
    return 128 - returncode if returncode < 0 else returncode


def run_under_load(busy: int, command: list[str]) -> int:
    """Run ``command`` while ``busy`` spinning processes compete for the CPU; its exit status."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL) for _ in range(busy)]
    # SIGTERM to this helper stops everything as Ctrl-C does (the finally clause below).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    child: subprocess.Popen[bytes] | None = None
    try:
        child = subprocess.Popen(command)
        return exit_status(child.wait())
    except FileNotFoundError as error:
        print(f"load.py: cannot run the command {command[0]!r}: {error}", file=sys.stderr)
        return 127
    except KeyboardInterrupt:
        return 130
    finally:
        if child is not None and child.poll() is None:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def main() -> None:
    busy, command = parse(sys.argv[1:])
    sys.exit(run_under_load(busy, command))


if __name__ == "__main__":
    main()
