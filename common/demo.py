"""The embedded-defaults job: synthetic multi-turn rollouts through every
stage that exists, with a one-screen summary."""
from __future__ import annotations

import time

import numpy as np

from .codec import decode
from .mask import SamplingMask
from .messages import BROKER_TO_CONSUMER, PRODUCER_TO_BROKER
from .miles import to_train_data
from .trajectory import Trajectory, Turn
from .validation import validate_samples
from .wire import encode_deliver, encode_turn, trajectory_from_deliver, turn_from_message

VOCAB = 151_936


def _synthetic_turn(rng: np.random.Generator, tokens: int, forced: int, last: bool) -> Turn:
    sizes = np.minimum(rng.geometric(1 / 8, size=tokens), 64)
    ids = rng.integers(0, VOCAB, size=int(sizes.sum()), dtype=np.int32)
    mask = SamplingMask.from_lengths(ids, sizes)
    sampled = ids[mask.offsets[:-1]]  # the first id of each support
    return Turn.build(
        sampled,
        -rng.exponential(1.0, size=tokens).astype(np.float32),
        mask=mask,
        forced_tokens=None if last else rng.integers(0, VOCAB, size=forced, dtype=np.int32),
        vocab_size=VOCAB,
    )


def run_demo(trajectories: int = 64, turns: int = 4, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    delivered = []
    for i in range(trajectories):
        tid = f"demo-{i}"
        merged = Trajectory(tid, rng.integers(0, VOCAB, size=32, dtype=np.int32), sample_index=i)
        for index in range(turns):
            turn = _synthetic_turn(rng, tokens=128, forced=32, last=index == turns - 1)
            frames = encode_turn(tid, index, turn, seq=index, prompt_tokens=merged.prompt_tokens if index == 0 else None)
            merged.append_turn(turn_from_message(decode(frames, PRODUCER_TO_BROKER, vocab_size=VOCAB)))
        merged.reward = float(rng.random())
        frames = encode_deliver(merged, lease=f"lease-{i}")
        delivered.append(trajectory_from_deliver(decode(frames, BROKER_TO_CONSUMER, vocab_size=VOCAB)))
    validate_samples(
        [t.tokens for t in delivered],
        [(t.mask.ids, t.mask.offsets) for t in delivered],
        names=[t.trajectory_id for t in delivered],
        vocab_size=VOCAB,
    )
    data = to_train_data(delivered)
    seconds = time.perf_counter() - start
    tokens = int(data["response_lengths"].sum())
    ids = sum(len(ids) for ids in data["rollout_sampling_mask_ids"])
    return (
        f"rollstream demo (in-process: encode -> decode -> merge -> deliver -> validate -> train data)\n"
        f"  trajectories: {len(delivered)}  turns each: {turns}\n"
        f"  response tokens: {tokens}  support ids: {ids}\n"
        f"  valid: yes  time: {seconds:.3f} s"
    )
