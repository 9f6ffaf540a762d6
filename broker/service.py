"""The broker's I/O shell: three ROUTER sockets and one poll loop around
`BrokerCore` (broker/core.py), which decides everything.

Each pass reads and decodes what waits on each socket, hands it to the core
and performs, in order, what the core's answer asks for: commits to the
store, sends, reads back, probes and measurements. The service also keeps
the store, the metrics endpoint, the CURVE guard and the signals.
"""
from __future__ import annotations

import logging
import os
import signal
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import zmq

from rollstream.common.admin import write_endpoints_file
from rollstream.common.clock import Clock
from rollstream.common.codec import Message, decode, decode_header, split_batch
from rollstream.common.config import ConfigError, bind_problem, check_settings
from rollstream.common.errors import ProtocolError, RemoteProtocolError
from rollstream.common.messages import ADMIN_REQUESTS, BATCHABLE_TYPES, CONSUMER_TO_BROKER, PRODUCER_TO_BROKER
from rollstream.common.sockets import recv_routed, router, send_frames
from rollstream.common.validation import check_message_arrays, messages_content_valid

from .core import BrokerCore, Performers, Received, Send, Sent, Steps, drive
from .curve import CurveGuard
from .metrics import BrokerMetrics
from .recovery import rebuild
from .settings import ENDPOINT_SETTINGS, BrokerSettings, broker_problems
from .store import Archiving, Store
from .store_io import StoreIO, free_space

if TYPE_CHECKING:
    from .archive import Archiver

log = logging.getLogger("rollstream.broker")

# The longest a poll waits, in seconds: while producers send or the store is probed (the core is
# `paced`), and otherwise (a stop signal, whose handler only sets a flag, is acted on within it).
BUSY_POLL, QUIET_POLL = 0.1, 1.0
# Bytes: a larger frame (a turn of top-p supports, sent split) goes without a copy (see `_send`).
ZERO_COPY_SEND_ABOVE = 1 << 19
# A turn frame this large (a turn of top-p-sized supports) has its content
# rules checked on a thread of their own as soon as it is decoded, while the
# main thread receives and decodes the rest of the read; numpy releases the
# GIL over arrays this size. The outcome is taken before the read merges.
CHECK_AHEAD_FROM_BYTES = 1 << 20


def _content_error(arrays, vocab_size: int | None, normalized: bool = False) -> Exception | None:
    """The first content rule a received turn's arrays break, anything
    else the check raised (the caller refuses the turn as `internal`), or
    None.

    Caller: the checker thread, for a turn checked ahead; the service's
    thread for the others. Affects: nothing; it reads the turn's arrays,
    which nothing writes, with scratch buffers of its own thread."""
    try:
        check_message_arrays(arrays, vocab_size=vocab_size, mask_log_probs_normalized=normalized)
    except ProtocolError as error:
        return error.as_remote()
    except Exception as exc:  # a failure no rule foresaw costs this turn alone
        return exc
    return None


def _header_of(frames: list) -> dict:
    """A message's header when it can be read (else empty), for its refusal."""
    try:
        return decode_header(frames[0]) if frames else {}
    except Exception:  # unreadable: refused without its seq or type
        return {}


def _seq_of(frames: list) -> int | None:
    seq = _header_of(frames).get("seq")
    return seq if type(seq) is int else None


class BrokerService:
    def __init__(self, settings: BrokerSettings, context: zmq.Context | None = None):
        check_settings(settings, broker_problems)
        self.settings = settings
        self.metrics = BrokerMetrics()
        # A CURVE broker answers its context's authentication requests, so it takes a context of its own.
        self._own_context = context is None and settings.curve_secret_key is not None
        self.context = context or (zmq.Context() if self._own_context else zmq.Context.instance())
        self.curve = None if settings.curve_secret_key is None else CurveGuard(settings, self.context, self.metrics)
        self._reload_keys = False  # a SIGHUP asked for the key directories to be read again
        self.store = Store(settings.data_dir, sync=settings.sync, segment_bytes=settings.segment_bytes,
                           archive=None if settings.archive is None else Archiving(settings.archive_dead_letters))
        self._archiver: Archiver | None = None  # made at `start`, once the store is open (its id names the files)
        broker_id = settings.broker_id or f"{socket.gethostname()}:{os.path.abspath(settings.data_dir)}"
        self.core = BrokerCore(settings, broker_id, self.metrics, disk_reserve=self._disk_reserve())
        self._stopping = False
        self._next_housekeeping = 0.0
        self._reading = True  # the producer socket is polled (the core pauses it over the memory budget)
        self.sockets: dict[str, zmq.Socket] = {}
        self.endpoints: dict[str, str] = {}  # by socket name, as bound (a port 0 resolved)
        self._metrics_server = None
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="rollstream-checker")  # see CHECK_AHEAD_FROM_BYTES
        self._store_io = StoreIO(self.store, settings.data_dir, self.metrics,
                                 archive_file_rows=settings.archive_file_rows, archive_linger=settings.archive_linger)
        self._performers: Performers = dict([*self._store_io.performers.items(), Send.answered_by(self._send)])

    def _disk_reserve(self) -> int:
        """Free space the broker keeps for ends and consumer acks: the
        setting, or 5% of the data dir's file system, at most 1 GiB (as
        databases keep free space so that deletes can still be written)."""
        if self.settings.disk_reserve_bytes is not None:
            return self.settings.disk_reserve_bytes
        Path(self.settings.data_dir).mkdir(parents=True, exist_ok=True)
        fs = os.statvfs(self.settings.data_dir)
        return min(1 << 30, fs.f_blocks * fs.f_frsize // 20)

    # -- life cycle ---------------------------------------------------------
    def start(self) -> None:
        """Open and check the store, restore state, bind the sockets."""
        recovered = self.store.open()
        self.core.restore(rebuild(recovered, self.store), self.store.bytes_on_disk(), free_space(self.settings.data_dir))
        s = self.settings
        if s.archive is not None:
            from .archive import Archiver  # pyarrow: only a broker with an archive imports it

            self._archiver = self._store_io.archiver = Archiver(s.archive, self.store.store_id,
                                                                compression=s.archive_compression)
        options = dict(high_water_mark=s.high_water_mark, heartbeat_interval=s.heartbeat_interval,
                       max_message_bytes=s.max_message_bytes)
        if s.endpoints_file:  # a file left by an earlier run must not send anyone to its old ports
            Path(s.endpoints_file).unlink(missing_ok=True)
        for name, endpoint in (("producer", s.producer_endpoint), ("consumer", s.consumer_endpoint),
                               ("admin", s.admin_endpoint)):
            curve = self.curve
            secure = None if curve is None else (lambda sock, name=name: curve.secure(name, sock))
            try:
                self.sockets[name] = router(self.context, endpoint, secure=secure, **options)
            except zmq.ZMQError as exc:
                self.close()
                raise ConfigError([bind_problem(ENDPOINT_SETTINGS[name], endpoint, exc)]) from None
            self.endpoints[name] = self.sockets[name].getsockopt_string(zmq.LAST_ENDPOINT) or endpoint  # port 0: the one picked
        self.core.endpoints = self.endpoints
        self.poller = zmq.Poller()
        for sock in [*self.sockets.values(), *(self.curve.sockets if self.curve else ())]:
            self.poller.register(sock, zmq.POLLIN)
        try:
            self._metrics_server = self.metrics.serve(s.metrics_host, s.metrics_port)
        except ConfigError:
            self.close()
            raise
        self.core.update_gauges(Clock.read())
        if s.endpoints_file:
            write_endpoints_file(s.endpoints_file, self.endpoints)
        log.info("broker listening", extra={"broker_id": self.core.broker_id, **self.endpoints, "sync": s.sync,
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
            self.run_once(timeout_ms=self.poll_timeout_ms())
        self.close()

    def poll_timeout_ms(self) -> int:
        """How long the next poll may wait: until the next housekeeping pass,
        at most `BUSY_POLL` while the core is `paced`, `QUIET_POLL` otherwise."""
        wait = self._next_housekeeping - Clock.monotonic()
        return int(1000 * max(0.0, min(wait, BUSY_POLL if self.core.paced(Clock.monotonic()) else QUIET_POLL)))

    def close(self) -> None:
        if self.curve is not None:
            self.curve.close()
        for sock in self.sockets.values():
            sock.close(linger=1000)
        self.sockets.clear()
        if self.settings.endpoints_file and self.endpoints:  # nobody should connect to these any more
            Path(self.settings.endpoints_file).unlink(missing_ok=True)
        if self._metrics_server is not None:
            server, _thread = self._metrics_server
            server.shutdown()
            self._metrics_server = None
        self._checker.shutdown()
        if self._archiver is not None:
            self._archiver.close()
        self.store.close()
        if self._own_context:
            self.context.term()
        log.info("broker stopped", extra={"broker_id": self.core.broker_id})

    def run_once(self, timeout_ms: int = 100) -> None:
        events = dict(self.poller.poll(timeout_ms))
        now = Clock.read()
        if self._reload_keys:
            self._reload_keys = False
            self._reload_curve(now)
        if self.curve is not None:
            self.curve.serve({sock for sock, flags in events.items() if flags}, now.mono)
        if events.get(self.sockets["producer"]):
            self._serve_producers(now)
        if events.get(self.sockets["consumer"]):
            self._serve_consumers(now)
        if events.get(self.sockets["admin"]):
            self._serve_admin(now)
        # a peer that arrived while quiet: the next pass comes at the busy pace
        self._next_housekeeping = min(self._next_housekeeping, now.mono + self.core.housekeeping_every(now.mono))
        if now.mono >= self._next_housekeeping:
            self._housekeep(now)
            self._next_housekeeping = now.mono + self.core.housekeeping_every(now.mono)
        self._drive(self.core.deliver(now))

    def _housekeep(self, now: Clock) -> None:
        """One housekeeping pass in the core's two halves, with the consumer
        messages that waited behind the first (its commits can take long)
        handled between them: the second judges leases and consumers'
        silence, and must not drop a live consumer whose heartbeat waits
        unread."""
        self._drive(self.core.housekeeping(now))
        events = self.sockets["consumer"].get(zmq.EVENTS)  # an int (pyzmq types every option as `int | bytes`)
        if isinstance(events, int) and events & zmq.POLLIN:
            self._serve_consumers(now)
        self._drive(self.core.finish_housekeeping(now))
        if self.curve is not None:  # each message records its connection's key again
            self.curve.forget("producer", self.core.producers)
            self.curve.forget("consumer", self.core.dispatcher.consumers)
            self.curve.forget("admin", ())

    def _reload_curve(self, now: Clock) -> None:
        """Read the key directories again; consumers whose key was removed
        are dropped by the core."""
        if self.curve is None:
            log.info("SIGHUP: no CURVE keys to reload (the broker runs without --curve-secret-key)")
            return
        self.curve.reload()
        for identity in self.curve.revoked_identities("consumer", list(self.core.dispatcher.consumers)):
            self._drive(self.core.drop_consumer(identity, now))

    def _drive(self, steps: Steps[None]) -> None:
        """Run one core input with the store's and the sockets' performers
        (`drive`); then poll the producer socket or not, as the core reads
        producers."""
        drive(steps, self._performers)
        if self.core.reading_producers != self._reading:
            self._reading = not self._reading
            if self._reading:
                self.poller.register(self.sockets["producer"], zmq.POLLIN)
            else:
                self.poller.unregister(self.sockets["producer"])

    def _receive(self, name: str, now: Clock) -> list | None:
        """One message from socket `name` (`recv_routed`; `zmq.Again` when
        none waits), or None when CURVE drops it: its connection's key was
        removed since it connected."""
        curve = self.curve
        if curve is None:
            return recv_routed(self.sockets[name])
        frames = recv_routed(self.sockets[name], users=curve.users[name])
        return None if curve.revoked(name, frames[0], now.mono) else frames

    # -- reading ----------------------------------------------------------------
    def _serve_producers(self, now: Clock) -> None:
        """Read producer frames (a `batch` message's elements one by one), decode and check them, and hand them to the core."""
        core = self.core
        received: list[Received] = []
        checks: dict[int, Future] = {}
        read_bytes = 0
        while core.takes_more(len(received), read_bytes):
            try:
                frames = self._receive("producer", now)
            except zmq.Again:
                break
            if frames is None:
                continue
            identity = frames[0]
            size = sum(map(len, frames))
            read_bytes += size
            core.frame_arrived(identity, size, now.mono)
            limited = core.limited("producer", identity, now.mono)
            if limited is not None:
                received.append((identity, None, limited.with_seq(_seq_of(frames[1:]))))
                continue
            try:
                message = self._decode_producer_frames(frames[1:])
                if message.type != "batch":
                    self._take(identity, message, size, received, checks)
                    continue
                elements = split_batch(message)
            except ProtocolError as error:
                received.append((identity, None, error))
                continue
            except Exception as exc:  # a failure no rule foresaw costs this message alone
                received.append((identity, None, self._failed("producer", identity, exc, frames[1:], now)))
                continue
            for element in elements:
                try:
                    message = self._decode_producer_frames(element)
                    if message.type not in BATCHABLE_TYPES:
                        raise RemoteProtocolError("schema", f"a batch carries {list(BATCHABLE_TYPES)} messages, "
                                                            f"got a {message.type}", seq=message.get("seq"))
                    self._take(identity, message, sum(map(len, element)), received, checks)
                except ProtocolError as error:
                    received.append((identity, None, error))
                except Exception as exc:
                    received.append((identity, None, self._failed("producer", identity, exc, element, now)))
        self._check_content(received, checks)
        self._drive(core.producer_read(received, now))
        if received:  # once per read: no clock read or counter update per frame
            self.metrics.received_bytes.add(read_bytes)
            self.metrics.ack_seconds.observe(Clock.monotonic() - now.mono)

    def _failed(self, endpoint: str, identity: bytes, exc: Exception, frames: list, now: Clock) -> ProtocolError:
        """The `internal` refusal of a message whose decoding raised `exc`."""
        header = _header_of(frames)
        seq, message_type = header.get("seq"), header.get("type")
        return self.core.failed_inside(endpoint, identity, exc, message_type if type(message_type) is str else None,
                                       frames, now.mono, seq=seq if type(seq) is int else None)

    def _decode_producer_frames(self, frames: list) -> Message:
        return decode(frames, PRODUCER_TO_BROKER, max_message_bytes=self.settings.max_message_bytes, check_content=False)

    def _take(self, identity: bytes, message: Message, size: int, received: list[Received],
              checks: dict[int, Future]) -> None:
        """A decoded message into the read under way (its ids keyed by its
        job, `BrokerCore.keyed`): a large turn's content check starts ahead,
        and its frames go to the writer (the store writes smaller ones at
        the commit, so the core is not asked about those)."""
        message = self.core.keyed(message)
        if message.type == "hello" and self.curve is not None:  # its trajectories are handed back over this key alone
            self.core.connection_key(identity, self.curve.users["producer"].get(identity, "-"))
        received.append((identity, message, None))
        if message.type == "turn":
            if size >= CHECK_AHEAD_FROM_BYTES:
                checks[len(received) - 1] = self._checker.submit(_content_error, message.arrays, self.settings.vocab_size,
                                                                 message.get("mask_log_probs_normalized", False))
            if size >= self.store.write_ahead_from and self.core.writes_ahead(message):
                self.store.write_ahead(message)  # on the writer thread while the read is checked and merged

    def _check_content(self, received: list[Received], checks: dict[int, Future]) -> None:
        """The content rules for every turn of the read: those not already
        being checked ahead in one packed pass (only when it fails is each
        checked alone, to refuse the culprits), then the outcomes of the
        checks ahead."""
        vocab = self.settings.vocab_size
        turns = {i: message for i, (_, message, _) in enumerate(received)
                 if message is not None and message.type == "turn" and i not in checks}
        outcomes: dict[int, Exception | None] = {}
        if turns:
            try:
                valid = messages_content_valid([message.arrays for message in turns.values()], vocab)
            except Exception:  # each turn checked alone then finds the one that raises
                valid = False
            # A turn whose support log-probs are said to be renormalised is checked alone for it too.
            outcomes = {i: _content_error(message.arrays, vocab, message.get("mask_log_probs_normalized", False))
                        for i, message in turns.items() if not valid or message.get("mask_log_probs_normalized")}
        outcomes.update((i, check.result()) for i, check in checks.items())
        for i, error in outcomes.items():
            if error is not None:
                identity, message, _ = received[i]
                assert message is not None  # only decoded turns are checked
                if not isinstance(error, ProtocolError):
                    error = self.core.failed_inside("producer", identity, error, message.type, message.frames,
                                                    Clock.monotonic())
                received[i] = (identity, message, error.with_seq(message["seq"]))

    def _serve_consumers(self, now: Clock) -> None:
        """Read consumer messages and hand them to the core."""
        received: list[Received] = []
        for _ in range(self.settings.read_max_frames):
            try:
                frames = self._receive("consumer", now)
            except zmq.Again:
                break
            if frames is not None:
                received.append(self._decoded("consumer", frames[0], frames[1:], CONSUMER_TO_BROKER, now))
        self._drive(self.core.consumer_read(received, now))

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
            _, message, error = self._decoded("admin", identity, body, ADMIN_REQUESTS, now)
            self._drive(self.core.admin_request(identity, envelope, message, error, now))

    def _decoded(self, endpoint: str, identity: bytes, body: list, schema, now: Clock) -> Received:
        limited = self.core.limited(endpoint, identity, now.mono)
        if limited is not None:
            return identity, None, limited.with_seq(_seq_of(body))
        try:
            return identity, decode(body, schema, max_message_bytes=self.settings.max_message_bytes), None
        except ProtocolError as error:
            return identity, None, error
        except Exception as exc:  # a failure no rule foresaw costs this message alone
            return identity, None, self._failed(endpoint, identity, exc, body, now)

    # -- performing what the core asks --------------------------------------------
    def _send(self, request: Send) -> Sent:
        """Send without blocking; what became of the frames (the core
        forgets a producer connection found gone). Frames up to
        `ZERO_COPY_SEND_ABOVE` are copied: a zero-copy send hands each frame
        to pyzmq's garbage-collector thread, which must take the interpreter
        lock to let it go, and that costs more than copying a trajectory's
        frames. Larger ones (long top-p supports) go without the copy, which
        then costs more than the hand-over."""
        name, identity = request.socket, request.identity
        try:
            send_frames(self.sockets[name], request.frames, identity=identity, zero_copy_above=ZERO_COPY_SEND_ABOVE)
            return Sent.TAKEN
        except zmq.ZMQError as exc:  # EHOSTUNREACH (peer gone) or EAGAIN (peer's queue full)
            log.warning("reply not delivered", extra={"endpoint": name, "peer": identity.hex(), "error": exc.strerror})
            return Sent.GONE if exc.errno == zmq.EHOSTUNREACH else Sent.FULL
