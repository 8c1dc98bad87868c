"""The readable reference backend of edge attention, and the higher-order gradients of the
fused backends.

:func:`reference_edge_attention` is plain torch ops (gather per edge, scatter-softmax,
scatter-add): every other backend is tested against it. Autograd differentiates it as often as
asked. The fused backends (``"cpu"``, ``"triton"``) hand-write one backward pass; when torch
asks for gradients that are themselves differentiable (``create_graph=True``: a gradient
penalty, a Hessian-vector product), their backward calls :func:`reference_grads` instead,
which recomputes the function the reference way and differentiates it with autograd.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from graphattn.functional.softmax import scatter_softmax


def repeat_kv_heads(heads: int, k: Tensor, v: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """Keys and values of ``H_kv`` heads along ``dim`` -> ``heads`` heads, each repeated
    ``G = heads / H_kv`` times: kv head g serves the query heads ``g G .. (g + 1) G - 1``
    (grouped-query attention, as Hugging Face's ``repeat_kv`` and SDPA's ``enable_gqa``)."""
    if k.size(dim) == heads:
        return k, v
    group = heads // k.size(dim)
    return k.repeat_interleave(group, dim=dim), v.repeat_interleave(group, dim=dim)


def reference_edge_attention(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *,
                             scale: float, bias: Tensor | None, dropout_mask: Tensor | None,
                             score: str, negative_slope: float, need_alpha: bool,
                             att: Tensor | None = None, edge_key: Tensor | None = None,
                             edge_value: Tensor | None = None, softcap: float | None = None,
                             sinks: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    r"""The readable reference backend: gather per edge, scatter-softmax, scatter-add.

    For each edge :math:`e = (j \to i)` and head :math:`h`, with the key
    :math:`\kappa_e = k_j + ek_e` and the value :math:`\nu_e = v_j + ev_e` (the edge terms
    when given):

    .. math::
        s_e = \begin{cases}
            \sigma \, q_i \cdot \kappa_e + b_e & \text{dot} \\
            \sigma \, a \cdot \mathrm{LeakyReLU}(q_i + \kappa_e) + b_e & \text{gatv2} \\
            \sigma \, \mathrm{LeakyReLU}(q_i + \kappa_e + b_e) & \text{additive}
        \end{cases}, \qquad
        \alpha_e = \operatorname{softmax}_{e' \to i}(s)_e, \qquad
        o_i = \sum_{e = (j \to i)} d_e \, \alpha_e \, \nu_e

    with :math:`\sigma` the scale and :math:`d_e` the dropout multiplier (1 without). With
    ``softcap`` :math:`c`, the dot and gatv2 scores before their bias,
    :math:`\tilde s_e = s_e - b_e`, become :math:`c \tanh(\tilde s_e / c)`. With ``sinks``
    :math:`\varsigma`, each target's softmax in head h has one more score, :math:`\varsigma_h`,
    whose value is 0: its row is appended to the edges' scores, and cut off after the softmax.
    Arguments are already checked by :func:`edge_attention`, whose backends are all tested
    against this one. Keeps ``[E, H, C]`` tensors for autograd.

    Args:
        q, k, v, edge_index, bias, score, negative_slope, att, edge_key, edge_value, softcap, sinks:
            as in :func:`edge_attention`; ``bias``, ``score`` and ``negative_slope`` have no
            default here (``None``, ``"dot"``, ``0.2`` there).
        scale (float): :math:`\sigma`, a number (no default; for ``None``
            ``edge_attention`` passes its default, :math:`1 / \sqrt{C_k}` for ``"dot"``).
        dropout_mask (Tensor or None): ``None`` (no dropout) or the ``[E, H]`` multiplier
            :math:`d_e` (0 or :math:`1 / (1 - p)`); no default.
        need_alpha (bool): return :math:`\alpha` as well (else ``None`` in its place); no
            default.

    Shapes:
        - **input:** q ``(N_dst, H, C_k)`` (``(N_dst, H)`` for the additive score), k
          ``(N_src, H, C_k)`` (same), v ``(N_src, H, C)``, edge_index ``(2, E)``, bias and
          dropout_mask ``(E, H)``, att ``(H, C_k)``, edge_key ``(E, H, C_k)``, edge_value
          ``(E, H, C)``, sinks ``(H)``
        - **output:** ``(out (N_dst, H, C), alpha (E, H) or None)``
    """
    src, dst = edge_index[0], edge_index[1]
    k, v = repeat_kv_heads(q.size(1), k, v, dim=1)  # grouped k, v: each kv head per query head
    # gathers by index_select, not x[idx]: on a multithreaded CPU the backward of x[idx] sums
    # in an order that changes from run to run, index_select's does not
    k_e = k.index_select(0, src)  # (E, H, C): each edge's key
    k_e = k_e if edge_key is None else k_e + edge_key
    v_e = v.index_select(0, src)  # (E, H, C): each edge's value
    v_e = v_e if edge_value is None else v_e + edge_value
    if q.dtype in (torch.float16, torch.bfloat16):
        # half precision is scored in fp32, as the fused kernels score it: a score past 65504
        # would be inf in fp16, and its target's weights NaN
        q, k_e, att, bias = (None if t is None else t.float() for t in (q, k_e, att, bias))
    if score == "dot":
        # scaled before the product: in fp16, q . k can overflow where the score does not
        s = ((q * scale).index_select(0, dst) * k_e).sum(dim=-1)  # (E, H)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if bias is not None:
            s = s + bias
    elif score == "gatv2":
        z = F.leaky_relu(q.index_select(0, dst) + k_e, negative_slope)  # (E, H, C)
        s = (z * att).sum(dim=-1) * scale  # (E, H)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if bias is not None:
            s = s + bias
    else:
        s = q.index_select(0, dst) + k_e  # (E, H)
        if bias is not None:
            s = s + bias
        s = F.leaky_relu(s, negative_slope) * scale
    if sinks is None:
        alpha = scatter_softmax(s, dst, num_segments=q.size(0)).to(v_e.dtype)  # (E, H)
    else:  # one more score per target and head, the sink's, in the softmax and then cut off
        n_dst, num_edges = q.size(0), s.size(0)
        s = torch.cat([s, sinks.to(s.dtype).expand(n_dst, -1)])  # (E + N_dst, H)
        targets = torch.cat([dst, torch.arange(n_dst, device=dst.device)])  # (E + N_dst)
        alpha = scatter_softmax(s, targets, num_segments=n_dst)[:num_edges].to(v_e.dtype)
    weight = alpha if dropout_mask is None else alpha * dropout_mask  # (E, H)
    msg = weight.unsqueeze(-1) * v_e  # (E, H, C)
    # zeros like msg, not v: under torch.func.vmap of q alone, v is not batched and msg is
    out = msg.new_zeros(q.size(0), *msg.shape[1:]).index_add_(0, dst, msg)  # (N_dst, H, C)
    return out, (alpha if need_alpha else None)


def reference_grads(grad_out: Tensor | None, grad_alpha: Tensor | None, q: Tensor, k: Tensor,
                    v: Tensor, edge_index: Tensor, *, scale: float, bias: Tensor | None,
                    dropout_mask: Tensor | None, score: str, negative_slope: float,
                    att: Tensor | None, edge_key: Tensor | None, edge_value: Tensor | None,
                    needs_grad: Sequence[bool], softcap: float | None = None,
                    sinks: Tensor | None = None) -> tuple[Tensor | None, ...]:
    r"""Differentiable gradients of :func:`reference_edge_attention`: the backward of a fused
    backend under ``create_graph=True``.

    With :math:`(o, \alpha)` the reference's outputs for these inputs and
    :math:`(g_o, g_\alpha)` the incoming gradients, returns the vector-Jacobian products
    :math:`g_o^\top \partial o / \partial x + g_\alpha^\top \partial \alpha / \partial x` for
    :math:`x` in ``(q, k, v, att, bias, edge_key, edge_value, sinks)``, built with
    ``create_graph=True``: autograd can differentiate them again, with respect to the inputs
    and to :math:`g_o, g_\alpha`. ``edge_value is edge_key`` (one tensor in both roles) gets
    the gradient of both roles in the ``edge_key`` slot and ``None`` in the other.

    The arguments ``q, k, v, edge_index, scale, bias, dropout_mask, score, negative_slope, att,
    edge_key, edge_value, softcap, sinks`` are those of :func:`reference_edge_attention` (q and k
    of the additive score may carry a trailing channel of size 1, as the ``"cpu"`` backend keeps
    them).

    Args:
        grad_out (Tensor, optional): :math:`g_o`; ``None`` for zeros.
        grad_alpha (Tensor, optional): :math:`g_\alpha`; ``None`` when alpha gets no gradient.
        needs_grad (list of bool): for each of the eight inputs above, whether its
            gradient is wanted.

    Shapes:
        - **input:** grad_out ``(N_dst, H, C)``, grad_alpha ``(E, H)``; the others as in
          :func:`reference_edge_attention`
        - **output:** eight gradients, each shaped like its input, or ``None`` where not
          wanted, absent, or not reached by the outputs
    """
    value_is_key = edge_value is edge_key
    with torch.enable_grad():
        # one alias per role: q, k and v may be one tensor (edge_attention(x, x, x)), whose
        # gradient autograd would otherwise give whole to each role it is asked for
        q, k, v, att, bias, edge_key, edge_value, sinks = (
            None if t is None else t.view_as(t)
            for t in (q, k, v, att, bias, edge_key, None if value_is_key else edge_value, sinks))
        inputs = (q, k, v, att, bias, edge_key, edge_value, sinks)
        if value_is_key:
            edge_value = edge_key
        if score == "additive" and q.dim() == 3:
            q_, k_ = q.squeeze(-1), k.squeeze(-1)  # (N, H)
        else:
            q_, k_ = q, k
        # The triton backend reads inputs of mixed dtypes each in its own (bf16 q, k, v beside
        # an fp32 att or its fp32 dropout mask, say): recompute in the dtype they promote to, as
        # edge_attention does for the other backends; autograd casts each gradient back to its
        # input's dtype.
        common = functools.reduce(torch.promote_types,
                                  [t.dtype for t in (q_, k_, v, att, bias, edge_key, edge_value,
                                                     dropout_mask) if t is not None])
        q_, k_, v_, att_, bias_, edge_key_, edge_value_ = (
            None if t is None else t.to(common)
            for t in (q_, k_, v, att, bias, edge_key, edge_value))
        out, alpha = reference_edge_attention(
            q_, k_, v_, edge_index, scale=scale, bias=bias_, dropout_mask=dropout_mask,
            score=score, negative_slope=negative_slope, need_alpha=grad_alpha is not None,
            att=att_, edge_key=edge_key_, edge_value=edge_value_, softcap=softcap, sinks=sinks)
        outputs = [out]
        grads = [torch.zeros_like(out) if grad_out is None else grad_out]
        if grad_alpha is not None and alpha.requires_grad:  # (not when only v is wanted)
            outputs.append(alpha)
            grads.append(grad_alpha)
        wanted = [i for i, (t, need) in enumerate(zip(inputs, needs_grad, strict=True))
                  if need and t is not None]
        found = torch.autograd.grad(outputs, [inputs[i] for i in wanted], grads,
                                    create_graph=True, allow_unused=True)
    result: list[Tensor | None] = [None] * len(inputs)
    for i, g in zip(wanted, found, strict=True):
        result[i] = g
    return tuple(result)
