"""A valid batch's hot paths never wait on the device.

Every host read of a device value (`.item()`, `bool(tensor)`, `nonzero`, a
boolean-mask index, a `repeat_interleave` that must learn its output size,
a copy back to the host) stalls the CPU until the GPU catches up. These
tests run packing, validation, sharding, the train-data view and the trainer
primitives on a valid batch while counting such reads at two levels: the
operators torch dispatches (`HostReads`, a `TorchDispatchMode`) and the
Python-level reads of a tensor (`Tensor.item`, `tolist`, `__bool__`, ...,
wrapped for the duration). They run on the CPU through the torch ops a GPU
runs (validation's numpy view is switched off), so they need no GPU; with
CUDA present they also run on it under `torch.cuda.set_sync_debug_mode("warn")`,
each synchronizing call's warning counted as a read where it happens.

A read is allowed only where `ALLOWED` names the function it happens in,
with the reason.
"""
from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from consumer_helpers import VOCAB, deliveries
from torch.utils._python_dispatch import TorchDispatchMode

from rollstream.common import validation
from rollstream.consumer import Batch, checked_batch, validate_batch
from rollstream.consumer import validate as validate_module
from rollstream.consumer.primitives import dense_support_mask, masked_log_probs, support_kl
from rollstream.consumer.sharding import partition_batch

ROOT = Path(__file__).resolve().parents[1]

# Where a read is expected, by the function it happens in (file relative to the repo, qualified name): why.
ALLOWED = {
    ("common/validation.py", "Verdict.passed"): "the verdict: the one read that says whether a batch broke any rule",
    ("consumer/batch.py", "_host_buffer"): "the numpy view of a host staging buffer, filled before its upload",
    ("common/validation.py", "_compiled_inside"): "numpy views of CPU tensors for the compiled support check (it takes "
                                                  "no tensor on another device)",
    ("consumer/batch.py", "Batch.to_train_data"): "miles' rewards, rollout ids and loss-mask sums are host lists: "
                                                   "one read for the three",
}

# Operators whose result (or its size) depends on a device value.
_READ_OPS = frozenset({
    "_local_scalar_dense", "nonzero", "nonzero_numpy", "argwhere", "masked_select", "is_nonzero", "equal",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount", "histc",
})
_PYTHON_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@dataclass(frozen=True)
class Read:
    what: str
    where: str  # the innermost frame in the package, `file:line in function`
    allowed: str | None  # the reason, when `ALLOWED` lists where it happens


def _site() -> tuple[str, str | None]:
    """The innermost package frame of the current stack, and the reason it may read, if any."""
    frame = sys._getframe(1)
    while frame is not None:  # innermost first
        filename = frame.f_code.co_filename
        path = Path(filename).resolve()
        if (not filename.startswith("<") and ROOT in path.parents
                and path.relative_to(ROOT).parts[0] not in ("tests", ".venv")):
            relative = str(path.relative_to(ROOT))
            name = frame.f_code.co_qualname
            return f"{relative}:{frame.f_lineno} in {name}", ALLOWED.get((relative, name))
        frame = frame.f_back
    return "outside the package", None


def _reads_device(func, args, kwargs) -> str | None:
    """The name of `func` when it must read a device value, else None."""
    name = func.overloadpacket.__name__
    if name in _READ_OPS:
        return name
    if name == "repeat_interleave" and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    if name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None):
        return f"{name} with a boolean mask"
    if name in ("_to_copy", "copy_"):
        source, target = (args[0], kwargs.get("device")) if name == "_to_copy" else (args[1], args[0].device)
        if target is not None and torch.device(target).type == "cpu" and source.device.type != "cpu":
            if name == "copy_" and _non_blocking(args, kwargs) and args[0].is_pinned():
                return None  # queued behind the device's work into pinned memory: nothing waits until it is read
            return f"{name} to the host"
    return None


def _non_blocking(args, kwargs) -> bool:
    """`copy_(src, non_blocking)`'s flag."""
    return bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))


class HostReads(TorchDispatchMode):
    """Records every dispatched operator that reads a device value."""

    def __init__(self, found: list[Read]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _reads_device(func, args, kwargs)
        if what is not None:
            self.found.append(Read(f"aten.{what}", *_site()))
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_reads(monkeypatch):
    """Every host read while the block runs, at the operator and the Python level."""
    found: list[Read] = []
    with monkeypatch.context() as patch:
        for name in _PYTHON_READS:
            original = getattr(torch.Tensor, name)

            def wrapped(self, *args, _original=original, _name=name, **kwargs):
                found.append(Read(f"Tensor.{_name}", *_site()))
                return _original(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, wrapped)
        sync_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else None
        if sync_mode is not None:
            # Every synchronizing CUDA call (those the operator level would miss too) warns, and each warning is a
            # read at its site, which `ALLOWED` judges like the others ("error" would raise at allowed ones as well).
            torch.cuda.set_sync_debug_mode("warn")
            shown = warnings.showwarning

            def seen(message, category, *args, **kwargs):
                if "synchronizing CUDA operation" in str(message):
                    found.append(Read(f"sync: {message}", *_site()))
                else:
                    shown(message, category, *args, **kwargs)

            patch.setattr(warnings, "showwarning", seen)
        try:
            with warnings.catch_warnings(), HostReads(found):
                warnings.simplefilter("always")  # every sync, not only each site's first
                yield found
        finally:
            if sync_mode is not None:
                torch.cuda.set_sync_debug_mode(sync_mode)


def assert_no_reads(found: list[Read]) -> None:
    """No read outside `ALLOWED`."""
    bad = [r for r in found if r.allowed is None]
    sites = {(r.what, r.where): r for r in found}
    listing = "\n  ".join(f"{r.what} at {r.where}" + (f" (allowed: {r.allowed})" if r.allowed else "")
                          for r in sites.values())
    assert not bad, (f"rule 'a valid batch reads nothing back from the device' broken: expected no read outside "
                     f"ALLOWED, got {len(bad)} of {len(found)} reads at {len(sites)} sites:\n  {listing}")


def scalar_reads(found: list[Read]) -> int:
    """Device values read back, each once (a Python-level read dispatches `_local_scalar_dense` too)."""
    return sum(r.what == "aten._local_scalar_dense" for r in found)


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch):
    """The device the batch lives on; on the CPU, validation runs the torch ops a GPU runs."""
    if request.param == "cpu":
        monkeypatch.setattr(validate_module, "_on_device_array", lambda tensor: tensor)
    return torch.device(request.param)


def _deliveries(seed: int = 0, size: int = 6):
    return deliveries(np.random.default_rng(seed), size, turns=3)


def test_packing_reads_nothing(device, monkeypatch):
    items = _deliveries()
    with host_reads(monkeypatch) as found:
        Batch.from_deliveries(items, device=device)
    assert_no_reads(found)


def test_validating_a_valid_batch_reads_once(device, monkeypatch):
    items = _deliveries()
    batch = Batch.from_deliveries(items, device=device)
    with host_reads(monkeypatch) as found:
        validate_batch(batch, vocab_size=VOCAB)
    assert_no_reads(found)
    assert scalar_reads(found) == 1  # the verdict
    with host_reads(monkeypatch) as found:
        _, violations, _ = checked_batch(items, device=device, vocab_size=VOCAB)
    assert violations == []
    assert_no_reads(found)
    # On the CPU with the compiled module, packing checked every sample as it copied it: no verdict to read.
    packing_checks = torch.device(device).type == "cpu" and validation._native is not None
    assert scalar_reads(found) == (0 if packing_checks else 1)


def test_sharding_reads_nothing(device, monkeypatch):
    batch = Batch.from_deliveries(_deliveries(), device=device)
    with host_reads(monkeypatch) as found:
        shards = [batch.select(part) for part in partition_batch(batch, 3)]
        Batch.concat(shards)
        batch.micro_batches(40)
    assert_no_reads(found)


def test_train_data_reads_nothing(device, monkeypatch):
    batch = Batch.from_deliveries(_deliveries(), device=device)
    with host_reads(monkeypatch) as found:
        batch.to_train_data()
    assert_no_reads(found)
    assert scalar_reads(found) <= 1


def _sampler_log_probs(batch: Batch) -> torch.Tensor:
    """A sampler's log-prob per mask id, on the batch's device, short of summing to 1 over each support."""
    generator = torch.Generator().manual_seed(0)
    return (-4 * torch.rand(len(batch.mask_ids), generator=generator)).to(batch.mask_ids.device)


def test_primitives_read_nothing_over_a_batchs_response_axis_and_once_for_positions_on_the_device(device, monkeypatch):
    """Rows that are the mask's tokens in order (a batch's response axis,
    `positions` omitted): forward and backward read nothing. Rows picked by
    `positions` on the device cost one read, of their count and bounds."""
    batch = Batch.from_deliveries(_deliveries(), device=device)
    rows = len(batch.response_tokens)
    logits = torch.randn(rows, VOCAB, device=device, requires_grad=True)
    with host_reads(monkeypatch) as found:
        masked_log_probs(logits, batch.response_tokens, batch.mask_ids, batch.mask_offsets).sum().backward()
        dense_support_mask(logits, batch.mask_ids, batch.mask_offsets, None)
    assert_no_reads(found)
    sampler = _sampler_log_probs(batch)
    with host_reads(monkeypatch) as found:
        support_kl(logits, batch.mask_ids, batch.mask_offsets, sampler, temperature=0.8).sum().backward()
    assert_no_reads(found)
    assert not found, found  # not even an allowed one
    positions = torch.arange(rows, device=device)
    with host_reads(monkeypatch) as found:
        masked_log_probs(logits, batch.response_tokens, batch.mask_ids, batch.mask_offsets, positions)
    assert {r.where.split(" in ")[-1] for r in found} == {"_support_entries"}, found
    assert len({r.where for r in found if r.what.startswith("Tensor.")}) == 1, found


def test_checked_primitives_read_the_verdict_once(device, monkeypatch):
    """`check=True` adds one read to a call, the verdict of the content
    rules (`Verdict.passed`): over a batch's response axis it is the only
    one; rows picked by `positions` on the device add the count's."""
    batch = Batch.from_deliveries(_deliveries(), device=device)
    rows = len(batch.response_tokens)
    logits = torch.randn(rows, VOCAB, device=device, requires_grad=True)
    sampler = _sampler_log_probs(batch)
    for call in (lambda: masked_log_probs(logits, batch.response_tokens, batch.mask_ids, batch.mask_offsets,
                                          check=True).sum().backward(),
                 lambda: dense_support_mask(logits, batch.mask_ids, batch.mask_offsets, None, check=True),
                 lambda: support_kl(logits, batch.mask_ids, batch.mask_offsets, sampler, check=True).sum().backward()):
        with host_reads(monkeypatch) as found:
            call()
        assert_no_reads(found)
        assert scalar_reads(found) == 1, found
    positions = torch.arange(rows, device=device)
    with host_reads(monkeypatch) as found:
        masked_log_probs(logits, batch.response_tokens, batch.mask_ids, batch.mask_offsets, positions, check=True)
    found = [r for r in found if not r.where.endswith(" in _compiled_inside")]  # views of CPU tensors (ALLOWED)
    assert {r.where.split(" in ")[-1] for r in found} == {"_support_entries", "Verdict.passed"}, found
    assert len({r.where for r in found if r.what.startswith("Tensor.")}) == 2, found


def test_the_guard_sees_reads(monkeypatch):
    """Each kind of read the guard looks for is seen (a guard that saw nothing would pass everything)."""
    values = torch.arange(5)
    mask = values > 2
    with host_reads(monkeypatch) as found:
        values.sum().item()
        bool(mask.any())
        values[mask]
        values.nonzero()
        torch.repeat_interleave(values, values)
        values.tolist()
    kinds = {r.what for r in found}
    assert {"Tensor.item", "Tensor.__bool__", "Tensor.tolist", "aten._local_scalar_dense", "aten.nonzero",
            "aten.index with a boolean mask", "aten.repeat_interleave without output_size"} <= kinds, kinds
    assert all(r.where == "outside the package" and r.allowed is None for r in found)


class Uploads(TorchDispatchMode):
    """Records every host-to-device copy: the function it came from, and whether its source is pinned."""

    def __init__(self, found: list[tuple[str, bool]]):
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_"):
            source, target = (args[0], kwargs.get("device")) if name == "_to_copy" else (args[1], args[0].device)
            if target is not None and torch.device(target).type == "cuda" and source.device.type == "cpu":
                self.found.append((_site()[0], source.is_pinned()))
        return func(*args, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host-to-device copies")
def test_uploads_come_from_pinned_memory_and_a_shard_takes_one():
    device = torch.device("cuda", torch.cuda.current_device())
    found: list[tuple[str, bool]] = []
    with Uploads(found):
        batch = Batch.from_deliveries(_deliveries(), device=device)
        packing = len(found)
        shard = batch.select([0, 2, 3])
        assert len(found) == packing + 1, found[packing:]
        shard.to_train_data()
        shard.local_mask_offsets()
    pageable = [where for where, pinned in found if not pinned]
    assert not pageable, f"uploads from pageable memory: {pageable}"
