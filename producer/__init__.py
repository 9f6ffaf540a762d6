"""rollstream.producer: stream rollout turns to the node's broker.

- `AsyncProducer` / `Producer`: asyncio and blocking clients with the same
  vocabulary (`trajectory(...)`, `turn`, `sglang`, `send`, `end`, `abort`):
  a resend window, heartbeats and an optional disk spool underneath.
- `Receipt` (a durable ack; `applied: false` outcomes are reported here),
  `Refused` (a nack, with its code) and `Halted` (a call on a halting handle
  whose trajectory a refusal gave up).
- `turns_from_miles_samples`: miles per-turn samples as turns.
- `ProducerSession` (the conduct toward the broker) and `ResendWindow`
  (what is unsettled and what goes again): the sans-I/O cores the clients
  are facades over.

Names load on first use, so `rollstream producer --help` stays fast.
"""
from rollstream.common.exports import lazy_exports

_EXPORTS = {
    "AsyncProducer": ".client",
    "AsyncTrajectoryHandle": ".client",
    "Producer": ".client",
    "TrajectoryHandle": ".client",
    "Receipt": ".window",
    "ResendWindow": ".window",
    "ProducerSession": ".session",
    "Refused": ".errors",
    "ProducerClosed": ".errors",
    "Halted": ".errors",
    "MilesMergeError": ".miles_samples",
    "turns_from_miles_samples": ".miles_samples",
}

__all__ = list(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
