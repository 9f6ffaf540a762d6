"""The compiled checks (common/_native.c) against the numpy ones they
stand in for: the same answer on every valid mask and on every content rule
broken, nothing read out of range on broken offsets, and the arrays they
take checked. The compiled merge of a delivery's turns against the numpy
join it stands in for: the same bytes sent. Both paths run here: the numpy one with the compiled module
set aside. Where the installed module carries an AVX2 build of its loops
beside the default one (picked at load time), a second build holding the
default alone answers alike."""
import contextlib
import functools
import importlib.util
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_content_check_agreement import VOCAB, _messages

from rollstream.common import trajectory as trajectory_module
from rollstream.common import validation
from rollstream.common.codec import decode, encode, packed_body
from rollstream.common.errors import LocalProtocolError
from rollstream.common.messages import BROKER_TO_CONSUMER
from rollstream.common.trajectory import Trajectory, Turn
from rollstream.common.wire import encode_deliver, trajectory_from_deliver

try:
    from rollstream.common import _native as native
except ImportError:
    if shutil.which("cc") or shutil.which("gcc"):  # the optional build failed where it could have run
        raise ImportError("rule 'the install builds common/_native.c where a C compiler exists' not met: a compiler "
                          "is on PATH, the module is missing (reinstall and read the build's output)") from None
    pytest.skip("built without a C compiler: numpy checks alone", allow_module_level=True)


@contextlib.contextmanager
def compiled_set_aside(module: ModuleType):
    """`module` without the compiled module: it takes its numpy paths."""
    compiled, module._native = module._native, None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module._native = compiled  # type: ignore[attr-defined]


def numpy_only():
    """The compiled checks set aside: validation takes its numpy paths."""
    return compiled_set_aside(validation)


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


@st.composite
def samples(draw, full=False, support=False):
    """Samples as deliveries carry them, keeping every rule (forced tokens:
    loss 0, log-prob 0.0, a singleton support), with `full_log_probs` and
    `mask_log_probs` when asked, then up to two values changed, which may
    break one."""
    supports = draw(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=20), max_size=10))
    forced = [len(s) == 1 and draw(st.booleans()) for s in supports]
    arrays = {
        "prompt_tokens": np.array(draw(st.lists(st.integers(0, 40), max_size=4)), np.int32),
        "tokens": np.array([draw(st.sampled_from(s)) for s in supports], np.int32),
        "log_probs": np.array([0.0 if f else draw(st.sampled_from([-2.0, -0.5, -0.0])) for f in forced], np.float32),
        "loss_mask": np.array([0 if f else draw(st.sampled_from([0, 1])) for f in forced], np.uint8),
        "mask_ids": np.array([i for s in supports for i in s], np.int32),
        "mask_offsets": np.cumsum([0, *map(len, supports)]).astype(np.int64),
    }
    if full:
        arrays["full_log_probs"] = np.array([draw(st.sampled_from([-3.0, -0.0])) for _ in supports], np.float32)
    if support:
        arrays["mask_log_probs"] = np.full(len(arrays["mask_ids"]), -1.5, np.float32)
    changes = {"prompt_tokens": [-1, 41], "tokens": [-1, 41, 3], "log_probs": [0.0, 0.01, np.nan, -np.inf],
               "loss_mask": [0, 2], "mask_ids": [-1, 41, 7], "mask_offsets": [-1, 0, 3, 10**12],
               "full_log_probs": [0.01, np.nan, -np.inf], "mask_log_probs": [0.5, np.nan, -np.inf]}
    changes = {name: values for name, values in changes.items() if name in arrays}
    for name in draw(st.lists(st.sampled_from(sorted(changes)), max_size=2)):
        if len(arrays[name]):
            arrays[name] = arrays[name].copy()
            arrays[name][draw(st.integers(0, len(arrays[name]) - 1))] = draw(st.sampled_from(changes[name]))
    return arrays


def _packed_with_numpy(batch, vocab_size):
    """The batch packed by `np.concatenate` and `pack_csr`, and whether it
    is valid: the packed batch's verdict (`packed_flags`, as the consumer
    checks it) and each sample's offsets framing its ids."""
    with numpy_only():
        ids, offsets = validation.pack_csr([a["mask_ids"] for a in batch], [a["mask_offsets"] for a in batch])
        tokens = np.concatenate([np.empty(0, np.int32), *(a["tokens"] for a in batch)])
        sequences = np.concatenate([np.empty(0, np.int32), *(part for a in batch for part in (a["prompt_tokens"], a["tokens"]))])
        log_probs = np.concatenate([np.empty(0, np.float32), *(a["log_probs"] for a in batch)])
        loss_mask = np.concatenate([np.empty(0, np.uint8), *(a["loss_mask"] for a in batch)])
        response = np.array([len(a["tokens"]) for a in batch], np.int64)
        sequence = np.array([len(a["prompt_tokens"]) + len(a["tokens"]) for a in batch], np.int64)
        beside = {name: np.concatenate([np.empty(0, np.float32), *(a[name] for a in batch)]) if batch and name in batch[0]
                  else None for name in ("full_log_probs", "mask_log_probs")}
        full, support = beside["full_log_probs"], beside["mask_log_probs"]
        verdict = validation.Verdict(
            validation.packed_flags(tokens, response, ids, offsets, vocab_size=vocab_size, loss_mask=loss_mask,
                                    log_probs=log_probs, token_log_probs=None if full is None else {"full_log_probs": full},
                                    support_log_probs=None if support is None else {"mask_log_probs": support}),
            validation.packed_flags(sequences, sequence, vocab_size=vocab_size))
    # Each sample's own offsets run from 0 to its ids' end (the consumer checks that before packing:
    # `validate.sample_violations`), which the packed offsets no longer show.
    framed = all(a["mask_offsets"][0] == 0 and a["mask_offsets"][-1] == len(a["mask_ids"]) for a in batch)
    return [sequences, tokens, log_probs, loss_mask, ids, offsets, full, support], verdict.passed() and framed


@settings(max_examples=400, deadline=None)
@given(st.tuples(st.booleans(), st.booleans()).flatmap(lambda carried: st.lists(samples(*carried), max_size=4)),
       st.sampled_from([41, 30, None]))
def test_packing_checked_lays_samples_out_as_numpy_and_agrees_with_the_packed_check(batch, vocab_size):
    expected, valid = _packed_with_numpy(batch, vocab_size)
    out = [None if array is None else np.full(len(array), 99, array.dtype) for array in expected]
    assert validation.pack_checked(batch, out, vocab_size) is valid
    for got, want in zip(out, expected):
        assert (got is None and want is None) or (got.dtype == want.dtype and got.tobytes() == want.tobytes())  # NaN too


def test_samples_without_a_mask_are_packed_checked_too():
    batch = [{"prompt_tokens": np.array([1], np.int32), "tokens": np.array([2, 40], np.int32),
              "log_probs": np.array([-1.0, -0.5], np.float32), "loss_mask": np.array([1, 1], np.uint8)}]
    out = [np.empty(3, np.int32), np.empty(2, np.int32), np.empty(2, np.float32), np.empty(2, np.uint8), None, None,
           None, None]
    assert validation.pack_checked(batch, out, 41) is True
    assert out[0].tolist() == [1, 2, 40] and out[1].tolist() == [2, 40] and out[3].tolist() == [1, 1]
    assert validation.pack_checked(batch, out, 40) is False  # token 40 is past a vocabulary of 40


def test_samples_packing_checked_cannot_take_are_refused_naming_the_rule_with_nothing_written():
    sample = {"prompt_tokens": np.array([1], np.int32), "tokens": np.array([2], np.int32),
              "log_probs": np.array([-1.0], np.float32), "loss_mask": np.array([1], np.uint8),
              "mask_ids": np.array([2], np.int32), "mask_offsets": np.array([0, 1], np.int64)}

    def outs(sequences=2, ids=1, support=None):
        return [np.full(sequences, 7, np.int32), np.full(1, 7, np.int32), np.full(1, 7, np.float32), np.full(1, 7, np.uint8),
                np.full(ids, 7, np.int32), np.full(2, 7, np.int64), None,
                None if support is None else np.full(support, 7, np.float32)]

    cases = [
        ([sample, {**sample, "log_probs": np.array([-1.0, -1.0], np.float32)}], outs(4, 2), "align with its tokens"),
        ([sample, {**sample, "mask_offsets": np.array([0], np.int64)}], outs(4, 2), "align with its tokens"),
        ([sample, {k: v for k, v in sample.items() if k != "loss_mask"}], outs(4, 2), "carries the arrays packed"),
        ([{**sample, "tokens": np.array([2], np.int64)}], outs(), "tokens is a 1-D array of 4-byte"),
        ([sample], outs(3), "exactly the size"),
        ([sample], outs(ids=2), "exactly the size"),
        ([{**sample, "mask_log_probs": np.array([-1.0, -1.0], np.float32)}], outs(support=1), "align with its tokens and ids"),
        ([sample], outs(support=1), "carries the arrays packed"),
        ([{**sample, "mask_log_probs": np.array([-1.0], np.float32)}], [*outs()[:4], None, None, None, np.full(1, 7, np.float32)],
         "packed together"),
    ]
    for batch, out, rule in cases:
        with pytest.raises(ValueError, match=rule):
            native.pack_checked(batch, validation._SAMPLE_ROLES, tuple(out), 41, validation.LOG_PROB_TOLERANCE)
        assert all(o is None or (o == 7).all() for o in out)  # nothing written
        assert validation.pack_checked(batch, out, 41) is None  # the caller packs them its own way
    with numpy_only():
        assert validation.pack_checked([sample], outs(), 41) is None


@pytest.mark.parametrize("change, holds", [
    ({}, True),
    ({"full_log_probs": np.array([-1.0, -0.0], np.float32)}, True),
    ({"full_log_probs": np.array([-1.0, np.nan], np.float32)}, False),
    ({"full_log_probs": np.array([0.01, -1.0], np.float32)}, False),
    ({"mask_log_probs": np.array([-0.5, -0.5, -1.0], np.float32)}, True),
    ({"mask_log_probs": np.array([-0.5, 0.5, -1.0], np.float32)}, False),
    ({"mask_log_probs": np.array([-np.inf, -0.5, -1.0], np.float32)}, False),
    ({"log_probs": np.array([-0.5, np.nan], np.float32)}, False),
    ({"loss_mask": np.array([1, 2], np.uint8)}, False),
    ({"loss_mask": np.array([1, 0], np.uint8), "log_probs": np.array([-0.5, 0.0], np.float32)}, False),  # forced, 2 ids
    ({"prompt_tokens": np.array([8], np.int32)}, False),
    ({"mask_ids": np.array([1, 4, 8], np.int32)}, False),
    ({"tokens": np.array([1, 5], np.int32)}, False),  # 5 is not in its support
])
def test_each_rule_packing_checks_is_kept_as_the_packed_check_keeps_it(change, holds):
    """Each rule alone, on a sample with every array packing takes, against
    numpy's packing and packed check."""
    sample = {"prompt_tokens": np.array([3], np.int32), "tokens": np.array([1, 4], np.int32),
              "log_probs": np.array([-0.5, -1.0], np.float32), "loss_mask": np.ones(2, np.uint8),
              "mask_ids": np.array([1, 4, 2], np.int32), "mask_offsets": np.array([0, 1, 3], np.int64),
              "full_log_probs": np.array([-1.0, -2.0], np.float32), "mask_log_probs": np.full(3, -0.5, np.float32)}
    sample.update(change)
    expected, valid = _packed_with_numpy([sample], 8)
    assert valid is holds  # the reference agrees with the case
    out = [np.full(len(array), 99, array.dtype) for array in expected]
    assert validation.pack_checked([sample], out, 8) is holds


@functools.cache
def plain_build() -> ModuleType:
    """`_native.c` built again with `WIDE_VECTORS` empty: its loops for the
    compiler's default target alone, the build a CPU without AVX2 runs
    where the installed module picks its AVX2 build at load time."""
    source = Path(validation.__file__).with_name("_native.c")
    if not source.exists():
        pytest.skip(f"the module's source is not installed beside it: {source}")
    built = Path(tempfile.mkdtemp(prefix="rollstream-native-")) / f"_native{sysconfig.get_config_var('EXT_SUFFIX')}"
    command = [*shlex.split(sysconfig.get_config_var("CC")), "-shared", "-fPIC", *shlex.split(sysconfig.get_config_var("CFLAGS")),
               "-DWIDE_VECTORS=", f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(built)]
    subprocess.run(command, check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("_native", built)  # its init function is named for `_native`
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shutil.rmtree(built.parent)  # loaded: the file is no longer needed
    return module


@settings(max_examples=200, deadline=None)
@given(st.lists(_messages(), min_size=1, max_size=5), st.lists(masks(), max_size=3), st.sampled_from([8, 41, VOCAB]))
def test_the_default_target_build_checks_content_and_supports_as_the_installed_one(batch, supports, bound):
    batch = batch + [{"tokens": t, "mask_ids": i, "mask_offsets": o} for t, i, o in supports]
    for messages in (batch, batch[-1:]):
        assert plain_build().messages_content_valid(messages, validation._CONTENT_ROLES, bound, validation.LOG_PROB_TOLERANCE) \
            is _compiled(messages, bound)
    for tokens, ids, offsets in supports:
        outs = [np.full(len(tokens), 7, np.uint8) for _ in range(2)]
        for build, out in zip((plain_build(), native), outs):
            build.inside_support(tokens, ids, offsets, out)
        assert outs[0].tolist() == outs[1].tolist()


@settings(max_examples=200, deadline=None)
@given(st.tuples(st.booleans(), st.booleans()).flatmap(lambda carried: st.lists(samples(*carried), max_size=4)),
       st.sampled_from([41, 30]))
def test_the_default_target_build_packs_and_checks_as_the_installed_one(batch, bound):
    expected, _ = _packed_with_numpy(batch, bound)
    outs = [[None if array is None else np.full(len(array), 99, array.dtype) for array in expected] for _ in range(2)]
    answers = [build.pack_checked(batch, validation._SAMPLE_ROLES, tuple(out), bound, validation.LOG_PROB_TOLERANCE)
               for build, out in zip((plain_build(), native), outs)]
    assert answers[0] is answers[1]
    for plain, installed in zip(*outs):
        assert (plain is None and installed is None) or plain.tobytes() == installed.tobytes()


def turns_joined_with_numpy():
    """The compiled merge set aside: a delivery joins the turns' arrays with numpy, as `arrays()` reads them."""
    return compiled_set_aside(trajectory_module)


@st.composite
def merged_turns(draw):
    """A trajectory's turns: with supports or none, loss masks given or not,
    forced tokens after some, forced-only turns (first too, without
    supports), or a context array that grows with the turns."""
    supported, context = draw(st.booleans()), draw(st.booleans())
    turns, covered = [], 0
    count = draw(st.integers(1, 6))
    for index in range(6 - count, 6):
        forced = np.array(draw(st.lists(st.integers(0, 40), max_size=4)), np.int32)
        sampled = any(type(turn) is not tuple for turn in turns)  # supports are carried from the first token on
        if not context and (sampled or not supported) and index < 5 and draw(st.integers(0, 4)) == 0:
            turns.append(("forced", forced))  # not last: the last turn gives the trajectory its status
            continue
        n = draw(st.integers(1 if supported else 0, 9))
        supports = [draw(st.lists(st.integers(0, 40), min_size=1, max_size=12)) for _ in range(n)]
        tokens = np.array([draw(st.sampled_from(s)) for s in supports] if supported
                          else draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)), np.int32)
        loss = np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), np.uint8) if draw(st.booleans()) else None
        covered += n + len(forced)
        experts = np.full((covered, 2, 1), index, np.int32) if context else None
        turns.append(Turn.build(tokens, np.linspace(-2.0, -0.1, n).astype(np.float32), loss_mask=loss,
                                supports=supports if supported else None, forced_tokens=forced, routed_experts=experts))
    return turns


def _trajectory(turns) -> Trajectory:
    trajectory = Trajectory("t", np.arange(3, dtype=np.int32), group_id="g", group_size=1, sample_index=0)
    trajectory.reward = 1.0
    for turn in turns:
        if type(turn) is tuple:  # ("forced", tokens): a `Turn` is a named tuple
            trajectory.append_forced(turn[1])
        else:
            trajectory.append_turn(turn)
    return trajectory


@settings(max_examples=300, deadline=None)
@given(merged_turns(), st.booleans())
def test_a_delivery_merged_compiled_is_the_delivery_joined_with_numpy_byte_for_byte(turns, may_split):
    merged = _trajectory(turns)
    assert merged.merged_shapes() is not None
    compiled = encode_deliver(merged, "lease", may_pack=True, may_split=may_split)
    with turns_joined_with_numpy():
        joined = _trajectory(turns)
        assert joined.merged_shapes() is None
        expected = encode_deliver(joined, "lease", may_pack=True, may_split=may_split)
    assert [bytes(frame) for frame in compiled] == [bytes(frame) for frame in expected]
    assert merged.pending_turns == len(turns)  # merging wrote nothing into the trajectory's buffers
    delivered = trajectory_from_deliver(decode(compiled, BROKER_TO_CONSUMER))
    for name, array in joined.arrays().items():
        np.testing.assert_array_equal(delivered.arrays()[name], array)


def test_trajectories_merging_cannot_take_are_joined_with_numpy():
    turn = Turn.build(np.array([5], np.int32), np.array([-1.0], np.float32), supports=[[5, 6]])
    logged = turn._replace(mask_log_probs=np.array([-0.5, -1.0], np.float32))
    full = Turn.build(np.array([5], np.int32), np.array([-1.0], np.float32), full_log_probs=np.array([-1.5], np.float32))
    read = _trajectory([turn, turn])
    read.arrays()  # its turns are written into its buffers: nothing is pending
    again = _trajectory([turn, turn])
    again.arrays()
    again.append_turn(turn)
    again.append_turn(turn)  # written turns, then pending ones
    shed = _trajectory([turn, turn])
    shed.shed()
    cases = {"read": read, "written then pending": again, "shed": shed, "support log-probs": _trajectory([logged, logged]),
             "full log-probs": _trajectory([full, full]), "no turn": Trajectory("t")}
    assert {case: trajectory.merged_shapes() for case, trajectory in cases.items()} == dict.fromkeys(cases)
    assert _trajectory([turn, turn]).merged_shapes() == {"prompt_tokens": (3,), "tokens": (2,), "loss_mask": (2,),
                                                         "log_probs": (2,), "mask_ids": (4,), "mask_offsets": (3,)}
    assert _trajectory([turn]).merged_shapes() == {"prompt_tokens": (3,), "tokens": (1,), "loss_mask": (1,),
                                                   "log_probs": (1,), "mask_ids": (2,), "mask_offsets": (2,)}


def test_turns_merging_cannot_take_are_refused_naming_the_rule_with_nothing_written():
    fields, names = trajectory_module._MERGED_TURN_FIELDS, trajectory_module._MASK_ATTRIBUTES
    turn = Turn.build(np.array([5], np.int32), np.array([-1.0], np.float32), supports=[[5, 6]],
                      forced_tokens=np.array([9], np.int32))

    def outs(tokens=2, ids=3, supports=True):
        return (np.full(tokens, 7, np.int32), np.full(tokens, 7, np.float32), np.full(tokens, 7, np.uint8),
                np.full(ids, 7, np.int32) if supports else None, np.full(tokens + 1, 7, np.int64) if supports else None)

    cases = [
        ([turn], outs(3, 4), "exactly the size"),
        ([turn], outs(ids=2), "exactly the size"),
        ([turn._replace(log_probs=np.array([-1.0, -2.0], np.float32))], outs(), "align with its tokens"),
        ([turn._replace(mask=None)], outs(), "align with its tokens"),  # sampled tokens without the supports carried
        ([turn], outs(supports=False), "carry supports as their trajectory does"),
        ([turn._replace(tokens=turn.tokens.astype(np.int64))], outs(), "tokens is a 1-D array of 4-byte"),
        ([turn._replace(log_probs=None)], outs(), "has its log_probs"),
        ([turn, "a turn"], outs(4, 6), "is a tuple"),
        ([turn], (*outs()[:3], outs()[3], None), "merged together"),
    ]
    for turns, out, rule in cases:
        with pytest.raises(ValueError, match=rule):
            native.merge_turns(turns, fields, names, out)
        assert all(o is None or (o == 7).all() for o in out)  # nothing written
    for k in range(5):  # a field position past the turn's tuple, in each place
        past = tuple(len(Turn._fields) if i == k else position for i, position in enumerate(fields))
        out = outs()
        with pytest.raises(ValueError, match="holding every field merged"):
            native.merge_turns([turn], past, names, out)
        assert all(o is None or (o == 7).all() for o in out)
    out = outs()
    native.merge_turns([turn], fields, names, out)
    assert [o.tolist() for o in out] == [[5, 9], [-1.0, 0.0], [1, 0], [5, 6, 9], [0, 2, 3]]


def test_a_written_packed_body_is_sent_as_encode_packs_the_same_arrays():
    arrays = {"prompt_tokens": np.arange(3, dtype=np.int32), "tokens": np.array([4, 5], np.int32),
              "loss_mask": np.array([1, 0], np.uint8), "log_probs": np.array([-1.0, 0.0], np.float32),
              "mask_ids": np.array([4, 5, 6], np.int32), "mask_offsets": np.array([0, 2, 3], np.int64),
              "routed_experts": np.ones((5, 2, 1), np.int32)}
    packed = packed_body({name: array.shape for name, array in arrays.items()})
    for name, array in arrays.items():
        packed.arrays[name][...] = array
    fields = {"lease": "l", "trajectory_id": "t", "status": "completed", "reward": 1.0, "response_length": 2,
              "weight_versions": [], "metadata": {}}
    expected = encode(BROKER_TO_CONSUMER, "deliver", fields, arrays, crc=True, packed=True)
    assert [bytes(f) for f in encode(BROKER_TO_CONSUMER, "deliver", fields, packed, crc=True)] == \
        [bytes(f) for f in expected]
    with pytest.raises(LocalProtocolError, match="shape"):
        packed_body({"tokens": (2, 1)})
