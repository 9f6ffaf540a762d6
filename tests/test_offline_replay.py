"""Offline replay (consumer/offline.py, `Consumer.from_archive`): a live
run's archive, exported, hands a trainer the same batches again, each
batch's trajectories in order with the content digests the live trainer's
ledger recorded; shuffled, each row once in an order its seed repeats; a
resume from a replay's own checkpoint hands back the same batches first."""
from __future__ import annotations

import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow", reason="offline replay reads a dataset (the archive extra)")

from broker_process import BrokerProcess  # noqa: E402
from consumer_helpers import VOCAB, make_rollout, send_rollouts, train_sealing  # noqa: E402
from waiting import wait_for  # noqa: E402

from rollstream.broker.export import export_archive  # noqa: E402
from rollstream.common.admin import AdminClient  # noqa: E402
from rollstream.common.checker import read_records  # noqa: E402
from rollstream.common.errors import InvalidInput  # noqa: E402
from rollstream.consumer import Consumer  # noqa: E402

STEPS, BATCH = 6, 4


@pytest.fixture(scope="module")
def a_run(tmp_path_factory):
    """A live run: 24 trajectories (groups of 2, supports, forced tokens)
    trained by a checkpointing consumer in 6 steps of 4, sealed each step;
    its run ended, the archive exported. (dataset, run, the live ledger's
    commits by step: [(id, digest)] in batch order)."""
    work = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(53)
    rollouts = [make_rollout(rng, f"t{i:02d}", turns=2, max_len=12, max_support=8) for i in range(STEPS * BATCH)]
    for i, rollout in enumerate(rollouts):
        rollout.group = (f"g{i // 2:02d}", 2)
        rollout.sample_index = i % 2
    archive = work / "archive"
    broker = BrokerProcess(Path(tempfile.mkdtemp(prefix="rso", dir="/tmp")), archive=str(archive), archive_linger=0,
                           heartbeat_interval=0.2).start()
    try:
        send_rollouts(broker.producer, rollouts)
        run, _ = train_sealing(broker.consumer, STEPS, BATCH, ledger=work / "live.jsonl")
        with AdminClient(broker.admin) as admin:
            admin.end_run(run)

        def whole() -> bool:  # every row archived (the counter), and nothing of it left to write or copy
            status = broker.status()
            archive = status.get("archive") or {}
            return (status["counters"].get("archive_rows") == STEPS * BATCH
                    and (archive.get("waiting"), archive.get("writing"), archive.get("lacking")) == (0, 0, 0))

        wait_for(whole, timeout=60, what="the archive to hold the whole run")
    finally:
        broker.__exit__(None, None, None)
        shutil.rmtree(broker.directory, ignore_errors=True)
    exported = export_archive(archive, work / "run.parquet")
    assert (exported.rows, exported.skipped) == (STEPS * BATCH, 0)
    commits: dict[int, list] = defaultdict(list)
    for record in sorted((r for r in read_records([work / "live.jsonl"]) if r["kind"] == "committed"),
                         key=lambda r: (r["step"], r["position"])):
        commits[record["step"]].append((record["id"], record["digest"]))
    assert sorted(commits) == list(range(1, STEPS + 1))
    return work / "run.parquet", run, dict(commits)


def replayed(consumer: Consumer, *, commit_through: int | None = None) -> dict[int, list]:
    """Every batch the consumer hands out, committed (through step `commit_through` only, when given): by step, its
    (id, digest) in batch order."""
    out = {}
    for batch in consumer:
        step = consumer.step_of(batch)
        out[step] = list(zip(batch.trajectory_ids, batch.content_digests()))
        if commit_through is not None and step > commit_through:
            break
        consumer.commit(batch)
    return out


def test_an_exported_run_replays_its_batches_as_the_live_trainer_got_them(a_run):
    dataset, run, commits = a_run
    with Consumer.from_archive(dataset, vocab_size=VOCAB) as consumer:
        assert replayed(consumer) == commits, "every step's trajectories, in order, with the live ledger's digests"
        assert consumer.position.step == STEPS
    with Consumer.from_archive(dataset, run=run, steps=(2, 4), vocab_size=VOCAB) as consumer:
        assert replayed(consumer) == {step: commits[step] for step in (2, 3, 4)}


def test_a_shuffled_replay_holds_each_row_once_in_an_order_its_seed_repeats(a_run):
    dataset, _, commits = a_run
    orders = {}
    for seed in (7, 7, 8):
        with Consumer.from_archive(dataset, order="shuffled", seed=seed, batch_size=6, vocab_size=VOCAB) as consumer:
            batches = replayed(consumer)
        ids = [tid for step in sorted(batches) for tid, _ in batches[step]]
        assert sorted(ids) == sorted(tid for batch in commits.values() for tid, _ in batch), "each row once"
        assert [len(batches[step]) for step in sorted(batches)] == [6, 6, 6, 6]
        for batch in batches.values():  # groups stay whole
            groups = {tid: int(tid[1:]) // 2 for tid, _ in batch}
            assert all(sum(1 for g in groups.values() if g == group) == 2 for group in groups.values())
        digests = {tid: digest for batch in commits.values() for tid, digest in batch}
        assert all(digest == digests[tid] for batch in batches.values() for tid, digest in batch)
        orders.setdefault(seed, []).append(ids)
    assert orders[7][0] == orders[7][1], "the same seed, the same order"
    assert orders[8][0] != orders[7][0], "another seed, another order"


def test_a_resumed_replay_hands_back_the_batches_after_its_checkpoint_first(a_run):
    dataset, _, commits = a_run
    with Consumer.from_archive(dataset, vocab_size=VOCAB) as consumer:
        first = replayed(consumer, commit_through=3)  # trained steps 1-3, checkpointed at 3, took step 4 and died
        consumer.sealed(3)
        state = consumer.state_dict()
    assert sorted(first) == [1, 2, 3, 4] and state["step"] == 3
    with Consumer.from_archive(dataset, vocab_size=VOCAB, resume=state) as consumer:
        again = replayed(consumer)
    assert again == {step: commits[step] for step in (4, 5, 6)} and again[4] == first[4]


def test_a_selection_the_dataset_cannot_give_is_refused_naming_the_rule(a_run, tmp_path):
    dataset, run, _ = a_run
    with pytest.raises(InvalidInput, match=r"no trajectory of job 'default' run 'nope' was trained in .*: expected"):
        Consumer.from_archive(dataset, run="nope")
    with pytest.raises(InvalidInput, match=r"expected an integer seed and batch_size >= 1, got seed=None"):
        Consumer.from_archive(dataset, order="shuffled", batch_size=4)
    with pytest.raises(InvalidInput, match=r"order must be one of \('as_trained', 'shuffled'\), got 'random'"):
        Consumer.from_archive(dataset, order="random")
    with pytest.raises(InvalidInput, match=r"expected a Parquet file or directory at .*, found nothing"):
        Consumer.from_archive(tmp_path / "missing.parquet")


def test_a_distributed_consumer_shards_an_offline_replay(a_run):
    """The replay as a data-parallel trainer takes it: `DistributedConsumer`
    over the offline consumer (a one-rank gloo world here), every shard the
    batch's trajectories with the live ledger's digests, committed."""
    import torch.distributed as dist

    from rollstream.consumer import DistributedConsumer

    dataset, _, commits = a_run
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with Consumer.from_archive(dataset, vocab_size=VOCAB) as client:
            trainer = DistributedConsumer(client)
            got = {}
            for shard in trainer:
                got[client.step_of(shard)] = list(zip(shard.trajectory_ids, shard.content_digests()))
                trainer.commit(shard)
            assert got == commits and client.state_dict()["world_size"] == 1
    finally:
        dist.destroy_process_group()


def test_without_pyarrow_the_replay_and_history_name_the_extra(monkeypatch, tmp_path):
    import sys

    from click.testing import CliRunner

    from rollstream.app.cli import main
    from rollstream.common.errors import ExtraMissing

    monkeypatch.setitem(sys.modules, "pyarrow.dataset", None)  # importing it fails, as where it is not installed
    monkeypatch.setitem(sys.modules, "rollstream.broker.archive", None)
    with pytest.raises(ExtraMissing, match=r"an offline replay .* needs the 'pyarrow' package.*rollstream\[archive\]"):
        Consumer.from_archive(tmp_path / "run.parquet")
    result = CliRunner().invoke(main, ["history", "--archive", str(tmp_path), "--step", "1"])
    assert result.exit_code == 1 and "history over an archive or a data directory needs the 'pyarrow' package" in \
        result.output, result.output


def test_the_context_replay_arrays_go_through_the_archive_and_the_replay(tmp_path):
    """A turn's routed experts (N-D: kept flat beside their shape in the
    dataset) come back to the trainer as the live batch had them: the
    replayed batch's digest, which covers them, is the merged trajectory's."""
    from broker_helpers import end_msg, turn_msg
    from test_archive import archive_all, opened, produce

    from rollstream.broker.engine import TrainedAt
    from rollstream.common.checker import delivered_digest
    from rollstream.common.trajectory import Trajectory, Turn

    experts = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)  # prompt + response tokens, layers, top-k
    store, engine = opened(tmp_path / "data")
    produce(engine, store, [turn_msg("a", 0, [5], [[5, 6]], prompt=(1,), routed_experts=experts), end_msg("a")])
    store.commit(engine.trained("a", TrainedAt("R", "L", 1, 0, 0), 2.0))
    store.commit(engine.end_run("R", 3.0))
    archive_all(tmp_path / "archive", store)
    store.close()
    export_archive(tmp_path / "archive", tmp_path / "run.parquet")
    reference = Trajectory("a", np.array([1], np.int32))
    reference.append_turn(Turn.build([5], [-0.5], supports=[[5, 6]], routed_experts=experts))
    with Consumer.from_archive(tmp_path / "run.parquet", vocab_size=VOCAB) as consumer:
        (batch,) = list(consumer)
    assert batch.content_digests() == [delivered_digest(reference.arrays())]
    assert delivered_digest({**reference.arrays(), "routed_experts": None}) != batch.content_digests()[0], \
        "the digest covers the routed experts"


def test_full_log_probs_go_through_the_dataset_and_the_replay_and_an_older_dataset_replays_without_them(tmp_path):
    """The dataset (schema version 2 on) holds each row's `full_log_probs`,
    null for a row without them; the replayed batch carries them as the
    live one did. A version 1 dataset, which has no such column, replays
    as before."""
    import pyarrow.parquet as pq
    from broker_helpers import end_msg, turn_msg
    from test_archive import archive_all, opened, produce

    from rollstream.broker.archive import DATASET_SCHEMA_KEY
    from rollstream.broker.engine import TrainedAt

    store, engine = opened(tmp_path / "data")
    produce(engine, store, [turn_msg("a", 0, [5], [[5, 6]], forced=[7], prompt=(1,), full_log_probs=[-2.5]),
                            turn_msg("a", 1, [8], [[8]], full_log_probs=[-0.25]), end_msg("a")])
    store.commit(engine.trained("a", TrainedAt("R", "L", 1, 0, 0), 2.0))
    store.commit(engine.end_run("R", 3.0))
    archive_all(tmp_path / "archive", store)
    store.close()
    export_archive(tmp_path / "archive", tmp_path / "run.parquet")
    table = pq.read_table(tmp_path / "run.parquet")
    assert table.column("full_log_probs").to_pylist() == [[-2.5, 0.0, -0.25]]
    assert table.schema.metadata[DATASET_SCHEMA_KEY] == b"3"
    with Consumer.from_archive(tmp_path / "run.parquet", vocab_size=VOCAB) as consumer:
        (batch,) = list(consumer)
    assert batch.full_log_probs.tolist() == [-2.5, 0.0, -0.25]
    older = table.drop_columns(["full_log_probs"])
    pq.write_table(older.replace_schema_metadata({**table.schema.metadata, DATASET_SCHEMA_KEY: b"1"}),
                   tmp_path / "v1.parquet")
    with Consumer.from_archive(tmp_path / "v1.parquet", vocab_size=VOCAB) as consumer:
        (batch,) = list(consumer)
    assert batch.full_log_probs is None and batch.log_probs.tolist() == [-0.5, 0.0, -0.5]


def test_mask_log_probs_go_through_the_dataset_and_the_replay_and_older_datasets_replay_without_them(tmp_path):
    """The dataset (schema version 3) holds each row's `mask_log_probs`
    aligned with its `mask_ids` (0.0 at a forced token's singleton), null
    for a row without them; the replay's deliveries carry them, with the
    digest the producer's turns had. Version 2 and 1 datasets, which have
    no such column, replay as before."""
    import pyarrow.parquet as pq
    from broker_helpers import end_msg, turn_msg
    from test_archive import archive_all, opened, produce

    from rollstream.broker.archive import DATASET_SCHEMA_KEY
    from rollstream.broker.engine import TrainedAt
    from rollstream.common.checker import ContentDigest, delivered_digest, expected, turn_record
    from rollstream.common.codec import decode
    from rollstream.common.messages import BROKER_TO_CONSUMER
    from rollstream.common.wire import trajectory_from_deliver, turn_from_message
    from rollstream.consumer.offline import ArchivedRows, ArchiveServer

    store, engine = opened(tmp_path / "data")
    sent = [turn_msg("a", 0, [5], [[5, 6]], forced=[7], prompt=(1,), mask_log_probs=[-0.25, -2.0]),
            turn_msg("a", 1, [8], [[8, 2, 3]], mask_log_probs=[-0.5, -1.5, -3.0])]
    produce(engine, store, [*sent, end_msg("a"), turn_msg("b", 0, [4], [[4, 1]], prompt=(1,)), end_msg("b", seq=101)])
    store.commit(engine.trained("a", TrainedAt("R", "L", 1, 0, 0), 2.0))
    store.commit(engine.trained("b", TrainedAt("R", "L", 2, 0, 0), 2.0))  # a batch's samples carry it or none do
    store.commit(engine.end_run("R", 3.0))
    archive_all(tmp_path / "archive", store)
    store.close()
    export_archive(tmp_path / "archive", tmp_path / "run.parquet")
    table = pq.read_table(tmp_path / "run.parquet").sort_by("trajectory_id")
    assert table.schema.metadata[DATASET_SCHEMA_KEY] == b"3"
    assert table.column("mask_ids").to_pylist() == [[5, 6, 7, 8, 2, 3], [4, 1]]
    assert table.column("mask_log_probs").to_pylist() == [[-0.25, -2.0, 0.0, -0.5, -1.5, -3.0], None]

    digest, records = ContentDigest(np.array([1], np.int32)), []
    for message in sent:
        record, digest = turn_record(digest, turn_from_message(message))
        records.append(record)
    want = expected(ContentDigest(np.array([1], np.int32)).hexdigest(), records).digest
    server = ArchiveServer(ArchivedRows(tmp_path / "run.parquet"))
    server.answer("hello", {})
    replies = [decode(frames, BROKER_TO_CONSUMER) for frames in server.answer("resume", {"step": 0})]
    delivered = {m["trajectory_id"]: trajectory_from_deliver(m) for m in replies if m.type == "deliver"}
    assert delivered["a"].mask_log_probs.tolist() == [-0.25, -2.0, 0.0, -0.5, -1.5, -3.0]
    assert delivered["b"].mask_log_probs is None and not delivered["b"].carries("mask_log_probs")
    assert delivered_digest(delivered["a"].arrays()) == want

    with Consumer.from_archive(tmp_path / "run.parquet", vocab_size=VOCAB) as consumer:
        assert [list(batch.trajectory_ids) for batch in consumer] == [["a"], ["b"]]
    for version, dropped in ((b"2", ["mask_log_probs"]), (b"1", ["mask_log_probs", "full_log_probs"])):
        older = table.drop_columns(dropped)
        path = tmp_path / f"v{version.decode()}.parquet"
        pq.write_table(older.replace_schema_metadata({**table.schema.metadata, DATASET_SCHEMA_KEY: version}), path)
        rows = ArchivedRows(path)
        replayed = {rows.trajectory_id(row): rows.trajectory(row) for row in range(2)}
        assert replayed["a"].mask.ids.tolist() == [5, 6, 7, 8, 2, 3] and replayed["a"].mask_log_probs is None
        assert replayed["b"].mask_log_probs is None and replayed["a"].full_log_probs is None
        with Consumer.from_archive(path, vocab_size=VOCAB) as consumer:
            batches = list(consumer)
        assert [list(batch.trajectory_ids) for batch in batches] == [["a"], ["b"]]
        assert batches[0].log_probs.tolist() == [-0.5, 0.0, -0.5]
