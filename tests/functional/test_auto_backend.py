import math

import pytest
import torch
from conftest import assert_close

from graphattn import graphs
from graphattn.functional import (
    attention,
    available_backends,
    dense_backend,
    edge_attention,
    select_backend,
)
from graphattn.functional.attention import dense_min_density, explicit_min_density
from graphattn.functional.dense_backend import DENSE_TENSORS_AT_PEAK, dense_peak_bytes
from graphattn.nn import GraphSelfAttention

CPU_BACKENDS = [b for b in available_backends() if b != "triton"]
# Every graph below is smaller than the first measured size: the first crossovers apply.
_, THRESHOLD, THRESHOLD_INFERENCE = attention.DENSE_CROSSOVER_CPU[0]  # training, inference
_, EXPLICIT, EXPLICIT_INFERENCE = attention.EXPLICIT_CROSSOVER_CPU[0]  # the weights needed


@pytest.mark.parametrize("min_density,table", [
    (dense_min_density, attention.DENSE_CROSSOVER_CPU),
    (explicit_min_density, attention.EXPLICIT_CROSSOVER_CPU)], ids=["fused", "explicit"])
def test_min_density_follows_the_measured_crossovers(min_density, table):
    for size, training, inference in table:
        assert min_density(size, size, training=True) == pytest.approx(training)
        assert min_density(size, size, training=False) == pytest.approx(inference)
    assert min_density(10, 10, training=True) == table[0][1]  # constant outside
    assert min_density(10**5, 10**5, training=False) == table[-1][2]
    (s0, t0, _), (s1, t1, _) = table[0], table[1]
    n = round(math.sqrt(s0 * s1))  # about half way between the two in log size
    expected = t0 + (t1 - t0) * math.log(n / s0) / math.log(s1 / s0)
    assert min_density(n, n, training=True) == pytest.approx(expected)
    # The size of a bipartite graph is the geometric mean of its two sides.
    assert min_density(s0, s1, training=True) == pytest.approx((t0 + t1) / 2)


def one_block(num_edges: int, n: int) -> torch.Tensor:
    """``num_edges`` copies of the edge 0 -> n - 1 (without their memory): a graph that does not
    split into diagonal blocks, so the whole graph's density decides."""
    return torch.tensor([[0], [n - 1]]).expand(2, num_edges)


def graph_with_density(n_dst: int, n_src: int, density: float, seed: int) -> torch.Tensor:
    """A simple graph (no repeated edge) with round(density * N_dst * N_src) random edges."""
    num_edges = round(density * n_dst * n_src)
    gen = torch.Generator().manual_seed(seed)
    pair = torch.randperm(n_dst * n_src, generator=gen)[:num_edges]
    return torch.stack([pair % n_src, pair // n_src])  # (2, E): source j, target i


# Graphs on both sides of the threshold: (N_dst, N_src, density, the side auto must pick).
SIDES = [
    (48, 48, THRESHOLD / 4, "cpu"),
    (48, 48, min(1.0, THRESHOLD * 4), "dense"),
    (30, 64, THRESHOLD / 3, "cpu"),
    (30, 64, min(1.0, THRESHOLD * 3), "dense"),
    (40, 40, 1.0, "dense"),
]


@pytest.mark.parametrize("n_dst,n_src,density,expected", SIDES,
                         ids=[f"{a}x{b}-{d:.3g}" for a, b, d, _ in SIDES])
def test_rule_picks_the_expected_side(n_dst, n_src, density, expected):
    edge_index = graph_with_density(n_dst, n_src, density, seed=0)
    q = torch.randn(n_dst, 2, 4, requires_grad=True)
    assert select_backend(q, edge_index, num_src=n_src) == expected


def test_inference_has_its_own_threshold():
    n = 50
    q = torch.randn(n, 2, 4, requires_grad=True)
    for density in (THRESHOLD, THRESHOLD_INFERENCE):
        edge_index = one_block(math.ceil(density * n * n), n)
        training = select_backend(q, edge_index)
        with torch.no_grad():
            no_grad = select_backend(q, edge_index)
        inference = select_backend(q.detach(), edge_index)
        assert training == ("dense" if density >= THRESHOLD else "cpu")
        assert no_grad == inference == ("dense" if density >= THRESHOLD_INFERENCE else "cpu")


def test_threshold_is_inclusive_and_counts_sources():
    n_dst, n_src = 20, 50
    at = math.ceil(THRESHOLD * n_dst * n_src)
    q = torch.randn(n_dst, 2, 4, requires_grad=True)
    assert select_backend(q, torch.zeros(2, at, dtype=torch.long), num_src=n_src) == "dense"
    assert select_backend(q, torch.zeros(2, at - 1, dtype=torch.long), num_src=n_src) == "cpu"
    # Without num_src the sources are counted as N_dst = 20: the same E is 2.5x denser.
    below = torch.zeros(2, round(at / 2), dtype=torch.long)
    assert select_backend(q, below, num_src=n_src) == "cpu"
    assert select_backend(q, below) == "dense"


def test_never_dense_when_the_matrices_do_not_fit():
    # 6 * 4096 * 200^2 * 4 bytes = 3.9 GB: many heads, so that the graph stays small (a
    # complete graph of the same size in 8 heads, 20,000 nodes, took 15 s to look at)
    n, heads = 200, 4096
    assert dense_peak_bytes(n, n, heads) > attention.DENSE_MAX_BYTES_CPU
    q = torch.empty(1, 1, 1).expand(n, heads, 16)  # the shape without the memory
    assert select_backend(q, one_block(n * n, n)) == "cpu"
    # The largest complete graph that fits goes dense.
    fits = int(math.sqrt(attention.DENSE_MAX_BYTES_CPU / (DENSE_TENSORS_AT_PEAK * heads * 4 + 2)))
    q = torch.empty(1, 1, 1).expand(fits, heads, 16)
    assert select_backend(q, one_block(fits**2, fits)) == "dense"


def test_memory_limit_is_inclusive_and_counts_the_itemsize(monkeypatch):
    """Dense when dense_peak_bytes of q's own itemsize is at most DENSE_MAX_BYTES_CPU: a limit of
    exactly those bytes still fits, one byte less does not (and float64 needs twice float32's)."""
    n, heads = 40, 2
    complete = torch.cartesian_prod(torch.arange(n), torch.arange(n)).t()
    q = torch.randn(n, heads, 4, dtype=torch.float64)
    need = 6 * heads * n * n * 8 + 2 * n * n  # by hand: six [H, N, N] float64 tensors, the mask
    monkeypatch.setattr(attention, "DENSE_MAX_BYTES_CPU", need)
    assert select_backend(q, complete) == "dense"
    monkeypatch.setattr(attention, "DENSE_MAX_BYTES_CPU", need - 1)
    assert select_backend(q, complete) == "cpu"
    assert select_backend(q.float(), complete) == "dense"  # float32 needs about half


def test_edge_attention_measures_the_density_over_its_sources(monkeypatch):
    """auto in edge_attention counts N_src = k.size(0): 30 targets, 300 sources and 270 edges
    are a sparse graph (density 0.03), though 270 edges over 30 x 30 pairs would be dense."""
    n_dst, n_src = 30, 300
    edge_index = graph_with_density(n_dst, n_src, 0.03, seed=0)
    assert edge_index.size(1) / (n_dst * n_dst) >= THRESHOLD  # dense if N_src were N_dst
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n_dst, 2, 4, generator=gen, requires_grad=True)
    k, v = (torch.randn(n_src, 2, 4, generator=gen) for _ in range(2))
    calls, real = [], dict(attention.BACKENDS)

    def spy(name):
        def call(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)
        return call

    for name in ("cpu", "dense"):
        monkeypatch.setitem(attention.BACKENDS, name, spy(name))
    edge_attention(q, k, v, edge_index, backend="auto")
    assert calls == ["cpu"]


def test_gatv2_takes_the_sparse_path_even_on_complete_graphs():
    q = torch.randn(64, 2, 4)
    complete = torch.cartesian_prod(torch.arange(64), torch.arange(64)).t()
    assert select_backend(q, complete) == "dense"
    assert select_backend(q, complete, score="gatv2") == "cpu"


def test_additive_queries_without_channels_take_the_sparse_path():
    """select_backend takes the additive score's [N_dst, H] queries, as edge_attention does."""
    complete = torch.cartesian_prod(torch.arange(64), torch.arange(64)).t()
    assert select_backend(torch.randn(64, 2), complete, score="additive") == "cpu"


def test_off_the_cpu_auto_takes_triton_where_its_kernels_run(monkeypatch):
    """Off the CPU (CUDA) the rule is use_triton_for(q): "triton", else "reference"."""
    q = torch.empty(8, 2, 4, device="meta")
    edge_index = torch.empty(2, 0, dtype=torch.long, device="meta")
    for runs, expected in ((True, "triton"), (False, "reference")):
        monkeypatch.setattr(attention, "use_triton_for", lambda q, runs=runs: runs)
        assert select_backend(q, edge_index) == expected


def test_empty_graphs_take_the_sparse_path():
    assert select_backend(torch.randn(0, 2, 4), torch.zeros(2, 0, dtype=torch.long)) == "cpu"
    assert select_backend(torch.randn(5, 2, 4), torch.zeros(2, 0, dtype=torch.long)) == "cpu"


@pytest.mark.parametrize("weights", [False, True], ids=["out", "weights"])
@pytest.mark.parametrize("score", ["dot", "additive"])
@pytest.mark.parametrize("n_dst,n_src,density,expected", SIDES,
                         ids=[f"{a}x{b}-{d:.3g}" for a, b, d, _ in SIDES])
def test_auto_equals_every_backend(n_dst, n_src, density, expected, score, weights,
                                   monkeypatch):
    """auto goes to the side the rule promises for training: the additive score always to
    the sparse kernels, the dot score by density, from explicit_min_density on when the
    weights are returned; and it equals every CPU backend, out, weights and gradients."""
    if score == "additive" or (weights and density < EXPLICIT):
        expected = "cpu"
    edge_index = graph_with_density(n_dst, n_src, density, seed=1)
    E, H, C = edge_index.size(1), 2, 4
    gen = torch.Generator().manual_seed(2)
    shape = (H, C) if score == "dot" else (H,)
    q, k = (torch.randn(n, *shape, generator=gen, dtype=torch.float64) for n in (n_dst, n_src))
    v = torch.randn(n_src, H, C, generator=gen, dtype=torch.float64)
    bias = torch.randn(E, H, generator=gen, dtype=torch.float64)
    out_weights = torch.randn(n_dst, H, C, generator=gen, dtype=torch.float64)

    calls = []
    chosen = attention.BACKENDS[expected]

    def spy(*args, **kwargs):
        calls.append(expected)
        return chosen(*args, **kwargs)

    def run(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        result = edge_attention(*leaves[:3], edge_index, bias=leaves[3], score=score,
                                return_attention=weights, backend=backend)
        out, alpha = result if weights else (result, out_weights.new_zeros(0))
        loss = (out * out_weights).sum() + alpha.square().sum()
        return out, alpha, torch.autograd.grad(loss, leaves)

    with monkeypatch.context() as m:
        m.setitem(attention.BACKENDS, expected, spy)
        auto = run("auto")
    assert calls == [expected]  # auto went to the side the rule promises
    for backend in CPU_BACKENDS:
        out, alpha, grads = run(backend)
        assert_close(auto[0], out)
        assert_close(auto[1], alpha)
        for g, r in zip(auto[2], grads, strict=True):
            assert_close(g, r)


@pytest.mark.parametrize("density", [THRESHOLD_INFERENCE / 2, min(1.0, THRESHOLD_INFERENCE * 2),
                                     (EXPLICIT_INFERENCE + 1) / 2, 1.0])
def test_auto_equals_every_backend_without_grad(density, monkeypatch):
    """Inference that returns the weights: dense from the rule's threshold and
    explicit_min_density on, and the same out and weights as every backend."""
    n = 40
    edge_index = graph_with_density(n, n, density, seed=5)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(n, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    floor = max(THRESHOLD_INFERENCE, EXPLICIT_INFERENCE)
    expected = "dense" if density >= floor else "cpu"
    calls = []
    chosen = attention.BACKENDS[expected]

    def spy(*args, **kwargs):
        calls.append(expected)
        return chosen(*args, **kwargs)

    with torch.no_grad():
        with monkeypatch.context() as m:
            m.setitem(attention.BACKENDS, expected, spy)
            auto = edge_attention(q, k, v, edge_index, return_attention=True)
        assert calls == [expected]
        for backend in CPU_BACKENDS:
            out, alpha = edge_attention(q, k, v, edge_index, return_attention=True,
                                        backend=backend)
            assert_close(auto[0], out)
            assert_close(auto[1], alpha)


def test_weights_or_dropout_in_training_take_the_explicit_crossover(monkeypatch):
    """Training that returns the weights or drops some out takes dense only from
    explicit_min_density's training crossover on, inference that returns them from its
    inference crossover on; calls without them keep the measured rule; edge_attention passes
    dropout and weights to it."""
    q = torch.randn(48, 2, 4, requires_grad=True)
    assert THRESHOLD_INFERENCE + 0.1 < EXPLICIT < EXPLICIT_INFERENCE - 0.05
    middle = graph_with_density(48, 48, (THRESHOLD_INFERENCE + EXPLICIT) / 2, seed=7)
    between = graph_with_density(48, 48, (EXPLICIT + EXPLICIT_INFERENCE) / 2, seed=7)
    complete = graph_with_density(48, 48, 1.0, seed=7)
    assert select_backend(q, middle) == "dense"
    assert select_backend(q, middle, needs_weights=True) == "cpu"
    assert select_backend(q.detach(), middle) == "dense"
    assert select_backend(q.detach(), middle, needs_weights=True) == "cpu"
    assert select_backend(q, between, needs_weights=True) == "dense"
    assert select_backend(q.detach(), between, needs_weights=True) == "cpu"
    assert select_backend(q, complete, needs_weights=True) == "dense"
    assert select_backend(q.detach(), complete, needs_weights=True) == "dense"
    calls = []
    for name in ("cpu", "dense"):
        chosen = attention.BACKENDS[name]
        monkeypatch.setitem(attention.BACKENDS, name,
                            lambda *a, chosen=chosen, name=name, **kw: calls.append(name)
                            or chosen(*a, **kw))
    for dropout_p, training in ((0.5, True), (0.5, False), (0.0, True)):
        edge_attention(q, q, q, middle, dropout_p=dropout_p, training=training)
    edge_attention(q, q, q, middle, return_attention=True)
    assert calls == ["cpu", "dense", "dense", "cpu"]


@pytest.mark.parametrize("training", [True, False], ids=["training", "inference"])
def test_larger_whole_graphs_need_a_denser_graph_for_the_explicit_softmax(training):
    """Between the first and the last crossover of EXPLICIT_CROSSOVER_CPU a graph goes dense
    with the weights needed when it is small, and keeps the sparse kernels when it is large:
    the dense matrices of the larger one leave the cache."""
    (small, *low), (large, *high) = (attention.EXPLICIT_CROSSOVER_CPU[i] for i in (0, -1))
    column = 0 if training else 1
    density = (low[column] + high[column]) / 2
    for n, expected in ((small, "dense"), (large, "cpu")):
        q = torch.randn(n, 2, 4, requires_grad=training)
        edge_index = one_block(round(density * n * n), n)
        assert select_backend(q, edge_index, needs_weights=True) == expected, n
        assert select_backend(q, edge_index) == "dense", n  # the fused crossover lies below


def test_small_blocks_take_the_dense_path_from_a_lower_density_in_training():
    """Causal blocks (density ~0.5, below EXPLICIT_MIN_DENSITY_CPU): blocks of at most
    EXPLICIT_SMALL_BLOCK nodes go dense in training with the weights needed, larger ones and
    inference keep the sparse kernels."""
    assert (attention.EXPLICIT_MIN_DENSITY_CPU_SMALL_BLOCKS < 0.5
            < attention.EXPLICIT_MIN_DENSITY_CPU)
    small = attention.EXPLICIT_SMALL_BLOCK // 2
    for size, blocks, expected in ((small, 8, "dense"),
                                   (attention.EXPLICIT_SMALL_BLOCK, 4, "dense"),  # at most
                                   (512, 2, "cpu")):
        edge_index = graphs.repeat_graph(graphs.causal_graph(size), size, blocks)
        q = torch.randn(size * blocks, 2, 4, requires_grad=True)
        assert select_backend(q, edge_index, needs_weights=True) == expected, size
        assert select_backend(q.detach(), edge_index, needs_weights=True) == "cpu", size


def test_blocks_in_inference_need_the_inference_density_for_the_explicit_softmax():
    """Windowed blocks of 64 nodes at block density 0.76, between EXPLICIT_MIN_DENSITY_CPU and
    EXPLICIT_MIN_DENSITY_CPU_INFERENCE: with the weights needed, dense in training, sparse in
    inference."""
    edge_index = graphs.repeat_graph(graphs.window_graph(64, 32), 64, 8)
    density = edge_index.size(1) / (8 * 64 * 64)
    assert (attention.EXPLICIT_MIN_DENSITY_CPU < density
            < attention.EXPLICIT_MIN_DENSITY_CPU_INFERENCE)
    q = torch.randn(512, 2, 4, requires_grad=True)
    assert select_backend(q, edge_index, needs_weights=True) == "dense"
    assert select_backend(q.detach(), edge_index, needs_weights=True) == "cpu"


def test_layer_auto_equals_reference_on_a_dense_graph():
    n = 32
    edge_index = graph_with_density(n, n, 0.9, seed=3)
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(0)
    auto = GraphSelfAttention(16, 8, heads=2, backend="auto")
    ref = GraphSelfAttention(16, 8, heads=2, backend="reference")
    ref.load_state_dict(auto.state_dict())
    out, (ei, alpha) = auto(x, edge_index, return_attention_weights=True)
    ref_out, (_, ref_alpha) = ref(x, edge_index, return_attention_weights=True)
    assert select_backend(torch.empty(n, 2, 8), ei) == "dense"
    assert_close(out, ref_out)
    assert_close(alpha, ref_alpha)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_picks_triton_when_it_imports_and_never_dense():
    """On CUDA, fp32 q: "triton" with Triton installed, else "reference"; never "dense" (no
    crossover has been measured on a GPU), not even on a complete graph."""
    q = torch.randn(8, 2, 4, device="cuda")
    complete = torch.cartesian_prod(torch.arange(8), torch.arange(8)).t().cuda()
    expected = "triton" if attention.triton_available() else "reference"
    assert select_backend(q, complete) == expected
    assert select_backend(q.double(), complete) == "reference"  # the kernels refuse float64


def test_available_backends_lists_triton_only_when_it_imports(monkeypatch):
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    assert available_backends() == ["reference", "cpu", "dense"]
    monkeypatch.setattr(attention, "triton_available", lambda: True)
    assert available_backends() == ["reference", "cpu", "triton", "dense"]


def test_auto_on_cuda_promotes_a_float64_input_beside_float32_q(triton_interpreter,
                                                                 monkeypatch):
    """Mixed dtypes are promoted on every backend but "triton", whose kernels refuse float64:
    auto must not send a float64 bias (or k, v) to it because q is float32."""
    calls = []
    triton = attention.BACKENDS["triton"]

    def spy(*args, **kwargs):
        calls.append("triton")
        return triton(*args, **kwargs)

    # the rule on CUDA, where use_triton_for(q) holds for a float32 q
    monkeypatch.setattr(attention, "_select", lambda q, *args, **kwargs: ("triton", None))
    monkeypatch.setitem(attention.BACKENDS, "triton", spy)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, 4, generator=gen) for _ in range(3))
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 0, 0]])
    bias = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    out = edge_attention(q, k, v, edge_index, bias=bias)
    assert calls == []
    assert out.dtype == torch.float64
    assert_close(out, edge_attention(q, k, v, edge_index, bias=bias, backend="reference"))
    out = edge_attention(q, k, v.double(), edge_index)
    assert calls == [] and out.dtype == torch.float64
    for term in ("edge_key", "edge_value"):  # a float64 per-edge term
        out = edge_attention(q, k, v, edge_index,
                             **{term: torch.randn(7, 2, 4, generator=gen, dtype=torch.float64)})
        assert calls == [] and out.dtype == torch.float64, term
    edge_attention(q, k, v, edge_index, bias=bias.float())  # all float32: the kernels
    assert calls == ["triton"]


# ---- block-diagonal graphs: judged by the density over their blocks ----

def test_block_min_density_follows_the_measured_crossovers():
    table = attention.DENSE_CROSSOVER_CPU_BLOCKS
    for size, training, inference in table:
        assert attention.block_min_density(size, training=True) == pytest.approx(training)
        assert attention.block_min_density(size, training=False) == pytest.approx(inference)
    assert attention.block_min_density(2, training=True) == table[0][1]  # constant outside
    assert attention.block_min_density(10**6, training=False) == table[-1][2]


def test_a_batch_of_causal_sequences_takes_dense_blocks():
    """16 causal sequences of 64 tokens: density 0.03 over the whole graph (sparse by the
    whole-graph rule), 0.51 over its blocks (dense)."""
    edge_index = graphs.repeat_graph(graphs.causal_graph(64), 64, 16)
    n = 16 * 64
    q = torch.randn(n, 2, 4, requires_grad=True)
    assert edge_index.size(1) / n**2 < dense_min_density(n, n, training=True)
    assert select_backend(q, edge_index) == "dense"
    assert select_backend(q.detach(), edge_index) == "dense"


@pytest.mark.parametrize("size,radius,expected", [(64, 1, "cpu"), (64, 16, "dense"),
                                                  (16, 2, "cpu"), (16, 7, "dense")])
def test_windowed_batches_go_dense_from_the_block_crossover(size, radius, expected):
    edge_index = graphs.repeat_graph(graphs.window_graph(size, radius), size, 8)
    blocks_density = edge_index.size(1) / (8 * size * size)
    threshold = attention.block_min_density(size, training=True)
    assert (blocks_density >= threshold) == (expected == "dense")  # the case is on its side
    q = torch.randn(8 * size, 2, 4, requires_grad=True)
    assert select_backend(q, edge_index) == expected


def test_block_memory_limit_counts_the_blocks_pairs(monkeypatch):
    """4 causal blocks of 32 nodes: 4 * 32^2 pairs, not 128^2, must fit."""
    edge_index = graphs.repeat_graph(graphs.causal_graph(32), 32, 4)
    q = torch.randn(128, 2, 4, requires_grad=True)
    monkeypatch.setattr(attention, "DENSE_CROSSOVER_CPU", ((256, 1.0, 1.0),))  # never whole
    need = dense_peak_bytes(4 * 32 * 32, 1, 2)
    monkeypatch.setattr(attention, "DENSE_MAX_BYTES_CPU", need)
    assert select_backend(q, edge_index) == "dense"
    monkeypatch.setattr(attention, "DENSE_MAX_BYTES_CPU", need - 1)
    assert select_backend(q, edge_index) == "cpu"


def test_block_threshold_is_inclusive(monkeypatch):
    """4 causal blocks of 32 nodes: block density 0.515625 exactly (0.129 over the whole
    graph, sparse by the whole-graph rule); dense at a block crossover of that density, not
    above it."""
    edge_index = graphs.repeat_graph(graphs.causal_graph(32), 32, 4)
    q = torch.randn(128, 2, 4, requires_grad=True)
    density = edge_index.size(1) / (4 * 32 * 32)
    assert density == 0.515625
    for crossover, expected in ((density, "dense"), (math.nextafter(density, 1.0), "cpu")):
        monkeypatch.setattr(attention, "DENSE_CROSSOVER_CPU_BLOCKS",
                            ((16, crossover, crossover),))
        assert select_backend(q, edge_index) == expected


def test_auto_finds_the_blocks_once_and_equals_the_reference(monkeypatch):
    edge_index = graphs.repeat_graph(graphs.causal_graph(40), 40, 6)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(240, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    found = []
    real = dense_backend.diagonal_blocks

    def spy(*args):
        found.append(real(*args))
        return found[-1]

    monkeypatch.setattr(attention, "diagonal_blocks", spy)
    monkeypatch.setattr(dense_backend, "diagonal_blocks", spy)
    out = edge_attention(q, k, v, edge_index)
    assert len(found) == 1 and found[0] is not None
    ref = edge_attention(q, k, v, edge_index, backend="reference")
    assert_close(out, ref)
    for g, r in zip(torch.autograd.grad(out.square().sum(), (q, k, v)),
                    torch.autograd.grad(ref.square().sum(), (q, k, v)), strict=True):
        assert_close(g, r)


def test_a_connected_sparse_graph_keeps_the_whole_graph_rule():
    edge_index = graphs.chain_graph(500)
    q = torch.randn(500, 2, 4, requires_grad=True)
    assert dense_backend.diagonal_blocks(edge_index, 500) is None
    assert select_backend(q, edge_index) == "cpu"


@pytest.mark.parametrize("graph,n", [
    (torch.arange(64).repeat(2, 1), 64),  # self-loops alone: 64 blocks of one node
    (graphs.repeat_graph(graphs.complete_graph(8), 8, 64), 512),  # complete blocks of 8
], ids=["self-loops", "complete-blocks-of-8"])
def test_blocks_below_the_smallest_measured_size_stay_sparse(graph, n):
    """Dense blocks of fewer than 16 nodes were never measured faster (self-loops alone ran
    3.5x slower as 4096 dense blocks of one node): "cpu", even at block density 1."""
    layout = dense_backend.diagonal_blocks(graph, n)
    assert layout is not None and graph.size(1) == layout.pairs  # every block complete
    assert graph.size(1) / n**2 < dense_min_density(n, n, training=True)  # sparse as a whole
    assert layout.size < attention.DENSE_CROSSOVER_CPU_BLOCKS[0][0]
    assert select_backend(torch.randn(n, 2, 4, requires_grad=True), graph) == "cpu"


def test_block_size_is_that_of_an_average_pair():
    """One block of 32 nodes among 32 of one node: pairs of the large block dominate."""
    edges = torch.cat([graphs.complete_graph(32), torch.arange(32, 64).repeat(2, 1)], dim=1)
    layout = dense_backend.diagonal_blocks(edges, 64)
    assert layout.size == pytest.approx((32**3 + 32) / (32**2 + 32))
    assert select_backend(torch.randn(64, 2, 4, requires_grad=True), edges) == "dense"


@pytest.mark.parametrize("call,error,match", [
    (lambda q, ei: select_backend(q, ei, score="bogus"), ValueError,
     r"score must be one of \('dot', 'additive', 'gatv2'\), got 'bogus'"),
    (lambda q, ei: select_backend(q, ei.float()), TypeError,
     r"edge_index must have an integer dtype \(int64 or int32\), got torch.float32"),
    (lambda q, ei: select_backend(q[0, 0], ei), ValueError,
     r"q must have shape \[N_dst, H, C\] or \[N_dst, H\], got \[8\]"),
    (lambda q, ei: select_backend(q, ei + 3), ValueError,
     r"edge_index\[0\] \(sources\) must be < the number of source nodes 5, got a maximum of 7"),
    (lambda q, ei: select_backend(q, ei, num_src=-1), ValueError,
     r"num_src must be a non-negative integer, got -1"),
    # a truthy string flipped the answer; a cap or q that edge_attention refuses got one
    (lambda q, ei: select_backend(q, ei, needs_weights="no"), TypeError,
     r"needs_weights must be a bool, got 'no' \(a str\)"),
    (lambda q, ei: select_backend(q, ei, softcap=-1.0), ValueError,
     r"softcap must be positive"),
    (lambda q, ei: select_backend(q, ei, score="additive", softcap=30.0), ValueError,
     r"softcap caps the dot and gatv2 scores"),
    (lambda q, ei: select_backend(q.long(), ei), TypeError,
     r"q must have a floating-point dtype, got torch.int64"),
])
def test_select_backend_checks_its_arguments(call, error, match):
    """As edge_attention does: a wrong score or graph must not get an answer."""
    q = torch.randn(5, 2, 8)
    edge_index = torch.tensor([[0, 1, 4], [1, 2, 3]])
    assert select_backend(q, edge_index) in ("cpu", "dense")  # the valid call answers
    with pytest.raises(error, match=match):
        call(q, edge_index)
