"""Turning an inference engine's reply into a checked `Turn`.

SGLang, asked with `return_sampling_mask`, returns for each generated token
its support (`meta_info["output_token_sampling_mask"]`, a list of id lists)
and the log-probability under the truncated distribution
(`meta_info["output_token_sampling_logprobs"]`: the sampled token's, a
number per token; asked with `sampling_logprobs_mode="support"`, every
support id's, a list per token aligned with its support, the sampler's
post-filter weights renormalised over the support, which become the turn's
`mask_log_probs`); asked with
`return_logprob`, also the log-probability under the full distribution
(`meta_info["output_token_logprobs"]`, `[log-prob, id, text]` per token);
with its weight-version spans, which weights sampled which of them
(`meta_info["weight_versions"]`). `/v1/chat/completions` asked with
`return_meta_info` puts the same `meta_info` in each choice.

vLLM, started with `--return-sampling-mask`, puts the supports on each
completion output (`sampling_mask`: one id list per token, in CSR form in
its first release) and, from its token-in/token-out `/inference/v1/generate`,
in each JSON choice; its `logprobs` are then over the processed (truncated)
distribution. Started with `--return-sampling-mask-logprobs` too, it pairs
each support with its ids' log-probs renormalised over it
(`sampling_mask_logprobs`, a list per token aligned with its support, or
one array aligned with a CSR mask's ids), which become the turn's
`mask_log_probs`. It fails a request it cannot answer so with
`finish_reason` `error` (a top-k boundary tie that keeps more than top_k
tokens), which is refused.

Every field of the reply is carried, used, or refused naming the rule:
none is dropped without a word (docs/producer.md lists them).
"""
from __future__ import annotations

import collections
import re
from typing import Any, Mapping

import numpy as np

from .errors import InvalidInput, LocalProtocolError, SupportOverflow
from .mask import SamplingMask, as_int_array
from .trajectory import LOG_PROB_DTYPE, TOKEN_DTYPE, Turn
from .validation import RULE_ALIGNED, RULE_SUPPORT_ALIGNED

# An engine's finish reason → the turn status docs/semantics.md uses. `tool_calls` is the chat endpoints' name of a
# stop at which a tool parser found calls.
FINISH_REASON_STATUS = {"stop": "completed", "tool_calls": "completed", "length": "truncated", "abort": "aborted"}

SUPPORTS_KEY = "output_token_sampling_mask"
LOG_PROBS_KEY = "output_token_sampling_logprobs"
SUPPORTS_LENGTH_KEY = "output_token_sampling_mask_length"
# SGLang's bounded mask mode: a support past the engine's cap was cut to its highest-weight ids, so the log-probs of
# what is left (each over the whole support) sum to less than 1.
TRUNCATED_KEY = "output_token_sampling_mask_truncated"
# A miles fork's SGLang: each support id's log-prob, renormalised over the support, beside the per-token ones.
SUPPORT_LOG_PROBS_KEY = "output_token_sampling_mask_logprobs"
# vLLM started with --return-sampling-mask-logprobs: each support id's log-prob, renormalised over the support.
VLLM_SUPPORT_LOG_PROBS_KEY = "sampling_mask_logprobs"
FULL_LOG_PROBS_KEY = "output_token_logprobs"
# Per-token weight versions: [{"version", "start", "end"}] over the output tokens, contiguous from 0, the newest last
# (SGLang's `weight_version` is the last one's, where a rollstream turn's is its first span's).
SPANS_KEY = "weight_versions"
# meta_info fields that hold per-token data a turn built here does not carry: refused rather than dropped.
UNCARRIED_KEYS = {
    "output_top_logprobs": "the top log-probs of each position (ask without top_logprobs_num)",
    "output_token_ids_logprobs": "log-probs of chosen ids at each position (ask without token_ids_logprob)",
    "routed_experts": "routed experts (decode them and pass routed_experts= to Turn.build)",
    "hidden_states": "hidden states (ask without return_hidden_states)",
}

# What an engine's refusal says when a support outgrew its cap (SGLang: a 400 BadRequestError, or an abort whose
# finish_reason carries status_code 400), and where its numbers are.
_OVERFLOW_WORDS = re.compile(r"exceed|overflow|cutoff ties|max[-_ ]tokens|limit", re.IGNORECASE)
_MASK_WORDS = re.compile(r"sampling[-_ ]mask|support", re.IGNORECASE)
_SUPPORT_SIZE = re.compile(r"support(?: size)?(?: of)?\D{0,12}?(\d{1,18})\b", re.IGNORECASE)
_CAP = re.compile(r"(?:max[-_ ]tokens|limit|cap|maximum)\D{0,12}?(\d{1,18})\b", re.IGNORECASE)


def _listed(value, where: str) -> list | tuple:
    """`value` when it is a list (a JSON array); else the rule broken."""
    if not isinstance(value, (list, tuple)):
        raise LocalProtocolError("schema", f"rule '{where} is a list' not met: got {type(value).__name__} {value!r:.80}")
    return value


def status_from_finish_reason(meta_info: Mapping[str, Any]) -> str:
    """The turn status of a reply's `finish_reason` (SGLang's `{"type": ...}`
    or a bare string); a reply that names none completed."""
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, Mapping) else reason
    if kind is None:
        return "completed"
    if not isinstance(kind, str) or kind not in FINISH_REASON_STATUS:
        cause = (": the engine failed the request (vLLM does so when a top-k boundary tie keeps more than top_k tokens, "
                 "which its paired sampling-mask log-probs cannot hold)") if kind == "error" else ""
        raise InvalidInput(f"rule 'finish_reason is one of {sorted(FINISH_REASON_STATUS)}' not met: got {kind!r}{cause}")
    return FINISH_REASON_STATUS[kind]


def overflow_from_error(error: Any) -> SupportOverflow | None:
    """The `SupportOverflow` an engine's refusal describes, or None when it
    is another refusal. `error` is an HTTP 400's JSON body
    (`{"error": {"message"}}` or `{"object": "error", "message", "code"}`),
    or an abort's `finish_reason` (`{"type": "abort", "status_code": 400,
    "message"}`). The support size and the cap are read from the message
    where it gives them."""
    if not isinstance(error, Mapping):
        return None
    inner = error.get("error")
    if isinstance(inner, Mapping):
        error = inner
    message = error.get("message")
    code = error.get("status_code", error.get("code", 400))
    if not isinstance(message, str) or code not in (400, "400"):
        return None
    if not (_MASK_WORDS.search(message) and _OVERFLOW_WORDS.search(message)):
        return None
    support, cap = _SUPPORT_SIZE.search(message), _CAP.search(message)
    return SupportOverflow(f"the engine refused the request: a sampled token's support outgrew its cap: {message}",
                           support=int(support.group(1)) if support else None, cap=int(cap.group(1)) if cap else None)


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
    `output_token_logprobs`, when the request asked for them, become the
    turn's `full_log_probs` (their ids must be the sampled ones).
    `output_token_sampling_logprobs` as one list per token (asked with
    `sampling_logprobs_mode="support"`) become the turn's `mask_log_probs`,
    flattened in the mask's order, each list as long as its support; the
    sampled id's entry is the token's log-prob. SGLang renormalises them
    over the support, so the turn says so (`mask_log_probs_normalized`)
    unless the reply says a support was cut to the engine's cap.
    An aborted response (`finish_reason` abort) may come without supports,
    and, when it sampled nothing, without log-probs: an engine abort
    returns neither. It gives an `aborted` turn without a mask, which cuts
    a trajectory that carries one at a replay gap (docs/semantics.md example 7).
    An abort that reports a support overflow raises `SupportOverflow`.
    With `require_mask=False` any response without supports does the same.
    """
    overflow = overflow_from_error(meta_info.get("finish_reason"))
    if overflow is not None:
        raise overflow
    for key, what in UNCARRIED_KEYS.items():
        if meta_info.get(key):
            raise LocalProtocolError("schema", f"rule 'meta_info fields a turn does not carry are refused, not dropped' "
                                               f"not met: meta_info.{key} holds {what}")
    status = status or status_from_finish_reason(meta_info)
    supports = meta_info.get(SUPPORTS_KEY)
    log_probs = meta_info.get(LOG_PROBS_KEY)
    n = len(_listed(output_ids, "output_ids"))
    if supports is None and require_mask and status != "aborted":
        raise LocalProtocolError("mask_invalid", f"response has no {SUPPORTS_KEY}; request it with return_sampling_mask")
    if log_probs is None:
        if n:
            raise LocalProtocolError("misaligned", f"response has no {LOG_PROBS_KEY} for its {n} sampled tokens")
        log_probs = ()
    for name, values in ((SUPPORTS_KEY, supports), (LOG_PROBS_KEY, log_probs)):
        if values is not None and len(_listed(values, f"meta_info.{name}")) != n:
            raise LocalProtocolError("misaligned", f"{name} has {len(values)} entries, {n} tokens were sampled")
    length = meta_info.get(SUPPORTS_LENGTH_KEY)
    if supports is not None and length is not None and length != n:
        raise LocalProtocolError("misaligned", f"rule '{SUPPORTS_LENGTH_KEY} counts the supports' not met: expected "
                                               f"{n}, got {length!r}")
    spans = None if weight_version is not None else engine_spans(meta_info.get(SPANS_KEY), f"meta_info.{SPANS_KEY}")
    if not spans and weight_version is None and meta_info.get("weight_version") is not None:
        weight_version = str(meta_info["weight_version"])
    mask: dict[str, Any] = {"supports": supports}
    per_support = _per_support(log_probs)
    if per_support or meta_info.get(SUPPORT_LOG_PROBS_KEY) is not None:
        key = LOG_PROBS_KEY if per_support else SUPPORT_LOG_PROBS_KEY
        rows = log_probs if per_support else _listed(meta_info[key], f"meta_info.{key}")
        support = _sglang_mask(supports, key)
        mask_log_probs, sampled = _support_log_probs(as_int_array(output_ids, TOKEN_DTYPE, "output_ids"), support, rows,
                                                     key, "meta_info.")
        if per_support:  # else the tokens' own log-probs are output_token_sampling_logprobs' numbers
            log_probs = sampled
        # Only support mode says a support was cut to the engine's cap, which leaves its probabilities short of 1.
        mask = {"mask": support, "mask_log_probs": mask_log_probs,
                "mask_log_probs_normalized": not (per_support and _truthy(meta_info.get(TRUNCATED_KEY)))}
    return _built(output_ids, log_probs, spans, **mask, full_log_probs=_sglang_full_log_probs(
        meta_info.get(FULL_LOG_PROBS_KEY), output_ids), loss_mask=loss_mask, forced_tokens=forced_tokens,
        status=status, weight_version=weight_version, vocab_size=vocab_size)


def _per_support(log_probs) -> bool:
    """Whether `output_token_sampling_logprobs` are SGLang's support mode
    (a list per token) rather than a number per token; refused when some
    are lists and some are not."""
    lists = sum(isinstance(row, (list, tuple)) for row in log_probs)
    if 0 < lists < len(log_probs):
        raise LocalProtocolError("schema", f"rule 'meta_info.{LOG_PROBS_KEY} is a number per token, or a list per "
                                           f"token (sampling_logprobs_mode support)' not met: {lists} of "
                                           f"{len(log_probs)} entries are lists")
    return lists > 0


def _truthy(flag) -> bool:
    """A reply's flag given once or per token: whether any is set."""
    return any(map(bool, flag)) if isinstance(flag, (list, tuple)) else bool(flag)


def _sglang_mask(supports, key: str) -> SamplingMask:
    """The mask per-support log-probs (meta_info's `key`) are aligned with."""
    if supports is None:
        raise _unpaired_log_probs(f"meta_info.{key} holds lists but there is no {SUPPORTS_KEY}")
    return SamplingMask.from_supports(supports)


def _unpaired_log_probs(got: str) -> LocalProtocolError:
    """The refusal of an engine reply whose per-support log-probs come
    without the supports they are aligned with (`got`: what it holds)."""
    return LocalProtocolError("mask_invalid", f"rule 'per-support log-probs come with their supports' not met: {got}")


def _support_log_probs(tokens: np.ndarray, mask: SamplingMask, rows, key: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """An engine's per-support log-probs (`rows`: its field `key`, named
    `where` + `key` in the rules) as the turn's `mask_log_probs`, float32 in
    the mask's CSR order, and each sampled id's entry (0.0 for a token its
    support lacks, which the in-support rule then refuses), which may serve
    as the tokens' log-probs. `rows` are one list per token, each as long as
    its support, or (not a list) one array aligned with the mask's ids.
    SGLang and vLLM share it, so both are held to the same rules. `tokens`
    are the sampled ids, already integers (named as their engine names them)."""
    sizes = np.diff(mask.offsets)
    if sizes.size != tokens.size:
        raise LocalProtocolError("misaligned", f"rule '{RULE_ALIGNED}' violated: mask covers {sizes.size} tokens, tokens "
                                               f"has {tokens.size}")
    values = _row_log_probs(rows, sizes, key, where) if isinstance(rows, (list, tuple)) else _flat_log_probs(
        rows, mask.ids.size, key, where)
    owner = np.repeat(np.arange(sizes.size), sizes)
    at = np.flatnonzero(mask.ids == tokens[owner])
    found, first = np.unique(owner[at], return_index=True)  # a duplicated id: its first entry
    sampled = np.zeros(sizes.size, dtype=LOG_PROB_DTYPE)
    sampled[found] = values[at[first]]
    return values, sampled


def _row_log_probs(rows: list | tuple, sizes: np.ndarray, key: str, where: str) -> np.ndarray:
    """One list of log-probs per token, each as long as its support (`sizes`), flattened to float32."""
    if len(rows) != sizes.size:
        raise LocalProtocolError("misaligned", f"rule '{RULE_ALIGNED}' violated: {key} has {len(rows)} entries, "
                                               f"{sizes.size} tokens were sampled")
    t = next((t for t, row in enumerate(rows) if not isinstance(row, (list, tuple, np.ndarray))), None)
    if t is not None:
        raise LocalProtocolError("schema", f"rule '{where}{key} is one list per token' not met: {key}[{t}] is "
                                           f"{type(rows[t]).__name__} {rows[t]!r:.40}")
    got = np.fromiter(map(len, rows), dtype=sizes.dtype, count=len(rows))
    if not np.array_equal(got, sizes):
        t = int(np.flatnonzero(got != sizes)[0])
        raise LocalProtocolError("misaligned", f"rule '{RULE_SUPPORT_ALIGNED}' violated at token {t}: "
                                               f"{key}[{t}] has {int(got[t])} entries, expected "
                                               f"{int(sizes[t])} (its support's ids)")
    flat: list = []
    collections.deque(map(flat.extend, rows), 0)
    if not all(map(_is_number, flat)):
        bad = next(value for value in flat if not _is_number(value))
        raise LocalProtocolError("schema", f"rule 'each of {where}{key}'s log-probs is a number' not "
                                           f"met: got {bad!r:.40}")
    try:
        with np.errstate(over="ignore"):  # past float32's range: infinite, which the log-prob rule refuses
            return np.asarray(flat, dtype=LOG_PROB_DTYPE)
    except OverflowError:  # an integer past even a double's range
        raise LocalProtocolError("schema", f"rule 'each of {where}{key}'s log-probs is a number a float "
                                           f"holds' not met: got {max(flat, key=abs)!r:.40}") from None


def _flat_log_probs(array, count: int, key: str, where: str) -> np.ndarray:
    """One array of log-probs aligned with the mask's `count` ids, as float32."""
    values = np.asarray(array)
    if values.ndim != 1 or values.dtype.kind not in "fiu":
        raise LocalProtocolError("schema", f"rule '{where}{key} is one list per token, or one array of numbers aligned "
                                           f"with the mask's ids' not met: got {type(array).__name__} of "
                                           f"{values.dtype} and shape {values.shape}")
    if values.size != count:
        raise LocalProtocolError("misaligned", f"rule '{RULE_SUPPORT_ALIGNED}' violated: {key} has {values.size} "
                                               f"entries, expected {count} (the mask's ids)")
    with np.errstate(over="ignore"):  # past float32's range: infinite, which the log-prob rule refuses
        return values.astype(LOG_PROB_DTYPE)


def sglang_chat_output(response: Mapping[str, Any], choice: int = 0) -> tuple[list[int], Mapping[str, Any]]:
    """The sampled ids and the `meta_info` of one choice of a
    `/v1/chat/completions` response asked with `return_meta_info` (and
    `return_token_ids`, or `logprobs`, for the ids): what `turn_from_sglang`
    takes. The choice's `finish_reason` stands in when its meta_info has
    none, and the response's `metadata` weight versions when it has none."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not 0 <= choice < len(choices) or not isinstance(choices[choice], Mapping):
        raise LocalProtocolError("schema", f"rule 'a chat response has choice {choice}' not met: got choices "
                                           f"{choices!r:.120}")
    picked = choices[choice]
    meta_info = picked.get("meta_info")
    if not isinstance(meta_info, Mapping):
        raise LocalProtocolError("schema", "rule 'each chat choice carries meta_info' not met (ask with "
                                           f"return_meta_info): got {meta_info!r:.80}")
    meta_info = dict(meta_info)
    if meta_info.get("finish_reason") is None and picked.get("finish_reason") is not None:
        meta_info["finish_reason"] = picked["finish_reason"]
    metadata = response.get("metadata")
    if isinstance(metadata, Mapping):
        for key in (SPANS_KEY, "weight_version"):
            if meta_info.get(key) is None and metadata.get(key) is not None:
                meta_info[key] = metadata[key]
    return sampled_ids({"output_ids": picked.get("response_token_ids", meta_info.get("output_ids")),
                        "meta_info": meta_info}), meta_info


def turn_from_sglang_chat(response: Mapping[str, Any], *, choice: int = 0, **options) -> Turn:
    """A `Turn` from one `/v1/chat/completions` response asked with
    `return_meta_info` and `return_sampling_mask` (`sglang_chat_output`,
    then `turn_from_sglang` with `options`)."""
    return turn_from_sglang(*sglang_chat_output(response, choice), **options)


def sampled_ids(response: Mapping[str, Any]) -> list[int]:
    """The generated ids of an SGLang response: `output_ids`, or the ids in
    `meta_info.output_token_logprobs` (`[logprob, id, text]` entries)."""
    if response.get("output_ids") is not None:
        return response["output_ids"]
    meta_info = response.get("meta_info")
    entries = meta_info.get(FULL_LOG_PROBS_KEY) if isinstance(meta_info, Mapping) else None
    if entries is None:
        raise LocalProtocolError("schema", "rule 'a response names its sampled ids' not met: it has neither output_ids "
                                           f"(response_token_ids in chat) nor meta_info.{FULL_LOG_PROBS_KEY}")
    return [entry[1] for entry in _log_prob_entries(entries)]


def _log_prob_entries(entries) -> list:
    """`output_token_logprobs` checked to be `[log-prob, id, ...]` per token,
    the log-prob a number or null."""
    if not isinstance(entries, list) or not all(
            isinstance(e, (list, tuple)) and len(e) >= 2 and (e[0] is None or _is_number(e[0]))
            for e in entries):
        raise LocalProtocolError("schema", f"rule 'meta_info.{FULL_LOG_PROBS_KEY} is [log-prob, id, text] per token' "
                                           f"not met: got {entries!r:.120}")
    return entries


def _sglang_full_log_probs(entries, output_ids) -> np.ndarray | None:
    """`output_token_logprobs` (`[log-prob, id, text]` per token) as an
    array, after checking that they are the sampled tokens'."""
    if entries is None:
        return None
    ids = [e[1] for e in _log_prob_entries(entries)]
    if ids != list(output_ids):
        raise LocalProtocolError("misaligned", f"rule '{FULL_LOG_PROBS_KEY} belong to the sampled tokens' not "
                                               f"met: expected ids {list(output_ids)!r:.120}, got {ids!r:.120}")
    return np.array([np.nan if e[0] is None else e[0] for e in entries], dtype=np.float32)


def turn_from_vllm(
    output,
    *,
    forced_tokens=None,
    loss_mask=None,
    status: str | None = None,
    weight_version: str | None = None,
    vocab_size: int | None = None,
    require_mask: bool = True,
) -> Turn:
    """A `Turn` from one vLLM completion with its sampling mask: a
    `CompletionOutput` (`token_ids`, `logprobs` as one `{id: Logprob}` per
    token, `finish_reason`, `sampling_mask`) or one choice of the JSON
    `/inference/v1/generate` returns (`token_ids`, `logprobs.content`,
    `finish_reason`, `sampling_mask`, `weight_versions`). The mask may be
    one id list per token, CSR (`token_ids` flat with `offsets`), or vLLM's
    in-engine bitset (uint8 rows of ceil(V/8) bytes, least significant bit
    first). The log-probs are vLLM's, over the processed distribution that
    mask replay requires (`logprobs_mode=processed_logprobs`). Its
    `sampling_mask_logprobs` (`--return-sampling-mask-logprobs`: one list
    per token, each as long as its support, or one array aligned with a
    CSR mask's ids) become the turn's `mask_log_probs`, said renormalised
    over the support as vLLM computes them; without `logprobs`, their
    sampled ids' entries are the tokens' log-probs. The same checks as
    `turn_from_sglang` apply."""
    read = output.get if isinstance(output, Mapping) else lambda key: getattr(output, key, None)
    if read("routed_experts") is not None:
        raise LocalProtocolError("schema", "rule 'fields a turn does not carry are refused, not dropped' not met: the "
                                           "output holds routed_experts (decode them and pass routed_experts= to "
                                           "Turn.build)")
    ids = read("token_ids")
    if ids is None:
        raise LocalProtocolError("schema", "rule 'a vLLM output names its sampled token_ids' not met: got none")
    ids = list(_listed(ids, "token_ids"))
    status = status or status_from_finish_reason({"finish_reason": read("finish_reason")})
    mask = _vllm_mask(read("sampling_mask"))
    if mask is None and require_mask and status != "aborted":
        raise LocalProtocolError("mask_invalid", "the output has no sampling_mask; start vLLM with "
                                                 "--return-sampling-mask")
    logprobs, rows = read("logprobs"), read(VLLM_SUPPORT_LOG_PROBS_KEY)
    mask_log_probs = sampled = None
    if rows is not None:
        if mask is None:
            raise _unpaired_log_probs(f"the output holds {VLLM_SUPPORT_LOG_PROBS_KEY} but no sampling_mask")
        tokens = as_int_array(ids, TOKEN_DTYPE, "token_ids")
        mask_log_probs, sampled = _support_log_probs(tokens, mask, rows, VLLM_SUPPORT_LOG_PROBS_KEY, "")
    log_probs = sampled if sampled is not None and logprobs is None else _vllm_log_probs(logprobs, ids)
    spans = None if weight_version is not None else engine_spans(read(SPANS_KEY), SPANS_KEY)
    return _built(ids, log_probs, spans, mask=mask, mask_log_probs=mask_log_probs,
                  mask_log_probs_normalized=mask_log_probs is not None, loss_mask=loss_mask, forced_tokens=forced_tokens,
                  status=status, weight_version=weight_version, vocab_size=vocab_size)


def _vllm_mask(mask) -> SamplingMask | None:
    if mask is None:
        return None
    if isinstance(mask, (list, tuple)):  # the JSON form: one id list per token
        return SamplingMask.from_supports(mask)
    offsets = getattr(mask, "offsets", None)
    token_ids = getattr(mask, "token_ids", None)
    if offsets is not None:
        return SamplingMask(token_ids, offsets)
    if token_ids is not None:
        return SamplingMask.from_supports(token_ids)
    bits = np.asarray(mask)
    if bits.ndim == 2 and bits.dtype == np.uint8:
        return SamplingMask.from_bitset(bits)
    raise LocalProtocolError("schema", "rule 'a vLLM sampling_mask is id lists, CSR (token_ids, offsets) or uint8 "
                                       f"bitset rows' not met: got {type(mask).__name__} {mask!r:.80}")


def _vllm_log_probs(logprobs, ids: list[int]) -> list:
    """The sampled tokens' log-probs from vLLM's `logprobs`: JSON
    `{"content": [{"token_id", "logprob"}]}` or one `{id: Logprob}` per token."""
    if logprobs is None:
        if ids:
            raise LocalProtocolError("misaligned", f"the output has no logprobs for its {len(ids)} sampled tokens; ask "
                                                   "with sampling_params.logprobs=0")
        return []
    entries = _listed(logprobs.get("content") if isinstance(logprobs, Mapping) else logprobs, "logprobs.content")
    if len(entries) != len(ids):
        raise LocalProtocolError("misaligned", f"logprobs has {len(entries)} entries, {len(ids)} tokens were sampled")
    out = []
    for position, (token, entry) in enumerate(zip(ids, entries)):
        if isinstance(entry, Mapping) and "token_id" in entry:  # the JSON form
            if entry["token_id"] != token:
                raise LocalProtocolError("misaligned", f"rule 'logprobs belong to the sampled tokens' not met at position "
                                                       f"{position}: expected id {token}, got {entry['token_id']}")
            out.append(entry.get("logprob"))
        elif isinstance(entry, Mapping) and isinstance(token, int) and token in entry:  # {id: Logprob}
            value = entry[token]
            out.append(getattr(value, "logprob", value))
        else:
            raise LocalProtocolError("misaligned", f"rule 'logprobs belong to the sampled tokens' not met at position "
                                                   f"{position}: no log-prob for sampled id {token} in {entry!r:.80}")
    if not all(map(_is_number, out)):
        raise LocalProtocolError("schema", f"rule 'each log-prob is a number' not met: got {out!r:.120}")
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _built(ids, log_probs, spans, *, weight_version, **turn) -> Turn:
    """`Turn.build` with an engine's spans: the turn's version is the first
    span's, and spans that say no more than one version over the turn go."""
    if spans:
        weight_version = spans[0][0]
        if len(spans) == 1 and spans[0][1:] == (0, len(ids)):
            spans = None
    return Turn.build(ids, log_probs, weight_version=weight_version, weight_version_spans=spans or None, **turn)


def engine_spans(value, where: str) -> list[tuple[str, int, int]] | None:
    """An engine's per-token weight versions (SGLang's and vLLM's
    `weight_versions`: `{"version", "start", "end"}` maps, `[version,
    start, end]` arrays, or objects with those attributes) as rollstream's
    (version, start, end) spans, empty ones left out; None when it sent
    none. Their order and bounds are checked where the turn is built
    (`Turn.build`)."""
    if value is None:
        return None
    triples = []
    for span in value if isinstance(value, list) else ():
        if isinstance(span, Mapping):
            triple: tuple[Any, ...] = (span.get("version"), span.get("start"), span.get("end"))
        elif isinstance(span, (list, tuple)) and len(span) == 3:
            triple = tuple(span)
        else:
            triple = (getattr(span, "version", None), getattr(span, "start", None), getattr(span, "end", None))
        triples.append(triple)
    if not isinstance(value, list) or not all(
            v is not None and type(s) is int and type(e) is int for v, s, e in triples):
        raise LocalProtocolError("schema", f"rule '{where} is a list of {{version, start, end}} with integer bounds' "
                                           f"not met: got {value!r:.200}")
    return [(str(v), int(s), int(e)) for v, s, e in triples if e > s]
