r"""The CPU backend of edge attention: fused numba kernels over edges sorted by target.

The reference backend gathers ``q_i``, ``k_j`` and ``v_j`` per edge and autograd keeps those
``[E, H, C]`` tensors for backward. Here each target's in-edges are walked in turn to compute the
scores, their softmax and the weighted sum of the values, without any per-edge ``[E, H, C]`` tensor.
For backward only the log-sum-exp of each target and head, in two parts ``[N_dst, H, 2]`` (the
largest score :math:`M_i` and :math:`\log \ell_i = \log \sum_j e^{s_{ij} - M_i}`, whose sum would
lose :math:`\log \ell_i` to rounding when :math:`|M_i|` is large, as with a bias of -1e9 on every
in-edge), and the target-sorted edge order (CSR) are kept; the scores are recomputed:

.. math::
    \alpha_{ij} = \exp\big((s_{ij} - M_i) - \log \ell_i\big), \qquad
    \frac{\partial L}{\partial s_{ij}} = \alpha_{ij}\Big(m_{ij}\, g_i \cdot v_j
        + \bar\alpha_{ij} - D_i\Big), \qquad
    D_i = g_i \cdot \mathrm{out}_i + \sum_j \alpha_{ij} \bar\alpha_{ij}

with ``g = dL/d out``, ``m`` the dropout multiplier and :math:`\bar\alpha` the gradient reaching
the returned attention weights. ``dq`` (and the bias gradient) is summed per target in CSR order,
``dk`` and ``dv`` per source in source-sorted (CSC) order: every output row is written by one
thread in a fixed order, so results are the same bit for bit on every run and for any number of
threads, with no atomics.

Per-edge key and value terms (``edge_key``, ``edge_value`` ``[E, H, C]``, for edge features as
PyG's ``TransformerConv`` and ``GATv2Conv`` use them) are read at each edge's id and added to
``k_j`` and ``v_j`` where those are read; the target pass of backward writes their gradients,
one row per edge, and for gatv2 the source pass reads the key term again for ``dk``.

Forward takes two passes over each target's in-edges: the scores and their maximum per head,
then the exponentials and the weighted sum of the values. Unlike a running (online) maximum this
has no data-dependent branch per edge and head, and the weighted sum runs over all ``H * C``
channels of a row at once, which the compiler vectorises. The target pass of backward writes
each edge's two factors of ``dk`` and ``dv`` (``[E, H]`` each) at the edge's CSC position, with
the cache lines fetched ahead for writing, so that the source pass reads them in order.

In float32 the exponentials are inlined arithmetic (the Cephes ``expf``, within 1 ulp) instead
of a call into libm per edge and head; both the forward and the target pass of backward first
take the scores of all of a target's in-edges, then their exponentials in one loop over the
``[degree, H]`` block as a flat array, which vectorises whatever the number of heads (a loop
over the heads alone runs scalar when H is below the vector width: 1.1-1.4x slower at H = 4).
Dot products and gatv2's ``att . LeakyReLU(q_i + k_j)`` of 8 channels or more are summed in 8
partial sums held in one vector, always in the same order (``_dot``, ``_gatv2_dot``).

On graphs larger than the cache the kernels are bound by gathering rows of ``k, v`` (forward) and
``q, dL/d out`` (backward) at random node ids; they prefetch the rows a few edges ahead. Each
kernel is compiled once per combination of its flags (score, bias, edge terms) and channel
counts: these are constants of the compiled kernel, so numba drops the flags' branches from the
inner loops and unrolls the channel loops. The dropout mask and the attention weights (written
in forward, their gradient read in backward) are switches read at run time instead: one branch
per edge and head, always taken the same way, which costs nothing measurable, and training,
evaluation and ``return_attention`` share one compiled kernel.
Channel counts in ``SPECIALISED_CHANNELS`` (powers of two up to 128) are compiled as constants;
others are read at run time by one shared variant. One head (``SPECIALISED_HEADS``; the layers'
default, and GAT's output layer) is compiled as a constant too: the loops over the heads, which
run once per edge, then vanish (a one-head call on Cora or CiteSeer takes 0.75-0.93x the time
with the head count read at run time, ``benchmarks/cpu_one_head.py``). With
``SPECIALISED_FLAGS`` off the score and the flags are read at run time too. With all three off
(``GRAPHATTN_CPU_SPECIALISE=0`` in the environment before import) one variant per dtype (and
type of dropout mask and of node ids) serves every call: the test suite runs that way, and
compares the constant variants with it bit for bit. Every variant is cached on disk.

No reference count is taken in the kernels' loops. numba counts references to an array (atomic
adds, through calls that LLVM cannot see into) where an inlined function takes it as an
argument, and drops the pairs only where no branch it cannot resolve lies between them. So the
functions called per edge take no array that they read only under a flag known at run time:
``_target_scores`` reads the bias and picks the score itself. (Before, the variant that reads
its flags at run time took two counts per array, edge and head, and ran several times slower.)

Under ``torch.compile`` forward and backward run as torch operators
(``graphattn::cpu_edge_attention`` and ``graphattn::cpu_edge_attention_backward``) with their
output shapes, which the compiled graph calls as they are instead of tracing into numba.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch
import torch.nn.functional as F
from llvmlite import ir
from numba import types
from numba.core import cgutils, ir_utils
from numba.core.compiler_lock import global_compiler_lock
from numba.core.errors import TypingError
from numba.extending import intrinsic, overload
from torch import Tensor

from graphattn.functional._transforms import apply_function, needs_grad, plain_ops_only, saveable
from graphattn.functional.reference import reference_edge_attention, reference_grads
from graphattn.functional.sinks import sink_grad

CHUNKS_PER_THREAD = 4  # the rows are split into this many chunks of equal work per thread
MIN_PARALLEL_WORK = 2**15  # rows + edges below which one thread does all
# dropout mask entries below which one thread draws all (two threads broke even at 2^20 in an
# ad-hoc timing: a fresh mask is bound by writing its memory)
MIN_PARALLEL_MASK = 2**20
PREFETCH_DISTANCE = 4  # edges ahead whose rows are prefetched
# Edges a row's sums run over in the inputs' dtype before they are added into float64 sums: a
# row of n edges then rounds like one of SUM_BLOCK edges plus n / SUM_BLOCK float64 adds, where
# one running float32 sum over 10^6 edges was off by 1e-5 (its error grows with n). Rows of at
# most SUM_BLOCK edges never touch the float64 sums.
SUM_BLOCK = 128
CACHE_LINE = 64  # bytes


def _jit(inline: str = "never", error_model: str = "python", reassociate: bool = False):
    """``numba.njit`` with an on-disk cache, or without one when no cache directory is writable.

    numba caches next to this file, else in the user's cache directory; when neither can be
    written (a read-only install and no writable home) the kernels compile in each process.
    ``error_model="numpy"``: a division by zero gives inf or NaN instead of raising, so that
    a loop that divides has no branch out of it and can vectorise. ``reassociate``: LLVM may
    reorder float sums (and fuse multiply-adds), so that a dot product vectorises; NaN and
    inf keep their meaning.
    """
    options = dict(nogil=True, inline=inline, error_model=error_model,
                   fastmath={"reassoc", "contract"} if reassociate else False)

    def wrap(fn):
        try:
            return numba.njit(cache=True, **options)(fn)
        except RuntimeError:
            return numba.njit(**options)(fn)
    return wrap


@intrinsic
def _prefetch(typingctx, array, row, offset, write):
    """Hint the CPU to fetch the cache line at byte ``offset`` of ``array[row]``.

    ``write`` must be a literal: 0 to fetch for reading, 1 for writing.
    """
    if not isinstance(write, types.IntegerLiteral):
        return None
    access = write.literal_value

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        row_stride = cgutils.unpack_tuple(builder, ary.strides)[0]
        base = builder.ptrtoint(ary.data, ir.IntType(64))
        address = builder.add(base, builder.add(builder.mul(args[1], row_stride), args[2]))
        i8_ptr, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8_ptr, i32, i32, i32]),
            "llvm.prefetch.p0i8")
        # (address, read 0 / write 1, high temporal locality 3, data cache 1)
        builder.call(prefetch, [builder.inttoptr(address, i8_ptr), i32(access), i32(3), i32(1)])
        return context.get_dummy_value()
    return types.void(array, types.int64, types.int64, write), codegen


@_jit(inline="always")
def _prefetch_row(array, row):
    for offset in range(0, array.strides[0], CACHE_LINE):
        _prefetch(array, row, offset, 0)


@_jit(inline="always")
def _prefetch_row_for_write(array, row):
    for offset in range(0, array.strides[0], CACHE_LINE):
        _prefetch(array, row, offset, 1)


@_jit()
def _csr(src, dst, num_dst):
    """Stable counting sort of the edges by target: ``rowptr [N_dst+1]``, ``perm``, sources.

    The index arrays have the integer type of ``src`` and ``dst``.
    """
    num_edges = dst.shape[0]
    rowptr = np.zeros(num_dst + 1, dtype=dst.dtype)
    for e in range(num_edges):
        rowptr[dst[e] + 1] += 1
    for i in range(num_dst):
        rowptr[i + 1] += rowptr[i]
    cursor = rowptr[:-1].copy()
    perm = np.empty(num_edges, dtype=dst.dtype)  # CSR position -> edge id
    src_sorted = np.empty(num_edges, dtype=dst.dtype)
    for e in range(num_edges):
        p = cursor[dst[e]]
        cursor[dst[e]] += 1
        perm[p] = e
        src_sorted[p] = src[e]
    return rowptr, perm, src_sorted


@_jit()
def _csc(rowptr, src_sorted, num_src):
    """Transpose of the CSR: ``colptr [N_src+1]``, each CSR entry's CSC position, the targets."""
    num_dst = rowptr.shape[0] - 1
    num_edges = src_sorted.shape[0]
    colptr = np.zeros(num_src + 1, dtype=rowptr.dtype)
    for p in range(num_edges):
        colptr[src_sorted[p] + 1] += 1
    for j in range(num_src):
        colptr[j + 1] += colptr[j]
    cursor = colptr[:-1].copy()
    csc_position = np.empty(num_edges, dtype=rowptr.dtype)  # CSR position -> CSC position
    target = np.empty(num_edges, dtype=rowptr.dtype)  # CSC position -> target
    for i in range(num_dst):
        for p in range(rowptr[i], rowptr[i + 1]):
            t = cursor[src_sorted[p]]
            cursor[src_sorted[p]] += 1
            csc_position[p] = t
            target[t] = i
    return colptr, csc_position, target


@_jit()
def _block_starts(src, dst, num_nodes):
    """The finest split of the nodes ``0 .. N-1`` into ranges that no edge crosses: the first
    node of each range, then N. One pass over the edges takes, for each node, the furthest
    node an edge joins it to at or after itself; one pass over the nodes then closes a range
    where no node so far reaches beyond."""
    reach = np.arange(num_nodes)
    for e in range(src.shape[0]):
        a, b = src[e], dst[e]
        if a > b:
            a, b = b, a
        if b > reach[a]:
            reach[a] = b
    starts = np.empty(num_nodes + 1, dtype=np.int64)
    starts[0] = 0
    count, furthest = 1, -1
    for i in range(num_nodes):
        furthest = max(furthest, reach[i])
        if furthest == i:  # no edge from nodes 0..i reaches past i
            starts[count] = i + 1
            count += 1
    return starts[:count]


def block_starts(edge_index: Tensor, num_nodes: int) -> Tensor:
    """Where the graph splits into diagonal blocks: ``[B + 1]`` int64, the first node of each
    of the B ranges of consecutive nodes that no edge crosses (finest split; a node that no
    edge joins to another is a range of its own), then ``num_nodes``. One pass over the edges
    (about 1 ns each). ``edge_index`` ``[2, E]`` is a CPU tensor of ids below ``num_nodes``."""
    if num_nodes == 0:
        return torch.zeros(1, dtype=torch.int64)
    ids = edge_index.detach()
    return torch.from_numpy(_block_starts(ids[0].numpy(), ids[1].numpy(), num_nodes))


@_jit()
def _block_pairs(src, dst, num_src, first_source, row, pair, want_pair, mask, upper, first,
                 last):
    """Edges ``first .. last - 1`` of a graph of diagonal blocks (see :func:`block_pairs`):
    each one's pair index (when ``want_pair``), its entry of the mask, and ``upper[0] = 1``
    when a source comes after its target within the block (every writer writes 1). For each
    target, ``first_source`` holds the first source of its block and ``row`` its row in the
    block (two reads of small tables, where a division per edge took twice the time)."""
    found = False
    for e in range(first, last):
        i = dst[e]
        j = np.int64(src[e]) - first_source[i]  # the source within its block
        p = np.int64(i) * num_src + j
        if want_pair:
            pair[e] = p
        mask[p] = True
        found |= j > row[i]
    if found:
        upper[0] = 1


@_jit()
def _pair_order(src, dst):
    """See :func:`pair_order`: stops at the first edge that fits neither run."""
    num_edges = src.shape[0]
    lower, loops = True, False  # over the first run
    e = 0
    while e < num_edges:
        if e > 0 and (dst[e] < dst[e - 1] or (dst[e] == dst[e - 1] and src[e] <= src[e - 1])):
            break
        lower &= src[e] <= dst[e]
        loops |= src[e] == dst[e]
        e += 1
    if e == num_edges:
        return True, lower, True
    if loops:
        return False, False, False
    for f in range(e, num_edges):  # the rest: self-loops, in increasing order
        if src[f] != dst[f] or (f > e and dst[f] <= dst[f - 1]):
            return False, False, False
    return True, lower, False


def pair_order(src: Tensor, dst: Tensor) -> tuple[bool, bool, bool]:
    """What the order of the edges ``src -> dst`` (CPU, ``[E]`` each) tells of their pairs, in
    one streaming pass (about 0.5 ms per million edges, where :func:`block_pairs` writes a mask
    entry per edge): ``(distinct, lower, target_major)``.

    ``target_major``: the edges come in strictly increasing ``(dst, src)`` order, the order of
    :func:`graphattn.graphs.complete_graph`, :func:`~graphattn.graphs.causal_graph` and
    :func:`~graphattn.graphs.batch_complete_graph`. ``distinct`` (no pair holds two edges): so
    they do, or they are edges without self-loops in that order followed by self-loops in
    increasing order (what a layer's ``add_self_loops`` makes of such a graph). ``lower``:
    when ``distinct``, whether every source is at most its target. ``False`` where the order
    does not tell."""
    return _pair_order(src.detach().numpy(), dst.detach().numpy())


def block_pairs(src: Tensor, dst: Tensor, blocks: int, num_dst: int, num_src: int, *,
                want_pair: bool = True) -> tuple[Tensor | None, Tensor, int, bool]:
    """What the dense backend needs of a graph of ``blocks`` diagonal blocks of ``num_dst``
    targets and ``num_src`` sources (one block: the whole graph), in one pass over its edges
    ``src -> dst`` (CPU, ``[E]`` each; on torch's threads for large graphs): each edge's flat
    index ``(block, i, j)`` in ``[B, N_dst, N_src]`` (int64 ``[E]``; ``None`` unless
    ``want_pair``, or when the graph repeats a pair), the bool mask ``[B, N_dst, N_src]`` of
    the pairs that hold an edge, the number of such pairs (E when no pair holds two edges), and
    whether every edge's source comes at or before its target within the block
    (``j <= i``)."""
    num_edges = src.numel()
    s, d = src.detach().numpy(), dst.detach().numpy()
    pair = np.empty(num_edges if want_pair else 0, dtype=np.int64)
    mask = torch.zeros(blocks, num_dst, num_src, dtype=torch.bool)
    upper = np.zeros(1, dtype=np.int64)
    target = np.arange(blocks * num_dst, dtype=np.int64)
    block, row = np.divmod(target, num_dst)
    args = (s, d, num_src, block * num_src, row, pair, want_pair, mask.view(-1).numpy(), upper)
    threads = torch.get_num_threads()
    if threads == 1 or num_edges < MIN_PARALLEL_WORK:
        _block_pairs(*args, 0, num_edges)
    else:  # each edge writes its own pair index; mask entries only ever become True
        _run_chunks(_block_pairs, np.linspace(0, num_edges, threads + 1).astype(np.int64),
                    threads, *args)
    distinct = int(mask.count_nonzero())
    if distinct != num_edges and not want_pair:  # a multigraph: its pairs are needed
        pair = np.empty(num_edges, dtype=np.int64)
        _block_pairs(*args[:5], pair, True, *args[7:], 0, num_edges)
    return (torch.from_numpy(pair) if pair.shape[0] == num_edges else None, mask, distinct,
            not upper[0])


@_jit()
def _group_edges(src, dst, node_row, node_group, num_groups):
    """A stable counting sort of the edges by the group of their target, with both ends
    renumbered to their rows in the group (see :func:`group_edges`)."""
    num_edges = src.shape[0]
    ptr = np.zeros(num_groups + 1, dtype=np.int64)
    for e in range(num_edges):
        ptr[node_group[dst[e]] + 1] += 1
    for g in range(num_groups):
        ptr[g + 1] += ptr[g]
    cursor = ptr[:-1].copy()
    perm = np.empty(num_edges, dtype=np.int64)
    src_row = np.empty(num_edges, dtype=np.int64)
    dst_row = np.empty(num_edges, dtype=np.int64)
    has_in = np.zeros(node_row.shape[0], dtype=np.bool_)
    has_out = np.zeros(node_row.shape[0], dtype=np.bool_)
    for e in range(num_edges):
        g = node_group[dst[e]]
        p = cursor[g]
        cursor[g] += 1
        perm[p] = e
        src_row[p] = node_row[src[e]]
        dst_row[p] = node_row[dst[e]]
        has_in[dst[e]] = True
        has_out[src[e]] = True
    return perm, ptr, src_row, dst_row, has_in, has_out


def group_edges(src: Tensor, dst: Tensor, node_row: Tensor, node_group: Tensor,
                num_groups: int) -> tuple[Tensor, ...]:
    """The edges ``src -> dst`` (CPU, ``[E]`` each) grouped by the group ``node_group`` of
    their target (both ends lie in one group), in one pass: the edge ids in group order
    (stable, ``[E]``), where each group's edges start (``[G + 1]``), both ends of each edge in
    that order renumbered to their ``node_row`` (``[E]`` each, int64), and which nodes have
    an in-edge and an out-edge (bool ``[N]`` each)."""
    out = _group_edges(src.detach().numpy(), dst.detach().numpy(), node_row.numpy(),
                       node_group.numpy(), num_groups)
    return tuple(torch.from_numpy(a) for a in out)


@_jit()
def _batch_complete_edges(batch, members, first, sizes, self_loops):
    """The edges of :func:`batch_complete_edges`, target by target."""
    n = batch.shape[0]
    total = 0
    for i in range(n):
        total += sizes[batch[i]] - (0 if self_loops else 1)
    edges = np.empty((2, total), dtype=np.int64)
    p = 0
    for i in range(n):
        start = first[batch[i]]
        for r in range(sizes[batch[i]]):
            j = members[start + r]
            if self_loops or j != i:
                edges[0, p] = j
                edges[1, p] = i
                p += 1
    return edges


def batch_complete_edges(batch: Tensor, members: Tensor, first: Tensor, sizes: Tensor,
                         self_loops: bool) -> Tensor:
    """The edges ``j -> i`` between the nodes of each graph of ``batch`` (CPU, int64 ``[N]``),
    in one pass that writes them: target by target, each target's sources in the order of
    ``members`` (the nodes sorted by graph; graph g's are ``members[first[g]:first[g] +
    sizes[g]]``). See :func:`graphattn.graphs.batch_complete_graph`."""
    return torch.from_numpy(_batch_complete_edges(batch.numpy(), members.numpy(), first.numpy(),
                                                  sizes.numpy(), self_loops))


def top_k_rows(rowptr: Tensor, scores: Tensor, k: int) -> Tensor:
    """The positions of the edges of each row ``rowptr[i]:rowptr[i + 1]`` of ``scores`` (CPU
    ``[E]`` float32 or float64, the edges grouped by target) that are among its ``k`` highest,
    ties to the first in order, NaN ranked below -inf: ``[sum_i min(deg_i, k)]`` int64, in
    increasing order. Each row is copied to a buffer, its k-th highest selected there
    (after a count by buckets of value, for long rows), then kept by two passes; the rows are
    split among torch's threads. See :func:`graphattn.graphs.top_k_edges`."""
    ptr = rowptr.numpy()
    kept = np.minimum(np.diff(ptr), k)  # (N,) edges each row keeps
    out_ptr = np.zeros(ptr.shape[0], dtype=np.int64)
    np.cumsum(kept, out=out_ptr[1:])
    out = np.empty(out_ptr[-1], dtype=np.int64)
    _run_rows(_top_k_rows, ptr, ptr, scores.detach().numpy(), k, out_ptr, out)
    return torch.from_numpy(out)


@_jit()
def _kth_highest(buf, n, k):
    """The ``k``-th highest of ``buf[:n]`` (no NaN), by a quickselect that reorders ``buf``:
    Hoare partitions around a median of three, which split runs of equal values evenly."""
    lo, hi, target = 0, n - 1, k - 1
    while lo < hi:
        a, b, c = buf[lo], buf[(lo + hi) >> 1], buf[hi]
        pivot = max(min(a, b), min(max(a, b), c))  # the median of the three
        i, j = lo, hi
        while i <= j:  # descending: [lo, j] >= pivot, [i, hi] <= pivot
            while buf[i] > pivot:
                i += 1
            while buf[j] < pivot:
                j -= 1
            if i <= j:
                buf[i], buf[j] = buf[j], buf[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:  # (between the two parts: equal to the pivot)
            return buf[target]
    return buf[target]


# rows at least this long are cut into 2^11 buckets of value first (their float32 bits' top
# 11: sign, exponent, 2 bits of mantissa), and only the k-th's bucket is selected in
_BUCKETED_ROWS = 1024


@_jit(inline="always")
def _bucket(bits):
    """The bucket of a float32 of ``bits`` (uint32), in the order of the values: the top 11
    bits of the bits with the sign bit flipped, and every bit flipped for negatives."""
    flip = (bits >> np.uint32(31)) * np.uint32(0x7FFFFFFF) | np.uint32(0x80000000)
    return (bits ^ flip) >> np.uint32(21)


@_jit()
def _bucketed_kth(buf, rounded, bits, counts, n, k):
    """The ``k``-th highest of ``buf[:n]`` (no NaN): a count of the values of each bucket of
    their float32 roundings (``rounded``, whose ``bits`` are a view of it), then a selection
    among the values of the bucket that holds the k-th alone, moved to the front of ``buf``.
    Rounding keeps the order (a < b gives round(a) <= round(b)), so the buckets above the k-th's
    hold values above every value of its bucket."""
    for t in range(n):
        rounded[t] = buf[t]
    counts[:] = 0
    for t in range(n):
        counts[_bucket(bits[t])] += 1
    b, above = counts.shape[0] - 1, 0  # the highest bucket with k values at or above it
    while above + counts[b] < k:
        above += counts[b]
        b -= 1
    size = 0
    for t in range(n):  # (size <= t: the front of buf is read before it is written)
        if _bucket(bits[t]) == b:
            buf[size] = buf[t]
            size += 1
    return _kth_highest(buf, size, k - above)


@_jit()
def _top_k_rows(ptr, scores, k, out_ptr, out, first, last):
    """See :func:`top_k_rows`; rows ``first`` to ``last - 1``."""
    widest = 0
    for i in range(first, last):
        widest = max(widest, ptr[i + 1] - ptr[i])
    buf = np.empty(widest, dtype=scores.dtype)
    rounded = np.empty(widest if widest >= _BUCKETED_ROWS else 0, dtype=np.float32)
    counts = np.zeros(1 << 11, dtype=np.int32)
    for i in range(first, last):
        start, stop, p = ptr[i], ptr[i + 1], out_ptr[i]
        size = 0  # the row's scores that are not NaN, into buf
        for e in range(start, stop):
            value = scores[e]
            if value == value:
                buf[size] = value
                size += 1
        if size <= k:  # all of them, and the first NaN to fill k
            room = k - size
            for e in range(start, stop):
                value = scores[e]
                if value == value:
                    out[p] = e
                    p += 1
                elif room > 0:
                    out[p] = e
                    p += 1
                    room -= 1
            continue
        if size >= _BUCKETED_ROWS:
            kth = _bucketed_kth(buf, rounded, rounded.view(np.uint32), counts, size, k)
        else:
            kth = _kth_highest(buf, size, k)
        room = k  # how many equal to kth are kept: k less those above it
        for e in range(start, stop):
            if scores[e] > kth:
                room -= 1
        for e in range(start, stop):  # (a NaN compares false)
            value = scores[e]
            if value > kth:
                out[p] = e
                p += 1
            elif value == kth and room > 0:
                out[p] = e
                p += 1
                room -= 1
    return out


def indexer_scores(q: Tensor, k: Tensor, w: Tensor, rowptr: Tensor, src: Tensor) -> Tensor:
    r"""A lightning indexer's score of each edge of a graph grouped by target (CSR ``rowptr``
    ``[N_dst + 1]``, sources ``src`` ``[E]``), :math:`s_e = \sum_h w_{ih}\,
    \mathrm{ReLU}(q_{ih} \cdot k_j)`, from its scaled queries ``q [N_dst, H_I, D]``, keys ``k
    [N_src, D]`` and head weights ``w [N_dst, H_I]`` (CPU, float32 or float64, one dtype):
    ``[E]``, the rows split among torch's threads. Each target's queries stay in cache while
    its edges' keys stream past; nothing of size ``[E, H_I]`` is made. See
    :class:`graphattn.nn.LightningIndexer`."""
    ptr = rowptr.numpy()
    scores = np.empty(src.shape[0], dtype=_np(q).dtype)
    _run_rows(_indexer_scores, ptr, _np(q.contiguous()), _np(k.contiguous()),
              _np(w.contiguous()), ptr, src.numpy(), scores)
    return torch.from_numpy(scores)


@_jit(inline="always", reassociate=True)
def _indexer_score(q, k, w, i, j, zero):
    """The indexer's score of the pair ``j -> i`` (see :func:`indexer_scores`)."""
    total = zero
    for h in range(q.shape[1]):
        dot = zero
        for c in range(q.shape[2]):
            dot += q[i, h, c] * k[j, c]
        total += w[i, h] * max(dot, zero)  # (no branch: the signs come at random)
    return total


@_jit(reassociate=True)
def _indexer_scores(q, k, w, ptr, src, scores, first, last):
    """See :func:`indexer_scores`; targets ``first`` to ``last - 1``."""
    zero = scores.dtype.type(0)
    for i in range(first, last):
        for e in range(ptr[i], ptr[i + 1]):
            scores[e] = _indexer_score(q, k, w, i, src[e], zero)


def indexer_score_grads(grad: Tensor, q: Tensor, k: Tensor, w: Tensor, rowptr: Tensor,
                        src: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""The gradients of :func:`indexer_scores` from ``grad`` ``[E]``, its scores' gradient:
    ``dq [N_dst, H_I, D]``, ``dk [N_src, D]`` and ``dw [N_dst, H_I]``, with
    :math:`\partial s_e / \partial q_{ih} = w_{ih} [q_{ih} \cdot k_j > 0]\, k_j`,
    :math:`\partial s_e / \partial w_{ih} = \mathrm{ReLU}(q_{ih} \cdot k_j)` and
    :math:`\partial s_e / \partial k_j = \sum_h w_{ih} [q_{ih} \cdot k_j > 0]\, q_{ih}`.
    One pass over the targets' rows (the dot products computed again) gives dq and dw and each
    edge's term of dk ``[E, D]``, which are summed by source after it, in edge order: the
    result does not depend on the number of threads."""
    ptr = rowptr.numpy()
    dtype = _np(q).dtype
    dq, dw = np.zeros(q.shape, dtype=dtype), np.zeros(w.shape, dtype=dtype)
    dk_edges = np.empty((src.shape[0], k.shape[1]), dtype=dtype)
    _run_rows(_indexer_score_grads, ptr, _np(grad.contiguous()), _np(q.contiguous()),
              _np(k.contiguous()), _np(w.contiguous()), ptr, src.numpy(), dq, dw, dk_edges)
    dk = torch.zeros(k.shape, dtype=q.dtype).index_add_(0, src, torch.from_numpy(dk_edges))
    return torch.from_numpy(dq), dk, torch.from_numpy(dw)


@_jit(reassociate=True)
def _indexer_score_grads(grad, q, k, w, ptr, src, dq, dw, dk_edges, first, last):
    """See :func:`indexer_score_grads`; targets ``first`` to ``last - 1``."""
    heads, channels = q.shape[1], q.shape[2]
    zero = dq.dtype.type(0)
    for i in range(first, last):
        for e in range(ptr[i], ptr[i + 1]):
            j = src[e]
            for c in range(channels):
                dk_edges[e, c] = zero
            for h in range(heads):
                dot = zero
                for c in range(channels):
                    dot += q[i, h, c] * k[j, c]
                if dot > 0:
                    dw[i, h] += grad[e] * dot
                    scale = grad[e] * w[i, h]
                    for c in range(channels):
                        dq[i, h, c] += scale * k[j, c]
                        dk_edges[e, c] += scale * q[i, h, c]


def indexer_dense_scores(q: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """The lightning indexer's score of every pair, ``[N_dst, N_src]`` (target i, source j),
    from the inputs :func:`indexer_scores` takes, the targets split among torch's threads."""
    out = np.empty((q.shape[0], k.shape[0]), dtype=_np(q).dtype)
    ptr = np.arange(q.shape[0] + 1, dtype=np.int64) * k.shape[0]  # (the work of each row)
    _run_rows(_indexer_dense_scores, ptr, _np(q.contiguous()), _np(k.contiguous()),
              _np(w.contiguous()), out)
    return torch.from_numpy(out)


@_jit(reassociate=True)
def _indexer_dense_scores(q, k, w, out, first, last):
    """See :func:`indexer_dense_scores`; targets ``first`` to ``last - 1``."""
    zero = out.dtype.type(0)
    for i in range(first, last):
        for j in range(k.shape[0]):
            out[i, j] = _indexer_score(q, k, w, i, j, zero)


@_jit()
def _one_loop_per_node(src, dst, num_nodes, keep_if_looped):
    """The edges that are not self-loops, then the loops, their positions, and ``False``
    (see :func:`one_loop_per_node`); two empty arrays and ``True``, after one pass, when
    ``keep_if_looped`` and every node has one loop."""
    num_edges = src.shape[0]
    count = 0
    loops = np.zeros(num_nodes if keep_if_looped else 0, dtype=np.int32)
    for e in range(num_edges):
        if src[e] != dst[e]:
            count += 1
        elif keep_if_looped and src[e] < num_nodes:
            loops[src[e]] += 1
    if keep_if_looped and count + num_nodes == num_edges and (loops == 1).all():
        return np.empty((2, 0), dtype=src.dtype), np.empty(0, dtype=np.int64), True
    edges = np.empty((2, count + num_nodes), dtype=src.dtype)
    kept = np.empty(count, dtype=np.int64)
    p = 0
    for e in range(num_edges):
        if src[e] != dst[e]:
            edges[0, p] = src[e]
            edges[1, p] = dst[e]
            kept[p] = e
            p += 1
    for i in range(num_nodes):
        edges[0, count + i] = i
        edges[1, count + i] = i
    return edges, kept, False


def one_loop_per_node(edge_index: Tensor, num_nodes: int, *,
                      keep_if_looped: bool = False) -> tuple[Tensor, Tensor | None]:
    """The edges of ``edge_index`` (CPU ``[2, E]``) that are not self-loops, in order, then
    ``i -> i`` for each ``i < num_nodes``: ``[2, E_kept + num_nodes]`` in the ids' dtype, and
    the positions of the kept edges ``[E_kept]`` (int64), in two passes over the edges.

    With ``keep_if_looped``, a graph in which each of the ``num_nodes`` nodes has exactly one
    self-loop already (and no other node has one) comes back as it is, with ``None`` for the
    positions, after one pass: the same edges in another order."""
    ids = edge_index.detach()
    edges, kept, looped = _one_loop_per_node(ids[0].numpy(), ids[1].numpy(), num_nodes,
                                             keep_if_looped)
    if looped:
        return edge_index, None
    return torch.from_numpy(edges), torch.from_numpy(kept)


def _specialise_from_environment() -> bool:
    """``GRAPHATTN_CPU_SPECIALISE`` (``1``, the default, or ``0``), read at import."""
    value = os.environ.get("GRAPHATTN_CPU_SPECIALISE", "1")
    if value not in ("0", "1"):
        raise ValueError(f"GRAPHATTN_CPU_SPECIALISE must be 0 or 1, got {value!r}")
    return value == "1"


# What the kernels are compiled for as constants: channel counts, head counts, and the score and
# the bias and edge-term flags. GRAPHATTN_CPU_SPECIALISE=0 in the environment turns all three off
# at import: one variant per dtype then serves every option set (fewer compiles, slower kernels:
# benchmarks/cpu_specialisation.py).
CONSTANT_CHANNELS = frozenset({1, 2, 4, 8, 16, 32, 64, 128})
CONSTANT_HEADS = frozenset({1})
SPECIALISED_FLAGS = _specialise_from_environment()
SPECIALISED_CHANNELS = CONSTANT_CHANNELS if SPECIALISED_FLAGS else frozenset()
SPECIALISED_HEADS = CONSTANT_HEADS if SPECIALISED_FLAGS else frozenset()
RUN_TIME = -1  # the score a kernel is compiled for when it reads its flags at run time
DOT, ADDITIVE, GATV2 = 0, 1, 2  # the scores, as the kernels' compile-time flag
SCORE_KINDS = {"dot": DOT, "additive": ADDITIVE, "gatv2": GATV2}
SCORE_NAMES = {kind: name for name, kind in SCORE_KINDS.items()}


# SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA
# 2014): the state advances by this odd constant, and each output is the state, mixed.
_SPLITMIX_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_SPLITMIX_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


@_jit(inline="always")
def _splitmix_high(seed, index):
    """The 32 high bits of output ``index + 1`` of SplitMix64 seeded with ``seed`` (uint64)."""
    mix1, mix2 = _SPLITMIX_MIX
    z = seed + np.uint64(index + 1) * _SPLITMIX_GAMMA
    z = (z ^ (z >> np.uint64(30))) * mix1
    z = (z ^ (z >> np.uint64(27))) * mix2
    z = z ^ (z >> np.uint64(31))
    return z >> np.uint64(32)


@_jit()
def _dropout_bits(out, seed, threshold, bits, first, last):
    """Entries ``first..last-1`` of a flat dropout mask, as the raw bits of its float type:
    ``bits`` where the 32 high bits of SplitMix64's output for the entry are at least
    ``threshold``, else 0. Entry ``i`` takes output ``i + 1`` of the generator seeded with
    ``seed``, so any split of the entries fills the same mask."""
    for i in range(first, last):
        out[i] = bits if _splitmix_high(seed, i) >= threshold else 0


def _mask_state(mask):
    """What a kernel reads once, before its loops, of a seeded mask's int64 parameters ``[3]``
    (:func:`graphattn.functional.dropout.seeded_mask_parameters`): the seed and the threshold
    as uint64, the kept multiplier as float32; zeros for a mask ``[E, H]``, which is read
    entry by entry instead."""


@overload(_mask_state, inline="always")
def _mask_state_overload(mask):
    if mask.ndim == 2:
        return lambda mask: (np.uint64(0), np.uint64(0), np.float32(0.0))
    return lambda mask: (np.uint64(mask[0]), np.uint64(mask[1]),
                         _float32_from_bits(np.int32(mask[2])))


def _mask_multiplier(mask, state, e, h, H):
    """The dropout multiplier of edge ``e``, head ``h`` (of ``H``): ``mask[e, h]`` of a mask
    ``[E, H]``, or, when ``mask`` is a seeded mask's parameters (``state``, from
    :func:`_mask_state`), entry ``e H + h`` of that mask drawn here, as :func:`seeded_mask`
    writes it and the Triton kernels draw it."""


@overload(_mask_multiplier, inline="always")
def _mask_multiplier_overload(mask, state, e, h, H):
    if mask.ndim == 2:
        return lambda mask, state, e, h, H: mask[e, h]

    def seeded(mask, state, e, h, H):
        seed, threshold, kept = state
        if _splitmix_high(seed, np.int64(e) * H + h) >= threshold:
            return kept
        return np.float32(0.0)
    return seeded


def _prefetch_mask(mask, e):
    """Prefetch row ``e`` of a dropout mask ``[E, H]``; nothing for a seeded mask's
    parameters (see :func:`_mask_multiplier`)."""


@overload(_prefetch_mask, inline="always")
def _prefetch_mask_overload(mask, e):
    if mask.ndim == 2:
        return lambda mask, e: _prefetch_row(mask, e)
    return lambda mask, e: None


def _channels(channels: int) -> int:
    """The channel count a kernel is compiled for: ``channels``, or 0 for "read it at run time"."""
    return channels if channels in SPECIALISED_CHANNELS else 0


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose IEEE 754 bit pattern is the int32 ``bits``."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(bits), codegen


# expf of the Cephes library: exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln(2) / 2, with
# ln 2 split in two parts so that r is exact, and exp(r) by a degree-7 polynomial.
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_POLY = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                          4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
_EXP_MIN = np.float32(-87.33654)  # exp(x) below the smallest normal float32: 0
_EXP_MAX = np.float32(88.37626)  # 2^n past float32's exponents above this: inf (expf: 88.72)
_F32_HALF, _F32_ONE, _F32_ZERO, _F32_INF = (np.float32(v) for v in (0.5, 1.0, 0.0, np.inf))


def _exp(x):
    """``exp(x)`` in the kernels: inlined arithmetic for float32, ``np.exp`` for float64."""
    return np.exp(x)


@overload(_exp, inline="always")
def _exp_overload(x):
    if x != types.float32:
        return lambda x: np.exp(x)
    p0, p1, p2, p3, p4, p5 = _EXP_POLY

    def exp_float32(x):
        # Straight-line arithmetic without a call, so that loops over heads vectorise. Within
        # 1 ulp of the exact exp (tested); 0 below _EXP_MIN (where expf would give a
        # subnormal), inf above _EXP_MAX, NaN for NaN.
        c = x
        if c < _EXP_MIN:
            c = _EXP_MIN
        if c > _EXP_MAX:
            c = _EXP_MAX
        n = np.floor(c * _LOG2E + _F32_HALF)
        r = c - n * _LN2_HI - n * _LN2_LO
        poly = ((((p0 * r + p1) * r + p2) * r + p3) * r + p4) * r + p5
        y = (poly * r * r + r + _F32_ONE) * _float32_from_bits(np.int32((np.int32(n) + 127) << 23))
        if x < _EXP_MIN:
            y = _F32_ZERO
        if x > _EXP_MAX:
            y = _F32_INF
        if x != x:
            y = x
        return y
    return exp_float32


@intrinsic
def _lane_dot(typingctx, a, i, b, j, start, blocks):
    """``_dot`` of the first ``8 * blocks >= 8`` channels from ``start`` on, as 8-wide vectors.

    Lane l sums the products of channels l, l + 8, l + 16, ... in that order; the 8 lanes are
    then added pairwise. Every add is the plain IEEE add of the scalar version, in the same
    order, so the result is the same bit for bit. ``a`` and ``b`` are C-contiguous 2-D float
    arrays of one dtype.
    """
    if not (isinstance(a, types.Array) and isinstance(b, types.Array) and a.ndim == b.ndim == 2
            and a.layout == b.layout == "C" and a.dtype == b.dtype
            and a.dtype in (types.float32, types.float64)):
        return None

    def codegen(context, builder, signature, args):
        a_ty, i_ty, b_ty, j_ty, start_ty, blocks_ty = signature.args
        i_v, j_v, start_v, blocks_v = (context.cast(builder, v, t, types.intp) for v, t in (
            (args[1], i_ty), (args[3], j_ty), (args[4], start_ty), (args[5], blocks_ty)))
        element = context.get_value_type(a_ty.dtype)
        vector = ir.VectorType(element, 8)
        align = context.get_abi_sizeof(element)  # rows need not be aligned to the vector

        def row_pointer(ty, value, row):
            array = context.make_array(ty)(context, builder, value)
            item = cgutils.get_item_pointer(context, builder, ty, array, [row, start_v],
                                            wraparound=False)
            return builder.bitcast(item, vector.as_pointer())

        pa, pb = row_pointer(a_ty, args[0], i_v), row_pointer(b_ty, args[2], j_v)
        acc = cgutils.alloca_once(builder, vector)
        builder.store(builder.fmul(builder.load(pa, align=align), builder.load(pb, align=align)),
                      acc)
        one = ir.Constant(blocks_v.type, 1)
        with cgutils.for_range(builder, builder.sub(blocks_v, one)) as loop:
            block = builder.add(loop.index, one)
            product = builder.fmul(builder.load(builder.gep(pa, [block]), align=align),
                                   builder.load(builder.gep(pb, [block]), align=align))
            builder.store(builder.fadd(builder.load(acc), product), acc)
        lanes = builder.load(acc)
        lane = [builder.extract_element(lanes, ir.Constant(ir.IntType(32), x)) for x in range(8)]
        pairs = [builder.fadd(lane[x], lane[x + 1]) for x in range(0, 8, 2)]
        return builder.fadd(builder.fadd(pairs[0], pairs[1]), builder.fadd(pairs[2], pairs[3]))
    return a.dtype(a, i, b, j, start, blocks), codegen


@intrinsic
def _lane_gatv2(typingctx, q, i, k, j, ek, e, att, start, blocks, slope):
    """``_gatv2_dot`` (``ek`` None) or ``_gatv2_edge_dot`` of the first ``8 * blocks >= 8``
    channels from ``start`` on, as 8-wide vectors.

    Lane l sums ``att[x] * LeakyReLU(q[i, x] + k[j, x])`` (with ``+ ek[e, x]`` added to
    ``k[j, x]`` first) over the channels x = l, l + 8, l + 16, ... in that order; the 8 lanes
    are then added pairwise, as in :func:`_lane_dot`. ``q``, ``k`` (and ``ek``) are
    C-contiguous 2-D float arrays, ``att`` a C-contiguous 1-D one, all of one dtype.
    """
    rows = (q, k) if ek == types.none else (q, k, ek)
    if not (all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C"
                and a.dtype == q.dtype for a in rows)
            and isinstance(att, types.Array) and att.ndim == 1 and att.layout == "C"
            and att.dtype == q.dtype and q.dtype in (types.float32, types.float64)):
        return None

    def codegen(context, builder, signature, args):
        tys = signature.args
        i_v, j_v, e_v, start_v, blocks_v = (context.cast(builder, args[n], tys[n], types.intp)
                                            for n in (1, 3, 5, 7, 8))
        element = context.get_value_type(tys[0].dtype)
        vector = ir.VectorType(element, 8)
        align = context.get_abi_sizeof(element)  # rows need not be aligned to the vector
        index32 = ir.IntType(32)
        slope_v = context.cast(builder, args[9], tys[9], tys[0].dtype)
        slopes = builder.shuffle_vector(
            builder.insert_element(ir.Constant(vector, ir.Undefined), slope_v,
                                   ir.Constant(index32, 0)),
            ir.Constant(vector, ir.Undefined), ir.Constant(ir.VectorType(index32, 8), [0] * 8))
        zeros = ir.Constant(vector, [0.0] * 8)

        def pointer(n, indices):
            array = context.make_array(tys[n])(context, builder, args[n])
            item = cgutils.get_item_pointer(context, builder, tys[n], array, indices,
                                            wraparound=False)
            return builder.bitcast(item, vector.as_pointer())

        pq, pk, patt = pointer(0, [i_v, start_v]), pointer(2, [j_v, start_v]), pointer(6, [start_v])
        pek = None if tys[4] == types.none else pointer(4, [e_v, start_v])

        def term(block):
            def load(p):
                return builder.load(builder.gep(p, [block]), align=align)
            key = load(pk) if pek is None else builder.fadd(load(pk), load(pek))
            z = builder.fadd(load(pq), key)
            positive = builder.fcmp_ordered(">", z, zeros)
            return builder.fmul(load(patt), builder.select(positive, z, builder.fmul(z, slopes)))

        acc = cgutils.alloca_once(builder, vector)
        builder.store(term(ir.Constant(blocks_v.type, 0)), acc)
        one = ir.Constant(blocks_v.type, 1)
        with cgutils.for_range(builder, builder.sub(blocks_v, one)) as loop:
            builder.store(builder.fadd(builder.load(acc), term(builder.add(loop.index, one))),
                          acc)
        lanes = builder.load(acc)
        lane = [builder.extract_element(lanes, ir.Constant(index32, x)) for x in range(8)]
        pairs = [builder.fadd(lane[x], lane[x + 1]) for x in range(0, 8, 2)]
        return builder.fadd(builder.fadd(pairs[0], pairs[1]), builder.fadd(pairs[2], pairs[3]))
    return q.dtype(q, i, k, j, ek, e, att, start, blocks, slope), codegen


if numba.config.DISABLE_JIT:
    # NUMBA_DISABLE_JIT=1 (numba's debugging switch) runs the kernels as Python functions, in
    # which an intrinsic cannot be called: Python stand-ins for the three the kernels call

    def _prefetch(array, row, offset, write):  # noqa: F811
        """No cache hint from Python."""

    def _lane_dot(a, i, b, j, start, blocks):  # noqa: F811
        """The products in 8 lanes, summed in the same order as the intrinsic."""
        lanes = a[i, start:start + 8] * b[j, start:start + 8]
        for block in range(1, blocks):
            x = start + 8 * block
            lanes = lanes + a[i, x:x + 8] * b[j, x:x + 8]
        return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
            (lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))

    def _lane_gatv2(q, i, k, j, ek, e, att, start, blocks, slope):  # noqa: F811
        """The terms in 8 lanes, summed in the same order as the intrinsic."""
        end = start + 8 * blocks
        key = k[j, start:end] if ek is None else k[j, start:end] + ek[e, start:end]
        z = q[i, start:end] + key
        terms = (att[start:end] * np.where(z > 0, z, z * slope)).reshape(blocks, 8)
        lanes = terms[0]
        for block in range(1, blocks):
            lanes = lanes + terms[block]
        return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + (
            (lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))


@_jit(inline="always")
def _dot(a, i, b, j, start, n):
    """``sum(a[i, start:start + n] * b[j, start:start + n])`` in a fixed order, for ``n >= 1``.

    From 8 channels on, the products go into 8 partial sums (channel x into sum x % 8), which
    are added pairwise, and the channels past the last multiple of 8 are added after, in order:
    the 8 sums are independent and run as one vector (:func:`_lane_dot`), where one running sum
    would be a chain of n dependent adds. Below 8 channels, one running sum.
    """
    if n < 8:
        s = a[i, start] * b[j, start]
        for x in range(start + 1, start + n):
            s += a[i, x] * b[j, x]
        return s
    end = start + n - n % 8
    s = _lane_dot(a, i, b, j, start, n // 8)
    for x in range(end, start + n):
        s += a[i, x] * b[j, x]
    return s


@_jit(inline="always")
def _leaky_relu(z, slope, y):
    """``y * LeakyReLU'(z)``: ``y`` for ``z > 0``, else ``y * slope`` (the slope at 0, as
    torch). ``_leaky_relu(z, slope, z)`` is LeakyReLU(z). A select between two computed values,
    which vectorises."""
    return y if z > 0 else y * slope


@_jit(inline="always")
def _gatv2_dot(q, i, k, j, att, start, n, slope):
    """``sum(att[x] * LeakyReLU(q[i, x] + k[j, x]))`` over ``x = start..start+n-1``, for
    ``n >= 1``, in the order of :func:`_dot`: from 8 channels on in 8 partial sums
    (:func:`_lane_gatv2`), then the channels past the last multiple of 8 in order; below 8
    channels one running sum."""
    if n < 8:
        z = q[i, start] + k[j, start]
        s = att[start] * _leaky_relu(z, slope, z)
        for x in range(start + 1, start + n):
            z = q[i, x] + k[j, x]
            s += att[x] * _leaky_relu(z, slope, z)
        return s
    s = _lane_gatv2(q, i, k, j, None, 0, att, start, n // 8, slope)
    for x in range(start + n - n % 8, start + n):
        z = q[i, x] + k[j, x]
        s += att[x] * _leaky_relu(z, slope, z)
    return s


@_jit(inline="always")
def _gatv2_edge_dot(q, i, k, j, ek, e, att, start, n, slope):
    """``_gatv2_dot`` with the edge's key term: ``sum(att[x] * LeakyReLU(q[i, x] + (k[j, x] +
    ek[e, x])))`` over ``x = start..start+n-1``, in the same order."""
    if n < 8:
        z = q[i, start] + (k[j, start] + ek[e, start])
        s = att[start] * _leaky_relu(z, slope, z)
        for x in range(start + 1, start + n):
            z = q[i, x] + (k[j, x] + ek[e, x])
            s += att[x] * _leaky_relu(z, slope, z)
        return s
    s = _lane_gatv2(q, i, k, j, ek, e, att, start, n // 8, slope)
    for x in range(start + n - n % 8, start + n):
        z = q[i, x] + (k[j, x] + ek[e, x])
        s += att[x] * _leaky_relu(z, slope, z)
    return s


# tanhf of the Cephes library: for |x| >= 0.625, (1 - e) / (1 + e) with e = exp(-2 |x|) and the
# sign of x; below, x + x^3 P(x^2) with a degree-4 polynomial P
_TANH_POLY = tuple(np.float32(c) for c in (-5.70498872745e-3, 2.06390887954e-2,
                                           -5.37397155531e-2, 1.33314422036e-1,
                                           -3.33332819422e-1))
_TANH_SMALL = np.float32(0.625)


def _tanh(x, a, e):
    """``tanh(x)`` in the kernels from ``a = |x|`` and ``e = exp(-2 a)``: Cephes' arithmetic
    for float32, ``np.tanh`` for float64."""
    return np.tanh(x)


@overload(_tanh, inline="always")
def _tanh_overload(x, a, e):
    if x != types.float32:
        return lambda x, a, e: np.tanh(x)
    p0, p1, p2, p3, p4 = _TANH_POLY

    def tanh_float32(x, a, e):
        # both branches computed and one selected, no call: within 2 ulp of the exact tanh
        # (tested); NaN for NaN
        large = (_F32_ONE - e) / (_F32_ONE + e)
        z = x * x
        small = ((((p0 * z + p1) * z + p2) * z + p3) * z + p4) * z * x + x
        signed = -large if x < _F32_ZERO else large
        return small if a < _TANH_SMALL else signed
    return tanh_float32


@_jit(error_model="numpy")
def _cap_values(values, n, cap, grad, backward):
    """``values[:n]`` soft-capped in place, ``cap * tanh(x / cap)``; for backward ``grad[:n]``
    times the derivative of the cap, ``1 - tanh^2``.

    One loop that computes the tanh with :func:`_exp`'s arithmetic inlined and divisions that
    cannot raise (``error_model="numpy"``; the divisors are never 0), which vectorises:
    libm's tanhf, a call per score, or a division that checks for 0, made the capped forward
    2x slower than the uncapped one. A function of its own: inlined into the inlined
    :func:`_target_scores`, or twice into one function, the nested inlining of :func:`_exp`
    leaves numba's SSA pass warning ("not in scope").
    """
    for t in range(n):
        x = values[t] / cap
        a = np.abs(x)
        th = _tanh(x, a, _exp(-(a + a)))  # (e in [0, 1]: no overflow)
        values[t] = cap * th
        if backward:
            grad[t] *= 1 - th * th


@_jit()
def _cap_row(scores, slopes, bias, perm, start, degree, H, cap, has_bias, top, backward):
    """The soft cap of a target's ``degree`` scores (``[degree, H]`` at the top of ``scores``,
    before their bias): ``cap * tanh(s / cap)``, then the bias added; for backward
    ``slopes`` times the derivative of the cap, else the maximum per head into ``top``.
    Without a bias ``top`` comes holding the maximum of the scores before the cap, which is
    capped here: the cap is increasing, so that saves a pass over the row."""
    _cap_values(scores.reshape(-1), degree * H, cap, slopes.reshape(-1), backward)
    if not has_bias:
        if not backward and degree:
            _cap_values(top, H, cap, top, False)
        return
    for p in range(degree):
        e = perm[start + p]
        for h in range(H):
            s = scores[p, h] + bias[e, h]  # (the scores' dtype)
            scores[p, h] = s
            if not backward:
                top[h] = max(top[h], s)


@_jit(inline="always")
def _additive_score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, score, has_bias, has_ek):
    """:func:`_score` for the additive score: ``scale * LeakyReLU(q_i + k_j + b)``."""
    u = q[i, h] + k[j, h]
    if has_bias:
        u += b
    if u > 0:
        return scale * u, scale
    return scale * slope * u, scale * slope


@_jit(inline="always")
def _gatv2_score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, score, has_bias,
                 has_ek):
    """:func:`_score` for gatv2: ``scale * att . LeakyReLU(q_i + k_j) + b``."""
    s = _gatv2_dot(q, i, k, j, att, h * Cq, Cq, slope) * scale
    if has_bias:
        s += b
    return s, scale


@_jit(inline="always")
def _gatv2_edge_score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, score, has_bias,
                      has_ek):
    """:func:`_score` for gatv2 with the edge's key term: ``scale * att . LeakyReLU(q_i + k_j +
    ek_e) + b``."""
    s = _gatv2_edge_dot(q, i, k, j, ek, e, att, h * Cq, Cq, slope) * scale
    if has_bias:
        s += b
    return s, scale


@_jit(inline="always")
def _dot_score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, score, has_bias, has_ek):
    """:func:`_score` for dot: ``scale * q_i . k_j + b``."""
    s = _dot(q, i, k, j, h * Cq, Cq) * scale
    if has_bias:
        s += b
    return s, scale


@_jit(inline="always")
def _dot_edge_score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, score, has_bias,
                    has_ek):
    """:func:`_score` for dot with the edge's key term: ``q_i . (k_j + ek_e)`` as two dot
    products."""
    s = (_dot(q, i, k, j, h * Cq, Cq) + _dot(q, i, ek, e, h * Cq, Cq)) * scale
    if has_bias:
        s += b
    return s, scale


# (score, has_ek) -> the score function; the additive score has no edge key term
_SCORE_FUNCTIONS = {(ADDITIVE, False): _additive_score, (GATV2, False): _gatv2_score,
                    (GATV2, True): _gatv2_edge_score, (DOT, False): _dot_score,
                    (DOT, True): _dot_edge_score}


def _score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, score, has_bias, has_ek):
    """Score of edge ``e = (j -> i)`` in head h, and ds/d(pre-activation) (``scale`` for dot
    and gatv2, whose channel factors come later).

    ``q, k`` are ``[N, H * Cq]`` (``Cq = 1`` for the additive score); ``att`` is ``[H * Cq]``;
    ``b`` (with ``has_bias``) the edge's bias in head h; ``ek`` (with ``has_ek``) the edges' key
    terms ``[E, H * Cq]``. The score and ``has_ek`` are compile-time constants, and only the
    score they name is compiled (see the overload below).
    """
    return _SCORE_FUNCTIONS[score, bool(has_ek)](q, k, att, b, ek, i, j, e, h, Cq, scale,
                                                 slope, score, has_bias, has_ek)


@overload(_score, inline="always", prefer_literal=True)
def _score_overload(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, score, has_bias, has_ek):
    # The score and has_ek reach here as literals (_target_scores passes constants): the score
    # function is picked at typing, so that only its code is compiled and inlined. (An njit
    # _score holding every score would be inlined whole into each kernel before its other
    # branches are dropped: a third more compile time per kernel variant.)
    if not (isinstance(score, types.IntegerLiteral) and isinstance(has_ek, types.Literal)):
        raise TypingError(f"_score takes its score and has_ek as constants, got {score} and "
                          f"{has_ek}")
    return _SCORE_FUNCTIONS[score.literal_value, bool(has_ek.literal_value)].py_func


@_jit(inline="always")
def _target_scores(q, k, att, bias, ek, rowptr, perm, src, i, H, Cq, scale, slope, score,
                   has_bias, has_ek, cap, has_cap, scores, top, slopes, backward):
    """Scores of target i's in-edges (``[degree, H]``, CSR order) into ``scores``, with the rows
    of ``k`` (and ``bias``, ``ek``) prefetched; for backward their ds/d(pre-activation) into
    ``slopes``, else the maximum per head into ``top``. With ``has_cap`` (dot and gatv2) the
    score before its bias is soft-capped at ``cap`` (:func:`_cap_row`)."""
    num_edges = src.shape[0]
    start, stop = rowptr[i], rowptr[i + 1]
    for p in range(start, stop):
        if p + PREFETCH_DISTANCE < num_edges:
            _prefetch_row(k, src[p + PREFETCH_DISTANCE])
            if has_bias:
                _prefetch_row(bias, perm[p + PREFETCH_DISTANCE])
            if has_ek:
                _prefetch_row(ek, perm[p + PREFETCH_DISTANCE])
        j, e = src[p], perm[p]
        for h in range(H):
            # The bias is read here and the score picked here, each _score call with its score
            # and edge-key flag as constants (with the kernel's flags constant, numba keeps one
            # of them): an inlined function given arrays that it reads under a branch on a
            # run-time flag costs two reference counts per array, edge and head (numba's
            # pruning of counts misses that pattern), which made the variant that reads its
            # flags at run time several times slower.
            b = bias[e, h] if has_bias else bias[0, 0]  # (bias[0, 0]: unread, as no flag)
            add_bias = has_bias and not has_cap  # (with a cap, added after it: _cap_row)
            if score == DOT and has_ek:
                s, d_pre = _score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, DOT,
                                  add_bias, True)
            elif score == DOT:
                s, d_pre = _score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, DOT,
                                  add_bias, False)
            elif score == GATV2 and has_ek:
                s, d_pre = _score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, GATV2,
                                  add_bias, True)
            elif score == GATV2:
                s, d_pre = _score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, GATV2,
                                  add_bias, False)
            else:
                s, d_pre = _score(q, k, att, b, ek, i, j, e, h, Cq, scale, slope, ADDITIVE,
                                  add_bias, False)
            scores[p - start, h] = s
            if backward:
                slopes[p - start, h] = d_pre
            elif not (has_cap and has_bias):  # (capped without a bias: _cap_row caps the max)
                top[h] = max(top[h], s)
    if has_cap:  # (a constant: see _kernel_flags)
        _cap_row(scores, slopes, bias, perm, start, stop - start, H, cap, has_bias, top,
                 backward)


@_jit(inline="always")
def _add_block(sums, acc, first):
    """``sums += acc`` (``sums = acc`` for the ``first`` block; ``sums`` in float64), then
    ``acc = 0``: one block of a long row's sum (see ``SUM_BLOCK``). Rows of one block never
    touch ``sums``, not even to zero it."""
    for x in range(acc.shape[0]):
        sums[x] = acc[x] if first else sums[x] + acc[x]
        acc[x] = 0


@_jit(inline="always")
def _weighted_values(v, ev, mask, state, scores, src, perm, start, lo, hi, H, C, weight, acc,
                     has_mask, has_ev):
    """``acc += sum_p weight_p * v_{src[p]}`` (``v + ev`` with ``has_ev``) over the edges
    ``p`` in ``lo..hi-1`` of the target whose first edge is ``start``, with the weights
    ``scores[p - start]`` (times the dropout multipliers with ``has_mask``), the rows of
    ``v`` prefetched; ``acc`` in ``H * C`` channels, ``weight`` its scratch."""
    num_edges = src.shape[0]
    for p in range(lo, hi):
        if p + PREFETCH_DISTANCE < num_edges:
            _prefetch_row(v, src[p + PREFETCH_DISTANCE])
            if has_mask:
                _prefetch_mask(mask, perm[p + PREFETCH_DISTANCE])
            if has_ev:
                _prefetch_row(ev, perm[p + PREFETCH_DISTANCE])
        j, e = src[p], perm[p]
        for h in range(H):
            w = scores[p - start, h]
            if has_mask:
                w *= _mask_multiplier(mask, state, e, h, H)
            for x in range(C):
                weight[h * C + x] = w
        if has_ev:
            for x in range(H * C):
                acc[x] += weight[x] * (v[j, x] + ev[e, x])
        else:
            for x in range(H * C):
                acc[x] += weight[x] * v[j, x]


@_jit(inline="always")
def _long_row_total(scores, degree, part, sums, total):
    """``total[h] = sum(scores[:degree, h])`` for a row of more than ``SUM_BLOCK`` edges: each
    block summed in ``part`` in the scores' dtype, the blocks added in float64 (``sums``),
    rounded once."""
    sums[:] = 0
    for block in range(0, degree, SUM_BLOCK):
        part[:] = 0
        for p in range(block, min(block + SUM_BLOCK, degree)):
            for h in range(part.shape[0]):
                part[h] += scores[p, h]
        for h in range(part.shape[0]):
            sums[h] += part[h]
    for h in range(part.shape[0]):
        total[h] = sums[h]


@_jit(inline="always")
def _max_degree(ptr, first, last):
    """The largest ``ptr[i + 1] - ptr[i]`` over rows ``first..last-1`` (at least 1)."""
    most = 1
    for i in range(first, last):
        most = max(most, ptr[i + 1] - ptr[i])
    return most


@functools.cache
def _forward_kernel(fixed_score: int, fixed_bias: bool, fixed_ek: bool, fixed_ev: bool,
                    fixed_cap: bool, qk_channels: int, v_channels: int, heads: int = 0):
    """The forward kernel compiled for these flags (score, bias, key and value edge terms, cap;
    ``fixed_score`` RUN_TIME: the kernel's ``flags`` instead), channel counts and head count
    (0: read at run time)."""

    @_jit()
    def kernel(q, k, v, att, bias, mask, ek, ev, rowptr, perm, src, scale, slope, cap, out,
               lse, alpha, flags, has_mask, need_alpha, sinks, has_sinks, first, last):
        """Targets ``first..last-1``: softmax over the in-edges, weighted sum of the values
        (``v_j + ev_e`` with ``has_ev``), the dropout multipliers applied with ``has_mask``
        and the weights written to ``alpha`` with ``need_alpha``. With ``has_sinks``, head
        h's softmax has one more score in every row, ``sinks[h]``, whose value is 0: it
        raises the maximum and the sum, and adds nothing to the weighted sum.

        Two passes over each target's in-edges: the scores (kept in a ``[degree, H]`` scratch)
        and their maximum per head, then the exponentials and the weighted sum of ``v``.
        """
        score = fixed_score  # (one name per assignment: numba then prunes the
        has_bias = fixed_bias  # branches on these where they are constants)
        has_ek = fixed_ek
        has_ev = fixed_ev
        has_cap = fixed_cap  # a constant in every variant (see _kernel_flags)
        if fixed_score == RUN_TIME:
            score, has_bias, has_ek, has_ev, _ = flags
        H = heads if heads else lse.shape[1]
        Cq = qk_channels if qk_channels else q.shape[1] // H
        C = v_channels if v_channels else v.shape[1] // H
        scores = np.empty((_max_degree(rowptr, first, last), H), dtype=out.dtype)
        state = _mask_state(mask)  # a seeded mask's parameters, read once
        top = np.empty(H, dtype=out.dtype)
        total = np.empty(H, dtype=out.dtype)
        part = np.empty(H, dtype=out.dtype)  # scratch of _long_row_total
        total_blocks = np.empty(H, dtype=np.float64)
        inv = np.empty(H, dtype=out.dtype)
        weight = np.empty(H * C, dtype=out.dtype)  # the edge's weight, repeated per channel
        acc = np.empty(H * C, dtype=out.dtype)
        acc_blocks = np.empty(H * C, dtype=np.float64)  # sum of acc over full SUM_BLOCKs
        for i in range(first, last):
            start, stop = rowptr[i], rowptr[i + 1]
            top[:] = -np.inf
            _target_scores(q, k, att, bias, ek, rowptr, perm, src, i, H, Cq, scale, slope, score,
                           has_bias, has_ek, cap, has_cap, scores, top, scores, False)
            degree = stop - start
            # a row without edges leaves its sinks out: nothing to weigh, and its output is 0
            # even beside a sink of +inf or NaN (whose term would make the row's total NaN)
            if has_sinks and degree > 0:
                for h in range(H):
                    top[h] = max(top[h], sinks[h])
            for h in range(H):  # a row whose scores are all -inf gets weights exp(-inf) = 0
                if top[h] == -np.inf:
                    top[h] = np.inf
            total[:] = 0
            for p in range(degree):  # the scores become exp(s - max)
                for h in range(H):
                    scores[p, h] -= top[h]
            flat = scores.reshape(-1)
            for t in range(degree * H):  # one loop over all heads: vectorised for any H
                flat[t] = _exp(flat[t])
            if degree <= SUM_BLOCK:
                for p in range(degree):
                    for h in range(H):
                        total[h] += scores[p, h]
            else:
                _long_row_total(scores, degree, part, total_blocks, total)
            if has_sinks and degree > 0:
                for h in range(H):
                    total[h] += np.exp(sinks[h] - top[h])
            acc[:] = 0
            if degree <= SUM_BLOCK:
                _weighted_values(v, ev, mask, state, scores, src, perm, start, start, stop, H,
                                 C, weight, acc, has_mask, has_ev)
            else:
                for block in range(start, stop, SUM_BLOCK):
                    _weighted_values(v, ev, mask, state, scores, src, perm, start, block,
                                     min(block + SUM_BLOCK, stop), H, C, weight, acc,
                                     has_mask, has_ev)
                    if block + SUM_BLOCK < stop:
                        _add_block(acc_blocks, acc, block == start)
                for x in range(H * C):  # the whole sum, rounded once
                    acc[x] = acc_blocks[x] + acc[x]
            for h in range(H):
                # the log-sum-exp top + log(total) in two parts: log(total) would round away
                # in the sum when |top| >> log(degree) (a bias of -1e9 on every in-edge)
                if total[h] > 0:
                    inv[h] = 1 / total[h]
                    lse[i, h, 0] = top[h]
                    lse[i, h, 1] = np.log(total[h])
                elif total[h] == 0:  # no edge, or all scores -inf: every alpha of the row is 0
                    inv[h] = 0
                    lse[i, h, 0] = np.inf
                    lse[i, h, 1] = 0
                else:  # a NaN score (or +inf): every alpha of the row is NaN, as in softmax
                    inv[h] = total[h]
                    lse[i, h, 0] = total[h]
                    lse[i, h, 1] = total[h]
                for x in range(C):
                    out[i, h * C + x] = acc[h * C + x] * inv[h]
            if need_alpha:
                for p in range(start, stop):
                    e = perm[p]
                    for h in range(H):
                        alpha[e, h] = scores[p - start, h] * inv[h]
    return kernel


@functools.cache
def _backward_target_kernel(fixed_score: int, fixed_bias: bool, fixed_ek: bool,
                            fixed_ev: bool, fixed_cap: bool, qk_channels: int, v_channels: int,
                            heads: int = 0):
    """The target pass of backward compiled for these flags, channel counts and head count, as
    :func:`_forward_kernel`."""

    @_jit()
    def kernel(q, k, v, att, bias, mask, ek, ev, out, grad_out, grad_alpha, lse, rowptr, perm,
               src, csc_position, scale, slope, cap, grad_q, grad_att, grad_bias, grad_key, weight,
               grad_ek, grad_ev, flags, has_mask, has_grad_alpha, first, last):
        """Targets ``first..last-1``: dL/ds of each in-edge, ``grad_q`` and the bias gradient
        (with the dropout multipliers when ``has_mask``, and the weights' own gradient
        ``grad_alpha`` when ``has_grad_alpha``).

        Also writes, in CSC order, each edge's factor of ``q_i`` in ``grad_k`` (``grad_key``)
        and its factor of ``grad_out_i`` in ``grad_v`` (``weight``: alpha times the dropout
        multiplier). For gatv2, ``grad_att[i]`` is target i's share of the gradient of the
        attention vector, ``sum_j dL/ds_ij * scale * LeakyReLU(q_i + k_j)``. The edge terms'
        gradients belong to one edge each and are written in edge order: ``grad_ev[e] =
        weight_e * grad_out_i``, then ``grad_ek[e]`` (zeros before) gains edge e's share of
        ``grad_q``'s sum with ``q_i`` in place of the key (dot) or the same share (gatv2). With
        one tensor as both terms, ``grad_ev`` is ``grad_ek`` and gets their sum.
        """
        score = fixed_score  # (one name per assignment: numba then prunes the
        has_bias = fixed_bias  # branches on these where they are constants)
        has_ek = fixed_ek
        has_ev = fixed_ev
        has_cap = fixed_cap  # a constant in every variant (see _kernel_flags)
        if fixed_score == RUN_TIME:
            score, has_bias, has_ek, has_ev, _ = flags
        H = heads if heads else lse.shape[1]
        Cq = qk_channels if qk_channels else q.shape[1] // H
        C = v_channels if v_channels else v.shape[1] // H
        num_edges = src.shape[0]
        delta = np.empty(H, dtype=out.dtype)
        state = _mask_state(mask)  # a seeded mask's parameters, read once
        most = _max_degree(rowptr, first, last)
        alphas = np.empty((most, H), dtype=out.dtype)  # a target's scores, then its weights
        slopes = np.empty((most, H), dtype=out.dtype)  # ds/d(pre-activation) of its edges
        factor = np.empty(H * Cq, dtype=out.dtype)  # the edge's d_pre, repeated per channel
        acc = np.empty(H * Cq, dtype=out.dtype)
        acc_att = np.empty(H * Cq, dtype=out.dtype)
        acc_blocks = np.empty(H * Cq, dtype=np.float64)  # sums of acc over full SUM_BLOCKs
        att_blocks = np.empty(H * Cq, dtype=np.float64)  # and of acc_att
        for i in range(first, last):
            start, stop = rowptr[i], rowptr[i + 1]
            _target_scores(q, k, att, bias, ek, rowptr, perm, src, i, H, Cq, scale, slope, score,
                           has_bias, has_ek, cap, has_cap, alphas, delta, slopes, True)
            degree = stop - start
            for p in range(degree):
                for h in range(H):
                    alphas[p, h] = (alphas[p, h] - lse[i, h, 0]) - lse[i, h, 1]
            flat = alphas.reshape(-1)
            for t in range(degree * H):  # one loop over all heads: vectorised for any H
                flat[t] = _exp(flat[t])
            for h in range(H):
                delta[h] = _dot(grad_out, i, out, i, h * C, C)
            if has_grad_alpha:
                for h in range(H):
                    extra = 0.0  # float64, as the other sums over a row's edges
                    for p in range(start, stop):
                        extra += alphas[p - start, h] * grad_alpha[perm[p], h]
                    delta[h] += extra
            acc[:] = 0
            acc_att[:] = 0
            for block in range(start, stop, SUM_BLOCK):
                for p in range(block, min(block + SUM_BLOCK, stop)):
                    if p + PREFETCH_DISTANCE < num_edges:
                        _prefetch_row(v, src[p + PREFETCH_DISTANCE])
                        if has_mask:
                            _prefetch_mask(mask, perm[p + PREFETCH_DISTANCE])
                        _prefetch_row_for_write(grad_key, csc_position[p + PREFETCH_DISTANCE])
                        _prefetch_row_for_write(weight, csc_position[p + PREFETCH_DISTANCE])
                    j, e, t = src[p], perm[p], csc_position[p]
                    for h in range(H):
                        a = alphas[p - start, h]
                        d_alpha = _dot(grad_out, i, v, j, h * C, C)
                        if has_ev:
                            d_alpha += _dot(grad_out, i, ev, e, h * C, C)
                        if has_mask:
                            m = _mask_multiplier(mask, state, e, h, H)
                            d_alpha *= m
                            weight[t, h] = a * m
                        else:
                            weight[t, h] = a
                        if has_ev:
                            for x in range(C):
                                grad_ev[e, h * C + x] = weight[t, h] * grad_out[i, h * C + x]
                        if has_grad_alpha:
                            d_alpha += grad_alpha[e, h]
                        d_score = a * (d_alpha - delta[h])  # dL/ds
                        # dL/d(q.k) for "dot" (s = scale q.k + b), dL/d(q + k + b) for "additive",
                        # dL/d(a . LeakyReLU(q + k)) for "gatv2"
                        d_pre = slopes[p - start, h] * d_score
                        grad_key[t, h] = d_pre
                        if has_bias:
                            grad_bias[e, h] = d_pre if score == ADDITIVE else d_score
                        for x in range(Cq):
                            factor[h * Cq + x] = d_pre
                    if score == ADDITIVE:
                        for x in range(H):
                            acc[x] += factor[x]
                    elif score == GATV2 and has_ek:  # z = q_i + k_j + ek_e; d/d ek_e = d/d q_i
                        for x in range(H * Cq):
                            z = q[i, x] + (k[j, x] + ek[e, x])
                            g = _leaky_relu(z, slope, factor[x] * att[x])
                            grad_ek[e, x] += g
                            acc[x] += g
                            acc_att[x] += factor[x] * _leaky_relu(z, slope, z)
                    elif score == GATV2:  # d/dz of a . LeakyReLU(z) is a, or a * slope for z <= 0
                        for x in range(H * Cq):
                            z = q[i, x] + k[j, x]
                            acc[x] += _leaky_relu(z, slope, factor[x] * att[x])
                            acc_att[x] += factor[x] * _leaky_relu(z, slope, z)
                    elif has_ek:  # the key of the edge is k_j + ek_e, and d/d ek_e = d/d k_j
                        for x in range(H * Cq):
                            acc[x] += factor[x] * (k[j, x] + ek[e, x])
                            grad_ek[e, x] += factor[x] * q[i, x]
                    else:
                        for x in range(H * Cq):
                            acc[x] += factor[x] * k[j, x]
                if block + SUM_BLOCK < stop:
                    _add_block(acc_blocks, acc, block == start)
                    if score == GATV2:
                        _add_block(att_blocks, acc_att, block == start)
            if degree > SUM_BLOCK:
                for x in range(H * Cq):
                    grad_q[i, x] = acc_blocks[x] + acc[x]
                if score == GATV2:
                    for x in range(H * Cq):
                        grad_att[i, x] = att_blocks[x] + acc_att[x]
            else:
                for x in range(H * Cq):
                    grad_q[i, x] = acc[x]
                if score == GATV2:
                    for x in range(H * Cq):
                        grad_att[i, x] = acc_att[x]
    return kernel


@functools.cache
def _backward_source_kernel(fixed_score: int, fixed_ek: bool, qk_channels: int,
                            v_channels: int, heads: int = 0):
    """The source pass of backward compiled for this score and key edge term (``fixed_score``
    RUN_TIME: the kernel's ``flags`` instead), these channel counts and head count (0: read at
    run time).

    With both channel counts constant (see ``_source_channels``) each edge's two factors are
    spread over a whole ``H * C`` row and the sums run over the row at once; otherwise they
    run head by head straight into the output rows, which is faster for wide heads.
    """

    @_jit()
    def kernel(q, k, att, ek, slope, grad_out, colptr, target, csc_edge, grad_key, weight,
               grad_k, grad_v, flags, first, last):
        """Sources ``first..last-1``: ``grad_k`` and ``grad_v`` summed over their out-edges
        (gatv2 with ``has_ek``: the edge's key term from ``ek[csc_edge[t]]``)."""
        score = fixed_score  # (one name per assignment: see _forward_kernel)
        has_ek = fixed_ek
        if fixed_score == RUN_TIME:
            score, has_ek = flags
        H = heads if heads else grad_key.shape[1]
        Cq = qk_channels if qk_channels else grad_k.shape[1] // H
        C = v_channels if v_channels else grad_v.shape[1] // H
        num_edges = target.shape[0]
        key_factor = np.empty(H * Cq, dtype=grad_k.dtype)
        value_factor = np.empty(H * C, dtype=grad_v.dtype)
        key_blocks = np.empty(grad_k.shape[1], dtype=np.float64)  # sums over full SUM_BLOCKs
        value_blocks = np.empty(grad_v.shape[1], dtype=np.float64)
        q3 = q.reshape((q.shape[0], H, Cq))
        k3 = k.reshape((k.shape[0], H, Cq))
        ek3 = ek.reshape((ek.shape[0], H, Cq))
        grad_k3 = grad_k.reshape((grad_k.shape[0], H, Cq))
        grad_out3 = grad_out.reshape((grad_out.shape[0], H, C))
        grad_v3 = grad_v.reshape((grad_v.shape[0], H, C))
        for j in range(first, last):
            grad_k[j] = 0
            grad_v[j] = 0
            start, stop = colptr[j], colptr[j + 1]
            for block in range(start, stop, SUM_BLOCK):
                for t in range(block, min(block + SUM_BLOCK, stop)):
                    if t + PREFETCH_DISTANCE < num_edges:
                        if score != ADDITIVE:
                            _prefetch_row(q, target[t + PREFETCH_DISTANCE])
                        if score == GATV2 and has_ek:
                            _prefetch_row(ek, csc_edge[t + PREFETCH_DISTANCE])
                        _prefetch_row(grad_out, target[t + PREFETCH_DISTANCE])
                    i = target[t]
                    if qk_channels and v_channels:
                        for h in range(H):
                            g, w = grad_key[t, h], weight[t, h]
                            for x in range(Cq):
                                key_factor[h * Cq + x] = g
                            for x in range(C):
                                value_factor[h * C + x] = w
                        if score == ADDITIVE:
                            for x in range(H):
                                grad_k[j, x] += key_factor[x]
                        elif score == GATV2 and has_ek:
                            e = csc_edge[t]
                            for x in range(H * Cq):
                                z = q[i, x] + (k[j, x] + ek[e, x])
                                grad_k[j, x] += _leaky_relu(z, slope, key_factor[x] * att[x])
                        elif score == GATV2:
                            for x in range(H * Cq):
                                z = q[i, x] + k[j, x]
                                grad_k[j, x] += _leaky_relu(z, slope, key_factor[x] * att[x])
                        else:
                            for x in range(H * Cq):
                                grad_k[j, x] += key_factor[x] * q[i, x]
                        for x in range(H * C):
                            grad_v[j, x] += value_factor[x] * grad_out[i, x]
                    else:  # (N, H, C) views: the compiler vectorises these loops with them
                        for h in range(H):
                            g, w = grad_key[t, h], weight[t, h]
                            if score == ADDITIVE:
                                grad_k[j, h] += g
                            elif score == GATV2 and has_ek:
                                e = csc_edge[t]
                                for x in range(Cq):
                                    z = q3[i, h, x] + (k3[j, h, x] + ek3[e, h, x])
                                    grad_k3[j, h, x] += _leaky_relu(z, slope, g * att[h * Cq + x])
                            elif score == GATV2:
                                for x in range(Cq):
                                    z = q3[i, h, x] + k3[j, h, x]
                                    grad_k3[j, h, x] += _leaky_relu(z, slope, g * att[h * Cq + x])
                            else:
                                for x in range(Cq):
                                    grad_k3[j, h, x] += g * q3[i, h, x]
                            for x in range(C):
                                grad_v3[j, h, x] += w * grad_out3[i, h, x]
                if block + SUM_BLOCK < stop:
                    _add_block(key_blocks, grad_k[j], block == start)
                    _add_block(value_blocks, grad_v[j], block == start)
            if stop - start > SUM_BLOCK:
                for x in range(grad_k.shape[1]):
                    grad_k[j, x] += key_blocks[x]
                for x in range(grad_v.shape[1]):
                    grad_v[j, x] += value_blocks[x]
    return kernel


def _source_channels(qk_channels: int, v_channels: int) -> tuple[int, int]:
    """The channel counts the source pass is compiled for: constants up to 8, else run time.

    Wider heads run faster through the loops of a run-time count over ``(N, H, C)`` views
    (1.3x at 32 channels on PubMed) than through constant counts.
    """
    if 0 < v_channels <= 8 and 0 < qk_channels <= 8:
        return qk_channels, v_channels
    return 0, 0


def _balanced_chunks(ptr: np.ndarray, parts: int) -> np.ndarray:
    """Row boundaries that split ``rows + edges`` into at most ``parts`` chunks of equal work."""
    rows = ptr.shape[0] - 1
    work = ptr + np.arange(rows + 1)  # (rows + 1,) work done before each row
    bounds = np.searchsorted(work, np.linspace(0, work[-1], parts + 1)).astype(np.int64)
    bounds[0], bounds[-1] = 0, rows
    return np.unique(bounds)


_pools: dict[int, ThreadPoolExecutor] = {}  # thread count -> pool
_pools_lock = threading.Lock()
os.register_at_fork(after_in_child=_pools.clear)  # a forked child has none of the threads


# numba labels the blocks of the IR it builds from one process-wide counter, and each helper
# inlined into a kernel raises it to about twice its value: a kernel variant compiled adds 4
# to 7 digits. Past about 1000 digits the block names pass LLVM's limit of 1024 characters and
# every compile fails ("unable to create block named 'B...'"), after some 200 variants in one
# process. Labels need only be unique within one function's IR, and inlining offsets a
# callee's labels past its caller's, so the counter may start again between compiles.
LABEL_LIMIT = 10**100


def _bound_block_labels() -> None:
    """Start numba's block-label counter again when it is past :data:`LABEL_LIMIT`."""
    counter = getattr(ir_utils, "_the_max_label", None)
    if getattr(counter, "_value", 0) > LABEL_LIMIT:
        with global_compiler_lock:  # no compile runs in any thread meanwhile
            counter._value = 0


def _run_rows(kernel, ptr: np.ndarray, *args) -> None:
    """Run ``kernel(*args, first, last)`` over all rows of ``ptr``, on torch's thread count.

    The rows are cut into chunks of equal work that the threads of a pool take in turn (the
    kernels release the GIL); every row is computed by one call in the same way whatever the
    chunking, so the result does not depend on the number of threads.
    """
    _bound_block_labels()
    threads = torch.get_num_threads()
    work = ptr[-1] + ptr.shape[0]
    if threads == 1 or work < MIN_PARALLEL_WORK:
        kernel(*args, 0, ptr.shape[0] - 1)
        return
    _run_chunks(kernel, _balanced_chunks(ptr, CHUNKS_PER_THREAD * threads), threads, *args)


def _run_chunks(kernel, bounds: np.ndarray, threads: int, *args) -> None:
    """Run ``kernel(*args, first, last)`` for each pair of consecutive ``bounds`` on a pool of
    ``threads`` threads, and wait for all."""
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="graphattn-cpu")
        pool = _pools[threads]
    jobs = [pool.submit(kernel, *args, first, last)
            for first, last in zip(bounds[:-1], bounds[1:], strict=True)]
    for job in jobs:
        job.result()


# The integer type whose bits a dropout mask of each float type is written in.
_MASK_BITS = {torch.float64: torch.int64, torch.float32: torch.int32,
              torch.float16: torch.int16, torch.bfloat16: torch.int16}
MASK_DTYPES = frozenset(_MASK_BITS)


def dropout_mask_from_seed(seed: int, shape: Sequence[int], p: float,
                           dtype: torch.dtype) -> Tensor:
    r"""The dropout mask of :func:`graphattn.functional.dropout_mask` on CPU, drawn from ``seed``
    (in ``[0, 2^63)``): entry ``i`` of the flat mask is 0 when the 32 high bits :math:`u_i` of
    output ``i + 1`` of SplitMix64 seeded with ``seed`` are below
    :math:`t = \lceil p \cdot 2^{32} \rceil`, else :math:`1 / (1 - p)` rounded to ``dtype``.
    An entry is dropped with probability :math:`t / 2^{32} \in [p, p + 2^{-32})`.

    The entries are written straight in ``dtype``'s bits, by the threads of torch's thread
    count for large masks; each entry depends on ``seed`` and its index only, so the mask is
    the same for any number of threads and for every ``dtype`` (up to its value).
    """
    # p * 2^32 is exact in float64, and below 2^32 for p < 1
    return seeded_mask(seed, math.ceil(p * 2.0**32), 1.0 / (1.0 - p), shape, dtype)


def seeded_mask(seed: int, threshold: int, kept: float, shape: Sequence[int],
                dtype: torch.dtype) -> Tensor:
    """The mask of :func:`dropout_mask_from_seed` given its threshold :math:`t` and the value
    ``kept`` of its kept entries (rounded to ``dtype``) instead of p."""
    mask = torch.empty(tuple(shape), dtype=dtype)
    flat = mask.view(-1).view(_MASK_BITS[dtype]).numpy()
    bits = torch.tensor(kept, dtype=dtype).view(_MASK_BITS[dtype]).item()
    args = (flat, np.uint64(seed), np.uint64(threshold), flat.dtype.type(bits))
    _bound_block_labels()  # (the kernel inlines a helper)
    threads, n = torch.get_num_threads(), flat.shape[0]
    if threads == 1 or n < MIN_PARALLEL_MASK:
        _dropout_bits(*args, 0, n)
    else:
        _run_chunks(_dropout_bits, np.linspace(0, n, threads + 1).astype(np.int64), threads,
                    *args)
    return mask


def seeded_mask_from(parameters: Tensor, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """The CPU mask that a seeded mask's int64 ``parameters`` ``[3]`` stand for (seed,
    threshold, fp32 bits of the kept multiplier;
    :func:`graphattn.functional.dropout.seeded_mask_parameters`), written by
    :func:`seeded_mask`."""
    seed, threshold, kept_bits = parameters.tolist()
    kept = float(np.array(kept_bits, dtype=np.int64).astype(np.int32).view(np.float32))
    return seeded_mask(seed, threshold, kept, shape, dtype)


def _as_mask(dropout_mask: Tensor | None, num_edges: int, heads: int,
             dtype: torch.dtype) -> Tensor | None:
    """The dropout argument as a mask ``[E, H]``: a seeded mask's parameters written out (for
    the paths in plain torch ops), a mask as it is."""
    if dropout_mask is None or dropout_mask.dtype != torch.int64:
        return dropout_mask
    return seeded_mask_from(dropout_mask, (num_edges, heads), dtype)


def _np(t: Tensor) -> np.ndarray:
    return t.detach().numpy()


def csr_transpose(crow: Tensor, col: Tensor, num_cols: int) -> tuple[Tensor, Tensor, Tensor]:
    """The structure of the transpose of a CSR matrix ``[N, num_cols]`` (CPU index tensors of
    one integer type), by a counting sort in one pass over its entries: ``colptr
    [num_cols + 1]``, the position in the transpose of each entry, and the row of each entry
    of the transpose (ascending within each column, as a stable sort leaves them)."""
    colptr, position, row = _csc(_np(crow), _np(col), num_cols)
    return torch.from_numpy(colptr), torch.from_numpy(position), torch.from_numpy(row)


def _rows(t: Tensor) -> np.ndarray:
    """A contiguous ``[N, H, C]`` (or ``[N, H]``) tensor as the ``[N, H * C]`` array of a kernel."""
    return t.detach().view(t.size(0), t.shape[1:].numel()).numpy()  # also for N = 0


def _kernel_heads(v: Tensor) -> int:
    """The head count the kernels are compiled for: ``H`` when in ``SPECIALISED_HEADS`` (one
    head), else 0 (read at run time).

    With one head every per-head loop runs once per edge; with the count a constant the
    compiler drops those loops.
    """
    heads = v.size(1)
    return heads if heads in SPECIALISED_HEADS else 0


def _kernel_flags(score: int, *flags: bool, cap: bool | None = None) -> tuple:
    """The flags the kernels are compiled for: ``score`` and ``flags`` (whether there is a
    bias, a key edge term, a value edge term) as they are, or with ``SPECIALISED_FLAGS`` off
    ``RUN_TIME`` and no flag, the one variant that reads them at run time; then ``cap`` (the
    forward and target kernels), a constant in both: a test of it at run time, between the
    score calls and the end of their loop, would keep numba's reference counts of the arrays
    those calls take (see ``_target_scores``), on every edge and head."""
    cap_flag = () if cap is None else (cap,)
    if SPECIALISED_FLAGS:
        return (score, *flags, *cap_flag)
    return (RUN_TIME, *(False for _ in flags), *cap_flag)


def _kernel_channels(q: Tensor, v: Tensor) -> tuple[int, int]:
    """The (score, value) channel counts the kernels are compiled for."""
    return _channels(q.size(2)), _channels(v.size(2))


# What the kernels take for "no dropout mask" in float32, where edge_attention's dropout passes a
# seeded mask's parameters (int64 [3]): a placeholder of that type, so that training with dropout
# and evaluating without run one compiled kernel instead of two (one per type of mask argument).
# (fp16 and bf16 inputs, computed in float32, take written masks [E, H]: with dropout they run
# a kernel of their own.)
_NO_SEEDED_MASK = np.zeros(3, dtype=np.int64)


def _mask_argument(dropout_mask: Tensor | None, none: np.ndarray) -> np.ndarray:
    """The kernels' dropout argument: the mask ``[E, H]`` or a seeded mask's parameters ``[3]``
    as given; for no mask (``has_mask`` false) a placeholder of the type dropout takes in the
    dtype of ``none``, the ``[1, H]`` placeholder of that dtype."""
    if dropout_mask is not None:
        return _np(dropout_mask)
    return _NO_SEEDED_MASK if none.dtype == np.float32 else none


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, att: Tensor | None, bias: Tensor | None,
                  dropout_mask: Tensor | None, edge_key: Tensor | None,
                  edge_value: Tensor | None, sinks: Tensor | None, edge_index: Tensor,
                  scale: float, negative_slope: float, softcap: float, score: int,
                  need_alpha: bool, value_is_key: bool,
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward kernel: ``out, alpha, lse`` and the CSR order ``rowptr, perm, src`` for backward
    (``value_is_key``: ``edge_key`` is the value term too, and ``edge_value`` is ``None``;
    ``softcap`` 0: no cap; ``sinks`` ``[H]``, in the dtype of v: see
    :func:`~graphattn.functional.sinks.sink_grad`)."""
    if value_is_key:
        edge_value = edge_key
    n_dst, H, C = q.size(0), v.size(1), v.size(2)
    real = _np(v).dtype.type  # the kernels compute in the dtype of their inputs
    none = np.zeros((1, H), dtype=real)  # stands in for an absent bias, mask or edge term
    rowptr, perm, src = _csr(_np(edge_index[0]), _np(edge_index[1]), n_dst)
    out = torch.empty(n_dst, H, C, dtype=v.dtype)
    lse = torch.empty(n_dst, H, 2, dtype=v.dtype)  # (max, log sum exp(s - max)) per target
    alpha = torch.empty(edge_index.size(1) if need_alpha else 0, H, dtype=v.dtype)
    flags = score, bias is not None, edge_key is not None, edge_value is not None, softcap > 0
    kernel = _forward_kernel(*_kernel_flags(*flags[:-1], cap=flags[-1]),
                             *_kernel_channels(q, v), _kernel_heads(v))
    _run_rows(kernel, rowptr, _rows(q), _rows(k), _rows(v),
              none[0] if att is None else _np(att).reshape(-1),
              none if bias is None else _np(bias),
              _mask_argument(dropout_mask, none),
              none if edge_key is None else _rows(edge_key),
              none if edge_value is None else _rows(edge_value), rowptr, perm, src,
              real(scale), real(negative_slope), real(softcap), _rows(out), lse.numpy(),
              alpha.numpy(), flags, dropout_mask is not None, need_alpha,
              none[0] if sinks is None else _np(sinks), sinks is not None)
    return (out, alpha, lse, torch.from_numpy(rowptr), torch.from_numpy(perm),
            torch.from_numpy(src))


def _forward_fake(q, k, v, att, bias, dropout_mask, edge_key, edge_value, sinks, edge_index,
                  scale, negative_slope, softcap, score, need_alpha, value_is_key):
    n_dst, H, C = q.size(0), v.size(1), v.size(2)
    E = edge_index.size(1)
    return (v.new_empty(n_dst, H, C), v.new_empty(E if need_alpha else 0, H),
            v.new_empty(n_dst, H, 2), edge_index.new_empty(n_dst + 1), edge_index.new_empty(E),
            edge_index.new_empty(E))


def _backward_impl(grad_out: Tensor, grad_alpha: Tensor | None, q: Tensor, k: Tensor,
                   v: Tensor, att: Tensor | None, bias: Tensor | None,
                   dropout_mask: Tensor | None, edge_key: Tensor | None,
                   edge_value: Tensor | None, out: Tensor, lse: Tensor, rowptr: Tensor,
                   perm: Tensor, src: Tensor, scale: float, negative_slope: float,
                   softcap: float, score: int, need_grad_kv: bool, value_is_key: bool,
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward kernels: ``dq, dk, dv, datt, dbias, d edge_key, d edge_value`` (``dk, dv`` empty
    unless ``need_grad_kv``; ``datt``, ``dbias`` and the edge terms' empty without them; with
    ``value_is_key``, ``d edge_key`` holds the gradient of both terms)."""
    real = _np(v).dtype.type
    none = np.zeros((1, v.size(1)), dtype=real)
    rowptr, perm, src = _np(rowptr), _np(perm), _np(src)
    has_grad_alpha = grad_alpha is not None and grad_alpha.numel() > 0
    grad_q = torch.empty_like(q)
    grad_bias = q.new_empty(0) if bias is None else torch.empty_like(bias)  # (0,): not asked
    grad_ek = q.new_empty(0) if edge_key is None else torch.zeros_like(edge_key)  # (E, H, C)
    grad_ev = q.new_empty(0) if edge_value is None else torch.empty_like(edge_value)
    has_ev = edge_value is not None or value_is_key
    ev = _rows(edge_key if value_is_key else edge_value) if has_ev else none
    grad_ev_rows = _rows(grad_ek if value_is_key else grad_ev) if has_ev else none
    # gatv2: each target's share of d att, (N_dst, H * C), summed below
    att_shares = np.empty((q.size(0), q.shape[1:].numel()) if att is not None else (1, 1),
                          dtype=real)
    colptr, csc_position, target = _csc(rowptr, src, k.size(0))
    grad_key = torch.empty(perm.shape[0], v.size(1), dtype=v.dtype)  # (E, H) CSC order
    weight = torch.empty(perm.shape[0], v.size(1), dtype=v.dtype)  # (E, H) CSC order
    channels = _kernel_channels(q, v)
    att_row = none[0] if att is None else _np(att).reshape(-1)  # (H * C,)
    flags = score, bias is not None, edge_key is not None, has_ev, softcap > 0
    kernel = _backward_target_kernel(*_kernel_flags(*flags[:-1], cap=flags[-1]), *channels,
                                     _kernel_heads(v))
    # (E, H * C); the source pass views it per head, so a placeholder needs H * C columns too
    ek = np.zeros((1, q.shape[1:].numel()), dtype=real) if edge_key is None else _rows(edge_key)
    _run_rows(kernel, rowptr, _rows(q), _rows(k), _rows(v), att_row,
              none if bias is None else _np(bias),
              _mask_argument(dropout_mask, none), ek, ev, _rows(out),
              _rows(grad_out), _np(grad_alpha) if has_grad_alpha else none,
              _np(lse), rowptr, perm, src, csc_position, real(scale), real(negative_slope),
              real(softcap), _rows(grad_q), att_shares, none if bias is None else grad_bias.numpy(),
              grad_key.numpy(), weight.numpy(), none if edge_key is None else _rows(grad_ek),
              grad_ev_rows, flags, dropout_mask is not None, has_grad_alpha)
    grad_att = q.new_empty(0)
    if att is not None:  # numpy sums the rows in order: the same bits for any thread count
        grad_att = torch.from_numpy(att_shares.sum(axis=0)).view_as(att)
    grad_k, grad_v = q.new_empty(0), q.new_empty(0)  # (0,) unless asked for
    if need_grad_kv:
        grad_k, grad_v = torch.empty_like(k), torch.empty_like(v)
        has_ek = edge_key is not None and score == GATV2  # only gatv2's dk reads the key term
        csc_edge = np.empty_like(perm)  # CSC position -> edge id (gatv2 with a key term)
        if has_ek:
            csc_edge[csc_position] = perm
        kernel = _backward_source_kernel(*_kernel_flags(score, has_ek),
                                         *_source_channels(*channels), _kernel_heads(v))
        _run_rows(kernel, colptr, _rows(q), _rows(k), att_row, ek, real(negative_slope),
                  _rows(grad_out), colptr, target, csc_edge, grad_key.numpy(), weight.numpy(),
                  _rows(grad_k), _rows(grad_v), (score, has_ek))
    return grad_q, grad_k, grad_v, grad_att, grad_bias, grad_ek, grad_ev


def _backward_fake(grad_out, grad_alpha, q, k, v, att, bias, dropout_mask, edge_key, edge_value,
                   out, lse, rowptr, perm, src, scale, negative_slope, softcap, score,
                   need_grad_kv, value_is_key):
    return (torch.empty_like(q), torch.empty_like(k) if need_grad_kv else q.new_empty(0),
            torch.empty_like(v) if need_grad_kv else q.new_empty(0),
            q.new_empty(0) if att is None else torch.empty_like(att),
            q.new_empty(0) if bias is None else torch.empty_like(bias),
            q.new_empty(0) if edge_key is None else torch.empty_like(edge_key),
            q.new_empty(0) if edge_value is None else torch.empty_like(edge_value))


# As torch operators (with their output shapes) the kernels are single opaque calls to
# torch.compile instead of numba code to trace into. Eager autograd goes through
# _EdgeAttentionCPU instead: the operators' dispatch costs 0.1-0.3 ms per forward and backward.
_forward_op = torch.library.custom_op("graphattn::cpu_edge_attention", _forward_impl,
                                      mutates_args=())
_forward_op.register_fake(_forward_fake)
_backward_op = torch.library.custom_op("graphattn::cpu_edge_attention_backward",
                                       _backward_impl, mutates_args=())
_backward_op.register_fake(_backward_fake)


def _setup_context(ctx, inputs, output) -> None:
    (q, k, v, att, bias, dropout_mask, edge_key, edge_value, sinks, _, scale, negative_slope,
     softcap, score, need_alpha, value_is_key) = inputs
    out, alpha, lse, rowptr, perm, src = output
    # the weights, for the sinks' gradient when they get one of their own
    weights = alpha if sinks is not None and need_alpha else None
    ctx.save_for_backward(*saveable(q, k, v, att, bias, dropout_mask, edge_key, edge_value),
                          out, lse, rowptr, perm, src, *saveable(sinks), weights)
    ctx.set_materialize_grads(False)  # an unused alpha gets no gradient pass
    ctx.options = (scale, negative_slope, softcap, score)
    ctx.value_is_key = value_is_key
    ctx.mark_non_differentiable(lse, rowptr, perm, src)
    if not need_alpha:
        ctx.mark_non_differentiable(alpha)


def _grads(ctx, grad_out: Tensor | None, grad_alpha: Tensor | None, backward) -> tuple:
    """The inputs' gradients, from ``backward`` (:func:`_backward_impl` or its operator)."""
    (q, k, v, att, bias, dropout_mask, edge_key, edge_value, out, lse, rowptr, perm,
     src, sinks, weights) = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if grad_alpha is not None:
        grad_alpha = grad_alpha.contiguous()
    need_grad_kv = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    grad_q, grad_k, grad_v, grad_att, grad_bias, grad_ek, grad_ev = backward(
        grad_out.contiguous(), grad_alpha, q, k, v, att, bias, dropout_mask, edge_key,
        edge_value, out, lse, rowptr, perm, src, *ctx.options, need_grad_kv, ctx.value_is_key)
    if not need_grad_kv:
        grad_k = grad_v = None
    grad_sinks = None
    if sinks is not None and ctx.needs_input_grad[8]:
        has_grad_alpha = grad_alpha is not None and grad_alpha.numel() > 0
        grad_sinks = sink_grad(sinks, out, lse, grad_out, grad_alpha if has_grad_alpha else None,
                               weights, _csr_targets(rowptr, perm) if has_grad_alpha else None)
    return (grad_q, grad_k, grad_v, None if att is None else grad_att,
            None if bias is None else grad_bias, None, None if edge_key is None else grad_ek,
            None if edge_value is None else grad_ev, grad_sinks, None, None, None, None, None,
            None, None)


_forward_op.register_autograd(
    lambda ctx, grad_out, grad_alpha, *_: _grads(ctx, grad_out, grad_alpha, _backward_op),
    setup_context=_setup_context)


def _differentiable_grads(ctx, grad_out: Tensor | None, grad_alpha: Tensor | None) -> tuple:
    """The inputs' gradients as :func:`~graphattn.functional.reference.reference_grads`
    computes them, for backward under ``create_graph=True``; the edges are given back in their
    original order (``perm`` maps CSR positions to edge ids)."""
    (q, k, v, att, bias, dropout_mask, edge_key, edge_value, _, _, rowptr, perm,
     src, sinks, _) = ctx.saved_tensors
    scale, negative_slope, softcap, score = ctx.options
    edge_index = torch.empty(2, perm.numel(), dtype=torch.int64)
    edge_index[0, perm] = src.long()
    edge_index[1] = _csr_targets(rowptr, perm)
    if ctx.value_is_key:
        edge_value = edge_key
    needs = [ctx.needs_input_grad[i] for i in (0, 1, 2, 3, 4, 6, 7, 8)]
    grads = reference_grads(grad_out, grad_alpha, q, k, v, edge_index, scale=scale, bias=bias,
                            dropout_mask=_as_mask(dropout_mask, perm.numel(), v.size(1),
                                                  v.dtype),
                            score=SCORE_NAMES[score],
                            negative_slope=negative_slope, att=att, edge_key=edge_key,
                            edge_value=edge_value, needs_grad=needs,
                            softcap=softcap if softcap > 0 else None, sinks=sinks)
    grad_q, grad_k, grad_v, grad_att, grad_bias, grad_ek, grad_ev, grad_sinks = grads
    return (grad_q, grad_k, grad_v, grad_att, grad_bias, None, grad_ek, grad_ev, grad_sinks,
            None, None, None, None, None, None, None)


def _csr_targets(rowptr: Tensor, perm: Tensor) -> Tensor:
    """The target of each edge ``[E]`` (int64, in edge order) from the CSR ``rowptr`` and the
    edge id ``perm`` at each CSR position."""
    degree = rowptr[1:] - rowptr[:-1]  # (N_dst,)
    targets = torch.empty(perm.numel(), dtype=torch.int64)
    # (output_size: a size known before the data, which torch.compile's tracers need)
    targets[perm] = torch.repeat_interleave(torch.arange(degree.numel()), degree,
                                            output_size=perm.numel())
    return targets


# The kernels as eager code calls them, out of dynamo's reach: should torch.compile cut a graph
# around an eager call, dynamo would otherwise trace the frames that call, numba's dispatcher
# among them (where it fails inside its own code). Costs 0.3 us a call.
_eager_forward = torch.compiler.disable(_forward_impl)
_eager_backward = torch.compiler.disable(_backward_impl)


class _EdgeAttentionCPU(torch.autograd.Function):
    """Eager autograd over the kernels: what the operators compute, without their dispatch."""

    @staticmethod
    def forward(*inputs):
        return _eager_forward(*inputs)

    # apart from forward, as torch.func needs (edge_attention itself takes the reference path
    # under torch.func's transforms)
    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, grad_out, grad_alpha, *_):
        # create_graph=True, or a forward-mode dual cotangent (whose tangent the kernels would
        # drop): gradients in plain ops, which autograd can differentiate
        if torch.is_grad_enabled() or plain_ops_only(grad_out, grad_alpha):
            return _differentiable_grads(ctx, grad_out, grad_alpha)
        return _grads(ctx, grad_out, grad_alpha, _eager_backward)


def check_cpu_inputs(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor) -> None:
    """Raise unless q, k, v and edge_index are CPU tensors: what :func:`cpu_edge_attention`
    refuses, refused too where it gives way to the reference path (under ``torch.func``)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("edge_index", edge_index)):
        if t.device.type != "cpu":
            raise ValueError(f"the cpu backend needs CPU tensors, got {name} on {t.device}")


def cpu_edge_attention(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *, scale: float,
                       bias: Tensor | None, dropout_mask: Tensor | None, score: str,
                       negative_slope: float, need_alpha: bool, att: Tensor | None = None,
                       edge_key: Tensor | None = None, edge_value: Tensor | None = None,
                       softcap: float | None = None,
                       sinks: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    r"""Edge attention on CPU with fused kernels and O(E * H) memory for training.

    Computes the function of the reference backend (see
    :func:`~graphattn.functional.edge_attention` for the math) in one pass per target over its
    in-edges, sorted by target with a stable O(E) counting sort on every call. Autograd keeps
    ``q, k, v``, ``att``, ``bias``, the dropout mask, the output, a log-sum-exp per target and
    head, and the sort order (two int64 per edge); backward recomputes the scores and
    allocates ``[E, H]`` scratch only (and, for gatv2, ``[N_dst, H, C]`` for the gradient of
    ``att``). Results are the same bit for bit on every run. fp32 and fp64 are
    computed in their own dtype; fp16 and bf16 are computed in fp32 and returned in their own
    dtype. Sums over a node's edges (the output and softmax denominator of a target, the
    gradients of ``q`` and of a source's ``k`` and ``v``) run in blocks of ``SUM_BLOCK`` (128)
    edges added in float64, so a node of 10^6 edges in fp32 rounds like one of 128: 6e-8
    relative error in its output, against 1.6e-5 for one running fp32 sum. Gradients of
    gradients (``create_graph=True``) are those of the reference backend, recomputed with its
    ``[E, H, C]`` tensors.

    Args:
        q (Tensor): ``[N_dst, H, C]`` (``[N_dst, H]`` when ``score="additive"``).
        k (Tensor): ``[N_src, H, C]`` (``[N_src, H]`` when ``score="additive"``).
        v (Tensor): ``[N_src, H, C]``.
        edge_index (Tensor): ``[2, E]`` int64, row 0 sources, row 1 targets, in any order.
        scale (float): score multiplier.
        bias (Tensor, optional): ``[E, H]`` score bias.
        dropout_mask (Tensor, optional): ``[E, H]`` multiplier of the attention weights, or,
            as int64, the parameters ``[3]`` of a seeded mask whose entries the kernels draw
            where they use them, in forward and again in backward
            (:func:`~graphattn.functional.dropout.seeded_mask_parameters`; what
            ``edge_attention`` passes for fp32 inputs): no ``[E, H]`` mask is stored or read.
        score (str): ``"dot"``, ``"additive"`` or ``"gatv2"``.
        negative_slope (float): LeakyReLU slope of the additive and gatv2 scores.
        need_alpha (bool): also return the attention weights.
        att (Tensor, optional): ``[H, C]`` attention vector of ``"gatv2"``.
        edge_key (Tensor, optional): ``[E, H, C]`` added to each edge's key (dot, gatv2).
        edge_value (Tensor, optional): ``[E, H, C]`` added to each edge's value.
        softcap (float, optional): the cap :math:`c` of the dot and gatv2 scores before their
            bias, :math:`c \tanh(s / c)`.
        sinks (Tensor, optional): ``[H]``, one more score of each head's softmax in every
            row, whose value is 0 (see :func:`~graphattn.functional.edge_attention`).

    Shapes:
        - **input:** q ``(N_dst, H, C)`` or ``(N_dst, H)``, k ``(N_src, H, C)`` or
          ``(N_src, H)``, v ``(N_src, H, C)``, edge_index ``(2, E)``, bias and dropout_mask
          ``(E, H)``, att ``(H, C)``, edge_key and edge_value ``(E, H, C)``, sinks ``(H)``
        - **output:** out ``(N_dst, H, C)``; alpha ``(E, H)`` (before dropout) or ``None``
    """
    check_cpu_inputs(q, k, v, edge_index)
    if v.size(1) == 0:  # no heads: empty results (the kernels would divide by H = 0)
        return reference_edge_attention(
            q, k, v, edge_index, scale=scale, bias=bias,
            dropout_mask=_as_mask(dropout_mask, edge_index.size(1), 0, v.dtype), score=score,
            negative_slope=negative_slope, need_alpha=need_alpha, att=att, edge_key=edge_key,
            edge_value=edge_value, softcap=softcap, sinks=sinks)
    dtype, channels = v.dtype, v.size(-1)
    work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
    # one tensor as both terms (TransformerConv's edge features): read once, one gradient
    value_is_key = edge_value is not None and edge_value is edge_key
    if value_is_key:
        edge_value = None
    if score == "additive":
        q, k = q.unsqueeze(-1), k.unsqueeze(-1)  # (N, H, 1)
    elif q.size(-1) == 0:  # the kernels read channel 0: an empty score is a zero channel's
        q, k = F.pad(q, (0, 1)), F.pad(k, (0, 1))  # (N, H, 1)
        if att is not None:
            att = F.pad(att, (0, 1))  # (H, 1)
        if edge_key is not None:
            edge_key = F.pad(edge_key, (0, 1))  # (E, H, 1)
    if channels == 0:
        v = F.pad(v, (0, 1))  # (N_src, H, 1); the extra output channel is cut off below
        if edge_value is not None:
            edge_value = F.pad(edge_value, (0, 1))  # (E, H, 1)
    q, k, v = (t.to(work).contiguous() for t in (q, k, v))
    att, bias, edge_key, edge_value, sinks = (None if t is None else t.to(work).contiguous()
                                              for t in (att, bias, edge_key, edge_value, sinks))
    if dropout_mask is not None and dropout_mask.dtype != torch.int64:  # (int64: parameters)
        dropout_mask = dropout_mask.to(work).contiguous()
    inputs = (q, k, v, att, bias, dropout_mask, edge_key, edge_value, sinks,
              edge_index.contiguous(),
              scale, negative_slope, 0.0 if softcap is None else softcap, SCORE_KINDS[score],
              need_alpha, value_is_key)
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        # an operator for the tracers (torch.jit.trace reads sizes as traced values, which
        # the kernels cannot take)
        out, alpha = _forward_op(*inputs)[:2]
    elif needs_grad(q, k, v, att, bias, edge_key, edge_value, sinks):
        out, alpha = apply_function(_EdgeAttentionCPU, *inputs)[:2]
    else:  # inference: no autograd node to record
        out, alpha = _eager_forward(*inputs)[:2]
    if channels == 0:
        out = out[..., :0]  # the padded channel (a slice would cost a copy in backward otherwise)
    return out.to(dtype), (alpha.to(dtype) if need_alpha else None)
