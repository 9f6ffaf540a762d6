"""Batch validation (docs/semantics.md §2, §3, §6).

Two stages. On the host, from array lengths and two offsets per sample, the
structure packing relies on: aligned per-token fields, well-formed CSR ends,
matching replay shapes, and the whole-batch rule. Then every per-token rule
in one vectorised pass over the packed batch on its device, through
`rollstream.common.validation.packed_violations`: strictly increasing
offsets, each sampled token inside its support, forced tokens as singleton
supports, ids and tokens in `[0, vocab_size)`, loss mask in {0, 1}, log-probs
(and `full_log_probs` and `mask_log_probs`, when the batch carries them)
finite and <= 0 within rounding (`LOG_PROB_RULES`). `mask_log_probs` hold
one entry per support id (`RULE_SUPPORT_ALIGNED`), checked per sample on
the host before packing, as the per-token fields' lengths are.

A delivery does not say which tokens were forced, so they are recognised the
way the merge model writes them (docs/semantics.md §3): loss mask 0 and log-prob
exactly 0.0. A sampled token kept out of the loss whose reported log-prob
rounds to exactly 0.0 while its support holds several ids would be flagged
too; it cannot affect training, but it is reported rather than guessed away.

On the CPU, where the compiled module is built, packing checks each
sample as it copies it (`Batch.checked_from_deliveries`), while its bytes
are in cache, and the packed batch is checked only when that saw a rule
broken. Otherwise the
per-token pass runs on numpy views of the batch's tensors (zero-copy;
numpy's element-wise passes and gathers are faster than torch's there, and
torch's prefix sums are used on numpy buffers where they win); on a GPU it
runs as torch ops that reduce every check to a flag on the device
(`batch_verdict`), so a valid batch costs one host read, and failing
positions are searched only when a flag is set.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from rollstream.common.contract import CONTEXT_REPLAY_ARRAYS, REPLAY_FIELDS, SUPPORT_LOG_PROB_ARRAYS, TOKEN_LOG_PROB_ARRAYS
from rollstream.common.validation import (
    RULE_ALIGNED,
    RULE_NONEMPTY_OFFSETS,
    RULE_OFFSETS_END,
    RULE_OFFSETS_START,
    RULE_SUPPORT_ALIGNED,
    RULE_TOKEN_VOCAB,
    RULE_WHOLE_BATCH,
    BatchValidationError,
    Verdict,
    Violation,
    locate_violations,
    packed_flags,
    whole_batch_problem,
)

from .assembly import Delivery
from .batch import Batch

RULE_REPLAY_SHAPE = "replay arrays of a batch share their trailing shape"


def _carried(arrays: Sequence, replay_field: str) -> np.ndarray:
    """Per delivery, whether it carries `replay_field` (one membership test each, no call per delivery)."""
    name = "mask_ids" if replay_field == "mask" else replay_field
    return np.array([name in a for a in arrays], dtype=bool)


def sample_violations(deliveries: Sequence[Delivery]) -> list[Violation]:
    """Per-sample structure, checked on the host in O(samples): a sample
    listed here cannot be packed. `sample` is the position in `deliveries`."""
    arrays = [d.arrays for d in deliveries]
    fields = [d.fields for d in deliveries]
    found: list[Violation] = []

    def flag(rule: str, bad: np.ndarray, detail) -> None:
        found.extend(Violation(rule, int(s), None, 1, detail(int(s))) for s in np.flatnonzero(bad))

    n = np.array([len(a["tokens"]) for a in arrays], dtype=np.int64)
    declared = np.array([f["response_length"] for f in fields], dtype=np.int64)
    flag(RULE_ALIGNED, declared != n, lambda s: f"response_length is {declared[s]}, tokens has {n[s]}")
    for name in ("loss_mask", "log_probs"):
        got = np.array([len(a[name]) for a in arrays], dtype=np.int64)
        flag(RULE_ALIGNED, got != n, lambda s: f"{name} has {got[s]} entries, tokens has {n[s]}")

    masked = _carried(arrays, "mask")
    rows = np.array([len(a["mask_offsets"]) if m else 1 for a, m in zip(arrays, masked)], dtype=np.int64)
    flag(RULE_NONEMPTY_OFFSETS, rows == 0, lambda s: "mask_offsets is empty")
    filled = masked & (rows > 0)
    flag(RULE_ALIGNED, filled & (rows - 1 != n), lambda s: f"mask covers {rows[s] - 1} tokens, response has {n[s]}")
    first = np.array([a["mask_offsets"][0] if f else 0 for a, f in zip(arrays, filled)], dtype=np.int64)
    last = np.array([a["mask_offsets"][-1] if f else 0 for a, f in zip(arrays, filled)], dtype=np.int64)
    n_ids = np.array([len(a["mask_ids"]) if f else 0 for a, f in zip(arrays, filled)], dtype=np.int64)
    flag(RULE_OFFSETS_START, first != 0, lambda s: f"expected 0, got {first[s]}")
    flag(RULE_OFFSETS_END, last != n_ids, lambda s: f"expected {n_ids[s]}, got {last[s]}")

    for name in CONTEXT_REPLAY_ARRAYS:
        shapes = [a[name].shape[1:] if name in a else None for a in arrays]
        reference = next((shape for shape in shapes if shape is not None), None)
        flag(RULE_REPLAY_SHAPE, np.array([shape not in (None, reference) for shape in shapes], dtype=bool),
             lambda s: f"{name} has shape {list(arrays[s][name].shape)}, expected [k, {', '.join(map(str, reference or ()))}]")

    for replay_field in REPLAY_FIELDS:
        present = _carried(arrays, replay_field)
        if present.any():
            flag(RULE_WHOLE_BATCH, ~present, lambda s: whole_batch_problem(
                "sampling mask" if replay_field == "mask" else replay_field, s,
                fields[s].get("sample_index", s), fields[s]["status"],
            ))
            if replay_field in TOKEN_LOG_PROB_ARRAYS:
                got = np.array([len(a[replay_field]) if p else k for a, p, k in zip(arrays, present, n)], dtype=np.int64)
                flag(RULE_ALIGNED, got != n, lambda s: f"{replay_field} has {got[s]} entries, tokens has {n[s]}")
            elif replay_field in SUPPORT_LOG_PROB_ARRAYS:  # one per support id, so a sample without a mask has none
                ids = np.array([len(a["mask_ids"]) if m else 0 for a, m in zip(arrays, masked)], dtype=np.int64)
                got = np.array([len(a[replay_field]) if p else k for a, p, k in zip(arrays, present, ids)], dtype=np.int64)
                flag(RULE_SUPPORT_ALIGNED, present & ~masked, lambda s: f"{replay_field} has {got[s]} entries, no sampling mask")
                flag(RULE_SUPPORT_ALIGNED, masked & (got != ids),
                     lambda s: f"{replay_field} has {got[s]} entries, mask_ids has {ids[s]}")
    return sorted(found, key=lambda v: v.sample)


def _token_log_probs(batch: Batch) -> dict:
    """The batch's per-token log-prob arrays beyond `log_probs`, as the shared checks take them."""
    return {name: _on_device_array(getattr(batch, name)) for name in TOKEN_LOG_PROB_ARRAYS
            if getattr(batch, name) is not None}


def _support_log_probs(batch: Batch) -> dict:
    """The batch's per-support-id log-prob arrays (beside `mask_ids`), as the shared checks take them."""
    return {name: _on_device_array(getattr(batch, name)) for name in SUPPORT_LOG_PROB_ARRAYS
            if getattr(batch, name) is not None}


def _on_device_array(tensor):
    """The array the shared checks run on: a zero-copy numpy view on the CPU."""
    if tensor is None or tensor.device.type != "cpu":
        return tensor
    return tensor.numpy()


def batch_verdict(batch: Batch, *, vocab_size: int | None = None) -> Verdict:
    """Every per-token rule as flags on the batch's device, nothing read
    back yet (on CUDA the flags' copy to the host is already on its way)."""
    view = _on_device_array
    return Verdict(
        packed_flags(view(batch.response_tokens), batch.lengths["response"], view(batch.mask_ids),
                     view(batch.mask_offsets), vocab_size=vocab_size, loss_mask=view(batch.loss_mask),
                     log_probs=view(batch.log_probs), token_log_probs=_token_log_probs(batch),
                     support_log_probs=_support_log_probs(batch)),
        # Prompt tokens feed the embedding too.
        packed_flags(view(batch.tokens), batch.lengths["sequence"], vocab_size=vocab_size),
    )


def batch_violations(batch: Batch, *, vocab_size: int | None = None, verdict: Verdict | None = None) -> list[Violation]:
    """Every per-token rule, one pass over the packed batch on its device
    (`verdict`, when `batch_verdict` already made it): one host read when
    the batch is valid, the search for positions only when it is not."""
    if (verdict or batch_verdict(batch, vocab_size=vocab_size)).passed():
        return []
    view = _on_device_array
    found = locate_violations(
        view(batch.response_tokens),
        batch.lengths["response"],
        view(batch.mask_ids),
        view(batch.mask_offsets),
        vocab_size=vocab_size,
        loss_mask=view(batch.loss_mask),
        log_probs=view(batch.log_probs),
        token_log_probs=_token_log_probs(batch),
        support_log_probs=_support_log_probs(batch),
    )
    # Response tokens were checked above (a sample's first out-of-vocab token is in its prompt, or none is).
    prompt = batch.lengths["prompt"]
    for v in locate_violations(view(batch.tokens), batch.lengths["sequence"], vocab_size=vocab_size):
        if v.position < prompt[v.sample]:
            found.append(Violation(RULE_TOKEN_VOCAB, v.sample, None, 1, f"prompt position {v.position}: {v.detail}"))
    return sorted(found, key=lambda v: v.sample)


def validate_batch(batch: Batch, *, vocab_size: int | None = None) -> None:
    """Raise `BatchValidationError` naming every failing trajectory, token
    position and rule."""
    found = batch_violations(batch, vocab_size=vocab_size)
    if found:
        raise BatchValidationError(found, batch.trajectory_ids)


def checked_batch(
    deliveries: Sequence[Delivery],
    *,
    device=None,
    seq: int = 0,
    vocab_size: int | None = None,
    reward_key: str | None = None,
) -> tuple[Batch, list[Violation], list[int]]:
    """Both stages. Returns the batch of every packable delivery, each
    violation with `sample` = its position in `deliveries`, and for each
    batch sample the position of its delivery. The packed batch's check is
    spared where packing saw every sample keep its rules
    (`Batch.checked_from_deliveries`)."""
    found = sample_violations(deliveries)
    unpackable = {v.sample for v in found}
    packed = [i for i in range(len(deliveries)) if i not in unpackable]
    batch, seen_valid = Batch.checked_from_deliveries([deliveries[i] for i in packed], device=device, seq=seq,
                                                      reward_key=reward_key, vocab_size=vocab_size)
    for v in [] if seen_valid else batch_violations(batch, vocab_size=vocab_size):
        found.append(Violation(v.rule, packed[v.sample], v.position, v.count, v.detail))
    return batch, sorted(found, key=lambda v: v.sample), packed
