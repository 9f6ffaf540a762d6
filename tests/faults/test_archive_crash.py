"""The archive across broker crashes: a real broker process with
`--archive`, SIGKILLed while it archives what a consumer that deletes on
commit committed, restarted on the same data directory; the archive ends
with every committed trajectory once, its records whole (docs/archive.md:
a file's number is fixed before it is written, so a file cut short or
written but not yet deleted from the store is written again, replacing
itself; a segment moved but not yet forgotten is found moved)."""
from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from broker_process import BrokerProcess
from consumer_helpers import VOCAB, make_rollout, send_rollouts
from waiting import wait_for

from rollstream.consumer.client import Consumer

ds = pytest.importorskip("pyarrow.dataset", reason="the archive needs the archive extra (pyarrow)")
pq = pytest.importorskip("pyarrow.parquet")

from rollstream.broker.export import export_archive  # noqa: E402

# How long a reply or a state may take on a machine running other work: a
# bound on a failing wait, not a timing assertion.
PATIENCE = 120.0
TRAJECTORIES = 300
BATCH = 20  # a divisor of TRAJECTORIES: the last batch is full
KILLS = 3


def archive_rows(root: Path) -> list[dict]:
    """Every row pyarrow's dataset API reads from the Hive-partitioned files
    (it skips hidden names: a file still being written is one)."""
    if not root.exists():
        return []
    dataset = ds.dataset(root, format="parquet", partitioning="hive")
    hidden = [f for f in dataset.files if Path(f).name.startswith(".")]
    assert not hidden, f"a reader must never see a file being written: expected no hidden file read, got {hidden}"
    return dataset.to_table(columns=["trajectory_id", "outcome"]).to_pylist()


def mid_archive(broker: BrokerProcess) -> bool:
    """This broker has archived files since it started (its `archive_rows`
    counter moved), more still wait for the archive and files are handed to
    its writer (being written, or written and their rows not yet deleted):
    it is in the midst of archiving. (The status's `archive` is as its last
    housekeeping pass found it; a broker just started has none until its
    first.)"""
    try:
        status = broker.status(timeout=2.0)
    except TimeoutError:
        return False
    archive = status.get("archive")
    return (archive is not None and archive["waiting"] > 0 and archive["writing"] > 0
            and status["counters"].get("archive_rows", 0) > 0)


@pytest.mark.slow
def test_a_broker_killed_while_it_archives_loses_no_row_and_writes_none_twice(tmp_path):
    """300 trajectories, committed in batches of 20 by a consumer that
    deletes on commit; the archive writes files of 4 rows (at most two a
    housekeeping pass, so it takes many). Three times, once a quarter more
    is committed and the broker has archived some of it and not all, it is
    SIGKILLed and started again on its data directory. At the end every
    committed trajectory is in the archive exactly once, as delivered, and
    no hidden file is left."""
    rng = np.random.default_rng(52)
    rollouts = [make_rollout(rng, f"t{i:03d}", turns=2, max_len=32, max_support=16) for i in range(TRAJECTORIES)]
    archive = tmp_path / "archive"
    # ipc:// paths must stay short: the broker's directory is under /tmp, not pytest's deeper tmp_path.
    broker = BrokerProcess(Path(tempfile.mkdtemp(prefix="rsk", dir="/tmp")), archive=str(archive),
                           archive_file_rows=4, archive_linger=0, heartbeat_interval=0.2, trajectory_ttl=2).start()
    consumer = None
    try:
        send_rollouts(broker.producer, rollouts)  # every turn and end acknowledged durably
        consumer = Consumer(broker.consumer, batch_size=BATCH, vocab_size=VOCAB, checkpointed=False)
        committed: list[str] = []
        hidden_at_kill = []
        while len(set(committed)) < TRAJECTORIES:
            batch = consumer.next_batch(timeout=PATIENCE)
            consumer.commit(batch)
            committed += batch.trajectory_ids
            consumer.flush(PATIENCE)  # the commit is durable: its rows wait for the archive
            kills = len(hidden_at_kill)
            if kills < KILLS and len(set(committed)) >= (kills + 1) * TRAJECTORIES // (KILLS + 1):
                wait_for(lambda: mid_archive(broker), PATIENCE, f"the broker to be archiving (kill {kills + 1})")
                broker.kill()
                hidden_at_kill.append(sorted(p.name for p in archive.rglob(".*")))
                broker.start()
        assert len(hidden_at_kill) == KILLS, f"expected {KILLS} kills while archiving, got {len(hidden_at_kill)}"
        consumer.flush(PATIENCE)
        consumer.close()
        consumer = None

        def archived_all() -> bool:
            status = broker.status()
            return status.get("archive", {}).get("waiting") == 0 and {
                r["trajectory_id"] for r in archive_rows(archive)} >= set(committed)

        wait_for(archived_all, PATIENCE, "the archive to hold every committed trajectory")
        rows = archive_rows(archive)
        twice = sorted(tid for tid, n in Counter(r["trajectory_id"] for r in rows).items() if n > 1)
        assert not twice, f"rule 'each trajectory archived once' broken: expected none twice, got {twice}"
        lost = sorted(set(committed) - {r["trajectory_id"] for r in rows})
        assert not lost, f"rule 'nothing committed is lost' broken: expected every committed one archived, lost {lost}"
        assert {r["trajectory_id"] for r in rows} == set(committed) == {r.trajectory_id for r in rollouts}
        assert {r["outcome"] for r in rows} == {"delivered"}, "deleted on commit: delivered"
        # Every row's records: its segments moved (or copied, a run ended) into the archive, each record whole.
        wait_for(lambda: broker.status().get("archive", {}).get("lacking") == 0, PATIENCE,
                 "the archive to hold the segments of what it archived")
        exported = export_archive(archive, tmp_path / "dataset.parquet")
        assert (exported.rows, exported.skipped) == (TRAJECTORIES, 0)
        sent = {r.trajectory_id: r for r in rollouts}
        for row in pq.read_table(tmp_path / "dataset.parquet", columns=["trajectory_id", "mask_ids"]).to_pylist():
            merged = sent[row["trajectory_id"]].merged()
            assert row["mask_ids"] == merged.arrays()["mask_ids"].tolist(), row["trajectory_id"]
        left = sorted(str(p.relative_to(archive)) for p in archive.rglob(".*"))
        assert not left, f"every file cut short is written again in its place: expected no hidden file left, got {left}"
        print(f"hidden files at each kill: {hidden_at_kill}")
    finally:
        if consumer is not None:
            consumer.close()
        broker.__exit__(None, None, None)
        shutil.rmtree(broker.directory, ignore_errors=True)
