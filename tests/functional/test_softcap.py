"""``edge_attention(softcap=c)``: the dot and gatv2 scores before their bias become
``c * tanh(s / c)``, on every backend that takes a cap, against the reference backend and against
the formula written out with dense torch ops."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close, assert_compiles_as_it_runs, outputs_and_grads, random_graph

from graphattn import graphs
from graphattn.functional import edge_attention, select_backend
from graphattn.functional import triton_kernels as tk
from graphattn.nn import GraphSelfAttention


def _inputs(score: str, *, n: int = 12, heads: int = 2, channels: int = 8, num_edges: int = 70,
            dtype: torch.dtype = torch.float64, bias: bool = True, edge_key: bool = False,
            seed: int = 0, device: torch.device | str = "cpu") -> tuple[dict, torch.Tensor]:
    """Leaves of a call with large scores (q and k of standard deviation 3, so that a cap of 2
    changes most of them) on a random graph with a node of 40 in-edges, on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.cat([random_graph(n, num_edges, seed=seed),
                            torch.stack([torch.randint(0, n, (40,), generator=gen),
                                         torch.zeros(40, dtype=torch.long)])], dim=1)
    E = edge_index.size(1)

    def leaf(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=dtype) * std).to(
            device).requires_grad_()

    inputs = dict(q=leaf(n, heads, channels, std=3.0), k=leaf(n, heads, channels, std=3.0),
                  v=leaf(n, heads, channels))
    if score == "gatv2":
        inputs["att"] = leaf(heads, channels)
    if bias:
        inputs["bias"] = leaf(E, heads)
    if edge_key:
        inputs["edge_key"] = leaf(E, heads, channels)
    return inputs, edge_index.to(device)


def test_reference_is_the_capped_dense_formula_on_the_complete_graph():
    """On the complete graph the capped dot score is Gemma 2's eager attention:
    softmax(c tanh(scale q k^T / c) + bias) v, written here with dense ops."""
    n, H, C, c = 9, 2, 4, 1.5
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, H, C, generator=gen, dtype=torch.float64) * 2 for _ in range(3))
    edge_index = graphs.complete_graph(n)
    bias_dense = torch.randn(H, n, n, generator=gen, dtype=torch.float64)  # (H, targets, sources)
    bias = bias_dense[:, edge_index[1], edge_index[0]].T  # (E, H)
    scores = torch.einsum("ihc,jhc->hij", q, k) * 0.3
    weights = torch.softmax(c * torch.tanh(scores / c) + bias_dense, dim=-1)  # (H, n, n)
    want = torch.einsum("hij,jhc->ihc", weights, v)
    for backend in ("reference", "cpu"):
        out = edge_attention(q, k, v, edge_index, scale=0.3, bias=bias, softcap=c,
                             backend=backend)
        assert_close(out, want)
    uncapped = edge_attention(q, k, v, edge_index, scale=0.3, bias=bias)
    assert (uncapped - want).abs().max() > 0.1  # the cap matters on these scores


@pytest.mark.parametrize("score", ["dot", "gatv2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("edge_key", [False, True], ids=["", "edge-key"])
def test_cpu_backend_matches_the_reference(score, dtype, edge_key):
    """Outputs, weights and every gradient (the bias's is that of the score after the cap);
    half precision is computed in fp32 by both."""
    inputs, edge_index = _inputs(score, dtype=dtype, edge_key=edge_key)
    want = outputs_and_grads("reference", inputs, edge_index, score=score, softcap=2.0)
    got = outputs_and_grads("cpu", inputs, edge_index, score=score, softcap=2.0)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)
    uncapped = outputs_and_grads("cpu", inputs, edge_index, score=score, softcap=None)
    assert (uncapped[0] - got[0]).abs().max() > 0.05


@pytest.mark.parametrize("tiles", ["one-node", "row-blocks", "hub"])
@pytest.mark.parametrize("score, edge_key", [("dot", False), ("dot", True), ("gatv2", True)])
def test_triton_backend_matches_the_reference(triton_device, monkeypatch, tiles, score,
                                              edge_key):
    """The three launches of the kernels: a program per row, row blocks, and the rows of many
    tiles summed in float64 blocks (tiles of 2 edges here, so that the 40 in-edges of node 0
    make such a row)."""
    if tiles == "hub":
        monkeypatch.setattr(tk, "SUM_STEPS", 1)
        monkeypatch.setattr(tk, "HUB_EDGES", 0)
    options = {"one-node": {}, "row-blocks": dict(block_n=4, heavy_degree=6),
               "hub": dict(block_e=2)}[tiles]
    inputs, edge_index = _inputs(score, dtype=torch.float32, edge_key=edge_key, n=8,
                                 num_edges=30, device=triton_device)
    want = outputs_and_grads("reference", inputs, edge_index, score=score, softcap=2.0)
    with tk.launch_tiles(**options):
        got = outputs_and_grads("triton", inputs, edge_index, score=score, softcap=2.0)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("cap", [1e4, 1e8, 1e30])
@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_triton_cap_far_above_the_scores_is_no_cap(triton_device, score, cap):
    """tanh(s / c) for |s / c| small: as (1 - e) / (1 + e) with e = exp(-2 |s / c|), 1 - e
    cancelled, and a cap of 1e30 made every score 0 (uniform weights). Outputs, weights and
    gradients are those without a cap."""
    inputs, edge_index = _inputs(score, dtype=torch.float32, n=8, num_edges=30,
                                 device=triton_device)
    want = outputs_and_grads("reference", inputs, edge_index, score=score)
    got = outputs_and_grads("triton", inputs, edge_index, score=score, softcap=cap)
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_gradients_match_finite_differences(backend):
    inputs, edge_index = _inputs("gatv2", n=5, heads=1, channels=3, num_edges=10)
    q, k, v, att, bias = inputs.values()

    def f(q, k, v, att, bias):
        return edge_attention(q, k, v, edge_index, bias=bias, score="gatv2", att=att,
                              softcap=2.0, backend=backend, return_attention=True)

    assert torch.autograd.gradcheck(f, (q, k, v, att, bias))
    assert torch.autograd.gradgradcheck(f, (q, k, v, att, bias))


def test_a_cap_bounds_the_scores_and_so_the_weights():
    """Scores of 1e4 under a cap of 3 differ by at most 6: no edge takes all of its target's
    weight, and nothing overflows."""
    q = torch.tensor([[[100.0]], [[-100.0]]])  # (2, 1, 1)
    k = torch.tensor([[[100.0]], [[-100.0]]])
    v = torch.tensor([[[1.0]], [[0.0]]])
    edge_index = torch.tensor([[0, 1], [0, 0]])  # both nodes into node 0
    for backend in ("reference", "cpu"):
        _, alpha = edge_attention(q, k, v, edge_index, scale=1.0, softcap=3.0, backend=backend,
                                  return_attention=True)
        assert_close(alpha[:, 0], torch.softmax(torch.tensor([3.0, -3.0]), 0))
        _, alpha = edge_attention(q, k, v, edge_index, scale=1.0, backend=backend,
                                  return_attention=True)
        assert alpha[1, 0] == 0  # without the cap: exp(-2e4) underflows


def test_a_minus_inf_bias_still_masks_its_edge():
    """The cap comes before the bias: a -inf bias gives its edge the weight 0."""
    inputs, edge_index = _inputs("dot", bias=False)
    bias = torch.zeros(edge_index.size(1), 2, dtype=torch.float64)
    bias[::3] = float("-inf")
    for backend in ("reference", "cpu"):
        _, alpha = edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index, bias=bias,
                                  softcap=2.0, backend=backend, return_attention=True)
        assert (alpha[::3] == 0).all() and alpha.isfinite().all()


def test_auto_never_takes_the_dense_backend_with_a_cap():
    q = torch.randn(64, 2, 8)
    edge_index = graphs.complete_graph(64)
    assert select_backend(q, edge_index) == "dense"
    assert select_backend(q, edge_index, softcap=5.0) == "cpu"
    k, v = torch.randn(64, 2, 8), torch.randn(64, 2, 8)
    assert_close(edge_attention(q, k, v, edge_index, softcap=5.0),
                 edge_attention(q, k, v, edge_index, softcap=5.0, backend="reference"))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(softcap=0.0), ValueError, "softcap must be positive .* got 0.0"),
    (dict(softcap=-1.0), ValueError, "softcap must be positive"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a finite number, got inf"),
    (dict(softcap=1e39), ValueError, "softcap must be finite in torch.float32"),
    (dict(softcap=torch.tensor(2.0, requires_grad=True)), TypeError,
     "softcap must be a number, got a tensor that requires grad"),
    (dict(softcap=2.0, score="additive"), ValueError,
     "softcap caps the dot and gatv2 scores; score='additive'"),
    (dict(softcap=2.0, backend="dense"), ValueError,
     "backend='dense' computes its scores in scaled_dot_product_attention, which has no soft "
     "cap"),
])
def test_errors(kwargs, error, match):
    n = 4
    q, k, v = torch.randn(n, 2, 3), torch.randn(n, 2, 3), torch.randn(n, 2, 3)
    if kwargs.get("score") == "additive":
        q, k = q[..., 0], k[..., 0]
    with pytest.raises(error, match=match):
        edge_attention(q, k, v, graphs.complete_graph(n), **kwargs)


def test_layer_takes_a_cap():
    torch.manual_seed(0)
    layer = GraphSelfAttention(6, 4, heads=2, attention="gatv2", softcap=1.5, backend="cpu")
    assert repr(layer) == ("GraphSelfAttention(6, 4, heads=2, backend='cpu', attention='gatv2', "
                           "softcap=1.5)")
    x, edge_index = torch.randn(10, 6) * 5, random_graph(10, 40, seed=2)
    out = layer(x, edge_index)
    layer.backend = "reference"
    assert_close(out, layer(x, edge_index))
    layer.softcap = None
    assert (layer(x, edge_index) - out).abs().max() > 1e-3
    with pytest.raises(ValueError, match="attention='additive'"):
        GraphSelfAttention(6, 4, attention="additive", softcap=1.0)
    with pytest.raises(ValueError, match="backend='dense'"):
        GraphSelfAttention(6, 4, softcap=1.0, backend="dense")


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_under_torch_compile(backend, request):
    """The fused backends' operators carry the cap through torch.compile (fullgraph), forward
    and backward."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    inputs, edge_index = _inputs("dot", dtype=torch.float32, n=8, num_edges=30)

    def attend(q, k, v, bias, edge_index):
        return edge_attention(q, k, v, edge_index, bias=bias, softcap=2.0, backend=backend,
                              return_attention=True)

    assert_compiles_as_it_runs(attend, inputs, edge_index)


def test_triton_operators_pass_opcheck(triton_interpreter):
    """torch's checks of the triton operators with a cap: schema, fake shapes, autograd."""
    inputs, edge_index = _inputs("gatv2", dtype=torch.float32, n=6, num_edges=10, bias=True)
    q, k, v, att, bias = inputs.values()
    args = (q, k, v, att, bias, None, edge_index, 0.5, 0.2, "gatv2", True, None, None, 2.0)
    torch.library.opcheck(tk._forward_op, args)
    out, _, lse = tk._forward_op(*args)
    detached = [t.detach() for t in (q, k, v, att, bias)]
    torch.library.opcheck(tk._backward_op, (
        torch.randn_like(out), None, *detached, None, edge_index, out.detach(), lse, 0.5, 0.2,
        "gatv2", True, True, None, None, False, False, False, 2.0))


def test_dense_attention_takes_the_cap_as_edge_attention_does():
    """dense_attention(softcap=) with a mask, a bias and a causal mask: the weights explicit,
    and the same as edge_attention's on the mask's edges."""
    from graphattn.functional import dense_attention

    B, L, H, C = 2, 10, 2, 4
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, L, H, C, generator=gen, dtype=torch.float64) * 2
               for _ in range(3))
    mask = (torch.rand(L, L, generator=gen) < 0.5) | torch.eye(L, dtype=torch.bool)
    bias = torch.randn(H, L, L, generator=gen, dtype=torch.float64)
    out, weights = dense_attention(q, k, v, mask, attn_bias=bias, softcap=1.5,
                                   return_attention=True)
    assert_close(dense_attention(q, k, v, mask, attn_bias=bias, softcap=1.5), out)
    edge_index = graphs.from_dense_mask(mask)
    edge_bias = bias[:, edge_index[1], edge_index[0]].T  # (E, H)
    for b in range(B):
        want, alpha = edge_attention(q[b], k[b], v[b], edge_index, bias=edge_bias,
                                     softcap=1.5, return_attention=True)
        assert_close(out[b], want)
        assert_close(weights[b][:, edge_index[1], edge_index[0]].T, alpha)
    causal = dense_attention(q, k, v, is_causal=True, softcap=1.5)
    want = edge_attention(q[0], k[0], v[0], graphs.causal_graph(L), softcap=1.5)
    assert_close(causal[0], want)
    with pytest.raises(ValueError, match="softcap is not taken with batch"):
        dense_attention(q[0], k[0], v[0], batch=torch.zeros(L, dtype=torch.long), softcap=1.5)


def test_dense_layer_takes_a_cap():
    """DenseSelfAttention(softcap=) is GraphSelfAttention(softcap=) with the same weights on
    the complete graph."""
    from graphattn.nn import DenseSelfAttention

    torch.manual_seed(0)
    dense = DenseSelfAttention(6, 4, heads=2, softcap=0.5)
    assert repr(dense) == "DenseSelfAttention(6, 4, heads=2, softcap=0.5)"
    graph = GraphSelfAttention(6, 4, heads=2, softcap=0.5, add_self_loops=False)
    graph.load_state_dict(dense.state_dict())
    x = torch.randn(7, 6) * 3
    assert_close(dense(x), graph(x, graphs.complete_graph(7)))
    dense.softcap = None
    assert (dense(x) - graph(x, graphs.complete_graph(7))).abs().max() > 1e-3
