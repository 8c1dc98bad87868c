"""GraphSelfAttention(attention="additive") against torch_geometric's GATConv, weights copied."""

import pytest
import torch
from conftest import GRAPHS, assert_agrees_with_pyg, assert_close
from torch_geometric.nn import GATConv

from graphattn.nn import GraphSelfAttention

DTYPE = torch.float64


def gat_weights(gat: GATConv):
    """GATConv's ``W_src, W_dst`` as ``[H, C, F]`` (the same matrix unless bipartite)."""
    H, C = gat.heads, gat.out_channels
    lin_src = gat.lin if gat.lin is not None else gat.lin_src
    lin_dst = gat.lin if gat.lin is not None else gat.lin_dst
    return lin_src.weight.view(H, C, -1), lin_dst.weight.view(H, C, -1)


def copy_gat_into(layer: GraphSelfAttention, gat: GATConv) -> None:
    """Fold GATConv's attention vectors into lin_q / lin_k; lin_v is W, its bias GATConv's."""
    H = gat.heads
    W_src, W_dst = gat_weights(gat)
    with torch.no_grad():
        layer.lin_q.weight.copy_(torch.einsum("hc,hcf->hf", gat.att_dst[0], W_dst))
        layer.lin_k.weight.copy_(torch.einsum("hc,hcf->hf", gat.att_src[0], W_src))
        layer.lin_v.weight.copy_(W_src.reshape(-1, W_src.size(-1)))
        layer.lin_q.bias.zero_()
        layer.lin_k.bias.zero_()
        if layer.lin_v.bias is None:  # GAT's layers: the bias comes after the sum, as GATConv's
            layer.out_bias.copy_(gat.bias)
        else:  # alpha sums to 1 over each target's edges: a bias on every value is one on out
            layer.lin_v.bias.copy_(gat.bias if gat.concat else gat.bias.repeat(H))
        if gat.lin_edge is not None:
            W_edge = gat.lin_edge.weight.view(H, gat.out_channels, -1)
            layer.lin_edge.weight.copy_(torch.einsum("hc,hcd->hd", gat.att_edge[0], W_edge))


def make_pair(in_channels, C, H, *, concat=True, edge_dim=None, seed=0, **options):
    """GATConv and the layer with its weights; ``options``: ``negative_slope``, ``residual``,
    ``fill_value``."""
    torch.manual_seed(seed)
    gat = GATConv(in_channels, C, H, concat=concat, edge_dim=edge_dim, **options).to(DTYPE)
    with torch.no_grad():
        gat.bias.normal_()  # GATConv zero-initialises it: make it matter
    layer = GraphSelfAttention(in_channels, C, H, concat=concat, edge_dim=edge_dim,
                               attention="additive", out_proj=False, **options).to(DTYPE)
    copy_gat_into(layer, gat)
    if layer.res is not None:
        with torch.no_grad():
            layer.res.weight.copy_(gat.res.weight)
            layer.res.bias.zero_()  # PyG's residual has no bias of its own
    return layer.eval(), gat.eval()


def inputs(case, F_src, F_dst, edge_dim, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x_src = torch.randn(case.num_src, F_src, generator=gen, dtype=DTYPE)
    if case.bipartite:
        x = (x_src, torch.randn(case.num_dst, F_dst, generator=gen, dtype=DTYPE))
    else:
        x = x_src
    e = case.edge_index.size(1)
    edge_attr = (torch.randn(e, edge_dim, generator=gen, dtype=DTYPE)
                 if edge_dim is not None else None)
    return x, edge_attr


def requires_grad(x):
    if isinstance(x, tuple):
        return tuple(t.clone().requires_grad_() for t in x)
    return x.clone().requires_grad_()


def grads(x):
    return [t.grad for t in x] if isinstance(x, tuple) else [x.grad]


@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
@pytest.mark.parametrize("edge_dim", [None, 3], ids=["no-edge-attr", "edge-attr"])
@pytest.mark.parametrize("heads", [1, 3])
def test_matches_gatconv(graph_case, concat, edge_dim, heads):
    F_src, F_dst, C = 5, 4, 6
    in_channels = (F_src, F_dst) if graph_case.bipartite else F_src
    layer, gat = make_pair(in_channels, C, heads, concat=concat, edge_dim=edge_dim)
    x, edge_attr = inputs(graph_case, F_src, F_dst, edge_dim)
    ei = graph_case.edge_index
    x_ours, x_ref = requires_grad(x), requires_grad(x)

    out, (ei_ours, alpha) = layer(x_ours, ei, edge_attr, return_attention_weights=True)
    ref, (ei_ref, alpha_ref) = gat(x_ref, ei, edge_attr, return_attention_weights=True)
    assert out.shape == ref.shape == (graph_case.num_dst, heads * C if concat else C)
    assert_close(out, ref)
    assert torch.equal(ei_ours, ei_ref)  # the same self-loop handling and edge order
    assert_close(alpha, alpha_ref)
    assert ((alpha >= 0) & (alpha <= 1)).all()

    # Input gradients, through a loss that weighs every output differently.
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    for g_ours, g_ref in zip(grads(x_ours), grads(x_ref), strict=True):
        assert_close(g_ours, g_ref)

    # Parameter gradients, mapped to GATConv's parameters by the chain rule.
    W_src, W_dst = gat_weights(gat)
    gq = layer.lin_q.weight.grad  # (H, F_dst)
    gk = layer.lin_k.weight.grad  # (H, F_src)
    gv = layer.lin_v.weight.grad.view(heads, C, -1)  # (H, C, F_src)
    assert_close(gat.att_dst.grad[0], torch.einsum("hf,hcf->hc", gq, W_dst))
    assert_close(gat.att_src.grad[0], torch.einsum("hf,hcf->hc", gk, W_src))
    if gat.lin is not None:
        expected = (gv + gat.att_src[0].unsqueeze(-1) * gk.unsqueeze(1)
                    + gat.att_dst[0].unsqueeze(-1) * gq.unsqueeze(1))
        assert_close(gat.lin.weight.grad.view(heads, C, -1), expected)
    else:
        assert_close(gat.lin_src.weight.grad.view(heads, C, -1),
                     gv + gat.att_src[0].unsqueeze(-1) * gk.unsqueeze(1))
        assert_close(gat.lin_dst.weight.grad.view(heads, C, -1),
                     gat.att_dst[0].unsqueeze(-1) * gq.unsqueeze(1))
    bias_grad = layer.lin_v.bias.grad
    assert_close(gat.bias.grad, bias_grad if concat else bias_grad.view(heads, C).sum(0))
    if edge_dim is not None:
        W_edge = gat.lin_edge.weight.view(heads, C, -1)
        assert_close(gat.att_edge.grad[0],
                     torch.einsum("hd,hcd->hc", layer.lin_edge.weight.grad, W_edge))


@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
def test_matches_gatconv_with_residual_and_another_slope(graph_case, concat):
    F_src, F_dst, C, H = 5, 4, 6, 2
    in_channels = (F_src, F_dst) if graph_case.bipartite else F_src
    layer, gat = make_pair(in_channels, C, H, concat=concat, negative_slope=0.05, residual=True)
    x, _ = inputs(graph_case, F_src, F_dst, None)
    assert_agrees_with_pyg(layer, gat, x, graph_case.edge_index)
    assert_close(layer.res.weight.grad, gat.res.weight.grad)


@pytest.mark.parametrize("fill_value", ["add", "max", "min", "mul", 0.5, "tensor"])
def test_self_loop_features_follow_fill_value_like_gatconv(graph_case, fill_value):
    if fill_value == "tensor":
        fill_value = torch.tensor([0.5, -1.0, 2.0], dtype=DTYPE)
    F_src, F_dst, C, H = 5, 4, 6, 2
    in_channels = (F_src, F_dst) if graph_case.bipartite else F_src
    layer, gat = make_pair(in_channels, C, H, edge_dim=3, fill_value=fill_value)
    x, edge_attr = inputs(graph_case, F_src, F_dst, 3)
    out, (ei, alpha) = layer(x, graph_case.edge_index, edge_attr, return_attention_weights=True)
    ref, (ei_ref, alpha_ref) = gat(x, graph_case.edge_index, edge_attr,
                                   return_attention_weights=True)
    assert torch.equal(ei, ei_ref)
    assert_close(alpha, alpha_ref)
    assert_close(out, ref)


def test_one_dimensional_edge_attr_matches_gatconv():
    """With ``edge_dim=1`` an ``edge_attr`` of shape ``[E]`` is taken as ``[E, 1]``, as
    ``GATConv`` takes it."""
    case = next(g for g in GRAPHS if g.name == "multi-edges")
    layer, gat = make_pair(5, 4, 2, edge_dim=1)
    x, edge_attr = inputs(case, 5, 5, 1)
    assert_close(layer(x, case.edge_index, edge_attr.view(-1)),
                 gat(x, case.edge_index, edge_attr.view(-1)))


def test_matches_gatconv_with_attention_dropout_in_eval_mode():
    case = next(g for g in GRAPHS if g.name == "chain")
    torch.manual_seed(0)
    gat = GATConv(5, 4, 2, dropout=0.5).to(DTYPE).eval()
    layer = GraphSelfAttention(5, 4, 2, dropout=0.5, attention="additive",
                               out_proj=False).to(DTYPE).eval()
    copy_gat_into(layer, gat)
    x, _ = inputs(case, 5, 5, None)
    assert_close(layer(x, case.edge_index), gat(x, case.edge_index))


def test_folded_initialisation_has_gat_score_scale():
    """At init, the folded score terms a^T W x have the spread of GATConv's (same order)."""
    torch.manual_seed(0)
    x = torch.randn(2000, 64)
    ours, ref = [], []
    for _ in range(20):
        layer = GraphSelfAttention(64, 8, 8, attention="additive", out_proj=False)
        gat = GATConv(64, 8, 8)
        _, W = gat_weights(gat)
        folded = torch.einsum("hc,hcf->hf", gat.att_dst[0], W)
        ours.append(layer.lin_q(x).std())
        ref.append((x @ folded.t()).std())
    ratio = torch.stack(ours).mean() / torch.stack(ref).mean()
    assert 0.5 < ratio < 2.0, ratio


def test_edge_weights_are_glorot_initialised():
    """``lin_edge`` is Glorot-uniform, as ``GATConv``'s is (not ``Linear``'s default): within
    sqrt(6 / (fan_in + fan_out)) and spread over it (the std of U(-b, b) is b / sqrt(3))."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(4, 2, 64, attention="additive", edge_dim=64)
    bound = (6 / (64 + 64)) ** 0.5
    weight = layer.lin_edge.weight
    assert weight.abs().max() <= bound
    assert 0.9 < weight.std() / (bound / 3**0.5) < 1.1
