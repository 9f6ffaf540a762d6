"""What a producer raises: a broker refusal (carrying the nack code) and a
frame given up because the producer closed before it was acknowledged. A
producer whose I/O loop died raises `rollstream.common.errors.ClientFailed`,
as a consumer does."""
from __future__ import annotations

from rollstream.common.errors import RollstreamError


class Refused(RollstreamError):
    """The broker refused a frame (`nack`); the frame changed nothing there.

    `code` is the reply code (`rollstream.common.contract.NACK_CODES`),
    `message` the broker's explanation, `expected` the next turn it wanted
    (for `out_of_order`).
    """

    def __init__(self, code: str, message: str, *, kind: str, trajectory_id: str, turn: int | None, seq: int,
                 expected: int | None = None):
        where = f"{kind} of {trajectory_id!r}" + (f" turn {turn}" if turn is not None else "")
        super().__init__(f"broker refused {where}: {code}: {message}", code=code)
        self.message = message
        self.kind = kind
        self.trajectory_id = trajectory_id
        self.turn = turn
        self.seq = seq
        self.expected = expected


class ProducerClosed(RollstreamError, RuntimeError):
    """The producer closed before this frame was acknowledged (with a spool,
    the frame stays there and is resent by the next producer on that spool)."""

    code = "closed"
