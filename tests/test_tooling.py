"""The static checks CI relies on, run as the tools themselves: ruff, the
import-linter contracts and mypy, each configured in pyproject.toml."""

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from import_checks import assert_not_loaded

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's scripts, installed by the `test` extra
# Import name -> folder: rollstream.common is common/, and so on.
PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def _run(*command: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run([str(BIN / command[0]), *command[1:]], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{done.stdout}{done.stderr}"


def test_ruff_finds_nothing():
    _run("ruff", "check", "--no-cache", ".")


def test_import_contracts_are_kept():
    _run("lint-imports", "--no-cache")


def test_common_loads_no_torch_at_import():
    """The import contract lets two modules of `common` import torch; this
    checks that they do so inside functions: importing every module of
    `common` leaves torch unloaded."""
    assert_not_loaded(["rollstream.common"], "torch", at_least=11)


def test_only_rollstream_ray_loads_ray():
    """Ray is an optional extra: importing every module of the core
    packages and of the app (the `rollstream` command included) leaves it
    unloaded, even where it is installed."""
    assert_not_loaded([f"rollstream.{name}" for name in ("common", "producer", "broker", "consumer", "app")], "ray",
                      reached="rollstream.app.cli")


@pytest.mark.slow
def test_mypy_finds_nothing(tmp_path):
    # mypy cannot follow package-dir through the editable install: it reads
    # the package through links named as the import path.
    farm = tmp_path / "farm"
    for package, folder in PACKAGE_DIRS.items():
        link = farm.joinpath(*package.split("."))
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(ROOT / folder, target_is_directory=True)
    env = {**os.environ, "MYPYPATH": str(farm)}
    packages = [arg for package in PACKAGE_DIRS for arg in ("-p", package)]
    _run("mypy", "--cache-dir", str(tmp_path / "cache"), *packages, env=env)


# The one place the package reads a clock; everywhere else reads a `Clock`. Every clock the standard library
# offers counts: time's (wall, monotonic, perf_counter, process and thread CPU, their _ns forms, clock_gettime)
# and datetime's now. A file's own times (st_mtime) are data, not a clock read.
CLOCK_MODULE = ROOT / "common" / "clock.py"
_TIME_CLOCKS = r"(?:time|monotonic|perf_counter|process_time|thread_time|clock_gettime)(?:_ns)?"
CLOCK_READS = re.compile(rf"\btime\.{_TIME_CLOCKS}\(|\bfrom time import\b.*\b{_TIME_CLOCKS}\b"
                         r"|\b(?:datetime|date)\.(?:now|utcnow|today)\(")


@pytest.mark.parametrize("line, reads", [
    ("started = time.perf_counter()", True), ("t = time.monotonic_ns()", True), ("now = time.time()", True),
    ("from time import perf_counter, sleep", True), ("cpu = time.process_time()", True),
    ("stamp = datetime.now(timezone.utc)", True), ("day = date.today()", True), ("x = datetime.utcnow()", True),
    ("time.sleep(0.1)", False), ("stamp = os.stat(path).st_mtime_ns", False), ("at = Clock.read().wall", False),
    ("datetime.fromtimestamp(wall, timezone.utc)", False),
])
def test_the_clock_rule_knows_every_clock_read(line, reads):
    assert bool(CLOCK_READS.search(line)) is reads, line


def test_time_is_read_only_through_clock():
    """Wall and monotonic time come from `Clock.read()`, so which clock a
    value is on shows at the call site and a test can stand in for both;
    durations too (`Clock.monotonic()`), and no module reads another clock."""
    reads = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in PACKAGE_DIRS.values()
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != CLOCK_MODULE
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if CLOCK_READS.search(line)
    ]
    assert len(PACKAGE_DIRS) >= 5, PACKAGE_DIRS
    assert not reads, "read the time through common.clock.Clock.read(), not the time module:\n" + "\n".join(reads)
