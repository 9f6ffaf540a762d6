"""SamplingMask: every rule of docs/semantics.md §2 and worked examples 1-5."""
import numpy as np
import pytest
import torch

from rollstream.common import ProtocolError, SamplingMask

M = [[1, 3], [4], [5, 6, 7]]


def test_example_1_from_supports():
    mask = SamplingMask.from_supports([[5, 9], [2], [7, 8, 11]])
    assert mask.ids.tolist() == [5, 9, 2, 7, 8, 11]
    assert mask.offsets.tolist() == [0, 2, 3, 6]
    assert mask.ids.dtype == np.int32 and mask.offsets.dtype == np.int64
    assert len(mask) == 3


def test_example_2_empty_support_refused():
    with pytest.raises(ValueError, match="non-empty support"):
        SamplingMask.from_supports([[], [1]])


def test_example_3_end_offset_must_equal_id_count():
    with pytest.raises(ValueError, match=r"offsets\[-1\] == len\(ids\)"):
        SamplingMask([0, 1], [0, 1])


def test_example_4_prefix():
    mask = SamplingMask.from_supports(M)
    assert mask.prefix(2).ids.tolist() == [1, 3, 4]
    assert mask.prefix(2).offsets.tolist() == [0, 2, 3]
    assert len(mask.prefix(0)) == 0 and mask.prefix(0).offsets.tolist() == [0]
    for bad in (4, -1):
        with pytest.raises(ValueError, match="prefix length"):
            mask.prefix(bad)


def test_example_5_concatenate():
    mask = SamplingMask.concatenate(
        [SamplingMask.from_supports(M), SamplingMask.singletons([20, 21]), SamplingMask.from_supports([[30, 7, 8]])]
    )
    assert mask.offsets.tolist() == [0, 2, 3, 6, 7, 8, 11]
    assert mask.ids.tolist() == [1, 3, 4, 5, 6, 7, 20, 21, 30, 7, 8]


def test_empty_mask_is_valid_and_concatenate_of_nothing_is_empty():
    empty = SamplingMask([], [0])
    assert len(empty) == 0 and empty.ids.dtype == np.int32
    assert SamplingMask.concatenate([]) == empty


@pytest.mark.parametrize(
    "ids, offsets, rule",
    [
        ([1], [], "offsets non-empty"),
        ([1], [1, 1], r"offsets\[0\] == 0"),
        ([1, 2], [0, 1, 1, 2], "non-empty support"),
        ([1, 2], [0, 2, 1, 2], "non-empty support"),
    ],
)
def test_csr_invariants_name_their_rule(ids, offsets, rule):
    with pytest.raises(ValueError, match=rule):
        SamplingMask(ids, offsets)


@pytest.mark.parametrize(
    "ids, offsets",
    [
        (np.array([True]), [0, 1]),
        (np.array([1.0]), [0, 1]),
        (np.array([1 + 0j]), [0, 1]),
        ([1], np.array([0.0, 1.0])),
        ([1], np.array([False, True])),
    ],
)
def test_bool_float_complex_are_refused_not_cast(ids, offsets):
    with pytest.raises(ValueError, match="integers"):
        SamplingMask(ids, offsets)


def test_values_outside_int32_are_refused_not_wrapped():
    with pytest.raises(ValueError, match="int32"):
        SamplingMask(np.array([2**31], dtype=np.int64), [0, 1])
    with pytest.raises(ValueError, match="int32"):
        SamplingMask.from_supports([[2**40]])
    with pytest.raises(ValueError, match="int64"):
        SamplingMask([1], np.array([0, 2**63], dtype=np.uint64))


@pytest.mark.parametrize("supports, refused", [
    ([[1, 2.5]], "float64"),  # np.fromiter alone would truncate it to 2
    ([[4.0]], "float64"),
    ([[True], [False]], "bool"),
    ([[np.float32(3)]], "float32"),
    ([["7"]], "<U1"),
    (["12"], "<U1"),  # a string support iterates as characters
    ([[1j]], "complex128"),
])
def test_supports_refuse_non_integer_ids_instead_of_casting(supports, refused):
    with pytest.raises(ValueError, match=rf"supports must hold integers, got dtype {refused} "):
        SamplingMask.from_supports(supports)


@pytest.mark.parametrize("build, code, text", [
    (lambda: SamplingMask.from_supports([[1], []]), "mask_invalid",
     r"'non-empty support \(strictly increasing offsets\)' violated at token 1: supports\[1\] gives 0 ids, expected at least 1"),
    (lambda: SamplingMask.from_lengths([1, 2], [2, 0]), "mask_invalid", r"at token 1: lengths\[1\] gives 0 ids"),
    (lambda: SamplingMask.from_lengths([1, 2, 3], [1, 1]), "mask_invalid", "lengths sum to 2, ids has 3"),
    (lambda: SamplingMask([1, 2], [0, 2, 2]), "mask_invalid", "non-empty support"),
    (lambda: SamplingMask([0, 1], [0, 1]), "mask_invalid", r"offsets\[-1\] == len\(ids\)"),
    (lambda: SamplingMask.from_supports([[2.5]]), "dtype", "supports must hold integers, got dtype float64"),
    (lambda: SamplingMask(np.array([1.0]), [0, 1]), "dtype", "ids must hold integers, got dtype float64"),
    (lambda: SamplingMask.from_supports([[2**40]]), "dtype",
     r"'values fit int32' violated: supports holds 1099511627776, expected \[-2147483648, 2147483647\]"),
    (lambda: SamplingMask([1], np.array([[0, 1]])), "shape", r"offsets must be 1-D, got shape \(1, 2\)"),
    (lambda: SamplingMask.singletons([1.5]), "dtype", "tokens must hold integers"),
    (lambda: SamplingMask.from_supports([[1]]).contains([1, 2]), "misaligned", "tokens has 2 entries, the mask covers 1"),
    (lambda: SamplingMask([5, -9], [0, 2]), "out_of_vocab",
     r"'mask ids in \[0, vocab_size\)' violated at token 0: ids holds -9, expected >= 0"),
    (lambda: SamplingMask.from_supports([[1], [5, -9]]), "out_of_vocab", "at token 1: supports holds -9, expected >= 0"),
    (lambda: SamplingMask.from_lengths([1, 2, -2**31], [2, 1]), "out_of_vocab",
     "at token 1: ids holds -2147483648, expected >= 0"),
    (lambda: SamplingMask.singletons([3, -1]), "out_of_vocab", "at token 1: tokens holds -1, expected >= 0"),
    (lambda: SamplingMask(torch.tensor([4, -1]), torch.tensor([0, 1, 2])), "out_of_vocab", "at token 1: ids holds -1"),
], ids=["empty-support", "zero-length", "lengths-sum", "equal-offsets", "end-offset", "float-supports", "float-ids",
        "int32-overflow", "2-D-offsets", "float-singletons", "contains-misaligned", "negative-id", "negative-support",
        "negative-lengths-id", "negative-singleton", "negative-torch-id"])
def test_every_refusal_is_a_protocol_error_with_the_reply_code_and_the_callers_name(build, code, text):
    with pytest.raises(ProtocolError, match=text) as err:
        build()
    assert err.value.code == code


def test_ids_past_a_vocabulary_are_left_to_the_vocabulary_check():
    """A mask knows no vocabulary: only a negative id is outside every one."""
    assert SamplingMask.from_supports([[0, 2**31 - 1]]).ids.tolist() == [0, 2**31 - 1]


def test_supports_take_numpy_integer_ids():
    mask = SamplingMask.from_supports([[np.int64(3), 4], np.array([9, 2], dtype=np.uint16)])
    assert mask.ids.tolist() == [3, 4, 9, 2] and mask.offsets.tolist() == [0, 2, 4]


def test_arrays_must_be_one_dimensional():
    with pytest.raises(ValueError, match="1-D"):
        SamplingMask(np.array([[1]]), [0, 1])


def test_wider_integer_inputs_that_fit_are_accepted():
    mask = SamplingMask(np.array([7], dtype=np.int64), np.array([0, 1], dtype=np.uint8))
    assert mask.ids.dtype == np.int32 and mask.offsets.dtype == np.int64


def test_owns_its_memory_and_is_read_only():
    ids, offsets = np.array([1, 2, 3], dtype=np.int32), np.array([0, 1, 3], dtype=np.int64)
    mask = SamplingMask(ids, offsets)
    ids[0] = 99
    offsets[1] = 2
    assert mask.ids.tolist() == [1, 2, 3] and mask.offsets.tolist() == [0, 1, 3]
    with pytest.raises(ValueError):
        mask.ids[0] = 5
    with pytest.raises(ValueError):
        mask.offsets[0] = 5


def test_indexing():
    mask = SamplingMask.from_supports(M)
    assert mask[0].tolist() == [1, 3]
    assert mask[-1].tolist() == [5, 6, 7]
    assert mask[np.int64(1)].tolist() == [4]
    for bad in (3, -4):
        with pytest.raises(IndexError):
            mask[bad]


def test_from_lengths_matches_from_supports_and_checks_lengths():
    assert SamplingMask.from_lengths([1, 3, 4, 5, 6, 7], [2, 1, 3]) == SamplingMask.from_supports(M)
    with pytest.raises(ValueError, match="non-empty support"):
        SamplingMask.from_lengths([1, 2], [2, 0])
    with pytest.raises(ValueError, match=r"offsets\[-1\] == len\(ids\)"):
        SamplingMask.from_lengths([1, 2, 3], [1, 1])


def test_singletons():
    mask = SamplingMask.singletons([20, 21, 22])
    assert [mask[t].tolist() for t in range(3)] == [[20], [21], [22]]


def test_nbytes_counts_both_arrays():
    mask = SamplingMask.from_supports(M)
    assert mask.nbytes == 6 * 4 + 4 * 8


def test_contains_is_per_token_membership():
    mask = SamplingMask.from_supports(M)
    assert mask.contains([3, 4, 8]).tolist() == [True, True, False]
    with pytest.raises(ValueError, match="covers"):
        mask.contains([3, 4])


def test_to_torch_is_zero_copy_on_cpu():
    mask = SamplingMask.from_supports(M)
    ids, offsets = mask.to_torch()
    assert ids.dtype == torch.int32 and offsets.dtype == torch.int64
    assert ids.data_ptr() == mask.ids.ctypes.data
    assert offsets.tolist() == [0, 2, 3, 6]


def test_accepts_torch_tensors():
    mask = SamplingMask(torch.tensor([4, 5], dtype=torch.int64), torch.tensor([0, 1, 2]))
    assert mask.ids.tolist() == [4, 5]


def test_prefix_is_cheap_view_that_stays_valid():
    mask = SamplingMask.from_supports(M)
    head = mask.prefix(1)
    assert head.ids.tolist() == [1, 3]
    assert not head.ids.flags.writeable


def _outcome(convert, values):
    """The array `convert` gives for `values`, or the error it raises, in a comparable form."""
    try:
        arr = convert(values)
    except ProtocolError as err:
        return ("error", err.code, str(err))
    return ("array", arr.dtype, arr.tobytes())


_LISTS = [
    [5, 9, 3], [151_935, 0, 7], [0, 1], [1], [], [2**31 - 1, 5], [2**31, 5], [-(2**31) - 1, 9], [-3, 9], [2**70, 3],
    [True, True], [True, 5], [1, 2.5], [4.0, 3.0], [-0.5, -1.25], [-0.5, float("nan"), float("-inf")], [0.5, True],
    [np.int64(3), 4], [4, np.int64(3)], [np.float32(3), 4], [np.float64(0.5), 2], [2, np.float64(0.5)], [0.5, 10**400],
    ["7", 8], [8, "7"], [None, 1], [1, None], [1j, 2], [3, 1j], [[1], [2]], [300, 2], [300, -1], [1e300, -1.0],
]


@pytest.mark.parametrize("values", _LISTS, ids=[repr(v)[:40] for v in _LISTS])
def test_the_list_fast_path_converts_exactly_as_the_general_path(values):
    """A list goes through `list_as_array` first; a tuple of the same values
    takes the general path (`np.asarray`). Whatever the fast path takes must
    come out the same, refusals included."""
    from rollstream.common.mask import as_int_array
    from rollstream.common.trajectory import _as_float_array

    for dtype in (np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint8)):
        convert = lambda v: as_int_array(v, dtype, "values")  # noqa: E731
        assert _outcome(convert, values) == _outcome(convert, tuple(values)), dtype
    convert = lambda v: _as_float_array(v, "values")  # noqa: E731
    with np.errstate(over="ignore"):
        assert _outcome(convert, values) == _outcome(convert, tuple(values))


def test_the_list_fast_path_takes_the_usual_engine_lists():
    """Ids and log-probs as an engine returns them go the fast way (else the
    agreement test above checks nothing)."""
    from rollstream.common.mask import list_as_array

    assert list_as_array([5, 9, 3], np.dtype(np.int32)) is not None
    assert list_as_array([-0.5, -1.25, 0], np.dtype(np.float32)) is not None
