"""A `Batch` as a tensordict `TensorDict`, the container verl and
TransferQueue pass batches in, and back (`Batch.to_tensordict`,
`Batch.from_tensordict`). tensordict is the `tensordict` extra, imported
only when called, so the consumer works without it.

The layout: batch_size [S], on the batch's device, no padding anywhere.

- Every packed field of `Batch.ragged()` (`tokens`, `response_tokens`,
  `loss_mask`, `log_probs`, `full_log_probs`, `mask_ids`, `mask_log_probs`,
  the replay captures) is a nested
  tensor with layout=torch.jagged whose values are the batch's own tensor,
  not a copy: `td["log_probs"][i]` is sample i's. Fields on one axis share
  one offsets tensor, so `td["log_probs"] * td["loss_mask"]` works (and
  `td["mask_log_probs"]` shares `td["mask_ids"]`'s: entry j of sample i is
  the log-prob of id `td["mask_ids"][i][j]`);
  `td["tokens"].offsets()` is `cu_seqlens` as int64.
- `mask_offsets` (with `mask_ids`, when the batch carries masks) is each
  sample's own CSR over its `mask_ids`, as `Batch.sample` gives it:
  response_length + 1 offsets starting at 0, so response token k of sample
  i was drawn from `td["mask_ids"][i][off[k]:off[k + 1]]` with
  `off = td["mask_offsets"][i]`. Offsets per sample stay right under any
  indexing, slicing or concatenation of the TensorDict, where the batch's
  one CSR over all samples would not; they are the one field computed
  (R + S int64) rather than shared.
- `prompt_lengths`, `response_lengths`, `rewards`, `sample_indices` and
  `group_index` are the batch's own [S] tensors (`group_index` is rebuilt
  from `group_ids` on the way back).
- Each host field (`Batch.host_fields()`: `trajectory_ids`, `group_ids`,
  `metadata`, ...) is a NonTensorStack, one Python value per sample.
- `seq` and `token_budget` are NonTensorData.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rollstream.common.errors import ExtraMissing, InvalidInput, InvalidType

from .batch import HOST_FIELDS, PER_SAMPLE, RAGGED, Batch, _offsets_from_sizes, cumsum0, gather_index, to_device

if TYPE_CHECKING:
    from tensordict import TensorDict

EXTRA = "tensordict"
# What `to_tensordict` always writes; `mask_ids` with `mask_offsets` (and `mask_log_probs`), `full_log_probs` and the
# replay captures come when the batch has them.
REQUIRED = ("tokens", "response_tokens", "loss_mask", "log_probs", *PER_SAMPLE, *HOST_FIELDS, "seq", "token_budget")


def to_tensordict(batch: Batch) -> TensorDict:
    """`batch` in the layout of the module docstring."""
    try:
        from tensordict import NonTensorData, NonTensorStack, TensorDict
    except ImportError as error:
        raise ExtraMissing("tensordict", EXTRA, "Batch.to_tensordict") from error
    # One offsets tensor per axis, shared by its fields; the response axis's is the batch's own.
    offsets = {"response": batch.response_cu}

    def jagged(values: torch.Tensor, axis: str, lengths: np.ndarray) -> torch.Tensor:
        if axis not in offsets:
            offsets[axis] = to_device(cumsum0(lengths), batch.device)
        # The shortest and longest sample from the host: padding them never reads the offsets back from the device.
        low, high = (int(lengths.min()), int(lengths.max())) if len(lengths) else (None, None)
        return torch.nested.nested_tensor_from_jagged(values, offsets[axis], min_seqlen=low, max_seqlen=high)

    fields: dict[str, Any] = {name: jagged(values, RAGGED[name], batch.lengths[RAGGED[name]])
                              for name, values in batch.ragged().items()}
    if batch.has_mask:
        fields["mask_offsets"] = jagged(batch.local_mask_offsets(), "mask_offsets", batch.lengths["response"] + 1)
    fields.update({name: getattr(batch, name) for name in (*PER_SAMPLE, "group_index")})
    fields.update({name: NonTensorStack(*(NonTensorData(value) for value in values))
                   for name, values in batch.host_fields().items()})
    fields["seq"], fields["token_budget"] = NonTensorData(batch.seq), NonTensorData(batch.token_budget)
    return TensorDict(fields, batch_size=[len(batch)], device=batch.device)


def _packed(td: TensorDict, name: str) -> tuple[torch.Tensor, np.ndarray]:
    """A jagged field's packed values (a view) and its per-sample lengths."""
    nested = td.get(name)
    if not (isinstance(nested, torch.Tensor) and nested.is_nested and nested.layout == torch.jagged):
        raise InvalidType(f"TensorDict field {name!r} must be a nested tensor with layout torch.jagged (Batch.to_tensordict's "
                          f"layout), got {type(nested).__name__} with layout {getattr(nested, 'layout', None)}")
    if not nested.is_contiguous():  # one with holes (a narrowed view): values end to end first
        nested = nested.contiguous()
    return nested.values(), np.diff(nested.offsets().cpu().numpy())  # type: ignore[attr-defined]  # not in torch stubs


def _one_value(td: TensorDict, name: str) -> Any:
    """A per-batch value; TensorDicts of several batches concatenated keep
    the first one's, as `Batch.concat` does."""
    values = td[name]
    return values[0] if isinstance(values, list) else values


def _expect(rule: str, expected: np.ndarray, got: np.ndarray) -> None:
    if not np.array_equal(got, expected):
        raise InvalidInput(f"rule '{rule}' broken: expected per sample {expected.tolist()}, got {got.tolist()}")


def batch_fields(td: TensorDict) -> dict[str, Any]:
    """`Batch._assemble`'s arguments from a TensorDict in the layout of the
    module docstring, its packed tensors shared. Checked: the fields are
    there and each jagged one has its sample's length; the content rules
    (supports, vocabulary) are `validate_batch`'s."""
    if len(td.batch_size) != 1:
        raise InvalidInput(f"a batch's TensorDict has one batch dimension, its samples: expected batch_size [S], "
                           f"got {list(td.batch_size)}")
    keys = set(td.keys())
    missing = [name for name in (*REQUIRED, *(("mask_offsets",) if "mask_ids" in keys else ())) if name not in keys]
    if missing:
        raise InvalidInput(f"a batch's TensorDict holds every field Batch.to_tensordict writes: missing {missing}")
    per_sample = {name: td.get(name) for name in PER_SAMPLE}
    response = per_sample["response_lengths"].cpu().numpy().astype(np.int64)
    prompt = per_sample["prompt_lengths"].cpu().numpy().astype(np.int64)
    lengths = {"prompt": prompt, "response": response, "sequence": prompt + response}

    def aligned(name: str, axis: str, got: np.ndarray) -> None:
        _expect(f"a sample's fields on one axis have one length ({name!r} on the {axis} axis)",
                lengths.setdefault(axis, got), got)

    ragged = {}
    for name, axis in RAGGED.items():
        if name in keys:
            ragged[name], got = _packed(td, name)
            aligned(name, axis, got)
    beside = [name for name, axis in RAGGED.items() if axis == "mask_ids" and name != "mask_ids" and name in ragged]
    if beside and "mask_ids" not in ragged:
        raise InvalidInput(f"a batch's TensorDict holds {beside[0]!r} beside 'mask_ids' and 'mask_offsets', which it "
                           "lacks (one entry per support id needs the supports)")
    mask_offsets = None
    if "mask_ids" in ragged:
        local, counts = _packed(td, "mask_offsets")
        _expect("a sample has response_length + 1 mask_offsets", response + 1, counts)
        firsts = cumsum0(counts)[:-1]
        first, last = (local[torch.as_tensor(at, device=local.device)] for at in (firsts, firsts + response))
        _expect("a sample's mask_offsets span its mask_ids", lengths["mask_ids"], (last - first).cpu().numpy())
        ends, starts = (local[gather_index(at, response, local.device)] for at in (firsts + 1, firsts))
        mask_offsets = _offsets_from_sizes(ends - starts)
    host = {name: tuple(td.get(name).tolist()) for name in HOST_FIELDS}
    return {"seq": _one_value(td, "seq"), "device": ragged["tokens"].device, "ragged": ragged, "per_sample": per_sample,
            "mask_offsets": mask_offsets, "lengths": lengths, "host": host, "token_budget": _one_value(td, "token_budget")}
