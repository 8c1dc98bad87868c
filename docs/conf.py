"""Sphinx configuration of graphattn's API reference: ``sphinx-build -W -n docs docs/_build``."""

from __future__ import annotations

import graphattn

project = "graphattn"
author = "graphattn developers"
release = version = graphattn.__version__

extensions = [
    "sphinx.ext.autodoc",   # the reference is the docstrings
    "sphinx.ext.napoleon",  # their "Args:", "Returns:" and "Shapes:" sections
    "sphinx.ext.mathjax",   # their math
    "myst_parser",          # the README as the guide page
]
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the docstrings give the types; overloads show one signature
autodoc_default_options = {"members": True}
napoleon_custom_sections = ["Shapes"]  # a heading over its list, as written
exclude_patterns = ["_build"]
# the README links to benchmarks/README.md by its path in the repository, with GitHub's heading
# anchors: the stub that includes that page stands at the same path under docs/ as the README's
# stub (readme.md) at its root, so the link resolves here too, and MyST gives the headings down
# to ### those anchors
myst_heading_anchors = 3
html_theme = "alabaster"

# nitpicky mode (-n) checks every cross-reference; the builds run offline, without the
# inventories of Python, torch, PyG, numpy and networkx, so names from those are not checked
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|torch_geometric|numpy|np|scipy|networkx|nx|collections|typing|types|os|"
               r"pathlib|contextlib|enum|urllib)(\..*)?"),
    (r"py:.*", r"(int|float|bool|str|bytes|tuple|list|dict|set|object|None|type|callable|"
               r"Callable|Sequence|Iterator|Tensor|Path|PathLike|optional|Literal|Any|T)"),
]


def _find(name: str, module: str | None = None):
    """The Python object that ``name`` (dotted, or relative to ``module``) names, or ``None``."""
    import importlib

    for full in ([f"{module}.{name}"] if module else []) + [name]:
        parts = full.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return obj
    return None


def _resolve_by_object(app, env, node, contnode):
    """A reference by another name of a documented object (its defining module's name, or a
    name relative to the module it is written in) links to where that object is documented:
    ``graphattn.functional.attention.edge_attention`` to ``graphattn.functional.edge_attention``.
    """
    from sphinx.util.nodes import make_refnode

    if node.get("refdomain") != "py":
        return None
    obj = _find(node["reftarget"].lstrip("~."), node.get("py:module"))
    if obj is None:
        return None
    for name, entry in env.get_domain("py").objects.items():
        if not entry.aliased and _find(name) is obj:
            return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id,
                                contnode, name)
    return None


def _last_overload(app, what, name, obj, options, signature, return_annotation):
    """An overloaded function (``edge_attention``'s ``return_attention``, which types the result)
    shows its general signature only."""
    if signature and "\n" in signature:
        return signature.split("\n")[-1], return_annotation
    return None


def setup(app):
    app.connect("missing-reference", _resolve_by_object)
    app.connect("autodoc-process-signature", _last_overload)
