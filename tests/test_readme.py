"""The README's Python examples run as written, each block on its own."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
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


def test_readme_tables_are_not_reflowed_into_paragraphs():
    """Every markdown table row starts its own line (a reflowed paragraph swallowed one)."""
    lines = README.read_text().splitlines()
    inlined = [line for line in lines if "| --- |" in line and not line.startswith("| ")]
    assert not inlined, inlined
    for i, line in enumerate(lines):
        if line.startswith("| ---"):
            assert lines[i - 1].startswith("| ") and (i < 2 or lines[i - 2] == ""), lines[i - 2:i]
