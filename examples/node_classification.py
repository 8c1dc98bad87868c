"""Semi-supervised node classification on Cora, CiteSeer or PubMed with graph attention.

The defaults reproduce the GAT paper's setup (Veličković et al., ICLR 2018) for the dataset,
Cora unless ``--dataset`` says otherwise: two GraphSelfAttention layers with GAT's additive
score, 8 heads x 8 channels, ELU, dropout 0.6 on inputs, projected values and attention (as in
the authors' reference code), Adam with lr 0.005 and weight decay 5e-4 (PubMed: lr 0.01, weight
decay 1e-3 and 8 averaged output heads), early stopping with patience 100.

Early stopping follows the GAT reference code (``--stop-on loss+acc``): training stops when
neither the validation loss nor the validation accuracy has improved for ``--patience`` epochs,
and the model evaluated on the test set is the one from the last epoch where both were at their
best so far. ``--stop-on acc`` lets the validation accuracy alone decide, the rule the GAT authors
say they used for their CiteSeer result (github.com/PetarV-/GAT, issue 14).

    python examples/node_classification.py                       # GAT on Cora
    python examples/node_classification.py --attention dot       # same model, dot-product score
    python examples/node_classification.py --model transformer --dataset CiteSeer --runs 3
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch_geometric.data import Data
from tqdm.auto import tqdm

from graphattn.datasets import MissingFilesError, load_planetoid
from graphattn.nn import GAT, GraphTransformer

STOP_RULES = ("loss+acc", "acc")  # train_node_classifier's early-stopping rules
# The GAT paper's optimiser and output heads per dataset (Velickovic et al., 2018, section 3.3):
# the defaults of --lr, --weight-decay and --out-heads.
PAPER_SETUPS = {
    "cora": dict(lr=0.005, weight_decay=5e-4, out_heads=1),
    "citeseer": dict(lr=0.005, weight_decay=5e-4, out_heads=1),
    "pubmed": dict(lr=0.01, weight_decay=1e-3, out_heads=8),
}

MODEL_DEFAULTS = {  # --hidden, --heads, --dropout when not given
    "gat": dict(hidden=8, heads=8, dropout=0.6),
    "transformer": dict(hidden=64, heads=4, dropout=0.5),
}


@dataclass
class RunResult:
    """One training run: the selected epoch's accuracies and the per-epoch curves."""

    test_acc: float
    val_acc: float
    best_epoch: int
    epochs: int
    epoch_times: list[float] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    val_accs: list[float] = field(default_factory=list)


def build_model(name: str, data: Data, num_classes: int, *, hidden: int, heads: int,
                out_heads: int = 1, dropout: float, attention: str = "additive",
                layers: int = 2, sinks: bool = False) -> torch.nn.Module:
    """The GAT-style classifier or the GraphTransformer for ``data`` (``sinks``: a learned
    sink logit per head in every attention layer)."""
    if name == "gat":
        return GAT(data.num_features, num_classes, hidden_channels=hidden, heads=heads,
                   out_heads=out_heads, dropout=dropout, attention=attention, sinks=sinks)
    return GraphTransformer(data.num_features, hidden, num_classes, layers, heads,
                            dropout=dropout, attention=attention, sinks=sinks)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Data, mask: torch.Tensor) -> tuple[float, float]:
    """(cross-entropy loss, accuracy) of ``model`` on the nodes in ``mask``, in eval mode."""
    model.eval()
    logits = model(data.x, data.edge_index)[mask]
    loss = F.cross_entropy(logits, data.y[mask]).item()
    correct = int((logits.argmax(dim=-1) == data.y[mask]).sum())
    return loss, correct / logits.size(0)  # exact count ratio: no float32 rounding in the means


def train_node_classifier(model: torch.nn.Module, data: Data, *, lr: float = 0.005,
                          weight_decay: float = 5e-4, epochs: int = 1000, patience: int = 100,
                          stop_on: str = "loss+acc", progress: bool = True,
                          desc: str = "train") -> RunResult:
    """Full-batch training with Adam and one of the GAT authors' early-stopping rules.

    ``stop_on="loss+acc"`` (their reference code): an epoch counts as progress when the
    validation loss or the validation accuracy is at its best so far, and the model kept is the
    one from the last epoch where both were. ``stop_on="acc"`` (what they used for their CiteSeer
    result): progress and the model kept are decided by the validation accuracy alone. Ties
    count as progress and keep the later model. Training stops after ``patience`` epochs without
    progress, or with a warning when the training loss is not finite (``epochs`` then counts
    the epochs completed). When no epoch is kept, the untrained model is: ``best_epoch`` 0, with
    its validation accuracy measured.
    """
    if stop_on not in STOP_RULES:
        raise ValueError(f"stop_on must be one of {STOP_RULES}, got {stop_on!r}")
    for value, what in ((epochs, "epochs"), (patience, "patience")):
        if value < 1:
            raise ValueError(f"{what} must be at least 1, got {value}")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    best_acc, best_loss = 0.0, float("inf")
    chosen_state, chosen = copy.deepcopy(model.state_dict()), (0, 0.0)
    result = RunResult(test_acc=0.0, val_acc=0.0, best_epoch=0, epochs=0)
    bad_epochs = 0
    bar = tqdm(range(1, epochs + 1), desc=desc, disable=not progress, leave=False)
    for epoch in bar:
        start = time.perf_counter()
        model.train()
        optimizer.zero_grad()
        logits = model(data.x, data.edge_index)
        loss = F.cross_entropy(logits[data.train_mask], data.y[data.train_mask])
        if not math.isfinite(train_loss := loss.item()):
            warnings.warn(f"{desc}: the training loss is {train_loss} at epoch {epoch}: "
                          f"training diverged (a smaller learning rate may help); stopped, "
                          f"keeping the model of epoch {chosen[0]}", RuntimeWarning,
                          stacklevel=2)
            break
        loss.backward()
        optimizer.step()
        if data.x.is_cuda:
            torch.cuda.synchronize(data.x.device)  # the data's GPU, not the current one
        result.epoch_times.append(time.perf_counter() - start)

        val_loss, val_acc = evaluate(model, data, data.val_mask)
        result.train_loss.append(train_loss)
        result.val_loss.append(val_loss)
        result.val_accs.append(val_acc)
        result.epochs = epoch
        acc_up, loss_down = val_acc >= best_acc, val_loss <= best_loss
        progress_made = acc_up if stop_on == "acc" else acc_up or loss_down
        if progress_made:
            if acc_up and (loss_down or stop_on == "acc"):
                chosen_state, chosen = copy.deepcopy(model.state_dict()), (epoch, val_acc)
            best_acc, best_loss = max(val_acc, best_acc), min(val_loss, best_loss)
            bad_epochs = 0
        else:
            bad_epochs += 1
            if bad_epochs == patience:
                break
        # the last epoch the run reaches unless it makes progress again: an ETA that means
        # something where --epochs is a mere bound (100000 by default)
        bar.total = min(epochs, epoch + patience - bad_epochs)
        bar.set_postfix(loss=f"{train_loss:.3f}", val_loss=f"{val_loss:.3f}",
                        val_acc=f"{val_acc:.3f}")
    bar.close()
    model.load_state_dict(chosen_state)
    if chosen[0] == 0:  # no epoch was kept: the untrained model's accuracy, measured
        chosen = (0, evaluate(model, data, data.val_mask)[1])
    result.best_epoch, result.val_acc = chosen
    result.test_acc = evaluate(model, data, data.test_mask)[1]
    return result


def summarise(results: list[RunResult]) -> dict[str, float]:
    """Mean and std of test accuracy (in %; std NaN for one run), median epoch time (ms; NaN
    when no epoch completed), mean epochs."""
    accs = [100 * r.test_acc for r in results]
    times = [t for r in results for t in r.epoch_times]
    return {
        "test_mean": statistics.mean(accs),
        "test_std": statistics.stdev(accs) if len(accs) > 1 else math.nan,
        "val_mean": statistics.mean(100 * r.val_acc for r in results),
        "epoch_ms": 1000 * statistics.median(times) if times else math.nan,
        "epochs": statistics.mean(r.epochs for r in results),
        "best_epoch": statistics.mean(r.best_epoch for r in results),
    }


def format_accuracy(s: dict[str, float]) -> str:
    """``"83.3 +- 1.1"``, or ``"83.3 (one run: no std)"``."""
    if math.isnan(s["test_std"]):
        return f"{s['test_mean']:.1f} (one run: no std)"
    return f"{s['test_mean']:.1f} +- {s['test_std']:.1f}"


def plot_curves(results: list[RunResult], path: Path, title: str) -> bool:
    """Loss and validation accuracy curves of every run as a PNG; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(results):
        epochs = range(1, r.epochs + 1)
        label = "_" if i else ""
        ax_loss.plot(epochs, r.train_loss, color="tab:blue", alpha=0.6, lw=1, label=f"{label}train")
        ax_loss.plot(epochs, r.val_loss, color="tab:orange", alpha=0.6, lw=1,
                     label=f"{label}validation")
        ax_acc.plot(epochs, [100 * a for a in r.val_accs], color="tab:orange", alpha=0.6, lw=1)
        ax_acc.axvline(r.best_epoch, color="grey", alpha=0.3, lw=1)
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
    ax_loss.legend()
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)",
               title="validation accuracy (grey: selected epoch)")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="Cora", help="Cora, CiteSeer or PubMed")
    parser.add_argument("--model", default="gat", choices=["gat", "transformer"])
    parser.add_argument("--attention", default=None, choices=["additive", "gatv2", "dot"],
                        help="score function (default: additive for gat, dot for transformer)")
    parser.add_argument("--epochs", type=int, default=100_000,
                        help="maximum epochs per run (early stopping ends runs long before)")
    parser.add_argument("--runs", type=int, default=3, help="runs with seeds seed, seed+1, ...")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: the GAT paper's, 0.01 on PubMed, else "
                             "0.005)")
    parser.add_argument("--weight-decay", type=float, default=None,
                        help="L2 weight decay (default: the GAT paper's, 1e-3 on PubMed, else "
                             "5e-4)")
    parser.add_argument("--patience", type=int, default=100,
                        help="stop after this many epochs without progress (see --stop-on)")
    parser.add_argument("--stop-on", default="loss+acc", choices=list(STOP_RULES),
                        help="early-stopping rule: progress is a better validation loss or "
                             "accuracy (loss+acc, the GAT reference code's) or a better "
                             "accuracy (acc, the GAT authors' rule on CiteSeer)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=None,
                        help="channels per head (gat) or model width (transformer)")
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--out-heads", type=int, default=None,
                        help="averaged output heads of gat (default: the GAT paper's, 8 on "
                             "PubMed, else 1)")
    parser.add_argument("--layers", type=int, default=None,
                        help="transformer blocks (default: 2)")
    parser.add_argument("--dropout", type=float, default=None)
    parser.add_argument("--sinks", action="store_true",
                        help="a learned sink logit per head in every attention layer: one more "
                             "score of each node's softmax whose value is 0")
    parser.add_argument("--root", default=None, help="data root (default: see datasets/README.md)")
    parser.add_argument("--out", default="out/node_classification",
                        help="folder for the training-curve PNG")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice; on a machine shared "
                             "with other work, 1 avoids stalls between threads)")
    args = parser.parse_args(argv)
    try:
        torch.device(args.device)
    except RuntimeError as error:
        parser.error(f"--device must name a torch device (cpu, cuda, cuda:1, ...), got "
                     f"{args.device!r}: {error}")
    # an option of the other model would be ignored: refused instead
    for flag, key, model in (("--layers", "layers", "transformer"),
                             ("--out-heads", "out_heads", "gat")):
        if getattr(args, key) is not None and args.model != model:
            parser.error(f"{flag} is an option of --model {model}, got --model {args.model}")
    if args.layers is None:
        args.layers = 2
    for key, value in MODEL_DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.attention is None:
        args.attention = "additive" if args.model == "gat" else "dot"
    for key, value in PAPER_SETUPS.get(args.dataset.lower(), PAPER_SETUPS["cora"]).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("epochs", "runs", "patience", "hidden", "heads", "out_heads", "layers"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be at least 1, got "
                         f"{getattr(args, key)}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}, but torch {torch.__version__} sees no CUDA "
                     f"device; use --device cpu")
    try:  # a device torch knows but this machine lacks (mps, xpu, cuda:7)
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError, NotImplementedError) as error:
        parser.error(f"--device {args.device} is not usable here: "
                     f"{str(error).splitlines()[0].split('. ')[0]}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    for key in ("lr", "weight_decay"):
        if not 0 <= getattr(args, key) < float("inf"):
            parser.error(f"--{key.replace('_', '-')} must be a finite number >= 0, got "
                         f"{getattr(args, key)}")
    if args.model == "transformer" and args.hidden % args.heads != 0:
        parser.error(f"--hidden must be divisible by --heads for the transformer, got "
                     f"--hidden {args.hidden} and --heads {args.heads}")
    out = Path(args.out)
    if out.exists() and not out.is_dir() or any(p.exists() and not p.is_dir()
                                                 for p in out.parents):
        parser.error(f"--out must be a folder (it gets the training-curve PNG), got "
                     f"{args.out!r}, a file")  # refused before any training
    return args


def main(argv: list[str] | None = None) -> list[RunResult]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        data = load_planetoid(args.dataset, args.root)
    except MissingFilesError as error:  # the loader's advice, in this script's terms
        raise SystemExit(f"error: {error}\nHere: --root names the data root (root=...); node "
                         f"classification needs the features, so structure_only does not "
                         f"apply.") from None
    except (FileNotFoundError, ValueError) as error:  # corrupt or unknown: say why
        raise SystemExit(f"error: {error}") from None
    data = data.to(args.device)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    data.x = data.x.to_sparse_csr()  # ~1% nonzeros: sparse input layers, same results
    num_classes = int(data.y.max()) + 1
    print(f"{args.dataset}: {data.num_nodes} nodes, {data.num_edges} edges, "
          f"{data.num_features} features, {num_classes} classes; model {args.model} "
          f"({args.attention} attention{', sinks' if args.sinks else ''}) on {args.device}; "
          f"early stopping on "
          f"{args.stop_on}, patience {args.patience}")
    results = []
    for run in range(args.runs):
        torch.manual_seed(args.seed + run)
        model = build_model(args.model, data, num_classes, hidden=args.hidden, heads=args.heads,
                            out_heads=args.out_heads, dropout=args.dropout,
                            attention=args.attention, layers=args.layers,
                            sinks=args.sinks).to(args.device)
        r = train_node_classifier(model, data, lr=args.lr, weight_decay=args.weight_decay,
                                  epochs=args.epochs, patience=args.patience,
                                  stop_on=args.stop_on, progress=not args.no_progress,
                                  desc=f"run {run + 1}/{args.runs}")
        results.append(r)
        print(f"run {run + 1:2d} (seed {args.seed + run}): test {100 * r.test_acc:.1f}%  "
              f"val {100 * r.val_acc:.1f}%  selected epoch {r.best_epoch}/{r.epochs}")

    s = summarise(results)
    print(f"\n| dataset | model | attention | runs | test accuracy (%) | val accuracy (%) "
          f"| epochs | median epoch (ms) |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n"
          f"| {args.dataset} | {args.model} | {args.attention} | {args.runs} "
          f"| {format_accuracy(s)} | {s['val_mean']:.1f} "
          f"| {s['epochs']:.0f} | {s['epoch_ms']:.1f} |")
    png = Path(args.out) / f"{args.dataset.lower()}_{args.model}_{args.attention}.png"
    title = f"{args.dataset}, {args.model} ({args.attention}), {args.runs} run(s)"
    if plot_curves(results, png, title):
        print(f"training curves: {png}")
    else:
        print("matplotlib is not installed: no training-curve plot (pip install matplotlib)")
    return results


if __name__ == "__main__":
    main()
