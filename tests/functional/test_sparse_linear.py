"""sparse_linear: F.linear with a counting-sort transpose in backward for CPU CSR features."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphattn.functional.sparse_linear import sparse_linear


def bag_of_words(num_rows: int, num_cols: int, dtype=torch.float32, seed: int = 0):
    """Sparse nonnegative features with an empty row and an empty column, as dense."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(num_rows, num_cols, generator=gen, dtype=dtype)
    x = x * (torch.rand(num_rows, num_cols, generator=gen) < 0.15)
    x[min(3, num_rows - 1)] = 0.0
    x[:, min(5, num_cols - 1)] = 0.0
    return x


def _out_and_grads(x, weight, bias, grad, linear):
    weight.grad = None
    if bias is not None:
        bias.grad = None
    out = linear(x, weight, bias)
    out.backward(grad)
    return out, weight.grad, None if bias is None else bias.grad


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [(40, 30), (1, 7), (6, 1)], ids=str)
def test_equals_f_linear_bit_for_bit(transposes, shape, with_bias, dtype, index_dtype):
    """Outputs and the gradients of weight and bias are F.linear's exactly: each sum runs over
    the same entries in the same order (the transpose keeps the rows of a column ascending)."""
    dense = bag_of_words(*shape, dtype=dtype)
    csr = dense.to_sparse_csr()
    x = torch.sparse_csr_tensor(csr.crow_indices().to(index_dtype),
                                csr.col_indices().to(index_dtype), csr.values(), csr.shape)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(8, shape[1], generator=gen, dtype=dtype, requires_grad=True)
    bias = torch.randn(8, generator=gen, dtype=dtype, requires_grad=True) if with_bias else None
    grad = torch.randn(shape[0], 8, generator=gen, dtype=dtype)
    got = _out_and_grads(x, weight, bias, grad, sparse_linear)
    assert len(transposes) == 1
    expected = _out_and_grads(x, weight, bias, grad, F.linear)
    for g, e in zip(got, expected, strict=True):
        assert (g is None and e is None) or torch.equal(g, e)
    # against the dense product too, up to rounding
    torch.testing.assert_close(got[1], grad.T @ dense)


def test_features_without_an_entry(transposes):
    """A matrix of zeros (no stored entry): a zero weight gradient."""
    x = torch.zeros(5, 4).to_sparse_csr()
    weight = torch.randn(3, 4, requires_grad=True)
    out = sparse_linear(x, weight)
    out.sum().backward()
    assert torch.equal(out, torch.zeros(5, 3)) and torch.equal(weight.grad, torch.zeros(3, 4))
    assert len(transposes) == 1


@pytest.mark.parametrize("case", ["dense", "coo", "csc", "x requires grad", "torch.func",
                                  "float64 x, float32 weight"])
def test_other_inputs_take_f_linear(transposes, case):
    """Every other layout, features that require grad (their gradient is F.linear's), torch.func
    transforms and mismatched dtypes go to F.linear: the same values or the same error."""
    dense = bag_of_words(10, 6)
    weight = torch.randn(4, 6, requires_grad=True)
    x = {"dense": dense, "coo": dense.to_sparse(), "csc": dense.to_sparse_csc()}.get(
        case, dense.to_sparse_csr())
    if case == "x requires grad":
        x.requires_grad_()
    if case == "float64 x, float32 weight":
        with pytest.raises(RuntimeError) as caught:
            sparse_linear(x.double(), weight)
        with pytest.raises(type(caught.value)):
            F.linear(x.double(), weight)
    elif case == "torch.func":  # F.linear's result, or its error (torch 2.13 takes no CSR)
        def outcome(linear):
            try:
                return torch.func.grad(lambda w: linear(x, w).sum())(weight.detach())
            except RuntimeError as err:
                return str(err)

        got, expected = outcome(sparse_linear), outcome(F.linear)
        assert got == expected if isinstance(got, str) else torch.equal(got, expected)
    else:
        out = sparse_linear(x, weight)
        out.sum().backward()
        torch.testing.assert_close(out, dense @ weight.detach().T)
        torch.testing.assert_close(weight.grad, torch.ones(10, 4).T @ dense)
    assert transposes == []


def test_gradients_of_gradients():
    """The backward is made of differentiable products: gradients of gradients (a gradient
    penalty on the weights) against finite differences in fp64."""
    x = bag_of_words(7, 5, dtype=torch.float64).to_sparse_csr()
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w, b: sparse_linear(x, w, b).square(), (weight, bias))
    assert torch.autograd.gradgradcheck(lambda w, b: sparse_linear(x, w, b).square(),
                                        (weight, bias))


def test_inference_skips_the_transpose(transposes):
    """Without a gradient to compute nothing is transposed."""
    x = bag_of_words(9, 4).to_sparse_csr()
    weight = torch.randn(2, 4, requires_grad=True)
    with torch.no_grad():
        out = sparse_linear(x, weight)
    torch.testing.assert_close(out, x.to_dense() @ weight.detach().T)
    frozen = sparse_linear(x, weight.detach(), torch.zeros(2, requires_grad=True))
    frozen.sum().backward()
    assert transposes == []


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_csc], ids=["csr", "csc"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_csr_features_are_multiplied_in_fp32(dtype, layout):
    """torch has no CSR product in half precision on CPU ("addmm_out_sparse_csr_impl_mkl" not
    implemented for 'BFloat16'): a bf16 model failed on the sparse features it took in fp32.
    The product runs in fp32, rounded to the dtype: the fp32 product of the same values,
    rounded, and its gradients."""
    x = bag_of_words(12, 9).to(dtype)
    weight = torch.randn(5, 9, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(5, generator=torch.Generator().manual_seed(2)).to(dtype)
    grad = torch.randn(12, 5, generator=torch.Generator().manual_seed(3)).to(dtype)
    sparse = x.to_sparse_csr() if layout == torch.sparse_csr else x.to_sparse_csc()
    got = _out_and_grads(sparse, weight.requires_grad_(), bias.requires_grad_(), grad,
                         sparse_linear)
    wide = [t.float().detach().requires_grad_() for t in (weight, bias)]
    want = _out_and_grads(x.float(), *wide, grad.float(), F.linear)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        assert torch.equal(g, w.to(dtype))


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_csc, torch.sparse_coo],
                         ids=["csr", "csc", "coo"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_sparse_features_under_autocast_are_multiplied_in_fp32(dtype, layout):
    """Under torch.autocast on CPU, fp32 sparse features and weights: the product in fp32 (torch
    has none in half precision for CSR and CSC), the result in autocast's dtype, as F.linear
    gives it for the dense features; the weight's gradient in fp32, as autocast's are."""
    x = bag_of_words(12, 9)
    sparse = {torch.sparse_csr: x.to_sparse_csr, torch.sparse_csc: x.to_sparse_csc,
              torch.sparse_coo: x.to_sparse}[layout]()
    weight = torch.randn(5, 9, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(5, generator=torch.Generator().manual_seed(2))
    grad = torch.randn(12, 5, generator=torch.Generator().manual_seed(3))
    results = []
    for features, linear in ((sparse, sparse_linear), (x, F.linear)):
        with torch.autocast("cpu", dtype=dtype):
            out = linear(features, *(t.detach().requires_grad_() for t in (weight, bias)))
        results.append(out)
    got, dense = results
    assert got.dtype == dense.dtype == dtype
    assert torch.equal(got, F.linear(x, weight, bias).to(dtype))  # rounded once
    assert torch.allclose(got.float(), dense.float(), rtol=2e-2, atol=2e-2)
    w = weight.detach().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):  # (the backward outside, as torch advises)
        loss = (sparse_linear(sparse, w, bias) * grad).sum()
    loss.backward()
    assert w.grad.dtype == torch.float32
    assert torch.allclose(w.grad, (grad.t() @ x), rtol=1e-2, atol=1e-2)
