"""The ``cpu`` kernels compiled per option set or one variant reading them at run time.

The ``cpu`` backend compiles its three kernels with the score, the bias and edge-term flags,
channel counts up to 128 (powers of two) and one head as constants, one variant per option set.
``GRAPHATTN_CPU_SPECIALISE=0`` (or the module's ``SPECIALISED_FLAGS``, ``SPECIALISED_CHANNELS``
and ``SPECIALISED_HEADS`` switched off) makes one variant, which reads them at run time, serve
every option set of a dtype. Two measurements:

- time: the same calls both ways, interleaved after warm-up (medians): ``edge_attention(...,
  backend="cpu")`` forward (inference) and forward+backward (dropout 0.5) on a citation graph
  with self-loops, 8 heads of 8 channels with a bias, per score; and one training step of
  ``graphattn.nn.GAT`` and of ``graphattn.nn.GraphTransformer`` (sparse CSR features);
- compile: in a fresh process with an empty numba cache, per way, the first forward+backward of
  each of a sweep of option sets (scores, with and without a bias, 8 and 16 channels), on a
  small graph: the seconds they took and the kernels compiled.

Usage (one line):
    python benchmarks/cpu_specialisation.py

Writes ``results/cpu_specialisation.md`` and ``.csv`` (``--out`` names another ``.md``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cpu_steps import (  # noqa: E402
    cpu_header,
    gat_step,
    interleaved,
    parse_step_args,
    step_parser,
    transformer_step,
)
from _report import RESULTS, write_table  # noqa: E402

from graphattn.datasets import load_planetoid  # noqa: E402
from graphattn.functional import edge_attention  # noqa: E402

cpu = sys.modules["graphattn.functional.cpu"]  # (imported by graphattn.functional)
CONSTANT, RUN_TIME = "compiled per option set", "options read at run time"
SWITCHES = {  # the module's switches for each way
    CONSTANT: {"SPECIALISED_FLAGS": True, "SPECIALISED_CHANNELS": cpu.CONSTANT_CHANNELS,
               "SPECIALISED_HEADS": cpu.CONSTANT_HEADS},
    RUN_TIME: {"SPECIALISED_FLAGS": False, "SPECIALISED_CHANNELS": frozenset(),
               "SPECIALISED_HEADS": frozenset()},
}
ENVIRONMENT = {CONSTANT: "1", RUN_TIME: "0"}  # GRAPHATTN_CPU_SPECIALISE of each way

# A fresh process: the first forward+backward of each option set in argv[1] (JSON: score,
# bias, channels), the seconds each took and the kernels compiled, as JSON on the last line.
SWEEP = """
import gc, json, sys, time
import numba
import torch
from graphattn.functional import cpu, edge_attention
sets = json.loads(sys.argv[1])
torch.set_num_threads(1)
gen = torch.Generator().manual_seed(0)
n, E, H = 200, 1000, 8
edge_index = torch.randint(0, n, (2, E), generator=gen)
edge_attention(torch.randn(n, H, 8), torch.randn(n, H, 8), torch.randn(n, H, 8), edge_index,
               backend="reference")  # torch's first-call work, outside the timings
seconds = []
for score, with_bias, C in sets:
    shape = (n, H) if score == "additive" else (n, H, C)
    q, k = (torch.randn(shape, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(n, H, C, generator=gen, requires_grad=True)
    bias = torch.randn(E, H, generator=gen, requires_grad=True) if with_bias else None
    att = torch.randn(H, C, generator=gen, requires_grad=True) if score == "gatv2" else None
    start = time.perf_counter()
    out = edge_attention(q, k, v, edge_index, bias=bias, att=att, score=score, dropout_p=0.5,
                         backend="cpu")
    out.backward(torch.ones_like(out))
    seconds.append(time.perf_counter() - start)
kernels = sum(len(d.overloads) for d in gc.get_objects()
              if isinstance(d, numba.core.registry.CPUDispatcher)
              and "_kernel.<locals>" in d.py_func.__qualname__)
print(json.dumps({"seconds": seconds, "kernels": kernels}))
"""


def parse_args(argv: list[str] | None = None):
    parser = step_parser(__doc__.split("\n\n")[0], RESULTS / "cpu_specialisation.md", warmup=3)
    parser.add_argument("--scores", default="dot,additive,gatv2",
                        help="comma-separated scores (default: dot,additive,gatv2)")
    parser.add_argument("--steps", default="gat,transformer",
                        help="comma-separated model steps (gat, transformer), or 'none' "
                             "(default: gat,transformer)")
    parser.add_argument("--compile-scores", default="dot,additive,gatv2",
                        help="the sweep's scores, each with and without a bias at 8 and 16 "
                             "channels, or 'none' to skip the compile measurement "
                             "(default: dot,additive,gatv2)")
    args = parse_step_args(parser, argv)
    args.scores = args.scores.split(",")
    args.steps = [] if args.steps == "none" else args.steps.split(",")
    for step in args.steps:
        if step not in ("gat", "transformer"):
            parser.error(f"--steps takes gat and transformer, got {step!r}")
    args.compile_scores = ([] if args.compile_scores == "none"
                           else args.compile_scores.split(","))
    return args


def with_switches(way: str, call: Callable[[], None]) -> Callable[[], None]:
    """``call`` with the ``cpu`` module's switches set as ``way`` has them."""
    def timed():
        kept = {name: getattr(cpu, name) for name in SWITCHES[way]}
        for name, value in SWITCHES[way].items():
            setattr(cpu, name, value)
        try:
            call()
        finally:
            for name, value in kept.items():
                setattr(cpu, name, value)
    return timed


def operator_calls(edge_index: torch.Tensor, num_nodes: int, score: str,
                   seed: int) -> dict[str, Callable[[], None]]:
    """The forward and the forward+backward of edge attention with 8 heads of 8 channels and a
    bias on this graph."""
    gen = torch.Generator().manual_seed(seed)
    H, C, E = 8, 8, edge_index.size(1)
    shape = (num_nodes, H) if score == "additive" else (num_nodes, H, C)
    q, k = (torch.randn(*shape, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(num_nodes, H, C, generator=gen, requires_grad=True)
    bias = torch.randn(E, H, generator=gen, requires_grad=True)
    att = torch.randn(H, C, generator=gen, requires_grad=True) if score == "gatv2" else None

    def forward():
        with torch.no_grad():
            edge_attention(q, k, v, edge_index, bias=bias, att=att, score=score, backend="cpu")

    def forward_backward():
        out = edge_attention(q, k, v, edge_index, bias=bias, att=att, score=score,
                             dropout_p=0.5, backend="cpu")
        out.backward(torch.ones_like(out))
    return {"forward": forward, "forward+backward": forward_backward}


def compile_sweep(way: str, sets: list[tuple[str, bool, int]]) -> dict:
    """The sweep's first calls in a fresh process with an empty numba cache, compiled as
    ``way`` compiles them: ``{"seconds": [...], "kernels": n}``."""
    with tempfile.TemporaryDirectory(prefix="graphattn-numba-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache,
               "GRAPHATTN_CPU_SPECIALISE": ENVIRONMENT[way]}
        done = subprocess.run([sys.executable, "-c", SWEEP, json.dumps(sets)], env=env,
                              capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"the compile sweep ({way}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    header = cpu_header("cpu_specialisation.py", argv, args.threads,
                        f"time: {args.rounds} interleaved rounds after {args.warmup} warm-up "
                        f"rounds, medians; compile: one fresh process per way, 1 thread")
    rows = []
    for name in args.datasets:
        data = load_planetoid(name, root=args.root)
        n = data.num_nodes
        loops = torch.arange(n).repeat(2, 1)
        edge_index = torch.cat([data.edge_index, loops], dim=1)  # (2, E): one loop per node
        cases = {}
        for score in args.scores:
            for step, call in operator_calls(edge_index, n, score, args.seed).items():
                cases[f"edge_attention {score}, 8 heads x 8 channels, bias", step] = call
        x = data.x.to_sparse_csr()
        if "gat" in args.steps:
            cases["GAT training step", "step"] = gat_step(data, x, args.seed, [])
        if "transformer" in args.steps:
            cases["GraphTransformer training step", "step"] = transformer_step(
                data, x, args.seed, [])
        for (case, step), call in cases.items():
            ways = {way: with_switches(way, call) for way in SWITCHES}
            medians = interleaved(ways, args.rounds, args.warmup, f"{name} {case} {step}")
            rows.append({"measure": "time", "graph": f"{name} ({edge_index.size(1)} edges)",
                         "call": case, "step": step,
                         f"{CONSTANT}": f"{medians[CONSTANT]:.3f} ms",
                         f"{RUN_TIME}": f"{medians[RUN_TIME]:.3f} ms",
                         "ratio": f"{medians[RUN_TIME] / medians[CONSTANT]:.2f}"})
    sets = [(score, with_bias, channels) for score in args.compile_scores
            for with_bias in (False, True) for channels in (8, 16)]
    if sets:
        swept = {way: compile_sweep(way, sets) for way in SWITCHES}
        seconds = {way: sum(result["seconds"]) for way, result in swept.items()}
        rows.append({"measure": "compile", "graph": "random, 200 nodes, 1000 edges",
                     "call": f"first forward+backward of {len(sets)} option sets "
                             f"({', '.join(args.compile_scores)}; bias or not; 8 or 16 "
                             f"channels; 8 heads)",
                     "step": "forward+backward",
                     f"{CONSTANT}": f"{seconds[CONSTANT]:.1f} s, "
                                    f"{swept[CONSTANT]['kernels']} kernels",
                     f"{RUN_TIME}": f"{seconds[RUN_TIME]:.1f} s, "
                                    f"{swept[RUN_TIME]['kernels']} kernels",
                     "ratio": f"{seconds[RUN_TIME] / seconds[CONSTANT]:.2f}"})
    if not rows:
        print("nothing to measure: no dataset and no compile sweep")
        return 1
    note = ("fp32, the `cpu` backend. \"ratio\": options read at run time over compiled per "
            "option set (time: above 1 is slower; compile: below 1 is less). Each "
            "edge_attention call includes its Python work and the CSR sort of the edges. The "
            "GAT step: 8 heads x 8 channels, then one head, dropout 0.6; the GraphTransformer "
            "step: width 64, 4 heads, 2 blocks, dropout 0.5; sparse CSR features, Adam. The "
            "compile sweep runs each way in a fresh process with an empty numba cache "
            "(`GRAPHATTN_CPU_SPECIALISE` 1 or 0) and counts the kernels numba compiled.")
    text = write_table("cpu_specialisation", "The cpu kernels: compiled per option set or "
                       "reading the options at run time", [f"- {h}" for h in header], note,
                       rows, out=args.out)
    print(text.split(note, 1)[1].strip())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
