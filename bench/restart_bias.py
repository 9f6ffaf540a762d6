"""Producer restarts and the length of trained trajectories: does what a
killed producer had open reach the trainer, or do the long ones go missing?

A long trajectory is the likeliest to be open when a producer dies, so a
producer that throws away what it had open at a restart trains fewer long
trajectories than were sampled. Three runs of the same `--prompts` file
(`--group-size` samples each) with the same seed, each on a fresh
`rollstream broker` and with a producer daemon (`rollstream producer
--source synthetic`, a spool and a durable prompt cursor):

  A  no kills;
  B  the daemon SIGKILLed `--kills` times, each restart with
     `--on-restart continue` (what it had open is continued where it stood);
  C  the same kills with `--on-restart abort` (what it had open is given up;
     its groups are trained short).

The synthetic source draws each trajectory (its turns' lengths, tokens and
aborts) from a stream seeded by (seed, prompt, sample), so a kill changes no
length. Lengths vary most with the number of turns: `--turns` turns, each
later turn aborted with `--abort-rate` (the trajectory ends there, cut after
the sampled tokens of the turn before: a replay gap).
`--tool-seconds` between turns keeps trajectories open a while, so at a
kill those open are long ones more often than not. Kills happen at
conditions, not times: once the broker's applied turns (admin status,
`frames.turn.applied`) grew by 1/(kills + 1) of the turns run A applied
since the daemon last started and the broker holds trajectories open; the
daemon is started again at once. Every delivered trajectory is trained by a
`Consumer` (each batch committed); its response length is the batch's
`response_lengths` (the tokens on the response axis the trainer gets,
sampled and tool tokens alike).

Printed per run: trajectories trained (and of them those that ran every
turn), groups trained short and groups lost whole, mean and p90 response
length; for B and C their ratios to A and how many trajectories they
trained with other content than A (tokens, loss mask, log-probs and reward
compared per (prompt, sample); 0 when continuing changes nothing), and
for those of A they did not train, their mean length in A. The
last line is one JSON object, with each run's kills, how many trajectories
each restarted daemon was handed back, and the broker's `resumed` counts.
`--smoke` runs 12 prompts of 2 samples, 4 at a time, with 2 kills, to check
the script end to end.

    .venv/bin/python bench/restart_bias.py [--prompts 1250] [--group-size 4] [--kills 15]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
from procs import Broker, parse_args

from rollstream.common.admin import ask_status
from rollstream.common.errors import TimedOut
from rollstream.consumer import Consumer

VOCAB = 1000
PRODUCER_ID = "restarts"
SMOKE = {"prompts": 12, "group_size": 2, "kills": 2, "concurrency": 4}  # the sizes of --smoke
RUNS = {"A": (None, False), "B": ("continue", True), "C": ("abort", True)}  # on_restart, killed


def write_prompts(path: Path, count: int, seed: int) -> None:
    rng = np.random.default_rng([seed, 9])
    with path.open("w") as out:
        for _ in range(count):
            out.write(json.dumps({"input_ids": rng.integers(0, VOCAB, size=int(rng.integers(4, 13))).tolist()}) + "\n")


def status(broker: Broker) -> dict:
    return ask_status(broker.admin, timeout=10.0)[0]


class Trainer(threading.Thread):
    """The trainer: takes every batch the broker delivers, commits it, and
    keeps what each trajectory brought, by (prompt, sample): its response
    length, its sampled tokens, a digest of its content (tokens, loss mask,
    log-probs, reward) and whether it ran every turn (no replay gap)."""

    def __init__(self, endpoint: str, batch_size: int):
        super().__init__(name="trainer", daemon=True)
        self.endpoint, self.batch_size = endpoint, batch_size
        self.stop = threading.Event()
        self.trained: dict[tuple[int, int], tuple[int, int, str, bool]] = {}
        self.trained_twice = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with Consumer(self.endpoint, batch_size=self.batch_size, vocab_size=VOCAB, checkpointed=False) as consumer:
                while not self.stop.is_set():
                    try:
                        batch = consumer.next_batch(timeout=0.2, partial_after=0.05)
                    except TimedOut:
                        continue
                    self.keep(batch)
                    consumer.commit(batch)
                consumer.flush(60)
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def keep(self, batch) -> None:
        lengths = batch.response_lengths.tolist()
        cu = batch.response_cu.tolist()
        tokens, mask, log_probs = (batch.response_tokens.numpy(), batch.loss_mask.numpy(), batch.log_probs.numpy())
        rewards = batch.rewards.numpy()
        for i, tid in enumerate(batch.trajectory_ids):
            prompt, sample = (int(part) for part in tid.rsplit("-", 2)[1:])
            lo, hi = cu[i], cu[i + 1]
            content = (tokens[lo:hi], mask[lo:hi], log_probs[lo:hi], rewards[i : i + 1])
            digest = hashlib.blake2b(b"".join(part.tobytes() for part in content), digest_size=16).hexdigest()
            self.trained_twice += (prompt, sample) in self.trained
            self.trained[(prompt, sample)] = (int(lengths[i]), int(mask[lo:hi].sum()), digest, batch.gaps[i] is None)


def producer(broker: Broker, work: Path, args: argparse.Namespace, on_restart: str | None, start: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "rollstream.app.cli", "producer", "--source", "synthetic",
               "--broker-endpoint", broker.producer, "--producer-id", PRODUCER_ID, "--metrics-port", "0",
               "--spool-dir", str(work / "spool"), "--prompts", str(work / "prompts.jsonl"),
               "--group-size", str(args.group_size), "--turns", str(args.turns), "--abort-rate", str(args.abort_rate),
               "--response-tokens", str(args.response_tokens), "--tool-tokens", str(args.tool_tokens),
               "--tool-seconds", str(args.tool_seconds), "--prompt-tokens", "8", "--vocab-size", str(VOCAB),
               "--concurrency", str(args.concurrency), "--seed", str(args.seed), "--log-level", "info",
               *(["--on-restart", on_restart] if on_restart else [])]
    with open(work / f"producer-{start}.log", "wb") as log:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)


def wait_for(condition, what: str, timeout: float, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(poll)


def listed_at_start(log: Path) -> int:
    """How many open trajectories a restarted daemon was handed back (its log line)."""
    found = re.search(r"producer restarted: (\d+) trajectories open", log.read_text(errors="replace"))
    return int(found.group(1)) if found else 0


def applied(report: dict) -> int:
    return int(report["counters"].get("frames.turn.applied", 0))


def one_run(name: str, args: argparse.Namespace, prompts_file: Path, step: float) -> dict:
    """Run `name` (A, B or C) on a fresh broker: the daemon started, killed
    and started again per RUNS (each kill once `step` more turns were
    applied since the last start and some trajectory is open), every
    delivered trajectory trained."""
    on_restart, killed = RUNS[name]
    work = Path(tempfile.mkdtemp(prefix=f"rollstream-restarts-{name}-"))
    shutil.copy(prompts_file, work / "prompts.jsonl")
    broker = Broker(VOCAB, ["--heartbeat-interval", "0.5", "--log-level", "warning"])
    trainer = Trainer(broker.consumer, args.batch_size)
    trainer.start()
    started = time.monotonic()
    process = producer(broker, work, args, on_restart, 0)
    kills, open_at_kills = 0, []
    try:
        for _ in range(args.kills if killed else 0):
            before = applied(status(broker))

            def due() -> bool:
                now = status(broker)
                return process.poll() is not None or (applied(now) >= before + step and now["open"] > 0)

            wait_for(due, f"run {name}'s producer to send {step:.0f} more turns", 600)
            if process.poll() is not None:
                break  # it finished before this kill was due
            open_at_kills.append(int(status(broker)["open"]))
            process.send_signal(signal.SIGKILL)
            process.wait(60)
            kills += 1
            process = producer(broker, work, args, on_restart, kills)
        if process.wait(1200) != 0:
            raise RuntimeError(f"run {name}'s producer exited {process.returncode}:\n"
                               f"{(work / f'producer-{kills}.log').read_text(errors='replace')[-3000:]}")

        def drained() -> bool:
            if trainer.error is not None:
                raise RuntimeError(f"run {name}'s trainer failed: {trainer.error!r}") from trainer.error
            now = status(broker)
            return not any(now[key] for key in ("open", "scoring", "queued", "leased", "awaiting_group"))

        wait_for(drained, f"run {name}'s broker to deliver everything", 300, poll=0.1)
        final = status(broker)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(60)
        trainer.stop.set()
        trainer.join(120)
        broker.close()
    if trainer.error is not None:
        raise RuntimeError(f"run {name}'s trainer failed: {trainer.error!r}") from trainer.error
    listed = [listed_at_start(work / f"producer-{start}.log") for start in range(1, kills + 1)]
    shutil.rmtree(work, ignore_errors=True)
    lengths = np.array([kept[0] for kept in trainer.trained.values()], dtype=np.float64)
    sampled = np.array([kept[1] for kept in trainer.trained.values()], dtype=np.float64)
    every_turn = sum(1 for kept in trainer.trained.values() if kept[3])
    members = Counter(prompt for prompt, _ in trainer.trained)
    return {
        "on_restart": on_restart, "kills": kills, "open_at_kills": open_at_kills, "listed_at_restarts": listed,
        "trained": len(trainer.trained), "trained_twice": trainer.trained_twice,
        "short_groups": sum(1 for count in members.values() if count < args.group_size),
        "groups_lost": args.prompts - len(members),
        "dead": int(final["dead"]),
        "mean": round(float(lengths.mean()), 3) if len(lengths) else None,
        "p90": round(float(np.percentile(lengths, 90)), 2) if len(lengths) else None,
        "sampled_mean": round(float(sampled.mean()), 3) if len(sampled) else None,
        "every_turn": every_turn,
        "turns_applied": applied(final), "resumed": final.get("resumed", {}),
        "seconds": round(time.monotonic() - started, 1),
        "_trained": trainer.trained,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1250, help="prompts in the run's --prompts file")
    parser.add_argument("--group-size", type=int, default=4, help="samples per prompt")
    parser.add_argument("--kills", type=int, default=15, help="SIGKILLs of the producer daemon in runs B and C")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--abort-rate", type=float, default=0.2,
                        help="chance that a later turn is aborted, ending its trajectory")
    parser.add_argument("--response-tokens", type=int, default=16, help="mean sampled tokens per turn")
    parser.add_argument("--tool-tokens", type=int, default=4, help="mean tool tokens between turns")
    parser.add_argument("--tool-seconds", type=float, default=0.05, help="seconds a trajectory stays open between turns")
    parser.add_argument("--concurrency", type=int, default=32, help="trajectories the daemon has in progress at once")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    args = parse_args(parser, SMOKE)

    work = Path(tempfile.mkdtemp(prefix="rollstream-restarts-"))
    try:
        write_prompts(work / "prompts.jsonl", args.prompts, args.seed)
        runs = {"A": one_run("A", args, work / "prompts.jsonl", 0)}
        # The kills of B and C spread over the turns A applied (the same turns, drawn from the same streams).
        step = runs["A"]["turns_applied"] / (args.kills + 1)
        runs.update((name, one_run(name, args, work / "prompts.jsonl", step)) for name in ("B", "C"))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = runs["A"]
    for name in ("B", "C"):
        run = runs[name]
        run["mean_ratio"] = round(run["mean"] / base["mean"], 4) if run["mean"] and base["mean"] else None
        run["p90_ratio"] = round(run["p90"] / base["p90"], 4) if run["p90"] and base["p90"] else None
        theirs, ours = base["_trained"], run["_trained"]
        # Trained in both runs but with other content (tokens, loss mask, log-probs or reward) than in A.
        run["differing_from_a"] = sum(1 for key, kept in ours.items() if key in theirs and kept[2] != theirs[key][2])
        missing = [kept[0] for key, kept in theirs.items() if key not in ours]
        run["missing_from_a"] = len(missing)
        # What the trajectories it did not train were long in A: above A's mean when restarts lose the long ones.
        run["missing_mean"] = round(float(np.mean(missing)), 3) if missing else None
    for run in runs.values():
        del run["_trained"]

    print(f"{args.prompts} prompts x {args.group_size} samples, {args.turns} turns (abort rate {args.abort_rate}), "
          f"{args.response_tokens} sampled + {args.tool_tokens} tool tokens a turn, {args.tool_seconds} s tool time, "
          f"seed {args.seed}")
    print(f"{'run':<16} {'kills':>5} {'trained':>7} {'all turns':>9} {'groups short':>12} {'lost':>5} {'mean':>8} "
          f"{'p90':>6} {'mean/A':>7} {'p90/A':>6} {'differ':>6} {'seconds':>7}  resumed")
    for name, run in runs.items():
        label = f"{name} {run['on_restart'] or 'no kills'}"
        print(f"{label:<16} {run['kills']:>5} {run['trained']:>7} {run['every_turn']:>9} {run['short_groups']:>12} "
              f"{run['groups_lost']:>5} {run['mean']:>8.2f} {run['p90']:>6.0f} {run.get('mean_ratio', 1.0):>7.4f} "
              f"{run.get('p90_ratio', 1.0):>6.3f} {run.get('differing_from_a', 0):>6} {run['seconds']:>7.1f}  "
              f"{run['resumed'] or '-'}")
    print(json.dumps({"prompts": args.prompts, "group_size": args.group_size, "turns": args.turns,
                      "abort_rate": args.abort_rate, "seed": args.seed, "runs": runs}))


if __name__ == "__main__":
    main()
