"""rollstream.consumer: pull trajectories from the brokers into the training
loop, as validated, packed batches on the GPU, sharded to trainer ranks.

- `Consumer`: fan-in client (credit, heartbeats, reconnects, dedup, commit).
- `Batch`: packed tensors plus the whole batch's CSR mask; `to_train_data()`.
- `validate_batch` / `batch_violations`: one vectorised pass on the device.
- `DistributedConsumer`: one source rank, shards to the others (the others
  raise `SourceRankFailed` when the source's `next_batch` fails).
- `dense_support_mask` / `masked_log_probs`: trainer primitives.
"""
from rollstream.common.validation import BatchValidationError, Violation

from .assembly import Assembler, Delivery
from .batch import Batch
from .client import Consumer, ConsumerClosed
from .distributed import DistributedConsumer, SourceRankFailed
from .primitives import dense_support_mask, masked_log_probs
from .sharding import STRATEGIES, partition, partition_batch
from .validate import batch_violations, checked_batch, validate_batch

__all__ = [
    "Assembler",
    "Batch",
    "BatchValidationError",
    "Consumer",
    "ConsumerClosed",
    "Delivery",
    "DistributedConsumer",
    "STRATEGIES",
    "SourceRankFailed",
    "Violation",
    "batch_violations",
    "checked_batch",
    "dense_support_mask",
    "masked_log_probs",
    "partition",
    "partition_batch",
    "validate_batch",
]
