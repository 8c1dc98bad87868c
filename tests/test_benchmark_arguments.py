"""The benchmarks refuse bad arguments by name, as argparse does, before any work: not with a
traceback from inside a run, and not by running with a value that means something else."""

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield lambda name: importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.parametrize("script, argv, message", [
    ("cpu_one_head", ["--datasets", "none"], "--datasets none leaves this benchmark nothing"),
    ("cpu_one_head", ["--datasets", "Foo"], "--datasets: 'Foo' is not one of Cora, CiteSeer"),
    ("sparse_features", ["--datasets", "none"], "--datasets none leaves"),
    ("cpu_one_head", ["--datasets", "Cora", "--channels", "abc"],
     "--channels must be comma-separated integers, got 'abc'"),
    ("cpu_one_head", ["--datasets", "Cora", "--channels", "8,0"], "--channels must be >= 1"),
    ("cpu_one_head", ["--datasets", "Cora", "--scores", "dot,foo"],
     "--scores must name dot, additive or gatv2, got 'foo'"),
    ("llama_window", ["--quick", "--lengths", "abc"],
     "--lengths must be comma-separated integers, got 'abc'"),
    ("batched_global", ["--quick", "--backend", "foo"], "--backend must be one of reference"),
    ("batched_global", ["--quick", "--heads", "0"], "--heads and --channels must be positive"),
    ("global_layers", ["--quick", "--channels", "0"],
     "--heads and --channels must be positive, got 4 and 0"),
    ("gpu", ["--replot", "no-such-table.md"], "--replot: no such file 'no-such-table.md'"),
])
def test_bad_arguments_are_refused_by_name(bench, capsys, script, argv, message):
    with pytest.raises(SystemExit):
        bench(script).parse_args(argv)
    assert message in capsys.readouterr().err


def test_convert_pyg_refuses_no_dataset(bench, capsys):
    with pytest.raises(SystemExit):
        bench("convert_pyg").main(["--datasets", "none"])
    assert "--datasets none leaves" in capsys.readouterr().err


def test_vs_pyg_refuses_a_negative_edge_dim(bench, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["vs_pyg.py", "--edge-dim", "-1"])
    with pytest.raises(SystemExit):
        bench("vs_pyg").main()
    assert "--edge-dim must be >= 0 (0: no edge features), got -1" in capsys.readouterr().err


def test_gpu_replot_refuses_a_table_of_another_script(bench, capsys, tmp_path):
    other = tmp_path / "vs_pyg.md"
    other.write_text("| dataset | layer | ms |\n| --- | --- | ---: |\n| Cora | GAT | 1.0 |\n")
    with pytest.raises(SystemExit):
        bench("gpu").parse_args(["--replot", str(other)])
    assert "is not a table this script wrote: no table of benchmarks/gpu.py found" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("argv, message", [
    (["--dense-limit-gib", "-1"], "--dense-limit-gib must be > 0, got -1.0"),
    (["--mem-limit-gib", "nan"], "--mem-limit-gib must be > 0, got nan"),
    (["--slow-factor", "0.5"], "--slow-factor must be >= 1"),
    (["--min-time-s", "-1"], "--min-time-s must be >= 0"),
    (["--out", "table.md"], "--out is the folder the tables and plots go to"),
])
def test_sparse_vs_dense_refuses_unusable_limits(bench, capsys, argv, message):
    """Refused before the sweep: a limit of 0 left FlexAttention out of the sweep but not out
    of the agreement check, which then called it (a TypeError)."""
    with pytest.raises(SystemExit):
        bench("sparse_vs_dense").main(["--quick", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--memory-limit", "0"], "--memory-limit must be > 0, got 0.0"),
    (["--repeats", "-1"], "--repeats must be > 0, got -1.0"),
    (["--probe-edges", "0", "10"], "--probe-edges must be positive edge counts, got [0, 10]"),
])
def test_vs_pyg_refuses_unusable_limits(bench, capsys, monkeypatch, argv, message):
    """A limit of 0 GiB crashed every worker, and the run still wrote its table of crashes."""
    monkeypatch.setattr(sys, "argv", ["vs_pyg.py", *argv])
    with pytest.raises(SystemExit):
        bench("vs_pyg").main()
    assert message in capsys.readouterr().err
