"""torch.nn modules built on the edge-attention operator."""

from graphattn.nn.attention import DenseSelfAttention, GraphSelfAttention

__all__ = ["DenseSelfAttention", "GraphSelfAttention"]
