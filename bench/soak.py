"""Soak: the fuzz of tests/faults/test_fuzz.py at scale, against
a broker that is SIGKILLed and restarted on the same data dir and ports
over and over, while a library `Producer` with a spool sends valid
trajectories through it all.

Malformed frames go to all three sockets from raw peers, each round's
replies read and checked before the next kill, among valid frames from raw
producers (one that said hello, one that never did). A raw consumer checks
every delivery against the arrays sent and acks it. At the end, every
trajectory whose `end` was acked must have been delivered intact, and none
delivered again after the broker confirmed its ack.

Prints figures, then one JSON line. The generator and the checking consumer
are tests/faults/fuzz_frames.py, whose folder (inside the repository) is put
on sys.path. `--smoke` sends a few thousand malformed frames across two
kills, to check the script end to end.

    .venv/bin/python bench/soak.py [--frames 100000] [--kills 30] [--seconds 600]
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "faults"))
from fuzz_frames import AdminFuzz, ConsumerFuzz, ProducerFuzz, Taker, exchange, peer  # noqa: E402
from procs import parse_args  # noqa: E402

from rollstream.common.admin import ask_status  # noqa: E402
from rollstream.producer import Producer  # noqa: E402

VOCAB = 1000
MAX_MESSAGE_BYTES = 64 << 10
ROUND = 200  # malformed frames per socket between checks (and possible kills)
WAIT_MS = 30_000

SMOKE = {"frames": 2000, "kills": 2, "seconds": 15.0}  # the sizes of --smoke


class RestartingBroker:
    """`rollstream broker` on loopback ports it picks at the first start and
    keeps, with one data dir, killed and started again at will."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.endpoints_file = directory / "endpoints.json"
        self.endpoints = {name: "tcp://127.0.0.1:0" for name in ("producer", "consumer", "admin")}
        self.process: subprocess.Popen | None = None
        self.log = open(directory / "broker.log", "ab")

    def start(self) -> None:
        self.endpoints_file.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rollstream.app.cli", "broker", "--data-dir", str(self.directory / "data"),
             "--producer-endpoint", self.endpoints["producer"], "--consumer-endpoint", self.endpoints["consumer"],
             "--admin-endpoint", self.endpoints["admin"], "--endpoints-file", str(self.endpoints_file),
             "--vocab-size", str(VOCAB), "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--heartbeat-interval", "2",
             "--metrics-port", "0", "--log-level", "error"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.endpoints_file.exists():  # written once it listens
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the broker did not start (exit {self.process.poll()}); see {self.log.name}")
            time.sleep(0.02)
        self.endpoints = json.loads(self.endpoints_file.read_text())

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)


class LibraryTraffic(threading.Thread):
    """Valid trajectories through the library `Producer` (spooled, so it
    resends across kills) until stopped; records those whose `end` was acked."""

    def __init__(self, endpoint: str, spool: Path, fuzz: ProducerFuzz):
        super().__init__(daemon=True)
        self.producer = Producer(endpoint, "soak-library", spool_dir=str(spool), window=64)
        self.fuzz, self.ends, self.errors = fuzz, [], []
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                messages = self.fuzz.valid_trajectory()
                tid = messages[0][0]
                handle = None
                for _, message in messages:
                    a = message.arrays
                    if message.header["type"] == "end":
                        self.ends.append((tid, handle.end(message.header["reward"])))
                        continue
                    if handle is None:
                        handle = self.producer.trajectory(tid, a["prompt_tokens"])
                    handle.turn(a["tokens"], a["log_probs"], mask_ids=a["mask_ids"], mask_offsets=a["mask_offsets"],
                                forced_tokens=a.get("forced_tokens"), full_log_probs=a.get("full_log_probs"),
                                mask_log_probs=a.get("mask_log_probs"),
                                mask_log_probs_normalized=message.header.get("mask_log_probs_normalized", False))
        except Exception as exc:  # reported in the figures, never silently lost
            self.errors.append(repr(exc))

    def acked(self, timeout: float) -> list[str]:
        """Stop, wait for every end, and the trajectories the broker acked."""
        self.stopping.set()
        self.join()
        self.producer.flush(timeout)
        out = []
        for tid, future in self.ends:
            try:
                if future.result(timeout).applied:
                    out.append(tid)
            except Exception as exc:
                self.errors.append(f"{tid}: {exc!r}")
        self.producer.close()
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=100_000, help="malformed frames in all (all sockets)")
    parser.add_argument("--kills", type=int, default=30, help="broker SIGKILLs and restarts, spread over the run")
    parser.add_argument("--seconds", type=float, default=600.0, help="stop sending after this long, however far")
    parser.add_argument("--seed", type=int, default=14)
    args = parse_args(parser, SMOKE)

    directory = Path(tempfile.mkdtemp(prefix="rollstream-soak-"))
    broker = RestartingBroker(directory)
    broker.start()
    seed = args.seed * 100
    noisy_fuzz = ProducerFuzz(seed + 1, VOCAB, MAX_MESSAGE_BYTES, prefix="p")
    quiet_fuzz = ProducerFuzz(seed + 2, VOCAB, MAX_MESSAGE_BYTES, prefix="q", valid_share=1.0)
    library_fuzz = ProducerFuzz(seed + 3, VOCAB, MAX_MESSAGE_BYTES, prefix="l", valid_share=1.0)
    consumer_fuzz = ConsumerFuzz(seed + 4, VOCAB, MAX_MESSAGE_BYTES, prefix="c")
    admin_fuzz = AdminFuzz(seed + 5, VOCAB, MAX_MESSAGE_BYTES, prefix="a")
    taker = Taker(broker.endpoints["consumer"], "soak-taker", noisy_fuzz.expected, quiet_fuzz.expected,
                  library_fuzz.expected, wait_ms=WAIT_MS)
    noisy, quiet = peer(broker.endpoints["producer"]), peer(broker.endpoints["producer"])
    stranger, admin = peer(broker.endpoints["consumer"]), peer(broker.endpoints["admin"])
    library = LibraryTraffic(broker.endpoints["producer"], directory / "spool", library_fuzz)
    library.start()

    problems, codes = [], Counter()
    malformed = valid_raw = kills = rounds = 0
    started = time.perf_counter()
    while malformed < args.frames and time.perf_counter() - started < args.seconds:
        rounds += 1
        chunks = ((noisy, [noisy_fuzz.next() for _ in range(ROUND)]),
                  (quiet, [quiet_fuzz.next() for _ in range(20)]),
                  (stranger, [consumer_fuzz.stranger() for _ in range(ROUND)]),
                  (admin, [admin_fuzz.next() for _ in range(ROUND)]))
        for sock, chunk in chunks:
            problems += exchange(sock, chunk, WAIT_MS, codes)
            for sent in chunk:
                malformed += sum(e.type == "nack" for e in sent.expects)
                valid_raw += sum(e.type != "nack" for e in sent.expects)
        if not broker.alive():
            problems.append(f"the broker died in round {rounds}")
            broker.start()
        taker.drain()
        if kills < args.kills and malformed >= args.frames * (kills + 1) / (args.kills + 1):  # spread over the run
            broker.kill()
            kills += 1
            broker.start()
    sending = time.perf_counter() - started
    for sock, fuzz in ((noisy, noisy_fuzz), (quiet, quiet_fuzz)):  # the trajectories under way, ended
        problems += exchange(sock, fuzz.finish(), WAIT_MS, codes)
    acked = library.acked(timeout=120) + list(noisy_fuzz.expected) + list(quiet_fuzz.expected)
    taker.wait_for(acked, quiet_ms=WAIT_MS)
    status, _ = ask_status(broker.endpoints["admin"], timeout=10)
    broker.stop()

    delivered = set(taker.delivered)
    lost = sorted(set(acked) - delivered)
    corrupted = len(taker.failures)
    redelivered = sum(n - 1 for n in taker.delivered.values())
    library_frames = sum(traj.turns + 1 for traj in library_fuzz.expected.values())
    verified = not (lost or taker.duplicates or corrupted or problems or library.errors)
    print(f"soak: {rounds} rounds in {sending:.1f} s, {kills} broker SIGKILLs and restarts")
    print(f"  malformed frames   {malformed:>9}  ({malformed / sending:,.0f}/s, all three sockets)")
    print(f"  valid raw frames   {valid_raw:>9}  library frames {library_frames} (spooled producer)")
    print("  nacks by code      " + ", ".join(f"{code} {n}" for code, n in codes.most_common()))
    print(f"  trajectories acked {len(acked):>9}  delivered {len(delivered)}  redelivered {redelivered}  "
          f"consumer hellos {taker.hellos}")
    print(f"  lost {len(lost)}  duplicated {len(taker.duplicates)}  corrupted {corrupted}  misanswered {len(problems)}  "
          f"producer errors {len(library.errors)}")
    print(f"  broker at the end: open {status['open']} queued {status['queued']} leased {status['leased']} "
          f"dead {status['dead']}")
    for line in (problems + taker.failures + library.errors + [f"lost {tid}" for tid in lost])[:10]:
        print("  !", line[:300])
    print(json.dumps({"frames": malformed + valid_raw + library_frames, "malformed": malformed, "kills": kills,
                      "trajectories": len(acked), "lost": len(lost), "duplicated": len(taker.duplicates),
                      "corrupted": corrupted, "misanswered": len(problems), "redelivered": redelivered,
                      "frames_per_s": round((malformed + valid_raw + library_frames) / sending),
                      "seconds": round(sending, 1), "verified": verified}))
    if verified:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        print(f"  kept {directory} (broker.log, data)")
    sys.exit(0 if verified else 1)


if __name__ == "__main__":
    main()
