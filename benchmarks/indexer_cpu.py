"""A learned sparse graph on CPU: ``GraphSelfAttention(indexer=LightningIndexer(...))``, which
attends each token to the ``top_k`` earlier tokens its indexer scores highest (DeepSeek's
sparse attention), against the same layer over the whole causal graph.

For each length of ``--lengths`` (default 2048, 4096, 8192): a layer of ``--heads`` heads of
``--channels`` channels (default 8 x 32, input width their product) with RoPE, the ``cpu``
backend, fp32, on ``graphs.causal_graph(L)``; the indexed layer has an indexer of
``--indexer-heads`` heads of ``--indexer-channels`` channels (default 4 x 32, RoPE on half)
keeping ``--top-k`` (default 256) edges per token. Per way: the layer's forward under
``torch.no_grad`` and a training step's forward+backward (projections included),
interleaved (the order rotates every round) after warm-up, medians; the indexer alone
(its scores and the choice of edges), and the peak memory of one forward+backward call, as
``sparse_vs_dense.py`` measures it. The indexer scores every causal edge: its work grows as
L² like the full attention's, with ``H_I D`` in place of ``H C`` per edge.

Usage (one line):
    python benchmarks/indexer_cpu.py

Writes ``results/indexer_cpu.md`` and ``.csv`` (``--out`` names another ``.md``).
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
from graphattn.graphs import top_k_edges  # noqa: E402
from graphattn.nn import GraphSelfAttention, LightningIndexer  # noqa: E402
from graphattn.pe import RotaryPE  # noqa: E402


def _counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=_counts, default=[2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--channels", type=int, default=32, help="channels per head")
    parser.add_argument("--indexer-heads", type=int, default=4)
    parser.add_argument("--indexer-channels", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=256, help="edges kept per token")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds before timing")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "indexer_cpu.md"))
    args = parser.parse_args(argv)
    for name in ("heads", "channels", "indexer_heads", "indexer_channels", "top_k", "rounds",
                 "warmup", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.lengths or min(args.lengths) < 1:
        parser.error(f"--lengths must be counts >= 1, got {args.lengths}")
    if args.channels % 2 or args.indexer_channels % 4:
        parser.error("--channels must be even and --indexer-channels a multiple of 4 (RoPE)")
    return args


def layers(args: argparse.Namespace) -> tuple[GraphSelfAttention, GraphSelfAttention]:
    """The layer over the whole graph and the same layer (the same weights) with an indexer."""
    width = args.heads * args.channels
    torch.manual_seed(args.seed)
    full = GraphSelfAttention(width, args.channels, args.heads, add_self_loops=False,
                              rotary=RotaryPE(args.channels), backend="cpu")
    indexer = LightningIndexer(width, args.indexer_heads, args.indexer_channels, args.top_k,
                               rotary=RotaryPE(args.indexer_channels // 2))
    indexed = GraphSelfAttention(width, args.channels, args.heads, add_self_loops=False,
                                 rotary=RotaryPE(args.channels), backend="cpu",
                                 indexer=indexer)
    indexed.load_state_dict(full.state_dict(), strict=False)
    return full, indexed


def calls(args: argparse.Namespace, length: int, backward: bool,
          ) -> dict[str, Callable[[], None]]:
    """One call per way on the same tokens: the full layer, the indexed layer, and (forward
    only) the indexer's scores and choice of edges alone."""
    full, indexed = layers(args)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(length, args.heads * args.channels, generator=gen)
    x.requires_grad_(backward)
    graph, pos = graphs.causal_graph(length), torch.arange(length)

    def step(layer: GraphSelfAttention) -> Callable[[], None]:
        trained = [p for name, p in layer.named_parameters()  # (the indexer takes none)
                   if not name.startswith("indexer.")]

        def run() -> None:
            with torch.set_grad_enabled(backward):
                out = layer(x, graph, pos=pos)
                if backward:
                    torch.autograd.grad(out.square().sum(), [x, *trained])
        return run

    ways = {"full causal graph": step(full), f"indexed, top {args.top_k}": step(indexed)}
    if not backward:
        def choose() -> None:
            with torch.no_grad():
                scores = indexed.indexer(x, x, x, graph, pos_src=pos, pos_dst=pos)
                top_k_edges(graph, scores, args.top_k, length)
        ways["the indexer alone (scores, choice)"] = choose
    return ways


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    header = cpu_header("indexer_cpu.py", argv, args.threads,
                        f"graphs.causal_graph(L); GraphSelfAttention, {args.heads} heads of "
                        f"{args.channels} channels, RoPE, cpu backend, fp32; indexer "
                        f"{args.indexer_heads} heads x {args.indexer_channels} channels keeping "
                        f"{args.top_k} edges per token; {args.rounds} interleaved rounds after "
                        f"{args.warmup} warm-up rounds, medians; memory: the peak resident set "
                        f"of one forward+backward call above the memory before it")
    memory = PeakMemory()
    rows = []
    for length in args.lengths:
        edges = length * (length + 1) // 2
        kept = sum(min(args.top_k, i + 1) for i in range(length))
        steps = calls(args, length, True)
        for run in steps.values():  # (the kernels compile on their first call: not measured)
            run()
        peaks = {way: memory.measure(run)[1] for way, run in steps.items()}
        for backward in (False, True):
            step = "forward+backward" if backward else "forward"
            medians = interleaved(calls(args, length, backward), args.rounds, args.warmup,
                                  f"L={length} {step}")
            first = next(iter(medians.values()))
            rows += [{"L": length, "causal edges": edges,
                      "edges attended": kept if way.startswith("indexed") else
                      (edges if way.startswith("full") else ""),
                      "step": step, "way": way, "ms": f"{ms:.1f}",
                      "ratio to the full graph": f"{ms / first:.2f}",
                      "peak MiB (fwd+bwd)": f"{peaks[way] / MIB:.0f}"
                      if backward and way in peaks else ""}
                     for way, ms in medians.items()]
    note = ("Each step at each length is one interleaved run; ratios are to the layer over the "
            "whole causal graph. The indexed layer is the same layer (the same weights) "
            "attending over each token's top-k edges by its indexer's score; its time "
            "includes the indexer's. The indexer takes no gradient."
            + (f" ({memory.reason})" if memory.reason else ""))
    print(write_table("indexer_cpu", "A learned sparse graph on CPU: attention over each "
                      "token's top-k keys by a lightning indexer, against the causal graph",
                      header, note, rows, out=Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
