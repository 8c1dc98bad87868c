"""Tiles of the fused Triton kernels on a CUDA GPU: which ``launch_tiles`` run fastest.

On each graph (default: the 1M-edge and the 50M-edge graphs of ``benchmarks/gpu.py``, each
window graph after the random graph of its size, then the PubMed graph, skipped with the
reason where its raw files are not found) and
for each candidate set of tiles (``BLOCK_E`` edges per step, ``BLOCK_H`` heads per program,
warps per program, ``BLOCK_N`` nodes per program: 1 for the one-node kernels, more for the
row-block kernels; or, on graphs that suit them, the block-sparse kernels in tiles of 32 or
64 with their warps; see ``graphattn.functional.triton_kernels.launch_tiles``), times
``edge_attention(q, k, v, edge_index, backend="triton")``: the forward under ``torch.no_grad``
and the forward+backward, with the graph's CSR orderings kept from call to call (as in
training on one graph). Candidates are interleaved repeat by repeat (rotating order) after
warm-up; the table gives medians and each candidate's time over that of the default tiles
(``launch_config``), < 1 being faster, and how far its out is from the default tiles' (max abs
difference: another summation order, so rounding only). Each candidate compiles its own
kernels during the warm-up of the first graph.

Usage (one line; ``--quick``: the 1M-edge graph and 3 repeats):

    python benchmarks/triton_tuning.py [--quick]

Writes ``results/triton_tuning.md`` (or ``--out``), after each graph. Exits with a message on a
machine without CUDA.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu  # noqa: E402  (graphs and timing of benchmarks/gpu.py)

from graphattn.functional import edge_attention  # noqa: E402
from graphattn.functional import triton_blocks as tb  # noqa: E402
from graphattn.functional import triton_kernels as tk  # noqa: E402

# (block_e, block_h, num_warps) around the default tiles of H = 4, C = 32 (16, 4, 4): fewer
# and more edges per step, fewer heads per program (more programs), fewer and more warps.
# Few edges per step suit graphs of low degree (PubMed's mean in-degree is 4.5).
CANDIDATES = (
    (4, 4, 1), (4, 4, 2), (8, 4, 2), (8, 4, 4), (16, 4, 2), (16, 4, 8), (32, 4, 4),
    (32, 4, 8), (8, 2, 1), (16, 2, 2), (16, 2, 4), (32, 2, 4), (16, 1, 1), (32, 1, 1),
    (32, 1, 2), (64, 1, 2),
)
# (block_n, block_h, num_warps) of the row-block kernels: 4 to 64 nodes per program, one edge
# of each per step, around their default warps (one per 256 values of the tile: 8 nodes x 4
# heads x 32 channels on 4 warps); the nodes of more than 256 edges (heavy_degree) go to the
# one-node kernels with their default BLOCK_E.
ROW_BLOCK_CANDIDATES = (
    (8, 4, 4), (8, 4, 2), (8, 4, 8), (4, 4, 2), (16, 4, 8), (16, 4, 4), (32, 4, 8),
    (64, 4, 8), (16, 2, 4), (32, 1, 4),
)
# (block_sparse, num_warps) of the block-sparse kernels: tiles of 32 and 64 on their default
# warps (4 on tensor cores, 8 for full fp32 products) and around them; tried only on graphs
# whose layout they take (no repeated edge, tiles at least MIN_FILL full: the window graphs).
BLOCK_SPARSE_CANDIDATES = ((32, 4), (32, 8), (32, 2), (64, 4), (64, 8))
# the goals' graphs first, each window graph after the random graph of its size
GRAPHS = ("random-1m", "window-1m", "window-wide-1m", "local-50m", "random-50m", "window-50m",
          "pubmed")


class Tiles(NamedTuple):
    """One candidate, as ``launch_tiles`` takes it; ``block_sparse`` 0: the CSR kernels."""

    block_e: int
    block_h: int
    num_warps: int
    block_n: int
    block_sparse: int = 0


@dataclass
class Row:
    graph: str
    num_nodes: int
    num_edges: int
    tiles: Tiles  # as launched
    forward_ms: float = math.nan
    train_ms: float = math.nan
    max_diff: float = math.nan
    note: str = ""
    forward_times: list[float] = field(default_factory=list, repr=False)
    train_times: list[float] = field(default_factory=list, repr=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true",
                        help="the 1M-edge graph only, 3 repeats")
    parser.add_argument("--graphs", default=None,
                        help=f"comma-separated, from {', '.join(GRAPHS)} (default: all)")
    parser.add_argument("--heads", type=int, default=4, help="H (default: 4)")
    parser.add_argument("--channels", type=int, default=32, help="C per head (default: 32)")
    parser.add_argument("--dtype", choices=sorted(gpu.DTYPES), default="fp32")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up calls (default: 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per candidate (default: 5, --quick 3)")
    parser.add_argument("--data-root", default=None,
                        help="where the Planetoid raw files are (default: as benchmarks/gpu.py)")
    parser.add_argument("--out", default=str(gpu.RESULTS / "triton_tuning.md"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    names = args.graphs.split(",") if args.graphs else (["random-1m"] if args.quick
                                                         else list(GRAPHS))
    unknown = [n for n in names if n not in gpu.GRAPHS]
    if unknown:
        parser.error(f"--graphs: unknown {unknown}; choose from {list(gpu.GRAPHS)}")
    args.graph_names = names
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and "
                     f"{args.warmup}")
    return args


def candidates(heads: int, channels: int) -> list[Tiles]:
    """The candidate :class:`Tiles`, ``block_h`` capped at the next power of 2 >= H as the
    kernels cap it, without repeats; the default tiles (``launch_config``'s) first, then the
    one-node kernels', the row-block kernels' and the block-sparse kernels' (whose other
    fields are the defaults')."""
    cap = 1 << max(0, heads - 1).bit_length()
    default = tk.launch_config(heads, channels)
    seen = []
    one_node = [(block_e, block_h, warps, 1) for block_e, block_h, warps in CANDIDATES]
    row_blocks = [(default.block_e, block_h, warps, block_n)
                  for block_n, block_h, warps in ROW_BLOCK_CANDIDATES]
    for block_e, block_h, warps, block_n in (
            (default.block_e, default.block_h, default.num_warps, 1), *one_node, *row_blocks):
        tiles = Tiles(block_e, min(block_h, cap), warps, block_n)
        if tiles not in seen:
            seen.append(tiles)
    return seen + [Tiles(default.block_e, min(default.block_h, cap), warps, 1, block)
                   for block, warps in BLOCK_SPARSE_CANDIDATES]


def _tiles(tiles: Tiles) -> tk.launch_tiles:
    return tk.launch_tiles(block_e=tiles.block_e, block_h=tiles.block_h,
                           num_warps=tiles.num_warps, block_n=tiles.block_n,
                           block_sparse=tiles.block_sparse or None)


def measure(graph: gpu.Graph, tiles_list: list[Tiles], heads: int,
            channels: int, dtype: torch.dtype, warmup: int, repeats: int,
            timer: Callable[[Callable[[], object]], float]) -> list[Row]:
    """Every candidate on one graph, interleaved repeat by repeat (rotating order); the first
    candidate (the default tiles) is the reference of the max abs differences, which stay NaN
    when it fails. Block-sparse candidates the graph does not suit are not run (the CSR
    kernels would run instead)."""
    q, k, v = gpu._qkv(graph, heads, channels, dtype)
    rows = [Row(graph.name, graph.num_nodes, graph.num_edges, Tiles(*t)) for t in tiles_list]
    suits = {block: tb.block_layout(graph.edge_index, graph.num_nodes, graph.num_nodes,
                                    block) is not None
             for block in {r.tiles.block_sparse for r in rows if r.tiles.block_sparse}}

    def forward():
        with torch.no_grad():
            return edge_attention(q, k, v, graph.edge_index, backend="triton")

    def train():
        out = edge_attention(q, k, v, graph.edge_index, backend="triton")
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    reference = None
    live = []
    for row in rows:
        if row.tiles.block_sparse and not suits[row.tiles.block_sparse]:
            row.note = (f"not run: a repeated edge, or tiles under {tb.MIN_FILL:.3g} full "
                        f"(the CSR kernels would run)")
            continue
        try:
            with _tiles(row.tiles):
                out = forward()  # compiles the forward kernel
                for _ in range(warmup):
                    forward()
                    train()
        except Exception as err:  # in the table; the other candidates still run
            row.note = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:80]}"
            print(f"  {row.tiles}: {row.note}", file=sys.stderr)
            continue
        if row is rows[0]:  # the default tiles; if they failed, no difference is measured
            reference = out.float()
        if reference is not None:
            row.max_diff = (out.float() - reference).abs().max().item() if out.numel() else 0.0
        live.append(row)
        del out
    for rep in range(repeats):
        order = live[rep % len(live):] + live[:rep % len(live)] if live else []
        for row in order:
            with _tiles(row.tiles):
                row.forward_times.append(timer(forward))
                row.train_times.append(timer(train))
    for row in live:
        row.forward_ms = statistics.median(row.forward_times)
        row.train_ms = statistics.median(row.train_times)
    return rows


def render_markdown(header: list[str], rows: list[Row], skipped: list[str]) -> str:
    lines = ["# Tiles of the fused Triton kernels", "", *header, ""]
    for name in dict.fromkeys(r.graph for r in rows):
        group = [r for r in rows if r.graph == name]
        default = group[0]
        lines += [f"## {name}: N = {default.num_nodes:,}, E = {default.num_edges:,}", "",
                  "| kernels | BLOCK_N | BLOCK_E | BLOCK_H | warps | fwd ms | fwd+bwd ms "
                  "| fwd / default | fwd+bwd / default | max abs diff to default | note |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in group:
            note = "default" if r is default and not r.note else r.note
            t = r.tiles
            kind, csr = ((f"block-sparse {t.block_sparse}", ("", "", "")) if t.block_sparse
                         else ("CSR", (t.block_n, t.block_e, t.block_h)))
            lines.append(f"| {kind} | {csr[0]} | {csr[1]} | {csr[2]} | {t.num_warps} "
                         f"| {r.forward_ms:.3f} | {r.train_ms:.3f} "
                         f"| {r.forward_ms / default.forward_ms:.2f} "
                         f"| {r.train_ms / default.train_ms:.2f} | {r.max_diff:.1e} | {note} |")
        timed = [r for r in group if not math.isnan(r.train_ms)]
        if timed:
            best_fwd = min(timed, key=lambda r: r.forward_ms)
            best = min(timed, key=lambda r: r.train_ms)
            lines += ["", f"Fastest forward: {best_fwd.tiles} at {best_fwd.forward_ms:.3f} ms "
                      f"({best_fwd.forward_ms / default.forward_ms:.2f} of the default's); "
                      f"fastest forward+backward: {best.tiles} at {best.train_ms:.3f} ms "
                      f"({best.train_ms / default.train_ms:.2f}).", ""]
    if skipped:
        lines += ["## Skipped graphs", "", *(f"- {s}" for s in skipped), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/triton_tuning.py needs a CUDA GPU (torch.cuda.is_available() is "
              "False); nothing was measured.", file=sys.stderr)
        return 2
    if not tk.triton_available():
        print("benchmarks/triton_tuning.py needs triton: pip install 'graphattn[gpu]'",
              file=sys.stderr)
        return 2
    import triton

    dtype = gpu.DTYPES[args.dtype]
    command = "python " + " ".join(shlex.quote(a) for a in [
        os.path.relpath(sys.argv[0]) if sys.argv[0] else "benchmarks/triton_tuning.py",
        *sys.argv[1:]])
    default = tk.launch_config(args.heads, args.channels)
    header = [f"- command: `{command}`",
              f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
              f"- device: {torch.cuda.get_device_name()}",
              f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton "
              f"{triton.__version__}, python {platform.python_version()}",
              f"- edge_attention(backend=\"triton\"), dot score, H = {args.heads}, "
              f"C = {args.channels}, {args.dtype}; default tiles (launch_config): BLOCK_E = "
              f"{default.block_e}, BLOCK_H = {default.block_h}, {default.num_warps} warps",
              f"- median of {args.repeats} repeats after {args.warmup} warm-up calls, "
              f"candidates interleaved; CSR orderings kept from call to call"]
    print("\n".join(header))
    tiles_list = candidates(args.heads, args.channels)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows, skipped = [], []
    device = torch.device("cuda")
    for name in args.graph_names:
        graph, reason = gpu.build_graph(name, args, device, torch.cuda.mem_get_info()[0])
        if graph is None:
            print(f"skip graph {name}: {reason}")
            skipped.append(f"{name}: {reason}")
            continue
        start = time.perf_counter()
        print(f"{name}: N = {graph.num_nodes:,}, E = {graph.num_edges:,}")
        graph_rows = measure(graph, tiles_list, args.heads, args.channels, dtype, args.warmup,
                             args.repeats, gpu._time_ms)
        for r in graph_rows:
            print(f"  {str(tuple(r.tiles)):20s} fwd {r.forward_ms:8.3f} ms  fwd+bwd "
                  f"{r.train_ms:8.3f} ms  diff {r.max_diff:.1e} {r.note}")
        print(f"  ({time.perf_counter() - start:.0f} s)")
        rows += graph_rows
        del graph
        tk.clear_csr_cache()
        torch.cuda.empty_cache()
        out.write_text(render_markdown(header, rows, skipped))
    out.write_text(render_markdown(header, rows, skipped))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
