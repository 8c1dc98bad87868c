import functools
import os
import re
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch
from conftest import (
    GRAPHS,
    PACKAGE_SPECIALISATION,
    SUITE_SPECIALISATION,
    assert_close,
    random_graph,
)

from graphattn.functional import cpu as cpu_module
from graphattn.functional import edge_attention, reference_edge_attention, select_backend
from graphattn.functional.cpu import cpu_edge_attention

H, C = 3, 4


def make_inputs(num_src, num_dst, num_edges, score="dot", dtype=torch.float32, seed=0,
                dropout=0.0, channels=C):
    """Random q, k, v, bias (all requiring grad) and a dropout multiplier like edge_attention's."""
    gen = torch.Generator().manual_seed(seed)
    shape = (H,) if score == "additive" else (H, channels)
    q = torch.randn(num_dst, *shape, generator=gen, dtype=dtype)
    k = torch.randn(num_src, *shape, generator=gen, dtype=dtype)
    v = torch.randn(num_src, H, channels, generator=gen, dtype=dtype)
    bias = torch.randn(num_edges, H, generator=gen, dtype=dtype)
    mask = None
    if dropout > 0:
        keep = torch.rand(num_edges, H, generator=gen, dtype=dtype) >= dropout
        mask = keep.to(dtype) / (1 - dropout)  # (E, H): 0 or 1/(1-p)
    return [t.requires_grad_() for t in (q, k, v, bias)], mask


def make_att(score, channels=C, dtype=torch.float32, seed=3):
    """gatv2's attention vector ``[H, channels]`` (requiring grad), ``None`` for other scores."""
    if score != "gatv2":
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(H, channels, generator=gen, dtype=dtype).requires_grad_()


def run(backend, q, k, v, edge_index, bias, mask, score, alpha_weight=None, need_alpha=True,
        att=None):
    """Output, alpha and the gradients of q, k, v, bias (and att) for a loss on out (and on
    alpha)."""
    out, alpha = backend(q, k, v, edge_index, scale=0.7, bias=bias, dropout_mask=mask,
                         score=score, negative_slope=0.2, need_alpha=need_alpha, att=att)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
    if alpha_weight is not None:
        loss = loss + (alpha * alpha_weight).sum()
    inputs = (q, k, v, bias) if att is None else (q, k, v, bias, att)
    grads = torch.autograd.grad(loss, inputs)
    return (out, *grads) if alpha is None else (out, alpha, *grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
@pytest.mark.parametrize("case", GRAPHS, ids=[g.name for g in GRAPHS])
def test_equals_reference_on_registry_graphs(case, score, dtype):
    E = case.edge_index.size(1)
    (q, k, v, bias), mask = make_inputs(case.num_src, case.num_dst, E, score, dtype, dropout=0.3)
    att = make_att(score, dtype=dtype)
    alpha_weight = torch.randn(E, H, dtype=dtype, generator=torch.Generator().manual_seed(1))
    ours = run(cpu_edge_attention, q, k, v, case.edge_index, bias, mask, score, alpha_weight,
               att=att)
    ref = run(reference_edge_attention, q, k, v, case.edge_index, bias, mask, score,
              alpha_weight, att=att)
    names = ("out", "alpha", "dq", "dk", "dv", "dbias", "datt")
    for name, a, b in zip(names, ours, ref, strict=False):
        assert a.dtype == dtype, name
        assert_close(a, b)


@pytest.mark.parametrize("need_alpha", [True, False])
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_equals_reference_on_a_skewed_random_graph(score, need_alpha, two_threads):
    # hubs with thousands of in-edges next to nodes with none, plus multi-edges and self-loops;
    # more rows + edges than MIN_PARALLEL_WORK, so that the thread pool (two threads) runs the
    # kernels
    n = 3000
    hubs = torch.stack([torch.randint(0, n, (6000,), generator=torch.Generator().manual_seed(2)),
                        torch.randint(0, 3, (6000,), generator=torch.Generator().manual_seed(3))])
    edge_index = torch.cat([random_graph(n, 30000, seed=4, num_dst=n // 2), hubs], dim=1)
    assert edge_index.size(1) + n > cpu_module.MIN_PARALLEL_WORK
    (q, k, v, bias), mask = make_inputs(n, n, edge_index.size(1), score, dropout=0.1)
    att = make_att(score)
    ours = run(cpu_edge_attention, q, k, v, edge_index, bias, mask, score, need_alpha=need_alpha,
               att=att)
    ref = run(reference_edge_attention, q, k, v, edge_index, bias, mask, score,
              need_alpha=need_alpha, att=att)
    for a, b in zip(ours, ref, strict=True):
        # d att sums over all 36,000 edges: float32 rounding grows with the sum
        assert_close(a, b, **({"atol": 1e-3, "rtol": 1e-4} if b.shape == (H, C) else {}))


def star_both_ways(num_edges):
    """Node 0 with ``num_edges`` in-edges (from 0..E-1) and as many out-edges (to 1..E): the
    longest row of both the target and the source pass."""
    j = torch.arange(num_edges)
    return torch.cat([torch.stack([j, torch.zeros_like(j)]),
                      torch.stack([torch.zeros_like(j), j + 1])], dim=1)


@pytest.mark.parametrize("score, channels, edge_terms", [
    ("dot", 16, "key and value"), ("gatv2", 4, "key"), ("additive", 16, None)])
def test_rows_longer_than_a_sum_block_equal_reference(score, channels, edge_terms):
    # rows of 2.5 SUM_BLOCKs, in float64 where both sum alike: the partial block sums of the
    # target and source passes add up to the whole, with edge terms, dropout and a loss on alpha
    E = 2 * cpu_module.SUM_BLOCK + cpu_module.SUM_BLOCK // 2
    edge_index = star_both_ways(E)
    (q, k, v, bias), mask = make_inputs(E + 1, E + 1, 2 * E, score, torch.float64, seed=6,
                                        dropout=0.2, channels=channels)
    att = make_att(score, channels=channels, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    edge_key = edge_value = None
    if edge_terms:
        edge_key = torch.randn(2 * E, H, channels, generator=gen,
                               dtype=torch.float64).requires_grad_()
        edge_value = edge_key if edge_terms == "key and value" else None
    alpha_weight = torch.randn(2 * E, H, generator=gen, dtype=torch.float64)
    inputs = [t for t in (q, k, v, bias, att, edge_key) if t is not None]
    results = []
    for backend in (cpu_edge_attention, reference_edge_attention):
        out, alpha = backend(q, k, v, edge_index, scale=0.7, bias=bias, dropout_mask=mask,
                             score=score, negative_slope=0.2, need_alpha=True, att=att,
                             edge_key=edge_key, edge_value=edge_value)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
        loss = loss + (alpha * alpha_weight).sum()
        results.append((out, alpha, *torch.autograd.grad(loss, inputs)))
    for a, b in zip(*results, strict=True):
        assert_close(a, b)


def test_long_rows_in_float32_are_summed_to_float64_accuracy():
    # One running float32 sum over a row of 2^15 edges was off by 3e-6 (out) and 3e-6 (the
    # source's grad v, summed over its out-edges); summed in blocks added in float64, by 4e-8
    # and 2e-7. Compared with the same kernels in float64.
    E, gen = 2**15, torch.Generator().manual_seed(0)
    edge_index = star_both_ways(E)
    q, k, v, w = (torch.randn(E + 1, H, C, generator=gen, dtype=torch.float64)
                  for _ in range(4))
    v = v + 1  # values of one sign: the sum does not cancel
    results = {}
    for dtype in (torch.float64, torch.float32):
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out, alpha = edge_attention(*inputs, edge_index, backend="cpu", return_attention=True)
        grads = torch.autograd.grad((out * w.to(dtype)).sum(), inputs)
        results[dtype] = (out[0], alpha[:E].sum(0) - 1, *(g[0] for g in grads))
    names = ("out", "sum alpha - 1", "grad q", "grad k", "grad v")
    bounds = (5e-7, 5e-7, 5e-5, 3e-6, 7e-7)
    for name, bound, single, double in zip(names, bounds, results[torch.float32],
                                           results[torch.float64], strict=True):
        error = (single.double() - double).norm() / double.norm().clamp_min(1)
        assert error < bound, (name, error.item())


@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_dropout_through_edge_attention_uses_the_same_mask(score):
    edge_index = random_graph(20, 120, seed=5)
    (q, k, v, _), _ = make_inputs(20, 20, 120, score)
    results = []
    for backend in ("cpu", "reference"):
        torch.manual_seed(7)
        out, alpha = edge_attention(q, k, v, edge_index, dropout_p=0.5, return_attention=True,
                                    backend=backend, score=score, att=make_att(score))
        results.append((out, alpha, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for a, b in zip(*results, strict=True):
        assert_close(a, b)


# (each case compiles kernels of its own: a few, to keep the suite's cold run short)
@pytest.mark.parametrize("score, edge_terms, dtype, ids", [
    ("dot", None, torch.float32, torch.int64), ("additive", None, torch.float32, torch.int64),
    ("gatv2", "key", torch.float32, torch.int64),
    ("dot", "key and value", torch.float32, torch.int32),
    ("dot", None, torch.float64, torch.int64)],
    ids=["dot", "additive", "gatv2-key", "dot-key-and-value-int32", "dot-fp64"])
def test_seeded_mask_is_the_written_mask_bit_for_bit(score, edge_terms, dtype, ids):
    """Given a seeded mask's parameters, the kernels draw each multiplier where they use it:
    outputs, weights and every gradient equal, bit for bit, those of the kernels reading the
    mask the parameters stand for (bias, a loss on the weights, edge terms, int32 ids)."""
    from graphattn.functional.dropout import seeded_mask, seeded_mask_parameters

    n, E = 40, 300
    edge_index = random_graph(n, E, seed=16).to(ids)
    (q, k, v, bias), _ = make_inputs(n, n, E, score, dtype=dtype, seed=2)
    att = make_att(score, dtype=dtype)
    gen = torch.Generator().manual_seed(17)
    edge_key = (torch.randn(E, H, C, generator=gen, dtype=dtype).requires_grad_()
                if edge_terms else None)
    edge_value = edge_key if edge_terms == "key and value" else None
    alpha_weight = torch.randn(E, H, generator=gen, dtype=dtype)
    inputs = [t for t in (q, k, v, bias, att, edge_key) if t is not None]
    torch.manual_seed(18)
    parameters = seeded_mask_parameters(0.3, device="cpu")
    mask = seeded_mask(parameters, (E, H), dtype)
    assert 0.2 < (mask == 0).double().mean() < 0.4

    def outputs_and_grads(dropout_mask):
        out, alpha = cpu_edge_attention(
            q, k, v, edge_index, scale=0.7, bias=bias, dropout_mask=dropout_mask, score=score,
            negative_slope=0.2, need_alpha=True, att=att, edge_key=edge_key,
            edge_value=edge_value)
        loss = ((out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum()
                + (alpha * alpha_weight).sum())
        return (out, alpha, *torch.autograd.grad(loss, inputs))

    for a, b in zip(outputs_and_grads(parameters), outputs_and_grads(mask), strict=True):
        assert torch.equal(a, b)


def test_seeded_mask_through_edge_attention_and_gradients_of_gradients():
    """``edge_attention`` hands the kernels a seeded mask in fp32 (no ``[E, H]`` mask), a
    written one in fp64; gradients of gradients through the seeded mask are the reference's
    with the mask written out."""
    from graphattn.functional import attention
    from graphattn.functional.dropout import seeded_mask, seeded_mask_parameters

    seen = []
    real = cpu_module.cpu_edge_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["dropout_mask"])
        return real(*args, **kwargs)

    edge_index = random_graph(20, 120, seed=5)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(attention.BACKENDS, "cpu", spy)
        for dtype in (torch.float32, torch.float64):
            (q, k, v, _), _ = make_inputs(20, 20, 120, dtype=dtype)
            edge_attention(q, k, v, edge_index, dropout_p=0.5, backend="cpu")
    assert seen[0].dtype == torch.int64 and seen[0].shape == (3,)
    assert seen[1].dtype == torch.float64 and seen[1].shape == (120, H)
    (q, k, v, _), _ = make_inputs(20, 20, 120, dtype=torch.float64)
    parameters = seeded_mask_parameters(0.5, device="cpu")
    results = []
    for backend, dropout_mask in ((cpu_edge_attention, parameters),
                                  (reference_edge_attention,
                                   seeded_mask(parameters, (120, H), torch.float64))):
        out, _ = backend(q, k, v, edge_index, scale=0.7, bias=None, dropout_mask=dropout_mask,
                         score="dot", negative_slope=0.2, need_alpha=False)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
        results.append(torch.autograd.grad(sum(g.square().sum() for g in grads), (q, k, v)))
    for a, b in zip(*results, strict=True):
        assert_close(a, b)


def test_training_with_dropout_and_evaluating_without_share_their_kernels(monkeypatch):
    """In fp32 the kernels take "no mask" as a placeholder of a seeded mask's type: a layer
    trained with dropout and evaluated without runs one compiled kernel per pass, where two
    types of mask argument would compile each kernel twice."""
    calls = []
    run_rows = cpu_module._run_rows

    def record(kernel, ptr, *args):
        calls.append((kernel, tuple(numba.typeof(a) for a in args)))
        return run_rows(kernel, ptr, *args)

    monkeypatch.setattr(cpu_module, "_run_rows", record)
    edge_index = random_graph(20, 120, seed=5)
    (q, k, v, _), _ = make_inputs(20, 20, 120)
    for training in (True, False):
        out = edge_attention(q, k, v, edge_index, dropout_p=0.5, training=training,
                             backend="cpu")
        out.sum().backward()
    assert len(calls) == 6  # forward, target pass and source pass of each
    for (kernel, types), (again, same_types) in zip(calls[:3], calls[3:], strict=True):
        assert kernel is again
        assert types == same_types


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_gradcheck_float64(score, with_mask):
    edge_index = torch.tensor([[0, 1, 2, 3, 1, 4, 4, 0, 0], [1, 1, 1, 0, 0, 2, 4, 1, 3]])
    (q, k, v, bias), mask = make_inputs(5, 5, 9, score, torch.float64,
                                        dropout=0.4 if with_mask else 0.0)
    att = make_att(score, dtype=torch.float64)

    def fn(q, k, v, bias, *att):
        return cpu_edge_attention(q, k, v, edge_index, scale=0.8, bias=bias, dropout_mask=mask,
                                  score=score, negative_slope=0.2, need_alpha=True,
                                  att=att[0] if att else None)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias) + (() if att is None else (att,)))


def test_scores_of_minus_infinity_give_zero_not_nan():
    edge_index = torch.tensor([[0, 1, 2, 0, 1], [0, 0, 0, 1, 1]])
    (q, k, v, bias), _ = make_inputs(3, 3, 5)
    bias = bias.detach().clone()
    bias[:3] = float("-inf")  # every in-edge of target 0 is masked
    bias[3, 0] = float("-inf")  # one edge of target 1 in head 0
    out, alpha = cpu_edge_attention(q, k, v, edge_index, scale=1.0, bias=bias,
                                    dropout_mask=None, score="dot", negative_slope=0.2,
                                    need_alpha=True)
    ref_out, ref_alpha = reference_edge_attention(q, k, v, edge_index, scale=1.0, bias=bias,
                                                  dropout_mask=None, score="dot",
                                                  negative_slope=0.2, need_alpha=True)
    assert (out[0] == 0).all() and (out[2] == 0).all() and (alpha[:3] == 0).all()
    assert_close(out, ref_out)
    assert_close(alpha, ref_alpha)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# each case compiles its own kernels (zero channels run as one padded channel): the padding of
# q, k and gatv2's att, of v, and of both
@pytest.mark.parametrize("qk_channels, v_channels, score",
                         [(0, 4, "gatv2"), (4, 0, "dot"), (0, 0, "dot")])
def test_zero_channels(qk_channels, v_channels, score):
    edge_index = random_graph(6, 20, seed=9)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(6, H, qk_channels, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(6, H, v_channels, generator=gen, requires_grad=True)
    bias = torch.randn(20, H, generator=gen, requires_grad=True)
    att = make_att(score, qk_channels)
    ours = run(cpu_edge_attention, q, k, v, edge_index, bias, None, score, att=att)
    ref = run(reference_edge_attention, q, k, v, edge_index, bias, None, score, att=att)
    for a, b in zip(ours, ref, strict=True):
        assert a.shape == b.shape
        assert_close(a, b)


@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
@pytest.mark.parametrize("qk_channels, v_channels", [(5, 3), (8, 8), (16, 5), (3, 64), (12, 20)])
def test_channel_counts_equal_reference(qk_channels, v_channels, score):
    # dot products of 8 lanes and a rest, and mixed score and value widths (in the package 8,
    # 16 and 64 compile as constants: test_specialised_kernels_agree_bit_for_bit_with_...)
    n, E = 40, 300
    edge_index = random_graph(n, E, seed=10)
    gen = torch.Generator().manual_seed(11)
    shape = (H,) if score == "additive" else (H, qk_channels)
    q, k = (torch.randn(n, *shape, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(n, H, v_channels, generator=gen, requires_grad=True)
    bias = torch.randn(E, H, generator=gen, requires_grad=True)
    mask = (torch.rand(E, H, generator=gen) >= 0.3).float() / 0.7
    alpha_weight = torch.randn(E, H, generator=gen)
    att = make_att(score, qk_channels)
    ours = run(cpu_edge_attention, q, k, v, edge_index, bias, mask, score, alpha_weight, att=att)
    ref = run(reference_edge_attention, q, k, v, edge_index, bias, mask, score, alpha_weight,
              att=att)
    for a, b in zip(ours, ref, strict=True):
        assert_close(a, b)


# Option sets the package compiles as constants, where the suite runs the variant that reads
# them all at run time (conftest.py): score, score and value channels, heads, bias, edge terms,
# dtype (float32 takes a seeded dropout mask, as edge_attention gives it, float64 a written one).
# Constant channels up to 8 take the source pass's whole-row branch, wider ones its per-head one.
SPECIALISED_OPTION_SETS = [
    ("dot", 8, 8, 2, True, None, torch.float32, None),
    ("dot", 16, 16, 1, False, "key and value", torch.float32, 3.0),
    ("dot", 5, 3, 3, True, "key", torch.float64, None),
    ("additive", 1, 4, 2, True, None, torch.float32, None),
    ("additive", 1, 16, 1, False, "value", torch.float64, None),
    ("gatv2", 8, 8, 1, True, "key", torch.float32, 2.0),
    ("gatv2", 4, 4, 3, False, None, torch.float64, None),
    ("gatv2", 16, 12, 2, True, "key and value", torch.float32, None),
]


@pytest.mark.parametrize("score, qk_channels, v_channels, heads, with_bias, edge_terms, dtype, "
                         "softcap", SPECIALISED_OPTION_SETS)
def test_specialised_kernels_agree_bit_for_bit_with_the_run_time_variant(
        monkeypatch, score, qk_channels, v_channels, heads, with_bias, edge_terms, dtype,
        softcap):
    """The kernels as the package compiles them (the score, bias, edge-term and cap flags, channel
    counts and one head as constants) give the outputs, weights and gradients of the variant
    that reads them at run time, bit for bit, through all three kernels: dropout, a loss on
    the weights, rows and columns longer than a SUM_BLOCK, isolated nodes. The rest of the
    suite tests that variant against the reference."""
    from graphattn.functional.dropout import seeded_mask_parameters

    n = 40
    long = star_both_ways(2 * cpu_module.SUM_BLOCK + 9)  # node 0: in- and out-edges
    edge_index = torch.cat([random_graph(n - 10, 300, seed=19), long], dim=1)  # 30..39: none
    E = edge_index.size(1)
    n = max(n, int(edge_index.max()) + 1)
    gen = torch.Generator().manual_seed(20)
    shape = (heads,) if score == "additive" else (heads, qk_channels)
    q, k = (torch.randn(n, *shape, generator=gen, dtype=dtype).requires_grad_()
            for _ in range(2))
    v = torch.randn(n, heads, v_channels, generator=gen, dtype=dtype).requires_grad_()
    bias = (torch.randn(E, heads, generator=gen, dtype=dtype).requires_grad_() if with_bias
            else None)
    att = (torch.randn(heads, qk_channels, generator=gen, dtype=dtype).requires_grad_()
           if score == "gatv2" else None)
    edge_key = edge_value = None
    if edge_terms in ("key", "key and value"):
        edge_key = torch.randn(E, *shape, generator=gen, dtype=dtype).requires_grad_()
    if edge_terms == "key and value":
        edge_value = edge_key
    if edge_terms == "value":
        edge_value = torch.randn(E, heads, v_channels, generator=gen,
                                 dtype=dtype).requires_grad_()
    torch.manual_seed(21)
    if dtype == torch.float32:
        mask = seeded_mask_parameters(0.3, device="cpu")
    else:
        mask = (torch.rand(E, heads, generator=gen, dtype=dtype) >= 0.3).to(dtype) / 0.7
    alpha_weight = torch.randn(E, heads, generator=gen, dtype=dtype)
    inputs = [t for t in (q, k, v, bias, att, edge_key, edge_value) if t is not None]

    def outputs_and_grads():
        out, alpha = cpu_edge_attention(
            q, k, v, edge_index, scale=0.7, bias=bias, dropout_mask=mask, score=score,
            negative_slope=0.2, need_alpha=True, att=att, edge_key=edge_key,
            edge_value=edge_value, softcap=softcap)
        loss = ((out * torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)).sum()
                + (alpha * alpha_weight).sum())
        return (out, alpha, *torch.autograd.grad(loss, inputs))

    compiled_for = []  # the arguments of each kernel factory called
    for name in ("_forward_kernel", "_backward_target_kernel", "_backward_source_kernel"):
        factory = getattr(cpu_module, name)
        monkeypatch.setattr(cpu_module, name, lambda *a, _f=factory: (
            compiled_for.append(a), _f(*a))[1])
    for option, value in PACKAGE_SPECIALISATION.items():
        monkeypatch.setattr(cpu_module, option, value)
    specialised = outputs_and_grads()
    for option, value in SUITE_SPECIALISATION.items():
        monkeypatch.setattr(cpu_module, option, value)
    run_time = outputs_and_grads()

    kind = cpu_module.SCORE_KINDS[score]
    has_ek = edge_key is not None
    flags = (kind, with_bias, has_ek, edge_value is not None, softcap is not None)
    constant_channels = (qk_channels in PACKAGE_SPECIALISATION["SPECIALISED_CHANNELS"],
                         v_channels in PACKAGE_SPECIALISATION["SPECIALISED_CHANNELS"])
    channels = tuple(c if constant else 0 for c, constant in
                     zip((qk_channels, v_channels), constant_channels, strict=True))
    one_head = 1 if heads == 1 else 0
    assert compiled_for[:3] == [
        (*flags, *channels, one_head), (*flags, *channels, one_head),
        (kind, has_ek and score == "gatv2", *cpu_module._source_channels(*channels), one_head)]
    # (the cap flag is a constant of every variant)
    generic = (cpu_module.RUN_TIME, False, False, False, softcap is not None, 0, 0, 0)
    assert compiled_for[3:] == [generic, generic, (cpu_module.RUN_TIME, False, 0, 0, 0)]
    for a, b in zip(specialised, run_time, strict=True):
        assert torch.equal(a, b)


def _reference_counts_on_cycles(llvm_ir: str) -> list[str]:
    """The ``NRT_incref``/``NRT_decref`` calls of the first ``graphattn`` function in
    ``llvm_ir`` that lie in a basic block on a cycle of its control flow graph (a loop),
    as ``"block: call"``."""
    start = llvm_ir.index("\ndefine ", llvm_ir.index("@_ZN9graphattn") - 300)
    body = llvm_ir[llvm_ir.index("{", llvm_ir.index("@_ZN9graphattn", start)) + 1:]
    body = body[:body.index("\n}\n")]
    label = re.compile(r'^"?([-\w.$]+)"?:', re.MULTILINE)
    names, texts = ["entry"], []
    last = 0
    for found in label.finditer(body):
        texts.append(body[last:found.start()])
        names.append(found.group(1))
        last = found.end()
    texts.append(body[last:])
    if not texts[0].strip():  # the entry block has a label of its own
        names, texts = names[1:], texts[1:]
    successors = {name: set(re.findall(r'\blabel %"?([-\w.$]+)"?', text))
                  for name, text in zip(names, texts, strict=True)}

    def on_a_cycle(block):
        seen, todo = set(), list(successors[block])
        while todo:
            node = todo.pop()
            if node == block:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(successors.get(node, ()))
        return False

    found = []
    for name, text in zip(names, texts, strict=True):
        calls = re.findall(r"call void @NRT_(?:incref|decref)\([^)]*\)", text)
        if calls and on_a_cycle(name):
            found += [f"{name}: {call}" for call in calls]
    return found


def test_reference_counts_helper_finds_calls_in_loops_only():
    """The helper on hand-written IR: a count in a loop body is found, those before and
    after the loop are not."""
    llvm_ir = """
define void @_ZN9graphattn4test(ptr %a) {
entry:
  call void @NRT_incref(ptr %a)
  br label %loop
loop:
  call void @NRT_decref(ptr %a)
  br i1 %c, label %loop, label %exit
exit:
  call void @NRT_decref(ptr %a)
  ret void
}
"""
    assert _reference_counts_on_cycles(llvm_ir) == ["loop: call void @NRT_decref(ptr %a)"]


@pytest.mark.parametrize("variant, score", [("run time", "dot"), ("package", "gatv2")])
def test_kernels_touch_no_reference_count_in_their_loops(monkeypatch, variant, score):
    """numba counts an array's references (atomic adds, through calls LLVM cannot see through)
    where an inlined function takes the array, and its pruning pass drops such pairs only
    where no branch it cannot resolve comes between them. In the variant that reads its flags
    at run time, a bias read and a score picked inside the functions the loops call left such
    counts per edge and head, and its forward took 5.3-8.0x the constant variants' time, now
    1.4-2.7x (benchmarks/cpu_specialisation.py). No count may be taken on a cycle of the three
    kernels' control flow graphs, for inputs that reach every flag's code (a bias, edge terms,
    seeded dropout), in the run-time variant and in one the package compiles."""
    from graphattn.functional.dropout import seeded_mask_parameters

    def uncached(inline="never"):  # compiled here, not loaded from a cache: its IR can be read
        return numba.njit(nogil=True, inline=inline)

    monkeypatch.setattr(cpu_module, "_jit", uncached)
    kernels = {}  # factory name -> {its arguments: the kernel}
    for name in ("_forward_kernel", "_backward_target_kernel", "_backward_source_kernel"):
        factory = functools.cache(getattr(cpu_module, name).__wrapped__)  # an empty cache

        def recording(*args, _factory=factory, _name=name):
            kernels.setdefault(_name, {})[args] = _factory(*args)
            return kernels[_name][args]
        monkeypatch.setattr(cpu_module, name, recording)
    switches = SUITE_SPECIALISATION if variant == "run time" else PACKAGE_SPECIALISATION
    for option, value in switches.items():
        monkeypatch.setattr(cpu_module, option, value)
    E = 60
    edge_index = random_graph(20, E, seed=4)
    gen = torch.Generator().manual_seed(5)
    q, k, v, edge_key = (torch.randn(n, 2, 8, generator=gen).requires_grad_()
                         for n in (20, 20, 20, E))
    bias = torch.randn(E, 2, generator=gen).requires_grad_()
    att = torch.randn(2, 8, generator=gen).requires_grad_() if score == "gatv2" else None
    torch.manual_seed(6)
    out, alpha = cpu_edge_attention(q, k, v, edge_index, bias=bias, edge_key=edge_key,
                                    edge_value=edge_key, need_alpha=True, score=score, att=att,
                                    scale=0.5, negative_slope=0.2,
                                    dropout_mask=seeded_mask_parameters(0.3, device="cpu"))
    (out.sum() + alpha.sum()).backward()
    if variant == "run time":
        generic = (cpu_module.RUN_TIME, False, False, False, False, 0, 0, 0)
        assert {name: list(made) for name, made in kernels.items()} == {
            "_forward_kernel": [generic], "_backward_target_kernel": [generic],
            "_backward_source_kernel": [(cpu_module.RUN_TIME, False, 0, 0, 0)]}
    else:
        assert [[args[0] for args in made] for made in kernels.values()] == [
            [cpu_module.GATV2]] * 3  # one variant of each kernel, compiled for gatv2
    for name, made in kernels.items():
        (kernel,) = made.values()
        (llvm_ir,) = kernel.inspect_llvm().values()  # one signature: the inputs above
        found = _reference_counts_on_cycles(llvm_ir)
        assert found == [], (name, found)


@pytest.mark.parametrize("value, specialised", [(None, True), ("1", True), ("0", False)])
def test_environment_switches_the_constant_variants(monkeypatch, value, specialised):
    if value is None:
        monkeypatch.delenv("GRAPHATTN_CPU_SPECIALISE", raising=False)
    else:
        monkeypatch.setenv("GRAPHATTN_CPU_SPECIALISE", value)
    assert cpu_module._specialise_from_environment() is specialised


def test_environment_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv("GRAPHATTN_CPU_SPECIALISE", "no")
    with pytest.raises(ValueError, match="GRAPHATTN_CPU_SPECIALISE must be 0 or 1, got 'no'"):
        cpu_module._specialise_from_environment()


def test_environment_switch_applies_at_import():
    """In fresh processes: the switches as the package sets them, and all off with
    GRAPHATTN_CPU_SPECIALISE=0 (as this suite's processes have them)."""
    show = ("from graphattn.functional import cpu; print(cpu.SPECIALISED_FLAGS, "
            "sorted(cpu.SPECIALISED_CHANNELS), sorted(cpu.SPECIALISED_HEADS))")
    seen = []
    for value in ("1", "0"):
        env = {**os.environ, "GRAPHATTN_CPU_SPECIALISE": value}
        done = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        seen.append(done.stdout.strip())
    assert seen == ["True [1, 2, 4, 8, 16, 32, 64, 128] [1]", "False [] []"]


def test_empty_edge_set_gives_zero_output_and_gradients():
    (q, k, v, _), _ = make_inputs(4, 6, 0)
    out = edge_attention(q, k, v, torch.empty(2, 0, dtype=torch.long), backend="cpu")
    assert out.shape == (6, H, C) and (out == 0).all()
    out.sum().backward()
    assert all((t.grad == 0).all() for t in (q, k, v))


@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_repeat_runs_and_thread_counts_are_bitwise_identical(score):
    n = 2000
    edge_index = random_graph(n, 40000, seed=6)
    (q, k, v, bias), mask = make_inputs(n, n, 40000, score, dropout=0.2)
    att = make_att(score)
    threads = torch.get_num_threads()
    results = []
    try:
        for num_threads in (2, 2, 1):  # the thread pool twice, then the caller's thread alone
            torch.set_num_threads(num_threads)
            results.append(run(cpu_edge_attention, q, k, v, edge_index, bias, mask, score,
                               att=att))
    finally:
        torch.set_num_threads(threads)
    for again in results[1:]:
        for a, b in zip(results[0], again, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32(dtype):
    edge_index = random_graph(10, 40, seed=7)
    (q, k, v, bias), _ = make_inputs(10, 10, 40, dtype=dtype)
    out, alpha = cpu_edge_attention(q, k, v, edge_index, scale=0.5, bias=bias, dropout_mask=None,
                                    score="dot", negative_slope=0.2, need_alpha=True)
    ref_out, ref_alpha = reference_edge_attention(
        *(t.float() for t in (q, k, v)), edge_index, scale=0.5, bias=bias.float(),
        dropout_mask=None, score="dot", negative_slope=0.2, need_alpha=True)
    assert out.dtype == dtype and alpha.dtype == dtype
    assert_close(out, ref_out.to(dtype))
    assert_close(alpha, ref_alpha.to(dtype))
    out.float().sum().backward()
    assert q.grad.dtype == dtype and bias.grad.dtype == dtype


def saved_tensor_sizes(fn):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


def test_autograd_keeps_no_per_edge_feature_tensor():
    n, E = 50, 2000  # E * H * C is far above anything of size N * H * C or E * H
    edge_index = random_graph(n, E, seed=8)
    (q, k, v, bias), mask = make_inputs(n, n, E, dropout=0.2)

    def call(backend):
        return lambda: backend(q, k, v, edge_index, scale=1.0, bias=bias, dropout_mask=mask,
                               score="dot", negative_slope=0.2, need_alpha=True)

    assert max(saved_tensor_sizes(call(reference_edge_attention))) >= E * H * C
    assert max(saved_tensor_sizes(call(cpu_edge_attention))) <= max(n * H * C, E * H)


def test_auto_picks_the_cpu_backend_for_sparse_graphs_on_cpu():
    q = torch.randn(1000, 2, 4)
    assert select_backend(q, random_graph(1000, 5000)) == "cpu"


def test_rejects_tensors_off_the_cpu():
    q = torch.empty(3, 2, 4, device="meta")
    with pytest.raises(ValueError, match="needs CPU tensors, got q on meta"):
        cpu_edge_attention(q, q, q, torch.zeros(2, 1, dtype=torch.long), scale=1.0, bias=None,
                           dropout_mask=None, score="dot", negative_slope=0.2, need_alpha=False)


@pytest.mark.parametrize("route", ["vmap", "jvp"])
def test_rejects_tensors_off_the_cpu_under_torch_func(route):
    """Under torch.func backend="cpu" runs the reference path, and still refuses what the
    kernels would: tensors off the CPU."""
    q = torch.empty(3, 2, 4, device="meta")

    def f(q):
        return edge_attention(q, q, q, torch.zeros(2, 0, dtype=torch.long, device="meta"),
                              backend="cpu")

    with pytest.raises(ValueError, match="needs CPU tensors, got q on meta"):
        if route == "vmap":
            torch.func.vmap(f)(q.expand(2, *q.shape))
        else:
            torch.func.jvp(f, (q,), (torch.ones_like(q),))


def test_compiles_without_a_cache_when_no_cache_directory_is_writable(monkeypatch):
    njit = numba.njit

    def njit_without_cache_dir(*args, cache=False, **kwargs):
        if cache:
            raise RuntimeError("cannot cache function: no locator available")
        return njit(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", njit_without_cache_dir)

    @cpu_module._jit()
    def add_one(x):
        return x + 1

    assert add_one(1) == 2


WITHOUT_JIT = """
import torch
from graphattn.functional import cpu, edge_attention, reference_edge_attention
assert cpu.numba.config.DISABLE_JIT
cpu.MIN_PARALLEL_WORK = 0  # the thread pool runs the Python kernels too
torch.set_num_threads(2)
gen = torch.Generator().manual_seed(0)
edge_index = torch.randint(0, 9, (2, 40), generator=gen)
for score in ("dot", "additive", "gatv2"):
    shape = (9, 2) if score == "additive" else (9, 2, 12)  # 12 channels: 8 lanes and 4 after
    q, k = (torch.randn(shape, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(9, 2, 12, generator=gen, requires_grad=True)
    att = torch.randn(2, 12, generator=gen, requires_grad=True) if score == "gatv2" else None
    ek = None if score == "additive" else torch.randn(40, 2, 12, generator=gen)
    results = []
    for backend in ("cpu", "reference"):
        out, alpha = edge_attention(q, k, v, edge_index, backend=backend, score=score, att=att,
                                    edge_key=ek, return_attention=True)
        results.append((out, alpha, *torch.autograd.grad(out.sin().sum() + alpha.sum(),
                                                         (q, k, v))))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b)
print("same as reference")
"""


def test_runs_as_python_under_numba_disable_jit():
    """NUMBA_DISABLE_JIT=1, numba's switch for debugging jitted code as Python, applies to the
    whole process: the kernels run as Python then, where numba's intrinsics cannot be called.
    In a fresh process: numba reads the switch when it is imported."""
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    done = subprocess.run([sys.executable, "-c", WITHOUT_JIT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same as reference" in done.stdout


PAST_THE_LABEL_LIMIT = """
import torch
from numba.core import ir_utils
from graphattn.functional import edge_attention
gen = torch.Generator().manual_seed(0)
edge_index = torch.randint(0, 9, (2, 40), generator=gen)
q, k = (torch.randn(9, 2, 11, generator=gen, requires_grad=True) for _ in range(2))
v = torch.randn(9, 2, 13, generator=gen, requires_grad=True)
att = torch.randn(2, 11, generator=gen, requires_grad=True)
bias = torch.randn(40, 2, generator=gen, requires_grad=True)
# the block-label counter as about 200 kernel variants compiled in one process leave it
ir_utils._the_max_label._value = 10**1100
results = []
for backend in ("cpu", "reference"):
    out = edge_attention(q, k, v, edge_index, bias=bias, att=att, score="gatv2", backend=backend)
    results.append((out, *torch.autograd.grad(out.sin().sum(), (q, k, v, att, bias))))
for a, b in zip(*results, strict=True):
    torch.testing.assert_close(a, b)
print("same as reference")
"""


def test_compiles_after_numba_block_labels_grew_past_llvm_name_limit(tmp_path):
    """numba's process-wide block-label counter grows by some 5 digits with each kernel variant
    compiled; past about 1000 digits the labels pass LLVM's limit on names and compiles fail.
    In a fresh process with an empty cache, so that the kernels really compile (as the package
    compiles them, quicker than the suite's variant): they do, and agree with the reference."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "GRAPHATTN_CPU_SPECIALISE": "1"}
    done = subprocess.run([sys.executable, "-c", PAST_THE_LABEL_LIMIT], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same as reference" in done.stdout


def test_block_label_counter_starts_again_only_past_its_limit():
    counter = numba.core.ir_utils._the_max_label
    saved = counter._value
    try:
        counter._value = cpu_module.LABEL_LIMIT
        cpu_module._bound_block_labels()
        assert counter._value == cpu_module.LABEL_LIMIT
        counter._value = cpu_module.LABEL_LIMIT + 1
        cpu_module._bound_block_labels()
        assert counter._value == 0
    finally:
        counter._value = max(saved, counter._value)


def test_float32_exp_of_the_kernels_is_within_one_ulp():
    @numba.njit
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = cpu_module._exp(x[i])

    x = np.linspace(-87, 88, 200_001, dtype=np.float32)
    out = np.empty_like(x)
    apply(x, out)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(out - exact) / ulp).max() <= 1.0
    special = np.array([-np.inf, -1000.0, -88.0, 0.0, -0.0, 89.0, np.inf, np.nan], np.float32)
    out = np.empty_like(special)
    apply(special, out)
    # 0 where expf gives 0 or a subnormal, inf where it overflows, NaN stays NaN
    assert out[:3].tolist() == [0.0, 0.0, 0.0] and out[3:5].tolist() == [1.0, 1.0]
    assert np.isinf(out[5:7]).all() and np.isnan(out[7])
    apply64 = np.empty(3)
    apply(np.array([-1.0, 0.0, 2.0]), apply64)  # float64 goes to np.exp
    assert apply64.tolist() == np.exp([-1.0, 0.0, 2.0]).tolist()


def test_float32_tanh_of_the_soft_cap_is_within_two_ulp():
    @numba.njit
    def apply(x, out):
        for i in range(x.shape[0]):
            a = np.abs(x[i])
            out[i] = cpu_module._tanh(x[i], a, cpu_module._exp(-(a + a)))

    x = np.concatenate([np.linspace(-20, 20, 400_001, dtype=np.float32),
                        np.geomspace(1e-30, 1, 2001, dtype=np.float32)])
    out = np.empty_like(x)
    apply(x, out)
    exact = np.tanh(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert (np.abs(out - exact) / ulp).max() <= 2.0
    special = np.array([-np.inf, -100.0, 0.0, -0.0, 100.0, np.inf, np.nan], np.float32)
    out = np.empty_like(special)
    apply(special, out)
    assert out[:6].tolist() == [-1.0, -1.0, 0.0, 0.0, 1.0, 1.0] and np.isnan(out[6])
    apply64 = np.empty(3)
    apply(np.array([-1.0, 0.0, 2.0]), apply64)  # float64 goes to np.tanh
    assert apply64.tolist() == np.tanh([-1.0, 0.0, 2.0]).tolist()


def sum_in_eight_lanes(terms: np.ndarray):
    """The kernels' order of summing the ``n`` channel terms of a score: below 8 one running
    sum; else lane l sums channels l, l + 8, l + 16, ... of the first ``8 * (n // 8)``, the lanes
    are added pairwise, then the rest in order."""
    if terms.size < 8:
        total = terms[0]
        for x in terms[1:]:
            total = total + x
        return total
    blocks = terms.size // 8
    lanes = terms[:8].copy()
    for block in range(1, blocks):
        lanes = lanes + terms[8 * block:8 * block + 8]
    total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
        (lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    for x in terms[8 * blocks:]:
        total = total + x
    return total


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [3, 8, 12, 16, 40])
def test_dot_products_sum_in_eight_lanes_in_a_fixed_order(n, dtype):
    @numba.njit
    def dot(a, b, start, n):
        return cpu_module._dot(a, 0, b, 1, start, n)

    rng = np.random.default_rng(n)
    a = rng.standard_normal((1, n + 3)).astype(dtype)
    b = rng.standard_normal((2, n + 3)).astype(dtype)
    products = a[0, 3:] * b[1, 3:]  # (n,), from channel 3 on
    got = dot(a, b, 3, n)
    assert got == sum_in_eight_lanes(products)  # bit for bit (numba returns a Python float)


@pytest.mark.parametrize("edge_key", [False, True], ids=["", "edge-key"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [3, 8, 12, 16, 40])
def test_gatv2_scores_sum_in_eight_lanes_in_a_fixed_order(n, dtype, edge_key):
    @numba.njit
    def gatv2(q, k, ek, att, start, n, slope):
        if ek is None:
            return cpu_module._gatv2_dot(q, 0, k, 1, att, start, n, slope)
        return cpu_module._gatv2_edge_dot(q, 0, k, 1, ek, 2, att, start, n, slope)

    rng = np.random.default_rng(n)
    q = rng.standard_normal((1, n + 3)).astype(dtype)
    k = rng.standard_normal((2, n + 3)).astype(dtype)
    q[0, 4], k[1, 4] = 0, 0  # a pre-activation of exactly 0 takes the slope
    ek = rng.standard_normal((3, n + 3)).astype(dtype) if edge_key else None
    att = rng.standard_normal(n + 3).astype(dtype)
    slope = dtype(0.2)
    z = q[0, 3:] + (k[1, 3:] if ek is None else k[1, 3:] + ek[2, 3:])  # (n,), from channel 3
    terms = att[3:] * np.where(z > 0, z, z * slope)
    assert gatv2(q, k, ek, att, 3, n, slope) == sum_in_eight_lanes(terms)  # bit for bit


@pytest.mark.parametrize("score", ["additive", "gatv2"])
def test_leaky_relu_at_zero_takes_the_negative_slope_as_torch(score):
    # pre-activations of exactly 0 (additive: q + k + bias, gatv2: q + k in channel 0), where
    # torch's LeakyReLU has the derivative negative_slope, not 1
    case = next(g for g in GRAPHS if g.name == "complete")
    E = case.edge_index.size(1)
    (q, k, v, bias), mask = make_inputs(case.num_src, case.num_dst, E, score, torch.float64,
                                        dropout=0.3)
    with torch.no_grad():
        if score == "additive":
            q.zero_(), k.zero_(), bias[::2].zero_()  # (E, H): every other edge at 0
        else:
            q[..., 0], k[..., 0] = 0.0, 0.0
    att = make_att(score, dtype=torch.float64)
    alpha_weight = torch.randn(E, H, dtype=torch.float64,
                               generator=torch.Generator().manual_seed(1))
    ours = run(cpu_edge_attention, q, k, v, case.edge_index, bias, mask, score, alpha_weight,
               att=att)
    ref = run(reference_edge_attention, q, k, v, case.edge_index, bias, mask, score,
              alpha_weight, att=att)
    for a, b in zip(ours, ref, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("wanted", ["q", "k", "v", "bias"])
@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_gradient_of_one_input_alone(score, wanted):
    # only one input requires grad: the source pass (dk, dv) runs for k or v alone, and not
    # otherwise
    edge_index = random_graph(9, 30, seed=13)
    (q, k, v, bias), mask = make_inputs(9, 9, 30, score, torch.float64, dropout=0.3)
    att = make_att(score, dtype=torch.float64)
    tensors = {"q": q, "k": k, "v": v, "bias": bias}
    for name, t in tensors.items():
        tensors[name] = t.detach().requires_grad_(name == wanted)
    if att is not None:
        att = att.detach()
    grads = []
    for backend in (cpu_edge_attention, reference_edge_attention):
        out, alpha = backend(tensors["q"], tensors["k"], tensors["v"], edge_index, scale=0.7,
                             bias=tensors["bias"], dropout_mask=mask, score=score,
                             negative_slope=0.2, need_alpha=True, att=att)
        loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
        grads.append(torch.autograd.grad(loss + alpha.square().sum(), tensors[wanted]))
    assert_close(grads[0][0], grads[1][0])


def test_balanced_chunks_cover_every_row_with_equal_work():
    degrees = np.random.default_rng(0).integers(0, 12, 200)  # (200,), with empty rows
    ptr = np.concatenate([[0], np.cumsum(degrees)])  # (201,)
    parts = 8
    bounds = cpu_module._balanced_chunks(ptr, parts)
    rows = ptr.shape[0] - 1
    assert bounds[0] == 0 and bounds[-1] == rows and (np.diff(bounds) > 0).all()
    assert len(bounds) - 1 <= parts
    work = ptr + np.arange(rows + 1)  # rows + edges before each row
    largest_row = np.diff(work).max()
    # each chunk ends at the first row boundary past its share of the work
    assert (np.diff(work[bounds]) <= work[-1] / parts + largest_row).all()


def star_of_degree(degree):
    """Node 0 with ``degree`` in-edges (from 1..degree) and as many out-edges (to 1..degree),
    no self-loop: a target and a source of exactly ``degree`` edges each."""
    j = torch.arange(1, degree + 1)
    return torch.cat([torch.stack([j, torch.zeros_like(j)]),
                      torch.stack([torch.zeros_like(j), j])], dim=1)


@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_rows_of_exactly_one_sum_block_equal_reference(score):
    """A target and a source of exactly SUM_BLOCK edges: their one block ends where the row
    ends, so the backward passes must keep it out of the float64 block sums (``block +
    SUM_BLOCK < stop``), as for any row of one block. Rows of 2.5 blocks and short rows do not
    tell ``<`` from ``<=`` there; with ``<=`` the target's grad q and the source's grad k and
    grad v come out 0. In float64 against the reference, with dropout and a loss on alpha."""
    B = cpu_module.SUM_BLOCK
    edge_index = star_of_degree(B)
    (q, k, v, bias), mask = make_inputs(B + 1, B + 1, 2 * B, score, torch.float64, seed=8,
                                        dropout=0.2)
    att = make_att(score, dtype=torch.float64)
    alpha_weight = torch.randn(2 * B, H, generator=torch.Generator().manual_seed(9),
                               dtype=torch.float64)
    ours = run(cpu_edge_attention, q, k, v, edge_index, bias, mask, score, alpha_weight, att=att)
    ref = run(reference_edge_attention, q, k, v, edge_index, bias, mask, score, alpha_weight,
              att=att)
    for a, b in zip(ours, ref, strict=True):
        assert_close(a, b)


def test_target_sort_is_stable():
    """``_csr`` is a stable counting sort of the edges by target: each target's in-edges keep
    the order of their edge ids. That order is the one each row's sums run in, so it fixes the
    bits of the results, which the comparisons with the reference (within a tolerance) do not
    see. Against numpy's stable argsort, with a last target of no in-edge."""
    rng = np.random.default_rng(3)
    src, dst = rng.integers(0, 7, 80), rng.integers(0, 6, 80)
    rowptr, perm, src_sorted = cpu_module._csr(src, dst, 7)
    order = np.argsort(dst, kind="stable")  # CSR position -> edge id
    np.testing.assert_array_equal(rowptr, np.r_[0, np.cumsum(np.bincount(dst, minlength=7))])
    np.testing.assert_array_equal(perm, order)
    np.testing.assert_array_equal(src_sorted, src[order])


def test_csr_transpose_keeps_the_rows_ascending_within_each_column():
    """``csr_transpose`` (``_csc``: the source order of backward, and sparse_linear's
    transpose) is a stable counting sort of the entries by column: within a column they keep
    their CSR order, so their rows ascend, as its docstring says. Against numpy's stable
    argsort, with a last column of no entry."""
    rng = np.random.default_rng(4)
    rows = np.sort(rng.integers(0, 6, 50))  # the row of each CSR entry
    col = rng.integers(0, 9, 50)
    crow = np.r_[0, np.cumsum(np.bincount(rows, minlength=6))]
    colptr, position, row = cpu_module.csr_transpose(torch.from_numpy(crow),
                                                     torch.from_numpy(col), 10)
    order = np.argsort(col, kind="stable")  # position in the transpose -> CSR entry
    np.testing.assert_array_equal(colptr.numpy(),
                                  np.r_[0, np.cumsum(np.bincount(col, minlength=10))])
    np.testing.assert_array_equal(row.numpy(), rows[order])
    np.testing.assert_array_equal(position.numpy()[order], np.arange(50))
