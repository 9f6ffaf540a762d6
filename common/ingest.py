"""Turning an inference engine's response into a checked `Turn`.

SGLang, asked with `return_sampling_mask`, returns for each generated token
its support (`meta_info["output_token_sampling_mask"]`, a list of id lists)
and the log-probability under the truncated distribution
(`meta_info["output_token_sampling_logprobs"]`); with its weight-version
spans, which weights sampled which of them (`meta_info["weight_versions"]`).
"""
from __future__ import annotations

from typing import Any, Mapping

from .errors import InvalidInput, LocalProtocolError
from .trajectory import Turn

# SGLang's finish_reason.type → the turn status docs/semantics.md uses.
FINISH_REASON_STATUS = {"stop": "completed", "length": "truncated", "abort": "aborted"}

SUPPORTS_KEY = "output_token_sampling_mask"
LOG_PROBS_KEY = "output_token_sampling_logprobs"
# SGLang's per-token weight versions: [{"version", "start", "end"}] over the output tokens, contiguous from 0, the
# newest last (its `weight_version` is the last one's, where a rollstream turn's is its first span's).
SPANS_KEY = "weight_versions"


def status_from_finish_reason(meta_info: Mapping[str, Any]) -> str:
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind is None:
        return "completed"
    if kind not in FINISH_REASON_STATUS:
        raise InvalidInput(f"unknown finish_reason {kind!r}; expected one of {sorted(FINISH_REASON_STATUS)}")
    return FINISH_REASON_STATUS[kind]


def turn_from_sglang(
    output_ids,
    meta_info: Mapping[str, Any],
    *,
    forced_tokens=None,
    loss_mask=None,
    status: str | None = None,
    weight_version: str | None = None,
    vocab_size: int | None = None,
    require_mask: bool = True,
) -> Turn:
    """A `Turn` from one `/generate` response.

    Checks, vectorised, that there is one support and one log-prob per
    sampled token, that every support is non-empty and holds its sampled
    token, and (with `vocab_size`) that every id is in the vocabulary.
    An aborted response (`finish_reason` abort) may come without supports,
    and, when it sampled nothing, without log-probs: an engine abort
    returns neither. It gives an `aborted` turn without a mask, which cuts
    a trajectory that carries one at a replay gap (docs/semantics.md example 7).
    With `require_mask=False` any response without supports does the same.
    """
    status = status or status_from_finish_reason(meta_info)
    supports = meta_info.get(SUPPORTS_KEY)
    log_probs = meta_info.get(LOG_PROBS_KEY)
    n = len(output_ids)
    if supports is None and require_mask and status != "aborted":
        raise LocalProtocolError("mask_invalid", f"response has no {SUPPORTS_KEY}; request it with return_sampling_mask")
    if log_probs is None:
        if n:
            raise LocalProtocolError("misaligned", f"response has no {LOG_PROBS_KEY} for its {n} sampled tokens")
        log_probs = ()
    for name, values in ((SUPPORTS_KEY, supports), (LOG_PROBS_KEY, log_probs)):
        if values is not None and len(values) != n:
            raise LocalProtocolError("misaligned", f"{name} has {len(values)} entries, {n} tokens were sampled")
    spans = None if weight_version is not None else sglang_spans(meta_info, n)
    if spans:
        weight_version = spans[0][0]
        if len(spans) == 1 and spans[0][1:] == (0, n):  # one version over the turn: the turn's own
            spans = None
    elif weight_version is None and meta_info.get("weight_version") is not None:
        weight_version = str(meta_info["weight_version"])
    return Turn.build(
        output_ids,
        log_probs,
        supports=supports,
        loss_mask=loss_mask,
        forced_tokens=forced_tokens,
        status=status,
        weight_version=weight_version,
        weight_version_spans=spans or None,
        vocab_size=vocab_size,
    )


def sglang_spans(meta_info: Mapping[str, Any], tokens: int) -> list[tuple[str, int, int]] | None:
    """SGLang's per-token weight versions (`meta_info["weight_versions"]`) as
    rollstream's (version, start, end) spans, empty ones left out; None when
    it sent none. Their order and bounds are checked where the turn is
    built (`Turn.build`)."""
    value = meta_info.get(SPANS_KEY)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
            isinstance(span, Mapping) and {"version", "start", "end"} <= set(span)
            and type(span["start"]) is int and type(span["end"]) is int for span in value):
        raise LocalProtocolError("schema", f"rule 'meta_info.{SPANS_KEY} is a list of {{version, start, end}} with "
                                           f"integer bounds' not met: got {value!r:.200}")
    return [(str(span["version"]), span["start"], span["end"]) for span in value if span["end"] > span["start"]]
