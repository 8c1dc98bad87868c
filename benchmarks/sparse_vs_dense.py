"""Sparse edge attention against dense masked attention: time and memory over graph density.

For graphs from 256 to 16384 nodes and average in-degree from 2 to the complete graph
(Erdos-Renyi, window, grid, causal, and the Cora / CiteSeer / PubMed citation graphs), times the
forward (inference, ``torch.no_grad``) and forward+backward (gradients of q, k, v) of

- ``edge_attention`` with every backend that runs here (``reference``, ``cpu``, ``dense``) and with
  ``backend="auto"``;
- ``sdpa``: ``dense_attention`` with the graph's bool mask (built once, outside the timing);
- ``flex`` and ``flex_rcm``: ``torch.nn.attention.flex_attention`` compiled with
  ``torch.compile``, with a block mask built from the edges, in the given node order and after
  reordering the nodes by reverse Cuthill-McKee (so that blocks empty out). The first call's
  compile time is reported separately.

and measures the peak memory of each call. Every method computes the same attention (outputs
and gradients checked against the reference on a small graph at start). Writes
``results/sparse_vs_dense.csv``, ``results/sparse_vs_dense.md`` and the plots
``results/sparse_vs_dense_time.png`` and ``results/sparse_vs_dense_memory.png``; ``--quick``
runs a small sweep in under two minutes. ``--patterns`` runs the sparse transformers' patterns
instead, over sequences of 4096 and 16384 positions: a window of radius 64, Longformer's (the
window and 16 global positions, one every N/16: ``graphs.union`` with
``graphs.global_token_graph``) and BigBird's (those and 3 random keys per query,
``graphs.random_graph``), with the causal graph of 4096 beside them; it writes
``results/sparse_vs_dense_patterns.*`` and bar charts of time and memory per graph.

Timing: methods are interleaved within each point (a new random order each round), after one
warm-up call (which is also the memory measurement), and the median of the repeats is kept. A
method that is clearly slower than the fastest at its point (``--slow-factor``) keeps its warm-up
time and skips the repeats.

Memory: the peak resident set size (VmHWM) of this process above its size before the call, after
resetting the high-water mark through ``/proc/self/clear_refs`` (Linux). During that call glibc is
told to serve every allocation above 256 KiB with mmap (and first to return the free memory the
timed repeats left in its heap), so freed tensors go back to the system and the peak counts every
byte a call holds at once, whichever allocator (torch, numba, the compiled kernels) asked for it.
The timed repeats run with glibc's thresholds at their dynamic maximum (32 MiB), as in a process
that never measures memory: with every block above 256 KiB mapped and unmapped on each call,
dense and SDPA calls on 256-1024 nodes take 10-70% longer. A fresh process per point would
measure the same thing at many times the cost.
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import gc
import math
import os
import platform
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import torch
from _machine import cpu_name
from tqdm import tqdm

from graphattn import graphs
from graphattn.datasets import ChecksumError, load_planetoid
from graphattn.functional import (
    available_backends,
    dense_attention,
    edge_attention,
    select_backend,
)

RESULTS = Path(__file__).resolve().parent / "results"
EDGE_BACKENDS = ("reference", "cpu", "dense")  # the choices of backend="auto" on CPU
BLOCK = 128  # FlexAttention's block size
MIB = 2**20


# ----------------------------------------------------------------------------------------------
# Graphs of the sweep


@dataclass
class Point:
    """One graph of the sweep."""

    family: str  # "er", "window", "grid", "causal", "citation"
    name: str
    num_nodes: int
    edge_index: torch.Tensor  # (2, E), no duplicate edges

    @property
    def num_edges(self) -> int:
        return self.edge_index.size(1)

    @property
    def density(self) -> float:
        return self.num_edges / self.num_nodes**2


def erdos_renyi(n: int, degree: int, seed: int) -> torch.Tensor:
    """Directed G(n, p) with p = degree / n, self-loops allowed; the complete graph at degree n."""
    if degree >= n:
        return graphs.complete_graph(n)
    gen = torch.Generator().manual_seed(seed)
    if degree * 8 >= n:
        mask = torch.rand(n, n, generator=gen) < degree / n  # (N_dst, N_src)
        return graphs.from_dense_mask(mask)
    pair = torch.randint(0, n * n, (n * degree,), generator=gen).unique()  # drop repeats
    return torch.stack([pair % n, pair // n])  # (2, E): source j, target i


def with_self_loops(edge_index: torch.Tensor, n: int) -> torch.Tensor:
    """Add i -> i to every node that lacks it (as GraphSelfAttention does)."""
    has = torch.zeros(n, dtype=torch.bool)
    has[edge_index[0][edge_index[0] == edge_index[1]]] = True
    loops = torch.arange(n)[~has]
    return torch.cat([edge_index, torch.stack([loops, loops])], dim=1)


PATTERN_RADIUS, PATTERN_GLOBAL, PATTERN_RANDOM = 64, 16, 3


def pattern_points(seed: int, sizes: tuple[int, ...] = (4096, 16384)) -> list[Point]:
    """The sparse transformers' patterns of ``--patterns``: for each length n a window of
    radius ``PATTERN_RADIUS``, Longformer's (the window and ``PATTERN_GLOBAL`` global positions
    spread evenly) and BigBird's (those and ``PATTERN_RANDOM`` random keys per query); and the
    causal graph of the first length."""
    points = []
    for n in sizes:
        window = graphs.window_graph(n, PATTERN_RADIUS)
        tokens = torch.arange(0, n, n // PATTERN_GLOBAL)  # (16,)
        longformer = graphs.union([window, graphs.global_token_graph(n, tokens)], n)
        rand = graphs.random_graph(n, PATTERN_RANDOM,
                                   generator=torch.Generator().manual_seed(seed + n))
        r, g = PATTERN_RADIUS, PATTERN_GLOBAL
        points += [Point("pattern", f"window-{n}-r{r}", n, window),
                   Point("pattern", f"longformer-{n}-r{r}-g{g}", n, longformer),
                   Point("pattern", f"bigbird-{n}-r{r}-g{g}-k{PATTERN_RANDOM}", n,
                         graphs.union([longformer, rand], n))]
    return points + [Point("pattern", f"causal-{sizes[0]}", sizes[0],
                           graphs.causal_graph(sizes[0]))]


def sweep_points(args: argparse.Namespace) -> tuple[list[Point], list[str]]:
    """The graphs of the sweep, and the reasons for graphs left out."""
    if args.patterns:
        return pattern_points(args.seed), []
    points: list[Point] = []
    notes: list[str] = []
    sizes = (256, 1024) if args.quick else (256, 1024, 4096, 16384)
    for n in sizes:
        fixed = (2, 32) if args.quick else (2, 8, 32, 128, 512)
        relative = (n // 4, n) if args.quick else (n // 4, n // 2, n)  # densities 1/4, 1/2, 1
        for degree in sorted({d for d in (*fixed, *relative) if d <= n}):
            if n >= 16384 and degree > 32:
                notes.append(f"er N={n} degree {degree}: left out, beyond the sweep's time budget "
                             f"(the sparse path alone takes seconds per call; dense does not fit)")
                continue
            name = f"er-{n}-complete" if degree == n else f"er-{n}-d{degree}"
            points.append(Point("er", name, n, erdos_renyi(n, degree, args.seed + n + degree)))
    structured = [("window", "window-1024-r16", 1024, lambda: graphs.window_graph(1024, 16))]
    if not args.quick:
        structured += [
            ("window", "window-4096-r64", 4096, lambda: graphs.window_graph(4096, 64)),
            ("window", "window-16384-r64", 16384, lambda: graphs.window_graph(16384, 64)),
            ("grid", "grid-64x64-r2", 4096, lambda: graphs.grid_graph(64, 64, radius=2)),
            ("grid", "grid-128x128-r1", 16384, lambda: graphs.grid_graph(128, 128, radius=1)),
            ("causal", "causal-1024", 1024, lambda: graphs.causal_graph(1024)),
            ("causal", "causal-4096", 4096, lambda: graphs.causal_graph(4096)),
        ]
    points += [Point(fam, name, n, build()) for fam, name, n, build in structured]
    for name in (("Cora",) if args.quick else ("Cora", "CiteSeer", "PubMed")):
        try:
            data = load_planetoid(name, root=args.data_root, structure_only=True,
                                  download=args.download, progress=False)
        except FileNotFoundError as err:
            notes.append(f"{name}: left out, raw files not found ({err.__class__.__name__}); "
                         f"pass --data-root DIR or --download")
            continue
        except ChecksumError as err:  # a corrupt file: say which, no traceback
            raise SystemExit(f"{name}: {err}") from None
        n = data.num_nodes
        points.append(Point("citation", name, n, with_self_loops(data.edge_index, n)))
    return points, notes


# ----------------------------------------------------------------------------------------------
# Peak memory


class PeakMemory:
    """Peak resident memory of a block above the memory before it, in bytes (Linux, glibc)."""

    def __init__(self) -> None:
        self.reason = None
        try:
            self._libc = ctypes.CDLL("libc.so.6")
            self._reset()
            self._read("VmHWM")
        except OSError as err:
            self.reason = f"peak memory not measured: {err}"

    def _mmap_threshold(self, nbytes: int) -> None:
        """glibc serves blocks above ``nbytes`` with mmap and trims free heap above it."""
        m_trim_threshold, m_mmap_threshold = -1, -3
        self._libc.mallopt(m_mmap_threshold, nbytes)
        self._libc.mallopt(m_trim_threshold, nbytes)

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS

    @staticmethod
    def _read(key: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        raise OSError(f"/proc/self/status has no {key}")

    def measure(self, fn: Callable[[], object]) -> tuple[float, float]:
        """Run ``fn`` once: (seconds, peak bytes above the start; NaN when not measurable)."""
        gc.collect()
        if self.reason is None:
            self._mmap_threshold(256 * 1024)  # every freed tensor leaves the resident set
            self._libc.malloc_trim(0)  # and so does what the timed repeats left in the heap
            self._reset()
            start = self._read("VmRSS")
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
        peak = math.nan if self.reason else max(self._read("VmHWM") - start, 0)
        del result
        if self.reason is None:
            self._mmap_threshold(32 * MIB)  # glibc's dynamic maximum, for the timed repeats
        return seconds, peak


# ----------------------------------------------------------------------------------------------
# Methods


@dataclass
class Method:
    """One way to compute the attention of a point: forward and forward+backward callables."""

    name: str
    fwd: Callable[[], object] | None = None
    fwd_bwd: Callable[[], object] | None = None
    skip: str | None = None  # why the method does not run at this point
    skip_bwd: str | None = None  # why only its forward runs
    extra: dict = field(default_factory=dict)


def block_mask_from_edges(edge_index: torch.Tensor, n: int):
    """FlexAttention BlockMask of a graph, built from the edges in O(E) (no N^2 mask_mod pass).

    Blocks are ``BLOCK x BLOCK`` tiles of the ``[N, N]`` mask: empty tiles are skipped, full
    ones run without the mask_mod, partial ones look the mask up.
    """
    from torch.nn.attention.flex_attention import BlockMask

    nb = -(-n // BLOCK)
    src, dst = edge_index
    tile = (dst // BLOCK) * nb + src // BLOCK  # (E,)
    count = torch.bincount(tile, minlength=nb * nb).view(nb, nb)  # edges per tile
    side = (n - torch.arange(nb) * BLOCK).clamp(max=BLOCK)  # (nb,) rows per block
    full = count == side.unsqueeze(1) * side.unsqueeze(0)
    partial = (count > 0) & ~full

    def kv_blocks(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = sel.sum(dim=1).to(torch.int32)  # (nb,)
        idx = torch.argsort((~sel).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()  # (1, 1, nb[, nb])

    mask = graphs.to_dense_mask(edge_index, n)  # (N, N), mask[i, j] = edge j -> i

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[q_idx, kv_idx]

    kv_num, kv_idx = kv_blocks(partial)
    full_num, full_idx = kv_blocks(full)
    block_mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK,
                                          mask_mod=mask_mod, seq_lengths=(n, n))
    return block_mask, int((count > 0).sum()), nb * nb


def rcm_order(edge_index: torch.Tensor, n: int) -> torch.Tensor:
    """Reverse Cuthill-McKee order of the symmetrised graph: ``order[new] = old``."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    src, dst = edge_index.numpy()
    adj = coo_matrix((np.ones(src.size), (dst, src)), shape=(n, n)).tocsr()
    return torch.from_numpy(reverse_cuthill_mckee((adj + adj.T).tocsr(),
                                                  symmetric_mode=True).astype(np.int64))


class Flex:
    """Compiled FlexAttention (dynamic shapes: one compile serves every N)."""

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        # Probe backward support eagerly on a tiny input, before compiling: an exception inside
        # the compiled function would make dynamo run every later call eagerly (unfused).
        self.bwd_error = None
        try:
            q = torch.randn(1, 1, BLOCK, 16, requires_grad=True)
            flex_attention(q, q, q).sum().backward()
        except Exception as err:  # noqa: BLE001 - the message is the result
            self.bwd_error = f"{err.__class__.__name__}: {err}"
        self.fn = torch.compile(flex_attention, dynamic=True)
        self.compile_s = math.nan

    def first_call(self, q, k, v, block_mask) -> None:
        """Compile on the first real inputs; the compile time is the first call minus the next."""
        t0 = time.perf_counter()
        with torch.no_grad():
            self.fn(q, k, v, block_mask=block_mask)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            self.fn(q, k, v, block_mask=block_mask)
        self.compile_s = first - (time.perf_counter() - t0)


def make_methods(point: Point, args, flex: Flex | None, flex_reason: str | None,
                 seed: int) -> list[Method]:
    """Every method at one point, with its inputs built and its skip reason set."""
    H, C, n = args.heads, args.channels, point.num_nodes
    ei = point.edge_index
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, H, C, generator=gen) for _ in range(3))  # (N, H, C)
    grad_out = torch.randn(n, H, C, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def edge(backend):
        def fwd():
            with torch.no_grad():
                return edge_attention(q, k, v, ei, backend=backend)

        def fwd_bwd():
            out = edge_attention(*leaves, ei, backend=backend)
            return torch.autograd.grad(out, leaves, grad_out)
        return fwd, fwd_bwd

    dense_bytes = H * n * n * 4
    dense_skip = None
    if dense_bytes > args.dense_limit_gib * 2**30:
        dense_skip = (f"its [H, N, N] = [{H}, {n}, {n}] fp32 scores take "
                      f"{dense_bytes / 2**30:.1f} GiB per tensor (> --dense-limit-gib "
                      f"{args.dense_limit_gib:g}); several are alive at once")
    methods = []
    for backend in (*available_backends(), "auto"):
        fwd, fwd_bwd = edge(backend)
        m = Method(backend, fwd, fwd_bwd)
        if backend == "triton":
            m.skip = "needs a CUDA device (its CPU interpreter is for tests only)"
        elif backend == "reference":
            need = 4 * point.num_edges * H * C * 4  # a few [E, H, C] fp32 tensors
            if need > args.mem_limit_gib * 2**30:
                m.skip = (f"its [E, H, C] per-edge tensors need ~{need / 2**30:.2f} GiB "
                          f"(> --mem-limit-gib {args.mem_limit_gib:g})")
        elif backend == "dense":
            m.skip = dense_skip
        elif backend == "auto":
            with torch.no_grad():
                m.extra["auto_fwd"] = select_backend(q, ei, num_src=n)  # inference
            m.extra["auto_fwd_bwd"] = select_backend(leaves[0], ei, num_src=n)  # training
            if "dense" in (m.extra["auto_fwd"], m.extra["auto_fwd_bwd"]):
                m.skip = dense_skip
        methods.append(m)

    mask = None if dense_skip else graphs.to_dense_mask(ei, n)  # (N, N)

    def sdpa_fwd():
        with torch.no_grad():
            return dense_attention(q, k, v, mask)

    def sdpa_fwd_bwd():
        out = dense_attention(*leaves, mask)
        return torch.autograd.grad(out, leaves, grad_out)
    methods.append(Method("sdpa", sdpa_fwd, sdpa_fwd_bwd, skip=dense_skip))

    for name, reorder in (("flex", False), ("flex_rcm", True)):
        m = Method(name)
        methods.append(m)
        if flex is None:
            m.skip = flex_reason
            continue
        if n * n > args.dense_limit_gib * 2**30:
            m.skip = (f"its [N, N] bool mask for mask_mod takes {n * n / 2**30:.1f} GiB "
                      f"(> --dense-limit-gib {args.dense_limit_gib:g})")
            continue
        graph = ei
        if reorder:
            order = rcm_order(ei, n)
            new_id = torch.empty_like(order)
            new_id[order] = torch.arange(n)
            graph = new_id[ei]
        block_mask, used, total = block_mask_from_edges(graph, n)
        m.extra["blocks"] = f"{used}/{total}"
        work = used * BLOCK * BLOCK * H * 4
        if work > args.dense_limit_gib * 2**30:
            m.skip = (f"{used} of {total} blocks are non-empty: {work / 2**30:.1f} GiB of "
                      f"fp32 scores (> --dense-limit-gib {args.dense_limit_gib:g})")
            continue
        perm = order if reorder else torch.arange(n)
        qf, kf, vf = (t[perm].transpose(0, 1).unsqueeze(0).contiguous()
                      for t in (q, k, v))  # (1, H, N, C), nodes in the block mask's order
        if math.isnan(flex.compile_s):
            flex.first_call(qf, kf, vf, block_mask)

        def flex_fwd(qf=qf, kf=kf, vf=vf, block_mask=block_mask):
            with torch.no_grad():
                return flex.fn(qf, kf, vf, block_mask=block_mask)
        m.fwd = flex_fwd
        # only the forward is timed: run_point calls fwd_bwd unless skip_bwd gives a reason
        m.skip_bwd = flex.bwd_error or "not timed (the sweep times FlexAttention's forward)"
    return methods


def check_methods_agree(args, flex: Flex | None) -> None:
    """Every method computes the same attention and gradients on a small random graph (fails
    loudly if not). This also compiles every kernel, backward included, before the sweep, so
    that no warm-up call of the sweep pays for a compilation."""
    n = 384
    point = Point("er", "check", n, with_self_loops(erdos_renyi(n, 20, args.seed), n))
    methods = {m.name: m for m in make_methods(point, args, flex, None, args.seed)}
    with torch.no_grad():
        ref = methods["reference"].fwd()
    for m in methods.values():
        if m.skip or m.fwd is None:
            continue
        out = m.fwd()
        if m.name.startswith("flex"):
            continue  # compared below, in its own node order
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"{m.name} differs")
    ref_grads = methods["reference"].fwd_bwd()
    for m in methods.values():
        if m.skip or m.skip_bwd or m.fwd_bwd is None:
            continue
        for name, got, want in zip("qkv", m.fwd_bwd(), ref_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=f"{m.name}: gradient of {name} differs")
    if flex is not None and not (methods["flex"].skip or methods["flex_rcm"].skip):
        order = rcm_order(point.edge_index, n)
        out = methods["flex_rcm"].fwd()[0].transpose(0, 1)  # (N, H, C) in RCM order
        torch.testing.assert_close(out, ref[order], atol=1e-5, rtol=1e-5, msg="flex_rcm differs")
        out = methods["flex"].fwd()[0].transpose(0, 1)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg="flex differs")


# ----------------------------------------------------------------------------------------------
# Measurement


def run_point(point: Point, methods: list[Method], args, memory: PeakMemory,
              seed: int) -> list[dict]:
    """Warm-up (= memory) call of every method, then interleaved repeats; medians per method."""
    rng = random.Random(seed)
    runnable = [m for m in methods if m.skip is None and m.fwd is not None]
    rows = {m.name: dict(fwd=[], fwd_bwd=[], fwd_mib=math.nan, fwd_bwd_mib=math.nan)
            for m in runnable}
    for m in runnable:
        seconds, peak = memory.measure(m.fwd)
        rows[m.name]["fwd"].append(seconds)
        rows[m.name]["fwd_mib"] = peak / MIB
        if m.skip_bwd is None:
            seconds, peak = memory.measure(m.fwd_bwd)
            rows[m.name]["fwd_bwd"].append(seconds)
            rows[m.name]["fwd_bwd_mib"] = peak / MIB

    for phase in ("fwd", "fwd_bwd"):
        timed = [m for m in runnable if phase == "fwd" or m.skip_bwd is None]
        if not timed:
            continue
        best = min(rows[m.name][phase][0] for m in timed)
        keep = max(args.slow_factor * best, args.min_repeat_s)
        fast = [m for m in timed if m.name == "auto" or rows[m.name][phase][0] <= keep]
        # At least --repeats rounds, more while the rounds are short (up to --min-time-s). Each
        # round runs the methods in a new random order, so that none always follows the same
        # method (the worker threads of one library still spin for a while after its call).
        start, r = time.perf_counter(), 0
        while r < args.repeats or (r < args.max_repeats
                                   and time.perf_counter() - start < args.min_time_s):
            for m in rng.sample(fast, len(fast)):
                fn = getattr(m, phase)
                t0 = time.perf_counter()
                result = fn()
                rows[m.name][phase].append(time.perf_counter() - t0)
                del result
            r += 1
        for m in fast:
            rows[m.name][phase] = rows[m.name][phase][1:]  # drop the warm-up
        for m in timed:
            rows[m.name][f"{phase}_once"] = m not in fast  # its warm-up call alone

    out = []
    for m in methods:
        row = dict(graph=point.name, family=point.family, N=point.num_nodes, E=point.num_edges,
                   density=point.density, method=m.name, fwd_ms=math.nan, fwd_bwd_ms=math.nan,
                   fwd_min_ms=math.nan, fwd_bwd_min_ms=math.nan, fwd_mib=math.nan,
                   fwd_bwd_mib=math.nan, fwd_reps=0, fwd_bwd_reps=0, fwd_once=False,
                   fwd_bwd_once=False,
                   auto_fwd=m.extra.get("auto_fwd", ""),
                   auto_fwd_bwd=m.extra.get("auto_fwd_bwd", ""), blocks=m.extra.get("blocks", ""),
                   skipped=m.skip or (f"backward: {m.skip_bwd}" if m.skip_bwd else ""))
        if m.name in rows:
            r = rows[m.name]
            for phase in ("fwd", "fwd_bwd"):
                if r[phase]:
                    row[f"{phase}_ms"] = statistics.median(r[phase]) * 1e3
                    row[f"{phase}_min_ms"] = min(r[phase]) * 1e3
                    row[f"{phase}_reps"] = len(r[phase])
                    row[f"{phase}_once"] = r.get(f"{phase}_once", False)
            row["fwd_mib"], row["fwd_bwd_mib"] = r["fwd_mib"], r["fwd_bwd_mib"]
        out.append(row)
    return out


# ----------------------------------------------------------------------------------------------
# Summaries, table, plots


def crossover(rows: list[dict], n: int, phase: str, dense: str = "dense") -> float:
    """Density at which ``dense`` becomes as fast as the fastest sparse backend (ER graphs of N
    nodes, log-log interpolation between sweep points); NaN when it never crosses."""
    by_density: dict[float, dict[str, float]] = {}
    for r in rows:
        if r["family"] == "er" and r["N"] == n and not math.isnan(r[f"{phase}_ms"]):
            by_density.setdefault(r["density"], {})[r["method"]] = r[f"{phase}_ms"]
    pts = []
    for d in sorted(by_density):
        t = by_density[d]
        sparse = min((t[b] for b in ("reference", "cpu") if b in t), default=math.nan)
        if dense in t and not math.isnan(sparse):
            pts.append((d, math.log(t[dense] / sparse)))
    for (d0, g0), (d1, g1) in zip(pts, pts[1:], strict=False):
        if g0 > 0 >= g1:
            x = math.log(d0) + (math.log(d1) - math.log(d0)) * g0 / (g0 - g1)
            return math.exp(x)
    if pts and pts[0][1] <= 0:
        return pts[0][0]  # dense already wins at the sparsest point
    return math.nan


def auto_report(rows: list[dict], phase: str,
                against: tuple[str, ...] | None = EDGE_BACKENDS) -> tuple[float, dict | None]:
    """Worst ratio auto / fastest of ``against`` (every other method when ``None``) over all
    points, and the auto row of that point."""
    worst, where = 0.0, None
    for graph in dict.fromkeys(r["graph"] for r in rows):
        t = {r["method"]: r[f"{phase}_ms"] for r in rows if r["graph"] == graph}
        best = min((x for b, x in t.items() if b != "auto" and not math.isnan(x)
                    and (against is None or b in against)), default=math.nan)
        if math.isnan(best) or math.isnan(t.get("auto", math.nan)):
            continue
        ratio = t["auto"] / best
        if ratio > worst:
            worst = ratio
            where = next(r for r in rows if r["graph"] == graph and r["method"] == "auto")
    return worst, where


def fmt(x: float, digits: int = 1) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def write_markdown(rows, header, notes, summary, path: Path) -> None:
    methods = [m for m in dict.fromkeys(r["method"] for r in rows)
               if any(not math.isnan(r["fwd_ms"]) for r in rows if r["method"] == m)]
    graph_rows = list(dict.fromkeys(r["graph"] for r in rows))
    lines = ["# Sparse vs dense attention", "", *[f"- {h}" for h in header], ""]
    lines += ["## Summary", "", *[f"- {s}" for s in summary], ""]
    for phase, title in (("fwd_bwd", "Forward+backward time (ms, median)"),
                         ("fwd", "Forward time (ms, median; inference, no autograd)"),
                         ("fwd_bwd", "Peak memory of forward+backward (MiB above the inputs)"),
                         ("fwd", "Peak memory of forward (MiB above the inputs)")):
        key = f"{phase}_mib" if "memory" in title else f"{phase}_ms"
        lines += [f"## {title}", "", "| graph | N | E | density | auto picks | "
                  + " | ".join(methods) + " |", "|" + " --- |" * (5 + len(methods))]
        for g in graph_rows:
            rs = {r["method"]: r for r in rows if r["graph"] == g}
            first = next(iter(rs.values()))
            vals = {m: rs[m][key] for m in methods if m in rs}
            timed = [x for m, x in vals.items() if m != "auto" and not math.isnan(x)]
            best = min(timed, default=math.nan)
            cells = []
            for m in methods:
                x = vals.get(m, math.nan)
                cell = fmt(x, 0 if "mib" in key else 1)
                if "ms" in key and x == best:
                    cell = f"**{cell}**"
                if "ms" in key and m in rs and rs[m][f"{phase}_once"]:
                    cell += "¹"
                cells.append(cell)
            lines.append(f"| {g} | {first['N']} | {first['E']} | {first['density']:.2e} | "
                         f"{rs.get('auto', {}).get(f'auto_{phase}', '')} | " + " | ".join(cells)
                         + " |")
        lines.append("")
    lines += ["¹ one call only (the warm-up): more than --slow-factor times slower than the "
              "fastest method at that point, so not repeated.", ""]
    skipped = sorted({(r["method"], r["skipped"]) for r in rows if r["skipped"]})
    lines += ["## Skipped", "", *[f"- {g}" for g in notes]]
    for m, why in skipped:
        where = [r["graph"] for r in rows if r["method"] == m and r["skipped"] == why]
        on = "every graph" if len(where) == len(graph_rows) else ", ".join(where)
        lines.append(f"- **{m}** on {on}: {why}")
    path.write_text("\n".join(lines) + "\n")


def plot_patterns(rows, path_time: Path, path_mem: Path) -> None:
    """Per graph of ``--patterns``, the time and peak memory of each method that ran, forward
    +backward above and forward below (bars, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graph_names = list(dict.fromkeys(r["graph"] for r in rows))
    methods = [m for m in dict.fromkeys(r["method"] for r in rows)
               if any(not math.isnan(r["fwd_ms"]) for r in rows if r["method"] == m)]
    width = 0.8 / max(len(methods), 1)
    for kind, label, path in (("ms", "time (ms)", path_time),
                              ("mib", "peak memory (MiB)", path_mem)):
        fig, axes = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
        for ax, phase, title in zip(axes, ("fwd_bwd", "fwd"), ("forward+backward", "forward"),
                                    strict=True):
            for i, m in enumerate(methods):
                value = {r["graph"]: r[f"{phase}_{kind}"] for r in rows if r["method"] == m}
                ax.bar([g + i * width for g in range(len(graph_names))],
                       [value.get(g, math.nan) for g in graph_names], width=width, label=m,
                       color=f"C{i}")
            ax.set_yscale("log")
            ax.set_ylabel(f"{title} {label}")
            ax.grid(True, axis="y", alpha=0.3)
        axes[1].set_xticks([g + width * (len(methods) - 1) / 2 for g in range(len(graph_names))],
                           [name.replace("-", "\n", 1) for name in graph_names], fontsize=8)
        fig.legend(*axes[1].get_legend_handles_labels(), loc="lower center", ncol=len(methods),
                   fontsize=9)
        fig.suptitle(f"Sparse transformers' patterns: {label} (no bar: not run)", fontsize=11)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(path, dpi=110)
        plt.close(fig)


def plot(rows, crossovers, path_time: Path, path_mem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    sizes = sorted({r["N"] for r in rows if r["family"] == "er"})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {m: dict(marker=mk, color=colors[i % len(colors)],
                      linestyle="--" if m == "auto" else "-")
              for i, (m, mk) in enumerate(zip(methods, "osD^v<>px*", strict=False))}
    for key_kind, path in (("ms", path_time), ("mib", path_mem)):
        fig, axes = plt.subplots(2, len(sizes), figsize=(4.2 * len(sizes), 7.5), squeeze=False)
        for col, n in enumerate(sizes):
            for row_i, phase in enumerate(("fwd_bwd", "fwd")):
                ax = axes[row_i][col]
                for m in methods:
                    # Memory below the mmap threshold (256 KiB) is not resolved: left out.
                    floor = 0.25 if key_kind == "mib" else 0.0
                    pts = sorted((r["density"], r[f"{phase}_{key_kind}"]) for r in rows
                                 if r["family"] == "er" and r["N"] == n and r["method"] == m
                                 and r[f"{phase}_{key_kind}"] >= floor)
                    if pts:
                        ax.plot(*zip(*pts, strict=True), label=m, **styles[m])
                x = crossovers.get((n, phase), math.nan)
                if not math.isnan(x):
                    ax.axvline(x, color="grey", linestyle=":")
                    ax.annotate(f"crossover\n{x:.3g}", (x, 0.97), ha="right", va="top",
                                xycoords=("data", "axes fraction"), fontsize=8, color="grey")
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.xaxis.set_minor_formatter(NullFormatter())
                ax.set_title(f"N = {n}, {'forward+backward' if phase == 'fwd_bwd' else 'forward'}",
                             fontsize=10)
                ax.set_xlabel("density E / N^2")
                ax.set_ylabel("time (ms)" if key_kind == "ms" else "peak memory (MiB)")
                ax.grid(True, which="major", alpha=0.3)
        legend = {}
        for ax in axes.flat:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                legend.setdefault(label, handle)
        fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend),
                   fontsize=9)
        fig.suptitle("Erdos-Renyi graphs: " + ("time" if key_kind == "ms" else "peak memory")
                     + " against density (crossover: dense backend vs fastest sparse backend)",
                     fontsize=11)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        fig.savefig(path, dpi=110)
        plt.close(fig)


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sweep, under two minutes")
    parser.add_argument("--patterns", action="store_true",
                        help="the sparse transformers' patterns (window, Longformer, BigBird) "
                             "instead of the sweep")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--channels", type=int, default=32, help="channels per head")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per method")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    parser.add_argument("--dense-limit-gib", type=float, default=1.0,
                        help="largest [H, N, N] fp32 tensor a dense method may need")
    parser.add_argument("--mem-limit-gib", type=float, default=4.0,
                        help="largest per-edge working set of the reference backend")
    parser.add_argument("--slow-factor", type=float, default=5.0,
                        help="a method this many times slower than the fastest is not repeated")
    parser.add_argument("--min-repeat-s", type=float, default=0.05,
                        help="methods faster than this are always repeated")
    parser.add_argument("--min-time-s", type=float, default=1.0,
                        help="keep repeating a point's rounds until this much time has passed")
    parser.add_argument("--max-repeats", type=int, default=30, help="most rounds per point")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of torch and numba (default: torch's default)")
    parser.add_argument("--data-root", default=None,
                        help="root of the citation datasets (default: load_planetoid's)")
    parser.add_argument("--download", action="store_true", help="download missing datasets")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    for name in ("repeats", "max_repeats", "threads", "heads", "channels"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("dense_limit_gib", "mem_limit_gib"):
        if not getattr(args, name) > 0:  # (NaN too)
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not args.slow_factor >= 1:
        parser.error(f"--slow-factor must be >= 1 (times the fastest method), got "
                     f"{args.slow_factor}")
    for name in ("min_repeat_s", "min_time_s"):
        if not getattr(args, name) >= 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.out.suffix in (".md", ".csv", ".png"):
        parser.error(f"--out is the folder the tables and plots go to, got a file name: "
                     f"{args.out}")
    if args.quick and args.patterns:
        parser.error("--quick and --patterns name two different runs: pass one")
    if args.quick:
        args.repeats, args.min_time_s = min(args.repeats, 3), min(args.min_time_s, 0.3)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        numba.set_num_threads(args.threads)

    started = time.perf_counter()
    torch.manual_seed(args.seed)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    header = [f"command: `{command}`",
              f"torch {torch.__version__}, device cpu ({cpu_name()}), "
              f"{torch.get_num_threads()} torch threads, {numba.get_num_threads()} numba threads, "
              f"python {platform.python_version()}",
              f"H = {args.heads} heads, C = {args.channels} channels per head, fp32, "
              f"dot-product score, no bias, no dropout, weights not returned; FlexAttention "
              f"block {BLOCK}"]
    header.append("load average (1, 5, 15 min) at start: "
                  + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    for h in header:
        print(h.replace("`", ""))

    compile_cache = "warm or cold: torch's default on-disk cache (--quick)"
    if not args.quick:
        # A fresh inductor cache: the compile time reported is that of a first run.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="graphattn-inductor-")
        compile_cache = "cold: an empty inductor cache"
    flex, flex_reason = None, None
    if args.no_flex:
        flex_reason = "--no-flex"
    else:
        try:
            flex = Flex()
        except ImportError as err:
            flex_reason = f"torch.nn.attention.flex_attention is not available: {err}"
    memory = PeakMemory()
    if memory.reason:
        print(memory.reason)
    check_methods_agree(args, flex)
    points, notes = sweep_points(args)
    for note in notes:
        print(note)

    rows: list[dict] = []
    told: set[tuple[str, str]] = set()
    # What exists now (modules, their caches, the graphs) outlives the sweep: frozen out of the
    # collector's reach, gc.collect() before each measurement scans only what the sweep makes
    # (in a process that has imported torch it took 0.3 s a call, scanning everything).
    gc.collect()
    gc.freeze()
    bar = tqdm(points, desc="sweep", unit="graph")
    for i, point in enumerate(bar):
        bar.set_postfix_str(f"{point.name} (E={point.num_edges})")
        methods = make_methods(point, args, flex, flex_reason, args.seed + i)
        for m in methods:
            for why in (m.skip, m.skip_bwd and f"backward: {m.skip_bwd}"):
                if why and (m.name, why) not in told:
                    told.add((m.name, why))
                    tqdm.write(f"{point.name}: skip {m.name}: {why}")
        rows += run_point(point, methods, args, memory, args.seed + i)
        del methods
        gc.collect()
    gc.unfreeze()

    crossovers = {(n, phase): crossover(rows, n, phase)
                  for n in sorted({r["N"] for r in rows if r["family"] == "er"})
                  for phase in ("fwd_bwd", "fwd")}
    summary = []
    for phase, label in (("fwd_bwd", "forward+backward"), ("fwd", "forward")) if crossovers else ():
        xs = ", ".join(f"N={n}: {fmt(x, 3) if math.isnan(x) else f'{x:.3g}'}"
                       for (n, p), x in crossovers.items() if p == phase)
        found = [x for (n, p), x in crossovers.items() if p == phase and not math.isnan(x)]
        median = f"; median {statistics.median(found):.2g}" if found else ""
        summary.append(f"crossover density (dense backend as fast as the fastest sparse one, "
                       f"{label}): {xs}{median}")
    for against, what in ((EDGE_BACKENDS, "the fastest edge_attention backend"),
                          (None, "the fastest method (SDPA and FlexAttention included)")):
        for phase, label in (("fwd_bwd", "forward+backward"), ("fwd", "forward")):
            worst, where = auto_report(rows, phase, against)
            if where is not None:
                summary.append(f"auto vs {what}, {label}: worst {worst:.2f}x at "
                               f"{where['graph']} (density {where['density']:.2e}, auto picks "
                               f"{where[f'auto_{phase}']})")
    for name in ("Cora", "CiteSeer", "PubMed"):
        t = {r["method"]: r for r in rows if r["graph"] == name}
        if not t:
            continue
        sparse = min((t[b]["fwd_bwd_ms"] for b in ("reference", "cpu")
                      if b in t and not math.isnan(t[b]["fwd_bwd_ms"])), default=math.nan)
        if math.isnan(sparse):
            continue
        for dense in ("sdpa", "dense"):
            if dense in t and not math.isnan(t[dense]["fwd_bwd_ms"]):
                ratio = t[dense]["fwd_bwd_ms"] / sparse
                faster = (f"sparse {ratio:.1f}x faster" if ratio >= 1 else
                          f"{dense} {1 / ratio:.1f}x faster")
                summary.append(f"{name}: fastest sparse backend {sparse:.1f} ms vs {dense} "
                               f"{t[dense]['fwd_bwd_ms']:.1f} ms forward+backward: {faster}")
    if flex is not None:
        summary.append(f"FlexAttention compile (first call minus a warm call, dynamic shapes, "
                       f"one compile for every N; {compile_cache}): {flex.compile_s:.1f} s; "
                       f"backward on CPU: {flex.bwd_error or 'works'}")
    elif flex_reason:
        summary.append(f"FlexAttention not run: {flex_reason}")
    summary.append(f"sweep wall time {time.perf_counter() - started:.0f} s; load average at the "
                   f"end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("sparse_vs_dense_quick" if args.quick else
                       "sparse_vs_dense_patterns" if args.patterns else "sparse_vs_dense")
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    write_markdown(rows, header, notes, summary, stem.with_suffix(".md"))
    if args.patterns:
        plot_patterns(rows, Path(f"{stem}_time.png"), Path(f"{stem}_memory.png"))
    else:
        plot(rows, crossovers, Path(f"{stem}_time.png"), Path(f"{stem}_memory.png"))
    if not args.quick:
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    print("\n".join(summary))
    print(f"wrote {stem}.csv, {stem}.md, {stem}_time.png, {stem}_memory.png")


if __name__ == "__main__":
    main()
