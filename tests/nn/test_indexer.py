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
from graphattn.nn import DenseSelfAttention, GraphSelfAttention, GraphTransformer, LightningIndexer
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


@pytest.mark.parametrize("route", ["cpu kernel", "torch ops"])
@pytest.mark.parametrize("pattern", ["causal", "window", "complete-shuffled"])
def test_indexer_scores_are_its_formula(pattern, route, monkeypatch):
    # the CPU kernel (on CPU tensors: edges grouped by target, sorted into groups where they
    # are not), and the torch ops that run elsewhere: on a causal or complete graph (half the
    # pairs or more: every pair's score by matrix products, here in blocks of 2 targets) and
    # on a window (one dot product per edge, in chunks of 3 edges); both with and without
    # autograd recording, the scores and the parameters' gradients against the formula's
    from graphattn.nn import indexer as module

    monkeypatch.setattr(module, "_CHUNK_NUMBERS", 3 * 6 * 3)  # (3 heads x 6 channels x 3)
    if route == "torch ops":
        monkeypatch.setattr(module, "_KERNEL_DTYPES", ())
    indexer = randomized(LightningIndexer(10, 3, 6, 4, query_channels=5,
                                          rotary=RotaryPE(4)).double(), 0)
    L = 9
    u, x = torch.randn(L, 5, dtype=torch.float64), torch.randn(L, 10, dtype=torch.float64)
    pos = torch.arange(L) * 3
    graph = {"causal": graphs.causal_graph(L), "window": graphs.window_graph(L, 1),
             "complete-shuffled": graphs.complete_graph(L)[:, torch.randperm(L * L)]}[pattern]
    got = indexer(u, x, x, graph, pos_src=pos, pos_dst=pos)
    assert not got.requires_grad  # (the choice of edges takes no gradient)
    want = _dense_scores(indexer, u, x, pos)[graph[1], graph[0]]
    assert_close(got, want)
    weights = torch.randn(graph.size(1), dtype=torch.float64)
    grads = []
    for scores in (indexer._scores(u, x, x, graph, pos, pos), want):  # (the loss's way)
        grads.append(torch.autograd.grad((scores * weights).sum(), list(indexer.parameters())))
    for grad, want_grad in zip(*grads, strict=True):
        assert_close(grad, want_grad)


def test_the_cpu_kernels_gradients_pass_gradcheck():
    # the CPU kernels' scores of a shuffled multigraph (sorted by target inside) against
    # finite differences, in the queries, keys and head weights
    from graphattn.nn.indexer import _cpu_scores

    gen = torch.Generator().manual_seed(6)
    edges = torch.randint(0, 5, (2, 30), generator=gen)
    q, k, w = (torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
               for shape in ((5, 3, 4), (5, 4), (5, 3)))
    assert torch.autograd.gradcheck(lambda *t: _cpu_scores(*t, *edges), (q, k, w))


@pytest.mark.parametrize("route", ["cpu kernel", "torch ops"])
def test_indexer_dense_scores_are_its_formula(route, monkeypatch):
    # every pair's score of each of a batch of sequences (the dense layer's), by the CPU
    # kernel or by matrix products in blocks of 2 targets (off the CPU)
    from graphattn.nn import indexer as module

    monkeypatch.setattr(module, "_CHUNK_NUMBERS", 3 * 6 * 2)
    if route == "torch ops":
        monkeypatch.setattr(module, "_KERNEL_DTYPES", ())
    indexer = randomized(LightningIndexer(10, 3, 6, 4, query_channels=5,
                                          rotary=RotaryPE(4)).double(), 5)
    u, x = torch.randn(2, 7, 5, dtype=torch.float64), torch.randn(2, 7, 10, dtype=torch.float64)
    pos = torch.arange(7) * 2
    got = indexer.dense_scores(u, x, pos)
    assert got.shape == (2, 7, 7) and not got.requires_grad
    for b in range(2):
        assert_close(got[b], _dense_scores(indexer, u[b], x[b], pos))


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
    assert ("indexer=LightningIndexer(8, heads=4, channels=6, top_k=3, query_channels=5, "
            "rotary=RotaryPE(2))") in repr(layer)


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
    # checked with or without indexer_top_k: a typo would otherwise wait for the day it is set
    (lambda: GraphTransformer(8, 8, 3, indexer_heads=0),
     "indexer_heads must be a positive integer, got 0", ValueError),
    (lambda: GraphTransformer(8, 8, 3, indexer_channels=-4),
     "indexer_channels must be a positive integer, got -4", ValueError),
])
def test_indexer_refusals(make, match, error):
    with pytest.raises(error, match=match):
        make()


@pytest.mark.parametrize("layer", [GraphSelfAttention, DenseSelfAttention])
def test_a_given_indexer_keeps_its_weights_until_the_layer_is_reset(layer):
    # a trained indexer handed to a new layer stays trained (its constructor initialised it
    # once; the layer's reset in its own constructor overwrote the weights);
    # reset_parameters() then re-initialises it with the layer
    indexer = randomized(LightningIndexer(10, 3, 8, 4), 7)
    trained = {name: p.clone() for name, p in indexer.state_dict().items()}
    model = layer(10, 4, heads=2, indexer=indexer)
    assert model.indexer is indexer
    for name, p in indexer.state_dict().items():
        assert torch.equal(p, trained[name]), name
    model.reset_parameters()
    assert not torch.equal(indexer.lin_q.weight, trained["lin_q.weight"])


def test_an_indexer_needs_the_targets_features():
    layer = GraphSelfAttention((8, 8), 4, attention="additive", add_self_loops=False,
                               indexer=LightningIndexer(8, 2, 4, 2))
    with pytest.raises(ValueError, match="x_dst is None, but the indexer weighs its heads by the "
                                         "targets' features"):
        layer((torch.randn(5, 8), None), graphs.random_graph(5, 2), size=(5, 5))


def test_indexer_loss_is_the_kl_divergence_written_out():
    # KL(p_i || softmax(s_i)) per target over its edges, p the heads' weights summed and
    # normalised; mean over the targets with edges, or their sum; the gradient reaches the
    # indexer's parameters alone
    torch.manual_seed(2)
    indexer = randomized(LightningIndexer(8, 3, 4, 2, rotary=RotaryPE(2)).double(), 3)
    layer = GraphSelfAttention(8, 4, heads=2, rotary=RotaryPE(4), add_self_loops=False,
                               indexer=indexer).double()
    L = 10
    x = torch.randn(L, 8, dtype=torch.float64, requires_grad=True)
    graph = graphs.window_graph(L, 2, causal=True)[:, 1:]  # (target 0 without an edge)
    pos = torch.arange(L)
    alpha = torch.rand(graph.size(1), 2, dtype=torch.float64, requires_grad=True)
    loss = layer.indexer_loss(x, graph, alpha, pos=pos)
    scores = _dense_scores(indexer, x.detach(), x.detach(), pos)
    want = []
    for i in range(1, L):
        mine = graph[1] == i
        p = alpha.detach()[mine].sum(-1)
        p = p / p.sum()
        log_q = torch.log_softmax(scores[i, graph[0, mine]], dim=0)
        want.append((p * (p.log() - log_q)).sum())
    assert_close(loss, torch.stack(want).mean())
    assert_close(layer.indexer_loss(x, graph, alpha, pos=pos, reduction="sum"),
                 torch.stack(want).sum())
    loss.backward()
    assert x.grad is None and alpha.grad is None
    assert all(p.grad is not None for p in indexer.parameters())
    assert all(p.grad is None for name, p in layer.named_parameters()
               if not name.startswith("indexer."))


def test_training_the_indexer_on_the_attention_s_weights_picks_the_attention_s_edges():
    # DeepSeek's dense warm-up: the layer attends over every causal edge (top_k = L), and the
    # indexer learns the attention's weights by the loss: the loss falls, and the edges it
    # would keep (its top 4) come to hold more of the attention's weight than at first
    torch.manual_seed(3)
    L = 24
    indexer = LightningIndexer(16, 4, 8, L, rotary=RotaryPE(4))
    layer = GraphSelfAttention(16, 8, heads=2, rotary=RotaryPE(8), add_self_loops=False,
                               indexer=indexer)
    x, graph, pos = torch.randn(L, 16), graphs.causal_graph(L), torch.arange(L)
    with torch.no_grad():
        _, (edges, alpha) = layer(x, graph, pos=pos, return_attention_weights=True)

    def weight_kept() -> float:  # the attention's weight on the indexer's top 4 per target
        keep = graphs.top_k_edges(edges, indexer(x, x, x, edges, pos_src=pos, pos_dst=pos),
                                  4, L)
        return alpha[keep].sum().item() / alpha.sum().item()

    first, kept_first = layer.indexer_loss(x, edges, alpha, pos=pos).item(), weight_kept()
    optimizer = torch.optim.Adam(indexer.parameters(), lr=1e-2)
    for _ in range(150):
        optimizer.zero_grad()
        layer.indexer_loss(x, edges, alpha, pos=pos).backward()
        optimizer.step()
    last = layer.indexer_loss(x, edges, alpha, pos=pos).item()
    assert last < 0.5 * first
    assert weight_kept() > kept_first + 0.1


def test_indexer_called_directly_checks_its_graph():
    """The indexer is public: called on its own, its edge_index is checked as the layer checks
    it (an id past the nodes read memory out of bounds in the cpu kernel, and came back as a
    score)."""
    indexer, x = LightningIndexer(6, 2, 4, top_k=2), torch.randn(4, 6)
    for call in (lambda ei: indexer(x, x, x, ei),
                 lambda ei: indexer.loss(x, x, x, ei, torch.rand(ei.size(1), 2))):
        with pytest.raises(ValueError, match=r"edge_index\[0\] \(sources\) must be < the "
                                             r"number of source nodes 4, got a maximum of 1000"):
            call(torch.tensor([[1000], [0]]))
        with pytest.raises(ValueError, match=r"edge_index\[1\] \(targets\) must be < the "
                                             r"number of target nodes 4, got a maximum of 9"):
            call(torch.tensor([[0], [9]]))
        with pytest.raises(ValueError, match=r"edge_index must hold node ids >= 0, got a "
                                             r"minimum of -5"):
            call(torch.tensor([[-5], [0]]))
        with pytest.raises(TypeError, match=r"edge_index must have an integer dtype"):
            call(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    with pytest.raises(TypeError, match=r"alpha must be a torch.Tensor, got list"):
        indexer.loss(x, x, x, graphs.complete_graph(4), [0.1] * 16)


def test_indexer_loss_refusals():
    layer = GraphSelfAttention(8, 4, heads=2, indexer=LightningIndexer(8, 2, 4, 2))
    x, graph = torch.randn(5, 8), graphs.complete_graph(5)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum', got 'max'"):
        layer.indexer_loss(x, graph, torch.rand(25, 2), reduction="max")
    with pytest.raises(ValueError, match="alpha must have shape \\[E, H\\] or \\[E\\] with "
                                         "E = 25, got \\[24, 2\\]"):
        layer.indexer_loss(x, graph, torch.rand(24, 2))
    with pytest.raises(ValueError, match="indexer_loss needs a layer with an indexer"):
        GraphSelfAttention(8, 4).indexer_loss(x, graph, torch.rand(25))
    # a differential layer's weights alpha_1 - lambda alpha_2 are signed: no distribution to
    # fit (the loss dropped the negative ones and fit rows summing past 1)
    differential = GraphSelfAttention(8, 4, heads=2, differential=True,
                                      indexer=LightningIndexer(8, 2, 4, 2))
    _, (edges, alpha) = differential(x, graph, return_attention_weights=True)
    assert (alpha < 0).any()
    with pytest.raises(ValueError, match="a differential layer's are signed"):
        differential.indexer_loss(x, edges, alpha)
    # a model of such blocks could never train its indexers: refused as it is built
    with pytest.raises(ValueError, match="differential=True with indexer_top_k: .* a "
                                         "differential block's are signed"):
        GraphTransformer(8, 8, 3, num_layers=1, heads=2, differential=True, indexer_top_k=2,
                         dropout=0.0)


@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("extremes", [False, True])
def test_the_dense_choice_is_the_graph_choice(extremes, k):
    # top_k_mask on a random mask keeps what top_k_edges keeps on the mask's graph, with ties
    # (scores rounded) and NaN among the scores, or scores drawn from the extremes (+inf above
    # the largest finite, -inf below the lowest, NaN below -inf, both zeros)
    from graphattn.nn.indexer import top_k_mask

    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(3, 15, 15, generator=gen) < 0.6
    scores = (torch.randn(3, 15, 15, generator=gen) * 2).round()
    scores[:, :, ::5] = float("nan")
    if extremes:
        big = torch.finfo(scores.dtype).max
        values = torch.tensor([big, float("inf"), float("nan"), -float("inf"), -big, 0.0, -0.0])
        scores = values[torch.randint(0, 7, scores.shape, generator=gen)]
    kept = top_k_mask(scores, mask, k)
    for b in range(3):
        graph = graphs.from_dense_mask(mask[b])  # (by target, then source)
        keep = graphs.top_k_edges(graph, scores[b][graph[1], graph[0]], k, 15)
        assert torch.equal(graphs.to_dense_mask(graph[:, keep], 15), kept[b])


@pytest.mark.parametrize("how", ["causal", "mask", "batch-of-sequences"])
def test_the_dense_layer_with_an_indexer_is_the_graph_layer(how):
    # DenseSelfAttention(indexer=) with the graph layer's state_dict: each query's top 3 keys
    # of those the mask allows, by the same indexer: outputs and every gradient
    from graphattn.nn import DenseSelfAttention

    torch.manual_seed(5)
    L = 12
    options = dict(heads=2, q_rank=5, kv_rank=4, shared_key_channels=2, score_channels=6,
                   rotary=RotaryPE(2))
    make = lambda: LightningIndexer(8, 3, 4, 3, query_channels=5, rotary=RotaryPE(2))  # noqa: E731
    graph_layer = randomized(GraphSelfAttention(8, 4, add_self_loops=False, indexer=make(),
                                                **options).double(), 6)
    dense_layer = DenseSelfAttention(8, 4, indexer=make(), **options).double()
    dense_layer.load_state_dict(graph_layer.state_dict())
    gen = torch.Generator().manual_seed(7)
    B = 2 if how == "batch-of-sequences" else 1
    x = torch.randn(B, L, 8, generator=gen, dtype=torch.float64)
    masks = torch.rand(B, L, L, generator=gen) < 0.5
    if how == "causal":
        masks = torch.ones(B, L, L, dtype=torch.bool).tril()
    results = []
    for layer in (graph_layer, dense_layer):
        layer.zero_grad()
        x_in = x.clone().requires_grad_(True)
        if layer is graph_layer:
            out = torch.stack([layer(x_in[b], graphs.from_dense_mask(masks[b]),
                                     pos=torch.arange(L)) for b in range(B)])
        else:
            out = (layer(x_in, is_causal=True) if how == "causal"
                   else layer(x_in, masks if B > 1 else masks[0]))
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        results.append((out.detach(), x_in.grad, [p.grad for name, p in
                                                  layer.named_parameters()
                                                  if not name.startswith("indexer.")]))
    (out, grad, params), (want, want_grad, want_params) = results
    assert_close(out.view_as(want), want)
    assert_close(grad, want_grad)
    for ours, theirs in zip(params, want_params, strict=True):
        assert_close(ours, theirs)
    assert "indexer=LightningIndexer(8, heads=3" in repr(dense_layer)
    with pytest.raises(ValueError, match="an indexer with batch= is not supported"):
        dense_layer(x[0], batch=torch.zeros(L, dtype=torch.long), pos=torch.arange(L))


def test_an_indexer_on_no_tokens():
    # (found by the dense-pair property test: the dense scores of an empty sequence failed to
    # reshape) both layers give empty outputs on 0 tokens
    from graphattn.nn import DenseSelfAttention

    dense = DenseSelfAttention(8, 4, heads=2, indexer=LightningIndexer(8, 2, 4, 3))
    assert dense(torch.randn(0, 8), is_causal=True).shape == (0, 8)
    assert dense(torch.randn(2, 0, 8)).shape == (2, 0, 8)
    graph = GraphSelfAttention(8, 4, heads=2, indexer=LightningIndexer(8, 2, 4, 3))
    assert graph(torch.randn(0, 8), torch.empty(2, 0, dtype=torch.long)).shape == (0, 8)


def test_graph_transformer_with_indexers_and_their_loss():
    # every block attends over each target's top 3 edges by its own indexer (rotating half
    # its channels, as the model's RoPE does); return_indexer_loss gives the sum of the
    # blocks' indexer losses, recomputed here from each block's input, and its gradient
    # reaches the indexers alone
    torch.manual_seed(8)
    model = GraphTransformer(8, 16, 3, num_layers=2, heads=2, rotary=RotaryPE(8),
                             add_self_loops=False, dropout=0.0, indexer_top_k=3,
                             indexer_heads=2, indexer_channels=6)
    assert all((a.indexer.top_k, a.indexer.heads, a.indexer.channels, a.indexer.rotary.dim)
               == (3, 2, 6, 2) for a in model.attns)
    L = 10
    x, graph, pos = torch.randn(L, 8), graphs.causal_graph(L), torch.arange(L)
    inputs = []
    hooks = [a.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
             for a in model.attns]
    out, weights, loss = model(x, graph, pos=pos, return_attention_weights=True,
                               return_indexer_loss=True)
    for hook in hooks:
        hook.remove()
    assert_close(out, model(x, graph, pos=pos))
    want = sum(a.indexer_loss(h, edges, alpha, pos=pos)
               for a, h, (edges, alpha) in zip(model.attns, inputs, weights, strict=True))
    assert_close(loss, want)
    assert all(torch.equal(torch.bincount(edges[1]), torch.arange(1, L + 1).clamp(max=3))
               for edges, _ in weights)
    loss.backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (".indexer." in name), name
    with pytest.raises(ValueError, match="return_indexer_loss=True needs a model with "
                                         "indexers"):
        GraphTransformer(8, 16, 3)(x, graph, return_indexer_loss=True)
    # the graph as a sparse adjacency: the weights come back as one, and the loss is the same
    for layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc):
        adj_t = graphs.to_sparse_adjacency(graph, L, L, layout=layout)
        _, sparse_weights, sparse_loss = model(x, adj_t, pos=pos, return_attention_weights=True,
                                               return_indexer_loss=True)
        assert_close(sparse_loss, loss)
        assert sparse_weights[0][0].layout == layout
        attn = model.attns[0]
        assert_close(attn.indexer_loss(inputs[0], *sparse_weights[0], pos=pos),
                     attn.indexer_loss(inputs[0], *weights[0], pos=pos))
