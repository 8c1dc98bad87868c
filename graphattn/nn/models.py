"""Node-classification models built from :class:`~graphattn.nn.GraphSelfAttention`."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import LayerNorm, LazyLinear, Linear

from graphattn._checks import (
    check_dropout,
    check_flag,
    check_float_dtype,
    check_in_channels,
    check_non_negative,
    check_positive,
    check_tensors,
    check_weight_dtype,
)
from graphattn.functional.dropout import dropout
from graphattn.functional.sparse_linear import sparse_linear
from graphattn.nn.attention import GraphSelfAttention, _module_forward, _plain_linear
from graphattn.nn.indexer import LightningIndexer
from graphattn.pe import RotaryPE

ConvFactory = Callable[..., torch.nn.Module]


def feature_dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Dropout that also takes sparse (COO, CSR or CSC) features, dropping their stored values.

    Zeros stay zero under dropout, so dropping only the stored values of a sparse matrix draws
    from the same distribution as dense dropout, at the cost of its nonzeros alone.
    """
    if not training or p == 0.0:
        return x
    if x.layout == torch.strided:
        return dropout(x, p)
    return _sparse_feature_dropout(x, p)


@torch.compiler.disable  # dynamo takes no sparse tensor: eager, behind a graph break
def _sparse_feature_dropout(x: Tensor, p: float) -> Tensor:
    """:func:`feature_dropout` of a sparse ``x``. Outside dynamo: traced, the stored values (a
    view of a tensor without strides) made dynamo fail inside its own code (an IndexError)."""
    if x.layout == torch.sparse_csr:
        return torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(),
                                       dropout(x.values(), p), x.shape,
                                       check_invariants=False)
    if x.layout == torch.sparse_csc:
        return torch.sparse_csc_tensor(x.ccol_indices(), x.row_indices(),
                                       dropout(x.values(), p), x.shape,
                                       check_invariants=False)
    if x.layout == torch.sparse_coo:
        x = x.coalesce()
        return torch.sparse_coo_tensor(x.indices(), dropout(x.values(), p), x.shape,
                                       is_coalesced=True, check_invariants=False)
    raise ValueError(f"feature_dropout takes strided, COO, CSR or CSC features, got {x.layout}")


class _Dropout(torch.nn.Dropout):
    """``torch.nn.Dropout`` with the masks of :func:`~graphattn.functional.dropout.dropout`
    (on CPU a third of the time of torch's ``bernoulli_`` draw, ``benchmarks/dropout_cpu.py``)."""

    def forward(self, input: Tensor) -> Tensor:
        return dropout(input, self.p, self.training)


def _reset_outermost(module: torch.nn.Module) -> None:
    """``reset_parameters()`` of the outermost submodules that have one: a layer resets its own
    children the way it initialised them (Glorot projections, say), which their own defaults
    would undo."""
    for child in module.children():
        if hasattr(child, "reset_parameters"):
            child.reset_parameters()
        else:
            _reset_outermost(child)


def _check_single_input(in_channels: int, model: str) -> None:
    """Refuse a pair ``(F_src, F_dst)``: the models take one feature matrix."""
    if isinstance(in_channels, (tuple, list)):
        raise ValueError(f"in_channels of {model} must be an integer (one feature matrix x), "
                         f"got {in_channels!r}")


def _check_not_fx_traced(x: object, model: torch.nn.Module) -> None:
    """Raise when ``torch.fx`` traces the model (``to_hetero`` does): its checks read shapes,
    and its layers add self-loops, which ``to_hetero`` refuses on edges between two types."""
    if isinstance(x, torch.fx.Proxy):
        raise TypeError(f"{type(model).__name__} is a model of graphs with one node type and "
                        f"is not traced by torch.fx, as torch_geometric.nn.to_hetero traces: "
                        f"build the heterogeneous model from GraphSelfAttention layers "
                        f"(add_self_loops=False), which to_hetero converts")


class GAT(torch.nn.Module):
    r"""The two-layer graph attention network of Veličković et al. (ICLR 2018).

    .. math::
        h = \mathrm{ELU}\Big(\big\Vert_{k=1}^{H} \sum_{j \in \mathcal{N}(i) \cup \{i\}}
            \alpha^{k}_{ij}\, \big(m_j \odot W^{k} \tilde x_j\big) + b\Big), \qquad
        \mathrm{logits}_i = \frac{1}{H_\mathrm{out}} \sum_{k=1}^{H_\mathrm{out}}
            \sum_{j \in \mathcal{N}(i) \cup \{i\}} \beta^{k}_{ij}\,
            \big(m'_j \odot U^{k} \tilde h_j\big) + c

    where :math:`\tilde x, \tilde h` are the inputs after dropout (``x`` may be a sparse CSR,
    CSC or COO tensor: bag-of-words features are mostly zeros, and dropout then touches only the
    stored values), :math:`m, m'` dropout masks on the projected values (``value_dropout``)
    and :math:`\alpha, \beta` the attention weights of :class:`GraphSelfAttention` (with dropout
    during training). The biases :math:`b` ``[H C]`` and :math:`c` ``[classes]`` are each
    layer's ``out_bias``, added after the weighted sum as in ``GATConv`` and the authors'
    reference code: the values have none (``lin_v.bias`` is ``None``), so neither value nor
    attention dropout touches them (the dropped weights of a target do not sum to 1).
    With ``attention="additive"`` the score is GAT's
    :math:`\mathrm{LeakyReLU}_{0.2}(a_l^\top W x_i + a_r^\top W x_j + b_s)`, where the
    per-head :math:`b_s`, the biases of ``lin_q`` and ``lin_k``, starts at 0 and is learnt
    (``GATConv`` has none); ``"gatv2"`` swaps in
    GATv2's :math:`a^\top \mathrm{LeakyReLU}_{0.2}(W^Q x_i + W^K x_j)` and ``"dot"`` the
    scaled dot product of a transformer, keeping everything else. Both layers have
    ``out_proj=False`` and add self-loops, like ``torch_geometric.nn.GATConv``.

    The defaults are the paper's Cora setup: 8 heads of 8 channels, one output head, dropout
    0.6 on the inputs of both layers and on the attention weights, and, as in the authors'
    reference code, also on the projected values. (The paper averages 8 output heads on
    PubMed: ``out_heads=8``.)

    Everything after ``out_channels`` is a keyword: PyG's ``GAT(in_channels, hidden_channels,
    num_layers, out_channels)`` and :class:`GraphTransformer` put the hidden width second, so
    ``GAT(1433, 64, 7)`` would have built 64 classes of 7 channels a head. Here
    ``hidden_channels`` is per head (the hidden layer is ``heads * hidden_channels`` wide;
    PyG's ``GAT`` counts the whole width).

    Args:
        in_channels (int): input features F; ``-1`` infers them from the first call.
        out_channels (int): classes.
        hidden_channels (int, optional): channels per head of the hidden layer.
            (default: ``8``)
        heads (int, optional): heads of the hidden layer, concatenated. (default: ``8``)
        out_heads (int, optional): heads of the output layer, averaged. (default: ``1``)
        dropout (float, optional): dropout on each layer's input features.
            (default: ``0.6``)
        attention_dropout (float, optional): dropout on the attention weights.
            (default: ``dropout``)
        value_dropout (float, optional): dropout on each layer's projected values
            :math:`W \tilde x_j` before aggregation, the second dropout of the GAT reference
            code (``GraphSelfAttention``'s ``value_dropout``). (default: ``dropout``)
        attention (str, optional): ``"additive"`` (GAT), ``"gatv2"`` (GATv2's dynamic
            attention) or ``"dot"``. (default: ``"additive"``)
        backend (str, optional): edge-attention backend of both layers. (default: ``"auto"``)
        conv (callable, optional): builds each layer instead of :class:`GraphSelfAttention`,
            called as ``conv(in_channels, out_channels, heads=..., concat=..., dropout=...)``
            (e.g. ``torch_geometric.nn.GATConv``), to train another layer under the same
            architecture. ``attention``, ``backend``, ``value_dropout`` and ``sinks`` are then
            unused. (default: ``None``)
        sinks (bool, optional): both layers have a learned sink logit per head, one more
            score of every node's softmax whose value is 0, so that a node can give its
            neighbours (and itself) less than all of its weight
            (:class:`GraphSelfAttention`'s ``sinks``). (default: ``False``)

    Shapes:
        - **input:** x ``(|V|, F)``, edge_index ``(2, |E|)`` or a sparse adjacency adj_t
          ``(|V|, |V|)`` (see :class:`~graphattn.nn.GraphSelfAttention`)
        - **output:** logits ``(|V|, out_channels)``; with ``return_attention_weights=True``
          also two pairs of edge_index ``(2, |E'|)`` and weights ``(|E'|, H)`` and
          ``(|E'|, H_out)``, E' the edges with the self-loops the layers add
    """

    def __init__(self, in_channels: int, out_channels: int, *, hidden_channels: int = 8,
                 heads: int = 8, out_heads: int = 1, dropout: float = 0.6,
                 attention_dropout: float | None = None, value_dropout: float | None = None,
                 attention: str = "additive", backend: str = "auto",
                 conv: ConvFactory | None = None, sinks: bool = False) -> None:
        super().__init__()
        _check_single_input(in_channels, "GAT")
        in_channels = check_in_channels(in_channels)
        out_channels = check_positive(out_channels, "out_channels")
        hidden_channels = check_positive(hidden_channels, "hidden_channels")
        heads = check_positive(heads, "heads")
        out_heads = check_positive(out_heads, "out_heads")
        check_dropout(dropout)
        attention_dropout = dropout if attention_dropout is None else attention_dropout
        check_dropout(attention_dropout, "attention_dropout")
        value_dropout = dropout if value_dropout is None else value_dropout
        check_dropout(value_dropout, "value_dropout")
        if conv is not None and not callable(conv):
            raise TypeError(f"conv must be a callable that builds a layer (a class such as "
                            f"GraphSelfAttention or PyG's GATConv), got {conv!r}")
        if conv is None:
            def conv(i: int, o: int, **kwargs) -> GraphSelfAttention:
                layer = GraphSelfAttention(i, o, **kwargs, out_proj=False, out_bias=True,
                                           attention=attention, backend=backend,
                                           value_dropout=value_dropout, sinks=sinks)
                # the bias is added after the weighted sum (out_bias), not to every value:
                # the dropped attention weights of a target do not sum to 1
                layer.lin_v.register_parameter("bias", None)
                return layer
        self.dropout = float(dropout)
        self.conv1 = conv(in_channels, hidden_channels, heads=heads, concat=True,
                          dropout=attention_dropout)
        self.conv2 = conv(heads * hidden_channels, out_channels, heads=out_heads, concat=False,
                          dropout=attention_dropout)

    def reset_parameters(self) -> None:
        """Re-initialise both layers."""
        self.conv1.reset_parameters()
        self.conv2.reset_parameters()

    def forward(self, x: Tensor, edge_index: Tensor, return_attention_weights: bool = False
                ) -> Tensor | tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """Class logits of every node; see the class docstring for shapes. With
        ``return_attention_weights=True`` also both layers' attention weights, ``[(edge_index,
        alpha), (edge_index, beta)]``, as each layer returns them (for PyG layers passed as
        ``conv``, those that take the flag)."""
        _check_not_fx_traced(x, self)
        return_attention_weights = return_attention_weights is not None and check_flag(
            return_attention_weights, "return_attention_weights")
        if not isinstance(x, Tensor) or x.dim() != 2:  # (a pair (x_src, x_dst) included)
            shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [N, F], got {shape}")
        check_float_dtype(x=x)  # before the dropout, whose mask takes x's dtype
        x = feature_dropout(x, self.dropout, self.training)  # (N, F)
        if not return_attention_weights:
            x = F.elu(self.conv1(x, edge_index))  # (N, H * C)
            x = dropout(x, self.dropout, self.training)
            return self.conv2(x, edge_index)  # (N, classes)
        x, first = self.conv1(x, edge_index, return_attention_weights=True)
        x = dropout(F.elu(x), self.dropout, self.training)  # (N, H * C)
        out, second = self.conv2(x, edge_index, return_attention_weights=True)  # (N, classes)
        return out, [first, second]


@torch.compiler.disable  # eager: under torch.compile, the first trace sized the module
def _size_lazy(lin: LazyLinear, x: Tensor) -> None:  # and the restarted one found a Linear
    """Size the lazy ``lin`` by ``x``'s width, with an empty batch through its own hook."""
    lin(torch.empty(0, x.size(1), dtype=lin.weight.dtype, device=x.device))


def _block_indexer(width: int, heads: int, top_k: int | None, indexer_heads: int,
                   channels: int | None, q_rank: int | None,
                   rotary: RotaryPE | None) -> LightningIndexer | None:
    """The :class:`LightningIndexer` of a block of ``GraphTransformer(indexer_top_k=)``, or
    ``None`` without: its rotation turns half its channels (a multiple of ``2 * axes``, at
    least one plane per axis) with ``rotary``'s base and axes. The indexer's sizes are
    checked with or without one."""
    indexer_heads = check_positive(indexer_heads, "indexer_heads")
    if channels is not None:
        channels = check_positive(channels, "indexer_channels")
    if top_k is None:
        return None
    channels = width // heads if channels is None else channels
    turned = None
    if rotary is not None:
        plane = 2 * rotary.axes
        dim = max(plane, channels // 2 // plane * plane)
        if dim > channels:
            raise ValueError(f"indexer_channels must hold one rotated plane per axis, "
                             f"{plane}, got {channels}")
        turned = RotaryPE(dim, axes=rotary.axes, base=rotary.base)
    return LightningIndexer(width, indexer_heads, channels,
                            check_positive(top_k, "indexer_top_k"), query_channels=q_rank,
                            rotary=turned)


class GraphTransformer(torch.nn.Module):
    r"""A pre-norm transformer encoder whose attention runs over the edges of a graph.

    .. math::
        h^{(0)} = W_\mathrm{in} x + W_\mathrm{pe}\, p, \qquad
        h \leftarrow h + \mathrm{Dropout}\big(\mathrm{Attn}(\mathrm{LN}(h), \mathcal{E})\big),
        \qquad h \leftarrow h + \mathrm{Dropout}\big(\mathrm{FFN}(\mathrm{LN}(h))\big),

    repeated ``num_layers`` times, then :math:`\mathrm{logits} = W_\mathrm{out}\,
    \mathrm{LN}(h)`. :math:`\mathrm{Attn}` is :class:`GraphSelfAttention` (``heads`` heads of
    ``hidden_channels / heads`` channels, output projection, self-loops), :math:`\mathrm{FFN}(h)
    = W_2\,\mathrm{Dropout}(\mathrm{GELU}(W_1 h))` with ``ffn_ratio * hidden_channels`` inner
    units, and
    :math:`p` optional positional encodings (e.g. Laplacian eigenvectors), extra input
    features: :math:`W_\mathrm{in} x + W_\mathrm{pe} p` is :math:`[W_\mathrm{in}\;
    W_\mathrm{pe}]` applied to :math:`x \Vert p`. ``x`` may be a sparse (CSR, CSC or COO)
    tensor (on CPU a CSR one is projected by
    ``graphattn.functional.sparse_linear.sparse_linear``, whose backward skips torch's sort
    of its entries). On a PyG ``Batch`` of graphs,
    ``edge_index=graphs.batch_complete_graph(data.batch)`` lets every node attend to every node
    of its own graph: a full transformer encoder per graph.

    Args:
        in_channels (int): input features F; ``-1`` infers them from the first call.
        hidden_channels (int): model width D, divisible by ``heads``.
        out_channels (int): classes (or outputs).
        num_layers (int, optional): transformer blocks. (default: ``2``)
        heads (int, optional): attention heads. (default: ``4``)
        pe_channels (int, optional): size P of the positional encodings passed to ``forward``
            as ``pe``; ``0`` for none. (default: ``0``)
        dropout (float, optional): dropout on the input features, on the feed-forward inner
            units, and after the attention and feed-forward sublayers. (default: ``0.5``)
        attention_dropout (float, optional): dropout on the attention weights.
            (default: ``dropout``)
        ffn_ratio (int, optional): feed-forward width as a multiple of D. (default: ``2``)
        attention (str, optional): ``"dot"``, ``"additive"`` or ``"gatv2"``.
            (default: ``"dot"``)
        backend (str, optional): edge-attention backend. (default: ``"auto"``)
        edge_dim (int, optional): size of the edge features passed to ``forward`` as
            ``edge_attr`` (by keyword: the third positional argument is ``pe``), which every
            call then needs; every attention layer takes them as ``edge_mode`` says.
            (default: ``None``)
        edge_mode (str, optional): ``"bias"``, ``"key"`` or ``"key_value"``, as in
            :class:`GraphSelfAttention` (the last two need ``edge_dim``). (default: ``"bias"``)
        add_self_loops (bool, optional): let each attention layer add a self-loop per node
            (replacing those in the graph); ``False`` attends along ``edge_index`` as given,
            which ``attn_bias`` needs. (default: ``True``)
        rotary (graphattn.pe.RotaryPE, optional): a rotary position embedding that every
            attention layer applies to its queries and keys, with the positions passed to
            ``forward`` as ``pos`` (``[N]`` or ``[N, A]``); its ``dim`` is at most
            ``hidden_channels / heads``. (default: ``None``)
        kv_heads (int, optional): key and value heads of every attention layer, a divisor of
            ``heads`` (grouped-query attention; see :class:`GraphSelfAttention`).
            (default: ``None``: ``heads``)
        qk_norm (str, optional): ``"rms"`` or ``"layer"``: every attention layer normalises
            each head's queries and keys over their channels (QK-norm; see
            :class:`GraphSelfAttention`), ``_per_head`` with each head's own gains;
            ``"rms_across_heads"`` or ``"layer_across_heads"``:
            over all heads' channels together. (default: ``None``)
        qk_norm_after_rotary (bool, optional): every attention layer normalises its queries
            and keys (``qk_norm``) after the ``rotary`` rotation rather than before it.
            (default: ``False``)
        out_norm (str, optional): ``"rms"`` or ``"layer"``: every attention layer normalises
            its merged heads' output before its output projection (see
            :class:`GraphSelfAttention`). (default: ``None``)
        differential (bool, optional): differential attention in every layer (see
            :class:`GraphSelfAttention`), with the Differential Transformer's
            :math:`\lambda_{init} = 0.8 - 0.6 e^{-0.3 l}` at layer :math:`l = 0, 1, \ldots`;
            it needs ``attention_dropout=0``. (default: ``False``)
        q_rank (int, optional): every attention layer's queries through a normalised
            bottleneck of ``q_rank`` channels (see :class:`GraphSelfAttention`).
            (default: ``None``)
        kv_rank (int, optional): every attention layer's keys and values from a latent of
            ``kv_rank`` channels, multi-head latent attention (see
            :class:`GraphSelfAttention`). (default: ``None``)
        shared_key_channels (int, optional): with ``kv_rank``, the key channels every head
            shares (with ``rotary``, the rotated ones). (default: ``0``)
        indexer_top_k (int, optional): a learned sparse graph in every block: a
            :class:`LightningIndexer` of ``indexer_heads`` heads of ``indexer_channels``
            channels (with ``rotary``, a rotation of the same kind on half of them) picks
            each target's ``indexer_top_k`` edges of the graph given, and the block attends
            over them (DeepSeek's sparse attention; see :class:`GraphSelfAttention`).
            ``forward(..., return_indexer_loss=True)`` gives the loss that trains the
            indexers. (default: ``None``)
        indexer_heads (int, optional): the indexers' heads. (default: ``4``)
        indexer_channels (int, optional): the indexers' channels per head.
            (default: ``None``: the attention's, ``hidden_channels / heads``)
        softcap (float, optional): every attention layer soft-caps its dot or gatv2 scores
            at :math:`c \tanh(s / c)` (see :class:`GraphSelfAttention`). (default: ``None``)
        sinks (bool, optional): every attention layer has a learned sink logit per head in
            its softmax (see :class:`GraphSelfAttention`). (default: ``False``)
        gate (str, optional): ``"elementwise"`` or ``"headwise"``: every attention layer
            gates each node's output by a sigmoid of the node's features (see
            :class:`GraphSelfAttention`). (default: ``None``)
        score_channels (int, optional): channels per head of every attention layer's queries
            and keys, apart from its values' ``hidden_channels / heads``: narrow scoring heads
            cost less per edge (see :class:`GraphSelfAttention`). (default: ``None``: the
            values')
        v_norm (bool, optional): every attention layer RMS-normalises each head's values
            without gains (see :class:`GraphSelfAttention`). (default: ``False``)

    ``forward(..., attn_bias=)`` takes an ``[|E|, H]`` score bias that every block adds to its
    attention scores, shared by the blocks as Graphormer shares its spatial encoding: a
    relative positional encoding such as ALiBi (:func:`graphattn.pe.alibi_bias`) or a learned
    bias of each hop distance (:class:`graphattn.pe.DistanceBias`), which can take the place
    of ``pe`` (``examples/sequence_attention.py`` trains ALiBi on a causal graph and measures
    it on sequences 4x longer than those it trained on).

    Shapes:
        - **input:** x ``(|V|, F)``, edge_index ``(2, |E|)`` or a sparse adjacency adj_t
          ``(|V|, |V|)``, pe ``(|V|, P)`` (when
          ``pe_channels > 0``), edge_attr ``(|E|, D_e)`` (when ``edge_dim`` is set),
          attn_bias ``(|E|, H)`` (with ``add_self_loops=False``), pos ``(|V|)`` or
          ``(|V|, A)`` (with ``rotary``)
        - **output:** ``(|V|, out_channels)``; with ``return_attention_weights=True`` also
          ``num_layers`` pairs of edge_index ``(2, |E'|)`` and alpha ``(|E'|, H)``, E' the
          edges with the self-loops the layers add
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int,
                 num_layers: int = 2, heads: int = 4, *, pe_channels: int = 0,
                 dropout: float = 0.5, attention_dropout: float | None = None,
                 ffn_ratio: int = 2, attention: str = "dot", backend: str = "auto",
                 edge_dim: int | None = None, edge_mode: str = "bias",
                 add_self_loops: bool = True, rotary: RotaryPE | None = None,
                 kv_heads: int | None = None, qk_norm: str | None = None,
                 softcap: float | None = None, sinks: bool = False,
                 gate: str | None = None, score_channels: int | None = None,
                 v_norm: bool = False, qk_norm_after_rotary: bool = False,
                 out_norm: str | None = None, differential: bool = False,
                 q_rank: int | None = None, kv_rank: int | None = None,
                 shared_key_channels: int = 0, indexer_top_k: int | None = None,
                 indexer_heads: int = 4, indexer_channels: int | None = None) -> None:
        super().__init__()
        _check_single_input(in_channels, "GraphTransformer")
        in_channels = check_in_channels(in_channels)
        hidden_channels = check_positive(hidden_channels, "hidden_channels")
        out_channels = check_positive(out_channels, "out_channels")
        num_layers = check_positive(num_layers, "num_layers")
        heads = check_positive(heads, "heads")
        ffn_ratio = check_positive(ffn_ratio, "ffn_ratio")
        pe_channels = check_non_negative(pe_channels, "pe_channels")
        if edge_dim is not None:
            edge_dim = check_positive(edge_dim, "edge_dim")
        if hidden_channels % heads != 0:
            raise ValueError(f"hidden_channels must be divisible by heads, got "
                             f"hidden_channels={hidden_channels} and heads={heads}")
        check_dropout(dropout)
        attention_dropout = dropout if attention_dropout is None else attention_dropout
        check_dropout(attention_dropout, "attention_dropout")
        if differential is True and attention_dropout:
            raise ValueError(f"differential=True takes no dropout of the attention weights "
                             f"(the two maps could not share it): give attention_dropout=0 "
                             f"(it defaults to dropout), got attention_dropout="
                             f"{attention_dropout}")
        if differential is True and indexer_top_k is not None:
            raise ValueError("differential=True with indexer_top_k: the indexers train on the "
                             "attention's weights as a distribution over each target's edges "
                             "(return_indexer_loss), and a differential block's are signed "
                             "(alpha_1 - lambda alpha_2)")
        self.pe_channels = pe_channels
        self.edge_dim = edge_dim
        self.dropout = float(dropout)
        D = hidden_channels
        self.lin_in = Linear(in_channels, D) if in_channels != -1 else LazyLinear(D)
        self.lin_pe = Linear(pe_channels, D, bias=False) if pe_channels > 0 else None
        self.attn_norms = torch.nn.ModuleList(LayerNorm(D) for _ in range(num_layers))
        self.attns = torch.nn.ModuleList(
            GraphSelfAttention(D, D // heads, heads, dropout=attention_dropout,
                               attention=attention, backend=backend, edge_dim=edge_dim,
                               edge_mode=edge_mode, add_self_loops=add_self_loops,
                               rotary=rotary, kv_heads=kv_heads, qk_norm=qk_norm,
                               softcap=softcap, sinks=sinks, gate=gate,
                               score_channels=score_channels, v_norm=v_norm,
                               qk_norm_after_rotary=qk_norm_after_rotary,
                               out_norm=out_norm, differential=differential,
                               lambda_init=(0.8 - 0.6 * math.exp(-0.3 * layer)
                                            if differential else None),
                               q_rank=q_rank, kv_rank=kv_rank,
                               shared_key_channels=shared_key_channels,
                               indexer=_block_indexer(D, heads, indexer_top_k, indexer_heads,
                                                      indexer_channels, q_rank, rotary))
            for layer in range(num_layers))
        self.ffn_norms = torch.nn.ModuleList(LayerNorm(D) for _ in range(num_layers))
        self.ffns = torch.nn.ModuleList(
            torch.nn.Sequential(Linear(D, ffn_ratio * D), torch.nn.GELU(),
                                _Dropout(dropout), Linear(ffn_ratio * D, D))
            for _ in range(num_layers))
        self.norm_out = LayerNorm(D)
        self.lin_out = Linear(D, out_channels)

    def reset_parameters(self) -> None:
        """Re-initialise every submodule as its constructor does."""
        _reset_outermost(self)

    def forward(self, x: Tensor, edge_index: Tensor, pe: Tensor | None = None,
                edge_attr: Tensor | None = None, return_attention_weights: bool = False,
                *, attn_bias: Tensor | None = None, pos: Tensor | None = None,
                return_indexer_loss: bool = False,
                ) -> Tensor | tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """Outputs of every node, with ``attn_bias`` added to every block's scores and the
        queries and keys rotated by ``pos`` (with ``rotary``); see the class docstring for
        shapes. With
        ``return_attention_weights=True`` also each block's attention weights, first block
        first: a list of ``(edge_index, alpha)`` as :class:`GraphSelfAttention` returns them
        (self-loops included; for a sparse ``adj_t``, the adjacency of each block's edges and
        their ``alpha``). With ``return_indexer_loss=True`` (a model with
        ``indexer_top_k``) also, last, the sum over the blocks of
        :meth:`GraphSelfAttention.indexer_loss` on the edges each block chose: add it to the
        training loss to train the indexers, whose gradient it alone reaches (DeepSeek's
        sparse stage)."""
        _check_not_fx_traced(x, self)
        return_attention_weights = return_attention_weights is not None and check_flag(
            return_attention_weights, "return_attention_weights")
        return_indexer_loss = check_flag(return_indexer_loss, "return_indexer_loss")
        if return_indexer_loss and self.attns[0].indexer is None:
            raise ValueError("return_indexer_loss=True needs a model with indexers: "
                             "GraphTransformer(..., indexer_top_k=K)")
        if not isinstance(x, Tensor) or x.dim() != 2:
            shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [N, F], got {shape}")
        check_float_dtype(x=x)
        if isinstance(self.lin_in, LazyLinear):
            _size_lazy(self.lin_in, x)
        check_weight_dtype(x, self.lin_in, "x")
        if not isinstance(self.lin_in, LazyLinear) and x.size(1) != self.lin_in.in_features:
            raise ValueError(f"x must have F = in_channels = {self.lin_in.in_features} "
                             f"features, got {list(x.shape)}")
        if self.edge_dim is not None and edge_attr is None:
            raise ValueError(f"edge_attr must be given: the model has edge_dim={self.edge_dim} "
                             f"(pass it by keyword, edge_attr=...; the third positional "
                             f"argument is pe)")
        if self.pe_channels > 0:
            if pe is not None:
                check_tensors(pe=pe)
            if pe is None or pe.dim() != 2 or tuple(pe.shape) != (x.size(0), self.pe_channels):
                got = None if pe is None else list(pe.shape)
                raise ValueError(f"pe must have shape [N, pe_channels] = "
                                 f"[{x.size(0)}, {self.pe_channels}], got {got}")
        elif pe is not None:
            raise ValueError("pe was given but the model has pe_channels=0; construct it with "
                             "pe_channels=<size of the encodings>")
        x = feature_dropout(x, self.dropout, self.training)
        if x.layout == torch.strided or not _plain_linear(self.lin_in):
            h = _module_forward(self.lin_in, x)  # (N, D): also a lazy one's first call, and
            # one with hooks
        else:  # sparse features: the weight's gradient without torch's sort of x's entries
            h = sparse_linear(x, self.lin_in.weight, self.lin_in.bias)  # (N, D)
        if self.lin_pe is not None:
            h = h + self.lin_pe(pe.to(h.dtype))  # (N, D)
        weights, indexer_loss = [], None
        for attn_norm, attn, ffn_norm, ffn in zip(self.attn_norms, self.attns, self.ffn_norms,
                                                  self.ffns, strict=True):
            if return_attention_weights or return_indexer_loss:
                hn = attn_norm(h)  # (N, D)
                a, edges_alpha = attn(hn, edge_index, edge_attr,
                                      return_attention_weights=True, attn_bias=attn_bias,
                                      pos=pos)  # (N, D), ((2, E'), (E', H))
                weights.append(edges_alpha)
                if return_indexer_loss:
                    loss = attn.indexer_loss(hn, *edges_alpha, pos=pos)
                    indexer_loss = loss if indexer_loss is None else indexer_loss + loss
            else:
                a = attn(attn_norm(h), edge_index, edge_attr, attn_bias=attn_bias,
                         pos=pos)  # (N, D)
            h = h + dropout(a, self.dropout, self.training)
            h = h + dropout(ffn(ffn_norm(h)), self.dropout, self.training)
        out = self.lin_out(self.norm_out(h))  # (N, out_channels)
        result = (out, weights) if return_attention_weights else (out,)
        result += (indexer_loss,) if return_indexer_loss else ()
        return result if len(result) > 1 else out
