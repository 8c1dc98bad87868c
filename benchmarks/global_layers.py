"""Global attention layers over a mini-batch of graphs: a training step of each, with and
without attention dropout.

A graph transformer's global attention, as a layer: every node attends to every node of its own
graph. Three layers with the same weights (``state_dict`` loads across them), each trained for
one step (forward, ``out.square().sum()``, backward) on the batches of
``batched_global.py``:

- ``graph auto``: ``GraphSelfAttention(backend="auto")`` on
  ``graphs.batch_complete_graph(batch)``, the graph built in the step (on CPU ``auto`` finds the
  diagonal blocks, knows them complete from the edges' order and count, and runs them on the
  dense backend);
- ``graph cpu``: the same layer on the sparse ``cpu`` kernels;
- ``dense batch=``: ``DenseSelfAttention(x, batch=batch)``, one SDPA call per size group.

At attention dropout 0 the three outputs are checked equal first. With dropout (0.5 here) the
graph layers draw graphattn's per-edge masks (the same for both) and the dense layer
graphattn's mask of its padded weights ``[G_b, H, n_b, n_b]``; the graph layer on ``auto`` and
the dense layer then multiply an explicit softmax by the mask instead of calling SDPA's fused
kernel. Interleaved repeats after warm-up, medians.

    python benchmarks/global_layers.py           # under a minute on 2 cores
    python benchmarks/global_layers.py --quick   # one tiny batch, a smoke run

Writes ``results/global_layers.md`` and ``.csv``.
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
from batched_global import CPU, Batch, batches, device_line
from tqdm import tqdm

from graphattn import graphs
from graphattn.nn import DenseSelfAttention, GraphSelfAttention

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = ("graph auto", "graph cpu", "dense batch=")


def steps(case: Batch, channels: int, heads: int, dropout: float, seed: int = 0,
          ) -> tuple[dict[str, Callable[[], torch.Tensor]], torch.Tensor]:
    """One training step of each layer on ``case`` (each returns its output), and the input."""
    torch.manual_seed(seed)
    batch = case.batch
    x = torch.randn(batch.numel(), channels * heads, requires_grad=True)
    auto = GraphSelfAttention(x.size(1), channels, heads=heads, dropout=dropout, backend="auto")
    sparse = GraphSelfAttention(x.size(1), channels, heads=heads, dropout=dropout, backend="cpu")
    dense = DenseSelfAttention(x.size(1), channels, heads=heads, dropout=dropout)
    sparse.load_state_dict(auto.state_dict())
    dense.load_state_dict(auto.state_dict())

    def step(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            out = forward()
            out.square().sum().backward()
            return out.detach()
        return run

    return {
        "graph auto": step(lambda: auto(x, graphs.batch_complete_graph(batch))),
        "graph cpu": step(lambda: sparse(x, graphs.batch_complete_graph(batch))),
        "dense batch=": step(lambda: dense(x, batch=batch)),
    }, x


def measure(case: Batch, channels: int, heads: int, dropouts: tuple[float, ...], repeats: int,
            warmup: int) -> list[dict[str, object]]:
    rows = []
    for dropout in dropouts:
        runs, _ = steps(case, channels, heads, dropout)
        if dropout == 0.0:  # the same function: checked before it is timed
            outs = {name: run() for name, run in runs.items()}
            for name, out in outs.items():
                diff = (out - outs["graph cpu"]).abs().max().item()
                if diff > 1e-4:
                    raise AssertionError(f"{case.name}: {name} differs from graph cpu by {diff}")
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(warmup + repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                if r >= warmup:
                    times[name].append(time.perf_counter() - start)
        cpu_ms = statistics.median(times["graph cpu"]) * 1e3
        for name in LAYERS:
            ms = statistics.median(times[name]) * 1e3
            rows.append({"batch": case.name, "graphs": len(case.sizes),
                         "nodes": sum(case.sizes), "dropout": dropout, "layer": name,
                         "step_ms": round(ms, 3), "vs_graph_cpu": round(ms / cpu_ms, 3)})
    return rows


def write_table(rows: list[dict[str, object]], args: argparse.Namespace, command: str,
                path: Path) -> None:
    lines = [
        "# Global attention layers over a mini-batch of graphs: a training step",
        "",
        f"- command: `{command}`",
        f"- torch {torch.__version__}, {device_line(CPU)}, python {platform.python_version()}",
        f"- {args.heads} heads x {args.channels} channels, input width "
        f"{args.heads * args.channels}, fp32, dot-product score, output projection; "
        f"{args.repeats} interleaved repeats after {args.warmup} warm-up, medians",
        "- step: forward, `out.square().sum()`, backward. `graph auto` / `graph cpu`: "
        "`GraphSelfAttention(backend=...)` on `graphs.batch_complete_graph(batch)` (built in "
        "the step); `dense batch=`: `DenseSelfAttention(x, batch=batch)`. Same weights; at "
        "dropout 0 the outputs are checked equal first. With dropout the graph layers draw "
        "graphattn's per-edge masks, the dense layer graphattn's mask of its padded weights.",
        "- ratio: the step's time over `graph cpu`'s (below 1: faster than the sparse kernels)",
        "",
        "| batch | graphs | nodes | attention dropout | layer | step ms | / graph cpu |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['graphs']} | {r['nodes']} | {r['dropout']} | "
                     f"{r['layer']} | {r['step_ms']:.2f} | {r['vs_graph_cpu']:.2f} |")
    path.write_text("\n".join(lines) + "\n")
    with path.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny batch, 3 repeats")
    parser.add_argument("--heads", type=int, default=4, help="heads H (default: 4)")
    parser.add_argument("--channels", type=int, default=16,
                        help="channels per head C (default: 16)")
    parser.add_argument("--dropout", type=float, default=0.5,
                        help="the attention dropout timed besides 0 (default: 0.5)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per layer (default: 10, 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repeats (default: 3)")
    parser.add_argument("--output", type=Path, default=None,
                        help="table path (default: results/global_layers.md; _quick with "
                             "--quick)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 10
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1 (a median), got {args.repeats}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.heads < 1 or args.channels < 1:
        parser.error(f"--heads and --channels must be positive, got {args.heads} and "
                     f"{args.channels}")
    if not 0.0 < args.dropout < 1.0:
        parser.error(f"--dropout must be in (0, 1), got {args.dropout}")
    if args.output is None:
        args.output = RESULTS / f"global_layers{'_quick' if args.quick else ''}.md"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python benchmarks/global_layers.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv)
    print(f"command: {command.strip()}")
    print(f"torch {torch.__version__}, {device_line(CPU)}")
    rows = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for case in tqdm(batches(args.quick), desc="batches"):
        rows.extend(measure(case, args.channels, args.heads, (0.0, args.dropout),
                            args.repeats, args.warmup))
        write_table(rows, args, command.strip(), args.output)  # kept if a later batch is cut
    print(args.output.read_text())
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
