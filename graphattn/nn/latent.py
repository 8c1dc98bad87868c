r"""Low-rank projections of queries, keys and values: multi-head latent attention (MLA).

DeepSeek-V2 (DeepSeek-AI, 2024, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model") projects each input through a narrow latent, normalised,
before widening it into the heads:

.. math::
    q_i = W^{Qb}\, \mathrm{RMSNorm}(W^{Qa} x_i), \qquad
    c_j = \mathrm{RMSNorm}(W^{KVa} x_j), \qquad
    k_{j,h} = [\, W^{KR} x_j \,;\, W^{Kb}_h c_j \,], \qquad v_{j,h} = W^{Vb}_h c_j

The first S channels of every head's key, :math:`W^{KR} x_j`, are one projection shared by
all heads (the keys' rotary channels in DeepSeek's models, "decoupled RoPE"); the rest of each
key and each value come from the latent :math:`c_j` of r channels. The layers take these as
``GraphSelfAttention(..., q_rank=, kv_rank=, shared_key_channels=)``: their ``lin_q`` is then a
:class:`LowRankLinear`, their ``lin_k`` a :class:`LatentKeysValues` that computes keys and values
together, and their ``lin_v`` a :class:`LatentValues` that reads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Linear
from torch.nn.parameter import UninitializedParameter

from graphattn._checks import check_float_dtype, check_non_negative, check_positive, check_tensors
from graphattn.functional.sparse_linear import sparse_linear


def _down(x: Tensor, lin: Linear) -> Tensor:
    """``lin(x)`` for dense or sparse (CSR, COO) features ``x [N, F]``, checked by name (the
    modules are public; a layer has checked its own inputs already)."""
    check_tensors(x=x)
    if not isinstance(lin.weight, UninitializedParameter) and (
            x.dim() == 0 or x.size(-1) != lin.in_features):
        raise ValueError(f"x must have F = in_features = {lin.in_features} features in its "
                         f"last dimension, got {list(x.shape)}")
    check_float_dtype(x=x)
    if x.layout == torch.strided:
        return lin(x)
    return sparse_linear(x, lin.weight, lin.bias)


def _glorot(lin: Linear) -> None:
    torch.nn.init.xavier_uniform_(lin.weight)
    if lin.bias is not None:
        torch.nn.init.zeros_(lin.bias)


class LowRankLinear(torch.nn.Module):
    r"""A linear map through a normalised bottleneck of ``rank`` channels:

    .. math::
        y = W^{b}\, \mathrm{RMSNorm}(W^{a} x + b^{a})

    DeepSeek-V2's compressed queries (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``).

    Args:
        in_features (int): input features F.
        rank (int): channels r of the bottleneck.
        out_features (int): output features.
        bias (bool, optional): a bias :math:`b^a` of the first product (``down``); the second
            (``up``) has none. (default: ``True``)
        eps (float, optional): the RMS norm's epsilon. (default: ``1e-6``)

    Modules: ``down`` ``Linear(F, r)``, ``norm`` ``RMSNorm(r)`` (with gains), ``up``
    ``Linear(r, out_features, bias=False)``.

    Shapes:
        - **input:** ``(..., F)`` (or ``(N, F)`` sparse)
        - **output:** ``(..., out_features)``
    """

    bias = None  # (the output has no bias term of its own)

    def __init__(self, in_features: int, rank: int, out_features: int, *, bias: bool = True,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.in_features = check_positive(in_features, "in_features")
        self.rank = check_positive(rank, "rank")
        self.out_features = check_positive(out_features, "out_features")
        self.down = Linear(self.in_features, self.rank, bias=bias)
        self.norm = torch.nn.RMSNorm(self.rank, eps=eps)
        self.up = Linear(self.rank, self.out_features, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weights (each product on its own), zero bias, gains of 1."""
        _glorot(self.down)
        _glorot(self.up)
        self.norm.reset_parameters()

    def latent(self, x: Tensor) -> Tensor:
        """The normalised bottleneck ``norm(down(x))`` ``[..., rank]``."""
        return self.norm(_down(x, self.down))

    def forward(self, x: Tensor) -> Tensor:
        """``up(norm(down(x)))``; see the class docstring for shapes."""
        return self.up(self.latent(x))

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.rank} -> {self.out_features}"


class LatentKeysValues(torch.nn.Module):
    r"""Keys and values of ``heads`` heads from one latent of ``rank`` channels (multi-head
    latent attention):

    .. math::
        [\, a_j \,;\, s_j \,] = W^{a} x_j + b^{a}, \quad c_j = \mathrm{RMSNorm}(a_j), \quad
        [\, k'_{j,h} \,;\, v_{j,h} \,] = W^{b}_h c_j, \quad
        k_{j,h} = [\, s_j \,;\, k'_{j,h} \,]

    The key's first ``shared_key_channels`` S channels, :math:`s_j`, are shared by every head
    and come from :math:`x_j` directly (with ``rotary=RotaryPE(S)`` on the layer, DeepSeek's
    decoupled rotary key); the other :math:`C_k - S` and the value's :math:`C_v` come from the
    latent. The rows of ``down`` are ``[latent (r); shared (S)]`` and those of ``up`` each
    head's ``[key (C_k - S); value (C_v)]``, as DeepSeek's ``kv_a_proj_with_mqa`` and
    ``kv_b_proj`` hold them.

    As a layer's ``lin_k`` its call gives the keys; :meth:`keys_values` gives both from one
    latent, as the layers call it, and the layer's ``lin_v`` (:class:`LatentValues`) the
    values.

    Args:
        in_features (int): input features F.
        rank (int): channels r of the latent.
        heads (int): key and value heads.
        key_channels (int): channels :math:`C_k` of each head's key, the shared ones included.
        value_channels (int): channels :math:`C_v` of each head's value.
        shared_key_channels (int, optional): S, below :math:`C_k`. (default: ``0``)
        bias (bool, optional): a bias :math:`b^a` of ``down``; ``up`` has none.
            (default: ``True``)
        eps (float, optional): the RMS norm's epsilon. (default: ``1e-6``)

    Shapes:
        - **input:** ``(..., F)`` (or ``(N, F)`` sparse)
        - **output:** keys ``(..., heads * C_k)``; :meth:`keys_values` also the values
          ``(..., heads * C_v)``
    """

    bias = None  # (the keys and values have no bias term of their own)

    def __init__(self, in_features: int, rank: int, heads: int, key_channels: int,
                 value_channels: int, shared_key_channels: int = 0, *, bias: bool = True,
                 eps: float = 1e-6) -> None:
        super().__init__()
        self.in_features = check_positive(in_features, "in_features")
        self.rank = check_positive(rank, "rank")
        self.heads = check_positive(heads, "heads")
        self.key_channels = check_positive(key_channels, "key_channels")
        self.value_channels = check_positive(value_channels, "value_channels")
        self.shared_key_channels = check_non_negative(shared_key_channels,
                                                      "shared_key_channels")
        if self.shared_key_channels >= self.key_channels:
            raise ValueError(f"shared_key_channels must be below the key channels "
                             f"{self.key_channels} (the others come from the latent), got "
                             f"{shared_key_channels!r}")
        self.out_features = self.heads * self.key_channels  # (the keys', as lin_k)
        self.down = Linear(self.in_features, self.rank + self.shared_key_channels, bias=bias)
        self.norm = torch.nn.RMSNorm(self.rank, eps=eps)
        own = self.key_channels - self.shared_key_channels
        self.up = Linear(self.rank, self.heads * (own + self.value_channels), bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot-uniform weights (each product on its own), zero bias, gains of 1."""
        _glorot(self.down)
        _glorot(self.up)
        self.norm.reset_parameters()

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The keys ``[..., heads * C_k]`` and values ``[..., heads * C_v]`` of ``x``."""
        S, H, r = self.shared_key_channels, self.heads, self.rank
        latent, shared = _down(x, self.down).split([r, S], dim=-1)
        c = self.norm(latent)  # (..., r)
        # each head's [key; value] rows of up, as two products: keys and values contiguous
        own = self.key_channels - S
        rows = self.up.weight.view(H, own + self.value_channels, r)
        v = F.linear(c, rows[:, own:].reshape(-1, r))  # (..., H * C_v)
        k = F.linear(c, rows[:, :own].reshape(-1, r))  # (..., H * (C_k - S))
        if S:
            k = torch.cat([shared.unsqueeze(-2).expand(*k.shape[:-1], H, S),
                           k.unflatten(-1, (H, own))], dim=-1).flatten(-2)
        return k, v

    def forward(self, x: Tensor) -> Tensor:
        """The keys ``[..., heads * C_k]`` of ``x``."""
        return self.keys_values(x)[0]

    def extra_repr(self) -> str:
        return (f"{self.in_features} -> {self.rank}, heads={self.heads}, key_channels="
                f"{self.key_channels}, value_channels={self.value_channels}, "
                f"shared_key_channels={self.shared_key_channels}")


class LatentValues(torch.nn.Module):
    """The values of a :class:`LatentKeysValues` as a module of their own (a layer's
    ``lin_v``), without parameters: it reads those of the ``LatentKeysValues`` (the layer's
    ``lin_k``), which it does not register, so that the ``state_dict`` holds them once.

    Shapes:
        - **input:** ``(..., F)``
        - **output:** ``(..., heads * C_v)``
    """

    bias = None

    def __init__(self, source: LatentKeysValues) -> None:
        super().__init__()
        if not isinstance(source, LatentKeysValues):
            raise TypeError(f"source must be a LatentKeysValues, got {type(source).__name__}")
        self.__dict__["source"] = source  # (not a submodule: its parameters are lin_k's)
        self.in_features = source.in_features
        self.out_features = source.heads * source.value_channels

    def reset_parameters(self) -> None:
        """Nothing: the parameters are the source's."""

    def forward(self, x: Tensor) -> Tensor:
        """The source's values ``[..., heads * C_v]`` of ``x``."""
        return self.source.keys_values(x)[1]

    def extra_repr(self) -> str:
        return f"values of {type(self.source).__name__}, {self.out_features} features"


def input_module(lin: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``weight`` multiplies a projection's input: ``down`` for the
    projections above, ``lin`` itself otherwise."""
    if isinstance(lin, LatentValues):
        return lin.source.down
    return lin.down if isinstance(lin, (LowRankLinear, LatentKeysValues)) else lin


__all__ = ["LatentKeysValues", "LatentValues", "LowRankLinear"]
