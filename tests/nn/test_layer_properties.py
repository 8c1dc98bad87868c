"""GraphSelfAttention with drawn option sets and graphs: every CPU backend agrees with the
reference backend, and DenseSelfAttention computes what it computes on the graphs of its masks.

Hypothesis draws the graph (self-attention or bipartite, 0 to 6 nodes per side, multi-edges and
self-loops allowed) and the options (score, heads, concat, output projection, self-loops,
residual and its gate, edge features and how they enter, sinks, an output gate and a soft cap of
the scores, the values' RMS norm, queries and keys of other widths than the values). Each
backend runs a copy of one layer:
outputs, the returned edge order and attention weights, and the gradients of every parameter must
match the readable reference path. A second draw gives the dot score a rotary embedding (real
positions, one or two axes), grouped key and value heads, QK-norm before or after the rotation,
sinks and an output gate. The draws are
derandomised, so CI runs the same cases each time.
The triton backend runs fewer draws, in Triton's CPU interpreter.
"""

import copy

import pytest
import torch
from conftest import assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphattn.nn import DenseSelfAttention, GraphSelfAttention

F_SRC, F_DST, EDGE_DIM = 5, 4, 3


@st.composite
def layer_cases(draw):
    bipartite = draw(st.booleans())
    n_src = draw(st.integers(0, 6))
    n_dst = draw(st.integers(0, 6)) if bipartite else n_src
    num_edges = draw(st.integers(0, 14)) if n_src and n_dst else 0
    attention = draw(st.sampled_from(["dot", "additive", "gatv2"]))
    residual = draw(st.booleans())
    options = dict(
        attention=attention, concat=draw(st.booleans()), out_proj=draw(st.booleans()),
        add_self_loops=draw(st.booleans()), residual=residual,
        beta=residual and draw(st.booleans()))
    with_edges = draw(st.booleans())
    if with_edges:
        modes = ["bias"] if attention == "additive" else ["bias", "key", "key_value"]
        options.update(edge_dim=EDGE_DIM, edge_mode=draw(st.sampled_from(modes)),
                       fill_value=draw(st.sampled_from(["mean", "add", "max", 0.5])))
    options.update(sinks=draw(st.booleans()), v_norm=draw(st.booleans()),
                   gate=draw(st.sampled_from([None, "elementwise", "headwise"])))
    if attention != "additive" and draw(st.booleans()):
        options["softcap"] = draw(st.sampled_from([0.5, 3.0]))  # (0.5: most scores capped)
    heads = draw(st.sampled_from([1, 2]))
    # channel counts the cpu kernels read at run time: one compiled variant serves both (the
    # constant counts are tested in tests/functional, and each costs seconds to compile)
    channels = draw(st.sampled_from([3, 5]))
    if attention != "additive" and options.get("edge_mode") != "key_value":
        options["score_channels"] = draw(st.sampled_from([None, 3, 5]))  # (the queries' and keys')
    seed = draw(st.integers(0, 2**16))
    return bipartite, n_src, n_dst, num_edges, heads, channels, options, with_edges, seed


def run(layer, backend, x, edge_index, edge_attr, **kwargs):
    layer = copy.deepcopy(layer)
    layer.backend = backend
    out, (ei, alpha) = layer(x, edge_index, edge_attr, return_attention_weights=True, **kwargs)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    if out.numel():
        (out * weight).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    return out, ei, alpha, grads


def check_backends(case, backends, dtype=torch.float64):
    bipartite, n_src, n_dst, num_edges, heads, channels, options, with_edges, seed = case
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    in_channels = (F_SRC, F_DST) if bipartite else F_SRC
    layer = GraphSelfAttention(in_channels, channels, heads, **options).to(dtype)
    x_src = torch.randn(n_src, F_SRC, generator=gen, dtype=dtype)
    x = (x_src, torch.randn(n_dst, F_DST, generator=gen, dtype=dtype)) if bipartite \
        else x_src
    edge_index = torch.stack([torch.randint(0, max(n_src, 1), (num_edges,), generator=gen),
                              torch.randint(0, max(n_dst, 1), (num_edges,), generator=gen)])
    edge_attr = (torch.randn(num_edges, EDGE_DIM, generator=gen, dtype=dtype)
                 if with_edges else None)

    if options.get("softcap") is not None:  # (the dense backend refuses a soft cap by name)
        backends = tuple(b for b in backends if b != "dense")
    out = assert_backends_agree(layer, backends, x, edge_index, edge_attr)
    assert out.shape == (n_dst, heads * channels if options["concat"] else channels)


def assert_backends_agree(layer, backends, x, edge_index, edge_attr, **kwargs):
    """Each of ``backends`` gives the reference backend's outputs, edge order, attention
    weights and parameter gradients on a copy of ``layer``; returns the outputs."""
    out, ei, alpha, grads = run(layer, "reference", x, edge_index, edge_attr, **kwargs)
    assert not out.isnan().any()
    for backend in backends:
        got_out, got_ei, got_alpha, got_grads = run(layer, backend, x, edge_index, edge_attr,
                                                    **kwargs)
        assert_close(got_out, out)
        assert torch.equal(got_ei, ei)
        assert_close(got_alpha, alpha)
        for name, grad in grads.items():
            if grad is None or got_grads[name] is None:  # no output reached it
                assert all(g is None or not g.any() for g in (grad, got_grads[name])), name
            else:
                assert_close(got_grads[name], grad)
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(layer_cases())
def test_every_cpu_backend_agrees_with_the_reference(case):
    check_backends(case, ("cpu", "dense"))


# the fixture only sets TRITON_INTERPRET=1, the same for every draw
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layer_cases())
def test_the_triton_backend_agrees_with_the_reference(triton_interpreter, case):
    check_backends(case, ("triton",), torch.float32)  # the kernels' dtypes: fp32/16, bf16


@pytest.mark.parametrize("fill_value", ["mean", 0.5, [1.0, 2.0, 3.0]])
def test_layer_built_on_the_meta_device_materialises(fill_value):
    """Built under ``torch.device("meta")`` (as large models are, before ``to_empty``), with
    every kind of ``fill_value``; materialised and reset, it computes what a layer built on the
    CPU with the same parameters computes."""
    with torch.device("meta"):
        layer = GraphSelfAttention(16, 8, heads=2, edge_dim=3, fill_value=fill_value)
    layer.to_empty(device="cpu")
    layer.reset_parameters()
    twin = GraphSelfAttention(16, 8, heads=2, edge_dim=3, fill_value=fill_value)
    twin.load_state_dict(layer.state_dict())
    x, edge_attr = torch.randn(5, 16), torch.randn(4, 3)
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 3]])  # node 3 has a loop of its own
    assert_close(layer(x, edge_index, edge_attr), twin(x, edge_index, edge_attr))


@st.composite
def rotary_cases(draw):
    """Graphs as ``layer_cases`` draws them, for a dot-score layer with a rotary embedding
    (one or two position axes, rotate-half or interleaved, all or part of the channels),
    grouped key/value heads, QK-norm (before or after the rotation), sinks, an output
    gate and latent queries, keys and values."""
    bipartite = draw(st.booleans())
    n_src = draw(st.integers(0, 6))
    n_dst = draw(st.integers(0, 6)) if bipartite else n_src
    num_edges = draw(st.integers(0, 14)) if n_src and n_dst else 0
    heads, kv_heads = draw(st.sampled_from([(1, 1), (2, 1), (4, 2)]))
    axes = draw(st.sampled_from([1, 2]))
    dim = draw(st.sampled_from([4, 8]))
    options = dict(add_self_loops=draw(st.booleans()), concat=draw(st.booleans()),
                   kv_heads=kv_heads, qk_norm=draw(st.sampled_from(
                       [None, "rms", "layer", "rms_per_head", "layer_per_head",
                        "rms_across_heads", "layer_across_heads"])),
                   sinks=draw(st.booleans()),
                   gate=draw(st.sampled_from([None, "elementwise", "headwise"])),
                   out_norm=draw(st.sampled_from([None, "rms", "layer"])))
    options["qk_norm_after_rotary"] = options["qk_norm"] is not None and draw(st.booleans())
    options["differential"] = draw(st.booleans())
    dim = 4 if options["differential"] else dim  # (its maps' queries and keys: 4 channels)
    if not options["differential"] and draw(st.booleans()):  # multi-head latent attention
        options.update(q_rank=draw(st.sampled_from([None, 5])), kv_rank=3,
                       shared_key_channels=draw(st.sampled_from([0, 2, 4])))
    rope = dict(axes=axes, interleaved=draw(st.booleans()), base=draw(st.sampled_from(
        [10.0, 10000.0])))
    seed = draw(st.integers(0, 2**16))
    return bipartite, n_src, n_dst, num_edges, heads, dim, options, rope, seed


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rotary_cases())
def test_rotary_grouped_layers_agree_on_every_cpu_backend(case):
    from graphattn import pe

    bipartite, n_src, n_dst, num_edges, heads, dim, options, rope, seed = case
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    in_channels = (F_SRC, F_DST) if bipartite else F_SRC
    layer = GraphSelfAttention(in_channels, 8, heads, rotary=pe.RotaryPE(dim, **rope),
                               **options).double()
    x_src = torch.randn(n_src, F_SRC, generator=gen, dtype=torch.float64)
    x = (x_src, torch.randn(n_dst, F_DST, generator=gen, dtype=torch.float64)) if bipartite \
        else x_src
    shape = (lambda n: (n,)) if rope["axes"] == 1 else (lambda n: (n, rope["axes"]))
    pos_src = torch.randn(shape(n_src), generator=gen, dtype=torch.float64) * 20
    pos = (pos_src, torch.randn(shape(n_dst), generator=gen, dtype=torch.float64) * 20) \
        if bipartite else pos_src
    edge_index = torch.stack([torch.randint(0, max(n_src, 1), (num_edges,), generator=gen),
                              torch.randint(0, max(n_dst, 1), (num_edges,), generator=gen)])
    assert_backends_agree(layer, ("cpu", "dense"), x, edge_index, None, pos=pos)


@st.composite
def dense_pair_cases(draw):
    """Options both layers take (grouped heads, QK-norm before or after a rotation, sinks,
    gates, a scale, a soft cap, residuals, values' RMS norm, values from the keys'
    projection, latent projections, an indexer keeping 1 or 3 keys per query), a length of 0
    to 7, and the backend of the graph layer."""
    heads, kv_heads = draw(st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2)]))
    residual = draw(st.booleans())
    qk_norm = draw(st.sampled_from([None, "rms", "layer", "rms_per_head", "layer_per_head",
                                    "rms_across_heads", "layer_across_heads"]))
    options = dict(
        concat=draw(st.booleans()), out_proj=draw(st.booleans()), bias=draw(st.booleans()),
        residual=residual, beta=residual and draw(st.booleans()), kv_heads=kv_heads,
        qk_norm=qk_norm, qk_norm_after_rotary=qk_norm is not None and draw(st.booleans()),
        sinks=draw(st.booleans()), gate=draw(st.sampled_from([None, "elementwise", "headwise"])),
        scale=draw(st.sampled_from([None, 0.3])), softcap=draw(st.sampled_from([None, 2.0])),
        v_norm=draw(st.booleans()), differential=draw(st.booleans()),
        out_norm=draw(st.sampled_from([None, "rms", "layer"])))
    options["share_value"] = not options["differential"] and draw(st.booleans())
    if not (options["differential"] or options["share_value"]) and draw(st.booleans()):
        options.update(q_rank=draw(st.sampled_from([None, 5])), kv_rank=3,  # (latent ones)
                       shared_key_channels=draw(st.sampled_from([0, 2])))
    backend = draw(st.sampled_from(["cpu", "reference"] if options["softcap"] else
                                   ["cpu", "reference", "dense"]))
    options["indexer"] = draw(st.sampled_from([None, 1, 3]))  # (its top_k: made in the test)
    return (heads, draw(st.sampled_from([4, 8])), options, draw(st.booleans()),
            draw(st.integers(0, 7)), draw(st.integers(0, 2**16)), backend)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(dense_pair_cases(), st.sampled_from(["complete", "causal", "mask", "batch"]))
def test_dense_layer_is_the_graph_layer_on_its_graph(case, how):
    """DenseSelfAttention with the GraphSelfAttention's state_dict, on all pairs, causally,
    under a random mask or per graph of a batch, computes what the graph layer computes on
    the graph of those pairs: outputs, the input's gradient and every parameter's gradient."""
    from graphattn import graphs, pe
    from graphattn.nn import LightningIndexer

    heads, channels, options, rotary, L, seed, backend = case
    options = dict(options)
    if how == "batch" and (options["softcap"] is not None or options["indexer"]):
        how = "mask"  # (the dense layer refuses a soft cap or an indexer with batch, by name)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    rope = pe.RotaryPE(channels // (2 if options["differential"] else 1)) if rotary else None
    if options["indexer"]:  # one module in both layers (its state_dict entries the same)
        options["indexer"] = LightningIndexer(
            F_SRC, 2, 4, options["indexer"], query_channels=options.get("q_rank") or F_SRC,
            rotary=pe.RotaryPE(2) if rotary else None).double()
    graph_layer = GraphSelfAttention(F_SRC, channels, heads, add_self_loops=False, rotary=rope,
                                     backend=backend, **options).double()
    dense_layer = DenseSelfAttention(F_SRC, channels, heads, rotary=rope, **options).double()
    for p in graph_layer.parameters():  # (gains, biases and sinks away from their 1s and 0s)
        torch.nn.init.normal_(p, 0.0, 0.5, generator=gen)
    dense_layer.load_state_dict(graph_layer.state_dict())
    x = torch.randn(L, F_SRC, generator=gen, dtype=torch.float64)
    pos, dense_kwargs = torch.arange(L), {}
    if how == "complete":
        edge_index = graphs.complete_graph(L)
    elif how == "causal":
        edge_index, dense_kwargs = graphs.causal_graph(L), dict(is_causal=True)
    elif how == "mask":
        mask = torch.rand(L, L, generator=gen) < 0.5
        edge_index, dense_kwargs = graphs.from_dense_mask(mask), dict(mask=mask)
    else:
        cut = int(torch.randint(0, L + 1, (1,), generator=gen))
        batch = (torch.arange(L) >= cut).long()
        pos = torch.cat([torch.arange(cut), torch.arange(L - cut)])  # (each graph's own)
        edge_index, dense_kwargs = graphs.batch_complete_graph(batch), dict(batch=batch)
        if rotary:
            dense_kwargs["pos"] = pos
    outs, grads = [], []
    for layer, call in ((graph_layer, lambda x: graph_layer(
            x, edge_index, **({"pos": pos} if rotary else {}))),
                        (dense_layer, lambda x: dense_layer(x, **dense_kwargs))):
        x_in = x.clone().requires_grad_(True)
        out = call(x_in)
        weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        (out * weight).sum().backward()
        outs.append(out.detach())
        grads.append({"x": x_in.grad, **{name: p.grad for name, p in layer.named_parameters()}})
    assert_close(outs[1], outs[0])
    for name, grad in grads[0].items():
        other = grads[1][name]
        if grad is None or other is None:  # no output reached it
            assert all(g is None or not g.any() for g in (grad, other)), name
        else:
            assert_close(other, grad)
