r"""Masked and truncated attention over text: one character-level language model, nine runs.

A sequence is a chain of tokens, and a decoder's attention is edge attention on a graph over
them. This script trains the same model, :class:`graphattn.nn.GraphTransformer` (two pre-norm
blocks, 4 heads, width 64), to predict the next character of English text, with each
character attending to

- ``window0``: itself only (``graphs.window_graph(L, 0, causal=True)``): no context, the
  model can learn the next character's distribution given the current one and nothing more;
- ``window8`` and ``window32``: itself and the 8 or 32 characters before it
  (``graphs.window_graph(L, r, causal=True)``): truncated attention, the long-sequence
  transformer's local window;
- ``window8+global32``: the window of 8, and every 32nd position global (Longformer's
  pattern, causal): a global position attends to every character before it, and every
  character to the global positions before it, so two layers reach the whole past
  (``graphs.union`` of ``graphs.window_graph`` and ``graphs.global_token_graph``);
- ``causal``: itself and every character before it in the sequence
  (``graphs.causal_graph(L)``): masked decoder attention, what ``DenseSelfAttention`` computes
  with ``is_causal=True``;
- ``causal+alibi``: the causal graph with the positions given by ALiBi's bias instead of the
  sinusoids (Press et al., 2022): each edge j -> i scores -m_h (i - j) more in head h, i - j
  being the hop distance on the chain (``pe.hop_distance``, ``pe.alibi_bias``); ``+alibi``
  joins any graph;
- ``causal+t5``: the causal graph with T5's learned relative position bias (Raffel et al.,
  2020) instead of the sinusoids: a bias per head and bucket of i - j, 32 buckets that are
  exact up to 15 and log-spaced up to 128 (``pe.RelativePositionBias(..., bidirectional=False)``,
  one table that every block adds, as T5's); ``+t5`` joins any graph;
- ``causal+rope``: the causal graph with rotary position embeddings (RoPE; Su et al., 2021)
  instead of the sinusoids: every block turns its queries and keys by their positions, so
  that each score depends on i - j, as LLaMA's attention does (``pe.RotaryPE``, the layers'
  ``rotary=`` and ``pos=``); ``+rope`` joins any graph, as in
- ``window32+rope``: the window of 32 with RoPE, whose every score is at an offset of 0 to 32,
  on sequences of any length.

A ``+topK`` part (not among the default runs) gives every block a learned sparse graph: a
``graphattn.nn.LightningIndexer`` picks each character's K edges of highest score among the
graph's (DeepSeek's sparse attention, ``GraphTransformer(indexer_top_k=K)``), trained with the
model by the indexer's loss (the KL divergence from the attention's weights, which reaches
the indexers alone), so that ``causal+top32+rope`` attends to 32 characters of its past that
it learns to pick, where ``window32+rope`` takes the last 32.

The text is the Python documentation's topic pages that ship with CPython
(``pydoc_data.topics``, about 465,000 characters, here in the order of their names): the first
90% trains, the last 10% validates. A step draws ``--batch-size`` sequences of ``--length``
characters at random places of the training text; a batch of B sequences is one graph,
``graphs.repeat_graph(edge_index, L, B)``. A character's input is its one-hot vector and the
transformer's sinusoidal encoding of its position (``pe.sinusoidal``, ``--pe`` columns; the
chain's Laplacian eigenvectors are sinusoids too, but only the lowest frequencies, which cannot
tell a character from its neighbour). Every
``--eval-every`` steps the script measures the validation loss in bits per character on fixed
sequences (every position predicts the next character; positions near a sequence's start see
less context on every graph); after training, also on sequences ``--extrapolate`` times as
long (default 4), whose positions past L a sinusoidal model never saw, while ALiBi's bias has
no largest position and T5's puts every offset from 128 on in one bucket; RoPE's rotations at
offsets past L are new to the model, as the sinusoids are. A ``+rope`` run is then measured on
those sequences again with its rotations stretched to them, with no retraining, in three ways
(``RESCALINGS``): position interpolation (every frequency divided by ``--extrapolate``), dynamic
NTK-aware scaling (``pe.RotaryPE(..., ntk_factor=, original_length=)``) and YaRN
(``pe.RotaryPE.yarn``); with ``+topK`` the indexers' rotations are stretched alike.

It prints the final validation bits per character of each graph, the scores a sequence
computes (its edges E against L^2 for unmasked dense attention) and the median time of a
training step; with matplotlib it draws the validation curves (``--no-plot``: none). Last, it
times one attention layer's forward+backward on a batch, ``GraphSelfAttention`` on each graph
(on the sparse kernels, and with the backend ``"auto"`` picks: the dense backend, block by
block, where the sequences' blocks are dense enough) against ``DenseSelfAttention`` with the
same weights (SDPA, with ``is_causal=True`` for the causal graph and the graph's mask
otherwise), to show which route to take for which pattern (``--timing-rounds 0`` skips it).

Usage::

    python examples/sequence_attention.py --out out/sequence_attention   # ~16 min on 2 cores
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from graphattn import graphs, pe
from graphattn.functional import select_backend
from graphattn.nn import DenseSelfAttention, GraphSelfAttention, GraphTransformer

GRAPHS = ("window0", "window8", "window32", "window8+global32", "causal", "causal+alibi",
          "causal+t5", "causal+rope", "window32+rope")
#: The parts of a run's name that give relative positions in the scores, not sinusoids.
RELATIVE = ("alibi", "t5", "rope")


def relative_part(name: str) -> str | None:
    """How the run named ``name`` encodes positions in the scores: ``"alibi"``, ``"t5"``
    (a bias), ``"rope"`` (rotated queries and keys), its ``+alibi``, ``+t5`` or ``+rope``
    part, or ``None`` for the sinusoids."""
    found = [part for part in name.split("+") if part in RELATIVE]
    if len(found) > 1:
        raise ValueError(f"graph may name one relative encoding of {RELATIVE}, got {name!r}")
    return found[0] if found else None


def top_k_part(part: str) -> int | None:
    """K of a ``topK`` part of a run's name (each character's K edges of highest score by a
    learned indexer), else ``None``."""
    return int(part[3:]) if part.startswith("top") and part[3:].isdigit() and int(
        part[3:]) > 0 else None


def indexer_top_k(name: str) -> int | None:
    """K of the run named ``name``'s ``+topK`` part, or ``None`` without one."""
    found = [top_k_part(part) for part in name.split("+") if top_k_part(part) is not None]
    return found[0] if found else None


def uses_alibi(name: str) -> bool:
    """Whether the run named ``name`` encodes positions by ALiBi's bias (its ``+alibi``
    part) instead of sinusoids."""
    return relative_part(name) == "alibi"


def sequence_graph(name: str, length: int) -> Tensor:
    """The edges j -> i among the ``length`` positions of one sequence: ``causal``,
    ``windowR`` (look back R), ``globalP`` (every P-th position global, causal), or the union
    of such parts joined by ``+`` (an ``alibi``, ``t5`` or ``rope`` part adds no edge: see
    :func:`relative_part`)."""
    relative = relative_part(name)
    if indexer_top_k(name) is not None and relative != "rope":
        raise ValueError(f"a +topK run needs +rope (its indexer turns by the positions RoPE "
                         f"takes), got {name!r}")
    parts = []
    for part in name.split("+"):
        if part in RELATIVE or top_k_part(part) is not None:
            continue
        if part == "causal":
            parts.append(graphs.causal_graph(length))
        elif part.startswith("window") and part[6:].isdigit():
            parts.append(graphs.window_graph(length, int(part[6:]), causal=True))
        elif part.startswith("global") and part[6:].isdigit() and int(part[6:]) > 0:
            positions = torch.arange(0, length, int(part[6:]))
            parts.append(graphs.global_token_graph(length, positions, causal=True))
        else:
            raise ValueError(f"graph must be one of {', '.join(GRAPHS)} (or windowR for a "
                             f"radius R, globalP for every P-th position global, parts "
                             f"joined by +, and +alibi, +t5 or +rope for ALiBi's, T5's or "
                             f"rotary positions), got "
                             f"{name!r}")
    if not parts:
        raise ValueError(f"graph must name edges besides {part}, got {name!r}")
    return parts[0] if len(parts) == 1 else graphs.union(parts, length)


@dataclass
class Corpus:
    """Characters as ids, split into a training and a validation text."""

    vocab: str  # the characters, sorted: id c is vocab[c]
    train: Tensor  # (n_train,) int64 character ids
    val: Tensor  # (n_val,)


def load_corpus() -> Corpus:
    """The Python documentation's topic pages (``pydoc_data.topics``): first 90% to train."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise SystemExit("the text is CPython's pydoc_data package, which this Python install "
                         "lacks (some Linux distributions strip it)") from None

    text = "\n\n".join(topics[name] for name in sorted(topics))
    vocab = "".join(sorted(set(text)))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([lookup[ch] for ch in text], dtype=torch.long)
    cut = int(0.9 * ids.numel())
    return Corpus(vocab, ids[:cut], ids[cut:])


def windows(text: Tensor, starts: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Inputs ``text[s : s + L]`` and next-character targets ``text[s + 1 : s + L + 1]``."""
    offsets = starts.unsqueeze(1) + torch.arange(length + 1)  # (B, L + 1)
    chunk = text[offsets]
    return chunk[:, :-1], chunk[:, 1:]  # (B, L), (B, L)


class CharModel(torch.nn.Module):
    """A GraphTransformer over the positions of each sequence: next-character logits.

    The positions enter as the sinusoidal encoding ``positions`` (rows 0..L-1 for sequences
    of L characters, so as many rows as the longest sequence), or, for a run named with
    ``+alibi``, as ALiBi's bias on the scores: :math:`-m_h (i - j)` on the edge j -> i, the
    hop distance on the chain of the sequence (``pe.hop_distance``, ``pe.alibi_bias``), which
    every block adds; it has no largest length. With ``+t5``, as T5's learned bias of each
    bucket of i - j (``pe.RelativePositionBias``), one table for every block. With ``+rope``,
    as rotations of every block's queries and keys by their position in the sequence
    (``pe.RotaryPE`` over all channels of a head).
    """

    def __init__(self, vocab_size: int, graph: str, positions: Tensor, *,
                 hidden: int, heads: int, layers: int, dropout: float,
                 qk_norm: str | None = None, softcap: float | None = None,
                 sinks: bool = False, gate: str | None = None,
                 differential: bool = False) -> None:
        super().__init__()
        self.vocab_size, self.graph, self.heads = vocab_size, graph, heads
        self.relative = relative_part(graph)
        self.alibi = self.relative == "alibi"
        self.register_buffer("positions", positions, persistent=False)  # (max L, P)
        self.body = GraphTransformer(vocab_size, hidden, vocab_size, num_layers=layers,
                                     heads=heads,
                                     pe_channels=0 if self.relative else positions.size(1),
                                     dropout=dropout, attention_dropout=0.0,
                                     add_self_loops=self.relative is None,
                                     rotary=(pe.RotaryPE(hidden // heads
                                                         // (2 if differential else 1))
                                             if self.relative == "rope" else None),
                                     qk_norm=qk_norm, softcap=softcap, sinks=sinks,
                                     gate=gate, differential=differential,
                                     indexer_top_k=indexer_top_k(graph))
        self.indexer_loss: Tensor | None = None  # (the last training call's, with +topK)
        self.t5 = (pe.RelativePositionBias(heads, 32, 128, bidirectional=False)
                   if self.relative == "t5" else None)
        self._batch_graphs: dict[tuple[int, int], tuple[Tensor, Tensor | None]] = {}

    def batch_graph(self, B: int, L: int) -> tuple[Tensor, Tensor | None]:
        """The graph of B sequences of L characters, ``(2, B E)``, and its ALiBi bias
        ``(B E, H)``, or for T5's bias the offsets i - j of one sequence's edges ``(E)``
        (``None`` for sinusoids and RoPE)."""
        if (B, L) not in self._batch_graphs:
            device = self.positions.device
            edge_index = sequence_graph(self.graph, L)  # (2, E), one sequence
            bias = None
            if self.relative in ("alibi", "t5"):
                distance = pe.hop_distance(graphs.chain_graph(L), L, edge_index)  # (E,) i - j
                if self.alibi:
                    bias = pe.alibi_bias(distance, self.heads).repeat(B, 1).to(device)
                else:  # the offsets, which the learned T5 bias reads at each step
                    bias = distance.to(device)  # (E,)
            self._batch_graphs[B, L] = (graphs.repeat_graph(edge_index, L, B).to(device), bias)
        return self._batch_graphs[B, L]

    def forward(self, chars: Tensor) -> Tensor:
        B, L = chars.shape
        edge_index, bias = self.batch_graph(B, L)
        x = F.one_hot(chars.reshape(B * L), self.vocab_size).float()  # (B * L, V)
        if self.relative == "rope":  # each character's position in its sequence
            pos = torch.arange(L, device=chars.device).repeat(B)  # (B * L,)
            if self.training and self.body.attns[0].indexer is not None:
                out, self.indexer_loss = self.body(x, edge_index, pos=pos,
                                                   return_indexer_loss=True)
                return out.view(B, L, -1)
            return self.body(x, edge_index, pos=pos).view(B, L, -1)  # (B, L, V)
        if self.body.attns[0].indexer is not None:
            raise ValueError(f"a +topK run needs +rope (its indexer turns by the positions "
                             f"RoPE takes), got {self.graph!r}")
        if self.relative:
            if self.t5 is not None:  # learned: one sequence's bias, for each sequence
                bias = self.t5(bias).repeat(B, 1)  # (B E, H)
            return self.body(x, edge_index, attn_bias=bias).view(B, L, -1)  # (B, L, V)
        if L > self.positions.size(0):
            raise ValueError(f"the model encodes {self.positions.size(0)} positions, got "
                             f"sequences of {L}")
        pos = self.positions[:L].repeat(B, 1)  # (B * L, P)
        return self.body(x, edge_index, pos).view(B, L, -1)  # (B, L, V)


@dataclass
class RunResult:
    graph: str
    scores: int  # edges of one sequence
    steps: list[int] = field(default_factory=list)
    val_bpc: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    longer_bpc: float | None = None  # on sequences --extrapolate times as long
    # +rope: on those sequences with the rotations stretched to them, by each of RESCALINGS
    rescaled_bpc: dict[str, float] = field(default_factory=dict)


# ways to stretch a RoPE model's rotations over sequences K times as long as it trained on,
# with no retraining (pe.RotaryPE's documentation describes each)
RESCALINGS = ("interpolation", "NTK", "YaRN")


def rescaled_rotary(name: str, channels: int, length: int, factor: int) -> pe.RotaryPE:
    """``pe.RotaryPE(channels)``, trained on ``length`` positions, stretched to ``factor``
    times as many: position interpolation (every frequency divided by the factor), dynamic
    NTK-aware scaling (a larger base past ``length``) or YaRN (the slow planes interpolated,
    the fast ones kept, and a temperature)."""
    if name == "interpolation":
        theta = 10000.0 ** (-torch.arange(0, channels, 2, dtype=torch.float64) / channels)
        return pe.RotaryPE(channels, frequencies=theta / factor)
    if name == "NTK":
        return pe.RotaryPE(channels, ntk_factor=factor, original_length=length)
    if name == "YaRN":
        return pe.RotaryPE.yarn(channels, factor, length)
    raise ValueError(f"name must be one of {', '.join(RESCALINGS)}, got {name!r}")


def rescaled_bpc(model: CharModel, longer: tuple[Tensor, Tensor], batch_size: int,
                 length: int, factor: int) -> dict[str, float]:
    """The validation bits per character of a ``+rope`` model on the sequences ``longer``,
    ``factor`` times its training ``length``, with its rotations stretched by each of
    ``RESCALINGS`` in turn: the attentions' and, with ``+topK``, their indexers' (which turn
    fewer channels), each of its own width. The model's own are put back after. NTK is
    left out where a rotation turns only 2 channels (one plane), which it cannot rescale."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "rotary", None), pe.RotaryPE)]
    trained = [m.rotary for m in layers]
    bpc = {}
    try:
        for name in RESCALINGS:
            if name == "NTK" and min(r.dim // r.axes for r in trained) <= 2:
                continue  # its exponent g / (g - 2) needs more than 2 channels a plane group
            stretched = {dim: rescaled_rotary(name, dim, length, factor).to(
                model.positions.device) for dim in {r.dim for r in trained}}
            for m, rotary in zip(layers, trained, strict=True):
                m.rotary = stretched[rotary.dim]
            bpc[name] = validation_bpc(model, *longer, batch_size)
    finally:
        for m, rotary in zip(layers, trained, strict=True):
            m.rotary = rotary
    return bpc


@torch.no_grad()
def validation_bpc(model: CharModel, inputs: Tensor, targets: Tensor, batch_size: int) -> float:
    """Mean cross-entropy of every next-character prediction, in bits."""
    model.eval()
    total = 0.0
    for first in range(0, inputs.size(0), batch_size):
        logits = model(inputs[first:first + batch_size])
        total += F.cross_entropy(logits.flatten(0, 1), targets[first:first + batch_size].flatten(),
                                 reduction="sum").item()
    model.train()
    return total / targets.numel() / math.log(2)


def train(model: CharModel, corpus: Corpus, val: tuple[Tensor, Tensor], *, steps: int,
          batch_size: int, length: int, lr: float, eval_every: int, seed: int, desc: str,
          progress: bool) -> RunResult:
    """AdamW with a linear warm-up over the first 5% of the steps and cosine decay to 10%."""
    generator = torch.Generator().manual_seed(seed)
    device = model.positions.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    result = RunResult(desc, sequence_graph(model.graph, length).size(1))
    bar = tqdm(range(1, steps + 1), desc=desc, disable=not progress, leave=False)
    for step in bar:
        starts = torch.randint(corpus.train.numel() - length - 1, (batch_size,),
                               generator=generator)
        inputs, targets = (t.to(device) for t in windows(corpus.train, starts, length))
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        if model.indexer_loss is not None:  # (+topK: it trains the indexers alone)
            loss = loss + model.indexer_loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        synchronize(device)
        result.step_seconds.append(time.perf_counter() - start)
        if step % eval_every == 0 or step == steps:
            result.steps.append(step)
            result.val_bpc.append(validation_bpc(model, *val, batch_size))
            bar.set_postfix(val_bpc=f"{result.val_bpc[-1]:.3f}")
    return result


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host clock times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_one_layer(names: list[str], length: int, batch_size: int, hidden: int, heads: int,
                   rounds: int, device: torch.device | str = "cpu") -> list[dict]:
    """Forward+backward of one attention layer on a batch, ``GraphSelfAttention`` on each
    graph, on the sparse kernels (``backend="cpu"``; on a GPU, ``"triton"``) and as
    ``backend="auto"`` picks, against ``DenseSelfAttention`` with the same weights on
    ``[B, L, D]`` (SDPA with ``is_causal=True`` for the causal graph, with the graph's mask
    otherwise): interleaved after 3 warm-up rounds, medians. All compute the same outputs
    (checked first)."""
    torch.manual_seed(0)
    device = torch.device(device)
    sparse_backend = "cpu" if device.type == "cpu" else "triton"
    sparse = GraphSelfAttention(hidden, hidden // heads, heads, backend=sparse_backend).to(device)
    auto = GraphSelfAttention(hidden, hidden // heads, heads).to(device)
    dense = DenseSelfAttention(hidden, hidden // heads, heads).to(device)
    auto.load_state_dict(sparse.state_dict())
    dense.load_state_dict(sparse.state_dict())
    x = torch.randn(batch_size, length, hidden, device=device, requires_grad=True)  # (B, L, D)
    q_like = torch.empty(batch_size * length, heads, hidden // heads, device=device,
                         requires_grad=True)  # what the layer hands edge_attention
    calls, picks = {}, {}
    for name in names:
        edge_index = sequence_graph(name, length).to(device)
        batch_graph = graphs.repeat_graph(edge_index, length, batch_size)
        picks[name] = select_backend(q_like, batch_graph)
        calls[name, "sparse"] = lambda g=batch_graph: sparse(x.flatten(0, 1), g)
        calls[name, "auto"] = lambda g=batch_graph: auto(x.flatten(0, 1), g)
        if name == "causal":
            calls[name, "dense"] = lambda: dense(x, is_causal=True).flatten(0, 1)
        else:
            mask = graphs.to_dense_mask(edge_index, length)  # (L, L)
            calls[name, "dense"] = lambda m=mask: dense(x, mask=m).flatten(0, 1)
        want = calls[name, "dense"]()
        for way in ("sparse", "auto"):
            torch.testing.assert_close(calls[name, way](), want, atol=1e-4, rtol=1e-4)
    seconds: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for round_ in range(3 + rounds):
        for key, call in calls.items():
            synchronize(device)
            start = time.perf_counter()
            call().sum().backward()
            synchronize(device)
            if round_ >= 3:
                seconds[key].append(time.perf_counter() - start)
    rows = []
    for name in names:
        sparse_ms, auto_ms, dense_ms = (1e3 * statistics.median(seconds[name, way])
                                        for way in ("sparse", "auto", "dense"))
        rows.append({"graph": name, "sparse ms": sparse_ms, "auto ms": auto_ms,
                     "auto picks": picks[name], "dense ms": dense_ms,
                     "dense route": "is_causal" if name == "causal" else "mask"})
    return rows


def format_timing(rows: list[dict], length: int, batch_size: int) -> str:
    lines = [f"One attention layer, forward+backward, {batch_size} sequences of {length}:",
             "| graph | GraphSelfAttention, sparse kernels ms | GraphSelfAttention, auto ms "
             "| auto picks | DenseSelfAttention ms | dense call | auto / dense |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['graph']} | {r['sparse ms']:.1f} | {r['auto ms']:.1f} | "
                     f"{r['auto picks']} | {r['dense ms']:.1f} | {r['dense route']} | "
                     f"{r['auto ms'] / r['dense ms']:.2f} |")
    return "\n".join(lines)


def format_table(results: list[RunResult], length: int, extrapolate: int = 1) -> str:
    longer = extrapolate > 1
    extra = f" bits per char at L = {extrapolate * length} |" if longer else ""
    lines = [f"| graph | scores per sequence | of L^2 | validation bits per char |{extra} "
             f"step ms |", "|---|---|---|---|---|" + "---|" * longer]
    for r in results:
        extra = f" {r.longer_bpc:.3f} |" if longer else ""
        lines.append(f"| {r.graph} | {r.scores} | {r.scores / length ** 2:.1%} | "
                     f"{r.val_bpc[-1]:.3f} |{extra} "
                     f"{1e3 * statistics.median(r.step_seconds):.0f} |")
    return "\n".join(lines)


def format_rescaled(results: list[RunResult], length: int, extrapolate: int) -> str:
    """The ``+rope`` runs' bits per character at the trained length, and on sequences
    ``extrapolate`` times as long with their rotations as trained and stretched."""
    ways = list(RESCALINGS)
    lines = [f"RoPE on sequences of {extrapolate * length}, {extrapolate}x the trained "
             f"{length}, rotations stretched with no retraining (bits per char):",
             f"| graph | at L = {length} | as trained | " + " | ".join(ways) + " |",
             "|---|---|---|" + "---|" * len(ways)]
    for r in results:
        if r.rescaled_bpc:
            lines.append(f"| {r.graph} | {r.val_bpc[-1]:.3f} | {r.longer_bpc:.3f} | "
                         + " | ".join(f"{r.rescaled_bpc[w]:.3f}" if w in r.rescaled_bpc
                                      else "n/a" for w in ways) + " |")
    if any(w not in r.rescaled_bpc for r in results if r.rescaled_bpc for w in ways):
        lines.append("n/a: NTK scaling needs more than 2 rotated channels (one plane)")
    return "\n".join(lines)


def plot(results: list[RunResult], path: Path, length: int, extrapolate: int = 1) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure (pip install -e '.[plot]')")
        return False
    longer = extrapolate > 1 and all(r.longer_bpc is not None for r in results)
    bars = len(results) + longer * sum(len(r.rescaled_bpc) for r in results)
    height = max(4.0, 1.5 + 0.3 * bars)  # room for each bar's name
    fig, axes = plt.subplots(1, 2 + longer, figsize=(15 if longer else 11, height),
                             layout="constrained", width_ratios=[2, 1, 1][:2 + longer])
    curves, cost = axes[:2]
    for r in results:
        curves.plot(r.steps, r.val_bpc, marker="o", markersize=3, label=r.graph)
    curves.set(xlabel="training step", ylabel="validation bits per character",
               title=f"character model, sequences of {length}: {len(results)} attention "
                     f"graph{'s' * (len(results) != 1)}")
    curves.legend()
    curves.grid(alpha=0.3)
    names = [r.graph for r in results]
    step_ms = [1e3 * statistics.median(r.step_seconds) for r in results]
    cost.barh(names, step_ms)
    for i, r in enumerate(results):
        cost.text(step_ms[i], i, f" {r.scores} scores", va="center")
    cost.set(xlabel="median training step (ms)", title="time per step (scores per sequence)",
             xlim=(0, 1.6 * max(step_ms)))
    cost.invert_yaxis()
    if longer:  # trained at L, measured at L and at K L (and +rope runs stretched to K L)
        at = axes[2]
        rows = torch.arange(len(results), dtype=torch.float64)
        at.barh(rows - 0.2, [r.val_bpc[-1] for r in results], height=0.4,
                label=f"L = {length} (trained)")
        at.barh(rows + 0.2, [r.longer_bpc for r in results], height=0.4,
                label=f"L = {extrapolate * length}")
        stretched = [(f"{r.graph}, {way}", bpc) for r in results
                     for way, bpc in r.rescaled_bpc.items()]
        extra = torch.arange(len(stretched), dtype=torch.float64) + len(results)
        if stretched:
            at.barh(extra + 0.2, [bpc for _, bpc in stretched], height=0.4, color="C1",
                    hatch="//", label=f"L = {extrapolate * length}, rotations stretched")
        rows = torch.cat([rows, extra])
        names = names + [name for name, _ in stretched]
        at.set_yticks(rows.tolist(), names)
        at.set(xlabel="validation bits per character",
               title=f"sequences {extrapolate}x longer than trained")
        at.invert_yaxis()
        at.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=1 + bool(stretched))
        at.grid(alpha=0.3, axis="x")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def check_training_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, by name, a device torch cannot use and rates outside their ranges."""
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device must name a torch device (cpu, cuda, cuda:1, ...), got "
                     f"{args.device!r}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}, but torch {torch.__version__} sees no CUDA "
                     f"device; use --device cpu")
    try:  # a device torch knows but this machine lacks (mps, xpu, cuda:7)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, NotImplementedError) as error:
        parser.error(f"--device {args.device} is not usable here: "
                     f"{str(error).splitlines()[0].split('. ')[0]}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if args.softcap is not None and not 0 < args.softcap < float("inf"):
        parser.error(f"--softcap must be a positive number, got {args.softcap}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", default=",".join(GRAPHS),
                        help="comma-separated graphs: windowR (itself and the R characters "
                             "before), globalP (every P-th position global), causal, or "
                             "unions of them joined by + (default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=2000)
    parser.add_argument("--eval-every", type=positive_int, default=100)
    parser.add_argument("--length", type=positive_int, default=256, help="characters L")
    parser.add_argument("--batch-size", type=positive_int, default=16)
    parser.add_argument("--val-sequences", type=positive_int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=positive_int, default=64)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--qk-norm", default=None,
                        choices=["rms", "layer", "rms_per_head", "layer_per_head",
                                 "rms_across_heads", "layer_across_heads"],
                        help="normalise each head's queries and keys (QK-norm; _per_head: "
                             "with each head's own gains), or all heads' together "
                             "(_across_heads)")
    parser.add_argument("--differential", action="store_true",
                        help="differential attention in every block: two score maps per head, "
                             "attending with their difference (GraphSelfAttention("
                             "differential=True))")
    parser.add_argument("--sinks", action="store_true",
                        help="a learned sink logit per head in every block's softmax, as "
                             "GPT-OSS has (GraphSelfAttention(sinks=True))")
    parser.add_argument("--gate", default=None, choices=["elementwise", "headwise"],
                        help="gate every block's attention output by a sigmoid of each "
                             "character's features, per channel or per head "
                             "(GraphSelfAttention(gate=...))")
    parser.add_argument("--softcap", type=float, default=None,
                        help="soft-cap every attention score before its bias at "
                             "c tanh(s / c), as Gemma 2 does (c > 0)")
    parser.add_argument("--pe", type=positive_int, default=16,
                        help="columns of the sinusoidal position encoding (even)")
    parser.add_argument("--extrapolate", type=positive_int, default=4,
                        help="also measure each trained model on validation sequences this "
                             "many times --length; 1 skips it (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-rounds", type=int, default=30,
                        help="rounds of the one-layer sparse-vs-dense timing; 0 skips it")
    parser.add_argument("--out", default="out/sequence_attention",
                        help="folder of the figure (default: out/sequence_attention)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    check_training_args(parser, args)
    args.graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    if not args.graphs:
        parser.error("--graphs must name at least one graph, got none")
    if len(set(args.graphs)) < len(args.graphs):
        parser.error(f"--graphs must name each graph once, got {','.join(args.graphs)}")
    for name in args.graphs:
        try:
            sequence_graph(name, 2)
        except ValueError as error:
            parser.error(f"--graphs: {error}")
    if args.hidden % args.heads != 0:
        parser.error(f"--hidden must be divisible by --heads, got {args.hidden} and "
                     f"{args.heads}")
    width = args.hidden // args.heads  # each head's channels (with --differential, 2 maps')
    if args.differential and width % 2:
        parser.error(f"--differential splits each head's channels into two maps: --hidden / "
                     f"--heads must be even, got {width}")
    if args.differential and any(indexer_top_k(name) is not None for name in args.graphs):
        parser.error("--differential with a +topK graph: the indexers train on the attention "
                     "weights as a distribution, and differential attention's are signed")
    rope = [name for name in args.graphs if relative_part(name) == "rope"]
    if rope and (width // (2 if args.differential else 1)) % 2:
        parser.error(f"the rotary embedding of {', '.join(rope)} turns channel pairs: each "
                     f"head's {'map' if args.differential else 'channels'} "
                     f"({width // (2 if args.differential else 1)}) must be even")
    out = Path(args.out)
    if any(p.exists() and not p.is_dir() for p in (out, *out.parents)):
        parser.error(f"--out must be a folder (it gets the figure), got {args.out!r}, a file")
    if args.length < 2:
        parser.error(f"--length must be at least 2, got {args.length}")
    if args.timing_rounds < 0:
        parser.error(f"--timing-rounds must be >= 0, got {args.timing_rounds}")
    if args.pe % 2:
        parser.error(f"--pe must be even (sin and cos pairs), got {args.pe}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    corpus = load_corpus()
    print(f"text: {corpus.train.numel()} training and {corpus.val.numel()} validation "
          f"characters, {len(corpus.vocab)} distinct")
    L = args.length
    spacing = (corpus.val.numel() - L - 1) // args.val_sequences
    if spacing < 1:
        raise SystemExit(f"--val-sequences {args.val_sequences} of --length {L} do not fit "
                         f"in the {corpus.val.numel()} validation characters")
    val = tuple(t.to(args.device) for t in windows(corpus.val,
                                                   torch.arange(args.val_sequences) * spacing, L))
    if L + 1 >= corpus.train.numel():
        raise SystemExit(f"--length {L} does not fit in the {corpus.train.numel()} training "
                         f"characters")
    if args.extrapolate * L + 1 > corpus.val.numel():
        raise SystemExit(f"--extrapolate {args.extrapolate} times --length {L} does not fit in "
                         f"the {corpus.val.numel()} validation characters: give a smaller "
                         f"--extrapolate (1 skips it) or --length")
    longer = None
    if args.extrapolate > 1:  # the same starts, sequences K times as long
        K = args.extrapolate
        if (args.val_sequences - 1) * spacing + K * L + 1 > corpus.val.numel():
            starts = torch.linspace(0, corpus.val.numel() - K * L - 1, args.val_sequences)
        else:
            starts = torch.arange(args.val_sequences) * spacing
        longer = tuple(t.to(args.device) for t in windows(corpus.val, starts.long(), K * L))
    # (max L, P): the rows of every position measured, those past L never trained
    positions = pe.sinusoidal(L * max(1, args.extrapolate), args.pe).to(args.device)
    results = []
    for name in args.graphs:
        torch.manual_seed(args.seed)
        model = CharModel(len(corpus.vocab), name, positions, hidden=args.hidden,
                          heads=args.heads, layers=args.layers, dropout=args.dropout,
                          qk_norm=args.qk_norm, softcap=args.softcap,
                          sinks=args.sinks, gate=args.gate,
                          differential=args.differential).to(args.device)
        result = train(model, corpus, val, steps=args.steps, batch_size=args.batch_size,
                       length=L, lr=args.lr, eval_every=args.eval_every, seed=args.seed,
                       desc=name, progress=not args.no_progress)
        if longer is not None:
            result.longer_bpc = validation_bpc(model, *longer, args.batch_size)
            if relative_part(name) == "rope":
                result.rescaled_bpc = rescaled_bpc(model, longer, args.batch_size, L,
                                                   args.extrapolate)
        print(f"{name:>9}: validation {result.val_bpc[-1]:.3f} bits per character after "
              f"{args.steps} steps, {1e3 * statistics.median(result.step_seconds):.0f} ms per "
              f"step, {result.scores} scores per sequence"
              + ("" if longer is None else f"; on sequences of {args.extrapolate * L}: "
                                           f"{result.longer_bpc:.3f}")
              + "".join(f", {way} {bpc:.3f}" for way, bpc in result.rescaled_bpc.items()))
        results.append(result)
    print()
    print(format_table(results, L, args.extrapolate))
    if any(r.rescaled_bpc for r in results):
        print()
        print(format_rescaled(results, L, args.extrapolate))
    timing = []
    timed = [name for name in args.graphs if not relative_part(name)]  # the same edges
    if args.timing_rounds > 0 and timed:
        timing = time_one_layer(timed, L, args.batch_size, args.hidden, args.heads,
                                args.timing_rounds, args.device)
        print()
        print(format_timing(timing, L, args.batch_size))
    figure = None
    if not args.no_plot:
        path = Path(args.out) / "sequence_attention.png"
        if plot(results, path, L, args.extrapolate):
            figure = path
            print(f"figure: {path}")
    return {"results": results, "timing": timing, "figure": figure}


if __name__ == "__main__":
    main()
