"""The seed's data path (miles, as its sampling-mask change describes it),
modelled here as the baseline the in-process benchmarks compare against, and
the standard agentic workload they all run.

What the model keeps from the seed, because that is what it costs:
- each sample's sampling supports are a CSR mask of two torch tensors (ids
  int32, offsets int64) built from the engine's Python lists;
- appending a turn or a forced observation builds a new mask by
  concatenating the whole existing one with the new part, so a trajectory
  of n turns copies its mask n times;
- the batch travels as one safetensors payload with two tensors per sample
  (`<field>.ids.<i>`, `<field>.offsets.<i>`) and a JSON meta tensor;
- validation runs sample by sample in Python over lists.

    python bench/peers/seed_path.py [--trajectories N]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Iterable, Sequence

import numpy as np
import safetensors.numpy
import torch

VOCAB = 151_936
FIELD = "rollout_sampling_mask"
META_KEY = "_samples_meta"

# One trajectory as an engine hands it over: per turn, the supports of its
# sampled tokens (one list of token ids per token) and the forced tokens
# that follow the turn (none after the last).
Turn = tuple[list[list[int]], list[int]]


class SeedMask:
    """One sample's sampling supports in CSR form: the support of token t is
    `ids[offsets[t]:offsets[t + 1]]`. The mask owns its storage: what it is
    built from is copied."""

    __slots__ = ("ids", "offsets")

    def __init__(self, ids, offsets):
        self.ids = torch.as_tensor(ids, dtype=torch.int32).clone()
        self.offsets = torch.as_tensor(offsets, dtype=torch.int64).clone()

    @classmethod
    def from_mask_list(cls, supports: Sequence[Sequence[int]]) -> SeedMask:
        """A mask from one list of token ids per token, walked in Python."""
        flat = list(itertools.chain.from_iterable(supports))
        offsets = [0, *itertools.accumulate(len(support) for support in supports)]
        return cls(flat, offsets)

    @classmethod
    def concatenate(cls, masks: Iterable[SeedMask]) -> SeedMask:
        """A new mask holding `masks` one after the other: every id is copied,
        every offset shifted by the ids before it."""
        masks = list(masks)
        shifted = [torch.zeros(1, dtype=torch.int64)]
        base = 0
        for mask in masks:
            shifted.append(mask.offsets[1:] + base)
            base += mask.ids.numel()
        return cls(torch.cat([mask.ids for mask in masks]), torch.cat(shifted))

    def __len__(self) -> int:
        return self.offsets.numel() - 1


def make_workload(n_traj: int = 64, turns: int = 8, turn_tokens: int = 512, obs_tokens: int = 128,
                  vocab: int = VOCAB, top_k: int = 64, seed: int = 0) -> list[list[Turn]]:
    """The standard agentic workload: `n_traj` trajectories of `turns` turns
    of `turn_tokens` sampled tokens, each turn but the last followed by
    `obs_tokens` forced tokens. A token's support holds
    min(geometric(1/8), `top_k`) ids drawn uniformly from the vocabulary.
    Everything is Python lists, as an engine returns it."""
    rng = np.random.default_rng(seed)
    work = []
    for _ in range(n_traj):
        trajectory = []
        for turn in range(turns):
            sizes = np.minimum(rng.geometric(1 / 8, size=turn_tokens), top_k)
            ids = rng.integers(0, vocab, size=int(sizes.sum())).tolist()
            bounds = [0, *itertools.accumulate(sizes.tolist())]
            supports = [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
            forced = rng.integers(0, vocab, size=obs_tokens).tolist() if turn < turns - 1 else []
            trajectory.append((supports, forced))
        work.append(trajectory)
    return work


def merge_trajectory(trajectory: Sequence[Turn]) -> SeedMask:
    """The seed's merge: each turn's mask appended to the trajectory's, then
    each forced observation appended as singleton supports, each append a
    full concatenation."""
    merged = None
    for supports, forced in trajectory:
        turn = SeedMask.from_mask_list(supports)
        merged = turn if merged is None else SeedMask.concatenate((merged, turn))
        if forced:
            merged = SeedMask.concatenate((merged, SeedMask.from_mask_list([[token] for token in forced])))
    assert merged is not None, "a trajectory has at least one turn"
    return merged


def seed_encode(masks: Sequence[SeedMask]) -> bytes:
    """One safetensors payload, two tensors per sample plus a JSON meta
    tensor listing the samples."""
    tensors = {}
    for i, mask in enumerate(masks):
        tensors[f"{FIELD}.ids.{i}"] = mask.ids.numpy()
        tensors[f"{FIELD}.offsets.{i}"] = mask.offsets.numpy()
    meta = json.dumps({"samples": [{"response_length": len(mask)} for mask in masks]}, separators=(",", ":"))
    tensors[META_KEY] = np.frombuffer(meta.encode(), dtype=np.uint8)
    return safetensors.numpy.save(tensors)


def seed_decode(payload: bytes) -> list[SeedMask]:
    """The masks back from `seed_encode`'s payload, their dtypes checked."""
    tensors = safetensors.numpy.load(payload)
    samples = json.loads(tensors.pop(META_KEY).tobytes())["samples"]
    masks = []
    for i in range(len(samples)):
        ids, offsets = tensors.pop(f"{FIELD}.ids.{i}"), tensors.pop(f"{FIELD}.offsets.{i}")
        if ids.dtype != np.int32 or offsets.dtype != np.int64:
            raise ValueError(f"sample {i}: mask dtypes {ids.dtype}/{offsets.dtype}, expected int32/int64")
        masks.append(SeedMask(torch.from_numpy(ids), torch.from_numpy(offsets)))
    return masks


def _check_offsets(offsets: list[int], id_count: int) -> None:
    if offsets[0] != 0 or offsets[-1] != id_count:
        raise ValueError(f"offsets run from {offsets[0]} to {offsets[-1]}, expected 0 to {id_count}")
    if not all(a < b for a, b in zip(offsets, offsets[1:])):
        raise ValueError("offsets are not strictly increasing: a token has an empty support")


def seed_validate(mask: SeedMask, response_length: int) -> None:
    """The seed's per-sample check of a mask: one support per token, offsets
    from 0 to the id count, none empty."""
    offsets = mask.offsets.tolist()
    if len(offsets) != response_length + 1:
        raise ValueError(f"{len(offsets) - 1} supports for {response_length} tokens")
    _check_offsets(offsets, mask.ids.numel())


def make_validation_batch(work: Sequence[Sequence[Turn]]) -> tuple[list[SeedMask], list[list[int]]]:
    """Per trajectory of `work`: its whole mask (forced tokens as singleton
    supports) and its response tokens, each sampled token the first id of
    its support, so the batch is valid."""
    masks, responses = [], []
    for trajectory in work:
        supports: list[list[int]] = []
        tokens: list[int] = []
        for turn_supports, forced in trajectory:
            supports.extend(turn_supports)
            tokens.extend(support[0] for support in turn_supports)
            supports.extend([token] for token in forced)
            tokens.extend(forced)
        masks.append(SeedMask.from_mask_list(supports))
        responses.append(tokens)
    return masks, responses


def seed_validate_batch(masks: Sequence[SeedMask], sampled_tokens: Sequence[Sequence[int]]) -> None:
    """The seed's validation of a batch, one sample at a time over Python
    lists: the offset checks, then each token looked up in its support."""
    for mask, tokens in zip(masks, sampled_tokens):
        ids, offsets = mask.ids.tolist(), mask.offsets.tolist()
        _check_offsets(offsets, len(ids))
        if len(tokens) != len(offsets) - 1:
            raise ValueError(f"{len(tokens)} tokens for {len(offsets) - 1} supports")
        for t, token in enumerate(tokens):
            if int(token) not in ids[offsets[t]:offsets[t + 1]]:
                raise ValueError(f"token {t} ({token}) is not in its sampling support")


def run_seed_path(work: Sequence[Sequence[Turn]]) -> dict:
    """Time the seed's path over `work`, stage by stage: `build_merge_s`
    (masks built from the lists, turns and forced tokens appended),
    `encode_s`, `decode_s` and `validate_s`; with the `tokens` and support
    `ids` carried and the `payload_bytes` sent."""
    timings: dict = {}
    start = time.perf_counter()
    merged = [merge_trajectory(trajectory) for trajectory in work]
    timings["build_merge_s"] = time.perf_counter() - start
    start = time.perf_counter()
    payload = seed_encode(merged)
    timings["encode_s"] = time.perf_counter() - start
    start = time.perf_counter()
    decoded = seed_decode(payload)
    timings["decode_s"] = time.perf_counter() - start
    start = time.perf_counter()
    for mask in decoded:
        seed_validate(mask, len(mask))
    timings["validate_s"] = time.perf_counter() - start
    timings["tokens"] = sum(len(mask) for mask in merged)
    timings["ids"] = sum(mask.ids.numel() for mask in merged)
    timings["payload_bytes"] = len(payload)
    return timings


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(run_seed_path(make_workload(n_traj=args.trajectories))))
