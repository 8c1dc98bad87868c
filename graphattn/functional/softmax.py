"""Softmax grouped by an index: the normalisation step of edge attention."""

from __future__ import annotations

import torch
from torch import Tensor

from graphattn._checks import (
    check_float_dtype,
    check_non_negative,
    check_same_device,
    check_tensors,
    host_list,
)


def scatter_softmax(src: Tensor, index: Tensor, num_segments: int | None = None) -> Tensor:
    r"""Softmax of ``src`` over the groups that ``index`` defines along dim 0.

    .. math::
        \mathrm{out}_e = \frac{\exp(s_e - m_{g(e)})}
                              {\sum_{e' : g(e') = g(e)} \exp(s_{e'} - m_{g(e)})},
        \qquad m_g = \max_{e : g(e) = g} s_e

    Each group subtracts its own maximum, so groups of wildly different scales are stable in one
    call. A group whose scores are all ``-inf`` gives zeros, never NaN; empty groups are fine.
    A group with a NaN or ``+inf`` score is NaN throughout, as :func:`torch.softmax` is.
    Half-precision inputs (fp16, bf16) are computed in fp32 and returned in their own dtype.

    Args:
        src (Tensor): scores, ``[E]`` or ``[E, H]``.
        index (Tensor): group of each row of ``src``, ``[E]``, integer, values in
            ``[0, num_segments)``.
        num_segments (int, optional): number of groups. (default: ``index.max() + 1``)

    Shapes:
        - **input:** src ``(E)`` or ``(E, H)``, index ``(E)``
        - **output:** ``(E)`` or ``(E, H)``, same dtype as ``src``

    Example:
        >>> scatter_softmax(torch.tensor([1.0, 1.0, 5.0]), torch.tensor([0, 0, 1]))
        tensor([0.5000, 0.5000, 1.0000])
    """
    check_tensors(src=src, index=index)
    check_same_device(src=src, index=index)
    if src.dim() not in (1, 2):
        raise ValueError(f"src must have shape [E] or [E, H], got {list(src.shape)}")
    if index.dim() != 1 or index.numel() != src.size(0):
        raise ValueError(f"index must have shape [E] = [{src.size(0)}] to match src, "
                         f"got {list(index.shape)}")
    if (index.dtype.is_floating_point or index.dtype == torch.bool or index.is_complex()
            or index.dtype in (torch.uint16, torch.uint32, torch.uint64)):
        # (torch's uint16, uint32 and uint64 lack the reductions the range check takes)
        raise TypeError(f"index must have an integer dtype (int8 to int64, or uint8), got "
                        f"{index.dtype}")
    check_float_dtype(src=src)
    if torch.compiler.is_compiling():
        if num_segments is None:
            num_segments = int(index.max()) + 1 if index.numel() > 0 else 0
    elif num_segments is not None and not (torch.jit.is_tracing()
                                           and isinstance(num_segments, Tensor)):
        # (torch.jit.trace gives a size as a 0-d tensor, which records it; an int would fix
        # the traced graph to that many groups)
        num_segments = check_non_negative(num_segments, "num_segments")
    if torch.compiler.is_compiling():
        pass  # the group count is settled above; the edge count may be known at run time only
    elif index.numel() == 0:
        num_segments = num_segments or 0
    else:
        # One host sync (not one per bound) for the range check and the default group count.
        lo, hi = host_list(torch.stack(torch.aminmax(index)))
        num_segments = hi + 1 if num_segments is None else num_segments
        if lo < 0 or hi >= num_segments:
            raise ValueError(f"index must hold groups in [0, num_segments) = "
                             f"[0, {num_segments}), got values from {lo} to {hi}")
    out_dtype = src.dtype
    s = src.float() if src.dtype in (torch.float16, torch.bfloat16) else src
    index = index.long()
    group = index.view(-1, *([1] * (s.dim() - 1))).expand_as(s)  # (E) or (E, H)

    # The shift only stabilises exp(); softmax does not depend on it, so no gradient flows there.
    with torch.no_grad():
        seg_max = s.new_full((num_segments, *s.shape[1:]), float("-inf"))
        seg_max.scatter_reduce_(0, group, s, reduce="amax", include_self=True)
        # an empty or all -inf group: no shift. A +inf maximum stays, so that its group comes
        # out NaN throughout (inf - inf), as in torch.softmax.
        seg_max = seg_max.masked_fill_(seg_max == float("-inf"), 0.0)
    # index_select: its backward sums in a fixed order on a multithreaded CPU, x[index]'s not
    exp = torch.exp(s - seg_max.index_select(0, index))  # (E, H); exactly 0 for -inf scores
    seg_sum = exp.new_zeros((num_segments, *s.shape[1:])).index_add_(0, index, exp)
    # A group of all -inf has seg_sum 0 and exp 0: dividing by 1 there gives 0 instead of NaN,
    # and a gradient of 0 (a tiny divisor would overflow it to inf, and inf * 0 is NaN).
    out = exp / seg_sum.masked_fill(seg_sum == 0, 1.0).index_select(0, index)
    return out.to(out_dtype)
