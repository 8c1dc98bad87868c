"""The per-edge key and value terms of the Triton kernels, run in Triton's CPU interpreter.

``triton_edge_attention(..., edge_key=ek, edge_value=ev)`` adds ``ek[e]`` to the key and
``ev[e]`` to the value of each edge e = (j -> i). The truth is the readable formula "edges as
sources": every edge becomes a source node of its own, with key ``k[j] + ek[e]`` and value
``v[j] + ev[e]``, on the graph e -> i, computed by :func:`reference_edge_attention` in float64.
Outputs, attention weights and the gradients of every input (q, k, v, att, bias, edge_key,
edge_value; through out and alpha) are compared with the tolerance of the kernel's dtype.
Every test runs under ``TRITON_INTERPRET=1`` (the ``triton_interpreter`` fixture of conftest,
which skips without triton); sizes stay tiny, since the interpreter runs one Python step per
tile operation.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, assert_results_close, attention_inputs, random_graph

from graphattn.functional import triton_kernels as tk
from graphattn.functional.attention import reference_edge_attention

pytestmark = pytest.mark.usefixtures("triton_interpreter")

TERMS = {"key": ("edge_key",), "value": ("edge_value",), "both": ("edge_key", "edge_value")}
ALL_TERMS = {"dot": "both", "gatv2": "both", "additive": "value"}  # edge_key needs channels


def mixed_graph() -> tuple[torch.Tensor, int]:
    """12 nodes: node 0 has 40 incoming edges (from nodes 0-9 four times each: multi-edges and
    the self-loop 0 -> 0; two edge blocks at 32 edges per block), self-loops 3 -> 3 and 5 -> 5,
    a triple edge 2 -> 5, nodes 1, 8 and 11 without incoming edge and node 10 without any."""
    hub = [(j % 10, 0) for j in range(40)]
    pairs = hub + [(3, 3), (5, 5), (2, 5), (2, 5), (2, 5), (1, 2), (4, 3), (6, 7), (7, 6),
                   (8, 9), (11, 4)]
    return torch.tensor(pairs).t().contiguous(), 12


def edges_as_sources(q, k, v, edge_index, *, edge_key=None, edge_value=None, **options):
    """The readable definition: each edge its own source, with key k[src] + edge_key and value
    v[src] + edge_value, on the graph (arange(E), dst)."""
    src, dst = edge_index
    k_e = k[src] if edge_key is None else k[src] + edge_key  # (E, H, C) or (E, H)
    v_e = v[src] if edge_value is None else v[src] + edge_value  # (E, H, C)
    per_edge = torch.stack([torch.arange(src.numel()), dst])  # (2, E)
    return reference_edge_attention(q, k_e, v_e, per_edge, **options)


def run(backend, inputs, edge_index, *, score, through=("out", "alpha"), dropout_mask=None,
        compute_dtype=None, seed=1, negative_slope=0.2):
    """out, alpha and the gradients of the inputs that require one, of a fixed random loss on
    ``through`` (0 where the loss does not depend on an input)."""
    given = {n: t for n, t in inputs.items() if t is not None}
    leaves = {n: t for n, t in given.items() if t.requires_grad}
    cast = {n: (t.to(compute_dtype) if compute_dtype else t) for n, t in given.items()}
    mask = None if dropout_mask is None else dropout_mask.to(compute_dtype or dropout_mask.dtype)
    out, alpha = backend(cast["q"], cast["k"], cast["v"], edge_index, scale=0.5,
                         bias=cast.get("bias"), dropout_mask=mask, score=score,
                         negative_slope=negative_slope, need_alpha=True, att=cast.get("att"),
                         edge_key=cast.get("edge_key"), edge_value=cast.get("edge_value"))
    gen = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    w_alpha = torch.randn(alpha.shape, generator=gen, dtype=torch.float64)
    loss = sum((t.double() * w).sum() for name, t, w in (("out", out, w_out),
                                                          ("alpha", alpha, w_alpha))
               if name in through)
    grads = torch.autograd.grad(loss, list(leaves.values()), materialize_grads=True)
    return {"out": out, "alpha": alpha, **{"d" + n: g for n, g in zip(leaves, grads, strict=True)}}


def check_against_edges_as_sources(inputs, edge_index, *, score, dtype=torch.float32,
                                   **kwargs) -> dict[str, torch.Tensor]:
    got = run(tk.triton_edge_attention, inputs, edge_index, score=score, **kwargs)
    want = run(edges_as_sources, inputs, edge_index, score=score, compute_dtype=torch.float64,
               **kwargs)
    assert_results_close(got, want, inputs, dtype)
    return got


@pytest.mark.parametrize("score", ["dot", "gatv2", "additive"])
def test_matches_edges_as_sources_on_graph_registry(graph_case, score, triton_tiles):
    ei = graph_case.edge_index
    inputs = attention_inputs(graph_case.num_src, graph_case.num_dst, ei.size(1), 2, 8, score=score,
                              terms=TERMS[ALL_TERMS[score]])
    got = check_against_edges_as_sources(inputs, ei, score=score)
    isolated = torch.ones(graph_case.num_dst, dtype=torch.bool)
    isolated[ei[1]] = False
    assert (got["out"][isolated] == 0).all()


@pytest.mark.parametrize("heads,channels", [(1, 8), (4, 16)])
@pytest.mark.parametrize("score,terms", [("dot", "key"), ("dot", "value"), ("dot", "both"),
                                         ("gatv2", "key"), ("gatv2", "value"),
                                         ("gatv2", "both"), ("additive", "value")])
def test_each_term_on_a_degree_40_row(score, terms, heads, channels, triton_tiles):
    """One target of 40 edges (two edge blocks), self-loops, a triple edge, targets without
    incoming edges; one head block of 1 and of 4 heads, channel tiles of 8 and 16."""
    ei, num_nodes = mixed_graph()
    inputs = attention_inputs(num_nodes, num_nodes, ei.size(1), heads, channels, score=score,
                              terms=TERMS[terms], seed=heads + channels)
    got = check_against_edges_as_sources(inputs, ei, score=score)
    assert (got["out"][[1, 8, 10, 11]] == 0).all()
    assert ((got["alpha"] >= 0) & (got["alpha"] <= 1)).all()


@pytest.mark.parametrize("through", [("out",), ("alpha",)], ids=["out", "alpha"])
@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_gradients_through_out_or_alpha_alone(score, through, triton_tiles):
    """Without a gradient of alpha the kernels skip its terms; without one of out, dout is 0
    and d edge_value is 0."""
    ei, num_nodes = mixed_graph()
    inputs = attention_inputs(num_nodes, num_nodes, ei.size(1), 2, 8, score=score,
                              terms=TERMS["both"], seed=7)
    got = check_against_edges_as_sources(inputs, ei, score=score, through=through)
    if through == ("alpha",):
        assert (got["dedge_value"] == 0).all() and (got["dv"] == 0).all()


@pytest.mark.parametrize("score", ["dot", "gatv2", "additive"])
def test_dropout_mask_weights_the_value_terms(score, triton_tiles):
    """d edge_value is w_e dout_i with w_e = alpha_e * mask_e: exactly 0 on dropped edges."""
    ei = random_graph(12, 40, seed=5)
    inputs = attention_inputs(12, 12, 40, 2, 8, score=score, terms=TERMS[ALL_TERMS[score]])
    p = 0.4
    keep = torch.rand(40, 2, generator=torch.Generator().manual_seed(9)) > p
    mask = keep.float() / (1 - p)
    got = check_against_edges_as_sources(inputs, ei, score=score, dropout_mask=mask)
    assert (got["dedge_value"][~keep] == 0).all()


def test_gatv2_terms_with_a_negative_slope_of_their_own():
    """negative_slope 0.1, not the default 0.2: the LeakyReLU of q_i + k_j + ek_e and its
    derivative in d edge_key, dq, d att and dk."""
    ei, num_nodes = mixed_graph()
    inputs = attention_inputs(num_nodes, num_nodes, ei.size(1), 2, 8, score="gatv2",
                              terms=TERMS["both"], seed=9)
    check_against_edges_as_sources(inputs, ei, score="gatv2", negative_slope=0.1)


@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_bfloat16(score, triton_tiles):
    """bf16 inputs and terms, fp32 statistics: gradients in bf16 within bf16's tolerance."""
    ei = random_graph(12, 40, seed=6)
    inputs = attention_inputs(12, 12, 40, 2, 16, score=score, terms=TERMS["both"],
                              dtype=torch.bfloat16)
    got = check_against_edges_as_sources(inputs, ei, score=score, dtype=torch.bfloat16)
    assert got["out"].dtype == torch.bfloat16 and got["dedge_key"].dtype == torch.bfloat16


@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_fp32_edge_key_beside_bf16_inputs(score):
    """bf16 q, k and att with an fp32 key term (and fp32 v): the scores promote to fp32, so
    alpha is fp32 as the definition's, not the bf16 of q and k."""
    ei, num_nodes = mixed_graph()
    inputs = attention_inputs(num_nodes, num_nodes, ei.size(1), 2, 8, score=score,
                              terms=("edge_key",), dtype=torch.bfloat16, seed=6)
    for name in ("v", "edge_key"):
        inputs[name] = inputs[name].detach().float().requires_grad_()
    got = run(tk.triton_edge_attention, inputs, ei, score=score)
    want = run(edges_as_sources, inputs, ei, score=score)
    assert got["alpha"].dtype == want["alpha"].dtype == torch.float32
    for name in got:
        assert_close(got[name].float(), want[name].float(), dtype=torch.bfloat16)


@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_terms_without_gradient(score):
    """Terms that need no gradient still enter the scores and values (and the recomputed ones
    of backward); only the other inputs get gradients."""
    ei, num_nodes = mixed_graph()
    inputs = attention_inputs(num_nodes, num_nodes, ei.size(1), 2, 8, score=score,
                              terms=TERMS["both"], seed=3)
    constants = {n: t.detach() for n, t in inputs.items() if n.startswith("edge_")}
    got = run(tk.triton_edge_attention, {**inputs, **constants}, ei, score=score)
    want = run(edges_as_sources, {**inputs, **constants}, ei, score=score,
               compute_dtype=torch.float64)
    assert "dedge_key" not in got and "dedge_value" not in got
    for name in got:
        assert_close(got[name], want[name], dtype=torch.float32)


@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_one_tensor_as_key_and_value_term(score, monkeypatch, triton_tiles):
    """``edge_key=e, edge_value=e`` (TransformerConv's edge features): the target pass writes
    the gradient of both roles into one buffer, and no second ``[E, H, C]`` gradient is made;
    the result is the definition's, where autograd adds the two roles."""
    ei, num_nodes = mixed_graph()
    inputs = attention_inputs(num_nodes, num_nodes, ei.size(1), 2, 8, score=score,
                              terms=("edge_key",), seed=8)
    inputs["edge_value"] = inputs["edge_key"]
    calls = []

    def spy(*args, **kwargs):
        grads = backward(*args, **kwargs)
        calls.append((kwargs["value_is_key"], grads[-1]))
        return grads

    backward = tk._backward
    monkeypatch.setattr(tk, "_backward", spy)
    # the definition's gradient of the one tensor is the sum of both roles
    check_against_edges_as_sources(inputs, ei, score=score)
    assert calls == [(True, None)]  # one buffer: d edge_value not made


def test_edge_key_refused_with_additive_score():
    inputs = attention_inputs(3, 3, 1, 1, 8, score="additive", terms=(), bias=False)
    with pytest.raises(ValueError, match="edge_key needs the dot or gatv2 score"):
        tk.triton_edge_attention(inputs["q"], inputs["k"], inputs["v"], torch.tensor([[0], [1]]),
                                 scale=1.0, bias=None, dropout_mask=None, score="additive",
                                 negative_slope=0.2, need_alpha=False,
                                 edge_key=torch.randn(1, 1, 8))


@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_operators_pass_opcheck(score):
    """torch's checks of the operators with the per-edge terms: schema, fake shapes and
    dtypes, autograd registration."""
    ei = random_graph(6, 20, seed=5)
    inputs = attention_inputs(6, 6, 20, 2, 8, score=score, terms=TERMS["both"])
    q, k, v, bias, att, ek, ev = inputs.values()
    mask = (torch.rand(20, 2, generator=torch.Generator().manual_seed(1)) > 0.3).float() / 0.7
    args = (q, k, v, att, bias, mask, ei, 0.5, 0.2, score, True, ek, ev)
    torch.library.opcheck(tk._forward_op, args)
    out, _, lse = tk._forward_op(*args)
    detached = [None if t is None else t.detach() for t in (q, k, v, att, bias)]
    backward_args = (torch.randn_like(out), torch.randn(20, 2), *detached, mask, ei,
                     out.detach(), lse, 0.5, 0.2, score, True, att is not None)
    torch.library.opcheck(tk._backward_op, (*backward_args, ek.detach(), ev.detach(), True,
                                            True))
    # one tensor as both terms: one gradient buffer, d edge_value empty
    grads = tk._backward_op(*backward_args, ek.detach(), ek.detach(), True, True, True)
    assert grads[5].shape == ek.shape and grads[6].numel() == 0
    torch.library.opcheck(tk._backward_op, (*backward_args, ek.detach(), ek.detach(), True,
                                            True, True))


@pytest.mark.parametrize("need_alpha", [True, False], ids=["alpha", "no-alpha"])
def test_operators_fake_outputs_with_half_inputs(need_alpha):
    """The fake (meta) outputs torch.compile plans with are the kernels': out and lse fp32
    whatever the dtype of v (bf16 here), alpha in the dtype the scores promote to (bf16 q, k
    and terms with an fp32 bias: fp32), and ``[0, H]`` without need_alpha."""
    ei = random_graph(6, 20, seed=5)
    inputs = attention_inputs(6, 6, 20, 2, 8, score="gatv2", terms=TERMS["both"],
                              dtype=torch.bfloat16)
    q, k, v, bias, att, ek, ev = (t.detach() for t in inputs.values())
    args = (q, k, v, att, bias.float(), None, ei, 0.5, 0.2, "gatv2", need_alpha, ek, ev)
    torch.library.opcheck(tk._forward_op, args, test_utils=("test_schema", "test_faketensor"))
    out, alpha, lse = tk._forward_op(*args)
    assert out.dtype == lse.dtype == alpha.dtype == torch.float32
    assert alpha.shape == ((20, 2) if need_alpha else (0, 2))


@pytest.mark.parametrize("score,shared", [("dot", False), ("gatv2", False), ("dot", True)],
                         ids=["dot", "gatv2", "dot-one-tensor-as-both"])
def test_compiled_function_matches_eager(score, shared, monkeypatch):
    """torch.compile(fullgraph=True) calls the operator graphattn::triton_edge_attention and
    its backward, with the terms (or one tensor as both, still written as one gradient),
    instead of tracing into the launches."""
    torch._dynamo.reset()
    ei, num_nodes = mixed_graph()
    inputs = attention_inputs(num_nodes, num_nodes, ei.size(1), 2, 8, score=score,
                              terms=TERMS["key" if shared else "both"], seed=4)
    if shared:
        inputs["edge_value"] = inputs["edge_key"]
    leaves = [t for t in inputs.values() if t is not None]
    shared_flags = []

    def spy(*args, **kwargs):
        shared_flags.append(kwargs["value_is_key"])
        return backward(*args, **kwargs)

    backward = tk._backward
    monkeypatch.setattr(tk, "_backward", spy)

    def attend(q, k, v, bias, att, edge_key, edge_value, edge_index):
        return tk.triton_edge_attention(q, k, v, edge_index, scale=0.5, bias=bias,
                                        dropout_mask=None, score=score, negative_slope=0.2,
                                        need_alpha=True, att=att, edge_key=edge_key,
                                        edge_value=edge_value)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, attend):
        out, alpha = fn(*inputs.values(), ei)
        grads = torch.autograd.grad((out * out).sum() + (alpha * alpha).sum(), leaves)
        results.append((out, alpha, *grads))
    for got, want in zip(*results, strict=True):
        assert_close(got, want)
    assert shared_flags == [shared, shared]  # compiled and eager backward
