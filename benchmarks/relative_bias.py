"""Relative positions in a training step: which backend runs a score bias (or RoPE) best.

Graphormer's spatial encoding, T5's and ALiBi's relative biases enter attention as a bias of
each pair's score (``attn_bias``), fixed (ALiBi) or learned (a table of ``pe.DistanceBias``,
``pe.RelativePositionBias``, ``pe.OffsetBias``), which then needs its gradient; rotary
embeddings (``rotary=pe.RotaryPE(C)``, ``pos=``) rotate the queries and keys instead. This
times one training step of ``GraphSelfAttention`` (forward, ``out.square().sum()``, backward)
on the sparse ``cpu`` kernels, on the ``dense`` backend and as ``auto`` picks, with no bias, a
fixed bias, a learned one and RoPE (each node's position in its graph or sequence), on

- the mini-batches of ``batched_global.py`` with global attention in each graph
  (``graphs.batch_complete_graph``) and Graphormer's bias of each pair's hop distance on a
  chain through each graph (``pe.hop_distance``, once, outside the step; the learned
  ``pe.DistanceBias(H, 8)`` looked up in the step);
- 16 sequences of 256 on the causal graph with T5's bias of i - j
  (``pe.RelativePositionBias(H, 32, 128, bidirectional=False)``, one sequence's bias repeated).

Same weights everywhere; the three backends' outputs are checked equal before they are timed.
Interleaved repeats after warm-up, each round in a new (seeded) random order, medians.

    python benchmarks/relative_bias.py           # about a minute on 2 cores
    python benchmarks/relative_bias.py --quick   # one tiny batch, a smoke run

Writes ``results/relative_bias.md`` and ``.csv``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import _report
import torch
from batched_global import CPU, batches, device_line
from torch import Tensor
from tqdm import tqdm

from graphattn import graphs, pe
from graphattn.nn import GraphSelfAttention

RESULTS = _report.RESULTS
BACKENDS = ("auto", "cpu", "dense")
BIASES = ("none", "fixed", "learned", "rotary")


@dataclass
class Case:
    """Attention edges over N nodes, and the bias module's input for each edge."""

    name: str
    edge_index: Tensor  # (2, E)
    num_nodes: int
    table: Callable[[], torch.nn.Module]  # a new bias table
    key: Tensor  # its input: one entry per edge, or per edge of one repeated block
    positions: Tensor  # (N,): each node's position in its graph, for RoPE
    repeat: int = 1  # the bias of ``key`` repeated this many times is the edges'


def cases(quick: bool, heads: int) -> list[Case]:
    out = []
    for b in batches(quick):
        batch = b.batch
        chains = _chains(b.sizes)  # (2, sum n - 1): the structure graph
        pairs = graphs.batch_complete_graph(batch)  # (2, sum n^2)
        distance = pe.hop_distance(chains, batch.numel(), pairs)  # (sum n^2,)
        first = torch.cat([batch.new_zeros(1), torch.bincount(batch).cumsum(0)])  # (G + 1,)
        positions = torch.arange(batch.numel()) - first[batch]  # (N,): along each chain
        out.append(Case(f"{b.name}, Graphormer", pairs, batch.numel(),
                        lambda: pe.DistanceBias(heads, 8), distance, positions))
    length, count = (16, 3) if quick else (256, 16)
    causal = graphs.causal_graph(length)
    out.append(Case(f"causal-{count}x{length}, T5", graphs.repeat_graph(causal, length, count),
                    length * count, lambda: pe.RelativePositionBias(heads, 32, 128,
                                                                    bidirectional=False),
                    causal[1] - causal[0], torch.arange(length).repeat(count), count))
    return out


def _chains(sizes: list[int]) -> Tensor:
    """A chain through each graph's nodes, graphs numbered one after another: ``(2, E)``."""
    first = torch.tensor([0, *sizes]).cumsum(0)[:-1].tolist()
    return torch.cat([graphs.chain_graph(n) + start for n, start in zip(sizes, first,
                                                                         strict=True)], dim=1)


def steps(case: Case, channels: int, heads: int, seed: int = 0,
          ) -> dict[tuple[str, str], Callable[[], Tensor]]:
    """One training step per (bias, backend), each returning its output."""
    torch.manual_seed(seed)
    x = torch.randn(case.num_nodes, channels * heads, requires_grad=True)
    layers = {b: GraphSelfAttention(x.size(1), channels, heads, add_self_loops=False, backend=b)
              for b in BACKENDS}
    rotary = {b: GraphSelfAttention(x.size(1), channels, heads, add_self_loops=False, backend=b,
                                    rotary=pe.RotaryPE(channels)) for b in BACKENDS}
    for layer in (*layers.values(), *rotary.values()):
        layer.load_state_dict(layers["auto"].state_dict())
    table = case.table()
    with torch.no_grad():  # a bias that is not 0, as after some training
        table.weight.normal_(generator=torch.Generator().manual_seed(seed))

    def bias(kind: str) -> Tensor | None:
        if kind == "none":
            return None
        value = table(case.key)  # (E or E / repeat, H)
        value = value if kind == "learned" else value.detach()
        return value.repeat(case.repeat, 1) if case.repeat > 1 else value

    def step(kind: str, backend: str) -> Callable[[], Tensor]:
        def run() -> Tensor:
            if kind == "rotary":
                out = rotary[backend](x, case.edge_index, pos=case.positions)
            else:
                out = layers[backend](x, case.edge_index, attn_bias=bias(kind))
            out.square().sum().backward()
            return out.detach()
        return run

    return {(kind, backend): step(kind, backend) for kind in BIASES for backend in BACKENDS}


def measure(case: Case, channels: int, heads: int, repeats: int, warmup: int,
            ) -> list[dict[str, object]]:
    runs = steps(case, channels, heads)
    for kind in BIASES:  # the same function on every backend: checked before it is timed
        outs = {backend: runs[kind, backend]() for backend in BACKENDS}
        for backend, out in outs.items():
            diff = (out - outs["cpu"]).abs().max().item()
            if diff > 1e-4:
                raise AssertionError(f"{case.name}, bias {kind}: {backend} differs from cpu by "
                                     f"{diff}")
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    keys = list(runs)
    order = torch.Generator().manual_seed(0)
    for r in range(warmup + repeats):
        # each round in a new order, so that no step always follows the same one: in a fixed
        # order, auto's step (after the dense backend's) ran 1.2x slower than the dense
        # backend's (after the cpu kernels') on the same dense path
        for i in torch.randperm(len(keys), generator=order).tolist():
            key = keys[i]
            start = time.perf_counter()
            runs[key]()
            if r >= warmup:
                times[key].append(time.perf_counter() - start)
    rows = []
    for kind in BIASES:
        cpu_ms = statistics.median(times[kind, "cpu"]) * 1e3
        for backend in BACKENDS:
            ms = statistics.median(times[kind, backend]) * 1e3
            rows.append({"case": case.name, "edges": case.edge_index.size(1), "bias": kind,
                         "backend": backend, "step_ms": round(ms, 3),
                         "vs_cpu": round(ms / cpu_ms, 3)})
    return rows


def write_table(rows: list[dict[str, object]], args: argparse.Namespace, command: str,
                path: Path) -> None:
    header = [f"- command: `{command}`",
              f"- torch {torch.__version__}, {device_line(CPU)}, python "
              f"{platform.python_version()}",
              f"- {args.heads} heads x {args.channels} channels, fp32, dot-product score, "
              f"output projection; {args.repeats} interleaved repeats (each round in a new random "
              f"order) after {args.warmup} warm-up, medians"]
    note = ("Step: forward of `GraphSelfAttention(backend=...)` with `attn_bias`, "
            "`out.square().sum()`, backward. Bias `fixed`: the table's values, detached; "
            "`learned`: looked up in the step, with its gradient; `rotary`: no bias, the "
            "queries and keys rotated by each node's position in its graph "
            "(`rotary=pe.RotaryPE(C)`, `pos=`). Outputs checked equal first. "
            "`vs_cpu`: the step's time over the `cpu` kernels' (below 1: faster than the "
            "sparse kernels).")
    _report.write_table("relative_bias", "Relative positions in a training step: "
                        "sparse kernels or dense backend", header, note, rows, out=path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny cases, 3 repeats")
    parser.add_argument("--heads", type=int, default=4, help="heads H (default: 4)")
    parser.add_argument("--channels", type=int, default=16,
                        help="channels per head C (default: 16)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per step (default: 12, 3 with --quick)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repeats (default: 3)")
    parser.add_argument("--output", type=Path, default=None,
                        help="table path (default: results/relative_bias.md; _quick with "
                             "--quick)")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 3 if args.quick else 12
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1 (a median), got {args.repeats}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.heads < 1 or args.channels < 1:
        parser.error(f"--heads and --channels must be positive, got {args.heads} and "
                     f"{args.channels}")
    if args.output is None:
        args.output = _report.default_output("relative_bias", args.quick)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python benchmarks/relative_bias.py " + " ".join(sys.argv[1:] if argv is None
                                                                else argv)
    print(f"command: {command.strip()}")
    print(f"torch {torch.__version__}, {device_line(CPU)}")
    rows = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for case in tqdm(cases(args.quick, args.heads), desc="cases"):
        rows.extend(measure(case, args.channels, args.heads, args.repeats, args.warmup))
        write_table(rows, args, command.strip(), args.output)  # kept if a later case is cut
    print(args.output.read_text())
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
