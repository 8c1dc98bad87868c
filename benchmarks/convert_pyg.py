"""PyG's GAT model against the same model after ``graphattn.nn.convert_pyg``, on CPU.

A user who has a PyG model does not rewrite it: ``convert_pyg(model)`` swaps its ``GATConv``
(or ``GATv2Conv``) layers for the ``GraphSelfAttention`` layers that compute the same function,
weights included, and leaves everything else (feature dropout, activations, the training loop)
as it was. This times both: PyG's ``torch_geometric.nn.models.GAT`` (``v2=False`` and
``v2=True``; 2 layers, 8 heads of 8 channels, dropout 0.6, the GAT paper's Cora sizes) and a
deep copy of it, converted, on the Planetoid graphs with their dense features, as PyG's
``Planetoid`` gives them, and with the same features as a sparse CSR tensor (both models take
it: PyG's linear layers multiply it with torch's sparse product, the converted layers with
``graphattn.functional.sparse_linear``).

Per dataset and model: a training step (forward, cross-entropy on the training nodes, backward,
Adam) and an inference call (``eval`` mode, ``torch.no_grad``), both ways interleaved in a
rotating order after warm-up rounds, medians. Before timing, the two models' outputs in eval mode
are compared (the largest difference is printed in the table).

Usage (one line):

    python benchmarks/convert_pyg.py --root datasets

Writes ``results/convert_pyg.md`` and ``.csv``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cpu_steps import cpu_header, interleaved, parse_step_args, step_parser  # noqa: E402
from _report import RESULTS, write_table  # noqa: E402

from graphattn.datasets import load_planetoid  # noqa: E402
from graphattn.nn import convert_pyg  # noqa: E402


def pyg_gat(in_channels: int, classes: int, v2: bool) -> torch.nn.Module:
    from torch_geometric.nn.models import GAT

    # hidden_channels is the concatenated width: 8 heads of 8 channels
    return GAT(in_channels, 64, num_layers=2, out_channels=classes, heads=8, dropout=0.6, v2=v2)


def train_step(model: torch.nn.Module, optimizer, x, edge_index, y, train):
    def step():
        model.train()
        optimizer.zero_grad()
        out = model(x, edge_index)  # (N, classes)
        F.cross_entropy(out[train], y[train]).backward()
        optimizer.step()
    return step


def inference(model: torch.nn.Module, x, edge_index):
    def call():
        model.eval()
        with torch.no_grad():
            model(x, edge_index)
    return call


def main(argv: list[str] | None = None) -> None:
    parser = step_parser(__doc__.split("\n\n")[0], RESULTS / "convert_pyg.md", warmup=5)
    args = parse_step_args(parser, argv, allow_none=False)
    header = cpu_header("convert_pyg.py", argv, args.threads,
                        f"median over {args.rounds} interleaved rounds after {args.warmup} "
                        f"warm-up rounds")
    rows = []
    for name in args.datasets:
        data = load_planetoid(name, root=args.root)
        x, edge_index, y, train = data.x, data.edge_index, data.y, data.train_mask
        for v2 in (False, True):
            torch.manual_seed(args.seed)
            pyg = pyg_gat(x.size(1), int(y.max()) + 1, v2)
            ours = convert_pyg(copy.deepcopy(pyg))
            pyg.eval()
            ours.eval()
            with torch.no_grad():
                difference = (pyg(x, edge_index) - ours(x, edge_index)).abs().max().item()
            for features, x_in in (("dense", x), ("sparse CSR", x.to_sparse_csr())):
                ways = {}
                for way, model in (("PyG", pyg), ("converted", ours)):
                    optimizer = torch.optim.Adam(model.parameters(), lr=0.005,
                                                 weight_decay=5e-4)
                    ways[f"{way} train"] = train_step(model, optimizer, x_in, edge_index, y,
                                                      train)
                    ways[f"{way} infer"] = inference(model, x_in, edge_index)
                ms = interleaved(ways, args.rounds, args.warmup, f"{name} v2={v2} {features}")
                for step in ("train", "infer"):
                    theirs, converted = ms[f"PyG {step}"], ms[f"converted {step}"]
                    rows.append({"dataset": name,
                                 "model": "GAT (GATv2Conv)" if v2 else "GAT (GATConv)",
                                 "features": features,
                                 "step": "training step" if step == "train" else "inference",
                                 "PyG ms": f"{theirs:.2f}", "converted ms": f"{converted:.2f}",
                                 "converted / PyG": f"{converted / theirs:.2f}",
                                 "max |out difference|": f"{difference:.1e}"})
                    print(rows[-1])
    note = ("PyG's `torch_geometric.nn.models.GAT` (2 layers, 8 heads x 8 channels, dropout "
            "0.6) against a deep copy after `graphattn.nn.convert_pyg`, on the Planetoid "
            "features dense and as a sparse CSR tensor, fp32; the last column compares the "
            "two models' eval-mode outputs (dense features) before timing.")
    print(write_table("convert_pyg", "PyG's GAT model against the same model converted",
                      header, note, rows, out=args.out))


if __name__ == "__main__":
    main()
