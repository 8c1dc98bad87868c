"""Grouped-query attention on CPU: ``dense_attention`` given keys and values of ``H_kv`` heads
(SDPA with ``enable_gqa``: the flash kernel reads each kv head for its ``G = H / H_kv`` query
heads) against the same call with each kv head repeated ``G`` times first (what
``DenseSelfAttention(kv_heads=...)`` did before it handed them over as they are); and the same
for ``edge_attention`` on the sequences' causal graph (``graphs.repeat_graph``), whose
``"dense"`` backend runs it as SDPA's causal blocks (what ``GraphSelfAttention(kv_heads=...)``
calls there); and ``dense_attention`` with a sink per query head (GPT-OSS's attention), whose
sink key is one per kv head.

On ``--batch`` causal sequences of ``--length`` positions (default 2 of 1024), fp32, for each
head layout of ``--layouts`` (``H/H_kv/C``; default Llama 3 8B's 32 query heads and 8 kv heads
of 64 channels, and multi-query attention with 8 query heads and one kv head): forward under
``torch.no_grad`` and forward+backward (the gradients of q and of the grouped k and v),
interleaved (the order rotates every round) after warm-up, medians; and the peak memory of one
forward+backward call, as ``sparse_vs_dense.py`` measures it (the peak resident set above the
memory before the call).

Usage (one line):
    python benchmarks/grouped_query_cpu.py

Writes ``results/grouped_query_cpu.md`` and ``.csv`` (``--out`` names another ``.md``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cpu_steps import cpu_header, interleaved  # noqa: E402
from _report import RESULTS, write_table  # noqa: E402
from sparse_vs_dense import MIB, PeakMemory  # noqa: E402

from graphattn import graphs  # noqa: E402
from graphattn.functional import dense_attention, edge_attention  # noqa: E402

WAYS = ("repeated", "grouped")  # the first the baseline of the ratios
OPERATORS = ("dense_attention", "dense_attention, sinks", "edge_attention, dense backend")


def parse_layout(text: str) -> tuple[int, int, int]:
    """``"H/H_kv/C"`` -> (H, H_kv, C), refusing a kv head count that does not divide H."""
    try:
        heads, kv_heads, channels = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a layout is H/H_kv/C, got {text!r}") from None
    if min(heads, kv_heads, channels) < 1 or heads % kv_heads:
        raise argparse.ArgumentTypeError(f"a layout needs H_kv dividing H and counts >= 1, "
                                         f"got {text!r}")
    return heads, kv_heads, channels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--layouts", type=lambda s: [parse_layout(x) for x in s.split(",")],
                        default=[(32, 8, 64), (8, 1, 64)], help="H/H_kv/C,... (default: "
                        "32/8/64,8/1/64)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds before timing")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "grouped_query_cpu.md"))
    args = parser.parse_args(argv)
    for name in ("batch", "length", "rounds", "warmup", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def calls(args: argparse.Namespace, layout: tuple[int, int, int], operator: str,
          backward: bool) -> dict[str, Callable[[], None]]:
    """One call per way of ``operator`` on the same inputs: forward alone (no autograd) or
    forward and backward."""
    heads, kv_heads, channels = layout
    gen = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.length)
    q = torch.randn(*shape, heads, channels, generator=gen).requires_grad_(backward)
    k, v = (torch.randn(*shape, kv_heads, channels, generator=gen).requires_grad_(backward)
            for _ in range(2))
    group = heads // kv_heads
    causal = graphs.repeat_graph(graphs.causal_graph(args.length), args.length, args.batch)
    sinks = torch.randn(heads, generator=gen).requires_grad_(backward)

    def attend(way: str) -> torch.Tensor:
        keys, values = k, v
        if way == "repeated":
            keys, values = (t.repeat_interleave(group, dim=-2) for t in (k, v))
        if operator.startswith("dense_attention"):
            return dense_attention(q, keys, values, is_causal=True,
                                   sinks=sinks if operator.endswith("sinks") else None)
        return edge_attention(q.flatten(0, 1), keys.flatten(0, 1), values.flatten(0, 1),
                              causal, backend="dense")

    def timed(way: str) -> Callable[[], None]:
        def run() -> None:
            with torch.set_grad_enabled(backward):
                out = attend(way)
                if backward:
                    with_sinks = operator.endswith("sinks")
                    torch.autograd.grad(out.sum(), [q, k, v, sinks] if with_sinks else [q, k, v])
        return run
    return {way: timed(way) for way in WAYS}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = cpu_header("grouped_query_cpu.py", argv, args.threads,
                        f"{args.batch} causal sequences of {args.length}, fp32; "
                        f"{args.rounds} interleaved rounds after {args.warmup} warm-up "
                        f"rounds, medians; memory: the peak resident set of one "
                        f"forward+backward call above the memory before it")
    memory = PeakMemory()
    rows = []
    for layout, operator in ((layout, op) for layout in args.layouts for op in OPERATORS):
        heads, kv_heads, channels = layout
        peaks = {way: memory.measure(run)[1]
                 for way, run in calls(args, layout, operator, True).items()}
        for backward in (False, True):
            step = "forward+backward" if backward else "forward"
            medians = interleaved(calls(args, layout, operator, backward), args.rounds,
                                  args.warmup, f"{heads}/{kv_heads}/{channels} {step}")
            rows += [{"H / H_kv / C": f"{heads} / {kv_heads} / {channels}",
                      "operator": operator, "step": step, "way": way, "ms": f"{ms:.2f}",
                      "ratio to repeated": f"{ms / medians[WAYS[0]]:.2f}",
                      "peak MiB (fwd+bwd)": f"{peaks[way] / MIB:.0f}" if backward else ""}
                     for way, ms in medians.items()]
    note = ("Each row group is one interleaved run; ratios are to the call that repeats each "
            "kv head for its query heads first. Grouped, SDPA's CPU flash kernel reads the "
            "H_kv heads of k and v and writes their gradients directly; repeated, k and v "
            "are copied to H heads and the gradients of the copies summed back. "
            "edge_attention runs on the sequences' causal graph, which its dense backend "
            "finds to be causal blocks and hands to SDPA with is_causal."
            + (f" ({memory.reason})" if memory.reason else ""))
    print(write_table("grouped_query_cpu", "Grouped-query attention on CPU: grouped keys "
                      "against keys repeated per query head", header, note, rows,
                      out=Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
