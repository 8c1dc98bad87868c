"""fp32 accuracy at a hub: one target with E in-edges, against float64.

A target's output is a softmax-weighted sum over its in-edges. Summed one edge at a time in
fp32 the rounding error grows with the in-degree; the ``cpu`` kernels add blocks of
``SUM_BLOCK`` (128) edges in float64. The graph: E sources, each with one edge into the one
target (q ``[1, H, C]``, k and v ``[E, H, C]``, values shifted by +1 so that the sum does not
cancel). For each backend and each E, the relative error of the fp32 output and of the fp32
gradient of q (the loss: the output times fixed random weights) against the same backend in
float64, ``||x32 - x64|| / ||x64||``, and ``|sum(alpha) - 1|``. PyG's utilities for the same
function (``torch_geometric.utils.softmax`` and ``scatter``, as its ``TransformerConv`` uses
them) are measured beside them, forward only.

Usage (one line):

    python benchmarks/hub_precision.py                 # E = 1e4, 1e5, 1e6: ~1 min on 2 cores

Writes ``results/hub_precision.md`` and ``.csv`` (``--out`` names another ``.md``).
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
import torch_geometric
from _machine import cpu_name
from _report import RESULTS, write_table
from torch_geometric.utils import scatter, softmax
from tqdm import tqdm

from graphattn.functional import edge_attention

BACKENDS = ("cpu", "reference", "dense")


def relative(single: torch.Tensor, double: torch.Tensor) -> float:
    """``||single - double|| / ||double||``, in float64."""
    return ((single.double() - double).norm() / double.norm()).item()


def graphattn_case(q, k, v, w, edge_index, backend: str, dtype: torch.dtype):
    """Output, ``sum(alpha) - 1`` per head and the gradient of q, in ``dtype``."""
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out, alpha = edge_attention(q, k, v, edge_index, backend=backend, return_attention=True)
    (grad_q,) = torch.autograd.grad((out * w.to(dtype)).sum(), q)
    return out.detach(), alpha.detach().sum(0) - 1, grad_q


def pyg_case(q, k, v, edge_index, dtype: torch.dtype) -> torch.Tensor:
    """The same output with PyG's softmax and scatter (forward)."""
    src, dst = edge_index
    q, k, v = (t.to(dtype) for t in (q, k, v))
    score = (q[dst] * k[src]).sum(-1) / q.size(-1) ** 0.5  # (E, H)
    alpha = softmax(score, dst, num_nodes=1)
    return scatter(alpha.unsqueeze(-1) * v[src], dst, 0, dim_size=1, reduce="sum")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=int, nargs="+", default=[10**4, 10**5, 10**6],
                        help="in-degrees E of the hub (default: 1e4 1e5 1e6)")
    parser.add_argument("--heads", type=int, default=2, help="H (default: 2)")
    parser.add_argument("--channels", type=int, default=8, help="C per head (default: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "hub_precision.md")
    args = parser.parse_args(argv)
    for name in ("heads", "channels"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if min(args.edges) < 1:
        parser.error(f"--edges must be >= 1, got {min(args.edges)}")
    command = "python benchmarks/hub_precision.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    header = [f"command: `{command.strip()}`",
              f"torch {torch.__version__}, torch_geometric {torch_geometric.__version__}, "
              f"python {platform.python_version()}",
              f"device: CPU ({cpu_name()}), {torch.get_num_threads()} torch thread(s)",
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
        out64, out32 = (pyg_case(q, k, v, edge_index, dt)
                        for dt in (torch.float64, torch.float32))
        rows.append({"E": E, "method": "PyG softmax + scatter",
                     "out error": f"{relative(out32, out64):.1e}",
                     "abs(sum alpha - 1)": "", "grad q error": ""})
    note = ("Relative errors of fp32 against float64 for the same method (`grad q`: the "
            "gradient of the one target's query). The `cpu` kernels sum a node's edges in "
            "blocks of 128 added in float64; `reference` and PyG sum them one at a time "
            "(`index_add_` / `scatter`); `dense` through SDPA's blocked products.")
    text = write_table("hub_precision", "fp32 accuracy at a hub of E in-edges", header, note,
                       rows, out=args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
