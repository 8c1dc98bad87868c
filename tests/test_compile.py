"""``torch.compile`` over edge_attention, the layers and the models: eager's outputs and gradients.

The ``cpu`` backend is a pair of torch operators (``graphattn::cpu_edge_attention`` and its
backward), so compiled graphs call the numba kernels instead of tracing into them; so is the
``triton`` backend (``graphattn::triton_edge_attention``, run here in Triton's CPU interpreter).
The node-id checks become asserts in the graph. Every case compiles with ``fullgraph=True``: no
graph break. Models are compared in eval mode, since a compiled graph draws the seeds of its
dropout masks (``graphattn::cpu_dropout_mask`` on CPU) from other random numbers than eager;
training mode is checked to run and give finite gradients, and to match eager when inductor's
``fallback_random`` option draws them with torch's generator.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from conftest import assert_close, random_graph

from graphattn import graphs
from graphattn.functional import cpu, dense_attention, edge_attention
from graphattn.functional import triton_kernels as tk
from graphattn.functional.attention import reference_edge_attention
from graphattn.nn import GAT, DenseSelfAttention, GraphSelfAttention, GraphTransformer

needs_cxx = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="inductor, torch.compile's default backend, needs a C++ compiler on CPU")


@pytest.fixture(autouse=True)
def fresh_dynamo_cache():
    """Forget earlier tests' compiled graphs: each test's functions share code objects with the
    other parametrisations, and dynamo stops recompiling one code object after 8 variants."""
    torch._dynamo.reset()
    yield


# Inductor fuses and reorders the projections' float operations: a few ulp of the outputs, and
# gradients summed over 1000 edges, differ from eager.
COMPILED = dict(atol=1e-4, rtol=1e-4)


class Stack(torch.nn.Module):
    """``layers`` applied in turn to the same graph."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor,
                edge_attr: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, edge_index, edge_attr)
        return x


def _graph(num_nodes: int = 60, num_edges: int = 400, seed: int = 0):
    edge_index = random_graph(num_nodes, num_edges, seed=seed)
    loops = torch.arange(0, num_nodes, 7).expand(2, -1)  # some self-loops for the layers to replace
    return torch.cat([edge_index, loops], dim=1)


def _loss_and_grads(model: torch.nn.Module, *inputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    out = model(*inputs)
    weight = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weight).sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_compiles_like_eager(model: torch.nn.Module, inputs_list: list[tuple],
                                backend: str, options: dict | None = None, *,
                                fullgraph: bool = True) -> None:
    """Eval mode: the compiled model's outputs and gradients are eager's. Training mode: they
    are finite, and with inductor's ``fallback_random`` option, which draws the dropout masks'
    seeds with torch's generator, they are eager's at the same seed."""
    model.eval()
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph, options=options)
    for inputs in inputs_list:
        out, grads = _loss_and_grads(compiled, *inputs)
        expected_out, expected_grads = _loss_and_grads(model, *inputs)
        assert_close(out, expected_out, **COMPILED)
        for grad, expected in zip(grads, expected_grads, strict=True):
            assert_close(grad, expected, **COMPILED)
    eval_out = _loss_and_grads(model, *inputs_list[0])[0]
    model.train()
    torch.manual_seed(1)
    out, grads = _loss_and_grads(compiled, *inputs_list[0])
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    if (options or {}).get("fallback_random"):
        torch.manual_seed(1)
        expected_out, expected_grads = _loss_and_grads(model, *inputs_list[0])
        assert not torch.allclose(expected_out, eval_out)  # the masks dropped something
        assert_close(out, expected_out, **COMPILED)
        for grad, expected in zip(grads, expected_grads, strict=True):
            assert_close(grad, expected, **COMPILED)


@pytest.mark.parametrize("backend", ["cpu", "reference", "dense", "triton"])
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_edge_attention_compiles(request, backend, score):
    """The triton backend runs in Triton's interpreter, as the operator
    ``graphattn::triton_edge_attention``."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    torch.manual_seed(0)
    N, H, C = 30, 2, 8
    edge_index = random_graph(N, 150, seed=1)
    qk_shape = (N, H) if score == "additive" else (N, H, C)
    leaves = [torch.randn(*qk_shape), torch.randn(*qk_shape), torch.randn(N, H, C),
              torch.randn(edge_index.size(1), H)]
    if score == "gatv2":
        leaves.append(torch.randn(H, C))
    leaves = [t.requires_grad_() for t in leaves]

    def attend(q, k, v, bias, *att_and_edge_index):
        *att, edge_index = att_and_edge_index
        return edge_attention(q, k, v, edge_index, bias=bias, backend=backend, score=score,
                              return_attention=True, att=att[0] if att else None)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, attend):
        out, alpha = fn(*leaves, edge_index)
        grads = torch.autograd.grad((out * out).sum() + (alpha * alpha).sum(), leaves)
        results.append((out, alpha, grads))
    (out, alpha, grads), (expected_out, expected_alpha, expected_grads) = results
    assert_close(out, expected_out)
    assert_close(alpha, expected_alpha)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert_close(grad, expected)


@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_dense_multigraph_path_under_inductor_with_threads(score):
    """The dense backend's multigraph path (torch.compile always takes it) with a bias, dropout
    and the weights in the loss, compiled by inductor on two threads and returning only the
    loss, equals eager: its scatter-adds are operators inductor does not fuse. Fused, torch
    2.13 compiled them into 2-D tiled kernels whose atomic adds wrote to the wrong entries or
    out of bounds (wrong losses, heap corruption)."""
    torch.manual_seed(0)
    N, E, H, C = 8, 30, 2, 4
    edge_index = torch.randint(0, N, (2, E))  # multi-edges
    leaves = [torch.randn(N, H, C) for _ in range(3)] + [torch.randn(E, H)]
    if score == "gatv2":
        leaves.append(torch.randn(H, C))
    leaves = [t.requires_grad_() for t in leaves]

    def loss(q, k, v, bias, *att):
        out, alpha = edge_attention(q, k, v, edge_index, bias=bias, att=att[0] if att else None,
                                    score=score, dropout_p=0.4, training=True,
                                    return_attention=True, backend="dense")
        return ((out * torch.linspace(-1, 2, out.numel()).view_as(out)).sum()
                + (alpha * torch.linspace(2, -1, alpha.numel()).view_as(alpha)).sum())

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch._inductor.config.patch(fallback_random=True):  # eager's dropout draws
            results = []
            for fn in (loss, torch.compile(loss)):
                torch.manual_seed(5)
                value = fn(*leaves)
                results.append([value, *torch.autograd.grad(value, leaves)])
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(*results, strict=True):
        assert_close(got, want, **COMPILED)


@pytest.mark.parametrize(("n_dst", "n_src"), [(3, 0), (0, 0)])
@pytest.mark.parametrize("score", ["dot", "additive"])
def test_dense_backend_compiles_graphs_without_source_nodes(score, n_dst, n_src):
    """torch.compile takes the dense backend's multigraph path, whose per-pair maximum over a
    target row has no row to reduce when N_src = 0: the result and the gradients are eager's,
    zeros."""
    qk_shape = (2,) if score == "additive" else (2, 4)
    leaves = [torch.randn(n_dst, *qk_shape), torch.randn(n_src, *qk_shape),
              torch.randn(n_src, 2, 4), torch.zeros(0, 2)]
    leaves = [t.requires_grad_() for t in leaves]
    no_edges = torch.empty(2, 0, dtype=torch.long)

    def attend(q, k, v, bias):
        return edge_attention(q, k, v, no_edges, bias=bias, score=score, return_attention=True,
                              backend="dense")

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    for fn in (attend, compiled):
        out, alpha = fn(*leaves)
        assert out.shape == (n_dst, 2, 4) and (out == 0).all() and alpha.shape == (0, 2)
        grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
        assert all(g is None or (g == 0).all() for g in grads)


@pytest.mark.parametrize("transform", ["grad", "vmap_of_grad"])
def test_dense_backend_compiles_under_torch_func_gradients(transform):
    """torch.compile over torch.func.grad (and vmap of it) on the dense backend: its row
    gathers and scatter-adds take plain torch ops there, since the autograd of a
    torch.library operator does not run under torch.func's gradient transforms."""
    torch.manual_seed(0)
    N, E, H, C = 6, 14, 2, 3
    edge_index = torch.randint(0, N, (2, E))  # multi-edges
    q, k, v = (torch.randn(N, H, C) for _ in range(3))
    bias = torch.randn(E, H)

    def loss(q, k, v, bias):
        out, alpha = edge_attention(q, k, v, edge_index, bias=bias, return_attention=True,
                                    backend="dense")
        return out.sin().sum() + alpha.square().sum()

    def grads(q):
        grad = torch.func.grad(loss, argnums=(0, 1, 2, 3))
        if transform == "grad":
            return grad(q, k, v, bias)
        return torch.func.vmap(grad, in_dims=(0, None, None, None))(q.expand(2, -1, -1, -1),
                                                                   k, v, bias)

    compiled = torch.compile(grads, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(q), grads(q), strict=True):
        assert_close(got, want, **COMPILED)


def test_node_id_checks_run_inside_the_compiled_graph():
    def attend(q, k, v, edge_index):
        return edge_attention(q, k, v, edge_index)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    q = torch.randn(5, 1, 4)
    good = torch.tensor([[0, 1, 2], [1, 2, 3]])
    assert_close(compiled(q, q, q, good), attend(q, q, q, good))
    with pytest.raises(RuntimeError, match=r"edge_index\[0\] \(sources\) must be < the number "
                                           r"of source nodes"):
        compiled(q, q, q, torch.tensor([[0, 5, 2], [1, 2, 3]]))
    with pytest.raises(RuntimeError, match=r"edge_index must hold node ids >= 0"):
        compiled(q, q, q, torch.tensor([[0, 1, 2], [1, -2, 3]]))
    with pytest.raises(RuntimeError, match=r"edge_index\[1\] \(targets\) must be < the number "
                                           r"of target nodes"):
        compiled(q, q, q, torch.tensor([[0, 1, 2], [1, 5, 3]]))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_scale_that_changes_between_calls_compiles_without_a_graph_break(backend):
    """A second call with another Python-float scale or softcap makes dynamo trace them as
    symbolic floats, on which the finiteness check's ``math.isfinite`` broke the graph
    (``fullgraph=True`` failed). It is now a comparison, which dynamo traces."""
    def attend(q, k, v, edge_index, scale, softcap):
        return edge_attention(q, k, v, edge_index, scale=scale, softcap=softcap,
                              backend=backend)

    compiled = torch.compile(attend, backend="eager", fullgraph=True)
    q, k, v = torch.randn(3, 6, 2, 4).unbind(0)
    edge_index = random_graph(6, 15, seed=0)
    for scale, softcap in [(0.5, 10.0), (0.25, 20.0), (0.75, 5.0)]:
        assert_close(compiled(q, k, v, edge_index, scale, softcap),
                     attend(q, k, v, edge_index, scale, softcap))


@needs_cxx
def test_gat_compiles_with_inductor():
    """With ``fallback_random`` (README, torch.compile), training steps draw eager's masks."""
    torch.manual_seed(0)
    x = torch.randn(60, 16)
    inputs = [(x, _graph()), (x, _graph(num_edges=437, seed=2))]  # a second edge count
    _assert_compiles_like_eager(GAT(16, 5), inputs, backend="inductor",
                                options={"fallback_random": True})


@needs_cxx
def test_stacked_copies_of_a_layer_compile_with_inductor():
    """Deep copies share everything but their identity; each still drops the self-loops itself."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(16, 8, heads=2, dropout=0.2, edge_dim=3)
    model = Stack([copy.deepcopy(layer) for _ in range(3)])
    edge_index = _graph().int()  # int32 ids (the GAT test has int64)
    inputs = [(torch.randn(60, 16), edge_index, torch.randn(edge_index.size(1), 3))]
    _assert_compiles_like_eager(model, inputs, backend="inductor")


def test_a_lazy_graph_transformer_compiles_in_the_default_mode():
    """GraphTransformer(-1, ...) failed its first compiled call (SpeculationLogDivergence: the
    first trace sized its input projection, and the restarted one found a Linear)."""
    torch.manual_seed(0)
    model = GraphTransformer(-1, 8, 3).eval()
    x, edge_index = torch.randn(20, 16), random_graph(20, 80, seed=4)
    got = torch.compile(model, backend="eager")(x, edge_index)
    assert model.lin_in.weight.shape == (8, 16)
    assert_close(got, model(x, edge_index))
    torch._dynamo.reset()


def test_layers_of_one_configuration_share_their_compiled_graph():
    """Each layer keyed its self-loop removal by its id(), which dynamo guards: every new layer
    compiled again, and the ninth, past dynamo's recompile limit, failed under fullgraph=True
    (an ensemble, a model per seed or fold). The key is a buffer now, an input of the graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x, edge_index = torch.randn(20, 16), random_graph(20, 80, seed=3)
    for seed in range(10):
        torch.manual_seed(seed)
        layer = GraphSelfAttention(16, 8, heads=2)
        got = torch.compile(layer, backend="eager", fullgraph=True)(x, edge_index)
        assert_close(got, layer(x, edge_index))
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("attention", ["dot", "additive"])
def test_graph_transformer_compiles(attention):
    torch.manual_seed(0)
    model = GraphTransformer(16, 32, 5, num_layers=3, attention=attention, pe_channels=4)
    inputs = [(torch.randn(60, 16), _graph(), torch.randn(60, 4))]
    _assert_compiles_like_eager(model, inputs, backend="aot_eager")


@pytest.mark.parametrize(("attention", "edge_mode"), [("dot", "key_value"), ("gatv2", "key")])
def test_edge_features_in_keys_and_the_beta_gate_compile(attention, edge_mode):
    """Edges as sources (one key per edge) and the gated residual, under the compiler."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(16, 8, heads=2, attention=attention, edge_dim=3,
                               edge_mode=edge_mode, residual=True, beta=True, dropout=0.2)
    inputs = [(torch.randn(60, 16), ei, torch.randn(ei.size(1), 3))
              for ei in (_graph(), _graph(num_edges=437, seed=2))]
    _assert_compiles_like_eager(layer, inputs, backend="aot_eager")


@pytest.mark.parametrize("make", [
    lambda: DenseSelfAttention(16, 8, heads=2),
    # with attention dropout on CPU: the explicit softmax and graphattn's mask operator
    lambda: DenseSelfAttention(16, 8, heads=2, dropout=0.3),
    lambda: GraphSelfAttention(16, 8, heads=2, backend="dense"),
    # backend="auto" takes "dense" on the complete graph when no self-loops are added
    lambda: GraphSelfAttention(16, 8, heads=2, residual=True, add_self_loops=False),
], ids=["dense-twin", "dense-twin-dropout", "dense-backend", "auto-backend"])
def test_sdpa_without_a_batch_dimension_compiles(make):
    """Inputs without a batch dimension reach SDPA through an autograd.Function in eager mode,
    whose backward calls ``torch.autograd.grad``: dynamo cannot trace that, so under the
    compiler SDPA runs directly. With attention dropout the dense twin traces in one graph too."""
    torch.manual_seed(0)
    layer, x = make(), torch.randn(12, 16)
    complete = torch.cartesian_prod(torch.arange(12), torch.arange(12)).t()
    inputs = (x,) if isinstance(layer, DenseSelfAttention) else (x, complete)
    _assert_compiles_like_eager(layer, [inputs], backend="aot_eager")


def test_triton_dropout_seed_is_drawn_in_the_compiled_graph(triton_interpreter):
    """Attention dropout on the triton backend under torch.compile: the seed of the mask the
    kernels draw is a random op of the graph (a new mask at every call), and at one
    ``torch.manual_seed`` the compiled function draws eager's, outputs and gradients alike."""
    torch.manual_seed(0)
    N, H, C = 20, 2, 8
    edge_index = random_graph(N, 90, seed=2)
    leaves = [torch.randn(N, H, C).requires_grad_() for _ in range(3)]

    def attend(q, k, v):
        return edge_attention(q, k, v, edge_index, backend="triton", dropout_p=0.4)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, attend):
        torch.manual_seed(5)
        out = fn(*leaves)
        results.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
    for got, want in zip(*results, strict=True):
        assert_close(got, want)
    assert not torch.equal(compiled(*leaves), compiled(*leaves))
    undropped = edge_attention(*leaves, edge_index, backend="triton", dropout_p=0.4,
                               training=False)
    assert not torch.allclose(results[0][0], undropped)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "default-mode"])
def test_layer_on_the_triton_backend_compiles(triton_interpreter, default_mode, fullgraph):
    """In the default mode the given self-loops reach the kernels with a bias of -inf."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(16, 8, heads=2, attention="gatv2", edge_dim=3, backend="triton")
    edge_index = _graph(num_nodes=20, num_edges=80)
    inputs = [(torch.randn(20, 16), edge_index, torch.randn(edge_index.size(1), 3))]
    _assert_compiles_like_eager(layer, inputs, backend="aot_eager", fullgraph=fullgraph)


@pytest.fixture
def default_mode():
    """Dynamo without ``capture_dynamic_output_shape_ops``, as it comes (conftest sets it on
    torch < 2.10)."""
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False):
        yield


def _graph_count(model: torch.nn.Module, *inputs) -> int:
    """The number of graphs dynamo cuts ``model``'s forward into in its default mode."""
    torch._dynamo.reset()
    count = torch._dynamo.explain(model)(*inputs).graph_count
    torch._dynamo.reset()
    return count


@pytest.mark.parametrize(("attention", "edge_mode", "fill_value", "backend"), [
    ("dot", "bias", "mean", "auto"), ("dot", "key", "mul", "dense"),
    ("additive", "bias", "max", "auto"), ("gatv2", "key_value", 0.5, "reference")])
def test_default_mode_traces_one_graph(default_mode, attention, edge_mode, fill_value, backend):
    """Without ``fullgraph=True`` dynamo does not trace the data-dependent edge count of
    dropping the given self-loops; the layer keeps them with a score of -inf instead and adds
    its own: one graph, eager's outputs and gradients, also for a node with two given loops
    (and, with ``backend="auto"``, on a second edge count, traced with symbolic sizes)."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(16, 8, heads=2, attention=attention, edge_dim=3,
                               edge_mode=edge_mode, fill_value=fill_value, backend=backend,
                               dropout=0.2)
    edge_index = torch.cat([_graph(), torch.tensor([[7, 3], [7, 3]])], dim=1)  # 7 twice looped
    graphs = [edge_index] + ([_graph(num_edges=437, seed=2)] if backend == "auto" else [])
    inputs = [(torch.randn(60, 16), ei, torch.randn(ei.size(1), 3)) for ei in graphs]
    assert _graph_count(layer, *inputs[0]) == 1
    _assert_compiles_like_eager(layer, inputs, backend="aot_eager", fullgraph=False)


@pytest.mark.parametrize("fullgraph", [False, True], ids=["default-mode", "fullgraph"])
@pytest.mark.parametrize(("attention", "backend"), [("dot", "auto"), ("additive", "auto"),
                                                    ("dot", "cpu")])
def test_new_graph_sizes_do_not_compile_again(attention, backend, fullgraph):
    """A compiled layer called on graphs of 9 to 30 nodes (as a DataLoader's batches come)
    compiles twice, the second time with symbolic sizes, as PyG's layers do; the node counts
    were once fixed by the messages of the node-id checks and by auto's crossover (a
    logarithm of the size), so that each new size compiled again until dynamo gave up."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    layer = GraphSelfAttention(4, 4, heads=2, attention=attention, backend=backend).eval()
    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=fullgraph)
    for n in (10, 13, 17, 22, 9, 30):
        # density (with the self-loops) at most 0.14, below auto's whole-graph crossover:
        # its choice stays the same (a change of choice compiles again)
        x, edge_index = torch.randn(n, 4), random_graph(n, 2, seed=n)
        assert_close(compiled(x, edge_index), layer(x, edge_index))
    assert counter.frame_count == 2


def test_dense_attention_takes_a_mask_after_the_sizes_changed():
    """A first call without a mask, then one with a mask on other sizes: the mask's shape is
    checked against the symbolic sizes (a ``size in (1, L)`` check once refused a valid mask
    there, failing ``fullgraph=True``)."""
    def attend(q, mask=None):
        return dense_attention(q, q, q, mask)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(5, 2, 4))
    q, mask = torch.randn(9, 2, 4), torch.rand(9, 9) < 0.5
    assert_close(compiled(q, mask), attend(q, mask))
    layer = DenseSelfAttention(4, 4, heads=2)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    compiled(torch.randn(3, 5, 4))
    x, mask = torch.randn(3, 9, 4), torch.rand(3, 9, 9) < 0.5
    assert_close(compiled(x, mask=mask), layer(x, mask=mask))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("make", [
    lambda: GAT(8, 3, hidden_channels=4, heads=2),
    lambda: GraphSelfAttention(8, 4, heads=2, dropout=0.3),
    lambda: GraphTransformer(8, 8, 3, heads=2)], ids=["GAT", "GraphSelfAttention", "transformer"])
def test_models_trace_with_torch_jit_trace(make, training):
    """``torch.jit.trace`` records sizes as values: the sparse kernels run as their operator,
    ``auto`` takes them, and the dropout masks' sizes are those traced. Outputs and gradients
    equal eager's at the same seed (on ``auto``'s choice in eager, to float rounding)."""
    torch.manual_seed(0)
    model = make().train(training)
    x = torch.randn(6, 8)
    edge_index = torch.tensor([[0, 1, 2, 3, 5, 4], [1, 2, 3, 4, 0, 0]])
    traced = torch.jit.trace(model, (x, edge_index), check_trace=False)
    results = []
    for run in (traced, model):
        torch.manual_seed(3)
        results.append(_loss_and_grads(run, x, edge_index))
    (out, grads), (want, want_grads) = results
    assert_close(out, want, **COMPILED)
    for grad, expected in zip(grads, want_grads, strict=True):
        assert_close(grad, expected, **COMPILED)


@pytest.mark.parametrize("backend", ["auto", "cpu", "reference"])
def test_a_layer_traced_in_eval_mode_runs_on_graphs_of_other_sizes(backend):
    """The trace records the node count where the backends use it (the reference path's
    softmax groups, as a traced size): a larger graph than the traced one computes what eager
    computes."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(8, 4, heads=2, backend=backend).eval()
    x, edge_index = torch.randn(12, 8), torch.randint(0, 12, (2, 40))
    traced = torch.jit.trace(layer, (x, edge_index), check_trace=False)
    for n, e in [(30, 100), (5, 9)]:
        x, edge_index = torch.randn(n, 8), torch.randint(0, n, (2, e))
        assert_close(traced(x, edge_index), layer(x, edge_index))


def test_dense_backend_refuses_torch_jit_trace_by_name():
    layer = GraphSelfAttention(8, 4, heads=2, backend="dense")
    with pytest.raises(ValueError, match="backend='dense' .* torch.jit.trace"):
        torch.jit.trace(layer, (torch.randn(4, 8), torch.tensor([[0, 1], [1, 2]])),
                        check_trace=False)


@pytest.mark.parametrize("make", [
    lambda: GraphSelfAttention(8, 4, heads=2), lambda: DenseSelfAttention(8, 4, heads=2),
    lambda: GAT(8, 3), lambda: torch.nn.Sequential(GraphTransformer(8, 8, 3, heads=2))],
    ids=["GraphSelfAttention", "DenseSelfAttention", "GAT", "nested"])
def test_torch_jit_script_is_refused_by_name(make):
    """TorchScript is refused with the layer's name and the ways that work, for a layer inside
    a model too, instead of TorchScript's own error about the keyword-only ``size``."""
    model = make()
    name = "DenseSelfAttention" if isinstance(model, DenseSelfAttention) else \
        "GraphSelfAttention"
    with pytest.raises(RuntimeError, match=f"jit.script does not compile {name}.*torch.export"):
        torch.jit.script(model)


@needs_cxx
def test_gat_compiles_to_one_graph_in_the_default_mode_with_inductor(default_mode):
    """On a graph without self-loops nothing is flagged, and with ``fallback_random`` a training
    step draws eager's dropout masks (README, torch.compile)."""
    torch.manual_seed(0)
    model, x = GAT(16, 5), torch.randn(60, 16)
    edge_index = random_graph(60, 400, seed=4)
    loopless = edge_index[:, edge_index[0] != edge_index[1]]
    assert _graph_count(model, x, _graph()) == 1
    _assert_compiles_like_eager(model, [(x, loopless), (x, _graph())], backend="inductor",
                                options={"fallback_random": True}, fullgraph=False)


def test_default_mode_on_a_bipartite_graph(default_mode):
    """Loops on the first min(N_src, N_dst) targets; edges into the others stay as given."""
    torch.manual_seed(0)
    layer = GraphSelfAttention((16, 12), 8, heads=2, edge_dim=3)
    edge_index = torch.cat([random_graph(40, 200, seed=3, num_dst=25),
                            torch.tensor([[0, 5, 24], [0, 5, 24]])], dim=1)
    inputs = ((torch.randn(40, 16), torch.randn(25, 12)), edge_index,
              torch.randn(edge_index.size(1), 3))
    assert _graph_count(layer, *inputs) == 1
    _assert_compiles_like_eager(layer, [inputs], backend="aot_eager", fullgraph=False)


def test_sparse_features_compile_in_the_default_mode(default_mode, transposes):
    """Sparse CSR features, which dynamo does not trace: the projection runs eagerly between
    graphs (sparse_linear, with its own backward) and the compiled model is eager's."""
    torch.manual_seed(0)
    x = (torch.rand(60, 16) * (torch.rand(60, 16) < 0.2)).to_sparse_csr()
    _assert_compiles_like_eager(GAT(16, 5), [(x, _graph())], backend="aot_eager",
                                fullgraph=False)
    assert transposes  # the counting-sort backward ran


@pytest.mark.parametrize("layout", [torch.sparse_csr, torch.sparse_csc, torch.sparse_coo],
                         ids=["csr", "csc", "coo"])
def test_sparse_features_train_from_the_first_compiled_call(default_mode, layout):
    """The first compiled call trains (feature dropout on the stored values): dynamo failed
    inside its own tracing (an IndexError) on the values of a sparse tensor, a view of a
    tensor without strides, when that was the first tensor it saw in ``dropout``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    dense = torch.rand(60, 16) * (torch.rand(60, 16) < 0.2)
    x = {torch.sparse_csr: dense.to_sparse_csr, torch.sparse_csc: dense.to_sparse_csc,
         torch.sparse_coo: dense.to_sparse}[layout]()
    model = GAT(16, 5)
    edge_index = _graph()
    loopless = edge_index[:, edge_index[0] != edge_index[1]]  # nothing flagged: eager's masks
    compiled = torch.compile(model, backend="aot_eager")
    torch.manual_seed(1)
    out = compiled(x, loopless)
    out.sum().backward()
    torch.manual_seed(1)
    expected = model(x, loopless)
    assert_close(out, expected, **COMPILED)


def test_fullgraph_compiles_without_the_flag_on_every_torch(default_mode):
    """torch 2.8 and 2.9 do not trace data-dependent sizes with ``fullgraph=True`` alone: there
    the layers keep the given loops flagged; later torch drops them as eager does."""
    torch.manual_seed(0)
    inputs = [(torch.randn(60, 16), _graph())]
    _assert_compiles_like_eager(GAT(16, 5), inputs, backend="aot_eager")


@pytest.mark.parametrize("case", ["weights", "hook", "additive-slope-0", "additive-scale-0",
                                  "additive-scale-negative"])
def test_default_mode_drops_the_given_loops_where_a_masked_edge_would_show(default_mode, case):
    """Returned weights and message hooks list the edges attended over, as eager does; the
    additive score with ``negative_slope=0`` or ``scale=0`` would turn -inf into
    0 * -inf = NaN, and with a negative scale into +inf. These calls drop the given loops, as
    eager does, and dynamo cuts the graph there."""
    torch.manual_seed(0)
    scale = {"additive-scale-0": 0.0, "additive-scale-negative": -0.5}.get(case)
    layer = GraphSelfAttention(16, 8, heads=2, attention="additive", scale=scale,
                               negative_slope=0.0 if case == "additive-slope-0" else 0.2).eval()
    seen = []
    if case == "hook":
        layer.register_message_forward_hook(lambda module, inputs, out: seen.append(inputs[0]))
    x, edge_index = torch.randn(60, 16), _graph()
    weights = case == "weights"
    compiled = torch.compile(layer, backend="aot_eager")
    got, expected = compiled(x, edge_index, None, weights), layer(x, edge_index, None, weights)
    if weights:
        (got, (got_index, got_alpha)), (expected, (index, alpha)) = got, expected
        assert torch.equal(got_index, index)
        assert_close(got_alpha, alpha)
    if case == "hook":
        assert torch.equal(seen[0]["edge_index"], seen[1]["edge_index"])
        assert_close(seen[0]["alpha"], seen[1]["alpha"])
    assert_close(got, expected, **COMPILED)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("differential", [False, True])
def test_weights_of_a_layer_with_sinks_compile(differential):
    """The sinks' gradient through the returned weights needs each edge's target, found by
    repeat_interleave with its output size given: a size known before the data, which
    torch.compile traces (without it the backward did not trace, dynamo cut the graph, and
    then failed inside its own code). Compiled: outputs, weights and every gradient, the
    sinks' included, are eager's; of a differential layer too (two maps, each with its sinks,
    and the weights their difference)."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(16, 8, heads=2, sinks=True, backend="cpu",
                               differential=differential)
    torch.nn.init.normal_(layer.sinks)
    twin = copy.deepcopy(layer)
    x, edge_index = torch.randn(60, 16), _graph()
    results = []
    for model in (torch.compile(twin, backend="aot_eager"), layer):  # (the default mode)
        out, (index, alpha) = model(x, edge_index, None, True)
        weight = torch.linspace(-1, 1, alpha.numel()).view_as(alpha)
        (out.square().sum() + (alpha * weight).sum()).backward()
        results.append((out.detach(), index, alpha.detach()))
    (got, got_index, got_alpha), (expected, index, alpha) = results
    assert_close(got, expected, **COMPILED)
    assert torch.equal(got_index, index)
    assert_close(got_alpha, alpha, **COMPILED)
    assert layer.sinks.grad.abs().min() > 0
    for param, twin_param in zip(layer.parameters(), twin.parameters(), strict=True):
        assert_close(twin_param.grad, param.grad, **COMPILED)


def test_a_layer_with_latent_projections_compiles():
    """Multi-head latent attention (q_rank, kv_rank, shared rotary key channels), compiled in
    the default mode: outputs and every gradient are eager's (lin_v reads lin_k's parameters,
    the copy's in the copy)."""
    from graphattn.pe import RotaryPE

    torch.manual_seed(0)
    layer = GraphSelfAttention(16, 8, heads=2, q_rank=6, kv_rank=5, shared_key_channels=2,
                               score_channels=6, rotary=RotaryPE(2), backend="cpu")
    twin = copy.deepcopy(layer)
    x, edge_index = torch.randn(60, 16), _graph()
    pos = torch.arange(60)
    outs = []
    for model in (torch.compile(twin, backend="aot_eager"), layer):
        out = model(x, edge_index, pos=pos)
        out.square().sum().backward()
        outs.append(out.detach())
    assert_close(outs[0], outs[1], **COMPILED)
    for param, twin_param in zip(layer.parameters(), twin.parameters(), strict=True):
        assert_close(twin_param.grad, param.grad, **COMPILED)


@pytest.mark.parametrize("dense", [False, True], ids=["graph", "dense"])
def test_a_layer_with_an_indexer_compiles(dense):
    """A learned sparse graph (each query's top 4 keys by a LightningIndexer), compiled in the
    default mode: the choice of edges has sizes that depend on the data, where dynamo cuts
    the graph and runs eagerly; outputs and every gradient are eager's."""
    from graphattn.nn import LightningIndexer
    from graphattn.pe import RotaryPE

    torch.manual_seed(0)
    indexer = LightningIndexer(16, 2, 8, 4, rotary=RotaryPE(4))
    layer = (DenseSelfAttention(16, 8, heads=2, rotary=RotaryPE(8), indexer=indexer) if dense
             else GraphSelfAttention(16, 8, heads=2, rotary=RotaryPE(8), indexer=indexer,
                                     add_self_loops=False, backend="cpu"))
    twin = copy.deepcopy(layer)
    L = 20
    x, graph, pos = torch.randn(L, 16), graphs.causal_graph(L), torch.arange(L)
    outs = []
    for model in (torch.compile(twin, backend="aot_eager"), layer):
        out = model(x, is_causal=True) if dense else model(x, graph, pos=pos)
        out.square().sum().backward()
        outs.append(out.detach())
    assert_close(outs[0], outs[1], **COMPILED)
    for param, twin_param in zip(layer.parameters(), twin.parameters(), strict=True):
        assert (param.grad is None) == (twin_param.grad is None)  # (the indexer's: none)
        if param.grad is not None:
            assert_close(twin_param.grad, param.grad, **COMPILED)


def test_a_graph_break_inside_the_cpu_backend_falls_back_to_eager(monkeypatch):
    """Where dynamo cuts a graph inside the cpu backend (here: the sinks' gradient taking each
    edge's target from repeat_interleave without its output size, as it once did), the rest
    runs eagerly and gives eager's results: the eager kernels are out of dynamo's reach, which
    otherwise traced numba's dispatcher and failed inside its own code."""
    def data_dependent_targets(rowptr, perm):
        degree = rowptr[1:] - rowptr[:-1]
        targets = torch.empty(perm.numel(), dtype=torch.int64)
        targets[perm] = torch.repeat_interleave(torch.arange(degree.numel()), degree)
        return targets

    monkeypatch.setattr(cpu, "_csr_targets", data_dependent_targets)
    torch.manual_seed(1)
    layer = GraphSelfAttention(16, 8, heads=2, attention="additive", sinks=True, backend="cpu")
    torch.nn.init.normal_(layer.sinks)
    twin = copy.deepcopy(layer)
    x, edge_index = torch.randn(30, 16), _graph(30, 120)
    results = []
    for model in (torch.compile(twin, backend="aot_eager"), layer):
        out, (_, alpha) = model(x, edge_index, None, True)
        (out.square().sum() + alpha.square().sum()).backward()
        results.append(out.detach())
    assert_close(results[0], results[1], **COMPILED)
    for param, twin_param in zip(layer.parameters(), twin.parameters(), strict=True):
        assert_close(twin_param.grad, param.grad, **COMPILED)


def _assert_operator_matches_reference(out, alpha, leaves, reference_inputs, *, bias, mask,
                                       score, att, edge_key=None, edge_value=None,
                                       softcap=None, sinks=None):
    """out, alpha and the gradients of ``leaves`` through them against the reference backend
    on ``reference_inputs`` (q, k, v, edge_index; scale 0.5, slope 0.2)."""
    grads = torch.autograd.grad((out * out).sum() + (alpha * alpha).sum(), leaves)
    expected_out, expected_alpha = reference_edge_attention(
        *reference_inputs, scale=0.5, bias=bias, dropout_mask=mask, score=score,
        negative_slope=0.2, need_alpha=True, att=att, edge_key=edge_key, edge_value=edge_value,
        softcap=softcap, sinks=sinks)
    expected = torch.autograd.grad((expected_out * expected_out).sum()
                                   + (expected_alpha * expected_alpha).sum(), leaves)
    assert_close(out, expected_out)
    assert_close(alpha, expected_alpha)
    for grad, reference in zip(grads, expected, strict=True):
        assert_close(grad, reference)


@pytest.mark.parametrize(("score", "with_bias", "with_mask"), [
    ("dot", True, False), ("additive", False, True), ("gatv2", True, True)])
def test_triton_operators_pass_opcheck_and_match_the_reference(triton_interpreter, score,
                                                               with_bias, with_mask):
    """As below for the triton backend's operators, in Triton's interpreter; q and k with more
    channels than v."""
    torch.manual_seed(0)
    N, H, C, C_v, E = 6, 2, 8, 4, 20
    edge_index = random_graph(N, E, seed=5)
    shape = (N, H) if score == "additive" else (N, H, C)
    q, k, v = torch.randn(*shape), torch.randn(*shape), torch.randn(N, H, C_v)
    att = torch.randn(H, C) if score == "gatv2" else None
    bias = torch.randn(E, H) if with_bias else None
    mask = (torch.rand(E, H) > 0.3).float() / 0.7 if with_mask else None
    leaves = [t.requires_grad_() for t in (q, k, v, att, bias) if t is not None]
    args = (q, k, v, att, bias, mask, edge_index, 0.5, 0.2, score, True)
    torch.library.opcheck(tk._forward_op, args)

    out, alpha, lse = tk._forward_op(*args)
    _assert_operator_matches_reference(out, alpha, leaves, (q, k, v, edge_index), bias=bias,
                                       mask=mask, score=score, att=att)

    detached = [None if t is None else t.detach() for t in (q, k, v, att, bias)]
    torch.library.opcheck(tk._backward_op, (
        torch.randn_like(out), torch.randn(E, H), *detached, mask, edge_index, out.detach(),
        lse, 0.5, 0.2, score, with_bias, att is not None))


@pytest.mark.parametrize(("score", "with_bias", "with_mask", "terms"), [
    ("dot", False, False, ""), ("dot", True, True, ""), ("additive", False, True, ""),
    ("additive", True, False, ""), ("gatv2", True, True, ""), ("gatv2", False, False, ""),
    ("dot", True, True, "key+value"), ("gatv2", False, True, "key+value"),
    ("dot", False, True, "key=value")])
def test_cpu_operators_pass_opcheck_and_match_the_reference(score, with_bias, with_mask, terms):
    """torch's own checks of the operators (schema, fake shapes, autograd registration), and
    the gradients the operators' autograd gives in eager against the reference backend, with
    and without the per-edge key and value terms ("key=value": one tensor as both, passed once
    with ``value_is_key``); with a bias, the dot and gatv2 scores soft-capped at 1.5, and sinks
    in the softmax."""
    torch.manual_seed(0)
    N, H, C, E = 7, 2, 4, 24
    edge_index = random_graph(N, E, seed=5)
    additive = score == "additive"
    shape = (N, H, 1) if additive else (N, H, C)  # the kernels take additive q, k as (N, H, 1)
    q, k, v = torch.randn(*shape), torch.randn(*shape), torch.randn(N, H, C)
    att = torch.randn(H, C) if score == "gatv2" else None
    bias = torch.randn(E, H) if with_bias else None
    mask = (torch.rand(E, H) > 0.3).float() / 0.7 if with_mask else None
    value_is_key = terms == "key=value"
    edge_key = torch.randn(E, H, C) if "key" in terms else None
    edge_value = torch.randn(E, H, C) if "value" in terms and not value_is_key else None
    sinks = torch.randn(H) if with_bias else None
    leaves = [t.requires_grad_() for t in (q, k, v, att, bias, edge_key, edge_value, sinks)
              if t is not None]
    softcap = 1.5 if with_bias and not additive else 0.0  # (0: no cap)
    args = (q, k, v, att, bias, mask, edge_key, edge_value, sinks, edge_index, 0.5, 0.2, softcap,
            cpu.SCORE_KINDS[score], True, value_is_key)
    torch.library.opcheck(cpu._forward_op, args)

    out, alpha = cpu._forward_op(*args)[:2]
    squeeze = (lambda t: t.squeeze(-1)) if additive else (lambda t: t)
    _assert_operator_matches_reference(out, alpha, leaves, (squeeze(q), squeeze(k), v, edge_index),
                                       bias=bias, mask=mask, score=score, att=att,
                                       edge_key=edge_key,
                                       edge_value=edge_key if value_is_key else edge_value,
                                       softcap=softcap or None, sinks=sinks)

    saved = cpu._forward_impl(*(t.detach() if isinstance(t, torch.Tensor) else t for t in args))
    out, _, lse, rowptr, perm, src = saved
    torch.library.opcheck(cpu._backward_op, (
        torch.randn_like(out), torch.randn(E, H), q.detach(), k.detach(), v.detach(),
        *(None if t is None else t.detach() for t in (att, bias)), mask,
        *(None if t is None else t.detach() for t in (edge_key, edge_value)), out, lse, rowptr,
        perm, src, 0.5, 0.2, softcap, cpu.SCORE_KINDS[score], True, value_is_key))


@pytest.mark.parametrize("fn", ["edge_attention", "dense_attention"])
def test_autocast_inputs_do_not_compile_again_per_call(fn):
    """Under autocast the inputs are cast to its dtype; a tensor given twice stays one tensor,
    found by `is` (an id() of each input guarded on the tensor object: every call with new
    tensors of the same shapes compiled again, and fullgraph=True failed at the 9th)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    edge_index = random_graph(12, 40, seed=2)

    def attend(q, k, v):
        if fn == "edge_attention":
            return edge_attention(q, k, v, edge_index, backend="reference")
        return dense_attention(q, k, v, is_causal=True)

    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for seed in range(10):
            q, k, v = torch.randn(3, 12, 2, 4, generator=torch.Generator().manual_seed(seed))
            out = compiled(q, k, v)
            assert out.dtype == torch.bfloat16
            assert torch.equal(out, attend(q.bfloat16(), k.bfloat16(), v.bfloat16()))
    assert counter.frame_count == 1


@pytest.mark.parametrize("model", ["layer", "GraphTransformer"])
def test_export_with_dynamic_sizes_runs_on_other_graphs(model):
    """``torch.export`` with the node and edge counts dynamic: ``auto`` takes the ``cpu``
    kernels' operator there (its size rules would fix N and E, or fail to export), so the
    program runs on graphs of other sizes, dense ones included, as eager does."""
    from torch.export import Dim, export

    torch.manual_seed(0)
    module = (GraphSelfAttention(8, 4, heads=2) if model == "layer"
              else GraphTransformer(8, 8, 3, heads=2)).eval()
    x, edge_index = torch.randn(12, 8), torch.randint(0, 12, (2, 100))  # density 0.69
    nodes, edges = Dim("N", min=2, max=10**6), Dim("E", min=2, max=10**7)
    program = export(module, (x, edge_index), dynamic_shapes=({0: nodes}, {1: edges}))
    for n, e in [(12, 100), (50, 300), (7, 40)]:
        x, edge_index = torch.randn(n, 8), torch.randint(0, n, (2, e))
        with torch.no_grad():
            assert_close(program.module()(x, edge_index), module(x, edge_index))


@pytest.mark.parametrize("model", ["layer", "GAT"])
def test_an_exported_program_takes_a_graph_without_edges(model):
    """The node-id checks reduced over the edges (amax of an empty dimension): a program
    exported with a dynamic edge count failed on a graph without edges, which eager takes."""
    from torch.export import Dim, export

    torch.manual_seed(0)
    module = (GraphSelfAttention(16, 8, heads=2) if model == "layer" else GAT(16, 3)).eval()
    program = export(module, (torch.randn(12, 16), torch.randint(0, 12, (2, 40))),
                     dynamic_shapes=({0: Dim("N")}, {1: Dim("E")}))
    x, no_edges = torch.randn(5, 16), torch.empty(2, 0, dtype=torch.long)
    with torch.no_grad():
        assert_close(program.module()(x, no_edges), module(x, no_edges))


class _Positional(torch.nn.Module):
    """``layer(x, edge_index, pos=pos)``, or with ``edge_index=None`` the dense
    ``layer(x, is_causal=True)``, as a module of plain positional tensors for export."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor | None = None,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        if edge_index is None:
            return self.layer(x, is_causal=True)
        return self.layer(x, edge_index, pos=pos)


@pytest.mark.parametrize("dense, ntk", [(False, False), (True, False), (False, True)],
                         ids=["graph", "dense", "graph-dynamic-ntk"])
def test_rotary_grouped_layers_export_with_dynamic_sizes(dense, ntk):
    """A layer with a rotary embedding and grouped key heads exports with its node (or
    sequence) count dynamic, and the program runs on other sizes as eager does; with dynamic
    NTK scaling too, whose frequencies depend on the positions' values (past 10 here), QK-norm
    and a scale of its own."""
    from torch.export import Dim, export

    from graphattn import graphs, pe

    torch.manual_seed(0)
    if dense:
        module = _Positional(DenseSelfAttention(8, 8, 2, rotary=pe.RotaryPE(8),
                                                kv_heads=1)).eval()
        length = Dim("L", min=2, max=10**5)
        program = export(module, (torch.randn(2, 12, 8),), dynamic_shapes=({1: length},))
        for n in (12, 30, 5):
            x = torch.randn(2, n, 8)
            with torch.no_grad():
                assert_close(program.module()(x), module(x))
        return
    rotary = pe.RotaryPE(8, ntk_factor=2.0, original_length=10) if ntk else pe.RotaryPE(8)
    extra = dict(qk_norm="rms", scale=0.2) if ntk else {}
    module = _Positional(GraphSelfAttention(8, 8, 2, add_self_loops=False,
                                            rotary=rotary, kv_heads=1, **extra)).eval()
    x, edge_index, pos = torch.randn(12, 8), graphs.causal_graph(12), torch.arange(12)
    nodes, edges = Dim("N", min=2, max=10**6), Dim("E", min=2, max=10**7)
    program = export(module, (x, edge_index, pos),
                     dynamic_shapes=({0: nodes}, {1: edges}, {0: nodes}))
    for n in (12, 40, 5):
        x, edge_index, pos = torch.randn(n, 8), graphs.causal_graph(n), torch.arange(n) + 3
        with torch.no_grad():
            assert_close(program.module()(x, edge_index, pos), module(x, edge_index, pos))
