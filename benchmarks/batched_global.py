"""Global attention inside each graph of a mini-batch: sparse (block-diagonal) or padded dense.

A graph transformer's global attention lets every node attend to every node of its own graph.
On a PyG mini-batch of graphs of n_1, ..., n_B nodes that is one of five routes, all computing
the same ``[N, H, C]`` output from the batch vector and ``[N, H, C]`` q, k, v (the tests check
that they agree):

- ``sparse``: ``edge_attention(backend="cpu")`` (the sparse kernels) on
  ``graphs.batch_complete_graph(batch)``, sum n_g^2 scores (the graph is built inside the
  timed call, as a training loop builds it per batch);
- ``auto``: the same call with ``backend="auto"``, which on CPU finds the graph's diagonal
  blocks (one per graph) and runs them on the dense backend, grouped by size as ``grouped``
  pads them;
- ``padded``: ``to_dense_batch`` to ``[B, n_max, H, C]``, ``dense_attention`` with the node mask
  as key mask, B n_max^2 scores, and the real rows taken back out;
- ``loop``: ``dense_attention`` on each graph alone, B calls;
- ``grouped``: ``dense_attention(q, k, v, batch=batch)``, which pads the graphs of each size
  group (sizes in ``(2^(b-1), 2^b]``) to the largest of the group, one call per group.

Forward (under ``torch.no_grad``) and forward+backward (``out.square().sum()``), interleaved
repeats after warm-up, medians.

    python benchmarks/batched_global.py            # ~40 s on 2 cores
    python benchmarks/batched_global.py --quick    # one small batch, for a smoke run
    python benchmarks/batched_global.py --device cuda --table-only   # on a GPU (gpu_session.sh)

Writes ``results/batched_global.md``, ``.csv`` and ``.png`` (``--table-only``: the ``.md``
alone). On CUDA the sparse route takes the ``triton`` backend (so does ``auto``), and every
timed call ends with ``torch.cuda.synchronize()``.
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
from _machine import cpu_name
from torch import Tensor
from torch_geometric.utils import to_dense_batch
from tqdm import tqdm

from graphattn import graphs
from graphattn.functional import dense_attention, edge_attention, select_backend

RESULTS = Path(__file__).resolve().parent / "results"
ROUTES = ("sparse", "auto", "padded", "loop", "grouped")
CPU = torch.device("cpu")


@dataclass
class Batch:
    """One mini-batch: a name and the number of nodes of each of its graphs."""

    name: str
    sizes: list[int]

    @property
    def batch(self) -> Tensor:
        return torch.repeat_interleave(torch.arange(len(self.sizes)), torch.tensor(self.sizes))


def batches(quick: bool, seed: int = 0) -> list[Batch]:
    """Molecule-sized graphs (ZINC's 9-37 nodes), mid-sized ones, one large graph among small
    ones (padding's worst case), and graphs of one size (its best case)."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(count: int, low: int, high: int) -> list[int]:
        return torch.randint(low, high + 1, (count,), generator=gen).tolist()

    if quick:
        return [Batch("tiny-8x3-9", uniform(8, 3, 9))]
    return [Batch("molecules-128x9-37", uniform(128, 9, 37)),
            Batch("mid-32x50-150", uniform(32, 50, 150)),
            Batch("skewed-15x20-100+1000", uniform(15, 20, 100) + [1000]),
            Batch("equal-16x256", [256] * 16)]


def routes(batch: Tensor, sizes: list[int], backend: str = "cpu",
           ) -> dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]]:
    """The five ways from q, k, v ``[N, H, C]`` to out ``[N, H, C]`` (``backend``: that of the
    sparse route)."""
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()

    def sparse(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return edge_attention(q, k, v, graphs.batch_complete_graph(batch), backend=backend)

    def auto(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return edge_attention(q, k, v, graphs.batch_complete_graph(batch), backend="auto")

    def padded(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        N, H, C = q.shape
        qkv, node_mask = to_dense_batch(torch.cat([q, k, v], dim=-1).view(N, -1), batch)
        qkv = qkv.view(*node_mask.shape, H, 3 * C)  # (B, n_max, H, 3C)
        qp, kp, vp = qkv.split(C, dim=-1)  # (B, n_max, H, C) each
        out = dense_attention(qp, kp, vp, node_mask.unsqueeze(1))  # key mask (B, 1, n_max)
        return out[node_mask]  # (N, H, C)

    def loop(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.cat([dense_attention(q[a:b], k[a:b], v[a:b])
                          for a, b in zip(bounds[:-1], bounds[1:], strict=True)])

    def grouped(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return dense_attention(q, k, v, batch=batch)

    return {"sparse": sparse, "auto": auto, "padded": padded, "loop": loop, "grouped": grouped}


def grouped_scores(sizes: list[int]) -> int:
    """Scores per head of the grouped route: each size group padded to its largest graph."""
    groups: dict[int, list[int]] = {}
    for n in sizes:
        if n > 0:
            groups.setdefault((n - 1).bit_length(), []).append(n)  # n in (2^(b-1), 2^b]
    return sum(len(group) * max(group) ** 2 for group in groups.values())


def auto_picks(q: Tensor, batch: Tensor) -> dict[str, str]:
    """The backend ``backend="auto"`` takes on the batch's graph, for a forward alone and for
    a forward+backward (q needing its gradient)."""
    edge_index = graphs.batch_complete_graph(batch)
    with torch.no_grad():
        forward = select_backend(q, edge_index)
    return {"forward": forward,
            "forward+backward": select_backend(q.detach().requires_grad_(), edge_index)}


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of ``fn()``, the device's queued work included."""
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def measure(case: Batch, heads: int, channels: int, repeats: int, warmup: int,
            device: torch.device = CPU, backend: str = "cpu",
            ) -> list[dict[str, object]]:
    """Median forward and forward+backward time of each route on one batch, and the largest
    difference of its output from the sparse route's."""
    batch = case.batch.to(device)
    N = batch.numel()
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(N, heads, channels, generator=gen).to(device).requires_grad_()
               for _ in range(3))
    fns = routes(batch, case.sizes, backend)
    with torch.no_grad():
        outs = {name: fn(q, k, v) for name, fn in fns.items()}

    def forward(fn):
        with torch.no_grad():
            fn(q, k, v)

    def forward_backward(fn):
        fn(q, k, v).square().sum().backward()
        q.grad = k.grad = v.grad = None

    times = {(name, kind): [] for name in fns for kind in ("fwd", "fwd_bwd")}
    for rep in range(warmup + repeats):
        for name, fn in fns.items():  # interleaved: every route in every repeat
            for kind, step in (("fwd", forward), ("fwd_bwd", forward_backward)):
                t = timed(lambda step=step, fn=fn: step(fn), device)
                if rep >= warmup:
                    times[name, kind].append(t)
    n_max = max(case.sizes)
    exact = sum(n * n for n in case.sizes)
    # auto picks by the graph's density and size: the dense backend runs the graph's blocks
    # (one per graph) grouped as grouped pads them; the sparse kernels score each edge once
    picks = auto_picks(q, batch)
    scores = {"sparse": exact, "auto": grouped_scores(case.sizes)
              if picks["forward+backward"] == "dense" else exact,
              "padded": len(case.sizes) * n_max * n_max, "loop": exact,
              "grouped": grouped_scores(case.sizes)}
    rows = []
    for name in fns:
        fwd = statistics.median(times[name, "fwd"]) * 1e3
        fwd_bwd = statistics.median(times[name, "fwd_bwd"]) * 1e3
        rows.append({"batch": case.name, "graphs": len(case.sizes), "nodes": N,
                     "n_max": n_max, "route": name, "scores_per_head": scores[name],
                     "auto_forward": picks["forward"],
                     "auto_forward_backward": picks["forward+backward"],
                     "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd,
                     "max_abs_diff": float((outs[name] - outs["sparse"]).abs().max())})
    for row in rows:
        sparse = next(r for r in rows if r["route"] == "sparse")
        row["fwd_vs_sparse"] = row["fwd_ms"] / sparse["fwd_ms"]
        row["fwd_bwd_vs_sparse"] = row["fwd_bwd_ms"] / sparse["fwd_bwd_ms"]
    return rows


def write_table(rows: list[dict[str, object]], args: argparse.Namespace, command: str,
                path: Path) -> None:
    lines = [
        "# Global attention over a mini-batch of graphs: sparse vs padded dense",
        "",
        f"- command: `{command}`",
        f"- torch {torch.__version__}, {device_line(args.device)}, python "
        f"{platform.python_version()}",
        f"- H = {args.heads}, C = {args.channels}, fp32, dot-product score; "
        f"{args.repeats} interleaved repeats after {args.warmup} warm-up, medians",
        "- routes, each from the batch vector and q, k, v `[N, H, C]` to out `[N, H, C]`: "
        f"`sparse` = `edge_attention(backend=\"{args.backend}\")` on "
        "`graphs.batch_complete_graph(batch)` "
        "(graph built in the call); `auto` = the same with `backend=\"auto\"`, which takes "
        "the dense backend (the graph's blocks, grouped by size) or the sparse kernels "
        f"({auto_line(rows)}); its scores per head are those of its forward+backward pick; "
        "`padded` = `to_dense_batch`, "
        "`dense_attention` with the node mask as key mask (SDPA), real rows taken out; "
        "`loop` = `dense_attention` per graph; "
        "`grouped` = `dense_attention(batch=batch)`, one padded call per size group",
        "- ratios: the route's time over the sparse route's (above 1: sparse is faster); "
        "max abs diff: of its out from the sparse route's",
        "",
        "| batch | graphs | nodes | n_max | route | scores per head | fwd ms | fwd+bwd ms | "
        "fwd / sparse | fwd+bwd / sparse | max abs diff |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['graphs']} | {r['nodes']} | {r['n_max']} | "
                     f"{r['route']} | {r['scores_per_head']:,} | {r['fwd_ms']:.2f} | "
                     f"{r['fwd_bwd_ms']:.2f} | {r['fwd_vs_sparse']:.2f} | "
                     f"{r['fwd_bwd_vs_sparse']:.2f} | {r['max_abs_diff']:.1e} |")
    path.write_text("\n".join(lines) + "\n")
    if args.table_only:
        return
    with path.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def auto_line(rows: list[dict[str, object]]) -> str:
    """What ``auto`` picked on each batch, forward / forward+backward."""
    picks = {r["batch"]: f"{r['auto_forward']} / {r['auto_forward_backward']}" for r in rows}
    return "picks, forward / forward+backward: " + "; ".join(
        f"{batch} {pick}" for batch, pick in picks.items())


def device_line(device: torch.device) -> str:
    """The device as the table names it."""
    if device.type == "cuda":
        return f"device {torch.cuda.get_device_name(device)}"
    return f"device cpu ({cpu_name()}), {torch.get_num_threads()} torch threads"


def plot(rows: list[dict[str, object]], path: Path, device: torch.device = CPU) -> None:
    """Forward+backward time of each route, grouped by batch (log scale), on ``device``."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install graphattn[plot])")
        return
    names = list(dict.fromkeys(r["batch"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(ROUTES)
    for i, route in enumerate(ROUTES):
        values = [next(r["fwd_bwd_ms"] for r in rows if r["batch"] == b and r["route"] == route)
                  for b in names]
        ax.bar([x + (i - (len(ROUTES) - 1) / 2) * width for x in range(len(names))], values,
               width, label=route)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("forward+backward ms (median)")
    ax.set_title(f"Global attention per graph of a mini-batch ({device.type.upper()})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _device(name: str) -> torch.device:
    """``--device``'s value, or argparse's error (torch raises RuntimeError, which argparse
    would not report as a bad value)."""
    try:
        return torch.device(name)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {name!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one tiny batch, 3 repeats")
    parser.add_argument("--heads", type=int, default=4, help="heads H (default: 4)")
    parser.add_argument("--channels", type=int, default=16,
                        help="channels per head C (default: 16)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per route (default: 15, 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repeats (default: 3)")
    parser.add_argument("--device", type=_device, default=torch.device("cpu"),
                        help="cpu or cuda (default: cpu)")
    parser.add_argument("--backend", default=None,
                        help="edge_attention backend of the sparse route (default: cpu, "
                             "triton with --device cuda)")
    parser.add_argument("--table-only", action="store_true",
                        help="write the .md table alone, no .csv or .png")
    parser.add_argument("--output", type=Path, default=None,
                        help="table path (default: results/batched_global.md; _quick with "
                             "--quick, _gpu with --device cuda)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 15
    if args.backend is None:
        args.backend = "triton" if args.device.type == "cuda" else "cpu"
    sparse_backends = ("reference", "cpu", "triton", "dense", "auto")
    if args.backend not in sparse_backends:
        parser.error(f"--backend must be one of {', '.join(sparse_backends)}, got "
                     f"{args.backend!r}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1 (a median), got {args.repeats}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.heads < 1 or args.channels < 1:
        parser.error(f"--heads and --channels must be positive, got {args.heads} and "
                     f"{args.channels}")
    if args.output is None:  # a GPU run does not overwrite the CPU table
        suffix = ("_quick" if args.quick else "") + ("_gpu" if args.device.type == "cuda" else "")
        args.output = RESULTS / f"batched_global{suffix}.md"
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python benchmarks/batched_global.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv)
    print(f"command: {command.strip()}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here; nothing measured")
    print(f"torch {torch.__version__}, {device_line(args.device)}")
    rows = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for case in tqdm(batches(args.quick), desc="batches"):
        rows.extend(measure(case, args.heads, args.channels, args.repeats, args.warmup,
                            args.device, args.backend))
        write_table(rows, args, command.strip(), args.output)  # kept if a later batch is cut
    if not args.table_only:
        plot(rows, args.output.with_suffix(".png"), args.device)
    print(args.output.read_text())
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
