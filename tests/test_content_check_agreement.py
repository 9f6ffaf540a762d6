"""The broker's fast content check (`messages_content_valid`, one packed
pass over a batch of turn frames) accepts exactly the messages in which
`packed_violations`, the rule-by-rule check that explains refusals, finds
nothing wrong as it checks a turn: the broker can trust the fast path."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollstream.common.validation import messages_content_valid, packed_violations

VOCAB = 8
# Mostly inside the vocabulary, its edges past both sides.
_IDS = st.integers(0, 3 * VOCAB).map(lambda i: -1 if i == 0 else VOCAB if i == 1 else i % VOCAB)


@st.composite
def _messages(draw):
    """One turn's arrays, often valid, often not: supports with repeated and
    out-of-vocabulary ids, empty supports, offsets that do not start at 0
    or end at the ids' length, tokens outside their supports, loss masks of
    2, log-probs of 0.0, -inf, +inf and NaN."""
    n = draw(st.integers(0, 4))
    supports = [draw(st.lists(_IDS, min_size=0 if draw(st.integers(0, 9)) == 0 else 1, max_size=3)) for _ in range(n)]
    tokens = [draw(st.sampled_from(s)) if s and draw(st.integers(0, 7)) else draw(_IDS) for s in supports]
    arrays = {"tokens": np.array(tokens, np.int32)}
    if draw(st.booleans()):
        arrays["log_probs"] = np.array(draw(st.lists(st.sampled_from([-0.5, 0.0, 0.0, -np.inf, -0.5, 0.0, np.inf, np.nan]),
                                                     min_size=n, max_size=n)), np.float32)
    if draw(st.booleans()):
        arrays["loss_mask"] = np.array(draw(st.lists(st.sampled_from([0, 1, 0, 1, 0, 1, 2]), min_size=n, max_size=n)), np.uint8)
    if draw(st.booleans()):
        ids = [i for s in supports for i in s]
        offsets = np.cumsum([0, *map(len, supports)])
        if draw(st.integers(0, 7)) == 0:
            offsets[0] += 1
        if draw(st.integers(0, 7)) == 0:
            offsets[-1] -= 1
        arrays["mask_ids"], arrays["mask_offsets"] = np.array(ids, np.int32), offsets.astype(np.int64)
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
    found = packed_violations(tokens, [len(tokens)], arrays.get("mask_ids"), offsets, vocab_size=vocab_size,
                              loss_mask=arrays.get("loss_mask"), log_probs=arrays.get("log_probs"), marks_forced=False)
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
    from rollstream.common.validation import check_message_arrays

    arrays = {"tokens": np.array([2], np.int32), "log_probs": np.array([0.0], np.float32),
              "loss_mask": np.array([0], np.uint8), "mask_ids": np.array([2, 5], np.int32),
              "mask_offsets": np.array([0, 2], np.int64)}
    assert messages_content_valid([arrays], VOCAB)
    check_message_arrays(arrays, vocab_size=VOCAB)
    merged = packed_violations(arrays["tokens"], [1], arrays["mask_ids"], arrays["mask_offsets"],
                               loss_mask=arrays["loss_mask"], log_probs=arrays["log_probs"])
    assert [v.rule for v in merged] == ["forced tokens (loss_mask 0, log_prob 0.0) have the singleton support [token]"]
