"""The compiled checks (common/_native.c) against the numpy ones they
stand in for: the same answer on every valid mask and on every content rule
broken, nothing read out of range on broken offsets, and the arrays they
take checked. Both paths run here: the numpy one with the compiled module
set aside."""
import contextlib
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_content_check_agreement import VOCAB, _messages

from rollstream.common import validation

try:
    from rollstream.common import _native as native
except ImportError:
    if shutil.which("cc") or shutil.which("gcc"):  # the optional build failed where it could have run
        raise ImportError("rule 'the install builds common/_native.c where a C compiler exists' not met: a compiler "
                          "is on PATH, the module is missing (reinstall and read the build's output)") from None
    pytest.skip("built without a C compiler: numpy checks alone", allow_module_level=True)


@contextlib.contextmanager
def numpy_only():
    """The compiled module set aside: validation takes its numpy paths."""
    compiled, validation._native = validation._native, None
    try:
        yield
    finally:
        validation._native = compiled


def numpy_inside(tokens, ids, offsets):
    """`inside_support` with the compiled module set aside."""
    with numpy_only():
        return validation.inside_support(tokens, ids, offsets)


@st.composite
def masks(draw):
    """Supports (some empty, ids repeated, some longer than a compiled step
    of eight ids) and tokens mostly inside them."""
    supports = draw(st.lists(st.lists(st.integers(-3, 40), max_size=20), max_size=12))
    tokens = [draw(st.sampled_from(s)) if s and draw(st.booleans()) else draw(st.integers(-3, 40)) for s in supports]
    offsets = np.cumsum([0, *map(len, supports)]).astype(np.int64)
    return (np.array(tokens, np.int32), np.array([i for s in supports for i in s], np.int32), offsets)


@settings(max_examples=300, deadline=None)
@given(masks())
def test_the_compiled_check_answers_as_numpy_on_every_valid_mask(mask):
    tokens, ids, offsets = mask
    expected = [bool(tokens[t] in ids[offsets[t]:offsets[t + 1]]) for t in range(len(tokens))]
    assert validation.inside_support(tokens, ids, offsets).tolist() == expected
    if len(tokens) and (np.diff(offsets) > 0).all():  # numpy's path takes non-empty supports only
        assert numpy_inside(tokens, ids, offsets).tolist() == expected


@settings(max_examples=300, deadline=None)
@given(masks(), st.lists(st.tuples(st.integers(0, 12), st.integers(-2**40, 2**40)), min_size=1, max_size=3))
def test_broken_offsets_read_nothing_out_of_range_and_their_supports_hold_nothing(mask, edits):
    tokens, ids, offsets = mask
    offsets = offsets.copy()
    for at, value in edits:
        offsets[at % len(offsets)] = value
    out = np.ones(len(tokens), dtype=bool)
    native.inside_support(tokens, ids, offsets, out)
    for t in range(len(tokens)):
        start, end = int(offsets[t]), int(offsets[t + 1])
        if not 0 <= start <= end <= len(ids):
            assert not out[t]
        else:
            assert out[t] == (tokens[t] in ids[start:end])


@pytest.mark.parametrize("tokens, ids, offsets, out, words", [
    (np.zeros(2, np.int64), np.zeros(1, np.int32), np.zeros(3, np.int64), np.zeros(2, bool), "tokens is a 1-D array of 4-byte"),
    (np.zeros(2, np.int32), np.zeros(1, np.float32), np.zeros(3, np.int64), np.zeros(2, bool), "ids is a 1-D array"),
    (np.zeros(2, np.int32), np.zeros(1, np.int32), np.zeros(3, np.float64), np.zeros(2, bool), "offsets is a 1-D array"),
    (np.zeros(2, np.int32), np.zeros(1, np.int32), np.zeros((3, 1), np.int64), np.zeros(2, bool), "got 2 dimension(s)"),
    (np.zeros(2, np.int32), np.zeros(1, np.int32), np.zeros(2, np.int64), np.zeros(2, bool), "2 tokens, 2 offsets, 2 out"),
    (np.zeros(2, np.int32), np.zeros(1, np.int32), np.zeros(3, np.int64), np.zeros(1, bool), "2 tokens, 3 offsets, 1 out"),
])
def test_arrays_of_the_wrong_kind_or_length_are_refused_naming_the_rule(tokens, ids, offsets, out, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        native.inside_support(tokens, ids, offsets, out)


def test_a_read_only_out_is_refused():
    out = np.zeros(1, bool)
    out.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):
        native.inside_support(np.zeros(1, np.int32), np.zeros(1, np.int32), np.array([0, 1], np.int64), out)


def _reference_holds(tokens, ids, offsets, bound):
    """The support rules the compiled content check applies, message by message, in plain Python."""
    for message_tokens, message_ids, message_offsets in zip(tokens, ids, offsets):
        n = len(message_tokens)
        if len(message_offsets) != n + 1 or message_offsets[0] != 0 or message_offsets[-1] != len(message_ids):
            return False
        if any(not 0 <= int(i) < bound for i in message_ids):
            return False
        for t in range(n):
            start, end = int(message_offsets[t]), int(message_offsets[t + 1])
            if not start < end <= len(message_ids) or message_tokens[t] not in message_ids[start:end]:
                return False
    return True


def _compiled(batch, bound):
    return native.messages_content_valid(batch, validation._CONTENT_ROLES, bound, validation.LOG_PROB_TOLERANCE)


@settings(max_examples=300, deadline=None)
@given(st.lists(masks(), max_size=4), st.sampled_from([8, 41, 2**31]),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(-3, 60)), max_size=2))
def test_the_compiled_support_rules_answer_as_the_rules_do(messages, bound, edits):
    """Valid messages, and some with an offset changed (framing, order,
    range), against a plain reference; ids past `bound` or negative fail."""
    tokens, ids, offsets = ([m[k] for m in messages] for k in range(3))
    offsets = [o.copy() for o in offsets]
    for which, at, value in edits:
        if offsets:
            chosen = offsets[which % len(offsets)]
            chosen[at % len(chosen)] = value
    batch = [{"tokens": t, "mask_ids": i, "mask_offsets": o} for t, i, o in zip(tokens, ids, offsets)]
    assert _compiled(batch, bound) == _reference_holds(tokens, ids, offsets, bound)


@pytest.mark.parametrize("change, holds", [
    ({}, True),
    ({"log_probs": np.array([-0.5, -1.0, 0.0009], np.float32)}, True),  # within the rounding tolerance
    ({"log_probs": np.array([-0.5, -1.0, 0.01], np.float32)}, False),
    ({"log_probs": np.array([-0.5, np.nan, -1.0], np.float32)}, False),
    ({"log_probs": np.array([-0.5, -np.inf, -1.0], np.float32)}, False),
    ({"log_probs": np.array([-0.5, -1.0], np.float32)}, False),  # one short
    ({"loss_mask": np.array([1, 0, 2], np.uint8)}, False),
    ({"loss_mask": np.array([1, 0], np.uint8)}, False),
    ({"full_log_probs": np.array([-1.0, -2.0, -3.0], np.float32)}, True),
    ({"full_log_probs": np.array([-1.0, -2.0, np.nan], np.float32)}, False),
    ({"full_log_probs": np.array([-1.0, -2.0], np.float32)}, False),
    ({"mask_log_probs": np.full(4, -0.5, np.float32)}, True),
    ({"mask_log_probs": np.array([-0.5, -0.5, 0.5, -0.5], np.float32)}, False),
    ({"mask_log_probs": np.full(3, -0.5, np.float32)}, False),  # one per support id
    ({"prompt_tokens": np.array([0, 7], np.int32)}, True),
    ({"prompt_tokens": np.array([0, 8], np.int32)}, False),  # past the vocabulary
    ({"forced_tokens": np.array([-1], np.int32)}, False),  # negative
    ({"forced_tokens": np.array([3], np.int32)}, True),
    ({"mask_ids": None, "mask_offsets": None, "tokens": np.array([1, 7, 2], np.int32)}, True),  # no supports
    ({"mask_ids": None, "mask_offsets": None, "tokens": np.array([1, 8, 2], np.int32)}, False),
    ({"mask_ids": None}, False),  # offsets without ids
    ({"mask_offsets": np.array([0, 1, 3, 3], np.int64)}, False),  # an empty support
])
def test_each_content_rule_is_kept_compiled_as_numpy_keeps_it(change, holds):
    arrays = {"tokens": np.array([1, 4, 2], np.int32), "mask_ids": np.array([1, 4, 5, 2], np.int32),
              "mask_offsets": np.array([0, 1, 3, 4], np.int64), "log_probs": np.array([-0.5, -1.0, 0.0], np.float32),
              "loss_mask": np.ones(3, np.uint8)}
    arrays.update(change)
    arrays = {name: value for name, value in arrays.items() if value is not None}
    assert _compiled([arrays], 8) is holds
    with numpy_only():
        assert validation.messages_content_valid([arrays], 8) is holds


@settings(max_examples=200, deadline=None)
@given(st.lists(_messages(), min_size=1, max_size=5), st.sampled_from([VOCAB, None]))
def test_the_content_check_answers_alike_with_and_without_the_compiled_passes(batch, vocab_size):
    compiled = validation.messages_content_valid(batch, vocab_size)
    with numpy_only():
        assert validation.messages_content_valid(batch, vocab_size) == compiled


@pytest.mark.parametrize("ids, bound, holds", [
    ([0, 7], 8, True), ([0, 8], 8, False), ([-1], 2**31, False), ([2**31 - 1], 2**31, True),
    ([-1], 2**32, True), ([-1], 2**32 - 1, False),  # read as unsigned: 2**32 - 1
    ([], 0, True), ([0], 0, False),
])
def test_ids_are_read_as_unsigned_against_any_bound(ids, bound, holds):
    arrays = {"tokens": np.array(ids, np.int32)}
    assert _compiled([arrays], bound) is holds
    assert validation._group_content_valid([arrays], bound) is holds  # numpy's way


def test_arrays_of_other_dtypes_are_refused_and_the_content_check_takes_them_with_numpy():
    with pytest.raises(ValueError, match="tokens is a 1-D array of 4-byte"):
        _compiled([{"tokens": np.array([1], np.int64), "mask_ids": np.array([1], np.int32),
                    "mask_offsets": np.array([0, 1], np.int64)}], 8)
    with pytest.raises(ValueError, match="every message has tokens"):
        _compiled([{"mask_ids": np.array([1], np.int32)}], 8)
    arrays = {"tokens": np.array([1, 2], np.int64), "mask_ids": np.array([1, 2], np.int32),
              "mask_offsets": np.array([0, 1, 2], np.int64)}
    assert validation.messages_content_valid([arrays, arrays], 8)
    assert not validation.messages_content_valid([arrays, {**arrays, "tokens": np.array([2, 2], np.int64)}], 8)
