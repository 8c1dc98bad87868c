"""graphattn: self-attention restricted to the edges of a graph.

Every familiar attention is the same sparse operator on a different graph: the complete graph is
a transformer layer, the causal graph a masked decoder, a window graph truncated attention, a
citation graph graph attention.

The subpackages load on first use (``graphattn.nn``, or ``from graphattn import nn``), so that
``import graphattn.functional`` or ``graphattn.graphs`` does not import torch_geometric, which
``nn``, ``pe`` and ``datasets`` build on.
"""

import importlib

from graphattn._tensor_cache import clear_graph_caches

__version__ = "0.1.0"

_SUBPACKAGES = ("datasets", "functional", "graphs", "nn", "pe")

__all__ = ["clear_graph_caches", *_SUBPACKAGES, "__version__"]


def __getattr__(name: str):
    """Import the subpackage ``name`` the first time it is asked for (PEP 562)."""
    if name in _SUBPACKAGES:
        return importlib.import_module(f"graphattn.{name}")
    raise AttributeError(f"module 'graphattn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBPACKAGES})
