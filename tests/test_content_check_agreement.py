"""The broker's fast content check (`messages_content_valid`, one packed
pass over a batch of turn frames) accepts exactly the messages in which
`packed_violations`, the rule-by-rule check that explains refusals, finds
nothing wrong as it checks a turn: the broker can trust the fast path. And
the producer, the broker and the consumer apply one log-prob rule."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.common.contract import LOG_PROB_TOLERANCE
from rollstream.common.errors import LocalProtocolError
from rollstream.common.trajectory import Turn
from rollstream.common.validation import (
    LOG_PROB_RULES,
    RULE_CODES,
    RULE_LOG_PROBS,
    RULE_MASK_VOCAB,
    RULE_NONEMPTY_SUPPORT,
    RULE_OFFSETS_END,
    RULE_OFFSETS_START,
    RULE_TOKEN_VOCAB,
    Verdict,
    check_message_arrays,
    csr_flags,
    locate_csr_violations,
    locate_violations,
    messages_content_valid,
    packed_flags,
    packed_violations,
)

VOCAB = 8
# Mostly inside the vocabulary, its edges past both sides.
_IDS = st.integers(0, 3 * VOCAB).map(lambda i: -1 if i == 0 else VOCAB if i == 1 else i % VOCAB)


@st.composite
def _messages(draw):
    """One turn's arrays, often valid, often not: supports with repeated and
    out-of-vocabulary ids, empty supports, offsets that do not start at 0
    or end at the ids' length, tokens outside their supports, loss masks of
    2, log-probs (and full log-probs, sometimes one too many or too few, and
    the supports' log-probs, sometimes one too many or too few for the
    support ids or without a mask at all) of 0.0, a rounding above it,
    +0.5, -inf, +inf and NaN."""
    n = draw(st.integers(0, 4))
    supports = [draw(st.lists(_IDS, min_size=0 if draw(st.integers(0, 9)) == 0 else 1, max_size=3)) for _ in range(n)]
    tokens = [draw(st.sampled_from(s)) if s and draw(st.integers(0, 7)) else draw(_IDS) for s in supports]
    arrays = {"tokens": np.array(tokens, np.int32)}
    if draw(st.booleans()):
        size = max(0, n + draw(st.sampled_from([0, 0, 0, 0, 0, 0, 1, -1])))
        arrays["log_probs"] = np.array(draw(st.lists(st.sampled_from([-0.5, 0.0, 0.0, -np.inf, 1e-6, 0.5, np.inf, np.nan]),
                                                     min_size=size, max_size=size)), np.float32)
    if draw(st.booleans()):
        size = max(0, n + draw(st.sampled_from([0, 0, 0, 0, 1, -1])))
        arrays["full_log_probs"] = np.array(draw(st.lists(st.sampled_from([-0.5, 0.0, -np.inf, 1e-6, 0.5, np.inf, np.nan]),
                                                          min_size=size, max_size=size)), np.float32)
    if draw(st.booleans()):
        size = max(0, n + draw(st.sampled_from([0, 0, 0, 0, 0, 0, 1, -1])))
        arrays["loss_mask"] = np.array(draw(st.lists(st.sampled_from([0, 1, 0, 1, 0, 1, 2]), min_size=size, max_size=size)),
                                       np.uint8)
    if draw(st.booleans()):
        ids = [i for s in supports for i in s]
        offsets = np.cumsum([0, *map(len, supports)])
        if draw(st.integers(0, 7)) == 0:
            offsets[0] += 1
        if draw(st.integers(0, 7)) == 0:
            offsets[-1] -= 1
        if draw(st.integers(0, 9)) == 0:  # an entry too many or too few
            offsets = np.append(offsets, offsets[-1]) if draw(st.booleans()) or len(offsets) < 2 else offsets[1:]
        arrays["mask_ids"], arrays["mask_offsets"] = np.array(ids, np.int32), offsets.astype(np.int64)
    if draw(st.booleans()):
        n_ids = sum(map(len, supports)) if "mask_ids" in arrays or draw(st.integers(0, 3)) else draw(st.integers(0, 2))
        size = max(0, n_ids + draw(st.sampled_from([0, 0, 0, 0, 1, -1])))
        arrays["mask_log_probs"] = np.array(draw(st.lists(st.sampled_from([-0.5, 0.0, -np.inf, 1e-6, 0.5, np.inf, np.nan]),
                                                          min_size=size, max_size=size)), np.float32)
    for name in ("prompt_tokens", "forced_tokens"):
        if draw(st.booleans()):
            arrays[name] = np.array(draw(st.lists(_IDS, max_size=2)), np.int32)
    return arrays


def _nothing_wrong(arrays, vocab_size):
    """`packed_violations` over everything the message carries: its response
    with its mask, loss mask and log-probs, and its prompt and forced tokens."""
    tokens = arrays["tokens"]
    offsets = arrays.get("mask_offsets")
    if offsets is not None and (len(offsets) != len(tokens) + 1 or offsets[0] != 0 or offsets[-1] != len(arrays["mask_ids"])):
        return False  # CSR framing packed_violations takes as given (check_message_structure's rules)
    if any(name in arrays and len(arrays[name]) != len(tokens) for name in ("log_probs", "loss_mask")):
        return False  # alignment too
    full = {"full_log_probs": arrays["full_log_probs"]} if "full_log_probs" in arrays else None
    supports = {"mask_log_probs": arrays["mask_log_probs"]} if "mask_log_probs" in arrays else None
    found = packed_violations(tokens, [len(tokens)], arrays.get("mask_ids"), offsets, vocab_size=vocab_size,
                              loss_mask=arrays.get("loss_mask"), log_probs=arrays.get("log_probs"), token_log_probs=full,
                              support_log_probs=supports, marks_forced=False)
    for name in ("prompt_tokens", "forced_tokens"):
        values = arrays.get(name)
        if values is not None:
            found += packed_violations(values, [len(values)], vocab_size=vocab_size)
    return not found


@pytest.mark.slow
@settings(max_examples=1500, deadline=None)
@given(st.lists(_messages(), min_size=1, max_size=5), st.sampled_from([VOCAB, None]))
def test_the_fast_content_check_accepts_exactly_what_packed_violations_finds_nothing_wrong_with(batch, vocab_size):
    expected = all(_nothing_wrong(arrays, vocab_size) for arrays in batch)
    assert messages_content_valid(batch, vocab_size) == expected, [
        (i, _nothing_wrong(arrays, vocab_size), messages_content_valid([arrays], vocab_size)) for i, arrays in enumerate(batch)]


def test_a_sampled_token_with_loss_0_and_log_prob_0_may_have_a_wide_support():
    """A turn's tokens are all sampled (its forced tokens travel apart): a
    certain token (log-prob 0.0 in float32) left out of the loss still has
    the support its sampler had, top-k ids say, and the turn is valid. Only
    a merged trajectory reads loss 0 with log-prob 0.0 as a forced token."""
    arrays = {"tokens": np.array([2], np.int32), "log_probs": np.array([0.0], np.float32),
              "loss_mask": np.array([0], np.uint8), "mask_ids": np.array([2, 5], np.int32),
              "mask_offsets": np.array([0, 2], np.int64)}
    assert messages_content_valid([arrays], VOCAB)
    check_message_arrays(arrays, vocab_size=VOCAB)
    merged = packed_violations(arrays["tokens"], [1], arrays["mask_ids"], arrays["mask_offsets"],
                               loss_mask=arrays["loss_mask"], log_probs=arrays["log_probs"])
    assert [v.rule for v in merged] == ["forced tokens (loss_mask 0, log_prob 0.0) have the singleton support [token]"]


_ABOVE_TOLERANCE = float(np.nextafter(np.float32(LOG_PROB_TOLERANCE), np.float32(1)))


def _log_prob_verdicts(log_prob: float, field: str) -> dict[str, str | None]:
    """The rule each check names for a turn whose last log-prob of `field`
    (`log_probs`, `full_log_probs`, or `mask_log_probs`: its last support
    id's) is `log_prob` (None: it passes), on every path a log-prob meets.
    Its last token has loss 0 and a singleton support, so read in a merged
    trajectory it is a forced token when the log-prob is exactly 0.0."""
    torch = pytest.importorskip("torch")
    rule = LOG_PROB_RULES[field]
    tokens, tested = np.array([2, 3], np.int32), np.array([-0.25, log_prob], np.float32)
    loss_mask, ids, offsets = np.array([1, 0], np.uint8), np.array([2, 5, 3], np.int32), np.array([0, 2, 3], np.int64)
    log_probs = tested if field == "log_probs" else np.array([-0.25, 0.0], np.float32)
    full = {"full_log_probs": tested} if field == "full_log_probs" else {}
    supports = {"mask_log_probs": np.array([-0.25, -1.5, log_prob], np.float32)} if field == "mask_log_probs" else {}
    arrays = {"tokens": tokens, "log_probs": log_probs, "loss_mask": loss_mask, "mask_ids": ids, "mask_offsets": offsets,
              **full, **supports}
    valid = {**arrays, field: np.array([-0.25, -1.0, -1.0][: len(arrays[field])], np.float32)}
    verdicts: dict[str, str | None] = {}
    try:
        Turn.build(tokens.tolist(), log_probs.tolist(), supports=[[2, 5], [3]], loss_mask=loss_mask, vocab_size=VOCAB,
                   full_log_probs=full.get("full_log_probs"), mask_log_probs=supports.get("mask_log_probs"))
        verdicts["producer"] = None
    except LocalProtocolError as error:
        verdicts["producer"] = f"{error.code}: {error.message}"
    try:
        check_message_arrays(arrays, vocab_size=VOCAB)
        verdicts["broker, explained"] = None
    except LocalProtocolError as error:
        verdicts["broker, explained"] = f"{error.code}: {error.message}"
    for name, batch in (("broker, fast", [arrays]), ("broker, fast, packed with others", [valid, arrays, valid])):
        verdicts[name] = None if messages_content_valid(batch, VOCAB) else rule
    for name, convert in (("consumer, numpy", np.asarray), ("consumer, torch", torch.from_numpy)):
        packed = [convert(a) for a in (tokens, np.array([2]), ids, offsets)]
        options = dict(vocab_size=VOCAB, loss_mask=convert(loss_mask), log_probs=convert(log_probs),
                       token_log_probs={key: convert(values) for key, values in full.items()},
                       support_log_probs={key: convert(values) for key, values in supports.items()})
        verdicts[f"{name}, verdict"] = None if Verdict(packed_flags(*packed, **options)).passed() else rule
        located = locate_violations(*packed, **options)
        verdicts[f"{name}, located"] = "; ".join(f"{v.rule} at {v.position}: {v.detail}" for v in located) or None
    return verdicts


@pytest.mark.parametrize("field, value", [("log_probs", "log_prob is "), ("full_log_probs", "full_log_prob is "),
                                          ("mask_log_probs", "its support holds a mask_log_prob of ")])
@pytest.mark.parametrize("log_prob, passes", [
    (0.5, False), (np.inf, False), (-np.inf, False), (np.nan, False), (_ABOVE_TOLERANCE, False),
    (1e-6, True), (0.0, True), (-0.0, True), (LOG_PROB_TOLERANCE, True), (-80.0, True),
], ids=["+0.5", "+inf", "-inf", "NaN", "past-tolerance", "+1e-6", "0.0", "-0.0", "tolerance", "-80"])
def test_producer_broker_and_consumer_apply_one_log_prob_rule(log_prob, passes, field, value):
    """A log-prob a rounding above 0 passes everywhere; one past the
    tolerance, infinite or NaN is refused everywhere, under the one rule
    with its one reply code; a forced token's exact 0.0 passes. The full
    log-probs and the supports' log-probs are kept by the same rule, named
    for them."""
    rule = LOG_PROB_RULES[field]
    verdicts = _log_prob_verdicts(log_prob, field)
    if passes:
        assert verdicts == dict.fromkeys(verdicts), verdicts
        return
    assert all(found is not None and rule in found for found in verdicts.values()), verdicts
    code = RULE_CODES[rule]
    assert code == "invalid_value" and (rule == RULE_LOG_PROBS) == (field == "log_probs")
    for role in ("producer", "broker, explained"):
        assert verdicts[role].startswith(f"{code}: rule '{rule}' violated at token 1: {value}"), verdicts
    for role in ("consumer, numpy, located", "consumer, torch, located"):
        assert verdicts[role] == f"{rule} at 1: {value}{float(np.float32(log_prob))}, " \
                                 f"expected finite and <= {LOG_PROB_TOLERANCE}", verdicts


def _backend(name: str):
    """The array each check runs on: numpy, or torch tensors (the consumer's device path)."""
    return np.asarray if name == "numpy" else pytest.importorskip("torch").from_numpy


BROKEN_OFFSETS = {
    "decreasing": [0, 2, 1, 3], "equal": [0, 1, 1, 3], "negative": [0, -5, 2, 3], "huge": [0, 2**62, 2, 3],
    "wrapping": [0, 2**62 + 1, -(2**62) - 1, 3], "extremes": [0, 2**63 - 1, -(2**63), 3], "reversed": [9, 8, 7, 6],
}
CSR_RULES = {RULE_OFFSETS_START, RULE_OFFSETS_END, RULE_NONEMPTY_SUPPORT}
# numpy's integer dtypes, and those torch has for every op the checks take.
TOKEN_DTYPES = [("numpy", dtype) for dtype in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")] + [
    ("torch", dtype) for dtype in ("int8", "uint8", "int16", "int32", "int64")]


@pytest.mark.parametrize(("backend", "dtype"), TOKEN_DTYPES, ids=[f"{b}-{d}" for b, d in TOKEN_DTYPES])
@pytest.mark.parametrize("offsets", [*BROKEN_OFFSETS.values(), None], ids=[*BROKEN_OFFSETS, "valid"])
def test_any_offsets_with_any_token_dtype_give_flags(backend, dtype, offsets):
    """Whatever the offsets hold and whatever the tokens' integer dtype, the
    flags are made without an error, set exactly when the offsets break a
    CSR rule, which `locate_violations` then names (and `csr_flags` and
    `locate_csr_violations` agree). The tokens step down, which a narrow
    dtype's own subtraction would wrap around."""
    convert = _backend(backend)
    tokens, ids = np.array([7, 5, 6], dtype), np.array([7, 5, 6], np.int32)
    packed = [convert(a) for a in (tokens, np.array([3]), ids, np.arange(4) if offsets is None else np.array(offsets))]
    mask = packed[2:]
    valid = offsets is None
    assert Verdict(packed_flags(*packed, vocab_size=VOCAB)).passed() == valid
    assert Verdict(csr_flags(*mask, VOCAB)).passed() == valid
    located = locate_violations(*packed, vocab_size=VOCAB)
    assert located == locate_csr_violations(*mask, VOCAB)
    assert (not located) if valid else {v.rule for v in located} <= CSR_RULES, located


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize(("dtype", "vocab_size"), [("int32", 2**31), ("int32", 2**40), ("int8", 1000), ("int64", 2**64)])
def test_a_vocabulary_past_the_ids_dtype_leaves_only_negative_ids_outside(backend, dtype, vocab_size):
    """torch compares a tensor with a Python int its dtype cannot hold as
    that int wrapped around (2**31 against int32 reads as -2**31, 2**64
    against int64 overflows): ids then lie outside only when negative."""
    convert = _backend(backend)
    values = np.array([0, 5, np.iinfo(dtype).max], dtype)
    offsets = np.arange(4)
    assert Verdict(packed_flags(*(convert(a) for a in (values, np.array([3]), values, offsets)), vocab_size=vocab_size)).passed()
    assert Verdict(csr_flags(convert(values), convert(offsets), vocab_size)).passed()
    values[1] = -1
    found = packed_violations(*(convert(a) for a in (values, np.array([3]), values, offsets)), vocab_size=vocab_size)
    assert [(v.rule, v.position, v.count) for v in found] == [(RULE_MASK_VOCAB, 1, 1), (RULE_TOKEN_VOCAB, 1, 1)], found


@pytest.mark.parametrize("may_pack", [False, True], ids=["frame-per-array", "packed"])
def test_the_turn_side_digest_is_the_delivered_trajectorys_with_mask_log_probs_forced_tokens_included(may_pack):
    """The producer's digest of the turns it sends (`turn_record`) is the
    consumer's of the trajectory the broker merged and delivered: turn
    frames decoded and checked as the broker does (one saying its supports'
    log-probs renormalised, checked for that too), merged, sent as a
    `deliver` and rebuilt. Each forced token's singleton carries 0.0."""
    from rollstream.common.checker import ContentDigest, delivered_digest, expected, turn_record
    from rollstream.common.codec import decode
    from rollstream.common.messages import BROKER_TO_CONSUMER, PRODUCER_TO_BROKER
    from rollstream.common.trajectory import Trajectory
    from rollstream.common.wire import encode_deliver, encode_turn, trajectory_from_deliver, turn_from_message

    half = float(np.log(np.float32(0.5)))
    turns = [Turn.build([2, 3], [-0.25, -0.5], supports=[[2, 5], [3, 1, 4]], forced_tokens=[6, 7],
                        mask_log_probs=[-0.25, -1.5, -0.5, -2.0, -3.0], vocab_size=VOCAB),
             Turn.build([4], [-0.75], supports=[[4, 0]], forced_tokens=[1], mask_log_probs=[half, half],
                        mask_log_probs_normalized=True, vocab_size=VOCAB),
             Turn.build([5], [0.0], supports=[[5]], mask_log_probs=[0.0], vocab_size=VOCAB)]
    prompt = np.array([1, 2], np.int32)
    digest, records = ContentDigest(prompt), []
    merged = Trajectory("t", prompt)
    for index, turn in enumerate(turns):
        record, digest = turn_record(digest, turn)
        records.append(record)
        message = decode(encode_turn("t", index, turn, seq=index, prompt_tokens=prompt if index == 0 else None,
                                     may_pack=may_pack), PRODUCER_TO_BROKER)
        check_message_arrays(message.arrays, vocab_size=VOCAB,
                             mask_log_probs_normalized=message.get("mask_log_probs_normalized", False))
        assert merged.append_turn(turn_from_message(message)).applied
    merged.reward = 1.0
    want = expected(ContentDigest(prompt).hexdigest(), records)
    delivered = trajectory_from_deliver(decode(encode_deliver(merged, "L", may_pack=may_pack), BROKER_TO_CONSUMER))
    assert delivered.mask.ids.tolist() == [2, 5, 3, 1, 4, 6, 7, 4, 0, 1, 5]
    assert delivered.mask_log_probs.tolist() == np.array([-0.25, -1.5, -0.5, -2.0, -3.0, 0.0, 0.0, half, half, 0.0, 0.0],
                                                         np.float32).tolist()
    assert want.gap is None and delivered_digest(delivered.arrays()) == want.digest
    assert delivered_digest({**delivered.arrays(), "mask_log_probs": None}) != want.digest
