"""What the bench scripts read about their processes, from /proc, and how
they start a broker daemon to measure."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple


def thread_cpu(pid: int, tid: int) -> float:
    """CPU seconds of one thread of a process: from the scheduler's
    nanosecond count where the kernel keeps one (`schedstat`), else user +
    system in clock ticks (10 ms steps, coarse for short reps)."""
    try:
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ProcessTimes(NamedTuple):
    """What a whole process has spent, every thread (those already ended
    too): user and system CPU seconds, and minor page faults (first touches
    of fresh anonymous memory among them)."""

    user: float
    system: float
    minor_faults: int

    @property
    def cpu(self) -> float:
        return self.user + self.system

    def __sub__(self, earlier: ProcessTimes) -> ProcessTimes:
        return ProcessTimes(self.user - earlier.user, self.system - earlier.system,
                            self.minor_faults - earlier.minor_faults)


def process_times(pid: int) -> ProcessTimes:
    """From /proc/<pid>/stat: user and system time in clock ticks (the
    kernel scales them to its nanosecond run time, so they add up to what
    `thread_cpu` counts over all threads), minor faults."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return ProcessTimes(int(fields[11]) / tick, int(fields[12]) / tick, int(fields[7]))


def peak_rss(pid: int) -> int:
    """The process's peak resident set, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class Broker:
    """`rollstream broker` on loopback TCP ports the system picks (read back
    from its endpoints file once it answers), with its own data directory."""

    def __init__(self, vocab_size: int | None, extra_args: list[str] = (), admin_keys: tuple[str, str] | None = None):
        """`admin_keys`: the admin client's own .key_secret and the broker's .key, for a CURVE broker."""
        from rollstream.common.admin import ask_status

        self.data = tempfile.mkdtemp(prefix="rollstream-bench-")
        endpoints_file = str(Path(self.data) / "endpoints.json")
        any_port = "tcp://127.0.0.1:0"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rollstream.app.cli", "broker", "--producer-endpoint", any_port,
             "--consumer-endpoint", any_port, "--admin-endpoint", any_port, "--endpoints-file", endpoints_file,
             "--data-dir", str(Path(self.data) / "data"), "--metrics-port", "0", "--log-level", "warning",
             *(["--vocab-size", str(vocab_size)] if vocab_size else []), *extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.pid = self.process.pid
        try:
            secret, server = admin_keys or (None, None)
            status, _ = ask_status(None, endpoints_file=endpoints_file, wait=60.0, curve_secret_key=secret,
                                   curve_server_key=server)
        except BaseException:
            self.close()
            raise
        self.producer, self.consumer, self.admin = (status["endpoints"][name] for name in ("producer", "consumer", "admin"))

    def close(self) -> None:
        import shutil

        self.process.terminate()
        self.process.wait(60)
        shutil.rmtree(self.data, ignore_errors=True)


def callgrind_counting(on: bool) -> None:
    """Turn callgrind's counting of this process on or off (a process started
    by `callgrind_instructions`)."""
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], check=True,
                   capture_output=True)


def callgrind_instructions(command: list[str], work: str) -> int:
    """The instructions `command` counts between its `callgrind_counting`
    calls, run under `valgrind --tool=callgrind` with counting off at
    start; its profile goes to the folder `work`."""
    done = subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no",
                           f"--callgrind-out-file={work}/callgrind.out", *command],
                          capture_output=True, text=True, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{command[1:3]} under callgrind failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return int(found.group(1))


def parse_args(parser: argparse.ArgumentParser, smoke: dict) -> argparse.Namespace:
    """The arguments, with `--smoke`: the sizes in `smoke` wherever a flag
    is not given, a run that checks the script end to end (its figures
    mean nothing)."""
    sizes = " ".join(f"--{name.replace('_', '-')} {value}" for name, value in smoke.items())
    parser.add_argument("--smoke", action="store_true",
                        help=f"tiny sizes where not given ({sizes}): checks the script end to end; its figures mean nothing")
    if parser.parse_known_args()[0].smoke:
        parser.set_defaults(**smoke)
    return parser.parse_args()
