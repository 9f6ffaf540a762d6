"""torch.distributed delivery over gloo with 2 and 4 processes on loopback.

Each rank runs this file as a script (no pickling of functions or data):
rank 0 owns a stand-in client that yields known batches; every rank writes
its shards in the shard wire format, and the test reassembles them. The
same processes check the collective commit, the failure and stop signals,
and the tensor-parallel masked log-prob. With no NCCL here, a second gloo
group stands in for the metadata group an NCCL data group gets, and every
torch.distributed call the consumer makes is recorded with its group and
tensors; a one-process world in the test's own process checks which
metadata group the consumer picks.
"""
import hashlib
import inspect
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

STRATEGIES = ("round_robin", "balanced", "group")
BATCHES = 2
VOCAB_TP = 24
MICRO_TOKENS = 200
# What the consumer may call in torch.distributed with a group; the side-group worker records each call.
SPIED = ("send", "isend", "recv", "irecv", "broadcast", "all_gather", "all_gather_into_tensor", "all_reduce", "barrier")


def known_batches(seed: int):
    """The batches rank 0 serves: grouped and ungrouped samples with masks,
    the second batch's with their support log-probs beside them."""
    from consumer_helpers import delivery, make_rollout

    from rollstream.consumer import Batch

    rng = np.random.default_rng(seed)
    out = []
    for seq in range(BATCHES):
        trajectories = []
        for i in range(9):
            group = (f"g{seq}-{i // 3}", 3) if i < 6 else None
            trajectories.append(make_rollout(rng, f"b{seq}-t{i}", sample_index=i, group=group, turns=3,
                                             mask_log_probs=seq == 1).merged())
        out.append(Batch.from_deliveries([delivery(t) for t in trajectories], seq=seq, device="cpu"))  # gloo's
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

    def shard_over(self, world_size):
        assert world_size == self.world_size, f"sharded over {world_size} ranks, expected {self.world_size}"

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


def deliver(rank: int, world: int, out: Path, **options) -> tuple[dict, object]:
    """Every strategy's batches to this rank (of the data group, `world`
    ranks) through a `DistributedConsumer(**options)`: its shards written to
    `out`, the failure it saw, its micro-batch counts and, on the source,
    what was committed. Also the last consumer."""
    from rollstream.consumer import DistributedConsumer
    from rollstream.consumer.distributed import encode_shard

    report = {}
    for strategy in STRATEGIES:
        client = StandInClient(known_batches(seed=3), world) if rank == 0 else None
        shards = DistributedConsumer(client, strategy=strategy, **options)
        failure, failure_kind, micro = None, None, []
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
            micro.append(len(shards.micro_batches(shard, MICRO_TOKENS)))
            shards.commit(shard, step=10 + shard.seq)
        report[strategy] = {"failure": failure, "failure_kind": failure_kind, "micro": micro,
                            "committed": client.committed if client else None}
    return report, shards


def worker(rank: int, world: int, init_file: str, out: Path) -> None:
    import torch.distributed as dist

    from rollstream.common.mask import SamplingMask
    from rollstream.consumer import DistributedConsumer, masked_log_probs

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    report, shards = deliver(rank, world, out)
    report["state"] = shards.state_dict()  # collective: the source's, on every rank
    shards.sealed(11)
    report["sealed"] = shards.client.sealed_steps if shards.client else None
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


@contextmanager
def spying(calls: list, names: dict):
    """Record each `SPIED` call into torch.distributed: its name, its group
    (`names` maps a group's id to a label) and its tensors' devices, dtypes
    and bytes (a digest of the first)."""
    import torch.distributed as dist

    real = {name: getattr(dist, name) for name in SPIED}

    def spy(name):
        def call(*args, **kwargs):
            result = real[name](*args, **kwargs)
            arguments = inspect.signature(real[name]).bind(*args, **kwargs).arguments
            tensors = [t for value in arguments.values() for t in (value if isinstance(value, list) else [value])
                       if isinstance(t, torch.Tensor)]
            group = arguments.get("group")
            calls.append({"op": name, "group": names.get(id(group), repr(group)),
                          "devices": sorted({t.device.type for t in tensors}),
                          "dtypes": sorted({str(t.dtype) for t in tensors}),
                          "digest": hashlib.sha256(tensors[0].cpu().numpy().tobytes()).hexdigest() if tensors else None})
            return result
        return call

    for name in SPIED:
        setattr(dist, name, spy(name))
    try:
        yield
    finally:
        for name, function in real.items():
            setattr(dist, name, function)


def side_group_worker(rank: int, world: int, init_file: str, out: Path) -> None:
    """Delivery to every rank but 0 (so the data group's source is global
    rank 1) with a second gloo group over the same ranks as the metadata
    group, every call recorded; first, metadata groups over other ranks,
    refused."""
    import torch.distributed as dist

    from rollstream.common.errors import InvalidInput
    from rollstream.consumer import DistributedConsumer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    members = list(range(1, world))
    data = dist.new_group(members)
    metadata = dist.new_group(members, backend="gloo")
    wrong = (dist.new_group(members[:-1], backend="gloo"), dist.new_group(list(range(world - 1)), backend="gloo"))
    if rank in members:
        group_rank = dist.get_rank(data)
        refused = []
        for group in wrong:
            try:
                DistributedConsumer(StandInClient([], len(members)) if group_rank == 0 else None, group=data,
                                    metadata_group=group)
            except InvalidInput as exc:
                refused.append(str(exc))
        calls: list = []
        with spying(calls, {id(data): "data", id(metadata): "metadata"}):
            report, _ = deliver(group_rank, len(members), out, group=data, metadata_group=metadata)
        report.update(refused=refused, calls=calls)
        (out / f"report-{group_rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def docs_worker(rank: int, world: int, init_file: str, out: Path) -> None:
    """docs/consumer.md's sharding loop as written, against the broker whose
    consumer endpoint `out/endpoint` names: only the source rank makes a
    `Consumer`, without `world_size`, and every rank wraps it in a
    `DistributedConsumer` of each strategy in turn for one batch."""
    import torch.distributed as dist
    from consumer_helpers import VOCAB

    from rollstream.consumer import Consumer, DistributedConsumer
    from rollstream.consumer.sharding import STRATEGIES as ALL_STRATEGIES

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    endpoint = (out / "endpoint").read_text()
    client = Consumer(endpoint, batch_size=2, unit="group", vocab_size=VOCAB) if dist.get_rank() == 0 else None
    report = {}
    for strategy in ALL_STRATEGIES:
        shards = DistributedConsumer(client, strategy=strategy)
        shard = next(shards)
        shards.commit(shard)  # collective; the source rank commits
        report[strategy] = {"trajectory_ids": list(shard.trajectory_ids), "group_ids": list(shard.group_ids),
                            "state_world_size": shards.state_dict()["world_size"]}
    if client is not None:
        client.flush(30)
        client.close()
    (out / f"report-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


WORKERS = {"delivery": worker, "side_group": side_group_worker, "docs": docs_worker}


def run_ranks(world: int, tmp_path: Path, mode: str = "delivery", reporting: int | None = None) -> list[dict]:
    """Run `WORKERS[mode]` on `world` processes; the reports of the first `reporting` (default all)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    init = tmp_path / "init"
    procs = [
        subprocess.Popen([sys.executable, __file__, mode, str(rank), str(world), str(init), str(tmp_path)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for rank in range(world)
    ]
    logs = [p.communicate(timeout=150)[0].decode() for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((tmp_path / f"report-{rank}.json").read_text()) for rank in range(reporting or world)]


def assert_delivered(reports: list[dict], tmp_path: Path) -> None:
    """Every strategy's shards, one per rank of `reports`, reassemble to the
    known batches; every rank saw the source's failure, ran as many
    micro-batches, and the source committed each batch."""
    from consumer_helpers import assert_same_batch

    from rollstream.consumer import Batch
    from rollstream.consumer.distributed import decode_shard

    world = len(reports)
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
            for shard in shards:  # the support log-probs cross beside each shard's own mask ids
                assert (shard.mask_log_probs is not None) == (batch.mask_log_probs is not None) == (batch.seq == 1)
                if shard.mask_log_probs is not None:
                    assert shard.mask_log_probs.shape == shard.mask_ids.shape
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
        assert all(report[strategy]["micro"] == reports[0][strategy]["micro"] for report in reports)
        assert reports[0][strategy]["committed"] == [[b.seq, 10 + b.seq] for b in expected]
        assert reports[0][strategy]["failure"].startswith("ValueError: stand-in failure")
        for report in reports[1:]:
            assert "stand-in failure" in report[strategy]["failure"]
            # The source's error was no RollstreamError: the other ranks' SourceRankFailed says client_failed.
            assert report[strategy]["failure"].startswith("SourceRankFailed: the source rank failed to produce a batch: "
                                                          "ValueError: stand-in failure")
            assert report[strategy]["failure_kind"] == {"runtime_error": True, "code": "client_failed"}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_shards_reassemble_to_the_batch(world, tmp_path):
    from rollstream.common.mask import SamplingMask
    from rollstream.consumer import masked_log_probs

    reports = run_ranks(world, tmp_path)
    assert_delivered(reports, tmp_path)
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


@pytest.mark.slow
def test_the_docs_loop_shards_a_client_made_without_world_size_on_every_strategy(brokers, tmp_path):
    """Two ranks run docs/consumer.md's loop against a live broker: every
    strategy hands each rank its part of a batch of two whole groups, and the
    data position records the group's two ranks."""
    from consumer_helpers import RawProducer, make_rollout

    from rollstream.consumer.sharding import STRATEGIES as ALL_STRATEGIES

    node = brokers()
    rng = np.random.default_rng(11)
    groups = {f"g{g}": [make_rollout(rng, f"g{g}-{m}", sample_index=m, group=(f"g{g}", 3)) for m in range(3)]
              for g in range(2 * len(ALL_STRATEGIES))}
    producer = RawProducer(node.producer)
    try:
        producer.send([rollout for members in groups.values() for rollout in members])
    finally:
        producer.close()
    (tmp_path / "endpoint").write_text(node.consumer)
    reports = run_ranks(2, tmp_path, mode="docs")
    trained = []
    for strategy in ALL_STRATEGIES:
        parts = [report[strategy] for report in reports]
        assert [part["state_world_size"] for part in parts] == [2, 2], strategy
        ids = [tid for part in parts for tid in part["trajectory_ids"]]
        batch_groups = {gid for part in parts for gid in part["group_ids"]}
        assert len(batch_groups) == 2 and sorted(ids) == sorted(r.trajectory_id for g in batch_groups for r in groups[g])
        assert all(part["trajectory_ids"] for part in parts), f"{strategy}: every rank gets a share of 6 samples"
        if strategy == "group":
            assert not set(parts[0]["group_ids"]) & set(parts[1]["group_ids"]), "a group stays on one rank"
        trained += ids
    assert sorted(trained) == sorted(r.trajectory_id for members in groups.values() for r in members)


def test_a_client_takes_its_world_size_from_the_group_unless_given_another(one_rank):
    """`DistributedConsumer` sets a client's world size to its group's; a
    client given another size is refused, naming both."""
    from rollstream.common.errors import InvalidInput
    from rollstream.consumer import Consumer, DistributedConsumer

    with Consumer("tcp://127.0.0.1:9", batch_size=1) as client:
        DistributedConsumer(client)
        DistributedConsumer(client)  # made again over the same group (every epoch, say)
        assert client.world_size == 1 and client.state_dict()["world_size"] == 1
    with Consumer("tcp://127.0.0.1:9", batch_size=1, world_size=2) as client:
        with pytest.raises(InvalidInput, match="must have the group's world size 1, got 2"):
            DistributedConsumer(client)


@pytest.mark.slow
def test_metadata_crosses_the_metadata_group_on_the_host(tmp_path):
    """Sizes, headers, failures and every agreement collective use the
    metadata group with CPU tensors; the data group carries exactly the
    payloads, each once."""
    world = 4
    reports = run_ranks(world, tmp_path, "side_group", reporting=world - 1)
    assert_delivered(reports, tmp_path)
    got = {rank: sorted(hashlib.sha256(path.read_bytes()).hexdigest()
                        for path in tmp_path.glob(f"*-{rank}.bin") if path.stat().st_size)
           for rank in range(len(reports))}
    for rank, report in enumerate(reports):
        calls = report["calls"]
        assert {call["group"] for call in calls} == {"data", "metadata"}, calls
        metadata = [call for call in calls if call["group"] == "metadata"]
        assert all(call["devices"] == ["cpu"] for call in metadata), metadata
        assert {call["op"] for call in metadata} == {"isend" if rank == 0 else "recv", "all_gather", "broadcast",
                                                     "all_reduce"}
        data = [call for call in calls if call["group"] == "data"]
        assert all(call["op"] == ("isend" if rank == 0 else "recv") and call["dtypes"] == ["torch.uint8"]
                   for call in data), data
        payloads = sorted(digest for other in range(1, len(reports)) for digest in got[other]) if rank == 0 else got[rank]
        assert sorted(call["digest"] for call in data) == payloads
    # Global ranks 1 and 2 hold the group [1, 2] and [0, 1, 2]; global rank 3 holds neither.
    inside = ["metadata_group must have the data group's size 3, got 2",
              "metadata_group must hold the data group's ranks [1, 2, 3], got [0, 1, 2]"]
    outside = ["metadata_group must have the data group's size 3, got -1 (this rank is outside it)"] * 2
    assert [report["refused"] for report in reports] == [inside, inside, outside]


@pytest.fixture
def one_rank():
    """A one-process gloo world in the test's own process, torn down after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist
    dist.destroy_process_group()


def test_a_gloo_group_carries_its_own_metadata(one_rank, monkeypatch):
    from rollstream.consumer import DistributedConsumer

    created = []
    monkeypatch.setattr(one_rank, "new_group", lambda *args, **kwargs: created.append((args, kwargs)))
    shards = DistributedConsumer(StandInClient([], 1))
    assert created == []
    assert shards.metadata_group is shards.group


def test_an_nccl_group_gets_a_gloo_side_group(one_rank, monkeypatch):
    """The data group read as NCCL: a gloo group over its ranks is built,
    and the consumer's collectives go through it."""
    from rollstream.consumer import DistributedConsumer

    real_backend, real_new_group = one_rank.get_backend, one_rank.new_group
    created = []

    def new_group(*args, **kwargs):
        created.append(inspect.signature(real_new_group).bind(*args, **kwargs).arguments)
        return real_new_group(*args, **kwargs)

    monkeypatch.setattr(one_rank, "get_backend", lambda group=None: "nccl" if group is None else real_backend(group))
    monkeypatch.setattr(one_rank, "new_group", new_group)
    shards = DistributedConsumer(StandInClient(known_batches(seed=3)[:1], 1), device="cpu")
    assert [(arguments["ranks"], arguments["backend"]) for arguments in created] == [([0], "gloo")]
    assert real_backend(shards.metadata_group) == "gloo"
    calls: list = []
    with spying(calls, {id(shards.metadata_group): "metadata"}):
        shard = next(shards)
        shards.micro_batches(shard, MICRO_TOKENS)
        shards.commit(shard)
    assert {(call["op"], call["group"]) for call in calls} == {("all_reduce", "metadata"), ("all_gather", "metadata"),
                                                                ("broadcast", "metadata")}
    # Made again over the same data group (each epoch, say): the side group is shared, not built again.
    again = DistributedConsumer(StandInClient([], 1), device="cpu")
    assert again.metadata_group is shards.metadata_group and len(created) == 1
    other = real_new_group([0], backend="gloo")
    monkeypatch.setattr(one_rank, "get_backend", lambda group=None: "nccl" if group in (None, other) else real_backend(group))
    assert DistributedConsumer(StandInClient([], 1), group=other, device="cpu").metadata_group is not shards.metadata_group
    assert [arguments["ranks"] for arguments in created] == [[0], [0]], "another data group gets its own"


def test_a_metadata_group_must_be_gloo(one_rank, monkeypatch):
    from rollstream.common.errors import InvalidInput
    from rollstream.consumer import DistributedConsumer

    side = one_rank.new_group([0], backend="gloo")
    real_backend = one_rank.get_backend
    monkeypatch.setattr(one_rank, "get_backend", lambda group=None: "nccl" if group is side else real_backend(group))
    with pytest.raises(InvalidInput, match=r"^metadata_group's backend must be gloo \(or map cpu to gloo\), got nccl$"):
        DistributedConsumer(StandInClient([], 1), metadata_group=side)


def test_a_device_map_that_sends_host_tensors_over_gloo_carries_its_own_metadata(one_rank, monkeypatch):
    """`cpu:gloo,cuda:nccl`: the metadata stays on the data group, and shards
    go to the GPU by default (asked of CUDA, faked here)."""
    from rollstream.consumer import DistributedConsumer

    created = []
    monkeypatch.setattr(one_rank, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(one_rank, "new_group", lambda *args, **kwargs: created.append(args))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    shards = DistributedConsumer(StandInClient([], 1))
    assert created == [] and shards.metadata_group is None  # the default group itself
    assert shards.device == torch.device("cuda", 0)
    monkeypatch.setattr(one_rank, "get_backend", lambda group=None: "cpu:nccl,cuda:nccl")
    DistributedConsumer(StandInClient([], 1), device="cpu")
    assert len(created) == 1, "a device map without gloo for host tensors gets a side group"



def test_the_source_rank_shard_lands_on_the_device_every_other_rank_gets(one_rank):
    """A client whose batches are on another device than the ranks' (a GPU
    consumer under a gloo group): the source keeps its shard on `device` too,
    with the same content. The other device is CUDA where there is one, else
    torch's `meta` device, which holds shapes and dtypes without data."""
    from consumer_helpers import assert_same_batch

    from rollstream.consumer import DistributedConsumer

    batch = known_batches(seed=5)[0]
    if torch.cuda.is_available():
        client_batch, device = decode_shard_on(batch, "cuda"), "cpu"
    else:
        client_batch, device = batch, "meta"
    shards = DistributedConsumer(StandInClient([client_batch], 1), device=device)
    shard = shards.next_shard()
    held = [shard.tokens, shard.response_tokens, shard.log_probs, shard.loss_mask, shard.rewards, shard.mask_ids]
    assert shard.device == torch.device(device) and all(t.device == torch.device(device) for t in held)
    assert shard.seq == batch.seq and list(shard.trajectory_ids) == list(batch.trajectory_ids)
    if device != "meta":
        assert_same_batch(shard, batch)
    shards.commit(shard, step=1)
    assert shards.client.committed == [[batch.seq, 1]]


class WorkerClock:
    """Stands in for `time` and `Clock` in the consumer's module: each sleep is the gloo
    worker getting the CPU, and it drops the references it still held."""

    def __init__(self):
        self.held: list[torch.Tensor] = []  # views the "worker" keeps of a collective's tensors
        self.sleeps = 0

    def monotonic(self):
        return time.monotonic()

    def sleep(self, seconds):
        self.sleeps += 1
        self.held.clear()


def test_each_collective_waits_for_gloo_to_let_go_of_its_tensors(one_rank, monkeypatch):
    """Gloo's worker thread drops a collective's tensors after the collective
    returns; freed on that thread at interpreter exit, they abort the process.
    Here every collective's tensors stay held (as the worker does) until the
    consumer pauses: the consumer must not return while any is still held."""
    from rollstream.consumer import DistributedConsumer, distributed

    clock = WorkerClock()
    monkeypatch.setattr(distributed, "time", clock)
    monkeypatch.setattr(distributed, "Clock", clock)
    calls = []

    def holding(name):
        real = getattr(one_rank, name)

        def call(*args, **kwargs):
            assert clock.held == [], f"{calls[-1]} returned while gloo still held its tensors"
            real(*args, **kwargs)
            tensors = [t for arg in args for t in (arg if isinstance(arg, list) else [arg])
                       if isinstance(t, torch.Tensor)]
            clock.held.extend(t.view(-1) for t in tensors)
            calls.append(name)
        return call

    for name in ("broadcast", "all_gather", "all_reduce"):
        monkeypatch.setattr(one_rank, name, holding(name))
    batch = known_batches(seed=6)[0]
    shards = DistributedConsumer(StandInClient([batch], 1))
    shard = shards.next_shard()
    shards.micro_batches(shard, MICRO_TOKENS)
    shards.commit(shard, step=1)
    assert shards.state_dict()["step"] == 1
    assert {"broadcast", "all_gather", "all_reduce"} <= set(calls)
    assert clock.held == [], f"{calls[-1]} returned while gloo still held its tensors"
    assert clock.sleeps >= len(calls)


def test_a_tensor_gloo_never_lets_go_holds_a_collective_no_longer_than_the_patience(monkeypatch):
    from rollstream.consumer import distributed

    class StuckClock(WorkerClock):
        def __init__(self):
            super().__init__()
            self.now = 0.0

        def monotonic(self):
            return self.now

        def sleep(self, seconds):
            self.sleeps += 1
            self.now += seconds

    clock = StuckClock()
    monkeypatch.setattr(distributed, "time", clock)
    monkeypatch.setattr(distributed, "Clock", clock)
    tensor = torch.zeros(2)
    stuck = tensor.view(-1)
    distributed._let_go([tensor])
    assert tensor._use_count() > 1 and stuck.shape == (2,)  # still held: the wait gave up
    assert clock.now >= distributed._LET_GO_PATIENCE
    assert clock.sleeps == pytest.approx(distributed._LET_GO_PATIENCE / distributed._LET_GO_POLL, rel=0.01)


def decode_shard_on(batch, device: str):
    """`batch` moved to `device` through the shard encoding."""
    from rollstream.consumer.distributed import decode_shard, encode_shard

    header, payload = encode_shard(batch)
    return decode_shard(header, payload.to(device))


if __name__ == "__main__":
    WORKERS[sys.argv[1]](int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))
