"""The archive (broker/archive.py): what the broker deletes is first written
to Parquet files that pyarrow reads as one table (the facts and where each
record lies), durably, once; the segment files holding the records follow
it whole, and `export_archive` turns it into the dataset with every token.

The store and archiver tests drive a `MergeEngine` into a real `Store`
marked for the archive, without sockets; the last test runs a broker
process with `--archive` beside a real producer and consumer."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow", reason="the archive needs the archive extra (pyarrow)")
ds = pytest.importorskip("pyarrow.dataset")
pq = pytest.importorskip("pyarrow.parquet")

from broker_helpers import end_msg, turn_msg  # noqa: E402

from rollstream.broker.archive import (  # noqa: E402
    ARCHIVE_SCHEMA_KEY,
    ARCHIVE_SCHEMA_VERSION,
    ArchiveFailed,
    Archiver,
    archive_stopped,
    segments_of,
)
from rollstream.broker.engine import EngineSettings, MergeEngine, Producer, TrainedAt  # noqa: E402
from rollstream.broker.export import export_archive  # noqa: E402
from rollstream.broker.recovery import rebuild  # noqa: E402
from rollstream.broker.store import Archiving, Store  # noqa: E402
from rollstream.common.jobs import DEFAULT_JOB  # noqa: E402


def opened(path: Path, **archive) -> tuple[Store, MergeEngine]:
    store = Store(path, archive=Archiving(**archive))
    engine = MergeEngine(EngineSettings())
    engine.restore(*rebuild(store.open(), store).engine_state())
    return store, engine


def produce(engine: MergeEngine, store: Store, messages, producer: str = "p0", wall: float = 1.0) -> None:
    for message in messages:
        reply = engine.handle(message, wall, producer=Producer(producer))
        assert reply.error is None, reply.error
        store.commit(list(reply.effects))


def write_all(archiver: Archiver, store: Store, rows: int = 1024) -> list:
    """Hand out every archive file, wait for each, return the outcomes."""
    outcomes = []
    for batch in store.archive_work(rows, archiver.busy):
        archiver.submit(batch)
    while archiver.busy:
        outcomes += archiver.finished()
    return outcomes


def archive_once(root: Path, store: Store, rows: int = 1024) -> list:
    """An archiver under `root` writes every file the store hands out, then stops; the outcomes."""
    archiver = Archiver(root, store.store_id)
    try:
        return write_all(archiver, store, rows)
    finally:
        archiver.close()


def archive_all(root: Path, store: Store, *, copies: bool = True) -> None:
    """Everything the store lets go of into the archive under `root`: its
    files written and their rows deleted, then the segments placed (those
    still in use copied, with `copies`, as when a run ends)."""
    archiver = Archiver(root, store.store_id)
    try:
        archive_stopped(store, archiver, copies=copies)
    finally:
        archiver.close()


def dataset(root: Path, out: Path) -> dict[str, dict]:
    """The archive under `root` exported with every token (`rollstream export --archive`), by trajectory id."""
    exported = export_archive(root, out)
    assert exported.skipped == 0, f"{exported.skipped} rows' records are not in the archive"
    return {row["trajectory_id"]: row for row in pq.read_table(out).to_pylist()}


def read(root: Path) -> dict[str, dict]:
    """Every archived row, by trajectory id, as pyarrow's dataset API reads the Hive-partitioned files."""
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    rows = table.to_pylist()
    by_id = {row["trajectory_id"]: row for row in rows}
    assert len(by_id) == len(rows), f"a trajectory archived twice: {sorted(r['trajectory_id'] for r in rows)}"
    return by_id


def test_a_committed_trajectory_is_archived_whole_then_deleted_and_its_id_stays_remembered(tmp_path):
    store, engine = opened(tmp_path / "data")
    produce(engine, store, [
        turn_msg("t", 0, [10, 11], [[10, 12], [11]], forced=[7, 8], weight_version="step-3", prompt=(1, 2, 3)),
        turn_msg("t", 1, [13], [[13, 14, 15]], weight_version="step-4"),
        end_msg("t", reward=0.5, metadata={"env": "math"}),
    ], wall=1000.0)
    engine.sent("t", 1001.0)
    store.commit(engine.delivered("t", 1002.0))
    assert store.archive_waiting() == 1, "a forgotten trajectory is kept until the archive holds it"
    (outcome,) = archive_once(tmp_path / "archive", store)
    assert outcome.error is None and outcome.rows == 1
    assert outcome.path == tmp_path / "archive" / f"job={DEFAULT_JOB}" / "outcome=delivered" / \
        f"{store.store_id}-{outcome.number:08d}.parquet"
    assert pq.read_schema(outcome.path).metadata[ARCHIVE_SCHEMA_KEY] == str(ARCHIVE_SCHEMA_VERSION).encode()
    facts = read(tmp_path / "archive")["t"]
    assert [(r["turn"], r["segment"], r["at"].timestamp()) for r in facts["records"]] == [(0, 1, 1000.0), (1, 1, 1000.0)]
    assert "tokens" not in facts, "the broker writes the facts and where the records lie, never the payload again"
    store.archived(outcome.number)
    assert store.archive_waiting() == 0
    assert store.segments.to_move == [1] and (tmp_path / "data" / "segments" / "seg-00000001.log").exists(), \
        "the segment holding its records is finished and kept for the archive, not deleted"
    archive_all(tmp_path / "archive", store)
    assert not (tmp_path / "data" / "segments" / "seg-00000001.log").exists()
    assert (segments_of(tmp_path / "archive", store.store_id) / "seg-00000001.log").exists(), "moved whole"
    row = dataset(tmp_path / "archive", tmp_path / "dataset.parquet")["t"]
    assert row["job"] == DEFAULT_JOB and row["run"] is None and row["producer"] == "p0"
    assert row["prompt_tokens"] == [1, 2, 3]
    assert row["tokens"] == [10, 11, 7, 8, 13], "sampled, forced, sampled"
    assert row["loss_mask"] == [1, 1, 0, 0, 1] and row["log_probs"] == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert row["mask_ids"] == [10, 12, 11, 7, 8, 13, 14, 15] and row["mask_offsets"] == [0, 2, 3, 4, 5, 8], \
        "each token's support, a forced one's itself"
    assert row["forced_spans"] == [{"start": 2, "end": 4}]
    assert row["weight_versions"] == ["step-3", "step-4"]
    assert row["weight_version_spans"] == [[{"version": "step-3", "start": 0, "end": 2}],
                                           [{"version": "step-4", "start": 4, "end": 5}]]
    assert (row["reward"], json.loads(row["reward_json"]), json.loads(row["metadata_json"])) == (0.5, 0.5, {"env": "math"})
    assert (row["outcome"], row["status"], row["turns"], row["response_length"]) == ("delivered", "completed", 2, 5)
    assert row["deliveries"] == 1
    assert row["first_turn_at"].timestamp() == 1000.0 and row["first_delivered_at"].timestamp() == 1001.0
    assert row["committed_at"].timestamp() == 1002.0
    store.close()
    store, engine = opened(tmp_path / "data")
    assert "t" in engine.dedup and "t" not in engine.entries, "archived: deleted, its id remembered"
    assert not any(store.segments.live.values()), "its records were let go"
    store.close()


def test_a_trained_trajectory_is_archived_under_its_run_and_lineage_with_its_step_once_a_seal_reclaims_it(tmp_path):
    store, engine = opened(tmp_path / "data")
    produce(engine, store, [turn_msg("a", 0), end_msg("a"), turn_msg("b", 0), end_msg("b")])
    store.commit(engine.trained("a", TrainedAt("run-1", "lin-1", 1, 0, 2), 5.0))
    store.commit(engine.trained("b", TrainedAt("run-1", "lin-1", 2, 0, 2), 6.0))
    store.close()  # what was trained, and at which epoch, is durable before any seal
    store, engine = opened(tmp_path / "data")
    store.commit(engine.seal("run-1", "lin-1", 1, 1, 7.0))
    assert store.archive_waiting() == 1, "the seal of step 1 reclaims what step 1 trained, not step 2"
    (outcome,) = archive_once(tmp_path / "archive", store)
    assert outcome.path.parent == tmp_path / "archive" / f"job={DEFAULT_JOB}" / "outcome=trained"
    (row,) = read(tmp_path / "archive").values()
    assert (row["trajectory_id"], row["run"], row["lineage"], row["epoch"], row["step"], row["position"],
            row["outcome"]) == ("a", "run-1", "lin-1", 2, 1, 0, "trained")
    assert row["committed_at"].timestamp() == 5.0
    filtered = ds.dataset(tmp_path / "archive", format="parquet", partitioning="hive").to_table(
        filter=(ds.field("outcome") == "trained") & (ds.field("run") == "run-1") & (ds.field("step") == 1))
    assert filtered.column("trajectory_id").to_pylist() == ["a"]
    store.close()


def test_a_file_written_again_after_a_crash_replaces_itself_so_no_row_is_lost_or_doubled(tmp_path):
    """Killed after a file was durable but before its rows were deleted:
    the next start hands out the same file number with the same rows."""
    store, engine = opened(tmp_path / "data")
    produce(engine, store, [m for tid in ("a", "b", "c") for m in (turn_msg(tid, 0), end_msg(tid))])
    for tid in ("a", "b", "c"):
        store.commit(engine.delivered(tid, 2.0))
    first = archive_once(tmp_path / "archive", store, rows=2)
    assert sorted(o.rows for o in first) == [1, 2]
    store.archived(first[0].number)  # the other file's delete never happened: the broker died
    store.close()
    torn = first[1].path.with_name(f".{first[1].path.name}.tmp")
    torn.write_bytes(b"PAR1 cut short")  # what a write killed midway leaves: hidden from readers, replaced
    store, engine = opened(tmp_path / "data")
    again = archive_once(tmp_path / "archive", store, rows=2)
    assert [(o.number, o.path, o.rows) for o in again] == [(first[1].number, first[1].path, first[1].rows)]
    store.archived(again[0].number)
    assert sorted(read(tmp_path / "archive")) == ["a", "b", "c"]
    assert not torn.exists() and store.archive_waiting() == 0
    store.close()


def test_an_archive_that_cannot_be_written_keeps_every_row_until_it_can(tmp_path):
    store, engine = opened(tmp_path / "data")
    produce(engine, store, [turn_msg("a", 0), end_msg("a")])
    store.commit(engine.delivered("a", 2.0))
    blocked = tmp_path / "archive"
    blocked.write_text("a file where the archive's directory should be")
    (failed,) = archive_once(blocked, store)
    assert isinstance(failed.error, OSError) and failed.path is None
    assert store.archive_waiting() == 1
    with pytest.raises(ArchiveFailed, match=r"archive file \d+ could not be written: .*"):
        archive_all(blocked, store)  # a stopped store's archiving raises what it could not write
    assert store.archive_waiting() == 1, "what failed stays in the store"
    store.close()
    store, engine = opened(tmp_path / "data")  # a restart meanwhile keeps it too
    assert store.archive_waiting() == 1 and "a" in engine.dedup
    os.unlink(blocked)
    (written,) = archive_once(blocked, store)
    assert written.number == failed.number and written.error is None
    store.archived(written.number)
    assert list(read(blocked)) == ["a"]
    store.close()


def test_pruned_dead_letters_are_archived_with_their_reason_only_when_asked(tmp_path):
    for dead_letters in (False, True):
        path = tmp_path / str(dead_letters)
        store, engine = opened(path / "data", dead_letters=dead_letters)
        produce(engine, store, [turn_msg("d", 0), end_msg("d")])
        store.commit(engine.dead_letter("d", "refused", 3.0))
        effects, gone = engine.prune_dead(0, 4.0)
        store.commit(effects)
        assert gone == {"refused": 1}
        assert store.archive_waiting() == int(dead_letters)
        if dead_letters:
            (outcome,) = archive_once(path / "archive", store)
            row = read(path / "archive")["d"]
            assert (row["outcome"], row["dead_reason"], row["dead_at"].timestamp()) == ("dead", "refused", 3.0)
        store.close()


def test_supports_of_many_rows_stay_each_rows_own():
    """Rows with and without supports side by side: each row's ids and
    offsets are its own (offsets from 0), a row without supports null."""
    from rollstream.broker.archive import dataset_table
    from rollstream.broker.store import StoredTrajectory
    from rollstream.common.trajectory import Trajectory, Turn

    def stored(tid):
        return StoredTrajectory(tid, "ended", None, None, None, 0.0, None, None, None, None, None, None, None)

    with_mask = Trajectory("m", [1])
    with_mask.append_turn(Turn.build([5, 6], [-1.0, -1.0], supports=[[5, 9], [6]]))
    plain = Trajectory("p", [2])
    plain.append_turn(Turn.build([7], [-1.0]))
    again = Trajectory("n", [3])
    again.append_turn(Turn.build([8], [-1.0], supports=[[8, 1, 2]]))
    table = dataset_table([(stored("m"), with_mask), (stored("p"), plain), (stored("n"), again)])
    assert table.column("mask_ids").to_pylist() == [[5, 9, 6], None, [8, 1, 2]]
    assert table.column("mask_offsets").to_pylist() == [[0, 2, 3], None, [0, 3]]
    assert table.column("tokens").to_pylist() == [[5, 6], [7], [8]]
    assert np.array_equal(table.column("prompt_tokens").combine_chunks().values.to_numpy(), [1, 2, 3])


def test_mask_log_probs_of_many_rows_stay_aligned_with_each_rows_mask_ids():
    """Dataset schema version 3: a nullable `mask_log_probs` column of
    float32 lists, each row's one entry per id of its `mask_ids` (0.0 at a
    forced token's singleton); null for a row with supports but without
    them and for a row without supports."""
    from rollstream.broker.archive import DATASET_SCHEMA, DATASET_SCHEMA_KEY, DATASET_SCHEMA_VERSION, dataset_table
    from rollstream.broker.store import StoredTrajectory
    from rollstream.common.trajectory import Trajectory, Turn

    def stored(tid):
        return StoredTrajectory(tid, "ended", None, None, None, 0.0, None, None, None, None, None, None, None)

    carried = Trajectory("c", [1])
    carried.append_turn(Turn.build([5, 6], [-1.0, -1.0], supports=[[5, 9], [6]], forced_tokens=[3],
                                   mask_log_probs=[-1.0, -0.5, -0.25]))
    carried.append_turn(Turn.build([8], [-1.0], supports=[[8, 1, 2]], mask_log_probs=[-0.125, -2.0, -4.0]))
    masked = Trajectory("m", [2])
    masked.append_turn(Turn.build([7], [-1.0], supports=[[7, 4]]))
    plain = Trajectory("p", [3])
    plain.append_turn(Turn.build([7], [-1.0]))
    table = dataset_table([(stored("c"), carried), (stored("m"), masked), (stored("p"), plain)])
    assert DATASET_SCHEMA_VERSION == 3 and table.schema.metadata[DATASET_SCHEMA_KEY] == b"3"
    field = DATASET_SCHEMA.field("mask_log_probs")
    assert field.type == pa.list_(pa.float32()) and field.nullable
    assert table.column("mask_ids").to_pylist() == [[5, 9, 6, 3, 8, 1, 2], [7, 4], None]
    assert table.column("mask_log_probs").to_pylist() == [[-1.0, -0.5, -0.25, 0.0, -0.125, -2.0, -4.0], None, None]
    for ids, values in zip(table.column("mask_ids").to_pylist(), table.column("mask_log_probs").to_pylist()):
        assert values is None or len(values) == len(ids)


def test_an_archived_trajectorys_mask_log_probs_come_back_in_the_export_and_a_gap_at_them_is_named(tmp_path):
    """Merged again from the archived records: the supports' log-probs of
    the turns applied, and a turn without them cut as a replay gap naming
    them."""
    store, engine = opened(tmp_path / "data")
    produce(engine, store, [turn_msg("a", 0, [5], [[5, 6]], forced=[7], mask_log_probs=[-0.25, -2.0]),
                            turn_msg("a", 1, [8], [[8, 2]], mask_log_probs=[-0.5, -1.5]), end_msg("a"),
                            turn_msg("g", 0, [5], [[5, 6]], forced=[7], mask_log_probs=[-0.25, -2.0]),
                            turn_msg("g", 1, [8], [[8, 2]]), end_msg("g", seq=101)])
    for position, tid in enumerate(("a", "g")):
        store.commit(engine.trained(tid, TrainedAt("R", "L", 1, position, 0), 2.0))
    store.commit(engine.end_run("R", 3.0))
    archive_all(tmp_path / "archive", store)
    store.close()
    rows = dataset(tmp_path / "archive", tmp_path / "run.parquet")
    assert rows["a"]["mask_ids"] == [5, 6, 7, 8, 2] and rows["a"]["mask_log_probs"] == [-0.25, -2.0, 0.0, -0.5, -1.5]
    assert (rows["g"]["gap_turn"], rows["g"]["gap_field"]) == (1, "mask_log_probs")
    assert rows["g"]["mask_ids"] == [5, 6] and rows["g"]["mask_log_probs"] == [-0.25, -2.0]


def test_a_live_broker_archives_what_its_trainer_trained_and_sealed_then_the_rest_once_the_run_ends(tmp_path):
    """`rollstream broker --archive DIR`, a producer, a checkpointing
    consumer that seals every step (keeping two checkpoints): what the
    seals reclaim reaches the archive, and `rollstream end-run` brings the
    last step; each trajectory once, with its step and position and the
    tokens it was sent with."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from broker_process import BrokerProcess
    from consumer_helpers import send_rollouts, train_sealing
    from test_consumer_tokens import sized_rollout
    from waiting import wait_for

    archive = tmp_path / "archive"
    broker = BrokerProcess(Path(tempfile.mkdtemp(prefix="rsa", dir="/tmp")), archive=str(archive),
                           archive_linger=0, heartbeat_interval=0.2).start()
    try:
        rollouts = [sized_rollout(f"r{i}", 2, 3 + i) for i in range(6)]
        send_rollouts(broker.producer, rollouts)
        run, trained = train_sealing(broker.consumer, 3, 2, keep_checkpoints=2)
        def archived(expected: set[str], lacking: int | None = None) -> bool:
            state = broker.status().get("archive", {})
            return (state.get("waiting") == 0 and lacking in (None, state.get("lacking")) and archive.exists()
                    and set(read(archive)) == expected)

        # The seal of step 3 reclaims through step 2, the second-latest checkpoint.
        wait_for(lambda: archived({tid for tid, (step, _) in trained.items() if step <= 2}), timeout=60,
                 what="the archive to hold what steps 1 and 2 trained")
        cli = [sys.executable, "-m", "rollstream.app.cli"]
        ended = subprocess.run([*cli, "end-run", "--admin", broker.admin, run], capture_output=True, text=True,
                               timeout=60)
        assert ended.returncode == 0 and "2 trained trajectories reclaimed" in ended.stdout, ended.stdout + ended.stderr
        wait_for(lambda: archived(set(trained), lacking=0), timeout=60,
                 what="the archive to hold the whole run, the records in segments still in use copied")
        reclaimed = set(trained)
        rows = dataset(archive, tmp_path / "dataset.parquet")
        for tid, row in rows.items():
            sent = next(r for r in rollouts if r.trajectory_id == tid)
            assert (row["step"], row["position"], row["epoch"], row["outcome"]) == (*trained[tid], 0, "trained")
            assert row["tokens"] == sent.turns[0].tokens.tolist() and row["prompt_tokens"] == sent.prompt.tolist()
            assert row["producer"] == f"test-{os.getpid()}" and row["deliveries"] == 1
            assert row["committed_at"] >= row["first_delivered_at"] >= row["ended_at"]
        assert broker.status()["counters"].get("archive_rows", 0) == len(reclaimed)
        shown = subprocess.run([*cli, "status", "--admin", broker.admin],
                               capture_output=True, text=True, timeout=60)
        assert "archive              0 waiting, 0 file(s) being written, 0 segment(s) it lacks" in shown.stdout, \
            shown.stdout + shown.stderr
    finally:
        broker.__exit__(None, None, None)
        shutil.rmtree(broker.directory, ignore_errors=True)


def test_duckdb_and_hugging_face_datasets_read_the_archive_and_its_export_as_pyarrow_does(tmp_path):
    """The recipes of docs/archive.md: DuckDB over the Hive-partitioned
    files and over the dataset exported from them, Hugging Face `datasets`
    over both."""
    duckdb = pytest.importorskip("duckdb", reason="reading the archive with DuckDB needs the analysis extra")
    datasets = pytest.importorskip("datasets", reason="reading the archive with datasets needs the analysis extra")
    store, engine = opened(tmp_path / "data")
    produce(engine, store, [turn_msg("a", 0, [5, 6], [[5, 1], [6]]), end_msg("a", reward=1.0),
                            turn_msg("b", 0, [7], [[7]]), end_msg("b", reward=0.0)])
    store.commit(engine.trained("a", TrainedAt("run-1", "lin-1", 1, 0), 5.0))
    store.commit(engine.delivered("b", 6.0))
    store.commit(engine.seal("run-1", "lin-1", 1, 1, 7.0))
    archive_all(tmp_path / "archive", store)
    store.close()
    root, exported = tmp_path / "archive", tmp_path / "dataset.parquet"
    facts = {tid: (row["outcome"], row["step"]) for tid, row in read(root).items()}
    assert facts == {"a": ("trained", 1), "b": ("delivered", None)}
    expected = {tid: (row["outcome"], row["step"], row["tokens"], row["mask_ids"], row["mask_offsets"])
                for tid, row in dataset(root, exported).items()}
    assert expected == {"a": ("trained", 1, [5, 6], [5, 1, 6], [0, 2, 3]), "b": ("delivered", None, [7], [7], [0, 1])}
    found = duckdb.sql(f"SELECT trajectory_id, outcome, step FROM read_parquet('{root}/**/*.parquet', "
                       "hive_partitioning = true) ORDER BY trajectory_id").fetchall()
    assert {tid: (outcome, step) for tid, outcome, step in found} == facts
    trained = duckdb.sql(f"SELECT trajectory_id FROM read_parquet('{root}/**/*.parquet', hive_partitioning = true) "
                         "WHERE outcome = 'trained' AND step = 1").fetchall()
    assert trained == [("a",)]
    found = duckdb.sql(f"SELECT trajectory_id, outcome, step, tokens, mask_ids, mask_offsets FROM read_parquet("
                       f"'{exported}') ORDER BY trajectory_id").fetchall()
    assert {tid: (outcome, step, list(tokens), list(ids), list(offsets)) for tid, outcome, step, tokens, ids, offsets
            in found} == expected
    loaded = datasets.load_dataset("parquet", data_files=f"{root}/**/*.parquet", split="train")
    assert {row["trajectory_id"]: (row["outcome"], row["step"]) for row in loaded} == facts
    loaded = datasets.load_dataset("parquet", data_files=str(exported), split="train")
    assert {row["trajectory_id"]: (row["outcome"], row["step"], row["tokens"], row["mask_ids"], row["mask_offsets"])
            for row in loaded} == expected


def test_ending_a_run_reclaims_all_it_trained_and_refuses_its_resume_afterwards(tmp_path):
    from rollstream.common.errors import RemoteProtocolError

    store, engine = opened(tmp_path / "data")
    produce(engine, store, [m for tid in ("a", "b", "c") for m in (turn_msg(tid, 0), end_msg(tid))])
    for step, tid in enumerate(("a", "b"), start=1):
        store.commit(engine.trained(tid, TrainedAt("run-1", "lin-1", step, 0), 5.0))
    store.commit(engine.trained("c", TrainedAt("run-2", "lin-2", 1, 0), 5.0))
    assert engine.end_run("no-such-run", 6.0) == []
    store.commit(engine.end_run("run-1", 6.0))
    assert store.archive_waiting() == 2 and "c" in engine.trained_entries, "another run's data stays"
    with pytest.raises(RemoteProtocolError, match="checkpoint_gone|reclaimed what the run trained through step 2"):
        engine.resumable("run-1", 1)
    store.close()
    store, engine = opened(tmp_path / "data")
    assert engine.runs["run-1"].reclaimed == 2, "the end is durable"
    store.close()


def test_the_store_hands_out_a_few_files_at_a_time_and_the_same_ones_until_they_are_archived(tmp_path):
    store, engine = opened(tmp_path / "data")
    produce(engine, store, [m for tid in "abcde" for m in (turn_msg(tid, 0), end_msg(tid))])
    for tid in "abcde":
        store.commit(engine.delivered(tid, 2.0))
    handed = store.archive_work(1, files=2)
    assert [batch.ids for batch in handed] == [["a"], ["b"]]
    assert [b.number for b in store.archive_work(1, busy={handed[0].number}, files=2)] == [handed[1].number,
                                                                                          handed[1].number + 1]
    store.archived(handed[0].number)
    assert [b.number for b in store.archive_work(1, files=5)] == [n + handed[0].number for n in (1, 2, 3, 4)]
    store.close()


def test_a_segment_still_in_use_is_copied_when_asked_and_moved_once_no_row_refers_to_it(tmp_path):
    """Two trajectories' records share a segment: the one committed is
    archived while the other is still queued. Without copies, the archive
    lacks its records (export skips the row and says so); a copy (a run
    ended) brings them; once the other goes too, the segment moves whole."""
    store, engine = opened(tmp_path / "data")
    produce(engine, store, [m for tid in ("a", "b") for m in (turn_msg(tid, 0, [5, 6], [[5], [6, 1]]), end_msg(tid))])
    store.commit(engine.delivered("a", 2.0))
    archive_all(tmp_path / "archive", store, copies=False)
    assert store.archive_lacking() == 1 and store.segments.to_move == []
    assert export_archive(tmp_path / "archive", tmp_path / "none.parquet").skipped == 1
    archive_all(tmp_path / "archive", store, copies=True)
    assert store.archive_lacking() == 0
    assert dataset(tmp_path / "archive", tmp_path / "a.parquet")["a"]["mask_ids"] == [5, 6, 1]
    assert (tmp_path / "data" / "segments" / "seg-00000001.log").exists(), "a copy: the store keeps its own"
    store.commit(engine.delivered("b", 3.0))
    archive_all(tmp_path / "archive", store, copies=False)
    assert not (tmp_path / "data" / "segments" / "seg-00000001.log").exists() and store.segments.kept == set()
    assert sorted(dataset(tmp_path / "archive", tmp_path / "ab.parquet")) == ["a", "b"]
    store.close()
    store, engine = opened(tmp_path / "data")
    assert store.segments.kept == set() and store.archive_lacking() == 0, "what the archive took is forgotten durably"
    store.close()


def test_a_segment_moved_before_a_crash_is_found_in_the_archive_at_the_next_start(tmp_path):
    """Killed after a segment's rename but before the store forgot it: the
    next start hands it over again and the archive takes it as placed."""
    from rollstream.broker.archive import place_segment

    store, engine = opened(tmp_path / "data")
    produce(engine, store, [turn_msg("a", 0), end_msg("a")])
    store.commit(engine.delivered("a", 2.0))
    for outcome in archive_once(tmp_path / "archive", store):
        store.archived(outcome.number)
    (handover,) = store.handover()
    place_segment(handover, segments_of(tmp_path / "archive", store.store_id))  # then the broker died
    store.close()
    store, engine = opened(tmp_path / "data")
    assert [h.number for h in store.handover()] == [handover.number]
    archive_all(tmp_path / "archive", store)
    assert store.segments.kept == set()
    assert dataset(tmp_path / "archive", tmp_path / "a.parquet")["a"]["tokens"] == [10]
    store.close()


def test_the_archiver_writes_a_file_without_reading_a_record(tmp_path, monkeypatch):
    """The broker's CPU: archiving never reads, decodes or encodes a payload again."""
    import rollstream.broker.store as store_module

    def refuse(*args):
        raise AssertionError("the archiver read a record")

    store, engine = opened(tmp_path / "data")
    produce(engine, store, [turn_msg("a", 0), end_msg("a")])
    store.commit(engine.delivered("a", 2.0))
    monkeypatch.setattr(store_module, "read_turn_records", refuse)
    monkeypatch.setattr(store_module.Segments, "read_many", refuse)
    (outcome,) = archive_once(tmp_path / "archive", store)
    assert outcome.error is None and outcome.rows == 1
    store.close()


def test_a_file_waits_to_be_fuller_until_it_lingered_or_the_run_ended(tmp_path):
    """Rows fewer than a file's wait `archive_linger` (each file costs the
    broker a fixed amount); a whole file's rows, the linger passed, or a
    run's end (`complete`) hand it out."""
    from rollstream.broker.core import ArchiveStep
    from rollstream.broker.metrics import BrokerMetrics
    from rollstream.broker.store_io import StoreIO

    store, engine = opened(tmp_path / "data")
    archiver = Archiver(tmp_path / "archive", store.store_id)
    io = StoreIO(store, tmp_path / "data", BrokerMetrics(), archiver=archiver, archive_file_rows=3, archive_linger=30.0)

    def step(mono: float, complete: bool = False):
        state = io.archive_step(ArchiveStep(mono, complete))
        while not archiver.settled():
            pass
        return state

    try:
        produce(engine, store, [m for tid in "abcdefg" for m in (turn_msg(tid, 0), end_msg(tid))])
        store.commit(engine.delivered("a", 2.0))
        assert step(100.0).writing == 0 and step(129.0).writing == 0, "one row: it lingers"
        assert step(130.0).writing == 1, "the linger passed"
        assert step(131.0).waiting == 0
        for tid in "bcd":
            store.commit(engine.delivered(tid, 3.0))
        assert step(132.0).writing == 1, "a whole file's rows go at once"
        assert step(133.0).waiting == 0
        store.commit(engine.delivered("e", 4.0))
        assert step(134.0).writing == 0 and step(135.0, complete=True).writing == 1, "a run's end writes at once"
    finally:
        archiver.close()
        store.close()


def test_a_run_of_another_job_is_archived_under_the_name_its_trainer_gave_it(tmp_path):
    """The store keys a job's runs apart (`eval` U+001F `R`); the archive, its
    export and history name the run `R` in job `eval`, as the trainer does."""
    from rollstream.app.history import History
    from rollstream.common.jobs import job_key

    store, engine = opened(tmp_path / "data")
    from rollstream.broker.core import BrokerCore

    produce(engine, store, [BrokerCore.keyed(m) for m in (turn_msg("a", 0, job="eval"), end_msg("a", job="eval"))])
    run = job_key("eval", "R")
    store.commit(engine.trained(job_key("eval", "a"), TrainedAt(run, "L", 1, 0, 0), 2.0))
    store.commit(engine.end_run(run, 3.0))
    archive_all(tmp_path / "archive", store)
    store.close()
    (facts,) = read(tmp_path / "archive").values()
    assert (facts["job"], facts["run"], facts["step"]) == ("eval", "R", 1)
    (row,) = dataset(tmp_path / "archive", tmp_path / "dataset.parquet").values()
    assert (row["job"], row["run"]) == ("eval", "R")
    assert [r["trajectory_id"] for r in History(tmp_path / "archive").step(1, job="eval", run="R")] == ["a"]
