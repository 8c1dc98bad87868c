"""Every attention pattern: GraphSelfAttention on the graph == dense attention with its mask.

Forward outputs and the gradients of the input and of every parameter are compared. Where SDPA
has the pattern built in (complete: no mask; causal: ``is_causal=True``), the graph layer is also
compared with ``torch.nn.functional.scaled_dot_product_attention`` called directly. The layer
runs on the readable reference backend and on the one ``backend="auto"`` picks.
"""

from __future__ import annotations

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close

from graphattn import graphs
from graphattn.nn import DenseSelfAttention, GraphSelfAttention

IN_CHANNELS = 8

PATTERNS = {
    "complete": lambda: (graphs.complete_graph(9), 9),
    "complete-no-loops": lambda: (graphs.complete_graph(9, self_loops=False), 9),
    "chain": lambda: (graphs.chain_graph(10), 10),
    "chain-directed": lambda: (graphs.chain_graph(10, directed=True), 10),
    "causal": lambda: (graphs.causal_graph(10), 10),
    "window": lambda: (graphs.window_graph(12, 2), 12),
    "causal-window": lambda: (graphs.window_graph(12, 3, causal=True), 12),
    "grid": lambda: (graphs.grid_graph(4, 5), 20),
    "grid-radius-2": lambda: (graphs.grid_graph(3, 6, radius=2), 18),
    "longformer": lambda: (graphs.union([graphs.window_graph(14, 2),
                                         graphs.global_token_graph(14, [0, 7])], 14), 14),
    "bigbird": lambda: (graphs.union([graphs.window_graph(14, 1),
                                      graphs.global_token_graph(14, 2),
                                      graphs.random_graph(
                                          14, 3, generator=torch.Generator().manual_seed(4))],
                                     14), 14),
    "sinks-causal-window": lambda: (graphs.union([graphs.window_graph(14, 3, causal=True),
                                                  graphs.global_token_graph(14, 2, causal=True)],
                                                 14), 14),
    "strided-causal": lambda: (graphs.strided_graph(14, 4, causal=True), 14),
    "nx-gnp": lambda: (graphs.from_networkx(nx.gnp_random_graph(14, 0.25, seed=1)), 14),
    "nx-barabasi-albert": lambda: (graphs.from_networkx(nx.barabasi_albert_graph(14, 2, seed=2)),
                                   14),
    "nx-directed": lambda: (graphs.from_networkx(nx.gnp_random_graph(14, 0.2, seed=3,
                                                                     directed=True)), 14),
}

LAYOUTS = [dict(heads=2, concat=True), dict(heads=3, concat=False)]


def make_layers(heads: int, concat: bool, add_self_loops: bool, backend: str = "reference",
                seed: int = 0):
    torch.manual_seed(seed)
    graph = GraphSelfAttention(IN_CHANNELS, 4, heads, concat=concat,
                               add_self_loops=add_self_loops, backend=backend)
    dense = DenseSelfAttention(IN_CHANNELS, 4, heads, concat=concat)
    dense.load_state_dict(graph.state_dict())
    return graph, dense


def forward_backward(layer: torch.nn.Module, forward, x: torch.Tensor):
    """Output, input gradient and parameter gradients of ``sum(out * w)`` for a fixed w."""
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = forward(layer, x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * w).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def assert_same(actual, expected) -> None:
    out_a, gx_a, grads_a = actual
    out_e, gx_e, grads_e = expected
    assert_close(out_a, out_e)
    assert_close(gx_a, gx_e)
    assert grads_a.keys() == grads_e.keys()
    for name in grads_e:
        assert_close(grads_a[name], grads_e[name])


def features(n: int) -> torch.Tensor:
    return torch.randn(n, IN_CHANNELS, generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["concat", "mean"])
@pytest.mark.parametrize("add_self_loops", [False, True], ids=["as-given", "plus-self-loops"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_graph_layer_equals_dense_with_mask(pattern, add_self_loops, layout, backend):
    edge_index, n = PATTERNS[pattern]()
    graph, dense = make_layers(**layout, add_self_loops=add_self_loops, backend=backend)
    mask = graphs.to_dense_mask(edge_index, n)
    if add_self_loops:  # compare like for like: the layer attends along edge_index + loops
        mask = mask | torch.eye(n, dtype=torch.bool)
    x = features(n)
    actual = forward_backward(graph, lambda m, x: m(x, edge_index), x)
    expected = forward_backward(dense, lambda m, x: m(x, mask=mask), x)
    assert_same(actual, expected)


def sdpa_directly(layer: torch.nn.Module, x: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """The layer's projections around a direct call of SDPA (no graphattn attention code)."""
    H, C, N = layer.heads, layer.out_channels, x.size(0)
    q = layer.lin_q(x).view(N, H, C).transpose(0, 1)  # (H, N, C)
    k = layer.lin_k(x).view(N, H, C).transpose(0, 1)  # (H, N, C)
    v = layer.lin_v(x).view(N, H, C).transpose(0, 1)  # (H, N, C)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # (H, N, C)
    out = out.transpose(0, 1)  # (N, H, C)
    out = out.reshape(N, H * C) if layer.concat else out.mean(dim=1)
    return layer.lin_out(out)


@pytest.mark.parametrize("layout", LAYOUTS, ids=["concat", "mean"])
@pytest.mark.parametrize("pattern,is_causal", [("complete", False), ("causal", True)])
def test_builtin_patterns_equal_sdpa(pattern, is_causal, layout):
    edge_index, n = PATTERNS[pattern]()
    graph, dense = make_layers(**layout, add_self_loops=False)
    x = features(n)
    actual = forward_backward(graph, lambda m, x: m(x, edge_index), x)
    via_layer = forward_backward(dense, lambda m, x: m(x, is_causal=is_causal), x)
    direct = forward_backward(dense, lambda m, x: sdpa_directly(m, x, is_causal), x)
    assert_same(actual, via_layer)
    assert_same(actual, direct)


def test_attention_weights_match_dense_matrix():
    edge_index, n = PATTERNS["window"]()
    graph, dense = make_layers(heads=2, concat=True, add_self_loops=False)
    x = features(n)
    _, (ei, alpha) = graph(x, edge_index, return_attention_weights=True)
    _, weights = dense(x, mask=graphs.to_dense_mask(edge_index, n),
                       return_attention_weights=True)  # (H, N, N)
    scattered = torch.zeros_like(weights)
    scattered[:, ei[1], ei[0]] = alpha.t()
    assert_close(scattered, weights)
    assert torch.equal(weights > 0, graphs.to_dense_mask(edge_index, n).expand_as(weights))
