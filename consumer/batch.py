"""A training batch: packed torch tensors on one device.

Samples lie end to end. `tokens` holds each sample's prompt then response
(`cu_seqlens` bounds them, as variable-length attention wants); the
per-response-token fields (`response_tokens`, `loss_mask`, `log_probs`,
`full_log_probs` when the samples carry them) and the whole batch's
sampling mask (one CSR, `mask_offsets` over all response tokens) are packed
on the response axis, bounded by `response_cu`; `mask_log_probs`, when the
samples carry them, lie beside `mask_ids`, one per support id. Replay captures
(`routed_experts`, `indexer_topk`) are packed along their first dimension.
Host-side per-sample facts (ids, statuses, gaps, ...) are tuples,
and the per-sample lengths of every packed field are kept on the host too,
so selecting, concatenating and shipping a batch never waits on the device.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch

from rollstream.common.checker import Ledger, delivered_digest
from rollstream.common.contract import CONTEXT_REPLAY_ARRAYS, SUPPORT_LOG_PROB_ARRAYS, TOKEN_LOG_PROB_ARRAYS
from rollstream.common.errors import InvalidInput, InvalidType, OutOfRange, RemoteProtocolError
from rollstream.common.miles import (
    MASK_KEYS,
    REPLAY_KEYS,
    SUPPORT_LOG_PROB_KEYS,
    TOKEN_LOG_PROB_KEYS,
    TRAIN_DTYPES,
    metric_view,
    rollout_keys,
    weight_version_calls,
)
from rollstream.common.trajectory import Gap
from rollstream.common.validation import pack_checked, pack_csr
from rollstream.common.versions import ordered_version

from .assembly import Delivery

if TYPE_CHECKING:
    from tensordict import TensorDict

# Packed fields and the per-sample length that bounds each one.
RAGGED = {
    "tokens": "sequence",
    "response_tokens": "response",
    "loss_mask": "response",
    "log_probs": "response",
    **dict.fromkeys(TOKEN_LOG_PROB_ARRAYS, "response"),
    "mask_ids": "mask_ids",
    **dict.fromkeys(SUPPORT_LOG_PROB_ARRAYS, "mask_ids"),  # one per support id, beside the ids
    **{name: name for name in CONTEXT_REPLAY_ARRAYS},
}
PER_SAMPLE = ("prompt_lengths", "response_lengths", "rewards", "sample_indices")
HOST_FIELDS = (
    "trajectory_ids", "statuses", "gaps", "group_ids", "raw_rewards", "metadata", "weight_versions",
    "weight_version_spans", "leases", "positions",
)
# Train-data keys `metrics` does not average: ids and counts, and `truncated` (a fraction there already).
_NOT_AVERAGED = frozenset({"tokens", "sample_indices", "rollout_ids", "rollout_mask_sums", "truncated"})


def spans_of(turns) -> tuple[tuple[tuple[str, int, int], ...], ...]:
    """A sample's weight-version spans as read off the wire (lists) as tuples."""
    return tuple(tuple((version, start, end) for version, start, end in spans) for spans in turns)


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype."""
    return torch.from_numpy(np.empty(0, dtype)).dtype


def as_device(device=None) -> torch.device:
    """`device` (by default CUDA when present, else the CPU) as the tensors
    on it name it: a bare `cuda` is the current CUDA device, with its index,
    so a batch's `device` equals its tensors' and a shard's."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def same_device(a, b) -> bool:
    """Whether `a` and `b` name one device: compared by type and index, a
    missing index meaning the current device (0 without CUDA)."""

    def indexed(device) -> tuple[str, int]:
        device = as_device(device)
        return device.type, 0 if device.index is None else device.index

    return indexed(a) == indexed(b)


def _host_buffer(shape, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """A host buffer to fill and its numpy view: pinned when it will be
    copied to CUDA (a non-blocking copy from pageable memory blocks)."""
    host = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
    return host, host.numpy()


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A non-blocking copy from pinned memory is safe to let go of: torch's
    # pinned allocator keeps the block until the copy has finished.
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array on `device` (shared memory on the CPU)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        host, view = _host_buffer(host.shape, host.dtype, device)
        view[...] = array
    return _upload(host, device)


def to_device_together(arrays: Mapping[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """int64 host arrays on `device` in one copy: laid end to end in one
    (pinned) buffer, then split into views on the device."""
    sizes = [len(values) for values in arrays.values()]
    host, view = _host_buffer((sum(sizes),), torch.int64, device)
    if arrays:
        np.concatenate(list(arrays.values()), out=view, casting="same_kind")
    return dict(zip(arrays, _upload(host, device).split(sizes)))


def concat_to_device(parts: Sequence[np.ndarray], dtype: npt.DTypeLike, device: torch.device, trailing=()) -> torch.Tensor:
    """`parts` concatenated along dim 0 straight into a (pinned) host buffer, then on `device`."""
    host, view = _host_buffer((sum(len(part) for part in parts), *trailing), torch_dtype(dtype), device)
    if parts:
        np.concatenate(parts, out=view)
    return _upload(host, device)


def cumsum0(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(values, out=out[1:])
    return out


def group_index(group_ids: Sequence[str | None]) -> np.ndarray:
    """Per sample, its group's number in first-appearance order; a sample
    without a group is a group of its own."""
    numbers: dict[Any, int] = {}
    return np.array(
        [numbers.setdefault(gid if gid is not None else ("sample", i), len(numbers)) for i, gid in enumerate(group_ids)],
        dtype=np.int64,
    )


def ranges_index(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """Index of the ranges `[starts[k], starts[k] + lengths[k])` laid end to
    end, `total` entries in all (one repeat and one add, no loop over ranges)."""
    device = lengths.device
    shift = starts - (torch.cumsum(lengths, 0) - lengths)
    owner = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths, output_size=total)
    return torch.arange(total, device=device) + shift[owner]


def gather_index(starts: np.ndarray, lengths: np.ndarray, device: torch.device) -> torch.Tensor:
    """`ranges_index` of host-known ranges, built on `device` (both uploaded in one copy)."""
    uploaded = to_device_together({"starts": starts, "lengths": lengths}, device)
    return ranges_index(uploaded["starts"], uploaded["lengths"], int(lengths.sum()))


def reward_value(reward, reward_key: str | None, trajectory_id: str) -> float:
    if type(reward) is not float and isinstance(reward, Mapping):  # the common float skips typing's slow isinstance
        if reward_key is None or reward_key not in reward:
            raise InvalidInput(
                f"trajectory {trajectory_id!r} has a map reward with keys {sorted(reward)}; expected a number, "
                f"or a reward_key naming one of them (got reward_key={reward_key!r})"
            )
        reward = reward[reward_key]
    return float(reward)


def pack_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: positions grouped so that each group's lengths
    sum to at most `max_tokens`; a length over it goes alone. Groups come in
    the order they opened (the longest sample's first), each ascending."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidInput(f"max_tokens must be an int of at least 1, got {max_tokens!r}")
    room: list[int] = []  # per group, the tokens it has left (below 0 for a sample over the limit, alone)
    groups: list[list[int]] = []
    for position in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = lengths[position]
        fit = next((g for g, left in enumerate(room) if size <= left), None)
        if fit is None:
            fit = len(groups)
            room.append(max_tokens)
            groups.append([])
        room[fit] -= size
        groups[fit].append(position)
    return [sorted(positions) for positions in groups]


_CPU = torch.device("cpu")
# What `pack_checked` writes, in its order.
_PACKED_CHECKED_OUT = ("tokens", "response_tokens", "log_probs", "loss_mask", "mask_ids", "mask_offsets",
                       *TOKEN_LOG_PROB_ARRAYS, *SUPPORT_LOG_PROB_ARRAYS)


def _packed_per_token(arrays: Sequence[Mapping[str, np.ndarray]], lengths: Mapping[str, np.ndarray], masked: bool,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """The per-token and per-id arrays the samples carry, each laid end to
    end on `device` (the support ids and offsets by `pack_csr`)."""
    sequences = [part for a in arrays for part in (a["prompt_tokens"], a["tokens"])]
    ragged = {
        "tokens": concat_to_device(sequences, np.int32, device),
        "response_tokens": concat_to_device([a["tokens"] for a in arrays], np.int32, device),
        "loss_mask": concat_to_device([a["loss_mask"] for a in arrays], np.uint8, device),
        "log_probs": concat_to_device([a["log_probs"] for a in arrays], np.float32, device),
    }
    if masked:
        ids, ids_view = _host_buffer((int(lengths["mask_ids"].sum()),), torch.int32, device)
        offsets, offsets_view = _host_buffer((int(lengths["response"].sum()) + 1,), torch.int64, device)
        pack_csr([a["mask_ids"] for a in arrays], [a["mask_offsets"] for a in arrays], out=(ids_view, offsets_view))
        ragged["mask_ids"], ragged["mask_offsets"] = _upload(ids, device), _upload(offsets, device)
    for name in (*TOKEN_LOG_PROB_ARRAYS, *(SUPPORT_LOG_PROB_ARRAYS if masked else ())):  # the support's as the ids
        if arrays and name in arrays[0]:
            ragged[name] = concat_to_device([a[name] for a in arrays], np.float32, device)
    return ragged


def _packed_checked(arrays: list[Mapping[str, np.ndarray]], lengths: Mapping[str, np.ndarray], masked: bool,
                    vocab_size: int | None) -> tuple[dict[str, torch.Tensor], bool] | None:
    """`_packed_per_token` on the CPU by `pack_checked`, with whether every
    sample kept the per-token rules; None where it cannot pack them."""
    sequence, response = int(lengths["sequence"].sum()), int(lengths["response"].sum())
    ids = int(lengths["mask_ids"].sum()) if masked else 0
    sizes = {"tokens": (sequence, torch.int32), "response_tokens": (response, torch.int32),
             "log_probs": (response, torch.float32), "loss_mask": (response, torch.uint8)}
    if masked:
        sizes.update(mask_ids=(ids, torch.int32), mask_offsets=(response + 1, torch.int64))
        sizes.update((name, (ids, torch.float32)) for name in SUPPORT_LOG_PROB_ARRAYS if name in arrays[0])
    sizes.update((name, (response, torch.float32)) for name in TOKEN_LOG_PROB_ARRAYS if name in arrays[0])
    buffers = {name: _host_buffer((size,), dtype, _CPU) for name, (size, dtype) in sizes.items()}
    valid = pack_checked(arrays, [buffers[name][1] if name in buffers else None for name in _PACKED_CHECKED_OUT], vocab_size)
    return None if valid is None else ({name: host for name, (host, _) in buffers.items()}, valid)


@dataclass(frozen=True, eq=False)
class Batch:
    """Packed samples on `device`; see the module docstring for the layout.

    `seq` identifies the batch to `commit`; a shard keeps its batch's `seq`
    and in `positions` each sample's place in that batch.
    """

    seq: int
    device: torch.device
    tokens: torch.Tensor  # int32 [sum(prompt + response)]
    cu_seqlens: torch.Tensor  # int32 [S + 1], bounds of `tokens`
    response_tokens: torch.Tensor  # int32 [R], each sample's response
    response_cu: torch.Tensor  # int64 [S + 1], bounds on the response axis
    prompt_lengths: torch.Tensor  # int64 [S]
    response_lengths: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # uint8 [R]
    log_probs: torch.Tensor  # float32 [R], under the sampler's truncated distribution
    # float32 [R], under the whole vocabulary's (0.0 at forced tokens); None unless every sample carries them, which
    # the whole-batch rule makes a batch's samples do or none (`validate.sample_violations`)
    full_log_probs: torch.Tensor | None
    rewards: torch.Tensor  # float32 [S]
    sample_indices: torch.Tensor  # int64 [S]
    group_index: torch.Tensor  # int64 [S], group number within the batch
    mask_ids: torch.Tensor | None  # int32 [M]
    mask_offsets: torch.Tensor | None  # int64 [R + 1]
    # float32 [M], aligned with `mask_ids`: the sampler's log-prob of each support id (0.0 for a forced token's
    # singleton); None unless every sample carries them (the whole-batch rule, as `full_log_probs`)
    mask_log_probs: torch.Tensor | None
    replay: dict[str, torch.Tensor]  # routed_experts / indexer_topk, packed along dim 0
    lengths: dict[str, np.ndarray]  # host per-sample length of each packed field
    trajectory_ids: tuple[str, ...]
    statuses: tuple[str, ...]
    gaps: tuple[Gap | None, ...]
    group_ids: tuple[str | None, ...]
    raw_rewards: tuple[Any, ...]
    metadata: tuple[Mapping[str, Any], ...]
    weight_versions: tuple[tuple[str, ...], ...]
    # Per weight version, its turn's (version, start, end) spans in response positions (none from an older broker)
    weight_version_spans: tuple[tuple[tuple[tuple[str, int, int], ...], ...], ...]
    leases: tuple[tuple[str, ...], ...]  # when the batch was formed; commit uses the live set
    positions: tuple[int, ...]
    # The tokens it was packed to (`Consumer(batch_tokens=)`, `micro_batches`); shards keep their batch's.
    token_budget: int | None = None

    # -- building -------------------------------------------------------------
    @classmethod
    def from_deliveries(
        cls, deliveries: Sequence[Delivery], *, device=None, seq: int = 0, reward_key: str | None = None
    ) -> "Batch":
        """Pack deliveries whose per-sample structure is already checked
        (`validate.sample_violations`): aligned fields, well-formed offsets,
        every sample carrying the same replay fields."""
        return cls._packed(deliveries, as_device(device), seq, reward_key, check=False)[0]

    @classmethod
    def checked_from_deliveries(
        cls, deliveries: Sequence[Delivery], *, device=None, seq: int = 0, reward_key: str | None = None,
        vocab_size: int | None = None,
    ) -> tuple["Batch", bool]:
        """`from_deliveries`, and whether every per-token rule the check of the
        packed batch applies (`validate.batch_verdict`) was seen to hold while
        packing: on the CPU each sample is checked as it is copied, in one
        compiled pass (`pack_checked`). False says only that it was not seen:
        the packed batch is then checked as usual."""
        return cls._packed(deliveries, as_device(device), seq, reward_key, check=True, vocab_size=vocab_size)

    @classmethod
    def _packed(cls, deliveries: Sequence[Delivery], device: torch.device, seq: int, reward_key: str | None, *,
                check: bool, vocab_size: int | None = None) -> tuple["Batch", bool]:
        """The batch, and whether packing saw every per-token rule kept (asked only with `check`)."""
        arrays = [d.arrays for d in deliveries]
        prompt = np.array([len(a["prompt_tokens"]) for a in arrays], dtype=np.int64)
        response = np.array([len(a["tokens"]) for a in arrays], dtype=np.int64)
        lengths = {"prompt": prompt, "response": response, "sequence": prompt + response}
        masked = bool(arrays) and "mask_ids" in arrays[0]
        if masked:
            lengths["mask_ids"] = np.array([len(a["mask_ids"]) for a in arrays], dtype=np.int64)
        packed = None
        if check and device.type == "cpu" and arrays:
            packed = _packed_checked(arrays, lengths, masked, vocab_size)
        ragged, seen_valid = packed or (_packed_per_token(arrays, lengths, masked, device), False)
        mask_offsets = ragged.pop("mask_offsets", None)
        for name in CONTEXT_REPLAY_ARRAYS:
            if arrays and name in arrays[0]:
                parts = [a[name] for a in arrays]
                ragged[name] = concat_to_device(parts, parts[0].dtype, device, parts[0].shape[1:])
                lengths[name] = np.array([len(part) for part in parts], dtype=np.int64)
        fields = [d.fields for d in deliveries]
        rewards = np.array([reward_value(f["reward"], reward_key, f["trajectory_id"]) for f in fields], np.float32)
        host_per_sample = {
            "prompt_lengths": prompt,
            "response_lengths": response,
            "sample_indices": np.array([f.get("sample_index", i) for i, f in enumerate(fields)], np.int64),
        }
        host = {
            "trajectory_ids": tuple(f["trajectory_id"] for f in fields),
            "statuses": tuple(f["status"] for f in fields),
            "gaps": tuple(Gap(f["gap"]["turn"], f["gap"]["field"]) if "gap" in f else None for f in fields),
            "group_ids": tuple(f.get("group_id") for f in fields),
            "raw_rewards": tuple(f["reward"] for f in fields),
            "metadata": tuple(f["metadata"] for f in fields),
            "weight_versions": tuple(tuple(f["weight_versions"]) for f in fields),
            "weight_version_spans": tuple(spans_of(f.get("weight_version_spans", ())) for f in fields),
            "leases": tuple(tuple(lease for _, lease in sorted(d.leases)) for d in deliveries),
            "positions": tuple(range(len(deliveries))),
        }
        uploaded = to_device_together({**host_per_sample, **_bounds(lengths, host)}, device)
        per_sample = {name: uploaded.pop(name) for name in host_per_sample}
        per_sample["rewards"] = to_device(rewards, device)
        return cls._assemble(seq, device, ragged, per_sample, mask_offsets, lengths, host, bounds=uploaded), seen_valid

    @classmethod
    def _assemble(cls, seq, device, ragged, per_sample, mask_offsets, lengths, host,
                  token_budget: int | None = None, bounds: Mapping[str, torch.Tensor] | None = None) -> "Batch":
        """The derived fields (bounds, group numbers) from the packed ones;
        `bounds`, when the caller uploaded `_bounds` along with its own."""
        device = as_device(device)
        if bounds is None:
            bounds = to_device_together(_bounds(lengths, host), device)
        return cls(
            seq=seq,
            token_budget=token_budget,
            device=device,
            tokens=ragged["tokens"],
            cu_seqlens=bounds["cu_seqlens"].to(torch.int32),
            response_tokens=ragged["response_tokens"],
            response_cu=bounds["response_cu"],
            loss_mask=ragged["loss_mask"],
            log_probs=ragged["log_probs"],
            full_log_probs=ragged.get("full_log_probs"),
            group_index=bounds["group_index"],
            mask_ids=ragged.get("mask_ids"),
            mask_offsets=mask_offsets,
            mask_log_probs=ragged.get("mask_log_probs"),
            replay={name: ragged[name] for name in CONTEXT_REPLAY_ARRAYS if name in ragged},
            lengths=lengths,
            **per_sample,
            **host,
        )

    # -- reading --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.trajectory_ids)

    @property
    def has_mask(self) -> bool:
        return self.mask_offsets is not None

    @property
    def num_tokens(self) -> int:
        return int(self.lengths["sequence"].sum())

    @property
    def over_budget(self) -> bool:
        """More tokens than `token_budget`: a unit (or, in a micro-batch, a
        sample) larger than the budget, which came alone."""
        return self.token_budget is not None and self.num_tokens > self.token_budget

    def ragged(self) -> dict[str, torch.Tensor]:
        """Every packed field present, by name."""
        out = {name: getattr(self, name) for name in ("tokens", "response_tokens", "loss_mask", "log_probs")}
        for name in TOKEN_LOG_PROB_ARRAYS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.mask_ids is not None:
            out["mask_ids"] = self.mask_ids
            for name in SUPPORT_LOG_PROB_ARRAYS:
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)
        out.update(self.replay)
        return out

    def host_fields(self) -> dict[str, tuple]:
        return {name: getattr(self, name) for name in HOST_FIELDS}

    def _masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`mask_ids` and `mask_offsets` of a batch that carries masks (`has_mask`)."""
        if self.mask_ids is None or self.mask_offsets is None:
            raise InvalidType(f"batch {self.seq} carries no sampling-support masks: this needs a batch with has_mask, "
                              "and its has_mask is False")
        return self.mask_ids, self.mask_offsets

    def support_sizes(self) -> torch.Tensor:
        """Ids per response token (the CSR's row lengths)."""
        _, offsets = self._masks()
        return offsets[1:] - offsets[:-1]

    @functools.cached_property
    def token_versions(self) -> torch.Tensor:
        """int64 [R] on `device`, on the response axis: the ordered policy
        version (`rollstream.common.versions.ordered_version`) of the weights
        that sampled each response token, read off `weight_version_spans`
        (the broker gives a turn without spans of its own one span over its
        sampled tokens). -1 where no span covers the token (a forced token,
        or a sample whose broker sent no spans) or its version has no order.
        Derived from fields every reshaping and shard carries, so a selected,
        concatenated or shipped batch has its own."""
        starts, ends, versions = [], [], []
        for tid, base, length, turns in zip(self.trajectory_ids, self._cu["response"][:-1].tolist(),
                                            self.lengths["response"].tolist(), self.weight_version_spans):
            for text, start, end in (span for spans in turns for span in spans):
                if end > length:
                    raise RemoteProtocolError(
                        "misaligned", f"rule 'weight_version_spans lie within the response' violated in {tid!r}: "
                                      f"expected ends <= {length}, got span {[text, start, end]}")
                version = ordered_version(text)
                if version is not None:
                    starts.append(base + start)
                    ends.append(base + end)
                    versions.append(version)
        out = np.full(int(self.lengths["response"].sum()), -1, dtype=np.int64)
        if versions:
            sizes = np.array(ends, np.int64) - np.array(starts, np.int64)
            shift = np.repeat(np.array(starts, np.int64) - (np.cumsum(sizes) - sizes), sizes)
            out[np.arange(int(sizes.sum())) + shift] = np.repeat(np.array(versions, np.int64), sizes)
        return to_device(out, self.device)

    @functools.cached_property
    def _cu(self) -> dict[str, np.ndarray]:
        return {key: cumsum0(values) for key, values in self.lengths.items()}

    def _split(self, values: torch.Tensor, key: str) -> list[torch.Tensor]:
        return list(values.split(self.lengths[key].tolist()))

    def response_index(self) -> torch.Tensor:
        """Where each response token sits in `tokens`; the logits that
        predict it are one row earlier."""
        starts = self._cu["sequence"][:-1] + self.lengths["prompt"]
        return gather_index(starts, self.lengths["response"], self.device)

    def sample_mask_offsets(self) -> list[torch.Tensor]:
        """Each sample's own CSR offsets (starting at 0), in one pass."""
        return list(self.local_mask_offsets().split((self.lengths["response"] + 1).tolist()))

    def local_mask_offsets(self) -> torch.Tensor:
        """`sample_mask_offsets` end to end (R + S entries, a sample's
        response_length + 1 at a time): offsets that stay right whichever
        samples are picked, as the one CSR over the batch does not."""
        counts = self.lengths["response"] + 1  # a sample's offsets share its neighbours' ends
        _, offsets = self._masks()
        ranges = to_device_together({"starts": self._cu["response"][:-1], "counts": counts}, self.device)
        total = int(counts.sum())
        local = offsets[ranges_index(ranges["starts"], ranges["counts"], total)]
        return local - torch.repeat_interleave(offsets[ranges["starts"]], ranges["counts"], output_size=total)

    def sample(self, i: int) -> dict[str, Any]:
        """Views of sample `i`'s fields (its mask offsets start at 0)."""
        if not -len(self) <= i < len(self):
            raise OutOfRange(f"sample index must be in [-{len(self)}, {len(self)}) for a batch of {len(self)}, got {i}")
        i %= len(self)
        out = self._sample_of(i, self.ragged())
        offsets = self.mask_offsets
        if offsets is not None:  # `has_mask`
            lo, hi = int(self._cu["response"][i]), int(self._cu["response"][i + 1])
            out["mask_offsets"] = offsets[lo : hi + 1] - offsets[lo]
        return out

    def _sample_of(self, i: int, ragged: Mapping[str, Any]) -> dict[str, Any]:
        """Sample `i`'s host facts and its slice of each of `ragged` (packed as this batch's fields)."""
        cu = self._cu
        out: dict[str, Any] = {"trajectory_id": self.trajectory_ids[i], "status": self.statuses[i], "gap": self.gaps[i]}
        for name, values in ragged.items():
            key = RAGGED[name]
            out[name] = values[int(cu[key][i]) : int(cu[key][i + 1])]
        return out

    def content_digests(self) -> list[str]:
        """Each sample's content digest as the end-to-end checker computes
        it (`checker.delivered_digest`), from the arrays the trainer got
        (on a GPU, each packed field comes back to the host in one copy)."""
        ragged = {name: values.cpu().numpy() for name, values in self.ragged().items()}
        if self.has_mask:
            local_offsets = self.local_mask_offsets().cpu().numpy()
            offsets_cu = cumsum0(self.lengths["response"] + 1)
        digests = []
        for i in range(len(self)):
            sample = self._sample_of(i, ragged)
            if self.has_mask:
                sample["mask_offsets"] = local_offsets[offsets_cu[i] : offsets_cu[i + 1]]
            prompt = int(self.lengths["prompt"][i])
            digests.append(delivered_digest({**sample, "prompt_tokens": sample["tokens"][:prompt],
                                             "tokens": sample["response_tokens"]}))
        return digests

    def record(self, ledger: Ledger, kind: str, **extra: Any) -> None:
        """Write one ledger record per sample: `handed` (given to the
        trainer) or `committed` (with the content digest, the gap, the
        response tokens and support ids it carried, and its place in the whole
        batch, `positions`)."""
        if kind == "committed":
            ids = self.lengths.get("mask_ids", np.zeros(len(self), np.int64)).tolist()
            for tid, digest, gap, tokens, support_ids, position in zip(
                    self.trajectory_ids, self.content_digests(), self.gaps, self.lengths["response"].tolist(), ids,
                    self.positions):
                ledger.write(kind, id=tid, digest=digest, gap=None if gap is None else [gap.turn, gap.field],
                             tokens=tokens, support_ids=support_ids, position=position, **extra)
        else:
            for tid in self.trajectory_ids:
                ledger.write(kind, id=tid, **extra)

    # -- reshaping ------------------------------------------------------------
    def select(self, samples: Sequence[int]) -> "Batch":
        """A batch of `samples` (positions in this one) in that order, on the
        same device. Its indexes are built on the host and reach the device
        in one copy (`to_device_together`)."""
        picked = np.asarray(samples, dtype=np.int64).reshape(-1)
        cu = self._cu
        ragged_keys = {RAGGED[name] for name in self.ragged()} | ({"response"} if self.has_mask else set())
        lengths = {key: values[picked] for key, values in self.lengths.items()}
        host = {name: tuple(values[i] for i in picked.tolist()) for name, values in self.host_fields().items()}
        indexes = {"picked": picked, **_bounds(lengths, host)}
        for key in ragged_keys:
            indexes[f"{key} starts"] = cu[key][:-1][picked]
            indexes[f"{key} lengths"] = lengths[key]
        uploaded = to_device_together(indexes, self.device)

        def segments(key: str) -> torch.Tensor:
            return ranges_index(uploaded[f"{key} starts"], uploaded[f"{key} lengths"], int(lengths[key].sum()))

        ragged = {name: values[segments(RAGGED[name])] for name, values in self.ragged().items()}
        mask_offsets = _offsets_from_sizes(self.support_sizes()[segments("response")]) if self.has_mask else None
        per_sample = {name: getattr(self, name)[uploaded["picked"]] for name in PER_SAMPLE}
        return Batch._assemble(self.seq, self.device, ragged, per_sample, mask_offsets, lengths, host, self.token_budget,
                               bounds=uploaded)

    def micro_batches(self, max_tokens: int, *, pad_to: int = 0) -> list["Batch"]:
        """This batch (or shard) packed into batches of at most `max_tokens`
        tokens each (`pack_tokens`), so one forward pass holds a bounded
        number of tokens; each has its own `cu_seqlens` and `token_budget`
        `max_tokens`. Empty ones follow up to `pad_to` in all, for ranks
        that must run the same number (`DistributedConsumer.micro_batches`)."""
        plan = pack_tokens(self.lengths["sequence"].tolist(), max_tokens)
        plan += [[]] * (pad_to - len(plan))
        return [replace(self.select(samples), token_budget=max_tokens) for samples in plan]

    @classmethod
    def concat(cls, batches: Sequence["Batch"]) -> "Batch":
        """Samples of `batches` in order (same device, same fields present),
        keeping the first one's `seq` and every sample's `positions`: shards
        of one batch join back into it."""
        first = batches[0]
        names = first.ragged().keys()
        for other in batches[1:]:
            if other.ragged().keys() != names or not same_device(other.device, first.device):
                raise InvalidInput(
                    f"cannot concatenate batches with different fields or devices: {sorted(names)} on {first.device} "
                    f"and {sorted(other.ragged())} on {other.device}"
                )
        ragged = {name: torch.cat([b.ragged()[name] for b in batches]) for name in names}
        mask_offsets = _offsets_from_sizes(torch.cat([b.support_sizes() for b in batches])) if first.has_mask else None
        per_sample = {name: torch.cat([getattr(b, name) for b in batches]) for name in PER_SAMPLE}
        lengths = {key: np.concatenate([b.lengths[key] for b in batches]) for key in first.lengths}
        host = {name: tuple(item for b in batches for item in getattr(b, name)) for name in HOST_FIELDS}
        return cls._assemble(first.seq, first.device, ragged, per_sample, mask_offsets, lengths, host, first.token_budget)

    # -- tensordict -----------------------------------------------------------
    def to_tensordict(self) -> TensorDict:
        """This batch as the TensorDict verl and TransferQueue pass batches
        in (the `tensordict` extra): one entry per sample, no padding, the
        packed tensors shared rather than copied. The layout is
        rollstream.consumer.tensordict_view's docstring."""
        from .tensordict_view import to_tensordict

        return to_tensordict(self)

    @classmethod
    def from_tensordict(cls, td: TensorDict) -> "Batch":
        """The batch a `to_tensordict` TensorDict holds, also after it was
        indexed, sliced or concatenated (its packed tensors shared again)."""
        from .tensordict_view import batch_fields

        return cls._assemble(**batch_fields(td))

    # -- miles ----------------------------------------------------------------
    def to_train_data(self) -> dict[str, Any]:
        """miles' rollout data dict (docs/semantics.md §6) with miles' dtypes:
        per-sample lists of tensors on this batch's device (views where the
        dtype already matches), `tokens` being prompt then response. The
        support log-probs, when carried, are `rollout_sampling_mask_log_probs`:
        per sample, one per id of its `rollout_sampling_mask_ids`."""

        def cast(values: torch.Tensor, key: str) -> torch.Tensor:
            return values.to(torch_dtype(TRAIN_DTYPES[key]))

        loss_masks = self._split(cast(self.loss_mask, "loss_masks"), "response")
        running = torch.zeros(len(self.loss_mask) + 1, dtype=torch.int64, device=self.loss_mask.device)
        torch.cumsum(self.loss_mask.to(torch.int64), 0, out=running[1:])
        mask_sums = running[self.response_cu[1:]] - running[self.response_cu[:-1]]  # each sample's loss-mask total
        # miles wants these three per-sample facts as host values: one read for all (float64 holds each exactly).
        facts = torch.cat([self.rewards.double(), self.sample_indices.double(), mask_sums.double()]).tolist()
        n = len(self)
        rewards, indices, totals = facts[:n], [int(v) for v in facts[n : 2 * n]], [int(v) for v in facts[2 * n :]]
        data: dict[str, Any] = {
            "tokens": self._split(cast(self.tokens, "tokens"), "sequence"),
            "response_lengths": cast(self.response_lengths, "response_lengths"),
            "loss_masks": loss_masks,
            "rollout_log_probs": self._split(cast(self.log_probs, "rollout_log_probs"), "response"),
            **{key: self._split(cast(getattr(self, name), key), "response")
               for key, name in TOKEN_LOG_PROB_KEYS.items() if getattr(self, name) is not None},
            "rewards": rewards,
            "sample_indices": cast(self.sample_indices, "sample_indices"),
        }
        for key, value in rollout_keys(rewards, self.statuses, indices, totals, self.metadata).items():
            data[key] = to_device(value, self.device) if isinstance(value, np.ndarray) else value
        calls = weight_version_calls(self.weight_versions, self.weight_version_spans, self.lengths["prompt"].tolist())
        if calls is not None:
            data["weight_versions"] = calls
        if self.has_mask:
            ids_key, offsets_key = MASK_KEYS
            mask_ids, _ = self._masks()
            data[ids_key] = self._split(cast(mask_ids, ids_key), "mask_ids")
            data[offsets_key] = [cast(o, offsets_key) for o in self.sample_mask_offsets()]
            for key, name in SUPPORT_LOG_PROB_KEYS.items():  # each sample's beside its ids, as miles hands them over
                if getattr(self, name) is not None:
                    data[key] = self._split(cast(getattr(self, name), key), "mask_ids")
        for key, name in REPLAY_KEYS.items():
            if name in self.replay:
                data[key] = self._split(cast(self.replay[name], key), name)
        return data

    def metrics(self) -> dict[str, float]:
        """Scalars for logging. Averages come from `metric_view` of the train
        data, which holds no mask or replay key, so those are never reduced."""
        out: dict[str, float] = {"samples": float(len(self)), "tokens": float(self.num_tokens)}
        for key, value in metric_view(self.to_train_data()).items():
            if key in _NOT_AVERAGED:
                continue
            if isinstance(value, list) and value and not all(torch.is_tensor(v) or isinstance(v, (int, float)) for v in value):
                continue  # raw rewards that are maps
            flat = torch.cat(value) if isinstance(value, list) and value and torch.is_tensor(value[0]) else torch.as_tensor(value)
            if flat.numel():
                out[f"{key}/mean"] = float(flat.double().mean())
        for status in ("truncated", "aborted"):
            out[f"{status}/fraction"] = self.statuses.count(status) / max(len(self), 1)
        out["gaps/fraction"] = sum(gap is not None for gap in self.gaps) / max(len(self), 1)
        return out

    def __repr__(self) -> str:
        return (
            f"Batch(seq={self.seq}, samples={len(self)}, tokens={self.num_tokens}, "
            f"mask={self.has_mask}, replay={sorted(self.replay)}, device={self.device})"
        )


def _bounds(lengths: Mapping[str, np.ndarray], host: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """A batch's derived per-sample fields, on the host (int64)."""
    return {"cu_seqlens": cumsum0(lengths["sequence"]), "response_cu": cumsum0(lengths["response"]),
            "group_index": group_index(host["group_ids"])}


def _offsets_from_sizes(sizes: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(len(sizes) + 1, dtype=torch.int64, device=sizes.device)
    torch.cumsum(sizes, 0, out=offsets[1:])
    return offsets
