"""Block-diagonal graphs on CPU: the sparse ``cpu`` kernels against the dense backend run block
by block, and what ``backend="auto"`` picks.

A batch of B sequences, images or small graphs is one graph of B diagonal blocks of L nodes that
no edge crosses (``graphs.repeat_graph``). The dense backend runs such a graph as B dense
``[H, L, L]`` blocks, B L^2 pairs instead of (B L)^2; its cost follows the pairs of the blocks,
the sparse kernels' cost the edges. This sweep times both on graphs of N = B L = 4096 nodes for
block sizes L in {16, 64, 256, 1024} and two patterns inside each block:

- ``window``: ``graphs.window_graph(L, r)`` (node i attends to i - r .. i + r), the pattern of
  local attention over sequences;
- ``random``: each (i, j) pair of a block drawn as an edge with probability d (a different draw
  in every block);

at block densities d = E / (B L^2) from 0.03 to 0.5, plus the causal (``causal_graph(L)``) and
complete blocks. Forward (under ``torch.no_grad``) and forward+backward
(``out.square().sum()``), ``edge_attention`` with H = 4, C = 32, fp32, as
``benchmarks/sparse_vs_dense.py`` measures whole graphs; interleaved rounds after warm-up,
medians. Each crossover is the block density at which the dense backend is as fast as the
``cpu`` backend, interpolated in log density between the two sweep points around it.

Usage (one line):
    python benchmarks/block_diagonal.py            # ~4 min on 2 cores
    python benchmarks/block_diagonal.py --quick    # L = 64 only, for a smoke run
    python benchmarks/block_diagonal.py --replot benchmarks/results/block_diagonal.csv

Writes ``results/block_diagonal.md``, ``.csv`` and ``.png`` (``--out`` names another ``.md``).
"""

from __future__ import annotations

import argparse
import math
import platform
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

DENSITIES = (0.03, 0.06, 0.12, 0.25, 0.5)
PHASES = ("forward", "forward+backward")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="L = 64 only (unless --sizes says), 3 rounds")
    parser.add_argument("--nodes", type=int, default=4096, help="N = B * L (default: 4096)")
    parser.add_argument("--sizes", default=None,
                        help="comma-separated block sizes L (default: 16,64,256,1024; "
                             "64 with --quick)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--channels", type=int, default=32, help="channels per head")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds (default: 7, 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds before timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "block_diagonal.md")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--replot", type=Path, default=None, metavar="CSV",
                        help="draw the figure of a table written before (its .csv), no timing")
    args = parser.parse_args(argv)
    if args.replot is not None:
        args.replot_rows = replot_rows(parser, args.replot, ("L", "block density", "dense / cpu"))
        return args
    sizes = args.sizes or ("64" if args.quick else "16,64,256,1024")
    try:
        args.sizes = [int(s) for s in sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {sizes!r}")
    if args.rounds is None:
        args.rounds = 3 if args.quick else 7
    for name in ("nodes", "heads", "channels", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    for size in args.sizes:
        if size < 2 or args.nodes % size:
            parser.error(f"--sizes: each L must be >= 2 and divide --nodes {args.nodes}, "
                         f"got {size}")
    return args


def block_graph(pattern: str, size: int, blocks: int, density: float,
                gen: torch.Generator) -> torch.Tensor:
    """``[2, E]`` edges of ``blocks`` diagonal blocks of ``size`` nodes with ``pattern``."""
    if pattern == "window":
        radius = max(0, round((density * size - 1) / 2))
        return graphs.repeat_graph(graphs.window_graph(size, radius), size, blocks)
    if pattern == "causal":
        return graphs.repeat_graph(graphs.causal_graph(size), size, blocks)
    if pattern == "complete":
        return graphs.repeat_graph(graphs.complete_graph(size), size, blocks)
    drawn = torch.rand(blocks, size, size, generator=gen) < density  # (B, L, L) [target, source]
    b, i, j = drawn.nonzero().unbind(1)
    return torch.stack([b * size + j, b * size + i])


def median_ms(ways: dict[str, Callable[[], object]], rounds: int, warmup: int) -> dict:
    """Median milliseconds of each way, rounds interleaved in a rotating order."""
    names = list(ways)
    for _ in range(warmup):
        for way in ways.values():
            way()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            ways[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def calls(q, k, v, edge_index, backend: str) -> dict[str, Callable[[], None]]:
    def forward():
        with torch.no_grad():
            edge_attention(q, k, v, edge_index, backend=backend)

    def forward_backward():
        edge_attention(q, k, v, edge_index, backend=backend).square().sum().backward()
    return {"forward": forward, "forward+backward": forward_backward}


def crossover(points: list[tuple[float, float]]) -> str:
    """The density where dense/cpu crosses 1, from (density, ratio) points by density."""
    points = sorted(points)
    if all(r <= 1 for _, r in points):
        return f"<= {points[0][0]:.3f}"
    if all(r > 1 for _, r in points):
        return f"> {points[-1][0]:.3f}"
    for (d0, r0), (d1, r1) in zip(points, points[1:], strict=False):
        if r0 > 1 >= r1:
            x0, x1, y0, y1 = math.log(d0), math.log(d1), math.log(r0), math.log(r1)
            return f"{math.exp(x0 + (x1 - x0) * y0 / (y0 - y1)):.3f}"
    return "mixed"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter
    sizes = sorted({row["L"] for row in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, phase in zip(axes, PHASES, strict=True):
        for n, size in enumerate(sizes):
            for pattern, marker in (("window", "o-"), ("random", "s--")):
                pts = sorted((row["block density"], row["dense / cpu"]) for row in rows
                             if row["L"] == size and row["pattern"] == pattern
                             and row["phase"] == phase)
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker, color=f"C{n}",
                            label=f"L = {size}, {pattern}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(xscale="log", yscale="log", title=phase, xlabel="block density E / (B L^2)")
        ticks = [0.01, 0.03, 0.1, 0.3, 1.0]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(FixedFormatter([f"{t:g}" for t in ticks]))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("dense / cpu time (below 1: dense faster)")
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle("Block-diagonal graphs, N = B L nodes: dense blocks vs sparse kernels")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_rows(rows: list[dict]) -> list[dict]:
    """The rows of a ``.csv`` this script wrote, with the numbers the figure reads."""
    for row in rows:
        row["L"] = int(row["L"])
        row["block density"], row["dense / cpu"] = (float(row["block density"]),
                                                     float(row["dense / cpu"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        plot(read_rows(args.replot_rows), args.replot.with_suffix(".png"))
        print(f"wrote {args.replot.with_suffix('.png')}")
        return 0
    command = "python benchmarks/block_diagonal.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    header = [f"command: `{command.strip()}`",
              f"torch {torch.__version__}, python {platform.python_version()}",
              f"device: CPU ({cpu_name()}), {torch.get_num_threads()} torch thread(s)",
              f"N = {args.nodes} nodes, H = {args.heads}, C = {args.channels}, fp32; "
              f"{args.rounds} interleaved rounds after {args.warmup} warm-up rounds, medians"]
    print("\n".join(header))
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.nodes, args.heads, args.channels)
    q, k, v = (torch.randn(shape, generator=gen, requires_grad=True) for _ in range(3))
    cases = [(size, pattern, d) for size in args.sizes for pattern in ("window", "random")
             for d in DENSITIES] + [(size, pattern, None) for size in args.sizes
                                    for pattern in ("causal", "complete")]
    rows, timed = [], set()
    for size, pattern, density in tqdm(cases, desc="graphs"):
        blocks = args.nodes // size
        edge_index = block_graph(pattern, size, blocks, density or 0.0, gen)
        # a window graph is timed once: small blocks round several densities to one radius
        if edge_index.size(1) == 0 or (size, pattern, edge_index.size(1)) in timed:
            continue
        if pattern == "window":
            timed.add((size, pattern, edge_index.size(1)))
        block_density = edge_index.size(1) / (blocks * size * size)
        auto = {phase: select_backend(q if phase == "forward+backward" else q.detach(),
                                      edge_index) for phase in PHASES}
        ways = {backend: calls(q, k, v, edge_index, backend) for backend in ("cpu", "dense")}
        for phase in PHASES:
            ms = median_ms({b: w[phase] for b, w in ways.items()}, args.rounds, args.warmup)
            rows.append({"L": size, "B": blocks, "pattern": pattern, "edges": edge_index.size(1),
                         "block density": round(block_density, 4), "phase": phase,
                         "cpu ms": round(ms["cpu"], 2), "dense ms": round(ms["dense"], 2),
                         "dense / cpu": round(ms["dense"] / ms["cpu"], 3),
                         "auto picks": auto[phase]})
    summary = []
    for size in args.sizes:
        for pattern in ("window", "random"):
            for phase in PHASES:
                pts = [(row["block density"], row["dense / cpu"]) for row in rows
                       if (row["L"], row["pattern"], row["phase"]) == (size, pattern, phase)]
                if pts:
                    summary.append(f"| {size} | {pattern} | {phase} | {crossover(pts)} |")
    note = ("`cpu ms`, `dense ms`: `edge_attention(..., backend=...)` per call; the dense "
            "backend runs the graph block by block. `dense / cpu` below 1: dense faster. "
            "`auto picks`: `select_backend` on these inputs (forward: q without gradient).\n\n"
            "Crossover block density (dense as fast as cpu), interpolated in log density:\n\n"
            "| L | pattern | phase | crossover |\n|---|---|---|---|\n" + "\n".join(summary))
    text = write_table("block_diagonal", "Block-diagonal graphs on CPU: sparse kernels vs "
                       "dense blocks", [f"- {h}" for h in header], note, rows, out=args.out)
    print(text.split("Crossover", 1)[1])
    if not args.no_plot:
        plot(rows, args.out.with_suffix(".png"))
        print(f"wrote {args.out.with_suffix('.png')}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
