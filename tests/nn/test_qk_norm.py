"""QK-norm: the layers' ``qk_norm=`` normalises each head's queries and keys over their
channels (or all heads' channels together, ``_across_heads``) before scoring.

Checked against the formula written out here (RMS and layer normalisation of each head's
channels with the learned gains, then the reference operator), the graph layer on the
complete graph against the dense layer with the same weights, outputs and gradients on every
CPU backend, and the property that makes it useful: with RMS normalisation and no biases the
attention weights do not change when the inputs grow, where without it they saturate.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close

from graphattn import graphs, pe
from graphattn.functional import edge_attention
from graphattn.nn import DenseSelfAttention, GraphSelfAttention, GraphTransformer


def _normalised(t: torch.Tensor, gain: torch.Tensor, kind: str,
                offset: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``t`` ``[..., C]`` normalised over its channels and times ``gain`` (plus ``offset``
    for layer normalisation), written out."""
    if kind == "layer":
        centred = t - t.mean(-1, keepdim=True)
        return centred / (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt() * gain + offset
    return t / (t.pow(2).mean(-1, keepdim=True) + eps).sqrt() * gain


@pytest.mark.parametrize("kind", ["rms", "layer", "rms_per_head", "layer_per_head",
                                  "rms_across_heads", "layer_across_heads"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_qk_norm_is_the_normalised_dot_product(kind, kv_heads):
    # the layer's output is the reference operator on queries and keys normalised per head
    # over their 8 channels (or over the 4 * 8 and kv_heads * 8 channels of the projections,
    # _across_heads) with the learned gains (_per_head: each head's own, [4, 8] and
    # [kv_heads, 8]), keys before they are shared by two heads
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = GraphSelfAttention(12, 8, heads=4, add_self_loops=False, kv_heads=kv_heads,
                               qk_norm=kind).double()
    with torch.no_grad():
        for norm in (layer.q_norm, layer.k_norm):
            norm.weight.normal_(generator=gen)
            if kind.startswith("layer"):
                norm.bias.normal_(generator=gen)
    x = torch.randn(9, 12, dtype=torch.float64, generator=gen)
    edge_index = graphs.random_graph(9, 3, self_loops=True)
    q, k, v = layer.lin_q(x), layer.lin_k(x), layer.lin_v(x)  # (9, 4 * 8), (9, kv_heads * 8)
    norm_kind = kind.removesuffix("_across_heads").removesuffix("_per_head")
    if kind.endswith("_per_head"):
        assert layer.q_norm.weight.shape == (4, 8) and layer.k_norm.weight.shape == (kv_heads, 8)
    if kind.endswith("_across_heads"):  # the whole projection, then split into heads
        q = _normalised(q, layer.q_norm.weight, norm_kind, getattr(layer.q_norm, "bias", None))
        k = _normalised(k, layer.k_norm.weight, norm_kind, getattr(layer.k_norm, "bias", None))
    q, k, v = q.view(9, 4, 8), k.view(9, kv_heads, 8), v.view(9, kv_heads, 8)
    if not kind.endswith("_across_heads"):  # each head's 8 channels
        q = _normalised(q, layer.q_norm.weight, norm_kind, getattr(layer.q_norm, "bias", None))
        k = _normalised(k, layer.k_norm.weight, norm_kind, getattr(layer.k_norm, "bias", None))
    group = 4 // kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    want = layer.lin_out(edge_attention(q, k, v, edge_index, backend="reference").flatten(1))
    assert_close(layer(x, edge_index), want)


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense", "auto"])
@pytest.mark.parametrize("attention", ["dot", "gatv2"])
@pytest.mark.parametrize("qk_norm", ["rms", "rms_across_heads"])
def test_graph_layer_on_the_complete_graph_is_the_dense_layer(backend, attention, qk_norm):
    # one state_dict, both layers, with the rotation after the normalisation: outputs and
    # the gradients of the gains (gatv2: every CPU backend against the reference)
    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    rotary = pe.RotaryPE(8) if attention == "dot" else None
    graph = GraphSelfAttention(16, 8, heads=2, add_self_loops=False, backend=backend,
                               attention=attention, rotary=rotary, qk_norm=qk_norm).double()
    with torch.no_grad():
        graph.q_norm.weight.normal_(generator=gen)
        graph.k_norm.weight.normal_(generator=gen)
    L = 11
    x = torch.randn(L, 16, dtype=torch.float64, generator=gen)
    w = torch.randn(L, 16, dtype=torch.float64, generator=gen)
    if attention == "dot":
        twin = DenseSelfAttention(16, 8, heads=2, rotary=pe.RotaryPE(8),
                                  qk_norm=qk_norm).double()
        twin.load_state_dict(graph.state_dict())
        want = twin(x)
    else:
        twin = GraphSelfAttention(16, 8, heads=2, add_self_loops=False, backend="reference",
                                  attention="gatv2", qk_norm=qk_norm).double()
        twin.load_state_dict(graph.state_dict())
        want = twin(x, graphs.complete_graph(L))
    (want * w).sum().backward()
    got = graph(x, graphs.complete_graph(L), **({"pos": torch.arange(L)} if rotary else {}))
    (got * w).sum().backward()
    assert_close(got, want)
    for name in ("q_norm", "k_norm"):
        assert_close(getattr(graph, name).weight.grad, getattr(twin, name).weight.grad)


def test_rms_qk_norm_keeps_the_weights_as_the_inputs_grow():
    # RMS normalisation is blind to the scale of q and k: with projections without biases the
    # attention weights for x and for 1000 x are the same, where without qk_norm they saturate
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    x = torch.randn(10, 16, dtype=torch.float64, generator=gen)
    edge_index = graphs.random_graph(10, 4, self_loops=True)
    for qk_norm, same in (("rms", True), ("rms_across_heads", True), (None, False)):
        layer = GraphSelfAttention(16, 8, heads=2, bias=False, add_self_loops=False,
                                   qk_norm=qk_norm).double()
        _, (_, alpha) = layer(x, edge_index, return_attention_weights=True)
        _, (_, grown) = layer(1000 * x, edge_index, return_attention_weights=True)
        assert torch.allclose(alpha, grown, atol=1e-9) == same


def test_models_state_and_repr():
    layer = GraphSelfAttention(8, 4, heads=2, qk_norm="layer")
    assert isinstance(layer.q_norm, torch.nn.LayerNorm) and layer.q_norm.normalized_shape == (4,)
    assert {"q_norm.weight", "q_norm.bias", "k_norm.weight"} <= set(layer.state_dict())
    assert "qk_norm='layer'" in repr(layer)
    with torch.no_grad():
        layer.q_norm.weight.fill_(3.0)
    layer.reset_parameters()
    assert torch.equal(layer.q_norm.weight, torch.ones(4))
    assert GraphSelfAttention(8, 4).q_norm is None and "qk_norm" not in repr(
        GraphSelfAttention(8, 4))
    model = GraphTransformer(8, 16, 3, num_layers=2, heads=2, qk_norm="rms")
    assert all(isinstance(a.q_norm, torch.nn.RMSNorm) for a in model.attns)
    out = model(torch.randn(6, 8), graphs.complete_graph(6))
    assert out.shape == (6, 3) and torch.isfinite(out).all()
    dense = DenseSelfAttention(8, 4, heads=2, qk_norm="rms")
    assert "qk_norm='rms'" in repr(dense) and dense(torch.randn(2, 5, 8)).shape == (2, 5, 8)
    # across heads: one norm over each projection's width, the keys' narrower with kv_heads
    layer = GraphSelfAttention(8, 4, heads=4, kv_heads=2, qk_norm="layer_across_heads")
    assert layer.q_norm.normalized_shape == (16,) and layer.k_norm.normalized_shape == (8,)
    model = GraphTransformer(8, 16, 3, num_layers=2, heads=2, qk_norm="rms_across_heads")
    assert all(a.q_norm.normalized_shape == (16,) for a in model.attns)


@pytest.mark.parametrize("kwargs, match", [
    (dict(qk_norm="l2"), r"qk_norm must be None or one of \['rms', 'layer', 'rms_per_head', "
     r"'layer_per_head', 'rms_across_heads', 'layer_across_heads'\], got 'l2'"),
    (dict(qk_norm=True), "qk_norm must be None or one of"),
    (dict(qk_norm=["rms"]), r"qk_norm must be None or one of .*got \['rms'\]"),
    (dict(qk_norm="rms", attention="additive"), "needs the dot or gatv2 score"),
    (dict(qk_norm="rms_across_heads", attention="additive"), "needs the dot or gatv2 score"),
    (dict(qk_norm_after_rotary=True), "qk_norm_after_rotary=True places the normalisation "
     "of the queries and keys after their rotation, and needs a qk_norm; got qk_norm=None"),
])
def test_qk_norm_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GraphSelfAttention(8, 4, heads=2, **kwargs)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_qk_norm_after_rotary_normalises_the_rotated_queries_and_keys(dense):
    """With qk_norm_after_rotary=True the gains act on the rotated channels: the layer
    computes attention over RMS(R(p) q) and RMS(R(p) k), written out here; with gains of 1
    the order makes no difference (rotations keep norms)."""
    torch.manual_seed(3)
    rotary = pe.RotaryPE(8)
    kwargs = dict(heads=2, rotary=rotary, qk_norm="rms", qk_norm_after_rotary=True)
    layer = (DenseSelfAttention(16, 8, **kwargs) if dense
             else GraphSelfAttention(16, 8, add_self_loops=False, **kwargs))
    assert "qk_norm_after_rotary=True" in repr(layer)
    with torch.no_grad():
        layer.q_norm.weight.uniform_(0.5, 2.0)
        layer.k_norm.weight.uniform_(0.5, 2.0)
    x, pos = torch.randn(10, 16), torch.arange(10)
    out = layer(x, is_causal=True) if dense else layer(x, graphs.causal_graph(10), pos=pos)
    q, k = rotary.rotate_pair(layer.lin_q(x).view(10, 2, 8), layer.lin_k(x).view(10, 2, 8),
                              pos, pos)
    q, k = _normalised(q, layer.q_norm.weight, "rms"), _normalised(k, layer.k_norm.weight, "rms")
    o = edge_attention(q, k, layer.lin_v(x).view(10, 2, 8), graphs.causal_graph(10),
                       backend="reference")
    assert_close(out, layer.lin_out(o.flatten(1)))
    with torch.no_grad():
        layer.q_norm.weight.fill_(1.0)
        layer.k_norm.weight.fill_(1.0)
    before = layer(x, is_causal=True) if dense else layer(x, graphs.causal_graph(10), pos=pos)
    layer.qk_norm_after_rotary = False
    after = layer(x, is_causal=True) if dense else layer(x, graphs.causal_graph(10), pos=pos)
    assert_close(before, after)


# (share_value needs keys of C channels: not the additive score's, one per head)
@pytest.mark.parametrize("attention, share_value", [
    ("dot", False), ("additive", False), ("gatv2", False), ("dot", True), ("gatv2", True)])
def test_v_norm_normalises_each_head_s_values(attention, share_value):
    """v_norm=True: the attention's values are each head's RMS-normalised without gains (norm
    sqrt(C) each), written out here; with share_value (Gemma 4's layers whose values are the
    keys' projection), the keys' projection before any QK-norm or rotation."""
    torch.manual_seed(4)
    layer = GraphSelfAttention(16, 8, heads=4, kv_heads=1 if attention == "dot" else None,
                               attention=attention, add_self_loops=False, v_norm=True,
                               share_value=share_value)
    assert "v_norm=True" in repr(layer) and not list(layer.v_norm.parameters())
    x, edge_index = torch.randn(9, 16) * 3, torch.randint(0, 9, (2, 40))
    out, (_, alpha) = layer(x, edge_index, return_attention_weights=True)
    values = (layer.lin_k if share_value else layer.lin_v)(x).view(9, -1, 8)
    values = _normalised(values, torch.ones(8), "rms")
    assert_close(values.norm(dim=-1), torch.full(values.shape[:2], 8 ** 0.5), atol=1e-4,
                 rtol=1e-4)
    heads = 4 // values.size(1)
    weighted = torch.zeros(9, 4, 8).index_add_(
        0, edge_index[1], alpha.unsqueeze(-1) * values.repeat_interleave(heads, 1)[edge_index[0]])
    assert_close(out, layer.lin_out(weighted.flatten(1)))


@pytest.mark.parametrize("backend", ["cpu", "dense", "reference"])
def test_v_norm_graph_and_dense_layers_agree(backend):
    torch.manual_seed(5)
    graph = GraphSelfAttention(16, 8, heads=2, v_norm=True, qk_norm="rms", add_self_loops=False,
                               backend=backend)
    dense = DenseSelfAttention(16, 8, heads=2, v_norm=True, qk_norm="rms")
    dense.load_state_dict(graph.state_dict())
    assert repr(dense) == "DenseSelfAttention(16, 8, heads=2, qk_norm='rms', v_norm=True)"
    x = torch.randn(11, 16, requires_grad=True)
    out_g, out_d = graph(x, graphs.causal_graph(11)), dense(x, is_causal=True)
    assert_close(out_g, out_d)
    grad_g, = torch.autograd.grad(out_g.square().sum(), x)
    grad_d, = torch.autograd.grad(out_d.square().sum(), x)
    assert_close(grad_g, grad_d)
    with pytest.raises(TypeError, match="v_norm must be a bool"):
        GraphSelfAttention(16, 8, v_norm="rms")


@pytest.mark.parametrize("attention, edge_mode", [("dot", None), ("dot", "key"),
                                                  ("gatv2", None), ("gatv2", "key")])
@pytest.mark.parametrize("backend", ["cpu", "dense", "reference"])
def test_score_channels_apart_from_the_values(attention, edge_mode, backend):
    """score_channels=4 beside values of 8 channels per head: queries and keys of 4 channels
    (the edges' key terms too, and gatv2's attention vector), the dot score's scale 1/2,
    written out here with the reference operator; outputs and every gradient."""
    torch.manual_seed(6)
    edges = dict(edge_dim=3, edge_mode=edge_mode) if edge_mode else {}
    layer = GraphSelfAttention(16, 8, heads=4, kv_heads=2, score_channels=4, backend=backend,
                               attention=attention, add_self_loops=False, **edges)
    assert (layer.lin_q.out_features, layer.lin_k.out_features, layer.lin_v.out_features) == (
        16, 8, 16)
    assert "score_channels=4" in repr(layer)
    x, edge_index = torch.randn(9, 16), torch.randint(0, 9, (2, 40))
    edge_attr = torch.randn(40, 3) if edge_mode else None
    out = layer(x, edge_index, edge_attr)
    edge_key = layer.lin_edge(edge_attr).view(40, 4, 4) if edge_mode else None
    k, v = layer.lin_k(x).view(9, 2, 4), layer.lin_v(x).view(9, 2, 8)
    o = edge_attention(layer.lin_q(x).view(9, 4, 4), k.repeat_interleave(2, 1),
                       v.repeat_interleave(2, 1), edge_index,
                       scale=0.5 if attention == "dot" else 1.0, score=attention,
                       att=layer.att, edge_key=edge_key, backend="reference")
    assert_close(out, layer.lin_out(o.flatten(1)))
    grads = torch.autograd.grad(out.square().sum(), list(layer.parameters()))
    expected = torch.autograd.grad(layer.lin_out(o.flatten(1)).square().sum(),
                                   list(layer.parameters()), allow_unused=True)
    for grad, want in zip(grads, expected, strict=True):
        assert_close(grad, want)


@pytest.mark.parametrize("backend", ["cpu", "dense"])
def test_graph_transformer_passes_score_channels_and_v_norm_to_its_layers(backend):
    torch.manual_seed(8)
    model = GraphTransformer(8, 16, 3, num_layers=2, heads=2, score_channels=3, v_norm=True,
                             dropout=0.0, backend="reference").eval()
    assert all(a.score_channels == 3 and a.lin_q.out_features == 6 and a.v_norm is not None
               for a in model.attns)
    x, edge_index = torch.randn(7, 8), torch.randint(0, 7, (2, 20))
    reference = model(x, edge_index)
    for attention in model.attns:
        attention.backend = backend
    assert_close(model(x, edge_index), reference)


def test_graph_transformer_passes_qk_norm_after_rotary_to_its_layers():
    """Each block's attention normalises after the rotation: with gains away from 1 the
    model then computes what its layers compute with the flag set by hand, and not what
    they compute without it."""
    torch.manual_seed(9)
    model = GraphTransformer(8, 16, 3, num_layers=2, heads=2, rotary=pe.RotaryPE(8),
                             qk_norm="rms", qk_norm_after_rotary=True, dropout=0.0).eval()
    assert all(a.qk_norm_after_rotary for a in model.attns)
    with torch.no_grad():
        for attention in model.attns:
            attention.q_norm.weight.uniform_(0.5, 2.0)
            attention.k_norm.weight.uniform_(0.5, 2.0)
    x, edge_index, pos = torch.randn(7, 8), torch.randint(0, 7, (2, 20)), torch.arange(7)
    out = model(x, edge_index, pos=pos)
    for attention in model.attns:
        attention.qk_norm_after_rotary = False
    assert not torch.allclose(model(x, edge_index, pos=pos), out, atol=1e-4)
    for attention in model.attns:
        attention.qk_norm_after_rotary = True
    assert_close(model(x, edge_index, pos=pos), out)


def test_score_channels_graph_and_dense_layers_agree_and_errors():
    torch.manual_seed(7)
    kwargs = dict(heads=2, score_channels=4, rotary=pe.RotaryPE(4), qk_norm="rms")
    graph = GraphSelfAttention(16, 6, add_self_loops=False, **kwargs)
    dense = DenseSelfAttention(16, 6, **kwargs)
    dense.load_state_dict(graph.state_dict())
    x = torch.randn(10, 16)
    assert_close(graph(x, graphs.causal_graph(10), pos=torch.arange(10)),
                 dense(x, is_causal=True))
    for make, match in [
            (lambda: GraphSelfAttention(16, 8, attention="additive", score_channels=4),
             "score_channels=4 sets the channels of the queries and keys of the dot and gatv2"),
            (lambda: GraphSelfAttention(16, 8, score_channels=4, share_value=True),
             "share_value=True makes one tensor serve the keys and the values, which need"),
            (lambda: GraphSelfAttention(16, 8, score_channels=4, edge_dim=2,
                                        edge_mode="key_value"),
             "edge_mode=key_value makes one tensor serve"),
            (lambda: DenseSelfAttention(16, 8, score_channels=4, share_value=True),
             "share_value=True makes one tensor serve"),
            (lambda: GraphSelfAttention(16, 8, score_channels=4, rotary=pe.RotaryPE(8)),
             "rotary rotates dim=8 channels per head, more than the 4 channels each head's "
             "queries and keys have"),
            (lambda: GraphSelfAttention(16, 8, score_channels=0), "score_channels must be")]:
        with pytest.raises(ValueError, match=match):
            make()
