r"""Sequence positional encodings are graph positional encodings of the chain.

A sequence is a chain graph, and the Laplacian eigenvectors of a chain are the sinusoids that
transformers add to their inputs. This script computes ``graphattn.pe.laplacian_pe`` on the
cycle ``0 - 1 - ... - n-1 - 0`` (a periodic sequence) and on the path ``0 - 1 - ... - n-1`` (an
open one) with a numerical eigensolver, and measures how far each eigenvector is from the
closed form:

- cycle: eigenvalue :math:`\lambda_m = 1 - \cos(2 \pi m / n)`, eigenspace spanned by
  :math:`\sin(2 \pi m t / n)` and :math:`\cos(2 \pi m t / n)`: the residual is the part of that
  sin/cos pair outside the two eigenvectors found (0 when they span the same plane);
- path: eigenvalue :math:`1 - \cos(\pi m / (n - 1))`, eigenvector
  :math:`\propto \sqrt{d_t} \cos(\pi m t / (n - 1))` (:math:`d_t` the degree, 1 at the ends):
  the residual is the closed form's part outside the line of :math:`u_m` (the sine of the
  angle between them).

Both run in float64 (``laplacian_pe`` returns the default dtype), so the residuals show the
eigensolver's precision rather than float32's rounding.

Relative positions are graph quantities of the chain too: the number of edges between j and
i on the path is |i - j|, and on the cycle min(|i - j|, n - |i - j|). The script checks
``pe.hop_distance`` against both for every pair, and so the biases built on it: ALiBi's
:math:`-m_h |i - j|` (``pe.alibi_bias``) and T5's buckets of i - j
(``pe.relative_position_bucket``), exact near 0 and log-spaced beyond. Rotary embeddings
(``pe.RotaryPE``) reach the same form without a bias: a query at position i and a key at j,
each rotated by its position, score :math:`q \cdot R_{j - i} k`, so that the score matrix of
one query and one key vector over all positions is constant along each diagonal i - j (a
Toeplitz matrix); the script measures how far it is from one.

It prints the tables, and with matplotlib draws the eigenvectors over their closed forms, the
cycle's encoding beside the transformer's sinusoidal encoding ``pe.sinusoidal``, the path's
hop distances, the biases of each offset and RoPE's scores.

Usage::

    python examples/positional_encodings.py --out out/positional_encodings
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from graphattn import graphs, pe


def cycle_graph(n: int) -> torch.Tensor:
    """The cycle on ``n`` nodes, both directions: the chain plus the edge ``n-1 <-> 0``."""
    closing = torch.tensor([[n - 1, 0], [0, n - 1]])
    return torch.cat([graphs.chain_graph(n), closing], dim=1)


def cycle_table(n: int, pairs: int) -> tuple[list[dict], torch.Tensor]:
    """The cycle's ``2 * pairs`` lowest eigenvectors against the sin/cos pairs of frequency
    ``2 pi m / n``, ``m = 1 .. pairs``."""
    enc, lam = pe.laplacian_pe(cycle_graph(n), n, 2 * pairs, return_eigenvalues=True)
    enc, lam = enc.double(), lam.double()  # (main computes them in float64)
    t = torch.arange(n, dtype=torch.float64)
    rows = []
    for m in range(1, pairs + 1):
        omega = 2 * math.pi * m / n
        pair = torch.stack([torch.sin(omega * t), torch.cos(omega * t)], dim=1)  # (n, 2)
        pair = pair / pair.norm(dim=0)
        basis = enc[:, 2 * (m - 1):2 * m]  # the two eigenvectors of the m-th eigenvalue
        outside = pair - basis @ (basis.T @ pair)  # the pair's part outside their plane
        rows.append({"m": m, "period": n / m, "eigenvalue": lam[2 * (m - 1)].item(),
                     "closed form": 1 - math.cos(omega),
                     "residual": outside.norm().item() / pair.norm().item()})
    return rows, enc


def path_table(n: int, k: int) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
    """The path's ``k`` lowest eigenvectors against :math:`\\sqrt{d_t} \\cos(\\pi m t / (n-1))`."""
    enc, lam = pe.laplacian_pe(graphs.chain_graph(n), n, k, return_eigenvalues=True)
    enc, lam = enc.double(), lam.double()  # (main computes them in float64)
    t = torch.arange(n, dtype=torch.float64)
    degree = torch.full((n,), 2.0, dtype=torch.float64)
    degree[[0, -1]] = 1.0
    rows, closed = [], []
    for m in range(1, k + 1):
        form = degree.sqrt() * torch.cos(math.pi * m * t / (n - 1))
        form = form / form.norm()
        closed.append(form)
        u = enc[:, m - 1] / enc[:, m - 1].norm()
        rows.append({"m": m, "period": 2 * (n - 1) / m, "eigenvalue": lam[m - 1].item(),
                     "closed form": 1 - math.cos(math.pi * m / (n - 1)),
                     "residual": (form - u * (u @ form)).norm().item()})
    return rows, enc, torch.stack(closed, dim=1)


def relative_table(n: int, heads: int = 4) -> dict:
    """Hop distances of every pair on the path and the cycle of ``n`` nodes against their
    closed forms, and the relative biases of the path's pairs: ALiBi's with ``heads`` slopes,
    T5's bucket (32 buckets up to 128, both directions) of each offset i - j."""
    i, j = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
    offset = i - j  # (n, n): row = target i, column = source j
    path = pe.hop_distance(graphs.chain_graph(n), n)  # (n, n)
    cycle = pe.hop_distance(cycle_graph(n), n)
    alibi = pe.alibi_bias(path, heads, dtype=torch.float64)  # (n, n, H)
    slopes = pe.alibi_slopes(heads)
    rope = rope_scores(n)  # (n, n)
    # the spread of the scores along each diagonal i - j: 0 for a function of i - j alone
    spread = max(float(rope.diagonal(d).max() - rope.diagonal(d).min()) for d in range(1 - n, n))
    return {
        "offset": offset, "path": path, "alibi": alibi, "rope": rope,
        "rope spread": spread,
        "t5": pe.relative_position_bucket(offset),
        "path differs": int((path != offset.abs()).sum()),
        "cycle differs": int((cycle != torch.minimum(offset.abs(), n - offset.abs())).sum()),
        "alibi error": float((alibi + slopes * offset.abs().unsqueeze(-1)).abs().max()),
    }


def rope_scores(n: int, dim: int = 16, seed: int = 0) -> torch.Tensor:
    """``[n, n]``: entry [i, j] the score of one query vector at position i and one key vector
    at position j, both rotated by ``pe.RotaryPE(dim)`` (float64)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, dim, dtype=torch.float64, generator=gen)
    rope = pe.RotaryPE(dim)
    positions = torch.arange(n)
    rotated_q = rope(q.expand(n, 1, dim), positions)[:, 0]  # (n, dim): R_i q
    rotated_k = rope(k.expand(n, 1, dim), positions)[:, 0]  # (n, dim): R_j k
    return rotated_q @ rotated_k.T


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'m':>3} {'period':>8} {'eigenvalue':>12} {'closed form':>12} {'residual':>10}")
    for r in rows:
        print(f"{r['m']:>3} {r['period']:>8.2f} {r['eigenvalue']:>12.8f} "
              f"{r['closed form']:>12.8f} {r['residual']:>10.1e}")


def plot(n: int, pairs: int, cycle_enc: torch.Tensor, path_enc: torch.Tensor,
         path_closed: torch.Tensor, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = torch.arange(n, dtype=torch.float64)
    fig, axes = plt.subplots(4, 2, figsize=(11, 14))
    ax = axes[0, 0]
    for m in range(1, min(pairs, 2) + 1):
        omega = 2 * math.pi * m / n
        sin, cos = torch.sin(omega * t), torch.cos(omega * t)
        for col in range(2):
            u = cycle_enc[:, 2 * (m - 1) + col]
            # the eigenvector's own mix of sin and cos: any rotation of the pair spans the plane
            fit = (float(u @ sin) * sin + float(u @ cos) * cos) / (n / 2)
            ax.plot(t.numpy(), u.numpy(), lw=2, alpha=0.6, color=f"C{m - 1}",
                    label=f"m = {m}: both eigenvectors" if col == 0 else None)
            ax.plot(t.numpy(), fit.numpy(), "k:", lw=1)
    ax.set_title(f"cycle of {n}: eigenvectors, a·sin + b·cos of 2πmt/n (dotted)")
    ax.set_xlabel("position t")
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    for m in range(1, min(3, path_enc.size(1)) + 1):  # --pairs 1: the path's two only
        ax.plot(t.numpy(), path_enc[:, m - 1].numpy(), lw=2, alpha=0.6, label=f"u_{m}")
        sign = 1.0 if float(path_enc[:, m - 1] @ path_closed[:, m - 1]) >= 0 else -1.0
        ax.plot(t.numpy(), (sign * path_closed[:, m - 1]).numpy(), "k:", lw=1)
    ax.set_title(f"path of {n}: eigenvectors, √d_t·cos(πmt/(n-1)) (dotted)")
    ax.set_xlabel("position t")
    ax.legend(fontsize=8)
    sinus = pe.sinusoidal(n, 2 * pairs)
    for ax, image, title in (
            (axes[1, 0], sinus, f"pe.sinusoidal, d = {2 * pairs}: sin/cos at 10000^(-2i/d)"),
            (axes[1, 1], cycle_enc, f"laplacian_pe of the cycle, k = {2 * pairs}: at 2πm/n")):
        ax.imshow(image.T.numpy(), aspect="auto", cmap="RdBu_r", interpolation="nearest")
        ax.set_title(title)
        ax.set_xlabel("position t")
        ax.set_ylabel("column")
    relative = relative_table(n)
    ax = axes[2, 0]
    image = ax.imshow(relative["path"].numpy(), cmap="viridis", interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046)
    ax.set_title(f"path of {n}: pe.hop_distance = |i - j| for every pair")
    ax.set_xlabel("source j")
    ax.set_ylabel("target i")
    ax = axes[2, 1]
    d = relative["offset"][:, 0]  # i - j for j = 0: offsets 0 .. n-1, and their negatives
    offsets = torch.cat([-d.flip(0)[:-1], d])
    biases = pe.alibi_bias(offsets.abs(), relative["alibi"].size(-1), dtype=torch.float64)
    for h in range(biases.size(1)):
        ax.plot(offsets.numpy(), biases[:, h].numpy(), lw=1.5, label=f"ALiBi head {h}")
    ax.set_xlabel("offset i - j")
    ax.set_ylabel("ALiBi bias -m_h |i - j|")
    twin = ax.twinx()
    twin.step(offsets.numpy(), pe.relative_position_bucket(offsets).numpy(), "k", lw=1,
              where="mid", label="T5 bucket")
    twin.set_ylabel("T5 bucket (32 up to 128)")
    ax.set_title("biases of the chain's offsets: ALiBi's, T5's buckets (black)")
    ax.legend(fontsize=8, loc="lower left")
    ax = axes[3, 0]
    image = ax.imshow(relative["rope"].numpy(), cmap="RdBu_r", interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046)
    ax.set_title("RoPE: score of R_i q and R_j k, constant along i - j")
    ax.set_xlabel("key position j")
    ax.set_ylabel("query position i")
    ax = axes[3, 1]
    # the same curve from every query position: drawn over each other, wide to narrow
    for i, style, width in ((n - 1, "-", 6), (n // 2, "--", 3), (n // 4, ":", 2)):
        shifts = torch.arange(i + 1)  # i - j for j = i .. 0
        ax.plot(shifts.numpy(), relative["rope"][i, i - shifts].numpy(), style, lw=width,
                alpha=0.8, label=f"query at i = {i}")
    ax.set_xlabel("offset i - j")
    ax.set_ylabel("score")
    ax.set_title("RoPE's score by offset, from three query positions")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "positional_encodings.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=64, help="sequence length n (>= 8)")
    parser.add_argument("--pairs", type=int, default=None,
                        help="sin/cos pairs of the cycle (2 * pairs eigenvectors; the path takes "
                             "as many), at most (length - 1) // 2 (default: 4, or that bound "
                             "if lower)")
    parser.add_argument("--out", type=Path, default=Path("out/positional_encodings"))
    parser.add_argument("--no-plot", action="store_true", help="skip the figure")
    args = parser.parse_args(argv)
    if args.length < 8:
        parser.error(f"--length must be at least 8, got {args.length}")
    # the cycle's frequencies m < n / 2 have an eigenspace of two sinusoids (m = n / 2, on an
    # even cycle, has one), so the pairs end at m = (n - 1) // 2
    most = (args.length - 1) // 2
    args.pairs = min(4, most) if args.pairs is None else args.pairs
    if not 1 <= args.pairs <= most:
        parser.error(f"--pairs must be in [1, {most}] for --length {args.length}, "
                     f"got {args.pairs}")
    if any(p.exists() and not p.is_dir() for p in (args.out, *args.out.parents)):
        parser.error(f"--out must be a folder (it gets the figure), got {str(args.out)!r}, a file")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # laplacian_pe computes and returns in it
    try:
        cycle, cycle_enc = cycle_table(args.length, args.pairs)
        path, path_enc, path_closed = path_table(args.length, 2 * args.pairs)
    finally:
        torch.set_default_dtype(default)
    print_table(f"cycle of {args.length}: eigenspaces against sin/cos(2 pi m t / n)", cycle)
    print_table(f"path of {args.length}: eigenvectors against sqrt(d_t) cos(pi m t / (n - 1))",
                path)
    worst = max(r["residual"] for r in cycle + path)
    print(f"\nlargest residual: {worst:.1e}")
    relative = relative_table(args.length)
    print(f"\nrelative positions, {args.length ** 2} pairs: hop distances on the path other "
          f"than |i - j|: {relative['path differs']}; on the cycle other than "
          f"min(|i - j|, n - |i - j|): {relative['cycle differs']}; ALiBi's bias against "
          f"-m_h |i - j|: {relative['alibi error']:.1e}; RoPE's scores, largest spread along "
          f"a diagonal i - j: {relative['rope spread']:.1e}")
    if not args.no_plot:
        try:
            figure = plot(args.length, args.pairs, cycle_enc, path_enc, path_closed, args.out)
        except ImportError:
            print("matplotlib is not installed: no figure (pip install -e '.[plot]')")
        else:
            print(f"figure: {figure}")
    return {"cycle": cycle, "path": path, "relative": relative}


if __name__ == "__main__":
    main()
