"""from_pyg, convert_pyg and from_mha: PyG's and torch's attention layers, converted, compute
what they computed."""

import warnings

import numpy as np
import pytest
import torch
from conftest import GRAPHS, assert_agrees_with_pyg, assert_close
from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

from graphattn import graphs
from graphattn.nn import (
    DenseSelfAttention,
    GraphSelfAttention,
    convert_pyg,
    from_llama,
    from_mha,
    from_pyg,
)

DTYPE = torch.float64
F_SRC, F_DST, C, D = 5, 4, 6, 3  # source and target features, channels, edge features

# Each PyG layer with the options that change its mapping.
CONVS = {
    "gat": (GATConv, {}),
    "gat-mean-edges": (GATConv, dict(concat=False, edge_dim=D, fill_value="add")),
    "gat-residual-no-loops": (GATConv, dict(residual=True, add_self_loops=False)),
    "gat-no-loops": (GATConv, dict(add_self_loops=False)),
    "gat-no-bias": (GATConv, dict(bias=False, negative_slope=0.1)),
    "gatv2": (GATv2Conv, {}),
    "gatv2-mean-edges-shared": (GATv2Conv, dict(concat=False, edge_dim=D, share_weights=True)),
    "gatv2-residual-no-loops": (GATv2Conv, dict(residual=True, add_self_loops=False)),
    "gatv2-no-loops": (GATv2Conv, dict(add_self_loops=False)),
    "gatv2-no-bias": (GATv2Conv, dict(bias=False)),
    "transformer": (TransformerConv, {}),
    "transformer-mean-edges-beta": (TransformerConv, dict(concat=False, edge_dim=D, beta=True)),
    "transformer-no-root": (TransformerConv, dict(root_weight=False, edge_dim=D)),
    "transformer-no-bias": (TransformerConv, dict(bias=False)),
}


def make_conv(name: str, bipartite: bool, heads: int = 3, seed: int = 0):
    cls, options = CONVS[name]
    torch.manual_seed(seed)
    conv = cls((F_SRC, F_DST) if bipartite else F_SRC, C, heads, **options).to(DTYPE)
    with torch.no_grad():  # PyG zero-initialises its biases: make them matter
        for param_name, param in conv.named_parameters():
            if "bias" in param_name:
                param.normal_()
    return conv.eval()


def inputs(case, edge_dim, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.num_src, F_SRC, generator=gen, dtype=DTYPE)
    if case.bipartite:
        x = (x, torch.randn(case.num_dst, F_DST, generator=gen, dtype=DTYPE))
    edge_attr = (torch.randn(case.edge_index.size(1), edge_dim, generator=gen, dtype=DTYPE)
                 if edge_dim is not None else None)
    return x, edge_attr


# share_weights needs the same features for sources and targets: not on bipartite graphs
@pytest.mark.parametrize(("case", "name"), [
    pytest.param(case, name, id=f"{case.name}-{name}") for case in GRAPHS for name in CONVS
    if not (case.bipartite and CONVS[name][1].get("share_weights"))])
def test_converted_layer_agrees_with_pyg(case, name):
    """Outputs, edge order (self-loops included), attention weights and input gradients."""
    conv = make_conv(name, case.bipartite)
    layer = from_pyg(conv)
    assert isinstance(layer, GraphSelfAttention)
    assert not layer.training and layer.lin_v.weight.dtype == DTYPE
    x, edge_attr = inputs(case, conv.edge_dim)
    assert_agrees_with_pyg(layer, conv, x, case.edge_index, edge_attr)


def test_converted_layer_is_a_copy():
    conv = make_conv("gatv2", bipartite=False)
    before = {name: p.clone() for name, p in conv.state_dict().items()}
    layer = from_pyg(conv)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(1.0)
    assert all(torch.equal(conv.state_dict()[name], p) for name, p in before.items())
    assert not any(p is q for p in layer.parameters() for q in conv.parameters())


def test_training_mode_is_kept_and_dropout_carried():
    conv = GATConv(F_SRC, C, heads=2, dropout=0.6).train()
    layer = from_pyg(conv)
    assert layer.training and layer.dropout == 0.6


def test_a_target_without_in_edges_gets_the_output_bias():
    """GATConv(add_self_loops=False) adds its bias after the sum, to every target: so does the
    converted layer's out_bias, also where a target has no in-edge."""
    conv = GATConv(F_SRC, C, heads=2, add_self_loops=False).to(DTYPE).eval()
    with torch.no_grad():
        conv.bias.normal_()
    layer = from_pyg(conv)
    assert layer.out_bias is not None and layer.lin_v.bias is None
    x = torch.randn(4, F_SRC, dtype=DTYPE)
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 1]])  # targets 0 and 3 have no in-edge
    ours, theirs = layer(x, edge_index), conv(x, edge_index)
    assert_close(ours, theirs)
    assert_close(ours[[0, 3]], conv.bias.expand(2, -1))


def test_conversions_warn_of_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in CONVS:
            from_pyg(make_conv(name, bipartite=False))
        from_pyg(make_conv("gat", bipartite=True))


def test_gatv2_values_are_its_keys_and_gat_projections_have_no_bias():
    """The converted layers hold PyG's parameters: GATv2Conv's lin_l serves keys and values
    (one product), GATConv's projections have no biases and its bias is the output's."""
    gatv2 = from_pyg(make_conv("gatv2", bipartite=False))
    assert gatv2.lin_v is gatv2.lin_k and gatv2.out_bias is not None
    gat = from_pyg(make_conv("gat", bipartite=False))
    assert all(lin.bias is None for lin in (gat.lin_q, gat.lin_k, gat.lin_v))
    assert gat.out_bias is not None


def test_convert_pyg_swaps_the_layers_of_pygs_gat_model():
    """PyG's ``GAT`` model (GATConv layers, or GATv2Conv with ``v2=True``) converted in place
    gives the same outputs and input gradients."""
    from torch_geometric.nn.models import GAT as PyGGAT

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, F_SRC, generator=gen, dtype=DTYPE)
    edge_index = torch.randint(0, 10, (2, 30), generator=gen)
    for v2 in (False, True):
        torch.manual_seed(0)
        model = PyGGAT(F_SRC, 8, num_layers=3, out_channels=3, heads=2, v2=v2).to(DTYPE).eval()
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "bias" in param_name:
                    param.normal_()
        x_ref = x.clone().requires_grad_()
        ref = model(x_ref, edge_index)
        ref.square().sum().backward()
        converted = convert_pyg(model)
        assert converted is model
        assert all(isinstance(conv, GraphSelfAttention) for conv in model.convs)
        x_ours = x.clone().requires_grad_()
        out = model(x_ours, edge_index)
        out.square().sum().backward()
        assert_close(out, ref)
        assert_close(x_ours.grad, x_ref.grad)


def test_convert_pyg_keeps_a_shared_layer_shared_and_converts_a_layer_itself():
    conv = make_conv("transformer", bipartite=False)
    model = torch.nn.ModuleDict({"a": conv, "b": torch.nn.Sequential(conv)})
    convert_pyg(model, backend="reference")
    assert model["a"] is model["b"][0] and isinstance(model["a"], GraphSelfAttention)
    assert model["a"].backend == "reference"
    # held twice by one parent (named_children() lists it once)
    conv = make_conv("gat", bipartite=False)
    twice = torch.nn.ModuleList([conv, conv])
    convert_pyg(twice)
    assert twice[0] is twice[1] and isinstance(twice[0], GraphSelfAttention)
    assert isinstance(convert_pyg(make_conv("gat", bipartite=False)), GraphSelfAttention)
    linear = torch.nn.Linear(2, 2)
    assert convert_pyg(linear) is linear  # nothing to convert
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got NoneType"):
        convert_pyg(None)
    with pytest.raises(ValueError, match=r"backend must be 'auto' or one of .* got 'bogus'"):
        convert_pyg(linear, backend="bogus")  # (nothing to convert, but a wrong name)


def test_refusals_name_the_problem():
    with pytest.raises(TypeError, match="GATConv, GATv2Conv, TransformerConv, got Linear"):
        from_pyg(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="lazy GATConv"):
        from_pyg(GATConv(-1, C))
    with pytest.raises(ValueError, match="aggr='mean'"):
        from_pyg(TransformerConv(F_SRC, C, aggr="mean"))
    with pytest.raises(ValueError, match="flow='target_to_source'"):
        from_pyg(GATv2Conv(F_SRC, C, flow="target_to_source"))


def test_a_lazy_transformer_conv_without_root_weight_converts_after_one_call():
    """TransformerConv builds lin_skip without root_weight too, and never calls it: after one
    forward every weight the conversion reads exists."""
    conv = TransformerConv(-1, C, heads=2, root_weight=False).to(DTYPE)
    x, edge_index = torch.randn(5, F_SRC, dtype=DTYPE), torch.tensor([[0, 1, 2], [1, 2, 3]])
    with pytest.raises(ValueError, match="lazy TransformerConv"):
        from_pyg(conv)
    expected = conv(x, edge_index)
    assert_close(from_pyg(conv)(x, edge_index), expected)


@pytest.mark.parametrize("cls", [TransformerConv, GATv2Conv])
def test_a_lazy_layer_first_called_on_two_widths_converts(cls):
    """``in_channels=-1`` (one number) called first on sources and targets of two widths:
    PyG sizes each side's projection to its own width, and so does the converted layer."""
    gen = torch.Generator().manual_seed(0)
    conv = cls(-1, C, heads=2).to(DTYPE).eval()
    x = (torch.randn(7, F_SRC, generator=gen, dtype=DTYPE),
         torch.randn(6, F_DST, generator=gen, dtype=DTYPE))
    edge_index = torch.tensor([[0, 3, 6, 2, 5], [0, 1, 1, 4, 5]])
    expected = conv(x, edge_index)
    layer = from_pyg(conv)
    assert layer.in_channels == (F_SRC, F_DST)
    assert_close(layer(x, edge_index), expected)


@pytest.mark.parametrize("cls", [GATConv, GATv2Conv, TransformerConv])
def test_a_lazy_edge_projection_converts_after_a_call_with_edge_features(cls):
    """``edge_dim=-1``: PyG sizes ``lin_edge`` at the first call with ``edge_attr``; before it,
    the refusal names the edge projection (not in_channels, which is set)."""
    gen = torch.Generator().manual_seed(0)
    conv = cls(F_SRC, C, heads=2, edge_dim=-1).to(DTYPE).eval()
    x = torch.randn(5, F_SRC, generator=gen, dtype=DTYPE)
    edge_index = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]])
    edge_attr = torch.randn(5, D, generator=gen, dtype=DTYPE)
    with pytest.raises(ValueError, match=rf"conv is a {cls.__name__} with a lazy edge "
                                         rf"projection \(edge_dim=-1\) whose weights do not "
                                         rf"exist yet: run one forward with edge_attr"):
        from_pyg(conv)
    expected = conv(x, edge_index, edge_attr)
    layer = from_pyg(conv)
    assert layer.edge_dim == D
    assert_close(layer(x, edge_index, edge_attr), expected)


def test_a_sum_aggregation_module_converts():
    """``aggr=SumAggregation()`` is kept as its repr, ``'SumAggregation()'``: the sum all the
    same."""
    from torch_geometric.nn.aggr import MeanAggregation, SumAggregation

    conv = TransformerConv(F_SRC, C, heads=2, aggr=SumAggregation()).to(DTYPE).eval()
    x = torch.randn(5, F_SRC, dtype=DTYPE)
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 0], [1, 2, 3, 4, 0, 2]])
    assert_close(from_pyg(conv)(x, edge_index), conv(x, edge_index))
    with pytest.raises(ValueError, match=r"aggr='MeanAggregation\(\)'"):
        from_pyg(TransformerConv(F_SRC, C, aggr=MeanAggregation()))


def test_convert_pyg_after_to_hetero_with_lazy_layers():
    """A heterogeneous model from ``to_hetero`` with lazy bipartite layers (``(-1, -1)``, whose
    ``in_channels`` stays -1 after their first call): converted, the same outputs."""
    from torch_geometric.data import HeteroData
    from torch_geometric.nn import to_hetero

    gen = torch.Generator().manual_seed(0)
    data = HeteroData()
    data["paper"].x = torch.randn(6, 5, generator=gen, dtype=DTYPE)
    data["author"].x = torch.randn(4, 3, generator=gen, dtype=DTYPE)
    data["author", "writes", "paper"].edge_index = torch.tensor([[0, 1, 2, 3, 0],
                                                                 [0, 1, 2, 3, 4]])  # 5: none
    data["paper", "rev_writes", "author"].edge_index = torch.tensor([[0, 1, 2, 3, 4],
                                                                     [0, 1, 2, 3, 0]])

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = GATConv((-1, -1), 8, heads=2, add_self_loops=False)

        def forward(self, x, edge_index):
            return self.conv(x, edge_index)

    model = to_hetero(Net(), data.metadata(), aggr="sum").to(DTYPE)
    model(data.x_dict, data.edge_index_dict)  # sizes the lazy layers
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "bias" in name:
                param.normal_()
    ref = model(data.x_dict, data.edge_index_dict)
    convert_pyg(model)
    assert isinstance(model.conv["author__writes__paper"], GraphSelfAttention)
    assert model.conv["author__writes__paper"].lin_k.in_features == 3
    out = model(data.x_dict, data.edge_index_dict)
    for node_type in ("paper", "author"):
        assert_close(out[node_type], ref[node_type])


def test_bipartite_targets_beyond_the_self_loops_agree():
    """On a bipartite input self-loops reach the first min(N_src, N_dst) targets: a target past
    them without an in-edge gets GATConv's bias from both."""
    conv = GATConv((F_SRC, F_DST), C, heads=2).to(DTYPE).eval()
    with torch.no_grad():
        conv.bias.normal_()
    layer = from_pyg(conv)
    x = (torch.randn(2, F_SRC, dtype=DTYPE), torch.randn(4, F_DST, dtype=DTYPE))
    edge_index = torch.tensor([[0, 1], [2, 0]])  # target 2 has an edge, target 3 none
    ours, theirs = layer(x, edge_index), conv(x, edge_index)
    assert_close(ours, theirs)
    assert_close(ours[3], conv.bias)


def test_a_converted_gatconv_takes_its_size_argument():
    """A model written for GATConv passes ``size=(N_src, N_dst)``: the converted layer takes it,
    refuses one that disagrees with the features as GATConv does, and names the mistake of
    passing it in GATConv's position (ours is ``return_attention_weights``)."""
    conv = GATConv((F_SRC, F_DST), C, heads=2, add_self_loops=False).to(DTYPE).eval()
    layer = from_pyg(conv)
    x = (torch.randn(6, F_SRC, dtype=DTYPE), torch.randn(4, F_DST, dtype=DTYPE))
    edge_index = torch.tensor([[0, 5, 3, 2, 1], [0, 0, 1, 3, 2]])
    for size in [(6, 4), (None, 4), (6, None)]:
        assert_close(layer(x, edge_index, size=size), conv(x, edge_index, size=size))
    with pytest.raises(ValueError, match=r"size = \(6, 5\) gives N_dst = 5, but the features "
                                         r"have 4 rows"):
        layer(x, edge_index, size=(6, 5))
    with pytest.raises(ValueError, match=r"size must be a pair \(N_src, N_dst\), got 6"):
        layer(x, edge_index, size=6)
    # a count that is no integer was truncated (size=(6, 4.9) passed; with x_dst=None, 3.7
    # targets were 3)
    for size, name in [((6, 4.9), "N_dst = 4.9"), ((6.0, 4), "N_src = 6.0"),
                       ((6, -1), "N_dst = -1"), (("6", 4), "N_src = '6'")]:
        with pytest.raises(ValueError, match=rf"size must be a pair \(N_src, N_dst\) of "
                                             rf"non-negative integers or None, got {name}"):
            layer(x, edge_index, size=size)
    assert_close(layer(x, edge_index, size=(np.int64(6), torch.tensor(4))),
                 conv(x, edge_index, size=(6, 4)))
    with pytest.raises(TypeError, match=r"return_attention_weights must be a bool, got \(6, 4\)"
                                        r": pass GATConv's size by keyword, size=\(6, 4\)"):
        layer(x, edge_index, None, (6, 4))


# GATConv options for x = (x_src, None), each with its head count (the conv's dropout in eval)
WITHOUT_TARGETS = {"gat": 3, "gat-1-head": 1, "gat-mean-edges": 3, "gat-residual-no-loops": 1,
                   "gat-no-loops": 3, "gat-no-bias": 3, "gat-dropout-edges": 2}
WITHOUT_TARGETS_OPTIONS = {"gat-1-head": "gat", "gat-dropout-edges": "gat-mean-edges"}


def gat_without_targets(name: str, bipartite: bool) -> GATConv:
    conv = make_conv(WITHOUT_TARGETS_OPTIONS.get(name, name), bipartite,
                     heads=WITHOUT_TARGETS[name])
    if name == "gat-dropout-edges":
        conv.dropout = 0.5
    return conv


def assert_gat_parameter_grads_without_targets(layer: GraphSelfAttention, conv: GATConv):
    """GATConv's parameter gradients after a call on ``(x_src, None)``, from the converted
    layer's by the chain rule through its folding (``lin_k = a_src W_src``, ``lin_edge =
    a_e W_e``, ``lin_v = W_src``): nothing reaches ``att_dst`` and ``lin_q``, nor a residual."""
    H, C = conv.heads, conv.out_channels
    lin_src = conv.lin if getattr(conv, "lin", None) is not None else conv.lin_src
    W_src = lin_src.weight.view(H, C, -1)  # (H, C, F_src)
    gk = layer.lin_k.weight.grad  # (H, F_src)
    gv = layer.lin_v.weight.grad.view(H, C, -1)  # (H, C, F_src)
    assert_close(conv.att_src.grad[0], torch.einsum("hf,hcf->hc", gk, W_src))
    assert_close(lin_src.weight.grad.view(H, C, -1),
                 gv + conv.att_src[0].unsqueeze(-1) * gk.unsqueeze(1))
    assert conv.att_dst.grad is None and layer.lin_q.weight.grad is None
    if conv.lin_edge is not None:
        ge = layer.lin_edge.weight.grad  # (H, D)
        W_edge = conv.lin_edge.weight.view(H, C, -1)  # (H, C, D)
        assert_close(conv.att_edge.grad[0], torch.einsum("hd,hcd->hc", ge, W_edge))
        assert_close(conv.lin_edge.weight.grad.view(H, C, -1),
                     conv.att_edge[0].unsqueeze(-1) * ge.unsqueeze(1))
    if conv.bias is not None:
        assert_close(layer.out_bias.grad, conv.bias.grad)
    if conv.res is not None:
        assert conv.res.weight.grad is None and layer.res.weight.grad is None


@pytest.mark.parametrize("size", ["none", "graph", "more-targets"])
@pytest.mark.parametrize(("case", "name"), [
    pytest.param(case, name, id=f"{case.name}-{name}") for case in GRAPHS
    for name in WITHOUT_TARGETS])
def test_a_converted_gatconv_takes_x_dst_none_as_gatconv_does(case, name, size):
    """``GATConv`` takes ``x = (x_src, None)``: the score without its target term, no
    residual, ``size[1]`` targets (``N_src`` without ``size``), self-loops on the first
    ``min(size)`` nodes. The converted layer refused it; now the same outputs, edge order,
    attention weights and gradients of the inputs and of every parameter."""
    conv = gat_without_targets(name, case.bipartite)
    layer = from_pyg(conv)
    x, edge_attr = inputs(case, conv.edge_dim)
    x_src = x[0] if case.bipartite else x
    size = {"none": None, "graph": (case.num_src, case.num_dst),
            "more-targets": (case.num_src, case.num_dst + 2)}[size]
    assert_agrees_with_pyg(layer, conv, (x_src, None), case.edge_index, edge_attr, size=size)
    assert_gat_parameter_grads_without_targets(layer, conv)


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr, "EdgeIndex"],
                         ids=["coo", "csr", "EdgeIndex"])
@pytest.mark.parametrize("add_self_loops", [True, False], ids=["loops", "no-loops"])
def test_x_dst_none_counts_the_targets_of_a_sparse_adjacency_or_edge_index_as_gatconv(
        layout, add_self_loops):
    """Without target features and without ``size``, ``GATConv`` counts the targets of a sparse
    adjacency by its rows and those of an ``EdgeIndex`` by its sparse size (at least
    ``N_src`` with self-loops); a ``size`` that contradicts them is refused."""
    from torch_geometric import EdgeIndex

    conv = GATConv(F_SRC, C, heads=2, add_self_loops=add_self_loops).to(DTYPE).eval()
    with torch.no_grad():
        conv.bias.normal_()
    layer = from_pyg(conv)
    x_src = torch.randn(5, F_SRC, dtype=DTYPE)
    edge_index = torch.tensor([[0, 1, 2, 4, 3, 1], [0, 0, 1, 2, 1, 1]])
    if layout == "EdgeIndex":
        given = [EdgeIndex(edge_index, sparse_size=(5, n)) for n in (3, 8, None)]
    else:
        given = [graphs.to_sparse_adjacency(edge_index, 5, 3, layout=layout)]
    for graph in given:
        ours, (_, alpha) = layer((x_src, None), graph, return_attention_weights=True)
        theirs, (_, alpha_ref) = conv((x_src, None), graph, return_attention_weights=True)
        assert ours.shape == theirs.shape
        assert_close(ours, theirs)
        assert_close(alpha, alpha_ref)
    with pytest.raises(ValueError, match=r"size = \(5, 4\) gives N_dst = 4, but edge_index is "
                                         r"(a sparse adjacency with|an EdgeIndex of) 3 targets"):
        layer((x_src, None), given[0], size=(5, 4))


def test_x_dst_none_is_refused_where_pyg_refuses_it():
    """``GATv2Conv`` and ``TransformerConv`` refuse ``x = (x_src, None)`` (their score needs the
    targets' features), and ``GATConv`` with self-loops refuses a ``size`` with a ``None``
    count (it takes ``min(size)``): the converted layers refuse each by name."""
    x_src = torch.randn(5, F_SRC, dtype=DTYPE)
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    for name, attention in [("gatv2", "gatv2"), ("transformer", "dot")]:
        conv = make_conv(name, bipartite=False)
        with pytest.raises((AssertionError, TypeError)):
            conv((x_src, None), edge_index)
        with pytest.raises(ValueError, match=f"x_dst is None: .* with attention='{attention}'"):
            from_pyg(conv)((x_src, None), edge_index)
    conv = make_conv("gat", bipartite=False)
    layer = from_pyg(conv)
    for size in [(None, 3), (5, None)]:
        with pytest.raises(TypeError):
            conv((x_src, None), edge_index, size=size)
        with pytest.raises(ValueError, match=rf"x_dst is None with add_self_loops=True: .* size "
                                             rf"must give both counts \(N_src, N_dst\), got size "
                                             rf"= \({size[0]}, {size[1]}\)"):
            layer((x_src, None), edge_index, size=size)
    without_loops = make_conv("gat-no-loops", bipartite=False)
    for size in [(None, 3), (5, None)]:  # taken without self-loops, by both
        assert_close(from_pyg(without_loops)((x_src, None), edge_index, size=size),
                     without_loops((x_src, None), edge_index, size=size))
    with pytest.raises(ValueError, match=r"edge_index\[1\] \(targets\) must be < the number of "
                                         r"target nodes 2, got a maximum of 2"):
        layer((x_src, None), edge_index, size=(5, 2))


def test_an_additive_layer_built_by_hand_takes_x_dst_none_as_a_score_without_queries():
    """A layer built with ``attention="additive"`` (not converted) gives ``(x_src, None)`` the
    meaning ``GATConv`` gives it: the score without its target term, ``lin_q`` and its bias
    included, which is the layer with ``lin_q`` zeroed on any target features; without a
    residual. ``beta=True``, which gates the residual, refuses it."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(F_SRC, C, heads=2, attention="additive", residual=True,
                               edge_dim=D).to(DTYPE).eval()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "bias" in name:
                param.normal_()
    x_src = torch.randn(6, F_SRC, dtype=DTYPE)
    edge_index = torch.tensor([[0, 5, 3, 2, 1, 4], [0, 0, 1, 3, 2, 3]])
    edge_attr = torch.randn(6, D, dtype=DTYPE)
    out = layer((x_src, None), edge_index, edge_attr, size=(6, 4))
    without_queries = GraphSelfAttention(F_SRC, C, heads=2, attention="additive",
                                         edge_dim=D).to(DTYPE).eval()
    without_queries.load_state_dict(layer.state_dict(), strict=False)  # all but res
    with torch.no_grad():
        without_queries.lin_q.weight.zero_()
        without_queries.lin_q.bias.zero_()
    x_dst = torch.randn(4, F_SRC, dtype=DTYPE)
    assert_close(out, without_queries((x_src, x_dst), edge_index, edge_attr))
    gated = GraphSelfAttention(F_SRC, C, attention="additive", residual=True, beta=True)
    with pytest.raises(ValueError, match="x_dst is None, but beta=True gates the residual"):
        gated((torch.randn(6, F_SRC), None), edge_index)



def test_a_subclass_with_its_own_forward_is_not_converted():
    """PyG's FusedGATConv is a GATConv whose forward takes CSR and CSC structures: a converted
    layer would not take its callers' arguments, so it is refused, and left in place."""

    class CSRGAT(GATConv):  # as FusedGATConv: another forward
        def forward(self, x, csr, csc, perm):
            raise NotImplementedError

    class Renamed(GATConv):  # the same forward: converted
        pass

    with pytest.raises(TypeError, match="conv is a CSRGAT, a GATConv with its own forward"):
        from_pyg(CSRGAT(F_SRC, C))
    model = torch.nn.ModuleList([CSRGAT(F_SRC, C), Renamed(F_SRC, C)])
    convert_pyg(model)
    assert isinstance(model[0], CSRGAT) and isinstance(model[1], GraphSelfAttention)


class TanhMessageGAT(GATConv):
    def message(self, x_j, alpha):
        return super().message(x_j, alpha).tanh()


class DoubledScoreGATv2(GATv2Conv):
    def edge_update(self, x_j, x_i, edge_attr, index, ptr, dim_size):
        return super().edge_update(x_j, x_i, edge_attr, index, ptr, dim_size) * 2


class TripledTransformer(TransformerConv):
    def update(self, inputs):
        return 3 * inputs


@pytest.mark.parametrize("custom, base, method", [
    (TanhMessageGAT, "GATConv", "message"), (DoubledScoreGATv2, "GATv2Conv", "edge_update"),
    (TripledTransformer, "TransformerConv", "update")])
def test_a_subclass_with_its_own_computation_is_not_converted(custom, base, method):
    """A subclass that keeps forward but overrides a step of the message passing computes
    another function than the layer the conversion maps: it is refused by name, and
    convert_pyg leaves it in place."""
    with pytest.raises(TypeError, match=f"conv is a {custom.__name__}, a {base} with its own "
                                        f"{method}:"):
        from_pyg(custom(F_SRC, C))
    model = torch.nn.ModuleList([custom(F_SRC, C)])
    convert_pyg(model)
    assert isinstance(model[0], custom)


def _mha(embed_dim=12, heads=3, seed=0, **options):
    torch.manual_seed(seed)
    mha = torch.nn.MultiheadAttention(embed_dim, heads, **options).to(DTYPE).eval()
    with torch.no_grad():  # torch zero-initialises the biases: make them matter
        for name, param in mha.named_parameters():
            if "bias" in name:
                param.normal_()
    return mha


@pytest.mark.parametrize("pattern", ["complete", "causal", "window", "grid", "bigbird"])
@pytest.mark.parametrize("bias", [True, False])
def test_from_mha_attends_over_the_graph_as_an_attn_mask_would(pattern, bias):
    """The converted layer on a graph is ``mha`` with the mask of that graph (torch's boolean
    mask: True where a pair may not attend): outputs and input gradients."""
    from graphattn import graphs

    L = 16
    edge_index = {"complete": lambda: graphs.complete_graph(L),
                  "causal": lambda: graphs.causal_graph(L),
                  "window": lambda: graphs.window_graph(L, 2),
                  "grid": lambda: graphs.grid_graph(4, 4),
                  "bigbird": lambda: graphs.union([
                      graphs.window_graph(L, 1), graphs.global_token_graph(L, [0, 8]),
                      graphs.random_graph(L, 2, generator=torch.Generator().manual_seed(0))],
                      L)}[pattern]()
    mha = _mha(bias=bias)
    layer = from_mha(mha)
    assert isinstance(layer, GraphSelfAttention) and not layer.add_self_loops
    x = torch.randn(L, 12, dtype=DTYPE)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = layer(x_ours, edge_index)
    blocked = ~graphs.to_dense_mask(edge_index, L)  # (L, L): True where j may not reach i
    ref, _ = mha(x_ref, x_ref, x_ref, attn_mask=blocked, need_weights=False)
    assert_close(out, ref)
    weight = torch.linspace(-1, 1, out.numel(), dtype=DTYPE).view_as(out)
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    assert_close(x_ours.grad, x_ref.grad)


def test_from_mha_attention_weights_are_torchs_per_head():
    from graphattn import graphs

    L = 7
    mha = _mha()
    edge_index = graphs.complete_graph(L)
    x = torch.randn(L, 12, dtype=DTYPE)
    _, (ei, alpha) = from_mha(mha)(x, edge_index, return_attention_weights=True)  # (E, H)
    _, ref = mha(x, x, x, average_attn_weights=False)  # (H, L, L): [h, i, j]
    assert_close(alpha, ref[:, ei[1], ei[0]].T)


def test_from_mha_with_other_key_dims_is_bipartite():
    """kdim = vdim != embed_dim: queries from x_dst, keys and values from x_src."""
    mha = _mha(embed_dim=8, heads=2, kdim=5, vdim=5)
    layer = from_mha(mha)
    x_src, x_dst = torch.randn(6, 5, dtype=DTYPE), torch.randn(4, 8, dtype=DTYPE)
    j, i = torch.meshgrid(torch.arange(6), torch.arange(4), indexing="ij")
    out = layer((x_src, x_dst), torch.stack([j.flatten(), i.flatten()]))  # every pair
    ref, _ = mha(x_dst, x_src, x_src, need_weights=False)
    assert_close(out, ref)


def test_from_mha_dense_is_a_batched_masked_mha():
    mha = _mha(batch_first=True)
    layer = from_mha(mha, dense=True)
    assert isinstance(layer, DenseSelfAttention)
    x = torch.randn(2, 9, 12, dtype=DTYPE)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    ref, _ = mha(x, x, x, attn_mask=~causal, need_weights=False)
    assert_close(layer(x, is_causal=True), ref)
    assert_close(layer(x, mask=causal), ref)


def test_from_mha_keeps_mode_dropout_device_and_dtype():
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.1).train()
    layer = from_mha(mha)
    assert layer.training and layer.dropout == 0.1
    assert layer.lin_q.weight.dtype == torch.float32
    assert not any(p is q for p in layer.parameters() for q in mha.parameters())


def test_from_mha_refusals_name_the_option():
    with pytest.raises(TypeError, match="got Linear"):
        from_mha(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="add_bias_kv=True"):
        from_mha(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn=True"):
        from_mha(torch.nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(ValueError, match="kdim=4, vdim=6"):
        from_mha(torch.nn.MultiheadAttention(8, 2, kdim=4, vdim=6))
    with pytest.raises(ValueError, match="dense=True needs kdim = embed_dim"):
        from_mha(torch.nn.MultiheadAttention(8, 2, kdim=4, vdim=4), dense=True)
    with pytest.raises(TypeError, match=r"dense must be a bool, got 'False' \(a str\)"):
        from_mha(torch.nn.MultiheadAttention(8, 2), dense="False")  # truthy: dense before
    for dense in (False, True):  # (with dense=True the name is checked, and unused)
        with pytest.raises(ValueError, match=r"backend must be 'auto' or one of .* got 'bogus'"):
            from_mha(torch.nn.MultiheadAttention(8, 2), dense=dense, backend="bogus")
    with pytest.raises(TypeError, match=r"dense must be a bool, got 1 \(a int\)"):
        from_llama(torch.nn.Linear(2, 2), dense=1)


def test_a_frozen_layer_converts_frozen_and_what_does_not_carry_over_is_warned_about():
    """A frozen conv (fine-tuning the rest of a model) gives a frozen layer; partly frozen
    weights and hooks do not carry over, and say so."""
    conv = GATConv(F_SRC, C, heads=2).requires_grad_(False)
    assert not any(p.requires_grad for p in from_pyg(conv).parameters())
    conv = GATConv(F_SRC, C, heads=2)
    conv.att_src.requires_grad_(False)
    with pytest.warns(UserWarning, match="some parameters frozen"):
        layer = from_pyg(conv)
    assert all(p.requires_grad for p in layer.parameters())
    conv = TransformerConv(F_SRC, C)
    conv.register_forward_hook(lambda module, inputs, output: None)
    with pytest.warns(UserWarning, match=r"has hooks \(_forward_hooks\)"):
        convert_pyg(torch.nn.Sequential(conv))
    conv = GATConv(F_SRC, C)
    conv.register_propagate_forward_hook(lambda module, inputs, output: None)
    with pytest.warns(UserWarning, match=r"has hooks \(_propagate_forward_hooks\) that the "
                                         r"converted layer has no step for"):
        layer = from_pyg(conv)
    assert not layer._propagate_forward_hooks  # registered there, it would be refused
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from_pyg(GATv2Conv(F_SRC, C))  # nothing to warn about


def test_conversion_warnings_name_each_layer_and_point_at_the_callers_line():
    """convert_pyg's warnings pointed at graphattn's own line (convert.py), where Python's
    default filter shows a warning once: of a model's three hooked layers, and of every model
    converted after it, one warning was seen, and it said "conv". Each now names its layer
    ("convs.0") and points at the line that called convert_pyg or from_pyg."""
    def hooked_model():
        model = torch.nn.Module()
        model.convs = torch.nn.ModuleList(GATConv(F_SRC, C) for _ in range(3))
        for conv in model.convs:
            conv.register_forward_pre_hook(lambda module, inputs: None)
        return model

    for convert, names in ((convert_pyg, ["convs.0", "convs.1", "convs.2"]),
                           (lambda model: from_pyg(model.convs[1]), ["conv"]),
                           (lambda model: convert_pyg(model.convs[2]), ["module"])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            convert(hooked_model())
        assert [str(w.message).split(" ")[0] for w in caught] == names
        assert {w.filename for w in caught} == {__file__}


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_mha_carries_each_parameters_requires_grad(dense):
    """A frozen MultiheadAttention converted to a layer whose parameters all trained; the
    projections map one to one, so partly frozen weights carry over too."""
    mha = torch.nn.MultiheadAttention(8, 2).requires_grad_(False)
    assert not any(p.requires_grad for p in from_mha(mha, dense=dense).parameters())
    mha = torch.nn.MultiheadAttention(8, 2)
    mha.in_proj_weight.requires_grad_(False)  # the projections frozen, their biases and the
    layer = from_mha(mha, dense=dense)  # output projection trained
    trained = {name for name, p in layer.named_parameters() if p.requires_grad}
    assert trained == {"lin_q.bias", "lin_k.bias", "lin_v.bias", "lin_out.weight",
                       "lin_out.bias"}
    mha = torch.nn.MultiheadAttention(8, 2, kdim=4, vdim=4)
    mha.k_proj_weight.requires_grad_(False)
    if not dense:
        layer = from_mha(mha)
        assert [name for name, p in layer.named_parameters() if not p.requires_grad] == [
            "lin_k.weight"]
    mha = torch.nn.MultiheadAttention(8, 2)
    mha.register_forward_hook(lambda module, inputs, output: None)
    with pytest.warns(UserWarning, match=r"mha \(MultiheadAttention\) has hooks"):
        from_mha(mha, dense=dense)


def test_a_gatconv_without_edge_dim_drops_edge_attr_as_gatconv_does():
    """PyG's GAT model passes edge_attr to every layer, and GATConv without edge_dim ignores
    it: the converted model refused the call. A layer built without edge_dim still refuses."""
    from torch_geometric.nn import GAT as PyGGAT

    torch.manual_seed(0)
    x, edge_index = torch.randn(7, F_SRC), torch.randint(0, 7, (2, 20))
    edge_attr = torch.randn(20, 3)
    model = PyGGAT(F_SRC, 8, 2, 3, heads=2).eval()
    expected = model(x, edge_index, edge_attr=edge_attr)
    convert_pyg(model)
    assert_close(model(x, edge_index, edge_attr=edge_attr), expected)
    with pytest.raises(ValueError, match="edge_attr was given but the layer has edge_dim=None"):
        GraphSelfAttention(F_SRC, C)(x, edge_index, edge_attr)
    with pytest.raises(ValueError, match="edge_attr was given but the layer has edge_dim=None"):
        from_pyg(GATv2Conv(F_SRC, C))(x, edge_index, edge_attr)  # GATv2Conv refuses it too


def test_a_gatconv_as_pyg_before_2_6_made_it_converts():
    """pyproject allows torch-geometric 2.4, whose GATConv has no ``residual`` and no ``lin``
    (``lin_src`` is ``lin_dst`` when shared): from_pyg read both and failed. The conv here is
    rebuilt to that layout after its output is taken."""
    torch.manual_seed(0)
    conv = GATConv(F_SRC, C, heads=2).eval()
    x, edge_index = torch.randn(6, F_SRC), torch.randint(0, 6, (2, 15))
    expected = conv(x, edge_index)
    shared = conv.lin
    del conv.lin, conv.residual
    conv.lin_src = conv.lin_dst = shared
    assert not hasattr(conv, "residual") and not hasattr(conv, "lin")
    assert_close(from_pyg(conv)(x, edge_index), expected)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_mha_of_an_eval_mha_is_in_eval_mode_with_its_dropout(dense):
    """Mutation testing: dropping the mode went unnoticed (the test's MHA was in training
    mode, the default), and so did the dense layer's dropout."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2, dropout=0.5).eval()
    layer = from_mha(mha, dense=dense)
    assert not layer.training and layer.dropout == 0.5
    x = torch.randn(6, 8)
    out = layer(x) if dense else layer(x, graphs.complete_graph(6))
    assert_close(out, mha(x, x, x, need_weights=False)[0], atol=1e-5, rtol=1e-5)


def test_converted_layers_have_pyg_s_parameters_shared_and_without_bias():
    """Mutation testing: unshared GATv2 weights and biases added to a bias-free
    TransformerConv gave the same output at conversion, but more (trainable) parameters."""
    def count(module):
        return sum(p.numel() for p in module.parameters())

    gatv2 = GATv2Conv(4, 3, heads=2, share_weights=True)
    layer = from_pyg(gatv2)
    assert layer.lin_q is layer.lin_k and count(layer) == count(gatv2)
    transformer = TransformerConv(4, 3, heads=2, bias=False)
    layer = from_pyg(transformer)
    assert layer.lin_q.bias is None and count(layer) == count(transformer)


@pytest.mark.parametrize("name", [name for name in CONVS if not name.startswith("gat-")
                                  and name != "gat"])
def test_converted_gatv2_and_transformer_layers_train_as_pyg_s(name):
    """GATv2Conv's and TransformerConv's parameters are the converted layer's, one for one:
    three SGD steps on the same loss keep the two equal. GATv2Conv(residual=True) gave the
    layer's residual a bias of its own (zeroed at conversion, then trained beside out_bias,
    which takes the same gradient), and the two drifted apart."""
    case = GRAPHS[0]
    conv = make_conv(name, bipartite=False)
    layer = from_pyg(conv)
    x, edge_attr = inputs(case, CONVS[name][1].get("edge_dim"))
    extra = () if edge_attr is None else (edge_attr,)
    with torch.no_grad():
        target = torch.randn_like(conv(x, case.edge_index, *extra))
    outputs, trained = [], []
    for module in (conv, layer):
        module.train()
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            ((module(x, case.edge_index, *extra) - target) ** 2).mean().backward()
            optimizer.step()
        outputs.append(module.eval()(x, case.edge_index, *extra))
        # (TransformerConv(root_weight=False) keeps a lin_skip it never uses: no gradient)
        trained.append(sum(p.numel() for p in module.parameters() if p.grad is not None))
    assert trained[0] == trained[1]
    assert_close(*outputs)
