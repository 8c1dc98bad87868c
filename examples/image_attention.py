r"""Attention over the pixels of images: one transformer, four graphs, four kinds of positions.

An image is a grid of pixels, and attention over it is edge attention on a graph of pixels.
This script trains the same model, :class:`graphattn.nn.GraphTransformer` (two pre-norm blocks,
4 heads, width 64), to classify the 8x8 handwritten digits that ship with scikit-learn
(``sklearn.datasets.load_digits``: 1,797 images, 10 classes), on four graphs over the 64
pixels:

- ``grid0``: each pixel attends to itself only, no mixing between pixels: the model is a
  per-pixel MLP followed by the mean over pixels (the baseline that shows what attention adds);
- ``grid1``: the 3x3 neighbourhood of each pixel (``graphs.grid_graph(8, 8, radius=1)``), the
  receptive field of a convolution;
- ``grid2``: the 5x5 neighbourhood (``radius=2``);
- ``complete``: every pixel attends to every pixel: a vision transformer whose tokens are
  pixels (``graphs.complete_graph(64)``, what ``torch.nn.MultiheadAttention`` computes);
- ``complete+offset``: the complete graph with the positions given by a learned bias of each
  pair's (rows, columns) offset instead of the eigenvectors (``pe.relative_offsets``,
  ``pe.OffsetBias``: Swin's relative position bias, shared by the blocks, trained at
  ``--table-lr`` times the learning rate without weight decay); ``+offset`` joins any graph;
- ``complete+rope``: the complete graph with 2-D rotary position embeddings instead of the
  eigenvectors: every block turns its queries and keys by the pixel's row (half of each
  head's channels) and column (the other half), so that each score depends on the pair's
  offset (``pe.RotaryPE(C, axes=2, base=--rope-base)`` with ``pe.grid_positions``); nothing
  is learned for the positions; ``+rope`` joins any graph;
- ``complete+laprope``: the same rotations by coordinates that come from the graph instead of
  the image: the two lowest Laplacian eigenvectors of the radius-1 pixel grid
  (``pe.laplacian_pe``, each rescaled to span 0 .. 7 as a row index does), the coordinates a
  graph without any (a mesh, a molecule) can give RoPE; ``+laprope`` joins any graph.

A pixel's input is its intensity (0 to 1) and the 8 lowest Laplacian eigenvectors of the
radius-1 pixel grid (``pe.laplacian_pe``), the grid's 2-D analogue of sinusoidal positions,
scaled by 8 from unit norm to unit root-mean-square (unscaled, entries of about 1/8 leave the
model near chance for many epochs).
The image's logits are the mean of its pixels' outputs. A batch of B images is one graph of
64 B nodes, ``graphs.repeat_graph(edge_index, 64, B)``: no edge crosses from one image to
another.

The split is fixed (60/20/20 train/validation/test, stratified, ``--split-seed``); each run
draws new initial weights (seeds ``--seed``, ``--seed + 1``, ...). A run trains ``--epochs``
epochs with AdamW and reports the test accuracy at the epoch of best validation accuracy (the
first such epoch). The script prints one line per run, then per graph the scores an image
computes (its edges E against 64^2 = 4096 for dense attention), the mean and standard
deviation of the test accuracy, and the median time of a training epoch. With matplotlib it
draws the mean validation curves and, for one test digit, the first layer's attention
weights (mean over heads) of one pixel on each graph (``--no-plot``: none).

Needs scikit-learn for the images (``pip install scikit-learn``). Usage::

    python examples/image_attention.py --out out/image_attention   # 3 runs, ~11 min on 2 cores
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from graphattn import graphs, pe
from graphattn.nn import GraphTransformer

SIDE = 8  # the digits are 8x8 pixels
PIXELS = SIDE * SIDE
CLASSES = 10
GRAPHS = ("grid0", "grid1", "grid2", "complete", "complete+offset", "complete+rope",
          "complete+laprope")


def uses_offsets(name: str) -> bool:
    """Whether the run named ``name`` gives positions by a learned bias of each pixel pair's
    offset (its ``+offset`` part) instead of Laplacian eigenvectors."""
    return name.endswith("+offset")


def uses_rope(name: str) -> bool:
    """Whether the run named ``name`` gives positions by 2-D rotary embeddings of the queries
    and keys (its ``+rope`` or ``+laprope`` part) instead of Laplacian eigenvectors."""
    return name.endswith("+rope") or name.endswith("+laprope")


def laplacian_coordinates(k: int = 2) -> Tensor:
    """The ``k`` lowest nontrivial Laplacian eigenvectors of the radius-1 pixel grid as
    coordinates ``[64, k]``, each rescaled to span 0 .. 7 as a row or column index does."""
    vectors = pe.laplacian_pe(graphs.grid_graph(SIDE, SIDE, radius=1), PIXELS, k)
    vectors = vectors.to(torch.float64)
    low, high = vectors.min(dim=0).values, vectors.max(dim=0).values
    return ((vectors - low) / (high - low) * (SIDE - 1)).float()  # (64, k)


def pixel_graph(name: str) -> Tensor:
    """The edges j -> i among the 64 pixels of one image (pixel ``(r, c)`` is ``r * 8 + c``);
    a ``+offset`` or ``+rope`` suffix changes the positions, not the graph
    (:func:`uses_offsets`, :func:`uses_rope`)."""
    name, *suffixes = name.split("+")
    if len(suffixes) > 1 or suffixes and suffixes[0] not in ("offset", "rope", "laprope"):
        raise ValueError(f"graph must be one of {', '.join(GRAPHS)} (or gridR for a radius R), "
                         f"with at most one of +offset, +rope or +laprope, got "
                         f"{'+'.join([name, *suffixes])!r}")
    if name == "complete":
        return graphs.complete_graph(PIXELS)
    if name.startswith("grid") and name[4:].isdigit():
        return graphs.grid_graph(SIDE, SIDE, radius=int(name[4:]))
    raise ValueError(f"graph must be one of {', '.join(GRAPHS)} (or gridR for a radius R, "
                     f"either with +offset, +rope or +laprope), "
                     f"got {name!r}")


@dataclass
class Digits:
    """Images as pixel features, split into train, validation and test."""

    x: Tensor  # (n_images, 64) intensities in [0, 1]
    y: Tensor  # (n_images,) classes 0..9
    splits: dict[str, Tensor]  # image ids of "train", "val", "test"


def load_digits(split_seed: int = 0) -> Digits:
    """scikit-learn's 8x8 digits, split 60/20/20 per class (the same split for every run)."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise SystemExit("the digits come with scikit-learn: pip install scikit-learn") from None
    data = sklearn_digits()
    x = torch.tensor(data.images, dtype=torch.float32).reshape(-1, PIXELS) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    g = torch.Generator().manual_seed(split_seed)
    splits: dict[str, list[Tensor]] = {"train": [], "val": [], "test": []}
    for c in range(CLASSES):
        ids = (y == c).nonzero().flatten()
        ids = ids[torch.randperm(ids.numel(), generator=g)]
        n_train, n_val = round(0.6 * ids.numel()), round(0.2 * ids.numel())
        splits["train"].append(ids[:n_train])
        splits["val"].append(ids[n_train:n_train + n_val])
        splits["test"].append(ids[n_train + n_val:])
    return Digits(x, y, {k: torch.cat(v).sort().values for k, v in splits.items()})


class PixelClassifier(torch.nn.Module):
    """A GraphTransformer over the pixels of each image; logits = mean of the pixel outputs.

    The pixels' positions enter as the encodings ``positions``, or with ``offsets=True`` as a
    learned bias of each edge's (rows, columns) offset that every block adds to its scores
    (``pe.OffsetBias``: Swin's relative position bias), in which case the graph must hold each
    pixel's edge to itself (the blocks add no self-loop then). With ``rope_base`` set, as 2-D
    rotary embeddings of every block's queries and keys (``pe.RotaryPE(..., axes=2)``) by the
    pixels' ``rope_positions`` ``[64, 2]`` (default: their rows and columns,
    ``pe.grid_positions``).
    """

    def __init__(self, edge_index: Tensor, positions: Tensor, *, hidden: int, heads: int,
                 layers: int, dropout: float, offsets: bool = False,
                 rope_base: float | None = None,
                 rope_positions: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("edge_index", edge_index, persistent=False)  # (2, E), one image
        self.register_buffer("positions", positions, persistent=False)  # (64, P)
        self.spatial = pe.OffsetBias(heads, radius=SIDE - 1) if offsets else None
        self.register_buffer("offsets", pe.relative_offsets(pe.grid_positions(SIDE, SIDE),
                                                            edge_index),
                             persistent=False)  # (E, 2)
        if offsets and rope_base is not None:
            raise ValueError("a model takes one kind of relative positions: offsets or rope")
        self.rope = rope_base is not None
        if rope_positions is None:
            rope_positions = pe.grid_positions(SIDE, SIDE)  # (64, 2): row, column
        self.register_buffer("pixel_positions", rope_positions, persistent=False)  # (64, 2)
        rotary = pe.RotaryPE(hidden // heads, axes=2, base=rope_base) if self.rope else None
        self.body = GraphTransformer(1, hidden, CLASSES, num_layers=layers, heads=heads,
                                     pe_channels=0 if offsets or self.rope
                                     else positions.size(1),
                                     dropout=dropout, attention_dropout=0.0,
                                     add_self_loops=not offsets, rotary=rotary)
        self._batch_graphs: dict[int, Tensor] = {}

    def encode(self, images: Tensor) -> tuple[Tensor, Tensor, dict]:
        """The pixels of ``images`` as nodes ``(B * 64, 1)``, their graph and the positions'
        keyword arguments of the body (``pe``, ``attn_bias`` or ``pos``)."""
        B = images.size(0)
        x = images.reshape(B * PIXELS, 1)  # (B * 64, 1): one node per pixel
        if self.rope:
            return x, self.batch_graph(B), {"pos": self.pixel_positions.repeat(B, 1)}
        if self.spatial is not None:
            return x, self.batch_graph(B), {"attn_bias": self.spatial(self.offsets).repeat(B, 1)}
        return x, self.batch_graph(B), {"pe": self.positions.repeat(B, 1)}  # pe (B * 64, P)

    def batch_graph(self, batch_size: int) -> Tensor:
        """The pixel graph repeated for ``batch_size`` images, built once per size."""
        if batch_size not in self._batch_graphs:
            self._batch_graphs[batch_size] = graphs.repeat_graph(self.edge_index, PIXELS,
                                                                 batch_size)
        return self._batch_graphs[batch_size]

    def forward(self, images: Tensor) -> Tensor:
        x, edge_index, positions = self.encode(images)
        out = self.body(x, edge_index, **positions)  # (B * 64, 10)
        return out.view(images.size(0), PIXELS, CLASSES).mean(dim=1)  # (B, 10)

    @torch.no_grad()
    def first_layer_attention(self, image: Tensor) -> Tensor:
        """The first block's attention weights of one image, mean over heads: ``[64, 64]``,
        row i the weights pixel i gives to each pixel (zero off the graph)."""
        was_training = self.training
        self.eval()
        x, edge_index, positions = self.encode(image.reshape(1, PIXELS))
        _, blocks = self.body(x, edge_index, return_attention_weights=True, **positions)
        self.train(was_training)
        edge_index, alpha = blocks[0]  # (2, E), (E, H): the first block's
        weights = torch.zeros(PIXELS, PIXELS, device=alpha.device)
        weights.index_put_((edge_index[1], edge_index[0]), alpha.mean(dim=1), accumulate=True)
        return weights.cpu()


@dataclass
class RunResult:
    graph: str
    seed: int
    test_acc: float
    val_acc: float
    best_epoch: int
    epoch_seconds: list[float]
    val_curve: list[float] = field(default_factory=list)


@torch.no_grad()
def accuracy(model: torch.nn.Module, digits: Digits, split: str, batch_size: int) -> float:
    model.eval()
    ids = digits.splits[split]
    correct = 0
    for start in range(0, ids.numel(), batch_size):
        batch = ids[start:start + batch_size]
        correct += int((model(digits.x[batch]).argmax(dim=1) == digits.y[batch]).sum())
    return correct / ids.numel()


def parameter_groups(model: PixelClassifier, lr: float, table_lr: float) -> list[dict]:
    """AdamW's parameter groups: the offset bias table, if the model has one, at ``table_lr``
    times ``lr`` and without weight decay (as Swin trains its table); the rest at ``lr``."""
    if model.spatial is None:
        return [{"params": list(model.parameters())}]
    table = model.spatial.weight
    rest = [p for p in model.parameters() if p is not table]
    return [{"params": rest}, {"params": [table], "lr": lr * table_lr, "weight_decay": 0.0}]


def train(model: PixelClassifier, digits: Digits, *, epochs: int, batch_size: int, lr: float,
          weight_decay: float, seed: int, desc: str, progress: bool,
          table_lr: float = 1.0) -> RunResult:
    """Train with AdamW (the offset bias table at ``table_lr`` times ``lr``, see
    :func:`parameter_groups`); the test accuracy is read at the first epoch of best
    validation accuracy."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(parameter_groups(model, lr, table_lr), lr=lr,
                                  weight_decay=weight_decay)
    train_ids = digits.splits["train"]
    result = RunResult(desc.split()[0], seed, 0.0, -1.0, 0, [])
    bar = tqdm(range(1, epochs + 1), desc=desc, disable=not progress, leave=False)
    for epoch in bar:
        model.train()
        start = time.perf_counter()
        order = train_ids[torch.randperm(train_ids.numel(), generator=generator)]
        for first in range(0, order.numel(), batch_size):
            batch = order[first:first + batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model(digits.x[batch]), digits.y[batch]).backward()
            optimizer.step()
        if digits.x.is_cuda:
            torch.cuda.synchronize(digits.x.device)
        result.epoch_seconds.append(time.perf_counter() - start)
        val = accuracy(model, digits, "val", batch_size)
        result.val_curve.append(val)
        if val > result.val_acc:
            result.val_acc, result.best_epoch = val, epoch
            result.test_acc = accuracy(model, digits, "test", batch_size)
        bar.set_postfix(val=f"{val:.3f}", test=f"{result.test_acc:.3f}")
    return result


def summarise(results: list[RunResult], edges: dict[str, int]) -> list[dict]:
    rows = []
    for name in edges:
        runs = [r for r in results if r.graph == name]
        tests = [r.test_acc for r in runs]
        rows.append({
            "graph": name, "scores per image": edges[name],
            "of dense": edges[name] / PIXELS ** 2,
            "test mean": statistics.mean(tests),
            "test std": statistics.stdev(tests) if len(tests) > 1 else 0.0,
            "val mean": statistics.mean(r.val_acc for r in runs),
            "epoch ms": 1e3 * statistics.median(t for r in runs for t in r.epoch_seconds),
        })
    return rows


def format_table(rows: list[dict], runs: int) -> str:
    lines = [f"| graph | scores per image | of dense | test accuracy ({runs} runs) | "
             f"validation | epoch ms |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['graph']} | {r['scores per image']} | {r['of dense']:.1%} | "
                     f"{100 * r['test mean']:.1f} +- {100 * r['test std']:.1f}% | "
                     f"{100 * r['val mean']:.1f}% | {r['epoch ms']:.0f} |")
    return "\n".join(lines)


def plot(results: list[RunResult], models: dict[str, PixelClassifier], digits: Digits,
         path: Path, pixel: tuple[int, int]) -> bool:
    """Validation curves, and one pixel's first-layer attention on each graph."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure (pip install -e '.[plot]')")
        return False
    names = list(models)
    fig = plt.figure(figsize=(3.0 * (len(names) + 1), 6.4), layout="constrained")
    grid = fig.add_gridspec(2, len(names) + 1)
    ax = fig.add_subplot(grid[0, :])
    for name in names:
        curves = torch.tensor([r.val_curve for r in results if r.graph == name])
        ax.plot(range(1, curves.size(1) + 1), (100 * curves.mean(dim=0)).numpy(), label=name)
    ax.set(xlabel="epoch", ylabel="validation accuracy (%)",
           title=f"8x8 digits: the same transformer over {len(names)} pixel "
                 f"graph{'s' * (len(names) != 1)} (mean of runs)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    image_id = int(digits.splits["test"][0])
    image = digits.x[image_id]
    node = pixel[0] * SIDE + pixel[1]
    ax = fig.add_subplot(grid[1, 0])
    ax.imshow(image.view(SIDE, SIDE).cpu().numpy(), cmap="gray_r")
    ax.plot(pixel[1], pixel[0], "r+", markersize=14, markeredgewidth=2)
    ax.set(title=f"test digit {int(digits.y[image_id])}, pixel {pixel}", xticks=[], yticks=[])
    for col, name in enumerate(names, start=1):
        weights = models[name].first_layer_attention(image)[node].view(SIDE, SIDE).numpy()
        ax = fig.add_subplot(grid[1, col])
        ax.imshow(weights, cmap="viridis", vmin=0)
        ax.plot(pixel[1], pixel[0], "r+", markersize=14, markeredgewidth=2)
        ax.set(title=f"{name}: layer-1 attention", xticks=[], yticks=[])
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def check_training_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, by name, a device torch cannot use and rates outside their ranges."""
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device must name a torch device (cpu, cuda, cuda:1, ...), got "
                     f"{args.device!r}: {error}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}, but torch {torch.__version__} sees no CUDA "
                     f"device; use --device cpu")
    try:  # a device torch knows but this machine lacks (mps, xpu, cuda:7)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, NotImplementedError) as error:
        parser.error(f"--device {args.device} is not usable here: "
                     f"{str(error).splitlines()[0].split('. ')[0]}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not (args.weight_decay >= 0 and math.isfinite(args.weight_decay)):
        parser.error(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    if not (args.table_lr > 0 and math.isfinite(args.table_lr)):
        parser.error(f"--table-lr must be a finite number > 0, got {args.table_lr}")
    if not (args.rope_base > 0 and math.isfinite(args.rope_base)):
        parser.error(f"--rope-base must be a positive number, got {args.rope_base}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", default=",".join(GRAPHS),
                        help="comma-separated pixel graphs: grid0, grid1, grid2 (gridR: radius "
                             "R neighbourhood), complete; +offset for a learned bias of each "
                             "pixel offset, +rope for 2-D rotary embeddings (+laprope: by "
                             "Laplacian eigenvector coordinates), in place of the Laplacian "
                             "positions")
    parser.add_argument("--epochs", type=positive_int, default=40)
    parser.add_argument("--runs", type=positive_int, default=3,
                        help="runs per graph, seeds seed, seed+1, ...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-2)
    parser.add_argument("--table-lr", type=float, default=10.0,
                        help="learning rate of the +offset runs' bias table, a multiple of "
                             "--lr, without weight decay (default: %(default)s)")
    parser.add_argument("--rope-base", type=float, default=100.0,
                        help="frequency base of the +rope runs' rotary embeddings (8 positions "
                             "a side: a smaller base than a sequence's 10000 turns more of the "
                             "planes measurably)")
    parser.add_argument("--hidden", type=positive_int, default=64)
    parser.add_argument("--heads", type=positive_int, default=4)
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--pe", type=positive_int, default=8,
                        help="Laplacian eigenvectors of the pixel grid per pixel")
    parser.add_argument("--pixel", type=int, nargs=2, default=(3, 4), metavar=("ROW", "COL"),
                        help="the pixel whose attention the figure shows")
    parser.add_argument("--out", default="out/image_attention",
                        help="folder of the figure (default: out/image_attention)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    check_training_args(parser, args)
    args.graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    if not args.graphs:
        parser.error("--graphs must name at least one graph, got none")
    if len(set(args.graphs)) < len(args.graphs):
        parser.error(f"--graphs must name each graph once, got {','.join(args.graphs)}")
    for name in args.graphs:
        try:
            pixel_graph(name)
        except ValueError as error:
            parser.error(f"--graphs: {error}")
    if args.hidden % args.heads != 0:
        parser.error(f"--hidden must be divisible by --heads, got {args.hidden} and "
                     f"{args.heads}")
    rope = [name for name in args.graphs if uses_rope(name)]
    if rope and (args.hidden // args.heads) % 4:
        parser.error(f"--hidden / --heads = {args.hidden // args.heads} channels per head, but "
                     f"the 2-D rotary embedding of {', '.join(rope)} turns them in planes of "
                     f"4 (2 per axis): give a multiple of 4")
    out = Path(args.out)
    if any(p.exists() and not p.is_dir() for p in (out, *out.parents)):
        parser.error(f"--out must be a folder (it gets the figure), got {args.out!r}, a file")
    if not all(0 <= p < SIDE for p in args.pixel):
        parser.error(f"--pixel must be a row and a column in 0..{SIDE - 1}, got {args.pixel}")
    if args.pe >= PIXELS:
        parser.error(f"--pe must be below the {PIXELS} pixels, got {args.pe}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    digits = load_digits(args.split_seed)
    digits.x, digits.y = digits.x.to(args.device), digits.y.to(args.device)
    sizes = {k: v.numel() for k, v in digits.splits.items()}
    print(f"digits: {digits.x.size(0)} images of {SIDE}x{SIDE} pixels, split {sizes}")
    positions = pe.laplacian_pe(graphs.grid_graph(SIDE, SIDE, radius=1), PIXELS, args.pe)
    positions = positions.float().to(args.device) * PIXELS ** 0.5  # (64, P): unit RMS
    results: list[RunResult] = []
    models: dict[str, PixelClassifier] = {}
    edges = {}
    for name in args.graphs:
        edge_index = pixel_graph(name)
        edges[name] = edge_index.size(1)
        for run in range(args.runs):
            seed = args.seed + run
            torch.manual_seed(seed)
            model = PixelClassifier(edge_index, positions, hidden=args.hidden, heads=args.heads,
                                    layers=args.layers, dropout=args.dropout,
                                    offsets=uses_offsets(name),
                                    rope_base=args.rope_base if uses_rope(name) else None,
                                    rope_positions=(laplacian_coordinates()
                                                    if name.endswith("+laprope") else None),
                                    ).to(args.device)
            result = train(model, digits, epochs=args.epochs, batch_size=args.batch_size,
                           lr=args.lr, weight_decay=args.weight_decay, seed=seed,
                           desc=f"{name} run {run + 1}/{args.runs}",
                           progress=not args.no_progress, table_lr=args.table_lr)
            print(f"{name:>8} run {run + 1}: test {100 * result.test_acc:.1f}% at epoch "
                  f"{result.best_epoch} (validation {100 * result.val_acc:.1f}%), "
                  f"{1e3 * statistics.median(result.epoch_seconds):.0f} ms per epoch")
            results.append(result)
            models.setdefault(name, model)
    rows = summarise(results, edges)
    print()
    print(format_table(rows, args.runs))
    figure = None
    if not args.no_plot:
        path = Path(args.out) / "image_attention.png"
        if plot(results, models, digits, path, tuple(args.pixel)):
            figure = path
            print(f"figure: {path}")
    return {"rows": rows, "results": results, "figure": figure}


if __name__ == "__main__":
    main()
