"""fp32 accuracy at a hub: one target with E in-edges, against float64.

A target's output is a softmax-weighted sum over its in-edges. Summed one edge at a time in
fp32 the rounding error grows with the in-degree; the ``cpu`` kernels add blocks of
``SUM_BLOCK`` (128) edges in float64. The graph: E sources, each with one edge into the one
target (q ``[1, H, C]``, k and v ``[E, H, C]``, values shifted by +1 so that the sum does not
cancel). For each backend and each E, the relative error of the fp32 output and of the fp32
gradient of q (the loss: the output times fixed random weights) against the same backend in
float64, ``||x32 - x64|| / ||x64||``, and ``|sum(alpha) - 1|``. PyG's utilities for the same
function (``torch_geometric.utils.softmax`` and ``scatter``, as its ``TransformerConv`` uses
them) are measured beside them, forward only. The ``triton`` backend runs in Triton's CPU
interpreter (``TRITON_INTERPRET=1`` for those calls) at the in-degrees of
``--triton-edges``, twice: with the hub's row in the launch of its own (float64 block sums), as
on a graph of at least ``HUB_EDGES`` edges, and in one fp32 sum, as on a smaller graph. It
computes in fp32 only, so its truth is the ``reference`` backend in float64, and the
interpreter takes minutes where a GPU takes a millisecond (one program per source in backward:
about 3 min per row at E = 1e4). ``--triton-device cuda`` runs it compiled on the GPU instead,
at every in-degree.

Usage (one line):

    python benchmarks/hub_precision.py                 # E = 1e4, 1e5, 1e6: ~8 min on 2 cores
    python benchmarks/hub_precision.py --triton-device cuda --out OUT.md   # triton at every E

Writes ``results/hub_precision.md`` and ``.csv`` (``--out`` names another ``.md``) and, with
matplotlib, the errors against E on log-log axes beside them (``.png``; ``--no-plot``: none).
``--replot results/hub_precision.csv`` draws the figure of a table written before and
measures nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch
import torch_geometric
from _machine import cpu_name
from _report import RESULTS, replot_rows, write_table
from torch_geometric.utils import scatter, softmax
from tqdm import tqdm

from graphattn.functional import edge_attention
from graphattn.functional.triton_kernels import HUB_EDGES, SUM_STEPS

BACKENDS = ("cpu", "reference", "dense")
# the triton backend's two ways to sum a row, by whether the hub takes its launch of its own
TRITON_SUMS = {True: "hub launch", False: "one fp32 sum"}
TRITON_WHERE = {"interpreter": "interpreter", "cuda": "CUDA"}  # --triton-device: its label


def triton_method(hub: bool, device: str) -> str:
    """The table's name of a triton row."""
    return f"triton, {TRITON_SUMS[hub]} ({TRITON_WHERE[device]})"


def relative(single: torch.Tensor, double: torch.Tensor) -> float:
    """``||single - double|| / ||double||``, in float64."""
    return ((single.double() - double).norm() / double.norm()).item()


def graphattn_case(q, k, v, w, edge_index, backend: str, dtype: torch.dtype):
    """Output, ``sum(alpha) - 1`` per head and the gradient of q, in ``dtype``."""
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out, alpha = edge_attention(q, k, v, edge_index, backend=backend, return_attention=True)
    (grad_q,) = torch.autograd.grad((out * w.to(dtype)).sum(), q)
    return out.detach(), alpha.detach().sum(0) - 1, grad_q


def triton_case(q, k, v, w, edge_index, *, hub: bool, device: str = "interpreter"):
    """:func:`graphattn_case` of the ``triton`` backend in fp32, in Triton's interpreter on CPU
    tensors (``device="interpreter"``) or compiled on CUDA tensors (``"cuda"``); with ``hub``,
    the hub's rows in the launch of their own with float64 block sums, as on a graph of at
    least ``HUB_EDGES`` edges, else in one fp32 sum, as on a smaller one. Results on CPU."""
    from graphattn.functional import triton_kernels

    if not triton_kernels.triton_available():
        return None
    before = os.environ.get("TRITON_INTERPRET"), triton_kernels.HUB_EDGES
    if device == "interpreter":
        os.environ["TRITON_INTERPRET"] = "1"  # the kernels of the interpreter, on CPU tensors
    triton_kernels.HUB_EDGES = 0 if hub else sys.maxsize
    on = "cuda" if device == "cuda" else "cpu"
    try:
        q, k, v = (t.to(on, torch.float32).requires_grad_() for t in (q, k, v))
        out, alpha = triton_kernels.triton_edge_attention(
            q, k, v, edge_index.to(on), scale=q.size(-1) ** -0.5, bias=None,
            dropout_mask=None, score="dot", negative_slope=0.2, need_alpha=True)
        (grad_q,) = torch.autograd.grad((out * w.to(on, torch.float32)).sum(), q)
    finally:
        triton_kernels.HUB_EDGES = before[1]
        if before[0] is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before[0]
    return out.detach().cpu(), alpha.detach().sum(0).cpu() - 1, grad_q.cpu()


def pyg_case(q, k, v, edge_index, dtype: torch.dtype) -> torch.Tensor:
    """The same output with PyG's softmax and scatter (forward)."""
    src, dst = edge_index
    q, k, v = (t.to(dtype) for t in (q, k, v))
    score = (q[dst] * k[src]).sum(-1) / q.size(-1) ** 0.5  # (E, H)
    alpha = softmax(score, dst, num_nodes=1)
    return scatter(alpha.unsqueeze(-1) * v[src], dst, 0, dim_size=1, reduce="sum")


PLOTTED = ("out error", "grad q error")  # the figure's panels, columns of the table


def plot(rows: list[dict], path: Path) -> None:
    """The fp32 errors against the in-degree E, log-log, one panel per column of ``PLOTTED``
    and a line per method (a lone point where a method ran at one E)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(row["method"] for row in rows))
    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(12.5, 4.4), sharey=True)
    lines = {}
    for ax, column in zip(axes, PLOTTED, strict=True):
        for n, method in enumerate(methods):
            pts = sorted((int(row["E"]), float(row[column])) for row in rows
                         if row["method"] == method and row[column] not in ("", None))
            if pts:  # PyG's dashed: it lies on the reference backend's line
                lines[method], = ax.plot(*zip(*pts, strict=True), "o" if n % 2 else "s",
                                         ls="--" if method.startswith("PyG") else "-",
                                         color=f"C{n}", label=method)
        ax.set(xscale="log", yscale="log", title=column, xlabel="in-degree E of the hub")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("relative error, fp32 against float64")
    fig.legend(handles=list(lines.values()), loc="center right", fontsize=8)
    fig.suptitle("fp32 accuracy at a hub: the softmax-weighted sum over E in-edges")
    fig.tight_layout(rect=(0, 0, 0.79, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=int, nargs="+", default=[10**4, 10**5, 10**6],
                        help="in-degrees E of the hub (default: 1e4 1e5 1e6)")
    parser.add_argument("--triton-edges", type=int, nargs="*", default=None,
                        help="in-degrees at which the triton backend runs (default: 1e4 in "
                             "the interpreter, every --edges on CUDA; none: skip it)")
    parser.add_argument("--triton-device", choices=tuple(TRITON_WHERE),
                        default="interpreter",
                        help="the triton backend in Triton's CPU interpreter (default) or "
                             "compiled on the CUDA device")
    parser.add_argument("--heads", type=int, default=2, help="H (default: 2)")
    parser.add_argument("--channels", type=int, default=8, help="C per head (default: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "hub_precision.md")
    parser.add_argument("--no-plot", action="store_true", help="no figure (.png beside --out)")
    parser.add_argument("--replot", type=Path, default=None, metavar="CSV",
                        help="draw the figure of a table this script wrote, and stop")
    args = parser.parse_args(argv)
    if args.replot is not None:
        plot(replot_rows(parser, args.replot, ("E", "method", *PLOTTED)),
             args.replot.with_suffix(".png"))
        return 0
    for name in ("heads", "channels"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.edges) < 1:
        parser.error(f"--edges must be >= 1, got {min(args.edges)}")
    if args.triton_device == "cuda" and not torch.cuda.is_available():
        parser.error("--triton-device cuda needs a CUDA device, and torch sees none")
    if args.triton_edges is None:
        args.triton_edges = args.edges if args.triton_device == "cuda" else [10**4]
    command = "python benchmarks/hub_precision.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    header = [f"command: `{command.strip()}`",
              f"torch {torch.__version__}, torch_geometric {torch_geometric.__version__}, "
              f"python {platform.python_version()}",
              f"device: CPU ({cpu_name()}), {torch.get_num_threads()} torch thread(s)"
              + (f"; triton on {torch.cuda.get_device_name()}"
                 if args.triton_device == "cuda" else ""),
              f"graph: one target with E in-edges from E sources; H = {args.heads}, "
              f"C = {args.channels}"]
    print("\n".join(header))
    H, C = args.heads, args.channels
    rows = []
    for E in tqdm(args.edges, desc="hub sizes"):
        gen = torch.Generator().manual_seed(args.seed)
        edge_index = torch.stack([torch.arange(E), torch.zeros(E, dtype=torch.long)])
        q = torch.randn(1, H, C, generator=gen, dtype=torch.float64)
        k = torch.randn(E, H, C, generator=gen, dtype=torch.float64)
        v = torch.randn(E, H, C, generator=gen, dtype=torch.float64) + 1
        w = torch.randn(1, H, C, generator=gen, dtype=torch.float64)
        for backend in BACKENDS:
            out64, _, grad64 = graphattn_case(q, k, v, w, edge_index, backend, torch.float64)
            out32, drift, grad32 = graphattn_case(q, k, v, w, edge_index, backend,
                                                  torch.float32)
            rows.append({"E": E, "method": backend,
                         "out error": f"{relative(out32, out64):.1e}",
                         "abs(sum alpha - 1)": f"{drift.abs().max().item():.1e}",
                         "grad q error": f"{relative(grad32, grad64):.1e}"})
        for hub in (True, False) if E in args.triton_edges else ():
            single = triton_case(q, k, v, w, edge_index, hub=hub, device=args.triton_device)
            if single is None:
                break
            out64, _, grad64 = graphattn_case(q, k, v, w, edge_index, "reference",
                                              torch.float64)
            rows.append({"E": E, "method": triton_method(hub, args.triton_device),
                         "out error": f"{relative(single[0], out64):.1e}",
                         "abs(sum alpha - 1)": f"{single[1].abs().max().item():.1e}",
                         "grad q error": f"{relative(single[2], grad64):.1e}"})
        out64, out32 = (pyg_case(q, k, v, edge_index, dt)
                        for dt in (torch.float64, torch.float32))
        rows.append({"E": E, "method": "PyG softmax + scatter",
                     "out error": f"{relative(out32, out64):.1e}",
                     "abs(sum alpha - 1)": "", "grad q error": ""})
    note = ("Relative errors of fp32 against float64 for the same method (`grad q`: the "
            "gradient of the one target's query). The `cpu` kernels sum a node's edges in "
            "blocks of 128 added in float64; `triton` (its fused kernels, in Triton's CPU "
            "interpreter or on CUDA, against `reference` in float64) in tiles of `block_e` "
            "edges: "
            f"with the hub launch (graphs of at least {HUB_EDGES} edges) {SUM_STEPS} tiles at "
            "a time in fp32, the blocks added in float64, else in one fp32 sum over the tiles "
            "(smaller graphs); `reference` and PyG "
            "sum them one at a time (`index_add_` / `scatter`); `dense` through SDPA's "
            "blocked products.")
    text = write_table("hub_precision", "fp32 accuracy at a hub of E in-edges", header, note,
                       rows, out=args.out)
    print(text)
    if not args.no_plot:
        plot(rows, args.out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
