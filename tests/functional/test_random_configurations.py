"""Random configurations of ``edge_attention``, every option at once, against the reference.

The other tests take the options one or two at a time on hand-picked graphs. Here each seed
draws a whole call: the score, fp32 or fp64, a bipartite or square graph of 0-12 nodes with
multi-edges, self-loops and sometimes one target of 30-220 in-edges, int32 or int64 ids, 1-4
heads of 1-17 channels (score and value channels apart), a bias, per-edge key and value terms
(sometimes one tensor for both), scale, negative slope, dropout, a soft cap of the dot and
gatv2 scores (which the dense backend refuses: its calls drop it), sinks, returned weights and
keys and values of fewer heads than the queries (grouped-query attention). The
backend's outputs, weights and the gradients of every input must match the reference backend's.

The suite runs the ``dense`` and ``cpu`` backends over ``SEEDS``: the ``cpu`` backend as the
suite compiles it (tests/conftest.py), one variant of its kernels reading the options at run
time. As the package compiles them, a kernel per combination of flags and channel count, and
for the ``triton`` backend, a run over many seeds is a separate command::

    python tests/functional/test_random_configurations.py --seeds 0:400 --backends cpu,dense
    TRITON_INTERPRET=1 python tests/functional/test_random_configurations.py --backends triton

``--hub-launch`` (and ``--row-blocks``) run the triton backend's float64 block sums on every
row of more than one tile of 2 edges, which graphs this small otherwise never reach.
"""

from __future__ import annotations

import argparse
import contextlib
import random
from dataclasses import dataclass, field

import pytest
import torch

from graphattn.functional import edge_attention

SEEDS = range(60)
TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.float64: dict(atol=1e-9, rtol=1e-7)}


@dataclass
class Call:
    """One drawn call: the positional inputs, the keyword arguments and the leaves whose
    gradients are compared."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    edge_index: torch.Tensor
    kwargs: dict = field(default_factory=dict)

    def leaves(self) -> list[torch.Tensor]:
        tensors = [self.q, self.k, self.v] + [t for t in self.kwargs.values()
                                              if isinstance(t, torch.Tensor)]
        return list({id(t): t for t in tensors}.values())  # one tensor as both edge terms

    def describe(self) -> str:
        shapes = {name: tuple(t.shape) if isinstance(t, torch.Tensor) else t
                  for name, t in self.kwargs.items()}
        return (f"q {tuple(self.q.shape)}, k {tuple(self.k.shape)}, v {tuple(self.v.shape)}, "
                f"edge_index {tuple(self.edge_index.shape)} {self.edge_index.dtype}, "
                f"{self.q.dtype}, {shapes}")


def _graph(rng: random.Random, gen: torch.Generator, n_src: int, n_dst: int) -> torch.Tensor:
    """``[2, E]``: uniform edges, repeated ones, sometimes a target of many in-edges."""
    if n_src == 0 or n_dst == 0:
        return torch.empty(2, 0, dtype=torch.long)
    num_edges = rng.randint(0, 4 * n_dst + 3)
    src = torch.randint(0, n_src, (num_edges,), generator=gen)
    dst = torch.randint(0, n_dst, (num_edges,), generator=gen)
    if num_edges and rng.random() < 0.5:  # multi-edges
        again = torch.randint(0, num_edges, (rng.randint(1, 5),), generator=gen)
        src, dst = torch.cat([src, src[again]]), torch.cat([dst, dst[again]])
    if rng.random() < 0.3:  # one heavy target, past the kernels' tiles
        degree = rng.randint(30, 220)
        src = torch.cat([src, torch.randint(0, n_src, (degree,), generator=gen)])
        dst = torch.cat([dst, torch.full((degree,), rng.randrange(n_dst))])
    edge_index = torch.stack([src, dst])
    return edge_index.int() if rng.random() < 0.3 else edge_index


def draw(seed: int) -> Call:
    """The call of ``seed``."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    score = rng.choice(["dot", "additive", "gatv2"])
    dtype = rng.choice([torch.float32, torch.float64])
    n_dst = rng.randint(0, 12)
    n_src = rng.randint(0, 12) if rng.random() < 0.3 else n_dst
    H, C = rng.choice([1, 1, 2, 3, 4]), rng.choice([1, 2, 3, 5, 7, 8, 9, 16, 17])
    Cq = C if score == "additive" or rng.random() < 0.7 else rng.choice([1, 3, 8])
    edge_index = _graph(rng, gen, n_src, n_dst)
    E = edge_index.size(1)

    def leaf(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, dtype=dtype) * rng.choice([0.5, 1.0, 3.0])
        return x.requires_grad_()

    qk = (H,) if score == "additive" else (H, Cq)  # (N, H) or (N, H, Cq)
    call = Call(leaf(n_dst, *qk), leaf(n_src, *qk), leaf(n_src, H, C), edge_index,
                {"score": score, "return_attention": rng.random() < 0.5})
    if score == "gatv2":
        call.kwargs["att"] = leaf(H, Cq)
    if rng.random() < 0.4:
        call.kwargs["bias"] = leaf(E, H)
    if score != "additive" and rng.random() < 0.3:
        call.kwargs["edge_key"] = leaf(E, H, Cq)
    if rng.random() < 0.3:
        both = "edge_key" in call.kwargs and Cq == C and rng.random() < 0.5
        call.kwargs["edge_value"] = call.kwargs["edge_key"] if both else leaf(E, H, C)
    if rng.random() < 0.3:
        call.kwargs["scale"] = rng.choice([0.1, 1.0, 2.5])
    if score != "dot" and rng.random() < 0.3:
        call.kwargs["negative_slope"] = rng.choice([0.0, 0.01, 0.5])
    if rng.random() < 0.3:
        call.kwargs["dropout_p"] = rng.choice([0.2, 0.6])
    if score != "additive" and rng.random() < 0.3:
        call.kwargs["softcap"] = rng.choice([0.5, 2.0, 30.0])
    if rng.random() < 0.3:
        call.kwargs["sinks"] = leaf(H)
    if H in (2, 4) and rng.random() < 0.3:  # grouped keys and values: H_kv heads dividing H
        kv_heads = rng.choice([h for h in (1, 2) if h < H])
        call.k = leaf(n_src, kv_heads) if score == "additive" else leaf(n_src, kv_heads, Cq)
        call.v = leaf(n_src, kv_heads, C)
    return call


def run(call: Call, backend: str, seed: int) -> list[torch.Tensor | None]:
    """``out``, the weights (or ``None``) and the gradient of every leaf (``None`` where it gets
    none) of a random linear loss on both; the dropout mask drawn at a fixed seed."""
    torch.manual_seed(seed)
    result = edge_attention(call.q, call.k, call.v, call.edge_index, backend=backend,
                            **call.kwargs)
    out, alpha = result if call.kwargs["return_attention"] else (result, None)
    gen = torch.Generator().manual_seed(seed)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    if alpha is not None:
        loss = loss + (alpha * torch.randn(alpha.shape, generator=gen, dtype=alpha.dtype)).sum()
    grads = torch.autograd.grad(loss, call.leaves(), allow_unused=True)
    return [out.detach(), None if alpha is None else alpha.detach(), *grads]


def mismatches(seed: int, backend: str) -> list[str]:
    """What differs between ``backend`` and the reference on the call of ``seed``."""
    call = draw(seed)
    if backend == "dense":  # (it refuses a cap: tests/functional/test_softcap.py)
        call.kwargs.pop("softcap", None)
    want, got = run(call, "reference", seed), run(call, backend, seed)
    names = ["out", "alpha"] + [f"grad {i}" for i in range(len(want) - 2)]
    found = []
    for name, a, b in zip(names, got, want, strict=True):
        if (a is None) != (b is None):
            found.append(f"{name}: {'no tensor' if a is None else 'a tensor'} where the "
                         f"reference has {'none' if b is None else 'one'}")
        elif a is not None and a.shape != b.shape:
            found.append(f"{name}: shape {tuple(a.shape)}, reference {tuple(b.shape)}")
        elif a is not None and not torch.allclose(a, b, equal_nan=True, **TOL[b.dtype]):
            found.append(f"{name}: max difference {(a - b).abs().max().item():.3g}")
    return [f"seed {seed}, {backend}, {call.describe()}: {m}" for m in found]


@pytest.mark.parametrize("seed", SEEDS)
def test_dense_backend_matches_the_reference_on_a_random_call(seed):
    assert mismatches(seed, "dense") == []


@pytest.mark.parametrize("seed", SEEDS)
def test_cpu_backend_matches_the_reference_on_a_random_call(seed):
    assert mismatches(seed, "cpu") == []


def test_draws_cover_the_options():
    """The seeds of the suite reach every score, both dtypes, bipartite and empty graphs, each
    optional input, one tensor as both edge terms, and a heavy target."""
    calls = [draw(seed) for seed in SEEDS]
    scores = {call.kwargs["score"] for call in calls}
    assert scores == {"dot", "additive", "gatv2"}
    assert {call.q.dtype for call in calls} == {torch.float32, torch.float64}
    assert any(call.q.size(0) != call.k.size(0) for call in calls)
    assert any(call.edge_index.size(1) == 0 for call in calls)
    assert any(call.edge_index.dtype == torch.int32 for call in calls)
    for name in ("bias", "edge_key", "edge_value", "dropout_p", "scale", "negative_slope",
                 "softcap", "sinks"):
        assert any(name in call.kwargs for call in calls), name
    assert any(call.kwargs.get("edge_value") is call.kwargs.get("edge_key") is not None
               for call in calls)
    assert any(call.kwargs["return_attention"] for call in calls)
    assert any(call.k.size(1) < call.q.size(1) for call in calls)
    assert any(torch.bincount(call.edge_index[1].long()).max() >= 30 for call in calls
               if call.edge_index.numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0:200", help="first:last (default: 0:200)")
    parser.add_argument("--backends", default="cpu,dense",
                        help="comma-separated backends to compare (default: cpu,dense)")
    parser.add_argument("--hub-launch", action="store_true",
                        help="triton: tiles of 2 edges, and every row of more than one tile "
                             "in the launch of the rows of many blocks, with float64 block "
                             "sums (SUM_STEPS=1, HUB_EDGES=0)")
    parser.add_argument("--row-blocks", action="store_true",
                        help="triton: the row-block kernels, 2 rows a program, the rows of "
                             "more than 4 edges in the one-node kernel")
    args = parser.parse_args()
    from graphattn.functional import triton_kernels as tk

    tiles = {}
    if args.hub_launch:
        tk.SUM_STEPS, tk.HUB_EDGES = 1, 0
        tiles["block_e"] = 2
    if args.row_blocks:
        tiles.update(block_n=2, heavy_degree=4)
    first, last = (int(x) for x in args.seeds.split(":"))
    found = 0
    for seed in range(first, last):
        for backend in args.backends.split(","):
            if backend == "triton" and draw(seed).q.dtype == torch.float64:
                continue  # the kernels take fp32, fp16 and bf16
            with tk.launch_tiles(**tiles) if backend == "triton" else contextlib.nullcontext():
                for line in mismatches(seed, backend):
                    found += 1
                    print(line, flush=True)
    print(f"{last - first} seeds, backends {args.backends}: {found} mismatches")


if __name__ == "__main__":
    main()
