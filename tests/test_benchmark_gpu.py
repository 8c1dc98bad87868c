"""``benchmarks/gpu.py`` before it meets a GPU: its correctness checks in Triton's interpreter.

The device time that runs the benchmark is short, so its first step, the fused kernels against
the reference backend (eager and compiled), is run here on a small CPU graph.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from graphattn.functional.triton_kernels import triton_available

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu  # noqa: E402


def test_device_checks_pass_in_the_interpreter(triton_interpreter):
    torch._dynamo.reset()
    graph = gpu.Graph("random", 12, gpu.synthetic_graph(12, 40, None, "cpu"))
    rows = gpu.check_on_device(graph, torch.float32, heads=2, channels=8,
                               compile_backend="aot_eager")
    names = [name for name, _ in rows]
    # eager and compiled; per score out, alpha, dq, dk, dv without bias, with it (+ dbias) and,
    # for dot and gatv2, with one edge term as key and value (+ dbias, dedge_term); gatv2 also
    # datt: dot 5 + 6 + 7, additive 5 + 6, gatv2 6 + 7 + 8
    assert len(names) == len(set(names)) == 2 * (18 + 11 + 21)
    assert "torch.compile, gatv2, bias, edge terms: dedge_term" in names
    assert sum(name.startswith("torch.compile") for name in names) == len(names) // 2
    bad = [row for row in rows if not row[1] < 1e-4]  # also NaN, which max() passes over
    assert not bad, bad


def test_every_method_runs_forward_and_backward_in_the_interpreter(triton_interpreter):
    """Each timed method builds and runs (inference, then forward+backward, with finite
    gradients) on a small CPU graph: a method that fails on the device costs device time.
    graphattn's methods give a gradient to every parameter or input they time; PyG's
    ``TransformerConv(root_weight=False)`` keeps an unused ``lin_skip``."""
    graph = gpu.Graph("random", 12, gpu.synthetic_graph(12, 40, None, "cpu"))
    for name, make in gpu.METHODS.items():
        case = make(graph, 2, 8, torch.float32)
        gpu._inference(case)
        gpu._train_step(case)
        grads = [t.grad for t in case.grad_of if t.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), name
        if not name.startswith("PyG"):
            assert len(grads) == len(case.grad_of), name


@pytest.mark.skipif(not triton_available(),
                    reason="triton is not installed (pip install 'graphattn[gpu]'): gpu.py stops")
def test_no_check_neither_checks_nor_reports_a_difference(monkeypatch, tmp_path, capsys):
    """With --no-check the log must not claim a fused-vs-reference difference of 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**37, 2**37))
    monkeypatch.setattr(gpu, "copy_bandwidth", lambda: 4.3e12)
    monkeypatch.setattr(gpu, "environment", lambda *a: ["- environment"])
    monkeypatch.setattr(gpu, "build_graph", lambda name, *a: (None, "not built in this test"))

    def no_check(*args, **kwargs):
        raise AssertionError("--no-check ran the device check")

    monkeypatch.setattr(gpu, "check_on_device", no_check)
    out = tmp_path / "gpu.md"
    assert gpu.main(["--no-check", "--graphs", "random-1m", "--out", str(out)]) == 0
    log = capsys.readouterr().out
    assert "max abs difference" not in log and "not checked (--no-check)" in log
    assert "Fused vs reference" not in out.read_text()
