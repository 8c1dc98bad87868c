"""Sparse bag-of-words features on CPU: a training step, dense against sparse CSR features.

One training step (forward, cross-entropy on the training nodes, backward, Adam) of
``graphattn.nn.GAT`` (the GAT paper's configuration: 8 heads x 8 channels, dropout 0.6), and
of ``graphattn.nn.GraphTransformer`` (width 64, 4 heads, 2 blocks, dropout 0.5, as
``examples/node_classification.py --model transformer`` builds it), on the public split of
each dataset, three ways, each with its own copy of the same initial model:

- ``dense features``: ``data.x`` as it loads, ``[N, F]``;
- ``sparse CSR, F.linear``: ``data.x.to_sparse_csr()``, the first layer's projection through
  ``torch.nn.functional.linear``, whose backward sorts x's entries by column to multiply by
  its transpose (how the layers projected sparse features before ``sparse_linear``);
- ``sparse CSR, sparse_linear``: the same features through
  ``graphattn.functional.sparse_linear.sparse_linear`` (the models' default), whose backward
  builds the transpose by a counting sort in one pass.

The steps are interleaved (the order rotates every round) after warm-up steps; the table gives
the median step time and its ratio to the ``sparse CSR, F.linear`` step of the same model and
dataset.

Usage (one line):

    python benchmarks/sparse_features.py

Writes ``results/sparse_features.md`` and ``.csv`` (``--out`` names another ``.md``).
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

import graphattn.nn.attention  # noqa: E402
import graphattn.nn.models  # noqa: E402
from graphattn.datasets import load_planetoid  # noqa: E402
from graphattn.functional.sparse_linear import sparse_linear  # noqa: E402

WAYS = ("dense features", "sparse CSR, F.linear", "sparse CSR, sparse_linear")
BASELINE = "sparse CSR, F.linear"
MODELS = ("GAT", "GraphTransformer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = step_parser(__doc__.split("\n\n")[0], RESULTS / "sparse_features.md", warmup=5)
    return parse_step_args(parser, argv, allow_none=False)


def training_steps(data, seed: int, model: str = "GAT") -> dict[str, Callable[[], None]]:
    """One training step of ``model`` (``"GAT"`` or ``"GraphTransformer"``) per way, each on
    its own copy of the model and its optimizer."""
    features = {"dense features": data.x, "sparse CSR, F.linear": data.x.to_sparse_csr(),
                "sparse CSR, sparse_linear": data.x.to_sparse_csr()}
    linears = {"dense features": sparse_linear, "sparse CSR, F.linear": F.linear,
               "sparse CSR, sparse_linear": sparse_linear}
    if model == "GAT":
        return {way: gat_step(data, features[way], seed,
                              [(graphattn.nn.attention, "sparse_linear", linears[way])])
                for way in WAYS}
    return {way: transformer_step(data, features[way], seed,
                                  [(graphattn.nn.models, "sparse_linear", linears[way])])
            for way in WAYS}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = cpu_header("sparse_features.py", argv,
                        args.threads, f"{args.rounds} interleaved steps of each way after "
                        f"{args.warmup} warm-up steps, medians")
    rows = []
    for name in args.datasets:
        data = load_planetoid(name, root=args.root)
        nnz = int(torch.count_nonzero(data.x))
        for model in MODELS:
            medians = interleaved(training_steps(data, args.seed, model), args.rounds,
                                  args.warmup, f"{name} {model}")
            rows += [{"model": model, "dataset": name,
                      "features": f"{data.x.size(0)} x {data.x.size(1)}, "
                      f"{100 * nnz / data.x.numel():.2f}% nonzero", "way": way,
                      "step ms": f"{ms:.2f}",
                      f"ratio to {BASELINE}": f"{ms / medians[BASELINE]:.2f}"}
                     for way, ms in medians.items()]
    note = ("One training step (forward, loss, backward, Adam) on the public split of "
            "`graphattn.nn.GAT` (8 heads x 8 channels, dropout 0.6) and of "
            "`graphattn.nn.GraphTransformer` (width 64, 4 heads, 2 blocks, dropout 0.5). "
            "\"F.linear\": the first projection's backward sorts the sparse features by column "
            "for their transpose; \"sparse_linear\" (the models' default) transposes them by a "
            "counting sort.")
    text = write_table("sparse_features", "Sparse features on CPU: a training step",
                       [f"- {h}" for h in header], note, rows, out=args.out)
    print(text.split(note, 1)[1].strip())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
