r"""Attention sinks in the fused kernels: one more score per row and head, whose value is 0.

With sinks :math:`\varsigma_h`, target i's softmax in head h runs over its in-edges and one
more score, :math:`\varsigma_h`, whose value is 0:

.. math::
    \ell_{ih} = e^{\varsigma_h} + \sum_{e \to i} e^{s_{eh}}, \qquad
    \alpha_{eh} = e^{s_{eh}} / \ell_{ih}, \qquad
    \pi_{ih} = e^{\varsigma_h} / \ell_{ih}, \qquad
    o_{ih} = \sum_{e = (j \to i)} \alpha_{eh} \, v_{jh}

so a row's weights sum to :math:`1 - \pi_{ih}` instead of 1, and a row without edges gives 0.
The ``"triton"`` kernels start each row's online softmax at the sink (running maximum
:math:`\varsigma_h`, running sum 1, accumulator 0), the ``"cpu"`` kernels take the sink into
the row's maximum and then its sum; otherwise they run unchanged. The softmax statistics they
keep for backward, the row maximum :math:`m_{ih}` and :math:`\log \ell_{ih}`, then count
the sink, and backward's :math:`\mathrm{d}s_e = \alpha_e
(\mathrm{d}\alpha_e - \delta_i)` with :math:`\delta_{ih} = g_{o,ih} \cdot o_{ih} + \sum_{e
\to i} \alpha_{eh} \, g_{\alpha,eh}` is the gradient of the softmax with the sink as it
stands. The sink's own score has :math:`\mathrm{d}\alpha = 0` (its value is 0, and its
weight is not returned), so

.. math::
    \frac{\partial L}{\partial \varsigma_h} = -\sum_i \pi_{ih} \, \delta_{ih}

which :func:`sink_grad` computes from what the kernels keep, in plain torch ops.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sink_grad(sinks: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
              grad_alpha: Tensor | None = None, alpha: Tensor | None = None,
              targets: Tensor | None = None) -> Tensor:
    r"""The gradient of the sinks :math:`-\sum_i \pi_{ih} \, \delta_{ih}` (see the module
    docstring) from a fused forward's output and softmax statistics.

    Args:
        sinks (Tensor): :math:`\varsigma`, ``[H]``.
        out (Tensor): the forward's output :math:`o`, ``[N_dst, H, C]``.
        lse (Tensor): its statistics ``[N_dst, H, 2]``, the row maximum :math:`m` and
            :math:`\log \ell` (:math:`m = +\infty` on a row without weight).
        grad_out (Tensor): :math:`g_o`, ``[N_dst, H, C]``.
        grad_alpha (Tensor, optional): :math:`g_\alpha`, ``[E, H]``, the gradient of the
            returned weights; with ``alpha`` and ``targets``. (default: ``None``)
        alpha (Tensor, optional): the returned weights ``[E, H]``. (default: ``None``)
        targets (Tensor, optional): the target of each edge ``[E]``. (default: ``None``)

    Shapes:
        - **output:** ``(H)``, in the dtype of ``sinks``
    """
    work = torch.promote_types(out.dtype, torch.float32)
    delta = (grad_out.to(work) * out.to(work)).sum(dim=-1)  # (N_dst, H)
    if grad_alpha is not None:
        delta = delta.index_add(0, targets, alpha.to(work) * grad_alpha.to(work))
    stats = lse.to(work)
    weight = torch.exp((sinks.to(work) - stats[..., 0]) - stats[..., 1])  # (N_dst, H): pi
    return -(weight * delta).sum(dim=0).to(sinks.dtype)  # (H)
