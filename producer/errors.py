"""What a producer raises: a broker refusal (`Refused`, carrying the nack
code, the same type a consumer raises), a frame given up because the
producer closed before it was acknowledged, and a call on a halting
handle whose trajectory a refusal gave up (`Halted`). A producer whose I/O
loop died raises `rollstream.common.errors.ClientFailed`, as a consumer does."""
from __future__ import annotations

from rollstream.common.errors import ClientClosed, InvalidState, Refused

__all__ = ["Halted", "ProducerClosed", "Refused"]


class ProducerClosed(ClientClosed):
    """The producer closed before this frame was acknowledged (with a spool,
    the frame stays there and is resent by the next producer on that spool)."""


class Halted(InvalidState):
    """A turn, end, reward or abort of a trajectory whose halting handle
    (`halts`) a refusal gave up: the producer aborted it and sends nothing
    more of it. `refused` is the refusal that gave it up."""

    def __init__(self, trajectory_id: str, refused: Refused, kind: str):
        super().__init__(f"rule 'a halting handle sends nothing after a refusal' not met: {refused}, so the producer "
                         f"gave {trajectory_id!r} up; expected no further frame of it, got a {kind!r} frame")
        self.refused = refused
