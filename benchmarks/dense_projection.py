"""Dense features: one product with the stacked weights ``[W^Q; W^K; W^V]`` against three.

``GraphSelfAttention`` projects dense features of self-attention by one product with the
stacked weights when they are at least ``DENSE_STACK_MIN_FEATURES`` wide and
``DENSE_STACK_MIN_RATIO`` times wider than the three outputs together, else by three
products (``graphattn/nn/attention.py``). This times both ways, interleaved, where the rule
was chosen:

- the projections alone, forward and backward (the weights' gradients; x is data), over a
  grid of node counts, feature widths and output widths: ``(8, 8, 64)`` is the first layer of
  GAT's additive score with 8 heads of 8 channels, ``(64, 64, 64)`` the dot score's,
  ``(1, 1, 7)`` GAT's output layer on Cora;
- a training step (forward, cross-entropy, backward, Adam) of ``graphattn.nn.GAT`` and of
  PyG's ``GAT`` model after ``graphattn.nn.convert_pyg``, on Cora and CiteSeer with their dense
  features.

Usage (one line):

    python benchmarks/dense_projection.py --root datasets

Writes ``results/dense_projection.md`` and ``.csv``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cpu_steps import cpu_header, interleaved, parse_step_args, step_parser  # noqa: E402
from _report import RESULTS, write_table  # noqa: E402

from graphattn.datasets import load_planetoid  # noqa: E402
from graphattn.nn import GAT, convert_pyg  # noqa: E402
from graphattn.nn import attention as layer_module  # noqa: E402

GRID = [(2708, 64), (2708, 128), (2708, 256), (2708, 512), (2708, 1433), (3327, 3703),
        (19717, 64), (19717, 128), (19717, 256), (19717, 500), (100000, 128), (100000, 256)]
OUTPUTS = [(8, 8, 64), (64, 64, 64), (1, 1, 7)]


def projections(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
                stacked: bool):
    """Forward and backward of the three projections of x, one way."""
    widths = [w.size(0) for w in weights]
    grads = [torch.ones(x.size(0), width) for width in widths]

    def call():
        if stacked:
            outs = F.linear(x, torch.cat(weights), torch.cat(biases)).split(widths, dim=-1)
        else:
            outs = [F.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
        torch.autograd.backward(outs, grads)
        for p in weights + biases:
            p.grad = None
    return call


def with_rule(stacked: bool, step):
    """``step`` with the layer's rule as it is (stacked) or never stacking."""
    def call():
        kept = layer_module.DENSE_STACK_MIN_FEATURES
        layer_module.DENSE_STACK_MIN_FEATURES = kept if stacked else float("inf")
        try:
            step()
        finally:
            layer_module.DENSE_STACK_MIN_FEATURES = kept
    return call


def gat_step(model: torch.nn.Module, x, edge_index, y, train):
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)

    def step():
        model.train()
        optimizer.zero_grad()
        F.cross_entropy(model(x, edge_index)[train], y[train]).backward()
        optimizer.step()
    return step


def main(argv: list[str] | None = None) -> None:
    parser = step_parser(__doc__.split("\n\n")[0], RESULTS / "dense_projection.md", warmup=5)
    parser.set_defaults(threads=2, rounds=30)
    args = parse_step_args(parser, argv)
    header = cpu_header("dense_projection.py", argv, args.threads,
                        f"median over {args.rounds} interleaved rounds after {args.warmup} "
                        f"warm-up rounds")
    rows = []
    gen = torch.Generator().manual_seed(args.seed)
    for nodes, features in GRID:
        x = torch.randn(nodes, features, generator=gen)
        for outputs in OUTPUTS:
            weights = [torch.randn(o, features, generator=gen).requires_grad_() for o in outputs]
            biases = [torch.randn(o, generator=gen).requires_grad_() for o in outputs]
            ms = interleaved({way: projections(x, weights, biases, way == "stacked")
                              for way in ("three", "stacked")},
                             args.rounds, args.warmup, f"{nodes} x {features}")
            rule = features >= max(layer_module.DENSE_STACK_MIN_FEATURES,
                                   layer_module.DENSE_STACK_MIN_RATIO * sum(outputs))
            rows.append({"what": f"projections, N = {nodes}, F = {features}",
                         "outputs": "+".join(map(str, outputs)),
                         "three ms": f"{ms['three']:.3f}", "stacked ms": f"{ms['stacked']:.3f}",
                         "stacked / three": f"{ms['stacked'] / ms['three']:.2f}",
                         "the layer takes": "stacked" if rule else "three"})
            print(rows[-1])
    for name in args.datasets:
        data = load_planetoid(name, root=args.root)
        x, edge_index, y, train = data.x, data.edge_index, data.y, data.train_mask
        classes = int(y.max()) + 1
        from torch_geometric.nn.models import GAT as PyGGAT

        torch.manual_seed(args.seed)
        models = {"graphattn.nn.GAT": GAT(x.size(1), classes),
                  "PyG GAT, converted": convert_pyg(PyGGAT(x.size(1), 64, num_layers=2,
                                                           out_channels=classes, heads=8,
                                                           dropout=0.6))}
        ways = {}
        for model_name, model in models.items():
            step = gat_step(model, x, edge_index, y, train)
            ways[f"{model_name} three"] = with_rule(False, step)
            ways[f"{model_name} stacked"] = with_rule(True, step)
        ms = interleaved(ways, args.rounds, args.warmup, name)
        for model_name in models:
            three, stacked = ms[f"{model_name} three"], ms[f"{model_name} stacked"]
            rows.append({"what": f"{model_name} training step, {name} (dense features)",
                         "outputs": "", "three ms": f"{three:.2f}",
                         "stacked ms": f"{stacked:.2f}",
                         "stacked / three": f"{stacked / three:.2f}", "the layer takes": ""})
            print(rows[-1])
    note = (f"fp32. Projections: forward and backward of `F.linear` by three weights, or one "
            f"by their concatenation followed by a split; \"the layer takes\": the way "
            f"`GraphSelfAttention` chooses (stacked from "
            f"{layer_module.DENSE_STACK_MIN_FEATURES} features and "
            f"{layer_module.DENSE_STACK_MIN_RATIO}x the outputs). GAT steps: the whole step "
            f"with the layer's rule against three products always.")
    print(write_table("dense_projection", "Dense projections: stacked against three products",
                      header, note, rows, out=args.out))


if __name__ == "__main__":
    main()
