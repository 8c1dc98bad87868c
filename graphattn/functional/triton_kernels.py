r"""Fused Triton kernels for edge attention: online softmax over CSR rows, forward and backward.

The reference backend materialises ``[E, H, C]`` messages and runs several kernels. Here the
whole operator is three kernels in the FlashAttention style; scores and weights live in
registers and nothing of size ``[E, H, C]`` is ever written but the gradients of the per-edge
terms below, when they are inputs.

**Forward** (one program per target node i and block of heads). The edges sorted by target form
a CSR matrix; the program walks row i in blocks of ``BLOCK_E`` edges and keeps, per head, a
running maximum :math:`m`, a running sum :math:`\ell` and an accumulator :math:`a`:

.. math::
    m' = \max(m, \max_e s_e), \quad
    \ell' = e^{m - m'} \ell + \sum_e e^{s_e - m'}, \quad
    a' = e^{m - m'} a + \sum_e e^{s_e - m'} d_e \, v_e

with :math:`d_e` the dropout multiplier (1 without dropout) and :math:`s_e` the score of edge
:math:`e = (j \to i)`, computed in the tile from its key :math:`k_e` and value :math:`v_e`,

.. math::
    k_e = k_j + \mathrm{ek}_e, \qquad v_e = v_j + \mathrm{ev}_e,

where the per-edge terms ``edge_key`` :math:`\mathrm{ek}` and ``edge_value``
:math:`\mathrm{ev}` ``[E, H, C]`` are 0 when not given (``edge_key`` only with ``"dot"`` and
``"gatv2"``); they are read at the edge ids, like the bias, and added in registers. The score
is :math:`\text{scale} \cdot q_i \cdot k_e + b_e` (``"dot"``),
:math:`\text{scale} \cdot \mathrm{LeakyReLU}(q_i + k_j + b_e)` (``"additive"``) or

.. math::
    s_e = \text{scale} \sum_c a_c \, \mathrm{LeakyReLU}(z_{ec}) + b_e, \qquad
    z_e = q_i + k_e

(``"gatv2"``, with the attention vector :math:`a` of the head; :math:`z_e` lives only in
registers, as a ``(BLOCK_E, BLOCK_H, BLOCK_C)`` tile). It writes
:math:`\mathrm{out}_i = a / \ell` ``[N_dst, H, C]`` and the softmax statistics
``lse`` ``[N_dst, H, 2]``, :math:`(m_i, \log \ell_i)`, all in fp32 (out is returned in the
dtype of v; the fp32 copy is what backward reads, so half-precision rounding of out does not
enter the gradients). On a graph of at least ``HUB_EDGES`` edges, the rows of more than
``SUM_STEPS`` tiles of edges (hubs) run in a launch of their own, whose sums over a row's edges
(:math:`a` and :math:`\ell` here, shifted to the row's running maximum at each block, and
those of backward over a target's or a source's edges) run in fp32 over ``SUM_STEPS`` tiles at
a time and add those block sums in float64: the rounding of a hub of :math:`10^4` in-edges
stays that of a row of one block (``benchmarks/hub_precision.py``). Every weight is recomputed
from them as

.. math::
    \alpha_e = e^{(s_e - m_i) - \log \ell_i},

the two kept apart: their sum, the log-sum-exp, would round to :math:`m_i` when
:math:`|m_i| \gg \log \ell_i` (a row masked with a bias of -1e9 on every edge, tied scores
near 1e30), and every weight of the row would come out 1 instead of :math:`1 / \ell_i`. A row
without weight (no incoming edge, or every score :math:`-\infty`) gets out 0,
:math:`m_i = +\infty` and :math:`\log \ell_i = 0`, so every :math:`\alpha_e` recomputed from
it is exactly 0, never NaN. When the attention weights are asked for, the kernel also writes
the scores :math:`s_e` ``[E, H]`` and :math:`\alpha_e` is one elementwise pass afterwards.

**Backward** recomputes :math:`\alpha_e` from q, k, ek, bias and the saved statistics. With
:math:`\delta_i = \sum_c \mathrm{dout}_{ic} \mathrm{out}_{ic}` (plus
:math:`\sum_e \alpha_e \, \mathrm{d}\alpha_e` when the returned attention weights carry a
gradient) the softmax gradient of an edge is

.. math::
    \mathrm{d}s_e = \alpha_e \big(d_e \, \mathrm{dout}_i \cdot v_e + \mathrm{d}\alpha_e
    - \delta_i\big).

A pass over target rows gives dq, :math:`\delta` and the gradients of the per-edge inputs (bias,
ek, ev), each edge's written once by the program of its target; a pass over source rows (the
transposed CSR: edges sorted by source) gives dk and dv. For ``"gatv2"`` both recompute
:math:`z_e`; with :math:`\mathrm{LeakyReLU}'(z) = 1` for :math:`z > 0` and the slope otherwise
(at 0 like torch), and sums over the edges into target i or out of source j,

.. math::
    \mathrm{d}q_i = \text{scale} \; a \odot \sum_{e \to i} \mathrm{d}s_e \,
    \mathrm{LeakyReLU}'(z_e), \qquad
    \mathrm{d}k_j = \text{scale} \; a \odot \sum_{j \to e} \mathrm{d}s_e \,
    \mathrm{LeakyReLU}'(z_e), \qquad
    \mathrm{d}a = \sum_i \text{scale} \sum_{e \to i} \mathrm{d}s_e \,
    \mathrm{LeakyReLU}(z_e).

The key term enters :math:`s_e` as :math:`k_j` does and the value term is weighted as
:math:`v_j` is, so their gradients are the terms of :math:`\mathrm{d}k_j` and
:math:`\mathrm{d}v_j` of one edge, not summed:

.. math::
    \mathrm{d}\mathrm{ek}_e = \text{scale} \; \mathrm{d}s_e \, q_i \;\; (\text{dot}), \qquad
    \mathrm{d}\mathrm{ek}_e = \text{scale} \; \mathrm{d}s_e \, a \odot
    \mathrm{LeakyReLU}'(z_e) \;\; (\text{gatv2}), \qquad
    \mathrm{d}\mathrm{ev}_e = \alpha_e d_e \, \mathrm{dout}_i.

The target pass writes the share of each target in :math:`\mathrm{d}a` (the inner sum),
``[N_dst, H, C]`` in fp32, and torch adds them up. Each program owns the rows it writes, so
there are no atomics and the gradients are bit-for-bit deterministic.

**Row blocks.** The kernels above give each node a program of its own. Inside
:func:`launch_tiles` with ``block_n > 1``, row-block kernels run instead: a program takes
``block_n`` rows (targets in the forward and the target pass, sources in the source pass) that
lie next to each other in the order of decreasing degree (``CSR.order``), and steps through
one edge of each at a time, every lane keeping its own running maximum, sum and accumulator.
Nothing is summed across lanes, and a program has ``block_n`` independent gathers in flight
per step instead of the edges of one row. Rows of more than ``heavy_degree`` edges, which
would hold their block for as many steps, get one program each in the one-node kernels (at
most E // (heavy_degree + 1) of them; their number is not read back to the host). Both kinds
compute the same values, up to the order of the sums; which is faster on a GPU is for
``benchmarks/triton_tuning.py`` to say, and the one-node kernels stay the default until it
has.

**Block-sparse kernels.** Inside :func:`launch_tiles` with ``block_sparse=B``, calls of the dot
score (with a bias, dropout, sinks and the weights returned, or without) and no per-edge terms
or soft cap, with q, k and v of one dtype, on a graph without repeated edges whose tiles are
at least 1/64 full, run the kernels of :mod:`graphattn.functional.triton_blocks` instead: B x B
tiles of the adjacency matrix as matrix products (on tensor cores for half inputs and TF32;
full fp32 products run on the FMA units), for graphs whose edges gather near its diagonal.

**Dropout** is supported: ``edge_attention`` passes the parameters of a seeded mask (a seed
drawn on the inputs' device, the threshold and :math:`1 / (1 - p)` in fp32, whatever the
inputs' dtype, so that it is not rounded;
:func:`~graphattn.functional.dropout.seeded_mask_parameters`), and every kernel computes the
multiplier :math:`d_e` of the entries it touches in registers from them, the same in forward
and backward; no ``[E, H]`` mask is stored. A float ``[E, H]`` mask given to
``triton_edge_attention`` is read instead.

**Tiles of 64 in fp32** without TF32 (``launch_tiles(block_sparse=64)``, ``allow_tf32``
off): the block-sparse backward kernels spill registers, up to tens of KB per thread with
C = 64 (``benchmarks/results/triton_resources_blocks.md``, compiled for sm_90); tiles of 32,
and tiles of 64 with TF32 or bf16, spill at most 168 bytes there.

**Triton is optional.** This module imports it lazily; kernels are defined on first use. With
``TRITON_INTERPRET=1`` in the environment at that moment they run in Triton's interpreter,
which accepts CPU tensors (slowly): this is how the tests check them without a GPU. The mode is
read at every call, and kernels are kept per mode; but a process that has run interpreted
kernels cannot compile afterwards (the interpreter leaves ``triton.language`` patched), so
switch from compiled to interpreted only, or use a fresh process.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from graphattn._tensor_cache import TensorCache
from graphattn.functional._transforms import apply_function, needs_grad, plain_ops_only, saveable
from graphattn.functional.dropout import mask_tensor
from graphattn.functional.reference import reference_grads
from graphattn.functional.sinks import sink_grad
from graphattn.functional.triton_blocks import (
    BLOCK_SIDES,
    BlockSparseAttention,
    _block_forward_op,
    block_inference,
    graph_blocks,
    use_blocks,
)

INSTALL_HINT = "pip install 'graphattn[gpu]'"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCORE_KINDS = {"dot": 0, "additive": 1, "gatv2": 2}  # the kernels' compile-time SCORE


_TRITON_IMPORT: dict[str, bool] = {}  # "available": whether import triton worked


@torch.compiler.assume_constant_result  # torch.compile reads it once, as a constant
def triton_available() -> bool:
    """Whether ``import triton`` works in this installation (tried once)."""
    if "available" not in _TRITON_IMPORT:
        try:
            import triton  # noqa: F401
            _TRITON_IMPORT["available"] = True
        except ImportError:
            _TRITON_IMPORT["available"] = False
    return _TRITON_IMPORT["available"]


def use_triton_for(q: Tensor) -> bool:
    """Whether ``backend="auto"`` picks the fused kernels: CUDA tensors of a supported dtype
    (fp32, fp16, bf16) and triton importable."""
    return q.device.type == "cuda" and q.dtype in DTYPES and triton_available()


@torch.compiler.assume_constant_result
def interpret_mode() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``) right now
    (under ``torch.compile``: when the graph was traced)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of the kernels for one (H, C, C_k).

    With ``block_n = 1`` (the default) a program handles ``block_h`` heads of one node and
    walks its edges ``block_e`` at a time; a tile is ``[block_e, block_h, block_c]`` (edges,
    heads, channels of v), with ``block_c`` the next power of two >= C (masked), and
    ``[block_e, block_h, block_ck]`` for q, k and att, with ``block_ck`` that of C_k.

    With ``block_n > 1`` the row-block kernels run instead: a program handles ``block_n``
    nodes of about the same degree (consecutive in the order of decreasing degree) and one
    edge of each per step, in tiles ``[block_n, block_h, block_c]``; the nodes of more than
    ``heavy_degree`` edges, which would hold their block for as many steps, each get a program
    of the one-node kernels, ``block_e`` edges at a time.
    """

    block_e: int
    block_h: int
    block_c: int
    num_warps: int
    block_ck: int
    block_n: int = 1
    heavy_degree: int = 256


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def launch_config(heads: int, channels: int, score_channels: int | None = None) -> LaunchConfig:
    """Tiles of at most 2048 values (16 fp32 registers per thread and operand at 4 warps):
    up to 128 values of a node per program and up to 32 edges per step, except that one
    head's channels always fit in one tile (C > 128 gives one head per program and, above
    2048 channels, one edge per step; C is rounded up to a power of 2). ``score_channels`` is
    C_k, the channels of q and k (1 for the additive score; default: ``channels``); the wider
    of the two sets the tile. Inside :func:`launch_tiles`, the tiles given replace these; with
    ``block_n > 1`` and no ``num_warps`` given, one warp per 256 values of the row-block tile
    ``[block_n, block_h, C]``, at most 8: a row-block program keeps a whole tile of q and of
    its accumulator beside the tiles of k and v, and fewer values per thread keep it from
    needing twice the registers (compiled for sm_90, H = 4, C = 32: 48 registers a thread in
    the forward kernel with 8 nodes on 4 warps, 90 on 2; ``benchmarks/triton_resources.py``)."""
    block_c = _next_power_of_2(channels)
    block_ck = block_c if score_channels is None else _next_power_of_2(score_channels)
    widest = max(block_c, block_ck)
    block_h = min(_next_power_of_2(heads), max(1, 128 // widest))
    block_e = max(1, min(32, 2048 // (block_h * widest)))
    tile = block_e * block_h * widest
    cfg = LaunchConfig(block_e=block_e, block_h=block_h, block_c=block_c,
                       num_warps=max(1, min(4, tile // 512)), block_ck=block_ck)
    open_tiles = _TILES  # one snapshot (launch_tiles on another thread replaces it whole)
    if open_tiles:  # inside launch_tiles
        tiles = {name: value for name, value in open_tiles.items() if name != "block_sparse"}
        if "block_h" in tiles:
            tiles["block_h"] = min(tiles["block_h"], _next_power_of_2(heads))
        cfg = replace(cfg, **tiles)
        if cfg.block_n > 1 and "num_warps" not in tiles:  # warps for the row-block tile
            tile = cfg.block_n * cfg.block_h * widest
            cfg = replace(cfg, num_warps=max(1, min(8, tile // 256)))
    return cfg


_TILES: dict[str, int] = {}  # what launch_tiles sets: LaunchConfig fields and block_sparse
_OPEN_TILES: list[dict[str, int]] = []  # the settings of each open launch_tiles, in entry order
_TILES_LOCK = threading.Lock()  # held while a launch_tiles block opens or closes
_WARPS = (1, 2, 4, 8, 16)
_POWERS_OF_2 = ("block_e", "block_h", "block_n")


@contextlib.contextmanager
def launch_tiles(*, block_e: int | None = None, block_h: int | None = None,
                 num_warps: int | None = None, block_n: int | None = None,
                 heavy_degree: int | None = None,
                 block_sparse: int | None = None) -> Iterator[None]:
    """Run the Triton kernels with other tiles than :func:`launch_config` picks, to tune them
    on a GPU (``benchmarks/triton_tuning.py``).

    Inside the ``with`` block, every launch in the process takes the tiles given here and
    :func:`launch_config` picks the rest; calls under ``torch.compile`` too, since the tiles are
    read at each launch. The setting is process-wide on purpose: on CUDA, autograd runs the
    backward kernels on its own thread for the device, which a thread- or context-local
    setting would not reach. Enter it outside the compiled function: dynamo cannot trace it (it
    would set and restore the tiles after the graph ran), so a compiled function that enters
    it runs eagerly, and with ``fullgraph=True`` fails. Each set of tiles compiles its own
    kernels. Results differ from those of other tiles by rounding only: ``block_e`` changes
    the order in which a row's edges are summed.

    Args:
        block_e (int, optional): edges per step of a row, a power of 2.
        block_h (int, optional): heads per program, a power of 2; at most the next power of 2
            >= H is used.
        num_warps (int, optional): warps per program: 1, 2, 4, 8 or 16 (the block-sparse
            kernels' too).
        block_n (int, optional): nodes per program, a power of 2: 1 runs the one-node
            kernels, more the row-block kernels (see :class:`LaunchConfig`).
        heavy_degree (int, optional): with ``block_n > 1``, the most edges a node may have
            to be handled in a row block; those with more get a program each. A non-negative
            integer.
        block_sparse (int, optional): run the calls that qualify on the block-sparse
            kernels of :mod:`graphattn.functional.triton_blocks`, in tiles of
            ``block_sparse`` x ``block_sparse`` (32 or 64); the others keep to the CSR
            kernels. ``torch.compile`` reads this one when it traces, and traces again
            when a call sees another value.

    Example:
        >>> with launch_tiles(block_e=8, num_warps=2):
        ...     out = edge_attention(q, k, v, edge_index, backend="triton")
        >>> with launch_tiles(block_n=16, heavy_degree=128):
        ...     out = edge_attention(q, k, v, edge_index, backend="triton")
        >>> with launch_tiles(block_sparse=64):  # a window graph: dense tiles near the diagonal
        ...     out = edge_attention(q, k, v, window_graph(4096, 64), backend="triton")
    """
    tiles = {"block_e": block_e, "block_h": block_h, "num_warps": num_warps,
             "block_n": block_n, "heavy_degree": heavy_degree, "block_sparse": block_sparse}
    for name in _POWERS_OF_2:
        value = tiles[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1 or value & (value - 1)):
            raise ValueError(f"{name} must be a power of 2, got {value!r}")
    if num_warps is not None and (isinstance(num_warps, bool) or num_warps not in _WARPS):
        raise ValueError(f"num_warps must be one of {list(_WARPS)}, got {num_warps!r}")
    if block_sparse is not None and (type(block_sparse) is not int
                                     or block_sparse not in BLOCK_SIDES):
        raise ValueError(f"block_sparse must be one of {list(BLOCK_SIDES)}, got "
                         f"{block_sparse!r}")
    if heavy_degree is not None and (isinstance(heavy_degree, bool)
                                     or not isinstance(heavy_degree, int) or heavy_degree < 0):
        raise ValueError(f"heavy_degree must be a non-negative integer, got {heavy_degree!r}")
    if torch.compiler.is_compiling():  # dynamo would replay the change after the graph ran
        raise RuntimeError("launch_tiles must be entered outside the function that "
                           "torch.compile compiles, not inside it")
    entry = {name: value for name, value in tiles.items() if value is not None}
    with _TILES_LOCK:
        _OPEN_TILES.append(entry)
        _apply_open_tiles()
    try:
        yield
    finally:
        # this block's own entry, found by identity: blocks that threads open and close out of
        # order leave what the still open ones set (restoring a saved copy left a closed
        # block's tiles in force for good). Under the lock: two threads closing at once
        # deleted each other's entries by a stale position, and left theirs in force.
        with _TILES_LOCK:
            _OPEN_TILES[:] = [open_entry for open_entry in _OPEN_TILES
                              if open_entry is not entry]
            _apply_open_tiles()


def _apply_open_tiles() -> None:
    """``_TILES``: the settings of the open ``launch_tiles`` blocks, later ones on top; a new
    dict, not the old one cleared and refilled, so that a launch on another thread reads either
    settings whole (it read an empty dict in between, and the defaults)."""
    global _TILES
    tiles: dict[str, int] = {}
    for entry in _OPEN_TILES:
        tiles.update(entry)
    _TILES = tiles


def _score_channels(q: Tensor, score: str) -> int:
    """C_k: the channels of q and k, 1 for the additive score (q and k are ``[N, H]``)."""
    return 1 if score == "additive" else q.size(-1)


@dataclass(frozen=True)
class CSR:
    """Edges grouped by one endpoint: row r owns positions ``ptr[r]:ptr[r + 1]``.

    ``other[p]`` is the opposite endpoint of the edge at position p and ``edge_id[p]`` its column
    in ``edge_index`` (where bias, dropout mask and alpha live). ``order`` lists the rows by
    decreasing number of edges (ties in row order), for the row-block kernels.
    """

    ptr: Tensor
    other: Tensor
    edge_id: Tensor
    order: Tensor


# A kernel walks a row in tiles of BLOCK_E positions from its start, e0 + arange(BLOCK_E), and
# the lanes of its last tile reach past the row's end: int32 positions stay this far below
# 2^31 - 1 so that those lanes do not wrap to negative positions, which the mask `< end` would
# let through. (The margin keeps the kernels' int32 arithmetic, which widening the bounds to
# int64 in the kernels would not: Triton's interpreter types its loop counter int32 anyway.)
CSR_POSITION_MARGIN = 2**16


def csr_index_dtype(num_edges: int, num_rows: int, num_other: int) -> torch.dtype:
    """int32 for the CSR of ``num_edges`` edges between ``num_rows`` rows and ``num_other``
    nodes when every id fits, with the positions ``CSR_POSITION_MARGIN`` below 2^31 - 1; else
    int64."""
    fits = (num_edges < 2**31 - 1 - CSR_POSITION_MARGIN
            and max(num_rows, num_other) < 2**31 - 1)
    return torch.int32 if fits else torch.int64


def build_csr(rows: Tensor, other: Tensor, num_rows: int, num_other: int) -> CSR:
    """Group edges by ``rows`` with a stable sort (so the summation order is deterministic).

    Args:
        rows (Tensor): ``[E]`` integer, the endpoint to group by, values in ``[0, num_rows)``.
        other (Tensor): ``[E]`` integer, the opposite endpoint, values in ``[0, num_other)``.
        num_rows (int): number of rows.
        num_other (int): number of nodes on the opposite side.

    Shapes:
        - **output:** ptr ``(num_rows + 1)``, other and edge_id ``(E)``, order ``(num_rows)``;
          int32 when every value fits, int64 otherwise.
    """
    index_dtype = csr_index_dtype(rows.numel(), num_rows, num_other)
    rows = rows.to(index_dtype)
    sorted_rows, perm = torch.sort(rows, stable=True)  # (E)
    # ptr[r] = the number of edges in rows < r. A binary search per row rather than bincount,
    # which on CUDA reads the largest value back to the host (a synchronisation per call).
    bounds = torch.arange(num_rows + 1, dtype=index_dtype, device=rows.device)
    ptr = torch.searchsorted(sorted_rows, bounds, out_int32=index_dtype == torch.int32)
    degree = ptr[1:] - ptr[:-1]  # (num_rows)
    order = torch.sort(degree, descending=True, stable=True).indices.to(index_dtype)
    return CSR(ptr=ptr, other=other[perm].to(index_dtype), edge_id=perm.to(index_dtype),
               order=order)


# The CSR orderings of recently used graphs, by edge_index tensor (graphattn._tensor_cache): on
# CUDA, a training loop that passes the same edge_index at every step sorts it once per direction
# instead of twice per step. Each entry holds 4 (2 N + 1) + 8 E bytes (int32 ids).
_CSR_CACHE: TensorCache[CSR] = TensorCache(max_entries=8)


def graph_csr(edge_index: Tensor, *, by_target: bool, num_dst: int, num_src: int,
              cached: bool = True) -> CSR:
    """:func:`build_csr` of the edges grouped by target (``by_target``) or by source; on CUDA
    kept for as long as ``edge_index`` lives unmodified (the same tensor object), unless
    ``cached=False``.

    Args:
        edge_index (Tensor): ``[2, E]``, checked by the caller.
        by_target (bool): group by ``edge_index[1]`` (the forward's rows), else by
            ``edge_index[0]`` (the rows of dk and dv).
        num_dst (int): number of targets.
        num_src (int): number of sources.
        cached (bool, optional): look up and keep the result in the cache. The operators that
            ``torch.compile`` calls pass ``False``: inductor reuses the buffer of a dead
            intermediate for another one, the same tensor object rewritten by its kernels
            without a version bump, so a kept CSR could be served for another graph.
            (default: ``True``)
    """
    if by_target:
        def compute() -> CSR:
            return build_csr(edge_index[1], edge_index[0], num_dst, num_src)
    else:
        def compute() -> CSR:
            return build_csr(edge_index[0], edge_index[1], num_src, num_dst)
    if not cached:
        return compute()
    return _CSR_CACHE.get(edge_index, (by_target, num_dst, num_src), compute)


def clear_csr_cache() -> None:
    """Free the CSR orderings kept for the graphs seen so far (see :func:`graph_csr`)."""
    _CSR_CACHE.clear()


def _load_kernel_module(interpret: bool) -> ModuleType:
    """Load ``_triton_jit.py`` as a module of its own for this mode (see its docstring)."""
    path = Path(__file__).with_name("_triton_jit.py")
    name = f"graphattn.functional._triton_jit_{'interpreted' if interpret else 'compiled'}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_KERNEL_MODULES: dict[bool, ModuleType] = {}


def kernels() -> ModuleType:
    """The kernel module for the current mode (compiled, or interpreted under
    ``TRITON_INTERPRET=1``): ``forward_kernel``, ``backward_target_kernel``,
    ``backward_source_kernel``."""
    mode = interpret_mode()
    if mode not in _KERNEL_MODULES:
        _KERNEL_MODULES[mode] = _load_kernel_module(mode)
    return _KERNEL_MODULES[mode]


# The row-block kernel of each one-node kernel (LaunchConfig.block_n > 1).
ROW_BLOCK_KERNELS = {"forward_kernel": "forward_rows_kernel",
                     "backward_target_kernel": "backward_target_rows_kernel",
                     "backward_source_kernel": "backward_source_rows_kernel"}


def on_device_of(tensor: Tensor) -> contextlib.AbstractContextManager:
    """The context of a Triton launch on ``tensor``'s device. Triton launches on the current
    CUDA device, on its current stream: inputs on another GPU (``cuda:1`` while ``cuda:0`` is
    current) make theirs the current device for the launch. Nothing on CPU (the
    interpreter)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _launch_over_rows(name: str, csr: CSR, cfg: LaunchConfig, heads: int, before: tuple,
                      after: tuple, **flags) -> None:
    """Launch the pass ``name`` (a kernel of :func:`kernels`) over the rows of ``csr``, its
    arguments ``before`` and ``after`` those of the CSR.

    ``cfg.block_n == 1``: one program per row and head block. Otherwise one program per
    ``block_n`` rows of the degree order, in the row-block kernel, and one per row of more
    than ``cfg.heavy_degree`` edges in the one-row kernel: at most E // (heavy_degree + 1)
    rows have that many, and they come first in the order, so that many programs are
    launched, and those that find a lighter row return without a store (the number of heavy
    rows is never read back to the host).
    """
    num_rows, num_edges = csr.order.numel(), csr.other.numel()
    if num_rows == 0:
        return
    module = kernels()
    head_blocks = -(-heads // cfg.block_h)
    tiles = dict(BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, BLOCK_CK=cfg.block_ck,
                 num_warps=cfg.num_warps)
    # float64 block sums (SUM_STEPS) only in a launch of the rows of many blocks, on graphs
    # large enough to hold such rows: the other launches keep the registers of one fp32 sum
    sums = SUM_STEPS if num_edges >= HUB_EDGES else 0

    def launch(kernel, programs: int, max_degree: int, **variant) -> None:
        with on_device_of(csr.ptr):
            kernel[(programs, head_blocks)](*before, csr.ptr, csr.other, csr.edge_id,
                                            csr.order, num_rows, max_degree, *after, **tiles,
                                            **variant, **flags)

    one_row = getattr(module, name)
    if cfg.block_n == 1:
        hub_degree = SUM_STEPS * cfg.block_e  # the edges of one block
        hubs = min(num_rows, num_edges // (hub_degree + 1)) if sums else 0
        if hubs == 0:
            launch(one_row, num_rows, hub_degree, BLOCK_E=cfg.block_e, SUM_STEPS=0)
            return
        launch(one_row, num_rows, hub_degree, BLOCK_E=cfg.block_e, SUM_STEPS=0,
               LIGHT_ONLY=True)
        launch(one_row, hubs, hub_degree, BLOCK_E=cfg.block_e, SUM_STEPS=sums,
               HEAVY_ONLY=True)
        return
    heavy = min(num_rows, num_edges // (cfg.heavy_degree + 1))
    if heavy > 0:
        launch(one_row, heavy, cfg.heavy_degree, BLOCK_E=cfg.block_e, SUM_STEPS=sums,
               HEAVY_ONLY=True)
    launch(getattr(module, ROW_BLOCK_KERNELS[name]), -(-num_rows // cfg.block_n),
           cfg.heavy_degree, BLOCK_N=cfg.block_n)


# The one-node kernels can sum a row's edges (forward: the output and the softmax sum; target
# pass: dq, d att and the weights' share of delta; source pass: dk and dv) SUM_STEPS tiles of
# block_e edges at a time in fp32 and add those block sums in float64, as the cpu backend adds
# blocks of its SUM_BLOCK edges: a hub's sums then round like those of a row of SUM_STEPS tiles
# plus one float64 add per block, where one fp32 sum over all of its tiles drifts with its
# degree (benchmarks/hub_precision.py). The float64 sums cost registers (sm_90, 4 heads of 32
# channels, fp32: 64 a thread in the forward kernel instead of 48, 122 in the source pass
# instead of 80; benchmarks/triton_resources.py --hub), so they run in a launch of their own:
# on a graph of at least HUB_EDGES edges, the rows of more than one block (SUM_STEPS * block_e
# edges, 512 and more) take a program each in a second launch of the one-node kernel, as the
# row-block kernels leave their heavy rows, and the first launch leaves them out. Smaller
# graphs, and rows of one block, keep one fp32 sum and one launch per pass. The row-block
# kernels' rows (at most heavy_degree edges) and the block-sparse kernels sum in fp32.
SUM_STEPS = 32
HUB_EDGES = 2**16


SEEDED_MASK_BLOCK = 1024  # mask entries per program of seeded_mask_kernel


def write_seeded_mask(parameters: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """The mask a seeded mask's ``parameters`` stand for
    (:func:`~graphattn.functional.dropout.seeded_mask_parameters`), written by a Triton kernel
    on their device, in ``dtype``: the multipliers the other kernels draw in registers, entry
    by entry, and the mask :func:`~graphattn.functional.dropout.seeded_mask` writes on CPU.
    No host sync: the parameters stay on the device."""
    out = torch.empty(shape, dtype=dtype, device=parameters.device)
    n = out.numel()
    if n > 0:
        with on_device_of(out):
            kernels().seeded_mask_kernel[(-(-n // SEEDED_MASK_BLOCK),)](
                parameters, out, n, BLOCK=SEEDED_MASK_BLOCK)
    return out


def fused_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                  dropout_mask: Tensor | None, csr: CSR, *, scale: float, score: str,
                  negative_slope: float, need_scores: bool, att: Tensor | None = None,
                  edge_key: Tensor | None = None, edge_value: Tensor | None = None,
                  out_dtype: torch.dtype = torch.float32, softcap: float = 0.0,
                  sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Launch the forward kernel on contiguous inputs and the target CSR of the graph
    (``att``: the ``[H, C]`` attention vector of ``score="gatv2"``; ``edge_key``,
    ``edge_value``: the ``[E, H, C]`` per-edge terms of keys and values; ``softcap``: the cap
    of the dot and gatv2 scores, 0 for none; ``sinks``: ``[H]``, the score of each head's
    sink, :mod:`graphattn.functional.sinks`).

    Returns out ``[N_dst, H, C]`` in ``out_dtype`` (fp32, which backward needs, unless told
    otherwise) and lse ``[N_dst, H, 2]`` in fp32 (the row maximum m and log l of each target
    and head; see the module docstring), and the scores ``[E, H]`` (fp32, in ``edge_index``
    order) when ``need_scores``.
    """
    n_dst, (heads, channels) = q.size(0), v.shape[1:]
    score_channels = _score_channels(q, score)
    cfg = launch_config(heads, channels, score_channels)
    out = torch.empty(n_dst, heads, channels, device=v.device, dtype=out_dtype)
    lse = torch.empty(n_dst, heads, 2, device=v.device, dtype=torch.float32)  # (m, log l)
    scores = (torch.empty(csr.other.numel(), heads, device=v.device, dtype=torch.float32)
              if need_scores else None)
    _launch_over_rows(
        "forward_kernel", csr, cfg, heads,
        (q, k, v, _or(bias, q), _or(att, q), _or(dropout_mask, q), _or(edge_key, q),
         _or(edge_value, v)),
        (out, lse, _or(scores, lse), scale, negative_slope, softcap,
         lse if sinks is None else sinks.float().contiguous()),
        H=heads, C=channels, CK=score_channels, SCORE=SCORE_KINDS[score], HAS_CAP=softcap > 0,
        HAS_SINKS=sinks is not None,
        HAS_BIAS=bias is not None, HAS_DROP=dropout_mask is not None,
        HAS_EK=edge_key is not None, HAS_EV=edge_value is not None, NEED_SCORES=need_scores)
    return out, lse, scores


def _alpha_dtype(q: Tensor, k: Tensor, bias: Tensor | None, att: Tensor | None,
                 edge_key: Tensor | None = None, sinks: Tensor | None = None) -> torch.dtype:
    """The dtype of the scores of the reference backend: that of q, k and what they meet."""
    dtype = torch.promote_types(q.dtype, k.dtype)
    for t in (bias, att, edge_key, sinks):
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _forward(q: Tensor, k: Tensor, v: Tensor, att: Tensor | None, bias: Tensor | None,
             dropout_mask: Tensor | None, edge_index: Tensor, scale: float,
             negative_slope: float, score: str, need_alpha: bool,
             edge_key: Tensor | None = None, edge_value: Tensor | None = None,
             softcap: float = 0.0, sinks: Tensor | None = None, *, cached: bool = True,
             out_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, CSR]:
    """The forward pass on contiguous inputs: out (in ``out_dtype``: fp32 for backward),
    alpha (``[0, H]`` unless ``need_alpha``), lse and the target CSR (``cached``: see
    :func:`graph_csr`; ``softcap`` 0: no cap; ``sinks``: see :func:`fused_forward`)."""
    csr = graph_csr(edge_index, by_target=True, num_dst=q.size(0), num_src=v.size(0),
                    cached=cached)
    # fp32 out for training: backward's delta = dout . out must not see the rounding of a
    # half out
    out, lse, scores = fused_forward(q, k, v, bias, dropout_mask, csr, scale=scale,
                                     score=score, att=att, negative_slope=negative_slope,
                                     need_scores=need_alpha, edge_key=edge_key,
                                     edge_value=edge_value, out_dtype=out_dtype,
                                     softcap=softcap, sinks=sinks)
    alpha = weights_from_scores(scores, lse, edge_index,
                                _alpha_dtype(q, k, bias, att, edge_key, sinks))
    return out, alpha, lse, csr


def weights_from_scores(scores: Tensor | None, lse: Tensor, edge_index: Tensor,
                        dtype: torch.dtype) -> Tensor:
    """The attention weights ``[E, H]`` in ``dtype`` from the kernels' fp32 scores ``[E, H]``
    and softmax statistics ``lse``; ``[0, H]`` when no scores were written."""
    if scores is None:
        return torch.empty(0, lse.size(1), device=lse.device, dtype=dtype)
    # m = +inf on rows without weight, scores -inf on masked edges: exp gives 0.
    stats = lse[edge_index[1]]  # (E, H, 2)
    return torch.exp((scores - stats[..., 0]) - stats[..., 1]).to(dtype)  # (E, H)


def _backward(dout: Tensor, dalpha: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
              att: Tensor | None, bias: Tensor | None, dropout_mask: Tensor | None,
              edge_index: Tensor, out32: Tensor, lse: Tensor, csr: CSR, scale: float,
              negative_slope: float, score: str, need_dbias: bool, need_datt: bool, *,
              edge_key: Tensor | None = None, edge_value: Tensor | None = None,
              need_dedge_key: bool = False, need_dedge_value: bool = False,
              value_is_key: bool = False, cached: bool = True, softcap: float = 0.0,
              ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None,
                         Tensor | None]:
    """The backward passes: dq, dk, dv, d att (when ``need_datt``), d bias (when
    ``need_dbias``), d edge_key and d edge_value (when ``need_dedge_key``,
    ``need_dedge_value``). ``value_is_key``: ``edge_value`` is ``edge_key`` (one tensor as both
    terms, and its gradient asked for): d edge_key is the gradient of both roles, written in
    one buffer, and d edge_value is None. ``cached``: see :func:`graph_csr`; ``softcap`` 0:
    no cap."""
    if value_is_key:
        need_dedge_key, need_dedge_value = True, False
    n_dst, (n_src, heads, channels) = q.size(0), v.shape
    score_channels = _score_channels(q, score)
    cfg = launch_config(heads, channels, score_channels)
    flags = dict(H=heads, C=channels, CK=score_channels, SCORE=SCORE_KINDS[score],
                 HAS_CAP=softcap > 0, HAS_BIAS=bias is not None, HAS_DROP=dropout_mask is not None,
                 HAS_EK=edge_key is not None, HAS_EV=edge_value is not None,
                 HAS_DALPHA=dalpha is not None)
    ek, ev = _or(edge_key, q), _or(edge_value, v)  # placeholders when absent

    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dbias = torch.empty_like(bias) if need_dbias else None
    # every edge has a target, so the target pass writes every row of these
    dedge_key = torch.empty_like(edge_key) if need_dedge_key else None  # (E, H, C)
    dedge_value = torch.empty_like(edge_value) if need_dedge_value else None  # (E, H, C_v)
    # gatv2: each target's share of d att, added up below (no atomics)
    datt_rows = (torch.empty(n_dst, *att.shape, device=v.device, dtype=torch.float32)
                 if need_datt else None)  # (N_dst, H, C)
    delta = torch.empty(n_dst, heads, device=v.device, dtype=torch.float32)
    _launch_over_rows(
        "backward_target_kernel", csr, cfg, heads,
        (q, k, v, _or(bias, q), _or(att, q), _or(dropout_mask, q), ek, ev, out32, dout, lse,
         _or(dalpha, lse)),
        (dq, _or(dbias, lse), _or(datt_rows, lse), _or(dedge_key, lse),
         _or(dedge_value, lse), delta, scale, negative_slope, softcap),
        NEED_DBIAS=need_dbias, NEED_DATT=need_datt, NEED_DEK=need_dedge_key,
        NEED_DEV=need_dedge_value, EV_IS_EK=value_is_key, **flags)
    if n_src > 0:
        csc = graph_csr(edge_index, by_target=False, num_dst=n_dst, num_src=n_src,
                        cached=cached)
        _launch_over_rows(
            "backward_source_kernel", csc, cfg, heads,
            (q, k, v, _or(bias, q), _or(att, q), _or(dropout_mask, q), ek, ev, dout, lse,
             delta, _or(dalpha, lse)),
            (dk, dv, scale, negative_slope, softcap), **flags)
    datt = datt_rows.sum(dim=0).to(att.dtype) if need_datt else None  # (H, C)
    return dq, dk, dv, datt, dbias, dedge_key, dedge_value


class FusedEdgeAttention(torch.autograd.Function):
    """Eager autograd around the three kernels; see the module docstring for the math. (Under
    ``torch.compile`` the same passes run as the operators ``graphattn::triton_edge_attention``
    and its backward.) Forward returns the fp32 out, alpha, and for backward alone the
    softmax statistics lse and the target CSR; with ``setup_context`` apart from forward, so
    that ``torch.func.grad`` can run it (``edge_attention`` itself takes the reference path
    under torch.func's transforms)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, att: Tensor | None, bias: Tensor | None,
                dropout_mask: Tensor | None, edge_index: Tensor, scale: float,
                negative_slope: float, score: str, need_alpha: bool,
                edge_key: Tensor | None, edge_value: Tensor | None, softcap: float = 0.0,
                sinks: Tensor | None = None,
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        out32, alpha, lse, csr = _forward(q, k, v, att, bias, dropout_mask, edge_index, scale,
                                          negative_slope, score, need_alpha, edge_key,
                                          edge_value, softcap, sinks)
        return out32, alpha, lse, csr.ptr, csr.other, csr.edge_id, csr.order

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        (q, k, v, att, bias, dropout_mask, edge_index, scale, negative_slope, score, need_alpha,
         edge_key, edge_value, *rest) = inputs
        softcap, sinks = (*rest, *(0.0, None)[len(rest):])  # their defaults when not given
        out32, alpha, lse, rowptr, col, eid, order = output
        # the weights, for the sinks' gradient when they get one of their own
        weights = alpha if sinks is not None and need_alpha else None
        ctx.save_for_backward(*saveable(q, k, v, att, bias, dropout_mask, edge_index), out32,
                              lse, rowptr, col, eid, order,
                              *saveable(edge_key, edge_value, sinks), weights)
        ctx.options = (scale, negative_slope, score)
        ctx.softcap = softcap
        ctx.value_is_key = edge_key is not None and edge_value is edge_key
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse, rowptr, col, eid, order)
        if not need_alpha:
            ctx.mark_non_differentiable(alpha)

    @staticmethod
    def backward(ctx, dout: Tensor | None, dalpha: Tensor | None, *_):
        (q, k, v, att, bias, dropout_mask, edge_index, out32, lse, rowptr, col, eid, order,
         edge_key, edge_value, sinks, weights) = ctx.saved_tensors
        # create_graph=True, or a forward-mode dual cotangent (whose tangent the kernels would
        # drop): gradients in plain ops, which autograd can differentiate
        if torch.is_grad_enabled() or plain_ops_only(dout, dalpha):
            scale, negative_slope, score = ctx.options
            needs = [ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 4, 11, 12, 14)]
            dq, dk, dv, datt, dbias, dedge_key, dedge_value, dsinks = reference_grads(
                dout, dalpha, q, k, v, edge_index, scale=scale, bias=bias,
                dropout_mask=mask_tensor(dropout_mask, edge_index.size(1), v.size(1)),
                score=score, negative_slope=negative_slope,
                att=att, edge_key=edge_key, edge_value=edge_value, needs_grad=needs,
                softcap=ctx.softcap or None, sinks=sinks)
            return (dq, dk, dv, datt, dbias, None, None, None, None, None, None, dedge_key,
                    dedge_value, None, dsinks)
        dout = torch.zeros_like(out32) if dout is None else dout.contiguous()
        dalpha = dalpha.contiguous() if dalpha is not None else None
        need_dedge_key = edge_key is not None and ctx.needs_input_grad[11]
        dq, dk, dv, datt, dbias, dedge_key, dedge_value = _backward(
            dout, dalpha, q, k, v, att, bias, dropout_mask, edge_index, out32, lse,
            CSR(rowptr, col, eid, order), *ctx.options,
            need_dbias=bias is not None and ctx.needs_input_grad[4],
            need_datt=att is not None and ctx.needs_input_grad[3], edge_key=edge_key,
            edge_value=edge_value, need_dedge_key=need_dedge_key,
            need_dedge_value=edge_value is not None and ctx.needs_input_grad[12],
            value_is_key=ctx.value_is_key and need_dedge_key, softcap=ctx.softcap)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[14]:
            dsinks = sink_grad(sinks, out32, lse, dout, dalpha, weights, edge_index[1])
        return (dq, dk, dv, datt, dbias, None, None, None, None, None, None, dedge_key,
                dedge_value, None, dsinks)


# The same passes as torch operators, which torch.compile calls as single opaque nodes (with
# their output shapes) instead of tracing into Triton launches. Eager autograd goes through
# FusedEdgeAttention, which keeps the target CSR for backward; the backward operator builds it
# again from edge_index (one sort of E entries). Neither operator uses graph_csr's cache: the
# edge_index inductor hands them may be a reused buffer (see graph_csr). The per-edge terms
# come last, with defaults, so that calls without them keep their form.
@torch.library.custom_op("graphattn::triton_edge_attention", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, att: Tensor | None, bias: Tensor | None,
                dropout_mask: Tensor | None, edge_index: Tensor, scale: float,
                negative_slope: float, score: str, need_alpha: bool,
                edge_key: Tensor | None = None, edge_value: Tensor | None = None,
                softcap: float = 0.0,
                sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """out (fp32), alpha and lse; see :func:`_forward`."""
    return _forward(q, k, v, att, bias, dropout_mask, edge_index, scale, negative_slope, score,
                    need_alpha, edge_key, edge_value, softcap, sinks, cached=False)[:3]


@_forward_op.register_fake
def _forward_fake(q, k, v, att, bias, dropout_mask, edge_index, scale, negative_slope, score,
                  need_alpha, edge_key=None, edge_value=None, softcap=0.0, sinks=None):
    n_dst, heads, channels = q.size(0), v.size(1), v.size(2)
    return (v.new_empty(n_dst, heads, channels, dtype=torch.float32),
            v.new_empty(edge_index.size(1) if need_alpha else 0, heads,
                        dtype=_alpha_dtype(q, k, bias, att, edge_key, sinks)),
            v.new_empty(n_dst, heads, 2, dtype=torch.float32))


@torch.library.custom_op("graphattn::triton_edge_attention_backward", mutates_args=())
def _backward_op(dout: Tensor, dalpha: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                 att: Tensor | None, bias: Tensor | None, dropout_mask: Tensor | None,
                 edge_index: Tensor, out32: Tensor, lse: Tensor, scale: float,
                 negative_slope: float, score: str, need_dbias: bool, need_datt: bool,
                 edge_key: Tensor | None = None, edge_value: Tensor | None = None,
                 need_dedge_key: bool = False, need_dedge_value: bool = False,
                 value_is_key: bool = False, softcap: float = 0.0,
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, d att, d bias, d edge_key and d edge_value (the last four empty when not
    asked for; d edge_value also with ``value_is_key``); see :func:`_backward`."""
    csr = graph_csr(edge_index, by_target=True, num_dst=q.size(0), num_src=v.size(0),
                    cached=False)
    grads = _backward(dout, dalpha, q, k, v, att, bias, dropout_mask, edge_index, out32, lse,
                      csr, scale, negative_slope, score, need_dbias, need_datt,
                      edge_key=edge_key, edge_value=edge_value, need_dedge_key=need_dedge_key,
                      need_dedge_value=need_dedge_value, value_is_key=value_is_key,
                      cached=False, softcap=softcap)
    return tuple(q.new_empty(0) if g is None else g for g in grads)


@_backward_op.register_fake
def _backward_fake(dout, dalpha, q, k, v, att, bias, dropout_mask, edge_index, out32, lse,
                   scale, negative_slope, score, need_dbias, need_datt, edge_key=None,
                   edge_value=None, need_dedge_key=False, need_dedge_value=False,
                   value_is_key=False, softcap=0.0):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(att) if need_datt else q.new_empty(0),
            torch.empty_like(bias) if need_dbias else q.new_empty(0),
            torch.empty_like(edge_key) if need_dedge_key or value_is_key else q.new_empty(0),
            torch.empty_like(edge_value) if need_dedge_value and not value_is_key
            else q.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, att, bias, dropout_mask, edge_index, scale, negative_slope, score, need_alpha,
     edge_key, edge_value, softcap, sinks) = inputs
    out32, alpha, lse = output
    weights = alpha if sinks is not None and need_alpha else None  # for the sinks' gradient
    ctx.save_for_backward(*saveable(q, k, v, att, bias, dropout_mask, edge_index), out32, lse,
                          *saveable(edge_key, edge_value, sinks), weights)
    ctx.options = (scale, negative_slope, score)
    ctx.softcap = softcap
    ctx.value_is_key = edge_key is not None and edge_value is edge_key
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse)
    if not need_alpha:
        ctx.mark_non_differentiable(alpha)


def _op_grads(ctx, dout: Tensor | None, dalpha: Tensor | None, _dlse) -> tuple:
    (q, k, v, att, bias, dropout_mask, edge_index, out32, lse, edge_key, edge_value, sinks,
     weights) = ctx.saved_tensors
    need_dbias = bias is not None and ctx.needs_input_grad[4]
    need_datt = att is not None and ctx.needs_input_grad[3]
    need_dedge_key = edge_key is not None and ctx.needs_input_grad[11]
    need_dedge_value = edge_value is not None and ctx.needs_input_grad[12]
    value_is_key = ctx.value_is_key and need_dedge_key
    dout = torch.zeros_like(out32) if dout is None else dout.contiguous()
    dalpha = dalpha.contiguous() if dalpha is not None else None
    dq, dk, dv, datt, dbias, dedge_key, dedge_value = _backward_op(
        dout, dalpha, q, k, v, att, bias, dropout_mask, edge_index, out32, lse, *ctx.options,
        need_dbias, need_datt, edge_key, edge_value, need_dedge_key, need_dedge_value,
        value_is_key, ctx.softcap)
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[14]:
        dsinks = sink_grad(sinks, out32, lse, dout, dalpha, weights, edge_index[1])
    return (dq, dk, dv, datt if need_datt else None, dbias if need_dbias else None,
            None, None, None, None, None, None, dedge_key if need_dedge_key else None,
            dedge_value if need_dedge_value and not value_is_key else None, None, dsinks)


_forward_op.register_autograd(_op_grads, setup_context=_setup_context)


def _or(tensor: Tensor | None, placeholder: Tensor) -> Tensor:
    """A pointer argument the kernel never reads when its flag is off."""
    return placeholder if tensor is None else tensor


def check_triton_inputs(q: Tensor, k: Tensor, v: Tensor, *, score: str, bias: Tensor | None,
                        att: Tensor | None, edge_key: Tensor | None,
                        edge_value: Tensor | None, sinks: Tensor | None = None) -> None:
    """Raise what :func:`triton_edge_attention` raises for inputs its kernels cannot take (see
    its Raises); also checked where the triton backend gives way to the reference path
    (under ``torch.func``), so that it refuses the same inputs there."""
    if not triton_available():
        raise ImportError(f"backend='triton' needs the optional package triton, which is not "
                          f"installed: {INSTALL_HINT}")
    for name, t in (("q", q), ("k", k), ("v", v), ("bias", bias), ("att", att),
                    ("edge_key", edge_key), ("edge_value", edge_value), ("sinks", sinks)):
        if t is not None and t.dtype not in DTYPES:
            raise TypeError(f"backend='triton' supports float32, float16 and bfloat16 inputs, "
                            f"got {name} of dtype {t.dtype}")
    if q.device.type != "cuda" and not interpret_mode():
        raise ValueError(f"backend='triton' runs on CUDA tensors, got q on {q.device} (on CPU, "
                         f"set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)")
    if edge_key is not None and score == "additive":
        raise ValueError("edge_key needs the dot or gatv2 score, whose keys have channels; "
                         "got score='additive'")


def triton_edge_attention(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *,
                          scale: float, bias: Tensor | None, dropout_mask: Tensor | None,
                          score: str, negative_slope: float, need_alpha: bool,
                          att: Tensor | None = None, edge_key: Tensor | None = None,
                          edge_value: Tensor | None = None, softcap: float | None = None,
                          sinks: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    r"""The ``"triton"`` backend of :func:`~graphattn.functional.edge_attention`: fused kernels.

    Computes exactly what :func:`~graphattn.functional.attention.reference_edge_attention`
    computes,

    .. math::
        \alpha_e = \operatorname{softmax}_{e \to i} s_e, \qquad
        \mathrm{out}_i = \sum_{e = (j \to i)} \alpha_e \, d_e \, (v_j + \mathrm{ev}_e)

    with :math:`s_e = \text{scale} \cdot q_i \cdot (k_j + \mathrm{ek}_e) + b_e` (``"dot"``),
    :math:`\text{scale} \cdot \mathrm{LeakyReLU}(q_i + k_j + b_e)` (``"additive"``) or
    :math:`\text{scale} \cdot a^\top \mathrm{LeakyReLU}(q_i + k_j + \mathrm{ek}_e) + b_e`
    (``"gatv2"``), :math:`d_e` the dropout multiplier and the per-edge terms
    :math:`\mathrm{ek}_e`, :math:`\mathrm{ev}_e` 0 when not given (with ``softcap`` :math:`c`,
    the dot and gatv2 scores before their bias become :math:`c \tanh(s / c)`), with online
    softmax over CSR rows (see the module docstring). Statistics are fp32 whatever the input
    dtype (fp32, fp16, bf16); out has the dtype of ``v``. Gradients flow to q, k, v, bias, att,
    edge_key, edge_value and through the returned alpha; they are deterministic (no atomics). No
    ``[E, H, C]`` tensor is made but the gradients of edge_key and edge_value; one tensor given
    as both terms (``edge_value is edge_key``, TransformerConv's edge features) gets one
    gradient buffer, the sum of both roles. Gradients of gradients (``create_graph=True``) are
    the reference backend's, recomputed with its ``[E, H, C]`` tensors.

    On CUDA the CSR orderings of ``edge_index`` (edges by target for the forward and dq, by
    source for dk and dv) are kept while that tensor lives unmodified (:func:`graph_csr`):
    calls on the same graph sort it once (``edge_attention`` widens int32 ids to int64 per call,
    so only int64 graphs are kept; nor are they kept under ``torch.compile``).
    :func:`clear_csr_cache` frees them.

    Args:
        q (Tensor): ``[N_dst, H, C]`` (``[N_dst, H]`` when additive).
        k (Tensor): ``[N_src, H, C]`` (``[N_src, H]`` when additive).
        v (Tensor): ``[N_src, H, C_v]``; C_v may differ from the C of q and k.
        edge_index (Tensor): ``[2, E]`` int64, checked by the caller.
        scale (float): score multiplier.
        bias (Tensor, optional): ``[E, H]`` added to the scores.
        dropout_mask (Tensor, optional): ``[E, H]`` multiplier on the weights (0 or
            ``1 / (1 - p)``), or, as int64, the parameters ``[3]`` of a mask the kernels draw
            in registers where they use it
            (:func:`~graphattn.functional.dropout.seeded_mask_parameters`; what
            ``edge_attention`` passes), so that no ``[E, H]`` mask is stored or read.
        score (str): ``"dot"``, ``"additive"`` or ``"gatv2"``.
        negative_slope (float): LeakyReLU slope of the additive and gatv2 scores.
        need_alpha (bool): also return :math:`\alpha` (before dropout).
        att (Tensor, optional): ``[H, C]`` attention vector :math:`a` of ``"gatv2"``, checked
            by the caller. (default: ``None``)
        edge_key (Tensor, optional): ``[E, H, C]`` added to the key of each edge, in
            ``edge_index`` order; ``"dot"`` and ``"gatv2"`` only. (default: ``None``)
        edge_value (Tensor, optional): ``[E, H, C_v]`` added to the value of each edge, in
            ``edge_index`` order. (default: ``None``)
        softcap (float, optional): the cap of the dot and gatv2 scores, checked by the caller;
            the block-sparse kernels (:func:`launch_tiles` with ``block_sparse``) take none, and
            give way to the row kernels. (default: ``None``)
        sinks (Tensor, optional): ``[H]``, the score of each head's sink, one more term of
            every row's softmax whose value is 0 (:mod:`graphattn.functional.sinks`), which
            the block-sparse kernels take too. (default: ``None``)

    Shapes:
        - **input:** q ``(N_dst, H, C)``, k ``(N_src, H, C)``, v ``(N_src, H, C_v)``,
          edge_index ``(2, E)``, bias ``(E, H)``, att ``(H, C)``, edge_key ``(E, H, C)``,
          edge_value ``(E, H, C_v)``, sinks ``(H)``
        - **output:** out ``(N_dst, H, C_v)``; alpha ``(E, H)`` or ``None``

    Raises:
        ImportError: triton is not installed.
        TypeError: an input is not fp32, fp16 or bf16.
        ValueError: the tensors are not on a CUDA device and Triton's interpreter is off, or
            edge_key comes with the additive score.
    """
    check_triton_inputs(q, k, v, score=score, bias=bias, att=att, edge_key=edge_key,
                        edge_value=edge_value, sinks=sinks)
    value_is_key = edge_key is not None and edge_value is edge_key
    q, k, v, att, bias, dropout_mask, edge_index, edge_key, edge_value = (
        None if t is None else t.contiguous()
        for t in (q, k, v, att, bias, dropout_mask, edge_index, edge_key, edge_value))
    if value_is_key:  # still one tensor: read once, one gradient buffer for both roles
        edge_value = edge_key
    block = _TILES.get("block_sparse")
    if block is not None and softcap is None and use_blocks(q, k, v, score=score,
                                                            edge_key=edge_key,
                                                            edge_value=edge_value):
        if torch.compiler.is_compiling():
            out32, alpha, _ = _block_forward_op(q, k, v, bias, dropout_mask, edge_index, scale,
                                                block, need_alpha, sinks)
            return out32.to(v.dtype), (alpha if need_alpha else None)
        with_ids = bias is not None or dropout_mask is not None or need_alpha
        layout = graph_blocks(edge_index, q.size(0), v.size(0), block, with_ids)
        if layout is not None:  # None: a repeated edge, or tiles too empty
            if needs_grad(q, k, v, bias, sinks):
                out, alpha, _ = BlockSparseAttention.apply(q, k, v, bias, dropout_mask,
                                                           edge_index, layout, scale,
                                                           need_alpha, sinks)
            else:  # inference: no autograd node, out written once in its dtype
                out, alpha = block_inference(q, k, v, bias, dropout_mask, edge_index, layout,
                                             scale, need_alpha, sinks)
            return out.to(v.dtype), (alpha if need_alpha else None)
    inputs = (q, k, v, att, bias, dropout_mask, edge_index, scale, negative_slope, score,
              need_alpha, edge_key, edge_value, 0.0 if softcap is None else softcap, sinks)
    if torch.compiler.is_compiling():
        out, alpha, _ = _forward_op(*inputs)  # out in fp32, for backward
    elif needs_grad(q, k, v, att, bias, edge_key, edge_value, sinks):
        out, alpha, *_ = apply_function(FusedEdgeAttention, *inputs)  # the same
    else:  # inference: no autograd node to record, and out written once, in its dtype
        out, alpha, *_ = _forward(*inputs, out_dtype=v.dtype)
    return out.to(v.dtype), (alpha if need_alpha else None)
