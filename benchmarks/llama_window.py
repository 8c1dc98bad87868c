"""A pretrained decoder's attention on a sliding window: graphattn's edges against the dense mask.

``graphattn.nn.from_llama`` turns a Hugging Face LLaMA-family self-attention into a
``GraphSelfAttention`` with its rotary embedding and grouped key heads. On a causal window
graph (``graphs.window_graph(L, r, causal=True)``: each token attends to itself and the r
before it) it computes that model's attention with a sliding-window mask, as Mistral's
attention restricts LLaMA's, over L (r + 1) edges instead of L^2 pairs. This times one layer
(hidden 512, 8 query heads and 2 key/value heads of 64 channels, window r = 256) at growing
lengths L:

- ``graphattn``: the converted layer on the window graph (``backend="auto"``, positions
  ``0 .. L-1``);
- ``hf sdpa``: Hugging Face's ``LlamaAttention`` with its SDPA implementation and the window as
  an additive ``[1, 1, L, L]`` mask, the way a dense implementation restricts attention;
- ``hf eager``: the same with its eager (matmul and softmax) implementation, up to 4096 tokens.

Forward (inference, ``torch.no_grad``) and forward+backward (``out.square().sum()``) of one
sequence, medians of interleaved repeats after warm-up, each round in a new random order. The
outputs are checked equal before anything is timed. Dense routes whose ``L x L`` mask and
scores would pass ``--max-dense-gib`` are skipped with the reason printed.

    python benchmarks/llama_window.py           # a few minutes on 2 cores
    python benchmarks/llama_window.py --quick   # tiny sizes, a smoke run

Needs Hugging Face ``transformers`` (in the ``test`` extra). Writes ``results/llama_window.md``
and ``.csv``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import _report
import torch
from batched_global import CPU, device_line
from tqdm import tqdm

from graphattn import graphs
from graphattn.nn import from_llama

RESULTS = _report.RESULTS
ROUTES = ("graphattn", "hf sdpa", "hf eager")
EAGER_MAX_LENGTH = 4096  # the eager route's [H, L, L] scores and their gradient stop here


def llama_attention(hidden: int, heads: int, kv_heads: int, implementation: str,
                    seed: int = 0):
    """A LlamaAttention of random weights with ``implementation`` (``"sdpa"`` or
    ``"eager"``), and its rotary embedding module."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, attention_dropout=0.0,
                         max_position_embeddings=1 << 20)
    config._attn_implementation = implementation
    torch.manual_seed(seed)
    return LlamaAttention(config, layer_idx=0).eval(), LlamaRotaryEmbedding(config)


def dense_gib(length: int, heads: int) -> float:
    """GiB of the dense routes' float mask and one layer of fp32 scores ``[H, L, L]``."""
    return (1 + heads) * length * length * 4 / 2**30


def routes(length: int, radius: int, hidden: int, heads: int, kv_heads: int,
           max_dense_gib: float, backward: bool) -> tuple[dict[str, Callable[[], torch.Tensor]],
                                                          dict[str, str]]:
    """One call per route (forward, or forward+backward), each returning its output, and the
    reason of each route left out."""
    sdpa, rotary = llama_attention(hidden, heads, kv_heads, "sdpa")
    eager, _ = llama_attention(hidden, heads, kv_heads, "eager")
    eager.load_state_dict(sdpa.state_dict())
    layer = from_llama(sdpa)
    window = graphs.window_graph(length, radius, causal=True)
    pos = torch.arange(length)
    x = torch.randn(1, length, hidden, generator=torch.Generator().manual_seed(1),
                    requires_grad=backward)
    skipped: dict[str, str] = {}
    runs: dict[str, Callable[[], torch.Tensor]] = {}

    def finish(out: torch.Tensor) -> torch.Tensor:
        if backward:
            out.square().sum().backward()
        return out.detach()

    def graph_run() -> torch.Tensor:
        with torch.set_grad_enabled(backward):
            return finish(layer(x[0], window, pos=pos)[None])

    runs["graphattn"] = graph_run
    gib = dense_gib(length, heads)
    if gib > max_dense_gib:
        reason = (f"the L x L mask and [H, L, L] scores take {gib:.1f} GiB, over "
                  f"--max-dense-gib {max_dense_gib}")
        skipped["hf sdpa"] = skipped["hf eager"] = reason
        return runs, skipped
    allowed = graphs.to_dense_mask(window, length)  # (L, L): query i may see key j
    mask = torch.zeros(length, length).masked_fill(~allowed, float("-inf"))[None, None]
    embeddings = rotary(x, pos[None])

    def hf_run(module) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.set_grad_enabled(backward):
                return finish(module(x, position_embeddings=embeddings,
                                     attention_mask=mask)[0])
        return run

    runs["hf sdpa"] = hf_run(sdpa)
    if length <= EAGER_MAX_LENGTH:
        runs["hf eager"] = hf_run(eager)
    else:
        skipped["hf eager"] = (f"the eager route stops at {EAGER_MAX_LENGTH} tokens (its "
                               f"[H, L, L] scores and weights, kept for backward)")
    return runs, skipped


def measure(length: int, args: argparse.Namespace) -> list[dict[str, object]]:
    rows = []
    for backward in (False, True):
        runs, skipped = routes(length, args.radius, args.hidden, args.heads, args.kv_heads,
                               args.max_dense_gib, backward)
        outs = {name: run() for name, run in runs.items()}
        for name, out in outs.items():  # the same function, checked before it is timed
            diff = (out - outs["graphattn"]).abs().max().item()
            if diff > 1e-3:
                raise AssertionError(f"L={length}: {name} differs from graphattn by {diff}")
        times: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        order = torch.Generator().manual_seed(0)
        for r in range(args.warmup + args.repeats):
            for i in torch.randperm(len(names), generator=order).tolist():
                start = time.perf_counter()
                runs[names[i]]()
                if r >= args.warmup:
                    times[names[i]].append(time.perf_counter() - start)
        ours = statistics.median(times["graphattn"])
        for name in ROUTES:
            row = {"length": length, "edges": length * (args.radius + 1)
                   - args.radius * (args.radius + 1) // 2,
                   "pass": "fwd+bwd" if backward else "forward", "route": name}
            if name in times:
                ms = statistics.median(times[name]) * 1e3
                row.update(ms=round(ms, 2), vs_graphattn=round(ms / (ours * 1e3), 2),
                           note="")
            else:
                row.update(ms="", vs_graphattn="", note=skipped[name])
            rows.append(row)
    return rows


def write_table(rows: list[dict[str, object]], args: argparse.Namespace, command: str) -> None:
    header = [f"- command: `{command}`",
              f"- torch {torch.__version__}, {device_line(CPU)}, python "
              f"{platform.python_version()}, transformers {_transformers_version()}",
              f"- LlamaAttention: hidden {args.hidden}, {args.heads} query heads, "
              f"{args.kv_heads} key/value heads, head_dim {args.hidden // args.heads}, fp32; "
              f"causal window r = {args.radius}; {args.repeats} interleaved repeats (each "
              f"round in a new random order) after {args.warmup} warm-up, medians"]
    note = ("One sequence of L tokens. `graphattn`: `from_llama(attention)` on "
            "`graphs.window_graph(L, r, causal=True)` with `pos=torch.arange(L)`; `hf sdpa` / "
            "`hf eager`: Hugging Face's attention with the window as an additive [1, 1, L, L] "
            "mask. Outputs checked equal first. `vs_graphattn`: the route's time over "
            "graphattn's (above 1: graphattn is faster).")
    _report.write_table("llama_window", "A LLaMA attention on a sliding window: edges or a "
                        "dense mask", header, note, rows, out=args.output)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 repeats")
    parser.add_argument("--lengths", default=None,
                        help="comma-separated sequence lengths (default: 1024,4096,8192,16384; "
                             "64,256 with --quick)")
    parser.add_argument("--radius", type=int, default=None,
                        help="window r (default: 256, 16 with --quick)")
    parser.add_argument("--hidden", type=int, default=None,
                        help="model width (default: 512, 64 with --quick)")
    parser.add_argument("--heads", type=int, default=8, help="query heads (default: 8)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default: 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats (default: 7, 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repeats (default: 2)")
    parser.add_argument("--max-dense-gib", type=float, default=6.0,
                        help="skip the dense routes above this many GiB of mask and scores "
                             "(default: 6)")
    parser.add_argument("--output", type=Path, default=None,
                        help="table path (default: results/llama_window.md; _quick with "
                             "--quick)")
    args = parser.parse_args(argv)
    lengths = args.lengths or ("64,256" if args.quick else "1024,4096,8192,16384")
    try:
        args.lengths = [int(v) for v in lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {lengths!r}")
    args.radius = args.radius if args.radius is not None else (16 if args.quick else 256)
    args.hidden = args.hidden if args.hidden is not None else (64 if args.quick else 512)
    args.repeats = args.repeats if args.repeats is not None else (2 if args.quick else 7)
    if min(args.lengths) < 2 or args.radius < 0:
        parser.error(f"--lengths must be at least 2 and --radius at least 0, got "
                     f"{args.lengths} and {args.radius}")
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be at least 1 and --warmup at least 0, got "
                     f"{args.repeats} and {args.warmup}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error(f"--hidden must be divisible by --heads and --heads by --kv-heads, got "
                     f"{args.hidden}, {args.heads}, {args.kv_heads}")
    if args.output is None:
        args.output = _report.default_output("llama_window", args.quick)
    return args


def main(argv: list[str] | None = None) -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("this benchmark needs Hugging Face transformers: "
                         "pip install -e '.[test]'") from None
    args = parse_args(argv)
    command = "python benchmarks/llama_window.py " + " ".join(sys.argv[1:] if argv is None
                                                               else argv)
    print(f"command: {command.strip()}")
    print(f"torch {torch.__version__}, {device_line(CPU)}")
    rows: list[dict[str, object]] = []
    args.output.parent.mkdir(parents=True, exist_ok=True)
    for length in tqdm(args.lengths, desc="lengths"):
        rows.extend(measure(length, args))
        for row in rows[-2 * len(ROUTES):]:
            if row["note"]:
                print(f"L={length} {row['pass']} {row['route']}: skipped, {row['note']}")
        write_table(rows, args, command.strip())  # kept if a later length is cut
    print(args.output.read_text())
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
