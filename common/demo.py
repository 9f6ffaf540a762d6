"""The embedded-defaults job: a broker, local synthetic producers and a
training-loop consumer on loopback, end to end, with a one-screen summary.

The broker and the producers run as real daemons (`rollstream broker`,
`rollstream producer`) in subprocesses, exactly as they would on a node; the
consumer runs here, as it would inside a trainer.
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


VOCAB = 151_936


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollstream.common.cli", *args]


class LoopbackNode:
    """A broker on a fresh data directory and producer daemons beside it,
    all on loopback, as the demos run them: `with LoopbackNode(...) as
    node:` starts the broker on ports the system picks and waits until it
    answers (`endpoints` are then the ones it bound); on exit every
    daemon still running is stopped (SIGTERM, then SIGKILL after 30 s) and
    the directory removed unless `keep_data`. The daemons' output goes to
    `daemons.log` in it."""

    def __init__(self, prefix: str, vocab_size: int, *, keep_data: bool = False):
        self.vocab_size = vocab_size
        self.keep_data = keep_data
        self.work = Path(tempfile.mkdtemp(prefix=prefix))
        self.endpoints: dict[str, str] = {}  # as the broker bound them, once it answers
        self._daemons: list[subprocess.Popen] = []
        self._producers: list[subprocess.Popen] = []
        self._log = None
        self.admin = None

    def __enter__(self) -> "LoopbackNode":
        from rollstream.broker.admin import AdminClient, ask_status

        self._log = open(self.work / "daemons.log", "ab")
        endpoints_file = str(self.work / "endpoints.json")
        try:
            any_port = "tcp://127.0.0.1:0"
            self._start("broker", "--producer-endpoint", any_port, "--consumer-endpoint", any_port,
                        "--admin-endpoint", any_port, "--endpoints-file", endpoints_file, "--data-dir",
                        str(self.work / "data"), "--vocab-size", str(self.vocab_size), "--metrics-port", "0",
                        "--log-level", "warning")
            status, _ = ask_status(None, endpoints_file=endpoints_file, wait=30.0)  # once the broker answers
            self.endpoints = status["endpoints"]
            self.admin = AdminClient(self.endpoints["admin"], timeout=30.0).__enter__()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self, *args: str) -> subprocess.Popen:
        daemon = subprocess.Popen(_cli(*args), stdout=self._log, stderr=self._log)
        self._daemons.append(daemon)
        return daemon

    def producer(self, *args: str) -> None:
        """Start a producer daemon of this node with `args`."""
        self._producers.append(self._start("producer", "--broker-endpoint", self.endpoints["producer"],
                                           "--vocab-size", str(self.vocab_size), "--metrics-port", "0",
                                           "--log-level", "warning", *args))

    def finish_producers(self, *, stop: bool = False) -> None:
        """Wait for every producer to exit (after a SIGTERM when `stop`);
        raises if one did not exit cleanly."""
        if stop:
            for daemon in self._producers:
                daemon.send_signal(signal.SIGTERM)
        for daemon in self._producers:
            if daemon.wait(60) != 0:
                raise RuntimeError(f"a producer exited with {daemon.returncode}; see {self.work / 'daemons.log'}")

    def __exit__(self, *exc) -> None:
        if self.admin is not None:
            self.admin.__exit__(None, None, None)
        for daemon in reversed(self._daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(30)
                except subprocess.TimeoutExpired:
                    daemon.kill()
        if self._log is not None:
            self._log.close()
        if not self.keep_data:
            shutil.rmtree(self.work, ignore_errors=True)


def run_demo(*, producers: int = 2, trajectories: int = 24, turns: int = 3, group_size: int = 4,
             batch_size: int = 4, abort_rate: float = 0.1, keep_data: bool = False) -> str:
    """Run the pipeline once; return the summary. Raises if any stage fails."""
    from rollstream.consumer import Consumer

    with LoopbackNode("rollstream-demo-", VOCAB, keep_data=keep_data) as node:
        started = time.perf_counter()
        for i in range(producers):
            node.producer("--source", "synthetic", "--producer-id", f"demo-producer-{i}", "--trajectories",
                          str(trajectories), "--turns", str(turns), "--group-size", str(group_size),
                          "--abort-rate", str(abort_rate), "--seed", str(i))
        expected = producers * trajectories
        received = tokens = ids = gaps = batches = 0
        with Consumer([node.endpoints["consumer"]], batch_size=batch_size, unit="group", vocab_size=VOCAB,
                      device="cpu", on_invalid="raise") as consumer:
            while received < expected:
                batch = consumer.next_batch(timeout=120.0)
                consumer.commit(batch)
                batches += 1
                received += len(batch)
                tokens += int(batch.response_lengths.sum())
                ids += int(batch.mask_ids.numel())
                gaps += sum(gap is not None for gap in batch.gaps)
        node.finish_producers()
        status = node.admin.status()
        seconds = time.perf_counter() - started
    counters = status["counters"]
    return "\n".join([
        "rollstream demo: broker + synthetic producers + consumer on loopback",
        f"  producers: {producers}  trajectories: {received} in groups of {group_size}, {turns} turns each",
        f"  batches: {batches} of {batch_size} groups, validated and committed",
        f"  response tokens: {tokens}  support ids: {ids}  replay gaps: {gaps}",
        f"  broker: frames applied {int(counters.get('frames.turn.applied', 0))}, "
        f"delivered {int(counters.get('trajectories.delivered', 0))}, "
        f"open {status['open']}, ready {status['ready']}, dead {status['dead']}",
        f"  valid: yes  time: {seconds:.1f} s" + (f"  data kept in {node.work}" if keep_data else ""),
    ])
