"""The attention-patterns example runs, and every pattern matches its dense reference."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "attention_patterns.py"


def test_attention_patterns_example(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="the example's heatmaps need the 'plot' extra")
    out = tmp_path / "heatmaps"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--length", "16", "--radius", "2",
                                      "--out", str(out)])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    printed = capsys.readouterr().out
    assert "all patterns match their dense reference to 1e-05" in printed
    rows = {line.split()[0]: line.split() for line in printed.splitlines()[1:7]}
    assert list(rows) == ["complete", "causal", "window-r2", "grid-4x4", "bigbird",
                          "networkx-small-world"]
    assert rows["complete"][1:3] == ["256", "256"]  # E = L^2
    assert rows["causal"][1] == str(16 * 17 // 2)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{name}.png" for name in rows)


@pytest.mark.parametrize("length", [0, 1])
def test_too_short_sequence_is_refused_by_name(monkeypatch, capsys, length):
    # 0 and 1 are perfect squares, but the small-world graph needs more nodes than its degree 4.
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--length", str(length), "--no-plot"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert exit_info.value.code == 2  # argparse's usage error
    assert re.search(f"--length must be a perfect square of at least 4.*got {length}",
                     capsys.readouterr().err)


@pytest.mark.parametrize("features", [0, 7])
def test_odd_or_zero_features_are_refused_by_flag_name(monkeypatch, capsys, features):
    # SinusoidalPE's error named its own argument ("dim must be even"), not --features.
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--length", "16", "--features", str(features),
                                      "--no-plot"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert "--features must be even and at least 2 " in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--length", "-4"], "--length must be a perfect square of at least 4"),
    (["--heads", "0"], "--heads must be at least 1, got 0"),
    (["--channels", "0"], "--channels must be at least 1, got 0"),
    (["--radius", "-1"], "--radius must be at least 0, got -1"),
    (["--backend", "foo"], "argument --backend: invalid choice: 'foo'"),
    (["--out", __file__], "--out must be a folder (it gets the heatmaps)"),
])
def test_bad_flag_values_are_refused_by_flag_name(monkeypatch, capsys, argv, message):
    # These ended in a traceback from torch ("negative dimension -4") or from a constructor
    # naming its own argument (out_channels for --channels), after the table header.
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--no-plot", *argv])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    captured = capsys.readouterr()
    assert message in f"{exit_info.value}{captured.err}"
    assert "pattern" not in captured.out  # refused before any work


def test_triton_outside_the_interpreter_is_refused_by_flag_name(monkeypatch, capsys):
    # The example's tensors are on CPU: this ended in the backend's traceback after the header.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--no-plot", "--backend", "triton"])
    with pytest.raises(SystemExit):
        runpy.run_path(str(SCRIPT), run_name="__main__")
    captured = capsys.readouterr()
    assert "--backend triton" in captured.err
    assert "pattern" not in captured.out
