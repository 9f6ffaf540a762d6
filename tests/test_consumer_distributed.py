"""torch.distributed delivery over gloo with 2 and 4 processes on loopback.

Each rank runs this file as a script (no pickling of functions or data):
rank 0 owns a stand-in client that yields known batches; every rank writes
its shards in the shard wire format, and the test reassembles them. The
same processes check the collective commit, the failure and stop signals,
and the tensor-parallel masked log-prob.
"""
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

STRATEGIES = ("round_robin", "balanced", "group")
BATCHES = 2
VOCAB_TP = 24


def known_batches(seed: int):
    """The batches rank 0 serves: grouped and ungrouped samples with masks."""
    from consumer_helpers import delivery, make_rollout

    from rollstream.consumer import Batch

    rng = np.random.default_rng(seed)
    out = []
    for seq in range(BATCHES):
        trajectories = []
        for i in range(9):
            group = (f"g{seq}-{i // 3}", 3) if i < 6 else None
            trajectories.append(make_rollout(rng, f"b{seq}-t{i}", sample_index=i, group=group, turns=3).merged())
        out.append(Batch.from_deliveries([delivery(t) for t in trajectories], seq=seq))
    return out


class StandInClient:
    """What `DistributedConsumer` needs from a `Consumer`: known batches, then
    one failure, then closed."""

    def __init__(self, batches, world_size):
        self.batches = list(batches)
        self.world_size = world_size
        self.checkpointed = False  # its commits carry no lineage to the ledgers
        self.committed = []
        self.sealed_steps = []
        self.failed = False
        self.closed = False  # closed by another thread while the ranks hold a batch: what a real Consumer raises

    def _check_open(self):
        from rollstream.consumer import ConsumerClosed

        if self.closed:
            raise ConsumerClosed("closed meanwhile")

    def next_batch(self, timeout=None):
        from rollstream.consumer import ConsumerClosed

        if self.batches:
            return self.batches.pop(0)
        if not self.failed:
            self.failed = True
            raise ValueError("stand-in failure")
        raise ConsumerClosed("no more batches")

    def commit(self, batch, step=None):
        self._check_open()
        self.committed.append([batch.seq, step])

    def sealed(self, step):
        self._check_open()
        self.sealed_steps.append(step)

    def state_dict(self):
        return {"format": "stand-in", "step": len(self.committed), "batches": [{"trajectory_ids": ["a", "b"]}]}

    def release(self, batch):
        raise AssertionError("nothing is released in this test")


def tp_problem(world: int):
    """Global logits, targets and supports for the tensor-parallel check."""
    gen = torch.Generator().manual_seed(7)
    rows = 5
    logits = torch.randn(rows, VOCAB_TP, generator=gen)  # VOCAB_TP divides over 2 and 4 ranks
    supports = [torch.randperm(logits.shape[1], generator=gen)[: 1 + r].tolist() for r in range(rows)]
    tokens = [s[-1] for s in supports]
    return logits, supports, tokens


def worker(rank: int, world: int, init_file: str, out: Path) -> None:
    import torch.distributed as dist

    from rollstream.common.mask import SamplingMask
    from rollstream.consumer import DistributedConsumer, masked_log_probs
    from rollstream.consumer.distributed import encode_shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    report = {}
    for strategy in STRATEGIES:
        client = StandInClient(known_batches(seed=3), world) if rank == 0 else None
        shards = DistributedConsumer(client, strategy=strategy)
        failure, failure_kind = None, None
        while True:
            try:
                shard = next(shards)
            except StopIteration:
                break
            except Exception as exc:  # the stand-in failure, once, then closed
                if failure is not None:
                    raise
                failure = f"{type(exc).__name__}: {exc}"
                failure_kind = {"runtime_error": isinstance(exc, RuntimeError), "code": getattr(exc, "code", None)}
                continue
            header, payload = encode_shard(shard)
            (out / f"{strategy}-{shard.seq}-{rank}.hdr").write_bytes(header)
            (out / f"{strategy}-{shard.seq}-{rank}.bin").write_bytes(payload.numpy().tobytes())
            shards.commit(shard, step=10 + shard.seq)
        report[strategy] = {"failure": failure, "failure_kind": failure_kind,
                            "committed": client.committed if client else None}
    report["state"] = shards.state_dict()  # collective: the source's, on every rank
    shards.sealed(11)
    report["sealed"] = client.sealed_steps if client else None
    # The source's client closed by another thread while the ranks hold a batch: its commit and seal end
    # every rank's collective with ConsumerClosed, so no rank waits on a source that stopped.
    closing = StandInClient(known_batches(seed=4)[:1], world) if rank == 0 else None
    shards = DistributedConsumer(closing, strategy="round_robin")
    shard = next(shards)
    if closing is not None:
        closing.closed = True
    report["closed_meanwhile"] = []
    for collective in (lambda: shards.commit(shard), lambda: shards.sealed(1)):
        try:
            collective()
        except Exception as exc:
            report["closed_meanwhile"].append(type(exc).__name__)

    logits, supports, tokens = tp_problem(world)
    local = logits.shape[1] // world
    mask = SamplingMask.from_supports(supports)
    ids, offsets = torch.from_numpy(mask.ids.copy()), torch.from_numpy(mask.offsets.copy())
    shard_logits = logits[:, rank * local : (rank + 1) * local].clone().requires_grad_()
    values = masked_log_probs(shard_logits, tokens, ids, offsets, temperature=0.7, tp_rank=rank, tp_group=dist.group.WORLD)
    values.sum().backward()
    report["tp"] = {"values": values.tolist(), "grad": shard_logits.grad.tolist()}
    (out / f"report-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def run_ranks(world: int, tmp_path: Path) -> list[dict]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    init = tmp_path / "init"
    procs = [
        subprocess.Popen([sys.executable, __file__, str(rank), str(world), str(init), str(tmp_path)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for rank in range(world)
    ]
    logs = [p.communicate(timeout=150)[0].decode() for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((tmp_path / f"report-{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_shards_reassemble_to_the_batch(world, tmp_path):
    from consumer_helpers import assert_same_batch

    from rollstream.common.mask import SamplingMask
    from rollstream.consumer import Batch, masked_log_probs
    from rollstream.consumer.distributed import decode_shard

    reports = run_ranks(world, tmp_path)
    expected = known_batches(seed=3)
    for strategy in STRATEGIES:
        for batch in expected:
            shards = []
            for rank in range(world):
                header = (tmp_path / f"{strategy}-{batch.seq}-{rank}.hdr").read_bytes()
                payload = torch.frombuffer(bytearray((tmp_path / f"{strategy}-{batch.seq}-{rank}.bin").read_bytes()),
                                           dtype=torch.uint8)
                shards.append(decode_shard(header, payload))
            assert sorted(p for s in shards for p in s.positions) == list(range(len(batch)))
            if strategy != "group":
                assert max(map(len, shards)) - min(map(len, shards)) <= 1
            else:  # every group on one rank
                homes = {}
                for rank, shard in enumerate(shards):
                    for gid in shard.group_ids:
                        if gid is not None:
                            assert homes.setdefault(gid, rank) == rank
            joined = Batch.concat(shards)
            assert_same_batch(joined.select(np.argsort(np.array(joined.positions))), batch)
        assert reports[0][strategy]["committed"] == [[b.seq, 10 + b.seq] for b in expected]
        assert reports[0][strategy]["failure"].startswith("ValueError: stand-in failure")
        for report in reports[1:]:
            assert "stand-in failure" in report[strategy]["failure"]
            # The source's error was no RollstreamError: the other ranks' SourceRankFailed says client_failed.
            assert report[strategy]["failure"].startswith("SourceRankFailed: the source rank failed to produce a batch: "
                                                          "ValueError: stand-in failure")
            assert report[strategy]["failure_kind"] == {"runtime_error": True, "code": "client_failed"}

    assert all(report["state"] == {"format": "stand-in", "step": 2, "batches": [{"trajectory_ids": ["a", "b"]}]}
               for report in reports)
    assert reports[0]["sealed"] == [11]
    assert all(report["closed_meanwhile"] == ["ConsumerClosed", "ConsumerClosed"] for report in reports)

    logits, supports, tokens = tp_problem(world)
    mask = SamplingMask.from_supports(supports)
    full = logits.clone().requires_grad_()
    reference = masked_log_probs(full, tokens, torch.from_numpy(mask.ids.copy()), torch.from_numpy(mask.offsets.copy()),
                                 temperature=0.7)
    reference.sum().backward()
    local = logits.shape[1] // world
    for rank, report in enumerate(reports):
        assert np.allclose(report["tp"]["values"], reference.detach().numpy(), atol=1e-5)
        assert np.allclose(report["tp"]["grad"], full.grad[:, rank * local : (rank + 1) * local].numpy(), atol=1e-5)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
