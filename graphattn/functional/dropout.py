r"""Dropout masks drawn the fast way on CPU.

On CPU a mask comes from a counter-based generator, SplitMix64 (Steele, Lea and Flood, "Fast
splittable pseudorandom number generators", OOPSLA 2014, who tested it with TestU01 and
DieHarder; the mixing function is Stafford's "Mix13"): one seed of 63 bits is drawn from torch's
generator, and entry ``i`` of the mask is a function of that seed and ``i`` alone, written in
the mask's dtype in one pass (:func:`graphattn.functional.cpu.dropout_mask_from_seed`).
``torch.manual_seed``, ``torch.random.fork_rng`` and inductor's ``fallback_random`` therefore
govern the masks as they govern ``torch.rand``. A Cora-sized ``[2708, 64]`` mask takes
0.17 ms on one core, where ``torch.rand(shape).ge(p)`` and the conversion to a float mask take
0.59 ms and ``F.dropout`` (torch's ``bernoulli_``) 1.7 ms (``benchmarks/dropout_cpu.py``).

Elsewhere (CUDA, other devices) the mask is drawn as ``torch.rand(shape) >= p``. Both draw each
entry's drop independently with probability ``p`` (on CPU within :math:`2^{-32}` of it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from graphattn._checks import check_dropout
from graphattn.functional import cpu


def dropout_mask(shape: int | tuple[int, ...], p: float, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    r"""An inverted-dropout multiplier: each entry is 0 with probability ``p``, else
    :math:`1 / (1 - p)`, so that :math:`\mathbb{E}[m] = 1`.

    On CPU (in fp64, fp32, fp16 and bf16) the entries are drawn by SplitMix64 from one seed that
    torch's generator draws, so the same ``torch.manual_seed`` gives the same mask; elsewhere
    the mask is ``torch.rand(shape) >= p``.

    Args:
        shape (int or tuple): shape of the mask.
        p (float): drop probability, in ``[0, 1)``.
        device (torch.device, optional): where to draw it. (default: the current default)
        dtype (torch.dtype, optional): its dtype. (default: ``torch.float32``)
    """
    check_dropout(p, "p")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)  # as torch.rand takes it
    # (torch.get_default_device() returns no tensor, which torch.compile cannot trace)
    device = torch.empty(0).device if device is None else torch.device(device)
    if device.type == "cpu" and dtype in cpu.MASK_DTYPES:
        # the seed is torch's: manual_seed, fork_rng and inductor's fallback_random apply to it
        seed = torch.randint(2**63 - 1, (), dtype=torch.int64, device="cpu")
        if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
                or torch.jit.is_tracing() or torch._C._len_torch_dispatch_stack() > 0):
            # an operator for tracers (dynamo, make_fx, torch.jit.trace) and modes to see,
            # with a rule for vmap's batched seeds
            return torch.ops.graphattn.cpu_dropout_mask(seed, list(shape), float(p), dtype)
        return cpu.dropout_mask_from_seed(int(seed), shape, p, dtype)
    # drawn out of place: under torch.func.vmap(randomness="different") a fresh tensor filled
    # in place would be unbatched, which vmap refuses (the same numbers as uniform_())
    keep = torch.rand(shape, device=device, dtype=torch.float32).ge(p)
    return keep.to(dtype).mul_(1.0 / (1.0 - p))


# the schema written out: older torch versions do not infer it from every annotation
@torch.library.custom_op(
    "graphattn::cpu_dropout_mask", mutates_args=(),
    schema="(Tensor seed, SymInt[] shape, float p, ScalarType dtype) -> Tensor")
def _cpu_dropout_mask_op(seed: Tensor, shape: list[int], p: float, dtype: torch.dtype) -> Tensor:
    """:func:`~graphattn.functional.cpu.dropout_mask_from_seed` as a torch operator, for
    ``torch.compile`` and ``torch.func``; ``seed`` is a 0-dim int64 CPU tensor."""
    return cpu.dropout_mask_from_seed(int(seed), shape, p, dtype)


@_cpu_dropout_mask_op.register_fake
def _(seed, shape, p, dtype):
    return torch.empty(shape, dtype=dtype, device=seed.device)


@_cpu_dropout_mask_op.register_vmap
def _(info, in_dims, seed, shape, p, dtype):
    # vmap(randomness="different") draws one seed per sample (a batched seed): one mask each
    if in_dims[0] is None:
        return _cpu_dropout_mask_op(seed, shape, p, dtype), None
    seeds = seed.movedim(in_dims[0], 0)  # (B,)
    return torch.stack([_cpu_dropout_mask_op(s, shape, p, dtype) for s in seeds]), 0


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
