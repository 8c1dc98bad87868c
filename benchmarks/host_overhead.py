"""Host time per call of the GPU path: what a layer costs the CPU around its kernels.

On a small graph a GPU call is bound by the host: Python, argument checks and one launch per
torch operator, not by the kernels (on an H200, Cora's fused forward kernel takes 0.11 ms of
a 1.06 ms call; ``results/gpu.md``). This measures that host work on a machine without a GPU:
the ``triton`` backend runs on CPU tensors with its kernel launches replaced by no-ops, and
with the graph caches on as they are on CUDA (a training loop passes one ``edge_index`` at
every step, so its CSR orderings and checked bounds are reused), for

- ``edge_attention(backend="triton")`` on given q, k, v ``[N, H, C]``,
- ``GraphSelfAttention`` with the dot, additive and gatv2 scores (three projections, the
  layer's defaults otherwise: self-loops, output projection),
- PyG's ``TransformerConv``, ``GATConv`` and ``GATv2Conv`` of the same sizes, for scale: these
  run their arithmetic on the CPU (tiny at these sizes, but not nothing), so their times bound
  their host cost from above;

each as inference (forward under ``torch.no_grad``) and as a training step (forward, then
backward of the sum, then the gradients set to None as ``zero_grad()`` does, so that no
backward adds into the last step's). Figures per call: the median over interleaved rounds of
the mean of a batch of calls, and the torch operators dispatched, counted with a
``TorchDispatchMode``: those that compute (each a kernel launch on CUDA) and the views (no
kernel). PyG's figures include its scatter operators, which on CUDA launch kernels too.

graphattn's calls are also timed the former way, interleaved with the current one: the
kernels' autograd Function called through ``torch.autograd.Function.apply`` at every call,
inference included (``Function.apply`` binds the arguments to ``forward``'s signature with
``inspect`` each time; the backends now call the autograd engine's ``apply`` directly, and
call no Function when nothing needs a gradient).

Usage (one line):

    python benchmarks/host_overhead.py

Writes ``results/host_overhead.md`` and ``.csv`` (``--out`` names another ``.md``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend accepts CPU tensors

import argparse  # noqa: E402
import csv  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import cpu_name  # noqa: E402
from _report import RESULTS  # noqa: E402

from graphattn import _tensor_cache  # noqa: E402
from graphattn.functional import _transforms, edge_attention  # noqa: E402
from graphattn.functional import triton_kernels as tk  # noqa: E402
from graphattn.nn import GraphSelfAttention  # noqa: E402


class _NoLaunch:
    """A Triton kernel whose launches do nothing: ``kernel[grid](*args)``."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class OpCounter(TorchDispatchMode):
    """Counts the torch operators dispatched: views apart from those that compute."""

    def __init__(self) -> None:
        super().__init__()
        self.compute = 0
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.compute += 1
        return func(*args, **(kwargs or {}))


def stub_kernels() -> None:
    """Replace every kernel of the triton backend by :class:`_NoLaunch`, and keep graph
    derivatives of CPU tensors as the caches do of CUDA ones."""
    kernel_names = [name for name in dir(tk.kernels()) if name.endswith("_kernel")]
    stubs = types.SimpleNamespace(**{name: _NoLaunch() for name in kernel_names})
    tk.kernels = lambda: stubs
    _tensor_cache.CACHED_DEVICE_TYPES = {"cuda", "cpu"}


def cases(num_nodes: int, num_edges: int, heads: int, channels: int,
          seed: int) -> dict[str, Callable[[], Callable[[bool], object]]]:
    """name -> a maker of ``call(train)``: one forward (``train=False``, under no_grad) or
    one training step."""
    from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.stack([torch.randint(0, num_nodes, (num_edges,), generator=gen),
                              torch.randint(0, num_nodes, (num_edges,), generator=gen)])
    features = heads * channels
    x = torch.randn(num_nodes, features, generator=gen)
    qkv = [torch.randn(num_nodes, heads, channels, generator=gen).requires_grad_()
           for _ in range(3)]

    def step(f: Callable[[], torch.Tensor],
             leaves: list[torch.Tensor]) -> Callable[[bool], object]:
        def call(train: bool) -> object:
            if not train:
                with torch.no_grad():
                    return f()
            out = f()
            out.sum().backward()
            for t in leaves:  # as zero_grad(set_to_none=True): no accumulating add next time
                t.grad = None
            return out
        return call

    def layer(module: torch.nn.Module) -> Callable[[bool], object]:
        return step(lambda: module(x, edge_index), list(module.parameters()))

    def ours(score: str) -> Callable[[bool], object]:
        return layer(GraphSelfAttention(features, channels, heads=heads, attention=score,
                                        backend="triton"))

    return {
        "edge_attention triton": lambda: step(
            lambda: edge_attention(*qkv, edge_index, backend="triton"), qkv),
        "GraphSelfAttention dot, triton": lambda: ours("dot"),
        "PyG TransformerConv": lambda: layer(TransformerConv(features, channels, heads=heads)),
        "GraphSelfAttention additive, triton": lambda: ours("additive"),
        "PyG GATConv": lambda: layer(GATConv(features, channels, heads=heads)),
        "GraphSelfAttention gatv2, triton": lambda: ours("gatv2"),
        "PyG GATv2Conv": lambda: layer(GATv2Conv(features, channels, heads=heads)),
    }


def use_route(route: str) -> None:
    """Call the triton backend's Function the ``"current"`` way or through
    ``Function.apply`` at every call, as before (``"Function.apply"``)."""
    if route == "Function.apply":
        tk.apply_function = lambda function, *args: function.apply(*args)
        tk.needs_grad = lambda *tensors: True
    else:
        tk.apply_function, tk.needs_grad = _transforms.apply_function, _transforms.needs_grad


ROUTES = ("current", "Function.apply")


def count_ops(call: Callable[[bool], object], train: bool) -> tuple[int, int]:
    """Operators that compute and views, of one call."""
    counter = OpCounter()
    with counter:
        call(train)
    return counter.compute, counter.views


def time_calls(calls: dict[tuple, Callable[[], object]], rounds: int,
               inner: int) -> dict[tuple, float]:
    """Median over ``rounds`` of the mean host time of ``inner`` calls (us), every call taking
    its turn in each round, in the order of ``calls`` (keys ending in their route) and in the
    reverse order every other round."""
    samples: dict[tuple, list[float]] = {key: [] for key in calls}
    for r in tqdm(range(rounds), desc="rounds"):
        for key, call in (list(calls.items()) if r % 2 == 0 else list(calls.items())[::-1]):
            use_route(key[-1])
            start = time.perf_counter()
            for _ in range(inner):
                call()
            samples[key].append((time.perf_counter() - start) / inner * 1e6)
    return {key: statistics.median(values) for key, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=16, help="N (default: 16)")
    parser.add_argument("--edges", type=int, default=64, help="E (default: 64)")
    parser.add_argument("--heads", type=int, default=4, help="H (default: 4)")
    parser.add_argument("--channels", type=int, default=32, help="C per head (default: 32)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default: 15)")
    parser.add_argument("--inner", type=int, default=40,
                        help="calls per round and case (default: 40)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default: 1: host work is one thread's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "host_overhead.md")
    args = parser.parse_args(argv)
    for name in ("nodes", "edges", "heads", "channels", "rounds", "inner", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    command = "python benchmarks/host_overhead.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    if not tk.triton_available():
        print("benchmarks/host_overhead.py times the triton backend's host work and needs "
              "triton: pip install 'graphattn[gpu]'", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    stub_kernels()
    import torch_geometric
    header = [f"command: `{command.strip()}`",
              f"torch {torch.__version__}, torch_geometric {torch_geometric.__version__}, "
              f"python {platform.python_version()}",
              f"device: CPU ({cpu_name()}), {args.threads} torch thread(s); the triton "
              f"backend's kernel launches are no-ops, the graph caches on (as on CUDA)",
              f"graph: {args.nodes} nodes, {args.edges} random edges; H = {args.heads}, "
              f"C = {args.channels}, fp32"]
    print("\n".join(header))

    makers = cases(args.nodes, args.edges, args.heads, args.channels, args.seed)
    calls, ops = {}, {}
    for name, make in makers.items():
        call = make()
        routes = ROUTES[:1] if name.startswith("PyG") else ROUTES
        for train in (False, True):
            for route in routes:
                use_route(route)
                for _ in range(3):  # warm-up: kernel stubs, caches, PyG's first-call work
                    call(train)
                calls[name, train, route] = (lambda call=call, train=train: call(train))
            use_route("current")
            ops[name, train] = count_ops(call, train)
    times = time_calls(calls, args.rounds, args.inner)
    use_route("current")

    rows = []
    for name in makers:
        for train in (False, True):
            compute, views = ops[name, train]
            now = times[name, train, "current"]
            before = times.get((name, train, "Function.apply"))
            rows.append({"call": name, "step": "forward+backward" if train else "forward",
                         "host us": f"{now:.0f}",
                         "host us through Function.apply": "" if before is None
                         else f"{before:.0f}",
                         "ratio": "" if before is None else f"{now / before:.2f}",
                         "operators that compute": compute, "views": views})
    lines = ["# Host time per call of the GPU path (kernel launches stubbed out)", "",
             *(f"- {h}" for h in header),
             f"- median over {args.rounds} interleaved rounds of the mean of {args.inner} "
             f"calls; operators counted in one call (the current route)",
             "- through Function.apply: graphattn's Function called as before, through "
             "`torch.autograd.Function.apply` at every call, inference included; ratio: host "
             "us / that", "",
             "| " + " | ".join(rows[0]) + " |", "|---|---|---:|---:|---:|---:|---:|"]
    lines += ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
