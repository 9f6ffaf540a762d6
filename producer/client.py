"""Producer clients: stream a rollout's turns to the node's broker.

`AsyncProducer` is the I/O shell (zmq.asyncio) around the sans-I/O
`ResendWindow` and the optional disk `Spool`; `Producer` is the blocking
client with the same vocabulary, running an `AsyncProducer` on one
background event-loop thread.

Every send first waits for room (the window, or the spool's byte budget when
there is a spool: backpressure, memory does not grow), then returns a future
that resolves to a `Receipt` once the broker has made the frame durable, or
raises `Refused` carrying the nack code.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from typing import Any, Mapping, Sequence

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from rollstream.common.codec import decode, encode
from rollstream.common.errors import ProtocolError
from rollstream.common.ingest import turn_from_sglang
from rollstream.common.mask import SamplingMask, as_int_array, owned
from rollstream.common.messages import BROKER_TO_PRODUCER, PRODUCER_TO_BROKER
from rollstream.common.sockets import tune
from rollstream.common.trajectory import TOKEN_DTYPE, Turn
from rollstream.common.validation import check_message_arrays
from rollstream.common.wire import encode_turn

from .errors import ProducerClosed, Refused
from .metrics import ProducerMetrics
from .spool import Spool, record_bytes
from .window import Heartbeat, Outgoing, ResendWindow, Settled

log = logging.getLogger("rollstream.producer")

_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


def _with_seq(header: bytes, seq: int) -> bytes:
    """The header frame with its `seq` replaced (arrays and CRC unchanged:
    the CRC covers array frames only)."""
    fields = msgpack.unpackb(header, raw=False)
    fields["seq"] = seq
    return msgpack.packb(fields, use_bin_type=True)


def _reward(value: Any) -> Any:
    """A number or a map, as the wire wants it (numpy scalars become floats)."""
    return value if isinstance(value, Mapping) else float(value)


def _prompt_array(prompt_tokens, vocab_size: int | None):
    """The prompt as an owned int32 array, checked against the vocabulary."""
    prompt = owned(as_int_array(prompt_tokens, TOKEN_DTYPE, "prompt_tokens"), prompt_tokens)
    empty = prompt[:0]
    check_message_arrays({"tokens": empty, "log_probs": empty.astype("<f4"), "prompt_tokens": prompt},
                         vocab_size=vocab_size)
    return prompt


class AsyncProducer:
    """An asyncio producer connected to one broker endpoint.

    Use as `async with AsyncProducer(endpoint, producer_id) as producer:`;
    open trajectories with `producer.trajectory(...)`.
    """

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
        context: zmq.asyncio.Context | None = None,
    ):
        if not producer_id:
            raise ValueError("producer_id must be a non-empty string")
        self.endpoint = endpoint
        self.producer_id = producer_id
        self.vocab_size = vocab_size
        self.crc = crc
        self.metrics = ProducerMetrics()
        self._window_limit = window
        self._window = ResendWindow(window, reply_timeout=reply_timeout, retry_delay=retry_delay)
        self._heartbeat = Heartbeat(heartbeat_interval, heartbeat_timeout, time.monotonic())
        self._spool_options = (spool_dir, spool_bytes, spool_fsync)
        self._spool: Spool | None = None
        self._hwm = high_water_mark
        self._context = context or zmq.asyncio.Context.instance()
        self._pending: dict[int, tuple[asyncio.Future, float]] = {}  # seq -> (future, accepted at)
        self._next_seq = 1
        self._changed: asyncio.Event | None = None  # set whenever frames settle (room may have appeared)
        self._tick_seconds = min(0.25, max(0.01, min(heartbeat_interval, reply_timeout, retry_delay or 1.0) / 4))
        self._tasks: list[asyncio.Task] = []
        self._sock = self._monitor = None
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
                log.info("resending spooled frames", extra={"producer_id": self.producer_id,
                                                            "frames": self._spool.backlog, "spool_dir": spool_dir})
        self._changed = asyncio.Event()
        self._heartbeat.heard(now)  # presumed alive from the start
        sock = tune(self._context.socket(zmq.DEALER), high_water_mark=self._hwm,
                    heartbeat_interval=self._heartbeat.interval, linger_ms=0)
        self._monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        sock.connect(self.endpoint)
        self._sock = sock
        self._send_now([*encode(PRODUCER_TO_BROKER, "hello", {"producer_id": self.producer_id})])
        self._tasks = [asyncio.create_task(coro) for coro in (self._receive(), self._watch(), self._tick())]
        for task in self._tasks:
            task.add_done_callback(self._task_done)
        self._started = True
        self.metrics.broker_up.set(1)
        self._pump()
        log.info("producer started", extra={"producer_id": self.producer_id, "endpoint": self.endpoint})
        return self

    async def __aenter__(self) -> "AsyncProducer":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def unsettled(self) -> int:
        """Frames accepted and not yet settled (in memory and in the spool)."""
        return len(self._window) + (self._spool.backlog if self._spool else 0)

    @property
    def held(self) -> int:
        """Frames held in memory (never more than the window)."""
        return len(self._window)

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
            if self._failure is not None:
                raise ProducerClosed(f"producer {self.producer_id!r} stopped working: {self._failure!r}") from self._failure
            self._changed.clear()
            await self._changed.wait()

    def _task_done(self, task: asyncio.Task) -> None:
        """A background task ended by an error: nothing would ever settle
        again, so fail the waiters instead of hanging them."""
        if task.cancelled() or task.exception() is None:
            return
        self._failure = task.exception()
        log.error("producer I/O loop failed", exc_info=self._failure)
        self._changed.set()

    async def close(self, timeout: float | None = 10.0) -> int:
        """Stop accepting frames, wait up to `timeout` for the rest to settle,
        then disconnect. Returns how many frames were left unsettled (kept in
        the spool if there is one; their futures raise `ProducerClosed`)."""
        if not self._started or self._closing:
            return 0
        self._closing = True
        self._changed.set()
        try:
            await self.flush(timeout)
        except ProducerClosed:  # the I/O loop failed: nothing more will settle
            pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        left = self.unsettled
        where = "left in the spool" if self._spool else "dropped"
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(ProducerClosed(f"producer {self.producer_id!r} closed before the broker acked this frame ({where})"))
        self._pending.clear()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._sock = None
        if self._spool is not None:
            self._spool.close()
        log.info("producer stopped", extra={"producer_id": self.producer_id, "unsettled": left,
                                            "resends": self._window.resends})
        return left

    # -- sending ----------------------------------------------------------------
    def trajectory(self, trajectory_id: str, prompt_tokens, *, group_id: str | None = None,
                   group_size: int | None = None, sample_index: int | None = None,
                   metadata: Mapping[str, Any] | None = None) -> "AsyncTrajectory":
        """A handle that sends this trajectory's turns in order."""
        return AsyncTrajectory(self, trajectory_id, prompt_tokens, group_id=group_id, group_size=group_size,
                               sample_index=sample_index, metadata=metadata)

    async def send_trajectory(self, trajectory_id: str, prompt_tokens, turns: Sequence[Turn], reward, *,
                              metadata: Mapping[str, Any] | None = None, **identity) -> list[asyncio.Future]:
        """Send a whole trajectory: every turn, then `end(reward)`. Returns the
        futures of all its frames (turns first, then the end)."""
        traj = self.trajectory(trajectory_id, prompt_tokens, metadata=metadata, **identity)
        futures = [await traj.send(turn) for turn in turns]
        futures.append(await traj.end(reward))
        return futures

    async def submit(self, frames: list) -> asyncio.Future:
        """Accept one encoded `turn`/`end`/`abort` message (its header's seq is
        replaced): wait for room, keep it until settled, return its future."""
        if not self._started:
            raise RuntimeError("start the producer first (await producer.start() or use `async with`)")
        if self._spool is not None and record_bytes(frames) > self._spool.max_bytes:
            raise ValueError(f"a frame of {record_bytes(frames)} spool bytes exceeds spool_bytes={self._spool.max_bytes}")
        await self._until(lambda: self._closing or self._has_room(frames))
        if self._closing:
            raise ProducerClosed(f"producer {self.producer_id!r} is closing; no new frames")
        # From here to the end nothing awaits, so seqs enter the window in order.
        seq = self._take_seq()
        frames = [_with_seq(bytes(frames[0]), seq), *frames[1:]]
        item = Outgoing.from_frames(frames)
        if self._spool is None:
            self._window.push(item)
        else:
            direct = not self._spool.backlog and not self._window.full
            self._spool.append(seq, frames, handed_out=direct)
            if direct:
                self._window.push(item)
        future = asyncio.get_running_loop().create_future()
        self._pending[seq] = (future, time.monotonic())
        self._pump()
        return future

    def _has_room(self, frames: list) -> bool:
        if self._spool is None:
            return not self._window.full
        return self._spool.fits(frames)

    def _take_seq(self) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def _send_now(self, frames: list) -> bool:
        """Hand frames to the socket without waiting; False if its queue is full."""
        sent = self._sock.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
        if sent.done() and sent.exception() is not None:
            if isinstance(sent.exception(), zmq.Again):
                return False
            raise sent.exception()
        return True

    def _pump(self) -> None:
        """Move spooled backlog into the window, transmit what may go now."""
        if self._sock is None:  # closed
            return
        now = time.monotonic()
        spool = self._spool
        while spool is not None and spool.backlog and not self._window.full:
            _, frames = spool.next_backlog()
            self._window.push(Outgoing.from_frames(frames))
        for item in self._window.ready(now):
            if not self._send_now(item.frames):
                break
            first = item.attempts == 0
            self._window.sent(item.seq, now)
            if first:
                self.metrics.inc(self.metrics.sent, type=item.kind)
            else:
                self.metrics.inc(self.metrics.resends)
        self._refresh_gauges()

    def _refresh_gauges(self) -> None:
        self.metrics.in_flight.set(self._window.in_flight)
        self.metrics.held.set(len(self._window))
        if self._spool is not None:
            self.metrics.spool_bytes.set(self._spool.nbytes)
            self.metrics.backlog.set(self._spool.backlog)

    # -- replies ------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            self._on_message(frames)

    def _on_message(self, frames: list) -> None:
        now = time.monotonic()
        try:
            reply = decode(frames, BROKER_TO_PRODUCER)
        except ProtocolError as error:
            self.metrics.inc(self.metrics.ignored)
            log.warning("undecodable reply from the broker ignored", extra={"code": error.code, "reason": error.message})
            return
        if self._heartbeat.heard(now):
            self.metrics.broker_up.set(1)
            log.info("broker answering again", extra={"endpoint": self.endpoint})
        if reply.type == "welcome":
            self._window.set_limit(min(self._window_limit, reply["window"]))
            log.info("broker welcomed us", extra={"broker_id": reply["broker_id"], "window": self._window.limit})
        elif reply.type == "nack" and "seq" not in reply.fields:
            self.metrics.inc(self.metrics.ignored)
            log.warning("broker refused a message it could not read", extra={"code": reply["code"],
                                                                             "reason": reply["message"]})
        elif reply.type in ("ack", "nack"):
            ignored = self._window.ignored
            settled = self._window.on_reply(reply, now)
            if settled is not None:
                self._settled(settled, now)
            elif self._window.ignored > ignored:
                self.metrics.inc(self.metrics.ignored)
        self._pump()

    def _settled(self, settled: Settled, now: float) -> None:
        item, outcome = settled.item, settled.outcome
        if self._spool is not None:
            self._spool.settle(item.seq)
        future, accepted_at = self._pending.pop(item.seq, (None, None))
        if accepted_at is not None:
            self.metrics.ack_latency.observe(now - accepted_at)
        if isinstance(outcome, Refused):
            self.metrics.inc(self.metrics.nacked, code=outcome.code)
            log.warning("frame refused", extra={"trajectory_id": item.trajectory_id, "kind": item.kind,
                                                "turn": item.turn, "code": outcome.code, "reason": outcome.message})
            if future is not None and not future.done():
                future.set_exception(outcome)
        else:
            label = "duplicate" if outcome.duplicate else "applied" if outcome.applied else outcome.reason or "not_applied"
            self.metrics.inc(self.metrics.acked, outcome=label)
            if future is not None and not future.done():
                future.set_result(outcome)
        self._changed.set()

    # -- time and connection events -----------------------------------------------
    async def _tick(self) -> None:
        """Reply timeouts, pings, liveness and retry backoff, a few times per
        heartbeat interval."""
        while True:
            now = time.monotonic()
            resent = self._window.expire(now)
            if resent:
                log.warning("replies overdue; resending in order", extra={"frames": resent})
            if self._heartbeat.lost(now):
                self.metrics.broker_up.set(0)
                log.warning("broker silent", extra={"endpoint": self.endpoint, "seconds": self._heartbeat.timeout})
            if self._heartbeat.ping_due(now) and self._send_now(encode(PRODUCER_TO_BROKER, "ping", {"seq": self._take_seq()})):
                self._heartbeat.pinged(now)
            self._pump()
            await asyncio.sleep(self._tick_seconds)

    async def _watch(self) -> None:
        """Connection events: after a reconnect, whatever was in flight may be
        lost, so it is all resent (in order) behind a fresh hello."""
        connected_before = False
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                log.info("disconnected from the broker", extra={"endpoint": self.endpoint})
                continue
            if connected_before:
                resent = self._window.reconnected()
                self.metrics.inc(self.metrics.reconnects)
                self._send_now(encode(PRODUCER_TO_BROKER, "hello", {"producer_id": self.producer_id}))
                log.info("reconnected to the broker; resending in order", extra={"endpoint": self.endpoint,
                                                                                 "frames": resent})
                self._pump()
            connected_before = True


class AsyncTrajectory:
    """Sends one trajectory's turns, end or abort, in order. Turn indices
    count from 0; after `abort` the next turn is turn 0 again (a retry)."""

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
        self.next_turn = 0
        self._lock = asyncio.Lock()

    async def turn(self, tokens, log_probs, *, mask: SamplingMask | None = None, supports=None, mask_ids=None,
                   mask_offsets=None, loss_mask=None,
                   forced_tokens=None, routed_experts=None, indexer_topk=None, status: str = "completed",
                   weight_version: str | None = None, metadata: Mapping[str, Any] | None = None) -> asyncio.Future:
        """Send the next turn: the sampled tokens with their log-probs and
        supports (`mask`, or `supports` as one id list per token), then the
        forced tokens the environment appended after them."""
        turn = Turn.build(tokens, log_probs, mask=mask, supports=supports, mask_ids=mask_ids, mask_offsets=mask_offsets,
                          loss_mask=loss_mask,
                          forced_tokens=forced_tokens, routed_experts=routed_experts, indexer_topk=indexer_topk,
                          status=status, weight_version=weight_version, vocab_size=self.producer.vocab_size)
        return await self.send(turn, metadata=metadata)

    async def sglang(self, output_ids, meta_info: Mapping[str, Any], *, forced_tokens=None, loss_mask=None,
                     require_mask: bool = True, metadata: Mapping[str, Any] | None = None) -> asyncio.Future:
        """Send the next turn straight from an SGLang `/generate` response."""
        turn = turn_from_sglang(output_ids, meta_info, forced_tokens=forced_tokens, loss_mask=loss_mask,
                                vocab_size=self.producer.vocab_size, require_mask=require_mask)
        return await self.send(turn, metadata=metadata)

    async def send(self, turn: Turn, *, metadata: Mapping[str, Any] | None = None) -> asyncio.Future:
        """Send an already built `Turn` as the next turn."""
        async with self._lock:
            index = self.next_turn
            first = index == 0
            merged = {**self.metadata, **(metadata or {})} if first else metadata
            frames = encode_turn(
                self.trajectory_id, index, turn, seq=0,
                prompt_tokens=self.prompt_tokens if first else None,
                group_id=self.group_id if first else None,
                group_size=self.group_size if first else None,
                sample_index=self.sample_index if first else None,
                metadata=merged or None,
                crc=self.producer.crc,
            )
            future = await self.producer.submit(frames)
            self.next_turn = index + 1
        metrics = self.producer.metrics
        metrics.inc(metrics.tokens, len(turn.tokens), kind="sampled")
        if turn.forced_tokens.size:
            metrics.inc(metrics.tokens, int(turn.forced_tokens.size), kind="forced")
        return future

    async def end(self, reward, metadata: Mapping[str, Any] | None = None) -> asyncio.Future:
        """Finish the trajectory with its reward (a number or a map)."""
        fields = {"seq": 0, "trajectory_id": self.trajectory_id, "reward": _reward(reward)}
        if metadata:
            fields["metadata"] = dict(metadata)
        async with self._lock:
            return await self.producer.submit(encode(PRODUCER_TO_BROKER, "end", fields))

    async def abort(self, reason: str = "") -> asyncio.Future:
        """Discard the trajectory at the broker; the next turn starts it afresh."""
        async with self._lock:
            future = await self.producer.submit(
                encode(PRODUCER_TO_BROKER, "abort", {"seq": 0, "trajectory_id": self.trajectory_id, "reason": reason})
            )
            self.next_turn = 0
        return future


# -- the blocking client ---------------------------------------------------------
def _concurrent(future: asyncio.Future) -> concurrent.futures.Future:
    """A thread-safe future that settles with `future` (called on its loop)."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def copy(done: asyncio.Future) -> None:
        if done.cancelled():
            out.cancel()
        elif done.exception() is not None:
            out.set_exception(done.exception())
        else:
            out.set_result(done.result())

    future.add_done_callback(copy)
    return out


class Producer:
    """The blocking producer: same arguments and vocabulary as
    `AsyncProducer`; sends block while there is no room and return
    `concurrent.futures.Future`s. One background thread runs the event loop."""

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

    def _future(self, coro):
        """Run a sending coroutine; its asyncio future(s) come back thread-safe."""
        async def accepted():
            result = await coro
            return [_concurrent(f) for f in result] if isinstance(result, list) else _concurrent(result)

        return self._run(accepted())

    @property
    def metrics(self) -> ProducerMetrics:
        return self._async.metrics

    @property
    def unsettled(self) -> int:
        return self._async.unsettled

    def trajectory(self, trajectory_id: str, prompt_tokens, **identity) -> "Trajectory":
        return Trajectory(self, self._async.trajectory(trajectory_id, prompt_tokens, **identity))

    def send_trajectory(self, trajectory_id: str, prompt_tokens, turns: Sequence[Turn], reward,
                        **options) -> list[concurrent.futures.Future]:
        return self._future(self._async.send_trajectory(trajectory_id, prompt_tokens, turns, reward, **options))

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


class Trajectory:
    """Blocking twin of `AsyncTrajectory`: each call blocks for room and
    returns a future of the broker's receipt."""

    def __init__(self, producer: Producer, handle: AsyncTrajectory):
        self._producer = producer
        self._handle = handle
        self.trajectory_id = handle.trajectory_id

    @property
    def next_turn(self) -> int:
        return self._handle.next_turn

    def turn(self, tokens, log_probs, **options) -> concurrent.futures.Future:
        return self._producer._future(self._handle.turn(tokens, log_probs, **options))

    def sglang(self, output_ids, meta_info: Mapping[str, Any], **options) -> concurrent.futures.Future:
        return self._producer._future(self._handle.sglang(output_ids, meta_info, **options))

    def send(self, turn: Turn, **options) -> concurrent.futures.Future:
        return self._producer._future(self._handle.send(turn, **options))

    def end(self, reward, metadata: Mapping[str, Any] | None = None) -> concurrent.futures.Future:
        return self._producer._future(self._handle.end(reward, metadata))

    def abort(self, reason: str = "") -> concurrent.futures.Future:
        return self._producer._future(self._handle.abort(reason))

