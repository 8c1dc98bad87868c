"""Attention sinks: ``GraphSelfAttention(sinks=True)`` adds a learned logit per head to each
target's softmax, as one more score whose value is 0 (GPT-OSS's attention).

Checked against the formula written out with dense ops on the causal graph, on every CPU
backend with edge features in the key and value and the weights returned, with every score,
and for the errors. ``tests/functional/test_softmax_sinks.py`` checks the operator's
``sinks=`` itself."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close

from graphattn import graphs
from graphattn.nn import GraphSelfAttention, GraphTransformer


def _layer(backend: str = "auto", **options) -> GraphSelfAttention:
    torch.manual_seed(0)
    layer = GraphSelfAttention(12, 4, heads=2, add_self_loops=False, sinks=True,
                               backend=backend, **options).double()
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([1.5, -0.5]))
    return layer


def test_sinks_are_one_more_score_of_value_zero():
    # on the causal graph: softmax over [q_i . k_j / sqrt(C) for j <= i, sigma_h], the sink's
    # column dropped, times v; the sinks' gradient too
    L = 7
    layer = _layer()
    x = torch.randn(L, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    q, k, v = (lin(x).view(L, 2, 4) for lin in (layer.lin_q, layer.lin_k, layer.lin_v))
    scores = torch.einsum("ihc,jhc->hij", q, k) / 2.0  # (H, L, L)
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    sink = layer.sinks.view(2, 1, 1).expand(2, L, 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :L]  # (H, L, L)
    want = layer.lin_out(torch.einsum("hij,jhc->ihc", weights, v).reshape(L, 8))
    got = layer(x, graphs.causal_graph(L))
    assert_close(got, want)
    (grad_want,) = torch.autograd.grad(want.sum(), layer.sinks)
    (grad_got,) = torch.autograd.grad(got.sum(), layer.sinks)
    assert_close(grad_got, grad_want)
    assert (grad_got != 0).all()


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_every_cpu_backend_and_the_weights(backend):
    # edge features in the key and value, the weights returned for the graph's edges: each
    # target's sum is what its sink leaves
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 12, dtype=torch.float64, generator=gen)
    edge_index = graphs.random_graph(9, 4, self_loops=True)
    edge_attr = torch.randn(edge_index.size(1), 3, dtype=torch.float64, generator=gen)
    want_layer = _layer("reference", edge_dim=3, edge_mode="key_value")
    layer = _layer(backend, edge_dim=3, edge_mode="key_value")
    want, (_, want_alpha) = want_layer(x, edge_index, edge_attr, return_attention_weights=True)
    got, (ei, alpha) = layer(x, edge_index, edge_attr, return_attention_weights=True)
    assert torch.equal(ei, edge_index) and alpha.shape == (edge_index.size(1), 2)
    assert_close(got, want)
    assert_close(alpha, want_alpha)
    totals = torch.zeros(9, 2, dtype=alpha.dtype).index_add_(0, ei[1], alpha)
    assert ((totals > 0) & (totals < 1)).all()
    (grad_want,) = torch.autograd.grad(want.square().sum(), want_layer.sinks)
    (grad_got,) = torch.autograd.grad(got.square().sum(), layer.sinks)
    assert_close(grad_got, grad_want)


def test_a_target_without_edges_gets_zero():
    layer = _layer()
    out = layer.lin_out.bias.detach()  # the output projection's bias alone
    got = layer(torch.randn(3, 12, dtype=torch.float64), torch.tensor([[0], [1]]))
    assert torch.isfinite(got).all()
    assert_close(got[2], out)


def test_state_and_repr():
    layer = GraphSelfAttention(8, 4, heads=2, sinks=True)
    assert "sinks" in dict(layer.named_parameters()) and "sinks=True" in repr(layer)
    with torch.no_grad():
        layer.sinks.fill_(3.0)
    layer.reset_parameters()
    assert torch.equal(layer.sinks, torch.zeros(2))
    assert GraphSelfAttention(8, 4).sinks is None
    model = GraphTransformer(8, 16, 3, num_layers=2, heads=2, sinks=True)
    assert all(attn.sinks is not None for attn in model.attns)
    assert model(torch.randn(5, 8), graphs.causal_graph(5)).shape == (5, 3)


@pytest.mark.parametrize("attention", ["additive", "gatv2"])
def test_every_score_takes_sinks(attention):
    # GAT's and GATv2's scores with a sink: the cpu kernels against the reference, and the
    # weights of each target summing to less than 1
    torch.manual_seed(0)
    layer = GraphSelfAttention(12, 4, heads=2, attention=attention, sinks=True, backend="cpu")
    with torch.no_grad():
        layer.sinks.copy_(torch.tensor([1.0, -1.0]))
    x = torch.randn(9, 12, generator=torch.Generator().manual_seed(4))
    edge_index = graphs.random_graph(9, 3)
    got, (ei, alpha) = layer(x, edge_index, return_attention_weights=True)
    layer.backend = "reference"
    want, (_, want_alpha) = layer(x, edge_index, return_attention_weights=True)
    assert_close(got, want)
    assert_close(alpha, want_alpha)
    totals = torch.zeros(9, 2).index_add_(0, ei[1], alpha)
    assert (totals < 1 - 1e-3).all()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sinks=1), TypeError, "sinks must be a bool"),
])
def test_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        GraphSelfAttention(8, 4, heads=2, **kwargs)


def test_triton_backend_in_the_interpreter(triton_interpreter):
    # the fused kernels start each row's softmax at the sink (fp32)
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(3))
    edge_index = graphs.random_graph(8, 3, self_loops=True)
    want, got = (_layer(backend).float()(x, edge_index) for backend in ("reference", "triton"))
    assert_close(got, want)


def test_dense_layer_is_the_graph_layer_on_the_complete_graph():
    """DenseSelfAttention(sinks=True) is GraphSelfAttention(sinks=True) with the same weights
    on the complete graph, causally too, the sinks' gradient included."""
    from graphattn.nn import DenseSelfAttention

    torch.manual_seed(0)
    dense = DenseSelfAttention(6, 4, heads=2, sinks=True)
    assert repr(dense) == "DenseSelfAttention(6, 4, heads=2, sinks=True)"
    assert torch.equal(dense.sinks.detach(), torch.zeros(2))
    with torch.no_grad():
        dense.sinks.copy_(torch.tensor([1.0, -2.0]))
    graph = GraphSelfAttention(6, 4, heads=2, sinks=True, add_self_loops=False)
    graph.load_state_dict(dense.state_dict())
    x = torch.randn(7, 6) * 3
    for causal, edge_index in ((False, graphs.complete_graph(7)), (True, graphs.causal_graph(7))):
        want = graph(x, edge_index)
        got = dense(x, is_causal=causal)
        assert_close(got, want)
        (grad_want,) = torch.autograd.grad(want.square().sum(), graph.sinks)
        (grad_got,) = torch.autograd.grad(got.square().sum(), dense.sinks)
        assert_close(grad_got, grad_want)
    assert DenseSelfAttention(6, 4).sinks is None
