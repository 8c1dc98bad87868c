"""The Markdown tables the benchmarks write (and those committed under benchmarks/results/)
have as many cells in every row as in their separator row: a ``|`` inside a cell is escaped."""

import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _misshapen_rows(text: str) -> list[str]:
    """The rows of the tables in ``text`` whose count of unescaped ``|`` differs from their
    separator row's."""
    lines = text.splitlines()
    bad = []
    for i, line in enumerate(lines):
        if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
            continue
        cells = line.count("|")
        j = i - 1  # the header, then the body
        rows = [lines[j]] if j >= 0 else []
        j = i + 1
        while j < len(lines) and lines[j].startswith("|"):
            rows.append(lines[j])
            j += 1
        bad += [row for row in rows if len(re.findall(r"(?<!\\)\|", row)) != cells]
    return bad


def test_the_checker_finds_a_cell_with_a_pipe():
    assert _misshapen_rows("| a | b |x| |\n|---|---|\n| 1 | 2 |\n") == ["| a | b |x| |"]
    assert _misshapen_rows("| a | b \\|x\\| |\n|---|---|\n| 1 | 2 |\n") == []


def test_write_table_escapes_pipes(tmp_path):
    sys.path.insert(0, str(RESULTS.parent))
    try:
        from _report import write_table
    finally:
        sys.path.remove(str(RESULTS.parent))
    text = write_table("t", "T", [], "note", [{"max |difference|": "1|2", "b": 3}],
                       out=tmp_path / "t.md")
    assert "| max \\|difference\\| | b |" in text
    assert _misshapen_rows(text) == []
    assert (tmp_path / "t.csv").read_text().splitlines()[0] == "max |difference|,b"


def test_committed_tables_are_well_formed():
    bad = {path.name: rows for path in sorted(RESULTS.rglob("*.md"))
           if (rows := _misshapen_rows(path.read_text()))}
    assert not bad, bad
