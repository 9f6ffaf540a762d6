"""Producer clients: stream a rollout's turns to the node's broker.

`AsyncProducer` is the I/O shell around `session.ProducerSession`, the
sans-I/O core that decides what the connection says, what the replies mean
and what goes out next: the shell holds one plain ZeroMQ DEALER whose
replies the asyncio loop reads from a reader callback on the socket's
descriptor (its sends never wait: no per-message futures of zmq.asyncio),
a reader on the socket's monitor for connection events, and one task for
what time brings (pings, liveness, overdue reports). `Producer` is the
blocking client: it checks, encodes and numbers frames in the caller's
thread and hands them to an `AsyncProducer` whose loop runs on one
background thread, waking that loop once per burst of calls, not per call.

The trajectory handles turn each call into a `session.Draft` (checked and
encoded, not yet numbered) and hand it to their producer through its public
`try_submit`, `submit` or `submit_blocking`. Every send first waits for room
(the window, or the spool's byte budget when there is a spool: backpressure,
memory does not grow), then returns a future that resolves to a `Receipt`
once the broker has made the frame durable, or raises `Refused` carrying the
nack code. Arrays travel zero-copy: a send keeps references to the caller's
arrays until the frame is settled.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from typing import Any, Callable, Mapping, Sequence, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from rollstream.common.checker import Ledger
from rollstream.common.clock import Clock
from rollstream.common.codec import check_values, decode, encode
from rollstream.common.curve import HANDSHAKE_FAILURES, ClientCurve, HandshakeReport
from rollstream.common.errors import (
    ClientFailed,
    InternalError,
    InvalidInput,
    InvalidState,
    ProtocolError,
    RollstreamError,
    TimedOut,
)
from rollstream.common.failures import log_internal
from rollstream.common.ingest import turn_from_sglang
from rollstream.common.jobs import DEFAULT_JOB
from rollstream.common.mask import SamplingMask, as_int_array, owned
from rollstream.common.messages import BROKER_TO_PRODUCER, PRODUCER_TO_BROKER
from rollstream.common.sockets import SendBuffer, recv_parts, send_frames, tune
from rollstream.common.trajectory import TOKEN_DTYPE, Turn
from rollstream.common.validation import check_message_arrays
from rollstream.common.wire import encode_turn

from .errors import Halted, ProducerClosed, Refused
from .metrics import ProducerMetrics
from .resume import Prefix, Resumable
from .session import Draft, ProducerSession, TrajectoryDigests
from .spool import Spool
from .window import ABORT, END, REWARD, TURN, Receipt, Settled

log = logging.getLogger("rollstream.producer")

_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: enum arithmetic costs more than the call
_ZERO_COPY_ABOVE = 65536  # bytes: smaller frames are cheaper to copy than to hand over (pyzmq's own threshold)


def retrieve(future: asyncio.Future) -> None:
    """Mark `future`'s exception as seen once it has one, for a frame whose
    outcome nobody awaits (a refusal is logged and counted by the client,
    and gives up the trajectory of a handle that halts): asyncio warns of
    an exception never retrieved."""
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


def _reward(value: Any) -> Any:
    """A number or a map, as the wire wants it (numpy scalars become floats)."""
    return value if isinstance(value, Mapping) else float(value)


class _ById:
    """A trajectory known only by its id (a reward sent for it): what a draft needs of a handle."""

    halted = None  # no handle of its own halts

    def __init__(self, trajectory_id: str):
        check_values(PRODUCER_TO_BROKER, "reward", {"trajectory_id": trajectory_id})
        self.trajectory_id = trajectory_id
        self.next_turn = 0


def reward_draft(handle, reward, job: str) -> Draft:
    """The `reward` frame of `handle`'s trajectory, ended without one."""
    frames = encode(PRODUCER_TO_BROKER, "reward", {"trajectory_id": handle.trajectory_id, "reward": _reward(reward),
                                                   **({} if job == DEFAULT_JOB else {"job": job})}, numbered=False)
    return Draft(REWARD, handle, handle.next_turn, lambda _: frames)


def _prompt_array(prompt_tokens, vocab_size: int | None):
    """The prompt as a read-only int32 array (the caller's own when it is one),
    checked against the vocabulary."""
    prompt = owned(as_int_array(prompt_tokens, TOKEN_DTYPE, "prompt_tokens"), prompt_tokens, borrow=True)
    empty = prompt[:0]
    check_message_arrays({"tokens": empty, "log_probs": empty.astype("<f4"), "prompt_tokens": prompt},
                         vocab_size=vocab_size)
    return prompt


_PUMP_NOW, _PUMP_SOON = 1, 2  # what an acceptance asks of the loop: take the intake at once, or when it next runs


class _Intake:
    """What senders on other threads share with the producer's loop: one
    lock around the session's *shared* calls (acceptance, filling the
    window, settlement, a ping's seq), the room blocking senders wait for,
    whether the loop is already due to take what was accepted, and whether
    the producer is closing or its loop died."""

    def __init__(self, session: ProducerSession, producer_id: str):
        self.session = session
        self.producer_id = producer_id
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)  # blocking senders wait here for room
        self.blocked = 0  # how many wait there
        self.pump_due = False  # the loop is due to take the intake
        self.closing = False
        self.failure: BaseException | None = None  # why the I/O loop died, if it did

    def check_alive(self) -> None:
        if self.failure is not None:
            raise ClientFailed(f"producer {self.producer_id!r}", self.failure) from self.failure

    def accept(self, draft: Draft, future: Any, burst: int) -> int:
        """Accept `draft`, for which the caller saw room. Returns `_PUMP_NOW`
        once `burst` frames wait, `_PUMP_SOON` when the loop must be asked to
        take it, 0 when it is already due to."""
        with self.lock:
            self._accept(draft, future)
            if len(self.session.intake) >= burst:
                return _PUMP_NOW
            if self.pump_due:
                return 0
            self.pump_due = True
            return _PUMP_SOON

    def accept_when_room(self, draft: Draft, future: Any, timeout: float | None) -> bool:
        """From another thread: wait up to `timeout` for room (then `TimedOut`)
        and accept `draft`. True when the loop must be woken to take it."""
        session = self.session
        size = session.spool_bytes(draft)
        deadline = None if timeout is None else Clock.monotonic() + timeout
        with self.room:
            while not (self.closing or self.failure is not None or session.has_room(size)):
                remaining = None if deadline is None else deadline - Clock.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimedOut(f"no room for a frame within {timeout} s ({session.in_memory} frames unsettled)")
                self.blocked += 1
                try:
                    self.room.wait(remaining)
                finally:
                    self.blocked -= 1
            self._accept(draft, future)
            wake = not self.pump_due
            self.pump_due = True
        return wake

    def _accept(self, draft: Draft, future: Any) -> None:
        """Under the lock. Raises `ClientFailed` once the I/O loop died
        (nothing would send it), `ProducerClosed` while closing."""
        if self.failure is not None or self.closing:
            self.check_alive()
            raise ProducerClosed(f"producer {self.producer_id!r} is closing; no new frames")
        self.session.accept(draft, future, Clock.monotonic())

    def fill_window(self) -> None:
        with self.lock:
            self.pump_due = False
            self.session.fill_window()

    def settle(self, settled: list[Settled], now: float) -> None:
        """Frames left the window: the session frees their room and rewinds a
        refused turn's handle, blocking senders look for room again, and the
        futures resolve, outside the lock (a blocking future runs its
        callbacks right there)."""
        with self.lock:
            resolved = self.session.settle(settled, now)
            if self.blocked:
                self.room.notify_all()
        for future, outcome in resolved:
            if not future.done():
                if isinstance(outcome, Refused):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

    def ping(self) -> list:
        with self.lock:  # a ping takes the next seq, as senders do
            return self.session.ping()

    def query(self, kind: str, fields: dict) -> tuple[int, list]:
        with self.lock:  # a query takes the next seq, as senders do
            return self.session.query(kind, fields)

    def wake(self) -> None:
        """Room may have appeared: blocking senders look again."""
        with self.lock:
            if self.blocked:
                self.room.notify_all()

    def failed(self, error: BaseException) -> None:
        """The I/O loop died: nothing would send or settle again, so senders raise `ClientFailed`."""
        self.failure = error
        self.wake()

    def close(self) -> None:
        with self.lock:
            self.closing = True
            self.room.notify_all()

    def abandon(self, why: str) -> int:
        """Fail every unsettled frame's future with `ProducerClosed(why)`; how many there were."""
        with self.lock:
            futures = self.session.abandon()
            for future in futures:
                if future is not None and not future.done():
                    future.set_exception(ProducerClosed(why))
        return len(futures)


class AsyncProducer:
    """An asyncio producer connected to one broker endpoint.

    Use as `async with AsyncProducer(endpoint, producer_id) as producer:`;
    open trajectories with `producer.trajectory(...)`.
    """

    _loop: asyncio.AbstractEventLoop  # the one `start` ran in, which runs the I/O from then on
    _task: asyncio.Task  # the one background task: what time brings (`_tick`)

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
        job: str = DEFAULT_JOB,
    ):
        if not producer_id:
            raise InvalidInput("producer_id must be a non-empty string")
        self.endpoint = endpoint
        self.producer_id = producer_id
        self.vocab_size = vocab_size
        self.crc = crc
        self.check_content = check_content
        self.batch_acks = batch_acks
        self.batch_frames = batch_frames
        self.send_burst = send_burst
        self.pack_arrays = pack_arrays
        self.metrics = ProducerMetrics()
        self._send_buffer = SendBuffer()  # every batch's body, written again for the next
        self._session = ProducerSession(  # checks the settings before any file is opened
            producer_id, endpoint, metrics=self.metrics, now=Clock.monotonic(), window=window,
            reply_timeout=reply_timeout, retry_delay=retry_delay, heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout, batch_acks=batch_acks, batch_frames=batch_frames, send_burst=send_burst,
            job=job)
        self.job = job  # every frame names it unless it is the default job
        # What was sent and acked, for the end-to-end checker (`rollstream.common.checker`):
        self.ledger = self._session.ledger = None if ledger is None else Ledger(ledger)
        self._spool_options = (spool_dir, spool_bytes, spool_fsync)
        self._hwm = high_water_mark
        self._curve = ClientCurve.from_files(curve_secret_key, curve_server_key)  # None: plain ZeroMQ
        self._handshakes = HandshakeReport(endpoint, self._curve)
        self._context = context or zmq.Context.instance()
        self._intake = _Intake(self._session, producer_id)  # what senders on other threads share with the loop
        # The loop's own:
        self._changed = asyncio.Event()  # set whenever frames settle, the window grows or admission changes
        self._read_scheduled = False
        self._tick_seconds = min(0.25, max(0.01, min(heartbeat_interval, reply_timeout, retry_delay or 1.0) / 4))
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._started = False

    # -- life cycle -------------------------------------------------------------
    async def start(self) -> "AsyncProducer":
        """Open the spool (resending what it holds), connect, say hello."""
        if self._started:
            return self
        session = self._session
        spool_dir, spool_bytes, spool_fsync = self._spool_options
        if spool_dir is not None:
            session.use_spool(Spool(spool_dir, self.producer_id, max_bytes=spool_bytes, fsync=spool_fsync))
        self._loop = asyncio.get_running_loop()
        session.heartbeat.heard(Clock.monotonic())  # presumed alive from the start
        sock = tune(zmq.Socket(self._context, zmq.DEALER), high_water_mark=self._hwm,
                    heartbeat_interval=session.heartbeat.interval, linger_ms=0)
        if self._curve is not None:
            self._curve.apply(sock)
        self._monitor = monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        sock.connect(self.endpoint)
        self._sock = sock
        self._send_now(session.hello())
        self._loop.add_reader(sock.fileno(), self._on_readable)
        self._loop.add_reader(monitor.fileno(), self._on_monitor)
        self._on_monitor()  # the descriptors signal edges: whatever came before the readers were added is read now
        self._task = asyncio.create_task(self._tick())
        self._task.add_done_callback(self._task_done)
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
        return self._session.unsettled

    @property
    def held(self) -> int:
        """Frames held in memory (never more than the window)."""
        return self._session.in_memory

    @property
    def admission(self) -> int | None:
        """New trajectories the broker last said it has room for (its staleness capacity); None: no limit named."""
        return self._session.admit

    @property
    def branch(self) -> tuple[int, int] | None:
        """The trainer's branch, (epoch, step), once it resumed from its
        checkpoint of `step`, starting lineage `epoch`: serve those weights
        (labelled `e{epoch}:{step}`, or as the trainer labels them); None:
        no resume."""
        return self._session.branch

    @property
    def lineage(self) -> tuple[int, int] | None:
        """The older name of `branch`, kept for callers written before it."""
        return self.branch

    @property
    def window(self) -> int:
        """Frames it may have unsettled now: its `window` setting or less, as
        the broker grants (`session.BEFORE_WELCOME_WINDOW` until the welcome)."""
        return self._session.window.limit

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted frame is settled; False on timeout."""
        try:
            async with asyncio.timeout(timeout):
                await self._until(lambda: self.unsettled == 0)
        except TimeoutError:
            return False
        return True

    async def open_trajectories(self, timeout: float | None = None) -> list[Resumable] | None:
        """The trajectories this producer (its id, in its job, under CURVE
        over its key) has open at the broker, to continue after a restart;
        None when the broker does not hand them back. Ask once the spool's
        resends have settled (`flush`), so that what is listed is all the
        broker holds. Raises `TimedOut` after `timeout`."""
        async with asyncio.timeout(timeout):
            await self._until(lambda: self._session.lists_open is not None)  # the welcome came
            if not self._session.lists_open:
                return None
            reply = await self._ask("list_open", {})
        return [Resumable.from_wire(entry) for entry in reply["trajectories"]]

    async def read_prefix(self, trajectory_id: str, timeout: float | None = None) -> Prefix:
        """One of `open_trajectories`' content so far, as the broker merged
        it. Raises `Refused` (`unknown_trajectory`: not open there for this
        producer) or `TimedOut` after `timeout`."""
        async with asyncio.timeout(timeout):
            reply = await self._ask("read_open", {"trajectory_id": trajectory_id})
        if reply.type == "nack":
            raise Refused(reply["code"], reply["message"], kind="read_open", trajectory_id=trajectory_id, seq=reply["seq"])
        return Prefix.from_message(reply)

    async def _ask(self, kind: str, fields: dict):
        """Send a query and wait for the reply that answers it (sent again
        after a reconnect, with the resends)."""
        seq, frames = self._intake.query(kind, fields)
        self._send_now(frames)
        answers = self._session.answers
        try:
            await self._until(lambda: seq in answers)
        finally:
            self._session.queries.pop(seq, None)
        return answers.pop(seq)

    def resume(self, resumable: Resumable, prompt_tokens, *, earlier: Sequence[Turn] = (),
               metadata: Mapping[str, Any] | None = None) -> "AsyncTrajectoryHandle":
        """A handle continuing a trajectory the broker handed back: its next
        turn goes under `resumable.next_turn`. `earlier`: the turns it holds
        (`Prefix.turns`, or as the source produces them again), recorded in
        the ledger as sent, so the `end`'s record covers the whole trajectory."""
        return _taken_up(AsyncTrajectoryHandle, self, resumable, prompt_tokens, earlier, metadata)

    async def admitted(self, timeout: float | None = None) -> bool:
        """Wait until the broker admits one more new trajectory (its
        staleness capacity has room; at once when it sets none) and take
        it: call before generating a trajectory, so nothing is sampled only
        to wait at the broker with ever older weights. False on timeout."""
        session = self._session
        try:
            async with asyncio.timeout(timeout):
                await self._until(lambda: session.admit is None or session.admit > 0)
        except TimeoutError:
            return False
        if session.admit is not None:  # until the broker's next answer says again
            session.admit -= 1
        return True

    async def _until(self, condition) -> None:
        while not condition():
            self._intake.check_alive()
            self._changed.clear()
            await self._changed.wait()

    def _task_done(self, task: asyncio.Task) -> None:
        """The tick task ended by an error: nothing would ever settle again,
        so fail the waiters instead of hanging them."""
        error = None if task.cancelled() else task.exception()
        if error is not None:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        log.error(f"producer I/O loop failed: {self.producer_id}: {error!r}", exc_info=error)
        self._intake.failed(error)
        self._changed.set()

    async def close(self, timeout: float | None = 10.0) -> int:
        """Stop accepting frames, wait up to `timeout` for the rest to settle,
        then disconnect. Returns how many frames were left unsettled (kept in
        the spool if there is one; their futures raise `ProducerClosed`)."""
        if not self._started or self._intake.closing:
            return 0
        self._intake.close()
        self._changed.set()
        try:
            await self.flush(timeout)
        except ClientFailed:  # the I/O loop failed: nothing more will settle
            pass
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        session = self._session
        where = "left in the spool" if session.spool else "dropped"
        left = self._intake.abandon(f"producer {self.producer_id!r} closed before the broker acked this frame ({where})")
        sock, monitor = self._sock, self._monitor
        if sock is None or monitor is None:
            raise InternalError("start opened the socket and its monitor; only close closes them")
        self._loop.remove_reader(sock.fileno())
        self._loop.remove_reader(monitor.fileno())
        # Stop the events first: libzmq's I/O thread sends them blocking, so an
        # event for a closed monitor (the disconnect that closing the socket
        # causes) would stall that thread, and every socket of the context.
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        self._sock = None
        if session.spool is not None:
            session.spool.close()
        if self.ledger is not None:
            self.ledger.close()
        log.info(f"producer stopped: {self.producer_id}, {left} frames unsettled ({where}), "
                 f"{session.window.resends} resends",
                 extra={"producer_id": self.producer_id, "unsettled": left, "resends": session.window.resends})
        return left

    # -- sending ----------------------------------------------------------------
    def trajectory(self, trajectory_id: str, prompt_tokens, *, group_id: str | None = None,
                   group_size: int | None = None, sample_index: int | None = None,
                   metadata: Mapping[str, Any] | None = None) -> "AsyncTrajectoryHandle":
        """A handle that sends this trajectory's turns in order."""
        return AsyncTrajectoryHandle(self, trajectory_id, prompt_tokens, group_id=group_id, group_size=group_size,
                                     sample_index=sample_index, metadata=metadata)

    async def reward(self, trajectory_id: str, reward) -> asyncio.Future:
        """The reward of a trajectory another producer ended without one
        (this producer a reward service): sent by trajectory id, in this
        producer's job. Refused `out_of_order` while its end has not arrived."""
        return await self.submit(reward_draft(_ById(trajectory_id), reward, self.job))

    async def send_trajectory(self, trajectory_id: str, prompt_tokens, turns: Sequence[Turn], reward, *,
                              metadata: Mapping[str, Any] | None = None, halts: bool = False,
                              **identity) -> list[asyncio.Future]:
        """Send a whole trajectory: every turn, then `end(reward)`. Returns the
        futures of all its frames (turns first, then the end). With `halts`,
        on a handle that halts: a refusal gives the trajectory up, and a call
        after it raises `Halted` (the futures of the frames before it left
        to the give-up, which logs and counts the refusal)."""
        traj = self.trajectory(trajectory_id, prompt_tokens, metadata=metadata, **identity)
        traj.halts = halts
        futures: list[asyncio.Future] = []
        try:
            for turn in turns:
                futures.append(await traj.send(turn))
            futures.append(await traj.end(reward))
        except Halted:
            for future in futures:  # nobody awaits them now: their outcome is the give-up's
                retrieve(future)
            raise
        return futures

    # The handles' way in (applications call the handles): a draft is accepted
    # (numbered, kept until settled) once there is room, and its future returned.
    def try_submit(self, draft: Draft) -> asyncio.Future | None:
        """On the loop: accept `draft` if there is room right away (no await,
        so nothing can come between the check and the acceptance); None when
        it must wait for room. It goes out with the others accepted since: at
        once when `send_burst` of them wait, else when the loop next runs (a
        caller that sends several turns without yielding pays for one
        hand-over to the socket per burst, and the broker still gets frames
        as they come)."""
        if not self._started:
            raise InvalidState("start the producer first (await producer.start() or use `async with`)")
        intake, session = self._intake, self._session
        size = session.spool_bytes(draft)
        if not (intake.closing or session.has_room(size)):
            return None
        future = self._loop.create_future()
        pump = intake.accept(draft, future, self.send_burst)
        if pump == _PUMP_NOW:
            self._pump()
        elif pump == _PUMP_SOON:
            self._loop.call_soon(self._pump)
        return future

    async def submit(self, draft: Draft) -> asyncio.Future:
        """On the loop: wait for room, then accept `draft`; its future."""
        future = self.try_submit(draft)
        while future is None:
            size = self._session.spool_bytes(draft)
            await self._until(lambda: self._intake.closing or self._session.has_room(size))
            future = self.try_submit(draft)
        return future

    def submit_blocking(self, draft: Draft, timeout: float | None = None) -> concurrent.futures.Future:
        """From another thread: wait up to `timeout` for room (then `TimedOut`),
        accept `draft`, and wake the loop if it is not already due to take
        the intake. No round trip to the loop."""
        if not self._started:
            raise InvalidState("start the producer first (Producer starts it)")
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._intake.accept_when_room(draft, future, timeout):
            self._loop.call_soon_threadsafe(self._pump)
        return future

    def _send_now(self, frames: list) -> bool:
        """Hand frames to the socket without waiting; False if its queue is
        full. Large arrays go zero-copy (the session keeps them until
        settled); a batch's body is copied out of `_send_buffer`, which the
        next batch writes again."""
        if self._sock is None:
            raise InternalError("frames are sent only between start and close")
        batched = self._send_buffer.holds(frames[-1])
        try:
            send_frames(self._sock, frames, zero_copy_above=None if batched else _ZERO_COPY_ABOVE)
        except zmq.Again:
            return False
        return True

    def _pump(self, *, look_again: bool = True) -> None:
        """Take accepted frames into the window, transmit what may go now, and
        (unless the caller reads replies right after) look for replies once
        the loop runs next. Runs on the loop."""
        if self._sock is None:  # closed
            return
        self._intake.fill_window()
        self._session.transmit(Clock.monotonic(), self._send_now, self._send_buffer.take)
        if look_again:
            self._read_soon()

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
                    self._on_message(recv_parts(sock))
                self._pump(look_again=False)
                sock = self._sock
        except Exception as exc:  # nothing would settle again: fail loudly rather than hang
            self._fail(exc)

    def _on_message(self, frames: list) -> None:
        now = Clock.monotonic()
        session = self._session
        try:
            reply = decode(frames, BROKER_TO_PRODUCER)
        except ProtocolError as error:
            session.undecodable(error)
            return
        except Exception as exc:  # a failure no rule foresaw: this reply is dropped, its frame resent on timeout
            self._failed_inside(exc, None, frames)
            return
        limit, admit = session.window.limit, session.admit
        try:
            settled = session.received(reply, now)
        except RollstreamError:  # a rule this producer enforces on purpose: it fails loudly
            raise
        except Exception as exc:
            self._failed_inside(exc, reply.type, frames)
            return
        if settled:
            self._intake.settle(settled, now)
            self._changed.set()
        elif reply.type in ("welcome", "open_list", "open_trajectory", "nack"):  # `open_trajectories` waiters look again
            self._changed.set()
        elif session.window.limit > limit:  # a larger grant: senders waiting for room look again
            self._intake.wake()
            self._changed.set()
        elif session.admit != admit:  # `admitted` waiters look again
            self._changed.set()

    def _failed_inside(self, exc: Exception, reply_type: str | None, frames: list) -> None:
        """Handling one reply raised what no rule foresaw: counted and logged
        once; nothing it answered is settled, so its frames time out and go
        again, and the loop keeps reading."""
        self.metrics.internal_errors.add(1)
        log_internal(log, exc, self.endpoint, reply_type, frames)

    # -- time and connection events -----------------------------------------------
    async def _tick(self) -> None:
        """Reply timeouts, pings, liveness and retry backoff, a few times per
        heartbeat interval."""
        session = self._session
        while True:
            now = Clock.monotonic()
            session.tick(now)
            if session.ping_due(now):
                if self._send_now(self._intake.ping()):
                    session.pinged(now)
            self._pump()
            self._on_monitor()  # a missed edge costs at most a tick
            session.refresh_gauges()
            await asyncio.sleep(self._tick_seconds)

    def _on_monitor(self) -> None:
        """Connection events: after a reconnect the session resends what was
        in flight, in order, behind a fresh hello."""
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
            hello = self._session.connected()
            if hello is not None:
                self._send_now(hello)
                for frames in list(self._session.queries.values()):  # their answers may be lost with the connection
                    self._send_now(frames)
                self._pump()


class _TrajectoryHandle:
    """What both handles share: the trajectory's identity, the index its next
    turn goes under, and the drafts its calls become. `next_turn` counts
    from 0; the producer's session advances it as each frame is accepted,
    sets it to 0 after an `abort` (a retry), and moves it back to a refused
    turn's index (anything but `conflict`): send the corrected turn next.

    A handle that `halts` (set it before its first call; the daemon's
    sources run on such handles) is for a caller that sends its turns
    without waiting for their receipts: a turn it sends after a refusal it
    has not looked at would otherwise go under the refused turn's index,
    and the broker would hold a trajectory other than the one it sent. At
    the first refusal of one of its turns or of its end the producer gives
    the trajectory up instead: it aborts it (the reason names the refusal),
    records it `given_up` in the ledger, logs and counts it
    (`given_up_total{code}`), and every later call raises `Halted`."""

    def __init__(self, producer: AsyncProducer, trajectory_id: str, prompt_tokens, *, group_id: str | None,
                 group_size: int | None, sample_index: int | None, metadata: Mapping[str, Any] | None):
        if (group_id is None) != (group_size is None):
            raise InvalidInput(f"group_id and group_size travel together, got group_id={group_id!r}, "
                               f"group_size={group_size!r}")
        self.producer = producer  # the asyncio producer that sends the frames
        self.trajectory_id = trajectory_id
        self.prompt_tokens = _prompt_array(prompt_tokens, producer.vocab_size)
        self.group_id = group_id
        self.group_size = group_size
        self.sample_index = sample_index
        self.metadata = dict(metadata or {})
        check_values(PRODUCER_TO_BROKER, "turn", {"trajectory_id": trajectory_id, "group_id": group_id,
                                                  "group_size": group_size, "sample_index": sample_index})
        self.next_turn = 0
        self.digests = TrajectoryDigests(self.prompt_tokens)  # for the ledger, when the producer keeps one
        # Called once, just before its `end` or final `abort` is submitted (a daemon source's prompt cursor).
        self.finishing: Callable[[], None] | None = None
        self.halts = False
        self.halted: Refused | None = None  # the refusal that gave a halting handle's trajectory up

    def earlier(self, turns: Sequence[Turn]) -> None:
        """The turns of a resumed trajectory the broker already holds, as
        its source produced them again: recorded in the ledger as sent
        (see `AsyncProducer.resume`); nothing is sent."""
        if self.producer.ledger is not None:
            self.digests.earlier(list(turns), self.next_turn)

    def _finish(self) -> None:
        finishing, self.finishing = self.finishing, None
        if finishing is not None:
            finishing()

    def _turn_draft(self, turn: Turn, metadata: Mapping[str, Any] | None) -> Draft:
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
                job=self.producer.job if self.producer.job != DEFAULT_JOB else None,
                crc=self.producer.crc,
                checked=False,
                may_pack=self.producer.pack_arrays,
            )
        return Draft(TURN, self, self.next_turn, encode_at, (len(turn.tokens), int(turn.forced_tokens.size)), turn)

    def _end_draft(self, reward, metadata: Mapping[str, Any] | None) -> Draft:
        fields: dict[str, Any] = {"trajectory_id": self.trajectory_id, **self._job_field()}
        if reward is not None:  # None: the reward comes later (`reward`)
            fields["reward"] = _reward(reward)
        if metadata:
            fields["metadata"] = dict(metadata)

        def encode_at(turns: int) -> list:
            return encode(PRODUCER_TO_BROKER, "end", {**fields, "turns": turns}, numbered=False)
        return Draft(END, self, self.next_turn, encode_at)

    def _reward_draft(self, reward) -> Draft:
        return reward_draft(self, reward, self.producer.job)

    def abort_draft(self, reason: str, again: bool = False) -> Draft:
        """Its `abort` (without `again`, the final one: `finishing` is called)."""
        if not again:
            self._finish()
        frames = encode(PRODUCER_TO_BROKER, "abort", {"trajectory_id": self.trajectory_id, "reason": reason,
                                                      **({"again": True} if again else {}), **self._job_field()},
                        numbered=False)
        return Draft(ABORT, self, self.next_turn, lambda _: frames)

    def _job_field(self) -> dict[str, str]:
        job = self.producer.job
        return {} if job == DEFAULT_JOB else {"job": job}

    def _build(self, tokens, log_probs, options: dict) -> Turn:
        producer = self.producer
        return Turn.build(tokens, log_probs, vocab_size=producer.vocab_size, borrow=True,
                          check_content=producer.check_content, **options)

    def _sglang_turn(self, output_ids, meta_info, options: dict) -> Turn:
        return turn_from_sglang(output_ids, meta_info, vocab_size=self.producer.vocab_size, **options)


class AsyncTrajectoryHandle(_TrajectoryHandle):
    """Sends one trajectory's turns, end or abort, in order. Turn indices
    count from 0; after `abort` the next turn is turn 0 again (a retry).
    After a refused turn (anything but `conflict`) `next_turn` is that
    turn's index again: send the corrected turn next (a handle that
    `halts` gives its trajectory up instead)."""

    def __init__(self, producer: AsyncProducer, trajectory_id: str, prompt_tokens, *, group_id: str | None,
                 group_size: int | None, sample_index: int | None, metadata: Mapping[str, Any] | None):
        super().__init__(producer, trajectory_id, prompt_tokens, group_id=group_id, group_size=group_size,
                         sample_index=sample_index, metadata=metadata)
        self._lock = asyncio.Lock()

    async def _send(self, draft: Draft) -> asyncio.Future:
        """Accept at once when there is room and no earlier send of this
        handle waits for it; otherwise wait in call order."""
        if not self._lock.locked():
            future = self.producer.try_submit(draft)
            if future is not None:
                return future
        async with self._lock:
            return await self.producer.submit(draft)

    async def turn(self, tokens, log_probs, *, mask: SamplingMask | None = None, supports=None, mask_ids=None,
                   mask_offsets=None, loss_mask=None, forced_tokens=None, routed_experts=None, indexer_topk=None,
                   full_log_probs=None, mask_log_probs=None, mask_log_probs_normalized: bool = False,
                   status: str = "completed", weight_version: str | None = None,
                   metadata: Mapping[str, Any] | None = None) -> asyncio.Future:
        """Send the next turn: the sampled tokens with their log-probs and
        supports (`mask`, `mask_ids` + `mask_offsets` as CSR arrays, or
        `supports` as one id list per token), then the forced tokens the
        environment appended after them. `log_probs` are under the
        sampler's truncated distribution; `full_log_probs`, when the engine
        reports them, under the whole vocabulary's (a trajectory whose
        first turn carries them carries them on every turn: one without
        them is a replay gap). `mask_log_probs`, when the engine reports
        them, are the sampler's log-prob of every support id, one per id
        in the mask's order (a replay field too); with
        `mask_log_probs_normalized` each support's probabilities must sum
        to 1 (the broker checks it; with `check_content`, so does this call,
        before the turn is sent). Arrays of the contract
        dtypes are sent as they are (not copied): leave them unchanged
        until settled."""
        turn = self._build(tokens, log_probs, dict(
            mask=mask, supports=supports, mask_ids=mask_ids, mask_offsets=mask_offsets, loss_mask=loss_mask,
            forced_tokens=forced_tokens, routed_experts=routed_experts, indexer_topk=indexer_topk,
            full_log_probs=full_log_probs, mask_log_probs=mask_log_probs,
            mask_log_probs_normalized=mask_log_probs_normalized, status=status, weight_version=weight_version))
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

    async def end(self, reward=None, metadata: Mapping[str, Any] | None = None) -> asyncio.Future:
        """Finish the trajectory with its reward (a number or a map), or
        without one (`None`): the broker then holds it until `reward`
        brings it. The `end` says how many turns were sent, so the broker
        refuses it (`out_of_order`) rather than end the trajectory short of one."""
        self._finish()
        return await self._send(self._end_draft(reward, metadata))

    async def reward(self, reward) -> asyncio.Future:
        """The reward of a trajectory ended without one (a verifier or reward model was slower)."""
        return await self._send(self._reward_draft(reward))

    async def end_and_wait(self, reward, metadata: Mapping[str, Any] | None = None) -> Receipt:
        """`end`, then wait for the broker's receipt (raises `Refused`)."""
        return await (await self.end(reward, metadata))

    async def abort(self, reason: str = "", *, again: bool = False) -> asyncio.Future:
        """Discard the trajectory at the broker; the next turn starts it
        afresh. `again`: it will be produced again from turn 0 under the same
        id, and its group waits for it meanwhile."""
        return await self._send(self.abort_draft(reason, again))


H = TypeVar("H", bound=_TrajectoryHandle)


def _taken_up(kind: type[H], producer: AsyncProducer, resumable: Resumable, prompt_tokens, earlier: Sequence[Turn],
              metadata: Mapping[str, Any] | None) -> H:
    """A handle of `kind` going on with a trajectory its broker handed back,
    its earlier turns recorded in the ledger as sent."""
    handle = kind(producer, resumable.trajectory_id, prompt_tokens, group_id=resumable.group_id,
                  group_size=resumable.group_size, sample_index=resumable.sample_index, metadata=metadata)
    handle.next_turn = resumable.next_turn
    handle.earlier(earlier)
    return handle


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
    def branch(self) -> tuple[int, int] | None:
        """As `AsyncProducer.branch`."""
        return self._async.branch

    @property
    def lineage(self) -> tuple[int, int] | None:
        """The older name of `branch`, kept for callers written before it."""
        return self._async.branch

    @property
    def unsettled(self) -> int:
        return self._async.unsettled

    def trajectory(self, trajectory_id: str, prompt_tokens, *, group_id: str | None = None,
                   group_size: int | None = None, sample_index: int | None = None,
                   metadata: Mapping[str, Any] | None = None) -> "TrajectoryHandle":
        return TrajectoryHandle(self._async, trajectory_id, prompt_tokens, group_id=group_id, group_size=group_size,
                                sample_index=sample_index, metadata=metadata)

    def reward(self, trajectory_id: str, reward, *, timeout: float | None = None) -> concurrent.futures.Future:
        """`AsyncProducer.reward`: a reward by trajectory id, for a trajectory ended without one."""
        return self._async.submit_blocking(reward_draft(_ById(trajectory_id), reward, self._async.job), timeout)

    def send_trajectory(self, trajectory_id: str, prompt_tokens, turns: Sequence[Turn], reward, *,
                        metadata: Mapping[str, Any] | None = None, halts: bool = False,
                        **identity) -> list[concurrent.futures.Future]:
        """As `AsyncProducer.send_trajectory`."""
        traj = self.trajectory(trajectory_id, prompt_tokens, metadata=metadata, **identity)
        traj.halts = halts
        return [*(traj.send(turn) for turn in turns), traj.end(reward)]

    def flush(self, timeout: float | None = None) -> bool:
        return self._run(self._async.flush(timeout))

    def open_trajectories(self, timeout: float | None = None) -> list[Resumable] | None:
        """As `AsyncProducer.open_trajectories`."""
        return self._run(self._async.open_trajectories(timeout))

    def read_prefix(self, trajectory_id: str, timeout: float | None = None) -> Prefix:
        """As `AsyncProducer.read_prefix`."""
        return self._run(self._async.read_prefix(trajectory_id, timeout))

    def resume(self, resumable: Resumable, prompt_tokens, *, earlier: Sequence[Turn] = (),
               metadata: Mapping[str, Any] | None = None) -> "TrajectoryHandle":
        """As `AsyncProducer.resume`."""
        return _taken_up(TrajectoryHandle, self._async, resumable, prompt_tokens, earlier, metadata)

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


class TrajectoryHandle(_TrajectoryHandle):
    """Blocking twin of `AsyncTrajectoryHandle`: each call blocks for room (up to
    `timeout` seconds, then `TimedOut`, a `TimeoutError`) and returns a future
    of the broker's receipt. Use one handle from one thread at a time."""

    def turn(self, tokens, log_probs, *, metadata: Mapping[str, Any] | None = None, timeout: float | None = None,
             **options) -> concurrent.futures.Future:
        return self.send(self._build(tokens, log_probs, options), metadata=metadata, timeout=timeout)

    def turn_and_wait(self, tokens, log_probs, *, timeout: float | None = None, **options) -> Receipt:
        """`turn`, then wait up to `timeout` for the receipt (raises `Refused`)."""
        return self.turn(tokens, log_probs, timeout=timeout, **options).result(timeout)

    def sglang(self, output_ids, meta_info: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None,
               timeout: float | None = None, **options) -> concurrent.futures.Future:
        return self.send(self._sglang_turn(output_ids, meta_info, options), metadata=metadata, timeout=timeout)

    def send(self, turn: Turn, *, metadata: Mapping[str, Any] | None = None,
             timeout: float | None = None) -> concurrent.futures.Future:
        return self.producer.submit_blocking(self._turn_draft(turn, metadata), timeout)

    def end(self, reward=None, metadata: Mapping[str, Any] | None = None, *,
            timeout: float | None = None) -> concurrent.futures.Future:
        self._finish()
        return self.producer.submit_blocking(self._end_draft(reward, metadata), timeout)

    def reward(self, reward, *, timeout: float | None = None) -> concurrent.futures.Future:
        return self.producer.submit_blocking(self._reward_draft(reward), timeout)

    def end_and_wait(self, reward, metadata: Mapping[str, Any] | None = None, *,
                     timeout: float | None = None) -> Receipt:
        """`end`, then wait up to `timeout` for the receipt (raises `Refused`)."""
        return self.end(reward, metadata, timeout=timeout).result(timeout)

    def abort(self, reason: str = "", *, again: bool = False, timeout: float | None = None) -> concurrent.futures.Future:
        return self.producer.submit_blocking(self.abort_draft(reason, again), timeout)
