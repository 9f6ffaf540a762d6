"""miles per-turn samples as rollstream turns (docs/semantics.md §4).

miles records a multi-turn rollout as one `Sample` per engine call whose
`tokens` is the whole context so far (prompt, earlier responses, tool
output) followed by this call's `response_length` sampled tokens. Its merge
(`merge_samples`) folds them left to right; here each fold step instead
yields a turn whose forced tokens are the observation between two samples:
`b.tokens[len(a.tokens) : len(b.tokens) - b.response_length]`.

A sample whose response holds several engine calls (miles' multi-turn
generation appends each call and the tool output after it to one sample)
yields a turn per call, as its per-call samples would: miles' train data
lists the weight versions per call, and so does a trajectory per turn. The
tokens between two calls become the earlier turn's forced tokens, which
they must already be (loss 0, log-prob 0.0, each its own support).

The walk stops where miles' merge stops: after a turn that is not
`completed`, and after a turn that introduces a replay gap (a replay field the
previous samples carried is missing). The gap turn itself is kept, so the
broker records the gap; later samples are counted as dropped. Each merged
pair is checked with miles' conditions: both samples `validate()`, `b.tokens`
starts with `a.tokens`, the observation is non-empty, and a mask on `b` needs
one on `a` (replay arrays cannot shrink: `validate()` ties their rows to
`len(tokens) - 1`, and `b.tokens` is longer).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

from rollstream.common.contract import STATUSES
from rollstream.common.errors import InvalidInput
from rollstream.common.mask import SamplingMask, as_numpy
from rollstream.common.miles import MASK_LOG_PROBS, SESSION_FIELDS
from rollstream.common.trajectory import Turn

_REPLAY = {"rollout_sampling_mask": "mask", "rollout_routed_experts": "routed_experts",
           "rollout_indexer_topk": "indexer_topk", "rollout_sampling_mask.logprobs": "mask_log_probs"}


class MilesMergeError(InvalidInput):
    """Per-turn samples that miles' merge would refuse to merge."""


@dataclass(frozen=True)
class MilesTurns:
    """A trajectory recovered from per-turn samples: its prompt, the turns to
    send, and how many trailing samples the merge never reaches."""

    prompt_tokens: np.ndarray
    turns: list[Turn]
    dropped: int
    unknown_fields: tuple[str, ...] = ()  # on the samples, not in miles' field table as rollstream reads it: not sent


@dataclass(frozen=True)
class _Sample:
    index: int
    tokens: np.ndarray
    response_length: int
    loss_mask: Any
    log_probs: Any
    mask: SamplingMask | None
    mask_log_probs: np.ndarray | None  # the support's log-probs, aligned with mask.ids
    routed_experts: np.ndarray | None
    indexer_topk: np.ndarray | None
    status: str
    weight_version: str | None
    weight_version_spans: tuple[tuple[str, int, int], ...] | None
    call: int = 0  # which engine call of its sample this is: the turns of one sample follow one another

    def carries(self, field: str) -> bool:
        return getattr(self, field) is not None

    @property
    def response(self) -> np.ndarray:
        return self.tokens[len(self.tokens) - self.response_length :]


def _field(sample: Any, name: str) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(name)
    return getattr(sample, name, None)


def _mask(value: Any, index: int) -> SamplingMask | None:
    """A `SamplingMask`, a list of supports, or miles' `RolloutSamplingMask`."""
    if value is None or isinstance(value, SamplingMask):
        return value
    for ids, offsets in (("ids", "offsets"), ("_ids", "_offsets")):
        if hasattr(value, ids) and hasattr(value, offsets):
            return SamplingMask(as_numpy(getattr(value, ids)), as_numpy(getattr(value, offsets)))
    try:
        return SamplingMask.from_supports(value)
    except TypeError:
        raise MilesMergeError(f"sample {index}: rollout_sampling_mask must be a sampling mask or a list of supports, "
                              f"got {type(value).__name__}") from None


def _mask_log_probs(sample: Any, mask_value: Any) -> np.ndarray | None:
    """The support's log-probs: a decoded sample's `mask_log_probs`, or those
    miles keeps on its mask object (`logprobs`)."""
    values = _field(sample, MASK_LOG_PROBS)
    if values is None:
        values = getattr(mask_value, "logprobs", None)
    return None if values is None else as_numpy(values)


def _status(value: Any, index: int) -> str:
    status = getattr(value, "value", value)  # miles' Sample.Status enum or its string
    if status not in STATUSES:
        raise MilesMergeError(f"sample {index}: status must be one of {list(STATUSES)} to be streamed, got {status!r}")
    return status


def _spans(call: Any, index: int) -> list[tuple[str, int, int]]:
    """One engine call's weight-version spans as (version, abs_start,
    abs_end): miles' per-call object (`.spans`), or its list of span dicts."""
    spans = getattr(call, "spans", call)
    if not isinstance(spans, (list, tuple)):
        raise MilesMergeError(f"sample {index}: rule 'weight_versions holds one list of spans per engine call' violated: "
                              f"expected a list of spans, got {type(spans).__name__}")
    out = []
    for span in spans:
        version, start, end = (_field(span, key) for key in ("version", "abs_start", "abs_end"))
        if not isinstance(version, str) or not version or not all(isinstance(v, int) for v in (start, end)):
            raise MilesMergeError(f"sample {index}: rule 'a weight-version span is a non-empty version with integer "
                                  f"abs_start and abs_end' violated: got {span!r:.120}")
        out.append((version, start, end))
    return out


def _calls(versions: Any, tokens: np.ndarray, response_length: int, index: int) -> list[list[tuple[str, int, int]]]:
    """The engine calls that sampled this sample's response, in token
    order: each its spans over the response, in response positions. miles
    records one list of spans per engine call, each placed by absolute
    token position, so calls over earlier samples' responses are left out,
    and so are calls without a version."""
    start, end = len(tokens) - response_length, len(tokens)
    calls = [sorted((version, max(begin, start) - start, min(stop, end) - start)
                    for version, begin, stop in _spans(call, index) if stop > start and begin < end)
             for call in versions]
    return sorted((call for call in calls if call), key=lambda call: call[0][1])


def _versioned(spans: Sequence[tuple[str, int, int]], length: int) -> tuple[str, tuple[tuple[str, int, int], ...] | None]:
    """A turn's version (its first token's: the oldest weights in it) and,
    where the weights changed within its `length` tokens, its spans (None
    when one version covers them all)."""
    over = tuple((version, begin, end) for version, begin, end in sorted(spans, key=lambda span: span[1]))
    return over[0][0], None if over == ((over[0][0], 0, length),) else over


def _read(sample: Any, index: int) -> list[_Sample]:
    """`sample`, one `_Sample` per engine call of its response (`_split`)."""
    tokens = np.asarray(as_numpy(_field(sample, "tokens")))
    length = _field(sample, "response_length")
    try:
        response_length = int(length) if length is not None else -1
    except (TypeError, ValueError):
        raise MilesMergeError(f"sample {index}: rule 'response_length is a count of tokens' violated: expected an "
                              f"integer, got {type(length).__name__} {length!r:.80}") from None
    replay = {name: _field(sample, name) for name in ("rollout_routed_experts", "rollout_indexer_topk")}
    mask_value = _field(sample, "rollout_sampling_mask")
    whole = _Sample(
        index=index,
        tokens=tokens,
        response_length=response_length,
        loss_mask=_field(sample, "loss_mask"),
        log_probs=_field(sample, "rollout_log_probs"),
        mask=_mask(mask_value, index),
        mask_log_probs=_mask_log_probs(sample, mask_value),
        routed_experts=None if replay["rollout_routed_experts"] is None else as_numpy(replay["rollout_routed_experts"]),
        indexer_topk=None if replay["rollout_indexer_topk"] is None else as_numpy(replay["rollout_indexer_topk"]),
        status=_status(_field(sample, "status"), index),
        weight_version=None,
        weight_version_spans=None,
    )
    versions = _field(sample, "weight_versions") or []
    if not isinstance(versions, (list, tuple)):
        raise MilesMergeError(f"sample {index}: rule 'weight_versions holds one list of spans per engine call' violated: "
                              f"expected a list, got {type(versions).__name__} {versions!r:.80}")
    if versions and all(isinstance(v, str) for v in versions):  # miles' legacy form: a string per call, this one's last
        return [replace(whole, weight_version=versions[-1])]
    calls = _calls(versions, tokens, response_length, index)
    if len(calls) < 2:
        version, spans = _versioned(calls[0], response_length) if calls else (None, None)
        return [replace(whole, weight_version=version, weight_version_spans=spans)]
    _validate(whole)
    return _split(whole, calls)


def _split(s: _Sample, calls: list[list[tuple[str, int, int]]]) -> list[_Sample]:
    """A sample holding several engine calls as one `_Sample` per call, as
    miles' per-call samples would have been before its merge: each call's
    tokens run from its first span to its last (the first call's from the
    response's start, the last's to its end), and what lies between two
    calls is the observation the next one's walk takes as forced tokens."""
    bounds = [[call[0][1], call[-1][2]] for call in calls]
    bounds[0][0], bounds[-1][1] = 0, s.response_length
    for (_, end), (begin, _) in zip(bounds, bounds[1:]):
        if begin < end:
            raise MilesMergeError(f"sample {s.index}: rule 'the engine calls of a sample follow one another' violated: "
                                  f"expected a call to begin at response position {end} or later, got {begin} "
                                  f"(calls at {bounds})")
        _check_observation(s, end, begin)
    prompt = len(s.tokens) - s.response_length
    pieces = []
    for call, (spans, (begin, end)) in enumerate(zip(calls, bounds)):
        rows = slice(0, prompt + end - 1)  # a replay array covers the call's whole context, less its last token
        version, over = _versioned([(v, b - begin, e - begin) for v, b, e in spans], end - begin)
        pieces.append(replace(
            s, tokens=s.tokens[: prompt + end], response_length=end - begin,
            loss_mask=None if s.loss_mask is None else s.loss_mask[begin:end],
            log_probs=None if s.log_probs is None else s.log_probs[begin:end],
            mask=None if s.mask is None else _mask_slice(s.mask, begin, end),
            mask_log_probs=(None if s.mask is None or s.mask_log_probs is None
                            else s.mask_log_probs[s.mask.offsets[begin]:s.mask.offsets[end]]),
            routed_experts=None if s.routed_experts is None else s.routed_experts[rows],
            indexer_topk=None if s.indexer_topk is None else s.indexer_topk[rows],
            status=s.status if call == len(calls) - 1 else "completed",
            weight_version=version, weight_version_spans=over, call=call))
    return pieces


def _mask_slice(mask: SamplingMask, begin: int, end: int) -> SamplingMask:
    offsets = mask.offsets[begin : end + 1]
    return SamplingMask(mask.ids[offsets[0] : offsets[-1]], offsets - offsets[0])


def _check_observation(s: _Sample, begin: int, end: int) -> None:
    """The tokens at response positions [begin, end) of `s`, between two
    of its engine calls, become forced tokens: they must already be what
    forced tokens are (loss 0, log-prob 0.0, each its own support), as
    miles appends a tool's output, or the turns would change the data."""
    n = end - begin
    loss = [1] * n if s.loss_mask is None else [int(v) for v in np.asarray(s.loss_mask[begin:end])]  # miles' default
    log_probs = [0.0] * n if s.log_probs is None else [float(v) for v in np.asarray(s.log_probs[begin:end])]
    supports = None if s.mask is None else [s.mask[t].tolist() for t in range(begin, end)]
    certain = (None if s.mask is None or s.mask_log_probs is None
               else [float(v) for v in s.mask_log_probs[s.mask.offsets[begin]:s.mask.offsets[end]]])
    own = [[int(t)] for t in s.response[begin:end]]
    if loss != [0] * n or log_probs != [0.0] * n or supports not in (None, own) or certain not in (None, [0.0] * n):
        expected, got = f"loss_mask {[0] * n}, log-probs {[0.0] * n}", f"loss_mask {loss}, log-probs {log_probs}"
        if supports is not None:
            expected, got = f"{expected}, supports {own}", f"{got}, supports {supports}"
        if certain is not None:
            expected, got = f"{expected}, support log-probs {[0.0] * n}", f"{got}, support log-probs {certain}"
        raise MilesMergeError(f"sample {s.index}: rule 'the tokens between two engine calls of a sample are an "
                              f"observation (loss_mask 0, log-prob 0.0, each token its own support)' violated at "
                              f"response positions [{begin}, {end}): expected {expected}, got {got}")


def _validate(s: _Sample) -> None:
    """miles' `Sample.validate()` on the fields that cross."""
    def fail(rule: str, expected, actual) -> MilesMergeError:
        return MilesMergeError(f"sample {s.index}: rule '{rule}' violated: expected {expected}, got {actual}")

    if s.response_length < 0:
        raise fail("response_length >= 0", ">= 0", s.response_length)
    if len(s.tokens) < s.response_length:
        raise fail("len(tokens) >= response_length", f">= {s.response_length}", len(s.tokens))
    for name, values in (("loss_mask", s.loss_mask), ("rollout_log_probs", s.log_probs), ("rollout_sampling_mask", s.mask)):
        if values is not None and len(values) != s.response_length:
            raise fail(f"len({name}) == response_length", s.response_length, len(values))
    for name, values in (("rollout_routed_experts", s.routed_experts), ("rollout_indexer_topk", s.indexer_topk)):
        if values is not None and len(values) != len(s.tokens) - 1:
            raise fail(f"len({name}) == len(tokens) - 1", len(s.tokens) - 1, len(values))
    if s.mask_log_probs is not None and (s.mask is None or len(s.mask_log_probs) != len(s.mask.ids)):
        raise fail("len(rollout_sampling_mask.logprobs) == len(rollout_sampling_mask.ids)",
                   "no log-probs without a mask" if s.mask is None else len(s.mask.ids), len(s.mask_log_probs))


def _gap(a: _Sample, b: _Sample) -> bool:
    return any(a.carries(field) and not b.carries(field) for field in _REPLAY.values())


def _observation(a: _Sample, b: _Sample) -> np.ndarray:
    """The tokens between two merged samples, checked as miles' merge checks."""
    _validate(a)
    _validate(b)
    if len(b.tokens) < len(a.tokens) or not np.array_equal(b.tokens[: len(a.tokens)], a.tokens):
        mismatch = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), min(len(a.tokens), len(b.tokens)))
        raise MilesMergeError(
            f"samples {a.index} -> {b.index}: rule 'b.tokens must start with a.tokens' violated: "
            f"expected the {len(a.tokens)} tokens of sample {a.index} as a prefix, first difference at position "
            f"{mismatch} (sample {b.index} has {len(b.tokens)} tokens)"
        )
    obs_len = len(b.tokens) - len(a.tokens) - b.response_length
    if obs_len <= 0 and not b.call:  # two calls of one sample may follow one another at once
        raise MilesMergeError(f"samples {a.index} -> {b.index}: rule 'obs_len > 0' violated: expected a non-empty "
                              f"observation between the turns, got obs_len={obs_len}")
    if b.mask is not None and a.mask is None:
        raise MilesMergeError(f"samples {a.index} -> {b.index}: rule 'both turns carry a complete rollout sampling mask' "
                              f"violated: expected a mask on sample {a.index} too, got none")
    return b.tokens[len(a.tokens) : len(a.tokens) + obs_len]


def _turn(s: _Sample, forced: np.ndarray | None, vocab_size: int | None) -> Turn:
    log_probs = np.zeros(s.response_length) if s.log_probs is None else s.log_probs  # miles' default
    return Turn.build(s.response, log_probs, mask=s.mask, mask_log_probs=s.mask_log_probs, loss_mask=s.loss_mask,
                      forced_tokens=forced,
                      routed_experts=s.routed_experts, indexer_topk=s.indexer_topk, status=s.status,
                      weight_version=s.weight_version, weight_version_spans=s.weight_version_spans,
                      vocab_size=vocab_size)


def turns_from_miles_samples(samples: Sequence[Any], *, vocab_size: int | None = None) -> MilesTurns:
    """Turns (with forced tokens derived from the full token lists) from
    miles per-turn samples: dicts as `decode_session_samples` gives them, or
    objects with the same attributes (miles' `Sample`)."""
    if not samples:
        raise MilesMergeError("no samples: a trajectory needs at least one turn")
    read = [call for i, sample in enumerate(samples) for call in _read(sample, i)]
    _validate(read[0])  # the prompt is what precedes its response
    prompt = read[0].tokens[: len(read[0].tokens) - read[0].response_length]
    turns: list[Turn] = []
    acc = read[0]
    for b in read[1:]:
        if acc.status != "completed":
            break
        if _gap(acc, b):  # the gap turn goes too, so the broker records the gap; acc's forced tokens would be cut
            turns.append(_turn(acc, None, vocab_size))
            acc = b
            break
        turns.append(_turn(acc, _observation(acc, b), vocab_size))
        acc = b
    turns.append(_turn(acc, None, vocab_size))
    unknown = sorted({name for sample in samples if isinstance(sample, Mapping) for name in sample}
                     - {*SESSION_FIELDS, MASK_LOG_PROBS})
    return MilesTurns(prompt, turns, dropped=len(samples) - acc.index - 1, unknown_fields=tuple(unknown))
