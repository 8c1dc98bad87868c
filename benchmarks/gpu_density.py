"""Sparse against dense edge attention on a CUDA GPU by graph density: where "auto" should switch.

On CPU, ``edge_attention(backend="auto")`` takes the dense path from a measured crossover
density on (``graphattn.functional.select_backend``, from ``sparse_vs_dense.py``); on CUDA it
takes the fused Triton kernels whatever the density, for want of a measurement. This is that
measurement. For Erdos-Renyi graphs on N nodes (each ordered pair (j, i) an edge with
probability rho, so E ~ rho * N^2), it times

- ``edge_attention(q, k, v, edge_index, backend="triton")``: the fused kernels, the CSR
  orderings of the graph kept from call to call (as in training on one graph);
- ``edge_attention(q, k, v, edge_index, backend="dense")``: what ``"auto"`` would call instead:
  the graph's ``[N, N]`` mask built from ``edge_index`` at each call, then SDPA;

the forward (inference, ``torch.no_grad``) and the forward+backward (gradients of q, k, v),
interleaved repeat by repeat after warm-up, medians, and the peak memory of a forward+backward
(``torch.cuda.max_memory_allocated`` above what was held before). Per size it reports the
crossover: the lowest density measured from which the dense path is as fast as the kernels.
Points whose dense matrices would take more than half the free memory, or with more than
``--max-edges`` edges, are skipped with the reason.

Usage (one line):

    python benchmarks/gpu_density.py

Writes ``results/gpu_density.md``, ``.csv`` and ``.png`` (``--table-only``: the ``.md`` alone,
after each size). ``--device cpu`` runs it on CPU tensors, the triton backend in Triton's
interpreter (with ``TRITON_INTERPRET=1``; for tests, not for timing).
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402
from _report import RESULTS  # noqa: E402

from graphattn.functional import edge_attention  # noqa: E402
from graphattn.functional.dense_backend import dense_peak_bytes  # noqa: E402
from graphattn.functional.triton_kernels import clear_csr_cache  # noqa: E402

METHODS = ("triton", "dense")
MIB = gpu.MIB


def _floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_ints, default=[1024, 4096, 16384],
                        help="node counts N, comma-separated (default: 1024,4096,16384)")
    parser.add_argument("--densities", type=_floats,
                        default=[0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 0.5],
                        help="edge probabilities rho, comma-separated "
                             "(default: 0.001,0.003,0.01,0.03,0.1,0.3,0.5)")
    parser.add_argument("--heads", type=int, default=4, help="H (default: 4)")
    parser.add_argument("--channels", type=int, default=32, help="C per head (default: 32)")
    parser.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed repeats; the median is kept (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up calls (default: 2)")
    parser.add_argument("--max-edges", type=int, default=64_000_000,
                        help="skip graphs of more edges (default: 64M)")
    parser.add_argument("--device", default="cuda",
                        help="cuda, or cpu with TRITON_INTERPRET=1 for tests (default: cuda)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--table-only", action="store_true",
                        help="write the .md table alone, no .csv or .png")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_density.md")
    args = parser.parse_args(argv)
    for name in ("heads", "channels", "repeats", "max_edges"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    bad = [rho for rho in args.densities if not 0.0 < rho <= 1.0]
    if bad:
        parser.error(f"--densities must lie in (0, 1], got {bad}")
    bad = [n for n in args.sizes if n < 1]
    if bad:
        parser.error(f"--sizes must be >= 1, got {bad}")
    return args


@dataclass
class Point:
    """One graph: its size, density and the figures of each method (None: not measured)."""

    nodes: int
    density: float
    edges: int = 0
    forward_ms: dict[str, float] | None = None
    train_ms: dict[str, float] | None = None
    peak_mib: dict[str, float | None] | None = None
    note: str = ""


def random_graph(nodes: int, density: float, device: torch.device,
                 seed: int) -> torch.Tensor:
    """``[2, E]``: every ordered pair (j, i), self-loops included, an edge with probability
    ``density``, in random order."""
    gen = torch.Generator(device=device).manual_seed(seed)
    mask = torch.rand(nodes, nodes, generator=gen, device=device) < density  # (N_dst, N_src)
    dst, src = mask.nonzero().t()
    del mask
    order = torch.randperm(dst.numel(), generator=gen, device=device)
    return torch.stack([src[order], dst[order]])


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Milliseconds of one call: CUDA events on a GPU (``gpu.py``'s), the wall clock on CPU."""
    if device.type == "cuda":
        return gpu._time_ms

    def wall_ms(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    return wall_ms


def _peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory of ``fn()`` above what was held before, in MiB, with the CSR orderings
    dropped first (``gpu.py``'s); None on CPU."""
    return gpu._peak_mib(fn) if device.type == "cuda" else None


def skip_reason(nodes: int, density: float, args: argparse.Namespace, free_bytes: int | None,
                element_size: int) -> str:
    """Why a point is not measured ("" when it is)."""
    expected = density * nodes * nodes
    if expected > args.max_edges:
        return f"about {expected:,.0f} edges, more than --max-edges {args.max_edges:,}"
    dense = dense_peak_bytes(nodes, nodes, args.heads, element_size)
    if free_bytes is not None and dense > free_bytes / 2:
        return (f"the dense path needs about {dense / MIB:,.0f} MiB, more than half the "
                f"{free_bytes / MIB:,.0f} MiB free")
    return ""


def measure(point: Point, edge_index: torch.Tensor, args: argparse.Namespace,
            device: torch.device, dtype: torch.dtype) -> None:
    """Both methods on one graph, forward and forward+backward, interleaved."""
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    q, k, v = (torch.randn(point.nodes, args.heads, args.channels, generator=gen,
                           device=device).to(dtype).requires_grad_() for _ in range(3))

    def call(method: str, train: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.set_grad_enabled(train):
                out = edge_attention(q, k, v, edge_index, backend=method)
                if train:
                    out.backward(torch.ones_like(out))
                    for t in (q, k, v):
                        t.grad = None
        return run

    time_ms = _timer(device)
    for _ in range(args.warmup):
        for method in METHODS:
            call(method, False)()
            call(method, True)()
    # after the warm-up, as gpu.py does: state made lazily by first calls is not a peak
    point.peak_mib = {m: _peak_mib(call(m, True), device) for m in METHODS}
    forward = {m: [] for m in METHODS}
    train = {m: [] for m in METHODS}
    for rep in range(args.repeats):
        for method in METHODS[rep % 2:] + METHODS[:rep % 2]:
            forward[method].append(time_ms(call(method, False)))
            train[method].append(time_ms(call(method, True)))
    point.forward_ms = {m: statistics.median(t) for m, t in forward.items()}
    point.train_ms = {m: statistics.median(t) for m, t in train.items()}


def crossovers(points: list[Point]) -> list[str]:
    """Per size, the lowest density measured from which dense is as fast as the kernels (and
    stays so at every higher density measured), forward and forward+backward."""
    lines = []
    for nodes in dict.fromkeys(p.nodes for p in points):
        measured = sorted((p for p in points if p.nodes == nodes and p.train_ms),
                          key=lambda p: p.density)
        if not measured:
            continue
        parts = []
        for label, figures in (("forward", "forward_ms"), ("forward+backward", "train_ms")):
            dense_wins = [getattr(p, figures)["dense"] <= getattr(p, figures)["triton"]
                          for p in measured]
            first = len(dense_wins)
            while first > 0 and dense_wins[first - 1]:
                first -= 1
            parts.append(f"{label} from density {measured[first].density:g}"
                         if first < len(measured) else
                         f"{label} never up to {measured[-1].density:g}")
        lines.append(f"- N = {nodes:,}: dense as fast as triton {'; '.join(parts)}")
    return lines or ["- no point measured"]


def _fmt(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def rows(points: list[Point]) -> list[dict[str, str]]:
    table = []
    for p in points:
        f, t, m = p.forward_ms or {}, p.train_ms or {}, p.peak_mib or {}
        table.append({
            "N": f"{p.nodes}", "density": f"{p.density:g}", "E": f"{p.edges}",
            "triton fwd ms": _fmt(f.get("triton"), 3), "dense fwd ms": _fmt(f.get("dense"), 3),
            "dense / triton fwd": _fmt(f["dense"] / f["triton"], 2) if f else "",
            "triton fwd+bwd ms": _fmt(t.get("triton"), 3),
            "dense fwd+bwd ms": _fmt(t.get("dense"), 3),
            "dense / triton fwd+bwd": _fmt(t["dense"] / t["triton"], 2) if t else "",
            "triton peak MiB": _fmt(m.get("triton"), 1), "dense peak MiB": _fmt(m.get("dense"), 1),
            "note": p.note})
    return table


def render_markdown(points: list[Point], header: list[str]) -> str:
    table = rows(points)
    lines = ["# Sparse (fused Triton kernels) against dense edge attention on GPU, by density",
             "", *header, ""]
    if table:
        lines += ["| " + " | ".join(table[0]) + " |", "|" + "---:|" * (len(table[0]) - 1) + "---|",
                  *("| " + " | ".join(r.values()) + " |" for r in table)]
    lines += ["", "## Crossover (for backend=\"auto\" on CUDA)", "", *crossovers(points)]
    return "\n".join(lines) + "\n"


def plot(points: list[Point], path: Path, device: torch.device) -> None:
    """Forward+backward time against density, one line per method and size (log-log)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install graphattn[plot])")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, nodes in enumerate(dict.fromkeys(p.nodes for p in points)):
        measured = [p for p in points if p.nodes == nodes and p.train_ms]
        for method, style in (("triton", "-"), ("dense", "--")):
            ax.plot([p.density for p in measured], [p.train_ms[method] for p in measured],
                    style, marker="o", color=f"C{i}", label=f"{method}, N = {nodes:,}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("density E / N^2")
    ax.set_ylabel("forward+backward ms (median)")
    ax.set_title(f"edge_attention: fused kernels vs dense, {device.type.upper()}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu_density.py needs a CUDA GPU (torch.cuda.is_available() is "
              "False); nothing was measured.", file=sys.stderr)
        return 2
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    element_size = torch.empty(0, dtype=dtype).element_size()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    command = "python benchmarks/gpu_density.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    header = [f"- command: `{command.strip()}`",
              f"- device: {name}; torch {torch.__version__}, python {platform.python_version()}",
              f"- Erdos-Renyi graphs (self-loops included), H = {args.heads}, C = "
              f"{args.channels}, {args.dtype}; median of {args.repeats} interleaved repeats "
              f"(warm-up calls before: {args.warmup}); the triton backend keeps the graph's CSR "
              f"orderings from call to call, the dense one builds the [N, N] mask at each call"]
    print("\n".join(header))
    points = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    todo = [(n, rho) for n in args.sizes for rho in sorted(args.densities)]
    for nodes, density in tqdm(todo, desc="graphs"):
        point = Point(nodes, density)
        points.append(point)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        point.note = skip_reason(nodes, density, args, free, element_size)
        if point.note:
            print(f"  skip N = {nodes}, density {density:g}: {point.note}")
            continue
        edge_index = random_graph(nodes, density, device, args.seed)
        point.edges = edge_index.size(1)
        try:
            measure(point, edge_index, args, device, dtype)
        except torch.cuda.OutOfMemoryError:
            point.note = "out of memory"
        del edge_index
        clear_csr_cache()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if point.train_ms:
            print(f"  N = {nodes:>6}, density {density:<6g} E = {point.edges:>11,}  fwd+bwd "
                  f"triton {point.train_ms['triton']:9.3f} ms, dense "
                  f"{point.train_ms['dense']:9.3f} ms")
        args.out.write_text(render_markdown(points, header))
    args.out.write_text(render_markdown(points, header))
    if not args.table_only:
        table = rows(points)
        with open(args.out.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
        plot(points, args.out.with_suffix(".png"), device)
    print("\n".join(crossovers(points)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
