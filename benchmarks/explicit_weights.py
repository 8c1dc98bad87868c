"""Calls that need the attention weights themselves, on CPU: the dense backend's explicit
softmax against the sparse ``cpu`` kernels, and what ``backend="auto"`` picks.

A call needs the weights when it returns them (``return_attention=True``) or applies attention
dropout in training: the dense backend then cannot run SDPA's fused kernel and computes the
softmax explicitly, gathering each edge's weight from the dense matrix (and scattering its
dropout multiplier into it). Its crossover with the sparse kernels lies far above the fused
one, and grows with the graph; ``EXPLICIT_CROSSOVER_CPU`` (whole graphs, by size),
``EXPLICIT_MIN_DENSITY_CPU`` (blocks, training) and ``EXPLICIT_MIN_DENSITY_CPU_INFERENCE``
(blocks, the weights returned under ``torch.no_grad``) are the floors ``auto`` keeps. Three
calls:

- ``inference, weights``: ``edge_attention(..., return_attention=True)`` under ``no_grad``;
- ``training, dropout``: ``dropout_p=0.5``, forward+backward of ``out.square().sum()``;
- ``training, weights``: the weights returned, forward+backward of the output's and the
  weights' sum;

on random graphs of 512, 1024 and 2048 nodes (each pair an edge with probability d), the
complete graph, 4096 nodes in diagonal blocks (complete, causal, random at density 0.3 and 0.8)
and complete blocks of unequal sizes (padded per size group: ~4000 nodes of graphs of 9-37 and
50-150 nodes), H = 4, C = 16, fp32; interleaved rounds after warm-up, medians.

Usage (one line):
    python benchmarks/explicit_weights.py           # ~3 min on 2 cores
    python benchmarks/explicit_weights.py --quick   # three small graphs, a smoke run

Writes ``results/explicit_weights.md`` and ``.csv``.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_name  # noqa: E402
from _report import RESULTS, replot_rows, write_table  # noqa: E402

from graphattn import graphs  # noqa: E402
from graphattn.functional import edge_attention, select_backend  # noqa: E402

CALLS = ("inference, weights", "training, dropout", "training, weights")


def random_pairs(size: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """Each (source, target) pair of ``size`` nodes an edge with probability ``density``."""
    dst, src = (torch.rand(size, size, generator=gen) < density).nonzero().t()
    return torch.stack([src, dst])


def cases(quick: bool, seed: int) -> list[tuple[str, torch.Tensor, int]]:
    """(name, edge_index, nodes) of every graph measured."""
    gen = torch.Generator().manual_seed(seed)
    if quick:
        return [("random-128-d0.3", random_pairs(128, 0.3, gen), 128),
                ("complete-blocks-4x32", graphs.repeat_graph(graphs.complete_graph(32), 32, 4),
                 128),
                ("complete-padded-9-37", *unequal_complete(9, 37, 160, gen))]
    out = [(f"random-1024-d{d}", random_pairs(1024, d, gen), 1024)
           for d in (0.05, 0.1, 0.35, 0.5, 0.7, 0.9)]
    out += [(f"random-{size}-d{d}", random_pairs(size, d, gen), size)
            for size in (512, 2048) for d in (0.5, 0.7, 0.9)]
    out.append(("complete-1024", graphs.complete_graph(1024), 1024))
    for size in (32, 64, 128, 256, 512):
        for name, g in (("complete", graphs.complete_graph(size)),
                        ("causal", graphs.causal_graph(size))):
            out.append((f"{name}-blocks-{4096 // size}x{size}",
                        graphs.repeat_graph(g, size, 4096 // size), 4096))
    for size in (32, 128):
        for density in (0.3, 0.8):
            block = random_pairs(size, density, gen)
            out.append((f"random{density}-blocks-{4096 // size}x{size}",
                        graphs.repeat_graph(block, size, 4096 // size), 4096))
    out.append(("complete-padded-9-37", *unequal_complete(9, 37, 4000, gen)))
    out.append(("complete-padded-50-150", *unequal_complete(50, 150, 4000, gen)))
    return out


def unequal_complete(low: int, high: int, nodes: int,
                     gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Complete graphs of ``low``..``high`` nodes, about ``nodes`` in all, as one batch."""
    sizes = []
    while sum(sizes) < nodes:
        sizes.append(int(torch.randint(low, high + 1, (), generator=gen)))
    batch = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return graphs.batch_complete_graph(batch), sum(sizes)


def call(kind: str, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         edge_index: torch.Tensor) -> Callable[[], None]:
    """One timed call of ``kind`` (see the module docstring) on ``backend``."""
    if kind == "inference, weights":
        def run() -> None:
            with torch.no_grad():
                edge_attention(q, k, v, edge_index, backend=backend, return_attention=True)
    elif kind == "training, dropout":
        def run() -> None:
            out = edge_attention(q, k, v, edge_index, backend=backend, dropout_p=0.5)
            out.square().sum().backward()
    else:
        def run() -> None:
            out, alpha = edge_attention(q, k, v, edge_index, backend=backend,
                                        return_attention=True)
            (out.square().sum() + alpha.sum()).backward()
    return run


def measure(name: str, edge_index: torch.Tensor, nodes: int, args: argparse.Namespace,
            ) -> list[dict]:
    """The three calls on dense and cpu, interleaved, and auto's pick for each."""
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(nodes, args.heads, args.channels, generator=gen).requires_grad_()
               for _ in range(3))
    rows = []
    for kind in CALLS:
        runs = {b: call(kind, b, q, k, v, edge_index) for b in ("dense", "cpu")}
        times = {b: [] for b in runs}
        for round_ in range(args.warmup + args.rounds):
            for backend, run in runs.items():
                start = time.perf_counter()
                run()
                if round_ >= args.warmup:
                    times[backend].append((time.perf_counter() - start) * 1e3)
        training = kind.startswith("training")
        auto = select_backend(q if training else q.detach(), edge_index, needs_weights=True)
        dense, cpu = (statistics.median(times[b]) for b in ("dense", "cpu"))
        rows.append({"graph": name, "edges": edge_index.size(1),
                     "density": round(density(edge_index, nodes), 3), "call": kind,
                     "dense_ms": round(dense, 2), "cpu_ms": round(cpu, 2),
                     "dense_over_cpu": round(dense / cpu, 2), "auto": auto})
    return rows


def density(edge_index: torch.Tensor, nodes: int) -> float:
    """Edges over the pairs the dense backend works on: its blocks' (padded) pairs on a
    block-diagonal graph, else N^2."""
    from graphattn.functional.dense_backend import diagonal_blocks

    layout = diagonal_blocks(edge_index, nodes)
    pairs = nodes * nodes if layout is None else layout.pairs
    return edge_index.size(1) / pairs


def plot(rows: list[dict], path: Path) -> None:
    """Dense over cpu against density on the whole random graphs, one panel per call, a line
    per size, and the floor ``auto`` keeps there (``explicit_min_density``) as a dotted line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter

    from graphattn.functional.attention import explicit_min_density

    whole = [r for r in rows if str(r["graph"]).startswith("random-")]
    sizes = sorted({int(str(r["graph"]).split("-")[1]) for r in whole})
    fig, axes = plt.subplots(1, len(CALLS), figsize=(13, 4.2), sharey=True)
    for ax, kind in zip(axes, CALLS, strict=True):
        for n, size in enumerate(sizes):
            pts = sorted((float(r["density"]), float(r["dense_over_cpu"])) for r in whole
                         if r["call"] == kind and int(str(r["graph"]).split("-")[1]) == size)
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", color=f"C{n}", label=f"{size} nodes")
            floor = explicit_min_density(size, size, training=kind.startswith("training"))
            ax.axvline(floor, color=f"C{n}", ls=":", lw=1.2)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(yscale="log", title=kind, xlabel="density E / N^2", xlim=(0, 1.02))
        ticks = [0.25, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter(FixedFormatter([f"{t:g}" for t in ticks]))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("dense / cpu time (below 1: dense faster)")
    axes[-1].legend(title="random graph (dotted: auto's floor)", fontsize=8)
    fig.suptitle("Calls that need the weights: the dense backend's explicit softmax vs the cpu "
                 "kernels (2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three small graphs, 2 rounds")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--channels", type=int, default=16, help="channels per head")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default: 16)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None,
                        help="default: results/explicit_weights.md")
    parser.add_argument("--no-plot", action="store_true", help="no figure (.png beside --out)")
    parser.add_argument("--replot", type=Path, default=None, metavar="CSV",
                        help="draw the figure of a table this script wrote, and stop")
    args = parser.parse_args(argv)
    if args.replot is not None:
        rows = replot_rows(parser, args.replot, ("graph", "call", "density", "dense_over_cpu"))
        plot(rows, args.replot.with_suffix(".png"))
        return 0
    for name in ("rounds", "warmup", "heads", "channels"):
        if getattr(args, name) is not None and getattr(args, name) < (name != "warmup"):
            parser.error(f"--{name} must be >= {int(name != 'warmup')}, "
                         f"got {getattr(args, name)}")
    if args.rounds is None:
        args.rounds = 2 if args.quick else 16
    command = "python " + shlex.join(["benchmarks/explicit_weights.py", *(argv or sys.argv[1:])])
    header = [f"- command: `{command}`",
              f"- torch {torch.__version__}, device cpu ({cpu_name()}), "
              f"{torch.get_num_threads()} torch threads, python {platform.python_version()}",
              f"- H = {args.heads}, C = {args.channels}, fp32; {args.rounds} interleaved rounds "
              f"after {args.warmup} warm-up, medians"]
    print("\n".join(header))
    rows = []
    for name, edge_index, nodes in tqdm(cases(args.quick, args.seed), desc="graphs"):
        for row in measure(name, edge_index, nodes, args):
            rows.append(row)
            tqdm.write(" | ".join(str(v) for v in row.values()))
    note = ("`dense_over_cpu`: the dense backend's time over the `cpu` kernels' (below 1: dense "
            "is faster); `density`: edges over the (padded) pairs of the dense path; `auto`: "
            "what `select_backend(..., needs_weights=True)` picks for the call.")
    text = write_table("explicit_weights", "Calls that need the weights: dense vs cpu on CPU",
                       header, note, rows, out=args.out)
    print(text)
    if not args.no_plot:
        out = Path(args.out) if args.out is not None else RESULTS / "explicit_weights.md"
        plot(rows, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
