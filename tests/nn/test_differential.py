"""Differential attention (``differential=True``): each head's two score maps over the same
graph and values, their difference :math:`(\\alpha_1 - \\lambda \\alpha_2) V`, RMS-normalised
per head and scaled by :math:`1 - \\lambda_{init}` (the Differential Transformer's head).

Checked against the formula written out here with the reference operator (outputs, the
input's gradient, every parameter's gradient and the returned weights) on every CPU backend,
with grouped keys and sinks; the graph layer on the causal graph against the dense layer with
the same weights; GraphTransformer's depth schedule of lambda_init; and the refusals.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_close

from graphattn import graphs
from graphattn.functional import edge_attention
from graphattn.nn import DenseSelfAttention, GraphSelfAttention, GraphTransformer


def _written_out(layer: GraphSelfAttention, x: torch.Tensor, edge_index: torch.Tensor,
                 edge_attr: torch.Tensor | None = None):
    """The layer's output and weights from its parameters: two reference attentions (the edge
    features' score bias in both), their difference with lambda, each head's RMS norm with
    its gains, times 1 - lambda_init."""
    H, kv, c, C = layer.heads, layer.kv_heads, layer.score_channels, layer.out_channels
    q = layer.lin_q(x).view(-1, 2, H, c)  # map-major: map 1's heads, then map 2's
    k = layer.lin_k(x).view(-1, 2, kv, c)
    v = layer.lin_v(x).view(-1, kv, C)
    sinks = [None, None] if layer.sinks is None else list(layer.sinks.view(2, H))
    bias = None if edge_attr is None else layer.lin_edge(edge_attr)  # (E, H)
    (o1, a1), (o2, a2) = (edge_attention(q[:, m], k[:, m], v, edge_index, backend="reference",
                                         sinks=sinks[m], bias=bias, return_attention=True)
                          for m in range(2))
    lam = (torch.exp((layer.lambda_q1 * layer.lambda_k1).sum())
           - torch.exp((layer.lambda_q2 * layer.lambda_k2).sum()) + layer.lambda_init)
    diff = o1 - lam * o2
    normed = diff / (diff.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * layer.diff_norm.weight
    out = layer.lin_out((normed * (1 - layer.lambda_init)).flatten(1))
    return out, a1 - lam * a2


@pytest.mark.parametrize("backend", ["reference", "cpu", "auto"])
@pytest.mark.parametrize("kv_heads, sinks, edge_dim", [(4, False, None), (2, True, 3)])
def test_differential_attention_is_the_difference_of_two_maps(backend, kv_heads, sinks,
                                                             edge_dim):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = GraphSelfAttention(12, 8, heads=4, kv_heads=kv_heads, add_self_loops=False,
                               differential=True, lambda_init=0.3, sinks=sinks,
                               edge_dim=edge_dim, backend=backend).double()
    assert layer.score_channels == 4 and layer.lin_q.out_features == 2 * 4 * 4
    assert layer.lin_k.out_features == 2 * kv_heads * 4 and layer.lin_v.out_features == kv_heads * 8
    with torch.no_grad():
        layer.diff_norm.weight.normal_(1.0, 0.5, generator=gen)
        for lam in (layer.lambda_q1, layer.lambda_k1, layer.lambda_q2, layer.lambda_k2):
            lam.normal_(0.0, 0.5, generator=gen)
        if sinks:
            layer.sinks.normal_(generator=gen)
    x = torch.randn(9, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    edge_index = graphs.random_graph(9, 3, self_loops=True)
    edge_attr = (None if edge_dim is None else torch.randn(
        edge_index.size(1), edge_dim, dtype=torch.float64, generator=gen))
    out, (_, alpha) = layer(x, edge_index, edge_attr, return_attention_weights=True)
    want, want_alpha = _written_out(layer, x, edge_index, edge_attr)
    assert_close(out, want)
    assert_close(alpha, want_alpha)
    params = [x] + [p for p in layer.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.square().sum(), params)
    wants = torch.autograd.grad(want.square().sum(), params)
    for grad, expected in zip(grads, wants, strict=True):
        assert_close(grad, expected)
    assert next(g for g, p in zip(grads, params, strict=True)
                if p is layer.lambda_q2).abs().sum() > 0


def test_differential_attention_on_the_triton_kernels(triton_interpreter):
    # the two maps on the fused kernels (Triton's interpreter), each with its sinks: outputs,
    # weights and every gradient as the reference backend's, in fp32
    torch.manual_seed(3)
    layer = GraphSelfAttention(16, 8, heads=2, kv_heads=1, differential=True, sinks=True,
                               add_self_loops=False, backend="reference")
    torch.nn.init.normal_(layer.sinks)
    x = torch.randn(12, 16, requires_grad=True)
    edge_index = graphs.random_graph(12, 3, self_loops=True)
    params = [x] + list(layer.parameters())
    results = []
    for backend in ("reference", "triton"):
        layer.backend = backend
        out, (_, alpha) = layer(x, edge_index, return_attention_weights=True)
        loss = out.square().sum() + (alpha * torch.linspace(-1, 1, alpha.numel()).view_as(
            alpha)).sum()
        results.append((out, alpha, torch.autograd.grad(loss, params)))
    (out, alpha, grads), (got_out, got_alpha, got_grads) = results
    assert_close(got_out, out, atol=1e-5, rtol=1e-4)
    assert_close(got_alpha, alpha, atol=1e-5, rtol=1e-4)
    for got, want in zip(got_grads, grads, strict=True):
        assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_differential_graph_and_dense_layers_agree(kv_heads):
    torch.manual_seed(1)
    graph = GraphSelfAttention(16, 8, heads=2, kv_heads=kv_heads, differential=True,
                               add_self_loops=False, backend="cpu", qk_norm="rms_per_head")
    dense = DenseSelfAttention(16, 8, heads=2, kv_heads=kv_heads, differential=True,
                               qk_norm="rms_per_head")
    assert graph.q_norm.weight.shape == (4, 4)  # the two maps' heads, each its own gains
    dense.load_state_dict(graph.state_dict())
    x = torch.randn(11, 16, requires_grad=True)
    out_g, (_, alpha) = graph(x, graphs.causal_graph(11), return_attention_weights=True)
    out_d, weights = dense(x, is_causal=True, return_attention_weights=True)
    assert_close(out_g, out_d)
    dst, src = graphs.causal_graph(11)[1], graphs.causal_graph(11)[0]
    assert_close(alpha, weights[:, dst, src].T)
    assert (alpha < 0).any()  # (a difference of weights: some are negative)
    grad_g = torch.autograd.grad(out_g.square().sum(), [x, graph.lambda_k1])
    grad_d = torch.autograd.grad(out_d.square().sum(), [x, dense.lambda_k1])
    for g, d in zip(grad_g, grad_d, strict=True):
        assert_close(g, d)


def test_differential_repr_and_defaults():
    layer = GraphSelfAttention(8, 6, heads=2, differential=True)
    assert layer.score_channels == 3 and layer.lambda_init == 0.8
    assert repr(layer) == "GraphSelfAttention(8, 6, heads=2, differential=True)"
    layer = DenseSelfAttention(8, 6, heads=2, differential=True, lambda_init=0.2,
                               score_channels=4)
    assert repr(layer) == ("DenseSelfAttention(8, 6, heads=2, score_channels=4, "
                           "differential=True, lambda_init=0.2)")
    assert layer.lambda_q1.shape == (4,) and layer.diff_norm.weight.shape == (6,)
    assert GraphSelfAttention(8, 6).lambda_q1 is None


def test_graph_transformer_schedules_lambda_init_by_depth():
    # the Differential Transformer's lambda_init = 0.8 - 0.6 exp(-0.3 l) at layer l (from 0)
    model = GraphTransformer(8, 16, 3, num_layers=3, heads=2, differential=True, dropout=0.0)
    assert [a.lambda_init for a in model.attns] == pytest.approx(
        [0.8 - 0.6 * math.exp(-0.3 * layer) for layer in range(3)])
    x, edge_index = torch.randn(7, 8), torch.randint(0, 7, (2, 20))
    assert model(x, edge_index).shape == (7, 3)
    with pytest.raises(ValueError, match="give attention_dropout=0 \\(it defaults to dropout\\), "
                       "got attention_dropout=0.5"):
        GraphTransformer(8, 16, 3, differential=True)
    assert GraphTransformer(8, 16, 3, differential=True, attention_dropout=0.0).dropout == 0.5


@pytest.mark.parametrize("kwargs, match", [
    (dict(attention="additive"), "needs attention='dot'.*got attention='additive'"),
    (dict(attention="gatv2"), "got attention='gatv2'"),
    (dict(edge_dim=3, edge_mode="key"), "got edge_mode='key'"),
    (dict(share_value=True), "got share_value=True"),
    (dict(dropout=0.1), "got dropout=0.1"),
])
def test_differential_refuses_what_its_two_maps_cannot_share(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GraphSelfAttention(8, 4, differential=True, **kwargs)


def test_differential_errors():
    with pytest.raises(ValueError, match="out_channels=5 is odd: give score_channels"):
        GraphSelfAttention(8, 5, differential=True)
    assert GraphSelfAttention(8, 5, differential=True, score_channels=3).score_channels == 3
    with pytest.raises(ValueError, match="lambda_init=0.5 .* needs differential=True"):
        DenseSelfAttention(8, 4, lambda_init=0.5)
    with pytest.raises(TypeError, match="differential must be a bool"):
        GraphSelfAttention(8, 4, differential="yes")
    with pytest.raises(ValueError, match="lambda_init"):
        GraphSelfAttention(8, 4, differential=True, lambda_init=float("nan"))
    with pytest.raises(ValueError, match="got dropout=0.1"):
        DenseSelfAttention(8, 4, differential=True, dropout=0.1)
