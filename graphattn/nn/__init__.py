"""torch.nn modules built on the edge-attention operator."""

from graphattn.nn.attention import DenseSelfAttention, GraphSelfAttention
from graphattn.nn.models import GAT, GraphTransformer
from graphattn.nn.pyg import convert_pyg, from_pyg

__all__ = ["DenseSelfAttention", "GAT", "GraphSelfAttention", "GraphTransformer", "convert_pyg",
           "from_pyg"]
