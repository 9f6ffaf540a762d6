"""Storage faults (issue 14), against real broker processes on ipc://
endpoints: a disk budget that must slow the pipeline but never stop it, a
disk that really fills, a file-size limit that makes writes fail, and a
damaged store."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from broker_process import BrokerProcess


def rollstream(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollstream.common.cli", *args]


class Processes:
    """Producer daemons and consumers started by a scenario, killed at its end."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, *args: str) -> subprocess.Popen:
        out = open(self.directory / f"{name}.out", "wb")
        err = open(self.directory / f"{name}.log", "wb")
        proc = subprocess.Popen(rollstream(*args), stdout=out, stderr=err)
        self.procs.append(proc)
        return proc

    def producer(self, broker: BrokerProcess, name: str, *args: str) -> subprocess.Popen:
        return self.start(name, "producer", "--broker-endpoint", broker.producer, "--producer-id", name,
                          "--metrics-port", "0", *args)

    def output(self, name: str) -> str:
        return (self.directory / f"{name}.out").read_text() + (self.directory / f"{name}.log").read_text()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.close()


def test_a_disk_budget_slows_the_pipeline_but_never_stops_it(tmp_path, processes):
    """The probe's setup: a 4 MiB disk budget in 256 KiB segments, two
    producers with the default window sending 100-400-token turns, and a
    consumer of batches of 3 that starts 5 s late. Over the budget, with two
    trajectories leased to a consumer that waits for a third, the `end`s
    that would finish the open trajectories must still get in."""
    with BrokerProcess(tmp_path, max_disk_bytes="4MiB", segment_bytes="256KiB") as broker:
        for name in ("p0", "p1"):
            processes.producer(broker, name, "--response-tokens", "250", "--concurrency", "100")
        time.sleep(5)
        consumer = processes.start("consumer", "consume", "--endpoint", broker.consumer, "--batch-size", "3",
                                   "--batches", "30", "--timeout", "60", "--device", "cpu")
        try:
            consumer.wait(300)
        except subprocess.TimeoutExpired:
            pass
        status = broker.status()
        batches = [json.loads(line) for line in (tmp_path / "consumer.out").read_text().splitlines() if line.strip()]
        assert len(batches) == 30, (f"the pipeline stopped after {len(batches)} batches: open {status['open']}, "
                                    f"ready {status['ready']}, leased {status['leased']}, bytes on disk "
                                    f"{status['bytes_on_disk']}\n{processes.output('consumer')[-2000:]}")
        assert "over budget" in broker.log()
