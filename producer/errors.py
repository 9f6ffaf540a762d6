"""What a producer raises: a broker refusal (`Refused`, carrying the nack
code, the same type a consumer raises) and a frame given up because the
producer closed before it was acknowledged. A producer whose I/O loop died
raises `rollstream.common.errors.ClientFailed`, as a consumer does."""
from __future__ import annotations

from rollstream.common.errors import ClientClosed, Refused

__all__ = ["ProducerClosed", "Refused"]


class ProducerClosed(ClientClosed):
    """The producer closed before this frame was acknowledged (with a spool,
    the frame stays there and is resent by the next producer on that spool)."""
