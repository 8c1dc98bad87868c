"""Dropout masks on CPU: graphattn's counter-based draw against torch's, alone and in training.

Two parts, each interleaved (the order rotates every round) after warm-up, medians:

- ``mask``: drawing one inverted-dropout mask (0 or ``1 / (1 - p)``, fp32) of the sizes a
  citation model draws, three ways: ``graphattn`` (``graphattn.functional.dropout_mask``:
  SplitMix64 from one seed that torch's generator draws, written in the mask's dtype in one
  pass); ``torch.rand >= p`` (a uniform draw, a comparison and the conversion to a float mask:
  how graphattn drew its masks before); ``F.dropout`` (of a tensor of ones: torch's
  ``bernoulli_`` and the scaling, what ``torch.nn.Dropout`` costs).
- ``GAT step``: one training step (forward, cross-entropy on the training nodes, backward,
  Adam) of ``graphattn.nn.GAT`` (8 heads x 8 channels, dropout 0.6) on the public split with
  sparse CSR features, its masks drawn the ``graphattn`` way (the attention weights' mask
  drawn by the kernels where they use it), the same with the attention weights' mask written
  to memory and read by the kernels (``graphattn, attention mask in memory``), or the
  ``torch.rand >= p`` way (every mask in memory: graphattn's former way); each way has its own
  copy of the same initial model.
- ``edge_attention``: forward and backward of ``edge_attention(..., dropout_p=0.6,
  backend="cpu")`` (fp32, 8 heads x 8 channels) on a random graph of ``--graph-nodes`` nodes
  and ``--graph-edges`` edges (default 100,000 and 1,000,000, in random order), three ways:
  ``graphattn`` (the kernels draw each entry of the attention weights' mask where they use it,
  from a seed: nothing of size ``[E, H]``), ``mask in memory`` (the same mask written to an
  ``[E, H]`` tensor per call and read by the kernels: how they ran before) and ``no dropout``;
  ratios to ``mask in memory``. Fewer rounds (``--graph-rounds``, default 15): a call takes
  a few hundred ms.
- ``GraphTransformer step``: one training step of ``graphattn.nn.GraphTransformer`` as
  ``examples/node_classification.py --model transformer`` builds it (width 64, 4 heads, 2
  blocks, dropout 0.5) on the same split and features, the dropout of its feed-forward inner
  units drawn by its own module (``graphattn``: ``graphattn.functional.dropout``'s mask) or by
  ``torch.nn.Dropout`` (``bernoulli_``) put in its place; every other mask is graphattn's in
  both.

Ratios are to the ``torch.rand >= p`` way of the same row group (``torch.nn.Dropout`` for the
GraphTransformer step).

Usage (one line):
    python benchmarks/dropout_cpu.py

Writes ``results/dropout_cpu.md`` and ``.csv`` (``--out`` names another ``.md``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cpu_steps import (  # noqa: E402
    cpu_header,
    gat_step,
    interleaved,
    parse_step_args,
    step_parser,
    transformer_step,
)
from _report import RESULTS, write_table  # noqa: E402

import graphattn.functional.attention  # noqa: E402
from graphattn.datasets import load_planetoid  # noqa: E402
from graphattn.functional import cpu as cpu_module  # noqa: E402
from graphattn.functional import dropout_mask  # noqa: E402

dropout_module = sys.modules["graphattn.functional.dropout"]  # (the package exports dropout())
BASELINE = "torch.rand >= p"
TORCH_MODULE = "torch.nn.Dropout"
P = 0.6  # the GAT paper's dropout
MASKS = {  # what a GAT on Cora draws per step, a PubMed-sized one, and a large one
    "Cora features 2708x64": (2708, 64),
    "Cora attention 13264x8": (13264, 8),
    "PubMed attention 108365x8": (108365, 8),
    "10M entries": (10_000_000,),
}


def former_mask(shape, p, *, device=None, dtype=torch.float32):
    """How graphattn drew a mask before: ``torch.rand(shape) >= p``, as a float multiplier."""
    keep = torch.rand(shape, device=device, dtype=torch.float32).ge(p)
    return keep.to(dtype).mul_(1.0 / (1.0 - p))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = step_parser(__doc__.split("\n\n")[0], RESULTS / "dropout_cpu.md", warmup=5)
    parser.add_argument("--masks", default=",".join(MASKS),
                        help=f"comma-separated mask sizes among: {', '.join(MASKS)}")
    parser.add_argument("--graph-nodes", type=int, default=100_000,
                        help="nodes of the edge_attention part's random graph (default: "
                             "100000; 0: no edge_attention part)")
    parser.add_argument("--graph-edges", type=int, default=1_000_000,
                        help="its edges (default: 1000000)")
    parser.add_argument("--graph-rounds", type=int, default=15,
                        help="timed rounds of the edge_attention part (default: 15)")
    args = parse_step_args(parser, argv)  # (--datasets none: the masks alone)
    for name in ("graph_nodes", "graph_edges", "graph_rounds"):
        if getattr(args, name) < (0 if name == "graph_nodes" else 1):
            parser.error(f"--{name.replace('_', '-')} must be >= "
                         f"{0 if name == 'graph_nodes' else 1}, got {getattr(args, name)}")
    args.masks = args.masks.split(",")
    unknown = [m for m in args.masks if m not in MASKS]
    if unknown:
        parser.error(f"--masks: unknown size {unknown[0]!r}; choose among {', '.join(MASKS)}")
    return args


def mask_ways(shape: tuple[int, ...]) -> dict[str, Callable[[], object]]:
    ones = torch.ones(shape)
    return {"graphattn": lambda: dropout_mask(shape, P), BASELINE: lambda: former_mask(shape, P),
            "F.dropout": lambda: F.dropout(ones, P)}


def mask_in_memory(draw: Callable[..., torch.Tensor]) -> Callable[..., object]:
    """The ``cpu`` backend with the attention weights' mask written to an ``[E, H]`` tensor
    and read by its kernels: for the parameters of a seeded mask that ``edge_attention``
    hands it, the mask ``draw((E, H), P)`` (``None``: the mask those parameters stand for)."""
    def backend(q, k, v, edge_index, *, dropout_mask, **options):
        if dropout_mask is not None and dropout_mask.dtype == torch.int64:
            shape = (edge_index.size(1), v.size(1))
            dropout_mask = (cpu_module.seeded_mask_from(dropout_mask, shape, v.dtype)
                            if draw is None else draw(shape, P, dtype=v.dtype))
        return cpu_module.cpu_edge_attention(q, k, v, edge_index, dropout_mask=dropout_mask,
                                             **options)
    return backend


def backends_with(backend: Callable[..., object]) -> dict[str, Callable[..., object]]:
    """``edge_attention``'s backends, ``backend`` as ``"cpu"``."""
    return {**graphattn.functional.attention.BACKENDS, "cpu": backend}


def training_steps(data, seed: int) -> dict[str, Callable[[], None]]:
    """One GAT training step per way of drawing the masks, each on its own model copy: the
    masks of feature and value dropout drawn by ``draw``, and the attention weights' mask
    drawn in the kernels or written to memory."""
    x = data.x.to_sparse_csr()
    attention = graphattn.functional.attention
    return {
        "graphattn": gat_step(data, x, seed, []),
        "graphattn, attention mask in memory": gat_step(
            data, x, seed, [(attention, "BACKENDS", backends_with(mask_in_memory(None)))]),
        BASELINE: gat_step(data, x, seed, [
            (dropout_module, "dropout_mask", former_mask),
            (attention, "make_dropout_mask", former_mask),
            (attention, "BACKENDS", backends_with(mask_in_memory(former_mask)))]),
    }


def attention_calls(nodes: int, edges: int, seed: int) -> dict[str, Callable[[], None]]:
    """Forward and backward of the cpu backend with attention dropout P on a random graph,
    the mask drawn in the kernels, written to memory and read, or no dropout."""
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, nodes, (2, edges), generator=gen)
    q, k, v = (torch.randn(nodes, 8, 8, generator=gen).requires_grad_() for _ in range(3))
    attention = graphattn.functional.attention
    in_memory = backends_with(mask_in_memory(None))

    def call(p: float, backends: dict | None = None) -> Callable[[], None]:
        def run():
            kept = attention.BACKENDS
            attention.BACKENDS = backends or kept
            try:
                out = attention.edge_attention(q, k, v, edge_index, dropout_p=p, backend="cpu")
                torch.autograd.grad(out.sum(), (q, k, v))
            finally:
                attention.BACKENDS = kept
        return run
    return {"graphattn": call(P), "mask in memory": call(P, in_memory),
            "no dropout": call(0.0)}


def transformer_steps(data, seed: int) -> dict[str, Callable[[], None]]:
    """One GraphTransformer training step per way of drawing the feed-forward dropout, each on
    its own copy of the same initial model."""
    x = data.x.to_sparse_csr()

    def torch_dropout(model):
        for ffn in model.ffns:
            ffn[2] = torch.nn.Dropout(ffn[2].p)
    return {"graphattn": transformer_step(data, x, seed, []),
            TORCH_MODULE: transformer_step(data, x, seed, [], prepare=torch_dropout)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    header = cpu_header("dropout_cpu.py", argv,
                        args.threads, f"p = {P}, fp32; {args.rounds} interleaved rounds after "
                        f"{args.warmup} warm-up rounds, medians")
    rows = []
    for name in args.masks:
        medians = interleaved(mask_ways(MASKS[name]), args.rounds, args.warmup, name)
        rows += [{"part": "mask", "case": name, "way": way, "ms": f"{ms:.3f}",
                  "ratio to baseline": f"{ms / medians[BASELINE]:.2f}"}
                 for way, ms in medians.items()]
    for name in args.datasets:
        data = load_planetoid(name, root=args.root)
        medians = interleaved(training_steps(data, args.seed), args.rounds, args.warmup, name)
        rows += [{"part": "GAT step", "case": name, "way": way, "ms": f"{ms:.3f}",
                  "ratio to baseline": f"{ms / medians[BASELINE]:.2f}"}
                 for way, ms in medians.items()]
    if args.graph_nodes > 0:
        case = f"random graph, {args.graph_nodes} nodes, {args.graph_edges} edges"
        medians = interleaved(attention_calls(args.graph_nodes, args.graph_edges, args.seed),
                              args.graph_rounds, min(args.warmup, 2), "edge_attention")
        rows += [{"part": "edge_attention", "case": case, "way": way, "ms": f"{ms:.3f}",
                  "ratio to baseline": f"{ms / medians['mask in memory']:.2f}"}
                 for way, ms in medians.items()]
    for name in args.datasets:
        data = load_planetoid(name, root=args.root)
        medians = interleaved(transformer_steps(data, args.seed), args.rounds, args.warmup,
                              f"{name} GraphTransformer")
        rows += [{"part": "GraphTransformer step", "case": name, "way": way, "ms": f"{ms:.3f}",
                  "ratio to baseline": f"{ms / medians[TORCH_MODULE]:.2f}"}
                 for way, ms in medians.items()]
    note = ("Ratios are to each part's baseline: \"torch.rand >= p\" (mask, GAT step), "
            "\"mask in memory\" (edge_attention), \"torch.nn.Dropout\" (GraphTransformer "
            f"step). `mask`: one fp32 mask, p = {P}. `GAT step`: one training step of "
            "`graphattn.nn.GAT` "
            "(8 heads x 8 channels, dropout 0.6, sparse CSR features) on the public split. "
            "\"graphattn\": `dropout_mask` (SplitMix64 from a seed drawn by torch's generator, "
            "written in one pass; the attention weights' mask drawn by the kernels where they "
            "use it, from a seed); \"graphattn, attention mask in memory\": the same masks, "
            "the attention weights' written to an [E, H] tensor that the kernels read; "
            "\"torch.rand >= p\": a uniform draw, a comparison and a "
            "conversion, every mask in memory (graphattn's former way); \"F.dropout\": "
            "torch's bernoulli_ draw and scaling. `edge_attention`: forward and backward of "
            "the cpu backend, fp32, 8 heads x 8 channels, attention dropout "
            f"{P}, on a random graph ({args.graph_rounds} rounds): the mask drawn in the "
            "kernels (\"graphattn\"), the same mask written to memory and read (\"mask in "
            "memory\"), or no dropout. "
            "`GraphTransformer step`: one training step of "
            "`graphattn.nn.GraphTransformer` (width 64, 4 heads, 2 blocks, dropout 0.5), its "
            "feed-forward dropout drawn by its own module (\"graphattn\") or by "
            "`torch.nn.Dropout` (bernoulli_), every other mask graphattn's; its ratio is to the "
            "torch.nn.Dropout way.")
    text = write_table("dropout_cpu", "Dropout masks on CPU", [f"- {h}" for h in header], note,
                       rows, out=args.out)
    print(text.split(note, 1)[1].strip())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
