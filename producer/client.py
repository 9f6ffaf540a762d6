"""Producer clients: stream a rollout's turns to the node's broker.

`AsyncProducer` is the I/O shell around the sans-I/O `ResendWindow` and the
optional disk `Spool`: one plain ZeroMQ DEALER whose replies the asyncio
loop reads from a reader callback on the socket's descriptor, and whose
sends never wait (no per-message futures of zmq.asyncio). `Producer` is the
blocking client: it checks, encodes and numbers frames in the caller's
thread and hands them to an `AsyncProducer` whose loop runs on one
background thread, waking that loop once per burst of calls, not per call.

Every send first waits for room (the window, or the spool's byte budget when
there is a spool: backpressure, memory does not grow), then returns a future
that resolves to a `Receipt` once the broker has made the frame durable, or
raises `Refused` carrying the nack code. Arrays travel zero-copy: a send keeps
references to the caller's arrays until the frame is settled.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections import Counter, deque
from typing import Any, Callable, Mapping, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from rollstream.common.checker import ContentDigest, Ledger, TurnRecord, turn_record
from rollstream.common.codec import PACK_UP_TO_BYTES, check_values, decode, encode, encode_batch, number_header
from rollstream.common.curve import HANDSHAKE_FAILURES, ClientCurve, HandshakeReport
from rollstream.common.errors import ClientFailed, ProtocolError
from rollstream.common.ingest import turn_from_sglang
from rollstream.common.mask import SamplingMask, as_int_array, owned
from rollstream.common.messages import BROKER_TO_PRODUCER, PRODUCER_TO_BROKER
from rollstream.common.sockets import send_frames, tune
from rollstream.common.trajectory import TOKEN_DTYPE, Turn
from rollstream.common.validation import check_message_arrays
from rollstream.common.wire import encode_turn

from .errors import ProducerClosed, Refused
from .metrics import ProducerMetrics
from .spool import Spool, record_bytes
from .window import ABORT, END, TURN, Heartbeat, HeldFrame, Receipt, ResendWindow, Settled, batch_runs

log = logging.getLogger("rollstream.producer")

_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES
_SEQ_BYTES = len(number_header(b"\x80", 0)) - 1  # what numbering adds to a header
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum arithmetic costs more than the call
BEFORE_WELCOME_WINDOW = 2  # frames in flight until the broker's welcome grants a window
_ZERO_COPY_ABOVE = 65536  # bytes: smaller frames are cheaper to copy than to hand over (pyzmq's own threshold)
BATCH_UP_TO_BYTES = 1 << 20  # a batch of frames stops growing here (or at the broker's max_message_bytes)


def _reward(value: Any) -> Any:
    """A number or a map, as the wire wants it (numpy scalars become floats)."""
    return value if isinstance(value, Mapping) else float(value)


def _prompt_array(prompt_tokens, vocab_size: int | None):
    """The prompt as a read-only int32 array (the caller's own when it is one),
    checked against the vocabulary."""
    prompt = owned(as_int_array(prompt_tokens, TOKEN_DTYPE, "prompt_tokens"), prompt_tokens, borrow=True)
    empty = prompt[:0]
    check_message_arrays({"tokens": empty, "log_probs": empty.astype("<f4"), "prompt_tokens": prompt},
                         vocab_size=vocab_size)
    return prompt


class _Draft:
    """A frame checked and encoded but not yet numbered: its header lacks
    `seq`, which `AsyncProducer._accept` adds (at a fixed width, so the
    draft's size is final)."""

    __slots__ = ("kind", "handle", "frames", "index", "encode", "tokens", "turn")

    def __init__(self, kind: str, handle: "AsyncTrajectoryHandle", index: int, encode_at: Callable[[int], list],
                 tokens: tuple[int, int] = (0, 0), turn: Turn | None = None):
        self.kind, self.handle, self.index, self.encode = kind, handle, index, encode_at
        self.frames = encode_at(index)
        self.tokens = tokens  # sampled, forced
        self.turn = turn  # a turn draft's turn, for the ledger

    @property
    def spool_bytes(self) -> int:
        """What the numbered frame will take in a spool."""
        return record_bytes(self.frames) + _SEQ_BYTES


class AsyncProducer:
    """An asyncio producer connected to one broker endpoint.

    Use as `async with AsyncProducer(endpoint, producer_id) as producer:`;
    open trajectories with `producer.trajectory(...)`.
    """

    _loop: asyncio.AbstractEventLoop  # the one `start` ran in, which runs the I/O from then on

    def __init__(
        self,
        endpoint: str,
        producer_id: str,
        *,
        window: int = 256,
        reply_timeout: float = 30.0,
        retry_delay: float = 0.5,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        spool_dir: str | None = None,
        spool_bytes: int = 1 << 30,
        spool_fsync: bool = False,
        vocab_size: int | None = None,
        crc: bool = True,
        high_water_mark: int = 1000,
        batch_acks: bool = True,
        batch_frames: bool = True,
        check_content: bool = False,
        send_burst: int = 32,
        pack_arrays: bool = True,
        ledger: str | os.PathLike | None = None,
        curve_secret_key: str | os.PathLike | None = None,
        curve_server_key: str | os.PathLike | None = None,
        context: zmq.Context | None = None,
    ):
        if not producer_id:
            raise ValueError("producer_id must be a non-empty string")
        if send_burst < 1:
            raise ValueError(f"send_burst must be at least 1 frame, got {send_burst}")
        self.send_burst = send_burst
        self.endpoint = endpoint
        self.producer_id = producer_id
        self.vocab_size = vocab_size
        self.crc = crc
        self.check_content = check_content
        self.batch_acks = batch_acks
        self.batch_frames = batch_frames
        self._batch_bytes = 0  # how large a batch may be: 0 until a welcome says the broker reads them
        self.pack_arrays = pack_arrays
        # What was sent and acked, for the end-to-end checker (`rollstream.common.checker`):
        self.ledger = None if ledger is None else Ledger(ledger)
        self.metrics = ProducerMetrics()
        self._window_limit = window
        # Until the welcome says how many frames this connection may have in
        # flight, a few: hundreds of producers starting at once would
        # otherwise queue a full window each at the broker before any grant.
        self._window = ResendWindow(min(window, BEFORE_WELCOME_WINDOW), reply_timeout=reply_timeout,
                                    retry_delay=retry_delay)
        self._heartbeat = Heartbeat(heartbeat_interval, heartbeat_timeout, time.monotonic())
        self._spool_options = (spool_dir, spool_bytes, spool_fsync)
        self._spool: Spool | None = None
        self._hwm = high_water_mark
        self._curve = ClientCurve.from_files(curve_secret_key, curve_server_key)  # None: plain ZeroMQ
        self._handshakes = HandshakeReport(endpoint, self._curve)
        self._context = context or zmq.Context.instance()
        # Intake, shared with blocking callers on other threads (all under `_lock`):
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # blocking callers wait here for room
        self._blocked = 0  # how many wait there
        self._intake: deque[HeldFrame] = deque()  # accepted, in seq order, not yet in the window
        self._in_memory = 0  # accepted and unsettled frames held in memory (intake and window)
        self._pending: dict[int, tuple[Any, float, AsyncTrajectoryHandle | None]] = {}  # seq -> future, accepted at, handle
        self._next_seq = 1
        self._pump_scheduled = False  # the loop is due to take the intake
        # The loop's own:
        self._changed = asyncio.Event()  # set whenever frames settle (room may have appeared)
        self._read_scheduled = False
        self._connected_before = False
        self._pings: dict[int, float] = {}  # seq -> when transmitted, until answered
        self._next_overdue_report = 0.0
        self._tick_seconds = min(0.25, max(0.01, min(heartbeat_interval, reply_timeout, retry_delay or 1.0) / 4))
        self._tasks: list[asyncio.Task] = []
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._closing = False
        self._started = False
        self._failure: BaseException | None = None  # why the I/O loop died, if it did

    # -- life cycle -------------------------------------------------------------
    async def start(self) -> "AsyncProducer":
        """Open the spool (resending what it holds), connect, say hello."""
        if self._started:
            return self
        now = time.monotonic()
        spool_dir, spool_bytes, spool_fsync = self._spool_options
        if spool_dir is not None:
            self._spool = Spool(spool_dir, self.producer_id, max_bytes=spool_bytes, fsync=spool_fsync)
            self._next_seq = self._spool.last_seq + 1
            if self._spool.backlog:
                log.info(f"resending {self._spool.backlog} spooled frames from {spool_dir}",
                         extra={"producer_id": self.producer_id, "frames": self._spool.backlog, "spool_dir": spool_dir})
        self._loop = asyncio.get_running_loop()
        self._heartbeat.heard(now)  # presumed alive from the start
        sock = tune(zmq.Socket(self._context, zmq.DEALER), high_water_mark=self._hwm,
                    heartbeat_interval=self._heartbeat.interval, linger_ms=0)
        if self._curve is not None:
            self._curve.apply(sock)
        self._monitor = monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        sock.connect(self.endpoint)
        self._sock = sock
        self._send_now(self._hello())
        self._loop.add_reader(sock.fileno(), self._on_readable)
        self._loop.add_reader(monitor.fileno(), self._on_monitor)
        self._on_monitor()  # the descriptors signal edges: whatever came before the readers were added is read now
        self._tasks = [asyncio.create_task(self._tick())]
        self._tasks[0].add_done_callback(self._task_done)
        self._started = True
        self.metrics.broker_up.set(1)
        self._pump()
        log.info(f"producer started: {self.producer_id}, broker {self.endpoint}",
                 extra={"producer_id": self.producer_id, "endpoint": self.endpoint})
        return self

    async def __aenter__(self) -> "AsyncProducer":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def unsettled(self) -> int:
        """Frames accepted and not yet settled (in memory and in the spool)."""
        return self._in_memory + (self._spool.backlog if self._spool else 0)

    @property
    def held(self) -> int:
        """Frames held in memory (never more than the window)."""
        return self._in_memory

    @property
    def window(self) -> int:
        """Frames it may have unsettled now: its `window` setting or less, as
        the broker grants (`BEFORE_WELCOME_WINDOW` until the welcome)."""
        return self._window.limit

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted frame is settled; False on timeout."""
        try:
            async with asyncio.timeout(timeout):
                await self._until(lambda: self.unsettled == 0)
        except TimeoutError:
            return False
        return True

    async def _until(self, condition) -> None:
        while not condition():
            self._check_alive()
            self._changed.clear()
            await self._changed.wait()

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise ClientFailed(f"producer {self.producer_id!r}", self._failure) from self._failure

    def _task_done(self, task: asyncio.Task) -> None:
        """A background task ended by an error: nothing would ever settle
        again, so fail the waiters instead of hanging them."""
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        log.error(f"producer I/O loop failed: {self.producer_id}: {error!r}", exc_info=error)
        self._changed.set()
        with self._room:
            self._room.notify_all()

    async def close(self, timeout: float | None = 10.0) -> int:
        """Stop accepting frames, wait up to `timeout` for the rest to settle,
        then disconnect. Returns how many frames were left unsettled (kept in
        the spool if there is one; their futures raise `ProducerClosed`)."""
        if not self._started or self._closing:
            return 0
        with self._room:
            self._closing = True
            self._room.notify_all()
        self._changed.set()
        try:
            await self.flush(timeout)
        except ClientFailed:  # the I/O loop failed: nothing more will settle
            pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        where = "left in the spool" if self._spool else "dropped"
        with self._lock:
            left = len(self._pending)
            for future, _, _ in self._pending.values():
                if not future.done():
                    future.set_exception(ProducerClosed(
                        f"producer {self.producer_id!r} closed before the broker acked this frame ({where})"))
            self._pending.clear()
            self._intake.clear()
        sock, monitor = self._sock, self._monitor
        assert sock is not None and monitor is not None, "start opened both; only this closes them"
        self._loop.remove_reader(sock.fileno())
        self._loop.remove_reader(monitor.fileno())
        # Stop the events first: libzmq's I/O thread sends them blocking, so an
        # event for a closed monitor (the disconnect that closing the socket
        # causes) would stall that thread, and every socket of the context.
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        self._sock = None
        if self._spool is not None:
            self._spool.close()
        if self.ledger is not None:
            self.ledger.close()
        log.info(f"producer stopped: {self.producer_id}, {left} frames unsettled ({where}), "
                 f"{self._window.resends} resends",
                 extra={"producer_id": self.producer_id, "unsettled": left, "resends": self._window.resends})
        return left

    # -- sending ----------------------------------------------------------------
    def trajectory(self, trajectory_id: str, prompt_tokens, *, group_id: str | None = None,
                   group_size: int | None = None, sample_index: int | None = None,
                   metadata: Mapping[str, Any] | None = None) -> "AsyncTrajectoryHandle":
        """A handle that sends this trajectory's turns in order."""
        return AsyncTrajectoryHandle(self, trajectory_id, prompt_tokens, group_id=group_id, group_size=group_size,
                               sample_index=sample_index, metadata=metadata)

    async def send_trajectory(self, trajectory_id: str, prompt_tokens, turns: Sequence[Turn], reward, *,
                              metadata: Mapping[str, Any] | None = None, **identity) -> list[asyncio.Future]:
        """Send a whole trajectory: every turn, then `end(reward)`. Returns the
        futures of all its frames (turns first, then the end)."""
        traj = self.trajectory(trajectory_id, prompt_tokens, metadata=metadata, **identity)
        futures = [await traj.send(turn) for turn in turns]
        futures.append(await traj.end(reward))
        return futures

    def _spool_bytes(self, draft: _Draft) -> int:
        """The draft's spool footprint (0 without a spool); too big for the spool is an error."""
        if self._spool is None:
            return 0
        size = draft.spool_bytes
        if size > self._spool.max_bytes:
            raise ValueError(f"a frame of {size} spool bytes exceeds spool_bytes={self._spool.max_bytes}")
        return size

    def _has_room(self, size: int) -> bool:
        if self._spool is None:
            return self._in_memory < self._window.limit
        return self._spool.nbytes + size <= self._spool.max_bytes

    def _submit_now(self, draft: _Draft) -> asyncio.Future | None:
        """On the loop: accept the draft if there is room right away (no
        await, so nothing can come between the check and the acceptance).
        It goes out with the others accepted since: at once when
        `send_burst` of them wait, else when the loop next runs (a caller
        that sends several turns without yielding pays for one hand-over to
        the socket per burst, and the broker still gets frames as they come).
        None when it must wait for room."""
        if not self._started:
            raise RuntimeError("start the producer first (await producer.start() or use `async with`)")
        size = self._spool_bytes(draft)
        if not (self._closing or self._has_room(size)):
            return None
        future = self._loop.create_future()
        with self._lock:
            self._accept(draft, future)
            burst = len(self._intake) >= self.send_burst
            later = not burst and not self._pump_scheduled
            if later:
                self._pump_scheduled = True
        if burst:
            self._pump()
        elif later:
            self._loop.call_soon(self._pump)
        return future

    async def _submit(self, draft: _Draft) -> asyncio.Future:
        """On the loop: wait for room, then accept the draft; its future."""
        future = self._submit_now(draft)
        while future is None:
            size = self._spool_bytes(draft)
            await self._until(lambda: self._closing or self._has_room(size))
            future = self._submit_now(draft)
        return future

    def _submit_blocking(self, draft: _Draft, timeout: float | None) -> concurrent.futures.Future:
        """From another thread: wait for room, accept, and wake the loop if
        it is not already due to take the intake. No round trip to the loop."""
        size = self._spool_bytes(draft)
        future: concurrent.futures.Future = concurrent.futures.Future()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._room:
            while not (self._closing or self._failure is not None or self._has_room(size)):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no room for a frame within {timeout} s ({self._in_memory} frames unsettled)")
                self._blocked += 1
                try:
                    self._room.wait(remaining)
                finally:
                    self._blocked -= 1
            self._accept(draft, future)
            wake = not self._pump_scheduled
            self._pump_scheduled = True
        if wake:
            self._loop.call_soon_threadsafe(self._pump)
        return future

    def _accept(self, draft: _Draft, future) -> None:
        """Under the lock: number the draft, keep it (spool, intake), register
        its future. Raises `ClientFailed` once the I/O loop died (nothing
        would send it), `ProducerClosed` while closing."""
        self._check_alive()
        if self._closing:
            raise ProducerClosed(f"producer {self.producer_id!r} is closing; no new frames")
        handle = draft.handle
        if draft.kind != ABORT and handle.next_turn != draft.index:  # a refusal rewound the handle meanwhile
            draft.index = handle.next_turn
            draft.frames = draft.encode(draft.index)
        seq = self._take_seq()
        frames = [number_header(draft.frames[0], seq), *draft.frames[1:]]
        item = HeldFrame(seq, draft.kind, handle.trajectory_id, frames, draft.index if draft.kind == TURN else None)
        spool = self._spool
        direct = spool is None or (not spool.backlog and self._in_memory < self._window.limit)
        if spool is not None:
            spool.append(seq, frames, handed_out=direct)
        if direct:
            self._intake.append(item)
            self._in_memory += 1
        self._pending[seq] = (future, time.monotonic(), handle if draft.kind == TURN else None)
        if self.ledger is not None:
            handle._record(draft, self.ledger)
        handle.next_turn = draft.index + 1 if draft.kind == TURN else 0 if draft.kind == ABORT else handle.next_turn
        sampled, forced = draft.tokens
        if sampled or forced:
            tokens = self.metrics.tokens
            tokens.add(sampled, "sampled")
            if forced:
                tokens.add(forced, "forced")

    def _take_seq(self) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def _hello(self) -> list:
        fields: dict[str, Any] = {"producer_id": self.producer_id}
        if self.batch_acks:
            fields["batch_acks"] = True
        if self.batch_frames:
            fields["batch_frames"] = True
        self._batch_bytes = 0  # one frame a message until this connection's welcome
        return encode(PRODUCER_TO_BROKER, "hello", fields)

    def _send_now(self, frames: list) -> bool:
        """Hand frames to the socket without waiting; False if its queue is
        full. Large arrays go zero-copy (the window keeps them until settled)."""
        assert self._sock is not None, "sent only between start and close"
        try:
            send_frames(self._sock, frames, zero_copy_above=_ZERO_COPY_ABOVE)
        except zmq.Again:
            return False
        return True

    def _pump(self, *, look_again: bool = True) -> None:
        """Take the intake and the spooled backlog into the window, transmit
        what may go now, and (unless the caller reads replies right after)
        look for replies once the loop runs next. Runs on the loop."""
        if self._sock is None:  # closed
            return
        window = self._window
        with self._lock:
            self._pump_scheduled = False
            intake = self._intake
            while intake and not window.full:
                window.push(intake.popleft())
            spool = self._spool
            while spool is not None and spool.backlog and not window.full and not intake:
                backlog = spool.next_backlog()
                if backlog is None:  # not while it has a backlog
                    break
                _, frames = backlog
                window.push(HeldFrame.from_frames(frames))
                self._in_memory += 1
        now = time.monotonic()
        metrics = self.metrics
        ready = window.ready(now)
        runs = ([[item] for item in ready] if not self._batch_bytes or len(ready) < 2 else
                batch_runs(ready, max_items=self.send_burst, max_bytes=self._batch_bytes, item_max_bytes=PACK_UP_TO_BYTES))
        for run in runs:
            if not self._send_now(run[0].frames if len(run) == 1 else encode_batch([item.frames for item in run])):
                break
            for item in run:
                if item.attempts == 0:
                    metrics.sent.add(1, item.kind)
                else:
                    metrics.resends.add(1)
                window.sent(item.seq, now)
        if look_again:
            self._read_soon()

    def _refresh_gauges(self) -> None:
        self.metrics.in_flight.set(self._window.in_flight)
        self.metrics.held.set(self._in_memory)
        if self._spool is not None:
            self.metrics.spool_bytes.set(self._spool.nbytes)
            self.metrics.backlog.set(self._spool.backlog)

    # -- replies ------------------------------------------------------------------
    def _read_soon(self) -> None:
        """ZeroMQ's descriptor signals edge-triggered, and a send can take in
        replies without signalling: look again once the loop runs next (once
        per loop pass, however many sends came before)."""
        if not self._read_scheduled:
            self._read_scheduled = True
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        """Read every reply, send what they made room for, and read again
        until nothing is waiting (sending can take replies in)."""
        self._read_scheduled = False
        sock = self._sock
        try:
            while sock is not None and sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]  # an int option; pyzmq types getsockopt int | bytes
                while sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]  # an int option; pyzmq types getsockopt int | bytes
                    self._on_message(sock.recv_multipart(zmq.NOBLOCK, copy=False))
                self._pump(look_again=False)
                sock = self._sock
        except Exception as exc:  # nothing would settle again: fail loudly rather than hang
            self._fail(exc)

    def _on_message(self, frames: list) -> None:
        now = time.monotonic()
        try:
            reply = decode(frames, BROKER_TO_PRODUCER)
        except ProtocolError as error:
            self.metrics.inc(self.metrics.ignored)
            log.warning(f"undecodable reply from the broker ignored: {error.code}: {error.message}",
                        extra={"code": error.code, "reason": error.message})
            return
        if self._heartbeat.heard(now):
            self.metrics.broker_up.set(1)
            log.info(f"broker {self.endpoint} answering again", extra={"endpoint": self.endpoint})
        window = self._window
        ignored = window.ignored
        if "window" in reply.fields:  # the welcome's window, or the broker's share of its in-flight bound since
            self._set_window(reply["window"])
        if reply.type == "acks":
            self._settle(window.on_acks(reply), now)
        elif reply.type == "pong":
            self._on_pong(reply["seq"])
        elif reply.type == "welcome":
            if self.batch_frames and reply.get("batch_frames"):
                self._batch_bytes = min(BATCH_UP_TO_BYTES, reply["max_message_bytes"])
            log.info(f"broker {reply['broker_id']} welcomed us: window {window.limit}",
                     extra={"broker_id": reply["broker_id"], "window": window.limit})
        elif reply.type == "nack" and "seq" not in reply.fields:
            self.metrics.inc(self.metrics.ignored)
            log.warning(f"broker refused a message it could not read: {reply['code']}: {reply['message']}",
                        extra={"code": reply["code"], "reason": reply["message"]})
        elif reply.type in ("ack", "nack"):
            settled = window.on_reply(reply, now)
            if settled is not None:
                self._settle([settled], now)
        if window.ignored > ignored:
            self.metrics.inc(self.metrics.ignored, window.ignored - ignored)

    def _set_window(self, granted: int) -> None:
        """Frames in flight the broker allows now; senders waiting for room
        look again when it grows."""
        window = self._window
        limit = min(self._window_limit, granted)
        if limit == window.limit:
            return
        grew = limit > window.limit
        window.set_limit(limit)
        if grew:
            with self._lock:
                if self._blocked:
                    self._room.notify_all()
            self._changed.set()

    def _on_pong(self, seq: int) -> None:
        """The broker answered everything sent before this ping: frames sent
        before it and still unsettled lost their replies, and go again."""
        sent_at = self._pings.pop(seq, None)
        if sent_at is None:
            return
        for earlier in [ping for ping in self._pings if ping < seq]:  # their pongs would have come first
            del self._pings[earlier]
        resent = self._window.answered_until(sent_at)
        if resent:
            log.warning(f"the broker answered a later ping but not {resent} frames sent before it; resending them in order",
                        extra={"frames": resent})
            self._pump(look_again=False)

    def _settle(self, settled: list[Settled], now: float) -> None:
        """Frames left the window: free their spool records and room, resolve
        their futures; a refused turn rewinds its handle to that turn, so the
        corrected turn can be sent under the same index."""
        if not settled:
            return
        outcomes: Counter = Counter()
        resolved = []
        observe = self.metrics.ack_latency.observe
        with self._lock:
            spool = self._spool
            for done in settled:
                item, outcome = done.item, done.outcome
                if spool is not None:
                    spool.settle(item.seq)
                self._in_memory -= 1
                future, accepted_at, handle = self._pending.pop(item.seq, (None, None, None))
                if accepted_at is not None:
                    observe(now - accepted_at)
                if isinstance(outcome, Refused):
                    # Only turns have a handle and a turn index. conflict: the broker holds that turn.
                    if handle is not None and item.turn is not None and outcome.code != "conflict":
                        handle.next_turn = min(handle.next_turn, item.turn)
                else:
                    outcomes["duplicate" if outcome.duplicate else "applied" if outcome.applied
                             else outcome.reason or "not_applied"] += 1
                    if item.kind == END and self.ledger is not None:
                        self.ledger.write("acked", id=item.trajectory_id, applied=outcome.applied,
                                          duplicate=outcome.duplicate, reason=outcome.reason,
                                          latency=None if accepted_at is None else now - accepted_at)
                if future is not None or isinstance(outcome, Refused):
                    resolved.append((future, outcome))
            if self._blocked:
                self._room.notify_all()
        for label, count in outcomes.items():
            self.metrics.acked.add(count, label)
        for future, outcome in resolved:  # outside the lock: a blocking future runs its callbacks right here
            if isinstance(outcome, Refused):
                self.metrics.inc(self.metrics.nacked, code=outcome.code)
                log.warning(f"broker refused {outcome.kind} of {outcome.trajectory_id!r}"
                            + (f" turn {outcome.turn}" if outcome.turn is not None else "")
                            + f": {outcome.code}: {outcome.message}",
                            extra={"trajectory_id": outcome.trajectory_id, "kind": outcome.kind, "turn": outcome.turn,
                                   "code": outcome.code, "reason": outcome.message})
                if future is not None and not future.done():
                    future.set_exception(outcome)
            elif future is not None and not future.done():  # always one: only refusals come without
                future.set_result(outcome)
        self._changed.set()

    # -- time and connection events -----------------------------------------------
    async def _tick(self) -> None:
        """Reply timeouts, pings, liveness and retry backoff, a few times per
        heartbeat interval."""
        while True:
            now = time.monotonic()
            if now >= self._next_overdue_report:
                overdue = self._window.overdue(now)
                if overdue:  # reported, not resent: a live connection loses nothing, and pongs find lost replies
                    self._next_overdue_report = now + self._window.reply_timeout
                    log.warning(f"{overdue} frames without a reply for {self._window.reply_timeout} s; waiting "
                                f"(the broker {'answers pings' if self._heartbeat.alive else 'is silent'})",
                                extra={"frames": overdue})
            if self._heartbeat.lost(now):
                self.metrics.broker_up.set(0)
                log.warning(f"broker {self.endpoint} silent for {self._heartbeat.timeout} s",
                            extra={"endpoint": self.endpoint, "seconds": self._heartbeat.timeout})
            if self._heartbeat.ping_due(now):
                with self._lock:
                    seq = self._take_seq()
                if self._send_now(encode(PRODUCER_TO_BROKER, "ping", {"seq": seq})):
                    self._heartbeat.pinged(now)
                    self._pings[seq] = now
                    if len(self._pings) > 64:  # a silent broker: keep the latest only
                        del self._pings[min(self._pings)]
            self._pump()
            self._on_monitor()  # a missed edge costs at most a tick
            self._refresh_gauges()
            await asyncio.sleep(self._tick_seconds)

    def _on_monitor(self) -> None:
        """Connection events: after a reconnect, whatever was in flight may be
        lost, so it is all resent (in order) behind a fresh hello."""
        monitor = self._monitor
        while monitor is not None and monitor.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator]  # an int option; pyzmq types getsockopt int | bytes
            message = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            event = message["event"]
            failure = self._handshakes.note(event, message["value"])
            if failure is not None:
                log.error(failure, extra={"endpoint": self.endpoint})
            if event & HANDSHAKE_FAILURES:
                continue
            if event == zmq.EVENT_DISCONNECTED:
                log.info(f"disconnected from the broker {self.endpoint}", extra={"endpoint": self.endpoint})
                continue
            if self._connected_before:
                self._pings.clear()  # they went with the old connection
                resent = self._window.reconnected()
                self.metrics.inc(self.metrics.reconnects)
                self._send_now(self._hello())
                log.info(f"reconnected to the broker {self.endpoint}; resending {resent} frames in order",
                         extra={"endpoint": self.endpoint, "frames": resent})
                self._pump()
            self._connected_before = True


class AsyncTrajectoryHandle:
    """Sends one trajectory's turns, end or abort, in order. Turn indices
    count from 0; after `abort` the next turn is turn 0 again (a retry).
    After a refused turn (anything but `conflict`) `next_turn` is that
    turn's index again: send the corrected turn next."""

    def __init__(self, producer: AsyncProducer, trajectory_id: str, prompt_tokens, *, group_id: str | None,
                 group_size: int | None, sample_index: int | None, metadata: Mapping[str, Any] | None):
        if (group_id is None) != (group_size is None):
            raise ValueError(f"group_id and group_size travel together, got group_id={group_id!r}, group_size={group_size!r}")
        self.producer = producer
        self.trajectory_id = trajectory_id
        self.prompt_tokens = _prompt_array(prompt_tokens, producer.vocab_size)
        self.group_id = group_id
        self.group_size = group_size
        self.sample_index = sample_index
        self.metadata = dict(metadata or {})
        check_values(PRODUCER_TO_BROKER, "turn", {"trajectory_id": trajectory_id, "group_id": group_id,
                                                  "group_size": group_size, "sample_index": sample_index})
        self.next_turn = 0
        self._lock = asyncio.Lock()
        # For the ledger (only with one): the content digest after the prompt and after each turn sent.
        self._digests: list[ContentDigest] = []
        self._turn_records: list[TurnRecord] = []

    def _record(self, draft: _Draft, ledger: Ledger) -> None:
        """Under the producer's lock, as a draft is accepted: a turn's digest
        goes on from the turn before it (a corrected turn replaces a refused
        one, and turn 0 after an `abort` starts afresh), an `end` writes the
        trajectory's `sent` record."""
        if draft.kind == TURN:
            if not self._digests:
                self._digests.append(ContentDigest(self.prompt_tokens))
            del self._digests[draft.index + 1:], self._turn_records[draft.index:]
            record, after = turn_record(self._digests[draft.index], draft.turn)
            self._digests.append(after)
            self._turn_records.append(record)
        elif draft.kind == END:
            prompt = (self._digests[0] if self._digests else ContentDigest(self.prompt_tokens)).hexdigest()
            ledger.write("sent", id=self.trajectory_id, producer=self.producer.producer_id, prompt=prompt,
                         turns=[list(record) for record in self._turn_records[:draft.index]])

    # -- drafts (any thread) ---------------------------------------------------
    def _turn_draft(self, turn: Turn, metadata: Mapping[str, Any] | None) -> _Draft:
        """The turn's fields are checked here, once; its frame is then encoded
        unchecked. Its arrays go packed in one frame when that copy is small
        (`codec.worth_packing`); larger ones go as they are, each handed to
        the socket without a copy."""
        if turn.weight_version is not None or metadata is not None:
            check_values(PRODUCER_TO_BROKER, "turn", {"weight_version": turn.weight_version, "metadata": metadata})

        def encode_at(index: int) -> list:
            first = index == 0
            merged = {**self.metadata, **(metadata or {})} if first else metadata
            return encode_turn(
                self.trajectory_id, index, turn, seq=None,
                prompt_tokens=self.prompt_tokens if first else None,
                group_id=self.group_id if first else None,
                group_size=self.group_size if first else None,
                sample_index=self.sample_index if first else None,
                metadata=merged or None,
                crc=self.producer.crc,
                checked=False,
                may_pack=self.producer.pack_arrays,
            )
        return _Draft(TURN, self, self.next_turn, encode_at, (len(turn.tokens), int(turn.forced_tokens.size)), turn)

    def _end_draft(self, reward, metadata: Mapping[str, Any] | None) -> _Draft:
        fields = {"trajectory_id": self.trajectory_id, "reward": _reward(reward)}
        if metadata:
            fields["metadata"] = dict(metadata)

        def encode_at(turns: int) -> list:
            return encode(PRODUCER_TO_BROKER, "end", {**fields, "turns": turns}, numbered=False)
        return _Draft(END, self, self.next_turn, encode_at)

    def _abort_draft(self, reason: str) -> _Draft:
        frames = encode(PRODUCER_TO_BROKER, "abort", {"trajectory_id": self.trajectory_id, "reason": reason},
                        numbered=False)
        return _Draft(ABORT, self, self.next_turn, lambda _: frames)

    def _build(self, tokens, log_probs, options: dict) -> Turn:
        producer = self.producer
        return Turn.build(tokens, log_probs, vocab_size=producer.vocab_size, borrow=True,
                          check_content=producer.check_content, **options)

    def _sglang_turn(self, output_ids, meta_info, options: dict) -> Turn:
        return turn_from_sglang(output_ids, meta_info, vocab_size=self.producer.vocab_size, **options)

    # -- sending -----------------------------------------------------------------
    async def _send(self, draft: _Draft) -> asyncio.Future:
        """Accept at once when there is room and no earlier send of this
        handle waits for it; otherwise wait in call order."""
        if not self._lock.locked():
            future = self.producer._submit_now(draft)
            if future is not None:
                return future
        async with self._lock:
            return await self.producer._submit(draft)

    async def turn(self, tokens, log_probs, *, mask: SamplingMask | None = None, supports=None, mask_ids=None,
                   mask_offsets=None, loss_mask=None, forced_tokens=None, routed_experts=None, indexer_topk=None,
                   status: str = "completed", weight_version: str | None = None,
                   metadata: Mapping[str, Any] | None = None) -> asyncio.Future:
        """Send the next turn: the sampled tokens with their log-probs and
        supports (`mask`, `mask_ids` + `mask_offsets` as CSR arrays, or
        `supports` as one id list per token), then the forced tokens the
        environment appended after them. Arrays of the contract dtypes are
        sent as they are (not copied): leave them unchanged until settled."""
        turn = self._build(tokens, log_probs, dict(
            mask=mask, supports=supports, mask_ids=mask_ids, mask_offsets=mask_offsets, loss_mask=loss_mask,
            forced_tokens=forced_tokens, routed_experts=routed_experts, indexer_topk=indexer_topk, status=status,
            weight_version=weight_version))
        return await self._send(self._turn_draft(turn, metadata))

    async def turn_and_wait(self, tokens, log_probs, **options) -> Receipt:
        """`turn`, then wait for the broker's receipt (raises `Refused`)."""
        return await (await self.turn(tokens, log_probs, **options))

    async def sglang(self, output_ids, meta_info: Mapping[str, Any], *, forced_tokens=None, loss_mask=None,
                     require_mask: bool = True, metadata: Mapping[str, Any] | None = None) -> asyncio.Future:
        """Send the next turn straight from an SGLang `/generate` response."""
        turn = self._sglang_turn(output_ids, meta_info, dict(forced_tokens=forced_tokens, loss_mask=loss_mask,
                                                             require_mask=require_mask))
        return await self._send(self._turn_draft(turn, metadata))

    async def send(self, turn: Turn, *, metadata: Mapping[str, Any] | None = None) -> asyncio.Future:
        """Send an already built `Turn` as the next turn."""
        return await self._send(self._turn_draft(turn, metadata))

    async def end(self, reward, metadata: Mapping[str, Any] | None = None) -> asyncio.Future:
        """Finish the trajectory with its reward (a number or a map). The
        `end` says how many turns were sent, so the broker refuses it
        (`out_of_order`) rather than end the trajectory short of one."""
        return await self._send(self._end_draft(reward, metadata))

    async def end_and_wait(self, reward, metadata: Mapping[str, Any] | None = None) -> Receipt:
        """`end`, then wait for the broker's receipt (raises `Refused`)."""
        return await (await self.end(reward, metadata))

    async def abort(self, reason: str = "") -> asyncio.Future:
        """Discard the trajectory at the broker; the next turn starts it afresh."""
        return await self._send(self._abort_draft(reason))


# -- the blocking client ---------------------------------------------------------
class Producer:
    """The blocking producer: same arguments and vocabulary as
    `AsyncProducer`; sends block while there is no room and return
    `concurrent.futures.Future`s. One background thread runs the event
    loop that does the socket I/O; a send does its checks and encoding in
    the calling thread and does not wait for that loop."""

    def __init__(self, endpoint: str, producer_id: str, **options):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"rollstream-producer-{producer_id}",
                                        daemon=True)
        self._thread.start()
        try:
            self._async: AsyncProducer = self._run(self._make(endpoint, producer_id, options))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _make(endpoint, producer_id, options) -> AsyncProducer:
        return await AsyncProducer(endpoint, producer_id, **options).start()

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def metrics(self) -> ProducerMetrics:
        return self._async.metrics

    @property
    def unsettled(self) -> int:
        return self._async.unsettled

    def trajectory(self, trajectory_id: str, prompt_tokens, *, group_id: str | None = None,
                   group_size: int | None = None, sample_index: int | None = None,
                   metadata: Mapping[str, Any] | None = None) -> "TrajectoryHandle":
        return TrajectoryHandle(self._async, AsyncTrajectoryHandle(self._async, trajectory_id, prompt_tokens, group_id=group_id,
                                                       group_size=group_size, sample_index=sample_index,
                                                       metadata=metadata))

    def send_trajectory(self, trajectory_id: str, prompt_tokens, turns: Sequence[Turn], reward, *,
                        metadata: Mapping[str, Any] | None = None, **identity) -> list[concurrent.futures.Future]:
        traj = self.trajectory(trajectory_id, prompt_tokens, metadata=metadata, **identity)
        return [*(traj.send(turn) for turn in turns), traj.end(reward)]

    def flush(self, timeout: float | None = None) -> bool:
        return self._run(self._async.flush(timeout))

    def close(self, timeout: float | None = 10.0) -> int:
        if self._loop.is_closed():
            return 0
        left = self._run(self._async.close(timeout))
        self._stop_loop()
        return left

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "Producer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TrajectoryHandle:
    """Blocking twin of `AsyncTrajectoryHandle`: each call blocks for room (up to
    `timeout` seconds, then `TimeoutError`) and returns a future of the
    broker's receipt. Use one handle from one thread at a time."""

    def __init__(self, producer: AsyncProducer, handle: AsyncTrajectoryHandle):
        self._producer = producer
        self._handle = handle
        self.trajectory_id = handle.trajectory_id

    @property
    def next_turn(self) -> int:
        return self._handle.next_turn

    def _submit(self, draft: _Draft, timeout: float | None) -> concurrent.futures.Future:
        return self._producer._submit_blocking(draft, timeout)

    def turn(self, tokens, log_probs, *, metadata: Mapping[str, Any] | None = None, timeout: float | None = None,
             **options) -> concurrent.futures.Future:
        return self.send(self._handle._build(tokens, log_probs, options), metadata=metadata, timeout=timeout)

    def turn_and_wait(self, tokens, log_probs, *, timeout: float | None = None, **options) -> Receipt:
        """`turn`, then wait up to `timeout` for the receipt (raises `Refused`)."""
        return self.turn(tokens, log_probs, timeout=timeout, **options).result(timeout)

    def sglang(self, output_ids, meta_info: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None,
               timeout: float | None = None, **options) -> concurrent.futures.Future:
        return self.send(self._handle._sglang_turn(output_ids, meta_info, options), metadata=metadata, timeout=timeout)

    def send(self, turn: Turn, *, metadata: Mapping[str, Any] | None = None,
             timeout: float | None = None) -> concurrent.futures.Future:
        return self._submit(self._handle._turn_draft(turn, metadata), timeout)

    def end(self, reward, metadata: Mapping[str, Any] | None = None, *,
            timeout: float | None = None) -> concurrent.futures.Future:
        return self._submit(self._handle._end_draft(reward, metadata), timeout)

    def end_and_wait(self, reward, metadata: Mapping[str, Any] | None = None, *,
                     timeout: float | None = None) -> Receipt:
        """`end`, then wait up to `timeout` for the receipt (raises `Refused`)."""
        return self.end(reward, metadata, timeout=timeout).result(timeout)

    def abort(self, reason: str = "", *, timeout: float | None = None) -> concurrent.futures.Future:
        return self._submit(self._handle._abort_draft(reason), timeout)
