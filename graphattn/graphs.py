"""Attention patterns as graphs, and conversions to dense masks, sparse adjacencies and networkx.

Every self-attention variant is :func:`~graphattn.functional.edge_attention` on one of these
graphs: the complete graph is ordinary (transformer) attention, the causal graph masked decoder
attention, a window graph truncated attention, a grid graph image attention with a
convolution-sized receptive field. Sparse transformers combine such patterns: :func:`union` of a
window and :func:`global_token_graph` is Longformer's attention, with :func:`random_graph` added
BigBird's; :func:`head_patterns` gives each head a pattern of its own (a window in some,
:func:`strided_graph` in others: the Sparse Transformer's); :func:`top_k_edges` keeps each
target's best edges by a learned score (DeepSeek's sparse attention). :func:`locality_order` and
:func:`permute_nodes` renumber a graph so that the sparse kernels read nearby rows.

All builders return ``edge_index`` ``[2, E]`` int64 with row 0 the source j and row 1 the
target i (node i attends to node j), sorted by target and then by source, so
``to_dense_mask(edge_index, N)`` read row by row lists the edges in order.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import overload

import networkx as nx
import numpy as np
import scipy.sparse as sp
import torch
from scipy.sparse.csgraph import reverse_cuthill_mckee
from torch import Tensor

from graphattn._checks import (
    as_integer,
    check_batch,
    check_edge_index,
    check_flag,
    check_generator,
    check_non_negative,
    check_positive,
    check_same_device,
    check_tensors,
    dense_graph_ids,
    host_list,
)
from graphattn.functional import cpu
from graphattn.functional._transforms import host_readable


def _window_edges(n: int, offsets: Tensor) -> Tensor:
    """Edges ``i + d -> i`` for every target i and ascending offset d that stays in ``[0, n)``."""
    dst = torch.arange(n).repeat_interleave(offsets.numel())  # (n * D,)
    src = dst + offsets.repeat(n)  # (n * D,)
    keep = (src >= 0) & (src < n)
    return torch.stack([src[keep], dst[keep]])  # (2, E), sorted by target, then source


def complete_graph(n: int, self_loops: bool = True) -> Tensor:
    r"""Every node attends to every node: ordinary dense self-attention.

    .. math::
        \mathcal{E} = \{(j, i) : 0 \le i, j < n\} \quad (\text{without } j = i
        \text{ when } \texttt{self\_loops=False})

    Args:
        n (int): number of nodes (sequence length L).
        self_loops (bool, optional): include the edges ``i -> i``. (default: ``True``)

    Shapes:
        - **output:** edge_index ``(2, n^2)`` or ``(2, n^2 - n)``, int64
    """
    n = check_non_negative(n, "n")
    self_loops = check_flag(self_loops, "self_loops")
    dst = torch.arange(n).repeat_interleave(n)  # (n^2,)
    src = torch.arange(n).repeat(n)  # (n^2,)
    if not self_loops:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    return torch.stack([src, dst])


def batch_complete_graph(batch: Tensor, self_loops: bool = True) -> Tensor:
    r"""Every node attends to every node of its own graph: dense self-attention inside each
    graph of a mini-batch, without padding.

    ``batch`` assigns each node to a graph, as in PyG's ``Batch`` (``data.batch``). The result
    is the block-diagonal complete graph

    .. math::
        \mathcal{E} = \{(j, i) : \text{batch}_j = \text{batch}_i\} \quad (\text{without }
        j = i \text{ when } \texttt{self\_loops=False}),

    :math:`\sum_g n_g^2` edges for graphs of :math:`n_g` nodes, where padding every graph to
    the largest, :math:`n_{\max}` (``torch_geometric.utils.to_dense_batch``), computes
    :math:`B\, n_{\max}^2` scores. ``GraphSelfAttention`` on it is the global attention of a
    graph transformer; ``DenseSelfAttention`` on the padded batch with
    ``mask=node_mask.unsqueeze(1)`` computes the same on the real nodes. For one graph
    (``batch`` all zeros) it is :func:`complete_graph`. ``batch`` need not be sorted.

    Args:
        batch (Tensor): ``[N]`` integer, the graph of each node, values >= 0.
        self_loops (bool, optional): include the edges ``i -> i``. (default: ``True``)

    Shapes:
        - **input:** batch ``(N)``
        - **output:** edge_index ``(2, sum_g n_g^2)`` (``sum_g n_g (n_g - 1)`` without
          self-loops), int64, on the device of ``batch``, sorted by target, then source
    """
    check_batch(batch)
    self_loops = check_flag(self_loops, "self_loops")
    batch = dense_graph_ids(batch)  # ids below N: bincount's bins stay O(N)
    n = batch.numel()
    members = torch.sort(batch, stable=True).indices  # (N,): each graph's nodes, ascending
    sizes = torch.bincount(batch)  # (G,) nodes per graph
    first = sizes.cumsum(0) - sizes  # (G,) where each graph's nodes start in members
    if host_readable(batch):  # one pass of a CPU kernel (the same edges, 5-10x faster)
        return cpu.batch_complete_edges(batch, members, first, sizes, self_loops)
    degree = sizes[batch]  # (N,) sources of each target: its graph's size
    dst = torch.arange(n, device=batch.device).repeat_interleave(degree)  # (E,)
    # position of each edge among its target's sources, then that source in members
    rank = torch.arange(dst.numel(), device=batch.device) - (degree.cumsum(0) - degree)[dst]
    src = members[first[batch][dst] + rank]  # (E,)
    if not self_loops:
        keep = src != dst
        src, dst = src[keep], dst[keep]
    return torch.stack([src, dst])


def repeat_graph(edge_index: Tensor, num_nodes: int, copies: int) -> Tensor:
    r"""One graph repeated ``copies`` times without edges between the copies: a mini-batch of
    sequences or images that share one attention pattern.

    Copy ``b`` holds nodes ``b * num_nodes`` to ``(b + 1) * num_nodes - 1``, so features of
    shape ``[B, L, F]`` flattened to ``[B * L, F]`` line up with
    ``repeat_graph(edge_index, L, B)``, and copy b of edge j -> i is

    .. math::
        (j + b\,n) \to (i + b\,n), \qquad b = 0, \dots, \texttt{copies} - 1.

    ``GraphSelfAttention`` on it attends within each sequence (image) alone, as
    ``DenseSelfAttention`` on the ``[B, L, F]`` batch with ``mask=to_dense_mask(edge_index,
    L)`` does (with ``add_self_loops=False``, or a pattern that has its self-loops: the layer
    adds them by default, the mask does not). For a graph given per example (as in PyG's
    ``Batch``), concatenate with offsets instead; :func:`batch_complete_graph` builds the
    complete graph of each.

    Args:
        edge_index (Tensor): ``[2, E]`` integer, the graph of one copy, ids below ``num_nodes``.
        num_nodes (int): nodes n of one copy (isolated ones included).
        copies (int): number of copies B >= 0.

    Shapes:
        - **input:** edge_index ``(2, E)``
        - **output:** edge_index ``(2, B * E)``, the dtype and device of ``edge_index``,
          copy by copy; sorted by target, then source, when ``edge_index`` is
    """
    num_nodes = check_non_negative(num_nodes, "num_nodes")
    copies = check_non_negative(copies, "copies")
    check_edge_index(edge_index, num_src=num_nodes, num_dst=num_nodes)
    if copies * num_nodes - 1 > torch.iinfo(edge_index.dtype).max:
        raise ValueError(f"copies * num_nodes = {copies} * {num_nodes} node ids do not fit "
                         f"in edge_index's dtype {edge_index.dtype}; pass int64 ids")
    offsets = torch.arange(copies, dtype=edge_index.dtype, device=edge_index.device)
    offsets = offsets * num_nodes  # (B,)
    return (edge_index.unsqueeze(1) + offsets.view(1, -1, 1)).reshape(2, -1)  # (2, B * E)


def chain_graph(n: int, directed: bool = False) -> Tensor:
    r"""The path ``0 - 1 - ... - n-1``: each position sees its direct neighbours.

    .. math::
        \mathcal{E} = \{(i-1, i)\} \cup \{(i+1, i)\ \text{unless}\ \texttt{directed}\}

    The chain is the graph of a plain sequence; its Laplacian eigenvectors are the cosines
    that :func:`graphattn.pe.laplacian_pe` returns (see :mod:`graphattn.pe`). There are no
    self-loops (``GraphSelfAttention`` adds them by default).

    Args:
        n (int): number of nodes.
        directed (bool, optional): only the forward edges ``i-1 -> i``. (default: ``False``)

    Shapes:
        - **output:** edge_index ``(2, m)`` (directed) or ``(2, 2 m)``, int64, with
          ``m = max(n - 1, 0)``
    """
    n = check_non_negative(n, "n")
    directed = check_flag(directed, "directed")
    offsets = torch.tensor([-1]) if directed else torch.tensor([-1, 1])
    return _window_edges(n, offsets)


def causal_graph(n: int) -> Tensor:
    r"""Node i attends to every j <= i: masked (decoder) self-attention.

    .. math::
        \mathcal{E} = \{(j, i) : 0 \le j \le i < n\}

    Equal to ``dense_attention(..., is_causal=True)``.

    Args:
        n (int): number of nodes.

    Shapes:
        - **output:** edge_index ``(2, n (n + 1) / 2)``, int64
    """
    n = check_non_negative(n, "n")
    dst, src = torch.tril_indices(n, n)  # row-major: sorted by target, then source
    return torch.stack([src, dst])


def chunked_graph(n: int, size: int, causal: bool = True) -> Tensor:
    r"""Node i attends to the nodes j of its own chunk of ``size`` consecutive nodes (with
    ``causal``, those with j <= i): Llama 4's chunked attention, which its layers with RoPE
    run over chunks of 8192 tokens (``attention_chunk_size``).

    .. math::
        \mathcal{E} = \{(j, i) : \lfloor j / s \rfloor = \lfloor i / s \rfloor,\;
        j \le i \text{ when causal}\}

    The chunks are diagonal blocks of the graph (the last one shorter when ``size`` does not
    divide n), which the ``"dense"`` backend runs block by block. A causal window of
    ``size - 1`` (:func:`window_graph`) reads as many past tokens at most; a chunk reads
    ``i mod size`` of them, none at its first token.

    Args:
        n (int): number of nodes.
        size (int): nodes per chunk, >= 1.
        causal (bool, optional): keep only the edges j -> i with j <= i. (default: ``True``)

    Shapes:
        - **output:** edge_index ``(2, E)``, int64, sorted by target, then source; E is
          :math:`\sum_c s_c (s_c + 1) / 2` over the chunks' sizes :math:`s_c` (causal), else
          :math:`\sum_c s_c^2`
    """
    n = check_non_negative(n, "n")
    size = check_positive(size, "size")
    causal = check_flag(causal, "causal")
    size = min(size, max(n, 1))  # (a chunk longer than the sequence: build no more than it)
    full, rest = divmod(n, size)
    block = causal_graph if causal else complete_graph
    parts = [repeat_graph(block(size), size, full)]
    if rest:  # the last chunk, shorter
        parts.append(block(rest) + full * size)
    return torch.cat(parts, dim=1)


def window_graph(n: int, radius: int, causal: bool = False, *, dilation: int = 1) -> Tensor:
    r"""Node i attends to the positions within ``radius``: truncated self-attention.

    .. math::
        \mathcal{E} = \{(j, i) : |i - j| \le r\} \quad \text{or, causal,} \quad
        \{(j, i) : 0 \le i - j \le r\}

    Used for long sequences (speech) where full attention costs too much: E is about
    ``(2r + 1) n`` (``(r + 1) n`` when causal) instead of ``n^2``. Self-loops are included.
    With a dilation d, the window skips: i attends to :math:`j = i + d\,m` for
    :math:`|m| \le r`, as many keys reaching d times as far (Longformer's dilated sliding
    window, often given to some heads only: :func:`head_patterns`).

    Args:
        n (int): number of nodes.
        radius (int): window radius r >= 0 (0 leaves only the self-loops), in steps of the
            dilation.
        causal (bool, optional): only look back, ``j <= i``. (default: ``False``)
        dilation (int, optional): the step d >= 1 between the positions of the window.
            (default: ``1``)

    Shapes:
        - **output:** edge_index ``(2, E)``, int64, sorted by target, then source
    """
    n = check_non_negative(n, "n")
    radius = check_non_negative(radius, "radius")
    causal = check_flag(causal, "causal")
    dilation = check_positive(dilation, "dilation")
    r = min(radius, max(n - 1, 0) // dilation)  # steps that can stay inside the sequence
    offsets = torch.arange(-r, 1) if causal else torch.arange(-r, r + 1)
    return _window_edges(n, offsets * dilation)


def grid_graph(height: int, width: int, radius: int = 1) -> Tensor:
    r"""Pixels of a ``height x width`` image attend to their square neighbourhood.

    Pixel ``(r, c)`` is node ``r * width + c`` (row-major). Pixel p attends to q when both
    coordinates differ by at most ``radius`` (Chebyshev distance):

    .. math::
        \mathcal{E} = \{(q, p) : |r_p - r_q| \le \rho,\ |c_p - c_q| \le \rho\}

    ``radius=1`` is the 3x3 neighbourhood of a convolution, the pixel itself included.

    Args:
        height (int): number of rows.
        width (int): number of columns.
        radius (int, optional): neighbourhood radius rho >= 0. (default: ``1``)

    Shapes:
        - **output:** edge_index ``(2, E)``, int64, E <= ``(2 rho + 1)^2 * height * width``
    """
    height = check_non_negative(height, "height")
    width = check_non_negative(width, "width")
    radius = check_non_negative(radius, "radius")
    # Capped per axis: a thin image (height or width 1) must not materialize (2 rho + 1)^2
    # offsets per pixel when only 2 rho + 1 of them can stay inside it.
    rad_r, rad_c = min(radius, max(height - 1, 0)), min(radius, max(width - 1, 0))
    d_r, d_c = torch.arange(-rad_r, rad_r + 1), torch.arange(-rad_c, rad_c + 1)
    dr, dc = d_r.repeat_interleave(d_c.numel()), d_c.repeat(d_r.numel())  # (D,) row-major
    row = torch.arange(height).repeat_interleave(width)  # (N,)
    col = torch.arange(width).repeat(height)  # (N,)
    src_row = row.unsqueeze(1) + dr  # (N, D)
    src_col = col.unsqueeze(1) + dc  # (N, D)
    keep = (src_row >= 0) & (src_row < height) & (src_col >= 0) & (src_col < width)
    src = (src_row * width + src_col)[keep]  # ascending per target: rows, then columns
    dst = torch.arange(height * width).unsqueeze(1).expand_as(keep)[keep]
    return torch.stack([src, dst])


def global_token_graph(n: int, tokens: int | Sequence[int] | Tensor,
                       causal: bool = False) -> Tensor:
    r"""Global tokens: each of the ``tokens`` positions attends to every node, and every node
    attends to it.

    .. math::
        \mathcal{E} = \{(j, i) : j \in G \ \text{or}\ i \in G\} \quad \text{or, causal,} \quad
        \{(j, i) : j \le i,\ j \in G \ \text{or}\ i \in G\}

    with G the global positions. Alone it is the star (hub) part of a sparse transformer's
    pattern; with a window, :func:`union` gives Longformer's attention (a sliding window plus
    global tokens), and with :func:`random_graph` too, BigBird's. Causal, with G the first s
    positions, every position also attends to the first s ("attention sinks", kept beside a
    sliding window when a decoder streams past its window). Global tokens attend to
    themselves; no other self-loop is added. Virtual nodes (a graph transformer's global
    nodes) are global tokens appended as new nodes: for k of them beside a graph of n nodes,
    ``union([edge_index, global_token_graph(n + k, range(n, n + k))], n + k)``, over the node
    features with k learned rows appended.

    Args:
        n (int): number of nodes.
        tokens (int or list of int or Tensor): the global positions G: an int t for the
            first t positions ``0..t-1``, or the positions themselves, as a sequence or a
            one-dimensional tensor (repeats count once).
        causal (bool, optional): keep only the edges ``j <= i``. (default: ``False``)

    Shapes:
        - **output:** edge_index ``(2, E)``, int64, sorted by target, then source;
          ``E <= 2 |G| n`` (``|G| (2 n - |G|)`` when not causal)
    """
    n = check_non_negative(n, "n")
    causal = check_flag(causal, "causal")
    count = None if isinstance(tokens, Tensor) else as_integer(tokens)  # a tensor: positions
    if count is not None:
        if not 0 <= count <= n:
            raise ValueError(f"tokens must be between 0 and n = {n} when it is a count, got "
                             f"{count}")
        positions = torch.arange(count)
    else:
        positions = _positions(tokens, "tokens")
        outside = positions[(positions < 0) | (positions >= n)]
        if outside.numel():
            raise ValueError(f"tokens must be positions in [0, {n}), got {int(outside[0])}")
    glob = positions.unique()  # (G,)
    every = torch.arange(n)  # (n,)
    # the global tokens' rows (they attend to all) and columns (all attend to them)
    src = torch.cat([every.repeat(glob.numel()), glob.repeat(n)])
    dst = torch.cat([glob.repeat_interleave(n), every.repeat_interleave(glob.numel())])
    if causal:
        keep = src <= dst
        src, dst = src[keep], dst[keep]
    return union([torch.stack([src, dst])], n)


def _positions(values: Sequence[int] | Tensor, name: str) -> Tensor:
    """``values`` as a one-dimensional int64 CPU tensor, or a TypeError naming ``name``."""
    try:
        positions = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        positions = None
    if positions is not None and positions.dim() == 1 and positions.numel() == 0:
        return positions.long().cpu()
    if (positions is None or positions.dim() != 1 or positions.is_floating_point()
            or positions.is_complex() or positions.dtype == torch.bool):
        raise TypeError(f"{name} must be an int or a one-dimensional sequence of integer "
                        f"positions, got {values!r}")
    return positions.long().cpu()


def random_graph(n: int, degree: int, *, self_loops: bool = False,
                 generator: torch.Generator | None = None) -> Tensor:
    r"""Each node attends to ``degree`` sources drawn at random: BigBird's random attention.

    For every target i, ``degree`` distinct sources j are drawn uniformly among the other
    ``n - 1`` nodes (among all ``n`` with ``self_loops``), independently of the other targets:

    .. math::
        \mathcal{E} = \{(j, i) : j \in S_i\}, \qquad S_i \subset \{0..n-1\} \setminus \{i\},
        \ |S_i| = d

    Random edges shorten the paths between far positions: a few layers of window attention
    plus d random keys per query reach every position in :math:`O(\log n)` layers, where the
    window alone needs :math:`n / r` (BigBird's argument). :func:`union` adds them to a window
    and global tokens.

    Args:
        n (int): number of nodes.
        degree (int): sources per target d, at most ``n - 1`` (``n`` with ``self_loops``).
        self_loops (bool, optional): a node may draw itself. (default: ``False``)
        generator (torch.Generator, optional): the random generator (CPU); torch's default
            one when ``None``. (default: ``None``)

    Shapes:
        - **output:** edge_index ``(2, n d)``, int64, sorted by target, then source
    """
    n = check_non_negative(n, "n")
    degree = check_non_negative(degree, "degree")
    self_loops = check_flag(self_loops, "self_loops")
    check_generator(generator)
    choices = n if self_loops else max(n - 1, 0)  # the sources a target can draw
    if degree > choices:
        raise ValueError(f"degree must be at most {choices} (the {'' if self_loops else 'other '}"
                         f"nodes of a target) for n = {n}, got {degree}")
    if 2 * degree > choices:  # dense: a random permutation of the choices per target
        drawn = torch.rand(n, choices, generator=generator).argsort(dim=1)[:, :degree]
    else:  # sparse: draw with replacement, then draw again where a target drew a repeat
        drawn = torch.randint(0, max(choices, 1), (n, degree), generator=generator)
        while True:
            ordered, order = drawn.sort(dim=1)  # (n, d)
            repeat = torch.zeros_like(drawn, dtype=torch.bool)
            repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
            if not bool(repeat.any()):
                break
            redraw = torch.randint(0, choices, (int(repeat.sum()),), generator=generator)
            ordered[repeat] = redraw
            drawn = ordered
    dst = torch.arange(n).unsqueeze(1).expand(n, degree)  # (n, d)
    if not self_loops:
        drawn = drawn + (drawn >= dst).long()  # skip the target itself
    src = drawn.sort(dim=1).values  # (n, d)
    return torch.stack([src.reshape(-1), dst.reshape(-1)])


def strided_graph(n: int, stride: int, causal: bool = False) -> Tensor:
    r"""Node i attends to the positions a multiple of ``stride`` away: the Sparse Transformer's
    strided pattern.

    .. math::
        \mathcal{E} = \{(j, i) : i - j \equiv 0 \pmod{s}\} \quad \text{or, causal,} \quad
        \{(j, i) : j \le i,\ i - j \equiv 0 \pmod{s}\}

    With a window of radius ``s - 1`` in another head (:func:`head_patterns`), two layers reach
    every position: the window gathers each block of s, the strided head carries it across
    (the factorized attention of Child et al., 2019). ``stride=1`` is the complete (causal)
    graph. Self-loops are included.

    Args:
        n (int): number of nodes.
        stride (int): the stride s >= 1.
        causal (bool, optional): only look back, ``j <= i``. (default: ``False``)

    Shapes:
        - **output:** edge_index ``(2, E)``, int64, sorted by target, then source; E is about
          ``n^2 / s`` (``n^2 / 2 s`` when causal)
    """
    n = check_non_negative(n, "n")
    causal = check_flag(causal, "causal")
    stride = check_positive(stride, "stride")
    reach = max(n - 1, 0) // stride  # the farthest multiple of the stride inside the sequence
    offsets = torch.arange(-reach, 1 if causal else reach + 1) * stride  # (D,) ascending
    return _window_edges(n, offsets)


def head_patterns(edge_indices: Sequence[Tensor], num_nodes: int, *,
                  dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    r"""One attention pattern per head, as one graph and a bias: the union of the heads'
    graphs, and the ``[E, H]`` bias that keeps each head to its own edges.

    .. math::
        \mathcal{E} = \bigcup_h \mathcal{E}_h, \qquad
        b_{e h} = \begin{cases} 0 & e \in \mathcal{E}_h \\ -\infty & \text{else} \end{cases}

    ``edge_attention(q, k, v, edge_index, bias=bias)`` then computes, in one call, head h's
    attention over its graph alone, as a dense mask per head would: a weight of 0 on the
    edges of the other heads, and 0 out for a target that head h gives no edge (see the
    conventions on ``-inf`` scores; for the additive score only with ``negative_slope > 0``).
    Sparse transformers split their patterns over the heads this way: a local window in some
    and a strided or global pattern in others (:func:`strided_graph`). Add other score biases
    to ``bias`` before the call. A :class:`~graphattn.nn.GraphSelfAttention` layer takes it
    as ``attn_bias`` (with ``add_self_loops=False``).

    Args:
        edge_indices (list of Tensor): H ``[2, E_h]`` integer graphs, head h's first, ids
            below ``num_nodes``, on one device.
        num_nodes (int): number of nodes N.
        dtype (torch.dtype, optional): the bias's dtype: that of q, k and v (a float32 bias
            with bf16 inputs promotes the output to float32). (default: ``torch.float32``)

    Shapes:
        - **input:** edge_indices ``(2, E_h)`` each
        - **output:** edge_index ``(2, E)``, int64, sorted by target, then source; bias
          ``(E, H)`` of ``dtype``, on the device of the inputs
    """
    if isinstance(edge_indices, Sequence) and not isinstance(edge_indices, Tensor) \
            and not edge_indices:
        raise ValueError("edge_indices must hold one graph per head, got none")
    edge_index = union(edge_indices, num_nodes)
    keys = edge_index[1] * num_nodes + edge_index[0]  # (E,) sorted
    columns = []
    for head in edge_indices:
        head_keys = head[1].long() * num_nodes + head[0].long()  # (E_h,)
        found = torch.searchsorted(keys, head_keys)  # (E_h,) where each edge of h lies
        mine = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
        mine[found] = True
        columns.append(mine)
    on = torch.stack(columns, dim=1)  # (E, H)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    bias = torch.zeros(on.shape, dtype=dtype, device=on.device).masked_fill_(~on, float("-inf"))
    return edge_index, bias


def top_k_edges(edge_index: Tensor, scores: Tensor, k: int, num_targets: int) -> Tensor:
    r"""The positions of each target's ``k`` in-edges of highest score (all of them where it
    has at most ``k``): the subgraph a learned score picks, as DeepSeek's sparse attention
    keeps each query's top-k keys by its indexer's score
    (:class:`graphattn.nn.LightningIndexer`).

    .. math::
        \mathcal{E}_k = \{\, (j \to i) \in \mathcal{E} :
        \lvert \{ (j' \to i) \in \mathcal{E} : s_{j'i} > s_{ji} \} \rvert < k \,\}

    Ties go to the edge that comes first in ``edge_index``; +inf ranks above every finite
    score, -inf below, and a NaN score below every other, on every device.
    ``edge_index[:, top_k_edges(...)]`` is the subgraph; the same positions pick its edge
    features or score bias.

    Args:
        edge_index (Tensor): ``[2, E]`` integer, the candidate edges ``j -> i``.
        scores (Tensor): ``[E]`` real, each edge's score.
        k (int): edges kept per target, > 0.
        num_targets (int): number of targets N (above every id in ``edge_index[1]``).

    Shapes:
        - **input:** edge_index ``(2, E)``, scores ``(E)``
        - **output:** ``(E_k)`` int64, the kept positions in increasing order (the edges keep
          their order)
    """
    k = check_positive(k, "k")
    num_targets = check_non_negative(num_targets, "num_targets")
    check_tensors(edge_index=edge_index, scores=scores)
    check_edge_index(edge_index, num_src=torch.iinfo(torch.int64).max, num_dst=num_targets)
    if scores.dim() != 1 or scores.size(0) != edge_index.size(-1) or \
            not scores.is_floating_point():
        raise ValueError(f"scores must be a real tensor [E] = [{edge_index.size(-1)}], one per "
                         f"edge, got {scores.dtype} {list(scores.shape)}")
    check_same_device(edge_index=edge_index, scores=scores)
    return _top_k_positions(edge_index, scores, k)


def _top_k_positions(edge_index: Tensor, scores: Tensor, k: int, *,
                     cpu_rows: bool = True) -> Tensor:
    """:func:`top_k_edges` of checked inputs.

    On the CPU one kernel selects in each target's scores (``cpu_rows``). Otherwise each
    target's edges are laid out in a row of its scores (padded with -inf to the largest
    in-degree) and ``torch.topk`` finds each row's k-th best score t_i; the edges above t_i are
    kept, and of those equal to it the first ones in edge order (NaN after -inf), as many as
    fill k. Where the rows would hold more than four times the edges, two stable sorts (by
    score, then by target) rank the edges instead. All three keep the same edges.
    """
    E, device = scores.numel(), scores.device
    cpu_rows = cpu_rows and host_readable(scores)
    nan = None  # (E,) where the scores are NaN, off the CPU kernel where any is
    if cpu_rows:  # (the kernel ranks NaN last; float32 holds every half value exactly)
        ranked = scores.detach().to(torch.promote_types(scores.dtype, torch.float32))
    else:  # (NaN as -inf, and below it where they tie: ``nan`` orders the ties)
        nan = torch.isnan(scores.detach())
        nan = nan if bool(nan.any()) else None
        ranked = scores.detach() if nan is None else scores.detach().masked_fill(nan, -torch.inf)
    target = edge_index[1].long()
    order = None  # edges grouped by target, each target's in edge order
    if E and bool((target[1:] < target[:-1]).any()):
        order = torch.argsort(target, stable=True)
        target, ranked = target[order], ranked[order]
        nan = None if nan is None else nan[order]
    # (N + 1,) each target's first edge: N binary searches in the sorted targets
    rowptr = torch.searchsorted(target, torch.arange(int(target[-1]) + 2 if E else 1,
                                                     device=device))
    counts = rowptr.diff()  # (N,)
    widest = int(counts.max()) if E else 0
    if widest <= k:
        return torch.arange(E, device=device)
    if cpu_rows:  # one CPU kernel: a selection in each row
        kept = cpu.top_k_rows(rowptr, ranked.contiguous(), k)
        if order is None:  # (in increasing order already)
            return kept
    elif counts.numel() * widest > max(4 * E, 1 << 20):  # (a hub: rows mostly padding)
        first = (torch.arange(E, device=device) if nan is None
                 else torch.argsort(nan.byte(), stable=True))  # (E,) each NaN after the rest
        by_score = first[torch.argsort(ranked[first], descending=True, stable=True)]  # (E,)
        by_target = by_score[torch.argsort(target[by_score], stable=True)]
        sorted_target = target[by_target]
        rank = (torch.arange(E, device=device)
                - torch.searchsorted(sorted_target, sorted_target))  # (E,) within target
        kept = by_target[rank < k]
    else:
        slot = torch.arange(E, device=device) - rowptr[target]  # (E,) within its target
        rows = ranked.new_full((counts.numel(), widest), -torch.inf)
        rows[target, slot] = ranked
        kth = rows.topk(k, dim=1).values[:, -1][target]  # (E,) the k-th best of its target
        above = ranked > kth
        tied = torch.nonzero(ranked == kth).squeeze(1)  # (T,) in order, grouped by target
        if nan is not None:  # (a target's NaN after its -inf)
            tied = tied[torch.argsort(2 * target[tied] + nan[tied], stable=True)]
        room = k - torch.bincount(target[above], minlength=counts.numel())  # (N,)
        tied_target = target[tied]
        rank = (torch.arange(tied.numel(), device=device)
                - torch.searchsorted(tied_target, tied_target))  # (T,) among its ties
        kept = torch.cat([torch.nonzero(above).squeeze(1), tied[rank < room[tied_target]]])
    return (kept if order is None else order[kept]).sort().values


# the most nodes whose pairs (i, j) have keys i * N + j < N^2 that int64 holds
MAX_KEYED_NODES = math.isqrt(torch.iinfo(torch.int64).max)


def union(edge_indices: Sequence[Tensor], num_nodes: int) -> Tensor:
    r"""The union of graphs on the same nodes: each edge of any of them once.

    .. math::
        \mathcal{E} = \mathcal{E}_1 \cup \dots \cup \mathcal{E}_m

    Sparse transformers combine patterns this way: ``union([window_graph(n, r),
    global_token_graph(n, g)], n)`` is Longformer's attention, and with ``random_graph(n, d)``
    added, BigBird's. A pair that several graphs (or one graph, twice) hold becomes one edge,
    so attention over the union weighs it once, as a dense mask does.

    Args:
        edge_indices (list of Tensor): ``[2, E_m]`` integer graphs, ids below ``num_nodes``,
            on one device.
        num_nodes (int): number of nodes N, at most 3,037,000,499 (each pair is keyed by
            :math:`i N + j`, which must fit in int64).

    Shapes:
        - **input:** edge_indices ``(2, E_m)`` each
        - **output:** edge_index ``(2, E)``, int64, sorted by target, then source, on the
          device of the inputs (CPU for none)
    """
    num_nodes = check_non_negative(num_nodes, "num_nodes")
    if num_nodes > MAX_KEYED_NODES:
        raise ValueError(f"num_nodes must be at most {MAX_KEYED_NODES:,} (each pair is keyed "
                         f"by target * num_nodes + source, in int64), got {num_nodes:,}")
    if isinstance(edge_indices, Tensor) or not isinstance(edge_indices, Sequence):
        raise TypeError(f"edge_indices must be a sequence of [2, E] tensors, got "
                        f"{type(edge_indices).__name__}")
    for m, edge_index in enumerate(edge_indices):
        check_tensors(**{f"edge_indices[{m}]": edge_index})
        try:
            check_edge_index(edge_index, num_src=num_nodes, num_dst=num_nodes)
        except (TypeError, ValueError) as error:
            raise type(error)(f"edge_indices[{m}]: {error}") from None
    if not edge_indices:
        return torch.empty(2, 0, dtype=torch.int64)
    check_same_device(**{f"edge_indices[{m}]": e for m, e in enumerate(edge_indices)})
    edges = torch.cat([e.long() for e in edge_indices], dim=1)  # (2, sum E_m)
    key = (edges[1] * num_nodes + edges[0]).unique()  # (E,) sorted: by target, then source
    return torch.stack([key % num_nodes, key // num_nodes]) if num_nodes else edges[:, :0]


def to_dense_mask(edge_index: Tensor, num_nodes: int) -> Tensor:
    r"""The boolean attention mask of a graph: ``mask[i, j] = True`` for every edge j -> i.

    ``dense_attention(q, k, v, to_dense_mask(edge_index, N))`` computes what
    ``edge_attention(q, k, v, edge_index)`` computes (multi-edges collapse into one entry).

    Args:
        edge_index (Tensor): ``[2, E]`` integer, row 0 the sources, row 1 the targets.
        num_nodes (int): number of nodes N.

    Shapes:
        - **input:** edge_index ``(2, E)``
        - **output:** mask ``(N, N)``, bool, on the device of ``edge_index``
    """
    num_nodes = check_non_negative(num_nodes, "num_nodes")
    check_edge_index(edge_index, num_src=num_nodes, num_dst=num_nodes)
    mask = torch.zeros(num_nodes, num_nodes, dtype=torch.bool, device=edge_index.device)
    mask[edge_index[1].long(), edge_index[0].long()] = True
    return mask


def from_dense_mask(mask: Tensor) -> Tensor:
    r"""The graph of a boolean attention mask: one edge j -> i for every ``mask[i, j] = True``.

    The inverse of :func:`to_dense_mask`.

    Args:
        mask (Tensor): bool ``[N, N]``; ``mask[i, j]`` says query i may attend to key j.

    Shapes:
        - **input:** mask ``(N, N)``
        - **output:** edge_index ``(2, E)``, int64, sorted by target, then source
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    if mask.layout != torch.strided:
        raise TypeError(f"mask must be a dense (strided) tensor, got layout {mask.layout}; a "
                        f"sparse adjacency converts with from_sparse_adjacency")
    if mask.dim() != 2 or mask.size(0) != mask.size(1):
        raise ValueError(f"mask must be square, [N, N], got {list(mask.shape)}")
    dst, src = mask.nonzero().t()  # row-major: sorted by target, then source
    return torch.stack([src, dst])


SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc)


def from_sparse_adjacency(adj: Tensor) -> Tensor:
    r"""The graph of a sparse adjacency: one edge j -> i for every stored entry ``adj[i, j]``.

    ``adj`` is ``[N_dst, N_src]``, row i listing the nodes that i attends to: the transposed
    adjacency ``adj_t`` that PyG's ``ToSparseTensor(layout=...)`` builds (COO or CSR; CSC is
    accepted too), and the layout of
    :func:`to_dense_mask`. The values are ignored. Every stored entry is one edge, in storage
    order: a COO tensor's entries as stored (a coalesced one is sorted by target, then source),
    CSR row by row, CSC column by column; so the rows of an ``edge_attr`` follow the entries.

    Args:
        adj (Tensor): sparse ``[N_dst, N_src]`` (or ``[N_dst, N_src, *]`` with dense values) in
            the ``torch.sparse_coo``, ``torch.sparse_csr`` or ``torch.sparse_csc`` layout.

    Shapes:
        - **input:** adj ``(N_dst, N_src)``
        - **output:** edge_index ``(2, nnz)``, int64
    """
    if not isinstance(adj, Tensor):
        raise TypeError(f"adj must be a torch.Tensor, got {type(adj).__name__}")
    if adj.layout not in SPARSE_LAYOUTS:
        raise ValueError(f"adj must be a sparse tensor in one of the layouts "
                         f"{[str(x) for x in SPARSE_LAYOUTS]}, got {adj.layout}")
    # A compressed (CSR/CSC) tensor reports sparse_dim() == 2 even with batch dimensions in
    # front, so count every dimension that is not a dense (value) one.
    num_index_dims = adj.dim() - adj.dense_dim()
    if num_index_dims != 2:
        raise ValueError(f"adj must have 2 sparse dimensions [N_dst, N_src] (no batch "
                         f"dimensions), got {num_index_dims} in shape {list(adj.shape)}")
    num_dst, num_src = adj.shape[:2]
    if adj.layout == torch.sparse_coo:
        dst, src = adj._indices()  # stored order, duplicates kept
    elif adj.layout == torch.sparse_csr:
        counts = adj.crow_indices().diff()  # (N_dst,)
        dst = torch.arange(num_dst, device=adj.device).repeat_interleave(counts)
        src = adj.col_indices()
    else:
        counts = adj.ccol_indices().diff()  # (N_src,)
        src = torch.arange(num_src, device=adj.device).repeat_interleave(counts)
        dst = adj.row_indices()
    return torch.stack([src.long(), dst.long()])  # (2, nnz)


def to_sparse_adjacency(edge_index: Tensor, num_src: int, num_dst: int,
                        values: Tensor | None = None, layout: torch.layout = torch.sparse_csr,
                        ) -> Tensor:
    r"""The sparse adjacency ``adj [N_dst, N_src]`` of a graph: ``adj[i, j]`` for each edge j -> i.

    The inverse of :func:`from_sparse_adjacency`. Entries are sorted by target, then source
    (CSC: by source, then target); multi-edges stay separate entries, and a COO result is
    marked coalesced exactly when there are none. Built sorted, so torch's invariant checks
    are skipped. A multigraph's CSR or CSC tensor repeats a column within a row, which torch's
    compressed layouts do not allow (``torch.sparse.check_sparse_tensor_invariants`` refuses
    it): graphattn's layers and :func:`from_sparse_adjacency` read it edge by edge, but
    torch's own operations on it (products, the gradient of its ``values()``) can be wrong.
    For those, take ``layout=torch.sparse_coo``, which may hold repeated entries (marked
    uncoalesced), or ``.coalesce()`` it to sum them.

    Args:
        edge_index (Tensor): ``[2, E]`` integer, row 0 the sources, row 1 the targets.
        num_src (int): number of source nodes N_src (columns).
        num_dst (int): number of target nodes N_dst (rows).
        values (Tensor, optional): ``[E]`` or ``[E, *]`` entry values, e.g. attention weights
            ``[E, H]`` (then a hybrid tensor ``[N_dst, N_src, H]``). (default: ones)
        layout (torch.layout, optional): ``torch.sparse_csr``, ``torch.sparse_coo`` or
            ``torch.sparse_csc``. (default: ``torch.sparse_csr``)

    Shapes:
        - **input:** edge_index ``(2, E)``, values ``(E, *)``
        - **output:** adj ``(N_dst, N_src, *)``
    """
    return _sparse_adjacency_and_values(edge_index, num_src, num_dst, values, layout)[0]


def _sparse_adjacency_and_values(edge_index: Tensor, num_src: int, num_dst: int,
                                 values: Tensor | None = None,
                                 layout: torch.layout = torch.sparse_csr,
                                 ) -> tuple[Tensor, Tensor]:
    """:func:`to_sparse_adjacency`, and its values in the order of its entries ``[E, *]``,
    differentiable as ``values`` are (a COO tensor's ``_values()`` is not)."""
    num_src = check_non_negative(num_src, "num_src")
    num_dst = check_non_negative(num_dst, "num_dst")
    check_edge_index(edge_index, num_src=num_src, num_dst=num_dst)
    if layout not in SPARSE_LAYOUTS:
        raise ValueError(f"layout must be one of {[str(x) for x in SPARSE_LAYOUTS]}, "
                         f"got {layout}")
    src, dst = edge_index.long()
    if values is None:
        values = torch.ones(src.numel(), device=edge_index.device)
    if not isinstance(values, Tensor):
        raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 0 or values.size(0) != src.numel():
        raise ValueError(f"values must have one row per edge, [E, *] = [{src.numel()}, *], "
                         f"got {list(values.shape)}")
    check_same_device(edge_index=edge_index, values=values)
    size = (num_dst, num_src, *values.shape[1:])
    major, minor, num_major = (src, dst, num_src) if layout == torch.sparse_csc else (dst, src,
                                                                                      num_dst)
    key, order = torch.sort(major * max(num_src, num_dst) + minor, stable=True)  # (E,)
    major, minor, values = major[order], minor[order], values[order]
    if layout == torch.sparse_coo:
        return torch.sparse_coo_tensor(torch.stack([major, minor]), values, size,
                                       is_coalesced=bool((key.diff() > 0).all()),
                                       check_invariants=False), values
    ptr = torch.zeros(num_major + 1, dtype=torch.long, device=edge_index.device)
    ptr[1:] = torch.bincount(major, minlength=num_major).cumsum(0)
    build = torch.sparse_csr_tensor if layout == torch.sparse_csr else torch.sparse_csc_tensor
    with warnings.catch_warnings():
        # torch's notice that CSR and CSC are in beta, printed once, at the first one built:
        # blamed on this line, where the user of this function has nothing to act on
        warnings.filterwarnings("ignore", message="Sparse CS[RC] tensor support is in beta",
                                category=UserWarning)
        return build(ptr, minor, values, size, check_invariants=False), values


@overload
def from_networkx(G: nx.Graph, edge_attrs: None = None) -> Tensor: ...


@overload
def from_networkx(G: nx.Graph, edge_attrs: Sequence[str]) -> tuple[Tensor, Tensor]: ...


def from_networkx(G: nx.Graph, edge_attrs: Sequence[str] | None = None,
                  ) -> Tensor | tuple[Tensor, Tensor]:
    r"""The ``edge_index`` of a networkx graph, nodes relabelled ``0..N-1`` in ``G``'s order.

    A directed edge ``u -> v`` becomes the edge ``(index(u), index(v))`` (u is the source). An
    undirected edge ``{u, v}`` becomes both directions (a self-loop stays one edge). Multigraphs
    keep every parallel edge. Nodes without edges remain nodes: N is ``G.number_of_nodes()``.

    Args:
        G (networkx.Graph): a ``Graph``, ``DiGraph``, ``MultiGraph`` or ``MultiDiGraph``.
        edge_attrs (list of str, optional): edge attributes to collect into ``edge_attr``;
            each must be a number or a sequence of numbers on every edge, and they are
            concatenated in the given order; an empty list gives ``edge_attr`` of 0 columns.
            (default: ``None``, return ``edge_index`` only)

    Shapes:
        - **output:** edge_index ``(2, E)``, int64, sorted by target, then source; with
          ``edge_attrs`` also edge_attr ``(E, D)`` in the default float dtype, D the total size
          of the attributes (a graph without edges has none to measure: its ``edge_attr`` is
          ``(0, len(edge_attrs))``, one column per attribute)
    """
    if not isinstance(G, nx.Graph):
        raise TypeError(f"G must be a networkx graph, got {type(G).__name__}")
    if isinstance(edge_attrs, str):  # list("weight") would be the names "w", "e", ...
        raise TypeError(f"edge_attrs must be a list of attribute names, got the string "
                        f"{edge_attrs!r}; pass [{edge_attrs!r}]")
    index = {node: i for i, node in enumerate(G.nodes)}
    if edge_attrs is not None and not (isinstance(edge_attrs, Sequence)
                                       and all(isinstance(n, str) for n in edge_attrs)):
        raise TypeError(f"edge_attrs must be a list of attribute names, got {edge_attrs!r}")
    names = list(edge_attrs) if edge_attrs is not None else []
    src: list[int] = []
    dst: list[int] = []
    rows: list[Tensor] = []
    for u, v, data in G.edges(data=True):
        row = _edge_attr_row(data, names, (u, v)) if names else None
        pairs = [(u, v)] if G.is_directed() or u == v else [(u, v), (v, u)]
        for a, b in pairs:
            src.append(index[a])
            dst.append(index[b])
            if row is not None:
                rows.append(row)
    n = G.number_of_nodes()
    edge_index = torch.tensor([src, dst], dtype=torch.long).view(2, -1)
    order = torch.sort(edge_index[1] * n + edge_index[0], stable=True).indices
    edge_index = edge_index[:, order]
    if edge_attrs is None:
        return edge_index
    if not names:  # asked for no attribute: an edge_attr of D = 0 columns
        return edge_index, torch.empty(edge_index.size(1), 0, dtype=torch.get_default_dtype())
    if rows and len({r.numel() for r in rows}) > 1:
        sizes = sorted({r.numel() for r in rows})
        raise ValueError(f"edge attributes {names} must have the same total size on every "
                         f"edge, got sizes {sizes}")
    edge_attr = (torch.stack(rows) if rows
                 else torch.empty(0, len(names), dtype=torch.get_default_dtype()))
    return edge_index, edge_attr[order]


def _edge_attr_row(data: dict, names: list[str], edge: tuple) -> Tensor:
    """Concatenate the attributes ``names`` of one networkx edge into a flat float tensor."""
    parts = []
    for name in names:
        if name not in data:
            raise ValueError(f"edge_attrs: edge {edge} has no attribute {name!r}")
        try:
            part = torch.as_tensor(data[name], dtype=torch.get_default_dtype())
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"edge_attrs: attribute {name!r} of edge {edge} must be a number "
                            f"or a sequence of numbers, got {data[name]!r} ({error})") from None
        parts.append(part.reshape(-1))
    return torch.cat(parts)


def to_networkx(edge_index: Tensor, num_nodes: int, edge_attr: Tensor | None = None, *,
                undirected: bool = False) -> nx.Graph:
    r"""A networkx graph with nodes ``0..N-1`` and the edges of ``edge_index``.

    Every node is added, with or without edges. Parallel edges collapse into one (the
    attribute of the last one is kept).

    Args:
        edge_index (Tensor): ``[2, E]`` integer, row 0 the sources, row 1 the targets.
        num_nodes (int): number of nodes N.
        edge_attr (Tensor, optional): ``[E]`` or ``[E, D]`` edge features, stored on each edge
            as the attribute ``"edge_attr"`` (a float, or a list of D floats).
            (default: ``None``)
        undirected (bool, optional): return a ``networkx.Graph`` in which ``j -> i`` and
            ``i -> j`` are the one edge ``{i, j}``; otherwise a ``networkx.DiGraph``.
            (default: ``False``)

    Shapes:
        - **input:** edge_index ``(2, E)``, edge_attr ``(E)`` or ``(E, D)``
    """
    num_nodes = check_non_negative(num_nodes, "num_nodes")
    undirected = check_flag(undirected, "undirected")
    check_edge_index(edge_index, num_src=num_nodes, num_dst=num_nodes)
    if edge_attr is not None and not isinstance(edge_attr, Tensor):
        raise TypeError(f"edge_attr must be a torch.Tensor, got {type(edge_attr).__name__}")
    if edge_attr is not None and (edge_attr.dim() not in (1, 2)
                                  or edge_attr.size(0) != edge_index.size(1)):
        raise ValueError(f"edge_attr must have shape [E] or [E, D] with E = "
                         f"{edge_index.size(1)}, got {list(edge_attr.shape)}")
    G = nx.Graph() if undirected else nx.DiGraph()
    G.add_nodes_from(range(num_nodes))
    src, dst = edge_index.tolist()
    if edge_attr is None:
        G.add_edges_from(zip(src, dst, strict=True))
    else:
        values = edge_attr.tolist()
        G.add_edges_from((j, i, {"edge_attr": a}) for j, i, a in zip(src, dst, values,
                                                                      strict=True))
    return G


def locality_order(edge_index: Tensor, num_nodes: int) -> Tensor:
    r"""A numbering of the nodes that puts the two ends of each edge close together: the
    reverse Cuthill-McKee order of the graph, its edges taken as undirected.

    Edge attention gathers, for each target i, the key and value rows of its sources j. The
    sparse kernels walk the targets in id order, so when a graph's ids say nothing of its
    structure (a point cloud or mesh numbered at random, a crawled graph), the rows that
    neighbouring targets read lie all over memory and are fetched again for each; numbered
    by this order, they lie near the targets' own and stay in cache. Reverse Cuthill-McKee
    makes the bandwidth

    .. math::
        \max_{(j \to i) \in E} \, \lvert \pi^{-1}(i) - \pi^{-1}(j) \rvert

    small: a breadth-first numbering from a node of low degree, each component in turn, then
    reversed. It does not change what attention computes, only where its rows lie: with
    ``perm = locality_order(edge_index, N)``, renumber the graph with :func:`permute_nodes`
    and the node rows with ``x[perm]``, or a PyG ``Data`` (its node and edge attributes, the
    masks and labels too) with ``data.subgraph(perm)``. Row i of the output then belongs to
    node ``perm[i]``; ``out[torch.argsort(perm)]`` puts the rows back in the given order.

    On 2 CPU cores, on a graph of 500,000 random points of the plane each attending to its 10
    nearest, numbered in the points' random order, the ``cpu`` kernels' forward+backward takes
    0.61x the time once renumbered (their forward 0.54x, a ``GraphSelfAttention`` layer's
    forward+backward 0.68x), on PubMed 0.87x; on a uniform random graph, which has no
    locality to find, 0.98x; the ``reference`` backend, whose ``[E, H, C]`` intermediates cost
    the most, gains nothing (``benchmarks/node_order.py``). Renumbered, that point graph's
    32 x 32 tiles of the adjacency matrix are 3.1% full instead of 0.11%, above the 1/64 that
    the block-sparse ``triton`` kernels ask. The order is computed on the CPU by SciPy in
    O(N + E) time (0.7 s with :func:`permute_nodes` for 5M edges).

    Args:
        edge_index (Tensor): ``[2, E]`` integer, row 0 the sources, row 1 the targets.
        num_nodes (int): number of nodes N (isolated ones included).

    Shapes:
        - **input:** edge_index ``(2, E)``
        - **output:** perm ``(N)``, int64, on the device of ``edge_index``: a permutation of
          ``0..N-1``, node ``perm[i]`` numbered i
    """
    num_nodes = check_non_negative(num_nodes, "num_nodes")
    check_edge_index(edge_index, num_src=num_nodes, num_dst=num_nodes)
    if num_nodes == 0:  # (SciPy's order refuses an empty matrix)
        return torch.zeros(0, dtype=torch.int64, device=edge_index.device)
    src, dst = edge_index.cpu().numpy()
    ends = np.concatenate([src, dst]), np.concatenate([dst, src])  # both directions
    pattern = sp.csr_matrix((np.ones(ends[0].size, dtype=np.int32), ends),
                            shape=(num_nodes, num_nodes))  # (N, N), symmetric
    order = reverse_cuthill_mckee(pattern, symmetric_mode=True)  # (N,)
    return torch.from_numpy(order.astype(np.int64)).to(edge_index.device)


def permute_nodes(edge_index: Tensor, perm: Tensor) -> Tensor:
    r"""The graph renumbered so that node ``perm[i]`` becomes node i.

    Each edge :math:`j \to i` becomes :math:`\pi^{-1}(j) \to \pi^{-1}(i)`, with
    :math:`\pi^{-1}` the inverse of ``perm``; the edges keep their order, so per-edge
    tensors (``edge_attr``, a ``bias``) stay aligned with them. Attention commutes with the
    renumbering: with ``q``, ``k`` and ``v`` indexed by ``perm`` too,

    .. code-block:: python

        edge_attention(q[perm], k[perm], v[perm], permute_nodes(edge_index, perm))
        # == edge_attention(q, k, v, edge_index)[perm]

    :func:`locality_order` gives a ``perm`` that makes the sparse kernels faster on graphs
    numbered without regard to their structure.

    Args:
        edge_index (Tensor): ``[2, E]`` integer, ids below ``N = perm.numel()``.
        perm (Tensor): ``[N]`` integer, each of ``0..N-1`` once, on the device of
            ``edge_index``.

    Shapes:
        - **input:** edge_index ``(2, E)``, perm ``(N)``
        - **output:** edge_index ``(2, E)``, the dtype and device of ``edge_index``
    """
    check_tensors(edge_index=edge_index, perm=perm)
    if perm.dim() != 1:
        raise ValueError(f"perm must be one-dimensional, [N], got {list(perm.shape)}")
    if perm.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"perm must have an integer dtype (int64 or int32), got {perm.dtype}")
    check_same_device(edge_index=edge_index, perm=perm)
    num_nodes = perm.numel()
    check_edge_index(edge_index, num_src=num_nodes, num_dst=num_nodes)
    perm = perm.long()
    rule = f"perm must hold each of 0..{num_nodes - 1} once (N = perm.numel() = {num_nodes})"
    if num_nodes:
        lo, hi = host_list(torch.stack([perm.min(), perm.max()]))
        if lo < 0 or hi >= num_nodes:
            raise ValueError(f"{rule}, got the value {lo if lo < 0 else hi}")
        counts = torch.bincount(perm, minlength=num_nodes)  # (N,) how often each id comes
        wrong = host_list(torch.nonzero(counts != 1)[:1].view(-1))
        if wrong:
            times = "twice or more" if int(counts[wrong[0]]) > 1 else "not at all"
            raise ValueError(f"{rule}, got {wrong[0]} {times}")
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(num_nodes, device=perm.device)  # (N,) new id of each node
    return inverse[edge_index.long()].to(edge_index.dtype)  # (2, E)
