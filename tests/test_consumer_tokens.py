"""Batches by token budget: the `Assembler`'s budget and the client over a
live broker, the `tokens` sharding strategy and its imbalance, micro-batches
with their `cu_seqlens`, and the collective that gives every rank as many
micro-batches, on a real 2-process gloo group (each rank runs this file as a
script, as tests/test_consumer_distributed.py does)."""
import json
import os
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.common.errors import InvalidInput
from rollstream.consumer import Batch
from rollstream.consumer.assembly import Assembler
from rollstream.consumer.batch import pack_tokens
from rollstream.consumer.sharding import partition, token_imbalance


def sized_arrays(prompt: int, response: int) -> dict:
    return {"prompt_tokens": np.zeros(prompt, np.int32), "tokens": np.zeros(response, np.int32)}


def welcomed(**kw) -> Assembler:
    assembler = Assembler(1, **kw)
    assembler.welcomed(0, 30.0)
    return assembler


def deliver(a: Assembler, tid: str, prompt: int, response: int, **extra) -> None:
    a.delivered(0, {"trajectory_id": tid, "lease": f"L-{tid}", **extra}, sized_arrays(prompt, response), 0.0)


def ids(units) -> list[list[str]]:
    return [sorted(unit.members) for unit in units]


# -- the Assembler's budget ------------------------------------------------------
def test_a_batch_closes_before_the_unit_that_would_pass_the_budget():
    a = welcomed(batch_tokens=10)
    deliver(a, "t1", 1, 2)  # 3 tokens
    deliver(a, "t2", 2, 2)  # 4: 7 so far, and the next may still fit
    assert not a.fills(a.batch_size)
    deliver(a, "t3", 1, 4)  # 5: 12 would pass 10
    assert a.fills(a.batch_size)
    assert ids(a.take(a.batch_size)) == [["t1"], ["t2"]]
    assert not a.fills(a.batch_size)
    deliver(a, "t4", 3, 2)  # 5 + 5 = 10: the budget reached
    assert a.fills(a.batch_size)
    assert ids(a.take(a.batch_size)) == [["t3"], ["t4"]]


def test_a_unit_over_the_budget_comes_alone():
    a = welcomed(batch_tokens=10)
    deliver(a, "small", 1, 1)  # 2
    deliver(a, "big", 4, 8)  # 12, over the budget
    deliver(a, "after", 1, 1)  # 2
    assert ids(a.take(a.batch_size)) == [["small"]]
    assert ids(a.take(a.batch_size)) == [["big"]]
    assert not a.fills(a.batch_size)


def test_groups_are_never_split():
    a = welcomed(batch_tokens=10, unit="group")
    for member in ("a", "b"):
        deliver(a, f"g1-{member}", 2, 2, group_id="g1", group_size=2)  # 8 tokens as a group
    for member in ("a", "b"):
        deliver(a, f"g2-{member}", 1, 2, group_id="g2", group_size=2)  # 6: 14 would pass 10
    assert a.fills(a.batch_size)
    assert ids(a.take(a.batch_size)) == [["g1-a", "g1-b"]]


@pytest.mark.parametrize(("batch_size", "batch_tokens", "expected"), [
    (2, 100, [["t0"], ["t1"]]),  # the unit count comes first
    (5, 8, [["t0"], ["t1"]]),  # the budget comes first: 3 + 3, and 9 would pass 8
])
def test_batch_size_and_batch_tokens_close_at_whichever_comes_first(batch_size, batch_tokens, expected):
    a = welcomed(batch_size=batch_size, batch_tokens=batch_tokens)
    for i in range(3):
        deliver(a, f"t{i}", 1, 2)  # 3 tokens each
    assert a.fills(a.batch_size)
    assert ids(a.take(a.batch_size)) == expected


@pytest.mark.parametrize(("batch_tokens", "units", "prefetch"), [(10_000, 256, 512), (8, 8, 16)])
def test_a_budget_alone_caps_the_units_of_a_batch_and_sizes_the_prefetch(batch_tokens, units, prefetch):
    a = welcomed(batch_tokens=batch_tokens)
    assert (a.batch_size, a.prefetch) == (units, prefetch)
    assert a.credit_grants() == {0: prefetch - units}


def test_a_refill_counts_the_tokens_already_in_the_batch():
    a = welcomed(batch_tokens=10)
    deliver(a, "kept", 3, 3)  # 6, kept after a quarantine removed its neighbours
    (kept,) = a.take(1)
    deliver(a, "t2", 1, 2)  # 3: 9
    deliver(a, "t3", 1, 2)  # 3: 12 would pass 10
    assert a.fills(a.batch_size - 1, [kept])
    assert ids(a.take(a.batch_size - 1, [kept])) == [["t2"]]


def test_a_partial_batch_takes_the_units_that_fit():
    a = welcomed(batch_tokens=10)
    deliver(a, "t1", 1, 2)
    assert not a.fills(a.batch_size)
    assert ids(a.take(a.batch_size)) == [["t1"]]  # what `partial_after` takes


@pytest.mark.parametrize(("limits", "message"), [
    ({"batch_tokens": 0}, "batch_tokens must be an int of at least 1, got 0"),
    ({"batch_tokens": -5, "batch_size": 4}, "batch_tokens must be an int of at least 1, got -5"),
    ({"batch_tokens": True}, "batch_tokens must be an int of at least 1, got True"),
    ({"batch_tokens": 2.5}, "batch_tokens must be an int of at least 1, got 2.5"),
    ({}, "a batch needs a limit: give batch_size (units), batch_tokens (tokens) or both, got neither"),
])
def test_bad_limits_are_refused_naming_the_rule(limits, message):
    with pytest.raises(InvalidInput) as error:
        Assembler(1, **limits)
    assert str(error.value) == message


def test_the_consumer_refuses_a_bad_budget_before_it_connects():
    from rollstream.consumer import Consumer

    with pytest.raises(InvalidInput, match="batch_tokens must be an int of at least 1, got 0"):
        Consumer("tcp://127.0.0.1:9", batch_tokens=0)


# -- the client over a live broker ------------------------------------------------
def sized_rollout(tid: str, prompt: int, response: int, **identity):
    """A one-turn rollout of `prompt` + `response` tokens, each sampled token its own support."""
    from consumer_helpers import Rollout

    from rollstream.common.trajectory import Turn

    tokens = np.arange(1, response + 1)
    turn = Turn.build(tokens, -np.full(response, 0.5), supports=[[int(t)] for t in tokens])
    return Rollout(tid, np.arange(prompt, dtype=np.int32), [turn], **identity)


def test_the_consumer_batches_by_tokens_over_a_live_broker(brokers):
    from consumer_helpers import VOCAB, RawProducer

    from rollstream.consumer import Consumer

    node = brokers()
    sizes = {"r0": (3, 3), "r1": (2, 2), "r2": (3, 4), "r3": (10, 10), "r4": (1, 2)}  # 6, 4, 7, 20, 3 tokens
    producer = RawProducer(node.producer)
    try:
        producer.send([sized_rollout(tid, *size) for tid, size in sizes.items()])
    finally:
        producer.close()
    with Consumer(node.consumer, batch_tokens=12, vocab_size=VOCAB) as consumer:
        assert consumer.batch_size == 12
        got = []
        for _ in range(3):  # 6 + 4 (7 would pass 12); 7 (20 would); 20 alone, over the budget
            batch = consumer.next_batch(timeout=20)
            got.append((batch.trajectory_ids, batch.num_tokens, batch.token_budget, batch.over_budget))
            consumer.commit(batch)
        batch = consumer.next_batch(timeout=20, partial_after=0.2)  # the tail: 3 tokens, never a full batch
        got.append((batch.trajectory_ids, batch.num_tokens, batch.token_budget, batch.over_budget))
        consumer.commit(batch)
        consumer.flush(10)
    assert got == [(("r0", "r1"), 10, 12, False), (("r2",), 7, 12, False), (("r3",), 20, 12, True),
                   (("r4",), 3, 12, False)]


# -- sharding by tokens -----------------------------------------------------------
def test_the_tokens_strategy_gives_a_long_sample_fewer_companions():
    lengths = [100, 10, 10, 10, 10, 10]
    parts = partition(lengths, 2, "tokens")
    assert sorted(map(tuple, parts)) == [(0,), (1, 2, 3, 4, 5)]  # 100 against 50
    balanced = partition(lengths, 2, "balanced")  # equal counts: 120 against 30
    assert sorted(sum(lengths[i] for i in part) for part in balanced) == [30, 120]


@settings(max_examples=300, deadline=None)
@given(weights=st.lists(st.integers(0, 50), min_size=1, max_size=30), ranks=st.integers(1, 8))
def test_the_tokens_strategy_leaves_no_rank_empty_when_it_can(weights, ranks):
    parts = partition(weights, ranks, "tokens")
    assert len(parts) == ranks
    assert sorted(p for part in parts for p in part) == list(range(len(weights)))
    if len(weights) >= ranks:
        assert all(parts)
    sums = [sum(weights[i] for i in part) for part in parts]
    assert max(sums) - min(sums) <= max(weights)


@pytest.mark.parametrize("weights", [[0, 0, 0], [0, 0, 1], [1, 0, 0]])
def test_samples_without_tokens_still_reach_every_rank(weights):
    assert sorted(map(len, partition(weights, 3, "tokens"))) == [1, 1, 1]


def test_fewer_samples_than_ranks_leave_empty_shards():
    assert sorted(map(tuple, partition([7, 3], 3, "tokens"))) == [(), (0,), (1,)]


@pytest.mark.parametrize(("tokens", "expected"), [([30, 10], 1.5), ([50, 40], 50 / 45), ([0, 0], 1.0), ([], 1.0)])
def test_token_imbalance_is_the_most_over_the_mean(tokens, expected):
    assert token_imbalance(tokens) == pytest.approx(expected)


# -- micro-batches ----------------------------------------------------------------
def sized_batch(sizes, seq: int = 0, token_budget: int | None = None) -> Batch:
    from consumer_helpers import delivery

    batch = Batch.from_deliveries([delivery(sized_rollout(f"s{i}", p, r, sample_index=i).merged())
                                   for i, (p, r) in enumerate(sizes)], seq=seq, device="cpu")
    return replace(batch, token_budget=token_budget)


def test_pack_tokens_is_first_fit_decreasing():
    # 9 is over 8: alone. 5 opens a group (3 left), 4 does not fit there and opens another (4 left),
    # 3 fills the first, 2 joins the second.
    assert pack_tokens([5, 3, 4, 2, 9], 8) == [[4], [0, 1], [2, 3]]
    assert pack_tokens([], 8) == []


@pytest.mark.parametrize("max_tokens", [0, -1, True, 1.5])
def test_bad_micro_batch_limits_are_refused(max_tokens):
    with pytest.raises(InvalidInput) as error:
        sized_batch([(1, 1)]).micro_batches(max_tokens)
    assert str(error.value) == f"max_tokens must be an int of at least 1, got {max_tokens!r}"


def test_micro_batches_carry_their_cu_seqlens_and_join_back_into_the_batch():
    from consumer_helpers import assert_same_batch

    batch = sized_batch([(2, 3), (1, 2), (2, 2), (1, 1), (4, 5)])  # 5, 3, 4, 2, 9 tokens
    micro = batch.micro_batches(8, pad_to=5)
    assert [m.positions for m in micro] == [(4,), (0, 1), (2, 3), (), ()]
    assert [m.cu_seqlens.tolist() for m in micro] == [[0, 9], [0, 5, 8], [0, 4, 6], [0], [0]]
    assert all(m.cu_seqlens.dtype == torch.int32 for m in micro)
    assert [m.over_budget for m in micro] == [True, False, False, False, False]
    assert {m.token_budget for m in micro} == {8} and [len(m) for m in micro] == [1, 2, 2, 0, 0]
    joined = Batch.concat(micro)
    assert_same_batch(joined.select(np.argsort(np.array(joined.positions))), batch)


def test_the_token_budget_survives_select_concat_and_the_shard_wire():
    from rollstream.consumer.distributed import decode_shard, encode_shard

    batch = sized_batch([(2, 3), (4, 5)], token_budget=8)  # 5 and 9 tokens
    assert batch.over_budget
    shard = batch.select([0])
    assert (shard.token_budget, shard.over_budget) == (8, False)
    assert Batch.concat([batch.select([1]), shard]).token_budget == 8
    crossed = decode_shard(*encode_shard(batch.select([1]), (9, 5)))
    assert (crossed.token_budget, crossed.over_budget) == (8, True)


# -- every rank as many micro-batches: a 2-process gloo group -----------------------
SHARDED = [[(20, 20), (5, 5), (5, 5), (5, 5), (5, 5), (5, 5)], [(15, 15)]]  # 40, 10 x 5; then 30 alone


class StandIn:
    """What `DistributedConsumer` needs from a `Consumer`: `SHARDED`'s batches, then closed."""

    checkpointed = False

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.batches = [sized_batch(sizes, seq=seq, token_budget=90) for seq, sizes in enumerate(SHARDED)]

    def shard_over(self, world_size: int):
        assert world_size == self.world_size, f"sharded over {world_size} ranks, expected {self.world_size}"

    def next_batch(self, timeout=None):
        from rollstream.consumer import ConsumerClosed

        if not self.batches:
            raise ConsumerClosed("no more batches")
        return self.batches.pop(0)

    def commit(self, batch, step=None):
        pass


def worker(rank: int, world: int, init_file: str, out: Path) -> None:
    import torch.distributed as dist

    from rollstream.consumer import DistributedConsumer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    shards = DistributedConsumer(StandIn(world) if rank == 0 else None, strategy="tokens")
    report = []
    for shard in shards:
        micro = {limit: [[list(m.positions), m.cu_seqlens.tolist(), str(m.cu_seqlens.dtype), m.over_budget]
                         for m in shards.micro_batches(shard, limit)] for limit in (40, 30)}
        report.append({"positions": list(shard.positions), "token_budget": shard.token_budget,
                       "rank_tokens": list(shards.rank_tokens), "imbalance": shards.imbalance, "micro": micro})
        shards.commit(shard)
    (out / f"tokens-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_gets_as_many_micro_batches(tmp_path):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, str(rank), "2", str(tmp_path / "init"), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    logs = [p.communicate(timeout=150)[0].decode() for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"tokens-{rank}.json").read_text()) for rank in range(2))
    i32 = "torch.int32"
    # Batch 0, by hand (largest differencing without equal counts): 40 + 10 on rank 0, 4 x 10 on rank 1.
    assert [rank0[0]["positions"], rank1[0]["positions"]] == [[0, 5], [1, 2, 3, 4]]
    assert rank0[0]["rank_tokens"] == rank1[0]["rank_tokens"] == [50, 40]
    assert rank0[0]["imbalance"] == rank1[0]["imbalance"] == pytest.approx(50 / 45)
    assert rank0[0]["token_budget"] == rank1[0]["token_budget"] == 90
    # At 40 tokens rank 0 needs two micro-batches and rank 1 one: rank 1's second is padding.
    assert rank0[0]["micro"]["40"] == [[[0], [0, 40], i32, False], [[5], [0, 10], i32, False]]
    assert rank1[0]["micro"]["40"] == [[[1, 2, 3, 4], [0, 10, 20, 30, 40], i32, False], [[], [0], i32, False]]
    # At 30 the 40-token sample is over the limit, alone; both ranks need two.
    assert rank0[0]["micro"]["30"] == [[[0], [0, 40], i32, True], [[5], [0, 10], i32, False]]
    assert rank1[0]["micro"]["30"] == [[[1, 2, 3], [0, 10, 20, 30], i32, False], [[4], [0, 10], i32, False]]
    # Batch 1: one sample for two ranks. Rank 1's shard is empty, and its micro-batch is padding.
    assert [rank0[1]["positions"], rank1[1]["positions"]] == [[0], []]
    assert rank0[1]["rank_tokens"] == rank1[1]["rank_tokens"] == [30, 0]
    assert rank1[1]["imbalance"] == 2.0
    assert rank0[1]["micro"]["40"] == [[[0], [0, 30], i32, False]]
    assert rank1[1]["micro"]["40"] == [[[], [0], i32, False]]
    assert len(rank0) == len(rank1) == 2


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
