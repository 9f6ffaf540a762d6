"""Bytes one response token costs on the wire and in the broker's store,
with and without `mask_log_probs` (the sampler's log-prob of every support
id, one float32 per id beside `mask_ids`).

Two workloads, each `--trajectories` trajectories of a 512-token prompt and
5,000 response tokens sent as 8 turns of 625:
- `prime_rl`: supports sized as prime-rl measured them under top-p 0.97 /
  top-k 512 (mean about 8 ids, median 2, p99 about 82, 45-48% single ids):
  a single id with probability `SINGLE_SHARE`, else 1 + ceil(a log-normal
  draw), at most 512 ids; the realised mean, median, p99 and single-id
  share are printed beside the target;
- `pipeline`: bench/pipeline.py's workload (TransferQueue's samples, their
  supports of min(geometric(1/8), 64) ids), from its own generator.
Each support's log-probs are drawn (seeded) and renormalised over it, so a
turn that carries them says so (`mask_log_probs_normalized`), as SGLang's
support mode does; a token's log-prob is its sampled id's entry, the same
with or without them.

Wire: each turn's frames as the producer's client encodes them (`encode_turn`
with its defaults: CRCs on, the arrays packed into one frame when small;
the header numbered as the session numbers it), every frame's bytes summed
over every turn and divided by the response tokens; the `end` frames, the
transport's framing and the batching of small frames are left out. Store:
the same turns merged by a `MergeEngine` and committed by a `Store` as the
broker does, then the bytes of its segment files (each turn's record: a
12-byte header, the frame-length table and the frames as they arrived);
SQLite's rows are left out (a few per turn, not per token, the same with or
without). The mask's own share (`mask_ids` + `mask_offsets`, bytes per
token) is printed beside the ~32 B/token prime-rl measured for its mask on
the wire.

The last line is one JSON object. `--smoke` writes 2 trajectories per
workload.

    .venv/bin/python bench/wire_bytes.py [--trajectories 32] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from pipeline import VOCAB, split_turns, workload
from procs import parse_args
from stores import applied

from rollstream.broker.engine import EngineSettings, MergeEngine
from rollstream.broker.store import Store
from rollstream.common.codec import decode, encode, number_header
from rollstream.common.messages import PRODUCER_TO_BROKER
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn

SMOKE = {"trajectories": 2}  # the sizes of --smoke
TURNS = 8
PROMPT_TOKENS, RESPONSE_TOKENS = 512, 5000
COMMIT_EVERY = 8  # trajectories per store commit

# prime-rl PR 2979 (PrimeIntellect-ai/prime-rl, top-p 0.97 / top-k 512, 2.5M-token steps): supports of mean ~8 ids,
# median 2, p99 ~82, 45-48% single ids, and its mask ~32 B/token on the wire.
PRIME_RL = {"mean": 8, "median": 2, "p99": 82, "single_share": 0.47}
PRIME_RL_MASK_WIRE_BYTES_PER_TOKEN = 32
TOP_K = 512
# The support sizes drawn for it: a single id with this probability, else 1 + ceil(exp(MU + SIGMA * N(0, 1))) ids.
SINGLE_SHARE, MU, SIGMA = 0.47, 1.73, 1.28


def prime_rl_sizes(n: int, rng: np.random.Generator) -> np.ndarray:
    """`n` support sizes distributed as prime-rl measured them."""
    sizes = np.ones(n, dtype=np.int64)
    wide = rng.random(n) >= SINGLE_SHARE
    drawn = np.ceil(np.exp(MU + SIGMA * rng.standard_normal(int(wide.sum()))))
    sizes[wide] = np.minimum(1 + drawn, TOP_K)
    return sizes


def prime_rl_workload(trajectories: int, seed: int) -> list[dict]:
    """Trajectories shaped as the pipeline's, their supports sized by
    `prime_rl_sizes`, each token inside its own."""
    rng = np.random.default_rng([seed, 2979])
    out = []
    for _ in range(trajectories):
        sizes = prime_rl_sizes(RESPONSE_TOKENS, rng)
        offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        ids = rng.integers(0, VOCAB, int(offsets[-1]), dtype=np.int32)
        tokens = ids[offsets[:-1] + rng.integers(0, sizes)]
        out.append({"prompt_tokens": rng.integers(0, VOCAB, PROMPT_TOKENS, dtype=np.int32), "tokens": tokens,
                    "log_probs": np.zeros(RESPONSE_TOKENS, np.float32), "loss_mask": np.ones(RESPONSE_TOKENS, np.uint8),
                    "mask_ids": ids, "mask_offsets": offsets})
    return out


def with_support_log_probs(sample: dict, rng: np.random.Generator) -> dict:
    """The sample with `mask_log_probs`: each support's weights drawn and
    renormalised over it; a token's log-prob becomes its sampled id's entry
    (the first, where a support holds it twice)."""
    ids, offsets = sample["mask_ids"], sample["mask_offsets"]
    sizes = np.diff(offsets)
    owner = np.repeat(np.arange(sizes.size), sizes)
    weights = rng.exponential(1.0, ids.size)
    log_probs = (np.log(weights) - np.log(np.add.reduceat(weights, offsets[:-1]))[owner]).astype(np.float32)
    at = np.flatnonzero(ids == sample["tokens"][owner])
    found, first = np.unique(owner[at], return_index=True)
    token_log_probs = np.zeros(sizes.size, np.float32)
    token_log_probs[found] = log_probs[at[first]]
    return {**sample, "log_probs": token_log_probs, "mask_log_probs": log_probs}


def turn_frames(tid: str, sample: dict, carry: bool) -> list[list]:
    """The sample's turns as the producer's client encodes them, numbered."""
    out = []
    offsets = sample["mask_offsets"]
    bounds = np.linspace(0, len(sample["tokens"]), TURNS + 1).astype(int)
    for k, part in enumerate(split_turns(sample, TURNS)):
        support = {}
        if carry:
            support = {"mask_log_probs": sample["mask_log_probs"][offsets[bounds[k]]:offsets[bounds[k + 1]]],
                       "mask_log_probs_normalized": True}
        turn = Turn.build(part["tokens"], part["log_probs"], loss_mask=part["loss_mask"], mask_ids=part["mask_ids"],
                          mask_offsets=part["mask_offsets"], check_content=False, **support)
        frames = encode_turn(tid, k, turn, seq=None, prompt_tokens=sample["prompt_tokens"] if k == 0 else None,
                             crc=True, checked=False, may_pack=True)
        out.append([number_header(frames[0], k), *frames[1:]])
    return out


def measure(samples: list[dict], carry: bool) -> dict:
    """Wire and store bytes per response token of `samples`' turns, with or
    without their `mask_log_probs`."""
    tokens = sum(len(sample["tokens"]) for sample in samples)
    wire = 0
    with tempfile.TemporaryDirectory(prefix="rollstream-wire-bytes-") as data_dir:
        store = Store(data_dir)
        store.open()
        engine = MergeEngine(EngineSettings())
        wall = time.time()
        try:
            for first in range(0, len(samples), COMMIT_EVERY):
                effects = []
                for i, sample in enumerate(samples[first:first + COMMIT_EVERY], first):
                    tid = f"t{i:06d}"
                    frames = turn_frames(tid, sample, carry)
                    wire += sum(len(frame) for turn in frames for frame in turn)
                    frames.append(encode(PRODUCER_TO_BROKER, "end", {"seq": TURNS, "trajectory_id": tid, "reward": 1.0}))
                    messages = [decode(f, PRODUCER_TO_BROKER, check_content=False) for f in frames]
                    effects += applied(engine, tid, messages, wall, "bench")
                store.commit(effects)
                engine.saved()
        finally:
            store.close()
        stored = sum(path.stat().st_size for path in Path(data_dir).rglob("seg-*.log"))
    return {"wire": round(wire / tokens, 2), "store": round(stored / tokens, 2)}


def support_stats(samples: list[dict]) -> dict:
    sizes = np.concatenate([np.diff(sample["mask_offsets"]) for sample in samples])
    return {"mean": round(float(sizes.mean()), 2), "median": float(np.median(sizes)),
            "p99": float(np.percentile(sizes, 99)), "single_share": round(float((sizes == 1).mean()), 3),
            "tokens": int(sizes.size)}


def run(name: str, samples: list[dict], seed: int) -> dict:
    rng = np.random.default_rng([seed, 11])
    samples = [with_support_log_probs(sample, rng) for sample in samples]
    stats = support_stats(samples)
    tokens = stats["tokens"]
    without, with_ = measure(samples, carry=False), measure(samples, carry=True)
    mask = sum(sample["mask_ids"].nbytes + sample["mask_offsets"].nbytes for sample in samples) / tokens
    figures = {"support": stats, "without_mask_log_probs": without, "with_mask_log_probs": with_,
               "mask_wire": round(mask, 2), "mask_log_probs_wire": round(with_["wire"] - without["wire"], 2)}
    print(f"{name}: {tokens} response tokens; supports mean {stats['mean']} ids, median {stats['median']:g}, "
          f"p99 {stats['p99']:g}, {stats['single_share']:.1%} single ids")
    print("  B/token       without mask_log_probs   with    (added)")
    for where in ("wire", "store"):
        print(f"  {where:<8} {without[where]:>20.2f} {with_[where]:>7.2f} {with_[where] - without[where]:>+9.2f}")
    print(f"  the mask (mask_ids + mask_offsets) on the wire: {mask:.2f} B/token "
          f"(prime-rl measured ~{PRIME_RL_MASK_WIRE_BYTES_PER_TOKEN} B/token for its mask)")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=32, help="trajectories per workload (5,000 tokens each)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every draw")
    args = parse_args(parser, SMOKE)
    target = PRIME_RL
    print(f"prime_rl target (prime-rl PR 2979): supports mean ~{target['mean']}, median {target['median']}, "
          f"p99 ~{target['p99']}, ~{target['single_share']:.0%} single ids")
    summary = {
        "prime_rl": run("prime_rl", prime_rl_workload(args.trajectories, args.seed), args.seed),
        "pipeline": run("pipeline", workload(args.trajectories, seed=args.seed), args.seed),
    }
    summary.update(unit="bytes per response token", store="segment files (turn records)",
                   prime_rl_mask_wire_reference=PRIME_RL_MASK_WIRE_BYTES_PER_TOKEN, trajectories=args.trajectories)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
