"""GraphSelfAttention(attention="gatv2") against torch_geometric's GATv2Conv, weights copied."""

import pytest
import torch
from conftest import GRAPHS, assert_agrees_with_pyg, assert_close
from torch_geometric.nn import GATv2Conv

from graphattn.functional import edge_attention
from graphattn.nn import GAT, GraphSelfAttention
from graphattn.nn.attention import add_remaining_self_loops

DTYPE = torch.float64


def copy_gatv2_into(layer: GraphSelfAttention, conv: GATv2Conv) -> None:
    """lin_r -> lin_q, lin_l -> lin_k and lin_v (GATv2Conv's value is its key), att -> att.

    GATv2Conv adds its bias after aggregating; alpha sums to 1 over each target's edges, so the
    same bias on every value is that bias on out.
    """
    H = conv.heads
    with torch.no_grad():
        layer.lin_q.weight.copy_(conv.lin_r.weight)
        layer.lin_q.bias.copy_(conv.lin_r.bias)
        layer.lin_k.weight.copy_(conv.lin_l.weight)
        layer.lin_k.bias.copy_(conv.lin_l.bias)
        layer.lin_v.weight.copy_(conv.lin_l.weight)
        out_bias = conv.bias if conv.concat else conv.bias.repeat(H)
        layer.lin_v.bias.copy_(conv.lin_l.bias + out_bias)
        layer.att.copy_(conv.att[0])


def make_pair(in_channels, C, H, *, concat=True, backend="auto", seed=0, **options):
    """GATv2Conv and the layer with its weights; ``options``: ``negative_slope``,
    ``residual``, ``share_weights``, ``edge_dim``, ``fill_value`` (and ``edge_mode``, ours
    alone)."""
    torch.manual_seed(seed)
    pyg_options = {k: v for k, v in options.items() if k != "edge_mode"}
    conv = GATv2Conv(in_channels, C, H, concat=concat, **pyg_options).to(DTYPE)
    with torch.no_grad():  # GATv2Conv zero-initialises its biases: make them matter
        for b in (conv.bias, conv.lin_l.bias, conv.lin_r.bias):
            b.normal_()
    layer = GraphSelfAttention(in_channels, C, H, concat=concat, attention="gatv2",
                               out_proj=False, backend=backend, **options).to(DTYPE)
    copy_gatv2_into(layer, conv)
    if layer.res is not None:
        with torch.no_grad():
            layer.res.weight.copy_(conv.res.weight)
            layer.res.bias.zero_()  # PyG's residual has no bias of its own
    return layer, conv


def requires_grad(x):
    if isinstance(x, tuple):
        return tuple(t.clone().requires_grad_() for t in x)
    return x.clone().requires_grad_()


def grads(x):
    return [t.grad for t in x] if isinstance(x, tuple) else [x.grad]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
@pytest.mark.parametrize("heads", [1, 3])
def test_matches_gatv2conv(graph_case, concat, heads, backend):
    F_src, F_dst, C = 5, 4, 6
    bipartite = graph_case.bipartite
    layer, conv = make_pair((F_src, F_dst) if bipartite else F_src, C, heads, concat=concat,
                            backend=backend)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(graph_case.num_src, F_src, generator=gen, dtype=DTYPE)
    if bipartite:
        x = (x, torch.randn(graph_case.num_dst, F_dst, generator=gen, dtype=DTYPE))
    ei = graph_case.edge_index
    x_ours, x_ref = requires_grad(x), requires_grad(x)

    out, (ei_ours, alpha) = layer(x_ours, ei, return_attention_weights=True)
    ref, (ei_ref, alpha_ref) = conv(x_ref, ei, return_attention_weights=True)
    assert out.shape == ref.shape == (graph_case.num_dst, heads * C if concat else C)
    assert_close(out, ref)
    assert torch.equal(ei_ours, ei_ref)  # the same self-loop handling and edge order
    assert_close(alpha, alpha_ref)

    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    for g_ours, g_ref in zip(grads(x_ours), grads(x_ref), strict=True):
        assert_close(g_ours, g_ref)
    # Parameter gradients: GATv2Conv's lin_l serves as our key and value projections.
    assert_close(conv.att.grad[0], layer.att.grad)
    assert_close(conv.lin_r.weight.grad, layer.lin_q.weight.grad)
    assert_close(conv.lin_l.weight.grad, layer.lin_k.weight.grad + layer.lin_v.weight.grad)
    assert_close(conv.lin_l.bias.grad, layer.lin_k.bias.grad + layer.lin_v.bias.grad)
    bias_grad = layer.lin_v.bias.grad
    assert_close(conv.bias.grad, bias_grad if concat else bias_grad.view(heads, C).sum(0))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_matches_gatv2conv_with_residual_and_another_slope(graph_case, backend):
    F_src, F_dst = 5, 4
    bipartite = graph_case.bipartite
    layer, conv = make_pair((F_src, F_dst) if bipartite else F_src, 6, 2, backend=backend,
                            negative_slope=0.3, residual=True)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(graph_case.num_src, F_src, generator=gen, dtype=DTYPE)
    if bipartite:
        x = (x, torch.randn(graph_case.num_dst, F_dst, generator=gen, dtype=DTYPE))
    assert_agrees_with_pyg(layer, conv, x, graph_case.edge_index)
    assert_close(layer.res.weight.grad, conv.res.weight.grad)
    assert_close(layer.att.grad, conv.att.grad[0])


def test_matches_gatv2conv_with_shared_weights(graph_case):
    """``share_weights=True``: ``lin_k`` is ``lin_q``, as GATv2Conv's ``lin_r`` is its
    ``lin_l``; the shared matrix's gradient sums the query, key (and, there, value) uses."""
    F = 5
    layer, conv = make_pair((F, F) if graph_case.bipartite else F, 6, 2, share_weights=True)
    assert layer.lin_k is layer.lin_q and conv.lin_r is conv.lin_l
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(graph_case.num_src, F, generator=gen, dtype=DTYPE)
    if graph_case.bipartite:
        x = (x, torch.randn(graph_case.num_dst, F, generator=gen, dtype=DTYPE))
    assert_agrees_with_pyg(layer, conv, x, graph_case.edge_index)
    assert_close(conv.lin_l.weight.grad, layer.lin_q.weight.grad + layer.lin_v.weight.grad)
    assert_close(layer.att.grad, conv.att.grad[0])


@pytest.mark.parametrize("num_dst", [4, 5], ids=["fewer-targets", "as-many-targets"])
def test_one_projection_for_queries_keys_and_values_on_a_bipartite_graph(num_dst):
    """``share_weights=True`` with ``share_value=True`` is ``GATv2Conv(share_weights=True)``,
    whose ``lin_l`` projects queries, keys and values: on a bipartite input the queries still
    come from ``x_dst``, also when it has as many rows as ``x_src``."""
    F, C, H = 5, 6, 2
    torch.manual_seed(0)
    conv = GATv2Conv(F, C, H, share_weights=True).to(DTYPE)
    layer = GraphSelfAttention(F, C, H, attention="gatv2", out_proj=False, share_weights=True,
                               share_value=True, out_bias=True).to(DTYPE)
    assert layer.lin_q is layer.lin_k is layer.lin_v
    with torch.no_grad():
        for b in (conv.bias, conv.lin_l.bias):
            b.normal_()
        layer.lin_q.weight.copy_(conv.lin_l.weight)
        layer.lin_q.bias.copy_(conv.lin_l.bias)
        layer.att.copy_(conv.att[0])
        layer.out_bias.copy_(conv.bias)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, F, generator=gen, dtype=DTYPE),
         torch.randn(num_dst, F, generator=gen, dtype=DTYPE))
    edge_index = torch.tensor([[0, 1, 4, 2, 3, 0], [0, 0, 1, 1, 1, 2]])
    assert_agrees_with_pyg(layer, conv, x, edge_index)
    assert_close(layer.lin_q.weight.grad, conv.lin_l.weight.grad)


def test_att_is_initialised_like_gatv2convs():
    """``att`` is Glorot-uniform as ``GATv2Conv``'s: within the same bound sqrt(6 / (H + C))
    and with the same spread (at zero every head would start from uniform weights), and
    ``reset_parameters`` draws it again."""
    torch.manual_seed(0)
    H, C = 8, 16
    layer = GraphSelfAttention(4, C, H, attention="gatv2")
    conv = GATv2Conv(4, C, H)
    bound = (6 / (H + C)) ** 0.5
    assert layer.att.abs().max() <= bound and conv.att.abs().max() <= bound
    assert 0.8 < layer.att.std() / conv.att.std() < 1.25
    before = layer.att.detach().clone()
    layer.reset_parameters()
    assert not torch.equal(layer.att, before)


def test_shared_weights_need_one_feature_size():
    with pytest.raises(ValueError, match=r"share_weights=True needs the same features for "
                                         r"sources and targets, got in_channels=\(5, 4\)"):
        GraphSelfAttention((5, 4), 6, attention="gatv2", share_weights=True)


def test_edge_features_add_a_score_bias_per_head():
    """With edge_dim the score gains lin_edge(edge_attr) [E, H] after the attention vector."""
    case = next(g for g in GRAPHS if g.name == "multi-edges")
    torch.manual_seed(0)
    layer = GraphSelfAttention(5, 4, 2, attention="gatv2", edge_dim=3, out_proj=False,
                               add_self_loops=False).to(DTYPE)
    n, e = case.num_src, case.edge_index.size(1)
    x = torch.randn(n, 5, dtype=DTYPE)
    edge_attr = torch.randn(e, 3, dtype=DTYPE)
    out, (ei, alpha) = layer(x, case.edge_index, edge_attr, return_attention_weights=True)
    q = layer.lin_q(x).view(n, 2, 4)
    k = layer.lin_k(x).view(n, 2, 4)
    v = layer.lin_v(x).view(n, 2, 4)
    ref, ref_alpha = edge_attention(q, k, v, case.edge_index, bias=layer.lin_edge(edge_attr),
                                    score="gatv2", att=layer.att, backend="reference",
                                    return_attention=True)
    assert torch.equal(ei, case.edge_index)
    assert_close(out, ref.flatten(1))
    assert_close(alpha, ref_alpha)
    # by hand, for the target of edge 0: softmax over its in-edges of a . LeakyReLU(q_i + k_j)
    # + w . e_ij
    target = case.edge_index[1, 0]
    edges = (case.edge_index[1] == target).nonzero().view(-1)
    z = torch.nn.functional.leaky_relu(q[target] + k[case.edge_index[0, edges]], 0.2)
    s = (layer.att * z).sum(-1) + edge_attr[edges] @ layer.lin_edge.weight.t()  # (deg, H)
    assert_close(alpha[edges], torch.softmax(s, dim=0))


def test_gat_model_trains_with_the_gatv2_score():
    """A GAT with attention="gatv2" fits a small graph task on the cpu backend."""
    torch.manual_seed(0)
    n = 60
    y = torch.arange(n) % 3
    x = torch.nn.functional.one_hot(y, 3).float() + 0.5 * torch.randn(n, 3)
    same = (y.view(-1, 1) == y.view(1, -1)) & (torch.rand(n, n) < 0.2)
    edge_index = same.nonzero().t()
    model = GAT(3, 3, hidden_channels=4, heads=2, dropout=0.0, attention="gatv2")
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(60):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x, edge_index), y)
        loss.backward()
        opt.step()
    assert loss.item() < 0.2
    assert all(p.grad is not None for p in model.parameters())


def test_att_exists_only_for_gatv2_and_is_required_by_the_operator():
    assert GraphSelfAttention(4, 2, 2, attention="dot").att is None
    assert GraphSelfAttention(4, 2, 2, attention="gatv2").att.shape == (2, 2)
    q = k = v = torch.randn(3, 2, 4)
    ei = add_remaining_self_loops(torch.empty(2, 0, dtype=torch.long), None, 3)[0]
    with pytest.raises(ValueError, match=r"score='gatv2' needs the attention vector att"):
        edge_attention(q, k, v, ei, score="gatv2")
    with pytest.raises(ValueError, match=r"att must have shape \[H, C\] = \[2, 4\]"):
        edge_attention(q, k, v, ei, score="gatv2", att=torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"att is used by score='gatv2' only, got score='dot'"):
        edge_attention(q, k, v, ei, att=torch.randn(2, 4))


@pytest.mark.parametrize("fill_value", ["mean", 0.5])
@pytest.mark.parametrize("backend", ["cpu", "reference", "dense"])
def test_matches_gatv2conv_with_edge_features_inside_the_leaky_relu(graph_case, backend,
                                                                      fill_value):
    """``edge_mode="key"`` is ``GATv2Conv(edge_dim=D)``: a . LeakyReLU(q_i + k_j + W^E e_ij),
    self-loops' features filled as ``fill_value`` says; inside the kernels (``cpu``), per edge
    (``reference``) and with every edge a source of its own (``dense``)."""
    F_src, F_dst, D = 5, 4, 3
    bipartite = graph_case.bipartite
    layer, conv = make_pair((F_src, F_dst) if bipartite else F_src, 6, 2, backend=backend,
                            edge_dim=D, edge_mode="key", fill_value=fill_value)
    with torch.no_grad():
        layer.lin_edge.weight.copy_(conv.lin_edge.weight)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(graph_case.num_src, F_src, generator=gen, dtype=DTYPE)
    if bipartite:
        x = (x, torch.randn(graph_case.num_dst, F_dst, generator=gen, dtype=DTYPE))
    edge_attr = torch.randn(graph_case.edge_index.size(1), D, generator=gen, dtype=DTYPE)
    assert_agrees_with_pyg(layer, conv, x, graph_case.edge_index, edge_attr)
    assert_close(layer.lin_edge.weight.grad, conv.lin_edge.weight.grad)
    assert_close(layer.att.grad, conv.att.grad[0])
