"""The layers' ``out_norm=``: each node's merged heads' output normalised (RMS or layer norm,
with learned gains) before the output projection, as BitNet's ``attn_sub_norm``; and
``out_dropout=``, a dropout of the output after the projection, before the residual.

Checked against the formula written out here (the reference operator's output, merged, then
normalised with the gains), with ``concat`` on and off, a gate and a residual; the graph
layer on the causal graph against the dense layer with the same weights, outputs and
gradients; and the property it is for: the output no longer grows with the values.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close

from graphattn import graphs
from graphattn.functional import edge_attention
from graphattn.nn import DenseSelfAttention, GraphSelfAttention, GraphTransformer


def _normalised(t: torch.Tensor, norm: torch.nn.Module, kind: str) -> torch.Tensor:
    """``t [..., D]`` normalised over its D channels with ``norm``'s gains (and biases),
    written out."""
    if kind == "layer":
        t = t - t.mean(-1, keepdim=True)
        return t / (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * norm.weight + norm.bias
    return t / (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * norm.weight


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("concat", [True, False])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_out_norm_normalises_the_merged_heads_before_lin_out(kind, concat, backend):
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    layer = GraphSelfAttention(12, 8, heads=4, concat=concat, add_self_loops=False,
                               residual=True, gate="headwise", out_norm=kind,
                               backend=backend).double()
    width = 32 if concat else 8
    assert layer.o_norm.weight.shape == (width,) and f"out_norm='{kind}'" in repr(layer)
    with torch.no_grad():
        layer.o_norm.weight.normal_(generator=gen)
        if kind == "layer":
            layer.o_norm.bias.normal_(generator=gen)
    x = torch.randn(9, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    edge_index = graphs.random_graph(9, 3, self_loops=True)
    out = layer(x, edge_index)
    q, k, v = (lin(x).view(9, 4, 8) for lin in (layer.lin_q, layer.lin_k, layer.lin_v))
    o = edge_attention(q, k, v, edge_index, backend="reference")  # (9, 4, 8)
    o = o * torch.sigmoid(layer.lin_gate(x)).unsqueeze(-1)
    merged = o.flatten(1) if concat else o.mean(1)
    want = layer.lin_out(_normalised(merged, layer.o_norm, kind)) + layer.res(x)
    assert_close(out, want)
    grads = torch.autograd.grad(out.square().sum(), [x, layer.o_norm.weight])
    wants = torch.autograd.grad(want.square().sum(), [x, layer.o_norm.weight])
    for grad, expected in zip(grads, wants, strict=True):
        assert_close(grad, expected)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_out_norm_graph_and_dense_layers_agree(kind):
    torch.manual_seed(2)
    graph = GraphSelfAttention(16, 8, heads=2, out_norm=kind, add_self_loops=False,
                               backend="cpu")
    dense = DenseSelfAttention(16, 8, heads=2, out_norm=kind)
    with torch.no_grad():
        graph.o_norm.weight.uniform_(0.5, 2.0)
    dense.load_state_dict(graph.state_dict())
    assert repr(dense) == f"DenseSelfAttention(16, 8, heads=2, out_norm='{kind}')"
    x = torch.randn(11, 16, requires_grad=True)
    out_g, out_d = graph(x, graphs.causal_graph(11)), dense(x, is_causal=True)
    assert_close(out_g, out_d)
    grad_g = torch.autograd.grad(out_g.square().sum(), [x, graph.o_norm.weight])
    grad_d = torch.autograd.grad(out_d.square().sum(), [x, dense.o_norm.weight])
    for g, d in zip(grad_g, grad_d, strict=True):
        assert_close(g, d)


def test_out_norm_keeps_the_output_at_the_scale_of_its_gains():
    # values 1000 times larger: without out_norm the output grows 1000-fold (the weights
    # do not change: the values do not enter the scores); with it, nothing changes
    torch.manual_seed(3)
    x, edge_index = torch.randn(10, 8), graphs.random_graph(10, 4, self_loops=True)
    for out_norm, same in (("rms", True), (None, False)):
        layer = GraphSelfAttention(8, 4, heads=2, add_self_loops=False, bias=False,
                                   out_norm=out_norm)
        before = layer(x, edge_index)
        with torch.no_grad():
            layer.lin_v.weight.mul_(1000.0)
        after = layer(x, edge_index)
        assert torch.allclose(before, after, rtol=1e-4, atol=1e-4) == same
        if not same:
            assert_close(after, before * 1000.0, rtol=1e-4, atol=1e-3)


def test_graph_transformer_passes_out_norm_to_its_layers():
    model = GraphTransformer(8, 16, 3, num_layers=2, heads=2, out_norm="layer", dropout=0.0)
    assert all(isinstance(a.o_norm, torch.nn.LayerNorm) and a.out_norm == "layer"
               for a in model.attns)
    x, edge_index = torch.randn(7, 8), torch.randint(0, 7, (2, 20))
    assert model(x, edge_index).shape == (7, 3)


def test_out_norm_errors_and_reset():
    with pytest.raises(ValueError, match=r"out_norm must be None or one of \['rms', 'layer'\], "
                       r"got 'l2'"):
        GraphSelfAttention(8, 4, out_norm="l2")
    with pytest.raises(ValueError, match="out_norm must be None or one of"):
        DenseSelfAttention(8, 4, out_norm=True)
    with pytest.raises(ValueError, match=r"out_norm must be None or one of .*got \['rms'\]"):
        DenseSelfAttention(8, 4, out_norm=["rms"])  # (a list was looked up in a dict)
    layer = GraphSelfAttention(8, 4, heads=2, out_norm="layer")
    with torch.no_grad():
        layer.o_norm.weight.fill_(3.0)
        layer.o_norm.bias.fill_(2.0)
    layer.reset_parameters()
    assert_close(layer.o_norm.weight.detach(), torch.ones(8))
    assert_close(layer.o_norm.bias.detach(), torch.zeros(8))


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_out_dropout_drops_the_projected_output_before_the_residual(dense):
    # in training each entry of lin_out's output is zeroed or scaled by 1 / (1 - p), and the
    # residual added after it is kept whole; in eval mode nothing is dropped
    torch.manual_seed(4)
    kwargs = dict(heads=2, residual=True, out_dropout=0.5)
    layer = (DenseSelfAttention(16, 8, **kwargs) if dense
             else GraphSelfAttention(16, 8, add_self_loops=False, backend="cpu", **kwargs))
    assert "out_dropout=0.5" in repr(layer)
    x, graph = torch.randn(30, 16), graphs.causal_graph(30)
    run = (lambda: layer(x, is_causal=True)) if dense else (lambda: layer(x, graph))
    layer.eval()
    want, skip = run(), layer.res(x)
    assert_close(run(), want)  # (nothing dropped)
    layer.train()
    got = run() - skip
    kept = got != 0
    assert 0.35 < kept.float().mean() < 0.65
    assert_close(got[kept], 2 * (want - skip)[kept])
    with pytest.raises(ValueError, match="out_dropout"):
        GraphSelfAttention(8, 4, out_dropout=1.5)
