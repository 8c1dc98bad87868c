"""Write a benchmark's table as CSV and Markdown under ``benchmarks/results/``."""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_table(name: str, title: str, header: list[str], note: str, rows: list[dict], *,
                out: Path | None = None) -> str:
    """Write ``rows`` (dicts with the same keys, the columns) to ``results/<name>.csv`` and
    ``results/<name>.md`` (or to ``out`` and its ``.csv``): the title, the ``header`` lines
    (command, versions, machine), the ``note`` that says what the figures are, then the table.
    Returns the Markdown."""
    out = RESULTS / f"{name}.md" if out is None else Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    def cells(values) -> str:  # (a | inside a cell, as in "max |out difference|", escaped)
        return "| " + " | ".join(str(v).replace("|", "\\|") for v in values) + " |"
    lines = [f"# {title}\n", *(f"{h}  " for h in header), "", note, "",
             cells(rows[0]), "|" + "---|" * len(rows[0])]
    lines += [cells(row.values()) for row in rows]
    text = "\n".join(lines) + "\n"
    out.write_text(text)
    return text


def default_output(name: str, quick: bool) -> Path:
    """``results/<name>.md``, or ``results/<name>_quick.md`` for a ``--quick`` run."""
    return RESULTS / f"{name}{'_quick' if quick else ''}.md"


def replot_rows(parser: argparse.ArgumentParser, path: Path, columns: tuple[str, ...]
                ) -> list[dict]:
    """The rows of the ``.csv`` that ``--replot`` names, or the parser's error when it is not
    a table the script wrote (another suffix, no such file, or without ``columns``)."""
    if path.suffix != ".csv":
        parser.error(f"--replot takes the .csv a run wrote, got {str(path)!r}")
    if not path.is_file():
        parser.error(f"--replot: no such file {str(path)!r}")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    missing = [c for c in columns if not rows or c not in rows[0]]
    if missing:
        parser.error(f"--replot: {str(path)!r} has no rows with the columns {missing}: not a "
                     f"table this script wrote")
    return rows
