"""Narrow scoring heads on CPU: a ``GraphSelfAttention`` layer whose queries and keys have
``score_channels`` channels per head beside values of ``out_channels``, against the same layer
with queries and keys as wide as the values (the default); differential attention
(``differential=True``), two maps of ``score_channels`` each over the same values; and
multi-head latent attention (``q_rank``, ``kv_rank``, ``shared_key_channels``), the first
width's queries, keys and values through narrow latents.

The scores cost ``E H C_qk`` multiply-adds and the weighted sums ``E H C``, so a layer that
scores on fewer channels than it carries spends less on its edges; the projections and the
output projection cost the same for the values. On a random graph of ``--nodes`` nodes and
``--degree`` in-edges each (default 100,000 and 10: one million edges), ``--heads`` heads of
``--channels`` value channels (default 4 x 32), the ``cpu`` backend, fp32: a layer's forward
under ``torch.no_grad`` and a training step's forward+backward (projections included), for
each width of ``--widths`` (default 32, 16 and 8) and a differential layer of each width of
``--differential`` (default 16: as many query and key channels as the first width's), a
latent layer of each rank r of ``--latent`` (default 32: ``kv_rank=r``, ``q_rank=2r``, a
quarter of the first width's key channels shared by the heads, as DeepSeek-V3 has a third),
interleaved (the order rotates every round) after warm-up, medians; and the peak memory of
one forward+backward call, as ``sparse_vs_dense.py`` measures it.

Usage (one line):
    python benchmarks/score_channels_cpu.py

Writes ``results/score_channels_cpu.md`` and ``.csv`` (``--out`` names another ``.md``).
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

from graphattn.nn import GraphSelfAttention  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--degree", type=int, default=10, help="in-edges per node")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--channels", type=int, default=32, help="value channels per head")
    parser.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[32, 16, 8], help="score channels per head, the first the "
                        "baseline of the ratios (default: 32,16,8)")
    parser.add_argument("--differential", type=lambda s: [int(x) for x in s.split(",") if x],
                        default=[16], help="score channels per map of the differential "
                        "layers (default: 16; '' for none)")
    parser.add_argument("--latent", type=lambda s: [int(x) for x in s.split(",") if x],
                        default=[32], help="kv_rank of the latent layers, with q_rank twice "
                        "it (default: 32; '' for none)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds before timing")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "score_channels_cpu.md"))
    args = parser.parse_args(argv)
    for name in ("nodes", "degree", "heads", "channels", "rounds", "warmup", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.widths or min(args.widths + args.differential + args.latent) < 1:
        parser.error(f"--widths, --differential and --latent must be channel counts >= 1, "
                     f"got {args.widths}, {args.differential} and {args.latent}")
    return args


def calls(args: argparse.Namespace, backward: bool) -> dict[str, Callable[[], None]]:
    """One call per width on the same features and graph: the layer's forward alone (no
    autograd) or its forward and the gradients of its parameters and input."""
    gen = torch.Generator().manual_seed(args.seed)
    features = args.heads * args.channels
    x = torch.randn(args.nodes, features, generator=gen).requires_grad_(backward)
    targets = torch.arange(args.nodes).repeat_interleave(args.degree)
    edge_index = torch.stack([torch.randint(0, args.nodes, targets.shape, generator=gen),
                              targets])
    ways = {}
    first = args.widths[0]
    shared = first // 4
    for way, options in ([(f"C_qk = {w}", dict(score_channels=w)) for w in args.widths]
                         + [(f"differential, 2 x C_qk = 2 x {w}",
                             dict(score_channels=w, differential=True))
                            for w in args.differential]
                         + [(f"latent, C_qk = {first}: kv_rank {r}, q_rank {2 * r}, "
                             f"{shared} shared", dict(score_channels=first, kv_rank=r,
                                                      q_rank=2 * r,
                                                      shared_key_channels=shared))
                            for r in args.latent]):
        torch.manual_seed(args.seed)
        layer = GraphSelfAttention(features, args.channels, args.heads, add_self_loops=False,
                                   backend="cpu", **options)

        def run(layer: GraphSelfAttention = layer) -> None:
            with torch.set_grad_enabled(backward):
                out = layer(x, edge_index)
                if backward:
                    torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
        ways[way] = run
    return ways


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    edges = args.nodes * args.degree
    header = cpu_header("score_channels_cpu.py", argv, args.threads,
                        f"random graph of {args.nodes} nodes, {args.degree} in-edges each "
                        f"({edges} edges); GraphSelfAttention, {args.heads} heads of "
                        f"{args.channels} value channels, cpu backend, fp32; {args.rounds} "
                        f"interleaved rounds after {args.warmup} warm-up rounds, medians; "
                        f"memory: the peak resident set of one forward+backward call above "
                        f"the memory before it")
    memory = PeakMemory()
    steps = calls(args, True)
    for run in steps.values():  # (the kernels compile on their first call: not measured)
        run()
    peaks = {way: memory.measure(run)[1] for way, run in steps.items()}
    rows = []
    for backward in (False, True):
        step = "forward+backward" if backward else "forward"
        medians = interleaved(calls(args, backward), args.rounds, args.warmup, step)
        first = next(iter(medians.values()))
        rows += [{"step": step, "score channels": way, "ms": f"{ms:.2f}",
                  "ratio to the first": f"{ms / first:.2f}",
                  "peak MiB (fwd+bwd)": f"{peaks[way] / MIB:.0f}" if backward else ""}
                 for way, ms in medians.items()]
    note = ("Each step is one interleaved run; ratios are to the first width, queries and keys "
            "as wide as the values (the layers' default). The layer includes its projections "
            "and output projection; the latent layer's are its low-rank ones, its edges cost "
            "what the first width's cost."
            + (f" ({memory.reason})" if memory.reason else ""))
    print(write_table("score_channels_cpu", "Narrow scoring heads on CPU: GraphSelfAttention "
                      "with queries and keys narrower than its values", header, note, rows,
                      out=Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
