r"""Per-edge key and value terms for backends without them in their kernels.

``edge_attention(..., edge_key=ek, edge_value=ev)`` attends with the key :math:`k_j + ek_e` and
the value :math:`v_j + ev_e` on each edge e = (j -> i). The ``reference``, ``cpu`` and
``triton`` backends take these terms themselves. For the ``dense`` backend,
:func:`fold_edge_terms` rewrites the call into one it takes, in one of two exact ways:

- **edges as sources** (any score): each edge becomes a source of its own, with key
  :math:`k_j + ek_e` and value :math:`v_j + ev_e`, and the graph ``e -> i``. This holds
  ``[E, H, C]`` keys and values (and their gradients).
- **score bias and value sum** (the dot score, and an edge value alone): the key term is the
  score bias :math:`\text{scale} \cdot q_i \cdot ek_e` (:class:`TargetDot`), and the value term
  :math:`\sum_e w_{ie} \, ev_e` is added beside the operator (:class:`WeightedEdgeSum`), with
  the weights the operator used, dropout included. Both run in chunks of ``EDGE_CHUNK`` edges,
  so only the ``[E, H, C]`` edge terms and their gradients are ever held whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphattn.functional._transforms import plain_ops_only, saveable

# Edges per step of TargetDot and WeightedEdgeSum: their [chunk, H, C] temporaries stay small.
EDGE_CHUNK = 1 << 16


def _chunks(num_edges: int) -> list[slice]:
    """Slices of at most ``EDGE_CHUNK`` edges; one slice under ``torch.compile``, whose edge
    count may be known only at run time (the compiler fuses the gathers there instead)."""
    if torch.compiler.is_compiling():
        return [slice(None)]
    return [slice(a, a + EDGE_CHUNK) for a in range(0, num_edges, EDGE_CHUNK)]


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores are formed in: fp32 for half precision, as every backend forms them."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class TargetDot(torch.autograd.Function):
    """``b_e = q_i . w_e`` per head for each edge e = (j -> i), ``[E, H]``, in chunks of edges,
    formed and returned in fp32 for half precision (a score; ``q_i . w_e`` past 65504 would be
    inf in fp16); backward keeps q and w, never the gathered rows ``q_i`` ``[E, H, C]``, and
    sums dq in that dtype too."""

    @staticmethod
    def forward(ctx, q: Tensor, w: Tensor, dst: Tensor) -> Tensor:
        ctx.save_for_backward(*saveable(q, w, dst))
        work = score_dtype(torch.promote_types(q.dtype, w.dtype))
        out = w.new_empty(w.shape[:2], dtype=work)  # (E, H)
        for s in _chunks(w.size(0)):
            out[s] = (q.index_select(0, dst[s]).to(work) * w[s].to(work)).sum(dim=-1)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        q, w, dst = ctx.saved_tensors
        work = grad.dtype
        grad_q = (torch.zeros_like(q, dtype=work) if ctx.needs_input_grad[0]
                  else None)  # (N_dst, H, C)
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[1] else None  # (E, H, C)
        for s in _chunks(w.size(0)):
            g = grad[s].unsqueeze(-1)  # (chunk, H, 1)
            if grad_q is not None:
                grad_q.index_add_(0, dst[s], g * w[s].to(work))
            if grad_w is not None:
                grad_w[s] = g * q.index_select(0, dst[s]).to(work)
        return None if grad_q is None else grad_q.to(q.dtype), grad_w, None


class WeightedEdgeSum(torch.autograd.Function):
    """``out_i = sum_e a_e w_e`` over the edges e into each target i, ``[N_dst, H, C]``, from
    weights a ``[E, H]`` and edge terms w ``[E, H, C]``, in chunks of edges."""

    @staticmethod
    def forward(ctx, weight: Tensor, w: Tensor, dst: Tensor, num_dst: int) -> Tensor:
        ctx.save_for_backward(*saveable(weight, w, dst))
        out = w.new_zeros(num_dst, *w.shape[1:])  # (N_dst, H, C)
        for s in _chunks(w.size(0)):
            out.index_add_(0, dst[s], weight[s].unsqueeze(-1) * w[s])
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        weight, w, dst = ctx.saved_tensors
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[0] else None  # (E, H)
        grad_w = torch.empty_like(w) if ctx.needs_input_grad[1] else None  # (E, H, C)
        for s in _chunks(w.size(0)):
            g = grad.index_select(0, dst[s])  # (chunk, H, C)
            if grad_weight is not None:
                grad_weight[s] = (g * w[s]).sum(dim=-1)
            if grad_w is not None:
                grad_w[s] = weight[s].unsqueeze(-1) * g
        return grad_weight, grad_w, None, None


def edges_as_sources(k: Tensor, v: Tensor, edge_index: Tensor, edge_key: Tensor | None,
                     edge_value: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Keys ``k_j + ek_e``, values ``v_j + ev_e`` ``[E, H, C]`` and the graph ``e -> i``
    ``[2, E]``: each target then attends over exactly its in-edges, in ``edge_index`` order,
    through any backend, and autograd carries the gradients back through the gather."""
    src, dst = edge_index
    k = k[src] if edge_key is None else k[src] + edge_key  # (E, H, C)
    v = v[src] if edge_value is None else v[src] + edge_value  # (E, H, C)
    edge_ids = torch.arange(src.numel(), device=src.device, dtype=src.dtype)
    return k, v, torch.stack([edge_ids, dst])  # (2, E)


def fold_edge_terms(attend, q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *,
                    scale: float, bias: Tensor | None, dropout_mask: Tensor | None, score: str,
                    need_alpha: bool, edge_key: Tensor | None, edge_value: Tensor | None,
                    **options) -> tuple[Tensor, Tensor | None]:
    """Run the backend ``attend`` (a function of ``graphattn.functional.attention.BACKENDS``'
    signature, without edge terms) on a call with edge terms, as the module docstring says:
    gatv2's key term through edges as sources, everything else as score bias and value sum."""
    if edge_key is not None and score != "dot":
        k, v, edge_index = edges_as_sources(k, v, edge_index, edge_key, edge_value)
        return attend(q, k, v, edge_index, scale=scale, bias=bias, dropout_mask=dropout_mask,
                      score=score, need_alpha=need_alpha, **options)
    dst = edge_index[1]
    # torch.func's transforms (vmap, jvp, ...) and forward-mode dual inputs cannot run the two
    # Functions: plain ops there, which hold [E, H, C] gathers
    plain = plain_ops_only(q, k, v, bias, edge_key, edge_value, dropout_mask,
                           options.get("att"))
    if edge_key is not None:  # a score: fp32 for half precision, as the backends form them
        work = score_dtype(torch.promote_types(q.dtype, edge_key.dtype))
        key_bias = ((q.index_select(0, dst).to(work) * edge_key.to(work)).sum(dim=-1) if plain
                    else TargetDot.apply(q, edge_key, dst)) * scale  # (E, H)
        bias = key_bias if bias is None else bias + key_bias
    out, alpha = attend(q, k, v, edge_index, scale=scale, bias=bias, dropout_mask=dropout_mask,
                        score=score, need_alpha=need_alpha or edge_value is not None, **options)
    if edge_value is not None:
        weight = alpha if dropout_mask is None else alpha * dropout_mask  # (E, H): out's weights
        weight = weight.to(edge_value.dtype)
        out = out + (
            edge_value.new_zeros(q.size(0), *edge_value.shape[1:]).index_add(
                0, dst, weight.unsqueeze(-1) * edge_value) if plain
            else WeightedEdgeSum.apply(weight, edge_value, dst, q.size(0)))  # (N_dst, H, C)
    return out, (alpha if need_alpha else None)
