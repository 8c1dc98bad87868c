"""Fused Triton edge attention on a CUDA GPU: time, peak memory and memory bandwidth.

On each graph (Cora, the PubMed graph, uniform random graphs with 1M and 10M edges (the
smallest size of the memory goal, where PyG's layers still fit), and 50M-edge
graphs: uniform, local (random sources near their target) and a sequence window graph of 2M
nodes, each attending to the 25 nodes within 12 of it, and the same window on 40k nodes, 1M
edges), times the forward (inference,
``torch.no_grad``) and the forward+backward of

- ``edge_attention`` with ``backend="triton"`` (the fused kernels; also with the row-block
  kernels, ``launch_tiles(block_n=8)``, and with the block-sparse kernels in 32 x 32 and in
  64 x 64 tiles, ``launch_tiles(block_sparse=32)``, which a graph they do not take, with a
  repeated edge or tiles under 1/64 full, leaves to the CSR kernels) and
  ``backend="reference"``, on given q, k, v ``[N, H, C]``;
- the layers, from node features x ``[N, H*C]`` (three projections, then attention, no output
  projection): ``GraphSelfAttention`` (dot, triton) against PyG's ``TransformerConv``
  (``root_weight=False``), ``GraphSelfAttention`` (additive, triton) against PyG's
  ``GATConv``, ``GraphSelfAttention`` (gatv2, triton) against PyG's ``GATv2Conv``, and with
  16 edge features per edge added to each edge's key and value, ``GraphSelfAttention`` (dot,
  ``edge_mode="key_value"``, triton) against ``TransformerConv(edge_dim=16)``;
- ``dense_attention`` (SDPA) with the graph's ``[N, N]`` bool mask (built outside the timing),

and the peak memory of each call (``torch.cuda.max_memory_allocated`` above the memory held
before it). What does not fit is skipped with a printed reason. Before timing, the fused kernels
are checked against the reference backend on the device (outputs and gradients, dot,
additive and gatv2, with and without bias), eagerly and under ``torch.compile(fullgraph=True)``,
and so are the block-sparse kernels, for every tile side, on a window graph; a layer compiled
in the default mode and with ``fullgraph=True`` is checked against it eager; and the dense paths
(``edge_attention(backend="dense")``, ``dense_attention``) on a graph with targets that have no
in-edge, where SDPA's fused kernels meet rows with no key.

Memory bandwidth of the fused forward kernel (CSR built outside the timing) is reported as a
fraction of the device's peak HBM bandwidth, from the bytes a minimal kernel must move: read
every input once, write every output once,

    bytes = e * (N * H * Cq        [q]
                 + N * H * Cq      [k]
                 + N * H * C       [v]
                 + N * H * C)      [out]
            + 4 * N * H            [lse: one log-sum-exp per row and head, fp32]
            + S                    [the graph]

with S the smaller of the CSR (4 * E source ids + 4 * (N + 1) row pointers, int32) and, on a
graph that the block-sparse kernels take, their layout of 32 x 32 tiles (the row pointers,
column ids and bit masks that their forward reads),

e the bytes per element of the dtype and Cq = C for dot attention (1 for additive);
GB/s = bytes / kernel time and % of peak = GB/s / peak. On a graph whose k and v rows do not
fit in L2, each edge gathers its k and v rows from HBM again (2 * H * C * e bytes per edge), so
the figure stays far below 100% on random graphs; the local graph (sources near their target)
shows what the kernel reaches when the gathers hit the cache. A second figure counts those
reads, k and v once per edge instead of once per node:

    per-edge bytes = bytes + e * (E - N) * H * (Cq + C)

A kernel that gets no reuse of a gathered row through the cache moves at least the per-edge
bytes, so even at peak bandwidth its minimal-bytes figure is at most

    ceiling = 100 * bytes / per-edge bytes   (% of peak)

which the goals list beside each 50M-edge graph's figure: 8.1% on the uniform 50M-edge graph
(N = 2M, E = 50M, H = 4, C = 32, fp32). Above it, only reuse of k and v rows (the local and
window graphs) takes the figure.

Usage (one line; ``--quick`` runs Cora and the 1M-edge graph with fewer repeats):

    python benchmarks/gpu.py [--quick]

Writes ``results/gpu.md`` (or ``--out``) and, with matplotlib, its figure beside it (``.png``:
forward+backward time and peak memory per graph of the layers and dense SDPA; ``--no-plot``:
none). ``--replot benchmarks/results/gpu.md`` draws the figure of a table written before and
measures nothing. Exits with a message on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch_geometric.data import Data

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20

# Peak HBM bandwidth in bytes/s by a substring of torch.cuda.get_device_name(); the first match
# wins, so the more specific names come first. Vendor data sheets.
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
    ("B200", 8.0e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("V100", 0.9e12),
    ("RTX 4090", 1.008e12),
)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EDGE_DIM = 16  # edge features of the "+ edge features" layers
GRAPHS = ("cora", "pubmed", "random-1m", "random-10m", "window-1m", "window-wide-1m", "random-50m",
          "local-50m", "window-50m")
QUICK_GRAPHS = ("cora", "random-1m")
# name -> (nodes, edges, window): window None draws sources uniformly, else from i-w..i+w.
SYNTHETIC = {
    "random-1m": (100_000, 1_000_000, None),
    "random-10m": (400_000, 10_000_000, None),
    "random-50m": (2_000_000, 50_000_000, None),
    "local-50m": (2_000_000, 50_000_000, 512),
}
# name -> (nodes, radius): graphattn.graphs.window_graph, each node attending to the nodes
# within ``radius`` of it in a sequence (itself included), no repeated edge: dense tiles along
# the diagonal, the graph the block-sparse kernels are for. Their 32 x 32 tiles are 26% full
# at radius 12 and 89% at radius 128: two points for where the block kernels start to pay.
# window_graph(N, r) has N (2r + 1) - r (r + 1) edges (r (r + 1) / 2 missing at each end):
# N is the smallest that reaches the million or fifty million edges of the name, the sizes from
# which the goals are judged.
WINDOWS = {"window-1m": (40_007, 12), "window-wide-1m": (4_000, 128),
           "window-50m": (2_000_007, 12)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"graphs {', '.join(QUICK_GRAPHS)}; 1 warm-up and 5 repeats")
    parser.add_argument("--graphs", default=None,
                        help=f"comma-separated subset of {', '.join(GRAPHS)} (default: all)")
    parser.add_argument("--heads", type=int, default=4, help="H (default: 4)")
    parser.add_argument("--channels", type=int, default=32, help="C per head (default: 32)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="dtype of features and weights (default: fp32)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up calls (default: 3)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats; the median is kept (default: 20)")
    parser.add_argument("--peak-bandwidth", type=float, default=None,
                        help="peak HBM bandwidth in TB/s (default: looked up by device name)")
    parser.add_argument("--data-root", default=None,
                        help="root of <Name>/raw/ind.* Planetoid files (default: the data root "
                             "of graphattn.datasets, then ../shared/datasets)")
    parser.add_argument("--out", default=str(RESULTS / "gpu.md"),
                        help="markdown table to write (default: benchmarks/results/gpu.md)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="also profile edge_attention(backend='triton') forward+backward "
                             "with torch.profiler on the graphs of <= 1M edges: host time per "
                             "call and the top operators, in a last section of --out")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the fused-vs-reference check on the device (for a second run "
                             "in one session, after a run that checked)")
    parser.add_argument("--no-graph-cache", action="store_true",
                        help="keep nothing of a graph from call to call (no CSR orderings, "
                             "checked bounds or self-looped graphs), as before those caches: "
                             "every call sorts the edges and reads the bounds back")
    parser.add_argument("--tf32", action="store_true",
                        help="let fp32 matrix products run as TF32 on tensor cores "
                             "(torch.backends.cuda.matmul.allow_tf32, after the device check): "
                             "the block-sparse kernels' and every layer's projections, PyG's "
                             "included; without it fp32 products are full fp32, which the "
                             "block-sparse kernels run on the FMA units")
    parser.add_argument("--no-plot", action="store_true",
                        help="write the table alone, without its figure (--out with .png)")
    parser.add_argument("--replot", default=None, metavar="MD",
                        help="measure nothing: draw the figure of a table this script wrote "
                             "(MD with .png), e.g. --replot benchmarks/results/gpu.md")
    parser.add_argument("--only", action="append", default=None, metavar="TEXT",
                        help="time only the methods whose name contains TEXT (repeatable; "
                             "default: every method but the dropout ones), e.g. --only "
                             "'edge_attention triton'; --only dropout: the fused op with "
                             "attention dropout, its mask drawn in the kernels or read, and "
                             "without; --only softcap: the fused op with soft-capped scores "
                             "and without, dot and gatv2; --only sinks: the fused op with "
                             "learned sinks and without")
    args = parser.parse_args(argv)
    if args.only:
        methods = [name for name in METHODS if any(text in name for text in args.only)]
        methods += [name for name in OPTIONAL_METHODS
                    if any(text in name and any(group in text for group in OPTIONAL_GROUPS)
                           for text in args.only)]
        if not methods:
            parser.error(f"--only matches no method among "
                         f"{', '.join({**METHODS, **OPTIONAL_METHODS})}: got "
                         f"{args.only}")
        args.methods = tuple(methods)
    else:
        args.methods = tuple(METHODS)
    names = QUICK_GRAPHS if args.quick and args.graphs is None else (
        tuple(args.graphs.split(",")) if args.graphs else GRAPHS)
    unknown = [n for n in names if n not in GRAPHS]
    if unknown:
        parser.error(f"--graphs must name graphs among {', '.join(GRAPHS)}, got {unknown}")
    args.graph_names = names
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.repeats = args.repeats if args.repeats is not None else (5 if args.quick else 20)
    for name in ("heads", "channels", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.replot:  # the table read here: a missing or foreign file is the parser's error
        table = Path(args.replot)
        if not table.is_file():
            parser.error(f"--replot: no such file {args.replot!r}")
        try:
            args.replot_table = read_markdown(table.read_text())
        except (ValueError, UnicodeDecodeError) as error:
            parser.error(f"--replot: {args.replot!r} is not a table this script wrote: {error}")
    return args


def peak_bandwidth(device_name: str, override_tbs: float | None) -> tuple[float | None, str]:
    """Peak HBM bandwidth in bytes/s and where the number comes from."""
    if override_tbs is not None:
        return override_tbs * 1e12, "--peak-bandwidth"
    for key, value in PEAK_BANDWIDTH:
        if key in device_name:
            return value, f"table entry {key!r}"
    return None, "unknown device: pass --peak-bandwidth TB/s"


def minimal_forward_bytes(num_nodes: int, num_edges: int, heads: int, channels: int,
                          element_size: int, additive: bool,
                          structure_bytes: int | None = None) -> int:
    """Bytes a minimal forward must move (formula in the module docstring); the graph is
    ``structure_bytes`` (default: its CSR, 4 E + 4 (N + 1))."""
    score_channels = 1 if additive else channels
    features = num_nodes * heads * (2 * score_channels + 2 * channels) * element_size
    if structure_bytes is None:
        structure_bytes = 4 * num_edges + 4 * (num_nodes + 1)
    return features + 4 * num_nodes * heads + structure_bytes


def graph_bytes(graph: Graph) -> int:
    """S of the module docstring: the smaller of the graph's CSR and the block-sparse
    kernels' layout of 32 x 32 tiles (when they take the graph)."""
    from graphattn.functional import triton_blocks as tb

    csr = 4 * graph.num_edges + 4 * (graph.num_nodes + 1)
    n = graph.num_nodes
    layout = tb.graph_blocks(graph.edge_index, n, n, BLOCK_SPARSE["block_sparse"],
                             with_ids=False)  # (a forward without bias reads no edge ids)
    if layout is None:
        return csr
    return min(csr, layout.ptr.nbytes + layout.col.nbytes + layout.bits.nbytes)


def per_edge_forward_bytes(num_nodes: int, num_edges: int, heads: int, channels: int,
                           element_size: int, additive: bool) -> int:
    """Bytes the forward moves when every edge reads its source's key and value rows from
    memory (no reuse through the cache): the minimal bytes with k and v counted once per edge
    instead of once per node."""
    score_channels = 1 if additive else channels
    kv_row = heads * (score_channels + channels) * element_size
    return (minimal_forward_bytes(num_nodes, num_edges, heads, channels, element_size, additive)
            + (num_edges - num_nodes) * kv_row)


def no_reuse_ceiling_percent(num_nodes: int, num_edges: int, heads: int, channels: int,
                             element_size: int, additive: bool) -> float:
    """The most the minimal-bytes figure (% of peak) can reach for a kernel that moves the
    per-edge bytes at peak bandwidth, i.e. gets no reuse of a gathered row through the cache:
    ``100 * minimal bytes / per-edge bytes`` (100 when no edge is gathered twice)."""
    figures = (num_nodes, num_edges, heads, channels, element_size, additive)
    return 100 * min(1.0, minimal_forward_bytes(*figures) / per_edge_forward_bytes(*figures))


# ----------------------------------------------------------------------------------------------
# Graphs


@dataclass
class Graph:
    name: str
    num_nodes: int
    edge_index: torch.Tensor  # (2, E) int64 on the device

    @property
    def num_edges(self) -> int:
        return self.edge_index.size(1)


def synthetic_graph(num_nodes: int, num_edges: int, window: int | None, device: str | torch.device,
                    seed: int = 0) -> torch.Tensor:
    """``[2, E]`` random edges: sources uniform over all nodes (``window=None``) or uniform over
    ``target - window .. target + window`` (clipped), targets uniform."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dst = torch.randint(0, num_nodes, (num_edges,), generator=gen, device=device)
    if window is None:
        src = torch.randint(0, num_nodes, (num_edges,), generator=gen, device=device)
    else:
        offset = torch.randint(-window, window + 1, (num_edges,), generator=gen, device=device)
        src = (dst + offset).clamp_(0, num_nodes - 1)
    return torch.stack([src, dst])


def data_roots(data_root: str | None) -> list[Path]:
    """Where to look for the Planetoid raw files, in order."""
    if data_root is not None:
        return [Path(data_root)]
    from graphattn.datasets import default_root

    repo = Path(__file__).resolve().parent.parent
    return [default_root(), repo.parent / "shared" / "datasets"]


def planetoid_graph(name: str, roots: list[Path]) -> tuple[Data | None, str]:
    """The citation graph (structure only, no download), or None and why not."""
    from graphattn.datasets import load_planetoid

    reasons = []
    for root in roots:
        try:
            data = load_planetoid(name, root, structure_only=True, download=False,
                                  progress=False)
        except (FileNotFoundError, OSError, ValueError) as err:
            reasons.append(f"{root}: {type(err).__name__}: {str(err).splitlines()[0]}")
            continue
        return data, ""
    return None, "; ".join(reasons)


def build_graph(name: str, args: argparse.Namespace, device: str | torch.device,
                free_bytes: int) -> tuple[Graph | None, str]:
    """The named graph on ``device``, or None and the reason it is skipped."""
    if name in ("cora", "pubmed"):
        data, reason = planetoid_graph("Cora" if name == "cora" else "PubMed",
                                       data_roots(args.data_root))
        if data is None:
            return None, f"raw files not found ({reason})"
        return Graph(name, data.num_nodes, data.edge_index.to(device)), ""
    if name in WINDOWS:
        from graphattn.graphs import window_graph

        num_nodes, radius = WINDOWS[name]
        if 64 * num_nodes * (2 * radius + 1) > free_bytes:
            return None, f"needs about {64 * num_nodes * (2 * radius + 1) / MIB:.0f} MiB"
        return Graph(name, num_nodes, window_graph(num_nodes, radius).to(device)), ""
    num_nodes, num_edges, window = SYNTHETIC[name]
    # The graph, features and the fused kernels' CSR take roughly 64 bytes per edge.
    if 64 * num_edges > free_bytes:
        return None, (f"needs about {64 * num_edges / MIB:.0f} MiB, "
                      f"{free_bytes / MIB:.0f} MiB free")
    return Graph(name, num_nodes, synthetic_graph(num_nodes, num_edges, window, device,
                                                  args.seed)), ""


# ----------------------------------------------------------------------------------------------
# Methods: each builds, for a graph, a forward callable and the tensors whose gradients
# forward+backward computes.


@dataclass
class Case:
    forward: Callable[[], torch.Tensor]
    grad_of: list[torch.Tensor] = field(default_factory=list)
    modules: list[torch.nn.Module] = field(default_factory=list)
    # launch_tiles settings of a forward made by _with_tiles; the backward of a training step
    # reads them when it launches, so _train_step enters them around it too
    tiles: dict[str, int] | None = None


def _qkv(graph: Graph, heads: int, channels: int, dtype: torch.dtype, additive: bool = False):
    n, device = graph.num_nodes, graph.edge_index.device
    score_shape = (n, heads) if additive else (n, heads, channels)
    q = torch.randn(score_shape, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(score_shape, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(n, heads, channels, device=device, dtype=dtype, requires_grad=True)
    return q, k, v


# The row-block kernels' tiles (graphattn.functional.triton_kernels.launch_tiles) for the
# methods that run them beside the default one-node kernels.
ROW_BLOCKS = {"block_n": 8}
# The block-sparse kernels (graphattn.functional.triton_blocks), tiles of 32 x 32: compiled for
# sm_90 with fp32 inputs and 4 heads of 32 channels, those of 64 x 64 spill registers
# (results/triton_resources_blocks.md), and on the window graph (25 sources per target) the
# tiles of 32 are fuller (26% of their entries are edges, against 13%). A graph with a
# repeated edge (the random graphs) runs the CSR kernels under this setting.
BLOCK_SPARSE = {"block_sparse": 32}
BLOCK_SPARSE_64 = {"block_sparse": 64}  # the fused op alone, to compare the two tile sides


def _with_tiles(forward: Callable[[], torch.Tensor],
                tiles: dict[str, int] | None) -> Callable[[], torch.Tensor]:
    """``forward`` run inside ``launch_tiles(**tiles)`` (as it is when ``tiles`` is None)."""
    if tiles is None:
        return forward
    from graphattn.functional.triton_kernels import launch_tiles

    def run() -> torch.Tensor:
        with launch_tiles(**tiles):
            return forward()
    return run


def op_case(backend: str, tiles: dict[str, int] | None = None) -> Callable[..., Case]:
    def make(graph: Graph, heads: int, channels: int, dtype: torch.dtype) -> Case:
        from graphattn.functional import edge_attention

        q, k, v = _qkv(graph, heads, channels, dtype)
        return Case(_with_tiles(lambda: edge_attention(q, k, v, graph.edge_index,
                                                       backend=backend), tiles), [q, k, v],
                    tiles=tiles)
    return make


DROPOUT_P = 0.1  # the attention dropout of the dropout methods (--only dropout)


def dropout_case(mask: str) -> Callable[..., Case]:
    """The fused op training with attention dropout ``DROPOUT_P``: ``"seeded"``, as
    ``edge_attention`` calls it (the kernels draw each entry in registers from a seed drawn per
    call), or ``"read"``, one ``[E, H]`` fp32 mask drawn once beforehand that the kernels read
    (the kernels' cost of reading it, the cost of drawing it left out)."""
    def make(graph: Graph, heads: int, channels: int, dtype: torch.dtype) -> Case:
        from graphattn.functional import dropout_mask, edge_attention
        from graphattn.functional.triton_kernels import triton_edge_attention

        q, k, v = _qkv(graph, heads, channels, dtype)
        if mask == "seeded":
            return Case(lambda: edge_attention(q, k, v, graph.edge_index, dropout_p=DROPOUT_P,
                                               backend="triton"), [q, k, v])
        drawn = dropout_mask((graph.num_edges, heads), DROPOUT_P, device=q.device)
        return Case(lambda: triton_edge_attention(
            q, k, v, graph.edge_index, scale=channels**-0.5, bias=None, dropout_mask=drawn,
            score="dot", negative_slope=0.2, need_alpha=False)[0], [q, k, v])
    return make


SOFTCAP = 5.0  # the cap of the softcap methods (--only softcap)


def softcap_case(score: str, softcap: float | None) -> Callable[..., Case]:
    """The fused op with the ``score`` (``"dot"`` or ``"gatv2"``, with a learned ``att``),
    its scores soft-capped at ``softcap`` or not capped (``None``)."""
    def make(graph: Graph, heads: int, channels: int, dtype: torch.dtype) -> Case:
        from graphattn.functional import edge_attention

        q, k, v = _qkv(graph, heads, channels, dtype)
        att = (torch.randn(heads, channels, device=q.device, dtype=dtype).requires_grad_()
               if score == "gatv2" else None)
        return Case(lambda: edge_attention(q, k, v, graph.edge_index, score=score, att=att,
                                           softcap=softcap, backend="triton"),
                    [q, k, v] + ([att] if att is not None else []))
    return make


def sinks_case(with_sinks: bool) -> Callable[..., Case]:
    """The fused op (dot score) with a sink logit per head that gets a gradient, or without
    sinks."""
    def make(graph: Graph, heads: int, channels: int, dtype: torch.dtype) -> Case:
        from graphattn.functional import edge_attention

        q, k, v = _qkv(graph, heads, channels, dtype)
        sinks = (torch.randn(heads, device=q.device, dtype=dtype).requires_grad_()
                 if with_sinks else None)
        return Case(lambda: edge_attention(q, k, v, graph.edge_index, sinks=sinks,
                                           backend="triton"),
                    [q, k, v] + ([sinks] if with_sinks else []))
    return make


def layer_case(kind: str, tiles: dict[str, int] | None = None) -> Callable[..., Case]:
    """A layer on node features ``[N, H*C]``: PyG's (``"transformer"``, ``"gat"``,
    ``"gatv2-pyg"``) or ``GraphSelfAttention`` with that score; ``"transformer-edge"`` and
    ``"dot-edge"`` take ``EDGE_DIM`` edge features too, added to each edge's key and value.
    ``tiles``: the kernels' tiles, as :func:`op_case`."""
    def make(graph: Graph, heads: int, channels: int, dtype: torch.dtype) -> Case:
        from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

        from graphattn.nn import GraphSelfAttention

        features = heads * channels
        edge_dim = EDGE_DIM if kind.endswith("-edge") else None
        if kind in ("transformer", "transformer-edge"):
            layer = TransformerConv(features, channels, heads=heads, root_weight=False,
                                    edge_dim=edge_dim)
        elif kind == "dot-edge":
            layer = GraphSelfAttention(features, channels, heads, out_proj=False,
                                       add_self_loops=False, edge_dim=edge_dim,
                                       edge_mode="key_value", backend="triton")
        elif kind == "gat":
            layer = GATConv(features, channels, heads=heads, add_self_loops=False)
        elif kind == "gatv2-pyg":
            layer = GATv2Conv(features, channels, heads=heads, add_self_loops=False)
        else:
            layer = GraphSelfAttention(features, channels, heads, out_proj=False,
                                       add_self_loops=False, attention=kind, backend="triton")
        device = graph.edge_index.device
        layer = layer.to(device, dtype)
        x = torch.randn(graph.num_nodes, features, device=device, dtype=dtype)
        if edge_dim is None:
            return Case(_with_tiles(lambda: layer(x, graph.edge_index), tiles),
                        list(layer.parameters()), [layer], tiles=tiles)
        edge_attr = torch.randn(graph.num_edges, edge_dim, device=device, dtype=dtype)
        return Case(lambda: layer(x, graph.edge_index, edge_attr), list(layer.parameters()),
                    [layer])
    return make


def dense_case(graph: Graph, heads: int, channels: int, dtype: torch.dtype) -> Case:
    from graphattn.functional import dense_attention

    n = graph.num_nodes
    mask = torch.zeros(n, n, dtype=torch.bool, device=graph.edge_index.device)
    mask[graph.edge_index[1], graph.edge_index[0]] = True
    q, k, v = _qkv(graph, heads, channels, dtype)
    # a batch of 1: SDPA's fused kernels take 4-D inputs only; 3-D ones run its math path
    return Case(lambda: dense_attention(q[None], k[None], v[None], mask[None]), [q, k, v])


METHODS: dict[str, Callable[..., Case]] = {
    "edge_attention triton": op_case("triton"),
    "edge_attention triton, row blocks": op_case("triton", ROW_BLOCKS),
    "edge_attention reference": op_case("reference"),
    "GraphSelfAttention dot, triton": layer_case("dot"),
    "GraphSelfAttention dot, triton, row blocks": layer_case("dot", ROW_BLOCKS),
    "edge_attention triton, block-sparse": op_case("triton", BLOCK_SPARSE),
    "edge_attention triton, block-sparse 64": op_case("triton", BLOCK_SPARSE_64),
    "GraphSelfAttention dot, triton, block-sparse": layer_case("dot", BLOCK_SPARSE),
    "PyG TransformerConv": layer_case("transformer"),
    "GraphSelfAttention additive, triton": layer_case("additive"),
    "PyG GATConv": layer_case("gat"),
    "GraphSelfAttention gatv2, triton": layer_case("gatv2"),
    "PyG GATv2Conv": layer_case("gatv2-pyg"),
    "GraphSelfAttention dot + edge features, triton": layer_case("dot-edge"),
    "PyG TransformerConv + edge features": layer_case("transformer-edge"),
    "dense SDPA + mask": dense_case,
}
# Timed only when a --only text that names their group names them (--only dropout: the
# seeded mask against a read one, and the same op without dropout; --only softcap: each
# score capped and not; --only sinks: the op with sinks and without).
OPTIONAL_GROUPS = ("dropout", "softcap", "sinks")
OPTIONAL_METHODS: dict[str, Callable[..., Case]] = {
    "edge_attention triton, dropout: none": op_case("triton"),
    f"edge_attention triton, dropout: {DROPOUT_P} seeded": dropout_case("seeded"),
    f"edge_attention triton, dropout: {DROPOUT_P} read mask": dropout_case("read"),
    **{f"edge_attention triton, {score}, softcap: {cap or 'none'}": softcap_case(score, cap)
       for score in ("dot", "gatv2") for cap in (None, SOFTCAP)},
    "edge_attention triton, sinks: none": sinks_case(False),
    "edge_attention triton, sinks: learned": sinks_case(True),
}


def dense_skip_reason(graph: Graph, heads: int, element_size: int, free_bytes: int) -> str:
    """Dense attention holds the [N, N] bool mask plus a float bias of the same size per head
    group; skip it when that would take more than a quarter of free memory."""
    need = graph.num_nodes**2 * (2 + element_size)
    if need > free_bytes // 4:
        return (f"the [N, N] mask needs about {need / MIB:.0f} MiB, more than a quarter of the "
                f"{free_bytes / MIB:.0f} MiB free")
    return ""


# ----------------------------------------------------------------------------------------------
# Measuring


@dataclass
class Result:
    graph: str
    num_nodes: int
    num_edges: int
    method: str
    forward_ms: float | None = None
    train_ms: float | None = None
    forward_mib: float | None = None
    train_mib: float | None = None
    kernel_ms: float | None = None
    bandwidth_gbs: float | None = None
    peak_percent: float | None = None
    copy_percent: float | None = None
    per_edge_percent: float | None = None
    no_reuse_ceiling: float | None = None  # % of peak: see no_reuse_ceiling_percent
    note: str = ""


def _clear_grads(case: Case) -> None:
    for t in case.grad_of:
        t.grad = None


def _time_ms(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _peak_mib(fn: Callable[[], object]) -> float:
    """Peak memory of ``fn()`` above what was allocated before, in MiB. What graphattn keeps
    per graph (the triton backend's CSR orderings and block layouts, the layers' graphs with
    self-loops) is dropped first, so the peak includes building it."""
    from graphattn._tensor_cache import clear_graph_caches

    clear_graph_caches()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / MIB


def _train_step(case: Case) -> None:
    from graphattn.functional.triton_kernels import launch_tiles

    # the backward launches inside the forward's tile settings too (it reads them then)
    with contextlib.nullcontext() if case.tiles is None else launch_tiles(**case.tiles):
        out = case.forward()
        out.backward(torch.ones_like(out))


def _inference(case: Case) -> None:
    with torch.no_grad():
        case.forward()


def copy_bandwidth(num_bytes: int = 2**31, repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes
    written (median of ``repeats`` copies of ``num_bytes`` of random data, after 3 warm-ups):
    the practical ceiling of a memory-bound kernel on this device."""
    src = torch.rand(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(_time_ms(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * num_bytes / (ms * 1e-3)


def measure_graph(graph: Graph, args: argparse.Namespace, dtype: torch.dtype,
                  peak: float | None, copy_bytes_per_s: float | None = None) -> list[Result]:
    """Every method on one graph, interleaved repeat by repeat (rotating order)."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    free_bytes = torch.cuda.mem_get_info()[0]
    results, cases, trains = {}, {}, set()  # trains: the cases whose fwd+bwd fits too
    for name in args.methods:
        make = {**METHODS, **OPTIONAL_METHODS}[name]
        result = Result(graph.name, graph.num_nodes, graph.num_edges, name)
        results[name] = result
        if name.startswith("dense"):
            result.note = dense_skip_reason(graph, args.heads, element_size, free_bytes)
            if result.note:
                print(f"  skip {name}: {result.note}")
                continue
        try:
            case = make(graph, args.heads, args.channels, dtype)
            # warm-up first: lazily made state (cuBLAS workspaces) is not the method's peak
            for _ in range(args.warmup):
                _inference(case)
            result.forward_mib = _peak_mib(lambda c=case: _inference(c))
            cases[name] = case
            for _ in range(args.warmup):
                _train_step(case)
                _clear_grads(case)
            result.train_mib = _peak_mib(lambda c=case: _train_step(c))
            _clear_grads(case)
            trains.add(name)
        except torch.cuda.OutOfMemoryError:
            result.note = "fwd+bwd out of memory" if name in cases else "out of memory"
            print(f"  {name}: {result.note}")
        except Exception as err:  # in the table; the other methods and graphs still run
            result.note = f"failed: {type(err).__name__}"
            print(f"  {name}: failed: {type(err).__name__}: {err}", file=sys.stderr)
            cases.pop(name, None)
        if name in cases:
            _clear_grads(cases[name])
        case = None  # a case that does not fit is freed before the next one is made
        torch.cuda.empty_cache()
    forward_times = {name: [] for name in cases}
    train_times = {name: [] for name in trains}
    for rep in range(args.repeats):
        order = list(cases)
        rotated = order[rep % len(order):] + order[:rep % len(order)] if order else []
        for name in rotated:
            case = cases[name]
            try:
                forward_times[name].append(_time_ms(lambda c=case: _inference(c)))
                if name in trains:
                    train_times[name].append(_time_ms(lambda c=case: _train_step(c)))
            except torch.cuda.OutOfMemoryError:  # with every other case held beside it
                results[name].note = "out of memory while timed"
                print(f"  {name}: {results[name].note}")
                del cases[name]
                trains.discard(name)
            except Exception as err:  # in the table; the other methods and graphs still run
                results[name].note = f"failed while timed: {type(err).__name__}"
                print(f"  {name}: failed while timed: {type(err).__name__}: {err}",
                      file=sys.stderr)
                del cases[name]
                trains.discard(name)
            _clear_grads(case)
    for name in cases:
        results[name].forward_ms = statistics.median(forward_times[name])
        if name in trains:
            results[name].train_ms = statistics.median(train_times[name])
    del cases
    torch.cuda.empty_cache()
    structure = None  # S, found once (a block layout) for the first fused op timed
    for name, tiles in FUSED_OPS.items():
        fused = results.get(name)
        if fused is not None and fused.forward_ms is not None and structure is None:
            structure = graph_bytes(graph)
        if fused is None or fused.forward_ms is None:
            continue
        try:
            fused.kernel_ms = forward_kernel_ms(graph, args, dtype, tiles)
        except Exception as err:  # the method's timings stay in the table
            fused.note = f"forward kernel timing failed: {type(err).__name__}"
            print(f"  {name}: {fused.note}: {err}", file=sys.stderr)
            continue
        if fused.kernel_ms is None:
            fused.note = ("the CSR kernels ran: the block-sparse ones do not take this graph "
                          "(a repeated edge, or tiles under 1/64 full)")
            continue
        moved = minimal_forward_bytes(graph.num_nodes, graph.num_edges, args.heads,
                                      args.channels, element_size, additive=False,
                                      structure_bytes=structure)
        fused.bandwidth_gbs = moved / (fused.kernel_ms * 1e-3) / 1e9
        if peak is not None:
            fused.peak_percent = 100 * moved / (fused.kernel_ms * 1e-3) / peak
        if copy_bytes_per_s:
            fused.copy_percent = 100 * moved / (fused.kernel_ms * 1e-3) / copy_bytes_per_s
        if peak is not None:
            gathered = per_edge_forward_bytes(graph.num_nodes, graph.num_edges, args.heads,
                                              args.channels, element_size, additive=False)
            fused.per_edge_percent = 100 * gathered / (fused.kernel_ms * 1e-3) / peak
            fused.no_reuse_ceiling = no_reuse_ceiling_percent(
                graph.num_nodes, graph.num_edges, args.heads, args.channels, element_size,
                additive=False)
    return list(results.values())


# The methods that time the fused forward kernels alone too, with their tiles.
FUSED_OPS = {"edge_attention triton": None, "edge_attention triton, row blocks": ROW_BLOCKS,
             "edge_attention triton, block-sparse": BLOCK_SPARSE,
             "edge_attention triton, block-sparse 64": BLOCK_SPARSE_64}


def forward_kernel_ms(graph: Graph, args: argparse.Namespace, dtype: torch.dtype,
                      tiles: dict[str, int] | None = None) -> float | None:
    """Median time of the fused forward kernel alone (CSR or block layout built before; out
    written in ``dtype``, as inference returns it, which the minimal bytes count), with
    the ``tiles`` of ``launch_tiles`` (the one-node kernels' defaults when None); None for the
    block-sparse kernels on a graph they do not take (a repeated edge, or tiles too empty:
    ``graphattn.functional.triton_blocks.block_layout``)."""
    from graphattn.functional.triton_blocks import block_forward, block_layout
    from graphattn.functional.triton_kernels import build_csr, fused_forward

    q, k, v = (t.detach() for t in _qkv(graph, args.heads, args.channels, dtype))
    scale = args.channels**-0.5
    if tiles is not None and "block_sparse" in tiles:
        layout = block_layout(graph.edge_index, graph.num_nodes, graph.num_nodes,
                              tiles["block_sparse"])
        if layout is None:
            return None

        def run():  # out in the inputs' dtype, as inference returns it (the bytes counted)
            return block_forward(q, k, v, None, None, layout, scale, out_dtype=dtype)
    else:
        csr = build_csr(graph.edge_index[1], graph.edge_index[0], graph.num_nodes,
                        graph.num_nodes)
        run = _with_tiles(lambda: fused_forward(q, k, v, None, None, csr, scale=scale,
                                                score="dot", negative_slope=0.2,
                                                need_scores=False, out_dtype=dtype), tiles)

    for _ in range(args.warmup):
        run()
    return statistics.median(_time_ms(run) for _ in range(args.repeats))


def profile_fused(graph: Graph, args: argparse.Namespace, dtype: torch.dtype) -> str:
    """Where a call of the fused op spends its time on a small graph: the host time to enqueue
    one forward and one forward+backward (no synchronisation inside the timing, so what the
    device does in parallel is not counted), and torch.profiler's table of the operators by
    self CPU time over 20 forward+backward calls."""
    from torch.profiler import ProfilerActivity, profile

    from graphattn.functional import edge_attention

    q, k, v = _qkv(graph, args.heads, args.channels, dtype)

    def step(train: bool) -> None:
        with torch.set_grad_enabled(train):
            out = edge_attention(q, k, v, graph.edge_index, backend="triton")
            if train:
                out.backward(torch.ones_like(out))

    lines = [f"## {graph.name}: N = {graph.num_nodes:,}, E = {graph.num_edges:,}"]
    for train in (False, True):
        for _ in range(args.warmup + 2):
            step(train)
        host = []
        for _ in range(max(args.repeats, 10)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(train)
            host.append(1e3 * (time.perf_counter() - start))
        torch.cuda.synchronize()
        lines.append(f"host ms per {'forward+backward' if train else 'forward'}: median "
                     f"{statistics.median(host):.3f}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            step(True)
        torch.cuda.synchronize()
    lines.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                           max_name_column_width=60))
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Correctness on the device


def check_on_device(graph: Graph, dtype: torch.dtype, heads: int = 2, channels: int = 16,
                    compile_backend: str = "inductor") -> list[tuple[str, float]]:
    """Max abs difference fused vs reference (fp32 math) of out, alpha and every gradient, in
    eager and under ``torch.compile(fullgraph=True)`` (the kernels as torch operators): each
    score without and with a bias, and the dot and gatv2 scores also with one ``[E, H, C]``
    tensor as both edge terms (``edge_key=edge_value``, TransformerConv's edge features); the
    dot score also with a bias and attention dropout, the mask the kernels draw from a seed
    given to the reference written out; the dot and gatv2 scores also with a bias and the
    scores soft-capped (``softcap=0.5``, small enough to change the output); every score
    also with a bias and sinks (``dsinks``)."""
    import torch._inductor.config

    from graphattn.functional import edge_attention, reference_edge_attention
    from graphattn.functional.dropout import seeded_mask, seeded_mask_parameters

    compiled_attention = torch.compile(edge_attention, fullgraph=True, dynamic=False,
                                       backend=compile_backend)

    rows = []
    gen = torch.Generator(device=graph.edge_index.device).manual_seed(0)
    for score in ("dot", "additive", "gatv2"):
        configs = ["no bias", "bias"] + ([] if score == "additive" else ["bias, edge terms"])
        configs += ["bias, dropout"] if score == "dot" else []
        configs += [] if score == "additive" else ["bias, softcap"]
        configs += ["bias, sinks"]
        for config in configs:
            # each config compiles anew: 8 of them would meet dynamo's recompile limit (8), past
            # which it runs the function eagerly without a word
            torch._dynamo.reset()
            n, e, dev = graph.num_nodes, graph.num_edges, graph.edge_index.device
            shape = (n, heads) if score == "additive" else (n, heads, channels)
            tensors = [torch.randn(shape, device=dev, generator=gen),
                       torch.randn(shape, device=dev, generator=gen),
                       torch.randn(n, heads, channels, device=dev, generator=gen),
                       torch.randn(heads, channels, device=dev, generator=gen)
                       if score == "gatv2" else None,
                       torch.randn(e, heads, device=dev, generator=gen)
                       if config != "no bias" else None,
                       torch.randn(e, heads, channels, device=dev, generator=gen)
                       if config == "bias, edge terms" else None,
                       torch.randn(heads, device=dev, generator=gen)
                       if config == "bias, sinks" else None]
            names = [name for name, t in zip(("dq", "dk", "dv", "datt", "dbias", "dedge_term",
                                              "dsinks"), tensors, strict=True)
                     if t is not None]
            leaves = [t.to(dtype).requires_grad_() for t in tensors if t is not None]
            outputs = {}
            dropout_p = 0.3 if config == "bias, dropout" else 0.0
            for mode in ("triton", "compiled", "reference"):
                q, k, v, *rest = leaves
                att = rest.pop(0) if score == "gatv2" else None
                bias = rest.pop(0) if rest else None
                sinks = rest.pop() if config == "bias, sinks" else None
                term = rest.pop(0) if rest else None  # one tensor as key and value term
                attend = compiled_attention if mode == "compiled" else edge_attention
                options = dict(bias=bias, return_attention=True, score=score, att=att,
                               edge_key=term, edge_value=term, sinks=sinks,
                               softcap=0.5 if config == "bias, softcap" else None)
                torch.manual_seed(1)  # one seed, so one mask, in every mode
                if mode == "reference" and dropout_p:  # the kernels' mask, written out
                    mask = seeded_mask(seeded_mask_parameters(dropout_p, device=dev), (e, heads))
                    out, alpha = reference_edge_attention(
                        q, k, v, graph.edge_index, scale=channels**-0.5, bias=bias,
                        dropout_mask=mask, score=score, negative_slope=0.2, need_alpha=True)
                else:
                    # inductor draws random numbers its own way unless fallback_random
                    with torch._inductor.config.patch(fallback_random=True):
                        out, alpha = attend(
                            q, k, v, graph.edge_index, dropout_p=dropout_p,
                            backend="reference" if mode == "reference" else "triton",
                            **options)
                weight = torch.linspace(-1, 1, out.numel(), device=dev).view_as(out)
                loss = (out.float() * weight).sum() + alpha.float().square().sum()
                outputs[mode] = [out, alpha, *torch.autograd.grad(loss, leaves)]
            names = ["out", "alpha", *names]
            for mode in ("triton", "compiled"):
                label = "" if mode == "triton" else "torch.compile, "
                for name, got, want in zip(names, outputs[mode], outputs["reference"],
                                           strict=True):
                    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
                    rows.append((f"{label}{score}, {config}: {name}", err))
    return rows


def check_layer_compile_on_device(device: str | torch.device, dtype: torch.dtype,
                                  num_nodes: int = 500, num_edges: int = 5000, heads: int = 2,
                                  channels: int = 16, compile_backend: str = "aot_eager",
                                  ) -> list[tuple[str, float]]:
    """Max abs difference of a ``GraphSelfAttention`` layer (edge features as a bias, the
    ``triton`` backend) compiled against eager, in eval mode: its output and every parameter's
    gradient, on a graph with self-loops to replace. In ``torch.compile``'s default mode the
    layer keeps the given loops in place with a score of -inf (one graph, no host
    synchronisation); with ``fullgraph=True`` it drops them as eager does. Each label names the
    graphs dynamo cut the default-mode forward into (1: none). ``aot_eager`` by default: the
    kernels' operators and the loops' handling are what is checked, in a few seconds of
    compilation (``check_on_device`` compiles them with inductor)."""
    from graphattn.nn import GraphSelfAttention

    gen = torch.Generator().manual_seed(0)
    edge_index = torch.cat([torch.randint(0, num_nodes, (2, num_edges), generator=gen),
                            torch.arange(0, num_nodes, 5).expand(2, -1)], dim=1).to(device)
    x = torch.randn(num_nodes, 32, generator=gen).to(device, dtype)
    edge_attr = torch.randn(edge_index.size(1), 4, generator=gen).to(device, dtype)
    layer = GraphSelfAttention(32, channels, heads=heads, edge_dim=4, backend="triton")
    layer = layer.to(device, dtype).eval()

    def out_and_grads(model: Callable) -> list[torch.Tensor]:
        out = model(x, edge_index, edge_attr)
        weight = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
        return [out, *torch.autograd.grad((out.float() * weight).sum(), list(layer.parameters()))]

    torch._dynamo.reset()
    graphs = torch._dynamo.explain(layer)(x, edge_index, edge_attr).graph_count
    expected = out_and_grads(layer)
    names = ["out", *(f"d{name}" for name, _ in layer.named_parameters())]
    rows = []
    for mode, fullgraph in ((f"default mode ({graphs} graph{'s' * (graphs != 1)})", False),
                            ("fullgraph", True)):
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=fullgraph, backend=compile_backend)
        for name, got, want in zip(names, out_and_grads(compiled), expected, strict=True):
            rows.append((f"layer, torch.compile {mode}: {name}",
                         (got.float() - want.float()).abs().max().item()))
    return rows


def check_blocks_on_device(device: str | torch.device, dtype: torch.dtype,
                           num_nodes: int = 3000, radius: int = 40, heads: int = 2,
                           channels: int = 16) -> list[tuple[str, float]]:
    """Max abs difference of the block-sparse kernels against the reference (fp32 math) on a
    window graph, each tile side, without per-edge inputs, with a bias, with a bias, a
    dropout mask and the weights returned (the loss on out only, so that backward stays on
    the block kernels), and with a bias and a mask the kernels draw from a seed (the reference
    gets it written out): out (and the weights) and every gradient."""
    from graphattn.functional import reference_edge_attention
    from graphattn.functional.dropout import mask_tensor, seeded_mask_parameters
    from graphattn.functional.triton_blocks import BLOCK_SIDES
    from graphattn.functional.triton_kernels import launch_tiles, triton_edge_attention
    from graphattn.graphs import window_graph

    edge_index = window_graph(num_nodes, radius).to(device)
    num_edges = edge_index.size(1)
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for block in BLOCK_SIDES:
        for case in ("no bias", "bias", "bias, dropout, weights", "bias, seeded dropout"):
            tensors = [torch.randn(num_nodes, heads, channels, device=device, generator=gen)
                       for _ in range(3)]
            if case != "no bias":
                tensors.append(torch.randn(num_edges, heads, device=device, generator=gen))
            leaves = [t.to(dtype).requires_grad_() for t in tensors]
            every = case == "bias, dropout, weights"
            mask = ((torch.rand(num_edges, heads, device=device, generator=gen) > 0.2).float()
                    / 0.8 if every else None)
            if case == "bias, seeded dropout":  # drawn by the kernels, written out for the other
                mask = seeded_mask_parameters(0.2, device=device)
            outputs = []
            for attend in (triton_edge_attention, reference_edge_attention):
                if attend is reference_edge_attention:
                    mask = mask_tensor(mask, num_edges, heads)
                with launch_tiles(block_sparse=block):
                    out, alpha = attend(*leaves[:3], edge_index, scale=channels**-0.5,
                                        bias=leaves[3] if len(leaves) > 3 else None,
                                        dropout_mask=mask, score="dot", negative_slope=0.2,
                                        need_alpha=every)
                weight = torch.linspace(-1, 1, out.numel(), device=device).view_as(out)
                grads = torch.autograd.grad((out.float() * weight).sum(), leaves)
                outputs.append([out, *([alpha] if every else []), *grads])
            names = ["out", *(["alpha"] if every else []), "dq", "dk", "dv", "dbias"]
            for name, got, want in zip(names[:len(outputs[0])], *outputs, strict=True):
                rows.append((f"block-sparse {block}, {case}: {name}",
                             (got.float() - want.float()).abs().max().item()))
    return rows


def check_dense_on_device(device: str | torch.device, dtype: torch.dtype,
                          num_nodes: int = 300, num_edges: int = 3000, heads: int = 2,
                          channels: int = 16) -> list[tuple[str, float]]:
    """Max abs difference of the dense paths against the reference (fp32 math) on a random
    graph (repeated edges included) where a tenth of the targets have no in-edge and a tenth
    of the sources no out-edge, with NaN in what nothing reads: the q rows of those targets,
    the k and v rows of those sources. ``edge_attention(backend="dense")`` for each score
    with a bias (out, alpha and every gradient), and ``dense_attention`` with the graph's
    mask, through SDPA and with the weights returned (out, the weights at the edges, dq, dk,
    dv), and through SDPA with keys and values of half the heads (grouped-query attention,
    ``enable_gqa``). SDPA's fused kernels give NaN on a row with no key: the dense paths must
    give what the reference gives, 0, and no NaN reaches an output or a gradient."""
    from graphattn.functional import dense_attention, edge_attention, reference_edge_attention
    from graphattn.graphs import from_dense_mask, to_dense_mask

    gen = torch.Generator().manual_seed(2)
    quiet = num_nodes // 10  # targets 0..quiet-1 have no in-edge, the last quiet sources none out
    edge_index = torch.stack([torch.randint(0, num_nodes - quiet, (num_edges,), generator=gen),
                              torch.randint(quiet, num_nodes, (num_edges,), generator=gen)])
    edge_index = edge_index.to(device)

    def inputs(score: str) -> list[torch.Tensor]:
        width = () if score == "additive" else (channels,)
        q, k = (torch.randn(num_nodes, heads, *width, generator=gen) for _ in range(2))
        v = torch.randn(num_nodes, heads, channels, generator=gen)
        q[:quiet] = math.nan
        k[num_nodes - quiet:] = math.nan
        v[num_nodes - quiet:] = math.nan
        bias = torch.randn(num_edges, heads, generator=gen)
        att = torch.randn(heads, channels, generator=gen) if score == "gatv2" else None
        return [t.to(device, dtype).requires_grad_() for t in (q, k, v, bias, att)
                if t is not None]

    def loss(out: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        weight = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
        return (out.float() * weight).sum() + alpha.float().square().sum()

    rows = []
    for score in ("dot", "additive", "gatv2"):
        leaves = inputs(score)
        names = ["out", "alpha", "dq", "dk", "dv", "dbias", "datt"][:len(leaves) + 2]
        outputs = []
        for backend in ("dense", "reference"):
            q, k, v, bias, *att = leaves
            out, alpha = edge_attention(q, k, v, edge_index, bias=bias, score=score,
                                        att=att[0] if att else None, return_attention=True,
                                        backend=backend)
            outputs.append([out, alpha, *torch.autograd.grad(loss(out, alpha), leaves)])
        for name, got, want in zip(names, *outputs, strict=True):
            rows.append((f"dense backend, {score}, empty rows: {name}",
                         (got.float() - want.float()).abs().max().item()))

    mask = to_dense_mask(edge_index, num_nodes)  # (N, N); rows 0..quiet-1 all False
    edges = from_dense_mask(mask)  # the graph without its repeated edges
    q, k, v, _ = inputs("dot")
    for weights in (False, True):
        got = dense_attention(q, k, v, mask, return_attention=weights)
        out = got[0] if weights else got
        want, alpha = reference_edge_attention(q, k, v, edges, scale=channels**-0.5, bias=None,
                                               dropout_mask=None, score="dot",
                                               negative_slope=0.2, need_alpha=True)
        pairs = [(out, want)]
        if weights:  # [H, N, N] at the edges (target i, source j) against alpha [E, H]
            pairs.append((got[1][:, edges[1], edges[0]].T, alpha))
        weight = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
        pairs += zip(torch.autograd.grad((out.float() * weight).sum(), (q, k, v)),
                     torch.autograd.grad((want.float() * weight).sum(), (q, k, v)),
                     strict=True)
        label = "weights" if weights else "SDPA"
        names = ["out", *(["alpha"] if weights else []), "dq", "dk", "dv"]
        for name, (got_t, want_t) in zip(names, pairs, strict=True):
            rows.append((f"dense_attention ({label}), empty rows: {name}",
                         (got_t.float() - want_t.float()).abs().max().item()))

    # grouped keys and values (half the heads, at least one), which SDPA takes as they are
    kg, vg = (t.detach()[:, :max(heads // 2, 1)].clone().requires_grad_() for t in (k, v))
    out = dense_attention(q, kg, vg, mask)
    want, _ = reference_edge_attention(q, kg, vg, edges, scale=channels**-0.5, bias=None,
                                       dropout_mask=None, score="dot", negative_slope=0.2,
                                       need_alpha=False)
    weight = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    pairs = [(out, want), *zip(torch.autograd.grad((out.float() * weight).sum(), (q, kg, vg)),
                               torch.autograd.grad((want.float() * weight).sum(), (q, kg, vg)),
                               strict=True)]
    for name, (got_t, want_t) in zip(("out", "dq", "dk", "dv"), pairs, strict=True):
        rows.append((f"dense_attention (SDPA, grouped keys), empty rows: {name}",
                     (got_t.float() - want_t.float()).abs().max().item()))
    return rows


# ----------------------------------------------------------------------------------------------
# Report


def _fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _kernel_kind(method: str) -> str:
    """The kernels of a triton method, as its name ends after "triton": ``""`` (the default
    one-node kernels), ``", row blocks"``, ``", block-sparse"``, ``", block-sparse 64"``."""
    return method.partition("triton")[2]


def goals(results: list[Result]) -> list[str]:
    """The three H200 goals of the fused kernels, evaluated on these results."""
    by = {(r.graph, r.method): r for r in results}
    lines = []
    for r in results:
        if (not r.method.startswith("GraphSelfAttention dot, triton")
                or r.num_edges < 1_000_000):
            continue
        graph = r.graph + _kernel_kind(r.method)
        pyg = by.get((r.graph, "PyG TransformerConv"))
        if r.train_ms and pyg and pyg.train_ms:
            speedup = pyg.train_ms / r.train_ms
            lines.append(f"- {graph}: forward+backward {speedup:.2f}x faster than "
                         f"TransformerConv (goal >= 3x: {'met' if speedup >= 3 else 'not met'})")
        if r.num_edges >= 10_000_000 and r.train_mib and pyg and pyg.train_mib:
            ratio = pyg.train_mib / r.train_mib
            lines.append(f"- {graph}: peak memory {ratio:.1f}x lower than TransformerConv "
                         f"(goal >= 5x: {'met' if ratio >= 5 else 'not met'})")
        elif r.num_edges >= 10_000_000 and r.train_mib and pyg and pyg.note:
            lines.append(f"- {graph}: TransformerConv {pyg.note}; the fused layer peaks at "
                         f"{r.train_mib:.0f} MiB")
    for r in results:
        if r.method in FUSED_OPS and r.num_edges >= 50_000_000 and r.peak_percent:
            copy = (f"; {r.copy_percent:.0f}% of the measured copy bandwidth"
                    if r.copy_percent else "")
            if r.per_edge_percent:
                copy += (f"; {r.per_edge_percent:.0f}% of peak counting each edge's read of "
                         f"its source's k and v rows")
            if r.no_reuse_ceiling is not None and r.no_reuse_ceiling < 100:
                copy += (f"; with no reuse of a gathered k or v row through the cache, at "
                         f"most {r.no_reuse_ceiling:.1f}% by the minimal bytes")
            met = "met" if r.peak_percent >= 50 else "not met"
            lines.append(f"- {r.graph}{_kernel_kind(r.method)}: forward kernel at "
                         f"{r.peak_percent:.0f}% of peak HBM bandwidth (goal >= 50%: "
                         f"{met}){copy}")
    return lines or ["- no graph of >= 1M edges was measured"]


def render_markdown(results: list[Result], header: list[str], checks: list[tuple[str, float]],
                    skipped: list[str], profiles: list[str] | None = None) -> str:
    lines = ["# Fused Triton edge attention on GPU", "", *header, ""]
    lines += ["| graph | N | E | method | fwd ms | fwd+bwd ms | peak fwd MiB | peak fwd+bwd MiB "
              "| fwd kernel ms | GB/s | % peak HBM | % copy | % peak, k v per edge | note |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r.graph} | {r.num_nodes:,} | {r.num_edges:,} | {r.method} "
                     f"| {_fmt(r.forward_ms, 3)} | {_fmt(r.train_ms, 3)} "
                     f"| {_fmt(r.forward_mib, 1)} | {_fmt(r.train_mib, 1)} "
                     f"| {_fmt(r.kernel_ms, 3)} | {_fmt(r.bandwidth_gbs, 0)} "
                     f"| {_fmt(r.peak_percent, 1)} | {_fmt(r.copy_percent, 1)} "
                     f"| {_fmt(r.per_edge_percent, 1)} | {r.note} |")
    lines += ["", "## Goals (H200)", "", *goals(results)]
    if skipped:
        lines += ["", "## Skipped graphs", "", *(f"- {s}" for s in skipped)]
    if checks:
        lines += ["", "## Fused vs reference on the device (max abs difference)", "",
                  "| case | max abs diff |", "|---|---:|"]
        lines += [f"| {name} | {err:.2e} |" for name, err in checks]
    if profiles:
        lines += ["", "## Host profile of the fused op (--profile)", "", "```",
                  *(p.rstrip("\n").replace("## ", "", 1) for p in profiles), "```"]
    return "\n".join(lines) + "\n"


# The columns of render_markdown's table and the Result fields they hold, for read_markdown.
COLUMNS = {"fwd ms": "forward_ms", "fwd+bwd ms": "train_ms", "peak fwd MiB": "forward_mib",
           "peak fwd+bwd MiB": "train_mib", "fwd kernel ms": "kernel_ms",
           "GB/s": "bandwidth_gbs", "% peak HBM": "peak_percent", "% copy": "copy_percent",
           "% peak, k v per edge": "per_edge_percent"}


def read_markdown(text: str) -> tuple[list[str], list[Result]]:
    """The header lines (``- ...``) and the results of a table :func:`render_markdown` wrote,
    columns found by name (a table of an earlier version, with fewer columns, reads too)."""
    lines = text.splitlines()
    start = next((n for n, line in enumerate(lines) if line.startswith("| graph | N | E |")),
                 None)
    if start is None:
        raise ValueError("no table of benchmarks/gpu.py found: no line starts with "
                         "'| graph | N | E |'")
    header = [line for line in lines[:start] if line.startswith("- ")]
    names = [cell.strip() for cell in lines[start].strip().strip("|").split("|")]
    results = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        # the note, last, may hold a |
        cells = [cell.strip() for cell in line.strip()[1:-1].split("|", len(names) - 1)]
        row = dict(zip(names, cells, strict=True))
        result = Result(row["graph"], int(row["N"].replace(",", "")),
                        int(row["E"].replace(",", "")), row["method"], note=row["note"])
        for column, name in COLUMNS.items():
            if row.get(column):
                setattr(result, name, float(row[column]))
        results.append(result)
    return header, results


# Colours by score; the layers of PyG hatched, graphattn's kernel variants dotted.
_SCORE_COLOURS = (("+ edge features", "tab:purple"), ("dot", "tab:blue"),
                  ("TransformerConv", "tab:blue"), ("additive", "tab:orange"),
                  ("GATConv", "tab:orange"), ("gatv2", "tab:green"), ("GATv2", "tab:green"))


def plot(results: list[Result], path: Path, header: list[str]) -> None:
    """Bars of forward+backward time and of its peak memory per graph, for the layers
    (graphattn's solid, PyG's hatched, colour by score) and dense SDPA (grey), log scale; a bar
    without a value says why: OOM (out of memory), skip (the dense mask would not fit) or the
    failure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install graphattn[plot])")
        return
    shown = [r for r in results if not r.method.startswith("edge_attention")]
    graphs = list(dict.fromkeys(r.graph for r in shown))
    methods = list(dict.fromkeys(r.method for r in shown))
    if not graphs:
        print("no layer was measured: no plot")
        return
    by = {(r.graph, r.method): r for r in shown}
    sizes = {r.graph: (r.num_nodes, r.num_edges) for r in shown}
    fig, axes = plt.subplots(1, 2, figsize=(15, 5))
    width = 0.85 / len(methods)
    for ax, key, label in ((axes[0], "train_ms", "forward+backward (ms)"),
                           (axes[1], "train_mib", "peak memory of forward+backward (MiB)")):
        missing = []  # (x, why) of bars without a value
        for n, method in enumerate(methods):
            colour = next((c for text, c in _SCORE_COLOURS if text in method), "tab:gray")
            pyg = method.startswith("PyG")
            variant = "row blocks" in method or "block-sparse" in method
            xs = [g + (n - (len(methods) - 1) / 2) * width for g in range(len(graphs))]
            cells = [by.get((graph, method)) for graph in graphs]
            ys = [getattr(r, key) if r else None for r in cells]
            ax.bar(xs, [y or 0.0 for y in ys], width, color=colour, label=method,
                   alpha=0.45 if pyg else 1.0, hatch="//" if pyg else (".." if variant else ""),
                   edgecolor="black" if variant else None, linewidth=0.4)
            for x, y, r in zip(xs, ys, cells, strict=True):
                if y is None and r is not None:
                    note = r.note
                    missing.append((x, "OOM" if "out of memory" in note else
                                    "skip" if "needs about" in note else note[:12].strip() or "-"))
        ax.set_yscale("log")
        for x, why in missing:
            ax.text(x, ax.get_ylim()[0], why, rotation=90, ha="center", va="bottom", fontsize=7)
        ax.set_ylabel(label)
        ax.set_xticks(range(len(graphs)),
                      [f"{g}\nN {sizes[g][0]:,}\nE {sizes[g][1]:,}" for g in graphs],
                      fontsize=7)
    handles, labels = axes[0].get_legend_handles_labels()
    # two rows, filled column by column: each layer of graphattn above its PyG counterpart
    fig.legend(handles, labels, loc="lower center", ncol=-(-len(labels) // 2), fontsize=8)
    device = next((line[len("- device: "):].split(";")[0] for line in header
                   if line.startswith("- device: ")), "GPU")
    sizes_line = next((line[2:].split(";")[0] for line in header
                       if line.startswith("- H = ")), "")
    date = next((line[len("- date: "):][:10] for line in header
                 if line.startswith("- date: ")), "")
    fig.suptitle(f"graphattn (solid) vs PyG (hatched) on {device}, {sizes_line}, {date}; "
                 "the layers with their projections")
    fig.tight_layout(rect=(0, 0.11, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def environment(args: argparse.Namespace, peak: float | None, peak_source: str,
                copy_bytes_per_s: float | None = None) -> list[str]:
    import triton

    device = torch.cuda.get_device_name()
    command = "python " + " ".join(shlex.quote(a) for a in [
        os.path.relpath(sys.argv[0]) if sys.argv[0] else "benchmarks/gpu.py", *sys.argv[1:]])
    peak_text = f"{peak / 1e12:.2f} TB/s ({peak_source})" if peak else peak_source
    if copy_bytes_per_s:
        peak_text += (f"; measured device-to-device copy {copy_bytes_per_s / 1e12:.2f} TB/s "
                      f"(bytes read + written, 2 GiB, median of 10)")
    return [f"- command: `{command}`",
            f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- device: {device}; peak HBM bandwidth {peak_text}",
            f"- torch {torch.__version__} (CUDA {torch.version.cuda}), "
            f"triton {triton.__version__}, python {platform.python_version()}",
            f"- H = {args.heads}, C = {args.channels}, dtype {args.dtype}; "
            f"median of {args.repeats} repeats after {args.warmup} warm-up calls, methods "
            f"interleaved",
            ("- fp32 matrix products as TF32 (--tf32): the block-sparse kernels' on tensor "
             "cores, and every layer's projections" if args.tf32 else
             "- fp32 matrix products in full fp32 (torch's default; the block-sparse kernels "
             "run theirs on the FMA units)"),
            *([f"- methods: those whose name contains {', '.join(map(repr, args.only))}"]
              if args.only else []),
            ("- --no-graph-cache: nothing of a graph is kept from call to call; every call "
             "sorts the edges and reads the bounds back" if args.no_graph_cache else
             "- the triton backend keeps the CSR orderings of an unmodified edge_index from call "
             "to call (as in training on one graph): the times are with them kept; each peak "
             "memory is measured with them dropped first, so it includes building them"),
            "- minimal forward bytes = e * N * H * (2 Cq + 2 C) + 4 N H + S, S the smaller of "
            "the CSR (4 E + 4 (N + 1)) and the block-sparse kernels' tile layout; "
            "% peak = bytes / fused forward kernel time / peak; % copy = the same over the "
            "measured copy bandwidth; % peak, k v per edge = the same with k and v read once "
            "per edge instead of once per node (+ e * (E - N) * H * (Cq + C))"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        header, results = args.replot_table
        plot(results, Path(args.replot).with_suffix(".png"), header)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "nothing was measured.", file=sys.stderr)
        return 2
    from graphattn.functional.triton_kernels import triton_available

    if not triton_available():
        print("benchmarks/gpu.py needs triton: pip install 'graphattn[gpu]'", file=sys.stderr)
        return 2
    if args.no_graph_cache:
        from graphattn import _tensor_cache

        _tensor_cache.CACHED_DEVICE_TYPES = set()
    dtype = DTYPES[args.dtype]
    device = torch.device("cuda")
    peak, peak_source = peak_bandwidth(torch.cuda.get_device_name(), args.peak_bandwidth)
    copy_bytes_per_s = copy_bandwidth()
    header = environment(args, peak, peak_source, copy_bytes_per_s)
    print("\n".join(header))

    checks = []
    if not args.no_check:
        check_graph = None
        if "cora" in args.graph_names:
            check_graph, _ = build_graph("cora", args, device, torch.cuda.mem_get_info()[0])
        if check_graph is None:
            check_graph = Graph("random", 2000, synthetic_graph(2000, 20_000, None, device))
        try:
            checks = check_on_device(check_graph, torch.float32)
            checks += check_blocks_on_device(device, torch.float32)
            checks += check_layer_compile_on_device(device, torch.float32)
            checks += check_dense_on_device(device, torch.float32)
        except Exception as err:  # still measure: the exit status reports the failed check
            print(f"the device check failed: {type(err).__name__}: {err}", file=sys.stderr)
            checks = [(f"check failed: {type(err).__name__}", math.nan)]
    # NaN ranks first: Python's max passes over a NaN that is not the first element
    worst = max((err for _, err in checks), key=lambda err: (math.isnan(err), err), default=0.0)
    if not args.no_check:
        print(f"fused vs reference on {check_graph.name}: max abs difference {worst:.2e}")
    else:
        print("fused vs reference: not checked (--no-check)")
    # after the check, which compares full fp32 products with the reference's
    torch.backends.cuda.matmul.allow_tf32 = args.tf32

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results, skipped, profiles = [], [], []
    for name in args.graph_names:
        graph, reason = build_graph(name, args, device, torch.cuda.mem_get_info()[0])
        if graph is None:
            print(f"skip graph {name}: {reason}")
            skipped.append(f"{name}: {reason}")
            continue
        print(f"{name}: N = {graph.num_nodes:,}, E = {graph.num_edges:,}")
        if args.profile and graph.num_edges <= 1_000_000:
            try:
                profiles.append(profile_fused(graph, args, dtype))
            except Exception as err:  # a profile is extra: the timings still run
                profiles.append(f"## {name}: profile failed: {type(err).__name__}: {err}\n")
        for r in measure_graph(graph, args, dtype, peak, copy_bytes_per_s):
            results.append(r)
            print(f"  {r.method:38s} fwd {_fmt(r.forward_ms, 3):>9s} ms  fwd+bwd "
                  f"{_fmt(r.train_ms, 3):>9s} ms  peak {_fmt(r.train_mib, 1):>9s} MiB  {r.note}")
        del graph
        torch.cuda.empty_cache()
        out.write_text(render_markdown(results, header, checks, skipped, profiles))

    out.write_text(render_markdown(results, header, checks, skipped, profiles))
    print(f"wrote {out}")
    if not args.no_plot:
        plot(results, out.with_suffix(".png"), header)
    if not worst < 1e-3:  # also catches NaN
        print(f"the fused kernels differ from the reference by {worst:.2e} (> 1e-3)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
