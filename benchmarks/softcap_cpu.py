"""What a soft cap of the scores costs on CPU: ``edge_attention(..., softcap=c)`` against the
same call without a cap, on the fused ``cpu`` backend, and the capped call on the
``reference`` backend (plain torch ops, ``[E, H, C]`` tensors).

For each score (dot, gatv2) on a random graph of ``--nodes`` nodes and ``--edges`` edges
(default 100,000 and 1,000,000, 8 heads x 8 channels, fp32, as ``benchmarks/vs_pyg.py``'s
``random-100k-1M``), forward under ``torch.no_grad`` and forward+backward (the gradients of q,
k, v and, for gatv2, att), interleaved (the order rotates every round) after warm-up; medians
and ratios to the uncapped ``cpu`` call.

Usage (one line):
    python benchmarks/softcap_cpu.py

Writes ``results/softcap_cpu.md`` and ``.csv`` (``--out`` names another ``.md``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cpu_steps import cpu_header, interleaved, operator_args  # noqa: E402
from _report import RESULTS, write_table  # noqa: E402

from graphattn.functional import edge_attention  # noqa: E402

CAP = 5.0
WAYS = {"cpu, no cap": ("cpu", None), "cpu, softcap": ("cpu", CAP),
        "reference, softcap": ("reference", CAP)}
BASELINE = "cpu, no cap"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return operator_args(__doc__.split("\n\n")[0], RESULTS / "softcap_cpu.md", argv)


def calls(score: str, nodes: int, edges: int, seed: int,
          backward: bool) -> dict[str, Callable[[], None]]:
    """One call per way on the same inputs: forward alone (no autograd) or forward and
    backward."""
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, nodes, (2, edges), generator=gen)
    q, k, v = (torch.randn(nodes, 8, 8, generator=gen).requires_grad_(backward)
               for _ in range(3))
    att = torch.randn(8, 8, generator=gen).requires_grad_(backward) if score == "gatv2" else None
    leaves = [t for t in (q, k, v, att) if t is not None]

    def call(backend: str, softcap: float | None) -> Callable[[], None]:
        def run() -> None:
            with torch.set_grad_enabled(backward):
                out = edge_attention(q, k, v, edge_index, score=score, att=att,
                                     softcap=softcap, backend=backend)
                if backward:
                    torch.autograd.grad(out.sum(), leaves)
        return run
    return {name: call(*way) for name, way in WAYS.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    header = cpu_header("softcap_cpu.py", argv, args.threads,
                        f"softcap = {CAP}; 8 heads x 8 channels, fp32; {args.rounds} "
                        f"interleaved rounds after {args.warmup} warm-up rounds, medians")
    graph = f"random graph, {args.nodes} nodes, {args.edges} edges"
    rows = []
    for score in ("dot", "gatv2"):
        for backward in (False, True):
            step = "forward+backward" if backward else "forward"
            medians = interleaved(calls(score, args.nodes, args.edges, args.seed, backward),
                                  args.rounds, args.warmup, f"{score} {step}")
            rows += [{"graph": graph, "score": score, "step": step, "way": way,
                      "ms": f"{ms:.2f}", "ratio to cpu, no cap": f"{ms / medians[BASELINE]:.2f}"}
                     for way, ms in medians.items()]
    note = ("Each row group is one interleaved run; ratios below 1 are faster than the "
            "uncapped cpu call. The cap is a tanh per edge and head in the forward and the "
            "target pass of backward (the source pass reads the factors the target pass "
            "wrote).")
    print(write_table("softcap_cpu", "Soft-capped scores on CPU: cost against no cap",
                      header, note, rows, out=Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
