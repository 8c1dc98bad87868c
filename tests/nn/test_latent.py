"""Latent projections (``q_rank``, ``kv_rank``, ``shared_key_channels``: multi-head latent
attention, DeepSeek-V2's MLA).

The modules are checked against their formulas written out here from their parameters; the
layer against the attention written out from those parameters (the reference operator on
queries, keys and values built by hand), outputs and every gradient, on each CPU backend;
the graph layer against the dense layer; the ``state_dict`` (the latent's parameters once);
copies; sparse features; value dropout; and the refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_close, randomized

from graphattn import graphs
from graphattn.functional import edge_attention
from graphattn.nn import (
    DenseSelfAttention,
    GraphSelfAttention,
    LatentKeysValues,
    LatentValues,
    LowRankLinear,
)
from graphattn.pe import RotaryPE


def _rms(x: torch.Tensor, gains: torch.Tensor, eps: float) -> torch.Tensor:
    return gains * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_low_rank_linear_is_its_formula():
    lin = randomized(LowRankLinear(7, 3, 10, eps=1e-5).double(), 0)
    x = torch.randn(4, 5, 7, dtype=torch.float64)
    a = x @ lin.down.weight.T + lin.down.bias
    assert_close(lin(x), _rms(a, lin.norm.weight, 1e-5) @ lin.up.weight.T)
    assert lin.up.bias is None and lin.bias is None and lin.out_features == 10
    assert repr(lin) == ("LowRankLinear(\n  7 -> 3 -> 10\n  (down): Linear(in_features=7, "
                         "out_features=3, bias=True)\n  (norm): RMSNorm((3,), eps=1e-05, "
                         "elementwise_affine=True)\n  (up): Linear(in_features=3, "
                         "out_features=10, bias=False)\n)")


@pytest.mark.parametrize("shared", [0, 2])
def test_latent_keys_values_are_their_formula(shared):
    H, C_k, C_v, r = 3, 5, 4, 6
    kv = randomized(LatentKeysValues(7, r, H, C_k, C_v, shared).double(), 1)
    x = torch.randn(9, 7, dtype=torch.float64)
    a = x @ kv.down.weight.T + kv.down.bias  # (N, r + S): [latent; shared]
    c = _rms(a[:, :r], kv.norm.weight, 1e-6)
    up = kv.up.weight.view(H, C_k - shared + C_v, r)  # each head's [key; value] rows
    keys, values = [], []
    for h in range(H):
        own = c @ up[h, :C_k - shared].T
        keys.append(torch.cat([a[:, r:], own], dim=1))  # the shared channels first
        values.append(c @ up[h, C_k - shared:].T)
    k, v = kv.keys_values(x)
    assert_close(k, torch.cat(keys, dim=1))
    assert_close(v, torch.cat(values, dim=1))
    assert_close(kv(x), k)
    assert_close(LatentValues(kv)(x), v)


def _written_out(layer: GraphSelfAttention, x: torch.Tensor, edge_index: torch.Tensor,
                 pos: torch.Tensor) -> torch.Tensor:
    """The layer's output from its parameters: queries through the low-rank bottleneck, keys
    and values from the latent, each written out; rotated; the reference operator; lin_out."""
    H, c, C, S = layer.heads, layer.score_channels, layer.out_channels, \
        layer.shared_key_channels
    q_mod, kv = layer.lin_q, layer.lin_k
    q = _rms(x @ q_mod.down.weight.T + q_mod.down.bias, q_mod.norm.weight,
             q_mod.norm.eps) @ q_mod.up.weight.T
    a = x @ kv.down.weight.T + kv.down.bias
    latent = _rms(a[:, :kv.rank], kv.norm.weight, kv.norm.eps)
    kv_rows = (latent @ kv.up.weight.T).view(-1, H, c - S + C)
    k = torch.cat([a[:, None, kv.rank:].expand(-1, H, S), kv_rows[..., :c - S]], dim=-1)
    v = kv_rows[..., c - S:]
    q, k = layer.rotary.rotate_pair(q.view(-1, H, c), k, pos, pos)
    out = edge_attention(q, k, v, edge_index, backend="reference")
    return layer.lin_out(out.flatten(1))


@pytest.mark.parametrize("backend", ["reference", "cpu", "auto"])
def test_graph_layer_with_latent_projections_is_the_attention_written_out(backend):
    torch.manual_seed(0)
    layer = GraphSelfAttention(12, 6, heads=3, q_rank=5, kv_rank=4, shared_key_channels=2,
                               score_channels=8, rotary=RotaryPE(2), add_self_loops=False,
                               backend=backend).double()
    randomized(layer, 2)
    L = 11
    x = torch.randn(L, 12, dtype=torch.float64)
    graph, pos = graphs.window_graph(L, 3, causal=True), torch.arange(L)
    grads = []
    for run in (lambda x: layer(x, graph, pos=pos), lambda x: _written_out(layer, x, graph, pos)):
        layer.zero_grad()
        x_in = x.clone().requires_grad_(True)
        out = run(x_in)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append((out.detach(), x_in.grad, [p.grad.clone() for p in layer.parameters()]))
    (got, got_x, got_params), (want, want_x, want_params) = grads
    assert_close(got, want)
    assert_close(got_x, want_x)
    assert len(got_params) == 10  # q: down (2), norm, up; kv: down (2), norm, up; lin_out (2)
    for ours, theirs in zip(got_params, want_params, strict=True):
        assert_close(ours, theirs)


def test_latent_parameters_are_in_the_state_dict_once_and_load_into_the_dense_layer():
    options = dict(heads=2, q_rank=5, kv_rank=3, shared_key_channels=2, score_channels=6,
                   rotary=RotaryPE(2))
    graph_layer = randomized(GraphSelfAttention(8, 4, add_self_loops=False, **options)
                             .double(), 3)
    keys = list(graph_layer.state_dict())
    assert keys == ["lin_q.down.weight", "lin_q.down.bias", "lin_q.norm.weight",
                    "lin_q.up.weight", "lin_k.down.weight", "lin_k.down.bias",
                    "lin_k.norm.weight", "lin_k.up.weight", "lin_out.weight", "lin_out.bias"]
    assert isinstance(graph_layer.lin_v, LatentValues) and graph_layer.lin_v.source is \
        graph_layer.lin_k
    assert len(list(graph_layer.parameters())) == len(keys)
    dense_layer = DenseSelfAttention(8, 4, **options).double()
    dense_layer.load_state_dict(graph_layer.state_dict())
    x = torch.randn(7, 8, dtype=torch.float64)
    assert_close(dense_layer(x, is_causal=True), graph_layer(x, graphs.causal_graph(7),
                                                              pos=torch.arange(7)))
    assert "q_rank=5, kv_rank=3, shared_key_channels=2" in repr(graph_layer)
    assert "q_rank=5, kv_rank=3, shared_key_channels=2" in repr(dense_layer)


def test_a_copy_reads_its_own_latent():
    # lin_v reads lin_k's parameters without registering them: a deep copy's lin_v reads
    # the copy's lin_k, so that changing the copy leaves the original as it was
    layer = GraphSelfAttention(8, 4, heads=2, kv_rank=3, add_self_loops=False).double()
    twin = copy.deepcopy(layer)
    assert twin.lin_v.source is twin.lin_k and twin.lin_k is not layer.lin_k
    x, graph = torch.randn(5, 8, dtype=torch.float64), graphs.complete_graph(5)
    before = layer(x, graph)
    assert_close(twin(x, graph), before)
    with torch.no_grad():
        twin.lin_k.up.weight.mul_(2.0)
    assert (twin(x, graph) - before).abs().max() > 1e-3
    assert_close(layer(x, graph), before)
    layer.reset_parameters()  # (each latent product Glorot-initialised again)
    assert (layer(x, graph) - before).abs().max() > 1e-3


def test_sparse_features_project_as_dense_ones():
    torch.manual_seed(4)
    layer = randomized(GraphSelfAttention(9, 4, heads=2, q_rank=4, kv_rank=3,
                                          shared_key_channels=1, score_channels=5)
                       .double(), 4)
    x = torch.randn(6, 9, dtype=torch.float64) * (torch.rand(6, 9) < 0.4)
    graph = graphs.random_graph(6, 2, generator=torch.Generator().manual_seed(0))
    assert_close(layer(x.to_sparse_csr(), graph), layer(x, graph))


def test_value_dropout_drops_the_latent_values():
    # value_dropout drops whole entries of the values (here each head's v_j from the latent,
    # which has no bias): with p close to 1 and one source per target, each output head is
    # either that value scaled by 1 / (1 - p) or 0
    layer = GraphSelfAttention(8, 4, heads=2, kv_rank=3, value_dropout=0.5, out_proj=False,
                               add_self_loops=False).double()
    x = torch.randn(20, 8, dtype=torch.float64)
    loops = torch.arange(20).expand(2, -1)
    want = layer.lin_v(x).view(20, 2, 4)
    torch.manual_seed(0)
    got = layer(x, loops).view(20, 2, 4)
    dropped = got == 0
    assert 0.3 < dropped.double().mean() < 0.7
    assert_close(got[~dropped], (want * 2)[~dropped])
    assert_close(layer.eval()(x, loops).view(20, 2, 4), want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_rank=3, differential=True), "kv_rank \\(latent projections\\) and "
                                         "differential=True do not combine"),
    (dict(q_rank=3, attention="additive"), "q_rank \\(latent projections\\) needs the dot "
                                           "score, got attention='additive'"),
    (dict(kv_rank=3, attention="gatv2"), "kv_rank .* needs the dot score"),
    (dict(kv_rank=3, share_value=True), "kv_rank .* and share_value=True do not combine"),
    (dict(q_rank=3, share_weights=True), "q_rank .* and share_weights=True do not combine"),
    (dict(shared_key_channels=2), "shared_key_channels=2 shares key channels among the heads "
                                  "of latent keys and needs kv_rank"),
    (dict(kv_rank=3, shared_key_channels=4), "shared_key_channels must be below the keys' "
                                             "score_channels = 4"),
    (dict(kv_rank=0), "kv_rank must be a positive integer, got 0"),
    (dict(q_rank=2.5), "q_rank must be a positive integer, got 2.5"),
    (dict(kv_rank=3, shared_key_channels=-1), "shared_key_channels must be a non-negative"),
])
def test_latent_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GraphSelfAttention(8, 4, heads=2, **kwargs)


def test_latent_modules_called_on_their_own_check_their_input():
    """The modules are public: wrong features are refused by name (a bare "mat1 and mat2
    shapes cannot be multiplied" before)."""
    for module in (LowRankLinear(6, 2, 3), LatentKeysValues(6, 2, 2, 3, 4)):
        with pytest.raises(ValueError, match=r"x must have F = in_features = 6 features in its "
                                             r"last dimension, got \[4, 5\]"):
            module(torch.randn(4, 5))
        with pytest.raises(TypeError, match=r"x must have a floating-point dtype, got "
                                            r"torch.int64"):
            module(torch.ones(4, 6, dtype=torch.long))
        with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
            module([[0.0] * 6])


def test_latent_projections_need_the_input_width():
    with pytest.raises(ValueError, match="kv_rank .* needs the input features' count, got "
                                         "in_channels=-1"):
        GraphSelfAttention(-1, 4, kv_rank=3)
    with pytest.raises(ValueError, match="q_rank .* and share_value=True"):
        DenseSelfAttention(8, 4, q_rank=3, share_value=True)
    with pytest.raises(TypeError, match="source must be a LatentKeysValues, got Linear"):
        LatentValues(torch.nn.Linear(2, 2))


def test_graph_transformer_gives_every_block_latent_projections():
    # q_rank, kv_rank and shared_key_channels reach every attention layer, with RoPE on the
    # shared key channels; the model trains (every latent parameter gets a gradient)
    from graphattn.nn import GraphTransformer

    model = GraphTransformer(8, 16, 3, num_layers=2, heads=2, q_rank=6, kv_rank=5,
                             shared_key_channels=2, rotary=RotaryPE(2), dropout=0.0,
                             add_self_loops=False)
    assert all((a.q_rank, a.kv_rank, a.shared_key_channels) == (6, 5, 2) for a in model.attns)
    assert all(isinstance(a.lin_k, LatentKeysValues) for a in model.attns)
    L = 9
    out = model(torch.randn(L, 8), graphs.causal_graph(L), pos=torch.arange(L))
    out.square().sum().backward()
    assert all(p.grad is not None for a in model.attns for p in a.lin_k.parameters())
