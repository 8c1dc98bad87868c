"""``edge_attention(sinks=)``: one more score per head in every target's softmax, whose value is
0, on every backend that takes sinks, against the formula written out with dense torch ops and
against the reference backend (outputs, weights, and the gradients of every input, the sinks'
included)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, assert_compiles_as_it_runs, outputs_and_grads, random_graph

from graphattn import graphs
from graphattn.functional import dense_attention, edge_attention, select_backend
from graphattn.functional import triton_blocks as tb
from graphattn.functional import triton_kernels as tk
from graphattn.functional.attention import BACKENDS
from graphattn.functional.cpu import seeded_mask_from
from graphattn.functional.dropout import seeded_mask_parameters


def _inputs(score: str, *, n: int = 12, heads: int = 2, channels: int = 8, num_edges: int = 70,
            dtype: torch.dtype = torch.float64, bias: bool = True, edge_terms: bool = False,
            seed: int = 0, device: torch.device | str = "cpu") -> tuple[dict, torch.Tensor]:
    """Leaves of a call on a random graph with a node of 40 in-edges and two nodes of none
    (n - 1 and n - 2), sinks of both signs, on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.cat([random_graph(n - 2, num_edges, seed=seed),
                            torch.stack([torch.randint(0, n, (40,), generator=gen),
                                         torch.zeros(40, dtype=torch.long)])], dim=1)
    E = edge_index.size(1)

    def leaf(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=dtype) * std).to(
            device).requires_grad_()

    qk_shape = (heads,) if score == "additive" else (heads, channels)
    inputs = dict(q=leaf(n, *qk_shape, std=2.0), k=leaf(n, *qk_shape, std=2.0),
                  v=leaf(n, heads, channels), sinks=leaf(heads, std=2.0))
    if score == "gatv2":
        inputs["att"] = leaf(heads, channels)
    if bias:
        inputs["bias"] = leaf(E, heads)
    if edge_terms:
        inputs["edge_key"] = leaf(E, heads, channels)
        inputs["edge_value"] = leaf(E, heads, channels)
    return inputs, edge_index.to(device)


def test_reference_is_the_formula_with_a_column_of_sinks():
    """On a causal graph with a bias: softmax over [scale q k^T + bias, sink] per row, the
    sink's column dropped, times v (GPT-OSS's eager attention)."""
    n, H, C = 9, 2, 4
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, H, C, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    sinks = torch.tensor([1.5, -0.5], dtype=torch.float64)
    edge_index = graphs.causal_graph(n)
    bias_dense = torch.randn(H, n, n, generator=gen, dtype=torch.float64)  # (H, targets, sources)
    bias = bias_dense[:, edge_index[1], edge_index[0]].T  # (E, H)
    scores = torch.einsum("ihc,jhc->hij", q, k) * 0.3 + bias_dense
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    column = sinks.view(H, 1, 1).expand(H, n, 1)
    weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :n]  # (H, n, n)
    want = torch.einsum("hij,jhc->ihc", weights, v)
    for backend in ("reference", "cpu"):
        out, alpha = edge_attention(q, k, v, edge_index, scale=0.3, bias=bias, sinks=sinks,
                                    backend=backend, return_attention=True)
        assert_close(out, want)
        assert_close(alpha, weights[:, edge_index[1], edge_index[0]].T)
    plain = edge_attention(q, k, v, edge_index, scale=0.3, bias=bias)
    assert (plain - want).abs().max() > 0.1  # the sinks matter here


@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_cpu_backend_matches_the_reference(score, dtype):
    """Outputs, weights and every gradient, the sinks' included, with per-edge key and value
    terms in fp64 and fp32; half precision is computed in fp32 by both (bf16 without the
    terms, whose gradients round apart in bf16 with or without sinks)."""
    inputs, edge_index = _inputs(score, dtype=dtype,
                                 edge_terms=score != "additive" and dtype != torch.bfloat16)
    want = outputs_and_grads("reference", inputs, edge_index, score=score)
    got = outputs_and_grads("cpu", inputs, edge_index, score=score)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_cpu_backend_with_a_cap_dropout_and_long_rows():
    """With a soft cap, seeded dropout (the mask the cpu kernels draw, given to the reference
    as a tensor) and rows of more than the kernels' block of 128 edges, summed in float64."""
    inputs, edge_index = _inputs("dot", dtype=torch.float32, num_edges=2000, n=14)
    mask_parameters = seeded_mask_parameters(0.3, device="cpu")
    mask = seeded_mask_from(mask_parameters, (edge_index.size(1), 2), torch.float32)
    results = {}
    for backend, drop in (("reference", mask), ("cpu", mask_parameters)):
        q, k, v = inputs["q"], inputs["k"], inputs["v"]
        out, alpha = BACKENDS[backend](q, k, v, edge_index, scale=0.3, bias=inputs["bias"],
                                       dropout_mask=drop, score="dot", negative_slope=0.2,
                                       need_alpha=True, softcap=3.0, sinks=inputs["sinks"])
        loss = out.square().sum() + alpha.square().sum()
        results[backend] = [out, alpha, *torch.autograd.grad(loss, list(inputs.values()))]
    assert torch.bincount(edge_index[1]).max() > 128
    for a, b in zip(results["cpu"], results["reference"], strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("tiles", ["one-node", "row-blocks", "hub"])
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_triton_backend_matches_the_reference(triton_device, monkeypatch, tiles, score):
    """The three launches of the forward kernels, each of which starts its rows' softmax at the
    sinks: a program per row, row blocks, and the rows of many tiles summed in float64 blocks
    (tiles of 2 edges here, so that the 40 in-edges of node 0 make such a row). The two nodes
    without in-edges get 0."""
    if tiles == "hub":
        monkeypatch.setattr(tk, "SUM_STEPS", 1)
        monkeypatch.setattr(tk, "HUB_EDGES", 0)
    options = {"one-node": {}, "row-blocks": dict(block_n=4, heavy_degree=6),
               "hub": dict(block_e=2)}[tiles]
    inputs, edge_index = _inputs(score, dtype=torch.float32, n=8, num_edges=30,
                                 edge_terms=score == "dot", device=triton_device)
    want = outputs_and_grads("reference", inputs, edge_index, score=score)
    with tk.launch_tiles(**options):
        got = outputs_and_grads("triton", inputs, edge_index, score=score)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)
    assert (got[0][-2:] == 0).all()


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_a_sink_of_minus_inf_is_no_sink(backend, request):
    """A sink of -inf weighs nothing: the result of the call without sinks, rows without
    edges included (0, not NaN), and a gradient of 0 for it."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    inputs, edge_index = _inputs("dot", dtype=torch.float32, n=8, num_edges=30)
    del inputs["sinks"]
    plain = outputs_and_grads(backend, inputs, edge_index, score="dot")
    inputs["sinks"] = torch.tensor([float("-inf"), 0.5]).requires_grad_()
    got = outputs_and_grads(backend, inputs, edge_index, score="dot")
    assert_close(got[0][:, 0], plain[0][:, 0])
    assert_close(got[1][:, 0], plain[1][:, 0])
    assert (got[0][:, 1] != plain[0][:, 1]).any()
    assert got[-1][0] == 0 and got[-1][1] != 0


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton", "dense"])
def test_a_sink_of_plus_inf_takes_all_the_weight(backend, request):
    """A sink of +inf takes all of its head's weight: outputs and weights 0 in that head,
    gradients finite, the other head as with a finite sink. Only ``"dense"`` (SDPA) gave
    this; the kernels and the reference gave NaN (exp(inf - inf) at the row's maximum)."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    inputs, edge_index = _inputs("dot", dtype=torch.float32, n=8, num_edges=30)
    inputs["sinks"] = torch.tensor([float("inf"), 0.5]).requires_grad_()
    got = outputs_and_grads(backend, inputs, edge_index, score="dot")
    want = outputs_and_grads("reference", {**inputs, "sinks": torch.tensor(
        [1e30, 0.5]).requires_grad_()}, edge_index, score="dot")  # a sink past every score
    assert (got[0][:, 0] == 0).all() and (got[1][:, 0] == 0).all()
    assert all(t.isfinite().all() for t in got)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gradients_match_finite_differences(backend):
    inputs, edge_index = _inputs("gatv2", n=5, heads=1, channels=3, num_edges=10)
    q, k, v, sinks, att, bias = inputs.values()

    def f(q, k, v, sinks, att, bias):
        return edge_attention(q, k, v, edge_index, bias=bias, score="gatv2", att=att,
                              sinks=sinks, backend=backend, return_attention=True)

    assert torch.autograd.gradcheck(f, (q, k, v, sinks, att, bias))
    assert torch.autograd.gradgradcheck(f, (q, k, v, sinks, att, bias))


def test_triton_gradients_of_gradients(triton_interpreter):
    """Under create_graph=True the fused kernels' backward is the reference's, sinks included:
    the second derivative of the sinks matches the reference backend's."""
    inputs, edge_index = _inputs("dot", dtype=torch.float32, n=8, num_edges=30)
    results = []
    for backend in ("reference", "triton"):
        out = edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index,
                             bias=inputs["bias"], sinks=inputs["sinks"], backend=backend)
        (g,) = torch.autograd.grad(out.square().sum(), inputs["sinks"], create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), inputs["sinks"])
        results.append((g, gg))
    for a, b in zip(*results, strict=True):
        assert_close(a, b)


def _blocks(sizes: list[int], pattern: str) -> torch.Tensor:
    """Diagonal blocks of these sizes, each complete, causal, or random with repeated edges
    (a node without in-edges in each)."""
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    edge_index = graphs.batch_complete_graph(batch)
    if pattern == "causal":
        return edge_index[:, edge_index[0] <= edge_index[1]]
    if pattern == "random":
        gen = torch.Generator().manual_seed(len(sizes))
        keep = torch.rand(edge_index.size(1), generator=gen) < 0.5
        starts = torch.tensor([0, *sizes]).cumsum(0)[:-1]
        keep &= ~torch.isin(edge_index[1], starts)  # each block's first node: no in-edge
        edge_index = edge_index[:, keep]
        return torch.cat([edge_index, edge_index[:, ::3]], dim=1)  # repeated edges
    return edge_index


GRAPHS = {  # the dense backend's routes: one SDPA call, per-graph SDPA, padded blocks
    "complete": lambda: graphs.complete_graph(12),
    "causal, equal blocks": lambda: graphs.repeat_graph(graphs.causal_graph(8), 8, 3),
    "causal, unequal blocks": lambda: _blocks([7, 3, 1, 5, 6], "causal"),
    "complete, unequal blocks": lambda: _blocks([7, 3, 1, 5, 6], "complete"),
    "random multigraph": lambda: _blocks([14], "random"),
    "random, unequal blocks": lambda: _blocks([9, 4, 12, 6], "random"),
}


@pytest.mark.parametrize("graph", list(GRAPHS))
@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "weights"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_dense_backend_matches_the_reference(graph, need_alpha, dtype):
    """Every route of the dense backend, through SDPA (the sinks as one more key, whose score
    is the sink; in half precision in two parts) and through the explicit softmax (one more
    column), with a bias on the graphs with repeated edges (whose log-sum-exp per pair is
    shifted by its row's maximum, and the sink with it): outputs, weights and every
    gradient."""
    edge_index = GRAPHS[graph]()
    n = int(edge_index.max()) + 1
    gen = torch.Generator().manual_seed(3)

    def leaf(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * std).to(
            dtype).requires_grad_()

    inputs = dict(q=leaf(n, 2, 8, std=2.0), k=leaf(n, 2, 8, std=2.0), v=leaf(n, 2, 8),
                  sinks=torch.tensor([1.5, -0.5], dtype=dtype, requires_grad=True))
    if "random" in graph:
        inputs["bias"] = leaf(edge_index.size(1), 2)
    results = []
    for backend in ("reference", "dense"):
        if need_alpha:
            results.append(outputs_and_grads(backend, inputs, edge_index))
            continue
        extra = {name: t for name, t in inputs.items() if name not in "qkv"}
        out = edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index,
                             backend=backend, **extra)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
        results.append([out, *torch.autograd.grad(loss, list(inputs.values()))])
    for a, b in zip(results[1], results[0], strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "weights"])
@pytest.mark.parametrize("dtype, level", [(torch.bfloat16, 300.0), (torch.float16, 3000.0),
                                          (torch.float32, 1e9)])
def test_dense_backend_counts_repeated_edges_beside_a_large_bias_and_sink(dtype, level,
                                                                          need_alpha):
    """Every score equals the sink, far from 0: the edge 0 -> 0 twice, 1 -> 0 and the sink
    weigh 1/4 each. The log-sum-exp of the doubled pair, log 2 + level, rounds to the level in
    the bias's dtype; it is taken relative to its row's maximum, and the sink with it."""
    edge_index = torch.tensor([[0, 0, 1], [0, 0, 0]])
    q = k = torch.zeros(2, 1, 4, dtype=dtype)
    v = torch.tensor([[1.0] * 4, [0.0] * 4], dtype=dtype).unsqueeze(1)
    bias, sinks = torch.full((3, 1), level, dtype=dtype), torch.tensor([level], dtype=dtype)
    for backend in ("reference", "dense"):
        result = edge_attention(q, k, v, edge_index, bias=bias, sinks=sinks, backend=backend,
                                return_attention=need_alpha)
        out, alpha = result if need_alpha else (result, None)
        assert out[0, 0].tolist() == [0.5] * 4 and (out[1] == 0).all(), backend
        assert alpha is None or alpha[:, 0].tolist() == [0.25] * 3, backend


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton", "dense"])
def test_a_target_without_edges_gets_0_beside_any_sink(backend, request):
    """0 on a row without edges, whatever its head's sink: +inf and NaN too (the cpu kernel
    added the sink's term exp(inf - inf) = NaN to the row's total)."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    q, k, v = (torch.randn(3, 3, 4, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    edge_index = torch.tensor([[0, 1], [0, 0]])  # targets 1 and 2 without edges
    sinks = torch.tensor([float("inf"), float("nan"), 2.0])
    out = edge_attention(q, k, v, edge_index, sinks=sinks, backend=backend)
    assert (out[1:] == 0).all()


@pytest.mark.parametrize("score", ["additive", "gatv2"])
def test_dense_backend_with_the_other_scores(score):
    inputs, edge_index = _inputs(score)
    want = outputs_and_grads("reference", inputs, edge_index, score=score)
    got = outputs_and_grads("dense", inputs, edge_index, score=score)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("graph", ["causal, equal blocks", "random multigraph"])
def test_dense_gradients_of_gradients(graph):
    """SDPA's backward recomputes its math path under create_graph=True: the sinks' key
    and the explicit softmax's column differentiate twice as the reference does."""
    edge_index = GRAPHS[graph]()
    n = int(edge_index.max()) + 1
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(n, 1, 3, generator=gen, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    sinks = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)

    def f(q, k, v, sinks):
        return edge_attention(q, k, v, edge_index, sinks=sinks, backend="dense",
                              return_attention="random" in graph)

    assert torch.autograd.gradgradcheck(f, (q, k, v, sinks))


def test_dense_attention_scale_of_zero():
    """Every score 0 but the sink's: SDPA's key cannot carry the sink then (its score is
    scale times the key), and the explicit softmax takes it."""
    inputs, edge_index = _inputs("dot", bias=False)
    want = outputs_and_grads("reference", inputs, edge_index, score="dot", scale=0.0)
    got = outputs_and_grads("dense", inputs, edge_index, score="dot", scale=0.0)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


def test_sdpa_sinks_at_the_ends_of_the_range():
    """The sink rides in a query channel as sink / scale: with a negative scale a sink of -inf
    (none) once made every score NaN (inf times the other keys' 0), and in fp16 a sink past
    65504 times the scale overflowed (NaN gradients) or was clamped (a wrong score, and a
    -inf sink that took the weight from scores below -65504 times the scale). SDPA's path
    against the explicit softmax (return_attention=True), outputs and gradients."""
    gen = torch.Generator().manual_seed(0)

    def both(q, k, v, sinks, **kwargs):
        results = []
        for weights in (False, True):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
            out = dense_attention(*leaves[:3], sinks=leaves[3], return_attention=weights,
                                  **kwargs)
            out = out[0] if weights else out
            results.append((out.detach(), *torch.autograd.grad(out.float().sum(), leaves)))
        return results

    q, k, v = (torch.randn(4, 2, 8, generator=gen) for _ in range(3))
    got, want = both(q, k, v, torch.tensor([float("-inf"), 0.0]), scale=-0.5)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)
    assert got[0].abs().amax() > 0  # (the head of no sink once came out 0)
    q, k, v = (torch.randn(1, 4, 1, 8, generator=gen).half() for _ in range(3))
    got, want = both(q, k, v, torch.tensor([100.0]).half(), scale=1e-3)  # sink / scale 1e5
    for a, b in zip(got, want, strict=True):
        assert not a.isnan().any()
        assert_close(a, b)
    bias = torch.full((1, 1, 4, 4), -30000.0).half()  # scores below -65504 times the scale
    no_sink = dense_attention(q, k, v, attn_bias=bias, sinks=torch.tensor([float("-inf")]).half())
    assert_close(no_sink, dense_attention(q, k, v, attn_bias=bias))


@pytest.mark.parametrize("scale", [5.0, 1e4])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_a_sink_of_minus_inf_is_no_sink_past_a_scale_of_1(dtype, scale):
    """v of other channels than q and k sends SDPA down its math path, which multiplies q by
    sqrt(scale) before the product: the channel that held -inf's stand-in, the dtype's lowest
    number, overflowed to -inf there, and -inf times the other keys' 0 made the head NaN. The
    head of a -inf sink is the head without sinks, on the dense backend and dense_attention."""
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(6, 2, 4, generator=gen).div(scale ** 0.5).to(dtype) for _ in range(2))
    v = torch.randn(6, 2, 3, generator=gen).to(dtype)
    sinks = torch.tensor([float("-inf"), 0.5], dtype=dtype)
    edge_index = graphs.complete_graph(6)
    got = edge_attention(q, k, v, edge_index, scale=scale, sinks=sinks, backend="dense")
    want = edge_attention(q, k, v, edge_index, scale=scale, backend="dense")
    assert not got.isnan().any()
    assert_close(got[:, 0], want[:, 0])
    assert_close(dense_attention(q, k, v, scale=scale, sinks=sinks), got)


@pytest.mark.parametrize("mask_shape", [(0, 0), (0, 3), (1, 3)],
                         ids=["no-keys", "rows", "broadcast-row"])
def test_dense_attention_with_sinks_and_no_queries(mask_shape):
    # (a mask of 0 rows once lost the row the sink's zero query needs: SDPA then refused the
    # shapes)
    q = torch.randn(0, 2, 4, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(mask_shape[-1], 2, 4, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)
    out = dense_attention(q, k, v, torch.ones(mask_shape, dtype=torch.bool), sinks=sinks)
    assert out.shape == (0, 2, 4)
    out.sum().backward()
    assert not sinks.grad.any() and not k.grad.any()


def test_auto_takes_the_dense_backend_with_sinks_too():
    q = torch.randn(64, 2, 8)
    edge_index = graphs.complete_graph(64)
    k, v, sinks = torch.randn(64, 2, 8), torch.randn(64, 2, 8), torch.randn(2)
    assert select_backend(q, edge_index) == "dense"
    assert_close(edge_attention(q, k, v, edge_index, sinks=sinks),
                 edge_attention(q, k, v, edge_index, sinks=sinks, backend="reference"))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must have shape \[H\] = \[2\], one score "
                                             r"per head, got \[3\]"),
    (dict(sinks=torch.zeros(1, 2)), ValueError, r"sinks must have shape \[H\] = \[2\]"),
    (dict(sinks=torch.zeros(2, dtype=torch.long)), TypeError, "sinks"),
])
def test_errors(kwargs, error, match):
    n = 4
    q, k, v = torch.randn(n, 2, 3), torch.randn(n, 2, 3), torch.randn(n, 2, 3)
    with pytest.raises(error, match=match):
        edge_attention(q, k, v, graphs.complete_graph(n), **kwargs)


@pytest.mark.parametrize("backend", ["cpu", "triton", "dense"])
def test_under_torch_compile(backend, request):
    """The fused backends' operators carry the sinks through torch.compile (fullgraph),
    forward and backward, and so does the dense backend's SDPA with its sink key."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    inputs, edge_index = _inputs("dot", dtype=torch.float32, n=8, num_edges=30)

    def attend(q, k, v, sinks, bias, edge_index):
        return edge_attention(q, k, v, edge_index, bias=bias, sinks=sinks, backend=backend,
                              return_attention=True)

    assert_compiles_as_it_runs(attend, inputs, edge_index)


def test_triton_operators_pass_opcheck(triton_interpreter):
    """torch's checks of the triton forward operator with sinks: schema, fake shapes, autograd
    (the sinks' gradient included)."""
    inputs, edge_index = _inputs("dot", dtype=torch.float32, n=6, num_edges=10)
    q, k, v, sinks, bias = inputs.values()
    args = (q, k, v, None, bias, None, edge_index, 0.5, 0.2, "dot", True, None, None, 0.0,
            sinks)
    torch.library.opcheck(tk._forward_op, args)


@pytest.mark.parametrize("how", ["mask", "causal", "bias", "weights", "batch", "dropout"])
def test_dense_attention_takes_sinks_as_edge_attention_does(how):
    """dense_attention(sinks=) on a mask, causally, with a bias of -inf entries (a row of a
    head left without keys gets 0), with the weights returned, per graph of a batch, and with
    dropout (graphattn's mask, drawn alike): what edge_attention computes on the same pairs."""
    B, L, H, C = 2, 10, 2, 4
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, L, H, C, generator=gen, dtype=torch.float64) * 2
               for _ in range(3))
    sinks = torch.tensor([0.8, -1.2], dtype=torch.float64)
    mask = (torch.rand(L, L, generator=gen) < 0.5) | torch.eye(L, dtype=torch.bool)
    if how == "batch":
        batch = torch.tensor([0] * 4 + [1] * 6)
        got = dense_attention(q[0], k[0], v[0], batch=batch, sinks=sinks)
        want = edge_attention(q[0], k[0], v[0], graphs.batch_complete_graph(batch),
                              sinks=sinks, backend="reference")
        assert_close(got, want)
        return
    options, edge_index, bias = {}, graphs.from_dense_mask(mask), None
    if how == "causal":
        options, edge_index = dict(is_causal=True), graphs.causal_graph(L)
    elif how == "bias":
        dense_bias = torch.randn(H, L, L, generator=gen, dtype=torch.float64)
        dense_bias[0, 3] = float("-inf")  # row 3 of head 0: no key
        options = dict(attn_bias=dense_bias)
        bias = dense_bias[:, edge_index[1], edge_index[0]].T  # (E, H)
    weights = how == "weights"
    dropout_p = 0.3 if how == "dropout" else 0.0
    torch.manual_seed(0)
    got = dense_attention(q, k, v, None if how == "causal" else mask, sinks=sinks,
                          return_attention=weights, dropout_p=dropout_p, **options)
    for b in range(B):
        torch.manual_seed(0)
        want = edge_attention(q[b], k[b], v[b], edge_index, bias=bias, sinks=sinks,
                              backend="reference", return_attention=weights)
        if weights:
            assert_close(got[1][b][:, edge_index[1], edge_index[0]].T, want[1])
            assert_close(got[0][b], want[0])
        elif not dropout_p:
            assert_close(got[b], want)
    if dropout_p:  # kept pairs scaled by 1 / (1 - p): between none and all of the weights
        plain = dense_attention(q, k, v, mask, sinks=sinks)
        assert (got - plain).abs().max() > 1e-3
        assert torch.isfinite(got).all()


@pytest.mark.parametrize("how", ["out", "weights", "bias, dropout", "inference"])
def test_block_sparse_kernels_take_sinks(triton_interpreter, how):
    """Inside launch_tiles(block_sparse=32) a call with sinks runs on the block kernels, whose
    forward starts each row at its sink as the CSR kernels' does: outputs and every gradient
    (the sinks' included) against the reference; with the weights returned, backward runs on
    the CSR kernels (as without sinks); with dropout, the kernels' seeded mask, written out
    for the reference; without a gradient, the inference launch."""
    from conftest import spy_on_launches

    edge_index = graphs.window_graph(64, 8)
    gen = torch.Generator().manual_seed(6)
    grad = how != "inference"
    q, k, v = (torch.randn(64, 2, 8, generator=gen).requires_grad_(grad) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0], requires_grad=grad)
    bias = (torch.randn(edge_index.size(1), 2, generator=gen).requires_grad_()
            if how == "bias, dropout" else None)
    leaves = [t for t in (q, k, v, sinks, bias) if t is not None and t.requires_grad]
    need_alpha = how == "weights"
    mask = (seeded_mask_parameters(0.3, device="cpu") if how == "bias, dropout" else None)
    results = []
    for backend in ("triton", "reference"):
        with pytest.MonkeyPatch.context() as patch, tk.launch_tiles(block_sparse=32):
            launches = spy_on_launches(patch, ("block_forward_kernel", "forward_kernel",
                                               "block_backward_target_kernel",
                                               "block_backward_source_kernel",
                                               "backward_target_kernel",
                                               "backward_source_kernel"))
            drop = mask
            if backend == "reference" and mask is not None:  # the kernels' mask, written out
                drop = seeded_mask_from(mask, (edge_index.size(1), 2), torch.float32)
            out, alpha = BACKENDS[backend](q, k, v, edge_index, scale=0.35, bias=bias,
                                           dropout_mask=drop, score="dot",
                                           negative_slope=0.2, need_alpha=need_alpha,
                                           sinks=sinks)
            loss = out.square().sum() + (alpha.square().sum() if need_alpha else 0.0)
            grads = torch.autograd.grad(loss, leaves) if grad else []
        results.append([out, *([alpha] if need_alpha else []), *grads])
        if backend == "triton":
            forward = [kw for name, _, kw in launches if name == "block_forward_kernel"]
            assert forward and all(kw["HAS_SINKS"] for kw in forward)
            assert not any(name == "forward_kernel" for name, *_ in launches)
    for a, b in zip(*results, strict=True):
        assert_close(a, b)


def test_block_sparse_operator_under_torch_compile(triton_interpreter):
    """The block kernels' operator carries the sinks through torch.compile (fullgraph):
    outputs and gradients as in eager, and torch's checks of the operator with sinks."""
    edge_index = graphs.window_graph(64, 8)
    gen = torch.Generator().manual_seed(7)
    inputs = {name: torch.randn(64, 2, 8, generator=gen).requires_grad_() for name in "qkv"}
    inputs["sinks"] = torch.tensor([0.5, -1.0], requires_grad=True)

    def attend(q, k, v, sinks, edge_index):
        return edge_attention(q, k, v, edge_index, sinks=sinks, backend="triton",
                              return_attention=True)

    with tk.launch_tiles(block_sparse=32):
        assert_compiles_as_it_runs(attend, inputs, edge_index)
    q, k, v, sinks = inputs.values()
    torch.library.opcheck(tb._block_forward_op, (q, k, v, None, None, edge_index, 0.35, 32,
                                                 False, sinks))
