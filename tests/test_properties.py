"""Property tests (hypothesis) for rollstream.common: the CSR mask algebra,
turn merging and replay gaps, the wire codec under round trips and
corruption, and batch validation.

Every expected value is built here from plain Python lists (or, where the
brief asks for it, from `SamplingMask.concatenate`, which has its own
properties above), never from the code path under test.
"""
from __future__ import annotations

import array
import dataclasses
import itertools
import math
import sys
from dataclasses import dataclass

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays as np_arrays

from rollstream.common.codec import content_digest, decode
from rollstream.common.contract import LOG_PROB_TOLERANCE, NACK_CODES, REPLAY_FIELDS, STATUSES
from rollstream.common.errors import ProtocolError
from rollstream.common.mask import IDS_DTYPE, SamplingMask, as_int_array
from rollstream.common.messages import (
    ADMIN_REPLIES,
    ADMIN_REQUESTS,
    BROKER_TO_CONSUMER,
    BROKER_TO_PRODUCER,
    CONSUMER_TO_BROKER,
    PRODUCER_TO_BROKER,
)
from rollstream.common.trajectory import Gap, Trajectory, Turn, TurnOutcome
from rollstream.common.validation import (
    RULE_IN_SUPPORT,
    BatchValidationError,
    packed_violations,
    validate_samples,
)
from rollstream.common.wire import encode_deliver, encode_turn, trajectory_from_deliver, turn_from_message

VOCAB = 64
INT32 = (-(2**31), 2**31 - 1)


def prop(n: int):
    """Settings for one property: `n` examples, no deadline (CI boxes are slow)."""
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- independent reference helpers ------------------------------------------------
def supports_of(mask: SamplingMask) -> list[list[int]]:
    return [mask[t].tolist() for t in range(len(mask))]


def csr_of(supports) -> tuple[list[int], list[int]]:
    """Flat ids and offsets of `supports`, computed in plain Python."""
    return [i for s in supports for i in s], list(itertools.accumulate((len(s) for s in supports), initial=0))


def assert_same_array(actual: np.ndarray, expected: np.ndarray) -> None:
    """Same dtype, shape and bytes (so -0.0 vs 0.0 or a dtype change fails)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.tobytes() == expected.tobytes(), (actual, expected)


def assert_messages_equal(a, b) -> None:
    assert a.type == b.type
    assert dict(a.fields) == dict(b.fields)
    assert sorted(a.arrays) == sorted(b.arrays)
    for name in a.arrays:
        assert_same_array(a.arrays[name], b.arrays[name])


def assert_content_valid(message) -> None:
    """The content rules of docs/protocol.md §2/§3, checked independently in Python."""
    arrays = message.arrays
    tokens = arrays["tokens"].tolist()
    n = len(tokens)
    log_probs = arrays["log_probs"]
    assert len(log_probs) == n
    assert all(math.isfinite(x) and x <= LOG_PROB_TOLERANCE for x in log_probs.tolist())
    if "loss_mask" in arrays:
        assert len(arrays["loss_mask"]) == n and set(arrays["loss_mask"].tolist()) <= {0, 1}
    assert ("mask_ids" in arrays) == ("mask_offsets" in arrays)
    if "mask_ids" in arrays:
        ids, offsets = arrays["mask_ids"].tolist(), arrays["mask_offsets"].tolist()
        assert len(offsets) == n + 1 and offsets[0] == 0 and offsets[-1] == len(ids)
        assert all(lo < hi for lo, hi in zip(offsets, offsets[1:]))
        assert all(tokens[t] in ids[offsets[t] : offsets[t + 1]] for t in range(n))
        assert all(i >= 0 for i in ids)
    for name in ("prompt_tokens", "tokens", "forced_tokens"):
        if name in arrays:
            assert all(t >= 0 for t in arrays[name].tolist())


# -- strategies --------------------------------------------------------------------
any_support = st.lists(st.integers(0, INT32[1]), min_size=1, max_size=5)  # a mask refuses negative ids
any_supports = st.lists(any_support, max_size=8)
vocab_support = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4, unique=True)
log_prob = st.floats(-30.0, 0.0, width=32) | st.floats(0.0, LOG_PROB_TOLERANCE, width=32)  # rounding above 0
json_leaf = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=5)
metadata_st = st.dictionaries(
    st.text(max_size=4),
    st.recursive(json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                 max_leaves=6),
    max_size=3,
)


@dataclass
class TurnSpec:
    """A turn as plain data: the test derives expectations from this, the
    code under test gets `build()`."""

    supports: list
    tokens: list
    log_probs: list
    loss_mask: list | None
    forced: list
    with_mask: bool
    routed: np.ndarray | None
    status: str
    weight_version: str | None
    full: list | None = None  # full-vocabulary log-probs

    def build(self) -> Turn:
        return Turn.build(
            self.tokens,
            self.log_probs,
            supports=self.supports if self.with_mask else None,
            loss_mask=None if self.loss_mask is None else np.array(self.loss_mask, np.uint8),
            forced_tokens=self.forced,
            routed_experts=self.routed,
            full_log_probs=self.full,
            status=self.status,
            weight_version=self.weight_version,
        )

    def without(self, fields) -> "TurnSpec":
        return TurnSpec(
            self.supports, self.tokens, self.log_probs, self.loss_mask, self.forced,
            self.with_mask and "mask" not in fields,
            None if "routed_experts" in fields else self.routed,
            self.status, self.weight_version,
            None if "full_log_probs" in fields else self.full,
        )


@st.composite
def turn_specs(draw, *, mask=st.booleans(), status=st.sampled_from(STATUSES), routed_k=st.none() | st.integers(0, 3),
               max_tokens=5, min_tokens=0, full=st.booleans()):
    supports = draw(st.lists(vocab_support, min_size=min_tokens, max_size=max_tokens))
    tokens = [draw(st.sampled_from(s)) for s in supports]
    n = len(tokens)
    log_probs = draw(st.lists(log_prob, min_size=n, max_size=n))
    loss_mask = draw(st.none() | st.lists(st.integers(0, 1), min_size=n, max_size=n))
    forced = draw(st.lists(st.integers(0, VOCAB - 1), max_size=4))
    k = draw(routed_k)
    routed = None if k is None else draw(np_arrays(np.dtype("<i4"), (k, 2, 3)))
    full_log_probs = draw(st.lists(log_prob, min_size=n, max_size=n)) if draw(full) else None
    return TurnSpec(
        supports, tokens, log_probs, loss_mask, forced, draw(mask), routed, draw(status),
        draw(st.none() | st.text(max_size=4)), full_log_probs,
    )


@st.composite
def turn_sequences(draw, *, mask: bool, routed: bool, min_turns=1, max_turns=5, last_status=st.sampled_from(STATUSES),
                   full: bool = False):
    """Turns that all apply: completed except maybe the last, one presence
    pattern for the replay fields, routed_experts' first dim never shrinking."""
    n = draw(st.integers(min_turns, max_turns))
    ks = sorted(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))) if routed else [None] * n
    specs = [
        draw(turn_specs(mask=st.just(mask), status=st.just("completed") if i < n - 1 else last_status, routed_k=st.just(k),
                        full=st.just(full)))
        for i, k in enumerate(ks)
    ]
    return specs


@dataclass
class Expected:
    tokens: np.ndarray
    loss_mask: np.ndarray
    log_probs: np.ndarray
    supports: list
    mask: SamplingMask
    full_log_probs: np.ndarray | None


def whole_build(specs, *, drop_last_forced=False) -> Expected:
    """The whole trajectory built at once (docs/semantics.md §4), with numpy lists."""
    tokens, loss, lps, supports, parts, full = [], [], [], [], [], []
    for i, s in enumerate(specs):
        tokens += s.tokens
        loss += s.loss_mask if s.loss_mask is not None else [1] * len(s.tokens)
        lps += s.log_probs
        full += s.full or []
        supports += s.supports
        parts.append(SamplingMask.from_supports(s.supports))
        if drop_last_forced and i == len(specs) - 1:
            break
        tokens += s.forced
        loss += [0] * len(s.forced)
        lps += [0.0] * len(s.forced)
        full += [0.0] * len(s.forced)
        supports += [[t] for t in s.forced]
        parts.append(SamplingMask.singletons(np.array(s.forced, np.int32)))
    return Expected(
        np.array(tokens, "<i4"), np.array(loss, "u1"), np.array(lps, "<f4"), supports, SamplingMask.concatenate(parts),
        np.array(full, "<f4") if specs and specs[0].full is not None else None,
    )


def merge(specs, prompt=(1, 2, 3), read_after=()) -> Trajectory:
    """Merge `specs` in order; a read after the turns whose positions are in
    `read_after` writes the pending ones, so later turns start a new batch."""
    traj = Trajectory("traj", np.array(prompt, np.int32))
    for position, spec in enumerate(specs):
        assert traj.append_turn(spec.build()) == TurnOutcome(True)
        if position in read_after:
            traj.arrays()
    return traj


def assert_trajectory_is(traj: Trajectory, exp: Expected, *, with_mask: bool) -> None:
    assert_same_array(traj.tokens, exp.tokens)
    assert_same_array(traj.loss_mask, exp.loss_mask)
    assert_same_array(traj.log_probs, exp.log_probs)
    assert traj.response_length == len(exp.tokens)
    if with_mask:
        assert traj.mask == exp.mask
        assert supports_of(traj.mask) == exp.supports
        assert len(traj.mask) == traj.response_length
    else:
        assert traj.mask is None
    if exp.full_log_probs is None:
        assert traj.full_log_probs is None
    else:
        assert_same_array(traj.full_log_probs, exp.full_log_probs)
    traj.validate()


# == 1. SamplingMask construction ===================================================
@prop(150)
@given(supports=any_supports)
def test_from_supports_round_trips_supports_ids_and_offsets(supports):
    """The CSR must give back exactly the supports it was built from (§2)."""
    m = SamplingMask.from_supports(supports)
    ids, offsets = csr_of(supports)
    assert len(m) == len(supports)
    assert [list(m[t]) for t in range(len(m))] == supports
    assert [list(m[-t]) for t in range(1, len(m) + 1)] == supports[::-1]
    assert m.ids.dtype == np.int32 and m.offsets.dtype == np.int64
    assert m.ids.tolist() == ids and m.offsets.tolist() == offsets
    for bad in (len(m), -len(m) - 1):
        with pytest.raises(IndexError):
            m[bad]


@prop(150)
@given(ids=st.lists(st.integers(-(2**32), 2**32) | st.booleans() | st.floats(allow_nan=False, width=16), max_size=12))
def test_support_ids_convert_exactly_as_any_integer_list_does(ids):
    """from_supports takes a fast path for plain vocabulary ids; whatever
    the ids, it converts or refuses them exactly as `as_int_array` does,
    then refuses a negative one (in no vocabulary)."""
    try:
        expected = as_int_array(ids, IDS_DTYPE, "supports").tolist()
    except ValueError:
        with pytest.raises(ValueError):
            SamplingMask.from_supports([ids])
        return
    negative = [value for value in expected if value < 0]
    if negative:
        with pytest.raises(ProtocolError, match=f"supports holds {negative[0]}, expected >= 0"):
            SamplingMask.from_supports([ids])
    elif ids:
        assert SamplingMask.from_supports([ids]).ids.tolist() == expected


@prop(150)
@given(supports=any_supports, ids_dtype=st.sampled_from([np.int32, np.int64]), lens_dtype=st.sampled_from([np.int32, np.int64]))
def test_from_lengths_equals_from_supports_and_owns_its_memory(supports, ids_dtype, lens_dtype):
    """A mask is immutable: changing the caller's arrays afterwards changes nothing."""
    flat_list, offsets_list = csr_of(supports)
    flat = np.array(flat_list, dtype=ids_dtype)
    lens = np.array([len(s) for s in supports], dtype=lens_dtype)
    offsets = np.array(offsets_list, dtype=np.int64)
    by_lengths = SamplingMask.from_lengths(flat, lens)
    by_csr = SamplingMask(flat, offsets)
    assert by_lengths == SamplingMask.from_supports(supports) == by_csr
    for m in (by_lengths, by_csr):
        assert m.ids.dtype == np.int32 and m.offsets.dtype == np.int64
        assert not m.ids.flags.writeable and not m.offsets.flags.writeable
        assert not np.shares_memory(m.ids, flat) and not np.shares_memory(m.offsets, offsets)
        with pytest.raises(ValueError):
            m.offsets[0] = 1
        if len(m):
            assert not m[0].flags.writeable
            with pytest.raises(ValueError):
                m.ids[0] = 1
    if flat.size:  # an empty array has nothing to change
        flat[:] = 7
    lens[:] = 1
    offsets[:] = 0
    for m in (by_lengths, by_csr):
        assert supports_of(m) == supports
        assert m.offsets.tolist() == offsets_list


@prop(40)
@given(supports=st.lists(any_support, min_size=1, max_size=6))
@example(supports=[[5, 9], [2]])
def test_mask_owns_its_memory_for_buffer_protocol_inputs(supports):
    """§2: "changing the arrays it was built from afterwards changes nothing",
    whatever sequence the ids came in (here the stdlib's array.array)."""
    flat_list, offsets_list = csr_of(supports)
    flat, offsets = array.array("i", flat_list), array.array("q", offsets_list)
    by_csr = SamplingMask(flat, offsets)
    by_lengths = SamplingMask.from_lengths(flat, [len(s) for s in supports])
    for i in range(len(flat)):
        flat[i] = 7 if flat[i] != 7 else 8
    offsets[-1] = offsets[-1] + 1  # would also break the checked CSR invariant
    for m in (by_csr, by_lengths):
        assert supports_of(m) == supports and m.offsets.tolist() == offsets_list


def _empty(dtype):
    return np.empty(0, dtype)


@pytest.mark.parametrize(
    "build",
    [
        lambda a: SamplingMask(a, np.zeros(1, np.int64)),
        lambda a: SamplingMask.from_lengths(a, []),
        lambda a: SamplingMask.singletons(a),
        lambda a: Turn.build(a, []),
        lambda a: Trajectory("t", a),
    ],
    ids=["SamplingMask", "from_lengths", "singletons", "Turn.build", "Trajectory"],
)
def test_building_from_an_empty_array_leaves_the_callers_array_writable(build):
    """Construction must not change the caller's objects: after building from
    an empty int32 array, `arr[:] = 0` (a no-op) must still work."""
    arr = _empty(np.int32)
    build(arr)
    assert arr.flags.writeable
    arr[:] = 0


@prop(60)
@given(supports=st.lists(any_support, min_size=1, max_size=6), data=st.data())
def test_ids_that_do_not_fit_int32_are_refused_not_wrapped(supports, data):
    """§2: a value outside int32 is refused, never wrapped."""
    flat_list, offsets_list = csr_of(supports)
    i = data.draw(st.integers(0, len(flat_list) - 1))
    flat_list[i] = data.draw(st.integers(2**31, 2**40) | st.integers(-(2**40), -(2**31) - 1))
    flat = np.array(flat_list, dtype=np.int64)
    with pytest.raises(ValueError):
        SamplingMask(flat, np.array(offsets_list, np.int64))
    with pytest.raises(ValueError):
        SamplingMask.from_lengths(flat, [len(s) for s in supports])


# == 2. concatenate / prefix algebra ===============================================
@prop(150)
@given(sa=any_supports, sb=any_supports, sc=any_supports)
def test_concatenate_then_prefix_recovers_parts_and_is_associative(sa, sb, sc):
    """Merging turns relies on concatenation keeping each part's supports intact."""
    a, b, c = (SamplingMask.from_supports(s) for s in (sa, sb, sc))
    ab = SamplingMask.concatenate([a, b])
    assert len(ab) == len(a) + len(b)
    assert supports_of(ab) == sa + sb
    assert ab.prefix(len(a)) == a
    assert [list(ab[len(a) + t]) for t in range(len(b))] == sb
    assert ab.ids.dtype == np.int32 and ab.offsets.dtype == np.int64
    left = SamplingMask.concatenate([ab, c])
    right = SamplingMask.concatenate([a, SamplingMask.concatenate([b, c])])
    assert left == right == SamplingMask.concatenate([a, b, c])
    assert supports_of(left) == sa + sb + sc


def test_concatenate_of_nothing_is_the_empty_mask():
    """§2: `[]` gives the empty mask (ids `[]`, offsets `[0]`)."""
    m = SamplingMask.concatenate([])
    assert len(m) == 0 and m.ids.tolist() == [] and m.offsets.tolist() == [0]
    assert m.ids.dtype == np.int32 and m.offsets.dtype == np.int64


@prop(150)
@given(supports=any_supports, data=st.data())
def test_prefix_keeps_first_n_supports_and_refuses_out_of_range(supports, data):
    """strip_last_output_tokens and gap cuts go through prefix(n)."""
    m = SamplingMask.from_supports(supports)
    assert m.prefix(len(m)) == m
    empty = m.prefix(0)
    assert len(empty) == 0 and empty.offsets.tolist() == [0] and empty.ids.tolist() == []
    n = data.draw(st.integers(0, len(m)))
    assert supports_of(m.prefix(n)) == supports[:n]
    assert m.prefix(n).offsets.tolist() == csr_of(supports[:n])[1]
    bad = data.draw(st.integers(-50, -1) | st.integers(len(m) + 1, len(m) + 50))
    with pytest.raises(ValueError):
        m.prefix(bad)


@prop(80)
@given(tokens=st.lists(st.integers(0, INT32[1]), max_size=10))
def test_singletons_give_one_support_per_forced_token(tokens):
    """§3: a forced token's support is exactly `[token]`."""
    m = SamplingMask.singletons(np.array(tokens, np.int64))
    assert supports_of(m) == [[t] for t in tokens]
    assert m.ids.dtype == np.int32 and m.offsets.tolist() == list(range(len(tokens) + 1))


def test_empty_turn_accepts_an_empty_list_loss_mask():
    """A turn with no sampled tokens (an abort with no output) is valid; its
    loss_mask given as `[]` must be accepted like `tokens=[]` and `forced_tokens=[]`."""
    turn = Turn.build([], [], loss_mask=[], forced_tokens=[5], supports=[])
    assert turn.loss_mask.dtype == np.uint8 and turn.loss_mask.size == 0


@st.composite
def contract_turn_arrays(draw):
    """Arrays of exactly the contract's dtypes, as a producer hands them
    over: lengths, offsets and ids that fit each other or break one rule."""
    n = draw(st.integers(0, 6))
    ints = st.integers(-3, VOCAB + 3)

    def length():
        return n + draw(st.sampled_from([0, 0, 0, 1, -1])) if n else draw(st.sampled_from([0, 0, 1]))

    def listed(values, size):
        return draw(st.lists(values, min_size=size, max_size=size))

    arrays = {"tokens": np.array(listed(ints, n), "<i4"),
              "log_probs": np.array(listed(st.floats(-5, 0, width=32), length()), "<f4")}
    if draw(st.booleans()):
        arrays["loss_mask"] = np.array(listed(st.integers(0, 1), length()), "u1")
    if draw(st.booleans()):
        sizes = listed(st.integers(0, 3), max(0, length()))
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype("<i8")
        offsets += draw(st.sampled_from([0, 0, 0, 1]))
        arrays["mask_ids"] = np.array(listed(ints, sum(sizes) + draw(st.sampled_from([0, 0, 0, 1]))), "<i4")
        arrays["mask_offsets"] = offsets
    return arrays


@pytest.mark.slow
@prop(300)
@given(arrays=contract_turn_arrays(), status=st.sampled_from(STATUSES), check_content=st.booleans())
def test_a_borrowed_turn_of_contract_arrays_is_the_turn_the_general_path_builds(arrays, status, check_content):
    """The producer's fast path (contract dtypes, borrowed as they are)
    accepts and refuses exactly what the general path does, with the same
    words, and builds the same turn; only it shares the caller's memory."""
    def built(borrow):
        given = {name: arr.copy() for name, arr in arrays.items()}
        try:
            turn = Turn.build(given.pop("tokens"), given.pop("log_probs"), borrow=borrow, status=status, vocab_size=VOCAB,
                              check_content=check_content, **given)
        except ValueError as error:
            return None, f"{type(error).__name__}: {error}"
        return turn, {name: (arr.dtype.str, arr.tobytes()) for name, arr in turn.arrays().items()}

    fast, fast_outcome = built(True)
    general, general_outcome = built(False)
    assert fast_outcome == general_outcome
    if fast is not None:
        assert fast.status == general.status == status and fast.forced_tokens.size == 0
        assert not np.shares_memory(general.tokens, fast.tokens)


# == 3. codec round trips ===========================================================
def expected_turn_arrays(spec: TurnSpec, prompt) -> dict:
    out = {"tokens": np.array(spec.tokens, "<i4"), "log_probs": np.array(spec.log_probs, "<f4")}
    if spec.loss_mask is not None:
        out["loss_mask"] = np.array(spec.loss_mask, "u1")
    if spec.with_mask:
        ids, offsets = csr_of(spec.supports)
        out["mask_ids"], out["mask_offsets"] = np.array(ids, "<i4"), np.array(offsets, "<i8")
    out["forced_tokens"] = np.array(spec.forced, "<i4")
    if spec.routed is not None:
        out["routed_experts"] = spec.routed
    if spec.full is not None:
        out["full_log_probs"] = np.array(spec.full, "<f4")
    if prompt is not None:
        out["prompt_tokens"] = prompt
    return out


@st.composite
def turn_messages(draw, *, min_tokens=0):
    """(spec, index, kwargs for encode_turn) of a valid `turn` message."""
    spec = draw(turn_specs(min_tokens=min_tokens))
    index = draw(st.integers(0, 3))
    kwargs = {"seq": draw(st.integers(-(2**63), 2**64 - 1))}
    if index == 0:
        kwargs["prompt_tokens"] = np.array(draw(st.lists(st.integers(0, VOCAB - 1), max_size=5)), "<i4")
        # group_id and group_size travel together (or not at all).
        kwargs["group_id"], kwargs["group_size"] = draw(
            st.just((None, None)) | st.tuples(ids(4), st.integers(1, 16))
        )
        kwargs["sample_index"] = draw(st.none() | st.integers(0, 16))
    kwargs["metadata"] = draw(st.none() | metadata_st)
    trajectory_id = draw(ids(8))
    return spec, trajectory_id, index, kwargs


def ids(max_size: int):
    """Trajectory and group ids: any text but U+001F, which no id holds (a broker keys other jobs' ids with it),
    and the surrogates, which are no text UTF-8 can carry."""
    return st.text(st.characters(exclude_characters="\x1f", exclude_categories=("Cs",)), min_size=1, max_size=max_size)


def expected_turn_fields(spec, trajectory_id, index, kwargs) -> dict:
    fields = {"seq": kwargs["seq"], "trajectory_id": trajectory_id, "turn": index, "status": spec.status}
    for name in ("group_id", "group_size", "sample_index", "metadata"):
        if kwargs.get(name) is not None:
            fields[name] = kwargs[name]
    if spec.weight_version is not None:
        fields["weight_version"] = spec.weight_version
    return fields


@pytest.mark.slow
@prop(150)
@given(msg=turn_messages(), crc=st.booleans(), packed=st.booleans())
def test_turn_message_round_trips_fields_and_array_bytes(msg, crc, packed):
    """What a producer sends is exactly what the broker reads (docs/protocol.md §2-§3),
    one frame per array or all in one (packed: then each array starts aligned
    to its item size, widest first)."""
    spec, trajectory_id, index, kwargs = msg
    turn = spec.build()
    frames = encode_turn(trajectory_id, index, turn, crc=crc, may_pack=packed, **kwargs)  # small turns: packed when asked
    decoded = decode([bytes(frame) for frame in frames], PRODUCER_TO_BROKER)
    assert len(frames) == (2 if packed else 1 + len(decoded.arrays))
    assert all(arr.flags.aligned for arr in decoded.arrays.values())
    assert decoded.type == "turn"
    assert dict(decoded.fields) == expected_turn_fields(spec, trajectory_id, index, kwargs)
    expected = expected_turn_arrays(spec, kwargs.get("prompt_tokens"))
    # An empty forced_tokens frame may be left out; every other array must travel.
    assert set(decoded.arrays) - {"forced_tokens"} == set(expected) - {"forced_tokens"}
    for name, arr in expected.items():
        if name == "forced_tokens" and name not in decoded.arrays:
            assert arr.size == 0
            continue
        assert_same_array(decoded.arrays[name], arr)
        assert not decoded.arrays[name].flags.writeable
    back = turn_from_message(decoded)
    assert back.status == spec.status and back.weight_version == spec.weight_version
    assert_same_array(back.tokens, expected["tokens"])
    assert_same_array(back.log_probs, expected["log_probs"])
    assert_same_array(back.forced_tokens, expected["forced_tokens"])
    assert (back.loss_mask is None) == (spec.loss_mask is None)
    if spec.loss_mask is not None:
        assert_same_array(back.loss_mask, expected["loss_mask"])
    if spec.with_mask:
        assert supports_of(back.mask) == spec.supports
    else:
        assert back.mask is None
    if spec.routed is None:
        assert back.routed_experts is None
    else:
        assert_same_array(back.routed_experts, spec.routed)
    if spec.full is None:
        assert back.full_log_probs is None
    else:
        assert_same_array(back.full_log_probs, expected["full_log_probs"])


def _reversed_maps(value):
    if isinstance(value, dict):
        return {k: _reversed_maps(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed_maps(v) for v in value]
    return value


@prop(120)
@given(msg=turn_messages(min_tokens=1), seq2=st.integers(-(2**63), 2**63 - 1), data=st.data())
def test_content_digest_ignores_seq_crc_and_map_order_but_not_array_bytes(msg, seq2, data):
    """Dedup compares content: a resend (new seq) is identical; one changed byte is not."""
    spec, trajectory_id, index, kwargs = msg
    turn = spec.build()
    original = decode(encode_turn(trajectory_id, index, turn, crc=True, **kwargs), PRODUCER_TO_BROKER)
    resend_kwargs = dict(kwargs, seq=seq2)
    if kwargs["metadata"] is not None:
        resend_kwargs["metadata"] = _reversed_maps(kwargs["metadata"])
    resend = decode(encode_turn(trajectory_id, index, turn, crc=False, **resend_kwargs), PRODUCER_TO_BROKER)
    assert content_digest(resend) == content_digest(original)

    frames = [bytes(f) for f in encode_turn(trajectory_id, index, turn, crc=False, **kwargs)]
    i = data.draw(st.sampled_from([i for i in range(1, len(frames)) if frames[i]]), label="frame")
    pos = data.draw(st.integers(0, len(frames[i]) - 1), label="byte")
    flipped = bytearray(frames[i])
    flipped[pos] ^= data.draw(st.integers(1, 255), label="xor")
    frames[i] = bytes(flipped)
    changed = decode(frames, PRODUCER_TO_BROKER, check_content=False)
    assert content_digest(changed) != content_digest(original)


@pytest.mark.parametrize(
    "meta_a, meta_b",
    [({"x": {}}, {"x": []}), ({"x": {"a": 1}}, {"x": [["a", 1]]})],
    ids=["empty-map-vs-empty-list", "map-vs-pair-list"],
)
def test_content_digest_distinguishes_a_map_from_a_list_of_pairs(meta_a, meta_b):
    """docs/protocol.md §3: identical content means *equal* known header fields, so
    a resend whose metadata changed from a map to a list must be a conflict,
    not a duplicate."""
    turn = Turn.build([3], [-0.5], supports=[[3, 4]])
    a = decode(encode_turn("t", 1, turn, seq=1, metadata=meta_a), PRODUCER_TO_BROKER)
    b = decode(encode_turn("t", 1, turn, seq=1, metadata=meta_b), PRODUCER_TO_BROKER)
    assert a.fields != b.fields
    assert content_digest(a) != content_digest(b)


@st.composite
def trajectories(draw):
    """A merged trajectory (specs, how it was built), sometimes cut by a gap."""
    with_mask, routed, full = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    specs = draw(turn_sequences(mask=with_mask, routed=routed, max_turns=4, full=full))
    gap_spec = None
    carried = [name for name, has in (("mask", with_mask), ("routed_experts", routed), ("full_log_probs", full)) if has]
    if carried and specs[-1].status == "completed" and draw(st.booleans()):
        gap_spec = draw(turn_specs(mask=st.just(with_mask), routed_k=st.just(None), full=st.just(full)))
        gap_spec = gap_spec.without(carried[:1])
    return specs, with_mask, routed, gap_spec


@prop(100)
@given(
    built=trajectories(),
    reward=(st.integers(-100, 100) | st.floats(allow_nan=False, allow_infinity=False)
            | st.dictionaries(st.text(max_size=3), st.floats(-1, 1), max_size=2)),
    lease=st.text(min_size=1, max_size=6),
    meta=metadata_st,
    packed=st.booleans(),
)
@pytest.mark.slow
def test_deliver_round_trips_a_merged_trajectory(built, reward, lease, meta, packed):
    """A consumer must rebuild exactly what the broker merged, gap included
    (§4), from one frame per array or from one packed frame."""
    specs, with_mask, routed, gap_spec = built
    traj = merge(specs)
    if gap_spec is not None:
        assert traj.append_turn(gap_spec.build()) == TurnOutcome(False, "replay_gap")
    traj.reward, traj.metadata = reward, meta
    frames = encode_deliver(traj, lease, may_pack=packed)  # these trajectories are well under 64 KiB
    assert len(frames) == (2 if packed else 1 + len(traj.arrays()))
    message = decode(frames, BROKER_TO_CONSUMER)
    assert message["lease"] == lease and message["response_length"] == traj.response_length
    back = trajectory_from_deliver(message)
    exp = whole_build(specs, drop_last_forced=gap_spec is not None)
    assert_trajectory_is(back, exp, with_mask=with_mask)
    assert_same_array(back.prompt_tokens, np.array([1, 2, 3], "<i4"))
    assert back.status == specs[-1].status
    gap_field = "mask" if with_mask else "routed_experts" if routed else "full_log_probs"
    assert back.gap == (None if gap_spec is None else Gap(len(specs), gap_field))
    assert back.weight_versions == [s.weight_version for s in specs if s.weight_version is not None]
    assert back.turns == len(specs)
    assert back.reward == reward and back.metadata == meta
    if routed:
        assert_same_array(back.routed_experts, specs[-1].routed)
    else:
        assert back.routed_experts is None


# == 4. merging turns ===============================================================
@pytest.mark.slow
@prop(150)
@given(data=st.data(), with_mask=st.booleans(), routed=st.booleans(), full=st.booleans())
def test_merging_turns_one_by_one_equals_building_the_whole_trajectory(data, with_mask, routed, full):
    """§4: response = sampled ++ forced per turn; forced tokens get loss 0,
    log-prob 0.0 (full log-prob 0.0 too) and singleton supports; status is the last turn's."""
    specs = data.draw(turn_sequences(mask=with_mask, routed=routed, full=full))
    traj = merge(specs, read_after=data.draw(st.sets(st.integers(0, len(specs) - 1))))
    exp = whole_build(specs)
    assert_trajectory_is(traj, exp, with_mask=with_mask)
    assert traj.status == specs[-1].status and traj.turns == len(specs) and traj.gap is None
    assert traj.weight_versions == [s.weight_version for s in specs if s.weight_version is not None]
    if routed:
        assert_same_array(traj.routed_experts, specs[-1].routed)
    else:
        assert traj.routed_experts is None
    assert traj.terminal == (specs[-1].status != "completed")
    if traj.terminal:
        # After a truncated/aborted turn nothing more is applied, and nothing changes.
        later = data.draw(turn_specs(mask=st.just(with_mask), full=st.just(full)))
        assert traj.append_turn(later.build()) == TurnOutcome(False, "after_terminal")
        assert_trajectory_is(traj, exp, with_mask=with_mask)


@prop(60)
@given(first=turn_specs(mask=st.just(False), status=st.just("completed"), routed_k=st.none(), min_tokens=1),
       second=turn_specs(mask=st.just(True), routed_k=st.none()))
def test_mask_after_unmasked_tokens_is_refused_and_changes_nothing(first, second):
    """§4 "missing, then present": the frame is refused, the trajectory unchanged."""
    traj = merge([first])
    with pytest.raises(ProtocolError) as err:
        traj.append_turn(second.build())
    assert err.value.code == "mask_presence"
    assert_trajectory_is(traj, whole_build([first]), with_mask=False)
    assert traj.turns == 1


# == 5. replay gaps ===================================================================
@st.composite
def gap_scenarios(draw):
    carried = draw(st.sampled_from([("mask",), ("routed_experts",), ("full_log_probs",), ("mask", "routed_experts"),
                                    ("mask", "full_log_probs"), ("mask", "routed_experts", "full_log_probs")]))
    with_mask, routed, full = "mask" in carried, "routed_experts" in carried, "full_log_probs" in carried
    captured = draw(turn_sequences(mask=with_mask, routed=routed, max_turns=4, last_status=st.just("completed"),
                                   full=full))
    missing = draw(st.sampled_from([m for r in range(1, len(carried) + 1) for m in itertools.combinations(carried, r)]))
    # The gap turn's own routed_experts (when it still has them) must not shrink.
    k = None if captured[-1].routed is None else draw(st.integers(captured[-1].routed.shape[0], 4))
    gap_turn = draw(turn_specs(mask=st.just(with_mask), routed_k=st.just(k), full=st.just(full))).without(missing)
    later = draw(st.lists(turn_specs(), max_size=3))
    return captured, carried, missing, gap_turn, later


@pytest.mark.slow
@prop(150)
@given(scenario=gap_scenarios())
def test_replay_gap_cuts_at_last_captured_sampled_tokens(scenario):
    """§4: a turn lacking a carried replay field cuts the trajectory after the
    last captured turn's sampled tokens (its trailing forced tokens dropped)."""
    captured, carried, missing, gap_turn, later = scenario
    traj = merge(captured)
    assert traj.append_turn(gap_turn.build()) == TurnOutcome(False, "replay_gap")
    exp = whole_build(captured, drop_last_forced=True)
    assert_trajectory_is(traj, exp, with_mask="mask" in carried)
    expected_field = next(f for f in REPLAY_FIELDS if f in missing)
    assert traj.gap == Gap(len(captured), expected_field)
    assert expected_field == "mask" or "mask" not in missing
    assert traj.status == "completed" and traj.terminal and traj.turns == len(captured)
    assert traj.weight_versions == [s.weight_version for s in captured if s.weight_version is not None]
    if "routed_experts" in carried:
        assert_same_array(traj.routed_experts, captured[-1].routed)
    for spec in later:
        assert traj.append_turn(spec.build()) == TurnOutcome(applied=False, reason="replay_gap")
    assert_trajectory_is(traj, exp, with_mask="mask" in carried)
    assert traj.gap == Gap(len(captured), expected_field)


# == 5b. shed trajectories (the broker's eviction of open ones) =========================
def outcome_of(traj: Trajectory, turn):
    try:
        return traj.append_turn(turn)
    except ProtocolError as error:
        return error.code


@pytest.mark.slow
@prop(200)
@given(specs=st.lists(turn_specs(), min_size=1, max_size=7), data=st.data())
def test_a_shed_trajectory_merges_exactly_as_the_whole_one_and_replays_to_it(specs, data):
    """Any turns, valid or not (mask and replay fields starting, going
    missing, shrinking; any status): shed at any point, the trajectory
    gives every later turn the outcome the whole one gives it, keeps the
    same lengths, status and gap, and replaying the applied turns into a
    fresh trajectory (as the broker reads one back from its store) gives
    the whole one's arrays."""
    whole, shed = Trajectory("t", np.array([1, 2], np.int32)), Trajectory("t", np.array([1, 2], np.int32))
    cut = data.draw(st.integers(0, len(specs)))
    applied = []
    for position, spec in enumerate(specs):
        if position == cut:
            shed.shed()
        turn = spec.build()
        outcome = outcome_of(whole, turn)
        assert outcome_of(shed, turn) == outcome
        if outcome == TurnOutcome(True):
            applied.append(turn)
        assert (shed.response_length, shed.turns, shed.status, shed.gap, shed.terminal, shed.weight_versions) == (
            whole.response_length, whole.turns, whole.status, whole.gap, whole.terminal, whole.weight_versions)
    replayed = Trajectory("t", np.array([1, 2], np.int32))
    for turn in applied:
        assert replayed.append_turn(turn) == TurnOutcome(True)
    if whole.gap is not None:
        replayed.cut_at_gap(whole.gap)
    expected, got = whole.arrays(), replayed.arrays()
    assert expected.keys() == got.keys()
    for name in expected:
        assert_same_array(got[name], expected[name])
    if cut < len(specs):
        with pytest.raises(RuntimeError, match="shed"):
            shed.arrays()


# == 6. corruption ====================================================================
# Contract facts restated from docs/protocol.md §2 (not read from the code under test).
ITEMSIZE = {
    "prompt_tokens": 4, "tokens": 4, "forced_tokens": 4, "log_probs": 4, "loss_mask": 1,
    "mask_ids": 4, "mask_offsets": 8, "routed_experts": 4, "indexer_topk": 4, "full_log_probs": 4,
}
MULTI_DIM = {"routed_experts", "indexer_topk"}
CONTENT_CODES = {"misaligned", "mask_invalid", "out_of_vocab", "invalid_value"}
CORRUPTIONS = ("flip", "truncate", "drop", "duplicate", "random_header", "dtype", "shape")


def repack(frames, edit):
    header = msgpack.unpackb(frames[0], raw=False)
    edit(header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def expected_shape_outcome(name, shape, nbytes):
    """The reply a shape entry must get, from docs/protocol.md §2; None: accepted."""
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        return "schema"
    if (len(shape) < 1) if name in MULTI_DIM else (len(shape) != 1):
        return "shape"
    if math.prod(shape) * ITEMSIZE[name] != nbytes:
        return "shape"
    return None


def shape_candidates(shape):
    if not (isinstance(shape, list) and all(type(d) is int for d in shape)):
        shape = [1]  # an earlier corruption already broke this entry
    p = math.prod(shape)
    same_size = st.sampled_from([list(shape), [p], [p, 1], [1, p], list(reversed(shape)), []])
    broken = st.one_of(
        st.lists(st.integers(-2, 2**40), max_size=4),
        st.lists(st.integers(0, 12), min_size=1, max_size=3),
        st.none(),
        st.integers(0, 9),
        st.text(max_size=3),
        st.lists(st.booleans(), min_size=1, max_size=2),
        st.lists(st.floats(0, 5), min_size=1, max_size=2),
    )
    return st.one_of(same_size, broken)  # half the time a same-size reshape


dtype_candidates = st.sampled_from(
    ["int32", "int64", "float32", "uint8", "<i4", "i4", "int16", "float64", "bool", "object", "|u1", "<f4"]
) | st.text(max_size=6) | st.integers(-(2**63), 2**63 - 1) | st.none() | st.lists(st.text(max_size=3), max_size=2)


def corrupt(data, frames, kind):
    """Apply one corruption; return the new frames and what was hit."""
    frames = list(frames)
    if kind in ("flip", "truncate"):
        i = data.draw(st.sampled_from([i for i, f in enumerate(frames) if f]), label="frame")
        if kind == "flip":
            buf = bytearray(frames[i])
            buf[data.draw(st.integers(0, len(buf) - 1), label="byte")] ^= data.draw(st.integers(1, 255), label="xor")
            frames[i] = bytes(buf)
        else:
            frames[i] = frames[i][: data.draw(st.integers(0, len(frames[i]) - 1), label="length")]
        return frames, {"frame": i}
    if kind == "drop":
        i = data.draw(st.integers(0, len(frames) - 1), label="frame")
        del frames[i]
        return frames, {"frame": i}
    if kind == "duplicate":
        i = data.draw(st.integers(0, len(frames) - 1), label="frame")
        frames.insert(i, frames[i])
        return frames, {"frame": i}
    if kind == "random_header":
        frames[0] = data.draw(st.binary(max_size=64), label="header")
        return frames, {"frame": 0}
    entries = msgpack.unpackb(frames[0], raw=False)["arrays"]
    j = data.draw(st.integers(0, len(entries) - 1), label="entry")
    name, _, shape = entries[j]
    value = data.draw(dtype_candidates if kind == "dtype" else shape_candidates(shape), label=kind)

    def edit(header):
        header["arrays"][j][1 if kind == "dtype" else 2] = value

    return repack(frames, edit), {"entry": j, "name": name, "value": value, "frame": j + 1}


def decode_or_error(frames):
    """decode, with ProtocolError turned into a value; any other exception escapes."""
    try:
        return decode(frames, PRODUCER_TO_BROKER), None
    except ProtocolError as err:
        assert err.code in NACK_CODES, err.code
        return None, err


def assert_arrays_unchanged_by_header_edit(message, original) -> None:
    """A header edit leaves every array frame as it was: same names, same
    bytes; only a multi-dim replay array may be viewed in another shape of
    the same size (that shape lives in the header, outside the CRC)."""
    assert sorted(message.arrays) == sorted(original.arrays)
    for name, arr in original.arrays.items():
        got = message.arrays[name]
        assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes()
        if name not in MULTI_DIM:
            assert got.shape == arr.shape


@st.composite
def encoded_turns(draw):
    """A turn's frames, CRC'd or not, one frame per array or packed in one."""
    spec, trajectory_id, index, kwargs = draw(turn_messages())
    crc = draw(st.booleans())
    frames = [bytes(f) for f in encode_turn(trajectory_id, index, spec.build(), crc=crc, may_pack=draw(st.booleans()),
                                            **kwargs)]
    return frames, crc


def array_bytes(frames) -> dict[str, bytes]:
    """Each listed array's bytes as the frames carry them, for either layout."""
    header = msgpack.unpackb(frames[0], raw=False)
    if not header.get("packed"):
        return {entry[0]: bytes(frame) for entry, frame in zip(header["arrays"], frames[1:])}
    out, start = {}, 0
    for name, _, shape in header["arrays"]:
        end = start + ITEMSIZE[name] * math.prod(shape)
        out[name] = bytes(frames[1][start:end])
        start = end
    return out


@pytest.mark.slow
@prop(400)
@given(encoded=encoded_turns(), kind=st.sampled_from(CORRUPTIONS), data=st.data())
def test_single_corruption_is_refused_with_the_right_code_or_is_harmless(encoded, kind, data):
    """A damaged frame must be answered with a nack code, never crash the
    broker, and never be read as a different message the CRC should have caught.

    The CRC (docs/protocol.md §2) covers the array frames only, so header damage
    is caught only when it breaks the schema. Header edits that decode can
    not detect, with or without a CRC: a flipped character in a string field
    (trajectory_id, weight_version, metadata, group_id), a changed integer
    (seq, turn > 0, group_size, sample_index), renaming the `crc32` key (which
    switches the CRC check off), and a reshape of a multi-dim replay array to
    another shape of the same size. Array bytes are still exactly the sent ones.
    """
    frames, crc = encoded
    original = decode(frames, PRODUCER_TO_BROKER)
    damaged, hit = corrupt(data, frames, kind)
    message, err = decode_or_error(damaged)
    header_hit = hit["frame"] == 0 or kind in ("dtype", "shape")
    event(f"{kind}{' header' if header_hit else ''}{' crc' if crc else ''}: {err.code if err else 'decoded'}")

    if kind == "flip" and not header_hit:
        if crc:
            assert err is not None and err.code == "crc_mismatch"
        elif err is not None:
            assert err.code in CONTENT_CODES
        else:
            # Undetectable without a CRC: any value change that keeps the content
            # rules (a finite log-prob, a 0<->1 loss flip, a token or mask id that
            # stays non-negative and in its support, any routed_experts value, an
            # offset change that keeps the CSR valid). The bytes are read as sent.
            assert dict(message.fields) == dict(original.fields)
            sent = array_bytes(damaged)
            for name, arr in message.arrays.items():
                assert arr.tobytes() == sent[name]
            assert_content_valid(message)
    elif kind == "truncate":
        assert err is not None
        if hit["frame"] == 0:
            assert err.code == "malformed"  # no proper prefix of a msgpack map is complete
        else:
            assert err.code in ({"crc_mismatch", "shape"} if crc else {"shape"})
    elif kind in ("drop", "duplicate"):
        assert err is not None
        if not (kind == "drop" and hit["frame"] == 0):
            assert err.code == "schema"  # array frame count no longer matches the header
    elif kind == "random_header":
        if message is not None:
            assert_messages_equal(message, original)
    elif kind == "dtype":
        if err is not None:
            assert err.code == "dtype"
        else:  # only the same dtype (its contract name, or an alias of it) may pass
            assert_messages_equal(message, original)
    elif kind == "shape":
        nbytes = original.arrays[hit["name"]].nbytes
        outcome = expected_shape_outcome(hit["name"], hit["value"], nbytes)
        if outcome is None:
            assert err is None, err
            assert_arrays_unchanged_by_header_edit(message, original)
            assert list(message.arrays[hit["name"]].shape) == hit["value"]
            assert dict(message.fields) == dict(original.fields)
        else:
            assert err is not None and err.code == outcome, (err, outcome)
    else:  # a flipped byte in the header
        if message is not None:
            assert_arrays_unchanged_by_header_edit(message, original)
            assert_content_valid(message)


@pytest.mark.slow
@prop(300)
@given(encoded=encoded_turns(), kinds=st.lists(st.sampled_from(CORRUPTIONS), min_size=1, max_size=3), data=st.data())
def test_chained_corruptions_never_crash_and_never_yield_unchecked_content(encoded, kinds, data):
    """Several corruptions at once: the only outcomes are a nack code, or a
    message that passes every content rule; with a CRC its array frames are
    also exactly the ones sent (only an intact, CRC-checked stream passes).

    Without a CRC, frame reordering (drop one frame, duplicate another) can
    go unnoticed when the swapped frames have the same size and the values
    still pass the content rules."""
    frames, crc = encoded
    damaged = frames
    for kind in kinds:
        if not any(damaged) or (kind in ("dtype", "shape") and not _has_arrays_header(damaged)):
            continue
        damaged, _ = corrupt(data, damaged, kind)
    message, err = decode_or_error(damaged)
    if message is None:
        return
    assert_content_valid(message)
    if crc and "crc32" in msgpack.unpackb(damaged[0], raw=False):
        concat = b"".join(damaged[1:])
        assert concat == b"".join(bytes(f) for f in frames[1:])


def _has_arrays_header(frames) -> bool:
    if not frames:
        return False
    try:
        header = msgpack.unpackb(frames[0], raw=False)
    except Exception:
        return False
    return isinstance(header, dict) and isinstance(header.get("arrays"), list) and len(header["arrays"]) > 0 and all(
        isinstance(e, list) and len(e) == 3 for e in header["arrays"]
    )


# == 6b. the decoder's msgspec fast path against the checked way ========================
CHECKED = {schema.name: dataclasses.replace(schema, fast=None)
           for schema in (PRODUCER_TO_BROKER, BROKER_TO_PRODUCER, CONSUMER_TO_BROKER, BROKER_TO_CONSUMER,
                          ADMIN_REQUESTS, ADMIN_REPLIES)}

# Header values of every kind a peer could send, nested maps with non-string keys included.
header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=4)
    | st.binary(max_size=3) | st.sampled_from(["", "turn", "completed", "aborted", "trajectory", "group"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3) | st.integers(0, 3), inner, max_size=2),
    max_leaves=6,
)

# Values at the edges of the kinds: an empty string, zero, a negative, a bool for an int, 2**32 for a CRC.
boundary_values = st.sampled_from(["", 0, -1, True, False, 1.5, 2**32, 2**32 - 1, [], {}, [1, 2], [[1, 2]], [[2, 1]]])

plain_headers = st.sampled_from([
    (PRODUCER_TO_BROKER, {"v": 1, "type": "hello", "producer_id": "p", "seq": 0, "batch_acks": True}),
    (PRODUCER_TO_BROKER, {"v": 1, "type": "ping", "seq": 3}),
    (PRODUCER_TO_BROKER, {"v": 1, "type": "abort", "seq": 4, "trajectory_id": "t", "reason": "retry"}),
    (PRODUCER_TO_BROKER, {"v": 1, "type": "end", "seq": 5, "trajectory_id": "t", "reward": 1.0, "turns": 2}),
    (PRODUCER_TO_BROKER, {"v": 1, "type": "end", "seq": 5, "trajectory_id": "t", "reward": {"score": 1, "ok": True},
                          "turns": 2, "metadata": {"env": "math", "tags": ["a", {"b": None}]}}),
    (PRODUCER_TO_BROKER, {"v": 1, "type": "reward", "seq": 7, "trajectory_id": "t", "reward": -2}),
    (BROKER_TO_CONSUMER, {"v": 1, "type": "deliver", "lease": "e-1", "trajectory_id": "t", "status": "completed",
                          "reward": 0.5, "response_length": 0, "weight_versions": ["3"], "metadata": {"k": [1, 2.5]},
                          "turns": 1, "gap": {"turn": 1, "field": "mask"}, "weight_version_spans": [["3", 0, 1]]}),
    (BROKER_TO_PRODUCER, {"v": 1, "type": "ack", "seq": 6, "trajectory_id": "t", "applied": True, "turn": 0}),
    (BROKER_TO_PRODUCER, {"v": 1, "type": "acks", "ranges": [[1, 4]], "outcomes": [{"seq": 2, "applied": False}]}),
    (BROKER_TO_PRODUCER, {"v": 1, "type": "welcome", "broker_id": "b", "max_message_bytes": 9, "window": 8}),
    (CONSUMER_TO_BROKER, {"v": 1, "type": "credit", "n": 3, "unit": "group"}),
    (CONSUMER_TO_BROKER, {"v": 1, "type": "ack", "leases": ["l1", "l2"]}),
    (CONSUMER_TO_BROKER, {"v": 1, "type": "nack", "leases": ["l1"], "reason": "bad", "requeue": False}),
    (BROKER_TO_CONSUMER, {"v": 1, "type": "acked", "leases": ["l1"], "seq": 1}),
    (ADMIN_REQUESTS, {"v": 1, "type": "dead_letters", "limit": 5}),
    (ADMIN_REPLIES, {"v": 1, "type": "requeued", "trajectory_ids": ["t"]}),
])


@st.composite
def edited_messages(draw):
    """A real message (a turn with its arrays, a delivery with its metadata
    and reward, either packed or a frame per array, or a header-only one),
    its header then edited:
    keys set to values of any kind, removed, or added."""
    kind = draw(st.sampled_from(["turn", "deliver", "header"]))
    if kind == "turn":
        frames, _ = draw(encoded_turns())
        schema = PRODUCER_TO_BROKER
    elif kind == "deliver":
        specs, _, _, _ = draw(trajectories())
        traj = merge(specs)
        traj.reward, traj.metadata = draw(st.sampled_from([1.0, {"score": 2}])), draw(metadata_st)
        frames = [bytes(f) for f in encode_deliver(traj, "e-1", may_pack=draw(st.booleans()))]
        schema = BROKER_TO_CONSUMER
    else:
        schema, header = draw(plain_headers)
        frames = [msgpack.packb(header, use_bin_type=True)]
    header = msgpack.unpackb(frames[0], raw=False)
    names = sorted(header) + ["seq", "metadata", "group_id", "newer_key", "arrays", "crc32", "packed"]
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.sampled_from(names))
        if draw(st.integers(0, 3)) == 0:
            header.pop(name, None)
        else:
            header[name] = draw(boundary_values | header_values)
    entries = header.get("arrays")
    if (type(entries) is list and entries and all(type(e) is list and len(e) == 3 and type(e[2]) is list for e in entries)
            and draw(st.booleans())):  # entries as encoding wrote them (an edit above may have set others)
        at = draw(st.integers(0, len(entries) - 1))
        entries[at] = draw(edited_entries(entries[at], entries[-1][0]))
    frames = [msgpack.packb(header, use_bin_type=True), *frames[1:]]
    if len(frames) > 1 and draw(st.integers(0, 3)) == 0:  # a body a byte short or a byte long
        frames[-1] = bytes(frames[-1])[:-1] if draw(st.booleans()) else bytes(frames[-1]) + b"\0"
    return schema, frames


def edited_entries(entry, other_name):
    """An array entry renamed (to `other_name`, listed too, or an unknown
    name), given another dtype, or another shape (rank or length)."""
    name, dtype, shape = entry
    return st.sampled_from([
        [other_name, dtype, shape], ["newer_array", dtype, shape], [name, "int64", shape], [name, "float16", shape],
        [name, dtype, [*shape, 1]], [name, dtype, []], [name, dtype, [shape[0] + 1] if shape else [1]],
    ])


def decode_outcome(frames, schema):
    """What decoding gives: the message as plain values, or the refusal."""
    try:
        message = decode(frames, schema)
    except ProtocolError as err:
        return ("refused", err.code, err.message, err.seq)
    return ("decoded", message.type, message.fields,
            {name: (arr.dtype.str, arr.shape, arr.tobytes()) for name, arr in message.arrays.items()})


@pytest.mark.slow
@prop(600)
@given(case=edited_messages())
def test_the_fast_decoder_decodes_and_refuses_exactly_as_the_checked_way(case):
    """Plain headers go through msgspec structs built from the catalogue;
    whatever those accept must come out as the checked decoder gives it, and
    whatever they refuse must get the checked decoder's answer (it decodes
    them), so both paths give one result for every header."""
    schema, frames = case
    fast, checked = decode_outcome(frames, schema), decode_outcome(frames, CHECKED[schema.name])
    event(f"{fast[0]} {fast[1]}")
    assert fast == checked


def test_every_message_type_has_a_fast_decoder_and_maps_are_read_raw():
    spec_turn, names, raw = next(t for t in PRODUCER_TO_BROKER.fast_specs.values() if t[0].type == "turn")
    assert {"metadata", "trajectory_id"} <= set(names) and set(raw) == {"metadata", "weight_version_spans"}
    for schema in (PRODUCER_TO_BROKER, BROKER_TO_PRODUCER, CONSUMER_TO_BROKER, BROKER_TO_CONSUMER):
        assert {spec.type for spec, _, _ in schema.fast_specs.values()} == set(schema.specs), schema.name
    _, _, raw = next(t for t in BROKER_TO_CONSUMER.fast_specs.values() if t[0].type == "deliver")
    assert set(raw) == {"reward", "metadata", "gap", "weight_version_spans"}


@pytest.mark.parametrize("levels", [40, 100_000])
def test_a_raw_value_nested_too_deep_is_refused_as_the_checked_way_refuses_it(levels):
    """Past `MAX_HEADER_DEPTH` levels with the header's own; and past
    msgspec's stack, where it gives up (a `RecursionError`) finding where
    the raw value ends and the checked way answers."""
    head = msgpack.packb({"v": 1, "type": "end", "seq": 5, "trajectory_id": "t", "turns": 2}, use_bin_type=True)
    nested = b"\x91" * levels + b"\xc0"  # one-element lists around nil
    frames = [bytes([0x86]) + head[1:] + msgpack.packb("metadata") + b"\x81" + msgpack.packb("k") + nested]
    fast, checked = decode_outcome(frames, PRODUCER_TO_BROKER), decode_outcome(frames, CHECKED[PRODUCER_TO_BROKER.name])
    assert fast == checked and fast[:2] == ("refused", "malformed")


# == 7. batch validation ==============================================================
sample_st = st.lists(vocab_support, max_size=6).flatmap(
    lambda sups: st.tuples(st.just(sups), st.tuples(*[st.sampled_from(s) for s in sups]).map(list))
)
batch_st = st.lists(sample_st, min_size=1, max_size=5)


def batch_arrays(batch):
    tokens = [np.array(toks, np.int32) for _, toks in batch]
    masks = []
    for supports, _ in batch:
        ids, offsets = csr_of(supports)
        masks.append((np.array(ids, np.int32), np.array(offsets, np.int64)))
    return tokens, masks


def packed(tokens, masks):
    """The packed form (one CSR over all samples), built in Python."""
    flat_tokens = [t for toks in tokens for t in toks.tolist()]
    ids, offsets = [], [0]
    for m_ids, m_offsets in masks:
        base = offsets[-1]
        ids += m_ids.tolist()
        offsets += [base + o for o in m_offsets.tolist()[1:]]
    lengths = [len(t) for t in tokens]
    return np.array(flat_tokens, np.int32), np.array(lengths, np.int64), np.array(ids, np.int32), np.array(offsets, np.int64)


@pytest.mark.slow
@prop(150)
@given(batch=batch_st)
def test_valid_batches_always_pass(batch):
    """A sampled token inside its support, ids in the vocab: no violation."""
    tokens, masks = batch_arrays(batch)
    validate_samples(tokens, masks, vocab_size=VOCAB)
    assert packed_violations(*packed(tokens, masks), vocab_size=VOCAB) == []


def _move_outside(data, batch, positions):
    """Replace sampled tokens at `positions` with in-vocab ids outside their support."""
    tokens, masks = batch_arrays(batch)
    for s, p in positions:
        support = batch[s][0][p]
        tokens[s][p] = data.draw(st.integers(0, VOCAB - 1).filter(lambda t: t not in support), label=f"token {s},{p}")
    return tokens, masks


@prop(150)
@given(batch=batch_st, data=st.data())
def test_one_token_outside_its_support_is_reported_at_its_sample_and_position(batch, data):
    """The error must point at the exact sample and position, and nothing else."""
    positions = [(s, p) for s, (sups, _) in enumerate(batch) for p in range(len(sups))]
    assume(positions)
    s, p = data.draw(st.sampled_from(positions), label="moved")
    tokens, masks = _move_outside(data, batch, [(s, p)])
    with pytest.raises(BatchValidationError) as err:
        validate_samples(tokens, masks, vocab_size=VOCAB)
    assert [(v.rule, v.sample, v.position, v.count) for v in err.value.violations] == [(RULE_IN_SUPPORT, s, p, 1)]
    found = packed_violations(*packed(tokens, masks), vocab_size=VOCAB)
    assert [(v.rule, v.sample, v.position, v.count) for v in found] == [(RULE_IN_SUPPORT, s, p, 1)]


@pytest.mark.slow
@prop(150)
@given(batch=batch_st, data=st.data())
def test_many_tokens_outside_support_give_first_position_and_count_per_sample(batch, data):
    """One violation per failing sample: its first bad position and how many."""
    positions = [(s, p) for s, (sups, _) in enumerate(batch) for p in range(len(sups))]
    assume(positions)
    moved = data.draw(st.lists(st.sampled_from(positions), min_size=1, unique=True), label="moved")
    tokens, masks = _move_outside(data, batch, moved)
    expected = []
    for s in sorted({s for s, _ in moved}):
        ps = sorted(p for t, p in moved if t == s)
        expected.append((RULE_IN_SUPPORT, s, ps[0], len(ps)))
    with pytest.raises(BatchValidationError) as err:
        validate_samples(tokens, masks, vocab_size=VOCAB)
    assert [(v.rule, v.sample, v.position, v.count) for v in err.value.violations] == expected


@prop(40)
@given(batch=batch_st, data=st.data())
def test_torch_batch_validation_agrees_with_numpy(batch, data):
    """The consumer validates on torch tensors: same violations as numpy."""
    torch = pytest.importorskip("torch")
    positions = [(s, p) for s, (sups, _) in enumerate(batch) for p in range(len(sups))]
    moved = data.draw(st.lists(st.sampled_from(positions), unique=True), label="moved") if positions else []
    tokens, masks = _move_outside(data, batch, moved)
    arrays = packed(tokens, masks)
    on_numpy = packed_violations(*arrays, vocab_size=VOCAB)
    on_torch = packed_violations(*(torch.from_numpy(a) for a in arrays), vocab_size=VOCAB)
    assert [(v.rule, v.sample, v.position, v.count) for v in on_torch] == [
        (v.rule, v.sample, v.position, v.count) for v in on_numpy
    ]
    assert bool(on_numpy) == bool(moved)


# Values that make hits likely and sit at the int32 edges the scan must survive.
_edge_ids = st.sampled_from([INT32[0], INT32[0] + 1, -1, 0, 1, 2, 3, INT32[1] - 1, INT32[1]])


@st.composite
def _membership_case(draw):
    """Tokens and supports (some longer than 255 ids, some holding the token
    256 times) as plain lists."""
    rows = draw(st.lists(st.tuples(_edge_ids, st.lists(_edge_ids, min_size=1, max_size=6), st.integers(0, 2)),
                         max_size=12))
    tokens, supports = [], []
    for token, support, stretch in rows:
        if stretch == 1:  # long support without the token
            support = support + [v for v in range(300) if v != token][: 300 - len(support)]
        elif stretch == 2:  # the token 256 times: a uint8 count would wrap to 0
            support = support + [token] * 256
        tokens.append(token)
        supports.append(support)
    return tokens, supports


@prop(120)
@given(case=_membership_case())
@example(case=([5, 7], [[5] * 256, [7]]))
@example(case=([5, 7], [[5, 5], [8]]))  # as many matches as tokens, the second support without its own
@example(case=([5, 7, 9], [[5, 5], [7, 7], [9]]))  # every pairing shifted by a second match
@example(case=([5, 7, 9], [[5, 5], [7, 7], [8]]))
@example(case=([INT32[0], INT32[1]], [[INT32[0]], [INT32[1], 0]]))
def test_inside_support_matches_a_python_membership_test_on_every_path(case):
    """Numpy counting hits and pairing them, with and without torch loaded,
    and torch, all agree with
    `token in support` (scan-based spreading must not overflow, uint8 hit
    counts must not wrap)."""
    from unittest import mock

    from rollstream.common import validation

    torch = pytest.importorskip("torch")
    tokens, supports = case
    ids, offsets = csr_of(supports)
    arrays = np.array(tokens, np.int32), np.array(ids, np.int32), np.array(offsets, np.int64)
    expected = [t in s for t, s in zip(tokens, supports)]
    wide = np.array(tokens, np.int64) + 2**32  # int64 tokens no int32 support can hold
    for fast in (True, False):
        with mock.patch.object(validation._NumpyOps, "fast_running_sum", staticmethod(lambda: fast)):
            assert validation.inside_support(*arrays).tolist() == expected, f"numpy, fast_running_sum={fast}"
            assert not validation.inside_support(wide, *arrays[1:]).any(), f"wide numpy, fast_running_sum={fast}"
    with mock.patch.dict(sys.modules):  # as in the broker and producers: numpy's prefix sum spreads, hits paired
        del sys.modules["torch"]
        assert validation.inside_support(*arrays).tolist() == expected, "numpy without torch"
    assert validation.inside_support(*(torch.from_numpy(a) for a in arrays)).tolist() == expected, "torch"
    assert not validation.inside_support(torch.from_numpy(wide), *(torch.from_numpy(a) for a in arrays[1:])).any()


@prop(120)
@given(rows=st.lists(st.tuples(_edge_ids, st.booleans()), min_size=1, max_size=10), size=st.integers(32, 300),
       seed=st.integers(0, 2**16))
def test_supports_of_one_length_agree_with_a_python_membership_test(rows, size, seed):
    """Supports all of one length (the matrix path, from 32 ids): the same
    answers as `token in support`, whether the token is anywhere in its
    support or only in a neighbour's."""
    from rollstream.common import validation

    rng = np.random.default_rng(seed)
    tokens, supports = [], []
    for token, inside in rows:
        support = [int(v) for v in rng.integers(-2**31, 2**31 - 1, size) if v != token]
        support += [int(rng.integers(0, 2**31 - 1))] * (size - len(support))
        if inside:
            support[int(rng.integers(0, size))] = token
        tokens.append(token)
        supports.append(support)
    if len(rows) > 1 and not rows[1][1]:
        supports[0][-1] = tokens[1]  # the next token at the end of this support: not its own
    ids, offsets = csr_of(supports)
    got = validation.inside_support(np.array(tokens, np.int32), np.array(ids, np.int32), np.array(offsets, np.int64))
    assert got.tolist() == [t in s for t, s in zip(tokens, supports)]


@prop(200)
@given(flags=st.lists(st.booleans(), max_size=300), data=st.data())
def test_segment_any_says_whether_each_segment_holds_a_set_flag(flags, data):
    """Short segments and long ones (two ways of computing it), empty ones
    included: they hold nothing (logical_or.reduceat would read the next
    segment's first flag for them)."""
    from rollstream.common import validation

    cuts = sorted(data.draw(st.lists(st.integers(0, len(flags)), max_size=8)))
    offsets = np.array([0, *cuts, len(flags)], dtype=np.int64)
    got = validation._NumpyOps.segment_any(np.array(flags, dtype=bool), offsets)
    assert got.tolist() == [any(flags[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]


def test_segment_any_on_long_segments_skips_the_empty_ones():
    from rollstream.common import validation

    flags = np.zeros(200, dtype=bool)
    flags[100] = True  # the first flag of the segment after an empty one
    offsets = np.array([0, 0, 100, 100, 200], dtype=np.int64)
    assert validation._NumpyOps.segment_any(flags, offsets).tolist() == [False, False, False, True]


# == the support's log-probs, producer to trainer ==========================================
@st.composite
def supported_turns(draw):
    """One turn's sampled tokens with supports and the sampler's log-prob of
    every support id, renormalised over each support or not, and its forced
    tokens."""
    supports = draw(st.lists(vocab_support, max_size=5))
    tokens = [draw(st.sampled_from(s)) for s in supports]
    normalized = draw(st.booleans())
    values = []
    for support in supports:
        raw = draw(st.lists(st.floats(-20.0, 0.0, width=32), min_size=len(support), max_size=len(support)))
        if normalized:  # log-softmax over the support, in float64, then float32 as an engine sends them
            shift = max(raw)
            raw = [v - shift - math.log(sum(math.exp(w - shift) for w in raw)) for v in raw]
        values += raw
    forced = draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))
    return tokens, supports, np.array(values, "<f4"), normalized, forced


@prop(60)
@given(turns=st.lists(supported_turns(), min_size=1, max_size=4), packed=st.booleans())
def test_mask_log_probs_reach_the_trainer_byte_for_byte(turns, packed):
    """Each turn as the producer builds and sends it, as the broker decodes
    and merges it, the trajectory as the broker delivers it and the consumer
    batches it: `to_train_data()["rollout_sampling_mask_log_probs"]` holds
    the bytes the producer sent, 0.0 for each forced token's singleton."""
    import torch
    from consumer_helpers import delivery

    from rollstream.consumer import Batch

    merged = Trajectory("t", np.array([1, 2], np.int32))
    expected = []
    for index, (tokens, supports, values, normalized, forced) in enumerate(turns):
        sent = Turn.build(tokens, [-0.5] * len(tokens), supports=supports, mask_log_probs=values,
                          mask_log_probs_normalized=normalized, forced_tokens=forced or None)
        frames = encode_turn("t", index, sent, seq=index, prompt_tokens=np.array([1, 2], np.int32) if index == 0 else None)
        received = decode(frames, PRODUCER_TO_BROKER)
        assert received.get("mask_log_probs_normalized", False) is normalized
        assert merged.append_turn(turn_from_message(received)) == TurnOutcome(True)
        expected += [values, np.zeros(len(forced), "<f4")]
    merged.reward = 1.0
    batch = Batch.from_deliveries([delivery(merged, may_pack=packed)], seq=0, device="cpu")
    (got,) = batch.to_train_data()["rollout_sampling_mask_log_probs"]
    assert got.dtype == torch.float32 and got.numpy().tobytes() == np.concatenate(expected).tobytes()
    assert batch.mask_log_probs.numpy().tobytes() == np.concatenate(expected).tobytes()
