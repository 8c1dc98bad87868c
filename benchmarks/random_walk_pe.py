"""Time of ``graphattn.pe.random_walk_pe`` against PyG's ``AddRandomWalkPE``.

Both compute the return probabilities of 1..k-step random walks, ``(P^t)_ii`` with
``P = D^-1 A``. PyG multiplies the whole sparse matrix ``P^t`` by ``P`` k - 1 times (dense up to
2000 nodes); graphattn multiplies the rows (and, on directed graphs, the columns) of the half
powers ``P^a``, ``a <= ceil(k / 2)``, block of nodes by block of nodes, in float64. On local
graphs (paths, grids) the powers fill in as ``(2t + 1)^2`` entries a row on a grid, so the half
powers are much smaller. The graphs: paths (sequences), grids (images), the citation graphs and
a uniform random graph (an expander, whose powers fill in and go to dense blocks of columns).

Each call runs in a fresh process with a time limit (``--timeout``) and an address-space limit
(``--memory-limit``); a method past either is reported as such and not repeated. Repeats are
interleaved over graphs, k and methods, and the table gives medians and the ratio
PyG / graphattn, with the largest difference between the two encodings.

    python benchmarks/random_walk_pe.py --root DIR         # ~10 min on 2 cores
    python benchmarks/random_walk_pe.py --quick             # a path, a grid and Cora: ~1 min

``DIR`` holds the Planetoid raw files (``DIR/Cora/raw/...``; default: the loader's data root).
Writes ``results/random_walk_pe.md`` and ``.csv`` (``random_walk_pe_quick.*`` with
``--quick``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch_geometric
from _child import call_in_child
from _machine import cpu_name
from _report import write_table
from torch_geometric.data import Data
from torch_geometric.transforms import AddRandomWalkPE
from torch_geometric.utils import coalesce
from tqdm import tqdm

from graphattn import graphs, pe
from graphattn.datasets import load_planetoid

METHODS = ("graphattn", "PyG")


@dataclass
class Case:
    name: str
    edge_index: torch.Tensor
    num_nodes: int
    times: dict[tuple[int, str], list[float]] = field(default_factory=dict)
    encodings: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)
    failed: dict[tuple[int, str], str] = field(default_factory=dict)  # key -> why


def cases(quick: bool, root: str | None) -> list[Case]:
    """The graphs, without parallel edges (on which PyG's encoding differs, see
    :func:`graphattn.pe.random_walk_pe`)."""
    cora = load_planetoid("Cora", root=root)
    out = [Case("path-30000", graphs.chain_graph(30000), 30000),
           Case("grid-128x128", graphs.grid_graph(128, 128), 128 * 128),
           Case("Cora", cora.edge_index, cora.num_nodes)]
    if quick:
        return out
    citeseer = load_planetoid("CiteSeer", root=root)
    pubmed = load_planetoid("PubMed", root=root, structure_only=True)
    gen = torch.Generator().manual_seed(0)
    random = coalesce(torch.randint(0, 20000, (2, 200000), generator=gen), num_nodes=20000)
    out += [Case("path-200000", graphs.chain_graph(200000), 200000),
            Case("grid-448x448", graphs.grid_graph(448, 448), 448 * 448),
            Case("grid-100x100, radius 2", graphs.grid_graph(100, 100, radius=2), 100 * 100),
            Case("CiteSeer", citeseer.edge_index, citeseer.num_nodes),
            Case("PubMed", pubmed.edge_index, pubmed.num_nodes),
            Case("random-20k-200k", random, 20000)]
    return out


def run(method: str, edge_index: torch.Tensor, num_nodes: int, k: int
        ) -> tuple[float, np.ndarray]:
    """In the child: one encoding of ``method``; its seconds and the encoding ``[N, k]`` (as
    numpy: a torch tensor would travel back through shared memory that the child frees)."""
    t0 = time.perf_counter()
    if method == "graphattn":
        enc = pe.random_walk_pe(edge_index, num_nodes, k)
    else:
        data = AddRandomWalkPE(k, attr_name="rw")(Data(edge_index=edge_index,
                                                       num_nodes=num_nodes))
        enc = data.rw
    return time.perf_counter() - t0, enc.numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None,
                        help="data root with Cora/raw/, CiteSeer/raw/, PubMed/raw/ "
                             "(default: the loader's)")
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds one call may take before it is stopped (default: 60)")
    parser.add_argument("--memory-limit", type=float, default=12.0,
                        help="GiB of address space per call (default: 12)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.repeats < 1 or args.timeout <= 0 or args.memory_limit <= 0 or min(args.ks) < 1:
        parser.error(f"--repeats, --ks, --timeout and --memory-limit must be positive, got "
                     f"{args.repeats}, {args.ks}, {args.timeout:g}, {args.memory_limit:g}")
    mp.set_forkserver_preload(["graphattn.pe", "torch_geometric.transforms"])
    name = "random_walk_pe_quick" if args.quick else "random_walk_pe"
    command = "python " + " ".join(sys.argv)
    header = [f"command: `{command}`",
              f"torch {torch.__version__}, torch_geometric {torch_geometric.__version__}, CPU: "
              f"{cpu_name()}, {torch.get_num_threads()} torch threads, Python "
              f"{platform.python_version()}",
              f"limits per call: {args.timeout:g} s, {args.memory_limit:g} GiB of address "
              f"space (RLIMIT_AS)"]
    print("\n".join(header))

    all_cases = cases(args.quick, args.root)
    plan = [(case, k, method) for case in all_cases for k in args.ks for method in METHODS]
    memory_limit = int(args.memory_limit * 2**30)
    with tqdm(total=len(plan) * args.repeats, desc="random_walk_pe") as bar:
        for rep in range(args.repeats):
            rotation = rep % len(plan)
            for case, k, method in plan[rotation:] + plan[:rotation]:
                bar.update()
                key = (k, method)
                if key in case.failed:
                    continue
                status, result = call_in_child(
                    run, (method, case.edge_index, case.num_nodes, k), args.timeout,
                    memory_limit=memory_limit)
                if status == "timeout":
                    case.failed[key] = f"> {args.timeout:g} s"
                elif status != "ok":
                    case.failed[key] = status
                else:
                    case.times.setdefault(key, []).append(result[0])
                    case.encodings[key] = result[1]

    def cell(case: Case, key: tuple[int, str]) -> str:
        if key in case.failed:
            return case.failed[key]
        return f"{statistics.median(case.times[key]):.3f}"

    rows = []
    for case in all_cases:
        for k in args.ks:
            ours, theirs = (case.times.get((k, m)) for m in METHODS)
            both = all((k, m) in case.encodings for m in METHODS)
            diff = (float(np.abs(case.encodings[(k, "graphattn")].astype(np.float64)
                                 - case.encodings[(k, "PyG")]).max()) if both else None)
            rows.append({
                "graph": case.name, "N": case.num_nodes, "E": int(case.edge_index.size(1)),
                "k": k, **{f"{m} s": cell(case, (k, m)) for m in METHODS},
                "PyG / graphattn": (f"{statistics.median(theirs) / statistics.median(ours):.1f}x"
                                    if ours and theirs else ""),
                "max difference": "" if diff is None else f"{diff:.1e}",
            })
    note = (f"Median wall time in seconds of one encoding (walk lengths 1..k) over "
            f"{args.repeats} interleaved repeats, each in a fresh process (the import is not "
            f"timed): `graphattn.pe.random_walk_pe(edge_index, N, k)` (float64, returned in "
            f"float32) and `torch_geometric.transforms.AddRandomWalkPE(k)` (float32) on the "
            f"same graph. The difference is the largest between the two encodings.")
    text = write_table(name, "`random_walk_pe` against PyG's `AddRandomWalkPE`", header, note,
                       rows)
    print(text)


if __name__ == "__main__":
    main()
