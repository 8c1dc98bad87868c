r"""Dropout masks drawn the fast way on CPU.

On CPU a mask comes from a counter-based generator, SplitMix64 (Steele, Lea and Flood, "Fast
splittable pseudorandom number generators", OOPSLA 2014, who tested it with TestU01 and
DieHarder; the mixing function is Stafford's "Mix13"): one seed of 63 bits is drawn from torch's
generator, and entry ``i`` of the mask is a function of that seed and ``i`` alone, written in
the mask's dtype in one pass (:func:`graphattn.functional.cpu.dropout_mask_from_seed`).
``torch.manual_seed``, ``torch.random.fork_rng`` and inductor's ``fallback_random`` therefore
govern the masks as they govern ``torch.rand``. A Cora-sized ``[2708, 64]`` mask takes
0.26 ms on one AMD EPYC core, where ``torch.rand(shape).ge(p)`` and the conversion to a float
mask take 0.72 ms and ``F.dropout`` (torch's ``bernoulli_``) 2.0 ms
(``benchmarks/dropout_cpu.py``).

On CUDA with Triton installed the mask is the same function of a seed, drawn from the device's
generator and written by a Triton kernel (fp32, fp16, bf16): every backend of
:func:`~graphattn.functional.edge_attention` then drops the same entries for one
``torch.manual_seed``, the ``triton`` backend's included. Elsewhere (other devices, fp64 on
CUDA, CUDA without Triton) the mask is drawn as ``torch.rand(shape) >= p``. All draw each
entry's drop independently with probability ``p`` (the seeded ones within :math:`2^{-32}` of
it).

The Triton kernels, and the ``cpu`` kernels in fp32, draw the attention weights' mask
themselves, as the CPU mask is drawn: they take the parameters of
:func:`seeded_mask_parameters` (a seed drawn on the inputs' device, the threshold and the kept
entries' multiplier) and compute each ``[E, H]`` entry's multiplier where they would have read
it, in the forward pass and again in backward, so the mask is neither drawn into memory nor
read from it. For one seed it is the CPU mask: :func:`seeded_mask` writes it out (for the
paths that need it as a tensor).
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

from graphattn._checks import (
    as_integer,
    check_dropout,
    check_flag,
    check_float_dtype,
    check_tensors,
)
from graphattn.functional import cpu

# the dtypes of the seeded masks (the kept multiplier is held in fp32)
SEEDED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dropout_mask(shape: int | tuple[int, ...], p: float, *,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> Tensor:
    r"""An inverted-dropout multiplier: each entry is 0 with probability ``p``, else
    :math:`1 / (1 - p)`, so that :math:`\mathbb{E}[m] = 1`.

    On CPU (in fp64, fp32, fp16 and bf16), and on CUDA with Triton installed (fp32, fp16,
    bf16), the entries are drawn by SplitMix64 from one seed that the device's generator
    draws, so the same ``torch.manual_seed`` gives the same mask; elsewhere the mask is
    ``torch.rand(shape) >= p``.

    In fp16 and bf16 the kept value :math:`1 / (1 - p)` is rounded to the dtype (bf16 keeps
    1.109375 for p = 0.1), so there :math:`\mathbb{E}[m]` is 1 to within the dtype's
    precision. (``edge_attention`` on fp32 inputs draws the multiplier in fp32.)

    Args:
        shape (int or tuple): shape of the mask: non-negative sizes.
        p (float): drop probability, in ``[0, 1)``.
        device (torch.device, optional): where to draw it. (default: the current default)
        dtype (torch.dtype, optional): its dtype, a floating one. (default: ``torch.float32``)
    """
    check_dropout(p, "p")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if not _traced():  # (tracers' sizes may be symbolic)
        shape = _mask_shape(shape)
    if p > 0.0 and 1.0 / (1.0 - p) > torch.finfo(dtype).max:
        raise ValueError(f"a dropout probability of {p!r} keeps entries as 1 / (1 - p) = "
                         f"{1.0 / (1.0 - p):.6g}, past the largest {dtype} "
                         f"({torch.finfo(dtype).max:.6g}): the mask would hold inf; use a "
                         f"smaller probability or a wider dtype")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)  # as torch.rand takes it
    # (torch.get_default_device() returns no tensor, which torch.compile cannot trace)
    device = torch.empty(0).device if device is None else torch.device(device)
    if device.type == "cpu" and dtype in cpu.MASK_DTYPES:
        # the seed is torch's: manual_seed, fork_rng and inductor's fallback_random apply to it
        seed = torch.randint(2**63 - 1, (), dtype=torch.int64, device="cpu")
        if _traced():
            # an operator for tracers (dynamo, make_fx, torch.jit.trace) and modes to see,
            # with a rule for vmap's batched seeds
            # torch.jit.trace records sizes read from a tensor as values, which the
            # operator's SymInt[] refuses (an internal assert): the sizes traced, as ints
            sizes = [int(s) for s in shape] if torch.jit.is_tracing() else list(shape)
            return torch.ops.graphattn.cpu_dropout_mask(seed, sizes, float(p), dtype)
        return cpu.dropout_mask_from_seed(int(seed), shape, p, dtype)
    if device.type == "cuda" and dtype in SEEDED_DTYPES and _triton_available():
        return seeded_mask(seeded_mask_parameters(p, device=device), shape, dtype)
    # drawn out of place: under torch.func.vmap(randomness="different") a fresh tensor filled
    # in place would be unbatched, which vmap refuses (the same numbers as uniform_())
    keep = torch.rand(shape, device=device, dtype=torch.float32).ge(p)
    return keep.to(dtype).mul_(1.0 / (1.0 - p))


def _mask_shape(shape: object) -> tuple[int, ...]:
    """``shape`` (an integer, or a sequence of them) as a tuple of non-negative ints; raise,
    naming it, otherwise."""
    if as_integer(shape) is not None and not (isinstance(shape, Tensor) and shape.dim() > 0):
        shape = (shape,)  # an int, a numpy integer or a 0-d tensor
    try:
        sizes = tuple(as_integer(size) for size in shape)
    except TypeError:
        sizes = (None,)
    if any(size is None or size < 0 for size in sizes):
        raise ValueError(f"shape must be a non-negative integer or a sequence of them, got "
                         f"{shape!r}")
    return sizes


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


def seeded_mask_parameters(p: float, *, device: torch.device | str) -> Tensor:
    r"""The parameters of a dropout mask the Triton kernels draw in registers: an int64 tensor
    ``[3]`` on ``device`` holding a seed in :math:`[0, 2^{63})` drawn from ``device``'s
    generator (as :func:`dropout_mask` draws the CPU seed, so on CPU ``torch.manual_seed``
    gives the seed of the CPU mask), the threshold :math:`\lceil p \cdot 2^{32} \rceil`, and
    the IEEE 754 bits of :math:`1 / (1 - p)` in fp32. Nothing is copied from the host: the
    seed stays on the device. :func:`seeded_mask` writes out the mask they stand for.

    Args:
        p (float): drop probability, in ``[0, 1)``.
        device (torch.device or str): where the kernels run.
    """
    check_dropout(p, "p")
    seed = torch.randint(2**63 - 1, (), dtype=torch.int64, device=device)
    kept = struct.unpack("<i", struct.pack("<f", 1.0 / (1.0 - p)))[0]
    return torch.stack((seed, torch.full((), math.ceil(p * 2.0**32), dtype=torch.int64,
                                         device=device),
                        torch.full((), kept, dtype=torch.int64, device=device)))


def seeded_mask(parameters: Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                ) -> Tensor:
    """The mask ``parameters`` (:func:`seeded_mask_parameters`) stand for, as a tensor of
    ``shape`` on their device: entry ``i`` of the flat mask is what the Triton kernels draw for
    it (0 or the kept multiplier, rounded to ``dtype``). On CUDA with Triton a kernel writes it
    there (:func:`~graphattn.functional.triton_kernels.write_seeded_mask`, no host sync);
    elsewhere it is written on CPU and copied (a host sync)."""
    if _traced():
        return torch.ops.graphattn.seeded_dropout_mask(parameters, list(shape), dtype)
    return _write_seeded_mask(parameters, tuple(shape), dtype)


def _write_seeded_mask(parameters: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    if parameters.device.type == "cuda" and _triton_available():
        from graphattn.functional.triton_kernels import write_seeded_mask

        return write_seeded_mask(parameters, shape, dtype)
    return cpu.seeded_mask_from(parameters, shape, dtype).to(parameters.device)


def _triton_available() -> bool:
    from graphattn.functional.triton_kernels import triton_available

    return triton_available()


def _traced() -> bool:
    """Whether a tracer (dynamo, make_fx, torch.jit.trace), a functorch transform or a
    dispatch mode is active: they see the masks as operators."""
    return (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or torch.jit.is_tracing() or torch._C._len_torch_dispatch_stack() > 0)


@torch.library.custom_op(
    "graphattn::seeded_dropout_mask", mutates_args=(),
    schema="(Tensor parameters, SymInt[] shape, ScalarType dtype) -> Tensor")
def _seeded_mask_op(parameters: Tensor, shape: list[int], dtype: torch.dtype) -> Tensor:
    """:func:`seeded_mask` as a torch operator, for ``torch.compile`` and ``torch.func``."""
    return _write_seeded_mask(parameters, tuple(shape), dtype)


@_seeded_mask_op.register_fake
def _(parameters, shape, dtype):
    return torch.empty(shape, dtype=dtype, device=parameters.device)


@_seeded_mask_op.register_vmap
def _(info, in_dims, parameters, shape, dtype):
    # vmap(randomness="different") draws one seed per sample (batched parameters): one mask each
    if in_dims[0] is None:
        return _seeded_mask_op(parameters, shape, dtype), None
    batch = parameters.movedim(in_dims[0], 0)  # (B, 3)
    return torch.stack([_seeded_mask_op(row, shape, dtype) for row in batch]), 0


def mask_tensor(dropout_mask: Tensor | None, num_edges: int, heads: int) -> Tensor | None:
    """A Triton backend's dropout argument as the mask ``[E, H]`` itself: written out by
    :func:`seeded_mask` when it is a seeded mask's parameters (int64), else as it is."""
    if dropout_mask is None or dropout_mask.dtype != torch.int64:
        return dropout_mask
    return seeded_mask(dropout_mask, (num_edges, heads))


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    r"""``F.dropout(x, p, training)`` with the mask of :func:`dropout_mask`:
    :math:`x \odot m`, and the gradient :math:`g \odot m` in backward.

    Args:
        x (Tensor): any dense tensor of a floating-point dtype.
        p (float): drop probability, in ``[0, 1)``.
        training (bool, optional): apply dropout; otherwise return ``x`` itself.
            (default: ``True``)

    Shapes:
        - **input:** x ``(*)``
        - **output:** ``(*)``
    """
    check_dropout(p, "p")
    check_tensors(x=x)
    if not check_flag(training, "training") or p == 0.0:
        return x  # (x itself, whatever its dtype, as F.dropout returns it)
    check_float_dtype(x=x)  # the mask, 0 or 1 / (1 - p), takes x's dtype
    return x * dropout_mask(tuple(x.shape), p, device=x.device, dtype=x.dtype)
