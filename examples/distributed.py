"""A data-parallel training loop on two gloo ranks, as the README shows it.

The script starts a broker on loopback, sends it 24 trajectories, and runs
two rank processes, as torchrun would (a gloo group over a rendezvous file
in a temporary directory, on loopback). Only rank 0 makes a `Consumer`,
without a world size; every rank wraps it in a `DistributedConsumer`, which
gives the client its group's size, and gets its part of each batch. The
ranks train one small model under DistributedDataParallel and commit each
batch together. The script checks that the ranks' parts of every batch
cover it once, that the weights are the same on both ranks, and that the
data position records the two ranks.

    .venv/bin/python examples/distributed.py
"""
import json
import math
import os
import subprocess
import sys
import tempfile
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from rollstream.app.harness import LoopbackNode
from rollstream.consumer import Consumer, DistributedConsumer, masked_log_probs
from rollstream.producer import Producer

VOCAB = 64
RANKS, BATCH, STEPS = 2, 8, 3


def produce(endpoint: str) -> list[str]:
    """Send BATCH * STEPS trajectories of different lengths and wait until each is durable; their ids."""
    rng = np.random.default_rng(0)
    with Producer(endpoint, "sampler") as producer:
        ends = []
        for i in range(BATCH * STEPS):
            supports = [rng.choice(VOCAB, size=3, replace=False).tolist() for _ in range(int(rng.integers(2, 12)))]
            tokens = [support[0] for support in supports]
            traj = producer.trajectory(f"t{i}", prompt_tokens=[1, 2, 3], sample_index=i)
            traj.turn(tokens, [-1.0] * len(tokens), supports=supports)
            ends.append(traj.end(reward=1.0))
        return [end.result(timeout=120).trajectory_id for end in ends]


def rank_main(rank: int, init_file: str, endpoints: list[str], report: str) -> None:
    """One rank: its part of every batch, trained and committed with the other rank's."""
    torch.manual_seed(0)  # the same initial weights on every rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=timedelta(seconds=120))
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trained = []

    client = Consumer(endpoints, batch_size=BATCH, vocab_size=VOCAB) if dist.get_rank() == 0 else None
    shards = DistributedConsumer(client, strategy="balanced")   # or "round_robin", "group", "tokens"
    for shard in shards:                                        # every rank, in step: its part of each batch
        logits = model(shard.tokens.long())
        logp = masked_log_probs(logits[shard.response_index() - 1], shard.response_tokens, shard.mask_ids,
                                shard.mask_offsets)             # each sampled token's log-prob over its support
        loss = -(logp * shard.loss_mask).sum() / shard.loss_mask.sum()
        loss.backward()                                         # DistributedDataParallel averages the gradients
        optimizer.step()
        optimizer.zero_grad()
        shards.commit(shard)                                    # collective; the source rank commits the batch
        trained.append({"batch": shard.seq, "trajectory_ids": list(shard.trajectory_ids)})
        if len(trained) == STEPS:
            break
    state = shards.state_dict()                                 # collective: the source's data position
    if client is not None:
        client.flush(120)                                       # the brokers confirmed every commit
    shards.close()

    with open(report, "w") as out:
        json.dump({"trained": trained, "world_size": state["world_size"], "step": state["step"],
                   "weights": sum(float(p.detach().double().sum()) for p in model.parameters())}, out)
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rollstream-ranks-") as work, \
            LoopbackNode("rollstream-example-", VOCAB) as node:
        produced = produce(node.endpoints["producer"])
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}  # gloo's sockets on loopback
        reports = [os.path.join(work, f"rank-{rank}.json") for rank in range(RANKS)]
        ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), os.path.join(work, "rendezvous"),
                                   json.dumps([node.endpoints["consumer"]]), reports[rank]], env=env)
                 for rank in range(RANKS)]
        statuses = [rank.wait(timeout=600) for rank in ranks]
        assert statuses == [0] * RANKS, f"every rank must exit with 0, got {statuses}"
        done = []
        for path in reports:
            with open(path) as report:
                done.append(json.load(report))
    for step in range(STEPS):
        parts = [report["trained"][step]["trajectory_ids"] for report in done]
        assert all(parts) and len({report["trained"][step]["batch"] for report in done}) == 1
        assert len(set().union(*parts)) == sum(map(len, parts)) == BATCH, "each rank its own part of the batch"
    trained = [tid for report in done for part in report["trained"] for tid in part["trajectory_ids"]]
    assert sorted(trained) == sorted(produced), "every trajectory trained once, on one rank"
    assert [report["world_size"] for report in done] == [RANKS] * RANKS and done[0]["step"] == STEPS
    assert math.isclose(done[0]["weights"], done[1]["weights"], rel_tol=1e-6), "the ranks' weights stay the same"
    per_rank = ", ".join(f"rank {rank} {sum(len(p['trajectory_ids']) for p in report['trained'])}"
                         for rank, report in enumerate(done))
    print(f"ok: {STEPS} batches of {BATCH} over {RANKS} gloo ranks ({per_rank} trajectories), each trained once; "
          f"the same weights on both ranks; the data position records world size {done[0]['world_size']}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5])
    else:
        main()
