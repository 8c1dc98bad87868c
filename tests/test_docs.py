"""The documentation (``docs/``: the README, then the API reference from the docstrings) builds
without a warning, and lists every public name."""

import inspect
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The HTML reference, built as ``python -m sphinx -b html -n -W docs docs/_build`` builds
    it: nitpicky (every cross-reference must resolve) and with warnings as errors."""
    reason = "{} (in the test extra from Python 3.11) {}"
    pytest.importorskip("sphinx", reason=reason.format("sphinx", "builds the documentation"))
    pytest.importorskip("myst_parser", reason=reason.format("myst-parser", "reads the README"))
    out = tmp_path_factory.mktemp("docs")
    run = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-n", "-W", "-q",
                          str(DOCS), str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def _documented(out: Path) -> set[str]:
    """The Python objects in the build's inventory (``objects.inv``: four header lines, then
    zlib-compressed lines ``name domain:role priority uri display-name``)."""
    header, _, body = (out / "objects.inv").read_bytes().partition(b"zlib.\n")
    assert header.startswith(b"# Sphinx inventory version 2"), header
    lines = zlib.decompress(body).decode().splitlines()
    return {line.split()[0] for line in lines if line.split()[1].startswith("py:")}


def _public(module) -> list[str]:
    """The functions and classes a module defines whose names do not start with ``_``."""
    return [f"{module.__name__}.{name}" for name, obj in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
            and obj.__module__ == module.__name__]


def test_every_public_name_is_documented(built):
    import graphattn
    from graphattn import datasets, functional, graphs, nn, pe

    documented = _documented(built)
    expected = ([f"graphattn.functional.{name}" for name in functional.__all__]
                + [f"graphattn.nn.{name}" for name in nn.__all__]
                + ["graphattn.clear_graph_caches"]
                + _public(graphs) + _public(pe) + _public(datasets))
    assert len(expected) > 40
    missing = [name for name in expected if name not in documented]
    assert not missing, f"not in the API reference: {missing}"
    assert graphattn.functional.edge_attention.__doc__  # the reference renders docstrings
