r"""Dropout drawn from a uniform sample, the fast way on CPU.

``torch.bernoulli_`` with a float probability costs about 20 ns per element on one CPU core,
three times a uniform draw and a comparison; ``F.dropout`` uses it. Both draw the same law:
for :math:`u \sim U[0, 1)`, :math:`P(u \ge p) = 1 - p`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphattn._checks import check_dropout


def dropout_mask(shape: tuple[int, ...], p: float, *, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    r"""An inverted-dropout multiplier: each entry is 0 with probability ``p``, else
    :math:`1 / (1 - p)`, so that :math:`\mathbb{E}[m] = 1`.

    Args:
        shape (tuple): shape of the mask.
        p (float): drop probability, in ``[0, 1)``.
        device (torch.device, optional): where to draw it. (default: the current default)
        dtype (torch.dtype, optional): its dtype. (default: ``torch.float32``)
    """
    check_dropout(p, "p")
    # drawn out of place: under torch.func.vmap(randomness="different") a fresh tensor filled
    # in place would be unbatched, which vmap refuses (the same numbers as uniform_())
    keep = torch.rand(shape, device=device, dtype=torch.float32).ge(p)
    return keep.to(dtype).mul_(1.0 / (1.0 - p))


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    r"""``F.dropout(x, p, training)`` with the mask of :func:`dropout_mask`:
    :math:`x \odot m`, and the gradient :math:`g \odot m` in backward.

    Args:
        x (Tensor): any dense tensor.
        p (float): drop probability, in ``[0, 1)``.
        training (bool, optional): apply dropout; otherwise return ``x`` itself.
            (default: ``True``)

    Shapes:
        - **input:** x ``(*)``
        - **output:** ``(*)``
    """
    check_dropout(p, "p")
    if not training or p == 0.0:
        return x
    return x * dropout_mask(tuple(x.shape), p, device=x.device, dtype=x.dtype)
