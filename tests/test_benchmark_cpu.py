"""The CPU benchmarks' bookkeeping, on tiny inputs: what a failed worker or a method that is
not timed becomes in their tables."""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from conftest import assert_close, needs_triton, random_graph
from torch_geometric.data import Data

from graphattn import graphs
from graphattn.functional import select_backend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _child  # noqa: E402
import _report  # noqa: E402
import batched_global  # noqa: E402
import block_diagonal  # noqa: E402
import citation_accuracy  # noqa: E402
import dropout_cpu  # noqa: E402
import explicit_weights  # noqa: E402
import global_layers  # noqa: E402
import hop_distance  # noqa: E402
import hub_precision  # noqa: E402
import llama_window  # noqa: E402
import node_order  # noqa: E402
import random_walk_pe  # noqa: E402
import relative_bias  # noqa: E402
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


def test_sparse_vs_dense_marks_only_the_methods_left_unrepeated(tmp_path):
    """A method more than --slow-factor times slower than the fastest keeps its warm-up call
    alone, and its cell says so (¹); with --repeats 1 a repeated method also has one timed
    call, and is not marked."""
    args = argparse.Namespace(repeats=1, slow_factor=5.0, min_repeat_s=0.0, min_time_s=0.0,
                              max_repeats=1)

    def sleeper(seconds):
        return lambda: time.sleep(seconds)

    methods = [sparse_vs_dense.Method("fast", sleeper(0.002), sleeper(0.002)),
               sparse_vs_dense.Method("slow", sleeper(0.05), sleeper(0.05))]
    point = sparse_vs_dense.Point("er", "tiny", 4, torch.tensor([[0, 1], [1, 0]]))
    rows = sparse_vs_dense.run_point(point, methods, args, sparse_vs_dense.PeakMemory(), 0)
    by = {row["method"]: row for row in rows}
    assert by["fast"]["fwd_reps"] == by["slow"]["fwd_reps"] == 1
    assert not by["fast"]["fwd_once"] and not by["fast"]["fwd_bwd_once"]
    assert by["slow"]["fwd_once"] and by["slow"]["fwd_bwd_once"]


def test_citation_accuracy_row_of_a_run_diverged_at_its_first_epoch(monkeypatch):
    """The training loop stops at a non-finite loss, before any epoch is timed: the row's
    median epoch time is NaN, as summarise makes it (statistics.median raised on the empty
    list, which ended the whole benchmark)."""
    mask = torch.ones(4, dtype=torch.bool)
    data = Data(x=torch.randn(4, 3), edge_index=random_graph(4, 6),
                y=torch.tensor([0, 1, 0, 0]), train_mask=mask, val_mask=mask, test_mask=mask)

    class Diverging(torch.nn.Module):  # NaN logits in training mode
        def __init__(self, *args, **kwargs):
            super().__init__()
            self.logits = torch.nn.Parameter(torch.zeros(4, 2))

        def forward(self, x, edge_index):
            return self.logits * (math.nan if self.training else 1.0)

    monkeypatch.setattr(citation_accuracy, "load_planetoid", lambda *args, **kwargs: data)
    monkeypatch.setattr(citation_accuracy, "GAT", Diverging)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the worker's, not ours
    job = citation_accuracy.Job("Cora", citation_accuracy.DEFAULT_MODEL, 0, 10, 5, None)
    with pytest.warns(RuntimeWarning, match="training loss is nan at epoch 1"):
        row = citation_accuracy.run_job(job)
    assert (row["epochs"], row["selected_epoch"], row["test_acc"]) == (0, 0, 75.0)
    assert math.isnan(row["median_epoch_ms"])


def test_global_layers_agree_and_fill_the_table(tmp_path):
    """The three global attention layers, checked equal at dropout 0 inside the run, each get
    a step time and a ratio at dropout 0 and 0.3."""
    out = tmp_path / "layers.md"
    global_layers.main(["--quick", "--repeats", "1", "--warmup", "0", "--dropout", "0.3",
                        "--output", str(out)])
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["dropout"], r["layer"]) for r in rows] == [
        (p, layer) for p in ("0.0", "0.3") for layer in global_layers.LAYERS]
    assert all(float(r["step_ms"]) > 0 for r in rows)
    assert all(float(r["vs_graph_cpu"]) == 1.0 for r in rows if r["layer"] == "graph cpu")
    assert "global_layers.py --quick" in out.read_text()


def test_relative_bias_agrees_and_fills_the_table(tmp_path):
    """Every bias kind on every backend gets a step time and a ratio to the cpu kernels, after
    the run checked their outputs equal; the table names its command."""
    out = tmp_path / "bias.md"
    relative_bias.main(["--quick", "--repeats", "1", "--warmup", "0", "--output", str(out)])
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    assert cases == ["tiny-8x3-9, Graphormer", "causal-3x16, T5"]
    assert [(r["bias"], r["backend"]) for r in rows] == 2 * [
        (kind, backend) for kind in relative_bias.BIASES for backend in relative_bias.BACKENDS]
    assert all(float(r["step_ms"]) > 0 for r in rows)
    assert all(float(r["vs_cpu"]) == 1.0 for r in rows if r["backend"] == "cpu")
    assert "relative_bias.py --quick" in out.read_text()


@pytest.mark.parametrize("kind", ["learned", "rotary"])
def test_relative_bias_checks_the_backends_agree(monkeypatch, kind):
    """A backend that computed another function would stop the run before any timing."""
    case = relative_bias.cases(True, 2)[0]
    real = relative_bias.steps

    def skewed(*args, **kwargs):
        runs = real(*args, **kwargs)
        honest = runs[kind, "dense"]
        runs[kind, "dense"] = lambda: honest() + 1e-2
        return runs

    monkeypatch.setattr(relative_bias, "steps", skewed)
    with pytest.raises(AssertionError, match=f"bias {kind}: dense differs from cpu"):
        relative_bias.measure(case, 4, 2, repeats=1, warmup=0)


def test_relative_bias_rotates_by_each_nodes_position_in_its_graph():
    """RoPE's positions count along each graph's chain (0 at its first node) and along each
    causal sequence."""
    graphormer, t5 = relative_bias.cases(True, 2)
    ends = torch.nonzero(graphormer.positions == 0).flatten().tolist() + [graphormer.num_nodes]
    for start, stop in zip(ends[:-1], ends[1:], strict=True):
        assert torch.equal(graphormer.positions[start:stop], torch.arange(stop - start))
    assert len(ends) - 1 == 8  # the quick batch's 8 graphs
    assert torch.equal(t5.positions, torch.arange(16).repeat(3))


def test_explicit_weights_fills_the_table(tmp_path):
    """Each graph gets the three calls, a time on both backends, their ratio and auto's pick,
    which follows the floors of the rule (on a whole graph no dense below
    explicit_min_density; on blocks none below EXPLICIT_MIN_DENSITY_CPU_SMALL_BLOCKS in
    training nor below EXPLICIT_MIN_DENSITY_CPU_INFERENCE in inference)."""
    from graphattn.functional import attention

    out = tmp_path / "weights.md"
    explicit_weights.main(["--quick", "--rounds", "1", "--warmup", "0", "--out", str(out)])
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 * len(explicit_weights.CALLS)
    assert [r["call"] for r in rows[:3]] == list(explicit_weights.CALLS)
    for r in rows:
        assert float(r["dense_ms"]) > 0 and float(r["cpu_ms"]) > 0
        training = r["call"].startswith("training")
        if r["graph"].startswith("random-"):  # random-{nodes}-d{density}: a whole graph
            nodes = int(r["graph"].split("-")[1])
            floor = attention.explicit_min_density(nodes, nodes, training=training)
        else:
            floor = (attention.EXPLICIT_MIN_DENSITY_CPU_SMALL_BLOCKS if training
                     else attention.EXPLICIT_MIN_DENSITY_CPU_INFERENCE)
        assert r["auto"] in ("cpu", "dense")
        if float(r["density"]) < floor:
            assert r["auto"] == "cpu", r
    assert "explicit_weights.py --quick" in out.read_text()
    assert out.with_suffix(".png").stat().st_size > 0  # the figure, beside the table
    replot = tmp_path / "again.csv"
    replot.write_text(out.with_suffix(".csv").read_text())
    assert explicit_weights.main(["--replot", str(replot)]) == 0
    assert replot.with_suffix(".png").stat().st_size > 0


def test_batched_global_routes_agree_and_fill_the_table(tmp_path):
    """The five routes of global attention over a mini-batch compute the same outputs, and
    each gets its times, ratios and score count."""
    out = tmp_path / "batched.md"
    batched_global.main(["--quick", "--repeats", "1", "--warmup", "0", "--output", str(out)])
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    sizes = batched_global.batches(quick=True)[0].sizes
    assert [r["route"] for r in rows] == list(batched_global.ROUTES)
    groups = {}  # sizes in (2^(b-1), 2^b] by b
    for n in sizes:
        groups.setdefault(math.ceil(math.log2(n)), []).append(n)
    grouped = sum(len(g) * max(g) ** 2 for g in groups.values())
    # auto scores as the backend it takes for a forward+backward on this graph
    batch = batched_global.batches(quick=True)[0].batch
    pick = select_backend(torch.zeros(batch.numel(), 4, 16, requires_grad=True),
                          graphs.batch_complete_graph(batch))
    expected = {"sparse": sum(n * n for n in sizes), "loop": sum(n * n for n in sizes),
                "auto": grouped if pick == "dense" else sum(n * n for n in sizes),
                "padded": len(sizes) * max(sizes) ** 2,
                "grouped": sum(len(g) * max(g) ** 2 for g in groups.values())}
    for r in rows:
        assert float(r["max_abs_diff"]) < 1e-5
        assert float(r["fwd_ms"]) > 0 and float(r["fwd_bwd_ms"]) > 0
        assert int(r["scores_per_head"]) == expected[r["route"]], r["route"]
    assert float(rows[0]["fwd_vs_sparse"]) == 1.0
    assert "| tiny-8x3-9 | 8 |" in out.read_text()
    assert {r["auto_forward_backward"] for r in rows} == {pick}
    assert f"tiny-8x3-9 {rows[0]['auto_forward']} / {pick}" in out.read_text()


def test_batched_global_plot_names_the_device_it_ran_on(monkeypatch, tmp_path):
    # --device cuda without --table-only draws the plot too: its title must not say CPU
    import matplotlib.axes

    titles = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, label, *a, **k: titles.append(label))
    rows = [{"batch": "b", "route": route, "fwd_bwd_ms": 1.0} for route in batched_global.ROUTES]
    batched_global.plot(rows, tmp_path / "b.png", torch.device("cuda"))
    assert titles == ["Global attention per graph of a mini-batch (CUDA)"]


def test_sparse_vs_dense_citation_summary_with_the_reference_backend_skipped(monkeypatch,
                                                                             tmp_path):
    """With the reference backend skipped (--mem-limit-gib), the citation summary compares the
    dense methods with the cpu backend (min() over a NaN first gave NaN: "nan ms ... nanx")."""
    n = 64
    point = sparse_vs_dense.Point("citation", "Cora", n, sparse_vs_dense.with_self_loops(
        sparse_vs_dense.erdos_renyi(n, 4, 0), n))
    monkeypatch.setattr(sparse_vs_dense, "sweep_points", lambda args: ([point], []))
    monkeypatch.setattr(sparse_vs_dense, "check_methods_agree", lambda args, flex: None)
    monkeypatch.setattr(sparse_vs_dense, "plot", lambda *args: None)
    sparse_vs_dense.main(["--no-flex", "--heads", "2", "--channels", "4", "--repeats", "1",
                          "--min-time-s", "0", "--mem-limit-gib", "1e-9", "--out",
                          str(tmp_path)])
    summary = [line for line in (tmp_path / "sparse_vs_dense.md").read_text().splitlines()
               if line.startswith("- Cora: fastest sparse backend")]
    assert len(summary) == 2 and not any("nan" in line for line in summary), summary


def test_sparse_vs_dense_patterns_run_writes_its_own_table(monkeypatch, tmp_path):
    """--patterns times the sparse transformers' patterns (here at 64 and 128 positions) and
    writes sparse_vs_dense_patterns.* with its bar charts, every pattern in the table."""
    pattern_points = sparse_vs_dense.pattern_points
    monkeypatch.setattr(sparse_vs_dense, "pattern_points",
                        lambda seed: pattern_points(seed, sizes=(64, 128)))
    monkeypatch.setattr(sparse_vs_dense, "check_methods_agree", lambda args, flex: None)
    sparse_vs_dense.main(["--patterns", "--no-flex", "--heads", "2", "--channels", "4",
                          "--repeats", "1", "--min-time-s", "0", "--out", str(tmp_path)])
    text = (tmp_path / "sparse_vs_dense_patterns.md").read_text()
    for name in ("window-64-r64", "longformer-64-r64-g16", "bigbird-128-r64-g16-k3",
                 "causal-64"):
        assert f"| {name} |" in text
    for figure in ("time", "memory"):
        assert (tmp_path / f"sparse_vs_dense_patterns_{figure}.png").stat().st_size > 0
    assert not (tmp_path / "sparse_vs_dense.md").exists()


def test_sparse_vs_dense_patterns_are_the_unions_they_name():
    from graphattn import graphs

    points = {p.name: p for p in sparse_vs_dense.pattern_points(0, sizes=(256,))}
    window = graphs.to_dense_mask(points["window-256-r64"].edge_index, 256)
    longformer = graphs.to_dense_mask(points["longformer-256-r64-g16"].edge_index, 256)
    bigbird = graphs.to_dense_mask(points["bigbird-256-r64-g16-k3"].edge_index, 256)
    tokens = torch.arange(0, 256, 16)
    extra = longformer & ~window
    assert extra[tokens].any(dim=1).all() and extra[:, tokens].any(dim=0).all()
    assert torch.equal(longformer, window | graphs.to_dense_mask(
        graphs.global_token_graph(256, tokens), 256))
    assert (longformer & ~bigbird).sum() == 0
    assert 0 < (bigbird & ~longformer).sum() <= 3 * 256


def test_batched_global_rejects_no_timed_repeats(tmp_path, capsys):
    """--repeats 0 is refused before anything runs (it ran the warm-up, then ended in
    statistics.StatisticsError: no median for empty data)."""
    with pytest.raises(SystemExit):
        batched_global.main(["--quick", "--repeats", "0", "--output", str(tmp_path / "b.md")])
    assert "--repeats must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "b.md").exists()


def test_citation_validation_grid_refuses_what_it_cannot_run_before_training(monkeypatch,
                                                                             capsys):
    """PubMed is refused (the grid's "GAT paper" setting is Cora's and CiteSeer's, not
    PubMed's), and a dataset without its files stops the search before any run (a worker
    raised it only once the runs of the datasets before it were done, writing nothing)."""
    import citation_validation_grid as grid

    from graphattn.datasets import MissingFilesError

    def no_pool(*args, **kwargs):
        raise AssertionError("training started")

    def missing(name, root=None, **kwargs):
        if name == "CiteSeer":
            raise MissingFilesError("CiteSeer: missing ind.citeseer.x")

    monkeypatch.setattr(grid, "ProcessPoolExecutor", no_pool)
    monkeypatch.setattr(grid, "load_planetoid", missing)
    monkeypatch.setattr(sys, "argv", ["citation_validation_grid.py", "--datasets", "PubMed"])
    with pytest.raises(SystemExit):
        grid.main()
    assert "invalid choice: 'PubMed'" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["citation_validation_grid.py", "--datasets", "Cora",
                                      "CiteSeer"])
    with pytest.raises(SystemExit):
        grid.main()
    assert "CiteSeer: missing ind.citeseer.x" in capsys.readouterr().err


def test_citation_validation_grid_lead_of_runs_all_alike():
    """The lead is in standard errors of the paper setting's mean; where its runs all agree
    (no spread: two seeds can), a lead is infinite and no lead is 0, not a ZeroDivisionError
    after the whole grid ran."""
    import citation_validation_grid as grid

    assert grid.lead_in_standard_errors(82.0, [80.0, 81.0, 82.0]) == pytest.approx(
        1.0 / (1.0 / 3 ** 0.5))
    assert grid.lead_in_standard_errors(81.0, [80.0, 80.0]) == math.inf
    assert grid.lead_in_standard_errors(80.0, [80.0, 80.0]) == 0.0


def test_a_corrupt_dataset_file_ends_the_run_by_name(monkeypatch, capsys):
    """A raw file whose checksum differs stops the benchmarks with its message, as a missing
    one does: not with a traceback (and citation_accuracy does not skip it, as it skips a
    dataset without files)."""
    import citation_validation_grid as grid

    from graphattn.datasets import ChecksumError

    def corrupt(name, root=None, **kwargs):
        raise ChecksumError(f"{name}: ind.cora.y has SHA-256 00, expected 11")

    for module in (grid, citation_accuracy, sparse_vs_dense):
        monkeypatch.setattr(module, "load_planetoid", corrupt)
    monkeypatch.setattr(sys, "argv", ["citation_validation_grid.py", "--datasets", "Cora"])
    with pytest.raises(SystemExit):
        grid.main()
    assert "ind.cora.y has SHA-256 00" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["citation_accuracy.py", "--datasets", "Cora"])
    with pytest.raises(SystemExit, match="ind.cora.y has SHA-256 00.*no results written"):
        citation_accuracy.main()
    args = argparse.Namespace(quick=True, patterns=False, seed=0, data_root=None,
                              download=False)
    with pytest.raises(SystemExit, match="Cora: Cora: ind.cora.y has SHA-256 00"):
        sparse_vs_dense.sweep_points(args)


def test_call_in_child_reports_each_way_a_call_ends():
    """A result (one larger than a pipe's buffer: read while the child runs, not after it
    exits), a timeout, a failed allocation under the address-space limit (Python's and
    torch's), another error, and a child that dies without a word."""
    status, value = _child.call_in_child(os.urandom, (50_000_000,), 60)
    assert status == "ok" and len(value) == 50_000_000
    t0 = time.perf_counter()
    assert _child.call_in_child(time.sleep, (60,), 0.5) == ("timeout", None)
    assert time.perf_counter() - t0 < 30
    limit = 16 * 2**30
    assert _child.call_in_child(bytearray, (2 * limit,), 60, memory_limit=limit) == (
        "out of memory", None)
    assert _child.call_in_child(torch.empty, (2 * limit,), 60, memory_limit=limit) == (
        "out of memory", None)
    status, value = _child.call_in_child(torch.zeros, ((-1,),), 60)
    # torch 2.13: "... must be non-negative ..."; 2.8: "... negative dimension -1 ..."
    assert status.startswith("failed: ") and "negative" in status and value is None
    with pytest.raises(RuntimeError, match="abort exited with -6 and no result"):
        _child.call_in_child(os.abort, (), 60)


def test_random_walk_pe_benchmark_fills_its_table(monkeypatch, tmp_path):
    """Both encodings timed at every repeat, in agreement; the ratio is PyG's median time over
    graphattn's. (Each call is a fresh process: one small graph keeps this short.)"""
    from graphattn import graphs

    grid = random_walk_pe.Case("grid-3x4", graphs.grid_graph(3, 4), 12)
    monkeypatch.setattr(random_walk_pe, "cases", lambda quick, root: [grid])
    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["random_walk_pe.py", "--quick", "--repeats", "2",
                                      "--ks", "5"])
    random_walk_pe.main()
    with open(tmp_path / "random_walk_pe_quick.csv") as f:
        (row,) = list(csv.DictReader(f))
    ours, theirs = (grid.times[(5, m)] for m in random_walk_pe.METHODS)
    assert len(ours) == len(theirs) == 2
    assert row["PyG / graphattn"] == f"{statistics.median(theirs) / statistics.median(ours):.1f}x"
    assert float(row["max difference"]) < 1e-6
    edges = grid.edge_index.size(1)
    assert f"| grid-3x4 | 12 | {edges} | 5 |" in (tmp_path / "random_walk_pe_quick.md").read_text()


def test_hop_distance_benchmark_fills_its_table(monkeypatch, tmp_path):
    """Every method timed at every repeat, their distances compared (a disconnected graph and
    a max_distance, so -1 is read too); networkx skipped past its pair limit, by name."""
    from graphattn import graphs

    two_chains = torch.cat([graphs.chain_graph(5), graphs.chain_graph(4) + 5], dim=1)
    small = hop_distance.Case("two chains", two_chains, 9, graphs.complete_graph(9), 3)
    big = hop_distance.Case("grid", graphs.grid_graph(4, 4), 16,
                            graphs.grid_graph(4, 4, radius=2), None)
    monkeypatch.setattr(hop_distance, "cases", lambda quick, root: [small, big])
    monkeypatch.setattr(_report, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["hop_distance.py", "--quick", "--repeats", "2",
                                      "--networkx-max-pairs", "100"])
    hop_distance.main()
    with open(tmp_path / "hop_distance_quick.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["same distances"] for r in rows] == ["yes", "yes"]
    assert (small.results["SciPy"] == -1).any() and (small.results["SciPy"] == 3).any()
    assert all(len(small.times[m]) == 2 for m in hop_distance.METHODS)
    ours, scipy_times = small.times["graphattn"], small.times["SciPy"]
    ratio = statistics.median(scipy_times) / statistics.median(ours)
    assert rows[0]["SciPy / graphattn"] == f"{ratio:.1f}x"
    assert "networkx" not in big.times
    assert rows[1]["networkx s"] == "skipped (> 100 pairs)"
    assert rows[1]["networkx / graphattn"] == ""
    # a method that disagrees is reported, not hidden
    wrong = hop_distance.scipy_distances
    monkeypatch.setattr(hop_distance, "scipy_distances", lambda case: wrong(case) + 1)
    small.times.clear()
    big.times.clear()
    hop_distance.main()
    with open(tmp_path / "hop_distance_quick.csv") as f:
        assert [r["same distances"] for r in csv.DictReader(f)] == ["NO", "NO"]


def test_hub_precision_benchmark_fills_its_table(tmp_path):
    out = tmp_path / "hub.md"
    assert hub_precision.main(["--edges", "300", "20000", "--triton-edges", "--out",
                               str(out)]) == 0
    with open(out.with_suffix(".csv")) as f:
        rows = {(int(row["E"]), row["method"]): row for row in csv.DictReader(f)}
    methods = (*hub_precision.BACKENDS, "PyG softmax + scatter")
    assert set(rows) == {(E, m) for E in (300, 20000) for m in methods}
    error = {key: float(row["out error"]) for key, row in rows.items()}
    # the blocked float64 sums, against one running fp32 sum (2.5e-6 against 4e-8 at 10^4)
    assert error[20000, "cpu"] * 10 < error[20000, "reference"]
    assert error[20000, "reference"] == pytest.approx(error[20000, "PyG softmax + scatter"],
                                                      rel=0.5)
    assert all(0 <= e < 1e-3 for e in error.values())
    assert "| 20000 | cpu |" in out.read_text()
    assert out.with_suffix(".png").stat().st_size > 0
    replot = tmp_path / "again.csv"
    replot.write_text(out.with_suffix(".csv").read_text())
    assert hub_precision.main(["--replot", str(replot)]) == 0
    assert replot.with_suffix(".png").stat().st_size > 0


def test_hub_precision_replot_refuses_what_it_did_not_write(tmp_path, capsys):
    for path, message in ((tmp_path / "hub.md", "takes the .csv a run wrote"),
                          (tmp_path / "none.csv", "no such file")):
        with pytest.raises(SystemExit):
            hub_precision.main(["--replot", str(path)])
        assert message in capsys.readouterr().err
    other = tmp_path / "other.csv"
    other.write_text("E,method\n10,cpu\n")
    with pytest.raises(SystemExit):
        hub_precision.main(["--replot", str(other)])
    assert "not a table this script wrote" in capsys.readouterr().err


def test_hub_precision_benchmark_runs_the_triton_backend(tmp_path, triton_interpreter):
    """The triton rows, in Triton's interpreter: the fused kernels against the reference
    backend in float64, on a hub small enough for the interpreter."""
    out = tmp_path / "hub.md"
    assert hub_precision.main(["--edges", "40", "300", "--triton-edges", "300",
                               "--out", str(out)]) == 0
    with open(out.with_suffix(".csv")) as f:
        rows = {(int(row["E"]), row["method"]): row for row in csv.DictReader(f)}
    for method in (hub_precision.triton_method(hub, "interpreter") for hub in (True, False)):
        assert (40, method) not in rows
        for name in ("out error", "abs(sum alpha - 1)", "grad q error"):
            assert 0 <= float(rows[300, method][name]) < 1e-5, (method, name, rows[300, method])
        assert f"| 300 | {method} |" in out.read_text()


def test_hub_precision_benchmark_wants_a_gpu_for_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        hub_precision.main(["--triton-device", "cuda", "--out", str(tmp_path / "hub.md")])
    assert "--triton-device cuda needs a CUDA device" in capsys.readouterr().err


# Runs a script with `import triton` refused, as in an install without the gpu extra.
WITHOUT_TRITON = ("import runpy, sys; sys.modules['triton'] = None; sys.argv = sys.argv[1:]; "
                  "runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.mark.parametrize("script", ["host_overhead", "triton_resources"])
def test_triton_benchmarks_say_that_they_need_triton(script):
    """Without triton the benchmarks that time the triton backend's host work or compile its
    kernels stop with a message that names the extra to install, not a traceback."""
    import subprocess

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{script}.py"
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "needs triton: pip install 'graphattn[gpu]'" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


@needs_triton
def test_host_overhead_benchmark_fills_its_table(tmp_path):
    """In a process of its own (it stubs out the Triton kernels of that process): one round
    of one call per case, every case in the table, with its operators counted."""
    import subprocess

    out = tmp_path / "host.md"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "host_overhead.py"
    done = subprocess.run([sys.executable, str(script), "--rounds", "1", "--inner", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    calls = {row["call"] for row in rows}
    assert calls == {"edge_attention triton", "GraphSelfAttention dot, triton",
                     "GraphSelfAttention additive, triton", "GraphSelfAttention gatv2, triton",
                     "PyG TransformerConv", "PyG GATConv", "PyG GATv2Conv"}
    assert len(rows) == 2 * len(calls)
    for row in rows:
        assert float(row["host us"]) > 0
        assert int(row["operators that compute"]) > 0
        # the former route (Function.apply) is timed for graphattn's calls only
        ours = not row["call"].startswith("PyG")
        assert bool(row["host us through Function.apply"]) == ours == bool(row["ratio"])
    steps = {(row["call"], row["step"]): int(row["operators that compute"]) for row in rows}
    for call in calls:  # backward adds operators
        assert steps[call, "forward+backward"] > steps[call, "forward"]
    assert "| edge_attention triton | forward |" in out.read_text()


def test_sparse_features_benchmark_fills_its_table(tmp_path):
    """In a process of its own (it sets the torch threads and swaps the models' projection):
    one warm-up and one timed step of each way and model on Cora, every way in the table, the
    ratios against the F.linear way of the same model."""
    import subprocess

    out = tmp_path / "sparse.md"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sparse_features.py"
    done = subprocess.run([sys.executable, str(script), "--rounds", "1", "--warmup", "1",
                           "--datasets", "Cora", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        table = list(csv.DictReader(f))
    ways = ["dense features", "sparse CSR, F.linear", "sparse CSR, sparse_linear"]
    assert [(row["model"], row["way"]) for row in table] == [
        (model, way) for model in ("GAT", "GraphTransformer") for way in ways]
    for model in ("GAT", "GraphTransformer"):
        rows = {row["way"]: row for row in table if row["model"] == model}
        assert all(row["features"] == "2708 x 1433, 1.27% nonzero" for row in rows.values())
        assert rows["sparse CSR, F.linear"]["ratio to sparse CSR, F.linear"] == "1.00"
        for row in rows.values():
            ratio = float(row["step ms"]) / float(rows["sparse CSR, F.linear"]["step ms"])
            assert float(row["ratio to sparse CSR, F.linear"]) == pytest.approx(ratio, abs=0.02)
    assert "command: `python benchmarks/sparse_features.py --rounds 1" in out.read_text()


def test_dropout_benchmark_fills_its_table(tmp_path):
    """In a process of its own (it sets the torch threads and swaps the masks' draw): one
    warm-up and one timed round of one mask size, of the GAT and GraphTransformer steps on
    Cora and of edge_attention on a small random graph, every way in the table, and the ratios
    against the baseline of each part."""
    import subprocess

    out = tmp_path / "dropout.md"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "dropout_cpu.py"
    done = subprocess.run([sys.executable, str(script), "--rounds", "1", "--warmup", "1",
                           "--datasets", "Cora", "--masks", "Cora attention 13264x8",
                           "--graph-nodes", "300", "--graph-edges", "3000",
                           "--graph-rounds", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        rows = [(row["part"], row["case"], row["way"], row) for row in csv.DictReader(f)]
    graph = "random graph, 300 nodes, 3000 edges"
    assert [r[:3] for r in rows] == [
        ("mask", "Cora attention 13264x8", "graphattn"),
        ("mask", "Cora attention 13264x8", "torch.rand >= p"),
        ("mask", "Cora attention 13264x8", "F.dropout"),
        ("GAT step", "Cora", "graphattn"),
        ("GAT step", "Cora", "graphattn, attention mask in memory"),
        ("GAT step", "Cora", "torch.rand >= p"),
        ("edge_attention", graph, "graphattn"), ("edge_attention", graph, "mask in memory"),
        ("edge_attention", graph, "no dropout"),
        ("GraphTransformer step", "Cora", "graphattn"),
        ("GraphTransformer step", "Cora", "torch.nn.Dropout")]
    for part, baseline in (("mask", "torch.rand >= p"), ("GAT step", "torch.rand >= p"),
                           ("edge_attention", "mask in memory"),
                           ("GraphTransformer step", "torch.nn.Dropout")):
        group = {way: row for p, _, way, row in rows if p == part}
        base = float(group[baseline]["ms"])
        assert group[baseline]["ratio to baseline"] == "1.00"
        for row in group.values():
            assert float(row["ratio to baseline"]) == pytest.approx(
                float(row["ms"]) / base, abs=0.02)
    assert "command: `python benchmarks/dropout_cpu.py --rounds 1" in out.read_text()


def test_dropout_benchmark_refuses_an_unknown_mask_size(capsys):
    with pytest.raises(SystemExit):
        dropout_cpu.parse_args(["--masks", "1M entries"])
    assert "--masks: unknown size '1M entries'" in capsys.readouterr().err


def test_one_head_benchmark_fills_its_table(tmp_path):
    """In a process of its own (it sets the torch threads and swaps the kernels' head count):
    one warm-up and one timed round on Cora with one channel count, every call in the table,
    and each ratio the quotient of its two times."""
    import subprocess

    out = tmp_path / "heads.md"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_one_head.py"
    # one score: each costs four kernel compiles per head setting on a cold cache
    done = subprocess.run([sys.executable, str(script), "--rounds", "1", "--warmup", "1",
                           "--datasets", "Cora", "--channels", "8", "--scores", "dot",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    assert [(row["call"], row["step"]) for row in rows] == [
        ("edge_attention dot, C = 8", "forward"), ("edge_attention dot, C = 8", "forward+backward"),
        ("GAT training step (output layer: 1 head)", "step")]
    assert all(row["graph"] == "Cora (13264 edges)" for row in rows)
    for row in rows:
        ratio = (float(row["one head compiled as a constant ms"])
                 / float(row["heads read at run time ms"]))
        assert float(row["ratio"]) == pytest.approx(ratio, abs=0.02)
    assert "command: `python benchmarks/cpu_one_head.py --rounds 1" in out.read_text()


def test_specialisation_benchmark_fills_its_table(tmp_path):
    """In a process of its own (it sets the torch threads and the kernels' switches): one
    warm-up and one timed round of one score on Cora both ways, each ratio the quotient of its
    two times. (Its compile sweep, a fresh numba cache per way, is left out: it would compile
    the kernels twice over.)"""
    import subprocess

    out = tmp_path / "specialisation.md"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_specialisation.py"
    done = subprocess.run([sys.executable, str(script), "--rounds", "1", "--warmup", "1",
                           "--datasets", "Cora", "--scores", "dot", "--steps", "none",
                           "--compile-scores", "none", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    case = "edge_attention dot, 8 heads x 8 channels, bias"
    assert [(row["measure"], row["call"], row["step"]) for row in rows] == [
        ("time", case, "forward"), ("time", case, "forward+backward")]
    for row in rows:
        constant, run_time = (float(row[way].removesuffix(" ms")) for way in (
            "compiled per option set", "options read at run time"))
        assert float(row["ratio"]) == pytest.approx(run_time / constant, abs=0.02)
    assert "command: `python benchmarks/cpu_specialisation.py --rounds 1" in out.read_text()


def test_specialisation_benchmark_refuses_an_unknown_step(capsys):
    import cpu_specialisation

    with pytest.raises(SystemExit):
        cpu_specialisation.parse_args(["--steps", "gcn"])
    assert "--steps takes gat and transformer, got 'gcn'" in capsys.readouterr().err


def test_compile_benchmark_fills_its_table(tmp_path):
    """In a process of its own (it sets the torch threads): one warm-up and one timed step of
    each way on Cora, compiled by dynamo alone (``--compile-backend eager``: inductor's C++
    build would take the suite's time), every way in the table, the inference ways' ratios
    against the eager inference."""
    import subprocess

    out = tmp_path / "compile.md"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_cpu.py"
    done = subprocess.run([sys.executable, str(script), "--rounds", "1", "--warmup", "1",
                           "--compile-backend", "eager", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # past the limit dynamo would run the later ways' frames eagerly
    assert "recompile_limit" not in done.stderr
    with open(out.with_suffix(".csv")) as f:
        rows = {row["way"]: row for row in csv.DictReader(f)}
    assert list(rows) == ["eager", "compiled", "compiled, fallback_random",
                          "compiled, loops dropped", "compiled fullgraph",
                          "compiled fullgraph, fallback_random", "eager, sparse features",
                          "compiled, fallback_random, sparse features", "eager, inference",
                          "compiled fullgraph, inference"]
    assert all(float(row["step ms"]) > 0 for row in rows.values())
    for way in ("eager", "eager, inference"):  # each kind of step against its own eager one
        assert rows[way]["ratio to eager"] == "1.00"
    ratio = float(rows["compiled fullgraph, inference"]["step ms"]) / float(
        rows["eager, inference"]["step ms"])
    assert float(rows["compiled fullgraph, inference"]["ratio to eager"]) == pytest.approx(
        ratio, abs=0.02)
    assert rows["compiled"]["graphs of the forward"] == "1"  # the self-loops, masked in place
    assert rows["compiled, fallback_random"]["graphs of the forward"] == "1"
    assert int(rows["compiled, loops dropped"]["graphs of the forward"]) > 1
    assert rows["compiled fullgraph"]["graphs of the forward"] == "1"
    assert rows["compiled fullgraph, fallback_random"]["graphs of the forward"] == "1"
    # the frames that hold the sparse features run eagerly, the rest in graphs
    assert int(rows["compiled, fallback_random, sparse features"]["graphs of the forward"]) >= 1
    assert "backend eager" in out.read_text()


def test_block_diagonal_sweep_fills_its_table_and_replots(tmp_path):
    """A small sweep: every graph on its side, both phases, crossovers, auto's pick; then the
    figure drawn again from the .csv alone."""
    pytest.importorskip("matplotlib", reason="the figure needs the 'plot' extra")
    out = tmp_path / "blocks.md"
    block_diagonal.main(["--quick", "--nodes", "256", "--rounds", "1", "--warmup", "0",
                         "--out", str(out)])
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["pattern"] for r in rows} == {"window", "random", "causal", "complete"}
    assert {r["phase"] for r in rows} == {"forward", "forward+backward"}
    for r in rows:
        assert int(r["L"]) * int(r["B"]) == 256
        density = int(r["edges"]) / (int(r["B"]) * int(r["L"]) ** 2)
        assert float(r["block density"]) == pytest.approx(density, abs=1e-4)
        cpu_ms, dense_ms = float(r["cpu ms"]), float(r["dense ms"])  # rounded to 0.01
        low = cpu_ms - 0.005  # the smallest cpu time that rounds to cpu_ms: the largest error
        rounding = 0.005 * (1 + dense_ms / low) / low + 0.0005
        assert dense_ms / cpu_ms == pytest.approx(float(r["dense / cpu"]), abs=rounding)
        assert r["auto picks"] in ("cpu", "dense")
    causal = [r for r in rows if r["pattern"] == "causal"]
    assert all(float(r["block density"]) > 0.5 for r in causal)  # L (L + 1) / 2 of L^2
    text = out.read_text()
    assert "| 64 | window | forward+backward |" in text  # the crossover summary
    out.with_suffix(".png").unlink()
    block_diagonal.main(["--replot", str(out.with_suffix(".csv"))])
    assert out.with_suffix(".png").stat().st_size > 0


def test_block_diagonal_times_each_window_graph_once(tmp_path):
    """Blocks of 16 round the densities 0.03, 0.06 and 0.12 to one window radius (0): that
    graph is timed once, not three times as three points of the sweep."""
    out = tmp_path / "blocks.md"
    block_diagonal.main(["--sizes", "16", "--nodes", "64", "--rounds", "1", "--warmup", "0",
                         "--no-plot", "--out", str(out)])
    with out.with_suffix(".csv").open() as f:
        window = [(r["phase"], r["edges"]) for r in csv.DictReader(f) if r["pattern"] == "window"]
    assert len(window) == len(set(window)) == 2 * 3, window  # radii 0, 2 and 4, two phases


def test_block_diagonal_refuses_a_size_that_does_not_divide_the_nodes(capsys):
    with pytest.raises(SystemExit):
        block_diagonal.main(["--nodes", "100", "--sizes", "64"])
    assert "--sizes" in capsys.readouterr().err


def test_dropout_benchmark_mask_in_memory_is_the_kernels_mask():
    """The ``mask in memory`` way reads the mask the kernels draw for the same seed: the same
    output, so the two ways time the same computation."""
    from graphattn.functional import edge_attention
    from graphattn.functional.cpu import cpu_edge_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(30, 2, 8, generator=gen) for _ in range(3))
    edge_index = torch.randint(0, 30, (2, 200), generator=gen)
    torch.manual_seed(1)
    want = edge_attention(q, k, v, edge_index, dropout_p=0.6, backend="cpu")
    from graphattn.functional.dropout import seeded_mask_parameters
    torch.manual_seed(1)
    parameters = seeded_mask_parameters(0.6, device="cpu")
    options = dict(scale=8**-0.5, bias=None, score="dot", negative_slope=0.2, need_alpha=False)
    got, _ = dropout_cpu.mask_in_memory(None)(q, k, v, edge_index, dropout_mask=parameters,
                                              **options)
    assert torch.equal(got, want)
    former, _ = dropout_cpu.mask_in_memory(dropout_cpu.former_mask)(
        q, k, v, edge_index, dropout_mask=parameters, **options)
    undropped, _ = cpu_edge_attention(q, k, v, edge_index, dropout_mask=None, **options)
    assert not torch.allclose(former, want) and not torch.allclose(former, undropped)


@pytest.mark.parametrize("parse, argv, message", [
    (batched_global.parse_args, ["--device", "bogus"], "not a torch device: 'bogus'"),
    (batched_global.parse_args, ["--warmup", "-1"], "--warmup must be >= 0"),
    (global_layers.parse_args, ["--warmup", "-5", "--repeats", "1"], "--warmup must be >= 0"),
    (block_diagonal.parse_args, ["--sizes", "16,x"], "--sizes must be comma-separated"),
    (block_diagonal.parse_args, ["--replot", "table.md"], "--replot takes the .csv"),
    (block_diagonal.parse_args, ["--replot", "missing.csv"], "--replot: no such file"),
    (explicit_weights.main, ["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (explicit_weights.main, ["--replot", "table.md"], "--replot takes the .csv"),
    (sparse_vs_dense.main, ["--threads", "0"], "--threads must be >= 1, got 0"),
    (sparse_vs_dense.main, ["--quick", "--patterns"], "--quick and --patterns name two"),
    (node_order.main, ["--synthetic", "knn,grid"], "--synthetic takes knn, random or 'none', "
                                                   "got ['grid']"),
    (node_order.main, ["--nodes", "0"], "--nodes must be >= 1, got 0"),
    (node_order.main, ["--nodes", "5", "--degree", "6"], "--degree must be <= --nodes, got 6"),
    (node_order.main, ["--replot", "table.md"], "--replot takes the .csv"),
])
def test_bad_arguments_are_argparse_errors(parse, argv, message, capsys):
    """A bad value ends in argparse's usage error naming the option, not a traceback."""
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_block_diagonal_quick_keeps_the_sizes_given():
    assert block_diagonal.parse_args(["--quick", "--sizes", "16"]).sizes == [16]
    assert block_diagonal.parse_args(["--quick"]).sizes == [64]


def test_replot_refuses_a_csv_of_another_script(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("graph,method\nCora,cpu\n")
    with pytest.raises(SystemExit):
        block_diagonal.parse_args(["--replot", str(other)])


def test_node_order_benchmark_fills_its_table(tmp_path):
    """In a process of its own (it sets the torch threads): one warm-up and one timed round on
    Cora and small synthetic graphs, every order and call in the table, each ratio the
    quotient of its times, and renumbering narrowing the k-nearest-neighbour graph."""
    import subprocess

    out = tmp_path / "order.md"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "node_order.py"
    done = subprocess.run([sys.executable, str(script), "--rounds", "1", "--warmup", "1",
                           "--datasets", "Cora", "--nodes", "600", "--degree", "5",
                           "--backends", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    calls = ["edge_attention cpu, forward", "edge_attention cpu, forward+backward",
             "GraphSelfAttention cpu, forward+backward"]
    graphs_ = {"Cora (2708 nodes, 13264 edges)": ["as it comes", "shuffled", "locality_order"],
               "knn 600 x 5 (600 nodes, 3000 edges)": ["as it comes", "locality_order"],
               "random 600 x 5 (600 nodes, 3000 edges)": ["as it comes", "locality_order"]}
    assert [(row["graph"], row["call"], row["order"]) for row in rows] == [
        (graph, call, order) for graph, orders in graphs_.items() for call in calls
        for order in orders]
    times = {(row["graph"], row["call"], row["order"]): float(row["ms"]) for row in rows}
    for row in rows:
        given = times[row["graph"], row["call"], "as it comes"]
        # the times are rounded to 0.1 ms (off by 0.05 at most), the ratio (to 0.01) before
        ratio = float(row["ms"]) / given
        assert float(row["ratio"]) == pytest.approx(
            ratio, abs=0.006 + 0.05 * (1 + ratio) / max(given - 0.05, 0.01))
        assert (row["order s"] != "") == (row["order"] == "locality_order")
    knn = {row["order"]: row for row in rows if row["graph"].startswith("knn")}
    assert int(knn["locality_order"]["bandwidth"]) * 4 < int(knn["as it comes"]["bandwidth"])
    assert (int(knn["locality_order"]["32x32 tiles"])
            < int(knn["as it comes"]["32x32 tiles"]) / 2)
    assert "command: `python benchmarks/node_order.py --rounds 1" in out.read_text()
    assert out.with_suffix(".png").stat().st_size > 0
    replot = tmp_path / "again.csv"
    replot.write_text(out.with_suffix(".csv").read_text())
    assert node_order.main(["--replot", str(replot)]) == 0
    assert replot.with_suffix(".png").stat().st_size > 0


def test_node_order_checks_that_the_orders_agree():
    """The benchmark refuses to time a numbering whose output is not the graph's, row for
    row (here: rows taken in another order than the edges were renumbered by)."""
    edge_index = node_order.knn_graph(50, 4, seed=0)
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(50, 2, 4, generator=gen) for name in "qkv"}
    numbered = node_order.orders(edge_index, 50, shuffle=True, seed=0)
    node_order.check_orders(numbered, tensors)
    renumbered, perm, seconds = numbered["locality_order"]
    numbered["locality_order"] = (renumbered, perm.flip(0), seconds)
    with pytest.raises(AssertionError, match="locality_order differs"):
        node_order.check_orders(numbered, tensors)


def test_llama_window_agrees_and_fills_the_table(tmp_path):
    """Every route gets a time per length and pass after the run checked their outputs equal,
    and a dense route over the memory limit is a row that says why it was skipped."""
    pytest.importorskip("transformers", reason="the benchmark needs Hugging Face transformers")
    out = tmp_path / "window.md"
    llama_window.main(["--quick", "--lengths", "32,64", "--repeats", "1", "--warmup", "0",
                       "--max-dense-gib", "1e-4", "--output", str(out)])
    with out.with_suffix(".csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["length"], r["pass"], r["route"]) for r in rows] == [
        (n, p, route) for n in ("32", "64") for p in ("forward", "fwd+bwd")
        for route in llama_window.ROUTES]
    # 32 tokens: 9 * 32^2 * 4 bytes = 3.5e-5 GiB, under the limit; 64: 1.4e-4, over it
    timed = {(r["length"], r["route"]) for r in rows if r["ms"]}
    assert timed == {("32", route) for route in llama_window.ROUTES} | {("64", "graphattn")}
    assert all("over --max-dense-gib" in r["note"] for r in rows if not r["ms"])
    assert all(float(r["vs_graphattn"]) == 1.0 for r in rows if r["route"] == "graphattn")
    assert "llama_window.py --quick" in out.read_text()


def test_llama_window_checks_the_routes_agree(monkeypatch):
    """A route that computed another function would stop the run before any timing."""
    pytest.importorskip("transformers", reason="the benchmark needs Hugging Face transformers")
    real = llama_window.routes

    def skewed(*args, **kwargs):
        runs, skipped = real(*args, **kwargs)
        honest = runs["hf sdpa"]
        runs["hf sdpa"] = lambda: honest() + 1e-2
        return runs, skipped

    monkeypatch.setattr(llama_window, "routes", skewed)
    args = llama_window.parse_args(["--quick", "--repeats", "1", "--warmup", "0"])
    with pytest.raises(AssertionError, match="hf sdpa differs from graphattn"):
        llama_window.measure(32, args)


def test_softcap_benchmark_runs_every_way(tmp_path):
    """In a process of its own (it sets the torch threads): one warm-up and one timed round
    of each score and step on a small graph, every way, the ratios against the uncapped cpu
    call."""
    out, rows = _small_operator_run("softcap_cpu.py", tmp_path)
    assert [(r["score"], r["step"], r["way"]) for r in rows] == [
        (score, step, way) for score in ("dot", "gatv2")
        for step in ("forward", "forward+backward")
        for way in ("cpu, no cap", "cpu, softcap", "reference, softcap")]
    _assert_ratios_to_the_first_way(rows, 3, "ratio to cpu, no cap")
    assert "command: `python benchmarks/softcap_cpu.py --nodes 200" in out.read_text()


def _small_operator_run(script: str, tmp_path: Path, *extra: str) -> tuple[Path, list[dict]]:
    """Run the operator benchmark ``script`` in a process of its own (it sets the torch
    threads) on a graph of 200 nodes and 2000 edges (and the arguments ``extra``), one
    warm-up and one timed round: its table and the rows of its CSV."""
    import subprocess

    out = tmp_path / "table.md"
    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    done = subprocess.run([sys.executable, str(path), "--nodes", "200", "--edges", "2000",
                           "--rounds", "1", "--warmup", "1", "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        return out, list(csv.DictReader(f))


def _assert_ratios_to_the_first_way(rows: list[dict], ways: int, column: str) -> None:
    """Each group of ``ways`` rows: the ratio of each row's ms to the first row's, as the
    rounded ms allow (ms and ratios are written to 0.01; on a small graph a call takes a
    tenth of a millisecond or so)."""
    for i in range(0, len(rows), ways):
        base = float(rows[i]["ms"])
        for row in rows[i:i + ways]:
            ms, ratio = float(row["ms"]), float(row[column])
            low, high = (ms - 0.005) / (base + 0.005), (ms + 0.005) / max(base - 0.005, 1e-9)
            assert low - 0.005 <= ratio <= high + 0.005, (row, base)


def test_sinks_benchmark_runs_every_way(tmp_path):
    """In a process of its own: one warm-up and one timed round of each step on a small
    graph, every way, the ratios against the call without sinks."""
    out, rows = _small_operator_run("sinks_cpu.py", tmp_path, "--sequences", "2",
                                    "--length", "16")
    sparse = ("cpu, no sinks", "cpu, sinks", "cpu, sinks as a virtual source",
              "reference, sinks")
    blocks = ("dense, no sinks", "dense, sinks", "cpu, sinks")
    steps = ("forward", "forward+backward")
    assert [(r["step"], r["way"]) for r in rows] == [
        *((step, way) for step in steps for way in sparse),
        *((step, way) for step in steps for way in blocks)]
    assert {r["graph"] for r in rows[8:]} == {"2 causal sequences of 16"}
    _assert_ratios_to_the_first_way(rows[:8], 4, "ratio to no sinks")
    _assert_ratios_to_the_first_way(rows[8:], 3, "ratio to no sinks")
    assert "command: `python benchmarks/sinks_cpu.py --nodes 200" in out.read_text()


def test_the_virtual_source_of_the_sinks_benchmark_is_the_sinks():
    """The benchmark's sinks written as a graph compute what ``sinks=`` computes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from sinks_cpu import with_virtual_source

    from graphattn.functional import edge_attention

    gen = torch.Generator().manual_seed(0)
    edge_index = torch.randint(0, 30, (2, 200), generator=gen)
    q, k, v = (torch.randn(30, 2, 4, generator=gen) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0])
    assert_close(with_virtual_source(q, k, v, edge_index, sinks),
                 edge_attention(q, k, v, edge_index, sinks=sinks, backend="reference"))


def test_score_channels_benchmark_runs_every_width(tmp_path):
    """In a process of its own: one warm-up and one timed round of both steps on a small
    graph, every width, the ratios against the first, and the peak memory of
    forward+backward on Linux."""
    import subprocess

    out = tmp_path / "table.md"
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "score_channels_cpu.py"
    done = subprocess.run([sys.executable, str(path), "--nodes", "300", "--degree", "3",
                           "--heads", "2", "--channels", "5", "--widths", "5,3",
                           "--differential", "2", "--latent", "3", "--rounds", "1",
                           "--warmup", "1",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["score channels"]) for r in rows] == [
        (step, way) for step in ("forward", "forward+backward")
        for way in ("C_qk = 5", "C_qk = 3", "differential, 2 x C_qk = 2 x 2",
                    "latent, C_qk = 5: kv_rank 3, q_rank 6, 1 shared")]
    _assert_ratios_to_the_first_way(rows, 4, "ratio to the first")
    for row in rows:  # a peak for forward+backward only, where Linux tells it
        assert (row["peak MiB (fwd+bwd)"] != "") == (row["step"] == "forward+backward"
                                                     and sys.platform == "linux")
    assert "command: `python benchmarks/score_channels_cpu.py --nodes 300" in out.read_text()


def test_indexer_benchmark_runs_every_way(tmp_path):
    """In a process of its own: one warm-up and one timed round of both steps at two short
    lengths, the full and the indexed layer (and the indexer alone, forward), the edges each
    attends over, the ratios against the full graph, and the peak memory of forward+backward
    on Linux."""
    import subprocess

    out = tmp_path / "table.md"
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "indexer_cpu.py"
    done = subprocess.run([sys.executable, str(path), "--lengths", "24,40", "--heads", "2",
                           "--channels", "4", "--indexer-heads", "2", "--indexer-channels",
                           "4", "--top-k", "5", "--rounds", "1", "--warmup", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    ways = ["full causal graph", "indexed, top 5", "the indexer alone (scores, choice)"]
    assert [(r["L"], r["step"], r["way"]) for r in rows] == [
        (L, step, way) for L in ("24", "40") for step in ("forward", "forward+backward")
        for way in (ways if step == "forward" else ways[:2])]
    for row in rows:
        L = int(row["L"])
        assert int(row["causal edges"]) == L * (L + 1) // 2
        if row["way"] == "indexed, top 5":
            assert int(row["edges attended"]) == sum(min(5, i + 1) for i in range(L))
        assert (row["peak MiB (fwd+bwd)"] != "") == (row["step"] == "forward+backward"
                                                     and sys.platform == "linux")
    assert all(r["ratio to the full graph"] == "1.00" for r in rows
               if r["way"] == "full causal graph")
    assert "command: `python benchmarks/indexer_cpu.py --lengths 24,40" in out.read_text()


def test_grouped_query_benchmark_runs_every_way(tmp_path):
    """In a process of its own: one warm-up and one timed round of each step on short
    sequences, both ways for each operator, the ratios against the repeated keys, and the
    peak memory of forward+backward on Linux."""
    import subprocess

    out = tmp_path / "table.md"
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "grouped_query_cpu.py"
    done = subprocess.run([sys.executable, str(path), "--batch", "1", "--length", "32",
                           "--layouts", "4/2/8", "--rounds", "1", "--warmup", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out.with_suffix(".csv")) as f:
        rows = list(csv.DictReader(f))
    steps, ways = ("forward", "forward+backward"), ("repeated", "grouped")
    operators = ("dense_attention", "dense_attention, sinks", "edge_attention, dense backend")
    assert [(r["H / H_kv / C"], r["operator"], r["step"], r["way"]) for r in rows] == [
        (layout, op, step, way) for layout in ("4 / 2 / 8",) for op in operators
        for step in steps for way in ways]
    _assert_ratios_to_the_first_way(rows, 2, "ratio to repeated")
    for row in rows:  # a peak for forward+backward only, where Linux tells it
        assert (row["peak MiB (fwd+bwd)"] != "") == (row["step"] == "forward+backward"
                                                     and sys.platform == "linux")
    assert "command: `python benchmarks/grouped_query_cpu.py --batch 1" in out.read_text()
    sys.path.insert(0, str(path.parent))
    from grouped_query_cpu import parse_layout

    with pytest.raises(argparse.ArgumentTypeError, match="H_kv dividing H"):
        parse_layout("4/3/8")
