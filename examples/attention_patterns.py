"""One attention layer, one sequence, six attention patterns.

Every self-attention variant is the same operator on a different graph. This script runs one
GraphSelfAttention layer on one sequence of L vectors over six graphs, and the DenseSelfAttention
twin (the same weights) with the matching dense reference:

    complete  = transformer attention     reference: SDPA without a mask
    causal    = masked decoder attention  reference: SDPA with is_causal=True
    window    = truncated attention       reference: SDPA with to_dense_mask(window_graph)
    grid      = image pixels, 3x3         reference: SDPA with to_dense_mask(grid_graph)
    bigbird   = window + global + random  reference: SDPA with to_dense_mask(union(...))
    networkx  = a small-world graph       reference: SDPA with to_dense_mask(from_networkx(G))

For each it prints the largest difference from the reference (outputs and attention weights) and
the number of scores computed, E against the L^2 of dense attention, and saves a heatmap of the
attention matrix (mean over heads; white where there is no edge) to --out.

    python examples/attention_patterns.py --out out/attention_patterns
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import networkx as nx
import torch

from graphattn import graphs, pe
from graphattn.functional import available_backends
from graphattn.functional.attention import BACKENDS
from graphattn.nn import DenseSelfAttention, GraphSelfAttention

TOLERANCE = 1e-5


def grid_side(length: int) -> int:
    """The side of the square grid of ``length`` pixels; ValueError unless ``length`` fits."""
    if length < 4 or math.isqrt(length) ** 2 != length:
        raise ValueError(f"--length must be a perfect square of at least 4 (the grid is side x "
                         f"side pixels; the small-world graph has degree 4), got {length}")
    return math.isqrt(length)


def patterns(length: int, radius: int, seed: int) -> dict[str, tuple[torch.Tensor, dict]]:
    """name -> (edge_index, keyword arguments of the dense reference)."""
    side = grid_side(length)
    G = nx.connected_watts_strogatz_graph(length, 4, 0.2, seed=seed)
    G.add_edges_from((v, v) for v in G)  # every node also attends to itself, as in the others
    edge_sets = {
        "complete": (graphs.complete_graph(length), None),
        "causal": (graphs.causal_graph(length), "causal"),
        f"window-r{radius}": (graphs.window_graph(length, radius), "mask"),
        f"grid-{side}x{side}": (graphs.grid_graph(side, side, radius=1), "mask"),
        # BigBird: the window, positions 0 and L/2 global, 2 random keys per query
        "bigbird": (graphs.union([graphs.window_graph(length, radius),
                                  graphs.global_token_graph(length, [0, length // 2]),
                                  graphs.random_graph(length, 2, generator=torch.Generator()
                                                      .manual_seed(seed))], length), "mask"),
        "networkx-small-world": (graphs.from_networkx(G), "mask"),
    }
    result = {}
    for name, (edge_index, kind) in edge_sets.items():
        if kind is None:
            reference = {}
        elif kind == "causal":
            reference = {"is_causal": True}
        else:
            reference = {"mask": graphs.to_dense_mask(edge_index, length)}
        result[name] = (edge_index, reference)
    return result


def save_heatmaps(matrices: dict[str, torch.Tensor], counts: dict[str, int], out: Path) -> None:
    """One PNG per pattern: the attention matrix, query i down, key j across."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise SystemExit("saving the heatmaps needs matplotlib, the 'plot' extra: "
                         "pip install 'graphattn[plot]' (or run with --no-plot)") from err
    out.mkdir(parents=True, exist_ok=True)
    for name, weights in matrices.items():
        L = weights.size(0)
        shown = weights.masked_fill(weights == 0, float("nan")).numpy()  # no edge: blank
        fig, ax = plt.subplots(figsize=(5.2, 4.4))
        image = ax.imshow(shown, cmap="viridis", interpolation="nearest")
        fig.colorbar(image, ax=ax, label="attention weight (mean over heads)")
        ax.set_title(f"{name}\nE = {counts[name]} of L² = {L * L} scores")
        ax.set_xlabel("key j (edge source)")
        ax.set_ylabel("query i (edge target)")
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
    print(f"heatmaps saved to {out}/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--length", type=int, default=64,
                        help="sequence length L (a square, at least 4)")
    parser.add_argument("--features", type=int, default=32,
                        help="input features per vector (even, at least 2)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--channels", type=int, default=8, help="channels per head")
    parser.add_argument("--radius", type=int, default=4, help="window radius")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="cpu", choices=["auto", *BACKENDS],
                        help="sparse edge_attention backend of the graph layer (default: cpu)")
    parser.add_argument("--out", type=Path, default=Path("out/attention_patterns"),
                        help="folder for the heatmaps")
    parser.add_argument("--no-plot", action="store_true", help="skip the heatmaps")
    args = parser.parse_args()
    if args.features < 2 or args.features % 2:
        parser.error(f"--features must be even and at least 2 (the sinusoidal positions take a "
                     f"sin and a cos column per frequency), got {args.features}")
    for flag, value, least in (("--heads", args.heads, 1), ("--channels", args.channels, 1),
                               ("--radius", args.radius, 0)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    if args.backend == "triton" and "triton" not in available_backends():
        parser.error("--backend triton needs the package triton (pip install graphattn[gpu])")
    if args.backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--backend triton: this example runs on CPU tensors, which the triton "
                     "kernels take in Triton's interpreter only: run it with TRITON_INTERPRET=1")
    try:
        grid_side(args.length)
    except ValueError as error:
        parser.error(str(error))
    if any(p.exists() and not p.is_dir() for p in (args.out, *args.out.parents)):
        parser.error(f"--out must be a folder (it gets the heatmaps), got {str(args.out)!r}, "
                     f"a file")

    torch.manual_seed(args.seed)
    L, F = args.length, args.features
    x = pe.SinusoidalPE(F)(torch.randn(L, F))  # (L, F): one sequence with positions
    graph_layer = GraphSelfAttention(F, args.channels, args.heads, add_self_loops=False,
                                     backend=args.backend)
    dense_layer = DenseSelfAttention(F, args.channels, args.heads)
    dense_layer.load_state_dict(graph_layer.state_dict())

    print(f"{'pattern':<22}{'E':>7}{'L^2':>7}{'E/L^2':>8}{'max|out diff|':>15}"
          f"{'max|attn diff|':>16}")
    matrices, counts, worst = {}, {}, 0.0
    with torch.no_grad():
        for name, (edge_index, reference) in patterns(L, args.radius, args.seed).items():
            out, (ei, alpha) = graph_layer(x, edge_index, return_attention_weights=True)
            expected, weights = dense_layer(x, **reference, return_attention_weights=True)
            attention = torch.zeros_like(weights)  # (H, L, L)
            attention[:, ei[1], ei[0]] = alpha.t()
            out_diff = (out - expected).abs().max().item()
            attn_diff = (attention - weights).abs().max().item()
            worst = max(worst, out_diff, attn_diff)
            E = edge_index.size(1)
            print(f"{name:<22}{E:>7}{L * L:>7}{E / (L * L):>8.3f}{out_diff:>15.2e}"
                  f"{attn_diff:>16.2e}")
            matrices[name], counts[name] = attention.mean(dim=0), E
    verdict = "match" if worst <= TOLERANCE else "DO NOT match"
    print(f"all patterns {verdict} their dense reference to {TOLERANCE:g} "
          f"(largest difference {worst:.2e})")
    if not args.no_plot:
        save_heatmaps(matrices, counts, args.out)
    if worst > TOLERANCE:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
