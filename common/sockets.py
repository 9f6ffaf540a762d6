"""Socket options every rollstream socket sets (docs/protocol.md §1)."""
from __future__ import annotations

import logging
import resource
from typing import Callable

import numpy as np
import zmq

from .contract import LIVENESS_INTERVALS
from .errors import InvalidInput

log = logging.getLogger("rollstream")

ZMQ_DEFAULT_MAX_SOCKETS = 1023  # libzmq's sockets per context, unless raised before the first socket

# The compiled send under pyzmq's Python wrapper, whose per-call handling
# (routing ids and groups of draft socket types, Frame objects, copy
# thresholds) costs more than sending a small frame.
_send_part = getattr(zmq.backend, "Socket", zmq.Socket).send
_SEND_MORE = zmq.SNDMORE | zmq.NOBLOCK
_RECEIVED_FRAME = zmq.Frame  # what a receive without copying gives


def tune(
    sock: zmq.Socket,
    *,
    high_water_mark: int = 1000,
    heartbeat_interval: float = 1.0,
    max_message_bytes: int | None = None,
    linger_ms: int = 1000,
) -> zmq.Socket:
    """Explicit HWMs, ZMTP heartbeats, a bounded linger, and a socket message
    limit above the application's `max_message_bytes`, so an oversized
    message is still read and answered `too_large`."""
    sock.setsockopt(zmq.SNDHWM, high_water_mark)
    sock.setsockopt(zmq.RCVHWM, high_water_mark)
    sock.setsockopt(zmq.LINGER, linger_ms)
    interval_ms = max(1, int(heartbeat_interval * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, LIVENESS_INTERVALS * interval_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, LIVENESS_INTERVALS * interval_ms)
    if max_message_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, min(2 * max_message_bytes, 2**62))
    return sock


def context_for(sockets: int, descriptors: int) -> tuple[zmq.Context, bool]:
    """A context with room for `sockets` sockets, and whether the caller owns
    it (must term it): the process's shared one when they fit zmq's default
    limit, else one of its own with the limit raised. The soft limit on open
    files is raised to `descriptors` when the hard limit allows; when it does
    not, InvalidInput names both."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < descriptors:
        if hard != resource.RLIM_INFINITY and hard < descriptors:
            raise InvalidInput(f"rule 'open files for every socket' not met: {sockets} sockets need about "
                               f"{descriptors} file descriptors, and the hard limit is {hard} (raise it: ulimit -Hn, "
                               "or LimitNOFILE= in a systemd unit)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (descriptors, hard))
        log.info("raised the soft limit on open files", extra={"from": soft, "to": descriptors})
    if sockets <= ZMQ_DEFAULT_MAX_SOCKETS - 64:  # room left for the process's other sockets
        return zmq.Context.instance(), False
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, sockets + 64)
    return context, True


def router(context: zmq.Context, endpoint: str, *, secure: Callable[[zmq.Socket], None] | None = None,
           **options) -> zmq.Socket:
    """A bound ROUTER that refuses to drop messages for unknown peers;
    `secure` sets its security options (CURVE) before it binds."""
    sock = tune(context.socket(zmq.ROUTER), **options)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if secure is not None:
        secure(sock)
    sock.bind(endpoint)
    return sock


def dealer(context: zmq.Context, endpoint: str, identity: bytes | None = None, *,
           secure: Callable[[zmq.Socket], None] | None = None, **options) -> zmq.Socket:
    """A connected DEALER; `secure` sets its security options (CURVE) before it connects."""
    sock = tune(context.socket(zmq.DEALER), **options)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if secure is not None:
        secure(sock)
    sock.connect(endpoint)
    return sock


# libzmq reads small messages into shared receive buffers of this size (its
# default ZMQ_IN_BATCH_SIZE) and larger ones into buffers of their own. A
# small frame held zero-copy therefore keeps a whole shared buffer alive:
# the broker holds turns for as long as their trajectory is open, and held
# that way each would cost its buffer, not its own size, in memory.
SHARED_RECEIVE_BUFFER_BYTES = 8192


def recv_routed(sock: zmq.Socket, flags: int = zmq.NOBLOCK, users: dict[bytes, str] | None = None) -> list:
    """One message from a ROUTER: the sender's identity as bytes, then each
    frame: as a zero-copy memoryview when it has a receive buffer of its own
    (larger than `SHARED_RECEIVE_BUFFER_BYTES`), else copied out as bytes,
    so keeping it keeps only its own bytes. Cheaper than
    `recv_multipart()` per message: no socket-option call per part (each
    zmq.Frame says whether more follow; docs/performance.md). With `users` (a CURVE socket),
    records the sender's `User-Id` (what authentication named its
    connection) under its identity."""
    frame = sock.recv(flags, copy=False)
    identity = frame.bytes
    if users is not None:
        users[identity] = str(frame.get("User-Id"))
    return _parts_after(sock, frame, flags, [identity])


def recv_parts(sock: zmq.Socket, flags: int = zmq.NOBLOCK) -> list:
    """One message from a DEALER, each frame kept as `recv_routed` keeps it."""
    return _parts_after(sock, None, flags, [])


def _parts_after(sock: zmq.Socket, frame: zmq.Frame | None, flags: int, frames: list) -> list:
    """`frames` and the parts after `frame` (all of a message when None)."""
    while frame is None or frame.more:
        frame = sock.recv(flags, copy=False)
        frames.append(frame.buffer if len(frame) > SHARED_RECEIVE_BUFFER_BYTES else frame.bytes)
    return frames


def send_frames(sock: zmq.Socket, frames: list, *, identity: bytes | None = None,
                zero_copy_above: int | None = None) -> None:
    """Send one message without blocking, part by part through the compiled
    send, cheaper per part than `send_multipart` (docs/performance.md). Parts are copied
    into ZeroMQ, except those larger than `zero_copy_above` bytes, which are
    handed over by reference (the caller keeps them unchanged until sent),
    and a received frame forwarded whole (`_whole_received`), whose bytes
    ZeroMQ shares: neither copied nor handed to pyzmq's collector thread.
    Raises `zmq.Again` when the queue is full (only ever at the first part:
    a message goes whole or not at all) and `zmq.ZMQError` otherwise."""
    if identity is not None:
        _send_part(sock, identity, _SEND_MORE)
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        flags = _SEND_MORE if i < last else zmq.NOBLOCK
        if type(frame) is memoryview and (received := _whole_received(frame)) is not None:
            _send_part(sock, received, flags)
        elif zero_copy_above is None or len(frame) <= zero_copy_above:
            _send_part(sock, frame, flags)
        else:
            _send_part(sock, frame, flags, copy=False)


def _whole_received(view: memoryview) -> zmq.Frame | None:
    """The received frame `view` shows all of, if any: a view of a
    `zmq.Frame`, or of an array decoding made over all of one (a turn's
    array sent a frame each, a delivery's piece that travels unjoined)."""
    owner = view.obj
    if type(owner) is np.ndarray and type(owner.base) is memoryview:  # `np.frombuffer` over the frame's view
        owner = owner.base.obj
    return owner if type(owner) is _RECEIVED_FRAME and view.nbytes == len(owner) else None


class SendBuffer:
    """The buffer a producer writes each batch's body into before ZeroMQ
    copies it out (`send_frames` without `zero_copy_above`), so it is written
    again for the next batch at once. A fresh body of up to a MiB per batch
    is a fresh `mmap` whose pages fault in every time; this one keeps its
    pages. Handing the body over by reference instead costs a wake-up of
    pyzmq's collector thread per batch, more than the copy
    (docs/performance.md). It grows in steps of `GRANULE` to the largest
    body asked for."""

    GRANULE = 1 << 20

    def __init__(self):
        self._buffer = bytearray()

    def take(self, size: int) -> memoryview:
        """A writable view of `size` bytes at the buffer's start."""
        if len(self._buffer) < size:
            self._buffer = bytearray(-(-size // self.GRANULE) * self.GRANULE)
        return memoryview(self._buffer)[:size]

    def holds(self, frame) -> bool:
        """Whether `frame` is a view of this buffer (to be sent by copy)."""
        return type(frame) is memoryview and frame.obj is self._buffer
