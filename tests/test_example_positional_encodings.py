"""The positional-encodings example runs: the chain's Laplacian eigenvectors are its closed-form
sinusoids, to the eigensolver's precision."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch

from graphattn import pe

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "positional_encodings.py"


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(str(SCRIPT))  # its functions, without running main


def test_tables_match_the_closed_forms(example, capsys):
    dtype = torch.get_default_dtype()
    tables = example["main"](["--length", "40", "--pairs", "3", "--no-plot"])
    assert torch.get_default_dtype() == dtype  # the example restores it
    assert [r["m"] for r in tables["cycle"]] == [1, 2, 3]
    assert [r["m"] for r in tables["path"]] == list(range(1, 7))
    for r in tables["cycle"] + tables["path"]:
        assert abs(r["eigenvalue"] - r["closed form"]) < 1e-12, r
        assert r["residual"] < 1e-10, r
    assert tables["cycle"][1]["closed form"] == pytest.approx(1 - math.cos(2 * math.pi * 2 / 40))
    assert "largest residual" in capsys.readouterr().out


def test_a_wrong_closed_form_shows_as_a_residual(example):
    """The residual measures something: the path's eigenvectors against the cycle's frequency
    (2 pi m / n instead of pi m / (n - 1)) are far off."""
    n = 40
    enc = example["path_table"](n, 2)[1]
    t = torch.arange(n, dtype=enc.dtype)
    wrong = torch.cos(2 * math.pi * t / n)
    wrong = wrong / wrong.norm()
    u = enc[:, 0] / enc[:, 0].norm()
    assert (wrong - u * (u @ wrong)).norm() > 0.1


def test_figure_is_written(example, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the example's figure needs the 'plot' extra")
    example["main"](["--length", "24", "--pairs", "2", "--out", str(tmp_path)])
    assert (tmp_path / "positional_encodings.png").stat().st_size > 10_000
    # one pair: the path has two eigenvectors to draw, not three
    example["main"](["--length", "8", "--pairs", "1", "--out", str(tmp_path / "one")])
    assert (tmp_path / "one" / "positional_encodings.png").stat().st_size > 10_000


@pytest.mark.parametrize("argv", [["--length", "4"], ["--pairs", "0"], ["--pairs", "32"],
                                  ["--out", __file__]])  # (a file: after all the work)
def test_bad_sizes_are_refused_by_name(example, argv, capsys):
    with pytest.raises(SystemExit):
        example["main"](argv + ["--no-plot"])
    assert argv[0] in capsys.readouterr().err


def test_relative_positions_are_hop_distances_of_the_chain(example, capsys):
    """The path's hop distances are |i - j| and the cycle's the shorter way round; the
    example's counts of pairs that differ are 0, and would not be for a wrong graph."""
    n = 20
    rel = example["relative_table"](n)
    assert rel["path differs"] == 0 and rel["cycle differs"] == 0
    assert rel["alibi error"] < 1e-12
    assert torch.equal(rel["path"], (torch.arange(n)[:, None] - torch.arange(n)).abs())
    # T5's buckets of the chain's offsets: exact up to 7 each way, then log-spaced
    assert rel["t5"][10, 10 - 7].item() == 7 and rel["t5"][10 - 7, 10].item() == 16 + 7
    out = example["main"](["--length", "16", "--pairs", "2", "--no-plot"])
    assert out["relative"]["path differs"] == 0
    assert "hop distances on the path other than |i - j|: 0" in capsys.readouterr().out
    # the cycle's distances are not the path's: the check can fail
    cycle = example["cycle_graph"](n)
    assert int((pe.hop_distance(cycle, n) != rel["path"]).sum()) > 0


def test_rope_scores_depend_on_the_offset_alone(example, capsys):
    """RoPE's score matrix over the chain's positions is constant along each diagonal i - j
    (Toeplitz) and not constant overall; without the key's rotation it would not be."""
    n = 24
    rel = example["relative_table"](n)
    assert rel["rope spread"] < 1e-12
    scores = rel["rope"]
    assert float(scores.max() - scores.min()) > 0.5
    for d in (-5, 0, 7):
        diagonal = scores.diagonal(d)
        assert torch.allclose(diagonal, diagonal[0].expand_as(diagonal), atol=1e-12)
    # rotating only the queries gives a score of the absolute position: a spread along diagonals
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 16, dtype=torch.float64, generator=gen)
    only_q = pe.RotaryPE(16)(q.expand(n, 1, 16), torch.arange(n))[:, 0] @ k  # (n,)
    assert float(only_q.max() - only_q.min()) > 0.1
    out = example["main"](["--length", "16", "--pairs", "2", "--no-plot"])
    assert out["relative"]["rope spread"] < 1e-12
    assert "RoPE's scores, largest spread along a diagonal i - j" in capsys.readouterr().out
