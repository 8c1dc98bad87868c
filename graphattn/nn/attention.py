"""Self-attention layers: over the edges of a graph, and its dense twin.

Both share one projection base, so their parameters have the same names and shapes and a
``state_dict`` loads from one into the other.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import LazyLinear, Linear
from torch_geometric.nn import MessagePassing

from graphattn._checks import (
    as_integer,
    check_bias_dtype,
    check_dropout,
    check_edge_index,
    check_finite,
    check_flag,
    check_float_dtype,
    check_in_channels,
    check_non_negative,
    check_positive,
    check_same_device,
    check_tensors,
    check_weight_dtype,
    exact_repr,
    finite_float,
    score_factor,
)
from graphattn._tensor_cache import TensorCache, cacheable, capturing_cuda_graph
from graphattn.functional import cpu
from graphattn.functional._transforms import host_readable
from graphattn.functional.attention import (
    BACKENDS,
    DENSE_REFUSES_SOFTCAP,
    SCORES,
    check_softcap,
    dense_attention,
    edge_attention_unchecked,
)
from graphattn.functional.dropout import dropout
from graphattn.functional.sparse_linear import sparse_linear
from graphattn.graphs import (
    SPARSE_LAYOUTS,
    _sparse_adjacency_and_values,
    _top_k_positions,
    from_sparse_adjacency,
)
from graphattn.nn.indexer import LightningIndexer, top_k_mask
from graphattn.nn.latent import LatentKeysValues, LatentValues, LowRankLinear, input_module
from graphattn.pe import QueryTemperature, RotaryPE


def _stacks(x: Tensor, widths: list[int]) -> bool:
    """Whether self-attention features ``x`` are projected by one product with the stacked
    weights of projections ``widths`` wide: always for sparse features, and for dense ones at
    least ``DENSE_STACK_MIN_FEATURES`` wide and ``DENSE_STACK_MIN_RATIO`` times the outputs."""
    return x.layout != torch.strided or x.size(-1) >= max(
        DENSE_STACK_MIN_FEATURES, DENSE_STACK_MIN_RATIO * sum(widths))


def _linear(in_features: int, out_features: int, bias: bool) -> Linear | LazyLinear:
    """``Linear``, or ``LazyLinear`` for ``in_features=-1`` (sized by its first input)."""
    if in_features == -1:
        return LazyLinear(out_features, bias=bias)
    return Linear(in_features, out_features, bias=bias)


def _plain_linear(lin: torch.nn.Module) -> bool:
    """Whether ``lin`` computes exactly ``F.linear(x, lin.weight, lin.bias)``: a ``Linear``
    (an initialised ``LazyLinear`` is one) without forward hooks, not a subclass."""
    return type(lin) is Linear and not (lin._forward_hooks or lin._forward_pre_hooks)


def _module_forward(lin: torch.nn.Module, x: Tensor) -> Tensor:
    """``lin(x)``, its hooks included. torch has no half-precision CSR or CSC product on the
    CPU: a CSR or CSC x in fp16 or bf16 there goes through ``lin`` dense, and a sparse x
    under ``torch.autocast`` goes through it with autocast off, the result in autocast's
    dtype, as :func:`sparse_linear` gives it."""
    if x.layout == torch.strided or x.device.type != "cpu":
        return lin(x)
    if (x.layout in (torch.sparse_csr, torch.sparse_csc)
            and x.dtype in (torch.float16, torch.bfloat16)):
        return lin(x.to_dense())
    if x.dtype == torch.float64 or not torch.is_autocast_enabled("cpu"):
        return lin(x)
    with torch.autocast("cpu", enabled=False):
        out = lin(x)
    return out.to(torch.get_autocast_dtype("cpu"))


def _check_rotary(rotary: RotaryPE | None, channels: int) -> RotaryPE | None:
    """``rotary`` unless it is neither ``None`` nor a ``RotaryPE`` that fits queries and keys
    of ``channels`` channels per head."""
    if rotary is None:
        return None
    if not isinstance(rotary, RotaryPE):
        raise TypeError(f"rotary must be a graphattn.pe.RotaryPE or None, got "
                        f"{type(rotary).__name__}")
    if rotary.dim > channels:
        raise ValueError(f"rotary rotates dim={rotary.dim} channels per head, more than the "
                         f"{channels} channels each head's queries and keys have "
                         f"(score_channels, else out_channels)")
    return rotary


def _check_query_temperature(temperature: QueryTemperature | None,
                             rotary: RotaryPE | None) -> QueryTemperature | None:
    """``temperature`` unless it is neither ``None`` nor a ``QueryTemperature``, or the
    positions of ``rotary`` have more than one coordinate."""
    if temperature is None:
        return None
    if not isinstance(temperature, QueryTemperature):
        raise TypeError(f"query_temperature must be a graphattn.pe.QueryTemperature or None, "
                        f"got {type(temperature).__name__}")
    if rotary is not None and rotary.axes != 1:
        raise ValueError(f"query_temperature takes one position per node, and rotary's have "
                         f"axes={rotary.axes} coordinates")
    return temperature


def _score_channels(score_channels: int | None, out_channels: int,
                    differential: bool = False) -> int:
    """The channels per head of the queries and keys: ``score_channels``, else
    ``out_channels`` (the values'), or half of them for each of the two maps of
    ``differential=True`` (the Differential Transformer's heads: values of 2d channels beside
    two query-key pairs of d)."""
    if score_channels is not None:
        return check_positive(score_channels, "score_channels")
    if check_flag(differential, "differential") and out_channels % 2:
        raise ValueError(f"differential=True gives each of its two maps half the values' "
                         f"channels as queries and keys, and out_channels={out_channels} is "
                         f"odd: give score_channels")
    return out_channels // 2 if differential else out_channels


def _check_differential(differential: bool, dropout: float, share_value: bool, *,
                        attention: str = "dot", edge_mode: str = "bias") -> None:
    """Raise unless ``differential=True`` goes with the other arguments: the dot score, edge
    features as a score bias, keys of their own and no attention dropout."""
    if not check_flag(differential, "differential"):
        return
    for fits, what in ((attention == "dot", f"attention={attention!r}"),
                       (edge_mode == "bias", f"edge_mode={edge_mode!r}"),
                       (not share_value, "share_value=True"),
                       (not dropout, f"dropout={dropout!r}")):
        if not fits:
            raise ValueError(
                f"differential=True takes the difference of two dot-score maps over the same "
                f"values: it needs attention='dot', edge features as a bias of the scores, "
                f"keys apart from the values and no dropout of the weights (which the two "
                f"maps could not share); got {what}")


def _check_latent(q_rank: int | None, kv_rank: int | None, shared_key_channels: int,
                  score_channels: int, in_channels: int | tuple[int, int],
                  differential: bool) -> tuple[int | None, int | None, int]:
    """``q_rank``, ``kv_rank`` and ``shared_key_channels`` checked; raise where they do not
    fit the layer's other options."""
    q_rank = None if q_rank is None else check_positive(q_rank, "q_rank")
    kv_rank = None if kv_rank is None else check_positive(kv_rank, "kv_rank")
    shared = check_non_negative(shared_key_channels, "shared_key_channels")
    if shared and kv_rank is None:
        raise ValueError(f"shared_key_channels={shared_key_channels!r} shares key channels "
                         f"among the heads of latent keys and needs kv_rank")
    if kv_rank is not None and shared >= score_channels:
        raise ValueError(f"shared_key_channels must be below the keys' score_channels = "
                         f"{score_channels} (the others come from the latent), got "
                         f"{shared_key_channels!r}")
    if q_rank is None and kv_rank is None:
        return None, None, 0
    name = "q_rank" if q_rank is not None else "kv_rank"
    if differential:
        raise ValueError(f"{name} (latent projections) and differential=True do not combine: "
                         f"the two maps would each need latents of their own")
    widths = in_channels if isinstance(in_channels, (tuple, list)) else (in_channels,)
    if -1 in widths:
        raise ValueError(f"{name} (latent projections) needs the input features' count, got "
                         f"in_channels={in_channels!r}")
    return q_rank, kv_rank, shared


def _check_latent_options(q_rank: int | None, kv_rank: int | None, *, attention: str = "dot",
                          share_value: bool = False, share_weights: bool = False) -> None:
    """Raise where latent projections (``q_rank``, ``kv_rank``) meet options they do not
    combine with: another score than the dot product, keys that are the queries' projection
    (``share_weights``) or values that are the keys' (``share_value``)."""
    if q_rank is None and kv_rank is None:
        return
    name = "q_rank" if q_rank is not None else "kv_rank"
    if attention != "dot":
        raise ValueError(f"{name} (latent projections) needs the dot score, got "
                         f"attention={attention!r}")
    for flag, what in ((share_weights, "share_weights"), (share_value, "share_value")):
        if flag is True:
            raise ValueError(f"{name} (latent projections) and {what}=True do not combine: "
                             f"{what} makes one Linear serve two projections")


def _glorot(lin: torch.nn.Module) -> None:
    if not isinstance(lin, Linear):  # (the latent projections: each product on its own)
        lin.reset_parameters()
        return
    torch.nn.init.xavier_uniform_(lin.weight)
    if lin.bias is not None:
        torch.nn.init.zeros_(lin.bias)


class _SelfAttentionBase(torch.nn.Module):
    """Projections ``lin_q, lin_k, lin_v``, ``lin_out`` and ``res`` and the head merge, for both
    layers."""

    def __init__(self, in_channels: int | tuple[int, int], out_channels: int, heads: int,
                 concat: bool, dropout: float, bias: bool, out_proj: bool, *,
                 score_channels: int, value_dropout: float, residual: bool, beta: bool,
                 kv_heads: int | None = None, qk_norm: str | None = None,
                 scale: float | None = None, gate: str | None = None,
                 qk_norm_after_rotary: bool = False, v_norm: bool = False,
                 out_norm: str | None = None, differential: bool = False,
                 lambda_init: float | None = None, out_dropout: float = 0.0,
                 q_rank: int | None = None, kv_rank: int | None = None,
                 shared_key_channels: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        concat, bias, out_proj, residual, beta = (
            check_flag(value, name) for value, name in ((concat, "concat"), (bias, "bias"),
                                                        (out_proj, "out_proj"),
                                                        (residual, "residual"), (beta, "beta")))
        heads = check_positive(heads, "heads")
        kv_heads = heads if kv_heads is None else check_positive(kv_heads, "kv_heads")
        if heads % kv_heads:
            raise ValueError(f"kv_heads must divide heads = {heads} (each key and value head "
                             f"serves heads / kv_heads query heads), got kv_heads={kv_heads}")
        out_channels = check_positive(out_channels, "out_channels")
        check_dropout(dropout)
        check_dropout(value_dropout, "value_dropout")
        check_dropout(out_dropout, "out_dropout")
        in_channels = check_in_channels(in_channels)
        score_channels = check_positive(score_channels, "score_channels")
        in_src, in_dst = (in_channels if isinstance(in_channels, (tuple, list))
                          else (in_channels, in_channels))
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.score_channels = score_channels  # per head, of the queries and keys
        self.heads = heads
        self.kv_heads = kv_heads
        self.concat = concat
        self.dropout = float(dropout)
        self.value_dropout = float(value_dropout)
        self.out_dropout = float(out_dropout)
        H, C = heads, out_channels
        # differential=True: two maps, each head's two queries and keys (map-major: lin_q
        # gives [2, H, C_qk], lin_k [2, H_kv, C_qk]), one value
        self.differential = check_flag(differential, "differential")
        maps = 2 if self.differential else 1
        # q_rank, kv_rank: the queries, the keys and values through normalised latents
        # (multi-head latent attention, graphattn.nn.latent)
        self.q_rank, self.kv_rank, self.shared_key_channels = _check_latent(
            q_rank, kv_rank, shared_key_channels, score_channels, in_channels,
            self.differential)
        self.lin_q = (_linear(in_dst, maps * H * score_channels, bias) if q_rank is None
                      else LowRankLinear(in_dst, self.q_rank, H * score_channels, bias=bias))
        if kv_rank is None:
            self.lin_k = _linear(in_src, maps * kv_heads * score_channels, bias)
            self.lin_v = _linear(in_src, kv_heads * C, bias)
        else:
            self.lin_k = LatentKeysValues(in_src, self.kv_rank, kv_heads, score_channels, C,
                                          self.shared_key_channels, bias=bias)
            self.lin_v = LatentValues(self.lin_k)  # (lin_k's parameters, registered once)
        out_dim = H * C if concat else C
        self.lin_out = Linear(out_dim, out_dim, bias=bias) if out_proj else None
        self.residual = bool(residual)
        self.res = _linear(in_dst, out_dim, bias) if residual else None
        if beta and not residual:
            raise ValueError("beta=True gates the residual term and needs residual=True, "
                             f"got residual={residual!r}")
        self.beta = bool(beta)
        # the gate's weights w: beta_i = sigmoid(w . [o_i, r_i, o_i - r_i])
        self.lin_beta = Linear(3 * out_dim, 1, bias=False) if beta else None
        if qk_norm is not None and (not isinstance(qk_norm, str) or qk_norm not in QK_NORMS):
            raise ValueError(f"qk_norm must be None or one of {list(QK_NORMS)}, got "
                             f"{qk_norm!r}")
        if qk_norm is not None and score_channels == 1:
            raise ValueError(f"qk_norm={qk_norm!r} normalises the queries and keys over "
                             f"their channels and needs the dot or gatv2 score; the additive "
                             f"score's are one number per head")
        self.qk_norm = qk_norm
        if check_flag(qk_norm_after_rotary, "qk_norm_after_rotary") and qk_norm is None:
            raise ValueError("qk_norm_after_rotary=True places the normalisation of the "
                             "queries and keys after their rotation, and needs a qk_norm; got "
                             "qk_norm=None")
        self.qk_norm_after_rotary = bool(qk_norm_after_rotary)
        self.scale = None if scale is None else finite_float(scale, "scale")
        # normalisation of the queries and keys over each head's channels, with gains of each
        # channel ([C]) or of each head's channel ([H, C]: _per_head), or over all heads'
        # channels together (_across_heads: [H * C])
        c, qh, kh = score_channels, maps * H, maps * kv_heads  # (query and key heads)
        q_shape, k_shape = ((qh * c, kh * c) if qk_norm in QK_NORMS_ACROSS_HEADS
                            else ((qh, c), (kh, c)) if qk_norm in QK_NORMS_PER_HEAD
                            else (c, c))
        self.q_norm = None if qk_norm is None else QK_NORMS[qk_norm](q_shape, eps=1e-6)
        self.k_norm = None if qk_norm is None else QK_NORMS[qk_norm](k_shape, eps=1e-6)
        # RMS normalisation of each head's values, without gains
        self.v_norm = (torch.nn.RMSNorm(C, eps=1e-6, elementwise_affine=False)
                       if check_flag(v_norm, "v_norm") else None)
        if gate is not None and gate not in GATES:
            raise ValueError(f"gate must be None or one of {GATES}, got {gate!r}")
        self.gate = gate
        # the gate of each head's output (of each of its channels), from the target's features
        self.lin_gate = (None if gate is None
                         else _linear(in_dst, H * C if gate == "elementwise" else H, bias))
        if out_norm is not None and (not isinstance(out_norm, str) or out_norm not in OUT_NORMS):
            raise ValueError(f"out_norm must be None or one of {list(OUT_NORMS)}, got "
                             f"{out_norm!r}")
        self.out_norm = out_norm
        # normalisation of the merged heads' output before lin_out (a sub-norm), with gains
        self.o_norm = None if out_norm is None else OUT_NORMS[out_norm](out_dim, eps=1e-6)
        # the Differential Transformer's lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init
        # and its RMS norm of each head's difference, with gains
        if lambda_init is not None and not self.differential:
            raise ValueError(f"lambda_init={lambda_init!r} sets the differential attention's "
                             f"lambda and needs differential=True")
        self.lambda_init = (finite_float(0.8 if lambda_init is None else lambda_init,
                                         "lambda_init") if self.differential else None)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            (torch.nn.Parameter(torch.empty(score_channels)) for _ in range(4))
            if self.differential else (None,) * 4)
        self.diff_norm = torch.nn.RMSNorm(C, eps=1e-5) if self.differential else None
        self.out_bias: torch.nn.Parameter | None = None  # GraphSelfAttention(out_bias=True)

    def _check_indexer(self, indexer: LightningIndexer | None) -> LightningIndexer | None:
        """``indexer``, checked against the layer's inputs: its features' width, its queries'
        (the layer's query latent with ``q_rank``), and positions from the layer's
        ``rotary``."""
        if indexer is None:
            return None
        if not isinstance(indexer, LightningIndexer):
            raise TypeError(f"indexer must be a graphattn.nn.LightningIndexer or None, got "
                            f"{type(indexer).__name__}")
        widths = (self.in_channels if isinstance(self.in_channels, (tuple, list))
                  else (self.in_channels,))
        if any(width != indexer.in_channels for width in widths):
            raise ValueError(f"indexer.in_channels must be the features' width, "
                             f"in_channels={self.in_channels!r}, got {indexer.in_channels}")
        queries = self.q_rank if self.q_rank is not None else widths[-1]
        if indexer.query_channels != queries:
            what = "query latent (q_rank)" if self.q_rank else "targets' features"
            raise ValueError(f"indexer.query_channels must be {queries}, the width of the "
                             f"layer's {what}, got {indexer.query_channels}")
        if indexer.rotary is not None and self.rotary is None:
            raise ValueError("the indexer has a rotary embedding, which takes the positions "
                             "the layer's rotary takes: give the layer rotary= too")
        return indexer

    def __prepare_scriptable__(self):
        # torch.jit.script calls this on every submodule before compiling it: refuse here, by
        # name, rather than with TorchScript's error about the keyword-only ``size``
        raise RuntimeError(
            f"torch.jit.script does not compile {type(self).__name__}: graphattn's layers are "
            "written for torch.compile and torch.export, not TorchScript. Use "
            "torch.export.export (node and edge counts can be dynamic) or torch.compile")

    def reset_parameters(self) -> None:
        """Glorot-uniform weights (each projection on its own) and zero biases.

        Projections whose input size is still to be inferred (``in_channels=-1``) are
        initialised when the first call gives them their shape.
        """
        for lin in (self.lin_q, self.lin_k, self.lin_v, self.lin_out, self.res, self.lin_beta,
                    self.lin_gate):
            if lin is not None and not (isinstance(lin, LazyLinear)
                                        and lin.has_uninitialized_params()):
                _glorot(lin)
        for norm in (self.q_norm, self.k_norm, self.o_norm, self.diff_norm):
            if norm is not None:
                norm.reset_parameters()
        for lam in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
            if lam is not None:  # (the Differential Transformer's initialisation)
                torch.nn.init.normal_(lam, 0.0, 0.1)

    def _infer_in_channels(self, x_src: Tensor, x_dst: Tensor) -> None:
        """Turn the projections of ``in_channels=-1`` into ``Linear`` modules sized by the
        first inputs (Glorot-initialised, unless a loaded ``state_dict`` already filled them).

        Each one is called once on an empty batch: that runs the lazy module's own hook, which
        sizes it and makes it a ``Linear``, also when sparse features never pass through it
        (:meth:`_project` reads their weights directly).
        """
        for lin, x in ((self.lin_q, x_dst), (self.lin_k, x_src), (self.lin_v, x_src),
                       (self.res, x_dst), (self.lin_gate, x_dst)):
            if isinstance(lin, LazyLinear) and isinstance(x, Tensor) and x.dim() >= 2:
                fresh = lin.has_uninitialized_params()
                lin(torch.empty(0, x.size(-1), dtype=lin.weight.dtype, device=x.device))
                if fresh:
                    _glorot(lin)

    def _project(self, x_src: Tensor, x_dst: Tensor | None,
                 ) -> tuple[Tensor | None, Tensor, Tensor]:
        r"""``lin_q(x_dst), lin_k(x_src)`` and ``lin_v(x_src)``, with ``value_dropout`` on the
        values' product :math:`W^V x_j` and not on their bias; one product for sparse
        self-attention. Without ``x_dst`` (``GATConv``'s ``x = (x_src, None)``, for the additive
        score) there are no queries: ``None``.

        In training with ``value_dropout = p > 0`` the values are
        :math:`v_j = m_j \odot W^V x_j + b^V` (:math:`m_j` a dropout mask, drawn once per source
        node): the GAT reference code, too, drops :math:`W x_j` and not the bias (which it adds
        after the weighted sum).

        For sparse (CSR or COO) features of self-attention, x is multiplied once by the stacked
        weights ``[W^Q; W^K; W^V]``: one sparse product and one transpose in backward instead
        of three (for CSR on CPU, :func:`~graphattn.functional.sparse_linear.sparse_linear`'s
        counting-sort transpose). So are dense features at least ``DENSE_STACK_MIN_RATIO``
        times wider than the three outputs together, and at least ``DENSE_STACK_MIN_FEATURES``
        wide (raw bag-of-words features, as PyG's ``Planetoid`` gives them): x is read once, in
        forward and for the weights' gradients,
        instead of three times, which outweighs copying the outputs apart. Narrower dense
        features take three products, whose outputs are contiguous: the attention kernels read
        them without a copy and backward needs no concatenation.
        Parameters stay three ``Linear`` modules either way. With ``share_value`` the keys'
        product serves the values (stacked with the queries' by the same rule). A projection
        that is not a plain ``Linear`` (one with forward hooks, a parametrization such as
        ``weight_norm``, a quantized or other subclass) makes the features, dense or sparse,
        go through each module's own forward instead, so that what it adds runs (the forward
        pre-hooks of ``torch.nn.utils.spectral_norm`` and ``prune`` compute the weight).
        """
        lins = (self.lin_q, self.lin_k, self.lin_v)
        drop = self.training and self.value_dropout > 0.0
        if self.q_rank is not None or self.kv_rank is not None:  # each module's own forward
            q = None if x_dst is None else self.lin_q(x_dst)
            k, v = (self.lin_k.keys_values(x_src) if self.kv_rank is not None
                    else (self.lin_k(x_src), self.lin_v(x_src)))
            if drop:
                b = self.lin_v.bias
                v = dropout(v if b is None else v - b, self.value_dropout, self.training)
                v = v if b is None else v + b
            return q, k, v
        if not all(_plain_linear(lin) for lin in lins):
            q = None if x_dst is None else _module_forward(self.lin_q, x_dst)
            k = _module_forward(self.lin_k, x_src)
            v = k if self.lin_v is self.lin_k else _module_forward(self.lin_v, x_src)
            if drop:  # on W^V x_j, not on the bias
                b = self.lin_v.bias
                v = dropout(v if b is None else v - b, self.value_dropout, self.training)
                v = v if b is None else v + b
            return q, k, v
        value_bias = self.lin_v.bias if drop else None  # added after the dropout
        project = F.linear if x_src.layout == torch.strided else sparse_linear
        if self.lin_v is self.lin_k:  # share_value: one product, W^K x_j, for k_j and v_j
            lin_q, lin_k = self.lin_q, self.lin_k
            widths = [lin_q.out_features, lin_k.out_features]
            q = None
            if x_src is x_dst and lin_q is not lin_k and _stacks(x_src, widths):
                q, product = project(x_src, torch.cat([lin_q.weight, lin_k.weight])).split(
                    widths, dim=-1)
                q = q if lin_q.bias is None else q + lin_q.bias
            else:
                product = project(x_src, lin_k.weight)  # (N_src, H * C)
            k = product if lin_k.bias is None else product + lin_k.bias
            if q is None:
                q = k if lin_q is lin_k and x_dst is x_src else lin_q(x_dst)
            if not drop:
                return q, k, k
            v = dropout(product, self.value_dropout, self.training)
            return q, k, v if lin_k.bias is None else v + lin_k.bias
        widths = [lin.out_features for lin in lins]
        if x_src is not x_dst or not _stacks(x_src, widths):
            q = None if x_dst is None else self.lin_q(x_dst)
            k = self.lin_k(x_src)
            v = F.linear(x_src, self.lin_v.weight) if drop else self.lin_v(x_src)
        else:
            weight = torch.cat([lin.weight for lin in lins])  # (2 * H * C_qk + H * C, F)
            # the values' bias, when dropout is on, is added after it (a zero bias here); a
            # projection without a bias (GAT's lin_v) gets zeros
            biases = (self.lin_q.bias, self.lin_k.bias, None if drop else self.lin_v.bias)
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([lin.weight.new_zeros(lin.out_features) if b is None else b
                                  for lin, b in zip(lins, biases, strict=True)])
            q, k, v = project(x_src, weight, bias).split(widths, dim=-1)
        v = dropout(v, self.value_dropout, self.training)
        return q, k, v if value_bias is None else v + value_bias

    def _normalize_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """Queries ``[..., H, c]`` and keys ``[..., kv_heads, c]`` normalised by ``q_norm`` and
        ``k_norm`` over each head's channels, or over all heads' together (with ``qk_norm``;
        as they are without)."""
        if self.q_norm is None:
            return q, k
        if self.qk_norm in QK_NORMS_ACROSS_HEADS:  # over [..., H * c], as the projection gave
            return (self.q_norm(q.flatten(-2)).view(q.shape),
                    self.k_norm(k.flatten(-2)).view(k.shape))
        if self.qk_norm in QK_NORMS_PER_HEAD:  # over [..., c], each head's gains [H, c]
            return _each_head_normalized(q, self.q_norm), _each_head_normalized(k, self.k_norm)
        return self.q_norm(q), self.k_norm(k)

    def _differential_lambda(self) -> Tensor:
        r"""The differential attention's :math:`\lambda = e^{\lambda_{q1} \cdot
        \lambda_{k1}} - e^{\lambda_{q2} \cdot \lambda_{k2}} + \lambda_{init}`, a scalar
        (computed in float32 at least)."""
        dtype = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        dot1 = (self.lambda_q1.to(dtype) * self.lambda_k1.to(dtype)).sum()
        dot2 = (self.lambda_q2.to(dtype) * self.lambda_k2.to(dtype)).sum()
        return torch.exp(dot1) - torch.exp(dot2) + self.lambda_init

    def _differential_maps(self, attend, q: Tensor, k: Tensor, *, weights: bool,
                           ) -> Tensor | tuple[Tensor, Tensor]:
        r"""``attend(q, k, sinks)`` on each of the two maps of ``differential=True`` (queries
        ``[..., 2H, C_qk]`` and keys ``[..., 2 H_kv, C_qk]``, map 1's heads first) and their
        outputs ``[..., H, C]`` as one: :math:`(1 - \lambda_{init})\,
        \mathrm{RMSNorm}(o_1 - \lambda o_2)` over each head's C channels; with ``weights``
        also the weights :math:`\alpha_1 - \lambda \alpha_2`."""
        H, kv = self.heads, self.kv_heads
        sinks = (None, None) if self.sinks is None else (self.sinks[:H], self.sinks[H:])
        first = attend(q[..., :H, :], k[..., :kv, :], sinks[0])
        second = attend(q[..., H:, :], k[..., kv:, :], sinks[1])
        lam = self._differential_lambda()
        out1, out2 = (first[0], second[0]) if weights else (first, second)
        out = self.diff_norm(out1 - lam.to(out1.dtype) * out2) * (1.0 - self.lambda_init)
        if not weights:
            return out
        return out, first[1] - lam.to(first[1].dtype) * second[1]

    def _merge_heads(self, out: Tensor, x_dst: Tensor | None) -> Tensor:
        """``[..., H, C]`` times ``sigmoid(lin_gate(x_dst))`` with ``gate``, then ``[...,
        H*C]`` (concat) or ``[..., C]`` (mean), normalised by ``o_norm`` with ``out_norm``,
        then ``lin_out`` and dropout (``out_dropout``), plus ``res(x_dst)`` with
        ``residual=True`` (gated by ``lin_beta`` with ``beta=True``; left out without
        ``x_dst``, as ``GATConv`` leaves it out), plus ``out_bias``."""
        if self.lin_gate is not None:  # (x_dst is there: the forwards refuse a gate without)
            gate = torch.sigmoid(self.lin_gate(x_dst))  # (..., H * C) or (..., H)
            width = out.size(-1) if self.gate == "elementwise" else 1  # (not -1: 0 nodes)
            out = out * gate.view(*out.shape[:-1], width)  # (..., H, C) times (..., H, C or 1)
        out = out.flatten(-2) if self.concat else out.mean(dim=-2)  # (..., D)
        out = out if self.o_norm is None else self.o_norm(out)
        out = out if self.lin_out is None else self.lin_out(out)
        out = dropout(out, self.out_dropout, self.training)
        if self.res is not None and x_dst is not None:
            skip = self.res(x_dst)  # (..., D)
            if self.lin_beta is None:
                out = out + skip
            else:
                gate = torch.sigmoid(self.lin_beta(torch.cat([out, skip, out - skip],
                                                             dim=-1)))  # (..., 1)
                out = gate * skip + (1 - gate) * out
        return out if self.out_bias is None else out + self.out_bias

    def _check_features(self, x: Tensor, lin: Linear, name: str) -> None:
        """Raise unless ``x`` is ``[N, F]`` with the ``F`` that ``lin`` takes."""
        if not isinstance(x, Tensor) or x.dim() != 2:
            shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must have shape [N, F], got {shape}")
        check_float_dtype(**{name: x})
        if x.size(-1) != lin.in_features:
            raise ValueError(f"{name} must have F = in_channels = {lin.in_features} features, "
                             f"got {list(x.shape)}")
        check_weight_dtype(x, input_module(lin), name)

    def _repr_args(self) -> str:
        """The constructor's arguments, those away from their defaults after ``heads``."""
        extra = "" if self.concat else ", concat=False"
        extra += f", dropout={self.dropout}" if self.dropout else ""
        extra += "" if input_module(self.lin_q).bias is not None else ", bias=False"
        extra += "" if self.lin_out is not None else ", out_proj=False"
        extra += f", value_dropout={self.value_dropout}" if self.value_dropout else ""
        extra += f", out_dropout={self.out_dropout}" if self.out_dropout else ""
        extra += "" if self.q_rank is None else f", q_rank={self.q_rank}"
        extra += "" if self.kv_rank is None else f", kv_rank={self.kv_rank}"
        if self.shared_key_channels:
            extra += f", shared_key_channels={self.shared_key_channels}"
        extra += ", residual=True" if self.residual else ""
        extra += ", beta=True" if self.beta else ""
        extra += "" if self.kv_heads == self.heads else f", kv_heads={self.kv_heads}"
        extra += "" if self.qk_norm is None else f", qk_norm={self.qk_norm!r}"
        extra += ", qk_norm_after_rotary=True" if self.qk_norm_after_rotary else ""
        extra += "" if self.v_norm is None else ", v_norm=True"
        default = self.out_channels // 2 if self.differential else self.out_channels
        if getattr(self, "attention", "dot") == "additive":
            default = 1  # the additive score's one number per head
        if self.score_channels != default:
            extra += f", score_channels={self.score_channels}"
        extra += "" if self.scale is None else f", scale={exact_repr(self.scale)}"
        extra += "" if self.gate is None else f", gate={self.gate!r}"
        extra += "" if self.out_norm is None else f", out_norm={self.out_norm!r}"
        if self.differential:
            extra += ", differential=True"
            if self.lambda_init != 0.8:
                extra += f", lambda_init={exact_repr(self.lambda_init)}"
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads}{extra}"


class GraphSelfAttention(_SelfAttentionBase, MessagePassing):
    r"""Multi-head self-attention over the edges of a graph.

    Node i attends to its in-neighbours j (edges j -> i), per head h:

    .. math::
        q_i = W^Q x_i,\; k_j = W^K x_j,\; v_j = W^V x_j, \qquad
        \alpha_{ij} = \operatorname{softmax}_{j \in \mathcal{N}(i)}
            \Big(\frac{q_i \cdot k_j}{\sqrt{C}} + w_h^\top e_{ij}\Big), \qquad
        x'_i = W^O \big\Vert_{h=1}^{H} \sum_{j \in \mathcal{N}(i)} \alpha_{ij} v_j
            \; \big[\, + \, W^R x_i \,\big]

    (the last term with ``residual=True``; ``beta=True`` gates it). That is
    ``edge_mode="bias"``; ``"key"`` and ``"key_value"`` put :math:`W^E e_{ij}` into
    :math:`k_j` (and :math:`v_j`) instead.

    With ``attention="additive"`` the score is GAT's
    :math:`\mathrm{LeakyReLU}(a_l^\top W x_i + a_r^\top W x_j + w_h^\top e_{ij})` (slope
    ``negative_slope``);
    then ``lin_q`` and ``lin_k`` map to one number per head (``Linear(in, H)``), which is that
    score term folded into one matrix. With ``bias=True`` their biases add a learnt constant per
    head inside the LeakyReLU, which ``GATConv`` does not have (a copy of its weights sets them
    to 0). With ``attention="gatv2"`` the score is GATv2's
    dynamic attention (Brody et al., 2022),
    :math:`a_h^\top \mathrm{LeakyReLU}(W^Q x_i + W^K x_j) + w_h^\top e_{ij}`, with an
    attention vector ``att`` :math:`[H, C]`; PyG's ``GATv2Conv`` is the case :math:`W^V = W^K`
    (with ``edge_mode="key"`` its edge features enter inside the LeakyReLU, as in
    ``GATv2Conv``). The fused backends compute it without any ``[E, H, C]`` tensor, which
    ``GATv2Conv`` keeps for autograd. On the complete graph with self-loops, ``concat=True``,
    ``out_proj=True`` and ``bias=True``, the layer computes exactly what
    ``torch.nn.MultiheadAttention(H * C, H)`` computes.

    The graph is an ``edge_index`` ``[2, E]`` (or PyG's ``EdgeIndex``) or a sparse adjacency
    ``adj_t [N_dst, N_src]`` in torch's COO, CSR or CSC layout (PyG's
    ``ToSparseTensor(layout=...)`` builds the COO and CSR ones): each stored entry ``(i, j)``
    is an edge j -> i and its value is ignored (see
    :func:`~graphattn.graphs.from_sparse_adjacency`). With a sparse adjacency, ``edge_attr``
    rows follow its stored entries, and the attention weights come back as a sparse adjacency
    of the same layout holding ``alpha`` as values, as PyG's ``GATConv`` returns them.

    With the additive score ``x`` may be ``(x_src, None)``, as ``GATConv`` takes it: the
    targets have no features, so the score has no target term,
    :math:`\mathrm{LeakyReLU}(a_r^\top W x_j + w_h^\top e_{ij})` (``lin_q``, its bias
    included, is left out), and neither has the output a residual (``GATConv`` leaves it out
    too). Their count :math:`|V_{dst}|` is ``size[1]``; else the rows of a sparse adjacency,
    or the columns of an ``EdgeIndex``'s sparse size; else :math:`|V_{src}|`, as in
    ``GATConv`` (a ``size[1]`` that contradicts the adjacency or the ``EdgeIndex`` is
    refused, where ``GATConv`` takes theirs). With ``add_self_loops`` the first
    :math:`\min(|V_{src}|, |V_{dst}|)` nodes get a loop (``GATConv`` then needs ``size``
    with both counts, or none, and so does the layer; an ``EdgeIndex`` without ``size`` then
    counts at least :math:`|V_{src}|` targets, as ``GATConv``'s loops make it). The dot and
    gatv2 scores need the targets' queries and refuse ``x_dst=None``, as ``TransformerConv``
    and ``GATv2Conv`` do; so does ``beta=True``, which gates the residual.

    Args:
        in_channels (int or tuple): input features F, or ``(F_src, F_dst)`` for bipartite graphs;
            ``-1`` (or ``(-1, -1)``) infers them from the first call, as PyG's lazy layers do
            (for ``torch_geometric.nn.to_hetero``); run one forward before building the
            optimizer.
        out_channels (int): channels per head C.
        heads (int, optional): number of heads H. (default: ``1``)
        concat (bool, optional): concatenate the heads (``H * C`` outputs); if ``False`` average
            them (``C`` outputs). (default: ``True``)
        dropout (float, optional): dropout on the attention weights. (default: ``0.0``)
        value_dropout (float, optional): dropout on the projected values :math:`v_j`, once per
            node before they are weighted and summed (every target of j sees the same dropped
            :math:`v_j`), as the GAT reference code drops :math:`W x_j`: the bias of ``lin_v``
            is added after the dropout. (default: ``0.0``)
        bias (bool, optional): biases in the projections. (default: ``True``)
        out_proj (bool, optional): apply the output projection ``lin_out`` (W^O).
            (default: ``True``)
        add_self_loops (bool, optional): give every target exactly one self-loop (existing ones
            are replaced, with their features; for bipartite inputs the first
            ``min(N_src, N_dst)`` nodes). In ``torch.compile``'s default mode, and while a
            CUDA graph is captured, the existing ones stay in place with a score of -inf, so
            that the edge count does not depend on the data (README, torch.compile).
            (default: ``True``)
        edge_dim (int, optional): edge feature size; ``edge_attr`` then enters as
            ``edge_mode`` says. A call without ``edge_attr`` leaves the edge term out, as
            ``GATConv`` does (``TransformerConv`` refuses it). (default: ``None``)
        edge_mode (str, optional): how edge features :math:`e_{ij}` enter, with ``edge_dim``:
            ``"bias"`` adds :math:`w_h^\top e_{ij}` to the score of head h
            (``lin_edge = Linear(edge_dim, H)``; ``GATConv``'s way, inside its LeakyReLU for
            the additive score); ``"key"`` adds :math:`W^E e_{ij}` to the key,
            :math:`k_{ij} = k_j + W^E e_{ij}` (``lin_edge = Linear(edge_dim, H * C)``; for
            the gatv2 score this is ``GATv2Conv``'s way, inside the LeakyReLU);
            ``"key_value"`` adds it to the key and the value, :math:`v_{ij} = v_j + W^E
            e_{ij}` (``TransformerConv``'s way). ``"key"`` and ``"key_value"`` are for the dot
            and gatv2 scores, and need ``edge_dim``. The operator takes :math:`W^E e_{ij}` as
            its ``edge_key`` (and ``edge_value``): the ``cpu`` and ``triton`` kernels add it as
            they go, where PyG builds a key (and value) ``[H, C]`` per edge.
            (default: ``"bias"``)
        fill_value (float or Tensor or str, optional): ``edge_attr`` of the added self-loops,
            as in PyG: ``"mean"``, ``"add"``, ``"max"``, ``"min"`` or ``"mul"`` of the target's
            other in-edge features (without any: 1 for ``"mul"``, 0 for the others), or a
            finite constant (a number, or a tensor or list of 1 or ``edge_dim`` values). On
            CUDA the sums of ``"mean"`` and ``"add"`` use atomic adds, as PyG's do, so their
            last bits can vary from run to run unless ``torch.use_deterministic_algorithms(True)``;
            the ``triton`` and ``cpu`` attention kernels themselves are deterministic.
            (default: ``"mean"``)
        attention (str, optional): ``"dot"`` (scaled dot product), ``"additive"`` (GAT) or
            ``"gatv2"`` (GATv2). (default: ``"dot"``)
        backend (str, optional): backend of :func:`~graphattn.functional.edge_attention`.
            (default: ``"auto"``)
        negative_slope (float, optional): LeakyReLU slope of the additive and gatv2 scores.
            (default: ``0.2``)
        share_weights (bool, optional): one projection for targets and sources: ``lin_k`` is
            ``lin_q`` (as ``GATv2Conv(share_weights=True)``; needs ``F_src = F_dst``).
            (default: ``False``)
        residual (bool, optional): add a skip connection ``res = Linear(F_dst, out)`` of the
            target's own features to the output (with a bias when ``bias``), as
            ``GATConv(residual=True)`` does and ``TransformerConv``'s ``lin_skip``.
            (default: ``False``)
        beta (bool, optional): with ``residual=True``, mix the attention output :math:`o_i`
            and the residual :math:`r_i = W^R x_i` by a learned gate instead of adding them,
            as ``TransformerConv(beta=True)``: :math:`\beta_i = \sigma(w^\top [o_i \Vert r_i
            \Vert o_i - r_i])`, :math:`x'_i = \beta_i r_i + (1 - \beta_i) o_i`
            (``lin_beta = Linear(3 * out, 1, bias=False)``). (default: ``False``)
        share_value (bool, optional): the values are the keys: ``lin_v`` is ``lin_k``, one
            product for both, :math:`v_j = k_j = W^K x_j` (as ``GATv2Conv``, whose
            ``lin_l`` serves both; ``value_dropout`` still drops the values alone). For the
            dot and gatv2 scores. (default: ``False``)
        out_bias (bool, optional): a learned bias ``out_bias`` ``[out]`` added to every
            output, after the residual: a target without an in-edge gets it too, as with the
            output bias of ``GATConv`` and ``GATv2Conv``. (default: ``False``)
        rotary (graphattn.pe.RotaryPE, optional): rotate the queries by the targets'
            positions and the keys by the sources' (the forward's ``pos``), so that each score
            depends on :math:`p_i - p_j` (RoPE): on :func:`~graphattn.graphs.causal_graph` with
            positions ``0 .. L-1``, LLaMA's attention; with ``axes=2`` and
            :func:`~graphattn.pe.grid_positions`, 2-D RoPE on an image. The dot score only.
            With ``edge_mode="key"`` the edge term :math:`W^E e_{ij}` is added to the rotated
            key. (default: ``None``)
        kv_heads (int, optional): heads of the keys and values, a divisor of ``heads``:
            ``lin_k`` and ``lin_v`` map to ``kv_heads * C``, and each key and value head
            serves ``heads / kv_heads`` consecutive query heads (grouped-query attention, as
            in LLaMA 2 and 3; 1 is multi-query attention). It saves parameters and projection
            work; ``edge_attention`` takes the keys and values as they are: the ``"dense"``
            backend hands them to SDPA so (no copy per query head), the sparse kernels read
            them repeated to ``heads``. For the dot and gatv2 scores. ``None`` is ``heads``.
            (default: ``None``)
        qk_norm (str, optional): normalise each head's query and key over their C channels
            before scoring (and before ``rotary``), with learned gains ``q_norm`` and
            ``k_norm``: ``"rms"``, :math:`\hat q = g \odot q / \sqrt{\overline{q^2} +
            \epsilon}` (``torch.nn.RMSNorm(C)``, as Qwen3 and Gemma 3 do), or ``"layer"``
            (``torch.nn.LayerNorm(C)``, as ViT-22B does), :math:`\epsilon = 10^{-6}`;
            ``"rms_per_head"`` or ``"layer_per_head"``: the same, but with each head's own
            gains (and biases), ``q_norm.weight`` of shape ``[H, C]`` and ``k_norm.weight``
            ``[kv_heads, C]`` (as Chameleon does); or
            over all heads' channels together, before the projection is split into heads:
            ``"rms_across_heads"`` (``RMSNorm(H * C)`` for the queries and ``RMSNorm(kv_heads
            * C)`` for the keys, as OLMo 2 does) or ``"layer_across_heads"``. It bounds the
            scores' growth in training (QK-norm). For the dot and gatv2 scores.
            (default: ``None``)
        scale (float, optional): the score multiplier in place of :math:`1/\sqrt{C}` for the
            dot score (and of 1 for the others), as ``edge_attention``'s ``scale`` (Gemma's
            :math:`1/\sqrt{s}` for a ``query_pre_attn_scalar`` s). (default: ``None``)
        softcap (float, optional): :math:`c > 0`: each dot or gatv2 score before its bias
            becomes :math:`c \tanh(s / c)`, as ``edge_attention``'s ``softcap`` (Gemma 2's
            ``attn_logit_softcapping``, 50). Not with ``backend="dense"``. (default: ``None``)
        sinks (bool, optional): a learned logit :math:`\sigma_h` per head (``sinks``, 0 at
            first) joins each target's softmax as one more score whose value is 0, so that a
            target can give its edges less than all its weight:
            :math:`\alpha_{ij} = e^{s_{ij}} / (e^{\sigma_h} + \sum_{j'} e^{s_{ij'}})`
            (GPT-OSS's attention sinks), with any score. The returned weights are the
            graph's edges'. (default: ``False``)
        gate (str, optional): multiply each target's attention output by a sigmoid gate of
            its own features before the heads are merged, :math:`o_i \leftarrow o_i \odot
            \sigma(W^G x_i + b^G)`, learned in ``lin_gate``: ``"elementwise"``, a gate per
            channel of each head (``H * C`` outputs; gated attention, Qiu et al., 2025, as
            Qwen3-Next has it), or ``"headwise"``, one per head (``H`` outputs, as GaAN gates
            its heads, Zhang et al., 2018, here from the target's features alone). A target
            can then take little or nothing from its neighbours. Needs the targets' features.
            (default: ``None``)
        qk_norm_after_rotary (bool, optional): normalise the queries and keys (``qk_norm``)
            after ``rotary`` turns them instead of before, as HunYuan does. The same for a
            norm without gains (rotations keep norms); with gains, the gains then act on the
            rotated channels. (default: ``False``)
        v_norm (bool, optional): RMS-normalise each head's values without gains,
            :math:`v_j \leftarrow v_j / \sqrt{\operatorname{mean}(v_j^2) + \epsilon}` over
            its C channels (``v_norm``, a ``torch.nn.RMSNorm``, :math:`\epsilon = 10^{-6}`),
            as Gemma 4 does: each value then has norm :math:`\sqrt{C}`. (default: ``False``)
        score_channels (int, optional): channels per head :math:`C_{qk}` of the queries and
            keys of the dot and gatv2 scores (``lin_q`` and ``lin_k`` give :math:`H C_{qk}`
            and :math:`H_{kv} C_{qk}`), apart from the values' C: the scores cost
            :math:`E H C_{qk}` and the weighted sums :math:`E H C`, so narrow scoring heads
            make wide values cheaper (MiMo-V2's, DeepSeek-V3's heads score on other widths
            than they carry). The scale defaults to :math:`1/\sqrt{C_{qk}}`, ``rotary`` and
            ``qk_norm`` act on the :math:`C_{qk}` channels, and ``edge_mode="key"`` adds
            :math:`H C_{qk}` edge channels; ``share_value`` and ``edge_mode="key_value"``
            need :math:`C_{qk} = C`. (default: ``None``, :math:`C_{qk} = C`)
        out_norm (str, optional): normalise each node's merged output (the :math:`H C`
            channels with ``concat=True``, the C of the heads' mean without) before
            ``lin_out``, with learned gains ``o_norm``: ``"rms"`` (``torch.nn.RMSNorm``, as
            BitNet's ``attn_sub_norm`` does) or ``"layer"`` (``torch.nn.LayerNorm``, the
            sub-LayerNorm of Magneto), :math:`\epsilon = 10^{-6}`. It keeps the output
            projection's input at unit scale whatever the values' scale. (default: ``None``)
        differential (bool, optional): differential attention (the Differential
            Transformer's): each head has two score maps over the same edges and values,
            with queries and keys of their own (``lin_q`` gives :math:`2 H C_{qk}` channels,
            map 1's heads first, ``lin_k`` :math:`2 H_{kv} C_{qk}`), and attends with their
            difference, :math:`o_h = (1 - \lambda_{init})\, \mathrm{RMSNorm}\big(
            \sum_j (\alpha^1_{ij} - \lambda \alpha^2_{ij}) v_j\big)` with
            :math:`\lambda = e^{\lambda_{q1} \cdot \lambda_{k1}} - e^{\lambda_{q2}
            \cdot \lambda_{k2}} + \lambda_{init}` (learned vectors ``lambda_q1`` ...
            of :math:`C_{qk}` channels, :math:`\mathcal{N}(0, 0.1^2)` at first) and an
            RMS norm of each head's C channels with gains (``diff_norm``). ``score_channels``
            defaults to :math:`C / 2`; ``sinks`` are each map's own; the returned weights
            are :math:`\alpha^1 - \lambda \alpha^2`. The dot score, without attention
            dropout, and with edge features as a score bias only. (default: ``False``)
        lambda_init (float, optional): :math:`\lambda_{init}` of ``differential=True``
            (the Differential Transformer's :math:`0.8 - 0.6 e^{-0.3 l}` at layer l tends to
            it). (default: ``None``: 0.8)
        out_dropout (float, optional): dropout on the layer's output after ``lin_out``
            (before the residual), as Seed-OSS's ``residual_dropout`` and ModernBERT's
            ``out_drop`` drop their attention's. (default: ``0.0``)
        q_rank (int, optional): the queries through a normalised bottleneck of ``q_rank``
            channels, :math:`q_i = W^{Qb}\, \mathrm{RMSNorm}(W^{Qa} x_i)`: ``lin_q`` is a
            :class:`~graphattn.nn.LowRankLinear` (DeepSeek-V2's compressed queries). The dot
            score only. (default: ``None``)
        kv_rank (int, optional): multi-head latent attention (DeepSeek-V2's MLA): each
            source's keys and values come from one latent of ``kv_rank`` channels,
            :math:`c_j = \mathrm{RMSNorm}(W^{KVa} x_j)`, :math:`k_{j,h} = [W^{KR} x_j;
            W^{Kb}_h c_j]`, :math:`v_{j,h} = W^{Vb}_h c_j`. ``lin_k`` is a
            :class:`~graphattn.nn.LatentKeysValues`, which computes both, and ``lin_v`` a
            :class:`~graphattn.nn.LatentValues` that reads its parameters (they are in the
            ``state_dict`` once, under ``lin_k``). The dot score only, without
            ``share_weights`` or ``share_value``. (default: ``None``)
        shared_key_channels (int, optional): with ``kv_rank``, the first S of each key's
            :math:`C_{qk}` channels, :math:`W^{KR} x_j`, are one projection shared by every
            head; with ``rotary=RotaryPE(S)`` they are MLA's decoupled rotary key, the only
            channels that turn. (default: ``0``)
        indexer (LightningIndexer, optional): a learned sparse graph: the layer attends over
            each target's ``indexer.top_k`` edges (of those given, self-loops included)
            that the indexer scores highest (:class:`~graphattn.nn.LightningIndexer`,
            DeepSeek's sparse attention; :func:`graphattn.graphs.top_k_edges`), their edge
            features and ``attn_bias`` along; ``return_attention_weights=True`` returns the
            edges kept. The choice takes no gradient; :meth:`indexer_loss` trains the
            indexer. The indexer keeps the weights it comes with (a trained one stays
            trained); :meth:`reset_parameters` re-initialises it. (default: ``None``)
        query_temperature (graphattn.pe.QueryTemperature, optional): multiply each target's
            queries by :math:`t(p_i)` of its position (the forward's ``pos``), after their
            normalisation and rotation: Llama 4's and Mistral 4's sharper softmax far into a
            long context. The dot score only. (default: ``None``)

    Shapes:
        - **input:** x ``(|V|, F)`` or ``((|V_src|, F_src), (|V_dst|, F_dst))`` (or
          ``((|V_src|, F_src), None)`` for the additive score),
          edge_index ``(2, |E|)`` or adj_t ``(|V_dst|, |V_src|)`` sparse, edge_attr
          ``(|E|, D_e)`` (optional)
        - **output:** ``(|V_dst|, H * C)`` (concat) or ``(|V_dst|, C)``; with
          ``return_attention_weights=True`` also ``(edge_index (2, |E'|), alpha (|E'|, H))``,
          where E' includes the added self-loops (for a sparse input
          ``(adj (|V_dst|, |V_src|, H) sparse, alpha (|E'|, H))``). The weights are those
          before dropout, as ``TransformerConv`` returns them (``GATConv`` and ``GATv2Conv``
          return them after: in training with dropout, theirs are partly 0).

    The layer computes its messages in one fused operator, not through ``propagate``; PyG's
    ``Explainer`` still masks its edges (``edge_mask_type="object"``): with an explanation
    mask :math:`m` set, each weight :math:`\alpha_{ij}` is multiplied by :math:`m_{ij}` (its
    sigmoid, as PyG applies it), as ``MessagePassing.explain_message`` multiplies messages,
    and the self-loops the layer adds get 1. That call takes the reference backend, which
    differentiates the mask; the weights returned are those before the mask. Hooks registered
    with PyG's ``register_message_forward_hook`` (``AttentionExplainer`` uses one) are called
    with the message arguments ``alpha`` ``[E', H]`` and ``edge_index`` ``[2, E']`` (the edges
    attended over, self-loops included) and ``None`` for the messages, which the fused operator
    never builds; a hook that returns replacement messages is refused, and so are PyG's
    other message-passing hooks (``propagate``, ``aggregate``, ``edge_update`` and message
    pre-hooks), which the layer would never call. Explainers that change messages
    (``GraphMaskExplainer``) are refused for the same reason.
    """

    # from_pyg sets it on a layer converted from a GATConv without edge_dim, which drops
    # edge_attr as GATConv does (PyG's GAT model passes edge_attr to every layer)
    _ignores_edge_attr = False

    def __init__(self, in_channels: int | tuple[int, int], out_channels: int, heads: int = 1, *,
                 concat: bool = True, dropout: float = 0.0, bias: bool = True,
                 out_proj: bool = True, add_self_loops: bool = True, edge_dim: int | None = None,
                 attention: str = "dot", backend: str = "auto", value_dropout: float = 0.0,
                 negative_slope: float = 0.2, residual: bool = False,
                 share_weights: bool = False, fill_value: float | Tensor | str = "mean",
                 edge_mode: str = "bias", beta: bool = False, share_value: bool = False,
                 out_bias: bool = False, rotary: RotaryPE | None = None,
                 kv_heads: int | None = None, qk_norm: str | None = None,
                 scale: float | None = None, softcap: float | None = None,
                 sinks: bool = False, gate: str | None = None,
                 qk_norm_after_rotary: bool = False, v_norm: bool = False,
                 score_channels: int | None = None, out_norm: str | None = None,
                 differential: bool = False, lambda_init: float | None = None,
                 out_dropout: float = 0.0, q_rank: int | None = None,
                 kv_rank: int | None = None, shared_key_channels: int = 0,
                 indexer: LightningIndexer | None = None,
                 query_temperature: QueryTemperature | None = None) -> None:
        if attention not in SCORES:
            raise ValueError(f"attention must be one of {SCORES}, got {attention!r}")
        add_self_loops, share_weights, share_value, out_bias = (
            check_flag(value, name) for value, name in (
                (add_self_loops, "add_self_loops"), (share_weights, "share_weights"),
                (share_value, "share_value"), (out_bias, "out_bias")))
        if edge_mode not in EDGE_MODES:
            raise ValueError(f"edge_mode must be one of {EDGE_MODES}, got {edge_mode!r}")
        if edge_mode != "bias" and edge_dim is None:
            raise ValueError(f"edge_mode={edge_mode!r} says how edge features enter, and the "
                             f"layer has none: give edge_dim=<number of edge features>, or "
                             f"leave edge_mode at 'bias'")
        if edge_mode != "bias" and attention == "additive":
            raise ValueError(f"edge_mode={edge_mode!r} needs the dot or gatv2 score: the "
                             f"additive score has one number per head, and edge_mode='bias' "
                             f"already adds edge features inside its LeakyReLU, as GATConv "
                             f"does; got attention={attention!r}")
        if share_value and attention == "additive":
            raise ValueError("share_value=True needs the dot or gatv2 score, whose keys have the "
                             "values' channels; the additive score's keys are one number per "
                             "head; got attention='additive'")
        if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
            raise ValueError(f"backend must be 'auto' or one of {list(BACKENDS)}, "
                             f"got {backend!r}")
        if score_channels is not None and attention == "additive":
            raise ValueError(f"score_channels={score_channels!r} sets the channels of the "
                             f"queries and keys of the dot and gatv2 scores; the additive "
                             f"score's are one number per head")
        _check_differential(differential, dropout, share_value,
                            attention=attention, edge_mode=edge_mode)
        _check_latent_options(q_rank, kv_rank, attention=attention, share_value=share_value,
                              share_weights=share_weights)
        qk = _score_channels(score_channels, out_channels, differential)
        if qk != out_channels and (share_value or edge_mode == "key_value"):
            raise ValueError(f"{'share_value=True' if share_value else 'edge_mode=key_value'} "
                             f"makes one tensor serve the keys and the values, which need "
                             f"score_channels = out_channels, got score_channels={qk} and "
                             f"out_channels={out_channels}")
        super().__init__(in_channels, out_channels, heads, concat, dropout, bias, out_proj,
                         score_channels=1 if attention == "additive" else qk,
                         value_dropout=value_dropout, residual=residual, beta=beta,
                         kv_heads=kv_heads, qk_norm=qk_norm, scale=scale, gate=gate,
                         qk_norm_after_rotary=qk_norm_after_rotary, v_norm=v_norm,
                         out_norm=out_norm, differential=differential,
                         lambda_init=lambda_init, out_dropout=out_dropout, q_rank=q_rank,
                         kv_rank=kv_rank, shared_key_channels=shared_key_channels,
                         aggr="add", node_dim=0)
        if self.kv_heads != self.heads and attention == "additive":
            raise ValueError(f"kv_heads={self.kv_heads} (grouped keys and values) needs the dot "
                             f"or gatv2 score; the additive score's key term is one number per "
                             f"head; got attention='additive'")
        if edge_dim is not None:
            edge_dim = check_positive(edge_dim, "edge_dim")
        check_finite(negative_slope, "negative_slope")
        self.negative_slope = float(negative_slope)
        if (isinstance(fill_value, str) and fill_value not in FILL_REDUCTIONS) or not isinstance(
                fill_value, (str, numbers.Real, Tensor, np.ndarray, list, tuple)) or isinstance(
                fill_value, (bool, np.bool_)):
            raise ValueError(f"fill_value must be a number, a tensor or one of "
                             f"{list(FILL_REDUCTIONS)}, got {fill_value!r}")
        given = fill_value  # (for the messages)
        if isinstance(fill_value, (list, tuple)):
            try:
                fill_value = np.asarray(fill_value)
            except ValueError:  # ragged
                raise ValueError(f"fill_value as a list must hold numbers, got "
                                 f"{fill_value!r}") from None
        kind = (fill_value.dtype.kind if isinstance(fill_value, np.ndarray)
                else "f" if not isinstance(fill_value, Tensor) or fill_value.is_floating_point()
                else "b" if fill_value.dtype == torch.bool
                else "c" if fill_value.is_complex() else "i")
        if kind not in "iuf":  # bool, complex (whose imaginary part would be dropped), text
            raise ValueError(f"fill_value must hold real numbers, got {given!r}")
        # on the CPU, not the default device: under `with torch.device("meta")` a meta tensor
        # could not be checked (the fill moves to edge_attr's device when it is used)
        if isinstance(fill_value, numbers.Real) and not isinstance(fill_value, (int, float)):
            fill_value = float(fill_value)  # a numpy scalar, as a number its repr can rebuild
        if isinstance(fill_value, np.ndarray):
            fill_value = torch.tensor(fill_value.astype(np.float64),
                                      dtype=torch.get_default_dtype(), device="cpu")
        if not isinstance(fill_value, str) and not (
                isinstance(fill_value, Tensor) and fill_value.is_meta) and not torch.isfinite(
                torch.as_tensor(fill_value, dtype=torch.float64, device="cpu")).all():
            raise ValueError(f"fill_value must be finite, got {fill_value!r}")
        if (isinstance(fill_value, Tensor) and edge_dim is not None
                and fill_value.numel() not in (1, edge_dim)):
            raise ValueError(f"fill_value as a tensor (or list or array) must hold 1 or "
                             f"edge_dim = {edge_dim} "
                             f"values, got shape {list(fill_value.shape)}")
        self.fill_value = fill_value
        # under torch.compile, the key add_remaining_self_loops compares node ids XOR with: a
        # tensor of each layer's own, so that two layers' loop removals trace apart, and an
        # input of the graph (not a constant), so that every layer shares one compiled graph
        self.register_buffer("_trace_key", torch.zeros((), dtype=torch.long), persistent=False)
        self.share_weights = bool(share_weights)
        if share_weights:
            if isinstance(in_channels, (tuple, list)) and in_channels[0] != in_channels[1]:
                raise ValueError(f"share_weights=True needs the same features for sources and "
                                 f"targets, got in_channels={in_channels!r}")
            if self.kv_heads != self.heads:
                raise ValueError(f"share_weights=True makes the keys' projection the queries', "
                                 f"which has heads = {self.heads} heads, got kv_heads="
                                 f"{self.kv_heads}")
            self.lin_k = self.lin_q  # one module: its weights serve q_i and k_j
        self.share_value = bool(share_value)
        if share_value:
            self.lin_v = self.lin_k  # one module: its product serves k_j and v_j
        out_dim = self.heads * self.out_channels if concat else self.out_channels
        self.out_bias = torch.nn.Parameter(torch.empty(out_dim)) if out_bias else None
        self.add_self_loops = add_self_loops
        self.edge_dim = edge_dim
        self.edge_mode = edge_mode
        self.attention = attention
        self.backend = backend
        edge_out = self.heads if edge_mode == "bias" else self.heads * self.score_channels
        self.lin_edge = Linear(edge_dim, edge_out, bias=False) if edge_dim is not None else None
        # gatv2's attention vector a, one per head
        self.att = (torch.nn.Parameter(torch.empty(self.heads, self.score_channels))
                    if attention == "gatv2" else None)
        if rotary is not None and attention != "dot":
            raise ValueError(f"rotary needs the dot score, where rotated queries and keys "
                             f"score by their relative position; got attention={attention!r}")
        self.rotary = _check_rotary(rotary, self.score_channels)
        if query_temperature is not None and attention != "dot":
            raise ValueError(f"query_temperature scales the queries of the dot score, "
                             f"t(p_i) q_i . k_j; got attention={attention!r}")
        self.query_temperature = _check_query_temperature(query_temperature, self.rotary)
        if softcap is not None:
            softcap = check_softcap(softcap, attention, score_name="attention")
            if backend == "dense":
                raise ValueError(DENSE_REFUSES_SOFTCAP)
        self.softcap = softcap
        check_flag(sinks, "sinks")
        # one learned logit per head (per head of each map: differential), one more score of
        # every target's softmax whose value is 0 (GPT-OSS's attention sinks)
        self.sinks = (torch.nn.Parameter(torch.empty((2 if self.differential else 1)
                                                     * self.heads)) if sinks else None)
        self.reset_parameters()
        # after the reset: an indexer given keeps its weights (its constructor initialised a
        # fresh one); reset_parameters() re-initialises it with the layer's own
        self.indexer = self._check_indexer(indexer)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "indexer", None) is not None:
            self.indexer.reset_parameters()
        if self.out_bias is not None:
            torch.nn.init.zeros_(self.out_bias)
        if getattr(self, "sinks", None) is not None:
            torch.nn.init.zeros_(self.sinks)
        if self.lin_edge is not None:
            torch.nn.init.xavier_uniform_(self.lin_edge.weight)
        if self.att is not None:
            torch.nn.init.xavier_uniform_(self.att)

    def forward(self, x: Tensor | tuple[Tensor, Tensor | None], edge_index: Tensor,
                edge_attr: Tensor | None = None, return_attention_weights: bool = False,
                *, size: tuple[int | None, int | None] | None = None,
                attn_bias: Tensor | None = None,
                pos: Tensor | tuple[Tensor, Tensor] | None = None,
                ) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]]:
        """Attend along ``edge_index``; see the class docstring for shapes.

        ``size`` ``(N_src, N_dst)`` is ``GATConv``'s argument, taken so that models written
        for it run unchanged (by keyword: the fourth argument is ``return_attention_weights``,
        as in ``TransformerConv`` and ``GATv2Conv``). The features fix both counts; a ``size``
        that disagrees with them is refused, and ``None`` entries are not checked. With
        ``x = (x_src, None)`` its ``N_dst`` is the number of targets (see the class docstring).

        ``attn_bias`` ``[E, H]`` is a term added to each edge's score in each head, beside
        the edge features' (a floating tensor in the dtype of the inputs, fixed or learned):
        a relative positional bias of the edge's ends (:func:`graphattn.pe.alibi_bias`,
        :class:`graphattn.pe.DistanceBias` of :func:`graphattn.pe.hop_distance`), or -inf to
        keep a head off an edge, which gives each head a pattern of its own
        (:func:`~graphattn.graphs.head_patterns`). It needs ``add_self_loops=False``: put the
        self-loops wanted into the graph, with their bias.

        ``pos`` are the nodes' positions for ``rotary`` (:class:`graphattn.pe.RotaryPE`) and
        ``query_temperature``, ``[N]`` or ``[N, A]``, integer or real; ``(pos_src, pos_dst)``
        for a bipartite ``x``. The queries turn by the targets' positions and the keys by the
        sources', so that each score depends on :math:`p_i - p_j`. A layer with either needs
        them.
        """
        H, C = self.heads, self.out_channels
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError(f"x as a pair must be (x_src, x_dst), got {len(x)} entries")
            x_src, x_dst = x
            check_tensors(x_src=x_src)
            if x_dst is not None:  # None: GATConv's targets without features
                check_tensors(x_dst=x_dst)
        else:
            check_tensors(x=x)
            x_src = x_dst = x
        if size is not None:
            size = _check_size(size, x_src, x_dst)
        if x_dst is None:
            self._check_without_targets(size)
        if isinstance(return_attention_weights, (tuple, list)):  # GATConv's size, by position
            raise TypeError(f"return_attention_weights must be a bool, got "
                            f"{return_attention_weights!r}: pass GATConv's size by keyword, "
                            f"size={tuple(return_attention_weights)!r}")
        # None: PyG's default for "no weights"
        return_attention_weights = return_attention_weights is not None and check_flag(
            return_attention_weights, "return_attention_weights")
        self._infer_in_channels(x_src, x_dst)
        self._check_features(x_src, self.lin_k, "x" if x_src is x_dst else "x_src")
        if x_dst is not None:
            self._check_features(x_dst, self.lin_q, "x" if x_src is x_dst else "x_dst")
        check_same_device(x=x_src, x_dst=x_dst, edge_index=edge_index, edge_attr=edge_attr)
        N_src = x_src.size(0)
        sparse = isinstance(edge_index, Tensor) and edge_index.layout in SPARSE_LAYOUTS
        N_dst = (x_dst.size(0) if x_dst is not None
                 else _targets_without_features(N_src, edge_index, sparse, size,
                                                self.add_self_loops))
        adjacency = None  # the sparse adjacency edge_index came as, if it did
        if sparse:
            adjacency = edge_index
            if tuple(adjacency.shape[:2]) != (N_dst, N_src):
                raise ValueError(f"edge_index as a sparse adjacency must have shape "
                                 f"[N_dst, N_src] = [{N_dst}, {N_src}], "
                                 f"got {list(adjacency.shape)}")
            edge_index = from_sparse_adjacency(adjacency)  # (2, nnz)
        check_edge_index(edge_index, num_src=N_src, num_dst=N_dst)
        edge_attr = self._check_edge_attr(edge_attr, edge_index.size(1))
        self._check_attn_bias(attn_bias, edge_index.size(1), x_src)
        pos_src, pos_dst = self._rotary_positions(pos, x_src, x_dst)
        edge_weight = None  # (E',): PyG's explanation mask, when an Explainer set one
        if self.explain:
            edge_weight = self._explain_mask(edge_index, num_loops=min(N_src, N_dst))
        hooks = bool(self._message_forward_hooks)  # PyG's, e.g. AttentionExplainer's
        self._check_no_uncalled_hooks()
        old_loops = None  # (E',) bool: given self-loops left in place with a score of -inf
        if self.add_self_loops and self._masks_old_loops(return_attention_weights or hooks):
            edge_index, edge_attr, old_loops = _self_loops_masking_old_ones(
                edge_index, edge_attr, min(N_src, N_dst), fill_value=self.fill_value)
        elif self.add_self_loops:
            if capturing_cuda_graph():
                self._refuse_capture_dropping_loops(return_attention_weights or hooks)
            edge_index, edge_attr = add_remaining_self_loops(
                edge_index, edge_attr, min(N_src, N_dst), fill_value=self.fill_value,
                trace_key=self._trace_key if torch.compiler.is_compiling() else None,
                keep_if_looped=not (return_attention_weights or hooks or self.explain))

        if self.indexer is not None:  # each target's top_k edges by the indexer's score
            keep = self._indexed(x_src, x_dst, edge_index, pos_src, pos_dst, old_loops)
            edge_index = edge_index[:, keep]
            edge_attr = None if edge_attr is None else edge_attr[keep]
            attn_bias = None if attn_bias is None else attn_bias[keep]
            old_loops = None if old_loops is None else old_loops[keep]

        q, k, v = self._project(x_src, x_dst)
        if self.scale is not None:  # finite in the dtype of these inputs' scores, too
            score_factor(self.scale, "scale", q, k)
        score_channels = self.score_channels  # (1: additive)
        if q is None:  # x = (x_src, None): the additive score without its target term
            q = k.new_zeros(N_dst, H * score_channels)
        maps = 2 if self.differential else 1  # (differential: heads of map 1, then map 2)
        q = q.view(N_dst, maps * H, score_channels)  # (N_dst, H, C) or (N_dst, H, 1)
        k = k.view(N_src, maps * self.kv_heads, score_channels)  # (N_src, H_kv, C) or (.., 1)
        v = v.view(N_src, self.kv_heads, C)  # (N_src, H_kv, C): shared by H / H_kv heads
        if self.v_norm is not None:
            v = self.v_norm(v)
        if not self.qk_norm_after_rotary:
            q, k = self._normalize_qk(q, k)
        if self.rotary is not None:  # the dot score of R(p_i) q_i and R(p_j) k_j
            q, k = self.rotary.rotate_pair(q, k, pos_dst, pos_src)
        if self.qk_norm_after_rotary:  # (HunYuan's order)
            q, k = self._normalize_qk(q, k)
        if self.query_temperature is not None:  # t(p_i) q_i
            q = q * self.query_temperature(pos_dst).to(q.dtype)[:, None, None]
        if self.attention == "additive":
            q, k = q.squeeze(-1), k.squeeze(-1)  # (N, H)
        bias = edge_key = edge_value = None
        if self.lin_edge is not None and edge_attr is not None:
            if self.edge_mode == "bias":
                bias = self.lin_edge(edge_attr)  # (E, H)
            else:  # W^E e_ij enters the key k_j (and the value v_j) of each edge
                edge_key = self.lin_edge(edge_attr).view(-1, H, score_channels)  # (E, H, C)
                edge_value = edge_key if self.edge_mode == "key_value" else None
        if attn_bias is not None:  # (E, H): no self-loop was added (_check_attn_bias)
            bias = attn_bias if bias is None else bias + attn_bias
        if old_loops is not None:
            # exactly 0 weight, in every backend, for the loops add_remaining_self_loops drops
            mask = torch.zeros(old_loops.shape, dtype=v.dtype, device=v.device).masked_fill(
                old_loops, float("-inf")).unsqueeze(-1)  # (E', 1)
            bias = mask.expand(-1, H).contiguous() if bias is None else bias + mask  # (E', H)
        # edge_index was checked above and q, k, v are built to match it: skip the re-check.
        def attend(q: Tensor, k: Tensor, sinks: Tensor | None):
            return edge_attention_unchecked(q, k, v, edge_index, scale=self.scale, bias=bias,
                                            dropout_p=self.dropout, training=self.training,
                                            return_attention=return_attention_weights or hooks,
                                            backend=self.backend, score=self.attention,
                                            negative_slope=self.negative_slope, att=self.att,
                                            edge_key=edge_key, edge_value=edge_value,
                                            edge_weight=edge_weight, softcap=self.softcap,
                                            sinks=sinks)
        if self.differential:
            result = self._differential_maps(attend, q, k,
                                             weights=return_attention_weights or hooks)
        else:
            result = attend(q, k, self.sinks)
        if hooks:
            self._call_message_hooks(edge_index, result[1])
            result = result if return_attention_weights else result[0]
        if return_attention_weights:
            out, alpha = result
            if adjacency is not None:
                adj, alpha = _sparse_adjacency_and_values(edge_index, N_src, N_dst, alpha,
                                                          adjacency.layout)
                return self._merge_heads(out, x_dst), (adj, alpha)  # alpha in entries' order
            return self._merge_heads(out, x_dst), (edge_index, alpha)
        return self._merge_heads(result, x_dst)  # (N_dst, H*C) or (N_dst, C)

    def indexer_loss(self, x: Tensor | tuple[Tensor, Tensor], edge_index: Tensor,
                     alpha: Tensor, *, pos: Tensor | tuple[Tensor, Tensor] | None = None,
                     reduction: str = "mean") -> Tensor:
        """The training loss of the layer's ``indexer`` (:meth:`LightningIndexer.loss
        <graphattn.nn.LightningIndexer.loss>`) on the edges ``edge_index`` (or the sparse
        adjacency a call on one returned) and weights ``alpha`` ``[E, H]`` that a call with
        ``return_attention_weights=True`` returned, with
        the inputs ``x`` and ``pos`` of that call: the KL divergence from the attention's
        weights to the softmax of the indexer's scores, whose gradient reaches the indexer
        alone. On the chosen edges it is DeepSeek's sparse stage; with an indexer whose
        ``top_k`` reaches every target's in-degree (all edges kept), its dense warm-up.

        .. code-block:: python

            out, (edges, alpha) = layer(x, graph, pos=pos, return_attention_weights=True)
            loss = task_loss(out) + layer.indexer_loss(x, edges, alpha, pos=pos)
        """
        if self.indexer is None:
            raise ValueError("indexer_loss needs a layer with an indexer, got indexer=None")
        if self.differential:
            raise ValueError("indexer_loss needs attention weights that are a distribution "
                             "over each target's edges; a differential layer's are signed "
                             "(alpha_1 - lambda alpha_2): train its indexer against a "
                             "layer with differential=False")
        x_src, x_dst = x if isinstance(x, (tuple, list)) else (x, x)
        if x_dst is None:
            raise ValueError("x_dst is None, but the indexer weighs its heads by the targets' "
                             "features: give x = (x_src, x_dst)")
        if isinstance(edge_index, Tensor) and edge_index.layout in SPARSE_LAYOUTS:
            # the sparse adjacency a call on one returned, alpha in its entries' order
            edge_index = from_sparse_adjacency(edge_index)
        check_edge_index(edge_index, num_src=x_src.size(0), num_dst=x_dst.size(0))
        pos_src, pos_dst = self._rotary_positions(pos, x_src, x_dst)
        u = self.lin_q.latent(x_dst) if self.q_rank is not None else x_dst
        return self.indexer.loss(u, x_src, x_dst, edge_index, alpha, pos_src=pos_src,
                                 pos_dst=pos_dst, reduction=reduction)

    def _indexed(self, x_src: Tensor, x_dst: Tensor | None, edge_index: Tensor,
                 pos_src: Tensor | None, pos_dst: Tensor | None,
                 old_loops: Tensor | None) -> Tensor:
        """The positions in ``edge_index`` of each target's ``indexer.top_k`` edges of highest
        score (the given self-loops that ``old_loops`` flags rank last)."""
        if x_dst is None:
            raise ValueError("x_dst is None, but the indexer weighs its heads by the targets' "
                             "features: give x = (x_src, x_dst)")
        if self.explain:
            raise NotImplementedError("explain=True with an indexer: the explanation mask is "
                                      "one value per given edge, and the indexer keeps some")
        u = self.lin_q.latent(x_dst) if self.q_rank is not None else x_dst
        with torch.no_grad():
            scores = self.indexer(u, x_src, x_dst, edge_index, pos_src=pos_src,
                                  pos_dst=pos_dst)
        if old_loops is not None:
            scores = scores.masked_fill(old_loops, float("-inf"))
        return _top_k_positions(edge_index, scores, self.indexer.top_k)

    def _check_without_targets(self, size: tuple[int | None, int | None] | None) -> None:
        """Raise unless ``x = (x_src, None)`` has a meaning for this layer and ``size``, as
        for ``GATConv``: the additive score, without ``beta``, and with ``add_self_loops`` a
        ``size`` that gives both counts or none."""
        if self.attention != "additive":
            raise ValueError(
                f"x_dst is None: the targets' queries are computed from their features, so "
                f"x = (x_src, x_dst) needs both with attention={self.attention!r} (only the "
                f"additive score, GATConv's, has a target term to leave out; GATv2Conv and "
                f"TransformerConv refuse x_dst=None too). Targets that are the first N_dst "
                f"sources, as in a sampled mini-batch, have x_src[:N_dst]")
        if self.beta:
            raise ValueError("x_dst is None, but beta=True gates the residual W^R x_i of the "
                             "targets' features: give x = (x_src, x_dst)")
        if self.gate is not None:
            raise ValueError(f"x_dst is None, but gate={self.gate!r} gates each target's "
                             f"output by sigmoid(W^G x_i) of its features: give x = (x_src, "
                             f"x_dst)")
        if self.add_self_loops and size is not None and None in size:
            raise ValueError(f"x_dst is None with add_self_loops=True: the self-loops go on the "
                             f"first min(size) nodes, as in GATConv, so size must give both "
                             f"counts (N_src, N_dst), got size = {tuple(size)!r}")

    def _call_message_hooks(self, edge_index: Tensor, alpha: Tensor) -> None:
        """Call the hooks of PyG's ``register_message_forward_hook`` as ``propagate`` would,
        with the message arguments ``{"alpha": alpha [E', H], "edge_index": edge_index
        [2, E']}`` (the edges attended over, self-loops included) and ``None`` for the
        messages, which the fused operator never builds. A hook that returns replacement
        messages is refused."""
        kwargs = {"alpha": alpha, "edge_index": edge_index}
        for hook in self._message_forward_hooks.values():
            if hook(self, (kwargs,), None) is not None:
                raise RuntimeError(f"a message forward hook of {self.__class__.__name__} "
                                   f"returned replacement messages, but the layer computes its "
                                   f"messages inside the attention operator: hooks may read "
                                   f"the arguments (alpha, edge_index), not replace messages")

    def _check_no_uncalled_hooks(self) -> None:
        """Raise if PyG hooks are registered that the layer would never call: it runs no
        ``propagate``, ``aggregate`` or ``edge_update``, and builds no messages."""
        names = [name for name in _UNCALLED_HOOKS if getattr(self, name, None)]
        if names:
            raise RuntimeError(f"{self.__class__.__name__} has hooks it never calls "
                               f"({', '.join(names)}): the layer computes its messages inside "
                               f"one attention operator, without propagate, aggregate or "
                               f"edge_update; of PyG's message-passing hooks only "
                               f"register_message_forward_hook is called")

    def _masks_old_loops(self, returns_weights: bool) -> bool:
        """Whether this call keeps the edge count static by leaving the given self-loops in place
        with a score of -inf (:func:`_self_loops_masking_old_ones`) instead of dropping them.

        Only while ``torch.compile`` traces without data-dependent sizes (its default mode;
        ``fullgraph=True`` traces them from torch 2.10), where dropping them would cut the graph,
        and while a CUDA graph is captured, where counting them would read back to the host,
        which capture forbids. Not when the weights are returned or an explanation mask is set
        (both list the edges attended over), nor for the additive score with
        ``negative_slope=0`` or ``scale <= 0``, whose bias of -inf sits inside the LeakyReLU:
        it becomes 0 * -inf = NaN, or with a negative scale +inf, all of its row's weight.
        """
        if returns_weights or self.explain:
            return False
        if self.attention == "additive" and (self.negative_slope <= 0 or (
                self.scale is not None and self.scale <= 0)):
            return False
        if torch.compiler.is_compiling():
            return not _traces_dynamic_sizes()
        return capturing_cuda_graph()

    def _refuse_capture_dropping_loops(self, returns_weights: bool) -> None:
        """Refuse a call captured into a CUDA graph that has to drop the given self-loops (see
        :meth:`_masks_old_loops`): their count is read back to the host, which capture
        forbids."""
        why = ("return_attention_weights=True (or a message hook)" if returns_weights
               else "an explanation mask" if self.explain
               else f"attention='additive' and negative_slope={self.negative_slope}"
               if self.negative_slope <= 0
               else f"attention='additive' and scale={self.scale}")
        raise RuntimeError(f"{self.__class__.__name__} cannot be captured into a CUDA graph "
                           f"with add_self_loops=True and {why}: it then drops the given "
                           f"self-loops, whose count is read back to the host, which capture "
                           f"forbids. Give it a graph with one self-loop per node and "
                           f"add_self_loops=False")

    def _explain_mask(self, edge_index: Tensor, num_loops: int) -> Tensor:
        """The explanation mask that PyG's ``Explainer`` set (``_edge_mask``, one value per edge
        of ``edge_index``), through its sigmoid if asked, on the edges the layer attends over:
        without the self-loops it replaces, and 1 on those it adds (as in
        ``MessagePassing.explain_message``) ``[E']``."""
        mask = self._edge_mask
        if mask is None and "explain_message" in self.__dict__:  # GraphMaskExplainer's
            raise NotImplementedError(
                f"explain is True with an explain_message of its own on the "
                f"{self.__class__.__name__} (as GraphMaskExplainer sets), which would change "
                f"messages the layer never builds: it takes explainers that mask edges "
                f"(GNNExplainer, PGExplainer; AttentionExplainer reads its weights)")
        if mask is None:
            raise ValueError("explain is True but no edge mask is set: set one with "
                             "torch_geometric.explain.algorithm.utils.set_masks")
        if mask.dim() != 1 or mask.size(0) != edge_index.size(1):
            raise ValueError(f"the explanation edge mask must have one value per edge, shape "
                             f"[{edge_index.size(1)}], got {list(mask.shape)}")
        mask = mask.sigmoid() if self._apply_sigmoid else mask
        if not self.add_self_loops:
            return mask
        kept = mask[edge_index[0] != edge_index[1]]  # (E_kept,)
        return torch.cat([kept, kept.new_ones(num_loops)])  # (E_kept + num_loops,)

    def _rotary_positions(self, pos: Tensor | tuple[Tensor, Tensor] | None, x_src: Tensor,
                          x_dst: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
        """``(pos_src, pos_dst)`` for ``rotary`` and ``query_temperature`` from the forward's
        ``pos``; ``(None, None)`` without either, which then refuses ``pos``."""
        if self.rotary is None and self.query_temperature is None:
            if pos is not None:
                raise ValueError("pos was given but the layer has rotary=None: positions enter "
                                 "through a rotary embedding, rotary=graphattn.pe.RotaryPE(...)"
                                 " (or a query_temperature)")
            return None, None
        if pos is None:
            what = "a rotary embedding" if self.rotary is not None else "a query_temperature"
            raise ValueError(f"the layer has {what} and needs the nodes' positions: "
                             f"pass pos=[N] (or [N, A]; a pair (pos_src, pos_dst) for "
                             f"bipartite x), e.g. pos=torch.arange(N) for a sequence")
        if isinstance(pos, (tuple, list)):
            if len(pos) != 2:
                raise ValueError(f"pos as a pair must be (pos_src, pos_dst), got {len(pos)} "
                                 f"entries")
            pos_src, pos_dst = pos
        elif x_src is not x_dst:
            raise ValueError("x is a pair (x_src, x_dst): give pos as a pair (pos_src, pos_dst) "
                             "too, one position per source and per target")
        else:
            pos_src = pos_dst = pos
        for name, p, x in (("pos_src", pos_src, x_src), ("pos_dst", pos_dst, x_dst)):
            check_tensors(**{name: p})
            check_same_device(x=x, **{name: p})
            axes = 1 if self.rotary is None else self.rotary.axes
            if tuple(p.shape) not in ((x.size(0),), (x.size(0), axes)):
                shape = f"[{x.size(0)}]" if axes == 1 else f"[{x.size(0)}, {axes}]"
                raise ValueError(f"{'pos' if pos_src is pos_dst else name} must have shape "
                                 f"{shape} (a position per node, with axes={axes} "
                                 f"coordinates), got {list(p.shape)}")
        if self.rotary is None or self.rotary.axes == 1:  # [N, 1] -> [N]
            pos_src = pos_src.view(-1)
            pos_dst = pos_src if pos_dst is pos else pos_dst.view(-1)
        return pos_src, pos_dst

    def _check_attn_bias(self, attn_bias: Tensor | None, num_edges: int, x: Tensor) -> None:
        """Raise unless ``attn_bias`` is ``None`` or a floating ``[E, H]`` tensor in the dtype
        of ``x``, on a layer that adds no self-loops."""
        if attn_bias is None:
            return
        check_tensors(attn_bias=attn_bias)
        if self.add_self_loops:
            raise ValueError("attn_bias needs add_self_loops=False: the self-loops the layer "
                             "adds would have no bias; put the loops wanted into the graph "
                             "and their bias into attn_bias")
        if tuple(attn_bias.shape) != (num_edges, self.heads):
            raise ValueError(f"attn_bias must have shape [E, H] = [{num_edges}, {self.heads}], "
                             f"got {list(attn_bias.shape)}")
        check_bias_dtype(attn_bias, x)
        check_same_device(x=x, attn_bias=attn_bias)

    def _check_edge_attr(self, edge_attr: Tensor | None, num_edges: int) -> Tensor | None:
        if edge_attr is None or (self.lin_edge is None and self._ignores_edge_attr):
            return None
        if self.lin_edge is None:
            raise ValueError("edge_attr was given but the layer has edge_dim=None; "
                             "construct it with edge_dim=<number of edge features>")
        check_float_dtype(edge_attr=edge_attr)
        check_weight_dtype(edge_attr, self.lin_edge, "edge_attr")
        if edge_attr.dim() == 1 and self.edge_dim == 1:
            edge_attr = edge_attr.view(-1, 1)
        if edge_attr.dim() != 2 or tuple(edge_attr.shape) != (num_edges, self.edge_dim):
            raise ValueError(f"edge_attr must have shape [E, edge_dim] = "
                             f"[{num_edges}, {self.edge_dim}], got {list(edge_attr.shape)}")
        return edge_attr

    def __repr__(self) -> str:
        extra = "" if self.add_self_loops else ", add_self_loops=False"
        extra += "" if self.backend == "auto" else f", backend={self.backend!r}"
        extra += "" if self.attention == "dot" else f", attention={self.attention!r}"
        if self.negative_slope != 0.2:
            extra += f", negative_slope={self.negative_slope}"
        if self.share_weights:
            extra += ", share_weights=True"
        if self.share_value:
            extra += ", share_value=True"
        if self.out_bias is not None:
            extra += ", out_bias=True"
        if self.rotary is not None:
            extra += f", rotary={self.rotary!r}"
        if self.query_temperature is not None:
            extra += f", query_temperature={self.query_temperature!r}"
        if self.softcap is not None:
            extra += f", softcap={exact_repr(self.softcap)}"
        if self.sinks is not None:
            extra += ", sinks=True"
        if self.indexer is not None:
            extra += f", indexer={self.indexer.inline_repr()}"
        if self.edge_dim is not None:
            extra += f", edge_dim={self.edge_dim}"
            extra += "" if self.edge_mode == "bias" else f", edge_mode={self.edge_mode!r}"
            if not (isinstance(self.fill_value, str) and self.fill_value == "mean"):
                fill = self.fill_value
                fill = fill.tolist() if isinstance(fill, Tensor) else fill
                extra += f", fill_value={fill!r}"
        return f"{self.__class__.__name__}({self._repr_args()}{extra})"


def _check_size(size: tuple[int | None, int | None], x_src: Tensor,
                x_dst: Tensor | None) -> tuple[int | None, int | None]:
    """``size`` as a pair of Python ints (or ``None``); raise unless it is a pair ``(N_src,
    N_dst)`` of non-negative integers that agrees with the features' rows (``None`` for
    either count, or ``x_dst=None`` for ``N_dst``, leaves it unchecked)."""
    if not isinstance(size, (tuple, list)) or len(size) != 2:
        raise ValueError(f"size must be a pair (N_src, N_dst), got {size!r}")
    counts = tuple(None if given is None else as_integer(given) for given in size)
    for name, given, count in zip(("N_src", "N_dst"), size, counts, strict=True):
        if given is not None and (count is None or count < 0):
            raise ValueError(f"size must be a pair (N_src, N_dst) of non-negative integers or "
                             f"None, got {name} = {given!r}")
    for name, count, rows in (("N_src", counts[0], x_src.size(0)),
                              ("N_dst", counts[1], None if x_dst is None else x_dst.size(0))):
        if count is not None and rows is not None and count != rows:
            raise ValueError(f"size = {tuple(size)!r} gives {name} = {count}, but the features "
                             f"have {rows} rows")
    return counts


def _targets_without_features(N_src: int, edge_index: Tensor, sparse: bool,
                              size: tuple[int | None, int | None] | None,
                              add_self_loops: bool) -> int:
    """The number of targets ``N_dst`` of ``x = (x_src, None)``, counted as ``GATConv`` counts
    them: ``size[1]``; else the rows of a sparse adjacency ``[N_dst, N_src]``, or the columns
    of an ``EdgeIndex``'s sparse size (with ``add_self_loops`` at least ``N_src``: its
    self-loops reach every source); else ``N_src``. A ``size[1]`` that disagrees with the
    adjacency or the ``EdgeIndex`` is refused (``GATConv`` takes theirs)."""
    given = None if size is None else size[1]
    declared = edge_index.size(0) if sparse else getattr(edge_index, "num_cols", None)
    if declared is None:
        return N_src if given is None else int(given)
    if given is not None and int(given) != declared:
        what = "a sparse adjacency with" if sparse else "an EdgeIndex of"
        raise ValueError(f"size = {tuple(size)!r} gives N_dst = {given}, but edge_index is "
                         f"{what} {declared} targets")
    if not sparse and given is None and add_self_loops:
        return max(declared, N_src)
    return declared


# Dense features of self-attention at least this many times wider than lin_q, lin_k and lin_v's
# outputs together, and at least this wide, are projected by one product with the stacked
# weights. Timed on 2 cores (forward and backward of the projections, interleaved): from 256
# features and 3x the outputs on, the stacked product took 0.71-0.94 of the three products' time
# (Cora's and CiteSeer's 1433 and 3703 features among the cases); at 1.3-1.6x the outputs
# 0.96-1.7, and at 64 features (a second GAT layer) 1.03-1.56 on Cora and CiteSeer sizes.
DENSE_STACK_MIN_RATIO = 3
DENSE_STACK_MIN_FEATURES = 256

# PyG's message-passing hooks that GraphSelfAttention never calls (it calls the message forward
# hooks with the weights): registered, they would do nothing
_UNCALLED_HOOKS = ("_propagate_forward_pre_hooks", "_propagate_forward_hooks",
                   "_message_forward_pre_hooks", "_aggregate_forward_pre_hooks",
                   "_aggregate_forward_hooks", "_edge_update_forward_pre_hooks",
                   "_edge_update_forward_hooks")

# how edge features enter the attention (GraphSelfAttention's edge_mode)
EDGE_MODES = ("bias", "key", "key_value")

# qk_norm's normalisations of the queries and keys: over each head's channels with gains
# shared by the heads, or with each head's own gains (_per_head: Chameleon's), or over all
# heads' channels together (_across_heads: OLMo 2's, on the whole projection)
QK_NORMS = {"rms": torch.nn.RMSNorm, "layer": torch.nn.LayerNorm,
            "rms_per_head": torch.nn.RMSNorm, "layer_per_head": torch.nn.LayerNorm,
            "rms_across_heads": torch.nn.RMSNorm, "layer_across_heads": torch.nn.LayerNorm}
QK_NORMS_PER_HEAD = ("rms_per_head", "layer_per_head")
# out_norm's normalisations of the merged heads' output before lin_out
OUT_NORMS = {"rms": torch.nn.RMSNorm, "layer": torch.nn.LayerNorm}
QK_NORMS_ACROSS_HEADS = ("rms_across_heads", "layer_across_heads")


def _each_head_normalized(t: Tensor, norm: torch.nn.RMSNorm | torch.nn.LayerNorm) -> Tensor:
    """``t [..., H, c]`` normalised over each head's c channels, then times the gains (plus
    the biases) of ``norm``, a norm over ``(H, c)``: each head its own."""
    c = t.size(-1)
    if isinstance(norm, torch.nn.LayerNorm):
        return F.layer_norm(t, (c,), eps=norm.eps) * norm.weight + norm.bias
    return F.rms_norm(t, (c,), eps=norm.eps) * norm.weight


# gate's kinds: a sigmoid gate on each channel of each head's output, or one per head
GATES = ("elementwise", "headwise")

# fill_value names of PyG's self-loop attributes -> the reduction over a target's in-edges
FILL_REDUCTIONS = {"mean": "mean", "add": "sum", "max": "amax", "min": "amin", "mul": "prod"}


def add_remaining_self_loops(edge_index: Tensor, edge_attr: Tensor | None, num_nodes: int,
                             *, fill_value: float | Tensor | str = "mean",
                             trace_key: Tensor | None = None, keep_if_looped: bool = False,
                             ) -> tuple[Tensor, Tensor | None]:
    """Replace all self-loops by exactly one loop ``i -> i`` for each ``i < num_nodes``.

    The loops' ``edge_attr`` follows PyG's ``fill_value``: a reduction of the target's other
    incoming edge features (``"mean"``, ``"add"``, ``"max"``, ``"min"``, ``"mul"``; for a
    target without any, 1 for ``"mul"`` and 0 for the others), or a constant (a number, or a
    tensor of 1 or ``D_e`` values).

    On CUDA the new ``edge_index`` and the positions of the kept edges are kept while the
    given ``edge_index`` lives unmodified (see ``graphattn._tensor_cache``): a layer called on
    the same graph again finds the old loops without a host synchronisation, and hands the
    ``"triton"`` backend the same tensor, whose CSR orderings that backend keeps too.

    With ``keep_if_looped`` and no ``edge_attr``, a CPU ``edge_index`` (one the cache above
    does not keep) whose nodes have one self-loop each already comes back as it is, after one
    read (the same edges; the loops not
    moved last): a complete or causal graph from :mod:`graphattn.graphs` keeps the order in
    which the dense backend recognises it. Calls that return the attention weights leave it
    off, so that the edges come in PyG's order.

    ``trace_key`` (a 0-d integer tensor) changes nothing in the result. Under
    ``torch.compile`` each layer passes a buffer of its own: the node ids are compared XOR the
    key, so that two layers dropping the self-loops of one ``edge_index`` trace to two
    different computations. Merged into one, their data-dependent edge count breaks the
    inductor backend of torch 2.13 (``AssertionError: u1 not in {u0: ...}``). A buffer is an
    input of the compiled graph, so layers of one configuration share their compiled code (a
    key from each layer's ``id()`` compiled every layer anew, and a ninth one hit dynamo's
    recompile limit).
    """
    if torch.compiler.is_compiling():
        src, dst = edge_index  # (E,), (E,)
        if trace_key is not None:
            key = trace_key.to(src.dtype)
            src, dst = src ^ key, dst ^ key
        keep = src != dst  # (E,)
        edge_index = edge_index[:, keep]  # (2, E_kept)
        loops = torch.arange(num_nodes, device=edge_index.device, dtype=edge_index.dtype)
        new_index = torch.cat([edge_index, loops.expand(2, -1)], dim=1)  # (2, E_kept + N)
        if edge_attr is None:
            return new_index, None
        edge_attr, kept_dst = edge_attr[keep], edge_index[1]  # (E_kept, D_e), (E_kept,)
    else:
        if (keep_if_looped and edge_attr is None and host_readable(edge_index)
                and not cacheable(edge_index)):
            # a graph with one loop per node already is kept as it is (one pass, no copy);
            # where the graph is cached, the cached one serves (and keeps the CSR cached too)
            return cpu.one_loop_per_node(edge_index, num_nodes, keep_if_looped=True)[0], None
        # eagerly, by the kept edges' positions, found once per unmodified CUDA edge_index
        new_index, kept = _SELF_LOOPED.get(edge_index, num_nodes,
                                           lambda: _one_loop_per_node(edge_index, num_nodes))
        if edge_attr is None:
            return new_index, None
        edge_attr = edge_attr.index_select(0, kept)  # (E_kept, D_e)
        kept_dst = new_index[1, :kept.numel()]  # (E_kept,)
    return new_index, torch.cat([edge_attr, _loop_attr(edge_attr, kept_dst, num_nodes,
                                                       fill_value)], dim=0)


def _self_loops_masking_old_ones(edge_index: Tensor, edge_attr: Tensor | None, num_nodes: int,
                                 *, fill_value: float | Tensor | str = "mean",
                                 ) -> tuple[Tensor, Tensor | None, Tensor]:
    """:func:`add_remaining_self_loops` with an edge count known before the data: all the given
    edges, then ``i -> i`` for each ``i < num_nodes`` ``[2, E + num_nodes]``, their features,
    and which of them are the given self-loops ``[E + num_nodes]`` (bool), for the caller to
    score -inf. The attention over the result is the attention over
    :func:`add_remaining_self_loops`'s graph, with weight 0 on the flagged edges. The given
    loops enter no ``fill_value`` reduction."""
    src, dst = edge_index  # (E,), (E,)
    old = src == dst  # (E,)
    loops = torch.arange(num_nodes, device=edge_index.device, dtype=edge_index.dtype)
    new_index = torch.cat([edge_index, loops.expand(2, -1)], dim=1)  # (2, E + N)
    flagged = torch.cat([old, old.new_zeros(num_nodes)])  # (E + N,)
    if edge_attr is None:
        return new_index, None, flagged
    kept_dst = dst.masked_fill(old, num_nodes)  # (E,): _loop_attr's spare row for the old loops
    loop_attr = _loop_attr(edge_attr, kept_dst, num_nodes, fill_value)  # (N, D_e)
    return new_index, torch.cat([edge_attr, loop_attr], dim=0), flagged


@torch.compiler.assume_constant_result
def _traces_dynamic_sizes() -> bool:
    """Whether the running ``torch.compile`` trace takes operators whose output size depends on
    the data (``fullgraph=True`` from torch 2.10, or ``capture_dynamic_output_shape_ops``),
    read from its shape environment once per trace."""
    context = torch._guards.TracingContext.try_get()
    shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    return bool(getattr(shape_env, "allow_dynamic_output_shape_ops", False))


# The self-looped graphs of recently used edge_index tensors (graphattn._tensor_cache): on CUDA,
# finding the old loops to drop reads their count back to the host, once per unmodified graph.
_SELF_LOOPED: TensorCache[tuple[Tensor, Tensor]] = TensorCache(max_entries=8)


def _one_loop_per_node(edge_index: Tensor, num_nodes: int) -> tuple[Tensor, Tensor]:
    """The edges that are not self-loops, then ``i -> i`` for each ``i < num_nodes``
    ``[2, E_kept + num_nodes]``, and the positions of the kept edges in ``edge_index``
    ``[E_kept]``."""
    if host_readable(edge_index):  # one CPU kernel: 3-4x faster than the torch ops below
        return cpu.one_loop_per_node(edge_index, num_nodes)
    kept = (edge_index[0] != edge_index[1]).nonzero().squeeze(1)  # (E_kept,)
    loops = torch.arange(num_nodes, device=edge_index.device, dtype=edge_index.dtype)
    return torch.cat([edge_index.index_select(1, kept), loops.expand(2, -1)], dim=1), kept


def _loop_attr(edge_attr: Tensor, dst: Tensor, num_nodes: int,
               fill_value: float | Tensor | str) -> Tensor:
    """The self-loops' features ``[num_nodes, D_e]`` from the in-edges' ``edge_attr``."""
    D = edge_attr.size(1)
    if not isinstance(fill_value, str):
        fill = torch.as_tensor(fill_value, dtype=edge_attr.dtype, device=edge_attr.device)
        return fill.reshape(-1).expand(num_nodes, D)  # (N, D_e)
    # bipartite: loops only on the first num_nodes targets; the edges into the others go to a
    # spare row, dropped at the end (no data-dependent selection, so no host synchronisation)
    # int64: the backward of scatter_reduce gathers at the expanded index, which torch 2.13
    # reads wrongly on CPU when it is int32 (an int32 edge_index's gradients were wrong)
    row = dst.long().clamp(max=num_nodes)  # (E_kept,)
    if fill_value == "mean":
        total = edge_attr.new_zeros(num_nodes + 1, D).index_add_(0, row, edge_attr)
        count = torch.zeros(num_nodes + 1, dtype=torch.long, device=row.device).index_add_(
            0, row, torch.ones_like(row, dtype=torch.long)).clamp_min(1)
        return (total / count.unsqueeze(-1).to(total.dtype))[:num_nodes]  # (N, D_e)
    # where no edge comes in: 1 for the product (PyG's empty product), 0 otherwise
    empty = 1.0 if fill_value == "mul" else 0.0
    return edge_attr.new_full((num_nodes + 1, D), empty).scatter_reduce_(
        0, row.unsqueeze(-1).expand(-1, D), edge_attr, reduce=FILL_REDUCTIONS[fill_value],
        include_self=False)[:num_nodes]  # (N, D_e)


class DenseSelfAttention(_SelfAttentionBase):
    r"""Multi-head self-attention over all positions, with an optional boolean mask and
    score bias.

    .. math::
        \mathrm{out} = W^O \big\Vert_{h=1}^{H} \operatorname{softmax}\Big(
            \frac{Q_h K_h^\top}{\sqrt{C}} + B_h + \log \text{mask}\Big) V_h

    The dense twin of :class:`GraphSelfAttention`: the same parameter names and shapes, so a
    ``state_dict`` loads across the two, and with ``mask = graphs.to_dense_mask(edge_index, L)``
    both compute the same function over the same edges: ``GraphSelfAttention`` adds a
    self-loop per node by default, so build it with ``add_self_loops=False`` or set the
    mask's diagonal (with an ``indexer``, ``add_self_loops=False``: the loops the graph layer
    adds come after the given edges, and the indexer's ties go to the edge listed first,
    where this layer's go to the lower key position). A fully masked query row gets 0 before
    ``lin_out``. The score bias
    :math:`B` (``attn_bias``) is the dense form of ``GraphSelfAttention``'s ``attn_bias``:
    Graphormer's spatial encoding is ``attn_bias=spatial(hop_distance(edge_index,
    N)).movedim(-1, 0)`` with ``spatial = graphattn.pe.DistanceBias(H, D)``, ALiBi is
    :func:`graphattn.pe.alibi_bias`, and a pattern per head is 0 and -inf (a head's row
    without any key gets 0 in that head).

    Args:
        in_channels (int): input features F; ``-1`` infers them from the first call.
        out_channels (int): channels per head C.
        heads (int, optional): number of heads H. (default: ``1``)
        concat (bool, optional): concatenate (``True``) or average the heads.
            (default: ``True``)
        dropout (float, optional): dropout on the attention weights. (default: ``0.0``)
        value_dropout (float, optional): dropout on the projected values :math:`v_j`, once per
            node before they are weighted and summed (every target of j sees the same dropped
            :math:`v_j`), as the GAT reference code drops :math:`W x_j`: the bias of ``lin_v``
            is added after the dropout. (default: ``0.0``)
        bias (bool, optional): biases in the projections. (default: ``True``)
        out_proj (bool, optional): apply ``lin_out``. (default: ``True``)
        residual (bool, optional): add ``res(x)``, a ``Linear(F, out)`` of each position's own
            features (with a bias when ``bias``), to the output. (default: ``False``)
        beta (bool, optional): gate the residual as :class:`GraphSelfAttention` does.
            (default: ``False``)
        rotary (graphattn.pe.RotaryPE, optional): rotate queries and keys by their positions
            (the forward's ``pos``, by default ``0 .. L-1``), as :class:`GraphSelfAttention`
            does. (default: ``None``)
        kv_heads (int, optional): heads of the keys and values, shared by groups of query
            heads, as :class:`GraphSelfAttention`'s;
            :func:`~graphattn.functional.dense_attention` takes them as they are (on SDPA's
            fused path, no copy per query head). (default: ``None``: ``heads``)
        qk_norm (str, optional): ``"rms"`` or ``"layer"``: normalise each head's queries and
            keys over their channels (``_per_head``: with each head's own gains);
            ``"rms_across_heads"`` or ``"layer_across_heads"``: over all heads' channels
            together; as :class:`GraphSelfAttention`'s.
            (default: ``None``)
        scale (float, optional): the score multiplier in place of :math:`1/\sqrt{C}`.
            (default: ``None``)
        softcap (float, optional): :math:`c > 0`: each score before ``attn_bias`` and the mask
            becomes :math:`c \tanh(s / c)`, as :class:`GraphSelfAttention`'s; the weights are
            then explicit (SDPA takes no cap), and ``batch`` is refused. (default: ``None``)
        sinks (bool, optional): a learned logit per head (``sinks``, 0 at first), one more
            score of every row's softmax whose value is 0, as :class:`GraphSelfAttention`'s
            (GPT-OSS's attention sinks). (default: ``False``)
        gate (str, optional): ``"elementwise"`` or ``"headwise"``: a sigmoid gate of each
            position's output from its own features, as :class:`GraphSelfAttention`'s.
            (default: ``None``)
        qk_norm_after_rotary (bool, optional): ``qk_norm`` after ``rotary``, as
            :class:`GraphSelfAttention`'s. (default: ``False``)
        v_norm (bool, optional): RMS-normalise each head's values without gains, as
            :class:`GraphSelfAttention`'s. (default: ``False``)
        share_value (bool, optional): the values are the keys' projection, ``lin_v`` is
            ``lin_k``, as :class:`GraphSelfAttention`'s. (default: ``False``)
        score_channels (int, optional): channels per head of the queries and keys, apart
            from the values' ``out_channels``, as :class:`GraphSelfAttention`'s.
            (default: ``None``, the values')
        out_norm (str, optional): ``"rms"`` or ``"layer"``: normalise the merged heads' output
            before ``lin_out``, as :class:`GraphSelfAttention`'s. (default: ``None``)
        differential (bool, optional): differential attention, as
            :class:`GraphSelfAttention`'s (without attention dropout). (default: ``False``)
        lambda_init (float, optional): its :math:`\lambda_{init}`. (default: ``None``: 0.8)
        out_dropout (float, optional): dropout on the output after ``lin_out``, as
            :class:`GraphSelfAttention`'s. (default: ``0.0``)
        q_rank (int, optional): the queries through a normalised bottleneck, as
            :class:`GraphSelfAttention`'s. (default: ``None``)
        kv_rank (int, optional): keys and values from a latent (multi-head latent
            attention), as :class:`GraphSelfAttention`'s. (default: ``None``)
        shared_key_channels (int, optional): key channels shared by every head, with
            ``kv_rank``, as :class:`GraphSelfAttention`'s. (default: ``0``)
        indexer (LightningIndexer, optional): each query attends to the ``top_k`` keys of
            those the mask allows that the indexer scores highest (DeepSeek's sparse
            attention), the keys :class:`GraphSelfAttention`'s indexer keeps on the mask's
            graph; not with ``batch``. It keeps the weights it comes with, as in
            :class:`GraphSelfAttention`. (default: ``None``)
        query_temperature (graphattn.pe.QueryTemperature, optional): multiply each query by
            :math:`t(p)` of its position (the forward's ``pos``, by default ``0 .. L-1``),
            as :class:`GraphSelfAttention` does. (default: ``None``)

    Shapes:
        - **input:** x ``(L, F)`` or ``(B, L, F)``, mask bool ``(L, L)`` or ``(B, L, L)``,
          attn_bias ``(H, L, L)`` or ``(B, H, L, L)`` in the dtype of x (H may be 1),
          or mask ``(B, 1, L)`` to mask keys alone (``to_dense_batch``'s node mask, unsqueezed:
          see :func:`graphattn.graphs.batch_complete_graph`); or x ``(N, F)`` with batch
          ``(N)``, the graph of each node as in PyG's ``Batch``: global attention inside each
          graph, without padding to the largest (``dense_attention(..., batch=)``), output
          ``(N, H * C)``
        - **output:** ``(L, H * C)`` or ``(B, L, H * C)`` (``C`` when ``concat=False``); with
          ``return_attention_weights=True`` also the weights ``([B,] H, L, L)``, before
          dropout
    """

    def __init__(self, in_channels: int, out_channels: int, heads: int = 1, *,
                 concat: bool = True, dropout: float = 0.0, bias: bool = True,
                 out_proj: bool = True, value_dropout: float = 0.0,
                 residual: bool = False, beta: bool = False,
                 rotary: RotaryPE | None = None, kv_heads: int | None = None,
                 qk_norm: str | None = None, scale: float | None = None,
                 softcap: float | None = None, sinks: bool = False,
                 gate: str | None = None, qk_norm_after_rotary: bool = False,
                 v_norm: bool = False, share_value: bool = False,
                 score_channels: int | None = None, out_norm: str | None = None,
                 differential: bool = False, lambda_init: float | None = None,
                 out_dropout: float = 0.0, q_rank: int | None = None,
                 kv_rank: int | None = None, shared_key_channels: int = 0,
                 indexer: LightningIndexer | None = None,
                 query_temperature: QueryTemperature | None = None) -> None:
        if isinstance(in_channels, (tuple, list)):
            raise ValueError(f"in_channels must be one integer for DenseSelfAttention (queries, "
                             f"keys and values come from one x), got {in_channels!r}")
        _check_differential(differential, dropout, share_value)
        _check_latent_options(q_rank, kv_rank, share_value=share_value)
        qk = _score_channels(score_channels, out_channels, differential)
        if qk != out_channels and share_value:
            raise ValueError(f"share_value=True makes one tensor serve the keys and the values, "
                             f"which needs score_channels = out_channels, got "
                             f"score_channels={qk} and out_channels={out_channels}")
        super().__init__(in_channels, out_channels, heads, concat, dropout, bias, out_proj,
                         score_channels=qk, value_dropout=value_dropout,
                         residual=residual, beta=beta, kv_heads=kv_heads, qk_norm=qk_norm,
                         scale=scale, gate=gate, qk_norm_after_rotary=qk_norm_after_rotary,
                         v_norm=v_norm, out_norm=out_norm, differential=differential,
                         lambda_init=lambda_init, out_dropout=out_dropout, q_rank=q_rank,
                         kv_rank=kv_rank, shared_key_channels=shared_key_channels)
        self.share_value = check_flag(share_value, "share_value")
        if self.share_value:
            self.lin_v = self.lin_k  # one module: its product serves k_j and v_j
        self.rotary = _check_rotary(rotary, self.score_channels)
        self.query_temperature = _check_query_temperature(query_temperature, self.rotary)
        self.softcap = None if softcap is None else check_softcap(softcap, "dot")
        self.sinks = (torch.nn.Parameter(torch.empty((2 if self.differential else 1)
                                                     * self.heads))
                      if check_flag(sinks, "sinks") else None)
        self.reset_parameters()
        # after the reset: an indexer given keeps its weights (its constructor initialised a
        # fresh one); reset_parameters() re-initialises it with the layer's own
        self.indexer = self._check_indexer(indexer)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "sinks", None) is not None:
            torch.nn.init.zeros_(self.sinks)
        if getattr(self, "indexer", None) is not None:
            self.indexer.reset_parameters()

    def forward(self, x: Tensor, mask: Tensor | None = None, is_causal: bool = False,
                return_attention_weights: bool = False, *, batch: Tensor | None = None,
                attn_bias: Tensor | None = None,
                pos: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Attend over all positions allowed by ``mask`` (with ``batch``: over the nodes of
        each node's own graph), with ``attn_bias`` added to the scores; see the class
        docstring for shapes.

        ``pos`` are the positions for ``rotary`` (:class:`graphattn.pe.RotaryPE`) and
        ``query_temperature``, ``[L]`` or ``[B, L]`` (``[L, A]`` or ``[B, L, A]`` with A
        coordinates); without them a layer with either takes ``0 .. L-1``, except with
        ``batch``, where each node needs its own (``[N]`` or ``[N, A]``).
        """
        H, C = self.heads, self.out_channels
        return_attention_weights = return_attention_weights is not None and check_flag(
            return_attention_weights, "return_attention_weights")
        if not isinstance(x, Tensor) or x.dim() not in (2, 3):
            shape = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [L, F] or [B, L, F], got {shape}")
        if batch is not None:
            if x.dim() != 2:
                raise ValueError(f"with batch, x must have shape [N, F] (the nodes of every "
                                 f"graph, as in PyG's Batch), got {list(x.shape)}")
            if isinstance(batch, Tensor) and tuple(batch.shape) != (x.size(0),):
                raise ValueError(f"batch must have shape [N] = [{x.size(0)}], one graph id per "
                                 f"row of x {list(x.shape)}, got {list(batch.shape)}")
            if return_attention_weights:
                raise ValueError("return_attention_weights=True is not supported with batch "
                                 "(graphs of different sizes have weights of different shapes); "
                                 "use GraphSelfAttention on graphs.batch_complete_graph(batch)")
        check_float_dtype(x=x)
        self._infer_in_channels(x, x)
        if x.size(-1) != self.lin_q.in_features:
            raise ValueError(f"x must have F = in_channels = {self.lin_q.in_features} features, "
                             f"got {list(x.shape)}")
        check_weight_dtype(x, input_module(self.lin_q), "x")
        if isinstance(attn_bias, Tensor) and attn_bias.is_floating_point():
            check_bias_dtype(attn_bias, x)  # as GraphSelfAttention refuses it
        q, k, v = self._project(x, x)
        maps = 2 if self.differential else 1  # (differential: heads of map 1, then map 2)
        q = q.unflatten(-1, (maps * H, self.score_channels))  # (B, L, H, C_qk)
        k = k.unflatten(-1, (maps * self.kv_heads, self.score_channels))
        v = v.unflatten(-1, (self.kv_heads, C))  # (B, L, H_kv, C)
        if self.v_norm is not None:
            v = self.v_norm(v)
        if not self.qk_norm_after_rotary:
            q, k = self._normalize_qk(q, k)
        if self.rotary is not None or self.query_temperature is not None:
            if pos is None and batch is not None:
                raise ValueError("with batch, a layer with rotary or query_temperature needs "
                                 "pos=[N] (or [N, A]): the position of each node in its own "
                                 "graph")
            if pos is None:
                pos = torch.arange(x.size(-2), device=x.device)
            check_tensors(pos=pos)
            check_same_device(x=x, pos=pos)
        elif pos is not None:
            raise ValueError("pos was given but the layer has rotary=None: positions enter "
                             "through a rotary embedding, rotary=graphattn.pe.RotaryPE(...)"
                             " (or a query_temperature)")
        if self.rotary is not None:
            q, k = self.rotary.rotate_pair(q, k, pos, pos)
        if self.qk_norm_after_rotary:  # (HunYuan's order)
            q, k = self._normalize_qk(q, k)
        if self.query_temperature is not None:  # t(p_i) q_i
            p = (pos.squeeze(-1) if pos.dim() >= 2 and pos.size(-1) == 1
                 and pos.size(-2) == x.size(-2) else pos)  # ([L, 1] -> [L])
            if tuple(p.shape) not in (tuple(x.shape[:-1]), tuple(x.shape[-2:-1])):
                raise ValueError(f"query_temperature takes one position per row of x: pos "
                                 f"must have shape {list(x.shape[:-1])} (or [L]), got "
                                 f"{list(pos.shape)}")
            q = q * self.query_temperature(p).to(q.dtype)[..., None, None]
        if self.indexer is not None:  # each query's top_k keys by the indexer's score
            mask = self._indexed_mask(x, mask, is_causal, batch, pos)
            is_causal = False
        # (B, L, H_kv, C): dense_attention shares each kv head among its query heads
        def attend(q: Tensor, k: Tensor, sinks: Tensor | None):
            return dense_attention(q, k, v, mask, is_causal=is_causal, scale=self.scale,
                                   dropout_p=self.dropout, training=self.training,
                                   return_attention=return_attention_weights, batch=batch,
                                   attn_bias=attn_bias, softcap=self.softcap, sinks=sinks)
        if self.differential:
            result = self._differential_maps(attend, q, k, weights=return_attention_weights)
        else:
            result = attend(q, k, self.sinks)
        if return_attention_weights:
            out, weights = result
            return self._merge_heads(out, x), weights
        return self._merge_heads(result, x)

    def _indexed_mask(self, x: Tensor, mask: Tensor | None, is_causal: bool,
                      batch: Tensor | None, pos: Tensor | None) -> Tensor:
        """The mask of each query's ``indexer.top_k`` allowed keys of highest score (those
        ``mask`` and ``is_causal`` allow), ties to the first key: ``[..., L, L]`` bool."""
        if batch is not None:
            raise ValueError("an indexer with batch= is not supported: give the graphs one "
                             "by one, or GraphSelfAttention(indexer=) on "
                             "graphs.batch_complete_graph(batch)")
        L = x.size(-2)
        u = self.lin_q.latent(x) if self.q_rank is not None else x
        scores = self.indexer.dense_scores(u, x, pos)  # (..., L, L)
        allowed = torch.ones(L, L, dtype=torch.bool, device=x.device)
        if is_causal:
            allowed = allowed.tril()
        if mask is not None:
            allowed = allowed & mask
        return top_k_mask(scores, allowed.expand(scores.shape), self.indexer.top_k)

    def __repr__(self) -> str:
        extra = ", share_value=True" if self.share_value else ""
        extra += "" if self.rotary is None else f", rotary={self.rotary!r}"
        extra += ("" if self.query_temperature is None
                  else f", query_temperature={self.query_temperature!r}")
        extra += "" if self.softcap is None else f", softcap={exact_repr(self.softcap)}"
        extra += "" if self.sinks is None else ", sinks=True"
        if self.indexer is not None:
            extra += f", indexer={self.indexer.inline_repr()}"
        return f"{self.__class__.__name__}({self._repr_args()}{extra})"
