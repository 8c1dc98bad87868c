"""Node order on CPU: edge attention on graphs numbered at random, then renumbered by
``graphs.locality_order``.

The sparse kernels walk the targets in id order and gather, for each, the key and value rows
of its sources. When the ids follow the graph's structure, the rows that neighbouring targets
read lie close together and stay in cache; numbered at random, each gather is a cache miss.
``graphs.locality_order`` (reverse Cuthill-McKee) renumbers a graph so that the two ends of an
edge get close ids. This benchmark times the same calls on each graph in the order it comes in
and renumbered (``permute_nodes`` on the edges, which keep their order; ``x[perm]`` on the
rows):

- ``pubmed``: the PubMed citation graph with a self-loop per node, as the dataset numbers it,
  numbered at random (``shuffled``), and renumbered;
- ``knn``: ``--nodes`` random points in the unit square, each attending to its ``--degree``
  nearest points (itself included), numbered in the random order the points were drawn: a
  point cloud or mesh without a spatial numbering;
- ``random``: ``--nodes`` nodes and ``--nodes x --degree`` uniform random edges, with no
  locality to find: the control.

Calls (fp32, 4 heads x 32 channels, ``--threads`` torch threads): ``edge_attention`` forward
(inference) and forward+backward on each of ``--backends``, and a forward+backward of
``GraphSelfAttention(64, 32, heads=4)`` (projections included) on the ``cpu`` backend. The
orders of a graph are interleaved, the order rotating every round, after warm-up rounds; the
table gives medians and the ratio to the graph as it comes. Beside them, what the order does to
the adjacency matrix: its bandwidth ``max |i - j|`` and mean ``|i - j| / N`` over the edges,
and its 32 x 32 tiles that hold an edge with their mean fill (the block-sparse ``triton``
kernels take graphs whose tiles are at least 1/64 full), and the time of ``locality_order``
plus ``permute_nodes``.

Usage (one line):

    python benchmarks/node_order.py              # about 13 min on 2 cores

Writes ``results/node_order.md`` and ``.csv`` (``--out`` names another ``.md``) and, with
matplotlib, the times relative to the graph as it comes beside them (``.png``; ``--no-plot``:
none). ``--replot results/node_order.csv`` draws the figure of a table written before and
measures nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cpu_steps import cpu_header, interleaved, parse_step_args, step_parser  # noqa: E402
from _report import RESULTS, replot_rows, write_table  # noqa: E402

from graphattn import graphs  # noqa: E402
from graphattn.datasets import load_planetoid  # noqa: E402
from graphattn.functional import edge_attention  # noqa: E402
from graphattn.nn import GraphSelfAttention  # noqa: E402

HEADS, CHANNELS, FEATURES, TILE = 4, 32, 64, 32
GIVEN, SHUFFLED, RENUMBERED = "as it comes", "shuffled", "locality_order"
SYNTHETIC = ("knn", "random")


def parse_args(argv: list[str] | None = None):
    parser = step_parser(__doc__.split("\n\n")[0], RESULTS / "node_order.md", warmup=1)
    parser.set_defaults(datasets="PubMed", rounds=5, threads=2)
    parser.add_argument("--synthetic", default="knn,random",
                        help="comma-separated synthetic graphs among knn, random, or 'none' "
                             "(default: knn,random)")
    parser.add_argument("--nodes", type=int, default=500_000,
                        help="nodes of a synthetic graph (default: %(default)s)")
    parser.add_argument("--degree", type=int, default=10,
                        help="in-edges per node of a synthetic graph (default: %(default)s)")
    parser.add_argument("--backends", default="cpu,reference",
                        help="comma-separated backends of the edge_attention calls "
                             "(default: cpu,reference)")
    parser.add_argument("--no-plot", action="store_true", help="no figure (.png beside --out)")
    parser.add_argument("--replot", type=Path, default=None, metavar="CSV",
                        help="draw the figure of a table this script wrote, and stop")
    args = parse_step_args(parser, argv, structure_only=True)
    if args.replot is not None:
        return parser, args
    args.synthetic = [] if args.synthetic == "none" else args.synthetic.split(",")
    unknown = sorted(set(args.synthetic) - set(SYNTHETIC))
    if unknown:
        parser.error(f"--synthetic takes {', '.join(SYNTHETIC)} or 'none', got {unknown}")
    for name in ("nodes", "degree"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.degree > args.nodes:
        parser.error(f"--degree must be <= --nodes, got {args.degree} > {args.nodes}")
    args.backends = args.backends.split(",")
    return parser, args


def knn_graph(num_nodes: int, degree: int, seed: int) -> torch.Tensor:
    """Each of ``num_nodes`` random points of the unit square attends to its ``degree``
    nearest points (itself among them); node ids in the order the points were drawn."""
    from scipy.spatial import cKDTree

    points = torch.rand(num_nodes, 2, generator=torch.Generator().manual_seed(seed)).numpy()
    _, nearest = cKDTree(points).query(points, k=degree)  # (N, D)
    src = torch.from_numpy(nearest.reshape(-1)).long()  # (N * D,)
    dst = torch.arange(num_nodes).repeat_interleave(degree)  # (N * D,)
    return torch.stack([src, dst])


def random_graph(num_nodes: int, degree: int, seed: int) -> torch.Tensor:
    """``num_nodes * degree`` uniform random edges, sorted by target."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_nodes, (num_nodes * degree,), generator=gen)
    dst = torch.randint(0, num_nodes, (num_nodes * degree,), generator=gen).sort().values
    return torch.stack([src, dst])


def layout(edge_index: torch.Tensor, num_nodes: int) -> dict[str, str]:
    """What the numbering does to the adjacency matrix: bandwidth, mean id distance over N,
    the ``TILE x TILE`` tiles that hold an edge and their mean fill."""
    distance = (edge_index[0] - edge_index[1]).abs()  # (E,)
    side = -(-num_nodes // TILE)
    tiles = torch.unique((edge_index[1] // TILE) * side + edge_index[0] // TILE).numel()
    return {"bandwidth": f"{int(distance.max())}",
            "mean |i - j| / N": f"{float(distance.double().mean()) / num_nodes:.4f}",
            f"{TILE}x{TILE} tiles": f"{tiles}",
            "tile fill": f"{edge_index.size(1) / tiles / TILE ** 2:.4f}"}


def orders(edge_index: torch.Tensor, num_nodes: int, shuffle: bool, seed: int
           ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """The graph's numberings: ``{name: (edge_index, perm, seconds to compute it)}``, the
    node rows of each taken as ``rows[perm]``."""
    numbered = {GIVEN: (edge_index, torch.arange(num_nodes), 0.0)}
    if shuffle:
        perm = torch.randperm(num_nodes, generator=torch.Generator().manual_seed(seed))
        edge_index = graphs.permute_nodes(edge_index, perm)
        numbered[SHUFFLED] = (edge_index, perm, 0.0)
    start = time.perf_counter()
    perm = graphs.locality_order(edge_index, num_nodes)
    renumbered = graphs.permute_nodes(edge_index, perm)
    seconds = time.perf_counter() - start
    base = numbered[SHUFFLED][1] if shuffle else torch.arange(num_nodes)
    numbered[RENUMBERED] = (renumbered, base[perm], seconds)  # rows of the graph as it comes
    return numbered


def calls(edge_index: torch.Tensor, perm: torch.Tensor, tensors: dict[str, torch.Tensor],
          layer: GraphSelfAttention, backends: list[str]) -> dict[str, Callable[[], None]]:
    """The timed calls on one numbering: node rows taken as ``rows[perm]``, leaves that
    require grad."""
    q, k, v, x = (tensors[name][perm].detach().requires_grad_() for name in "qkvx")
    timed = {}
    for backend in backends:
        def forward(backend=backend):
            with torch.no_grad():
                edge_attention(q, k, v, edge_index, backend=backend)

        def forward_backward(backend=backend):
            out = edge_attention(q, k, v, edge_index, backend=backend)  # (N, H, C)
            out.backward(torch.ones_like(out))
        timed[f"edge_attention {backend}, forward"] = forward
        timed[f"edge_attention {backend}, forward+backward"] = forward_backward

    def layer_step():
        layer(x, edge_index).sum().backward()  # (N, H * C)
    timed["GraphSelfAttention cpu, forward+backward"] = layer_step
    return timed


def check_orders(numbered: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                 tensors: dict[str, torch.Tensor]) -> None:
    """Raise unless each numbering gives the output of the graph as it comes, row for row."""
    edge_index, _, _ = numbered[GIVEN]
    with torch.no_grad():
        out = edge_attention(*(tensors[name] for name in "qkv"), edge_index, backend="cpu")
        for order, (ei, perm, _) in numbered.items():
            got = edge_attention(*(tensors[name][perm] for name in "qkv"), ei, backend="cpu")
            torch.testing.assert_close(got, out[perm], atol=1e-5, rtol=1e-5,
                                       msg=lambda m, order=order: f"{order} differs: {m}")


def plot(rows: list[dict], path: Path) -> None:
    """One panel per graph: each call's time under each numbering over its time on the graph
    as it comes (below 1: faster)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graph_names = list(dict.fromkeys(row["graph"] for row in rows))
    fig, axes = plt.subplots(1, len(graph_names), figsize=(5.2 * len(graph_names), 4.6),
                             sharey=True, squeeze=False)
    for ax, graph in zip(axes[0], graph_names, strict=True):
        mine = [row for row in rows if row["graph"] == graph and row["order"] != GIVEN]
        names = list(dict.fromkeys(row["call"] for row in mine))
        numberings = list(dict.fromkeys(row["order"] for row in mine))
        width = 0.8 / max(len(numberings), 1)
        for n, order in enumerate(numberings):
            ratio = {row["call"]: float(row["ratio"]) for row in mine if row["order"] == order}
            ax.barh([i + n * width for i in range(len(names))],
                    [ratio.get(name, 0.0) for name in names], height=width,
                    color="C1" if order == SHUFFLED else "C0", label=order)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks([i + width * (len(numberings) - 1) / 2 for i in range(len(names))],
                      [name.replace(", ", ",\n") for name in names], fontsize=8)
        ax.invert_yaxis()
        ax.set(title=graph, xlabel="time / time as the graph comes")
        ax.grid(True, axis="x", alpha=0.3)
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_legend_handles_labels()[0]}
    fig.legend(handles=list(handles.values()), loc="lower center", ncol=len(handles),
               fontsize=9)
    fig.suptitle("Edge attention on CPU, graphs renumbered by graphs.locality_order")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    if args.replot is not None:
        plot(replot_rows(parser, args.replot, ("graph", "order", "call", "ratio")),
             args.replot.with_suffix(".png"))
        return 0
    header = cpu_header("node_order.py", argv, args.threads,
                        f"{args.rounds} interleaved rounds after {args.warmup} warm-up "
                        f"rounds, medians; H = {HEADS}, C = {CHANNELS}, fp32")
    cases = []
    for name in args.datasets:
        data = load_planetoid(name, root=args.root, structure_only=True)
        n = data.num_nodes
        loops = torch.arange(n).repeat(2, 1)
        edge_index = torch.cat([data.edge_index, loops], dim=1)  # (2, E)
        cases.append((name, edge_index, n, True))
    makers = {"knn": knn_graph, "random": random_graph}
    for name in args.synthetic:
        edge_index = makers[name](args.nodes, args.degree, args.seed)
        cases.append((f"{name} {args.nodes} x {args.degree}", edge_index, args.nodes, False))
    rows = []
    for name, edge_index, n, shuffle in cases:
        gen = torch.Generator().manual_seed(args.seed)
        tensors = {part: torch.randn(n, HEADS, CHANNELS, generator=gen) for part in "qkv"}
        tensors["x"] = torch.randn(n, FEATURES, generator=gen)
        torch.manual_seed(args.seed)
        layer = GraphSelfAttention(FEATURES, CHANNELS, heads=HEADS, backend="cpu")
        numbered = orders(edge_index, n, shuffle, args.seed)
        check_orders(numbered, tensors)
        ways = {order: calls(ei, perm, tensors, layer, args.backends)
                for order, (ei, perm, _) in numbered.items()}
        graph = f"{name} ({n} nodes, {edge_index.size(1)} edges)"
        for call in ways[GIVEN]:
            medians = interleaved({order: ways[order][call] for order in ways}, args.rounds,
                                  args.warmup, f"{name}: {call}")
            for order, (ei, _, seconds) in numbered.items():
                rows.append({"graph": graph, "order": order, "call": call,
                             "ms": f"{medians[order]:.1f}",
                             "ratio": f"{medians[order] / medians[GIVEN]:.2f}",
                             **layout(ei, n),
                             "order s": f"{seconds:.3f}" if order == RENUMBERED else ""})
    note = ("`ratio`: the median time over the median time of the same call on the graph as "
            "it comes (below 1: faster). `locality_order` rows: the graph renumbered by "
            "`graphs.locality_order` (of the shuffled graph, for a dataset) and "
            "`graphs.permute_nodes`, whose time is `order s`; the edges keep their order. "
            "Each edge_attention call includes its checks and its sort of the edges by "
            f"target. Tiles: the {TILE} x {TILE} tiles of the adjacency matrix that hold an "
            "edge; fill: edges per tile entry.")
    text = write_table("node_order", "Edge attention on CPU by node order", header, note, rows,
                       out=args.out)
    print(text.split(note, 1)[1].strip())
    print(f"wrote {args.out}")
    if not args.no_plot:
        plot(rows, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
