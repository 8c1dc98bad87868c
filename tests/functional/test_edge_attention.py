import math

import numpy as np
import pytest
import torch
from conftest import (
    GRAPHS,
    assert_close,
    attention_inputs,
    check_nan_score_pattern,
    dense_mask,
    needs_triton,
    random_graph,
)

from graphattn.functional import (
    attention,
    available_backends,
    dense_attention,
    dropout_mask,
    edge_attention,
)

# Backends that run on CPU tensors here (the Triton kernels have their own interpreter tests).
CPU_BACKENDS = [b for b in available_backends() if b != "triton"]


def qkv(n_dst, n_src, H=2, C=4, dtype=torch.float32, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_dst, H, C, generator=gen, dtype=dtype)
    k = torch.randn(n_src, H, C, generator=gen, dtype=dtype)
    v = torch.randn(n_src, H, C, generator=gen, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def unique_edges(edge_index):
    return torch.unique(edge_index, dim=1)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_equals_dense_attention_with_mask(backend, seed):
    n_dst, n_src = 12, 9
    edge_index = unique_edges(random_graph(n_src, 40, seed=seed, num_dst=n_dst))
    q, k, v = qkv(n_dst, n_src, grad=True, seed=seed)
    out = edge_attention(q, k, v, edge_index, backend=backend)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))

    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    mask = dense_mask(edge_index, n_dst, n_src)
    ref = dense_attention(q2, k2, v2, mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q2, k2, v2))
    assert_close(out, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r)


def test_complete_graph_is_scaled_dot_product_attention():
    n, H, C = 7, 3, 5
    q, k, v = qkv(n, n, H, C)
    edge_index = torch.cartesian_prod(torch.arange(n), torch.arange(n)).t()
    out = edge_attention(q, k, v, edge_index)
    scores = torch.einsum("ihc,jhc->hij", q, k) / math.sqrt(C)  # (H, N, N)
    expected = torch.einsum("hij,jhc->ihc", torch.softmax(scores, dim=-1), v)
    assert_close(out, expected)


def test_bias_and_scale_enter_the_scores():
    n = 6
    q, k, v = qkv(n, n)
    edge_index = unique_edges(random_graph(n, 20, seed=3))
    bias = torch.randn(edge_index.size(1), 2)
    out, alpha = edge_attention(q, k, v, edge_index, bias=bias, scale=0.3, return_attention=True)
    mask = dense_mask(edge_index, n, n)
    dense_bias = torch.full((2, n, n), float("-inf"))
    dense_bias[:, edge_index[1], edge_index[0]] = bias.t()
    scores = 0.3 * torch.einsum("ihc,jhc->hij", q, k) + dense_bias  # (H, N, N)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    assert_close(out, torch.einsum("hij,jhc->ihc", weights, v))
    assert_close(alpha, weights[:, edge_index[1], edge_index[0]].t())
    assert mask.any()


def test_additive_score_is_gat():
    n, H, C = 6, 2, 3
    gen = torch.Generator().manual_seed(0)
    a_dst, a_src = torch.randn(n, H, generator=gen), torch.randn(n, H, generator=gen)
    v = torch.randn(n, H, C, generator=gen)
    edge_index = unique_edges(random_graph(n, 18, seed=5))
    out, alpha = edge_attention(a_dst, a_src, v, edge_index, score="additive",
                                return_attention=True)
    expected = torch.zeros(n, H, C)
    for i in range(n):
        js = edge_index[0, edge_index[1] == i]
        if js.numel() == 0:
            continue
        s = torch.nn.functional.leaky_relu(a_dst[i] + a_src[js], 0.2)  # (deg, H)
        expected[i] = torch.einsum("jh,jhc->hc", torch.softmax(s, dim=0), v[js])
    assert_close(out, expected)
    assert alpha.shape == (edge_index.size(1), H)


@pytest.mark.parametrize("score", ["dot", "additive"])
def test_gradcheck_float64(score):
    n, H, C = 5, 2, 3
    gen = torch.Generator().manual_seed(0)
    shape = (n, H, C) if score == "dot" else (n, H)
    q = torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(n, H, C, dtype=torch.float64, generator=gen, requires_grad=True)
    edge_index = torch.tensor([[0, 1, 2, 3, 1, 4, 4], [1, 1, 1, 0, 0, 2, 4]])
    bias = torch.randn(7, H, dtype=torch.float64, generator=gen, requires_grad=True)
    for backend in CPU_BACKENDS:
        assert torch.autograd.gradcheck(
            lambda q, k, v, b, be=backend: edge_attention(q, k, v, edge_index, bias=b,
                                                          score=score, backend=be),
            (q, k, v, bias))


def test_relabelling_nodes_permutes_the_output():
    n = 10
    q, k, v = qkv(n, n)
    edge_index = random_graph(n, 30, seed=7)
    out = edge_attention(q, k, v, edge_index)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n)  # new id of old node u is inv[u]
    out_p = edge_attention(q[perm], k[perm], v[perm], inv[edge_index])
    assert_close(out_p, out[perm])


def test_shuffling_the_edges_changes_nothing():
    n = 10
    q, k, v = qkv(n, n)
    edge_index = random_graph(n, 30, seed=8)
    bias = torch.randn(30, 2)
    out, alpha = edge_attention(q, k, v, edge_index, bias=bias, return_attention=True)
    order = torch.randperm(30, generator=torch.Generator().manual_seed(2))
    out_s, alpha_s = edge_attention(q, k, v, edge_index[:, order], bias=bias[order],
                                    return_attention=True)
    assert_close(out_s, out)
    assert_close(alpha_s, alpha[order])


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", GRAPHS, ids=[g.name for g in GRAPHS])
def test_registry_graphs(case, backend, index_dtype):
    q, k, v = qkv(case.num_dst, case.num_src, grad=True)
    edge_index = case.edge_index.to(index_dtype)
    out, alpha = edge_attention(q, k, v, edge_index, return_attention=True, backend=backend)
    assert out.shape == (case.num_dst, 2, 4) and alpha.shape == (edge_index.size(1), 2)
    assert torch.isfinite(out).all() and torch.isfinite(alpha).all()
    assert ((alpha >= 0) & (alpha <= 1)).all()
    dst = case.edge_index[1]
    sums = torch.zeros(case.num_dst, 2).index_add_(0, dst, alpha)
    has_in = torch.bincount(dst, minlength=case.num_dst) > 0
    assert_close(sums[has_in], torch.ones(int(has_in.sum()), 2))
    assert (out[~has_in] == 0).all()  # exactly zero for targets without in-edges
    out.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_dropout_mask_drops_weights_and_is_off_in_eval():
    n = 40
    q, k, v = qkv(n, n)
    edge_index = torch.cartesian_prod(torch.arange(n), torch.arange(n)).t()
    ones = torch.ones(n, 2, 4)
    plain = edge_attention(q, k, ones, edge_index)
    assert_close(plain, ones)  # weights sum to 1
    assert_close(edge_attention(q, k, ones, edge_index, dropout_p=0.5, training=False), ones)
    torch.manual_seed(0)
    dropped = edge_attention(q, k, ones, edge_index, dropout_p=0.5)
    torch.manual_seed(0)
    again = edge_attention(q, k, ones, edge_index, dropout_p=0.5)
    assert torch.equal(dropped, again)
    assert not torch.allclose(dropped, ones)
    # Inverted dropout keeps the expectation: the mean row sum stays near 1.
    assert abs(dropped.mean().item() - 1.0) < 0.1


def test_errors_name_the_argument_and_value():
    q, k, v = qkv(4, 4)
    good = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"edge_index must have shape \[2, E\], got \[3, 2\]"):
        edge_attention(q, k, v, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="edge_index must have an integer dtype.*torch.float32"):
        edge_attention(q, k, v, good.float())
    with pytest.raises(ValueError, match="edge_index must hold node ids >= 0, got a minimum of -1"):
        edge_attention(q, k, v, torch.tensor([[0, -1], [1, 2]]))
    with pytest.raises(ValueError, match=r"edge_index\[0\].*< the number of source nodes 4.*5"):
        edge_attention(q, k, v, torch.tensor([[5, 1], [1, 2]]))
    with pytest.raises(ValueError, match=r"edge_index\[1\].*< the number of target nodes 4.*4"):
        edge_attention(q, k, v, torch.tensor([[0, 1], [4, 2]]))
    q3, k5, v5 = qkv(3, 5)  # sources are bounded by k and v, targets by q
    edge_attention(q3, k5, v5, torch.tensor([[4], [2]]), backend="reference")
    with pytest.raises(ValueError, match=r"edge_index\[1\].*< the number of target nodes 3.*3"):
        edge_attention(q3, k5, v5, torch.tensor([[4], [3]]), backend="reference")
    with pytest.raises(ValueError, match=r"q must have shape \[N, H, C\].*got \[4, 8\]"):
        edge_attention(q.flatten(1), k, v, good)
    with pytest.raises(ValueError, match=r"bias must have shape \[E, H\] = \[2, 2\], got \[2\]"):
        edge_attention(q, k, v, good, bias=torch.zeros(2))
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\), got 1.0"):
        edge_attention(q, k, v, good, dropout_p=1.0)
    with pytest.raises(ValueError, match="backend must be 'auto' or one of .* got 'magic'"):
        edge_attention(q, k, v, good, backend="magic")
    with pytest.raises(ValueError, match="score must be one of"):
        edge_attention(q, k, v, good, score="cosine")
    with pytest.raises(ValueError, match="all inputs must be on one device.*meta"):
        edge_attention(q, k, v, good.to("meta"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_wrong_dtypes_and_non_tensors_are_named(backend):
    q, k, v = qkv(4, 4)
    good = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(TypeError, match="q must have a floating-point dtype, got torch.int64"):
        edge_attention(q.long(), k.long(), v.long(), good, backend=backend)
    with pytest.raises(TypeError, match="v must have a floating-point dtype, got torch.int64"):
        edge_attention(q, k, v.long(), good, backend=backend)
    with pytest.raises(TypeError, match="bias must have a floating-point dtype, got torch.int64"):
        edge_attention(q, k, v, good, bias=torch.zeros(2, 2, dtype=torch.long), backend=backend)
    with pytest.raises(TypeError, match="att must have a floating-point dtype, got torch.int64"):
        edge_attention(q, k, v, good, score="gatv2", att=torch.zeros(2, 4, dtype=torch.long),
                       backend=backend)
    with pytest.raises(ValueError, match="scale must be a finite number, got inf"):
        edge_attention(q, k, v, good, scale=float("inf"), backend=backend)
    with pytest.raises(TypeError, match="edge_index must be a torch.Tensor, got list"):
        edge_attention(q, k, v, good.tolist(), backend=backend)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got ndarray"):
        edge_attention(q.numpy(), k, v, good, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_scale_and_slope_past_the_scores_dtype_are_refused(backend):
    """scale=1e39 is a finite float but inf in fp32: the scores were NaN, on some targets for
    one backend and on all for another. float64 inputs score in float64 and take it."""
    q, k, v = qkv(4, 4)
    good = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"scale must be finite in torch.float32, .* 1e\+39"):
        edge_attention(q, k, v, good, scale=1e39, backend=backend)
    with pytest.raises(ValueError, match=r"scale must be finite in torch.float32"):
        edge_attention(q.half(), k.half(), v.half(), good, scale=-1e39, backend=backend)
    with pytest.raises(ValueError, match=r"negative_slope must be finite in torch.float32"):
        edge_attention(q, k, v, good, score="gatv2", att=torch.ones(2, 4),
                       negative_slope=1e39, backend=backend)
    with pytest.raises(ValueError, match=r"scale must be finite in torch.float32"):
        dense_attention(q, k, v, scale=1e39)
    out = edge_attention(q.double(), k.double(), v.double(), good, scale=1e39, backend=backend)
    assert out.dtype == torch.float64


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_scale_and_slope_take_numpy_and_tensor_scalars(backend):
    """numpy scalars and one-element tensors without grad act as the float they hold; a tensor
    scale that requires grad is refused, since its gradient would be lost."""
    q, k, v = qkv(4, 4)
    ei = torch.tensor([[0, 1, 2, 3, 1], [1, 2, 3, 0, 0]])
    want = edge_attention(q, k, v, ei, scale=0.7, negative_slope=0.1, score="gatv2",
                          att=torch.ones(2, 4), backend=backend)
    for scale, slope in ((np.float32(0.7), np.float32(0.1)),
                         (torch.tensor(0.7), torch.tensor([0.1]))):
        got = edge_attention(q, k, v, ei, scale=scale, negative_slope=slope, score="gatv2",
                             att=torch.ones(2, 4), backend=backend)
        assert_close(got, want)
    with pytest.raises(TypeError, match="scale must be a number, got a tensor that requires"):
        edge_attention(q, k, v, ei, scale=torch.tensor(0.7, requires_grad=True),
                       backend=backend)
    with pytest.raises(ValueError, match=r"scale must be a finite number, got a tensor of "
                                         r"shape \[2\]"):
        edge_attention(q, k, v, ei, scale=torch.ones(2), backend=backend)
    with pytest.raises(ValueError, match=r"scale must be a finite number, got a tensor of "
                                         r"shape \[0\]"):
        edge_attention(q, k, v, ei, scale=torch.ones(0), backend=backend)


@pytest.mark.parametrize("return_attention", [False, True])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fp16_scores_whose_unscaled_product_overflows(backend, return_attention):
    """q . k = 102400 and 99840 overflow fp16 (max 65504); the scaled scores 12800 and 12480
    do not, and put all the weight on the first edge, as in fp64."""
    C = 64
    q = torch.full((1, 1, C), 40.0)
    k = torch.stack([torch.full((1, C), 40.0), torch.full((1, C), 39.0)])
    v = torch.randn(2, 1, C, generator=torch.Generator().manual_seed(0))
    ei = torch.tensor([[0, 1], [0, 0]])
    want = v[0:1].double()  # alpha = softmax([12800, 12480]) = [1, 0] in fp64
    result = edge_attention(q.half(), k.half(), v.half(), ei, backend=backend,
                            return_attention=return_attention)
    out = result[0] if return_attention else result
    assert_close(out, want.half())
    if return_attention:
        assert_close(result[1], torch.tensor([[1.0], [0.0]], dtype=torch.float16))


@pytest.mark.parametrize("score", ["dot", "gatv2"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mixed_float_dtypes_are_promoted(backend, score):
    """float64 q, bias and att beside float32 k and v, and one float32 tensor as both edge
    terms: every backend computes in float64, as torch's promotion would, and agrees with the
    all-float64 reference, gradients included. (3 channels, a bias, alpha in the loss: the
    cpu kernels of test_edge_terms.py's one-tensor test, already compiled.)"""
    q, k, v = qkv(5, 5, C=3, seed=3, grad=True)
    ei = torch.tensor([[0, 1, 2, 3, 4, 0, 2], [1, 2, 3, 4, 0, 0, 0]])
    gen = torch.Generator().manual_seed(4)
    bias = torch.randn(7, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    term = torch.randn(7, 2, 3, generator=gen, requires_grad=True)
    att = (torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
           if score == "gatv2" else None)
    q64 = q.detach().double().requires_grad_()
    results = []
    for args in ((q64, k, v, term), (q64, k.double(), v.double(), term.double())):
        out, alpha = edge_attention(*args[:3], ei, bias=bias, att=att, score=score,
                                    edge_key=args[3], edge_value=args[3], return_attention=True,
                                    backend=backend if args[1] is k else "reference")
        leaves = [q64, k, v, bias, term] + ([att] if att is not None else [])
        results.append((out, alpha, *torch.autograd.grad(out.sum() + alpha.square().sum(),
                                                          leaves)))
    got, want = results
    assert got[0].dtype == got[1].dtype == torch.float64
    for a, b in zip(got, want, strict=True):
        assert_close(a, b.to(a.dtype))


@pytest.mark.parametrize("weights", [False, True], ids=["plain", "dropout+weights"])
@pytest.mark.parametrize(("n_dst", "n_src"), [(3, 0), (0, 3), (0, 0)])
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_no_source_or_target_nodes_gives_zero_output_and_gradients(backend, score, n_dst,
                                                                     n_src, weights):
    """N_src = 0 (a bipartite graph whose source side is empty, or a layer's edges-as-sources
    graph without edges) or N_dst = 0: every target gets 0, weights and gradients are empty or
    zero, the bias's ``[0, H]`` included. With and without dropout and returned weights (the
    dense backend's SDPA route and its explicit one)."""
    gen = torch.Generator().manual_seed(0)
    qk_shape = (2,) if score == "additive" else (2, 4)
    q = torch.randn(n_dst, *qk_shape, generator=gen).requires_grad_()
    k = torch.randn(n_src, *qk_shape, generator=gen).requires_grad_()
    v = torch.randn(n_src, 2, 4, generator=gen).requires_grad_()
    att = torch.randn(2, 4, generator=gen).requires_grad_() if score == "gatv2" else None
    bias = torch.zeros(0, 2, requires_grad=True)
    no_edges = torch.empty(2, 0, dtype=torch.long)
    out, alpha = edge_attention(q, k, v, no_edges, bias=bias, backend=backend, score=score,
                                att=att, dropout_p=0.5,
                                return_attention=True) if weights else (
        edge_attention(q, k, v, no_edges, bias=bias, backend=backend, score=score, att=att),
        torch.zeros(0, 2))
    assert out.shape == (n_dst, 2, 4) and (out == 0).all()
    assert alpha.shape == (0, 2)
    (out.sum() + alpha.sum()).backward()
    for t in (q, k, v, bias) + ((att,) if att is not None else ()):
        assert t.grad.shape == t.shape and (t.grad == 0).all()


@pytest.mark.parametrize("return_attention", [False, True])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_output_is_contiguous_on_every_backend(backend, return_attention):
    """``out`` ``[N_dst, H, C]`` and ``alpha`` ``[E, H]`` come contiguous from every backend
    (the dense one computes ``[H, N_dst, C]``), so that ``out.view(N_dst, H * C)`` works."""
    n = 10
    edge_index = unique_edges(random_graph(n, 60, seed=4))
    q, k, v = qkv(n, n, H=3, C=5, grad=True)
    result = edge_attention(q, k, v, edge_index, backend=backend,
                            return_attention=return_attention)
    out, alpha = result if return_attention else (result, None)
    assert out.is_contiguous()
    assert out.view(n, 3 * 5).shape == (n, 15)
    assert alpha is None or alpha.is_contiguous()


@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_no_heads_gives_empty_output_and_gradients(backend, score):
    """H = 0 (like C = 0 or N = 0): empty results and gradients, on a graph with edges."""
    gen = torch.Generator().manual_seed(0)
    qk_shape = (0,) if score == "additive" else (0, 4)
    q = torch.randn(4, *qk_shape, generator=gen).requires_grad_()
    k = torch.randn(3, *qk_shape, generator=gen).requires_grad_()
    v = torch.randn(3, 0, 4, generator=gen).requires_grad_()
    att = torch.randn(0, 4, generator=gen) if score == "gatv2" else None
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 3]])
    out, alpha = edge_attention(q, k, v, edge_index, bias=torch.zeros(3, 0), backend=backend,
                                score=score, att=att, return_attention=True)
    assert out.shape == (4, 0, 4) and alpha.shape == (3, 0)
    grads = torch.autograd.grad(out.sum() + alpha.sum(), (q, k, v), allow_unused=True)
    for t, g in zip((q, k, v), grads, strict=True):
        assert g is None or g.shape == t.shape


@pytest.mark.parametrize(("heads", "value_channels"), [(0, 4), (2, 0)])
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_outputs_give_every_input_a_zero_gradient(backend, score, heads,
                                                        value_channels):
    """No heads, or no value channels: the output alone is empty or 0, and every input (the
    bias included) has a zero gradient of its shape, without ``allow_unused``. The dense path
    once left the bias out of the autograd graph when H = 0."""
    gen = torch.Generator().manual_seed(0)
    qk_shape = (heads,) if score == "additive" else (heads, 3)
    edge_index = torch.tensor([[0, 1, 2, 0], [1, 2, 0, 0]])
    inputs = [torch.randn(3, *qk_shape, generator=gen), torch.randn(3, *qk_shape, generator=gen),
              torch.randn(3, heads, value_channels, generator=gen),
              torch.randn(4, heads, generator=gen)]
    if score == "gatv2":
        inputs.append(torch.randn(heads, 3, generator=gen))
    q, k, v, bias, *att = [t.requires_grad_() for t in inputs]
    out = edge_attention(q, k, v, edge_index, bias=bias, backend=backend, score=score,
                         att=att[0] if att else None)
    assert out.shape == (3, heads, value_channels)
    for t, g in zip(inputs, torch.autograd.grad(out.sum(), inputs), strict=True):
        assert g.shape == t.shape and (g == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("score", ["dot", "gatv2", "additive"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_half_precision_scores_past_fp16_range_stay_finite(backend, score, dtype):
    """Scores of 80000, past fp16's 65504 (q = k = 200, C = 4; additive: q = k = 40000, one
    channel): formed in fp32, as the fused
    kernels form them, every path gives the fp32 result, in the inputs' dtype; once the
    reference and the dense backend's explicit softmax formed them in fp16 and gave NaN. With
    the weights returned and with dropout (the paths that need the weights themselves), on a
    graph with a repeated edge."""
    gen = torch.Generator().manual_seed(0)
    q = torch.full((4, 1), 40000.0) if score == "additive" else torch.full((4, 1, 4), 200.0)
    v = torch.randn(4, 1, 4, generator=gen)
    att = torch.full((1, 4), 100.0) if score == "gatv2" else None
    edge_index = torch.tensor([[0, 1, 2, 3, 1, 2], [0, 0, 1, 2, 3, 1]])  # 2 -> 1 twice
    want, want_alpha = edge_attention(q, q, v, edge_index, score=score, att=att,
                                      backend="reference", return_attention=True)
    half = [t.to(dtype) for t in (q, v)] + [None if att is None else att.to(dtype)]
    out, alpha = edge_attention(half[0], half[0], half[1], edge_index, score=score,
                                att=half[2], backend=backend, return_attention=True)
    assert out.dtype == alpha.dtype == dtype
    assert_close(out.float(), want, atol=1e-2, rtol=1e-2)
    assert_close(alpha.float(), want_alpha, atol=1e-2, rtol=1e-2)
    torch.manual_seed(1)
    dropped = edge_attention(half[0], half[0], half[1], edge_index, score=score, att=half[2],
                             backend=backend, dropout_p=0.3)
    assert torch.isfinite(dropped).all()


@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min, 1e30])
@pytest.mark.parametrize("score", ["dot", "additive"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_huge_biases_on_every_in_edge_give_the_reference_weights_and_gradients(backend, score,
                                                                               fill):
    """A bias of -1e9 or finfo.min on every in-edge of target 0 (the masking idiom), or tied
    scores of 1e30: in fp32 its scores are all equal, so its weights are 1/4 each. Backward must
    recompute them from statistics that keep log(degree) next to a maximum of 1e9 or more (a
    log-sum-exp in one fp32 number rounds it away: weights of 1, gradients 4x too large), and
    the dense path must keep the edge doubled in that row counted twice. Target 0's query is 0,
    so that its fp32 scores are equal on every path (the dense path adds q . k to a bias taken
    relative to the row, and keeps what the others round away next to 1e9)."""
    ei = torch.tensor([[0, 1, 1, 2, 0, 2, 1], [0, 0, 0, 0, 1, 1, 2]])  # 1 -> 0 twice
    q, k, v = qkv(3, 3, seed=5)
    q[0] = 0.0
    if score == "additive":
        q, k = q[..., 0], k[..., 0]  # (N, H)
    bias = torch.zeros(7, 2)
    bias[:4] = fill
    grads, results = {}, {}
    for name in ("reference", backend):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        out, alpha = edge_attention(*leaves[:3], ei, bias=leaves[3], score=score,
                                    return_attention=True, backend=name)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        results[name] = (out, alpha)
        grads[name] = torch.autograd.grad((out * weights).sum() + alpha.square().sum(), leaves)
    assert_close(results[backend][1][:4], torch.full((4, 2), 0.25))
    for got, want in zip(results[backend] + grads[backend],
                         results["reference"] + grads["reference"], strict=True):
        assert_close(got, want)



@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "+inf"])
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nan_or_plus_inf_score_makes_its_target_nan_in_that_head(backend, score, value):
    # The dense backend's gradients span every pair of its matrices, so NaN also reaches the
    # k, v of nodes off the target's row there: its gradients are not compared.
    check_nan_score_pattern(backend, score, value, grads=backend != "dense")


@pytest.mark.parametrize("backend", ["reference", "dense"])
def test_mixed_float_dtypes_promote_past_the_dtype_of_q(backend):
    """float32 q, k and v beside a float64 bias: the bias, not q, has the widest dtype, and the
    result is float64, equal to the all-float64 reference."""
    q, k, v = qkv(5, 5, C=3, seed=3)
    ei = torch.tensor([[0, 1, 2, 3, 4, 0, 2], [1, 2, 3, 4, 0, 0, 0]])
    bias = torch.randn(7, 2, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out, alpha = edge_attention(q, k, v, ei, bias=bias, return_attention=True, backend=backend)
    want, want_alpha = edge_attention(q.double(), k.double(), v.double(), ei, bias=bias,
                                      return_attention=True, backend="reference")
    assert out.dtype == alpha.dtype == torch.float64
    assert_close(out, want)
    assert_close(alpha, want_alpha)


def test_shape_errors_of_q_k_and_v_name_the_argument():
    q, k, v = qkv(4, 4)
    good = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match=r"v must have shape \[N_src, H, C\], got \[4, 8\]"):
        edge_attention(q, k, v.flatten(1), good)
    three = torch.cat([q, q[:, :1]], dim=1)  # 3 heads beside v's 2
    with pytest.raises(ValueError, match=r"k must have the heads of v, 2, got k \[4, 3"):
        edge_attention(q, three, v, good)
    with pytest.raises(ValueError, match=r"q must have the heads H of k and v, 2, or a "
                                         r"multiple of them .*got q \[4, 3"):
        edge_attention(three, k, v, good)
    with pytest.raises(ValueError, match=r"k and v must have the same number of source nodes"):
        edge_attention(q, k[:3], v, good)
    with pytest.raises(ValueError, match=r"q and k must have the same channels C"):
        edge_attention(q[..., :3], k, v, good)

def test_one_tensor_as_both_edge_terms_stays_one_tensor_when_cast():
    """_common_dtype (promotion) and _autocast_inputs (autocast's dtype) cast a float32 tensor
    given as edge_key and edge_value once, not twice."""
    term = torch.randn(5, 2, 4)
    cast = attention._common_dtype(torch.randn(3, 2, 4, dtype=torch.float64), term, term)
    assert cast[1].dtype == torch.float64 and cast[1] is cast[2]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = attention._autocast_inputs(torch.randn(3, 2, 4), term, term)
    assert cast[1].dtype == torch.bfloat16 and cast[1] is cast[2]


@pytest.mark.parametrize("channels", [1, 4, 9])
def test_default_dot_scale_is_one_over_the_root_of_the_channels(channels):
    """The default scale of the dot score is 1 / sqrt(C), at C = 1 too (1)."""
    ei = random_graph(6, 20, seed=4)
    q, k, v = (torch.randn(6, 2, channels, generator=torch.Generator().manual_seed(s))
               for s in range(3))
    assert_close(edge_attention(q, k, v, ei, backend="reference"),
                 edge_attention(q, k, v, ei, scale=channels ** -0.5, backend="reference"))
    assert not torch.allclose(edge_attention(q, k, v, ei, backend="reference"),
                              edge_attention(q, k, v, ei, scale=1.1 * channels ** -0.5,
                                             backend="reference"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_autocast_runs_in_its_dtype_on_every_backend(backend, score, requires_grad):
    """Under torch.autocast fp32 inputs (gatv2's att and the bias too) are cast to its dtype,
    as autocast casts SDPA's, and nothing inside is autocast again: every backend returns
    the output and weights of bf16 inputs without autocast, bit for bit, whether or not a
    gradient is needed, with fp32 gradients."""
    edge_index = random_graph(12, 50, seed=5)
    inputs = {name: None if t is None else t.detach().requires_grad_(requires_grad)
              for name, t in attention_inputs(12, 12, 50, 2, 8, score=score).items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = edge_attention(**inputs, edge_index=edge_index, score=score, backend=backend,
                             return_attention=True)
    half = {name: None if t is None else t.detach().bfloat16() for name, t in inputs.items()}
    want = edge_attention(**half, edge_index=edge_index, score=score, backend=backend,
                          return_attention=True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert torch.equal(g, w)
    if requires_grad:
        leaves = [t for t in inputs.values() if t is not None]
        grads = torch.autograd.grad(got[0].float().square().sum(), leaves)
        assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


def test_autocast_leaves_float64_inputs_in_float64():
    """Autocast leaves float64 alone, as it does for SDPA: float64 inputs under autocast give
    the float64 result of the call without it."""
    edge_index = random_graph(6, 20, seed=4)
    q, k, v = qkv(6, 6, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = edge_attention(q, k, v, edge_index, backend="reference")
    assert out.dtype == torch.float64
    assert torch.equal(out, edge_attention(q, k, v, edge_index, backend="reference"))


def test_autocast_casts_to_the_dtype_it_was_given():
    """fp16 autocast on CPU gives fp16 inputs, not a fixed half dtype."""
    q, k, v = qkv(6, 6)
    with torch.autocast("cpu", dtype=torch.float16):
        out = edge_attention(q, k, v, random_graph(6, 20, seed=4), backend="reference")
    assert out.dtype == torch.float16


@pytest.mark.parametrize("missing", ["q", "k", "v", "edge_index"])
def test_a_missing_tensor_is_named(missing):
    """``None`` (or a list) where a tensor is required is named, not met by an
    AttributeError from inside."""
    x = torch.randn(3, 2, 4)
    args = {"q": x, "k": x, "v": x, "edge_index": torch.tensor([[0, 1], [1, 2]])}
    args[missing] = None
    with pytest.raises(TypeError, match=f"{missing} must be a torch.Tensor, got NoneType"):
        edge_attention(*args.values())
    args[missing] = [1, 2]
    with pytest.raises(TypeError, match=f"{missing} must be a torch.Tensor, got list"):
        edge_attention(*args.values())


def test_a_backend_that_is_not_a_name_is_refused_by_name():
    x = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match=r"backend must be 'auto' or one of .*got \['cpu'\]"):
        edge_attention(x, x, x, torch.tensor([[0, 1], [1, 2]]), backend=["cpu"])


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-inputs", "autocast"])
def test_edge_weight_multiplies_the_weights_in_the_dtype_of_v(autocast):
    """An fp32 explanation mask (``edge_weight``) beside bf16 inputs, or beside fp32 inputs
    under autocast (which casts them to bf16), gives the bf16 output of a bf16 mask."""
    from graphattn.functional.attention import edge_attention_unchecked

    def call(q, k, v, edge_weight):
        return edge_attention_unchecked(q, k, v, edge_index, scale=None, bias=None,
                                        dropout_p=0.0, training=False, return_attention=False,
                                        backend="auto", score="dot", edge_weight=edge_weight)

    edge_index = random_graph(9, 30, seed=4)
    q, k, v = qkv(9, 9)
    edge_weight = torch.rand(30, generator=torch.Generator().manual_seed(1))
    half = [t.bfloat16() for t in (q, k, v)]
    want = call(*half, edge_weight.bfloat16())
    if autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = call(q, k, v, edge_weight)
    else:
        got = call(*half, edge_weight)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_edge_weight_multiplies_the_dropped_weights_in_training():
    """An explanation mask (``edge_weight``) in training with dropout: each edge's weight is
    alpha times its dropout mask times its edge weight, the mask drawn as without it."""
    from graphattn.functional.attention import edge_attention_unchecked
    from graphattn.functional.reference import reference_edge_attention

    torch.manual_seed(0)
    N, E, H, C = 9, 30, 2, 4
    q, k, v = (torch.randn(N, H, C) for _ in range(3))
    edge_index = torch.randint(0, N, (2, E))
    edge_weight = torch.rand(E)
    torch.manual_seed(1)
    out = edge_attention_unchecked(q, k, v, edge_index, scale=None, bias=None, dropout_p=0.5,
                                   training=True, return_attention=False, backend="auto",
                                   score="dot", edge_weight=edge_weight)
    torch.manual_seed(1)
    mask = dropout_mask((E, H), 0.5)
    expected, _ = reference_edge_attention(q, k, v, edge_index, scale=C ** -0.5, bias=None,
                                           dropout_mask=mask * edge_weight[:, None],
                                           score="dot", negative_slope=0.2, need_alpha=False)
    assert_close(out, expected)


@pytest.mark.parametrize("backend", ["reference", "dense"])
@pytest.mark.parametrize("score", attention.SCORES)
def test_gradients_repeat_bit_for_bit_with_two_threads(backend, score):
    """The reference and dense backends gather with index_select: on a CPU with several
    threads the backward of ``x[index]`` sums in an order that changes from run to run (the
    weights of every edge of a node), index_select's does not. (The cpu backend's kernels
    have no atomics; the seeded dropout mask is the same every run.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(0)
        N, E, H, C = 3000, 30000, 2, 16
        edge_index = torch.randint(0, N, (2, E), generator=gen)
        qk_shape = (N, H) if score == "additive" else (N, H, C)
        inputs = [torch.randn(qk_shape, generator=gen), torch.randn(qk_shape, generator=gen),
                  torch.randn(N, H, C, generator=gen)]
        att = torch.randn(H, C, generator=gen) if score == "gatv2" else None
        grad_out = torch.randn(N, H, C, generator=gen)
        grads = []
        for _ in range(3):
            leaves = [t.clone().requires_grad_() for t in inputs]
            torch.manual_seed(1)
            out = edge_attention(*leaves, edge_index, backend=backend, score=score, att=att,
                                 dropout_p=0.5)
            out.backward(grad_out)
            grads.append([t.grad for t in leaves])
        for again in grads[1:]:
            for got, want in zip(again, grads[0], strict=True):
                assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_in_place_edit_of_the_output_before_backward(backend):
    # documented: the fused cpu kernels keep the output for backward (as SDPA does), so an
    # in-place edit is caught; the reference and dense paths do not keep it. A copy is right
    # everywhere.
    edge_index = random_graph(12, 50, seed=3)
    q, k, v = (torch.randn(12, 2, 4, requires_grad=True) for _ in range(3))
    out = edge_attention(q, k, v, edge_index, backend=backend)
    if backend == "cpu":
        out.relu_()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    expected = torch.autograd.grad(
        edge_attention(q, k, v, edge_index, backend="reference").relu().sum(), (q, k, v))
    got = torch.autograd.grad(edge_attention(q, k, v, edge_index, backend=backend).relu().sum(),
                              (q, k, v))
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("name", ["q", "k", "v", "bias", "sinks"])
def test_sparse_features_are_refused_by_name(name):
    """A sparse q, k, v or optional input reached a raw error deep inside each backend
    (NotImplementedError, "unsupported memory format"); it is refused by name and layout, by
    edge_attention and dense_attention alike."""
    from graphattn.functional import dense_attention

    q, k, v = torch.randn(3, 4, 2, 3).unbind(0)
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 3]])
    inputs = dict(q=q, k=k, v=v, bias=torch.randn(3, 2), sinks=torch.randn(2))
    inputs[name] = inputs[name].to_sparse()
    match = rf"{name} must be a dense \(strided\) tensor, got layout torch.sparse_coo"
    for backend in ("reference", "cpu", "dense", "auto"):
        with pytest.raises(TypeError, match=match):
            edge_attention(**inputs, edge_index=edge_index, backend=backend)
    if name != "bias":
        with pytest.raises(TypeError, match=match):
            dense_attention(**{key: inputs[key] for key in ("q", "k", "v", "sinks")})


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("backend", [*CPU_BACKENDS, pytest.param("triton", marks=needs_triton)])
def test_a_graph_and_features_made_under_inference_mode_train(request, backend, index_dtype):
    """A graph or frozen features made under ``torch.inference_mode`` (in preprocessing), then
    used in a training step: the ``reference`` and ``triton`` paths saved the int64 edge_index
    for backward, the ``cpu`` and ``triton`` kernels q, k and v (a learnable bias's and the
    sinks' gradients need them), and autograd refuses to save an inference tensor. Whether
    training failed hung on the backend, and so on the graph's density under ``"auto"``."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    graph = random_graph(9, 30, seed=2).to(index_dtype)
    q, k, v = qkv(9, 9)
    bias = torch.randn(30, 2, requires_grad=True)
    sinks = torch.randn(2, requires_grad=True)
    with torch.inference_mode():
        frozen = [t.clone() for t in (graph, q, k, v)]
    assert all(t.is_inference() for t in frozen)
    results = []
    for edge_index, *features in ((graph, q, k, v), frozen):
        out = edge_attention(*features, edge_index, bias=bias, sinks=sinks, backend=backend)
        results.append([out, *torch.autograd.grad(out.square().sum(), (bias, sinks))])
        query = features[0].clone().requires_grad_()  # a grad for q, the graph frozen or not
        out = edge_attention(query, *features[1:], edge_index, backend=backend)
        results[-1] += [out, torch.autograd.grad(out.square().sum(), query)[0]]
    for got, want in zip(*results, strict=True):
        assert_close(got, want)



@pytest.mark.parametrize("backend", [*CPU_BACKENDS, "auto"])
def test_vmap_over_edge_index_names_it_and_the_ways_to_batch(backend):
    """torch.func.vmap over a batch of graphs failed inside the node-id check with torch's
    "calling .item()" error; it now says that edge_index is batched and how to batch graphs.
    vmap over the features of one graph works (compared with a loop)."""
    q, k, v = torch.randn(3, 3, 7, 2, 4).unbind(0)
    edge_index = random_graph(7, 12, seed=0)
    graphs = torch.stack([edge_index, edge_index.flip(0), edge_index])

    def attend(q, k, v, edge_index):
        return edge_attention(q, k, v, edge_index, backend=backend)

    with pytest.raises(ValueError, match=r"edge_index is batched by torch.func.vmap.*"
                                         r"graphattn.graphs.repeat_graph"):
        torch.func.vmap(attend)(q, k, v, graphs)
    assert_close(torch.func.vmap(attend, in_dims=(0, 0, 0, None))(q, k, v, edge_index),
                 torch.stack([attend(*inputs, edge_index) for inputs in zip(q, k, v, strict=True)]))
