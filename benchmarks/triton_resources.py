"""Registers, shared memory and spills of the fused Triton kernels for sm_90 (H100/H200), no GPU.

Triton compiles ahead of time for a target it is told about: this script compiles the forward
kernel and the two backward kernels for sm_90 with the tiles ``launch_config`` picks, for each
(heads, channels) below, each score and fp32 / bf16 inputs, once with no optional input
("plain": no bias, no dropout, no per-edge key or value term, no gradient through alpha) and
once with all of them ("all"; the per-edge key term with the dot and gatv2 scores only; the
dropout mask drawn in the kernels from a seed, as ``edge_attention`` runs them), and
reads what ``ptxas -v`` reports as Triton runs it (its own ptxas and flags; where a triton
drops that report, as 3.4 does, ptxas runs again on the kernel's PTX with the same flags):
registers per thread, stack frame and spill stores and loads, in bytes per thread; shared
memory per block is Triton's (``metadata.shared``). Pointer arguments are taken as 16-byte
aligned, as Triton's JIT specializes them at a launch on tensors torch allocated (without it,
the loads are not vectorized and the register counts come out higher: 212 instead of 90 for
the row-block forward kernel of 16 nodes x 4 heads x 32 channels on 4 warps).

A kernel that spills keeps values in local memory, a round trip to memory per spilled value.
Registers bound how many programs an SM runs at once; the table gives

    blocks per SM = min(32, floor(65536 / (ceil(registers * 32 / 256) * 256 * warps)),
                        floor(233472 / max(shared, 1)))
    resident warps = blocks per SM * warps  (of at most 64)

with 65536 32-bit registers, 64 warps, 32 blocks and 228 KiB of shared memory per SM on sm_90
(NVIDIA's H100 tuning guide), registers allocated per warp in units of 256. These are static
figures from the compiler; times need the GPU (``benchmarks/gpu.py``).

``--blocks`` compiles the block-sparse kernels instead
(:mod:`graphattn.functional.triton_blocks`); ``--hub`` the one-node kernels as they run the rows
of many blocks on graphs of at least ``triton_kernels.HUB_EDGES`` edges, with their sums over a
row's edges added in float64 every ``SUM_STEPS`` tiles (``HEAVY_ONLY``).

Usage:

    python benchmarks/triton_resources.py [--block-n N | --blocks | --hub]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU, even where tests set the interpreter
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # run ptxas even when the cache holds the kernel
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # and print its report, read by resource_usage

import torch  # noqa: E402

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    sys.exit("benchmarks/triton_resources.py compiles the triton backend's kernels and needs "
             "triton: pip install 'graphattn[gpu]'")

from graphattn.functional import triton_blocks as tb  # noqa: E402
from graphattn.functional import triton_kernels as tk  # noqa: E402

# (heads, channels): the layers of benchmarks/gpu.py, GAT's 8 x 8, and wide heads
CONFIGS = [(8, 8), (4, 16), (4, 64), (8, 64), (1, 128), (2, 256)]
KERNELS = ("forward_kernel", "backward_target_kernel", "backward_source_kernel")
# arguments that are not pointers of the input dtype
POINTER_TYPES = {"lse": "*fp32", "delta": "*fp32", "datt_rows": "*fp32", "rowptr": "*i32",
                 "col": "*i32", "eid": "*i32", "colptr": "*i32", "row_t": "*i32",
                 "eid_t": "*i32", "order": "*i32", "num_rows": "i32", "max_degree": "i32",
                 "scale": "fp32", "slope": "fp32", "cap": "fp32", "ptr": "*i32", "row": "*i32",
                 "tptr": "*i32", "tpair": "*i32", "bits": "*i32", "ids": "*i32",
                 "n_dst": "i32", "n_src": "i32", "out": "*fp32", "drop": "*fp32",
                 "scores": "*fp32", "sinks": "*fp32"}
BLOCK_KERNELS = ("block_forward_kernel", "block_backward_target_kernel",
                 "block_backward_source_kernel")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
REGISTERS_PER_SM, MAX_WARPS, MAX_BLOCKS, SHARED_PER_SM = 65536, 64, 32, 233472


def compile_kernels(heads: int, channels: int, score: str, dtype: str, *, features: bool,
                    score_channels: int | None = None, arch: int = 90,
                    one_edge_term: bool = False, block_n: int = 1,
                    seeded_dropout: bool = True, hub: bool = False,
                    ) -> tuple[tk.LaunchConfig, dict[str, dict[str, int | str]]]:
    """The three kernels compiled for ``sm_<arch>``: their launch config and, by kernel name,
    the resources of :func:`resource_usage`; with ``block_n > 1``, the row-block kernels
    (``block_n`` nodes per program) under their one-node kernels' names.

    ``dtype`` is ``"fp32"``, ``"fp16"`` or ``"bf16"``; ``features`` turns on the bias, the
    dropout mask, the per-edge key (dot and gatv2) and value terms, the soft cap of the scores
    (dot and gatv2), the sinks, the gradient through alpha and the gradients of bias, att and
    the per-edge terms; ``score_channels``
    is C_k (default: ``channels``, 1 for the additive score). ``one_edge_term`` (with
    ``features``, dot or gatv2, ``score_channels == channels``): one tensor is both terms, and
    the target pass writes one gradient for both (``EV_IS_EK``). ``seeded_dropout`` (with
    ``features``): the dropout mask is drawn in the kernels from a seed, as ``edge_attention``
    runs them, rather than read from an ``[E, H]`` tensor. ``hub``: the one-node kernels as
    they run the rows of many blocks, their sums added in float64 every ``tk.SUM_STEPS`` tiles
    (the other launches sum in fp32, ``SUM_STEPS=0``).
    """
    if one_edge_term and not (features and score != "additive"
                              and score_channels in (None, channels)):
        raise ValueError(f"one_edge_term needs features=True, the dot or gatv2 score and "
                         f"score_channels == channels, got features={features}, "
                         f"score={score!r}, score_channels={score_channels}")
    if score_channels is None:
        score_channels = 1 if score == "additive" else channels
    if block_n > 1:
        with tk.launch_tiles(block_n=block_n):
            cfg = tk.launch_config(heads, channels, score_channels)
    else:
        cfg = tk.launch_config(heads, channels, score_channels)
    edge_key = features and score != "additive"  # keys with channels
    constants = dict(H=heads, C=channels, CK=score_channels, SCORE=tk.SCORE_KINDS[score],
                     HAS_CAP=edge_key, HAS_BIAS=features, HAS_DROP=features, HAS_EK=edge_key,
                     HAS_EV=features, HAS_SINKS=features,
                     NEED_SCORES=features, HAS_DALPHA=features, NEED_DBIAS=features,
                     NEED_DATT=features and score == "gatv2", NEED_DEK=edge_key,
                     NEED_DEV=features and not one_edge_term, BLOCK_E=cfg.block_e,
                     BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, BLOCK_CK=cfg.block_ck,
                     EV_IS_EK=one_edge_term, BLOCK_N=block_n, HEAVY_ONLY=hub,
                     LIGHT_ONLY=False, SUM_STEPS=tk.SUM_STEPS if hub else 0)
    module = tk.kernels()
    usage = {}
    for name in KERNELS:
        kernel = getattr(module, tk.ROW_BLOCK_KERNELS[name] if block_n > 1 else name)
        usage[name] = _compile(kernel, constants, dtype, cfg.num_warps, arch,
                               _drop_type(features and seeded_dropout))
    return cfg, usage


def _drop_type(seeded: bool) -> dict[str, str]:
    """The type of the ``drop`` argument: a seeded mask's int64 parameters, or the fp32 mask
    of ``POINTER_TYPES``."""
    return {"drop": "*i64"} if seeded else {}


def _compile(kernel, constants: dict, dtype: str, num_warps: int, arch: int,
             types: dict[str, str] | None = None) -> dict[str, int | str]:
    """One kernel compiled for ``sm_<arch>``: the resources of :func:`resource_usage`,
    ``shared`` (bytes per block), ``mma``, the tensor-core instructions in its PTX
    (``wgmma.mma_async`` and ``mma.sync``; 0 where its products run on the FMA units), and
    ``ttir``, its Triton IR as text (for checks of its index arithmetic)."""
    pointer_types = {**POINTER_TYPES, **(types or {})}
    signature = {arg: "constexpr" if arg in constants else pointer_types.get(arg, f"*{dtype}")
                 for arg in kernel.arg_names}
    used = {n: v for n, v in constants.items() if n in kernel.arg_names}
    # Triton's JIT specializes a pointer to a 16-byte aligned address (every tensor torch
    # allocates on CUDA) as divisible by 16, which lets it vectorize the loads; so does this
    aligned = {(i,): [["tt.divisibility", 16]]
               for i, arg in enumerate(kernel.arg_names) if signature[arg].startswith("*")}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=used,
                                            attrs=aligned),
                                  target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps})
    assert compiled.asm["cubin"], kernel
    ptx = compiled.asm["ptx"]
    report = log.getvalue()
    if "Used " not in report:  # this triton discards the report: ask its ptxas again
        report = ptxas_report(ptx, arch)
    return {**resource_usage(report), "shared": compiled.metadata.shared,
            "mma": ptx.count("wgmma.mma_async") + ptx.count("mma.sync"),
            "ttir": compiled.asm["ttir"]}


def ptxas_report(ptx: str, arch: int) -> str:
    """What ``ptxas -v`` prints on ``ptx`` for ``sm_<arch>``, run as Triton runs it: its own
    ptxas, ``-lineinfo -v --gpu-name=<arch>`` (Triton's default flags). For tritons that run
    ptxas with ``-v`` but drop its report (3.4: no ``TRITON_DUMP_PTXAS_LOG``)."""
    from triton.backends.nvidia import compiler as nvidia

    try:
        ptxas = nvidia.get_ptxas(arch).path  # triton >= 3.5 picks a ptxas per architecture
    except TypeError:
        ptxas = nvidia.get_ptxas().path
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([ptxas, "-lineinfo", "-v",
                               f"--gpu-name={nvidia.sm_arch_from_capability(arch)}",
                               str(source), "-o", str(source.with_suffix(".cubin"))],
                              capture_output=True, text=True, check=True)
    return done.stdout + done.stderr


def compile_block_kernels(heads: int, channels: int, dtype: str, block: int, *, bias: bool,
                          dropout: bool = False, scores: bool = False, precision: str = "ieee",
                          arch: int = 90, seeded_dropout: bool = True, sinks: bool = False,
                          ) -> tuple[int, dict[str, dict[str, int | str]]]:
    """The three block-sparse kernels (:mod:`graphattn.functional.triton_blocks`) compiled
    for ``sm_<arch>`` with B = ``block``: their warps and, by kernel name, the resources of
    :func:`resource_usage`. ``bias`` turns on the bias and its gradient, ``dropout`` the
    dropout mask (drawn from a seed in the kernels with ``seeded_dropout``, as
    ``edge_attention`` runs them, else read from an ``[E, H]`` tensor), ``scores`` the scores
    written for the weights, ``sinks`` the sinks (the forward's rows start at them);
    ``precision`` is the products' input precision of fp32 inputs (``"ieee"`` or
    ``"tf32"``)."""
    tile = tb._channel_tile(channels)
    warps = tb._warps(DTYPES[dtype], precision, dropout and seeded_dropout)
    constants = dict(H=heads, C=channels, CV=channels, HAS_BIAS=bias, NEED_DBIAS=bias,
                     HAS_DROP=dropout, NEED_SCORES=scores, BLOCK=block, BLOCK_C=tile, BLOCK_CV=tile,
                     PRECISION=precision, HAS_SINKS=sinks)
    module = tk.kernels()
    return warps, {name: _compile(getattr(module, name), constants, dtype, warps, arch,
                                  _drop_type(dropout and seeded_dropout))
                   for name in BLOCK_KERNELS}


def resource_usage(ptxas_log: str) -> dict[str, int]:
    """``registers`` per thread and ``stack``, ``spill_stores``, ``spill_loads`` in bytes per
    thread, from the report of ``ptxas -v`` on one kernel."""
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", ptxas_log)
    registers = re.search(r"Used (\d+) registers", ptxas_log)
    if frame is None or registers is None:
        raise RuntimeError(f"ptxas printed no resource report: {ptxas_log[-500:]!r}")
    stack, stores, loads = (int(g) for g in frame.groups())
    return {"registers": int(registers.group(1)), "stack": stack, "spill_stores": stores,
            "spill_loads": loads}


def resident_warps(registers: int, warps: int, shared: int) -> int:
    """Warps an sm_90 SM holds at once for this kernel (see the module docstring)."""
    per_warp = math.ceil(registers * 32 / 256) * 256
    blocks = min(MAX_BLOCKS, REGISTERS_PER_SM // (per_warp * warps),
                 SHARED_PER_SM // max(shared, 1))
    return min(MAX_WARPS, blocks * warps)


def add_row(table: list[str], spills: list[str], cells: str, use: dict[str, int],
            warps: int) -> None:
    """Print and append to ``table`` (and to ``spills`` when the kernel spills) the row that
    starts with ``cells`` and ends with the resources ``use`` of a kernel on ``warps`` warps."""
    resident = resident_warps(use["registers"], warps, use["shared"])
    row = (f"{cells}{use['registers']} | {use['shared']} | {use['spill_stores']} / "
           f"{use['spill_loads']} | {resident} |")
    table.append(row)
    print(row, flush=True)
    if use["spill_stores"] or use["spill_loads"]:
        spills.append(row)


def spill_summary(spills: list[str], table: list[str]) -> str:
    """How many of the kernels of ``table`` (after its two header lines) spill."""
    if spills:
        return f"{len(spills)} of {len(table) - 2} kernels spill registers"
    return f"None of the {len(table) - 2} kernels spills registers."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--block-n", type=int, default=1,
                        help="nodes per program: 1 for the one-node kernels (default), a "
                             "larger power of 2 for the row-block kernels")
    parser.add_argument("--output", default=None,
                        help="default: results/triton_resources.md, or "
                             "results/triton_resources_rows<N>.md with --block-n N > 1")
    parser.add_argument("--hub", action="store_true",
                        help="the one-node kernels with float64 block sums, as they run the "
                             "rows of many blocks, written to results/triton_resources_hub.md")
    parser.add_argument("--blocks", action="store_true",
                        help="the block-sparse kernels instead (launch_tiles(block_sparse=B)), "
                             "written to results/triton_resources_blocks.md")
    args = parser.parse_args()
    if args.blocks:
        blocks_table(args)
        return
    if args.block_n < 1 or args.block_n & (args.block_n - 1):
        parser.error(f"--block-n must be a power of 2, got {args.block_n}")
    if args.hub and args.block_n > 1:
        parser.error(f"--hub compiles the one-node kernels, got --block-n {args.block_n}")
    name = ("triton_resources_hub.md" if args.hub
            else "triton_resources.md" if args.block_n == 1
            else f"triton_resources_rows{args.block_n}.md")
    args.output = args.output or str(Path(__file__).parent / "results" / name)
    command = "python " + " ".join(shlex.quote(a) for a in [
        "benchmarks/triton_resources.py", *sys.argv[1:]])
    header = [f"command: `{command}`",
              f"triton {triton.__version__}, target sm_90 (compiled ahead of time, no GPU)"]
    if args.block_n > 1:
        header.append(f"the row-block kernels, {args.block_n} nodes per program, one edge of "
                      f"each per step (`launch_tiles(block_n={args.block_n})`)")
    if args.hub:
        header.append(f"the one-node kernels of the rows of many blocks: sums over a row's "
                      f"edges added in float64 every {tk.SUM_STEPS} tiles")
    print("\n".join(header))
    table = ["| H | C | score | dtype | inputs | tile (E or nodes x H x C), warps | kernel "
             "| registers | shared B | spill stores / loads B | resident warps / 64 |",
             "| ---: | ---: | --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    spills = []
    for heads, channels in CONFIGS:
        for score in tk.SCORE_KINDS:
            for dtype in ("fp32", "bf16"):
                for features in (False, True):
                    cfg, usage = compile_kernels(heads, channels, score, dtype,
                                                 features=features, block_n=args.block_n,
                                                 hub=args.hub)
                    lanes = (f"{cfg.block_e}" if args.block_n == 1
                             else f"{cfg.block_n} nodes")
                    tile = (f"{lanes} x {cfg.block_h} x "
                            f"{max(cfg.block_c, cfg.block_ck)}, {cfg.num_warps}")
                    for name, use in usage.items():
                        add_row(table, spills,
                                f"| {heads} | {channels} | {score} | {dtype} | "
                                f"{'all' if features else 'plain'} | {tile} | "
                                f"{name.removesuffix('_kernel')} | ", use, cfg.num_warps)
    summary = spill_summary(spills, table) + (":" if spills else "")
    print(summary)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join([
        "# Resource usage of the fused Triton kernels on sm_90 (H100/H200)", "",
        *(f"- {line}" for line in header), "",
        "Each kernel compiled with the tiles `launch_config` picks; \"plain\": no bias, dropout, "
        "per-edge term or gradient through alpha; \"all\": every optional input and gradient "
        "(the dropout mask drawn in the kernels from a seed). "
        "Registers and spills per thread from `ptxas -v` as Triton runs it, shared memory per "
        "block from Triton; resident warps per SM from registers and shared memory (formula in "
        "`benchmarks/triton_resources.py`). Static figures: the times need a GPU "
        "(`benchmarks/gpu.py`).", "",
        summary, "", *(table[:2] + spills if spills else []), "", "All kernels:", "", *table,
        ""]))
    print(f"wrote {output}")


def blocks_table(args: argparse.Namespace) -> None:
    """The table of the block-sparse kernels: H = 4, each tile side B, C in 16, 32, 64, fp32
    inputs with full fp32 and with TF32 products and bf16 inputs; no per-edge input, a bias,
    and a bias with a dropout mask and the weights returned."""
    output = Path(args.output or Path(__file__).parent / "results" / "triton_resources_blocks.md")
    command = "python " + " ".join(shlex.quote(a) for a in [
        "benchmarks/triton_resources.py", *sys.argv[1:]])
    header = [f"command: `{command}`",
              f"triton {triton.__version__}, target sm_90 (compiled ahead of time, no GPU)",
              "the block-sparse kernels (`launch_tiles(block_sparse=B)`), H = 4, C_v = C"]
    print("\n".join(header))
    table = ["| B | C | inputs | products | per-edge | warps | kernel | registers | shared B "
             "| spill stores / loads B | resident warps / 64 |",
             "| ---: | ---: | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    spills = []
    for block in tb.BLOCK_SIDES:
        for channels in (16, 32, 64):
            for dtype, precision in (("fp32", "ieee"), ("fp32", "tf32"), ("bf16", "ieee")):
                for bias, every in ((False, False), (True, False), (True, True)):
                    warps, usage = compile_block_kernels(4, channels, dtype, block, bias=bias,
                                                         dropout=every, scores=every,
                                                         precision=precision)
                    per_edge = "bias, dropout, weights" if every else "bias" if bias else "no"
                    for name, use in usage.items():
                        add_row(table, spills,
                                f"| {block} | {channels} | {dtype} | "
                                f"{precision if dtype == 'fp32' else dtype} | "
                                f"{per_edge} | {warps} | "
                                f"{name.removeprefix('block_').removesuffix('_kernel')} | ",
                                use, warps)
    summary = spill_summary(spills, table) + ("." if spills else "")
    print(summary)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join([
        "# Resource usage of the block-sparse Triton kernels on sm_90 (H100/H200)", "",
        *(f"- {line}" for line in header), "",
        "Registers and spills per thread from `ptxas -v` as Triton runs it, shared memory per "
        "block from Triton, resident warps per SM from both (formula in "
        "`benchmarks/triton_resources.py`). \"ieee\": full fp32 products (torch's default, "
        "`allow_tf32` off); \"tf32\": tensor-core TF32 products. Static figures: the times "
        "need a GPU (`benchmarks/gpu.py`).", "", summary, "", *table, ""]))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
