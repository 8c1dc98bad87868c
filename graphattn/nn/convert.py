r"""Attention layers of PyG and of torch, as graphattn's layers, weights included.

**PyG.** :func:`from_pyg` turns a ``GATConv``, ``GATv2Conv`` or ``TransformerConv`` into a
:class:`~graphattn.nn.GraphSelfAttention` that computes the same function (outputs, attention
weights and input gradients, on every graph), and :func:`convert_pyg` swaps every such layer
inside a model, PyG's ``GAT`` model and ``to_hetero`` models included, so that a trained model
runs on the fused kernels without retraining. How each layer maps:

- ``GATConv``: the additive score. GAT's score
  :math:`a_{dst}^\top W_{dst} x_i + a_{src}^\top W_{src} x_j (+ a_e^\top W_e e_{ij})` is linear
  in the features, so each attention vector is folded into its projection, ``lin_q = a_dst W_dst``
  and ``lin_k = a_src W_src`` (``Linear(F, H)``, no biases), and ``lin_edge = a_e W_e``
  (``edge_mode="bias"``); ``lin_v = W_src``. ``x = (x_src, None)`` leaves out the target term
  (``lin_q``) and the residual, as ``GATConv`` does.
- ``GATv2Conv``: the gatv2 score, ``lin_q = lin_r``, ``lin_k = lin_l``, ``att = att``, and
  ``share_value=True`` (GATv2's value is its key: ``lin_v`` is ``lin_k``); edge features enter
  the key (``edge_mode="key"``).
- ``TransformerConv``: the dot score, ``lin_q, lin_k, lin_v = lin_query, lin_key, lin_value``,
  ``res = lin_skip`` (``root_weight``), ``lin_beta``, and edge features in the key and the value
  (``edge_mode="key_value"``); no self-loops are added, as ``TransformerConv`` adds none.

No layer gets an output projection (``out_proj=False``); the output bias of ``GATConv`` and
``GATv2Conv``, added after the weighted sum (so a target without an in-edge gets it too), is the
layer's ``out_bias``. Attention dropout keeps its probability; the masks are graphattn's
(:func:`graphattn.functional.dropout_mask`), so training steps with dropout draw other masks
than PyG's.

The function is the same at conversion, and so are the parameters, with one exception: a
converted GAT layer holds ``a^\top W`` as free ``lin_q`` and ``lin_k`` (``Linear(F, H)``), where
``GATConv`` ties its attention vectors to the value weights ``W``, so trained further it
follows another path than ``GATConv`` would. (A residual of ``GATv2Conv`` gets a bias, 0 at
conversion, with ``bias=True``.) The converted layers hold new parameters: build the optimizer
after converting (one built before holds the old tensors and trains nothing); optimizer states
do not carry over.

**torch.** :func:`from_mha` turns a ``torch.nn.MultiheadAttention`` (a pretrained
transformer's, say) into a ``GraphSelfAttention`` without added self-loops, which attends over
the edges it is given: on the complete graph it is the ``MultiheadAttention`` itself, on a
window, causal or grid graph that attention restricted to the graph, as an ``attn_mask`` would
restrict it, at the cost of the edges instead of :math:`L^2`. Or into a
:class:`~graphattn.nn.DenseSelfAttention` (``dense=True``). Here the parameters map one to one.

**Hugging Face.** :func:`from_llama` turns the self-attention of a LLaMA-family decoder layer
(``LlamaAttention`` and the models built like it) into a ``GraphSelfAttention`` with its
rotary embedding (:class:`~graphattn.pe.RotaryPE`) and grouped key and value heads
(``kv_heads``): on the causal graph with positions ``0 .. L-1`` it is that attention, on a
causal window graph the same model's attention restricted to a sliding window. Each conversion
is run against the attention before it is returned, and refused by name where the two differ.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import sys
import warnings

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parameter import UninitializedParameter

from graphattn._checks import check_flag
from graphattn.functional.attention import BACKENDS
from graphattn.graphs import causal_graph
from graphattn.nn.attention import _UNCALLED_HOOKS, DenseSelfAttention, GraphSelfAttention
from graphattn.nn.indexer import LightningIndexer
from graphattn.pe import QueryTemperature, RotaryPE

CONVERTIBLE = ("GATConv", "GATv2Conv", "TransformerConv")
"""The names of the PyG layers :func:`from_pyg` converts."""


def _pyg_convs() -> dict[str, type]:
    from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

    return {"GATConv": GATConv, "GATv2Conv": GATv2Conv, "TransformerConv": TransformerConv}


# the methods that make a PyG layer's computation: a subclass that overrides one of them
# computes something else than the layer the conversion maps (propagate and edge_updater are
# left out: PyG generates them per class, from the signatures of these)
_COMPUTING_METHODS = ("forward", "message", "aggregate", "message_and_aggregate", "update",
                      "edge_update")


def _own_methods(module: Module, cls: type) -> list[str]:
    """The methods of :data:`_COMPUTING_METHODS` that ``module``'s class overrides."""
    return [m for m in _COMPUTING_METHODS if getattr(type(module), m) is not getattr(cls, m)]


def _kind(module: Module) -> str | None:
    """The name in :data:`CONVERTIBLE` of ``module``'s class, or ``None``. A subclass counts
    when it keeps the class's computation: ``forward``, ``message`` and the rest of
    :data:`_COMPUTING_METHODS` (``FusedGATConv``, a ``GATConv`` called with CSR and CSC
    structures, does not: converted, it would not take its callers' arguments)."""
    for name, cls in _pyg_convs().items():
        if isinstance(module, cls):
            return None if _own_methods(module, cls) else name
    return None


def _check_convertible(conv: Module, kind: str) -> None:
    from torch_geometric.nn.aggr import SumAggregation

    # TransformerConv builds lin_skip without root_weight too, and never sizes it then
    unread = (set(conv.lin_skip.parameters())
              if kind == "TransformerConv" and not conv.root_weight else set())
    lazy = {p for p in conv.parameters()
            if isinstance(p, UninitializedParameter) and p not in unread}
    lin_edge = getattr(conv, "lin_edge", None)
    if lazy and lin_edge is not None and lazy <= set(lin_edge.parameters()):
        raise ValueError(f"conv is a {kind} with a lazy edge projection (edge_dim=-1) whose "
                         f"weights do not exist yet: run one forward with edge_attr through "
                         f"it before converting it")
    if lazy:
        raise ValueError(f"conv is a lazy {kind} (in_channels=-1) whose weights do not exist "
                         f"yet: run one forward through it before converting it")
    # (an Aggregation module given as aggr is kept as its repr, 'SumAggregation()')
    if conv.aggr not in ("add", "sum") and type(conv.aggr_module) is not SumAggregation:
        raise ValueError(f"conv must aggregate with aggr='add' (the weighted sum of attention), "
                         f"got aggr={conv.aggr!r}")
    if conv.flow != "source_to_target":
        raise ValueError(f"conv must have flow='source_to_target' (edges j -> i, as "
                         f"graphattn's edge_index), got flow={conv.flow!r}")


def from_pyg(conv: Module, *, backend: str = "auto") -> GraphSelfAttention:
    r"""A :class:`~graphattn.nn.GraphSelfAttention` that computes what the PyG layer ``conv``
    computes, with its weights copied (see :mod:`graphattn.nn.convert` for the mapping).

    Same outputs and attention weights on every graph, and the same gradients with respect to
    the inputs, up to floating-point rounding. The new layer is a separate module on ``conv``'s
    device, in its dtype and training mode, frozen when ``conv`` is (every parameter with
    ``requires_grad=False``); ``conv`` is left as it was. Hooks registered on ``conv`` and
    partly frozen weights do not carry over: a warning says so. A subclass that overrides a
    step of the computation (``forward``, ``message``, ``aggregate``, ``update``,
    ``edge_update``) is refused.

    Args:
        conv (torch.nn.Module): a ``torch_geometric.nn.GATConv``, ``GATv2Conv`` or
            ``TransformerConv`` (with ``aggr="add"``, PyG's default, or ``SumAggregation()``).
        backend (str, optional): the new layer's ``backend``. (default: ``"auto"``)

    Returns:
        GraphSelfAttention: the converted layer; it takes the same ``forward`` arguments
        (``x``, ``edge_index``, ``edge_attr``, ``return_attention_weights``). Converted from
        a ``GATConv`` without ``edge_dim``, it drops ``edge_attr`` as ``GATConv`` does (PyG's
        ``GAT`` model passes it to every layer); a ``GraphSelfAttention`` built without
        ``edge_dim`` refuses it.
    """
    return _from_pyg(conv, backend, "conv")


def _from_pyg(conv: Module, backend: str, name: str) -> GraphSelfAttention:
    """:func:`from_pyg`, called from a public function of this module (whose caller the
    warnings point at), ``name`` for ``conv`` in the warnings (a submodule's qualified name
    from :func:`convert_pyg`)."""
    kind = _kind(conv)
    if kind is None:
        bases = [(name, cls) for name, cls in _pyg_convs().items() if isinstance(conv, cls)]
        if bases:
            name, cls = bases[0]
            raise TypeError(f"conv is a {type(conv).__name__}, a {name} with its own "
                            f"{', '.join(_own_methods(conv, cls))}: the converted layer would "
                            f"compute {name}'s function, not this one, or not take its "
                            f"arguments")
        raise TypeError(f"conv must be one of PyG's {', '.join(CONVERTIBLE)}, "
                        f"got {type(conv).__name__}")
    _check_convertible(conv, kind)
    H, C = conv.heads, conv.out_channels
    reference = next(conv.parameters())

    def new_layer(**options) -> GraphSelfAttention:  # in conv's dtype before the weights come
        layer = GraphSelfAttention(_in_channels(conv, kind), C, heads=H, concat=conv.concat,
                                   dropout=conv.dropout, out_proj=False,
                                   edge_dim=_edge_dim(conv),
                                   backend=backend, **options)
        return layer.to(device=reference.device, dtype=reference.dtype).train(conv.training)

    if kind == "TransformerConv":
        layer = new_layer(attention="dot", bias=conv.lin_key.bias is not None,
                          add_self_loops=False, residual=conv.root_weight, beta=conv.beta,
                          edge_mode="key_value" if conv.edge_dim is not None else "bias")
        pairs = [(layer.lin_q, conv.lin_query), (layer.lin_k, conv.lin_key),
                 (layer.lin_v, conv.lin_value), (layer.lin_edge, conv.lin_edge)]
        if conv.root_weight:
            pairs += [(layer.res, conv.lin_skip), (layer.lin_beta, conv.lin_beta)]
        with torch.no_grad():
            for ours, theirs in pairs:
                if theirs is not None:
                    ours.weight.copy_(theirs.weight)
                    if theirs.bias is not None:
                        ours.bias.copy_(theirs.bias)
    else:
        gat = kind == "GATConv"
        out_bias = conv.bias  # added after the weighted sum: the layer's out_bias
        layer = new_layer(
            attention="additive" if gat else "gatv2",
            # GATConv's projections have no biases; GATv2Conv's lin_l and lin_r do
            bias=not gat and conv.lin_l.bias is not None, out_bias=out_bias is not None,
            add_self_loops=conv.add_self_loops, negative_slope=conv.negative_slope,
            fill_value=conv.fill_value, residual=getattr(conv, "residual", False),
            share_weights=not gat and conv.share_weights, share_value=not gat,
            edge_mode="bias" if gat or conv.edge_dim is None else "key")
        layer._ignores_edge_attr = gat and conv.edge_dim is None  # GATConv drops edge_attr
        with torch.no_grad():
            if gat:
                _copy_gat(layer, conv)
            else:
                _copy_gatv2(layer, conv)
            if layer.res is not None:
                layer.res.weight.copy_(conv.res.weight)
                # PyG's residual has no bias; GATv2Conv's projections do, and the layer gives
                # its residual one with them: removed, not zeroed, or it would train beside
                # out_bias (one gradient twice over) and the parameters would not be PyG's
                layer.res.register_parameter("bias", None)
            if out_bias is not None:
                layer.out_bias.copy_(out_bias)  # (H * C,) or (C,), as the output
    _carry_state(layer, conv, name, stacklevel=4)
    return layer


def _carry_state(layer: Module, conv: Module, name: str = "conv",
                 pairs: list[tuple[Tensor | None, Tensor | None]] | None = None, *,
                 stacklevel: int = 3) -> None:
    """What the weights do not hold. ``pairs`` (the layer's parameter, the one it was copied
    from): each takes its source's ``requires_grad``. Without them, a frozen ``conv`` gives a
    frozen layer, and partly frozen weights (which folded projections cannot split) are
    warned about. Hooks, which do not carry over, are warned about. ``name``: the
    argument's name in the warnings; ``stacklevel``: theirs, counted from here (3: the
    caller of the public function that called this one)."""
    kind = type(conv).__name__
    if pairs is not None:
        for ours, theirs in pairs:
            if ours is not None and theirs is not None:
                ours.requires_grad_(theirs.requires_grad)
    else:
        trainable = {p.requires_grad for p in conv.parameters()}
        if trainable == {False}:
            layer.requires_grad_(False)
        elif trainable == {False, True}:
            warnings.warn(f"{name} ({kind}) has some parameters frozen (requires_grad=False): "
                          f"the converted layer's parameters all require gradients; freeze "
                          f"those you want frozen again", stacklevel=stacklevel)
    hooks = [hook for hook in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                               "_backward_pre_hooks", "_message_forward_hooks")
             if getattr(conv, hook, None)]
    uncalled = [hook for hook in _UNCALLED_HOOKS if getattr(conv, hook, None)]
    if hooks:
        warnings.warn(f"{name} ({kind}) has hooks ({', '.join(hooks)}) that the converted "
                      f"layer does not have: register them on it again",
                      stacklevel=stacklevel)
    if uncalled:
        warnings.warn(f"{name} ({kind}) has hooks ({', '.join(uncalled)}) that the converted "
                      f"layer has no step for (it runs no propagate, aggregate or edge_update, "
                      f"and builds no messages): they are not carried over",
                      stacklevel=stacklevel)


def _in_channels(conv: Module, kind: str) -> int | tuple[int, int]:
    """``conv``'s ``in_channels`` as its weights have them: a lazy layer (``-1``, which PyG's
    ``to_hetero`` models use) keeps ``-1`` there after its first call."""
    if kind == "GATConv":
        lin = _shared_lin(conv)
        src, dst = (lin, lin) if lin is not None else (conv.lin_src, conv.lin_dst)
    elif kind == "GATv2Conv":
        src, dst = conv.lin_l, conv.lin_r
    else:
        src, dst = conv.lin_key, conv.lin_query
    if isinstance(conv.in_channels, int) and src.weight.size(1) == dst.weight.size(1):
        return src.weight.size(1)
    # (a lazy layer first called on sources and targets of two widths sized each side to its own)
    return src.weight.size(1), dst.weight.size(1)


def _edge_dim(conv: Module) -> int | None:
    """``conv``'s ``edge_dim`` as its edge projection has it: a lazy one (``-1``, sized by the
    first call with ``edge_attr``) keeps ``-1`` there."""
    if conv.edge_dim is None or conv.edge_dim > 0:
        return conv.edge_dim
    return conv.lin_edge.weight.size(1)


def _shared_lin(conv: Module) -> Module | None:
    """``GATConv.lin``, its one projection of sources and targets alike; ``None`` when it
    has two (``lin_src``, ``lin_dst``). Before PyG 2.6 it had no ``lin`` (nor ``residual``),
    and ``lin_src`` was ``lin_dst`` when they were shared."""
    return getattr(conv, "lin", None)


def _copy_gat(layer: GraphSelfAttention, conv: Module) -> None:
    """GATConv's attention vectors folded into lin_q / lin_k (and lin_edge); lin_v is W_src."""
    H, C = conv.heads, conv.out_channels
    lin = _shared_lin(conv)
    lin_src = lin if lin is not None else conv.lin_src
    lin_dst = lin if lin is not None else conv.lin_dst
    W_src = lin_src.weight.view(H, C, -1)  # (H, C, F_src)
    W_dst = lin_dst.weight.view(H, C, -1)  # (H, C, F_dst)
    layer.lin_q.weight.copy_(torch.einsum("hc,hcf->hf", conv.att_dst[0], W_dst))  # (H, F_dst)
    layer.lin_k.weight.copy_(torch.einsum("hc,hcf->hf", conv.att_src[0], W_src))  # (H, F_src)
    layer.lin_v.weight.copy_(lin_src.weight)
    if conv.lin_edge is not None:
        W_edge = conv.lin_edge.weight.view(H, C, -1)  # (H, C, edge_dim)
        layer.lin_edge.weight.copy_(torch.einsum("hc,hcd->hd", conv.att_edge[0], W_edge))


def _copy_gatv2(layer: GraphSelfAttention, conv: Module) -> None:
    """lin_r -> lin_q, lin_l -> lin_k (which is lin_v), att -> att, lin_edge -> lin_edge."""
    for ours, theirs in ((layer.lin_k, conv.lin_l), (layer.lin_q, conv.lin_r)):
        ours.weight.copy_(theirs.weight)  # shared weights: lin_q is lin_k, lin_r is lin_l
        if ours.bias is not None:  # with bias=True both have biases, else neither
            ours.bias.copy_(theirs.bias)
    layer.att.copy_(conv.att[0])
    if conv.lin_edge is not None:
        layer.lin_edge.weight.copy_(conv.lin_edge.weight)


def convert_pyg(module: Module, *, backend: str = "auto") -> Module:
    r"""Replace every ``GATConv``, ``GATv2Conv`` and ``TransformerConv`` inside ``module`` by
    the :class:`~graphattn.nn.GraphSelfAttention` of :func:`from_pyg`, in place.

    A model built from these layers (PyG's ``torch_geometric.nn.models.GAT``, say) then
    computes the same function on graphattn's kernels. Layers shared between places stay
    shared (one converted layer replaces them all). The new layers' parameters are new
    tensors: build the optimizer after converting.

    Args:
        module (torch.nn.Module): a model, or one PyG layer.
        backend (str, optional): the converted layers' ``backend``. (default: ``"auto"``)

    Returns:
        torch.nn.Module: ``module`` with its layers replaced, or the converted layer when
        ``module`` itself is one.
    """
    if not isinstance(module, Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    _check_layer_kind(False, backend)  # (checked where no layer is converted, too)
    if _kind(module) is not None:
        return _from_pyg(module, backend, "module")
    converted: dict[int, Module] = {}
    for prefix, parent in list(module.named_modules()):
        # _modules, not named_children(): a layer held twice by one parent (a ModuleList
        # [conv, conv], or self.a = self.b = conv) is listed once there
        for name, child in list(parent._modules.items()):
            if child is not None and _kind(child) is not None:
                if id(child) not in converted:  # (the warnings name it, e.g. "convs.0")
                    converted[id(child)] = _from_pyg(child, backend,
                                                     f"{prefix}.{name}" if prefix else name)
                setattr(parent, name, converted[id(child)])
    return module


def from_mha(mha: torch.nn.MultiheadAttention, *, dense: bool = False,
             backend: str = "auto") -> GraphSelfAttention | DenseSelfAttention:
    r"""The :class:`~graphattn.nn.GraphSelfAttention` (or, with ``dense=True``, the
    :class:`~graphattn.nn.DenseSelfAttention`) that computes what ``mha`` computes, with its
    weights copied: ``lin_q, lin_k, lin_v`` from ``in_proj_weight`` (or ``q_proj_weight,
    k_proj_weight, v_proj_weight``) and ``in_proj_bias``, ``lin_out`` from ``out_proj``.

    With ``x [L, D]`` and a graph ``edge_index`` on its L positions (no self-loops are added)

    .. math::
        \text{layer}(x, \text{edge\_index}) = \text{mha}(x, x, x,
        \text{attn\_mask} = \lnot M)[0], \qquad M_{ij} = [\, j \to i \in \text{edge\_index} \,]

    (``M = graphattn.graphs.to_dense_mask(edge_index, L)``; torch's boolean ``attn_mask`` marks
    the pairs that may *not* attend). On the complete graph that is ``mha(x, x, x)``. A
    ``mha`` with ``kdim = vdim`` other than ``embed_dim`` gives a bipartite layer: keys and
    values from ``x_src [L_k, kdim]``, queries from ``x_dst [L_q, embed_dim]``, as
    ``mha(x_dst, x_src, x_src)``. The dense layer takes ``x [L, D]`` or ``[B, L, D]`` with a
    mask in graphattn's convention (``True``: may attend), or ``is_causal=True``.

    Args:
        mha (torch.nn.MultiheadAttention): without ``add_bias_kv`` and ``add_zero_attn``, and
            with its keys and values of one size (``kdim == vdim``).
        dense (bool, optional): return a ``DenseSelfAttention``. (default: ``False``)
        backend (str, optional): the ``GraphSelfAttention``'s ``backend`` (unused with
            ``dense=True``). (default: ``"auto"``)

    Returns:
        GraphSelfAttention or DenseSelfAttention: on ``mha``'s device, in its dtype and
        training mode (its attention dropout included), each parameter frozen where the one
        it was copied from is (``requires_grad=False``).
    """
    if not isinstance(mha, torch.nn.MultiheadAttention):
        raise TypeError(f"mha must be a torch.nn.MultiheadAttention, got {type(mha).__name__}")
    _check_layer_kind(dense, backend)
    if mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError(f"mha must have add_bias_kv=False and add_zero_attn=False (they attend "
                         f"to keys that are no node), got add_bias_kv={mha.bias_k is not None}, "
                         f"add_zero_attn={mha.add_zero_attn}")
    if mha.kdim != mha.vdim:
        raise ValueError(f"mha must take keys and values of one size (both come from x_src), "
                         f"got kdim={mha.kdim}, vdim={mha.vdim}")
    D, H = mha.embed_dim, mha.num_heads
    bias = mha.in_proj_bias is not None
    if dense:
        if mha.kdim != D:
            raise ValueError(f"dense=True needs kdim = embed_dim ({D}): DenseSelfAttention "
                             f"attends within one sequence; got kdim={mha.kdim}")
        layer = DenseSelfAttention(D, D // H, heads=H, dropout=mha.dropout, bias=bias)
    else:
        in_channels = D if mha.kdim == D else (mha.kdim, D)
        layer = GraphSelfAttention(in_channels, D // H, heads=H, dropout=mha.dropout, bias=bias,
                                   add_self_loops=False, backend=backend)
    reference = mha.out_proj.weight
    layer = layer.to(device=reference.device, dtype=reference.dtype).train(mha.training)
    if mha.in_proj_weight is not None:
        weights = mha.in_proj_weight.chunk(3)  # (D, D) each
    else:
        weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
    with torch.no_grad():
        for i, lin in enumerate((layer.lin_q, layer.lin_k, layer.lin_v)):
            lin.weight.copy_(weights[i])
            if bias:
                lin.bias.copy_(mha.in_proj_bias[i * D:(i + 1) * D])
        layer.lin_out.weight.copy_(mha.out_proj.weight)
        if bias:
            layer.lin_out.bias.copy_(mha.out_proj.bias)
    in_bias = mha.in_proj_bias
    _carry_state(layer, mha, "mha", [
        *zip((layer.lin_q.weight, layer.lin_k.weight, layer.lin_v.weight), weights,
             strict=True),
        *((lin.bias, in_bias) for lin in (layer.lin_q, layer.lin_k, layer.lin_v)),
        (layer.lin_out.weight, mha.out_proj.weight), (layer.lin_out.bias, mha.out_proj.bias)])
    return layer


def _check_layer_kind(dense: bool, backend: str) -> None:
    """The checks of a converter's ``dense`` and ``backend`` (whose name is checked with
    ``dense=True`` too, where the layer made takes none)."""
    check_flag(dense, "dense")
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValueError(f"backend must be 'auto' or one of {list(BACKENDS)}, got {backend!r}")


def from_llama(attention: Module, *, dense: bool = False, backend: str = "auto",
               check: bool = True) -> GraphSelfAttention | DenseSelfAttention:
    r"""The :class:`~graphattn.nn.GraphSelfAttention` (or, with ``dense=True``, the
    :class:`~graphattn.nn.DenseSelfAttention`) that computes what a Hugging Face LLaMA-family
    self-attention computes, with its weights copied: ``lin_q, lin_k, lin_v, lin_out`` from
    ``q_proj, k_proj, v_proj, o_proj`` (or from the three parts of Phi-3's fused
    ``qkv_proj`` or ModernBERT's ``Wqkv``, or of GPT-NeoX's ``query_key_value``, which holds
    each head's query, key and value in turn; ``o_proj`` is ``dense`` in GPT-NeoX and Phi,
    ``out_proj`` in LFM2, ``Wo`` in ModernBERT), its rotary embedding as
    ``rotary=RotaryPE(head_dim,
    base=rope_theta)`` and its key and value heads as ``kv_heads`` (those ``k_proj`` gives,
    where they are not the config's ``num_key_value_heads``). Qwen3's and Gemma 3's RMS
    normalisation of each head's queries and keys (``q_norm``, ``k_norm``) comes over as
    ``qk_norm="rms"`` with its gains (Gemma's ``1 + weight``) and epsilon, OLMo 2's and
    OLMo 3's RMS normalisation of the whole query and key projections, all heads together, as
    ``qk_norm="rms_across_heads"``, a score scale
    other than ``head_dim ** -0.5`` (Gemma's ``query_pre_attn_scalar ** -0.5``) as
    ``scale``, Gemma 2's soft cap of the scores (``attn_logit_softcapping``) as ``softcap``,
    GPT-OSS's sink logit per head (``sinks``) as ``sinks=True``, a sigmoid gate of each
    head's output (Qwen3-Next's, the second half of each head's rows of a ``q_proj`` of twice
    the width, and MiniCPM5-MoE's, so laid out in its ``q_gate_proj``; AFMoE's, Beam's and
    HRM's ``gate_proj``, with Beam's ``gate_bias`` per head) as ``gate="elementwise"``,
    HunYuan's normalisation of the rotated queries and keys (``query_layernorm``,
    ``key_layernorm``) as ``qk_norm_after_rotary=True`` (found by the check below, which
    tries both orders), Gemma 4's RMS normalisation of the values without
    gains (``v_norm``) as ``v_norm=True``, the values of its global layers taken from
    ``k_proj`` (``attention_k_eq_v``; no ``v_proj``) as ``share_value=True``, and its
    "proportional" RoPE (a fraction of the planes turn, the others have frequency 0) as
    ``RotaryPE(head_dim, frequencies=)``, values of their own width per head (MiMo-V2's
    ``v_head_dim``) as ``out_channels`` beside ``score_channels=head_dim``, with its factor on
    the values (``v_scale``) folded into ``lin_v``, Chameleon's layer norms of each head's
    queries and keys with each head's gains as ``qk_norm="layer_per_head"``, TimesFM 2.5's
    learned scale of each query channel after its QK-norm (``softplus(scaling) log2(e) /
    sqrt(head_dim)``) folded into ``q_norm``'s gains with ``scale=1``, BitNet's RMS norm of
    the merged heads before ``o_proj`` (``attn_sub_norm``) as ``out_norm="rms"``, Seed-OSS's
    and ModernBERT's dropout of the output (``residual_dropout``, ``out_drop``) as
    ``out_dropout``, DiffLlama's
    differential attention as ``differential=True`` (its heads h and h + H/2 the two maps of
    one head, its value heads g and g + H_kv/2 one value), Dory's (nGPT's) projections onto
    the unit sphere of its queries, keys and merged heads (``x / sqrt(sum(x ** 2) + eps)``:
    RMS norms of gains ``1 / sqrt(width)``) with its scale of each rotated query channel
    (``sqk``) folded into ``q_norm``'s gains of each head and the one inside its output gate
    (``s_gate``) into ``lin_gate``'s rows, a projection
    without a bias beside biased ones (Voxtral Realtime's ``k_proj``) as a bias of 0 that is
    frozen (``requires_grad=False``: the layer trains the parameters the attention has),
    and where the config has one rotary embedding per kind of layer (Gemma 3's and
    OLMo 3's local and global layers) the one of the attention's ``layer_type`` (OLMo 3's
    ``attention_type``; else the config's ``layer_types`` at its ``layer_idx``). Where
    ``o_proj`` maps
    the ``heads * head_dim`` channels to another width (Qwen3-0.6B: 16 heads of 128 in a model
    of width 1024), ``lin_out`` is that ``Linear`` and the layer's output has that width.

    With ``x [L, D]`` and positions ``0 .. L-1``

    .. math::
        \text{layer}(x, \text{causal\_graph}(L), \text{pos}=0..L-1) =
        \text{attention}(x[\text{None}], \text{position\_embeddings}, \text{causal mask})

    and on any other graph over the L positions (a causal window, global tokens) the same
    attention restricted to the graph's edges, at the cost of the edges. A model's sliding
    window of w tokens (``attention.sliding_window``: Mistral's, and the local layers of
    Qwen2, Qwen3, Gemma 2, Gemma 3 and OLMo 3) is ``graphs.window_graph(L, w - 1,
    causal=True)``: Hugging Face's mask keeps the keys :math:`i - w < j \le i`; Llama 4's
    chunked attention (its layers with RoPE; ``config.attention_chunk_size``) is
    ``graphs.chunked_graph(L, attention_chunk_size)``; ModernBERT's encoder layers (which
    attend both ways) are the attention on ``graphs.complete_graph(L)`` (global layers) and on
    ``graphs.window_graph(L, config.sliding_window)`` (local ones). Gemma 4's layers that
    reuse an earlier layer's keys and values (KV sharing: no ``k_proj`` of their own) are
    refused by name, as are JetMoE's mixture of attention heads (``experts``). No self-loops
    are added. The dense layer takes ``x [B, L, D]`` with ``is_causal=True`` (``pos``
    defaults to ``0 .. L-1``).

    A multi-head latent attention (DeepSeek-V2's and V3's, with ``kv_a_proj_with_mqa``,
    ``kv_a_layernorm`` and ``kv_b_proj``, and ``q_a_proj``, ``q_a_layernorm`` and
    ``q_b_proj`` or a ``q_proj``) becomes a layer with ``q_rank``, ``kv_rank`` and
    ``shared_key_channels=qk_rope_head_dim`` (:mod:`graphattn.nn.latent`), ``score_channels
    = qk_nope_head_dim + qk_rope_head_dim`` and ``out_channels=v_head_dim``, each head's query
    and key channels reordered with the rotary ones first (where ``RotaryPE`` turns them);
    LongCat-Flash's factors on the queries and the latent are folded into ``q_b_proj`` and the
    latent's gains, Bailing's sigmoid gate of each head (``g_proj``) becomes ``gate=
    "headwise"``, and Kimi Linear's, which turns nothing, has ``rotary=None``. One whose
    indexer picks each query's keys (DeepSeek's sparse attention: DeepSeek-V3.2's,
    GLM-MoE-DSA's, HunYuan V4's) gets ``indexer=``
    :class:`~graphattn.nn.LightningIndexer`, its rotation found by the check (which keeps 4
    keys per token, so that the indexer's choice is checked too). Mistral 4's scale of its
    queries by position (``llama_4_scaling_beta``), as Llama 4's in its layers without RoPE
    (``attn_temperature_tuning``), becomes ``query_temperature=``
    :class:`~graphattn.pe.QueryTemperature`: call the layer with ``pos``. Refused by name:
    HunYuan V4's layers that reuse an earlier layer's choice of keys.

    Args:
        attention (torch.nn.Module): a module with ``q_proj``, ``k_proj``, ``v_proj`` and
            ``o_proj`` (``Linear``), ``head_dim`` and a ``config`` giving
            ``num_attention_heads``, ``num_key_value_heads`` (or the attention's
            ``num_key_value_groups``, where a model's layers differ) and the rotary embedding
            (``rope_parameters`` or ``rope_theta``: the default RoPE; one whose frequencies
            are rescaled once for all positions, ``"linear"``, LLaMA 3's ``"llama3"`` and
            ``"yarn"``, taken as ``RotaryPE(frequencies=, attention_factor=)`` from
            ``transformers``' own computation; LongRoPE, ``"longrope"`` (Phi-3), as
            ``RotaryPE(frequencies=short, long_frequencies=long, original_length=,
            attention_factor=)``; or dynamic NTK scaling, ``"dynamic"``, as
            ``RotaryPE(ntk_factor=factor, original_length=max_position_embeddings)``, which
            computes each call's frequencies from its largest position where ``transformers``
            keeps those of the longest sequence seen until a short one resets them), as
            ``transformers``' ``LlamaAttention`` (and ``MistralAttention``,
            ``Qwen2Attention``, ``Qwen3Attention``, ``Gemma2Attention``,
            ``Gemma3Attention``, ``Olmo2Attention``, ``Olmo3Attention``, and
            ``Phi3Attention`` with its ``qkv_proj``) have. ``q_norm`` and ``k_norm``, where it
            has them, must be RMSNorms over each head's channels or over the whole
            projection's (a ``weight`` and ``variance_epsilon`` or ``eps``, told apart from
            Gemma's form by running them; without a ``weight``, gains of 1: NanoChat's, which
            it applies after the rotation, where a norm without gains gives the same); Phi's
            and Persimmon's ``q_layernorm`` and ``k_layernorm`` (``torch.nn.LayerNorm`` over
            each head's channels) become ``qk_norm="layer"``, and LFM2's, RMSNorms under
            those names, ``qk_norm="rms"``; a soft cap on the scores
            (``attn_logit_softcapping``, Gemma 2's) becomes ``softcap``.
        dense (bool, optional): return a ``DenseSelfAttention``. (default: ``False``)
        backend (str, optional): the ``GraphSelfAttention``'s ``backend`` (unused with
            ``dense=True``). (default: ``"auto"``)
        check (bool, optional): run the attention and the converted layer on a probe before
            returning it, and refuse a conversion that does not compute what the attention
            computes (see below). ``False`` returns the layer unchecked. (default: ``True``)

    Returns:
        GraphSelfAttention or DenseSelfAttention: on the attention's device, in its dtype and
        training mode (its attention dropout included); frozen when the attention is (every
        parameter with ``requires_grad=False``); partly frozen weights, which the folded
        projections cannot always split, do not carry over: a warning says so.

    The attention's class does not say all it computes: models built like LLaMA differ in
    module-level functions (how the rotation pairs channels) and in steps inside ``forward``
    (a gate, an attention sink, a normalisation after the rotation, layers without a
    rotation). So the conversion is checked by running it: both, in float32 on the CPU, on 12
    random tokens at positions from 0 to 232 with the causal mask, the attention with the
    cosines and sines of its model family's rotary embedding module (the
    ``*RotaryEmbedding`` class beside it, built from its config), and the largest difference
    of the outputs must stay within 1e-3 of the largest output. A rotation that pairs
    channels as GPT-J does (Cohere's, GLM's, Ernie 4.5's, Helium's) is found that way and
    taken as ``RotaryPE(interleaved=True)``, one that turns each plane the other way
    (NanoChat's) as negated ``frequencies``, and a layer that rotates nothing (SmolLM3's
    layers without RoPE, Cohere 2's global layers) gets ``rotary=None`` (call it without
    ``pos``); an attention that still differs is refused by name
    (``NotImplementedError``), with the difference, where it would otherwise compute
    something else without a word.
    """
    _check_layer_kind(dense, backend)
    config = getattr(attention, "config", None)
    lins = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    if lins[0] is None:  # MiniCPM5-MoE's: each head's query, then its gate, as Qwen3-Next's
        lins[0] = getattr(attention, "q_gate_proj", None)
    for i, lin in enumerate(lins):  # Moshi's (and Kyutai's speech-to-text) Linear in a
        inner = getattr(lin, "linear", None)  # wrapper, or a weight per codebook, which one
        if isinstance(inner, torch.nn.Linear) and not isinstance(lin, torch.nn.Linear):
            lins[i] = inner
        elif isinstance(inner, Module) and getattr(lin, "use_flexible_linear", False):
            raise NotImplementedError(  # Linear cannot hold (Moshi's depth decoder's)
                f"{type(attention).__name__}'s projections hold a weight per codebook "
                f"({type(inner).__name__}), one for each position of its sequences: a layer "
                f"of one query, key, value and output projection cannot hold them")
    if lins[3] is None:  # GPT-NeoX's, Phi's and Persimmon's output projection; LFM2's;
        lins[3] = next((lin for lin in (getattr(attention, name, None)  # ModernBERT's
                                        for name in ("dense", "out_proj", "Wo"))
                        if lin is not None), None)
    if config is not None and isinstance(getattr(attention, "qkv_proj", None), torch.nn.Linear):
        lins[:3] = _split_qkv(attention.qkv_proj, config)  # Phi-3's one product for q, k, v
    modernbert_qkv = config is not None and isinstance(getattr(attention, "Wqkv", None),
                                                       torch.nn.Linear) and lins[0] is None
    if modernbert_qkv:  # ModernBERT's: [q; k; v] as Phi-3's, a key and value head per head
        lins[:3] = _split_qkv(attention.Wqkv, config, kv_heads=config.num_attention_heads)
    if getattr(attention, "is_kv_shared_layer", False) is True:  # Gemma 4's (and 3n's)
        raise NotImplementedError(
            f"{type(attention).__name__} (layer {getattr(attention, 'layer_idx', '?')}) takes "
            f"the keys and values of an earlier layer (KV sharing): it has no k_proj or v_proj "
            f"of its own, and a layer converted alone would have no keys; from_llama converts "
            f"the layers that compute their own")
    share_value = (lins[2] is None and isinstance(lins[1], torch.nn.Linear)
                   and getattr(attention, "use_alternative_attention", False) is True)
    if share_value:  # Gemma 4's global layers (attention_k_eq_v): the values are k_proj's
        lins[2] = lins[1]
    fused = getattr(attention, "query_key_value", None)
    per_head_qkv = config is not None and isinstance(fused, torch.nn.Linear) and lins[0] is None
    if per_head_qkv:
        lins[:3] = _split_per_head_qkv(fused, config)  # GPT-NeoX's, each head's q, k, v
    name = type(attention).__name__
    if config is not None and isinstance(getattr(attention, "experts", None), Module):
        raise NotImplementedError(  # JetMoE's mixture of attention heads
            f"{name} routes each token's queries and outputs through experts it picks per token "
            f"(experts: {type(attention.experts).__name__}): a layer of one query and output "
            f"projection cannot hold them, so from_llama does not convert it")
    if config is not None and isinstance(getattr(attention, "kv_a_proj_with_mqa", None),
                                         torch.nn.Linear):  # DeepSeek's multi-head latent
        layer = _from_latent_attention(attention, config, dense=dense, backend=backend,
                                       check=check)
        _carry_state(layer, attention, "attention")
        return layer
    if config is None or not all(isinstance(lin, torch.nn.Linear) for lin in lins):
        raise TypeError(f"attention must be a LLaMA-family self-attention with q_proj, k_proj, "
                        f"v_proj (or one qkv_proj or query_key_value) and o_proj (or dense) "
                        f"Linear layers and a config, got {type(attention).__name__}")
    q_proj, k_proj, v_proj, o_proj = lins
    heads = config.num_attention_heads
    groups = getattr(attention, "num_key_value_groups", None)  # the layer's own (a model's
    if isinstance(groups, int) and groups > 0 and heads % groups == 0:  # layers may differ)
        kv_heads = heads // groups
    elif per_head_qkv or modernbert_qkv:  # a key and value per head, whatever the config holds
        kv_heads = heads
    else:
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = (getattr(attention, "head_dim", None) or getattr(attention, "head_size", None)
                or q_proj.out_features // heads)
    # the values' channels per head, where they are not the queries' and keys' (MiMo-V2's)
    v_dim = getattr(attention, "v_head_dim", None)
    v_dim = v_dim if isinstance(v_dim, int) and v_dim > 0 else head_dim
    own = k_proj.out_features // max(head_dim, 1)  # the key heads k_proj gives
    if (k_proj.out_features != kv_heads * head_dim and own * head_dim == k_proj.out_features
            and v_proj.out_features == own * v_dim and own and heads % own == 0):
        kv_heads = own  # a module that reads no key head count from its config (ModernBERT's
        # decoder, given a config that holds one)
    hidden = q_proj.in_features
    try:
        layer_type, base, factor, rope_args = _rotary_settings(attention, config)
    except _NoRotation:
        raise NotImplementedError(
            f"from_llama converts the attentions of the LLaMA family, which turn their queries "
            f"and keys by a rotary embedding: the config of {name} gives no rope_theta (nor "
            f"rope_parameters['rope_theta'])") from None
    # a learned scale of each query channel after the QK-norm, folded into its gains
    query_gains, scaling = _query_gains(attention, heads, head_dim, kv_heads)
    if not isinstance(scaling, (int, float)):
        raise NotImplementedError(
            f"{type(attention).__name__}'s score scale is a {type(scaling).__name__}, not a "
            f"number: from_llama converts one number, as the layers' scale (or a learned scale "
            f"of each of the head_dim query channels after a QK-norm, TimesFM 2.5's)")
    scaling = float(scaling)
    scale = None if math.isclose(scaling, head_dim ** -0.5, rel_tol=1e-12) else scaling
    softcap = getattr(attention, "attn_logit_softcapping", None)
    if o_proj.in_features != heads * v_dim:
        raise ValueError(f"o_proj must take heads * head_dim = {heads * v_dim} features, "
                         f"got o_proj {o_proj.in_features} -> {o_proj.out_features}")
    gate, gate_lin, q_proj = _output_gate(attention, q_proj, heads, head_dim)
    lins[0] = q_proj
    gate_bias = getattr(attention, "gate_bias", None)  # Beam's, one per head
    if gate is None or not (isinstance(gate_bias, Tensor) and tuple(gate_bias.shape) == (heads,)):
        gate_bias = None
    for name, lin, count, heads_name, width in (
            ("q_proj", q_proj, heads, "heads", head_dim),
            ("k_proj", k_proj, kv_heads, "kv_heads", head_dim),
            ("v_proj", v_proj, kv_heads, "kv_heads", v_dim)):
        if lin.out_features != count * width:
            raise NotImplementedError(
                f"{name} gives {lin.out_features} features where its heads take "
                f"{count * width} ({heads_name} {count} x head_dim {width}): the "
                f"attention computes something besides them, which from_llama does not "
                f"convert")
    qk_norm, norms = _qk_norms(attention, head_dim, heads, kv_heads) or (None, None)
    if query_gains is not None and query_gains.dim() == 2 and qk_norm in ("rms", "layer"):
        # gains of each head's channel (Dory's) on norms whose gains the heads share: each
        # head its own, as they were
        qk_norm += "_per_head"
        norms = tuple((gains.expand(count, head_dim).clone(), eps,
                       None if shift is None else shift.expand(count, head_dim).clone())
                      for (gains, eps, shift), count in zip(norms, (heads, kv_heads),
                                                            strict=True))
    gate_scale = getattr(attention, "s_gate", None)  # Dory's factor inside the output gate
    if isinstance(gate_scale, Tensor) and gate_lin is not None and tuple(gate_scale.shape) == (
            gate_lin.out_features,):
        gate_scale = (gate_scale.detach() * getattr(attention, "s_gate_scale", 1.0)).square()
    else:
        gate_scale = None
    # the layer's projections all have biases or none: with one of the attention's biased
    # (Voxtral Realtime's and Whisper's k_proj has no bias beside biased q_proj and v_proj),
    # each bias the attention has not is 0 and frozen, so the layer trains the parameters the
    # attention has
    bias = gate_bias is not None or any(lin is not None and lin.bias is not None
                                        for lin in (*lins, gate_lin))
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    temperature = None
    if getattr(attention, "attn_temperature_tuning", False) and not getattr(
            attention, "use_rope", True):  # Llama 4's layers without RoPE
        # log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 at position p
        temperature = QueryTemperature(attention.attn_scale, attention.floor_scale, offset=1)
    # a dropout of the attention's output after o_proj: Seed-OSS's residual_dropout,
    # ModernBERT's out_drop (of p = attention_dropout)
    out_dropout = getattr(attention, "residual_dropout", 0.0)
    out_drop = getattr(attention, "out_drop", None)
    if isinstance(out_drop, torch.nn.Dropout):
        out_dropout = out_drop.p
    out_dropout = float(out_dropout) if isinstance(out_dropout, (int, float)) else 0.0
    v_norm = _v_norm_eps(attention, v_dim)  # Gemma 4's RMS norm of the values, or None
    out_norm = _out_norm(attention, heads * v_dim)  # BitNet's norm before o_proj, or None
    v_scale = getattr(attention, "v_scale", 1.0)  # MiMo-V2's factor on the values
    if not isinstance(v_scale, (int, float)) or not math.isfinite(v_scale):
        raise NotImplementedError(f"{type(attention).__name__}'s v_scale is a "
                                  f"{type(v_scale).__name__}, not a number: from_llama folds "
                                  f"one number into the values' projection")
    if v_scale != 1.0 and share_value:
        raise NotImplementedError(f"{type(attention).__name__} scales its values, which are "
                                  f"its keys' projection (v_scale={v_scale}): from_llama folds "
                                  f"the factor into a projection of the values alone")
    rotary = RotaryPE(int(head_dim * factor), base=float(base), **rope_args)
    sinks = getattr(attention, "sinks", None)  # GPT-OSS's logit per head
    if not (isinstance(sinks, Tensor) and tuple(sinks.shape) == (heads,)):
        sinks = None
    options = dict(dropout=dropout, bias=bias, rotary=rotary, kv_heads=kv_heads,
                   qk_norm=qk_norm, qk_norm_after_rotary=query_gains is not None,
                   scale=scale, softcap=softcap, sinks=sinks is not None,
                   gate=gate, v_norm=v_norm is not None, share_value=share_value,
                   out_dropout=out_dropout, query_temperature=temperature,
                   score_channels=head_dim, out_norm=None if out_norm is None else "rms")
    differential = _differential(attention, head_dim, heads, kv_heads)  # DiffLlama's, or None
    layer_heads, layer_v_dim = heads, v_dim
    if differential is not None:  # head h and head h + heads/2 are one head's two maps
        if gate is not None or share_value:
            raise NotImplementedError(f"{type(attention).__name__}'s differential attention "
                                      f"beside an output gate or values from k_proj")
        layer_heads, layer_v_dim = heads // 2, 2 * v_dim
        options.update(kv_heads=kv_heads // 2, differential=True,
                       lambda_init=differential[0])
        lins[2] = _paired_values(v_proj, kv_heads, v_dim)
    if dense:
        layer = DenseSelfAttention(hidden, layer_v_dim, layer_heads, **options)
    else:
        layer = GraphSelfAttention(hidden, layer_v_dim, layer_heads, add_self_loops=False,
                                   backend=backend, **options)
    if o_proj.out_features != heads * v_dim:  # e.g. Qwen3-0.6B: 16 x 128 -> 1024
        layer.lin_out = torch.nn.Linear(heads * v_dim, o_proj.out_features, bias=bias)
    layer = layer.to(device=o_proj.weight.device, dtype=o_proj.weight.dtype)
    layer.train(attention.training)
    with torch.no_grad():
        for lin, source in zip((layer.lin_q, layer.lin_k, layer.lin_v, layer.lin_out,
                                layer.lin_gate), (*lins, gate_lin), strict=True):
            if lin is None:  # (no gate)
                continue
            lin.weight.copy_(source.weight)
            if lin.bias is not None and source.bias is not None:
                lin.bias.copy_(source.bias)
            elif lin.bias is not None:  # a bias the attention has not: 0, frozen (but Beam's
                lin.bias.zero_()  # gate_bias, added below)
                lin.bias.requires_grad_(lin is layer.lin_gate and gate_bias is not None)
        for norm, (weight, eps, shift) in zip((layer.q_norm, layer.k_norm), norms or (),
                                              strict=False):
            norm.weight.copy_(weight)
            norm.eps = eps
            if shift is not None:  # a LayerNorm's bias
                norm.bias.copy_(shift)
        if query_gains is not None:  # onto [c], [H, c] or [H * c] gains
            for param in (layer.q_norm.weight, getattr(layer.q_norm, "bias", None)):
                if param is not None:  # (a LayerNorm's bias too)
                    gains = (query_gains if query_gains.numel() == param.numel()
                             else query_gains.expand(heads, head_dim))
                    param.mul_(gains.reshape(param.shape))
        if gate_scale is not None:  # sigmoid(gate_proj(x) * s): s folded into its rows
            layer.lin_gate.weight.mul_(gate_scale[:, None])
            if layer.lin_gate.bias is not None:
                layer.lin_gate.bias.mul_(gate_scale)
        if sinks is not None:
            layer.sinks.copy_(sinks)
        if v_norm is not None:
            layer.v_norm.eps = v_norm
        if out_norm is not None:
            layer.o_norm.weight.copy_(out_norm[0])
            layer.o_norm.eps = out_norm[1]
        if differential is not None:
            for ours, theirs in zip((layer.lambda_q1, layer.lambda_k1, layer.lambda_q2,
                                     layer.lambda_k2), differential[1], strict=True):
                ours.copy_(theirs)
            layer.diff_norm.weight.fill_(1.0)  # (DiffLlama's norm has no gains: frozen at 1)
            layer.diff_norm.weight.requires_grad_(False)
            layer.diff_norm.eps = differential[2]
        if v_scale != 1.0:  # MiMo-V2's factor on the values, folded into their projection
            layer.lin_v.weight.mul_(v_scale)
            if layer.lin_v.bias is not None:
                layer.lin_v.bias.mul_(v_scale)
        if gate_bias is not None:  # each head's, on each of its channels' gates
            layer.lin_gate.bias.add_(gate_bias.repeat_interleave(
                layer.lin_gate.out_features // heads))
    if check_flag(check, "check"):
        # the rotation as LLaMA pairs channels, as GPT-J does, turned the other way, or none:
        # the first that computes what the attention computes
        interleaved = RotaryPE(int(head_dim * factor), base=float(base), interleaved=True,
                               **rope_args)
        turned_back = _turned_back(rotary)
        rotations = [rotary, interleaved] + ([turned_back] if turned_back is not None else [])
        _check_conversion(attention, layer, layer_type, tuple(
            rotation.to(o_proj.weight.device) for rotation in rotations) + (None,))
    _carry_state(layer, attention, "attention")
    return layer


class _NoRotation(ValueError):
    """A config without a rotary embedding (no ``rope_theta``)."""


def _rotary_settings(attention: Module, config) -> tuple[str | None, float, float, dict]:
    """The kind of layer whose rotary embedding the attention takes (``None`` where the
    config has one for all), its base, the fraction of each head's channels it turns and
    ``RotaryPE``'s other arguments."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    # the kind of layer, where the config has one rotary embedding per kind (Gemma 3's
    # layer_type, OLMo 3's attention_type: "sliding_attention" or "full_attention"; else the
    # config's layer_types at the attention's layer_idx)
    layer_type = getattr(attention, "layer_type", None) or getattr(attention, "attention_type",
                                                                   None)
    layer_types, layer_idx = getattr(config, "layer_types", None), getattr(attention,
                                                                          "layer_idx", None)
    if layer_type is None and isinstance(layer_idx, int) and isinstance(layer_types, list) and (
            0 <= layer_idx < len(layer_types)):
        layer_type = layer_types[layer_idx]
    if isinstance(rope.get(layer_type), dict):
        rope = dict(rope[layer_type])
    else:
        layer_type = None
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    base = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if base is None:
        raise _NoRotation("the attention's config gives no rope_theta for its rotary embedding")
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if rope_type == "proportional":  # every channel, with frequencies of 0 past the factor's
        factor = 1.0
    return layer_type, float(base), factor, _rope_arguments(config, rope, rope_type, layer_type)


def _from_latent_attention(attention: Module, config, *, dense: bool, backend: str,
                           check: bool) -> GraphSelfAttention | DenseSelfAttention:
    """:func:`from_llama` of a multi-head latent attention (DeepSeek-V2's and V3's MLA):
    ``q_proj`` or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` (``q_rank``);
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` (``kv_rank``, with the rotary key
    channels shared by the heads: ``shared_key_channels``); ``o_proj``. Each head's query
    and key channels are reordered rotary channels first, where ``RotaryPE`` turns them."""
    name = type(attention).__name__
    hf_indexer = getattr(attention, "indexer", False)
    if hf_indexer is None:  # (HunYuan V4's "shared" layers)
        raise NotImplementedError(
            f"{name} (layer {getattr(attention, 'layer_idx', '?')}) has no indexer of its own "
            f"and attends over the keys an earlier layer's indexer picked: a layer converted "
            f"alone would have no graph to attend over; from_llama converts the layers with an "
            f"indexer (their graph then serves the others: GraphSelfAttention(indexer=) "
            f"returns it with return_attention_weights=True)")
    heads = config.num_attention_heads
    nope, rot, v_dim = (getattr(attention, key, getattr(config, key, None)) for key in (
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_rank, kv_rank = (getattr(attention, key, getattr(config, key, None))
                       for key in ("q_lora_rank", "kv_lora_rank"))
    kv_a, kv_norm, kv_b = (getattr(attention, key, None) for key in (
        "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"))
    q_parts = ([getattr(attention, "q_proj", None)] if q_rank is None else
               [getattr(attention, key, None) for key in ("q_a_proj", "q_a_layernorm",
                                                          "q_b_proj")])
    o_proj = getattr(attention, "o_proj", None)
    lins = [*q_parts[::2], kv_a, kv_b, o_proj]  # (the Linear modules)
    dims = (nope, rot, v_dim, kv_rank) + (() if q_rank is None else (q_rank,))
    C_qk = (nope + rot) if all(isinstance(d, int) for d in dims) else None
    if not (C_qk and all(isinstance(lin, torch.nn.Linear) for lin in lins)
            and kv_a.out_features == kv_rank + rot and kv_b.in_features == kv_rank
            and kv_b.out_features == heads * (nope + v_dim) and kv_b.bias is None
            and q_parts[-1].out_features == heads * C_qk and o_proj.in_features == heads * v_dim
            and (q_rank is None or (q_parts[0].out_features == q_rank
                                    and q_parts[2].bias is None))):
        raise NotImplementedError(
            f"{name} is not built as DeepSeek's multi-head latent attention: from_llama "
            f"converts q_proj (or q_a_proj, q_a_layernorm and q_b_proj without a bias) of "
            f"heads x (qk_nope_head_dim + qk_rope_head_dim) outputs, kv_a_proj_with_mqa of "
            f"kv_lora_rank + qk_rope_head_dim, kv_a_layernorm, kv_b_proj without a bias of "
            f"heads x (qk_nope_head_dim + v_head_dim) and o_proj of heads x v_head_dim inputs")
    like = kv_a.weight
    norms = [_rms_norm(norm, width, like) for norm, width in (
        (kv_norm, kv_rank), *(() if q_rank is None else ((q_parts[1], q_rank),)))]
    if any(norm is None for norm in norms):
        raise NotImplementedError(
            f"from_llama converts the latent attention's kv_a_layernorm and q_a_layernorm as "
            f"RMSNorms over the latent's channels, g * x / sqrt(mean(x ** 2) + eps); got "
            f"{_described(kv_norm)} and {_described(q_parts[1] if q_rank else None)}")
    rope = getattr(config, "rope_parameters", None) or {}
    temperature = None
    if rope.get("llama_4_scaling_beta"):  # Mistral 4's: 1 + beta log(1 + floor(p / L0))
        temperature = QueryTemperature(rope["llama_4_scaling_beta"],
                                       rope["original_max_position_embeddings"])
    try:
        layer_type, base, _, rope_args = _rotary_settings(attention, config)
        rotary = RotaryPE(rot, base=base, interleaved=bool(getattr(config, "rope_interleave",
                                                                    False)), **rope_args)
    except _NoRotation:  # (Kimi Linear's latent attention turns nothing)
        rotary = rope_args = layer_type = None
    # LongCat-Flash's factors on the queries and on the normalised latent, folded into q_b_proj
    # and the latent's gains
    q_factor, kv_factor = (getattr(attention, key, 1.0) for key in ("mla_scale_q_lora",
                                                                    "mla_scale_kv_lora"))
    # a sigmoid gate of each head's output (Bailing's g_proj) or of each of its channels
    gate_proj = next((lin for lin in (getattr(attention, key, None) for key in (
        "g_proj", "gate_proj", "q_gate_proj")) if isinstance(lin, torch.nn.Linear)
        and lin.out_features in (heads, heads * v_dim)), None)
    scaling = getattr(attention, "scaling", C_qk ** -0.5)
    if not all(isinstance(f, (int, float)) for f in (q_factor, kv_factor, scaling)):
        raise NotImplementedError(f"{name}'s scaling, mla_scale_q_lora and mla_scale_kv_lora "
                                  f"must be numbers for from_llama to fold them in")
    bias = any(lin.bias is not None for lin in lins + [gate_proj] if lin is not None)
    scaling = float(scaling)
    sinks = getattr(attention, "sinks", None)  # (HunYuan V4's logit per head, GPT-OSS's)
    sinks = sinks if isinstance(sinks, Tensor) and tuple(sinks.shape) == (heads,) else None
    options = dict(dropout=float(getattr(config, "attention_dropout", 0.0) or 0.0), bias=bias,
                   rotary=rotary, score_channels=C_qk, q_rank=q_rank, kv_rank=kv_rank,
                   shared_key_channels=rot, sinks=sinks is not None,
                   query_temperature=temperature, gate=None if gate_proj is None else (
                       "headwise" if gate_proj.out_features == heads else "elementwise"),
                   scale=None if math.isclose(scaling, C_qk ** -0.5, rel_tol=1e-12) else scaling)
    hidden = kv_a.in_features
    if isinstance(hf_indexer, Module):
        if rotary is None:
            raise NotImplementedError(f"{name} has an indexer but its config gives no rotary "
                                      f"embedding (rope_theta), which from_llama does not "
                                      f"convert")
        options["indexer"] = _lightning_indexer(hf_indexer, name, hidden, q_rank, RotaryPE(
            rot, base=base, **rope_args))
    layer = (DenseSelfAttention(hidden, v_dim, heads, **options) if dense else
             GraphSelfAttention(hidden, v_dim, heads, add_self_loops=False, backend=backend,
                                **options))
    if o_proj.out_features != heads * v_dim:
        layer.lin_out = torch.nn.Linear(heads * v_dim, o_proj.out_features, bias=bias)
    layer = layer.to(device=like.device, dtype=like.dtype)
    layer.train(attention.training)
    # each head's query rows [nope; rotary] as [rotary; nope], where RotaryPE turns them
    order = torch.cat([torch.arange(nope, C_qk), torch.arange(nope)])
    order = (order + C_qk * torch.arange(heads)[:, None]).flatten().to(like.device)
    lin_q, lin_k = layer.lin_q, layer.lin_k
    pairs = [(lin_k.down, kv_a, None), (lin_k.up, kv_b, None), (layer.lin_out, o_proj, None),
             (layer.lin_gate, gate_proj, None)]
    pairs += ([(lin_q, q_parts[0], order)] if q_rank is None else
              [(lin_q.down, q_parts[0], None), (lin_q.up, q_parts[2], order)])
    with torch.no_grad():
        for ours, theirs, rows in pairs:
            if theirs is None:  # (no gate)
                continue
            ours.weight.copy_(theirs.weight if rows is None else theirs.weight[rows])
            if ours.bias is not None and theirs.bias is not None:
                ours.bias.copy_(theirs.bias if rows is None else theirs.bias[rows])
            elif ours.bias is not None:  # a bias the attention has not: 0, frozen
                ours.bias.zero_()
                ours.bias.requires_grad_(False)
        if sinks is not None:
            layer.sinks.copy_(sinks)
        if isinstance(hf_indexer, Module):
            _load_indexer(layer.indexer, hf_indexer, rotated_last=False)
        for norm, (gains, eps) in zip((lin_k.norm, getattr(lin_q, "norm", None)), norms,
                                      strict=False):
            norm.weight.copy_(gains)
            norm.eps = eps
        lin_k.norm.weight.mul_(kv_factor)
        for param in (getattr(lin_q, "up", lin_q).weight, getattr(lin_q, "up", lin_q).bias):
            if param is not None:
                param.mul_(q_factor)
    if check_flag(check, "check"):
        rotations = [None]
        if rotary is not None:  # (and none, except where an indexer needs the positions)
            other = RotaryPE(rot, base=base, interleaved=not rotary.interleaved, **rope_args)
            turned_back = _turned_back(rotary)
            rotations = [rotary, other] + ([turned_back] if turned_back is not None else []) + (
                [] if isinstance(hf_indexer, Module) else [None])
        rotations = tuple(None if rotation is None else rotation.to(like.device)
                          for rotation in rotations)
        if not isinstance(hf_indexer, Module):
            _check_conversion(attention, layer, layer_type, rotations)
            return layer
        # the indexer's rotation as LLaMA pairs channels (DeepSeek-V3.2's) or as GPT-J does
        # (GLM-MoE-DSA's), on its first channels or its last (HunYuan V4's); checked with both
        # keeping the top _CHECK_TOP_K keys of the check's tokens, so that the choice matters
        top_k, hf_top_k = layer.indexer.top_k, hf_indexer.index_topk
        layer.indexer.top_k = hf_indexer.index_topk = min(top_k, _CHECK_TOP_K)
        try:
            for interleaved, last in ((False, False), (True, False), (False, True),
                                      (True, True)):
                layer.indexer.rotary = RotaryPE(rot, base=base, interleaved=interleaved,
                                                **rope_args).to(like.device)
                _load_indexer(layer.indexer, hf_indexer, rotated_last=last)
                try:
                    _check_conversion(attention, layer, layer_type, rotations)
                    return layer
                except NotImplementedError as error:
                    failure = error
            raise failure
        finally:
            layer.indexer.top_k, hf_indexer.index_topk = top_k, hf_top_k
    return layer


def _load_indexer(ours: LightningIndexer, theirs: Module, *, rotated_last: bool) -> None:
    """Copy the weights of DeepSeek-V3.2's indexer ``theirs`` into ``ours``; with
    ``rotated_last`` its rotated channels are the last of each query and of the key, and come
    first in ours (where ``RotaryPE`` turns them)."""
    D, R = ours.channels, ours.rotary.dim
    order = (torch.cat([torch.arange(D - R, D), torch.arange(D - R)]) if rotated_last
             else torch.arange(D)).to(ours.lin_k.weight.device)
    with torch.no_grad():
        ours.lin_q.weight.copy_(theirs.wq_b.weight.view(ours.heads, D, -1)[:, order].flatten(0, 1))
        ours.lin_k.weight.copy_(theirs.wk.weight[order])
        ours.k_norm.weight.copy_(theirs.k_norm.weight[order])
        ours.k_norm.bias.copy_(theirs.k_norm.bias[order])
        ours.k_norm.eps = theirs.k_norm.eps
        ours.lin_w.weight.copy_(theirs.weights_proj.weight)


def _lightning_indexer(indexer: Module, name: str, hidden: int, q_rank: int | None,
                       rotary: RotaryPE) -> LightningIndexer:
    """A :class:`LightningIndexer` shaped as DeepSeek-V3.2's indexer ``indexer`` (``wq_b`` from
    the query latent, ``wk``, ``k_norm``, ``weights_proj``, ``index_topk``; its rotation
    rotate-half, on the first channels): its weights are copied in by the caller. Refused by
    name where it is built otherwise (the check refuses what computes otherwise)."""
    parts = [getattr(indexer, key, None) for key in ("wq_b", "wk", "weights_proj")]
    k_norm = getattr(indexer, "k_norm", None)
    heads, dim, top_k = (getattr(indexer, key, None) for key in ("n_heads", "head_dim",
                                                               "index_topk"))
    if not (all(isinstance(lin, torch.nn.Linear) and lin.bias is None for lin in parts)
            and isinstance(k_norm, torch.nn.LayerNorm) and k_norm.bias is not None
            and all(isinstance(n, int) and n > 0 for n in (heads, dim, top_k))
            and parts[0].in_features == (q_rank or hidden)
            and parts[0].out_features == heads * dim and parts[1].out_features == dim
            and tuple(k_norm.normalized_shape) == (dim,) and parts[2].out_features == heads
            and math.isclose(getattr(indexer, "softmax_scale", dim ** -0.5), dim ** -0.5)):
        raise NotImplementedError(
            f"{name}'s indexer ({type(indexer).__name__}) is not built as DeepSeek-V3.2's, "
            f"which from_llama converts: wq_b from the query latent, wk, a LayerNorm k_norm "
            f"and weights_proj without biases, n_heads, head_dim and index_topk")
    return LightningIndexer(hidden, heads, dim, top_k, query_channels=q_rank, rotary=rotary)


def _output_gate(attention: Module, q_proj: torch.nn.Linear, heads: int, head_dim: int,
                 ) -> tuple[str | None, torch.nn.Linear | None, torch.nn.Linear]:
    """The attention's sigmoid gate of its output as the layers' ``gate``, the projection that
    computes it, and the query projection: a ``gate_proj`` of ``heads * head_dim`` outputs
    (``"elementwise"``: AFMoE's, HRM's) or ``heads`` (``"headwise"``), or Qwen3-Next's
    ``q_proj`` of twice the queries' width, whose rows hold each head's query, then its gate
    (split in two here); ``(None, None, q_proj)`` without a gate."""
    gate_proj = getattr(attention, "gate_proj", None)
    width = heads * head_dim
    if isinstance(gate_proj, torch.nn.Linear) and gate_proj.out_features in (width, heads):
        return "elementwise" if gate_proj.out_features == width else "headwise", gate_proj, q_proj
    if q_proj.out_features != 2 * width:
        return None, None, q_proj
    parts = []
    for part in range(2):  # (0: the queries, 1: the gates)
        lin = torch.nn.Linear(q_proj.in_features, width, bias=q_proj.bias is not None,
                              device=q_proj.weight.device, dtype=q_proj.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(q_proj.weight.view(heads, 2, head_dim, -1)[:, part].flatten(0, 1))
            if lin.bias is not None:
                lin.bias.copy_(q_proj.bias.view(heads, 2, head_dim)[:, part].flatten())
        parts.append(lin)
    return "elementwise", parts[1], parts[0]


def _turned_back(rotary: RotaryPE) -> RotaryPE | None:
    """``rotary`` turning each plane the other way, by the angles of ``-pos`` (NanoChat's
    rotate_half flips the other half's sign); ``None`` for the rotations whose angles depend on
    the call's positions (dynamic NTK, LongRoPE)."""
    if rotary.ntk_factor is not None or rotary.long_frequencies is not None:
        return None
    group = rotary.dim // rotary.axes
    frequencies = (rotary.frequencies if rotary.frequencies is not None else 1.0 / (
        rotary.base ** (torch.arange(0, group, 2, dtype=torch.float64) / group)))
    return RotaryPE(rotary.dim, axes=rotary.axes, interleaved=rotary.interleaved,
                    frequencies=-frequencies, attention_factor=rotary.attention_factor)


# the positions of from_llama's check: 12 tokens spread up to 232, so that the slow planes of
# a rotation turn too, within the trained length of any model
_CHECK_POSITIONS = (0, 1, 2, 4, 7, 12, 20, 33, 54, 88, 143, 232)
_CHECK_TOLERANCE = 1e-3  # of the largest output; the converted features differ by 1e-1 and more
_CHECK_TOP_K = 4  # the keys an indexer keeps per token in the check (of up to 12)


def _check_conversion(attention: Module, layer: GraphSelfAttention | DenseSelfAttention,
                      layer_type: str | None, rotaries: tuple[RotaryPE | None, ...]) -> None:
    """Give ``layer`` the first of ``rotaries`` with which it computes what ``attention``
    computes on the check of :func:`from_llama`, within ``_CHECK_TOLERANCE`` of the largest
    output; raise ``NotImplementedError`` when none does, or when the check cannot run the
    attention."""
    name = type(attention).__name__
    escape = "from_llama(..., check=False) converts it unchecked"
    L = len(_CHECK_POSITIONS)
    pos = torch.tensor(_CHECK_POSITIONS)
    if getattr(attention, "attn_temperature_tuning", False) and not getattr(
            attention, "use_rope", True):  # Llama 4's layers without RoPE take the
        pos = torch.arange(L)  # temperature's positions from the tokens, not position_ids
    x = torch.randn(1, L, layer.lin_q.in_features, generator=torch.Generator().manual_seed(0))
    try:
        want = _attention_output(attention, layer_type, x, pos)
    except Exception as error:  # the family's own code, in any of its ways to fail
        raise NotImplementedError(
            f"from_llama could not run {name} to check the conversion "
            f"({type(error).__name__}: {error}); {escape}") from error
    errors = []
    # the normalisation of the queries and keys where the conversion put it (before the
    # rotation, or after it where gains act on the rotated queries), else on the other side
    # (HunYuan's after)
    first = layer.qk_norm_after_rotary
    placements = (first, not first) if layer.qk_norm is not None else (first,)
    for after, rotary in ((after, rotary) for after in placements for rotary in rotaries):
        layer.rotary, layer.qk_norm_after_rotary = rotary, after
        got = _layer_output(layer, x, pos)
        errors.append(((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
        if errors[-1] <= _CHECK_TOLERANCE:
            return
    raise NotImplementedError(
        f"{name} does not compute what its conversion computes: on from_llama's check the "
        f"outputs differ by {min(errors):.3g} of the largest output or more (within "
        f"{_CHECK_TOLERANCE:g} passes), with the rotary embedding's channels paired as in "
        f"LLaMA or as in GPT-J, turned the other way, or no rotation (and its queries' and "
        f"keys' normalisation before or after it). It computes something from_llama does not "
        f"convert (in code the converter does not read); {escape}")


def _attention_output(attention: Module, layer_type: str | None, x: Tensor,
                      pos: Tensor) -> Tensor:
    """``attention`` on ``x [1, L, D]`` at positions ``pos [L]`` under the causal mask: a copy
    in float32 on the CPU, in eval mode and its eager implementation, with the cosines and
    sines of its model's rotary embedding module. ``[1, L, D_out]``."""
    hf = copy.deepcopy(attention).float().cpu().eval()
    hf.config._attn_implementation = "eager"  # (the copy's config)
    parameters = inspect.signature(hf.forward).parameters
    try:
        embedding = _family_rotary_embedding(hf)
    except LookupError:  # (an attention that takes no cosines and sines, Kimi Linear's, has
        if "position_embeddings" in parameters:  # none beside it)
            raise
        embedding = None
    L = x.size(1)
    mask = torch.full((L, L), float("-inf")).triu(1)[None, None]  # (1, 1, L, L)
    kinds = ({"layer_type": layer_type} if embedding is not None and "layer_type" in
             inspect.signature(embedding.forward).parameters else {})
    # (Gemma 4's forward takes the keys and values its layers share: none here)
    shared = {"shared_kv_states": {}} if "shared_kv_states" in parameters else {}
    with torch.no_grad():
        if embedding is not None:
            shared["position_embeddings"] = embedding(x, pos[None], **kinds)
        return hf(x, attention_mask=mask, position_ids=pos[None], **shared)[0]


def _layer_output(layer: GraphSelfAttention | DenseSelfAttention, x: Tensor,
                  pos: Tensor) -> Tensor:
    """``layer`` on ``x [1, L, D]`` at positions ``pos [L]`` on the causal graph (dense:
    ``is_causal``): a copy in float32 on the CPU, in eval mode, the graph layer on the
    ``reference`` backend. ``[1, L, D_out]``."""
    ours = copy.deepcopy(layer).float().cpu().eval()
    positions = ({} if ours.rotary is None and ours.query_temperature is None
                 else {"pos": pos})
    with torch.no_grad():
        if isinstance(ours, DenseSelfAttention):
            return ours(x, is_causal=True, **positions)
        ours.backend = "reference"
        return ours(x[0], causal_graph(x.size(1)), **positions)[None]


def _family_rotary_embedding(attention: Module) -> Module:
    """The rotary embedding module of ``attention``'s model family, built from its config: the
    ``*RotaryEmbedding`` class of the attention's own module whose name shares the longest
    beginning with the attention's (``LlamaRotaryEmbedding`` for ``LlamaAttention``)."""
    module = sys.modules.get(type(attention).__module__)
    classes = {name: value for name, value in vars(module or object()).items()
               if name.endswith("RotaryEmbedding") and isinstance(value, type)}
    if not classes:
        raise LookupError(f"the module {type(attention).__module__} holds no *RotaryEmbedding "
                          f"class to compute the attention's cosines and sines")
    prefix = type(attention).__name__.removesuffix("Attention")
    best = max(classes, key=lambda name: len(os.path.commonprefix([name, prefix])))
    return classes[best](attention.config).float().cpu()


def _split_qkv(qkv_proj: torch.nn.Linear, config,
               kv_heads: int | None = None) -> list[torch.nn.Linear]:
    """Three ``Linear`` modules that compute the query, key and value parts of a fused
    ``qkv_proj`` (rows ``[H d; H_kv d; H_kv d]``, as Phi-3 stacks them), holding copies of its
    weight's rows; ``H_kv`` is ``kv_heads``, else the config's."""
    heads = config.num_attention_heads
    kv_heads = kv_heads or getattr(config, "num_key_value_heads", None) or heads
    if qkv_proj.out_features % (heads + 2 * kv_heads):
        raise ValueError(f"qkv_proj must give (heads + 2 kv_heads) * head_dim features, a "
                         f"multiple of {heads + 2 * kv_heads}, got {qkv_proj.out_features}")
    head_dim = qkv_proj.out_features // (heads + 2 * kv_heads)
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    weights = qkv_proj.weight.detach().split(widths)
    biases = (qkv_proj.bias.detach().split(widths) if qkv_proj.bias is not None
              else (None,) * 3)
    parts = []
    for weight, bias in zip(weights, biases, strict=True):
        lin = torch.nn.Linear(qkv_proj.in_features, weight.size(0), bias=bias is not None,
                              device="meta")
        lin.weight = torch.nn.Parameter(weight.clone())
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias.clone())
        parts.append(lin)
    return parts


def _split_per_head_qkv(fused: torch.nn.Linear, config) -> list[torch.nn.Linear]:
    """Three ``Linear`` modules that compute the query, key and value parts of GPT-NeoX's
    ``query_key_value``, whose rows hold each head's query, key and value in turn (``[H, 3,
    d]``), holding copies of its weight's rows; refused unless it gives 3 H d features."""
    heads = config.num_attention_heads
    if fused.out_features % (3 * heads):
        raise ValueError(f"query_key_value must give 3 * heads * head_dim features, a multiple "
                         f"of {3 * heads}, got {fused.out_features}")
    head_dim = fused.out_features // (3 * heads)
    weight = fused.weight.detach().view(heads, 3, head_dim, fused.in_features)
    bias = None if fused.bias is None else fused.bias.detach().view(heads, 3, head_dim)
    parts = []
    for part in range(3):  # q, k, v
        lin = torch.nn.Linear(fused.in_features, heads * head_dim, bias=bias is not None,
                              device="meta")
        lin.weight = torch.nn.Parameter(weight[:, part].reshape(heads * head_dim, -1).clone())
        if bias is not None:
            lin.bias = torch.nn.Parameter(bias[:, part].reshape(-1).clone())
        parts.append(lin)
    return parts


def _qk_norms(attention: Module, head_dim: int, heads: int, kv_heads: int,
              ) -> tuple[str, tuple[tuple[Tensor, float, Tensor | None], ...]] | None:
    """The attention's normalisation of its queries and keys as the layers' ``qk_norm``, and
    the gains, epsilon and (LayerNorm) bias of each, or ``None`` when it has none: RMSNorms
    ``q_norm`` and ``k_norm`` over each head's channels (``"rms"``) or the whole projection's
    (``"rms_across_heads"``), or ``torch.nn.LayerNorm`` modules over each head's channels
    (``"layer"``: Phi's and Persimmon's ``q_layernorm``, ``k_layernorm``; RMSNorms under
    those names, LFM2's, are ``"rms"``, and so is Llama 4's one ``qk_norm`` for both), or
    LayerNorms over each head's channels with each head's gains and biases (``weight [H,
    head_dim]``: Chameleon's, ``"layer_per_head"``); refused by name otherwise."""
    layer_norms = [getattr(attention, name, None) for name in ("q_layernorm", "k_layernorm")]
    if all(isinstance(m, torch.nn.LayerNorm) and m.normalized_shape == (head_dim,)
           and m.elementwise_affine and m.bias is not None for m in layer_norms):
        return "layer", tuple((m.weight.detach(), float(m.eps), m.bias.detach())
                              for m in layer_norms)
    modules = [getattr(attention, name, None) for name in ("q_norm", "k_norm")]
    if all(isinstance(m, torch.nn.LayerNorm) and m.normalized_shape == (head_dim,)
           and m.elementwise_affine and m.bias is not None for m in modules) and (
            tuple(modules[0].weight.shape), tuple(modules[1].weight.shape)) == (
            (heads, head_dim), (kv_heads, head_dim)):  # Chameleon's, with each head's gains
        return "layer_per_head", tuple((m.weight.detach(), float(m.eps), m.bias.detach())
                                       for m in modules)
    if all(m is None for m in modules) and not all(m is None for m in layer_norms):
        modules = layer_norms  # LFM2's RMSNorms, under the names of Phi's LayerNorms
    shared = getattr(attention, "qk_norm", None)
    if all(m is None for m in modules) and isinstance(shared, Module):
        modules = [shared, shared]  # Llama 4's one RMSNorm without gains for both
    if all(m is None for m in modules):  # HunYuan's, which it applies after the rotation
        modules = [getattr(attention, name, None) for name in ("query_layernorm",
                                                               "key_layernorm")]
    if all(m is None for m in modules):
        return None
    widths = {"rms": (head_dim, head_dim), "rms_across_heads": (heads * head_dim,
                                                                kv_heads * head_dim)}
    q_shape = tuple(getattr(getattr(modules[0], "weight", None), "shape", ()))
    kind = "rms_across_heads" if q_shape == (heads * head_dim,) and heads > 1 else "rms"
    like = next(attention.parameters())  # (the device and dtype of gains made here)
    norms = []
    for name, module, width in zip(("q_norm", "k_norm"), modules, widths[kind], strict=True):
        gains_eps = _rms_norm(module, width, like)
        if gains_eps is None:
            raise NotImplementedError(
                f"from_llama converts an attention whose q_norm and k_norm are RMSNorms, "
                f"g * x / sqrt(mean(x ** 2) + eps) with g their weight (Qwen3's, OLMo 2's) "
                f"or 1 + weight (Gemma 3's), over each head's head_dim = {head_dim} channels "
                f"or over the whole projection's (q_norm {heads * head_dim}, k_norm "
                f"{kv_heads * head_dim}); got {name} {_described(module)}")
        norms.append((*gains_eps, None))
    return kind, tuple(norms)


def _differential(attention: Module, head_dim: int, heads: int, kv_heads: int,
                  ) -> tuple[float, tuple[Tensor, ...], float | None] | None:
    """DiffLlama's differential attention, its heads h and h + heads/2 the two maps of one
    head: ``lambda_init``, the vectors ``lambda_q1, lambda_k1, lambda_q2, lambda_k2`` and the
    epsilon of its RMS norm of each head's difference (``groupnorm``, without gains); ``None``
    without; refused by name when it is built otherwise."""
    names = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
    lambdas = [getattr(attention, name, None) for name in names]
    if all(lam is None for lam in lambdas):
        return None
    lambda_init = getattr(attention, "lambda_init", None)
    norm = getattr(attention, "groupnorm", None)
    if not (all(isinstance(lam, Tensor) and tuple(lam.shape) == (head_dim,) for lam in lambdas)
            and isinstance(lambda_init, (int, float)) and isinstance(norm, torch.nn.RMSNorm)
            and norm.weight is None and tuple(norm.normalized_shape) == (2 * head_dim,)
            and heads % 2 == 0 and kv_heads % 2 == 0):
        raise NotImplementedError(
            f"from_llama converts a differential attention as DiffLlama's: lambda_q1, "
            f"lambda_k1, lambda_q2, lambda_k2 of head_dim = {head_dim} channels, a number "
            f"lambda_init, a groupnorm RMSNorm over 2 * head_dim channels without gains, and "
            f"even numbers of heads and key heads; got {type(attention).__name__} with "
            f"{heads} heads and {kv_heads} key heads")
    eps = norm.eps
    return (float(lambda_init), tuple(lam.detach() for lam in lambdas),
            None if eps is None else float(eps))


def _paired_values(v_proj: torch.nn.Linear, kv_heads: int, head_dim: int) -> torch.nn.Linear:
    """DiffLlama's values as the differential layer's: each of its first ``kv_heads / 2``
    value heads beside the head ``kv_heads / 2`` after it, one value of ``2 head_dim``
    channels (the rows of ``v_proj`` reordered)."""
    lin = torch.nn.Linear(v_proj.in_features, v_proj.out_features, bias=v_proj.bias is not None,
                          device=v_proj.weight.device, dtype=v_proj.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(v_proj.weight.view(2, kv_heads // 2, head_dim, -1).transpose(0, 1)
                         .reshape(v_proj.weight.shape))
        if lin.bias is not None:
            lin.bias.copy_(v_proj.bias.view(2, kv_heads // 2, head_dim).transpose(0, 1)
                           .flatten())
    return lin


def _described(module: Module | None) -> str:
    """``module``'s class, with the shape of its ``weight`` where it has one."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ + (f" with weight {list(weight.shape)}"
                                    if isinstance(weight, Tensor) else "")


def _rms_norm(module: Module | None, width: int, like: Tensor) -> tuple[Tensor, float] | None:
    """The gains and epsilon of ``module``, an RMSNorm over ``width`` channels (its
    ``weight``, or 1 without one: NanoChat's), or ``None`` when it computes something else
    (or is ``None``); ``like``: the device and dtype of gains of 1. A projection onto the unit
    sphere without gains, ``x / sqrt(sum(x ** 2) + eps)`` (Dory's, nGPT's), is the RMSNorm of
    gains ``1 / sqrt(width)`` and epsilon ``eps / width``."""
    if module is None:
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if weight is None and isinstance(eps, (int, float)) and _unit_norm(module, width, eps):
        return (torch.full((width,), width ** -0.5, device=like.device, dtype=torch.float32),
                eps / width)
    if weight is None:
        weight = torch.ones(width, device=like.device, dtype=like.dtype)
    if not (isinstance(weight, Tensor) and tuple(weight.shape) == (width,)
            and isinstance(eps, (int, float))):
        return None
    gains = _rms_gains(module, weight.detach(), float(eps))
    return None if gains is None else (gains, float(eps))


def _query_gains(attention: Module, heads: int, head_dim: int, kv_heads: int,
                 ) -> tuple[Tensor | None, object]:
    """A learned scale of each query channel after the attention's QK-norm (and rotation), to
    fold into the query norm's gains, and the score scale left: TimesFM 2.5's
    ``softplus(scaling) log2(e) / sqrt(head_dim)`` (``[head_dim]``) in place of the scale,
    which is then 1, or Dory's ``(sqk * sqk_scale) ** 2`` of each head's channel (``[heads,
    head_dim]``) beside it. ``(None, attention.scaling)`` without; the check refuses another
    form."""
    scaling = getattr(attention, "scaling", head_dim ** -0.5)
    if _qk_norms(attention, head_dim, heads, kv_heads) is None:
        return None, scaling
    if isinstance(scaling, Tensor) and tuple(scaling.shape) == (head_dim,):
        return (torch.nn.functional.softplus(scaling.detach())
                * (1.442695041 / math.sqrt(head_dim))), 1.0
    sqk = getattr(attention, "sqk", None)
    if isinstance(sqk, Tensor) and tuple(sqk.shape) == (heads * head_dim,):
        factor = getattr(attention, "sqk_scale", 1.0)
        return (sqk.detach() * factor).square().view(heads, head_dim), scaling
    return None, scaling


def _unit_norm(module: Module, width: int, eps: float) -> bool:
    """Whether ``module`` computes ``x / sqrt(sum(x ** 2) + eps)`` over ``width`` channels, run
    on a few random rows."""
    like = next(iter(module.parameters()), None)
    probe = torch.randn(4, width, generator=torch.Generator().manual_seed(0))
    if like is not None:
        probe = probe.to(device=like.device)
    with torch.no_grad():
        out = module(probe).float()
    unit = probe * torch.rsqrt(probe.pow(2).sum(-1, keepdim=True) + eps)
    return out.shape == unit.shape and torch.allclose(out, unit, rtol=2e-2, atol=2e-3)


def _rms_gains(module: Module, weight: Tensor, eps: float) -> Tensor | None:
    """The gains g of an RMSNorm ``module``, ``module(x) = g * x / sqrt(mean(x ** 2) + eps)``:
    ``weight`` (LLaMA's and Qwen3's form) or ``1 + weight`` (Gemma's), told apart by running
    the module on a few random rows (the two differ by ``x / rms(x)`` itself); ``None`` when
    neither computes what it does."""
    probe = torch.randn(4, weight.numel(), generator=torch.Generator().manual_seed(0))
    probe = probe.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        out = module(probe).float()
    unit = probe.float() * torch.rsqrt(probe.float().pow(2).mean(-1, keepdim=True) + eps)
    for gains in (weight.float(), 1.0 + weight.float()):
        if torch.allclose(out, unit * gains, rtol=2e-2, atol=2e-2):
            return gains
    return None


def _v_norm_eps(attention: Module, head_dim: int) -> float | None:
    """The epsilon of the attention's ``v_norm``, an RMS normalisation of each head's values
    without gains (Gemma 4's), or ``None`` when it has none; refused by name when its
    ``v_norm`` computes something else."""
    module = getattr(attention, "v_norm", None)
    if module is None:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    like = next(attention.parameters())
    if isinstance(eps, (int, float)) and getattr(module, "weight", None) is None and (
            _rms_gains(module, torch.ones(head_dim, device=like.device, dtype=like.dtype),
                       float(eps)) is not None):
        return float(eps)
    raise NotImplementedError(
        f"from_llama converts a v_norm that RMS-normalises each head's values without gains, "
        f"x / sqrt(mean(x ** 2) + eps) over head_dim = {head_dim} channels (Gemma 4's); got "
        f"v_norm {type(module).__name__}")


def _out_norm(attention: Module, width: int) -> tuple[Tensor, float] | None:
    """The gains and epsilon of the attention's RMS normalisation of its heads' merged output
    before ``o_proj`` (BitNet's ``attn_sub_norm``), or ``None`` when it has none; refused by
    name when it computes something else."""
    module = getattr(attention, "attn_sub_norm", None)
    if module is None:
        return None
    gains_eps = _rms_norm(module, width, next(attention.parameters()))
    if gains_eps is None:
        raise NotImplementedError(
            f"from_llama converts an attn_sub_norm that RMS-normalises the heads' merged "
            f"output before o_proj with gains, g * x / sqrt(mean(x ** 2) + eps) over the "
            f"heads * head_dim = {width} channels (BitNet's); got attn_sub_norm "
            f"{_described(module)}")
    return gains_eps


# the rotary embeddings whose frequencies transformers computes once for all positions, which
# RotaryPE(frequencies=, attention_factor=) then reproduces at every position (Gemma 4's
# "proportional" one: frequencies of 0, no rotation, for the planes past its fraction)
_FIXED_ROPE_TYPES = ("linear", "llama3", "yarn", "proportional")


def _rope_arguments(config, rope: dict, rope_type: str, layer_type: str | None) -> dict:
    """``RotaryPE``'s arguments past ``dim`` and ``base`` for a model whose config asks for
    ``rope_type``: the frequencies and factor on the cosines and sines that ``transformers``
    computes (LongRoPE's short and long sets), or dynamic NTK scaling's factor and trained
    length; refused by name where the embedding is none of these."""
    if rope_type == "default":
        return {}
    if rope_type == "dynamic":
        if not float(rope["factor"]) >= 1:  # (RotaryPE would name its own ntk_factor)
            raise ValueError(f"dynamic NTK scaling stretches the rotations past the trained "
                             f"length by a factor >= 1: the config's rope factor must be >= 1, "
                             f"got rope_parameters['factor']={rope['factor']!r}")
        return {"ntk_factor": float(rope["factor"]),
                "original_length": int(config.max_position_embeddings)}
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope":  # the short set within the trained positions, the long past
        original = int(rope["original_max_position_embeddings"])
        short, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", **kwargs)
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=original + 1, **kwargs)
        return {"frequencies": short.to(torch.float64), "attention_factor": float(scaling),
                "long_frequencies": long.to(torch.float64), "original_length": original}
    if rope_type not in _FIXED_ROPE_TYPES:
        raise NotImplementedError(
            f"from_llama converts the default rotary embedding, those whose frequencies are "
            f"computed once ({', '.join(_FIXED_ROPE_TYPES)}), dynamic NTK scaling "
            f"('dynamic') and LongRoPE ('longrope'), got rope_type={rope_type!r}")
    frequencies, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kwargs)
    return {"frequencies": frequencies.to(torch.float64), "attention_factor": float(scaling)}
