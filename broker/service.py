"""The broker's I/O shell: three ROUTER sockets and one poll loop around the
merge engine, the dispatcher and the store.

Each pass reads a batch of producer frames, runs them through the engine,
commits every effect of the batch in one store transaction (group commit),
and only then sends the replies, so an `ack` always means durable. Consumer
acks are made durable the same way before `acked` goes out.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import zmq

from rollstream.common.admin import write_endpoints_file
from rollstream.common.codec import Message, decode, encode, encode_error, split_batch
from rollstream.common.contract import LIVENESS_INTERVALS
from rollstream.common.errors import ProtocolError
from rollstream.common.messages import (
    ADMIN_REPLIES,
    ADMIN_REQUESTS,
    BATCHABLE_TYPES,
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    CONSUMER_TO_BROKER,
    PRODUCER_TO_BROKER,
)
from rollstream.common.sockets import recv_routed, router, send_frames
from rollstream.common.validation import check_message_arrays, messages_content_valid
from rollstream.common.wire import encode_deliver

from .curve import CurveGuard
from .dispatch import Dispatch, Dispatcher, DispatchSettings
from .engine import (
    DEAD,
    ENDED,
    OPEN,
    DeadLetter,
    DeliveryUnit,
    DropTrajectory,
    Effect,
    EngineSettings,
    MarkGap,
    MergeEngine,
)
from .flow import DiskAdmission, MemoryBudget, WindowGrants
from .hello import Hellos
from .metrics import BrokerMetrics
from .recovery import load_trajectory, restore
from .settings import BrokerSettings
from .settlement import Settlement
from .store import Store, StoreError

log = logging.getLogger("rollstream.broker")

HOUSEKEEPING_EVERY = 0.2  # seconds between expiry, lease and budget checks
PROBE_EVERY = 1.0  # seconds between store probes while unavailable
PRODUCER_FORGET_AFTER = 3600.0  # seconds after which a silent producer connection is forgotten
# Bytes: a larger frame (a 1 MiB turn of top-p supports, sent split) goes without a copy (see `_send`).
ZERO_COPY_SEND_ABOVE = 1 << 19
# A turn frame this large (a turn of top-p-sized supports) has its content
# rules checked on a thread of their own as soon as it is decoded, while the
# main thread receives and decodes the rest of the batch; numpy releases the
# GIL over arrays this size. The outcome is taken before the batch merges.
CHECK_AHEAD_FROM_BYTES = 1 << 20
PRODUCER_ACTIVE_FOR = 30.0  # seconds a producer connection counts as active after its last frame (it pings every second)


def _content_error(arrays, vocab_size: int | None) -> ProtocolError | None:
    """The first content rule a turn's arrays break, or None."""
    try:
        check_message_arrays(arrays, vocab_size=vocab_size)
    except ProtocolError as error:
        return error
    return None


@dataclass(slots=True)
class _Pending:
    """A producer reply waiting for its batch to commit."""

    identity: bytes
    frames: list | None = None  # ready to send (hello, ping, refusals)
    ack: dict | None = None  # sent as `ack` if the commit succeeds
    message: Message | None = None


class Clock(NamedTuple):
    """The two times a pass runs on: `mono` (monotonic, never jumps) for
    leases, heartbeats, liveness and schedules; `wall` for what is persisted
    and compared across restarts (TTL, dedup windows, dead letters' times)."""

    mono: float
    wall: float

    @classmethod
    def read(cls) -> "Clock":
        return cls(time.monotonic(), time.time())


class BrokerService:
    def __init__(self, settings: BrokerSettings, context: zmq.Context | None = None):
        self.settings = settings
        self.metrics = BrokerMetrics()
        # A CURVE broker answers its context's authentication requests, so it takes a context of its own.
        self._own_context = context is None and settings.curve_secret_key is not None
        self.context = context or (zmq.Context() if self._own_context else zmq.Context.instance())
        self.curve = None if settings.curve_secret_key is None else CurveGuard(settings, self.context, self.metrics)
        self._reload_keys = False  # a SIGHUP asked for the key directories to be read again
        self.store = Store(settings.data_dir, sync=settings.sync, segment_bytes=settings.segment_bytes)
        self.engine = self._new_engine()
        self.dispatcher = Dispatcher(
            DispatchSettings(settings.lease_timeout, settings.heartbeat_interval, settings.max_deliveries)
        )
        self.broker_id = settings.broker_id or f"{socket.gethostname()}:{os.path.abspath(settings.data_dir)}"
        self.unavailable = False  # writes fail: producer frames are refused until a probe succeeds
        self._reads_failed = False  # a trajectory could not be read back: deliveries wait for the probe too
        self.memory = MemoryBudget(settings.max_memory_bytes)  # when producer frames are read, how far to evict
        self.admission = DiskAdmission(settings.max_disk_bytes, self._disk_reserve())
        self.producers: dict[bytes, float] = {}  # connection -> last heard
        self.grants = WindowGrants(settings.window, settings.max_in_flight)  # frames in flight per producer connection
        self.hellos = Hellos(self.broker_id, max_message_bytes=settings.max_message_bytes,
                             lease_timeout=settings.lease_timeout, heartbeat_interval=settings.heartbeat_interval)
        self._stopping = False
        self._next_housekeeping = 0.0
        self._next_probe = 0.0
        self._next_dedup_prune = 0.0
        self._next_producer_prune = 0.0
        self._memory_bytes = 0
        self._disk_bytes = 0
        self._free_bytes = 0  # on the data dir's file system
        self._redeliveries_seen = 0
        self.sockets: dict[str, zmq.Socket] = {}
        self.endpoints: dict[str, str] = {}  # by socket name, as bound (a port 0 resolved)
        self._metrics_server = None
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="rollstream-checker")  # see CHECK_AHEAD_FROM_BYTES

    def _disk_reserve(self) -> int:
        """Free space the broker keeps for ends and consumer acks: the
        setting, or 5% of the data dir's file system, at most 1 GiB (as
        databases keep free space so that deletes can still be written)."""
        if self.settings.disk_reserve_bytes is not None:
            return self.settings.disk_reserve_bytes
        Path(self.settings.data_dir).mkdir(parents=True, exist_ok=True)
        fs = os.statvfs(self.settings.data_dir)
        return min(1 << 30, fs.f_blocks * fs.f_frsize // 20)

    def _free_space(self) -> int:
        fs = os.statvfs(self.settings.data_dir)
        return fs.f_bavail * fs.f_frsize

    def _new_engine(self) -> MergeEngine:
        s = self.settings
        return MergeEngine(EngineSettings(s.trajectory_ttl, s.dedup_window), stored_digest=self._stored_digest)

    def _stored_digest(self, trajectory_id: str, turn: int) -> bytes:
        """A stored applied turn's digest, read back to compare a resend with
        it; a store that cannot be read is unavailable, and the resend is
        refused `unavailable` (to come again) rather than judged."""
        try:
            return self.store.turn_digest(trajectory_id, turn)
        except StoreError as exc:
            self._store_failed(f"cannot read turn {turn} of {trajectory_id!r} back to compare a resend: {exc}")
            raise ProtocolError("unavailable", "the broker cannot read its store right now; resend later") from None

    # -- life cycle ---------------------------------------------------------
    def start(self) -> None:
        """Open and check the store, restore state, bind the sockets."""
        recovered = self.store.open()
        self._disk_bytes, self._free_bytes = self.store.bytes_on_disk(), self._free_space()
        for unit in restore(self.engine, recovered, self.store):
            self.dispatcher.enqueue(unit)
        counts = self.engine.counts()
        log.info("store recovered", extra={"data_dir": self.settings.data_dir, "open": counts[OPEN],
                                           "ready": self.dispatcher.queued_trajectories, "dead": counts[DEAD]})
        s = self.settings
        options = dict(high_water_mark=s.high_water_mark, heartbeat_interval=s.heartbeat_interval,
                       max_message_bytes=s.max_message_bytes)
        if s.endpoints_file:  # a file left by an earlier run must not send anyone to its old ports
            Path(s.endpoints_file).unlink(missing_ok=True)
        for name, endpoint in (("producer", s.producer_endpoint), ("consumer", s.consumer_endpoint),
                               ("admin", s.admin_endpoint)):
            curve = self.curve
            secure = None if curve is None else (lambda sock, name=name: curve.secure(name, sock))
            self.sockets[name] = router(self.context, endpoint, secure=secure, **options)
            self.endpoints[name] = self.sockets[name].getsockopt_string(zmq.LAST_ENDPOINT) or endpoint  # port 0: the one picked
        self.poller = zmq.Poller()
        for sock in [*self.sockets.values(), *(self.curve.sockets if self.curve else ())]:
            self.poller.register(sock, zmq.POLLIN)
        self._metrics_server = self.metrics.serve(s.metrics_host, s.metrics_port)
        self._refresh_gauges(Clock.read())
        if s.endpoints_file:
            write_endpoints_file(s.endpoints_file, self.endpoints)
        log.info("broker listening", extra={"broker_id": self.broker_id, **self.endpoints, "sync": s.sync,
                                            "curve": self.curve is not None})

    def stop(self, *_args) -> None:
        """Finish the pass in progress (commit, reply), then leave `run`."""
        self._stopping = True

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGHUP, self.reload_keys)

    def reload_keys(self, *_args) -> None:
        """Read the CURVE key directories again at the next pass (SIGHUP)."""
        self._reload_keys = True

    def run(self) -> None:
        while not self._stopping:
            self.run_once(timeout_ms=100)
        self.close()

    def close(self) -> None:
        if self.curve is not None:
            self.curve.close()
        for sock in self.sockets.values():
            sock.close(linger=1000)
        self.sockets.clear()
        if self.settings.endpoints_file and self.endpoints:  # nobody should connect to these any more
            Path(self.settings.endpoints_file).unlink(missing_ok=True)
        if self._metrics_server is not None:
            server, thread = self._metrics_server
            server.shutdown()
            self._metrics_server = None
        self._checker.shutdown()
        self.store.close()
        if self._own_context:
            self.context.term()
        log.info("broker stopped", extra={"broker_id": self.broker_id})

    def run_once(self, timeout_ms: int = 100) -> None:
        events = dict(self.poller.poll(timeout_ms))
        now = Clock.read()
        if self._reload_keys:
            self._reload_keys = False
            if self.curve is None:
                log.info("SIGHUP: no CURVE keys to reload (the broker runs without --curve-secret-key)")
            else:
                self._reload_curve(now)
        if self.curve is not None:
            self.curve.serve({sock for sock, flags in events.items() if flags}, now.mono)
        if events.get(self.sockets["producer"]):
            self._serve_producers(now)
        if events.get(self.sockets["consumer"]):
            self._serve_consumers(now)
        if events.get(self.sockets["admin"]):
            self._serve_admin(now)
        if now.mono >= self._next_housekeeping:
            self._housekeeping(now)
            self._next_housekeeping = now.mono + HOUSEKEEPING_EVERY
        self._deliver(now)

    def _reload_curve(self, now: Clock) -> None:
        """Read the key directories again; consumers whose key was removed
        get no more deliveries, and their leases go back to the queue."""
        assert self.curve is not None
        self.curve.reload()
        for identity in self.curve.revoked_identities("consumer", list(self.dispatcher.consumers)):
            log.warning("dropped a consumer whose key was removed; its leases are requeued",
                        extra={"consumer_id": self.dispatcher.consumers[identity].consumer_id})
            self._dead_letter(self.dispatcher.drop_consumer(identity), "max_deliveries", now)

    # -- durability -----------------------------------------------------------
    def _commit(self, effects: list) -> bool:
        """Persist `effects`; on failure roll memory back to the store and
        report unavailable until a probe succeeds."""
        if not effects and not self.store.writing_ahead:
            return True
        started = time.perf_counter()
        try:
            self.store.commit(effects)
        except StoreError as exc:
            self._store_failed(f"commit failed: {exc}")
            self._rollback()
            return False
        self.metrics.commit_seconds.observe(time.perf_counter() - started)
        for unit in self.engine.ready_units:
            self.dispatcher.enqueue(unit)
        self.engine.ready_units.clear()
        return True

    def _store_failed(self, error: str) -> None:
        log.error("store failed; refusing writes until it recovers", extra={"error": error})
        self.unavailable = True
        self.metrics.unavailable.set(1)

    def _rollback(self) -> None:
        """Memory back to exactly what the store holds. Committed units are
        already with the dispatcher, so the restored list is not re-queued."""
        self.engine = self._new_engine()
        restore(self.engine, self.store.reload(), self.store)

    def _receive(self, name: str, now: Clock) -> list | None:
        """One message from socket `name` (`recv_routed`; `zmq.Again` when
        none waits), or None when CURVE drops it: its connection's key was
        removed since it connected."""
        curve = self.curve
        if curve is None:
            return recv_routed(self.sockets[name])
        frames = recv_routed(self.sockets[name], users=curve.users[name])
        return None if curve.revoked(name, frames[0], now.mono) else frames

    # -- producers ------------------------------------------------------------
    def _serve_producers(self, now: Clock) -> None:
        """Read a batch, check it, merge it, commit it once, then reply."""
        received: list[tuple[bytes, Message | None, ProtocolError | None]] = []
        checks: dict[int, Future] = {}  # index in `received` -> its content check, running ahead
        batch_bytes = 0
        self._free_bytes = self._free_space()  # one statvfs a batch; its frames are counted off it as they come
        while len(received) < self.settings.batch_max:
            # The frame crossing batch_max_bytes is the batch's last.
            if self.memory.over(self._memory_bytes) or (received and batch_bytes >= self.settings.batch_max_bytes):
                break
            try:
                frames = self._receive("producer", now)
            except zmq.Again:
                break
            if frames is None:
                continue
            identity = frames[0]
            size = sum(map(len, frames))
            batch_bytes += size
            self._memory_bytes += size  # estimates until the next measurement
            self._disk_bytes += size
            self._free_bytes -= size
            if self.admission.everything and (self._disk_bytes > self.admission.budget
                                              or self._free_bytes < self.admission.reserve):
                self._update_backpressure()  # from the next frame on, only what may enter is taken
            self.producers[identity] = now.mono
            try:
                message = self._decode_producer_frames(frames[1:])
                if message.type != "batch":
                    self._take(identity, message, size, received, checks)
                    continue
                elements = split_batch(message)
            except ProtocolError as error:
                received.append((identity, None, error))
                continue
            for element in elements:
                try:
                    message = self._decode_producer_frames(element)
                    if message.type not in BATCHABLE_TYPES:
                        raise ProtocolError("schema", f"a batch carries {list(BATCHABLE_TYPES)} messages, "
                                                      f"got a {message.type}", seq=message.get("seq"))
                    self._take(identity, message, sum(map(len, element)), received, checks)
                except ProtocolError as error:
                    received.append((identity, None, error))
        self._check_content(received, checks)
        pending: list[_Pending] = []
        effects: list = []
        for identity, decoded, refusal in received:
            item, item_effects = self._producer_message(identity, decoded, refusal, now)
            pending.append(item)
            effects += item_effects
        committed = self._commit(effects)
        if committed:
            self.engine.saved()
            self._count_effects(effects)
            self._count_outcomes(pending)
            for identity, acks in self._batched_acks(pending).items():
                self._send("producer", identity, encode(BROKER_TO_PRODUCER, "acks", acks, checked=False))
        for item in pending:
            reply = item.frames
            if item.ack is not None:
                if not committed:
                    unavailable = ProtocolError("unavailable", "the broker cannot persist right now; resend later",
                                                seq=item.ack["seq"])
                    reply = self._refuse("producer", unavailable, item.message)
                elif item.identity in self.hellos.batch_acks:
                    continue  # in its connection's `acks`
                else:
                    reply = encode(BROKER_TO_PRODUCER, "ack", item.ack, checked=False)
            assert reply is not None  # a reply without an ack is made with its frames
            self._send("producer", item.identity, reply)
        self._apply_memory_budget()

    def _decode_producer_frames(self, frames: list) -> Message:
        return decode(frames, PRODUCER_TO_BROKER, max_message_bytes=self.settings.max_message_bytes, check_content=False)

    def _take(self, identity: bytes, message: Message, size: int, received: list, checks: dict[int, Future]) -> None:
        """A decoded message into the batch being read: a large turn's
        content check starts ahead, and a turn's frames go to the writer."""
        received.append((identity, message, None))
        if message.type == "turn":
            if size >= CHECK_AHEAD_FROM_BYTES:
                checks[len(received) - 1] = self._checker.submit(_content_error, message.arrays, self.settings.vocab_size)
            if not self.unavailable and self._admits(message):
                self.store.write_ahead(message)  # on the writer thread while the batch is checked and merged

    def _batched_acks(self, pending: list[_Pending]) -> dict[bytes, dict]:
        """One `acks` per connection that asked for them (docs/protocol.md §3):
        its acked seqs as ranges, and the outcomes that are not a plain
        `applied` listed on their own."""
        by_identity: dict[bytes, dict] = {}
        for item in pending:
            if item.ack is None or item.identity not in self.hellos.batch_acks:
                continue
            ack = item.ack
            seq = ack["seq"]
            acks = by_identity.get(item.identity)
            if acks is None:
                acks = by_identity[item.identity] = {"ranges": [[seq, seq]], "window": self.grants.grant(item.identity)}
            else:
                last = acks["ranges"][-1]
                if seq == last[1] + 1:
                    last[1] = seq
                else:
                    acks["ranges"].append([seq, seq])
            if not ack["applied"] or "duplicate" in ack:
                outcome = {"seq": seq, "applied": ack["applied"]}
                outcome.update((key, ack[key]) for key in ("duplicate", "reason") if key in ack)
                acks.setdefault("outcomes", []).append(outcome)
        return by_identity

    def _check_content(self, received: list, checks: dict[int, Future]) -> None:
        """The content rules for every turn of the batch: those not already
        being checked ahead in one packed pass (only when it fails is each
        checked alone, to refuse the culprits), then the outcomes of the
        checks ahead."""
        vocab = self.settings.vocab_size
        turns = [i for i, (_, message, _) in enumerate(received)
                 if message is not None and message.type == "turn" and i not in checks]
        if turns and not messages_content_valid([received[i][1].arrays for i in turns], vocab):
            for i in turns:
                self._refuse_if(received, i, _content_error(received[i][1].arrays, vocab))
        for i, check in checks.items():
            self._refuse_if(received, i, check.result())

    @staticmethod
    def _refuse_if(received: list, i: int, error: ProtocolError | None) -> None:
        if error is not None:
            identity, message, _ = received[i]
            received[i] = (identity, message, error.with_seq(message["seq"]))

    def _read_unit(self, unit: list[Dispatch], now: Clock) -> bool:
        """Whether every member of a delivered unit is in memory, evicted
        ones read back from the store. False when one cannot be read: a
        store that fails makes the store unavailable and deliveries wait for
        its probe; a member whose records are damaged does too, until it has
        failed `UNREADABLE_AFTER` reads, when it is dead-lettered
        `unreadable` and its lease dropped (the rest of its unit goes on)."""
        for delivery in unit:
            tid = delivery.trajectory_id
            entry = self.engine.entries.get(tid)
            if entry is None or entry.state != ENDED:  # cannot happen; never send what is not ready
                log.error("queued trajectory is not ready", extra={"trajectory_id": tid})
                self.dispatcher.settle([delivery.lease])
                return False
            if not self.engine.needs_reload(entry):
                continue
            try:
                self.engine.reload(entry, load_trajectory(self.store, self.store.load_one(tid)))
            except StoreError as exc:
                if not exc.retriable and self.engine.unreadable(tid):
                    log.error("stored trajectory cannot be read back", extra={"trajectory_id": tid, "error": str(exc)})
                    self.dispatcher.settle([delivery.lease])
                    self._dead_letter([tid], "unreadable", now)
                else:
                    self._store_failed(f"cannot read evicted trajectory {tid!r} back to deliver it: {exc}")
                    self._reads_failed = True
                return False
            self.metrics.inc(self.metrics.reloads)
        return True

    def _producer_message(self, identity: bytes, message: Message | None, error: ProtocolError | None,
                          now: Clock) -> tuple[_Pending, list]:
        if error is not None:
            return _Pending(identity, self._refuse("producer", error, message)), []
        assert message is not None  # one that failed to decode is received with its error
        if message.type == "hello":
            log.info("producer connected", extra={"producer_id": message["producer_id"]})
            self._count_active_producers(now.mono)
            fields = self.hellos.welcome_producer(identity, message.fields, self.grants.grant(identity))
            return _Pending(identity, encode(BROKER_TO_PRODUCER, "welcome", fields)), []
        if message.type == "ping":
            pong = {"seq": message["seq"], "window": self.grants.grant(identity)}
            return _Pending(identity, encode(BROKER_TO_PRODUCER, "pong", pong)), []
        if self.unavailable:
            error = ProtocolError("unavailable", "the broker cannot persist right now; resend later", seq=message["seq"])
            return _Pending(identity, self._refuse("producer", error, message)), []
        if not self._admits(message):  # resent by the producer; counted, not logged per frame (see DiskAdmission)
            error = ProtocolError("unavailable", self.admission.refusal(), seq=message["seq"])
            return _Pending(identity, self._refuse("producer", error, message, quiet=True)), []
        reply = self.engine.handle(message, now.wall)
        if reply.error is not None:
            return _Pending(identity, self._refuse("producer", reply.error, message)), []
        return _Pending(identity, ack=reply.fields, message=message), list(reply.effects)

    def _admits(self, message: Message) -> bool:
        """Whether the disk lets a producer frame in now (`DiskAdmission`)."""
        if self.admission.everything:
            return True
        entry = self.engine.entries.get(message["trajectory_id"])
        return self.admission.admits(message.type, entry is not None and entry.state == OPEN)

    def _refuse(self, endpoint: str, error: ProtocolError, message: Message | None, *, quiet: bool = False,
                **extra) -> list:
        """A `nack` for `error`, counted and logged (`quiet`: only counted,
        for refusals that repeat by design until a state changes, which is
        logged once)."""
        if error.seq is None and message is not None and "seq" in message.fields:  # protocol.md §2: answer its seq
            error = error.with_seq(message["seq"])
        self.metrics.inc(self.metrics.nacks, endpoint=endpoint, code=error.code)
        if not quiet:
            context = {"endpoint": endpoint, "code": error.code, "reason": error.message}
            if message is not None and "trajectory_id" in message.fields:
                context["trajectory_id"] = message["trajectory_id"]
                if "turn" in message.fields:
                    context["turn"] = message["turn"]
            log.warning("message refused", extra=context)
        schema = BROKER_TO_PRODUCER if endpoint == "producer" else BROKER_TO_CONSUMER if endpoint == "consumer" else ADMIN_REPLIES
        return encode_error(schema, error, **extra)

    def _count_outcomes(self, pending: list) -> None:
        """Frames by type and outcome, once their batch is durable (one
        counter update per kind of outcome, not per frame)."""
        outcomes = Counter(
            (item.message.type, "duplicate" if ack.get("duplicate") else
             "applied" if ack["applied"] else ack.get("reason", "not_applied"))
            for item in pending if (ack := item.ack) is not None
        )
        for (mtype, outcome), count in outcomes.items():
            self.metrics.inc(self.metrics.frames, count, type=mtype, outcome=outcome)

    def _count_effects(self, effects: list[Effect]) -> None:
        for effect in effects:
            match effect:
                case MarkGap():
                    self.metrics.inc(self.metrics.gaps, field=effect.gap.field)
                    log.info("replay gap", extra={"trajectory_id": effect.trajectory_id, "turn": effect.gap.turn,
                                                  "field": effect.gap.field})
                case DropTrajectory():
                    self.metrics.inc(self.metrics.exits, exit="aborted")
                    log.info("trajectory aborted", extra={"trajectory_id": effect.trajectory_id})
                case DeadLetter():
                    exit_label = effect.reason if effect.reason in ("expired", "unreadable") else "dead"
                    self.metrics.inc(self.metrics.exits, exit=exit_label)
                    log.warning("trajectory dead-lettered", extra={"trajectory_id": effect.trajectory_id,
                                                                   "reason": effect.reason})
                case _:  # turns are counted by _count_outcomes; the rest need no counter
                    pass

    def _send(self, endpoint: str, identity: bytes, frames: list) -> bool:
        """Send without blocking; False when the peer is gone or not reading.
        Frames up to `ZERO_COPY_SEND_ABOVE` are copied: a zero-copy send
        hands each frame to pyzmq's garbage-collector thread, which must take
        the interpreter lock to let it go, and the broker delivered 5-10%
        fewer frames/s that way than by copying ~200 KB per trajectory.
        Larger ones (long top-p supports) go without the copy, which then
        costs more than the hand-over."""
        sock = self.sockets[endpoint]
        try:
            send_frames(sock, frames, identity=identity, zero_copy_above=ZERO_COPY_SEND_ABOVE)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH (peer gone) or EAGAIN (peer's queue full)
            log.warning("reply not delivered", extra={"endpoint": endpoint, "peer": identity.hex(), "error": exc.strerror})
            if endpoint == "producer" and exc.errno == zmq.EHOSTUNREACH:
                self._forget_producer(identity)
            return False

    def _count_active_producers(self, now: float) -> None:
        """The grants share `max_in_flight` among the connections heard from
        lately, so frames queued at the broker, and so the wait for an ack,
        stay bounded however many producers there are."""
        self.grants.active(sum(1 for seen in self.producers.values() if seen >= now - PRODUCER_ACTIVE_FOR))

    def _forget_producer(self, identity: bytes) -> None:
        """A connection that is gone (a reconnect comes with a new identity)."""
        self.producers.pop(identity, None)
        self.hellos.forget_producer(identity)
        self.grants.forget(identity)

    # -- consumers ------------------------------------------------------------
    def _serve_consumers(self, now: Clock) -> None:
        """Read a batch of consumer messages; the acks and nacks among them
        are made durable together (one commit), then answered."""
        settling: list[Settlement] = []
        claimed: set[str] = set()  # leases settled by an earlier message of this batch
        for _ in range(self.settings.batch_max):
            try:
                frames = self._receive("consumer", now)
            except zmq.Again:
                break
            if frames is None:
                continue
            identity = frames[0]
            try:
                message = decode(frames[1:], CONSUMER_TO_BROKER, max_message_bytes=self.settings.max_message_bytes)
            except ProtocolError as error:
                self._send("consumer", identity, self._refuse("consumer", error, None))
                continue
            if message.type == "hello":
                self._settle(settling, now)  # a hello drops leases: settle what came before it first
                claimed.clear()
            settlement = self._consumer_message(identity, message, now, claimed)
            if settlement is not None:
                settling.append(settlement)
                claimed.update(settlement.known)
        self._settle(settling, now)

    def _consumer_message(self, identity: bytes, message: Message, now: Clock, claimed: set) -> Settlement | None:
        dispatcher = self.dispatcher
        if message.type == "hello":
            self._dead_letter(dispatcher.hello(identity, message["consumer_id"], now.mono), "max_deliveries", now)
            log.info("consumer connected", extra={"consumer_id": message["consumer_id"]})
            fields = self.hellos.welcome_consumer(identity, message.fields, dispatcher.consumers.keys())
            self._send("consumer", identity, encode(BROKER_TO_CONSUMER, "welcome", fields))
            return None
        if not dispatcher.seen(identity, now.mono):
            error = ProtocolError("unknown_consumer", "this connection has not said hello (or was dropped); send hello first")
            extra = {"leases": message["leases"]} if "leases" in message.fields else {}
            self._send("consumer", identity, self._refuse("consumer", error, message, **extra))
            return None
        if message.type == "credit":
            dispatcher.credit(identity, message["n"], message["unit"])
        elif message.type in ("ack", "nack"):
            return Settlement.prepare(identity, message, dispatcher, self.engine, now.wall, claimed)
        return None

    def _settle(self, settling: list[Settlement], now: Clock) -> None:
        """Commit the batch's settlements at once, then update the
        dispatcher and answer each (or answer `unavailable`)."""
        if not settling:
            return
        effects = [e for s in settling for e in s.effects]
        committed = self._commit(effects)
        if committed:
            self._count_effects(effects)
        for s in settling:
            if not committed:
                error = ProtocolError("unavailable", "the broker cannot persist right now; resend later")
                self._send("consumer", s.identity, self._refuse("consumer", error, s.message, leases=s.known))
                continue
            self._dead_letter(s.apply(self.dispatcher), "max_deliveries", now)
            if s.message.type == "ack":
                self.metrics.inc(self.metrics.exits, len(s.trajectory_ids), exit="delivered")
            if s.known:
                reply = "acked" if s.message.type == "ack" else "nacked"
                self._send("consumer", s.identity, encode(BROKER_TO_CONSUMER, reply, {"leases": s.known}))
            if s.stale:
                error = ProtocolError("stale_lease", f"{len(s.stale)} lease(s) are unknown or expired; they changed nothing")
                self._send("consumer", s.identity, self._refuse("consumer", error, s.message, leases=s.stale))
        settling.clear()
        if committed:
            self._apply_memory_budget()  # delivered trajectories left memory: paused producers may go on

    def _dead_letter(self, tids: list[str], reason: str, now: Clock) -> None:
        if not tids:
            return
        effects = [e for tid in tids for e in self.engine.dead_letter(tid, reason, now.wall)]
        if self._commit(effects):
            self._count_effects(effects)
            for tid in tids:
                self.dispatcher.forget(tid)
        else:  # not durable: keep them deliverable
            for tid in tids:
                self.dispatcher.enqueue(DeliveryUnit((tid,)), front=True)

    def _deliver(self, now: Clock) -> None:
        """Send queued trajectories to consumers with credit, also while
        writes fail: a consumer's ack deletes data, which is what frees a
        full disk (the reserve keeps room to write those deletes). Each
        delivered unit is read back whole before any of it is sent, so a
        group goes out whole or not at all; one that cannot be read back
        (`_read_unit`) ends the pass, and it and the rest go back to the
        front with the consumers' credit returned. Nothing is sent once a
        trajectory could not be read back, until the probe succeeds."""
        if self._reads_failed:
            return
        deliveries = self.dispatcher.deliveries(now.mono)
        refused: list[str] = []  # leases whose send the connection refused: requeued, their credit spent
        start = 0
        while start < len(deliveries):
            end = start + 1
            while end < len(deliveries) and deliveries[end].unit is deliveries[start].unit:
                end += 1
            if not self._read_unit(deliveries[start:end], now):
                self.dispatcher.retract([d.lease for d in deliveries[start:] if d.lease in self.dispatcher.leases],
                                        refund=True)
                break
            for delivery in deliveries[start:end]:
                layouts = self.hellos.reads(delivery.identity)
                trajectory = self.engine.entries[delivery.trajectory_id].trajectory
                assert trajectory is not None  # `_read_unit` read it back
                frames = encode_deliver(trajectory, delivery.lease, delivery_count=delivery.delivery_count,
                                        may_pack="packed_arrays" in layouts, may_split="split_arrays" in layouts,
                                        **delivery.group_fields)
                if not self._send("consumer", delivery.identity, frames):
                    refused.append(delivery.lease)
            start = end
        if refused:
            self.dispatcher.retract(refused)

    # -- admin ----------------------------------------------------------------
    def _serve_admin(self, now: Clock) -> None:
        while True:
            try:
                frames = self._receive("admin", now)
            except zmq.Again:
                return
            if frames is None:
                continue
            identity, body, envelope = frames[0], frames[1:], []
            if len(body) >= 2 and body[0] == b"":  # a REQ peer's delimiter
                envelope, body = [b""], body[1:]
            try:
                message = decode(body, ADMIN_REQUESTS, max_message_bytes=self.settings.max_message_bytes)
                reply = self._admin_reply(message, now)
            except ProtocolError as error:
                reply = self._refuse("admin", error, None)
            self._send("admin", identity, [*envelope, *reply])

    def _admin_reply(self, message: Message, now: Clock) -> list:
        seq = {"seq": message["seq"]} if "seq" in message.fields else {}
        if message.type == "status":
            return encode(ADMIN_REPLIES, "status", {**self.status(now), **seq})
        if message.type == "dead_letters":
            items = self.engine.dead_letters(message.get("limit", 100))
            return encode(ADMIN_REPLIES, "dead_letters", {"items": items, **seq})
        requeued = []
        effects = []
        for tid in dict.fromkeys(message["trajectory_ids"]):
            effect = self.engine.requeue(tid)
            if effect is not None:
                effects.append(effect)
                requeued.append(tid)
        if not self._commit(effects):
            raise ProtocolError("unavailable", "the broker cannot persist right now; retry later")
        for tid in requeued:
            log.info("dead letter requeued", extra={"trajectory_id": tid})
        return encode(ADMIN_REPLIES, "requeued", {"trajectory_ids": requeued, **seq})

    def status(self, now: Clock) -> dict:
        counts = self.engine.counts()
        alive_after = now.mono - LIVENESS_INTERVALS * max(self.settings.heartbeat_interval, 10.0)
        return {
            "open": counts[OPEN],
            "ready": self.dispatcher.queued_trajectories,
            "leased": len(self.dispatcher.leases),
            "dead": counts[DEAD],
            "producers": sum(1 for seen in self.producers.values() if seen >= alive_after),
            "consumers": len(self.dispatcher.consumers),
            "bytes_in_memory": self._memory_bytes,
            "bytes_on_disk": self._disk_bytes,
            "counters": {key: int(value) for key, value in sorted(self.metrics.totals.items())},
            "endpoints": dict(self.endpoints),
        }

    # -- housekeeping ---------------------------------------------------------
    def _housekeeping(self, now: Clock) -> None:
        if now.mono >= self._next_producer_prune:  # connections long silent (producers ping every second)
            self._next_producer_prune = now.mono + PRODUCER_FORGET_AFTER / 10
            for identity in [i for i, seen in self.producers.items() if seen < now.mono - PRODUCER_FORGET_AFTER]:
                self._forget_producer(identity)
        self._count_active_producers(now.mono)
        if self.curve is not None:  # each message records its connection's key again
            self.curve.forget("producer", self.producers)
            self.curve.forget("consumer", self.dispatcher.consumers)
            self.curve.forget("admin", ())
        effects = self.engine.expire(now.wall)
        if self._commit(effects):
            self._count_effects(effects)
        events = self.sockets["consumer"].get(zmq.EVENTS)  # an int (pyzmq types every option as `int | bytes`)
        if isinstance(events, int) and events & zmq.POLLIN:
            self._serve_consumers(now)  # heartbeats that waited behind a long pass: never drop a live consumer unheard
        self._dead_letter(self.dispatcher.tick(now.mono), "max_deliveries", now)
        new_redeliveries = self.dispatcher.redeliveries - self._redeliveries_seen
        if new_redeliveries:
            self.metrics.inc(self.metrics.redeliveries, new_redeliveries)
            self._redeliveries_seen = self.dispatcher.redeliveries
        if self.unavailable and now.mono >= self._next_probe:
            self._next_probe = now.mono + PROBE_EVERY
            try:
                self.store.probe()
            except StoreError:
                pass
            else:
                self.unavailable = self._reads_failed = False
                self.metrics.unavailable.set(0)
                log.info("store available again")
        if now.mono >= self._next_dedup_prune:
            self._next_dedup_prune = now.mono + 60.0
            try:
                self.store.prune_dedup(now.wall)
            except StoreError as exc:  # a failed prune only delays pruning
                log.warning("dedup prune failed", extra={"error": str(exc)})
        self._apply_budgets()
        self._refresh_gauges(now)

    def _apply_memory_budget(self) -> None:
        """Evict down to the memory budget, then pause or resume producers.
        Run after every batch, not only at housekeeping: the engine keeps its
        count as it changes, so producers resume as soon as room is made."""
        self._evict_to_budget()
        self._update_backpressure()

    def _evict_to_budget(self) -> None:
        """Evict (all of it durable in the store) as far as `MemoryBudget`
        says, keeping what is out on a lease."""
        self._memory_bytes = self.engine.bytes_in_memory
        target = self.memory.evict_to(self._memory_bytes)
        if target is not None:
            evicted = self.engine.evict(target, keep={lease.trajectory_id for lease in self.dispatcher.leases.values()})
            for state, count in evicted.items():
                if count:
                    self.metrics.inc(self.metrics.evictions, count, state=state)
            self._memory_bytes = self.engine.bytes_in_memory

    def _apply_budgets(self) -> None:
        """Memory, then disk (measured from the store, and its WAL
        checkpointed when near the limit), then pause or resume producers."""
        s = self.settings
        self._evict_to_budget()
        self._disk_bytes = self.store.bytes_on_disk()
        self._free_bytes = self._free_space()
        if self._disk_bytes > 0.9 * s.max_disk_bytes or self._free_bytes < self.admission.reserve:
            # also below the limit: the WAL (up to 16 MiB between checkpoints) must not hold off a resume
            try:
                self.store.checkpoint()
            except StoreError as exc:  # a failed checkpoint only leaves the WAL larger
                log.warning("WAL checkpoint failed", extra={"error": str(exc)})
            self._disk_bytes, self._free_bytes = self.store.bytes_on_disk(), self._free_space()
        self._update_backpressure()

    def _update_backpressure(self) -> None:
        """Pause or resume reading producer frames as `MemoryBudget` says;
        tell `DiskAdmission` the store's size and free space, logging when
        what enters changes."""
        change = self.memory.update(self._memory_bytes)
        if change is False:
            self.poller.unregister(self.sockets["producer"])
            log.warning("over the memory budget: producer frames paused", extra={"bytes_in_memory": self._memory_bytes})
        elif change is True:
            self.poller.register(self.sockets["producer"], zmq.POLLIN)
            log.info("back under the memory budget: producer frames resumed")
        admission = self.admission
        drainable = bool(self.dispatcher.queue or self.dispatcher.leases)
        if admission.update(self._disk_bytes, self._free_bytes, drainable):
            figures = {"bytes_on_disk": self._disk_bytes, "bytes_free": self._free_bytes}
            if admission.everything:
                log.info("disk back under budget: every producer frame enters", extra=figures)
            else:
                log.warning("disk over budget: some producer frames wait", extra={**figures, "reason": admission.refusal()})
        self.metrics.backpressure.set(int(not (self.memory.reading and admission.everything)))

    def _refresh_gauges(self, now: Clock) -> None:
        status = self.status(now)
        for state in ("open", "ready", "leased", "dead"):
            self.metrics.depth.labels(state=state).set(status[state])
        self.metrics.bytes.labels(where="memory").set(status["bytes_in_memory"])
        self.metrics.bytes.labels(where="disk").set(status["bytes_on_disk"])
