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

from .sockets import free_loopback_ports

VOCAB = 151_936


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollstream.common.cli", *args]


def run_demo(*, producers: int = 2, trajectories: int = 24, turns: int = 3, group_size: int = 4,
             batch_size: int = 4, abort_rate: float = 0.1, keep_data: bool = False) -> str:
    """Run the pipeline once; return the summary. Raises if any stage fails."""
    from rollstream.broker.admin import AdminClient
    from rollstream.consumer import Consumer

    work = Path(tempfile.mkdtemp(prefix="rollstream-demo-"))
    producer_port, consumer_port, admin_port = free_loopback_ports(3)
    endpoints = {name: f"tcp://127.0.0.1:{port}" for name, port in
                 (("producer", producer_port), ("consumer", consumer_port), ("admin", admin_port))}
    log = open(work / "daemons.log", "ab")
    broker = subprocess.Popen(
        _cli("broker", "--producer-endpoint", endpoints["producer"], "--consumer-endpoint", endpoints["consumer"],
             "--admin-endpoint", endpoints["admin"], "--data-dir", str(work / "data"), "--vocab-size", str(VOCAB),
             "--metrics-port", "0", "--log-level", "warning"),
        stdout=log, stderr=log,
    )
    started = time.perf_counter()
    daemons = [broker]
    try:
        with AdminClient(endpoints["admin"], timeout=30.0) as admin:
            admin.status()  # waits until the broker answers
            for i in range(producers):
                daemons.append(subprocess.Popen(
                    _cli("producer", "--source", "synthetic", "--broker-endpoint", endpoints["producer"],
                         "--producer-id", f"demo-producer-{i}", "--trajectories", str(trajectories),
                         "--turns", str(turns), "--group-size", str(group_size), "--abort-rate", str(abort_rate),
                         "--vocab-size", str(VOCAB), "--seed", str(i), "--metrics-port", "0", "--log-level", "warning"),
                    stdout=log, stderr=log,
                ))
            expected = producers * trajectories
            received = tokens = ids = gaps = batches = 0
            with Consumer([endpoints["consumer"]], batch_size=batch_size, unit="group", vocab_size=VOCAB,
                          device="cpu", on_invalid="raise") as consumer:
                while received < expected:
                    batch = consumer.next_batch(timeout=120.0)
                    consumer.commit(batch)
                    batches += 1
                    received += len(batch)
                    tokens += int(batch.response_lengths.sum())
                    ids += int(batch.mask_ids.numel())
                    gaps += sum(gap is not None for gap in batch.gaps)
            for daemon in daemons[1:]:
                if daemon.wait(60) != 0:
                    raise RuntimeError(f"a producer exited with {daemon.returncode}; see {work / 'daemons.log'}")
            status = admin.status()
        seconds = time.perf_counter() - started
    finally:
        for daemon in reversed(daemons):
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(30)
                except subprocess.TimeoutExpired:
                    daemon.kill()
        log.close()
        if not keep_data:
            shutil.rmtree(work, ignore_errors=True)
    counters = status["counters"]
    return "\n".join([
        "rollstream demo: broker + synthetic producers + consumer on loopback",
        f"  producers: {producers}  trajectories: {received} in groups of {group_size}, {turns} turns each",
        f"  batches: {batches} of {batch_size} groups, validated and committed",
        f"  response tokens: {tokens}  support ids: {ids}  replay gaps: {gaps}",
        f"  broker: frames applied {int(counters.get('frames.turn.applied', 0))}, "
        f"delivered {int(counters.get('trajectories.delivered', 0))}, "
        f"open {status['open']}, ready {status['ready']}, dead {status['dead']}",
        f"  valid: yes  time: {seconds:.1f} s" + (f"  data kept in {work}" if keep_data else ""),
    ])
