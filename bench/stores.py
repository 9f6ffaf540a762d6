"""Building a broker's store for a bench through the broker's own code."""
from __future__ import annotations

from collections.abc import Iterable

from rollstream.broker.engine import MergeEngine, Producer
from rollstream.common.codec import Message


def applied(engine: MergeEngine, tid: str, messages: Iterable[Message], wall: float, producer: str) -> list:
    """The store effects of trajectory `tid`'s `messages` in `engine`; a
    refusal is an error (a bench's frames are all valid)."""
    effects: list = []
    for message in messages:
        reply = engine.handle(message, wall, producer=Producer(producer))
        if reply.error is not None:
            raise RuntimeError(f"the engine refused a bench frame of {tid}: {reply.error}")
        effects += reply.effects
    return effects
