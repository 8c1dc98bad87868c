"""Time of ``graphattn.pe.hop_distance`` against SciPy's and networkx's breadth-first searches.

A relative positional bias (ALiBi, Graphormer's spatial encoding, ``pe.DistanceBias``) needs
the hop distance of every attention pair: all pairs of a small graph, or the pairs within a
few hops of a large one. graphattn runs one breadth-first search per target in numba, which
stops once the target's sources are reached (or at ``max_distance``), on torch's threads.
SciPy's ``dijkstra(..., unweighted=True, limit=D)`` searches from each target too, in C, and
writes a dense row of N distances per target (taken here in chunks of targets, so its memory
stays bounded), from which the pairs are read; networkx's
``single_source_shortest_path_length(G, target, cutoff=D)`` searches in Python.

The graphs: Cora (all 7.3M pairs), PubMed (the 1.2M pairs within 2 hops), a 128 x 128 pixel
grid (the pairs of a 7 x 7 neighbourhood, distances on the 3 x 3 one) and a chain of 20,000
positions (a causal window of 64: ALiBi's distances), each with the largest distance its pairs
can have as ``max_distance`` (SciPy's ``limit``) where one is known.

    python benchmarks/hop_distance.py --root DIR   # ~2 min on 2 cores
    python benchmarks/hop_distance.py --quick      # Cora and a small grid: ~20 s

``DIR`` holds the Planetoid raw files (default: the loader's data root). Writes
``results/hop_distance.md`` and ``.csv`` (``hop_distance_quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import networkx as nx
import numpy as np
import scipy
import scipy.sparse as sp
import torch
from _machine import cpu_name
from _report import write_table
from scipy.sparse.csgraph import dijkstra
from tqdm import tqdm

from graphattn import graphs, pe
from graphattn.datasets import load_planetoid

METHODS = ("graphattn", "SciPy", "networkx")
SCIPY_CHUNK_BYTES = 2**28  # the dense rows SciPy writes, per chunk of targets


@dataclass
class Case:
    name: str
    edge_index: torch.Tensor  # the graph the distances are measured on
    num_nodes: int
    pairs: torch.Tensor  # (2, P) the attention pairs
    max_distance: int | None
    times: dict[str, list[float]] = field(default_factory=dict)
    results: dict[str, np.ndarray] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def within_hops(edge_index: torch.Tensor, num_nodes: int, hops: int) -> torch.Tensor:
    """The pairs (j, i) at most ``hops`` edges apart (undirected), as ``[2, P]``."""
    src, dst = edge_index.numpy()
    adj = sp.csr_matrix((np.ones(2 * src.size), (np.r_[src, dst], np.r_[dst, src])),
                        shape=(num_nodes, num_nodes))
    reach = sp.identity(num_nodes, format="csr") + adj
    power = reach
    for _ in range(hops - 1):
        power = power @ reach
    power = power.tocoo()
    return torch.from_numpy(np.stack([power.col, power.row]).astype(np.int64))


def cases(quick: bool, root: str | None) -> list[Case]:
    cora = load_planetoid("Cora", root=root, structure_only=True)
    n = cora.num_nodes
    out = [Case("Cora, all pairs", cora.edge_index, n, graphs.complete_graph(n), None)]
    if quick:
        side = 32
        out.append(Case(f"grid {side}x{side}, 7x7 pairs", graphs.grid_graph(side, side),
                        side * side, graphs.grid_graph(side, side, radius=3), 3))
        return out
    pubmed = load_planetoid("PubMed", root=root, structure_only=True)
    # SciPy writes N distances a target: past some 10^4 nodes its time grows as N^2
    side, length = 128, 20_000
    out += [Case("PubMed, pairs within 2 hops", pubmed.edge_index, pubmed.num_nodes,
                 within_hops(pubmed.edge_index, pubmed.num_nodes, 2), 2),
            Case(f"grid {side}x{side}, 7x7 pairs", graphs.grid_graph(side, side),
                 side * side, graphs.grid_graph(side, side, radius=3), 3),
            Case(f"chain {length}, causal window 64", graphs.chain_graph(length), length,
                 graphs.window_graph(length, 64, causal=True), 64)]
    return out


def scipy_distances(case: Case) -> np.ndarray:
    src, dst = case.edge_index.numpy()
    N = case.num_nodes
    adj = sp.csr_matrix((np.ones(src.size), (src, dst)), shape=(N, N))
    pair_src, pair_dst = case.pairs.numpy()
    out = np.empty(pair_src.size, dtype=np.int64)
    limit = np.inf if case.max_distance is None else case.max_distance
    order = np.argsort(pair_dst, kind="stable")
    targets, first = np.unique(pair_dst[order], return_index=True)
    bounds = np.r_[first, order.size]
    chunk = max(1, SCIPY_CHUNK_BYTES // (8 * max(N, 1)))
    for c in range(0, targets.size, chunk):
        rows = dijkstra(adj, directed=False, indices=targets[c:c + chunk], unweighted=True,
                        limit=limit)  # (chunk, N) float64, inf beyond
        rows = np.where(np.isinf(rows), -1, rows).astype(np.int64)
        for r, t in enumerate(range(c, min(c + chunk, targets.size))):
            sel = order[bounds[t]:bounds[t + 1]]
            out[sel] = rows[r, pair_src[sel]]
    return out


def networkx_distances(case: Case) -> np.ndarray:
    G = nx.Graph()
    G.add_nodes_from(range(case.num_nodes))
    G.add_edges_from(case.edge_index.t().tolist())
    pair_src, pair_dst = case.pairs.numpy()
    out = np.empty(pair_src.size, dtype=np.int64)
    order = np.argsort(pair_dst, kind="stable")
    targets, first = np.unique(pair_dst[order], return_index=True)
    bounds = np.r_[first, order.size]
    for t, target in enumerate(targets.tolist()):
        lengths = nx.single_source_shortest_path_length(G, target, cutoff=case.max_distance)
        sel = order[bounds[t]:bounds[t + 1]]
        out[sel] = [lengths.get(s, -1) for s in pair_src[sel].tolist()]
    return out


def run(method: str, case: Case) -> np.ndarray:
    if method == "graphattn":
        return pe.hop_distance(case.edge_index, case.num_nodes, case.pairs,
                               max_distance=case.max_distance).numpy()
    if method == "SciPy":
        return scipy_distances(case)
    return networkx_distances(case)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None,
                        help="data root with Cora/raw/ and PubMed/raw/ (default: the loader's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--networkx-max-pairs", type=int, default=2_000_000,
                        help="networkx runs only on graphs with at most this many pairs "
                             "(default: %(default)s)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be positive, got {args.repeats}")
    name = "hop_distance_quick" if args.quick else "hop_distance"
    header = [f"command: `python {' '.join(sys.argv)}`",
              f"torch {torch.__version__}, SciPy {scipy.__version__}, networkx "
              f"{nx.__version__}, CPU: {cpu_name()}, {torch.get_num_threads()} torch threads, "
              f"Python {platform.python_version()}"]
    print("\n".join(header))
    all_cases = cases(args.quick, args.root)
    for case in all_cases:
        if case.pairs.size(1) > args.networkx_max_pairs:
            case.skipped["networkx"] = f"skipped (> {args.networkx_max_pairs:,} pairs)"
    pe.hop_distance(graphs.chain_graph(4), 4)  # numba's compile (or cache load), not timed
    plan = [(case, method) for case in all_cases for method in METHODS
            if method not in case.skipped]
    with tqdm(total=len(plan) * args.repeats, desc="hop_distance") as bar:
        for rep in range(args.repeats):
            rotation = rep % len(plan)
            for case, method in plan[rotation:] + plan[:rotation]:
                bar.update()
                start = time.perf_counter()
                result = run(method, case)
                case.times.setdefault(method, []).append(time.perf_counter() - start)
                case.results[method] = result

    rows = []
    for case in all_cases:
        ours = statistics.median(case.times["graphattn"])
        agree = all(np.array_equal(case.results[m], case.results["graphattn"])
                    for m in case.results)
        row = {"graph": case.name, "N": case.num_nodes, "E": int(case.edge_index.size(1)),
               "pairs": int(case.pairs.size(1)),
               "max distance": "-" if case.max_distance is None else case.max_distance}
        for m in METHODS:
            row[f"{m} s"] = (case.skipped[m] if m in case.skipped
                             else f"{statistics.median(case.times[m]):.3f}")
        for m in METHODS[1:]:
            row[f"{m} / graphattn"] = ("" if m in case.skipped else
                                       f"{statistics.median(case.times[m]) / ours:.1f}x")
        row["same distances"] = "yes" if agree else "NO"
        rows.append(row)
    note = (f"Median wall time in seconds of the hop distances of all the pairs, over "
            f"{args.repeats} interleaved repeats in one process: "
            f"`graphattn.pe.hop_distance(edge_index, N, pairs, max_distance=D)`, SciPy's "
            f"`dijkstra(adj, directed=False, indices=targets, unweighted=True, limit=D)` over "
            f"chunks of targets (dense rows of N, then the pairs read from them), and "
            f"networkx's `single_source_shortest_path_length(G, target, cutoff=D)` per target. "
            f"Every method's distances are compared with graphattn's (-1 where no path of at "
            f"most D edges joins a pair).")
    print(write_table(name, "`pe.hop_distance` against SciPy and networkx", header, note, rows))


if __name__ == "__main__":
    main()
