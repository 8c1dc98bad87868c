"""The README's Python examples run as written, each block on its own; its links and the
benchmarks' README they lead to hold what they promise."""

import re
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BENCHMARKS_README = README.parent / "benchmarks" / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, capsys):
    exec(compile(BLOCKS[index], f"README.md, python block {index}", "exec"), {})


def test_readme_shapes_are_the_printed_ones(capsys):
    """The first block's comment promises [4, 16] outputs and 5 edges + 4 self-loops."""
    exec(compile(BLOCKS[0], "README.md, python block 0", "exec"), {})
    assert capsys.readouterr().out.splitlines()[0] == "torch.Size([4, 16]) torch.Size([9, 2])"


def test_package_exposes_its_modules():
    import graphattn

    for name in ("datasets", "functional", "graphs", "nn", "pe"):
        assert hasattr(graphattn, name), name
    assert callable(graphattn.datasets.load_planetoid)
    assert {"datasets", "functional", "graphs", "nn", "pe"} <= set(dir(graphattn))
    with pytest.raises(AttributeError, match="module 'graphattn' has no attribute 'layers'"):
        graphattn.layers  # noqa: B018


OPERATOR_ALONE = """
import sys
import torch
import graphattn
from graphattn import graphs
from graphattn.functional import edge_attention
edge_index = graphs.causal_graph(6)
q, k, v = (torch.randn(6, 2, 4) for _ in range(3))
out = edge_attention(q, k, v, edge_index, backend="reference")
print(tuple(out.shape), "torch_geometric" in sys.modules)
print(graphattn.nn.GraphSelfAttention.__name__, "torch_geometric" in sys.modules)
"""


def test_the_operator_and_the_graphs_load_without_torch_geometric():
    """``graphattn.functional`` and ``graphattn.graphs`` import without torch_geometric (the
    subpackages load on first use), and ``graphattn.nn`` loads it when first asked for. In a
    fresh process: this one has imported everything."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", OPERATOR_ALONE], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["(6, 2, 4) False", "GraphSelfAttention True"]


@pytest.mark.parametrize("page", [README, BENCHMARKS_README], ids=["README", "benchmarks"])
def test_readme_tables_are_not_reflowed_into_paragraphs(page):
    """Every markdown table row starts its own line (a reflowed paragraph swallowed one)."""
    lines = page.read_text().splitlines()
    inlined = [line for line in lines if "| --- |" in line and not line.startswith("| ")]
    assert not inlined, inlined
    for i, line in enumerate(lines):
        if line.startswith("| ---"):
            assert lines[i - 1].startswith("| ") and (i < 2 or lines[i - 2] == ""), lines[i - 2:i]


def _spilling(table: str, **columns: str) -> list[int]:
    """Spill stores (bytes a thread) of the rows of a committed triton_resources table (its
    last, the one of all kernels) whose named columns have the given values."""
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    start = max(i for i, line in enumerate(lines) if "spill stores" in line)
    lines = lines[start:]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    stores = []
    for line in lines:
        cells = dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")),
                         strict=True))
        spill = cells["spill stores / loads B"]
        if spill[0].isdigit() and all(cells[k] == v for k, v in columns.items()):
            stores.append(int(spill.split("/")[0]))
    return stores


def _section(page: Path, heading: str) -> str:
    """The text of the ``## `` section of a markdown page whose heading starts with ``heading``,
    up to the next ``## `` heading, its lines joined by single spaces."""
    text = page.read_text()
    start = text.index("\n## " + heading)
    end = text.find("\n## ", start + 1)
    return " ".join(text[start:end if end > 0 else None].split())


def test_readme_quotes_the_committed_register_spills():
    """The spill counts that the benchmarks' README gives under `triton_resources.py` are those
    of the tables in benchmarks/results (they were left behind once when the tables were
    rerun), and the README's summary agrees with them."""
    results = README.parent / "benchmarks" / "results"
    text = _section(BENCHMARKS_README, "`triton_resources.py`")
    one_node = (results / "triton_resources.md").read_text()
    rows8 = (results / "triton_resources_rows8.md").read_text()
    blocks = (results / "triton_resources_blocks.md").read_text()
    spilled = [s for s in _spilling(one_node) if s > 0]
    assert spilled == [8]
    assert "1 of the 216 one-node kernels spills registers, by 8 bytes" in text
    assert not any(s > 0 for s in _spilling(rows8))
    assert "none of the 216 row-block kernels spills" in text
    counts = {}
    for tile in ("32", "64"):
        for products in ("ieee", "tf32", "bf16"):
            spilled = [s for s in _spilling(blocks, B=tile, products=products) if s > 0]
            counts[tile, products] = (len(spilled), max(spilled, default=0))
    assert counts["32", "ieee"] == (0, 0) and "none of 27 kernels spills with full fp32" in text
    assert counts["32", "tf32"] == (4, 36) and "4 of 27 by up to 36 bytes with TF32" in text
    assert counts["32", "bf16"] == (2, 12) and "2 of 27 by up to 12 bytes in bf16" in text
    assert counts["64", "ieee"][0] == 18 and "in tiles of 64, 18 of 27 spill in fp32" in text
    summary = " ".join(README.read_text().split())
    assert "one of the 216 one-node kernels spills registers, by 8 bytes" in summary


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, code marks and punctuation
    dropped, spaces made hyphens (as MyST's ``myst_heading_anchors`` does in the docs)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """The anchors of a markdown page's headings (outside its code blocks)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_github_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", [README, BENCHMARKS_README], ids=["README", "benchmarks"])
def test_relative_links_resolve(page):
    """Every relative link and image of the page names a file of the repository, and a link's
    anchor names a heading of the page it leads to (GitHub resolves them as paths; the docs
    build checks them again, with the pages at their places under docs/)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    name = page.relative_to(README.parent)
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.is_file(), f"{name}: {link} names no file"
        if anchor:
            assert anchor in _anchors(target), f"{name}: {link}: no heading {anchor!r}"


def test_readme_links_to_the_moved_measurements():
    """The README summarises the measurements and links to each place in the benchmarks'
    README that holds them."""
    text = README.read_text()
    for heading in ("`gpu.py`", "`triton_resources.py`", "`vs_pyg.py`", "`compile_cpu.py`",
                    "`sparse_vs_dense.py`", "`block_diagonal.py`", "`explicit_weights.py`",
                    "`dropout_cpu.py`"):
        line = next(line for line in BENCHMARKS_README.read_text().splitlines()
                    if line.startswith("## " + heading))
        assert f"](benchmarks/README.md#{_github_slug(line.lstrip('# '))})" in text, heading


def test_ci_runs_the_test_commands_of_the_readme():
    """Every pytest command of ``.ci/run`` is one of README.md's (line continuations joined,
    spaces collapsed), and the README names no other."""
    def commands(text: str) -> list[str]:
        joined = re.sub(r"\\\n\s*", " ", text)
        return sorted(" ".join(line.split()) for line in joined.splitlines()
                      if "python -m pytest" in line and not line.lstrip().startswith("#"))

    ci = commands((README.parent / ".ci" / "run").read_text())
    readme = commands("\n".join(re.findall(r"```bash\n(.*?)```", README.read_text(),
                                           flags=re.S)))
    assert len(ci) == 2
    assert ci == readme
