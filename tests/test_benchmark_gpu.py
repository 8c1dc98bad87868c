"""``benchmarks/gpu.py`` before it meets a GPU: its correctness checks in Triton's interpreter.

The device time that runs the benchmark is short, so its first step, the fused kernels against
the reference backend (eager and compiled), is run here on a small CPU graph.
"""

from __future__ import annotations

import csv
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_close

from graphattn.functional import edge_attention
from graphattn.functional import triton_blocks as tb
from graphattn.functional.triton_kernels import triton_available
from graphattn.graphs import window_graph

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import batched_global  # noqa: E402
import gpu  # noqa: E402
import gpu_density  # noqa: E402
import triton_tuning  # noqa: E402


def test_device_checks_pass_in_the_interpreter(triton_interpreter):
    torch._dynamo.reset()
    graph = gpu.Graph("random", 12, gpu.synthetic_graph(12, 40, None, "cpu"))
    rows = gpu.check_on_device(graph, torch.float32, heads=2, channels=8,
                               compile_backend="aot_eager")
    names = [name for name, _ in rows]
    # eager and compiled; per score out, alpha, dq, dk, dv without bias, with it (+ dbias) and,
    # for dot and gatv2, with one edge term as key and value (+ dbias, dedge_term); gatv2 also
    # datt; dot also with a bias and dropout drawn from a seed; dot and gatv2 also with a bias
    # and a soft cap; every score with a bias and sinks (+ dsinks): dot 5 + 6 + 7 + 6 + 6 + 7,
    # additive 5 + 6 + 7, gatv2 6 + 7 + 8 + 7 + 8
    assert len(names) == len(set(names)) == 2 * (37 + 18 + 36)
    assert "torch.compile, gatv2, bias, edge terms: dedge_term" in names
    assert "torch.compile, dot, bias, dropout: dk" in names
    assert "torch.compile, gatv2, bias, softcap: datt" in names
    assert "torch.compile, additive, bias, sinks: dsinks" in names
    assert sum(name.startswith("torch.compile") for name in names) == len(names) // 2
    bad = [row for row in rows if not row[1] < 1e-4]  # also NaN, which max() passes over
    assert not bad, bad


def test_layer_compile_device_check_passes_in_the_interpreter(triton_interpreter):
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False):  # as it comes
        rows = gpu.check_layer_compile_on_device("cpu", torch.float32, num_nodes=30,
                                                 num_edges=120, channels=8,
                                                 compile_backend="aot_eager")
    torch._dynamo.reset()
    names = [name for name, _ in rows]
    # out and the gradients of the 9 parameters (lin_q/k/v/out and their biases, lin_edge),
    # per mode
    assert len(names) == len(set(names)) == 2 * 10
    assert "layer, torch.compile default mode (1 graph): dlin_edge.weight" in names
    assert "layer, torch.compile fullgraph: out" in names
    bad = [row for row in rows if not row[1] < 1e-4]
    assert not bad, bad


def test_dense_device_checks_pass_on_cpu():
    """The dense paths' check needs no triton: on CPU it runs torch's CPU kernels, on a GPU
    SDPA's fused ones."""
    rows = gpu.check_dense_on_device("cpu", torch.float32, num_nodes=40, num_edges=200,
                                     channels=8)
    names = [name for name, _ in rows]
    # edge_attention: out, alpha, dq, dk, dv, dbias per score, gatv2 also datt; dense_attention
    # through SDPA: out, dq, dk, dv, with the weights: also alpha, and with grouped keys: out,
    # dq, dk, dv
    assert len(names) == len(set(names)) == 6 + 6 + 7 + 4 + 5 + 4
    assert "dense_attention (SDPA, grouped keys), empty rows: dk" in names
    assert "dense backend, gatv2, empty rows: datt" in names
    assert "dense_attention (weights), empty rows: alpha" in names
    bad = [row for row in rows if not row[1] < 1e-4]  # also NaN
    assert not bad, bad


def test_dense_device_check_sees_nan_that_reaches_an_output(monkeypatch):
    """An output or gradient that takes the NaN of an unread row fails the check."""
    import graphattn.functional

    dense_attention = graphattn.functional.dense_attention

    def leaky(q, k, v, mask, **kwargs):  # the NaN of unread v rows reaches out
        result = dense_attention(q, k, v, mask, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        out = out + v.sum() * 0
        return (out, result[1]) if isinstance(result, tuple) else out

    monkeypatch.setattr(graphattn.functional, "dense_attention", leaky)
    rows = gpu.check_dense_on_device("cpu", torch.float32, num_nodes=40, num_edges=200,
                                     channels=8)
    bad = {name for name, err in rows if not err < 1e-4}
    assert "dense_attention (SDPA), empty rows: out" in bad
    assert not any(name.startswith("dense backend") for name in bad)


def test_block_sparse_device_checks_pass_in_the_interpreter(triton_interpreter, monkeypatch):
    from graphattn.functional import triton_kernels as tk

    launches = []
    kernels = tk.kernels

    def counting():
        launches.append(1)
        return kernels()

    monkeypatch.setattr(tk, "kernels", counting)
    rows = gpu.check_blocks_on_device("cpu", torch.float32, num_nodes=70, radius=5,
                                      channels=8)
    names = [name for name, _ in rows]
    # per tile side: out, dq, dk, dv; + dbias; + alpha, dbias; + dbias (seeded dropout)
    assert len(names) == len(set(names)) == 2 * (4 + 5 + 6 + 5)
    assert "block-sparse 64, bias, seeded dropout: dv" in names
    assert "block-sparse 64, bias: dbias" in names
    assert "block-sparse 32, bias, dropout, weights: alpha" in names
    assert len(launches) == 2 * 4 * 2  # every check: the forward, then both backward kernels
    bad = [row for row in rows if not row[1] < 1e-4]
    assert not bad, bad


def test_block_sparse_forward_kernel_time_in_the_interpreter(triton_interpreter, monkeypatch):
    """The bandwidth figure of the block-sparse kernels times their forward kernel on a graph
    without a repeated edge, and gives None on one with (the CSR kernels ran)."""
    monkeypatch.setattr(gpu, "_time_ms", lambda fn: (fn(), 1.0)[1])
    args = gpu.parse_args(["--repeats", "2", "--warmup", "1", "--channels", "8", "--heads", "2"])
    window = gpu.Graph("window", 50, window_graph(50, 3))
    assert gpu.forward_kernel_ms(window, args, torch.float32, gpu.BLOCK_SPARSE) == 1.0
    repeated = gpu.Graph("repeated", 5, torch.tensor([[0, 0, 1], [1, 1, 2]]))
    assert gpu.forward_kernel_ms(repeated, args, torch.float32, gpu.BLOCK_SPARSE) is None


def test_every_method_runs_forward_and_backward_in_the_interpreter(triton_interpreter):
    """Each timed method builds and runs (inference, then forward+backward, with finite
    gradients) on a small CPU graph: a method that fails on the device costs device time.
    graphattn's methods give a gradient to every parameter or input they time; PyG's
    ``TransformerConv(root_weight=False)`` keeps an unused ``lin_skip``."""
    random = gpu.Graph("random", 12, gpu.synthetic_graph(12, 40, None, "cpu"))
    window = gpu.Graph("window", 40, window_graph(40, 3))  # the block-sparse kernels run
    for name, make in {**gpu.METHODS, **gpu.OPTIONAL_METHODS}.items():
        for graph in (random, window) if name.endswith("block-sparse") else (random,):
            case = make(graph, 2, 8, torch.float32)
            gpu._inference(case)
            gpu._train_step(case)
            grads = [t.grad for t in case.grad_of if t.grad is not None]
            assert grads and all(torch.isfinite(g).all() for g in grads), name
            if not name.startswith("PyG"):
                assert len(grads) == len(case.grad_of), name


def test_row_block_methods_run_their_backward_on_row_blocks(triton_interpreter, monkeypatch):
    """The row-block methods' training step launches every kernel, backward included, with
    their tile settings (the backward reads them when it launches: timed outside
    launch_tiles, it ran the default one-node kernels)."""
    from graphattn.functional import triton_kernels as tk

    random = gpu.Graph("random", 12, gpu.synthetic_graph(12, 40, None, "cpu"))
    names = [name for name in {**gpu.METHODS, **gpu.OPTIONAL_METHODS}
             if name.endswith("row blocks")]
    assert names
    config = tk.launch_config
    seen = []
    monkeypatch.setattr(tk, "launch_config",
                        lambda *a, **kw: seen.append(config(*a, **kw)) or seen[-1])
    for name in names:
        seen.clear()
        gpu._train_step({**gpu.METHODS, **gpu.OPTIONAL_METHODS}[name](random, 2, 8,
                                                                       torch.float32))
        assert len(seen) >= 2 and all(cfg.block_n == gpu.ROW_BLOCKS["block_n"]
                                      for cfg in seen), (name, seen)


def test_goals_for_every_kind_of_kernels():
    """The goals are read for the default (one-node) kernels, the row-block kernels and the
    block-sparse kernels alike, each row named by its kernels."""
    def result(graph, edges, method, **figures):
        return gpu.Result(graph, edges // 10, edges, method, **figures)

    results = [
        result("random-1m", 10**6, "GraphSelfAttention dot, triton", train_ms=4.0),
        result("random-1m", 10**6, "GraphSelfAttention dot, triton, row blocks", train_ms=2.0),
        result("random-1m", 10**6, "PyG TransformerConv", train_ms=10.0),
        result("local-50m", 5 * 10**7, "edge_attention triton", peak_percent=4.0,
               no_reuse_ceiling=8.16),
        result("local-50m", 5 * 10**7, "edge_attention triton, row blocks", peak_percent=55.0),
        result("window-50m", 50_000_019, "GraphSelfAttention dot, triton, block-sparse",
               train_mib=100.0),
        result("window-50m", 50_000_019, "PyG TransformerConv", train_mib=1000.0),
        result("window-50m", 50_000_019, "edge_attention triton, block-sparse",
               peak_percent=60.0),
    ]
    assert gpu.goals(results) == [
        "- random-1m: forward+backward 2.50x faster than TransformerConv (goal >= 3x: not met)",
        "- random-1m, row blocks: forward+backward 5.00x faster than TransformerConv "
        "(goal >= 3x: met)",
        "- window-50m, block-sparse: peak memory 10.0x lower than TransformerConv "
        "(goal >= 5x: met)",
        "- local-50m: forward kernel at 4% of peak HBM bandwidth (goal >= 50%: not met); "
        "with no reuse of a gathered k or v row through the cache, at most 8.2% by the "
        "minimal bytes",
        "- local-50m, row blocks: forward kernel at 55% of peak HBM bandwidth (goal >= 50%: met)",
        "- window-50m, block-sparse: forward kernel at 60% of peak HBM bandwidth "
        "(goal >= 50%: met)",
    ]


def test_profiles_go_into_the_table():
    """--profile's text ends the table, in a section of its own, one graph after the other."""
    profiles = ["## cora: N = 2,708\nhost ms per forward: median 1.000\n",
                "## pubmed: profile failed: RuntimeError: x\n"]
    text = gpu.render_markdown([], ["- header"], [], [], profiles)
    section = text.split("## Host profile of the fused op (--profile)\n", 1)[1]
    assert section.splitlines() == ["", "```", "cora: N = 2,708",
                                     "host ms per forward: median 1.000",
                                     "pubmed: profile failed: RuntimeError: x", "```"]
    assert "Host profile" not in gpu.render_markdown([], ["- header"], [], [])


def _measured_results():
    """Results as gpu.py measures them: values at the table's precision, a note with a |,
    methods out of memory or skipped."""
    return [
        gpu.Result("random-1m", 100_000, 1_000_000, "edge_attention triton", forward_ms=2.084,
                   train_ms=3.844, forward_mib=60.7, train_mib=292.0, kernel_ms=0.741,
                   bandwidth_gbs=287.0, peak_percent=6.0, copy_percent=6.8,
                   per_edge_percent=30.5),
        gpu.Result("random-1m", 100_000, 1_000_000, "GraphSelfAttention dot, triton",
                   forward_ms=2.238, train_ms=4.599, forward_mib=207.1, train_mib=438.5),
        gpu.Result("random-1m", 100_000, 1_000_000, "PyG TransformerConv", forward_ms=5.544,
                   train_ms=12.628, forward_mib=2163.7, train_mib=3088.4),
        gpu.Result("random-1m", 100_000, 1_000_000, "dense SDPA + mask",
                   note="the [N, N] mask needs about 57220 MiB, more than a quarter"),
        gpu.Result("random-50m", 2_000_000, 50_000_000, "GraphSelfAttention dot, triton",
                   forward_ms=34.18, train_ms=102.09, forward_mib=4655.4, train_mib=10019.2),
        gpu.Result("random-50m", 2_000_000, 50_000_000, "PyG TransformerConv",
                   forward_ms=261.351, forward_mib=102325.4, note="fwd+bwd out of memory"),
        gpu.Result("random-50m", 2_000_000, 50_000_000, "PyG GATConv", note="failed: a | b"),
    ]


def test_table_reads_back_as_written():
    """read_markdown gives back the header lines and every result of render_markdown's table,
    missing values and notes included; a table without the per-edge column (an earlier
    version's) reads too."""
    header = ["- device: NVIDIA H200; peak HBM bandwidth 4.80 TB/s",
              "- H = 4, C = 32, dtype fp32"]
    results = _measured_results()
    text = gpu.render_markdown(results, header, [("dot: out", 1e-6)], ["cora: no files"])
    assert gpu.read_markdown(text) == (header, results)
    earlier = """- device: NVIDIA H200
| graph | N | E | method | fwd ms | fwd+bwd ms | peak fwd MiB | peak fwd+bwd MiB \
| fwd kernel ms | GB/s | % peak HBM | % copy | note |
|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|
| cora | 2,708 | 10,556 | edge_attention triton | 1.061 | 2.081 | 1.5 | 7.2 | 0.112 | 51 \
| 1.1 | 1.2 |  |
| cora | 2,708 | 10,556 | dense SDPA + mask |  |  |  |  |  |  |  |  | out of memory |
"""  # a backslash at the end of a line joins it to the next
    assert gpu.read_markdown(earlier) == (["- device: NVIDIA H200"], [
        gpu.Result("cora", 2708, 10556, "edge_attention triton", forward_ms=1.061,
                   train_ms=2.081, forward_mib=1.5, train_mib=7.2, kernel_ms=0.112,
                   bandwidth_gbs=51.0, peak_percent=1.1, copy_percent=1.2),
        gpu.Result("cora", 2708, 10556, "dense SDPA + mask", note="out of memory")])
    with pytest.raises(ValueError, match="no table of benchmarks/gpu.py"):
        gpu.read_markdown("# something else\n")


def test_replot_draws_the_figure_of_a_table(tmp_path, capsys):
    """--replot reads a table and writes its figure beside it, without CUDA."""
    pytest.importorskip("matplotlib", reason="the figure needs matplotlib (the plot extra)")
    table = tmp_path / "gpu.md"
    table.write_text(gpu.render_markdown(_measured_results(), ["- device: NVIDIA H200; x",
                                                               "- date: 2026-12-01T00:36:38"],
                                         [], []))
    assert gpu.main(["--replot", str(table)]) == 0
    assert (tmp_path / "gpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {tmp_path / 'gpu.png'}" in capsys.readouterr().out


def test_plot_marks_the_bars_without_a_value(tmp_path, monkeypatch):
    """The layers and dense SDPA get bars, edge_attention alone does not; each missing bar is
    labelled by its note."""
    pytest.importorskip("matplotlib", reason="the figure needs matplotlib (the plot extra)")
    import matplotlib.axes

    labels, bars = [], []
    text, bar = matplotlib.axes.Axes.text, matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "text",
                        lambda self, x, y, s, *a, **k: labels.append(s) or text(self, x, y, s,
                                                                                *a, **k))
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda self, *a, label=None, **k: bars.append(label) or bar(
                            self, *a, label=label, **k))
    gpu.plot(_measured_results(), tmp_path / "gpu.png", [])
    assert bars == 2 * ["GraphSelfAttention dot, triton", "PyG TransformerConv",
                        "dense SDPA + mask", "PyG GATConv"]
    # per panel: dense skipped on random-1m; on random-50m, TransformerConv's fwd+bwd out of
    # memory, GATConv failed; dense not run there (no result, no label)
    assert labels == 2 * ["OOM", "skip", "failed: a |"]


def test_no_reuse_ceiling_worked_by_hand():
    """The ceiling of the minimal-bytes figure without reuse, on sizes worked by hand from
    the module docstring's formulas. N = 2, E = 5, H = 1, C = 2, fp32, dot: q, k, v, out
    2 * 1 * 8 * 4 = 64 bytes, lse 8, edge ids 20, row pointers 12: 104 minimal bytes; the
    three edges past the first two read k and v again, 3 * 4 * 4 = 48 more: 104 / 152.
    With one edge per node nothing is read twice (100%); the additive score reads one number
    of k per head: 2 * (2 + 4) * 4 = 48 + 40 = 88 minimal, 88 + 3 * 3 * 4 = 124 per edge.
    A graph of 100 bytes instead of its CSR: 64 + 8 + 100."""
    assert gpu.no_reuse_ceiling_percent(2, 5, 1, 2, 4, additive=False) == pytest.approx(
        100 * 104 / 152)
    assert gpu.no_reuse_ceiling_percent(5, 5, 1, 2, 4, additive=False) == 100.0
    assert gpu.no_reuse_ceiling_percent(2, 5, 1, 2, 4, additive=True) == pytest.approx(
        100 * 88 / 124)
    assert gpu.minimal_forward_bytes(2, 5, 1, 2, 4, additive=False, structure_bytes=100) == 172


def test_graph_bytes_take_the_smaller_of_the_csr_and_the_tile_layout():
    """S of the bandwidth formula: the block layout's row pointers, column ids and bit masks
    on a window graph (25 sources per target, far fewer bytes than 4 per edge); the CSR on a
    graph with a repeated edge, which the block kernels do not take."""
    window = gpu.Graph("window", 2000, window_graph(2000, 12))
    layout = tb.block_layout(window.edge_index, 2000, 2000, 32, False)
    tiles = layout.ptr.nbytes + layout.col.nbytes + layout.bits.nbytes
    assert gpu.graph_bytes(window) == tiles < 4 * window.num_edges
    repeated = gpu.Graph("random", 50, torch.tensor([[0, 0, 1], [1, 1, 2]]))
    assert gpu.graph_bytes(repeated) == 4 * 3 + 4 * 51


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


@pytest.mark.skipif(not triton_available(),
                    reason="triton is not installed (pip install 'graphattn[gpu]'): gpu.py stops")
def test_tf32_comes_on_after_the_check_and_only_picks_methods(monkeypatch, tmp_path,
                                                                request):
    """--tf32 lets fp32 products run as TF32 in the timings but not in the device check (which
    compares full fp32 products with the reference), and says so in the table's header;
    --only times the methods whose name holds one of its texts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**37, 2**37))
    # not monkeypatch: from pytest 9.2 it deletes, on undo, an attribute it did not find in the
    # object's __dict__, and torch keeps allow_tf32 behind __getattr__ / __setattr__
    tf32 = torch.backends.cuda.matmul.allow_tf32
    request.addfinalizer(lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", tf32))
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(gpu, "copy_bandwidth", lambda: 4.3e12)
    seen = {}

    def check(*args, **kwargs):
        seen.setdefault("check", torch.backends.cuda.matmul.allow_tf32)
        return [("a check", 0.0)]

    def measure(graph, args, *rest):
        seen["measure"] = (torch.backends.cuda.matmul.allow_tf32, args.methods)
        return []

    monkeypatch.setattr(gpu, "check_on_device", check)
    monkeypatch.setattr(gpu, "check_blocks_on_device", check)
    monkeypatch.setattr(gpu, "check_layer_compile_on_device", check)
    monkeypatch.setattr(gpu, "check_dense_on_device", check)
    monkeypatch.setattr(gpu, "build_graph",
                        lambda name, *a: (gpu.Graph(name, 3, torch.zeros(2, 1)), ""))
    monkeypatch.setattr(gpu, "measure_graph", measure)
    monkeypatch.setattr(gpu, "synthetic_graph", lambda *a: torch.zeros(2, 1))
    out = tmp_path / "gpu.md"
    argv = ["--graphs", "window-50m", "--out", str(out), "--tf32", "--only", "block-sparse",
            "--only", "edge_attention triton"]
    assert gpu.main(argv) == 0
    assert seen["check"] is False
    assert seen["measure"] == (True, (
        "edge_attention triton", "edge_attention triton, row blocks",
        "edge_attention triton, block-sparse", "edge_attention triton, block-sparse 64",
        "GraphSelfAttention dot, triton, block-sparse"))
    assert "fp32 matrix products as TF32 (--tf32)" in out.read_text()
    assert "methods: those whose name contains 'block-sparse', 'edge_attention triton'" in (
        out.read_text())
    with pytest.raises(SystemExit):
        gpu.parse_args(["--only", "no such method"])
    assert gpu.parse_args([]).methods == tuple(gpu.METHODS)
    # the dropout and softcap methods: only for a text that names their group
    dropout = gpu.parse_args(["--only", "dropout"]).methods
    assert len(dropout) == 3 and all("dropout" in name for name in dropout)
    assert gpu.parse_args(["--only", "softcap"]).methods == (
        "edge_attention triton, dot, softcap: none", "edge_attention triton, dot, softcap: 5.0",
        "edge_attention triton, gatv2, softcap: none",
        "edge_attention triton, gatv2, softcap: 5.0")
    assert gpu.parse_args(["--only", "sinks"]).methods == (
        "edge_attention triton, sinks: none", "edge_attention triton, sinks: learned")
    assert set(gpu.parse_args(["--only", "dropout", "--only", "softcap", "--only", "sinks"]
                              ).methods) == set(gpu.OPTIONAL_METHODS)
    assert not set(gpu.OPTIONAL_METHODS) & set(
        gpu.parse_args(["--only", "edge_attention triton"]).methods)


def test_softcap_methods_cap_as_named(triton_interpreter):
    """Each softcap method computes the op with its score, capped at its cap or not capped
    (and not the other way round)."""
    graph = gpu.Graph("random", 12, gpu.synthetic_graph(12, 40, None, "cpu"))
    for score in ("dot", "gatv2"):
        for cap, other in ((None, gpu.SOFTCAP), (gpu.SOFTCAP, None)):
            name = f"edge_attention triton, {score}, softcap: {cap or 'none'}"
            case = gpu.OPTIONAL_METHODS[name](graph, 2, 8, torch.float32)
            q, k, v, *att = case.grad_of
            assert len(att) == (score == "gatv2"), name
            with torch.no_grad():
                got = case.forward()
                want, uncapped_or_capped = (
                    edge_attention(q, k, v, graph.edge_index, score=score,
                                   att=att[0] if att else None, softcap=softcap,
                                   backend="reference") for softcap in (cap, other))
                assert_close(got, want)
                assert not torch.allclose(got, uncapped_or_capped, atol=1e-3), name


def test_sinks_methods_have_sinks_as_named(triton_interpreter):
    graph = gpu.Graph("random", 12, gpu.synthetic_graph(12, 40, None, "cpu"))
    plain = gpu.OPTIONAL_METHODS["edge_attention triton, sinks: none"](graph, 2, 8,
                                                                      torch.float32)
    case = gpu.OPTIONAL_METHODS["edge_attention triton, sinks: learned"](graph, 2, 8,
                                                                        torch.float32)
    assert len(plain.grad_of) == 3
    q, k, v, sinks = case.grad_of
    assert sinks.shape == (2,)
    with torch.no_grad():
        assert_close(case.forward(), edge_attention(q, k, v, graph.edge_index, sinks=sinks,
                                                    backend="reference"))
        assert not torch.allclose(case.forward(), edge_attention(q, k, v, graph.edge_index),
                                  atol=1e-3)


def test_dropout_methods_draw_their_masks_as_named(triton_interpreter):
    """The seeded method draws a new mask per call from torch's seed, as ``edge_attention``
    does; the read-mask one reads one mask drawn beforehand, the same at every call."""
    graph = gpu.Graph("random", 12, gpu.synthetic_graph(12, 40, None, "cpu"))
    seeded = gpu.OPTIONAL_METHODS["edge_attention triton, dropout: 0.1 seeded"](
        graph, 2, 8, torch.float32)
    read = gpu.OPTIONAL_METHODS["edge_attention triton, dropout: 0.1 read mask"](
        graph, 2, 8, torch.float32)
    plain = gpu.OPTIONAL_METHODS["edge_attention triton, dropout: none"](
        graph, 2, 8, torch.float32)
    with torch.no_grad():
        assert not torch.equal(seeded.forward(), seeded.forward())
        torch.manual_seed(2)
        got = seeded.forward()
        torch.manual_seed(2)
        assert torch.equal(got, edge_attention(*seeded.grad_of, graph.edge_index,
                                               dropout_p=0.1, backend="triton"))
        assert torch.equal(read.forward(), read.forward())
        undropped = edge_attention(*read.grad_of, graph.edge_index, training=False,
                                   backend="triton")
        assert not torch.allclose(read.forward(), undropped)
        assert torch.equal(plain.forward(), edge_attention(*plain.grad_of, graph.edge_index,
                                                           training=False, backend="triton"))


def test_tuning_candidates_start_with_the_default_tiles():
    Tiles = triton_tuning.Tiles
    every = triton_tuning.candidates(4, 32)
    assert every[0] == Tiles(16, 4, 4, 1)  # launch_config's for H = 4, C = 32
    assert Tiles(16, 4, 4, 16) in every  # a row-block candidate, with the default BLOCK_E
    assert [t for t in every if t.block_sparse] == [  # last, with the default BLOCK_E, BLOCK_H
        Tiles(16, 4, warps, 1, block) for block, warps in triton_tuning.BLOCK_SPARSE_CANDIDATES]
    two_heads = triton_tuning.candidates(2, 8)
    assert two_heads[0] == Tiles(32, 2, 1, 1)
    assert len(set(two_heads)) == len(two_heads)
    assert max(t.block_h for t in two_heads) == 2  # capped at H's power of 2


def test_tuning_times_every_candidate_in_the_interpreter(triton_interpreter, monkeypatch):
    """``benchmarks/triton_tuning.py`` before it meets a GPU: each candidate runs forward and
    forward+backward with its tiles, and its out is the default tiles' up to rounding."""
    graph = gpu.Graph("random", 8, gpu.synthetic_graph(8, 30, None, "cpu"))
    Tiles = triton_tuning.Tiles
    tiles = [Tiles(32, 2, 1, 1), Tiles(4, 1, 1, 1), Tiles(8, 2, 2, 4)]
    clock, timed, launched = iter(range(1, 1000)), [], []

    def timer(fn):
        fn()
        timed.append(launched[-1])
        return float(next(clock))

    def attend(*args, **kwargs):  # the tiles each call runs with
        cfg = triton_tuning.tk.launch_config(2, 8)
        launched.append(Tiles(cfg.block_e, cfg.block_h, cfg.num_warps, cfg.block_n))
        return edge_attention(*args, **kwargs)

    edge_attention = triton_tuning.edge_attention
    monkeypatch.setattr(triton_tuning, "edge_attention", attend)
    rows = triton_tuning.measure(graph, tiles, 2, 8, torch.float32, warmup=0, repeats=2,
                                 timer=timer)
    assert [r.tiles for r in rows] == tiles
    assert timed == [t for order in (tiles, tiles[1:] + tiles[:1]) for t in order for _ in "ft"]
    assert rows[0].max_diff == 0.0
    assert all(r.max_diff < 1e-5 and not r.note for r in rows), rows
    # the clock ticks once per timed call, fwd then fwd+bwd: repeat 0 runs the candidates in
    # order (ticks 1-6), repeat 1 from the second on (7-12)
    assert [r.forward_times for r in rows] == [[1, 11], [3, 7], [5, 9]]
    assert [r.train_times for r in rows] == [[2, 12], [4, 8], [6, 10]]
    table = triton_tuning.render_markdown(["- header"], rows, [])
    assert "| CSR | 1 | 32 | 2 | 1 | 6.000 | 7.000 | 1.00 | 1.00 | 0.0e+00 | default |" in table
    assert "| CSR | 1 | 4 | 1 | 1 | 5.000 | 6.000 | 0.83 | 0.86 |" in table
    assert "| CSR | 4 | 8 | 2 | 2 | 7.000 | 8.000 | 1.17 | 1.14 |" in table  # row blocks of 4
    assert ("fastest forward+backward: Tiles(block_e=4, block_h=1, num_warps=1, block_n=1, "
            "block_sparse=0) at 6.000 ms (0.86)") in table


def test_tuning_runs_block_sparse_candidates_on_graphs_that_suit_them(triton_interpreter,
                                                                     monkeypatch):
    """A block-sparse candidate runs the block kernels with its tiles and warps, forward and
    backward, on a window graph, with out the default tiles' up to rounding; on a graph with a
    repeated edge it is not run, and the table says why."""
    from graphattn.functional import triton_kernels as tk

    Tiles = triton_tuning.Tiles
    tiles = [Tiles(32, 2, 1, 1), Tiles(32, 2, 2, 1, 32), Tiles(32, 2, 8, 1, 64)]
    launches = []
    module = tk.kernels()

    class Launch:  # records the block kernels' launches: (name, BLOCK, num_warps)
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((self.name, kwargs["BLOCK"], kwargs["num_warps"]))
                return getattr(module, self.name)[grid](*args, **kwargs)
            return launch

    class Spy:
        def __getattr__(self, name):
            return Launch(name) if name.startswith("block_") else getattr(module, name)

    def timer(fn):
        fn()
        return 1.0

    monkeypatch.setattr(tk, "kernels", Spy)
    window = gpu.Graph("window", 70, window_graph(70, 3))
    rows = triton_tuning.measure(window, tiles, 2, 8, torch.float32, warmup=0, repeats=1,
                                 timer=timer)
    assert all(not r.note and r.max_diff < 1e-5 for r in rows), rows
    for block, warps in ((32, 2), (64, 8)):
        assert {name for name, b, w in launches if (b, w) == (block, warps)} == {
            "block_forward_kernel", "block_backward_target_kernel",
            "block_backward_source_kernel"}
    assert {(b, w) for _, b, w in launches} == {(32, 2), (64, 8)}

    repeated = window_graph(70, 3)
    repeated = gpu.Graph("repeated", 70, torch.cat([repeated, repeated[:, :1]], dim=1))
    launches.clear()
    rows = triton_tuning.measure(repeated, tiles, 2, 8, torch.float32, warmup=0, repeats=1,
                                 timer=timer)
    assert not launches and not rows[0].note
    assert all(r.note.startswith("not run: a repeated edge") for r in rows[1:])
    table = triton_tuning.render_markdown(["- header"], rows, [])
    assert "| block-sparse 64 |  |  |  | 8 | nan | nan | nan | nan | nan | not run:" in table


def test_tuning_measures_no_difference_when_the_default_tiles_fail(triton_interpreter,
                                                                   monkeypatch):
    """The table's differences are to the default tiles (the first candidate): when those
    fail, the other candidates are still timed, but no difference is given, not one to the
    first candidate that ran (which would read 0 to the default)."""
    graph = gpu.Graph("random", 8, gpu.synthetic_graph(8, 30, None, "cpu"))
    edge_attention = triton_tuning.edge_attention

    def attend(*args, **kwargs):  # the default tiles of this list fail
        if triton_tuning.tk.launch_config(2, 8).block_e == 32:
            raise RuntimeError("out of resources")
        return edge_attention(*args, **kwargs)

    def timer(fn):
        fn()
        return 1.0

    monkeypatch.setattr(triton_tuning, "edge_attention", attend)
    rows = triton_tuning.measure(graph, [(32, 2, 1, 1), (4, 1, 1, 1), (8, 2, 2, 1)], 2, 8,
                                 torch.float32, warmup=0, repeats=1, timer=timer)
    assert rows[0].note.startswith("failed: RuntimeError: out of resources")
    assert [r.forward_ms for r in rows[1:]] == [1.0, 1.0]
    assert all(math.isnan(r.max_diff) for r in rows), rows
    table = triton_tuning.render_markdown(["- header"], rows, [])
    assert "| CSR | 1 | 4 | 1 | 1 | 1.000 | 1.000 | nan | nan | nan |  |" in table


def test_batched_global_sparse_route_on_the_triton_kernels(triton_interpreter, tmp_path):
    """The GPU run of batched_global.py (--backend triton, as auto picks on CUDA): the routes
    agree with the fused kernels' sparse route, and --table-only writes the table alone."""
    out = tmp_path / "batched.md"
    batched_global.main(["--quick", "--repeats", "1", "--warmup", "0", "--backend", "triton",
                         "--table-only", "--output", str(out)])
    rows = [line.split(" | ") for line in out.read_text().splitlines()
            if line.startswith("| tiny")]
    assert [row[4] for row in rows] == list(batched_global.ROUTES)
    assert all(float(row[-1].rstrip(" |")) < 1e-5 for row in rows)  # max abs diff
    assert 'edge_attention(backend="triton")' in out.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batched.md"]


def test_batched_global_on_cuda_without_cuda_exits_with_a_message(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device here; nothing measured"):
        batched_global.main(["--device", "cuda", "--output", str(tmp_path / "b.md")])
    assert not list(tmp_path.iterdir())


def test_window_graphs_are_the_sequence_windows():
    """The window graphs: 25 sources per target (fewer at the ends), no repeated edge, so the
    block-sparse methods run on them; skipped with a reason when memory is short."""
    args = gpu.parse_args([])
    graph, reason = gpu.build_graph("window-1m", args, "cpu", free_bytes=2**40)
    assert reason == "" and graph.num_nodes == 40_007
    assert 25 * 40_007 - 12 * 13 == graph.num_edges  # 12 + 11 + ... + 1 missing at each end
    assert tb.block_layout(graph.edge_index, 40_007, 40_007, 32) is not None
    assert torch.equal(torch.bincount(graph.edge_index[1]).unique(),
                       torch.arange(13, 26))
    graph, reason = gpu.build_graph("window-wide-1m", args, "cpu", free_bytes=2**40)
    assert reason == "" and graph.num_nodes == 4_000
    assert 257 * 4_000 - 128 * 129 == graph.num_edges
    layout = tb.block_layout(graph.edge_index, 4_000, 4_000, 32)
    assert 0.85 < layout.fill(graph.num_edges) < 0.9  # against 26% for window-1m
    graph, reason = gpu.build_graph("window-50m", args, "cpu", free_bytes=2**20)
    assert graph is None and "MiB" in reason
    # each reaches the edges of its name, from which goals() judges the speed, memory and
    # bandwidth goals (1M, 10M, 50M edges)
    for name, (nodes, radius) in gpu.WINDOWS.items():
        edges = nodes * (2 * radius + 1) - radius * (radius + 1)
        assert edges >= {"1m": 10**6, "50m": 5 * 10**7}[name.rsplit("-", 1)[1]], name


def _session_commands() -> list[list[str]]:
    """The Python command lines of ``benchmarks/gpu_session.sh`` (after ``"$PY"``, up to their
    redirection), continuation lines joined, ``$OUT`` as ``OUT``."""
    import shlex

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"
    text = script.read_text().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or '"$PY"' not in line:
            continue
        command = line.split('"$PY"', 1)[1].split("2>&1")[0].replace('"$OUT', '"OUT')
        commands.append(shlex.split(command))
    return commands


def test_gpu_session_commands_parse():
    """Every benchmark that ``gpu_session.sh`` runs accepts its arguments, and the test files
    and test names it asks pytest for exist: a typo there would cost a step of a short device
    lease."""
    modules = {"benchmarks/gpu.py": gpu, "benchmarks/triton_tuning.py": triton_tuning,
               "benchmarks/batched_global.py": batched_global,
               "benchmarks/gpu_density.py": gpu_density}
    root = Path(__file__).resolve().parents[1]
    ran = []
    for command in _session_commands():
        if command[0] in modules:
            modules[command[0]].parse_args(command[1:])  # exits on an unknown argument
            ran.append(command[0])
        elif command[:2] == ["-m", "pytest"]:
            files = [arg for arg in command if arg.endswith(".py")]
            assert files and all((root / f).is_file() for f in files), files
            deselected = command[command.index("-k") + 1].removeprefix("not ")
            assert any(re.search(rf"def test_\w*{deselected}", (root / f).read_text())
                       for f in files), deselected  # -k matches parts of names
            ran.append("pytest")
        else:
            assert command[0] == "-c", command  # the version line
    assert sorted(set(ran)) == ["benchmarks/batched_global.py", "benchmarks/gpu.py",
                                "benchmarks/gpu_density.py", "benchmarks/triton_tuning.py",
                                "pytest"]
    assert ran.count("benchmarks/gpu.py") == 4


def test_gpu_session_writes_what_the_device_tool_brings_back():
    """The device tool brings back at most 8 files from $OUT: the session's log, each
    benchmark's table and what goes beside it (batched_global.py's .csv and .png unless
    --table-only, gpu.py's .png unless --no-plot; gpu.py's profile goes into its table) must
    fit, each under its own name."""
    files = ["session.log"]
    for command in _session_commands():
        if command[0].startswith("benchmarks/"):
            flag = "--output" if command[0] == "benchmarks/batched_global.py" else "--out"
            path = Path(command[command.index(flag) + 1])
            assert path.parent == Path("OUT"), command
            files.append(path.name)
            if command[0] == "benchmarks/batched_global.py" and "--table-only" not in command:
                files += [path.with_suffix(".csv").name, path.with_suffix(".png").name]
            if command[0] == "benchmarks/gpu.py" and "--no-plot" not in command:
                files.append(path.with_suffix(".png").name)
    assert len(files) == len(set(files)) <= 8, files


def _density_point(nodes, density, forward, train):
    """A measured point of gpu_density.py: (triton, dense) medians forward and fwd+bwd."""
    return gpu_density.Point(nodes, density, edges=1,
                             forward_ms=dict(zip(gpu_density.METHODS, forward, strict=True)),
                             train_ms=dict(zip(gpu_density.METHODS, train, strict=True)))


def test_density_crossover_is_where_dense_stays_as_fast():
    """The crossover is the lowest density from which the dense path is as fast as the
    kernels at every higher density measured: a single dense win below a loss is noise."""
    points = [_density_point(64, 0.5, (2.0, 1.0), (2.0, 1.0)),  # given out of order
              _density_point(64, 0.01, (1.0, 0.5), (1.0, 3.0)),
              _density_point(64, 0.1, (1.0, 2.0), (1.0, 1.0)),
              _density_point(128, 0.1, (1.0, 2.0), (1.0, 2.0)),
              gpu_density.Point(128, 0.5, note="skipped")]
    assert gpu_density.crossovers(points) == [
        "- N = 64: dense as fast as triton forward from density 0.5; forward+backward from "
        "density 0.1",
        "- N = 128: dense as fast as triton forward never up to 0.1; forward+backward never "
        "up to 0.1"]


def test_density_points_too_large_are_skipped_with_the_reason():
    args = gpu_density.parse_args(["--max-edges", "1000", "--heads", "4"])
    assert "more than --max-edges" in gpu_density.skip_reason(100, 0.5, args, None, 4)
    assert gpu_density.skip_reason(40, 0.5, args, None, 4) == ""  # 800 edges, no memory bound
    # dense: 6 * 4 heads * 40^2 * 4 bytes + 2 * 40^2 = 156,800 bytes, over half of 200,000
    assert "half the" in gpu_density.skip_reason(40, 0.5, args, 200_000, 4)
    with pytest.raises(SystemExit):
        gpu_density.parse_args(["--densities", "0,0.5"])


def test_density_sweep_runs_in_the_interpreter(triton_interpreter, tmp_path):
    """On CPU tensors, the triton backend in Triton's interpreter (a process of its own, with
    TRITON_INTERPRET=1; skipped where this triton's interpreter cannot run the kernels, as
    ``triton_interpreter`` says): two tiny graphs, both methods forward and forward+backward, the
    table, the csv and the plot written."""
    import subprocess

    out = tmp_path / "density.md"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_density.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--sizes", "8",
                           "--densities", "0.3,1", "--repeats", "1", "--warmup", "0",
                           "--heads", "2", "--channels", "8", "--out", str(out)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        table = list(csv.DictReader(f))
    assert [(row["N"], row["density"]) for row in table] == [("8", "0.3"), ("8", "1")]
    assert all(float(row[f"{m} fwd+bwd ms"]) > 0 for row in table for m in ("triton", "dense"))
    assert [row["E"] for row in table if row["density"] == "1"] == ["64"]
    assert "## Crossover" in out.read_text() and out.with_suffix(".png").is_file()
