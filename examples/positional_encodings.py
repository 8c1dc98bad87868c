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

It prints both tables, and with matplotlib draws the eigenvectors over their closed forms, and
the cycle's encoding beside the transformer's sinusoidal encoding ``pe.sinusoidal``.

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
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
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
    for m in range(1, 4):
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
    if not args.no_plot:
        try:
            figure = plot(args.length, args.pairs, cycle_enc, path_enc, path_closed, args.out)
        except ImportError:
            print("matplotlib is not installed: no figure (pip install -e '.[plot]')")
        else:
            print(f"figure: {figure}")
    return {"cycle": cycle, "path": path}


if __name__ == "__main__":
    main()
