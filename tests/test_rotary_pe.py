"""Rotary position embeddings (RoPE): ``pe.apply_rotary``, ``pe.RotaryPE`` and the layers'
``rotary=`` / ``pos=``.

On the causal graph with positions ``0 .. L-1`` the graph layer with a rotary embedding is
Hugging Face's ``LlamaAttention`` (its rotary embedding module and its causal mask), on every
backend, outputs and gradients; the interleaved rotation is GPT-J's and RoFormer's. The
properties that make it a relative encoding are checked on their own: scores unchanged when
every position moves by the same amount (along each axis, for 2-D positions), norms kept, and
the 2-D embedding made of one-axis embeddings of each coordinate. The graph layer on the
complete and grid graphs equals the dense layer with the same rotation.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from conftest import assert_close, assert_close_to_scale, dense_mask

from graphattn import graphs, pe
from graphattn.nn import DenseSelfAttention, GraphSelfAttention


def transformers_module(name: str):
    """A module of Hugging Face transformers, or a skip naming why there is none."""
    return pytest.importorskip(
        f"transformers.models.{name}",
        reason="the RoPE comparisons need Hugging Face transformers (the test extra has it)")


def llama_pair(heads: int, channels: int, base: float, kv_heads: int | None = None):
    """Hugging Face's LlamaAttention and rotary embedding, and GraphSelfAttention with its
    weights and ``RotaryPE(C, base=base)`` (LLaMA's projections have no biases), with
    ``kv_heads`` key and value heads (grouped-query attention)."""
    kv_heads = heads if kv_heads is None else kv_heads
    llama = transformers_module("llama.modeling_llama")
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=heads * channels, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, rope_theta=base, attention_bias=False,
                         attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = llama.LlamaAttention(config, layer_idx=0)
    rotary = llama.LlamaRotaryEmbedding(config)
    layer = GraphSelfAttention(heads * channels, channels, heads, bias=False,
                               add_self_loops=False, rotary=pe.RotaryPE(channels, base=base),
                               kv_heads=kv_heads)
    with torch.no_grad():
        layer.lin_q.weight.copy_(attention.q_proj.weight)
        layer.lin_k.weight.copy_(attention.k_proj.weight)
        layer.lin_v.weight.copy_(attention.v_proj.weight)
        layer.lin_out.weight.copy_(attention.o_proj.weight)
    return attention, rotary, layer


def run_llama(attention, rotary, x: torch.Tensor, position_ids: torch.Tensor,
              w: torch.Tensor, mask: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """LlamaAttention's output on ``x`` ``[B, L, D]`` with ``mask`` (an additive
    ``[1, 1, L, L]``; by default the causal mask), and the gradient of ``(out * w).sum()``
    with respect to ``x`` (the rotary embedding of the attention's kind of layer where the
    model has several, as Gemma 3)."""
    L = x.size(1)
    x = x.clone().requires_grad_(True)
    if mask is None:
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]  # (1, 1, L, L)
    layer_type = getattr(attention, "layer_type", None) or getattr(attention, "attention_type",
                                                                   None)  # (OLMo 3's)
    if layer_type is None and getattr(attention.config, "layer_types", None):  # (Mellum's)
        layer_type = attention.config.layer_types[attention.layer_idx]
    rope = getattr(attention.config, "rope_parameters", None) or {}  # (Kimi Linear: none)
    per_kind = isinstance(rope.get(layer_type), dict)
    kinds = {"layer_type": layer_type} if per_kind else {}
    # (an attention without a rotation, Kimi Linear's latent one, takes no cosines and sines)
    cos_sin = {} if rotary is None else {"position_embeddings": rotary(x, position_ids, **kinds)}
    if "position_ids" in inspect.signature(attention.forward).parameters:  # (Mistral 4's)
        cos_sin["position_ids"] = position_ids
    out = attention(x, attention_mask=mask, **cos_sin)[0]
    (out * w).sum().backward()
    return out.detach(), x.grad


def check_llama(backend: str, heads: int, channels: int, length: int, base: float,
                seed: int, kv_heads: int | None = None) -> None:
    """The graph layer on the causal graph with positions 0 .. L-1 against LlamaAttention:
    outputs, the input's gradient and the projections' weight gradients."""
    attention, rotary, layer = llama_pair(heads, channels, base=base, kv_heads=kv_heads)
    layer.backend = backend
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, length, heads * channels, generator=gen)
    w = torch.randn(1, length, heads * channels, generator=gen)
    want, want_grad = run_llama(attention, rotary, x, torch.arange(length)[None], w)

    x_graph = x[0].clone().requires_grad_(True)
    out = layer(x_graph, graphs.causal_graph(length), pos=torch.arange(length))
    (out * w[0]).sum().backward()
    assert_close(out.detach(), want[0])
    assert_close(x_graph.grad, want_grad[0])
    for name in ("q", "k", "v"):
        assert_close(getattr(layer, f"lin_{name}").weight.grad,
                     getattr(attention, f"{name}_proj").weight.grad)


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense", "auto"])
def test_causal_graph_with_rotary_is_llama_attention(backend):
    # LLaMA's self-attention is the causal graph with RoPE at positions 0 .. L-1; a base away
    # from the default checks that the frequencies follow it
    check_llama(backend, heads=4, channels=8, length=40, base=500.0, seed=1)


def test_triton_backend_with_rotary_is_llama_attention(triton_interpreter):
    check_llama("triton", heads=2, channels=8, length=24, base=10000.0, seed=2)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["grouped", "multi-query"])
@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_grouped_query_attention_is_llamas(backend, kv_heads):
    # LLaMA 2 and 3 share each key and value head among a group of query heads
    check_llama(backend, heads=4, channels=8, length=30, base=10000.0, seed=3,
                kv_heads=kv_heads)


def test_dense_layer_with_grouped_heads_is_the_graph_layer():
    # the same parameters load across the two, and compute the same on the complete graph
    torch.manual_seed(0)
    graph = GraphSelfAttention(12, 4, 6, kv_heads=3, add_self_loops=False,
                               rotary=pe.RotaryPE(4)).double()
    dense = DenseSelfAttention(12, 4, 6, kv_heads=3, rotary=pe.RotaryPE(4)).double()
    dense.load_state_dict(graph.state_dict())
    assert graph.lin_k.weight.shape == graph.lin_v.weight.shape == (12, 12)
    x = torch.randn(10, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(15))
    assert_close(dense(x), graph(x, graphs.complete_graph(10), pos=torch.arange(10)))
    assert repr(dense) == "DenseSelfAttention(12, 4, heads=6, kv_heads=3, rotary=RotaryPE(4))"


def test_dense_layer_with_rotary_is_llama_attention():
    # a batch of sequences, each with its own positions (LLaMA's position_ids); without pos
    # the dense layer takes 0 .. L-1
    H, C, L = 2, 8, 20
    attention, rotary, layer = llama_pair(H, C, base=10000.0)
    dense = DenseSelfAttention(H * C, C, H, bias=False, rotary=pe.RotaryPE(C))
    dense.load_state_dict(layer.state_dict())
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, L, H * C, generator=gen)
    w = torch.randn(3, L, H * C, generator=gen)
    position_ids = torch.arange(L) + torch.tensor([[0], [5], [100]])  # (3, L)
    want, want_grad = run_llama(attention, rotary, x, position_ids, w)
    x_dense = x.clone().requires_grad_(True)
    out = dense(x_dense, is_causal=True, pos=position_ids)
    (out * w).sum().backward()
    assert_close(out.detach(), want)
    assert_close(x_dense.grad, want_grad)
    default, _ = run_llama(attention, rotary, x, torch.arange(L)[None].expand(3, -1), w)
    assert_close(dense(x, is_causal=True).detach(), default)


@pytest.mark.parametrize("rotary_dim", [16, 8], ids=["all-channels", "partial"])
def test_interleaved_rotary_is_gptjs(rotary_dim):
    # GPT-J rotates channel pairs (2m, 2m+1) of the first rotary_dim channels of each head
    gptj = transformers_module("gptj.modeling_gptj")
    B, L, H, C = 2, 12, 3, 16
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(B, L, H, C, generator=gen)
    position_ids = torch.arange(L) + torch.tensor([[0], [7]])  # (B, L)
    sincos = gptj.create_sinusoidal_positions(200, rotary_dim)[position_ids]  # (B, L, dim)
    sin, cos = sincos.split(rotary_dim // 2, dim=-1)
    want = torch.cat([gptj.apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos),
                      x[..., rotary_dim:]], dim=-1)
    got = pe.apply_rotary(x, position_ids, dim=rotary_dim, interleaved=True)
    assert_close(got, want)
    module = pe.RotaryPE(rotary_dim, interleaved=True)
    assert_close(module(x, position_ids), want)


def test_interleaved_rotary_is_roformers():
    roformer = transformers_module("roformer.modeling_roformer")
    L, H, C = 15, 2, 8
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 1, H, L, C, generator=gen)  # RoFormer's [B, H, L, C]
    table = roformer.RoFormerSinusoidalPositionalEmbedding(64, C)
    with torch.no_grad():  # RoFormer's model init fills the table, a bare module has none
        table.weight.copy_(table.create_weight())
    sinusoidal_pos = table(torch.Size([1, L]))[None, None]  # (1, 1, L, C): sin | cos
    want_q, want_k = roformer.RoFormerSelfAttention.apply_rotary_position_embeddings(
        sinusoidal_pos, q, k)
    rope = pe.RotaryPE(C, interleaved=True)
    got_q, got_k = rope.rotate_pair(q.transpose(1, 2), k.transpose(1, 2),
                                    torch.arange(L), torch.arange(L))
    assert_close(got_q.transpose(1, 2), want_q)
    assert_close(got_k.transpose(1, 2), want_k)


def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[N, H, C]`` queries and keys -> ``[H, N, N]`` dot products of every pair."""
    return torch.einsum("ihc,jhc->hij", q, k)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("axes, dim", [(1, 16), (1, 6), (2, 16), (3, 12)])
def test_rotated_scores_depend_on_position_differences(axes, dim, interleaved):
    N, H, C = 10, 2, 16
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(2, N, H, C, generator=gen, dtype=torch.float64)
    shape = (N,) if axes == 1 else (N, axes)
    pos = torch.randn(shape, generator=gen, dtype=torch.float64) * 20  # real positions
    rope = pe.RotaryPE(dim, axes=axes, interleaved=interleaved)
    base = scores(rope(q, pos), rope(k, pos))
    # every position moved by the same offset (another along each axis): the same scores
    shift = torch.tensor([3.5, -11.0, 40.0][:axes], dtype=torch.float64)
    moved = pos + (shift if axes > 1 else shift[0])
    assert_close(scores(rope(q, moved), rope(k, moved)), base)
    # positions moved apart change them (the rotation does something)
    spread = pos * 1.5
    assert not torch.allclose(scores(rope(q, spread), rope(k, spread)), base, atol=1e-3)
    # each rotated plane keeps its length, and the channels after dim are left as they are
    rotated = rope(q, pos)
    assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    assert torch.equal(rotated[..., dim:], q[..., dim:])
    # position 0 is the identity
    assert_close(rope(q, torch.zeros(shape, dtype=torch.float64)), q)


@pytest.mark.parametrize("interleaved", [False, True])
def test_axial_rotary_is_a_one_axis_rotary_per_coordinate(interleaved):
    # axes=2: the first half of the rotated channels turn with the row, the second with the
    # column, each as the one-axis embedding of dim / 2 channels
    N, H, C, dim = 12, 2, 20, 16
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(N, H, C, generator=gen, dtype=torch.float64)
    pos = pe.grid_positions(3, 4)  # (12, 2)
    got = pe.apply_rotary(x, pos, dim=dim, axes=2, interleaved=interleaved)
    rows = pe.apply_rotary(x[..., :8], pos[:, 0], interleaved=interleaved)
    columns = pe.apply_rotary(x[..., 8:16], pos[:, 1], interleaved=interleaved)
    assert_close(got, torch.cat([rows, columns, x[..., 16:]], dim=-1))


def test_rotation_pairs_channels_as_documented():
    # one plane by hand: channels (0, C/2) for rotate-half, (0, 1) interleaved, at angle p
    x = torch.zeros(1, 1, 4, dtype=torch.float64)
    x[..., 0] = 1.0
    angle = torch.tensor([0.7], dtype=torch.float64)
    half = pe.apply_rotary(x, angle)
    assert_close(half[0, 0], torch.stack([angle.cos()[0], angle.new_zeros(()),
                                          angle.sin()[0], angle.new_zeros(())]))
    inter = pe.apply_rotary(x, angle, interleaved=True)
    assert_close(inter[0, 0], torch.stack([angle.cos()[0], angle.sin()[0],
                                           angle.new_zeros(()), angle.new_zeros(())]))
    # the second plane turns base^(-2/4) = 1/100 as fast
    x = torch.zeros(1, 1, 4, dtype=torch.float64)
    x[..., 1] = 1.0
    assert_close(pe.apply_rotary(x, angle)[0, 0, 3], (angle / 100).sin()[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_in_half_precision(dtype):
    x = torch.randn(50, 2, 8, generator=torch.Generator().manual_seed(8))
    pos = torch.arange(50) * 37
    x = x.to(dtype)
    got = pe.apply_rotary(x, pos)
    assert got.dtype == dtype
    # the angles in float32, their cosines and sines rounded to the dtype (as Hugging Face
    # does): a few units in the last place of |x| < 4
    eps = torch.finfo(dtype).eps
    assert_close(got, pe.apply_rotary(x.double(), pos), dtype=dtype, atol=8 * eps, rtol=4 * eps)


@pytest.mark.parametrize("backend", ["reference", "cpu", "auto"])
@pytest.mark.parametrize("pattern", ["complete", "grid"])
def test_graph_layer_with_rotary_equals_the_dense_layer(pattern, backend):
    # the same rotation on the edge route and the dense route with the graph's mask: outputs
    # and the gradients of the input and every weight
    if pattern == "complete":
        n, edges, rope = 11, graphs.complete_graph(11), pe.RotaryPE(6, base=100.0)
        pos = torch.randn(11, generator=torch.Generator().manual_seed(9)) * 5
    else:
        n, edges, rope = 20, graphs.grid_graph(4, 5, radius=1), pe.RotaryPE(8, axes=2)
        pos = pe.grid_positions(4, 5)
    torch.manual_seed(0)
    layer = GraphSelfAttention(12, 8, 2, add_self_loops=False, backend=backend, rotary=rope)
    dense = DenseSelfAttention(12, 8, 2, rotary=rope)
    dense.load_state_dict(layer.state_dict())
    x = torch.randn(n, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    layer, dense = layer.double(), dense.double()
    w = torch.randn(n, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    x_graph, x_dense = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = layer(x_graph, edges, pos=pos)
    (out * w).sum().backward()
    want = dense(x_dense, dense_mask(edges, n, n), pos=pos)
    (want * w).sum().backward()
    assert_close(out, want)
    assert_close(x_graph.grad, x_dense.grad)
    for (name, p), q in zip(layer.named_parameters(), dense.parameters(), strict=True):
        assert_close(p.grad, q.grad), name


def test_rotary_on_a_bipartite_graph_turns_targets_and_sources_by_their_own_positions():
    # sources at positions 0..5 and targets at 10..13: the queries take the targets'
    gen = torch.Generator().manual_seed(12)
    x_src, x_dst = torch.randn(6, 8, generator=gen), torch.randn(4, 8, generator=gen)
    edges = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 2], [0, 0, 1, 1, 2, 2, 3, 3]])
    pos_src, pos_dst = torch.arange(6), torch.arange(10, 14)
    torch.manual_seed(0)
    layer = GraphSelfAttention(8, 4, 2, add_self_loops=False, rotary=pe.RotaryPE(4))
    out, (_, alpha) = layer((x_src, x_dst), edges, pos=(pos_src, pos_dst),
                            return_attention_weights=True)
    # the same function as self-attention over the ten nodes together, read at the targets
    self_layer = GraphSelfAttention(8, 4, 2, add_self_loops=False, rotary=pe.RotaryPE(4))
    self_layer.load_state_dict(layer.state_dict())
    joint = torch.stack([edges[0], edges[1] + 6])
    out_joint, (_, alpha_joint) = self_layer(torch.cat([x_src, x_dst]), joint,
                                             pos=torch.cat([pos_src, pos_dst]),
                                             return_attention_weights=True)
    assert_close(out, out_joint[6:])
    assert_close(alpha, alpha_joint)
    # and not the function of other target positions
    other = layer((x_src, x_dst), edges, pos=(pos_src, pos_dst - 7))
    assert not torch.allclose(other, out, atol=1e-4)


def test_rotary_with_edge_keys_and_self_loops_on_the_fused_backend():
    # the edge term enters the rotated keys, the added self-loops are rotated as any edge: the
    # cpu kernels agree with the reference path
    torch.manual_seed(0)
    layer = GraphSelfAttention(8, 6, 2, edge_dim=3, edge_mode="key_value",
                               rotary=pe.RotaryPE(4), backend="reference").double()
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(9, 8, generator=gen, dtype=torch.float64)
    edges = graphs.random_graph(9, 3, generator=gen)
    edge_attr = torch.randn(edges.size(1), 3, generator=gen, dtype=torch.float64)
    pos = torch.randint(0, 100, (9,), generator=gen)
    results = []
    for backend in ("reference", "cpu"):
        layer.zero_grad()
        layer.backend = backend
        x_in = x.clone().requires_grad_(True)
        out, (_, alpha) = layer(x_in, edges, edge_attr, pos=pos, return_attention_weights=True)
        out.square().sum().backward()
        results.append((out, alpha, x_in.grad, layer.lin_edge.weight.grad.clone()))
    for got, want in zip(*results, strict=True):
        assert_close(got, want)


def test_rotary_layer_compiles_in_one_graph():
    torch.manual_seed(0)
    layer = GraphSelfAttention(8, 8, 2, add_self_loops=False, rotary=pe.RotaryPE(8, axes=2),
                               backend="cpu")
    x, edges, pos = torch.randn(12, 8), graphs.grid_graph(3, 4), pe.grid_positions(3, 4)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    assert_close(compiled(x, edges, pos=pos), layer(x, edges, pos=pos))


def test_rotary_repr_and_state_dict():
    rope = pe.RotaryPE(8, axes=2, base=100.0, interleaved=True)
    assert repr(rope) == "RotaryPE(8, axes=2, base=100.0, interleaved=True)"
    layer = GraphSelfAttention(8, 8, 2, rotary=pe.RotaryPE(8))
    assert repr(layer) == "GraphSelfAttention(8, 8, heads=2, rotary=RotaryPE(8))"
    assert repr(DenseSelfAttention(8, 8, rotary=rope)).endswith(f"rotary={rope!r})")
    # no parameters or buffers: the state_dict is the one without rotary
    assert layer.state_dict().keys() == GraphSelfAttention(8, 8, 2).state_dict().keys()


@pytest.mark.parametrize("call, error, match", [
    (lambda: pe.RotaryPE(6, axes=2), ValueError, "multiple of 2 \\* axes = 4"),
    (lambda: pe.RotaryPE(0), ValueError, "dim"),
    (lambda: pe.RotaryPE(8, base=-1.0), ValueError, "base"),
    (lambda: pe.apply_rotary(torch.randn(4, 2, 6), torch.arange(4), dim=8), ValueError,
     "at most the channels per head C = 6"),
    (lambda: pe.apply_rotary(torch.randn(4, 2, 6), torch.arange(5)), ValueError,
     "N = 4 rows"),
    (lambda: pe.apply_rotary(torch.randn(2, 4, 2, 6), torch.zeros(3, 4)), ValueError,
     "broadcast"),
    (lambda: pe.apply_rotary(torch.randn(4, 2, 8), torch.zeros(4, 3), axes=2), ValueError,
     "A = axes = 2"),
    (lambda: pe.apply_rotary(torch.randn(4, 2, 6), torch.ones(4, dtype=torch.bool)), TypeError,
     "integer or real"),
    (lambda: pe.apply_rotary(torch.randn(4, 6), torch.arange(4)), ValueError, "N, H, C"),
    (lambda: GraphSelfAttention(8, 4, rotary=pe.RotaryPE(8)), ValueError,
     "dim=8 channels per head, more than the 4 channels each head.s queries and keys have"),
    (lambda: GraphSelfAttention(8, 4, attention="additive", rotary=pe.RotaryPE(4)), ValueError,
     "rotary needs the dot score"),
    (lambda: GraphSelfAttention(8, 4, rotary="rope"), TypeError, "RotaryPE or None"),
    (lambda: GraphSelfAttention(8, 4, rotary=pe.RotaryPE(4))(
        torch.randn(3, 8), graphs.chain_graph(3)), ValueError, "needs the nodes' positions"),
    (lambda: GraphSelfAttention(8, 4)(torch.randn(3, 8), graphs.chain_graph(3),
                                      pos=torch.arange(3)), ValueError, "rotary=None"),
    (lambda: GraphSelfAttention(8, 4, rotary=pe.RotaryPE(4))(
        torch.randn(3, 8), graphs.chain_graph(3), pos=torch.arange(4)), ValueError,
     "pos must have shape \\[3\\]"),
    (lambda: GraphSelfAttention(8, 4, rotary=pe.RotaryPE(4))(
        (torch.randn(3, 8), torch.randn(2, 8)), graphs.chain_graph(2), pos=torch.arange(3)),
     ValueError, "pair \\(pos_src, pos_dst\\)"),
    (lambda: GraphSelfAttention(8, 4, rotary=pe.RotaryPE(4, axes=2))(
        (torch.randn(3, 8), torch.randn(2, 8)), graphs.chain_graph(2),
        pos=(torch.zeros(3, 2), torch.zeros(2, 3))), ValueError, "pos_dst must have shape"),
    (lambda: DenseSelfAttention(8, 4, rotary=pe.RotaryPE(4))(
        torch.randn(5, 8), batch=torch.zeros(5, dtype=torch.long)), ValueError,
     "with batch, a layer with rotary or query_temperature needs pos"),
    (lambda: DenseSelfAttention(8, 4)(torch.randn(5, 8), pos=torch.arange(5)), ValueError,
     "rotary=None"),
    (lambda: GraphSelfAttention(8, 4, heads=4, kv_heads=3), ValueError,
     "kv_heads must divide heads = 4"),
    (lambda: GraphSelfAttention(8, 4, heads=4, kv_heads=0), ValueError, "kv_heads"),
    # one position as a 0-d tensor failed in torch ("Dimension out of range ... got -3")
    (lambda: pe.apply_rotary(torch.randn(1, 2, 8), torch.tensor(5)), ValueError,
     r"pos must give a position to each of the N = 1 rows of x \[1, 2, 8\].*got \[\]"),
    (lambda: GraphSelfAttention(8, 4, heads=4, kv_heads=2, attention="additive"), ValueError,
     "needs the dot or gatv2 score"),
    (lambda: GraphSelfAttention(8, 4, heads=4, kv_heads=2, share_weights=True), ValueError,
     "share_weights=True"),
])
def test_rotary_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_graph_transformer_rotates_in_every_block():
    # every block's layer takes the positions: moving them all by one offset changes no
    # output of the whole model, on a batch of two sequences side by side
    from graphattn.nn import GraphTransformer

    torch.manual_seed(0)
    model = GraphTransformer(5, 16, 3, num_layers=3, heads=2, dropout=0.0, kv_heads=1,
                             add_self_loops=False, rotary=pe.RotaryPE(8)).double().eval()
    assert all(attn.lin_k.out_features == 8 for attn in model.attns)  # one key head
    L = 10
    edges = graphs.repeat_graph(graphs.causal_graph(L), L, 2)
    x = torch.randn(2 * L, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(L).repeat(2)
    out, weights = model(x, edges, pos=pos, return_attention_weights=True)
    assert_close(model(x, edges, pos=pos + 123), out)
    assert len(weights) == 3
    # the positions reach every block: a model whose last block rotates otherwise differs
    model.attns[2].rotary = pe.RotaryPE(8, base=3.0)
    assert not torch.allclose(model(x, edges, pos=pos), out, atol=1e-6)
    with pytest.raises(ValueError, match="needs the nodes' positions"):
        model(x, edges)


def test_dense_layer_with_a_pyg_batch_rotates_each_node_by_its_own_position():
    # DenseSelfAttention(batch=) attends within each graph of a PyG batch: with rotary, each
    # node turns by its pos, as the graph layer does on batch_complete_graph(batch)
    torch.manual_seed(0)
    rope = pe.RotaryPE(8, axes=2)
    graph = GraphSelfAttention(6, 8, 2, add_self_loops=False, rotary=rope).double()
    dense = DenseSelfAttention(6, 8, 2, rotary=rope).double()
    dense.load_state_dict(graph.state_dict())
    gen = torch.Generator().manual_seed(14)
    batch = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    x = torch.randn(9, 6, dtype=torch.float64, generator=gen)
    pos = torch.randn(9, 2, dtype=torch.float64, generator=gen) * 10  # real 2-D coordinates
    want = graph(x, graphs.batch_complete_graph(batch), pos=pos)
    assert_close(dense(x, batch=batch, pos=pos), want)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("options", [
    dict(attention="dot"),
    dict(attention="gatv2"),
    dict(attention="dot", edge_dim=3, edge_mode="key_value"),
    dict(attention="gatv2", share_value=True, edge_dim=3, edge_mode="key"),
], ids=["dot", "gatv2", "dot-edge-key-value", "gatv2-shared-value-edge-key"])
def test_grouped_heads_are_full_heads_with_repeated_weights(options, backend):
    # kv_heads = 2 of 4 heads is the layer of 4 key and value heads whose weights repeat each
    # group's: the same outputs, and the grouped weights' gradients are the sums of the groups'
    H, G, C, F = 4, 2, 5, 7
    torch.manual_seed(0)
    grouped = GraphSelfAttention(F, C, H, kv_heads=H // G, backend=backend, **options).double()
    full = GraphSelfAttention(F, C, H, backend=backend, **options).double()
    state = dict(grouped.state_dict())
    for name in ("lin_k", "lin_v"):
        for part in ("weight", "bias"):
            key = f"{name}.{part}"
            if key in state:  # (H_kv C, ...) -> (H C, ...): each head's rows G times
                t = state[key].unflatten(0, (H // G, C))
                state[key] = t.repeat_interleave(G, dim=0).flatten(0, 1)
    full.load_state_dict(state)
    gen = torch.Generator().manual_seed(16)
    x = torch.randn(12, F, dtype=torch.float64, generator=gen)
    edges = graphs.random_graph(12, 4, generator=gen)
    edge_attr = (torch.randn(edges.size(1), 3, dtype=torch.float64, generator=gen)
                 if "edge_dim" in options else None)
    outs = []
    for layer in (grouped, full):
        out, (_, alpha) = layer(x, edges, edge_attr, return_attention_weights=True)
        out.square().sum().backward()
        outs.append((out, alpha))
    assert_close(outs[0][0], outs[1][0])
    assert_close(outs[0][1], outs[1][1])
    assert_close(grouped.lin_q.weight.grad, full.lin_q.weight.grad)
    summed = full.lin_k.weight.grad.unflatten(0, (H // G, G, C)).sum(dim=1).flatten(0, 1)
    assert_close(grouped.lin_k.weight.grad, summed)


def hf_attention(family: str, kv_heads: int, layer_idx: int = 0, **config):
    """Hugging Face's self-attention of ``family`` (``"llama"``, ``"qwen2"``, ``"mistral"``),
    4 heads of 8 channels, and its rotary embedding module, from a config (no download)."""
    module = transformers_module(f"{family}.modeling_{family}")
    import transformers

    prefix = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral", "qwen3": "Qwen3",
              "gemma2": "Gemma2", "gemma3": "Gemma3", "phi3": "Phi3", "olmo2": "Olmo2",
              "olmo3": "Olmo3", "cohere": "Cohere", "cohere2": "Cohere2", "glm": "Glm",
              "helium": "Helium", "ernie4_5": "Ernie4_5", "smollm3": "SmolLM3",
              "gpt_oss": "GptOss", "diffllama": "DiffLlama", "qwen3_next": "Qwen3Next",
              "seed_oss": "SeedOss", "nanochat": "NanoChat", "gpt_neox": "GPTNeoX",
              "phi": "Phi", "persimmon": "Persimmon", "lfm2": "Lfm2", "afmoe": "Afmoe",
              "hrm_text": "HrmText", "beam": "Beam", "bitnet": "BitNet",
              "hunyuan_v1_dense": "HunYuanDenseV1", "modernbert": "ModernBert",
              "modernbert_decoder": "ModernBertDecoder",
              "voxtral_realtime": "VoxtralRealtime", "chameleon": "Chameleon",
              "timesfm2_5": "TimesFm2_5", "dory": "Dory", "minicpm5_moe": "MiniCPM5Moe",
              "jetmoe": "JetMoe", "hy_v4": "HYV4", "deepseek_v2": "DeepseekV2",
              "deepseek_v3": "DeepseekV3", "deepseek_v32": "DeepseekV32",
              "minicpm3": "MiniCPM3", "kimi_linear": "KimiLinear",
              "longcat_flash": "LongcatFlash", "bailing_hybrid": "BailingHybrid",
              "mistral4": "Mistral4", "glm_moe_dsa": "GlmMoeDsa"}[family]
    config = getattr(transformers, f"{prefix}TextConfig" if family in (
        "gemma3", "voxtral_realtime") else f"{prefix}Config")(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=kv_heads,
        attention_dropout=0.0, **config)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = (getattr(module, f"{prefix}Attention", None)  # (LongCat-Flash's: ...MLA)
                 or getattr(module, f"{prefix}MLA"))(config, layer_idx=layer_idx)
    for name in ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "Wqkv",
                 "o_proj", "dense", "Wo"):
        lin = getattr(attention, name, None)  # (Phi-3 has one qkv_proj, GPT-NeoX another)
        if lin is not None and lin.bias is not None:  # not 0, so that a lost one would show
            torch.nn.init.normal_(lin.bias)
    for name in ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm",
                 "key_layernorm", "q_a_layernorm", "kv_a_layernorm"):
        norm = getattr(attention, name, None)
        if getattr(norm, "weight", None) is not None:  # Qwen3's gains, away from their initial
            # 1 for the same reason (NanoChat's norms have none)
            torch.nn.init.normal_(norm.weight, 1.0, 0.5)
        if getattr(norm, "bias", None) is not None:  # Phi's LayerNorms, away from 0
            torch.nn.init.normal_(norm.bias, 0.0, 0.5)
    rotary = getattr(module, f"{prefix}RotaryEmbedding", None)  # (Kimi Linear's MLA: none)
    return attention, None if rotary is None else rotary(config)


@pytest.mark.parametrize("family, kv_heads, config", [
    ("llama", 4, dict(rope_theta=500.0)),
    ("llama", 2, dict(attention_bias=True)),
    ("qwen2", 2, {}),  # biased q, k, v, and an o_proj without one
    ("mistral", 1, {}),
], ids=["llama", "llama-grouped-biased", "qwen2", "mistral-multi-query"])
@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_computes_the_hugging_face_attention(family, kv_heads, config, dense):
    from graphattn.nn import from_llama

    attention, rotary = hf_attention(family, kv_heads, **config)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.kv_heads == kv_heads and layer.rotary.dim == 8
    check_causal(attention, rotary, layer, dense, length=20, seed=17)
    assert_close(layer.lin_v.weight.grad, attention.v_proj.weight.grad)


def check_causal(attention, rotary, layer, dense: bool, length: int, seed: int,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The converted layer on the causal graph (or the dense layer with ``is_causal``) and
    Hugging Face's attention on ``[1, length, 32]``: outputs and the input's gradient. Returns
    the input and Hugging Face's output."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, length, 32, generator=gen)
    w = torch.randn(1, length, 32, generator=gen)
    want, want_grad = run_llama(attention, rotary, x, torch.arange(length)[None], w)
    x_in = x.clone().requires_grad_(True)
    positions = ({} if layer.rotary is None and layer.query_temperature is None
                 else {"pos": torch.arange(length)})  # (NoPE: none)
    out = (layer(x_in, is_causal=True) if dense
           else layer(x_in[0], graphs.causal_graph(length), **positions)[None])
    (out * w).sum().backward()
    assert_close(out.detach(), want)
    assert_close(x_in.grad, want_grad)
    return x, want


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"], ids=["llama", "latent"])
def test_from_llama_carries_a_frozen_attention(family):
    """A frozen attention converted to a frozen layer, a trainable one to a trainable layer;
    partly frozen weights and hooks are warned about (the latent attention's conversion,
    a path of its own, carried none of it)."""
    from graphattn.nn import from_llama

    attention, _ = (hf_attention(family, 4, **MLA) if family == "deepseek_v3"
                    else hf_attention(family, 2))
    name = type(attention).__name__
    attention.requires_grad_(False)
    assert not any(p.requires_grad for p in from_llama(attention).parameters())
    attention.requires_grad_(True)
    assert all(p.requires_grad for p in from_llama(attention).parameters())
    attention.o_proj.requires_grad_(False)
    with pytest.warns(UserWarning, match=rf"attention \({name}\) has some parameters frozen"):
        from_llama(attention, dense=True)
    attention.requires_grad_(True)
    attention.register_forward_hook(lambda *args: None)
    with pytest.warns(UserWarning, match=rf"attention \({name}\) has hooks \(_forward_hooks\)"):
        from_llama(attention)


def test_from_llama_refuses_a_config_without_a_rotary_embedding_by_name():
    """A config without rope_theta (Jamba's attention has none): refused as from_llama refuses
    what it does not convert (it raised the private exception that marks the latent
    attentions without a rotation)."""
    from graphattn.nn import from_llama

    attention, _ = hf_attention("llama", 2)
    attention.config.rope_parameters = {"rope_type": "default"}
    with pytest.raises(NotImplementedError, match=r"the config of LlamaAttention gives no "
                                                  r"rope_theta \(nor rope_parameters"):
        from_llama(attention)


def test_from_llama_on_a_window_is_the_attention_with_a_window_mask():
    # the converted layer on a causal window graph: Hugging Face's attention with that mask
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("llama", 2)
    layer = from_llama(attention)
    L, r = 24, 5
    window = graphs.window_graph(L, r, causal=True)
    x = torch.randn(1, L, 32, generator=torch.Generator().manual_seed(18))
    mask = torch.zeros(L, L).masked_fill(~graphs.to_dense_mask(window, L), float("-inf"))
    with torch.no_grad():
        want = attention(x, position_embeddings=rotary(x, torch.arange(L)[None]),
                         attention_mask=mask[None, None])[0]
        assert_close(layer(x[0], window, pos=torch.arange(L)), want[0])


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["global", "local"])
@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_modernbert_encoder_layers(layer_idx, dense):
    # ModernBERT, an encoder: one Wqkv ([q; k; v], a key and value head per head) and Wo;
    # global layers (RoPE base 160,000) attend to every token, local ones (base 10,000) to the
    # tokens within sliding_window = local_attention // 2 on both sides: window_graph(L, 4)
    # here, against the mask the model builds for them
    from transformers.masking_utils import (
        create_bidirectional_mask,
        create_bidirectional_sliding_window_mask,
    )

    from graphattn.nn import from_llama

    attention, rotary = hf_attention("modernbert", 4, layer_idx, local_attention=8,
                                     attention_bias=True)
    config, L = attention.config, 14
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.kv_heads == 4 and layer.rotary.base == (160000.0, 10000.0)[layer_idx]
    assert_close(layer.lin_v.bias.detach(), attention.Wqkv.bias.detach()[64:])
    gen = torch.Generator().manual_seed(34)
    x, w = torch.randn(1, L, 32, generator=gen), torch.randn(1, L, 32, generator=gen)
    make_mask = (create_bidirectional_mask, create_bidirectional_sliding_window_mask)[layer_idx]
    mask = make_mask(config=config, inputs_embeds=x, attention_mask=torch.ones(1, L).long())
    if mask is None:  # (the global layers' mask: none, every token sees every token)
        mask = torch.zeros(1, 1, L, L)
    graph = (graphs.complete_graph(L), graphs.window_graph(L, config.sliding_window))[layer_idx]
    assert torch.equal(mask[0, 0] == 0, graphs.to_dense_mask(graph, L))
    want, want_grad = run_llama(attention, rotary, x, torch.arange(L)[None], w, mask=mask)
    x_in = x.clone().requires_grad_(True)
    out = (layer(x_in, mask=mask[:, 0] == 0) if dense
           else layer(x_in[0], graph, pos=torch.arange(L))[None])
    (out * w).sum().backward()
    assert_close(out.detach(), want)
    assert_close(x_in.grad, want_grad)
    assert_close(layer.lin_out.weight.grad, attention.Wo.weight.grad)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_reads_the_key_heads_from_k_proj(dense):
    # ModernBERT's decoder gives every head its own key and value, whatever its config says of
    # key heads: given a config with num_key_value_heads=2, its k_proj still has 4 heads of 8
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("modernbert_decoder", 2, 0, attention_bias=True)
    assert attention.config.num_key_value_heads == 2 and attention.k_proj.out_features == 32
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.kv_heads == 4
    check_causal(attention, rotary, layer, dense, length=14, seed=35)
    assert_close(layer.lin_k.weight.grad, attention.k_proj.weight.grad)


def gemma4_attention(layer_idx: int, **config):
    """Gemma 4's text attention (4 heads of 8 channels in its sliding layers, 16 in its global
    ones; two key heads) with gains away from 1, and its rotary embedding module."""
    transformers = pytest.importorskip("transformers")
    module = transformers_module("gemma4.modeling_gemma4")
    config = transformers.Gemma4TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        global_head_dim=16, num_hidden_layers=3, intermediate_size=64,
        layer_types=["sliding_attention", "full_attention", "full_attention"], **config)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = module.Gemma4TextAttention(config, layer_idx=layer_idx)
    for norm in (attention.q_norm, getattr(attention, "k_norm", None)):
        if norm is not None:
            torch.nn.init.normal_(norm.weight, 1.0, 0.5)
    return attention, module.Gemma4TextRotaryEmbedding(config)


@pytest.mark.parametrize("layer_idx, k_eq_v", [(0, False), (1, False), (1, True)],
                         ids=["sliding", "global", "global-k-eq-v"])
@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_gemma4(layer_idx, k_eq_v, dense):
    # Gemma 4: QK-norm with gains, an RMS norm of the values without gains (v_norm=True), a
    # score scale of 1, and in its global layers wider heads, "proportional" RoPE (a quarter
    # of the planes turn, the others have frequency 0) and, with attention_k_eq_v, values
    # from k_proj (share_value=True; before the keys' norm and rotation)
    from graphattn.nn import from_llama

    attention, rotary = gemma4_attention(layer_idx, attention_k_eq_v=k_eq_v)
    layer = from_llama(attention, dense=dense, backend="cpu")
    head_dim = (8, 16)[layer_idx]
    assert layer.out_channels == head_dim and layer.v_norm is not None
    assert layer.scale == 1.0 and layer.qk_norm == "rms" and layer.rotary.dim == head_dim
    if layer_idx == 1:  # 2 of the 8 planes turn
        assert (layer.rotary.frequencies > 0).sum() == 2
    assert (layer.lin_v is layer.lin_k) == k_eq_v
    forward = attention.forward
    attention.forward = lambda *args, **kwargs: forward(*args, shared_kv_states={}, **kwargs)
    check_causal(attention, rotary, layer, dense, length=14, seed=36)
    assert_close_to_scale(layer.lin_k.weight.grad, attention.k_proj.weight.grad)  # (up to 12)
    assert_close(layer.q_norm.weight.grad, attention.q_norm.weight.grad)


@pytest.mark.parametrize("layer_idx", [0, 4], ids=["sliding", "global"])
def test_from_llama_converts_gemma3n(layer_idx):
    # Gemma 3n: the q, k and v norms of Gemma 4 (v_norm without gains), a scale of 1
    transformers = pytest.importorskip("transformers")
    from graphattn.nn import from_llama

    module = transformers_module("gemma3n.modeling_gemma3n")
    config = transformers.Gemma3nTextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_hidden_layers=5, intermediate_size=64, num_kv_shared_layers=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = module.Gemma3nTextAttention(config, layer_idx=layer_idx)
    for norm in (attention.q_norm, attention.k_norm):
        torch.nn.init.normal_(norm.weight, 1.0, 0.5)
    layer = from_llama(attention, backend="cpu")
    assert layer.v_norm is not None and layer.scale == 1.0
    check_causal(attention, module.Gemma3nRotaryEmbedding(config), layer, False, length=14,
                 seed=37)


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["full", "sliding"])
@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_mimo_v2_values_of_their_own_width(layer_idx, dense):
    # MiMo-V2-Flash: values of 12 channels per head beside queries and keys of 8
    # (score_channels=8), a factor of 0.707 on the values (folded into lin_v), RoPE on a
    # third of the channels; its sliding layers have twice the key heads and a sink per head
    transformers = pytest.importorskip("transformers")
    from graphattn.nn import from_llama

    module = transformers_module("mimo_v2_flash.modeling_mimo_v2_flash")
    config = transformers.MiMoV2FlashConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=8, v_head_dim=12,
        num_hidden_layers=2, intermediate_size=64, attention_bias=True)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = module.MiMoV2FlashAttention(config, layer_idx=layer_idx)
    for lin in (attention.q_proj, attention.k_proj, attention.v_proj):
        torch.nn.init.normal_(lin.bias)
    if attention.sinks is not None:
        torch.nn.init.normal_(attention.sinks)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert (layer.score_channels, layer.out_channels, layer.kv_heads) == (8, 12, 1 + layer_idx)
    assert (layer.sinks is not None) == (layer_idx == 1) and layer.rotary.dim == 2
    assert_close(layer.lin_v.bias.detach(), attention.v_proj.bias.detach() * 0.707)
    check_causal(attention, module.MiMoV2FlashRotaryEmbedding(config), layer, dense, length=14,
                 seed=38)
    assert_close(layer.lin_q.weight.grad, attention.q_proj.weight.grad)


def test_from_llama_refuses_gemma4_layers_that_share_keys_and_values():
    from graphattn.nn import from_llama

    attention, _ = gemma4_attention(2, num_kv_shared_layers=1)
    assert attention.is_kv_shared_layer and getattr(attention, "k_proj", None) is None
    with pytest.raises(NotImplementedError, match="Gemma4TextAttention \\(layer 2\\) takes "
                       "the keys and values of an earlier layer \\(KV sharing\\)"):
        from_llama(attention)
    attention.v_norm = torch.nn.LayerNorm(8)
    attention.is_kv_shared_layer = False
    attention.k_proj = torch.nn.Linear(32, 16, bias=False)
    attention.v_proj = torch.nn.Linear(32, 16, bias=False)
    attention.k_norm = attention.q_norm
    with pytest.raises(NotImplementedError, match="v_norm that RMS-normalises each head's "
                       "values without gains"):
        from_llama(attention)


@pytest.mark.parametrize("make, error, match", [
    (lambda: torch.nn.Linear(4, 4), TypeError, "LLaMA-family self-attention"),
    (lambda: _with_rope(hf_attention("llama", 4)[0], rope_type="made_up", rope_theta=1e4),
     NotImplementedError, "rope_type='made_up'"),
    (lambda: _replaced(hf_attention("qwen3", 2, head_dim=8)[0], o_proj=torch.nn.Linear(48, 32)),
     ValueError, "o_proj must take heads \\* head_dim = 32 features"),
    (lambda: _replaced(hf_attention("qwen3", 2, head_dim=8)[0], k_norm=torch.nn.LayerNorm(8)),
     NotImplementedError, "over each head's head_dim = 8 channels or over the whole "
     "projection's \\(q_norm 32, k_norm 16\\); got k_norm LayerNorm with weight \\[8\\]"),
    (lambda: _replaced(hf_attention("olmo2", 2)[0], k_norm=torch.nn.RMSNorm(8)),  # q: 32
     NotImplementedError, "got k_norm RMSNorm with weight \\[8\\]"),
])
def test_from_llama_errors(make, error, match):
    from graphattn.nn import from_llama

    with pytest.raises(error, match=match):
        from_llama(make())


def _with_rope(attention: torch.nn.Module, **rope) -> torch.nn.Module:
    attention.config.rope_parameters = rope
    return attention


def _replaced(module: torch.nn.Module, **children: torch.nn.Module) -> torch.nn.Module:
    for name, child in children.items():
        setattr(module, name, child)
    return module


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_qwen3_qk_norm_and_wide_heads(dense):
    # Qwen3 normalises each head's queries and keys (RMSNorm with gains) before the rotation,
    # and its small models have more head channels than hidden ones (Qwen3-0.6B: 16 heads of
    # 128 in a width of 1024): here 4 heads of 16 in a width of 32, o_proj 64 -> 32
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("qwen3", 2, head_dim=16, rms_norm_eps=1e-5)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.qk_norm == "rms" and layer.q_norm.eps == 1e-5
    assert tuple(layer.lin_out.weight.shape) == (32, 64)
    check_causal(attention, rotary, layer, dense, length=18, seed=24)
    assert_close(layer.q_norm.weight.grad, attention.q_norm.weight.grad)
    assert_close(layer.k_norm.weight.grad, attention.k_norm.weight.grad)
    assert_close(layer.lin_out.weight.grad, attention.o_proj.weight.grad)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_from_llama_converts_olmo2_qk_norm_across_heads(dense, kv_heads):
    # OLMo 2 normalises the whole query and key projections (RMSNorm over 4 * 8 and
    # kv_heads * 8 channels, all heads together) before splitting them into heads and rotating
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("olmo2", kv_heads, rms_norm_eps=1e-5)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.qk_norm == "rms_across_heads" and layer.q_norm.eps == 1e-5
    assert layer.k_norm.weight.shape == (kv_heads * 8,)
    check_causal(attention, rotary, layer, dense, length=16, seed=27)
    assert_close(layer.q_norm.weight.grad, attention.q_norm.weight.grad)
    assert_close(layer.k_norm.weight.grad, attention.k_norm.weight.grad)


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["sliding", "full"])
def test_from_llama_converts_olmo3(layer_idx):
    # OLMo 3: OLMo 2's QK-norm, a rotary embedding per kind of layer (its attention_type:
    # here base 10,000 for the sliding layers and 1e6 with linear interpolation by 8 for the
    # full ones), and sliding layers of a window of w = 4 keys, which is the causal window
    # graph of radius w - 1 (Hugging Face's mask keeps i - w < j <= i)
    from graphattn.nn import from_llama

    attention, rotary = hf_attention(
        "olmo3", 2, layer_idx, num_hidden_layers=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=GEMMA3["rope_parameters"])
    layer = from_llama(attention, backend="cpu")
    assert layer.qk_norm == "rms_across_heads"
    assert (layer.rotary.base, layer.rotary.frequencies is None) == (
        (10000.0, True) if layer_idx == 0 else (1e6, False))
    L = 15
    gen = torch.Generator().manual_seed(28)
    x = torch.randn(1, L, 32, generator=gen)
    w = torch.randn(1, L, 32, generator=gen)
    graph = (graphs.window_graph(L, 3, causal=True) if attention.sliding_window == 4
             else graphs.causal_graph(L))
    assert (attention.sliding_window is None) == (layer_idx == 1)
    mask = torch.zeros(L, L).masked_fill(~graphs.to_dense_mask(graph, L), float("-inf"))
    want, want_grad = run_llama(attention, rotary, x, torch.arange(L)[None], w,
                                mask=mask[None, None])
    x_in = x[0].clone().requires_grad_(True)
    out = layer(x_in, graph, pos=torch.arange(L))
    (out * w[0]).sum().backward()
    assert_close(out.detach(), want[0])
    assert_close(x_in.grad, want_grad[0])


@pytest.mark.parametrize("family, dense", [
    ("cohere", False), ("cohere", True), ("helium", False), ("ernie4_5", False), ("glm", False),
])
def test_from_llama_finds_a_rotation_that_pairs_channels_as_gptj(family, dense):
    # Cohere, Helium, Ernie 4.5 and GLM (on half its channels) rotate the channel pairs 2m,
    # 2m + 1, in a module-level function of their model: their attention classes are LLaMA's.
    # The conversion's check finds it and takes RotaryPE(interleaved=True).
    from graphattn.nn import from_llama

    attention, rotary = hf_attention(family, 2, head_dim=8)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.rotary.interleaved
    assert layer.rotary.dim == (4 if family == "glm" else 8)
    check_causal(attention, rotary, layer, dense, length=18, seed=29)
    assert_close(layer.lin_q.weight.grad, attention.q_proj.weight.grad)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_nanochat_norm_without_gains(dense):
    # NanoChat normalises each head's queries and keys after rotating them, by an RMSNorm
    # without gains: the rotation keeps their norms, so this is qk_norm="rms" with gains of 1
    # before it. Its rotate_half flips the sign of the other half: each plane turns the other
    # way, which the check finds (negated frequencies)
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("nanochat", 2, head_dim=8)
    assert getattr(attention.q_norm, "weight", None) is None
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.qk_norm == "rms" and torch.equal(layer.q_norm.weight.detach(), torch.ones(8))
    assert not layer.rotary.interleaved and (layer.rotary.frequencies < 0).all()
    check_causal(attention, rotary, layer, dense, length=16, seed=34)


@pytest.mark.parametrize("family, dense", [("gpt_neox", False), ("gpt_neox", True),
                                           ("phi", False)])
def test_from_llama_converts_gpt_neox_and_phi(family, dense):
    # GPT-NeoX (Pythia) projects q, k and v by one query_key_value whose rows hold each
    # head's three in turn, and Phi (1, 1.5, 2) has q_proj, k_proj and v_proj; both project
    # the output by `dense` and rotate part of each head's channels (a quarter and a half)
    from graphattn.nn import from_llama

    attention, rotary = hf_attention(family, 4, attention_bias=True)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.rotary.dim == (2 if family == "gpt_neox" else 4) and layer.kv_heads == 4
    check_causal(attention, rotary, layer, dense, length=14, seed=35)
    assert_close(layer.lin_out.weight.grad, attention.dense.weight.grad)
    if family == "gpt_neox":  # the value rows of head 1 of the fused weight
        assert_close(layer.lin_v.weight.grad[8:16],
                     attention.query_key_value.weight.grad.view(4, 3, 8, 32)[1, 2])


@pytest.mark.parametrize("family", ["gpt_neox", "persimmon"])
def test_fused_per_head_projections_keep_one_key_head_per_query_head(family):
    # GPT-NeoX's and Persimmon's query_key_value holds one query, key and value per head:
    # a num_key_value_heads that their config carries (as any config may) is not theirs, and
    # was once read as such, which made the conversion refuse them
    from graphattn.nn import from_llama

    attention, rotary = hf_attention(family, 2)
    assert attention.config.num_key_value_heads == 2
    layer = from_llama(attention, backend="cpu")
    assert layer.kv_heads == layer.heads == 4
    check_causal(attention, rotary, layer, dense=False, length=12, seed=37)


@pytest.mark.parametrize("family, config", [("phi", dict(qk_layernorm=True)),
                                            ("persimmon", {})])
def test_from_llama_converts_layer_norms_of_queries_and_keys(family, config):
    # Phi (with qk_layernorm) and Persimmon normalise each head's queries and keys by a
    # LayerNorm with gains and a bias (set away from 1 and 0 here): qk_norm="layer"
    from graphattn.nn import from_llama

    attention, rotary = hf_attention(family, 4, **config)
    layer = from_llama(attention, backend="cpu")
    assert layer.qk_norm == "layer"
    assert_close(layer.k_norm.bias.detach(), attention.k_layernorm.bias.detach())
    check_causal(attention, rotary, layer, dense=False, length=14, seed=36)
    assert_close(layer.q_norm.weight.grad, attention.q_layernorm.weight.grad)
    assert_close(layer.k_norm.bias.grad, attention.k_layernorm.bias.grad)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_norms_after_the_rotation(dense):
    # HunYuan normalises the rotated queries and keys (query_layernorm, key_layernorm: RMSNorms
    # with gains, set away from 1 here, where the order matters): qk_norm_after_rotary=True
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("hunyuan_v1_dense", 2, head_dim=8)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.qk_norm == "rms" and layer.qk_norm_after_rotary
    check_causal(attention, rotary, layer, dense, length=12, seed=43)
    assert_close(layer.k_norm.weight.grad, attention.key_layernorm.weight.grad)
    layer.qk_norm_after_rotary = False  # before the rotation it computes something else
    with pytest.raises(AssertionError):
        check_causal(attention, rotary, layer, dense, length=12, seed=43)


def test_from_llama_converts_lfm2():
    # LFM2 (Liquid AI) is Qwen3's attention under other names: an RMSNorm of each head's
    # queries and keys before the rotation as q_layernorm and k_layernorm (gains set away
    # from 1 here), the output projection as out_proj
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("lfm2", 2)
    layer = from_llama(attention, backend="cpu")
    assert layer.qk_norm == "rms" and layer.kv_heads == 2
    check_causal(attention, rotary, layer, dense=False, length=14, seed=38)
    assert_close(layer.q_norm.weight.grad, attention.q_layernorm.weight.grad)
    assert_close(layer.lin_out.weight.grad, attention.out_proj.weight.grad)


def llama4_attention(layer_idx: int):
    """Hugging Face's Llama 4 text attention of layer ``layer_idx`` (0: RoPE and its weightless
    QK-norm; 3: no RoPE, with attention temperature tuning) and its rotary embedding."""
    llama4 = transformers_module("llama4.modeling_llama4")
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, num_hidden_layers=4, intermediate_size=64,
                              intermediate_size_mlp=64, attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = llama4.Llama4TextAttention(config, layer_idx)
    return attention, llama4.Llama4TextRotaryEmbedding(config)


def test_from_llama_converts_llama4_and_its_chunked_attention():
    # Llama 4's layers with RoPE: GPT-J's pairing of the channels (a complex product), an
    # RMSNorm without gains of the rotated queries and keys (the same before the rotation,
    # which keeps norms), attention within chunks of attention_chunk_size: chunked_graph
    from graphattn.nn import from_llama

    attention, rotary = llama4_attention(0)
    assert attention.use_rope and isinstance(attention.qk_norm, torch.nn.Module)
    layer = from_llama(attention, backend="cpu")
    assert layer.rotary.interleaved and layer.qk_norm == "rms" and layer.kv_heads == 2
    assert torch.equal(layer.q_norm.weight, torch.ones(8))
    check_causal(attention, rotary, layer, dense=False, length=14, seed=39)
    L, chunk = 11, 4
    gen = torch.Generator().manual_seed(40)
    x, w = torch.randn(1, L, 32, generator=gen), torch.randn(1, L, 32, generator=gen)
    i = torch.arange(L)
    allowed = (i[:, None] // chunk == i[None, :] // chunk) & (i[None, :] <= i[:, None])
    mask = torch.zeros(L, L).masked_fill(~allowed, float("-inf"))[None, None]
    want, want_grad = run_llama(attention, rotary, x, i[None], w, mask=mask)
    x_in = x[0].clone().requires_grad_(True)
    out = layer(x_in, graphs.chunked_graph(L, chunk), pos=i)
    (out * w[0]).sum().backward()
    assert_close(out.detach(), want[0])
    assert_close(x_in.grad, want_grad[0])


def check_without_temperature(attention, rotary, layer, dense: bool, length: int) -> None:
    """The conversion of an attention with a query temperature, checked, and the same layer
    without it, which must then differ from the attention."""
    check_causal(attention, rotary, layer, dense=dense, length=length, seed=41)
    layer.query_temperature = None
    with pytest.raises(AssertionError, match="not close"):
        check_causal(attention, rotary, layer, dense=dense, length=length, seed=41)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_llama4_temperature_tuning(dense):
    # Llama 4's layers without RoPE scale their queries by 1 + attn_scale log1p(floor((p + 1)
    # / floor_scale)): query_temperature, offset 1. floor_scale 3 instead of 8192, so that the
    # 14 positions take five steps of the floor
    from graphattn.nn import from_llama

    attention, rotary = llama4_attention(3)
    assert not attention.use_rope and attention.attn_temperature_tuning
    attention.floor_scale = 3
    layer = from_llama(attention, dense=dense)
    assert layer.rotary is None
    temperature = layer.query_temperature
    assert (temperature.beta, temperature.length, temperature.offset) == (
        attention.attn_scale, 3.0, 1.0)
    check_without_temperature(attention, rotary, layer, dense, length=14)


def test_query_temperature_is_mistral4_s_factor_and_refuses_what_it_cannot_take():
    # against Mistral 4's own function at positions 0 .. 99 (Llama 4's, inside its forward, is
    # checked through the conversion above); by hand at steps of the floor; 1 before -offset
    mistral4 = transformers_module("mistral4.modeling_mistral4")
    pos = torch.arange(100)
    want = mistral4.get_llama_4_attn_scale(pos[None], 0.4, 16)[0, 0, :, 0]
    assert_close(pe.QueryTemperature(0.4, 16)(pos), want)
    got = pe.QueryTemperature(2.0, 4, offset=1)(torch.tensor([-9, -1, 2, 3, 10, 11]))
    assert_close(got, torch.tensor([1.0, 1.0, 1.0, 1 + 2 * math.log(2), 1 + 2 * math.log(3),
                                    1 + 2 * math.log(4)]))
    assert repr(pe.QueryTemperature(0.1, 8192, offset=1)) == (
        "QueryTemperature(beta=0.1, length=8192, offset=1)")
    for kwargs, error, match in (
            (dict(beta=float("nan"), length=4), ValueError, "beta must be a finite number"),
            (dict(beta=1.0, length=0), ValueError, "length must be > 0, got 0"),
            (dict(beta=1.0, length=4, offset="1"), ValueError, "offset must be a finite")):
        with pytest.raises(error, match=match):
            pe.QueryTemperature(**kwargs)
    with pytest.raises(TypeError, match="pos must be integer or real, got torch.bool"):
        pe.QueryTemperature(1.0, 4)(torch.ones(3, dtype=torch.bool))


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["sliding", "full"])
def test_from_llama_converts_gpt_oss_sinks(layer_idx):
    # GPT-OSS: a learned sink logit per head in each softmax (sinks=True), biased
    # projections, YaRN's rotation; its sliding layers' window is the graph's
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("gpt_oss", 2, layer_idx, head_dim=8, attention_bias=True,
                                     num_hidden_layers=2)
    torch.nn.init.normal_(attention.sinks, 0.0, 2.0)
    layer = from_llama(attention, backend="cpu")
    assert_close(layer.sinks.detach(), attention.sinks.detach())
    check_causal(attention, rotary, layer, dense=False, length=14, seed=37)
    assert_close(layer.sinks.grad, attention.sinks.grad)
    # and DenseSelfAttention(sinks=True), whose SDPA call gets one more key per head
    attention.zero_grad()
    dense = from_llama(attention, dense=True)
    assert repr(dense).endswith("sinks=True)")
    check_causal(attention, rotary, dense, dense=True, length=14, seed=37)
    assert_close(dense.sinks.grad, attention.sinks.grad)


@pytest.mark.parametrize("family", ["smollm3", "cohere2"])
def test_from_llama_converts_a_layer_without_a_rotation(family):
    # SmolLM3's every fourth layer and Cohere 2's global layers rotate nothing (NoPE): the
    # converted layer has rotary=None and is called without pos; the model's other layers
    # keep their rotation
    from graphattn.nn import from_llama

    attention, rotary = hf_attention(family, 2, 3, num_hidden_layers=4, head_dim=8)
    layer = from_llama(attention, backend="cpu")
    assert layer.rotary is None
    check_causal(attention, rotary, layer, dense=False, length=18, seed=30)
    assert from_llama(hf_attention(family, 2, 0, num_hidden_layers=4, head_dim=8)[0]
                      ).rotary is not None


def test_from_llama_refuses_what_it_does_not_convert():
    # an attention that computes something more in code the converter does not read (here a
    # forward that doubles the output of the second half of the tokens' channels): from_llama
    # says so instead of returning a layer that computes something else
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("llama", 2, head_dim=8)
    base = type(attention)

    def forward(self, *args, **kwargs):
        out, weights = base.forward(self, *args, **kwargs)
        return torch.cat([out[..., :16], 2 * out[..., 16:]], dim=-1), weights

    attention.__class__ = type("LlamaAttention", (base,), {"forward": forward,
                                                           "__module__": base.__module__})
    with pytest.raises(NotImplementedError, match="LlamaAttention does not compute what its "
                       "conversion computes"):
        from_llama(attention)
    layer = from_llama(attention, check=False)  # unchecked, it computes something else indeed
    with pytest.raises(AssertionError):
        check_causal(attention, rotary, layer, dense=False, length=12, seed=31)


@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_diffllama(dense, kv_heads):
    # DiffLlama's heads h and h + 2 are one differential head's two maps, over values of 2 x 8
    # channels (its value heads g and g + kv_heads / 2 side by side): differential=True with
    # 2 heads, kv_heads / 2 key heads, score_channels=8, and its lambda_init (0.2 at layer 0)
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("diffllama", kv_heads, head_dim=8)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(attention, name).normal_(0.0, 0.5, generator=gen)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.differential and (layer.heads, layer.kv_heads) == (2, kv_heads // 2)
    assert (layer.out_channels, layer.score_channels) == (16, 8)
    assert layer.lambda_init == pytest.approx(0.2) and not layer.diff_norm.weight.requires_grad
    check_causal(attention, rotary, layer, dense, length=12, seed=48)
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        assert_close(getattr(layer, name).grad, getattr(attention, name).grad)
    assert_close(layer.lin_q.weight.grad, attention.q_proj.weight.grad)


@pytest.mark.parametrize("family, config", [
    ("qwen3_next", dict(attention_bias=True)),  # the gate in q_proj, each head's after its query
    ("afmoe", {}),  # a gate_proj
    ("hrm_text", {}),
    ("beam", dict(attention_bias=True)),  # a gate_proj and a bias per head (gate_bias)
    ("minicpm5_moe", dict(attention_bias=True)),  # Qwen3-Next's layout, named q_gate_proj
])
@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_gated_attention(family, config, dense):
    # Qwen3-Next, MiniCPM5-MoE, AFMoE, HRM and Beam multiply each channel of each head's
    # output by a sigmoid gate of the token's features before o_proj: gate="elementwise"
    from graphattn.nn import from_llama

    attention, rotary = hf_attention(family, 2, head_dim=8, **config)
    if family == "beam":
        torch.nn.init.normal_(attention.gate_bias)  # (0 at first)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.gate == "elementwise" and layer.lin_gate.out_features == 32
    check_causal(attention, rotary, layer, dense, length=12, seed=42)
    if family in ("qwen3_next", "minicpm5_moe"):  # the gate rows of head 1: rows 24..31
        fused = getattr(attention, "q_proj", None) or attention.q_gate_proj
        assert_close(layer.lin_gate.weight.grad[8:16], fused.weight.grad[24:32])
        assert_close(layer.lin_gate.bias.grad[8:16], fused.bias.grad[24:32])
    else:
        assert_close(layer.lin_gate.weight.grad, attention.gate_proj.weight.grad)


def test_from_llama_converts_a_gate_bias_without_other_biases():
    # Beam without attention_bias: its gate_bias per head is the one bias; the layer's
    # projections get biases of 0 that stay so (frozen), and the gate's bias trains
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("beam", 2, head_dim=8)
    assert attention.q_proj.bias is None
    torch.nn.init.normal_(attention.gate_bias)
    layer = from_llama(attention, backend="cpu")
    check_causal(attention, rotary, layer, dense=False, length=12, seed=43)
    for lin in (layer.lin_q, layer.lin_k, layer.lin_v, layer.lin_out):
        assert not lin.bias.requires_grad and not lin.bias.any()
    assert_close(layer.lin_gate.bias.grad.view(4, 8).sum(1), attention.gate_bias.grad)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_chameleon_s_gains_of_each_head(dense, kv_heads):
    # Chameleon layer-normalises each head's queries and keys over its channels, with each
    # head's own gains and biases (weight [heads, head_dim]): qk_norm="layer_per_head"
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("chameleon", kv_heads, head_dim=8)
    assert attention.q_norm.weight.shape == (4, 8)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.qk_norm == "layer_per_head" and layer.k_norm.weight.shape == (kv_heads, 8)
    check_causal(attention, rotary, layer, dense, length=12, seed=45)
    for ours, theirs in ((layer.q_norm, attention.q_norm), (layer.k_norm, attention.k_norm)):
        assert_close(ours.weight.grad, theirs.weight.grad)
        assert_close(ours.bias.grad, theirs.bias.grad)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_dory_s_unit_norm_heads(dense):
    # Dory (nGPT's attention): queries and keys projected onto the unit sphere (an RMS norm
    # with gains 1/sqrt(8) and epsilon / 8), each rotated query scaled per head and channel by
    # (sqk * sqk_scale) ** 2 (folded into q_norm's gains, each head its own), a gate of
    # sigmoid(gate_proj(x) * (s_gate * s_gate_scale) ** 2) (folded into lin_gate) and the
    # merged heads projected onto the unit sphere before o_proj (out_norm="rms")
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("dory", 2, head_dim=8)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in (attention.sqk, attention.s_gate):
            param.mul_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert (layer.qk_norm, layer.qk_norm_after_rotary, layer.gate, layer.out_norm) == (
        "rms_per_head", True, "elementwise", "rms")
    assert layer.q_norm.weight.shape == (4, 8) and layer.o_norm.eps == pytest.approx(1e-6 / 32)
    check_causal(attention, rotary, layer, dense, length=12, seed=49)
    unchecked = from_llama(attention, dense=dense, backend="cpu", check=False)
    check_causal(attention, rotary, unchecked, dense, length=12, seed=49)  # (the same order)
    with torch.no_grad():
        attention.sqk.mul_(1.5)  # another query scale: the conversion no longer matches
    with pytest.raises(AssertionError):
        check_causal(attention, rotary, layer, dense, length=12, seed=49)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_bitnet_s_norm_before_the_output_projection(dense):
    # BitNet RMS-normalises the heads' merged output before o_proj (attn_sub_norm, with
    # gains): out_norm="rms" with its gains and epsilon
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("bitnet", 2, head_dim=8)
    torch.nn.init.normal_(attention.attn_sub_norm.weight, 1.0, 0.5)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.out_norm == "rms" and layer.o_norm.eps == attention.attn_sub_norm.variance_epsilon
    check_causal(attention, rotary, layer, dense, length=12, seed=47)
    assert_close(layer.o_norm.weight.grad, attention.attn_sub_norm.weight.grad)
    attention.attn_sub_norm = torch.nn.LayerNorm(32)  # another norm: refused by name
    with pytest.raises(NotImplementedError, match="got attn_sub_norm LayerNorm"):
        from_llama(attention)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_timesfm_s_learned_scale_of_each_query_channel(dense):
    # TimesFM 2.5 RMS-normalises the rotated queries and keys, then scales each query channel
    # by softplus(scaling) log2(e) / sqrt(head_dim), with a score scale of 1: folded into the
    # query norm's gains, with scale=1 and qk_norm_after_rotary=True
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("timesfm2_5", 2, head_dim=8)
    torch.nn.init.normal_(attention.scaling, generator=torch.Generator().manual_seed(5))
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.scale == 1.0 and layer.qk_norm_after_rotary
    check_causal(attention, rotary, layer, dense, length=12, seed=46)
    unchecked = from_llama(attention, dense=dense, backend="cpu", check=False)
    check_causal(attention, rotary, unchecked, dense, length=12, seed=46)  # (the same order)
    with torch.no_grad():
        attention.scaling.add_(1.0)  # another scale: the conversion no longer matches
    with pytest.raises(AssertionError):
        check_causal(attention, rotary, layer, dense, length=12, seed=46)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_a_key_projection_without_a_bias(dense):
    # Voxtral Realtime's text attention (as Whisper's) has biased q_proj, v_proj and o_proj
    # beside a k_proj without a bias: the layer's lin_k gets a bias of 0, frozen, so that the
    # layer trains what the attention trains; the others come over
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("voxtral_realtime", 2, head_dim=8)
    assert attention.k_proj.bias is None and attention.q_proj.bias is not None
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert not layer.lin_k.bias.requires_grad and not layer.lin_k.bias.any()
    check_causal(attention, rotary, layer, dense, length=12, seed=44)
    assert layer.lin_k.bias.grad is None
    for ours, theirs in ((layer.lin_q, attention.q_proj), (layer.lin_v, attention.v_proj),
                         (layer.lin_out, attention.o_proj)):
        assert_close(ours.bias.grad, theirs.bias.grad)
    assert_close(layer.lin_k.weight.grad, attention.k_proj.weight.grad)


@pytest.mark.parametrize("family", ["seed_oss", "modernbert"])
def test_from_llama_converts_a_dropout_of_the_output(family):
    # Seed-OSS drops its attention's output in training (residual_dropout, 0.1 by default),
    # ModernBERT by out_drop (of p = attention_dropout): out_dropout of that p. In eval mode
    # nothing changes (the check passes); in training the layer's output is its eval output
    # with about a tenth of the entries zeroed and the others scaled by 1 / 0.9
    from graphattn.nn import from_llama

    attention, rotary = hf_attention(family, 2 if family == "seed_oss" else 4, head_dim=8)
    if family == "modernbert":
        attention.out_drop = torch.nn.Dropout(0.1)  # (what attention_dropout=0.1 gives it)
    assert attention.training
    layer = from_llama(attention, backend="cpu")
    assert layer.out_dropout == pytest.approx(0.1) and "out_dropout=0.1" in repr(layer)
    x, graph, pos = torch.randn(40, 32), graphs.causal_graph(40), torch.arange(40)
    want = layer.eval()(x, graph, pos=pos)
    torch.manual_seed(0)
    got = layer.train()(x, graph, pos=pos)
    kept = got != 0
    assert 0.8 < kept.float().mean() < 0.97
    assert_close(got[kept], want[kept] / 0.9)
    if family == "seed_oss":  # with the dropout at 0, the same in training mode too
        attention.residual_dropout = 0.0
        check_causal(attention, rotary, from_llama(attention, backend="cpu"), dense=False,
                     length=12, seed=33)


# a small multi-head latent attention: queries through a rank-16 bottleneck, keys and values
# from a latent of 12 channels, each head's key 8 channels of its own and 4 rotated ones that
# all heads share, values of 6 channels
MLA = dict(q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=8,
           v_head_dim=6, head_dim=4, num_hidden_layers=2)
YARN = dict(max_position_embeddings=64, rope_parameters=dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.7))


@pytest.mark.parametrize("family, config", [
    ("deepseek_v3", {}),
    ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, attention_bias=True)),
    ("deepseek_v3", YARN),
    ("deepseek_v2", {}),
    ("minicpm3", {}),
    ("kimi_linear", {}),
    ("longcat_flash", {}),
    ("bailing_hybrid", {}),
], ids=["deepseek_v3", "v3-q_proj-rotate_half-biases", "v3-yarn", "deepseek_v2", "minicpm3",
        "kimi_linear-nope", "longcat_flash-factors", "bailing_hybrid-gate"])
@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_multi_head_latent_attention(family, config, dense):
    # DeepSeek-V2's MLA and the models built on it: q_rank (or q_proj), kv_rank, the rotary
    # key channels shared by the heads; DeepSeek's interleaved rotation or rotate-half, YaRN
    # (its frequencies, factor on the cosines and sines and score scale), Kimi Linear's
    # latent attention without a rotation, LongCat-Flash's factors on the query and the
    # latent (folded into q_b_proj and the latent's gains) and Bailing's sigmoid gate of
    # each head
    from graphattn.nn import LatentKeysValues, from_llama

    attention, rotary = hf_attention(family, 4, **{**MLA, **config})
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert isinstance(layer.lin_k, LatentKeysValues)
    assert (layer.kv_rank, layer.shared_key_channels, layer.score_channels,
            layer.out_channels) == (12, 4, 12, 6)
    assert layer.q_rank == config.get("q_lora_rank", 16)
    assert (layer.rotary is None) == (family == "kimi_linear")
    assert (layer.gate == "headwise") == (family == "bailing_hybrid")
    check_causal(attention, rotary, layer, dense, length=40 if config is YARN else 20,
                 seed=50)
    assert_close(layer.lin_k.down.weight.grad, attention.kv_a_proj_with_mqa.weight.grad)
    assert_close(layer.lin_k.up.weight.grad, attention.kv_b_proj.weight.grad)
    assert_close(layer.lin_out.weight.grad, attention.o_proj.weight.grad)


# DeepSeek's sparse attention: each token keeps the 5 keys its indexer scores highest, of
# up to 20 here (16 indexer heads, so that a score of exactly 0, where every head's ReLU is 0,
# and with it a tie that torch.topk breaks its own way, is unlikely)
DSA = dict(MLA, index_topk=5, index_n_heads=16, index_head_dim=8)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa", "hy_v4"])
def test_from_llama_converts_deepseek_sparse_attention(family):
    # the latent attention over the subgraph of the causal graph that its indexer picks
    # (GraphSelfAttention(indexer=LightningIndexer(...))): the indexer's rotation is
    # DeepSeek-V3.2's rotate-half on its first channels, GLM-MoE-DSA's interleaved, HunYuan
    # V4's interleaved on its last channels (reordered first); HunYuan V4 also has a gate of
    # each channel and a sink per head. Outputs and gradients on 20 tokens; the check itself
    # keeps 4 keys per token, whatever the model's index_topk
    from graphattn import graphs
    from graphattn.nn import LightningIndexer, from_llama

    attention, rotary = hf_attention(family, 4, **DSA)
    if family == "hy_v4":
        torch.nn.init.normal_(attention.sinks)  # (made by torch.empty)
    layer = from_llama(attention, backend="cpu")
    indexer = layer.indexer
    assert isinstance(indexer, LightningIndexer) and indexer.top_k == 5
    assert indexer.rotary.interleaved == (family != "deepseek_v32")
    wk = attention.indexer.wk.weight
    assert torch.equal(indexer.lin_k.weight, torch.cat([wk[4:], wk[:4]]) if family == "hy_v4"
                       else wk)
    assert (layer.sinks is not None, layer.gate) == (
        (True, "elementwise") if family == "hy_v4" else (False, None))
    check_causal(attention, rotary, layer, dense=False, length=20, seed=51)
    assert indexer.lin_q.weight.grad is None  # (the choice of edges takes no gradient)
    _, (edges, _) = layer(torch.randn(20, 32), graphs.causal_graph(20), pos=torch.arange(20),
                          return_attention_weights=True)
    assert torch.equal(torch.bincount(edges[1]), torch.arange(1, 21).clamp(max=5))
    dense = from_llama(attention, dense=True)  # (each query's top 5 keys as a mask)
    check_causal(attention, rotary, dense, dense=True, length=20, seed=51)


def test_from_llama_picks_the_indexer_s_rotation_with_few_keys_kept():
    # a model keeping more keys than the check has tokens: the check keeps 4 per token, so
    # that the indexer's rotation is found (GLM-MoE-DSA's interleaved one) and the model's
    # index_topk is the layer's again afterwards
    from graphattn.nn import from_llama

    attention, _ = hf_attention("glm_moe_dsa", 4, **{**DSA, "index_topk": 64})
    layer = from_llama(attention)
    assert layer.indexer.rotary.interleaved and layer.indexer.top_k == 64
    assert attention.indexer.index_topk == 64


@pytest.mark.parametrize("family, config, match", [
    ("jetmoe", dict(head_dim=8), "JetMoeAttention routes each token's queries and outputs "
                                 "through experts"),
    ("hy_v4", {**DSA, "num_hidden_layers": 4, "layer_idx": 2},
     "HYV4Attention \\(layer 2\\) has no indexer of its own"),
])
def test_from_llama_refuses_attention_experts_and_what_it_does_not_hold(family, config, match):
    # the attentions it refuses, each saying what it has that the layers have not: JetMoE's
    # mixture of attention heads; HunYuan V4's layers
    # that attend over the keys an earlier layer's indexer picked
    from graphattn.nn import from_llama

    config = {"num_hidden_layers": 2, **config}
    layer_idx = config.pop("layer_idx", 0)
    attention, _ = hf_attention(family, 4 if family != "jetmoe" else 2, layer_idx, **config)
    with pytest.raises(NotImplementedError, match=match):
        from_llama(attention)


def test_from_llama_refuses_what_its_check_cannot_run():
    from graphattn.nn import from_llama

    attention = hf_attention("llama", 2)[0]
    attention.__class__ = type("LlamaAttention", (type(attention),),
                               {"__module__": __name__})
    with pytest.raises(NotImplementedError, match="from_llama could not run LlamaAttention to "
                       "check the conversion \\(LookupError: the module .* holds no "
                       "\\*RotaryEmbedding class"):
        from_llama(attention)
    assert from_llama(attention, check=False).rotary is not None
    with pytest.raises(TypeError, match="check must be a bool"):
        from_llama(hf_attention("llama", 2)[0], check="yes")


def _every_rotary_attention():
    """Each self-attention class of the installed transformers that has a rotary embedding
    class beside it (text attentions; vision and audio ones left out), with the module."""
    import importlib
    import pkgutil
    import warnings

    models = pytest.importorskip("transformers.models", reason="needs transformers")
    for info in pkgutil.iter_modules(models.__path__):
        try:
            with warnings.catch_warnings():  # (what some models' imports say of torch.jit)
                warnings.simplefilter("ignore")
                module = importlib.import_module(f"transformers.models.{info.name}.modeling_"
                                                 f"{info.name}")
        except Exception:  # a model whose optional dependencies are missing
            continue
        for name, value in sorted(vars(module).items()):
            if (name.endswith("Attention") and isinstance(value, type)
                    and "Vision" not in name and "Audio" not in name
                    and any(other.endswith("RotaryEmbedding") for other in vars(module))):
                yield module, value


def _sweep_attention(cls, config_cls, rotary_cls, extra: dict):
    """``cls`` built from the sweep's small config (with ``extra``) and its rotary embedding,
    after one run of the attention (which raises where the config or call does not fit)."""
    config = config_cls(**{"hidden_size": 32, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 8, "num_hidden_layers": 2,
                           "attention_dropout": 0.0, "intermediate_size": 64, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attention = cls(config, layer_idx=0).eval()  # (dropouts: tested apart)
    for lin in (getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj",
                                                             "o_proj")):
        if isinstance(lin, torch.nn.Linear) and lin.bias is not None:
            torch.nn.init.normal_(lin.bias)
    for name in ("sinks", "scaling"):  # (GPT-OSS's sinks, TimesFM 2.5's scale: made by
        if isinstance(getattr(attention, name, None), torch.Tensor):  # torch.empty, any value)
            torch.nn.init.normal_(getattr(attention, name))
    rotary = rotary_cls(config)
    x = torch.randn(1, 16, 32)
    run_llama(attention, rotary, x, torch.arange(16)[None], x)
    return attention, rotary


def test_from_llama_converts_exactly_or_refuses_every_model():
    # Every transformers attention built like LLaMA that runs from a small config: its
    # conversion computes what it computes (outputs and the input's gradient on 16
    # consecutive positions, other tokens than the check's), or from_llama refuses it by name.
    # None may convert into something else. (Attentions that do not build or run from this
    # generic config are passed over.)
    import transformers

    from graphattn.nn import from_llama

    converted, refused, mismatched = [], [], []
    for module, cls in _every_rotary_attention():
        prefix = cls.__name__.removesuffix("Attention").removesuffix("Text")
        config_cls = (getattr(transformers, f"{prefix}TextConfig", None)
                      or getattr(transformers, f"{prefix}Config", None))
        rotaries = [value for name, value in vars(module).items()
                    if name.endswith("RotaryEmbedding") and name.startswith(prefix)]
        if config_cls is None or len(rotaries) != 1:
            continue
        attention = rotary = None
        for extra in ({}, {**MLA, "num_key_value_heads": 4}):  # (a latent attention's sizes)
            try:
                attention, rotary = _sweep_attention(cls, config_cls, rotaries[0], extra)
                break
            except Exception:  # this generic config or call does not fit the model
                continue
        if attention is None:
            continue
        try:
            layer = from_llama(attention, backend="reference")
        except (NotImplementedError, ValueError, TypeError):
            refused.append(cls.__name__)
            continue
        try:
            check_causal(attention, rotary, layer, dense=False, length=16, seed=32)
            converted.append(cls.__name__)
        except AssertionError:
            mismatched.append(cls.__name__)
    assert not mismatched, mismatched
    assert len(converted) >= 20 and "LlamaAttention" in converted, (converted, refused)
    print(f"{len(converted)} converted, {len(refused)} refused: {', '.join(refused)}")


GEMMA3 = dict(head_dim=8, query_pre_attn_scalar=24, num_hidden_layers=2, sliding_window=4,
              layer_types=["sliding_attention", "full_attention"], rope_parameters={
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_gemma3(layer_idx, dense):
    # Gemma 3: QK-norm whose gains are 1 + weight, scores scaled by query_pre_attn_scalar **
    # -0.5 instead of head_dim ** -0.5, and a rotary embedding per kind of layer (the local
    # layers' base 10,000, the global layers' 1e6 with linear interpolation by 8)
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("gemma3", 2, layer_idx, **GEMMA3)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.scale == pytest.approx(24 ** -0.5) and layer.qk_norm == "rms"
    assert_close(layer.q_norm.weight.detach(), 1 + attention.q_norm.weight.detach())
    assert (layer.rotary.base, layer.rotary.frequencies is None) == (
        (10000.0, True) if layer_idx == 0 else (1e6, False))
    check_causal(attention, rotary, layer, dense, length=14, seed=25)
    assert_close(layer.k_norm.weight.grad, attention.k_norm.weight.grad)


GEMMA2 = dict(head_dim=8, query_pre_attn_scalar=24, attn_logit_softcapping=0.5,
              num_hidden_layers=2, sliding_window=4,
              layer_types=["sliding_attention", "full_attention"])


@pytest.mark.parametrize("backend", ["cpu", "reference", "dense"])
def test_from_llama_converts_gemma2_soft_cap(backend):
    # Gemma 2 caps its scores at c tanh(s / c), after the scale and before the mask: here
    # c = 0.5, small enough that the cap changes the output (checked below; its models use 50)
    from graphattn.nn import from_llama

    dense = backend == "dense"
    attention, rotary = hf_attention("gemma2", 2, **GEMMA2)
    layer = from_llama(attention, dense=dense, backend="auto" if dense else backend)
    assert layer.softcap == 0.5 and layer.scale == pytest.approx(24 ** -0.5)
    x, want = check_causal(attention, rotary, layer, dense, length=14, seed=26)
    assert_close(layer.lin_q.weight.grad, attention.q_proj.weight.grad)
    layer.softcap = None
    with torch.no_grad():
        uncapped = (layer(x, is_causal=True) if dense
                    else layer(x[0], graphs.causal_graph(14), pos=torch.arange(14))[None])
    assert (uncapped - want).abs().max() > 1e-2


PHI3 = dict(max_position_embeddings=64, original_max_position_embeddings=16, pad_token_id=0,
            rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                 short_factor=[1.0, 1.5, 2.0, 3.0],
                                 long_factor=[2.0, 4.0, 8.0, 16.0],
                                 original_max_position_embeddings=16))


@pytest.mark.parametrize("length", [12, 40], ids=["short", "long"])
@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_phi3_longrope(length, dense):
    # Phi-3: one fused qkv_proj, and LongRoPE, whose frequencies are the short set for a
    # sequence within the trained 16 positions and the long set past them, with a factor on
    # the cosines and sines
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("phi3", 2, **PHI3)
    layer = from_llama(attention, dense=dense, backend="cpu")
    assert layer.rotary.original_length == 16 and layer.rotary.attention_factor > 1
    x, want = check_causal(attention, rotary, layer, dense, length, seed=26)
    assert_close(layer.lin_k.weight.grad, attention.qkv_proj.weight.grad[32:48])
    # the short set alone computes another function past the trained length
    layer.rotary = pe.RotaryPE(8, frequencies=layer.rotary.frequencies,
                               attention_factor=layer.rotary.attention_factor)
    short = (layer(x, is_causal=True) if dense
             else layer(x[0], graphs.causal_graph(length), pos=torch.arange(length))[None])
    assert torch.allclose(short, want, atol=1e-4) == (length <= 16)


def test_long_frequencies_replace_the_frequencies_past_the_trained_length():
    # within original_length the frequencies, past it the long ones, for all positions of the
    # call (and of a query and key pair together)
    gen = torch.Generator().manual_seed(35)
    short, long = torch.tensor([1.0, 0.1, 0.01, 0.001]), torch.tensor([0.5, 0.05, 0.004, 3e-4])
    rope = pe.RotaryPE(8, frequencies=short, long_frequencies=long, original_length=10)
    x = torch.randn(12, 2, 8, dtype=torch.float64, generator=gen)
    pos = torch.arange(12)
    assert_close(rope(x[:10], pos[:10]), pe.RotaryPE(8, frequencies=short)(x[:10], pos[:10]))
    assert_close(rope(x, pos), pe.RotaryPE(8, frequencies=long)(x, pos))
    q, k = rope.rotate_pair(x[:3], x, pos[:3], pos)  # the keys reach past 10: both long
    assert_close(q, pe.RotaryPE(8, frequencies=long)(x[:3], pos[:3]))
    assert_close(pe.apply_rotary(x, pos, frequencies=short, long_frequencies=long,
                                 original_length=10), rope(x, pos))
    assert repr(rope) == ("RotaryPE(8, frequencies=[...], long_frequencies=[...], "
                          "original_length=10)")
    assert "long_frequencies" not in GraphSelfAttention(8, 8, rotary=rope).state_dict()
    with pytest.raises(ValueError, match="long_frequencies needs original_length"):
        pe.RotaryPE(8, long_frequencies=long)
    with pytest.raises(ValueError, match="give ntk_factor or long_frequencies, not both"):
        pe.RotaryPE(8, long_frequencies=long, ntk_factor=2.0, original_length=10)
    with pytest.raises(ValueError, match=r"long_frequencies must be a real tensor"):
        pe.RotaryPE(8, long_frequencies=long[:3], original_length=10)


def test_packed_sequences_of_other_lengths_are_llama_on_each():
    # sequences of 5, 9 and 3 tokens packed into one tensor, without padding: the dense
    # layer's batch= with is_causal=True, and the graph layer on each sequence's causal graph
    # side by side, both with each token's position in its own sequence, are LLaMA's
    # attention on each sequence alone
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("llama", 2)
    graph, dense = from_llama(attention), from_llama(attention, dense=True)
    lengths = [5, 9, 3]
    seq = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))  # (17,)
    pos = torch.cat([torch.arange(n) for n in lengths])  # position within its sequence
    starts = [0, 5, 14]
    causal = torch.cat([graphs.causal_graph(n) + s for n, s in zip(lengths, starts,
                                                                     strict=True)], dim=1)
    x = torch.randn(17, 32, generator=torch.Generator().manual_seed(19))
    want = torch.cat([run_llama(attention, rotary, x[s:s + n][None], torch.arange(n)[None],
                                torch.zeros(1, n, 32))[0][0]
                      for n, s in zip(lengths, starts, strict=True)])
    with torch.no_grad():
        assert_close(dense(x, batch=seq, is_causal=True, pos=pos), want)
        assert_close(graph(x, causal, pos=pos), want)


LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=8192)


YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                 original_max_position_embeddings=512)


@pytest.mark.parametrize("rope", [
    LLAMA3_ROPE, dict(rope_type="linear", rope_theta=10000.0, factor=4.0), YARN_ROPE,
], ids=["llama3", "linear", "yarn"])
def test_from_llama_takes_rescaled_rope_frequencies(rope):
    # LLaMA 3's frequencies (the low ones divided by 8, a smooth band between), linear
    # position interpolation and YaRN (a ramp, and a factor on the cosines and sines): the
    # converted layer holds transformers' frequencies and computes its attention at positions
    # far from 0, where a wrong low frequency would show
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("llama", 2, rope_parameters=rope)
    layer = from_llama(attention, backend="cpu")
    assert layer.rotary.frequencies is not None
    assert (layer.rotary.attention_factor != 1.0) == (rope["rope_type"] == "yarn")
    plain = pe.RotaryPE(8, base=rope["rope_theta"])
    assert not torch.allclose(layer.rotary.frequencies.float(),
                              _rotary_frequencies(plain, 4), rtol=1e-3)
    L, start = 16, 20000
    x = torch.randn(1, L, 32, generator=torch.Generator().manual_seed(20))
    w = torch.randn(1, L, 32, generator=torch.Generator().manual_seed(21))
    want, want_grad = run_llama(attention, rotary, x, torch.arange(L)[None] + start, w)
    x_in = x[0].clone().requires_grad_(True)
    out = layer(x_in, graphs.causal_graph(L), pos=torch.arange(L) + start)
    (out * w[0]).sum().backward()
    assert_close(out.detach(), want[0])
    assert_close(x_in.grad, want_grad[0])
    # the layer without them (base alone) computes another function there
    layer.rotary = plain
    assert not torch.allclose(layer(x[0], graphs.causal_graph(L), pos=torch.arange(L) + start),
                              want[0], atol=1e-4)


def _rotary_frequencies(rope: pe.RotaryPE, planes: int) -> torch.Tensor:
    """The frequencies a RotaryPE without explicit ones turns its planes by, read back from
    the rotation of unit vectors at position 1."""
    x = torch.zeros(1, planes, 2 * planes, dtype=torch.float64)
    x[0, torch.arange(planes), torch.arange(planes)] = 1.0  # head m: plane m's first channel
    rotated = rope(x, torch.ones(1))[0]  # (planes, 2 planes)
    angle = torch.atan2(rotated[torch.arange(planes), torch.arange(planes) + planes],
                        rotated[torch.arange(planes), torch.arange(planes)])
    return angle.float()


def test_rotary_frequencies_replace_the_base():
    # explicit frequencies turn each plane by theta_m * p: the base's own frequencies given
    # explicitly compute what the base computes, other ones another rotation
    base = pe.RotaryPE(8, base=100.0)
    theta = 100.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    explicit = pe.RotaryPE(8, frequencies=theta)
    x = torch.randn(6, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(22))
    pos = torch.arange(6) * 7
    assert_close(explicit(x, pos), base(x, pos))
    assert_close(_rotary_frequencies(base, 4), theta.float())
    halved = pe.RotaryPE(8, frequencies=theta / 2)
    assert_close(halved(x, pos), base(x, pos // 7 * 7 / 2))  # theta / 2 at p = theta at p / 2
    assert "frequencies" not in GraphSelfAttention(8, 8, rotary=explicit).state_dict()
    assert repr(explicit) == "RotaryPE(8, frequencies=[...])"
    with pytest.raises(ValueError, match="frequencies must be a real tensor"):
        pe.RotaryPE(8, frequencies=theta[:3])
    with pytest.raises(ValueError, match="frequencies must be finite"):
        pe.apply_rotary(x, pos, frequencies=torch.tensor([1.0, float("nan"), 1.0, 1.0]))


@pytest.mark.parametrize("axes, interleaved", [(1, False), (2, True)])
def test_rotary_gradients_pass_gradcheck_also_for_real_positions(axes, interleaved):
    # the rotation is differentiable in x and in real positions (learned coordinates)
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(5, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    shape = (5,) if axes == 1 else (5, axes)
    pos = (torch.randn(shape, dtype=torch.float64, generator=gen) * 3).requires_grad_(True)
    rope = pe.RotaryPE(8, axes=axes, base=50.0, interleaved=interleaved)
    assert torch.autograd.gradcheck(rope, (x, pos))


# ---- longer contexts: YaRN, dynamic NTK scaling, the factor on the cosines and sines ------


@pytest.mark.parametrize("dim, factor, original, base, beta_fast, beta_slow", [
    (64, 4.0, 4096, 10000.0, 32.0, 1.0),
    (128, 8.0, 32768, 1e6, 32.0, 1.0),
    (32, 2.5, 2048, 500000.0, 16.0, 2.0),
    (16, 16.0, 64, 10000.0, 32.0, 1.0),  # a short context: the ramp starts at plane 0
])
def test_yarn_is_transformers_yarn(dim, factor, original, base, beta_fast, beta_slow):
    transformers_module("llama.modeling_llama")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=4 * dim, num_attention_heads=4, head_dim=dim,
                         max_position_embeddings=int(original * factor),
                         rope_parameters=dict(rope_type="yarn", rope_theta=base, factor=factor,
                                              original_max_position_embeddings=original,
                                              beta_fast=beta_fast, beta_slow=beta_slow))
    frequencies, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = pe.RotaryPE.yarn(dim, factor, original, base=base, beta_fast=beta_fast,
                            beta_slow=beta_slow)
    assert_close(rope.frequencies.float(), frequencies, rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)


def test_yarn_keeps_fast_planes_and_interpolates_slow_ones():
    # planes that turn more than beta_fast times over the trained positions keep their
    # frequency, planes that turn less than beta_slow times turn s times slower, and the
    # frequencies fall monotonically between; factor 1 is the plain embedding
    dim, s, original = 64, 8.0, 2048
    theta = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    turns = original * theta / (2 * torch.pi)
    got = pe.RotaryPE.yarn(dim, s, original).frequencies
    fast, slow = turns > 32, turns < 1
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    assert_close(got[fast], theta[fast])
    assert_close(got[slow], theta[slow] / s)
    assert (got <= theta * (1 + 1e-12)).all() and (got >= theta / s * (1 - 1e-12)).all()
    assert (got.diff() < 0).all()
    plain = pe.RotaryPE.yarn(dim, 1.0, original)
    assert_close(plain.frequencies, theta) and plain.attention_factor == 1.0
    # the default temperature, and one given
    assert pe.RotaryPE.yarn(dim, s, original).attention_factor == pytest.approx(
        0.1 * torch.log(torch.tensor(s)).item() + 1)
    assert pe.RotaryPE.yarn(dim, s, original, attention_factor=1.5).attention_factor == 1.5


def test_attention_factor_scales_the_rotated_channels_only():
    # a factor f on the cosines and sines: the rotated channels times f, the others unchanged,
    # so that a rotated query and key score f ** 2 times as much over the rotated channels
    gen = torch.Generator().manual_seed(30)
    x = torch.randn(7, 2, 12, dtype=torch.float64, generator=gen)
    pos = torch.arange(7) * 3
    plain = pe.apply_rotary(x, pos, dim=8)
    scaled = pe.apply_rotary(x, pos, dim=8, attention_factor=1.25)
    assert_close(scaled[..., :8], 1.25 * plain[..., :8])
    assert torch.equal(scaled[..., 8:], x[..., 8:])
    rope = pe.RotaryPE(8, attention_factor=1.25)
    q, k = rope.rotate_pair(x, x.flip(0), pos, pos)
    assert_close(q, scaled)
    assert_close(k, pe.apply_rotary(x.flip(0), pos, dim=8, attention_factor=1.25))
    assert repr(rope) == "RotaryPE(8, attention_factor=1.25)"


def _dynamic_frequencies(dim: int, base: float, factor: float, original: int,
                         length: int) -> torch.Tensor:
    """Dynamic NTK's frequencies for a call whose positions run to length - 1, in float64."""
    length = max(length, original)
    grown = base * (factor * length / original - (factor - 1)) ** (dim / (dim - 2))
    return grown ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)


@pytest.mark.parametrize("length", [10, 16, 17, 40])
def test_dynamic_ntk_grows_the_base_past_the_trained_length(length):
    # positions within the trained length: the plain embedding, bit for bit; past it, the
    # base grown by (s L / L0 - (s - 1)) ** (g / (g - 2)) for the call's largest position
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(length, 2, 8, dtype=torch.float64, generator=gen)
    pos = torch.randperm(length, generator=gen)
    dynamic = pe.RotaryPE(8, base=100.0, ntk_factor=2.0, original_length=16)
    want = pe.RotaryPE(8, frequencies=_dynamic_frequencies(8, 100.0, 2.0, 16, length))
    assert_close(dynamic(x, pos), want(x, pos))
    if length <= 16:
        assert torch.equal(dynamic(x, pos), pe.RotaryPE(8, base=100.0)(x, pos))
    else:
        assert not torch.allclose(dynamic(x, pos), pe.RotaryPE(8, base=100.0)(x, pos))
    assert repr(dynamic) == "RotaryPE(8, base=100.0, ntk_factor=2, original_length=16)"


def test_dynamic_ntk_set_after_construction_takes_effect():
    """``ntk_factor`` and ``original_length`` are attributes, as ``base`` is: set on a built
    RotaryPE they act as they do given to the constructor, and are checked as it checks them."""
    gen = torch.Generator().manual_seed(33)
    x = torch.randn(40, 2, 8, dtype=torch.float64, generator=gen)
    pos = torch.arange(40)
    rotary = pe.RotaryPE(8, ntk_factor=2.0, original_length=16)
    rotary.ntk_factor = 8.0
    assert torch.equal(rotary(x, pos), pe.RotaryPE(8, ntk_factor=8.0, original_length=16)(x, pos))
    rotary.original_length = 32
    assert torch.equal(rotary(x, pos), pe.RotaryPE(8, ntk_factor=8.0, original_length=32)(x, pos))
    rotary.ntk_factor = 0.5
    with pytest.raises(ValueError, match=r"ntk_factor must be a number >= 1, got 0.5"):
        rotary(x, pos)


def test_dynamic_ntk_axial_and_in_the_layer():
    # 2-D positions: each axis' group grows its base by the largest coordinate of either
    # axis; the layer's shared angles (rotate_pair) give what rotating q and k apart gives
    gen = torch.Generator().manual_seed(32)
    pos = torch.randint(0, 30, (12, 2), generator=gen)
    x = torch.randn(12, 2, 16, dtype=torch.float64, generator=gen)
    dynamic = pe.RotaryPE(16, axes=2, ntk_factor=3.0, original_length=10)
    length = int(pos.max()) + 1
    want = pe.RotaryPE(16, axes=2, frequencies=_dynamic_frequencies(8, 1e4, 3.0, 10, length))
    assert_close(dynamic(x, pos), want(x, pos))
    q, k = dynamic.rotate_pair(x, x * 2, pos, pos)
    assert_close(q, dynamic(x, pos)) and assert_close(k, dynamic(x * 2, pos))


def test_dynamic_ntk_rotates_a_bipartite_pair_by_one_set_of_frequencies():
    # queries and keys at positions of their own (a bipartite layer): both take the
    # frequencies of the largest position of either, so that the scores stay relative, the
    # same when all positions move together (within the trained length's frequencies)
    gen = torch.Generator().manual_seed(34)
    q, k = (torch.randn(n, 2, 8, dtype=torch.float64, generator=gen) for n in (5, 9))
    pos_q, pos_k = torch.arange(5) + 30, torch.arange(9) * 2
    dynamic = pe.RotaryPE(8, ntk_factor=4.0, original_length=16)
    want = pe.RotaryPE(8, frequencies=_dynamic_frequencies(8, 1e4, 4.0, 16, 35))
    got_q, got_k = dynamic.rotate_pair(q, k, pos_q, pos_k)
    assert_close(got_q, want(q, pos_q)) and assert_close(got_k, want(k, pos_k))
    layer = GraphSelfAttention((6, 6), 8, 2, add_self_loops=False, rotary=dynamic).double()
    x = (torch.randn(9, 6, dtype=torch.float64, generator=gen),
         torch.randn(5, 6, dtype=torch.float64, generator=gen))
    edges = torch.stack([torch.randint(0, 9, (20,), generator=gen),
                         torch.randint(0, 5, (20,), generator=gen)])
    out = layer(x, edges, pos=(pos_k, pos_q))
    layer.rotary = want
    assert_close(out, layer(x, edges, pos=(pos_k, pos_q)))


@pytest.mark.parametrize("length", [12, 40, 100])
def test_from_llama_takes_dynamic_ntk_scaling(length):
    # Hugging Face's "dynamic" RoPE on a fresh model (no longer sequence seen before) computes
    # each length's frequencies as the converted layer does, within and past the trained 16
    from graphattn.nn import from_llama

    rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    attention, rotary = hf_attention("llama", 2, rope_parameters=rope,
                                     max_position_embeddings=16)
    layer = from_llama(attention, backend="cpu")
    assert (layer.rotary.ntk_factor, layer.rotary.original_length) == (2.0, 16)
    x, want = check_causal(attention, rotary, layer, False, length, seed=33)
    # past the trained length, the base's frequencies alone compute another function
    layer.rotary = pe.RotaryPE(8)
    plain = layer(x[0], graphs.causal_graph(length), pos=torch.arange(length))
    assert torch.allclose(plain, want[0], atol=1e-4) == (length <= 16)


def test_from_llama_names_a_dynamic_factor_below_1_by_its_config_key():
    """RotaryPE refused it by its own argument, ntk_factor, which the caller never gave."""
    from graphattn.nn import from_llama

    rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=0.5)
    attention, _ = hf_attention("llama", 2, rope_parameters=rope, max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"the config's rope factor must be >= 1, got "
                                         r"rope_parameters\['factor'\]=0.5"):
        from_llama(attention)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(attention_factor=0.0), ValueError, "attention_factor must be a positive number"),
    (dict(attention_factor=float("inf")), ValueError, "attention_factor must be a finite"),
    (dict(ntk_factor=2.0), ValueError, "ntk_factor needs original_length"),
    (dict(original_length=16), ValueError, "original_length=16 is read by dynamic NTK"),
    (dict(ntk_factor=0.5, original_length=16), ValueError, "ntk_factor must be a number >= 1"),
    (dict(ntk_factor=2.0, original_length=0), ValueError, "original_length must be a positive"),
    (dict(ntk_factor=2.0, original_length=16, frequencies=torch.ones(4)), ValueError,
     "give frequencies or ntk_factor, not both"),
    (dict(ntk_factor=2.0, original_length=16, axes=4), ValueError,
     "more than 2 rotated channels per axis"),
])
def test_long_context_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        pe.RotaryPE(8, **kwargs)
    x = torch.randn(4, 1, 8)
    with pytest.raises(error, match=match):
        pe.apply_rotary(x, torch.arange(4), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(factor=0.5), "factor must be a number >= 1"),
    (dict(original_length=-3), "original_length must be a positive integer"),
    (dict(beta_fast=1.0, beta_slow=2.0), "0 < beta_slow <= beta_fast"),
    (dict(base=-1.0), "base must be a positive number"),
    (dict(base=1.0), "yarn needs base > 1"),
    (dict(dim=7), r"dim must be a multiple of 2 \* axes = 2 .*, got dim=7"),  # (a size clash)
    (dict(dim=6, axes=2), r"dim must be a multiple of 2 \* axes = 4 .*, got dim=6"),
])
def test_yarn_arguments_are_checked(kwargs, match):
    args = dict(dim=8, factor=4.0, original_length=64) | kwargs
    with pytest.raises(ValueError, match=match):
        pe.RotaryPE.yarn(**args)


def test_frequencies_keep_their_dtype_when_the_model_is_cast_to_bf16():
    # from_llama of a bf16 model: the converted frequencies stay float64 (rounded to bf16 they
    # would turn position 20,000 by radians too far), so that the bf16 layer computes what
    # the bf16 attention computes with transformers' float32 rotary embedding
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("llama", 2, rope_parameters=LLAMA3_ROPE)
    attention = attention.to(torch.bfloat16)
    layer = from_llama(attention, backend="cpu")
    assert layer.lin_q.weight.dtype == torch.bfloat16
    assert layer.rotary.frequencies.dtype == torch.float64
    L, start = 12, 20000
    x = torch.randn(1, L, 32, generator=torch.Generator().manual_seed(27)).to(torch.bfloat16)
    mask = torch.full((L, L), float("-inf")).triu(1)[None, None].to(torch.bfloat16)
    with torch.no_grad():
        want = attention(x, position_embeddings=rotary(x, torch.arange(L)[None] + start),
                         attention_mask=mask)[0]
        got = layer(x[0], graphs.causal_graph(L), pos=torch.arange(L) + start)
    assert_close(got.float(), want[0].float(), atol=0.05, rtol=0.05)
    layer.rotary.to(torch.float32)  # a float32 cast keeps them too; .to(device) moves them
    assert layer.rotary.frequencies.dtype == torch.float64


def test_a_cast_module_rotates_as_before():
    # cast to bf16 (and back to float32), the module rotates float32 queries at position
    # 20,000 by the same angles, bit for bit; rounded to bf16, frequency 0.1 would be off by
    # up to 2e-4, 4 radians there
    import copy

    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    rope = pe.RotaryPE(8, frequencies=theta, long_frequencies=theta / 4, original_length=30000)
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(28))
    cast = copy.deepcopy(rope).to(torch.bfloat16).float()
    for pos in (torch.arange(6) + 20000, torch.arange(6) + 40000):  # short set, then long
        assert torch.equal(cast(x, pos), rope(x, pos))
    pos = torch.arange(6) + 20000  # what rounding the frequencies would have done
    rounded = pe.RotaryPE(8, frequencies=theta.to(torch.bfloat16).double())
    assert not torch.allclose(rounded(x, pos), pe.RotaryPE(8, frequencies=theta)(x, pos),
                              atol=0.1)


def test_a_sliding_window_of_w_is_the_window_graph_of_radius_w_minus_1():
    # transformers' sliding window w keeps the keys i - w < j <= i: the causal window graph of
    # radius w - 1; Gemma 3's local layer converted and run on it is that layer with the mask
    from graphattn.nn import from_llama

    masking = pytest.importorskip("transformers.masking_utils",
                                  reason="the sliding-window mask comes from transformers")
    L, w = 16, GEMMA3["sliding_window"]
    keep = masking.sliding_window_causal_mask_function(w)
    rows = torch.arange(L)
    mask = keep(0, 0, rows[:, None], rows[None, :])  # (L, L): query i may see key j
    window = graphs.window_graph(L, w - 1, causal=True)
    assert torch.equal(mask, graphs.to_dense_mask(window, L))
    attention, rotary = hf_attention("gemma3", 2, 0, **GEMMA3)
    assert attention.sliding_window == w
    layer = from_llama(attention)
    x = torch.randn(1, L, 32, generator=torch.Generator().manual_seed(29))
    bias = torch.zeros(L, L).masked_fill(~mask, float("-inf"))[None, None]
    with torch.no_grad():
        pos = torch.arange(L)[None]
        want = attention(x, position_embeddings=rotary(x, pos, layer_type="sliding_attention"),
                         attention_mask=bias)[0]
        assert_close(layer(x[0], window, pos=pos[0]), want[0])


MISTRAL4 = {**MLA, "head_dim": 12, "rope_parameters": dict(
    rope_type="yarn", rope_theta=10000.0, partial_rotary_factor=1 / 3, factor=4.0,
    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.4,
    original_max_position_embeddings=3)}


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_from_llama_converts_mistral4_query_scale(dense):
    # Mistral 4's latent attention scales its queries by 1 + beta log(1 + floor(p /
    # original_max_position_embeddings)): query_temperature (original_max_position_embeddings
    # 3, so that the 14 positions take five steps)
    from graphattn.nn import from_llama

    attention, rotary = hf_attention("mistral4", 4, **MISTRAL4)
    layer = from_llama(attention, dense=dense)
    temperature = layer.query_temperature
    assert (temperature.beta, temperature.length, temperature.offset) == (0.4, 3.0, 0.0)
    check_without_temperature(attention, rotary, layer, dense, length=14)


@pytest.mark.parametrize("rotary", [None, 8], ids=["no-rotary", "rotary"])
def test_query_temperature_on_the_graph_is_the_dense_layer_s(rotary):
    # the graph layer on the causal graph and its dense twin with is_causal, at positions
    # from 5: outputs and gradients
    temperature = pe.QueryTemperature(0.7, 3, offset=1)
    torch.manual_seed(0)
    rotation = None if rotary is None else pe.RotaryPE(rotary)
    graph = GraphSelfAttention(16, 8, heads=2, kv_heads=1, rotary=rotation, backend="cpu",
                               query_temperature=temperature, add_self_loops=False)
    dense = DenseSelfAttention(16, 8, heads=2, kv_heads=1, rotary=rotation,
                               query_temperature=temperature)
    dense.load_state_dict(graph.state_dict())
    assert "query_temperature=QueryTemperature(beta=0.7, length=3, offset=1)" in repr(graph)
    assert "query_temperature=QueryTemperature(beta=0.7, length=3, offset=1)" in repr(dense)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(5, 17)
    outs, grads = [], []
    for call in (lambda x: graph(x, graphs.causal_graph(12), pos=pos),
                 lambda x: dense(x, is_causal=True, pos=pos)):
        x_in = x.clone().requires_grad_(True)
        out = call(x_in)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append(x_in.grad)
    assert_close(*outs)
    assert_close(*grads)


def test_query_temperature_multiplies_the_queries():
    # with bias-free projections, the factor on the targets' queries is the factor on their
    # features: the layer with it on (x_src, x_dst) is the layer without it on (x_src,
    # t * x_dst), given the targets' positions
    temperature = pe.QueryTemperature(1.5, 2)
    torch.manual_seed(0)
    layer = GraphSelfAttention(16, 8, heads=2, bias=False, add_self_loops=False,
                               query_temperature=temperature, backend="reference")
    gen = torch.Generator().manual_seed(2)
    x_src, x_dst = torch.randn(7, 16, generator=gen), torch.randn(9, 16, generator=gen)
    pos_src, pos_dst = torch.arange(7), torch.arange(3, 12)
    edge_index = torch.stack([torch.randint(0, 7, (30,), generator=gen),
                              torch.randint(0, 9, (30,), generator=gen)])
    got = layer((x_src, x_dst), edge_index, pos=(pos_src, pos_dst))
    layer.query_temperature = None
    want = layer((x_src, x_dst * temperature(pos_dst)[:, None]), edge_index)
    assert_close(got, want)
    assert not torch.allclose(got, layer((x_src, x_dst), edge_index))


def test_query_temperature_is_refused_where_it_does_not_apply():
    temperature = pe.QueryTemperature(1.0, 4)
    with pytest.raises(ValueError, match="query_temperature scales the queries of the dot "
                                         "score, .*got attention='additive'"):
        GraphSelfAttention(16, 8, attention="additive", query_temperature=temperature)
    for cls in (GraphSelfAttention, DenseSelfAttention):
        with pytest.raises(ValueError, match="query_temperature takes one position per node, "
                                             "and rotary's have axes=2"):
            cls(16, 8, rotary=pe.RotaryPE(8, axes=2), query_temperature=temperature)
        with pytest.raises(TypeError, match="query_temperature must be a graphattn.pe."
                                            "QueryTemperature or None, got float"):
            cls(16, 8, query_temperature=1.5)
    layer = GraphSelfAttention(16, 8, query_temperature=temperature)
    with pytest.raises(ValueError, match="the layer has a query_temperature and needs the "
                                         "nodes' positions"):
        layer(torch.randn(5, 16), graphs.causal_graph(5))
    dense = DenseSelfAttention(16, 8, query_temperature=temperature)
    with pytest.raises(ValueError, match="query_temperature takes one position per row of x: "
                                         "pos must have shape \\[5\\] \\(or \\[L\\]\\), got "
                                         "\\[4\\]"):
        dense(torch.randn(5, 16), pos=torch.arange(4))
    with pytest.raises(ValueError, match="with batch, a layer with rotary or "
                                         "query_temperature needs pos"):
        dense(torch.randn(5, 16), batch=torch.zeros(5, dtype=torch.long))


def test_from_llama_converts_moshi_and_refuses_its_weights_per_codebook():
    # Moshi's projections hold their Linear in a wrapper (MoshiLinear), read through it; its
    # depth decoder's hold a weight per codebook (use_flexible_linear), refused by name
    import transformers

    from graphattn.nn import from_llama

    moshi = transformers_module("moshi.modeling_moshi")
    attention, rotary = _sweep_attention(moshi.MoshiAttention, transformers.MoshiConfig,
                                         moshi.MoshiRotaryEmbedding, {})
    assert type(attention.q_proj).__name__ == "MoshiLinear"
    layer = from_llama(attention)
    assert torch.equal(layer.lin_q.weight, attention.q_proj.linear.weight)
    check_causal(attention, rotary, layer, dense=False, length=16, seed=33)
    flexible = moshi.MoshiAttention(attention.config, layer_idx=0, use_flexible_linear=True)
    with pytest.raises(NotImplementedError, match="MoshiAttention's projections hold a weight "
                                                  "per codebook \\(MoshiFlexibleLinear\\)"):
        from_llama(flexible)
