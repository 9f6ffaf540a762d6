"""An archive disk that fills (a small tmpfs): the broker keeps serving,
keeps every trajectory the archive could not take in its store, says so
(status, counters), and archives them, each once, as soon as there is room
(docs/archive.md)."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from broker_process import BrokerProcess
from consumer_helpers import VOCAB, make_rollout, send_rollouts
from disks import tmpfs
from waiting import wait_for

from rollstream.consumer.client import Consumer

ds = pytest.importorskip("pyarrow.dataset", reason="the archive needs the archive extra (pyarrow)")
pq = pytest.importorskip("pyarrow.parquet")

from rollstream.broker.export import export_archive  # noqa: E402

# A bound on a failing wait on a busy machine, not a timing assertion.
PATIENCE = 120.0
FIRST, LATER = 120, 40  # trajectories committed while the archive fills, then while it is full


def committed_through(consumer: Consumer, n: int) -> list[str]:
    ids: list[str] = []
    while len(ids) < n:
        batch = consumer.next_batch(timeout=PATIENCE, partial_after=1.0)
        consumer.commit(batch)
        ids += batch.trajectory_ids
    consumer.flush(PATIENCE)
    return ids


def archived_ids(root: Path) -> Counter:
    files = [p for p in root.rglob("*.parquet") if not p.name.startswith(".")]
    if not files:
        return Counter()
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table(columns=["trajectory_id"])
    return Counter(table.column("trajectory_id").to_pylist())


@pytest.mark.slow
def test_a_full_archive_disk_leaves_the_broker_serving_and_every_row_kept_until_there_is_room(tmp_path):
    rng = np.random.default_rng(7)
    rollouts = [make_rollout(rng, f"t{i:03d}", turns=2, max_len=64, max_support=32) for i in range(FIRST + LATER)]
    with tmpfs(tmp_path / "archive", "96k") as archive:
        broker = BrokerProcess(Path(tempfile.mkdtemp(prefix="rsf", dir="/tmp")), archive=str(archive),
                               archive_file_rows=8, archive_linger=0, heartbeat_interval=0.2,
                               trajectory_ttl=2).start()
        consumer = None
        try:
            send_rollouts(broker.producer, rollouts[:FIRST])
            consumer = Consumer(broker.consumer, batch_size=20, vocab_size=VOCAB, checkpointed=False)
            committed = committed_through(consumer, FIRST)

            def failing() -> dict | None:
                status = broker.status()
                archive_state = status.get("archive") or {}
                return status if archive_state.get("failing") and archive_state.get("waiting") else None

            status = wait_for(failing, PATIENCE, "the archive to fail for want of room")
            assert "No space left on device" in status["archive"]["failing"], status["archive"]
            assert status["counters"].get("archive_failures", 0) >= 1
            # Still serving: new trajectories are acknowledged, delivered and committed while the archive is full.
            send_rollouts(broker.producer, rollouts[FIRST:])
            committed += committed_through(consumer, LATER)

            def kept() -> bool:  # (the status's archive is as the broker's last housekeeping pass found it)
                return broker.status()["archive"]["waiting"] + sum(archived_ids(archive).values()) == len(committed)

            wait_for(kept, PATIENCE, "every committed trajectory to be archived or waiting for the archive")
            shown = subprocess.run([*broker.command()[:3], "status", "--admin", broker.admin], capture_output=True,
                                   text=True, timeout=60)
            assert "FAILING: OSError" in shown.stdout, shown.stdout + shown.stderr
            # Room again: what waited is archived, each once.
            subprocess.run(["mount", "-o", "remount,size=64m", str(archive)], check=True)
            wait_for(lambda: broker.status().get("archive", {}).get("waiting") == 0, PATIENCE,
                     "the archive to catch up once there is room")
            counts = archived_ids(archive)
            assert set(counts) == set(committed) and set(counts.values()) == {1}, counts
            # The segments holding their records follow (moved across file systems: copied, then deleted).
            wait_for(lambda: broker.status().get("archive", {}).get("lacking") == 0, PATIENCE,
                     "the archive to hold the segments of what it archived")
            assert broker.status()["archive"]["failing"] is None
            exported = export_archive(archive, tmp_path / "dataset.parquet")
            assert exported.skipped == 0 and exported.rows == len(committed)
            sent = {r.trajectory_id: r for r in rollouts}
            for row in pq.read_table(tmp_path / "dataset.parquet", columns=["trajectory_id", "tokens"]).to_pylist():
                assert row["tokens"] == sent[row["trajectory_id"]].merged().arrays()["tokens"].tolist()
        finally:
            if consumer is not None:
                consumer.close()
            broker.__exit__(None, None, None)
            shutil.rmtree(broker.directory, ignore_errors=True)
