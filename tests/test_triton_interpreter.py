"""The suite's change to Triton's interpreter (``conftest._patch_the_language_once_per_launch``):
the language is patched once per launch instead of on every device-function call, kernels
compute what they computed, and the language is put back after each launch."""

import inspect

import pytest
import torch
from conftest import HAS_TRITON, INTERPRETER_PATCHES_ONCE

pytestmark = pytest.mark.skipif(not HAS_TRITON,
                                reason="triton is not installed (pip install 'graphattn[gpu]')")


if HAS_TRITON:
    import triton
    import triton.language as tl


def _scaled_sum(x, scale):  # a device function that calls one of tl's own (tl.sum)
    return total(tl.where(x > 0, x * scale, 0.0), axis=0)


def _repeat_kernel(x_ptr, out_ptr, CALLS: "tl.constexpr"):
    pid = tl.program_id(0)
    x = tl.load(x_ptr + pid * 8 + tl.arange(0, 8))
    total = 0.0
    for step in tl.static_range(CALLS):
        total += scaled_sum(x, step + 1.0)
    tl.store(out_ptr + pid, total)


@pytest.fixture
def run_kernel(triton_interpreter):
    # jitted here, with the interpreter on (triton.jit picks it when it decorates); the kernel
    # finds its device function among the module's globals, as Triton resolves names
    # (tl.sum again, as graphattn's kernels wrap it: the one tl holds is jitted in the mode of
    # triton's first import)
    global scaled_sum, total
    total = triton.jit(getattr(tl.sum, "fn", tl.sum))
    scaled_sum = triton.jit(_scaled_sum)
    kernel = triton.jit(_repeat_kernel)

    def run(calls: int) -> torch.Tensor:
        x = torch.linspace(-3, 4, 24).view(3, 8)
        out = torch.empty(3)
        kernel[(3,)](x, out, CALLS=calls)
        return x, out
    return run


@pytest.mark.skipif(not INTERPRETER_PATCHES_ONCE,
                    reason="this triton's interpreter is not built as the suite's change expects "
                           "(it is left unchanged and runs the kernels more slowly)")
def test_device_calls_reuse_the_launch_patch(run_kernel, monkeypatch):
    from triton.runtime import interpreter as ti

    def patching_count(calls: int) -> int:
        count = 0
        getmembers = inspect.getmembers

        def counted(*args, **kwargs):
            nonlocal count
            count += 1
            return getmembers(*args, **kwargs)

        monkeypatch.setattr(ti.inspect, "getmembers", counted)
        try:
            run_kernel(calls)
        finally:
            monkeypatch.setattr(ti.inspect, "getmembers", getmembers)
        return count

    patching_count(1)  # the first launch of a process also patches what its rewrite adds
    # 3 programs calling the device function 1 or 12 times: the same patching (stock: 12x)
    assert patching_count(12) == patching_count(1) > 0


def test_kernels_compute_as_before_and_the_language_is_put_back(run_kernel):
    import triton.language as tl

    where = tl.where
    x, out = run_kernel(4)
    want = x.clamp(min=0).sum(1) * (1 + 2 + 3 + 4)
    torch.testing.assert_close(out, want)
    assert tl.where is where  # the launch's patch undone
    assert tl.core.is_builtin(tl.where)
