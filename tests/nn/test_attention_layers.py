import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
import torch.nn.utils.prune
from conftest import GRAPHS, assert_agrees_with_pyg, assert_close, dense_mask, random_graph
from torch import Tensor
from torch_geometric.nn import TransformerConv

from graphattn import graphs
from graphattn.functional import dropout_mask, edge_attention, edge_terms
from graphattn.graphs import to_sparse_adjacency
from graphattn.nn import GAT, DenseSelfAttention, GraphSelfAttention, GraphTransformer
from graphattn.nn import attention as attention_module


def complete_edges(n):
    return torch.cartesian_prod(torch.arange(n), torch.arange(n)).t()  # j -> i for all pairs


def causal_edges(n):
    j, i = torch.tril_indices(n, n, offset=0).flip(0)  # rows (i >= j) -> edge j -> i
    return torch.stack([j, i])


def copy_into_mha(layer, mha):
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([layer.lin_q.weight, layer.lin_k.weight,
                                            layer.lin_v.weight]))
        mha.in_proj_bias.copy_(torch.cat([layer.lin_q.bias, layer.lin_k.bias, layer.lin_v.bias]))
        mha.out_proj.weight.copy_(layer.lin_out.weight)
        mha.out_proj.bias.copy_(layer.lin_out.bias)


def param_grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def test_complete_graph_equals_dense_and_multihead_attention():
    torch.manual_seed(0)
    N, H, C = 9, 4, 6
    graph = GraphSelfAttention(H * C, C, heads=H)
    dense = DenseSelfAttention(H * C, C, heads=H)
    dense.load_state_dict(graph.state_dict())
    mha = torch.nn.MultiheadAttention(H * C, H)
    copy_into_mha(graph, mha)

    x = torch.randn(N, H * C)
    xs = [x.clone().requires_grad_() for _ in range(3)]
    out_g = graph(xs[0], complete_edges(N))
    out_d = dense(xs[1])
    out_m, _ = mha(xs[2], xs[2], xs[2], need_weights=False)
    assert_close(out_g, out_m)
    assert_close(out_d, out_m)

    for out in (out_g, out_d, out_m):
        out.square().sum().backward()
    assert_close(xs[0].grad, xs[2].grad)
    assert_close(xs[1].grad, xs[2].grad)
    g_graph, g_dense = param_grads(graph), param_grads(dense)
    for name in g_graph:
        assert_close(g_graph[name], g_dense[name])
    assert_close(torch.cat([g_graph[f"lin_{p}.weight"] for p in "qkv"]), mha.in_proj_weight.grad)
    assert_close(g_graph["lin_out.weight"], mha.out_proj.weight.grad)


def test_bias_false_equals_multihead_attention_without_bias():
    """``bias=False`` leaves no bias anywhere, ``lin_out``'s included: the layer has exactly the
    parameters of ``MultiheadAttention(bias=False)`` and, with them copied, its output."""
    torch.manual_seed(0)
    N, H, C = 6, 2, 3
    layer = GraphSelfAttention(H * C, C, heads=H, bias=False)
    mha = torch.nn.MultiheadAttention(H * C, H, bias=False)
    assert [name for name, _ in layer.named_parameters() if "bias" in name] == []
    assert (sum(p.numel() for p in layer.parameters())
            == sum(p.numel() for p in mha.parameters()))
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([layer.lin_q.weight, layer.lin_k.weight,
                                            layer.lin_v.weight]))
        mha.out_proj.weight.copy_(layer.lin_out.weight)
    x = torch.randn(N, H * C)
    assert_close(layer(x, complete_edges(N)), mha(x, x, x, need_weights=False)[0])


def test_residual_layers_load_across_and_agree_on_the_complete_graph():
    """``residual=True`` adds ``res`` to both twins; with a shared state_dict the graph layer on
    the complete graph computes the dense layer's output plus the same skip term."""
    torch.manual_seed(0)
    N, F, H, C = 7, 5, 2, 3
    graph = GraphSelfAttention(F, C, heads=H, residual=True)
    dense = DenseSelfAttention(F, C, heads=H, residual=True)
    dense.load_state_dict(graph.state_dict())
    assert graph.res.weight.shape == (H * C, F) and graph.res.bias.shape == (H * C,)
    x = torch.randn(N, F)
    out = graph(x, complete_edges(N))
    assert_close(out, dense(x))
    plain = GraphSelfAttention(F, C, heads=H)
    plain.load_state_dict({k: v for k, v in graph.state_dict().items() if not k.startswith("res")})
    assert_close(out, plain(x, complete_edges(N)) + graph.res(x))
    assert GraphSelfAttention(F, C, residual=True, bias=False).res.bias is None


def test_causal_graph_equals_dense_is_causal():
    torch.manual_seed(1)
    N, H, C = 8, 2, 4
    graph = GraphSelfAttention(5, C, heads=H)
    dense = DenseSelfAttention(5, C, heads=H)
    dense.load_state_dict(graph.state_dict())
    x = torch.randn(N, 5, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out_g = graph(x, causal_edges(N))
    out_d = dense(x2, is_causal=True)
    assert_close(out_g, out_d)
    out_g.sum().backward()
    out_d.sum().backward()
    assert_close(x.grad, x2.grad)
    for name, grad in param_grads(graph).items():
        assert_close(grad, param_grads(dense)[name])


@pytest.mark.parametrize("residual", [False, True])
def test_batched_dense_matches_per_sequence_graph(residual):
    torch.manual_seed(2)
    B, L = 3, 5
    graph = GraphSelfAttention(6, 3, heads=2, concat=False, residual=residual)
    dense = DenseSelfAttention(6, 3, heads=2, concat=False, residual=residual)
    dense.load_state_dict(graph.state_dict())
    x = torch.randn(B, L, 6)
    masks = torch.rand(B, L, L, generator=torch.Generator().manual_seed(0)) < 0.5
    masks |= torch.eye(L, dtype=torch.bool)  # the graph layer adds self-loops
    out = dense(x, masks)
    for b in range(B):
        i, j = masks[b].nonzero().t()
        assert_close(out[b], graph(x[b], torch.stack([j, i])))
    assert out.shape == (B, L, 3)


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_global_attention_over_a_pyg_batch_four_ways(backend):
    # Graph transformers attend over all nodes of each graph of a mini-batch. The layer on
    # graphs.batch_complete_graph(batch), the dense twin on the padded batch with the node mask
    # as key mask, the dense twin given the batch vector, and the layer on each graph's complete
    # graph alone agree: outputs on the real nodes and parameter gradients.
    from torch_geometric.data import Batch, Data
    from torch_geometric.utils import to_dense_batch

    from graphattn import graphs

    torch.manual_seed(3)
    sizes = [4, 1, 6, 3]
    data = Batch.from_data_list([Data(x=torch.randn(n, 6)) for n in sizes])
    graph = GraphSelfAttention(6, 3, heads=2, add_self_loops=False, backend=backend)
    dense = DenseSelfAttention(6, 3, heads=2)
    dense.load_state_dict(graph.state_dict())

    out = graph(data.x, graphs.batch_complete_graph(data.batch))  # (N, 6)
    x_pad, node_mask = to_dense_batch(data.x, data.batch)  # (B, L_max, 6), (B, L_max)
    out_pad = dense(x_pad, node_mask.unsqueeze(1))  # (B, L_max, 6)

    def per_graph():
        return torch.cat([graph(g.x, graphs.complete_graph(g.num_nodes))
                          for g in data.to_data_list()])  # (N, 6)

    assert_close(out, per_graph())
    assert_close(out_pad[node_mask], per_graph())

    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    grads = param_grads(graph)
    graph.zero_grad()
    (per_graph() * weights).sum().backward()
    for name, g in param_grads(graph).items():
        assert_close(grads[name], g)
    (out_pad[node_mask] * weights).sum().backward()
    for name, g in param_grads(dense).items():
        assert_close(grads[name], g)
    dense.zero_grad()
    out_batch = dense(data.x, batch=data.batch)  # (N, 6)
    assert_close(out_batch, per_graph())
    (out_batch * weights).sum().backward()
    for name, g in param_grads(dense).items():
        assert_close(grads[name], g)
    with pytest.raises(ValueError, match=r"with batch, x must have shape \[N, F\] .*got "
                                         r"\[4, 6, 6\]"):
        dense(x_pad, batch=data.batch)


def test_force_matching_through_global_attention_over_a_pyg_batch():
    # Training on forces (F = -dE/dx, as molecular models do) differentiates a gradient: the
    # dense twin, with the batch vector and on the padded batch, gives the same second-order
    # parameter gradients as the layer on graphs.batch_complete_graph (reference backend).
    from torch_geometric.data import Batch, Data
    from torch_geometric.utils import to_dense_batch

    from graphattn import graphs

    torch.manual_seed(4)
    data = Batch.from_data_list([Data(x=torch.randn(n, 6)) for n in [5, 2, 9, 3]])
    graph = GraphSelfAttention(6, 3, heads=2, add_self_loops=False, backend="reference")
    dense = DenseSelfAttention(6, 3, heads=2)
    dense.load_state_dict(graph.state_dict())
    target = torch.randn(data.num_nodes, 6)

    def force_loss_grads(layer, energy_of):
        x = data.x.clone().requires_grad_()
        forces = -torch.autograd.grad(energy_of(layer, x), x, create_graph=True)[0]
        assert forces.requires_grad
        layer.zero_grad()
        (forces - target).square().sum().backward()
        return param_grads(layer)

    want = force_loss_grads(graph, lambda layer, x: layer(
        x, graphs.batch_complete_graph(data.batch)).tanh().sum())

    def padded(layer, x):
        x_pad, node_mask = to_dense_batch(x, data.batch)
        return layer(x_pad, node_mask.unsqueeze(1))[node_mask].tanh().sum()

    for energy_of in (lambda layer, x: layer(x, batch=data.batch).tanh().sum(), padded):
        got = force_loss_grads(dense, energy_of)
        for name, g in want.items():
            assert_close(got[name], g)


def test_dense_with_batch_errors_name_the_layer_arguments():
    # the layer's own arguments, x and return_attention_weights, not dense_attention's q, k, v
    # and return_attention
    dense = DenseSelfAttention(6, 3, heads=2)
    x = torch.randn(5, 6)
    with pytest.raises(ValueError, match=r"batch must have shape \[N\] = \[5\], one graph id per "
                                         r"row of x \[5, 6\], got \[4\]"):
        dense(x, batch=torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="return_attention_weights=True is not supported with "
                                         "batch"):
        dense(x, return_attention_weights=True, batch=torch.tensor([0, 0, 1, 1, 1]))


@pytest.mark.parametrize("case", GRAPHS, ids=[g.name for g in GRAPHS])
@pytest.mark.parametrize("add_self_loops", [True, False])
def test_registry_graphs_through_both_layers(case, add_self_loops, index_dtype):
    torch.manual_seed(0)
    in_ch = (5, 3) if case.bipartite else 5
    graph = GraphSelfAttention(in_ch, 4, heads=2, add_self_loops=add_self_loops, dropout=0.1)
    x_src = torch.randn(case.num_src, 5, requires_grad=True)
    x_dst = torch.randn(case.num_dst, 3, requires_grad=True) if case.bipartite else x_src
    x = (x_src, x_dst) if case.bipartite else x_src
    out, (ei, alpha) = graph(x, case.edge_index.to(index_dtype), return_attention_weights=True)
    assert out.shape == (case.num_dst, 8)
    assert torch.isfinite(out).all() and ((alpha >= 0) & (alpha <= 1)).all()
    out.sum().backward()
    assert torch.isfinite(x_src.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in graph.parameters())
    if add_self_loops:
        loops = ei[:, ei[0] == ei[1]]
        n_loops = min(case.num_src, case.num_dst)
        assert torch.equal(loops[0].sort().values, torch.arange(n_loops))

    if case.bipartite or "multi-edge" in case.tags:
        return
    dense = DenseSelfAttention(5, 4, heads=2, dropout=0.1).eval()
    dense.load_state_dict(graph.state_dict())
    graph.eval()
    edges = ei if add_self_loops else case.edge_index
    mask = dense_mask(edges, case.num_dst, case.num_src)
    assert_close(dense(x_src, mask), graph(x, case.edge_index))


def test_self_loops_are_not_doubled_and_edge_attr_fills_with_mean():
    layer = GraphSelfAttention(4, 2, edge_dim=3)
    edge_index = torch.tensor([[0, 1, 1, 2, 2], [0, 0, 1, 0, 2]])
    edge_attr = torch.arange(15.0).view(5, 3)
    _, (ei, alpha) = layer(torch.randn(4, 4), edge_index, edge_attr,
                           return_attention_weights=True)
    loops = ei[:, ei[0] == ei[1]]
    assert torch.equal(loops[0], torch.arange(4))
    assert ei.size(1) == 2 + 4 and alpha.shape == (6, 1)


def test_edge_attr_bias_changes_attention():
    torch.manual_seed(0)
    layer = GraphSelfAttention(4, 2, heads=3, edge_dim=2, add_self_loops=False)
    x, edge_index = torch.randn(3, 4), torch.tensor([[0, 1, 2], [2, 2, 2]])
    edge_attr = torch.randn(3, 2)
    _, (_, alpha) = layer(x, edge_index, edge_attr, return_attention_weights=True)
    _, (_, plain) = layer(x, edge_index, return_attention_weights=True)
    bias = layer.lin_edge(edge_attr)  # (E, H)
    expected = torch.softmax(torch.log(plain) + bias, dim=0)  # one target: softmax over edges
    assert_close(alpha, expected)


def test_out_proj_false_and_mean_heads_shapes():
    layer = GraphSelfAttention(6, 5, heads=3, concat=False, out_proj=False)
    assert layer.lin_out is None
    out = layer(torch.randn(4, 6), torch.tensor([[0, 1], [1, 2]]))
    assert out.shape == (4, 5)


@pytest.mark.parametrize("cls", ["GraphSelfAttention", "DenseSelfAttention"])
def test_repr_rebuilds_a_layer_that_computes_the_same(cls):
    """Evaluated, the repr builds a layer whose output, with the same state, is the same bit for
    bit: floats keep every digit they need (not 6 significant ones) and the indexer its
    rotary embedding."""
    from graphattn.nn import LightningIndexer
    from graphattn.pe import QueryTemperature, RotaryPE

    names = {"GraphSelfAttention": GraphSelfAttention, "DenseSelfAttention": DenseSelfAttention,
             "LightningIndexer": LightningIndexer, "RotaryPE": RotaryPE,
             "QueryTemperature": QueryTemperature}
    rotary = RotaryPE(4, attention_factor=1 / 0.9, ntk_factor=1.3, original_length=8)
    layers = [
        names[cls](8, 4, heads=2, scale=1 / 3 ** 0.5, softcap=30.123456, differential=True,
                   lambda_init=0.3123456),
        names[cls](8, 4, heads=2, rotary=rotary, query_temperature=QueryTemperature(
            beta=1 / 3, length=3.3, offset=0.1 / 3),
            indexer=LightningIndexer(8, 2, 4, 3, rotary=RotaryPE(2, base=77.7)),
            **({"add_self_loops": False} if cls == "GraphSelfAttention" else {})),
    ]
    if cls == "GraphSelfAttention":
        layers.append(GraphSelfAttention(8, 4, edge_dim=3, fill_value=np.array([0.1, 0.2, 1 / 3]),
                                         add_self_loops=True))
        layers.append(GraphSelfAttention(8, 4, edge_dim=3, fill_value=np.float32(0.25)))
    gen = torch.Generator().manual_seed(0)
    x, pos = torch.randn(6, 8, generator=gen), torch.arange(6.0) * 1.7
    edge_index = graphs.complete_graph(6)
    for layer in layers:
        torch.manual_seed(1)
        layer.reset_parameters()
        rebuilt = eval(repr(layer), names)
        assert repr(rebuilt) == repr(layer)
        rebuilt.load_state_dict(layer.state_dict())
        if cls == "GraphSelfAttention":
            edge_attr = torch.randn(edge_index.size(1), 3, generator=gen)
            args = (x, edge_index) + ((edge_attr,) if layer.edge_dim else ())
        else:
            args = (x,)
        kwargs = {"pos": pos} if layer.rotary is not None else {}
        assert torch.equal(rebuilt(*args, **kwargs), layer(*args, **kwargs)), repr(layer)


def test_number_of_nodes_comes_from_x():
    layer = GraphSelfAttention(3, 2, add_self_loops=False)
    out = layer(torch.randn(10, 3), torch.tensor([[0, 1], [1, 0]]))
    assert out.shape == (10, 2)
    assert (out[2:] == layer.lin_out.bias).all()  # no in-edges: attention gives 0


def test_repr_and_reset_parameters():
    layer = GraphSelfAttention(16, 8, heads=2)
    assert repr(layer) == "GraphSelfAttention(16, 8, heads=2)"
    assert repr(GraphSelfAttention(16, 8, attention="additive")) == (
        "GraphSelfAttention(16, 8, heads=1, attention='additive')")
    assert repr(DenseSelfAttention(16, 8, heads=4)) == "DenseSelfAttention(16, 8, heads=4)"
    assert repr(DenseSelfAttention(16, 8)) == "DenseSelfAttention(16, 8, heads=1)"
    assert repr(GraphSelfAttention(16, 8, residual=True, attention="gatv2",
                                   negative_slope=0.1, share_weights=True)) == (
        "GraphSelfAttention(16, 8, heads=1, residual=True, attention='gatv2', "
        "negative_slope=0.1, share_weights=True)")
    # every argument away from its default shows, so the repr rebuilds the layer
    other = GraphSelfAttention(16, 8, heads=2, concat=False, dropout=0.1, bias=False,
                               out_proj=False, add_self_loops=False, value_dropout=0.2)
    text = ("GraphSelfAttention(16, 8, heads=2, concat=False, dropout=0.1, bias=False, "
            "out_proj=False, value_dropout=0.2, add_self_loops=False)")
    assert repr(other) == text
    assert repr(eval(text, {"GraphSelfAttention": GraphSelfAttention})) == text
    assert repr(DenseSelfAttention(16, 8, concat=False, out_proj=False)) == (
        "DenseSelfAttention(16, 8, heads=1, concat=False, out_proj=False)")
    text = ("GraphSelfAttention(4, 3, heads=2, backend='reference', edge_dim=2, "
            "fill_value='add')")
    assert repr(eval(text, {"GraphSelfAttention": GraphSelfAttention})) == text
    assert repr(GraphSelfAttention(4, 3, edge_dim=2, fill_value=[1.0, 2.0])).endswith(
        "edge_dim=2, fill_value=[1.0, 2.0])")
    # one score channel is the additive score's own width, but a choice of a dot layer's
    for cls in (GraphSelfAttention, DenseSelfAttention):
        text = f"{cls.__name__}(6, 4, heads=2, score_channels=1)"
        rebuilt = eval(text, {cls.__name__: cls})
        assert repr(rebuilt) == text and rebuilt.lin_q.weight.shape == (2, 6)
    with torch.no_grad():
        layer.lin_q.bias.fill_(3.0)
    layer.reset_parameters()
    assert (layer.lin_q.bias == 0).all()


def test_sizes_may_be_numpy_or_tensor_integers():
    """A size from numpy or a tensor (``np.int64(4)``, ``data.x.size(1)`` as a tensor) builds
    the same layer as the int, with int attributes."""
    torch.manual_seed(0)
    want = GraphSelfAttention((6, 5), 3, heads=2, attention="gatv2", edge_dim=4)
    for as_int in (np.int64, torch.tensor):
        torch.manual_seed(0)
        got = GraphSelfAttention((as_int(6), as_int(5)), as_int(3), heads=as_int(2),
                                 attention="gatv2", edge_dim=as_int(4))
        assert (got.in_channels, got.out_channels, got.heads, got.edge_dim) == ((6, 5), 3, 2, 4)
        assert all(type(n) is int for n in (*got.in_channels, got.out_channels, got.heads))
        for (name, p), q in zip(want.named_parameters(), got.parameters(), strict=True):
            assert torch.equal(p, q), name
        dense = DenseSelfAttention(as_int(6), as_int(3), heads=as_int(2))
        assert (dense.in_channels, dense.out_channels, dense.heads) == (6, 3, 2)
    with pytest.raises(ValueError, match=r"heads must be a positive integer, got tensor\(True\)"):
        GraphSelfAttention(4, 2, heads=torch.tensor(True))
    with pytest.raises(ValueError, match=r"in_channels must be a positive integer, or -1"):
        GraphSelfAttention(np.float64(4.0), 2)


@pytest.mark.parametrize("flag", ["concat", "bias", "out_proj", "residual", "beta",
                                  "add_self_loops", "share_weights", "share_value", "out_bias"])
def test_layer_flags_must_be_bools(flag):
    """A string such as "False" was read by its truth value: concat="False" concatenated."""
    with pytest.raises(TypeError, match=rf"{flag} must be a bool, got 'False' \(a str\)"):
        GraphSelfAttention(4, 2, **{flag: "False"})
    if flag in ("concat", "bias", "out_proj", "residual", "beta"):
        with pytest.raises(TypeError, match=rf"{flag} must be a bool, got None"):
            DenseSelfAttention(4, 2, **{flag: None})
    assert GraphSelfAttention(4, 2, concat=np.bool_(False)).concat is False


def test_a_torch_sparse_adjacency_is_refused_with_the_conversion_to_make():
    """torch_sparse's SparseTensor (what T.ToSparseTensor makes with torch_sparse installed)
    is not a torch tensor: the error says how to get one the layer takes."""
    SparseTensor = type("SparseTensor", (), {})  # torch_sparse is not installed here
    with pytest.raises(TypeError, match=r"got SparseTensor: convert it with "
                                        r"adj_t.to_torch_sparse_csr_tensor\(\)"):
        GraphSelfAttention(4, 2)(torch.randn(3, 4), SparseTensor())


def test_errors_name_the_argument_and_value():
    with pytest.raises(ValueError, match="heads must be a positive integer, got 0"):
        GraphSelfAttention(4, 2, heads=0)
    with pytest.raises(ValueError, match="out_channels must be a positive integer, got -1"):
        DenseSelfAttention(4, -1)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        GraphSelfAttention(4, 2, dropout=1.5)
    with pytest.raises(ValueError, match="attention must be one of .* got 'cosine'"):
        GraphSelfAttention(4, 2, attention="cosine")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of .* got 'magic'"):
        GraphSelfAttention(4, 2, backend="magic")
    with pytest.raises(ValueError, match=r"value_dropout must be in \[0, 1\), got 1.0"):
        DenseSelfAttention(4, 2, value_dropout=1.0)
    # a bool is not a count or a probability, though Python takes True for 1 and False for 0
    with pytest.raises(ValueError, match="heads must be a positive integer, got True"):
        GraphSelfAttention(4, 2, heads=True)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got False \(a bool"):
        GraphSelfAttention(4, 2, dropout=False)
    layer = GraphSelfAttention(4, 2)
    edge_index = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(ValueError, match=r"x must have shape \[N, F\], got \[2, 3, 4\]"):
        layer(torch.randn(2, 3, 4), edge_index)
    with pytest.raises(ValueError, match=r"x must have F = in_channels = 4 features, got \[2, 5\]"):
        layer(torch.randn(2, 5), edge_index)
    with pytest.raises(ValueError, match=r"edge_index must have shape \[2, E\], got \[1, 2\]"):
        layer(torch.randn(2, 4), edge_index[:1])
    with pytest.raises(TypeError, match=r"sparse adjacency in COO, CSR or CSC layout\), got "
                                        r"layout torch.sparse_bsr"):  # (not its [2, E] shape)
        layer(torch.randn(2, 4), torch.eye(2).to_sparse_bsr((1, 1)))
    with pytest.raises(ValueError, match="edge_index.*< the number of target nodes 2.*2"):
        layer(torch.randn(2, 4), torch.tensor([[0], [2]]))
    with pytest.raises(ValueError, match="all inputs must be on one device"):
        layer(torch.randn(2, 4), edge_index.to("meta"))
    with pytest.raises(ValueError, match="edge_attr was given but the layer has edge_dim=None"):
        layer(torch.randn(2, 4), edge_index, torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"edge_attr must have shape \[E, edge_dim\] = \[2, 3\]"):
        GraphSelfAttention(4, 2, edge_dim=3)(torch.randn(2, 4), edge_index, torch.randn(2, 2))
    with pytest.raises(ValueError, match=r"edge_attr must have shape \[E, edge_dim\] = \[2, 3\], "
                                         r"got \[2\]"):  # 1-D edge_attr: edge_dim=1 only
        GraphSelfAttention(4, 2, edge_dim=3)(torch.randn(2, 4), edge_index, torch.randn(2))
    with pytest.raises(ValueError, match=r"x must have shape \[L, F\] or \[B, L, F\], got \[4\]"):
        DenseSelfAttention(4, 2)(torch.randn(4))
    with pytest.raises(ValueError, match=r"x must have F = in_channels = 4 features, got \[3, 5\]"):
        DenseSelfAttention(4, 2)(torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"fill_value must be a number, a tensor or one of "
                                         r"\['mean', 'add', 'max', 'min', 'mul'\], got 'sum'"):
        GraphSelfAttention(4, 2, edge_dim=3, fill_value="sum")
    with pytest.raises(ValueError, match=r"fill_value must be a number, a tensor or one of "
                                         r"\['mean', 'add', 'max', 'min', 'mul'\], got None"):
        GraphSelfAttention(4, 2, edge_dim=3, fill_value=None)  # (torch's error named nothing)
    with pytest.raises(ValueError, match=r"fill_value as a tensor \(or list or array\) must "
                                         r"hold 1 or edge_dim = 3 values, got shape \[2\]"):
        GraphSelfAttention(4, 2, edge_dim=3, fill_value=torch.ones(2))
    for values in ([1.0, 2.0], np.array([1.0, 2.0])):  # as a tensor
        with pytest.raises(ValueError, match=r"fill_value as a tensor \(or list or array\) must "
                                             r"hold 1 or edge_dim = 3 values, got shape \[2\]"):
            GraphSelfAttention(4, 2, edge_dim=3, fill_value=values)
    for bad in (np.array([1 + 5j, 2.0, 3.0]), torch.tensor([True, False, True]),
                torch.tensor([1 + 1j]), ["a", "b", "c"]):  # (the imaginary part was dropped)
        with pytest.raises(ValueError, match=r"fill_value must hold real numbers, got "):
            GraphSelfAttention(4, 2, edge_dim=3, fill_value=bad)
    with pytest.raises(ValueError, match=r"fill_value must be a number, a tensor or one of "
                                         r"\['mean', 'add', 'max', 'min', 'mul'\], got True"):
        GraphSelfAttention(4, 2, edge_dim=3, fill_value=True)
    with pytest.raises(ValueError, match=r"fill_value as a list must hold numbers, got "
                                         r"\[\[1\], \[2, 3\]\]"):
        GraphSelfAttention(4, 2, edge_dim=3, fill_value=[[1], [2, 3]])
    for bad in (float("nan"), torch.tensor([0.0, float("inf"), 1.0])):
        with pytest.raises(ValueError, match="fill_value must be finite, got"):
            GraphSelfAttention(4, 2, edge_dim=3, fill_value=bad)
    with pytest.raises(TypeError, match="x must have a floating-point dtype, got torch.int64"):
        layer(torch.ones(2, 4, dtype=torch.long), edge_index)
    with pytest.raises(TypeError, match="x_dst must have a floating-point dtype, got torch.int32"):
        GraphSelfAttention((3, 4), 2)((torch.randn(2, 3), torch.ones(2, 4, dtype=torch.int32)),
                                      edge_index)
    for add_self_loops in (True, False):  # refused whether or not loops are added to it
        with pytest.raises(TypeError, match="edge_attr must have a floating-point dtype, got "
                                            "torch.int64"):
            GraphSelfAttention(4, 2, edge_dim=3, add_self_loops=add_self_loops)(
                torch.randn(2, 4), edge_index, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="x must have a floating-point dtype, got torch.int64"):
        DenseSelfAttention(4, 2)(torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"in_channels must be one integer for "
                                         r"DenseSelfAttention .*got \(16, 8\)"):
        DenseSelfAttention((16, 8), 2)
    with pytest.raises(ValueError, match="negative_slope must be a finite number, got nan"):
        GraphSelfAttention(4, 2, attention="additive", negative_slope=float("nan"))
    with pytest.raises(ValueError, match="negative_slope must be a finite number, got '0.1'"):
        edge_attention(torch.randn(2, 1), torch.randn(2, 1), torch.randn(2, 1, 3), edge_index,
                       score="additive", negative_slope="0.1")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16])
def test_narrow_edge_index_dtypes_are_refused(dtype):
    """uint8 ids would wrap around in the self-loops the layer adds (node 256 becomes node 0)
    and give a wrong output without an error; int8 and int16 fail deep inside."""
    layer = GraphSelfAttention(4, 2)
    with pytest.raises(TypeError, match=rf"edge_index must have an integer dtype \(int64 or "
                                        rf"int32\), got {dtype}"):
        layer(torch.randn(300, 4), torch.tensor([[0, 1], [1, 0]], dtype=dtype))


def test_layer_checks_edge_index_once_per_call(monkeypatch):
    # The layer validates edge_index itself and then skips edge_attention's re-check, which
    # would cost two more passes over the edges and, on CUDA, two device syncs.
    import graphattn._checks as checks
    import graphattn.functional.attention as functional_attention
    import graphattn.nn.attention as nn_attention

    calls = []

    def counting_check(edge_index, num_src, num_dst):
        calls.append(edge_index.size(1))
        return checks.check_edge_index(edge_index, num_src, num_dst)

    monkeypatch.setattr(nn_attention, "check_edge_index", counting_check)
    monkeypatch.setattr(functional_attention, "check_edge_index", counting_check)
    layer = GraphSelfAttention(4, 2, heads=2, edge_dim=1)
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    layer(torch.randn(3, 4), edge_index, torch.randn(3, 1)).sum().backward()
    assert calls == [3]


@pytest.mark.parametrize("attention", ["dot", "additive"])
def test_value_dropout_drops_each_source_value_once(attention):
    # Every target of j must see the same dropped v_j: out_i = sum_j alpha_ij (m_j * v_j).
    torch.manual_seed(0)
    N, H, C = 7, 2, 3
    # Only W^V x_j is dropped: the bias of lin_v is added after the mask, as the GAT reference
    # code drops W x_j and not its bias.
    layer = GraphSelfAttention(5, C, heads=H, value_dropout=0.5, attention=attention,
                               add_self_loops=False, out_proj=False)
    torch.nn.init.uniform_(layer.lin_v.bias, 1.0, 2.0)
    x, edge_index = torch.randn(N, 5), complete_edges(N)
    torch.manual_seed(1)
    out = layer(x, edge_index)
    torch.manual_seed(1)
    mask = dropout_mask((N, H, C), 0.5)  # drawn exactly once per forward
    assert (mask == 0).any() and (mask != 0).any()
    q, k = layer.lin_q(x).view(N, H, -1), layer.lin_k(x).view(N, H, -1)
    if attention == "additive":
        q, k = q.squeeze(-1), k.squeeze(-1)
    v = (x @ layer.lin_v.weight.T).view(N, H, C) * mask + layer.lin_v.bias.view(H, C)
    expected = edge_attention(q, k, v, edge_index, score=attention, backend="reference")
    assert_close(out, expected.flatten(-2))
    layer.eval()
    no_drop = GraphSelfAttention(5, C, heads=H, attention=attention, add_self_loops=False,
                                 out_proj=False)
    no_drop.load_state_dict(layer.state_dict())
    assert_close(layer(x, edge_index), no_drop(x, edge_index))


@pytest.mark.parametrize("twin", ["graph", "dense"])
def test_attention_dropout_drops_weights_in_training_only(twin):
    """``dropout`` acts on the attention weights of both twins: with every value 1, each output
    is the sum of the kept weights over ``1 - p``, so in training it leaves 1 (between 0 and
    ``1 / (1 - p)``, 1 on average) and in eval it is exactly 1."""
    torch.manual_seed(0)
    N, H, C, p = 32, 4, 2, 0.5
    kwargs = dict(heads=H, dropout=p, out_proj=False)
    layer = (GraphSelfAttention(6, C, backend="reference", **kwargs) if twin == "graph"
             else DenseSelfAttention(6, C, **kwargs))
    with torch.no_grad():
        layer.lin_v.weight.zero_()
        layer.lin_v.bias.fill_(1.0)  # v_j = 1 for every j
    x = torch.randn(N, 6)
    run = (lambda: layer(x, complete_edges(N))) if twin == "graph" else (lambda: layer(x))
    out = run()  # (N, H * C)
    assert not torch.allclose(out, torch.ones_like(out))
    assert (out >= 0).all() and (out <= 1 / (1 - p) + 1e-5).all()
    assert abs(out.mean().item() - 1.0) < 0.1
    layer.eval()
    assert_close(run(), torch.ones(N, H * C))


def test_value_dropout_is_the_same_in_the_dense_twin():
    torch.manual_seed(0)
    N, H, C = 6, 2, 4
    graph = GraphSelfAttention(8, C, heads=H, value_dropout=0.4)
    dense = DenseSelfAttention(8, C, heads=H, value_dropout=0.4)
    torch.nn.init.uniform_(graph.lin_v.bias, 1.0, 2.0)
    dense.load_state_dict(graph.state_dict())
    x = torch.randn(N, 8)
    torch.manual_seed(3)
    out_graph = graph(x, complete_edges(N))
    torch.manual_seed(3)
    out_dense = dense(x)
    assert_close(out_graph, out_dense)
    torch.manual_seed(4)
    assert not torch.allclose(graph(x, complete_edges(N)), out_graph)  # a fresh mask per call


@pytest.mark.parametrize("features", ["dense", "dense-wide", "sparse_csr", "bipartite",
                                      "hooked"])
def test_value_dropout_spares_the_value_bias_on_every_projection_path(features):
    # The stacked product of sparse and wide dense features, three products of narrow dense
    # ones, the bipartite path and projections run as modules (lin_v with a forward hook) must
    # all give v_j = m_j * W^V x_j + b^V, with the same mask for the same seed.
    torch.manual_seed(0)
    N, H, C = 8, 2, 3
    F_in = 300 if features == "dense-wide" else 5  # 300 >= 256 and 3 x 18 outputs: stacked
    layer = GraphSelfAttention(F_in, C, heads=H, value_dropout=0.5, add_self_loops=False,
                               out_proj=False)
    for lin in (layer.lin_q, layer.lin_k, layer.lin_v):
        torch.nn.init.uniform_(lin.bias, -2.0, 2.0)
    if features == "hooked":
        layer.lin_v.register_forward_hook(lambda module, inputs, output: None)
    x, edge_index = torch.randn(N, F_in).relu(), complete_edges(N)
    x_in = (x.to_sparse_csr() if features == "sparse_csr"
            else (x, x.clone()) if features == "bipartite" else x)
    torch.manual_seed(1)
    out = layer(x_in, edge_index)
    torch.manual_seed(1)
    mask = dropout_mask((N, H, C), 0.5)
    q, k = layer.lin_q(x).view(N, H, C), layer.lin_k(x).view(N, H, C)
    v = (x @ layer.lin_v.weight.T).view(N, H, C) * mask + layer.lin_v.bias.view(H, C)
    assert_close(out, edge_attention(q, k, v, edge_index, backend="reference").flatten(-2))


@pytest.mark.parametrize("attention", ["dot", "additive"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("features", ["dense-wide", "sparse_csr"])
def test_stacked_projection_equals_three_linears(attention, bias, features, monkeypatch):
    # Self-attention on sparse features, or on dense ones at least DENSE_STACK_MIN_RATIO times
    # wider than the three outputs, projects x once by [W^Q; W^K; W^V]; a clone of x as x_dst
    # takes the three separate Linear calls. Outputs and gradients must agree (in float64: the
    # two routes sum the weight gradients over the 12 nodes in different orders).
    torch.manual_seed(0)
    F_in, H, C = 300, 3, 4  # >= 256, and >= 3 x the outputs: 36 (dot) or 18 (additive)
    layer = GraphSelfAttention(F_in, C, heads=H, bias=bias, attention=attention).double()
    x = torch.randn(12, F_in, dtype=torch.float64).relu()
    edge_index = random_graph(12, 40)
    products = []
    # dense features take F.linear, sparse ones sparse_linear
    name = "sparse_linear" if features == "sparse_csr" else "F"
    if name == "F":
        spy = SimpleNamespace(**vars(F))
        spy.linear = lambda x, w, b=None: products.append(w.shape) or F.linear(x, w, b)
    else:
        def spy(x, w, b):
            products.append(w.shape)
            return F.linear(x, w, b)
    monkeypatch.setattr(attention_module, name, spy)
    x_in = x.to_sparse_csr() if features == "sparse_csr" else x
    out_fused = layer(x_in, edge_index)
    widths = sum(lin.out_features for lin in (layer.lin_q, layer.lin_k, layer.lin_v))
    assert products == [(widths, F_in)]  # one product, by the stacked weights
    out_fused.square().sum().backward()
    fused = param_grads(layer)
    layer.zero_grad()
    monkeypatch.undo()
    out_split = layer((x, x.clone()), edge_index)
    out_split.square().sum().backward()
    assert_close(out_fused, out_split)
    for name, grad in param_grads(layer).items():
        assert_close(fused[name], grad)


def test_narrow_dense_features_take_three_products(monkeypatch):
    layer = GraphSelfAttention(16, 4, heads=2)  # 16 features < 256
    spy = SimpleNamespace(**vars(F))
    spy.linear = lambda *args: pytest.fail("the stacked product ran")
    monkeypatch.setattr(attention_module, "F", spy)
    layer(torch.randn(5, 16), random_graph(5, 10))


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_coo])
def test_sparse_bipartite_features_equal_dense_ones(layout):
    # Sparse features of a bipartite graph take the separate products: q from x_dst, k and v
    # from x_src (the stacked product serves self-attention only).
    torch.manual_seed(0)
    layer = GraphSelfAttention((6, 4), 3, heads=2)
    x_src, x_dst = torch.randn(9, 6).relu(), torch.randn(5, 4).relu()
    edge_index = random_graph(9, 30, seed=1, num_dst=5)
    sparse = (x_src.to_sparse(layout=layout), x_dst.to_sparse(layout=layout))
    out = layer(sparse, edge_index)
    out.square().sum().backward()
    grads = param_grads(layer)
    layer.zero_grad()
    expected = layer((x_src, x_dst), edge_index)
    expected.square().sum().backward()
    assert out.shape == (5, 6)
    assert_close(out, expected)
    for name, grad in param_grads(layer).items():
        assert_close(grads[name], grad)


def unique_graph(num_src, num_dst, num_edges, seed):
    """A random graph without multi-edges (a sparse adjacency holds each pair once)."""
    ei = random_graph(num_src, num_edges, seed=seed, num_dst=num_dst)
    return torch.unique(ei, dim=1)  # (2, E_unique), sorted by source


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc],
                         ids=str)
@pytest.mark.parametrize("bipartite", [False, True])
@pytest.mark.parametrize("attention", ["dot", "additive"])
def test_sparse_adjacency_input_equals_edge_index(layout, bipartite, attention):
    """adj_t[i, j] (PyG's ToSparseTensor layout) is the edge j -> i; values are ignored."""
    torch.manual_seed(0)
    n_src, n_dst = (9, 6) if bipartite else (9, 9)
    ei = unique_graph(n_src, n_dst, 40, seed=1)
    adj_t = torch.sparse_coo_tensor(ei.flip(0), torch.rand(ei.size(1)), (n_dst, n_src),
                                    check_invariants=True)
    adj_t = {torch.sparse_coo: adj_t.coalesce(), torch.sparse_csr: adj_t.to_sparse_csr(),
             torch.sparse_csc: adj_t.to_sparse_csc()}[layout]
    layer = GraphSelfAttention((5, 3) if bipartite else 5, 4, heads=2, attention=attention)
    x_src = torch.randn(n_src, 5, requires_grad=True)
    x_dst = torch.randn(n_dst, 3, requires_grad=True) if bipartite else x_src
    x = (x_src, x_dst) if bipartite else x_src

    grad_out = torch.randn(n_dst, 8)
    out, (ei_out, alpha) = layer(x, ei, return_attention_weights=True)
    out.backward(grad_out, inputs=[x_src, *layer.parameters()])
    expected_grads = [x_src.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
    x_src.grad = None
    layer.zero_grad()
    sp_out, (adj, sp_alpha) = layer(x, adj_t, return_attention_weights=True)
    sp_out.backward(grad_out, inputs=[x_src, *layer.parameters()])

    assert_close(sp_out, out)
    for got, want in zip([x_src.grad, *(p.grad for p in layer.parameters())], expected_grads,
                         strict=True):
        assert_close(got, want)
    # The weights come back as an adjacency of the input's layout, self-loops included.
    assert adj.layout == layout and adj.shape == (n_dst, n_src, 2)
    dense_alpha = torch.zeros(n_dst, n_src, 2)
    dense_alpha[ei_out[1], ei_out[0]] = alpha.detach()
    assert_close(adj.detach().to_dense(), dense_alpha)
    values = adj._values() if layout == torch.sparse_coo else adj.values()
    assert torch.equal(sp_alpha, values) and sp_alpha.shape == alpha.shape


def test_sparse_adjacency_edge_attr_follows_stored_entries():
    torch.manual_seed(0)
    ei = unique_graph(7, 7, 25, seed=2)  # sorted by source
    edge_attr = torch.randn(ei.size(1), 3)
    layer = GraphSelfAttention(4, 2, heads=2, edge_dim=3).eval()
    x = torch.randn(7, 4)
    adj_t = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.size(1)), (7, 7),
                                    check_invariants=True).to_sparse_csr()
    order = torch.argsort(ei[1] * 7 + ei[0])  # CSR stores the entries by target, then source
    assert_close(layer(x, adj_t, edge_attr[order]), layer(x, ei, edge_attr))
    with pytest.raises(ValueError, match=rf"edge_attr must have shape \[E, edge_dim\] = "
                                         rf"\[{ei.size(1)}, 3\], got \[{ei.size(1) - 1}, 3\]"):
        layer(x, adj_t, edge_attr[:-1])


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, torch.sparse_csc],
                         ids=str)
def test_sparse_adjacency_weights_carry_their_gradient(layout):
    """The weights returned for a sparse adjacency are differentiable as for an edge_index (an
    attention regulariser): COO's ``_values()`` had no gradient, and CSR / CSC ``values()``
    failed in backward on a multi-edge."""
    ei = torch.tensor([[0, 1, 2, 3, 1, 0, 2], [1, 2, 0, 1, 1, 3, 0]])  # 2 -> 0 twice
    adj_t = to_sparse_adjacency(ei, 5, 5, layout=layout)  # the multi-edge kept twice
    torch.manual_seed(0)
    layer = GraphSelfAttention(5, 4, heads=2)
    x = torch.randn(5, 5)
    grads = []
    for graph in (ei, adj_t):
        layer.zero_grad()
        out, (_, alpha) = layer(x, graph, return_attention_weights=True)
        (out.sum() + (alpha ** 2).sum()).backward()
        grads.append(param_grads(layer))
    for name, want in grads[0].items():
        assert_close(grads[1][name], want)


def test_sparse_adjacency_shape_error():
    layer = GraphSelfAttention((4, 3), 2)
    adj_t = torch.eye(5, 6).to_sparse_csr()
    with pytest.raises(ValueError, match=r"sparse adjacency must have shape \[N_dst, N_src\] = "
                                         r"\[5, 6\], got \[6, 5\]"):
        layer((torch.randn(6, 4), torch.randn(5, 3)), adj_t.t().to_sparse_csr())


@pytest.mark.parametrize("attention", ["dot", "additive"])
def test_lazy_in_channels_equal_a_sized_layer(attention):
    """``in_channels=-1`` sizes the projections at the first call and initialises them then."""
    torch.manual_seed(0)
    x_src, x_dst = torch.randn(7, 5), torch.randn(4, 3)
    edge_index = random_graph(7, 20, seed=3, num_dst=4)
    lazy = GraphSelfAttention((-1, -1), 6, heads=2, attention=attention, add_self_loops=False)
    assert repr(lazy) == "GraphSelfAttention((-1, -1), 6, heads=2, add_self_loops=False" + (
        ")" if attention == "dot" else ", attention='additive')")
    out = lazy((x_src, x_dst), edge_index)
    assert (lazy.lin_k.in_features, lazy.lin_q.in_features) == (5, 3)
    assert all(lin.bias.abs().sum() == 0 for lin in (lazy.lin_q, lazy.lin_k, lazy.lin_v))
    assert all(p.grad is None for p in lazy.parameters())
    sized = GraphSelfAttention((5, 3), 6, heads=2, attention=attention, add_self_loops=False)
    sized.load_state_dict(lazy.state_dict())
    assert_close(out, sized((x_src, x_dst), edge_index))
    with pytest.raises(ValueError, match=r"x_dst must have F = in_channels = 3 features"):
        lazy((x_src, torch.randn(4, 5)), edge_index)
    # GATConv's (x_src, None): the dot score's queries need the targets' features; the
    # additive score leaves its target term out, as GATConv does (N_dst = N_src without size)
    if attention == "dot":
        with pytest.raises(ValueError, match=r"x_dst is None: .* x_src\[:N_dst\]"):
            lazy((x_src, None), edge_index)
    else:
        assert lazy((x_src, None), edge_index).shape == (7, 12)

    lazy_res = GraphSelfAttention((-1, -1), 6, heads=2, attention=attention, residual=True)
    lazy_res((x_src, x_dst), edge_index)
    assert lazy_res.res.weight.shape == (12, 3)  # sized by x_dst, Glorot-initialised
    assert lazy_res.res.weight.abs().max() <= (6 / (12 + 3)) ** 0.5

    dense = DenseSelfAttention(-1, 4, heads=2)
    assert dense(torch.randn(2, 6, 5)).shape == (2, 6, 8)
    assert dense.lin_q.in_features == 5


@pytest.mark.parametrize("layout", [torch.strided, torch.sparse_csr])
def test_lazy_layer_keeps_a_loaded_state_dict_and_its_trained_weights(layout):
    """A lazy layer becomes a sized one at its first call: weights loaded before that call are
    kept, later calls (also with sparse features, which bypass the modules' own forward) never
    re-initialise, and reset_parameters re-initialises loaded weights."""
    torch.manual_seed(0)
    x = torch.randn(6, 5).relu()
    x_in = x if layout == torch.strided else x.to_sparse_csr()
    edge_index = random_graph(6, 15, seed=2)
    sized = GraphSelfAttention(5, 3, heads=2).eval()
    want = sized(x, edge_index)

    lazy = GraphSelfAttention(-1, 3, heads=2).eval()
    lazy.load_state_dict(sized.state_dict())
    assert_close(lazy(x_in, edge_index), want)
    assert all(type(lin) is torch.nn.Linear for lin in (lazy.lin_q, lazy.lin_k, lazy.lin_v))

    fresh = GraphSelfAttention(-1, 3, heads=2).eval()
    first = fresh(x_in, edge_index)
    assert_close(fresh(x_in, edge_index), first)  # the same weights on the second call
    with torch.no_grad():
        fresh.lin_v.weight.add_(1.0)  # an optimizer step, say
    stepped = fresh.lin_v.weight.clone()
    fresh(x_in, edge_index)
    assert torch.equal(fresh.lin_v.weight, stepped)

    loaded = GraphSelfAttention(-1, 3, heads=2)
    loaded.load_state_dict(sized.state_dict())
    loaded.reset_parameters()
    assert not torch.equal(loaded.lin_q.weight, sized.lin_q.weight)
    assert loaded.lin_q.bias.abs().sum() == 0

    dense_sized = DenseSelfAttention(5, 3, heads=2).eval()
    dense_lazy = DenseSelfAttention(-1, 3, heads=2).eval()
    dense_lazy.load_state_dict(dense_sized.state_dict())
    assert_close(dense_lazy(x), dense_sized(x))


@pytest.mark.parametrize("graph_case", [g for g in GRAPHS if not g.bipartite],
                         ids=lambda g: g.name)  # PyG's add_self_loops takes one node set
@pytest.mark.parametrize("fill_value", ["mean", "add", "max", "min", "mul", 0.5, "tensor",
                                        "column"])
def test_self_loops_replaced_and_filled_like_gatconv(graph_case, fill_value):
    """The self-loops' features, for every fill, against what GATConv does (PyG's
    remove_self_loops, then add_self_loops): also on targets without in-edges (1 for "mul",
    PyG's empty product) and for a fill tensor of shape [D_e, 1]."""
    from torch_geometric.utils import add_self_loops, remove_self_loops

    from graphattn.nn.attention import add_remaining_self_loops

    column = fill_value == "column"
    if fill_value in ("tensor", "column"):
        fill_value = torch.tensor([0.5, -1.0, 2.0])
        fill_value = fill_value.view(3, 1) if column else fill_value
    E = graph_case.edge_index.size(1)
    edge_attr = torch.randn(E, 3, generator=torch.Generator().manual_seed(1))
    ei, attr = add_remaining_self_loops(graph_case.edge_index, edge_attr, graph_case.num_dst,
                                        fill_value=fill_value)
    pyg_fill = fill_value.view(-1) if isinstance(fill_value, torch.Tensor) else fill_value
    ei_ref, attr_ref = remove_self_loops(graph_case.edge_index, edge_attr)
    ei_ref, attr_ref = add_self_loops(ei_ref, attr_ref, fill_value=pyg_fill,
                                      num_nodes=graph_case.num_dst)
    assert torch.equal(ei, ei_ref)
    assert_close(attr, attr_ref)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("num_nodes", [0, 5, 9])
def test_self_loops_cpu_kernel_equals_the_torch_ops(dtype, num_nodes, monkeypatch):
    """CPU tensors take one kernel to drop the old loops and add one per node; other devices
    and traced graphs take torch ops: the same edges, order, dtype and kept positions."""
    from graphattn.nn import attention as nn_attention

    gen = torch.Generator().manual_seed(num_nodes)
    n = max(num_nodes, 1)
    edge_index = torch.randint(0, n, (2, 40), generator=gen).to(dtype)
    edge_index[:, :4] = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0]], dtype=dtype)  # loops, doubled
    fast = nn_attention._one_loop_per_node(edge_index, num_nodes)
    monkeypatch.setattr(nn_attention, "host_readable", lambda t: False)
    slow = nn_attention._one_loop_per_node(edge_index, num_nodes)
    for got, want in zip(fast, slow, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert fast[0].dtype == dtype and fast[1].dtype == torch.int64


def test_a_graph_with_one_loop_per_node_keeps_its_edges_without_features():
    """Asked to, without edge features, a CPU graph whose nodes have one self-loop each comes
    back as it is (the same tensor: the same edge set as with the loops moved last); a node
    without a loop, one with two, a loop beyond the loop count (bipartite), edge features, or
    not asking rebuild it. A layer asks unless it returns the attention weights."""
    from graphattn.nn.attention import add_remaining_self_loops

    looped = graphs.batch_complete_graph(torch.tensor([0, 0, 1, 1, 1]))  # one loop each
    ei, attr = add_remaining_self_loops(looped, None, 5, keep_if_looped=True)
    assert ei is looped and attr is None
    assert add_remaining_self_loops(looped, None, 5)[0] is not looped
    rebuilt = add_remaining_self_loops(looped, torch.ones(looped.size(1), 2), 5,
                                       keep_if_looped=True)[0]
    assert rebuilt is not looped and sorted(map(tuple, rebuilt.t().tolist())) == sorted(
        map(tuple, looped.t().tolist()))
    others = [looped[:, 1:],  # node 0 without its loop
              torch.cat([looped, torch.tensor([[3], [3]])], dim=1),  # node 3 with two
              torch.cat([looped[:, 1:], torch.tensor([[5], [5]])], dim=1)]  # a loop on node 5
    for edge_index in others:
        ei = add_remaining_self_loops(edge_index, None, 5, keep_if_looped=True)[0]
        assert ei is not edge_index
        loops = ei[:, ei[0] == ei[1]]
        assert loops.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]
    # a layer: the same output as on the rebuilt graph, on which it returns the weights
    layer = GraphSelfAttention(6, 4, heads=2, backend="auto")
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    out = layer(x, looped)
    out_rebuilt, (ei, _) = layer(x, looped, return_attention_weights=True)
    assert ei is not looped
    assert_close(out, out_rebuilt)


@pytest.mark.parametrize("fill_value", ["mean", "add", "max", "min", "mul"])
def test_bipartite_self_loops_fill_from_their_own_targets_only(fill_value):
    # 3 sources, 5 targets: loops on targets 0..2; the edges into targets 3 and 4 must not
    # enter any loop's features.
    from graphattn.nn.attention import add_remaining_self_loops

    edge_index = torch.tensor([[0, 2, 2, 0, 1, 2],
                               [1, 1, 0, 3, 4, 4]])
    edge_attr = torch.tensor([[1.0], [3.0], [5.0], [100.0], [200.0], [300.0]])
    ei, attr = add_remaining_self_loops(edge_index, edge_attr, 3, fill_value=fill_value)
    assert ei[:, 6:].tolist() == [[0, 1, 2], [0, 1, 2]]
    # target 0 gets 5; target 1 gets 1 and 3; target 2 gets nothing
    expected = {"mean": [5.0, 2.0, 0.0], "add": [5.0, 4.0, 0.0], "max": [5.0, 3.0, 0.0],
                "min": [5.0, 1.0, 0.0], "mul": [5.0, 3.0, 1.0]}[fill_value]
    assert attr[6:, 0].tolist() == expected
    assert torch.equal(attr[:6], edge_attr)


@pytest.mark.parametrize("graph_case", GRAPHS, ids=lambda g: g.name)
@pytest.mark.parametrize("fill_value", ["mean", "add", "max", "min", "mul", 0.5])
def test_self_loops_with_the_given_ones_flagged_are_the_replaced_graph(graph_case, fill_value):
    """The static-count twin that compiled layers use in dynamo's default mode: without its
    flagged edges it is add_remaining_self_loops's graph, features and order included."""
    from graphattn.nn.attention import _self_loops_masking_old_ones, add_remaining_self_loops

    num_loops = min(graph_case.num_src, graph_case.num_dst)
    E = graph_case.edge_index.size(1)
    edge_attr = torch.randn(E, 3, generator=torch.Generator().manual_seed(1))
    ei, attr, flagged = _self_loops_masking_old_ones(graph_case.edge_index, edge_attr,
                                                     num_loops, fill_value=fill_value)
    expected_ei, expected_attr = add_remaining_self_loops(graph_case.edge_index, edge_attr,
                                                          num_loops, fill_value=fill_value)
    assert ei.size(1) == E + num_loops and flagged.tolist() == (
        (ei[0] == ei[1]).tolist()[:E] + [False] * num_loops)
    assert torch.equal(ei[:, ~flagged], expected_ei)
    assert_close(attr[~flagged], expected_attr)
    assert torch.equal(attr[:E], edge_attr)


def _simulate_cuda_graph_capture(monkeypatch):
    """What a CUDA graph's capture changes, on CPU: the capture flag set, and no step that
    reads back to the host (dropping the given self-loops counts them; the node-id check
    reads its bounds)."""
    from graphattn import _checks, _tensor_cache

    for module in (attention_module, _checks, _tensor_cache):
        monkeypatch.setattr(module, "capturing_cuda_graph", lambda: True)

    def no_read_back(*args, **kwargs):
        raise AssertionError("read back to the host during capture")

    monkeypatch.setattr(attention_module, "add_remaining_self_loops", no_read_back)
    monkeypatch.setattr(_checks, "host_list", no_read_back)


@pytest.mark.parametrize("attention", ["dot", "additive", "gatv2"])
def test_layer_under_cuda_graph_capture_masks_the_given_self_loops(attention, monkeypatch):
    """Captured, the layer leaves the given self-loops in place with weight 0 (nothing read
    back), and computes what it computes eagerly, where it drops them: outputs and gradients."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(6, 4, heads=2, edge_dim=3, attention=attention)
    x = torch.randn(7, 6, requires_grad=True)
    # self-loops (one doubled), multi-edges and an isolated node (6)
    edge_index = torch.tensor([[0, 1, 1, 2, 3, 3, 5, 4, 0],
                               [0, 1, 1, 0, 2, 2, 4, 5, 3]])
    edge_attr = torch.randn(edge_index.size(1), 3)
    runs = []
    for captured in (False, True):
        with monkeypatch.context() as patch:
            if captured:
                _simulate_cuda_graph_capture(patch)
            out = layer(x, edge_index, edge_attr)
            runs.append((out, *torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])))
    for eager, captured in zip(*runs, strict=True):
        assert_close(captured, eager)


@pytest.mark.parametrize("case", ["weights", "additive_slope_0", "additive_scale_negative"])
def test_layer_under_cuda_graph_capture_refuses_dropping_the_given_self_loops(case, monkeypatch):
    _simulate_cuda_graph_capture(monkeypatch)
    x, edge_index = torch.randn(4, 6), torch.tensor([[0, 1, 2], [1, 1, 3]])
    if case == "weights":
        layer, kwargs, why = GraphSelfAttention(6, 4), {"return_attention_weights": True}, \
            r"return_attention_weights=True \(or a message hook\)"
    elif case == "additive_slope_0":
        layer, kwargs, why = GraphSelfAttention(6, 4, attention="additive", negative_slope=0.0), \
            {}, "attention='additive' and negative_slope=0.0"
    else:
        layer, kwargs, why = GraphSelfAttention(6, 4, attention="additive", scale=-0.5), \
            {}, "attention='additive' and scale=-0.5"
    with pytest.raises(RuntimeError, match=rf"GraphSelfAttention cannot be captured into a CUDA "
                                           rf"graph with add_self_loops=True and {why}: .* "
                                           rf"add_self_loops=False"):
        layer(x, edge_index, **kwargs)
    # without the added loops nothing is dropped, and the weights come back
    layer.add_self_loops = False
    layer(x, edge_index, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: CUDA graphs")
def test_layer_captured_in_a_cuda_graph_replays_on_new_features():
    torch.manual_seed(0)
    layer = GraphSelfAttention(6, 4, heads=2, edge_dim=3).cuda().eval()
    edge_index = torch.cat([random_graph(30, 120, seed=3), torch.arange(5).expand(2, -1)],
                           dim=1).cuda()  # with self-loops to replace
    edge_attr = torch.randn(edge_index.size(1), 3, device="cuda")
    x = torch.randn(30, 6, device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: the kernels compiled before capture
            layer(x, edge_index, edge_attr)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x, edge_index, edge_attr)
        for seed in range(2):
            x.copy_(torch.randn(30, 6, generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            assert_close(out, layer(x, edge_index, edge_attr))


def test_a_scale_past_the_scores_dtype_is_refused_at_the_call():
    """scale=1e39 is finite in float64 but inf in float32, where the scores of fp32 (and half)
    inputs are computed: refused by name there, as edge_attention refuses it (it gave NaN),
    and taken by a float64 layer."""
    edge_index = torch.tensor([[0, 1], [1, 2]])
    layer = GraphSelfAttention(4, 2, scale=1e39)
    with pytest.raises(ValueError, match=r"scale must be finite in torch.float32, the dtype the "
                                         r"scores of these inputs are computed in, got 1e\+39"):
        layer(torch.randn(3, 4), edge_index)
    assert layer.double()(torch.randn(3, 4, dtype=torch.float64), edge_index).isfinite().all()


@pytest.mark.parametrize("fill_value", ["mean", "add", "max", "min", "mul"])
def test_int32_edge_index_gives_the_gradients_of_int64(fill_value):
    """The added loops' features reduce the in-edges' by fill_value: with an int32 graph their
    scatter index was int32, and the backward of scatter_reduce in torch 2.13 gathers an
    expanded int32 index wrongly on CPU (edge_attr's gradient off, NaN for max and min)."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(4, 3, heads=2, edge_dim=2, fill_value=fill_value)
    x = torch.randn(6, 4)
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 2], [1, 2, 3, 4, 5, 0, 0, 0]])
    edge_attr = torch.randn(8, 2, generator=torch.Generator().manual_seed(1))
    results = []
    for ids in (edge_index, edge_index.int()):
        attr = edge_attr.clone().requires_grad_()
        out = layer(x, ids, attr)
        results.append((out, torch.autograd.grad(out.square().sum(), attr)[0]))
    for a, b in zip(*results, strict=True):
        assert_close(a, b)


def test_lazy_in_channels_errors():
    for bad in (0, -2, 2.5, (3, 0), (1, 2, 3)):
        with pytest.raises(ValueError, match=r"in_channels must be a positive integer, or -1 "
                                             r"to infer it from the first call \(or a pair of "
                                             r"these\), got "):
            GraphSelfAttention(bad, 4)


def test_to_hetero_sums_one_layer_per_edge_type():
    """PyG's ``to_hetero`` copies the layer per edge type and sums the copies per target type."""
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import to_hetero

    torch.manual_seed(0)
    data = HeteroData()
    data["paper"].x, data["author"].x = torch.randn(9, 6), torch.randn(5, 4)
    data["author", "writes", "paper"].edge_index = random_graph(5, 20, seed=1, num_dst=9)
    data["paper", "rev_writes", "author"].edge_index = (
        data["author", "writes", "paper"].edge_index.flip(0))
    data["paper", "cites", "paper"].edge_index = random_graph(9, 25, seed=2)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = GraphSelfAttention((-1, -1), 3, heads=2, add_self_loops=False)

        def forward(self, x, edge_index):
            return self.conv(x, edge_index)

    model = to_hetero(Net(), data.metadata(), aggr="sum")
    out = model(data.x_dict, data.edge_index_dict)
    convs = model.conv
    x, ei = data.x_dict, data.edge_index_dict
    expected_paper = (
        convs["author__writes__paper"]((x["author"], x["paper"]),
                                       ei["author", "writes", "paper"])
        + convs["paper__cites__paper"]((x["paper"], x["paper"]), ei["paper", "cites", "paper"]))
    expected_author = convs["paper__rev_writes__author"]((x["paper"], x["author"]),
                                                          ei["paper", "rev_writes", "author"])
    assert_close(out["paper"], expected_paper)
    assert_close(out["author"], expected_author)
    assert convs["author__writes__paper"].lin_k.in_features == 4


@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
@pytest.mark.parametrize("case", GRAPHS, ids=lambda g: g.name)
def test_dot_attention_with_residual_equals_transformerconv(case, concat):
    """``GraphSelfAttention(residual=True, out_proj=False, add_self_loops=False)`` is PyG's
    ``TransformerConv`` (``root_weight=True``, ``beta=False``) with copied weights: ``lin_skip``
    is ``res``, bias included, so targets without edges agree too (they get the skip term)."""
    torch.manual_seed(0)
    dtype = torch.float64
    F_src, F_dst, H, C = 5, 4, 3, 6
    in_channels = (F_src, F_dst) if case.bipartite else F_src
    conv = TransformerConv(in_channels, C, heads=H, concat=concat).to(dtype)
    layer = GraphSelfAttention(in_channels, C, heads=H, concat=concat, residual=True,
                               out_proj=False, add_self_loops=False).to(dtype)
    with torch.no_grad():
        conv.lin_skip.bias.normal_()  # zero-initialised: make it matter
        for ours, theirs in ((layer.lin_q, conv.lin_query), (layer.lin_k, conv.lin_key),
                             (layer.lin_v, conv.lin_value), (layer.res, conv.lin_skip)):
            ours.weight.copy_(theirs.weight)
            ours.bias.copy_(theirs.bias)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(case.num_src, F_src, generator=gen, dtype=dtype)
    if case.bipartite:
        x = (x, torch.randn(case.num_dst, F_dst, generator=gen, dtype=dtype))
    assert_agrees_with_pyg(layer, conv, x, case.edge_index)
    for ours, theirs in ((layer.lin_q, conv.lin_query), (layer.lin_k, conv.lin_key),
                         (layer.lin_v, conv.lin_value), (layer.res, conv.lin_skip)):
        assert_close(ours.weight.grad, theirs.weight.grad)
        assert_close(ours.bias.grad, theirs.bias.grad)


@pytest.mark.parametrize("backend", ["cpu", "reference", "dense"])
@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
@pytest.mark.parametrize("case", GRAPHS, ids=lambda g: g.name)
def test_edge_features_in_keys_and_values_and_beta_equal_transformerconv(case, concat, backend,
                                                                         monkeypatch):
    """``edge_mode="key_value"`` and ``beta=True`` are ``TransformerConv(edge_dim=D,
    beta=True)`` with copied weights: ``W^E e_ij`` joins k_j and v_j, and the gate
    ``sigmoid(w . [o, r, o - r])`` mixes the output and the skip term. Every way of computing
    it: inside the kernels (``cpu``), per edge (``reference``), and folded into a score bias
    and a value sum beside the operator (``dense``), there in chunks of 2 edges."""
    monkeypatch.setattr(edge_terms, "EDGE_CHUNK", 2)
    torch.manual_seed(0)
    dtype = torch.float64
    F_src, F_dst, H, C, D = 5, 4, 3, 6, 2
    in_channels = (F_src, F_dst) if case.bipartite else F_src
    conv = TransformerConv(in_channels, C, heads=H, concat=concat, edge_dim=D,
                           beta=True).to(dtype)
    layer = GraphSelfAttention(in_channels, C, heads=H, concat=concat, residual=True,
                               out_proj=False, add_self_loops=False, edge_dim=D,
                               edge_mode="key_value", beta=True, backend=backend).to(dtype)
    pairs = ((layer.lin_q, conv.lin_query), (layer.lin_k, conv.lin_key),
             (layer.lin_v, conv.lin_value), (layer.res, conv.lin_skip),
             (layer.lin_edge, conv.lin_edge), (layer.lin_beta, conv.lin_beta))
    with torch.no_grad():
        conv.lin_skip.bias.normal_()  # zero-initialised: make it matter
        for ours, theirs in pairs:
            ours.weight.copy_(theirs.weight)
            if theirs.bias is not None:
                ours.bias.copy_(theirs.bias)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(case.num_src, F_src, generator=gen, dtype=dtype)
    if case.bipartite:
        x = (x, torch.randn(case.num_dst, F_dst, generator=gen, dtype=dtype))
    edge_attr = torch.randn(case.edge_index.size(1), D, generator=gen, dtype=dtype)
    assert_agrees_with_pyg(layer, conv, x, case.edge_index, edge_attr)
    for ours, theirs in pairs:
        assert_close(ours.weight.grad, theirs.weight.grad)


def test_beta_layer_has_the_parameters_of_transformerconv():
    """``TransformerConv(edge_dim=D, beta=True)``'s parameters one for one: ``lin_beta`` and
    ``lin_edge`` without a bias (an extra zero-initialised bias would not show in the outputs
    of the copied-weights comparison above)."""
    conv = TransformerConv(5, 3, heads=2, edge_dim=2, beta=True)
    layer = GraphSelfAttention(5, 3, heads=2, residual=True, out_proj=False, edge_dim=2,
                               edge_mode="key_value", beta=True)
    assert layer.lin_beta.bias is None and layer.lin_edge.bias is None
    assert (sorted(tuple(p.shape) for p in layer.parameters())
            == sorted(tuple(p.shape) for p in conv.parameters()))


def test_edge_features_in_keys_by_hand():
    """``edge_mode="key"`` with the dot score: s_ij = q_i . (k_j + W^E e_ij) / sqrt(C) and
    out_i = sum_j alpha_ij v_j, written out per target; values carry no edge term."""
    case = next(g for g in GRAPHS if g.name == "multi-edges")
    torch.manual_seed(0)
    dtype = torch.float64
    H, C = 2, 4
    layer = GraphSelfAttention(5, C, H, edge_dim=3, edge_mode="key", out_proj=False,
                               add_self_loops=False).to(dtype)
    n, (src, dst) = case.num_src, case.edge_index
    x = torch.randn(n, 5, dtype=dtype)
    edge_attr = torch.randn(src.numel(), 3, dtype=dtype)
    out, (_, alpha) = layer(x, case.edge_index, edge_attr, return_attention_weights=True)
    q, k, v = (lin(x).view(n, H, C) for lin in (layer.lin_q, layer.lin_k, layer.lin_v))
    edge = (edge_attr @ layer.lin_edge.weight.t()).view(-1, H, C)
    for target in range(n):
        edges = (dst == target).nonzero().view(-1)
        if edges.numel() == 0:
            assert (out[target] == 0).all()
            continue
        s = (q[target] * (k[src[edges]] + edge[edges])).sum(-1) / C**0.5  # (deg, H)
        a = torch.softmax(s, dim=0)
        assert_close(alpha[edges], a)
        assert_close(out[target], (a[..., None] * v[src[edges]]).sum(0).flatten())


def test_beta_layers_load_across_and_agree_on_the_complete_graph():
    """``beta=True`` gives both twins ``lin_beta``; the graph layer on the complete graph then
    computes the dense layer's output, gate included."""
    torch.manual_seed(0)
    N, F, H, C = 7, 5, 2, 3
    graph = GraphSelfAttention(F, C, heads=H, residual=True, beta=True)
    dense = DenseSelfAttention(F, C, heads=H, residual=True, beta=True)
    dense.load_state_dict(graph.state_dict())
    assert graph.lin_beta.weight.shape == (1, 3 * H * C)
    x = torch.randn(N, F)
    assert_close(graph(x, complete_edges(N)), dense(x))
    assert_close(dense(x[None].expand(2, N, F)), dense(x)[None].expand(2, -1, -1))
    assert repr(dense) == "DenseSelfAttention(5, 3, heads=2, residual=True, beta=True)"


def test_edge_mode_and_beta_errors():
    with pytest.raises(ValueError, match=r"edge_mode must be one of \('bias', 'key', "
                                         r"'key_value'\), got 'values'"):
        GraphSelfAttention(4, 2, edge_dim=3, edge_mode="values")
    with pytest.raises(ValueError, match=r"edge_mode='key' says how edge features enter, and "
                                         r"the layer has none: give edge_dim"):
        GraphSelfAttention(4, 2, edge_mode="key")
    with pytest.raises(ValueError, match=r"edge_mode='key' needs the dot or gatv2 score.*"
                                         r"got attention='additive'"):
        GraphSelfAttention(4, 2, edge_dim=3, edge_mode="key", attention="additive")
    with pytest.raises(ValueError, match=r"beta=True gates the residual term and needs "
                                         r"residual=True, got residual=False"):
        GraphSelfAttention(4, 2, beta=True)
    assert repr(GraphSelfAttention(4, 2, edge_dim=3, edge_mode="key_value")) == (
        "GraphSelfAttention(4, 2, heads=1, edge_dim=3, edge_mode='key_value')")


@pytest.mark.parametrize("backend, chunk", [("cpu", None), ("reference", None), ("dense", 3),
                                            ("dense", 1 << 16)],
                         ids=["cpu", "reference", "dense-chunks-of-3", "dense-one-chunk"])
@pytest.mark.parametrize("edge_mode", ["key", "key_value"])
def test_dot_edge_modes_with_dropout_equal_edges_as_sources(edge_mode, backend, chunk,
                                                            monkeypatch):
    """With attention dropout every edge's key and value term must meet the weights the
    operator used: inside the kernels (``cpu``), per edge (``reference``), and folded in as a
    score bias and a value sum after the operator, in chunks of edges (``dense``). The same
    function written out: every edge a source of its own, key ``k_j + W^E e_ij`` (and value
    ``v_j + W^E e_ij``), through ``edge_attention`` with the same dropout draw."""
    if chunk is not None:
        monkeypatch.setattr(edge_terms, "EDGE_CHUNK", chunk)
    case = next(g for g in GRAPHS if g.name == "multi-edges")
    torch.manual_seed(0)
    dtype = torch.float64
    H, C = 2, 4
    layer = GraphSelfAttention(5, C, H, edge_dim=3, edge_mode=edge_mode, out_proj=False,
                               add_self_loops=False, dropout=0.5,
                               backend=backend).to(dtype).train()
    n, (src, dst) = case.num_src, case.edge_index
    x = torch.randn(n, 5, dtype=dtype, requires_grad=True)
    edge_attr = torch.randn(src.numel(), 3, dtype=dtype)
    torch.manual_seed(7)
    out = layer(x, case.edge_index, edge_attr)

    x_ref = x.detach().clone().requires_grad_()
    q, k, v = (lin(x_ref).view(n, H, C) for lin in (layer.lin_q, layer.lin_k, layer.lin_v))
    edge = layer.lin_edge(edge_attr).view(-1, H, C)
    values = v[src] + edge if edge_mode == "key_value" else v[src]
    sources = torch.stack([torch.arange(src.numel()), dst])
    torch.manual_seed(7)
    ref = edge_attention(q, k[src] + edge, values, sources, dropout_p=0.5, backend="reference")
    assert_close(out, ref.flatten(1))
    out.square().sum().backward()
    ref.flatten(1).square().sum().backward()
    assert_close(x.grad, x_ref.grad)
    assert case.edge_index.size(1) > 3  # several chunks in the first case


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
@pytest.mark.parametrize(("attention", "edge_mode"),
                         [("dot", "key_value"), ("gatv2", "key"), ("additive", "bias")])
def test_per_sample_gradients_through_torch_func(attention, edge_mode, backend):
    """Per-sample parameter gradients of a layer with edge features, by torch.func.vmap of
    torch.func.grad over functional_call (node and edge features batched, the graph shared),
    equal the gradients of a Python loop over the samples through ordinary autograd."""
    gen = torch.Generator().manual_seed(4)
    edge_index = random_graph(6, 15, seed=2)
    layer = GraphSelfAttention(5, 3, heads=2, attention=attention, edge_dim=3,
                               edge_mode=edge_mode, backend=backend)
    params = {name: p.detach() for name, p in layer.named_parameters()}
    x = torch.randn(4, 6, 5, generator=gen)
    edge_attr = torch.randn(4, edge_index.size(1), 3, generator=gen)

    def loss(params, x, edge_attr):
        out = torch.func.functional_call(layer, params, (x, edge_index, edge_attr))
        return out.square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x,
                                                                               edge_attr)
    for i in range(x.size(0)):
        layer.zero_grad()
        layer(x[i], edge_index, edge_attr[i]).square().sum().backward()
        for name, p in layer.named_parameters():
            assert_close(per_sample[name][i], p.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
@pytest.mark.parametrize(("attention", "edge_mode"),
                         [("dot", "key_value"), ("gatv2", "key"), ("additive", "bias")])
def test_forward_mode_ad_through_a_layer(attention, edge_mode, backend):
    """A layer with edge features called on dual tensors (torch.autograd.forward_ad) gives the
    Jacobian-vector product that ordinary autograd gives by differentiating its vector-Jacobian
    product, along node and edge features at once, on every backend."""
    gen = torch.Generator().manual_seed(6)
    edge_index = random_graph(6, 15, seed=2)
    layer = GraphSelfAttention(5, 3, heads=2, attention=attention, edge_dim=3,
                               edge_mode=edge_mode, backend=backend).double()
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    edge_attr = torch.randn(edge_index.size(1), 3, generator=gen, dtype=torch.float64,
                            requires_grad=True)
    tangents = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (x, edge_attr)]
    out = layer(x, edge_index, edge_attr)
    u = torch.zeros_like(out, requires_grad=True)
    vjp = torch.autograd.grad(out, (x, edge_attr), u, create_graph=True)
    (want,) = torch.autograd.grad(vjp, u, tangents)  # J t
    with fwAD.dual_level():
        got = layer(fwAD.make_dual(x.detach(), tangents[0]), edge_index,
                    fwAD.make_dual(edge_attr.detach(), tangents[1]))
        got_out, got_tangent = fwAD.unpack_dual(got)
    assert_close(got_out, out)
    assert_close(got_tangent, want)


@pytest.mark.parametrize("attention", ["dot", "gatv2"])
@pytest.mark.parametrize("features", ["dense", "dense-wide", "sparse_csr", "bipartite"])
def test_share_value_is_a_value_projection_equal_to_the_keys(attention, features):
    """share_value=True (lin_v is lin_k) computes what a layer whose lin_v holds a copy of
    lin_k computes, on every projection path (wide dense and sparse features stack the
    queries' and keys' weights); the shared weights get the sum of both gradients."""
    torch.manual_seed(0)
    F_in, H, C, N = 300 if features == "dense-wide" else 5, 2, 3, 8
    shared = GraphSelfAttention(F_in, C, heads=H, attention=attention, share_value=True)
    assert shared.lin_v is shared.lin_k and "share_value=True" in repr(shared)
    apart = GraphSelfAttention(F_in, C, heads=H, attention=attention)
    apart.load_state_dict(shared.state_dict())  # lin_v.* are lin_k's
    assert torch.equal(apart.lin_v.weight, apart.lin_k.weight)
    x, edge_index = torch.randn(N, F_in).relu(), random_graph(N, 20)
    x_in = (x.to_sparse_csr() if features == "sparse_csr"
            else (x, x.clone()) if features == "bipartite" else x)
    out_shared, out_apart = shared(x_in, edge_index), apart(x_in, edge_index)
    assert_close(out_shared, out_apart)
    out_shared.square().sum().backward()
    out_apart.square().sum().backward()
    assert_close(shared.lin_k.weight.grad, apart.lin_k.weight.grad + apart.lin_v.weight.grad)
    assert_close(shared.lin_k.bias.grad, apart.lin_k.bias.grad + apart.lin_v.bias.grad)


def test_share_value_drops_the_values_alone():
    """With value_dropout the values are m * W^K x_j + b^K; the keys keep every entry."""
    torch.manual_seed(0)
    N, H, C = 6, 2, 3
    layer = GraphSelfAttention(4, C, heads=H, share_value=True, value_dropout=0.5,
                               add_self_loops=False, out_proj=False)
    torch.nn.init.uniform_(layer.lin_k.bias, -2.0, 2.0)
    x, edge_index = torch.randn(N, 4), complete_edges(N)
    torch.manual_seed(1)
    out = layer(x, edge_index)
    torch.manual_seed(1)
    mask = dropout_mask((N, H * C), 0.5)
    q = layer.lin_q(x).view(N, H, C)
    k = layer.lin_k(x).view(N, H, C)
    v = ((x @ layer.lin_k.weight.T) * mask + layer.lin_k.bias).view(N, H, C)
    assert_close(out, edge_attention(q, k, v, edge_index, backend="reference").flatten(-2))


def test_share_value_refuses_the_additive_score():
    with pytest.raises(ValueError, match="share_value=True needs the dot or gatv2 score"):
        GraphSelfAttention(4, 3, attention="additive", share_value=True)


@pytest.mark.parametrize("concat", [True, False])
def test_out_bias_reaches_every_target(concat):
    """out_bias is added to every output row, a target without an in-edge included, after the
    residual; its gradient is the sum of the output's."""
    torch.manual_seed(0)
    H, C = 2, 3
    layer = GraphSelfAttention(4, C, heads=H, concat=concat, out_bias=True, residual=True,
                               add_self_loops=False)
    assert "out_bias=True" in repr(layer) and torch.equal(layer.out_bias, torch.zeros_like(
        layer.out_bias))
    torch.nn.init.uniform_(layer.out_bias, -1.0, 1.0)
    x, edge_index = torch.randn(5, 4), torch.tensor([[0, 1], [1, 2]])  # 0, 3, 4: no in-edge
    out = layer(x, edge_index)
    assert out.shape == (5, H * C if concat else C)
    without = GraphSelfAttention(4, C, heads=H, concat=concat, residual=True,
                                 add_self_loops=False)
    without.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "out_bias"})
    assert_close(out, without(x, edge_index) + layer.out_bias)
    assert_close(out[[0, 3, 4]], layer.res(x[[0, 3, 4]]) + layer.out_bias)
    weight = torch.randn(out.shape)
    (out * weight).sum().backward()
    assert_close(layer.out_bias.grad, weight.sum(0))


@pytest.mark.parametrize("options", [dict(), dict(share_value=True), dict(value_dropout=0.5)],
                         ids=["plain", "share_value", "value_dropout"])
def test_projections_run_their_modules_hooks_and_parametrizations(options):
    """Wide features take one stacked product of the three weights, which bypasses the
    modules: a projection with a forward hook or a parametrization (weight_norm) runs as
    its own module instead, with the same numbers as the plain layer."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(300, 4, heads=2, **options).train()
    hooked = copy.deepcopy(layer)
    calls = []
    for name in ("lin_q", "lin_k", "lin_v"):
        getattr(hooked, name).register_forward_hook(lambda m, i, o, n=name: calls.append(n))
    x = torch.randn(12, 300)
    edge_index = random_graph(12, 40, seed=1)
    torch.manual_seed(1)
    want = layer(x, edge_index)
    torch.manual_seed(1)
    got = hooked(x, edge_index)
    assert_close(got, want)
    assert set(calls) == {"lin_q", "lin_k", "lin_v"}  # (share_value: lin_v is lin_k)
    # weight_norm recomputes lin_q.weight in a pre-hook: two training steps must work
    normed = copy.deepcopy(layer)
    torch.nn.utils.parametrizations.weight_norm(normed.lin_q)
    optimizer = torch.optim.SGD(normed.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        normed(x, edge_index).square().sum().backward()
        optimizer.step()
    old_hook = copy.deepcopy(layer)
    with pytest.warns(FutureWarning):
        torch.nn.utils.weight_norm(old_hook.lin_k)  # the deprecated pre-hook form
    for _ in range(2):
        old_hook(x, edge_index).square().sum().backward()


SPARSE_LAYOUTS = {"csr": torch.Tensor.to_sparse_csr, "csc": torch.Tensor.to_sparse_csc,
                  "coo": torch.Tensor.to_sparse}


@pytest.mark.parametrize("model", ["layer", "graph-transformer"])
@pytest.mark.parametrize("layout", list(SPARSE_LAYOUTS))
def test_sparse_features_run_the_projections_hooks_as_dense_ones(model, layout):
    """Sparse features took the stacked product of the weights even where a projection had
    hooks: torch.nn.utils.spectral_norm's pre-hook never ran (outputs 10 apart from the dense
    features', no gradient to weight_orig), nor a forward hook, and prune's weight went stale
    (the second step's backward failed). They now run each module's forward, as dense ones,
    under CPU autocast too."""
    torch.manual_seed(0)
    if model == "layer":
        plain = GraphSelfAttention(300, 4, heads=2)
        hooked_names = ("lin_q", "lin_k")
    else:  # (in eval mode: sparse features drop their stored values, dense ones every entry)
        plain = GraphTransformer(300, 8, 3, heads=2, num_layers=1).eval()
        hooked_names = ("lin_in",)
    x = torch.randn(12, 300) * (torch.rand(12, 300) < 0.05)
    edge_index = random_graph(12, 40, seed=1)
    results = []
    for features in (x, SPARSE_LAYOUTS[layout](x)):
        module, calls = copy.deepcopy(plain), []
        torch.manual_seed(2)  # (spectral_norm draws its first power-iteration vector)
        torch.nn.utils.spectral_norm(getattr(module, hooked_names[0]))
        getattr(module, hooked_names[-1]).register_forward_hook(
            lambda m, i, o, calls=calls: calls.append(len(calls)))
        torch.manual_seed(1)
        out = module(features, edge_index)
        out.square().sum().backward()
        assert calls == [0]
        results.append((out, getattr(module, hooked_names[0]).weight_orig.grad))
    for got, want in zip(*results, strict=True):
        assert_close(got, want)
    pruned = copy.deepcopy(plain).train()  # prune computes the weight in a pre-hook
    torch.nn.utils.prune.l1_unstructured(getattr(pruned, hooked_names[0]), "weight", 0.5)
    optimizer = torch.optim.SGD(pruned.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        pruned(SPARSE_LAYOUTS[layout](x), edge_index).square().sum().backward()
        optimizer.step()
    # under CPU autocast the hooked module multiplies sparse features in fp32 (torch has no
    # bf16 CSR or CSC product there), as the plain module's stacked product does
    hooked = copy.deepcopy(plain).eval()
    getattr(hooked, hooked_names[0]).register_forward_hook(lambda m, i, o: None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = hooked(SPARSE_LAYOUTS[layout](x), edge_index)
        want = plain.eval()(SPARSE_LAYOUTS[layout](x), edge_index)
    assert got.dtype == want.dtype == torch.bfloat16
    assert_close(got, want)


@pytest.mark.parametrize("layout", list(SPARSE_LAYOUTS))
def test_sparse_features_in_half_precision_and_backward_inside_autocast(layout):
    """torch has no half-precision CSR or CSC product on the CPU. A hooked projection (its own
    forward) on CSR or CSC features of a bf16 model failed with torch's error, where a plain
    one multiplies in fp32; it now goes dense. A backward called inside CPU autocast failed
    for CSR and CSC features: the weight gradient's product was cast to bf16 too."""
    torch.manual_seed(0)
    x = torch.randn(12, 300) * (torch.rand(12, 300) < 0.05)
    edge_index = random_graph(12, 40, seed=1)
    plain = GraphSelfAttention(300, 4, heads=2).to(torch.bfloat16)
    hooked = copy.deepcopy(plain)
    hooked.lin_q.register_forward_hook(lambda m, i, o: None)
    x16 = x.to(torch.bfloat16)
    for module in (plain, hooked):
        got = module(SPARSE_LAYOUTS[layout](x16), edge_index)
        got.float().square().sum().backward()
        want = copy.deepcopy(module)(x16, edge_index)
        assert got.dtype == torch.bfloat16
        assert_close(got, want)
        assert module.lin_q.weight.grad is not None
    grads = []
    for features in (x, SPARSE_LAYOUTS[layout](x)):
        module = GraphSelfAttention(300, 4, heads=2)
        module.load_state_dict(plain.float().state_dict())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            module(features, edge_index).float().square().sum().backward()
        grads.append(module.lin_k.weight.grad)
    assert_close(grads[1], grads[0], atol=0.05, rtol=0.05)  # bf16 products against fp32


class DoublingLinear(torch.nn.Linear):
    """A ``Linear`` subclass whose forward is its own: ``2 (W x + b)``."""

    def forward(self, input):
        return 2 * super().forward(input)


@pytest.mark.parametrize("make", ["graph", "dense"])
@pytest.mark.parametrize("features", [5, 300], ids=["narrow", "wide"])
def test_projections_of_a_linear_subclass_run_its_forward(make, features):
    """A projection replaced by a subclass of ``Linear`` with a forward of its own (as a
    quantization-aware or low-rank-adapted ``Linear`` is) runs that forward, also where plain
    ``Linear`` weights would be stacked into one product: the layer computes what the plain
    layer computes with the doubled weights and biases."""
    torch.manual_seed(0)
    N, H, C = 12, 2, 4
    layer = (GraphSelfAttention(features, C, heads=H) if make == "graph"
             else DenseSelfAttention(features, C, heads=H))
    doubled = copy.deepcopy(layer)
    for name in ("lin_q", "lin_k", "lin_v"):
        plain = getattr(layer, name)
        subclassed = DoublingLinear(features, H * C)
        subclassed.load_state_dict(plain.state_dict())
        setattr(layer, name, subclassed)
        with torch.no_grad():
            getattr(doubled, name).weight.mul_(2)
            getattr(doubled, name).bias.mul_(2)
    x = torch.randn(N, features)
    edge_index = random_graph(N, 40, seed=1)
    args = (x, edge_index) if make == "graph" else (x,)
    assert_close(layer(*args), doubled(*args))


@pytest.mark.parametrize("make", ["graph", "dense"])
def test_features_of_another_dtype_than_the_weights_are_named(make):
    """float64 features (read from numpy, say) in an fp32 layer: the message names x and
    both dtypes, instead of torch's matmul error from inside. Under autocast the layer casts
    them, as autocast does (float64 aside, which autocast leaves)."""
    layer = GraphSelfAttention(4, 3, heads=2) if make == "graph" else DenseSelfAttention(4, 3,
                                                                                     heads=2)
    x, edge_index = torch.randn(3, 4), torch.tensor([[0, 1], [1, 2]])

    def call(x):
        return layer(x, edge_index) if make == "graph" else layer(x)

    for dtype in (torch.float64, torch.bfloat16):
        with pytest.raises(TypeError, match=rf"x must have the dtype of the layer's weights, "
                                            rf"torch.float32, got {dtype}"):
            call(x.to(dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert call(x.half()).dtype == torch.bfloat16
        with pytest.raises(TypeError, match="got torch.float64"):
            call(x.double())
    layer.double()  # the layer cast instead: float64 throughout
    assert call(x.double()).dtype == torch.float64


def test_edge_attr_of_another_dtype_than_the_weights_is_named():
    layer = GraphSelfAttention(4, 3, heads=2, edge_dim=2)
    x, edge_index = torch.randn(3, 4), torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(TypeError, match="edge_attr must have the dtype of the layer's weights"):
        layer(x, edge_index, torch.randn(2, 2, dtype=torch.float64))


def test_x_that_is_none_or_not_a_pair_is_named():
    layer = GraphSelfAttention(4, 3)
    x, edge_index = torch.randn(3, 4), torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got NoneType"):
        layer(None, edge_index)
    with pytest.raises(ValueError, match=r"x as a pair must be \(x_src, x_dst\), got 3 entries"):
        layer((x, x, x), edge_index)
    with pytest.raises(TypeError, match="x_src must be a torch.Tensor, got NoneType"):
        layer((None, x), edge_index)


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_attn_bias_gives_each_head_its_pattern(backend):
    """With graphs.head_patterns' bias, head h of one call computes what the layer computes
    for head h on head h's graph alone: outputs, and the gradients of x and the weights."""
    from graphattn import graphs

    n, C = 12, 4
    heads = [graphs.window_graph(n, 2, causal=True), graphs.strided_graph(n, 4, causal=True)]
    edge_index, bias = graphs.head_patterns(heads, n)
    torch.manual_seed(0)
    layer = GraphSelfAttention(6, C, heads=2, add_self_loops=False, out_proj=False,
                               backend=backend)
    x = torch.randn(n, 6, requires_grad=True)
    out = layer(x, edge_index, attn_bias=bias)  # (n, 2 C)
    weight = torch.randn(out.shape)
    got = torch.autograd.grad((out * weight).sum(), [x, *layer.parameters()])
    want_out = torch.cat([layer(x, head)[:, h * C:(h + 1) * C] for h, head in enumerate(heads)],
                         dim=1)  # head h's channels from head h's graph
    want = torch.autograd.grad((want_out * weight).sum(), [x, *layer.parameters()])
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_attn_bias_adds_to_the_edge_features_bias():
    """attn_bias of zeros changes nothing; a constant per head changes nothing either (the
    softmax ignores it); a bias on one edge moves the weights as the edge features' would."""
    torch.manual_seed(1)
    n = 6
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 0], [1, 1, 1, 2, 2, 2, 3]])
    layer = GraphSelfAttention(4, 3, heads=2, add_self_loops=False, edge_dim=2)
    x, edge_attr = torch.randn(n, 4), torch.randn(7, 2)
    out, (_, alpha) = layer(x, edge_index, edge_attr, return_attention_weights=True)
    same = layer(x, edge_index, edge_attr, attn_bias=torch.zeros(7, 2))
    torch.testing.assert_close(same, out)
    shifted = layer(x, edge_index, edge_attr, attn_bias=torch.full((7, 2), 3.0))
    torch.testing.assert_close(shifted, out, atol=1e-6, rtol=1e-5)
    bump = torch.zeros(7, 2)
    bump[0, 1] = 1.0
    _, (_, moved) = layer(x, edge_index, edge_attr, attn_bias=bump,
                          return_attention_weights=True)
    scores = torch.log(alpha[:3, 1]) + torch.tensor([1.0, 0.0, 0.0])  # target 1, head 1
    torch.testing.assert_close(moved[:3, 1], torch.softmax(scores, dim=0))
    torch.testing.assert_close(moved[:, 0], alpha[:, 0])


@pytest.mark.parametrize("make,kwargs,error,match", [
    (dict(), dict(attn_bias=torch.zeros(3, 2)), ValueError,
     r"attn_bias needs add_self_loops=False"),
    (dict(add_self_loops=False), dict(attn_bias=torch.zeros(3, 1)), ValueError,
     r"attn_bias must have shape \[E, H\] = \[3, 2\], got \[3, 1\]"),
    (dict(add_self_loops=False), dict(attn_bias=torch.zeros(3, 2, dtype=torch.float64)),
     TypeError, r"attn_bias must have the dtype of the features, torch.float32, got "
                r"torch.float64"),
    (dict(add_self_loops=False), dict(attn_bias=[[0.0, 0.0]] * 3), TypeError,
     r"attn_bias must be a torch.Tensor, got list"),
])
def test_attn_bias_errors(make, kwargs, error, match):
    layer = GraphSelfAttention(4, 3, heads=2, **make)
    with pytest.raises(error, match=match):
        layer(torch.randn(4, 4), torch.tensor([[0, 1, 2], [1, 2, 3]]), **kwargs)


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
@pytest.mark.parametrize("attention", ["dot", "gatv2"])
def test_scale_replaces_the_score_multiplier(backend, attention):
    # scale=s multiplies each score by s in place of 1/sqrt(C) (dot) or 1 (gatv2): the
    # layer's output is the operator's with that scale, and the dense layer's the same
    torch.manual_seed(3)
    layer = GraphSelfAttention(6, 4, heads=2, add_self_loops=False, attention=attention,
                               backend=backend, scale=0.7).double()
    x = torch.randn(7, 6, dtype=torch.float64)
    edge_index = graphs.random_graph(7, 3, self_loops=True)  # no repeated edge
    q, k, v = (lin(x).view(7, 2, 4) for lin in (layer.lin_q, layer.lin_k, layer.lin_v))
    want = layer.lin_out(edge_attention(q, k, v, edge_index, scale=0.7, score=attention,
                                        att=layer.att, backend="reference").flatten(1))
    assert_close(layer(x, edge_index), want)
    unscaled = GraphSelfAttention(6, 4, heads=2, add_self_loops=False, attention=attention,
                                  backend=backend).double()
    unscaled.load_state_dict(layer.state_dict())
    assert not torch.allclose(unscaled(x, edge_index), want)
    if attention == "dot":
        dense = DenseSelfAttention(6, 4, heads=2, scale=0.7).double()
        dense.load_state_dict(layer.state_dict())
        assert_close(dense(x, graphs.to_dense_mask(edge_index, 7)), want)
    assert "scale=0.7" in repr(layer)
    with pytest.raises(ValueError, match="scale must be a finite number, got nan"):
        GraphSelfAttention(6, 4, scale=float("nan"))


def test_forward_flags_must_be_bools():
    """return_attention_weights="no" returned the weights; None is PyG's "no weights"."""
    x = torch.randn(5, 8)
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    graph_layer, dense_layer = GraphSelfAttention(8, 4, heads=2), DenseSelfAttention(8, 4)
    model = GraphTransformer(8, 8, 3, num_layers=1, heads=2).eval()
    for call in (lambda flag: graph_layer(x, edge_index, return_attention_weights=flag),
                 lambda flag: dense_layer(x, return_attention_weights=flag),
                 lambda flag: model(x, edge_index, return_attention_weights=flag),
                 lambda flag: GAT(8, 3, heads=2).eval()(x, edge_index,
                                                  return_attention_weights=flag)):
        with pytest.raises(TypeError, match=r"return_attention_weights must be a bool, got "
                                            r"'no' \(a str\)"):
            call("no")
        assert isinstance(call(None), Tensor)
    with pytest.raises(TypeError, match=r"return_indexer_loss must be a bool, got 1"):
        model(x, edge_index, return_indexer_loss=1)


@pytest.mark.parametrize("cls", ["GraphSelfAttention", "DenseSelfAttention"])
def test_attn_bias_of_another_dtype_under_autocast(cls):
    """Under torch.autocast, which casts features and bias to its dtype, a bf16 bias (a Linear's
    output there) beside fp32 features is taken, as it is by edge_attention, and so is the
    bf16 output of one layer beside the fp32 bias it shares with the next; float64, which
    autocast leaves, is still refused."""
    torch.manual_seed(0)
    if cls == "GraphSelfAttention":
        layers = [GraphSelfAttention(8, 4, heads=2, add_self_loops=False) for _ in range(2)]
        edge_index = graphs.complete_graph(5)
        bias = torch.randn(edge_index.size(1), 2)

        def call(layer, x, attn_bias):
            return layer(x, edge_index, attn_bias=attn_bias)
    else:
        layers = [DenseSelfAttention(8, 4, heads=2) for _ in range(2)]
        bias = torch.randn(2, 5, 5)

        def call(layer, x, attn_bias):
            return layer(x, attn_bias=attn_bias)
    x = torch.randn(5, 8)
    want = call(layers[1], call(layers[0], x, bias), bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = call(layers[0], x, bias.bfloat16())  # fp32 features, bf16 bias
        out = call(layers[1], hidden, bias)  # bf16 features, fp32 bias
        assert hidden.dtype == out.dtype == torch.bfloat16
        with pytest.raises(TypeError, match=r"attn_bias must have the dtype of the features, "
                                            r"torch.float32, got torch.float64"):
            call(layers[0], x, bias.double())
    assert_close(out.float(), want, atol=5e-2, rtol=5e-2)


def test_dense_layer_refuses_an_attn_bias_of_another_dtype():
    """As GraphSelfAttention does: an fp64 bias beside fp32 features was cast silently."""
    layer = DenseSelfAttention(8, 4, heads=2)
    with pytest.raises(TypeError, match=r"attn_bias must have the dtype of the features, "
                                        r"torch.float32, got torch.float64"):
        layer(torch.randn(5, 8), attn_bias=torch.zeros(2, 5, 5, dtype=torch.float64))
