"""The consumer client: the I/O shell around `ConsumerCore`.

Every decision (what a broker's message means, what goes out, which units
make a batch, quarantine and refill, the commit's step, stale drops) is the
core's (consumer/core.py); this shell moves bytes, reads the time, waits,
and builds and checks each batch on the device. One background thread owns
every socket (a DEALER per broker plus an inproc wake-up pair) and runs one
poll loop: it decodes what arrived, hands it to the core with the time, and
sends what the core's `due` returns. The thread exists because heartbeats
must keep flowing while the trainer computes: a training step easily
outlasts three heartbeat intervals, after which the broker would call the
consumer dead and hand its leases to someone else. Polling inside `next()`
cannot do that. The thread never touches torch: the calling thread builds,
validates (on CUDA on a stream of its own, `UploadStream`) and returns
batches. Both threads call the core under one lock (`_lock`); which thread
calls which input is written at each input (`ConsumerCore`).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import zmq

from rollstream.common.checker import Ledger
from rollstream.common.clock import Clock
from rollstream.common.codec import decode, decode_header, encode
from rollstream.common.contract import DEFAULT_MAX_MESSAGE_BYTES
from rollstream.common.curve import ClientCurve, HandshakeWatch
from rollstream.common.errors import ClientFailed, InvalidInput, RemoteProtocolError, TimedOut
from rollstream.common.failures import internal_error, log_internal
from rollstream.common.jobs import DEFAULT_JOB
from rollstream.common.messages import BROKER_TO_CONSUMER, CONSUMER_TO_BROKER
from rollstream.common.sockets import context_for, dealer, recv_parts
from rollstream.common.versions import version_label

from .batch import Batch, as_device
from .core import ConsumerClosed, ConsumerCore, Form, HandOut, Wait
from .position import TrainingPosition
from .stream import UploadStream
from .validate import checked_batch

if TYPE_CHECKING:
    from .offline import ArchiveConsumer

__all__ = ["Consumer", "ConsumerClosed"]

log = logging.getLogger("rollstream.consumer")
MONITOR_SWEEP_EVERY = 1.0  # seconds between reads of the handshake monitors once every broker has welcomed us


class Consumer:
    """Pulls batches from one or many brokers (fan-in), validates them, and
    acks what the trainer commits.

    >>> with Consumer(["tcp://node0:5556", "tcp://node1:5556"], batch_size=64, vocab_size=151936) as consumer:
    ...     for batch in consumer:
    ...         train_step(batch)
    ...         consumer.commit(batch)

    `unit="group"` makes batches of `batch_size` whole groups (and grants
    group credit); `prefetch` bounds the units buffered or promised by credit
    (by default `max(2 * batch_size, batch_size + brokers)`; as low as
    `batch_size + 1` when every broker sends queued counts, as this
    version's do).
    `batch_tokens` closes a batch before the unit that would take it past
    that many prompt + response tokens (units are never split; one over the
    budget comes alone, `Batch.over_budget`); with `batch_size` too, at
    whichever limit comes first. Alone, it caps batches at
    `min(batch_tokens, TOKEN_BATCH_UNITS)` (256) units, which also sizes the
    prefetch.
    `on_invalid="quarantine"` sends failing trajectories to the broker's dead
    letters with the reason and refills the batch; `"raise"` gives the whole
    batch back for redelivery and raises `BatchValidationError`.
    A batch not committed within the brokers' `lease_timeout` of its delivery
    is redelivered (at-least-once), so the lease timeout must cover the wait
    in the prefetch buffer plus a training step; redeliveries are
    deduplicated by trajectory id (the last `dedup_capacity` settled ids are
    remembered, and a late redelivery of one is settled at once). Units whose
    leases ran out while still buffered are dropped, not trained.

    `filter`: a predicate only the trainer can judge, called once per unit
    as it completes with its members' `deliver` fields (`trajectory_id`,
    `reward`, `metadata`, `response_length`, `weight_versions`, ...); a unit
    it returns False for is dead-lettered `filtered:consumer` at its broker
    and never handed out (`stats()["filtered"]`). The brokers' own group
    filters run before delivery and cost no transfer.

    Staleness: `set_policy_version(v)` (or `commit(..., policy_version=v)`)
    publishes the trainer's version to every broker; with a bound (this
    consumer's `max_staleness`, or a broker's) brokers admit and deliver
    only what fits it, and a prefetched unit more than the bound behind `v`
    when a batch is formed is dead-lettered `stale`, not handed out
    (docs/consumer.md, "Staleness").

    Checkpointing (the default): `commit(batch)` records the batch as
    trained at its step, and brokers keep it until `sealed(step)` says a
    checkpoint after it is durable. Save `state_dict()` with each
    checkpoint; `Consumer(..., resume=state)` then hands back first what was
    trained after that checkpoint, batch by batch, then new data
    (docs/consumer.md). `checkpointed=False` deletes on commit instead:
    at-least-once across trainer restarts.

    `world_size`: the data-parallel ranks its batches are sharded to,
    recorded in `state_dict()`. Leave it out: a `DistributedConsumer` over
    this consumer sets its group's size (`shard_over`), and a consumer
    used alone is 1.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        batch_size: int | None = None,
        batch_tokens: int | None = None,
        unit: str = "trajectory",
        prefetch: int | None = None,
        device=None,
        vocab_size: int | None = None,
        on_invalid: str = "raise",
        reward_key: str | None = None,
        consumer_id: str | None = None,
        dedup_capacity: int = 100_000,
        hello_timeout: float = 5.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        ledger: str | os.PathLike | None = None,
        curve_secret_key: str | os.PathLike | None = None,
        curve_server_key: str | os.PathLike | None = None,
        context: zmq.Context | None = None,
        checkpointed: bool = True,
        keep_checkpoints: int = 2,
        resume: dict | None = None,
        world_size: int | None = None,
        job: str = DEFAULT_JOB,
        max_staleness: int | None = None,
        filter: Callable[[list[Mapping[str, Any]]], bool] | None = None,
    ):
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.endpoints:
            raise InvalidInput(f"give at least one broker endpoint, got {endpoints!r}")
        self.consumer_id = consumer_id or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self._core = ConsumerCore(self.endpoints, consumer_id=self.consumer_id, batch_size=batch_size,
                                  batch_tokens=batch_tokens, unit=unit, prefetch=prefetch, on_invalid=on_invalid,
                                  dedup_capacity=dedup_capacity, hello_timeout=hello_timeout, checkpointed=checkpointed,
                                  keep_checkpoints=keep_checkpoints, resume=resume, world_size=world_size, job=job,
                                  max_staleness=max_staleness, keep=filter)
        self.job = self._core.job
        self.batch_size = self._core.batch_size  # given, or the unit cap of a `batch_tokens` batch
        self.batch_tokens = self._core.batch_tokens
        self.on_invalid = self._core.on_invalid
        self.device = as_device(device)
        self._upload = UploadStream(self.device)  # batches are built and checked beside the trainer's step
        self.vocab_size = vocab_size
        self.reward_key = reward_key
        self.max_message_bytes = max_message_bytes
        # Over CURVE: this consumer's key pair and the brokers' public key (brokers of one job share it).
        self._curve = ClientCurve.from_files(curve_secret_key, curve_server_key)
        # What the trainer was handed and committed, for the end-to-end checker (`rollstream.common.checker`):
        self.ledger = None if ledger is None else Ledger(ledger)
        if self.ledger is not None and self.resumed_from is not None:
            self.ledger.write("resumed", **self.position.resume_record)
        self._lock = threading.Lock()  # every call into the core holds it
        self._changed = threading.Condition(self._lock)
        # A DEALER and a handshake monitor's pair per broker, and the wake-up pair: past zmq's default limit at a
        # few hundred brokers, when the consumer makes a context of its own.
        sockets = 3 * len(self.endpoints) + 2
        self._context, self._own_context = ((context, False) if context is not None
                                            else context_for(sockets, descriptors=2 * sockets + 64))
        self._stopping = False
        self._error: BaseException | None = None
        wake_address = f"inproc://rollstream-consumer-{id(self)}-{os.urandom(4).hex()}"
        self._wake_in = self._context.socket(zmq.PAIR)
        self._wake_in.bind(wake_address)
        self._wake_out = self._context.socket(zmq.PAIR)
        self._wake_out.connect(wake_address)
        # Each broker socket's handshakes (made by the I/O thread): a refused one is logged and named by
        # `wait_welcomed`, not left to look like a silent broker.
        self._watches: list[HandshakeWatch] = []
        self._thread = threading.Thread(target=self._run, name=f"rollstream-consumer-{self.consumer_id}", daemon=True)
        self._thread.start()

    @classmethod
    def from_archive(cls, path: str | os.PathLike, *, job: str = DEFAULT_JOB, run: str | None = None,
                     steps: Sequence[int] | None = None, order: str = "as_trained", seed: int | None = None,
                     batch_size: int | None = None, **options) -> "ArchiveConsumer":
        """A consumer that hands out a run's trained batches again from a
        dataset `rollstream export` wrote (of a broker's archive, or of its
        data directory), with this class's validation, commits,
        `state_dict` and resume, over no socket (consumer/offline.py):
        `order="as_trained"` gives the recorded batches step by step, each
        as the live run's trainer got it; `"shuffled"` deals the selected
        trajectories (groups whole) into batches of `batch_size` in an order
        `seed` fixes, each once. `run` names the run when the dataset holds
        several, `steps` an inclusive range of its steps. `options`: this
        class's (`device`, `vocab_size`, `ledger`, `resume`, `world_size`,
        `unit`, ...). Iteration ends after the last batch."""
        from .offline import from_archive

        return from_archive(path, job=job, run=run, steps=steps, order=order, seed=seed, batch_size=batch_size,
                            **options)

    # -- the trainer's side ---------------------------------------------------
    def __iter__(self) -> "Consumer":
        return self

    def __next__(self) -> Batch:
        try:
            return self.next_batch()
        except ConsumerClosed:
            raise StopIteration from None

    def __enter__(self) -> "Consumer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def next_batch(self, timeout: float | None = None, *, partial_after: float | None = None) -> Batch:
        """The next validated batch; blocks up to `timeout` seconds
        (`TimedOut`, a `TimeoutError`), raises `ConsumerClosed` once closed. With
        `partial_after`, a batch of the units complete once that many seconds
        passed without a full batch (the tail of a run): smaller, never empty."""
        now = Clock.monotonic()
        deadline = None if timeout is None else now + timeout
        partial_at = None if partial_after is None else now + partial_after
        try:
            while True:
                form = self._take(deadline, partial_at)
                with self._upload.side():  # built and checked on the consumer's upload stream
                    batch, violations, _ = checked_batch(form.deliveries, device=self.device, seq=form.seq,
                                                         vocab_size=self.vocab_size, reward_key=self.reward_key)
                with self._lock:
                    if isinstance(self._core.formed(violations), HandOut):
                        break
                    self._wake()  # quarantined (`Refill`): their nacks go out
        except BaseException:  # nothing stays taken without a batch to commit
            with self._lock:
                self._core.abandon()
                self._wake()
            raise
        batch = self._upload.hand_over(batch)
        if self.batch_tokens is not None:  # the budget `Batch.over_budget` compares with
            batch = replace(batch, token_budget=self.batch_tokens)
        if self.ledger is not None:
            batch.record(self.ledger, "handed", consumer=self.consumer_id)
        return batch

    def _take(self, deadline: float | None, partial_at: float | None) -> Form:
        """Wait until the core hands out deliveries to form a batch of."""
        with self._changed:
            while True:
                if self._error is not None:
                    raise ClientFailed(f"consumer {self.consumer_id!r}", self._error) from self._error
                now = Clock.monotonic()
                answer = self._core.take(now, deadline=deadline, partial_at=partial_at)
                if self._core.pending:  # the settlements of units dropped expired or stale
                    self._wake()
                if not isinstance(answer, Wait):
                    return answer
                self._changed.wait(1.0 if answer.until is None else min(answer.until - now, 1.0))

    def set_policy_version(self, version: int) -> None:
        """The trainer's policy version now (its step, as the weights it
        serves carry it): published to every broker, with this consumer's
        `max_staleness` and a step's size, so they bound staleness at
        admission and delivery; batches handed out from now on hold nothing
        more than the bound behind it."""
        with self._lock:
            self._core.publish(version)
            self._wake()

    def version_label(self, step: int) -> str:
        """The `weight_version` to serve the weights this trainer made at
        `step` under: `12`, or after a resume `e1:12`, which names the
        lineage epoch so brokers tell them from what weights of an abandoned
        lineage sampled (docs/consumer.md, "Lineage")."""
        return version_label(step, self._core.epoch)

    def commit(self, batch: Batch, step: int | None = None, *, policy_version: int | None = None) -> None:
        """After the training step: the batch is trained. Checkpointing, it
        is recorded as the batch of `step` (by default the step after the
        last; a batch handed back by a resume keeps its own) and kept until
        sealed; otherwise it is deleted. `policy_version`: then
        `set_policy_version` (the weights the step made)."""
        if self.ledger is not None:  # its record precedes the acks
            with self._lock:
                step = self._core.commit_step(batch.seq, step)
            position = self._core.position
            lineage = {} if position is None else {"run": position.run, "lineage": position.lineage, "step": step}
            batch.record(self.ledger, "committed", consumer=self.consumer_id, **lineage)
        with self._lock:
            self._core.commit(batch.seq, step)
            self._wake()
        if policy_version is not None:
            self.set_policy_version(policy_version)

    def step_of(self, batch: Batch) -> int | None:
        """The step a commit of `batch` would record now: a batch handed
        back by a resume (or an offline replay) keeps its own, a new one is
        the next; None when commits delete."""
        with self._lock:
            return self._core.commit_step(batch.seq)

    def sealed(self, step: int) -> None:
        """The checkpoint saved after step `step` is durable: brokers may
        reclaim what was trained up to it (keeping `keep_checkpoints`
        checkpoints to fall back on). `flush` waits for their answers."""
        with self._lock:
            self._core.seal(step)
            self._wake()
        if self.ledger is not None:
            self.ledger.write("sealed", run=self.position.run, lineage=self.position.lineage, step=step)

    def state_dict(self) -> dict:
        """The data position to save with the model's checkpoint: plain
        lists, numbers and strings (`Consumer(..., resume=state)`)."""
        with self._lock:
            return self._core.state_dict()

    def shard_over(self, world_size: int) -> None:
        """The size of the data-parallel group a `DistributedConsumer`
        shards this consumer's batches over, which `state_dict()` records.
        Refused when the constructor's `world_size`, or an earlier group, set
        another."""
        with self._lock:
            self._core.shard_over(world_size)

    @property
    def world_size(self) -> int:
        """The data-parallel ranks its batches are sharded to (`shard_over`)."""
        return self._core.world_size

    @property
    def checkpointed(self) -> bool:
        """Whether commits record batches as trained until sealed (else they delete)."""
        return self._core.checkpointed

    @property
    def position(self) -> TrainingPosition:
        """Where this checkpointing consumer stands: run, lineage, last step."""
        return self._core.require_position("position")

    @property
    def resumed_from(self) -> int | None:
        """The step of the checkpoint this consumer resumed from, if any."""
        return self._core.resumed_from

    def release(self, batch: Batch) -> None:
        """Give an uncommitted batch back for redelivery: it will not be
        trained on (a batch handed back by a resume is the next one again)."""
        with self._lock:
            self._core.release(batch.seq)
            self._wake()

    def stats(self) -> dict[str, int]:
        """The client's counters (the `Assembler`'s `stats`, listed in
        docs/consumer.md) and, at the moment of the call, `complete` units
        buffered (also as `ready`, their older name, for one version), `held` by the trainer and `unsettled` settlements
        awaiting their broker's answer."""
        with self._lock:
            return self._core.stats()

    def wait_welcomed(self, timeout: float | None = None) -> None:
        """Block until every broker has welcomed this consumer (credit is
        then on its way); `TimedOut` (a `TimeoutError`) naming those still
        silent."""
        def describe() -> str:
            silent = self._core.silent_brokers
            failures = [watch.failure for i, watch in enumerate(self._watches) if i in silent and watch.failure]
            return (f"no welcome within {timeout} s from {[self.endpoints[i] for i in silent]}"
                    + "".join(f"; {failure}" for failure in failures))

        self._wait_until(lambda: not self._core.silent_brokers, timeout, describe)

    def wait_ready(self, timeout: float | None = None) -> None:
        """The older name of `wait_welcomed`, kept for callers written before it."""
        self.wait_welcomed(timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Block until the brokers have confirmed every commit, release and
        seal made so far (each is then durable at its broker); `TimedOut` (a
        `TimeoutError`) saying how many are unconfirmed."""
        core = self._core
        self._wait_until(lambda: not core.unsettled and not core.unsealed, timeout,
                         lambda: f"{core.unsettled} settlement(s) and {core.unsealed} seal(s) unconfirmed after {timeout} s")

    def _wait_until(self, done, timeout: float | None, describe) -> None:
        deadline = None if timeout is None else Clock.monotonic() + timeout
        with self._changed:
            while not done():
                if self._error is not None:
                    raise ClientFailed(f"consumer {self.consumer_id!r}", self._error) from self._error
                if self._stopping:
                    raise ConsumerClosed("the consumer is closed")
                remaining = None if deadline is None else deadline - Clock.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimedOut(describe())
                self._changed.wait(1.0 if remaining is None else min(remaining, 1.0))

    def close(self, timeout: float = 5.0) -> None:
        """Give back every uncommitted trajectory, wait up to `timeout` for
        the brokers to confirm pending settlements, then stop."""
        with self._changed:
            if self._stopping:
                return
            self._core.close()
            self._wake()
            deadline = Clock.monotonic() + timeout
            while self._core.unsettled and self._error is None:
                remaining = deadline - Clock.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            self._stopping = True
            self._interrupt()  # the loop sees `_stopping` and ends
        self._thread.join(timeout)
        self._wake_out.close(linger=0)
        if self._own_context and not self._thread.is_alive():
            self._context.term()
        if self.ledger is not None:
            self.ledger.close()

    # -- the I/O thread -------------------------------------------------------
    def _wake(self) -> None:
        """Interrupt the poll loop (caller holds the lock, which serialises this
        socket; once stopping, the loop has ended and `close` closes it)."""
        if not self._stopping:
            self._interrupt()

    def _interrupt(self) -> None:
        try:
            self._wake_out.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # a wake-up is already pending
            pass

    def _run(self) -> None:
        watches = self._watches

        def secure(endpoint: str):
            def configure(sock: zmq.Socket) -> None:
                if self._curve is not None:
                    self._curve.apply(sock)
                watches.append(HandshakeWatch(sock, endpoint, self._curve))
            return configure

        socks = [dealer(self._context, endpoint, max_message_bytes=self.max_message_bytes, secure=secure(endpoint))
                 for endpoint in self.endpoints]
        index = {sock: i for i, sock in enumerate(socks)}
        poller = zmq.Poller()
        for sock in (*socks, self._wake_in):
            poller.register(sock, zmq.POLLIN)
        next_sweep = 0.0
        try:
            while True:
                events = dict(poller.poll(100))
                if events.get(self._wake_in):
                    while self._wake_in.poll(0):
                        self._wake_in.recv()
                now = Clock.monotonic()
                # The handshake monitors stay out of the poll (a poll over twice the sockets): read on every pass
                # while a broker has not welcomed us, else every `MONITOR_SWEEP_EVERY`.
                if now >= next_sweep or self._core.handshaking:
                    next_sweep = now + MONITOR_SWEEP_EVERY
                    for watch in watches:
                        if (failure := watch.read()) is not None:
                            log.error(failure, extra={"endpoint": watch.report.endpoint})
                received = [(index[sock], frames) for sock in events if sock in index for frames in _drain(sock)]
                decoded = [self._decode(frames) for _, frames in received]
                with self._changed:
                    if self._stopping:
                        break
                    for (broker, frames), (message, header, error) in zip(received, decoded):
                        if message is None:
                            self._core.undecodable(broker, header, error, frames)
                        else:
                            self._core.received(broker, message, now)
                    outgoing = self._core.due(now)
                    self._changed.notify_all()
                for broker, mtype, fields in outgoing:
                    try:
                        socks[broker].send_multipart(encode(CONSUMER_TO_BROKER, mtype, fields), zmq.NOBLOCK)
                    except zmq.Again:  # the broker is not reading; heartbeats and resends try again
                        log.warning("message to broker not sent", extra={"endpoint": self.endpoints[broker], "type": mtype})
        except BaseException as exc:  # surfaced to the trainer by next_batch
            log.exception("consumer I/O thread failed")
            with self._changed:
                self._error = exc
                self._changed.notify_all()
        finally:
            for watch in watches:
                watch.close()
            for sock in socks:
                sock.close(linger=200)
            self._wake_in.close(linger=0)

    def _decode(self, frames: list) -> tuple:
        """`(message, header, error)`: the decoded message, or the raw header
        and the reason it could not be decoded."""
        try:
            return decode(frames, BROKER_TO_CONSUMER, max_message_bytes=self.max_message_bytes, check_content=False), None, None
        except Exception as exc:  # a failure no rule foresaw is refused like a broken rule, as `internal`
            try:
                header = decode_header(frames[0])
            except Exception:  # unreadable
                header = {}
            if isinstance(exc, RemoteProtocolError):
                return None, header, exc
            message_type = header.get("type") if isinstance(header.get("type"), str) else None
            log_internal(log, exc, "broker", message_type, frames)
            return None, header, internal_error(exc, message_type, frames)  # counted where it is refused


def _drain(sock: zmq.Socket):
    while True:
        try:
            yield recv_parts(sock)
        except zmq.Again:
            return
