"""TensorCache: values derived from a tensor, kept while the tensor lives unmodified.

The caches apply to CUDA tensors only (``CACHED_DEVICE_TYPES``); these tests add ``"cpu"`` to
that set, so that the same code runs here on CPU tensors.
"""

from __future__ import annotations

import gc

import pytest
import torch

from graphattn import _checks, _tensor_cache
from graphattn._checks import check_edge_index
from graphattn._tensor_cache import TensorCache, clear_graph_caches
from graphattn.functional import edge_attention
from graphattn.nn import GraphSelfAttention


@pytest.fixture
def cache_on_cpu(monkeypatch):
    monkeypatch.setattr(_tensor_cache, "CACHED_DEVICE_TYPES", {"cuda", "cpu"})


class Counter:
    """``compute`` that returns the tensor's sum and counts its calls."""

    def __init__(self, tensor):
        self.tensor, self.calls = tensor, 0

    def __call__(self):
        self.calls += 1
        return int(self.tensor.sum())


def test_value_is_computed_once_per_unmodified_tensor(cache_on_cpu):
    cache = TensorCache(max_entries=4)
    t = torch.tensor([1, 2, 3])
    count = Counter(t)
    assert cache.get(t, "a", count) == 6
    assert cache.get(t, "a", count) == 6
    assert count.calls == 1
    assert cache.get(t, "b", count) == 6 and count.calls == 2  # the extra key is part of it
    assert cache.get(t.clone(), "a", count) == 6 and count.calls == 3  # another tensor


@pytest.mark.parametrize("change", ["in_place", "through_a_view", "set_", "data_replaced",
                                    "data_narrowed", "data_reinterpreted"])
def test_changed_tensor_is_computed_again(cache_on_cpu, change):
    cache = TensorCache(max_entries=4)
    t = torch.tensor([[1, 2, 3], [4, 5, 6]])
    count = Counter(t)
    assert cache.get(t, None, count) == 21
    if change == "in_place":
        t.add_(1)
    elif change == "through_a_view":
        t[1][0] = 100  # a view shares the version counter
    elif change == "set_":
        t.set_(torch.tensor([[7, 7, 7], [7, 7, 7]]))
    # assigning .data keeps the version counter: other memory, shape or dtype tell instead
    elif change == "data_replaced":
        t.data = torch.tensor([[7, 7, 7], [7, 7, 7]])
    elif change == "data_narrowed":
        t.data = t[:1]  # the same memory, shape (1, 3)
    else:
        t.data = t.view(torch.float64)  # the same memory, shape and strides
    expected = int(t.sum())
    assert cache.get(t, None, count) == expected
    assert count.calls == 2


def test_entry_is_dropped_when_its_tensor_is_freed(cache_on_cpu):
    cache = TensorCache(max_entries=4)
    t = torch.arange(5)
    cache.get(t, None, Counter(t))
    assert len(cache) == 1
    del t
    gc.collect()
    assert len(cache) == 0


@pytest.mark.parametrize("touch", ["hit", "recompute"])
def test_least_recently_used_entry_goes_first(cache_on_cpu, touch):
    """A hit, or a value computed again for a changed tensor, makes its entry the most
    recent."""
    cache = TensorCache(max_entries=2)
    a, b, c = torch.arange(3), torch.arange(4), torch.arange(5)
    counts = {name: Counter(t) for name, t in (("a", a), ("b", b), ("c", c))}
    cache.get(a, None, counts["a"])
    cache.get(b, None, counts["b"])
    if touch == "recompute":
        a.add_(1)
    cache.get(a, None, counts["a"])  # a is now the most recent
    cache.get(c, None, counts["c"])  # drops b
    assert len(cache) == 2
    cache.get(a, None, counts["a"])
    cache.get(b, None, counts["b"])
    recomputed = touch == "recompute"
    assert (counts["a"].calls, counts["b"].calls, counts["c"].calls) == (1 + recomputed, 2, 1)


def test_nothing_is_kept_while_torch_compile_traces(cache_on_cpu):
    # dynamo runs get() on tensors whose type reads as Tensor: is_compiling() refuses them
    cache = TensorCache(max_entries=4)
    t = torch.tensor([1, 2, 3])
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: cache.get(t, None, lambda: t * 2) + 1, backend="eager")
    assert compiled(t).tolist() == [3, 5, 7]
    assert len(cache) == 0


def test_nothing_is_kept_outside_the_cached_devices():
    # by default only CUDA tensors are cached: CPU tensors may share memory with numpy arrays
    assert _tensor_cache.CACHED_DEVICE_TYPES == {"cuda"}
    cache = TensorCache(max_entries=4)
    t = torch.arange(4)
    count = Counter(t)
    cache.get(t, None, count)
    cache.get(t, None, count)
    assert count.calls == 2 and len(cache) == 0


def test_inference_tensors_and_subclasses_are_not_kept(cache_on_cpu):
    cache = TensorCache(max_entries=4)
    with torch.inference_mode():
        t = torch.arange(4)  # no version counter
    count = Counter(t)
    cache.get(t, None, count)
    cache.get(t, None, count)
    assert count.calls == 2

    class Sub(torch.Tensor):
        pass

    s = torch.arange(4).as_subclass(Sub)
    count = Counter(s)
    cache.get(s, None, count)
    cache.get(s, None, count)
    assert count.calls == 2 and len(cache) == 0


def test_nothing_is_served_or_kept_while_a_cuda_graph_is_captured(cache_on_cpu, monkeypatch):
    # A replay runs the recorded kernels only: a value served at capture would outlive a
    # change of its tensor's contents between replays. Capture is simulated here (no GPU).
    cache = TensorCache(max_entries=4)
    t = torch.tensor([1, 2, 3])
    count = Counter(t)
    cache.get(t, None, count)  # kept, as in a warm-up step before capture
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cache.get(t, None, count)
    cache.get(t, None, count)
    assert count.calls == 3
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    cache.get(t, None, count)
    assert count.calls == 3 and len(cache) == 1


def test_check_edge_index_reads_bounds_back_once_per_unmodified_graph(cache_on_cpu,
                                                                      monkeypatch):
    reads = []
    bounds = _checks._edge_index_bounds

    def counting_bounds(edge_index):
        reads.append(edge_index.size(1))
        return bounds(edge_index)

    monkeypatch.setattr(_checks, "_edge_index_bounds", counting_bounds)
    monkeypatch.setattr(_checks, "_EDGE_INDEX_BOUNDS", TensorCache(max_entries=4))
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    check_edge_index(edge_index, num_src=3, num_dst=3)
    check_edge_index(edge_index, num_src=3, num_dst=3)
    assert reads == [3]
    # the kept bounds are compared with the node counts of each call
    with pytest.raises(ValueError, match=r"edge_index\[1\] \(targets\) must be < the number "
                                         r"of target nodes 2, got a maximum of 2"):
        check_edge_index(edge_index, num_src=3, num_dst=2)
    assert reads == [3]
    edge_index[0, 1] = 7  # modified in place: read again, and refused
    with pytest.raises(ValueError, match=r"edge_index\[0\] \(sources\) must be < the number "
                                         r"of source nodes 3, got a maximum of 7"):
        check_edge_index(edge_index, num_src=3, num_dst=3)
    assert reads == [3, 3]


def test_value_modified_through_a_handed_out_tensor_is_computed_again(cache_on_cpu):
    # A caller may return a kept tensor to the user (the layer returns its self-looped
    # edge_index with the attention weights); writing into it must not leave a stale entry.
    cache = TensorCache(max_entries=4)
    t = torch.tensor([1, 2, 3])
    calls = []

    def compute():
        calls.append(1)
        return (t * 2, t.sum())

    doubled, _ = cache.get(t, None, compute)
    assert cache.get(t, None, compute)[0] is doubled and len(calls) == 1
    doubled.add_(1)
    assert cache.get(t, None, compute)[0].tolist() == [2, 4, 6]
    assert len(calls) == 2


def test_value_holding_the_key_of_another_entry_can_be_dropped(cache_on_cpu):
    # Dropping an entry frees its value; when that value is the key of another entry, that
    # entry's callback runs while the cache is busy: no deadlock, and nothing left behind.
    cache = TensorCache(max_entries=2)
    first = torch.arange(3)
    derived = cache.get(first, None, lambda: first + 1)  # kept only by first's entry below
    cache.get(derived, None, lambda d=derived: d + 1)
    del derived
    other = torch.arange(4)
    cache.get(other, None, lambda: other + 1)  # drops first's entry, which frees derived
    assert len(cache) == 1


def test_value_computed_in_inference_mode_serves_autograd_later(cache_on_cpu):
    # An evaluation under torch.inference_mode() fills the cache; the training step after it
    # must get a normal tensor (inference tensors have no version counter and cannot be saved
    # for backward).
    cache = TensorCache(max_entries=4)
    t = torch.tensor([2, 0, 1])
    with torch.inference_mode():
        kept = cache.get(t, None, lambda: t.argsort())
    assert not kept.is_inference()
    assert cache.get(t, None, lambda: t.argsort()) is kept
    w = torch.randn(3, requires_grad=True)
    w[kept].square().sum().backward()  # the index is saved for backward
    assert torch.equal(w.grad, 2 * w.detach())


def test_clearing_the_caches_lets_swap_tensors_take_a_kept_graph(cache_on_cpu):
    # torch.utils.swap_tensors (load_state_dict and module.to() under
    # torch.__future__.set_swap_module_params_on_conversion(True)) refuses a tensor that has a
    # weak reference, which each kept entry holds; clear_graph_caches drops them.
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    GraphSelfAttention(4, 4, heads=2)(torch.randn(3, 4), edge_index)  # bounds, self-loops
    other = edge_index.flip(0)
    with pytest.raises(RuntimeError, match="weakref"):
        torch.utils.swap_tensors(edge_index, other)
    clear_graph_caches()
    torch.utils.swap_tensors(edge_index, other)
    assert edge_index.tolist() == [[1, 2, 0], [0, 1, 2]]


def test_edge_index_check_reads_nothing_back_while_a_cuda_graph_is_captured(monkeypatch):
    """A read back to the host is not allowed while a CUDA graph is captured: there the check
    is the asserts of torch.compile's trace, recorded and run at each replay (as here, on CPU,
    at once), and the bounds are neither read nor kept."""
    monkeypatch.setattr(_checks, "capturing_cuda_graph", lambda: True)
    monkeypatch.setattr(_tensor_cache, "capturing_cuda_graph", lambda: True)

    def no_read_back(values):
        raise AssertionError("read back to the host during capture")

    monkeypatch.setattr(_checks, "host_list", no_read_back)
    check_edge_index(torch.tensor([[0, 2, 1], [1, 0, 2]]), 3, 3)
    for bad, sizes in (([[0, -1], [1, 0]], (3, 3)), ([[0, 3], [1, 0]], (3, 3)),
                       ([[0, 1], [1, 2]], (3, 2))):
        with pytest.raises(RuntimeError, match="edge_index"):
            check_edge_index(torch.tensor(bad), *sizes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: its streams")
def test_values_are_kept_per_cuda_stream():
    """A value made on one stream is not served on another (it would be read there before
    its kernels finished, and its memory freed to the first stream while the other reads)."""
    cache, calls = TensorCache(max_entries=4), []
    t = torch.arange(6, device="cuda")

    def compute():
        calls.append(torch.cuda.current_stream().cuda_stream)
        return (t * 2,)

    first = cache.get(t, None, compute)
    assert cache.get(t, None, compute) is first and len(calls) == 1
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        other = cache.get(t, None, compute)
        assert other is not first and cache.get(t, None, compute) is other
    assert calls == [torch.cuda.current_stream().cuda_stream, side.cuda_stream]
    assert cache.get(t, None, compute) is first


@pytest.mark.parametrize("write", ["setitem", "add_", "copy_"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_write_through_an_edge_index_wrapper_is_seen(cache_on_cpu, write, dtype):
    """PyG's ``EdgeIndex`` writes into the tensor it wraps without bumping that tensor's
    version counter (only its own moves), and the caches key on the wrapped tensor: the int64
    copy of an int32 graph, and the graph with self-loops of a layer, must be derived again."""
    EdgeIndex = pytest.importorskip("torch_geometric").EdgeIndex
    torch.manual_seed(0)
    n = 6
    q, k, v = torch.randn(3, n, 2, 4).unbind(0)
    ring = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 0]], dtype=dtype)
    ei = EdgeIndex(ring.clone(), sparse_size=(n, n))
    layer = GraphSelfAttention(4, 3, heads=2, backend="reference")
    x = torch.randn(n, 4)
    edge_attention(q, k, v, ei, backend="reference")  # what the first calls derive is kept
    layer(x, ei)
    changed = ring.clone()
    changed[1, 0] = 3  # the edge 0 -> 1 becomes 0 -> 3: node 1 keeps no in-edge
    if write == "setitem":
        ei[1, 0] = 3
    elif write == "add_":
        ei.add_(changed - ring)
    else:
        ei.copy_(changed)
    assert torch.equal(ei.as_tensor(), changed)
    assert torch.equal(edge_attention(q, k, v, ei, backend="reference"),
                       edge_attention(q, k, v, changed, backend="reference"))
    assert torch.equal(edge_attention(q, k, v, ei, backend="reference")[1], torch.zeros(2, 4))
    assert torch.equal(layer(x, ei), layer(x, changed))


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
def test_torch_func_transforms_take_the_graph_as_an_argument(cache_on_cpu, backend):
    """``torch.func.grad(loss)(params, x, edge_index)``: the transforms wrap the graph too, in
    a tensor without storage, which the caches must not take as a key."""
    torch.manual_seed(0)
    layer = GraphSelfAttention(5, 3, heads=2, backend=backend)
    x = torch.randn(6, 5, dtype=torch.float64)
    layer.double()
    params = {name: p.detach() for name, p in layer.named_parameters()}
    edge_index = torch.tensor([[0, 1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 0, 3]])

    def loss(params, x, edge_index):
        return torch.func.functional_call(layer, params, (x, edge_index)).square().sum()

    grads = torch.func.grad(loss)(params, x, edge_index)
    layer.zero_grad()
    loss(dict(layer.named_parameters()), x, edge_index).backward()
    for name, p in layer.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)
    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(
        params, torch.stack([x, 2 * x]), edge_index)
    torch.testing.assert_close({name: g[0] for name, g in batched.items()}, grads)
    q = torch.randn(6, 2, 4, dtype=torch.float64)
    jac = torch.func.jacrev(lambda q, e: edge_attention(q, q, q, e, backend=backend))(
        q, edge_index)
    assert jac.shape == (6, 2, 4, 6, 2, 4) and torch.isfinite(jac).all()
