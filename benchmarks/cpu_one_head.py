"""One attention head on CPU: the ``cpu`` kernels compiled for H = 1 against H read at run time.

The ``cpu`` backend compiles its three kernels with the head count as a constant when there is
one head (the layers' default, and GAT's output layer): the loops over the heads, which run once
per edge, then vanish. This benchmark times the same calls both ways, interleaved after warm-up
(medians): ``edge_attention(..., backend="cpu")`` forward (inference) and forward+backward
(dropout 0.5) on a citation graph with self-loops, one head, for the dot and additive scores and
7, 8 and 64 channels; and one training step of ``graphattn.nn.GAT`` (sparse CSR features), whose
output layer has one head. "heads read at run time" compiles the kernels as they were before
(``graphattn.functional.cpu._kernel_heads`` answering 0).

Usage (one line):
    python benchmarks/cpu_one_head.py

Writes ``results/cpu_one_head.md`` and ``.csv`` (``--out`` names another ``.md``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cpu_steps import (  # noqa: E402
    cpu_header,
    gat_step,
    interleaved,
    parse_step_args,
    step_parser,
)
from _report import RESULTS, write_table  # noqa: E402

from graphattn.datasets import load_planetoid  # noqa: E402
from graphattn.functional import edge_attention  # noqa: E402

cpu = sys.modules["graphattn.functional.cpu"]  # (imported by graphattn.functional)
cpu.SPECIALISED_HEADS = cpu.CONSTANT_HEADS  # timed here whatever GRAPHATTN_CPU_SPECIALISE says
CONSTANT, RUN_TIME = "one head compiled as a constant", "heads read at run time"
HEADS = {CONSTANT: cpu._kernel_heads, RUN_TIME: lambda v: 0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = step_parser(__doc__.split("\n\n")[0], RESULTS / "cpu_one_head.md", warmup=3)
    parser.add_argument("--channels", default="7,8,64",
                        help="comma-separated channel counts per head (default: 7,8,64)")
    parser.add_argument("--scores", default="dot,additive",
                        help="comma-separated scores (default: dot,additive)")
    args = parse_step_args(parser, argv, allow_none=False)
    try:
        args.channels = [int(c) for c in args.channels.split(",")]
    except ValueError:
        parser.error(f"--channels must be comma-separated integers, got {args.channels!r}")
    if min(args.channels) < 1:
        parser.error(f"--channels must be >= 1, got {min(args.channels)}")
    args.scores = args.scores.split(",")
    unknown = [score for score in args.scores if score not in ("dot", "additive", "gatv2")]
    if unknown:
        parser.error(f"--scores must name dot, additive or gatv2, got {unknown[0]!r}")
    return args


def with_heads(heads: Callable, call: Callable[[], None]) -> Callable[[], None]:
    """``call`` with the kernels' head count chosen by ``heads``."""
    def timed():
        kept, cpu._kernel_heads = cpu._kernel_heads, heads
        try:
            call()
        finally:
            cpu._kernel_heads = kept
    return timed


def operator_calls(edge_index: torch.Tensor, num_nodes: int, score: str, channels: int,
                   seed: int) -> dict[str, Callable[[], None]]:
    """The forward and the forward+backward of one-head edge attention on this graph."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_nodes, 1) if score == "additive" else (num_nodes, 1, channels)
    q, k = (torch.randn(*shape, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(num_nodes, 1, channels, generator=gen, requires_grad=True)

    def forward():
        with torch.no_grad():
            edge_attention(q, k, v, edge_index, score=score, backend="cpu")

    def forward_backward():
        out = edge_attention(q, k, v, edge_index, score=score, dropout_p=0.5, backend="cpu")
        out.backward(torch.ones_like(out))
    return {"forward": forward, "forward+backward": forward_backward}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = cpu_header("cpu_one_head.py", argv,
                        args.threads, f"{args.rounds} interleaved rounds after {args.warmup} "
                        f"warm-up rounds, medians")
    rows = []
    for name in args.datasets:
        data = load_planetoid(name, root=args.root)
        n = data.num_nodes
        loops = torch.arange(n).repeat(2, 1)
        edge_index = torch.cat([data.edge_index, loops], dim=1)  # (2, E): one loop per node
        cases = {}
        for score in args.scores:
            for channels in args.channels:
                for step, call in operator_calls(edge_index, n, score, channels,
                                                 args.seed).items():
                    cases[f"edge_attention {score}, C = {channels}", step] = call
        x = data.x.to_sparse_csr()
        cases["GAT training step (output layer: 1 head)", "step"] = gat_step(
            data, x, args.seed, [])
        for (case, step), call in cases.items():
            ways = {way: with_heads(heads, call) for way, heads in HEADS.items()}
            medians = interleaved(ways, args.rounds, args.warmup, f"{name} {case} {step}")
            rows.append({"graph": f"{name} ({edge_index.size(1)} edges)", "call": case,
                         "step": step, f"{RUN_TIME} ms": f"{medians[RUN_TIME]:.3f}",
                         f"{CONSTANT} ms": f"{medians[CONSTANT]:.3f}",
                         "ratio": f"{medians[CONSTANT] / medians[RUN_TIME]:.2f}"})
    note = ("One head, fp32, the `cpu` backend; \"ratio\": the time with one head compiled as a "
            "constant over the time with the head count read at run time (below 1: faster). "
            "Each edge_attention call includes its Python work and the CSR sort of the edges. "
            "The GAT step (8 heads x 8 channels, then one head; dropout 0.6; sparse CSR "
            "features; Adam) changes only in its output layer.")
    text = write_table("cpu_one_head", "One attention head on CPU: head count constant or read "
                       "at run time", [f"- {h}" for h in header], note, rows, out=args.out)
    print(text.split(note, 1)[1].strip())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
