r"""A learned sparse graph: each target keeps the ``top_k`` in-edges a small scoring network
ranks highest (DeepSeek's sparse attention, DSA).

DeepSeek-V3.2 (DeepSeek-AI, 2025, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language
Models") attends each query to the 2048 keys that its "lightning indexer" scores highest, out
of all the keys before it. In graph terms that is attention over a subgraph of the causal
graph, chosen per call: :class:`LightningIndexer` scores the edges of any candidate graph and
:func:`graphattn.graphs.top_k_edges` keeps each target's best, which
``GraphSelfAttention(..., indexer=LightningIndexer(...))`` then attends over.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn import Linear

from graphattn._checks import check_edge_index, check_positive, check_tensors
from graphattn.functional import cpu
from graphattn.functional._transforms import host_readable, needs_grad, plain_ops_only, saveable
from graphattn.pe import RotaryPE

# edges scored per chunk: the [chunk, H_I, D] products stay below this many numbers
_CHUNK_NUMBERS = 1 << 22
# the scores a CPU kernel computes (one kernel by target; off the CPU and when autograd
# records, torch's ops)
_KERNEL_DTYPES = (torch.float32, torch.float64)


def _all_pair_scores(q: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """The indexer's score of every pair ``[N_dst, N_src]`` from its scaled queries ``[N_dst,
    H_I, D]``, keys ``[N_src, D]`` and head weights ``[N_dst, H_I]``: matrix products by blocks
    of targets, each ``[rows, H_I, N_src]`` below ``_CHUNK_NUMBERS`` numbers. A graph of half
    the pairs or more takes these (no larger than twice its edges) instead of one dot product
    per edge gathered by index."""
    n_dst, H, _ = q.shape
    out = q.new_empty(n_dst, k.size(0))
    rows = max(1, _CHUNK_NUMBERS // max(1, H * k.size(0)))
    for start in range(0, n_dst, rows):
        heads = torch.matmul(q[start:start + rows], k.T).relu()  # (rows, H_I, N_src)
        out[start:start + rows] = torch.einsum("rhs,rh->rs", heads, w[start:start + rows])
    return out


class _CPUScores(torch.autograd.Function):
    """The CPU kernels' scores of edges grouped by target (``rowptr``, ``src``), differentiable
    in the queries, keys and head weights (for :meth:`LightningIndexer.loss`)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, w: Tensor, rowptr: Tensor, src: Tensor) -> Tensor:
        return cpu.indexer_scores(q, k, w, rowptr, src)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*saveable(*inputs))

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, w, rowptr, src = ctx.saved_tensors
        return (*cpu.indexer_score_grads(grad, q, k, w, rowptr, src), None, None)


def _cpu_scores(q: Tensor, k: Tensor, w: Tensor, src: Tensor, dst: Tensor) -> Tensor:
    """The indexer's score ``[E]`` of each edge ``src -> dst`` from its scaled queries ``[N_dst,
    H_I, D]``, keys ``[N_src, D]`` and head weights ``[N_dst, H_I]`` on the CPU: the edges
    grouped by target (a stable sort, where they are not), one kernel over the targets' rows
    (and one for the gradients, when autograd records)."""
    order = None
    if src.numel() and bool((dst[1:] < dst[:-1]).any()):
        order = torch.argsort(dst, stable=True)
        src, dst = src[order], dst[order]
    rowptr = torch.searchsorted(dst, torch.arange(q.size(0) + 1))  # (N_dst + 1,)
    src = src.contiguous()
    if needs_grad(q, k, w):
        scores = _CPUScores.apply(q, k, w, rowptr, src)  # (E,) by target
    else:
        scores = cpu.indexer_scores(q, k, w, rowptr, src)
    if order is None:
        return scores
    return torch.empty_like(scores).index_copy(0, order, scores)


class LightningIndexer(torch.nn.Module):
    r"""The score of each edge :math:`j \to i` of a candidate graph by a small multi-head
    scoring network, DeepSeek-V3.2's lightning indexer:

    .. math::
        s_{ji} = \sum_{h=1}^{H_I} w_{ih}\, \mathrm{ReLU}\big(\tau\, q_{ih} \cdot k_j\big),
        \qquad q_{ih} = R(p_i)\, W^{Q}_h u_i, \quad k_j = R(p_j)\,
        \mathrm{LayerNorm}(W^{K} x_j), \quad w_i = H_I^{-1/2}\, W^{w} x_i

    with :math:`\tau = D^{-1/2}`, one key per source shared by the :math:`H_I` heads, and
    ``rotary`` R turning the first channels of queries and keys by the targets' and sources'
    positions. :math:`u_i` is the target's features, or the query latent of the layer that
    holds the indexer (:class:`~graphattn.nn.LowRankLinear`'s normalised bottleneck, as
    DeepSeek shares its query compression with the indexer). A layer with
    ``indexer=`` keeps each target's ``top_k`` edges of highest score
    (:func:`graphattn.graphs.top_k_edges`) and attends over them.

    The choice of edges is not differentiable, and the scores are computed without gradients:
    the indexer is trained apart, to match the attention's weights by a KL divergence
    (:meth:`loss`, as DeepSeek trains it), or converted from a trained model
    (:func:`graphattn.nn.from_llama`).
    Scoring costs :math:`E H_I D` multiply-adds. On the CPU one kernel computes them target by
    target, with nothing of size :math:`E \times H_I` (and another their gradients, for
    :meth:`loss`); elsewhere, by chunks of edges, or, on a graph of half the pairs or more (a
    causal or complete graph), every pair's score by matrix products.

    Args:
        in_channels (int): features F of the sources and targets (keys and head weights).
        heads (int): scoring heads :math:`H_I`.
        channels (int): channels D of each query and of the key.
        top_k (int): edges kept per target.
        query_channels (int, optional): width of :math:`u_i`, when it is not the targets'
            features (a layer's ``q_rank``). (default: ``None``: ``in_channels``)
        rotary (RotaryPE, optional): the rotation of the first ``rotary.dim`` channels.
            (default: ``None``)

    Modules: ``lin_q`` ``Linear(query_channels, H_I D, bias=False)``, ``lin_k`` ``Linear(F, D,
    bias=False)``, ``k_norm`` ``LayerNorm(D)``, ``lin_w`` ``Linear(F, H_I, bias=False)``.

    Shapes:
        - **input:** queries' features u ``(|V_dst|, query_channels)``, x_src
          ``(|V_src|, F)``, x_dst ``(|V_dst|, F)``, edge_index ``(2, |E|)``, positions
          ``(|V|)`` or ``(|V|, A)``
        - **output:** scores ``(|E|)``, float32 at least
    """

    def __init__(self, in_channels: int, heads: int, channels: int, top_k: int, *,
                 query_channels: int | None = None, rotary: RotaryPE | None = None) -> None:
        super().__init__()
        self.in_channels = check_positive(in_channels, "in_channels")
        self.heads = check_positive(heads, "heads")
        self.channels = check_positive(channels, "channels")
        self.top_k = check_positive(top_k, "top_k")
        self.query_channels = (self.in_channels if query_channels is None
                               else check_positive(query_channels, "query_channels"))
        if rotary is not None and not isinstance(rotary, RotaryPE):
            raise TypeError(f"rotary must be a graphattn.pe.RotaryPE or None, got "
                            f"{type(rotary).__name__}")
        if rotary is not None and rotary.dim > self.channels:
            raise ValueError(f"rotary turns {rotary.dim} channels, more than the indexer's "
                             f"channels = {self.channels}")
        self.rotary = rotary
        self.lin_q = Linear(self.query_channels, self.heads * self.channels, bias=False)
        self.lin_k = Linear(self.in_channels, self.channels, bias=False)
        self.k_norm = torch.nn.LayerNorm(self.channels, eps=1e-6)
        self.lin_w = Linear(self.in_channels, self.heads, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weights; the key norm's gains 1 and bias 0."""
        for lin in (self.lin_q, self.lin_k, self.lin_w):
            torch.nn.init.xavier_uniform_(lin.weight)
        self.k_norm.reset_parameters()

    def forward(self, u: Tensor, x_src: Tensor, x_dst: Tensor, edge_index: Tensor, *,
                pos_src: Tensor | None = None, pos_dst: Tensor | None = None) -> Tensor:
        """The score of each edge of ``edge_index``, without gradients; see the class
        docstring for the formula and shapes."""
        check_edge_index(edge_index, num_src=x_src.size(0), num_dst=x_dst.size(0))
        with torch.no_grad():
            return self._scores(u, x_src, x_dst, edge_index, pos_src, pos_dst)

    def loss(self, u: Tensor, x_src: Tensor, x_dst: Tensor, edge_index: Tensor,
             alpha: Tensor, *, pos_src: Tensor | None = None, pos_dst: Tensor | None = None,
             reduction: str = "mean") -> Tensor:
        r"""The indexer's training loss, DeepSeek-V3.2's: the KL divergence from the
        attention's weights, summed over its heads and normalised over each target's edges,
        to the softmax of the indexer's scores over the same edges,

        .. math::
            \mathcal{L} = \sum_i \mathrm{KL}\big(p_{i,:} \,\|\,
            \operatorname{softmax}_j(s_{ji})\big), \qquad
            p_{ij} = \frac{\sum_h \alpha_{ij}^h}{\sum_{j'} \sum_h \alpha_{ij'}^h}

        over the edges of ``edge_index``: all the candidate edges with a dense attention's
        weights (DeepSeek's dense warm-up), or the chosen ones with the sparse layer's (its
        sparse stage: the edges and weights ``return_attention_weights=True`` gives). Every
        input is detached, so the gradient reaches the indexer's parameters alone, as
        DeepSeek trains the indexer apart from the model. Targets whose weights sum to 0 (no
        edge) count for nothing.

        Args:
            u, x_src, x_dst, edge_index, pos_src, pos_dst: as :meth:`forward` takes them.
            alpha (Tensor): ``[E, H]`` (or ``[E]``) the attention's weights on those edges,
                non-negative.
            reduction (str, optional): ``"mean"`` over the targets with edges, or ``"sum"``.
                (default: ``"mean"``)

        Returns:
            Tensor: the loss, a scalar of float32 at least.
        """
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        check_edge_index(edge_index, num_src=x_src.size(0), num_dst=x_dst.size(0))
        check_tensors(alpha=alpha)
        if alpha.dim() not in (1, 2) or alpha.size(0) != edge_index.size(1):
            raise ValueError(f"alpha must have shape [E, H] or [E] with E = "
                             f"{edge_index.size(1)}, got {list(alpha.shape)}")
        detached = [None if t is None else t.detach() for t in (u, x_src, x_dst, pos_src,
                                                                pos_dst)]
        scores = self._scores(detached[0], detached[1], detached[2], edge_index, detached[3],
                              detached[4])  # (E,)
        dst = edge_index[1].long()
        n = detached[2].size(0)
        weight = alpha.detach().to(scores.dtype)
        weight = weight.sum(-1) if weight.dim() == 2 else weight  # (E,)
        total = weight.new_zeros(n).index_add_(0, dst, weight)  # (N_dst,)
        p = weight / total[dst].clamp_min(torch.finfo(weight.dtype).tiny)  # (E,)
        top = scores.detach().new_full((n,), -torch.inf).scatter_reduce_(
            0, dst, scores.detach(), "amax", include_self=True)  # (N_dst,)
        shifted = scores - top[dst]
        exp = shifted.exp()
        log_norm = exp.new_zeros(n).index_add_(0, dst, exp).log()  # (N_dst,)
        log_q = shifted - log_norm[dst]  # (E,) log softmax over each target's edges
        terms = torch.where(p > 0, p * (p.clamp_min(torch.finfo(p.dtype).tiny).log() - log_q),
                            torch.zeros_like(p))
        loss = terms.sum()
        return loss / (total > 0).sum().clamp_min(1) if reduction == "mean" else loss

    def dense_scores(self, u: Tensor, x: Tensor, pos: Tensor | None = None) -> Tensor:
        """The score of every pair of a sequence (or of each of a batch of them), without
        gradients: ``u [..., L, query_channels]``, ``x [..., L, F]``, ``pos [..., L]`` ->
        ``[..., L, L]`` (target i, source j), as :class:`~graphattn.nn.DenseSelfAttention`
        takes them."""
        with torch.no_grad():
            q, k, w = self._projected(u, x, x, pos, pos)  # (..., L, H_I, D), (..., L, D), ..
            lead, L = q.shape[:-3], q.size(-3)
            out = q.new_zeros(math.prod(lead), L, L)
            q, k, w = (t.reshape(out.size(0), L, *t.shape[len(lead) + 1:]) for t in (q, k, w))
            kernel = host_readable(q) and q.dtype in _KERNEL_DTYPES  # (a CPU kernel)
            for b in range(out.size(0)):
                out[b] = (cpu.indexer_dense_scores if kernel else _all_pair_scores)(
                    q[b], k[b], w[b])
            return out.view(*lead, L, L)

    def _projected(self, u: Tensor, x_src: Tensor, x_dst: Tensor, pos_src: Tensor | None,
                   pos_dst: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """The scaled queries ``[..., N_dst, H_I, D]``, keys ``[..., N_src, D]`` and head
        weights ``[..., N_dst, H_I]``, float32 at least."""
        H, D = self.heads, self.channels
        dtype = torch.promote_types(x_src.dtype, torch.float32)
        q = self.lin_q(u).unflatten(-1, (H, D))  # (..., N_dst, H_I, D)
        k = self.k_norm(self.lin_k(x_src)).unsqueeze(-2)  # (..., N_src, 1, D)
        if self.rotary is not None:
            if pos_src is None or pos_dst is None:
                raise ValueError("the indexer has a rotary embedding and needs the positions "
                                 "(the layer's pos)")
            q, k = self.rotary.rotate_pair(q, k, pos_dst, pos_src)
        w = self.lin_w(x_dst).to(dtype) * H ** -0.5  # (..., N_dst, H_I)
        return q.to(dtype) * D ** -0.5, k.to(dtype).squeeze(-2), w

    def _scores(self, u: Tensor, x_src: Tensor, x_dst: Tensor, edge_index: Tensor,
                pos_src: Tensor | None, pos_dst: Tensor | None) -> Tensor:
        """:meth:`forward`'s scores, through autograd when it records."""
        H, D = self.heads, self.channels
        q, k, w = self._projected(u, x_src, x_dst, pos_src, pos_dst)
        dtype = q.dtype
        src, dst = edge_index.long()
        n_dst, n_src = q.size(0), k.size(0)
        if host_readable(q) and dtype in _KERNEL_DTYPES and not plain_ops_only(q, k, w):
            return _cpu_scores(q, k, w, src, dst)
        if 2 * src.numel() >= n_dst * n_src:  # half the pairs or more: all pairs, by products
            return _all_pair_scores(q, k, w)[dst, src]
        scores = torch.empty(src.numel(), dtype=dtype, device=q.device)
        step = max(1, _CHUNK_NUMBERS // (H * D))
        for start in range(0, src.numel(), step):  # (E / step chunks of [step, H_I, D])
            j, i = src[start:start + step], dst[start:start + step]
            heads = torch.einsum("ehd,ed->eh", q[i], k[j]).relu()  # (chunk, H_I)
            scores[start:start + step] = (heads * w[i]).sum(-1)
        return scores

    def inline_repr(self) -> str:
        """The indexer as the call that builds it, its ``rotary`` included (for the repr of a
        layer that holds it)."""
        extra = "" if self.rotary is None else f", rotary={self.rotary!r}"
        return f"{self.__class__.__name__}({self.extra_repr()}{extra})"

    def extra_repr(self) -> str:
        extra = "" if self.query_channels == self.in_channels else \
            f", query_channels={self.query_channels}"
        return (f"{self.in_channels}, heads={self.heads}, channels={self.channels}, "
                f"top_k={self.top_k}{extra}")


def top_k_mask(scores: Tensor, allowed: Tensor, k: int) -> Tensor:
    """Each row's ``k`` allowed entries of highest score (all of them where a row allows at
    most ``k``), ties to the first in the row, NaN ranked last: ``[..., L_q, L_k]`` bool, the
    dense form of :func:`graphattn.graphs.top_k_edges` on the graph of ``allowed`` (whose
    edges come by target, then source)."""
    nan = torch.isnan(scores)
    ranked = scores.masked_fill(nan | ~allowed, -torch.inf)
    kth = ranked.topk(min(k, ranked.size(-1)), dim=-1).values[..., -1:]  # (..., L_q, 1)
    above = allowed & (ranked > kth)
    tied = allowed & (ranked == kth) & ~nan
    room = k - above.sum(-1, keepdim=True)  # (..., L_q, 1)
    last = allowed & nan & (kth == -torch.inf)  # (tied too, after the rest of the ties)
    room_last = room - tied.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= room)) | (last & (last.cumsum(-1) <= room_last))
