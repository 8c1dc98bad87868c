"""torch.compile on CPU: a GAT training step on Cora, eager against compiled.

One training step (forward, cross-entropy on the training nodes, backward, Adam) of
``graphattn.nn.GAT`` (the GAT paper's configuration: 8 heads x 8 channels, dropout 0.6) on
Cora's public split, eight ways, each with its own copy of the same initial model:

- ``eager``: dense ``[2708, 1433]`` features;
- ``compiled``: ``torch.compile(model)``, default mode, dense features;
- ``compiled, fallback_random``: the same with inductor's option ``fallback_random=True``: the
  graph's random numbers are drawn by torch's own generator (as eagerly) instead of
  inductor's. On CPU these are only the seeds of the dropout masks: the masks themselves are
  graphattn's operator (``graphattn::cpu_dropout_mask``) in either case;
- ``compiled, loops dropped``: the default mode with each layer dropping the given self-loops
  as eager does (``_masks_old_loops`` off), which cuts the forward into graphs at the
  data-dependent edge count: how layers compiled before they kept those loops flagged (they
  are flagged by default, so ``compiled`` and this way differ only in that);
- ``compiled fullgraph``: ``torch.compile(model, fullgraph=True)``, dense features;
- ``compiled fullgraph, fallback_random``: the same with ``fallback_random=True``;
- ``eager, sparse features``: the features as a sparse CSR tensor;
- ``compiled, fallback_random, sparse features``: ``torch.compile(model)`` (default mode, with
  ``fallback_random=True``) on the sparse CSR features: torch does not trace sparse tensors,
  so dynamo runs the frames that hold them eagerly (the model's forward and the first
  layer's projection) and compiles the rest;

and one inference step (the forward in eval mode under ``torch.no_grad``: no dropout) two
ways, ``eager, inference`` and ``compiled fullgraph, inference``, which separate what
compiling does to the dropout's random draws from what it does to the rest.

The steps are interleaved (the order rotates every round) after warm-up calls, which include
the compilation; the table gives the median step time, its ratio to the eager step of the
same kind (training or inference), and the
number of graphs dynamo makes of the model's forward (``torch._dynamo.explain``; one graph
means no graph break).

Usage (one line):

    python benchmarks/compile_cpu.py

Writes ``results/compile_cpu.md`` and ``.csv`` (``--out`` names another ``.md``).
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_name  # noqa: E402
from _report import RESULTS  # noqa: E402

from graphattn.datasets import load_planetoid  # noqa: E402
from graphattn.nn import GAT  # noqa: E402

WAYS = ("eager", "compiled", "compiled, fallback_random", "compiled, loops dropped",
        "compiled fullgraph",
        "compiled fullgraph, fallback_random",
        "eager, sparse features", "compiled, fallback_random, sparse features",
        "eager, inference", "compiled fullgraph, inference")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=None,
                        help="data root holding Cora/raw (default: graphattn's data root)")
    parser.add_argument("--rounds", type=int, default=40,
                        help="timed steps of each way (default: 40)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="steps of each way before timing, compilation included "
                             "(default: 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend (default: inductor)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "compile_cpu.md")
    args = parser.parse_args(argv)
    for name in ("rounds", "warmup", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def training_steps(data, args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """One step per way, each on its own copy of the model and its optimizer: a training
    step, or a forward in eval mode under ``torch.no_grad`` for the inference ways."""
    x, edge_index, y, train = data.x, data.edge_index, data.y, data.train_mask
    x_sparse = x.to_sparse_csr()
    steps = {}
    for way in WAYS:
        torch.manual_seed(args.seed)
        model = GAT(x.size(1), int(y.max()) + 1)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)
        model.train(not way.endswith("inference"))
        forward = model
        if way == "compiled, loops dropped":
            for layer in (model.conv1, model.conv2):
                layer._masks_old_loops = lambda returns_weights: False
        if way.startswith("compiled"):
            options = ({"fallback_random": True}  # inductor's option; others take none
                       if "fallback_random" in way and args.compile_backend == "inductor"
                       else None)
            forward = torch.compile(model, backend=args.compile_backend,
                                    fullgraph="fullgraph" in way, options=options)
            if "fullgraph" in way and torch.__version__ < (2, 10):
                forward = _with_data_dependent_sizes(forward)
        features = x_sparse if way.endswith("sparse features") else x

        def step(forward=forward, optimizer=optimizer, features=features) -> None:
            optimizer.zero_grad()
            out = forward(features, edge_index)  # (N, classes)
            F.cross_entropy(out[train], y[train]).backward()
            optimizer.step()

        def inference(forward=forward) -> None:
            with torch.no_grad():
                forward(x, edge_index)

        steps[way] = inference if way.endswith("inference") else step
    return steps


def _with_data_dependent_sizes(compiled: Callable) -> Callable:
    """Calls ``compiled`` with dynamo's ``capture_dynamic_output_shape_ops``: with it, torch
    2.8 and 2.9 trace the self-loop replacement's data-dependent edge count in one graph, as
    ``fullgraph=True`` alone does from torch 2.10 on."""
    def call(*args):
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            return compiled(*args)
    return call


def _kind_of(way: str) -> str:
    """The key of ``graphs`` in :func:`main` that a compiled way's graph count is under."""
    return next((kind for kind in ("loops dropped", "sparse features") if way.endswith(kind)),
                "")


def _eager_of(way: str) -> str:
    """The eager way a way's ratio is taken against: of the same kind of step."""
    return "eager, inference" if way.endswith("inference") else "eager"


def graph_count(data, args: argparse.Namespace, *, drop_loops: bool = False,
                sparse: bool = False) -> int:
    """The graphs dynamo makes of the model's forward (1: no break) on dense features or
    ``sparse`` CSR ones, with the layers dropping the given self-loops or not."""
    torch._dynamo.reset()
    model = GAT(data.x.size(1), int(data.y.max()) + 1)
    if drop_loops:
        for layer in (model.conv1, model.conv2):
            layer._masks_old_loops = lambda returns_weights: False
    x = data.x.to_sparse_csr() if sparse else data.x
    count = torch._dynamo.explain(model)(x, data.edge_index).graph_count
    torch._dynamo.reset()
    return count


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python benchmarks/compile_cpu.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    header = [f"command: `{command.strip()}`",
              f"torch {torch.__version__}, python {platform.python_version()}",
              f"device: CPU ({cpu_name()}), {args.threads} torch thread(s); torch.compile "
              f"backend {args.compile_backend}",
              f"{args.rounds} interleaved steps of each way after {args.warmup} warm-up steps "
              f"(compilation included), medians"]
    print("\n".join(header))
    data = load_planetoid("Cora", root=args.root)
    graphs = {"": graph_count(data, args),
              "loops dropped": graph_count(data, args, drop_loops=True),
              "sparse features": graph_count(data, args, sparse=True)}
    steps = training_steps(data, args)
    times = {way: [] for way in WAYS}
    # every compiled way adds entries to the same frames' dynamo caches (another backend,
    # options or mode each); past the default limit of 8 dynamo would run the later ways'
    # frames eagerly, silently
    with torch._dynamo.config.patch(
            recompile_limit=max(torch._dynamo.config.recompile_limit, 8 * len(WAYS))):
        for _ in tqdm(range(args.warmup), desc="warm-up (compiling)"):
            for step in steps.values():
                step()
        for i in tqdm(range(args.rounds), desc="timing"):
            for way in WAYS[i % len(WAYS):] + WAYS[:i % len(WAYS)]:
                start = time.perf_counter()
                steps[way]()
                times[way].append(time.perf_counter() - start)
    medians = {way: 1e3 * statistics.median(t) for way, t in times.items()}
    rows = [{"way": way, "step ms": f"{ms:.1f}",
             "ratio to eager": f"{ms / medians[_eager_of(way)]:.2f}",
             "graphs of the forward": (1 if "fullgraph" in way else graphs[_kind_of(way)])
             if way.startswith("compiled") else ""}
            for way, ms in medians.items()]
    lines = ["# torch.compile on CPU: a GAT training step on Cora", "",
             *(f"- {h}" for h in header), "",
             "One training step (forward, loss, backward, Adam) of `graphattn.nn.GAT` (8 heads "
             "x 8 channels, dropout 0.6) on Cora's public split; \"inference\": the forward in "
             "eval mode under `torch.no_grad` (no dropout), against the eager inference. "
             "\"graphs of the forward\": "
             "the graphs dynamo makes of the forward in the default mode "
             "(`torch._dynamo.explain`); `fullgraph=True` makes one or fails. "
             "\"fallback_random\": inductor's option `fallback_random=True`: the seeds of the "
             "dropout masks are drawn by torch's generator instead of inductor's (the masks "
             "are graphattn's operator either way).", "",
             "| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0]),
             *("| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("\n".join(lines[len(header) + 3:]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
