r"""Positional encodings for sequences and graphs, and PyG transforms that attach them.

Self-attention is blind to order: it sees a set. Sequences add the sinusoidal encoding
(Vaswani et al., 2017), whose columns are pairs

.. math::
    \mathrm{PE}[t, 2i] = \sin(\omega_i t), \qquad \mathrm{PE}[t, 2i + 1] = \cos(\omega_i t),
    \qquad \omega_i = 10000^{-2i/d}.

Graphs use the eigenvectors of the symmetric normalized Laplacian
:math:`\mathcal{L} = I - D^{-1/2} A D^{-1/2}` (:func:`laplacian_pe`), and the sequence case is
the chain graph case of it:

- **Cycle** ``0 - 1 - ... - n-1 - 0`` (a periodic sequence). :math:`\mathcal{L} = I - A / 2`
  has the eigenvalues :math:`\lambda_m = 1 - \cos(2 \pi m / n)`, ``m = 0 .. n // 2``; for
  ``0 < m < n / 2`` the eigenspace of :math:`\lambda_m` is two-dimensional and spanned by
  :math:`\sin(\omega t)` and :math:`\cos(\omega t)` with :math:`\omega = 2 \pi m / n` -- exactly
  the column pair of the sinusoidal encoding at the frequency :math:`\omega_i = 2 \pi m / n`
  (period ``n / m`` positions). Small eigenvalues are low frequencies: the ``k`` eigenvectors
  that ``laplacian_pe`` keeps are the ``k / 2`` slowest pairs, ``m = 1 .. k / 2``, which play the
  part of the last (large ``i``) columns of the sinusoidal encoding. The two differ in which
  frequencies they sample: the Transformer spaces its ``d / 2`` frequencies geometrically from
  1 down to 1/10000, for any length; the cycle's Laplacian has exactly the ``n / 2`` frequencies
  ``2 pi m / n`` that fit around it, so a Transformer pair lies in an eigenspace only when its
  :math:`\omega_i` is one of them. The basis inside a
  two-dimensional eigenspace is arbitrary (any rotation of the sin/cos pair is as good), so
  only the span is determined: what matches is the subspace, not the columns.
- **Path** ``0 - 1 - ... - n-1`` (:func:`graphattn.graphs.chain_graph`, an open sequence). The
  eigenvalues :math:`1 - \cos(\pi m / (n - 1))` are simple and the eigenvectors are cosines,
  :math:`u_m(t) \propto \sqrt{d_t} \cos(\pi m t / (n - 1))` (:math:`d_t` is 1 at the two ends
  and 2 inside): the cosine column at :math:`\omega = \pi m / (n - 1)`, corrected at the ends.

On a general graph the same eigenvectors are the graph's "frequencies"; an eigenvector is
defined only up to sign (up to rotation inside a repeated eigenvalue), which is why
:func:`laplacian_pe` fixes a sign convention and can flip signs at random for training.
:func:`random_walk_pe` (Dwivedi et al., 2022) has no sign ambiguity at all.

Relative encodings are the same story one level up. A sequence's relative position
:math:`i - j` is the number of edges between j and i on the chain, and on any graph that
number is the shortest-path length (:func:`hop_distance`). A bias of the scores that depends
on it only is then ALiBi on the chain (:func:`alibi_bias`: :math:`-m_h (i - j)` on the causal
graph) and Graphormer's spatial encoding on a graph (:class:`DistanceBias`, a learned bias per
head and distance; on the chain, the learned bias of each clipped relative position). T5's
bias (:class:`RelativePositionBias`) learns one per log-spaced bucket of i - j
(:func:`relative_position_bucket`), and on a graph ``DistanceBias(..., num_buckets=)`` buckets
hop distances the same way. Where nodes have coordinates, the offset :math:`p_i - p_j` itself
can index the bias (:func:`relative_offsets`, :class:`OffsetBias`): Swin's relative position
bias on an image's grid graph, a bias per signed offset on a sequence. All go into attention
as ``attn_bias``, on the edges (:class:`~graphattn.nn.GraphSelfAttention`) or dense
(:class:`~graphattn.nn.DenseSelfAttention`).

Rotary embeddings (:func:`apply_rotary`, :class:`RotaryPE`) reach the same relative form
without a bias: queries and keys turn by angles proportional to their positions, so that
:math:`q_i \cdot k_j` depends on :math:`p_i - p_j` alone. They need coordinates rather than a
graph distance (a sequence's index, a pixel's row and column, a point's x, y, z) and go into
the layers as ``rotary=`` with the positions as ``pos=``.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import numpy as np
import scipy.sparse as sp
import torch
from scipy.sparse.csgraph import connected_components, reverse_cuthill_mckee
from scipy.sparse.linalg import (
    ArpackError,
    ArpackNoConvergence,
    LinearOperator,
    SuperLU,
    eigsh,
    splu,
)
from torch import Tensor
from torch_geometric.data import Batch, Data
from torch_geometric.transforms import BaseTransform

from graphattn import graphs
from graphattn._checks import (
    check_edge_index,
    check_finite,
    check_flag,
    check_generator,
    check_non_negative,
    check_positive,
    check_tensors,
    exact_repr,
)
from graphattn.functional._transforms import (
    apply_function,
    host_readable,
    needs_grad,
    plain_ops_only,
)
from graphattn.functional.cpu import MIN_PARALLEL_WORK, _jit, _run_chunks, _run_rows

#: ``laplacian_pe(solver="auto")`` uses the dense eigensolver up to this many nodes.
DENSE_SOLVER_MAX_NODES = 2000

#: The sparse solver factorizes the Laplacian (shift-invert Lanczos) when its envelope in
#: reverse Cuthill-McKee order, a bound on the fill of that factorization, has at most this
#: many entries; above it (expander-like graphs) it runs plain Lanczos on the Laplacian.
SHIFT_INVERT_MAX_ENVELOPE = 5 * 10**7

#: ... and, when that envelope is wide (more than ``SHIFT_INVERT_PROBE_WIDTH`` entries a row on
#: average, so the factorization may cost much), when a few Lanczos steps put the smallest
#: non-trivial eigenvalue below this. Above it (hypercubes, random graphs of mean degree 8:
#: 0.17, 0.33) plain Lanczos converges in few iterations and the factorization costs far more
#: (hypercube of 16384 nodes, k = 8: 27.6 s against 0.25 s); below it (paths, grids, the
#: citation graphs: 1e-6 to 0.015) the factorization pays. ``float("inf")`` skips the probe.
SHIFT_INVERT_MAX_EIGENVALUE = 0.05
#: Mean envelope width (entries a row) up to which the factorization is taken without the
#: probe: N w^2 operations at most (paths 1, grids about their side, Cora 214, PubMed 1604,
#: a hypercube of 4096 nodes 694).
SHIFT_INVERT_PROBE_WIDTH = 256

#: Above ``SHIFT_INVERT_MAX_ENVELOPE``, where the factorization is not taken, the sparse solver
#: probes the smallest non-trivial eigenvalue too, and runs a Chebyshev-filtered subspace
#: iteration (``_chebyshev_smallest``) instead of Lanczos when it is below this: an
#: expander-like graph with a small, crowded low end, such as a random graph with a path hanging
#: off it, whose eigenvalues on the path (from 3e-7 for 2000 nodes) Lanczos on the Laplacian
#: resolves only after tens of thousands of restarted iterations (a random graph of 18000 nodes
#: and mean degree 4 with that path, k = 8: 66 s, the filter 4.1 s; 15x to 50x on such graphs
#: with one path, three, or twelve equal ones). ``float("inf")`` skips the probe; 0 turns the
#: filter off.
CHEBYSHEV_MAX_EIGENVALUE = 0.05

#: ... and when k is at most this. The filter multiplies a block of 2k vectors by the Laplacian
#: at each step, while Lanczos keeps 2k + 1 vectors and restarts the less the larger k is: at
#: k = 32 Lanczos took 0.66x to 0.89x the filter's time on random graphs of 20000 nodes, with
#: or without a path of up to 100 nodes hanging off them (against 1.8x with 2000 nodes, where
#: the eigenvalues are far smaller); at k <= 16 the filter took 0.55x to 1.1x Lanczos's.
CHEBYSHEV_MAX_K = 16

# The shift of shift-invert Lanczos: below the spectrum of the normalized Laplacian, and at
# most a fraction of its lowest non-zero eigenvalue up to paths of about 10^5 nodes, so those
# become the largest and best separated eigenvalues of the inverse. (On longer paths they
# crowd again, and convergence slows gradually.)
_SHIFT = -1e-10

# Where the sparse solver moves the trivial eigenvectors: strictly above the spectrum of the
# normalized Laplacian, [0, 2], whose top value 2 is a genuine eigenvalue of every bipartite
# component (a trivial eigenvector left at 2 would be indistinguishable from those).
_TRIVIAL_SHIFT = 3.0

# The sparse solver's check round (see :func:`_sparse_smallest`) stops its Lanczos run at this
# relative residual: it only has to tell whether something lies below the k-th eigenvalue
# found, not to converge an eigenvector.
_CHECK_TOL = 1e-6

# A check-round eigenvalue this far (relatively) below the k-th eigenvalue found is one that
# the earlier rounds missed; closer, it is a copy of that k-th eigenvalue, which changes nothing.
_MISSED_RTOL = 1e-8

# The Chebyshev filter's stopping rule: every wanted Ritz pair (unit vector) has a residual
# ||L x - theta x|| at most this (rounding leaves about 1e-14).
_CHEBYSHEV_TOL = 1e-13

# A filter's degree makes its polynomial about e^_CHEBYSHEV_GAIN times larger at 0 than anywhere
# on the interval it damps: the block's columns then span at most that ratio, well within what
# its orthonormalization resolves in float64.
_CHEBYSHEV_GAIN = 20.0

# At most this many filter sweeps, each of degree at most _CHEBYSHEV_MAX_DEGREE, before the
# sparse solver gives up on the filter and runs Lanczos.
_CHEBYSHEV_MAX_SWEEPS = 40
_CHEBYSHEV_MAX_DEGREE = 20000

# Entries whose magnitude is within this relative distance of the largest one count as tied
# when fixing eigenvector signs (mirror-symmetric graphs have exact ties).
_SIGN_TIE_RTOL = 1e-6

SOLVERS = ("auto", "dense", "sparse")

# What a multiply-add of a sparse product (scipy's CSR times CSR) costs in those of a sparse
# matrix times a dense block, about: where :func:`random_walk_pe` changes route (measured on
# Cora, PubMed, a radius-2 grid and a random graph, k = 8 and 16).
_SPARSE_PRODUCT_COST = 4

#: :func:`random_walk_pe` multiplies the rows and columns of the walk matrix's half powers as
#: sparse matrices while a product has at most this many entries; above it (expander-like
#: graphs, whose powers fill in) it multiplies dense blocks of columns of the identity.
RANDOM_WALK_SPARSE_MAX_NNZ = 1 << 23


def _sinusoid(positions: Tensor, dim: int, base: float) -> Tensor:
    """The sinusoidal encoding of arbitrary (float64) positions, ``[L]`` -> ``[L, dim]``."""
    steps = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)
    omega = base ** (-steps / dim)  # (dim / 2,)
    angle = positions.to(torch.float64).unsqueeze(-1) * omega  # (L, dim / 2)
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)  # (L, dim): sin, cos, ..


def _check_base(base: float) -> None:
    check_finite(base, "base")
    if base <= 0:
        raise ValueError(f"base must be a positive number, got {base!r}")


def _check_dim(dim: int) -> int:
    dim = check_positive(dim, "dim")
    if dim % 2:
        raise ValueError(f"dim must be even (one sin and one cos column per frequency), "
                         f"got {dim}")
    return dim


def sinusoidal(num_positions: int, dim: int, *, base: float = 10000.0) -> Tensor:
    r"""The Transformer's sinusoidal positional encoding.

    .. math::
        \mathrm{PE}[t, 2i] = \sin(\omega_i t), \qquad \mathrm{PE}[t, 2i + 1] = \cos(\omega_i t),
        \qquad \omega_i = \text{base}^{-2i/d}

    Computed in float64 and returned in the default float dtype.

    Args:
        num_positions (int): number of positions L (``t = 0 .. L-1``).
        dim (int): encoding size d; must be even.
        base (float, optional): frequency base. (default: ``10000.0``)

    Shapes:
        - **output:** ``(L, d)``
    """
    num_positions = check_non_negative(num_positions, "num_positions")
    dim = _check_dim(dim)
    _check_base(base)
    positions = torch.arange(num_positions, dtype=torch.float64)
    return _sinusoid(positions, dim, base).to(torch.get_default_dtype())


def _check_positions(positions: Tensor, length: int, *, integer: bool) -> None:
    """Raise unless ``positions`` is a tensor ``[L]`` with ``L = length``, of an integer dtype
    if ``integer`` (else of a real one)."""
    if not isinstance(positions, Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    if (positions.dtype == torch.bool or positions.is_complex()
            or (integer and positions.dtype.is_floating_point)):
        kind = "an integer" if integer else "a real"
        raise TypeError(f"positions must have {kind} dtype, got {positions.dtype}")
    if tuple(positions.shape) != (length,):
        raise ValueError(f"positions must have shape [L] = [{length}] (one per row of x), "
                         f"got {list(positions.shape)}")


class SinusoidalPE(torch.nn.Module):
    r"""Adds :func:`sinusoidal` to its input: :math:`x_t + \mathrm{PE}[t]`.

    Args:
        dim (int): feature size d of the input; must be even.
        base (float, optional): frequency base. (default: ``10000.0``)

    Shapes:
        - **input:** x ``(..., L, d)``; positions ``(L)``, integer or real (optional,
          default ``0 .. L-1``)
        - **output:** ``(..., L, d)``
    """

    def __init__(self, dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        dim = _check_dim(dim)
        _check_base(base)
        self.dim = dim
        self.base = float(base)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Add the encoding of ``positions`` (default ``0 .. L-1``) along dim -2 of ``x``."""
        if x.dim() < 2 or x.size(-1) != self.dim:
            raise ValueError(f"x must have shape [..., L, dim] with dim = {self.dim}, "
                             f"got {list(x.shape)}")
        if positions is None:
            positions = torch.arange(x.size(-2), device=x.device)
        _check_positions(positions, x.size(-2), integer=False)
        pe = _sinusoid(positions, self.dim, self.base)  # (L, d)
        # a float x keeps its dtype; an integer one is promoted, as x + LearnablePE's weights
        dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
        return x + pe.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}" + ("" if self.base == 10000.0 else f", base={self.base}")


class LearnablePE(torch.nn.Module):
    r"""A learned embedding per position, added to the input: :math:`x_t + P_t`.

    As in BERT and GPT-2; ``P`` starts as :math:`\mathcal{N}(0, 0.02^2)`.

    Args:
        max_len (int): number of positions that have an embedding; a position >= max_len
            raises an ``IndexError``.
        dim (int): feature size d of the input.

    Shapes:
        - **input:** x ``(..., L, d)``; positions ``(L)`` integer (optional, default
          ``0 .. L-1``)
        - **output:** ``(..., L, d)``
    """

    def __init__(self, max_len: int, dim: int) -> None:
        super().__init__()
        max_len = check_positive(max_len, "max_len")
        dim = check_positive(dim, "dim")
        self.max_len = max_len
        self.dim = dim
        self.weight = torch.nn.Parameter(torch.empty(max_len, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw the embeddings from a normal distribution with standard deviation 0.02."""
        torch.nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """Add the embedding of ``positions`` (default ``0 .. L-1``) along dim -2 of ``x``."""
        if x.dim() < 2 or x.size(-1) != self.dim:
            raise ValueError(f"x must have shape [..., L, dim] with dim = {self.dim}, "
                             f"got {list(x.shape)}")
        if positions is None:
            if x.size(-2) > self.max_len:
                raise IndexError(f"LearnablePE has max_len={self.max_len} positions, got a "
                                 f"sequence of length {x.size(-2)} (positions up to "
                                 f"{x.size(-2) - 1})")
            positions = torch.arange(x.size(-2), device=x.device)
        _check_positions(positions, x.size(-2), integer=True)
        if positions.numel() and _values_checkable() and (
                int(positions.min()) < 0 or int(positions.max()) >= self.max_len):
            lo, hi = int(positions.min()), int(positions.max())
            raise IndexError(f"positions must lie in [0, max_len) = [0, {self.max_len}), "
                             f"got values in [{lo}, {hi}]")
        return x + self.weight[positions.long()]  # uint8 would index as a boolean mask

    def extra_repr(self) -> str:
        return f"{self.max_len}, {self.dim}"


def _adjacency(edge_index: Tensor, num_nodes: int,
               edge_weight: np.ndarray | None = None) -> sp.csr_matrix:
    """Symmetric adjacency without self-loops (float64 CSR): binary without weights (multi-edges
    count once), else :math:`(W + W^\top) / 2` with the weights of multi-edges summed and the
    pairs whose weights sum to 0 left out."""
    src, dst = edge_index.long().cpu().numpy()
    keep = src != dst
    src, dst = src[keep], dst[keep]
    rows = np.concatenate([src, dst])
    cols = np.concatenate([dst, src])
    values = (np.ones(rows.size) if edge_weight is None
              else np.tile(edge_weight[keep], 2) / 2)  # each direction half of the weight
    adj = sp.csr_matrix((values, (rows, cols)), shape=(num_nodes, num_nodes))
    if edge_weight is None:
        adj.data[:] = 1.0  # duplicates were summed; keep one unit weight per pair
    else:
        adj.eliminate_zeros()  # a pair of weight 0 is no edge (nor joins components)
    return adj


def _fix_signs(vecs: np.ndarray) -> np.ndarray:
    """Flip each column so that its largest-magnitude entry (first one on a tie) is positive."""
    if vecs.size == 0:
        return vecs
    mag = np.abs(vecs)  # (N, k)
    tied = mag >= mag.max(axis=0, keepdims=True) * (1.0 - _SIGN_TIE_RTOL)
    first = tied.argmax(axis=0)  # (k,) first row of each column's top entries
    signs = np.sign(vecs[first, np.arange(vecs.shape[1])])
    return vecs * np.where(signs == 0, 1.0, signs)


@overload
def laplacian_pe(edge_index: Tensor, num_nodes: int, k: int, *, pad: bool = ...,
                 random_sign_flip: bool = ..., generator: torch.Generator | None = ...,
                 solver: str = ..., return_eigenvalues: Literal[False] = ...,
                 edge_weight: Tensor | None = ...) -> Tensor: ...


@overload
def laplacian_pe(edge_index: Tensor, num_nodes: int, k: int, *, pad: bool = ...,
                 random_sign_flip: bool = ..., generator: torch.Generator | None = ...,
                 solver: str = ..., return_eigenvalues: Literal[True],
                 edge_weight: Tensor | None = ...) -> tuple[Tensor, Tensor]: ...


@overload
def laplacian_pe(edge_index: Tensor, num_nodes: int, k: int, *, pad: bool = ...,
                 random_sign_flip: bool = ..., generator: torch.Generator | None = ...,
                 solver: str = ..., return_eigenvalues: bool,
                 edge_weight: Tensor | None = ...) -> Tensor | tuple[Tensor, Tensor]: ...


def laplacian_pe(edge_index: Tensor, num_nodes: int, k: int, *, pad: bool = False,
                 random_sign_flip: bool = False, generator: torch.Generator | None = None,
                 solver: str = "auto", return_eigenvalues: bool = False,
                 edge_weight: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    r"""Laplacian eigenvector positional encoding: the k lowest non-trivial graph frequencies.

    The graph is made undirected (an edge in either direction connects the two nodes;
    self-loops are dropped) and unweighted (multi-edges count once), or, with ``edge_weight``,
    weighted by :math:`A_{ij} = (W_{ij} + W_{ji}) / 2`, :math:`W_{ij}` the summed weights of
    the edges ``i -> j`` (an undirected graph given in both directions keeps its weights; a
    pair of weight 0 is no edge). With :math:`D = \operatorname{diag}(A \mathbf{1})` and the
    symmetric normalized Laplacian (:math:`D^{-1/2}_{ii} = 0` for an isolated node, so its row
    and column are 0)

    .. math::
        \mathcal{L} = D^{-1/2} (D - A) D^{-1/2}, \qquad
        \mathcal{L} u_m = \lambda_m u_m, \qquad \mathrm{PE} = [u_1, \dots, u_k],
        \qquad 0 < \lambda_1 \le \dots \le \lambda_k

    On the nodes with an edge this is :math:`I - D^{-1/2} A D^{-1/2}`. The trivial
    eigenvectors, :math:`\lambda = 0`, one per connected component C (:math:`D^{1/2}
    \mathbb{1}_C`, or :math:`e_i` for an isolated node i), say only which component a node is
    in and are left out: a graph with c components has ``N - c`` non-trivial eigenvectors
    (``N - 1`` when connected), and an isolated node's encoding is 0. Each column gets a
    deterministic sign: its largest-magnitude entry is positive (the first such entry, in node
    order, on a tie). When eigenvalues repeat (symmetric graphs) the basis inside an eigenspace
    is arbitrary; only the span is determined. On chains and cycles the columns are the
    sinusoidal encoding's cosines and sin/cos pairs (see :mod:`graphattn.pe`).

    Up to :data:`DENSE_SOLVER_MAX_NODES` nodes the dense ``numpy.linalg.eigh`` runs (on the
    nodes that have an edge, isolated ones left out); above it
    ``scipy.sparse.linalg.eigsh`` (Lanczos) runs on :math:`\mathcal{L}` with the trivial
    eigenvectors shifted to eigenvalue 3, above the spectrum, from seeded start vectors: in
    shift-invert mode, on one sparse LU factorization, when that factorization is small and the
    lowest eigenvalues are small, which makes plain Lanczos slow (paths, grids, meshes, citation
    graphs; see :data:`SHIFT_INVERT_MAX_ENVELOPE` and :data:`SHIFT_INVERT_MAX_EIGENVALUE`),
    else on :math:`\mathcal{L}` itself (random and expander-like graphs, where Lanczos
    converges quickly anyway). One start vector finds one vector per eigenspace, so it runs
    again from a new one, with the eigenvectors found moved above the spectrum too, until a run
    finds nothing below the k-th eigenvalue: a repeated eigenvalue (symmetric graphs) gets all its
    eigenvectors. A graph whose factorization would be too large but whose lowest eigenvalues
    are small all the same (a random graph with a path hanging off it) gets a
    Chebyshev-filtered subspace iteration instead, on a block of seeded random vectors (see
    :data:`CHEBYSHEV_MAX_EIGENVALUE`), which sees every direction of a repeated eigenvalue
    at once.

    Args:
        edge_index (Tensor): ``[2, E]`` integer.
        num_nodes (int): number of nodes N.
        k (int): number of eigenvectors.
        pad (bool, optional): if the graph has fewer than k non-trivial eigenvectors (always
            when ``k >= N``), fill the missing columns (and eigenvalues) with zeros instead of
            raising. (default: ``False``)
        random_sign_flip (bool, optional): multiply each column by a random sign, the usual
            training augmentation that teaches a model the sign does not matter.
            (default: ``False``)
        generator (torch.Generator, optional): source of the random signs. (default: ``None``)
        solver (str, optional): ``"auto"``, ``"dense"`` or ``"sparse"``; ``"sparse"`` falls
            back to dense when k is close to ``N - c`` (always when ``k >= N - c - 1``): too
            little room is left beside the eigenvectors for Lanczos. (default: ``"auto"``)
        return_eigenvalues (bool, optional): also return :math:`\lambda_1 .. \lambda_k`.
            (default: ``False``)
        edge_weight (Tensor, optional): ``[E]`` non-negative finite weight of each edge.
            (default: ``None``, the unweighted graph)

    Shapes:
        - **input:** edge_index ``(2, E)``, edge_weight ``(E)``
        - **output:** ``(N, k)`` in the default float dtype on the device of ``edge_index``;
          eigenvalues ``(k)`` when ``return_eigenvalues``
    """
    num_nodes = check_non_negative(num_nodes, "num_nodes")
    k = check_positive(k, "k")
    pad = check_flag(pad, "pad")
    random_sign_flip = check_flag(random_sign_flip, "random_sign_flip")
    return_eigenvalues = check_flag(return_eigenvalues, "return_eigenvalues")
    check_generator(generator)
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    check_edge_index(edge_index, num_src=num_nodes, num_dst=num_nodes)
    weight = None if edge_weight is None else _edge_weights(edge_weight, edge_index.size(1),
                                                            edge_index, num_nodes,
                                                            self_loops=False)
    adj = _adjacency(edge_index, num_nodes, weight)
    deg = np.asarray(adj.sum(axis=1)).ravel()  # (N,)
    active = deg > 0
    inv_sqrt = np.zeros_like(deg)
    np.divide(1.0, np.sqrt(deg), out=inv_sqrt, where=active)
    scale = sp.diags(inv_sqrt)
    lap = (sp.diags(active.astype(np.float64)) - scale @ adj @ scale).tocsr()  # (N, N)

    num_trivial, labels = (connected_components(adj, directed=False) if num_nodes
                           else (0, np.zeros(0, dtype=np.int64)))  # labels: (N,) component
    available = num_nodes - num_trivial
    if k > available and not pad:
        raise ValueError(f"k must be at most the number of non-trivial eigenvectors, "
                         f"N - c = {num_nodes} - {num_trivial} = {available} (c = connected "
                         f"components, isolated nodes included), got k={k}; pass pad=True "
                         f"to fill the missing columns with zeros")
    n_eig = min(k, available)

    vals, vecs = np.zeros(0), np.zeros((num_nodes, 0))
    use_sparse = solver == "sparse" or (solver == "auto" and num_nodes > DENSE_SOLVER_MAX_NODES)
    null = _null_space(deg, labels, num_trivial)  # (N, c)
    if n_eig > 0 and use_sparse and n_eig < available - 1:
        vals, vecs = _sparse_smallest(lap, null, n_eig)
    elif n_eig > 0:
        vals, vecs = _dense_smallest(lap, null, n_eig)
    vals = np.maximum(vals, 0.0)  # L is positive semi-definite; rounding gave -5e-16
    vecs[~active] = 0.0  # exactly: orthogonal to every e_i of an isolated node
    vecs = _fix_signs(vecs)

    pe = torch.zeros(num_nodes, k, dtype=torch.float64)
    pe[:, :n_eig] = torch.from_numpy(vecs)
    eigenvalues = torch.zeros(k, dtype=torch.float64)
    eigenvalues[:n_eig] = torch.from_numpy(vals)
    if random_sign_flip:
        # drawn where the generator draws (a CUDA generator beside a CUDA edge_index)
        where = "cpu" if generator is None else generator.device
        signs = torch.randint(0, 2, (k,), generator=generator, device=where) * 2 - 1  # (k,)
        pe = pe * signs.cpu()
    pe.masked_fill_(pe == 0, 0.0)  # a flipped column's zeros (isolated nodes, padding) were -0.0
    dtype, device = torch.get_default_dtype(), edge_index.device
    pe = pe.to(device=device, dtype=dtype)
    if return_eigenvalues:
        return pe, eigenvalues.to(device=device, dtype=dtype)
    return pe


def _null_space(deg: np.ndarray, labels: np.ndarray, num_trivial: int) -> sp.csr_matrix:
    r"""The null space of :math:`\mathcal{L}` in closed form, ``[N, c]`` orthonormal columns:
    :math:`D^{1/2} \mathbb{1}_C / \lVert D^{1/2} \mathbb{1}_C \rVert` per component C,
    :math:`e_i` for an isolated node i."""
    num_nodes = deg.shape[0]
    values = np.where(deg > 0, np.sqrt(deg), 1.0)  # (N,) unnormalized null vectors
    norms = np.sqrt(np.bincount(labels, weights=values**2, minlength=num_trivial))
    return sp.csr_matrix((values / norms[labels], (np.arange(num_nodes), labels)),
                         shape=(num_nodes, num_trivial))


def _dense_smallest(lap: sp.csr_matrix, null: sp.csr_matrix,
                    n_eig: int) -> tuple[np.ndarray, np.ndarray]:
    r"""The ``n_eig`` smallest non-trivial eigenpairs of ``lap`` by ``numpy.linalg.eigh``, on
    the nodes with an edge only: an isolated node adds just an eigenvalue 0 (e_i), and a large
    graph with few edges must not build an N x N matrix.

    The null space (``null``, U) is moved to eigenvalue 3, above the spectrum:
    ``eigh`` of :math:`\mathcal{L} + 3 U U^T`. Skipping the c lowest eigenvectors of
    :math:`\mathcal{L}` instead would trust ``eigh`` to separate eigenvalue 0 from the
    smallest genuine one, which it cannot when that one is near rounding (a weak link, weight
    1e-13 against 1, mixed the trivial vector into the encoding)."""
    active = lap.diagonal() > 0  # 1 on a node with an edge (no self-loops), 0 on an isolated one
    sub_null = null[active].toarray()  # (N_active, c); isolated nodes' columns are 0
    sub = lap[active][:, active].toarray() + 3.0 * sub_null @ sub_null.T
    sub_vals, sub_vecs = np.linalg.eigh(sub)  # ascending; the trivial ones at 3, last
    vecs = np.zeros((lap.shape[0], n_eig))
    vecs[active] = sub_vecs[:, :n_eig]
    return sub_vals[:n_eig], vecs


def _sparse_smallest(lap: sp.csr_matrix, null: sp.csr_matrix,
                     n_eig: int) -> tuple[np.ndarray, np.ndarray]:
    r"""The ``n_eig`` smallest eigenpairs of ``lap`` orthogonal to its null space, by Lanczos
    or, for small eigenvalues where the factorization is not taken, a Chebyshev filter.

    The null space is known in closed form (:math:`D^{1/2} 1_C` per component C, :math:`e_i`
    for an isolated node; orthonormal columns U); :math:`M = \mathcal{L} + 3 U U^T` moves it
    above the spectrum (which ends at 2, an eigenvalue of every bipartite component), so Lanczos
    never has to resolve the repeated eigenvalue 0 nor mistake a trivial vector for a genuine one.

    Lanczos from one start vector v finds one vector per eigenspace: the Krylov space of v
    holds only the projection of v on each eigenspace, so the other directions of a repeated
    eigenvalue (symmetric graphs: hypercubes, tori, unions of equal components, leaves on one
    hub) stay hidden unless rounding happens to bring them in. So it runs in rounds, each from a
    new random start vector on M with the eigenvectors found so far moved above the spectrum
    too (columns of U): a round that collects eigenpairs until there are ``n_eig``, then a check
    round (loose tolerance, one eigenvalue) for the lowest eigenvalue left. A Ritz value is an
    upper bound of the lowest eigenvalue left, so a check below the ``n_eig``-th eigenvalue
    found means eigenpairs were missed; another round collects them, and a check follows. When
    the eigenvalues have few distinct values ARPACK can also run out of restart shifts
    (``ArpackError`` 3: every unwanted Ritz value exact); the round then asks for half as many.

    The lowest eigenvalues of long paths and grids are tiny and crowded (about
    :math:`\pi^2 m^2 / 2 (N - 1)^2` on a path), where Lanczos on M needs many iterations. When the
    factorization is affordable (:func:`_envelope`) and, for a wide envelope, a probe finds the
    smallest eigenvalue small (:func:`_smallest_estimate`), Lanczos runs on
    :math:`(M - \sigma I)^{-1}` instead, which maps them to the largest and best separated
    values. Since U spans an invariant subspace of :math:`\mathcal{L}`,

    .. math::
        (M - \sigma I)^{-1} = P (\mathcal{L} - \sigma I)^{-1} P + \frac{U U^T}{3 - \sigma},
        \qquad P = I - U U^T

    (up to the eigenvalues U has in M, all far from the wanted ones) with one sparse LU
    factorization of :math:`\mathcal{L} - \sigma I`, :math:`\sigma < 0`, for every round.
    Lanczos needs room in the complement of U: when ``n_eig`` is close to ``N - c`` (small
    graphs) the dense solver takes over.

    Where the envelope is above ``SHIFT_INVERT_MAX_ENVELOPE`` and the probe finds the smallest
    eigenvalue below ``CHEBYSHEV_MAX_EIGENVALUE`` all the same (and ``n_eig`` is at most
    ``CHEBYSHEV_MAX_K``), :func:`_chebyshev_smallest` runs instead of Lanczos on M; should it
    not converge, the Lanczos rounds follow.
    """
    num_nodes, num_trivial = null.shape
    lu = None
    envelope = _envelope(lap)
    if envelope <= SHIFT_INVERT_MAX_ENVELOPE:
        if (envelope <= SHIFT_INVERT_PROBE_WIDTH * num_nodes
                or _smallest_below(lap, null, SHIFT_INVERT_MAX_EIGENVALUE)):
            shifted = (lap - _SHIFT * sp.identity(num_nodes, format="csc")).tocsc()
            lu = splu(shifted, permc_spec="MMD_AT_PLUS_A", options={"SymmetricMode": True})
    elif n_eig <= CHEBYSHEV_MAX_K and _smallest_below(lap, null, CHEBYSHEV_MAX_EIGENVALUE):
        filtered = _chebyshev_smallest(lap, null, n_eig)
        if filtered is not None:
            return filtered
    rng = np.random.default_rng(0)
    available = num_nodes - num_trivial
    vals, vecs = np.zeros(0), np.zeros((num_nodes, 0))  # found so far, ascending
    want, check = n_eig, False  # what the next round asks for, and whether it is a check
    most = n_eig  # the most a round asks for, halved on each ArpackError
    while True:
        # ARPACK's Krylov space, of 2 * size + 1 vectors at least, must fit in the complement
        size = min(want, most, (available - vals.size - 1) // 2)
        if size < 1:
            return _dense_smallest(lap, null, n_eig)
        try:
            new_vals, new_vecs = _deflated_lanczos(lap, null, vecs, lu, size, rng,
                                                   tol=_CHECK_TOL if check else 0.0)
        except ArpackError as error:  # 3: no shifts could be applied
            if isinstance(error, ArpackNoConvergence) or size == 1:
                raise
            most = size // 2
            continue
        if check:
            kth = vals[n_eig - 1]
            if new_vals[0] >= kth * (1 - _MISSED_RTOL):
                return vals[:n_eig], vecs[:, :n_eig]
            # missed: at most the found eigenvalues above it are displaced; collect that many
            want, check = int((vals[:n_eig] > new_vals[0]).sum()), False
            continue
        vals = np.concatenate([vals, new_vals])
        vecs = np.concatenate([vecs, new_vecs], axis=1)
        order = np.argsort(vals, kind="stable")
        vals, vecs = vals[order], vecs[:, order]
        want, check = (1, True) if vals.size >= n_eig else (n_eig - vals.size, False)


def _deflated_lanczos(lap: sp.csr_matrix, null: sp.csr_matrix, found: np.ndarray,
                      lu: SuperLU | None, want: int, rng: np.random.Generator,
                      tol: float) -> tuple[np.ndarray, np.ndarray]:
    r"""The ``want`` smallest eigenpairs, ascending, of :math:`\mathcal{L}` on the complement of
    the null space ``null`` and the eigenvectors ``found`` (orthonormal columns U of both), by
    Lanczos on :math:`M = \mathcal{L} + 3 U U^T` from a random start vector in that complement:
    in shift-invert mode with ``lu`` (a factorization of :math:`\mathcal{L} - \sigma I`), else on
    M itself."""
    num_nodes = lap.shape[0]
    found = np.asfortranarray(found)  # (N, found): each column contiguous for einsum

    def on_moved(x: np.ndarray) -> np.ndarray:
        # U U^T x. np.einsum's own loops, not numpy's BLAS: the threads of that second BLAS,
        # woken between ARPACK's calls into scipy's, made a check round 2-3x slower (2 cores).
        coef = np.einsum("nk,n...->k...", found, x)
        return null @ (null.T @ x) + np.einsum("nk,k...->n...", found, coef)

    def matvec(x: np.ndarray) -> np.ndarray:
        x = x.reshape(num_nodes, -1)
        return lap @ x + _TRIVIAL_SHIFT * on_moved(x)

    op = LinearOperator((num_nodes, num_nodes), matvec=matvec, matmat=matvec, dtype=np.float64)
    v0 = rng.standard_normal(num_nodes)
    v0 -= on_moved(v0)
    complement = num_nodes - null.shape[1] - found.shape[1]
    ncv = min(max(2 * want + 1, 20), complement)  # Lanczos vectors, all in the complement
    if lu is None:
        vals, vecs = eigsh(op, k=want, which="SA", v0=v0, ncv=ncv, tol=tol)
    else:
        def solve(x: np.ndarray) -> np.ndarray:
            x = x.reshape(num_nodes, -1)
            moved_x = on_moved(x)
            y = lu.solve(np.ascontiguousarray(x - moved_x))
            return y - on_moved(y) + moved_x / (_TRIVIAL_SHIFT - _SHIFT)

        inverse = LinearOperator((num_nodes, num_nodes), matvec=solve, matmat=solve,
                                 dtype=np.float64)
        vals, vecs = eigsh(op, k=want, sigma=_SHIFT, which="LM", OPinv=inverse, v0=v0, ncv=ncv,
                           tol=tol)
    # A breakdown (few distinct eigenvalues) restarts Lanczos from a random vector of ARPACK's
    # own, which has components on U: what it returns at 3 or above is U, not an eigenvector.
    keep = vals < (2.0 + _TRIVIAL_SHIFT) / 2
    order = np.argsort(vals[keep])
    return vals[keep][order], vecs[:, keep][:, order]


# Restarts of the probe of _smallest_estimate: about 100 products with the Laplacian (20
# Lanczos vectors), a few ms on the citation graphs.
_PROBE_RESTARTS = 5


def _smallest_estimate(lap: sp.csr_matrix, null: sp.csr_matrix) -> float:
    r"""The smallest eigenvalue of :math:`\mathcal{L}` on the complement of its null space
    ``null``, from a few Lanczos restarts (``_PROBE_RESTARTS``, tolerance 1e-2, a fixed start
    vector); 0 when they do not converge: a small, crowded low end is what keeps Lanczos from
    converging, and what shift-invert is for."""
    num_nodes = lap.shape[0]
    ncv = min(20, num_nodes - null.shape[1] - 1)
    if ncv < 3:
        return 0.0

    def matvec(x: np.ndarray) -> np.ndarray:
        x = x.reshape(num_nodes, -1)
        return lap @ x + _TRIVIAL_SHIFT * (null @ (null.T @ x))

    op = LinearOperator((num_nodes, num_nodes), matvec=matvec, matmat=matvec, dtype=np.float64)
    v0 = np.random.default_rng(1).standard_normal(num_nodes)
    v0 -= null @ (null.T @ v0)
    try:
        vals = eigsh(op, k=1, which="SA", v0=v0, ncv=ncv, maxiter=_PROBE_RESTARTS, tol=1e-2,
                     return_eigenvectors=False)
    except ArpackError:  # ArpackNoConvergence among them
        return 0.0
    return float(vals.min())


def _smallest_below(lap: sp.csr_matrix, null: sp.csr_matrix, limit: float) -> bool:
    """Whether the smallest non-trivial eigenvalue of ``lap`` lies below ``limit``: always
    when ``limit`` is infinite (no probe), never when it is at most 0, else as
    :func:`_smallest_estimate` finds it."""
    if limit <= 0:
        return False
    return math.isinf(limit) or _smallest_estimate(lap, null) < limit


def _chebyshev_smallest(lap: sp.csr_matrix, null: sp.csr_matrix,
                        n_eig: int) -> tuple[np.ndarray, np.ndarray] | None:
    r"""The ``n_eig`` smallest eigenpairs of ``lap`` orthogonal to its null space, ascending,
    by Chebyshev-filtered subspace iteration (Zhou and Saad, 2007); ``None`` when it does not
    converge.

    A block X of ``p = n_eig + max(n_eig, 8)`` orthonormal vectors in the complement of the
    null space (orthonormal columns U) goes through sweeps: Rayleigh-Ritz of
    :math:`\mathcal{L}` on X, which gives Ritz values :math:`\theta_1 \le \dots \le
    \theta_p`, upper bounds of :math:`\lambda_1 .. \lambda_p`; then

    .. math::
        X \leftarrow C_d(M) X, \qquad M = \mathcal{L} + 2 U U^T, \qquad
        C_d(\lambda) = \frac{T_d((a + b - 2 \lambda) / (b - a))}{T_d((a + b) / (b - a))},
        \qquad a = \theta_p, \; b = 2

    with :math:`T_d` the Chebyshev polynomial of degree d. M has the spectrum of
    :math:`\mathcal{L}` on the complement, in [0, 2], and U at 2, inside [a, b], where
    :math:`\lvert C_d \rvert \le 1 / T_d((a + b) / (b - a))`; below a, :math:`C_d` grows
    monotonically up to 1 at 0. So the eigenvectors below a, the wanted ones among them
    (:math:`\lambda_{n\_eig} \le \lambda_p \le \theta_p`), gain on all the others, U
    included (on :math:`\mathcal{L}` itself U would sit at 0 and the trivial components left by
    rounding would gain most). The degree d that gains a given factor grows as
    :math:`\sqrt{b / a}` only: Lanczos needs as many products, but ARPACK, with few Lanczos
    vectors, restarts and throws most of them away (a random graph of 18000 nodes, mean degree
    4, with a 2000-node path hanging off it, k = 8: 56000 products for the eigenpairs and 7900
    for the check round, against 1800 products of blocks of 16 here). d makes :math:`C_d`
    about ``e^_CHEBYSHEV_GAIN`` times larger at 0 than on [a, b], a range of column sizes that
    the orthonormalization resolves.

    It stops when every wanted Ritz pair has a residual :math:`\lVert \mathcal{L} x - \theta
    x \rVert` of at most ``_CHEBYSHEV_TOL``. The block holds every direction of a repeated
    eigenvalue, so no check round follows; but when such an eigenvalue fills the block,
    :math:`\theta_p` converges to the wanted ones and the filter separates nothing, so a sweep
    that would gain less than a factor 4 on :math:`\theta_{n\_eig}` doubles p instead (up to
    8 times its first size), with new random columns. It gives up after three sweeps in a row
    that do not cut the largest residual by 4, or ``_CHEBYSHEV_MAX_SWEEPS`` sweeps.
    """
    num_nodes, num_trivial = null.shape
    available = num_nodes - num_trivial
    size = min(n_eig + max(n_eig, 8), available)
    most = min(8 * size, available)  # the largest block it grows to
    null_t = null.T.tocsr()
    rng = np.random.default_rng(0)
    block = rng.standard_normal((num_nodes, size))
    filtered, best, stalls = False, math.inf, 0
    for _ in range(_CHEBYSHEV_MAX_SWEEPS):
        block = np.linalg.qr(block - null @ (null_t @ block))[0]  # (N, p) orthonormal
        product = lap @ block  # (N, p)
        theta, rotation = np.linalg.eigh(block.T @ product)  # (p,) ascending Ritz values
        block, product = block @ rotation, product @ rotation
        residual = np.linalg.norm(product[:, :n_eig] - block[:, :n_eig] * theta[:n_eig],
                                  axis=0).max()
        if residual <= _CHEBYSHEV_TOL:
            return theta[:n_eig], block[:, :n_eig]
        lower = float(theta[-1])
        degree = _chebyshev_degree(lower)
        gain = degree * _chebyshev_rate(float(theta[n_eig - 1]), lower)
        # A filtered block whose last Ritz value is the wanted ones' (a repeated eigenvalue
        # fills it), or one that reaches 2, leaves the filter nothing to separate: more columns.
        if degree == 0 or (filtered and gain < math.log(4.0)):
            if size == most:
                return None
            size = min(2 * size, most)
            block = np.concatenate(
                [block, rng.standard_normal((num_nodes, size - block.shape[1]))], axis=1)
            filtered, best, stalls = False, math.inf, 0
            continue
        if filtered:  # three sweeps in a row that do not cut the residual by 4: rounding
            stalls = stalls + 1 if residual > best / 4 else 0
            if stalls == 3:
                return None
            best = min(best, residual)
        block = _chebyshev_filter(lap, null, null_t, block, lower, degree)
        filtered = True
    return None


def _chebyshev_rate(value: float, lower: float) -> float:
    r"""How fast the Chebyshev filter of [``lower``, 2] grows at ``value`` below it, per degree:
    :math:`\operatorname{arccosh} x = 2 \operatorname{artanh} \sqrt{(a - \lambda) /
    (b - \lambda)}` at :math:`x = (a + b - 2 \lambda) / (b - a)`, the form that stays
    accurate when a is tiny; 0 at or above ``lower``."""
    if not value < lower < 2.0:
        return 0.0
    return 2.0 * math.atanh(math.sqrt((lower - value) / (2.0 - value)))


def _chebyshev_degree(lower: float) -> int:
    """The degree of the filter of [``lower``, 2]: its value at 0 about ``e^_CHEBYSHEV_GAIN``
    times its largest on that interval, at most ``_CHEBYSHEV_MAX_DEGREE``; 0 when the interval
    does not lie above 0 (nothing to separate)."""
    rate = _chebyshev_rate(0.0, lower)
    if rate == 0.0:
        return 0
    return min(math.ceil(_CHEBYSHEV_GAIN / rate), _CHEBYSHEV_MAX_DEGREE)


def _chebyshev_filter(lap: sp.csr_matrix, null: sp.csr_matrix, null_t: sp.csr_matrix,
                      block: np.ndarray, lower: float, degree: int) -> np.ndarray:
    r""":math:`C_d(M) X` of :func:`_chebyshev_smallest`, damping [``lower``, 2], d =
    ``degree`` >= 1: the scaled three-term recurrence of Zhou and Saad (2007), whose iterates
    stay of the size of X."""
    upper = 2.0
    half, center = (upper - lower) / 2, (upper + lower) / 2

    def shifted(x: np.ndarray) -> np.ndarray:  # (M - center I) x, (N, p)
        out = lap @ x
        out += upper * (null @ (null_t @ x))
        out -= center * x
        return out

    sigma = -half / center  # the recurrence's scale: 1 / T_j at 0, relatively
    tau = 2.0 / sigma
    previous, current = block, shifted(block) * (sigma / half)  # (N, p): C_0 X, C_1 X
    for _ in range(degree - 1):
        sigma_next = 1.0 / (tau - sigma)
        following = shifted(current)
        following *= 2.0 * sigma_next / half
        following -= (sigma * sigma_next) * previous
        previous, current, sigma = current, following, sigma_next
    return current


def _envelope(lap: sp.csr_matrix) -> int:
    """Entries between each row's first non-zero and its diagonal, in reverse Cuthill-McKee
    order: the storage of a factorization in that order, an upper bound for the sparser
    minimum-degree order :func:`_sparse_smallest` uses (paths: N; grids: N times the side;
    random graphs: near N^2 / 2)."""
    pattern = (lap + sp.identity(lap.shape[0], format="csr")).tocsr()  # no empty row
    order = reverse_cuthill_mckee(pattern, symmetric_mode=True)
    pattern = pattern[order][:, order].tocsr()
    first = np.minimum.reduceat(pattern.indices, pattern.indptr[:-1])  # (N,)
    return int((np.arange(pattern.shape[0]) - first).sum())


def random_walk_pe(edge_index: Tensor, num_nodes: int, k: int, *,
                   edge_weight: Tensor | None = None) -> Tensor:
    r"""Random-walk positional encoding: the return probabilities of 1..k-step walks.

    A walker at node j moves along one of j's outgoing edges ``j -> i``, chosen uniformly, or
    with probability proportional to its weight when ``edge_weight`` is given (parallel edges
    count separately, a self-loop lets it stay):

    .. math::
        P = D_{\text{out}}^{-1} A, \qquad A_{ji} = \sum_{\text{edges } e = j \to i} w_e,
        \qquad D_{\text{out}} = \operatorname{diag}(A \mathbf{1}), \qquad
        \mathrm{PE}[i, t - 1] = (P^t)_{ii}, \quad t = 1 .. k

    with :math:`w_e = 1` without weights (:math:`A_{ji}` counts the edges), so an edge of
    integer weight w is w parallel edges. A node without outgoing edges (or whose weights sum
    to 0) ends every walk: its return probabilities are 0. Every entry is a probability, in
    [0, 1]. Without weights, on graphs without parallel edges, this is PyG's
    ``AddRandomWalkPE``; on a multigraph with at most 2000 nodes that one keeps a single copy
    of each parallel edge, weighted by the inverse degree counted with all copies, so its rows
    of P sum to less than 1; and with weights it gives each edge :math:`1 / \max(1, d_j)`,
    :math:`d_j` the weighted degree, not :math:`w_e / d_j`, so its entries can exceed 1
    (pyg-team/pytorch_geometric#10098). Unlike
    :func:`laplacian_pe` the encoding is unique (no sign or basis choice) and relabelling the
    nodes permutes its rows. Computed in float64, on blocks of nodes: each diagonal entry as
    the product of a row and a column of the half powers,
    :math:`(P^t)_{ii} = \sum_j (P^{\lceil t/2 \rceil})_{ij} (P^{\lfloor t/2 \rfloor})_{ji}`,
    multiplied as sparse matrices while they stay sparse (walks on paths, grids and meshes stay
    local: time linear in N; see :data:`RANDOM_WALK_SPARSE_MAX_NNZ`), the columns taken from
    the rows on undirected graphs; else by sparse products on dense blocks of columns of the
    identity, so memory stays ``O(E + N * block)``. ``benchmarks/random_walk_pe.py`` times it
    against PyG's ``AddRandomWalkPE``.

    Args:
        edge_index (Tensor): ``[2, E]`` integer.
        num_nodes (int): number of nodes N.
        k (int): number of walk lengths.
        edge_weight (Tensor, optional): ``[E]`` non-negative finite weight of each edge, the
            walker's preference for it. (default: ``None``, every edge 1)

    Shapes:
        - **input:** edge_index ``(2, E)``, edge_weight ``(E)``
        - **output:** ``(N, k)`` in the default float dtype on the device of ``edge_index``
    """
    num_nodes = check_non_negative(num_nodes, "num_nodes")
    k = check_positive(k, "k")
    check_edge_index(edge_index, num_src=num_nodes, num_dst=num_nodes)
    src, dst = edge_index.long().cpu().numpy()
    weight = (np.ones(src.size) if edge_weight is None
              else _edge_weights(edge_weight, src.size, edge_index, num_nodes))
    adj = sp.csr_matrix((weight, (src, dst)), shape=(num_nodes, num_nodes))
    adj.eliminate_zeros()  # every entry left has a weight > 0, so its row a degree > 0
    out_deg = np.asarray(adj.sum(axis=1)).ravel()  # (N,)
    walk = adj.copy()  # (N, N) row-stochastic (or zero rows): each entry over its row's degree
    walk.data /= np.repeat(out_deg, np.diff(adj.indptr))
    # undirected: the columns of P follow from its rows, through ratios of degrees (while
    # their inverses are finite: weights down to 1e-300 of the largest)
    positive = out_deg[out_deg > 0]
    symmetric = (positive.size == 0 or positive.min() >= 1e-300) and (adj != adj.T).nnz == 0
    return_prob = _return_probabilities(walk, k, out_deg if symmetric else None)  # (N, k)
    return torch.from_numpy(return_prob).to(device=edge_index.device,
                                            dtype=torch.get_default_dtype())


def _edge_weights(edge_weight: Tensor, num_edges: int,
                  edge_index: Tensor | None = None, num_nodes: int = 0,
                  self_loops: bool = True) -> np.ndarray:
    """``edge_weight`` as float64 numpy ``[E]``, checked (a floating-point tensor of shape
    ``[E]`` whose entries are finite and non-negative) and, given the graph, divided by the
    largest entry of its connected component: neither encoding sees a factor common to a
    component, and weights near the ends of the float range would make degrees or their
    inverses overflow. (By the largest of all, a component of weights 1e-30 beside one of
    1e300 would round to 0, and lose its edges.) ``self_loops=False``: the encoding drops
    the self-loops, whose weights are then 0 and set no component's largest."""
    if not isinstance(edge_weight, Tensor) or not edge_weight.is_floating_point():
        what = edge_weight.dtype if isinstance(edge_weight, Tensor) else type(edge_weight).__name__
        raise TypeError(f"edge_weight must be a floating-point tensor, got {what}")
    if edge_weight.shape != (num_edges,):
        raise ValueError(f"edge_weight must have shape [E] = [{num_edges}], "
                         f"got {list(edge_weight.shape)}")
    weight = edge_weight.detach().double().cpu().numpy()
    bad = ~np.isfinite(weight) | (weight < 0)
    if bad.any():
        raise ValueError(f"edge_weight must be finite and non-negative, got "
                         f"{float(weight[bad][0])} at edge {int(np.flatnonzero(bad)[0])}")
    if edge_index is None:
        return weight
    src, dst = edge_index.long().cpu().numpy()
    kept = weight > 0  # (a weight of 0 is no edge)
    structure = sp.csr_matrix((np.ones(int(kept.sum())), (src[kept], dst[kept])),
                              shape=(num_nodes, num_nodes))
    _, labels = connected_components(structure, directed=False)  # (N,)
    largest = np.zeros(labels.max(initial=-1) + 1)
    if not self_loops:
        weight = np.where(src != dst, weight, 0.0)  # (dropped by the encoding)
    np.maximum.at(largest, labels[src], weight)  # each component's largest weight
    scale = largest[labels[src]]  # (E,)
    return np.divide(weight, scale, out=np.zeros_like(weight), where=scale > 0)


def _return_probabilities(walk: sp.csr_matrix, k: int,
                          degree: np.ndarray | None = None) -> np.ndarray:
    r"""The diagonals of ``walk^1 .. walk^k``, ``[N, k]``, block of nodes by block of nodes.

    A diagonal entry of a power is the product of a row of one half power and a column of the
    other, :math:`(P^{a + b})_{ii} = \sum_j (P^a)_{ij} (P^b)_{ji}` with
    :math:`a = \lceil t / 2 \rceil`, :math:`b = \lfloor t / 2 \rfloor`, so a block needs the
    rows and the columns of the powers up to :math:`\lceil k / 2 \rceil` only. ``degree``
    (the degrees D of a symmetric adjacency A, with ``walk`` = :math:`D^{-1} A`) says the
    columns follow from the rows, :math:`(P^b)_{ji} = d_i (P^b)_{ij} / d_j`, since
    :math:`P^\top = D P D^{-1}`: then only the rows are multiplied.

    Rows and columns are multiplied as sparse matrices while each product has at most
    :data:`RANDOM_WALK_SPARSE_MAX_NNZ` entries (a bound counted before it is formed): walks on
    paths, grids and meshes stay local, and the half powers fill in far less than the full
    ones (on a grid, :math:`(2a + 1)^2` entries a row instead of :math:`(2t + 1)^2`), so the
    whole graph is one block or a few, in time linear in N. A block whose next product would
    have too many entries is halved, each half going on from the rows it has (nothing is
    recomputed), down to ``2^23 / N`` nodes, whose columns of the powers are then multiplied
    as a dense ``[N, block]`` matrix."""
    num_nodes = walk.shape[0]
    out = np.zeros((num_nodes, k))
    if num_nodes == 0:
        return out
    row_nnz = np.diff(walk.indptr)  # (N,) entries of each row of the walk
    if degree is None:
        walk_t = walk.transpose().tocsr()  # (N, N): rows of P^T are the columns of P
        col_nnz = np.diff(walk_t.indptr)  # (N,) entries of each column
    else:
        inv_degree = np.divide(1.0, degree, out=np.zeros_like(degree), where=degree > 0)
    dense_block = max(1, (1 << 23) // num_nodes)
    # Blocks to compute: nodes [start, stop), the next walk length t, and the block's rows
    # (B, N) of P^a, and of (P^T)^b without degree, for a, b of walk length t - 1. (A block
    # splits where a product would fill in; with degree that is where a grows, which replaces
    # the rows of P^(a-1) before they are read again.)
    pending = [(0, num_nodes, 1, None, None)]
    while pending:
        start, stop, t, rows, cols = pending.pop()
        previous = None  # (B, N): rows of P^(a-1), for the columns of P^b when b = a - 1
        nodes = np.arange(start, stop)  # (B,)
        bound = 0  # of the entries of the next product, at a break
        while t <= k:
            a, b = (t + 1) // 2, t // 2
            if t == 1:
                rows = walk[start:stop]
            elif a > b:  # a grew: rows of P^a from those of P^(a-1)
                bound = int(row_nnz[rows.indices].sum())  # >= nnz(rows @ walk)
                if bound > RANDOM_WALK_SPARSE_MAX_NNZ:
                    break
                previous, rows = rows, rows @ walk
            elif degree is None and b == 1:
                cols = walk_t[start:stop]
            elif degree is None:  # b grew: columns of P^b
                bound = int(col_nnz[cols.indices].sum())
                if bound > RANDOM_WALK_SPARSE_MAX_NNZ:
                    break
                cols = cols @ walk_t
            if b == 0:
                out[nodes, t - 1] = np.asarray(rows[nodes - start, nodes]).ravel()
            elif degree is None:  # sum_j (P^a)_ij (P^b)_ji
                out[nodes, t - 1] = np.asarray(rows.multiply(cols).sum(axis=1)).ravel()
            else:  # d_i sum_j (P^a)_ij (P^b)_ij / d_j
                both = rows.power(2) if a == b else rows.multiply(previous)  # (B, N)
                out[nodes, t - 1] = degree[nodes] * (both @ inv_degree)
            t += 1
        if t > k:
            continue
        # The rows fill in. Dense columns of the powers once a block fits and its next sparse
        # product would cost as much as a dense step (E multiply-adds a node), else halves.
        if stop - start <= dense_block and (
                stop - start == 1
                or _SPARSE_PRODUCT_COST * bound >= walk.nnz * (stop - start)):
            y = np.zeros((num_nodes, nodes.size))
            y[nodes, nodes - start] = 1.0  # columns of the identity
            for step in range(k):
                y = walk @ y  # (N, B): columns of P^(step+1)
                out[nodes, step] = y[nodes, nodes - start]
            continue
        half = (stop - start) // 2  # each half goes on from its rows at walk length t
        for lo, hi in ((start + half, stop), (start, start + half)):
            part = slice(lo - start, hi - start)
            pending.append((lo, hi, t, rows[part], None if cols is None else cols[part]))
    return out


def _graph_of(data: Data, transform: str) -> tuple[Tensor, int]:
    """``(edge_index, num_nodes)`` of a homogeneous graph, checked before anything reads it (a
    batch's split, its edge weights): no ``edge_index`` means no edges, and a numpy or 0-d
    tensor ``num_nodes`` (as PyG's own transforms take) becomes an int."""
    if not isinstance(data, Data):
        raise TypeError(f"{transform} takes a homogeneous torch_geometric.data.Data, "
                        f"got {type(data).__name__}")
    num_nodes = check_non_negative(data.num_nodes, "num_nodes")
    edge_index = data.edge_index
    if edge_index is None:
        for name in ("adj_t", "adj"):
            if name in data:  # T.ToSparseTensor moved the edges there
                raise ValueError(f"{transform} reads data.edge_index, and this graph holds its "
                                 f"edges as data.{name} (T.ToSparseTensor): apply {transform} "
                                 f"before ToSparseTensor")
        edge_index = torch.empty(2, 0, dtype=torch.long)
    check_edge_index(edge_index, num_nodes, num_nodes)
    return edge_index, num_nodes


def _graphs_of_batch(data: Data, edge_index: Tensor, num_nodes: int,
                     edge_weight: Tensor | None) -> list[tuple[Tensor, int, Tensor | None]]:
    """``(edge_index, num_nodes, edge_weight)`` of each graph of a ``Batch`` (nodes renumbered
    from 0; the weights of its edges, or ``None``), or the one graph of a ``Data``: a batch's
    Laplacian eigenvectors would mix its graphs."""
    ptr = _batch_ptr(data, num_nodes) if isinstance(data, Batch) else None
    if ptr is None or ptr.numel() <= 2:
        return [(edge_index, num_nodes, edge_weight)]
    ptr = ptr.to(edge_index.device)
    graph = torch.bucketize(edge_index[0], ptr[1:], right=True)  # (E,) graph of each edge
    order = torch.sort(graph, stable=True).indices
    counts = torch.bincount(graph, minlength=ptr.numel() - 1).tolist()
    starts, sizes = ptr[:-1].tolist(), ptr.diff().tolist()
    weights = ([None] * len(counts) if edge_weight is None
               else edge_weight[order].split(counts))
    return [(ei - start, size, w) for ei, start, size, w in
            zip(edge_index[:, order].split(counts, dim=1), starts, sizes, weights, strict=True)]


def _batch_ptr(data: Batch, num_nodes: int) -> Tensor | None:
    """Where each graph of a ``Batch`` starts, ``(G + 1)``, from ``data.batch`` when it has one
    entry per node: ``Batch.subgraph`` (and transforms built on it, ``RemoveIsolatedNodes``)
    updates ``batch`` but leaves ``ptr`` as it was."""
    ptr, batch = getattr(data, "ptr", None), getattr(data, "batch", None)
    if isinstance(batch, Tensor) and batch.dim() == 1 and batch.numel() == num_nodes:
        if batch.numel() > 1 and bool((batch.diff() < 0).any()):
            raise ValueError("data.batch must list each graph's nodes together, in graph "
                             "order (as Batch.from_data_list makes it), to be split by graph")
        graphs = 0 if ptr is None else ptr.numel() - 1  # graphs without nodes kept
        sizes = torch.bincount(batch, minlength=graphs)  # (G,)
        return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    if ptr is not None and int(ptr[-1]) != num_nodes:
        raise ValueError(f"data.ptr ends at {int(ptr[-1])} but the batch has {num_nodes} "
                         f"nodes, and no data.batch to split it by")
    return ptr


def _edge_weight_of(data: Data, edge_index: Tensor) -> Tensor | None:
    """``data.edge_weight``, which PyG's transforms read as the weights of the edges, checked
    against ``edge_index`` before a batch is split by graph."""
    if "edge_weight" not in data:
        return None
    _edge_weights(data.edge_weight, edge_index.size(1))
    return data.edge_weight


def _check_attr_name(attr_name: str | None) -> str | None:
    """``attr_name`` of a node encoding: ``None``, or a str that PyG's batching leaves as it
    is (a name with "index" in it is offset by the node count, and "batch" is taken)."""
    if attr_name is not None and (not isinstance(attr_name, str) or "index" in attr_name
                                  or "batch" in attr_name):
        raise ValueError(f"attr_name must be None or a str without 'index' or 'batch', which "
                         f"would make PyG offset the encoding in a batch, got {attr_name!r}")
    return attr_name


def _add_node_attr(data: Data, value: Tensor, attr_name: str | None) -> Data:
    """Store ``value`` as ``data[attr_name]``, or concatenate it to ``data.x`` when ``None``."""
    if attr_name is not None:
        data[attr_name] = value
    elif data.x is None:
        data.x = value
    else:
        x = data.x.view(-1, 1) if data.x.dim() == 1 else data.x
        if x.size(0) != value.size(0):
            raise ValueError(f"data.x has {x.size(0)} rows, but the encoding has one per node: "
                             f"{value.size(0)} (data.num_nodes); pass an attr_name to store it "
                             f"apart, or give x one row per node")
        # Integer (or bool) features, e.g. atom types, would truncate the encoding to 0: the
        # concatenation takes the encoding's float dtype then.
        dtype = x.dtype if x.is_floating_point() else value.dtype
        data.x = torch.cat([x.to(dtype), value.to(x.device, dtype)], dim=-1)
    return data


class AddLaplacianPE(BaseTransform):
    r"""PyG transform that stores :func:`laplacian_pe` of ``data.edge_index`` on the graph,
    weighted by ``data.edge_weight`` when the graph has one (as PyG's
    ``AddLaplacianEigenvectorPE`` reads it).

    Args:
        k (int): number of eigenvectors.
        attr_name (str, optional): attribute to store the ``[N, k]`` encoding in; ``None``
            concatenates it to ``data.x`` (in ``x``'s dtype if that is floating-point, else
            ``x`` is converted to the encoding's); a name must contain neither ``index``
            nor ``batch``, which PyG would offset. (default: ``"laplacian_pe"``)
        pad (bool, optional): zero columns for graphs with too few eigenvectors.
            (default: ``False``)
        random_sign_flip (bool, optional): flip signs at random on every call (use as a
            per-access ``transform``, not a one-off ``pre_transform``). (default: ``False``)
        solver (str, optional): see :func:`laplacian_pe`. (default: ``"auto"``)

    Shapes:
        - **input:** ``Data`` with ``edge_index (2, E)`` (none: no edges), ``num_nodes`` N and
          optionally ``edge_weight (E)``
        - **output:** the same ``Data`` (shallow copy) with ``laplacian_pe (N, k)``; on a
          ``Batch`` each graph gets its own encoding, as if transformed alone
    """

    def __init__(self, k: int, attr_name: str | None = "laplacian_pe", *, pad: bool = False,
                 random_sign_flip: bool = False, solver: str = "auto") -> None:
        k = check_positive(k, "k")
        if solver not in SOLVERS:
            raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
        self.k = k
        self.attr_name = _check_attr_name(attr_name)
        self.pad = check_flag(pad, "pad")
        self.random_sign_flip = check_flag(random_sign_flip, "random_sign_flip")
        self.solver = solver

    def forward(self, data: Data) -> Data:
        edge_index, num_nodes = _graph_of(data, "AddLaplacianPE")
        parts = _graphs_of_batch(data, edge_index, num_nodes, _edge_weight_of(data, edge_index))
        encodings = []
        for g, (ei, n, w) in enumerate(parts):
            try:
                encodings.append(laplacian_pe(ei, n, self.k, pad=self.pad,
                                              random_sign_flip=self.random_sign_flip,
                                              solver=self.solver, edge_weight=w))  # (n, k)
            except ValueError as error:
                if len(parts) == 1:
                    raise
                raise ValueError(f"graph {g} of the batch ({n} nodes): {error}") from None
        return _add_node_attr(data, torch.cat(encodings), self.attr_name)

    def __repr__(self) -> str:
        # every argument away from its default: PyG compares a pre_transform's repr with the
        # one a processed dataset was made with
        extra = "" if self.attr_name == "laplacian_pe" else f", attr_name={self.attr_name!r}"
        extra += ", pad=True" if self.pad else ""
        extra += ", random_sign_flip=True" if self.random_sign_flip else ""
        extra += "" if self.solver == "auto" else f", solver={self.solver!r}"
        return f"{self.__class__.__name__}(k={self.k}{extra})"


class AddRandomWalkPE(BaseTransform):
    r"""PyG transform that stores :func:`random_walk_pe` of ``data.edge_index`` on the graph,
    with the walk weighted by ``data.edge_weight`` when the graph has one (as PyG's
    ``AddRandomWalkPE`` reads it).

    Args:
        k (int): number of walk lengths.
        attr_name (str, optional): attribute to store the ``[N, k]`` encoding in; ``None``
            concatenates it to ``data.x`` (in ``x``'s dtype if that is floating-point, else
            ``x`` is converted to the encoding's); a name must contain neither ``index``
            nor ``batch``, which PyG would offset. (default: ``"random_walk_pe"``)

    Shapes:
        - **input:** ``Data`` with ``edge_index (2, E)`` (none: no edges), ``num_nodes`` N and
          optionally ``edge_weight (E)``
        - **output:** the same ``Data`` (shallow copy) with ``random_walk_pe (N, k)``
    """

    def __init__(self, k: int, attr_name: str | None = "random_walk_pe") -> None:
        k = check_positive(k, "k")
        self.k = k
        self.attr_name = _check_attr_name(attr_name)

    def forward(self, data: Data) -> Data:
        edge_index, num_nodes = _graph_of(data, "AddRandomWalkPE")
        pe = random_walk_pe(edge_index, num_nodes, self.k,
                            edge_weight=_edge_weight_of(data, edge_index))
        return _add_node_attr(data, pe, self.attr_name)

    def __repr__(self) -> str:
        extra = "" if self.attr_name == "random_walk_pe" else f", attr_name={self.attr_name!r}"
        return f"{self.__class__.__name__}(k={self.k}{extra})"


# ---------------------------------------------------------------------------------------------
# Relative positional encodings: a score bias from the distance between the two ends of a pair
# ---------------------------------------------------------------------------------------------

@_jit()
def _hop_distance_rows(adj_ptr: np.ndarray, adj_src: np.ndarray, pair_ptr: np.ndarray,
                       pair_src: np.ndarray, max_distance: int, out: np.ndarray,
                       first: int, last: int) -> None:
    """``out[p]`` for the pairs of targets ``first .. last - 1``: a breadth-first search from
    each target t over its in-neighbours (``adj_src[adj_ptr[u]:adj_ptr[u + 1]]`` for node u),
    level by level, until every source of t's pairs is reached or ``max_distance`` levels are
    done; -1 for a source not reached."""
    n = adj_ptr.shape[0] - 1
    dist = np.full(n, -1, dtype=np.int64)  # (N,) reset after each search
    wanted = np.zeros(n, dtype=np.int64)  # (N,) t + 1 on the sources t asks for
    queue = np.empty(n, dtype=np.int64)
    for t in range(first, last):
        p0, p1 = pair_ptr[t], pair_ptr[t + 1]
        if p0 == p1:
            continue
        needed = 0
        for p in range(p0, p1):  # each distinct source once (multi-edges ask once)
            if wanted[pair_src[p]] != t + 1:
                wanted[pair_src[p]] = t + 1
                needed += 1
        dist[t] = 0
        queue[0] = t
        head, tail = 0, 1
        found = 1 if wanted[t] == t + 1 else 0
        level = 0
        while head < tail and found < needed and level < max_distance:
            level += 1
            level_end = tail
            while head < level_end:
                u = queue[head]
                head += 1
                for e in range(adj_ptr[u], adj_ptr[u + 1]):
                    w = adj_src[e]
                    if dist[w] < 0:
                        dist[w] = level
                        queue[tail] = w
                        tail += 1
                        if wanted[w] == t + 1:
                            found += 1
        for p in range(p0, p1):
            out[p] = dist[pair_src[p]]
        for i in range(tail):
            dist[queue[i]] = -1


@overload
def hop_distance(edge_index: Tensor, num_nodes: int, pairs: Tensor, *,
                 max_distance: int | None = ..., directed: bool = ...) -> Tensor: ...


@overload
def hop_distance(edge_index: Tensor, num_nodes: int, pairs: None = ..., *,
                 max_distance: int | None = ..., directed: bool = ...) -> Tensor: ...


def hop_distance(edge_index: Tensor, num_nodes: int, pairs: Tensor | None = None, *,
                 max_distance: int | None = None, directed: bool = False) -> Tensor:
    r"""The number of edges on a shortest path of the graph between the two nodes of each pair:
    the relative position of two nodes, as :math:`\lvert i - j \rvert` is that of two positions
    of a sequence.

    .. math::
        d(j \to i) = \min \{\, \ell : j = u_0 \to u_1 \to \dots \to u_\ell = i
        \text{ along edges of } G \,\}, \qquad d(i \to i) = 0

    The graph G that defines the distances (a molecule's bonds, a citation graph, a chain) need
    not be the graph that attention runs on: ``pairs`` are the attention edges, often all pairs
    (Graphormer's spatial encoding: Ying et al., 2021, "Do Transformers Really Perform Bad for
    Graph Representation?") or the pairs within a few hops. On
    :func:`graphattn.graphs.chain_graph` the distance is :math:`\lvert i - j \rvert`, so
    :func:`alibi_bias` of it is ALiBi's linear bias of sequences, and :class:`DistanceBias` of
    it the learned bias of each relative position (clipped, as in Shaw et al., 2018).

    Each target of ``pairs`` runs one breadth-first search over G, on the CPU, by the threads
    of torch's thread count, and stops once it has reached all its sources (or
    ``max_distance``): time of the order of the nodes within the farthest source's distance,
    over all targets. On 2 CPU cores all 7.3M pairs of Cora take 0.18 s (SciPy's ``dijkstra``
    0.77 s) and the 1.2M pairs of PubMed within 2 hops 0.026 s (SciPy 2.3 s, networkx 0.54 s;
    ``benchmarks/hop_distance.py``).

    Args:
        edge_index (Tensor): ``[2, E]`` integer, the edges ``j -> i`` of G.
        num_nodes (int): number of nodes N.
        pairs (Tensor, optional): ``[2, P]`` integer, the pairs ``j -> i`` to measure (an
            attention graph's ``edge_index``). (default: ``None``, all pairs, as an
            ``[N, N]`` matrix)
        max_distance (int, optional): pairs farther apart than this are reported as -1, like
            pairs that no path joins; the searches stop there, which bounds their cost on
            large graphs. (default: ``None``, no limit)
        directed (bool, optional): follow the edges of G from source to target only, so
            :math:`d(j \to i)` counts the steps from j to i; by default each edge is read both
            ways and the distance is symmetric. (default: ``False``)

    Shapes:
        - **input:** edge_index ``(2, E)``, pairs ``(2, P)``
        - **output:** int64 on the device of ``pairs`` (else of ``edge_index``): ``(P)``, the
          distance of each pair, or with ``pairs=None`` ``(N, N)``, entry ``[i, j]`` the
          distance :math:`d(j \to i)` (row: target, as in a dense attention mask); -1 where no
          path of at most ``max_distance`` edges joins them
    """
    num_nodes = check_non_negative(num_nodes, "num_nodes")
    check_edge_index(edge_index, num_src=num_nodes, num_dst=num_nodes)
    directed = check_flag(directed, "directed")
    if max_distance is not None:
        max_distance = check_non_negative(max_distance, "max_distance")
    device = edge_index.device
    if pairs is not None:
        check_tensors(pairs=pairs)
        if pairs.dim() != 2 or pairs.size(0) != 2:
            raise ValueError(f"pairs must have shape [2, P] (sources, targets), got "
                             f"{list(pairs.shape)}")
        try:
            check_edge_index(pairs, num_src=num_nodes, num_dst=num_nodes)
        except (TypeError, ValueError) as error:  # (its message says edge_index)
            raise type(error)(f"pairs: {error}") from None
        device = pairs.device
        pair_src, pair_dst = pairs.long().cpu().numpy()
    else:
        pair_src = np.tile(np.arange(num_nodes, dtype=np.int64), num_nodes)
        pair_dst = np.repeat(np.arange(num_nodes, dtype=np.int64), num_nodes)
    src, dst = edge_index.long().cpu().numpy()
    if not directed:
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    # the in-neighbours of each node, in CSR: the search walks edges backwards from the target
    adj_order = np.argsort(dst, kind="stable")
    adj_ptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=num_nodes), out=adj_ptr[1:])
    adj_src = np.ascontiguousarray(src[adj_order], dtype=np.int64)
    # the pairs grouped by target
    pair_order = np.argsort(pair_dst, kind="stable")
    pair_ptr = np.zeros(num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(pair_dst, minlength=num_nodes), out=pair_ptr[1:])
    grouped = np.empty(pair_src.size, dtype=np.int64)
    limit = num_nodes if max_distance is None else min(max_distance, num_nodes)
    if pair_src.size:
        _run_rows(_hop_distance_rows, pair_ptr, adj_ptr, adj_src, pair_ptr,
                  np.ascontiguousarray(pair_src[pair_order]), limit, grouped)
    distance = np.empty_like(grouped)
    distance[pair_order] = grouped
    out = torch.from_numpy(distance).to(device)
    return out if pairs is not None else out.view(num_nodes, num_nodes)


def hop_pairs(edge_index: Tensor, num_nodes: int, max_distance: int, *,
              directed: bool = False, self_loops: bool = True) -> tuple[Tensor, Tensor]:
    r"""Every pair of nodes at most ``max_distance`` hops apart on a structure graph G, and
    its hop distance: the attention graph of k-hop attention, with the input of
    :class:`DistanceBias` (Graphormer's spatial encoding restricted to k hops):

    .. math::
        \mathcal{E}_k = \{(j, i) : d_G(j \to i) \le k\}

    ``edge_index`` is G's ``[2, E]`` edge list (1 hop = 1 edge). On a chain with k = r this
    is :func:`graphattn.graphs.window_graph` of radius r; as k grows it becomes each connected
    component's complete graph, which :func:`hop_distance` with the pairs of
    :func:`graphattn.graphs.batch_complete_graph` covers. The pairs come from products of
    G's sparse adjacency with itself (scipy), one per hop, each keeping the pairs first
    reached there; the distances equal :func:`hop_distance` on the same pairs.

    Args:
        edge_index (Tensor): ``[2, E]`` integer, the structure graph G.
        num_nodes (int): number of nodes N.
        max_distance (int): the largest number of hops k.
        directed (bool, optional): follow G's edges from source to target only; by default
            each edge is read both ways. (default: ``False``)
        self_loops (bool, optional): include each node's pair with itself (distance 0).
            (default: ``True``)

    Shapes:
        - **input:** edge_index ``(2, E)``
        - **output:** pairs ``(2, P)`` int64 (row 0 source j, row 1 target i), sorted by
          target, then source, and their distances ``(P)`` int64, on the device of
          ``edge_index``
    """
    num_nodes = check_non_negative(num_nodes, "num_nodes")
    check_edge_index(edge_index, num_src=num_nodes, num_dst=num_nodes)
    max_distance = check_non_negative(max_distance, "max_distance")
    directed = check_flag(directed, "directed")
    self_loops = check_flag(self_loops, "self_loops")
    src, dst = edge_index.long().cpu().numpy()
    if not directed:
        src, dst = np.concatenate([src, dst]), np.concatenate([dst, src])
    step = sp.csr_matrix((np.ones(src.size, dtype=np.int32), (dst, src)),
                         shape=(num_nodes, num_nodes))  # [i, j] > 0: an edge j -> i
    # seen: the pairs reached so far, [target, source]; frontier: those first reached last hop
    seen = sp.identity(num_nodes, dtype=np.int32, format="csr")
    frontier = seen
    parts = [(np.arange(num_nodes), np.arange(num_nodes), np.zeros(num_nodes, dtype=np.int64))]
    for d in range(1, max_distance + 1):
        reached = (step @ frontier).tocsr()  # [i, j]: a walk j -> ... -> i of d edges
        reached.data[:] = 1
        frontier = (reached - reached.multiply(seen)).tocsr()  # only the pairs new at d
        frontier.eliminate_zeros()
        if frontier.nnz == 0:
            break
        seen = (seen + frontier).tocsr()
        rows, cols = frontier.nonzero()
        parts.append((rows, cols, np.full(rows.size, d, dtype=np.int64)))
    dst_all, src_all, dist = (np.concatenate(column) for column in zip(*parts, strict=True))
    if not self_loops:
        keep = dst_all != src_all
        dst_all, src_all, dist = dst_all[keep], src_all[keep], dist[keep]
    order = np.lexsort((src_all, dst_all))  # by target, then source
    pairs = torch.from_numpy(np.stack([src_all[order], dst_all[order]]).astype(np.int64))
    return pairs.to(edge_index.device), torch.from_numpy(dist[order]).to(edge_index.device)


def alibi_slopes(heads: int) -> Tensor:
    r"""ALiBi's slope of each head (Press et al., 2022, "Train Short, Test Long"): for a power
    of two H, the geometric sequence

    .. math::
        m_h = 2^{-8 (h + 1) / H}, \qquad h = 0 .. H - 1

    (1/2, 1/4, ..., 1/256 for 8 heads); for other H, the H' = 2^⌊log₂ H⌋ slopes of H' heads,
    then every other slope of 2H' heads (the ones between them), as many as are missing, as
    the authors' code does.

    Args:
        heads (int): number of heads H.

    Shapes:
        - **output:** ``(H)`` float64
    """
    heads = check_positive(heads, "heads")
    lower = 1 << (heads.bit_length() - 1)  # the largest power of two <= H
    slopes = 2.0 ** (-8.0 * torch.arange(1, lower + 1, dtype=torch.float64) / lower)
    if lower == heads:
        return slopes
    between = 2.0 ** (-8.0 * torch.arange(1, 4 * lower, 2, dtype=torch.float64) / (2 * lower))
    return torch.cat([slopes, between[:heads - lower]])


def _values_checkable() -> bool:
    """Whether a check may read a tensor's values: not under ``torch.compile`` (a graph break
    per call) or ``torch.func``'s transforms (whose tensors have no single value: ``vmap``
    refuses ``.item()``)."""
    return not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active()


def _check_distance(distance: Tensor) -> None:
    check_tensors(distance=distance)
    if distance.is_floating_point() or distance.is_complex() or distance.dtype == torch.bool:
        raise TypeError(f"distance must be an integer tensor (hop_distance's), got "
                        f"{distance.dtype}")
    if distance.numel() and _values_checkable():
        lowest = int(distance.min())
        if lowest < -1:
            raise ValueError(f"distance must be >= 0, or -1 for pairs no path joins, got "
                             f"{lowest}")


def alibi_bias(distance: Tensor, heads: int, *, dtype: torch.dtype | None = None) -> Tensor:
    r"""ALiBi's score bias of each pair and head, :math:`-m_h \, d`, for distances ``d`` from
    :func:`hop_distance`, with :math:`m_h` from :func:`alibi_slopes`:

    .. math::
        \alpha_{ij}^h = \operatorname{softmax}_j\big(\text{scale} \cdot q_i^h \cdot k_j^h
        - m_h \, d(j \to i)\big)

    Passed as ``bias`` to :func:`~graphattn.functional.edge_attention` or as ``attn_bias`` to
    :class:`~graphattn.nn.GraphSelfAttention`, on :func:`graphattn.graphs.causal_graph` with
    distances on :func:`graphattn.graphs.chain_graph`, this is ALiBi's causal attention
    (distance i - j); on any other graph, the same linear penalty on the number of hops. A
    pair with distance -1 (no path, or beyond ``max_distance``) gets :math:`-\infty`: the pair
    is infinitely far, and attention leaves it out (a target with no other pair gets 0).

    Args:
        distance (Tensor): integer, any shape ``[...]``, from :func:`hop_distance`.
        heads (int): number of heads H.
        dtype (torch.dtype, optional): of the bias, e.g. that of ``q``. (default: the default
            float dtype)

    Shapes:
        - **input:** distance ``(...)``
        - **output:** ``(..., H)`` on the device of ``distance``; for dense attention move the
          heads in front of an ``(N, N)`` distance with ``.movedim(-1, 0)``: ``(H, N, N)``
    """
    _check_distance(distance)
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype (the bias holds -inf and the "
                        f"slopes' fractions), got {dtype!r}")
    slopes = alibi_slopes(heads).to(distance.device)  # (H,) float64
    bias = -slopes * distance.unsqueeze(-1).to(torch.float64)  # (..., H)
    return bias.masked_fill(distance.unsqueeze(-1) < 0, float("-inf")).to(dtype)


@_jit()
def _sum_rows_by_index(index, grad, partial, chunk, first, last):
    """``partial[first // chunk, index[p]] += grad[p]`` for the lookups ``p`` in
    ``[first, last)``: each chunk of lookups sums into a table of its own."""
    part = partial[first // chunk]
    for p in range(first, last):
        row = part[index[p]]
        for h in range(grad.shape[1]):
            row[h] += grad[p, h]


class _TableRows(torch.autograd.Function):
    """``weight[index]``, whose backward sums the gradient into the table's rows in one pass
    over the lookups, a chunk of them per thread: a bias table has few rows (buckets,
    distances, offsets) and many lookups (pairs), and the indexing's own backward, an
    accumulating scatter into those few rows, is several times slower on CPU
    (``index_add_``, ``scatter_add_`` and ``embedding``'s backward take as long; a 10 x 4
    table and 1,048,576 lookups on 2 cores: forward+backward 8.2 ms against 64 ms, the
    forward 3.9 ms of it). The sums are taken in float64. With ``create_graph=True`` (a
    Hessian, a meta-learning step) the backward is ``index_add``, which autograd
    differentiates again."""

    @staticmethod
    def forward(weight: Tensor, index: Tensor) -> Tensor:
        return weight[index]

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        weight, index = inputs
        ctx.save_for_backward(index)
        ctx.rows = weight.size(0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (index,) = ctx.saved_tensors  # (...,) into a (rows, H) table
        if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
            return grad.new_zeros(ctx.rows, grad.size(-1)).index_add(
                0, index.reshape(-1), grad.reshape(-1, grad.size(-1))), None
        rows = grad.reshape(-1, grad.size(-1))  # (P, H), strided as it comes
        if rows.dtype not in (torch.float32, torch.float64):
            rows = rows.float()  # numpy has no bfloat16
        lookups = rows.size(0)
        chunks = max(1, min(torch.get_num_threads(), lookups // MIN_PARALLEL_WORK))
        chunk = -(-lookups // chunks)  # ceil
        partial = np.zeros((chunks, ctx.rows, rows.size(1)))  # float64 sums
        args = (index.reshape(-1).numpy(), rows.numpy(), partial, max(chunk, 1))
        if chunks == 1:
            _sum_rows_by_index(*args, 0, lookups)
        else:
            bounds = np.minimum(np.arange(chunks + 1) * chunk, lookups)
            _run_chunks(_sum_rows_by_index, bounds, chunks, *args)
        return torch.from_numpy(partial.sum(axis=0)).to(grad.dtype), None  # (rows, H)


def _table_rows(weight: Tensor, index: Tensor) -> Tensor:
    """``weight[index]`` (rows of a bias table), with a faster backward on CPU."""
    if needs_grad(weight) and weight.device.type == "cpu" and host_readable(index) \
            and not plain_ops_only(weight):
        return apply_function(_TableRows, weight, index.long())
    return weight[index]


def _check_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> tuple[int, int]:
    num_buckets = check_positive(num_buckets, "num_buckets")
    max_distance = check_positive(max_distance, "max_distance")
    side = num_buckets // 2 if bidirectional else num_buckets  # buckets of one sign
    if side < 2:
        raise ValueError(f"num_buckets must be at least {4 if bidirectional else 2} "
                         f"(bidirectional={bidirectional}): half of each sign's buckets are "
                         f"exact, half log-spaced; got {num_buckets}")
    if max_distance <= side // 2:
        raise ValueError(f"max_distance must exceed the {side // 2} exact offsets of "
                         f"num_buckets={num_buckets} (bidirectional={bidirectional}), where the "
                         f"log-spaced buckets start; got {max_distance}")
    return num_buckets, max_distance


def relative_position_bucket(offset: Tensor, *, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    r"""T5's bucket of each relative position (Raffel et al., 2020): offsets near 0 each have
    a bucket of their own, farther ones share log-spaced buckets, and all beyond
    ``max_distance`` the last one.

    With B buckets for each sign (``num_buckets // 2`` if ``bidirectional``, else
    ``num_buckets``), :math:`X = \lfloor B / 2 \rfloor` and :math:`n = |i - j|`, the first X
    distances are exact and the rest are spaced logarithmically up to ``max_distance`` (D):

    .. math::
        b(n) = \begin{cases} n & n < X \\
        \min\!\Big(B - 1, \; X + \Big\lfloor \frac{\log(n / X)}{\log(D / X)}
        \,(B - X) \Big\rfloor\Big) & \text{otherwise} \end{cases}

    ``bidirectional``: a key after its query (i - j < 0) gets ``B + b(n)``, one at or before
    it ``b(n)`` (T5's encoder). Otherwise (T5's decoder, causal attention) keys after the query
    count as offset 0. The logarithm is taken in float32, as T5 does, so the buckets are T5's
    exactly (``tests/test_relative_pe.py`` compares them with Hugging Face's ``T5Attention``).

    The offset is the query's position minus the key's, i - j on the edge j -> i, as
    :func:`relative_offsets` gives it (one coordinate); on a graph, a hop distance from
    :func:`hop_distance` is an offset that is never negative (see :class:`DistanceBias`).

    Args:
        offset (Tensor): integer ``[...]``, i - j of each pair.
        bidirectional (bool, optional): separate buckets for keys after the query.
            (default: ``True``)
        num_buckets (int, optional): number of buckets. (default: ``32``)
        max_distance (int, optional): offsets at least this far share the last bucket of
            their sign. (default: ``128``)

    Shapes:
        - **input:** offset ``(...)``
        - **output:** ``(...)`` int64 in ``[0, num_buckets)``
    """
    check_tensors(offset=offset)
    if offset.is_floating_point() or offset.is_complex() or offset.dtype == torch.bool:
        raise TypeError(f"offset must be an integer tensor, got {offset.dtype}")
    bidirectional = check_flag(bidirectional, "bidirectional")
    num_buckets, max_distance = _check_buckets(num_buckets, max_distance, bidirectional)
    n = offset.long()
    if bidirectional:  # the upper half for keys after the query
        num_buckets //= 2
        first, n = torch.where(n < 0, num_buckets, 0), n.abs()
    else:
        first, n = 0, n.clamp(min=0)
    max_exact = num_buckets // 2
    # float32 as T5; n clamped to 1 so that the branch not taken has no log(0)
    ratio = torch.log(n.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return first + torch.where(n < max_exact, n, large)


class RelativePositionBias(torch.nn.Module):
    r"""T5's learned score bias for each head and bucket of the relative position i - j
    (Raffel et al., 2020): on :func:`graphattn.graphs.complete_graph` of a sequence, T5's
    encoder self-attention bias; on :func:`graphattn.graphs.causal_graph` with
    ``bidirectional=False``, its decoder's.

    .. math::
        \alpha_{ij}^h = \operatorname{softmax}_j\big(\text{scale} \cdot q_i^h \cdot k_j^h
        + B^h[b(i - j)]\big), \qquad B \in \mathbb{R}^{\text{num\_buckets}, H}

    with :math:`b` from :func:`relative_position_bucket`. T5 itself does not scale its scores
    (its initialization folds :math:`1/\sqrt{C}` into the queries): ``scale=1`` in
    :func:`~graphattn.functional.edge_attention` computes exactly T5's attention, and so does
    :class:`~graphattn.nn.GraphSelfAttention` with T5's query weights times
    :math:`\sqrt{C}` in ``lin_q``. The biases start at 0 (:class:`OffsetBias` says how fast
    they learn). On a graph, :class:`DistanceBias` with ``num_buckets`` buckets the hop
    distance the same way.

    .. code-block:: python

        t5 = RelativePositionBias(heads=4)                    # 32 buckets up to 128
        edges = graphs.complete_graph(L)
        out = layer(x, edges, attn_bias=t5(edges[1] - edges[0]))  # (E, 4): i - j per edge

    Args:
        heads (int): number of heads H.
        num_buckets (int, optional): number of buckets. (default: ``32``)
        max_distance (int, optional): offsets at least this far share a bucket.
            (default: ``128``)
        bidirectional (bool, optional): separate buckets for keys after the query; ``False``
            for causal attention. (default: ``True``)

    Shapes:
        - **input:** offset ``(...)`` integer, i - j
        - **output:** ``(..., H)`` in the parameters' dtype
    """

    def __init__(self, heads: int, num_buckets: int = 32, max_distance: int = 128, *,
                 bidirectional: bool = True) -> None:
        super().__init__()
        self.heads = check_positive(heads, "heads")
        self.bidirectional = check_flag(bidirectional, "bidirectional")
        self.num_buckets, self.max_distance = _check_buckets(num_buckets, max_distance,
                                                             self.bidirectional)
        self.weight = torch.nn.Parameter(torch.zeros(self.num_buckets, self.heads))

    def reset_parameters(self) -> None:
        """Set every bias to 0."""
        torch.nn.init.zeros_(self.weight)

    def forward(self, offset: Tensor) -> Tensor:
        """The bias ``(..., H)`` of each offset i - j ``(...)``; see the class docstring."""
        bucket = relative_position_bucket(offset, bidirectional=self.bidirectional,
                                          num_buckets=self.num_buckets,
                                          max_distance=self.max_distance)
        return _table_rows(self.weight, bucket)  # (..., H)

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, num_buckets={self.num_buckets}, "
                f"max_distance={self.max_distance}, bidirectional={self.bidirectional}")


class DistanceBias(torch.nn.Module):
    r"""A learned score bias for each head and hop distance: Graphormer's spatial encoding
    (Ying et al., 2021), and on a chain graph the learned bias of each clipped relative
    position (Shaw et al., 2018) or, with ``num_buckets``, of each of T5's log-spaced buckets.

    .. math::
        \alpha_{ij}^h = \operatorname{softmax}_j\big(\text{scale} \cdot q_i^h \cdot k_j^h
        + b^h_{\text{bucket}(d(j \to i))}\big)

    with :math:`d` from :func:`hop_distance` and D = ``max_distance``. Without
    ``num_buckets``, distances 0..D each have their own bias per head, and every pair farther
    apart shares bucket D + 1. With ``num_buckets`` = B, the distances go into T5's B
    one-sided buckets (:func:`relative_position_bucket` with ``bidirectional=False``): 0 ..
    ⌊B/2⌋ - 1 exact, then log-spaced, and D or more the last; on the causal graph with chain
    distances that is T5's decoder bias, and on a graph it reaches far pairs with few
    parameters. Pairs that no path joins (distance -1) take the last row: a row of their own
    with ``num_buckets``; without, the row D + 1 of the pairs farther apart than D (which
    :func:`hop_distance` with ``max_distance=D`` reports as -1 too). The biases start at 0
    (plain attention; :class:`OffsetBias` says how fast they learn). The output goes to
    ``attn_bias`` of
    :class:`~graphattn.nn.GraphSelfAttention` (distances of its edges) or of
    :class:`~graphattn.nn.DenseSelfAttention` (an ``(N, N)`` distance matrix, heads moved in
    front).

    .. code-block:: python

        spatial = DistanceBias(heads=4, max_distance=5)
        dist = hop_distance(data.edge_index, N, attn_edges)  # (E_attn,) once per graph
        out = layer(x, attn_edges, attn_bias=spatial(dist))  # (E_attn, 4)

    Args:
        heads (int): number of heads H.
        max_distance (int): the largest distance D with a bias of its own; with
            ``num_buckets``, the distance from which all share the last bucket.
        num_buckets (int, optional): T5's log-spaced buckets instead of one a distance.
            (default: ``None``)

    Shapes:
        - **input:** distance ``(...)`` integer
        - **output:** ``(..., H)`` in the parameters' dtype
    """

    def __init__(self, heads: int, max_distance: int, *, num_buckets: int | None = None) -> None:
        super().__init__()
        self.heads = check_positive(heads, "heads")
        if num_buckets is None:
            self.max_distance = check_non_negative(max_distance, "max_distance")
            rows = self.max_distance + 2
        else:
            num_buckets, self.max_distance = _check_buckets(num_buckets, max_distance, False)
            rows = num_buckets + 1
        self.num_buckets = num_buckets
        self.weight = torch.nn.Parameter(torch.zeros(rows, self.heads))

    def reset_parameters(self) -> None:
        """Set every bias to 0."""
        torch.nn.init.zeros_(self.weight)

    def forward(self, distance: Tensor) -> Tensor:
        """The bias ``(..., H)`` of each distance ``(...)``; see the class docstring."""
        _check_distance(distance)
        if self.num_buckets is None:
            far = self.max_distance + 1  # (int64: it may not fit the distances' dtype)
            distance = distance.long()
            bucket = torch.where((distance < 0) | (distance > self.max_distance), far,
                                 distance)
        else:
            bucket = relative_position_bucket(distance, bidirectional=False,
                                              num_buckets=self.num_buckets,
                                              max_distance=self.max_distance)
            bucket = torch.where(distance < 0, self.num_buckets, bucket)
        return _table_rows(self.weight, bucket)  # (..., H)

    def extra_repr(self) -> str:
        buckets = "" if self.num_buckets is None else f", num_buckets={self.num_buckets}"
        return f"heads={self.heads}, max_distance={self.max_distance}{buckets}"


class AddHopDistance(BaseTransform):
    r"""PyG transform that stores the pairs of a graph transformer's attention over each whole
    graph, every ordered pair of its nodes (:func:`graphattn.graphs.complete_graph`), and the
    hop distance of each (:func:`hop_distance`): Graphormer's spatial encoding computed once
    per graph, as a dataset's ``pre_transform``, instead of at every step.

    ``Batch.from_data_list`` adds each graph's first node to ``pair_index`` (PyG offsets every
    attribute whose name contains ``index``) and concatenates ``pair_distance``, so a
    mini-batch's ``pair_index`` is :func:`graphattn.graphs.batch_complete_graph` of its
    ``batch``, in the same order, and ``pair_distance`` the distances of those pairs (no path
    leads from one graph to another):

    .. code-block:: python

        dataset = TUDataset(root, "MUTAG", pre_transform=AddHopDistance(max_distance=5))
        for data in DataLoader(dataset, batch_size=32):
            bias = spatial(data.pair_distance)            # DistanceBias: (sum n_g^2, H)
            out = layer(data.x, data.pair_index, attn_bias=bias)

    A graph of n nodes stores :math:`n^2` pairs (``self_loops=False``: :math:`n^2 - n`), three
    int64 numbers each: for molecules and other small graphs. With ``pairs="within"`` it stores
    only the pairs at most ``max_distance`` hops apart (:func:`hop_pairs`), for graphs where
    :math:`n^2` is too many.

    Args:
        max_distance (int, optional): see :func:`hop_distance`: farther pairs get -1, or
            with ``pairs="within"`` are left out. (default: ``None``)
        pairs (str, optional): ``"complete"``, every ordered pair, or ``"within"``, those at
            most ``max_distance`` hops apart. (default: ``"complete"``)
        directed (bool, optional): see :func:`hop_distance`. (default: ``False``)
        self_loops (bool, optional): include the pairs ``i -> i`` (distance 0).
            (default: ``True``)
        index_name (str, optional): attribute for the ``[2, n^2]`` pairs; its name must contain
            ``index`` for PyG to offset it in a batch. (default: ``"pair_index"``)
        attr_name (str, optional): attribute for the ``[n^2]`` distances; its name must contain
            neither ``index`` nor ``batch``, which PyG would offset. (default:
            ``"pair_distance"``)

    Shapes:
        - **input:** ``Data`` with ``edge_index (2, E)`` (none: no edges) and ``num_nodes`` N
        - **output:** the same ``Data`` (shallow copy) with ``pair_index (2, P)`` int64
          (:math:`P = N^2` for complete pairs), sorted by target, then source, and
          ``pair_distance (P)`` int64; on a ``Batch``, the pairs of each graph, as if each
          graph were transformed alone and batched
    """

    def __init__(self, max_distance: int | None = None, *, pairs: str = "complete",
                 directed: bool = False, self_loops: bool = True,
                 index_name: str = "pair_index", attr_name: str = "pair_distance") -> None:
        self.max_distance = (None if max_distance is None
                             else check_non_negative(max_distance, "max_distance"))
        if pairs not in ("complete", "within"):
            raise ValueError(f"pairs must be 'complete' or 'within', got {pairs!r}")
        if pairs == "within" and max_distance is None:
            raise ValueError("pairs='within' keeps the pairs at most max_distance hops apart: "
                             "give max_distance=<hops>")
        self.pairs = pairs
        self.directed = check_flag(directed, "directed")
        self.self_loops = check_flag(self_loops, "self_loops")
        if not isinstance(index_name, str) or "index" not in index_name:
            raise ValueError(f"index_name must be a str that contains 'index', which makes PyG "
                             f"offset the pairs by each graph's first node in a batch, got "
                             f"{index_name!r}")
        if not isinstance(attr_name, str) or "index" in attr_name or "batch" in attr_name \
                or attr_name == index_name:
            raise ValueError(f"attr_name must be a str without 'index' or 'batch', which would "
                             f"make PyG offset the distances in a batch, got {attr_name!r}")
        self.index_name = index_name
        self.attr_name = attr_name

    def forward(self, data: Data) -> Data:
        edge_index, num_nodes = _graph_of(data, "AddHopDistance")
        if self.pairs == "within":  # no path crosses from one graph of a batch to another
            data[self.index_name], data[self.attr_name] = hop_pairs(
                edge_index, num_nodes, self.max_distance, directed=self.directed,
                self_loops=self.self_loops)
            return data
        batch = getattr(data, "batch", None) if isinstance(data, Batch) else None
        if isinstance(batch, Tensor) and batch.dim() == 1 and batch.numel() == num_nodes:
            pairs = graphs.batch_complete_graph(batch, self_loops=self.self_loops)
        else:
            pairs = graphs.complete_graph(num_nodes, self_loops=self.self_loops)
        pairs = pairs.to(edge_index.device)
        data[self.index_name] = pairs  # (2, P)
        data[self.attr_name] = hop_distance(edge_index, num_nodes, pairs,
                                            max_distance=self.max_distance,
                                            directed=self.directed)  # (P,)
        return data

    def __repr__(self) -> str:
        extra = [] if self.max_distance is None else [f"max_distance={self.max_distance}"]
        extra += [] if self.pairs == "complete" else [f"pairs={self.pairs!r}"]
        extra += ["directed=True"] if self.directed else []
        extra += [] if self.self_loops else ["self_loops=False"]
        extra += [] if self.index_name == "pair_index" else [f"index_name={self.index_name!r}"]
        extra += ([] if self.attr_name == "pair_distance"
                  else [f"attr_name={self.attr_name!r}"])
        return f"{self.__class__.__name__}({', '.join(extra)})"


def grid_positions(height: int, width: int) -> Tensor:
    """The (row, column) of each pixel of :func:`graphattn.graphs.grid_graph`, whose pixel
    ``r * width + c`` is at row r, column c.

    Args:
        height (int): rows H.
        width (int): columns W.

    Shapes:
        - **output:** ``(H * W, 2)`` int64
    """
    height = check_non_negative(height, "height")
    width = check_non_negative(width, "width")
    pixel = torch.arange(height * width)
    return torch.stack([pixel // max(width, 1), pixel % max(width, 1)], dim=1)


def relative_offsets(positions: Tensor, edge_index: Tensor) -> Tensor:
    r"""The offset :math:`p_i - p_j` of each edge :math:`j \to i`, from integer node
    positions: a sequence's signed relative position i - j (``positions`` the arange: one
    coordinate, ``d = 1``), a pixel's (rows, columns) offset on a grid
    (:func:`grid_positions`), a voxel's in 3-D.

    Args:
        positions (Tensor): ``[N, d]`` integer coordinates of the nodes, or ``[N]`` for one
            coordinate (as ``[N, 1]``).
        edge_index (Tensor): ``[2, E]`` integer, ids below N.

    Shapes:
        - **input:** positions ``(N, d)`` or ``(N)``, edge_index ``(2, E)``
        - **output:** ``(E, d)`` int64 on the device of ``positions`` (``(E, 1)`` for
          positions ``(N)``, as :class:`OffsetBias` with ``dims=1`` takes them)
    """
    check_tensors(positions=positions)
    if positions.dim() not in (1, 2) or positions.is_floating_point() \
            or positions.is_complex() or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer [N, d] or [N] tensor, got "
                         f"{positions.dtype} {list(positions.shape)}")
    positions = positions.unsqueeze(1) if positions.dim() == 1 else positions  # (N, d)
    N = positions.size(0)
    check_edge_index(edge_index, num_src=N, num_dst=N)
    src, dst = edge_index.to(positions.device).long()
    positions = positions.long()  # (before the difference: uint8's 0 - 5 would be 251)
    return positions[dst] - positions[src]


class OffsetBias(torch.nn.Module):
    r"""A learned score bias for each head and relative offset of a pair's positions: the
    relative position bias of Swin (Liu et al., 2021) and of neighbourhood attention
    (Hassani et al., 2023) on an image's grid graph, and on a sequence (d = 1) a bias of each
    signed relative position up to R (T5's log-spaced buckets are
    :class:`RelativePositionBias`).

    .. math::
        \alpha_{ij}^h = \operatorname{softmax}_j\big(\text{scale} \cdot q_i^h \cdot k_j^h
        + B^h[p_i - p_j]\big), \qquad B \in \mathbb{R}^{(2R + 1)^d + 1, H}

    with :math:`p_i - p_j` from :func:`relative_offsets`. Each offset with every coordinate in
    ``[-R, R]`` (``R = radius``) has its own bias per head, at row
    :math:`\sum_k (o_k + R)(2R + 1)^{d - 1 - k}` (Swin's ``relative_position_index`` for a
    window of R + 1 pixels a side); every farther pair shares the last row. The biases start
    at 0. Adam moves each entry by about the learning rate a step, and the biases must reach
    a unit or so to set positions apart: on a short schedule, give the table its own
    parameter group at a larger rate, without weight decay as Swin trains it (the image
    example, 680 steps: 10x the rate, 94.8% test accuracy against 67.1% at 1x). The output
    goes to ``attn_bias`` of :class:`~graphattn.nn.GraphSelfAttention` on, say,
    :func:`graphattn.graphs.grid_graph` with the same radius:

    .. code-block:: python

        edges = graphs.grid_graph(32, 32, radius=3)                       # 7 x 7 neighbourhoods
        offsets = relative_offsets(grid_positions(32, 32), edges)          # (E, 2)
        out = layer(x, edges, attn_bias=OffsetBias(4, radius=3)(offsets))  # (E, 4) bias

    Args:
        heads (int): number of heads H.
        radius (int): the largest offset R along an axis with a bias of its own.
        dims (int, optional): number of coordinates d. (default: ``2``)

    Shapes:
        - **input:** offset ``(..., d)`` integer
        - **output:** ``(..., H)`` in the parameters' dtype
    """

    def __init__(self, heads: int, radius: int, dims: int = 2) -> None:
        super().__init__()
        self.heads = check_positive(heads, "heads")
        self.radius = check_non_negative(radius, "radius")
        self.dims = check_positive(dims, "dims")
        self.weight = torch.nn.Parameter(
            torch.zeros((2 * self.radius + 1) ** self.dims + 1, self.heads))

    def reset_parameters(self) -> None:
        """Set every bias to 0."""
        torch.nn.init.zeros_(self.weight)

    def forward(self, offset: Tensor) -> Tensor:
        """The bias ``(..., H)`` of each offset ``(..., d)``; see the class docstring."""
        check_tensors(offset=offset)
        if offset.is_floating_point() or offset.is_complex() or offset.dtype == torch.bool:
            raise TypeError(f"offset must be an integer tensor (relative_offsets'), got "
                            f"{offset.dtype}")
        if offset.dim() == 0 or offset.size(-1) != self.dims:
            raise ValueError(f"offset must have shape [..., d] = [..., {self.dims}], got "
                             f"{list(offset.shape)}")
        side = 2 * self.radius + 1
        offset = offset.long()  # (int8's abs(-128) is -128)
        inside = (offset.abs() <= self.radius).all(dim=-1)  # (...,)
        index = torch.zeros(offset.shape[:-1], dtype=torch.long, device=offset.device)
        for k in range(self.dims):
            index = index * side + (offset[..., k].long() + self.radius)
        index = torch.where(inside, index, side ** self.dims)
        return _table_rows(self.weight, index)  # (..., H)

    def extra_repr(self) -> str:
        return f"heads={self.heads}, radius={self.radius}, dims={self.dims}"


def apply_rotary(x: Tensor, pos: Tensor, *, dim: int | None = None, axes: int = 1,
                 base: float = 10000.0, interleaved: bool = False,
                 frequencies: Tensor | None = None, attention_factor: float = 1.0,
                 ntk_factor: float | None = None,
                 long_frequencies: Tensor | None = None,
                 original_length: int | None = None) -> Tensor:
    r"""Rotate queries or keys by their positions: the rotary position embedding (RoPE; Su et
    al., 2021), on a sequence, an image or any nodes with coordinates.

    The first ``dim`` channels of each head form ``dim / 2`` planes; plane m turns by the
    angle :math:`p \, \theta_m` with :math:`\theta_m = \text{base}^{-2m/d}` (``d = dim``),
    and the other channels pass unchanged. A rotated query and key then score

    .. math::
        (R_{p_i} q_i) \cdot (R_{p_j} k_j) = q_i \cdot R_{p_j - p_i}\, k_j,

    which depends on the positions through their difference only: a relative encoding that
    leaves the attention operator untouched, so every backend runs it as it is. On the
    causal graph with positions ``0 .. L-1`` this is LLaMA's and GPT-NeoX's attention
    (``interleaved=False``: plane m pairs channels m and m + d/2, Hugging Face's
    ``rotate_half``), or RoFormer's and GPT-J's (``interleaved=True``: channels 2m and 2m+1).

    With ``axes = A > 1`` each node has A coordinates (an image's rows and columns,
    :func:`grid_positions`, or a point's x, y, z): the ``dim`` channels split into A
    consecutive groups of ``dim / A``, and group a is the one-axis embedding of coordinate a,
    with its own frequencies :math:`\text{base}^{-2m/(d/A)}` (axial RoPE). The score then
    depends on the offset :math:`p_i - p_j` along every axis. Positions may be integer or
    real; the angles are computed in float32, as Hugging Face computes them (in float64 for
    a float64 ``x``, where Hugging Face stays in float32: its angles then differ from these by
    their float32 rounding), and rounded to the dtype of ``x``.

    Args:
        x (Tensor): queries or keys ``[..., N, H, C]``.
        pos (Tensor): positions ``[..., N]`` (one axis) or ``[..., N, A]``, broadcast against
            the dimensions of ``x`` before N (one sequence's positions serve a batch).
        dim (int, optional): channels rotated per head, even and a multiple of 2A, at most C
            (GPT-J's ``rotary_dim``); ``None`` rotates all C. (default: ``None``)
        axes (int, optional): coordinates per position A. (default: ``1``)
        base (float, optional): frequency base. (default: ``10000.0``)
        interleaved (bool, optional): pair channels 2m, 2m+1 instead of m, m + d/2 (within
            each axis' group). (default: ``False``)
        frequencies (Tensor, optional): the planes' frequencies :math:`\theta_m` themselves,
            ``[dim / (2A)]`` (radians per unit of position, the same for every axis), in place
            of ``base``'s: the rescaled frequencies of long-context variants, such as LLaMA 3's
            (:func:`graphattn.nn.from_llama` reads them from a model's config;
            :meth:`RotaryPE.yarn` computes YaRN's). (default: ``None``)
        attention_factor (float, optional): a factor on the rotated channels (on the cosines
            and sines), so that a rotated query and key score ``attention_factor ** 2`` times
            as much on those channels: YaRN's temperature :math:`\sqrt{1/t} = 0.1 \ln s + 1`
            for a context s times as long (:meth:`RotaryPE.yarn`). (default: ``1.0``)
        ntk_factor (float, optional): dynamic NTK-aware scaling (a factor s >= 1): when the
            largest position in ``pos`` reaches past ``original_length`` :math:`L_0`, the base
            of each axis' group of g channels grows to

            .. math::
                \text{base}' = \text{base} \cdot \Big(\frac{s L}{L_0} - (s - 1)\Big)^{g/(g-2)},
                \qquad L = \max(\max \text{pos} + 1,\ L_0),

            so that the slowest planes turn no further over the L positions than they did
            over :math:`L_0` while the fastest keep their frequency, as Hugging Face's
            ``"dynamic"`` RoPE computes it for a sequence of L positions (on every call: it
            keeps no state between calls). Needs ``original_length`` and no ``frequencies``.
            (default: ``None``)
        long_frequencies (Tensor, optional): the planes' frequencies ``[dim / (2A)]`` for a
            call whose positions reach past ``original_length``, in place of ``frequencies``
            (or the base's) there: LongRoPE's long factors (Phi-3's ``rope_type="longrope"``),
            chosen on the device as Hugging Face chooses them. (default: ``None``)
        original_length (int, optional): the positions :math:`L_0` a model was trained on,
            for ``ntk_factor`` and ``long_frequencies``. (default: ``None``)

    Shapes:
        - **input:** x ``(..., N, H, C)``, pos ``(..., N)`` or ``(..., N, A)``
        - **output:** ``(..., N, H, C)`` in the dtype of ``x``
    """
    check_tensors(x=x, pos=pos)
    axes = check_positive(axes, "axes")
    _check_rows(x)
    C = x.size(-1)
    dim = C if dim is None else check_positive(dim, "dim")
    if dim % (2 * axes):
        raise ValueError(f"dim must be a multiple of 2 * axes = {2 * axes} and at most the "
                         f"channels per head C = {C}, got dim={dim}")
    _check_base(base)
    _check_frequencies(frequencies, dim // axes // 2)
    attention_factor = _check_attention_factor(attention_factor)
    _check_frequencies(long_frequencies, dim // axes // 2, "long_frequencies")
    ntk = _check_ntk(ntk_factor, original_length, frequencies, dim // axes, long_frequencies)
    return _apply_rotary(x, pos, dim, axes, float(base), check_flag(interleaved, "interleaved"),
                         frequencies, attention_factor, ntk, long=long_frequencies)


def _check_rows(x: Tensor, dim: int | None = None) -> None:
    """Raise unless ``x`` is a floating ``[..., N, H, C]`` tensor with C >= ``dim``."""
    if x.dim() < 3 or not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor [..., N, H, C], got {x.dtype} "
                         f"{list(x.shape)}")
    if dim is not None and dim > x.size(-1):
        raise ValueError(f"dim must be a multiple of 2 * axes and at most the channels per "
                         f"head C = {x.size(-1)}, got dim={dim}")


def _apply_rotary(x: Tensor, pos: Tensor, dim: int, axes: int, base: float,
                  interleaved: bool, frequencies: Tensor | None, attention_factor: float,
                  ntk: tuple[float | None, int] | None, length: Tensor | None = None,
                  long: Tensor | None = None) -> Tensor:
    """:func:`apply_rotary` on checked arguments; dynamic NTK scaling and long frequencies
    read ``length`` (the positions of a query and key pair together) in place of
    ``pos.max() + 1``."""
    _check_rows(x, dim)
    cos, sin = _rotary_angles(pos, x, dim, axes, base, interleaved, frequencies,
                              attention_factor, ntk, length, long)
    return _rotate(x, cos, sin, dim, axes, interleaved)


def _positions_spanned(*positions: Tensor) -> Tensor | None:
    """The largest position of all ``positions`` plus one, a 0-dim tensor on the device
    (no host synchronisation); ``None`` when all are empty."""
    largest = [p.max() for p in positions if p.numel()]
    if not largest:
        return None
    return torch.stack([m.to(largest[0].dtype) for m in largest]).max() + 1


def _check_attention_factor(value: float) -> float:
    check_finite(value, "attention_factor")
    if value <= 0:
        raise ValueError(f"attention_factor must be a positive number, got {value!r}")
    return float(value)


def _check_ntk(ntk_factor: float | None, original_length: int | None,
               frequencies: Tensor | None, group: int, long_frequencies: Tensor | None = None,
               ) -> tuple[float | None, int] | None:
    """``(ntk_factor, original_length)`` for frequencies that depend on a call's largest
    position (``ntk_factor`` ``None`` with ``long_frequencies``), or ``None`` for fixed ones;
    raise unless ``original_length`` comes with one of the two, and dynamic NTK scaling with
    no explicit frequencies and more than two channels per axis."""
    if long_frequencies is not None:
        if ntk_factor is not None:
            raise ValueError("give ntk_factor or long_frequencies, not both: each sets the "
                             "frequencies past original_length")
        if original_length is None:
            raise ValueError("long_frequencies needs original_length, the positions past "
                             "which they replace the frequencies")
        return None, check_positive(original_length, "original_length")
    if ntk_factor is None:
        if original_length is not None:
            raise ValueError(f"original_length={original_length!r} is read by dynamic NTK "
                             f"scaling and long_frequencies only: give one of them too")
        return None
    check_finite(ntk_factor, "ntk_factor")
    if ntk_factor < 1:
        raise ValueError(f"ntk_factor must be a number >= 1, got {ntk_factor!r}")
    if original_length is None:
        raise ValueError("ntk_factor needs original_length, the positions the model was "
                         "trained on")
    original_length = check_positive(original_length, "original_length")
    if frequencies is not None:
        raise ValueError("ntk_factor rescales the base's frequencies: give frequencies or "
                         "ntk_factor, not both")
    if group <= 2:
        raise ValueError(f"ntk_factor needs more than 2 rotated channels per axis (its "
                         f"exponent is g / (g - 2)), got dim / axes = {group}")
    return float(ntk_factor), original_length


def _check_frequencies(frequencies: Tensor | None, planes: int,
                       name: str = "frequencies") -> None:
    """Raise unless ``frequencies`` is ``None`` or a finite real ``[planes]`` tensor."""
    if frequencies is None:
        return
    check_tensors(**{name: frequencies})
    if not frequencies.is_floating_point() or tuple(frequencies.shape) != (planes,):
        raise ValueError(f"{name} must be a real tensor [dim / (2 * axes)] = [{planes}], "
                         f"one per plane, got {frequencies.dtype} {list(frequencies.shape)}")
    if not torch.isfinite(frequencies).all():
        raise ValueError(f"{name} must be finite")


def _rotary_angles(pos: Tensor, x: Tensor, dim: int, axes: int, base: float,
                   interleaved: bool, frequencies: Tensor | None = None,
                   attention_factor: float = 1.0, ntk: tuple[float | None, int] | None = None,
                   length: Tensor | None = None, long: Tensor | None = None,
                   ) -> tuple[Tensor, Tensor]:
    """The cosine and sine of each rotated channel's angle ``[..., N, 1, dim]`` in the dtype
    of ``x`` (each plane's angle at both of its channels), times ``attention_factor``, after
    checking that ``pos`` gives a position to every row N of ``x`` ``[..., N, H, C]``."""
    if pos.dtype == torch.bool or pos.is_complex():
        raise TypeError(f"pos must have an integer or real dtype, got {pos.dtype}")
    shape = list(pos.shape)
    if axes > 1:
        if pos.dim() < 2 or pos.size(-1) != axes:
            raise ValueError(f"pos must have shape [..., N, A] with A = axes = {axes} "
                             f"coordinates per position, got {shape}")
        pos = pos.unsqueeze(-2)  # (..., N, 1, A): broadcast over the heads
    else:
        pos = pos.unsqueeze(-1).unsqueeze(-1)  # (..., N, 1, 1)
    fits = 3 <= pos.dim() <= x.dim() and pos.size(-3) == x.size(-3)
    try:  # the dimensions before N broadcast against those of x
        fits = fits and torch.broadcast_shapes(pos.shape[:-3], x.shape[:-3]) == x.shape[:-3]
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"pos must give a position to each of the N = {x.size(-3)} rows of x "
                         f"{list(x.shape)}: shape [..., N{'' if axes == 1 else ', A'}], its "
                         f"leading dimensions broadcast against x's, got {shape}")
    group = dim // axes
    angle_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    pos = pos.to(device=x.device, dtype=angle_dtype)
    factor = None
    if ntk is not None:  # the positions spanned, on the device: at least the trained ones
        factor, original = ntk
        length = _positions_spanned(pos) if length is None else length
        length = (pos.new_tensor(float(original)) if length is None
                  else length.to(angle_dtype).clamp_min(original))
    if frequencies is None:
        steps = torch.arange(0, group, 2, dtype=angle_dtype, device=x.device)
        if factor is None:
            freq = 1.0 / (base ** (steps / group))  # (group / 2,): theta_m, as HF's inv_freq
        else:  # dynamic NTK: the base grows with the largest position
            grown = base * (factor * length / original - (factor - 1)) ** (group / (group - 2))
            freq = 1.0 / (grown ** (steps / group))
    else:
        freq = frequencies.to(device=x.device, dtype=angle_dtype)  # (group / 2,)
    if long is not None:  # LongRoPE: the long set where the positions pass the trained ones
        freq = torch.where(length > original, long.to(device=x.device, dtype=angle_dtype), freq)
    angle = pos.unsqueeze(-1) * freq  # (..., N, 1, A, g/2)
    # each plane's angle at its two channels: (2m, 2m + 1), or (m, m + g/2) within each group
    angle = (angle.repeat_interleave(2, dim=-1) if interleaved
             else torch.cat([angle, angle], dim=-1)).flatten(-2)  # (..., N, 1, dim)
    cos, sin = angle.cos(), angle.sin()
    if attention_factor != 1.0:  # scaled before rounding to x's dtype, as HF does
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(x.dtype), sin.to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, dim: int, axes: int,
            interleaved: bool) -> Tensor:
    r"""``x`` ``[..., N, H, C]`` with each plane of its first ``dim`` channels turned by its
    angle: :math:`x \cos\theta + \mathrm{swap}(x) \sin\theta`, where the swap takes each
    plane :math:`(x_1, x_2)` to :math:`(-x_2, x_1)` (Hugging Face's ``rotate_half``, or
    ``rotate_every_two`` interleaved), ``cos`` and ``sin`` ``[..., N, 1, dim]`` from
    :func:`_rotary_angles`. Written over whole rows of channels, broadcast over the heads
    only: queries and keys of 16 x 256 positions, 4 heads of 16 channels, forward+backward on
    2 cores in 1.47 ms, against 1.95 ms for the same products over each plane's strided
    halves."""
    rot = x[..., :dim]
    group = dim // axes
    if interleaved:  # planes (2m, 2m + 1)
        x1, x2 = rot.unflatten(-1, (dim // 2, 2)).unbind(-1)  # (..., N, H, dim / 2) each
        swapped = torch.stack([-x2, x1], dim=-1).flatten(-2)
    else:  # planes (m, m + g/2) within each axis' group
        halves = rot.unflatten(-1, (axes, 2, group // 2))  # (..., N, H, A, 2, g/2)
        swapped = torch.cat([-halves[..., 1:, :], halves[..., :1, :]], dim=-2).flatten(-3)
    out = rot * cos + swapped * sin  # (..., N, H, dim)
    return out if dim == x.size(-1) else torch.cat([out, x[..., dim:]], dim=-1)


class RotaryPE(torch.nn.Module):
    r"""The rotary position embedding of queries and keys, as a module:
    :func:`apply_rotary` with fixed ``dim``, ``axes``, ``base`` and ``interleaved``.

    Give it to :class:`~graphattn.nn.GraphSelfAttention` (or
    :class:`~graphattn.nn.DenseSelfAttention`) as ``rotary=``, and the positions to each call
    as ``pos=``: the layer rotates its queries by the targets' positions and its keys by the
    sources', before the attention operator, on every backend. It has no parameters.

    .. code-block:: python

        L = 128
        layer = GraphSelfAttention(64, 16, heads=4, rotary=RotaryPE(16), add_self_loops=False)
        out = layer(x, graphs.causal_graph(L), pos=torch.arange(L))   # LLaMA-style attention

        edges = graphs.grid_graph(32, 32, radius=3)                     # 2-D RoPE on an image
        layer = GraphSelfAttention(64, 16, heads=4, rotary=RotaryPE(16, axes=2))
        out = layer(x, edges, pos=grid_positions(32, 32))

    Args:
        dim (int): channels rotated per head (even, a multiple of 2 * axes); a layer's heads
            must have at least as many.
        axes (int, optional): coordinates per position. (default: ``1``)
        base (float, optional): frequency base. (default: ``10000.0``)
        interleaved (bool, optional): pair channels 2m, 2m+1 (RoFormer, GPT-J) instead of
            m, m + dim/2 (LLaMA, GPT-NeoX). (default: ``False``)
        frequencies (Tensor, optional): the planes' frequencies ``[dim / (2 * axes)]`` in
            place of ``base``'s, as :func:`apply_rotary` takes them; kept as a buffer outside
            the ``state_dict``, which moves with the module but keeps its dtype when the
            module is cast (``.to(torch.bfloat16)``), as rounding it would turn far
            positions by the wrong angles. (default: ``None``)
        attention_factor (float, optional): a factor on the rotated channels, as
            :func:`apply_rotary` takes it. (default: ``1.0``)
        ntk_factor (float, optional): dynamic NTK-aware scaling past ``original_length``, as
            :func:`apply_rotary` takes it. (default: ``None``)
        long_frequencies (Tensor, optional): the frequencies past ``original_length``
            (LongRoPE), as :func:`apply_rotary` takes them; a buffer outside the
            ``state_dict``. (default: ``None``)
        original_length (int, optional): the positions the model was trained on, for
            ``ntk_factor`` and ``long_frequencies``. (default: ``None``)

    A model trained on sequences of :math:`L_0` positions meets angles it never saw on
    longer ones. Four ways to stretch its rotations, with no retraining or with a short
    fine-tuning, for a context s times as long:

    - position interpolation (Chen et al., 2023): ``frequencies`` divided by s, so the
      positions ``0 .. s L0`` turn as far as ``0 .. L0`` did;
    - dynamic NTK-aware scaling: ``ntk_factor=s, original_length=L0``, a larger base only
      when a call's positions reach past L0 (the fastest planes, which tell neighbours
      apart, keep their frequencies);
    - YaRN (Peng et al., 2023): :meth:`yarn`, interpolating the slow planes only, with a
      ramp between, and a temperature on the scores;
    - LongRoPE (Ding et al., 2024): factors per plane found by search, one set within
      :math:`L_0` and one past it: ``frequencies=short, long_frequencies=long,
      original_length=L0`` (:func:`graphattn.nn.from_llama` reads Phi-3's).

    Shapes:
        - **input:** x ``(..., N, H, C)`` with C >= dim, pos ``(..., N)`` or ``(..., N, A)``
        - **output:** ``(..., N, H, C)``
    """

    def __init__(self, dim: int, *, axes: int = 1, base: float = 10000.0,
                 interleaved: bool = False, frequencies: Tensor | None = None,
                 attention_factor: float = 1.0, ntk_factor: float | None = None,
                 long_frequencies: Tensor | None = None,
                 original_length: int | None = None) -> None:
        super().__init__()
        self.axes = check_positive(axes, "axes")
        dim = check_positive(dim, "dim")
        if dim % (2 * self.axes):
            raise ValueError(f"dim must be a multiple of 2 * axes = {2 * self.axes} (a plane "
                             f"of two channels per frequency and axis), got dim={dim}")
        _check_base(base)
        self.dim = dim
        self.base = float(base)
        self.interleaved = check_flag(interleaved, "interleaved")
        _check_frequencies(frequencies, dim // self.axes // 2)
        self.register_buffer("frequencies", None if frequencies is None
                             else frequencies.detach().clone(), persistent=False)
        self.attention_factor = _check_attention_factor(attention_factor)
        _check_frequencies(long_frequencies, dim // self.axes // 2, "long_frequencies")
        ntk = _check_ntk(ntk_factor, original_length, frequencies, dim // self.axes,
                         long_frequencies)
        self.ntk_factor, self.original_length = ntk or (None, None)
        self.register_buffer("long_frequencies", None if long_frequencies is None
                             else long_frequencies.detach().clone(), persistent=False)

    @property
    def _ntk(self) -> tuple[float | None, int] | None:
        """``(ntk_factor, original_length)`` for frequencies that depend on a call's largest
        position, or ``None``: read from the attributes at each call, so that setting them
        after construction takes effect (and is checked as the constructor checks them)."""
        return _check_ntk(self.ntk_factor, self.original_length, self.frequencies,
                          self.dim // self.axes, self.long_frequencies)

    def _apply(self, fn, recurse: bool = True) -> RotaryPE:
        # the frequencies follow the module's device but keep their dtype: a model cast to
        # bf16 would otherwise turn them by up to 0.4% too far (4 radians at position 1000)
        kept = {name: getattr(self, name) for name in ("frequencies", "long_frequencies")}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if before is not None and after is not None and after.dtype != before.dtype:
                self._buffers[name] = before.to(device=after.device)
        return self

    @classmethod
    def yarn(cls, dim: int, factor: float, original_length: int, *, axes: int = 1,
             base: float = 10000.0, interleaved: bool = False, beta_fast: float = 32.0,
             beta_slow: float = 1.0, attention_factor: float | None = None) -> RotaryPE:
        r"""The rotary embedding of a model trained on ``original_length`` positions
        :math:`L_0`, stretched to ``factor`` s times as many by YaRN (Peng et al., 2023, "YaRN:
        Efficient Context Window Extension of Large Language Models"), as Hugging Face's
        ``rope_type="yarn"`` computes it.

        Plane m of a group of g channels turns :math:`r_m = L_0 \theta_m / 2\pi` times over
        the trained positions, :math:`\theta_m = \text{base}^{-2m/g}`. Planes that turn more
        than ``beta_fast`` times keep their frequency (they tell near positions apart and
        have seen every angle), planes that turn less than ``beta_slow`` times are
        interpolated to :math:`\theta_m / s`, and a linear ramp over the planes joins the two:

        .. math::
            \theta'_m = (1 - \gamma_m)\,\frac{\theta_m}{s} + \gamma_m\, \theta_m, \qquad
            \gamma_m = 1 - \mathrm{clamp}\Big(\frac{m - m_\text{lo}}{m_\text{hi} -
            m_\text{lo}}, 0, 1\Big),

        with :math:`m_\text{lo} = \lfloor m(\beta_\text{fast}) \rfloor` and
        :math:`m_\text{hi} = \lceil m(\beta_\text{slow}) \rceil`, :math:`m(r) = g \ln(L_0 /
        2\pi r) / (2 \ln \text{base})` the plane that turns r times. The cosines and sines
        are multiplied by ``attention_factor`` (default :math:`0.1 \ln s + 1`), which
        sharpens the softmax as the context grows.

        Args:
            dim (int): channels rotated per head, as :class:`RotaryPE` takes it.
            factor (float): the context's growth s >= 1.
            original_length (int): the positions the model was trained on, :math:`L_0`.
            axes, base, interleaved: as :class:`RotaryPE` takes them.
            beta_fast (float, optional): turns over :math:`L_0` from which a plane keeps its
                frequency. (default: ``32.0``)
            beta_slow (float, optional): turns under which a plane is interpolated fully.
                (default: ``1.0``)
            attention_factor (float, optional): the factor on the cosines and sines;
                ``None`` for :math:`0.1 \ln s + 1`. (default: ``None``)
        """
        axes = check_positive(axes, "axes")
        dim = check_positive(dim, "dim")
        check_finite(factor, "factor")
        if factor < 1:
            raise ValueError(f"factor must be a number >= 1, got {factor!r}")
        original_length = check_positive(original_length, "original_length")
        _check_base(base)
        if base == 1:
            raise ValueError("yarn needs base > 1: its ramp runs from the fast planes to the "
                             "slow ones, and with base=1 every plane turns at one frequency")
        check_finite(beta_fast, "beta_fast")
        check_finite(beta_slow, "beta_slow")
        if not 0 < beta_slow <= beta_fast:
            raise ValueError(f"beta_fast and beta_slow must satisfy 0 < beta_slow <= "
                             f"beta_fast, got beta_fast={beta_fast!r}, beta_slow={beta_slow!r}")
        if dim % (2 * axes):  # (as RotaryPE refuses it, before the frequencies are made)
            raise ValueError(f"dim must be a multiple of 2 * axes = {2 * axes} (a plane of two "
                             f"channels per frequency and axis), got dim={dim}")
        group = dim // axes
        if attention_factor is None:
            attention_factor = 0.1 * math.log(factor) + 1.0
        steps = torch.arange(0, group, 2, dtype=torch.float64)
        theta = 1.0 / (float(base) ** (steps / group))  # (g / 2,)

        def plane(turns: float) -> float:  # the (real) plane m that turns `turns` times
            return group * math.log(original_length / (turns * 2 * math.pi)) / (
                2 * math.log(base))

        low = max(math.floor(plane(beta_fast)), 0)
        high = min(math.ceil(plane(beta_slow)), group - 1)
        width = high - low if high != low else 0.001
        ramp = ((torch.arange(group // 2, dtype=torch.float64) - low) / width).clamp(0, 1)
        frequencies = theta / factor * ramp + theta * (1 - ramp)
        return cls(dim, axes=axes, base=base, interleaved=interleaved, frequencies=frequencies,
                   attention_factor=attention_factor)

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        """``x`` ``[..., N, H, C]`` rotated by ``pos`` ``[..., N]`` or ``[..., N, A]``."""
        check_tensors(x=x, pos=pos)
        return self._rotate(x, pos)

    def _rotate(self, x: Tensor, pos: Tensor, length: Tensor | None = None) -> Tensor:
        return _apply_rotary(x, pos, self.dim, self.axes, self.base, self.interleaved,
                             self.frequencies, self.attention_factor, self._ntk, length,
                             self.long_frequencies)

    def rotate_pair(self, q: Tensor, k: Tensor, pos_q: Tensor, pos_k: Tensor,
                    ) -> tuple[Tensor, Tensor]:
        """``self(q, pos_q), self(k, pos_k)``, computing the angles once when the two
        position tensors are one (self-attention). With dynamic NTK scaling or long
        frequencies both take the frequencies of the largest position of either, so that
        their scores stay relative."""
        check_tensors(q=q, k=k, pos_q=pos_q, pos_k=pos_k)
        if (pos_q is not pos_k or q.shape[:-2] != k.shape[:-2] or q.size(-1) != k.size(-1)
                or q.dtype != k.dtype):  # (the angles broadcast over any number of heads)
            length = None if self._ntk is None else _positions_spanned(pos_q, pos_k)
            return self._rotate(q, pos_q, length), self._rotate(k, pos_k, length)
        _check_rows(q, self.dim)
        cos, sin = _rotary_angles(pos_q, q, self.dim, self.axes, self.base, self.interleaved,
                                  self.frequencies, self.attention_factor, self._ntk,
                                  long=self.long_frequencies)
        return tuple(_rotate(t, cos, sin, self.dim, self.axes, self.interleaved)
                     for t in (q, k))

    def extra_repr(self) -> str:
        extra = f"{self.dim}"
        extra += "" if self.axes == 1 else f", axes={self.axes}"
        extra += "" if self.base == 10000.0 else f", base={self.base}"
        extra += "" if self.frequencies is None else ", frequencies=[...]"
        extra += "" if self.attention_factor == 1.0 else (
            f", attention_factor={exact_repr(self.attention_factor)}")
        extra += "" if self.ntk_factor is None else f", ntk_factor={exact_repr(self.ntk_factor)}"
        extra += "" if self.long_frequencies is None else ", long_frequencies=[...]"
        extra += "" if self._ntk is None else f", original_length={self.original_length}"
        return extra + (", interleaved=True" if self.interleaved else "")


class QueryTemperature(torch.nn.Module):
    r"""A factor on each query by its position, which grows with the log of the context:

    .. math::
        t(p) = 1 + \beta \ln\!\left(1 + \left\lfloor \frac{p + o}{L} \right\rfloor\right)

    so that a query at position :math:`p` scores :math:`t(p)\, q_i \cdot k_j` (a sharper
    softmax far into a long context, where more keys compete). It is 1 below position
    :math:`L - o` (and before :math:`-o`, where the floor would be negative). Llama 4's
    attention temperature tuning (its layers without RoPE: ``beta=attn_scale,
    length=floor_scale, offset=1``) and Mistral 4's (``beta=llama_4_scaling_beta,
    length=original_max_position_embeddings``) are this factor; :func:`graphattn.nn.from_llama`
    reads both.

    Give it to :class:`~graphattn.nn.GraphSelfAttention` (or
    :class:`~graphattn.nn.DenseSelfAttention`) as ``query_temperature=``, and the positions to
    each call as ``pos=``: the layer multiplies each target's queries by :math:`t` of its
    position after their normalisation and rotation, on every backend. It has no parameters.

    Args:
        beta (float): :math:`\beta`, finite.
        length (float): :math:`L`, > 0: the positions of one step of the floor.
        offset (float, optional): :math:`o`, finite. (default: ``0.0``)

    Shapes:
        - **input:** pos ``(..., N)``, integer or real
        - **output:** ``(..., N)`` float32 factors
    """

    def __init__(self, beta: float, length: float, *, offset: float = 0.0) -> None:
        super().__init__()
        check_finite(beta, "beta")
        check_finite(length, "length")
        check_finite(offset, "offset")
        if length <= 0:
            raise ValueError(f"length must be > 0, got {length!r}")
        self.beta, self.length, self.offset = float(beta), float(length), float(offset)

    def forward(self, pos: Tensor) -> Tensor:
        """The factors :math:`t(p)` of the positions ``pos``, float32 of ``pos``'s shape."""
        check_tensors(pos=pos)
        if pos.is_complex() or pos.dtype == torch.bool:
            raise TypeError(f"pos must be integer or real, got {pos.dtype}")
        # (positions before -o take the first step's factor, 1, not log(0) or a NaN)
        steps = torch.floor((pos.to(torch.float32) + self.offset) / self.length).clamp_min(0)
        return 1.0 + self.beta * torch.log1p(steps)

    def extra_repr(self) -> str:
        extra = f"beta={exact_repr(self.beta)}, length={exact_repr(self.length)}"
        return extra + ("" if self.offset == 0.0 else f", offset={exact_repr(self.offset)}")
