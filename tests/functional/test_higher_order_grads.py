"""Gradients of gradients (``create_graph=True``): a gradient penalty through every backend.

The fused backends hand-write one backward pass; under ``create_graph=True`` their backward
recomputes the function the reference way so that autograd can differentiate the gradients
again. Each backend's second-order gradients are checked against the reference backend's, and
the ``"cpu"`` backend's against finite differences (``gradgradcheck``, fp64).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from conftest import assert_close, attention_inputs, random_graph

from graphattn.functional import edge_attention
from graphattn.functional.reference import reference_edge_attention, reference_grads

NUM_SRC, NUM_DST, NUM_EDGES, HEADS, CHANNELS = 6, 7, 16, 2, 3
BACKENDS = ["cpu", "dense", "triton"]  # triton in Triton's interpreter (skipped without it)
CASES = [  # (score, per-edge terms, dropout_p)
    ("dot", (), 0.0),
    ("dot", ("edge_key", "edge_value"), 0.3),
    ("dot", ("shared",), 0.0),  # one tensor as both edge_key and edge_value
    ("additive", (), 0.3),
    ("gatv2", ("edge_key", "edge_value"), 0.0),
]


def _inputs(score: str, terms: tuple[str, ...], dtype: torch.dtype = torch.float32) -> dict:
    inputs = attention_inputs(NUM_SRC, NUM_DST, NUM_EDGES, HEADS, CHANNELS, score=score,
                              terms=("edge_key",) if terms == ("shared",) else terms,
                              dtype=dtype, seed=3)
    if terms == ("shared",):
        inputs["edge_value"] = inputs["edge_key"]
    return inputs


def _penalty_grads(backend: str, inputs: dict, edge_index: torch.Tensor, score: str,
                   dropout_p: float, use_alpha: bool, use_out: bool = True,
                   ) -> dict[str, torch.Tensor]:
    """Gradients of ||d loss / d inputs||^2 with respect to the inputs, where loss weighs every
    output (with ``use_out``) and, with ``use_alpha``, every attention weight differently."""
    leaves = {name: t for name, t in inputs.items() if t is not None}
    if "edge_value" in leaves and leaves["edge_value"] is leaves.get("edge_key"):
        del leaves["edge_value"]
    if not use_out:
        del leaves["v"]  # the weights do not depend on v
    torch.manual_seed(11)  # the same dropout mask for every backend
    out, alpha = edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index,
                                bias=inputs["bias"], att=inputs["att"],
                                edge_key=inputs["edge_key"], edge_value=inputs["edge_value"],
                                score=score, dropout_p=dropout_p, training=True,
                                return_attention=True, backend=backend)
    loss = (out * torch.linspace(-1, 2, out.numel()).view_as(out)).sum() if use_out else 0
    if use_alpha:
        loss = loss + (alpha * torch.linspace(2, -1, alpha.numel()).view_as(alpha)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=True)
    for name, g in zip(leaves, grads, strict=True):
        assert g.requires_grad, f"d loss / d {name} is not differentiable"
    penalty = sum((g ** 2).sum() for g in grads)
    second = torch.autograd.grad(penalty, list(leaves.values()), allow_unused=True)
    return {name: torch.zeros_like(leaves[name]) if g is None else g
            for name, g in zip(leaves, second, strict=True)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score,terms,dropout_p", CASES, ids=lambda c: str(c))
@pytest.mark.parametrize("use_alpha", [False, True], ids=["out", "out+alpha"])
def test_gradient_penalty_matches_reference(backend, score, terms, dropout_p, use_alpha,
                                            request):
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = _inputs(score, terms)
    got = _penalty_grads(backend, inputs, edge_index, score, dropout_p, use_alpha)
    want = _penalty_grads("reference", inputs, edge_index, score, dropout_p, use_alpha)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.isfinite(got[name]).all(), name
        assert_close(got[name], want[name], atol=1e-4, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in want.values())  # the penalty reaches the inputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_gradient_penalty_of_the_weights_alone_matches_reference(backend, score, request):
    """A loss on the attention weights alone: out gets no gradient (None in the fused
    backends' backward), which the differentiable recompute must take as zeros."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = _inputs(score, ())
    got = _penalty_grads(backend, inputs, edge_index, score, 0.0, True, use_out=False)
    want = _penalty_grads("reference", inputs, edge_index, score, 0.0, True, use_out=False)
    for name in want:
        assert_close(got[name], want[name], atol=1e-4, rtol=1e-4)
    assert want["q"].abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
@pytest.mark.parametrize("wanted", [("v",), ("v", "edge_value")], ids=["v", "v+edge_value"])
def test_create_graph_gradients_of_the_values_alone_with_weights_in_the_loss(
        backend, score, wanted, request):
    """Only v (and edge_value) need a gradient, create_graph=True, and the loss holds the
    weights too, which do not depend on them: the differentiable recompute must leave the
    weights out of its autograd.grad (it raised "element 1 of tensors does not require
    grad")."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = _inputs(score, ("edge_value",))
    inputs = {name: None if t is None else t.detach().requires_grad_(name in wanted)
              for name, t in inputs.items()}
    results = []
    for b in (backend, "reference"):
        out, alpha = edge_attention(**inputs, edge_index=edge_index, score=score,
                                    return_attention=True, backend=b)
        loss = (out * torch.linspace(-1, 2, out.numel()).view_as(out)).sum() + alpha.square().sum()
        leaves = [inputs[name] for name in wanted]
        # (the gradients do not depend on v: a penalty on them would have nothing to reach)
        results.append(torch.autograd.grad(loss, leaves, create_graph=True))
    for got, want in zip(*results, strict=True):
        assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_create_graph_gradients_of_one_tensor_in_several_roles(backend, score, request):
    """edge_attention(x, x, x): under create_graph=True the fused backends' backward gives x
    the sum of its roles' gradients, as without it, not that sum once per role."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5)
    inputs = attention_inputs(NUM_SRC, NUM_SRC, NUM_EDGES, HEADS, CHANNELS, score=score,
                              bias=False, seed=3)
    x = inputs["v"].detach().requires_grad_()
    qk = x[..., 0] if score == "additive" else x  # (N, H) for the additive score

    def f():
        return edge_attention(qk, qk, x, edge_index, score=score, att=inputs["att"],
                              backend=backend)

    grad_out = torch.randn_like(f())
    (want,) = torch.autograd.grad(f(), x, grad_out)
    (got,) = torch.autograd.grad(f(), x, grad_out, create_graph=True)
    assert_close(got, want)


def test_reference_grads_promote_to_the_dtype_of_the_dropout_mask():
    """bf16 q, k, v with the fp32 dropout mask the triton backend draws (and no bias): the
    recompute runs in fp32, as the kernels multiply by the mask in fp32, not in bf16."""
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = attention_inputs(NUM_SRC, NUM_DST, NUM_EDGES, HEADS, CHANNELS, bias=False, seed=3)
    mask = (torch.arange(NUM_EDGES * HEADS).view(NUM_EDGES, HEADS) % 3 > 0) / 0.9  # fp32
    qkv = [inputs[name].detach().bfloat16().requires_grad_() for name in ("q", "k", "v")]
    promoted = [t.float() for t in qkv]
    out, _ = reference_edge_attention(*promoted, edge_index, scale=0.5, bias=None,
                                      dropout_mask=mask, score="dot", negative_slope=0.2,
                                      need_alpha=False)
    grad_out = torch.randn_like(out).bfloat16()
    want = torch.autograd.grad(out, qkv, grad_out.float())
    got = reference_grads(grad_out, None, *qkv, edge_index, scale=0.5, bias=None,
                          dropout_mask=mask, score="dot", negative_slope=0.2, att=None,
                          edge_key=None, edge_value=None, needs_grad=[True] * 8)
    for g, w in zip(got[:3], want, strict=True):
        assert g.dtype == torch.bfloat16
        assert_close(g, w)


def test_reference_edge_attention_gives_no_weights_unless_asked():
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = _inputs("dot", ())
    out, alpha = reference_edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index,
                                          scale=0.5, bias=None, dropout_mask=None, score="dot",
                                          negative_slope=0.2, need_alpha=False)
    assert alpha is None and out.shape == (NUM_DST, HEADS, CHANNELS)


@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_cpu_backend_gradgradcheck(score):
    """Second derivatives of the cpu backend against finite differences, in fp64."""
    edge_index = random_graph(4, 9, seed=2, num_dst=5)
    inputs = attention_inputs(4, 5, 9, 2, 2, score=score, dtype=torch.float64, seed=4)
    names = [name for name in ("q", "k", "v", "att", "bias") if inputs[name] is not None]

    def attend(*tensors):
        given = dict(zip(names, tensors, strict=True))
        out, alpha = edge_attention(given["q"], given["k"], given["v"], edge_index,
                                    bias=given["bias"], att=given.get("att"), score=score,
                                    return_attention=True, backend="cpu")
        return out, alpha

    assert torch.autograd.gradgradcheck(attend, [inputs[name] for name in names])


def test_first_order_gradients_stay_on_the_fused_path():
    """Without create_graph the cpu backend's gradients come from its own kernels: they are
    not differentiable, and they are what the reference gives."""
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = _inputs("dot", ())
    leaves = [inputs[name] for name in ("q", "k", "v", "bias")]
    grads = {}
    for backend in ("cpu", "reference"):
        out = edge_attention(inputs["q"], inputs["k"], inputs["v"], edge_index,
                             bias=inputs["bias"], backend=backend)
        grads[backend] = torch.autograd.grad(out.square().sum(), leaves)
    assert not any(g.requires_grad for g in grads["cpu"])
    for got, want in zip(grads["cpu"], grads["reference"], strict=True):
        assert_close(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_torch_func_grad_and_grad_of_grad(score, backend, request):
    """torch.func.grad, and torch.func.grad of it, through every backend match the reference
    backend."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = {name: None if t is None else t.detach()
              for name, t in _inputs(score, ()).items()}

    def loss(backend):
        def of_q(q):
            out = edge_attention(q, inputs["k"], inputs["v"], edge_index, bias=inputs["bias"],
                                 att=inputs["att"], score=score, backend=backend)
            return out.square().sum()
        return of_q

    q = inputs["q"]
    for transform in (lambda f: torch.func.grad(f),
                      lambda f: torch.func.grad(lambda q: torch.func.grad(f)(q).square().sum())):
        assert_close(transform(loss(backend))(q), transform(loss("reference"))(q),
                     atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_reference_grads_of_mixed_dtypes_promote_them(score):
    """The triton backend takes inputs of mixed dtypes (bf16 q, k, v beside an fp32 bias and
    att, as autocast leaves them) and its differentiable backward hands them to reference_grads
    as they are: the recompute promotes them, as edge_attention does for the other backends,
    and each gradient comes back in its input's dtype."""
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = _inputs(score, ())
    for name in ("q", "k", "v"):
        inputs[name] = inputs[name].detach().bfloat16().requires_grad_()
    names = [name for name in ("q", "k", "v", "att", "bias") if inputs[name] is not None]
    promoted = {name: inputs[name].float() for name in names}
    out, alpha = reference_edge_attention(
        promoted["q"], promoted["k"], promoted["v"], edge_index, scale=0.5,
        bias=promoted["bias"], dropout_mask=None, score=score, negative_slope=0.2,
        need_alpha=True, att=promoted.get("att"))
    grad_out, grad_alpha = torch.randn_like(out).bfloat16(), torch.randn_like(alpha)
    want = torch.autograd.grad((out, alpha), [inputs[name] for name in names],
                               (grad_out.float(), grad_alpha))
    got = reference_grads(grad_out, grad_alpha, inputs["q"], inputs["k"], inputs["v"],
                          edge_index, scale=0.5, bias=inputs["bias"], dropout_mask=None,
                          score=score, negative_slope=0.2, att=inputs["att"], edge_key=None,
                          edge_value=None, needs_grad=[True] * 8)
    got = dict(zip(("q", "k", "v", "att", "bias"), got[:5], strict=True))
    for name, w in zip(names, want, strict=True):
        assert got[name].dtype == inputs[name].dtype, name
        assert got[name].requires_grad, name
        assert_close(got[name], w)


@pytest.mark.parametrize("score", ["dot", "gatv2"])
def test_triton_gradient_penalty_with_mixed_dtypes(score, triton_interpreter):
    """bf16 q, k, v beside an fp32 bias and att through the triton backend (each read in its
    own dtype), under create_graph=True: the reference backend's gradient penalty, which
    promotes the inputs up front."""
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = _inputs(score, ())
    for name in ("q", "k", "v"):
        inputs[name] = inputs[name].detach().bfloat16().requires_grad_()
    got = _penalty_grads("triton", inputs, edge_index, score, 0.0, use_alpha=True)
    want = _penalty_grads("reference", inputs, edge_index, score, 0.0, use_alpha=True)
    for name in want:
        assert got[name].dtype == inputs[name].dtype, name
        assert_close(got[name], want[name], dtype=torch.bfloat16)



@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize(("score", "terms"), [(score, terms) for score, terms, _ in CASES])
def test_torch_func_transforms_match_autograd(score, terms, backend, request):
    """torch.func's vjp, jacrev, jvp, jacfwd, hessian, vmap and vmap of grad (per-sample
    gradients), and forward-mode AD with dual tensors, run through every backend, with respect
    to every input, and agree with what ordinary autograd and a Python loop give on that
    backend (its fused kernels, for ``"cpu"`` and ``"triton"``): vector-Jacobian,
    Jacobian-vector and Hessian-vector products of the outputs and weights, and batched
    outputs and gradients."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = _inputs(score, terms)
    names = [name for name, t in inputs.items() if t is not None
             and not (name == "edge_value" and t is inputs["edge_key"])]
    leaves = [inputs[name] for name in names]

    def f(*tensors):
        given = dict(zip(names, tensors, strict=True))
        if terms == ("shared",):
            given["edge_value"] = given["edge_key"]
        return edge_attention(given.pop("q"), given.pop("k"), given.pop("v"), edge_index,
                              score=score, return_attention=True, backend=backend, **given)

    def loss(*tensors):
        out, alpha = f(*tensors)
        return out.square().sum() + (alpha * alpha.flip(0)).sum()

    def cat(tensors):
        return torch.cat([t.flatten() for t in tensors])

    gen = torch.Generator().manual_seed(8)
    outputs = f(*leaves)
    cotangents = [torch.randn(t.shape, generator=gen) for t in outputs]
    tangents = [torch.randn(t.shape, generator=gen) for t in leaves]
    # autograd, the backend's own backward: J^T u; J t as the derivative of u -> J^T u along t;
    # H t as the derivative of the gradient along t
    u = [c.clone().requires_grad_() for c in cotangents]
    vjp = torch.autograd.grad(outputs, leaves, u, create_graph=True)
    jvp = torch.autograd.grad(vjp, u, tangents)
    grad = torch.autograd.grad(loss(*leaves), leaves, create_graph=True)
    hvp = torch.autograd.grad(grad, leaves, tangents)
    detached = [t.detach() for t in leaves]
    argnums = tuple(range(len(leaves)))

    got_outputs, vjp_fn = torch.func.vjp(f, *detached)
    assert_close(cat(got_outputs), cat(outputs))
    assert_close(cat(vjp_fn(tuple(cotangents))), cat(vjp))
    assert_close(cat(torch.func.jvp(f, tuple(detached), tuple(tangents))[1]), cat(jvp))
    with fwAD.dual_level():  # forward-mode AD outside torch.func: every input dual, q alone,
        # or the bias alone (beside plain q, k, v)
        duals = [fwAD.make_dual(t, tangent) for t, tangent in zip(detached, tangents,
                                                                 strict=True)]
        assert_close(cat(fwAD.unpack_dual(t).tangent for t in f(*duals)), cat(jvp))
        for alone in (0, names.index("bias")):
            fresh = [t.detach().requires_grad_() for t in leaves]
            alone_jvp = torch.autograd.grad(torch.autograd.grad(f(*fresh), fresh, u,
                                                                create_graph=True)[alone],
                                            u, tangents[alone])
            got = f(*[fwAD.make_dual(t, tangents[i]) if i == alone else t
                      for i, t in enumerate(detached)])
            assert_close(cat(fwAD.unpack_dual(t).tangent for t in got), cat(alone_jvp))
    for jacobian in (torch.func.jacrev, torch.func.jacfwd):  # [outputs][inputs] blocks
        blocks = jacobian(f, argnums=argnums)(*detached)
        matrix = torch.cat([torch.cat([b.reshape(out.numel(), -1) for b in row], dim=1)
                            for out, row in zip(outputs, blocks, strict=True)])
        assert_close(cat(cotangents) @ matrix, cat(vjp))
        assert_close(matrix @ cat(tangents), cat(jvp))
    blocks = torch.func.hessian(loss, argnums=argnums)(*detached)
    matrix = torch.cat([torch.cat([b.reshape(a.numel(), -1) for b in row], dim=1)
                        for a, row in zip(leaves, blocks, strict=True)])
    assert_close(matrix @ cat(tangents), cat(hvp), atol=1e-4, rtol=1e-4)
    samples = [torch.stack([t, torch.randn(t.shape, generator=gen)]) for t in detached]
    for in_dims in (0, (0, *[None] * (len(leaves) - 1))):  # every input batched, or q alone
        inputs = samples if in_dims == 0 else [samples[0], *detached[1:]]
        batched = torch.func.vmap(f, in_dims=in_dims)(*inputs)
        per_sample = torch.func.vmap(torch.func.grad(loss, argnums=argnums),
                                     in_dims=in_dims)(*inputs)
        for i in range(2):
            sample = [(t if in_dims != 0 and j else t[i]).clone().requires_grad_()
                      for j, t in enumerate(inputs)]
            assert_close(cat(t[i] for t in batched), cat(f(*sample)))
            want = torch.autograd.grad(loss(*sample), sample)
            assert_close(cat(t[i] for t in per_sample), cat(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("return_attention", [False, True])
def test_backward_carries_the_tangent_of_a_dual_cotangent(backend, return_attention, request):
    """Inputs without a tangent take the fused kernels; the gradient that a forward-mode dual
    cotangent u + eps du flows back from their outputs is J^T u + eps J^T du, on every backend
    (J^T being linear in the cotangent), not J^T u with the tangent dropped."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = _inputs("dot", ("edge_key", "edge_value"))
    leaves = [inputs[name] for name in ("q", "k", "v", "edge_key", "edge_value")]
    outputs = edge_attention(*leaves[:3], edge_index, edge_key=leaves[3], edge_value=leaves[4],
                             return_attention=True, backend=backend)
    outputs = outputs if return_attention else outputs[:1]
    gen = torch.Generator().manual_seed(9)
    u, du = ([torch.randn(t.shape, generator=gen) for t in outputs] for _ in range(2))
    want = torch.autograd.grad(outputs, leaves, du, retain_graph=True)  # J^T du
    with fwAD.dual_level():
        got = torch.autograd.grad(outputs, leaves, [fwAD.make_dual(a, b) for a, b in zip(
            u, du, strict=True)])
        tangents = [fwAD.unpack_dual(g).tangent for g in got]
    assert all(t is not None for t in tangents)
    assert_close(torch.cat([t.flatten() for t in tangents]),
                 torch.cat([w.flatten() for w in want]))


@pytest.mark.parametrize("backend", ["reference", *BACKENDS])
@pytest.mark.parametrize("randomness", ["same", "different"])
def test_dropout_under_vmap_follows_its_randomness(backend, randomness, request):
    """Attention dropout under torch.func.vmap with ``randomness="same"`` draws one mask for
    the batch (the one a plain call draws from the same seed), with ``"different"`` a mask per
    sample, as ``F.dropout`` does; every backend draws the reference backend's masks."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = {name: t.detach() for name, t in _inputs("dot", ("edge_key", "edge_value")).items()
              if t is not None}

    def f(name, q):
        return edge_attention(q, inputs["k"], inputs["v"], edge_index, bias=inputs["bias"],
                              edge_key=inputs["edge_key"], edge_value=inputs["edge_value"],
                              dropout_p=0.5, training=True, backend=name)

    q = inputs["q"].expand(4, *inputs["q"].shape)  # (4, N_dst, H, C): one q, four samples
    outs = {}
    for name in ("reference", backend):
        torch.manual_seed(12)
        outs[name] = torch.func.vmap(functools.partial(f, name), randomness=randomness)(q)
    assert_close(outs[backend], outs["reference"])
    same = [torch.equal(outs[backend][0], o) for o in outs[backend][1:]]
    assert same == [randomness == "same"] * 3
    if randomness == "same":
        torch.manual_seed(12)
        assert_close(outs[backend][0], f(backend, inputs["q"]))


@pytest.mark.parametrize("half", [("q", "k", "v", "edge_value"), ("q", "k", "att", "edge_key")],
                         ids=["qkv", "scores-but-bias"])
@pytest.mark.parametrize("terms", [(), ("edge_key", "edge_value")])
def test_triton_keeps_its_output_dtypes_under_torch_func(terms, half, triton_interpreter):
    """Under torch.func the triton backend runs the reference path, whose outputs are those of
    a plain call in dtype too: out in v's dtype and the weights in the scores' inputs' dtype
    promoted, not everything promoted (bf16 q, k, v beside an fp32 att and bias; or bf16
    scores' inputs but an fp32 bias, beside an fp32 v)."""
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = {name: t.detach() for name, t in _inputs("gatv2", terms).items() if t is not None}
    for name in half:
        if name in inputs:
            inputs[name] = inputs[name].bfloat16()

    def f(q):
        rest = {name: t for name, t in inputs.items() if name != "q"}
        return edge_attention(q, rest.pop("k"), rest.pop("v"), edge_index, score="gatv2",
                              return_attention=True, backend="triton", **rest)

    want = f(inputs["q"])
    batched = torch.func.vmap(f)(inputs["q"].expand(2, *inputs["q"].shape))
    primal, tangent = torch.func.jvp(f, (inputs["q"],), (torch.ones_like(inputs["q"]),))
    for got in (tuple(t[0] for t in batched), primal, tangent):
        assert [t.dtype for t in got] == [t.dtype for t in want]
    for got, ref in zip((t[0] for t in batched), want, strict=True):
        assert_close(got, ref, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("score", ["dot", "additive", "gatv2"])
def test_create_graph_on_a_graph_without_edges(backend, score, request):
    """No edge: out is 0 whatever the inputs, so the recompute reaches none of them; their
    gradients are zeros (or None), and differentiable again, not an error."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    inputs = attention_inputs(NUM_SRC, NUM_DST, 0, HEADS, CHANNELS, score=score, bias=False,
                              seed=3)
    leaves = [inputs[name] for name in ("q", "k", "v", "att") if inputs[name] is not None]
    out = edge_attention(inputs["q"], inputs["k"], inputs["v"], torch.empty(2, 0, dtype=torch.long),
                         att=inputs["att"], score=score, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad((out * 2).sum(), leaves, create_graph=True, allow_unused=True)
    for leaf, g in zip(leaves, grads, strict=True):
        assert g is None or torch.equal(g, torch.zeros_like(leaf))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_penalty_with_one_channel_matches_reference(backend, request):
    """q and k of the dot score with C = 1 keep their channel axis in the recompute (only the
    additive score's [N, H, 1] inputs lose it)."""
    if backend == "triton":
        request.getfixturevalue("triton_interpreter")
    edge_index = random_graph(NUM_SRC, NUM_EDGES, seed=5, num_dst=NUM_DST)
    inputs = attention_inputs(NUM_SRC, NUM_DST, NUM_EDGES, HEADS, 1, seed=3)
    got = _penalty_grads(backend, inputs, edge_index, "dot", 0.0, True)
    want = _penalty_grads("reference", inputs, edge_index, "dot", 0.0, True)
    for name in want:
        assert_close(got[name], want[name], atol=1e-4, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in want.values())
