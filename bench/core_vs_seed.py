"""rollstream's in-process data path against the seed's, on the same workload
in the same run.

Stages (both paths get the same per-turn engine output: supports as Python
lists, plus, for rollstream, the sampled ids and log-probs an engine returns):
  build_merge  ingest each turn, append forced tokens, merge turns
  encode       rollstream: one `deliver` wire message per trajectory;
               seed: one safetensors payload
  decode       back to arrays (zero-copy for rollstream)
  validate     rollstream: CSR rules + sampled-token-in-support + vocab over
               the whole batch in one pass; seed: offset checks only

Also printed: the conversion floor (the engine's lists turned into arrays with
one numpy call each, nothing else: no path from lists goes below it) and
`list_path_vs_floor`, rollstream's total over that floor, i.e. what the
checks, the merge and the wire cost on top of the unavoidable conversion;
merge scaling (per-token cost of a 1,000-turn trajectory over a 10-turn one
with the same tokens), and CSR bytes against the same supports padded to
[tokens, top_k]. The last line is JSON with the headline figures.

The seed's path and the workload are `peers/seed_path.py`.

usage: python bench/core_vs_seed.py [--trajectories N] [--repeat R] [--smoke]

`--smoke` runs every stage at a tiny size, to check the script works; its
figures mean nothing.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np
from peers import seed_path
from procs import parse_args

from rollstream.common.codec import decode
from rollstream.common.ingest import turn_from_sglang
from rollstream.common.messages import BROKER_TO_CONSUMER
from rollstream.common.trajectory import Trajectory
from rollstream.common.validation import validate_samples
from rollstream.common.wire import encode_deliver

VOCAB = 151_936
TOP_K = 64
SMOKE = {"trajectories": 4, "repeat": 1, "scaling_tokens": 5_000}  # the sizes of --smoke


def engine_responses(work):
    """What an engine hands over per turn: ids, supports, log-probs, forced."""
    rng = np.random.default_rng(1)
    out = []
    for traj in work:
        turns = []
        for supports, obs in traj:
            meta = {
                "output_token_sampling_mask": supports,
                "output_token_sampling_logprobs": (-rng.exponential(size=len(supports))).tolist(),
                "finish_reason": {"type": "stop"},
            }
            turns.append(([s[0] for s in supports], meta, obs))
        out.append(turns)
    return out


def run_rollstream(responses) -> dict:
    timings = {}
    t0 = time.perf_counter()
    merged = []
    for i, turns in enumerate(responses):
        traj = Trajectory(f"t{i}", [1, 2, 3], sample_index=i)
        for sampled, meta, obs in turns:
            traj.append_turn(turn_from_sglang(sampled, meta, forced_tokens=obs or None))
        traj.reward = 1.0
        traj.arrays()  # queued appends are written here, as part of the merge
        merged.append(traj)
    timings["build_merge_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    messages = [encode_deliver(traj, f"lease-{i}") for i, traj in enumerate(merged)]
    timings["encode_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoded = [decode(frames, BROKER_TO_CONSUMER, check_content=False) for frames in messages]
    timings["decode_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    validate_samples(
        [m.arrays["tokens"] for m in decoded],
        [(m.arrays["mask_ids"], m.arrays["mask_offsets"]) for m in decoded],
        names=[m["trajectory_id"] for m in decoded],
        vocab_size=VOCAB,
        loss_masks=[m.arrays["loss_mask"] for m in decoded],
    )
    timings["validate_s"] = time.perf_counter() - t0
    timings["tokens"] = sum(t.response_length for t in merged)
    timings["ids"] = sum(len(m.arrays["mask_ids"]) for m in decoded)
    timings["payload_bytes"] = sum(sum(memoryview(f).nbytes for f in frames) for frames in messages)
    return timings


STAGES = ("build_merge_s", "encode_s", "decode_s", "validate_s")


def best_of(fn, arg, repeat: int) -> dict:
    runs = [fn(arg) for _ in range(repeat)]
    best = dict(runs[0])
    for key in STAGES:
        best[key] = min(r[key] for r in runs)
    best["total_s"] = sum(best[key] for key in STAGES)
    return best


def merge_scaling(total_tokens: int, repeat: int) -> dict:
    """Per-token build+merge cost of 1,000 turns over 10 turns, same tokens.

    Measured for the engine-output path (ingest + merge, the build_merge
    stage) and for merging already-built turns alone."""
    rng = np.random.default_rng(2)
    result = {}
    for turns in (10, 1000):
        per_turn = total_tokens // turns
        raw = []
        for _ in range(turns):
            sizes = np.minimum(rng.geometric(1 / 8, size=per_turn), TOP_K)
            supports = [rng.integers(0, VOCAB, size=s).tolist() for s in sizes]
            raw.append(([s[0] for s in supports], {"output_token_sampling_mask": supports,
                                                  "output_token_sampling_logprobs": [-0.5] * per_turn}))
        built = [turn_from_sglang(ids, meta) for ids, meta in raw]
        ingest_merge, merge_only, seed = [], [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            traj = Trajectory("scale", [1])
            for ids, meta in raw:
                traj.append_turn(turn_from_sglang(ids, meta))
            traj.arrays()  # appends are written at the first read; the seed's result is materialised too
            ingest_merge.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            traj = Trajectory("scale", [1])
            for turn in built:
                traj.append_turn(turn)
            traj.arrays()
            merge_only.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            acc = None
            for _, meta in raw:
                part = seed_path.SeedMask.from_mask_list(meta["output_token_sampling_mask"])
                acc = part if acc is None else seed_path.SeedMask.concatenate((acc, part))
            seed.append(time.perf_counter() - t0)
        tokens = per_turn * turns
        result[turns] = {name: min(times) / tokens for name, times in
                         (("ingest_merge", ingest_merge), ("merge_only", merge_only), ("seed", seed))}
    return {name: result[1000][name] / result[10][name] for name in result[10]} | {"per_token_s": result}


def conversion_floor(responses, repeat: int) -> float:
    """Seconds just to turn the engine's Python lists into arrays (supports,
    sampled ids, log-probs, forced tokens): no path can go below this, so
    seed time / this is the ceiling of `total_ratio` on this machine."""
    def convert():
        for turns in responses:
            for sampled, meta, obs in turns:
                supports = meta["output_token_sampling_mask"]
                np.fromiter(map(len, supports), np.int64, len(supports))
                np.fromiter(itertools.chain.from_iterable(supports), np.int32)
                np.asarray(sampled, np.int32), np.asarray(meta["output_token_sampling_logprobs"], np.float32)
                np.asarray(obs, np.int32)

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        convert()
        times.append(time.perf_counter() - t0)
    return min(times)


def csr_vs_padded(work) -> dict:
    tokens = sum(len(supports) + len(obs) for traj in work for supports, obs in traj)
    ids = sum(sum(map(len, supports)) + len(obs) for traj in work for supports, obs in traj)
    csr = ids * 4 + (tokens + len(work)) * 8
    padded = tokens * TOP_K * 4
    return {"csr_bytes": csr, "padded_bytes": padded, "csr_vs_padded": csr / padded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    # 1,000 turns of 512 tokens, the workload's turn size, against 10 turns of 51,200.
    parser.add_argument("--scaling-tokens", type=int, default=512_000)
    args = parse_args(parser, SMOKE)

    work = seed_path.make_workload(n_traj=args.trajectories)
    responses = engine_responses(work)
    seed = best_of(seed_path.run_seed_path, work, args.repeat)
    ours = best_of(run_rollstream, responses, args.repeat)
    assert seed["tokens"] == ours["tokens"] and seed["ids"] == ours["ids"], "both paths must carry the same data"

    print(f"workload: {args.trajectories} trajectories, {ours['tokens']} response tokens, {ours['ids']} support ids")
    print(f"{'stage':<14}{'seed s':>10}{'rollstream s':>14}{'ratio':>9}")
    for key in (*STAGES, "total_s"):
        print(f"{key[:-2]:<14}{seed[key]:>10.4f}{ours[key]:>14.4f}{seed[key] / ours[key]:>9.1f}x")
    floor = conversion_floor(responses, args.repeat)
    print(f"converting the engine's lists alone: {floor:.4f} s, so total_ratio cannot exceed "
          f"{seed['total_s'] / floor:.1f} here")
    print(f"rollstream's whole path from the lists: {ours['total_s'] / floor:.2f}x that conversion (list_path_vs_floor)")
    scaling = merge_scaling(args.scaling_tokens, args.repeat)
    print(
        f"merge scaling (per-token cost, 1000 turns / 10 turns, {args.scaling_tokens} tokens): "
        f"ingest+merge {scaling['ingest_merge']:.2f}, merge only {scaling['merge_only']:.2f}, "
        f"seed {scaling['seed']:.2f}"
    )
    sizes = csr_vs_padded(work)
    print(f"CSR {sizes['csr_bytes']} bytes vs padded [tokens, {TOP_K}] {sizes['padded_bytes']} bytes: "
          f"{sizes['csr_vs_padded']:.3f} of the padded size")
    print(json.dumps({
        "total_ratio": round(seed["total_s"] / ours["total_s"], 2),
        "stage_ratios": {key[:-2]: round(seed[key] / ours[key], 2) for key in STAGES},
        "seed_total_s": round(seed["total_s"], 4),
        "conversion_floor_s": round(floor, 4),
        "total_ratio_ceiling": round(seed["total_s"] / floor, 2),
        "rollstream_total_s": round(ours["total_s"], 4),
        "list_path_vs_floor": round(ours["total_s"] / floor, 3),
        "merge_scaling": round(scaling["ingest_merge"], 3),
        "merge_only_scaling": round(scaling["merge_only"], 3),
        "seed_merge_scaling": round(scaling["seed"], 3),
        "csr_vs_padded": round(sizes["csr_vs_padded"], 4),
    }))


if __name__ == "__main__":
    main()
