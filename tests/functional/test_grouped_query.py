"""dense_attention and edge_attention with grouped keys and values (H_kv heads serving H query
heads)."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close

from graphattn import graphs
from graphattn.functional import dense_attention, dense_backend, edge_attention
from graphattn.nn import DenseSelfAttention, GraphSelfAttention

H, H_KV, C = 6, 2, 8  # each key and value head serves 3 query heads


def grouped_qkv(*lead, L=7, S=7, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, L, H, C, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(*lead, S, H_KV, C, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(*lead, S, H_KV, C, generator=gen).to(dtype).requires_grad_()
    return q, k, v


def einsum_attention(q, k, v, mask, scale):
    """Independent reference: query head h reads key and value head h // (H / H_kv)."""
    group = q.size(-2) // k.size(-2)
    heads = torch.arange(q.size(-2)) // group  # (H,): the kv head of each query head
    k, v = k[..., heads, :], v[..., heads, :]  # (..., S, H, C)
    scores = torch.einsum("...ihc,...jhc->...hij", q, k) * scale
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("...hij,...jhc->...ihc", weights, v)


CASES = {
    "none": lambda S, gen: {},
    "is_causal": lambda S, gen: {"is_causal": True},
    "mask": lambda S, gen: {"mask": torch.rand(7, S, generator=gen) < 0.6},
    "key mask": lambda S, gen: {"mask": torch.rand(2, 1, S, generator=gen) < 0.6},
    "weights": lambda S, gen: {"return_attention": True},
    "sinks": lambda S, gen: {"sinks": torch.randn(H, generator=gen)},
    "softcap": lambda S, gen: {"softcap": 2.0},
    "attn_bias": lambda S, gen: {"attn_bias": torch.randn(2, H, 7, S, generator=gen)},
    "dropout": lambda S, gen: {"dropout_p": 0.3},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_keys_equal_keys_repeated_per_query_head(case, dtype):
    """Every path of dense_attention gives with k, v of H_kv heads what it gives with each kv
    head repeated for its H / H_kv query heads: output, weights, and the gradients of q, k and
    v (those of the repeated k and v summed over each group, as autograd sums them)."""
    S = 7 if case == "is_causal" else 9
    q, k, v = grouped_qkv(2, S=S, dtype=dtype)
    options = CASES[case](S, torch.Generator().manual_seed(1))
    if "sinks" in options:
        options["sinks"] = options["sinks"].to(dtype)
    if "attn_bias" in options:
        options["attn_bias"] = options["attn_bias"].to(dtype)
    group = H // H_KV
    torch.manual_seed(2)
    got = dense_attention(q, k, v, **options)
    torch.manual_seed(2)  # the same dropout draw
    want = dense_attention(q, k.repeat_interleave(group, dim=-2),
                           v.repeat_interleave(group, dim=-2), **options)
    if case == "weights":
        assert_close(got[1], want[1])
        got, want = got[0], want[0]
    grad = torch.randn_like(got)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    assert_close(got, want, **tol)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), grad),
                    torch.autograd.grad(want, (q, k, v), grad), strict=True):
        assert_close(a, b, **tol)


@pytest.mark.parametrize("mask_kind", ["none", "mask", "is_causal"])
def test_grouped_keys_against_an_independent_reference(mask_kind):
    q, k, v = grouped_qkv(3, dtype=torch.float64)
    mask = torch.ones(7, 7, dtype=torch.bool)
    options = {}
    if mask_kind == "mask":
        mask = torch.rand(3, 7, 7, generator=torch.Generator().manual_seed(4)) < 0.5
        mask[..., 2, :] = False  # a query row with no key gets 0
        options["mask"] = mask
    elif mask_kind == "is_causal":
        mask = mask.tril()
        options["is_causal"] = True
    want = einsum_attention(q, k, v, mask, 1 / math.sqrt(C))
    assert_close(dense_attention(q, k, v, **options), want)


@pytest.fixture
def flash_heads(monkeypatch) -> list[tuple[int, int, int]]:
    """The heads of q, k and v at every call of SDPA's CPU flash operator, made by the dense
    path when gradients are wanted."""
    flash = dense_backend._flash_cpu_forward
    if flash is None:
        pytest.skip("this torch has no operator of SDPA's CPU flash kernel")
    heads: list[tuple[int, int, int]] = []

    def spy(q, k, v, *args, **kwargs):
        heads.append((q.size(-3), k.size(-3), v.size(-3)))
        return flash(q, k, v, *args, **kwargs)

    monkeypatch.setattr(dense_backend, "_flash_cpu_forward", spy)
    return heads


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dims", [3, 4])
def test_flash_kernel_reads_grouped_keys_without_copies(dims, sinks, flash_heads):
    """On SDPA's fused path each kv head reaches the flash kernel once, not per query head,
    with sinks too (one sink key per kv head, the sink in the queries), and its backward gives
    the gradients of the H_kv heads directly."""
    q, k, v = grouped_qkv(*([2] if dims == 4 else []), dtype=torch.float32)
    sink = torch.randn(H, requires_grad=True) if sinks else None
    out = dense_attention(q, k, v, is_causal=True, sinks=sink)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert flash_heads == [(H, H_KV, H_KV)]
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_layer_hands_grouped_keys_to_the_kernel(flash_heads):
    """DenseSelfAttention(kv_heads=) no longer repeats its keys and values before attention,
    and computes what it computed when it did."""
    torch.manual_seed(0)
    layer = DenseSelfAttention(16, C, heads=H, kv_heads=H_KV)
    x = torch.randn(2, 10, 16, requires_grad=True)
    out = layer(x, is_causal=True)
    out.sum().backward()
    assert flash_heads == [(H, H_KV, H_KV)]
    q = layer.lin_q(x).unflatten(-1, (H, C))
    k, v = (lin(x).unflatten(-1, (H_KV, C)).repeat_interleave(H // H_KV, dim=-2)
            for lin in (layer.lin_k, layer.lin_v))
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                                          is_causal=True).transpose(1, 2)
    assert_close(out, layer.lin_out(want.flatten(-2)))


def test_grouped_gradients_can_be_differentiated_again():
    q, k, v = grouped_qkv(2, dtype=torch.float64)
    out = dense_attention(q, k, v, is_causal=True)
    gq, gk = torch.autograd.grad((out ** 2).sum(), (q, k), create_graph=True)
    second = torch.autograd.grad(gq.sum() + gk.sum(), (q, k, v))
    rep = [t.detach().requires_grad_() for t in (q, k, v)]
    out_r = dense_attention(rep[0], rep[1].repeat_interleave(3, -2),
                            rep[2].repeat_interleave(3, -2), is_causal=True)
    gq_r, gk_r = torch.autograd.grad((out_r ** 2).sum(), rep[:2], create_graph=True)
    for a, b in zip(second, torch.autograd.grad(gq_r.sum() + gk_r.sum(), rep), strict=True):
        assert_close(a, b)


def test_batch_takes_grouped_keys():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(11, H, C, generator=gen, requires_grad=True)
    k, v = (torch.randn(11, H_KV, C, generator=gen, requires_grad=True) for _ in range(2))
    batch = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2])
    got = dense_attention(q, k, v, batch=batch)
    want = dense_attention(q, k.repeat_interleave(3, -2), v.repeat_interleave(3, -2),
                           batch=batch)
    assert_close(got, want)


@pytest.mark.parametrize("kv_heads, message", [(4, "divisor of H"), (0, "divisor of H")])
def test_heads_that_do_not_group_are_refused(kv_heads, message):
    q = torch.randn(5, H, C)
    k = v = torch.randn(5, kv_heads, C)
    with pytest.raises(ValueError, match=message):
        dense_attention(q, k, v)
    with pytest.raises(ValueError, match="do not fit together"):
        dense_attention(q, torch.randn(5, H_KV, C), torch.randn(5, 3, C))


# ----------------------------------------------------------------------------------------------
# edge_attention with grouped keys and values

EDGE_CASES = {
    "dot": {},
    "bias": {"bias": True},
    "weights": {"return_attention": True},
    "dropout": {"dropout_p": 0.4},
    "sinks": {"sinks": True},
    "sinks+bias": {"sinks": True, "bias": True},  # with repeated edges: the explicit softmax
    "edge terms": {"edge_key": True, "edge_value": True},
    "softcap": {"softcap": 3.0},
    "gatv2": {"score": "gatv2"},
    "additive": {"score": "additive"},
}

EDGE_GRAPHS = {
    "random": lambda: (torch.randint(0, 12, (2, 60), generator=torch.Generator().manual_seed(3)),
                       12),
    "complete": lambda: (graphs.complete_graph(9), 9),
    "causal blocks": lambda: (graphs.repeat_graph(graphs.causal_graph(6), 6, 3), 18),
    "unequal blocks": lambda: (graphs.batch_complete_graph(torch.tensor([0] * 3 + [1] * 7)),
                               10),
}


def edge_inputs(case: str, graph: str, dtype=torch.float64):
    """q of H heads, k and v of H_KV, and the options of ``case`` on ``graph``."""
    edge_index, n = EDGE_GRAPHS[graph]()
    options = dict(EDGE_CASES[case])
    gen = torch.Generator().manual_seed(7)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()
    score = options.get("score", "dot")
    qk = (H,) if score == "additive" else (H, C)
    q, k, v = leaf(n, *qk), leaf(n, H_KV, *qk[1:]), leaf(n, H_KV, C)
    E = edge_index.size(1)
    for name, shape in (("bias", (E, H)), ("sinks", (H,)), ("edge_key", (E, H, C)),
                        ("edge_value", (E, H, C))):
        if options.get(name):
            options[name] = leaf(*shape)
    if score == "gatv2":
        options["att"] = leaf(H, C)
    return q, k, v, edge_index, options


def outputs_and_grads(q, k, v, edge_index, options, backend):
    torch.manual_seed(11)  # the same dropout draw
    result = edge_attention(q, k, v, edge_index, backend=backend, **options)
    out, alpha = result if options.get("return_attention") else (result, None)
    gen = torch.Generator().manual_seed(12)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    leaves = [q, k, v, *(t for t in options.values() if isinstance(t, torch.Tensor))]
    return [out, alpha, *torch.autograd.grad(loss, leaves)]


# the triton kernels read any graph the same way: one graph is enough there; the dense
# backend refuses a soft cap (tests/functional/test_softcap.py)
BACKEND_CASES = [(backend, graph, case) for backend in ("reference", "cpu", "dense", "triton")
                 for graph in EDGE_GRAPHS for case in EDGE_CASES
                 if (backend != "triton" or graph == "random")
                 and not (backend == "dense" and case == "softcap")]


@pytest.mark.parametrize("backend, graph, case", BACKEND_CASES)
def test_edge_attention_of_grouped_keys_equals_repeated_keys(backend, graph, case, request):
    """Every backend gives with k, v of H_kv heads what the reference gives with each kv head
    repeated for its query heads: outputs, weights and gradients (those of the grouped k and
    v the sums over their query heads), on a random graph, a complete one (SDPA's plain
    path), diagonal blocks of equal sizes (viewed in place) and of unequal ones (padded)."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    dtype = torch.float32 if backend == "triton" else torch.float64
    q, k, v, edge_index, options = edge_inputs(case, graph, dtype)
    got = outputs_and_grads(q, k, v, edge_index, options, backend)
    group = H // H_KV
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    want = outputs_and_grads(q2, k2.repeat_interleave(group, dim=1),
                             v2.repeat_interleave(group, dim=1), edge_index, options,
                             "reference")
    want[2:5] = [want[2], *(g.unflatten(1, (H_KV, group)).sum(2) for g in want[3:5])]
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {}
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
        else:
            assert_close(a, b, **tol)


def test_grouped_reference_against_an_independent_loop():
    """The reference's grouped keys: each target's softmax over its in-edges, query head h
    reading kv head h // (H / H_kv), in a plain loop."""
    q, k, v, edge_index, _ = edge_inputs("dot", "random")
    out = edge_attention(q, k, v, edge_index, backend="reference")
    want = torch.zeros_like(out)
    for i in range(q.size(0)):
        src = edge_index[0][edge_index[1] == i]
        for h in range(H):
            g = h // (H // H_KV)
            if src.numel():
                weights = torch.softmax(k[src, g] @ q[i, h] / math.sqrt(C), dim=0)
                want[i, h] = weights @ v[src, g]
    assert_close(out, want)


@pytest.mark.parametrize("graph", ["complete", "causal blocks"])
def test_dense_backend_hands_grouped_keys_to_sdpa(graph, flash_heads):
    """On SDPA's path the dense backend passes the H_kv heads on, no copy per query head; and
    a GraphSelfAttention with kv_heads on a batch of causal sequences does too."""
    q, k, v, edge_index, _ = edge_inputs("dot", graph, torch.float32)
    edge_attention(q, k, v, edge_index, backend="dense").sum().backward()
    assert flash_heads == [(H, H_KV, H_KV)]
    flash_heads.clear()
    layer = GraphSelfAttention(16, C, heads=H, kv_heads=H_KV, add_self_loops=False)
    x = torch.randn(q.size(0), 16)
    layer(x, edge_index).sum().backward()  # auto: dense on these graphs
    assert flash_heads == [(H, H_KV, H_KV)]


def test_edge_attention_refuses_heads_that_do_not_group():
    q, k, v, edge_index, _ = edge_inputs("dot", "random")
    with pytest.raises(ValueError, match=r"q must have the heads H of k and v, 2, or a "
                                         r"multiple of them"):
        edge_attention(q[:, :5], k, v, edge_index)
    with pytest.raises(ValueError, match=r"edge_key must have shape \[E, H, C\] = \[60, 6, 8\]"):
        edge_attention(q, k, v, edge_index, edge_key=torch.randn(60, H_KV, C, dtype=q.dtype))
    with pytest.raises(ValueError, match=r"bias must have shape \[E, H\] = \[60, 6\]"):
        edge_attention(q, k, v, edge_index, bias=torch.randn(60, H_KV, dtype=q.dtype))


@pytest.mark.parametrize("layer_kind", ["graph", "dense, sinks"])
def test_grouped_layers_compile_as_eager(layer_kind):
    """torch.compile(fullgraph=True) of a layer with kv_heads, on the path that hands the
    grouped keys to SDPA (a batch of causal sequences on the dense backend; the dense layer
    with sinks): output and input gradient as eager."""
    torch.manual_seed(0)
    if layer_kind == "graph":
        layer = GraphSelfAttention(16, C, heads=H, kv_heads=H_KV, add_self_loops=False)
        args = (torch.randn(24, 16, requires_grad=True),
                graphs.repeat_graph(graphs.causal_graph(8), 8, 3))
        kwargs = {}
    else:
        layer = DenseSelfAttention(16, C, heads=H, kv_heads=H_KV, sinks=True)
        args, kwargs = (torch.randn(2, 10, 16, requires_grad=True),), {"is_causal": True}
    want = layer(*args, **kwargs)
    want_grad = torch.autograd.grad(want.sum(), args[0])[0]
    torch._dynamo.reset()
    got = torch.compile(layer, fullgraph=True)(*args, **kwargs)
    assert_close(got, want)
    assert_close(torch.autograd.grad(got.sum(), args[0])[0], want_grad)
