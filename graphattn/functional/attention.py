"""Attention over the edges of a graph, and its dense twin.

``edge_attention`` is the library's one operator. It checks its arguments, draws the dropout mask,
picks a backend and hands the work over; every backend computes the same function and is tested
against :func:`reference_edge_attention`, the readable path made of plain torch ops.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal, overload

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import guard_or_false

from graphattn._checks import (
    check_batch,
    check_dropout,
    check_edge_index,
    check_flag,
    check_float_dtype,
    check_non_negative,
    check_same_device,
    check_strided,
    check_tensors,
    dense_graph_ids,
    score_factor,
)
from graphattn._tensor_cache import TensorCache
from graphattn.functional._transforms import onnx_exporting, plain_ops_only
from graphattn.functional.cpu import check_cpu_inputs, cpu_edge_attention
from graphattn.functional.dense_backend import (
    DiagonalBlocks,
    dense_edge_attention,
    dense_peak_bytes,
    diagonal_blocks,
    per_graph_attention,
    scaled_scores,
    sdpa,
    softmax_with_sinks,
)
from graphattn.functional.dropout import dropout_mask as make_dropout_mask
from graphattn.functional.dropout import seeded_mask_parameters
from graphattn.functional.edge_terms import fold_edge_terms
from graphattn.functional.reference import reference_edge_attention, repeat_kv_heads
from graphattn.functional.triton_kernels import DTYPES as TRITON_DTYPES
from graphattn.functional.triton_kernels import (
    check_triton_inputs,
    triton_available,
    triton_edge_attention,
    use_triton_for,
)

SCORES = ("dot", "additive", "gatv2")


Backend = Callable[..., tuple[Tensor, Tensor | None]]
BACKENDS: dict[str, Backend] = {"reference": reference_edge_attention,
                               "cpu": cpu_edge_attention,
                               "triton": triton_edge_attention,
                               "dense": dense_edge_attention}
# backends that take edge_key and edge_value themselves; the others get them folded in
# (graphattn.functional.edge_terms)
NATIVE_EDGE_TERMS = {"reference", "cpu", "triton"}
DENSE_REFUSES_SOFTCAP = ("backend='dense' computes its scores in scaled_dot_product_attention, "
                         "which has no soft cap: use backend='auto', 'cpu', 'triton' or "
                         "'reference' with softcap")


def available_backends() -> list[str]:
    """Names accepted by ``edge_attention(..., backend=name)`` in this installation.

    ``"triton"`` is listed only when the optional package triton imports.
    """
    return [name for name in BACKENDS if name != "triton" or triton_available()]


# The rule of backend="auto" on CPU: the crossover densities that benchmarks/sparse_vs_dense.py
# measured on 2 cores (see select_backend), by size sqrt(N_dst * N_src):
# (size, forward+backward, forward only).
DENSE_CROSSOVER_CPU = ((256, 0.16, 0.25), (1024, 0.13, 0.14), (4096, 0.11, 0.21))
# The same for block-diagonal graphs run block by block, by block size L, the density counted
# over the blocks' pairs (benchmarks/block_diagonal.py, 2 cores; see select_backend).
DENSE_CROSSOVER_CPU_BLOCKS = ((16, 0.47, 0.50), (64, 0.16, 0.22), (256, 0.11, 0.18),
                              (1024, 0.12, 0.24))
DENSE_MAX_BYTES_CPU = 2 * 2**30
# For a call that needs the weights themselves (returned, or multiplied by a dropout mask in
# training), the dense backend computes an explicit softmax, not SDPA's fused one, and its
# crossover with the sparse kernels moves up. On a whole graph, by size sqrt(N_dst N_src):
# (size, forward+backward, forward only), measured by benchmarks/explicit_weights.py on 2 cores
# (random graphs, H = 4, C = 16; at 4096 nodes and density 0.9 the ratios were those of 2048).
# From about 2048 nodes the [H, N, N] matrices leave the cache, and each pass over them costs.
EXPLICIT_CROSSOVER_CPU = ((512, 0.45, 0.55), (1024, 0.55, 0.65), (2048, 0.7, 0.9))
# The least density over the blocks at which auto runs a block-diagonal graph as dense blocks
# on CPU for such a call, in training (2 cores, H = 4, C = 16; see select_backend).
EXPLICIT_MIN_DENSITY_CPU = 0.6
# The same in inference (weights returned without a gradient): the sparse kernels' forward
# alone is cheaper still beside the dense path's explicit softmax and its gather of the weights
# (forward on 2 cores, H = 4, C = 16; see select_backend).
EXPLICIT_MIN_DENSITY_CPU_INFERENCE = 0.9
# In training, blocks of at most EXPLICIT_SMALL_BLOCK nodes take the dense path from this
# density on instead: their explicit softmax stays in cache (causal blocks of 32-128 nodes,
# density 0.5, train 1.2-1.8x faster dense; of 256 about even, of 512 1.8x slower; see
# select_backend).
EXPLICIT_MIN_DENSITY_CPU_SMALL_BLOCKS = 0.4
EXPLICIT_SMALL_BLOCK = 128



def _interpolate(table: tuple[tuple[float, float, float], ...], size: float,
                 training: bool) -> float:
    """The crossover of ``table`` at ``size``, linear in log size, constant outside it.

    Traced by ``torch.compile``, linear in the size itself: a compiled call then traces again
    only where a new size crosses one of the table's sizes (or changes the choice made)."""
    column = 1 if training else 2
    if torch.compiler.is_compiling():
        # traced by torch.compile: linear in the size itself, which stays symbolic (a
        # logarithm would fix it to the size traced, and each other size compile again)
        points = [(row[0], row[column]) for row in table]
        x = size
    else:
        points = [(math.log(row[0]), row[column]) for row in table]
        x = math.log(size) if size > 0 else points[0][0]
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def dense_min_density(num_dst: int, num_src: int, *, training: bool) -> float:
    r"""The density from which ``backend="auto"`` takes the dense path on CPU.

    Interpolates the measured crossovers ``DENSE_CROSSOVER_CPU`` linearly in
    :math:`\log \sqrt{N_{dst} N_{src}}` (held constant below the smallest and above the
    largest size measured).

    Args:
        num_dst (int): number of targets N_dst.
        num_src (int): number of sources N_src.
        training (bool): forward+backward (``True``) or forward only (``False``).
    """
    return _interpolate(DENSE_CROSSOVER_CPU, math.sqrt(num_dst * num_src), training)


def block_min_density(block_size: float, *, training: bool) -> float:
    r"""The block density from which ``backend="auto"`` runs a block-diagonal graph as dense
    blocks on CPU.

    Interpolates the measured crossovers ``DENSE_CROSSOVER_CPU_BLOCKS`` linearly in
    :math:`\log L` (held constant outside the sizes measured).

    Args:
        block_size (float): the block size L (for blocks of unequal sizes, that of an average
            pair of their padded blocks, :math:`\sum_g B_g L_g^3 / \sum_g B_g L_g^2`).
        training (bool): forward+backward (``True``) or forward only (``False``).
    """
    return _interpolate(DENSE_CROSSOVER_CPU_BLOCKS, block_size, training)


def explicit_min_density(num_dst: int, num_src: int, *, training: bool) -> float:
    r"""The density from which ``backend="auto"`` takes the dense path on CPU for a whole
    graph when the call needs the attention weights themselves (returned, or dropped out in
    training).

    Interpolates the measured crossovers ``EXPLICIT_CROSSOVER_CPU`` linearly in
    :math:`\log \sqrt{N_{dst} N_{src}}` (held constant below the smallest and above the
    largest size measured). ``auto`` takes the larger of this and
    :func:`dense_min_density`.

    Args:
        num_dst (int): number of targets N_dst.
        num_src (int): number of sources N_src.
        training (bool): forward+backward (``True``) or forward only (``False``).
    """
    return _interpolate(EXPLICIT_CROSSOVER_CPU, math.sqrt(num_dst * num_src), training)


# The contiguous int64 copy of an int32 or strided edge_index (an [E, 2] table transposed),
# kept (on CUDA) while the graph lives unmodified: the triton backend's CSR orderings are kept
# per edge_index tensor, and a copy made at each call would be a new graph to them, sorted
# again at every step.
_INT64_IDS: TensorCache[Tensor] = TensorCache(max_entries=8)


def _unwrapped(edge_index: Tensor) -> Tensor:
    """The tensor a wrapper such as PyG's ``EdgeIndex`` holds (``as_tensor()``), with its
    version counter bumped when the wrapper's has moved since the last call: a write through
    the wrapper (``ei[1, 0] = 3``, ``ei.add_(1)``) changes the tensor it wraps without counting
    there, and the graph caches key on that tensor."""
    inner = edge_index.as_tensor()
    version = edge_index._version
    if getattr(edge_index, "_graphattn_version", version) != version and not inner.is_inference():
        torch.autograd.graph.increment_version(inner)
    edge_index._graphattn_version = version
    return inner


def int64_ids(edge_index: Tensor) -> Tensor:
    """``edge_index`` as a plain contiguous int64 tensor: itself, or its contiguous int64 copy
    (kept while an int32 or strided one lives unmodified, where the graph caches keep values).
    PyG's ``EdgeIndex`` comes as
    the tensor it wraps: its own data pointer is none (0), and the ``triton`` kernels read
    through pointers."""
    if (type(edge_index) is not Tensor and callable(getattr(edge_index, "as_tensor", None))
            and not torch.compiler.is_compiling()):
        edge_index = _unwrapped(edge_index)
    if edge_index.dtype == torch.int64 and edge_index.is_contiguous():
        if (not torch.compiler.is_compiling() and edge_index.is_inference()
                and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):
            # made under torch.inference_mode: a copy, which autograd can save (the reference
            # path's index_select saves the ids)
            return edge_index.clone()
        return edge_index
    return _INT64_IDS.get(edge_index, None, lambda: edge_index.long().contiguous())


def select_backend(q: Tensor, edge_index: Tensor, num_src: int | None = None, *,
                   score: str = "dot", needs_weights: bool = False,
                   softcap: float | None = None) -> str:
    r"""The backend that ``backend="auto"`` picks for these inputs.

    On CPU the choice is between the sparse path (``"cpu"``) and dense masked attention
    (``"dense"``), by the density of the graph

    .. math::
        \rho = \frac{E}{N_{dst} \cdot N_{src}}

    ``"dense"`` when :math:`\rho \ge \rho^*` and the dense matrices fit comfortably:
    :func:`~graphattn.functional.dense_backend.dense_peak_bytes` :math:`\le`
    ``DENSE_MAX_BYTES_CPU`` (2 GiB; 4 heads in fp32 stop there at about 4700 nodes); ``"cpu"``
    otherwise. :math:`\rho^*`
    (:func:`~graphattn.functional.attention.dense_min_density`) is the crossover measured by
    ``benchmarks/sparse_vs_dense.py`` on 2 cores (Erdos-Renyi graphs, H = 4, C = 32, fp32): the
    density at which the dense backend is as fast as the ``"cpu"`` backend: the mean of the
    latest run on each of two machines, both with the present kernels (Intel Xeon / AMD
    EPYC),

    ======================  ====================  ====================  ====================
    size sqrt(N_dst N_src)  256                   1024                  4096
    ======================  ====================  ====================  ====================
    forward+backward        0.16 (0.138 / 0.177)  0.13 (0.100 / 0.162)  0.11 (0.086 / 0.140)
    forward only            0.25 (0.247 / 0.242)  0.14 (0.155 / 0.133)  0.21 (0.205 / 0.224)
    ======================  ====================  ====================  ====================

    interpolated in log size (the first forward entry, a mean of 0.2445, is rounded up). The
    forward+backward column applies when q requires a gradient under grad mode, the forward
    column otherwise. The crossover moves with the machine (the
    Intel cores run the dense matrix products faster relative to the sparse kernels' gathers)
    and from run to run; on the two runs' tables this rule keeps ``"auto"`` within 1.12x of
    the faster of ``"cpu"`` and ``"dense"`` on every random graph, for training and for
    inference (the rule before it, drawn from older runs with slower sparse kernels and lower
    crossovers, 0.06-0.09 for training and 0.10-0.23 for inference, was 1.47x slower at 256
    nodes and density 0.12 in inference). Far from the crossover one backend is many times
    slower than the other (Cora, density 0.0018, about 64 times below it: ``"cpu"`` 3.4 ms,
    ``"dense"`` 139.4 ms (one call) forward+backward in
    ``benchmarks/results/sparse_vs_dense.md``; 3.4-8.3 and 77-218 ms in earlier runs), while
    near it the two are close: the choice matters far more than its exact place.

    **Block-diagonal graphs.** A graph that is sparse as a whole but splits into diagonal
    blocks that no edge crosses (a batch of B sequences or images through
    :func:`~graphattn.graphs.repeat_graph`, the complete graphs of a mini-batch of graphs) is
    judged by the density over its blocks, :math:`\rho_B = E / \sum_g B_g L_g^2` (the padded
    blocks the dense backend runs, see :func:`~graphattn.functional.dense_backend.diagonal_blocks`),
    against the block crossover :math:`\rho_B^*`
    (:func:`~graphattn.functional.attention.block_min_density`) measured by
    ``benchmarks/block_diagonal.py`` on 2 Intel Xeon cores (N = 4096 nodes, H = 4, C = 32,
    fp32; the mean of a window and a random pattern inside the blocks, over two runs; at
    L = 16 the dense blocks won only on the densest graphs, 0.5, or not at all):

    ======================  ======  ======  ======  ======
    block size L            16      64      256     1024
    ======================  ======  ======  ======  ======
    forward+backward        0.47    0.16    0.11    0.12
    forward only            0.50    0.22    0.18    0.24
    ======================  ======  ======  ======  ======

    L is the block size of an average pair (:attr:`DiagonalBlocks.size
    <graphattn.functional.dense_backend.DiagonalBlocks.size>`); blocks of fewer than 16 nodes
    by it stay on ``"cpu"`` (a graph of self-loops alone is N blocks of one node, 3.5x slower
    as dense blocks). A batch of 16 causal sequences of 256 tokens (:math:`\rho_B = 0.5`,
    :math:`\rho = 0.03`) thus runs as 16 causal SDPA blocks. Finding the blocks takes one pass
    over the edges (about 1 ns each), and is skipped when the whole graph is dense enough on
    its own (the dense backend then finds its blocks itself).

    The ``"gatv2"`` score always takes ``"cpu"`` on CPU: the dense backend computes its
    ``[E, H, C]`` per-edge terms as the reference does, before any dense work (complete graphs
    of 256 and 512 nodes, H = 4, C = 32, forward+backward on 1 thread: ``"cpu"`` 56 and 146 ms,
    ``"dense"`` 321 and 1289 ms). So does the ``"additive"`` score, whose per-edge scores the
    dense backend scatters into its matrices: forward+backward on 2 cores (H = 4, C = 16) it
    was 2.0-3.3x slower than ``"cpu"`` on random graphs of 1024 nodes at densities 0.1 to 0.7,
    1.06x on the complete graph, 1.68x on 16 complete blocks of 256 nodes. A ``softcap``
    takes ``"cpu"`` too: the dense backend refuses it.

    **Calls that need the weights** (``needs_weights``: weights returned, or dropout on them in
    training) make the dense backend compute an explicit softmax instead of SDPA's fused one.
    A whole graph then takes the dense path only from
    :func:`~graphattn.functional.attention.explicit_min_density` on, interpolated like
    :math:`\rho^*` from the crossovers ``EXPLICIT_CROSSOVER_CPU``
    (``benchmarks/explicit_weights.py``, random graphs, 2 cores, H = 4, C = 16):

    ======================  ======  ======  ======
    size sqrt(N_dst N_src)  512     1024    2048
    ======================  ======  ======  ======
    forward+backward        0.45    0.55    0.7
    forward only            0.55    0.65    0.9
    ======================  ======  ======  ======

    From about 2048 nodes the ``[H, N, N]`` matrices leave the cache, and each pass of the
    explicit softmax over them costs (4096 nodes at density 0.9 gave the ratios of 2048).
    Blocks take it in training from ``EXPLICIT_MIN_DENSITY_CPU`` (0.6) on (blocks of at most
    ``EXPLICIT_SMALL_BLOCK`` = 128 nodes from ``EXPLICIT_MIN_DENSITY_CPU_SMALL_BLOCKS`` = 0.4
    on), and in inference from ``EXPLICIT_MIN_DENSITY_CPU_INFERENCE`` (0.9) on. Dense over
    ``"cpu"`` (``benchmarks/results/explicit_weights.md``; inference with the weights returned
    / training with dropout 0.5 / training with the weights returned; runs differ by up to
    30%): random graphs of 512 nodes at density 0.5 1.11 / 0.75 / 0.74x, 0.7 0.66 / 0.58 /
    0.51x; of 1024 nodes at 0.05 3.1 / 4.4 / 4.0x, 0.35 1.49 / 1.48 / 1.25x, 0.5 1.11 / 1.06 /
    0.99x, 0.7 0.83 / 0.87 / 0.93x, 0.9 0.60 / 0.63 / 0.62x; of 2048 nodes at 0.5 1.75 / 1.51
    / 1.33x, 0.7 1.29 / 1.02 / 0.96x, 0.9 0.92 / 0.77 / 0.73x; the complete graph of 1024
    0.22 / 0.41 / 0.22x; 4096 nodes in complete blocks of 32 to 512 0.31-0.77 / 0.29-0.62 /
    0.24-0.44x, in causal blocks (density 0.5) of 32, 64 and 128 0.64-1.08 / 0.51-0.60 /
    0.53-0.70x, of 256 0.89 / 0.78 / 0.94x, of 512 1.78 / 1.55 / 1.41x, in random blocks of 32
    and 128 at density 0.3 0.96-1.11 / 0.86-0.87 / 0.81-0.97x and at 0.8 0.72-1.02 /
    0.46-0.52 / 0.57-0.61x; complete graphs of 9-37 and 50-150 nodes (~4000 nodes, padded per
    size group to density 0.70-0.71) 0.78-0.79 / 0.71-0.75 / 0.76-0.78x.

    On CUDA: ``"triton"`` when Triton is installed and q is fp32, fp16 or bf16, else
    ``"reference"``. This is a placeholder rule: the dense path is not chosen on GPUs until GPU
    measurements exist (``benchmarks/gpu_density.py`` measures the crossover; not yet run).

    Args:
        q (Tensor): queries ``[N_dst, H, C]`` (or ``[N_dst, H]``): device, N_dst, H, dtype and
            whether a gradient is needed.
        edge_index (Tensor): ``[2, E]``.
        num_src (int, optional): number of sources N_src. (default: N_dst)
        score (str, optional): the score function. (default: ``"dot"``)
        needs_weights (bool, optional): the call returns the weights or applies dropout to
            them in training. (default: ``False``)
        softcap (float, optional): the call's score cap. (default: ``None``)
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if not isinstance(q, Tensor) or q.dim() not in (2, 3):
        shape = list(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(f"q must have shape [N_dst, H, C] or [N_dst, H], got {shape}")
    check_float_dtype(q=q)
    needs_weights = check_flag(needs_weights, "needs_weights")
    if softcap is not None:
        check_softcap(softcap, score, q)
    if num_src is not None:
        num_src = check_non_negative(num_src, "num_src")
    check_edge_index(edge_index, num_src=q.size(0) if num_src is None else num_src,
                     num_dst=q.size(0))
    return _select(q, edge_index, num_src, score, needs_weights, softcap is not None)[0]


def _select(q: Tensor, edge_index: Tensor, num_src: int | None, score: str,
            needs_weights: bool = False,
            sparse_only: bool = False) -> tuple[str, DiagonalBlocks | None]:
    """:func:`select_backend`, and the block layout it found when it chose dense blocks
    (``sparse_only``: a cap, which the dense backend refuses)."""
    if q.device.type == "cpu":
        if (score != "dot" or sparse_only or torch.jit.is_tracing()
                or torch.compiler.is_exporting()):
            # (torch.jit.trace records sizes as values, which no rule below can compare, and
            # torch.export would fix the sizes the rules compare; the sparse kernels' operator
            # takes every size)
            return "cpu", None
        # the explicit softmax's crossover, where the weights themselves are needed
        # (measured forward+backward)
        training = q.requires_grad and torch.is_grad_enabled()
        n_dst = q.size(0)
        n_src = n_dst if num_src is None else num_src
        floor = (explicit_min_density(n_dst, n_src, training=training) if needs_weights
                 else 0.0)
        pairs = n_dst * n_src
        num_edges = edge_index.size(1)
        density = num_edges / pairs if pairs > 0 else 0.0
        threshold = max(dense_min_density(n_dst, n_src, training=training), floor)
        heads, itemsize = q.size(1), q.element_size()
        fits = dense_peak_bytes(n_dst, n_src, heads, itemsize) <= DENSE_MAX_BYTES_CPU
        # guard_or_false: under torch.compile an edge count known only at run time (after the
        # self-loops were replaced) cannot be compared while tracing; the sparse path is taken.
        if fits and guard_or_false(density >= threshold):
            return "dense", None
        layout = diagonal_blocks(edge_index, n_dst) if n_dst == n_src else None
        # blocks smaller than the smallest size measured stay sparse (there, at 16 nodes,
        # the dense blocks won on the densest graphs only)
        if layout is not None and layout.size >= DENSE_CROSSOVER_CPU_BLOCKS[0][0]:
            # the blocks' pairs as one row of sources: the same bytes
            fits = dense_peak_bytes(layout.pairs, 1, heads, itemsize) <= DENSE_MAX_BYTES_CPU
            floor = 0.0
            if needs_weights and not training:
                floor = EXPLICIT_MIN_DENSITY_CPU_INFERENCE
            elif needs_weights:
                floor = (EXPLICIT_MIN_DENSITY_CPU_SMALL_BLOCKS
                         if layout.size <= EXPLICIT_SMALL_BLOCK else EXPLICIT_MIN_DENSITY_CPU)
            threshold = max(block_min_density(layout.size, training=training), floor)
            if fits and num_edges / layout.pairs >= threshold:
                return "dense", layout
        return "cpu", None
    if use_triton_for(q):
        return "triton", None
    return "reference", None


def _check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor,
                            bias: Tensor | None, score: str, att: Tensor | None,
                            edge_key: Tensor | None, edge_value: Tensor | None,
                            sinks: Tensor | None = None) -> None:
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    check_tensors(q=q, k=k, v=v, edge_index=edge_index)
    check_same_device(q=q, k=k, v=v, edge_index=edge_index, bias=bias, att=att,
                      edge_key=edge_key, edge_value=edge_value, sinks=sinks)
    check_strided(q=q, k=k, v=v, bias=bias, att=att, edge_key=edge_key, edge_value=edge_value,
                  sinks=sinks)
    if v.dim() != 3:
        raise ValueError(f"v must have shape [N_src, H, C], got {list(v.shape)}")
    n_src, kv_heads, _ = v.shape
    per_channel = score != "additive"  # q and k have channels for "dot" and "gatv2"
    qk_rank = 3 if per_channel else 2
    layout = "[N, H, C]" if per_channel else "[N, H]"
    for name, t in (("q", q), ("k", k)):
        if t.dim() != qk_rank:
            raise ValueError(f"{name} must have shape {layout} for score={score!r}, "
                             f"got {list(t.shape)}")
    if k.size(1) != kv_heads:
        raise ValueError(f"k must have the heads of v, {kv_heads}, got k {list(k.shape)} and "
                         f"v {list(v.shape)}")
    heads = q.size(1)
    if heads != kv_heads and (kv_heads == 0 or heads % kv_heads):
        raise ValueError(f"q must have the heads H of k and v, {kv_heads}, or a multiple of "
                         f"them (grouped-query attention), got q {list(q.shape)} and v "
                         f"{list(v.shape)}")
    if k.size(0) != n_src:
        raise ValueError(f"k and v must have the same number of source nodes, "
                         f"got k {list(k.shape)} and v {list(v.shape)}")
    if per_channel and q.size(-1) != k.size(-1):
        raise ValueError(f"q and k must have the same channels C, "
                         f"got q {list(q.shape)} and k {list(k.shape)}")
    if score == "gatv2":
        if att is None:
            raise ValueError("score='gatv2' needs the attention vector att [H, C]")
        if tuple(att.shape) != (heads, q.size(-1)):
            raise ValueError(f"att must have shape [H, C] = [{heads}, {q.size(-1)}] like q, "
                             f"got {list(att.shape)}")
    elif att is not None:
        raise ValueError(f"att is used by score='gatv2' only, got score={score!r}")
    check_float_dtype(q=q, k=k, v=v, bias=bias, att=att, edge_key=edge_key,
                      edge_value=edge_value, sinks=sinks)
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape [H] = [{heads}], one score per head, "
                         f"got {list(sinks.shape)}")
    check_edge_index(edge_index, num_src=n_src, num_dst=q.size(0))
    num_edges = edge_index.size(1)
    if bias is not None and tuple(bias.shape) != (num_edges, heads):
        raise ValueError(f"bias must have shape [E, H] = [{num_edges}, {heads}], "
                         f"got {list(bias.shape)}")
    if edge_key is not None:
        if not per_channel:
            raise ValueError(f"edge_key needs the dot or gatv2 score, whose keys have "
                             f"channels; got score={score!r} (add an [E, H] bias instead)")
        if tuple(edge_key.shape) != (num_edges, heads, k.size(-1)):
            raise ValueError(f"edge_key must have shape [E, H, C] = "
                             f"[{num_edges}, {heads}, {k.size(-1)}] like k per edge, "
                             f"got {list(edge_key.shape)}")
    if edge_value is not None and tuple(edge_value.shape) != (num_edges, heads, v.size(-1)):
        raise ValueError(f"edge_value must have shape [E, H, C] = "
                         f"[{num_edges}, {heads}, {v.size(-1)}] like v per edge, "
                         f"got {list(edge_value.shape)}")


# For type checkers: out alone, or (out, alpha) with return_attention=True.
@overload
def edge_attention(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *,
                   scale: float | None = ..., bias: Tensor | None = ..., dropout_p: float = ...,
                   training: bool = ..., return_attention: Literal[False] = ...,
                   backend: str = ..., score: str = ..., negative_slope: float = ...,
                   att: Tensor | None = ..., edge_key: Tensor | None = ...,
                   edge_value: Tensor | None = ..., softcap: float | None = ...) -> Tensor: ...


@overload
def edge_attention(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *,
                   scale: float | None = ..., bias: Tensor | None = ..., dropout_p: float = ...,
                   training: bool = ..., return_attention: Literal[True], backend: str = ...,
                   score: str = ..., negative_slope: float = ..., att: Tensor | None = ...,
                   edge_key: Tensor | None = ...,
                   edge_value: Tensor | None = ...,
                   softcap: float | None = ...) -> tuple[Tensor, Tensor]: ...


@overload
def edge_attention(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *,
                   scale: float | None = ..., bias: Tensor | None = ..., dropout_p: float = ...,
                   training: bool = ..., return_attention: bool, backend: str = ...,
                   score: str = ..., negative_slope: float = ..., att: Tensor | None = ...,
                   edge_key: Tensor | None = ...,
                   edge_value: Tensor | None = ..., softcap: float | None = ...,
                   sinks: Tensor | None = ...) -> Tensor | tuple[Tensor, Tensor]: ...


def edge_attention(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *,
                   scale: float | None = None, bias: Tensor | None = None,
                   dropout_p: float = 0.0, training: bool = True,
                   return_attention: bool = False, backend: str = "auto",
                   score: str = "dot", negative_slope: float = 0.2,
                   att: Tensor | None = None, edge_key: Tensor | None = None,
                   edge_value: Tensor | None = None, softcap: float | None = None,
                   sinks: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    r"""Multi-head self-attention restricted to the edges of a graph.

    Node i attends to node j when the edge j -> i exists (``edge_index[:, e] = (j, i)``):

    .. math::
        s_{ij} = \text{scale} \cdot q_i \cdot k_j + b_{ij}, \qquad
        \alpha_{ij} = \operatorname{softmax}_{j \in \mathcal{N}(i)} s_{ij}, \qquad
        \mathrm{out}_i = \sum_{j \in \mathcal{N}(i)} \alpha_{ij} \, v_j

    for every head separately. With ``score="additive"`` (GAT's score) ``q`` and ``k`` hold one
    number per node and head, and :math:`s_{ij} = \text{scale} \cdot
    \mathrm{LeakyReLU}(q_i + k_j + b_{ij})`. With ``score="gatv2"`` (GATv2's dynamic
    attention, Brody et al., 2022) ``q`` and ``k`` have channels again and

    .. math::
        s_{ij} = \text{scale} \cdot a^\top \mathrm{LeakyReLU}(q_i + k_j) + b_{ij}

    with the attention vector ``att`` :math:`a` per head: the nonlinearity sits between the
    node features and :math:`a`, so the ranking of the neighbours can depend on the target.
    Every backend computes it without an ``[E, H, C]`` tensor except ``"reference"`` and
    ``"dense"``. A target with no incoming edge gets exactly 0.

    With ``softcap`` :math:`c` (dot and gatv2 scores), the score before its bias is squashed
    smoothly into :math:`(-c, c)`, as Gemma 2 and Grok-1 cap their attention logits:

    .. math::
        s_{ij} = c \tanh\!\big(\text{scale} \cdot q_i \cdot k_j \,/\, c\big) + b_{ij}

    (the gatv2 score likewise). Scores far below :math:`c` are almost unchanged; none can
    grow past it, so no single edge can take all of a target's weight by a large logit. The
    ``"cpu"`` and ``"triton"`` kernels compute it in their score, with the derivative
    :math:`1 - \tanh^2` in their backward; ``"dense"`` (scaled_dot_product_attention takes no
    cap) refuses it, and ``backend="auto"`` never picks it then.

    With ``sinks`` :math:`\varsigma` (``[H]``), each head's softmax has one more score in
    every row, whose value is 0, as GPT-OSS's attention sinks:

    .. math::
        \alpha_{ij} = \frac{e^{s_{ij}}}{e^{\varsigma_h} + \sum_{j' \in \mathcal{N}(i)}
        e^{s_{ij'}}}

    so a target can give its edges less than all of its weight (and one without edges still
    gets 0). The weights returned are the edges'; they sum to less than 1. The ``"cpu"`` and
    ``"triton"`` kernels start each row's softmax at the sink
    (:mod:`graphattn.functional.sinks`); ``"dense"`` gives SDPA one more key, whose score is
    the sink. SDPA reads the sink over the scale from a query channel of q's dtype: in fp16
    a finite sink is held to at most about :math:`1.7 \cdot 10^7 \cdot \text{scale}` there
    (:math:`65504 \cdot 256 \cdot \text{scale}`, over :math:`\sqrt{\text{scale}}` past a
    scale of 1), beyond which the weights differ from the other backends'; ``-inf`` means no
    sink, and ``+inf`` takes all the weight: that head's outputs are 0.

    Per-edge terms enter the key and the value of each edge e = (j -> i), as PyG's
    ``TransformerConv(edge_dim=...)`` and ``GATv2Conv(edge_dim=...)`` add their projected edge
    features: the key :math:`k_j + ek_e` (``edge_key``, dot and gatv2 scores) and the value
    :math:`v_j + ev_e` (``edge_value``), so that

    .. math::
        \mathrm{out}_i = \sum_{j \in \mathcal{N}(i)} \alpha_{ij} \, (v_j + ev_e).

    The ``"cpu"`` and ``"triton"`` backends compute them inside their kernels, without an
    ``[E, H, C]`` tensor other than the terms and their gradients; ``"reference"`` adds them
    to the gathered keys and values, and ``"dense"`` folds them in as
    :mod:`graphattn.functional.edge_terms` describes.
    On the complete graph with ``"dot"`` this is ordinary scaled dot-product attention.

    Gradients flow to every tensor input but ``edge_index``, and can be differentiated again
    (``create_graph=True``) on every backend: the fused ``"cpu"`` and ``"triton"`` backends
    then recompute the reference path in their backward, with its ``[E, H, C]`` tensors.
    ``torch.func``'s transforms (``grad``, ``vjp``, ``jvp``, ``jacrev``, ``jacfwd``,
    ``hessian``, ``vmap``) and forward-mode AD with dual tensors
    (``torch.autograd.forward_ad``) work on every backend: under them the fused backends run
    the reference path, since their kernels have no batching or forward-mode rule.

    Every tensor input but ``edge_index`` must be floating-point. Under ``torch.autocast`` for
    their device, the floating inputs (float64 aside) are first cast to its dtype, as autocast
    casts those of ``scaled_dot_product_attention``, and nothing inside is autocast again:
    every backend returns what it returns for inputs of that dtype, with or without a
    gradient. Inputs of mixed floating dtypes (an fp32 ``att`` beside bf16 q, k and v) are
    cast to the dtype torch's arithmetic promotes them to, except on the ``"triton"``
    backend, whose kernels read each in its own dtype and compute in fp32 (and take no
    float64: ``backend="auto"`` then takes ``"reference"``); their output has the dtype of
    v, and the weights that of the scores' inputs (q, k, bias, att, ``edge_key``) promoted.

    The fused backends keep the output for backward, as ``scaled_dot_product_attention``
    does: an in-place edit of ``out`` (``out.relu_()``, ``out += x``, ``out[mask] = 0``)
    before backward makes autograd raise "modified by an inplace operation" on ``"cpu"`` and
    on fp32 ``"triton"``. Edit a copy (``out = out.relu()``) instead; ``"reference"`` and
    ``"dense"`` happen not to keep it, so code that edits in place runs there but not on every
    backend.

    Args:
        q (Tensor): queries of the targets, ``[N_dst, H, C]`` (``[N_dst, H]`` when additive).
        k (Tensor): keys of the sources, ``[N_src, H_kv, C]`` (``[N_src, H_kv]`` when
            additive): ``H_kv = H``, or a divisor of H for grouped-query attention, where key
            and value head g serve the query heads ``g G .. (g + 1) G - 1``, ``G = H / H_kv``.
            The ``"dense"`` backend hands them to SDPA as they are (``enable_gqa``); the
            others, and the dense backend's explicit weights, read them repeated per query
            head.
        v (Tensor): values of the sources, ``[N_src, H_kv, C]``.
        edge_index (Tensor): ``[2, E]`` integer; row 0 the source j, row 1 the target i.
        scale (float, optional): score multiplier. (default: :math:`1/\sqrt{C}` for ``"dot"``,
            ``1`` for ``"additive"`` and ``"gatv2"``)
        bias (Tensor, optional): ``[E, H]`` added to the scores before the softmax; a
            ``-inf`` entry gives its edge the weight 0. The additive score adds it inside the
            LeakyReLU, where ``-inf`` stays ``-inf`` only with ``negative_slope > 0`` and
            ``scale > 0`` (a slope of 0 makes it NaN, as torch's ``leaky_relu`` does).
            (default: ``None``)
        dropout_p (float, optional): dropout probability on the attention weights, applied when
            ``training``. (default: ``0.0``)
        training (bool, optional): apply dropout. (default: ``True``)
        return_attention (bool, optional): also return :math:`\alpha` (before dropout).
            (default: ``False``)
        backend (str, optional): ``"auto"`` or one of :func:`available_backends`.
            (default: ``"auto"``)
        score (str, optional): ``"dot"``, ``"additive"`` or ``"gatv2"``. (default: ``"dot"``)
        negative_slope (float, optional): LeakyReLU slope of the additive and gatv2 scores.
            (default: ``0.2``)
        att (Tensor, optional): ``[H, C]`` attention vector of ``score="gatv2"`` (required
            there, refused otherwise). (default: ``None``)
        edge_key (Tensor, optional): ``[E, H, C]`` added to the key of each edge (dot and
            gatv2 scores). (default: ``None``)
        edge_value (Tensor, optional): ``[E, H, C]`` added to the value of each edge.
            (default: ``None``)
        softcap (float, optional): :math:`c > 0`, the cap of the dot and gatv2 scores before
            their bias, :math:`c \tanh(s / c)` (Gemma 2 uses 50). (default: ``None``, no cap)
        sinks (Tensor, optional): ``[H]``, the score :math:`\varsigma_h` of each head's sink,
            one more term of every row's softmax whose value is 0. (default: ``None``)

    Shapes:
        - **input:** q ``(N_dst, H, C)``, k and v ``(N_src, H_kv, C)``, edge_index ``(2, E)``,
          bias ``(E, H)``, att ``(H, C)``, edge_key and edge_value ``(E, H, C)``, sinks
          ``(H)``
        - **output:** out ``(N_dst, H, C)``; alpha ``(E, H)`` when ``return_attention``
    """
    _check_attention_inputs(q, k, v, edge_index, bias, score, att, edge_key, edge_value, sinks)
    check_dropout(dropout_p, "dropout_p")
    training = check_flag(training, "training")
    return_attention = check_flag(return_attention, "return_attention")
    negative_slope = score_factor(negative_slope, "negative_slope", q, k, v)
    if scale is not None:
        scale = score_factor(scale, "scale", q, k, v)
    if softcap is not None:
        softcap = check_softcap(softcap, score, q, k, v)
    return edge_attention_unchecked(q, k, v, edge_index, scale=scale, bias=bias,
                                    dropout_p=dropout_p, training=training,
                                    return_attention=return_attention, backend=backend,
                                    score=score, negative_slope=negative_slope, att=att,
                                    edge_key=edge_key, edge_value=edge_value, softcap=softcap,
                                    sinks=sinks)


def check_softcap(softcap: float | Tensor, score: str, *tensors: Tensor,
                  score_name: str = "score") -> float:
    """``softcap`` as a positive float, finite in the dtype of the scores of ``tensors``;
    refused with the additive score (the argument ``score_name``), whose bias sits inside its
    LeakyReLU (a cap there would turn a ``-inf`` bias into the finite score ``-c``)."""
    softcap = score_factor(softcap, "softcap", *tensors)
    if softcap <= 0:
        raise ValueError(f"softcap must be positive (scores are capped to (-softcap, "
                         f"softcap)), got {softcap!r}")
    if score == "additive":
        raise ValueError(f"softcap caps the dot and gatv2 scores; {score_name}='additive' adds "
                         f"its bias inside its LeakyReLU, where a cap would make a -inf bias "
                         f"finite")
    return softcap


def _autocast_inputs(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Under ``torch.autocast`` for the inputs' device, the floating inputs (float64 aside) in
    its dtype, as autocast casts those of ``scaled_dot_product_attention`` (an op it runs in
    lower precision): the same dtype whatever the backend, and whether or not a gradient is
    needed. The caller then turns autocast off, so that every path computes as it does on
    inputs of that dtype (scores of half precision in fp32). A tensor given twice stays one
    tensor. The inputs as they are otherwise."""
    device = _autocast_device(*tensors)
    if device is None:
        return tensors
    dtype = torch.get_autocast_dtype(device)
    cast: list[Tensor | None] = []
    for i, t in enumerate(tensors):
        # a tensor given before is the same cast tensor; compared by `is`, which torch.compile
        # traces (id() would guard on the tensor object: every new input would compile again)
        earlier = next((j for j in range(i) if tensors[j] is t), None)
        if earlier is not None:
            cast.append(cast[earlier])
        elif isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64:
            cast.append(t.to(dtype))
        else:
            cast.append(t)
    return tuple(cast)


def _autocast_device(*tensors: Tensor | None) -> str | None:
    """The device type of the first tensor, when ``torch.autocast`` is on for it; else None."""
    first = next((t for t in tensors if isinstance(t, Tensor)), None)
    if first is None or not torch.amp.is_autocast_available(first.device.type):
        return None  # (meta tensors, say)
    if not torch.is_autocast_enabled(first.device.type):
        return None
    return first.device.type


def _common_dtype(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Inputs of mixed floating dtypes (an fp32 ``att`` beside bf16 q, k, v under autocast, say)
    cast to the dtype torch's arithmetic would promote them to; one tensor given as both edge
    terms (the last two) stays one tensor."""
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) <= 1:
        return tensors
    common = functools.reduce(torch.promote_types, dtypes)
    cast = [None if t is None else t.to(common) for t in tensors]
    if tensors[-1] is not None and tensors[-1] is tensors[-2]:
        cast[-1] = cast[-2]
    return tuple(cast)


def edge_attention_unchecked(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *,
                             scale: float | None, bias: Tensor | None, dropout_p: float,
                             training: bool, return_attention: bool, backend: str, score: str,
                             negative_slope: float = 0.2, att: Tensor | None = None,
                             edge_key: Tensor | None = None, edge_value: Tensor | None = None,
                             edge_weight: Tensor | None = None, softcap: float | None = None,
                             sinks: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`edge_attention` without the argument checks, for callers that made them.

    :class:`~graphattn.nn.GraphSelfAttention` validates ``edge_index`` once and builds q, k, v
    and the self-loops itself, so their shapes and node ids are valid by construction; checking
    again would cost two more passes over the edges (and, on CUDA, two device syncs). Only the
    backend name is still checked. Everything else is as in :func:`edge_attention`, plus
    ``edge_weight`` ``[E]``: a multiplier of each edge's weights after the softmax (and after
    dropout), gradients included (PyG's explanation masks); it takes the reference backend,
    the one that differentiates it.
    """
    autocast = _autocast_device(q, k, v)
    if autocast is not None:
        q, k, v, bias, att, edge_key, edge_value, sinks = _autocast_inputs(
            q, k, v, bias, att, edge_key, edge_value, sinks)
        with torch.autocast(autocast, enabled=False):
            return edge_attention_unchecked(
                q, k, v, edge_index, scale=scale, bias=bias, dropout_p=dropout_p,
                training=training, return_attention=return_attention, backend=backend,
                score=score, negative_slope=negative_slope, att=att, edge_key=edge_key,
                edge_value=edge_value, edge_weight=edge_weight, softcap=softcap, sinks=sinks)
    if scale is None:
        # 1 / sqrt(C) for dot (C = 0: the score is 0 whatever the scale)
        scale = 1.0 / math.sqrt(max(q.size(-1), 1)) if score == "dot" else 1.0
    layout = None  # the blocks of a block-diagonal graph that auto sends to the dense backend
    if edge_weight is not None:
        backend = "reference"
    elif backend == "auto":
        backend, layout = _select(q, edge_index, k.size(0), score,
                                  return_attention or (training and dropout_p > 0.0),
                                  softcap is not None)
        if backend == "triton" and any(t is not None and t.dtype not in TRITON_DTYPES
                                       for t in (k, v, bias, att, edge_key, edge_value, sinks)):
            backend = "reference"  # a float64 input beside q: the kernels take none
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {available_backends()}, "
                         f"got {backend!r}")
    if backend == "dense" and softcap is not None:
        raise ValueError(DENSE_REFUSES_SOFTCAP)
    if backend == "dense" and onnx_exporting():
        backend = "reference"  # the same function in ops ONNX has, for graphs of any size
    if backend == "dense" and torch.jit.is_tracing():
        raise ValueError("backend='dense' reads the graph's structure as it runs, which "
                         "torch.jit.trace cannot record: trace with backend='auto' or 'cpu' "
                         "(the sparse kernels' operator), or use torch.export.export or "
                         "torch.compile")
    if k.size(1) != q.size(1) and not (backend == "dense" and edge_key is None
                                       and edge_value is None):
        # grouped keys and values: the dense backend hands them to SDPA as they are (which
        # shares each kv head among its query heads); the kernels read every query head's
        k, v = repeat_kv_heads(q.size(1), k, v, dim=1)  # (N_src, H, C)
    triton_dtypes = None  # (out, alpha) dtypes of the triton backend, when rerouted from it
    if backend in ("cpu", "triton") and plain_ops_only(q, k, v, bias, att, edge_key,
                                                        edge_value, sinks):
        # torch.func (vjp, jacrev, jvp, vmap, hessian) or forward-mode dual inputs: the fused
        # kernels have no batching or forward-mode rule; the reference computes the same
        # function with plain torch ops. What the fused backend refuses is refused here too,
        # and triton's outputs keep their dtypes for mixed inputs (see edge_attention).
        if backend == "cpu":
            check_cpu_inputs(q, k, v, edge_index)
        else:
            check_triton_inputs(q, k, v, score=score, bias=bias, att=att, edge_key=edge_key,
                                edge_value=edge_value, sinks=sinks)
            triton_dtypes = (v.dtype, functools.reduce(torch.promote_types, [
                t.dtype for t in (q, k, bias, att, edge_key, sinks) if t is not None]))
        backend = "reference"
    if backend != "triton":  # the Triton kernels read each input in its own dtype
        q, k, v, bias, att, sinks, edge_key, edge_value = _common_dtype(
            q, k, v, bias, att, sinks, edge_key, edge_value)
    dropout_mask = None
    if training and dropout_p > 0.0 and (backend == "triton" or (
            backend == "cpu" and v.dtype == torch.float32)):
        # The kernels draw the mask where they use it from these, the CPU mask's SplitMix64
        # entries (nothing of size [E, H] in memory), with 1 / (1 - p) in fp32: not rounded to
        # bf16 or fp16 (bf16 keeps 1.109375 for p = 0.1, and the outputs would shrink by
        # 0.16%). The cpu kernels take them in fp32 (a mask in memory would hold the same
        # values); in fp64 and half precision they read the mask of v's dtype.
        dropout_mask = seeded_mask_parameters(dropout_p, device=v.device)  # (3)
    elif training and dropout_p > 0.0:
        dropout_mask = make_dropout_mask((edge_index.size(1), q.size(1)), dropout_p,
                                         device=v.device, dtype=v.dtype)  # (E, H)
    if edge_weight is not None:
        weight = edge_weight.to(v.dtype).unsqueeze(-1)  # (E, 1)
        dropout_mask = weight.expand(-1, q.size(1)) if dropout_mask is None else (
            dropout_mask * weight)  # (E, H)
    options = dict(scale=float(scale), bias=bias, dropout_mask=dropout_mask, score=score,
                   negative_slope=float(negative_slope), need_alpha=return_attention, att=att)
    if softcap is not None:
        options["softcap"] = float(softcap)
    if sinks is not None:  # a sink of +inf takes all of its rows' weight, as in "dense"'s SDPA
        options["sinks"] = sinks.clamp(max=torch.finfo(sinks.dtype).max)
    ids = int64_ids(edge_index)
    if edge_key is None and edge_value is None:
        if layout is not None and backend == "dense":
            options["layout"] = layout  # found once, by the rule
        out, alpha = BACKENDS[backend](q, k, v, ids, **options)
    elif backend in NATIVE_EDGE_TERMS:
        out, alpha = BACKENDS[backend](q, k, v, ids, edge_key=edge_key,
                                       edge_value=edge_value, **options)
    else:
        out, alpha = fold_edge_terms(BACKENDS[backend], q, k, v, ids,
                                     edge_key=edge_key, edge_value=edge_value, **options)
    if triton_dtypes is not None:
        out, alpha = out.to(triton_dtypes[0]), alpha if alpha is None else alpha.to(
            triton_dtypes[1])
    return (out, alpha) if return_attention else out


# For type checkers: out alone, or (out, attention) with return_attention=True.
@overload
def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = ..., *,
                    is_causal: bool = ..., scale: float | None = ..., dropout_p: float = ...,
                    training: bool = ..., return_attention: Literal[False] = ...,
                    batch: Tensor | None = ..., attn_bias: Tensor | None = ...,
                    softcap: float | None = ..., sinks: Tensor | None = ...) -> Tensor: ...


@overload
def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = ..., *,
                    is_causal: bool = ..., scale: float | None = ..., dropout_p: float = ...,
                    training: bool = ..., return_attention: Literal[True],
                    batch: Tensor | None = ..., attn_bias: Tensor | None = ...,
                    softcap: float | None = ..., sinks: Tensor | None = ...,
                    ) -> tuple[Tensor, Tensor]: ...


@overload
def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = ..., *,
                    is_causal: bool = ..., scale: float | None = ..., dropout_p: float = ...,
                    training: bool = ..., return_attention: bool,
                    batch: Tensor | None = ..., attn_bias: Tensor | None = ...,
                    softcap: float | None = ..., sinks: Tensor | None = ...,
                    ) -> Tensor | tuple[Tensor, Tensor]: ...


def dense_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
                    is_causal: bool = False, scale: float | None = None, dropout_p: float = 0.0,
                    training: bool = True, return_attention: bool = False,
                    batch: Tensor | None = None, attn_bias: Tensor | None = None,
                    softcap: float | None = None,
                    sinks: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    r"""Multi-head scaled dot-product attention with an optional boolean mask and score bias.

    .. math::
        \alpha = \operatorname{softmax}\big(\text{scale} \cdot Q K^\top
        + \text{attn\_bias} + \log \text{mask}\big), \qquad \mathrm{out} = \alpha V

    per head, through :func:`torch.nn.functional.scaled_dot_product_attention`.
    ``mask[i, j] = True`` means query i may attend to key j (the edge j -> i), so
    ``dense_attention(q, k, v, graphs.to_dense_mask(edge_index, N))`` equals
    ``edge_attention(q, k, v, edge_index)`` for a graph without multi-edges.
    A query row with no allowed key gets exactly 0, and what no query reads (the q of such a
    row, the k and v of a key no row may attend to) reaches no output and no gradient, NaN or
    inf included. q, k, v, ``attn_bias`` and ``sinks`` of different floating dtypes are cast
    to the one torch's arithmetic promotes them to, and under ``torch.autocast`` to its dtype,
    as in :func:`edge_attention`.

    Args:
        q (Tensor): ``[..., L_q, H, C]``.
        k (Tensor): ``[..., L_k, H_kv, C]``: ``H_kv = H``, or a divisor of H for
            grouped-query attention, where key head g serves the query heads ``g G .. (g + 1)
            G - 1``, ``G = H / H_kv`` (as SDPA's ``enable_gqa``; on SDPA's fused path no copy
            of k and v is made per query head).
        v (Tensor): ``[..., L_k, H_kv, C_v]``; ``C_v`` may differ from ``C``.
        mask (Tensor, optional): bool ``[..., L_q, L_k]``; its leading dims broadcast to
            those of q, and ``L_q`` (or ``L_k``) may be 1: ``[B, 1, L_k]`` is a key mask,
            e.g. ``node_mask.unsqueeze(1)`` with ``node_mask`` from PyG's ``to_dense_batch``
            (True on real nodes, the opposite of ``torch.nn.MultiheadAttention``'s
            ``key_padding_mask``). (default: ``None``, attend everywhere)
        is_causal (bool, optional): also forbid keys j > i. (default: ``False``)
        scale (float, optional): (default: :math:`1/\sqrt{C}`)
        dropout_p (float, optional): dropout on the attention weights when ``training``: on
            CPU (and with ``return_attention``) graphattn's :func:`dropout_mask` of the
            weights' shape ``[..., H, L_q, L_k]`` times an explicit softmax, 2.1-2.4x faster
            than SDPA's unfused path with its ``bernoulli_`` mask; on CUDA SDPA's fused
            kernels draw it. (default: ``0.0``)
        training (bool, optional): (default: ``True``)
        return_attention (bool, optional): also return the weights ``[..., H, L_q, L_k]``
            (before dropout), computed by the explicit path. (default: ``False``)
        batch (Tensor, optional): ``[N]`` integer, the graph of each of the N nodes (PyG's
            ``data.batch``; need not be sorted): q, k, v are ``[N, H, C]`` and each node
            attends to the nodes of its own graph only (with ``is_causal``, to those of them
            with smaller or equal ids), as ``edge_attention`` on
            :func:`graphattn.graphs.batch_complete_graph` computes, without the ``[N, N]`` mask
            and without padding every graph to the largest: graphs are grouped by size (sizes in
            ``(2^(b-1), 2^b]`` together), and each group runs as one batched SDPA call, padded to
            its largest graph. Not with ``mask`` or ``return_attention``. Reads the graph sizes
            back to the host (a synchronisation on CUDA). On CPU its gradients can be
            differentiated again (``create_graph=True``, ``torch.func``: force matching, a
            gradient penalty); on CUDA they cannot, as SDPA's fused CUDA backward is not
            differentiable (take the sparse route there). (default: ``None``)
        attn_bias (Tensor, optional): float ``[..., H, L_q, L_k]`` (H may be 1), added to
            the scores of each head: a relative positional bias (``graphattn.pe.alibi_bias``,
            ``graphattn.pe.DistanceBias``), or 0 and -inf for a pattern of each head
            (``graphattn.graphs.head_patterns``); it may require a gradient. An entry of
            -inf leaves the pair out, as ``mask`` does, and a row of a head left without any
            key gets 0 in that head. ``edge_attention(..., bias=)`` on the same pairs
            computes the same. Not with ``batch``. (default: ``None``)
        softcap (float, optional): :math:`c > 0`: the scores before ``attn_bias`` and the
            mask become :math:`c \tanh(\text{scale} \cdot q k^\top / c)`, as
            ``edge_attention``'s ``softcap`` (Gemma 2's cap). The weights are then explicit,
            as with ``return_attention`` (SDPA takes no cap). Not with ``batch``.
            (default: ``None``)
        sinks (Tensor, optional): ``[H]``, one more score :math:`\varsigma_h` in every row of
            head h's softmax, whose value is 0, as ``edge_attention``'s ``sinks`` (GPT-OSS's
            attention sinks): SDPA gets one more key, whose score is the sink, and the
            explicit softmax one more column. The weights returned are the keys'.
            (default: ``None``)

    Shapes:
        - **input:** q ``(..., L_q, H, C)``, k ``(..., L_k, H_kv, C)``, v
          ``(..., L_k, H_kv, C_v)``, mask ``(..., L_q, L_k)``, attn_bias
          ``(..., H, L_q, L_k)``, sinks ``(H)``; the leading dims ``...`` of q, k and v
          broadcast together; with ``batch``: q ``(N, H, C)``, k ``(N, H_kv, C)``, v
          ``(N, H_kv, C_v)``, batch ``(N)``
        - **output:** ``(..., L_q, H, C_v)``; weights ``(..., H, L_q, L_k)``
    """
    autocast = _autocast_device(q, k, v)
    if autocast is not None:  # inputs in autocast's dtype, and no autocast inside
        q, k, v, sinks, attn_bias = _autocast_inputs(q, k, v, sinks, attn_bias)
        with torch.autocast(autocast, enabled=False):
            return dense_attention(q, k, v, mask, is_causal=is_causal, scale=scale,
                                   dropout_p=dropout_p, training=training,
                                   return_attention=return_attention, batch=batch,
                                   attn_bias=attn_bias, softcap=softcap, sinks=sinks)
    check_tensors(q=q, k=k, v=v)
    check_same_device(q=q, k=k, v=v, mask=mask, attn_bias=attn_bias, sinks=sinks)
    check_strided(q=q, k=k, v=v, mask=mask, attn_bias=attn_bias, sinks=sinks)
    is_causal = check_flag(is_causal, "is_causal")
    training = check_flag(training, "training")
    return_attention = check_flag(return_attention, "return_attention")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() < 3:
            raise ValueError(f"{name} must have shape [..., L, H, C], got {list(t.shape)}")
    heads, kv_heads = q.size(-2), k.size(-2)
    grouped = kv_heads != heads and kv_heads > 0 and heads % kv_heads == 0
    if (k.shape[-3:-1] != v.shape[-3:-1] or q.size(-1) != k.size(-1)
            or (kv_heads != heads and not grouped)):
        raise ValueError(f"q [..., L_q, H, C], k and v [..., L_k, H_kv, C] (H_kv = H, or a "
                         f"divisor of H for grouped-query attention) do not fit together: "
                         f"got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    if batch is not None:  # before any broadcast: its message quotes the shapes given
        _check_batch(batch, q, k, v, mask, return_attention, attn_bias)
    if grouped and (batch is not None or attn_bias is not None or return_attention
                    or softcap is not None):
        # these paths take every query head's keys and values; SDPA shares them itself
        k, v = repeat_kv_heads(heads, k, v, dim=-2)  # (..., L_k, H, C)
    try:
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except RuntimeError:
        raise ValueError(f"the leading (batch) dims of q, k and v must broadcast together, "
                         f"got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}") from None
    check_float_dtype(q=q, k=k, v=v, sinks=sinks)
    if sinks is not None and tuple(sinks.shape) != (q.size(-2),):
        raise ValueError(f"sinks must have shape [H] = [{q.size(-2)}], one score per head, "
                         f"got {list(sinks.shape)}")
    # mixed dtypes promoted, as in edge_attention (a bias that is no float is refused below)
    float_bias = (attn_bias if isinstance(attn_bias, Tensor) and attn_bias.is_floating_point()
                  else None)
    q, k, v, sinks, float_bias = _common_dtype(q, k, v, sinks, float_bias)
    attn_bias = attn_bias if float_bias is None else float_bias
    if not q.shape[:-3] == k.shape[:-3] == v.shape[:-3]:
        # SDPA broadcasts q against k but not v: each input gets the common leading dims
        q, k, v = (t.expand(*lead, *t.shape[-3:]) for t in (q, k, v))
    check_dropout(dropout_p, "dropout_p")
    if scale is not None:
        scale = score_factor(scale, "scale", q, k, v)
    if softcap is not None:
        softcap = check_softcap(softcap, "dot", q, k, v)
        if batch is not None:
            raise ValueError("softcap is not taken with batch (per-graph attention runs in "
                             "scaled_dot_product_attention, which has no soft cap): pad the "
                             "graphs with to_dense_batch and pass a mask, or use "
                             "edge_attention on batch_complete_graph")
    L_q, L_k = q.size(-3), k.size(-3)
    if batch is not None:
        return _dense_attention_per_graph(q, k, v, batch, is_causal=is_causal, scale=scale,
                                          dropout_p=dropout_p, training=training, sinks=sinks)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
        # != each: under torch.compile, `in (1, L_q)` of a symbolic L_q decides wrongly
        rows, cols = (mask.size(-2), mask.size(-1)) if mask.dim() >= 2 else (0, 0)
        if mask.dim() < 2 or (rows != 1 and rows != L_q) or (cols != 1 and cols != L_k):
            raise ValueError(f"mask must have shape [..., L_q, L_k] = [..., {L_q}, {L_k}] "
                             f"(or 1 for either, broadcast), got {list(mask.shape)}")
        _check_leading_dims("mask", mask, 2, lead)
        if is_causal:
            mask = mask & torch.ones(L_q, L_k, dtype=torch.bool, device=q.device).tril()
            is_causal = False
    if attn_bias is not None:
        _check_attn_bias(attn_bias, lead, q.size(-2), L_q, L_k)
        if is_causal:  # SDPA takes no mask with is_causal
            mask = torch.ones(L_q, L_k, dtype=torch.bool, device=q.device).tril()
            is_causal = False
    if scale is None:
        scale = 1.0 / math.sqrt(max(q.size(-1), 1))  # C = 0: the score is 0 whatever the scale
    p = dropout_p if training else 0.0

    empty_rows = None  # (..., H or 1, L_q): the rows of a head without any key
    if attn_bias is not None:
        # (a NaN is no mask: it makes its row NaN, as in edge_attention)
        allowed = ~torch.isneginf(attn_bias)  # (..., H or 1, L_q, L_k)
        if mask is not None:
            allowed = allowed & mask.unsqueeze(-3)
        empty_rows = ~allowed.any(dim=-1)
        unread = ~allowed.any(dim=-2)  # (..., H or 1, L_k): keys no query of a head reads
        # an additive mask: the bias where allowed, -inf elsewhere, 0 on the empty rows
        mask = (attn_bias.to(q.dtype).masked_fill(~allowed, float("-inf"))
                .masked_fill(empty_rows.unsqueeze(-1), 0.0))
    elif mask is not None:
        empty_rows = ~mask.any(dim=-1).unsqueeze(-2)  # (..., 1, L_q)
        unread = ~mask.any(dim=-2).unsqueeze(-2)  # (..., 1, L_k)
        mask = (mask.unsqueeze(-3) | empty_rows.unsqueeze(-1))  # (..., 1, L_q, L_k)
    if empty_rows is not None:
        # What no output reads reaches no output and no gradient, whatever it holds (NaN or
        # inf included), as in edge_attention: a fully masked row attends everywhere (else
        # its softmax is NaN) with its query 0, and keys and values that no row reads are 0
        q = q.masked_fill(empty_rows.transpose(-1, -2).unsqueeze(-1), 0.0)
        k, v = (t.masked_fill(unread.transpose(-1, -2).unsqueeze(-1), 0.0) for t in (k, v))
    elif is_causal and L_k > L_q:
        # causal from the top left: the keys past the last query's position are read by none
        past = (torch.arange(L_k, device=q.device) >= L_q).view(L_k, 1, 1)  # (L_k, 1, 1)
        k, v = (t.masked_fill(past, 0.0) for t in (k, v))
    qh, kh, vh = (t.transpose(-3, -2) for t in (q, k, v))  # (..., H, L, C)

    weights = None
    if return_attention or softcap is not None:
        scores = scaled_scores(qh, kh, scale)  # (..., H, L_q, L_k)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if is_causal:
            mask = torch.ones(L_q, L_k, dtype=torch.bool, device=q.device).tril()
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            scores = scores + mask
        # half precision is scored and normalised in fp32, fp32 and fp64 in their own dtype
        weights = softmax_with_sinks(scores, sinks).to(q.dtype)
        if empty_rows is not None:
            weights = weights.masked_fill(empty_rows.unsqueeze(-1), 0.0)
        if p > 0.0:  # graphattn's mask, as the explicit path of sdpa draws it
            weights_dropped = weights * make_dropout_mask(weights.shape, p, device=q.device,
                                                          dtype=weights.dtype)
        else:
            weights_dropped = weights
        out = weights_dropped @ vh  # (..., H, L_q, C)
    else:
        out = sdpa(qh, kh, vh, attn_mask=mask, dropout_p=p, is_causal=is_causal, scale=scale,
                   sinks=sinks)
    out = out.transpose(-3, -2)  # (..., L_q, H, C)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows.transpose(-1, -2).unsqueeze(-1), 0.0)
    return (out, weights) if return_attention else out


def _check_attn_bias(attn_bias: Tensor, lead: torch.Size, heads: int, L_q: int,
                     L_k: int) -> None:
    """The checks of ``dense_attention(..., attn_bias=)``, naming the argument and the
    value."""
    check_tensors(attn_bias=attn_bias)
    if not attn_bias.is_floating_point():
        hint = " (a bool pattern goes to mask)" if attn_bias.dtype == torch.bool else ""
        raise TypeError(f"attn_bias must be a floating-point tensor{hint}, got "
                        f"{attn_bias.dtype}")
    shape = list(attn_bias.shape)
    # != each: under torch.compile, `in (1, H)` of a symbolic size decides wrongly
    if (attn_bias.dim() < 3 or (shape[-3] != 1 and shape[-3] != heads)
            or shape[-2] != L_q or shape[-1] != L_k):
        raise ValueError(f"attn_bias must have shape [..., H, L_q, L_k] = [..., {heads}, "
                         f"{L_q}, {L_k}] (H may be 1), got {shape}")
    _check_leading_dims("attn_bias", attn_bias, 3, lead)


def _check_leading_dims(name: str, t: Tensor, trailing: int, lead: torch.Size) -> None:
    """Raise unless the dims of ``t`` before its last ``trailing`` broadcast to ``lead``,
    those of q, k and v."""
    try:
        fits = torch.broadcast_shapes(lead, t.shape[:-trailing]) == lead
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"the leading dims of {name} must broadcast to those of q, k and v "
                         f"{list(lead)}, got {name} {list(t.shape)}")


def _check_batch(batch: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                 return_attention: bool, attn_bias: Tensor | None = None) -> None:
    """The checks of ``dense_attention(..., batch=)``, naming the argument and the value."""
    check_batch(batch)
    shapes = [list(t.shape) for t in (q, k, v)]
    if (q.dim() != 3 or k.dim() != 3 or v.dim() != 3
            or not q.size(0) == k.size(0) == v.size(0) == batch.size(0)):
        raise ValueError(f"with batch, q, k and v must be [N, H, C] for the N entries of batch "
                         f"[N], got q {shapes[0]}, k {shapes[1]}, v {shapes[2]} and batch "
                         f"{list(batch.shape)}")
    check_same_device(q=q, batch=batch)
    if mask is not None:
        raise ValueError("mask and batch cannot be combined: batch masks every pair of nodes "
                         "of different graphs")
    if attn_bias is not None:
        raise ValueError("attn_bias and batch cannot be combined (graphs of different sizes "
                         "have biases of different shapes); use edge_attention(..., bias=) on "
                         "graphs.batch_complete_graph(batch)")
    if return_attention:
        raise ValueError("return_attention=True is not supported with batch (graphs of "
                         "different sizes have weights of different shapes); call "
                         "dense_attention per graph, or edge_attention on "
                         "graphs.batch_complete_graph(batch)")


def _dense_attention_per_graph(q: Tensor, k: Tensor, v: Tensor, batch: Tensor, *,
                               is_causal: bool, scale: float | None, dropout_p: float,
                               training: bool, sinks: Tensor | None = None) -> Tensor:
    """Dense attention inside each graph of ``batch`` (see :func:`dense_attention` and
    :func:`~graphattn.functional.dense_backend.per_graph_attention`)."""
    if v.size(0) == 0:  # no graph: the plain path's empty output, with its autograd graph
        return dense_attention(q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                               training=training, sinks=sinks)
    if scale is None:
        scale = 1.0 / math.sqrt(max(q.size(-1), 1))
    batch = dense_graph_ids(batch)  # ids below N: the per-graph sizes take O(N) memory
    return per_graph_attention(q, k, v, batch, is_causal=is_causal, scale=scale,
                               dropout_p=dropout_p if training else 0.0, sinks=sinks)
