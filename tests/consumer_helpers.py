"""Builders shared by the consumer tests (this file holds no tests).

Synthetic rollouts go through the real merge model and wire codec; the
producer is raw zmq + msgpack, as a peer following docs/protocol.md would
write it. A live broker is `broker_process.BrokerProcess`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from rollstream.common.codec import decode, encode
from rollstream.common.messages import (
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    PRODUCER_TO_BROKER,
)
from rollstream.common.trajectory import Trajectory, Turn
from rollstream.common.wire import encode_deliver, encode_turn
from rollstream.consumer import Batch, Delivery

VOCAB = 1000


@dataclass
class Rollout:
    """A trajectory as its producer sends it: prompt, turns, identity, reward."""

    trajectory_id: str
    prompt: np.ndarray
    turns: list[Turn]
    reward: float = 1.0
    sample_index: int | None = None
    group: tuple[str, int] | None = None
    metadata: dict = field(default_factory=dict)

    def merged(self) -> Trajectory:
        """What the broker should deliver: the turns merged by the reference model."""
        group_id, group_size = self.group or (None, None)
        traj = Trajectory(self.trajectory_id, self.prompt, sample_index=self.sample_index, group_id=group_id,
                          group_size=group_size, metadata=self.metadata)
        for turn in self.turns:
            traj.append_turn(turn)
        traj.reward = self.reward
        return traj


def make_rollout(rng: np.random.Generator, tid: str, *, turns: int = 2, mask: bool = True, max_len: int = 6,
                 max_support: int = 5, vocab: int = VOCAB, full: bool = False, mask_log_probs: bool = False,
                 **identity) -> Rollout:
    """Random turns: each sampled token inside a random support, forced tokens between turns; with `full`,
    each turn's full-vocabulary log-probs (below its truncated ones); with `mask_log_probs` (and `mask`), each
    support's log-probs (a log-softmax over it, float32, one per support id)."""
    built = []
    for k in range(turns):
        n = int(rng.integers(1, max_len + 1))
        tokens = rng.integers(0, vocab, size=n)
        supports = None
        if mask:
            supports = []
            for token in tokens.tolist():
                others = rng.integers(0, vocab, size=int(rng.integers(0, max_support))).tolist()
                others.insert(int(rng.integers(0, len(others) + 1)), token)
                supports.append(others)
        forced = rng.integers(0, vocab, size=int(rng.integers(0, 4))) if k < turns - 1 else None
        log_probs = -rng.exponential(size=n) - 1e-3
        full_log_probs = log_probs - rng.exponential(size=n) if full else None
        support_log_probs = None
        if mask_log_probs:
            support_log_probs = np.concatenate([log_softmax(rng.normal(size=len(support))) for support in supports])
        built.append(Turn.build(tokens, log_probs, supports=supports, forced_tokens=forced, full_log_probs=full_log_probs,
                                mask_log_probs=support_log_probs))
    prompt = rng.integers(0, vocab, size=int(rng.integers(1, 6))).astype(np.int32)
    return Rollout(tid, prompt, built, reward=float(rng.normal()), **identity)


def log_softmax(values: np.ndarray) -> np.ndarray:
    """float32 log-probabilities over `values` (each <= 0, summing to 1 as probabilities)."""
    shifted = values - values.max()
    return (shifted - np.log(np.exp(shifted).sum())).astype(np.float32)


def replaying_trajectories(rng: np.random.Generator, n: int = 3) -> list[Trajectory]:
    """One-turn trajectories whose turns carry routed experts (k + 2 rows of [3, 2] for k tokens)."""
    trajectories = []
    for i in range(n):
        t = Trajectory(f"r{i}", [1, 2])
        k = int(rng.integers(1, 5))
        t.append_turn(Turn.build(list(range(k)), [-0.5] * k, supports=[[j] for j in range(k)],
                                 routed_experts=rng.integers(0, 8, size=(k + 2, 3, 2))))
        t.reward = 0.0
        trajectories.append(t)
    return trajectories


def delivery(traj: Trajectory, lease: str | None = None, broker: int = 0, **extra) -> Delivery:
    """The `Delivery` a consumer builds from the broker's `deliver` message."""
    lease = lease or f"lease-{traj.trajectory_id}"
    message = decode(encode_deliver(traj, lease, **extra), BROKER_TO_CONSUMER, check_content=False)
    return Delivery(traj.trajectory_id, message.fields, message.arrays, broker, {(broker, lease)})


def deliveries(rng: np.random.Generator, n: int, **kw) -> list[Delivery]:
    return [delivery(make_rollout(rng, f"t{i}", sample_index=i, **kw).merged()) for i in range(n)]


def assert_same_batch(a: Batch, b: Batch):
    assert a.ragged().keys() == b.ragged().keys()
    for name in a.ragged():
        assert torch.equal(a.ragged()[name], b.ragged()[name]), name
    for name in ("cu_seqlens", "response_cu", "prompt_lengths", "response_lengths", "rewards", "sample_indices",
                 "group_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.mask_offsets is None) == (b.mask_offsets is None)
    if a.has_mask:
        assert torch.equal(a.mask_offsets, b.mask_offsets)
    for name in ("full_log_probs", "mask_log_probs"):  # by field, not only as `ragged()` lists them
        assert (getattr(a, name) is None) == (getattr(b, name) is None), name
        if getattr(a, name) is not None:
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("trajectory_ids", "statuses", "gaps", "group_ids", "raw_rewards", "metadata", "weight_versions",
                 "weight_version_spans", "leases"):
        assert getattr(a, name) == getattr(b, name), name
    assert {k: v.tolist() for k, v in a.lengths.items()} == {k: v.tolist() for k, v in b.lengths.items()}


def writable(d: Delivery, **arrays) -> Delivery:
    """A copy of `d` with writable arrays, some replaced."""
    copied = {name: np.array(values) for name, values in d.arrays.items()}
    copied.update(arrays)
    return Delivery(d.trajectory_id, dict(d.fields), copied, d.broker, set(d.leases))


# -- a raw producer --------------------------------------------------------------
def send_rollouts(endpoint: str, rollouts, **kw) -> None:
    """A `RawProducer` sends `rollouts` (acknowledged) and goes."""
    producer = RawProducer(endpoint)
    try:
        producer.send(rollouts, **kw)
    finally:
        producer.close()


def train_sealing(endpoint: str, steps: int, batch_size: int, **options) -> tuple[str, dict[str, tuple[int, int]]]:
    """A checkpointing consumer (`options`: more of `Consumer`'s) trains
    `steps` batches of `batch_size`, sealing after each, and flushes: its
    run, and each trajectory's (step, position)."""
    from rollstream.consumer import Consumer

    trained = {}
    with Consumer(endpoint, batch_size=batch_size, vocab_size=VOCAB, **options) as consumer:
        run = consumer.position.run
        for _ in range(steps):
            batch = consumer.next_batch(timeout=60)
            consumer.commit(batch)
            step = consumer.position.step
            trained.update({tid: (step, position) for position, tid in enumerate(batch.trajectory_ids)})
            consumer.sealed(step)
        consumer.flush(60)
    return run, trained


class RawProducer:
    """A producer from raw zmq + msgpack: hello, then turn and end frames with `seq`."""

    def __init__(self, endpoint: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.sock.send_multipart(encode(PRODUCER_TO_BROKER, "hello", {"producer_id": f"test-{os.getpid()}"}))
        self.seq = 0

    def _send(self, frames) -> None:
        self.sock.send_multipart(frames)

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def send(self, rollouts, *, abort: tuple[str, ...] = ()) -> None:
        """Send every rollout (turns then end; `abort`ed ids get turn 0 then
        abort) and wait until each frame is acked."""
        sent = set()
        for r in rollouts:
            group = {"group_id": r.group[0], "group_size": r.group[1]} if r.group else {}
            for k, turn in enumerate(r.turns if r.trajectory_id not in abort else r.turns[:1]):
                first = {"prompt_tokens": r.prompt, "sample_index": r.sample_index, **group} if k == 0 else {}
                seq = self._next_seq()
                self._send(encode_turn(r.trajectory_id, k, turn, seq=seq, crc=True, **first))
                sent.add(seq)
            seq = self._next_seq()
            if r.trajectory_id in abort:
                self._send(encode(PRODUCER_TO_BROKER, "abort", {"seq": seq, "trajectory_id": r.trajectory_id, "reason": "test"}))
            else:
                self._send(encode(PRODUCER_TO_BROKER, "end", {"seq": seq, "trajectory_id": r.trajectory_id, "reward": r.reward}))
            sent.add(seq)
        while sent:
            if not self.sock.poll(20_000):
                raise TimeoutError(f"{len(sent)} frames unacknowledged")
            reply = decode(self.sock.recv_multipart(), BROKER_TO_PRODUCER)
            if reply.type == "nack":
                raise AssertionError(f"broker refused a frame: {dict(reply.fields)}")
            if reply.type == "ack":
                sent.discard(reply["seq"])

    def close(self) -> None:
        self.sock.close()


# The checker's problem counts of a run that went right: none.
CLEAN = {"lost": 0, "duplicated": 0, "partial": 0, "corrupted": 0, "unseen": 0}


def clean(report) -> dict:
    """The counts (`Report.counts`) of a clean checker report: every problem
    0, and the prompt figures 0 too once prompts were judged (a daemon's
    sources record the prompts they issue)."""
    return {**CLEAN, **(dict.fromkeys(report.PROMPT_PROBLEMS, 0) if report.prompts else {})}
