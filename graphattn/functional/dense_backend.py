"""The ``"dense"`` backend of edge attention: the graph as a dense mask, the work done by BLAS.

Edge attention on a graph with E edges costs O(E H C) memory traffic on the sparse path (a gather,
a product and a scatter per edge); dense masked attention costs O(N_dst N_src H C) arithmetic in
matrix products, which run an order of magnitude faster per element. On a dense enough graph the
dense path wins; :func:`~graphattn.functional.attention.select_backend` decides from the measured
crossover, and :func:`dense_peak_bytes` keeps it from picking dense when the matrices would not fit.

A graph whose nodes split into ranges that no edge crosses (:func:`diagonal_blocks`: a batch of
sequences, images or small graphs side by side) runs block by block, as a batch of dense
``[H, L, L]`` blocks: its cost then follows the pairs inside the blocks, not :math:`N^2`. On CPU
one pass of a compiled kernel over the edges finds the blocks, and another the pairs, the mask
and whether the pattern is causal. Blocks that are complete or causal, with their edges in
target-major order (as :mod:`graphattn.graphs` builds them: a batch of graphs' global
attention, a batch of sequences), need no pairs: a read of the edges tells, and SDPA runs
them without a mask of the graph (blocks of unequal sizes as :func:`per_graph_attention`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphattn._checks import host_list
from graphattn.functional import cpu
from graphattn.functional._transforms import (
    apply_function,
    host_readable,
    onnx_exporting,
    plain_ops_only,
)
from graphattn.functional.dropout import dropout_mask
from graphattn.functional.reference import reference_edge_attention, repeat_kv_heads

# [H, N_dst, N_src] fp32 tensors alive at the peak of forward+backward, rounded up from the peak
# resident memory measured at N = 2048, H = 4: 3.1 on the SDPA path, 4.3 with the weights
# returned, 4.5 with a bias, 5.7 with weights, bias and dropout.
DENSE_TENSORS_AT_PEAK = 6


def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
         sinks: Tensor | None = None) -> Tensor:
    """``scaled_dot_product_attention`` on ``(..., H, L, C)`` inputs, run by its fused kernels
    when they have no batch dimension too, with gradients that can be differentiated again;
    with ``sinks`` ``[H]``, one more score per head in every row whose value is 0 (see
    :func:`_sdpa_with_sinks`). k and v may have fewer heads, ``H_kv`` dividing H
    (grouped-query attention): SDPA then gets ``enable_gqa=True``, and its CPU flash kernel
    reads each kv head for its G query heads, forward and backward, with no copy of k and v
    per query head, sinks or not (the explicit softmax of dropout on CPU makes those copies).

    SDPA's fused kernels (flash attention on CPU and CUDA, memory-efficient on CUDA) take 4-D
    inputs with a 2-D or 4-D mask only; anything else runs its unfused math path, several times
    slower. So 3-D inputs get a batch dimension. The fused kernels' backward cannot be
    differentiated again (``create_graph=True`` raises "derivative ... not implemented"), so
    with gradients wanted, inputs that SDPA would give a fused kernel run through
    :class:`_FusedSDPA`, whose backward takes the math path when gradients of gradients may
    follow. On CPU that costs nothing: the flash kernel's own operators run forward and
    backward (a torch without them recomputes the forward in the backward). On CUDA the
    backward recomputes the forward, which 3-D inputs pay (as the ``"dense"`` backend always
    has) and 4-D inputs do not: they go to SDPA as they are, and their gradients cannot be
    differentiated again there.

    With dropout on CPU, where SDPA would take its math path and draw its mask with
    ``bernoulli_``, the same softmax is computed here in plain torch ops and multiplied by
    graphattn's :func:`~graphattn.functional.dropout_mask` (SplitMix64 from a seed, as every
    backend of ``edge_attention`` draws it): a training step 2.1-2.4x faster on 2 cores
    (padded blocks of 32 to 1024 nodes, 4 heads), differentiable twice, traced as it is by
    ``torch.compile``. Other inputs SDPA gives its math path (a mask that needs a gradient, 5
    or more dims) go to SDPA as they are: that path is differentiable twice. Under
    ``torch.compile`` SDPA is called directly: dynamo cannot trace the ``torch.autograd.grad``
    in :class:`_FusedSDPA`'s backward (``fullgraph=True`` would fail). Under ``torch.func``'s
    transforms SDPA runs its math path, which they all differentiate and batch; so do inputs
    that carry a forward-mode tangent (``torch.autograd.forward_ad``).
    """
    if is_causal and scale is not None and scale < 0:
        # torch's CPU flash kernel gives NaN in causal rows under a negative scale: the same
        # scores as -q under -scale, which it reads right (no [L, L] mask made)
        q, scale = -q, -scale
    if sinks is not None:
        if dropout_p > 0 and q.device.type == "cpu":  # graphattn's mask, of the weights' shape
            return _explicit_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, sinks)
        return _sdpa_with_sinks(q, k, v, attn_mask, dropout_p, is_causal, scale, sinks)
    gqa = {"enable_gqa": True} if k.size(-3) != q.size(-3) else {}  # (grouped k, v)
    options = {"dropout_p": dropout_p, "is_causal": is_causal, "scale": scale, **gqa}
    if plain_ops_only(q, k, v, attn_mask):
        # torch.func (vjp, jacrev, vmap of grad, hessian) or forward-mode dual inputs: the math
        # path, which every transform differentiates and batches. _fused_sdp_choice has no
        # batching rule, the flash kernel no forward AD, and _FusedSDPA's backward cannot
        # differentiate inputs whose transform has exited (vjp's, by the time its vjp_fn runs).
        if q.dim() == 3 and onnx_exporting():  # ONNX's attention takes 4-D inputs only
            mask = attn_mask[None] if attn_mask is not None and attn_mask.dim() == 3 else attn_mask
            return sdpa(q[None], k[None], v[None], mask, dropout_p, is_causal, scale)[0]
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **options)
    tensors = (q, k, v, attn_mask)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if 0 in (q.size(-3), v.size(-3)):
        # No heads: the empty output of two empty products, which autograd follows back to q,
        # k and v. SDPA is not called: torch before 2.13 hands 4-D inputs without heads to
        # its CPU flash operator, which divides by H (SIGFPE: the process dies).
        return q @ k.transpose(-2, -1) @ v
    if dropout_p > 0 and q.device.type == "cpu":
        return _explicit_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)
    if q.dim() not in (3, 4) or (grad and dropout_p > 0):
        # with dropout a fused backward would need the same draw again: SDPA as it is (the
        # math path for 3-D inputs and on CPU)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **options)
    batched = q.dim() == 4
    if not batched:
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask[None]
        q, k, v = q[None], k[None], v[None]  # (1, H, L, C)
    if grad and not torch.compiler.is_compiling():
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal, scale=scale,
                                         **gqa)
        cpu = q.device.type == "cpu"
        if choice != SDPBackend.MATH.value and (cpu or not batched):  # a fused kernel
            flash_cpu = (cpu and choice == SDPBackend.FLASH_ATTENTION.value
                         and _flash_cpu_forward is not None and _flash_cpu_backward is not None)
            if flash_cpu:  # the mask as SDPA hands it to the kernel, made once
                attn_mask = _additive_mask(attn_mask, q.dtype)
            out = apply_function(_FusedSDPA, q, k, v, attn_mask, is_causal, scale, flash_cpu)[0]
            return out if batched else out[0]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **options)
    return out if batched else out[0]


def _explicit_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                        dropout_p: float, is_causal: bool, scale: float | None,
                        sinks: Tensor | None = None) -> Tensor:
    r"""SDPA's math path with graphattn's dropout mask M (entries 0 or :math:`1 / (1 - p)`):
    :math:`\big(\operatorname{softmax}(\text{scale} \cdot QK^\top + \text{mask}) \odot M\big) V`
    on ``(..., H, L, C)`` inputs, a bool ``attn_mask`` (True: attend) or an additive one, the
    softmax of half precision in fp32 (with ``sinks``, :func:`softmax_with_sinks`)."""
    if scale is None:
        scale = 1.0 / math.sqrt(max(q.size(-1), 1))
    k, v = repeat_kv_heads(q.size(-3), k, v, dim=-3)  # (..., H, L_k, C): every head's
    scores = scaled_scores(q, k, scale)  # (..., H, L_q, L_k)
    if is_causal:
        causal = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
        attn_mask = causal if attn_mask is None else attn_mask & causal
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill_(~attn_mask, float("-inf"))  # in place: one pass
    elif attn_mask is not None:
        scores = scores + attn_mask
    P = softmax_with_sinks(scores, sinks).to(v.dtype)
    return (P * dropout_mask(P.shape, dropout_p, device=P.device, dtype=P.dtype)) @ v


def softmax_with_sinks(scores: Tensor, sinks: Tensor | None,
                       shift: Tensor | None = None) -> Tensor:
    r"""The softmax of each row of ``(..., H, L_q, L_k)`` scores, in fp32 for half precision;
    with ``sinks`` ``[H]``, of the row and one more score :math:`\varsigma_h`, whose weight is
    then dropped: the row's weights sum to :math:`1 - \pi`. ``shift`` ``(..., H, L_q, 1)``:
    what was subtracted from each row's scores, subtracted from its sink too."""
    dtype = _softmax_dtype(scores.dtype)
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=dtype)
    column = sinks.to(scores.dtype).view(-1, 1, 1)
    if shift is not None:
        column = column - shift.to(scores.dtype)
    column = column.expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=dtype)[..., :-1]


def _sdpa_with_sinks(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
                     dropout_p: float, is_causal: bool, scale: float | None,
                     sinks: Tensor) -> Tensor:
    r""":func:`sdpa` with one more score per head in every row, :math:`\varsigma_h`, whose value
    is 0, still on SDPA's fused kernels: a key in front of the others, whose score is the sink.

    The queries of head h gain a channel holding :math:`\varsigma_h / \text{scale}` (two in
    half precision, where it is split into a high and a low part so that its sum keeps fp32's
    precision), the keys a channel of 0, and the sink's key is 0 but in that channel, where it
    holds 1 (in fp16 256, the queries' channel then 256 times smaller, so that sinks up to
    1.7e7 times the scale fit): its score is then :math:`\varsigma_h` for every query, and
    the other scores are unchanged. The sink's key is the same for every head, so grouped keys
    and values (fewer heads than q) stay grouped, one sink key per kv head. A sink of
    :math:`-\infty` (none) is held as nearly the dtype's lowest number over
    :math:`\max(1, \sqrt{|\text{scale}|})` (the highest, with a negative scale: finite after
    SDPA's math path multiplies q by :math:`\sqrt{\text{scale}}`), whose product with the other
    keys' 0 is 0 and whose score is hugely negative. The
    sink's value is 0; where v has the channels of q and k, it gains
    zero channels too, as SDPA's flash kernels take one channel count for all three (without
    them SDPA took its math path: on 16 causal sequences of 256, 4 heads of 16 channels,
    forward+backward took 2.1x the time of the call without sinks, and 1.2x with them). The
    mask gains a column that every row attends (first), and, so that ``is_causal`` still
    holds (SDPA aligns it top-left), a first query row of zeros that sees the sink alone and
    is dropped after: row i + 1 then sees the sink and keys 0..i. Gradients reach the sinks
    through the queries' channel. A scale of 0 (every score 0, the sink's still :math:`\varsigma_h`)
    takes the explicit softmax instead."""
    if scale is None:
        scale = 1.0 / math.sqrt(max(q.size(-1), 1))
    if scale == 0:
        return _explicit_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, sinks)
    lead, (H, L_q, C), (H_kv, L_k) = q.shape[:-3], q.shape[-3:], k.shape[-3:-1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    # fp16's channel holds sink / scale / 256 and the sink's key 256, so that a sink up to
    # 1.7e7 times the scale fits (65504 times it without)
    factor = SINK_KEY_FP16 if q.dtype == torch.float16 else 1.0
    # finite, so that 0 times it is 0 in every other key's score, also where SDPA's math path
    # has multiplied q by sqrt(scale) first: -inf (no sink) the lowest number over that, or
    # with a negative scale the highest, either way a score of -huge
    bound = torch.finfo(q.dtype).max * (1 - 2**-8) / max(1.0, math.sqrt(abs(scale)))
    sink = (sinks.to(work) / (scale * factor)).clamp(min=-bound, max=bound)  # (H,)
    if q.dtype in (torch.float16, torch.bfloat16):  # high and low parts, summed in fp32
        high = sink.to(q.dtype)
        parts = torch.stack([high, (sink - high.float()).to(q.dtype)], dim=-1)  # (H, 2)
    else:
        parts = sink.to(q.dtype).unsqueeze(-1)  # (H, 1)
    extra = parts.size(-1)
    q = torch.cat([q, parts.view(H, 1, extra).expand(*lead, H, L_q, extra)], dim=-1)
    q = torch.cat([q.new_zeros(*lead, H, 1, C + extra), q], dim=-2)  # (..., H, 1 + L_q, C + x)
    sink_key = torch.cat([k.new_zeros(C), k.new_full((extra,), factor)])  # (C + x,): for
    # every head
    k = torch.cat([k, k.new_zeros(*lead, H_kv, L_k, extra)], dim=-1)
    k = torch.cat([sink_key.expand(*lead, H_kv, 1, C + extra), k], dim=-2)  # (.., 1 + L_k, .)
    C_v = v.size(-1)
    if C_v == C:  # SDPA's flash kernels take one channel count for q, k and v: v's padded too
        v = torch.cat([v, v.new_zeros(*lead, H_kv, L_k, extra)], dim=-1)
    v = torch.cat([v.new_zeros(*lead, H_kv, 1, v.size(-1)), v], dim=-2)  # (.., 1 + L_k, .)
    if attn_mask is not None:  # the sink's column, and the zero query's row unless broadcast
        fill = True if attn_mask.dtype == torch.bool else 0.0
        attn_mask = attn_mask.expand(*attn_mask.shape[:-1], L_k)
        rows = (1, 0) if attn_mask.dim() > 1 and attn_mask.size(-2) != 1 else ()  # (0 rows too)
        attn_mask = F.pad(attn_mask, (1, 0, *rows), value=fill)
    out = sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
               scale=scale)
    return out[..., 1:, :C_v]  # (..., H, L_q, C_v)


# The sink's key channel in fp16 (a power of two: exact), and its query channel the sink over
# the scale and this
SINK_KEY_FP16 = 256.0


# torch's private operators of SDPA's CPU flash kernel, forward and backward (a torch without
# them recomputes the forward in the backward)
_FLASH_CPU_OP = "_scaled_dot_product_flash_attention_for_cpu"
_flash_cpu_forward = getattr(getattr(torch.ops.aten, _FLASH_CPU_OP, None), "default", None)
_flash_cpu_backward = getattr(getattr(torch.ops.aten, _FLASH_CPU_OP + "_backward", None),
                              "default", None)


def _additive_mask(attn_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A bool mask as SDPA hands it to its kernels: 0 where True, -inf where False."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.full_like(attn_mask, float("-inf"), dtype=dtype).masked_fill_(attn_mask, 0.0)


# SDPA's CPU flash kernel keeps one fp32 log-sum-exp per row, and its backward recomputes the
# weights exp(s - lse) from scores rounded otherwise than its forward's: off by a factor of
# about exp(|s| eps). Past this |lse| its gradients lose more than about 1e-5 of their size
# (measured against float64, 4 heads x 32 channels, 256 keys: 2e-6 at |lse| 21, 5e-6 at 48,
# 2e-5 at 193, while SDPA's math path stays at 2e-6; at |lse| 1e3 and above, inf or garbage),
# and the backward recomputes the math path instead (1.6-2.3x the flash backward's time).
FLASH_CPU_BACKWARD_MAX_LSE = 64.0


def _flash_backward_is_accurate(lse: Tensor) -> bool:
    """Whether the flash kernel's backward keeps its precision for these rows' log-sum-exps
    ``(B, H, L_q)`` (rows without any key, at -inf, excluded)."""
    finite = torch.where(lse.isfinite(), lse.abs(), 0.0)
    return lse.numel() == 0 or float(finite.amax()) <= FLASH_CPU_BACKWARD_MAX_LSE


class _FusedSDPA(torch.autograd.Function):
    """SDPA without dropout on ``(B, H, L, C)`` inputs, with gradients that autograd can
    differentiate again.

    Where SDPA would take its CPU flash kernel, the forward calls that kernel's operator,
    which also returns the log-sum-exp of each row, and the backward hands both to the
    kernel's backward operator: the same numbers as SDPA's own autograd, bit for bit, with no
    work repeated, as long as no row's log-sum-exp passes ``FLASH_CPU_BACKWARD_MAX_LSE`` in
    magnitude (past it that backward loses precision, and the math path's is taken).
    Elsewhere (CUDA, the math path) the backward recomputes SDPA and takes its backward. When
    the gradients must be differentiable (``create_graph=True``, ``torch.func``), the backward
    recomputes the math path instead, which autograd can differentiate again (as the fused
    backends do with the reference path)."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, is_causal: bool,
                scale: float | None, flash_cpu: bool) -> tuple[Tensor, Tensor | None]:
        if flash_cpu:  # SDPA would take its CPU flash kernel (mask additive): its operator
            return _flash_cpu_forward(q, k, v, 0.0, is_causal, attn_mask=attn_mask,
                                      scale=scale)  # (B, H, L_q, C), log-sum-exp (B, H, L_q)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                             is_causal=is_causal, scale=scale,
                                             enable_gqa=k.size(-3) != q.size(-3))
        return out, None

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        q, k, v, attn_mask, is_causal, scale, flash_cpu = inputs
        out, lse = output
        if flash_cpu:
            ctx.mark_non_differentiable(lse)
            ctx.save_for_backward(q, k, v, attn_mask, out, lse)
        else:
            ctx.save_for_backward(q, k, v, attn_mask)
        ctx.flash_cpu, ctx.is_causal, ctx.scale = flash_cpu, is_causal, scale

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor | None = None):
        # create_graph=True, or a forward-mode dual dout (the flash kernel's backward has no
        # forward-mode derivative): the math path, which autograd differentiates
        differentiable = torch.is_grad_enabled() or plain_ops_only(dout)
        if ctx.flash_cpu and not differentiable:  # the kernel's own backward
            q, k, v, attn_mask, out, lse = ctx.saved_tensors
            if _flash_backward_is_accurate(lse):
                # a mask that needs a gradient never takes the flash kernel; autograd drops
                # the gradients of inputs that need none
                return (*_flash_cpu_backward(dout, q, k, v, out, lse, 0.0, ctx.is_causal,
                                             attn_mask=attn_mask, scale=ctx.scale),
                        None, None, None, None)
        inputs = list(ctx.saved_tensors[:4])  # q, k, v, attn_mask
        wanted = [i for i, t in enumerate(inputs) if t is not None and ctx.needs_input_grad[i]]
        if not differentiable:
            for i in wanted:
                inputs[i] = inputs[i].detach().requires_grad_()
        # the math path where the flash kernel's backward would lose precision, too
        math = differentiable or ctx.flash_cpu
        kernels = sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext()
        gqa = inputs[1].size(-3) != inputs[0].size(-3)  # grouped k, v
        with torch.enable_grad(), kernels:
            out = F.scaled_dot_product_attention(*inputs[:3], attn_mask=inputs[3],
                                                 is_causal=ctx.is_causal, scale=ctx.scale,
                                                 enable_gqa=gqa)
            found = torch.autograd.grad(out, [inputs[i] for i in wanted], dout,
                                        create_graph=differentiable, allow_unused=True)
        grads: list[Tensor | None] = [None] * 7
        for i, g in zip(wanted, found, strict=True):
            grads[i] = g
        return tuple(grads)


def dense_peak_bytes(num_dst: int, num_src: int, heads: int, itemsize: int = 4) -> int:
    r"""Upper estimate of the extra memory the ``"dense"`` backend needs for forward+backward.

    .. math::
        \text{bytes} = 6 \cdot H \cdot N_{dst} \cdot N_{src} \cdot \text{itemsize}
        + 2 \cdot N_{dst} \cdot N_{src}

    (six ``[H, N_dst, N_src]`` tensors at the peak of the costliest path, with the weights
    returned, a bias and dropout; plus the bool mask and its row flags); the SDPA path needs
    about half.

    Args:
        num_dst (int): number of targets N_dst.
        num_src (int): number of sources N_src.
        heads (int): number of heads H.
        itemsize (int, optional): bytes per element of q, k, v. (default: ``4``)
    """
    pairs = num_dst * num_src
    return DENSE_TENSORS_AT_PEAK * heads * pairs * itemsize + 2 * pairs


def _softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half precision is normalised in fp32, like :func:`~graphattn.functional.scatter_softmax`."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def scaled_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    r""":math:`\text{scale} \cdot q k^\top` of ``(..., L_q, C)`` and ``(..., L_k, C)``, formed in
    fp32 for half precision, as the fused kernels form them (a score past 65504 would be inf
    in fp16, and its row NaN after the softmax) ``(..., L_q, L_k)``."""
    work = _softmax_dtype(q.dtype)
    # scaled before the product: q . k can overflow where the score does not
    return (q.to(work) * scale) @ k.to(work).transpose(-2, -1)


# Row gathers and scatter-adds as operators that torch.compile calls as they are. Inductor's C++
# backend in torch 2.13 miscompiles a scatter-add (index_add, the gradient of a gather) fused into
# a kernel it tiles in two dimensions when it runs on more than one thread: the atomic add's
# index counts the inner tile offset twice (pytorch/pytorch#191837), which wrote out of bounds
# (heap corruption) or into the wrong entries (wrong results) on the dense backend's multigraph
# path. Opaque operators are never fused; eager calls keep the plain ops.
@torch.library.custom_op("graphattn::gather_rows", mutates_args=())
def _gather_rows_op(x: Tensor, index: Tensor) -> Tensor:
    return x.index_select(0, index)


@torch.library.custom_op("graphattn::scatter_add_rows", mutates_args=())
def _scatter_add_rows_op(src: Tensor, index: Tensor, num_rows: int) -> Tensor:
    return src.new_zeros(num_rows, *src.shape[1:]).index_add_(0, index, src)


@_gather_rows_op.register_fake
def _gather_rows_fake(x, index):
    return x.new_empty(index.size(0), *x.shape[1:])


@_scatter_add_rows_op.register_fake
def _scatter_add_rows_fake(src, index, num_rows):
    return src.new_empty(num_rows, *src.shape[1:])


def _gather_rows_setup(ctx, inputs, output) -> None:
    x, index = inputs
    ctx.save_for_backward(index)
    ctx.num_rows = x.size(0)


def _scatter_add_rows_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])


_gather_rows_op.register_autograd(
    lambda ctx, grad: (_scatter_add_rows_op(grad, ctx.saved_tensors[0], ctx.num_rows), None),
    setup_context=_gather_rows_setup)
_scatter_add_rows_op.register_autograd(
    lambda ctx, grad: (_gather_rows_op(grad, ctx.saved_tensors[0]), None, None),
    setup_context=_scatter_add_rows_setup)


def gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[index]`` for an int64 ``index`` ``[E]``: ``[E, *]``, an opaque operator under
    torch.compile (see above), except under torch.func's transforms, which the operators'
    autograd does not support."""
    if torch.compiler.is_compiling() and not plain_ops_only(x):
        return _gather_rows_op(x, index)
    return x.index_select(0, index)  # its backward sums in a fixed order, x[index]'s not


def scatter_add_rows(src: Tensor, index: Tensor, num_rows: int) -> Tensor:
    """The rows of ``src`` ``[E, *]`` summed into ``num_rows`` rows at ``index`` ``[E]``, an
    opaque operator under torch.compile (see above), except under torch.func's transforms."""
    if torch.compiler.is_compiling() and not plain_ops_only(src):
        return _scatter_add_rows_op(src, index, num_rows)
    return src.new_zeros(num_rows, *src.shape[1:]).index_add(0, index, src)


def _pair_log_weights(t: Tensor | None, pair: Tensor | None, mask: Tensor, simple: bool,
                      dtype: torch.dtype, in_place: bool = False,
                      ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Sum the per-edge log-weights ``t`` of each (target, source) pair in log space.

    ``mask`` is the ``[B, N_dst, N_src]`` bool mask of the graph's blocks and ``pair`` ``[E]``
    each edge's flat index in it. Returns ``T [B, H, N_dst, N_src]`` (contiguous, the layout
    SDPA reads its mask in) with ``T_p = log sum_{e in p} exp(t_e)`` less the largest ``t_e`` of its
    target row, which the softmax over the row does not see (``-inf`` where no edge lies;
    ``None`` when the graph is simple and ``t`` is ``None``, i.e. all zeros on the mask) and
    ``r [E, H]``, each edge's share ``exp(t_e) / sum_{e' in p} exp(t_e')`` of its pair
    (``None`` when every share is 1), and the shift ``[B, H, N_dst, 1]`` subtracted from each
    target row (``None`` where nothing was: no ``t``, or a simple graph, whose ``T`` is ``t``),
    which a softmax with sinks subtracts from their scores too. ``in_place``: edge e is pair
    e (a complete graph's edges in target-major order).
    """
    flat = mask.view(-1)  # (P,)
    B, n_dst, n_src = mask.shape
    if t is None:
        if simple:
            return None, None, None
        count = scatter_add_rows(torch.ones(pair.numel(), dtype=dtype, device=pair.device),
                                 pair, flat.numel())  # (P,)
        T = count.log().view(B, 1, n_dst, n_src)  # log(0) = -inf off the graph
        r = (1.0 / count[pair]).unsqueeze(-1)  # (E, 1)
        return T, r, None
    heads = t.size(1)
    if simple:  # one row written per edge, in place (pairs first: see below)
        T = (t if in_place else t.new_full((flat.numel(), heads), float("-inf")).index_copy_(
            0, pair, t))  # (P, H)
        return T.view(B, n_dst, n_src, heads).permute(0, 3, 1, 2).contiguous(), None, None
    # logsumexp per pair: shift by the pair maximum (no gradient flows through a shift). Pairs
    # come first, [P, H]: gathers and scatters of whole rows. (Under torch.compile on CPU, the
    # gradient of a gather along dim 1 of [H, P] was compiled into a scatter that wrote out of
    # bounds with more than one thread: heap corruption.)
    with torch.no_grad():
        m = t.new_full((flat.numel(), heads), float("-inf"))
        m.scatter_reduce_(0, pair.unsqueeze(-1).expand(-1, heads), t, reduce="amax",
                          include_self=True)  # (P, H)
        rows = m.view(*mask.shape, heads)  # (B, N_dst, N_src, H)
        # amax takes no empty dimension: no sources, so no edges (torch.compile comes here)
        top = (rows.amax(dim=-2, keepdim=True).nan_to_num_(0.0, 0.0, 0.0) if rows.size(-2) > 0
               else rows.new_zeros(*rows.shape[:-2], 1, heads))  # (B, N_dst, 1, H)
        # T relative to the largest score of its target row (a shift per row leaves the
        # softmax as it is): log(edge count) would round away next to a score of 1e9 or more
        # 0 for a pair without a live edge (-inf) or a +inf/NaN score (its row is NaN anyway);
        # a difference of finite scores that overflows stays -inf: its weight underflows to 0
        relative = rows - top
        shift = torch.where(torch.isneginf(rows), 0.0, relative.nan_to_num_(
            0.0, 0.0, float("-inf"))).view(flat.numel(), heads)  # (P, H)
        m = m.masked_fill_(torch.isinf(m), 0.0)  # (P, H); off the graph, or -inf scores only
    w = torch.exp(t - m[pair])  # (E, H)
    total = scatter_add_rows(w, pair, flat.numel())  # (P, H)
    # total = 0 where no edge lies or every edge of the pair scores -inf: T = -inf, share 0;
    # a NaN score keeps its NaN (total NaN), which makes its target's row NaN, as the reference
    live = total != 0
    safe_total = torch.where(live, total, 1.0)
    T = torch.where(live, safe_total.log() + shift, t.new_tensor(float("-inf")))  # (P, H)
    r = w / gather_rows(safe_total, pair)  # (E, H)
    return (T.view(B, n_dst, n_src, heads).permute(0, 3, 1, 2).contiguous(), r,
            top.permute(0, 3, 1, 2))  # (B, H, N_dst, N_src), (E, H), (B, H, N_dst, 1)


# A graph that no edge crosses between ranges of its nodes (a batch of sequences, images or
# small graphs, as graphs.repeat_graph and graphs.batch_complete_graph build them) is run block
# by block, when that saves at least this share of the whole graph's N_dst * N_src pairs.
BLOCK_MIN_SAVING = 0.5


def per_graph_attention(q: Tensor, k: Tensor, v: Tensor, batch: Tensor, *, is_causal: bool,
                        scale: float, dropout_p: float, sinks: Tensor | None = None) -> Tensor:
    r"""Dense attention of each node over the nodes of its own graph of ``batch`` (in node
    order, the earlier ones only when ``is_causal``), with ``dropout_p`` as ``sdpa`` applies
    it (graphattn's mask of each group's padded weights on CPU, SDPA's on CUDA) and ``sinks``
    ``[H]`` as ``sdpa`` takes them: what ``dense_attention(..., batch=)`` and the dense
    backend on complete or causal diagonal blocks run.

    Graphs with sizes in ``(2^(b-1), 2^b]`` form group b; each group is gathered into
    ``[G_b, n_b, H, C]`` tensors, padded to its largest graph n_b (padding at most quadruples a
    graph's scores, and there are at most log2(n_max) + 1 groups), and runs as one SDPA call
    with the padding masked out as keys (every padded row keeps its graph's first node as a
    key, so no row is empty). The padding reads a row of zeros: a NaN or inf in one graph's
    inputs stays in that graph (a masked key's value is still multiplied by its weight 0).
    q, k and v are gathered together, with one ``index_select`` per group, and the real rows
    of the groups' outputs put back in node order with one more: index ops, which autograd
    differentiates (with ``index_add``).

    Shapes:
        - **input:** q and k ``(N, H, C)``, v ``(N, H, C_v)``, batch ``(N)`` (graph ids,
          at least one node)
        - **output:** ``(N, H, C_v)``
    """
    N, H, C_v = v.shape
    C = q.size(-1)
    batch = batch.long()
    sizes = torch.bincount(batch)  # (G,) nodes per graph
    members = torch.sort(batch, stable=True).indices  # (N,): each graph's nodes, ascending
    first = sizes.cumsum(0) - sizes  # (G,) where each graph starts in members
    rank = torch.empty_like(members)  # (N,) position of each node in its graph
    rank[members] = torch.arange(N, device=batch.device) - first[batch[members]]
    group = torch.ceil(torch.log2(sizes.clamp(min=1).double())).long()  # (G,) size group
    width = H * (2 * C + C_v)
    qkv = torch.cat([torch.cat([q, k, v], dim=-1).view(N, width),
                     q.new_zeros(1, width)])  # (N + 1, H (2C + C_v)): row N for the padding
    outs = []
    position = torch.empty_like(members)  # (N,) row of each node in the groups' outputs
    offset = 0  # rows of the groups' outputs so far
    for b in host_list(torch.unique(group[sizes > 0])):
        graphs_b = torch.nonzero((group == b) & (sizes > 0)).flatten()  # (G_b,)
        G_b, n_b = graphs_b.numel(), int(sizes[graphs_b].max())
        slot = torch.full_like(sizes, -1)
        slot[graphs_b] = torch.arange(G_b, device=batch.device)
        nodes = torch.nonzero(slot[batch] >= 0).flatten()  # (N_b,) nodes of the group's graphs
        padded_row = slot[batch[nodes]] * n_b + rank[nodes]  # (N_b,) row in [G_b * n_b]
        index = torch.full((G_b * n_b,), N, dtype=torch.long, device=batch.device)
        index[padded_row] = nodes  # node at each padded row (the zero row on padding)
        valid = torch.zeros(G_b * n_b, dtype=torch.bool, device=batch.device)
        valid[padded_row] = True
        position[nodes] = offset + padded_row
        offset += G_b * n_b
        padded = qkv.index_select(0, index).view(G_b, n_b, H, 2 * C + C_v)
        q_b, k_b, v_b = (t.transpose(1, 2) for t in padded.split([C, C, C_v], dim=-1))
        key_mask = valid.view(G_b, 1, 1, n_b)  # (G_b, 1, 1, n_b): padding is no key
        if is_causal:
            key_mask = key_mask & torch.ones(n_b, n_b, dtype=torch.bool,
                                             device=batch.device).tril()
        out_b = sdpa(q_b, k_b, v_b, attn_mask=key_mask, dropout_p=dropout_p, scale=scale,
                     sinks=sinks)
        outs.append(out_b.transpose(1, 2).reshape(G_b * n_b, H, C_v))  # (G_b n_b, H, C_v)
    return torch.cat(outs).index_select(0, position)  # (N, H, C_v)


@dataclass(frozen=True)
class DiagonalBlocks:
    """A block-diagonal graph as the dense backend runs it: its blocks (ranges of consecutive
    nodes that no edge crosses) in groups of similar size, each group padded to its largest
    block and run as one batch of ``[L, L]`` blocks.

    Attributes:
        starts (Tensor): ``[B + 1]`` int64, the first node of each block, then N.
        groups (list): per group, ``(blocks, size)``: the group's block ids ``[B_g]`` (int64,
            ascending) and the size L_g its blocks are padded to. Blocks of equal size form
            one group; otherwise a group holds the blocks of ``(2^(g-1), 2^g]`` nodes.
    """

    starts: Tensor
    groups: list[tuple[Tensor, int]]

    @property
    def pairs(self) -> int:
        r"""The (target, source) pairs of the padded blocks, :math:`\sum_g B_g L_g^2`."""
        return sum(blocks.numel() * size * size for blocks, size in self.groups)

    @property
    def size(self) -> float:
        r"""The block size of an average pair, :math:`\sum_g B_g L_g^3 / \sum_g B_g L_g^2`
        (L for blocks of one size; a few blocks of one node beside large ones barely move it)."""
        return sum(blocks.numel() * size**3 for blocks, size in self.groups) / self.pairs

    @property
    def padded(self) -> bool:
        """Whether any block is padded (blocks of unequal sizes, in one size group or more)."""
        blocks, size = self.groups[0]
        return (len(self.groups) > 1 or self.starts.numel() - 1 != blocks.numel()
                or bool((self.starts.diff() != size).any()))


def diagonal_blocks(edge_index: Tensor, num_nodes: int) -> DiagonalBlocks | None:
    r"""The diagonal blocks of a graph over one node set, when running it block by block needs
    at most ``1 - BLOCK_MIN_SAVING`` of the whole graph's :math:`N^2` pairs; ``None`` otherwise
    (one block, a few large ones, or a graph whose ids cannot be read while it is traced or
    transformed: ``torch.compile``, ``torch.jit.trace``, ``torch.func``).

    Args:
        edge_index (Tensor): ``[2, E]`` CPU tensor of node ids below ``num_nodes``.
        num_nodes (int): the number of nodes N, targets and sources alike.
    """
    max_pairs = (1.0 - BLOCK_MIN_SAVING) * num_nodes * num_nodes
    # (read first: under torch.compile the edge count may be symbolic, and is not compared)
    if not host_readable(edge_index) or num_nodes < 2:
        return None
    # more edges than that would not fit in such blocks without repeating a pair: not looked for
    if edge_index.size(1) > max_pairs:
        return None
    starts = cpu.block_starts(edge_index, num_nodes)  # (B + 1,)
    sizes = starts.diff()  # (B,)
    if sizes.numel() == 1:
        return None
    if bool((sizes == sizes[0]).all()):
        groups = [(torch.arange(sizes.numel()), int(sizes[0]))]
    else:  # by ceil(log2(size)): a block padded to at most twice its size
        bucket = torch.ceil(torch.log2(sizes.double())).long()
        groups = []
        for b in bucket.unique().tolist():
            members = (bucket == b).nonzero().squeeze(1)
            groups.append((members, int(sizes[members].max())))
    layout = DiagonalBlocks(starts, groups)
    if layout.pairs > max_pairs:
        return None
    return layout


def dense_edge_attention(q: Tensor, k: Tensor, v: Tensor, edge_index: Tensor, *,
                         scale: float, bias: Tensor | None, dropout_mask: Tensor | None,
                         score: str, negative_slope: float, need_alpha: bool,
                         att: Tensor | None = None, layout: DiagonalBlocks | None = None,
                         sinks: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    r"""Edge attention computed as dense masked attention over ``[H, N_dst, N_src]`` scores.

    Computes exactly what :func:`~graphattn.functional.attention.reference_edge_attention`
    computes, for finite inputs: a NaN or an infinity in ``q``, ``k``, ``v`` or ``bias``
    reaches every target here (a weight of 0 times it is NaN in the product with the values),
    where the sparse backends keep it to the targets whose edges read it. Edges of one
    (target i, source j) pair enter as one dense entry with the summed weight of its edges:
    with per-edge scores :math:`t_e` (the bias :math:`b_e` for ``"dot"``, the whole score for
    ``"additive"`` and ``"gatv2"``, computed per edge)

    .. math::
        L_{ij} = \text{scale} \cdot q_i \cdot k_j + \log \sum_{e : j \to i} e^{t_e}, \qquad
        P = \operatorname{softmax}_j L, \qquad
        \alpha_e = P_{ij} \, \frac{e^{t_e}}{\sum_{e' : j \to i} e^{t_{e'}}}

    (:math:`-\infty` where no edge lies; a simple graph without bias has :math:`L_{ij} =
    \text{scale} \cdot q_i \cdot k_j`, a multigraph without bias adds the log of the edge count).
    The per-edge dropout multiplier :math:`m_e` enters as the dense matrix
    :math:`D_{ij} = \sum_e \alpha_e m_e / P_{ij}`, so ``out = (P * D) V`` equals the reference.
    Without bias, dropout, multi-edges or ``need_alpha``, the dot score runs as one
    :func:`torch.nn.functional.scaled_dot_product_attention` call with the bool mask (none on
    the complete graph, ``is_causal`` on the causal one, which SDPA runs faster); with a bias
    or multi-edges, SDPA gets the float mask :math:`L - \text{scale}\, q k^\top`; otherwise the
    weights are explicit. Targets without an incoming edge get exactly 0, and the rows of
    nodes that no edge reads (the queries of targets without an in-edge, the keys and values
    of sources without an out-edge) reach no output and no gradient, whatever they hold (NaN
    or inf included). With ``sinks`` :math:`\varsigma`, each row's softmax has one more score,
    :math:`\varsigma_h`, whose value is 0: SDPA runs it as a key in front of the others
    (:func:`_sdpa_with_sinks`), the explicit softmax as one more column
    (:func:`softmax_with_sinks`).

    **Block-diagonal graphs.** On CPU, a graph over one node set whose nodes split into ranges
    that no edge crosses (a batch of B sequences or images built by
    :func:`~graphattn.graphs.repeat_graph`, the complete graphs of a mini-batch of graphs) runs
    as a batch of ``[H, L, L]`` blocks, :math:`B L^2` pairs instead of :math:`(B L)^2` (see
    :func:`diagonal_blocks`). Blocks of equal size are viewed in place (a batch of causal
    sequences runs SDPA with ``is_causal``); blocks of unequal sizes are grouped by size, each
    group padded to its largest block (at most twice a block's size), and gathered into place.
    Complete or causal blocks of unequal sizes (the dot score, no bias) need no search for
    each edge's pair: per-graph SDPA runs them, or, when the weights themselves are needed
    (returned, or under dropout), padded blocks whose pairs follow from the edges' positions.

    Memory grows as :math:`H \cdot N_{dst} \cdot N_{src}` (see :func:`dense_peak_bytes`), or
    :math:`H \sum_g B_g L_g^2` block by block, whatever the number of edges.

    Args:
        q (Tensor): ``[N_dst, H, C]`` (``[N_dst, H]`` when additive).
        k (Tensor): ``[N_src, H_kv, C]`` (``[N_src, H_kv]`` when additive), ``H_kv`` dividing
            H: each kv head serves ``H / H_kv`` query heads, as in :func:`sdpa`.
        v (Tensor): ``[N_src, H_kv, C]``.
        edge_index (Tensor): ``[2, E]`` int64, already checked.
        scale (float): score multiplier.
        bias (Tensor, optional): ``[E, H]`` added to the scores.
        dropout_mask (Tensor, optional): ``[E, H]`` multiplier of the weights (0 or
            ``1 / (1 - p)``).
        score (str): ``"dot"``, ``"additive"`` or ``"gatv2"``.
        negative_slope (float): LeakyReLU slope of the additive and gatv2 scores.
        need_alpha (bool): also return the weights per edge.
        att (Tensor, optional): ``[H, C]`` attention vector of ``"gatv2"``.
        layout (DiagonalBlocks, optional): the graph's blocks, when the caller found them
            (:func:`diagonal_blocks`). (default: found here)
        sinks (Tensor, optional): ``[H]``, the score of each head's sink. (default: ``None``)

    Shapes:
        - **input:** q ``(N_dst, H, C)``, k and v ``(N_src, H, C)``, edge_index ``(2, E)``,
          bias and dropout_mask ``(E, H)``
        - **output:** out ``(N_dst, H, C)``; alpha ``(E, H)`` or ``None``
    """
    n_dst, n_src = q.size(0), v.size(0)
    options = dict(scale=scale, bias=bias, dropout_mask=dropout_mask, score=score,
                   negative_slope=negative_slope, need_alpha=need_alpha, att=att, sinks=sinks)
    if edge_index.size(1) == 0 or 0 in (q.size(1), v.size(-1)):
        # no edges, heads or value channels: every output 0 or empty. The reference path
        # gives each input a (zero) gradient, the bias included; SDPA's empty products would
        # leave the bias out of the autograd graph.
        return reference_edge_attention(q, k, v, edge_index, **options)
    src, dst = edge_index[0].long(), edge_index[1].long()
    if layout is None and n_dst == n_src and q.device.type == "cpu":
        layout = diagonal_blocks(edge_index, n_dst)
    if (score != "dot" or need_alpha or dropout_mask is not None
            or (layout is not None and layout.padded)):
        # grouped k, v (fewer heads than q) go to SDPA as they are, on its path alone: the
        # explicit weights and the padded blocks take every query head's
        k, v = repeat_kv_heads(q.size(1), k, v, dim=1)  # (N_src, H, C)
    if layout is None:
        return _dense_blocks(q, k, v, src, dst, 1, n_dst, n_src, **options)
    if not layout.padded:  # B blocks of L nodes: viewed in place
        blocks, size = layout.groups[0]
        return _dense_blocks(q, k, v, src, dst, blocks.numel(), size, size, **options)
    pattern = _whole_blocks(src, dst, layout) if score == "dot" and bias is None else None
    if pattern is not None and dropout_mask is None and not need_alpha:
        # no pair to find: each block's nodes are all it needs
        sizes = layout.starts.diff()
        block_of = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)  # (N,)
        out = per_graph_attention(q, k, v, block_of.to(q.device),
                                  is_causal=pattern == "causal", scale=scale, dropout_p=0.0,
                                  sinks=sinks)
        return out, None
    if pattern is not None:  # the weights themselves: each edge's pair from its positions
        return _whole_padded_blocks(q, k, v, src, dst, layout, pattern == "causal",
                                    scale=scale, dropout_mask=dropout_mask,
                                    need_alpha=need_alpha, sinks=sinks)
    return _padded_groups(q, k, v, src, dst, layout, **options)


def _whole_blocks(src: Tensor, dst: Tensor, layout: DiagonalBlocks) -> str | None:
    """``"complete"`` when every block of ``layout`` holds all its pairs, ``"causal"`` when
    it holds those with the source at or before the target, once each (known from the edge
    count and one read of the edges, :func:`cpu.pair_order
    <graphattn.functional.cpu.pair_order>`); ``None`` otherwise, or in an order that does
    not tell."""
    sizes = layout.starts.diff()
    num_edges = src.numel()
    complete = num_edges == int(sizes.square().sum())
    if not (complete or num_edges == int((sizes * (sizes + 1)).sum()) // 2):
        return None
    distinct, lower, _ = cpu.pair_order(src, dst)
    if not distinct:
        return None
    return "complete" if complete else ("causal" if lower else None)


def _whole_padded_blocks(q: Tensor, k: Tensor, v: Tensor, src: Tensor, dst: Tensor,
                         layout: DiagonalBlocks, causal: bool, *, scale: float,
                         dropout_mask: Tensor | None, need_alpha: bool,
                         sinks: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    r"""Complete (or, with ``causal``, causal) blocks of unequal sizes, each pair once, with
    the dot score and no bias, when the weights themselves are needed (a dropout mask, or
    ``need_alpha``): group by group, the blocks padded to the group's size L_g as
    ``[B_g, H, L_g, L_g]`` scores, with the padding masked out as keys only. Every row then has
    a key (a padding row, whose query is a zero row, has its block's nodes), so no row needs
    the empty-row handling of the general path, and the padding rows' outputs are never read.
    The pair of edge :math:`j \to i` of block b, in group g at slot s, is known from the
    positions :math:`i - s_b`, :math:`j - s_b` in the block (:math:`s_b` its first node):
    :math:`P_g + s L_g^2 + (i - s_b) L_g + (j - s_b)`, with :math:`P_g` the pairs of the groups
    before; no sort of the edges and no mask search."""
    n, heads, channels = v.shape
    starts, sizes = layout.starts, layout.starts.diff()  # (B + 1,), (B,)
    width = torch.empty_like(sizes)  # (B,) the padded size of each block
    slot = torch.empty_like(sizes)  # (B,) of each block in its group
    row_base = torch.empty_like(sizes)  # (B,) first padded row of its group
    pair_base = torch.empty_like(sizes)  # (B,) first padded pair of its group
    rows = pairs = 0
    bounds = []  # per group: its rows and its pairs among all of the groups'
    for members, size in layout.groups:
        count = members.numel()
        width[members], row_base[members], pair_base[members] = size, rows, pairs
        slot[members] = torch.arange(count)
        bounds.append((slice(rows, rows + count * size), slice(pairs, pairs + count * size**2)))
        rows, pairs = rows + count * size, pairs + count * size**2
    block_of = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)  # (N,)
    local = torch.arange(n) - starts[block_of]  # (N,) position of each node in its block
    padded_row = row_base[block_of] + slot[block_of] * width[block_of] + local  # (N,)
    # the pair of j -> i less j, per target i: one gather per edge
    row_pairs = (pair_base + slot * width.square() - starts[:-1])[block_of] + local * width[
        block_of]  # (N,)
    pair = (row_pairs[dst] + src).to(q.device)  # (E,) among all padded pairs
    # padded row -> node; n, a zero row, for the padding: what no edge reads reaches nothing
    gather = torch.full((rows,), n, dtype=torch.int64)
    gather[padded_row] = torch.arange(n)
    qkv = torch.cat([q, k, v], dim=-1)  # (N, H, 2C + C_v)
    qkv = gather_rows(torch.cat([qkv, qkv.new_zeros(1, *qkv.shape[1:])]), gather.to(q.device))
    D = None
    if dropout_mask is not None:  # 0 on the padding
        # heads first, [H, pairs], in the layout of the weights (see _dense_blocks; 0.88x the
        # time of a training step on a batch with a graph of 1000 nodes), outside tracers;
        # pairs first, [pairs, H], under them
        heads_first = host_readable(pair)
        D = (dropout_mask.new_zeros(heads, pairs).index_copy_(1, pair, dropout_mask.t())
             if heads_first else
             dropout_mask.new_zeros(pairs, heads).index_copy(0, pair, dropout_mask))
    outs, weights = [], []
    # split, not sliced: the gradient of each part is then written once, not added to zeros
    parts = qkv.split([r.stop - r.start for r, _ in bounds])
    for (members, size), (_, pair_range), part in zip(layout.groups, bounds, parts,
                                                      strict=True):
        count = members.numel()
        group = part.view(count, size, heads, -1).transpose(1, 2)  # (B_g, H, L, .)
        qh, kh, vh = group.split([q.size(-1), k.size(-1), channels], dim=-1)
        keys = torch.arange(size) < sizes[members].unsqueeze(1)  # (B_g, L): real nodes
        mask = keys.view(count, 1, 1, size)
        if causal:
            mask = mask & torch.ones(size, size, dtype=torch.bool).tril()
        scores = scaled_scores(qh, kh, scale)  # (B_g, H, L, L)
        scores = scores.masked_fill_(~mask.to(q.device), float("-inf"))  # in place: one pass
        P = softmax_with_sinks(scores, sinks).to(v.dtype)
        weights.append(P)
        W = P
        if D is not None:  # (B_g, H, L, L)
            D_g = (D[:, pair_range].view(heads, count, size, size).transpose(0, 1)
                   if heads_first else
                   D[pair_range].view(count, size, size, heads).permute(0, 3, 1, 2))
            W = P * D_g.to(P.dtype)
        outs.append((W @ vh).transpose(1, 2).reshape(count * size, heads, channels))
    out = gather_rows(torch.cat(outs), padded_row.to(q.device))  # (N, H, C_v)
    alpha = None
    if need_alpha:
        alpha = gather_rows(torch.cat([P.permute(0, 2, 3, 1).reshape(-1, heads)
                                       for P in weights]), pair)  # (E, H)
    return out, alpha


def _padded_groups(q: Tensor, k: Tensor, v: Tensor, src: Tensor, dst: Tensor,
                   layout: DiagonalBlocks, **options) -> tuple[Tensor, Tensor | None]:
    """Blocks of unequal sizes, group by group: the nodes gathered once into every group's
    padded ``[B_g, L_g]`` blocks one after the other (zero rows for the padding, which no
    edge touches), the edges sorted by group and renumbered, each group run as equal blocks,
    and the outputs (and weights) put back."""
    n = q.size(0)
    starts, groups = layout.starts, layout.groups
    sizes = starts.diff()  # (B,)
    group_of_block = torch.empty_like(sizes)
    first_row = torch.empty_like(sizes)  # of each block, in its group's rows
    base = [0]  # where each group's rows start among all padded rows
    for g, (members, size) in enumerate(groups):
        group_of_block[members] = g
        first_row[members] = torch.arange(members.numel()) * size
        base.append(base[-1] + members.numel() * size)
    block_of = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)  # (N,)
    node_group = group_of_block[block_of]  # (N,)
    node_row = first_row[block_of] + torch.arange(n) - starts[block_of]  # (N,) in its group
    padded_row = node_row + torch.tensor(base[:-1])[node_group]  # (N,) among all
    perm, ptr, src_row, dst_row, has_in, has_out = cpu.group_edges(src, dst, node_row,
                                                                   node_group, len(groups))

    def padded(t: Tensor, read: Tensor) -> Tensor:  # (N, ...) -> (rows of every group, ...)
        # padded row -> node; n, the zero row, for the padding and for the rows no edge reads
        # (a target's query without an in-edge, a source's key and value without an out-edge),
        # so that what those rows hold (NaN or inf included) reaches no output or gradient
        gather = torch.full((base[-1],), n, dtype=torch.int64)
        gather[padded_row[read]] = read.nonzero().squeeze(1)
        return gather_rows(torch.cat([t, t.new_zeros(1, *t.shape[1:])]), gather.to(t.device))

    qp, kp, vp = padded(q, has_in), padded(k, has_out), padded(v, has_out)
    edge_terms = {name: gather_rows(options[name], perm)
                  for name in ("bias", "dropout_mask") if options[name] is not None}
    outs, alphas = [], []
    for g, (members, size) in enumerate(groups):
        rows, edges = slice(base[g], base[g + 1]), slice(int(ptr[g]), int(ptr[g + 1]))
        out, alpha = _dense_blocks(
            qp[rows], kp[rows], vp[rows], src_row[edges], dst_row[edges], members.numel(),
            size, size, rows_read_only=True,
            **{**options, **{name: t[edges] for name, t in edge_terms.items()}})
        outs.append(out)
        alphas.append(alpha)
    out = gather_rows(torch.cat(outs), padded_row)  # (N, H, C)
    alpha = None
    if options["need_alpha"]:
        grouped = torch.cat(alphas)  # (E, H) in group order
        alpha = grouped.new_empty(grouped.shape).index_copy(0, perm, grouped)
    return out, alpha


def _dense_blocks(q: Tensor, k: Tensor, v: Tensor, src: Tensor, dst: Tensor, blocks: int,
                  n_dst: int, n_src: int, *, scale: float, bias: Tensor | None,
                  dropout_mask: Tensor | None, score: str, negative_slope: float,
                  need_alpha: bool, att: Tensor | None, rows_read_only: bool = False,
                  sinks: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`dense_edge_attention` on a graph of ``blocks`` diagonal blocks of ``n_dst``
    targets and ``n_src`` sources each (one block: the whole graph), whose edges ``src -> dst``
    (int64, at least one) stay inside their block: the work on ``[B, H, n_dst, n_src]``.
    ``rows_read_only``: the rows of q, k and v that no edge reads are zero already."""
    B = blocks
    num_edges = src.numel()
    capacity = B * n_dst * n_src
    in_place = False  # whether the edges are the pairs, in order (pair[e] = e)
    causal_count = n_dst == n_src and num_edges == B * n_dst * (n_dst + 1) // 2
    if host_readable(src) and host_readable(dst):  # one pass of a CPU kernel
        # the pair index is needed beyond the mask only for per-edge terms, weights and
        # multi-edges (block_pairs finds the last itself)
        want_pair = (score != "dot" or bias is not None or dropout_mask is not None
                     or need_alpha)
        # Complete and causal blocks whose edge order shows no pair twice (as graphs builds
        # them, self-loops moved last or not) are known from a read of the edges and their
        # count. Edges in target-major order fill the pairs in order: a complete graph's pair
        # index is then the edge's position.
        distinct, lower, in_order = (cpu.pair_order(src, dst)
                                     if num_edges == capacity or causal_count
                                     else (False, False, False))
        if distinct and (num_edges == capacity or lower) and (
                not want_pair or (in_order and num_edges == capacity)):
            pair = torch.arange(num_edges, device=src.device) if want_pair else None
            in_place = want_pair  # edge e is pair e
            mask = torch.ones(n_dst, n_src, dtype=torch.bool)
            if num_edges != capacity:
                mask = mask.tril_()  # causal
            mask = mask.expand(B, n_dst, n_src).contiguous()
            distinct = num_edges
        else:
            pair, mask, distinct, lower = cpu.block_pairs(src, dst, B, n_dst, n_src,
                                                          want_pair=want_pair)
        simple = distinct == num_edges
        causal = simple and causal_count and lower
    else:
        # (E,) flat index of (block, i, j) in [B, N_dst, N_src]: block * N_dst + i is the target
        pair = dst * n_src + (src - (dst // n_dst) * n_src if B > 1 else src)
        mask = torch.zeros(B, n_dst, n_src, dtype=torch.bool, device=q.device)
        mask.view(-1)[pair] = True
        # Whether no pair holds two edges is known only at run time: torch.compile takes the
        # multigraph path, which gives the same result on any graph.
        simple = not torch.compiler.is_compiling() and int(mask.count_nonzero()) == num_edges
        causal = simple and causal_count and bool((src <= dst).all())
    # The complete and the causal graph run SDPA without a mask (and have no empty row).
    complete = simple and num_edges == B * n_dst * n_src
    causal = causal and not complete
    # Targets without an in-edge, and (below) sources that no edge reads: counted over the
    # edges, O(E), where torch.compile does not trace (bincount's size depends on the values);
    # the O(N^2) reductions of the mask took 2.0 and 1.1 ms at 1024 nodes and density 0.25,
    # the counts 0.2 ms each
    counts = host_readable(src) and host_readable(dst)
    if complete or causal:
        empty_rows = mask.new_zeros(B, 1, n_dst)  # (B, 1, N_dst)
    elif counts:
        empty_rows = (torch.bincount(dst, minlength=B * n_dst) == 0).view(B, 1, n_dst)
    else:
        empty_rows = ~mask.any(dim=-1).unsqueeze(1)

    def heads_first(x: Tensor, n: int) -> Tensor:  # (B * n, H, C) -> (B, H, n, C)
        return x.view(B, n, *x.shape[1:]).transpose(1, 2)

    vh = v.view(B, n_src, *v.shape[1:]).transpose(1, 2)  # (B, H, N_src, C)
    if score == "dot":
        qh, kh = heads_first(q, n_dst), heads_first(k, n_src)  # (B, H, N, C)
    if not (complete or causal or rows_read_only):
        # A source without an out-edge (a padding node, say) enters every target's product
        # with weight 0, and 0 * inf or 0 * NaN is NaN: its rows are zeroed, so that what it
        # holds reaches no output and no gradient, as in the sparse backends; so are the query
        # rows of targets without an in-edge.
        unread = ((torch.bincount(src, minlength=B * n_src) == 0) if counts
                  else ~mask.any(dim=1)).view(B, 1, n_src, 1)
        vh = vh.masked_fill(unread, 0.0)
        if score == "dot":
            kh = kh.masked_fill(unread, 0.0)
            qh = qh.masked_fill(empty_rows.unsqueeze(-1), 0.0)

    work = _softmax_dtype(q.dtype)  # half precision is scored in fp32 (see scaled_scores)
    if score == "dot":
        t = bias
    elif score == "gatv2":
        t = (F.leaky_relu(gather_rows(q, dst).to(work) + gather_rows(k, src).to(work),
                          negative_slope) * att.to(work)).sum(dim=-1) * scale  # (E, H)
        if bias is not None:
            t = t + bias
    else:
        t = gather_rows(q, dst).to(work) + gather_rows(k, src).to(work)  # (E, H)
        if bias is not None:
            t = t + bias
        t = F.leaky_relu(t, negative_slope) * scale
    # (B, H or 1, N_dst, N_src), (E, H), (B, H, N_dst, 1)
    T, share, shift = _pair_log_weights(t, pair, mask, simple, v.dtype, in_place)
    # rows that get 0: no in-edge, or (with per-edge scores) every in-edge scoring -inf (a
    # NaN score counts as live: its row is NaN, as in the reference)
    # (amax: one pass over T, where == and all() take two and a bool tensor)
    dead = empty_rows if T is None else T.amax(dim=-1) == float("-inf")  # (B, H or 1, N_dst)

    def nodes_first(out: Tensor) -> Tensor:  # (B, H, N_dst, C) -> (B * N_dst, H, C)
        # contiguous, as every backend returns it: (N_dst, H, C) views as (N_dst, H * C)
        return out.masked_fill(dead.unsqueeze(-1), 0.0).transpose(1, 2).reshape(
            B * n_dst, *out.shape[1::2]).contiguous()

    # SDPA takes a float mask in q's dtype: scores of fp32 beside half-precision inputs (an
    # edge key's term, formed in fp32) take the explicit softmax, which adds them in fp32
    # (and sinks beside a multigraph's T shifted per row: SDPA takes one sink per head)
    explicit = (score != "dot" or need_alpha or dropout_mask is not None
                or (T is not None and T.dtype != q.dtype)
                or (sinks is not None and shift is not None))
    if not explicit:
        attn_mask = None  # the complete graph; the causal one: SDPA skips the masked half
        if T is not None:  # (B, H|1, N, N), which may be a view of the caller's bias
            attn_mask = T.to(q.dtype)
            if not host_readable(dead) or bool(dead.any()):  # (on CPU, the rare case only)
                attn_mask = attn_mask.masked_fill(dead.unsqueeze(-1), 0.0)
        elif not (complete or causal):
            attn_mask = mask | empty_rows.transpose(1, 2)  # (B, N_dst, N_src); empty rows see all
        if B == 1:  # one block: SDPA on (H, N, C), as sdpa() batches it
            qh, kh, vh = qh[0], kh[0], vh[0]
            attn_mask = None if attn_mask is None else attn_mask[0]
        elif attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.unsqueeze(1)  # (B, 1, N_dst, N_src)
        # with a bias, the float mask holds the causal pattern (SDPA takes one or the other)
        out = sdpa(qh, kh, vh, attn_mask=attn_mask, is_causal=causal and attn_mask is None,
                   scale=scale, sinks=sinks)
        return nodes_first(out.view(B, *out.shape[-3:])), None

    # complete or causal blocks without per-edge scores have no row without weight; on CPU,
    # a graph whose every target row has an edge (the common case) is seen to have none
    rows_dead = T is not None or not (complete or causal)
    if rows_dead and host_readable(dead) and not bool(dead.any()):
        rows_dead = False
    if score == "dot":
        # grouped k, v (fewer heads than q) come this far where the explicit softmax is found
        # here (fp32 scores beside half inputs, sinks beside a multigraph's shift): every query
        # head's copy
        kh, vh = repeat_kv_heads(qh.size(1), kh, vh, dim=1)  # (B, H, N_src, C)
        L = scaled_scores(qh, kh, scale)
        # -inf off the graph before T is added: a pair without an edge whose product overflowed
        # to +inf (fp16) would make inf + T = inf - inf = NaN in its target row
        if not complete:
            L = L.masked_fill_(~mask.unsqueeze(1), float("-inf"))  # (B, H, N_dst, N_src)
        if T is not None:
            L = L + T
    else:  # the whole score is in T
        L = T  # (B, H, N_dst, N_src)
    if rows_dead:
        L = L.masked_fill(dead.unsqueeze(-1), 0.0)
    P = softmax_with_sinks(L, sinks, shift).to(v.dtype)
    if rows_dead:
        P = P.masked_fill(dead.unsqueeze(-1), 0.0)  # (B, H, N_dst, N_src)
    heads = P.size(1)
    alpha = None
    if need_alpha:
        alpha = P.permute(0, 2, 3, 1).reshape(B * n_dst * n_src, heads)  # (P, H)
        alpha = alpha if in_place else gather_rows(alpha, pair)  # (E, H)
        if share is not None:
            alpha = (alpha * share).to(P.dtype)  # share: fp32 for half precision
    W = P
    if dropout_mask is not None:
        kept = (dropout_mask if share is None else dropout_mask * share).to(P.dtype)  # (E, H)
        # On CPU, outside tracers, one edge per pair: the multipliers are written heads first,
        # [H, P] (each block of a head whole), in the layout of P, 1.1x faster than pairs first
        # (whose product reads P with a stride). Tracers keep the pairs-first rows (see
        # _pair_log_weights); a complete graph's pairs-first multipliers are kept itself.
        if simple and not in_place and host_readable(pair):
            D = kept.new_zeros(heads, capacity).index_copy_(1, pair, kept.t())  # (H, P)
            D = D.view(heads, B, n_dst, n_src).transpose(0, 1)  # (B, H, N_dst, N_src)
            return nodes_first((P * D) @ vh), alpha
        # pairs first, as in _pair_log_weights: whole rows
        if in_place:
            D = kept  # (P, H)
        elif simple:  # one edge per pair: rows written, not summed (3-6x faster)
            D = kept.new_zeros(capacity, heads).index_copy(0, pair, kept)  # (P, H)
        else:
            D = scatter_add_rows(kept, pair, capacity)  # (P, H)
        W = P * D.view(B, n_dst, n_src, heads).permute(0, 3, 1, 2)  # (B, H, N_dst, N_src)
    # a dead row's weights are 0, but 0 * NaN (or inf) in a value row is NaN: zeroed after
    return nodes_first(W @ vh), alpha
