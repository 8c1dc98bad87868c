"""Validation accuracy of graphattn's GAT over a small hyperparameter grid; test nodes never read.

The search behind the hyperparameters of ``benchmarks/citation_accuracy.py``: every setting of
the grid trains ``graphattn.nn.GAT`` (additive score) under the same protocol, on seeds disjoint
from the reported ones (10..19 by default; the accuracy table uses 0..9), and is judged by mean
validation accuracy alone. The final evaluation of each run is on the validation nodes too, so
no test label is ever looked at.

    python benchmarks/citation_validation_grid.py --jobs 2               # CiteSeer, 8 settings
    python benchmarks/citation_validation_grid.py --datasets Cora CiteSeer --jobs 2

Writes benchmarks/results/citation_validation_grid.md.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import shlex
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch_geometric

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "examples")]
from _machine import cpu_name  # noqa: E402
from citation_accuracy import SETUPS  # noqa: E402
from node_classification import train_node_classifier  # noqa: E402

from graphattn.datasets import ChecksumError, MissingFilesError, load_planetoid  # noqa: E402
from graphattn.nn import GAT  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
ACCURACY_SEEDS = 10  # citation_accuracy.py's default seeds, 0..9
ADOPT_STANDARD_ERRORS = 2  # the lead on validation a setting needs to replace the paper's

# (weight decay, learning rate, dropout, channels per hidden head); the first is the GAT paper's.
GRID = [(5e-4, 0.005, 0.6, 8), (1e-3, 0.005, 0.6, 8), (2e-3, 0.005, 0.6, 8),
        (5e-4, 0.01, 0.6, 8), (1e-3, 0.01, 0.6, 8), (5e-4, 0.005, 0.7, 8),
        (1e-3, 0.005, 0.7, 8), (5e-4, 0.005, 0.6, 16)]


def run(job: tuple) -> tuple:
    """Train one setting with one seed; returns (job, validation accuracy, selected epoch)."""
    dataset, setting, seed, root = job
    weight_decay, lr, dropout, hidden = setting
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
    data = load_planetoid(dataset, root, download=False)
    data.x = data.x.to_sparse_csr()
    data.test_mask = data.val_mask  # the run's final evaluation reads validation labels only
    torch.manual_seed(seed)
    model = GAT(data.num_features, int(data.y.max()) + 1, hidden_channels=hidden, heads=8,
                out_heads=SETUPS[dataset]["out_heads"], dropout=dropout)
    result = train_node_classifier(model, data, lr=lr, weight_decay=weight_decay,
                                   epochs=100_000, patience=100, progress=False,
                                   desc=f"{dataset} {setting} seed {seed}")
    return job, 100 * result.val_acc, result.best_epoch


def lead_in_standard_errors(best: float, paper_accs: list[float]) -> float:
    """How far the mean ``best`` is ahead of the mean of the paper setting's accuracies, in
    standard errors of that mean (runs all alike: any lead is infinitely many, none is 0)."""
    gap = best - statistics.mean(paper_accs)
    error = statistics.stdev(paper_accs) / len(paper_accs) ** 0.5
    return gap / error if error > 0 else math.inf if gap > 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["CiteSeer"], choices=["Cora", "CiteSeer"],
                        help="the grid's first setting is the GAT paper's for these two (PubMed's "
                             "is lr 0.01, weight decay 1e-3)")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=10, help="first seed")
    parser.add_argument("--jobs", type=int, default=1, help="parallel processes (1 thread each)")
    parser.add_argument("--root", default=None, help="data root")
    args = parser.parse_args()
    if args.seeds < 2:
        parser.error(f"--seeds must be at least 2 (a standard deviation), got {args.seeds}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    for dataset in args.datasets:  # here, not in a worker after the other datasets' runs
        try:
            load_planetoid(dataset, args.root, download=False)
        except (MissingFilesError, ChecksumError) as err:
            parser.error(str(err))
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    print(command)
    print(f"torch {torch.__version__}, torch_geometric {torch_geometric.__version__}, "
          f"CPU {cpu_name()}, {os.cpu_count()} cores, {args.jobs} job(s) x 1 thread")
    jobs = [(dataset, setting, seed, args.root) for dataset in args.datasets
            for setting in GRID for seed in range(args.seed, args.seed + args.seeds)]
    start = time.perf_counter()
    val: dict[tuple, list[float]] = {}
    epochs: dict[tuple, list[int]] = {}
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for (dataset, setting, seed, _), acc, epoch in pool.map(run, jobs):
            val.setdefault((dataset, setting), []).append(acc)
            epochs.setdefault((dataset, setting), []).append(epoch)
            print(f"{dataset} {setting} seed {seed}: val {acc:.1f} (epoch {epoch})", flush=True)
    minutes = (time.perf_counter() - start) / 60

    lines = [
        "# Validation accuracy over a hyperparameter grid (graphattn GAT, additive score)", "",
        f"Command: `{command}`  ",
        f"torch {torch.__version__}, torch_geometric {torch_geometric.__version__}; "
        f"CPU: {cpu_name()}; {args.jobs} process(es) with 1 thread each; {minutes:.0f} min.", "",
        f"Seeds {args.seed}..{args.seed + args.seeds - 1}, "
        + ("disjoint from the seeds 0..9 of `citation_accuracy.md`. "
           if args.seed >= ACCURACY_SEEDS else
           f"which overlap the seeds 0..{ACCURACY_SEEDS - 1} of `citation_accuracy.md`: a "
           "setting chosen here has seen those seeds' validation runs. ")
        + "The protocol of `citation_accuracy.py` otherwise: public "
        "split, Adam, early stopping on validation loss and accuracy with patience 100, "
        "8 hidden heads. No test label is read: each run's final evaluation is on the "
        "validation nodes. Mean +- sample standard deviation over the seeds; the standard "
        "error of a mean is the standard deviation / sqrt(seeds).", "",
        "| dataset | weight decay | lr | dropout | channels per head | val accuracy (%) "
        "| selected epoch |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (dataset, setting), accs in val.items():
        paper = " (GAT paper)" if setting == GRID[0] else ""
        lines.append(f"| {dataset} | {setting[0]:g}{paper} | {setting[1]:g} | {setting[2]:g} "
                     f"| {setting[3]} | {statistics.mean(accs):.2f} +- "
                     f"{statistics.stdev(accs):.2f} "
                     f"| {statistics.median(epochs[(dataset, setting)]):.0f} |")
    lines += ["", "## Reading", ""]
    for dataset in args.datasets:
        means = {s: statistics.mean(val[(dataset, s)]) for s in GRID}
        best = max(means, key=means.get)
        paper_accs = val[(dataset, GRID[0])]
        lead = lead_in_standard_errors(means[best], paper_accs)
        verdict = (f"{best} replaces it" if lead > ADOPT_STANDARD_ERRORS
                   else "the paper's setting stays")
        lines.append(f"- {dataset}: best {best} at {means[best]:.2f}, the GAT paper's setting "
                     f"{means[GRID[0]]:.2f}: {means[best] - means[GRID[0]]:+.2f} points, "
                     f"{lead:.1f} standard errors of its mean. Settings span "
                     f"{min(means.values()):.2f}..{max(means.values()):.2f}. A setting would "
                     f"replace the paper's if ahead by more than {ADOPT_STANDARD_ERRORS} "
                     f"standard errors: {verdict}.")
    (RESULTS / "citation_validation_grid.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
