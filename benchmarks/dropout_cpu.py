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
  sparse CSR features, its masks drawn the ``graphattn`` way or the ``torch.rand >= p`` way;
  each way has its own copy of the same initial model.
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
    args = parse_step_args(parser, argv)  # (--datasets none: the masks alone)
    args.masks = args.masks.split(",")
    unknown = [m for m in args.masks if m not in MASKS]
    if unknown:
        parser.error(f"--masks: unknown size {unknown[0]!r}; choose among {', '.join(MASKS)}")
    return args


def mask_ways(shape: tuple[int, ...]) -> dict[str, Callable[[], object]]:
    ones = torch.ones(shape)
    return {"graphattn": lambda: dropout_mask(shape, P), BASELINE: lambda: former_mask(shape, P),
            "F.dropout": lambda: F.dropout(ones, P)}


def training_steps(data, seed: int) -> dict[str, Callable[[], None]]:
    """One GAT training step per way of drawing the masks, each on its own model copy: the
    masks of feature and value dropout and of the attention weights drawn by ``draw``."""
    x = data.x.to_sparse_csr()
    return {way: gat_step(data, x, seed, [(dropout_module, "dropout_mask", draw),
                                          (graphattn.functional.attention, "make_dropout_mask",
                                           draw)])
            for way, draw in (("graphattn", dropout_mask), (BASELINE, former_mask))}


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
                  f"ratio to {BASELINE}": f"{ms / medians[BASELINE]:.2f}"}
                 for way, ms in medians.items()]
    for name in args.datasets:
        data = load_planetoid(name, root=args.root)
        medians = interleaved(training_steps(data, args.seed), args.rounds, args.warmup, name)
        rows += [{"part": "GAT step", "case": name, "way": way, "ms": f"{ms:.3f}",
                  f"ratio to {BASELINE}": f"{ms / medians[BASELINE]:.2f}"}
                 for way, ms in medians.items()]
    for name in args.datasets:
        data = load_planetoid(name, root=args.root)
        medians = interleaved(transformer_steps(data, args.seed), args.rounds, args.warmup,
                              f"{name} GraphTransformer")
        rows += [{"part": "GraphTransformer step", "case": name, "way": way, "ms": f"{ms:.3f}",
                  f"ratio to {BASELINE}": f"{ms / medians[TORCH_MODULE]:.2f}"}
                 for way, ms in medians.items()]
    note = (f"`mask`: one fp32 mask, p = {P}. `GAT step`: one training step of `graphattn.nn.GAT` "
            "(8 heads x 8 channels, dropout 0.6, sparse CSR features) on the public split. "
            "\"graphattn\": `dropout_mask` (SplitMix64 from a seed drawn by torch's generator, "
            "written in one pass); \"torch.rand >= p\": a uniform draw, a comparison and a "
            "conversion (graphattn's former draw); \"F.dropout\": torch's bernoulli_ draw and "
            "scaling. `GraphTransformer step`: one training step of "
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
