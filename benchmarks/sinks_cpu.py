"""What attention sinks cost on CPU: ``edge_attention(..., sinks=)`` on the fused ``cpu``
backend against the same call without sinks, against the sinks written as a graph (a virtual
source whose key and value are 0, with an edge into every target whose bias is the sink, built
on each call), and on the ``reference`` backend; and on the ``dense`` backend, which runs a
batch of causal sequences as SDPA's blocks, against the same without sinks and against the
``cpu`` backend with sinks.

On a random graph of ``--nodes`` nodes and ``--edges`` edges (default 100,000 and 1,000,000, 8
heads x 8 channels, fp32, the dot score, as ``benchmarks/softcap_cpu.py``), and on
``--sequences`` causal sequences of ``--length`` nodes (default 16 of 256, the same heads),
forward under ``torch.no_grad`` and forward+backward (the gradients of q, k, v and the
sinks), interleaved (the order rotates every round) after warm-up; medians and ratios to the
call without sinks.

Usage (one line):
    python benchmarks/sinks_cpu.py

Writes ``results/sinks_cpu.md`` and ``.csv`` (``--out`` names another ``.md``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cpu_steps import cpu_header, interleaved, operator_args  # noqa: E402
from _report import RESULTS, write_table  # noqa: E402

from graphattn import graphs  # noqa: E402
from graphattn.functional import edge_attention  # noqa: E402

# the ways of each graph, the first the baseline of its ratios
WAYS = {"random": ("cpu, no sinks", "cpu, sinks", "cpu, sinks as a virtual source",
                   "reference, sinks"),
        "causal": ("dense, no sinks", "dense, sinks", "cpu, sinks")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return operator_args(__doc__.split("\n\n")[0], RESULTS / "sinks_cpu.md", argv,
                         extra=(("--sequences", 16), ("--length", 256)))


def with_virtual_source(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        edge_index: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks as a graph: source N with key and value 0 and an edge into every target,
    whose bias is the sink (its key of 0 scores 0), the graph's edges' bias 0."""
    n_dst, n_src, heads = q.size(0), k.size(0), q.size(1)
    targets = torch.arange(n_dst)
    edges = torch.cat([edge_index, torch.stack([torch.full_like(targets, n_src), targets])], 1)
    k = torch.cat([k, k.new_zeros(1, *k.shape[1:])])  # (N + 1, H, C)
    v = torch.cat([v, v.new_zeros(1, *v.shape[1:])])
    bias = torch.cat([sinks.new_zeros(edge_index.size(1), heads), sinks.expand(n_dst, heads)])
    return edge_attention(q, k, v, edges, bias=bias, backend="cpu")


def calls(edge_index: torch.Tensor, nodes: int, seed: int, backward: bool,
          names: tuple[str, ...]) -> dict[str, Callable[[], None]]:
    """One call per way of ``names`` on the same inputs: forward alone (no autograd) or
    forward and backward (to the sinks too, where the way has them)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(nodes, 8, 8, generator=gen).requires_grad_(backward)
               for _ in range(3))
    sinks = torch.randn(8, generator=gen).requires_grad_(backward)

    def attend(backend: str, with_sinks: bool) -> Callable[[], torch.Tensor]:
        return lambda: edge_attention(q, k, v, edge_index, backend=backend,
                                      sinks=sinks if with_sinks else None)
    ways = {  # name: (the call, whether it has sinks)
        "cpu, no sinks": (attend("cpu", False), False),
        "cpu, sinks": (attend("cpu", True), True),
        "cpu, sinks as a virtual source": (
            lambda: with_virtual_source(q, k, v, edge_index, sinks), True),
        "reference, sinks": (attend("reference", True), True),
        "dense, no sinks": (attend("dense", False), False),
        "dense, sinks": (attend("dense", True), True),
    }

    def timed(way: Callable[[], torch.Tensor], has_sinks: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.set_grad_enabled(backward):
                out = way()
                if backward:
                    torch.autograd.grad(out.sum(), [q, k, v, sinks] if has_sinks else [q, k, v])
        return run
    return {name: timed(*ways[name]) for name in names}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    header = cpu_header("sinks_cpu.py", argv, args.threads,
                        f"dot score, 8 heads x 8 channels, fp32; {args.rounds} interleaved "
                        f"rounds after {args.warmup} warm-up rounds, medians")
    gen = torch.Generator().manual_seed(args.seed)
    n_causal = args.sequences * args.length
    graphs_ = {
        "random": (f"random graph, {args.nodes} nodes, {args.edges} edges",
                   torch.randint(0, args.nodes, (2, args.edges), generator=gen), args.nodes),
        "causal": (f"{args.sequences} causal sequences of {args.length}",
                   graphs.repeat_graph(graphs.causal_graph(args.length), args.length,
                                       args.sequences), n_causal),
    }
    rows = []
    for kind, (graph, edge_index, nodes) in graphs_.items():
        names = WAYS[kind]
        for backward in (False, True):
            step = "forward+backward" if backward else "forward"
            medians = interleaved(calls(edge_index, nodes, args.seed, backward, names),
                                  args.rounds, args.warmup, f"{kind} {step}")
            rows += [{"graph": graph, "step": step, "way": way, "ms": f"{ms:.2f}",
                      "ratio to no sinks": f"{ms / medians[names[0]]:.2f}"}
                     for way, ms in medians.items()]
    note = ("Each row group is one interleaved run; ratios are to the group's first row, "
            "without sinks. The kernels start each row's softmax at its sink; the virtual "
            "source adds N edges, a row of k and v and an [E + N, H] bias, and sorts the "
            "grown graph on every call. The dense backend gives SDPA one more key per head "
            "(and the queries and keys one more channel), whose score is the sink.")
    print(write_table("sinks_cpu", "Attention sinks on CPU: cost against no sinks", header,
                      note, rows, out=Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
