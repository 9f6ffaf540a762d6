"""The rollout samples both sides of bench/pipeline.py move: numpy only, so
the TransferQueue driver (its own virtualenv, no rollstream) and
pipeline.py (rollstream's virtualenv) build the same bytes from the same
seed.

A sample is a prompt of `prompt_len` tokens followed by a response of
`resp_len` tokens, with, per response token, a float32 log-prob, a 0/1 loss
mask and its sampling support in CSR form: a support of
min(geometric(1/8), 64) ids drawn from a 151,936-token vocabulary. Token ids
are drawn independently of the supports, as TransferQueue's own streaming
benchmark draws them; `with_tokens_in_support` moves each response token
into its support for a consumer that checks that rule.
"""
from __future__ import annotations

import numpy as np

VOCAB = 151_936
SUPPORT_P = 1.0 / 8.0  # geometric support sizes, mean 8 before the cap
SUPPORT_CAP = 64
FIELDS = ("input_ids", "log_probs", "loss_mask", "mask_ids", "mask_offsets")


def make_samples(n: int, resp_len: int = 5000, prompt_len: int = 512, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`n` samples, each a dict of the `FIELDS` arrays; `input_ids` is the
    prompt and the response together, the response being its last `resp_len`
    ids."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        input_ids = rng.integers(0, VOCAB, prompt_len + resp_len, dtype=np.int32)
        log_probs = (-rng.exponential(1.0, resp_len)).astype(np.float32)
        loss_mask = rng.integers(0, 2, resp_len, dtype=np.uint8)
        sizes = np.minimum(rng.geometric(SUPPORT_P, size=resp_len), SUPPORT_CAP)
        mask_offsets = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        mask_ids = rng.integers(0, VOCAB, int(mask_offsets[-1]), dtype=np.int32)
        out.append({"input_ids": input_ids, "log_probs": log_probs, "loss_mask": loss_mask, "mask_ids": mask_ids,
                    "mask_offsets": mask_offsets})
    return out


def response_length(sample: dict[str, np.ndarray]) -> int:
    return len(sample["log_probs"])


def with_tokens_in_support(samples: list[dict[str, np.ndarray]], seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The samples with every response token replaced by a member of its own
    support (picked uniformly, from a generator of its own), every array
    keeping its size and dtype; the prompt is untouched."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for sample in samples:
        offsets, ids = sample["mask_offsets"], sample["mask_ids"]
        picks = offsets[:-1] + rng.integers(0, np.diff(offsets))
        input_ids = sample["input_ids"].copy()
        input_ids[len(input_ids) - response_length(sample):] = ids[picks]
        out.append({**sample, "input_ids": input_ids})
    return out


def payload_bytes(samples: list[dict[str, np.ndarray]]) -> int:
    return sum(sample[name].nbytes for sample in samples for name in FIELDS)
