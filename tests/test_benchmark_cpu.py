"""The CPU benchmarks' bookkeeping, on tiny inputs: what a failed worker or a method that is
not timed becomes in their tables."""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sparse_vs_dense  # noqa: E402
import vs_pyg  # noqa: E402


def test_vs_pyg_worker_crash_is_not_out_of_memory(monkeypatch, tmp_path):
    """A worker killed by a segfault is reported as a crash; a MemoryError stays out of memory."""
    script = tmp_path / "worker.py"
    monkeypatch.setattr(vs_pyg, "__file__", str(script))
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert vs_pyg.run_worker([], 12.0) == {"error": "crashed: SIGSEGV"}
    script.write_text("raise MemoryError\n")
    assert vs_pyg.run_worker([], 12.0) == {"error": "out of memory"}


def test_sparse_vs_dense_flex_backward_is_skipped_when_it_works():
    """FlexAttention has a forward only here: with a backward that works on the CPU (no
    bwd_error), the point still runs and says why there is no forward+backward time."""
    args = argparse.Namespace(heads=2, channels=4, dense_limit_gib=1.0, mem_limit_gib=4.0,
                              repeats=1, slow_factor=5.0, min_repeat_s=0.0, min_time_s=0.0,
                              max_repeats=1)
    flex = types.SimpleNamespace(bwd_error=None, compile_s=0.0,
                                 fn=lambda q, k, v, block_mask: q)  # compiled already
    n = 64
    point = sparse_vs_dense.Point("er", "tiny", n, sparse_vs_dense.with_self_loops(
        sparse_vs_dense.erdos_renyi(n, 4, 0), n))
    methods = [m for m in sparse_vs_dense.make_methods(point, args, flex, None, 0)
               if m.name.startswith("flex")]
    rows = sparse_vs_dense.run_point(point, methods, args, sparse_vs_dense.PeakMemory(), 0)
    for row in rows:
        assert row["fwd_reps"] > 0 and row["fwd_bwd_reps"] == 0
        assert row["skipped"].startswith("backward: "), row["skipped"]
