import math
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from conftest import assert_close
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphattn import graphs
from graphattn.functional import dense_attention, dense_backend, edge_attention
from graphattn.graphs import window_graph


def explicit_attention(q, k, v, mask, scale):
    """Independent reference in einsum, [..., L, H, C] layout; empty rows give 0."""
    scores = torch.einsum("...ihc,...jhc->...hij", q, k) * scale
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("...hij,...jhc->...ihc", weights, v), weights


def qkv(*lead, L=6, S=6, H=2, C=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, L, H, C, generator=gen, requires_grad=True)
    k = torch.randn(*lead, S, H, C, generator=gen, requires_grad=True)
    v = torch.randn(*lead, S, H, C, generator=gen, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("lead", [(), (3,)])
def test_mask_matches_explicit_and_returns_weights(lead):
    q, k, v = qkv(*lead, L=5, S=7)
    mask = torch.rand(*lead, 5, 7, generator=torch.Generator().manual_seed(1)) < 0.5
    mask[..., 0, :] = False  # one fully masked query row
    out = dense_attention(q, k, v, mask)
    out_w, weights = dense_attention(q, k, v, mask, return_attention=True)
    ref, ref_w = explicit_attention(q, k, v, mask, 1 / math.sqrt(4))
    assert_close(out, ref)
    assert_close(out_w, ref)
    assert_close(weights, ref_w)
    assert (out[..., 0, :, :] == 0).all()
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(g).all()
        assert_close(g, r)


@pytest.mark.parametrize("return_attention", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("lead", [(), (3,)])
def test_mask_of_one_query_row_or_key_column_broadcasts(lead, is_causal, return_attention):
    # [..., 1, L_k]: a key mask (PyG's to_dense_batch mask, unsqueezed), the same for every
    # query; [..., L_q, 1]: whole query rows on or off. Each equals its expanded [..., L_q, L_k].
    q, k, v = qkv(*lead, L=5, S=7)
    gen = torch.Generator().manual_seed(2)
    for shape in ((*lead, 1, 7), (*lead, 5, 1)):
        mask = torch.rand(shape, generator=gen) < 0.6
        mask.view(-1)[0] = False  # a key (or query) off, in the first batch entry
        full = mask.expand(*lead, 5, 7)
        out = dense_attention(q, k, v, mask, is_causal=is_causal,
                              return_attention=return_attention)
        expected = dense_attention(q, k, v, full.contiguous(), is_causal=is_causal,
                                   return_attention=return_attention)
        tril = torch.ones(5, 7, dtype=torch.bool).tril()
        ref, ref_w = explicit_attention(q, k, v, full & tril if is_causal else full,
                                        1 / math.sqrt(4))
        if return_attention:
            assert_close(out[1], expected[1])
            assert_close(out[1], ref_w)
            out, expected = out[0], expected[0]
        assert_close(out, expected)
        assert_close(out, ref)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for g, r in zip(grads, ref_grads, strict=True):
            assert_close(g, r)


@pytest.mark.parametrize("return_attention", [False, True])
@pytest.mark.parametrize("batched", ["q", "k", "v"])
def test_leading_dims_of_one_input_broadcast_over_the_others(batched, return_attention):
    # One of q, k, v carries a batch dim of 3, the other two none; the mask carries it too.
    # Each batch entry equals the unbatched call on that entry's slice.
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*((3,) if name == batched else ()), L, 2, 4, generator=gen,
                           requires_grad=True)
               for name, L in (("q", 5), ("k", 7), ("v", 7)))
    mask = torch.rand(3, 5, 7, generator=gen) < 0.6
    result = dense_attention(q, k, v, mask, return_attention=return_attention)
    out = result[0] if return_attention else result
    assert out.shape == (3, 5, 2, 4)
    expected = []
    for b in range(3):
        qb, kb, vb = (t[b] if name == batched else t
                      for name, t in zip("qkv", (q, k, v), strict=True))
        expected.append(dense_attention(qb, kb, vb, mask[b], return_attention=return_attention))
        if return_attention:
            assert_close(result[1][b], expected[b][1])
            expected[b] = expected[b][0]
        assert_close(out[b], expected[b])
    # the unbatched inputs' gradients sum over the batch entries they served
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(sum(e.square().sum() for e in expected), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r)


def test_causal_flag_equals_lower_triangular_mask():
    q, k, v = qkv(2)
    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    assert_close(dense_attention(q, k, v, is_causal=True), dense_attention(q, k, v, tril))
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(3)) < 0.7
    assert_close(dense_attention(q, k, v, mask, is_causal=True),
                 dense_attention(q, k, v, mask & tril))
    _, weights = dense_attention(q, k, v, is_causal=True, return_attention=True)
    assert (weights[..., ~tril] == 0).all()


def test_no_mask_is_full_softmax_and_eval_ignores_dropout():
    q, k, v = qkv()
    full = torch.ones(6, 6, dtype=torch.bool)
    ref, _ = explicit_attention(q, k, v, full, 0.5)
    assert_close(dense_attention(q, k, v, scale=0.5), ref)
    assert_close(dense_attention(q, k, v, scale=0.5, dropout_p=0.9, training=False), ref)


def test_errors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="mask must be a bool tensor, got torch.float32"):
        dense_attention(q, k, v, torch.ones(6, 6))
    for shape in ([6, 5], [2, 6], [6]):
        with pytest.raises(ValueError, match=r"mask must have shape \[..., L_q, L_k\] = "
                                             r"\[..., 6, 6\] \(or 1 for either, broadcast\), "
                                             rf"got \{shape}"):
            dense_attention(q, k, v, torch.ones(shape, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"q must have shape \[..., L, H, C\], got \[6, 8\]"):
        dense_attention(q.flatten(-2), k, v)
    with pytest.raises(ValueError, match="do not fit together"):
        dense_attention(q, k[:, :1], v)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got -0.1"):
        dense_attention(q, k, v, dropout_p=-0.1)
    with pytest.raises(TypeError, match="q must have a floating-point dtype, got torch.int64"):
        dense_attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="scale must be a finite number, got nan"):
        dense_attention(q, k, v, scale=float("nan"))
    batched = q.expand(2, -1, -1, -1)  # (2, 6, 2, 4)
    with pytest.raises(ValueError, match=r"the leading \(batch\) dims of q, k and v must "
                                         r"broadcast together, got q \[2, 6, 2, 4\], "
                                         r"k \[3, 6, 2, 4\]"):
        dense_attention(batched, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1))
    with pytest.raises(ValueError, match=r"the leading dims of mask must broadcast to those of "
                                         r"q, k and v \[2\], got mask \[3, 6, 6\]"):
        dense_attention(batched, k, v, torch.ones(3, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"got mask \[4, 2, 6, 6\]"):  # more dims than q
        dense_attention(batched, k, v, torch.ones(4, 2, 6, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got list"):
        dense_attention(q, k, v, torch.ones(6, 6, dtype=torch.bool).tolist())


@pytest.mark.parametrize("return_attention", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_zero_channels_give_uniform_weights(is_causal, return_attention):
    # C = 0: every score is 0 (as in edge_attention), so each query averages its allowed values
    q, k, v = qkv()
    q, k = q[..., :0], k[..., :0]  # (6, 2, 0)
    mask = torch.ones(6, 6, dtype=torch.bool)
    ref, _ = explicit_attention(q, k, v, mask.tril() if is_causal else mask, scale=1.0)
    result = dense_attention(q, k, v, is_causal=is_causal, return_attention=return_attention)
    assert_close(result[0] if return_attention else result, ref)


NO_HEADS = """
import torch
from graphattn.functional import dense_attention, edge_attention
q = torch.randn(4, 0, 3, requires_grad=True)  # (N, H = 0, C)
outs = [dense_attention(q, q, q), dense_attention(q[None], q[None], q[None], is_causal=True),
        dense_attention(q, q, q, torch.ones(4, 4, dtype=torch.bool)),
        dense_attention(q, q, q, batch=torch.tensor([1, 0, 1, 1])),
        edge_attention(q, q, q, torch.tensor([[0, 1], [1, 2]]), backend="dense")]
sum(out.sum() for out in outs).backward()
print([list(out.shape) for out in outs], list(q.grad.shape))
"""


def test_no_heads_give_empty_outputs_with_gradients():
    """H = 0 with gradients: torch's CPU flash operator divides by H (SIGFPE, the process
    dies), and SDPA before torch 2.13 hands it 4-D inputs without heads, so sdpa makes their
    empty outputs without SDPA. In a fresh process: a crash must fail the test, not end the
    session."""
    done = subprocess.run([sys.executable, "-c", NO_HEADS], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"returncode {done.returncode}: {done.stderr[-3000:]}"
    assert done.stdout.strip() == ("[[4, 0, 3], [1, 4, 0, 3], [4, 0, 3], [4, 0, 3], [4, 0, 3]] "
                                   "[4, 0, 3]")


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("call", ["dense_attention", "dense backend", "dense backend, bias"])
def test_sdpa_gets_a_batch_dimension(call, grad, sdpa_calls):
    """Unbatched inputs reach SDPA as 4-D tensors with a 2-D or 4-D mask (its fused kernels
    take no other), once: a training step's backward does not run the forward again."""
    q, k, v = qkv(L=6, S=6)
    edge_index = window_graph(6, radius=1)
    bias = torch.randn(edge_index.size(1), 2, generator=torch.Generator().manual_seed(3))
    bias.requires_grad_(grad)
    mask = torch.zeros(6, 6, dtype=torch.bool)
    mask[edge_index[1], edge_index[0]] = True
    additive = torch.full((2, 6, 6), float("-inf"))  # (H, i, j)
    additive[:, edge_index[1], edge_index[0]] = bias.detach().t() if call.endswith("bias") else 0

    with torch.set_grad_enabled(grad):
        if call == "dense_attention":
            got = dense_attention(q, k, v, mask)
        else:
            got = edge_attention(q, k, v, edge_index, backend="dense",
                                 bias=bias if call.endswith("bias") else None)
    if grad:
        got.square().sum().backward()
        assert q.grad is not None and k.grad is not None and v.grad is not None
    assert len(sdpa_calls) == 1 and sdpa_calls[0][:2] in ((4, 2), (4, 4)), sdpa_calls
    scores = torch.einsum("ihc,jhc->hij", q, k).detach() / 2.0 + additive  # scale 1/sqrt(4)
    assert_close(got, torch.einsum("hij,jhc->ihc", torch.softmax(scores, -1), v.detach()))


def test_gradients_of_gradients_without_batch_dimension():
    """The fused kernel's backward cannot be differentiated; second derivatives still come
    (through the math path), checked against finite differences in fp64."""
    q, k, v = (t.detach().double().requires_grad_() for t in qkv(L=5, S=5, C=3))
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(2)) < 0.6
    mask[:, 0] = True
    assert torch.autograd.gradgradcheck(lambda q, k, v: dense_attention(q, k, v, mask),
                                        (q, k, v))


# the reference: torch's SDPA with its own autograd, taken before any test replaces it
SDPA = F.scaled_dot_product_attention


def _sdpa_case(dims, mask_kind, dtype, contiguous, L_q=9, L_k=9):
    gen = torch.Generator().manual_seed(7)
    lead = (2, 3) if dims == 4 else (3,)  # [B,] H

    def tensor(L):
        if contiguous:
            return torch.randn(*lead, L, 8, generator=gen).to(dtype)
        # (..., H, L, C) views of (..., L, H, C) tensors, as dense_attention makes them
        return torch.randn(*lead, L, 8, generator=gen).to(dtype).transpose(-3, -2) \
            .contiguous().transpose(-3, -2)

    q, k, v = tensor(L_q), tensor(L_k), tensor(L_k)
    mask = {
        "none": None,
        "is_causal": None,
        "bool [L, L]": torch.rand(L_q, L_k, generator=gen) < 0.6,
        "bool key mask": torch.rand(*lead[:-1], 1, 1, L_k, generator=gen) < 0.6,
        "bool full": torch.rand(*lead, L_q, L_k, generator=gen) < 0.6,
        "float": torch.randn(*lead, L_q, L_k, generator=gen).to(dtype),
    }[mask_kind]
    if mask is not None and mask.dtype == torch.bool:
        mask[..., 0] = True  # no row without a key: SDPA's kernels differ there
    return [t.requires_grad_() for t in (q, k, v)], mask


@pytest.mark.parametrize("ops", ["flash operators", "recompute"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("mask_kind", ["none", "is_causal", "bool [L, L]", "bool key mask",
                                       "bool full", "float"])
@pytest.mark.parametrize("dims", [3, 4])
def test_sdpa_with_gradients_equals_torch_sdpa_bit_for_bit(dims, mask_kind, dtype, ops,
                                                           monkeypatch):
    """dense_backend.sdpa with gradients wanted (through _FusedSDPA, which calls the CPU flash
    kernel's operators itself, or without them recomputes the forward) gives exactly what
    torch's SDPA and its autograd give: output and gradients of q, k and v, for contiguous and
    transposed inputs, as many queries as keys or fewer, and an incoming gradient that is
    contiguous or transposed."""
    is_causal = mask_kind == "is_causal"
    if ops == "recompute":
        monkeypatch.setattr(dense_backend, "_flash_cpu_forward", None)
    for contiguous, L_q in ((True, 9), (False, 9), (False, 5)):
        (q, k, v), mask = _sdpa_case(dims, mask_kind, dtype, contiguous, L_q=L_q)
        out = dense_backend.sdpa(q, k, v, attn_mask=mask, is_causal=is_causal)
        assert type(out.grad_fn).__name__ != "ScaledDotProductFlashAttentionForCpuBackward0"
        grad = torch.randn_like(out)
        if not contiguous:
            grad = grad.transpose(-3, -2).contiguous().transpose(-3, -2)
        got = torch.autograd.grad(out, (q, k, v), grad)
        if dims == 3:  # what SDPA gets: a batch dimension, and a 4-D mask
            q, k, v = q[None], k[None], v[None]
            mask = mask[None] if mask is not None and mask.dim() == 3 else mask
            grad = grad[None]
        want_out = SDPA(q, k, v, attn_mask=mask, is_causal=is_causal)
        want = torch.autograd.grad(want_out, (q, k, v), grad)
        assert torch.equal(out, want_out[0] if dims == 3 else want_out)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w[0] if dims == 3 else w)


def test_flash_operators_run_forward_once_per_training_step(sdpa_calls):
    """On CPU, the backward hands the flash kernel's saved log-sum-exp to its backward
    operator: one SDPA forward per step, where the recompute took two."""
    (q, k, v), mask = _sdpa_case(4, "bool key mask", torch.float32, contiguous=False)
    dense_backend.sdpa(q, k, v, attn_mask=mask).sum().backward()
    assert sdpa_calls == [(4, 4, False)]


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradients_of_gradients_with_batch(is_causal):
    """Per-graph attention (``batch=``: one batched SDPA call per size group) has gradients of
    gradients, checked against finite differences in fp64."""
    batch = shuffled_batch([1, 3, 4], seed=2)  # two size groups, one graph padded
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(8, 2, 2, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: dense_attention(q, k, v, batch=batch, is_causal=is_causal), (q, k, v))


def test_gradients_of_gradients_with_a_batch_dimension():
    """[B, L, H, C] inputs with a key mask (the padded route): gradients of gradients, against
    finite differences in fp64, and through torch.func."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 5, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    mask = torch.rand(3, 1, 5, generator=gen) < 0.7
    mask[..., 0] = True
    assert torch.autograd.gradgradcheck(lambda q, k, v: dense_attention(q, k, v, mask),
                                        (q, k, v))

    def loss(q):
        return dense_attention(q, k.detach(), v.detach(), mask).square().sum()

    def math_loss(q):
        with sdpa_kernel(SDPBackend.MATH):
            return loss(q)

    for transform in (torch.func.grad, lambda f: torch.func.grad(
            lambda q: torch.func.grad(f)(q).square().sum())):
        assert_close(transform(loss)(q.detach()), transform(math_loss)(q.detach()))


@pytest.mark.parametrize("route", ["[L, H, C]", "[B, L, H, C]", "batch="])
def test_torch_func_transforms_match_autograd(route):
    """torch.func.vjp, jacrev, hessian and per-sample gradients (vmap of grad), and
    forward-mode AD with dual tensors, run through every dense route and match autograd, as
    they do through torch's SDPA."""
    gen = torch.Generator().manual_seed(7)
    shape = (2, 5, 2, 3) if route == "[B, L, H, C]" else (5, 2, 3)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    batch = torch.tensor([1, 0, 1, 1, 0]) if route == "batch=" else None

    def f(y):
        return dense_attention(y, y.flip(-1), y, batch=batch)

    out = f(x)
    cotangent = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(out, x, cotangent)[0]
    got_out, vjp_fn = torch.func.vjp(f, x.detach())
    assert_close(got_out, out)
    assert_close(vjp_fn(cotangent)[0], want)
    jacobian = torch.func.jacrev(f)(x.detach()).reshape(out.numel(), x.numel())
    assert_close(cotangent.flatten() @ jacobian, want.flatten())
    direction = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    with fwAD.dual_level():  # forward-mode AD with a dual tensor: J t
        tangent = fwAD.unpack_dual(f(fwAD.make_dual(x.detach(), direction))).tangent
    assert_close(tangent.flatten(), jacobian @ direction.flatten())

    def loss(y):
        return f(y).square().sum()

    hessian = torch.func.hessian(loss)(x.detach())
    (g,) = torch.autograd.grad(loss(x), x, create_graph=True)
    tangent = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    (hvp,) = torch.autograd.grad(g, x, tangent)
    assert_close(hessian.reshape(x.numel(), x.numel()) @ tangent.flatten(), hvp.flatten())
    samples = torch.stack([x.detach(), 2 * x.detach()])
    per_sample = torch.func.vmap(torch.func.grad(loss))(samples)
    for sample, got in zip(samples, per_sample, strict=True):
        assert_close(got, torch.func.grad(loss)(sample))


@pytest.mark.parametrize("route", ["[L, H, C]", "[B, L, H, C]", "batch="])
def test_backward_carries_the_tangent_of_a_dual_cotangent(route):
    """Inputs without a tangent take SDPA's fused kernel; a forward-mode dual cotangent
    u + eps du flows back as J^T u + eps J^T du (the flash kernel's backward has no
    forward-mode derivative: the math path then), as through torch's SDPA on [H, L, C]."""
    gen = torch.Generator().manual_seed(7)
    shape = (2, 5, 2, 3) if route == "[B, L, H, C]" else (5, 2, 3)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    batch = torch.tensor([1, 0, 1, 1, 0]) if route == "batch=" else None
    out = dense_attention(x, x.flip(-1), x, batch=batch)
    u, du = (torch.randn(out.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    (want,) = torch.autograd.grad(out, x, du, retain_graph=True)  # J^T du
    with fwAD.dual_level():
        (got,) = torch.autograd.grad(out, x, fwAD.make_dual(u, du))
        assert_close(fwAD.unpack_dual(got).tangent, want)


def test_weights_of_float64_inputs_are_normalised_in_float64():
    """The explicit path (return_attention=True) keeps fp64 scores in fp64: its weights are a
    fp64 softmax, its output equals the SDPA path's, and gradcheck passes."""
    q, k, v = (t.detach().double().requires_grad_() for t in qkv(L=4, S=5, C=3))
    mask = torch.rand(4, 5, generator=torch.Generator().manual_seed(3)) < 0.6
    mask[1] = False
    out, weights = dense_attention(q, k, v, mask, return_attention=True)
    want_out, want_weights = explicit_attention(q, k, v, mask, 1 / math.sqrt(3))
    torch.testing.assert_close(weights, want_weights, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(out, dense_attention(q, k, v, mask), rtol=1e-12, atol=1e-14)
    assert torch.autograd.gradcheck(
        lambda q, k, v: dense_attention(q, k, v, mask, return_attention=True), (q, k, v))


def test_fp16_weights_whose_unscaled_product_overflows():
    """q . k = 102400 overflows fp16 while the score q . k / sqrt(C) = 12800 does not: the path
    that returns the weights scales before the product, as SDPA and edge_attention do."""
    q = torch.full((4, 1, 64), 40.0, dtype=torch.float16)
    k = torch.full((4, 1, 64), 40.0, dtype=torch.float16)
    k[1] *= 0.9
    v = torch.randn(4, 1, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float16)
    out, weights = dense_attention(q, k, v, return_attention=True)
    assert out.isfinite().all() and weights.isfinite().all()
    assert_close(out.float(), dense_attention(q, k, v).float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("return_attention", [False, True])
def test_mixed_float_dtypes_are_promoted(return_attention):
    """fp64 q beside fp32 k and v: computed in fp64, as edge_attention and torch's arithmetic
    would, instead of SDPA's dtype error."""
    q, k, v = qkv()
    q64 = q.detach().double()
    got = dense_attention(q64, k, v, return_attention=return_attention)
    want = dense_attention(q64, k.double(), v.double(), return_attention=return_attention)
    got, want = (got, want) if return_attention else ((got,), (want,))
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float64
        assert_close(a, b)


def test_mixed_float_dtypes_promote_past_the_dtype_of_q():
    """fp32 q and k beside an fp64 v: the result is fp64, as torch's arithmetic promotes."""
    q, k, v = qkv()
    v64 = v.detach().double()
    out = dense_attention(q, k, v64)
    assert out.dtype == torch.float64
    assert_close(out, dense_attention(q.double(), k.double(), v64))


def test_weights_path_applies_dropout_in_training_only():
    """return_attention=True with dropout: the output uses the dropped weights (no longer
    weights @ v), the weights returned are those before dropout, and eval drops nothing."""
    q, k, v = qkv()
    torch.manual_seed(0)
    out, weights = dense_attention(q, k, v, dropout_p=0.5, return_attention=True)
    undropped = torch.einsum("...hij,...jhc->...ihc", weights, v)
    assert not torch.allclose(out, undropped)
    assert_close(weights, explicit_attention(q, k, v, torch.ones(6, 6, dtype=torch.bool), 0.5)[1])
    out, weights = dense_attention(q, k, v, dropout_p=0.5, training=False, return_attention=True)
    assert_close(out, undropped)


@pytest.mark.parametrize("return_attention", [False, True], ids=["sdpa", "weights"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "mask"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["", "causal"])
def test_dropout_on_cpu_is_graphattns_mask_on_the_weights(return_attention, masked, is_causal):
    """With dropout on CPU, out = (weights * M) @ v with M graphattn's dropout_mask of the
    weights' shape [..., H, L_q, L_k] drawn from the same seed (not SDPA's bernoulli_ mask);
    gradients too, by an independent einsum."""
    from graphattn.functional import dropout_mask

    q, k, v = qkv(3, L=7, S=7, seed=4)
    mask = (torch.rand(3, 7, 7, generator=torch.Generator().manual_seed(5)) < 0.6) | torch.eye(
        7, dtype=torch.bool) if masked else None
    torch.manual_seed(11)
    result = dense_attention(q, k, v, mask, is_causal=is_causal, scale=0.6, dropout_p=0.4,
                             return_attention=return_attention)
    out = result[0] if return_attention else result
    allowed = torch.ones(3, 7, 7, dtype=torch.bool) if mask is None else mask
    if is_causal:
        allowed = allowed & torch.ones(7, 7, dtype=torch.bool).tril()
    _, weights = explicit_attention(q, k, v, allowed, 0.6)  # (3, H, L, L)
    torch.manual_seed(11)
    M = dropout_mask(weights.shape, 0.4)
    assert 0.25 < (M == 0).double().mean() < 0.55
    want = torch.einsum("...hij,...jhc->...ihc", weights * M, v)
    assert_close(out, want)
    if return_attention:
        assert_close(result[1], weights)
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(out.shape, generator=gen)
    for g, r in zip(torch.autograd.grad((out * w).sum(), (q, k, v)),
                    torch.autograd.grad((want * w).sum(), (q, k, v)), strict=True):
        assert_close(g, r)


@pytest.mark.parametrize("is_causal", [False, True], ids=["", "causal"])
def test_dropout_with_sinks_on_cpu_is_graphattns_mask_on_the_weights(is_causal):
    """With sinks too, dropout on CPU multiplies the weights [..., H, L_q, L_k] by the
    dropout_mask of their shape, whether the weights are returned or not (the sinks' padded
    SDPA drew a mask of its own shape, [H, 1 + L_q, 1 + L_k])."""
    from graphattn.functional import dropout_mask

    q, k, v = qkv(3, L=7, S=7, seed=4)
    sinks = torch.tensor([0.5, -1.0])
    results = []
    for return_attention in (False, True):
        torch.manual_seed(11)
        results.append(dense_attention(q, k, v, is_causal=is_causal, dropout_p=0.4,
                                       sinks=sinks, return_attention=return_attention))
    (out, (out_w, weights)) = results
    torch.manual_seed(11)
    M = dropout_mask(weights.shape, 0.4)
    assert_close(out, out_w)
    assert_close(out, torch.einsum("...hij,...jhc->...ihc", weights * M, v))


@pytest.mark.parametrize("return_attention", [False, True], ids=["sdpa", "weights"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_causal_keys_past_the_last_query_reach_nothing(return_attention, sinks):
    """is_causal with L_q < L_k (from the top left): the keys past the last query are read by
    none, so what they hold, NaN and inf included, reaches no output and no gradient."""
    q, k, v = qkv(L=3, S=5, seed=2)
    extra = {"sinks": torch.tensor([0.5, -1.0])} if sinks else {}
    clean = dense_attention(q, k, v, is_causal=True, return_attention=return_attention, **extra)
    k_bad, v_bad = k.detach().clone(), v.detach().clone()
    k_bad[3], v_bad[4] = float("inf"), float("nan")
    k_bad.requires_grad_(), v_bad.requires_grad_()
    got = dense_attention(q, k_bad, v_bad, is_causal=True, return_attention=return_attention,
                          **extra)
    out, out_clean = (got[0], clean[0]) if return_attention else (got, clean)
    assert_close(out, out_clean)
    if return_attention:
        assert_close(got[1], clean[1])
    grads = torch.autograd.grad(out.sum(), (q, k_bad, v_bad))
    want = torch.autograd.grad(out_clean.sum(), (q, k, v))
    for g, r in zip(grads, want, strict=True):
        assert_close(g, r)
    assert (grads[1][3:] == 0).all() and (grads[2][3:] == 0).all()


@pytest.mark.parametrize("return_attention", [False, True], ids=["sdpa", "weights"])
def test_a_nan_in_attn_bias_is_no_mask(return_attention):
    """A NaN bias makes its row NaN, as edge_attention's bias does on the same pairs; it is no
    -inf (the pair was left out, silently)."""
    q, k, v = qkv(L=3, S=3, seed=1)
    bias = torch.zeros(2, 3, 3)
    bias[0, 0, 1] = float("nan")
    result = dense_attention(q, k, v, attn_bias=bias, return_attention=return_attention)
    out = result[0] if return_attention else result
    edges = graphs.complete_graph(3)
    want = edge_attention(q, k, v, edges, bias=bias[:, edges[1], edges[0]].t())
    assert out[0, 0].isnan().all() and want[0, 0].isnan().all()
    assert_close(out[1:], want[1:])
    assert_close(out[0, 1], want[0, 1])


def test_dropout_on_cpu_is_differentiable_twice():
    """The explicit path with dropout (plain torch ops) passes gradcheck and gradgradcheck in
    fp64, the mask drawn again from the same seed at each evaluation."""
    q, k, v = (t.detach().double().requires_grad_() for t in qkv(L=5, S=5, seed=8))
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(9)) < 0.7
    mask |= torch.eye(5, dtype=torch.bool)

    def f(q, k, v):
        torch.manual_seed(12)
        return dense_attention(q, k, v, mask, dropout_p=0.3)

    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradgradcheck(f, (q, k, v))


def test_batch_dropout_on_cpu_is_each_graphs_masked_softmax_times_graphattns_mask():
    """dense_attention(batch=) with dropout on CPU: each size group's padded SDPA call draws
    graphattn's mask of its [G_b, H, n_b, n_b] weights; one graph alone is one group, so the
    mask is that of its own weights' shape."""
    from graphattn.functional import dropout_mask

    q, k, v = (t[0] for t in qkv(1, L=9, S=9, seed=10))  # (9, H, C)
    batch = torch.zeros(9, dtype=torch.long)
    torch.manual_seed(13)
    out = dense_attention(q, k, v, batch=batch, dropout_p=0.5)
    _, weights = explicit_attention(q, k, v, torch.ones(9, 9, dtype=torch.bool), 0.5)
    torch.manual_seed(13)
    M = dropout_mask((1, *weights.shape), 0.5)[0]  # (H, 9, 9)
    assert_close(out, torch.einsum("...hij,...jhc->...ihc", weights * M, v))


# graph sizes of one per size group (2^(b-1), 2^b] and more, in shuffled node order
GROUP_SIZES = [1, 2, 3, 4, 5, 8, 9, 17, 40]


def shuffled_batch(sizes, seed=0):
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return batch[torch.randperm(batch.numel(), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("sizes", [GROUP_SIZES, [6], [3, 0, 0, 5]],
                         ids=["groups", "one-graph", "ids-without-nodes"])
def test_batch_equals_edge_attention_on_the_block_diagonal_graph(sizes, is_causal):
    batch = shuffled_batch(sizes)
    N = batch.numel()
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(N, 2, 4, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(N, 2, 3, generator=gen, requires_grad=True)  # C_v != C
    edge_index = graphs.batch_complete_graph(batch)
    if is_causal:  # each node attends to the nodes of its graph with smaller or equal ids
        edge_index = edge_index[:, edge_index[0] <= edge_index[1]]
    out = dense_attention(q, k, v, batch=batch, is_causal=is_causal)
    ref = edge_attention(q, k, v, edge_index, backend="reference")
    assert_close(out, ref)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r)


def test_batch_takes_graph_ids_far_above_the_node_count():
    """The per-graph sizes came from bincount, with max id + 1 bins: ids of 10^12 asked for
    terabytes. Renumbered, they give the output of the ids 0, 1, 2."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 4, generator=gen) for _ in range(3))
    far = torch.tensor([10 ** 12, 3, 10 ** 12, 0, 3])
    near = torch.tensor([2, 1, 2, 0, 1])
    assert_close(dense_attention(q, k, v, batch=far), dense_attention(q, k, v, batch=near))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_batch_takes_unsigned_graph_ids(dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 2, 4, generator=gen) for _ in range(3))
    batch = torch.tensor([1, 0, 1, 2])
    assert_close(dense_attention(q, k, v, batch=batch.to(dtype)),
                 dense_attention(q, k, v, batch=batch))


@pytest.mark.parametrize("channels", [4, 0])
def test_batch_takes_the_given_scale_and_zero_channels(channels):
    # A scale given with batch is the one used; C = 0 scores 0 (uniform weights), not NaN
    batch = shuffled_batch([3, 5, 1])
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(9, 2, channels, generator=gen) for _ in range(2))
    v = torch.randn(9, 2, 3, generator=gen)
    edge_index = graphs.batch_complete_graph(batch)
    for scale in (None, 0.3):
        out = dense_attention(q, k, v, batch=batch, scale=scale)
        assert_close(out, edge_attention(q, k, v, edge_index, scale=scale, backend="reference"))


def test_batch_runs_one_padded_call_per_size_group(monkeypatch):
    # sizes in (2^(b-1), 2^b] share a call, padded to the largest of them
    calls = []
    sdpa = dense_backend.sdpa

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.size(0), q.size(-2)))  # (graphs, padded length) of (G, H, n, C)
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(dense_backend, "sdpa", spy)
    batch = shuffled_batch(GROUP_SIZES, seed=1)
    q = torch.randn(batch.numel(), 2, 4)
    dense_attention(q, q, q, batch=batch)
    assert sorted(calls) == [(1, 1), (1, 2), (1, 9), (1, 17), (1, 40), (2, 4), (2, 8)]


@pytest.mark.parametrize("is_causal", [False, True])
def test_batch_keeps_a_nan_in_its_own_graph(is_causal):
    """Graphs of 4 and 3 nodes share a size group, the second padded to 4; node 0, in the first,
    holds inf in its key and NaN in its value: the second graph's outputs and gradients are
    those it has alone (the padding reads zeros, not node 0)."""
    batch = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(7, 2, 4, generator=gen) for _ in range(3))
    k[0, 0, 0], v[0, 1, 2] = float("inf"), float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = dense_attention(q, k, v, batch=batch, is_causal=is_causal)
    alone = [t[4:].detach().clone().requires_grad_() for t in (q, k, v)]
    want = dense_attention(*alone, is_causal=is_causal)
    assert torch.isfinite(out[4:]).all()
    assert_close(out[4:], want)
    grads = torch.autograd.grad(out[4:].sum(), (q, k, v))
    for g, a in zip(grads, torch.autograd.grad(want.sum(), alone), strict=True):
        assert_close(g[4:], a)  # (the first graph's own gradients are NaN, 0 times NaN)


def test_batch_of_no_nodes_and_dropout():
    empty = torch.empty(0, 2, 4)
    assert dense_attention(empty, empty, empty, batch=torch.empty(0, dtype=torch.long)).shape \
        == (0, 2, 4)
    batch = shuffled_batch([3, 7])
    q = torch.randn(10, 2, 4)
    evaluated = dense_attention(q, q, q, batch=batch, dropout_p=0.5, training=False)
    assert_close(evaluated, dense_attention(q, q, q, batch=batch))
    torch.manual_seed(0)
    dropped = dense_attention(q, q, q, batch=batch, dropout_p=0.5)
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, evaluated)


def test_batch_of_no_nodes_is_differentiable():
    # an empty batch gives gradients (empty ones) like the plain path and edge_attention, so that
    # a training step's backward does not fail on it
    q, k, v = (torch.empty(0, 2, 4, requires_grad=True) for _ in range(3))
    out = dense_attention(q, k, v, batch=torch.empty(0, dtype=torch.long))
    assert out.requires_grad
    out.sum().backward()
    assert q.grad.shape == k.grad.shape == v.grad.shape == (0, 2, 4)


def test_batch_errors():
    q = torch.randn(5, 2, 4)
    batch = torch.tensor([0, 0, 1, 1, 1])
    with pytest.raises(TypeError, match="batch must be a torch.Tensor, got list"):
        dense_attention(q, q, q, batch=[0, 0, 1, 1, 1])
    with pytest.raises(TypeError, match="batch must be an integer tensor, got torch.float32"):
        dense_attention(q, q, q, batch=batch.float())
    with pytest.raises(ValueError, match=r"with batch, q, k and v must be \[N, H, C\] for the N "
                                         r"entries of batch \[N\], got q \[5, 2, 4\], k "
                                         r"\[5, 2, 4\], v \[5, 2, 4\] and batch \[4\]"):
        dense_attention(q, q, q, batch=batch[:4])
    with pytest.raises(ValueError, match=r"got q \[4, 2, 4\], k \[5, 2, 4\], v \[5, 2, 6\] "
                                         r"and batch \[5\]"):
        dense_attention(q[:4], q, torch.randn(5, 2, 6), batch=batch)
    with pytest.raises(ValueError, match=r"got q \[1, 5, 2, 4\]"):
        dense_attention(q[None], q[None], q[None], batch=batch)
    with pytest.raises(ValueError, match="mask and batch cannot be combined"):
        dense_attention(q, q, q, torch.ones(5, 5, dtype=torch.bool), batch=batch)
    with pytest.raises(ValueError, match="return_attention=True is not supported with batch"):
        dense_attention(q, q, q, batch=batch, return_attention=True)
    with pytest.raises(ValueError, match="batch must hold graph ids >= 0, got -1"):
        dense_attention(q, q, q, batch=torch.tensor([0, 0, -1, 1, 1]))
    with pytest.raises(ValueError, match="batch must hold graph ids >= 0, got -1"):
        dense_attention(q[:1], q[:1], q[:1], batch=torch.tensor([-1]))  # a batch of one


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_scores_past_fp16_range_stay_finite_on_every_path(dtype):
    """Scores of 80000 (q = k = 200, C = 4): SDPA, the weights returned and dropout's explicit
    softmax all give the fp32 result (the explicit paths once formed the scores in fp16: inf,
    then NaN)."""
    q = torch.full((4, 1, 4), 200.0)
    v = torch.randn(4, 1, 4, generator=torch.Generator().manual_seed(0))
    want = dense_attention(q, q, v)  # every score equal: the mean of v
    qh, vh = q.to(dtype), v.to(dtype)
    assert_close(dense_attention(qh, qh, vh).float(), want, atol=1e-2, rtol=1e-2)
    out, weights = dense_attention(qh, qh, vh, return_attention=True)
    assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    assert_close(weights.float(), torch.full((1, 4, 4), 0.25), atol=1e-3, rtol=0)
    torch.manual_seed(1)
    assert torch.isfinite(dense_attention(qh, qh, vh, dropout_p=0.3)).all()


@pytest.mark.parametrize("return_attention", [False, True])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("case", ["isolated node", "padded key"])
def test_what_no_output_reads_reaches_nothing(return_attention, poison, case):
    """What no output reads holds NaN or inf: the q, k and v of an isolated node (its mask row
    and column all False), or the k and v of a padded key (a batch's key mask [B, 1, L]). As
    in edge_attention, every other output and every gradient is what it is without them, and
    the unread entries get gradient 0."""
    L, H, C = 5, 2, 3
    if case == "isolated node":
        lead, unread, poisoned_inputs = (), (3,), (0, 1, 2)
        mask = torch.rand(L, L, generator=torch.Generator().manual_seed(3)) < 0.7
        mask.fill_diagonal_(True)
        mask[3], mask[:, 3] = False, False
    else:  # graph 1 of 2 padded at node 4: its query still reads the keys of graph 1
        lead, unread, poisoned_inputs = (2,), (1, 4), (1, 2)
        mask = torch.ones(2, 1, L, dtype=torch.bool)
        mask[1, 0, 4] = False
    clean = qkv(*lead, L=L, S=L, H=H, C=C)
    poisoned = [t.detach().clone() for t in clean]
    for i in poisoned_inputs:
        poisoned[i][unread] = poison
    poisoned = [t.requires_grad_() for t in poisoned]
    results = []
    for inputs in (clean, poisoned):
        out = dense_attention(*inputs, mask, return_attention=return_attention)
        out = out[0] if return_attention else out
        results.append((out, torch.autograd.grad(out.square().sum(), inputs)))
    (out, grads), (out_p, grads_p) = results
    read = torch.ones(*lead, L, dtype=torch.bool)
    read[unread] = False
    assert_close(out_p, out)  # (an isolated node's row is 0 in both)
    for i, (g, g_p) in enumerate(zip(grads, grads_p, strict=True)):
        assert torch.isfinite(g_p).all()
        if i in poisoned_inputs:
            assert_close(g_p[read], g[read])
            assert (g_p[~read] == 0).all()


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("call", ["mask", "causal", "batch", "weights"])
def test_autocast_runs_in_its_dtype_as_sdpa(requires_grad, call):
    """Under torch.autocast fp32 inputs are cast to its dtype, as autocast casts SDPA's:
    bf16 out (and weights), whether or not a gradient is needed; the same numbers as bf16
    inputs without autocast, and fp32 gradients."""
    q, k, v = (t.detach().requires_grad_(requires_grad) for t in qkv(L=6, S=6))
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(2)) < 0.6
    options = {"mask": dict(mask=mask), "causal": dict(is_causal=True),
               "batch": dict(batch=torch.tensor([0, 0, 1, 1, 1, 0])),
               "weights": dict(mask=mask, return_attention=True)}[call]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dense_attention(q, k, v, **options)
    want = dense_attention(*(t.detach().bfloat16() for t in (q, k, v)), **options)
    got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert torch.equal(g, w)
    if requires_grad:
        grads = torch.autograd.grad(got[0].float().square().sum(), (q, k, v))
        assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_a_missing_tensor_is_named():
    x = torch.randn(3, 2, 4)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got NoneType"):
        dense_attention(None, x, x)
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got NoneType"):
        dense_attention(x, x, None)


def test_batch_errors_quote_the_shapes_given():
    """A batched q beside [N, H, C] k and v: the message quotes the shapes as they came, not
    as broadcast for SDPA."""
    q, k = torch.randn(2, 4, 2, 3), torch.randn(4, 2, 3)
    with pytest.raises(ValueError, match=r"got q \[2, 4, 2, 3\], k \[4, 2, 3\], v \[4, 2, 3\]"):
        dense_attention(q, k, k, batch=torch.zeros(4, dtype=torch.long))


def test_is_causal_must_be_a_bool():
    # an int (or a tensor) would reach SDPA, whose error names none of graphattn's arguments
    from graphattn.nn import DenseSelfAttention

    q = torch.randn(5, 2, 4)
    for value in (1, "True", torch.tensor(True)):
        with pytest.raises(TypeError, match="is_causal must be a bool, got"):
            dense_attention(q, q, q, is_causal=value)
    with pytest.raises(TypeError, match="is_causal must be a bool, got 1"):
        DenseSelfAttention(8, 4)(torch.randn(5, 8), is_causal=1)


def test_training_and_return_attention_must_be_bools():
    """training="False" was read by its truth value: dropout applied where the caller asked for
    none; return_attention="no" returned a pair."""
    from graphattn.functional import dropout

    q = torch.randn(5, 2, 4)
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    for flag in ("training", "return_attention"):
        with pytest.raises(TypeError, match=rf"{flag} must be a bool, got 'False' \(a str\)"):
            dense_attention(q, q, q, **{flag: "False"})
        with pytest.raises(TypeError, match=rf"{flag} must be a bool, got None"):
            edge_attention(q, q, q, edge_index, **{flag: None})
    with pytest.raises(TypeError, match=r"training must be a bool, got 'False'"):
        dropout(q, 0.5, training="False")
    out, alpha = edge_attention(q, q, q, edge_index, training=np.bool_(False),
                                return_attention=np.bool_(True), dropout_p=0.5)
    assert torch.equal(out, edge_attention(q, q, q, edge_index, training=False))


def test_a_wider_bias_or_sinks_promotes_as_in_edge_attention():
    """fp64 sinks or attn_bias beside fp32 q, k, v: edge_attention promotes to fp64, and
    dense_attention cast them down to fp32. Both promote now; under autocast every input takes
    autocast's dtype."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 2, 4, generator=gen) for _ in range(3))
    sinks = torch.randn(2, generator=gen, dtype=torch.float64)
    bias = torch.randn(2, 5, 5, generator=gen, dtype=torch.float64)
    edge_index = graphs.complete_graph(5)
    edge_bias = bias[:, edge_index[1], edge_index[0]].t()  # (E, H): target i, source j
    for options, edge_options in ((dict(sinks=sinks), dict(sinks=sinks)),
                                  (dict(attn_bias=bias), dict(bias=edge_bias))):
        got = dense_attention(q, k, v, **options)
        want = edge_attention(q, k, v, edge_index, backend="reference", **edge_options)
        assert got.dtype == want.dtype == torch.float64
        torch.testing.assert_close(got, want)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert dense_attention(q, k, v, **{name: t.float() for name, t in
                                               options.items()}).dtype == torch.bfloat16


@pytest.mark.parametrize("scale", [-1.0, -0.01])
@pytest.mark.parametrize("sinks", [False, True])
def test_causal_attention_under_a_negative_scale(scale, sinks):
    """torch's CPU flash kernel gives NaN in causal rows under a negative scale (with a mask of
    the same pattern it does not): dense_attention(is_causal=True) and the dense backend on a
    causal graph against the formula, outputs and gradients."""
    q, k, v = qkv(L=6, S=6)
    sink = torch.tensor([0.3, -0.7]) if sinks else None
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    got = dense_attention(*leaves, is_causal=True, scale=scale, sinks=sink)
    grads = torch.autograd.grad(got.square().sum(), leaves)
    want_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = edge_attention(*want_leaves, graphs.causal_graph(6), scale=scale, sinks=sink,
                          backend="reference")
    want_grads = torch.autograd.grad(want.square().sum(), want_leaves)
    assert not got.isnan().any()
    assert_close(got, want)
    for a, b in zip(grads, want_grads, strict=True):
        assert_close(a, b)
    if not sinks:
        assert_close(got, explicit_attention(q, k, v, mask, scale)[0])
    assert_close(edge_attention(q, k, v, graphs.causal_graph(6), scale=scale, sinks=sink,
                                backend="dense"), want)
