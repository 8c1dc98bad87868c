import math

import pytest
import torch
from conftest import GRAPHS, assert_close, attention_inputs, dense_mask, random_graph
from hypothesis import given, settings
from hypothesis import strategies as st

from graphattn import graphs
from graphattn.functional import cpu, dense_attention, dense_backend, edge_attention
from graphattn.functional.dense_backend import (
    dense_edge_attention,
    dense_peak_bytes,
    diagonal_blocks,
)


def inputs(case_dst, case_src, score, E, H=2, C=3, dtype=torch.float64, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    shape = (H, C) if score == "dot" else (H,)
    q = torch.randn(case_dst, *shape, generator=gen, dtype=dtype)
    k = torch.randn(case_src, *shape, generator=gen, dtype=dtype)
    v = torch.randn(case_src, H, C, generator=gen, dtype=dtype)
    b = torch.randn(E, H, generator=gen, dtype=dtype) if bias else None
    return q, k, v, b


def run(backend, q, k, v, edge_index, bias, *, score, dropout_p, need_alpha, seed=0):
    """Out, alpha and the gradients of every input under one loss that also uses alpha."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    b = None if bias is None else bias.detach().clone().requires_grad_()
    torch.manual_seed(seed)  # the same dropout mask for every backend
    result = edge_attention(*leaves, edge_index, bias=b, score=score, dropout_p=dropout_p,
                            return_attention=need_alpha, backend=backend, scale=0.7)
    out, alpha = result if need_alpha else (result, None)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    loss = (out * weights).sum() + (alpha.square().sum() if alpha is not None else 0.0)
    grads = torch.autograd.grad(loss, leaves + ([b] if b is not None else []))
    return out, alpha, grads


@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.4], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("score", ["dot", "additive"])
@pytest.mark.parametrize("case", GRAPHS, ids=[g.name for g in GRAPHS])
def test_equals_reference(case, score, with_bias, dropout_p, need_alpha):
    q, k, v, bias = inputs(case.num_dst, case.num_src, score, case.edge_index.size(1),
                           bias=with_bias)
    assert_dense_equals_reference(q, k, v, case.edge_index, bias, score=score,
                                  dropout_p=dropout_p, need_alpha=need_alpha)


def assert_dense_equals_reference(q, k, v, edge_index, bias, **kw):
    """out, alpha (when ``need_alpha``) and finite gradients of the dense backend match the
    reference; returns the dense out."""
    out, alpha, grads = run("dense", q, k, v, edge_index, bias, **kw)
    ref_out, ref_alpha, ref_grads = run("reference", q, k, v, edge_index, bias, **kw)
    assert_close(out, ref_out)
    if kw["need_alpha"]:
        assert_close(alpha, ref_alpha)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(g).all()
        assert_close(g, r)
    return out


@pytest.mark.parametrize("dropout_p", [0.0, 0.4], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("case", GRAPHS, ids=[g.name for g in GRAPHS])
def test_gatv2_with_a_scale_and_slope_of_its_own_equals_reference(case, dropout_p):
    """gatv2's per-edge scores (scale 0.7, slope 0.1, not the defaults 1 and 0.2): out, alpha
    and the gradients of q, k, v, bias and att match the reference."""
    inputs = attention_inputs(case.num_src, case.num_dst, case.edge_index.size(1), 2, 3,
                              score="gatv2", dtype=torch.float64)
    results = []
    for backend in ("dense", "reference"):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()
                  if t is not None}
        torch.manual_seed(0)  # the same dropout mask for both backends
        out, alpha = edge_attention(leaves["q"], leaves["k"], leaves["v"], case.edge_index,
                                    bias=leaves["bias"], att=leaves["att"], score="gatv2",
                                    scale=0.7, negative_slope=0.1, dropout_p=dropout_p,
                                    return_attention=True, backend=backend)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1),
                              dtype=out.dtype)
        loss = (out * weights).sum() + alpha.square().sum()
        results.append([out, alpha, *torch.autograd.grad(loss, list(leaves.values()))])
    for got, want in zip(*results, strict=True):
        assert torch.isfinite(got).all()
        assert_close(got, want)


def test_multi_edges_add_their_weights():
    # Target 0 has the edge 1 -> 0 three times with biases b1, b2, b3 and the edge 2 -> 0 once:
    # by hand, weight(1) = sum_e exp(s_10 + b_e), weight(2) = exp(s_20 + b_4).
    q = torch.tensor([[[1.0, 0.5]]]).repeat(3, 1, 1)  # (3, 1, 2)
    k = torch.tensor([[[0.0, 0.0]], [[1.0, -1.0]], [[0.5, 2.0]]])  # (3, 1, 2)
    v = torch.tensor([[[0.0]], [[1.0]], [[10.0]]])  # (3, 1, 1)
    edge_index = torch.tensor([[1, 1, 1, 2], [0, 0, 0, 0]])
    bias = torch.tensor([[0.1], [-0.3], [0.7], [0.2]])
    out, alpha = edge_attention(q, k, v, edge_index, bias=bias, scale=1.0, return_attention=True,
                                backend="dense")
    s1, s2 = (q[0, 0] @ k[1, 0]).item(), (q[0, 0] @ k[2, 0]).item()
    w = [math.exp(s1 + b) for b in (0.1, -0.3, 0.7)] + [math.exp(s2 + 0.2)]
    total = sum(w)
    assert_close(alpha[:, 0], torch.tensor(w) / total)
    assert_close(out[0, 0, 0], torch.tensor((sum(w[:3]) * 1.0 + w[3] * 10.0) / total))
    assert (out[1:] == 0).all()  # targets 1 and 2 have no in-edge


@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
@pytest.mark.parametrize("score", ["dot", "additive"])
def test_scores_of_minus_infinity_give_zero_not_nan(score, need_alpha):
    # target 1: a simple pair and a double edge, all -inf; target 2: one -inf edge of two
    edge_index = torch.tensor([[0, 3, 3, 0, 1], [1, 1, 1, 2, 2]])
    q, k, v, bias = inputs(4, 4, score, 5)
    bias[:4, 0] = float("-inf")  # head 0: every in-edge of target 1 is masked
    bias[:3, 1] = float("-inf")  # head 1 as well
    out = assert_dense_equals_reference(q, k, v, edge_index, bias, score=score, dropout_p=0.0,
                                        need_alpha=need_alpha)
    assert (out[1] == 0).all()


@pytest.mark.parametrize("edge", [2, 1], ids=["single-edge-pair", "double-edge-pair"])
@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
@pytest.mark.parametrize("score", ["dot", "additive"])
def test_nan_score_on_a_multigraph_makes_its_target_nan_as_the_reference(score, need_alpha,
                                                                          edge):
    # target 0 has in-edges from 0, 1, 2 and 1 again (a double edge): the multigraph path. A
    # NaN score there once made its pair -inf (masked) instead of making the target's row NaN.
    edge_index = torch.tensor([[0, 1, 2, 0, 3, 1], [0, 0, 0, 1, 2, 0]])
    q, k, v, bias = inputs(4, 4, score, 6)
    bias[edge, 0] = float("nan")
    results = {}
    for backend in ("reference", "dense"):
        result = edge_attention(q, k, v, edge_index, bias=bias, score=score,
                                return_attention=need_alpha, backend=backend)
        results[backend] = result if need_alpha else (result,)
    for got, want in zip(results["dense"], results["reference"], strict=True):
        assert torch.equal(got.isnan(), want.isnan())
        assert_close(got.nan_to_num(), want.nan_to_num())
    assert results["dense"][0][0, 0].isnan().all() and not results["dense"][0][1:].isnan().any()


def test_sdpa_path_equals_dense_attention_fp32():
    n_dst, n_src = 70, 50
    edge_index = torch.unique(random_graph(n_src, 900, seed=4, num_dst=n_dst), dim=1)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n_dst, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(n_src, 4, 8, generator=gen, requires_grad=True) for _ in range(2))
    out = edge_attention(q, k, v, edge_index, backend="dense")
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = dense_attention(q, k, v, dense_mask(edge_index, n_dst, n_src))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    assert_close(out, ref)
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close(g, r)


def _edited_causal(n):
    """The causal graph with its edge 1 -> 2 replaced by 3 -> 2: as many edges, one above the
    diagonal."""
    edge_index = graphs.causal_graph(n).clone()
    edge_index[0, ((edge_index[0] == 1) & (edge_index[1] == 2)).nonzero()] = 3
    return edge_index


def _doubled_causal(n):
    """The causal graph with its edge 1 -> 2 replaced by a second 0 -> 2: as many edges, all on
    or below the diagonal, one pair missing."""
    edge_index = graphs.causal_graph(n).clone()
    edge_index[0, ((edge_index[0] == 1) & (edge_index[1] == 2)).nonzero()] = 0
    return edge_index


@pytest.mark.parametrize(("graph", "mask_dim", "is_causal"), [
    (lambda n: graphs.complete_graph(n), None, False),
    (lambda n: graphs.causal_graph(n), None, True),
    (_edited_causal, 2, False),
    (_doubled_causal, 4, False),
], ids=["complete", "causal", "causal-one-edge-moved", "causal-one-edge-doubled"])
def test_complete_and_causal_graphs_run_sdpa_without_a_mask(graph, mask_dim, is_causal,
                                                             sdpa_calls):
    """SDPA gets no mask on the complete graph and ``is_causal`` on the causal graph (both run
    faster than with the mask); graphs with as many edges that are neither keep the mask. Every
    case equals the reference, gradients included."""
    n = 9
    edge_index = graph(n)
    q, k, v, _ = inputs(n, n, "dot", edge_index.size(1), bias=False)
    assert_dense_equals_reference(q, k, v, edge_index, None, score="dot", dropout_p=0.0,
                                  need_alpha=False)
    assert sdpa_calls and all(call[1:] == (mask_dim, is_causal) for call in sdpa_calls), \
        sdpa_calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_follows_the_fp32_result(dtype):
    n = 40
    edge_index = random_graph(n, 300, seed=2)  # with multi-edges
    q, k, v, bias = (t.to(dtype) for t in inputs(n, n, "dot", 300, H=2, C=8))
    out = edge_attention(q, k, v, edge_index, bias=bias, backend="dense")
    ref = edge_attention(q.float(), k.float(), v.float(), edge_index, bias=bias.float(),
                         backend="reference")  # the same rounded inputs, computed in fp32
    assert out.dtype == dtype
    assert_close(out, ref, dtype=dtype)


def test_called_directly_takes_int32_indices():
    q, k, v, _ = inputs(5, 5, "dot", 0, dtype=torch.float32, bias=False)
    edge_index = torch.tensor([[0, 1, 2, 2], [1, 1, 3, 3]], dtype=torch.int32)
    out, alpha = dense_edge_attention(q, k, v, edge_index, scale=0.5, bias=None,
                                      dropout_mask=None, score="dot", negative_slope=0.2,
                                      need_alpha=True)
    ref, ref_alpha = edge_attention(q, k, v, edge_index.long(), scale=0.5,
                                    return_attention=True, backend="reference")
    assert_close(out, ref)
    assert_close(alpha, ref_alpha)


def test_peak_bytes_grow_with_heads_and_pairs():
    assert dense_peak_bytes(3, 5, 2) == 6 * 2 * 15 * 4 + 2 * 15
    assert dense_peak_bytes(3, 5, 4, itemsize=2) == dense_peak_bytes(3, 5, 2)
    assert dense_peak_bytes(100, 100, 8) == 100 * dense_peak_bytes(10, 10, 8)


@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
def test_target_without_in_edge_is_zero_whatever_the_values(need_alpha):
    """A target without an in-edge gets exactly 0 even when a value row is NaN or inf (the
    dense product would give 0 * NaN there), as on the sparse backends."""
    edge_index = torch.tensor([[0, 1, 2, 3, 0, 1], [0, 0, 1, 1, 2, 3]])  # node 4: no edges
    q, k, v, _ = inputs(5, 5, "dot", 6, bias=False)
    v[4, 0, 0], v[3, 1, 2] = float("nan"), float("inf")
    result = edge_attention(q, k, v, edge_index, backend="dense", return_attention=need_alpha)
    out = result[0] if need_alpha else result
    assert (out[4] == 0).all()


@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("score", ["dot", "additive"])
@pytest.mark.parametrize("repeated", [False, True], ids=["simple", "multi-edge"])
def test_sources_without_out_edges_reach_no_output_whatever_their_values(repeated, score,
                                                                         with_bias, need_alpha):
    """Padding: nodes 4 and 5 have no edges and hold NaN and inf. The dense product weighs
    their value rows by 0 for every target (0 * NaN is NaN); they must reach no output and no
    gradient, as in the reference: through SDPA with a bool mask (simple graph, dot, no
    bias), with a float mask (multi-edges or bias) and with explicit weights."""
    edges = [[0, 1, 2, 3, 0, 1, 3], [0, 0, 1, 1, 2, 3, 3]]
    if repeated:
        edges = [edges[0] + [1], edges[1] + [3]]
    edge_index = torch.tensor(edges)
    q, k, v, bias = inputs(6, 6, score, edge_index.size(1), bias=with_bias)
    v[4], v[5, 1, 2] = float("nan"), float("inf")
    expected = run("reference", q, k, v, edge_index, bias, score=score, dropout_p=0.0,
                   need_alpha=need_alpha)
    got = run("dense", q, k, v, edge_index, bias, score=score, dropout_p=0.0,
              need_alpha=need_alpha)
    assert got[0].isfinite().all()
    assert_close(got[0], expected[0])
    if need_alpha:
        assert_close(got[1], expected[1])
    for g, e in zip(got[2], expected[2], strict=True):
        assert g.isfinite().all()
        assert_close(g, e)


@pytest.mark.parametrize("dtype,scale", [(torch.float16, 1.0), (torch.float32, 1e36)])
@pytest.mark.parametrize("edges", [[[1], [0]], [[1, 1], [0, 0]]], ids=["bias", "multi-edge"])
def test_product_overflowing_off_the_graph_is_masked_not_nan(dtype, scale, edges):
    """The explicit path with a bias or multi-edges: a pair without an edge whose q . k
    overflows to +inf must not turn its target NaN (+inf + log 0 = NaN before the mask)."""
    q = torch.tensor([[[100.0]], [[1.0]]], dtype=dtype)
    k = torch.tensor([[[1000.0]], [[1.0]]], dtype=dtype)  # pair 0 -> 0: 1e5 > fp16 max, no edge
    v = torch.tensor([[[5.0]], [[7.0]]], dtype=dtype)
    edge_index = torch.tensor(edges)
    bias = torch.zeros(edge_index.size(1), 1, dtype=dtype)
    for b in (bias, None):
        out, alpha = edge_attention(q, k, v, edge_index, bias=b, scale=scale, backend="dense",
                                    return_attention=True)
        ref, ref_alpha = edge_attention(q, k, v, edge_index, bias=b, scale=scale,
                                        backend="reference", return_attention=True)
        assert_close(out, ref, dtype=dtype)
        assert_close(alpha, ref_alpha, dtype=dtype)


@pytest.mark.parametrize("score", ["dot", "additive"])
def test_simple_graph_with_every_in_edge_at_minus_infinity_has_zero_weights(score):
    """Target 1's two in-edges (no pair doubled) score -inf in head 0: their weights are 0,
    as the reference's, not the uniform softmax of the row the dense path computes there."""
    edge_index = torch.tensor([[0, 2, 1, 3], [1, 1, 2, 2]])
    q, k, v, bias = inputs(4, 4, score, 4)
    bias[:2, 0] = float("-inf")
    out = assert_dense_equals_reference(q, k, v, edge_index, bias, score=score, dropout_p=0.0,
                                        need_alpha=True)
    assert (out[1, 0] == 0).all()
    alpha = edge_attention(q, k, v, edge_index, bias=bias, score=score, return_attention=True,
                           backend="dense")[1]
    assert (alpha[:2, 0] == 0).all()


# ---- block-diagonal graphs: run block by block ----

def brute_force_block_starts(edge_index: torch.Tensor, n: int) -> list[int]:
    """The gaps between nodes p - 1 and p that no edge spans, found edge by edge."""
    cut = [True] * (n + 1)
    for a, b in edge_index.t().tolist():
        for p in range(min(a, b) + 1, max(a, b) + 1):
            cut[p] = False
    return [p for p in range(n + 1) if cut[p]]


def random_blocks(sizes: list[int], edges_per_block: int, seed: int) -> torch.Tensor:
    """Random edges (multi-edges and self-loops allowed) inside consecutive blocks of
    ``sizes`` nodes; a block of one node gets no edge."""
    gen = torch.Generator().manual_seed(seed)
    parts, start = [], 0
    for size in sizes:
        if size > 1:
            parts.append(torch.randint(start, start + size, (2, edges_per_block), generator=gen))
        start += size
    return torch.cat(parts, dim=1)


BLOCK_GRAPHS = {
    # name: (edge_index, N, the (blocks, block size) of each _dense_blocks call)
    "3-causal-sequences": (graphs.repeat_graph(graphs.causal_graph(5), 5, 3), 15, [(3, 5)]),
    "4-windows": (graphs.repeat_graph(graphs.window_graph(6, 1), 6, 4), 24, [(4, 6)]),
    "4-random-blocks": (random_blocks([6] * 4, 14, seed=1), 24, [(4, 6)]),
    # sizes 1 | 3, 4, 3 | 7, 6, 5 | 2: groups (1], (2], (2, 4], (4, 8]
    "unequal-blocks": (random_blocks([1, 3, 4, 7, 3, 6, 5, 2], 9, seed=2), 31,
                       [(1, 1), (1, 2), (3, 4), (3, 7)]),
}


@pytest.mark.parametrize("seed", range(6))
def test_block_starts_split_where_no_edge_crosses(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 30, (), generator=gen))
    span = int(torch.randint(1, 6, (), generator=gen))  # edges join nodes at most span apart
    src = torch.randint(0, n, (int(torch.randint(0, 25, (), generator=gen)),), generator=gen)
    dst = (src + torch.randint(-span, span + 1, src.shape, generator=gen)).clamp(0, n - 1)
    for edge_index in (torch.stack([src, dst]), torch.stack([dst, src]).int()):
        starts = cpu.block_starts(edge_index, n)
        assert starts.tolist() == brute_force_block_starts(edge_index, n)
        assert starts.dtype == torch.int64


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("want_pair", [True, False])
@pytest.mark.parametrize("blocks", [1, 3])
def test_block_pairs_equal_their_definition(blocks, want_pair, threads, monkeypatch):
    """Pair index, mask, pair count and causal order, in one pass or on two threads (forced
    for a small graph), against torch ops; a multigraph returns its pairs even when they were
    not asked for (the dense backend needs them there)."""
    monkeypatch.setattr(cpu, "MIN_PARALLEL_WORK", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        L = 6
        for edge_index in (random_blocks([L] * blocks, 20, seed=blocks),  # multi-edges
                           graphs.repeat_graph(graphs.causal_graph(L), L, blocks)):
            src, dst = edge_index
            pair, mask, distinct, lower = cpu.block_pairs(src, dst, blocks, L, L,
                                                          want_pair=want_pair)
            b = dst // L
            expected = (b * L + dst % L) * L + src % L
            want_mask = torch.zeros(blocks * L * L, dtype=torch.bool)
            want_mask[expected] = True
            assert torch.equal(mask.view(-1), want_mask)
            assert distinct == int(want_mask.sum())
            assert lower == bool((src % L <= dst % L).all())
            if want_pair or distinct != edge_index.size(1):
                assert torch.equal(pair, expected)
            else:
                assert pair is None
    finally:
        torch.set_num_threads(before)


def test_pair_order_against_its_definition():
    """Target-major order (strictly increasing (dst, src)), or edges without loops in that
    order then self-loops in increasing order, by brute force over the split; the graphs of
    graphs in both orders, a layer's self-loops moved last among them; random small graphs,
    whose pairs must be distinct wherever the answer says so."""
    def increasing(src, dst):
        return bool(((dst * 100 + src).diff() > 0).all())

    def definition(src, dst):
        in_order = increasing(src, dst)
        distinct = in_order or any(
            increasing(src[:k], dst[:k]) and not (src[:k] == dst[:k]).any()
            and increasing(src[k:], dst[k:]) and bool((src[k:] == dst[k:]).all())
            for k in range(src.numel() + 1))
        return distinct, distinct and bool((src <= dst).all()), in_order

    gen = torch.Generator().manual_seed(0)
    complete = graphs.batch_complete_graph(torch.tensor([0, 0, 1, 1, 1]))
    cases = [graphs.complete_graph(5), graphs.causal_graph(5), complete,
             cpu.one_loop_per_node(complete, 5)[0],  # the loops moved last
             cpu.one_loop_per_node(graphs.causal_graph(5), 5)[0],
             cpu.one_loop_per_node(graphs.causal_graph(5), 5)[0].flip(1),
             graphs.complete_graph(5).flip(0),  # source-major: out of order
             graphs.causal_graph(5).flip(0),  # sources after their targets, in order
             torch.tensor([[0, 0], [1, 1]]),  # a repeated pair
             torch.tensor([[0, 1, 1], [1, 1, 1]]),  # a loop in each run: repeated
             torch.zeros(2, 0, dtype=torch.long)]
    cases += [torch.randint(0, 3, (2, 5), generator=gen) for _ in range(40)]
    for edge_index in cases:
        src, dst = edge_index
        got = cpu.pair_order(src, dst)
        assert got == definition(src, dst), edge_index
        if got[0]:
            assert torch.unique(edge_index, dim=1).size(1) == edge_index.size(1)


def reordered(edge_index: torch.Tensor, order: str, num_nodes: int) -> torch.Tensor:
    """``edge_index`` (target-major) shuffled, with its ends swapped and sorted target-major
    again ("flipped"), with its self-loops moved last as a layer's ``add_self_loops`` leaves
    them, or as it is."""
    if order == "shuffled":
        return edge_index[:, torch.randperm(edge_index.size(1),
                                            generator=torch.Generator().manual_seed(1))]
    if order == "flipped":
        flipped = edge_index.flip(0)
        return flipped[:, torch.argsort(flipped[1] * num_nodes + flipped[0])]
    if order == "loops-last":
        return cpu.one_loop_per_node(edge_index, num_nodes)[0]
    return edge_index


@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("order", ["target-major", "loops-last", "shuffled", "flipped"])
@pytest.mark.parametrize("pattern", ["complete", "causal"])
def test_complete_and_causal_blocks_in_any_order(pattern, order, bias, need_alpha, monkeypatch):
    """Complete and causal blocks are recognised from their order (target-major, as graphs
    builds them) without the pass of block_pairs, and from that pass in any other order; a
    graph with the causal edge count in target-major order but its sources after their
    targets ("flipped" causal) is not causal. Each matches the reference, weights and
    gradients too, with SDPA told is_causal only for the causal graph without a bias."""
    one = graphs.complete_graph(5) if pattern == "complete" else graphs.causal_graph(5)
    edge_index = graphs.repeat_graph(one, 5, 3)
    edge_index = reordered(edge_index, order, 15)
    pairs_passes, causal_calls = [], []
    block_pairs, sdpa = cpu.block_pairs, dense_backend.sdpa

    def counting_block_pairs(*args, **kw):
        pairs_passes.append(1)
        return block_pairs(*args, **kw)

    def recording_sdpa(*args, **kw):
        causal_calls.append(kw.get("is_causal", False))
        return sdpa(*args, **kw)

    monkeypatch.setattr(cpu, "block_pairs", counting_block_pairs)
    monkeypatch.setattr(dense_backend, "sdpa", recording_sdpa)
    q, k, v, b = inputs(15, 15, "dot", edge_index.size(1), bias=bias)
    assert_dense_equals_reference(q, k, v, edge_index, b, score="dot", dropout_p=0.0,
                                  need_alpha=need_alpha)
    wants_pair = bias or need_alpha
    # (the complete graph flipped and sorted again is itself); only in target-major order is
    # the pair index of each edge known (and only there for the complete graph)
    in_order = order == "target-major" or (order == "flipped" and pattern == "complete")
    known = in_order or order == "loops-last"
    shortcut = known and (not wants_pair or (in_order and pattern == "complete"))
    assert bool(pairs_passes) != shortcut
    if causal_calls:  # the implicit path (no weights); a bias's float mask holds the pattern
        assert causal_calls == [pattern == "causal" and order != "flipped" and not bias]


@pytest.mark.parametrize("order", ["target-major", "loops-last", "shuffled", "flipped"])
@pytest.mark.parametrize("pattern", ["complete", "causal"])
def test_complete_and_causal_blocks_of_unequal_sizes(pattern, order, monkeypatch):
    """Blocks of 7, 3, 1, 5 and 6 nodes (padded groups), each complete or causal in
    target-major order, run as per-graph attention (no pair of the graph found, no edge
    sorted by group), and with the weights needed (returned, or under dropout) as padded
    whole blocks (each edge's pair from its positions); in another order, or with the sources
    after their targets, as padded groups of the graph's pairs. Every route matches the
    reference, gradients too, and a NaN in one block's inputs stays in that block."""
    sizes = [7, 3, 1, 5, 6]
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    edge_index = graphs.batch_complete_graph(batch)
    if pattern == "causal":
        edge_index = edge_index[:, edge_index[0] <= edge_index[1]]
    edge_index = reordered(edge_index, order, sum(sizes))
    n = sum(sizes)
    layout = diagonal_blocks(edge_index, n)
    assert layout is not None and layout.padded
    routes = []
    per_graph, group_edges = dense_backend.per_graph_attention, cpu.group_edges

    def spy_per_graph(*args, **kw):
        routes.append(("per-graph", kw["is_causal"]))
        return per_graph(*args, **kw)

    def spy_group_edges(*args):
        routes.append("groups")
        return group_edges(*args)

    whole_padded = dense_backend._whole_padded_blocks

    def spy_whole_padded(*args, **kw):
        routes.append("whole-padded")
        return whole_padded(*args, **kw)

    monkeypatch.setattr(dense_backend, "per_graph_attention", spy_per_graph)
    monkeypatch.setattr(dense_backend, "_whole_padded_blocks", spy_whole_padded)
    monkeypatch.setattr(cpu, "group_edges", spy_group_edges)
    q, k, v, _ = inputs(n, n, "dot", edge_index.size(1), bias=False)
    out = assert_dense_equals_reference(q, k, v, edge_index, None, score="dot",
                                        dropout_p=0.0, need_alpha=False)
    whole = order in ("target-major", "loops-last") or (order == "flipped"
                                                        and pattern == "complete")
    route = ("per-graph", pattern == "causal") if whole else "groups"
    assert routes == [route]
    # node 0 opens the first block, in one group with the (padded) blocks of 5 and 6 nodes
    v[0, 1, 2], k[1, 0, 0] = float("inf"), float("nan")
    spoilt = edge_attention(q, k, v, edge_index, backend="dense", scale=0.7)
    assert_close(spoilt[7:], out[7:])
    # with the weights needed, each edge's pair too: padded whole blocks, or padded groups
    for dropout_p, need_alpha in ((0.0, True), (0.4, False), (0.4, True)):
        routes.clear()
        assert_dense_equals_reference(*inputs(n, n, "dot", edge_index.size(1), bias=False)[:3],
                                      edge_index, None, score="dot", dropout_p=dropout_p,
                                      need_alpha=need_alpha)
        assert routes == ["whole-padded" if whole else "groups"]
    spoilt, alpha = edge_attention(q, k, v, edge_index, backend="dense", scale=0.7,
                                   dropout_p=0.4, return_attention=True)
    torch.manual_seed(0)
    want, want_alpha = edge_attention(q.detach(), k.detach(), v.detach(), edge_index,
                                      backend="reference", scale=0.7, return_attention=True)
    outside = edge_index[1] >= 7  # the edges of the other blocks
    assert_close(alpha[outside], want_alpha[outside])
    assert torch.isfinite(spoilt[7:]).all()


def test_block_starts_of_repeated_patterns_and_edge_cases():
    assert cpu.block_starts(graphs.repeat_graph(graphs.causal_graph(4), 4, 3), 12).tolist() == [
        0, 4, 8, 12]
    assert cpu.block_starts(torch.zeros(2, 0, dtype=torch.long), 3).tolist() == [0, 1, 2, 3]
    assert cpu.block_starts(torch.zeros(2, 0, dtype=torch.long), 0).tolist() == [0]
    # one long edge joins everything between its ends
    assert cpu.block_starts(torch.tensor([[5], [1]]), 7).tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("self_loops", [True, False])
def test_blocks_of_unequal_sizes_in_one_group_are_padded(self_loops):
    """Graphs of 20, 24, 30 and 32 nodes share the size group (16, 32]: the blocks are padded
    (they were taken for equal blocks of 32 and viewed as such, which raised), and auto and
    dense equal the reference, with self-loops (per-graph attention) and without (pairs)."""
    sizes = [20, 24, 30, 32]
    batch = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    edge_index = graphs.batch_complete_graph(batch, self_loops=self_loops)
    layout = diagonal_blocks(edge_index, sum(sizes))
    assert layout is not None and len(layout.groups) == 1 and layout.padded
    q, k, v, _ = inputs(sum(sizes), sum(sizes), "dot", edge_index.size(1), bias=False)
    want = edge_attention(q, k, v, edge_index, backend="reference")
    for backend in ("auto", "dense"):
        assert_close(edge_attention(q, k, v, edge_index, backend=backend), want)


def test_diagonal_blocks_groups_blocks_and_pads_each_less_than_twice():
    sizes = [1, 3, 4, 7, 3, 6, 5, 2]
    layout = diagonal_blocks(random_blocks(sizes, 9, seed=2), sum(sizes))
    assert layout is not None and layout.padded
    assert layout.starts.diff().tolist() == sizes
    seen = []
    for members, size in layout.groups:
        member_sizes = [sizes[b] for b in members.tolist()]
        assert max(member_sizes) == size and all(2 * s > size for s in member_sizes)
        seen += members.tolist()
    assert sorted(seen) == list(range(len(sizes)))  # every block in exactly one group
    assert layout.pairs == sum(len(m) * s * s for m, s in layout.groups)
    equal = diagonal_blocks(graphs.repeat_graph(graphs.causal_graph(5), 5, 3), 15)
    assert not equal.padded and [(m.tolist(), s) for m, s in equal.groups] == [([0, 1, 2], 5)]


def test_diagonal_blocks_is_none_when_blocks_save_less_than_half_the_pairs():
    assert diagonal_blocks(graphs.chain_graph(10), 10) is None  # one block
    # blocks of 8 and 2 nodes: 68 of 100 pairs, more than half
    assert diagonal_blocks(random_blocks([8, 2], 12, seed=0), 10) is None
    # blocks of 5 and 5: 50 of 100 pairs, exactly half
    assert diagonal_blocks(random_blocks([5, 5], 12, seed=0), 10) is not None


@pytest.fixture
def block_calls(monkeypatch) -> list[tuple[int, int]]:
    """Records ``(blocks, block size)`` of every call of the dense backend's block routine."""
    calls, real = [], dense_backend._dense_blocks

    def spy(q, k, v, src, dst, blocks, n_dst, n_src, **kwargs):
        calls.append((blocks, n_dst))
        return real(q, k, v, src, dst, blocks, n_dst, n_src, **kwargs)

    monkeypatch.setattr(dense_backend, "_dense_blocks", spy)
    return calls


@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.4], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
@pytest.mark.parametrize("name", list(BLOCK_GRAPHS))
def test_block_diagonal_graphs_run_block_by_block_and_equal_the_reference(
        name, score, with_bias, dropout_p, need_alpha, block_calls):
    """Equal blocks viewed in place, unequal blocks padded by size group: out, alpha and every
    gradient equal the reference, and the work runs on the blocks alone."""
    edge_index, n, expected = BLOCK_GRAPHS[name]
    q, k, v, bias = inputs(n, n, "additive" if score == "additive" else "dot",
                           edge_index.size(1), bias=with_bias)
    if score == "gatv2":  # its att [H, C] as a fixed tensor through edge_attention's argument
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        att = torch.randn(2, 3, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
        outs = {}
        for backend in ("dense", "reference"):
            torch.manual_seed(0)
            out, alpha = edge_attention(*leaves, edge_index, bias=bias, score="gatv2", att=att,
                                        dropout_p=dropout_p, return_attention=True,
                                        backend=backend)
            grads = torch.autograd.grad(out.sin().sum() + alpha.square().sum(), leaves)
            outs[backend] = (out, alpha, grads)
        for got, want in zip(outs["dense"], outs["reference"], strict=True):
            for g, w in zip(*((got, want) if isinstance(got, tuple) else ([got], [want])),
                            strict=True):
                assert_close(g, w)
    else:
        assert_dense_equals_reference(q, k, v, edge_index, bias, score=score,
                                      dropout_p=dropout_p, need_alpha=need_alpha)
    assert block_calls and set(block_calls) == set(expected), block_calls


def test_batch_of_causal_sequences_runs_sdpa_with_is_causal_on_its_blocks(sdpa_calls,
                                                                          block_calls):
    edge_index = graphs.repeat_graph(graphs.causal_graph(7), 7, 4)
    q, k, v, _ = inputs(28, 28, "dot", edge_index.size(1), bias=False)
    assert_dense_equals_reference(q, k, v, edge_index, None, score="dot", dropout_p=0.0,
                                  need_alpha=False)
    assert block_calls == [(4, 7)]
    assert sdpa_calls and all(call == (4, None, True) for call in sdpa_calls), sdpa_calls


@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
@pytest.mark.parametrize("blocks", [True, False], ids=["blocks", "one-block"])
def test_nodes_without_edges_reach_no_output_or_gradient(blocks, need_alpha):
    """Node 3 has no edge, and holds NaN and inf in q, k and v: no output and no gradient take
    them in, as in the reference, whether the graph runs as blocks of 3, 1, 4 and 1 nodes
    (node 8 has no edge either) or as one block (the edge 1 -> 8 spans every node)."""
    edges = [[0, 1, 2, 0, 4, 5, 6, 7, 4], [1, 2, 0, 0, 5, 6, 7, 4, 4]]
    if not blocks:
        edges = [edges[0] + [1], edges[1] + [8]]
    edge_index = torch.tensor(edges)
    assert (diagonal_blocks(edge_index, 9) is not None) == blocks
    q, k, v, _ = inputs(9, 9, "dot", edge_index.size(1), bias=False)
    for node in (3, 8) if blocks else (3,):
        for t in (q, k, v):
            t[node, 0], t[node, 1] = float("nan"), float("inf")
    out = assert_dense_equals_reference(q, k, v, edge_index, None, score="dot", dropout_p=0.0,
                                        need_alpha=need_alpha)
    assert (out[3] == 0).all()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 7), min_size=1, max_size=5),
       pattern=st.sampled_from(["complete", "causal"]),
       order=st.sampled_from(["target-major", "loops-last", "shuffled", "flipped"]),
       change=st.sampled_from(["none", "drop", "repeat", "swap"]), with_bias=st.booleans(),
       dropout_p=st.sampled_from([0.0, 0.3]), need_alpha=st.booleans(), data=st.data())
def test_property_blocks_known_from_their_order_equal_the_reference(
        sizes, pattern, order, change, with_bias, dropout_p, need_alpha, data):
    """Complete or causal blocks in any order, with an edge dropped, one repeated (the count
    of a complete graph kept by dropping another), or two edges swapped, with or without a
    bias, dropout and the weights: whichever route the dense backend takes (per-graph
    attention, the shortcut of the equal blocks, the pairs in place or found), out, weights
    and gradients equal the reference's, and pair_order never calls a graph with a repeated
    pair distinct."""
    n = sum(sizes)
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    edge_index = graphs.batch_complete_graph(batch)
    if pattern == "causal":
        edge_index = edge_index[:, edge_index[0] <= edge_index[1]]
    edge_index = reordered(edge_index, order, n)
    E = edge_index.size(1)
    if change == "drop":
        keep = torch.ones(E, dtype=torch.bool)
        keep[data.draw(st.integers(0, E - 1))] = False
        edge_index = edge_index[:, keep]
    elif change == "repeat" and E > 1:
        i, j = data.draw(st.integers(0, E - 1)), data.draw(st.integers(0, E - 1))
        edge_index = edge_index.clone()
        edge_index[:, j] = edge_index[:, i]  # the count kept, one pair twice (or unchanged)
    elif change == "swap":
        i, j = data.draw(st.integers(0, E - 1)), data.draw(st.integers(0, E - 1))
        edge_index = edge_index.clone()
        edge_index[:, [i, j]] = edge_index[:, [j, i]]
    src, dst = edge_index
    distinct, _, _ = cpu.pair_order(src, dst)
    if distinct:
        assert torch.unique(edge_index, dim=1).size(1) == edge_index.size(1)
    if edge_index.size(1) == 0:
        return
    q, k, v, bias = inputs(n, n, "dot", edge_index.size(1), bias=with_bias, seed=len(sizes))
    assert_dense_equals_reference(q, k, v, edge_index, bias, score="dot", dropout_p=dropout_p,
                                  need_alpha=need_alpha)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
       per_block=st.integers(1, 40), seed=st.integers(0, 1000),
       score=st.sampled_from(["dot", "additive", "gatv2"]), with_bias=st.booleans(),
       dropout_p=st.sampled_from([0.0, 0.3]), need_alpha=st.booleans(),
       backend=st.sampled_from(["dense", "auto"]))
def test_property_random_blocks_equal_the_reference(sizes, per_block, seed, score, with_bias,
                                                    dropout_p, need_alpha, backend):
    """Random edges inside blocks of 1 to 9 nodes (multi-edges, self-loops and isolated nodes
    allowed), each score, with or without bias, dropout and the weights: the dense backend (on
    the blocks it finds, padded by size group or not) and auto (whichever backend it picks)
    equal the reference, out, weights and gradients."""
    if all(size == 1 for size in sizes):
        sizes = sizes + [2]  # random_blocks gives a block of one node no edge
    n = sum(sizes)
    edge_index = random_blocks(sizes, per_block, seed=seed)
    inputs_ = attention_inputs(n, n, edge_index.size(1), 2, 3, score=score,
                               dtype=torch.float64)
    results = []
    for name in (backend, "reference"):
        leaves = {key: t.detach().clone().requires_grad_() for key, t in inputs_.items()
                  if t is not None and (key != "bias" or with_bias)}
        torch.manual_seed(0)  # the same dropout mask for both backends
        result = edge_attention(leaves["q"], leaves["k"], leaves["v"], edge_index,
                                bias=leaves.get("bias"), att=leaves.get("att"), score=score,
                                dropout_p=dropout_p, return_attention=need_alpha,
                                backend=name, scale=0.7)
        out, alpha = result if need_alpha else (result, None)
        loss = out.square().sum() + (alpha.square().sum() if alpha is not None else 0.0)
        results.append((out, alpha, torch.autograd.grad(loss, list(leaves.values()))))
    (out, alpha, grads), (ref, ref_alpha, ref_grads) = results
    assert_close(out, ref)
    if need_alpha:
        assert_close(alpha, ref_alpha)
    for got, want in zip(grads, ref_grads, strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("route", ["_per_graph", "_whole_padded_blocks"])
@pytest.mark.parametrize("pattern", ["complete", "causal"])
def test_whole_block_paths_gradients_of_gradients(pattern, route, monkeypatch):
    """Complete and causal blocks of 3, 4 and 2 nodes (the first padded to 4) run as per-graph
    attention, and with the weights returned and dropout (one seed at every call, so one
    mask) as padded whole blocks; gradients and gradients of gradients are checked
    numerically."""
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 4, 2]))
    edge_index = graphs.batch_complete_graph(batch)
    if pattern == "causal":
        edge_index = edge_index[:, edge_index[0] <= edge_index[1]]
    name = "per_graph_attention" if route == "_per_graph" else route
    calls, run_route = [], getattr(dense_backend, name)
    monkeypatch.setattr(dense_backend, name,
                        lambda *a, **kw: calls.append(1) or run_route(*a, **kw))
    q, k, v = (t.requires_grad_() for t in inputs(9, 9, "dot", 0, bias=False)[:3])
    weights = route == "_whole_padded_blocks"

    def attend(q, k, v):
        torch.manual_seed(3)
        return edge_attention(q, k, v, edge_index, backend="dense", dropout_p=0.3 * weights,
                              return_attention=weights)

    assert torch.autograd.gradcheck(attend, (q, k, v))
    assert torch.autograd.gradgradcheck(attend, (q, k, v), fast_mode=weights)
    assert calls


@pytest.mark.parametrize("sizes", [[4, 4, 4], [3, 5, 2, 4]], ids=["equal", "padded"])
def test_block_path_gradients_of_gradients(sizes):
    n = sum(sizes)
    edge_index = random_blocks(sizes, 10, seed=3)
    q, k, v, bias = (t.requires_grad_() for t in inputs(n, n, "dot", edge_index.size(1)))

    def attend(q, k, v, bias):
        out, alpha = edge_attention(q, k, v, edge_index, bias=bias, backend="dense",
                                    return_attention=True)
        return out, alpha

    layout = diagonal_blocks(edge_index, n)
    assert layout is not None and layout.padded == (len(set(sizes)) > 1)
    assert torch.autograd.gradcheck(attend, (q, k, v, bias))
    # random projections of the second derivatives (the full check: 3.9 s alone, 42 s in the
    # suite beside the compile tests)
    assert torch.autograd.gradgradcheck(attend, (q, k, v, bias), fast_mode=True)


@pytest.mark.parametrize("dtype,big", [(torch.float32, 2e38), (torch.float64, 1e308)])
def test_repeated_edges_with_scores_whose_differences_overflow(dtype, big):
    """A pair with two edges beside an edge scoring +big, each of its edges -big: the shift
    of the pair's log-sum-exp below its row's top overflows to -inf. Its weight underflows to
    0 (it was taken as a shift of 0, and the row's weights came out 1/3 each)."""
    edge_index = torch.tensor([[0, 1, 1, 2, 0], [0, 0, 0, 1, 1]])  # pair (1 -> 0) twice
    q, k = torch.zeros(2, 1, 3, dtype=dtype), torch.zeros(3, 1, 3, dtype=dtype)
    v = torch.randn(3, 1, 3, dtype=dtype, generator=torch.Generator().manual_seed(0))
    bias = torch.tensor([[big], [-big], [-big], [1.0], [2.0]], dtype=dtype)
    results = {}
    for backend in ("dense", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, alpha = edge_attention(*leaves, edge_index, bias=bias, backend=backend,
                                    return_attention=True)
        grads = torch.autograd.grad((out * torch.arange(out.numel()).view_as(out)).sum(),
                                    leaves)
        results[backend] = (out, alpha, *grads)
    two = torch.tensor([-1.0, 1.0], dtype=dtype).sigmoid()  # target 1: scores 1 and 2
    assert_close(results["dense"][1][:, 0], torch.cat([torch.tensor([1.0, 0, 0], dtype=dtype),
                                                       two]))
    for got, want in zip(results["dense"], results["reference"], strict=True):
        assert torch.isfinite(got).all()
        assert_close(got, want)


@pytest.mark.parametrize("via", ["edge_attention", "dense_attention"])
def test_large_scores_take_an_accurate_backward(via):
    """SDPA's CPU flash kernel recomputes its weights in the backward from scores rounded
    otherwise than its forward's: at scores of thousands grad v was off by 2.5e-3 (and grad q
    inf at tens of thousands). Past FLASH_CPU_BACKWARD_MAX_LSE the backward takes the math
    path: the gradients stay within fp32 rounding of float64's."""
    N, H, C = 64, 2, 32
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(N, H, C, generator=gen) * 30 for _ in range(2))
    v, grad_out = (torch.randn(N, H, C, generator=gen) for _ in range(2))
    grads = []
    for dtype in (torch.float64, torch.float32):
        qq, kk, vv = (t.to(dtype).requires_grad_() for t in (q, k, v))
        if via == "edge_attention":
            out = edge_attention(qq, kk, vv, graphs.complete_graph(N), backend="dense")
        else:
            out = dense_attention(qq, kk, vv)
        out.backward(grad_out.to(dtype))
        grads.append((vv.grad, qq.grad))
    (want_v, _), (got_v, got_q) = grads
    assert (got_v.double() - want_v).abs().max() < 1e-5
    assert got_q.isfinite().all()


def test_sdpa_with_dropout_on_cpu_takes_sdpas_default_scale_and_adds_a_float_mask():
    """sdpa() with dropout on CPU (its explicit path): no scale is SDPA's 1 / sqrt(C), and a
    float mask is added to the scores, as SDPA takes them."""
    from graphattn.functional import dropout_mask

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 5, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(5, 5, generator=gen, dtype=torch.float64)  # (L_q, L_k), additive
    torch.manual_seed(7)
    out = dense_backend.sdpa(q, k, v, attn_mask=mask, dropout_p=0.3)
    torch.manual_seed(7)
    M = dropout_mask((2, 5, 5), 0.3, dtype=torch.float64)
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(4) + mask, dim=-1)  # (H, L, L)
    assert_close(out, (weights * M) @ v)


@pytest.mark.parametrize(("heads", "value_channels"), [(0, 3), (2, 0)],
                         ids=["no-heads", "no-value-channels"])
def test_no_heads_or_value_channels_give_every_input_a_zero_gradient(heads, value_channels):
    """An empty output still gives q, k, v and the bias a (zero) gradient, as the reference
    does: SDPA's empty products would leave the bias out of the autograd graph."""
    edge_index = torch.tensor([[0, 1, 2, 2], [1, 1, 3, 0]])
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(4, heads, 3, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(4, heads, value_channels, generator=gen, requires_grad=True)
    bias = torch.randn(4, heads, generator=gen, requires_grad=True)
    out = edge_attention(q, k, v, edge_index, bias=bias, backend="dense")
    assert out.shape == (4, heads, value_channels)
    grads = torch.autograd.grad(out.sum(), (q, k, v, bias))
    assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, (q, k, v, bias),
                                                                  strict=True))


@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
def test_repeated_edge_keeps_its_count_next_to_large_scores(need_alpha):
    """A pair of two edges next to a pair of one, every bias 1e9 (fp32): the double pair
    weighs twice the single one. Its log-weight is kept relative to the largest score of its
    row, where log(2) would round away next to 1e9. (q = 0: the reference's fp32 scores of
    1e9 would round q . k away.)"""
    edge_index = torch.tensor([[1, 1, 2], [0, 0, 0]])
    _, k, v, _ = inputs(3, 3, "dot", 3, dtype=torch.float32, bias=False)
    q = torch.zeros_like(k)
    bias = torch.full((3, 2), 1e9)
    assert_dense_equals_reference(q, k, v, edge_index, bias, score="dot", dropout_p=0.0,
                                  need_alpha=need_alpha)


@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
def test_multigraph_with_as_many_edges_as_pairs_is_not_the_complete_graph(need_alpha):
    """9 edges over 3 nodes, as many as the complete graph's pairs, but repeated among nodes 0
    and 1: node 2, without edges, holding NaN and inf, reaches no output and no gradient, as
    in the reference (the complete graph would run without a mask and without zeroing it)."""
    edge_index = torch.tensor([[0, 0, 1, 1, 0, 1, 1, 0, 1], [0, 1, 0, 1, 1, 1, 0, 0, 1]])
    q, k, v, _ = inputs(3, 3, "dot", edge_index.size(1), bias=False)
    for t in (q, k, v):
        t[2, 0], t[2, 1] = float("nan"), float("inf")
    out = assert_dense_equals_reference(q, k, v, edge_index, None, score="dot", dropout_p=0.0,
                                        need_alpha=need_alpha)
    assert (out[2] == 0).all()


@pytest.mark.parametrize("graph", ["flipped-causal", "blocks"])
def test_under_torch_func_the_graph_is_read_on_the_device_path(graph):
    """Under torch.func the edges cannot be read on the host: the pair index and the causal
    pattern are computed with tensor ops. The flipped causal graph (each source at or after its
    target) is not causal; blocks given by their layout stay inside their block. Both equal
    the reference, output and gradient."""
    if graph == "flipped-causal":
        edge_index, layout = graphs.causal_graph(5).flip(0), None
    else:
        edge_index = torch.tensor([[1, 0, 0, 2, 3, 4, 5], [0, 1, 0, 3, 3, 4, 4]])  # 3 x 2
        layout = diagonal_blocks(edge_index, 6)
        assert layout is not None and not layout.padded
    n = int(edge_index.max()) + 1
    q, k, v, _ = inputs(n, n, "dot", edge_index.size(1), bias=False)

    def loss(q, backend):
        if backend == "dense":
            out, _ = dense_edge_attention(q, k, v, edge_index, scale=0.7, bias=None,
                                          dropout_mask=None, score="dot", negative_slope=0.2,
                                          need_alpha=False, layout=layout)
        else:
            out = edge_attention(q, k, v, edge_index, scale=0.7, backend="reference")
        return out.sin().sum()

    got = torch.func.grad_and_value(loss)(q, "dense")
    expected = torch.func.grad_and_value(loss)(q, "reference")
    for g, e in zip(got, expected, strict=True):
        assert_close(g, e)


@pytest.mark.parametrize("need_alpha", [False, True], ids=["sdpa", "weights"])
@pytest.mark.parametrize("graph", ["random", "complete"])
def test_output_is_contiguous_as_on_every_backend(graph, need_alpha):
    """One block's [1, H, N, C] output turned nodes first is a strided view until copied: the
    output must view as [N, H * C], as every backend's does."""
    edge_index = (graphs.complete_graph(5) if graph == "complete"
                  else torch.tensor([[0, 1, 2, 3, 1], [1, 2, 3, 0, 0]]))
    q, k, v, _ = inputs(5, 5, "dot", edge_index.size(1), bias=False)
    result = edge_attention(q, k, v, edge_index, backend="dense", return_attention=need_alpha)
    out = result[0] if need_alpha else result
    assert out.is_contiguous()
    assert out.view(5, -1).shape == (5, 2 * 3)


@pytest.mark.parametrize("graph", ["complete", "causal"])
def test_gradients_of_gradients_keep_the_scale(graph):
    """With create_graph=True the backward of SDPA's fused kernel is recomputed on its math
    path, with the scale of the forward: first and second gradients equal the reference's at
    a scale other than 1 / sqrt(C)."""
    edge_index = graphs.complete_graph(6) if graph == "complete" else graphs.causal_graph(6)
    q, k, v, _ = inputs(6, 6, "dot", 0, H=2, C=4, dtype=torch.float32, bias=False)
    results = []
    for backend in ("dense", "reference"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = edge_attention(*leaves, edge_index, scale=0.7, backend=backend)
        grads = torch.autograd.grad(out.sin().sum(), leaves, create_graph=True)
        second = torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)
        results.append((*grads, *second))
    for got, expected in zip(*results, strict=True):
        assert_close(got, expected)


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("blocks", [1, 4])
def test_bias_of_complete_blocks_with_a_dead_row_is_read_only(blocks, heads):
    """Complete blocks in target-major order score from a view of the bias itself: a row
    whose every edge scores -inf gets 0 without the caller's bias (or its gradient) being
    written to, and the result is the reference's."""
    n = 6
    edge_index = graphs.repeat_graph(graphs.complete_graph(n), n, blocks)
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(edge_index.size(1), heads, generator=gen)
    bias[edge_index[1] == 2, 0] = -math.inf  # target 2 of the first block, head 0
    before = bias.clone()
    bias.requires_grad_()
    q = torch.randn(blocks * n, heads, 4, generator=gen, requires_grad=True)
    results = {}
    for backend in ("dense", "reference"):
        out = edge_attention(q, q, q, edge_index, bias=bias, backend=backend)
        grads = torch.autograd.grad(out.square().sum(), (q, bias))
        results[backend] = (out, *grads)
        assert torch.equal(bias.detach(), before)
    assert (results["dense"][0][2, 0] == 0).all()
    for got, want in zip(results["dense"], results["reference"], strict=True):
        assert torch.isfinite(got).all()
        assert_close(got, want)
