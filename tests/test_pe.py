"""Positional encodings: sinusoidal and learned, Laplacian and random-walk, PyG transforms.

References are independent: closed forms (path and cycle spectra, walks on a chain), networkx's
normalized Laplacian with numpy's eigensolver, and numpy matrix powers.
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch_geometric.transforms as T
from conftest import assert_close
from torch_geometric.data import Data

from graphattn import graphs, pe

# ---------------------------------------------------------------- sinusoidal and learned


def test_sinusoidal_matches_transformer_formula():
    L, d = 12, 6
    expected = torch.empty(L, d)
    for t in range(L):
        for i in range(d // 2):
            omega = 1.0 / 10000 ** (2 * i / d)
            expected[t, 2 * i] = math.sin(t * omega)
            expected[t, 2 * i + 1] = math.cos(t * omega)
    assert_close(pe.sinusoidal(L, d), expected)
    assert pe.sinusoidal(0, 4).shape == (0, 4)



def test_sinusoidal_is_exact_at_far_positions():
    """Computed in float64: at t ~ 10^4 a float32 angle would be off by about 1e-3."""
    L, d = 10000, 8
    t = L - 1
    expected = [f(t / 10000 ** (2 * i / d)) for i in range(d // 2) for f in (math.sin, math.cos)]
    assert_close(pe.sinusoidal(L, d)[-1], torch.tensor(expected))
    x = torch.zeros(2, d)
    positions = torch.tensor([t, 12345.5], dtype=torch.float64)
    far = [f(12345.5 / 10000 ** (2 * i / d)) for i in range(d // 2) for f in (math.sin, math.cos)]
    assert_close(pe.SinusoidalPE(d)(x, positions), torch.tensor([expected, far]))

@pytest.mark.parametrize("args,match", [
    ((5, 7), r"dim must be even .* got 7"),
    ((5, 0), r"dim must be a positive integer, got 0"),
    ((-1, 4), r"num_positions must be a non-negative integer, got -1"),
])
def test_sinusoidal_errors(args, match):
    with pytest.raises(ValueError, match=match):
        pe.sinusoidal(*args)


def test_sizes_may_be_numpy_or_tensor_integers():
    edge_index = graphs.chain_graph(6)
    for n in (np.int64, torch.tensor):
        assert torch.equal(pe.sinusoidal(n(5), n(4)), pe.sinusoidal(5, 4))
        assert pe.SinusoidalPE(n(4)).dim == 4 and pe.LearnablePE(n(5), n(4)).weight.shape == (5, 4)
        assert torch.equal(pe.laplacian_pe(edge_index, n(6), n(2)),
                           pe.laplacian_pe(edge_index, 6, 2))
        assert torch.equal(pe.random_walk_pe(edge_index, n(6), n(3)),
                           pe.random_walk_pe(edge_index, 6, 3))
        assert pe.AddRandomWalkPE(n(3)).k == 3


@pytest.mark.parametrize("base", [0.0, -10000.0, float("nan"), float("inf")])
def test_sinusoidal_rejects_bad_base(base):
    with pytest.raises(ValueError, match=r"base must be a (finite|positive) number, got"):
        pe.sinusoidal(4, 4, base=base)
    with pytest.raises(ValueError, match=r"base must be a (finite|positive) number, got"):
        pe.SinusoidalPE(4, base=base)


def test_sinusoidal_pe_module():
    module = pe.SinusoidalPE(8)
    x = torch.randn(3, 5, 8)
    assert_close(module(x), x + pe.sinusoidal(5, 8))
    positions = torch.tensor([4, 0, 9])
    assert_close(module(x[0, :3], positions), x[0, :3] + pe.sinusoidal(10, 8)[positions])
    with pytest.raises(ValueError, match=r"dim must be even"):
        pe.SinusoidalPE(5)
    with pytest.raises(ValueError, match=r"x must have shape \[..., L, dim\] with dim = 8, "
                                         r"got \[5, 6\]"):
        module(torch.randn(5, 6))
    assert repr(module) == "SinusoidalPE(8)"


def test_learnable_pe():
    torch.manual_seed(0)
    module = pe.LearnablePE(10, 4)
    x = torch.randn(2, 6, 4)
    assert_close(module(x), x + module.weight[:6])
    positions = torch.tensor([9, 0, 3])
    assert_close(module(x[0, :3], positions), x[0, :3] + module.weight[positions])
    module(x).sum().backward()
    assert torch.equal(module.weight.grad[:6], torch.full((6, 4), 2.0))
    assert torch.equal(module.weight.grad[6:], torch.zeros(4, 4))
    assert repr(module) == "LearnablePE(10, 4)"


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_learnable_pe_takes_positions_of_every_integer_dtype(dtype):
    """uint8 positions must not index as a boolean mask, nor int8/int16 fail to index."""
    module = pe.LearnablePE(4, 3)
    x = torch.zeros(3, 3)
    positions = torch.tensor([0, 1, 3])
    assert torch.equal(module(x, positions.to(dtype)), module(x, positions))


def test_sinusoidal_pe_promotes_an_integer_input():
    x = torch.ones(4, 6, dtype=torch.int64)
    out = pe.SinusoidalPE(6)(x)
    assert out.dtype == torch.get_default_dtype()  # as x + LearnablePE's weights
    assert_close(out, 1 + pe.sinusoidal(4, 6))
    half = torch.zeros(4, 6, dtype=torch.float16)
    assert pe.SinusoidalPE(6)(half).dtype == torch.float16  # a float x keeps its dtype


def test_learnable_pe_out_of_range():
    module = pe.LearnablePE(5, 4)
    with pytest.raises(IndexError, match=r"max_len=5 positions, got a sequence of length 6"):
        module(torch.zeros(6, 4))
    with pytest.raises(IndexError, match=r"positions must lie in \[0, max_len\) = \[0, 5\), "
                                         r"got values in \[0, 5\]"):
        module(torch.zeros(2, 4), torch.tensor([0, 5]))
    with pytest.raises(IndexError, match=r"got values in \[-1, 2\]"):
        module(torch.zeros(2, 4), torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match=r"max_len must be a positive integer, got 0"):
        pe.LearnablePE(0, 4)


def test_learnable_pe_takes_a_sequence_of_exactly_max_len():
    module = pe.LearnablePE(5, 4)
    x = torch.randn(5, 4)
    assert_close(module(x), x + module.weight)


def test_learnable_pe_starts_as_bert_normal():
    """The embeddings start as N(0, 0.02^2), as documented (BERT, GPT-2)."""
    torch.manual_seed(0)
    weight = pe.LearnablePE(4096, 64).weight.detach().double()
    assert abs(weight.mean().item()) < 1e-3
    assert weight.std().item() == pytest.approx(0.02, rel=0.02)


# ---------------------------------------------------------------- Laplacian: closed forms


def expected_sign_rule(vec: np.ndarray) -> np.ndarray:
    """The documented sign convention, written out: the first largest-magnitude entry > 0."""
    mag = np.abs(vec)
    first = next(t for t in range(vec.size) if mag[t] >= mag.max() * (1 - 1e-9))
    return vec if vec[first] > 0 else -vec


SPARSE_METHODS = ("shift-invert", "lanczos", "chebyshev")


def force_sparse_method(monkeypatch, method: str) -> tuple[list, list]:
    """Make ``solver="sparse"`` take ``method`` whatever the graph, without a probe; returns
    the lists that get the shift of each ``eigsh`` call and, for each call of the Chebyshev
    filter, whether it converged (rather than handing over to Lanczos)."""
    assert method in SPARSE_METHODS
    monkeypatch.setattr(pe, "SHIFT_INVERT_MAX_ENVELOPE", 10**18 if method == "shift-invert" else -1)
    monkeypatch.setattr(pe, "SHIFT_INVERT_MAX_EIGENVALUE", math.inf)  # no probe
    monkeypatch.setattr(pe, "CHEBYSHEV_MAX_EIGENVALUE", math.inf if method == "chebyshev" else 0.0)
    monkeypatch.setattr(pe, "CHEBYSHEV_MAX_K", 10**9)
    shifts, converged = [], []
    eigsh, chebyshev = pe.eigsh, pe._chebyshev_smallest

    def spy_eigsh(*args, **kwargs):
        shifts.append(kwargs.get("sigma"))
        return eigsh(*args, **kwargs)

    def spy_chebyshev(*args, **kwargs):
        result = chebyshev(*args, **kwargs)
        converged.append(result is not None)
        return result

    monkeypatch.setattr(pe, "eigsh", spy_eigsh)
    monkeypatch.setattr(pe, "_chebyshev_smallest", spy_chebyshev)
    return shifts, converged


def assert_method_ran(method: str, shifts: list, converged: list) -> None:
    """The calls that :func:`force_sparse_method` recorded are those of ``method`` only."""
    if method == "chebyshev":
        assert converged and all(converged) and not shifts
    else:
        assert shifts and all((shift is not None) == (method == "shift-invert")
                              for shift in shifts) and not converged


@pytest.fixture(params=("dense",) + SPARSE_METHODS)
def solver(request, monkeypatch):
    """A ``solver=`` for ``laplacian_pe``: dense, or sparse with each of its methods, forced,
    and checked to be the one that ran."""
    if request.param == "dense":
        yield "dense"
        return
    calls = force_sparse_method(monkeypatch, request.param)
    yield "sparse"
    assert_method_ran(request.param, *calls)


def test_laplacian_pe_path_is_cosines(solver):
    check_path_cosines(40, 6, solver)


def test_laplacian_pe_path_all_eigenvectors(solver):
    # all 11, or (the sparse solver needs n_eig < N - 2) 9 of them: Lanczos rounds collect
    # them until its Krylov space no longer fits beside them, then the dense fallback runs on
    # the nodes with edges (here the two ends have degree 1)
    check_path_cosines(12, 11 if solver == "dense" else 9, solver)


def check_path_cosines(n: int, k: int, solver: str) -> None:
    """Path 0-1-..-n-1: u_m(t) ~ sqrt(d_t) cos(pi m t / (n-1)), lambda_m = 1 - cos(pi m/(n-1))."""
    enc, lam = pe.laplacian_pe(graphs.chain_graph(n), n, k, solver=solver,
                               return_eigenvalues=True)
    t = np.arange(n)
    sqrt_deg = np.where((t == 0) | (t == n - 1), 1.0, math.sqrt(2.0))
    for m in range(1, k + 1):
        u = sqrt_deg * np.cos(math.pi * m * t / (n - 1))
        u = u / np.linalg.norm(u)
        col = enc[:, m - 1].double()
        sign = torch.sign(col @ torch.from_numpy(u))
        assert_close(col * sign, torch.from_numpy(u), dtype=torch.float32)  # up to sign
        assert_close(col, torch.from_numpy(expected_sign_rule(u)), dtype=torch.float32)
        assert lam[m - 1].item() == pytest.approx(1 - math.cos(math.pi * m / (n - 1)), abs=1e-6)


def test_laplacian_pe_cycle_eigenspaces_are_sinusoid_pairs():
    """Cycle C_n: the eigenspace of 1 - cos(2 pi m / n) is span{sin, cos}(2 pi m t / n).

    The sinusoidal encoding's column pair at frequency omega_i = base^(-2i/d) is that pair when
    omega_i = 2 pi m / n; with d = 4 the second pair has omega_1 = base^(-1/2), so
    base = (n / (2 pi m))^2 puts it on the m-th eigenspace. Eigenvectors inside a 2-d eigenspace
    are arbitrary, so the test projects the pair onto the span and checks the residual.
    """
    n, pairs = 16, 3
    cycle = torch.cat([graphs.chain_graph(n), torch.tensor([[0, n - 1], [n - 1, 0]])], dim=1)
    enc, lam = pe.laplacian_pe(cycle, n, 2 * pairs, return_eigenvalues=True)
    enc = enc.double()
    for m in range(1, pairs + 1):
        expected_lam = 1 - math.cos(2 * math.pi * m / n)
        assert lam[2 * m - 2: 2 * m].tolist() == pytest.approx([expected_lam] * 2, abs=1e-6)
        base = (n / (2 * math.pi * m)) ** 2
        pair = pe.sinusoidal(n, 4, base=base)[:, 2:].double()  # sin, cos at omega = 2 pi m / n
        t = torch.arange(n, dtype=torch.float64)
        assert_close(pair[:, 0], torch.sin(2 * math.pi * m * t / n), dtype=torch.float32)
        for m_space in range(1, pairs + 1):
            basis = enc[:, 2 * m_space - 2: 2 * m_space]  # (n, 2), orthonormal
            residual = pair - basis @ (basis.t() @ pair)
            relative = (residual.norm() / pair.norm()).item()
            if m_space == m:
                assert relative < 1e-5
            else:
                assert relative > 0.99  # orthogonal to the other eigenspaces


# ---------------------------------------------------------------- Laplacian: general graphs


def mixed_graph() -> tuple[torch.Tensor, int]:
    """Two components with edges (given in one direction only) and two isolated nodes, 18, 19."""
    G = nx.disjoint_union(nx.gnp_random_graph(12, 0.35, seed=11), nx.path_graph(6))
    G.add_nodes_from([18, 19])
    assert nx.number_connected_components(G) == 4 and nx.is_connected(G.subgraph(range(12)))
    edge_index = torch.tensor([(min(u, v), max(u, v)) for u, v in G.edges]).t()
    return edge_index, 20


def reference_laplacian(edge_index: torch.Tensor, n: int) -> tuple[np.ndarray, int]:
    """networkx's normalized Laplacian (0 rows at isolated nodes) and the number of components."""
    G = graphs.to_networkx(edge_index, n, undirected=True)
    G.remove_edges_from(list(nx.selfloop_edges(G)))
    lap = nx.normalized_laplacian_matrix(G, nodelist=range(n)).toarray()
    return lap, nx.number_connected_components(G)


def test_laplacian_pe_against_networkx(solver):
    edge_index, n = mixed_graph()
    lap, c = reference_laplacian(edge_index, n)
    assert c == 4
    k = 8
    enc, lam = pe.laplacian_pe(edge_index, n, k, solver=solver, return_eigenvalues=True)
    enc, lam = enc.double().numpy(), lam.double().numpy()
    expected_lam = np.linalg.eigvalsh(lap)[c:c + k]
    np.testing.assert_allclose(lam, expected_lam, atol=1e-5)
    np.testing.assert_allclose(lap @ enc, enc * lam, atol=1e-5)  # eigenvectors
    np.testing.assert_allclose(enc.T @ enc, np.eye(k), atol=1e-5)  # orthonormal
    G = graphs.to_networkx(edge_index, n, undirected=True)
    for comp in nx.connected_components(G):  # orthogonal to each trivial eigenvector
        trivial = np.zeros(n)
        trivial[list(comp)] = [math.sqrt(G.degree(v)) for v in comp]
        np.testing.assert_allclose(trivial @ enc, 0.0, atol=1e-5)
    assert np.isfinite(enc).all()
    assert (enc[18:] == 0).all()  # isolated nodes have no position


def test_laplacian_pe_ignores_direction_multi_edges_and_self_loops():
    edge_index, n = mixed_graph()
    expected = pe.laplacian_pe(edge_index, n, 5)
    noisy = torch.cat([edge_index.flip(0), edge_index, torch.tensor([[0, 3, 3], [0, 3, 3]])],
                      dim=1)
    assert_close(pe.laplacian_pe(noisy, n, 5), expected)



def test_laplacian_pe_counts_a_repeated_edge_once(solver):
    """Repeating only some edges (repeating all of them scales A, which the normalized
    Laplacian does not see) leaves the unweighted graph's eigenpairs."""
    edge_index, n = mixed_graph()
    lap, c = reference_laplacian(edge_index, n)
    repeated = torch.cat([edge_index, edge_index[:, :3], edge_index[:, :3].flip(0)], dim=1)
    k = 6
    enc, lam = pe.laplacian_pe(repeated, n, k, solver=solver, return_eigenvalues=True)
    enc, lam = enc.double().numpy(), lam.double().numpy()
    np.testing.assert_allclose(lam, np.linalg.eigvalsh(lap)[c:c + k], atol=1e-5)
    np.testing.assert_allclose(lap @ enc, enc * lam, atol=1e-5)

def test_laplacian_pe_eigenvalue_two_is_not_confused_with_trivial(solver):
    """A perfect matching's non-trivial spectrum is {2}, the top of the spectrum of every
    bipartite graph: the sparse solver must not return null-space directions for it."""
    n, k = 40, 3
    src = torch.arange(0, n, 2)
    edge_index = torch.stack([src, src + 1])  # 20 disjoint edges 2i - 2i+1
    enc, lam = pe.laplacian_pe(edge_index, n, k, solver=solver, return_eigenvalues=True)
    enc = enc.double()
    assert lam.tolist() == pytest.approx([2.0] * k, abs=1e-6)
    # Orthogonal to each edge's trivial eigenvector (1, 1) / sqrt(2): u[2i] = -u[2i+1].
    assert_close(enc[0::2] + enc[1::2], torch.zeros(n // 2, k, dtype=torch.float64),
                 dtype=torch.float32)
    assert_close(enc.t() @ enc, torch.eye(k, dtype=torch.float64), dtype=torch.float32)


def assert_lowest_eigenpairs(lap: np.ndarray, c: int, enc: torch.Tensor,
                             lam: torch.Tensor) -> None:
    """``enc`` and ``lam`` hold the k lowest non-trivial eigenpairs of ``lap`` (a graph's
    normalized Laplacian with c components), then zero columns (and eigenvalues) past N - c.
    Inside a repeated eigenvalue any orthonormal basis of its eigenspace will do, so the check
    is: numpy's eigenvalues, L u = lambda u, and orthonormal columns (which makes them
    orthogonal to the trivial eigenvectors, at 0)."""
    n, k = lap.shape[0], enc.size(1)
    m = min(k, n - c)
    enc, lam = enc.double(), lam.double()
    expected = torch.zeros(k, dtype=torch.float64)
    expected[:m] = torch.from_numpy(np.linalg.eigvalsh(lap)[c:c + m])
    assert_close(lam, expected, dtype=torch.float32)
    assert_close(torch.from_numpy(lap) @ enc, enc * lam, dtype=torch.float32)
    gram = torch.zeros(k, k, dtype=torch.float64)
    gram[:m, :m] = torch.eye(m, dtype=torch.float64)
    assert_close(enc.t() @ enc, gram, dtype=torch.float32)


def from_networkx(G: nx.Graph) -> tuple[torch.Tensor, int]:
    """``edge_index`` and node count of a networkx graph (isolated nodes count too)."""
    G = nx.convert_node_labels_to_integers(G)
    return graphs.from_networkx(G), G.number_of_nodes()


# Graphs whose normalized Laplacian repeats eigenvalues many times over: Lanczos from one start
# vector finds only one vector per eigenspace (the projection of the start vector on it).
REPEATED_EIGENVALUE_GRAPHS = {
    "hypercube-5": nx.hypercube_graph(5),  # 2 i / 5, binomial(5, i) times
    "5-cycles-of-7": nx.disjoint_union_all([nx.cycle_graph(7)] * 5),  # each 10 times
    "binary-tree-31": nx.balanced_tree(2, 4),
    "5-stars-of-5-and-4-isolated": nx.disjoint_union_all([nx.star_graph(5)] * 5
                                                         + [nx.empty_graph(4)]),  # 1: 20 times
}


@pytest.mark.parametrize("name", REPEATED_EIGENVALUE_GRAPHS)
def test_laplacian_pe_finds_every_copy_of_a_repeated_eigenvalue(name, solver):
    """The sparse solver used to return only some vectors of a repeated eigenvalue's eigenspace
    and then the next eigenvalue up (0.8 for the fifth 0.4 of the 5-cube); its extra rounds,
    each from a new start vector with the eigenvectors found so far moved away, find the rest."""
    edge_index, n = from_networkx(REPEATED_EIGENVALUE_GRAPHS[name])
    lap, c = reference_laplacian(edge_index, n)
    for k in range(1, 17):
        enc, lam = pe.laplacian_pe(edge_index, n, k, solver=solver, return_eigenvalues=True)
        assert_lowest_eigenpairs(lap, c, enc, lam)


def test_laplacian_pe_sparse_equals_dense_on_a_disconnected_graph(solver):
    """5 hexagons and 4 isolated nodes (34 nodes, 9 components; eigenvalues 0.5 and 1.5 ten
    times each, 2 five times), every k with padding: the sparse solver used to stop with
    ARPACK error 3 (no shifts could be applied: every unwanted Ritz value exact, as happens
    when a few distinct eigenvalues repeat) or to miss copies of 0.5."""
    edge_index, n = from_networkx(nx.disjoint_union_all([nx.cycle_graph(6)] * 5
                                                        + [nx.empty_graph(4)]))
    lap, c = reference_laplacian(edge_index, n)
    for k in range(1, n + 2):
        enc, lam = pe.laplacian_pe(edge_index, n, k, pad=True, solver=solver,
                                   return_eigenvalues=True)
        dense_enc, dense_lam = pe.laplacian_pe(edge_index, n, k, pad=True, solver="dense",
                                               return_eigenvalues=True)
        assert_close(lam, dense_lam)
        assert torch.equal(enc[30:], dense_enc[30:])  # isolated nodes: 0
        assert torch.equal(enc[:, 25:], dense_enc[:, 25:])  # padding past N - c = 25: 0
        assert_lowest_eigenpairs(lap, c, enc, lam)


def well_separated_graph(n: int) -> tuple[torch.Tensor, int]:
    """A connected small-world graph whose lowest eigenvalues are simple."""
    G = nx.connected_watts_strogatz_graph(n, 4, 0.4, seed=3)
    return graphs.from_networkx(G), n


@pytest.mark.parametrize("method", SPARSE_METHODS)
def test_laplacian_pe_dense_and_sparse_agree_with_signs(method, monkeypatch):
    calls = force_sparse_method(monkeypatch, method)
    edge_index, n = well_separated_graph(150)
    k = 6
    lap, _ = reference_laplacian(edge_index, n)
    vals = np.linalg.eigvalsh(lap)[: k + 2]
    assert np.diff(vals).min() > 1e-3  # simple eigenvalues: eigenvectors unique up to sign
    dense = pe.laplacian_pe(edge_index, n, k, solver="dense")
    sparse = pe.laplacian_pe(edge_index, n, k, solver="sparse")
    assert_method_ran(method, *calls)
    assert_close(sparse, dense)
    for col in dense.t().double().numpy():
        assert_close(torch.from_numpy(col), torch.from_numpy(expected_sign_rule(col)))



def test_weighted_laplacian_pe_against_a_dense_reference(solver):
    # directed, weighted multi-edges and loops: A = (W + W^T) / 2 without the diagonal, and
    # the eigenvectors of I - D^-1/2 A D^-1/2, simple here, up to the sign rule
    edge_index, n = well_separated_graph(60)
    gen = torch.Generator().manual_seed(7)
    extra = torch.randint(0, n, (2, 30), generator=gen)
    edge_index = torch.cat([edge_index, extra, torch.arange(5).repeat(2, 1)], dim=1)
    weight = torch.rand(edge_index.size(1), generator=gen, dtype=torch.float64) + 0.1
    w = np.zeros((n, n))
    np.add.at(w, (edge_index[0].numpy(), edge_index[1].numpy()), weight.numpy())
    adj = (w + w.T) / 2
    np.fill_diagonal(adj, 0.0)
    inv_sqrt = 1 / np.sqrt(adj.sum(axis=1))
    vals, vecs = np.linalg.eigh(np.eye(n) - inv_sqrt[:, None] * adj * inv_sqrt[None, :])
    k = 5
    assert np.diff(vals[: k + 2]).min() > 1e-3
    enc, lam = pe.laplacian_pe(edge_index, n, k, solver=solver, edge_weight=weight,
                               return_eigenvalues=True)
    np.testing.assert_allclose(lam.double().numpy(), vals[1:k + 1], atol=1e-6)
    expected = np.stack([expected_sign_rule(vecs[:, m]) for m in range(1, k + 1)], axis=1)
    assert_close(enc, torch.from_numpy(expected), dtype=torch.float32)


def test_weighted_laplacian_pe_scale_and_zero_weights():
    edge_index, n = well_separated_graph(40)  # both directions, no multi-edges
    unweighted = pe.laplacian_pe(edge_index, n, 4)
    scaled = pe.laplacian_pe(edge_index, n, 4, edge_weight=torch.full((edge_index.size(1),), 3.5))
    assert_close(scaled, unweighted)  # D^-1/2 A D^-1/2 does not see a common factor
    # a path 0 - 1 - 2 - 3 whose middle edge weighs 0: two components, two non-trivial columns
    path = torch.tensor([[0, 1, 1, 2, 2, 3], [1, 0, 2, 1, 3, 2]])
    weight = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    enc = pe.laplacian_pe(path, 4, 2, edge_weight=weight).double()
    # eigenvalue 2 twice (each edge alone): only the span {e0 - e1, e2 - e3} is determined
    half = math.sqrt(0.5)
    basis = torch.tensor([[half, 0.0], [-half, 0.0], [0.0, half], [0.0, -half]],
                         dtype=torch.float64)
    assert_close(enc @ enc.T, basis @ basis.T, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"N - c = 4 - 2 = 2"):
        pe.laplacian_pe(path, 4, 3, edge_weight=weight)
    with pytest.raises(ValueError, match=r"edge_weight must be finite and non-negative"):
        pe.laplacian_pe(path, 4, 2, edge_weight=-weight - 1)


@pytest.mark.parametrize("eps", [1e-10, 1e-13, 1e-17])
def test_weighted_laplacian_pe_of_a_weak_link(solver, eps):
    """Two 4-cliques joined by one edge of weight eps: the lowest eigenvalue is about eps / 6,
    below eigh's rounding at 1e-17, and its eigenvector is exactly antisymmetric (i -> 7 - i)
    and orthogonal to the trivial one, D^1/2 1. Each solver must keep the trivial vector out."""
    clique = [(i, j) for c in (range(4), range(4, 8)) for i in c for j in c if i != j]
    edge_index = torch.tensor(clique + [(3, 4), (4, 3)]).t()
    weight = torch.tensor([1.0] * len(clique) + [eps, eps], dtype=torch.float64)
    enc, lam = pe.laplacian_pe(edge_index, 8, 1, solver=solver, edge_weight=weight,
                               return_eigenvalues=True)
    u = enc[:, 0].double()
    deg = torch.full((8,), 3.0, dtype=torch.float64)
    deg[[3, 4]] += eps
    trivial = deg.sqrt() / deg.sqrt().norm()
    assert abs(float(u @ trivial)) < 1e-6
    assert_close(u[:4], -u.flip(0)[:4], dtype=torch.float32)
    assert_close(u.abs(), torch.full((8,), math.sqrt(1 / 8), dtype=torch.float64),
                 dtype=torch.float32)
    assert 0 <= float(lam) < 1e-9


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_laplacian_pe_equals_pyg_up_to_sign(weighted):
    """PyG's AddLaplacianEigenvectorPE on an undirected graph (both directions, the same
    weight each way) finds the same eigenvectors; it fixes no sign."""
    edge_index, n = well_separated_graph(30)
    gen = torch.Generator().manual_seed(1)
    pair_weight = torch.rand(n, n, generator=gen, dtype=torch.float64) + 0.5
    pair_weight = pair_weight + pair_weight.T  # symmetric
    weight = pair_weight[edge_index[0], edge_index[1]] if weighted else None
    data = Data(edge_index=edge_index, edge_weight=weight, num_nodes=n)
    pyg = T.AddLaplacianEigenvectorPE(4, attr_name="pe", is_undirected=True)(data).pe
    ours = pe.laplacian_pe(edge_index, n, 4, edge_weight=weight)
    assert_close(ours.abs(), pyg.abs(), dtype=torch.float32)
    assert_close(pe.AddLaplacianPE(4)(data).laplacian_pe, ours)


def test_transforms_read_edge_weight_per_graph_of_a_batch():
    """data.edge_weight weights both encodings, as PyG's transforms read it; on a batch each
    graph's encoding uses its own edges' weights."""
    from torch_geometric.data import Batch

    gen = torch.Generator().manual_seed(8)
    data_list = []
    for edge_index, n in (well_separated_graph(12), (graphs.grid_graph(2, 3), 6)):
        weight = torch.rand(edge_index.size(1), generator=gen) + 0.5
        data_list.append(Data(edge_index=edge_index, edge_weight=weight, num_nodes=n))
    batch = Batch.from_data_list(data_list)
    perm = torch.randperm(batch.edge_index.size(1), generator=gen)  # edges in any order
    batch.edge_index, batch.edge_weight = batch.edge_index[:, perm], batch.edge_weight[perm]
    for transform, fn, attr in ((pe.AddLaplacianPE(3), pe.laplacian_pe, "laplacian_pe"),
                                (pe.AddRandomWalkPE(4), pe.random_walk_pe, "random_walk_pe")):
        expected = torch.cat([fn(d.edge_index, d.num_nodes, transform.k,
                                 edge_weight=d.edge_weight) for d in data_list])
        assert_close(transform(batch)[attr], expected)
        unweighted = torch.cat([fn(d.edge_index, d.num_nodes, transform.k) for d in data_list])
        assert not torch.allclose(expected, unweighted, atol=1e-3)
        extra = batch.clone()
        extra.edge_weight = torch.ones(batch.edge_index.size(1) + 1)  # checked before a split
        with pytest.raises(ValueError, match=r"edge_weight must have shape \[E\] = \[\d+\]"):
            transform(extra)


def test_laplacian_pe_does_not_rely_on_the_order_eigsh_returns(solver, monkeypatch):
    """ARPACK does not promise an order: the sparse solver sorts the eigenpairs itself."""
    eigsh = pe.eigsh

    def reversed_eigsh(*args, **kwargs):
        vals, vecs = eigsh(*args, **kwargs)
        return vals[::-1], vecs[:, ::-1]

    monkeypatch.setattr(pe, "eigsh", reversed_eigsh)
    n, k = 40, 5
    enc, lam = pe.laplacian_pe(graphs.chain_graph(n), n, k, solver=solver,
                               return_eigenvalues=True)
    expected = 1 - np.cos(np.pi * np.arange(1, k + 1) / (n - 1))
    np.testing.assert_allclose(lam.double().numpy(), expected, atol=1e-6)

def test_laplacian_pe_on_a_long_path_by_default(monkeypatch):
    """Above the dense limit a path takes the shift-invert method, whose lowest eigenvalues
    (about pi^2 m^2 / 2 (n-1)^2, 2e-7 here) are crowded for plain Lanczos."""
    n, k = 5000, 4
    shifts = []
    eigsh = pe.eigsh
    monkeypatch.setattr(pe, "eigsh",
                        lambda *a, **kw: shifts.append(kw.get("sigma")) or eigsh(*a, **kw))
    enc, lam = pe.laplacian_pe(graphs.chain_graph(n), n, k, return_eigenvalues=True)
    assert n > pe.DENSE_SOLVER_MAX_NODES and shifts and all(shift < 0 for shift in shifts)
    m = np.arange(1, k + 1)
    expected = 2 * np.sin(np.pi * m / (2 * (n - 1))) ** 2  # = 1 - cos(pi m / (n - 1))
    np.testing.assert_allclose(lam.double().numpy(), expected, rtol=1e-5)
    t = np.arange(n)
    sqrt_deg = np.where((t == 0) | (t == n - 1), 1.0, math.sqrt(2.0))
    for j in range(k):
        u = sqrt_deg * np.cos(math.pi * m[j] * t / (n - 1))
        u = u / np.linalg.norm(u)
        col = enc[:, j].double().numpy()
        np.testing.assert_allclose(col * np.sign(col @ u), u, atol=1e-5)  # up to sign


def random_graph_with_a_tail(core: int, tail: int, seed: int) -> tuple[torch.Tensor, int]:
    """The giant component of a random graph of ``core`` nodes and mean degree 4, with a path
    of ``tail`` more nodes hanging off its node 0."""
    G = nx.gnm_random_graph(core, 2 * core, seed=seed)
    G = nx.convert_node_labels_to_integers(G.subgraph(max(nx.connected_components(G), key=len)))
    start = G.number_of_nodes()
    nx.add_path(G, [0, *range(start, start + tail)])
    return graphs.from_networkx(G), G.number_of_nodes()


@pytest.fixture
def float64_default():
    """float64 as the default dtype, so that ``laplacian_pe`` returns what its solver found."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


def test_laplacian_pe_of_a_random_graph_with_a_tail(monkeypatch, float64_default):
    """A path hanging off a random graph: the lowest eigenpairs live on the path, their
    eigenvalues tiny and crowded (from 5e-6 here), while the random graph makes the
    factorization of shift-invert fill in. At 20000 nodes its envelope is above
    ``SHIFT_INVERT_MAX_ENVELOPE`` and Lanczos on the Laplacian took about a minute for k = 8; this
    graph of about 2100 nodes gets the same route by a bound just below its envelope: the probe,
    then the Chebyshev filter, with no Lanczos round and no factorization. Its eigenpairs are
    those of the dense solver: eigenvalues, residuals, orthonormal columns that leave out the
    trivial vector, and the sign rule."""
    edge_index, n = random_graph_with_a_tail(1600, 500, seed=0)
    lap, c = reference_laplacian(edge_index, n)
    assert c == 1 and n > pe.DENSE_SOLVER_MAX_NODES
    adj = pe._adjacency(edge_index, n)
    sqrt_deg = np.sqrt(np.asarray(adj.sum(axis=1)).ravel())  # (n,): the trivial vector
    scaled = sp.diags(1 / sqrt_deg)
    monkeypatch.setattr(pe, "SHIFT_INVERT_MAX_ENVELOPE",
                        pe._envelope(sp.identity(n) - scaled @ adj @ scaled) - 1)
    ran, deflated_lanczos, splu = [], pe._deflated_lanczos, pe.splu
    monkeypatch.setattr(pe, "_deflated_lanczos",
                        lambda *a, **kw: ran.append("lanczos") or deflated_lanczos(*a, **kw))
    monkeypatch.setattr(pe, "splu", lambda *a, **kw: ran.append("splu") or splu(*a, **kw))
    k = 8
    enc, lam = pe.laplacian_pe(edge_index, n, k, return_eigenvalues=True)
    assert ran == []
    enc, lam = enc.numpy(), lam.numpy()
    expected = np.linalg.eigvalsh(lap)[1:k + 1]
    assert expected[0] < 1e-5 and expected[-1] < 2e-3  # tiny: the tail's
    np.testing.assert_allclose(lam, expected, rtol=0, atol=1e-12)
    assert np.linalg.norm(lap @ enc - enc * lam, axis=0).max() < 1e-12
    np.testing.assert_allclose(enc.T @ enc, np.eye(k), rtol=0, atol=1e-12)
    np.testing.assert_allclose(sqrt_deg @ enc / np.linalg.norm(sqrt_deg), 0.0, atol=1e-12)
    for col in enc.T:
        np.testing.assert_array_equal(col, expected_sign_rule(col))


def test_laplacian_pe_hands_over_to_lanczos_when_the_filter_stops_short(monkeypatch):
    """A Chebyshev filter that does not converge within its sweeps returns nothing, and
    Lanczos rounds find the eigenpairs."""
    shifts, converged = force_sparse_method(monkeypatch, "chebyshev")
    monkeypatch.setattr(pe, "_CHEBYSHEV_MAX_SWEEPS", 2)
    edge_index, n = well_separated_graph(150)
    lap, _ = reference_laplacian(edge_index, n)
    k = 6
    enc, lam = pe.laplacian_pe(edge_index, n, k, solver="sparse", return_eigenvalues=True)
    assert converged == [False] and shifts  # then Lanczos on L
    assert_lowest_eigenpairs(lap, 1, enc, lam)


def test_chebyshev_filter_damps_the_trivial_vector():
    """The filter runs on M = L + 2 U U^T, where the trivial vector U lies in the damped
    interval [a, 2]: on L itself it would sit at 0, where the filter is largest, and the
    trivial components that rounding leaves would grow over the sweeps past the wanted
    eigenvectors (tried on a random graph of 20000 nodes: the Ritz vectors had lost their
    orthogonality to U by the seventh sweep)."""
    n = 200
    adj = pe._adjacency(graphs.chain_graph(n), n)
    deg = np.asarray(adj.sum(axis=1)).ravel()
    scaled = sp.diags(1 / np.sqrt(deg))
    lap = (sp.identity(n) - scaled @ adj @ scaled).tocsr()
    null = pe._null_space(deg, np.zeros(n, dtype=np.int64), 1)  # (n, 1): D^1/2 1, normalized
    vals, vecs = np.linalg.eigh(lap.toarray())
    block = np.stack([null.toarray()[:, 0], vecs[:, 1]], axis=1)  # U and u_1
    lower = vals[4]
    degree = pe._chebyshev_degree(lower)
    out = pe._chebyshev_filter(lap, null, null.T.tocsr(), block, lower, degree)
    norms = np.linalg.norm(out, axis=0)
    assert norms[0] < math.exp(-pe._CHEBYSHEV_GAIN / 2) * norms[1]
    np.testing.assert_allclose(out[:, 1] / norms[1], vecs[:, 1], atol=1e-10)


def test_envelope_on_a_path_and_a_complete_graph():
    """Reverse Cuthill-McKee puts a path in band 1 (one entry left of each diagonal but the
    first); a complete graph fills every row: 0 + 1 + ... + (n - 1)."""
    def laplacian(edge_index, n):
        adj = pe._adjacency(edge_index, n)
        return (np.eye(n) - adj.toarray() / adj.sum(axis=1)).astype(float)

    n = 30
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    path = shuffled[graphs.chain_graph(n)]
    assert pe._envelope(sp.csr_matrix(laplacian(path, n))) == n - 1
    assert pe._envelope(sp.csr_matrix(laplacian(graphs.complete_graph(n), n))) == n * (n - 1) // 2


def test_relabelling_permutes_encodings():
    edge_index, n = well_separated_graph(40)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5))  # new id of node i
    relabelled = perm[edge_index]
    k = 5
    lap_pe = pe.laplacian_pe(edge_index, n, k)
    mag = lap_pe.abs()
    top2 = mag.topk(2, dim=0).values
    assert ((top2[0] - top2[1]) > 1e-4).all()  # a unique largest entry fixes each sign
    assert_close(pe.laplacian_pe(relabelled, n, k)[perm], lap_pe)
    assert_close(pe.random_walk_pe(relabelled, n, 6)[perm], pe.random_walk_pe(edge_index, n, 6))


def test_laplacian_pe_random_sign_flip():
    edge_index, n = well_separated_graph(30)
    base = pe.laplacian_pe(edge_index, n, 4)
    seen = set()
    for seed in range(8):
        flipped = pe.laplacian_pe(edge_index, n, 4, random_sign_flip=True,
                                  generator=torch.Generator().manual_seed(seed))
        signs = (flipped * base).sum(dim=0).sign()
        assert set(signs.tolist()) <= {-1.0, 1.0}
        assert_close(flipped, base * signs)
        again = pe.laplacian_pe(edge_index, n, 4, random_sign_flip=True,
                                generator=torch.Generator().manual_seed(seed))
        assert torch.equal(again, flipped)
        seen.update(signs.tolist())
    assert seen == {-1.0, 1.0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the signs "
                    "drawn by a CUDA generator beside a CUDA edge_index")
def test_laplacian_pe_random_sign_flip_with_a_cuda_generator():
    """The signs are drawn on the generator's device (a CPU draw refused a CUDA generator)."""
    edge_index, n = well_separated_graph(30)
    base = pe.laplacian_pe(edge_index, n, 4)
    flipped = pe.laplacian_pe(edge_index.cuda(), n, 4, random_sign_flip=True,
                              generator=torch.Generator("cuda").manual_seed(0))
    assert flipped.is_cuda
    signs = (flipped.cpu() * base).sum(dim=0).sign()
    assert_close(flipped.cpu(), base * signs)


def test_laplacian_pe_random_sign_flip_draws_a_sign_per_column():
    """Each column gets its own sign: with 4 columns the 8 seeds show more than the two
    patterns (all kept, all flipped) that one shared sign would give."""
    edge_index, n = well_separated_graph(30)
    lap, _ = reference_laplacian(edge_index, n)
    _, vecs = np.linalg.eigh(lap)
    fixed = torch.from_numpy(np.stack([expected_sign_rule(v) for v in vecs[:, 1:5].T], axis=1))
    patterns = set()
    for seed in range(8):
        flipped = pe.laplacian_pe(edge_index, n, 4, random_sign_flip=True,
                                  generator=torch.Generator().manual_seed(seed)).double()
        patterns.add(tuple((flipped * fixed).sum(dim=0).sign().tolist()))
    assert len(patterns) > 2, patterns


def test_laplacian_pe_k_limits_and_padding():
    n = 6
    chain = graphs.chain_graph(n)
    with pytest.raises(ValueError, match=r"N - c = 6 - 1 = 5 .* got k=6; pass pad=True"):
        pe.laplacian_pe(chain, n, n)
    padded, lam = pe.laplacian_pe(chain, n, n + 2, pad=True, return_eigenvalues=True)
    assert padded.shape == (n, n + 2)
    assert_close(padded[:, :5], pe.laplacian_pe(chain, n, 5))
    assert torch.equal(padded[:, 5:], torch.zeros(n, 3))
    assert torch.equal(lam[5:], torch.zeros(3))

    edge_index, m = mixed_graph()  # 20 nodes, 4 components (2 of them isolated nodes)
    pe.laplacian_pe(edge_index, m, 16)
    with pytest.raises(ValueError, match=r"N - c = 20 - 4 = 16 .* got k=17"):
        pe.laplacian_pe(edge_index, m, 17)
    no_edges = torch.empty(2, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"N - c = 3 - 3 = 0 .* got k=1"):
        pe.laplacian_pe(no_edges, 3, 1)
    assert torch.equal(pe.laplacian_pe(no_edges, 3, 2, pad=True), torch.zeros(3, 2))
    assert pe.laplacian_pe(no_edges, 0, 3, pad=True).shape == (0, 3)


def test_laplacian_pe_has_no_negative_zeros(solver):
    """Isolated nodes and padded columns are +0.0, whatever sign their column gets from the sign
    rule or a random flip (a flipped 0.0 is -0.0, which sign-sensitive code sees as negative)."""
    edge_index, n = mixed_graph()  # nodes 18 and 19 are isolated
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        for k, pad in ((8, False), (18, True)):
            enc = pe.laplacian_pe(edge_index, n, k, pad=pad, solver=solver,
                                  random_sign_flip=seed > 0, generator=gen)
            assert torch.equal(enc[18:], torch.zeros(2, k))
            assert not torch.signbit(enc[enc == 0]).any()


def test_laplacian_pe_leaves_isolated_nodes_out_of_the_dense_solver(monkeypatch):
    """A large graph with few edges (here 3000 nodes, one edge) must not build an N x N
    matrix: the dense solver sees only the nodes with an edge."""
    shapes = []
    eigh = np.linalg.eigh

    def recording_eigh(a, *args, **kwargs):
        shapes.append(a.shape)
        return eigh(a, *args, **kwargs)

    monkeypatch.setattr(np.linalg, "eigh", recording_eigh)
    edge_index = torch.tensor([[5, 2999], [2999, 5]])
    encoding, lam = pe.laplacian_pe(edge_index, 3000, 3, pad=True, return_eigenvalues=True)
    assert shapes == [(2, 2)]
    expected = torch.zeros(3000, 3)
    expected[5, 0], expected[2999, 0] = math.sqrt(0.5), -math.sqrt(0.5)
    assert_close(encoding, expected)
    assert_close(lam, torch.tensor([2.0, 0.0, 0.0]))


@pytest.mark.parametrize("call,error,match", [
    (lambda: pe.laplacian_pe(graphs.chain_graph(4), 4, 0), ValueError,
     r"k must be a positive integer, got 0"),
    (lambda: pe.laplacian_pe(graphs.chain_graph(4), -4, 2), ValueError,
     r"num_nodes must be a non-negative integer, got -4"),
    (lambda: pe.laplacian_pe(graphs.chain_graph(4), 3, 1), ValueError,
     r"edge_index\[0\] \(sources\) must be < the number of source nodes 3"),
    (lambda: pe.laplacian_pe(graphs.chain_graph(4), 4, 1, solver="lobpcg"), ValueError,
     r"solver must be one of \('auto', 'dense', 'sparse'\), got 'lobpcg'"),
    (lambda: pe.AddLaplacianPE(2, solver="arpack"), ValueError,
     r"solver must be one of \('auto', 'dense', 'sparse'\), got 'arpack'"),
    (lambda: pe.SinusoidalPE(16)(torch.randn(4, 16), torch.arange(4).view(4, 1)), ValueError,
     r"positions must have shape \[L\] = \[4\] \(one per row of x\), got \[4, 1\]"),
    (lambda: pe.SinusoidalPE(16)(torch.randn(4, 16), torch.arange(3)), ValueError,
     r"positions must have shape \[L\] = \[4\]"),
    (lambda: pe.SinusoidalPE(16)(torch.randn(4, 16), torch.ones(4, dtype=torch.bool)), TypeError,
     r"positions must have a real dtype, got torch.bool"),
    (lambda: pe.LearnablePE(8, 16)(torch.randn(4, 16), torch.arange(4.0)), TypeError,
     r"positions must have an integer dtype, got torch.float32"),
    (lambda: pe.LearnablePE(8, 16)(torch.randn(4, 16), torch.arange(4).view(2, 2)), ValueError,
     r"positions must have shape \[L\] = \[4\]"),
    (lambda: pe.SinusoidalPE(16)(torch.randn(4, 16), [0, 1, 2, 3]), TypeError,
     r"positions must be a torch.Tensor, got list"),
    (lambda: pe.LearnablePE(8, 16)(torch.randn(4, 16), [0, 1, 2, 3]), TypeError,
     r"positions must be a torch.Tensor, got list"),
    (lambda: pe.LearnablePE(8, 16)(torch.randn(4, 8)), ValueError,
     r"x must have shape \[..., L, dim\] with dim = 16, got \[4, 8\]"),
    (lambda: pe.LearnablePE(8, 16)(torch.randn(16)), ValueError,
     r"x must have shape \[..., L, dim\] with dim = 16, got \[16\]"),
    (lambda: pe.random_walk_pe(graphs.chain_graph(4), 4, 0), ValueError,
     r"k must be a positive integer, got 0"),
    (lambda: pe.random_walk_pe(graphs.chain_graph(4).float(), 4, 2), TypeError,
     r"edge_index must have an integer dtype"),
    (lambda: pe.random_walk_pe(graphs.chain_graph(4), 4, 2, edge_weight=torch.ones(6, 1)),
     ValueError, r"edge_weight must have shape \[E\] = \[6\], got \[6, 1\]"),
    (lambda: pe.random_walk_pe(graphs.chain_graph(4), 4, 2, edge_weight=torch.ones(6).long()),
     TypeError, r"edge_weight must be a floating-point tensor, got torch.int64"),
    (lambda: pe.random_walk_pe(graphs.chain_graph(4), 4, 2, edge_weight=[1.0] * 6),
     TypeError, r"edge_weight must be a floating-point tensor, got list"),
    (lambda: pe.random_walk_pe(graphs.chain_graph(4), 4, 2,
                               edge_weight=torch.tensor([1.0, 1, 1, -0.5, 1, 1])),
     ValueError, r"edge_weight must be finite and non-negative, got -0.5 at edge 3"),
    (lambda: pe.random_walk_pe(graphs.chain_graph(4), 4, 2,
                               edge_weight=torch.tensor([1.0, 1, 1, 1, 1, float("nan")])),
     ValueError, r"edge_weight must be finite and non-negative, got nan at edge 5"),
    (lambda: pe.laplacian_pe(graphs.chain_graph(4), 4, 2, pad="False"), TypeError,
     r"pad must be a bool, got 'False' \(a str\)"),
    (lambda: pe.laplacian_pe(graphs.chain_graph(4), 4, 2, random_sign_flip=None), TypeError,
     r"random_sign_flip must be a bool, got None"),
    (lambda: pe.laplacian_pe(graphs.chain_graph(4), 4, 2, return_eigenvalues="yes"), TypeError,
     r"return_eigenvalues must be a bool, got 'yes'"),
    (lambda: pe.AddLaplacianPE(2, random_sign_flip="False"), TypeError,
     r"random_sign_flip must be a bool, got 'False'"),
])
def test_pe_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------- random walks


def test_random_walk_pe_chain_closed_form():
    n, k = 40, 8
    enc = pe.random_walk_pe(graphs.chain_graph(n), n, k).double()
    # Far from the ends (2 * distance > t) the walk is the infinite line's: C(t, t/2) / 2^t.
    line = torch.tensor([math.comb(t, t // 2) / 2**t if t % 2 == 0 else 0.0
                         for t in range(1, k + 1)], dtype=torch.float64)
    for i in range(k // 2 + 1, n - k // 2 - 1):
        assert_close(enc[i], line, dtype=torch.float32)
    # Near an end, counted by hand (node 0 has degree 1).
    by_hand = torch.tensor([[0, 1 / 2, 0, 3 / 8], [0, 3 / 4, 0, 5 / 8], [0, 1 / 2, 0, 7 / 16]],
                           dtype=torch.float64)
    assert_close(enc[:3, :4], by_hand, dtype=torch.float32)
    assert_close(enc[-3:, :4], by_hand.flip(0), dtype=torch.float32)


def test_random_walk_pe_directed_cycle_and_sinks():
    n, k = 3, 7
    cycle = torch.tensor([[0, 1, 2], [1, 2, 0]])
    expected = torch.tensor([[1.0 if t % n == 0 else 0.0 for t in range(1, k + 1)]] * n)
    assert torch.equal(pe.random_walk_pe(cycle, n, k), expected)
    assert torch.equal(pe.random_walk_pe(graphs.chain_graph(5, directed=True), 5, 4),
                       torch.zeros(5, 4))  # no walk ever returns


def test_random_walk_pe_of_one_node_and_of_none():
    loop = torch.tensor([[0], [0]])  # a walk on one node with a self-loop never leaves it
    assert torch.equal(pe.random_walk_pe(loop, 1, 3), torch.ones(1, 3))
    assert torch.equal(pe.random_walk_pe(torch.zeros(2, 0, dtype=torch.long), 1, 3),
                       torch.zeros(1, 3))  # nowhere to go
    assert pe.random_walk_pe(torch.zeros(2, 0, dtype=torch.long), 0, 3).shape == (0, 3)


def test_random_walk_pe_against_matrix_powers():
    n, k = 15, 6
    gen = torch.Generator().manual_seed(2)
    edge_index = torch.randint(0, n, (2, 40), generator=gen)  # multi-edges, loops, sinks
    adj = np.zeros((n, n))
    np.add.at(adj, (edge_index[0].numpy(), edge_index[1].numpy()), 1.0)
    out_deg = adj.sum(axis=1, keepdims=True)
    walk = np.divide(adj, out_deg, out=np.zeros_like(adj), where=out_deg > 0)
    expected = np.stack([np.diag(np.linalg.matrix_power(walk, t)) for t in range(1, k + 1)], 1)
    assert_close(pe.random_walk_pe(edge_index, n, k), torch.from_numpy(expected),
                 dtype=torch.float32)


def test_random_walk_pe_with_edge_weights_against_matrix_powers():
    n, k = 15, 6
    gen = torch.Generator().manual_seed(3)
    edge_index = torch.randint(0, n, (2, 40), generator=gen)  # multi-edges, loops, sinks
    weight = torch.rand(40, generator=gen, dtype=torch.float64)
    weight[:3] = 0.0  # an edge of weight 0 is no edge
    adj = np.zeros((n, n))
    np.add.at(adj, (edge_index[0].numpy(), edge_index[1].numpy()), weight.numpy())
    out_deg = adj.sum(axis=1, keepdims=True)
    walk = np.divide(adj, out_deg, out=np.zeros_like(adj), where=out_deg > 0)
    expected = np.stack([np.diag(np.linalg.matrix_power(walk, t)) for t in range(1, k + 1)], 1)
    assert_close(pe.random_walk_pe(edge_index, n, k, edge_weight=weight),
                 torch.from_numpy(expected), dtype=torch.float32)
    assert_close(pe.random_walk_pe(edge_index[:, 3:], n, k, edge_weight=weight[3:].float()),
                 torch.from_numpy(expected), dtype=torch.float32)


@pytest.mark.parametrize("directed", [True, False], ids=["directed", "undirected"])
@pytest.mark.parametrize("n", [50, 8192], ids=["dense-blocks", "sparse-rows"])
def test_random_walk_pe_integer_weights_are_parallel_edges(n, directed):
    # an edge of weight w walks as w copies of it, on every route; scaling every weight
    # changes nothing
    gen = torch.Generator().manual_seed(6)
    edge_index = torch.randint(0, n, (2, 2 * n), generator=gen)
    copies = torch.randint(1, 4, (2 * n,), generator=gen)
    if not directed:
        edge_index, copies = torch.cat([edge_index, edge_index.flip(0)], 1), copies.repeat(2)
    weighted = pe.random_walk_pe(edge_index, n, 5, edge_weight=copies.double())
    assert_close(weighted, pe.random_walk_pe(edge_index.repeat_interleave(copies, dim=1), n, 5))
    assert_close(pe.random_walk_pe(edge_index, n, 5, edge_weight=copies * 0.25), weighted)


@pytest.mark.parametrize("scale", [1e-310, 1e308], ids=["subnormal", "huge"])
def test_encodings_of_weights_near_the_ends_of_the_float_range(scale):
    # the weights are divided by the largest first: degrees or their inverses overflowed
    # (inf, NaN, or a node taken for a sink)
    edge_index, n = well_separated_graph(20)
    gen = torch.Generator().manual_seed(9)
    weight = torch.rand(edge_index.size(1), generator=gen, dtype=torch.float64) + 0.5
    extreme = weight * scale  # subnormal: 13 of float64's 16 digits left; huge: degrees overflow
    for fn, k in ((pe.random_walk_pe, 5), (pe.laplacian_pe, 3)):
        assert_close(fn(edge_index, n, k, edge_weight=extreme),
                     fn(edge_index, n, k, edge_weight=weight))


def test_random_walk_pe_weighted_encodings_are_probabilities():
    # PyG's AddRandomWalkPE gives 22252.1 on this graph (pyg-team/pytorch_geometric#10098): it
    # weights every edge by 1 / max(1, weighted degree), without the edge's own weight
    torch.manual_seed(42)
    edge_index = torch.randint(0, 100, (2, 1000))
    edge_weight = torch.rand(1000)
    enc = pe.random_walk_pe(edge_index, 100, 20, edge_weight=edge_weight)
    assert enc.min() >= 0 and enc.max() <= 1
    data = Data(edge_index=edge_index, edge_weight=edge_weight, num_nodes=100)
    assert torch.equal(pe.AddRandomWalkPE(20)(data).random_walk_pe, enc)


def test_random_walk_pe_equals_pyg_without_parallel_edges():
    n, k = 40, 5
    gen = torch.Generator().manual_seed(4)
    edge_index = torch.unique(torch.randint(0, n, (2, 160), generator=gen), dim=1)
    assert edge_index.size(1) > 100  # loops and sinks may remain
    pyg = T.AddRandomWalkPE(k, attr_name="rw")(Data(edge_index=edge_index, num_nodes=n)).rw
    assert_close(pe.random_walk_pe(edge_index, n, k), pyg)


def test_random_walk_pe_in_several_blocks(monkeypatch):
    monkeypatch.setattr(pe, "RANDOM_WALK_SPARSE_MAX_NNZ", 0)  # the route of expander graphs:
    monkeypatch.setattr(pe, "_SPARSE_PRODUCT_COST", math.inf)  # dense once a block fits
    n, k = 3000, 4  # more than 2^23 / n columns: computed in two blocks of nodes
    enc = pe.random_walk_pe(graphs.chain_graph(n), n, k)
    assert_close(enc[[0, 1, 1500, n - 1]],
                 torch.tensor([[0, 1 / 2, 0, 3 / 8], [0, 3 / 4, 0, 5 / 8],
                               [0, 1 / 2, 0, 3 / 8], [0, 1 / 2, 0, 3 / 8]]))


def test_random_walk_pe_on_a_long_path():
    # the half powers P^a of a path have a + 1 entries a row: one sparse block, O(N k^2), a
    # few hundredths of a second here (dense blocks of columns of the identity, 2^23 / N nodes
    # at a time, took 25 s)
    n, k = 30_000, 8
    enc = pe.random_walk_pe(graphs.chain_graph(n), n, k)
    assert_close(enc[[0, 1, n // 2, n - 1], :4],
                 torch.tensor([[0, 1 / 2, 0, 3 / 8], [0, 3 / 4, 0, 5 / 8],
                               [0, 1 / 2, 0, 3 / 8], [0, 1 / 2, 0, 3 / 8]]))


def test_random_walk_pe_sparse_and_dense_blocks_agree(monkeypatch):
    n, k = 8192, 6  # dense blocks of 2^23 / n = 1024 nodes
    gen = torch.Generator().manual_seed(5)
    edge_index = torch.randint(0, n, (2, 2 * n), generator=gen)  # multi-edges, loops, sinks
    # every node points at node 0 too: sparse rows of P, but a full column, so the columns of
    # the powers fill in where the rows do not (and P is far from symmetric)
    hub = torch.stack([torch.arange(n), torch.zeros(n, dtype=torch.long)])
    edge_index = torch.cat([edge_index, hub], dim=1)
    monkeypatch.setattr(pe, "RANDOM_WALK_SPARSE_MAX_NNZ", 0)
    monkeypatch.setattr(pe, "_SPARSE_PRODUCT_COST", math.inf)
    dense = pe.random_walk_pe(edge_index, n, k)  # dense blocks of 1024 nodes, from t = 3 on
    # 10^18: one sparse block; 100_000 halves the graph at the rows of P^3 (t = 5), then one
    # half at the columns of P^3 (t = 6); 40_000 splits at rows and columns of P^2 and P^3
    # (t = 3 to 5), each half going on from its rows, down to dense blocks or (when a sparse
    # step costs less than a dense one) smaller sparse blocks
    for max_nnz, cost in ((10**18, 4), (100_000, 4), (40_000, math.inf), (40_000, 4)):
        monkeypatch.setattr(pe, "RANDOM_WALK_SPARSE_MAX_NNZ", max_nnz)
        monkeypatch.setattr(pe, "_SPARSE_PRODUCT_COST", cost)
        assert_close(pe.random_walk_pe(edge_index, n, k), dense)


def test_random_walk_pe_undirected_graphs_take_the_columns_from_the_rows(monkeypatch):
    # an undirected multigraph with loops and 10 isolated nodes: P^T = D P D^-1, so the
    # columns of the powers come from their rows; the dense blocks compute columns outright
    n, k = 8192, 6
    gen = torch.Generator().manual_seed(5)
    edge_index = torch.randint(0, n - 10, (2, 2 * n), generator=gen)
    edge_index = torch.cat([edge_index, edge_index.flip(0)], dim=1)
    adj = sp.csr_matrix((np.ones(edge_index.size(1)), edge_index.numpy()), shape=(n, n))
    degree = np.asarray(adj.sum(axis=1)).ravel()
    monkeypatch.setattr(pe, "RANDOM_WALK_SPARSE_MAX_NNZ", 0)
    monkeypatch.setattr(pe, "_SPARSE_PRODUCT_COST", math.inf)
    dense = pe.random_walk_pe(edge_index, n, k)  # dense blocks of 1024 nodes, from t = 3 on
    assert torch.equal(dense[:, 1] > 0, torch.from_numpy(degree > 0))  # out and back
    # 10^18: one sparse block; 200_000 halves the graph at the rows of P^3 (t = 5); 40_000
    # splits from the rows of P^2 on (t = 3), down to dense or smaller sparse blocks
    for max_nnz, cost in ((10**18, 4), (200_000, 4), (40_000, math.inf), (40_000, 4)):
        monkeypatch.setattr(pe, "RANDOM_WALK_SPARSE_MAX_NNZ", max_nnz)
        monkeypatch.setattr(pe, "_SPARSE_PRODUCT_COST", cost)
        assert_close(pe.random_walk_pe(edge_index, n, k), dense)
    # the route that multiplies the columns too gives the same
    walk = (sp.diags(np.divide(1.0, degree, out=np.zeros(n), where=degree > 0)) @ adj).tocsr()
    monkeypatch.setattr(pe, "RANDOM_WALK_SPARSE_MAX_NNZ", 10**18)
    np.testing.assert_allclose(pe._return_probabilities(walk, k, degree),
                               pe._return_probabilities(walk, k), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- PyG transforms


def test_transforms_store_encodings():
    edge_index, n = well_separated_graph(25)
    data = Data(x=torch.randn(n, 3), edge_index=edge_index)
    transform = T.Compose([pe.AddLaplacianPE(4), pe.AddRandomWalkPE(5)])
    out = transform(data)
    assert_close(out.laplacian_pe, pe.laplacian_pe(edge_index, n, 4))
    assert_close(out.random_walk_pe, pe.random_walk_pe(edge_index, n, 5))
    assert "laplacian_pe" not in data  # the input is not modified

    named = pe.AddRandomWalkPE(2, attr_name="rw")(data)
    assert_close(named.rw, pe.random_walk_pe(edge_index, n, 2))
    into_x = pe.AddLaplacianPE(3, attr_name=None)(data)
    assert_close(into_x.x, torch.cat([data.x, pe.laplacian_pe(edge_index, n, 3)], dim=1))
    no_x = pe.AddRandomWalkPE(2, attr_name=None)(Data(edge_index=edge_index, num_nodes=n))
    assert_close(no_x.x, pe.random_walk_pe(edge_index, n, 2))


@pytest.mark.parametrize("make", [pe.AddLaplacianPE, pe.AddRandomWalkPE])
@pytest.mark.parametrize("attr_name", ["rw_index", "batch_pe", 5, ["pe"]])
def test_transforms_refuse_a_name_that_pyg_batching_would_change(make, attr_name):
    """A name with "index" in it made PyG's Batch offset the encoding by the node count (two
    graphs' [3, 2] encodings became [3, 4], offset by 3); a name that is no str became a key
    of the Data. Refused by name, as AddHopDistance refuses them."""
    with pytest.raises(ValueError, match=r"attr_name must be None or a str without 'index' or "
                                         r"'batch'"):
        make(2, attr_name=attr_name)


@pytest.mark.parametrize("transform", [pe.AddLaplacianPE(2, attr_name=None),
                                       pe.AddRandomWalkPE(2, attr_name=None)],
                         ids=["laplacian", "random-walk"])
def test_transforms_concatenate_to_integer_x_without_truncation(transform):
    edge_index = graphs.chain_graph(6)
    data = Data(x=torch.arange(6).view(6, 1), edge_index=edge_index)  # e.g. atom types
    expected = transform(Data(edge_index=edge_index, num_nodes=6)).x
    assert expected.abs().sum() > 0
    out = transform(data)
    assert out.x.dtype == torch.get_default_dtype()
    assert torch.equal(out.x, torch.cat([data.x.to(expected.dtype), expected], dim=1))
    half = transform(Data(x=torch.zeros(6, 1, dtype=torch.float16), edge_index=edge_index))
    assert half.x.dtype == torch.float16  # floating features keep their dtype


@pytest.mark.parametrize("transform", [pe.AddLaplacianPE(2, attr_name=None),
                                       pe.AddRandomWalkPE(2, attr_name=None)],
                         ids=["laplacian", "random-walk"])
def test_transforms_refuse_an_x_of_other_rows_by_name(transform):
    """num_nodes = 4 but x has 3 rows: the encoding cannot be concatenated to x, and the
    error names x, both counts and the way out."""
    data = Data(x=torch.randn(3, 2), edge_index=graphs.chain_graph(4), num_nodes=4)
    with pytest.raises(ValueError, match=r"data.x has 3 rows.*4 \(data.num_nodes\).*attr_name"):
        transform(data)


def test_transform_padding_sign_flips_and_repr():
    data = Data(edge_index=graphs.chain_graph(3), num_nodes=3)
    with pytest.raises(ValueError, match=r"pass pad=True"):
        pe.AddLaplacianPE(4)(data)
    assert pe.AddLaplacianPE(4, pad=True)(data).laplacian_pe.shape == (3, 4)
    base = pe.AddLaplacianPE(2)(data).laplacian_pe
    torch.manual_seed(0)
    flipped = pe.AddLaplacianPE(2, random_sign_flip=True)(data).laplacian_pe
    assert_close(flipped.abs(), base.abs())
    assert repr(pe.AddLaplacianPE(4)) == "AddLaplacianPE(k=4)"
    assert repr(pe.AddRandomWalkPE(3)) == "AddRandomWalkPE(k=3)"
    # every argument away from its default shows: PyG compares a pre_transform's repr with
    # the one a processed dataset was made with, to warn that it is stale
    text = ("AddLaplacianPE(k=2, attr_name=None, pad=True, random_sign_flip=True, "
            "solver='dense')")
    assert repr(eval(text, {"AddLaplacianPE": pe.AddLaplacianPE})) == text
    assert repr(pe.AddRandomWalkPE(3, attr_name="rw")) == "AddRandomWalkPE(k=3, attr_name='rw')"
    assert repr(pe.SinusoidalPE(8, base=100.0)) == "SinusoidalPE(8, base=100.0)"
    with pytest.raises(ValueError, match=r"k must be a positive integer, got -1"):
        pe.AddRandomWalkPE(-1)



def test_laplacian_transform_flips_signs_and_uses_its_solver(monkeypatch):
    """``random_sign_flip=True`` gives each column either sign across calls (not the fixed
    sign), and ``solver`` reaches the eigensolver."""
    edge_index, n = well_separated_graph(30)
    data = Data(edge_index=edge_index, num_nodes=n)
    lap, _ = reference_laplacian(edge_index, n)
    _, vecs = np.linalg.eigh(lap)
    fixed = np.stack([expected_sign_rule(v) for v in vecs[:, 1:4].T], axis=1)  # (n, 3)
    transform = pe.AddLaplacianPE(3, random_sign_flip=True)
    torch.manual_seed(0)
    signs = set()
    for _ in range(6):
        out = transform(data).laplacian_pe.double().numpy()
        col_signs = np.sign((out * fixed).sum(axis=0))
        np.testing.assert_allclose(out, fixed * col_signs, atol=1e-5)
        signs.update(col_signs.tolist())
    assert signs == {-1.0, 1.0}
    calls = []
    eigsh = pe.eigsh
    monkeypatch.setattr(pe, "eigsh", lambda *a, **kw: calls.append(1) or eigsh(*a, **kw))
    pe.AddLaplacianPE(3)(data)
    assert not calls  # auto: dense at 30 nodes
    out = pe.AddLaplacianPE(3, solver="sparse")(data).laplacian_pe.double().numpy()
    assert calls
    np.testing.assert_allclose(out, fixed, atol=1e-5)

@pytest.mark.parametrize("transform", [pe.AddLaplacianPE(2, pad=True), pe.AddRandomWalkPE(3)],
                         ids=["laplacian", "random_walk"])
def test_transforms_take_graphs_without_edges_and_numpy_node_counts(transform):
    """No edge_index is a graph without edges (every encoding as for isolated nodes); a numpy
    or 0-d tensor num_nodes is a node count, as PyG's transforms take it; HeteroData is refused
    by name."""
    from torch_geometric.data import HeteroData

    edge_index = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]])
    want = transform(Data(edge_index=edge_index, num_nodes=5))
    name = transform.attr_name
    for n in (np.int64(5), torch.tensor(5)):
        got = transform(Data(edge_index=edge_index, num_nodes=n))
        assert torch.equal(got[name], want[name])
    no_edges = transform(Data(num_nodes=3))
    assert torch.equal(no_edges[name], transform(
        Data(edge_index=torch.empty(2, 0, dtype=torch.long), num_nodes=3))[name])
    with pytest.raises(TypeError, match=f"{type(transform).__name__} takes a homogeneous "
                                        r"torch_geometric.data.Data, got HeteroData"):
        transform(HeteroData())


def test_laplacian_transform_encodes_each_graph_of_a_batch_alone():
    """The eigenvectors of a batch (a disjoint union) mix its graphs: the first graph would get
    the columns of the second, and the encoding would depend on the batch."""
    from torch_geometric.data import Batch

    data_list = [Data(edge_index=graphs.chain_graph(4), num_nodes=4),
                 Data(edge_index=graphs.chain_graph(4), num_nodes=4),
                 Data(edge_index=graphs.grid_graph(2, 3), num_nodes=6)]
    transform = pe.AddLaplacianPE(2)
    batch = transform(Batch.from_data_list(data_list))
    expected = torch.cat([transform(d).laplacian_pe for d in data_list])
    assert_close(batch.laplacian_pe, expected)
    # a graph too small for k names itself
    small = Batch.from_data_list(data_list + [Data(edge_index=graphs.chain_graph(2),
                                                   num_nodes=2)])
    with pytest.raises(ValueError, match=r"graph 3 of the batch \(2 nodes\): k must be at "
                                         r"most the number of non-trivial eigenvectors"):
        transform(small)


@pytest.mark.parametrize("dropped", [[0, 1], [10, 11]], ids=["first-graph", "last-graph"])
def test_laplacian_transform_splits_a_subgraph_of_a_batch_by_its_batch_vector(dropped):
    """``Batch.subgraph`` (and ``RemoveIsolatedNodes``) update ``data.batch`` and keep the old
    ``ptr``: split by ``ptr``, the graphs took the wrong nodes (an error naming the wrong
    graph, or 12 rows of encoding for 10 nodes)."""
    from torch_geometric.data import Batch
    from torch_geometric.utils import subgraph

    path = graphs.grid_graph(1, 6)  # 6 nodes in a row, self-loops included
    data_list = [Data(edge_index=path, num_nodes=6), Data(edge_index=path, num_nodes=6)]
    keep = torch.ones(12, dtype=torch.bool)
    keep[dropped] = False
    sub = Batch.from_data_list(data_list).subgraph(keep)
    assert sub.ptr.tolist() == [0, 6, 12]  # stale, as PyG leaves it
    transform = pe.AddLaplacianPE(2, pad=True)
    expected = []
    for g in range(2):  # each graph's kept nodes, alone
        nodes = keep[6 * g:6 * (g + 1)]
        edge_index, _ = subgraph(nodes, path, relabel_nodes=True)
        one = Data(edge_index=edge_index, num_nodes=int(nodes.sum()))
        expected.append(transform(one).laplacian_pe)
    assert_close(transform(sub).laplacian_pe, torch.cat(expected))


def test_laplacian_transform_refuses_a_batch_whose_ptr_and_nodes_disagree():
    from torch_geometric.data import Batch

    batch = Batch.from_data_list([Data(edge_index=graphs.chain_graph(3), num_nodes=3)] * 2)
    del batch.batch
    batch.num_nodes = 5
    batch.edge_index = batch.edge_index[:, (batch.edge_index < 5).all(0)]
    with pytest.raises(ValueError, match=r"data.ptr ends at 6 but the batch has 5 nodes"):
        pe.AddLaplacianPE(1)(batch)


@pytest.mark.parametrize("transform", [pe.AddLaplacianPE(1, pad=True), pe.AddRandomWalkPE(2)],
                         ids=["laplacian", "random-walk"])
def test_transforms_refuse_a_graph_held_as_a_sparse_adjacency(transform):
    """After ``T.ToSparseTensor`` the edges are in ``adj_t``: read as a graph without edges,
    the encodings were all zeros."""
    import torch_geometric.transforms as T

    data = Data(edge_index=graphs.chain_graph(4), num_nodes=4, x=torch.randn(4, 2))
    data = T.ToSparseTensor(layout=torch.sparse_csr)(data)
    name = type(transform).__name__
    with pytest.raises(ValueError, match=rf"{name} reads data.edge_index, and this graph holds "
                                         r"its edges as data.adj_t"):
        transform(data)


def test_laplacian_transform_on_a_batch_with_edges_in_any_order():
    """A batch's edges need not be grouped by graph (edges shuffled, or appended later): each
    graph still gets its own encoding, here the closed-form path cosines and a lone edge."""
    from torch_geometric.data import Batch

    batch = Batch.from_data_list([Data(edge_index=graphs.chain_graph(5), num_nodes=5),
                                  Data(edge_index=torch.tensor([[0], [1]]), num_nodes=3),
                                  Data(edge_index=graphs.chain_graph(4), num_nodes=4)])
    perm = torch.randperm(batch.edge_index.size(1), generator=torch.Generator().manual_seed(0))
    batch.edge_index = batch.edge_index[:, perm]
    out = pe.AddLaplacianPE(1, pad=True)(batch).laplacian_pe.double()[:, 0]
    expected = []
    for n in (5, 4):  # u_1(t) ~ sqrt(d_t) cos(pi t / (n - 1)), first entry positive
        t = np.arange(n)
        u = np.where((t == 0) | (t == n - 1), 1.0, math.sqrt(2.0)) * np.cos(math.pi * t / (n - 1))
        expected.append(torch.from_numpy(expected_sign_rule(u / np.linalg.norm(u))))
    lone_edge = torch.tensor([math.sqrt(0.5), -math.sqrt(0.5), 0.0], dtype=torch.float64)
    assert_close(out, torch.cat([expected[0], lone_edge, expected[1]]), dtype=torch.float32)


def test_transforms_concatenate_to_one_dimensional_x():
    """A 1-D x (one feature per node, e.g. a node type) becomes the first column."""
    data = Data(x=torch.tensor([2.0, 0.0, 1.0, 5.0]), edge_index=graphs.chain_graph(4))
    out = pe.AddRandomWalkPE(2, attr_name=None)(data)
    # Return probabilities on the path 0-1-2-3, by hand: none after 1 step; after 2 steps
    # 1/2 at the ends (one way back) and 1/2 * 1 + 1/2 * 1/2 = 3/4 inside.
    expected = torch.tensor([[2.0, 0, 1 / 2], [0.0, 0, 3 / 4], [1.0, 0, 3 / 4], [5.0, 0, 1 / 2]])
    assert_close(out.x, expected)



def test_laplacian_transform_on_a_batch_with_isolated_first_and_last_nodes():
    """Graphs of a batch are renumbered from their first node even when it has no edge, and a
    last graph without edges still gets its (zero) rows."""
    from torch_geometric.data import Batch

    batch = Batch.from_data_list([Data(edge_index=torch.tensor([[0, 1], [1, 2]]), num_nodes=3),
                                  Data(edge_index=torch.tensor([[1, 2], [2, 3]]), num_nodes=4),
                                  Data(edge_index=torch.empty(2, 0, dtype=torch.long),
                                       num_nodes=2)])
    out = pe.AddLaplacianPE(1, pad=True)(batch).laplacian_pe
    # Path a-b-c: u_1 ~ sqrt(d_t) cos(pi t / 2) = (1, 0, -1) / sqrt(2); isolated nodes: 0.
    half = math.sqrt(0.5)
    assert_close(out[:, 0], torch.tensor([half, 0.0, -half, 0.0, half, 0.0, -half, 0.0, 0.0]))


def test_wide_envelope_probe_picks_the_method(monkeypatch):
    """A graph whose factorization may be costly (its reverse Cuthill-McKee envelope wider than
    ``SHIFT_INVERT_PROBE_WIDTH`` entries a row) gets a probe of its smallest non-trivial
    eigenvalue first. A hypercube (1/6: eigenvalues 2j/d of its normalized Laplacian) runs
    plain Lanczos, without a factorization; two random graphs joined by one edge (a bottleneck:
    about 2e-4) run shift-invert. Eigenvalues as known, or as the dense solver finds them."""
    probes, shifts, factorizations = [], [], []
    probe, eigsh, splu = pe._smallest_estimate, pe.eigsh, pe.splu
    monkeypatch.setattr(pe, "_smallest_estimate",
                        lambda lap, null: probes.append(probe(lap, null)) or probes[-1])
    monkeypatch.setattr(pe, "eigsh",
                        lambda *a, **kw: shifts.append(kw.get("sigma")) or eigsh(*a, **kw))
    monkeypatch.setattr(pe, "splu", lambda *a, **kw: factorizations.append(1) or splu(*a, **kw))

    cube = graphs.from_networkx(nx.hypercube_graph(12))
    assert 4096 > pe.DENSE_SOLVER_MAX_NODES
    _, lam = pe.laplacian_pe(cube, 4096, 8, return_eigenvalues=True)
    np.testing.assert_allclose(lam.double().numpy(), 1 / 6, atol=1e-8)
    assert len(probes) == 1 and probes[0] > pe.SHIFT_INVERT_MAX_EIGENVALUE
    assert shifts and all(shift is None for shift in shifts) and not factorizations

    probes.clear(), shifts.clear()
    halves = [nx.gnm_random_graph(800, 5000, seed=seed) for seed in (1, 2)]
    bridged = nx.disjoint_union(*halves)
    bridged.add_edge(0, 800)
    edge_index = graphs.from_networkx(bridged)
    _, lam = pe.laplacian_pe(edge_index, 1600, 4, solver="sparse", return_eigenvalues=True)
    assert len(probes) == 1 and probes[0] < pe.SHIFT_INVERT_MAX_EIGENVALUE
    assert any(shift is not None for shift in shifts) and factorizations
    _, want = pe.laplacian_pe(edge_index, 1600, 4, solver="dense", return_eigenvalues=True)
    np.testing.assert_allclose(lam.double().numpy(), want.double().numpy(), atol=1e-8)
    assert lam[0] < 1e-3  # the bottleneck


@pytest.mark.parametrize("transform", [pe.AddLaplacianPE(2), pe.AddRandomWalkPE(2)])
def test_transforms_check_edge_index_before_the_edge_weights(transform):
    """A transposed edge_index is named as such, not as edge weights of the wrong length."""
    edge_index = torch.tensor([[0, 1, 2, 3, 4], [1, 2, 3, 4, 0]])
    data = Data(edge_index=edge_index.t(), edge_weight=torch.ones(5), num_nodes=5)
    with pytest.raises(ValueError, match=r"edge_index must have shape \[2, E\], got \[5, 2\]"):
        transform(data)


def test_random_walk_weights_near_the_smallest_double_stay_probabilities():
    """Mutation testing: without the guard on tiny positive weights, weights of 1e-310 gave
    inf (1 / a denormal degree)."""
    edge_index = torch.tensor([[0, 1, 2, 3], [1, 0, 3, 2]])
    weight = torch.tensor([1.0, 1.0, 1e-310, 1e-310], dtype=torch.float64)
    out = pe.random_walk_pe(edge_index, 4, 3, edge_weight=weight)
    assert out.isfinite().all() and (out >= 0).all() and (out <= 1).all()


def test_sinusoidal_positions_past_float32_integers():
    """Position 2^24 + 1 has no float32: cast through it, the encoding was that of 2^24."""
    position = 2 ** 24 + 1
    out = pe.SinusoidalPE(2)(torch.zeros(1, 2, dtype=torch.float64), torch.tensor([position]))
    assert_close(out[0], torch.tensor([math.sin(position), math.cos(position)],
                                      dtype=torch.float64))


def test_laplacian_transform_refuses_a_batch_vector_that_interleaves_graphs():
    from torch_geometric.data import Batch

    batch = Batch.from_data_list([Data(edge_index=graphs.chain_graph(3), num_nodes=3)] * 2)
    batch.batch = torch.tensor([0, 1, 0, 1, 0, 1])
    with pytest.raises(ValueError, match=r"data.batch must list each graph's nodes together"):
        pe.AddLaplacianPE(1)(batch)


def test_pe_checks_kept_by_mutation_testing():
    """AddLaplacianPE's pad must be a bool; learned edge weights (requiring grad) are read as
    their values."""
    with pytest.raises(TypeError, match=r"pad must be a bool, got 'False'"):
        pe.AddLaplacianPE(2, pad="False")
    edge_index = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
    weight = torch.tensor([1.0, 1.0, 2.0, 2.0])
    for encode in (pe.laplacian_pe, pe.random_walk_pe):
        assert_close(encode(edge_index, 3, 1, edge_weight=weight.clone().requires_grad_()),
                     encode(edge_index, 3, 1, edge_weight=weight))


def test_a_self_loops_weight_leaves_the_laplacian_encoding_alone():
    """laplacian_pe drops self-loops, but a heavy self-loop's weight set its component's
    largest weight, by which every weight is divided: a chain of weights 1e-30 beside a loop of
    1e300 fell apart into isolated nodes (and was refused). Now the loop changes nothing, as
    without weights."""
    chain = graphs.chain_graph(4)
    weight = torch.full((chain.size(1),), 1e-30, dtype=torch.float64)
    looped = torch.cat([chain, torch.tensor([[0], [0]])], dim=1)
    heavy = torch.cat([weight, torch.tensor([1e300], dtype=torch.float64)])
    want, want_values = pe.laplacian_pe(chain, 4, 3, edge_weight=weight,
                                        return_eigenvalues=True)
    got, got_values = pe.laplacian_pe(looped, 4, 3, edge_weight=heavy, return_eigenvalues=True)
    assert_close(got_values, want_values)
    assert_close(got.abs(), want.abs())


def test_weights_far_apart_in_two_components_keep_both():
    # both encodings are blind to a factor on one component's weights: two components of
    # weights 1e300 and 1e-30 (scaled by the largest of all, the second would round to 0 and
    # lose its edges) encode as with weights 1, and random weights with a factor per
    # component as without the factors
    pair = torch.tensor([[0, 1, 2, 3], [1, 0, 3, 2]])
    far = torch.tensor([1e300, 1e300, 1e-30, 1e-30], dtype=torch.float64)
    assert torch.equal(pe.random_walk_pe(pair, 4, 3, edge_weight=far),
                       pe.random_walk_pe(pair, 4, 3))
    _, values = pe.laplacian_pe(pair, 4, 2, edge_weight=far, pad=True, return_eigenvalues=True)
    assert_close(values, torch.tensor([2.0, 2.0], dtype=values.dtype))
    gen = torch.Generator().manual_seed(3)
    chain = graphs.chain_graph(6)
    edges = torch.cat([chain, chain + 6], dim=1)  # two chains of 6 nodes
    weight = torch.rand(edges.size(1), generator=gen, dtype=torch.float64) + 0.5
    factor = torch.where(edges[0] < 6, torch.tensor(1e200, dtype=torch.float64),
                         torch.tensor(1e-200, dtype=torch.float64))
    for encode in (lambda w: pe.random_walk_pe(edges, 12, 4, edge_weight=w),
                   lambda w: pe.laplacian_pe(edges, 12, 3, edge_weight=w).abs()):
        assert_close(encode(weight * factor), encode(weight))
