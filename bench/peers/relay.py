"""The transport ceiling: frames pushed over two loopback ZeroMQ hops with
nothing done to them.

    sender DEALER -> ROUTER relay DEALER -> ROUTER receiver

Three processes: the sender is the caller, the relay and the receiver are
children. Each message is laid out as the broker frames a turn: one msgpack
header naming its arrays, then one raw frame per array. The relay strips the
routing identity its ROUTER adds and forwards the rest untouched; the
receiver only counts. A broker moving the same frames over the same two hops
does strictly more, so its rate over this one is the share of the transport
it keeps. Compare ratios measured in one run, not absolute rates.

    python bench/peers/relay.py [--messages N] [--array-bytes B] [--arrays K] [--transport tcp|ipc]
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

# How long a child waits for its peers or its messages before giving up, ms.
PATIENCE_MS = 120_000


def frames_like_a_turn(array_bytes: int, arrays: int, seed: int = 0) -> list[bytes]:
    """One message: a msgpack header describing `arrays` byte arrays of
    `array_bytes` each (as the codec's header lists name, dtype and shape),
    followed by the arrays themselves, filled with random bytes."""
    rng = np.random.default_rng(seed)
    header = msgpack.packb({
        "v": 1,
        "type": "turn",
        "trajectory_id": "relay-0",
        "turn": 0,
        "seq": 1,
        "arrays": [[f"array_{k}", "uint8", [array_bytes]] for k in range(arrays)],
    }, use_bin_type=True)
    return [header, *(rng.integers(0, 256, size=array_bytes, dtype=np.uint8).tobytes() for _ in range(arrays))]


def _bind(sock: zmq.Socket, transport: str, directory: str, name: str) -> str:
    """Bind on an address the system picks and return the one bound."""
    sock.bind(f"ipc://{directory}/{name}" if transport == "ipc" else "tcp://127.0.0.1:*")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _receive(conn, transport: str, directory: str, count: int) -> None:
    """The last hop: read `count` messages, then report when the first and
    the last arrived and how many payload bytes came (the routing identity
    left out)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVTIMEO, PATIENCE_MS)
    conn.send(_bind(sock, transport, directory, "receiver"))
    first = None
    payload = 0
    try:
        for _ in range(count):
            parts = sock.recv_multipart(copy=False)
            if first is None:
                first = time.perf_counter()
            payload += sum(part.buffer.nbytes for part in parts[1:])
        conn.send((first, time.perf_counter(), payload))
    except zmq.Again:
        conn.send(None)
    finally:
        sock.close(0)
        ctx.term()


def _forward(conn, transport: str, directory: str, downstream: str, count: int) -> None:
    """The middle hop: `count` messages in on a ROUTER, out on a DEALER
    connected to the receiver, zero-copy, the sender's identity dropped."""
    ctx = zmq.Context()
    inbound = ctx.socket(zmq.ROUTER)
    inbound.setsockopt(zmq.RCVTIMEO, PATIENCE_MS)
    outbound = ctx.socket(zmq.DEALER)
    outbound.setsockopt(zmq.LINGER, PATIENCE_MS)  # what is still queued at the end is delivered, not dropped
    outbound.connect(downstream)
    conn.send(_bind(inbound, transport, directory, "relay"))
    try:
        for _ in range(count):
            outbound.send_multipart(inbound.recv_multipart(copy=False)[1:], copy=False)
    except zmq.Again:
        pass
    finally:
        inbound.close(0)
        outbound.close()
        ctx.term()


def run(messages: int, array_bytes: int, arrays: int, transport: str = "tcp") -> dict:
    """Relay `messages` messages of `arrays` arrays of `array_bytes` each and
    return the figures: `messages`, `bytes` (payload received, header
    included), `seconds` (the receiver's first message to its last),
    `msgs_per_s` and `bytes_per_s`."""
    if transport not in ("tcp", "ipc"):
        raise ValueError(f"transport must be tcp or ipc, not {transport!r}")
    directory = tempfile.mkdtemp(prefix="rollstream-relay-")
    message = frames_like_a_turn(array_bytes, arrays)
    receiver_end, receiver_conn = mp.Pipe()
    relay_end, relay_conn = mp.Pipe()
    receiver = mp.Process(target=_receive, args=(receiver_conn, transport, directory, messages), daemon=True)
    receiver.start()
    relay = None
    ctx = zmq.Context()
    sender = ctx.socket(zmq.DEALER)
    try:
        downstream = receiver_end.recv()
        relay = mp.Process(target=_forward, args=(relay_conn, transport, directory, downstream, messages), daemon=True)
        relay.start()
        sender.connect(relay_end.recv())
        for _ in range(messages):
            sender.send_multipart(message, copy=False)
        if not receiver_end.poll(PATIENCE_MS / 1000):
            raise RuntimeError("the relay's receiver did not report")
        report = receiver_end.recv()
        if report is None:
            raise RuntimeError("the relay's receiver timed out before every message arrived")
        first, last, payload = report
    finally:
        sender.close(0)
        ctx.term()
        for child in (relay, receiver):
            if child is not None:
                child.join(10)
                if child.is_alive():
                    child.terminate()
                    child.join()
        shutil.rmtree(directory, ignore_errors=True)
    seconds = max(last - first, 1e-9)
    return {
        "messages": messages,
        "bytes": payload,
        "seconds": seconds,
        "msgs_per_s": messages / seconds,
        "bytes_per_s": payload / seconds,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--array-bytes", type=int, default=4096)
    parser.add_argument("--arrays", type=int, default=5)
    parser.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    args = parser.parse_args()
    print(json.dumps(run(args.messages, args.array_bytes, args.arrays, args.transport)))
