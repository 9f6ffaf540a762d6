"""`rollstream export` (broker/export.py): the trajectories a data directory
holds, as the archive's rows or as miles payloads, from a stopped store and
from a live broker's without ever writing half a trajectory.

Stores are built by driving a `MergeEngine` into a real `Store`, as
tests/test_archive.py does; the last test exports a broker process's data
directory while a producer writes to it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow", reason="export needs the archive extra (pyarrow)")
pq = pytest.importorskip("pyarrow.parquet")

from broker_helpers import end_msg  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from rollstream.broker import export as export_module  # noqa: E402
from rollstream.broker.cli import export as export_command  # noqa: E402
from rollstream.broker.core import BrokerCore  # noqa: E402
from rollstream.broker.engine import EngineSettings, MergeEngine, Producer, TrainedAt  # noqa: E402
from rollstream.broker.export import Selection, export  # noqa: E402
from rollstream.broker.recovery import rebuild  # noqa: E402
from rollstream.broker.store import SCHEMA_VERSION, Archiving, Store, StoreCorrupted  # noqa: E402
from rollstream.common.codec import decode  # noqa: E402
from rollstream.common.jobs import job_key  # noqa: E402
from rollstream.common.messages import PRODUCER_TO_BROKER  # noqa: E402
from rollstream.common.miles import decode_session_samples  # noqa: E402
from rollstream.common.trajectory import Trajectory, Turn  # noqa: E402
from rollstream.common.wire import encode_turn  # noqa: E402
from rollstream.producer.miles_samples import turns_from_miles_samples  # noqa: E402

VOCAB = 1000


def opened(path: Path, **store) -> tuple[Store, MergeEngine]:
    store_ = Store(path, archive=Archiving(), **store)
    engine = MergeEngine(EngineSettings())
    engine.restore(*rebuild(store_.open(), store_).engine_state())
    return store_, engine


def random_turns(rng: np.random.Generator, count: int, *, versions: bool = False, forced_after_last: bool = False,
                 forced_between: bool = True, support_log_probs: bool = False) -> list[Turn]:
    """Turns whose tokens lie in their supports, forced tokens between them;
    with `support_log_probs`, the sampler's log-prob of every support id."""
    turns = []
    for k in range(count):
        n = int(rng.integers(1, 7))
        tokens = rng.integers(0, VOCAB, n)
        supports = [[int(t), *rng.integers(0, VOCAB, int(rng.integers(0, 4))).tolist()] for t in tokens]
        forced = rng.integers(0, VOCAB, int(rng.integers(1, 4))) \
            if (k < count - 1 and forced_between) or (k == count - 1 and forced_after_last) else None
        ids = sum(map(len, supports))
        turns.append(Turn.build(tokens, -rng.exponential(size=n) - 1e-3, supports=supports, forced_tokens=forced,
                                weight_version=f"v{k}" if versions else None,
                                mask_log_probs=-rng.exponential(size=ids) if support_log_probs else None))
    return turns


class Sent:
    """What a producer sent, and the merged trajectory the store must give back."""

    def __init__(self, engine: MergeEngine, store: Store, tid: str, turns: list[Turn], *, reward=1.0, end: bool = True,
                 job: str | None = None, wall: float = 1000.0, prompt=(1, 2, 3)):
        self.tid, self.turns, self.reward = tid, turns, reward if end else None
        self.merged = Trajectory(tid, prompt)
        for k, turn in enumerate(turns):
            first = {"prompt_tokens": np.array(prompt, np.int32)} if k == 0 else {}
            message = decode(encode_turn(tid, k, turn, seq=k, job=job, **first), PRODUCER_TO_BROKER)
            self._apply(engine, store, message, wall + k)
            assert self.merged.append_turn(turn).applied
        if end:
            self._apply(engine, store, end_msg(tid, reward=reward, job=job), wall + len(turns))
        self.key = tid if job is None else job_key(job, tid)

    @staticmethod
    def _apply(engine: MergeEngine, store: Store, message, wall: float) -> None:
        reply = engine.handle(BrokerCore.keyed(message), wall, producer=Producer("p0"))
        assert reply.error is None, reply.error
        store.commit(list(reply.effects))


def a_store(path: Path) -> dict[str, Sent]:
    """A stopped store with a trajectory in each state export reports."""
    rng = np.random.default_rng(7)
    store, engine = opened(path)
    sent = {tid: Sent(engine, store, tid, random_turns(rng, 3), reward=float(i), wall=1000.0 + 10 * i)
            for i, tid in enumerate(["a", "b", "q", "d", "gone"])}
    sent["o"] = Sent(engine, store, "o", random_turns(rng, 2), end=False, wall=1100.0)
    sent["s"] = Sent(engine, store, "s", random_turns(rng, 1), reward=None, wall=1110.0)
    sent["x"] = Sent(engine, store, "x", random_turns(rng, 2), job="other", wall=1120.0)
    store.commit(engine.trained("a", TrainedAt("run-1", "lin-1", 1, 0), 2000.0))
    store.commit(engine.trained("b", TrainedAt("run-1", "lin-1", 2, 1), 2001.0))
    store.commit(engine.dead_letter("d", "refused", 2002.0))
    store.commit(engine.delivered("gone", 2003.0))  # archiving: committed, kept until the archive holds it
    store.close()
    return sent


OUTCOMES = {"a": "trained", "b": "trained", "q": "queued", "d": "dead", "gone": "delivered", "o": "open",
            "s": "scoring", "x": "queued"}


def rows_of(path: Path) -> dict[str, dict]:
    rows = pq.read_table(path).to_pylist()
    by_id = {row["trajectory_id"]: row for row in rows}
    assert len(by_id) == len(rows), "a trajectory exported twice"
    return by_id


def assert_row_is(row: dict, sent: Sent) -> None:
    merged = sent.merged
    assert row["prompt_tokens"] == merged.prompt_tokens.tolist()
    assert row["tokens"] == merged.tokens.tolist()
    assert row["loss_mask"] == merged.loss_mask.tolist()
    assert row["log_probs"] == merged.log_probs.tolist()
    assert (row["mask_ids"], row["mask_offsets"]) == (merged.mask.ids.tolist(), merged.mask.offsets.tolist())
    assert row["forced_spans"] == [{"start": a, "end": b} for a, b in merged.forced_spans]
    assert row["turns"] == len(sent.turns)
    assert row["reward"] == sent.reward


def test_a_stopped_store_exports_every_trajectory_with_data_as_it_was_sent_with_its_state(tmp_path):
    sent = a_store(tmp_path / "data")
    result = export(tmp_path / "data", tmp_path / "all.parquet")
    assert (result.rows, result.skipped) == (len(sent), 0)
    assert result.nbytes == (tmp_path / "all.parquet").stat().st_size
    assert pq.read_schema(tmp_path / "all.parquet") == export_module.DATASET_SCHEMA
    rows = rows_of(tmp_path / "all.parquet")
    assert {tid: row["outcome"] for tid, row in rows.items()} == OUTCOMES
    for tid, row in rows.items():
        assert_row_is(row, sent[tid])
    assert [(rows[t]["run"], rows[t]["lineage"], rows[t]["step"], rows[t]["position"]) for t in ("a", "b")] == \
        [("run-1", "lin-1", 1, 0), ("run-1", "lin-1", 2, 1)]
    assert rows["q"]["step"] is None and rows["d"]["dead_reason"] == "refused" and rows["x"]["job"] == "other"
    assert rows["o"]["status"] == "completed" and rows["s"]["reward"] is None
    assert sorted(os.listdir(tmp_path)) == ["all.parquet", "data"], "nothing else written beside the output"


@pytest.mark.parametrize("selection, expected", [
    (Selection(trained=True), {"a", "b"}),
    (Selection(steps=(2, 5)), {"b"}),
    (Selection(trained=True, steps=(0, 1)), {"a"}),
    (Selection(queued=True), {"q", "x"}),
    (Selection(dead_letters=True), {"d"}),
    (Selection(queued=True, dead_letters=True), {"q", "x", "d"}),
    (Selection(job="other"), {"x"}),
    (Selection(job="default", queued=True), {"q"}),
    (Selection(since=1110.0), {"s", "x"}),
    (Selection(since=1020.0, trained=True), set()),
    (Selection(since=1012.0, trained=True), {"b"}),
], ids=["trained", "steps", "trained-steps", "queued", "dead", "queued-or-dead", "job", "default-job-queued", "since",
        "since-none", "since-trained"])
def test_each_filter_selects_what_it_names(tmp_path, selection, expected):
    sent = a_store(tmp_path / "data")
    export(tmp_path / "data", tmp_path / "out.parquet", selection)
    rows = rows_of(tmp_path / "out.parquet")
    assert set(rows) == expected
    for tid, row in rows.items():
        assert_row_is(row, sent[tid])


def run_cli(*args: str):
    return CliRunner().invoke(export_command, list(args), catch_exceptions=False)


@pytest.mark.parametrize("args, status, words", [
    (["--steps", "5..2"], 2, ["a step range is A..B", "0 <= A <= B", "got '5..2'"]),
    (["--steps", "one..2"], 2, ["a step range is A..B", "got 'one..2'"]),
    (["--since", "yesterday"], 2, ["ISO-8601", "epoch seconds", "got 'yesterday'"]),
    (["--job", "no job"], 2, ["a job name must match", "got 'no job'"]),
    (["--format", "csv"], 2, ["'csv' is not one of 'parquet', 'miles'"]),
])
def test_a_bad_filter_is_refused_naming_its_rule_expected_and_actual(tmp_path, args, status, words):
    a_store(tmp_path / "data")
    result = run_cli("--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "out.parquet"), *args)
    assert result.exit_code == status, result.output
    for word in words:
        assert word in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out.parquet").exists()


def test_a_bad_path_is_refused_naming_its_rule_expected_and_actual(tmp_path):
    a_store(tmp_path / "data")
    (tmp_path / "empty").mkdir()
    data = str(tmp_path / "data")
    cases = [
        (["--data-dir", str(tmp_path / "empty"), "--out", str(tmp_path / "o.parquet")],
         ["holds state.sqlite and segments/", f"expected a file at {tmp_path / 'empty' / 'state.sqlite'}",
          "found nothing"]),
        (["--data-dir", data, "--out", str(tmp_path / "data" / "o.parquet")],
         ["writes nothing in what it reads", "expected a path outside"]),
        (["--data-dir", data, "--out", str(tmp_path / "missing" / "o.parquet")],
         ["the output's directory must exist", f"expected a directory at {tmp_path / 'missing'}", "found nothing"]),
        (["--data-dir", data, "--out", str(tmp_path / "empty")], ["writes one file", "got the directory"]),
        (["--data-dir", data, "--out", str(tmp_path / "data"), "--format", "miles"],
         ["writes nothing in what it reads"]),
    ]
    for args, words in cases:
        result = run_cli(*args)
        assert result.exit_code == 2, result.output
        for word in words:
            assert word in result.output, result.output
    assert sorted(os.listdir(tmp_path / "data")) == sorted(["LOCK", "segments", "state.sqlite"]), \
        "a refused export writes nothing in the data directory"


def test_a_store_of_another_schema_version_is_refused_naming_both(tmp_path):
    import sqlite3

    a_store(tmp_path / "data")
    db = sqlite3.connect(tmp_path / "data" / "state.sqlite")
    db.execute("UPDATE meta SET value=8 WHERE key='schema_version'")
    db.commit()
    db.close()
    result = run_cli("--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "o.parquet"))
    assert result.exit_code == 1 and f"export reads stores of schema version {SCHEMA_VERSION}, this one has 8" in \
        result.output, result.output


def test_the_miles_format_round_trips_through_decode_session_samples_and_the_replay_merge(tmp_path):
    """Each payload decodes, and the turns the replay source derives from
    it merge into the trajectory that was sent: forced tokens between
    samples, trailing forced tokens inside the last sample's response (loss
    0, each its own support), turns without forced tokens between them
    inside one sample, per-turn weight versions as calls."""
    rng = np.random.default_rng(3)
    store, engine = opened(tmp_path / "data")
    sent = {
        "plain": Sent(engine, store, "plain", random_turns(rng, 3), reward=0.5),
        "versions": Sent(engine, store, "versions", random_turns(rng, 3, versions=True), reward=1.5),
        "trailing": Sent(engine, store, "trailing", random_turns(rng, 2, forced_after_last=True), reward=2.5),
        "adjacent": Sent(engine, store, "adjacent", random_turns(rng, 3, versions=True, forced_between=False),
                         reward={"score": 3}),
        "supported": Sent(engine, store, "supported", random_turns(rng, 3, forced_after_last=True, support_log_probs=True)),
        "supported-adjacent": Sent(engine, store, "supported-adjacent",
                                   random_turns(rng, 3, versions=True, forced_between=False, support_log_probs=True)),
    }
    store.commit(engine.trained("plain", TrainedAt("run-1", "lin-1", 4, 2), 2000.0))
    store.close()
    result = export(tmp_path / "data", tmp_path / "miles", fmt="miles")
    assert result.rows == len(sent)
    files = sorted((tmp_path / "miles").iterdir())
    assert [f.name for f in files] == [f"{i:08d}.safetensors" for i in range(len(sent))]
    assert result.nbytes == sum(f.stat().st_size for f in files)
    for path in files:
        session = decode_session_samples(path.read_bytes())
        meta = session.session_metadata
        expected = sent[meta["trajectory_id"]]
        assert meta["reward"] == expected.reward and meta["job"] == "default"
        converted = turns_from_miles_samples(session.samples, vocab_size=VOCAB)
        assert converted.dropped == 0
        replayed = Trajectory(meta["trajectory_id"], converted.prompt_tokens)
        for turn in converted.turns:
            assert replayed.append_turn(turn).applied
        merged = expected.merged
        assert replayed.prompt_tokens.tolist() == merged.prompt_tokens.tolist()
        for name in ("tokens", "loss_mask", "log_probs"):
            assert getattr(replayed, name).tolist() == getattr(merged, name).tolist(), (meta["trajectory_id"], name)
        assert replayed.mask.ids.tolist() == merged.mask.ids.tolist()
        assert replayed.mask.offsets.tolist() == merged.mask.offsets.tolist()
        if merged.mask_log_probs is None:
            assert replayed.mask_log_probs is None, meta["trajectory_id"]
        else:  # the support's log-probs cross as miles' rollout_sampling_mask.logprobs, byte for byte
            assert replayed.mask_log_probs.tobytes() == merged.mask_log_probs.tobytes(), meta["trajectory_id"]
        assert replayed.weight_versions == merged.weight_versions
        assert replayed.weight_version_spans == merged.weight_version_spans
    by_id = {decode_session_samples(p.read_bytes()).session_metadata["trajectory_id"]: p for p in files}
    plain = decode_session_samples(by_id["plain"].read_bytes())
    assert len(plain.samples) == 3, "a sample per turn"
    assert {k: plain.session_metadata[k] for k in ("outcome", "run", "step", "position")} == \
        {"outcome": "trained", "run": "run-1", "step": 4, "position": 2}
    assert len(decode_session_samples(by_id["adjacent"].read_bytes()).samples) == 1, \
        "turns with no forced tokens between them: one sample, a call per turn"


def test_memory_stays_bounded_the_writer_takes_row_groups_of_at_most_the_chunk(tmp_path, monkeypatch):
    """What the export holds at once is one group of trajectories: the
    writer is handed tables of at most `chunk_rows` rows (or fewer, once
    they hold `chunk_bytes` of records), each one row group of the file."""
    rng = np.random.default_rng(5)
    store, engine = opened(tmp_path / "data")
    for i in range(10):
        Sent(engine, store, f"t{i:02d}", random_turns(rng, 2))
    store.close()
    handed: list[int] = []

    class Recording(pq.ParquetWriter):
        def write_table(self, table, row_group_size=None):
            handed.append(table.num_rows)
            super().write_table(table, row_group_size=row_group_size)

    monkeypatch.setattr(export_module.pq, "ParquetWriter", Recording)
    export(tmp_path / "data", tmp_path / "rows.parquet", chunk_rows=3)
    assert handed == [3, 3, 3, 1]
    metadata = pq.ParquetFile(tmp_path / "rows.parquet").metadata
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [3, 3, 3, 1]
    handed.clear()
    export(tmp_path / "data", tmp_path / "bytes.parquet", chunk_rows=3, chunk_bytes=1)
    assert handed == [1] * 10, "a group closes once it holds chunk_bytes of records"


def test_trajectories_deleted_by_the_live_broker_after_the_snapshot_are_skipped_and_counted_never_written_in_part(
        tmp_path):
    """The live store deletes trajectories (a commit, no archive) once the
    export's snapshot is taken, and their segment files go: the export
    skips exactly those, counts them, and writes the rest whole. A segment
    file missing while a row still refers to it is damage, refused."""
    rng = np.random.default_rng(9)
    store = Store(tmp_path / "data", segment_bytes=1)  # a segment per record: a delete retires its file
    engine = MergeEngine(EngineSettings())
    engine.restore(*rebuild(store.open(), store).engine_state())
    sent = {f"t{i}": Sent(engine, store, f"t{i}", random_turns(rng, 2)) for i in range(6)}
    deleted = ["t1", "t4"]

    def delete_once(done: int, total: int) -> None:
        if done == 0:
            assert total == 6, "the snapshot selected every trajectory before the deletes"
            for tid in deleted:
                store.commit(engine.delivered(tid, 2000.0))
            store.wait_writes()
            assert store.segments.existing() and all(
                not store.segments.path(n).exists() for n in {t.location[0] for tid in deleted
                                                              for t in [*gone[tid].turns]})

    gone = {tid: store.load_one(tid) for tid in deleted}
    result = export(tmp_path / "data", tmp_path / "live.parquet", progress=delete_once)
    assert (result.rows, result.skipped) == (4, 2)
    rows = rows_of(tmp_path / "live.parquet")
    assert set(rows) == set(sent) - set(deleted)
    for tid, row in rows.items():
        assert_row_is(row, sent[tid])
    kept = store.load_one("t2")
    store.close()
    os.unlink(Path(tmp_path / "data" / "segments") / f"seg-{kept.turns[0].location[0]:08d}.log")
    with pytest.raises(StoreCorrupted, match="which are missing while rows still refer to them"):
        export(tmp_path / "data", tmp_path / "damaged.parquet")
    assert not (tmp_path / "damaged.parquet").exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_the_snapshot_lasts_only_its_copy_so_the_broker_checkpoints_its_wal_at_once_while_the_export_reads(tmp_path):
    """Once the selected rows are copied out, the export holds no read of
    the store: a broker's WAL checkpoint that waits for readers (TRUNCATE,
    as a broker near its disk budget runs it) finds none, with no wait."""
    rng = np.random.default_rng(13)
    store, engine = opened(tmp_path / "data")
    for i in range(5):
        Sent(engine, store, f"t{i}", random_turns(rng, 2))
    busy: list[int] = []

    def checkpoint(done: int, total: int) -> None:
        store.db.execute("PRAGMA busy_timeout = 0")
        busy.append(store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0])

    export(tmp_path / "data", tmp_path / "out.parquet", chunk_rows=2, progress=checkpoint)
    store.close()
    assert busy == [0, 0, 0, 0], "every checkpoint went through: no reader held the WAL"


def test_pyarrow_is_imported_only_when_export_runs():
    """`rollstream --help` and the broker's commands load no pyarrow; the
    export command's help neither."""
    code = ("import sys; from click.testing import CliRunner; from rollstream.app.cli import main; "
            "r = CliRunner().invoke(main, ['export', '--help']); assert r.exit_code == 0, r.output; "
            "print('pyarrow' in sys.modules)")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert shown.stdout.strip() == "False", shown.stdout + shown.stderr


def test_export_of_a_live_broker_while_a_producer_writes_gives_only_whole_trajectories(tmp_path):
    """`rollstream export` runs several times as a subprocess against a
    running broker's data directory while a producer streams trajectories
    into it and a consumer that deletes on commit takes them out: every run
    succeeds, and every row it wrote is whole, equal to what was sent for
    that id (an open one: its turns so far). Once both stop, what the store
    holds and what was consumed make up everything that was sent."""
    import shutil
    import tempfile
    import threading

    from broker_process import BrokerProcess
    from consumer_helpers import VOCAB as CONSUMER_VOCAB
    from consumer_helpers import RawProducer, make_rollout
    from waiting import wait_for

    from rollstream.consumer import Consumer

    broker = BrokerProcess(Path(tempfile.mkdtemp(prefix="rse", dir="/tmp")), segment_bytes=1 << 16).start()
    sent: dict = {}
    consumed: set[str] = set()
    stop = threading.Event()
    failures: list[BaseException] = []

    def produce() -> None:
        rng = np.random.default_rng(11)
        producer = RawProducer(broker.producer)
        try:
            while not stop.is_set():
                batch = [make_rollout(rng, f"r{len(sent) + k:05d}", turns=3, max_len=40) for k in range(8)]
                sent.update((r.trajectory_id, r) for r in batch)  # before it is sent: an export may see it at once
                producer.send(batch)
        except BaseException as exc:
            failures.append(exc)
        finally:
            producer.close()

    def consume() -> None:
        try:
            with Consumer(broker.consumer, batch_size=4, vocab_size=CONSUMER_VOCAB, checkpointed=False) as consumer:
                while not stop.is_set():
                    try:
                        batch = consumer.next_batch(timeout=0.2)
                    except TimeoutError:
                        continue
                    consumer.commit(batch)
                    consumed.update(batch.trajectory_ids)
                consumer.flush(30)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=produce, daemon=True), threading.Thread(target=consume, daemon=True)]
    try:
        for thread in threads:
            thread.start()
        for run in range(4):
            wait_for(lambda: len(sent) > 16 * (run + 1) or failures, timeout=60, what="the producer to send more")
            assert not failures, failures
            out = tmp_path / f"run{run}.parquet"
            shown = subprocess.run([sys.executable, "-m", "rollstream.app.cli", "export", "--data-dir",
                                    str(broker.data_dir), "--out", str(out)], capture_output=True, text=True,
                                   timeout=120)
            assert shown.returncode == 0 and shown.stderr == "", shown.stdout + shown.stderr
            assert shown.stdout.startswith("exported "), shown.stdout
            for tid, row in rows_of(out).items():
                rollout = sent[tid]
                turns = row["turns"]
                rollouts_prefix = Trajectory(tid, rollout.prompt)
                for turn in rollout.turns[:turns]:
                    assert rollouts_prefix.append_turn(turn).applied
                assert row["prompt_tokens"] == rollout.prompt.tolist()
                assert row["tokens"] == rollouts_prefix.tokens.tolist(), tid
                assert row["log_probs"] == rollouts_prefix.log_probs.tolist(), tid
                assert row["mask_ids"] == rollouts_prefix.mask.ids.tolist(), tid
                assert row["mask_offsets"] == rollouts_prefix.mask.offsets.tolist(), tid
                if row["outcome"] != "open":  # ended: every turn, with its reward
                    assert turns == len(rollout.turns) and row["reward"] == rollout.reward, tid
        stop.set()
        for thread in threads:
            thread.join(60)
        assert not failures, failures
        final = tmp_path / "final.parquet"
        subprocess.run([sys.executable, "-m", "rollstream.app.cli", "export", "--data-dir", str(broker.data_dir),
                        "--out", str(final)], check=True, capture_output=True, timeout=120)
        held = rows_of(final)
        assert set(held) | consumed == set(sent), "nothing sent is missing from both the store and the trainer"
        assert all(row["outcome"] == "queued" for tid, row in held.items() if tid not in consumed)
    finally:
        stop.set()
        broker.__exit__(None, None, None)
        shutil.rmtree(broker.directory, ignore_errors=True)
