"""rollstream.consumer: pull trajectories from the brokers into the training
loop, as validated, packed batches on the GPU, sharded to trainer ranks.

- `Consumer`: fan-in client (credit, heartbeats, reconnects, dedup, commit), the
  I/O shell around `ConsumerCore`, where its decisions live (sans-I/O).
- `Batch`: packed tensors plus the whole batch's CSR mask; `to_train_data()`.
- `validate_batch` / `batch_violations`: one vectorised pass on the device.
- `DistributedConsumer`: one source rank, shards to the others (the others
  raise `SourceRankFailed` when the source's `next_batch` fails).
- `dense_support_mask` / `masked_log_probs` / `support_kl`: trainer primitives.

Names load on first use: `rollstream --help` and `rollstream consume --help`
import no torch.
"""
from rollstream.common.exports import lazy_exports

_EXPORTS = {
    "Assembler": ".assembly",
    "Delivery": ".assembly",
    "Batch": ".batch",
    "BatchValidationError": "rollstream.common.validation",
    "Violation": "rollstream.common.validation",
    "Consumer": ".client",
    "ConsumerClosed": ".core",
    "ConsumerCore": ".core",
    "DistributedConsumer": ".distributed",
    "SourceRankFailed": ".distributed",
    "dense_support_mask": ".primitives",
    "masked_log_probs": ".primitives",
    "support_kl": ".primitives",
    "STRATEGIES": ".sharding",
    "partition": ".sharding",
    "partition_batch": ".sharding",
    "batch_violations": ".validate",
    "checked_batch": ".validate",
    "validate_batch": ".validate",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
