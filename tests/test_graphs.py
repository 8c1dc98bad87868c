"""Attention-pattern builders and conversions, against brute-force edge lists."""

from __future__ import annotations

import re
import warnings

import networkx as nx
import numpy as np
import pytest
import torch

from graphattn import graphs, pe


def brute_force(n: int, allowed) -> torch.Tensor:
    """Every edge j -> i with ``allowed(i, j)``, sorted by target, then source."""
    pairs = [(j, i) for i in range(n) for j in range(n) if allowed(i, j)]
    if not pairs:
        return torch.empty(2, 0, dtype=torch.long)
    return torch.tensor(pairs, dtype=torch.long).t()


def assert_edges_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.int64
    assert actual.shape == (2, expected.size(1))
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("n", [0, 1, 2, 7])
@pytest.mark.parametrize("self_loops", [True, False])
def test_complete_graph(n, self_loops):
    expected = brute_force(n, lambda i, j: self_loops or i != j)
    assert_edges_equal(graphs.complete_graph(n, self_loops=self_loops), expected)


@pytest.mark.parametrize("n", [0, 1, 2, 6])
def test_chain_graph(n):
    assert_edges_equal(graphs.chain_graph(n), brute_force(n, lambda i, j: abs(i - j) == 1))
    assert_edges_equal(graphs.chain_graph(n, directed=True),
                       brute_force(n, lambda i, j: i - j == 1))


@pytest.mark.parametrize("n", [0, 1, 5])
def test_causal_graph(n):
    assert_edges_equal(graphs.causal_graph(n), brute_force(n, lambda i, j: j <= i))


@pytest.mark.parametrize("n,radius", [(0, 1), (1, 0), (6, 0), (9, 2), (5, 4), (4, 10)])
def test_window_graph(n, radius):
    assert_edges_equal(graphs.window_graph(n, radius),
                       brute_force(n, lambda i, j: abs(i - j) <= radius))
    assert_edges_equal(graphs.window_graph(n, radius, causal=True),
                       brute_force(n, lambda i, j: 0 <= i - j <= radius))


@pytest.mark.parametrize("n,size", [(0, 3), (1, 1), (10, 4), (12, 4), (3, 5), (7, 1)])
def test_chunked_graph(n, size):
    """Each node attends within its chunk of ``size`` (causally by default), the last chunk
    shorter where ``size`` does not divide n; edges sorted by target, then source."""
    same = lambda i, j: i // size == j // size  # noqa: E731
    causal = graphs.chunked_graph(n, size)
    assert_edges_equal(causal, brute_force(n, lambda i, j: same(i, j) and j <= i))
    assert_edges_equal(graphs.chunked_graph(n, size, causal=False), brute_force(n, same))
    key = causal[1] * (n + 1) + causal[0]
    assert causal.dtype == torch.int64 and bool((key.diff() > 0).all())


def test_chunked_graph_special_cases_and_errors():
    assert_edges_equal(graphs.chunked_graph(9, 9), graphs.causal_graph(9))
    assert_edges_equal(graphs.chunked_graph(9, 100, causal=False), graphs.complete_graph(9))
    # a chunk longer than the sequence builds no more than the sequence (2^40 edges else)
    assert_edges_equal(graphs.chunked_graph(10, 2**20), graphs.causal_graph(10))
    assert_edges_equal(graphs.chunked_graph(0, 2**20), graphs.causal_graph(0))
    assert_edges_equal(graphs.chunked_graph(8, 4),
                       graphs.repeat_graph(graphs.causal_graph(4), 4, 2))
    with pytest.raises(ValueError, match="size"):
        graphs.chunked_graph(8, 0)
    with pytest.raises(ValueError, match="n"):
        graphs.chunked_graph(-1, 2)


def test_window_graph_special_cases():
    n = 7
    assert_edges_equal(graphs.window_graph(n, n - 1), graphs.complete_graph(n))
    assert_edges_equal(graphs.window_graph(n, n - 1, causal=True), graphs.causal_graph(n))


@pytest.mark.parametrize("height,width,radius", [(1, 1, 1), (3, 4, 1), (4, 3, 0), (5, 6, 2),
                                                 (2, 7, 3), (0, 3, 1)])
def test_grid_graph(height, width, radius):
    def allowed(p, q):
        (rp, cp), (rq, cq) = divmod(p, width), divmod(q, width)
        return abs(rp - rq) <= radius and abs(cp - cq) <= radius

    expected = brute_force(height * width, allowed)
    assert_edges_equal(graphs.grid_graph(height, width, radius), expected)


@pytest.mark.parametrize("n,radius", [(1, 5), (6, 2), (40, 39), (40, 10**6)])
def test_thin_grid_graph_is_window_graph(n, radius):
    # A one-row (or one-column) image is a sequence. (Capping the offsets per axis also keeps
    # grid_graph(1, W, r) at O(W r) memory instead of O(W r^2).)
    assert_edges_equal(graphs.grid_graph(1, n, radius), graphs.window_graph(n, radius))
    assert_edges_equal(graphs.grid_graph(n, 1, radius), graphs.window_graph(n, radius))


def test_grid_graph_radius_one_is_3x3_neighbourhood():
    edge_index = graphs.grid_graph(5, 5)
    centre = 2 * 5 + 2
    sources = edge_index[0, edge_index[1] == centre].tolist()
    assert sources == [6, 7, 8, 11, 12, 13, 16, 17, 18]
    corner_sources = edge_index[0, edge_index[1] == 0].tolist()
    assert corner_sources == [0, 1, 5, 6]


@pytest.mark.parametrize("batch", [
    [], [0], [0, 0, 0], [0, 0, 1, 1, 1, 2], [2, 0, 2, 1, 0, 2, 2],  # unsorted
    [3, 3, 0, 3],  # graph ids 1 and 2 without nodes
])
@pytest.mark.parametrize("self_loops", [True, False])
@pytest.mark.parametrize("route", ["cpu-kernel", "torch-ops"])
def test_batch_complete_graph(batch, self_loops, route, monkeypatch):
    """On CPU one kernel writes the edges; traced or on other devices torch ops build them
    (forced here): both give the brute-force edge list, in its order."""
    if route == "torch-ops":
        monkeypatch.setattr(graphs, "host_readable", lambda t: False)
    b = torch.tensor(batch, dtype=torch.long)
    expected = brute_force(len(batch), lambda i, j: batch[i] == batch[j] and (self_loops or i != j))
    assert_edges_equal(graphs.batch_complete_graph(b, self_loops=self_loops), expected)


@pytest.mark.parametrize("n", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_batch_complete_graph_of_one_graph_is_the_complete_graph(n, dtype):
    for self_loops in (True, False):
        assert_edges_equal(graphs.batch_complete_graph(torch.zeros(n, dtype=dtype), self_loops),
                           graphs.complete_graph(n, self_loops))


def test_batch_complete_graph_of_a_pyg_batch_has_sum_of_squares_edges():
    from torch_geometric.data import Batch, Data

    sizes = [3, 1, 4, 2]
    data = Batch.from_data_list([Data(num_nodes=n) for n in sizes])
    edge_index = graphs.batch_complete_graph(data.batch)
    assert edge_index.size(1) == sum(n * n for n in sizes)
    assert torch.equal(data.batch[edge_index[0]], data.batch[edge_index[1]])


@pytest.mark.parametrize("route", ["cpu-kernel", "torch-ops"])
def test_batch_complete_graph_of_a_large_shuffled_batch(route, monkeypatch):
    """Mutation testing: an unstable sort of the graph ids kept the order on batches of 7
    nodes; on 300 the edges were no longer sorted by target, then source."""
    if route == "torch-ops":
        monkeypatch.setattr(graphs, "host_readable", lambda t: False)
    batch = torch.randint(0, 3, (300,), generator=torch.Generator().manual_seed(0))
    ids = batch.tolist()
    assert_edges_equal(graphs.batch_complete_graph(batch),
                       brute_force(len(ids), lambda i, j: ids[i] == ids[j]))


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_batch_complete_graph_takes_unsigned_graph_ids(dtype):
    """torch has no ``min`` for these dtypes: the check of ids >= 0 skips them."""
    batch = [2, 0, 2, 1]
    assert_edges_equal(graphs.batch_complete_graph(torch.tensor(batch, dtype=dtype)),
                       brute_force(len(batch), lambda i, j: batch[i] == batch[j]))


@pytest.mark.parametrize("route", ["cpu-kernel", "torch-ops"])
def test_batch_complete_graph_takes_graph_ids_far_above_the_node_count(route, monkeypatch):
    """Per-graph sizes came from bincount, with max id + 1 bins: ids of 10^12 asked for
    terabytes. Only which nodes share an id matters, so the ids are renumbered."""
    if route == "torch-ops":
        monkeypatch.setattr(graphs, "host_readable", lambda t: False)
    far = 10 ** 12
    batch = [far, 0, far, 7]
    assert_edges_equal(graphs.batch_complete_graph(torch.tensor(batch)),
                       brute_force(len(batch), lambda i, j: batch[i] == batch[j]))


@pytest.mark.parametrize("call,match", [
    (lambda: graphs.complete_graph(3, self_loops="False"), r"self_loops must be a bool, got "
                                                           r"'False' \(a str\)"),
    (lambda: graphs.batch_complete_graph(torch.zeros(3, dtype=torch.long),
                                         self_loops=torch.tensor(False)),
     r"self_loops must be a bool, got tensor\(False\) \(a Tensor\)"),
    (lambda: graphs.chain_graph(4, directed="no"), r"directed must be a bool, got 'no'"),
    (lambda: graphs.window_graph(5, 1, causal=None), r"causal must be a bool, got None"),
    (lambda: graphs.to_networkx(graphs.chain_graph(3), 3, undirected=1),
     r"undirected must be a bool, got 1 \(a int\)"),
])
def test_builder_flags_must_be_bools(call, match):
    """A string such as "False" was read by its truth value: window_graph(causal="False")
    built the causal window."""
    with pytest.raises(TypeError, match=match):
        call()


def test_builder_flags_take_numpy_bools():
    assert torch.equal(graphs.complete_graph(3, self_loops=np.bool_(False)),
                       graphs.complete_graph(3, self_loops=False))


@pytest.mark.parametrize("batch,error,match", [
    ([0, 1], TypeError, r"batch must be a torch.Tensor, got list"),
    (torch.zeros(2, 2, dtype=torch.long), ValueError, r"batch must have shape \[N\], got \[2, 2\]"),
    (torch.zeros(3), TypeError, r"batch must be an integer tensor, got torch.float32"),
    (torch.ones(3, dtype=torch.bool), TypeError, r"must be an integer tensor, got torch.bool"),
    (torch.tensor([0, -2, 1]), ValueError, r"batch must hold graph ids >= 0, got -2"),
])
def test_batch_complete_graph_errors(batch, error, match):
    with pytest.raises(error, match=match):
        graphs.batch_complete_graph(batch)


@pytest.mark.parametrize("call,match", [
    (lambda: graphs.complete_graph(-1), r"n must be a non-negative integer, got -1"),
    (lambda: graphs.complete_graph(2.0), r"n must be a non-negative integer, got 2.0"),
    (lambda: graphs.chain_graph(-3), r"n must be a non-negative integer, got -3"),
    (lambda: graphs.causal_graph(True), r"n must be a non-negative integer, got True"),
    (lambda: graphs.window_graph(-1, 1), r"n must be a non-negative integer, got -1"),
    (lambda: graphs.window_graph(4, -1), r"radius must be a non-negative integer, got -1"),
    (lambda: graphs.grid_graph(-2, 3), r"height must be a non-negative integer, got -2"),
    (lambda: graphs.grid_graph(2, -3), r"width must be a non-negative integer, got -3"),
    (lambda: graphs.grid_graph(2, 3, radius=-1), r"radius must be a non-negative integer"),
    (lambda: graphs.to_dense_mask(graphs.chain_graph(3), -1), r"num_nodes must be a non"),
])
def test_builder_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call", [lambda: graphs.random_graph(5, 2, generator=5),
                                  lambda: pe.laplacian_pe(graphs.chain_graph(4), 4, 2,
                                                          generator="x")],
                         ids=["random_graph", "laplacian_pe"])
def test_a_generator_that_is_not_one_is_refused_by_name(call):
    """It failed in torch.randint ("received an invalid combination of arguments"), or, without
    random_sign_flip, was taken without a word."""
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator or None, got "):
        call()


@pytest.mark.parametrize("as_int", [np.int64, np.int32, torch.tensor], ids=["np64", "np32", "0d"])
def test_builders_take_numpy_and_tensor_integers(as_int):
    # sizes often come from numpy (np.prod of a shape) or from a tensor's sum
    calls = [(graphs.complete_graph, (5,)), (graphs.chain_graph, (5,)), (graphs.causal_graph, (5,)),
             (graphs.window_graph, (7, 2)), (graphs.grid_graph, (3, 4, 1))]
    for build, args in calls:
        assert torch.equal(build(*map(as_int, args)), build(*args)), build.__name__
    edge_index = graphs.chain_graph(4)
    assert torch.equal(graphs.to_dense_mask(edge_index, as_int(4)),
                       graphs.to_dense_mask(edge_index, 4))
    adj = graphs.to_sparse_adjacency(edge_index, as_int(4), as_int(4))
    assert adj.shape == (4, 4) and all(type(n) is int for n in adj.shape)


@pytest.mark.parametrize("n", [torch.tensor(True), np.bool_(True), torch.tensor(3.0),
                               np.float64(3.0), torch.tensor([2, 3]), "3"])
def test_builders_refuse_non_integers(n):
    with pytest.raises(ValueError, match=r"n must be a non-negative integer, got "):
        graphs.chain_graph(n)


def test_to_dense_mask():
    edge_index = torch.tensor([[0, 2, 1, 1], [1, 1, 2, 2]])  # 0->1, 2->1, 1->2 twice
    mask = graphs.to_dense_mask(edge_index, 4)
    expected = torch.zeros(4, 4, dtype=torch.bool)
    expected[1, 0] = expected[1, 2] = expected[2, 1] = True
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)
    assert torch.equal(graphs.to_dense_mask(edge_index.int(), 4), expected)


def test_to_dense_mask_of_patterns():
    n = 6
    assert graphs.to_dense_mask(graphs.complete_graph(n), n).all()
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(graphs.to_dense_mask(graphs.causal_graph(n), n), causal)
    band = torch.ones(n, n, dtype=torch.bool).triu(-2).tril(2)
    assert torch.equal(graphs.to_dense_mask(graphs.window_graph(n, 2), n), band)


def test_to_dense_mask_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match=r"edge_index\[0\] \(sources\) must be < .* 3"):
        graphs.to_dense_mask(torch.tensor([[3], [0]]), 3)
    with pytest.raises(ValueError, match=r"edge_index must have shape \[2, E\]"):
        graphs.to_dense_mask(torch.zeros(3, 2, dtype=torch.long), 3)


@pytest.mark.parametrize("convert", [
    lambda ei: graphs.to_dense_mask(ei, 2),
    lambda ei: graphs.to_sparse_adjacency(ei, 2, 2),
    lambda ei: graphs.to_networkx(ei, 2),
], ids=["to_dense_mask", "to_sparse_adjacency", "to_networkx"])
def test_conversions_name_an_edge_index_that_is_not_a_tensor(convert):
    with pytest.raises(TypeError, match=r"edge_index must be a torch.Tensor, got list"):
        convert([[0], [1]])


def test_from_dense_mask_round_trip():
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(7, 7, generator=gen) < 0.4
    edge_index = graphs.from_dense_mask(mask)
    expected = brute_force(7, lambda i, j: bool(mask[i, j]))
    assert_edges_equal(edge_index, expected)
    assert torch.equal(graphs.to_dense_mask(edge_index, 7), mask)
    for builder in (graphs.causal_graph(5), graphs.window_graph(5, 1), graphs.grid_graph(2, 3)):
        n = int(builder.max()) + 1
        assert torch.equal(graphs.from_dense_mask(graphs.to_dense_mask(builder, n)), builder)
    assert graphs.from_dense_mask(torch.zeros(0, 0, dtype=torch.bool)).shape == (2, 0)


def test_from_dense_mask_errors():
    with pytest.raises(TypeError, match=r"mask must be a dense \(strided\) tensor, got layout "
                                        r"torch.sparse_coo; .* from_sparse_adjacency"):
        graphs.from_dense_mask(torch.eye(2, dtype=torch.bool).to_sparse())
    with pytest.raises(ValueError, match=r"mask must be square, \[N, N\], got \[3, 4\]"):
        graphs.from_dense_mask(torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must be square, \[N, N\], got \[2, 2, 2\]"):
        graphs.from_dense_mask(torch.ones(2, 2, 2, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask must be a bool tensor, got torch.float32"):
        graphs.from_dense_mask(torch.ones(3, 3))
    with pytest.raises(TypeError, match=r"mask must be a torch.Tensor, got list"):
        graphs.from_dense_mask([[True]])


def test_from_networkx_node_order_and_directions():
    G = nx.Graph()
    G.add_nodes_from(["c", "a", "b", "lonely"])
    G.add_edges_from([("c", "a"), ("a", "b"), ("b", "b")])
    edge_index = graphs.from_networkx(G)
    # c=0, a=1, b=2, lonely=3; undirected edges in both directions, the self-loop once
    expected = torch.tensor([[1, 0, 2, 1, 2], [0, 1, 1, 2, 2]])
    assert_edges_equal(edge_index, expected)

    D = nx.DiGraph()
    D.add_nodes_from([10, 20, 30])
    D.add_edges_from([(30, 10), (10, 20)])
    assert_edges_equal(graphs.from_networkx(D), torch.tensor([[2, 0], [0, 1]]))  # 30->10, 10->20


def test_from_networkx_sorts_by_target_then_source_whatever_the_insertion_order():
    # networkx lists node 0's neighbours as they were added, 3 then 2 then 1
    G = nx.Graph()
    G.add_nodes_from(range(4))
    G.add_edges_from([(0, 3), (0, 2), (0, 1)])
    assert list(G.edges) == [(0, 3), (0, 2), (0, 1)]
    assert_edges_equal(graphs.from_networkx(G),
                       torch.tensor([[1, 2, 3, 0, 0, 0], [0, 0, 0, 1, 2, 3]]))


def test_from_networkx_multigraph_keeps_parallel_edges():
    M = nx.MultiDiGraph()
    M.add_edges_from([(0, 1), (0, 1), (2, 1)])
    assert_edges_equal(graphs.from_networkx(M), torch.tensor([[0, 0, 2], [1, 1, 1]]))


def test_from_networkx_edge_attrs():
    D = nx.DiGraph()
    D.add_edge(2, 0, weight=0.5, feat=[1.0, 2.0])
    D.add_edge(1, 0, weight=1.5, feat=[3.0, 4.0])
    D.add_edge(0, 2, weight=2.5, feat=[5.0, 6.0])
    edge_index, edge_attr = graphs.from_networkx(D, edge_attrs=["weight", "feat"])
    # node order 2, 0, 1 -> ids 0, 1, 2
    assert_edges_equal(edge_index, torch.tensor([[1, 0, 2], [0, 1, 1]]))
    expected = torch.tensor([[2.5, 5.0, 6.0], [0.5, 1.0, 2.0], [1.5, 3.0, 4.0]])
    assert torch.equal(edge_attr, expected)

    G = nx.Graph()
    G.add_edge("x", "y", weight=3.0)
    edge_index, edge_attr = graphs.from_networkx(G, edge_attrs=["weight"])
    assert_edges_equal(edge_index, torch.tensor([[1, 0], [0, 1]]))
    assert torch.equal(edge_attr, torch.tensor([[3.0], [3.0]]))


def test_from_networkx_with_no_edge_attrs_named_still_returns_edge_attr():
    G = nx.path_graph(3)
    edge_index, edge_attr = graphs.from_networkx(G, edge_attrs=[])
    assert torch.equal(edge_index, graphs.from_networkx(G))
    assert edge_attr.shape == (4, 0) and edge_attr.dtype == torch.get_default_dtype()


def test_from_networkx_without_edges_gives_one_column_per_attribute():
    G = nx.empty_graph(3)
    edge_index, edge_attr = graphs.from_networkx(G, edge_attrs=["weight", "feat"])
    assert edge_index.shape == (2, 0) and edge_index.dtype == torch.int64
    assert edge_attr.shape == (0, 2) and edge_attr.dtype == torch.get_default_dtype()


def test_from_networkx_errors():
    G = nx.Graph()
    G.add_edge(0, 1, weight=1.0)
    G.add_edge(1, 2)
    with pytest.raises(ValueError, match=r"edge \(1, 2\) has no attribute 'weight'"):
        graphs.from_networkx(G, edge_attrs=["weight"])
    G.edges[1, 2]["weight"] = [1.0, 2.0]
    with pytest.raises(ValueError, match=r"same total size on every edge, got sizes \[1, 2\]"):
        graphs.from_networkx(G, edge_attrs=["weight"])
    with pytest.raises(TypeError, match=r"G must be a networkx graph, got Tensor"):
        graphs.from_networkx(torch.zeros(2, 2))
    for value in ("abc", None, [1.0, [2.0, 3.0]]):
        G.edges[1, 2]["weight"] = value
        with pytest.raises(TypeError, match=r"attribute 'weight' of edge \(1, 2\) must be a "
                                            r"number or a sequence of numbers, got "):
            graphs.from_networkx(G, edge_attrs=["weight"])


def test_from_networkx_refuses_a_single_attribute_name_as_string():
    G = nx.Graph()
    G.add_edge(0, 1, weight=2.0)  # a string would be read as the names 'w', 'e', ...
    with pytest.raises(TypeError, match=r"edge_attrs must be a list of attribute names, got the "
                                        r"string 'weight'; pass \['weight'\]"):
        graphs.from_networkx(G, edge_attrs="weight")
    for bad in (5, [1]):  # ('int' object is not iterable; a KeyError of the number)
        with pytest.raises(TypeError, match=rf"edge_attrs must be a list of attribute names, "
                                            rf"got {re.escape(repr(bad))}"):
            graphs.from_networkx(G, edge_attrs=bad)


def test_to_networkx():
    edge_index = torch.tensor([[0, 1, 2], [1, 0, 1]])
    D = graphs.to_networkx(edge_index, 5)
    assert isinstance(D, nx.DiGraph)
    assert list(D.nodes) == [0, 1, 2, 3, 4]
    assert sorted(D.edges) == [(0, 1), (1, 0), (2, 1)]

    U = graphs.to_networkx(edge_index, 5, undirected=True)
    assert not U.is_directed()
    assert sorted(tuple(sorted(e)) for e in U.edges) == [(0, 1), (1, 2)]

    attr = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    A = graphs.to_networkx(edge_index, 3, edge_attr=attr)
    assert A.edges[2, 1]["edge_attr"] == [5.0, 6.0]
    S = graphs.to_networkx(edge_index, 3, edge_attr=attr[:, 0])
    assert S.edges[1, 0]["edge_attr"] == 3.0

    with pytest.raises(ValueError, match=r"edge_attr must have shape \[E\] or \[E, D\] with "
                                         r"E = 3, got \[2, 2\]"):
        graphs.to_networkx(edge_index, 3, edge_attr=attr[:2])
    with pytest.raises(TypeError, match=r"edge_attr must be a torch.Tensor, got list"):
        graphs.to_networkx(edge_index, 3, edge_attr=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"edge_index\[0\] \(sources\) must be <"):
        graphs.to_networkx(edge_index, 2)


@pytest.mark.parametrize("make", [
    lambda: nx.gnp_random_graph(15, 0.3, seed=4),
    lambda: nx.gnp_random_graph(15, 0.2, seed=5, directed=True),
    lambda: nx.barabasi_albert_graph(15, 2, seed=6),
], ids=["gnp", "directed-gnp", "barabasi-albert"])
def test_networkx_round_trip(make):
    G = make()
    for u, v in G.edges:
        G.edges[u, v]["w"] = float(u * 100 + v)
    edge_index, edge_attr = graphs.from_networkx(G, edge_attrs=["w"])
    n = G.number_of_nodes()
    H = graphs.to_networkx(edge_index, n, edge_attr=edge_attr[:, 0],
                           undirected=not G.is_directed())
    assert H.is_directed() == G.is_directed()
    assert nx.utils.edges_equal(G.edges, H.edges)
    for u, v in G.edges:
        assert H.edges[u, v]["edge_attr"] == G.edges[u, v]["w"]
    assert_edges_equal(graphs.from_networkx(H), edge_index)
    mask = nx.to_numpy_array(G, nodelist=range(n), weight=None).T > 0  # mask[i, j]: edge j -> i
    assert torch.equal(graphs.to_dense_mask(edge_index, n), torch.from_numpy(mask))


@pytest.mark.parametrize("layout", graphs.SPARSE_LAYOUTS, ids=str)
def test_sparse_adjacency_round_trip(graph_case, layout):
    ei, n_src, n_dst = graph_case.edge_index, graph_case.num_src, graph_case.num_dst
    values = torch.arange(2.0 * ei.size(1)).view(-1, 2)  # (E, 2): one row per edge
    adj = graphs.to_sparse_adjacency(ei, n_src, n_dst, values, layout=layout)
    assert adj.layout == layout and adj.shape == (n_dst, n_src, 2)
    back = graphs.from_sparse_adjacency(adj)
    # The same multiset of edges, each with its own values row.
    rows = adj._values() if layout == torch.sparse_coo else adj.values()
    got = sorted(zip(back.t().tolist(), rows.tolist(), strict=True))
    want = sorted(zip(ei.t().tolist(), values.tolist(), strict=True))
    assert got == want
    # Sorted by target then source (CSC: source then target), as the layout reads.
    major, minor = (back[0], back[1]) if layout == torch.sparse_csc else (back[1], back[0])
    key = major * 100 + minor
    assert torch.equal(key, key.sort().values)
    if layout == torch.sparse_coo:
        has_multi_edges = len(set(map(tuple, ei.t().tolist()))) < ei.size(1)
        assert adj.is_coalesced() != has_multi_edges
    expected = torch.zeros(n_dst, n_src, dtype=torch.bool)
    expected[ei[1], ei[0]] = True
    assert torch.equal(adj.to_dense().sum(-1) > 0, expected)  # every values row sums above 0


def test_sparse_adjacency_keeps_torchs_beta_notice_to_itself():
    """torch prints, once per process, that CSR and CSC tensors are in beta, at the first one
    built: README's first example printed it, blamed on graphattn/graphs.py, with nothing for
    the user to act on. to_sparse_adjacency now builds its CSR and CSC without it; a CSR the
    user builds still gets torch's notice (``set_warn_always`` shows it every time)."""
    edge_index = torch.tensor([[0, 1, 2], [1, 2, 0]])
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for layout in (torch.sparse_csr, torch.sparse_csc):
                graphs.to_sparse_adjacency(edge_index, 3, 3, layout=layout)
            assert [str(w.message) for w in caught] == []
            torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1),
                                    check_invariants=False)
        assert ["in beta" in str(w.message) for w in caught] == [True]
    finally:
        torch.set_warn_always(before)


@pytest.mark.parametrize("layout", graphs.SPARSE_LAYOUTS, ids=str)
@pytest.mark.parametrize("num_src,num_dst", [(2, 5), (5, 2)])
def test_rectangular_sparse_adjacency_equals_torchs_conversion(layout, num_src, num_dst):
    """Every pair j -> i of a rectangular graph, given in a scrambled order: the adjacency is
    what torch's own conversion of the dense ``[N_dst, N_src]`` matrix stores, entry for entry
    (also with more targets than sources, where a CSC sort key by ``N_src`` would collide)."""
    src, dst = torch.cartesian_prod(torch.arange(num_src), torch.arange(num_dst)).t()
    order = torch.randperm(src.numel(), generator=torch.Generator().manual_seed(0))
    ei = torch.stack([src[order], dst[order]])  # (2, E)
    values = torch.arange(1.0, ei.size(1) + 1)  # (E,): each entry its own value
    dense = torch.zeros(num_dst, num_src)
    dense[ei[1], ei[0]] = values
    adj = graphs.to_sparse_adjacency(ei, num_src, num_dst, values, layout=layout)
    expected = dense.to_sparse(layout=layout)
    assert torch.equal(adj.to_dense(), dense)
    if layout == torch.sparse_coo:
        assert torch.equal(adj._indices(), expected._indices())
        assert torch.equal(adj._values(), expected._values())
    else:
        compressed, plain = ((torch.Tensor.ccol_indices, torch.Tensor.row_indices)
                             if layout == torch.sparse_csc
                             else (torch.Tensor.crow_indices, torch.Tensor.col_indices))
        assert torch.equal(compressed(adj), compressed(expected))
        assert torch.equal(plain(adj), plain(expected))
        assert torch.equal(adj.values(), expected.values())


@pytest.mark.parametrize("layout", graphs.SPARSE_LAYOUTS, ids=str)
def test_from_sparse_adjacency_reads_entries_in_storage_order(layout):
    dense = torch.tensor([[0.0, 2.0, 0.0],
                          [3.0, 0.0, 0.0],
                          [4.0, 5.0, 6.0]])  # (N_dst, N_src): adj[i, j] is the edge j -> i
    adj = {torch.sparse_coo: dense.to_sparse_coo, torch.sparse_csr: dense.to_sparse_csr,
           torch.sparse_csc: dense.to_sparse_csc}[layout]()
    values = adj.values()
    ei = graphs.from_sparse_adjacency(adj)
    assert ei.dtype == torch.int64
    # Each edge's entry, read back from the dense matrix, is the value stored at its position.
    assert torch.equal(dense[ei[1], ei[0]], values)
    assert sorted(map(tuple, ei.t().tolist())) == [(0, 1), (0, 2), (1, 0), (1, 2), (2, 2)]


def test_from_sparse_adjacency_keeps_uncoalesced_duplicates():
    adj = torch.sparse_coo_tensor(torch.tensor([[1, 0, 1], [2, 2, 2]]), torch.ones(3), (3, 3),
                                  check_invariants=True)
    assert torch.equal(graphs.from_sparse_adjacency(adj), torch.tensor([[2, 2, 2], [1, 0, 1]]))


def test_sparse_adjacency_errors():
    ei = torch.tensor([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="adj must be a sparse tensor.*got torch.strided"):
        graphs.from_sparse_adjacency(torch.eye(3))
    with pytest.raises(TypeError, match="adj must be a torch.Tensor, got list"):
        graphs.from_sparse_adjacency([[0, 1]])
    batched = torch.eye(3).expand(2, 3, 3).to_sparse_coo()
    with pytest.raises(ValueError, match="2 sparse dimensions.*got 3 in shape \\[2, 3, 3\\]"):
        graphs.from_sparse_adjacency(batched)
    for layout in ("csr", "csc"):  # compressed layouts report sparse_dim() == 2 with a batch
        dense = torch.eye(3).expand(2, 3, 3).contiguous()
        batched = dense.to_sparse_csr() if layout == "csr" else dense.to_sparse_csc()
        with pytest.raises(ValueError, match="2 sparse dimensions.*got 3 in shape \\[2, 3, 3\\]"):
            graphs.from_sparse_adjacency(batched)
    with pytest.raises(ValueError, match=r"values must have one row per edge.*got \[3\]"):
        graphs.to_sparse_adjacency(ei, 3, 3, torch.ones(3))
    with pytest.raises(ValueError, match=r"values must have one row per edge.*got \[\]"):
        graphs.to_sparse_adjacency(ei, 3, 3, torch.tensor(2.0))  # 0-d: no rows at all
    with pytest.raises(TypeError, match="values must be a torch.Tensor, got list"):
        graphs.to_sparse_adjacency(ei, 3, 3, [1.0, 2.0])
    with pytest.raises(ValueError, match="one device, got edge_index on cpu, values on meta"):
        graphs.to_sparse_adjacency(ei, 3, 3, torch.ones(ei.size(1), device="meta"))
    with pytest.raises(ValueError, match="layout must be one of.*got torch.strided"):
        graphs.to_sparse_adjacency(ei, 3, 3, layout=torch.strided)
    with pytest.raises(ValueError, match="targets.*< the number of target nodes 2"):
        graphs.to_sparse_adjacency(ei, 3, 2)


@pytest.mark.parametrize("make,n", [(lambda: graphs.window_graph(5, 1, causal=True), 5),
                                    (lambda: graphs.grid_graph(2, 3), 6),
                                    (lambda: torch.tensor([[0, 0, 2], [1, 1, 0]]), 4)])
@pytest.mark.parametrize("copies", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_repeat_graph_is_the_block_diagonal_mask(make, n, copies, dtype):
    edge_index = make().to(dtype)
    out = graphs.repeat_graph(edge_index, n, copies)
    assert out.dtype == dtype and out.shape == (2, copies * edge_index.size(1))
    mask = graphs.to_dense_mask(edge_index.long(), n)
    assert torch.equal(graphs.to_dense_mask(out.long(), copies * n),
                       torch.block_diag(*[mask] * copies) if copies else torch.zeros(0, 0).bool())
    # copy by copy, each the graph shifted by its offset (multi-edges kept)
    for b in range(copies):
        part = out[:, b * edge_index.size(1):(b + 1) * edge_index.size(1)]
        assert torch.equal(part, edge_index + b * n)


def test_repeat_graph_keeps_target_order_and_matches_pyg_batch():
    from torch_geometric.data import Batch, Data

    edge_index, n = graphs.grid_graph(3, 3), 9
    out = graphs.repeat_graph(edge_index, n, 4)
    assert bool((out[1, 1:] >= out[1, :-1]).all())
    pyg = Batch.from_data_list([Data(edge_index=edge_index, num_nodes=n)] * 4)
    assert torch.equal(out, pyg.edge_index)


def test_repeat_graph_batches_sequences_as_dense_attention_does():
    from graphattn.nn import DenseSelfAttention, GraphSelfAttention

    torch.manual_seed(0)
    B, L, F = 3, 7, 8
    sparse = GraphSelfAttention(F, 4, heads=2, add_self_loops=False)
    dense = DenseSelfAttention(F, 4, heads=2)
    dense.load_state_dict(sparse.state_dict())
    edge_index = graphs.window_graph(L, 2, causal=True)
    x = torch.randn(B, L, F)
    out = sparse(x.reshape(B * L, F), graphs.repeat_graph(edge_index, L, B))
    expected = dense(x, mask=graphs.to_dense_mask(edge_index, L))
    torch.testing.assert_close(out.view(B, L, -1), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call,error,match", [
    (lambda: graphs.repeat_graph(graphs.chain_graph(3), 3, -1), ValueError,
     r"copies must be a non-negative integer, got -1"),
    (lambda: graphs.repeat_graph(graphs.chain_graph(3), 2, 2), ValueError,
     r"edge_index\[0\] \(sources\) must be < the number of source nodes 2, got a maximum of 2"),
    (lambda: graphs.repeat_graph(graphs.chain_graph(3).float(), 3, 2), TypeError,
     r"edge_index must have an integer dtype"),
    (lambda: graphs.repeat_graph(graphs.chain_graph(3).int(), 2**30, 3), ValueError,
     r"copies \* num_nodes = 3 \* 1073741824 node ids do not fit in edge_index's dtype "
     r"torch.int32"),
])
def test_repeat_graph_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_edge_checks_kept_by_mutation_testing():
    """to_networkx refuses a 3-D edge_attr; repeat_graph takes int32 ids up to 2^31 - 1."""
    with pytest.raises(ValueError, match=r"edge_attr must have shape \[E\] or \[E, D\]"):
        graphs.to_networkx(torch.tensor([[0, 1], [1, 2]]), 3, torch.ones(2, 2, 2))
    empty = torch.empty(2, 0, dtype=torch.int32)
    assert graphs.repeat_graph(empty, 2 ** 30, 2).dtype == torch.int32


def bandwidth(edge_index: torch.Tensor) -> int:
    """The largest id distance ``|i - j|`` between the ends of an edge."""
    return int((edge_index[0] - edge_index[1]).abs().max())


def shuffled(edge_index: torch.Tensor, num_nodes: int, seed: int = 0) -> torch.Tensor:
    """The graph with its nodes numbered at random (written out here, not by permute_nodes)."""
    new_id = torch.randperm(num_nodes, generator=torch.Generator().manual_seed(seed))
    return new_id[edge_index]


def test_locality_order_numbers_a_shuffled_chain_as_a_chain():
    mixed = shuffled(graphs.chain_graph(50), 50)
    assert bandwidth(mixed) > 10
    perm = graphs.locality_order(mixed, 50)
    assert bandwidth(graphs.permute_nodes(mixed, perm)) == 1


def test_locality_order_narrows_a_shuffled_grid():
    height = width = 20
    mixed = shuffled(graphs.grid_graph(height, width), height * width, seed=1)
    renumbered = graphs.permute_nodes(mixed, graphs.locality_order(mixed, height * width))
    # a breadth-first numbering of a grid puts neighbours at most two of its diagonals apart
    assert bandwidth(renumbered) <= 4 * width < bandwidth(mixed)
    mean_distance = (renumbered[0] - renumbered[1]).abs().float().mean()
    assert mean_distance < (mixed[0] - mixed[1]).abs().float().mean() / 5


def test_locality_order_keeps_each_component_together():
    # two chains of 30 and 20 nodes, numbered at random together, and 3 isolated nodes
    chains = torch.cat([graphs.chain_graph(30), graphs.chain_graph(20) + 30], dim=1)
    mixed = shuffled(chains, 53, seed=2)
    perm = graphs.locality_order(mixed, 53)
    renumbered = graphs.permute_nodes(mixed, perm)
    assert bandwidth(renumbered) == 1
    chain_of = torch.tensor([0] * 30 + [1] * 20 + [2] * 3)[torch.argsort(
        torch.randperm(53, generator=torch.Generator().manual_seed(2)))]  # old id -> chain
    for chain in (0, 1):  # each chain's nodes get consecutive ids
        new_ids = torch.nonzero(chain_of[perm] == chain).view(-1)
        assert new_ids[-1] - new_ids[0] == new_ids.numel() - 1


def test_locality_order_is_a_permutation(graph_case, index_dtype):
    n = max(graph_case.num_src, graph_case.num_dst)
    edge_index = graph_case.edge_index.to(index_dtype)
    perm = graphs.locality_order(edge_index, n)
    assert perm.dtype == torch.int64
    assert torch.equal(perm.sort().values, torch.arange(n))
    renumbered = graphs.permute_nodes(edge_index, perm)
    assert renumbered.dtype == index_dtype
    # edge for edge, the same pairs of nodes: perm maps new ids back to the old ones
    assert torch.equal(perm[renumbered.long()], edge_index.long())


def test_locality_order_reads_edges_both_ways():
    # a directed chain 0 -> 1 -> ... numbered at random: only its undirected pattern is a path
    mixed = shuffled(graphs.chain_graph(40, directed=True), 40, seed=3)
    perm = graphs.locality_order(mixed, 40)
    assert bandwidth(graphs.permute_nodes(mixed, perm)) == 1


def test_permute_nodes_against_a_loop():
    edge_index = torch.tensor([[0, 3, 3, 1, 2, 2], [1, 0, 3, 2, 4, 4]])
    perm = torch.tensor([2, 4, 0, 1, 3])
    new_id = {int(old): new for new, old in enumerate(perm)}
    expected = torch.tensor([[new_id[int(j)] for j in edge_index[0]],
                             [new_id[int(i)] for i in edge_index[1]]])
    assert torch.equal(graphs.permute_nodes(edge_index, perm), expected)
    assert torch.equal(graphs.permute_nodes(edge_index, perm.int()), expected)


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense"])
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_attention_commutes_with_renumbering(backend, score):
    from conftest import assert_close, attention_inputs, random_graph

    from graphattn.functional import edge_attention

    n, num_edges = 30, 120
    edge_index = random_graph(n, num_edges, seed=4)
    inputs = attention_inputs(n, n, num_edges, 2, 8, score=score)
    perm = graphs.locality_order(edge_index, n)
    renumbered = graphs.permute_nodes(edge_index, perm)

    def run(edges, node_rows):
        q, k, v = (inputs[name][node_rows] for name in "qkv")
        out, alpha = edge_attention(q, k, v, edges, score=score, bias=inputs["bias"],
                                    att=inputs["att"], return_attention=True, backend=backend)
        return out, alpha

    out, alpha = run(edge_index, torch.arange(n))
    out_p, alpha_p = run(renumbered, perm)
    assert_close(out_p, out[perm])
    assert_close(alpha_p, alpha)  # per edge, and the edges keep their order
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), [inputs["q"], inputs["v"],
                                                         inputs["bias"]])
    grads_p = torch.autograd.grad((out_p * weights[perm]).sum(), [inputs["q"], inputs["v"],
                                                                   inputs["bias"]])
    for got, want in zip(grads_p, grads, strict=True):
        assert_close(got, want)


def test_a_pyg_data_renumbers_with_subgraph():
    """The recipe of locality_order's docstring: ``data.subgraph(perm)`` renumbers the graph,
    the node rows and the edge features alike; a layer's output rows follow perm."""
    from torch_geometric.data import Data

    from graphattn.nn import GraphSelfAttention

    torch.manual_seed(5)
    n = 40
    edge_index = shuffled(graphs.grid_graph(5, 8), n, seed=5)
    data = Data(x=torch.randn(n, 6), edge_index=edge_index,
                edge_attr=torch.randn(edge_index.size(1), 3), y=torch.arange(n))
    perm = graphs.locality_order(data.edge_index, n)
    renumbered = data.subgraph(perm)
    assert torch.equal(renumbered.edge_index, graphs.permute_nodes(data.edge_index, perm))
    assert torch.equal(renumbered.y, data.y[perm])
    layer = GraphSelfAttention(6, 4, heads=2, edge_dim=3)
    out = layer(data.x, data.edge_index, data.edge_attr)
    out_p = layer(renumbered.x, renumbered.edge_index, renumbered.edge_attr)
    torch.testing.assert_close(out_p, out[perm], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_p[torch.argsort(perm)], out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("call,error,match", [
    (lambda: graphs.locality_order(graphs.chain_graph(4), 3), ValueError,
     r"edge_index\[0\] \(sources\) must be < the number of source nodes 3, got a maximum of 3"),
    (lambda: graphs.locality_order(graphs.chain_graph(4), -1), ValueError,
     r"num_nodes must be a non-negative integer, got -1"),
    (lambda: graphs.permute_nodes(graphs.chain_graph(4), torch.tensor([0, 1, 1, 3])),
     ValueError, r"perm must hold each of 0..3 once \(N = perm.numel\(\) = 4\), got 1 twice "
                 r"or more"),
    (lambda: graphs.permute_nodes(graphs.chain_graph(3), torch.tensor([2, 0, 2])),
     ValueError, r"perm must hold each of 0..2 once \(N = perm.numel\(\) = 3\), got 1 not at all"),
    (lambda: graphs.permute_nodes(graphs.chain_graph(3), torch.tensor([0, 0, 1])),
     ValueError, r"got 0 twice or more"),
    (lambda: graphs.permute_nodes(graphs.chain_graph(3), torch.tensor([0, 1, 3])),
     ValueError, r"perm must hold each of 0..2 once \(N = perm.numel\(\) = 3\), got the value 3"),
    (lambda: graphs.permute_nodes(graphs.chain_graph(3), torch.tensor([0, -1, 2])),
     ValueError, r"got the value -1"),
    (lambda: graphs.permute_nodes(graphs.chain_graph(4), torch.arange(3)), ValueError,
     r"edge_index\[0\] \(sources\) must be < the number of source nodes 3"),
    (lambda: graphs.permute_nodes(graphs.chain_graph(3), torch.arange(3).view(1, 3)),
     ValueError, r"perm must be one-dimensional, \[N\], got \[1, 3\]"),
    (lambda: graphs.permute_nodes(graphs.chain_graph(3), torch.arange(3.0)), TypeError,
     r"perm must have an integer dtype \(int64 or int32\), got torch.float32"),
    (lambda: graphs.permute_nodes(graphs.chain_graph(3), [2, 0, 1]), TypeError,
     r"perm must be a torch.Tensor, got list"),
])
def test_renumbering_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_renumbering_empty_graphs():
    empty = torch.empty(2, 0, dtype=torch.int32)
    assert graphs.locality_order(empty, 0).shape == (0,)
    assert torch.equal(graphs.locality_order(empty, 4).sort().values, torch.arange(4))
    assert graphs.permute_nodes(empty, torch.arange(0)).dtype == torch.int32


def test_a_renumbered_grid_fills_the_tiles_of_the_block_kernels():
    """Numbered at random, a 40 x 40 pixel grid's edges scatter over the adjacency's 32 x 32
    tiles, too thinly for the block-sparse triton kernels; renumbered, they qualify again."""
    from graphattn.functional.triton_blocks import block_layout

    n = 40 * 40
    mixed = shuffled(graphs.grid_graph(40, 40), n, seed=6)
    renumbered = graphs.permute_nodes(mixed, graphs.locality_order(mixed, n))
    assert block_layout(mixed, n, n, 32) is None
    assert block_layout(renumbered, n, n, 32) is not None


@pytest.mark.parametrize("n", [0, 1, 5, 9])
@pytest.mark.parametrize("tokens", [0, 1, 3, [4, 0], (2, 2, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_global_token_graph(n, tokens, causal):
    positions = set(range(tokens)) if isinstance(tokens, int) else set(tokens)
    if max(positions, default=-1) >= n:
        with pytest.raises(ValueError, match="tokens must be"):
            graphs.global_token_graph(n, tokens, causal=causal)
        return
    expected = brute_force(n, lambda i, j: (i in positions or j in positions)
                           and (j <= i or not causal))
    assert_edges_equal(graphs.global_token_graph(n, tokens, causal=causal), expected)
    as_tensor = graphs.global_token_graph(n, torch.tensor(sorted(positions), dtype=torch.long),
                                          causal=causal)
    assert_edges_equal(as_tensor, expected)


def test_attention_sinks_with_a_window():
    """Causal, the first s positions global: each position sees the first s and its window."""
    n, sinks, radius = 12, 2, 3
    graph = graphs.union([graphs.window_graph(n, radius, causal=True),
                          graphs.global_token_graph(n, sinks, causal=True)], n)
    assert_edges_equal(graph, brute_force(n, lambda i, j: j <= i and (i - j <= radius
                                                                        or j < sinks or i < sinks)))


@pytest.mark.parametrize("n,degree,self_loops", [(0, 0, False), (1, 0, False), (1, 1, True),
                                                 (6, 5, False), (6, 6, True), (40, 3, False),
                                                 (40, 3, True), (40, 30, False)])
def test_random_graph_draws_distinct_sources_per_target(n, degree, self_loops):
    gen = torch.Generator().manual_seed(n + degree)
    edge_index = graphs.random_graph(n, degree, self_loops=self_loops, generator=gen)
    assert edge_index.dtype == torch.int64 and edge_index.shape == (2, n * degree)
    src, dst = edge_index
    assert torch.equal(dst, torch.arange(n).repeat_interleave(degree))
    for i in range(n):
        sources = src[dst == i].tolist()
        assert sources == sorted(set(sources)), sources  # distinct, sorted
        assert all(0 <= j < n for j in sources)
        assert self_loops or i not in sources
    again = graphs.random_graph(n, degree, self_loops=self_loops,
                                generator=torch.Generator().manual_seed(n + degree))
    assert torch.equal(again, edge_index)


@pytest.mark.parametrize("degree", [2, 7])  # drawn with repeats redrawn; by permutation
def test_random_graph_draws_each_source_equally_often(degree):
    """Over many targets each other node is drawn about degree / (n - 1) of the time, and so
    is each pair of sources (a draw that favoured some subsets would show there)."""
    n, rounds = 9, 4000
    gen = torch.Generator().manual_seed(degree)
    counts = torch.zeros(n, n)
    pairs = torch.zeros(n, n, n)
    for _ in range(rounds // n):
        src, dst = graphs.random_graph(n, degree, generator=gen).view(2, n, degree)
        counts[dst[:, 0].unsqueeze(1), src] += 1
        for a in range(degree):
            for b in range(a + 1, degree):
                pairs[dst[:, 0], src[:, a], src[:, b]] += 1
    draws = rounds // n
    expected = draws * degree / (n - 1)
    off = ~torch.eye(n, dtype=torch.bool)
    assert counts.diagonal().sum() == 0
    # binomial standard deviation about sqrt(expected); 5 sigma
    assert (counts[off] - expected).abs().max() < 5 * expected ** 0.5
    pair_expected = draws * degree * (degree - 1) / ((n - 1) * (n - 2))
    upper = torch.ones(n, n).triu(1).bool()
    for i in range(n):
        mine = upper.clone()
        mine[i, :] = mine[:, i] = False
        assert (pairs[i][mine] - pair_expected).abs().max() < 5 * pair_expected ** 0.5 + 1


def test_top_k_edges_keeps_each_target_s_best_edges():
    # each target's k in-edges of highest score, against a sort of each target's edges by
    # hand; ties go to the edge listed first, NaN ranks last, a target with at most k edges
    # keeps them all; the positions come in increasing order
    gen = torch.Generator().manual_seed(0)
    edge_index = graphs.random_graph(30, 6, generator=gen)
    edge_index = edge_index[:, torch.randperm(edge_index.size(1), generator=gen)]
    scores = torch.randn(edge_index.size(1), generator=gen).round(decimals=1)  # (ties)
    scores[::7] = float("nan")
    keep = graphs.top_k_edges(edge_index, scores, 4, 30)
    assert torch.equal(keep, keep.sort().values)
    want = []
    for i in range(30):
        mine = torch.nonzero(edge_index[1] == i).squeeze(1).tolist()
        ranked = sorted(mine, key=lambda e: (-(scores[e].item() if scores[e] == scores[e]
                                               else float("-inf")), e))
        want += ranked[:4]
    assert keep.tolist() == sorted(want)
    # (the CPU kernel above; the rows of scores through torch.topk, as on a GPU, below)
    assert torch.equal(graphs._top_k_positions(edge_index, scores, 4, cpu_rows=False), keep)
    assert torch.equal(graphs.top_k_edges(edge_index, scores, 100, 30),
                       torch.arange(edge_index.size(1)))
    empty = torch.empty(2, 0, dtype=torch.long)
    assert graphs.top_k_edges(empty, torch.empty(0), 3, 0).shape == (0,)


@pytest.mark.parametrize("k", [37, 1500])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
def test_top_k_edges_of_long_rows_with_ties_on_several_threads(dtype, k, two_threads):
    # 60 targets of 40 to 2,500 shuffled in-edges (enough edges that the CPU kernel's rows are
    # split among threads; rows of 1,024 or more are bucketed by value before the selection):
    # scores drawn from few values (long runs of ties, the k-th among them, positive or
    # negative), sorted runs, float64 values that round to one float32, NaN (below -inf),
    # -inf and both zeros; the kernel keeps what a sort of each target's edges by hand keeps,
    # and what torch.topk's rows keep
    gen = torch.Generator().manual_seed(2)
    degrees = torch.randint(40, 2500, (60,), generator=gen)
    target = torch.repeat_interleave(torch.arange(60), degrees)
    edge_index = torch.stack([torch.randint(0, 60, target.shape, generator=gen), target])
    edge_index = edge_index[:, torch.randperm(target.numel(), generator=gen)]
    assert edge_index.size(1) > 2**15  # (cpu.MIN_PARALLEL_WORK)
    scores = torch.randint(-3, 4, target.shape, generator=gen).double() / 2
    scores[:3000] = torch.linspace(-1, 1, 3000)  # (runs in order)
    scores[3000:4000] = 0.5 + torch.arange(1000) * 1e-12  # (one float32)
    scores[4000:4200] = -0.0
    scores = scores.to(dtype)
    scores[4200::97], scores[4300::89] = float("nan"), float("-inf")
    keep = graphs.top_k_edges(edge_index, scores, k, 60)
    nan = torch.isnan(scores)  # (below -inf)
    ranked = scores.double().masked_fill(nan, 0)
    order = np.lexsort((np.arange(target.numel()), -ranked.numpy(), nan.numpy(),
                        edge_index[1].numpy()))
    first = torch.cumsum(degrees, 0) - degrees
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) - first[edge_index[1]][order].numpy()
    assert keep.tolist() == np.nonzero(rank < k)[0].tolist()
    assert torch.equal(graphs._top_k_positions(edge_index, scores, k, cpu_rows=False), keep)


def _top_k_by_hand(edge_index, scores, k):
    # each target's k best edges by a sort on (target, NaN last, score descending, position)
    nan = torch.isnan(scores)
    order = np.lexsort((np.arange(scores.numel()), -scores.double().masked_fill(nan, 0).numpy(),
                        nan.numpy(), edge_index[1].numpy()))
    target = edge_index[1].numpy()[order]
    first = np.searchsorted(target, target)  # (each target's first place in the order)
    return sorted(order[np.arange(order.size) - first < k].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
def test_top_k_edges_ranks_infinities_above_the_extreme_finite_scores(dtype):
    # +inf above the largest finite score, -inf below the lowest and NaN below -inf, as every
    # k cuts through them, on each of the three ways to rank: the CPU kernel, the rows of
    # scores through torch.topk, and the sorts for a hub (one target of 1,200 in-edges among
    # 1,001), against a sort by hand
    finfo = torch.finfo(dtype)
    values = torch.tensor([finfo.max, float("inf"), float("nan"), float("-inf"), finfo.min,
                           0.0, -0.0, float("nan"), finfo.max, float("-inf")], dtype=dtype)
    gen = torch.Generator().manual_seed(4)
    small = torch.stack([torch.randperm(40, generator=gen), torch.arange(40) % 4])  # (4 x 10)
    hub = torch.stack([torch.arange(1200) % 1001, torch.zeros(1200, dtype=torch.long)])
    spokes = torch.stack([torch.arange(1000), torch.arange(1, 1001)])
    for edge_index in small, torch.cat([hub, spokes], dim=1):
        scores = values[torch.randint(0, values.numel(), (edge_index.size(1),), generator=gen)]
        for k in range(1, 12):
            want = _top_k_by_hand(edge_index, scores, k)
            assert graphs.top_k_edges(edge_index, scores, k, 1001).tolist() == want, k
            rows = graphs._top_k_positions(edge_index, scores, k, cpu_rows=False)
            assert rows.tolist() == want, k


def test_top_k_edges_of_a_long_row_whose_k_best_fill_their_buckets():
    # one target of 3,000 in-edges whose 100 best scores are alone in the highest buckets of
    # value (the CPU kernel counts by buckets before it selects): exactly those are kept
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(3000, generator=gen)  # (in [0, 1))
    best = torch.randperm(3000, generator=gen)[:100]
    scores[best] = 8 + torch.rand(100, generator=gen)
    edge_index = torch.stack([torch.arange(3000), torch.zeros(3000, dtype=torch.long)])
    assert graphs.top_k_edges(edge_index, scores, 100, 1).tolist() == best.sort().values.tolist()


def test_top_k_edges_of_a_hub_ranks_by_sorting_and_keeps_the_same_edges():
    # a hub of 1,500 in-edges among 2,000 nodes: off the CPU kernel the rows of scores would
    # be mostly padding, so two sorts rank the edges; they keep what the CPU kernel keeps, and
    # what the rows keep on the same edges without the hub
    gen = torch.Generator().manual_seed(1)
    n = 2000
    spokes = torch.stack([torch.arange(1, 1501), torch.zeros(1500, dtype=torch.long)])
    ring = torch.stack([torch.arange(n), (torch.arange(n) + 1) % n])
    extra = torch.stack([torch.randint(0, n, (3000,), generator=gen),
                         torch.randint(0, n, (3000,), generator=gen)])
    edge_index = torch.cat([extra, spokes, ring], dim=1)
    scores = torch.randint(0, 5, (edge_index.size(1),), generator=gen).float()  # (ties)
    keep = graphs._top_k_positions(edge_index, scores, 3, cpu_rows=False)
    assert torch.equal(graphs.top_k_edges(edge_index, scores, 3, n), keep)
    ranked = sorted(range(edge_index.size(1)), key=lambda e: (edge_index[1, e].item(),
                                                              -scores[e].item(), e))
    seen, want = {}, []
    for e in ranked:
        t = edge_index[1, e].item()
        seen[t] = seen.get(t, 0) + 1
        if seen[t] <= 3:
            want.append(e)
    assert keep.tolist() == sorted(want)
    no_hub = edge_index[1] != 0  # (the rest, through the rows of scores)
    positions = torch.nonzero(no_hub).squeeze(1)
    rows = graphs._top_k_positions(edge_index[:, no_hub], scores[no_hub], 3, cpu_rows=False)
    assert positions[rows].tolist() == [e for e in keep.tolist() if no_hub[e]]


@pytest.mark.parametrize("kwargs, match, error", [
    (dict(k=0), "k must be a positive integer, got 0", ValueError),
    (dict(scores=torch.zeros(3)), "scores must be a real tensor \\[E\\] = \\[4\\], one per "
                                  "edge, got torch.float32 \\[3\\]", ValueError),
    (dict(scores=torch.zeros(4, dtype=torch.long)), "scores must be a real tensor", ValueError),
    (dict(num_targets=2), "edge_index\\[1\\] \\(targets\\) must be < the number of target "
                          "nodes 2, got a maximum of 3", ValueError),
    # (checked after scores, a 0-d edge_index failed in torch: "Dimension specified as -1")
    (dict(edge_index=torch.tensor(0), scores=torch.zeros(3)),
     "edge_index must have shape \\[2, E\\], got \\[\\]", ValueError),
])
def test_top_k_edges_refusals(kwargs, match, error):
    args = dict(edge_index=torch.tensor([[0, 1, 2, 3], [1, 2, 3, 3]]), scores=torch.zeros(4),
                k=2, num_targets=4)
    with pytest.raises(error, match=match):
        graphs.top_k_edges(**{**args, **kwargs})


def test_union_against_sets():
    a = torch.tensor([[0, 2, 2, 1], [1, 0, 0, 3]])
    b = torch.tensor([[3, 0], [3, 1]], dtype=torch.int32)
    pairs = {tuple(edge) for e in (a, b) for edge in e.t().tolist()}
    expected = torch.tensor(sorted(pairs, key=lambda p: (p[1], p[0]))).t()
    assert_edges_equal(graphs.union([a, b], 4), expected)
    assert_edges_equal(graphs.union([a], 4), graphs.union([a, a], 4))
    assert graphs.union([], 4).shape == (2, 0)
    assert graphs.union([torch.empty(2, 0, dtype=torch.long)], 0).shape == (2, 0)


def test_union_keys_fit_int64_or_are_refused():
    """Pairs are keyed target * N + source in int64: up to N = isqrt(2^63 - 1) the ids come
    back as given; past it the call is refused (the keys overflowed into wrong, even negative
    ids)."""
    top = graphs.MAX_KEYED_NODES
    assert top ** 2 <= torch.iinfo(torch.int64).max < (top + 1) ** 2
    edges = torch.tensor([[top - 1, 1, top - 1], [top - 1, top - 1, 0]])
    assert graphs.union([edges], top).tolist() == [[top - 1, 1, top - 1], [0, top - 1, top - 1]]
    for call in (lambda: graphs.union([edges], top + 1),
                 lambda: graphs.head_patterns([edges], 10**10)):
        with pytest.raises(ValueError, match=r"num_nodes must be at most 3,037,000,499 .*, got "):
            call()


def test_longformer_and_bigbird_are_unions():
    n = 16
    window, glob = graphs.window_graph(n, 2), graphs.global_token_graph(n, [0, 9])
    rand = graphs.random_graph(n, 2, generator=torch.Generator().manual_seed(0))
    bigbird = graphs.union([window, glob, rand], n)
    mask = graphs.to_dense_mask(window, n) | graphs.to_dense_mask(glob, n)
    assert torch.equal(graphs.to_dense_mask(graphs.union([window, glob], n), n), mask)
    assert torch.equal(graphs.to_dense_mask(bigbird, n), mask | graphs.to_dense_mask(rand, n))


@pytest.mark.parametrize("call,error,match", [
    (lambda: graphs.global_token_graph(4, 5), ValueError,
     r"tokens must be between 0 and n = 4 when it is a count, got 5"),
    (lambda: graphs.global_token_graph(4, -1), ValueError,
     r"tokens must be between 0 and n = 4 when it is a count, got -1"),
    (lambda: graphs.global_token_graph(4, [1, 7]), ValueError,
     r"tokens must be positions in \[0, 4\), got 7"),
    (lambda: graphs.global_token_graph(4, [1.5]), TypeError,
     r"tokens must be an int or a one-dimensional sequence of integer positions, got \[1.5\]"),
    (lambda: graphs.global_token_graph(4, [[1]]), TypeError, r"one-dimensional"),
    (lambda: graphs.global_token_graph(4, "ab"), TypeError, r"got 'ab'"),
    (lambda: graphs.global_token_graph(4, 1, causal="yes"), TypeError, r"causal"),
    (lambda: graphs.random_graph(4, 4), ValueError,
     r"degree must be at most 3 \(the other nodes of a target\) for n = 4, got 4"),
    (lambda: graphs.random_graph(4, 5, self_loops=True), ValueError,
     r"degree must be at most 4 \(the nodes of a target\) for n = 4, got 5"),
    (lambda: graphs.random_graph(4, -2), ValueError,
     r"degree must be a non-negative integer, got -2"),
    (lambda: graphs.union(graphs.chain_graph(3), 3), TypeError,
     r"edge_indices must be a sequence of \[2, E\] tensors, got Tensor"),
    (lambda: graphs.union([graphs.chain_graph(3), graphs.chain_graph(4)], 3), ValueError,
     r"edge_indices\[1\]: edge_index\[0\] \(sources\) must be < the number of source nodes 3"),
    (lambda: graphs.union([graphs.chain_graph(3).float()], 3), TypeError,
     r"edge_indices\[0\]: edge_index must have an integer dtype"),
    (lambda: graphs.union([[0, 1]], 3), TypeError,
     r"edge_indices\[0\] must be a torch.Tensor, got list"),
])
def test_sparse_pattern_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_virtual_nodes_are_appended_global_tokens():
    """The recipe of global_token_graph's docstring: k new nodes, each linked both ways to
    every node, on top of the graph's own edges."""
    n, k = 6, 2
    chain = graphs.chain_graph(n)
    graph = graphs.union([chain, graphs.global_token_graph(n + k, range(n, n + k))], n + k)
    chain_pairs = set(map(tuple, chain.t().tolist()))
    assert_edges_equal(graph, brute_force(n + k, lambda i, j: i >= n or j >= n
                                          or (j, i) in chain_pairs))


@pytest.mark.parametrize("n", [0, 1, 6, 13])
@pytest.mark.parametrize("radius", [0, 1, 2, 9])
@pytest.mark.parametrize("dilation", [1, 2, 5])
def test_dilated_window_graph(n, radius, dilation):
    def allowed(i, j, causal):
        steps, rest = divmod(abs(i - j), dilation)
        return rest == 0 and steps <= radius and (j <= i or not causal)

    for causal in (False, True):
        assert_edges_equal(graphs.window_graph(n, radius, causal, dilation=dilation),
                           brute_force(n, lambda i, j, c=causal: allowed(i, j, c)))


@pytest.mark.parametrize("n", [0, 1, 7, 12])
@pytest.mark.parametrize("stride", [1, 3, 5, 20])
@pytest.mark.parametrize("causal", [False, True])
def test_strided_graph(n, stride, causal):
    expected = brute_force(n, lambda i, j: (i - j) % stride == 0 and (j <= i or not causal))
    assert_edges_equal(graphs.strided_graph(n, stride, causal=causal), expected)


def test_head_patterns_mask_each_head_to_its_graph():
    n = 9
    heads = [graphs.window_graph(n, 1, causal=True), graphs.strided_graph(n, 3, causal=True),
             graphs.global_token_graph(n, [4])]
    edge_index, bias = graphs.head_patterns(heads, n)
    assert_edges_equal(edge_index, graphs.union(heads, n))
    assert bias.shape == (edge_index.size(1), 3) and bias.dtype == torch.float32
    for h, head in enumerate(heads):
        mine = graphs.to_dense_mask(head, n)[edge_index[1], edge_index[0]]  # (E,)
        assert torch.equal(bias[:, h] == 0, mine)
        assert torch.equal(bias[:, h] == float("-inf"), ~mine)


@pytest.mark.parametrize("backend", ["reference", "cpu", "dense", "triton"])
def test_head_patterns_give_each_head_its_own_attention(backend, request):
    """One call over the union with the heads' bias == each head's attention over its own
    graph (dense attention with that head's mask): outputs and gradients; head 2's graph
    leaves most targets without an edge, whose output there is 0. (triton: in Triton's
    interpreter.)"""
    from conftest import assert_close

    from graphattn.functional import dense_attention, edge_attention

    if backend == "triton":
        request.getfixturevalue("triton_interpreter")

    n, C = 12, 4
    heads = [graphs.window_graph(n, 2, causal=True), graphs.strided_graph(n, 4, causal=True),
             torch.tensor([[0, 5, 7], [3, 3, 9]])]
    edge_index, bias = graphs.head_patterns(heads, n)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 3, C, generator=gen).requires_grad_() for _ in range(3))
    out = edge_attention(q, k, v, edge_index, bias=bias, backend=backend)  # (n, 3, C)
    want = torch.cat([dense_attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1],
                                      graphs.to_dense_mask(head, n))
                      for h, head in enumerate(heads)], dim=1)  # (n, 3, C)
    assert_close(out, want)
    assert torch.equal(out[[0, 1, 2, 4], 2], torch.zeros(4, C))
    weight = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad((out * weight).sum(), (q, k, v))
    expected = torch.autograd.grad((want * weight).sum(), (q, k, v))
    for a, b in zip(got, expected, strict=True):
        assert torch.isfinite(a).all()
        assert_close(a, b)


def test_head_patterns_bias_in_the_inputs_dtype():
    from graphattn.functional import edge_attention

    heads = [graphs.window_graph(8, 1), graphs.strided_graph(8, 3)]
    edge_index, bias = graphs.head_patterns(heads, 8, dtype=torch.bfloat16)
    assert bias.dtype == torch.bfloat16
    assert torch.equal(bias.float(), graphs.head_patterns(heads, 8)[1])
    q = torch.randn(8, 2, 4, dtype=torch.bfloat16)
    assert edge_attention(q, q, q, edge_index, bias=bias).dtype == torch.bfloat16


@pytest.mark.parametrize("call,error,match", [
    (lambda: graphs.head_patterns([graphs.chain_graph(3)], 3, dtype=torch.int64), TypeError,
     r"dtype must be a floating-point torch.dtype, got torch.int64"),
    (lambda: graphs.window_graph(5, 1, dilation=0), ValueError,
     r"dilation must be a positive integer, got 0"),
    (lambda: graphs.strided_graph(5, 0), ValueError,
     r"stride must be a positive integer, got 0"),
    (lambda: graphs.strided_graph(5, 1.5), ValueError,
     r"stride must be a positive integer, got 1.5"),
    (lambda: graphs.head_patterns([], 4), ValueError,
     r"edge_indices must hold one graph per head, got none"),
    (lambda: graphs.head_patterns([graphs.chain_graph(5)], 4), ValueError,
     r"edge_indices\[0\]: edge_index\[0\] \(sources\) must be < the number of source nodes 4"),
])
def test_head_pattern_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
