"""torch.nn modules built on the edge-attention operator."""

from graphattn.nn.attention import DenseSelfAttention, GraphSelfAttention
from graphattn.nn.convert import convert_pyg, from_llama, from_mha, from_pyg
from graphattn.nn.indexer import LightningIndexer
from graphattn.nn.latent import LatentKeysValues, LatentValues, LowRankLinear
from graphattn.nn.models import GAT, GraphTransformer

__all__ = ["DenseSelfAttention", "GAT", "GraphSelfAttention", "GraphTransformer",
           "LatentKeysValues", "LatentValues", "LightningIndexer", "LowRankLinear",
           "convert_pyg", "from_llama", "from_mha", "from_pyg"]
