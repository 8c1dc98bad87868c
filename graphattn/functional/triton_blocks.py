r"""Block-sparse Triton kernels of edge attention, for graphs whose edges gather in dense blocks.

A window, causal or grid graph numbered along its sequence or image, or a graph reordered so
that neighbours get nearby ids, has its edges near the diagonal of the ``[N_dst, N_src]``
adjacency matrix. Cut that matrix into tiles of B x B (B targets by B sources); the tiles that
hold an edge are few, and each is dense enough that computing all of its B^2 scores as one
matrix product (on tensor cores for half inputs and TF32, see **Precision**) costs less than
gathering the keys and values of its edges one by one. These kernels do that, in the
FlashAttention style: for each block of B targets and each head, a program walks the tiles of
its block, computes

.. math::
    S = \text{scale} \; Q_I K_J^\top + B_{IJ}, \qquad S_{ij} = -\infty \text{ off the edges},

and keeps the online softmax of :mod:`graphattn.functional.triton_kernels` per row,
:math:`\mathrm{acc} \mathrel{+}= e^{S - m} V_J`. Backward recomputes the weights from the
saved statistics, ``lse`` ``[N_dst, H, 2]`` as in the CSR kernels: a pass over target blocks
gives dq and d bias,

.. math::
    \mathrm{d}S = A \odot (\mathrm{dO}_I V_J^\top - \delta_I), \qquad
    \mathrm{d}Q_I = \text{scale} \sum_J \mathrm{d}S \, K_J,

and a pass over source blocks (the tiles sorted by source block) gives
:math:`\mathrm{d}V_J = \sum_I A^\top \mathrm{dO}_I` and
:math:`\mathrm{d}K_J = \text{scale} \sum_I \mathrm{d}S^\top Q_I`; each program writes only its
own rows, so the gradients are deterministic.

**The layout** (:class:`BlockLayout`, built by :func:`block_layout` and kept per ``edge_index``
on CUDA, as the CSR orderings are) stores, per tile that holds an edge, one bit per entry (B^2 /
8 bytes) and, when a bias or a dropout mask is given, the edge id of each entry (4 B^2 bytes),
where the bias and the mask are read (or the mask drawn, from a seed: see
:func:`~graphattn.functional.dropout.seeded_mask_parameters`) and the bias's gradient written.
With a fraction f of the tile entries edges (the fill), the bits cost 1 / (8 f) bytes an edge,
against the 8 bytes an edge of a CSR ordering: fewer above f = 1/64. Below that (``MIN_FILL``)
the graph keeps to the CSR kernels: a graph of scattered edges would spend a tile, and B^2
products, on each.

**What runs here:** the ``"dot"`` score, with or without a bias ``[E, H]`` and a dropout mask
``[E, H]``, read or drawn from a seed (which multiplies the weights :math:`A` in the products
with V and in dS, as in the CSR kernels), q, k and v of one dtype (fp32, fp16, bf16), no
per-edge key or value terms, a graph without repeated edges whose tiles are at least
``MIN_FILL`` full. The weights are returned when asked for: the forward kernel writes each
edge's score at its id, and the weights follow from lse. A gradient through them runs the CSR
kernels' backward, which takes it (on the block kernels' out and lse, in the same conventions);
under ``torch.compile`` a call that returns them always does, since the weights' gradient then
comes as zeros when unused. :func:`use_blocks` says whether a call qualifies; what does not runs
on the CSR kernels, as it does without the option. Under ``torch.compile`` the kernels run as
the operators ``graphattn::triton_block_attention`` and its backward, which check the graph
themselves. The block kernels run only inside
:func:`~graphattn.functional.triton_kernels.launch_tiles` with ``block_sparse=B``: whether they
beat the CSR kernels depends on how full the tiles are, and ``benchmarks/gpu.py`` measures both.

**Precision.** Products accumulate in fp32. Half inputs multiply on tensor cores; fp32 inputs
use full fp32 products unless ``torch.backends.cuda.matmul.allow_tf32`` is set, then TF32 on
tensor cores, as torch's own matrix products do. Full fp32 products have no tensor-core
instruction: Triton runs them on the FMA units (compiled for sm_90, B = 64, H = 4, C = 32, the
forward kernel's PTX holds 1028 ``fma.rn.f32`` and no ``wgmma`` in fp32, 12 ``wgmma`` with
TF32), so on fp32 graphs they pay most with TF32 (``benchmarks/gpu.py --tf32``). Half inputs
multiply the weights, rounded to the input dtype, by the values (as FlashAttention does); the
CSR kernels keep those products in fp32, so the two agree to half precision, not bit for bit.

**Non-finite inputs.** A NaN or infinite entry in a row of q, k or v reaches every entry of
the tile's products, edge or not (0 times NaN is NaN), so it spreads to the rows of its tile
that are not its neighbours, as in dense masked attention; the CSR kernels keep it to the edges
it is on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from graphattn._tensor_cache import TensorCache
from graphattn.functional._transforms import plain_ops_only, saveable
from graphattn.functional.dropout import mask_tensor
from graphattn.functional.reference import reference_grads
from graphattn.functional.sinks import sink_grad

# B: a multiple of 32 (bits per word) and of 16 (tensor cores). Compiled for sm_90, tiles of 128
# need more shared memory than an SM has (228 KiB) for fp32 inputs with C >= 32, and spill
# registers in most cases (benchmarks/results/triton_resources_blocks.md before it dropped 128).
BLOCK_SIDES = (32, 64)
# The least fraction of the tiles' entries that must be edges: there the bits of the layout cost
# as much per edge as a CSR ordering's 8 bytes (see the module docstring).
MIN_FILL = 1 / 64


@dataclass(frozen=True)
class BlockLayout:
    """The tiles of a graph's adjacency matrix that hold an edge, B x B each.

    Tiles are numbered by target block, then source block: tile ``t`` is
    ``(row[t], col[t])`` and target block r owns tiles ``ptr[r]:ptr[r + 1]``. Source block c
    owns tiles ``tpair[tptr[c]:tptr[c + 1]]``. ``bits[t, i, j // 32]`` has bit ``j % 32`` set
    when the tile holds the edge from source ``col[t] * B + j`` to target ``row[t] * B + i``;
    ``ids[t, i, j]`` is that edge's column in ``edge_index`` (-1 off the edges), built only
    for calls with a bias or a dropout mask (``None`` otherwise).
    """

    block: int
    ptr: Tensor
    col: Tensor
    row: Tensor
    tptr: Tensor
    tpair: Tensor
    bits: Tensor
    ids: Tensor | None

    @property
    def num_tiles(self) -> int:
        return self.col.numel()

    def fill(self, num_edges: int) -> float:
        """The fraction of tile entries that are edges."""
        return num_edges / max(1, self.num_tiles * self.block**2)


def block_layout(edge_index: Tensor, num_dst: int, num_src: int, block: int,
                 with_ids: bool = False) -> BlockLayout | None:
    """The :class:`BlockLayout` of a graph in tiles of ``block`` x ``block``; ``None`` when an
    edge is repeated (a tile entry holds one edge), when fewer than ``MIN_FILL`` of the tiles'
    entries would be edges, or when there are 2^31 edges or more (their ids, int32 here).
    Reads two numbers back to the host (the number of tiles, and whether an edge repeats).

    Args:
        edge_index (Tensor): ``[2, E]`` int64, sources then targets, checked by the caller.
        num_dst (int): number of targets.
        num_src (int): number of sources.
        block (int): B, one of ``BLOCK_SIDES``.
        with_ids (bool, optional): also build ``ids``, the edge id of each tile entry (for a
            bias or a dropout mask). (default: ``False``)

    Shapes:
        - **output:** ptr ``(ceil(N_dst / B) + 1)``, tptr ``(ceil(N_src / B) + 1)``, col, row
          and tpair ``(P)``, bits ``(P, B, B // 32)``, ids ``(P, B, B)``; int32.
    """
    if block not in BLOCK_SIDES:
        raise ValueError(f"block must be one of {list(BLOCK_SIDES)}, got {block!r}")
    if edge_index.size(1) > 2**31 - 1:  # edge ids past int32, which ids and the kernels hold
        return None
    src, dst = edge_index[0], edge_index[1]
    device = edge_index.device
    pair = dst * num_src + src
    if pair.numel() > 1:
        ordered = torch.sort(pair).values
        if bool((ordered[1:] == ordered[:-1]).any()):
            return None
    row_blocks, col_blocks = -(-num_dst // block), -(-num_src // block)
    tile_key = (dst // block) * col_blocks + src // block  # (E)
    keys, tile_of_edge = torch.unique(tile_key, sorted=True, return_inverse=True)
    row, col = keys // col_blocks, keys % col_blocks  # (P), sorted by row, then col
    ptr = torch.searchsorted(row, torch.arange(row_blocks + 1, device=device))
    col_sorted, tpair = torch.sort(col, stable=True)
    tptr = torch.searchsorted(col_sorted, torch.arange(col_blocks + 1, device=device))
    num_tiles = keys.numel()
    if edge_index.size(1) < MIN_FILL * num_tiles * block**2:
        return None
    i, j = dst % block, src % block
    words = block // 32
    word_at = (tile_of_edge * block + i) * words + j // 32
    bits = torch.zeros(num_tiles * block * words, dtype=torch.int64, device=device)
    bits.index_add_(0, word_at, torch.ones_like(j) << (j % 32))  # edges are distinct: an OR
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)  # the same 32 bits, as int32
    ids = None
    if with_ids:
        ids = torch.full((num_tiles * block * block,), -1, dtype=torch.int32, device=device)
        ids[(tile_of_edge * block + i) * block + j] = torch.arange(
            edge_index.size(1), dtype=torch.int32, device=device)
        ids = ids.view(num_tiles, block, block)
    int32 = torch.int32
    return BlockLayout(block=block, ptr=ptr.to(int32), col=col.to(int32), row=row.to(int32),
                       tptr=tptr.to(int32), tpair=tpair.to(int32),
                       bits=bits.to(int32).view(num_tiles, block, words), ids=ids)


# The layouts of recently used graphs, by edge_index tensor, as graph_csr keeps the CSR.
_LAYOUT_CACHE: TensorCache[BlockLayout | None] = TensorCache(max_entries=8)


def graph_blocks(edge_index: Tensor, num_dst: int, num_src: int, block: int,
                 with_ids: bool) -> BlockLayout | None:
    """:func:`block_layout`, kept on CUDA while ``edge_index`` lives unmodified (see
    :func:`~graphattn.functional.triton_kernels.graph_csr`)."""
    return _LAYOUT_CACHE.get(edge_index, (num_dst, num_src, block, with_ids),
                             lambda: block_layout(edge_index, num_dst, num_src, block,
                                                  with_ids))


def use_blocks(q: Tensor, k: Tensor, v: Tensor, *, score: str, edge_key: Tensor | None,
               edge_value: Tensor | None) -> bool:
    """Whether a call of the triton backend can run on the block-sparse kernels (the graph
    aside: see :func:`block_layout`); see the module docstring."""
    return (score == "dot" and edge_key is None and edge_value is None
            and q.dtype == k.dtype == v.dtype)


def _precision(q: Tensor) -> str:
    """The products' input precision: TF32 for fp32 inputs only where torch allows it."""
    tf32 = q.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "ieee"


def _channel_tile(channels: int) -> int:
    """Channels padded to a power of 2, at least 16 (the smallest tensor-core operand)."""
    return max(16, 1 << max(0, channels - 1).bit_length())


def _warps(dtype: torch.dtype, precision: str, seeded_dropout: bool = False) -> int:
    """Warps of a program, unless ``launch_tiles(num_warps=...)`` sets them: 4 when the
    products run on tensor cores (half inputs, TF32), 8 for full fp32 products, which run as
    FMAs on registers. Compiled for sm_90 with 4 heads of 32 channels in tiles of 32, the
    source pass then needs 69 registers a thread, no spill, against 254 on 4 warps
    (``python benchmarks/triton_resources.py --blocks``). 8 too for a seeded dropout mask
    (drawn in registers, a 64-bit hash per entry of a tile): with bf16 tiles of 64 x 64 the
    source pass needs 255 registers and spills 44 bytes a thread on 4 warps, 254 and no spill
    on 8 (compiled as ``benchmarks/triton_resources.py --blocks`` compiles them)."""
    from graphattn.functional import triton_kernels

    open_tiles = triton_kernels._TILES  # one snapshot: launch_tiles replaces it whole
    if "num_warps" in open_tiles:
        return open_tiles["num_warps"]
    return 8 if (dtype == torch.float32 and precision == "ieee") or seeded_dropout else 4


def _launch_options(q: Tensor, v: Tensor, layout: BlockLayout, bias: Tensor | None,
                    dropout_mask: Tensor | None) -> dict:
    heads, channels, value_channels = q.size(1), q.size(2), v.size(2)
    precision = _precision(q)
    return dict(H=heads, C=channels, CV=value_channels, HAS_BIAS=bias is not None,
                HAS_DROP=dropout_mask is not None,
                BLOCK=layout.block, BLOCK_C=_channel_tile(channels),
                BLOCK_CV=_channel_tile(value_channels), PRECISION=precision,
                num_warps=_warps(q.dtype, precision, dropout_mask is not None
                                 and dropout_mask.dtype == torch.int64))


def block_forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                  dropout_mask: Tensor | None, layout: BlockLayout, scale: float,
                  num_scores: int | None = None, out_dtype: torch.dtype = torch.float32,
                  sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Launch the forward kernel on contiguous inputs: out ``[N_dst, H, C_v]`` in
    ``out_dtype`` (fp32, which backward needs, unless told otherwise) and lse
    ``[N_dst, H, 2]`` in fp32, and with ``num_scores`` = E the scores ``[E, H]`` (fp32, in
    ``edge_index`` order; the layout must have ids), else ``None``; ``sinks`` ``[H]``: see
    :mod:`graphattn.functional.sinks`."""
    from graphattn.functional.triton_kernels import kernels, on_device_of

    n_dst, n_src, heads = q.size(0), k.size(0), q.size(1)
    out = torch.empty(n_dst, heads, v.size(2), device=v.device, dtype=out_dtype)
    lse = torch.empty(n_dst, heads, 2, device=v.device, dtype=torch.float32)
    scores = (None if num_scores is None else
              torch.empty(num_scores, heads, device=v.device, dtype=torch.float32))
    if n_dst == 0 or heads == 0:
        return out, lse, scores
    with on_device_of(q):
        kernels().block_forward_kernel[((layout.ptr.numel() - 1) * heads,)](
            q, k, v, q if bias is None else bias, q if dropout_mask is None else dropout_mask,
            layout.ptr, layout.col, layout.bits,
            layout.col if layout.ids is None else layout.ids, out, lse,
            lse if scores is None else scores, n_dst, n_src, scale,
            lse if sinks is None else sinks.float().contiguous(),
            NEED_SCORES=scores is not None, HAS_SINKS=sinks is not None,
            **_launch_options(q, v, layout, bias, dropout_mask))
    return out, lse, scores


def block_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                   dropout_mask: Tensor | None, layout: BlockLayout, out32: Tensor,
                   lse: Tensor, scale: float,
                   need_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Launch the two backward kernels: dq, dk, dv and d bias (when ``need_dbias``)."""
    from graphattn.functional.triton_kernels import kernels, on_device_of

    n_dst, n_src, heads = q.size(0), k.size(0), q.size(1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dbias = torch.empty_like(bias) if need_dbias else None  # every edge is in one tile
    if heads == 0:
        return dq, dk, dv, dbias
    delta = (dout.float() * out32).sum(-1).contiguous()  # (N_dst, H)
    options = _launch_options(q, v, layout, bias, dropout_mask)
    ids = layout.col if layout.ids is None else layout.ids
    per_edge = (q if bias is None else bias, q if dropout_mask is None else dropout_mask)
    module = kernels()
    with on_device_of(q):
        if n_dst > 0:
            module.block_backward_target_kernel[((layout.ptr.numel() - 1) * heads,)](
                q, k, v, *per_edge, layout.ptr, layout.col, layout.bits, ids, dout, lse,
                delta, dq, lse if dbias is None else dbias, n_dst, n_src, scale,
                NEED_DBIAS=need_dbias, **options)
        if n_src > 0:
            module.block_backward_source_kernel[((layout.tptr.numel() - 1) * heads,)](
                q, k, v, *per_edge, layout.tptr, layout.tpair, layout.row, layout.bits,
                ids, dout, lse, delta, dk, dv, n_dst, n_src, scale, **options)
    return dq, dk, dv, dbias


def _alpha(q: Tensor, k: Tensor, bias: Tensor | None, scores: Tensor | None, lse: Tensor,
           edge_index: Tensor, sinks: Tensor | None = None) -> Tensor:
    """The weights ``[E, H]`` from the forward kernel's scores (``[0, H]`` without), in the
    dtype of the reference's scores."""
    from graphattn.functional.triton_kernels import _alpha_dtype, weights_from_scores

    return weights_from_scores(scores, lse, edge_index,
                               _alpha_dtype(q, k, bias, None, None, sinks))


def block_inference(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                    dropout_mask: Tensor | None, edge_index: Tensor, layout: BlockLayout,
                    scale: float, need_alpha: bool,
                    sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """What :class:`BlockSparseAttention` computes when nothing needs a gradient, without it:
    out in the dtype of v, written once by the kernel, and the weights (``[0, H]`` unless
    ``need_alpha``)."""
    out, lse, scores = block_forward(q, k, v, bias, dropout_mask, layout, scale,
                                     edge_index.size(1) if need_alpha else None,
                                     out_dtype=v.dtype, sinks=sinks)
    return out, _alpha(q, k, bias, scores, lse, edge_index, sinks)


def _reference_grads(dout: Tensor | None, dalpha: Tensor | None, q: Tensor, k: Tensor,
                     v: Tensor, bias: Tensor | None, dropout_mask: Tensor | None,
                     edge_index: Tensor, scale: float, needs: tuple[bool, ...],
                     sinks: Tensor | None = None) -> tuple:
    """dq, dk, dv, d bias and d sinks in plain torch ops (``needs``: whether each is
    wanted)."""
    dq, dk, dv, _, dbias, _, _, dsinks = reference_grads(
        dout, dalpha, q, k, v, edge_index, scale=scale, bias=bias,
        dropout_mask=mask_tensor(dropout_mask, edge_index.size(1), v.size(1)), score="dot",
        negative_slope=0.2, att=None, edge_key=None, edge_value=None,
        needs_grad=[*needs[:3], False, needs[3], False, False, needs[4]], sinks=sinks)
    return dq, dk, dv, dbias, dsinks


class BlockSparseAttention(torch.autograd.Function):
    """Eager autograd around the block-sparse kernels. Forward returns the fp32 out, the
    weights (``[0, H]`` unless ``need_alpha``) and, for backward alone, lse. Backward runs the
    block kernels when only out gets a gradient, the CSR kernels when the weights get one
    too; gradients of gradients (``create_graph=True``) are the reference backend's, as in
    :class:`~graphattn.functional.triton_kernels.FusedEdgeAttention`."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                dropout_mask: Tensor | None, edge_index: Tensor, layout: BlockLayout,
                scale: float, need_alpha: bool,
                sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        out32, lse, scores = block_forward(q, k, v, bias, dropout_mask, layout, scale,
                                           edge_index.size(1) if need_alpha else None,
                                           sinks=sinks)
        alpha = _alpha(q, k, bias, scores, lse, edge_index, sinks)
        weights = alpha if sinks is not None and need_alpha else None  # for d sinks
        ctx.save_for_backward(*saveable(q, k, v, bias, dropout_mask, edge_index), out32, lse,
                              *saveable(sinks), weights)
        ctx.layout, ctx.scale = layout, scale
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse)
        if not need_alpha:
            ctx.mark_non_differentiable(alpha)
        return out32, alpha, lse

    @staticmethod
    def backward(ctx, dout: Tensor | None, dalpha: Tensor | None, _dlse):
        q, k, v, bias, dropout_mask, edge_index, out32, lse, sinks, weights = ctx.saved_tensors
        none = (None,) * 5  # dropout_mask, edge_index, layout, scale, need_alpha
        if dout is None and dalpha is None:
            return (None,) * 4 + none + (None,)
        if torch.is_grad_enabled() or plain_ops_only(dout, dalpha):
            dq, dk, dv, dbias, dsinks = _reference_grads(
                dout, dalpha, q, k, v, bias, dropout_mask, edge_index, ctx.scale,
                (*ctx.needs_input_grad[:4], ctx.needs_input_grad[9]), sinks)
            return dq, dk, dv, dbias, *none, dsinks
        need_dbias = bias is not None and ctx.needs_input_grad[3]
        dout = torch.zeros_like(out32) if dout is None else dout.contiguous()
        if dalpha is not None:
            grads = _csr_backward(dout, dalpha, q, k, v, bias, dropout_mask, edge_index, out32,
                                  lse, ctx.scale, need_dbias, cached=True)
        else:
            grads = block_backward(dout, q, k, v, bias, dropout_mask, ctx.layout, out32, lse,
                                   ctx.scale, need_dbias=need_dbias)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[9]:
            dsinks = sink_grad(sinks, out32, lse, dout, dalpha, weights, edge_index[1])
        return (*grads, *none, dsinks)


def _csr_backward(dout: Tensor | None, dalpha: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                  bias: Tensor | None, dropout_mask: Tensor | None, edge_index: Tensor,
                  out32: Tensor, lse: Tensor, scale: float, need_dbias: bool,
                  cached: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """dq, dk, dv and d bias on the CSR kernels, which take a gradient through the weights
    (``dalpha``) too: out and lse of the block kernels are in their conventions."""
    from graphattn.functional.triton_kernels import _backward, graph_csr

    csr = graph_csr(edge_index, by_target=True, num_dst=q.size(0), num_src=v.size(0),
                    cached=cached)
    dout = torch.zeros_like(out32) if dout is None else dout.contiguous()
    dq, dk, dv, _, dbias, _, _ = _backward(
        dout, None if dalpha is None else dalpha.contiguous(), q, k, v, None, bias,
        dropout_mask, edge_index, out32, lse, csr, scale, 0.2, "dot", need_dbias, False,
        cached=cached)
    return dq, dk, dv, dbias


# Under torch.compile the block kernels run as two operators, which torch.compile calls as
# opaque nodes with their output shapes (as it calls the CSR kernels' operators). Whether the
# graph suits the tiles (no repeated edge, tiles full enough) is known only from edge_index's
# values, so each operator builds the layout itself and, when the graph does not suit, runs the
# CSR kernels instead: both kinds write out and lse in the same conventions, and both
# operators decide alike from the same edge_index. The layout is built anew in each (one sort
# of E entries), never cached: the edge_index inductor hands them may be a reused buffer.
def _op_layout(edge_index: Tensor, q: Tensor, v: Tensor, bias: Tensor | None,
               dropout_mask: Tensor | None, need_alpha: bool, block: int) -> BlockLayout | None:
    return block_layout(edge_index, q.size(0), v.size(0), block,
                        with_ids=bias is not None or dropout_mask is not None or need_alpha)


@torch.library.custom_op("graphattn::triton_block_attention", mutates_args=())
def _block_forward_op(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None,
                      dropout_mask: Tensor | None, edge_index: Tensor, scale: float,
                      block: int, need_alpha: bool,
                      sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """out (fp32), the weights (``[0, H]`` unless ``need_alpha``) and lse on the block kernels
    in tiles of ``block``, or on the CSR kernels when the graph does not suit them; see
    :func:`block_forward`."""
    layout = _op_layout(edge_index, q, v, bias, dropout_mask, need_alpha, block)
    if layout is not None:
        out32, lse, scores = block_forward(q, k, v, bias, dropout_mask, layout, scale,
                                           edge_index.size(1) if need_alpha else None,
                                           sinks=sinks)
        return out32, _alpha(q, k, bias, scores, lse, edge_index, sinks), lse
    from graphattn.functional.triton_kernels import _forward

    # the dot score: no att; the slope is unused
    out32, alpha, lse, _ = _forward(q, k, v, None, bias, dropout_mask, edge_index, scale, 0.2,
                                    "dot", need_alpha, sinks=sinks, cached=False)
    return out32, alpha, lse


@_block_forward_op.register_fake
def _block_forward_fake(q, k, v, bias, dropout_mask, edge_index, scale, block, need_alpha,
                        sinks=None):
    from graphattn.functional.triton_kernels import _alpha_dtype

    n_dst, heads = q.size(0), v.size(1)
    return (v.new_empty(n_dst, heads, v.size(2), dtype=torch.float32),
            v.new_empty(edge_index.size(1) if need_alpha else 0, heads,
                        dtype=_alpha_dtype(q, k, bias, None, None, sinks)),
            v.new_empty(n_dst, heads, 2, dtype=torch.float32))


@torch.library.custom_op("graphattn::triton_block_attention_backward", mutates_args=())
def _block_backward_op(dout: Tensor, dalpha: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                       bias: Tensor | None, dropout_mask: Tensor | None, edge_index: Tensor,
                       out32: Tensor, lse: Tensor, scale: float, block: int,
                       need_dbias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv and d bias (empty unless ``need_dbias``): on the block kernels when
    :func:`_block_forward_op` ran on them and no gradient reaches the weights (``dalpha``),
    else on the CSR kernels; see :func:`block_backward`."""
    layout = None if dalpha is not None else _op_layout(edge_index, q, v, bias, dropout_mask,
                                                        False, block)
    if layout is not None:
        dq, dk, dv, dbias = block_backward(dout, q, k, v, bias, dropout_mask, layout, out32,
                                           lse, scale, need_dbias)
    else:
        dq, dk, dv, dbias = _csr_backward(dout, dalpha, q, k, v, bias, dropout_mask,
                                          edge_index, out32, lse, scale, need_dbias,
                                          cached=False)
    return dq, dk, dv, q.new_empty(0) if dbias is None else dbias


@_block_backward_op.register_fake
def _block_backward_fake(dout, dalpha, q, k, v, bias, dropout_mask, edge_index, out32, lse,
                         scale, block, need_dbias):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(bias) if need_dbias else q.new_empty(0))


def _block_setup_context(ctx, inputs, output) -> None:
    q, k, v, bias, dropout_mask, edge_index, scale, block, need_alpha, sinks = inputs
    out32, alpha, lse = output
    weights = alpha if sinks is not None and need_alpha else None  # for d sinks
    ctx.save_for_backward(*saveable(q, k, v, bias, dropout_mask, edge_index), out32, lse,
                          *saveable(sinks), weights)
    ctx.options = (scale, block)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(lse)
    if not need_alpha:
        ctx.mark_non_differentiable(alpha)


def _block_op_grads(ctx, dout: Tensor | None, dalpha: Tensor | None, _dlse) -> tuple:
    q, k, v, bias, dropout_mask, edge_index, out32, lse, sinks, weights = ctx.saved_tensors
    if dout is None and dalpha is None:
        return (None,) * 10
    need_dbias = bias is not None and ctx.needs_input_grad[3]
    dout = torch.zeros_like(out32) if dout is None else dout.contiguous()
    dalpha = None if dalpha is None else dalpha.contiguous()
    dq, dk, dv, dbias = _block_backward_op(dout, dalpha, q, k, v, bias, dropout_mask,
                                           edge_index, out32, lse, *ctx.options, need_dbias)
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[9]:
        dsinks = sink_grad(sinks, out32, lse, dout, dalpha, weights, edge_index[1])
    return dq, dk, dv, dbias if need_dbias else None, None, None, None, None, None, dsinks


_block_forward_op.register_autograd(_block_op_grads, setup_context=_block_setup_context)
