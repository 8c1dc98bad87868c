"""The fused Triton kernels against the reference backend, run in Triton's CPU interpreter.

Every kernel test runs under ``TRITON_INTERPRET=1`` (set for this module only): the kernels are
defined per mode at first use, so importing graphattn earlier does not matter. The truth is
:func:`reference_edge_attention` in float64 on the same inputs; outputs, attention weights and
the gradients of q, k, v, bias and att (through out and alpha) are compared with the tolerance
of the kernel's dtype. Sizes stay tiny: the interpreter runs one Python step per tile operation.

On a machine with a GPU, ``GRAPHATTN_TRITON_DEVICE=cuda`` runs the same tests on CUDA tensors with
the compiled kernels instead (the reference backend then runs on the GPU too).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from conftest import (
    DEVICE,
    GRAPHS,
    assert_close,
    assert_results_close,
    attention_inputs,
    check_nan_score_pattern,
    needs_triton,
    on_device,
    random_graph,
    record_out_dtypes,
    spy_on_launches,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphattn import _checks, _tensor_cache
from graphattn._tensor_cache import TensorCache
from graphattn.functional import attention, dropout_mask, edge_attention, reference_edge_attention
from graphattn.functional import triton_kernels as tk
from graphattn.functional.dropout import mask_tensor, seeded_mask, seeded_mask_parameters


def run_backend(backend, inputs, edge_index, *, score="dot", scale=0.5, dropout_mask=None,
                compute_dtype=None, seed=1, negative_slope=0.2):
    """out, alpha and the gradients of a fixed random loss on both (computed in compute_dtype),
    on ``DEVICE``."""
    leaves = {n: t for n, t in on_device(inputs).items() if t is not None}
    edge_index = edge_index.to(DEVICE)
    dropout_mask = None if dropout_mask is None else dropout_mask.to(DEVICE)
    cast = {n: (t.to(compute_dtype) if compute_dtype else t) for n, t in leaves.items()}
    mask = None if dropout_mask is None else dropout_mask.to(compute_dtype or dropout_mask.dtype)
    out, alpha = backend(cast["q"], cast["k"], cast["v"], edge_index, scale=scale,
                         bias=cast.get("bias"), dropout_mask=mask, score=score,
                         negative_slope=negative_slope, need_alpha=True, att=cast.get("att"))
    gen = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    w_alpha = torch.randn(alpha.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    loss = (out.double() * w_out).sum() + (alpha.double() * w_alpha).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"out": out, "alpha": alpha, **{"d" + n: g for n, g in zip(leaves, grads, strict=True)}}


def check_against_reference(inputs, edge_index, *, score="dot", scale=0.5, dropout_mask=None,
                            dtype=torch.float32, negative_slope=0.2):
    """The kernels against the float64 reference; ``dropout_mask`` is a mask ``[E, H]`` or a
    seeded mask's parameters, which the reference gets written out (``seeded_mask``)."""
    got = run_backend(tk.triton_edge_attention, inputs, edge_index, score=score, scale=scale,
                      dropout_mask=dropout_mask, negative_slope=negative_slope)
    want = run_backend(reference_edge_attention, inputs, edge_index, score=score, scale=scale,
                       dropout_mask=mask_tensor(dropout_mask, edge_index.size(1),
                                                inputs["v"].size(1)),
                       compute_dtype=torch.float64, negative_slope=negative_slope)
    assert got["out"].dtype == inputs["v"].dtype
    assert_results_close(got, want, inputs, dtype)
    return got


@needs_triton
@pytest.mark.parametrize("score", attention.SCORES)
def test_matches_reference_on_graph_registry(interpreter, triton_tiles, graph_case, score):
    ei = graph_case.edge_index
    inputs = attention_inputs(graph_case.num_src, graph_case.num_dst, ei.size(1), 2, 8, score=score)
    got = check_against_reference(inputs, ei, score=score)
    isolated = torch.ones(graph_case.num_dst, dtype=torch.bool)
    isolated[ei[1]] = False
    assert (got["out"][isolated.to(DEVICE)] == 0).all()


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf - inf
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "+inf"])
@pytest.mark.parametrize("score", attention.SCORES)
def test_nan_or_plus_inf_score_makes_its_target_nan_in_that_head(interpreter, triton_tiles,
                                                                  score, value):
    check_nan_score_pattern("triton", score, value, device=DEVICE)


@needs_triton
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("heads,channels",
                         [(1, 8), (1, 16), (1, 64), (4, 8), (4, 16), (4, 64), (3, 64), (2, 12)])
@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_heads_and_channels(interpreter, triton_tiles, score, heads, channels, bias):
    """Channel tiles padded (C = 12) or not, head blocks full or partial (H = 3, C = 64)."""
    ei = random_graph(16, 48, seed=heads * 100 + channels)
    inputs = attention_inputs(16, 16, 48, heads, channels, score=score, bias=bias, seed=channels)
    check_against_reference(inputs, ei, score=score, scale=channels ** -0.5)


@needs_triton
@pytest.mark.parametrize("channels,value_channels", [(8, 4), (4, 16), (12, 5), (64, 8)])
@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_channels_of_v_unlike_those_of_q(interpreter, triton_tiles, score, channels,
                                         value_channels):
    """q and k with C channels, v with C_v: separate channel tiles (padded for 12 and 5; at
    C = 64 the q, k tile sets the head block)."""
    ei = random_graph(12, 40, seed=channels + value_channels)
    inputs = attention_inputs(12, 12, 40, 4, channels, score=score, value_channels=value_channels,
                              seed=value_channels)
    got = check_against_reference(inputs, ei, score=score, scale=channels ** -0.5)
    assert got["out"].shape == (12, 4, value_channels)


@needs_triton
@pytest.mark.parametrize("score", ["additive", "gatv2"])
def test_negative_slope_of_its_own(interpreter, triton_tiles, score):
    """negative_slope 0.1, not the default 0.2: the LeakyReLU of the scores and its derivative
    in both backward passes (dq, d att on the target pass, dk on the source pass)."""
    ei = random_graph(12, 40, seed=8)
    inputs = attention_inputs(12, 12, 40, 2, 8, score=score, seed=5)
    check_against_reference(inputs, ei, score=score, negative_slope=0.1)


def star_graph(degree: int, extra: int = 6, seed: int = 0) -> torch.Tensor:
    """Target 0 with ``degree`` incoming edges (repeats and a self-loop included) plus a few
    random edges elsewhere; every other node has degree 0 or small."""
    gen = torch.Generator().manual_seed(seed)
    num_nodes = 40
    src = torch.cat([torch.arange(degree) % num_nodes, torch.randint(0, num_nodes, (extra,),
                                                                     generator=gen)])
    dst = torch.cat([torch.zeros(degree, dtype=torch.long),
                     torch.randint(1, num_nodes, (extra,), generator=gen)])
    return torch.stack([src, dst])


@needs_triton
@pytest.mark.parametrize("score", attention.SCORES)
def test_degree_200_row(interpreter, triton_tiles, score):
    ei = star_graph(200)
    inputs = attention_inputs(40, 40, ei.size(1), 2, 8, score=score, seed=3)
    check_against_reference(inputs, ei, score=score, scale=2.0)


@pytest.fixture
def small_sum_blocks(monkeypatch):
    """Rows of more than ``block_e * SUM_STEPS`` = 4 edges (1 edge with
    ``one_edge_sum_blocks``) take the launch of the rows of many blocks, whose float64 sums
    add a block every 4 edges, on graphs of any size (``HUB_EDGES``)."""
    monkeypatch.setattr(tk, "SUM_STEPS", 1)
    monkeypatch.setattr(tk, "HUB_EDGES", 0)
    with tk.launch_tiles(block_e=4):
        yield


@pytest.fixture
def one_edge_sum_blocks(monkeypatch):
    monkeypatch.setattr(tk, "SUM_STEPS", 1)
    monkeypatch.setattr(tk, "HUB_EDGES", 0)
    with tk.launch_tiles(block_e=1):
        yield


@needs_triton
@pytest.mark.parametrize("score", attention.SCORES)
def test_rows_of_many_sum_blocks_match_reference(interpreter, small_sum_blocks, score):
    """Target 0's 100 in-edges in 25 blocks of the float64 sums: its first 10 edges masked
    (blocks with no weight, the row maximum still -inf), then ordinary scores, then one edge
    whose score jumps by 30 (the sums of the blocks before it shift to the new maximum); the
    sources' out-edges (up to 3 each) one or two blocks. With seeded dropout, through both
    passes of backward and the weights' gradient (delta's blocked sum)."""
    ei = star_graph(100)
    inputs = attention_inputs(40, 40, ei.size(1), 2, 8, score=score, seed=3)
    with torch.no_grad():
        inputs["bias"][:10] = float("-inf")
        inputs["bias"][70] += 30.0
    check_against_reference(inputs, ei, score=score, scale=0.5)
    torch.manual_seed(5)
    mask = seeded_mask_parameters(0.3, device=DEVICE)
    check_against_reference(inputs, ei, score=score, scale=0.5, dropout_mask=mask)


@needs_triton
@pytest.mark.parametrize("score", attention.SCORES)
def test_every_edge_its_own_sum_block(interpreter, one_edge_sum_blocks, graph_case, score):
    """The registry graphs with a block of the float64 sums per edge: isolated targets,
    multi-edges, self-loops and bipartite graphs as with one block per row."""
    ei = graph_case.edge_index
    inputs = attention_inputs(graph_case.num_src, graph_case.num_dst, ei.size(1), 2, 8,
                              score=score)
    check_against_reference(inputs, ei, score=score)


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf - inf
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")  # a NaN block
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "+inf"])
@pytest.mark.parametrize("score", attention.SCORES)
def test_nan_score_spreads_over_its_row_across_sum_blocks(interpreter, one_edge_sum_blocks,
                                                          score, value):
    """A NaN or +inf score in one block of its row makes the whole row NaN, the blocks after
    it included; a fully masked row still gives 0."""
    check_nan_score_pattern("triton", score, value, device=DEVICE)
    check_fully_masked_row(score)


@needs_triton
@pytest.mark.parametrize("tiles", [{}, {"block_n": 2, "heavy_degree": 8}],
                         ids=["one-node", "row-blocks"])
def test_long_rows_are_summed_in_float64_blocks(interpreter, monkeypatch, tiles):
    """Sums over a row's edges of one inexact fp32 term (0.1) repeated: a running fp32 sum over
    its n tiles drifts by up to n / 2 units in its last place, which the float64 sum of blocks
    of 2 tiles (8 edges) does not. One target, 512 in-edges from two sources (256 each); q and
    k orthogonal, so every weight is 1/512: out and dv sum 0.1 (channel 0 of v, and of dout),
    dq and dk sum a constant too, v being +1 and -1 on channel 1 and k = +-0.1 in channel 3.
    Each is within 1.5e-7 (relative) of float64; the fp32 running sums missed by 5e-7 to
    1e-6 (with no launch of the rows of many blocks, ``HUB_EDGES`` above E). The same with
    row blocks: there the rows above ``heavy_degree`` take that launch."""
    monkeypatch.setattr(tk, "SUM_STEPS", 2)
    monkeypatch.setattr(tk, "HUB_EDGES", 0)
    E, C = 512, 4
    ei = torch.stack([torch.arange(E) % 2, torch.zeros(E, dtype=torch.long)])
    q = torch.zeros(1, 1, C, dtype=torch.float64)
    q[0, 0, 2] = 0.1
    k = torch.zeros(2, 1, C, dtype=torch.float64)
    k[:, 0, 3] = torch.tensor([0.1, -0.1])
    v = torch.zeros(2, 1, C, dtype=torch.float64)
    v[:, 0, 0] = 0.1
    v[:, 0, 1] = torch.tensor([1.0, -1.0])
    weight = torch.zeros(1, 1, C, dtype=torch.float64)  # dout = 0.1 on channel 1
    weight[0, 0, 1] = 0.1
    results = []
    for backend, dtype in ((tk.triton_edge_attention, torch.float32),
                           (reference_edge_attention, torch.float64)):
        leaves = [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v)]
        with tk.launch_tiles(block_e=4, **tiles):
            out, _ = backend(*leaves, ei.to(DEVICE), scale=1.0, bias=None, dropout_mask=None,
                             score="dot", negative_slope=0.2, need_alpha=False)
            grads = torch.autograd.grad((out * weight.to(DEVICE, dtype)).sum(), leaves)
        results.append((out.detach(), *grads))
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        error = ((got.double() - want).norm() / want.norm()).item()
        assert error < 1.5e-7, (name, error)


@needs_triton
@pytest.mark.parametrize("score", attention.SCORES)
def test_dropout_mask_in_forward_and_backward(interpreter, triton_tiles, score):
    ei = random_graph(12, 40, seed=5)
    inputs = attention_inputs(12, 12, 40, 2, 8, score=score)
    p = 0.4
    keep = torch.rand(40, 2, generator=torch.Generator().manual_seed(9)) > p
    mask = keep.float() / (1 - p)
    check_against_reference(inputs, ei, score=score, dropout_mask=mask)


@needs_triton
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("score", attention.SCORES)
def test_seeded_dropout_in_forward_and_backward(interpreter, triton_tiles, score, bias):
    """The mask drawn in the kernels from a seed: the forward and both backward passes draw
    the same entries, those of the mask ``seeded_mask`` writes out (the reference gets it)."""
    ei = random_graph(12, 60, seed=5)
    inputs = attention_inputs(12, 12, 60, 2, 8, score=score, bias=bias)
    torch.manual_seed(3)
    parameters = seeded_mask_parameters(0.4, device=DEVICE)
    mask = seeded_mask(parameters, (60, 2))
    assert 0.2 < (mask == 0).float().mean() < 0.6  # the test sees dropped and kept entries
    got = check_against_reference(inputs, ei, score=score, dropout_mask=parameters)
    undropped = run_backend(tk.triton_edge_attention, inputs, ei, score=score)
    assert not torch.allclose(got["out"], undropped["out"])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("score", attention.SCORES)
def test_half_precision(interpreter, triton_tiles, dtype, score):
    ei = random_graph(12, 40, seed=6)
    inputs = attention_inputs(12, 12, 40, 2, 16, score=score, dtype=dtype)
    got = check_against_reference(inputs, ei, score=score, dtype=dtype)
    assert got["out"].dtype == dtype and got["dq"].dtype == dtype and got["alpha"].dtype == dtype


@needs_triton
@pytest.mark.parametrize("score", attention.SCORES)
def test_fully_masked_row_gives_zero_without_nan(interpreter, triton_tiles, score):
    check_fully_masked_row(score)


def check_fully_masked_row(score: str) -> None:
    """Node 1's every in-edge masked by a bias of -inf: its out and weights are 0, not NaN."""
    ei = torch.tensor([[0, 1, 2, 0, 2], [1, 1, 1, 2, 2]])
    inputs = attention_inputs(3, 3, 5, 1, 8, score=score)
    with torch.no_grad():
        inputs["bias"][:3] = float("-inf")  # every edge into node 1
    got = check_against_reference(inputs, ei, score=score)
    assert (got["out"][1] == 0).all() and (got["alpha"][:3] == 0).all()


@needs_triton
@pytest.mark.parametrize("fill", [-1e9, torch.finfo(torch.float32).min], ids=["-1e9", "fp32-min"])
@pytest.mark.parametrize("score", attention.SCORES)
def test_scores_far_from_zero_keep_the_weights(interpreter, triton_tiles, score, fill):
    """Scores so large that log(degree) vanishes next to them in fp32: node 0's three in-edges
    all masked with the finite ``fill`` (uniform weights 1/3), node 1 two ordinary edges, node 2
    two tied scores near 1e30 (weights 1/2) and an ordinary edge (weight 0). A saved max + log
    sum rounds to the max and recomputes every weight of such a row as 1; here out, alpha and
    the gradients match the reference backend in fp32, on which the scores round alike."""
    ei = torch.tensor([[0, 1, 2, 0, 2, 0, 1, 2], [0, 0, 0, 1, 1, 2, 2, 2]])
    inputs = attention_inputs(3, 3, 8, 1, 4, score=score, seed=2)
    with torch.no_grad():
        inputs["bias"][:3] = fill
        inputs["bias"][5:7] = 1e30
    got = run_backend(tk.triton_edge_attention, inputs, ei, score=score)
    want = run_backend(reference_edge_attention, inputs, ei, score=score)
    assert_results_close(got, want, inputs, torch.float32)
    assert_close(got["alpha"][:3].sum(), torch.tensor(1.0))
    assert_close(got["alpha"][5:], torch.tensor([[0.5], [0.5], [0.0]]))


@needs_triton
@pytest.mark.parametrize(("n_src", "n_dst"), [(0, 3), (3, 0)])
@pytest.mark.parametrize("score", attention.SCORES)
def test_no_source_or_target_nodes_gives_zero(interpreter, triton_tiles, score, n_src, n_dst):
    inputs = attention_inputs(n_src, n_dst, 0, 2, 8, score=score)
    got = check_against_reference(inputs, torch.empty(2, 0, dtype=torch.long), score=score)
    assert (got["out"] == 0).all() and got["out"].shape[0] == n_dst
    assert got["dk"].shape[0] == n_src and (got["dk"] == 0).all()


def test_kernels_use_no_atomics():
    """Each program owns the rows it writes: no atomics, so gradients are deterministic."""
    source = Path(tk.__file__).with_name("_triton_jit.py").read_text()
    assert "tl.store" in source
    assert "atomic" not in source


@needs_triton
@pytest.mark.parametrize("score", attention.SCORES)
def test_edge_attention_dispatches_by_name(interpreter, index_dtype, score):
    case = next(g for g in GRAPHS if g.name == "multi-edges")
    inputs = on_device(attention_inputs(case.num_src, case.num_dst, case.edge_index.size(1), 2, 8,
                                        score=score))
    kwargs = dict(bias=inputs["bias"], return_attention=True, score=score, att=inputs["att"])
    args = (inputs["q"], inputs["k"], inputs["v"], case.edge_index.to(DEVICE, index_dtype))
    out, alpha = edge_attention(*args, backend="triton", **kwargs)
    want_out, want_alpha = edge_attention(*args, backend="reference", **kwargs)
    assert_close(out, want_out)
    assert_close(alpha, want_alpha)
    assert attention.BACKENDS["triton"] is tk.triton_edge_attention


@needs_triton
def test_edge_attention_dropout_uses_one_mask(interpreter):
    """``edge_attention`` hands the kernels a seed drawn from the inputs' device (so
    ``torch.manual_seed`` governs it) and the kernels draw the mask of ``seeded_mask`` from it,
    in forward and backward alike. That is the mask every backend draws (on CPU, and on CUDA
    with Triton): the same seed gives the reference backend's output and gradients."""
    ei = random_graph(10, 30, seed=2).to(DEVICE)
    inputs = on_device(attention_inputs(10, 10, 30, 2, 8, bias=False))
    args = (inputs["q"], inputs["k"], inputs["v"], ei)
    results = {}
    for backend in ("triton", "reference"):
        torch.manual_seed(11)
        out = edge_attention(*args, dropout_p=0.5, backend=backend)
        results[backend] = (out, *torch.autograd.grad(out.square().sum(), args[:3]))
    torch.manual_seed(11)
    mask = seeded_mask(seeded_mask_parameters(0.5, device=DEVICE), (30, 2))
    want = reference_edge_attention(*args, scale=8**-0.5, bias=None, dropout_mask=mask,
                                    score="dot", negative_slope=0.2, need_alpha=False)[0]
    want = (want, *torch.autograd.grad(want.square().sum(), args[:3]))
    for got, expected in zip(results["triton"], want, strict=True):
        assert_close(got, expected)
    for got, expected in zip(results["triton"], results["reference"], strict=True):
        assert_close(got, expected)
    assert not torch.equal(results["triton"][0], edge_attention(
        *args, dropout_p=0.5, training=False, backend="triton"))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(("p", "shape"), [(0.0, (7, 3)), (0.1, (1023,)), (0.5, (700, 4)),
                                          (0.9, (2, 1500)), (0.5, (0, 4))])
def test_seeded_mask_kernel_writes_the_cpu_mask(interpreter, dtype, p, shape):
    """``write_seeded_mask`` (the Triton kernel that writes a seeded mask on the device) writes
    entry for entry what the CPU writes from the same parameters, in several programs, the last
    one partial; and ``dropout_mask`` on the device draws that mask from the seed a
    ``torch.manual_seed`` gives (on CUDA through that kernel)."""
    torch.manual_seed(int(p * 10) + len(shape))
    parameters = seeded_mask_parameters(p, device=DEVICE)
    got = tk.write_seeded_mask(parameters, shape, dtype)
    want = seeded_mask(parameters.cpu(), shape, dtype)  # the CPU writer
    assert got.shape == shape and got.dtype == dtype and got.device.type == DEVICE.type
    assert torch.equal(got.cpu(), want)
    if want.numel() >= 1000:
        assert abs((want == 0).float().mean().item() - p) < 0.05
    torch.manual_seed(int(p * 10) + len(shape))
    assert torch.equal(dropout_mask(shape, p, device=DEVICE, dtype=dtype).cpu(), want)


@needs_triton
@pytest.mark.parametrize("v_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dropout_mask_beside_half_values_is_not_rounded(interpreter, v_dtype):
    """The mask was drawn in v's dtype: bf16 keeps 1 / (1 - 0.1) as 1.109375, which shrank the
    outputs by 0.16%, and with fp32 q and k the gradients differed from the reference backend's
    (which promotes v, and draws the mask, in fp32) by 0.3%."""
    ei = random_graph(10, 40, seed=3).to(DEVICE)
    inputs = on_device(attention_inputs(10, 10, 40, 2, 8, bias=False))
    q, k = inputs["q"], inputs["k"]  # fp32
    v = inputs["v"].detach().to(v_dtype).requires_grad_()
    # A loss linear in out, with weights exact in bf16 and fp16: both backends get the same
    # output gradient although only the reference's out is fp32.
    w = torch.randint(-4, 5, (10, 2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    results = {}
    for backend in ("triton", "reference"):
        torch.manual_seed(5)
        if backend == "triton":
            out = edge_attention(q, k, v, ei, dropout_p=0.1, backend=backend)
        else:  # the triton backend's mask, wherever the kernels run
            mask = seeded_mask(seeded_mask_parameters(0.1, device=DEVICE), (40, 2))
            out = reference_edge_attention(q, k, v.float(), ei, scale=8**-0.5, bias=None,
                                           dropout_mask=mask, score="dot", negative_slope=0.2,
                                           need_alpha=False)[0]
        results[backend] = (out, *torch.autograd.grad((out.float() * w / 4).sum(), (q, k, v)))
    (out, dq, dk, dv), (want_out, want_dq, want_dk, want_dv) = results.values()
    assert out.dtype == dv.dtype == v_dtype and want_out.dtype == torch.float32
    assert_close(out, want_out.to(v_dtype))
    assert_close(dq, want_dq)  # fp32, as q: the same mask and values on both sides
    assert_close(dk, want_dk)
    assert_close(dv, want_dv)


@needs_triton
@pytest.mark.parametrize("compiled", [False, True], ids=["autograd-function", "operators"])
def test_csr_is_built_once_per_unmodified_graph(interpreter, monkeypatch, compiled):
    # The CSR cache applies to CUDA tensors; adding "cpu" runs the same code here. Two training
    # steps on one edge_index sort it once per direction; changed in place, it is sorted again
    # and the kernels see the new graph. The operators torch.compile calls keep nothing (see
    # test_compiled_graph_reusing_a_buffer_for_another_edge_index): they sort at every call,
    # by target in the forward and again in the backward, by source in the backward.
    monkeypatch.setattr(_tensor_cache, "CACHED_DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(tk, "_CSR_CACHE", TensorCache(max_entries=8))
    builds = []
    build_csr = tk.build_csr

    def counting_build_csr(rows, other, num_rows, num_other):
        builds.append(num_rows)
        return build_csr(rows, other, num_rows, num_other)

    monkeypatch.setattr(tk, "build_csr", counting_build_csr)
    if compiled:  # the operators torch.compile calls, run eagerly
        monkeypatch.setattr(tk, "apply_function",
                            lambda function, *args: tk._forward_op(*args))
    ei = random_graph(7, 20, seed=3, num_dst=5).to(DEVICE)
    inputs = attention_inputs(7, 5, 20, 2, 8)
    per_step = [5, 5, 7] if compiled else [5, 7]  # by target (5 rows), by source (7 rows)
    first = check_against_reference(inputs, ei)
    assert sorted(builds) == per_step
    second = run_backend(tk.triton_edge_attention, inputs, ei)
    assert sorted(builds) == sorted(per_step * (2 if compiled else 1))
    assert len(tk._CSR_CACHE) == (0 if compiled else 2)
    for name, value in first.items():
        assert torch.equal(value, second[name]), name
    ei[1] = ei[1].flip(0)  # the same tensor, other targets
    check_against_reference(inputs, ei)
    assert sorted(builds) == sorted(per_step * (3 if compiled else 2))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_pyg_edge_index_reaches_the_kernels_as_its_data(triton_device, dtype):
    """PyG's EdgeIndex wraps its data: its own data pointer is 0, and the kernels read the
    graph through pointers ("Attempted to access the data pointer on an invalid python
    storage" in the interpreter). The layer and the operator take it as the plain tensor it
    wraps: the same outputs and gradients."""
    from torch_geometric import EdgeIndex

    from graphattn.nn import GraphSelfAttention

    ei = random_graph(9, 30, seed=4).to(triton_device, dtype)
    wrapped = EdgeIndex(ei, sparse_size=(9, 9))
    q, k, v = (torch.randn(9, 2, 4, device=triton_device) for _ in range(3))
    want = edge_attention(q, k, v, ei, backend="triton")
    got = edge_attention(q, k, v, wrapped, backend="triton")
    assert_close(got, want)
    layer = GraphSelfAttention(6, 4, heads=2, add_self_loops=False, backend="triton").to(
        triton_device)
    x = torch.randn(9, 6, device=triton_device, requires_grad=True)
    results = []
    for graph in (ei, wrapped):
        out = layer(x, graph)
        results.append((out, *torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])))
    for a, b in zip(*results, strict=True):
        assert_close(a, b)


@needs_triton
def test_write_through_an_edge_index_wrapper_sorts_the_graph_again(interpreter, monkeypatch):
    """A write into PyG's ``EdgeIndex`` does not bump the version counter of the tensor it
    wraps, which the CSR cache keys on: the kernels ran on the graph before the write."""
    from torch_geometric import EdgeIndex

    monkeypatch.setattr(_tensor_cache, "CACHED_DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(tk, "_CSR_CACHE", TensorCache(max_entries=8))
    ei = random_graph(7, 20, seed=3, num_dst=7).to(DEVICE)
    wrapped = EdgeIndex(ei.clone(), sparse_size=(7, 7))
    inputs = on_device(attention_inputs(7, 7, 20, 2, 8, bias=False))
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    edge_attention(q, k, v, wrapped, backend="triton")
    wrapped[0] = wrapped[0].flip(0)  # other sources for the same targets
    assert_close(edge_attention(q, k, v, wrapped, backend="triton"),
                 edge_attention(q, k, v, wrapped.as_tensor().clone(), backend="reference"))


@pytest.fixture
def csr_builds(monkeypatch):
    """The node counts of the CSR orderings built from now on, with the caches on for CPU
    tensors too ("cpu" added runs CUDA's code) and empty."""
    monkeypatch.setattr(_tensor_cache, "CACHED_DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(tk, "_CSR_CACHE", TensorCache(max_entries=8))
    monkeypatch.setattr(attention, "_INT64_IDS", TensorCache(max_entries=8))
    builds = []
    build_csr = tk.build_csr
    monkeypatch.setattr(tk, "build_csr", lambda *args: builds.append(args[2]) or build_csr(*args))
    return builds


@needs_triton
def test_csr_is_built_once_per_unmodified_int32_graph(interpreter, csr_builds):
    """An int32 edge_index reaches the backends as int64: a copy made at every call was a new
    graph to the CSR cache, sorted again at every training step. The copy is kept while the
    int32 graph lives unmodified (CUDA; "cpu" added here runs the same code)."""
    builds = csr_builds
    ei = random_graph(7, 20, seed=3, num_dst=7).to(DEVICE, torch.int32)
    inputs = on_device(attention_inputs(7, 7, 20, 2, 8, bias=False))
    want = edge_attention(inputs["q"], inputs["k"], inputs["v"], ei.long(), backend="reference")
    for _ in range(3):
        out = edge_attention(inputs["q"], inputs["k"], inputs["v"], ei, backend="triton")
        out.sum().backward()
        assert_close(out, want)
    assert sorted(builds) == [7, 7]  # once by target, once by source
    assert attention.int64_ids(ei) is attention.int64_ids(ei)
    assert attention.int64_ids(ei).dtype == torch.int64
    ei[0] = ei[0].flip(0)  # changed in place: another graph, sorted again
    out = edge_attention(inputs["q"], inputs["k"], inputs["v"], ei, backend="triton")
    assert_close(out, edge_attention(inputs["q"], inputs["k"], inputs["v"], ei.long(),
                                     backend="reference"))
    assert len(builds) == 3


@needs_triton
def test_csr_is_built_once_per_unmodified_strided_graph(interpreter, csr_builds):
    """An [E, 2] table transposed is a strided int64 edge_index: its contiguous copy, made at
    every call, was a new graph to the CSR cache. The copy is kept as an int32 graph's is."""
    builds = csr_builds
    table = random_graph(7, 20, seed=3, num_dst=7).to(DEVICE).t().contiguous()  # [E, 2]
    ei = table.t()
    assert not ei.is_contiguous()
    inputs = on_device(attention_inputs(7, 7, 20, 2, 8, bias=False))
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    want = edge_attention(q, k, v, ei.contiguous(), backend="reference")
    for _ in range(3):
        assert_close(edge_attention(q, k, v, ei, backend="triton"), want)
    assert builds == [7]
    table[:, 0] = table[:, 0].flip(0)  # changed in place through the table: sorted again
    assert_close(edge_attention(q, k, v, ei, backend="triton"),
                 edge_attention(q, k, v, ei.contiguous(), backend="reference"))
    assert builds == [7, 7]


@needs_triton
def test_compiled_graph_reusing_a_buffer_for_another_edge_index(interpreter, monkeypatch):
    # Inductor gives a dead intermediate's buffer to a later one ("buf22 = buf8; del buf8  #
    # reuse"): the same tensor object, rewritten by its kernels without a version bump. Two
    # graphs built in one compiled function, a second one of the first's size, must each get
    # their own CSR, not the first's kept for the reused buffer.
    monkeypatch.setattr(_tensor_cache, "CACHED_DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(tk, "_CSR_CACHE", TensorCache(max_entries=8))
    torch.manual_seed(0)
    ei = torch.randint(0, 5, (2, 12), device=DEVICE)
    q, k, v = (torch.randn(5, 1, 4, device=DEVICE) for _ in range(3))

    def two_graphs(q, k, v, ei):
        first = edge_attention(q, k, v, ei.flip(1), backend="triton")  # the same edges
        # the reversed edges, computed once first is done: into first's edge_index buffer
        reversed_ei = ei.flip(0) + (first.sum() > 1e30).long()
        return first, edge_attention(q, k, v, reversed_ei, backend="triton")

    torch._dynamo.reset()
    with torch.no_grad():
        expected = two_graphs(q, k, v, ei)
        got = torch.compile(two_graphs, fullgraph=True)(q, k, v, ei)
    assert_close(got[0], expected[0])
    assert_close(got[1], expected[1])


@needs_triton
def test_graph_kept_during_inference_mode_serves_the_next_training_step(interpreter,
                                                                        monkeypatch):
    # Evaluating under torch.inference_mode() fills the caches (self-loops, bounds, CSR);
    # training on the same graph afterwards must work and match the reference backend.
    from graphattn.nn import GraphSelfAttention
    from graphattn.nn import attention as nn_attention

    monkeypatch.setattr(_tensor_cache, "CACHED_DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(tk, "_CSR_CACHE", TensorCache(max_entries=8))
    monkeypatch.setattr(_checks, "_EDGE_INDEX_BOUNDS", TensorCache(max_entries=16))
    monkeypatch.setattr(nn_attention, "_SELF_LOOPED", TensorCache(max_entries=8))
    torch.manual_seed(0)
    ei = random_graph(6, 20, seed=5).to(DEVICE)
    x = torch.randn(6, 16, device=DEVICE)
    fused = GraphSelfAttention(16, 8, heads=2, backend="triton").to(DEVICE)
    reference = GraphSelfAttention(16, 8, heads=2, backend="reference").to(DEVICE)
    reference.load_state_dict(fused.state_dict())
    with torch.inference_mode():
        fused(x, ei)
    assert len(tk._CSR_CACHE) == 1 and len(nn_attention._SELF_LOOPED) == 1
    fused(x, ei).square().sum().backward()
    reference(x, ei).square().sum().backward()
    for p, q in zip(fused.parameters(), reference.parameters(), strict=True):
        assert_close(p.grad, q.grad)


class _NoLaunch:
    """A kernel whose launches do nothing: the host work of a call alone."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@needs_triton
@pytest.mark.parametrize("case", ["edge_attention", "layer", "layer_loops_edge_attr"])
def test_repeated_step_on_one_graph_sorts_and_reads_back_nothing(interpreter, monkeypatch, case):
    # What torch records of a second training step on the same edge_index (the caches on, as
    # on CUDA; the kernel launches stubbed out): no sort, no search, no bounds read back, no
    # data-dependent selection of self-loops.
    from torch.profiler import ProfilerActivity, profile

    from graphattn.nn import GraphSelfAttention
    from graphattn.nn import attention as nn_attention

    monkeypatch.setattr(_tensor_cache, "CACHED_DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(tk, "_CSR_CACHE", TensorCache(max_entries=8))
    monkeypatch.setattr(_checks, "_EDGE_INDEX_BOUNDS", TensorCache(max_entries=16))
    monkeypatch.setattr(nn_attention, "_SELF_LOOPED", TensorCache(max_entries=8))
    # the self-loops found by torch ops, as for CUDA tensors (CPU tensors take a CPU kernel)
    monkeypatch.setattr(nn_attention, "host_readable", lambda t: False)
    monkeypatch.setattr(tk, "kernels", lambda: types.SimpleNamespace(
        forward_kernel=_NoLaunch(), backward_target_kernel=_NoLaunch(),
        backward_source_kernel=_NoLaunch()))
    ei = random_graph(6, 20, seed=4).to(DEVICE)
    ei[:, :3] = torch.tensor([[0, 1, 2], [0, 1, 2]])  # self-loops, replaced by the layer
    edge_attr = torch.randn(20, 3, device=DEVICE)
    q, k, v = (torch.randn(6, 2, 8, device=DEVICE, requires_grad=True) for _ in range(3))
    x = torch.randn(6, 16, device=DEVICE)
    loops = case == "layer_loops_edge_attr"
    module = GraphSelfAttention(16, 8, heads=2, add_self_loops=loops, backend="triton",
                                edge_dim=3 if loops else None).to(DEVICE)

    def step():
        if case == "edge_attention":
            out = edge_attention(q, k, v, ei, backend="triton")
        else:
            out = module(x, ei, edge_attr if loops else None)
        out.sum().backward()

    def recorded():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        return {event.name for event in prof.events()}

    first = recorded()
    assert {"aten::sort", "aten::searchsorted", "aten::amax"} <= first  # the work is seen
    assert ("aten::nonzero" in first) == loops
    second = recorded()
    for name in ("aten::sort", "aten::searchsorted", "aten::min", "aten::amax",
                 "aten::nonzero", "aten::masked_select", "aten::bincount", "aten::item",
                 "aten::_local_scalar_dense"):
        assert name not in second, name


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_inference_writes_out_in_its_dtype(interpreter, monkeypatch, dtype):
    """Without a gradient to compute, the forward kernel writes out in the dtype of v: no fp32
    buffer (which backward's delta needs) and no conversion after it; the values are those of
    a training call's out, converted."""
    written = record_out_dtypes(monkeypatch, tk, "fused_forward")
    ei = random_graph(30, 200, seed=6).to(DEVICE)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(30, 4, 16, generator=gen).to(DEVICE, dtype) for _ in range(3))
    bias = torch.randn(200, 4, generator=gen).to(DEVICE, dtype)
    trained = edge_attention(q, k, v.requires_grad_(), ei, bias=bias, backend="triton")
    with torch.no_grad():
        inferred = edge_attention(q, k, v, ei, bias=bias, backend="triton")
    assert written == [torch.float32, dtype]
    assert inferred.dtype == dtype
    if dtype == torch.bfloat16 and DEVICE.type == "cpu":
        # the interpreter truncates fp32 to bf16 where GPUs (and torch) round to nearest even:
        # one unit in the last place at most
        assert_close(inferred, trained.detach(), atol=0.0, rtol=2.0**-7)
    else:
        assert torch.equal(inferred, trained.detach())


def test_auto_picks_triton_only_for_cuda(monkeypatch):
    q = torch.randn(3, 2, 8)
    ei = torch.tensor([[0], [1]])
    assert attention.select_backend(q, ei) != "triton"
    assert not tk.use_triton_for(q)
    meta = torch.empty(3, 2, 8, device="meta")
    monkeypatch.setattr(tk, "triton_available", lambda: True)
    assert not tk.use_triton_for(meta)
    cuda_like = type("CudaLike", (), {"device": torch.device("cuda"), "dtype": torch.float16})()
    assert tk.use_triton_for(cuda_like)
    monkeypatch.setattr(tk, "triton_available", lambda: False)
    assert not tk.use_triton_for(cuda_like)


def test_triton_is_unavailable_when_it_does_not_import(monkeypatch):
    """Without triton installed, ``import triton`` fails: the backend is not listed (and
    edge_attention(backend="triton") refuses by name, test_clear_error_without_triton)."""
    monkeypatch.setattr(tk, "_TRITON_IMPORT", {})  # not yet tried
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert tk.triton_available() is False
    assert "triton" not in attention.available_backends()


def test_clear_csr_cache_frees_the_kept_orderings(monkeypatch):
    monkeypatch.setattr(_tensor_cache, "CACHED_DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.setattr(tk, "_CSR_CACHE", TensorCache(max_entries=8))
    ei = random_graph(7, 20, seed=3, num_dst=5)
    tk.graph_csr(ei, by_target=True, num_dst=5, num_src=7)
    tk.graph_csr(ei, by_target=False, num_dst=5, num_src=7)
    assert len(tk._CSR_CACHE) == 2
    tk.clear_csr_cache()
    assert len(tk._CSR_CACHE) == 0


def _call_through(route: str, f, q: torch.Tensor):
    """``f(q)`` called plainly, under torch.func.vmap or jvp, or on a forward-mode dual q: the
    last three run the reference path in place of the kernels (edge_attention's docstring)."""
    if route == "plain":
        return f(q)
    if route == "vmap":
        return torch.func.vmap(f)(q.expand(2, *q.shape))
    if route == "jvp":
        return torch.func.jvp(f, (q,), (torch.ones_like(q),))
    with fwAD.dual_level():
        return f(fwAD.make_dual(q, torch.ones_like(q)))


ROUTES = ["plain", "vmap", "jvp", "dual"]


@pytest.mark.parametrize("route", ROUTES)
def test_clear_error_without_triton(monkeypatch, route):
    monkeypatch.setattr(tk, "triton_available", lambda: False)
    inputs = attention_inputs(3, 3, 1, 1, 8)
    with pytest.raises(ImportError, match=r"needs the optional package triton.*graphattn\[gpu\]"):
        _call_through(route, lambda q: edge_attention(q, inputs["k"], inputs["v"],
                                                      torch.tensor([[0], [1]]), backend="triton"),
                      inputs["q"])


@needs_triton
@pytest.mark.parametrize("route", ROUTES)
def test_clear_error_for_cpu_tensors_outside_interpreter(monkeypatch, route):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inputs = attention_inputs(3, 3, 1, 1, 8)
    with pytest.raises(ValueError, match="runs on CUDA tensors, got q on cpu"):
        _call_through(route, lambda q: edge_attention(q, inputs["k"], inputs["v"],
                                                      torch.tensor([[0], [1]]), backend="triton"),
                      inputs["q"])


@needs_triton
@pytest.mark.parametrize("route", ROUTES)
def test_clear_error_for_float64(interpreter, route):
    inputs = on_device(attention_inputs(3, 3, 1, 1, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="float32, float16 and bfloat16 inputs, got q of dtype"):
        _call_through(route, lambda q: edge_attention(
            q, inputs["k"], inputs["v"], torch.tensor([[0], [1]], device=DEVICE),
            backend="triton"), inputs["q"])
    # float64 sinks beside fp32 inputs: the kernels read them as fp32 (1e39 became inf, and
    # the rows NaN)
    single = on_device(attention_inputs(3, 3, 1, 1, 8))
    sinks = torch.tensor([1e39], dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16 inputs, got sinks of "
                                        "dtype torch.float64"):
        _call_through(route, lambda q: edge_attention(
            q, single["k"], single["v"], torch.tensor([[0], [1]], device=DEVICE), sinks=sinks,
            backend="triton"), single["q"])


@pytest.mark.parametrize("heads,channels,score_channels,expected", [
    (1, 8, None, (32, 1, 8, 8)), (4, 16, None, (32, 4, 16, 16)), (8, 64, None, (16, 2, 64, 64)),
    (3, 12, None, (32, 4, 16, 16)), (1, 1000, None, (2, 1, 1024, 1024)),
    (8, 64, 1, (16, 2, 64, 1)), (8, 8, 64, (16, 2, 8, 64)), (4, 12, 5, (32, 4, 16, 8)),
])
def test_launch_config_tiles(heads, channels, score_channels, expected):
    cfg = tk.launch_config(heads, channels, score_channels)
    assert (cfg.block_e, cfg.block_h, cfg.block_c, cfg.block_ck) == expected
    assert cfg.block_e * cfg.block_h * max(cfg.block_c, cfg.block_ck) <= 2048
    assert 1 <= cfg.num_warps <= 4


@needs_triton
@pytest.mark.parametrize("score,tiles,degree", [
    ("dot", dict(block_e=1, block_h=1, num_warps=1), 7),
    ("additive", dict(block_e=4, block_h=2, num_warps=2), 15),
    ("gatv2", dict(block_e=4, block_h=2, num_warps=2), 15),
    ("dot", dict(block_e=64, num_warps=8), 70),
    ("gatv2", dict(block_e=64, num_warps=8), 70),
], ids=["dot-1x1", "additive-4x2", "gatv2-4x2", "dot-64", "gatv2-64"])
def test_launch_tiles_run_every_kernel_with_them(interpreter, monkeypatch, score, tiles,
                                                 degree):
    """Under ``launch_tiles`` each of the three kernels is launched with the tiles given (the
    rest as ``launch_config`` picks them) and still computes the reference's outputs, weights
    and gradients: a row of 7, 15 or 70 edges over 1, 4 or 64 edges per step (a last step
    part full), 4 heads over 1 or 2 heads per program."""
    names = ("forward_kernel", "backward_target_kernel", "backward_source_kernel")
    launches = spy_on_launches(monkeypatch, names)
    ei = star_graph(degree)
    inputs = attention_inputs(40, 40, ei.size(1), 4, 8, score=score, seed=6)
    default = tk.launch_config(4, 8, 1 if score == "additive" else 8)
    with tk.launch_tiles(**tiles):
        check_against_reference(inputs, ei, score=score)
    expected = (tiles["block_e"], tiles.get("block_h", default.block_h), tiles["num_warps"])
    assert [(name, kw["BLOCK_E"], kw["BLOCK_H"], kw["num_warps"])
            for name, _, kw in launches] == [(name, *expected) for name in names]
    assert tk.launch_config(4, 8) == tk.launch_config(4, 8, 8)  # the defaults again after


@pytest.mark.parametrize("tiles,message", [
    (dict(block_e=3), "block_e must be a power of 2, got 3"),
    (dict(block_h=0), "block_h must be a power of 2, got 0"),
    (dict(block_e=8.0), "block_e must be a power of 2, got 8.0"),
    (dict(num_warps=3), r"num_warps must be one of \[1, 2, 4, 8, 16\], got 3"),
    (dict(block_n=6), "block_n must be a power of 2, got 6"),
    (dict(heavy_degree=-1), "heavy_degree must be a non-negative integer, got -1"),
    (dict(heavy_degree=2.5), "heavy_degree must be a non-negative integer, got 2.5"),
])
def test_launch_tiles_errors_name_the_argument(tiles, message):
    with pytest.raises(ValueError, match=message), tk.launch_tiles(**tiles):
        pass
    assert tk._TILES == {}


def test_launch_tiles_nest_and_restore():
    default = tk.launch_config(4, 32)
    with tk.launch_tiles(block_e=8, block_h=16):
        # block_h is capped at the next power of 2 >= H
        assert (tk.launch_config(4, 32).block_e, tk.launch_config(4, 32).block_h) == (8, 4)
        with tk.launch_tiles(num_warps=1):
            assert tk.launch_config(3, 32) == tk.LaunchConfig(8, 4, 32, 1, 32)
        assert tk.launch_config(4, 32).num_warps == default.num_warps
        with pytest.raises(RuntimeError), tk.launch_tiles(block_e=2):
            raise RuntimeError
        assert tk.launch_config(4, 32).block_e == 8
    assert tk.launch_config(4, 32) == default


def test_launch_tiles_blocks_of_many_threads_leave_nothing_and_tear_no_reads():
    """Threads opening and closing blocks of their own at once (the setting is process-wide):
    two closing together deleted each other's entries by a stale position, raised, and left
    their tiles in force for good (launch_config(2, 8) then gave block_e=4 outside any
    block); a launch while another thread's block opened or closed read the settings
    half-rebuilt (block_e=32 inside launch_tiles(block_e=4), or "dictionary changed size")."""
    import threading

    errors, seen, stop = [], set(), threading.Event()

    def churn(block_e):
        try:
            while not stop.is_set():
                with tk.launch_tiles(block_e=block_e, num_warps=None if block_e else 2):
                    pass
        except BaseException as error:  # noqa: BLE001 (any error of a thread fails the test)
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between the steps of a block's entry and exit
    try:
        with tk.launch_tiles(block_e=4):
            threads = [threading.Thread(target=churn, args=(block_e,))
                       for block_e in (None, 1, 2, 8, 16)]
            for thread in threads:
                thread.start()
            for _ in range(20000):
                seen.add(tk.launch_config(2, 8).block_e)
            stop.set()
            for thread in threads:
                thread.join(timeout=60)
    finally:
        stop.set()
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert tk._OPEN_TILES == [] and tk._TILES == {}
    assert tk.launch_config(2, 8) == tk.launch_config(2, 8, 8)
    assert seen <= {1, 2, 4, 8, 16}  # never the default 32: the reader's own block is open


def test_launch_tiles_blocks_closed_out_of_order_leave_the_open_ones():
    """Two threads: A opens, B opens, A closes, B closes. B restored the tiles it saw on entry,
    A's, which then stayed in force for every later launch of the process."""
    default = tk.launch_config(4, 32)
    a, b = tk.launch_tiles(block_e=8), tk.launch_tiles(num_warps=1)
    a.__enter__()
    b.__enter__()
    assert (tk.launch_config(4, 32).block_e, tk.launch_config(4, 32).num_warps) == (8, 1)
    a.__exit__(None, None, None)
    assert tk.launch_config(4, 32).block_e == default.block_e  # A's tiles are gone
    assert tk.launch_config(4, 32).num_warps == 1  # B's stay while B is open
    b.__exit__(None, None, None)
    assert tk.launch_config(4, 32) == default


class _NaNFilledEmpty:
    """torch for the triton backend's module, but with ``empty`` and ``empty_like`` filled
    with NaN (floating point): a row no kernel writes cannot pass for a computed one."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _nan(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty(self, *args, **kwargs):
        return self._nan(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._nan(torch.empty_like(*args, **kwargs))


@needs_triton
@pytest.mark.parametrize("score", attention.SCORES)
def test_row_blocks_give_each_heavy_row_a_program(interpreter, monkeypatch, score):
    """With ``block_n > 1`` each pass is two launches: the one-node kernel over the first
    E // (heavy_degree + 1) rows of the degree order (``HEAVY_ONLY``: the rows of more than
    heavy_degree edges are among them, and it writes those alone), then the row-block kernel
    over all rows, ``block_n`` per program, which writes the others. Every row is written
    once: the outputs are allocated with torch.empty, filled here with NaN, and match the
    reference."""
    launches = spy_on_launches(monkeypatch,
                               [*tk.ROW_BLOCK_KERNELS, *tk.ROW_BLOCK_KERNELS.values()])
    monkeypatch.setattr(tk, "torch", _NaNFilledEmpty())
    ei = star_graph(30, extra=40)  # target 0: 30 edges; the others few, and 0 for some
    inputs = attention_inputs(40, 40, ei.size(1), 4, 8, score=score, seed=3)
    with tk.launch_tiles(block_n=8, heavy_degree=5):
        check_against_reference(inputs, ei, score=score)
    heavy = ei.size(1) // 6
    assert [(name, grid[0], kw.get("BLOCK_N"), kw.get("HEAVY_ONLY", False))
            for name, grid, kw in launches] == [
        ("forward_kernel", heavy, None, True), ("forward_rows_kernel", 5, 8, False),
        ("backward_target_kernel", heavy, None, True),
        ("backward_target_rows_kernel", 5, 8, False),
        ("backward_source_kernel", heavy, None, True),
        ("backward_source_rows_kernel", 5, 8, False)]


@needs_triton
@pytest.mark.parametrize("edges_short", [0, 1], ids=["hub-launch", "one-launch"])
def test_rows_of_many_sum_blocks_get_a_launch_of_their_own(interpreter, monkeypatch,
                                                           edges_short):
    """On a graph of at least ``HUB_EDGES`` edges (here exactly that many) each pass is two
    launches of its one-node kernel: all rows, leaving out those of more than one block
    (``LIGHT_ONLY``, fp32 sums, ``SUM_STEPS=0``), then the first E // (block + 1) rows of the
    degree order (``HEAVY_ONLY``, float64 block sums), which write those. One edge short of
    it, one launch of the fp32 kernel. Every row is written once (outputs allocated with
    torch.empty, filled here with NaN) and matches the reference."""
    ei = star_graph(30, extra=40)  # target 0: 30 edges; the others few, and 0 for some
    monkeypatch.setattr(tk, "SUM_STEPS", 2)
    monkeypatch.setattr(tk, "HUB_EDGES", ei.size(1) + edges_short)
    launches = spy_on_launches(monkeypatch, list(tk.ROW_BLOCK_KERNELS))
    monkeypatch.setattr(tk, "torch", _NaNFilledEmpty())
    inputs = attention_inputs(40, 40, ei.size(1), 4, 8, score="gatv2", seed=3)
    with tk.launch_tiles(block_e=2):
        check_against_reference(inputs, ei, score="gatv2")
    plan = [(name, grid[0], kw["SUM_STEPS"], kw.get("LIGHT_ONLY", False),
             kw.get("HEAVY_ONLY", False)) for name, grid, kw in launches]
    if edges_short:
        assert plan == [(name, 40, 0, False, False) for name in tk.ROW_BLOCK_KERNELS]
        return
    hubs = ei.size(1) // 5  # rows of more than 2 tiles of 2 edges
    assert plan == [row for name in tk.ROW_BLOCK_KERNELS
                    for row in ((name, 40, 0, True, False), (name, hubs, 2, False, True))]


@needs_triton
@pytest.mark.parametrize("heavy_degree", [0, 3, 1000])
def test_row_blocks_on_a_graph_of_skewed_degrees(interpreter, heavy_degree):
    """Degrees from 0 to 60 (a few hubs, many leaves) in and out, with a bias and dropout (a
    mask read, and one drawn from a seed): every row heavy (heavy_degree 0), some, or none;
    blocks of 2 nodes."""
    gen = torch.Generator().manual_seed(11)
    hubs = torch.tensor([3, 3, 3, 17, 17, 29])
    dst = torch.cat([hubs.repeat_interleave(torch.tensor([20, 20, 20, 15, 15, 10])),
                     torch.randint(0, 32, (40,), generator=gen)])
    src = torch.cat([torch.randint(0, 32, (100,), generator=gen), hubs.repeat(7)[:40]])
    ei = torch.stack([src, dst])
    inputs = attention_inputs(32, 32, ei.size(1), 2, 8, score="dot", bias=True, seed=5)
    keep = torch.rand(ei.size(1), 2, generator=gen) > 0.3
    torch.manual_seed(heavy_degree)
    seeded = seeded_mask_parameters(0.3, device=DEVICE)
    with tk.launch_tiles(block_n=2, heavy_degree=heavy_degree):
        check_against_reference(inputs, ei, dropout_mask=keep.float() / 0.7)
        check_against_reference(inputs, ei, dropout_mask=seeded)


@st.composite
def row_block_cases(draw):
    """A bipartite graph (0 to 9 nodes a side, multi-edges and self-loops allowed, degrees
    skewed by drawing endpoints from a few nodes more often), a score, heads, channels, and
    row-block tiles: 2 to 8 nodes per program, heavy_degree 0 to 8."""
    n_src, n_dst = draw(st.integers(0, 9)), draw(st.integers(0, 9))
    num_edges = draw(st.integers(0, 30)) if n_src and n_dst else 0
    endpoint = st.integers(0, 2**16)
    src = [draw(endpoint) % (n_src if draw(st.booleans()) else min(n_src, 2)) for _ in
           range(num_edges)]
    dst = [draw(endpoint) % (n_dst if draw(st.booleans()) else min(n_dst, 2)) for _ in
           range(num_edges)]
    return dict(edge_index=torch.tensor([src, dst], dtype=torch.long).view(2, num_edges),
                n_src=n_src, n_dst=n_dst, score=draw(st.sampled_from(attention.SCORES)),
                heads=draw(st.integers(1, 3)), channels=draw(st.integers(1, 9)),
                bias=draw(st.booleans()),
                tiles=dict(block_n=draw(st.sampled_from([2, 4, 8])),
                           heavy_degree=draw(st.integers(0, 8))))


@needs_triton
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=row_block_cases())
def test_row_blocks_match_reference_on_drawn_graphs(interpreter, case):
    """Drawn graphs, sizes and row-block tiles: outputs, weights and gradients as the
    reference backend's (derandomized: CI runs the same draws)."""
    inputs = attention_inputs(case["n_src"], case["n_dst"], case["edge_index"].size(1),
                              case["heads"], case["channels"], score=case["score"],
                              bias=case["bias"], seed=case["edge_index"].size(1))
    with tk.launch_tiles(**case["tiles"]):
        check_against_reference(inputs, case["edge_index"], score=case["score"])


@pytest.mark.parametrize("tiles,warps", [(dict(block_n=16), 8), (dict(block_n=8), 4),
                                         (dict(block_n=2), 1), (dict(block_n=64), 8),
                                         (dict(block_n=16, num_warps=2), 2)])
def test_row_block_tiles_set_the_warps(tiles, warps):
    """H = 4, C = 32: one warp per 256 values of the row-block tile (16 nodes: 2048 values, 8
    warps; 8 nodes: 4; 2 nodes: 1), at most 8, unless the warps are given."""
    with tk.launch_tiles(**tiles):
        cfg = tk.launch_config(4, 32)
    assert (cfg.block_n, cfg.num_warps, cfg.heavy_degree) == (tiles["block_n"], warps, 256)
    assert tk.launch_config(4, 32).block_n == 1


@needs_triton
def test_launch_tiles_inside_a_compiled_function_are_not_traced_away(interpreter, monkeypatch):
    """Entered inside the function torch.compile compiles, launch_tiles would be traced as a
    side effect on ``_TILES``, replayed (set, then restored) after the graph has launched the
    kernels with the defaults. It refuses to be traced: the frame runs eagerly, with the
    tiles; ``fullgraph=True`` fails instead of running without them."""
    launched, launch_config = [], tk.launch_config

    def spy(*args):
        cfg = launch_config(*args)
        launched.append((cfg.block_e, cfg.block_h, cfg.num_warps))
        return cfg

    monkeypatch.setattr(tk, "launch_config", spy)
    ei = star_graph(7).to(DEVICE)
    q = torch.randn(ei.max().item() + 1, 4, 8, device=DEVICE)

    def attend(q):
        with tk.launch_tiles(block_e=2, block_h=1, num_warps=1):
            return edge_attention(q, q, q, ei, backend="triton")

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(attend, backend="aot_eager")(q)
        assert launched == [(2, 1, 1)]
        assert_close(got, edge_attention(q, q, q, ei, backend="reference"))
        torch._dynamo.reset()  # the frame is not left marked as run eagerly
        with pytest.raises(Exception) as refused:
            torch.compile(attend, backend="aot_eager", fullgraph=True)(q)
        # torch 2.11 and 2.13 quote launch_tiles's message; 2.8 names the exception's place
        message = str(refused.value)
        assert ("outside the function that torch.compile" in message
                or ("Observed exception" in message and "tk.launch_tiles(" in message)), message
    assert tk._TILES == {}


def test_build_csr_groups_rows_stably():
    rows = torch.tensor([2, 0, 2, 1, 0, 2])
    other = torch.tensor([10, 11, 12, 13, 14, 15])
    csr = tk.build_csr(rows, other, num_rows=4, num_other=16)
    assert csr.ptr.tolist() == [0, 2, 3, 6, 6]
    assert csr.edge_id.tolist() == [1, 4, 3, 0, 2, 5]
    assert csr.order.tolist() == [2, 0, 1, 3]  # by decreasing degree (3, 2, 1, 0)
    assert csr.other.tolist() == [11, 14, 13, 10, 12, 15]
    assert csr.ptr.dtype == torch.int32
    empty = tk.build_csr(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                         num_rows=3, num_other=2)
    assert empty.ptr.tolist() == [0, 0, 0, 0] and empty.edge_id.numel() == 0
    no_rows = tk.build_csr(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                           num_rows=0, num_other=2)
    assert no_rows.ptr.tolist() == [0]


def test_build_csr_keeps_edge_order_within_rows_of_many_ties():
    """1000 edges on 3 rows: an unstable sort reorders ties at this size (torch's does on CPU),
    and with them the summation order of each row."""
    rows = torch.randint(0, 3, (1000,), generator=torch.Generator().manual_seed(0))
    csr = tk.build_csr(rows, torch.arange(1000), num_rows=3, num_other=1000)
    for r in range(3):
        ids = csr.edge_id[csr.ptr[r]:csr.ptr[r + 1]].long()
        assert torch.equal(ids, (rows == r).nonzero().flatten()), r
    assert torch.equal(csr.other, csr.edge_id)


@pytest.mark.parametrize("num_other,dtype", [(2**31 - 2, torch.int32), (2**31 - 1, torch.int64),
                                             (2**31 + 1, torch.int64)])
def test_build_csr_index_dtype_at_the_int32_limit(num_other, dtype):
    """Ids are int32 while every value fits, int64 beyond: a source id of 2**31 would wrap."""
    other = torch.tensor([0, num_other - 1])
    csr = tk.build_csr(torch.tensor([1, 0]), other, num_rows=2, num_other=num_other)
    assert csr.ptr.dtype == csr.other.dtype == csr.edge_id.dtype == dtype
    assert csr.other.tolist() == [num_other - 1, 0]


@pytest.mark.parametrize("num_edges,dtype", [
    (2**31 - 1 - tk.CSR_POSITION_MARGIN - 1, torch.int32),
    (2**31 - 1 - tk.CSR_POSITION_MARGIN, torch.int64), (2**31 - 2, torch.int64)])
def test_csr_positions_stay_int32_only_a_margin_below_the_limit(num_edges, dtype):
    """A row ending at position 2^31 - 2 in an int32 CSR: the lanes of its last tile passed
    2^31 - 1, wrapped to negative positions below its end, and were read as its edges (Triton's
    interpreter: out off by 225 with v = 0 on the row's real sources). Positions that close to
    the limit are int64 (building a CSR of 2^31 edges takes 16 GB: the rule is checked)."""
    assert tk.csr_index_dtype(num_edges, 2, 2) == dtype


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
COMPILE_FOR_SM90 = f"""
import sys
sys.path.insert(0, {str(BENCHMARKS)!r})
import triton_resources

for score in ("dot", "additive", "gatv2"):
    for features in (False, True):
        # q, k wider than v (two channel tiles) where the score has channels
        _, usage = triton_resources.compile_kernels(
            4, 16, score, "fp16", features=features,
            score_channels=None if score == "additive" else 32)
        for name, use in usage.items():
            print("compiled", name, score, features, use["spill_stores"], use["spill_loads"])
# a dropout mask read from memory (a user's mask; the other inputs as above)
_, usage = triton_resources.compile_kernels(4, 16, "gatv2", "fp16", features=True,
                                            seeded_dropout=False)
print("read mask", len(usage))
for score in ("dot", "gatv2"):  # one tensor as both edge terms: one gradient for both roles
    _, usage = triton_resources.compile_kernels(4, 16, score, "fp16", features=True,
                                                one_edge_term=True)
    print("one edge term", usage["backward_target_kernel"]["spill_stores"])
for score in ("dot", "additive", "gatv2"):  # the row-block kernels, 16 nodes per program
    for features in (False, True):
        _, usage = triton_resources.compile_kernels(4, 16, score, "fp16", features=features,
                                                    block_n=16)
        print("row blocks", len(usage))
for score in ("additive", "gatv2"):  # the rows of many blocks: float64 block sums (dq, dk of
    # one value per head and of channels; gatv2 adds d att)
    _, usage = triton_resources.compile_kernels(4, 16, score, "fp16", features=True, hub=True)
    print("hub", len(usage))
# where a triton drops ptxas's report (3.4), ptxas runs again on the PTX: the same figures
import os
_, reported = triton_resources.compile_kernels(4, 16, "dot", "fp16", features=True)
os.environ["TRITON_DUMP_PTXAS_LOG"] = "0"
runs, ptxas_report = [], triton_resources.ptxas_report
triton_resources.ptxas_report = lambda *args: runs.append(args) or ptxas_report(*args)
_, again = triton_resources.compile_kernels(4, 16, "dot", "fp16", features=True)
print("ptxas again", len(runs), again == reported, reported["forward_kernel"]["registers"])
"""


@needs_triton
def test_kernels_compile_for_sm90():
    """The interpreter does not run Triton's compiler, so compile every kernel (fp16, every
    score, with no optional input and with all of them, the dropout mask drawn from a seed
    and read from a tensor, and with one tensor as both edge terms; the row-block kernels
    and the one-node kernels of the rows of many blocks too) for sm_90 (H100/H200) ahead of time, as
    ``benchmarks/triton_resources.py`` does; no GPU needed. The forward kernel, the one the
    bandwidth figures are about, must not spill registers. Where ptxas runs again on the PTX
    (tritons that drop its report), it reports what it reported as Triton ran it. In a fresh
    process: Triton's
    interpreter leaves ``triton.language`` patched after it ran."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_SM90], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line.split() for line in done.stdout.splitlines()
                if line.startswith("compiled")]
    assert len(compiled) == 3 * 2 * len(tk.SCORE_KINDS)
    assert done.stdout.count("one edge term") == 2
    assert done.stdout.count("read mask 3") == 1
    assert done.stdout.count("row blocks 3") == 2 * len(tk.SCORE_KINDS)
    assert done.stdout.count("hub 3") == 2
    again = next(line.split() for line in done.stdout.splitlines()
                 if line.startswith("ptxas again"))
    assert again[2:4] == ["3", "True"] and int(again[4]) > 0, again
    forward = [row for row in compiled if row[1] == "forward_kernel"]
    assert all(row[4:] == ["0", "0"] for row in forward), forward


@needs_triton
@pytest.mark.parametrize("score", attention.SCORES)
def test_gradient_through_alpha_alone(interpreter, triton_tiles, score):
    ei = random_graph(10, 30, seed=4).to(DEVICE)
    inputs = on_device(attention_inputs(10, 10, 30, 2, 8, score=score))
    wrt = [inputs[name] for name in ("q", "k", "bias", "att") if inputs[name] is not None]
    grads, alphas = [], []
    for backend in (tk.triton_edge_attention, reference_edge_attention):
        _, alpha = backend(inputs["q"], inputs["k"], inputs["v"], ei, scale=0.5,
                           bias=inputs["bias"], dropout_mask=None, score=score,
                           negative_slope=0.2, need_alpha=True, att=inputs["att"])
        weight = torch.linspace(-1, 1, alpha.numel(), device=DEVICE).view_as(alpha)
        grads.append(torch.autograd.grad((alpha * weight).sum(), wrt))
        alphas.append(alpha.detach())
    assert_close(*alphas)
    for got, want in zip(*grads, strict=True):
        assert_close(got, want)


@needs_triton
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("score", attention.SCORES)
def test_without_alpha(interpreter, triton_tiles, score, bias):
    """need_alpha=False: no scores written (and, without bias, no edge id read); alpha is None,
    out and the gradients are the reference backend's."""
    ei = random_graph(10, 30, seed=4).to(DEVICE)
    inputs = on_device(attention_inputs(10, 10, 30, 2, 8, score=score, bias=bias))
    leaves = [t for t in inputs.values() if t is not None]
    results = []
    for backend in (tk.triton_edge_attention, reference_edge_attention):
        out, alpha = backend(inputs["q"], inputs["k"], inputs["v"], ei, scale=0.5,
                             bias=inputs["bias"], dropout_mask=None, score=score,
                             negative_slope=0.2, need_alpha=False, att=inputs["att"])
        assert alpha is None
        weight = torch.linspace(-1, 1, out.numel(), device=DEVICE).view_as(out)
        results.append((out, *torch.autograd.grad((out * weight).sum(), leaves)))
    for got, want in zip(*results, strict=True):
        assert_close(got, want)


@needs_triton
@pytest.mark.parametrize("score", attention.SCORES)
def test_strided_and_expanded_inputs(interpreter, score):
    """q a transposed view, k one row expanded to every node (stride 0), a bias of stride 2:
    outputs, weights and gradients equal the reference's on the same tensors."""
    gen = torch.Generator().manual_seed(5)
    N, H, C = 12, 3, 8
    edge_index = random_graph(N, 40, seed=7).to(DEVICE)
    q_base = torch.randn(N, C, H, generator=gen).to(DEVICE).requires_grad_()
    k_row = torch.randn(1, H, C, generator=gen).to(DEVICE).requires_grad_()
    v = torch.randn(N, H, C, generator=gen).to(DEVICE).requires_grad_()
    bias_base = torch.randn(40, 2 * H, generator=gen).to(DEVICE).requires_grad_()
    att = torch.randn(H, C, generator=gen).to(DEVICE) if score == "gatv2" else None
    if score == "additive":
        q_base = torch.randn(H, N, generator=gen).to(DEVICE).requires_grad_()
        k_row = torch.randn(1, H, generator=gen).to(DEVICE).requires_grad_()
    results = []
    for backend in ("triton", "reference"):
        q = q_base.t() if score == "additive" else q_base.transpose(1, 2)
        k = k_row.expand(N, *k_row.shape[1:])
        bias = bias_base[:, ::2]
        assert not q.is_contiguous() and k.stride(0) == 0 and not bias.is_contiguous()
        out, alpha = edge_attention(q, k, v, edge_index, bias=bias, score=score, att=att,
                                    return_attention=True, backend=backend)
        grads = torch.autograd.grad((out * out).sum() + alpha.sum(),
                                    (q_base, k_row, v, bias_base))
        results.append((out, alpha, *grads))
    for got, want in zip(*results, strict=True):
        assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_triton
def test_every_launch_runs_on_the_device_of_its_inputs(interpreter, monkeypatch):
    """Triton launches on the current CUDA device, on its stream: inputs on ``cuda:1`` while
    ``cuda:0`` is current failed (or raced another device's work). Every launch of the CSR
    kernels (one-row, row-block and hub launches), the block-sparse kernels and the seeded
    mask runs inside ``on_device_of`` a tensor on the inputs' device."""
    module, guards, launches, sums = tk.kernels(), [], [], []

    @contextlib.contextmanager
    def on_device_of(tensor):
        guards.append(tensor.device)
        try:
            yield
        finally:
            guards.pop()

    class Launches:
        def __getattr__(self, name):
            kernel = getattr(module, name)

            class Grid:
                def __getitem__(self, grid):
                    def launch(*args, **kwargs):
                        launches.append((name, list(guards)))
                        sums.append(kwargs.get("SUM_STEPS", 0))
                        return kernel[grid](*args, **kwargs)
                    return launch
            return Grid()

    monkeypatch.setattr(tk, "kernels", Launches)
    monkeypatch.setattr(tk, "on_device_of", on_device_of)
    monkeypatch.setattr(tk, "HUB_EDGES", 1)  # the hub launch too, on a small graph
    monkeypatch.setattr(tk, "SUM_STEPS", 1)
    # every edge once (the block-sparse kernels take no repeated edge), node 0 a hub
    ei = torch.cat([random_graph(12, 40, seed=3), torch.stack(
        [torch.arange(12), torch.zeros(12, dtype=torch.long)])], 1).unique(dim=1).to(DEVICE)
    inputs = on_device(attention_inputs(12, 12, ei.size(1), 2, 8))
    for tiles in ({"block_e": 4}, {"block_n": 4, "heavy_degree": 8}, {"block_sparse": 32}):
        with tk.launch_tiles(**tiles):
            out, _ = tk.triton_edge_attention(
                inputs["q"], inputs["k"], inputs["v"], ei, scale=0.5, bias=inputs["bias"],
                dropout_mask=None, score="dot", negative_slope=0.2, need_alpha=False)
            out.sum().backward()
    tk.write_seeded_mask(seeded_mask_parameters(0.3, device=DEVICE), (40, 2), torch.float32)
    names = {name for name, _ in launches}
    assert {"forward_kernel", "backward_target_kernel", "backward_source_kernel",
            "block_forward_kernel", "block_backward_target_kernel",
            "block_backward_source_kernel", "seeded_mask_kernel"} <= names, names
    assert any(name in tk.ROW_BLOCK_KERNELS.values() for name in names), names
    assert max(sums) > 0  # the hub launch: rows of more than one block of block_e edges
    assert all(where == [DEVICE] for _, where in launches), launches


@needs_triton
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices: the inputs on the second, the first current")
def test_inputs_on_another_gpu_than_the_current_one():
    ei = random_graph(30, 120, seed=2).to("cuda:1")
    inputs = {n: None if t is None else t.to("cuda:1").requires_grad_()
              for n, t in attention_inputs(30, 30, 120, 2, 8).items()}
    results = []
    for backend in (tk.triton_edge_attention, reference_edge_attention):
        with torch.cuda.device(0):
            out, _ = backend(inputs["q"], inputs["k"], inputs["v"], ei, scale=0.5,
                             bias=inputs["bias"], dropout_mask=None, score="dot",
                             negative_slope=0.2, need_alpha=False)
            grads = torch.autograd.grad(out.square().sum(), [inputs["q"], inputs["k"],
                                                             inputs["v"], inputs["bias"]])
        results.append((out, *grads))
    for got, want in zip(*results, strict=True):
        assert_close(got, want)


@needs_triton
@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need the compiled kernels on a "
                    "GPU (GRAPHATTN_TRITON_DEVICE=cuda)")
def test_forward_captured_in_a_cuda_graph_replays_on_new_inputs():
    """The fused forward captured into a CUDA graph (no read back to the host inside it) and
    replayed on new q, k, v copied into its inputs computes what an eager call computes."""
    ei = random_graph(40, 160, seed=5).to(DEVICE)
    static = [torch.randn(40, 2, 8, device=DEVICE) for _ in range(3)]
    edge_attention(*static, ei, backend="triton")  # compiled and the graph checked before
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = edge_attention(*static, ei, backend="triton")
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        new = [torch.randn(40, 2, 8, generator=gen).to(DEVICE) for _ in range(3)]
        for buffer, value in zip(static, new, strict=True):
            buffer.copy_(value)
        graph.replay()
        assert_close(out, edge_attention(*new, ei, backend="reference"))
