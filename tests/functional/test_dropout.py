import math

import numpy as np
import pytest
import torch

from graphattn.functional import cpu, dropout, dropout_mask
from graphattn.functional.dropout import mask_tensor, seeded_mask, seeded_mask_parameters


@pytest.mark.parametrize("p", [0.1, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mask_is_zero_with_probability_p_else_inverse_keep(p, dtype):
    torch.manual_seed(0)
    n = 200_000
    mask = dropout_mask((n,), p, dtype=dtype)
    assert mask.dtype == dtype and mask.shape == (n,)
    kept = mask != 0
    expected = torch.tensor(1.0 / (1.0 - p), dtype=dtype)
    assert (mask[kept] == expected).all()
    # Fraction dropped: within 5 standard deviations of the binomial mean.
    dropped = 1.0 - kept.double().mean().item()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_dropout_gradient_is_the_mask_and_eval_is_identity():
    torch.manual_seed(1)
    x = torch.randn(50, 7, requires_grad=True)
    torch.manual_seed(2)
    y = dropout(x, 0.3)
    g = torch.randn_like(y)
    y.backward(g)
    torch.manual_seed(2)
    mask = dropout_mask((50, 7), 0.3)
    assert torch.equal(y, x.detach() * mask)
    assert torch.equal(x.grad, g * mask)
    assert dropout(x, 0.3, training=False) is x
    assert dropout(x, 0.0) is x


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_mask_drops_the_same_entries_in_every_dtype(dtype):
    # the triton backend draws its mask in fp32, the others in v's dtype: one seed, one draw
    torch.manual_seed(4)
    fp32 = dropout_mask((100_000,), 0.3)
    torch.manual_seed(4)
    assert torch.equal(dropout_mask((100_000,), 0.3, dtype=dtype) != 0, fp32 != 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dropout_keeps_the_dtype_of_x(dtype):
    x = torch.randn(50, 7).to(dtype)
    torch.manual_seed(2)
    y = dropout(x, 0.3)
    torch.manual_seed(2)
    assert y.dtype == dtype
    assert torch.equal(y, x * dropout_mask((50, 7), 0.3, dtype=dtype))


def test_dropout_of_integers_is_refused_by_name():
    """The mask takes x's dtype: for integers it read "result type Float can't be cast"."""
    x = torch.ones(4, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="x must have a floating-point dtype, got torch.int64"):
        dropout(x, 0.5)
    assert dropout(x, 0.5, training=False) is x  # nothing to drop: x itself, as F.dropout


@pytest.mark.parametrize("p", [-0.5, 1.0, 1.5, float("nan"), "0.5"])
def test_probability_outside_zero_one_is_refused(p):
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got"):
        dropout(x, p)
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got"):
        dropout(x, p, training=False)  # as F.dropout: refused in eval too
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got"):
        dropout_mask((4,), p)


@pytest.mark.parametrize("p", [True, "0.5", torch.tensor(0.5)], ids=["bool", "str", "tensor"])
def test_probability_that_is_not_a_number_is_refused_by_its_type(p):
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got .* \(a (bool|str|Tensor), "
                                         r"not a number\)"):
        dropout(torch.ones(4), p)


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_dropout_under_vmap_follows_its_randomness(randomness):
    """Under torch.func.vmap, one mask for every sample with ``randomness="same"`` (the mask
    of a plain call from the same seed), one per sample with ``"different"``, as F.dropout."""
    x = torch.randn(4, 50, 7)
    torch.manual_seed(2)
    y = torch.func.vmap(lambda x: dropout(x, 0.3), randomness=randomness)(x)
    masks = y / x  # (4, 50, 7): 0 or 1 / 0.7
    assert ((masks == 0) | torch.isclose(masks, torch.tensor(1 / 0.7))).all()
    assert [torch.equal(masks[0] != 0, m != 0) for m in masks[1:]] == [randomness == "same"] * 3
    if randomness == "same":
        torch.manual_seed(2)
        assert torch.equal(y[0], dropout(x[0], 0.3))


# The CPU masks: SplitMix64 written out here from its published definition (Steele, Lea and
# Flood 2014; Vigna's splitmix64.c), in Python integers, to check the kernel against.
_MASK64 = 2**64 - 1


def splitmix64(seed: int, count: int) -> list[int]:
    """The first ``count`` outputs of SplitMix64 seeded with ``seed``."""
    state, outputs = seed, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        outputs.append(z ^ (z >> 31))
    return outputs


def test_the_python_splitmix64_gives_the_published_outputs():
    """The reference below is checked against the first outputs that the test vector of
    SplitMix64's reference code gives for seed 1234567."""
    assert splitmix64(1234567, 3) == [6457827717110365317, 3203168211198807973,
                                      9817491932198370423]


def drawn_seed(seed: int) -> int:
    """The seed a CPU mask draws from torch's generator right after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return int(torch.randint(2**63 - 1, (), dtype=torch.int64))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_cpu_mask_is_splitmix64_of_a_seed_from_torch(p, dtype):
    """Entry i is dropped when the 32 high bits of output i + 1 are below ceil(p 2^32)."""
    shape = (37, 3)
    outputs = splitmix64(drawn_seed(5), math.prod(shape))
    threshold = math.ceil(p * 2**32)
    kept = torch.tensor([z >> 32 >= threshold for z in outputs]).view(shape)
    torch.manual_seed(5)
    mask = dropout_mask(shape, p, dtype=dtype)
    assert mask.dtype == dtype and mask.shape == shape
    scale = torch.tensor(1 / (1 - p), dtype=dtype)
    assert torch.equal(mask, torch.where(kept, scale, torch.zeros((), dtype=dtype)))


def test_cpu_mask_is_the_same_for_any_number_of_threads(monkeypatch):
    """Large masks are drawn by several threads: each entry depends on the seed and its index
    only, so the split does not change the mask."""
    calls = []
    draw = cpu._dropout_bits

    def spy(*args):
        calls.append(args[-2:])
        draw(*args)

    monkeypatch.setattr(cpu, "_dropout_bits", spy)
    monkeypatch.setattr(cpu, "MIN_PARALLEL_MASK", 100)
    threads = torch.get_num_threads()
    masks = {}
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            torch.manual_seed(6)
            masks[n] = dropout_mask((101, 7), 0.4)
    finally:
        torch.set_num_threads(threads)
    assert calls[0] == (0, 707) and len(calls) == 4  # one call, then three chunks
    assert torch.equal(masks[1], masks[3])


def test_cpu_masks_follow_torch_seed_and_fork_rng():
    torch.manual_seed(7)
    first, second = dropout_mask((64, 8), 0.5), dropout_mask((64, 8), 0.5)
    torch.manual_seed(7)
    assert torch.equal(dropout_mask((64, 8), 0.5), first)
    with torch.random.fork_rng():
        dropout_mask((64, 8), 0.5)
    assert torch.equal(dropout_mask((64, 8), 0.5), second)
    # two draws in a row agree on an entry as two independent draws do: p^2 + (1 - p)^2
    agree = ((first != 0) == (second != 0)).double().mean().item()
    assert abs(agree - 0.5) < 5 * math.sqrt(0.25 / first.numel())


def test_cpu_mask_entries_are_uncorrelated_with_their_neighbours():
    """Neighbouring entries come from consecutive outputs of the generator: each disjoint pair
    (2t, 2t + 1) is dropped together with probability p^2, within 5 standard deviations."""
    torch.manual_seed(8)
    p, pairs = 0.3, 100_000
    dropped = dropout_mask((2 * pairs,), p) == 0
    both = (dropped[0::2] & dropped[1::2]).double().mean().item()
    assert abs(both - p * p) < 5 * math.sqrt(p * p * (1 - p * p) / pairs)


def test_cpu_mask_operator_draws_what_eager_draws():
    """The operator torch.compile and torch.func call: the same mask from the same seed, and a
    compiled call with fallback_random (torch's generator for the seed) draws eager's mask."""
    seed = torch.tensor(drawn_seed(9))
    torch.manual_seed(9)
    eager = dropout_mask((40, 4), 0.25, dtype=torch.float64)
    assert torch.equal(torch.ops.graphattn.cpu_dropout_mask(seed, [40, 4], 0.25, torch.float64),
                       eager)
    compiled = torch.compile(lambda: dropout_mask((40, 4), 0.25, dtype=torch.float64),
                             backend="inductor", fullgraph=True)
    with torch._inductor.config.patch(fallback_random=True):
        torch.manual_seed(9)
        assert torch.equal(compiled(), eager)


def test_zero_probability_keeps_every_entry_and_empty_masks_are_empty():
    assert torch.equal(dropout_mask((5, 3), 0.0), torch.ones(5, 3))
    assert dropout_mask((0, 3), 0.5).shape == (0, 3)


def test_vmap_draws_one_splitmix64_mask_per_sample_seed():
    """Under vmap(randomness="different") the seed draw is batched: sample b's mask is the one
    drawn from the b-th seed, as torch's generator gives them for a batch of seeds."""
    torch.manual_seed(10)
    masks = torch.func.vmap(lambda x: dropout_mask((30, 2), 0.4), randomness="different")(
        torch.zeros(3))
    torch.manual_seed(10)
    seeds = torch.randint(2**63 - 1, (3,), dtype=torch.int64).tolist()
    assert masks.shape == (3, 30, 2)
    for mask, seed in zip(masks, seeds, strict=True):
        assert torch.equal(mask, cpu.dropout_mask_from_seed(seed, (30, 2), 0.4, torch.float32))
    with pytest.raises(RuntimeError, match="randomness"):  # vmap's default, as for F.dropout
        torch.func.vmap(lambda x: dropout_mask((30, 2), 0.4))(torch.zeros(3))


def test_traced_masks_are_drawn_at_every_call():
    """Tracers outside dynamo (make_fx, torch.jit.trace) record the mask's operator, so a
    traced function draws a new mask at each call instead of replaying the traced one."""
    traced = torch.fx.experimental.proxy_tensor.make_fx(
        lambda x: x * dropout_mask((20, 5), 0.5))(torch.ones(20, 5))
    assert any(node.target is torch.ops.graphattn.cpu_dropout_mask.default
               for node in traced.graph.nodes)
    assert not torch.equal(traced(torch.ones(20, 5)), traced(torch.ones(20, 5)))
    scripted = torch.jit.trace(lambda x: x * dropout_mask((20, 5), 0.5), torch.ones(20, 5),
                               check_trace=False)
    assert not torch.equal(scripted(torch.ones(20, 5)), scripted(torch.ones(20, 5)))


def test_dropout_of_a_tensor_traces_with_torch_jit_trace():
    """``dropout(x, p)`` reads the mask's shape from ``x``, which ``torch.jit.trace`` records
    as traced sizes (once an internal assert of the operator's ``SymInt[]``): the traced
    function draws the eager masks at the same seed."""
    traced = torch.jit.trace(lambda x: dropout(x, 0.5), torch.ones(6, 7), check_trace=False)
    torch.manual_seed(3)
    out = traced(torch.ones(6, 7))
    torch.manual_seed(3)
    assert torch.equal(out, dropout(torch.ones(6, 7), 0.5))
    assert (out == 0).any() and (out == 2).any()


def test_shape_may_be_an_int():
    torch.manual_seed(11)
    mask = dropout_mask(40, 0.5)
    for size in (np.int64(40), torch.tensor(40), (torch.tensor(40),)):
        torch.manual_seed(11)
        assert torch.equal(mask, dropout_mask(size, 0.5))
    torch.manual_seed(11)
    assert mask.shape == (40,) and torch.equal(mask, dropout_mask((40,), 0.5))


@pytest.mark.parametrize("call, error, match", [
    # each failed inside torch or Python ("'numpy.int64' object is not iterable" before numpy
    # integers were taken, "negative dimension", "result type Float can't be cast", an
    # AttributeError) or returned a complex mask
    (lambda: dropout_mask((-1, 3), 0.5), ValueError,
     r"shape must be a non-negative integer or a sequence of them, got \(-1, 3\)"),
    (lambda: dropout_mask(2.5, 0.5), ValueError, r"shape must be .*got 2.5"),
    (lambda: dropout_mask(3, 0.5, dtype=torch.int64), TypeError,
     r"dtype must be a floating-point torch.dtype, got torch.int64"),
    (lambda: dropout_mask(3, 0.5, dtype="float32"), TypeError,
     r"dtype must be a floating-point torch.dtype, got 'float32'"),
    (lambda: dropout_mask(3, 0.5, dtype=torch.complex64), TypeError,
     r"dtype must be a floating-point torch.dtype, got torch.complex64"),
    (lambda: dropout([1.0, 2.0], 0.5), TypeError, r"x must be a torch.Tensor, got list"),
])
def test_mask_arguments_are_refused_by_name(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_seeded_mask_parameters_stand_for_the_cpu_mask(p):
    """The parameters the Triton kernels draw from: the seed torch's generator gives
    ``dropout_mask`` (the same ``torch.manual_seed``, the same seed), the threshold
    ceil(p 2^32), and 1 / (1 - p) in fp32; written out they are the CPU mask."""
    torch.manual_seed(4)
    parameters = seeded_mask_parameters(p, device="cpu")
    torch.manual_seed(4)
    mask = dropout_mask((70, 3), p)
    torch.manual_seed(4)
    seed = int(torch.randint(2**63 - 1, (), dtype=torch.int64))
    assert parameters.dtype == torch.int64 and parameters.shape == (3,)
    assert parameters[:2].tolist() == [seed, math.ceil(p * 2**32)]
    kept = parameters[2:].to(torch.int32).view(torch.float32)
    assert kept.item() == torch.tensor(1.0 / (1.0 - p), dtype=torch.float32).item()
    assert torch.equal(seeded_mask(parameters, (70, 3)), mask)
    assert torch.equal(seeded_mask(parameters, (70, 3), torch.bfloat16),
                       mask.to(torch.bfloat16))
    # as the kernels take it: a float mask passes through, and no mask stays None
    assert torch.equal(mask_tensor(parameters, 70, 3), mask)
    assert mask_tensor(mask, 70, 3) is mask and mask_tensor(None, 70, 3) is None


def test_seeded_mask_operator_writes_the_eager_mask_and_batches_under_vmap():
    """Tracers and functorch transforms see ``seeded_mask`` as the operator
    ``graphattn::seeded_dropout_mask``: it writes eager's mask, make_fx records it, and under
    vmap each sample's parameters give that sample's mask."""
    torch.manual_seed(6)
    parameters = seeded_mask_parameters(0.3, device="cpu")
    eager = seeded_mask(parameters, (25, 2), torch.float16)
    assert torch.equal(torch.ops.graphattn.seeded_dropout_mask(parameters, [25, 2],
                                                                torch.float16), eager)
    traced = torch.fx.experimental.proxy_tensor.make_fx(
        lambda prm: seeded_mask(prm, (25, 2), torch.float16))(parameters)
    assert any(node.target is torch.ops.graphattn.seeded_dropout_mask.default
               for node in traced.graph.nodes)
    assert torch.equal(traced(parameters), eager)
    batch = torch.stack([parameters, seeded_mask_parameters(0.3, device="cpu")])
    masks = torch.func.vmap(lambda prm: seeded_mask(prm, (25, 2)))(batch)
    assert masks.shape == (2, 25, 2) and not torch.equal(masks[0], masks[1])
    for mask, prm in zip(masks, batch, strict=True):
        assert torch.equal(mask, seeded_mask(prm, (25, 2)))


def test_mask_drawn_by_torch_elsewhere_is_zero_or_the_inverse_keep(monkeypatch):
    """The path of devices without graphattn's seeded masks (CUDA without triton, fp64 on
    CUDA, MPS): ``torch.rand`` draws it, with the same values as every other path."""
    monkeypatch.setattr(cpu, "MASK_DTYPES", frozenset())  # the CPU takes that path too
    torch.manual_seed(0)
    p = 0.3
    mask = dropout_mask((200_000,), p)
    values = mask.unique().tolist()
    assert values == [0.0, pytest.approx(1 / (1 - p))]
    assert (mask == 0).float().mean().item() == pytest.approx(p, abs=0.005)
    assert mask.mean().item() == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_multiplier_past_the_dtype_is_refused(dtype):
    """p = 0.99999 keeps entries as 1e5, past fp16's 65504: the mask held inf, and attention
    outputs inf and gradients NaN from finite inputs. bf16 holds 1e5 (and refuses nothing)."""
    if dtype == torch.float16:
        with pytest.raises(ValueError, match=r"dropout probability of 0.99999 .* 100000, past "
                                             r"the largest torch.float16 \(65504\)"):
            dropout_mask(8, 0.99999, dtype=dtype)
    else:
        assert dropout_mask(8, 0.99999, dtype=dtype).isfinite().all()
    assert dropout_mask(8, 0.99, dtype=dtype).isfinite().all()
