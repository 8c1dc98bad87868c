"""apply_function: the fused Functions called without Function.apply's per-call binding."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import assert_close, attention_inputs, random_graph

from graphattn.functional import edge_attention
from graphattn.functional._transforms import apply_function


class _Scale(torch.autograd.Function):
    """y = a * x, with forward and setup_context apart (as the fused backends' Functions)."""

    @staticmethod
    def forward(x: torch.Tensor, a: float, shift: float = 0.0) -> torch.Tensor:
        return x * a + shift

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.a = inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.a, None, None

    @staticmethod
    def vmap(info, in_dims, x, a, shift):
        return x * a + shift, in_dims[0]


def _no_signatures(monkeypatch) -> None:
    """Make ``inspect.signature`` raise: what Function.apply calls at each call."""
    def refuse(*args, **kwargs):
        raise AssertionError("inspect.signature was called")
    monkeypatch.setattr(inspect, "signature", refuse)


def test_apply_function_skips_the_signature_binding(monkeypatch):
    x = torch.randn(5, requires_grad=True)
    expected = _Scale.apply(x, 3.0, 1.0)
    (grad_expected,) = torch.autograd.grad(expected.sum(), x)
    _no_signatures(monkeypatch)
    with pytest.raises(AssertionError, match="inspect.signature"):
        _Scale.apply(x, 3.0, 1.0)  # the check itself can fail
    out = apply_function(_Scale, x, 3.0, 1.0)
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(out, expected)
    assert torch.equal(grad, grad_expected)


def test_apply_function_under_torch_func_takes_function_apply():
    x = torch.randn(4, 3)
    grads = torch.func.vmap(torch.func.grad(lambda r: apply_function(_Scale, r, 2.5, 0.0)
                                            .pow(2).sum()))(x)
    assert_close(grads, 2 * 2.5 * 2.5 * x)


@pytest.mark.parametrize("backend", ["cpu", "dense", "triton"])
def test_backends_call_their_functions_without_signature_binding(backend, monkeypatch,
                                                                 request):
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    ei = random_graph(6, 18, seed=2)
    inputs = attention_inputs(6, 6, 18, 2, 8)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    grads = []
    for refuse in (False, True):
        if refuse:
            _no_signatures(monkeypatch)
        out = edge_attention(q, k, v, ei, backend=backend)
        grads.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for plain, fast in zip(*grads, strict=True):
        assert torch.equal(plain, fast)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_requires_grad"])
def test_inference_calls_the_kernels_without_their_function(backend, mode, monkeypatch,
                                                            request):
    """Nothing to differentiate: the fused backends call their forward directly, with the
    same outputs and weights, bit for bit, as the call that records an autograd node."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
        from graphattn.functional import triton_kernels as module
    else:
        from graphattn.functional import cpu as module
    ei = random_graph(7, 25, seed=5)
    inputs = attention_inputs(7, 7, 25, 2, 8)
    q, k, v, bias = inputs["q"], inputs["k"], inputs["v"], inputs["bias"]
    recorded = edge_attention(q, k, v, ei, bias=bias, backend=backend, return_attention=True)
    assert recorded[0].grad_fn is not None

    def refuse(*args):
        raise AssertionError("the autograd Function was called")

    monkeypatch.setattr(module, "apply_function", refuse)
    if mode == "no_requires_grad":
        q, k, v, bias = (t.detach() for t in (q, k, v, bias))
        context = torch.enable_grad()
    else:
        context = getattr(torch, mode)()
    with context:
        out, alpha = edge_attention(q, k, v, ei, bias=bias, backend=backend,
                                    return_attention=True)
    assert out.grad_fn is None and not out.requires_grad
    assert torch.equal(out, recorded[0].detach())
    assert torch.equal(alpha, recorded[1].detach())
    with pytest.raises(AssertionError, match="autograd Function"):  # the refusal is in place
        edge_attention(*(t.detach().requires_grad_() for t in (q, k, v)), ei, backend=backend)


def test_apply_function_falls_back_without_torchs_private_helper(monkeypatch):
    """Where torch has no ``unwrap_dead_wrappers`` (another version), ``Function.apply``."""
    from graphattn.functional import _transforms

    monkeypatch.setattr(_transforms, "unwrap_dead_wrappers", None)
    called = []
    monkeypatch.setattr(_Scale, "apply", classmethod(
        lambda cls, *args: called.append(args) or torch.autograd.Function.apply.__func__(
            cls, *args)))
    x = torch.randn(3, requires_grad=True)
    out = apply_function(_Scale, x, 2.0, 0.0)
    assert len(called) == 1
    assert torch.equal(out, 2.0 * x)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("backend", ["reference", "cpu", "dense", "triton"])
def test_activation_checkpointing_gives_the_same_gradients(backend, reentrant, request):
    """torch.utils.checkpoint runs the forward without keeping activations (the reentrant
    kind under no_grad: the fused backends skip their Function there) and again in backward,
    through the Function: the gradients are those of a plain step."""
    from torch.utils.checkpoint import checkpoint

    from graphattn.nn import GraphSelfAttention

    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    torch.manual_seed(0)
    layer = GraphSelfAttention(16, 8, heads=2, backend=backend)
    x = torch.randn(12, 16, requires_grad=True)
    edge_index = random_graph(12, 40, seed=7)
    leaves = [x, *layer.parameters()]

    def step(forward) -> list[torch.Tensor]:
        for t in leaves:
            t.grad = None
        forward().square().sum().backward()
        return [t.grad.clone() for t in leaves]

    plain = step(lambda: layer(x, edge_index))
    checkpointed = step(lambda: checkpoint(layer, x, edge_index, use_reentrant=reentrant))
    for a, b in zip(plain, checkpointed, strict=True):
        assert_close(b, a)
