"""Trainer primitives: the dense vocab-shard mask, the masked,
temperature-scaled log-prob (docs/semantics.md §6) and the KL from the
sampler to the trainer over the support, against direct definitions; what
they allocate at a real vocabulary, and that they read nothing back."""
import itertools
import math
import threading
import weakref
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from rollstream.common.contract import LOG_PROB_TOLERANCE
from rollstream.common.errors import InvalidInput, InvalidType
from rollstream.common.mask import SamplingMask
from rollstream.consumer import dense_support_mask, masked_log_probs, support_kl

REAL_VOCAB = 151_936  # Qwen2's


def csr(supports):
    mask = SamplingMask.from_supports(supports)
    return torch.from_numpy(mask.ids.copy()), torch.from_numpy(mask.offsets.copy())


def on_ranks(tp_size: int, run):
    """`run(rank, group)` for every rank of a tensor-parallel group of
    `tp_size` in this process: one thread per rank over gloo, or the plain
    call (no group) for one rank. Returns the results in rank order."""
    if tp_size == 1:
        return [run(0, None)]
    store, results, failures = dist.HashStore(), [None] * tp_size, []

    def rank(k):
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = timedelta(seconds=60)
        try:
            results[k] = run(k, dist.ProcessGroupGloo(store, k, tp_size, options))
        except BaseException as exc:  # re-raised below, in the test's thread
            failures.append(exc)

    threads = [threading.Thread(target=rank, args=(k,)) for k in range(tp_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    return results


def dense_reference(logits, supports, positions, tokens, temperature):
    """The log-softmax over each row's support in float64, on a dense mask
    built one row at a time; differentiable in `logits`."""
    inside = torch.zeros(logits.shape, dtype=torch.bool)
    for row, position in enumerate(positions):
        inside[row, supports[position]] = True
    scaled = (logits.double() / temperature).masked_fill(~inside, float("-inf"))
    return torch.log_softmax(scaled, -1)[torch.arange(len(tokens)), tokens]


def dense_kl_reference(logits, supports, positions, sampler, temperature):
    """KL(sampler || trainer) per row in float64, from dense `[rows, vocab]`
    distributions built one row at a time: the sampler's log-probs
    (`sampler[p]`, support p's in its ids' order) and the trainer's scaled
    logits, each -inf off the row's support, then log-softmaxed over the
    vocabulary. Differentiable in `logits`."""
    inside = torch.zeros(logits.shape, dtype=torch.bool)
    given = torch.full(logits.shape, float("-inf"), dtype=torch.float64)
    for row, position in enumerate(positions):
        inside[row, supports[position]] = True
        given[row, supports[position]] = torch.as_tensor(sampler[position], dtype=torch.float64)
    log_sampler = torch.log_softmax(given, -1)
    log_trainer = torch.log_softmax((logits.double() / temperature).masked_fill(~inside, float("-inf")), -1)
    return (log_sampler.exp() * torch.where(inside, log_sampler - log_trainer, 0.0)).sum(-1)


def per_support(values, offsets):
    """A flat array of one value per mask id, as one list per support."""
    return [values[start:end].tolist() for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


class Allocations(TorchDispatchMode):
    """Every storage the ops run under it allocate (an output sharing an
    input's storage allocates nothing), with its bytes at birth and, through
    a weakref finalizer, at death. Thread-local, like every dispatch mode."""

    def __init__(self):
        super().__init__()
        self.events = []  # (storage number, +bytes at birth or -bytes at death), in order
        self.numbers = {}  # id of each live storage -> its number
        self.counter = itertools.count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if id(storage) not in inputs and id(storage) not in self.numbers:
                number = next(self.counter)
                self.numbers[id(storage)] = number
                self.events.append((number, storage.nbytes()))
                weakref.finalize(storage, self._died, id(storage), number, storage.nbytes())
        return out

    def _died(self, key, number, nbytes):
        del self.numbers[key]
        self.events.append((number, -nbytes))

    def peak_bytes(self, leaving_out: torch.Tensor) -> int:
        """The most bytes live at once in the storages allocated here, but
        for the (still live) storage of `leaving_out`."""
        skip = self.numbers[id(leaving_out.untyped_storage())]
        live = peak = 0
        for number, change in self.events:
            if number != skip:
                live += change
                peak = max(peak, live)
        return peak


def test_worked_example():
    ids, offsets = csr([[0, 2]])
    got = masked_log_probs(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), [0], ids, offsets, [0], temperature=1.0)
    assert float(got) == pytest.approx(2 - math.log(math.e**2 + 1), abs=1e-6)
    assert float(got) == pytest.approx(-0.1269, abs=1e-4)


@st.composite
def problems(draw):
    vocab = draw(st.integers(2, 12))
    n_tokens = draw(st.integers(1, 6))
    supports = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=vocab, unique=True)) for _ in range(n_tokens)]
    positions = draw(st.lists(st.integers(0, n_tokens - 1), min_size=0, max_size=6))
    return vocab, supports, positions


@settings(max_examples=60, deadline=None)
@given(problems(), st.sampled_from([1, 2, 4]))
def test_dense_mask_of_every_vocab_shard(problem, tp_size):
    vocab, supports, positions = problem
    local = -(-vocab // tp_size)
    ids, offsets = csr(supports)
    shards = [dense_support_mask(torch.zeros(len(positions), local), ids, offsets, positions, tp_rank=r) for r in range(tp_size)]
    for rank, dense in enumerate(shards):
        for row, position in enumerate(positions):
            expected = {i - rank * local for i in supports[position] if rank * local <= i < (rank + 1) * local}
            assert set(torch.nonzero(dense[row]).flatten().tolist()) == expected


@settings(max_examples=60, deadline=None)
@given(problems(), st.floats(0.25, 4.0), st.integers(0, 2**31 - 1))
def test_masked_log_prob_matches_its_definition_with_gradient(problem, temperature, seed):
    vocab, supports, positions = problem
    if not positions:
        return
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(positions), vocab, generator=gen, dtype=torch.float64).requires_grad_()
    picks = torch.randint(0, 10**6, (len(positions),), generator=gen).tolist()
    tokens = [supports[p][k % len(supports[p])] for p, k in zip(positions, picks)]
    ids, offsets = csr(supports)
    got = masked_log_probs(logits, tokens, ids, offsets, positions, temperature=temperature)
    reference = torch.stack([
        logits[r, tokens[r]] / temperature - torch.logsumexp(logits[r, supports[p]] / temperature, 0)
        for r, p in enumerate(positions)
    ])
    assert torch.allclose(got.double(), reference, atol=1e-5)
    (grad,) = torch.autograd.grad(got.sum(), logits)
    (expected_grad,) = torch.autograd.grad(reference.sum(), logits)
    assert torch.allclose(grad.double(), expected_grad, atol=1e-5)


def test_dense_mask_and_log_prob_agree():
    """The masked log-softmax through the dense mask gives the same values."""
    rng = np.random.default_rng(2)
    supports = [rng.choice(50, size=int(rng.integers(1, 10)), replace=False).tolist() for _ in range(8)]
    ids, offsets = csr(supports)
    logits = torch.randn(8, 50)
    tokens = [s[0] for s in supports]
    dense = dense_support_mask(logits, ids, offsets, torch.arange(8))
    via_dense = torch.log_softmax(logits.masked_fill(~dense, float("-inf")), -1)[torch.arange(8), tokens]
    assert torch.allclose(masked_log_probs(logits, tokens, ids, offsets), via_dense, atol=1e-5)


def test_rows_and_positions_are_checked():
    ids, offsets = csr([[1], [2, 3]])
    with pytest.raises(ValueError, match="align"):
        dense_support_mask(torch.zeros(3, 4), ids, offsets, [0, 1])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        dense_support_mask(torch.zeros(1, 4), ids, offsets, [2])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        masked_log_probs(torch.zeros(1, 4), [1], ids, offsets, [-1])


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_values_and_gradients_match_a_dense_float64_reference(dtype, temperature, tp_size):
    """Every rank's values, and its slice of the gradient, against the dense
    log-softmax over the support in float64 of the same (rounded) logits.
    Row 0's token holds nearly all its support's mass, so its gradient
    `(1 - p_y) / T` is small: bf16 must keep it to bf16's precision."""
    rng = np.random.default_rng(5)
    vocab = 48
    supports = [rng.choice(vocab, size=n, replace=False).tolist() for n in (1, 5, 12, 8, 2, 1, 9, 3, 6, 4)]
    positions = [3, 0, 9, 9, 5, 1, 7, 2, 8, 4, 6, 0]  # every token, two of them twice
    tokens = [supports[p][int(rng.integers(len(supports[p])))] for p in positions]
    ids, offsets = csr(supports)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(len(positions), vocab, generator=gen, dtype=torch.float64)
    logits[0, tokens[0]] += 8
    logits = logits.to(dtype)
    weights = torch.rand(len(positions), generator=gen, dtype=torch.float64)
    exact = logits.to(torch.float64, copy=True).requires_grad_()
    expected = dense_reference(exact, supports, positions, tokens, temperature)
    (expected * weights).sum().backward()
    local = vocab // tp_size

    def rank(k, group):
        mine = logits[:, k * local : (k + 1) * local].clone().requires_grad_()
        values = masked_log_probs(mine, tokens, ids, offsets, positions, temperature=temperature, tp_rank=k, tp_group=group)
        (values * weights.to(values.dtype)).sum().backward()
        return values.detach(), mine.grad

    results = on_ranks(tp_size, rank)
    grad = torch.cat([rank_grad for _, rank_grad in results], 1)
    assert grad.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    for values, _ in results:
        torch.testing.assert_close(values.double(), expected.detach(), atol=tolerance, rtol=0)
    if dtype == torch.bfloat16:  # within two bf16 steps of the exact gradient rounded to bf16
        torch.testing.assert_close(grad.double(), exact.grad.to(dtype).double(), atol=1e-9, rtol=2**-6)
    else:
        torch.testing.assert_close(grad.double(), exact.grad, atol=tolerance / 10, rtol=0)


@pytest.mark.parametrize("primitive", ["masked_log_probs", "support_kl"])
@pytest.mark.parametrize("tp_size", [1, 8])
def test_allocates_little_beyond_the_logits_and_their_gradient(tp_size, primitive):
    """At a real vocabulary with bf16 logits, what the log-prob (and the
    support KL) allocates, forward and backward, but for the logits' own
    gradient, peaks under half the bytes of (each rank's slice of) the
    logits; a float32 copy of them alone would be twice. The rows are few,
    so that it runs on a CPU."""
    rows, temperature = 64, 0.7
    rng = np.random.default_rng(11)
    supports = [rng.choice(REAL_VOCAB, size=int(rng.integers(20, 51)), replace=False).tolist() for _ in range(rows)]
    tokens = [support[int(rng.integers(len(support)))] for support in supports]
    ids, offsets = csr(supports)
    logits = torch.randn(rows, REAL_VOCAB, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    sampler = -torch.rand(len(ids), generator=torch.Generator().manual_seed(11)) * 5
    local = REAL_VOCAB // tp_size

    def rank(k, group):
        mine = logits[:, k * local : (k + 1) * local].clone().requires_grad_()
        with Allocations() as allocations:
            if primitive == "support_kl":
                values = support_kl(mine, ids, offsets, sampler, temperature=temperature, tp_rank=k, tp_group=group)
            else:
                values = masked_log_probs(mine, tokens, ids, offsets, temperature=temperature, tp_rank=k, tp_group=group)
            values.sum().backward()
        return values.detach(), allocations.peak_bytes(leaving_out=mine.grad) / (mine.numel() * mine.element_size())

    results = on_ranks(tp_size, rank)
    fractions = [fraction for _, fraction in results]
    assert max(fractions) < 0.5, f"peak allocations as a fraction of each rank's logits: {fractions}"
    if primitive == "support_kl":
        expected = dense_kl_reference(logits, supports, range(rows), per_support(sampler, offsets), temperature)
    else:
        expected = torch.stack([
            logits[r, token].double() / temperature - torch.logsumexp(logits[r, support].double() / temperature, 0)
            for r, (token, support) in enumerate(zip(tokens, supports))
        ])
    for values, _ in results:
        torch.testing.assert_close(values.double(), expected, atol=1e-4, rtol=0)


def test_nothing_is_read_back_when_the_rows_are_the_masks_tokens():
    """`positions` omitted with one row per mask token (a batch's response
    axis): the primitives run, forward and backward, on the meta device,
    which holds no values, so nothing waits on a value read back from the
    GPU. With `positions` on the device, the entry count is read back once."""
    rng = np.random.default_rng(3)
    supports = [rng.choice(40, size=int(rng.integers(1, 10)), replace=False).tolist() for _ in range(12)]
    ids, offsets = (t.to("meta") for t in csr(supports))
    tokens = torch.tensor([s[-1] for s in supports], device="meta")
    logits = torch.empty(12, 40, device="meta", requires_grad=True)
    masked_log_probs(logits, tokens, ids, offsets, temperature=0.8).sum().backward()
    assert logits.grad.shape == logits.shape and logits.grad.dtype == logits.dtype
    assert dense_support_mask(logits, ids, offsets, None).shape == logits.shape
    logits.grad = None
    support_kl(logits, ids, offsets, torch.empty(len(ids), device="meta"), temperature=0.8).sum().backward()
    assert logits.grad.shape == logits.shape and logits.grad.dtype == logits.dtype
    with pytest.raises(NotImplementedError, match="meta"):
        masked_log_probs(logits, tokens, ids, offsets, torch.arange(12, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: the primitives on CUDA")
def test_primitives_on_the_gpu_match_the_cpu():
    rng = np.random.default_rng(8)
    supports = [rng.choice(64, size=int(rng.integers(1, 12)), replace=False).tolist() for _ in range(32)]
    ids, offsets = csr(supports)
    logits = torch.randn(32, 64)
    tokens = [s[-1] for s in supports]
    on_cpu = masked_log_probs(logits, tokens, ids, offsets, temperature=0.8)
    on_gpu = masked_log_probs(logits.cuda(), tokens, ids.cuda(), offsets.cuda(), temperature=0.8)
    assert torch.allclose(on_gpu.cpu(), on_cpu, atol=1e-5)
    sampler = -torch.rand(len(ids), generator=torch.Generator().manual_seed(8)) * 4
    on_cpu = support_kl(logits, ids, offsets, sampler, temperature=0.8)
    on_gpu = support_kl(logits.cuda(), ids.cuda(), offsets.cuda(), sampler.cuda(), temperature=0.8)
    assert torch.allclose(on_gpu.cpu(), on_cpu, atol=1e-5)
    dense = dense_support_mask(logits.cuda()[:, 32:], ids.cuda(), offsets.cuda(), torch.arange(32).cuda(), tp_rank=1)
    assert torch.equal(dense.cpu(), dense_support_mask(logits[:, 32:], ids, offsets, torch.arange(32), tp_rank=1))
    # With every input on the GPU and one row per mask token, nothing synchronizes with the host.
    on_gpu = logits.cuda().requires_grad_()
    tokens, ids, offsets, sampler = torch.tensor(tokens).cuda(), ids.cuda(), offsets.cuda(), sampler.cuda()
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        masked_log_probs(on_gpu, tokens, ids, offsets, temperature=0.8).sum().backward()
        dense_support_mask(on_gpu, ids, offsets, None)
        support_kl(on_gpu, ids, offsets, sampler, temperature=0.8).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def three_tokens():
    """Logits, tokens and the mask of three rows over a vocabulary of 4: supports {0, 2}, {1, 3}, {2}."""
    ids, offsets = csr([[0, 2], [1, 3], [2]])
    logits = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    return logits, torch.tensor([2, 3, 2]), ids, offsets


def log_prob_call(arguments):
    return masked_log_probs(**arguments)


def dense_call(arguments):
    return dense_support_mask(**{"positions": None} | {k: v for k, v in arguments.items() if k != "tokens"})


BAD_ARGUMENTS = [  # (the change to a valid call, the error, what its message must say)
    (lambda t: dict(logits=t["logits"][0]), InvalidInput, r"logits must be 2-D .* got shape \(4,\)"),
    (lambda t: dict(logits=t["logits"].long()), InvalidType, "logits must be a floating-point tensor .* got torch.int64"),
    (lambda t: dict(logits=t["logits"].tolist()), InvalidType, "logits must be a floating-point tensor .* got list"),
    (lambda t: dict(mask_ids=t["mask_ids"].float()), InvalidType, "mask_ids must be an integer tensor .* got torch.float32"),
    (lambda t: dict(mask_ids=t["mask_ids"].bool()), InvalidType, "mask_ids must be an integer tensor .* got torch.bool"),
    (lambda t: dict(mask_ids=t["mask_ids"].reshape(1, -1)), InvalidInput, r"mask_ids must be 1-D .* got shape \(1, 5\)"),
    (lambda t: dict(mask_offsets=t["mask_offsets"].double()), InvalidType,
     r"mask_offsets must be an integer tensor \(offsets index mask_ids\), got torch.float64"),
    (lambda t: dict(mask_offsets=t["mask_offsets"].reshape(1, -1)), InvalidInput, "mask_offsets must be 1-D"),
    (lambda t: dict(mask_offsets=t["mask_offsets"][:0]), InvalidInput,
     r"mask_offsets: rule 'offsets non-empty \(N \+ 1 entries\)' violated: expected at least 1 entry, got 0"),
    (lambda t: dict(mask_offsets=t["mask_offsets"][:3]), InvalidInput,
     "mask_offsets must have one entry more than logits has rows when positions is omitted .* expected 4, got 3"),
    (lambda t: dict(positions=[0.0, 1.0, 2.0]), InvalidType, "positions must be an integer tensor .* got torch.float32"),
    (lambda t: dict(positions=[0, 1]), InvalidInput, "positions must align with the rows of logits .* expected 3, got 2"),
    (lambda t: dict(tp_rank=-1), InvalidInput, "tp_rank must be 0 or more, got -1"),
    (lambda t: dict(tp_rank=1.0), InvalidType, "tp_rank must be an int .* got float"),
]
LOG_PROB_ONLY = [
    (lambda t: dict(tokens=t["tokens"].float()), InvalidType, "tokens must be an integer tensor .* got torch.float32"),
    (lambda t: dict(tokens=[2.0, 3.0, 2.0]), InvalidType, "tokens must be an integer tensor .* got torch.float32"),
    (lambda t: dict(tokens=t["tokens"][:2]), InvalidInput, "tokens must align with the rows of logits .* expected 3, got 2"),
    (lambda t: dict(temperature=0.0), InvalidInput, "temperature must be positive and finite .* got 0.0"),
    (lambda t: dict(temperature=-1), InvalidInput, "temperature must be positive and finite .* got -1"),
    (lambda t: dict(temperature=math.inf), InvalidInput, "temperature must be positive and finite .* got inf"),
    (lambda t: dict(temperature=math.nan), InvalidInput, "temperature must be positive and finite .* got nan"),
    (lambda t: dict(temperature=torch.tensor(1.0)), InvalidType, "temperature must be a number .* got torch.float32"),
]

def kl_call(arguments):
    return support_kl(**{"mask_log_probs": -torch.rand(len(arguments["mask_ids"].reshape(-1)))}
                      | {k: v for k, v in arguments.items() if k != "tokens"})


KL_ONLY = [
    (lambda t: dict(mask_log_probs=[-1, -2, -1, -3, 0]), InvalidType,
     r"mask_log_probs must be a floating-point tensor \(the sampler's log-prob of each support id\), got torch.int64"),
    (lambda t: dict(mask_log_probs="x"), InvalidType, "mask_log_probs must be a floating-point tensor .* got str"),
    (lambda t: dict(mask_log_probs=torch.zeros(1, 5)), InvalidInput, r"mask_log_probs must be 1-D .* got shape \(1, 5\)"),
    (lambda t: dict(mask_log_probs=torch.zeros(4)), InvalidInput,
     r"mask_log_probs: rule 'per-support-id fields aligned with mask_ids \(one entry per support id\)' violated: "
     r"expected 5 \(len\(mask_ids\)\), got 4"),
    (lambda t: dict(mask_log_probs=[]), InvalidInput, r"mask_log_probs: rule 'per-support-id .* expected 5 .* got 0"),
]


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize(("call", "change", "error", "message"), [
    *[(log_prob_call, *case) for case in BAD_ARGUMENTS + LOG_PROB_ONLY],
    *[(dense_call, *case) for case in BAD_ARGUMENTS],
    *[(kl_call, *case) for case in BAD_ARGUMENTS + [c for c in LOG_PROB_ONLY if "temperature" in c[2]] + KL_ONLY],
])
def test_bad_arguments_are_refused_naming_the_argument(call, change, error, message, check):
    """Types, ranks and lengths are checked on every call, `check` or not."""
    logits, tokens, ids, offsets = three_tokens()
    valid = dict(logits=logits, tokens=tokens, mask_ids=ids, mask_offsets=offsets, check=check)
    call(valid)
    with pytest.raises(error, match=message):
        call(valid | change(valid))


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the check on the device"))
HUGE = 2**62
INCREASING = r"mask_offsets: rule 'non-empty support \(strictly increasing offsets\)' violated"
BROKEN_CONTENT = [  # (the change to a valid call, the argument and rule the refusal names, then what it must say)
    (dict(tokens=[2, 0, 2]), r"tokens: rule 'sampled token inside its support' violated",
     r"token 0 is not in its support \[1, 3\]"),
    (dict(ids=[0, 2, 4, 3, 2]), r"mask_ids: rule 'mask ids in \[0, vocab_size\)' violated at mask token 1",
     r"its support holds id 4, outside \[0, 4\); vocab_size is logits.shape\[1\] = 4"),
    (dict(ids=[0, 2, -1, 3, 2]), r"mask_ids: rule 'mask ids in \[0, vocab_size\)' violated at mask token 1",
     r"its support holds id -1, outside \[0, 4\)"),
    (dict(offsets=[1, 2, 4, 5]), r"mask_offsets: rule 'offsets\[0\] == 0' violated", "expected 0, got 1"),
    (dict(offsets=[0, 3, 2, 5]), INCREASING + " at mask token 1", r"offsets\[1\] = 3, offsets\[2\] = 2"),
    (dict(offsets=[0, 2, 2, 5]), INCREASING + " at mask token 1", r"offsets\[1\] = 2, offsets\[2\] = 2"),
    (dict(offsets=[0, 2, 4, 7]), r"mask_offsets: rule 'offsets\[-1\] == len\(ids\)' violated", "expected 5, got 7"),
    (dict(offsets=[0, HUGE, 4, 5]), INCREASING, rf"offsets\[1\] = {HUGE}, offsets\[2\] = 4"),
    (dict(offsets=[0, -HUGE, 4, 5]), INCREASING, rf"offsets\[0\] = 0, offsets\[1\] = -{HUGE}"),
    (dict(offsets=[0, 2, 4, HUGE]), r"mask_offsets: rule 'offsets\[-1\] == len\(ids\)' violated", f"expected 5, got {HUGE}"),
]


@pytest.mark.parametrize("positions", [None, [0, 1, 2]], ids=["rows-are-tokens", "positions"])
@pytest.mark.parametrize("change", [change for change, _, _ in BROKEN_CONTENT])
def test_unchecked_content_is_the_callers_promise(change, positions):
    """Without `check`, broken content gives meaningless numbers (what
    `check=True` is for; a batch from the consumer was validated), but no
    index past an array, however far the offsets point."""
    logits, tokens, ids, offsets = three_tokens()
    changed = {name: torch.tensor(value) for name, value in change.items()}
    tokens, ids, offsets = changed.get("tokens", tokens), changed.get("ids", ids), changed.get("offsets", offsets)
    assert masked_log_probs(logits, tokens, ids, offsets, positions).shape == (3,)
    assert dense_support_mask(logits, ids, offsets, positions).shape == (3, 4)
    assert support_kl(logits, ids, offsets, -torch.rand(len(ids)), positions).shape == (3,)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("positions", [None, [0, 1, 2]], ids=["rows-are-tokens", "positions"])
@pytest.mark.parametrize(("change", "rule", "detail"), BROKEN_CONTENT)
def test_check_refuses_broken_content_naming_the_rule(change, rule, detail, positions, device):
    """With `check=True` each broken rule is refused, naming the argument,
    the rule, the expected and the actual value; the mask's rules by the
    dense mask as well."""
    logits, tokens, ids, offsets = (t.to(device) for t in three_tokens())
    changed = {name: torch.tensor(value, device=device) for name, value in change.items()}
    tokens, ids, offsets = changed.get("tokens", tokens), changed.get("ids", ids), changed.get("offsets", offsets)
    if positions is not None:
        positions = torch.tensor(positions, device=device)
    with pytest.raises(InvalidInput, match=f"{rule}.*{detail}"):
        masked_log_probs(logits, tokens, ids, offsets, positions, check=True)
    if "tokens" not in change:
        with pytest.raises(InvalidInput, match=f"{rule}.*{detail}"):
            dense_support_mask(logits, ids, offsets, positions, check=True)
        with pytest.raises(InvalidInput, match=f"{rule}.*{detail}"):  # before the log-probs, NaN or not
            support_kl(logits, ids, offsets, torch.full((len(ids),), math.nan, device=device), positions, check=True)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@settings(max_examples=40, deadline=None)
@given(problem=problems(), temperature=st.floats(0.25, 4.0), seed=st.integers(0, 2**31 - 1))
def test_check_passes_valid_content_and_changes_no_value(problem, temperature, seed, device):
    vocab, supports, positions = problem
    gen = torch.Generator().manual_seed(seed)
    ids, offsets = (t.to(device) for t in csr(supports))
    for rows in (positions, None):  # picked by positions, and one row per mask token
        picked = list(range(len(supports))) if rows is None else rows
        logits = torch.randn(len(picked), vocab, generator=gen).to(device)
        picks = torch.randint(0, 10**6, (len(picked),), generator=gen).tolist()
        tokens = torch.tensor([supports[p][k % len(supports[p])] for p, k in zip(picked, picks)], dtype=torch.int64,
                              device=device)
        at = None if rows is None else torch.tensor(rows, dtype=torch.int64, device=device)
        checked = masked_log_probs(logits, tokens, ids, offsets, at, temperature=temperature, check=True)
        assert torch.equal(checked, masked_log_probs(logits, tokens, ids, offsets, at, temperature=temperature))
        assert torch.equal(dense_support_mask(logits, ids, offsets, at, check=True), dense_support_mask(logits, ids, offsets, at))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_check_bounds_ids_by_the_whole_vocabulary(tp_size):
    """The vocabulary `check=True` bounds ids by: each of a group's ranks
    holds a slice of it, so an id of another rank's slice is valid and one
    past the last slice is not; without a group, the logits are the whole
    vocabulary at rank 0, and a slice of one it cannot know at a later rank."""
    local = 4
    ids, offsets = csr([[0, 2], [1, 3 + local * (tp_size - 1)]])
    tokens = torch.tensor([2, 1])

    def rank(k, group):
        logits = torch.randn(2, local)
        good = masked_log_probs(logits, tokens, ids, offsets, tp_rank=k, tp_group=group, check=True)
        past = ids.clone()
        past[-1] = local * tp_size
        with pytest.raises(InvalidInput, match=rf"its support holds id {local * tp_size}, outside \[0, {local * tp_size}\)"):
            masked_log_probs(logits, tokens, past, offsets, tp_rank=k, tp_group=group, check=True)
        if group is not None:
            with pytest.raises(InvalidInput, match=rf"tp_rank must be in \[0, {tp_size}\) \(the ranks of tp_group\), got 2"):
                masked_log_probs(logits, tokens, ids, offsets, tp_rank=tp_size, tp_group=group)
        return good

    assert all(torch.isfinite(values).all() for values in on_ranks(tp_size, rank))
    far = torch.tensor([0, 2, 1, 10**6], dtype=torch.int32)  # a later slice alone: ids bounded by int32's range
    assert masked_log_probs(torch.randn(2, local), [2, 10**6], far, offsets, tp_rank=3, check=True).shape == (2,)
    with pytest.raises(InvalidInput, match=r"its support holds id -1, outside \[0, 2147483647\).*int32's range"):
        masked_log_probs(torch.randn(2, local), [2, 1], torch.tensor([0, 2, -1, 1]), offsets, tp_rank=3, check=True)


def test_a_slice_computed_alone_checks_ids_against_the_vocabulary_it_is_given():
    """Slice 0 computed without its group (as a bench shards by hand) would
    take its own columns for the whole vocabulary; `vocab_size` says what
    the whole is, so another slice's id is valid and one past the whole is
    not, and a size that cannot hold this slice is refused."""
    local, whole = 4, 12
    ids, offsets = csr([[0, 2], [1, 9]])  # 9 lies in the third slice
    logits, tokens = torch.randn(2, local), torch.tensor([2, 1])
    with pytest.raises(InvalidInput, match=r"holds id 9, outside \[0, 4\)"):
        masked_log_probs(logits, tokens, ids, offsets, check=True)
    assert masked_log_probs(logits, tokens, ids, offsets, check=True, vocab_size=whole).shape == (2,)
    assert dense_support_mask(logits, ids, offsets, None, check=True, vocab_size=whole).sum() == 3  # 9 not in slice 0
    past = torch.tensor([0, 2, 1, whole], dtype=torch.int32)
    with pytest.raises(InvalidInput, match=rf"holds id {whole}, outside \[0, {whole}\); vocab_size is vocab_size = {whole}"):
        masked_log_probs(logits, tokens, past, offsets, check=True, vocab_size=whole)
    with pytest.raises(InvalidInput, match=r"vocab_size must be in \[8, 2147483647\].*got 5"):
        masked_log_probs(logits, tokens, ids, offsets, tp_rank=1, check=True, vocab_size=5)
    with pytest.raises(InvalidType, match=r"vocab_size must be an int"):
        masked_log_probs(logits, tokens, ids, offsets, check=True, vocab_size=12.0)


def test_support_kl_worked_example():
    """Logits [2, 1, 0, -1], support {0, 2}, a sampler even over it: the
    trainer's restricted distribution is softmax([2, 0]), and the KL from
    the even one is `ln(e^2 + 1) - 1 - ln 2`."""
    ids, offsets = csr([[0, 2]])
    got = support_kl(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), ids, offsets, [math.log(0.5)] * 2)
    assert float(got) == pytest.approx(math.log(math.e**2 + 1) - 1 - math.log(2), abs=1e-6)
    assert float(got) == pytest.approx(0.4338, abs=1e-4)


@settings(max_examples=60, deadline=None)
@given(problems(), st.floats(0.25, 4.0), st.integers(0, 2**31 - 1))
def test_support_kl_matches_its_dense_definition_with_gradient(problem, temperature, seed):
    """Values and gradients against the dense float64 KL, for rows picked by
    `positions` (in any order, some twice) and for one row per mask token."""
    vocab, supports, positions = problem
    gen = torch.Generator().manual_seed(seed)
    ids, offsets = csr(supports)
    sampler = torch.randn(len(ids), generator=gen, dtype=torch.float64) * 2 - 3  # summing to anything over a support
    for rows in (positions, None):
        picked = list(range(len(supports))) if rows is None else rows
        logits = torch.randn(len(picked), vocab, generator=gen, dtype=torch.float64).requires_grad_()
        got = support_kl(logits, ids, offsets, sampler, rows, temperature=temperature)
        reference = dense_kl_reference(logits, supports, picked, per_support(sampler, offsets), temperature)
        torch.testing.assert_close(got, reference, atol=1e-12, rtol=1e-12)
        assert (got >= -1e-12).all()
        if picked:
            weights = torch.rand(len(picked), generator=gen, dtype=torch.float64)
            (grad,) = torch.autograd.grad((got * weights).sum(), logits)
            (expected_grad,) = torch.autograd.grad((reference * weights).sum(), logits)
            torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_support_kl_sharded_matches_unsharded_and_the_dense_reference(dtype, temperature, tp_size):
    """Each rank of a tensor-parallel group, holding its vocab slice, gets
    the same KL as the whole vocabulary computed at once, to the dtype's
    rounding, and the slices' gradients put together are the whole's; both
    against the dense float64 KL of the same (rounded) logits. Row 0's
    trainer puts nearly all its mass on one id the sampler gives little."""
    rng = np.random.default_rng(6)
    vocab = 48
    supports = [rng.choice(vocab, size=n, replace=False).tolist() for n in (1, 5, 12, 8, 2, 1, 9, 3, 6, 4)]
    positions = [3, 0, 9, 9, 5, 1, 7, 2, 8, 4, 6, 0]  # every token, two of them twice
    ids, offsets = csr(supports)
    gen = torch.Generator().manual_seed(6)
    sampler = torch.randn(len(ids), generator=gen) - 2
    logits = torch.randn(len(positions), vocab, generator=gen, dtype=torch.float64) * 2
    logits[0, supports[3][0]] += 10
    logits = logits.to(dtype)
    weights = torch.rand(len(positions), generator=gen, dtype=torch.float64)
    exact = logits.to(torch.float64, copy=True).requires_grad_()
    expected = dense_kl_reference(exact, supports, positions, per_support(sampler, offsets), temperature)
    (expected * weights).sum().backward()

    def run(tp):
        local = vocab // tp

        def rank(k, group):
            mine = logits[:, k * local : (k + 1) * local].clone().requires_grad_()
            values = support_kl(mine, ids, offsets, sampler, positions, temperature=temperature, tp_rank=k, tp_group=group)
            (values * weights.to(values.dtype)).sum().backward()
            return values.detach(), mine.grad

        results = on_ranks(tp, rank)
        return [values for values, _ in results], torch.cat([grad for _, grad in results], 1)

    (whole,), whole_grad = run(1)
    sharded, grad = run(tp_size)
    assert grad.dtype == dtype
    for values in sharded:
        torch.testing.assert_close(values, whole, atol=1e-12 if dtype == torch.float64 else 1e-6, rtol=0)
    torch.testing.assert_close(grad, whole_grad, atol=1e-12 if dtype == torch.float64 else None,
                               rtol=0 if dtype == torch.float64 else None)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(whole.double(), expected.detach(), atol=tolerance, rtol=0)
    if dtype == torch.bfloat16:  # within two bf16 steps of the exact gradient rounded to bf16
        torch.testing.assert_close(grad.double(), exact.grad.to(dtype).double(), atol=1e-9, rtol=2**-6)
    else:
        torch.testing.assert_close(grad.double(), exact.grad, atol=tolerance / 10, rtol=0)


@pytest.mark.parametrize("positions", [None, [2, 0, 2]], ids=["rows-are-tokens", "positions"])
def test_support_kl_gradient_passes_gradcheck(positions):
    ids, offsets = csr([[0, 2, 3], [1, 4], [4, 0, 1, 2]])
    sampler = torch.tensor([-0.3, -1.9, -2.5, -0.1, -4.0, -1.0, -1.2, -0.7, -3.3], dtype=torch.float64)
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: support_kl(z, ids, offsets, sampler, positions, temperature=0.7), (logits,))


def test_support_kl_does_not_need_renormalised_sampler_log_probs():
    """Log-probs short of summing to 1 over a support (a sampler that
    reports them before renormalising) give the KL of the renormalised ones."""
    rng = np.random.default_rng(9)
    supports = [rng.choice(30, size=int(rng.integers(1, 9)), replace=False).tolist() for _ in range(10)]
    ids, offsets = csr(supports)
    raw = torch.randn(len(ids), generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    owner = torch.repeat_interleave(torch.arange(len(supports)), offsets.diff())
    renormalised = raw - torch.stack([torch.logsumexp(raw[owner == row], 0) for row in range(len(supports))])[owner]
    mass = torch.from_numpy(rng.uniform(0.05, 1.0, len(supports)))  # what each support kept of the whole vocabulary
    short = renormalised + torch.log(mass)[owner]
    logits = torch.randn(len(supports), 30, dtype=torch.float64, requires_grad=True)
    expected = support_kl(logits, ids, offsets, renormalised, temperature=0.8, check=True)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)
    for given_log_probs, check in ((short, True), (raw, False)):  # raw: any values at all, the rule's or not
        got = support_kl(logits, ids, offsets, given_log_probs, temperature=0.8, check=check)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
        (grad,) = torch.autograd.grad(got.sum(), logits)
        torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=0)


def test_support_kl_is_zero_where_sampler_and_trainer_agree():
    """The sampler's log-probs the trainer's own restricted ones, at a large
    logit scale: the KL's three terms cancel to rounding, and so does its gradient."""
    supports = [[0, 3, 5], [1, 2], [7], [6, 4, 0, 2]]
    ids, offsets = csr(supports)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(2)) * 30
    temperature = 0.7
    sampler = torch.cat([torch.log_softmax(logits[row, support].double() / temperature, 0)
                         for row, support in enumerate(supports)]).float()
    logits.requires_grad_()
    got = support_kl(logits, ids, offsets, sampler, temperature=temperature)
    torch.testing.assert_close(got, torch.zeros(4), atol=2e-5, rtol=0)
    got.sum().backward()
    torch.testing.assert_close(logits.grad, torch.zeros(4, 8), atol=1e-5, rtol=0)


def test_support_kl_of_an_empty_support_is_zero():
    """An empty support (which batch validation and `check=True` refuse)
    has nothing to diverge over: 0, and no gradient reaches its row."""
    ids, offsets = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 2, 2, 3])
    logits = torch.randn(3, 4, requires_grad=True)
    got = support_kl(logits, ids, offsets, torch.tensor([-0.5, -1.0, -0.2]))
    assert float(got[1].detach()) == 0.0 and torch.isfinite(got).all() and (got[[0, 2]] >= 0).all()
    got.sum().backward()
    assert torch.equal(logits.grad[1], torch.zeros(4)) and torch.isfinite(logits.grad).all()
    with pytest.raises(InvalidInput, match=INCREASING + " at mask token 1"):
        support_kl(logits, ids, offsets, torch.tensor([-0.5, -1.0, -0.2]), check=True)



LOG_PROB_RULE = (r"mask_log_probs: rule 'mask_log_probs are finite and <= 0 \(within 0.0009765625 for rounding\)' "
                 r"violated")


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("positions", [None, [2, 1]], ids=["rows-are-tokens", "positions"])
@pytest.mark.parametrize(("value", "shown"), [(math.nan, "nan"), (0.5, "0.5"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_check_refuses_broken_mask_log_probs_naming_the_rule(value, shown, positions, device):
    """`check=True` refuses a sampler log-prob that is not finite or lies
    above 0 by more than rounding, naming the argument, the rule, where it
    is, the expected and the actual value; every mask id's, whether a row
    uses it or not. Unchecked, it is the caller's promise: a value, no refusal."""
    logits, _, ids, offsets = (t.to(device) for t in three_tokens())  # supports {0, 2}, {1, 3}, {2}
    if positions is not None:
        logits, positions = logits[:2], torch.tensor(positions, device=device)
    log_probs = torch.tensor([-0.5, -1.0, -0.1, -2.0, 0.0], device=device)
    log_probs[3] = value  # mask token 1's second id, 3
    with pytest.raises(InvalidInput, match=rf"{LOG_PROB_RULE} at mask token 1: mask_log_prob is {shown} "
                                           rf"\(support id 3, entry 3\), expected finite and <= {LOG_PROB_TOLERANCE}$"):
        support_kl(logits, ids, offsets, log_probs, positions, check=True)
    log_probs[0] = math.nan
    with pytest.raises(InvalidInput, match=rf"{LOG_PROB_RULE} at mask token 0: mask_log_prob is nan .* \(and 1 more\)$"):
        support_kl(logits, ids, offsets, log_probs, positions, check=True)
    assert support_kl(logits, ids, offsets, log_probs, positions).shape == (len(logits),)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_check_passes_sampler_log_probs_within_rounding_and_changes_no_value(device):
    """A log-prob a hair above 0, up to `LOG_PROB_TOLERANCE` (an engine's
    rounding of a near-certain id), keeps the rule."""
    logits, _, ids, offsets = (t.to(device) for t in three_tokens())
    log_probs = torch.tensor([-0.5, -1.0, LOG_PROB_TOLERANCE, -2.0, 1e-6], device=device)
    checked = support_kl(logits, ids, offsets, log_probs, check=True, temperature=0.9)
    assert torch.equal(checked, support_kl(logits, ids, offsets, log_probs, temperature=0.9))
    assert float(checked[2]) == 0.0  # a singleton support: both distributions are certain of its id
