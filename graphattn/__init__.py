"""graphattn: self-attention restricted to the edges of a graph.

Every familiar attention is the same sparse operator on a different graph: the complete graph is
a transformer layer, the causal graph a masked decoder, a window graph truncated attention, a
citation graph graph attention.
"""

from graphattn import datasets, functional, graphs, nn, pe
from graphattn._tensor_cache import clear_graph_caches

__version__ = "0.1.0"

__all__ = ["clear_graph_caches", "datasets", "functional", "graphs", "nn", "pe", "__version__"]
