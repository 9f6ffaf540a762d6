"""Fan-in at scale, simulated: one consumer reading from up to 1,000 stand-in brokers.

bench/fanin.py starts a real `rollstream broker` per endpoint, too heavy for
a two-core machine at 1,000. Here, for each N of `--brokers`, one fresh
process of stand-in brokers binds N ROUTER sockets on loopback and speaks
the broker's side of the consumer protocol (docs/protocol.md §4) just far
enough for the library's `Consumer`: hello/welcome, credit, deliver,
ack/acked, nack/nacked and, when a hello asks for `queued_counts`, the
queued counts and revoke/revoked. Together they hold `--trajectories` queued
single-turn trajectories (256 tokens, 4 ids per token over a 151,936 vocab),
dealt round-robin over the N. A `deliver` is encoded once per process; only
its header (lease, trajectory id, queued count) is packed again per
delivery, so the stand-ins' own CPU stays small (it is reported, counted
over the same span as the consumer's, so a reader sees it is not the
bottleneck).

One library `Consumer` over the N endpoints (its own fresh process) first
connects: every stand-in welcomes it and records its credit, but delivers
nothing until the consumer is measuring. Then it takes batches of
`--batch-size` and commits each until it has every trajectory, which must
arrive exactly once (and each stand-in must have delivered each of its own
once and had it acked). Its CPU (every thread, user and system:
`time.process_time`) and wall time count from its first `next_batch` to its
last commit, per trajectory; its memory: the resident set just before that
first call and the peak over the run (`ru_maxrss`, its high-water mark
reset at the start). The Ns run interleaved, `--reps` times; medians are
reported.

The last line is one JSON object, per N: `sim_consumer_cpu_us_per_traj_<N>`,
`sim_consumer_wall_us_per_traj_<N>`, `sim_cpu_ratio_<N>` (that CPU over the
first N's), `sim_consumer_rss_growth_mb_<N>` (peak over the resident set
before the first batch), `sim_consumer_rss_peak_mb_<N>`,
`sim_consumer_setup_mb_<N>` (what constructing and connecting the consumer
added to its resident set), `sim_consumer_ready_s_<N>` (from constructing it
to every broker's welcome), `sim_consumer_msgs_per_traj_<N>` (messages it
sent the stand-ins while measured: credit, acks, heartbeats, ...),
`sim_consumer_gc_share_<N>` (its garbage collections' time, from
`gc.callbacks`, over its CPU time),
`sim_standin_cpu_us_per_traj_<N>`; then
`received_once` (every rep of every N), `trajectories`, `batch_size`, `reps`,
`gc_freeze` (`--gc-freeze`: the consumer's process froze what was alive
once connected, `gc.freeze()`, as a trainer would after setting up).

    .venv/bin/python bench/fanin_sim.py [--brokers 1,64,1000] [--trajectories 4096] [--batch-size 64] [--reps 3] [--gc-freeze]
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import resource
import select
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import numpy as np
import zmq
from procs import parse_args

from rollstream.common.codec import decode, decode_header, encode
from rollstream.common.errors import RemoteProtocolError
from rollstream.common.messages import BROKER_TO_CONSUMER, CONSUMER_TO_BROKER
from rollstream.common.sockets import recv_routed, send_frames

VOCAB = 151_936
TOKENS = 256
PROMPT = 32
IDS_PER_TOKEN = 4
LEASE_TIMEOUT = 60.0  # a real broker's defaults (broker/settings.py)
HEARTBEAT_INTERVAL = 1.0
_POLLIN = int(zmq.POLLIN)  # a plain int: pyzmq's flag enums cost microseconds per `&`
SMOKE = {"brokers": "1,16", "trajectories": 256, "reps": 1}


# -- both processes ------------------------------------------------------------
def _room_for(sockets: int) -> zmq.Context:
    """A context for `sockets` sockets (zmq's default is 1,023), with the
    descriptors they need (an eventfd each, a connection or listener each)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * sockets + 256
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard) if hard != resource.RLIM_INFINITY else want, hard))
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, max(1023, sockets + 64))
    return context


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _send(conn, value: Any) -> None:
    """Between the processes: JSON, not pickle."""
    conn.send_bytes(json.dumps(value).encode())


def _recv(conn, timeout: float, what: str) -> Any:
    try:
        if conn.poll(timeout):
            return json.loads(conn.recv_bytes())
    except EOFError:
        raise RuntimeError(f"{what}, but its process ended (its error is above)") from None
    raise RuntimeError(f"{what} within {timeout:.0f} s")


# -- the stand-in brokers -------------------------------------------------------
@dataclass
class _Endpoint:
    """One stand-in broker: its queued trajectories (numbers) and its one consumer connection."""

    sock: zmq.Socket
    index: int
    queue: deque
    peer: bytes | None = None  # the routing id of the connection that said hello last
    credit: int = 0
    packed: bool = False
    counts: bool = False  # the hello asked for queued counts
    told_any: bool = False  # what those counts last told it: something queued, or nothing
    leases: dict[str, int] = field(default_factory=dict)
    next_lease: int = 0


class StandIns:
    """N brokers' consumer endpoints, as little as the `Consumer` needs of them."""

    def __init__(self, context: zmq.Context, count: int, trajectories: int):
        specs = BROKER_TO_CONSUMER.specs
        # The queued counts (docs/protocol.md §4), where this version's catalogue has them.
        self.counts_known = ("queued_counts" in specs["welcome"].kinds and "queued" in specs["deliver"].kinds
                             and "queued" in specs and "revoked" in specs)
        self.endpoints = []
        for i in range(count):
            sock = context.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:0")
            self.endpoints.append(_Endpoint(sock, i, deque(range(i, trajectories, count))))
        self.open = False  # deliveries wait until the consumer measures
        self.delivered = self.acked = self.redelivered = 0
        self.seen: set[int] = set()
        self.heard: dict[str, int] = {}  # the consumer's messages by type, once deliveries are open
        self.pack = msgpack.Packer(use_bin_type=True).pack
        self.templates = self._templates()

    @staticmethod
    def _templates() -> dict[bool, tuple[dict, list]]:
        """One `deliver`, encoded once unpacked and once packed: its header
        as a map to fill in, and its array frames to send as they are."""
        rng = np.random.default_rng(0)
        # Per token 4 sorted, distinct ids (a random start, random gaps); the sampled token is one of them.
        starts = rng.integers(0, VOCAB - 64, TOKENS)
        ids = (starts[:, None] + np.cumsum(rng.integers(1, 16, (TOKENS, IDS_PER_TOKEN)), axis=1)).astype(np.int32)
        tokens = ids[np.arange(TOKENS), rng.integers(0, IDS_PER_TOKEN, TOKENS)].copy()
        arrays: dict[str, np.ndarray] = {
            "prompt_tokens": np.arange(PROMPT, dtype=np.int32),
            "tokens": tokens,
            "loss_mask": np.ones(TOKENS, np.uint8),
            "log_probs": np.full(TOKENS, -0.5, np.float32),
            "mask_ids": ids.ravel(),
            "mask_offsets": np.arange(TOKENS + 1, dtype=np.int64) * IDS_PER_TOKEN,
        }
        fields = {"lease": "-", "trajectory_id": "-", "status": "completed", "reward": 0.0, "response_length": TOKENS,
                  "weight_versions": ["0"], "metadata": {}, "turns": 1, "delivery_count": 1}
        out = {}
        for packed in (False, True):
            frames = encode(BROKER_TO_CONSUMER, "deliver", fields, arrays, crc=True, packed=packed)
            out[packed] = (decode_header(frames[0]), [bytes(frame) for frame in frames[1:]])
        return out

    def endpoint_names(self) -> list[str]:
        return [e.sock.getsockopt_string(zmq.LAST_ENDPOINT) for e in self.endpoints]

    def _reply(self, e: _Endpoint, peer: bytes, mtype: str, fields: dict) -> None:
        send_frames(e.sock, encode(BROKER_TO_CONSUMER, mtype, fields), identity=peer)

    def serve(self, e: _Endpoint) -> None:
        """Every message waiting at `e`."""
        sock = e.sock
        # Read until ZMQ_EVENTS says nothing is waiting: its descriptor only signals a change, and a send may take
        # that signal, so the state is read again after every message (and is what `deliver`'s callers read last).
        while cast(int, sock.get(zmq.EVENTS)) & _POLLIN:
            peer, *frames = recv_routed(sock)
            try:
                message = decode(frames, CONSUMER_TO_BROKER)
            except RemoteProtocolError as error:
                self._reply(e, peer, "nack", {"code": error.code, "message": error.message})
                continue
            if self.open:
                self.heard[message.type] = self.heard.get(message.type, 0) + 1
            seq = {"seq": message["seq"]} if "seq" in message.fields else {}
            if message.type == "hello":
                self._hello(e, peer, message, seq)
            elif peer != e.peer:
                leases = {"leases": message["leases"]} if "leases" in message.fields else {}
                self._reply(e, peer, "nack", {"code": "unknown_consumer", "message": "say hello first", **leases, **seq})
            elif message.type == "credit":
                e.credit += message["n"]
                self.deliver(e)
            elif message.type == "ack":
                self._ack(e, message, seq)
            elif message.type == "nack":
                back = [e.leases.pop(lease) for lease in message["leases"] if lease in e.leases]
                if message["requeue"]:
                    e.queue.extendleft(reversed(back))
                    self.redelivered += len(back)
                self._reply(e, peer, "nacked", {"leases": message["leases"], **seq})
                self._tell(e)
                self.deliver(e)
            elif message.type == "revoke":
                e.credit = 0
                e.told_any = bool(e.queue)
                self._reply(e, peer, "revoked", {"queued": len(e.queue), **seq})
            # heartbeat, policy, seal, resume: nothing this bench needs

    def _hello(self, e: _Endpoint, peer: bytes, message, seq: dict) -> None:
        """A new session: the old one's leases go back to the front of the queue, its credit is gone."""
        e.queue.extendleft(reversed(list(e.leases.values())))
        self.redelivered += len(e.leases)
        e.leases.clear()
        e.peer, e.credit = peer, 0
        e.packed = bool(message.get("packed_arrays"))
        e.counts = bool(message.get("queued_counts")) and self.counts_known
        welcome: dict[str, Any] = {"broker_id": f"standin-{e.index}", "lease_timeout": LEASE_TIMEOUT,
                                   "heartbeat_interval": HEARTBEAT_INTERVAL, **seq}
        for flag in ("packed_arrays", "split_arrays", "job"):
            if flag in message.fields:
                welcome[flag] = message[flag]
        if e.counts:
            welcome.update(queued_counts=True, queued=len(e.queue))
            e.told_any = bool(e.queue)
        self._reply(e, peer, "welcome", welcome)

    def _ack(self, e: _Endpoint, message, seq: dict) -> None:
        known = [lease for lease in message["leases"] if lease in e.leases]
        for lease in known:
            e.leases.pop(lease)
        self.acked += len(known)
        assert e.peer is not None
        if known:
            self._reply(e, e.peer, "acked", {"leases": known, **seq})
        stale = [lease for lease in message["leases"] if lease not in known]
        if stale:
            self._reply(e, e.peer, "nack", {"code": "stale_lease", "message": "unknown lease", "leases": stale, **seq})

    def deliver(self, e: _Endpoint) -> None:
        """What `e`'s credit allows, once deliveries are open."""
        if not self.open or e.peer is None:
            return
        header, arrays = self.templates[e.packed]
        while e.credit and e.queue:
            number = e.queue.popleft()
            lease = f"{e.index}.{e.next_lease}"
            e.next_lease += 1
            e.leases[lease] = number
            e.credit -= 1
            fields = {**header, "lease": lease, "trajectory_id": f"t{number}"}
            if e.counts:
                fields["queued"] = len(e.queue)
                e.told_any = bool(e.queue)
            send_frames(e.sock, [self.pack(fields), *arrays], identity=e.peer)
            self.delivered += 1
            self.seen.add(number)

    def _tell(self, e: _Endpoint) -> None:
        """An unsolicited `queued`, when what the connection was last told
        (something queued, or nothing) is no longer so."""
        if e.counts and e.peer is not None and bool(e.queue) != e.told_any:
            e.told_any = bool(e.queue)
            self._reply(e, e.peer, "queued", {"n": len(e.queue)})


def _stand_in(conn, count: int, trajectories: int) -> None:
    """The stand-ins' process: binds, says where, serves until told to
    stop, then says what it spent from opening the deliveries on."""
    context = _room_for(count)
    brokers = StandIns(context, count, trajectories)
    _send(conn, {"endpoints": brokers.endpoint_names(), "queued_counts": brokers.counts_known})
    # epoll over the sockets' descriptors: only the ready ones come back (zmq.Poller walks all N on every call).
    ready = select.epoll()
    by_fd = {}
    for e in brokers.endpoints:
        fd = cast(int, e.sock.getsockopt(zmq.FD))
        by_fd[fd] = e
        ready.register(fd, select.EPOLLIN)
    control = conn.fileno()
    ready.register(control, select.EPOLLIN)
    cpu = 0.0
    while True:
        for fd, _ in ready.poll():
            if fd != control:
                brokers.serve(by_fd[fd])
                continue
            order = json.loads(conn.recv_bytes())
            if order == "open":
                cpu = time.process_time()
                brokers.open = True
                for e in brokers.endpoints:
                    brokers.deliver(e)
                    brokers.serve(e)  # its descriptor's signal may have gone to the sends
                continue
            _send(conn, {"cpu": time.process_time() - cpu, "delivered": brokers.delivered, "acked": brokers.acked,
                         "distinct": len(brokers.seen), "redelivered": brokers.redelivered, "heard": brokers.heard,
                         "leased": sum(len(e.leases) for e in brokers.endpoints)})
            ready.close()
            for e in brokers.endpoints:
                e.sock.close()
            context.term()
            return


# -- the consumer -----------------------------------------------------------------
class _Collections:
    """The seconds garbage collections take from now until `stop`, every
    thread's (a collection runs in whichever thread's allocation set it off)."""

    def __init__(self):
        self.seconds = self._started = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def stop(self) -> float:
        gc.callbacks.remove(self._note)
        return self.seconds


def _consume(conn, endpoints: list[str], trajectories: int, batch_size: int, freeze: bool) -> None:
    """The measured consumer: connects (every broker welcomes it), then
    every trajectory in committed batches; its CPU and wall seconds from
    the first request to the last commit, its memory, and how many it got
    and how many of them were distinct. With `freeze`, everything alive
    once it is connected is moved out of the collector's reach first
    (`gc.freeze()`), as a trainer would after setting up."""
    from rollstream.consumer import Consumer
    from rollstream.consumer.batch import as_device

    context = _room_for(4 * len(endpoints))  # per broker a DEALER, its monitor and the monitor's reader
    as_device("cpu")  # torch loaded before the first measure of memory: the consumer's own cost is what is left
    before, start = _rss_bytes(), time.perf_counter()
    with Consumer(endpoints, batch_size=batch_size, vocab_size=VOCAB, device="cpu", context=context) as consumer:
        consumer.wait_welcomed(timeout=300)
        ready = time.perf_counter() - start
        rss = _rss_bytes()
        try:  # the peak from here on (`ru_maxrss` too), not start-up's
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
        except OSError:
            pass
        if freeze:
            gc.freeze()
        _send(conn, "connected")
        _recv(conn, 60, "the bench must say go")
        ids: list[str] = []
        gc_time = _Collections()
        cpu, wall = time.process_time(), time.perf_counter()
        _send(conn, "measuring")
        while len(ids) < trajectories:
            batch = consumer.next_batch(timeout=120, partial_after=0 if trajectories - len(ids) < batch_size else None)
            consumer.commit(batch)
            ids += batch.trajectory_ids
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        collecting = gc_time.stop()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        consumer.flush(timeout=60)  # every ack answered, so the stand-ins can tell each was acked
    context.term()
    _send(conn, {"cpu": cpu, "wall": wall, "ready": ready, "setup": rss - before, "rss": rss, "peak": peak, "gc": collecting,
                 "received": len(ids), "distinct": len(set(ids))})


def one_run(count: int, trajectories: int, batch_size: int, freeze: bool = False) -> dict:
    """N=`count` fresh stand-ins drained by one fresh consumer: its figures and theirs."""
    ctx = mp.get_context("spawn")
    brokers_end, to_brokers = ctx.Pipe()
    consumer_end, to_consumer = ctx.Pipe()
    brokers = ctx.Process(target=_stand_in, args=(brokers_end, count, trajectories))
    consumer: mp.process.BaseProcess | None = None
    brokers.start()
    brokers_end.close()  # the child's alone now: if it dies, reading here ends at once
    try:
        started = _recv(to_brokers, 120, "the stand-ins must bind")
        consumer = ctx.Process(target=_consume, args=(consumer_end, started["endpoints"], trajectories, batch_size,
                                                                freeze))
        consumer.start()
        consumer_end.close()
        _recv(to_consumer, 360, "every stand-in must welcome the consumer")
        _send(to_consumer, "go")
        _recv(to_consumer, 60, "the consumer must start measuring")
        _send(to_brokers, "open")
        result = _recv(to_consumer, 600, "the consumer must receive every trajectory")
        _send(to_brokers, "stop")
        result["standin"] = _recv(to_brokers, 60, "the stand-ins must stop")
        result["queued_counts"] = started["queued_counts"]
        for process in (consumer, brokers):
            process.join(60)
            if process.exitcode != 0:
                raise RuntimeError(f"{process.name} ended with exit code {process.exitcode}")
        return result
    finally:
        for child in (consumer, brokers):
            if child is not None and child.exitcode is None:
                child.kill()
                child.join()


def _describe(r: dict, trajectories: int) -> str:
    """One run's figures, for its line of progress."""
    s, mb = r["standin"], 2**20
    sent = ", ".join(f"{kind} {count / trajectories:.2f}" for kind, count in sorted(s["heard"].items()))
    return (f"consumer {r['cpu'] / trajectories * 1e6:.1f} µs CPU, {r['wall'] / trajectories * 1e6:.1f} µs wall per "
            f"trajectory (GC {r['gc'] / r['cpu']:.0%} of that CPU), ready in {r['ready']:.2f} s, setup "
            f"+{r['setup'] / mb:.1f} MB, RSS {r['rss'] / mb:.0f} -> peak {r['peak'] / mb:.0f} MB; stand-ins "
            f"{s['cpu'] / trajectories * 1e6:.1f} µs CPU per trajectory; received {r['received']} ({r['distinct']} "
            f"distinct), delivered {s['delivered']}, acked {s['acked']}{', queued counts' if r['queued_counts'] else ''}; "
            f"the consumer sent per trajectory: {sent}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--brokers", default="1,64,1000",
                        help="stand-in broker counts, comma-separated (the first is the baseline)")
    parser.add_argument("--trajectories", type=int, default=4096, help="ready trajectories in all, dealt over the brokers")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="interleaved rounds over the broker counts")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="the consumer's process calls gc.freeze() once connected, as a trainer would after setup")
    args = parse_args(parser, SMOKE)
    counts = [int(n) for n in str(args.brokers).split(",")]

    per: dict[int, list[dict]] = {n: [] for n in counts}
    for rep in range(args.reps):
        for n in counts:
            r = one_run(n, args.trajectories, args.batch_size, args.gc_freeze)
            per[n].append(r)
            print(f"rep {rep}: {n:>4} stand-ins: {_describe(r, args.trajectories)}", flush=True)

    def median(n: int, value) -> float:
        return statistics.median(value(r) for r in per[n])

    summary: dict = {}
    cpu = {n: median(n, lambda r: r["cpu"]) / args.trajectories for n in counts}
    mb = 2**20
    for n in counts:
        summary[f"sim_consumer_cpu_us_per_traj_{n}"] = round(cpu[n] * 1e6, 1)
        summary[f"sim_consumer_wall_us_per_traj_{n}"] = round(median(n, lambda r: r["wall"]) / args.trajectories * 1e6, 1)
        summary[f"sim_cpu_ratio_{n}"] = round(cpu[n] / cpu[counts[0]], 3)
        summary[f"sim_consumer_rss_growth_mb_{n}"] = round(median(n, lambda r: max(0, r["peak"] - r["rss"])) / mb, 1)
        summary[f"sim_consumer_rss_peak_mb_{n}"] = round(median(n, lambda r: r["peak"]) / mb, 1)
        summary[f"sim_consumer_setup_mb_{n}"] = round(median(n, lambda r: r["setup"]) / mb, 1)
        summary[f"sim_consumer_ready_s_{n}"] = round(median(n, lambda r: r["ready"]), 3)
        summary[f"sim_consumer_gc_share_{n}"] = round(median(n, lambda r: r["gc"] / r["cpu"]), 3)
        summary[f"sim_consumer_msgs_per_traj_{n}"] = round(
            median(n, lambda r: sum(r["standin"]["heard"].values())) / args.trajectories, 2)
        summary[f"sim_standin_cpu_us_per_traj_{n}"] = round(
            median(n, lambda r: r["standin"]["cpu"]) / args.trajectories * 1e6, 1)
    summary["received_once"] = all(
        r["received"] == r["distinct"] == args.trajectories
        and r["standin"]["delivered"] == r["standin"]["distinct"] == r["standin"]["acked"] == args.trajectories
        for rs in per.values() for r in rs)
    summary.update(trajectories=args.trajectories, batch_size=args.batch_size, reps=args.reps, gc_freeze=args.gc_freeze)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
