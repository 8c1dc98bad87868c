"""Relative positional encodings: hop distances, ALiBi and learned distance biases.

``pe.hop_distance`` is checked against networkx's breadth-first search and closed forms (a
chain's |i - j|, a grid's Chebyshev distance); ALiBi on a chain graph against ALiBi written out
for a sequence; a learned distance bias (Graphormer's spatial encoding) and per-head patterns on
the edge route (``GraphSelfAttention``) against the dense route (``DenseSelfAttention``), which
takes the same bias as a dense ``attn_bias``.
"""

from __future__ import annotations

import math

import networkx as nx
import pytest
import torch
from conftest import GRAPHS, assert_close, dense_mask

from graphattn import graphs, pe
from graphattn.functional import dense_attention, edge_attention
from graphattn.nn import DenseSelfAttention, GraphSelfAttention

SQUARE_GRAPHS = [g for g in GRAPHS if not g.bipartite]


def networkx_distances(edge_index: torch.Tensor, num_nodes: int, directed: bool) -> torch.Tensor:
    """``[N, N]``: entry [i, j] the number of edges on a shortest path j -> i, -1 if none."""
    G = nx.DiGraph() if directed else nx.Graph()
    G.add_nodes_from(range(num_nodes))
    G.add_edges_from(edge_index.t().tolist())
    out = torch.full((num_nodes, num_nodes), -1, dtype=torch.int64)
    for j, lengths in nx.all_pairs_shortest_path_length(G):
        for i, d in lengths.items():
            out[i, j] = d
    return out


NX_GRAPHS = {
    "gnp": lambda: (graphs.from_networkx(nx.gnp_random_graph(30, 0.08, seed=1)), 30),
    "gnp-directed": lambda: (graphs.from_networkx(nx.gnp_random_graph(30, 0.06, seed=2,
                                                                      directed=True)), 30),
    "barabasi-albert": lambda: (graphs.from_networkx(nx.barabasi_albert_graph(40, 1, seed=3)),
                                40),
    "two-components": lambda: (graphs.union([graphs.chain_graph(6),
                                             graphs.chain_graph(9)[:, :0] + 0], 12), 12),
}


@pytest.mark.parametrize("directed", [False, True])
@pytest.mark.parametrize("name", list(NX_GRAPHS))
def test_hop_distance_equals_networkx(name, directed):
    edge_index, n = NX_GRAPHS[name]()
    expected = networkx_distances(edge_index, n, directed)
    assert torch.equal(pe.hop_distance(edge_index, n, directed=directed), expected)


@pytest.mark.parametrize("directed", [False, True])
@pytest.mark.parametrize("case", SQUARE_GRAPHS, ids=[g.name for g in SQUARE_GRAPHS])
def test_hop_distance_on_the_registry(case, directed, index_dtype):
    n = case.num_src
    edge_index = case.edge_index.to(index_dtype)
    expected = networkx_distances(case.edge_index, n, directed)
    assert torch.equal(pe.hop_distance(edge_index, n, directed=directed), expected)
    # pairs: every pair in a shuffled order, some twice, as int32 or int64 ids
    gen = torch.Generator().manual_seed(0)
    dst, src = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    pairs = torch.stack([src.reshape(-1), dst.reshape(-1)])
    pairs = pairs[:, torch.randint(0, n * n, (3 * n * n,), generator=gen)].to(index_dtype)
    got = pe.hop_distance(edge_index, n, pairs, directed=directed)
    assert got.dtype == torch.int64 and got.shape == (pairs.size(1),)
    assert torch.equal(got, expected[pairs[1].long(), pairs[0].long()])


def test_hop_distance_closed_forms():
    n = 11
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert torch.equal(pe.hop_distance(graphs.chain_graph(n), n), (i - j).abs())
    # the directed chain j -> j + 1: only forward, i - j steps
    directed = pe.hop_distance(graphs.chain_graph(n, directed=True), n, directed=True)
    assert torch.equal(directed, torch.where(i >= j, i - j, -1))
    cycle = graphs.union([graphs.chain_graph(n), torch.tensor([[0, n - 1], [n - 1, 0]])], n)
    assert torch.equal(pe.hop_distance(cycle, n), torch.minimum((i - j).abs(),
                                                                n - (i - j).abs()))
    complete = pe.hop_distance(graphs.complete_graph(n, self_loops=False), n)
    assert torch.equal(complete, 1 - torch.eye(n, dtype=torch.int64))
    # a grid's 3 x 3 neighbourhoods: Chebyshev distance; radius 2: half of it, rounded up
    h, w = 5, 7
    r, c = torch.arange(h * w) // w, torch.arange(h * w) % w
    chebyshev = torch.maximum((r[:, None] - r[None]).abs(), (c[:, None] - c[None]).abs())
    assert torch.equal(pe.hop_distance(graphs.grid_graph(h, w), h * w), chebyshev)
    assert torch.equal(pe.hop_distance(graphs.grid_graph(h, w, radius=2), h * w),
                       (chebyshev + 1) // 2)


@pytest.mark.parametrize("max_distance", [0, 1, 3, 100])
def test_hop_distance_stops_at_max_distance(max_distance):
    edge_index, n = NX_GRAPHS["barabasi-albert"]()
    full = pe.hop_distance(edge_index, n)
    cut = pe.hop_distance(edge_index, n, max_distance=max_distance)
    assert torch.equal(cut, torch.where(full <= max_distance, full, -1))


def test_hop_distance_of_many_pairs_on_two_threads(two_threads):
    # past the pairs one thread takes alone: the targets are split over a pool
    edge_index, n = graphs.grid_graph(15, 16), 240
    r, c = torch.arange(n) // 16, torch.arange(n) % 16
    chebyshev = torch.maximum((r[:, None] - r[None]).abs(), (c[:, None] - c[None]).abs())
    assert torch.equal(pe.hop_distance(edge_index, n), chebyshev)
    assert torch.equal(pe.hop_distance(edge_index, n, max_distance=4),
                       torch.where(chebyshev <= 4, chebyshev, -1))


def test_hop_distance_without_pairs_or_nodes():
    assert pe.hop_distance(graphs.chain_graph(4), 4,
                           torch.zeros(2, 0, dtype=torch.long)).shape == (0,)
    assert pe.hop_distance(torch.zeros(2, 0, dtype=torch.long), 0).shape == (0, 0)
    lone = pe.hop_distance(torch.zeros(2, 0, dtype=torch.long), 3)
    assert torch.equal(lone, torch.where(torch.eye(3, dtype=torch.bool), 0, -1))


@pytest.mark.parametrize("call, error, match", [
    (lambda: pe.hop_distance(graphs.chain_graph(4), 4, torch.zeros(3, 2, dtype=torch.long)),
     ValueError, r"pairs must have shape \[2, P\]"),
    (lambda: pe.hop_distance(graphs.chain_graph(4), 4, torch.tensor([[0], [4]])),
     ValueError, r"^pairs: .*4"),  # (the message named edge_index alone)
    (lambda: pe.hop_distance(graphs.chain_graph(4), 4, torch.zeros(2, 1)),
     TypeError, r"^pairs: .*integer dtype"),
    (lambda: pe.hop_distance(graphs.chain_graph(4), 3), ValueError, "3"),
    (lambda: pe.hop_distance(graphs.chain_graph(4), 4, max_distance=-1),
     ValueError, "max_distance must be a non-negative integer, got -1"),
    (lambda: pe.hop_distance(graphs.chain_graph(4), 4, directed="yes"),
     TypeError, "directed must be a bool"),
    (lambda: pe.alibi_slopes(0), ValueError, "heads must be a positive integer, got 0"),
    (lambda: pe.alibi_bias(torch.zeros(3), 2), TypeError, "distance must be an integer"),
    (lambda: pe.alibi_bias(torch.tensor([0, -2]), 2), ValueError, "got -2"),
    (lambda: pe.DistanceBias(0, 3), ValueError, "heads must be a positive integer, got 0"),
    (lambda: pe.DistanceBias(2, -1), ValueError,
     "max_distance must be a non-negative integer, got -1"),
    (lambda: pe.DistanceBias(2, 3)(torch.tensor([1.0])), TypeError,
     "distance must be an integer"),
])
def test_relative_pe_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_alibi_slopes_are_the_papers():
    # Press et al. (2022), section 3: 8 heads 1/2 .. 1/2^8; 16 heads 1/2^0.5 .. 1/2^8
    assert torch.equal(pe.alibi_slopes(8), torch.tensor([2.0 ** -h for h in range(1, 9)],
                                                        dtype=torch.float64))
    assert_close(pe.alibi_slopes(16), torch.tensor([2.0 ** (-h / 2) for h in range(1, 17)],
                                                   dtype=torch.float64))
    assert torch.equal(pe.alibi_slopes(1), torch.tensor([2.0 ** -8], dtype=torch.float64))
    # other counts, by the authors' rule: 2^floor(log2 H) heads, then the odd slopes of twice
    # as many: 3 heads -> (1/16, 1/256) + (1/4); 12 -> the 8 above + 2^-0.5, 2^-1.5, ...
    assert torch.equal(pe.alibi_slopes(3), torch.tensor([1 / 16, 1 / 256, 1 / 4],
                                                        dtype=torch.float64))
    assert_close(pe.alibi_slopes(12), torch.tensor(
        [2.0 ** -h for h in range(1, 9)] + [2.0 ** (-h / 2) for h in (1, 3, 5, 7)],
        dtype=torch.float64))


def test_alibi_bias_values():
    distance = torch.tensor([[0, 3], [-1, 1]])
    bias = pe.alibi_bias(distance, 2)  # slopes 1/16, 1/256
    assert bias.shape == (2, 2, 2) and bias.dtype == torch.get_default_dtype()
    expected = torch.tensor([[[0.0, 0.0], [-3 / 16, -3 / 256]],
                             [[-math.inf, -math.inf], [-1 / 16, -1 / 256]]])
    assert torch.equal(bias, expected)
    assert pe.alibi_bias(distance, 2, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype .*got "
                                        "torch.int64"):
        pe.alibi_bias(distance, 2, dtype=torch.int64)


def alibi_causal_attention(q, k, v):
    """ALiBi's causal attention on a sequence, written out: softmax(q k / sqrt(C) - m (i - j))
    over j <= i, with 2^-8(h+1)/H as the slopes (H a power of two)."""
    L, H, C = q.shape
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / H) for h in range(H)], dtype=q.dtype)
    scores = torch.einsum("ihc,jhc->hij", q, k) / math.sqrt(C) - slopes[:, None, None] * (i - j)
    scores = scores.masked_fill(j > i, -math.inf)
    return torch.einsum("hij,jhc->ihc", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_alibi_on_the_chain_graph_is_alibi(backend):
    L, H, C = 13, 4, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(L, H, C, generator=gen, requires_grad=True) for _ in range(3))
    causal = graphs.causal_graph(L)
    bias = pe.alibi_bias(pe.hop_distance(graphs.chain_graph(L), L, causal), H)  # (E, H)
    out = edge_attention(q, k, v, causal, bias=bias, backend=backend)
    expected = alibi_causal_attention(q, k, v)
    assert_close(out, expected)
    w = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad((expected * w).sum(), (q, k, v)),
                         strict=True):
        assert_close(got, want)
    # the dense route: the (L, L) distances, heads in front
    dense_bias = pe.alibi_bias(pe.hop_distance(graphs.chain_graph(L), L), H).movedim(-1, 0)
    assert_close(dense_attention(q, k, v, is_causal=True, attn_bias=dense_bias), expected)


def layer_pair(heads: int, seed: int = 0):
    torch.manual_seed(seed)
    graph = GraphSelfAttention(8, 4, heads, add_self_loops=False, backend="reference")
    dense = DenseSelfAttention(8, 4, heads)
    dense.load_state_dict(graph.state_dict())
    return graph, dense


def run(layer, spatial, call, x):
    """Output, x's gradient and every parameter's gradient (the layer's and the bias's)."""
    for module in (layer, spatial):
        module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = call(x)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * w).sum().backward()
    params = {**dict(layer.named_parameters()), **dict(spatial.named_parameters(prefix="pe"))}
    return out.detach(), x.grad, {name: p.grad for name, p in params.items()}


@pytest.mark.parametrize("max_distance", [2, 3])
@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_distance_bias_on_the_complete_graph_equals_the_dense_layer(backend, max_distance):
    # Graphormer: attention over all pairs of a molecule-like graph (two components, so some
    # pairs have no path), a learned bias per head and hop distance
    structure = graphs.union([graphs.from_networkx(nx.barabasi_albert_graph(9, 1, seed=4)),
                              graphs.chain_graph(5) + 9], 14)
    N, H = 14, 3
    graph, dense = layer_pair(H)
    graph.backend = backend
    spatial = pe.DistanceBias(H, max_distance)
    with torch.no_grad():
        spatial.weight.normal_(generator=torch.Generator().manual_seed(1))
    edges = graphs.complete_graph(N)
    dist_edges = pe.hop_distance(structure, N, edges)  # (E,)
    dist_dense = pe.hop_distance(structure, N)  # (N, N)
    assert (dist_dense == -1).any() and (dist_dense > max_distance).any()
    x = torch.randn(N, 8, generator=torch.Generator().manual_seed(2))
    got = run(graph, spatial, lambda x: graph(x, edges, attn_bias=spatial(dist_edges)), x)
    want = run(dense, spatial,
               lambda x: dense(x, attn_bias=spatial(dist_dense).movedim(-1, 0)), x)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        assert_close(got[2][name], want[2][name], msg=name)
    assert got[2]["pe.weight"].abs().sum() > 0


def test_distance_bias_buckets():
    spatial = pe.DistanceBias(2, 3)
    assert torch.equal(spatial.weight, torch.zeros(5, 2))
    with torch.no_grad():
        spatial.weight.copy_(torch.arange(10.0).view(5, 2))
    distance = torch.tensor([[0, 1, 2], [3, 4, 50], [-1, 2, 0]])
    bucket = torch.tensor([[0, 1, 2], [3, 4, 4], [4, 2, 0]])
    assert torch.equal(spatial(distance), spatial.weight[bucket])
    assert spatial(distance.int()).shape == (3, 3, 2)
    # distances of a dtype too narrow for max_distance + 1, the far bucket's
    wide = pe.DistanceBias(1, 200)
    narrow = torch.tensor([-1, 5, 127], dtype=torch.int8)
    assert torch.equal(wide(narrow), wide(narrow.long()))
    assert repr(spatial) == "DistanceBias(heads=2, max_distance=3)"
    spatial.reset_parameters()
    assert torch.equal(spatial.weight, torch.zeros(5, 2))


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_head_patterns_on_the_dense_layer(backend):
    # head 0 a causal window, head 1 a strided pattern, head 2 only the global token 0's row:
    # rows of head 2 without any key get 0 there, on both routes
    n = 12
    heads = [graphs.window_graph(n, 2, causal=True), graphs.strided_graph(n, 4, causal=True),
             graphs.global_token_graph(n, [0])[:, :n]]
    edge_index, bias = graphs.head_patterns(heads, n)
    masks = torch.stack([dense_mask(h, n, n) for h in heads])  # (H, N, N)
    assert (~masks[2].any(dim=-1)).any()
    dense_bias = torch.zeros(masks.shape).masked_fill(~masks, -math.inf)
    graph, dense = layer_pair(3)
    graph.backend = backend
    spatial = torch.nn.Module()  # no parameters of its own
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(2))
    got = run(graph, spatial, lambda x: graph(x, edge_index, attn_bias=bias), x)
    want = run(dense, spatial, lambda x: dense(x, attn_bias=dense_bias), x)
    for a, b in zip(got[:2], want[:2], strict=True):
        assert_close(a, b)
    for name in want[2]:
        assert_close(got[2][name], want[2][name], msg=name)


@pytest.mark.parametrize("return_attention", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_dense_attention_bias_equals_edge_attention_bias(with_mask, return_attention):
    # a batch of 2, a bias per head (H = 3) or shared (H = 1) with some -inf, a mask on top:
    # outputs, weights and the gradients of q, k, v and the bias against edge_attention per
    # batch entry on the pairs left
    B, L, H, C = 2, 9, 3, 4
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, L, H, C, generator=gen, requires_grad=True) for _ in range(3))
    mask = torch.rand(L, L, generator=gen) > 0.3 if with_mask else None
    for bias_heads in (H, 1):
        base = torch.randn(B, bias_heads, L, L, generator=gen)
        base[0, 0, 4, :] = -math.inf  # a row without keys in (one or every) head
        base[1, :, :, 2] = -math.inf  # a key no query reads
        bias = base.requires_grad_()
        result = dense_attention(q, k, v, mask, attn_bias=bias,
                                 return_attention=return_attention)
        out, weights = result if return_attention else (result, None)
        w = torch.randn(out.shape, generator=gen)
        got = torch.autograd.grad((out * w).sum(), (q, k, v, bias))
        allowed = torch.ones(L, L, dtype=torch.bool) if mask is None else mask
        edge_index = graphs.from_dense_mask(allowed)  # (2, E): j -> i where allowed[i, j]
        src, dst = edge_index
        outs, want_grads = [], [torch.zeros_like(t) for t in (q, k, v, bias)]
        for b in range(B):
            qb, kb, vb = (t[b].detach().requires_grad_() for t in (q, k, v))
            bias_b = base[b].detach().expand(H, L, L).requires_grad_()
            edge_bias = bias_b[:, dst, src].t()  # (E, H)
            out_b, alpha = edge_attention(qb, kb, vb, edge_index, bias=edge_bias,
                                          backend="reference", return_attention=True)
            grads = torch.autograd.grad((out_b * w[b]).sum(), (qb, kb, vb, bias_b))
            for t, g in zip(want_grads[:3], grads[:3], strict=True):
                t[b] = g
            want_grads[3][b] = grads[3].sum(dim=0, keepdim=True) if bias_heads == 1 else grads[3]
            outs.append(out_b)
            if return_attention:
                dense_alpha = torch.zeros(H, L, L)
                dense_alpha[:, dst, src] = alpha.t()
                assert_close(weights[b], dense_alpha)
        assert_close(out, torch.stack(outs))
        assert torch.isfinite(out).all()
        assert (out[0, 4, 0] == 0).all() if bias_heads == H else (out[0, 4] == 0).all()
        for g, want in zip(got, want_grads, strict=True):
            assert torch.isfinite(g).all()
            assert_close(g, want)


@pytest.mark.parametrize("call, error, match", [
    (lambda q: dense_attention(q, q, q, attn_bias=torch.zeros(2, 5, 5, dtype=torch.bool)),
     TypeError, "attn_bias must be a floating-point tensor \\(a bool pattern goes to mask\\)"),
    (lambda q: dense_attention(q, q, q, attn_bias=torch.zeros(3, 5, 5)), ValueError,
     r"attn_bias must have shape \[..., H, L_q, L_k\] = \[..., 2, 5, 5\] \(H may be 1\), "
     r"got \[3, 5, 5\]"),
    (lambda q: dense_attention(q, q, q, attn_bias=torch.zeros(5, 5)), ValueError,
     r"got \[5, 5\]"),
    (lambda q: dense_attention(q, q, q, attn_bias=torch.zeros(4, 2, 5, 5)), ValueError,
     r"leading dims of attn_bias must broadcast to those of q, k and v \[\], got "
     r"attn_bias \[4, 2, 5, 5\]"),
    (lambda q: dense_attention(q, q, q, attn_bias=torch.zeros(2, 5, 5),
                               batch=torch.zeros(5, dtype=torch.long)),
     ValueError, "attn_bias and batch cannot be combined"),
])
def test_dense_attention_bias_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(5, 2, 4))


def test_dense_layer_bias_broadcasts_over_a_batch():
    # one (H, L, L) bias for every sequence of a batch equals each sequence alone
    _, dense = layer_pair(2)
    x = torch.randn(3, 7, 8, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(2, 7, 7, generator=torch.Generator().manual_seed(1))
    out, weights = dense(x, attn_bias=bias, is_causal=True, return_attention_weights=True)
    for b in range(3):
        out_b, weights_b = dense(x[b], attn_bias=bias, is_causal=True,
                                 return_attention_weights=True)
        assert_close(out[b], out_b)
        assert_close(weights[b], weights_b)
    assert (weights.triu(1) == 0).all()


def test_hop_distance_over_a_mini_batch_of_graphs():
    """Graphormer on a PyG Batch: the pairs of batch_complete_graph, distances measured on the
    batch's edges, equal each graph's own distance matrix, block by block."""
    from torch_geometric.data import Batch, Data

    parts = [graphs.from_networkx(nx.barabasi_albert_graph(n, 1, seed=n)) for n in (5, 8, 3)]
    batch = Batch.from_data_list([Data(edge_index=ei, num_nodes=ei.max().item() + 1)
                                  for ei in parts])
    pairs = graphs.batch_complete_graph(batch.batch)
    got = pe.hop_distance(batch.edge_index, batch.num_nodes, pairs, max_distance=3)
    offsets = batch.ptr[batch.batch[pairs[1]]]  # (P,) first node of each pair's graph
    expected = torch.cat([pe.hop_distance(ei, ei.max().item() + 1, max_distance=3).view(-1)
                          for ei in parts])  # (P,) each graph's matrix, row-major
    assert got.shape == (pairs.size(1),)
    block = batch.batch[pairs[1]]
    local = torch.stack([pairs[0] - offsets, pairs[1] - offsets])  # ids inside each graph
    sizes = (batch.ptr[1:] - batch.ptr[:-1])[block]
    start = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long),
                                    (batch.ptr[1:] - batch.ptr[:-1]) ** 2]), 0)[block]
    assert torch.equal(got, expected[start + local[1] * sizes + local[0]])


def test_grid_positions_and_offsets_follow_grid_graph():
    h, w, R = 5, 7, 2
    positions = pe.grid_positions(h, w)
    assert positions.shape == (h * w, 2) and positions.dtype == torch.int64
    assert positions[3 * w + 4].tolist() == [3, 4]
    edges = graphs.grid_graph(h, w, radius=R)
    offsets = pe.relative_offsets(positions, edges)
    assert offsets.shape == (edges.size(1), 2)
    assert int(offsets.abs().amax()) == R  # Chebyshev radius R
    center = 2 * w + 3  # an interior pixel: every offset of the (2R+1)^2 square once
    mine = offsets[edges[1] == center]
    assert sorted(map(tuple, mine.tolist())) == [(a, b) for a in range(-R, R + 1)
                                                 for b in range(-R, R + 1)]
    # on a sequence, the signed relative position i - j
    causal = graphs.causal_graph(9)
    rel = pe.relative_offsets(torch.arange(9).unsqueeze(1), causal)
    assert torch.equal(rel[:, 0], causal[1] - causal[0])
    # one coordinate may come as [N]: the same offsets, [E, 1], as OffsetBias(dims=1) takes
    assert torch.equal(pe.relative_offsets(torch.arange(9, dtype=torch.int32), causal), rel)
    # narrow integer positions: the difference in int64 (uint8's 0 - 5 is not 251, int8's
    # 100 - (-100) not -56)
    for dtype, low, high in ((torch.uint8, 0, 255), (torch.int8, -128, 127),
                             (torch.int16, -2**15, 2**15 - 1), (torch.int32, -2**31, 2**31 - 1)):
        values, edges = [low, high, 0], graphs.complete_graph(3)
        offsets = pe.relative_offsets(torch.tensor(values, dtype=dtype), edges)
        want = [values[i] - values[j] for j, i in edges.t().tolist()]  # p_i - p_j of j -> i
        assert offsets[:, 0].tolist() == want, dtype


def test_offset_bias_is_swins_relative_position_bias():
    # Swin's index for a window of M x M pixels (Liu et al., 2021, its reference code):
    # relative coords shifted by M - 1, rows times 2M - 1, plus columns
    M, H = 4, 3
    coords = torch.stack(torch.meshgrid(torch.arange(M), torch.arange(M), indexing="ij"))
    coords = coords.flatten(1)  # (2, M^2)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0)  # (M^2, M^2, 2)
    swin_index = (rel[..., 0] + M - 1) * (2 * M - 1) + (rel[..., 1] + M - 1)
    spatial = pe.OffsetBias(H, radius=M - 1)
    assert spatial.weight.shape == ((2 * M - 1) ** 2 + 1, H)
    with torch.no_grad():
        spatial.weight.normal_(generator=torch.Generator().manual_seed(0))
    window = graphs.complete_graph(M * M)  # window attention: every pixel pair of it
    got = spatial(pe.relative_offsets(pe.grid_positions(M, M), window))  # (E, H)
    assert torch.equal(got, spatial.weight[swin_index[window[1], window[0]]])
    # farther than the radius: the shared last row; one dimension: T5's exact buckets
    assert torch.equal(spatial(torch.tensor([[M, 0], [0, -M - 3]])),
                       spatial.weight[[-1, -1]])
    t5 = pe.OffsetBias(2, radius=3, dims=1)
    with torch.no_grad():
        t5.weight.copy_(torch.arange(16.0).view(8, 2))
    assert torch.equal(t5(torch.tensor([[-3], [0], [2], [4], [-9]])),
                       t5.weight[[0, 3, 5, 7, 7]])
    # int8's -128, whose abs wraps to -128 in int8: the far row too
    assert torch.equal(t5(torch.tensor([[-128], [127], [-3]], dtype=torch.int8)),
                       t5.weight[[7, 7, 0]])
    assert repr(t5) == "OffsetBias(heads=2, radius=3, dims=1)"


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_offset_bias_on_the_grid_graph_equals_the_dense_layer(backend):
    # neighbourhood attention over a 5 x 6 image with a learned bias per (rows, columns)
    # offset: the edge route and the dense one, with the grid's mask and an (H, N, N) bias
    h, w, R, H = 5, 6, 2, 2
    edges = graphs.grid_graph(h, w, radius=R)
    positions = pe.grid_positions(h, w)
    graph, dense = layer_pair(H)
    graph.backend = backend
    spatial = pe.OffsetBias(H, radius=R)
    with torch.no_grad():
        spatial.weight.normal_(generator=torch.Generator().manual_seed(1))
    every = positions.unsqueeze(1) - positions.unsqueeze(0)  # (N, N, 2): p_i - p_j
    x = torch.randn(h * w, 8, generator=torch.Generator().manual_seed(2))
    mask = graphs.to_dense_mask(edges, h * w)
    got = run(graph, spatial, lambda x: graph(
        x, edges, attn_bias=spatial(pe.relative_offsets(positions, edges))), x)
    want = run(dense, spatial, lambda x: dense(
        x, mask, attn_bias=spatial(every).movedim(-1, 0)), x)
    for a, b in zip(got[:2], want[:2], strict=True):
        assert_close(a, b)
    for name in want[2]:
        assert_close(got[2][name], want[2][name], msg=name)
    assert got[2]["pe.weight"][-1].abs().sum() == 0  # no edge is farther than the radius


@pytest.mark.parametrize("call, error, match", [
    (lambda: pe.relative_offsets(torch.zeros(4, 2), graphs.chain_graph(4)), ValueError,
     r"positions must be an integer \[N, d\] or \[N\] tensor, got torch.float32 \[4, 2\]"),
    (lambda: pe.relative_offsets(torch.zeros(4, 1, 1, dtype=torch.long), graphs.chain_graph(4)),
     ValueError, r"positions must be an integer \[N, d\] or \[N\] tensor, got torch.int64 "
                 r"\[4, 1, 1\]"),
    (lambda: pe.relative_offsets(torch.zeros(3, 2, dtype=torch.long), graphs.chain_graph(4)),
     ValueError, "3"),
    (lambda: pe.grid_positions(-1, 3), ValueError, "height must be a non-negative integer"),
    (lambda: pe.OffsetBias(2, -1), ValueError, "radius must be a non-negative integer"),
    (lambda: pe.OffsetBias(2, 1, dims=0), ValueError, "dims must be a positive integer"),
    (lambda: pe.OffsetBias(2, 1)(torch.zeros(3, 2)), TypeError, "offset must be an integer"),
    (lambda: pe.OffsetBias(2, 1)(torch.zeros(3, 3, dtype=torch.long)), ValueError,
     r"offset must have shape \[..., d\] = \[..., 2\], got \[3, 3\]"),
])
def test_offset_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# T5's relative position buckets and bias. Hugging Face's T5Attention is the reference: its
# bucket function takes the key's position minus the query's, the negative of pe's offset.
# The last two are where a float64 logarithm would give other buckets than T5's float32 one.
T5_BUCKETS = [(True, 32, 128), (False, 32, 128), (True, 8, 20), (False, 8, 20), (True, 4, 3),
              (False, 2, 2), (True, 33, 9), (False, 16, 1000), (True, 6, 5), (True, 18, 128),
              (False, 10, 160)]


def t5_attention():
    """Hugging Face's T5Attention class, or a skip naming why there is none."""
    module = pytest.importorskip(
        "transformers.models.t5.modeling_t5",
        reason="the T5 comparisons need Hugging Face transformers (the test extra has it)")
    return module.T5Attention


@pytest.mark.parametrize("bidirectional, num_buckets, max_distance", T5_BUCKETS)
def test_relative_position_bucket_is_t5s(bidirectional, num_buckets, max_distance):
    T5Attention = t5_attention()
    offset = torch.arange(-3000, 3001)
    got = pe.relative_position_bucket(offset, bidirectional=bidirectional,
                                      num_buckets=num_buckets, max_distance=max_distance)
    want = T5Attention._relative_position_bucket(-offset, bidirectional=bidirectional,
                                                 num_buckets=num_buckets,
                                                 max_distance=max_distance)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)
    int32 = pe.relative_position_bucket(offset.int(), bidirectional=bidirectional,
                                        num_buckets=num_buckets, max_distance=max_distance)
    assert torch.equal(int32, want)


@pytest.mark.parametrize("bidirectional, num_buckets, max_distance", T5_BUCKETS)
def test_relative_position_bucket_shape(bidirectional, num_buckets, max_distance):
    # what the buckets must be whatever their reference: exact near 0, then never decreasing
    # in |i - j| (T5's last bucket can come before max_distance, and close to the exact ones
    # buckets can be skipped), the last bucket of a sign from max_distance on, signs apart
    side = num_buckets // 2 if bidirectional else num_buckets
    exact = side // 2
    n = torch.arange(0, 4 * max_distance + 10)
    for sign in (1, -1) if bidirectional else (1,):
        bucket = pe.relative_position_bucket(sign * n, bidirectional=bidirectional,
                                             num_buckets=num_buckets,
                                             max_distance=max_distance)
        first = side if sign == -1 else 0
        assert int(bucket[0]) == 0  # offset 0 is the query itself, a key at or before it
        assert torch.equal(bucket[1:exact], first + n[1:exact])
        assert (bucket[1:].diff() >= 0).all()
        assert (bucket[max_distance:] == first + side - 1).all()
        assert int(bucket[exact]) == first + exact  # the first log-spaced bucket
    if not bidirectional:  # keys after the query count as offset 0
        assert (pe.relative_position_bucket(-n, bidirectional=False, num_buckets=num_buckets,
                                            max_distance=max_distance) == 0).all()
    scalar = pe.relative_position_bucket(torch.tensor(-1), bidirectional=bidirectional,
                                         num_buckets=num_buckets, max_distance=max_distance)
    assert scalar.shape == () and int(scalar) == (side + 1 if bidirectional else 0)


def t5_pair(heads: int, channels: int, decoder: bool, num_buckets: int, max_distance: int):
    """Hugging Face's T5 self-attention and GraphSelfAttention with its weights, in float64.
    T5 does not scale its scores: the queries take the factor sqrt(C) that the layer's
    1/sqrt(C) takes back."""
    T5Attention = t5_attention()
    from transformers import T5Config

    config = T5Config(d_model=heads * channels, d_kv=channels, num_heads=heads,
                      relative_attention_num_buckets=num_buckets,
                      relative_attention_max_distance=max_distance, dropout_rate=0.0,
                      is_decoder=decoder)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    t5 = T5Attention(config, has_relative_attention_bias=True, layer_idx=0).double()
    torch.nn.init.normal_(t5.relative_attention_bias.weight)
    layer = GraphSelfAttention(heads * channels, channels, heads, bias=False,
                               add_self_loops=False).double()
    bias = pe.RelativePositionBias(heads, num_buckets, max_distance,
                                   bidirectional=not decoder).double()
    with torch.no_grad():
        layer.lin_q.weight.copy_(t5.q.weight * math.sqrt(channels))
        layer.lin_k.weight.copy_(t5.k.weight)
        layer.lin_v.weight.copy_(t5.v.weight)
        layer.lin_out.weight.copy_(t5.o.weight)
        bias.weight.copy_(t5.relative_attention_bias.weight)
    return t5, layer, bias


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_t5_attention_is_graph_attention(backend, decoder):
    # T5's encoder self-attention is the complete graph with RelativePositionBias, its
    # decoder's the causal graph with the one-sided buckets; L = 40 reaches the log-spaced
    # buckets and beyond max_distance = 20
    H, C, L = 4, 4, 40
    t5, layer, bias = t5_pair(H, C, decoder, num_buckets=8, max_distance=20)
    layer.backend = backend
    x = torch.randn(1, L, H * C, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mask = (torch.full((L, L), float("-inf"), dtype=torch.float64).triu(1)[None, None]
            if decoder else None)  # T5 adds its causal mask to the bias
    edges = graphs.causal_graph(L) if decoder else graphs.complete_graph(L)
    w = torch.randn(L, H * C, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    x_t5 = x.clone().requires_grad_(True)
    (t5(x_t5, mask=mask)[0][0] * w).sum().backward()
    x_graph = x[0].clone().requires_grad_(True)
    out = layer(x_graph, edges, attn_bias=bias(edges[1] - edges[0]))
    (out * w).sum().backward()

    assert_close(out.detach(), t5(x, mask=mask)[0][0].detach())
    assert_close(x_graph.grad, x_t5.grad[0])
    assert_close(bias.weight.grad, t5.relative_attention_bias.weight.grad)
    assert_close(layer.lin_k.weight.grad, t5.k.weight.grad)
    assert_close(layer.lin_q.weight.grad * math.sqrt(C), t5.q.weight.grad)
    used = t5.relative_attention_bias.weight.grad.abs().sum(dim=1) > 0
    # every bucket is reached, but the encoder's bucket 4, which would be offset -0
    assert int(used.sum()) == (8 if decoder else 7)


def test_t5_bias_on_the_dense_layer():
    # the same bias as DenseSelfAttention's [H, L, L] attn_bias, with an offset matrix
    H, C, L = 2, 4, 24
    t5, layer, bias = t5_pair(H, C, False, num_buckets=8, max_distance=10)
    dense = DenseSelfAttention(H * C, C, H, bias=False).double()
    dense.load_state_dict(layer.state_dict())
    x = torch.randn(L, H * C, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    position = torch.arange(L)
    offset = position[:, None] - position[None, :]  # (L, L): row = query i, column = key j
    got = dense(x, attn_bias=bias(offset).movedim(-1, 0))
    assert_close(got, t5(x[None])[0][0].detach())


def test_distance_bias_with_log_buckets():
    # DistanceBias(num_buckets=B) buckets hop distances as T5's decoder buckets i - j, with a
    # last row of its own for pairs that no path joins
    spatial = pe.DistanceBias(2, 20, num_buckets=8)
    assert spatial.weight.shape == (9, 2) and not spatial.weight.any()
    with torch.no_grad():
        spatial.weight.normal_(generator=torch.Generator().manual_seed(0))
    distance = torch.tensor([[0, 1, 3, 4], [7, 19, 20, 500], [-1, 2, -1, 0]])
    t5 = pe.relative_position_bucket(distance.clamp(min=0), bidirectional=False,
                                     num_buckets=8, max_distance=20)
    bucket = torch.where(distance < 0, 8, t5)
    assert torch.equal(spatial(distance), spatial.weight[bucket])
    assert bucket[0].tolist() == [0, 1, 3, 4] and bucket[1, 2:].tolist() == [7, 7]
    assert repr(spatial) == "DistanceBias(heads=2, max_distance=20, num_buckets=8)"

    # on the causal graph with chain distances: RelativePositionBias(bidirectional=False)
    L = 50
    edges = graphs.causal_graph(L)
    decoder = pe.RelativePositionBias(2, 8, 20, bidirectional=False)
    with torch.no_grad():
        decoder.weight.copy_(spatial.weight[:8])
    distance = pe.hop_distance(graphs.chain_graph(L), L, edges)
    assert torch.equal(spatial(distance), decoder(edges[1] - edges[0]))


def test_relative_position_bias_module():
    t5 = pe.RelativePositionBias(3)
    assert t5.weight.shape == (32, 3) and not t5.weight.any()
    assert repr(t5) == ("RelativePositionBias(heads=3, num_buckets=32, max_distance=128, "
                        "bidirectional=True)")
    with torch.no_grad():
        t5.weight.copy_(torch.arange(96.0).view(32, 3))
    offset = torch.tensor([[0, 5, -5], [200, -200, 17]])
    bucket = pe.relative_position_bucket(offset)
    assert torch.equal(t5(offset), t5.weight[bucket])
    assert t5(offset).shape == (2, 3, 3)
    t5.reset_parameters()
    assert not t5.weight.any()


@pytest.mark.parametrize("call, error, match", [
    (lambda: pe.relative_position_bucket(torch.zeros(3)), TypeError,
     "offset must be an integer tensor, got torch.float32"),
    (lambda: pe.relative_position_bucket(torch.zeros(3, dtype=torch.long), num_buckets=3),
     ValueError, r"num_buckets must be at least 4 \(bidirectional=True\).*got 3"),
    (lambda: pe.relative_position_bucket(torch.zeros(3, dtype=torch.long), bidirectional=False,
                                         num_buckets=1),
     ValueError, r"num_buckets must be at least 2 \(bidirectional=False\).*got 1"),
    (lambda: pe.relative_position_bucket(torch.zeros(3, dtype=torch.long), max_distance=8),
     ValueError, "max_distance must exceed the 8 exact offsets of num_buckets=32.*got 8"),
    (lambda: pe.relative_position_bucket(torch.zeros(3, dtype=torch.long), num_buckets=0),
     ValueError, "num_buckets must be a positive integer, got 0"),
    (lambda: pe.relative_position_bucket(torch.zeros(3, dtype=torch.long), bidirectional=1),
     TypeError, "bidirectional must be a bool"),
    (lambda: pe.RelativePositionBias(0), ValueError, "heads must be a positive integer, got 0"),
    (lambda: pe.RelativePositionBias(2, max_distance=0), ValueError,
     "max_distance must be a positive integer, got 0"),
    (lambda: pe.DistanceBias(2, 3, num_buckets=8), ValueError,
     r"max_distance must exceed the 4 exact offsets of num_buckets=8 \(bidirectional=False\)"),
    (lambda: pe.DistanceBias(2, 30, num_buckets=8)(torch.tensor([-2])), ValueError,
     "got -2"),
])
def test_t5_bias_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def molecules() -> list:
    """Small graphs as a dataset holds them: trees, a ring, a graph without edges, one node."""
    from torch_geometric.data import Data

    shapes = [graphs.from_networkx(nx.random_labeled_tree(7, seed=1)),
              graphs.from_networkx(nx.cycle_graph(6)),
              torch.empty(2, 0, dtype=torch.long), graphs.chain_graph(1),
              graphs.from_networkx(nx.barabasi_albert_graph(9, 2, seed=2))]
    sizes = [7, 6, 4, 1, 9]
    return [Data(x=torch.randn(n, 8, generator=torch.Generator().manual_seed(n)),
                 edge_index=ei, num_nodes=n) for ei, n in zip(shapes, sizes, strict=True)]


@pytest.mark.parametrize("self_loops", [True, False])
@pytest.mark.parametrize("max_distance", [None, 2])
def test_add_hop_distance_batches_as_batch_complete_graph(max_distance, self_loops):
    from torch_geometric.data import Batch

    transform = pe.AddHopDistance(max_distance, self_loops=self_loops)
    data = [transform(d) for d in molecules()]
    for d in data:  # each graph alone: its complete graph and the distances networkx finds
        n = d.num_nodes
        assert torch.equal(d.pair_index, graphs.complete_graph(n, self_loops=self_loops))
        dist = networkx_distances(d.edge_index, n, directed=False)
        if max_distance is not None:
            dist = torch.where(dist > max_distance, -1, dist)
        src, dst = d.pair_index
        assert torch.equal(d.pair_distance, dist[dst, src])
    batch = Batch.from_data_list(data)
    pairs = graphs.batch_complete_graph(batch.batch, self_loops=self_loops)
    assert torch.equal(batch.pair_index, pairs)
    assert torch.equal(batch.pair_distance,
                       pe.hop_distance(batch.edge_index, batch.num_nodes, pairs,
                                       max_distance=max_distance))
    # the transform of a batch is the batch of the transformed graphs
    again = transform(Batch.from_data_list(molecules()))
    assert torch.equal(again.pair_index, batch.pair_index)
    assert torch.equal(again.pair_distance, batch.pair_distance)


@pytest.mark.parametrize("self_loops", [True, False])
def test_add_hop_distance_within_k_hops_batches_as_each_graph(self_loops):
    # pairs="within": each graph's hop_pairs; batched, the same pairs offset graph by graph,
    # and the transform of the batch gives them too
    from torch_geometric.data import Batch

    transform = pe.AddHopDistance(2, pairs="within", self_loops=self_loops)
    data = [transform(d) for d in molecules()]
    for d in data:
        want = pe.hop_pairs(d.edge_index, d.num_nodes, 2, self_loops=self_loops)
        assert torch.equal(d.pair_index, want[0]) and torch.equal(d.pair_distance, want[1])
    batch = Batch.from_data_list(data)
    offsets = batch.ptr[:-1].repeat_interleave(torch.tensor([d.pair_index.size(1)
                                                             for d in data]))
    assert torch.equal(batch.pair_index, torch.cat([d.pair_index for d in data], 1) + offsets)
    again = transform(Batch.from_data_list(molecules()))
    assert torch.equal(again.pair_index, batch.pair_index)
    assert torch.equal(again.pair_distance, batch.pair_distance)
    assert (batch.pair_distance <= 2).all() and (batch.pair_distance >= 0).all()


def test_add_hop_distance_feeds_graphormer_over_a_loader():
    # a mini-batch's attention with the stored pairs and distances equals each graph's own
    from torch_geometric.loader import DataLoader

    data = [pe.AddHopDistance(directed=True)(d) for d in molecules()]
    torch.manual_seed(0)
    layer = GraphSelfAttention(8, 4, heads=2, add_self_loops=False)
    spatial = pe.DistanceBias(2, 3)
    with torch.no_grad():
        spatial.weight.normal_(generator=torch.Generator().manual_seed(3))
    alone = torch.cat([layer(d.x, d.pair_index, attn_bias=spatial(d.pair_distance))
                       for d in data])
    together = torch.cat([layer(b.x, b.pair_index, attn_bias=spatial(b.pair_distance))
                          for b in DataLoader(data, batch_size=2)])
    assert_close(together, alone)


def test_add_hop_distance_names_and_repr():
    transform = pe.AddHopDistance(3, directed=True, self_loops=False, index_name="attn_index",
                                  attr_name="attn_hops")
    assert repr(transform) == ("AddHopDistance(max_distance=3, directed=True, "
                               "self_loops=False, index_name='attn_index', "
                               "attr_name='attn_hops')")
    assert repr(pe.AddHopDistance()) == "AddHopDistance()"
    assert repr(pe.AddHopDistance(2, pairs="within")) == ("AddHopDistance(max_distance=2, "
                                                          "pairs='within')")
    d = transform(molecules()[1])
    assert d.attn_index.shape == (2, 30) and d.attn_hops.shape == (30,)
    assert "pair_index" not in d


@pytest.mark.parametrize("call, error, match", [
    (lambda: pe.AddHopDistance(-1), ValueError,
     "max_distance must be a non-negative integer, got -1"),
    (lambda: pe.AddHopDistance(index_name="pairs"), ValueError,
     "index_name must be a str that contains 'index'.*got 'pairs'"),
    (lambda: pe.AddHopDistance(attr_name="pair_index_distance"), ValueError,
     "attr_name must be a str without 'index' or 'batch'.*got 'pair_index_distance'"),
    (lambda: pe.AddHopDistance(attr_name="batch_distance"), ValueError, "'batch_distance'"),
    (lambda: pe.AddHopDistance(self_loops=None), TypeError, "self_loops must be a bool"),
    (lambda: pe.AddHopDistance(2, pairs="k-hop"), ValueError,
     "pairs must be 'complete' or 'within', got 'k-hop'"),
    (lambda: pe.AddHopDistance(pairs="within"), ValueError, "give max_distance=<hops>"),
    (lambda: pe.AddHopDistance()(graphs.chain_graph(3)), TypeError,
     "AddHopDistance takes a homogeneous torch_geometric.data.Data, got Tensor"),
])
def test_add_hop_distance_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


BIAS_TABLES = {
    "distance": (lambda: pe.DistanceBias(3, 4), lambda g: torch.randint(-1, 9, (6, 50),
                                                                        generator=g)),
    "distance-log": (lambda: pe.DistanceBias(3, 20, num_buckets=8),
                     lambda g: torch.randint(-1, 60, (300,), generator=g)),
    "t5": (lambda: pe.RelativePositionBias(3, 16, 40),
           lambda g: torch.randint(-90, 90, (5, 7, 11), generator=g)),
    "offset": (lambda: pe.OffsetBias(3, 2), lambda g: torch.randint(-4, 5, (200, 2),
                                                                    generator=g)),
    "empty": (lambda: pe.RelativePositionBias(3, 8, 10),
              lambda g: torch.zeros(0, dtype=torch.long)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", list(BIAS_TABLES))
def test_bias_tables_backward_equals_indexings(name, dtype):
    # on CPU the tables sum their gradient by bincount (pe._TableRows); under torch.func the
    # lookup is plain indexing, whose gradient torch computes: the two must agree
    make, draw = BIAS_TABLES[name]
    module = make().to(dtype)
    with torch.no_grad():
        module.weight.normal_(generator=torch.Generator().manual_seed(0))
    index = draw(torch.Generator().manual_seed(1))
    out = module(index)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    out.backward(grad)
    assert out.grad_fn is not None and "TableRows" in type(out.grad_fn).__name__

    def plain(weight):
        return torch.func.functional_call(module, {"weight": weight}, (index,))

    want_out, vjp = torch.func.vjp(plain, module.weight.detach().double())
    (want,) = vjp(grad.double())
    assert torch.equal(out.detach(), want_out.to(dtype))
    assert_close(module.weight.grad, want, dtype=dtype)
    assert module.weight.grad.dtype == dtype
    if index.numel():
        assert module.weight.grad.abs().sum() > 0
    else:
        assert not module.weight.grad.any()


@pytest.mark.parametrize("name", ["distance", "t5", "offset"])
def test_bias_tables_differentiate_twice(name):
    """The fast backward was once differentiable: a Hessian of the table came out all zeros
    (torch.autograd.functional.hessian) and a meta-learning step's outer backward failed. With
    create_graph=True the backward is differentiable, and equals plain indexing's."""
    make, draw = BIAS_TABLES[name]
    module = make().double()
    with torch.no_grad():
        module.weight.normal_(generator=torch.Generator().manual_seed(0))
    index = draw(torch.Generator().manual_seed(1))

    def loss(weight):  # under torch.func the plain lookup, whose second derivative torch takes
        return torch.func.functional_call(module, {"weight": weight}, (index,)).pow(3).sum()

    weight = module.weight.detach().clone().requires_grad_()
    out = torch.func.functional_call(module, {"weight": weight}, (index,))
    assert "TableRows" in type(out.grad_fn).__name__
    (grad,) = torch.autograd.grad(out.pow(3).sum(), weight, create_graph=True)
    direction = torch.randn(weight.shape, generator=torch.Generator().manual_seed(2),
                            dtype=weight.dtype)
    (hvp,) = torch.autograd.grad((grad * direction).sum(), weight)
    want = torch.func.jvp(torch.func.grad(loss), (weight.detach(),), (direction,))[1]
    assert hvp.abs().sum() > 0
    assert_close(hvp, want)


def test_bias_tables_under_torch_compile():
    # compiled, the tables index plainly (no host-side bincount in the graph): same values
    spatial = pe.DistanceBias(2, 20, num_buckets=8)
    with torch.no_grad():
        spatial.weight.normal_(generator=torch.Generator().manual_seed(0))
    distance = torch.randint(-1, 40, (64,), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(spatial, fullgraph=True, backend="eager")
    out = compiled(distance)
    out.sum().backward()
    got = spatial.weight.grad.clone()
    spatial.weight.grad = None
    spatial(distance).sum().backward()
    assert torch.equal(out, spatial(distance))
    assert_close(got, spatial.weight.grad)


def test_bias_table_backward_in_chunks_on_two_threads(two_threads):
    # enough lookups for a chunk per thread, each summing into its own table: the sums of
    # both chunks, of a gradient that comes strided, equal the indexing's (in float64)
    table = pe.DistanceBias(3, 6)
    g = torch.Generator().manual_seed(0)
    distance = torch.randint(-1, 10, (150_001,), generator=g)
    out = table(distance)
    grad = torch.randn(3, distance.numel(), generator=g, dtype=torch.float64).t()
    out.backward(grad.float())
    want = torch.zeros(8, 3, dtype=torch.float64).index_add_(
        0, torch.where((distance < 0) | (distance > 6), 7, distance), grad.float().double())
    assert_close(table.weight.grad, want, dtype=torch.float32)
    assert (want[0] != want[-1]).all()


@pytest.mark.parametrize("max_distance", [0, 1, 2, 3, 50])
@pytest.mark.parametrize("directed", [False, True])
@pytest.mark.parametrize("name", list(NX_GRAPHS))
def test_hop_pairs_are_networkxs_pairs_within_k_hops(name, directed, max_distance):
    edge_index, n = NX_GRAPHS[name]()
    pairs, distance = pe.hop_pairs(edge_index, n, max_distance, directed=directed)
    full = networkx_distances(edge_index, n, directed)  # [i, j]: d(j -> i), -1 if none
    target, source = ((full >= 0) & (full <= max_distance)).nonzero(as_tuple=True)  # row-major
    assert torch.equal(pairs, torch.stack([source, target]))  # by target, then source
    assert torch.equal(distance, full[target, source])
    assert pairs.dtype == distance.dtype == torch.int64
    without, dist_without = pe.hop_pairs(edge_index, n, max_distance, directed=directed,
                                         self_loops=False)
    loops = pairs[0] == pairs[1]
    assert torch.equal(without, pairs[:, ~loops]) and torch.equal(dist_without,
                                                                   distance[~loops])
    assert int(loops.sum()) == n and (distance[loops] == 0).all()


@pytest.mark.parametrize("case", SQUARE_GRAPHS, ids=[g.name for g in SQUARE_GRAPHS])
def test_hop_pairs_distances_are_hop_distances(case):
    # on the registry (multi-edges, self-loops, isolated nodes): the pairs' distances are
    # hop_distance's, and the pairs are all those hop_distance puts within k
    edge_index, n = case.edge_index, case.num_dst
    for k in (1, 2):
        pairs, distance = pe.hop_pairs(edge_index, n, k)
        assert torch.equal(distance, pe.hop_distance(edge_index, n, pairs))
        full = pe.hop_distance(edge_index, n)
        assert pairs.size(1) == int(((full >= 0) & (full <= k)).sum())


def test_hop_pairs_closed_forms():
    # a chain's k hops are the window of radius k; on the 3x3 grid graph (each pixel's 8
    # neighbours and itself) 2 hops are the 5x5 grid graph, at Chebyshev distance
    pairs, distance = pe.hop_pairs(graphs.chain_graph(12), 12, 3)
    assert torch.equal(pairs, graphs.window_graph(12, 3))
    assert torch.equal(distance, (pairs[1] - pairs[0]).abs())
    pairs, distance = pe.hop_pairs(graphs.grid_graph(6, 6, radius=1), 36, 2)
    five = graphs.grid_graph(6, 6, radius=2)
    order = torch.argsort(five[1] * 36 + five[0])
    assert torch.equal(pairs, five[:, order])
    row, col = pairs // 6, pairs % 6
    assert torch.equal(distance, torch.maximum((row[0] - row[1]).abs(), (col[0] - col[1]).abs()))
    assert pe.hop_pairs(torch.empty(2, 0, dtype=torch.long), 0, 2)[0].shape == (2, 0)


@pytest.mark.parametrize("call, error, match", [
    (lambda: pe.hop_pairs(graphs.chain_graph(4), 4, -1), ValueError,
     "max_distance must be a non-negative integer, got -1"),
    (lambda: pe.hop_pairs(graphs.chain_graph(4), 3, 1), ValueError, "3"),
    (lambda: pe.hop_pairs(graphs.chain_graph(4), 4, 1, directed=1), TypeError,
     "directed must be a bool"),
])
def test_hop_pairs_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_distance_biases_and_learned_positions_run_under_vmap():
    """alibi_bias, DistanceBias and LearnablePE checked their inputs' range with .item(),
    which torch.func.vmap refuses: a batch of distances (positions) now maps, each row as
    the call on it alone."""
    gen = torch.Generator().manual_seed(0)
    distance = torch.randint(-1, 6, (3, 10), generator=gen)
    learned = pe.LearnablePE(12, 4)
    x = torch.randn(3, 10, 4, generator=gen)
    positions = torch.randint(0, 12, (3, 10), generator=gen)
    for f, args in ((lambda d: pe.alibi_bias(d, 2), (distance,)),
                    (pe.DistanceBias(2, 4), (distance,)),
                    (learned, (x, positions))):
        batched = torch.func.vmap(f)(*args)
        for i in range(3):
            assert torch.equal(batched[i], f(*(a[i] for a in args)))
