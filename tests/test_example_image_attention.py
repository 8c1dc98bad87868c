"""The image-attention example runs: the digits split is sound, a short training learns, and the
attention it draws is a softmax over each pixel's neighbourhood."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from graphattn import graphs

pytest.importorskip("sklearn", reason="the example's images come with scikit-learn "
                                      "(the 'test' extra installs it)")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "image_attention.py"
SMALL = ["--hidden", "32", "--heads", "2", "--layers", "1", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(str(SCRIPT))  # its functions, without running main


@pytest.fixture(scope="module")
def digits(example):
    return example["load_digits"](0)


def test_split_is_disjoint_stratified_and_fixed(example, digits):
    ids = torch.cat(list(digits.splits.values()))
    assert torch.equal(ids.sort().values, torch.arange(digits.x.size(0)))  # a partition
    assert digits.x.shape == (1797, 64) and 0 <= digits.x.min() and digits.x.max() <= 1
    for split, share in {"train": 0.6, "val": 0.2, "test": 0.2}.items():
        counts = torch.bincount(digits.y[digits.splits[split]], minlength=10)
        expected = share * torch.bincount(digits.y, minlength=10)
        assert (counts - expected).abs().max() <= 1, split
    again = example["load_digits"](0)
    assert all(torch.equal(digits.splits[k], again.splits[k]) for k in digits.splits)
    other = example["load_digits"](1)
    assert not torch.equal(digits.splits["test"], other.splits["test"])


@pytest.mark.parametrize("name,edges", [("grid0", 64), ("grid1", 22 * 22), ("complete", 4096)])
def test_pixel_graphs(example, name, edges):
    edge_index = example["pixel_graph"](name)
    assert edge_index.size(1) == edges
    if name == "grid1":  # pixel (3, 4) attends to its 3x3 neighbourhood
        sources = edge_index[0, edge_index[1] == 3 * 8 + 4]
        assert sorted(sources.tolist()) == [r * 8 + c for r in (2, 3, 4) for c in (3, 4, 5)]


def test_short_training_learns_and_reports(example, capsys):
    out = example["main"](["--graphs", "grid1,grid0", "--epochs", "6", "--runs", "2",
                           "--no-plot", *SMALL])
    rows = {r["graph"]: r for r in out["rows"]}
    assert list(rows) == ["grid1", "grid0"]
    assert rows["grid1"]["scores per image"] == 484
    for r in out["results"]:
        assert len(r.val_curve) == 6 and 1 <= r.best_epoch <= 6
        assert r.val_acc == max(r.val_curve)
    # chance is 10%: a model that does not learn stays near it (seeded: 48.2% and 32.1% here)
    assert rows["grid1"]["test mean"] > 0.35, rows
    assert rows["grid0"]["test mean"] > 0.2, rows
    printed = capsys.readouterr().out
    assert "| grid1 | 484 | 11.8% |" in printed and "test accuracy (2 runs)" in printed


@pytest.mark.parametrize("offsets", [False, True], ids=["laplacian", "offset-bias"])
def test_attention_of_a_pixel_is_a_softmax_over_its_neighbourhood(example, digits, offsets):
    torch.manual_seed(0)
    edge_index = example["pixel_graph"]("grid2+offset" if offsets else "grid2")
    positions = torch.randn(64, 4)
    model = example["PixelClassifier"](edge_index, positions, hidden=16, heads=2, layers=1,
                                       dropout=0.0, offsets=offsets)
    weights = model.first_layer_attention(digits.x[0])  # (64, 64)
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(64))
    on_graph = graphs.to_dense_mask(edge_index, 64)
    assert bool((weights[~on_graph] == 0).all()) and bool((weights[on_graph] > 0).all())


@pytest.mark.parametrize("offsets", [False, True, "rope"],
                         ids=["laplacian", "offset-bias", "rope"])
def test_batch_of_images_equals_images_one_by_one(example, digits, offsets):
    """repeat_graph keeps the images apart: a batch gives each image's own logits."""
    torch.manual_seed(0)
    model = example["PixelClassifier"](example["pixel_graph"]("grid1"), torch.randn(64, 4),
                                       hidden=16, heads=2, layers=2, dropout=0.0,
                                       offsets=offsets is True,
                                       rope_base=100.0 if offsets == "rope" else None).eval()
    if offsets is True:  # a bias that is not 0, so that the offsets matter
        with torch.no_grad():
            model.spatial.weight.normal_(generator=torch.Generator().manual_seed(1))
    images = digits.x[:5]
    together = model(images)
    alone = torch.cat([model(images[i:i + 1]) for i in range(5)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_figure_is_written(example, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the example's figure needs the 'plot' extra")
    out = example["main"](["--graphs", "grid1,complete", "--epochs", "1", "--runs", "1",
                           "--out", str(tmp_path), *SMALL])
    assert out["figure"] == tmp_path / "image_attention.png"
    assert out["figure"].stat().st_size > 20_000


@pytest.mark.parametrize("argv,name", [
    (["--graphs", "grid"], "--graphs"), (["--graphs", "window"], "--graphs"),
    (["--pixel", "8", "0"], "--pixel"), (["--hidden", "30", "--heads", "4"], "--hidden"),
    (["--epochs", "0"], "--epochs"), (["--pe", "64"], "--pe"),
    (["--device", "nonsense"], "--device"), (["--dropout", "1"], "--dropout"),
    (["--lr", "0"], "--lr"), (["--weight-decay", "-1"], "--weight-decay"),
    (["--table-lr", "0"], "--table-lr must be a finite number > 0, got 0.0"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got inf"),
    # a head of 6 channels reached RotaryPE(6, axes=2) after the first graphs had trained
    (["--hidden", "24", "--heads", "4"], "6 channels per head, but the 2-D rotary embedding"),
    # a second position suffix was dropped without a word
    (["--graphs", "complete+rope+offset"], "with at most one of +offset, +rope or +laprope"),
    (["--graphs", "grid1+laprope+rope"], "with at most one of +offset, +rope or +laprope"),
    (["--out", __file__], "--out must be a folder (it gets the figure)"),
    (["--rope-base", "-2"], "--rope-base must be a positive number, got -2.0"),
    (["--graphs", ","], "--graphs must name at least one"),
    (["--graphs", "grid1,grid1"], "--graphs must name each graph once"),
    (["--device", "mps"], "--device mps is not usable here"),
])
def test_bad_arguments_are_refused_by_name(example, argv, name, capsys):
    with pytest.raises(SystemExit):
        example["main"](argv + ["--no-plot"])
    assert name in capsys.readouterr().err


def test_rope_model_rotates_by_each_pixels_row_and_column(example, digits):
    """``+rope``: no Laplacian input, every block rotates its queries and keys by the pixel's
    (row, column), the same graph as without it; moving every pixel by the same offset
    changes no logit, and nothing is learned for the positions."""
    assert torch.equal(example["pixel_graph"]("complete+rope"),
                       example["pixel_graph"]("complete"))
    torch.manual_seed(0)
    model = example["PixelClassifier"](example["pixel_graph"]("complete+rope"),
                                       torch.randn(64, 4), hidden=16, heads=2, layers=2,
                                       dropout=0.0, rope_base=100.0).eval()
    assert model.body.lin_pe is None
    assert all(attn.rotary.axes == 2 and attn.rotary.base == 100.0 for attn in model.body.attns)
    plain = example["PixelClassifier"](example["pixel_graph"]("complete"), torch.randn(64, 4),
                                       hidden=16, heads=2, layers=2, dropout=0.0)
    assert {n for n, _ in model.named_parameters()} < {n for n, _ in plain.named_parameters()}
    x, edge_index, kwargs = model.encode(digits.x[:3])
    rows_cols = torch.stack([torch.arange(64) // 8, torch.arange(64) % 8], dim=1)
    assert torch.equal(kwargs["pos"], rows_cols.repeat(3, 1))
    with torch.no_grad():
        moved = model.body(x, edge_index, pos=kwargs["pos"] + torch.tensor([5, -3]))
        torch.testing.assert_close(moved.view(3, 64, -1).mean(dim=1), model(digits.x[:3]),
                                   atol=1e-5, rtol=1e-5)
        # a real change of the positions changes the logits
        swapped = model.body(x, edge_index, pos=kwargs["pos"].flip(1))
        assert not torch.allclose(swapped.view(3, 64, -1).mean(dim=1), model(digits.x[:3]),
                                  atol=1e-4)


def test_laprope_rotates_by_the_grids_laplacian_coordinates(example, digits):
    """``+laprope``: the rotations take each pixel's coordinates from the two lowest Laplacian
    eigenvectors of the pixel grid, rescaled to 0 .. 7: distinct for every pixel, and what
    the model's blocks get."""
    assert torch.equal(example["pixel_graph"]("complete+laprope"),
                       example["pixel_graph"]("complete"))
    assert example["uses_rope"]("complete+laprope")
    coords = example["laplacian_coordinates"]()
    assert coords.shape == (64, 2)
    assert torch.equal(coords.min(dim=0).values, torch.zeros(2))
    assert torch.equal(coords.max(dim=0).values, torch.full((2,), 7.0))
    assert torch.unique(coords, dim=0).size(0) == 64  # every pixel its own position
    torch.manual_seed(0)
    model = example["PixelClassifier"](example["pixel_graph"]("complete+laprope"),
                                       torch.randn(64, 4), hidden=16, heads=2, layers=1,
                                       dropout=0.0, rope_base=100.0, rope_positions=coords)
    _, _, kwargs = model.encode(digits.x[:2])
    assert torch.equal(kwargs["pos"], coords.repeat(2, 1))


def test_offset_model_biases_each_pixel_pair_by_its_offset(example, digits):
    """``+offset``: no Laplacian input, every block's scores biased by the learned bias of
    the pair's (rows, columns) offset, the same graph as without it; the bias learns."""
    assert torch.equal(example["pixel_graph"]("complete+offset"),
                       example["pixel_graph"]("complete"))
    model = example["PixelClassifier"](example["pixel_graph"]("grid1+offset"),
                                       torch.randn(64, 4), hidden=16, heads=2, layers=2,
                                       dropout=0.0, offsets=True)
    assert model.body.lin_pe is None and not model.body.attns[0].add_self_loops
    src, dst = model.edge_index
    assert torch.equal(model.offsets, torch.stack([dst // 8 - src // 8, dst % 8 - src % 8], 1))
    F.cross_entropy(model(digits.x[:4]), digits.y[:4]).backward()
    assert model.spatial.weight.grad.abs().sum() > 0


def test_offset_table_trains_at_its_own_rate(example, digits):
    """``--table-lr``: the bias table in its own AdamW group, at that multiple of ``--lr`` and
    without weight decay; Adam's first step moves each entry by about its group's rate."""
    torch.manual_seed(0)
    model = example["PixelClassifier"](example["pixel_graph"]("grid1+offset"),
                                       torch.randn(64, 4), hidden=16, heads=2, layers=1,
                                       dropout=0.0, offsets=True)
    groups = example["parameter_groups"](model, 1e-3, 10.0)
    assert [len(g["params"]) for g in groups] == [len(list(model.parameters())) - 1, 1]
    assert groups[1]["params"][0] is model.spatial.weight
    assert groups[1]["lr"] == pytest.approx(1e-2) and groups[1]["weight_decay"] == 0.0
    before = model.spatial.weight.detach().clone()
    optimizer = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.5)
    F.cross_entropy(model(digits.x[:8]), digits.y[:8]).backward()
    optimizer.step()
    moved = (model.spatial.weight.detach() - before).abs()
    reached = model.spatial.weight.grad.abs() > 1e-4  # Adam's eps (1e-8) is nothing there
    assert int(reached.sum()) > 0
    assert torch.allclose(moved[reached], torch.full_like(moved[reached], 1e-2), rtol=1e-3)
    plain = example["PixelClassifier"](example["pixel_graph"]("grid1"), torch.randn(64, 4),
                                       hidden=16, heads=2, layers=1, dropout=0.0)
    assert len(example["parameter_groups"](plain, 1e-3, 10.0)) == 1
