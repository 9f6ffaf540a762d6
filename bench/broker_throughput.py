"""Broker throughput against the bare two-hop relay, in the same run.

A producer process streams turn frames (pre-encoded, so it is not the
bottleneck) through a live broker subprocess to a consumer process that
acks every delivered trajectory; both hops are loopback TCP like the relay's.
Two frame shapes: the `peers.seed_path.make_workload` turn (512 sampled tokens with
geometric supports capped at 64, 128 forced tokens) and tiny 32-token turns.
The consumer acks and re-grants credit once per burst of deliveries it has
read, as the consumer library does. The bare relay (`peers/relay.py`) moves
frames of the same total size. Printed: frames/s, tokens/s, bytes/s, the
ratio to the relay, and the broker's peak RSS; `--sync full` and CURVE on
both hops (`relay_ratio_512_curve`, against the same plain relay, so it
sits next to `relay_ratio_512`) are measured too. The last line is JSON.

usage: python bench/broker_throughput.py [--frames N] [--window W] [--repeat R] [--smoke]

`--smoke` runs every measurement at a tiny size, to check the script works;
its figures mean nothing.

The producer keeps the broker's advertised window in flight, as the
producer library does.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import tempfile
import time

import msgpack
import numpy as np
import zmq
from peers import relay as bare_relay
from procs import Broker, parse_args, peak_rss

from rollstream.common.codec import decode, encode
from rollstream.common.curve import ClientCurve, KeyLayout
from rollstream.common.mask import SamplingMask
from rollstream.common.messages import (
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    CONSUMER_TO_BROKER,
    PRODUCER_TO_BROKER,
)
from rollstream.common.trajectory import Turn
from rollstream.common.wire import encode_turn

VOCAB = 151_936
TURNS_PER_TRAJECTORY = 8
SMOKE = {"frames": 64, "tiny_frames": 128, "repeat": 1}  # the sizes of --smoke


def make_turns(tokens: int, forced: int, seed: int = 0) -> list[Turn]:
    """Turn shapes as in peers.seed_path.make_workload."""
    rng = np.random.default_rng(seed)
    turns = []
    for t in range(TURNS_PER_TRAJECTORY):
        sizes = np.minimum(rng.geometric(1 / 8, size=tokens), 64)
        ids = rng.integers(0, VOCAB, size=int(sizes.sum()), dtype=np.int32)
        mask = SamplingMask.from_lengths(ids, sizes)
        last = t == TURNS_PER_TRAJECTORY - 1
        turns.append(Turn.build(ids[mask.offsets[:-1]], -rng.exponential(size=tokens).astype(np.float32), mask=mask,
                                forced_tokens=None if last else rng.integers(0, VOCAB, size=forced, dtype=np.int32)))
    return turns


def encoded_stream(frames: int, tokens: int, forced: int) -> tuple[list[list], int, int]:
    """All producer messages (turns and ends), the turn count and the bytes
    of one turn frame on average."""
    turns = make_turns(tokens, forced)
    prompt = np.arange(64, dtype=np.int32)
    messages, seq, turn_bytes = [], 0, 0
    for i in range(frames // TURNS_PER_TRAJECTORY):
        tid = f"traj-{i}"
        for index, turn in enumerate(turns):
            seq += 1
            msg = encode_turn(tid, index, turn, seq=seq, prompt_tokens=prompt if index == 0 else None)
            turn_bytes += sum(memoryview(f).nbytes for f in msg)
            messages.append([bytes(memoryview(f)) for f in msg])
        seq += 1
        messages.append(encode(PRODUCER_TO_BROKER, "end", {"seq": seq, "trajectory_id": tid, "reward": 1.0}))
    n_turns = (frames // TURNS_PER_TRAJECTORY) * TURNS_PER_TRAJECTORY
    return messages, n_turns, turn_bytes // n_turns


def _greeted(endpoint: str, to_broker, from_broker, hello: dict,
             keys: tuple[str, str] | None = None) -> tuple[zmq.Context, zmq.Socket, dict]:
    """A DEALER in a fresh context (we are a forked process) that said
    hello (over CURVE with `keys`: own .key_secret, broker .key), and the
    broker's welcome."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if keys is not None:
        curve = ClientCurve.from_files(*keys)
        assert curve is not None
        curve.apply(sock)
    sock.connect(endpoint)
    sock.send_multipart(encode(to_broker, "hello", hello))
    return ctx, sock, decode(sock.recv_multipart(), from_broker).fields


def _producer(endpoint, shape, window, out, keys=None):
    # Encoded here rather than inherited from the parent: touching the
    # parent's objects after the fork would copy their pages on write, work
    # the relay's sender does not do, on the same two cores as the broker.
    messages, _, _ = encoded_stream(*shape)
    ctx, sock, welcome = _greeted(endpoint, PRODUCER_TO_BROKER, BROKER_TO_PRODUCER, {"producer_id": "bench"}, keys)
    window = window or welcome["window"]  # as a producer does: the broker's window unless told less
    in_flight, sent, acked, refused = 0, 0, 0, 0
    start = time.perf_counter()
    while acked + refused < len(messages):
        while in_flight < window and sent < len(messages):
            sock.send_multipart(messages[sent], copy=False)
            sent += 1
            in_flight += 1
        reply = msgpack.unpackb(sock.recv())  # a bare parse: the load generator must not compete for CPU
        in_flight -= 1
        if reply["type"] == "ack":
            acked += 1
        else:
            refused += 1
    out.put(("producer", start, acked, refused))
    sock.close()
    ctx.term()


def _consumer(endpoint, trajectories, credit, out, keys=None):
    """Acks every delivery, as the consumer library does: the deliveries
    read in one go are acked in one message and their credit re-granted
    in one more (the library merges settlements and grants per broker).
    Its hello says it reads packed and split arrays, as the library's does."""
    hello = {"consumer_id": "bench", "packed_arrays": True, "split_arrays": True}
    ctx, sock, welcome = _greeted(endpoint, CONSUMER_TO_BROKER, BROKER_TO_CONSUMER, hello, keys)
    sock.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": credit, "unit": "trajectory"}))
    received, start, tokens = 0, None, 0
    while received < trajectories:
        # Heard from at the broker's interval while it waits (the producer may take a while to encode a large run),
        # as the library's consumer is: a silent one is dropped as gone.
        while not sock.poll(welcome["heartbeat_interval"] * 1000):
            sock.send_multipart(encode(CONSUMER_TO_BROKER, "heartbeat", {}))
        leases, flags = [], 0
        while True:
            try:
                frames = sock.recv_multipart(flags, copy=False)
            except zmq.Again:
                break
            flags = zmq.NOBLOCK  # the first waits; the rest are what has already arrived
            message = decode(frames, BROKER_TO_CONSUMER, check_content=False)  # as the relay's receiver
            if message.type == "deliver":
                start = start or time.perf_counter()
                tokens += message["response_length"]
                leases.append(message["lease"])
        if leases:
            received += len(leases)
            sock.send_multipart(encode(CONSUMER_TO_BROKER, "ack", {"leases": leases}))
            sock.send_multipart(encode(CONSUMER_TO_BROKER, "credit", {"n": len(leases), "unit": "trajectory"}))
    out.put(("consumer", time.perf_counter(), received, tokens))
    time.sleep(0.5)  # let the last acks leave
    sock.close()
    ctx.term()


def run_broker(shape: tuple, n_turns: int, window: int, sync: str, curve: KeyLayout | None = None) -> dict:
    broker = Broker(None, ["--sync", sync, *(curve.broker_args() if curve else [])],
                    curve.client_keys("admin") if curve else None)
    try:
        out = mp.Queue()
        trajectories = n_turns // TURNS_PER_TRAJECTORY
        consumer = mp.Process(target=_consumer, args=(broker.consumer, trajectories, 32, out,
                                                      curve.client_keys("consumer") if curve else None))
        consumer.start()
        time.sleep(0.3)
        producer = mp.Process(target=_producer, args=(broker.producer, shape, window, out,
                                                      curve.client_keys("producer") if curve else None))
        producer.start()
        results = dict((item[0], item[1:]) for item in (out.get(timeout=600), out.get(timeout=600)))
        producer.join()
        consumer.join()
        # From the producer's first frame (after its hello; the relay is timed
        # from its first message too) to the consumer's last delivery.
        # perf_counter is the system-wide monotonic clock on Linux.
        seconds = results["consumer"][0] - results["producer"][0]
        rss = peak_rss(broker.pid)
    finally:
        broker.close()
    _, acked, refused = results["producer"]
    assert refused == 0, f"{refused} frames were refused"
    return {
        "seconds": seconds,
        "frames_per_s": n_turns / seconds,
        "tokens_per_s": results["consumer"][2] / seconds,
        "broker_peak_rss_bytes": rss,
    }


def run_relay(messages: int, frame_bytes: int) -> dict:
    arrays = 5
    return bare_relay.run(messages, max(1, frame_bytes // arrays), arrays, "tcp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=4000, help="turn frames per 512-token run")
    parser.add_argument("--tiny-frames", type=int, default=16000, help="turn frames per 32-token run")
    parser.add_argument("--window", type=int, default=0, help="frames in flight; 0: the broker's welcome window")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved runs of each; the best is reported")
    args = parse_args(parser, SMOKE)

    def best(runs: list[dict], key: str) -> dict:
        return max(runs, key=lambda r: r[key])

    results = {}
    curve = KeyLayout.generate(tempfile.mkdtemp(prefix="rollstream-bench-keys-"),
                               {"producers": "producer", "consumers": "consumer", "admin": "admin"})
    for label, tokens, forced, frames in (("512", 512, 128, args.frames), ("32", 32, 8, args.tiny_frames)):
        _, n_turns, frame_bytes = encoded_stream(frames, tokens, forced)
        runs: dict[str, list[dict]] = {"relay": [], "normal": [], "full": [], "curve": []}
        for _ in range(args.repeat):  # interleaved, best of each: the machine is shared and noisy
            runs["relay"].append(run_relay(n_turns, frame_bytes))
            runs["normal"].append(run_broker((frames, tokens, forced), n_turns, args.window, "normal"))
            if label == "512":
                runs["full"].append(run_broker((frames, tokens, forced), n_turns, args.window, "full"))
                runs["curve"].append(run_broker((frames, tokens, forced), n_turns, args.window, "normal", curve))
        results[label] = {"relay": best(runs["relay"], "msgs_per_s"), "normal": best(runs["normal"], "frames_per_s"),
                          "frame_bytes": frame_bytes}
        for mode in ("full", "curve"):
            if runs[mode]:
                results[label][mode] = best(runs[mode], "frames_per_s")
        relay = results[label]["relay"]
        print(f"{label}-token turns ({frame_bytes} bytes/frame, {n_turns} frames, best of {args.repeat}):")
        print(f"  raw relay     {relay['msgs_per_s']:>10.0f} frames/s  {relay['bytes_per_s'] / 1e6:>8.1f} MB/s")
        for mode in ("normal", "full", "curve"):
            if mode in results[label]:
                r = results[label][mode]
                print(f"  broker {mode:<6} {r['frames_per_s']:>10.0f} frames/s"
                      f"  {r['frames_per_s'] * frame_bytes / 1e6:>8.1f} MB/s"
                      f"  {r['tokens_per_s']:>12.0f} tokens/s  ratio {r['frames_per_s'] / relay['msgs_per_s']:.2f}"
                      f"  peak RSS {r['broker_peak_rss_bytes'] / 2**20:.0f} MiB")
    shutil.rmtree(curve.root, ignore_errors=True)
    r512, r32 = results["512"], results["32"]
    print(json.dumps({
        "relay_ratio_512": round(r512["normal"]["frames_per_s"] / r512["relay"]["msgs_per_s"], 3),
        "relay_ratio_32": round(r32["normal"]["frames_per_s"] / r32["relay"]["msgs_per_s"], 3),
        "relay_ratio_512_sync_full": round(r512["full"]["frames_per_s"] / r512["relay"]["msgs_per_s"], 3),
        "relay_ratio_512_curve": round(r512["curve"]["frames_per_s"] / r512["relay"]["msgs_per_s"], 3),
        "frames_per_s_512": round(r512["normal"]["frames_per_s"]),
        "frames_per_s_512_sync_full": round(r512["full"]["frames_per_s"]),
        "frames_per_s_512_curve": round(r512["curve"]["frames_per_s"]),
        "frames_per_s_32": round(r32["normal"]["frames_per_s"]),
        "relay_frames_per_s_512": round(r512["relay"]["msgs_per_s"]),
        "relay_frames_per_s_32": round(r32["relay"]["msgs_per_s"]),
        "broker_peak_rss_bytes": max(r512["normal"]["broker_peak_rss_bytes"], r32["normal"]["broker_peak_rss_bytes"]),
    }))


if __name__ == "__main__":
    main()
