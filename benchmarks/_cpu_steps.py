"""What the CPU step benchmarks share: a GAT training step with some of graphattn's functions
swapped for others, interleaved timing with warm-up, and the header of their tables."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _machine import cpu_name
from tqdm import tqdm

from graphattn.nn import GAT


def cpu_header(script: str, argv: list[str], threads: int, how: str) -> list[str]:
    """The header lines of a table: the command, the versions, the CPU and ``how`` it timed."""
    command = f"python benchmarks/{script} " + " ".join(argv)
    return [f"command: `{command.strip()}`",
            f"torch {torch.__version__}, python {platform.python_version()}",
            f"device: CPU ({cpu_name()}), {threads} torch thread(s)", how]


def gat_step(data, x, seed: int, swaps: list[tuple[object, str, object]]) -> Callable[[], None]:
    """One training step (forward, cross-entropy on the training nodes, backward, Adam) of a
    fresh ``graphattn.nn.GAT`` (seeded with ``seed``) on features ``x``, with each
    ``(module, name, value)`` of ``swaps`` set during the step and restored after it."""
    edge_index, y, train = data.edge_index, data.y, data.train_mask
    torch.manual_seed(seed)
    model = GAT(data.x.size(1), int(y.max()) + 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4)

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
