"""The sequence-attention example runs: its text and windows are sound, its model is causal
with the receptive field its graph gives, and a short training learns."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch

from graphattn import graphs, pe

pytest.importorskip("pydoc_data.topics", reason="the example's text is CPython's pydoc_data "
                                                "(absent from some stripped installs)")

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "sequence_attention.py"
SMALL = ["--timing-rounds", "0", "--length", "32", "--batch-size", "8", "--val-sequences", "8",
         "--hidden", "32", "--heads", "2", "--layers", "1", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def example():
    return runpy.run_path(str(SCRIPT))  # its functions, without running main


@pytest.fixture(scope="module")
def corpus(example):
    return example["load_corpus"]()


def test_corpus_and_windows(example, corpus):
    from pydoc_data.topics import topics

    assert corpus.vocab == "".join(sorted(set(corpus.vocab)))
    total = corpus.train.numel() + corpus.val.numel()
    assert corpus.train.numel() == int(0.9 * total)
    text = "".join(corpus.vocab[i] for i in torch.cat([corpus.train, corpus.val]).tolist())
    assert text == "\n\n".join(topics[name] for name in sorted(topics))
    inputs, targets = example["windows"](corpus.train, torch.tensor([0, 100]), 16)
    assert inputs.shape == targets.shape == (2, 16)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(targets[1], corpus.train[101:117])


@pytest.mark.parametrize("name,edges", [("window0", 10), ("window3", 10 + 9 + 8 + 7),
                                        ("causal", 55)])
def test_sequence_graphs(example, name, edges):
    edge_index = example["sequence_graph"](name, 10)
    assert edge_index.size(1) == edges
    assert bool((edge_index[0] <= edge_index[1]).all())  # no edge from the future


def test_a_window_with_global_positions(example):
    """``window1+global4``: the window of one, and positions 0, 4, 8 global, causally."""
    n = 10
    edge_index = example["sequence_graph"]("window1+global4", n)
    pairs = [(j, i) for i in range(n) for j in range(i + 1)
             if i - j <= 1 or j % 4 == 0 or i % 4 == 0]
    assert edge_index.tolist() == torch.tensor(pairs).t().tolist()


@pytest.mark.parametrize("name,reach", [("window2", 2), ("causal", None),
                                        ("window2+alibi", 2), ("causal+alibi", None),
                                        ("window2+t5", 2), ("causal+t5", None),
                                        ("window2+rope", 2), ("causal+rope", None)])
def test_model_is_causal_with_its_graphs_receptive_field(example, corpus, name, reach):
    """Changing character t changes no prediction before t, and with a window of r over two
    blocks none after t + 2 r; within reach it does change them."""
    torch.manual_seed(0)
    L, t = 24, 10
    model = example["CharModel"](len(corpus.vocab), name, torch.randn(L, 4), hidden=16,
                                 heads=2, layers=2, dropout=0.0).eval()
    if model.t5 is not None:  # a bias that is not 0, so that a wrong one would show
        torch.nn.init.normal_(model.t5.weight)
    chars = corpus.train[:L].clone().unsqueeze(0)
    other = chars.clone()
    other[0, t] = (chars[0, t] + 1) % len(corpus.vocab)
    with torch.no_grad():
        diff = (model(chars) - model(other)).abs().amax(dim=2)[0]  # (L,)
    assert float(diff[:t].max()) == 0.0
    assert float(diff[t]) > 0
    if reach is not None:
        assert float(diff[t + 2 * reach]) > 0
        assert float(diff[t + 2 * reach + 1:].max()) == 0.0
    else:
        assert bool((diff[t:] > 0).all())


@pytest.mark.parametrize("name", ["window3", "causal+alibi", "causal+t5", "causal+rope"])
def test_batch_of_sequences_equals_sequences_one_by_one(example, corpus, name):
    torch.manual_seed(0)
    L = 16
    model = example["CharModel"](len(corpus.vocab), name, torch.randn(L, 4), hidden=16,
                                 heads=2, layers=2, dropout=0.0)
    chars = corpus.train[:4 * L].view(4, L)
    together = model(chars)
    alone = torch.cat([model(chars[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_alibi_model_biases_each_edge_by_its_distance(example, corpus):
    """ALiBi's bias on the edge j -> i is -m_h (i - j), slopes 2^-8(h+1)/H; the model has no
    position encoding then, so it runs on sequences of any length."""
    L, heads = 12, 4
    model = example["CharModel"](len(corpus.vocab), "causal+alibi", torch.randn(L, 4),
                                 hidden=16, heads=heads, layers=1, dropout=0.0)
    assert model.body.lin_pe is None
    edge_index, bias = model.batch_graph(3, L)
    src, dst = edge_index
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)])
    assert torch.equal(bias, -slopes * ((dst - src) % L).unsqueeze(1).float())
    assert model(corpus.train[:5 * L].view(1, 5 * L)).shape == (1, 5 * L, len(corpus.vocab))
    plain = example["CharModel"](len(corpus.vocab), "causal", torch.randn(L, 4), hidden=16,
                                 heads=heads, layers=1, dropout=0.0)
    with pytest.raises(ValueError, match="encodes 12 positions, got sequences of 13"):
        plain(corpus.train[:13].view(1, 13))


def test_t5_model_biases_each_edge_by_its_bucket(example, corpus):
    """T5's bias on the edge j -> i is the table's row of the bucket of i - j, the same table
    in both blocks, and it learns; the model has no position encoding and no largest length."""
    L, heads = 40, 2
    model = example["CharModel"](len(corpus.vocab), "causal+t5", torch.randn(L, 4),
                                 hidden=16, heads=heads, layers=2, dropout=0.0)
    assert model.body.lin_pe is None and model.t5.weight.shape == (32, heads)
    edge_index, offset = model.batch_graph(3, L)  # offsets of one sequence's edges
    src, dst = edge_index
    assert torch.equal(offset.repeat(3), (dst - src) % L)
    seen = []
    for attn in model.body.attns:
        attn.register_forward_hook(lambda mod, args, kwargs, out: seen.append(
            kwargs["attn_bias"]), with_kwargs=True)
    torch.nn.init.normal_(model.t5.weight)
    chars = corpus.train[:3 * L].view(3, L)
    model(chars).sum().backward()
    bucket = pe.relative_position_bucket(offset.repeat(3), bidirectional=False)
    assert len(seen) == 2 and all(torch.equal(b, model.t5.weight[bucket]) for b in seen)
    assert int((model.t5.weight.grad.abs().sum(dim=1) > 0).sum()) == int(bucket.max()) + 1
    assert model(corpus.train[:5 * L].view(1, 5 * L)).shape == (1, 5 * L, len(corpus.vocab))


def test_rope_model_rotates_by_each_characters_position(example, corpus):
    """With ``+rope`` every block rotates its queries and keys by the position of each
    character in its own sequence, 0 .. L-1 (LLaMA's); the model has no position encoding,
    and moving every position by the same amount changes no prediction."""
    L, heads = 12, 2
    model = example["CharModel"](len(corpus.vocab), "causal+rope", torch.randn(L, 4),
                                 hidden=16, heads=heads, layers=2, dropout=0.0)
    assert model.body.lin_pe is None
    assert all(attn.rotary is not None and attn.rotary.dim == 8 for attn in model.body.attns)
    seen = []
    for attn in model.body.attns:
        attn.register_forward_hook(lambda mod, args, kwargs, out: seen.append(kwargs["pos"]),
                                   with_kwargs=True)
    chars = corpus.train[:3 * L].view(3, L)
    out = model(chars)
    assert len(seen) == 2 and all(torch.equal(p, torch.arange(L).repeat(3)) for p in seen)
    x = torch.nn.functional.one_hot(chars.reshape(-1), len(corpus.vocab)).float()
    edge_index, _ = model.batch_graph(3, L)
    moved = model.body(x, edge_index, pos=torch.arange(L).repeat(3) + 1000)
    torch.testing.assert_close(moved.view(3, L, -1), out, atol=1e-4, rtol=1e-4)
    assert model(corpus.train[:5 * L].view(1, 5 * L)).shape == (1, 5 * L, len(corpus.vocab))


def test_stretched_rotations(example):
    """Position interpolation turns position K p as the trained rotation turns p; dynamic NTK
    keeps the trained rotation within the trained length and changes it past; YaRN is
    ``pe.RotaryPE.yarn``."""
    stretch = example["rescaled_rotary"]
    x = torch.randn(40, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(40)
    trained = pe.RotaryPE(8)
    torch.testing.assert_close(stretch("interpolation", 8, 10, 4)(x, 4 * pos), trained(x, pos))
    ntk = stretch("NTK", 8, 10, 4)
    torch.testing.assert_close(ntk(x[:10], pos[:10]), trained(x[:10], pos[:10]))
    assert not torch.allclose(ntk(x, pos), trained(x, pos))
    yarn = stretch("YaRN", 8, 10, 4)
    torch.testing.assert_close(yarn(x, pos), pe.RotaryPE.yarn(8, 4, 10)(x, pos))
    with pytest.raises(ValueError, match="name must be one of"):
        stretch("linear", 8, 10, 4)


def test_rope_runs_are_measured_with_stretched_rotations(example, corpus, capsys):
    """A +rope run is read on the longer sequences with each stretched rotation in every
    block (the bits the model gives with that rotation set by hand), and keeps its own."""
    L = 8
    model = example["CharModel"](len(corpus.vocab), "causal+rope", torch.randn(L, 4),
                                 hidden=16, heads=2, layers=2, dropout=0.0)
    longer = example["windows"](corpus.val, torch.tensor([0, 50, 100]), 3 * L)
    own = [attn.rotary for attn in model.body.attns]
    before = example["validation_bpc"](model, *longer, 2)
    bpc = example["rescaled_bpc"](model, longer, 2, L, 3)
    assert list(bpc) == list(example["RESCALINGS"])
    assert [attn.rotary for attn in model.body.attns] == own
    assert example["validation_bpc"](model, *longer, 2) == before
    for attn in model.body.attns:
        attn.rotary = example["rescaled_rotary"]("YaRN", 8, L, 3)
    assert example["validation_bpc"](model, *longer, 2) == pytest.approx(bpc["YaRN"], rel=1e-6)
    assert len(set(bpc.values()) | {before}) == 4  # four rotations, four readings
    out = example["main"](["--graphs", "causal+rope,window2", "--steps", "2", "--eval-every",
                           "1", "--extrapolate", "2", "--no-plot", *SMALL])
    rope, window = out["results"]
    assert list(rope.rescaled_bpc) == list(example["RESCALINGS"]) and not window.rescaled_bpc
    printed = capsys.readouterr().out
    assert "RoPE on sequences of 64, 2x the trained 32" in printed
    assert "| causal+rope | " in printed.split("RoPE on sequences")[1]


def test_rotations_of_one_plane_are_stretched_without_ntk(example, corpus, capsys):
    """NTK scaling needs more than one plane (2 channels) a rotation: a run whose heads (or
    indexers) turn 2 channels reads the other stretchings and says n/a for NTK, where it
    failed after its training."""
    out = example["main"](["--graphs", "causal+rope", "--steps", "2", "--eval-every", "1",
                           "--extrapolate", "2", "--no-plot", *SMALL, "--hidden", "8",
                           "--heads", "4"])  # (the last --hidden and --heads count)
    rope, = out["results"]
    assert list(rope.rescaled_bpc) == ["interpolation", "YaRN"]
    table = capsys.readouterr().out.split("RoPE on sequences")[1]
    assert "| n/a |" in table and "n/a: NTK scaling needs more than 2 rotated channels" in table


def test_the_indexers_rotations_are_stretched_too(example, corpus):
    """With ``+topK`` the indexers turn half the channels the attentions turn; each rotation
    is stretched at its own width (the bits the model gives with those set by hand), and put
    back after."""
    L = 8
    model = example["CharModel"](len(corpus.vocab), "causal+top4+rope", torch.randn(L, 4),
                                 hidden=16, heads=2, layers=2, dropout=0.0)
    indexers = [attn.indexer for attn in model.body.attns]
    assert {attn.rotary.dim for attn in model.body.attns} == {8}
    assert {indexer.rotary.dim for indexer in indexers} == {4}
    own = [indexer.rotary for indexer in indexers]
    longer = example["windows"](corpus.val, torch.tensor([0, 50, 100]), 3 * L)
    bpc = example["rescaled_bpc"](model, longer, 2, L, 3)
    assert [indexer.rotary for indexer in indexers] == own
    for attn in model.body.attns:
        attn.rotary = example["rescaled_rotary"]("interpolation", 8, L, 3)
    attention_only = example["validation_bpc"](model, *longer, 2)
    for indexer in indexers:
        indexer.rotary = example["rescaled_rotary"]("interpolation", 4, L, 3)
    both = example["validation_bpc"](model, *longer, 2)
    assert both == pytest.approx(bpc["interpolation"], rel=1e-6)
    assert attention_only != pytest.approx(both, rel=1e-6)  # (the indexers' choice moved)


def test_qk_norm_reaches_every_block(example, corpus):
    model = example["CharModel"](len(corpus.vocab), "causal+rope", torch.randn(8, 4),
                                 hidden=16, heads=2, layers=2, dropout=0.0, qk_norm="rms")
    assert all(isinstance(attn.q_norm, torch.nn.RMSNorm) for attn in model.body.attns)
    assert example["parse_args"](["--qk-norm", "layer"]).qk_norm == "layer"
    assert example["parse_args"](["--qk-norm", "rms_across_heads"]).qk_norm == "rms_across_heads"
    assert example["parse_args"]([]).qk_norm is None


def test_softcap_reaches_every_block(example, corpus):
    model = example["CharModel"](len(corpus.vocab), "window4+rope", torch.randn(8, 4),
                                 hidden=16, heads=2, layers=2, dropout=0.0, softcap=5.0)
    assert [attn.softcap for attn in model.body.attns] == [5.0, 5.0]
    assert example["parse_args"](["--softcap", "5"]).softcap == 5.0
    assert example["parse_args"]([]).softcap is None


def test_sinks_reach_every_block(example, corpus):
    model = example["CharModel"](len(corpus.vocab), "window4+alibi", torch.randn(8, 4),
                                 hidden=16, heads=2, layers=2, dropout=0.0, sinks=True)
    assert all(attn.sinks is not None for attn in model.body.attns)
    x = torch.randint(0, len(corpus.vocab), (2, 8))  # two sequences, ALiBi's bias beside
    assert torch.isfinite(model(x)).all()
    assert example["parse_args"](["--sinks"]).sinks
    assert not example["parse_args"]([]).sinks


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_gates_reach_every_block(example, corpus, gate):
    model = example["CharModel"](len(corpus.vocab), "causal+rope", torch.randn(8, 4),
                                 hidden=16, heads=2, layers=2, dropout=0.0, gate=gate)
    assert [attn.gate for attn in model.body.attns] == [gate, gate]
    x = torch.randint(0, len(corpus.vocab), (2, 8))
    assert torch.isfinite(model(x)).all()
    assert example["parse_args"](["--gate", gate]).gate == gate
    assert example["parse_args"]([]).gate is None


def test_differential_attention_reaches_every_block(example, corpus):
    # with RoPE on each map's 4 query and key channels (half of a head's 8)
    model = example["CharModel"](len(corpus.vocab), "causal+rope", torch.randn(8, 4),
                                 hidden=16, heads=2, layers=2, dropout=0.0, differential=True)
    assert [(attn.differential, attn.rotary.dim) for attn in model.body.attns] == [
        (True, 4), (True, 4)]
    x = torch.randint(0, len(corpus.vocab), (2, 8))
    assert torch.isfinite(model(x)).all()
    assert example["parse_args"](["--differential"]).differential
    assert not example["parse_args"]([]).differential


def test_a_learned_sparse_graph_trains_its_indexers(example, corpus):
    # +top4: every block attends over each character's 4 edges of highest score by its own
    # indexer; in training the model keeps the indexers' loss for the step to add, and a few
    # steps of training move the indexers (their loss's gradient) and the rest (the task's)
    assert example["indexer_top_k"]("causal+top4+rope") == 4
    assert example["indexer_top_k"]("causal+rope") is None
    assert torch.equal(example["sequence_graph"]("causal+top4+rope", 6),
                       graphs.causal_graph(6))
    model = example["CharModel"](len(corpus.vocab), "causal+top4+rope", torch.randn(8, 4),
                                 hidden=16, heads=2, layers=2, dropout=0.0)
    assert [attn.indexer.top_k for attn in model.body.attns] == [4, 4]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    val = tuple(t[:4] for t in example["windows"](corpus.val, torch.arange(0, 400, 100), 8))
    example["train"](model, corpus, val, steps=3, batch_size=2, length=8, lr=1e-2,
                     eval_every=3, seed=0, desc="top4", progress=False)
    assert model.indexer_loss is not None and model.indexer_loss.item() > 0
    assert all(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    model.eval()
    assert torch.isfinite(model(torch.randint(0, len(corpus.vocab), (2, 8)))).all()
    with pytest.raises(ValueError, match="a \\+topK run needs \\+rope"):
        example["CharModel"](len(corpus.vocab), "causal+top4", torch.randn(8, 4), hidden=16,
                             heads=2, layers=1, dropout=0.0)(torch.zeros(1, 8, dtype=torch.long))


def test_short_training_learns_and_reports(example, corpus, capsys):
    out = example["main"](["--graphs", "window4+alibi,window0", "--steps", "200",
                           "--eval-every", "100", "--extrapolate", "2", "--no-plot", *SMALL])
    results = {r.graph: r for r in out["results"]}
    assert list(results) == ["window4+alibi", "window0"]
    for r in results.values():
        assert r.steps == [100, 200] and len(r.step_seconds) == 200
    # predicting every character as equally likely costs log2(V) = 6.69 bits; a model that
    # learns nothing stays there, on the sequences trained on and on twice as long ones
    uniform = math.log2(len(corpus.vocab))
    for r in results.values():
        assert r.val_bpc[-1] < uniform - 2, (r.graph, r.val_bpc)
        assert r.longer_bpc < uniform - 2, (r.graph, r.longer_bpc)
    printed = capsys.readouterr().out
    assert "| window4+alibi | " in printed and "validation bits per char" in printed
    assert "bits per char at L = 64" in printed


def test_one_layer_timing_compares_equal_outputs(example):
    """The timing checks that the three routes compute the same layer before timing them."""
    rows = example["time_one_layer"](["window2", "causal"], 16, 3, 8, 2, rounds=2)
    assert [(r["graph"], r["dense route"]) for r in rows] == [("window2", "mask"),
                                                             ("causal", "is_causal")]
    assert all(r["sparse ms"] > 0 and r["auto ms"] > 0 and r["dense ms"] > 0 for r in rows)
    # the causal blocks are half dense: auto runs them on the dense backend
    assert [r["auto picks"] for r in rows] == ["cpu", "dense"]
    table = example["format_timing"](rows, 16, 3)
    assert "| causal | " in table and "3 sequences of 16" in table


def test_figure_is_written(example, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the example's figure needs the 'plot' extra")
    out = example["main"](["--graphs", "window2,causal+rope", "--steps", "2", "--eval-every",
                           "1", "--out", str(tmp_path), *SMALL])
    assert out["figure"] == tmp_path / "sequence_attention.png"
    assert out["figure"].stat().st_size > 20_000


@pytest.mark.parametrize("argv,name", [
    (["--graphs", "window"], "--graphs"), (["--graphs", "grid1"], "--graphs"),
    (["--hidden", "30", "--heads", "4"], "--hidden"), (["--pe", "7"], "--pe"),
    (["--length", "1"], "--length"), (["--steps", "0"], "--steps"),
    (["--timing-rounds", "-1"], "--timing-rounds"),
    (["--device", "nonsense"], "--device"), (["--dropout", "1"], "--dropout"),
    (["--lr", "0"], "--lr"), (["--graphs", ","], "--graphs must name at least one"),
    (["--graphs", "causal,causal"], "--graphs must name each graph once"),
    (["--graphs", "window8+global0"], "--graphs: graph must be one of"),
    (["--graphs", "window8+sinks"], "got 'window8+sinks'"),
    (["--graphs", "alibi"], "must name edges besides alibi"),
    (["--graphs", "t5"], "must name edges besides t5"),
    (["--graphs", "causal+t5+alibi"], "may name one relative encoding"),
    (["--graphs", "window8,causal+top4"], "--graphs: a +topK run needs +rope"),  # (before
    # the first graph trains)
    (["--extrapolate", "0"],
                                                                "--extrapolate"),
    (["--device", "mps"], "--device mps is not usable here"),
    (["--qk-norm", "l2"], "--qk-norm"),
    (["--softcap", "0"], "--softcap must be a positive number, got 0.0"),
    (["--softcap", "inf"], "--softcap must be a positive number, got inf"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    # each failed in a constructor once the graph's run began, after others had trained
    (["--hidden", "12", "--heads", "4", "--graphs", "window8,causal+rope"],
     "the rotary embedding of causal+rope turns channel pairs"),
    (["--differential", "--hidden", "12", "--heads", "4"], "--differential splits each head"),
    (["--differential", "--graphs", "window8,causal+top4+rope"],
     "--differential with a +topK graph"),
    (["--out", __file__], "--out must be a folder (it gets the figure)"),
])
def test_bad_arguments_are_refused_by_name(example, argv, name, capsys):
    with pytest.raises(SystemExit):
        example["main"](argv + ["--no-plot"])
    assert name in capsys.readouterr().err


def test_sequences_longer_than_the_text_are_refused_by_name(example):
    """--extrapolate 4 with --length 12000 ran past the 46,513 validation characters
    (IndexError in windows) once the first graph had trained."""
    with pytest.raises(SystemExit, match=r"--extrapolate 4 times --length 12000 does not fit "
                                         r"in the \d+ validation characters"):
        example["main"](["--length", "12000", "--extrapolate", "4", "--val-sequences", "1",
                         "--no-plot"])
