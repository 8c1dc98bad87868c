"""Time of ``laplacian_pe`` by eigensolver: dense, and the sparse solver's three methods.

The sparse solver (``solver="sparse"``, and ``"auto"`` above ``DENSE_SOLVER_MAX_NODES`` nodes)
runs Lanczos either in shift-invert mode on one sparse LU factorization or on the Laplacian
itself; it picks shift-invert when the factorization is small (``SHIFT_INVERT_MAX_ENVELOPE``)
and, where it may not be, a probe finds the lowest eigenvalues small
(``SHIFT_INVERT_MAX_EIGENVALUE``). Where the factorization is too large and the probe finds
them small all the same (``CHEBYSHEV_MAX_EIGENVALUE``), it runs a Chebyshev-filtered subspace
iteration instead.
This script forces each method on paths (the graphs of sequences), a grid (of an image), the
citation graphs, a uniform random graph and a random graph with a path hanging off it, and
reports the median wall time of each, the largest eigenvalue difference between methods, and
which one ``solver="auto"`` takes.

Each call runs in a fresh process with a time limit (``--timeout``); a method past it is
reported as such and not repeated. Repeats are interleaved over graphs, k and methods.

    python benchmarks/laplacian_pe.py            # ~25 min on 2 cores (most of it timeouts)
    python benchmarks/laplacian_pe.py --quick    # a 4096-node path and Cora, ~2 min

Writes ``results/laplacian_pe.md`` and ``.csv`` (``laplacian_pe_quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from _child import call_in_child
from _machine import cpu_name
from _report import write_table
from tqdm import tqdm

from graphattn import graphs, pe
from graphattn.datasets import load_planetoid

METHODS = ("dense", "shift-invert", "lanczos", "chebyshev")


@dataclass
class Case:
    name: str
    edge_index: torch.Tensor
    num_nodes: int
    times: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    eigenvalues: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)
    timed_out: set[tuple[int, str]] = field(default_factory=set)
    handed_over: set[tuple[int, str]] = field(default_factory=set)  # filter, then Lanczos


def random_graph_with_a_path(core: int, path: int, seed: int) -> Case:
    """A uniform random graph of ``core`` nodes and mean degree 4 with a path of ``path`` more
    nodes hanging off its node of highest degree: the path's tiny, crowded eigenvalues, and a
    factorization that fills in."""
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, core, (2, 2 * core), generator=gen)
    hub = int(torch.bincount(edge_index.flatten(), minlength=core).argmax())
    nodes = torch.cat([torch.tensor([hub]), torch.arange(core, core + path)])
    edge_index = torch.cat([edge_index, torch.stack([nodes[:-1], nodes[1:]])], dim=1)
    return Case(f"random-{core // 1000}k+path-{path // 1000}k", edge_index, core + path)


def cases(quick: bool) -> list[Case]:
    """The graphs: paths, a grid, the citation graphs, a uniform random graph, and one with a
    path hanging off it."""
    out = [Case("path-4096", graphs.chain_graph(4096), 4096)]
    cora = load_planetoid("Cora")
    out.append(Case("Cora", cora.edge_index, cora.num_nodes))
    if quick:
        return out
    out.append(Case("path-65536", graphs.chain_graph(65536), 65536))
    out.append(Case("grid-128x128", graphs.grid_graph(128, 128), 128 * 128))
    citeseer = load_planetoid("CiteSeer")
    out.append(Case("CiteSeer", citeseer.edge_index, citeseer.num_nodes))
    pubmed = load_planetoid("PubMed", structure_only=True)
    out.append(Case("PubMed", pubmed.edge_index, pubmed.num_nodes))
    gen = torch.Generator().manual_seed(0)
    out.append(Case("random-20k-200k", torch.randint(0, 20000, (2, 200000), generator=gen),
                    20000))
    out.append(random_graph_with_a_path(18000, 2000, seed=0))
    return out


def run(method: str, edge_index: torch.Tensor, num_nodes: int, k: int
        ) -> tuple[float, np.ndarray, bool]:
    """In the child: one ``laplacian_pe`` call with ``method`` forced; its seconds,
    eigenvalues, and whether the Chebyshev filter gave up and handed over to Lanczos."""
    torch.set_default_dtype(torch.float64)  # eigenvalues compared to more than float32 digits
    if method != "dense":  # the method as forced, no probe
        pe.SHIFT_INVERT_MAX_ENVELOPE = 2**62 if method == "shift-invert" else -1
        pe.SHIFT_INVERT_MAX_EIGENVALUE = math.inf
        pe.CHEBYSHEV_MAX_EIGENVALUE = math.inf if method == "chebyshev" else 0.0
        pe.CHEBYSHEV_MAX_K = 2**62
    solver = "dense" if method == "dense" else "sparse"
    filtered, chebyshev = [], pe._chebyshev_smallest
    pe._chebyshev_smallest = lambda *args: filtered.append(chebyshev(*args)) or filtered[-1]
    t0 = time.perf_counter()
    _, values = pe.laplacian_pe(edge_index, num_nodes, k, solver=solver, pad=True,
                                return_eigenvalues=True)
    seconds = time.perf_counter() - t0
    return seconds, values.double().numpy(), any(result is None for result in filtered)


def timed(method: str, case: Case, k: int, timeout: float
          ) -> tuple[float, np.ndarray, bool] | None:
    """What :func:`run` returns, from a child process; ``None`` past ``timeout``."""
    status, result = call_in_child(run, (method, case.edge_index, case.num_nodes, k), timeout)
    if status not in ("ok", "timeout"):
        raise RuntimeError(f"{method} on {case.name} (k={k}): {status}")
    return result


def auto_method(case: Case, k: int) -> str:
    """The method ``solver="auto"`` takes on this graph for k eigenvectors (the filter only up
    to ``CHEBYSHEV_MAX_K``), found from a call: the Chebyshev filter when it returns
    eigenpairs, shift-invert when one of the ``eigsh`` calls has a shift."""
    if case.num_nodes <= pe.DENSE_SOLVER_MAX_NODES:
        return "dense"
    shifts, filtered, eigsh, chebyshev = [], [], pe.eigsh, pe._chebyshev_smallest

    def spy_eigsh(*args, **kwargs):
        shifts.append(kwargs.get("sigma"))
        return eigsh(*args, **kwargs)

    def spy_chebyshev(*args, **kwargs):
        filtered.append(chebyshev(*args, **kwargs))
        return filtered[-1]

    pe.eigsh, pe._chebyshev_smallest = spy_eigsh, spy_chebyshev
    try:
        pe.laplacian_pe(case.edge_index, case.num_nodes, k, pad=True)
    finally:
        pe.eigsh, pe._chebyshev_smallest = eigsh, chebyshev
    if any(result is not None for result in filtered):
        return "chebyshev"
    return "shift-invert" if any(shift is not None for shift in shifts) else "lanczos"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds one call may take before it is stopped (default: 60)")
    parser.add_argument("--dense-max-nodes", type=int, default=20000,
                        help="skip the dense solver above this many nodes (default: 20000)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if min(args.ks) < 1:
        parser.error(f"--ks must be >= 1, got {args.ks}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be > 0, got {args.timeout}")
    mp.set_forkserver_preload(["graphattn.pe", "scipy.sparse.linalg"])
    name = "laplacian_pe_quick" if args.quick else "laplacian_pe"
    command = "python " + " ".join(sys.argv)
    header = [f"command: `{command}`", f"torch {torch.__version__}, CPU: {cpu_name()}, "
              f"{torch.get_num_threads()} threads, Python {platform.python_version()}"]
    print("\n".join(header))

    all_cases = cases(args.quick)
    plan = [(case, k, method) for case in all_cases for k in args.ks for method in METHODS
            if not (method == "dense" and case.num_nodes > args.dense_max_nodes)]
    with tqdm(total=len(plan) * args.repeats, desc="laplacian_pe") as bar:
        for rep in range(args.repeats):
            rotation = rep % len(plan)
            for case, k, method in plan[rotation:] + plan[:rotation]:
                bar.update()
                key = (k, method)
                if key in case.timed_out:
                    continue
                result = timed(method, case, k, args.timeout)
                if result is None:
                    case.timed_out.add(key)
                    continue
                seconds, values, handed_over = result
                case.times.setdefault(key, []).append(seconds)
                case.eigenvalues[key] = values
                if handed_over:
                    case.handed_over.add(key)

    def cell(case: Case, key: tuple[int, str]) -> str:
        if key in case.timed_out:
            return f"> {args.timeout:g}"
        if key not in case.times:
            return f"skipped (N > {args.dense_max_nodes})"
        then = " (then lanczos)" if key in case.handed_over else ""
        return f"{statistics.median(case.times[key]):.3f}{then}"

    rows = []
    for case in all_cases:
        for k in args.ks:
            found = [case.eigenvalues[(k, m)] for m in METHODS if (k, m) in case.eigenvalues]
            spread = (f"{max(np.abs(a - found[0]).max() for a in found):.1e}"
                      if len(found) > 1 else "")
            si, lz = (case.times.get((k, m)) for m in ("shift-invert", "lanczos"))
            ratio = (statistics.median(lz) / statistics.median(si) if si and lz
                     else math.nan)
            rows.append({
                "graph": case.name, "N": case.num_nodes,
                "E": int(case.edge_index.size(1)), "k": k,
                **{f"{m} s": cell(case, (k, m)) for m in METHODS},
                "lanczos / shift-invert": "" if math.isnan(ratio) else f"{ratio:.1f}x",
                "max eigenvalue difference": spread, "auto takes": auto_method(case, k),
            })
    note = (f"Median wall time in seconds of `laplacian_pe(edge_index, N, k)` over "
            f"{args.repeats} interleaved repeats, each in a fresh process, in float64 (so it "
            f"includes building the Laplacian, but not the import). `shift-invert`, "
            f"`lanczos` and `chebyshev` are the three methods of `solver=\"sparse\"`, "
            f"forced (`then lanczos`: the filter did not converge and handed over to "
            f"Lanczos, whose time is included); `auto takes` is what `solver=\"auto\"` picks "
            f"on that graph for that k. The eigenvalue difference is the largest between the "
            f"methods that finished.")
    text = write_table(name, "`laplacian_pe` time by eigensolver", header, note, rows)
    print(text)


if __name__ == "__main__":
    main()
