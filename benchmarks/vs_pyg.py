"""GraphSelfAttention against PyG's TransformerConv, GATConv and GATv2Conv on CPU: time and memory.

Each PyG layer is compared with the GraphSelfAttention that computes the same function, with
the same parameters: the PyG layer converted by ``graphattn.nn.from_pyg``
(``tests/nn/test_convert.py`` checks each conversion): TransformerConv as
``attention="dot", residual=True`` (its root weight is the residual), GATConv as
``"additive"`` (``bias=False, out_bias=True``) and GATv2Conv as ``"gatv2"``
(``share_value=True, out_bias=True``). One configuration for all layers: input dim 64,
8 heads x 8 channels (concatenated, 64 outputs), fp32, projections included, on the same edge
set with one self-loop per node (added once with ``torch_geometric.utils.add_remaining_self_loops``;
the layers that add self-loops get ``add_self_loops=False`` so that none redoes it;
TransformerConv has no such option).
Features are random (the PubMed mirror has no feature file; only the graph matters here).
Graphs: Cora, CiteSeer, PubMed, a uniform random graph with 100k nodes and 1M edges and one with
1M nodes and 10M edges (plus the self-loops). Writes ``results/vs_pyg.md``, the numbers as
``results/vs_pyg.csv`` and, with matplotlib, ``results/vs_pyg.png`` (time and memory by graph).

``--edge-dim D`` gives every edge D random features and every layer ``edge_dim=D``, each pair
still computing the same function: TransformerConv's edge features (added to keys and values)
against ``edge_mode="key_value"``, GATv2Conv's (inside the LeakyReLU) against ``"key"``,
GATConv's (a score term per head) against ``"bias"``. Its tables go to
``results/vs_pyg_edge_features.*``.

Time: each graph runs in its own subprocess, where the six layers are interleaved (rotating
order) after two warm-up calls each, and the median of the repeats is kept: the forward
(inference, ``torch.no_grad``) and the training step (forward, ``out.sum().backward()``).

Peak memory: each (graph, layer) runs in a fresh subprocess that builds its inputs, warms the
layer up on a 1000-node ring (so numba's kernels are loaded), resets the peak resident set size
(VmHWM, through ``/proc/self/clear_refs``) and runs one training step; the figure is VmHWM after
the step minus VmRSS before it: every byte the step holds at once (activations kept for backward,
gradients, temporaries), whichever allocator asked for it. glibc serves allocations above
256 KiB with mmap, so freed tensors leave the resident set.

Every subprocess runs under an address-space limit (``RLIMIT_AS``, ``--memory-limit``, default
12 GiB) so that a layer that needs more fails with an out-of-memory error instead of taking the
machine down; such a layer is reported as "out of memory". For PyG on the largest graph the
peak is then extrapolated from two smaller graphs with the same node count (``--probe-edges``).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import json
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numba
import torch
import torch_geometric
from _machine import cpu_name
from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv
from torch_geometric.utils import add_remaining_self_loops

from graphattn.datasets import load_planetoid
from graphattn.nn import from_pyg

IN_CHANNELS, HEADS, CHANNELS = 64, 8, 8
# each PyG layer -> the GraphSelfAttention it is compared with
COUNTERPART = {"TransformerConv": "GraphSelfAttention dot",
               "GATConv": "GraphSelfAttention additive",
               "GATv2Conv": "GraphSelfAttention gatv2"}
PYG_LAYERS = tuple(COUNTERPART)
LAYERS = tuple(name for pyg in PYG_LAYERS for name in (COUNTERPART[pyg], pyg))
GIB = 2**30


@dataclass(frozen=True)
class Case:
    """A graph: a Planetoid dataset's structure, or a uniform random graph."""

    name: str
    dataset: str | None = None
    num_nodes: int = 0
    num_edges: int = 0
    repeats: int = 10


CASES = {c.name: c for c in (
    Case("Cora", dataset="Cora", repeats=20),
    Case("CiteSeer", dataset="CiteSeer", repeats=20),
    Case("PubMed", dataset="PubMed", repeats=10),
    Case("random-100k-1M", num_nodes=100_000, num_edges=1_000_000, repeats=5),
    Case("random-1M-10M", num_nodes=1_000_000, num_edges=10_000_000, repeats=3),
)}
LARGEST = "random-1M-10M"


def make_graph(case: Case, root: str | None, edge_dim: int = 0,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Features ``[N, 64]``, ``edge_index`` with one self-loop per node and, with ``edge_dim``,
    edge features ``[E, edge_dim]``."""
    gen = torch.Generator().manual_seed(0)
    if case.dataset is not None:
        data = load_planetoid(case.dataset, root, structure_only=True)
        num_nodes, edge_index = data.num_nodes, data.edge_index
    else:
        num_nodes = case.num_nodes
        edge_index = torch.randint(0, num_nodes, (2, case.num_edges), generator=gen)
    edge_index, _ = add_remaining_self_loops(edge_index, num_nodes=num_nodes)
    x = torch.randn(num_nodes, IN_CHANNELS, generator=gen)
    edge_attr = (torch.randn(edge_index.size(1), edge_dim, generator=gen) if edge_dim > 0
                 else None)
    return x, edge_index, edge_attr


# each score -> the PyG layer whose conversion (graphattn.nn.from_pyg) has it
PYG_COUNTERPART = {"dot": "TransformerConv", "additive": "GATConv", "gatv2": "GATv2Conv"}


def make_layer(name: str, edge_dim: int = 0) -> torch.nn.Module:
    torch.manual_seed(0)
    edge = {"edge_dim": edge_dim} if edge_dim > 0 else {}
    if name.startswith("GraphSelfAttention"):
        # the PyG counterpart converted by graphattn.nn.from_pyg: the same function, with the
        # same parameters (tests/nn/test_convert.py)
        return from_pyg(make_layer(PYG_COUNTERPART[name.split()[1]], edge_dim))
    if name == "TransformerConv":
        return TransformerConv(IN_CHANNELS, CHANNELS, heads=HEADS, **edge)
    conv = GATConv if name == "GATConv" else GATv2Conv
    return conv(IN_CHANNELS, CHANNELS, heads=HEADS, add_self_loops=False, **edge)


def forward(layer: torch.nn.Module, x: torch.Tensor, edge_index: torch.Tensor,
            edge_attr: torch.Tensor | None = None) -> None:
    with torch.no_grad():
        layer(x, edge_index, edge_attr)


def train_step(layer: torch.nn.Module, x: torch.Tensor, edge_index: torch.Tensor,
               edge_attr: torch.Tensor | None = None) -> None:
    layer.zero_grad(set_to_none=True)
    layer(x, edge_index, edge_attr).sum().backward()


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, MemoryError) or "alloc" in str(err).lower()


# ----------------------------------------------------------------------------------------------
# Workers (each in its own subprocess)


def time_worker(case: Case, root: str | None, repeats: int, edge_dim: int = 0) -> dict:
    """Interleaved medians of the forward and the training step of every layer on one graph."""
    x, edge_index, edge_attr = make_graph(case, root, edge_dim)
    layers = {name: make_layer(name, edge_dim) for name in LAYERS}
    result: dict = {"num_nodes": x.size(0), "num_edges": edge_index.size(1), "layers": {}}
    times: dict[str, dict[str, list[float]]] = {n: {"forward": [], "train": []} for n in layers}
    for name, layer in list(layers.items()):
        try:
            for _ in range(2):
                forward(layer, x, edge_index, edge_attr)
                train_step(layer, x, edge_index, edge_attr)
        except (RuntimeError, MemoryError) as err:
            if not is_out_of_memory(err):
                raise
            result["layers"][name] = {"error": "out of memory"}
            del layers[name]
            gc.collect()
    for r in range(repeats):
        names = list(layers)
        names = names[r % len(names):] + names[:r % len(names)] if names else names
        for name in names:
            for kind, fn in (("forward", forward), ("train", train_step)):
                t0 = time.perf_counter()
                fn(layers[name], x, edge_index, edge_attr)
                times[name][kind].append(time.perf_counter() - t0)
    for name in layers:
        result["layers"][name] = {kind: statistics.median(ts) for kind, ts in
                                  times[name].items()}
    return result


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


def memory_worker(case: Case, root: str | None, layer_name: str, edge_dim: int = 0) -> dict:
    """Peak resident memory of one training step above the memory before it."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 256 * 1024)
    libc.mallopt(m_trim_threshold, 256 * 1024)
    x, edge_index, edge_attr = make_graph(case, root, edge_dim)
    layer = make_layer(layer_name, edge_dim)
    ring = torch.arange(1000)  # sparse enough for backend="auto" to pick the sparse kernels
    train_step(layer, x[:1000], torch.stack([ring, ring.roll(1)]),
               None if edge_attr is None else edge_attr[:1000])
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set size
    start = _status_bytes("VmRSS")
    try:
        train_step(layer, x, edge_index, edge_attr)
    except (RuntimeError, MemoryError) as err:
        if not is_out_of_memory(err):
            raise
        return {"error": "out of memory"}
    return {"peak": _status_bytes("VmHWM") - start, "inputs": start,
            "num_edges": edge_index.size(1)}


def compile_worker() -> dict:
    """numba's compile time (empty cache) or load time (warm cache) for the fp32 kernels of the
    dot score (each score has its own kernels, compiled on its first use)."""
    x, edge_index, _ = make_graph(Case("tiny", num_nodes=100, num_edges=500), None)
    layer = make_layer(LAYERS[0])
    t0 = time.perf_counter()
    train_step(layer, x, edge_index)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    train_step(layer, x, edge_index)
    return {"first_call": first, "steady": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------
# Driver


def run_worker(args: list[str], memory_limit: float, env: dict | None = None) -> dict:
    """Run this script as a worker under an address-space limit; its JSON result."""
    limit = int(memory_limit * GIB)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          preexec_fn=cap, env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        # SIGKILL: the kernel's OOM killer; a failed allocation otherwise raises or aborts with
        # its message. Any other signal (a segfault) is a crash, not a lack of memory.
        if (proc.returncode == -signal.SIGKILL
                or any(s in proc.stderr for s in ("MemoryError", "bad_alloc"))):
            return {"error": "out of memory"}
        if proc.returncode < 0:
            return {"error": f"crashed: {signal.Signals(-proc.returncode).name}"}
        return {"error": tail[0][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt_ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


def fmt_mb(nbytes: float | None) -> str:
    return "" if nbytes is None else f"{nbytes / 2**20:.0f}"


def fmt_ratio(ours: float | None, theirs: float | None) -> str:
    return "" if ours is None or theirs is None else f"{ours / theirs:.2f}"


def extrapolate(points: list[tuple[int, int]], num_edges: int) -> float:
    """Least-squares line through (edges, peak bytes), evaluated at ``num_edges``."""
    n = len(points)
    mean_e = sum(e for e, _ in points) / n
    mean_p = sum(p for _, p in points) / n
    slope = (sum((e - mean_e) * (p - mean_p) for e, p in points)
             / sum((e - mean_e) ** 2 for e, _ in points))
    return mean_p + slope * (num_edges - mean_e)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES),
                        help="graphs to run (default: all)")
    parser.add_argument("--repeats", type=float, default=1.0,
                        help="multiply every graph's number of timed repeats (default: 1)")
    parser.add_argument("--memory-limit", type=float, default=12.0,
                        help="address-space limit of every subprocess in GiB (default: 12)")
    parser.add_argument("--probe-edges", type=int, nargs="*", default=[1_000_000, 3_000_000],
                        help="random edges of the 1M-node graphs on which PyG's peak is "
                             "measured to extrapolate it to the largest graph (default: 1M 3M)")
    parser.add_argument("--root", default=None,
                        help="root of the Planetoid raw files (default: load_planetoid's; "
                             "missing files are downloaded)")
    parser.add_argument("--edge-dim", type=int, default=0,
                        help="edge features per edge; 0 for none (default: 0)")
    parser.add_argument("--output", default=None,
                        help="table path (default: results/vs_pyg.md, or "
                             "results/vs_pyg_edge_features.md with --edge-dim)")
    parser.add_argument("--worker", choices=["time", "memory", "compile"], help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--layer", help=argparse.SUPPRESS)
    parser.add_argument("--num-edges", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.edge_dim < 0:
        parser.error(f"--edge-dim must be >= 0 (0: no edge features), got {args.edge_dim}")
    for name in ("repeats", "memory_limit"):
        if not getattr(args, name) > 0:  # (NaN too)
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if any(edges < 1 for edges in args.probe_edges):
        parser.error(f"--probe-edges must be positive edge counts, got {args.probe_edges}")

    if args.worker is not None:
        case = CASES.get(args.case)
        if args.num_edges is not None:
            case = Case(f"probe-{args.num_edges}", num_nodes=CASES[LARGEST].num_nodes,
                        num_edges=args.num_edges)
        if args.worker == "time":
            result = time_worker(case, args.root, max(1, round(case.repeats * args.repeats)),
                                 args.edge_dim)
        elif args.worker == "memory":
            result = memory_worker(case, args.root, args.layer, args.edge_dim)
        else:
            result = compile_worker()
        print(json.dumps(result))
        return

    command = "python " + " ".join(shlex.quote(a) for a in [
        str(Path(__file__).relative_to(Path.cwd()) if Path(__file__).is_relative_to(Path.cwd())
            else __file__), *sys.argv[1:]])
    header = [
        f"command: `{command}`",
        f"torch {torch.__version__}, torch_geometric {torch_geometric.__version__}, "
        f"numba {numba.__version__}, python {platform.python_version()}",
        f"CPU: {cpu_name()}, torch threads: {torch.get_num_threads()}",
        f"memory limit per subprocess: {args.memory_limit:g} GiB (RLIMIT_AS)",
        f"load average (1 min) at the start: {os.getloadavg()[0]:.1f}",
    ]
    for line in header:
        print(line)
    common = (["--root", args.root] if args.root else []) + ["--edge-dim", str(args.edge_dim)]

    with tempfile.TemporaryDirectory() as cache_dir:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache_dir}
        cold = run_worker(["--worker", "compile"], args.memory_limit, env)
        warm = run_worker(["--worker", "compile"], args.memory_limit, env)
    if "error" in cold or "error" in warm:
        jit_line = f"numba compile time not measured: {cold.get('error') or warm.get('error')}"
    else:
        jit_line = (f"numba kernels of the dot score (fp32): compiled in "
                    f"{cold['first_call'] - cold['steady']:.1f}"
                    f" s with an empty cache, loaded in {warm['first_call'] - warm['steady']:.2f}"
                    f" s from the cache; both happen in the warm-up, outside the timings")
    print(jit_line)

    rows = []
    for name in args.cases:
        print(f"{name}: timing ...", flush=True)
        timing = run_worker(["--worker", "time", "--case", name, "--repeats",
                             str(args.repeats), *common], args.memory_limit)
        memory = {}
        for layer in LAYERS:
            print(f"{name}: peak memory of {layer} ...", flush=True)
            memory[layer] = run_worker(["--worker", "memory", "--case", name, "--layer", layer,
                                        *common], args.memory_limit)
        rows.append((name, timing, memory))

    probe_lines = []
    if LARGEST in args.cases and args.probe_edges:
        for layer in PYG_LAYERS:
            largest = next(memory for name, _, memory in rows if name == LARGEST)[layer]
            if "error" not in largest:
                continue
            points = []
            for num_edges in args.probe_edges:
                print(f"probe {num_edges} edges: peak memory of {layer} ...", flush=True)
                probe = run_worker(["--worker", "memory", "--case", LARGEST, "--layer", layer,
                                    "--num-edges", str(num_edges), *common],
                                   args.memory_limit)
                if "error" not in probe:
                    points.append((probe["num_edges"], probe["peak"], probe["inputs"]))
            if len(points) >= 2:
                timing = next(t for n, t, _ in rows if n == LARGEST)
                target = timing.get("num_edges", CASES[LARGEST].num_edges)
                peak = extrapolate([(e, p) for e, p, _ in points], target)
                inputs = points[-1][2]
                probe_lines.append(
                    f"- {layer} on {LARGEST}: out of memory under the {args.memory_limit:g} GiB "
                    f"limit. Its peak measured on the same 1M nodes with "
                    + ", ".join(f"{e / 1e6:.1f}M edges: {p / GIB:.2f} GiB" for e, p, _ in points)
                    + f" extrapolates linearly to {peak / GIB:.1f} GiB at {target / 1e6:.1f}M "
                    f"edges; with the inputs and the process (~{inputs / GIB:.1f} GiB on the "
                    f"{points[-1][0] / 1e6:.1f}M-edge probe) that is "
                    f"{(peak + inputs) / GIB:.1f} GiB, "
                    + ("within" if peak + inputs <= 24 * GIB else "beyond") + " 24 GiB.")

    table = [
        "| graph | nodes | edges | layer | forward ms | fwd+bwd ms | peak MB (fwd+bwd) "
        "| forward ours/PyG | fwd+bwd ours/PyG | peak ours/PyG |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, timing, memory in rows:
        if "error" in timing and "layers" not in timing:
            table.append(f"| {name} | | | | {timing['error']} | | | | | |")
            continue
        for layer in LAYERS:
            t = timing["layers"].get(layer, {})
            m = memory[layer]
            fwd, train = t.get("forward"), t.get("train")
            peak = m.get("peak")
            note = t.get("error") or m.get("error")
            fwd_cell = fmt_ms(fwd) if fwd is not None else (note or "")
            ratios = ["", "", ""]
            if layer in COUNTERPART:
                ours_t = timing["layers"].get(COUNTERPART[layer], {})
                ours_m = memory[COUNTERPART[layer]].get("peak")
                ratios = [fmt_ratio(ours_t.get("forward"), fwd),
                          fmt_ratio(ours_t.get("train"), train), fmt_ratio(ours_m, peak)]
            table.append(f"| {name} | {timing['num_nodes']} | {timing['num_edges']} | {layer} "
                         f"| {fwd_cell} | {fmt_ms(train)} | "
                         f"{fmt_mb(peak) if peak is not None else (m.get('error') or '')} | "
                         + " | ".join(ratios) + " |")
    load = os.getloadavg()[0]
    header.append(f"load average (1 min) at the end: {load:.1f} (the machine may be shared: "
                  "other jobs slow every layer; the ratios come from interleaved runs)")
    print(header[-1])
    print()
    print("\n".join(table))
    for line in probe_lines:
        print(line)

    name = "vs_pyg_edge_features.md" if args.edge_dim > 0 else "vs_pyg.md"
    output = Path(args.output or Path(__file__).parent / "results" / name)
    edge_line = (f"Every edge has {args.edge_dim} random features, every layer `edge_dim="
                 f"{args.edge_dim}`: TransformerConv against `edge_mode=\"key_value\"`, "
                 "GATv2Conv against `\"key\"`, GATConv against `\"bias\"`.")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join([
        "# GraphSelfAttention vs PyG (TransformerConv, GATConv, GATv2Conv) on CPU",
        "",
        *(f"- {line}" for line in [*header, jit_line]),
        "",
        f"Input dim {IN_CHANNELS}, {HEADS} heads x {CHANNELS} channels, fp32, projections "
        "included, one self-loop per node (the same edge set for every layer). forward: "
        "inference under `torch.no_grad`; fwd+bwd: forward and `out.sum().backward()`; medians "
        "of interleaved repeats after warm-up. Peak MB: resident memory of one fwd+bwd step "
        "above the memory before it, in a fresh process per layer and graph. Each PyG row's "
        "ratios are GraphSelfAttention with the same score (the row above it) / that PyG "
        "layer: below 1 favours GraphSelfAttention. Each pair computes the same function "
        "with the same parameters: the GraphSelfAttention is the PyG layer converted by "
        "`graphattn.nn.from_pyg` (tests/nn/test_convert.py).",
        *(["", edge_line] if args.edge_dim > 0 else []),
        "",
        *table,
        "",
        *probe_lines,
        "",
    ]))
    print(f"wrote {output}")
    records = []
    for name, timing, memory in rows:
        for layer in LAYERS:
            t, peak = timing.get("layers", {}).get(layer, {}), memory[layer].get("peak")
            records.append({"graph": name, "nodes": timing.get("num_nodes"),
                            "edges": timing.get("num_edges"), "layer": layer,
                            "forward_ms": None if t.get("forward") is None
                            else 1e3 * t["forward"],
                            "train_ms": None if t.get("train") is None else 1e3 * t["train"],
                            "peak_mb": None if peak is None else peak / 2**20,
                            "error": t.get("error") or memory[layer].get("error", "")})
    table_csv = output.with_suffix(".csv")
    with table_csv.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    print(f"wrote {table_csv}")
    plot(records, output.with_suffix(".png"))


def plot(records: list[dict], path: Path) -> None:
    """Bars of fwd+bwd time and peak memory per graph, each PyG layer beside its counterpart
    (log scale; a bar without a value is marked "OOM" when out of memory, else "error")."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    graphs = list(dict.fromkeys(r["graph"] for r in records))
    value = {(r["graph"], r["layer"]): r for r in records}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(LAYERS)
    colours = {"dot": "tab:blue", "additive": "tab:orange", "gatv2": "tab:green"}
    for ax, key, label in ((axes[0], "train_ms", "forward+backward (ms)"),
                           (axes[1], "peak_mb", "peak memory of a step (MB)")):
        missing = []  # (x, label) of bars without a value
        for n, layer in enumerate(LAYERS):
            ours = layer.startswith("GraphSelfAttention")
            score = layer.split()[1] if ours else COUNTERPART[layer].split()[1]
            xs = [g + (n - (len(LAYERS) - 1) / 2) * width for g in range(len(graphs))]
            ys = [value[(g, layer)][key] for g in graphs]
            ax.bar(xs, [y or 0.0 for y in ys], width, color=colours[score],
                   alpha=1.0 if ours else 0.45, hatch="" if ours else "//", label=layer)
            missing += [(x, "OOM" if "out of memory" in value[(g, layer)]["error"] else "error")
                        for x, y, g in zip(xs, ys, graphs, strict=True) if y is None]
        ax.set_yscale("log")
        for x, text in missing:
            ax.text(x, ax.get_ylim()[0], text, rotation=90, ha="center", va="bottom",
                    fontsize=7)
        ax.set_ylabel(label)
        ax.set_xticks(range(len(graphs)), graphs, fontsize=8)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(LAYERS), fontsize=8)
    fig.suptitle("GraphSelfAttention (solid) vs the PyG layer computing the same function "
                 f"(hatched), CPU, {HEADS} heads x {CHANNELS} channels")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
