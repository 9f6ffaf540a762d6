"""Delivering shards to data-parallel ranks through torch.distributed.

Every rank holds a `DistributedConsumer` and calls the same methods in the
same order. The source rank alone owns a `Consumer`: it pulls and validates
each batch, partitions it (`sharding`), keeps its own shard and sends every
other rank its shard. A shard crosses as three messages: its kind and two
sizes (int64) and a msgpack header (field names, dtypes, shapes and the
host-side per-sample facts) over the metadata group, then one uint8 payload
with every tensor back to back through the process group's backend (NCCL on
GPUs, gloo on CPU). The metadata group is a gloo group over the same ranks
(the process group itself when that is gloo), so with NCCL the small
messages and the agreement collectives stay in host memory, with no copy to
the GPU and no device sync to read them back. Nothing is pickled.
`commit` is collective: the ranks check they finished the same batch, then
the source acks it. Every collective ends the same way on every rank: when
the source's part raises, the others raise too (`ConsumerClosed` when its
client was closed meanwhile, else `SourceRankFailed`).
"""
from __future__ import annotations

import os
import time
import weakref
from typing import Sequence

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from rollstream.common.checker import Ledger
from rollstream.common.clock import Clock
from rollstream.common.contract import SUPPORT_LOG_PROB_ARRAYS
from rollstream.common.errors import InvalidInput, InvalidState, RemoteProtocolError, RollstreamError
from rollstream.common.trajectory import Gap
from rollstream.common.validation import RULE_SUPPORT_ALIGNED

from .batch import PER_SAMPLE, Batch, pack_tokens, same_device, spans_of
from .client import ConsumerClosed
from .sharding import STRATEGIES, partition_batch, rank_tokens, token_imbalance

# What a message to a rank carries. STOP and FAILED carry a text: FAILED's is the error's code, a space, the error.
_SHARD, _STOP, _FAILED = 0, 1, 2
_ALIGN = 8  # every tensor starts 8-byte aligned in the payload
_DTYPES = {str(dtype): dtype for dtype in (torch.int32, torch.int64, torch.uint8, torch.float32)}
_LET_GO_PATIENCE = 10.0  # seconds a collective waits for gloo to let go of its tensors
_LET_GO_POLL = 0.0001


def encode_shard(batch: Batch, rank_tokens: Sequence[int] = ()) -> tuple[bytes, torch.Tensor]:
    """The header and the payload (uint8, on the batch's device) of a batch:
    every packed field of `Batch.ragged()` (`mask_log_probs` beside
    `mask_ids`, when carried), the per-sample tensors and the mask offsets;
    the header also carries the tokens every rank got of the whole batch."""
    tensors = {f"ragged.{name}": values for name, values in batch.ragged().items()}
    tensors.update({f"sample.{name}": getattr(batch, name) for name in PER_SAMPLE})
    if batch.mask_offsets is not None:  # `has_mask`
        tensors["mask_offsets"] = batch.mask_offsets
    entries, chunks, offset = [], [], 0
    for name, values in tensors.items():
        raw = values.contiguous().reshape(-1).view(torch.uint8)
        pad = -raw.numel() % _ALIGN
        entries.append([name, str(values.dtype), list(values.shape), offset])
        chunks += [raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)]
        offset += raw.numel() + pad
    host = {name: list(values) for name, values in batch.host_fields().items()}
    host["gaps"] = [gap.to_wire() if gap else None for gap in batch.gaps]
    header = {
        "seq": batch.seq,
        "token_budget": batch.token_budget,
        "rank_tokens": list(rank_tokens),
        "lengths": {key: values.tolist() for key, values in batch.lengths.items()},
        "host": host,
        "tensors": entries,
    }
    payload = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8, device=batch.device)
    return msgpack.packb(header, use_bin_type=True), payload


def decode_shard(header: bytes, payload: torch.Tensor) -> Batch:
    """The batch `encode_shard` described, on the payload's device."""
    return _shard_of(msgpack.unpackb(header, raw=False), payload)


def _shard_of(doc: dict, payload: torch.Tensor) -> Batch:
    """`decode_shard` of an unpacked header."""
    tensors = {}
    for name, dtype_name, shape, offset in doc["tensors"]:
        dtype = _DTYPES.get(dtype_name)
        if dtype is None:
            raise RemoteProtocolError("dtype", f"shard tensor {name!r} must have a dtype of {sorted(_DTYPES)}, "
                                               f"got {dtype_name}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
        tensors[name] = payload[offset : offset + nbytes].view(dtype).reshape(shape)
    host = {name: tuple(values) for name, values in doc["host"].items()}
    host["gaps"] = tuple(Gap(g["turn"], g["field"]) if g else None for g in host["gaps"])
    host["weight_versions"] = tuple(tuple(v) for v in host["weight_versions"])
    host["weight_version_spans"] = tuple(map(spans_of, host["weight_version_spans"]))
    host["leases"] = tuple(tuple(v) for v in host["leases"])
    ragged = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.startswith("ragged.")}
    per_sample = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.startswith("sample.")}
    for name in SUPPORT_LOG_PROB_ARRAYS:  # one per support id: a shard's must lie beside its mask ids
        ids = ragged.get("mask_ids")
        if name in ragged and (ids is None or ragged[name].shape != ids.shape):
            beside = "the shard has no mask_ids" if ids is None else f"mask_ids has shape {list(ids.shape)}"
            raise RemoteProtocolError("misaligned", f"rule '{RULE_SUPPORT_ALIGNED}' violated: shard tensor {name!r} has "
                                                    f"shape {list(ragged[name].shape)}, {beside}")
    lengths = {key: np.array(values, dtype=np.int64) for key, values in doc["lengths"].items()}
    return Batch._assemble(doc["seq"], payload.device, ragged, per_sample, tensors.get("mask_offsets"), lengths, host,
                           doc["token_budget"])


# The gloo side group of each data group, built once: a consumer made again over the same group (every
# epoch, say) shares it rather than leaves one more group behind. Gone with the data group.
_SIDE_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _let_go(tensors: Sequence[torch.Tensor]) -> None:
    """Wait until the gloo worker thread that ran a collective has dropped
    its references to `tensors`. A collective returns as soon as its result
    is in, while the worker still holds the tensors; dropped by Python first,
    they are freed later on the worker, which must take the GIL to do it, and
    at interpreter exit that aborts the process. Kept until the worker lets
    go, they are freed here. The wait is bounded: past it, the tensors are
    freed as before."""
    deadline = Clock.monotonic() + _LET_GO_PATIENCE
    while any(_holders(tensor) > 1 for tensor in tensors) and Clock.monotonic() < deadline:
        time.sleep(_LET_GO_POLL)


def _holders(tensor: torch.Tensor) -> int:
    """How many references the tensor's storage-and-shape object has: this
    Python tensor's one, plus one per view or C++ holder."""
    return tensor._use_count()  # type: ignore[attr-defined]  # torch's stubs omit it


def _backend_for(group, device_type: str) -> str | None:
    """The backend `group` uses for tensors on `device_type`: a plain
    backend for every device it serves (gloo's both, NCCL's CUDA alone), or
    what a device map such as `cpu:gloo,cuda:nccl` names."""
    spec = dist.get_backend(group)
    if ":" not in spec:
        return spec if spec == "gloo" or (spec, device_type) == ("nccl", "cuda") else None
    return dict(part.split(":", 1) for part in spec.split(",")).get(device_type)


class SourceRankFailed(RollstreamError, RuntimeError):
    """Raised on every other rank when the source rank's `next_batch`
    failed: its code is the source error's (`client_failed` for one that is
    not a `RollstreamError`), so `retriable` is that error's; the message
    gives its type and text."""


def _ending(exc: BaseException) -> tuple[int, str]:
    """How the source tells the other ranks it stopped (`exc` a
    `ConsumerClosed`) or failed: the kind and its text."""
    said = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ConsumerClosed):
        return _STOP, said
    return _FAILED, f"{exc.code if isinstance(exc, RollstreamError) else 'client_failed'} {said}"


def _raise_ending(kind: int, said: str, what: str):
    """On a rank other than the source: raise what `_ending` said."""
    if kind == _STOP:
        raise ConsumerClosed(f"the source rank stopped: {said}")
    code, _, said = said.partition(" ")
    raise SourceRankFailed(f"the source rank failed {what}: {said}", code=code)


class DistributedConsumer:
    """The same object on every rank of `group`; only rank `src` (a rank of
    `group`) passes a `Consumer`, and this sets the client's world size to
    the group's (`Consumer.shard_over`: one given to the client must match).

    >>> client = Consumer(endpoints, batch_size=256, vocab_size=V) if dist.get_rank() == 0 else None
    >>> shards = DistributedConsumer(client, strategy="balanced")
    >>> for shard in shards:          # every rank, in step
    ...     train_step(shard)
    ...     shards.commit(shard)      # collective; rank 0 acks the batch

    When the source's client is closed every rank's iteration stops; when it
    fails (a `BatchValidationError` under `on_invalid="raise"`, a timeout)
    the source re-raises and every other rank raises `SourceRankFailed` (a
    `RuntimeError`) with its code and message, so no rank waits forever.

    `metadata_group` is the gloo group the sizes, headers and agreement
    collectives cross, over the same ranks as `group`. By default it is
    `group` itself when that is gloo, else a gloo group built here.

    Every rank's shard lands on `device`: by default the current GPU under
    NCCL, else the CPU. The source's own shard too: a client that validated
    on the GPU under a gloo group has its shard copied to the CPU like the
    others', so the ranks train on one kind of device.
    """

    def __init__(self, client=None, *, src: int = 0, group=None, strategy: str = "balanced", device=None,
                 timeout: float | None = None, partial_after: float | None = None,
                 ledger: str | os.PathLike | None = None, metadata_group=None):
        if strategy not in STRATEGIES:
            raise InvalidInput(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.src = src
        if (self.rank == src) != (client is not None):
            raise InvalidInput(f"exactly the source rank {src} passes a client: this is rank {self.rank}, "
                               f"{'without' if client is None else 'with'} one")
        if client is not None:
            client.shard_over(self.world)  # recorded in its state_dict
        self.client = client
        self.strategy = strategy
        self.timeout = timeout
        self.partial_after = partial_after  # the source's `Consumer.next_batch(partial_after=...)`
        if device is None:
            nccl = _backend_for(group, "cuda") == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self.metadata_group = self._metadata_group(metadata_group)
        self.rank_tokens: tuple[int, ...] = ()  # per rank, its tokens of the last batch (`imbalance`)
        self._batches: dict[int, Batch] = {}
        # This rank's shards as handed and committed, for the end-to-end checker (`rollstream.common.checker`):
        self.ledger = None if ledger is None else Ledger(ledger)
        if self.ledger is not None and client is not None and client.checkpointed and client.resumed_from is not None:
            client.position.record_resume(self.ledger)

    def _metadata_group(self, given):
        """The gloo group for the metadata: `given` once checked, `group` when
        that is gloo, else a new gloo group over `group`'s ranks."""
        ranks = list(range(dist.get_world_size())) if self.group is None else dist.get_process_group_ranks(self.group)
        if given is not None:
            size = dist.get_world_size(given)  # -1 on a rank outside it
            if size != self.world:
                raise InvalidInput(f"metadata_group must have the data group's size {self.world}, got {size}"
                                   + (" (this rank is outside it)" if size < 0 else ""))
            held = sorted(dist.get_process_group_ranks(given))
            if held != sorted(ranks):
                raise InvalidInput(f"metadata_group must hold the data group's ranks {sorted(ranks)}, got {held}")
            if _backend_for(given, "cpu") != "gloo":
                raise InvalidInput(f"metadata_group's backend must be gloo (or map cpu to gloo), got "
                                   f"{dist.get_backend(given)}")
            return given
        if _backend_for(self.group, "cpu") == "gloo":
            return self.group
        data = dist.group.WORLD if self.group is None else self.group
        side = _SIDE_GROUPS.get(data)
        if side is None:
            # Collective over `ranks` alone: every rank of the group constructs its DistributedConsumers in the same
            # order, and local synchronization spares the ranks of other groups (other data-parallel groups, say).
            side = _SIDE_GROUPS[data] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return side

    def _global(self, rank: int) -> int:
        """The global rank of `rank` of `group`: what addresses it in both groups, whatever their numbering."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def __iter__(self) -> "DistributedConsumer":
        return self

    def __next__(self) -> Batch:
        try:
            return self.next_shard()
        except ConsumerClosed:
            raise StopIteration from None

    def next_shard(self) -> Batch:
        """This rank's shard of the next batch (collective)."""
        shard = self._scatter() if self.rank == self.src else self._receive()
        if self.ledger is not None:
            shard.record(self.ledger, "handed", rank=self.rank)
        return shard

    def _scatter(self) -> Batch:
        try:
            batch = (self.client.next_batch(self.timeout) if self.partial_after is None
                     else self.client.next_batch(self.timeout, partial_after=self.partial_after))
        except BaseException as exc:
            kind, said = _ending(exc)
            self._send_all({r: (kind, said.encode(), None) for r in self._others()})
            raise
        self._batches[batch.seq] = batch
        parts = partition_batch(batch, self.world, self.strategy)
        self.rank_tokens = tuple(rank_tokens(batch.lengths["sequence"].tolist(), parts))
        shards = {rank: batch.select(parts[rank]) for rank in range(self.world)}
        self._send_all({rank: (_SHARD, *encode_shard(shards[rank], self.rank_tokens)) for rank in self._others()})
        own = shards[self.src]
        if not same_device(own.device, self.device):
            # The client validated on another device (a GPU under a gloo group, say): the source's shard lands
            # on `device` as every other rank's does, so no rank trains on a device the others do not.
            header, payload = encode_shard(own, self.rank_tokens)
            own = decode_shard(header, payload.to(self.device))
        return own

    @property
    def imbalance(self) -> float:
        """Of the last batch, on every rank: the most tokens a rank got over
        the mean across ranks (1.0 is even). The most loaded rank sets the
        step time, so this is roughly the step time over an even split's."""
        return token_imbalance(self.rank_tokens)

    def micro_batches(self, shard: Batch, max_tokens: int) -> list[Batch]:
        """Collective: `shard.micro_batches(max_tokens)`, padded with empty
        ones to the most any rank has, so every rank runs as many forward
        and backward passes and the collectives FSDP or DDP issue in each
        line up (an empty shard gets only padding)."""
        mine = len(pack_tokens(shard.lengths["sequence"].tolist(), max_tokens))
        most = torch.tensor([mine], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.metadata_group)
        _let_go([most])
        return shard.micro_batches(max_tokens, pad_to=int(most))

    def _others(self) -> list[int]:
        return [rank for rank in range(self.world) if rank != self.src]

    def _send_all(self, messages: dict[int, tuple[int, bytes, torch.Tensor | None]]) -> None:
        """Every rank's sizes and header over the metadata group, then the
        payloads over `group`: each group carries a rank's messages in the
        order it receives them, and no rank's sizes wait behind another
        rank's payload."""
        requests, in_flight = [], []

        def send(tensor: torch.Tensor, rank: int, group) -> None:
            if tensor.numel():
                request = dist.isend(tensor, self._global(rank), group=group)
                assert request is not None  # None only on a rank outside `group`, which this one is in
                requests.append(request)
                in_flight.append(tensor)  # alive until sent

        for rank, (kind, header, payload) in messages.items():
            header_tensor = torch.frombuffer(bytearray(header), dtype=torch.uint8)
            payload_bytes = 0 if payload is None else payload.numel()
            send(torch.tensor([kind, header_tensor.numel(), payload_bytes], dtype=torch.int64), rank,
                 self.metadata_group)
            send(header_tensor, rank, self.metadata_group)
        for rank, (_, _, payload) in messages.items():
            if payload is not None:
                send(payload.to(self.device), rank, self.group)
        for request in requests:
            request.wait()

    def _receive(self) -> Batch:
        src = self._global(self.src)
        sizes = torch.zeros(3, dtype=torch.int64)
        dist.recv(sizes, src, group=self.metadata_group)
        kind, header_bytes, payload_bytes = sizes.tolist()
        received = torch.empty(header_bytes, dtype=torch.uint8)
        if header_bytes:
            dist.recv(received, src, group=self.metadata_group)
        header = bytes(received.numpy())
        if kind != _SHARD:
            _raise_ending(kind, header.decode(), "to produce a batch")
        payload = torch.empty(payload_bytes, dtype=torch.uint8, device=self.device)
        if payload_bytes:
            dist.recv(payload, src, group=self.group)
        doc = msgpack.unpackb(header, raw=False)
        self.rank_tokens = tuple(doc["rank_tokens"])
        return _shard_of(doc, payload)

    def commit(self, shard: Batch, step: int | None = None) -> None:
        """Collective: every rank finished batch `shard.seq`; the source
        commits it (at `step`, `Consumer.commit`). The step the source
        recorded (and, checkpointing, its run and lineage) go to every
        rank's ledger."""
        lineage = self._agree(shard, "commit", step=step)
        if self.ledger is not None:  # once every rank agreed: a rank lost before that commits nothing
            shard.record(self.ledger, "committed", rank=self.rank, **lineage)

    def _lineage_of_commit(self) -> dict:
        """On the source: the run, lineage and step of its last commit (none when it deletes on commit)."""
        if not self.client.checkpointed:
            return {}
        state = self.client.position
        return {"run": state.run, "lineage": state.lineage, "step": state.step}

    def release(self, shard: Batch) -> None:
        """Collective: give the batch back for redelivery."""
        self._agree(shard, "release")

    def _agree(self, shard: Batch, action: str, **options) -> dict:
        """Every rank holds `shard`; the source does `action` with its batch.
        The run, lineage and step a commit recorded, on every rank."""
        self._same(shard.seq, f"collective {action} out of step: ranks hold batches", "")

        def act() -> dict:
            getattr(self.client, action)(self._batches.pop(shard.seq), **options)
            return self._lineage_of_commit() if action == "commit" else {}
        return self._from_source(act, f"to {action}")

    def _from_source(self, action, what: str) -> dict:
        """Run `action` on the source and end the same way on every rank: its
        result (plain data) everywhere, or, when it raised, the source
        re-raises and the others raise `ConsumerClosed` (the source's client
        was closed meanwhile) or `SourceRankFailed`, so no rank goes on to
        wait for a source that has stopped."""
        outcome: dict = {}
        error = None
        if self.rank == self.src:
            try:
                outcome = {"value": action()}
            except BaseException as exc:
                error = exc
                kind, said = _ending(exc)
                outcome = {"kind": kind, "said": said}
        outcome = self._broadcast(outcome)
        if error is not None:
            raise error
        if "kind" in outcome:
            _raise_ending(outcome["kind"], outcome["said"], what)
        return outcome["value"]

    def _same(self, value: int, problem: str, unit: str) -> None:
        """Check every rank passed the same `value` (an all-gather)."""
        mine = torch.tensor([value], dtype=torch.int64)
        gathered = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(gathered, mine, group=self.metadata_group)
        _let_go([mine, *gathered])
        values = [int(v) for v in gathered]
        if len(set(values)) != 1:
            raise InvalidState(f"{problem} {values}, expected all {value}{unit}")

    def sealed(self, step: int) -> None:
        """Collective: the checkpoint after `step` is durable on every rank; the source tells the brokers."""
        self._same(step, "collective sealed out of step: ranks sealed steps", "")

        def seal() -> dict:
            self.client.sealed(step)
            if self.ledger is not None:
                self.ledger.write("sealed", step=step)
            return {}
        self._from_source(seal, "to seal")

    def state_dict(self) -> dict:
        """Collective: the source's data position (`Consumer.state_dict`),
        the same on every rank, to save with each rank's checkpoint."""
        return self._from_source(lambda: self.client.state_dict(), "to give its state")

    def _broadcast(self, value: dict) -> dict:
        """The source's `value` (plain data), on every rank."""
        size = torch.zeros(1, dtype=torch.int64)
        packed = b""
        if self.rank == self.src:
            packed = msgpack.packb(value, use_bin_type=True)
            size[0] = len(packed)
        dist.broadcast(size, self._global(self.src), group=self.metadata_group)
        _let_go([size])
        data = (torch.frombuffer(bytearray(packed), dtype=torch.uint8) if self.rank == self.src
                else torch.empty(int(size), dtype=torch.uint8))
        if int(size):
            dist.broadcast(data, self._global(self.src), group=self.metadata_group)
            _let_go([data])
        return msgpack.unpackb(bytes(data.numpy()), raw=False)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.ledger is not None:
            self.ledger.close()
