"""The layers' sigmoid gate of each target's attention output (gate="elementwise"/"headwise")."""

import pytest
import torch
from conftest import assert_close

from graphattn import graphs
from graphattn.functional import edge_attention
from graphattn.nn import DenseSelfAttention, GraphSelfAttention

H, C = 4, 8


@pytest.mark.parametrize("concat", [True, False])
@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_gate_multiplies_each_head_output_by_a_sigmoid_of_the_target(gate, concat):
    """out = lin_out(merge(o * sigmoid(W^G x_i + b^G))), written out from the operator, for a
    bipartite graph (the gate reads the targets' features)."""
    torch.manual_seed(0)
    layer = GraphSelfAttention((12, 16), C, heads=H, gate=gate, concat=concat,
                               add_self_loops=False)
    torch.nn.init.normal_(layer.lin_gate.bias)  # (0 at first)
    x_src, x_dst = torch.randn(9, 12), torch.randn(5, 16)
    edge_index = torch.stack([torch.randint(0, 9, (30,)), torch.randint(0, 5, (30,))])
    out = layer((x_src, x_dst), edge_index)
    q = layer.lin_q(x_dst).view(5, H, C)
    k, v = (lin(x_src).view(9, H, C) for lin in (layer.lin_k, layer.lin_v))
    o = edge_attention(q, k, v, edge_index, backend="reference")
    g = torch.sigmoid(x_dst @ layer.lin_gate.weight.T + layer.lin_gate.bias)
    g = g.view(5, H, C if gate == "elementwise" else 1)
    merged = (o * g).flatten(1) if concat else (o * g).mean(1)
    assert_close(out, layer.lin_out(merged))
    assert layer.lin_gate.out_features == (H * C if gate == "elementwise" else H)


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_graph_and_dense_layers_gate_alike(gate):
    """state_dicts load across the two layers, gate included; on the causal graph they
    compute the same, gradients of the gate's weights too."""
    torch.manual_seed(1)
    graph = GraphSelfAttention(16, C, heads=H, gate=gate, add_self_loops=False)
    dense = DenseSelfAttention(16, C, heads=H, gate=gate)
    dense.load_state_dict(graph.state_dict())
    x = torch.randn(10, 16)
    out_g, out_d = graph(x, graphs.causal_graph(10)), dense(x, is_causal=True)
    assert_close(out_g, out_d)
    out_g.square().sum().backward()
    out_d.square().sum().backward()
    assert_close(graph.lin_gate.weight.grad, dense.lin_gate.weight.grad)


def test_a_closed_gate_shuts_the_attention_out():
    """With the gate's bias far below 0, the output is the output projection's bias alone:
    the target takes nothing from its neighbours."""
    layer = GraphSelfAttention(16, C, heads=H, gate="headwise")
    with torch.no_grad():
        layer.lin_gate.weight.zero_()
        layer.lin_gate.bias.fill_(-100.0)
    out = layer(torch.randn(6, 16), graphs.complete_graph(6))
    assert_close(out, layer.lin_out.bias.expand(6, -1))


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_gate_on_a_graph_without_nodes(gate):
    # (the gate's view once took -1 for its last size, which a tensor of 0 elements cannot
    # resolve)
    graph = GraphSelfAttention(16, C, heads=H, gate=gate)
    x = torch.randn(0, 16, requires_grad=True)
    out = graph(x, torch.zeros(2, 0, dtype=torch.long))
    assert out.shape == (0, H * C)
    out.sum().backward()
    assert x.grad.shape == (0, 16)
    dense = DenseSelfAttention(16, C, heads=H, gate=gate)
    assert dense(torch.randn(2, 0, 16), is_causal=True).shape == (2, 0, H * C)


def test_gate_reprs_lazy_sizes_and_errors():
    layer = GraphSelfAttention(-1, C, heads=H, gate="elementwise")
    assert repr(layer) == "GraphSelfAttention(-1, 8, heads=4, gate='elementwise')"
    assert layer(torch.randn(5, 7), graphs.complete_graph(5)).shape == (5, H * C)
    assert layer.lin_gate.in_features == 7
    assert repr(DenseSelfAttention(16, C, heads=H, gate="headwise")) == (
        "DenseSelfAttention(16, 8, heads=4, gate='headwise')")
    with pytest.raises(ValueError, match="gate must be None or one of .*got 'channel'"):
        GraphSelfAttention(16, C, gate="channel")
    additive = GraphSelfAttention((12, 16), C, heads=H, attention="additive", gate="headwise",
                                  add_self_loops=False)
    with pytest.raises(ValueError, match="x_dst is None, but gate='headwise' gates"):
        additive((torch.randn(4, 12), None), torch.tensor([[0, 1], [1, 2]]))
