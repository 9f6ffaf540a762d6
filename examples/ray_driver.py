"""A Ray driver, as docs/ray.md's recipe lays it out, on a one-node Ray
cluster that this script starts on loopback (CPUs only).

`rollstream.ray.start_brokers` puts a supervised broker on every node (its
data directory in a temporary directory here); a rollout actor sends two
groups to its own node's broker (`local_broker()`); two trainer-rank actors
(a gloo group) train them, the source rank fanning in from every node's
broker (`all_brokers()`); `stop_brokers` ends each broker cleanly. The
samples travel over ZeroMQ, never through Ray's object store.

    .venv/bin/python examples/ray_driver.py
"""
import os
import tempfile

# Ray reads these at import, and its workers inherit them: one machine alone, every address on loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import ray  # noqa: E402

import rollstream.ray as rsray  # noqa: E402

VOCAB = 1000
GROUPS, GROUP_SIZE, RANKS = 2, 4, 2


@ray.remote(num_cpus=1)
class RolloutWorker:
    """One per inference engine, on any node: sends to its own node's broker."""

    def __init__(self):
        from rollstream.producer import Producer

        self.producer = Producer(rsray.local_broker().producer, f"rollout-{ray.get_runtime_context().get_actor_id()}")

    def generate(self, prompts: dict[str, list[int]]) -> list[str]:
        """Each prompt's group of samples (engine calls stood in for); the ids the broker acked."""
        ends = []
        for prompt_id, prompt_tokens in prompts.items():
            for i in range(GROUP_SIZE):
                traj = self.producer.trajectory(f"{prompt_id}-{i}", prompt_tokens, group_id=prompt_id,
                                                group_size=GROUP_SIZE, sample_index=i)
                tokens = [prompt_tokens[-1] + i, 7]
                traj.turn(tokens, [-0.5, -0.1], supports=[[tokens[0], 5], [7]])
                ends.append(traj.end(reward=float(i % 2)))
        return [end.result(timeout=120).trajectory_id for end in ends]


@ray.remote(num_cpus=1)
class TrainerRank:
    """One per data-parallel rank."""

    def train(self, rank: int, world: int, rendezvous: str, batches: int) -> list[str]:
        """This rank's part of each batch (one group), committed with the other ranks; its trajectory ids."""
        import torch.distributed as dist

        from rollstream.consumer import Consumer, DistributedConsumer

        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        client = None
        if rank == 0:  # the source rank fans in from every node's broker
            client = Consumer([b.consumer for b in rsray.all_brokers()], batch_size=1, unit="group", vocab_size=VOCAB)
        shards = DistributedConsumer(client, strategy="balanced")
        trained = []
        for shard in shards:
            trained += shard.trajectory_ids  # the training step
            shards.commit(shard)
            if shard.seq + 1 == batches:
                break
        if client is not None:
            client.flush(120)
        shards.close()
        dist.destroy_process_group()
        return trained


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rollstream-ray-") as work:
        # A cluster of its own ("local": not one already running here), its session files in the temporary directory.
        ray.init("local", num_cpus=1 + RANKS, _node_ip_address="127.0.0.1", _temp_dir=os.path.join(work, "ray"),
                 include_dashboard=False, log_to_driver=False)
        try:
            brokers = rsray.start_brokers(
                {"vocab_size": VOCAB, "metrics_port": 0, "log_level": "warning"},  # broker settings, by name
                data_dir=os.path.join(work, "{node_id}"),                           # each node's local disk
            )
            acked = ray.get(RolloutWorker.remote().generate.remote(
                {f"prompt-{g}": [1, 2, 3 + g] for g in range(GROUPS)}))
            ranks = [TrainerRank.remote() for _ in range(RANKS)]
            trained = ray.get([actor.train.remote(rank, RANKS, os.path.join(work, "rendezvous"), GROUPS)
                               for rank, actor in enumerate(ranks)])
            running = {node: status["state"] for node, status in rsray.brokers_status().items()}
        finally:
            stopped = rsray.stop_brokers()  # at the end of the job: each broker closes its store cleanly
            ray.shutdown()
    assert all(len(rank_ids) == GROUPS * GROUP_SIZE // RANKS for rank_ids in trained), "an even share per rank"
    assert sorted(tid for rank_ids in trained for tid in rank_ids) == sorted(acked), "every sample trained once"
    assert set(running.values()) == {"running"} and set(stopped.values()) == {0}, (running, stopped)
    assert all(b.producer.startswith("tcp://127.0.0.1:") for b in brokers), brokers
    print(f"ok: a broker on each of {len(brokers)} Ray node(s); {len(acked)} samples acked from a rollout actor and "
          f"trained by {RANKS} trainer-rank actors ({' and '.join(str(len(ids)) for ids in trained)}), each once; "
          f"every broker stopped with exit status 0")


if __name__ == "__main__":
    main()
