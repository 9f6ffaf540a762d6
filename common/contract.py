"""The one contract table: array fields, their wire dtypes and shapes, the
replay fields, statuses and reply codes.

Everything that encodes, decodes, stores or validates rollstream data reads
its names and dtypes from here, so a field is declared exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

PROTOCOL_VERSION = 1

STATUSES = ("completed", "truncated", "aborted")
TERMINAL_STATUSES = frozenset({"truncated", "aborted"})


@dataclass(frozen=True)
class ArraySpec:
    """Wire contract of one array field.

    `per_token` arrays are 1-D with one entry per token of the message's own
    token axis; `min_ndim` arrays (replay captures) are `[k, ...]`.
    """

    dtype: np.dtype
    ndim: int | None  # exact rank, or None for "at least min_ndim"
    min_ndim: int = 1
    wire_name: str = field(init=False)  # the dtype string on the wire (cached: dtype.name is slow)

    def __post_init__(self):
        object.__setattr__(self, "wire_name", self.dtype.name)

    def rank_ok(self, ndim: int) -> bool:
        return ndim == self.ndim if self.ndim is not None else ndim >= self.min_ndim

    def rank_rule(self) -> str:
        return f"{self.ndim}-D" if self.ndim is not None else f"at least {self.min_ndim}-D"


_INT32 = np.dtype("<i4")
_INT64 = np.dtype("<i8")
_FLOAT32 = np.dtype("<f4")
_UINT8 = np.dtype("u1")

ARRAYS: dict[str, ArraySpec] = {
    "prompt_tokens": ArraySpec(_INT32, 1),
    "tokens": ArraySpec(_INT32, 1),
    "forced_tokens": ArraySpec(_INT32, 1),
    "log_probs": ArraySpec(_FLOAT32, 1),
    "full_log_probs": ArraySpec(_FLOAT32, 1),
    "loss_mask": ArraySpec(_UINT8, 1),
    "mask_ids": ArraySpec(_INT32, 1),
    "mask_offsets": ArraySpec(_INT64, 1),
    "mask_log_probs": ArraySpec(_FLOAT32, 1),
    "routed_experts": ArraySpec(_INT32, None, 1),
    "indexer_topk": ArraySpec(_INT32, None, 1),
}

# How far above 0 a log-prob may lie and still be one: an engine's
# log-softmax rounds a near-certain token's log-prob to a hair above 0, and
# refusing that would refuse good turns; more than this is no rounding. A
# power of two (about 1e-3 nats), exact in float32 and float64, so every
# check compares the same number whatever the array's dtype.
LOG_PROB_TOLERANCE = 2.0**-10

# Replay arrays that cover their engine call's whole context: the merged
# trajectory keeps the latest, whose first dimension must not shrink.
CONTEXT_REPLAY_ARRAYS = ("routed_experts", "indexer_topk")

# Optional per-token log-probs beside `log_probs` (which is under the
# sampler's truncated distribution): one entry per sampled token, 0.0 at a
# forced token, each kept by the log-prob rule. `full_log_probs` is the
# sampled token's log-prob under the engine's whole vocabulary.
TOKEN_LOG_PROB_ARRAYS = ("full_log_probs",)

# Optional arrays with one entry per support id, aligned with `mask_ids`
# (a forced token's singleton gets 0.0). `mask_log_probs` is the sampler's
# log-prob of every id it could have emitted, kept by the log-prob rule.
SUPPORT_LOG_PROB_ARRAYS = ("mask_log_probs",)

# Replay fields in the order a gap reports them: "mask" is the
# `mask_ids` + `mask_offsets` pair.
REPLAY_FIELDS = ("mask", *CONTEXT_REPLAY_ARRAYS, *TOKEN_LOG_PROB_ARRAYS, *SUPPORT_LOG_PROB_ARRAYS)
MASK_ARRAYS = ("mask_ids", "mask_offsets")

# Token-id arrays whose values must lie in [0, vocab_size).
TOKEN_ID_ARRAYS = ("prompt_tokens", "tokens", "forced_tokens", "mask_ids")

# Reply codes of a refused frame, in the order the checks run (docs/protocol.md §2).
NACK_CODES = (
    "malformed",
    "version",
    "schema",
    "too_large",
    "crc_mismatch",
    "dtype",
    "shape",
    "misaligned",
    "mask_invalid",
    "out_of_vocab",
    "invalid_value",
    "out_of_order",
    "conflict",
    "mask_presence",
    "unknown_trajectory",
    "stale_lease",
    "unknown_consumer",
    "not_checkpointed",
    "checkpoint_gone",
    "unavailable",
    "internal",
)

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024

class CreditUnit(StrEnum):
    """What one unit of a consumer's credit pays for (docs/protocol.md §4): one
    trajectory, or one whole group (its members come back to back)."""

    TRAJECTORY = "trajectory"
    GROUP = "group"


# A peer silent for this many heartbeat intervals is gone (docs/protocol.md §1, §4):
# ZeroMQ's own heartbeats, the broker's consumers and its count of live producers.
LIVENESS_INTERVALS = 3
# The longest heartbeat interval, in seconds: ZeroMQ's heartbeat TTL, which
# holds LIVENESS_INTERVALS intervals, is 16 bits of deciseconds.
LONGEST_HEARTBEAT_INTERVAL = 0xFFFF * 0.1 / LIVENESS_INTERVALS
