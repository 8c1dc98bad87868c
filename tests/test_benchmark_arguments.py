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
