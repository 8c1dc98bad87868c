"""GraphSelfAttention under PyG's explainability API: explanation edge masks applied as PyG's
``MessagePassing`` applies them, checked against ``GATConv`` and ``TransformerConv`` with
copied weights (outputs and mask gradients) and through ``Explainer`` itself."""

from types import SimpleNamespace

import pytest
import torch
from conftest import GRAPHS, assert_close, random_graph
from test_additive_attention import make_pair
from torch_geometric.explain import AttentionExplainer, Explainer, GNNExplainer
from torch_geometric.explain.algorithm.utils import clear_masks, set_masks
from torch_geometric.nn import TransformerConv

from graphattn import graphs
from graphattn.nn import GraphSelfAttention

DTYPE = torch.float64
F, C, H = 5, 4, 3


def transformer_pair(in_channels):
    """``TransformerConv`` and the layer computing the same function, weights copied."""
    torch.manual_seed(0)
    conv = TransformerConv(in_channels, C, heads=H).to(DTYPE)
    layer = GraphSelfAttention(in_channels, C, heads=H, residual=True, out_proj=False,
                               add_self_loops=False).to(DTYPE)
    with torch.no_grad():
        for ours, theirs in ((layer.lin_q, conv.lin_query), (layer.lin_k, conv.lin_key),
                             (layer.lin_v, conv.lin_value), (layer.res, conv.lin_skip)):
            ours.weight.copy_(theirs.weight)
            ours.bias.copy_(theirs.bias)
    return layer, conv


def gat_pair():
    """``GATConv`` and the additive layer, without output bias: under a mask that no longer
    sums to 1, ``GATConv``'s bias (added after the sum) and the layer's (in the values) part."""
    layer, gat = make_pair(F, C, H)
    with torch.no_grad():
        gat.bias.zero_()
        layer.lin_v.bias.zero_()
    return layer, gat


def masked_run(module, x, edge_index, mask, apply_sigmoid):
    """Output and the mask's gradient through a loss weighing every output differently."""
    param = torch.nn.Parameter(mask.clone())
    set_masks(module, param, edge_index, apply_sigmoid=apply_sigmoid)
    try:
        out = module(x, edge_index)
    finally:
        clear_masks(module)
    (out * torch.linspace(-1, 1, out.numel(), dtype=DTYPE).view_as(out)).sum().backward()
    return out, param.grad


def inputs(case, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.num_src, F, generator=gen, dtype=DTYPE)
    if case.bipartite:
        x = (x, torch.randn(case.num_dst, F, generator=gen, dtype=DTYPE))
    mask = torch.randn(case.edge_index.size(1), generator=gen, dtype=DTYPE)
    return x, mask


def _adjusts_loops(case):
    """PyG's explain_message re-orders the mask for the self-loops a layer replaced only when
    the edge counts differ; on a graph whose count does not change (the complete graph with
    its loops) it applies the raw mask to the re-ordered edges."""
    ei = case.edge_index
    return int((ei[0] != ei[1]).sum()) + case.num_dst != ei.size(1)


@pytest.mark.parametrize("apply_sigmoid", [True, False], ids=["sigmoid", "raw"])
@pytest.mark.parametrize("case", GRAPHS, ids=lambda g: g.name)
def test_edge_mask_as_transformerconv_applies_it(case, apply_sigmoid):
    layer, conv = transformer_pair((F, F) if case.bipartite else F)
    x, mask = inputs(case)
    out, grad = masked_run(layer, x, case.edge_index, mask, apply_sigmoid)
    want, want_grad = masked_run(conv, x, case.edge_index, mask, apply_sigmoid)
    assert_close(out, want)
    assert_close(grad, want_grad)
    if case.edge_index.size(1):
        assert grad.abs().sum() > 0
        assert not torch.allclose(out, layer(x, case.edge_index))  # the mask changes it


@pytest.mark.parametrize("apply_sigmoid", [True, False], ids=["sigmoid", "raw"])
@pytest.mark.parametrize("case", [g for g in GRAPHS if not g.bipartite and _adjusts_loops(g)],
                         ids=lambda g: g.name)
def test_edge_mask_as_gatconv_applies_it_with_self_loops(case, apply_sigmoid):
    """The layer drops the given self-loops and adds one per node: their mask entries go, and
    the added loops get 1."""
    layer, gat = gat_pair()
    x, mask = inputs(case)
    out, grad = masked_run(layer, x, case.edge_index, mask, apply_sigmoid)
    want, want_grad = masked_run(gat, x, case.edge_index, mask, apply_sigmoid)
    assert_close(out, want)
    assert_close(grad, want_grad)
    loops = case.edge_index[0] == case.edge_index[1]
    assert (grad[loops] == 0).all()  # replaced: the mask does not reach them


LOOPED = {"complete": graphs.complete_graph(5), "window": graphs.window_graph(6, radius=1),
          "self-loops": next(g.edge_index for g in GRAPHS if g.name == "self-loops")}


@pytest.mark.parametrize("name", LOOPED)
def test_edge_mask_on_a_graph_with_one_loop_per_node_reaches_the_right_edges(name):
    """Every node already has one self-loop (the graphs of ``complete_graph``,
    ``window_graph``, ``grid_graph``): the layer replaces them, so their mask entries go and
    its loops get 1, and each other edge's weight is multiplied by its own entry. The output
    is the weighted sum built here from the layer's weights, and does not depend on the order
    of the edges. (PyG's layers, whose edge count does not change here, apply the mask as it
    comes to the edges they re-ordered: no comparison with them.)"""
    ei = LOOPED[name]
    n = int(ei.max()) + 1
    torch.manual_seed(0)
    layer = GraphSelfAttention(F, C, heads=H, out_proj=False).to(DTYPE)
    x, mask = inputs(SimpleNamespace(num_src=n, edge_index=ei, bipartite=False))
    out, grad = masked_run(layer, x, ei, mask, False)
    loops = ei[0] == ei[1]
    assert (grad[loops] == 0).all() and (grad[~loops] != 0).any()
    # what the docstring promises, from the layer's edges and weights
    edges, alpha = layer(x, ei, return_attention_weights=True)[1]  # (2, E'), (E', H)
    given = {(int(j), int(i)): float(m) for (j, i), m in zip(ei.t(), mask, strict=True)}
    factor = torch.tensor([1.0 if j == i else given[(j, i)] for j, i in edges.t().tolist()],
                          dtype=DTYPE)  # (E',)
    v = layer.lin_v(x).view(n, H, C)
    want = torch.zeros(n, H, C, dtype=DTYPE).index_add_(
        0, edges[1], (alpha * factor[:, None]).unsqueeze(-1) * v[edges[0]]).view(n, H * C)
    assert_close(out, want)
    perm = torch.randperm(ei.size(1), generator=torch.Generator().manual_seed(2))
    out_perm, grad_perm = masked_run(layer, x, ei[:, perm], mask[perm], False)
    assert_close(out_perm, out)
    assert_close(grad_perm, grad[perm])


@pytest.mark.parametrize("flip", [False, True], ids=["more-sources", "more-targets"])
def test_mask_of_ones_on_a_bipartite_graph_with_self_loops_changes_nothing(flip):
    """A bipartite layer adds min(N_src, N_dst) self-loops, each given 1: a raw mask of 1s
    leaves the output as it is, whichever side has more nodes."""
    case = next(g for g in GRAPHS if g.bipartite)
    ei, num_src, num_dst = case.edge_index, case.num_src, case.num_dst
    if flip:
        ei, num_src, num_dst = ei.flip(0), num_dst, num_src
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(num_src, F, generator=gen, dtype=DTYPE),
         torch.randn(num_dst, F, generator=gen, dtype=DTYPE))
    torch.manual_seed(0)
    layer = GraphSelfAttention((F, F), C, heads=H).to(DTYPE)
    want = layer(x, ei)
    out, grad = masked_run(layer, x, ei, torch.ones(ei.size(1), dtype=DTYPE), False)
    assert_close(out, want)
    assert grad.abs().sum() > 0


def test_explainer_finds_the_same_edge_mask_as_for_gatconv():
    """GNNExplainer, which failed on the layer ("Could not compute gradients for edges"),
    trains the same edge mask for it as for GATConv with the same weights."""
    ei = random_graph(12, 40, seed=3)
    x = torch.randn(12, F, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    masks = []
    for model in gat_pair():
        explainer = Explainer(model.eval(), algorithm=GNNExplainer(epochs=30),
                              explanation_type="model", edge_mask_type="object",
                              model_config=dict(mode="regression", task_level="node",
                                                return_type="raw"))
        torch.manual_seed(0)
        masks.append(explainer(x, ei, index=3).edge_mask)
    assert masks[0].abs().sum() > 0
    assert_close(masks[0], masks[1], atol=1e-6, rtol=1e-5)


def test_explanation_mask_of_another_size_is_refused_by_shape():
    layer = GraphSelfAttention(F, C, heads=H)
    ei = random_graph(6, 10)
    set_masks(layer, torch.nn.Parameter(torch.zeros(9)), ei)
    with pytest.raises(ValueError, match=r"one value per edge, shape \[10\], got \[9\]"):
        layer(torch.randn(6, F), ei)
    set_masks(layer, torch.nn.Parameter(torch.zeros(10, 1)), ei)  # a column is not one value
    for loops in (True, False):
        layer.add_self_loops = loops
        with pytest.raises(ValueError, match=r"one value per edge, shape \[10\], got \[10, 1\]"):
            layer(torch.randn(6, F), ei)
    clear_masks(layer)
    assert layer(torch.randn(6, F), ei).shape == (6, H * C)  # cleared: no mask


def test_explain_without_an_edge_mask_is_refused_by_name():
    layer = GraphSelfAttention(F, C, heads=H)
    layer.explain = True  # as an Explainer leaves a layer, but without set_masks
    with pytest.raises(ValueError, match=r"explain is True but no edge mask is set"):
        layer(torch.randn(6, F), random_graph(6, 10))


def test_attention_explainer_reads_the_same_weights_as_from_gatconv():
    """AttentionExplainer collects alpha through message forward hooks, which ``propagate``
    calls; the layer calls them itself (it failed: "Could not collect any attention
    coefficients")."""
    ei = random_graph(12, 40, seed=3)
    x = torch.randn(12, F, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    masks = []
    for model in gat_pair():
        explainer = Explainer(model.eval(), algorithm=AttentionExplainer(),
                              explanation_type="model", edge_mask_type="object",
                              model_config=dict(mode="regression", task_level="node",
                                                return_type="raw"))
        masks.append(explainer(x, ei, index=3).edge_mask)
    assert masks[0].abs().sum() > 0
    assert_close(masks[0], masks[1])


def test_message_hooks_see_the_weights_and_may_not_replace_messages():
    layer = GraphSelfAttention(F, C, heads=H)
    x, ei = torch.randn(6, F), random_graph(6, 10)
    seen = []
    handle = layer.register_message_forward_hook(
        lambda module, inputs, out: seen.append((inputs[0]["alpha"], inputs[0]["edge_index"])))
    out, (ei_used, alpha) = layer(x, ei, return_attention_weights=True)
    assert torch.equal(seen[0][1], ei_used) and torch.equal(seen[0][0], alpha)
    assert_close(layer(x, ei), out)  # without return_attention_weights: the output alone
    handle.remove()
    layer.register_message_forward_hook(lambda module, inputs, out: torch.zeros(1))
    with pytest.raises(RuntimeError, match="returned replacement messages"):
        layer(x, ei)


@pytest.mark.parametrize("register", [
    "register_propagate_forward_pre_hook", "register_propagate_forward_hook",
    "register_message_forward_pre_hook", "register_aggregate_forward_pre_hook",
    "register_aggregate_forward_hook", "register_edge_update_forward_pre_hook",
    "register_edge_update_forward_hook"])
def test_hooks_the_layer_never_calls_are_refused(register):
    """The layer runs no propagate, aggregate or edge_update: these hooks did nothing."""
    layer = GraphSelfAttention(F, C, heads=H)
    handle = getattr(layer, register)(lambda *args: None)
    with pytest.raises(RuntimeError, match=r"has hooks it never calls \(_\w+_hooks\)"):
        layer(torch.randn(6, F), random_graph(6, 10))
    handle.remove()
    assert layer(torch.randn(6, F), random_graph(6, 10)).shape == (6, H * C)


def test_graphmask_explainer_is_refused_by_name():
    """GraphMaskExplainer replaces explain_message, which changes messages the layer never
    builds; the error blamed a missing edge mask, and setting one would not have helped."""
    from torch_geometric.explain.algorithm import GraphMaskExplainer

    model = gat_pair()[0].eval()
    explainer = Explainer(model, algorithm=GraphMaskExplainer(1, epochs=1, log=False),
                          explanation_type="model", edge_mask_type="object",
                          model_config=dict(mode="regression", task_level="node",
                                            return_type="raw"))
    x = torch.randn(12, F, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    with pytest.raises(NotImplementedError, match=r"explain_message of its own .*"
                                                  r"GraphMaskExplainer"):
        explainer(x, random_graph(12, 40, seed=3), index=3)
