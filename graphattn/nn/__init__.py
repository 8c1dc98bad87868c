"""torch.nn modules built on the edge-attention operator."""

from graphattn.nn.attention import DenseSelfAttention, GraphSelfAttention
from graphattn.nn.models import GAT, GraphTransformer

__all__ = ["DenseSelfAttention", "GAT", "GraphSelfAttention", "GraphTransformer"]
