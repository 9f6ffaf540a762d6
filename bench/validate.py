"""Batch validation throughput: rollstream's one-pass consumer validation
against the seed's per-sample validation, on the same batch in the same run.

The batch is `make_workload()` of `peers/seed_path.py` as its
`make_validation_batch` lays it out (64 trajectories x 8 turns x 512 sampled
tokens, 128 forced tokens between turns; every sampled token inside its
support, forced tokens as singletons). rollstream validates the packed batch
on its device (`rollstream.consumer.batch_violations`: CSR rules, sampled
token in support, forced tokens singleton, ids and tokens in the vocabulary,
loss mask and log-probs); the seed runs `seed_validate_batch` (offset checks
and a per-token membership test over Python lists). The two are timed in
alternation, so both see the same load on a shared machine; the ratio
compares their best runs (the least disturbed), medians are printed beside.
Packing and validating the batch as the consumer does
(`Batch.checked_from_deliveries`: on the CPU each sample is checked as it
is packed, in one compiled pass) is timed separately, in alternation with
packing first and validating the packed batch after. With CUDA present, validating a batch of at least
`--gpu-tokens` (1M) tokens on the GPU, and packing and uploading it, are
timed too: by CUDA events recorded around each run on the stream (a
host-side clock would count the launch queue, not the work), after
`--gpu-warmup` untimed runs (the caching allocator's first blocks, lazy
kernel loading, clocks ramping up), the median of `--gpu-repeat` runs.

usage: python bench/validate.py [--repeat R] [--gpu-tokens N] [--gpu-repeat R] [--gpu-warmup W] [--smoke]
The last line is one JSON object with the headline figures. `--smoke` runs
it on a tiny batch (and, with CUDA, a small GPU batch), to check the script
works; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from peers import seed_path
from procs import parse_args

from rollstream.consumer import Batch, Delivery, batch_violations, checked_batch

VOCAB = 151_936
SMOKE = {"trajectories": 4, "repeat": 2, "gpu_tokens": 50_000, "gpu_repeat": 3, "gpu_warmup": 1}  # the sizes of --smoke


def deliveries_of(work) -> tuple[list[Delivery], list, list]:
    """The workload as delivered trajectories, plus the seed's view of it."""
    masks, sampled = seed_path.make_validation_batch(work)
    rng = np.random.default_rng(0)
    out = []
    for i, (traj, mask, tokens) in enumerate(zip(work, masks, sampled)):
        trained = np.concatenate([np.r_[np.ones(len(supports), np.uint8), np.zeros(len(obs), np.uint8)]
                                  for supports, obs in traj])
        log_probs = np.where(trained == 1, -rng.exponential(size=len(trained)) - 1e-3, 0.0).astype(np.float32)
        arrays = {
            "prompt_tokens": rng.integers(0, VOCAB, size=256).astype(np.int32),
            "tokens": np.asarray(tokens, np.int32),
            "loss_mask": trained,
            "log_probs": log_probs,
            "mask_ids": mask.ids.numpy(),
            "mask_offsets": mask.offsets.numpy(),
        }
        fields = {"trajectory_id": f"t{i}", "status": "completed", "reward": 0.0, "response_length": len(tokens),
                  "weight_versions": [], "metadata": {}}
        out.append(Delivery(f"t{i}", fields, arrays, 0))
    return out, masks, sampled


def timed(fn, repeat: int) -> tuple[float, float]:
    """(best, median) wall-clock seconds of `repeat` runs on the CPU."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def cuda_timed(fn, repeat: int, warmup: int) -> list[float]:
    """Seconds of each of `repeat` runs of `fn`, between two CUDA events on
    the current stream, after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeat)]
    for start, end in marks:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in marks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9, help="rounds of (3 rollstream runs, 1 seed run)")
    parser.add_argument("--trajectories", type=int, default=64, help="trajectories in the batch")
    parser.add_argument("--gpu-tokens", type=int, default=1_000_000, help="tokens at least in the GPU batch")
    parser.add_argument("--gpu-repeat", type=int, default=50, help="timed GPU runs (the median is reported)")
    parser.add_argument("--gpu-warmup", type=int, default=20, help="untimed GPU runs before them")
    args = parse_args(parser, SMOKE)

    work = seed_path.make_workload(n_traj=args.trajectories)
    deliveries, masks, sampled = deliveries_of(work)
    batch = Batch.from_deliveries(deliveries, device="cpu")
    tokens = int(batch.lengths["response"].sum())
    ids = len(batch.mask_ids)
    assert batch_violations(batch, vocab_size=VOCAB) == []
    seed_path.seed_validate_batch(masks, sampled)  # the seed agrees the batch is valid

    ours_runs, seed_runs = [], []
    for _ in range(args.repeat):
        ours_runs.append(timed(lambda: batch_violations(batch, vocab_size=VOCAB), 3)[0])
        seed_runs.append(timed(lambda: seed_path.seed_validate_batch(masks, sampled), 1)[0])
    ours, ours_median = min(ours_runs), statistics.median(ours_runs)
    seed, seed_median = min(seed_runs), statistics.median(seed_runs)
    # The consumer's way (`Batch.checked_from_deliveries`: on the CPU each sample checked as it is packed) against
    # packing first and checking the packed batch after, in alternation.
    assert checked_batch(deliveries, device="cpu", vocab_size=VOCAB)[1] == []

    def pack_checking() -> None:
        packed, seen_valid = Batch.checked_from_deliveries(deliveries, device="cpu", vocab_size=VOCAB)
        assert seen_valid or batch_violations(packed, vocab_size=VOCAB) == []

    checked_runs, then_runs = [], []
    for _ in range(args.repeat):
        checked_runs.append(timed(pack_checking, 1)[0])
        then_runs.append(timed(lambda: batch_violations(Batch.from_deliveries(deliveries, device="cpu"),
                                                        vocab_size=VOCAB), 1)[0])
    packed, packed_median = min(checked_runs), statistics.median(checked_runs)
    then, then_median = min(then_runs), statistics.median(then_runs)
    ratio = seed / ours
    print(f"batch: {len(deliveries)} trajectories, {tokens:,} response tokens, {ids:,} support ids")
    print("                               best      median")
    print(f"seed per-sample validation:   {seed * 1e3:8.2f} ms {seed_median * 1e3:8.2f} ms")
    print(f"rollstream batch validation:  {ours * 1e3:8.2f} ms {ours_median * 1e3:8.2f} ms  "
          f"({tokens / ours / 1e6:.1f} M tokens/s, {ids / ours / 1e6:.1f} M ids/s, cpu)")
    print(f"rollstream pack + validate:   {packed * 1e3:8.2f} ms {packed_median * 1e3:8.2f} ms  (checked as packed)")
    print(f"  pack, then validate:        {then * 1e3:8.2f} ms {then_median * 1e3:8.2f} ms  "
          f"(ratio {packed_median / then_median:.2f} median to median)")
    print(f"validation speed-up over the seed: {ratio:.1f}x best to best, {seed_median / ours_median:.1f}x median "
          "to median (target 15x)")
    figures = {
        "validate_ratio": round(ratio, 2),
        "validate_ratio_median": round(seed_median / ours_median, 2),
        "tokens_per_s": round(tokens / ours),
        "ids_per_s": round(ids / ours),
        "validate_s": ours,
        "seed_validate_s": seed,
        "pack_validate_s": packed,
        "pack_then_validate_s": then,
        "pack_validate_ratio": round(packed_median / then_median, 3),
        "tokens": tokens,
        "ids": ids,
    }
    if torch.cuda.is_available():
        scale = -(-args.gpu_tokens // tokens)
        big = [d for _ in range(scale) for d in deliveries]
        device = torch.device("cuda")
        gpu_batch = Batch.from_deliveries(big, device=device)
        gpu_tokens = int(gpu_batch.lengths["response"].sum())
        assert batch_violations(gpu_batch, vocab_size=VOCAB) == []
        gpu_runs = cuda_timed(lambda: batch_violations(gpu_batch, vocab_size=VOCAB), args.gpu_repeat, args.gpu_warmup)
        upload_runs = cuda_timed(lambda: Batch.from_deliveries(big, device=device), args.gpu_repeat, args.gpu_warmup)
        gpu, upload = statistics.median(gpu_runs), statistics.median(upload_runs)
        print(f"gpu ({torch.cuda.get_device_name()}; CUDA events, median of {args.gpu_repeat} runs after "
              f"{args.gpu_warmup} warm-up): {gpu_tokens:,}-token batch validated in {gpu * 1e3:.3f} ms "
              f"(best {min(gpu_runs) * 1e3:.3f} ms, {gpu_tokens / gpu / 1e6:.0f} M tokens/s); "
              f"packed and uploaded in {upload * 1e3:.1f} ms")
        figures.update(gpu_tokens=gpu_tokens, gpu_validate_s=gpu, gpu_validate_best_s=min(gpu_runs),
                       gpu_tokens_per_s=round(gpu_tokens / gpu), gpu_pack_upload_s=upload,
                       gpu_pack_upload_best_s=min(upload_runs), gpu_repeat=args.gpu_repeat, gpu_warmup=args.gpu_warmup)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
