"""When the fused paths must give way to plain torch ops, and how they call their Functions.

The fused backends' autograd Functions (the ``cpu`` and ``triton`` kernels, the edge-term
gathers and scatters, the dense backend's SDPA wrapper) have a hand-written backward and no
forward-mode or batching rule, and SDPA's flash kernel has no forward-mode derivative. Under
``torch.func``'s transforms, and for inputs that carry a forward-mode tangent
(``torch.autograd.forward_ad``), the same functions are computed with plain torch ops instead,
which every transform differentiates and batches. So they are under ``torch.onnx.export``,
where ONNX has functions for plain torch ops and none for the Functions' operators.

Outside those transforms the Functions are called through :func:`apply_function`, which skips
what ``torch.autograd.Function.apply`` does at every call for a Function with a separate
``setup_context``: bind the arguments to ``forward``'s signature with :mod:`inspect`.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

try:  # what Function.apply calls before the engine's apply (a private helper of torch)
    from torch._functorch.utils import unwrap_dead_wrappers
except ImportError:  # another torch: apply_function falls back to Function.apply
    unwrap_dead_wrappers = None

try:  # the dynamo ONNX exporter's flag (a private module of torch), read without a call
    from torch.onnx._internal.exporter import _flags as onnx_flags
except ImportError:  # another torch: onnx_exporting asks torch.onnx.is_in_onnx_export
    onnx_flags = None


def host_readable(t: Tensor) -> bool:
    """Whether a CPU kernel can read ``t``'s values now: a plain CPU tensor, outside
    ``torch.compile``, ``torch.jit.trace``, ``torch.func``'s transforms and dispatch modes
    (``make_fx``, fake tensors), where values are symbolic or wrapped."""
    return (type(t) is Tensor and t.device.type == "cpu" and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing() and not torch._C._are_functorch_transforms_active()
            and torch._C._len_torch_dispatch_stack() == 0)


def onnx_exporting() -> bool:
    """Whether ``torch.onnx.export`` is tracing this call (either exporter: dynamo's, or the
    TorchScript one's trace)."""
    # (is_in_onnx_export takes 2 us, its flag 30 ns: plain_ops_only runs on every call)
    if onnx_flags is not None and onnx_flags._is_onnx_exporting:
        return True
    return ((torch.jit.is_tracing() or (onnx_flags is None and torch.compiler.is_compiling()))
            and torch.onnx.is_in_onnx_export())


def plain_ops_only(*tensors: Tensor | None) -> bool:
    """True under ``torch.func``'s transforms (vjp, jvp, vmap, ...), under
    ``torch.onnx.export``, or when one of ``tensors`` is a forward-mode dual tensor: the fused
    paths' Functions cannot run (or be exported) there."""
    if torch._C._are_functorch_transforms_active() or onnx_exporting():
        return True
    # no dual level entered (the common case): no tensor can carry a tangent
    return fwAD._current_level >= 0 and any(
        t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors)


def apply_function(function: type[torch.autograd.Function], *args):
    """``function.apply(*args)``, with every argument of ``function.forward`` given.

    ``Function.apply`` builds ``inspect.signature(forward)`` and binds the arguments to it on
    each call when the Function has its own ``setup_context`` (30-40 us of host time for the
    13 arguments of the ``triton`` kernels' Function: more than a kernel launch, on every
    layer call). With every argument given there are no defaults to fill in, so outside
    ``torch.func``'s transforms this hands them to the autograd engine's ``apply`` directly,
    as ``Function.apply`` itself does after binding. Under the transforms and while dynamo
    traces it calls ``function.apply``, which they need (and so it does where torch lacks the
    private helper that ``Function.apply`` calls first).
    """
    if (unwrap_dead_wrappers is None or torch._C._are_functorch_transforms_active()
            or torch.compiler.is_compiling()):
        # (dynamo traces Function.apply; it fails inside its own code on the engine's apply,
        # in a frame it compiles after a graph break)
        return function.apply(*args)
    return super(torch.autograd.Function, function).apply(*unwrap_dead_wrappers(args))


def needs_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd would record an operation on ``tensors``: grad mode is on and one of
    them requires grad. When not, a fused backend calls its forward without its Function."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def saveable(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """``tensors`` for ``ctx.save_for_backward``, with a copy of each inference tensor (one
    made under ``torch.inference_mode``, as frozen features or a graph built there can be),
    which autograd refuses to save; the others as they are (and all of them in a graph that
    ``torch.compile`` traces, where there is no inference tensor)."""
    if torch.compiler.is_compiling():
        return tensors
    return tuple(t.clone() if t is not None and t.is_inference() else t for t in tensors)
