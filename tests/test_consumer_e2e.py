"""The consumer against live broker subprocesses on ipc:// endpoints, fed by
a raw zmq + msgpack producer: complete batches from several brokers,
deduplication after redelivery, a killed consumer losing nothing, broker
restarts, quarantine and whole groups."""
import json
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from consumer_helpers import VOCAB, RawProducer, Rollout, make_rollout
from waiting import wait_for

from rollstream.common.trajectory import Turn
from rollstream.common.validation import RULE_TOKEN_VOCAB, BatchValidationError
from rollstream.consumer import Consumer


def produce(broker, rollouts, **kw):
    producer = RawProducer(broker.producer)
    try:
        producer.send(rollouts, **kw)
    finally:
        producer.close()


def rollouts(prefix, n, seed=0, **kw):
    rng = np.random.default_rng(seed)
    return [make_rollout(rng, f"{prefix}{i}", sample_index=i, **kw) for i in range(n)]


def out_of_vocab_rollout(tid):
    """Valid for a broker that does not know the vocabulary; token 1500 is
    outside the consumer's."""
    turn = Turn.build([1500, 7], [-0.1, -0.2], supports=[[3, 1500], [7]])
    return Rollout(tid, np.array([1, 2], np.int32), [turn], reward=0.0)


def drained(broker):
    status = broker.status()
    return status["queued"] == 0 and status["leased"] == 0


@pytest.mark.slow
def test_fan_in_batches_arrive_complete(brokers):
    nodes = [brokers(), brokers()]
    sent = {}
    for k, node in enumerate(nodes):
        batch = rollouts(f"n{k}-", 10, seed=k)
        produce(node, batch)
        sent.update({r.trajectory_id: r.merged() for r in batch})
    seen = []
    with Consumer([n.consumer for n in nodes], batch_size=5, vocab_size=VOCAB, keep_checkpoints=1) as consumer:
        for _ in range(4):
            batch = consumer.next_batch(timeout=20)
            assert len(batch) == 5 and batch.has_mask
            for i, tid in enumerate(batch.trajectory_ids):
                expected, got = sent[tid], batch.sample(i)
                assert got["tokens"].tolist() == [*expected.prompt_tokens.tolist(), *expected.tokens.tolist()]
                assert got["loss_mask"].tolist() == expected.loss_mask.tolist()
                assert torch.equal(got["log_probs"].cpu(), torch.from_numpy(expected.log_probs.copy()))
                assert got["mask_ids"].tolist() == expected.mask.ids.tolist()
                assert got["mask_offsets"].tolist() == expected.mask.offsets.tolist()
                assert float(batch.rewards[i]) == pytest.approx(expected.reward)
            seen += batch.trajectory_ids
            consumer.commit(batch)
        wait_for(lambda: consumer.stats()["acked"] == 20, what="20 acks")
        assert [node.status()["unsealed"] for node in nodes] == [10, 10]  # trained, kept until sealed
        consumer.sealed(consumer.position.step)  # the only checkpoint kept: what it trained can go
        consumer.flush(20)
    assert sorted(seen) == sorted(sent)
    for node in nodes:
        status = node.status()
        assert drained(node) and status["unsealed"] == 0 and status["counters"]["trajectories.delivered"] == 10


@pytest.mark.slow
def test_redelivered_trajectories_are_seen_once(brokers):
    node = brokers(lease_timeout=1.0)
    produce(node, rollouts("r", 4))
    with Consumer(node.consumer, batch_size=4, vocab_size=VOCAB) as consumer:
        batch = consumer.next_batch(timeout=20)
        wait_for(lambda: consumer.stats()["duplicates"] >= 4, what="redelivery after the lease ran out")
        consumer.commit(batch)
        wait_for(lambda: drained(node) and consumer.stats()["unsettled"] == 0, what="acks")
        stats = consumer.stats()
        # Both leases of each (the expired one and the redelivery's) are answered as settled: by id, once.
        assert stats["acked"] == 8 and stats["committed"] == 4 and stats["stale_leases"] == 0
        with pytest.raises(TimeoutError):
            consumer.next_batch(timeout=1.5)
    assert sorted(batch.trajectory_ids) == ["r0", "r1", "r2", "r3"]


KILLED_CONSUMER = textwrap.dedent("""
    import json, sys, time
    from rollstream.consumer import Consumer
    consumer = Consumer(sys.argv[1], batch_size=4)
    batch = consumer.next_batch(timeout=30)
    print(json.dumps(list(batch.trajectory_ids)), flush=True)
    time.sleep(120)  # holds the batch uncommitted until the test kills it (bounded, should the test not)
""")


@pytest.mark.slow
def test_a_consumer_killed_before_commit_loses_nothing(brokers):
    node = brokers(lease_timeout=60.0)
    batch = rollouts("k", 8)
    produce(node, batch)
    victim = subprocess.Popen([sys.executable, "-c", KILLED_CONSUMER, node.consumer], stdout=subprocess.PIPE)
    try:
        taken = json.loads(victim.stdout.readline())
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()
    assert len(taken) == 4
    collected = []
    with Consumer(node.consumer, batch_size=4) as consumer:
        while len(collected) < 8:
            got = consumer.next_batch(timeout=30)
            collected += got.trajectory_ids
            consumer.commit(got)
        wait_for(lambda: drained(node), what="acks")
    assert sorted(collected) == sorted(r.trajectory_id for r in batch) and set(taken) <= set(collected)
    assert node.dead_letters() == []


@pytest.mark.slow
def test_broker_restart_reconnects_and_nothing_is_trained_twice(brokers):
    node = brokers()
    produce(node, rollouts("a", 4))
    with Consumer(node.consumer, batch_size=4) as consumer:
        first = consumer.next_batch(timeout=20)
        node.kill()
        node.start()
        consumer.commit(first)  # its leases died with the old broker process
        produce(node, rollouts("b", 4, seed=1))
        second = consumer.next_batch(timeout=30)
        consumer.commit(second)
        wait_for(lambda: drained(node) and node.status()["unsealed"] == 8, what="the restarted broker to drain")
        # The commit named its trajectories: the restarted broker settled the first batch by id (any of it
        # redelivered before that was acked by the consumer, not trained).
        assert consumer.stats()["stale_leases"] == 0
    assert sorted(first.trajectory_ids) == ["a0", "a1", "a2", "a3"]
    assert sorted(second.trajectory_ids) == ["b0", "b1", "b2", "b3"]


def test_quarantine_dead_letters_invalid_trajectories_and_refills(brokers):
    node = brokers()
    bad = [out_of_vocab_rollout("bad0"), out_of_vocab_rollout("bad1")]
    good = rollouts("g", 8)
    produce(node, [good[0], bad[0], good[1], bad[1], *good[2:]])
    with Consumer(node.consumer, batch_size=4, vocab_size=VOCAB, on_invalid="quarantine") as consumer:
        batches = [consumer.next_batch(timeout=20) for _ in range(2)]
        for batch in batches:
            assert len(batch) == 4
            consumer.commit(batch)
        wait_for(lambda: drained(node), what="acks")
    assert sorted(t for b in batches for t in b.trajectory_ids) == sorted(r.trajectory_id for r in good)
    letters = {item["trajectory_id"]: item["reason"] for item in node.dead_letters()}
    assert sorted(letters) == ["bad0", "bad1"]
    assert all(RULE_TOKEN_VOCAB in reason and "token 0" in reason for reason in letters.values())


def test_raise_names_the_trajectory_and_gives_the_batch_back(brokers):
    node = brokers()
    produce(node, [*rollouts("g", 3), out_of_vocab_rollout("bad")])
    with Consumer(node.consumer, batch_size=4, vocab_size=VOCAB) as consumer:
        with pytest.raises(BatchValidationError) as err:
            consumer.next_batch(timeout=20)
        assert "bad" in str(err.value) and RULE_TOKEN_VOCAB in str(err.value)
        found = {(v.rule, v.sample, v.position) for v in err.value.violations}
        assert (RULE_TOKEN_VOCAB, 3, 0) in found and {sample for _, sample, _ in found} == {3}
        wait_for(lambda: consumer.stats()["released"] == 4 and consumer.stats()["unsettled"] == 0, what="release")
        with pytest.raises(BatchValidationError):  # redelivered, still invalid
            consumer.next_batch(timeout=20)
    assert node.dead_letters() == []


def test_group_batches_hold_whole_groups(brokers):
    node = brokers()
    rng = np.random.default_rng(9)
    groups = {f"grp{g}": [make_rollout(rng, f"grp{g}-{m}", group=(f"grp{g}", 3)) for m in range(3)] for g in range(4)}
    produce(node, [r for members in groups.values() for r in members], abort=("grp2-1",))
    with Consumer(node.consumer, batch_size=2, unit="group", vocab_size=VOCAB) as consumer:
        batches = [consumer.next_batch(timeout=20) for _ in range(2)]
        for batch in batches:
            consumer.commit(batch)
            assert len(set(batch.group_ids)) == 2
            for gid in set(batch.group_ids):
                members = sorted(t for t, g in zip(batch.trajectory_ids, batch.group_ids) if g == gid)
                expected = sorted(r.trajectory_id for r in groups[gid] if r.trajectory_id != "grp2-1")
                assert members == expected
            assert batch.group_index.tolist() == [sorted(set(batch.group_ids), key=batch.group_ids.index).index(g)
                                                  for g in batch.group_ids]
        wait_for(lambda: drained(node), what="acks")


@pytest.mark.slow
def test_consume_command_prints_one_json_line_per_batch(brokers):
    node = brokers()
    produce(node, rollouts("c", 4))
    result = subprocess.run(
        [sys.executable, "-m", "rollstream.app.cli", "consume", "--endpoint", node.consumer, "--batch-size", "2",
         "--batches", "2", "--timeout", "30", "--vocab-size", str(VOCAB)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["samples"] for line in lines] == [2, 2]
    assert sorted(t for line in lines for t in line["trajectory_ids"]) == ["c0", "c1", "c2", "c3"]
    assert not any("rollout_sampling_mask" in key for line in lines for key in line)
    wait_for(lambda: drained(node), what="acks from the command")
    status = node.status()  # an inspector has no checkpoint: what it acked is gone, not kept as trained
    assert status["unsealed"] == 0 and status["counters"]["trajectories.delivered"] == 4


def versioned(tid, version):
    """A one-turn rollout sampled by weights `version`."""
    turn = Turn.build([5, 6], [-0.1, -0.2], supports=[[5, 1], [6]], weight_version=version)
    return Rollout(tid, np.array([1, 2], np.int32), [turn])


def test_a_published_version_bounds_what_is_delivered_and_what_prefetch_hands_out(tmp_path):
    from broker_process import BrokerProcess

    with BrokerProcess(tmp_path, max_staleness=1, heartbeat_interval=0.2) as broker:
        produce(broker, [versioned("v1", "step-1"), versioned("v2", "step-2"), versioned("v3", "step-3")])
        with Consumer(broker.consumer, batch_size=1, prefetch=4, vocab_size=VOCAB, checkpointed=False) as consumer:
            consumer.set_policy_version(2)  # every one is within 1 of 2: all prefetched
            wait_for(lambda: consumer.stats()["complete"] == 3, what="three prefetched units")
            consumer.set_policy_version(4)  # now v1 and v2 are more than 1 behind, v3 is not
            batch = consumer.next_batch(timeout=10)
            assert batch.trajectory_ids == ("v3",)
            consumer.commit(batch)
            wait_for(lambda: consumer.stats()["stale"] == 2, what="two stale drops")
        wait_for(lambda: broker.status()["dead"] == 2, what="the stale ones dead-lettered")
        assert sorted((d["trajectory_id"], d["reason"]) for d in broker.dead_letters()) == [("v1", "stale"),
                                                                                          ("v2", "stale")]
        assert broker.status()["policies"]["default"]["version"] == 4


def test_two_brokers_each_admit_their_share_of_one_steps_capacity(tmp_path):
    from broker_process import BrokerProcess

    with BrokerProcess(tmp_path / "a", max_staleness=1) as a, BrokerProcess(tmp_path / "b", max_staleness=3) as b:
        with Consumer([a.consumer, b.consumer], batch_size=4, vocab_size=VOCAB, checkpointed=False) as consumer:
            consumer.wait_welcomed(10)
            consumer.set_policy_version(5)
            # capacity = (S + 1) x 4 per step x share 0.5 on each, with each broker's own S (the consumer, which
            # names none, checks what it prefetched against the lowest it heard)
            wait_for(lambda: "policies" in a.status() and "policies" in b.status(), what="both brokers to hear it")
            assert a.status()["policies"]["default"] == {"version": 5, "max_staleness": 1, "capacity": 4, "untrained": 0}
            assert b.status()["policies"]["default"] == {"version": 5, "max_staleness": 3, "capacity": 8, "untrained": 0}


def test_full_log_probs_reach_the_trainer_byte_for_byte_and_the_checker_vouches_for_them(brokers, tmp_path):
    """The producer client sends `full_log_probs` with every turn (one
    trajectory's last turn without them: cut at a replay gap); the trainer's
    batch, its train data and its shards carry exactly the values sent, 0.0
    at forced tokens, and the end-to-end checker finds every commit
    byte-equal to what was acked."""
    import asyncio

    from rollstream.common.checker import check, read_records
    from rollstream.consumer.sharding import partition_batch
    from rollstream.producer import AsyncProducer

    node = brokers()
    rng = np.random.default_rng(5)
    sent: dict[str, np.ndarray] = {}

    async def produce_full():
        async with AsyncProducer(node.producer, "full", ledger=tmp_path / "producer.jsonl") as producer:
            for i in range(4):
                traj = producer.trajectory(f"f{i}", np.array([1, 2], np.int32))
                parts = []
                for index in range(2):
                    tokens = rng.integers(0, VOCAB, 3, dtype=np.int32)
                    full = -rng.exponential(size=3).astype(np.float32)
                    gap = i == 3 and index == 1
                    await traj.turn(tokens, full / 2, supports=[[t] for t in tokens], forced_tokens=[5, 6],
                                    full_log_probs=None if gap else full)
                    if not gap:
                        parts += [full, np.zeros(2, np.float32)]
                sent[f"f{i}"] = np.concatenate(parts[:-1] if i == 3 else parts)  # a gap drops the forced tokens
                await traj.end_and_wait(1.0)

    asyncio.run(produce_full())
    with Consumer(node.consumer, batch_size=4, vocab_size=VOCAB, ledger=tmp_path / "consumer.jsonl") as consumer:
        batch = consumer.next_batch(timeout=20)
        assert batch.full_log_probs is not None and batch.full_log_probs.dtype == torch.float32
        data = batch.to_train_data()
        for i, tid in enumerate(batch.trajectory_ids):
            want = sent[tid].tobytes()
            assert batch.sample(i)["full_log_probs"].cpu().numpy().tobytes() == want
            assert data["rollout_full_log_probs"][i].cpu().numpy().tobytes() == want
        assert batch.gaps[batch.trajectory_ids.index("f3")].field == "full_log_probs"
        for part in partition_batch(batch, 2):
            shard = batch.select(part)
            assert [shard.sample(k)["full_log_probs"].cpu().numpy().tobytes() for k in range(len(shard))] == \
                [sent[batch.trajectory_ids[p]].tobytes() for p in part]
        consumer.commit(batch)
        consumer.flush(20)
    report = check(read_records([tmp_path]), node.dead_letters(), broker_backlog=node.status()["queued"])
    summary = report.summary()
    assert (summary["acked"], summary["committed"], summary["corrupted"], summary["partial"]) == (4, 4, 0, 0), summary


def test_mask_log_probs_reach_the_trainer_byte_for_byte_beside_their_ids_and_the_checker_vouches_for_them(
        brokers, tmp_path):
    """The producer client sends each support's log-probs with every turn
    (renormalised, as it says; one trajectory's last turn without them: cut
    at a replay gap); the trainer's batch, its train data and its shards
    carry exactly the values sent beside each sample's mask ids, 0.0 for a
    forced token's singleton, and the end-to-end checker finds every commit
    byte-equal to what was acked."""
    import asyncio

    from consumer_helpers import log_softmax

    from rollstream.common.checker import check, read_records
    from rollstream.consumer.distributed import decode_shard, encode_shard
    from rollstream.consumer.sharding import partition_batch
    from rollstream.producer import AsyncProducer

    node = brokers()
    rng = np.random.default_rng(6)
    sent: dict[str, np.ndarray] = {}

    async def produce_supports():
        async with AsyncProducer(node.producer, "support", ledger=tmp_path / "producer.jsonl") as producer:
            for i in range(4):
                traj = producer.trajectory(f"m{i}", np.array([1, 2], np.int32))
                parts = []
                for index in range(2):
                    tokens = rng.integers(0, VOCAB - 4, 3, dtype=np.int32)
                    supports = [[int(t), *range(int(t) + 1, int(t) + 1 + int(rng.integers(0, 4)))] for t in tokens]
                    values = [log_softmax(rng.normal(size=len(support))) for support in supports]
                    flat = np.concatenate(values)
                    gap = i == 3 and index == 1
                    await traj.turn(tokens, np.array([v[0] for v in values]), supports=supports, forced_tokens=[5, 6],
                                    mask_log_probs=None if gap else flat, mask_log_probs_normalized=not gap)
                    if not gap:
                        parts += [flat, np.zeros(2, np.float32)]  # a forced token's singleton is certain
                sent[f"m{i}"] = np.concatenate(parts[:-1] if i == 3 else parts)  # a gap drops the forced tokens
                await traj.end_and_wait(1.0)

    asyncio.run(produce_supports())
    with Consumer(node.consumer, batch_size=4, vocab_size=VOCAB, ledger=tmp_path / "consumer.jsonl") as consumer:
        batch = consumer.next_batch(timeout=20)
        assert batch.mask_log_probs is not None and batch.mask_log_probs.dtype == torch.float32
        assert batch.mask_log_probs.shape == batch.mask_ids.shape and batch.full_log_probs is None
        data = batch.to_train_data()
        for i, tid in enumerate(batch.trajectory_ids):
            want = sent[tid].tobytes()
            assert batch.sample(i)["mask_log_probs"].cpu().numpy().tobytes() == want
            assert data["rollout_sampling_mask_log_probs"][i].cpu().numpy().tobytes() == want
            assert data["rollout_sampling_mask_log_probs"][i].shape == data["rollout_sampling_mask_ids"][i].shape
        assert batch.gaps[batch.trajectory_ids.index("m3")].field == "mask_log_probs"
        for part in partition_batch(batch, 2):
            header, payload = encode_shard(batch.select(part))
            shard = decode_shard(header, payload.clone())
            assert [shard.sample(k)["mask_log_probs"].cpu().numpy().tobytes() for k in range(len(shard))] == \
                [sent[batch.trajectory_ids[p]].tobytes() for p in part]
        consumer.commit(batch)
        consumer.flush(20)
    report = check(read_records([tmp_path]), node.dead_letters(), broker_backlog=node.status()["queued"])
    summary = report.summary()
    assert (summary["acked"], summary["committed"], summary["corrupted"], summary["partial"]) == (4, 4, 0, 0), summary
