import numpy as np
import pytest
import torch
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from graphattn.functional import scatter_softmax


def per_group_softmax(src: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """Independent reference: torch.softmax on each group separately."""
    out = torch.zeros_like(src)
    for g in range(num_segments):
        sel = index == g
        if sel.any():
            out[sel] = torch.softmax(src[sel], dim=0)
    return out


@pytest.mark.parametrize("shape", [(9,), (9, 3)])
def test_matches_per_group_softmax(shape):
    torch.manual_seed(0)
    src = torch.randn(shape)
    index = torch.tensor([0, 2, 2, 0, 1, 2, 4, 4, 0])
    out = scatter_softmax(src, index, num_segments=5)
    assert_close(out, per_group_softmax(src, index, 5))


def test_groups_of_wildly_different_scales():
    src = torch.tensor([-1000.0, 0.0, 1e4, 3.0, 3.0, -5e3])
    index = torch.tensor([0, 0, 1, 2, 2, 3])
    out = scatter_softmax(src, index)
    assert_close(out, torch.tensor([0.0, 1.0, 1.0, 0.5, 0.5, 1.0]))
    assert_close(out, per_group_softmax(src, index, 4))


def test_all_minus_inf_group_gives_zero_not_nan():
    src = torch.tensor([float("-inf"), float("-inf"), 1.0, float("-inf")], requires_grad=True)
    index = torch.tensor([0, 0, 1, 1])
    out = scatter_softmax(src, index)
    assert_close(out, torch.tensor([0.0, 0.0, 1.0, 0.0]))
    out.sum().backward()
    assert torch.isfinite(src.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_minus_inf_group_has_zero_gradient_under_large_upstream_gradients(dtype):
    """A masked-out group's weights are constant 0: their gradient is 0 whatever comes from
    above, and the other groups' gradients are torch.softmax's."""
    inf = float("-inf")
    src = torch.tensor([inf, inf, 0.5, -1.0, inf], dtype=dtype, requires_grad=True)
    index = torch.tensor([0, 0, 1, 1, 1])
    # up to the dtype's largest value: dividing by any divisor below 1 would overflow to inf
    # there, and inf * 0 is NaN (an all -inf group's sum is 0, any other group's is >= 1)
    big = torch.finfo(dtype).max
    upstream = torch.tensor([big, -big, 2.0, 7.0, 1e6], dtype=dtype)
    (scatter_softmax(src, index) * upstream).sum().backward()
    live = src.detach()[2:].clone().requires_grad_()
    (torch.softmax(live, dim=0) * upstream[2:]).sum().backward()
    assert_close(src.grad[:2], torch.zeros(2, dtype=dtype))
    assert_close(src.grad[2:], live.grad)


def test_empty_groups_and_empty_input():
    out = scatter_softmax(torch.tensor([2.0, 5.0]), torch.tensor([1, 4]), num_segments=7)
    assert_close(out, torch.ones(2))
    empty = scatter_softmax(torch.empty(0, 3), torch.empty(0, dtype=torch.long))
    assert empty.shape == (0, 3)


def test_int32_index():
    src = torch.randn(6, 2)
    index = torch.tensor([0, 1, 0, 1, 1, 2])
    assert_close(scatter_softmax(src, index.int()), scatter_softmax(src, index))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_fp32(dtype):
    torch.manual_seed(0)
    src = torch.randn(200, 2) * 4
    index = torch.randint(0, 3, (200,))
    out = scatter_softmax(src.to(dtype), index)
    assert out.dtype == dtype
    assert_close(out, per_group_softmax(src, index, 3), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_the_fp32_softmax_rounded_once(dtype):
    """Computed in fp32 and rounded once at the end: bit for bit the fp32 softmax of the same
    half scores, rounded. (Rounding exp and the sums in the half dtype changes about 80% of
    the bf16 values and 27% of the fp16 ones by an ulp, which a tolerance cannot see.)"""
    torch.manual_seed(0)
    index = torch.randint(0, 5, (2000,))
    src = (torch.randn(2000, 2) * 4).to(dtype)
    expected = per_group_softmax(src.float(), index, 5).to(dtype)
    assert torch.equal(scatter_softmax(src, index), expected)


def test_gradcheck_float64():
    torch.manual_seed(0)
    src = torch.randn(10, 2, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([0, 0, 1, 3, 3, 3, 1, 0, 3, 1])
    assert torch.autograd.gradcheck(lambda s: scatter_softmax(s, index, 5), (src,))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(-50, 50)), min_size=1, max_size=40))
def test_property_sums_to_one_per_group(pairs):
    index = torch.tensor([g for g, _ in pairs])
    src = torch.tensor([s for _, s in pairs], dtype=torch.float64)
    out = scatter_softmax(src, index, num_segments=6)
    assert (out >= 0).all() and (out <= 1).all()
    sums = torch.zeros(6, dtype=torch.float64).index_add_(0, index, out)
    present = torch.bincount(index, minlength=6) > 0
    assert_close(sums[present], torch.ones(int(present.sum()), dtype=torch.float64))


def test_compiled_without_num_segments_counts_the_groups_from_index():
    """Traced by torch.compile, the default group count index.max() + 1 is read inside the
    graph, not by the eager range check."""
    src, index = torch.tensor([1.0, 1.0, 5.0, 2.0]), torch.tensor([0, 0, 3, 3])
    torch._dynamo.reset()
    compiled = torch.compile(scatter_softmax, backend="aot_eager")
    assert_close(compiled(src, index), per_group_softmax(src, index, 4))


def test_errors():
    with pytest.raises(ValueError, match=r"src must have shape \[E\] or \[E, H\], got \[2, 2, 2\]"):
        scatter_softmax(torch.zeros(2, 2, 2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"index must have shape \[E\] = \[3\].*got \[2\]"):
        scatter_softmax(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    for dtype in (torch.float32, torch.bool, torch.uint16, torch.uint32, torch.uint64):
        # (torch's uint16 to uint64 lack the range check's reductions: once a raw error)
        with pytest.raises(TypeError, match=f"index must have an integer dtype \\(int8 to "
                                            f"int64, or uint8\\), got {dtype}"):
            scatter_softmax(torch.zeros(3), torch.zeros(3, dtype=dtype))
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32):  # read as int64's
        assert torch.equal(scatter_softmax(torch.arange(3.0), torch.tensor([0, 1, 1], dtype=dtype)),
                           scatter_softmax(torch.arange(3.0), torch.tensor([0, 1, 1])))
    index = torch.tensor([0, 1, 1])
    with pytest.raises(TypeError, match="src must have a floating-point dtype, got torch.int64"):
        scatter_softmax(torch.zeros(3, dtype=torch.long), index)
    with pytest.raises(ValueError, match="num_segments must be a non-negative integer, got -1"):
        scatter_softmax(torch.zeros(3), index, num_segments=-1)
    with pytest.raises(ValueError, match="num_segments must be a non-negative integer, got 2.0"):
        scatter_softmax(torch.zeros(3), index, num_segments=2.0)
    with pytest.raises(ValueError, match=r"index must hold groups in \[0, num_segments\) = "
                                         r"\[0, 1\), got values from 0 to 1"):
        scatter_softmax(torch.zeros(3), index, num_segments=1)
    with pytest.raises(ValueError, match="got values from -1 to 1"):
        scatter_softmax(torch.zeros(3), torch.tensor([0, -1, 1]))
    with pytest.raises(TypeError, match="src must be a torch.Tensor, got list"):
        scatter_softmax([0.0, 1.0, 2.0], index)
    with pytest.raises(TypeError, match="index must be a torch.Tensor, got list"):
        scatter_softmax(torch.zeros(3), [0, 1, 1])


def test_num_segments_takes_numpy_and_tensor_integers():
    src, index = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 2, 2])
    want = scatter_softmax(src, index, num_segments=4)
    for n in (np.int64(4), torch.tensor(4)):
        assert torch.equal(scatter_softmax(src, index, num_segments=n), want)


def test_a_missing_tensor_is_named():
    with pytest.raises(TypeError, match="index must be a torch.Tensor, got NoneType"):
        scatter_softmax(torch.randn(3), None)
    with pytest.raises(TypeError, match="src must be a torch.Tensor, got list"):
        scatter_softmax([1.0, 2.0], torch.tensor([0, 0]))
