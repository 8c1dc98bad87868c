"""What the CPU step benchmarks share: a GAT or GraphTransformer training step with some of
graphattn's functions swapped for others, interleaved timing with warm-up, and the header of
their tables."""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from _machine import cpu_name
from tqdm import tqdm

from graphattn.datasets import NAMES, ChecksumError, MissingFilesError, load_planetoid
from graphattn.nn import GAT, GraphTransformer


def step_parser(description: str, out: Path, warmup: int) -> argparse.ArgumentParser:
    """A parser with the arguments the step benchmarks share: ``--root``, ``--datasets``
    (Cora and CiteSeer), ``--rounds``, ``--warmup``, ``--threads``, ``--seed``, ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--root", default=None,
                        help="data root holding <Name>/raw (default: graphattn's data root)")
    parser.add_argument("--datasets", default="Cora,CiteSeer",
                        help="comma-separated Planetoid names, or 'none' "
                             "(default: Cora,CiteSeer)")
    parser.add_argument("--rounds", type=int, default=60,
                        help="timed rounds (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=warmup,
                        help="rounds before timing (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=out,
                        help=f"the table's .md, with a .csv beside it (default: {out.name})")
    return parser


def parse_step_args(parser: argparse.ArgumentParser, argv: list[str] | None, *,
                    allow_none: bool = True, structure_only: bool = False,
                    ) -> argparse.Namespace:
    """``parser``'s arguments, refusing a count below 1; ``datasets`` split into a list, each
    a Planetoid name whose files load (``structure_only``: the graph alone) as the script
    will load them, and ``none`` refused unless ``allow_none`` (the script has more to
    time)."""
    args = parser.parse_args(argv)
    for name in ("rounds", "warmup", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.datasets == "none" and not allow_none:
        parser.error("--datasets none leaves this benchmark nothing to measure: name a "
                     "dataset")
    args.datasets = [] if args.datasets == "none" else args.datasets.split(",")
    for name in args.datasets:
        if name.lower() not in NAMES:
            parser.error(f"--datasets: {name!r} is not one of {', '.join(NAMES.values())} "
                         f"(or 'none')")
        try:  # (downloads what is missing, where it can)
            load_planetoid(name, root=args.root, structure_only=structure_only)
        except (MissingFilesError, ChecksumError) as error:
            parser.error(f"--datasets {name}: {error}")
    return args


def operator_args(description: str, out: Path, argv: list[str] | None,
                  extra: tuple[tuple[str, int], ...] = ()) -> argparse.Namespace:
    """The arguments the operator benchmarks share (one random graph, one call per way):
    ``--nodes`` (100,000), ``--edges`` (1,000,000), ``--rounds``, ``--warmup``, ``--threads``
    (torch's count), ``--seed`` and ``--out``, and the counts ``extra`` (name, default),
    refusing a count below 1."""
    parser = argparse.ArgumentParser(description=description)
    for name, default in extra:
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--nodes", type=int, default=100_000)
    parser.add_argument("--edges", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default: 10)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds before timing")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(out))
    args = parser.parse_args(argv)
    for name in ("nodes", "edges", "rounds", "warmup", "threads",
                 *(flag[2:] for flag, _ in extra)):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def cpu_header(script: str, argv: list[str] | None, threads: int, how: str) -> list[str]:
    """Set torch's thread count, then print and return the header lines of a table: the
    command (``argv``: the arguments, ``None`` for the process's own), the versions, the CPU
    and ``how`` it timed."""
    torch.set_num_threads(threads)
    command = f"python benchmarks/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
    header = [f"command: `{command.strip()}`",
              f"torch {torch.__version__}, python {platform.python_version()}",
              f"device: CPU ({cpu_name()}), {threads} torch thread(s)", how]
    print("\n".join(header))
    return header


def gat_step(data, x, seed: int, swaps: list[tuple[object, str, object]]) -> Callable[[], None]:
    """One training step (forward, cross-entropy on the training nodes, backward, Adam) of a
    fresh ``graphattn.nn.GAT`` (seeded with ``seed``) on features ``x``, with each
    ``(module, name, value)`` of ``swaps`` set during the step and restored after it."""
    torch.manual_seed(seed)
    model = GAT(data.x.size(1), int(data.y.max()) + 1)
    return _training_step(model, 0.005, data, x, swaps)


def transformer_step(data, x, seed: int, swaps: list[tuple[object, str, object]],
                     prepare: Callable[[GraphTransformer], None] | None = None
                     ) -> Callable[[], None]:
    """:func:`gat_step` of a fresh ``graphattn.nn.GraphTransformer`` as
    ``examples/node_classification.py --model transformer`` builds it (width 64, 4 heads, 2
    blocks, dropout 0.5; Adam, lr 0.001), ``prepare(model)`` applied to it first."""
    torch.manual_seed(seed)
    model = GraphTransformer(data.x.size(1), 64, int(data.y.max()) + 1, num_layers=2, heads=4,
                             dropout=0.5)
    if prepare is not None:
        prepare(model)
    return _training_step(model, 0.001, data, x, swaps)


def _training_step(model: torch.nn.Module, lr: float, data, x,
                   swaps: list[tuple[object, str, object]]) -> Callable[[], None]:
    edge_index, y, train = data.edge_index, data.y, data.train_mask
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=5e-4)

    def step():
        kept = [(module, name, getattr(module, name)) for module, name, _ in swaps]
        for module, name, value in swaps:
            setattr(module, name, value)
        try:
            optimizer.zero_grad()
            out = model(x, edge_index)  # (N, classes)
            F.cross_entropy(out[train], y[train]).backward()
            optimizer.step()
        finally:
            for module, name, value in kept:
                setattr(module, name, value)
    return step


def interleaved(ways: dict[str, Callable[[], object]], rounds: int, warmup: int,
                desc: str) -> dict[str, float]:
    """Median milliseconds of each way over ``rounds`` rounds after ``warmup`` rounds; each
    round calls every way once, in an order that rotates from round to round."""
    names = list(ways)
    for _ in range(warmup):
        for way in ways.values():
            way()
    times = {name: [] for name in names}
    for i in tqdm(range(rounds), desc=desc, leave=False):
        for name in names[i % len(names):] + names[:i % len(names)]:
            start = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}
