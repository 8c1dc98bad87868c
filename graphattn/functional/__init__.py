"""Pure tensor functions: the edge-attention operator, its backends, and dense attention."""

from graphattn.functional.attention import (
    available_backends,
    dense_attention,
    edge_attention,
    reference_edge_attention,
    select_backend,
)
from graphattn.functional.dropout import dropout, dropout_mask
from graphattn.functional.softmax import scatter_softmax

__all__ = [
    "available_backends",
    "dense_attention",
    "dropout",
    "dropout_mask",
    "edge_attention",
    "reference_edge_attention",
    "scatter_softmax",
    "select_backend",
]
