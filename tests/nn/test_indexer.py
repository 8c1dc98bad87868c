"""A learned sparse graph (``GraphSelfAttention(indexer=LightningIndexer(...))``): each target
attends over the ``top_k`` of its edges that the indexer scores highest (DeepSeek's sparse
attention).

The indexer's scores are checked against its formula written out densely from its
parameters; the layer against the same layer without an indexer on the subgraph picked by
hand from those scores (outputs, the input's and parameters' gradients, the returned edges),
with edge features and a score bias picked along; and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, randomized

from graphattn import graphs
from graphattn.nn import GraphSelfAttention, LightningIndexer
from graphattn.pe import RotaryPE


def _dense_scores(indexer: LightningIndexer, u, x, pos) -> torch.Tensor:
    """``[N, N]``: s[i, j] = sum_h w_ih relu(q_ih . k_j / sqrt(D)), written out."""
    H, D = indexer.heads, indexer.channels
    q = (u @ indexer.lin_q.weight.T).view(-1, H, D)
    k = torch.nn.functional.layer_norm(x @ indexer.lin_k.weight.T, (D,),
                                       indexer.k_norm.weight, indexer.k_norm.bias, 1e-6)
    q, k = indexer.rotary.rotate_pair(q, k[:, None], pos, pos)
    w = (x @ indexer.lin_w.weight.T) / H ** 0.5  # (N, H)
    dots = torch.einsum("ihd,jd->ijh", q, k[:, 0]) / D ** 0.5  # (N, N, H)
    return (dots.relu() * w[:, None, :]).sum(-1)


@pytest.mark.parametrize("pattern", ["causal", "window", "complete-shuffled"])
def test_indexer_scores_are_its_formula(pattern, monkeypatch):
    # on a causal or complete graph (half the pairs or more: every pair's score by matrix
    # products, here in blocks of 2 targets) and on a window (one dot product per edge, in
    # chunks of 3 edges)
    from graphattn.nn import indexer as module

    monkeypatch.setattr(module, "_CHUNK_NUMBERS", 3 * 6 * 3)  # (3 heads x 6 channels x 3)
    indexer = randomized(LightningIndexer(10, 3, 6, 4, query_channels=5,
                                          rotary=RotaryPE(4)).double(), 0)
    L = 9
    u, x = torch.randn(L, 5, dtype=torch.float64), torch.randn(L, 10, dtype=torch.float64)
    pos = torch.arange(L) * 3
    graph = {"causal": graphs.causal_graph(L), "window": graphs.window_graph(L, 1),
             "complete-shuffled": graphs.complete_graph(L)[:, torch.randperm(L * L)]}[pattern]
    got = indexer(u, x, x, graph, pos_src=pos, pos_dst=pos)
    want = _dense_scores(indexer, u, x, pos)[graph[1], graph[0]]
    assert_close(got, want)
    assert not got.requires_grad  # (the choice of edges takes no gradient)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_the_layer_attends_over_the_top_k_edges_of_the_indexer(backend):
    # the layer with an indexer on a causal window is the layer without it on the subgraph of
    # each target's top 3 edges by the written-out scores: outputs, gradients, returned edges;
    # edge features and a score bias go along with their edges
    torch.manual_seed(0)
    L, k = 14, 3
    options = dict(heads=2, q_rank=5, kv_rank=4, shared_key_channels=2, score_channels=6,
                   rotary=RotaryPE(2), add_self_loops=False, edge_dim=3, backend=backend)
    indexer = LightningIndexer(8, 4, 6, k, query_channels=5, rotary=RotaryPE(2))
    layer = randomized(GraphSelfAttention(8, 4, indexer=indexer, **options).double(), 1)
    plain = GraphSelfAttention(8, 4, **options).double()
    plain.load_state_dict({key: value for key, value in layer.state_dict().items()
                           if not key.startswith("indexer.")})
    x = torch.randn(L, 8, dtype=torch.float64)
    graph, pos = graphs.window_graph(L, 5, causal=True), torch.arange(L)
    attr = torch.randn(graph.size(1), 3, dtype=torch.float64)
    bias = torch.randn(graph.size(1), 2, dtype=torch.float64)
    scores = _dense_scores(indexer, layer.lin_q.latent(x).detach(), x, pos)[graph[1], graph[0]]
    keep = torch.cat([torch.nonzero(graph[1] == i).squeeze(1)[
        scores[graph[1] == i].argsort(descending=True)[:k]] for i in range(L)]).sort().values
    results = []
    for model, edges, a, b in ((layer, graph, attr, bias),
                               (plain, graph[:, keep], attr[keep], bias[keep])):
        model.zero_grad()
        x_in = x.clone().requires_grad_(True)
        out, (returned, alpha) = model(x_in, edges, a, True, pos=pos, attn_bias=b)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results.append((out.detach(), returned, alpha.detach(), x_in.grad,
                        [p.grad for name, p in model.named_parameters()
                         if not name.startswith("indexer.")]))
    (out, edges, alpha, grad, params), (want, want_edges, want_alpha, want_grad, want_params) = \
        results
    assert torch.equal(edges, want_edges) and edges.size(1) == sum(min(k, min(i, 5) + 1)
                                                                   for i in range(L))
    assert_close(out, want)
    assert_close(alpha, want_alpha)
    assert_close(grad, want_grad)
    for ours, theirs in zip(params, want_params, strict=True):
        assert_close(ours, theirs)
    assert all(p.grad is None for p in indexer.parameters())
    assert "indexer=LightningIndexer(8, heads=4, channels=6, top_k=3, query_channels=5)" in \
        repr(layer)


def test_an_indexer_without_a_query_latent_reads_the_targets_features():
    indexer = LightningIndexer(8, 2, 4, 2)
    layer = GraphSelfAttention(8, 4, heads=2, indexer=indexer)  # (self-loops added first)
    x = torch.randn(6, 8)
    graph = graphs.complete_graph(6, self_loops=False)
    _, (edges, _) = layer(x, graph, return_attention_weights=True)
    assert torch.equal(torch.bincount(edges[1], minlength=6), torch.full((6,), 2))
    scores = indexer(x, x, x, edges)
    everything = graphs.complete_graph(6)
    all_scores = indexer(x, x, x, everything)
    for i in range(6):  # each target's two best of its 6 edges, its self-loop among them
        best = all_scores[everything[1] == i].topk(2).values
        assert_close(scores[edges[1] == i].sort(descending=True).values, best)


@pytest.mark.parametrize("make, match, error", [
    (lambda: GraphSelfAttention(8, 4, indexer=LightningIndexer(6, 2, 4, 2)),
     "indexer.in_channels must be the features' width, in_channels=8, got 6", ValueError),
    (lambda: GraphSelfAttention(8, 4, q_rank=3, indexer=LightningIndexer(8, 2, 4, 2)),
     "indexer.query_channels must be 3, the width of the layer's query latent \\(q_rank\\), "
     "got 8", ValueError),
    (lambda: GraphSelfAttention(8, 4, indexer=LightningIndexer(8, 2, 4, 2, rotary=RotaryPE(2))),
     "the indexer has a rotary embedding, which takes the positions the layer's rotary takes",
     ValueError),
    (lambda: GraphSelfAttention(8, 4, indexer=torch.nn.Linear(2, 2)),
     "indexer must be a graphattn.nn.LightningIndexer or None, got Linear", TypeError),
    (lambda: LightningIndexer(8, 2, 4, 0), "top_k must be a positive integer, got 0",
     ValueError),
    (lambda: LightningIndexer(8, 2, 4, 2, rotary=RotaryPE(6)),
     "rotary turns 6 channels, more than the indexer's channels = 4", ValueError),
])
def test_indexer_refusals(make, match, error):
    with pytest.raises(error, match=match):
        make()


def test_an_indexer_needs_the_targets_features():
    layer = GraphSelfAttention((8, 8), 4, attention="additive", add_self_loops=False,
                               indexer=LightningIndexer(8, 2, 4, 2))
    with pytest.raises(ValueError, match="x_dst is None, but the indexer weighs its heads by the "
                                         "targets' features"):
        layer((torch.randn(5, 8), None), graphs.random_graph(5, 2), size=(5, 5))
