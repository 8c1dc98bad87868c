"""When the fused paths must give way to plain torch ops.

The fused backends' autograd Functions (the ``cpu`` and ``triton`` kernels, the edge-term
gathers and scatters, the dense backend's SDPA wrapper) have a hand-written backward and no
forward-mode or batching rule, and SDPA's flash kernel has no forward-mode derivative. Under
``torch.func``'s transforms, and for inputs that carry a forward-mode tangent
(``torch.autograd.forward_ad``), the same functions are computed with plain torch ops instead,
which every transform differentiates and batches.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor


def plain_ops_only(*tensors: Tensor | None) -> bool:
    """True under ``torch.func``'s transforms (vjp, jvp, vmap, ...) or when one of ``tensors``
    is a forward-mode dual tensor: the fused paths' Functions cannot run there."""
    if torch._C._are_functorch_transforms_active():
        return True
    # no dual level entered (the common case): no tensor can carry a tangent
    return fwAD._current_level >= 0 and any(
        t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors)
