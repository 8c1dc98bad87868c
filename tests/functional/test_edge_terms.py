"""Per-edge key and value terms of ``edge_attention`` on the CPU backends.

``edge_attention(..., edge_key=ek, edge_value=ev)`` attends with the key ``k[j] + ek[e]`` and the
value ``v[j] + ev[e]`` on each edge e = (j -> i). The truth is that definition written out with
every edge a source of its own (graph e -> i) through the reference backend without any term.
The ``cpu`` backend takes the terms in its kernels, ``reference`` per edge, and ``dense`` gets
them folded in (``graphattn.functional.edge_terms``): dot keys as a score bias, values as a sum
beside the operator, gatv2 keys with every edge a source.
"""

import pytest
import torch
from conftest import GRAPHS, assert_close, attention_inputs, random_graph

from graphattn.functional import dropout_mask, edge_attention, edge_terms
from graphattn.functional.attention import reference_edge_attention

TERMS = [("dot", "edge_key"), ("dot", "edge_value"), ("dot", "edge_key+edge_value"),
         ("gatv2", "edge_key"), ("gatv2", "edge_key+edge_value"), ("additive", "edge_value")]
# Every term a score takes. (Each combination of flags and channel counts compiles kernels of
# its own, several seconds each with an empty cache: the larger tests take these only.)
ALL_TERMS = [("dot", "edge_key+edge_value"), ("gatv2", "edge_key+edge_value"),
             ("additive", "edge_value")]


def edges_as_sources(inputs, edge_index, score, dropout_mask=None, scale=None,
                     negative_slope=0.2):
    """The definition: each edge a source with key k[j] + ek[e] and value v[j] + ev[e]
    (``scale``: edge_attention's default when ``None``)."""
    src, dst = edge_index
    ek, ev = inputs["edge_key"], inputs["edge_value"]
    k = inputs["k"][src] if ek is None else inputs["k"][src] + ek  # (E, H, C)
    v = inputs["v"][src] if ev is None else inputs["v"][src] + ev  # (E, H, C)
    sources = torch.stack([torch.arange(src.numel()), dst])  # (2, E): edge e -> its target
    if scale is None:
        scale = inputs["q"].size(-1) ** -0.5 if score == "dot" else 1.0
    return reference_edge_attention(inputs["q"], k, v, sources, scale=scale, bias=inputs["bias"],
                                    dropout_mask=dropout_mask, score=score,
                                    negative_slope=negative_slope, need_alpha=True,
                                    att=inputs["att"])


def out_alpha_and_grads(out, alpha, inputs):
    """out, alpha and every leaf's gradient of a fixed random loss on both."""
    gen = torch.Generator().manual_seed(3)
    loss = ((out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
            + (alpha * torch.randn(alpha.shape, generator=gen, dtype=alpha.dtype)).sum())
    leaves = [t for t in inputs.values() if t is not None]
    return [out, alpha, *torch.autograd.grad(loss, leaves)]


@pytest.mark.parametrize("backend", ["cpu", "reference", "dense"])
@pytest.mark.parametrize(("score", "terms"), TERMS, ids=["-".join(t) for t in TERMS])
@pytest.mark.parametrize("case", GRAPHS, ids=lambda g: g.name)
def test_edge_terms_equal_edges_as_sources(case, score, terms, backend, monkeypatch):
    """Outputs, attention weights and the gradients of q, k, v, att, bias and both terms on
    every graph of the registry (the dense fold in chunks of 2 edges)."""
    monkeypatch.setattr(edge_terms, "EDGE_CHUNK", 2)
    H, C = 2, 3
    inputs = attention_inputs(case.num_src, case.num_dst, case.edge_index.size(1), H, C,
                              score=score, terms=terms.split("+"), dtype=torch.float64)
    options = {n: t for n, t in inputs.items() if n not in ("q", "k", "v")}
    out, alpha = edge_attention(inputs["q"], inputs["k"], inputs["v"], case.edge_index,
                                score=score, backend=backend, return_attention=True, **options)
    expected = edges_as_sources(inputs, case.edge_index, score)
    for actual, truth in zip(out_alpha_and_grads(out, alpha, inputs),
                             out_alpha_and_grads(*expected, inputs), strict=True):
        assert_close(actual, truth)


@pytest.mark.parametrize("backend", ["cpu", "dense"])
@pytest.mark.parametrize(("score", "terms"), ALL_TERMS[:2],
                         ids=["-".join(t) for t in ALL_TERMS[:2]])
def test_edge_terms_with_dropout_use_the_dropped_weights(score, terms, backend):
    """With attention dropout the value term is weighted by the weights the operator used,
    and the key term's gradient flows through the kept edges only."""
    edge_index = random_graph(9, 40, seed=2)
    inputs = attention_inputs(9, 9, 40, 2, 3, score=score, terms=terms.split("+"),
                              dtype=torch.float64)
    options = {n: t for n, t in inputs.items() if n not in ("q", "k", "v")}
    torch.manual_seed(7)
    out, alpha = edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index, score=score,
                                backend=backend, return_attention=True, dropout_p=0.4,
                                **options)
    torch.manual_seed(7)
    mask = dropout_mask((40, 2), 0.4, dtype=torch.float64)  # the operator's draw
    expected = edges_as_sources(inputs, edge_index, score, dropout_mask=mask)
    for actual, truth in zip(out_alpha_and_grads(out, alpha, inputs),
                             out_alpha_and_grads(*expected, inputs), strict=True):
        assert_close(actual, truth)


@pytest.mark.parametrize("backend", ["cpu", "reference", "dense"])
@pytest.mark.parametrize(("score", "terms"), ALL_TERMS, ids=["-".join(t) for t in ALL_TERMS])
def test_edge_terms_with_a_scale_and_slope_of_their_own(score, terms, backend):
    """scale 0.7 and negative_slope 0.1 (not the defaults) reach the scores and every gradient
    of the edge terms' paths: the gatv2 key term's LeakyReLU and its derivative in backward."""
    case = next(g for g in GRAPHS if g.name == "multi-edges")
    inputs = attention_inputs(case.num_src, case.num_dst, case.edge_index.size(1), 2, 3,
                              score=score, terms=terms.split("+"), dtype=torch.float64, seed=4)
    options = {n: t for n, t in inputs.items() if n not in ("q", "k", "v")}
    out, alpha = edge_attention(inputs["q"], inputs["k"], inputs["v"], case.edge_index,
                                score=score, backend=backend, return_attention=True, scale=0.7,
                                negative_slope=0.1, **options)
    expected = edges_as_sources(inputs, case.edge_index, score, scale=0.7, negative_slope=0.1)
    for actual, truth in zip(out_alpha_and_grads(out, alpha, inputs),
                             out_alpha_and_grads(*expected, inputs), strict=True):
        assert_close(actual, truth)


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_edge_terms_under_autocast_keep_their_places(backend):
    """Under torch.autocast the key and value terms are cast to its dtype, each where it was
    given: the output and weights of bf16 inputs without autocast, bit for bit."""
    case = next(g for g in GRAPHS if g.name == "multi-edges")
    inputs = attention_inputs(case.num_src, case.num_dst, case.edge_index.size(1), 2, 3,
                              terms=("edge_key", "edge_value"), seed=4)
    half = {name: None if t is None else t.detach().bfloat16() for name, t in inputs.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = edge_attention(**inputs, edge_index=case.edge_index, backend=backend,
                             return_attention=True)
    want = edge_attention(**half, edge_index=case.edge_index, backend=backend,
                          return_attention=True)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w)


@pytest.mark.parametrize("backend", ["reference", "dense"])
def test_edge_terms_without_a_gradient_still_carry_those_of_q_k_v(backend, monkeypatch):
    """Constant edge terms (edge features that take no gradient): the gradients of q, k, v and
    bias still flow through the key term's score and the value term's weights."""
    monkeypatch.setattr(edge_terms, "EDGE_CHUNK", 2)
    case = next(g for g in GRAPHS if g.name == "multi-edges")
    inputs = attention_inputs(case.num_src, case.num_dst, case.edge_index.size(1), 2, 3,
                              terms=("edge_key", "edge_value"), dtype=torch.float64)
    inputs["edge_key"], inputs["edge_value"] = (inputs[n].detach()
                                                for n in ("edge_key", "edge_value"))
    options = {n: t for n, t in inputs.items() if n not in ("q", "k", "v")}
    leaves = {n: t for n, t in inputs.items() if t is not None and t.requires_grad}
    out, alpha = edge_attention(inputs["q"], inputs["k"], inputs["v"], case.edge_index,
                                backend=backend, return_attention=True, **options)
    expected = edges_as_sources(inputs, case.edge_index, "dot")
    for actual, truth in zip(out_alpha_and_grads(out, alpha, leaves),
                             out_alpha_and_grads(*expected, leaves), strict=True):
        assert_close(actual, truth)


LARGE_CASES = [(*terms, 12) for terms in ALL_TERMS] + [("gatv2", "edge_key+edge_value", 8)]


@pytest.mark.parametrize(("score", "terms", "channels"), LARGE_CASES,
                         ids=["-".join(map(str, case)) for case in LARGE_CASES])
def test_cpu_kernels_take_edge_terms_on_a_large_graph(score, terms, channels, two_threads):
    """float32 on 3000 nodes and 40000 edges: the kernels' two threads, prefetches and both channel
    layouts (12: read at run time, 8: a constant count, whose source pass has loops of its own
    for gatv2's key term) against the reference backend."""
    edge_index = random_graph(3000, 40000, seed=4)
    inputs = attention_inputs(3000, 3000, 40000, 2, channels, score=score,
                              terms=terms.split("+"))
    options = {n: t for n, t in inputs.items() if n not in ("q", "k", "v")}
    results = [out_alpha_and_grads(*edge_attention(
        inputs["q"], inputs["k"], inputs["v"], edge_index, score=score, backend=backend,
        return_attention=True, **options), inputs) for backend in ("cpu", "reference")]
    for actual, truth in zip(*results, strict=True):
        assert_close(actual, truth, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_one_tensor_as_key_and_value_term(score):
    """``edge_key=e, edge_value=e`` (TransformerConv's edge features): the cpu backend reads
    and differentiates the one tensor once, and its gradient is the sum of both roles."""
    edge_index = random_graph(9, 40, seed=6)
    inputs = attention_inputs(9, 9, 40, 2, 3, score=score, terms=("edge_key",),
                              dtype=torch.float64)
    inputs["edge_value"] = inputs["edge_key"]
    options = {n: t for n, t in inputs.items() if n not in ("q", "k", "v")}
    results = []
    for backend in ("cpu", "reference"):
        out, alpha = edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index,
                                    score=score, backend=backend, return_attention=True,
                                    **options)
        results.append(out_alpha_and_grads(out, alpha, {**inputs, "edge_value": None}))
    for actual, truth in zip(*results, strict=True):
        assert_close(actual, truth)


def test_edge_value_with_zero_channels_and_empty_scores():
    """C = 0 values (and dot scores over no channel) with terms: zeros of the right shapes."""
    edge_index = random_graph(5, 12, seed=1)
    q, k = torch.randn(5, 2, 0), torch.randn(5, 2, 0)
    v = torch.randn(5, 2, 0)
    out = edge_attention(q, k, v, edge_index, edge_key=torch.randn(12, 2, 0),
                         edge_value=torch.randn(12, 2, 0), backend="cpu")
    assert out.shape == (5, 2, 0)


def test_edge_term_errors():
    edge_index = random_graph(4, 6, seed=0)
    q = k = v = torch.randn(4, 2, 3)
    with pytest.raises(ValueError, match=r"edge_key needs the dot or gatv2 score.*"
                                         r"got score='additive'"):
        edge_attention(torch.randn(4, 2), torch.randn(4, 2), v, edge_index, score="additive",
                       edge_key=torch.randn(6, 2, 3))
    with pytest.raises(ValueError, match=r"edge_key must have shape \[E, H, C\] = \[6, 2, 3\] "
                                         r"like k per edge, got \[5, 2, 3\]"):
        edge_attention(q, k, v, edge_index, edge_key=torch.randn(5, 2, 3))
    with pytest.raises(ValueError, match=r"edge_value must have shape \[E, H, C\] = "
                                         r"\[6, 2, 3\] like v per edge, got \[6, 3\]"):
        edge_attention(q, k, v, edge_index, edge_value=torch.randn(6, 3))


def test_gatv2_key_term_in_the_source_pass_of_constant_channels():
    """8 channels: the source pass's loops over whole rows (constant channel counts) read
    gatv2's key term for d k; on a small graph, so that it also runs as Python
    (NUMBA_DISABLE_JIT=1) against the reference backend."""
    edge_index = random_graph(9, 40, seed=8)
    inputs = attention_inputs(9, 9, 40, 2, 8, score="gatv2", terms=("edge_key", "edge_value"))
    options = {n: t for n, t in inputs.items() if n not in ("q", "k", "v")}
    results = [out_alpha_and_grads(*edge_attention(
        inputs["q"], inputs["k"], inputs["v"], edge_index, score="gatv2", backend=backend,
        return_attention=True, **options), inputs) for backend in ("cpu", "reference")]
    for actual, truth in zip(*results, strict=True):
        assert_close(actual, truth)


@pytest.mark.parametrize("weights", [False, True], ids=["out", "out-and-weights"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_key_term_in_half_precision_is_scored_in_fp32_on_every_backend(dtype, weights):
    """The dense backend formed the key term q_i . ek_e in the inputs' dtype, and SDPA took it
    in a float mask of that dtype: rounded to bf16, scores near 36 moved by up to 0.125, and
    the output was off by 20x the reference's error. Every backend's output and gradients are
    as close to the float64 truth as the reference's."""
    C, E = 64, 8
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, C, generator=gen, dtype=torch.float64) * 3
    k = torch.zeros(E, 2, C, dtype=torch.float64)
    v = torch.randn(E, 2, C, generator=gen, dtype=torch.float64)
    ek = 0.5 * q + 0.3 * torch.randn(E, 2, C, generator=gen, dtype=torch.float64)  # scores ~36
    edge_index = torch.stack([torch.arange(E), torch.zeros(E, dtype=torch.long)])
    weight = torch.randn(1, 2, C, generator=gen, dtype=torch.float64)

    def run(backend, precision):
        leaves = [t.to(precision).requires_grad_() for t in (q, k, v, ek)]
        result = edge_attention(*leaves[:3], edge_index, edge_key=leaves[3], backend=backend,
                                return_attention=weights)
        out = result[0] if weights else result
        grads = torch.autograd.grad((out.double() * weight).sum(), leaves)
        return [out.double(), *(g.double() for g in grads)]

    truth = run("reference", torch.float64)
    reference = run("reference", dtype)
    for backend in ("cpu", "dense", "auto"):
        got = run(backend, dtype)
        for name, g, r, t in zip(("out", "dq", "dk", "dv", "dek"), got, reference, truth,
                                 strict=True):
            error, bound = (g - t).abs().max(), (r - t).abs().max()
            assert error <= 3 * bound, (backend, name, error.item(), bound.item())


@pytest.mark.parametrize("backend", ["cpu", "dense", "auto"])
def test_a_key_term_past_fp16s_range_before_the_scale_is_no_nan(backend):
    """q_i . ek_e = 102400 is inf in fp16, but the scaled score 12800 is not: the dense backend
    made the row NaN; every backend gives the weights 1 and 0, and v_0."""
    C = 64
    q = torch.full((1, 1, C), 40.0, dtype=torch.float16)
    k = torch.zeros(2, 1, C, dtype=torch.float16)
    v = torch.stack([torch.full((1, C), 1.0), torch.full((1, C), 2.0)]).half()
    ek = torch.stack([torch.full((1, C), 40.0), torch.full((1, C), -40.0)]).half()
    edge_index = torch.tensor([[0, 1], [0, 0]])
    out, alpha = edge_attention(q, k, v, edge_index, edge_key=ek, backend=backend,
                                return_attention=True)
    assert torch.equal(alpha, torch.tensor([[1.0], [0.0]], dtype=alpha.dtype))
    assert torch.equal(out, v[:1])
    assert torch.equal(edge_attention(q, k, v, edge_index, edge_key=ek, backend=backend), v[:1])
