"""The block-sparse Triton kernels (``launch_tiles(block_sparse=B)``) against the reference backend.

Run in Triton's CPU interpreter, or with ``GRAPHATTN_TRITON_DEVICE=cuda`` compiled on a GPU (see
``conftest.py``). The truth is :func:`reference_edge_attention` in float64 on the same inputs;
every call that should take the block kernels is made under a spy that has only those kernels,
so a call that fell back to the CSR kernels fails instead of passing unnoticed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    DEVICE,
    GRAPHS,
    assert_close,
    assert_results_close,
    attention_inputs,
    needs_triton,
    on_device,
    record_out_dtypes,
    spy_on_launches,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphattn.functional import edge_attention, reference_edge_attention
from graphattn.functional import triton_blocks as tb
from graphattn.functional import triton_kernels as tk
from graphattn.functional.dropout import mask_tensor, seeded_mask_parameters
from graphattn.graphs import causal_graph, complete_graph, grid_graph, to_dense_mask, window_graph

BLOCK_KERNELS = ("block_forward_kernel", "block_backward_target_kernel",
                 "block_backward_source_kernel")
CSR_KERNELS = ("forward_kernel", "backward_target_kernel", "backward_source_kernel")


@pytest.fixture(autouse=True)
def any_fill(monkeypatch):
    """The graphs here are small, with tiles mostly empty (one edge in a tile of 64 x 64): the
    block kernels take them whatever their fill (``test_empty_tiles_keep_to_the_csr_kernels``
    checks the rule with its default)."""
    monkeypatch.setattr(tb, "MIN_FILL", 0.0)


def distinct_random_edges(num_src: int, num_dst: int, num_edges: int, seed: int = 0):
    """``num_edges`` distinct random edges, sources in ``[0, num_src)``, targets in
    ``[0, num_dst)``."""
    gen = torch.Generator().manual_seed(seed)
    pairs = torch.randperm(num_src * num_dst, generator=gen)[:num_edges]
    return torch.stack([pairs % num_src, pairs // num_src])


# name -> (edge_index, num_src, num_dst): structured graphs with dense tiles, sizes that are not
# multiples of the tile, a bipartite graph with isolated targets, a row of degree 200
STRUCTURED = {
    "window-70-r3": (window_graph(70, 3), 70, 70),
    "causal-40": (causal_graph(40), 40, 40),
    "grid-6x7": (grid_graph(6, 7), 42, 42),
    "complete-75": (complete_graph(75), 75, 75),
    "random-bipartite": (distinct_random_edges(45, 70, 300, seed=3), 45, 70),
    "star-200": (torch.stack([torch.arange(1, 201), torch.zeros(200, dtype=torch.long)]),
                 201, 201),
}
SINGLE_EDGES = [g for g in GRAPHS if "multi-edge" not in g.tags]


def run(inputs, edge_index, *, block=None, scale=0.5, compute_dtype=None, seed=1,
        create_graph=False, leaves=None, dropout_mask=None):
    """out and the gradients of a fixed random loss: on the block kernels (``block``) or on the
    reference backend (computed in ``compute_dtype``), on ``DEVICE``, with respect to fresh
    copies of the inputs there (or to ``leaves``, a dict of them); ``dropout_mask`` ``[E, H]``
    multiplies the weights (a seeded mask's parameters: the kernels draw it, the reference gets
    it written out)."""
    if leaves is None:
        leaves = {n: t for n, t in on_device(inputs).items() if t is not None}
    cast = {n: (t.to(compute_dtype) if compute_dtype else t) for n, t in leaves.items()}
    args = (cast["q"], cast["k"], cast["v"], edge_index.to(DEVICE))
    if dropout_mask is not None and block is None:
        dropout_mask = mask_tensor(dropout_mask, edge_index.size(1), inputs["v"].size(1))
    if dropout_mask is not None and dropout_mask.is_floating_point():
        dropout_mask = dropout_mask.to(DEVICE, compute_dtype or torch.float32)
    options = dict(scale=scale, bias=cast.get("bias"), dropout_mask=dropout_mask, score="dot",
                   negative_slope=0.2, need_alpha=False)
    if block is None:
        out, _ = reference_edge_attention(*args, **options)
    else:
        with tk.launch_tiles(block_sparse=block):
            out, _ = tk.triton_edge_attention(*args, **options)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    grads = torch.autograd.grad((out.double() * weight).sum(), list(leaves.values()),
                                create_graph=create_graph)
    return {"out": out, **{"d" + n: g for n, g in zip(leaves, grads, strict=True)}}


def check_blocks(monkeypatch, inputs, edge_index, *, block, dtype=torch.float32, scale=0.5,
                 dropout_mask=None):
    """The block kernels (all three launched, nothing else) against the float64 reference."""
    launches = spy_on_launches(monkeypatch, BLOCK_KERNELS)
    got = run(inputs, edge_index, block=block, scale=scale, dropout_mask=dropout_mask)
    assert {name for name, *_ in launches} == set(BLOCK_KERNELS)
    assert all(kw["HAS_DROP"] == (dropout_mask is not None) for _, _, kw in launches)
    monkeypatch.undo()
    want = run(inputs, edge_index, scale=scale, compute_dtype=torch.float64,
               dropout_mask=dropout_mask)
    assert got["out"].dtype == inputs["v"].dtype
    assert_results_close(got, want, inputs, dtype)
    return got


@needs_triton
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("name", list(STRUCTURED))
def test_matches_reference_on_structured_graphs(interpreter, monkeypatch, name, block, bias):
    edge_index, num_src, num_dst = STRUCTURED[name]
    inputs = attention_inputs(num_src, num_dst, edge_index.size(1), 2, 8, bias=bias)
    check_blocks(monkeypatch, inputs, edge_index, block=block)


@needs_triton
def test_matches_reference_on_graph_registry(interpreter, monkeypatch, graph_case):
    if "multi-edge" in graph_case.tags:
        pytest.skip("a tile entry holds one edge: repeated edges take the CSR kernels "
                    "(test_falls_back_to_the_csr_kernels)")
    ei = graph_case.edge_index
    inputs = attention_inputs(graph_case.num_src, graph_case.num_dst, ei.size(1), 2, 8)
    got = check_blocks(monkeypatch, inputs, ei, block=32)
    isolated = torch.ones(graph_case.num_dst, dtype=torch.bool)
    isolated[ei[1]] = False
    assert (got["out"][isolated.to(DEVICE)] == 0).all()


@needs_triton
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("block", [32, 64])
@pytest.mark.parametrize("name", ["window-70-r3", "causal-40", "random-bipartite"])
@pytest.mark.parametrize("kind", ["read", "seeded"])
def test_dropout_mask_multiplies_the_weights(interpreter, monkeypatch, kind, name, block, bias):
    """A dropout mask ``[E, H]`` (0 or 1 / (1 - p), read at each tile entry's edge id, or
    drawn there from a seed) multiplies the weights: out and gradients are the reference's
    with the same mask."""
    edge_index, num_src, num_dst = STRUCTURED[name]
    num_edges = edge_index.size(1)
    inputs = attention_inputs(num_src, num_dst, num_edges, 2, 8, bias=bias)
    gen = torch.Generator().manual_seed(7)
    if kind == "seeded":
        torch.manual_seed(7)
        mask = seeded_mask_parameters(0.3, device=DEVICE)
    else:
        mask = (torch.rand(num_edges, 2, generator=gen) > 0.3).float() / 0.7
    check_blocks(monkeypatch, inputs, edge_index, block=block, dropout_mask=mask)


@needs_triton
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("through_alpha", [False, True], ids=["loss-on-out", "loss-on-alpha"])
@pytest.mark.parametrize("per_edge", ["none", "bias+dropout"])
def test_returned_weights(interpreter, monkeypatch, per_edge, through_alpha, compiled):
    """The weights, returned, are the reference's; the block forward kernel writes the scores.
    A loss on out alone runs the block kernels backward; a loss on the weights too runs the
    CSR kernels' backward (which takes the weights' gradient) on the block kernels' out and
    lse; the gradients are the reference's either way, in eager mode and under
    ``torch.compile`` (the operators). Compiled, the weights' gradient comes as zeros when the
    loss does not use them, so that backward runs the CSR kernels too."""
    edge_index, num_src, num_dst = STRUCTURED["window-70-r3"]
    num_edges = edge_index.size(1)
    inputs = attention_inputs(num_src, num_dst, num_edges, 2, 8, bias=per_edge != "none")
    mask = None
    if per_edge != "none":
        gen = torch.Generator().manual_seed(5)
        mask = ((torch.rand(num_edges, 2, generator=gen) > 0.3).float() / 0.7).to(DEVICE)
    leaves = {n: t for n, t in on_device(inputs).items() if t is not None}
    edge_index = edge_index.to(DEVICE)
    gen = torch.Generator().manual_seed(6)
    w_out = torch.randn(num_dst, 2, 8, generator=gen, dtype=torch.float64).to(DEVICE)
    w_alpha = torch.randn(num_edges, 2, generator=gen, dtype=torch.float64).to(DEVICE)

    def attend(fn, dtype):
        cast = {n: t.to(dtype) for n, t in leaves.items()}
        out, alpha = fn(cast["q"], cast["k"], cast["v"], edge_index, scale=0.5,
                        bias=cast.get("bias"), dropout_mask=None if mask is None
                        else mask.to(dtype), score="dot", negative_slope=0.2,
                        need_alpha=True)
        loss = (out.double() * w_out).sum()
        if through_alpha:
            loss = loss + (alpha.double() * w_alpha).sum()
        return out, alpha, torch.autograd.grad(loss, list(leaves.values()))

    fused = tk.triton_edge_attention
    if compiled:
        fused = torch.compile(fused, backend="aot_eager", fullgraph=True)
    launches = spy_on_launches(monkeypatch, BLOCK_KERNELS + CSR_KERNELS)
    with tk.launch_tiles(block_sparse=32):
        out, alpha, grads = attend(fused, torch.float32)
    backward = ({"backward_target_kernel", "backward_source_kernel"}
                if through_alpha or compiled
                else {"block_backward_target_kernel", "block_backward_source_kernel"})
    assert {name for name, *_ in launches} == {"block_forward_kernel"} | backward
    assert all(kw["NEED_SCORES"] for name, _, kw in launches if name == "block_forward_kernel")
    monkeypatch.undo()
    want_out, want_alpha, want_grads = attend(reference_edge_attention, torch.float64)
    assert alpha.dtype == torch.float32 and alpha.shape == (num_edges, 2)
    assert_close(out, want_out, dtype=torch.float32)
    assert_close(alpha, want_alpha, dtype=torch.float32)
    for got, want in zip(grads, want_grads, strict=True):
        assert_close(got, want, dtype=torch.float32)


@needs_triton
def test_edge_attention_with_dropout_takes_the_block_kernels(interpreter, monkeypatch):
    """``edge_attention(dropout_p > 0)`` in training runs the block kernels, forward and
    backward; its out is the reference backend's with the mask drawn from the same seed (the
    fp32 mask the triton backend draws)."""
    from graphattn.functional.dropout import dropout_mask

    edge_index, num_src, num_dst = STRUCTURED["window-70-r3"]
    edge_index = edge_index.to(DEVICE)
    inputs = on_device(attention_inputs(num_src, num_dst, edge_index.size(1), 2, 8))
    launches = spy_on_launches(monkeypatch, BLOCK_KERNELS)
    torch.manual_seed(3)
    with tk.launch_tiles(block_sparse=32):
        out = edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index,
                             dropout_p=0.5, backend="triton")
        out.sum().backward()
    assert {name for name, *_ in launches} == set(BLOCK_KERNELS)
    monkeypatch.undo()
    torch.manual_seed(3)
    mask = dropout_mask((edge_index.size(1), 2), 0.5, device=out.device, dtype=torch.float32)
    assert 0 < (mask == 0).sum() < mask.numel()
    want, _ = reference_edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index,
                                       scale=8**-0.5, bias=None, dropout_mask=mask,
                                       score="dot", negative_slope=0.2, need_alpha=False)
    assert_close(out, want)


@needs_triton
@pytest.mark.parametrize("heads,channels,value_channels", [
    (1, 8, 8), (4, 16, 16), (2, 64, 64), (2, 8, 24), (3, 5, 7)])
def test_heads_and_channels(interpreter, monkeypatch, heads, channels, value_channels):
    edge_index, num_src, num_dst = STRUCTURED["window-70-r3"]
    inputs = attention_inputs(num_src, num_dst, edge_index.size(1), heads, channels,
                              value_channels=value_channels)
    check_blocks(monkeypatch, inputs, edge_index, block=32, scale=channels**-0.5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_half_precision(interpreter, monkeypatch, dtype, bias):
    """Half inputs: the weights meet the values in the input dtype (FlashAttention's rounding),
    within the dtype's tolerance of the float64 truth."""
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        pytest.skip("Triton's interpreter gets tl.dot of bf16 tiles wrong (a 16 x 16 product "
                    "off by 1e10 in triton 3.9): bf16 is checked on a GPU "
                    "(GRAPHATTN_TRITON_DEVICE=cuda)")
    edge_index, num_src, num_dst = STRUCTURED["grid-6x7"]
    inputs = attention_inputs(num_src, num_dst, edge_index.size(1), 2, 16, bias=bias,
                              dtype=dtype)
    check_blocks(monkeypatch, inputs, edge_index, block=32, dtype=dtype)


@needs_triton
@pytest.mark.parametrize("block", [32, 64])
def test_masked_rows_get_zero_and_no_nan(interpreter, monkeypatch, block):
    """A bias of -inf on every edge of a target leaves it without weight: out 0 and no NaN in
    any gradient."""
    edge_index, num_src, num_dst = STRUCTURED["window-70-r3"]
    inputs = attention_inputs(num_src, num_dst, edge_index.size(1), 2, 8)
    with torch.no_grad():
        inputs["bias"][edge_index[1] == 5] = float("-inf")
        inputs["bias"][edge_index[1] == 69] = float("-inf")  # in the last, partial block
    got = check_blocks(monkeypatch, inputs, edge_index, block=block)
    assert (got["out"][[5, 69]] == 0).all()
    assert (got["dq"][[5, 69]] == 0).all()


@needs_triton
@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min], ids=["-1e9", "fp32-min"])
def test_scores_far_from_zero_keep_the_weights(interpreter, monkeypatch, fill):
    """Every edge of target 40 masked with the finite ``fill`` (uniform weights), two edges of
    target 20 tied near 1e30 (weights 1/2, the others 0): as the reference backend in fp32,
    whose scores round alike (in float64 they would not)."""
    edge_index, num_src, num_dst = STRUCTURED["window-70-r3"]
    inputs = attention_inputs(num_src, num_dst, edge_index.size(1), 2, 8)
    with torch.no_grad():
        inputs["bias"][edge_index[1] == 40] = fill
        inputs["bias"][(edge_index[1] == 20).nonzero()[:2, 0]] = 1e30
    launches = spy_on_launches(monkeypatch, BLOCK_KERNELS)
    got = run(inputs, edge_index, block=32)
    assert len(launches) == 3
    monkeypatch.undo()
    assert_results_close(got, run(inputs, edge_index), inputs, torch.float32)


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf - inf
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "+inf"])
def test_nan_or_plus_inf_bias_stays_in_its_target(interpreter, monkeypatch, value):
    """A NaN or +inf bias on one edge makes its target NaN in that head, out and gradients,
    exactly where the reference has NaN: the weights off the edges are 0, not NaN, so the
    other rows of the tile stay finite."""
    edge_index, num_src, num_dst = STRUCTURED["window-70-r3"]
    inputs = attention_inputs(num_src, num_dst, edge_index.size(1), 2, 8)
    with torch.no_grad():
        inputs["bias"][int((edge_index[1] == 10).nonzero()[2]), 0] = value
    launches = spy_on_launches(monkeypatch, BLOCK_KERNELS)
    got = run(inputs, edge_index, block=32)
    assert len(launches) == 3
    monkeypatch.undo()
    want = run(inputs, edge_index, compute_dtype=torch.float64)
    for name in got:
        assert got[name].isnan().any(), name
        assert torch.equal(got[name].isnan(), want[name].isnan()), name
        assert_close(got[name], want[name], dtype=torch.float32, equal_nan=True)


@needs_triton
@pytest.mark.parametrize("dropout", [False, True], ids=["no-dropout", "dropout"])
def test_gradients_of_gradients_are_the_reference_ones(interpreter, monkeypatch, dropout):
    edge_index, num_src, num_dst = STRUCTURED["causal-40"]
    num_edges = edge_index.size(1)
    inputs = attention_inputs(num_src, num_dst, num_edges, 2, 8)
    gen = torch.Generator().manual_seed(8)
    mask = (torch.rand(num_edges, 2, generator=gen) > 0.3).float() / 0.7 if dropout else None
    results = []
    for block in (32, None):
        leaves = {n: t for n, t in on_device(inputs).items() if t is not None}
        got = run(inputs, edge_index, block=block, create_graph=True, leaves=leaves,
                  dropout_mask=mask)
        loss = sum((g.double() ** 2).sum() for n, g in got.items() if n.startswith("d"))
        results.append(torch.autograd.grad(loss, list(leaves.values())))
    for got, want in zip(*results, strict=True):
        assert_close(got, want)


@needs_triton
@pytest.mark.parametrize("case", ["repeated-edge", "additive", "edge-value", "mixed-dtypes"])
def test_falls_back_to_the_csr_kernels(interpreter, monkeypatch, case):
    """What the block kernels do not take runs on the CSR kernels, with the same result."""
    edge_index, num_src, num_dst = STRUCTURED["window-70-r3"]
    if case == "repeated-edge":
        edge_index = torch.cat([edge_index, edge_index[:, :3]], dim=1)
    num_edges = edge_index.size(1)
    inputs = attention_inputs(num_src, num_dst, num_edges, 2, 8,
                              score="additive" if case == "additive" else "dot")
    q, k, v, bias = (on_device(inputs)[n] for n in ("q", "k", "v", "bias"))
    if case == "mixed-dtypes":
        k = k.detach().double().float().half().requires_grad_()
    options = dict(scale=0.5, bias=bias, score="additive" if case == "additive" else "dot",
                   negative_slope=0.2, need_alpha=False, dropout_mask=None)
    if case == "edge-value":
        options["edge_value"] = torch.randn(num_edges, 2, 8, device=DEVICE)
    edge_index = edge_index.to(DEVICE)
    launches = spy_on_launches(monkeypatch, CSR_KERNELS + BLOCK_KERNELS)
    with tk.launch_tiles(block_sparse=32):
        out, _ = tk.triton_edge_attention(q, k, v, edge_index, **options)
        out.sum().backward()
    assert {name for name, *_ in launches} == set(CSR_KERNELS)
    want, _ = reference_edge_attention(q.double(), k.double(), v.double(), edge_index,
                                       **{**options, "bias": bias.double()})
    assert_close(out, want, dtype=torch.float16 if case == "mixed-dtypes" else torch.float32)


@needs_triton
def test_edge_attention_takes_the_block_kernels(interpreter, monkeypatch):
    """Through the public entry point, with the scale of 1 / sqrt(C) by default."""
    edge_index, num_src, num_dst = STRUCTURED["window-70-r3"]
    inputs = on_device(attention_inputs(num_src, num_dst, edge_index.size(1), 2, 8))
    launches = spy_on_launches(monkeypatch, BLOCK_KERNELS)
    with tk.launch_tiles(block_sparse=64):
        out = edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index.to(DEVICE),
                             bias=inputs["bias"], backend="triton")
    assert [name for name, *_ in launches] == ["block_forward_kernel"]
    want = edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index.to(DEVICE),
                          bias=inputs["bias"], backend="reference")
    assert_close(out, want)


@needs_triton
def test_no_sources(interpreter, monkeypatch):
    q = torch.randn(5, 2, 8, device=DEVICE, requires_grad=True)
    k = torch.randn(0, 2, 8, device=DEVICE, requires_grad=True)
    v = torch.randn(0, 2, 8, device=DEVICE, requires_grad=True)
    edge_index = torch.empty(2, 0, dtype=torch.long, device=DEVICE)
    spy_on_launches(monkeypatch, BLOCK_KERNELS)
    with tk.launch_tiles(block_sparse=32):
        out, _ = tk.triton_edge_attention(q, k, v, edge_index, scale=1.0, bias=None,
                                          dropout_mask=None, score="dot", negative_slope=0.2,
                                          need_alpha=False)
        dq, dk, dv = torch.autograd.grad(out.sum(), [q, k, v])
    assert (out == 0).all() and (dq == 0).all()
    assert dk.shape == (0, 2, 8) and dv.shape == (0, 2, 8)


@pytest.mark.parametrize("name", list(STRUCTURED) + [g.name for g in SINGLE_EDGES])
@pytest.mark.parametrize("block", tb.BLOCK_SIDES)
def test_layout_describes_the_graph(name, block):
    """The tiles' bits are the adjacency matrix, ids the edges' columns, and the two orders
    of the tiles list the same tiles."""
    if name in STRUCTURED:
        edge_index, num_src, num_dst = STRUCTURED[name]
    else:
        case = next(g for g in GRAPHS if g.name == name)
        edge_index, num_src, num_dst = case.edge_index, case.num_src, case.num_dst
    layout = tb.block_layout(edge_index, num_dst, num_src, block, with_ids=True)
    rows, cols = -(-num_dst // block), -(-num_src // block)
    assert layout.ptr.numel() == rows + 1 and layout.tptr.numel() == cols + 1
    # decode the bits into a dense [rows * B, cols * B] matrix, tile by tile
    shifts = torch.arange(32, dtype=torch.int32)
    entries = ((layout.bits[..., None] >> shifts) & 1).reshape(-1, block, block).bool()
    dense = torch.zeros(rows * block, cols * block, dtype=torch.bool)
    ids = torch.full((rows * block, cols * block), -1, dtype=torch.int32)
    for t in range(layout.num_tiles):
        r, c = int(layout.row[t]), int(layout.col[t])
        assert layout.ptr[r] <= t < layout.ptr[r + 1]
        dense[r * block:(r + 1) * block, c * block:(c + 1) * block] = entries[t]
        ids[r * block:(r + 1) * block, c * block:(c + 1) * block] = layout.ids[t]
        assert entries[t].any()  # only tiles that hold an edge
    expected = torch.zeros_like(dense)
    expected[:num_dst, :num_src] = to_dense_mask(edge_index, max(num_src, num_dst))[
        :num_dst, :num_src]
    assert torch.equal(dense, expected)
    assert torch.equal(ids[edge_index[1], edge_index[0]],
                       torch.arange(edge_index.size(1), dtype=torch.int32))
    assert ((ids >= 0) == dense).all()
    for c in range(cols):  # the tiles of source block c, by target block
        mine = layout.tpair[layout.tptr[c]:layout.tptr[c + 1]].long()
        assert (layout.col[mine] == c).all()
        assert torch.equal(mine, torch.sort(mine).values)
    assert torch.equal(torch.sort(layout.tpair.long()).values,
                       torch.arange(layout.num_tiles))


def test_layout_refuses_repeated_edges():
    assert tb.block_layout(torch.tensor([[0, 1, 0], [1, 1, 1]]), 2, 2, 32) is None
    with pytest.raises(ValueError, match="block must be one of .*got 48"):
        tb.block_layout(torch.tensor([[0], [1]]), 2, 2, 48)


@pytest.mark.parametrize("value", [48, 16, 128, True, 64.0])
def test_launch_tiles_refuses_other_block_sides(value):
    with pytest.raises(ValueError, match=f"block_sparse must be one of .*got {value!r}"):
        with tk.launch_tiles(block_sparse=value):
            pass


@st.composite
def banded_graphs(draw):
    """A graph whose sources lie near their target (distinct edges), its sizes, a tile side,
    heads, channels, whether it has a bias and whether a dropout mask."""
    num_dst = draw(st.integers(1, 90))
    num_src = draw(st.integers(1, 90))
    reach = draw(st.integers(0, 40))
    pairs = [(j, i) for i in range(num_dst) for j in range(num_src)
             if abs(j * num_dst - i * num_src) <= reach * max(num_src, num_dst)]
    keep = draw(st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs)))
    kept = [p for p, k in zip(pairs, keep, strict=True) if k]
    edge_index = (torch.tensor(kept, dtype=torch.long).t() if kept
                  else torch.empty(2, 0, dtype=torch.long))
    return (edge_index.contiguous(), num_src, num_dst, draw(st.sampled_from([32, 64])),
            draw(st.sampled_from([1, 2])), draw(st.sampled_from([4, 8, 16])), draw(st.booleans()),
            draw(st.booleans()))


@needs_triton
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(case=banded_graphs())
def test_drawn_banded_graphs(interpreter, monkeypatch, case):
    edge_index, num_src, num_dst, block, heads, channels, bias, dropout = case
    num_edges = edge_index.size(1)
    inputs = attention_inputs(num_src, num_dst, num_edges, heads, channels, bias=bias)
    gen = torch.Generator().manual_seed(num_edges)
    mask = (torch.rand(num_edges, heads, generator=gen) > 0.3).float() / 0.7 if dropout else None
    with monkeypatch.context() as mp:
        check_blocks(mp, inputs, edge_index, block=block, dropout_mask=mask)


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
COMPILE_FOR_SM90 = f"""
import re
import sys
sys.path.insert(0, {str(BENCHMARKS)!r})
import triton_resources

for dtype, block, bias, dropout, precision in [
        ("fp16", 64, False, False, "ieee"), ("fp16", 64, True, False, "ieee"),
        ("bf16", 32, True, True, "ieee"), ("fp32", 32, False, False, "ieee"),
        ("fp32", 64, True, False, "tf32"), ("fp32", 32, False, True, "ieee")]:
    warps, usage = triton_resources.compile_block_kernels(4, 32, dtype, block, bias=bias,
                                                          dropout=dropout, scores=dropout,
                                                          precision=precision)
    for name, use in usage.items():
        # a tile's edge ids start at pair * B^2: an int32 product wraps from 2^31 / B^2 tiles
        narrow = len(re.findall(rf"arith.muli .*c{{block * block}}_i32 : i32", use["ttir"]))
        print("compiled", name, dtype, block, bias, use["registers"], use["spill_stores"],
              precision, use["mma"], narrow)
# a dropout mask read from memory (a user's mask) rather than drawn from a seed
warps, usage = triton_resources.compile_block_kernels(4, 32, "bf16", 64, bias=True,
                                                      dropout=True, seeded_dropout=False)
print("read mask", warps, len(usage))
# drawn from a seed, half tiles of 64 x 64 on 8 warps, with sinks: no spill
warps, usage = triton_resources.compile_block_kernels(4, 32, "bf16", 64, bias=True,
                                                      dropout=True, sinks=True)
print("seeded", warps, *(use["spill_stores"] for use in usage.values()))
"""


@needs_triton
def test_block_kernels_compile_for_sm90():
    """The interpreter does not run Triton's compiler: compile the three block kernels for
    sm_90 ahead of time (half and fp32 inputs, full fp32 and TF32 products, with and without a
    bias, a dropout mask, drawn from a seed or read from a tensor, sinks, and the scores
    written), as ``benchmarks/triton_resources.py --blocks`` does; no GPU needed. Their PTX
    multiplies on tensor cores except with full fp32 products, which Triton runs on the FMA
    units, and address a tile's edge ids (from pair * B^2) in int64, past 2^31 on large
    graphs. In a fresh process: the interpreter leaves ``triton.language`` patched after it
    ran."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line.split() for line in done.stdout.splitlines()
                if line.startswith("compiled")]
    assert len(compiled) == 6 * 3
    assert "read mask 4 3" in done.stdout
    assert "seeded 8 0 0 0" in done.stdout
    assert {row[1] for row in compiled} == set(BLOCK_KERNELS)
    # every kernel's products on tensor cores but full fp32 ones, which have no such instruction
    for _, name, dtype, block, _, _, _, precision, mma, narrow in compiled:
        on_tensor_cores = dtype != "fp32" or precision == "tf32"
        assert (int(mma) > 0) == on_tensor_cores, (name, dtype, precision, mma)
        assert narrow == "0", (name, dtype, block)  # tile offsets in int64


@needs_triton
def test_graph_self_attention_trains_on_the_block_kernels(interpreter, monkeypatch):
    """``GraphSelfAttention`` (its self-loops added) runs the block kernels forward and
    backward, with the gradients of its parameters those of the reference backend."""
    from graphattn.nn import GraphSelfAttention

    edge_index = window_graph(70, 3, causal=True).to(DEVICE)
    x = torch.randn(70, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    grads = {}
    for backend in ("triton", "reference"):
        torch.manual_seed(0)
        layer = GraphSelfAttention(16, 8, heads=2, backend=backend).to(DEVICE)
        if backend == "triton":
            launches = spy_on_launches(monkeypatch, BLOCK_KERNELS)
        with tk.launch_tiles(block_sparse=32):
            out = layer(x, edge_index)
            out.square().sum().backward()
        if backend == "triton":
            assert {name for name, *_ in launches} == set(BLOCK_KERNELS)
            monkeypatch.undo()
        grads[backend] = [out] + [p.grad for p in layer.parameters()]
    for got, want in zip(grads["triton"], grads["reference"], strict=True):
        assert_close(got, want)


@needs_triton
def test_empty_tiles_keep_to_the_csr_kernels(interpreter, monkeypatch):
    """Under 1/64 of the tiles' entries edges (scattered edges: 300 on 400 nodes, a tile each
    or nearly), no layout is built and the CSR kernels run; a window graph's tiles are full
    enough."""
    monkeypatch.setattr(tb, "MIN_FILL", 1 / 64)
    scattered = distinct_random_edges(400, 400, 300, seed=5)
    layout_fill = 300 / (torch.unique((scattered[1] // 32) * 13 + scattered[0] // 32).numel()
                         * 32**2)
    assert layout_fill < 1 / 64
    assert tb.block_layout(scattered, 400, 400, 32) is None
    window = STRUCTURED["window-70-r3"][0]
    assert tb.block_layout(window, 70, 70, 32).fill(window.size(1)) >= 1 / 64
    inputs = on_device(attention_inputs(400, 400, 300, 2, 8))
    launches = spy_on_launches(monkeypatch, CSR_KERNELS + BLOCK_KERNELS)
    with tk.launch_tiles(block_sparse=32):
        out, _ = tk.triton_edge_attention(inputs["q"], inputs["k"], inputs["v"],
                                          scattered.to(DEVICE), scale=0.5, bias=inputs["bias"],
                                          dropout_mask=None, score="dot", negative_slope=0.2,
                                          need_alpha=False)
    assert [name for name, *_ in launches] == ["forward_kernel"]


@needs_triton
@pytest.mark.parametrize("case", ["window", "window-no-bias", "window-dropout",
                                  "repeated-edge"])
def test_compiled_calls_run_the_block_operators(interpreter, monkeypatch, case):
    """Under ``torch.compile`` (``fullgraph=True``) the block kernels run forward and backward,
    as the operator ``graphattn::triton_block_attention``; on a graph with a repeated edge the
    operators find it and run the CSR kernels instead. Out and gradients are the float64
    reference's. Called outside ``launch_tiles``, the compiled function is traced again and
    runs the CSR kernels."""
    edge_index, num_src, num_dst = STRUCTURED["window-70-r3"]
    if case == "repeated-edge":
        edge_index = torch.cat([edge_index, edge_index[:, :3]], dim=1)
    num_edges = edge_index.size(1)
    inputs = attention_inputs(num_src, num_dst, num_edges, 2, 8)
    if case == "window-no-bias":
        inputs["bias"] = None
    mask = None
    if case == "window-dropout":
        gen = torch.Generator().manual_seed(4)
        mask = ((torch.rand(num_edges, 2, generator=gen) > 0.4).float() / 0.6).to(DEVICE)
    leaves = {n: t for n, t in on_device(inputs).items() if t is not None}
    edge_index = edge_index.to(DEVICE)

    def attend(q, k, v, bias, edge_index):
        return tk.triton_edge_attention(q, k, v, edge_index, scale=0.5, bias=bias,
                                        dropout_mask=mask, score="dot", negative_slope=0.2,
                                        need_alpha=False)[0]

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    weight = torch.randn(num_dst, 2, 8, generator=torch.Generator().manual_seed(2),
                         dtype=torch.float64).to(DEVICE)  # run's loss
    expected = run(inputs, edge_index, scale=0.5, compute_dtype=torch.float64, seed=2,
                   dropout_mask=mask)
    kinds = CSR_KERNELS if case == "repeated-edge" else BLOCK_KERNELS
    for tiles in ({"block_sparse": 32}, {}):
        launches = spy_on_launches(monkeypatch, CSR_KERNELS + BLOCK_KERNELS)
        with tk.launch_tiles(**tiles):
            out = compiled(leaves["q"], leaves["k"], leaves["v"], leaves.get("bias"),
                           edge_index)
            grads = torch.autograd.grad((out.double() * weight).sum(),
                                        list(leaves.values()))
        assert {name for name, *_ in launches} == set(kinds if tiles else CSR_KERNELS)
        monkeypatch.undo()
        got = {"out": out, **{"d" + n: g for n, g in zip(leaves, grads, strict=True)}}
        assert_results_close(got, expected, inputs, torch.float32)


@needs_triton
@pytest.mark.parametrize(("bias", "dropout", "alpha", "repeated"), [
    (True, False, False, False), (False, False, False, False), (False, True, True, False),
    (True, True, True, True)], ids=["bias", "no-bias", "dropout-alpha", "repeated-edge"])
def test_block_operators_pass_opcheck(interpreter, bias, dropout, alpha, repeated):
    """torch's checks of the two operators (schema, fake shapes, the autograd registration),
    on a graph the tiles take and on one they do not (a repeated edge: the CSR kernels); a
    small causal graph (20 nodes, 210 edges), as opcheck runs the operators many times."""
    edge_index, num_src, num_dst = causal_graph(20), 20, 20
    if repeated:
        edge_index = torch.cat([edge_index, edge_index[:, :2]], dim=1)
    num_edges = edge_index.size(1)
    inputs = on_device(attention_inputs(num_src, num_dst, num_edges, 2, 8))
    q, k, v = (inputs[n].detach() for n in ("q", "k", "v"))
    b = inputs["bias"].detach() if bias else None
    mask = (torch.rand(num_edges, 2) > 0.5).float().mul(2).to(DEVICE) if dropout else None
    edge_index = edge_index.to(DEVICE)
    torch.library.opcheck(tb._block_forward_op, (q.requires_grad_(), k, v, b, mask,
                                                 edge_index, 0.5, 32, alpha))
    out32, weights, lse = tb._block_forward_op(q.detach(), k, v, b, mask, edge_index, 0.5, 32,
                                               alpha)
    assert weights.shape == (num_edges if alpha else 0, 2)
    dalpha = torch.randn_like(weights) if alpha else None
    torch.library.opcheck(tb._block_backward_op, (torch.randn_like(out32), dalpha, q.detach(),
                                                  k, v, b, mask, edge_index, out32, lse, 0.5,
                                                  32, bias))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("need_alpha", [False, True], ids=["out", "alpha"])
def test_inference_writes_out_in_its_dtype(interpreter, monkeypatch, dtype, need_alpha):
    """Without a gradient to compute, the block forward kernel runs without the autograd
    Function and writes out in the dtype of v; its values and weights are those of a training
    call (bf16: the interpreter's tl.dot of bf16 tiles is wrong, see test_half_precision)."""
    written = record_out_dtypes(monkeypatch, tb, "block_forward")
    launches = spy_on_launches(monkeypatch, BLOCK_KERNELS)
    edge_index, num_src, num_dst = STRUCTURED["window-70-r3"]
    edge_index = edge_index.to(DEVICE)
    inputs = on_device(attention_inputs(num_src, num_dst, edge_index.size(1), 2, 8,
                                        dtype=dtype))
    q, k, v, bias = (inputs[name].detach() for name in ("q", "k", "v", "bias"))
    with tk.launch_tiles(block_sparse=32):
        trained = edge_attention(q, k, v.requires_grad_(), edge_index, bias=bias,
                                 backend="triton", return_attention=need_alpha)
        with torch.no_grad():
            inferred = edge_attention(q, k, v, edge_index, bias=bias, backend="triton",
                                      return_attention=need_alpha)
    assert [name for name, *_ in launches] == ["block_forward_kernel"] * 2
    assert written == [torch.float32, dtype]
    if not need_alpha:
        trained, inferred = (trained,), (inferred,)
    assert inferred[0].dtype == dtype and inferred[0].grad_fn is None
    for got, want in zip(inferred, trained, strict=True):
        assert torch.equal(got, want.detach())


def test_a_graph_of_2_to_the_31_edges_takes_the_csr_kernels():
    """The tile entries hold edge ids in int32: edge 2^31 would wrap to -2^31, and the kernels
    read a bias and wrote weights before their buffers. Such a graph gets no block layout (an
    expanded edge_index: its size is all that is read)."""
    edge_index = torch.zeros(2, 1, dtype=torch.long).expand(2, 2**31)
    assert tb.block_layout(edge_index, 64, 64, 32, with_ids=True) is None
