"""How fast one producer process goes, so load tests know it is not the
bottleneck:

1. the synthetic source's own generation rate (sampling over Zipf-like
   logits, no I/O);
2. turns/s and tokens/s one `AsyncProducer` sustains against a live broker
   subprocess (ipc:// in a temporary directory), every frame acked durably,
   with turns pre-generated so the figure is the client's and the broker's,
   and the share of a core the producer process used meanwhile (well below
   1.0: the broker, not the producer, sets the pace).

Printed figures, not pass/fail timings. The last line is one JSON object.

`--smoke` measures for a second instead, to check the script end to end.

    .venv/bin/python bench/producer_rate.py [--seconds 5] [--response-tokens 128]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time

import numpy as np
from procs import parse_args

from rollstream.producer import AsyncProducer
from rollstream.producer.settings import ProducerSettings
from rollstream.producer.synthetic import SyntheticSource, around

SMOKE = {"seconds": 1.0}  # the sizes of --smoke


def synthetic_rate(settings: ProducerSettings, seconds: float) -> tuple[float, float]:
    """(turns/s, sampled tokens/s) of the synthetic sampler alone."""
    source, rng = SyntheticSource(settings, "bench"), np.random.default_rng(settings.seed)
    turns = tokens = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += len(source.turn(rng, around(rng, settings.response_tokens)).tokens)
        turns += 1
    elapsed = time.perf_counter() - start
    return turns / elapsed, tokens / elapsed


def turn_pool(settings: ProducerSettings, size: int):
    """Pre-generated turns (tokens, log-probs, mask, forced) to send repeatedly."""
    source, rng = SyntheticSource(settings, "bench"), np.random.default_rng(settings.seed)
    pool = []
    for _ in range(size):
        drawn = source.turn(rng, around(rng, settings.response_tokens))
        forced = rng.integers(0, settings.vocab_size, size=settings.tool_tokens, dtype=np.int32)
        pool.append((drawn, forced))
    return pool


async def broker_rate(endpoint: str, settings: ProducerSettings, seconds: float, window: int) -> dict:
    pool = turn_pool(settings, 256)
    prompt = np.arange(settings.prompt_tokens, dtype=np.int32)
    async with AsyncProducer(endpoint, "bench", window=window) as producer:
        turns = tokens = frames = 0
        last = None
        start, cpu_start = time.perf_counter(), time.process_time()
        index = 0
        while time.perf_counter() - start < seconds:
            traj = producer.trajectory(f"bench-{index}", prompt)
            for t in range(settings.turns):
                drawn, forced = pool[(index * settings.turns + t) % len(pool)]
                final = t == settings.turns - 1
                last = await traj.turn(drawn.tokens, drawn.log_probs, mask=drawn.mask,
                                       forced_tokens=None if final else forced)
                turns += 1
                tokens += len(drawn.tokens) + (0 if final else len(forced))
            last = await traj.end(1.0)
            frames += settings.turns + 1
            index += 1
        await producer.flush()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        await last
        totals = producer.metrics.totals
    return {"turns_per_s": turns / elapsed, "tokens_per_s": tokens / elapsed, "frames_per_s": frames / elapsed,
            "trajectories": index, "resends": int(totals.get("resends", 0)), "producer_cpu": cpu / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--window", type=int, default=ProducerSettings.window,
                        help="frames in flight (the defaults of both daemons)")
    args = parse_args(parser, SMOKE)
    settings = ProducerSettings(response_tokens=args.response_tokens, tool_tokens=32, prompt_tokens=256, turns=4)

    synthetic_turns, synthetic_tokens = synthetic_rate(settings, args.seconds / 2)
    print(f"synthetic source: {synthetic_turns:,.0f} turns/s, {synthetic_tokens:,.0f} sampled tokens/s "
          f"(vocab {settings.vocab_size}, top_k {settings.top_k}, top_p {settings.top_p})")

    with tempfile.TemporaryDirectory(prefix="rollstream-bench-") as root:
        endpoints = {name: f"ipc://{root}/{name}" for name in ("producer", "consumer", "admin")}
        broker = subprocess.Popen([sys.executable, "-m", "rollstream.app.cli", "broker",
                                   "--producer-endpoint", endpoints["producer"],
                                   "--consumer-endpoint", endpoints["consumer"], "--admin-endpoint", endpoints["admin"],
                                   "--data-dir", f"{root}/data", "--metrics-port", "0", "--log-level", "warning",
                                   "--window", str(args.window)])
        try:
            rates = asyncio.run(broker_rate(endpoints["producer"], settings, args.seconds, args.window))
        finally:
            broker.terminate()
            broker.wait()
    print(f"producer -> broker: {rates['turns_per_s']:,.0f} turns/s, {rates['tokens_per_s']:,.0f} tokens/s, "
          f"{rates['frames_per_s']:,.0f} frames/s acked ({rates['trajectories']} trajectories of {settings.turns} "
          f"turns, ~{args.response_tokens} sampled + {settings.tool_tokens} forced tokens a turn, window {args.window}); "
          f"the producer process used {rates['producer_cpu']:.0%} of a core")
    print(json.dumps({
        "turns_per_s": round(rates["turns_per_s"], 1),
        "tokens_per_s": round(rates["tokens_per_s"], 1),
        "frames_per_s": round(rates["frames_per_s"], 1),
        "synthetic_turns_per_s": round(synthetic_turns, 1),
        "synthetic_tokens_per_s": round(synthetic_tokens, 1),
        "response_tokens": args.response_tokens,
        "window": args.window,
        "resends": rates["resends"],
        "producer_cpu_fraction": round(rates["producer_cpu"], 2),
    }))


if __name__ == "__main__":
    main()
