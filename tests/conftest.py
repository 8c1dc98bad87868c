"""Shared tolerances, the registry of small named test graphs and Triton's interpreter.

Every layer and backend runs through all of ``GRAPHS`` (tagged like DGL's graph cases), with
int64 and int32 ids.
"""

from __future__ import annotations

import functools
import os
import types
from dataclasses import dataclass

import pytest
import torch

from graphattn.functional import cpu as _cpu_backend
from graphattn.functional import edge_attention
from graphattn.functional import triton_kernels as tk

# The cpu backend compiles its three numba kernels for each set of flags (score, bias, edge
# terms), channel counts in SPECIALISED_CHANNELS and one head, as constants: 3.5-5 s a kernel on
# this machine's cores, some 180 kernels over the suite. The suite runs the one variant that reads
# them all at run time instead (about 30 kernels: one per dtype and type of mask and ids), and
# test_specialised_kernels_agree_bit_for_bit_with_the_run_time_variant compares the package's
# constant variants with it, bit for bit.
# GRAPHATTN_CPU_SPECIALISE=0 does the same in the processes that tests start (the benchmarks').
os.environ["GRAPHATTN_CPU_SPECIALISE"] = "0"
PACKAGE_SPECIALISATION = {"SPECIALISED_FLAGS": True,
                          "SPECIALISED_CHANNELS": _cpu_backend.CONSTANT_CHANNELS,
                          "SPECIALISED_HEADS": _cpu_backend.CONSTANT_HEADS}
SUITE_SPECIALISATION = {"SPECIALISED_FLAGS": False, "SPECIALISED_CHANNELS": frozenset(),
                        "SPECIALISED_HEADS": frozenset()}
for _name, _value in SUITE_SPECIALISATION.items():
    setattr(_cpu_backend, _name, _value)

# pytest-xdist runs one process per core (README.md, "Test"). With torch's default of one
# intra-op thread per core in each, the processes' thread pools share the cores, and an OpenMP
# barrier waits for a thread that the other process holds: gradcheck on a 9-node graph took 13
# to 58 s in the suite, 2.2 s alone. Each process gets its share of the threads instead; tests
# of more than one thread ask for them (the ``two_threads`` fixture, or set_num_threads).
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // XDIST_WORKERS))


@pytest.fixture
def two_threads():
    """torch (and so the cpu backend's thread pool) on two threads for the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# torch 2.8 and 2.9 trace an operator whose output size depends on the data (the boolean index
# of the self-loop replacement: nonzero) only with this flag, where fullgraph=True implies it
# from torch 2.10 on (torch/_dynamo/output_graph.py). Without it the layers keep the given
# self-loops flagged (README.md, torch.compile); the suite sets it there, so that fullgraph=True
# takes the path it takes on later torch. It changes nothing on CI's torch. Tests of the default
# mode unset it (test_compile.py's default_mode fixture).
FULLGRAPH_NEEDS_THE_FLAG = torch.__version__ < (2, 10)


@pytest.fixture(autouse=True)
def _dynamic_output_shapes_on_older_torch():
    if not FULLGRAPH_NEEDS_THE_FLAG:
        yield
        return
    # config.patch, not monkeypatch: pytest 9.2's undo deletes what it did not find in the
    # object's __dict__, and dynamo's config lives behind __getattr__ / __setattr__
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        yield


# Tolerances live here and nowhere else.
TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-8),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def randomized(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``module`` with every parameter drawn at random, N(0, 0.5^2) (gains and biases away
    from their 1s and 0s, so that a lost one shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return module


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 **overrides) -> None:
    """``torch.testing.assert_close`` with the project's tolerance for ``dtype``."""
    tol = dict(TOL[dtype or expected.dtype])
    tol.update(overrides)
    torch.testing.assert_close(actual, expected.to(actual.device, actual.dtype), **tol)


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """:func:`assert_close` with the absolute tolerance times the largest magnitude of
    ``expected`` (at least 1): for the gradient of a weight, a sum over every node whose
    rounding follows its largest entries, so that its small entries differ by more than their
    own size allows (on CPUs whose kernels sum in another order)."""
    scale = max(1.0, expected.abs().max().item())
    assert_close(actual, expected, atol=TOL[expected.dtype]["atol"] * scale)


@dataclass(frozen=True)
class GraphCase:
    """A small named graph: ``edge_index`` with ``num_src`` sources and ``num_dst`` targets."""

    name: str
    edge_index: torch.Tensor
    num_src: int
    num_dst: int
    tags: tuple[str, ...]

    @property
    def bipartite(self) -> bool:
        return "bipartite" in self.tags


def _ei(pairs: list[tuple[int, int]]) -> torch.Tensor:
    if not pairs:
        return torch.empty(2, 0, dtype=torch.long)
    return torch.tensor(pairs, dtype=torch.long).t().contiguous()


def _complete(n: int) -> list[tuple[int, int]]:
    return [(j, i) for i in range(n) for j in range(n)]


GRAPHS: list[GraphCase] = [
    GraphCase("no-edges", _ei([]), 4, 4, ("zero-degree",)),
    GraphCase("single-edge", _ei([(0, 1)]), 3, 3, ("zero-degree",)),
    GraphCase("isolated-middle", _ei([(0, 1), (1, 0), (3, 4), (4, 3)]), 5, 5, ("zero-degree",)),
    GraphCase("trailing-isolated", _ei([(0, 1), (1, 2), (2, 0)]), 6, 6, ("zero-degree",)),
    GraphCase("self-loops", _ei([(0, 0), (1, 1), (0, 1), (2, 2), (1, 2)]), 3, 3, ("self-loop",)),
    GraphCase("multi-edges", _ei([(0, 1), (0, 1), (0, 1), (2, 1), (1, 0), (1, 0)]), 3, 3,
              ("multi-edge", "zero-degree")),
    GraphCase("chain", _ei([(i - 1, i) for i in range(1, 7)] + [(i, i - 1) for i in range(1, 7)]),
              7, 7, ("chain",)),
    GraphCase("complete", _ei(_complete(5)), 5, 5, ("complete", "self-loop")),
    GraphCase("star-in", _ei([(j, 0) for j in range(1, 9)]), 9, 9, ("zero-degree",)),
    GraphCase("bipartite", _ei([(0, 0), (1, 0), (4, 1), (2, 1), (3, 1), (0, 2)]), 5, 4,
              ("bipartite", "zero-degree")),
]


@pytest.fixture(params=GRAPHS, ids=[g.name for g in GRAPHS])
def graph_case(request) -> GraphCase:
    return request.param


@pytest.fixture(params=[torch.int64, torch.int32], ids=["int64", "int32"])
def index_dtype(request) -> torch.dtype:
    return request.param


def random_graph(num_nodes: int, num_edges: int, seed: int = 0,
                 num_dst: int | None = None) -> torch.Tensor:
    """Uniform random ``[2, E]`` edges (multi-edges and self-loops allowed)."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, num_nodes, (num_edges,), generator=gen)
    dst = torch.randint(0, num_dst or num_nodes, (num_edges,), generator=gen)
    return torch.stack([src, dst])



def attention_inputs(num_src: int, num_dst: int, num_edges: int, heads: int, channels: int, *,
                     score: str = "dot", bias: bool = True, terms: tuple[str, ...] = (),
                     dtype: torch.dtype = torch.float32, seed: int = 0,
                     value_channels: int | None = None) -> dict[str, torch.Tensor | None]:
    """Random inputs of ``edge_attention`` in ``dtype``, leaves that require grad: q, k, v,
    bias (``bias``), att (gatv2) and the per-edge terms named in ``terms`` (``"edge_key"``,
    ``"edge_value"``); v and edge_value have ``value_channels`` (default: ``channels``)."""
    gen = torch.Generator().manual_seed(seed)
    qk_shape = (heads,) if score == "additive" else (heads, channels)
    value_channels = channels if value_channels is None else value_channels
    tensors = {
        "q": torch.randn(num_dst, *qk_shape, generator=gen),
        "k": torch.randn(num_src, *qk_shape, generator=gen),
        "v": torch.randn(num_src, heads, value_channels, generator=gen),
        "bias": torch.randn(num_edges, heads, generator=gen) if bias else None,
        "att": torch.randn(heads, channels, generator=gen) if score == "gatv2" else None,
        "edge_key": (torch.randn(num_edges, heads, channels, generator=gen)
                     if "edge_key" in terms else None),
        "edge_value": (torch.randn(num_edges, heads, value_channels, generator=gen)
                       if "edge_value" in terms else None),
    }
    return {name: None if t is None else t.to(dtype).requires_grad_()
            for name, t in tensors.items()}


def assert_results_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                         inputs: dict[str, torch.Tensor | None], dtype: torch.dtype) -> None:
    """Two dicts of results (``out``, ``alpha`` and ``d<input>`` gradients) hold the same
    names, finite values close within the tolerance of ``dtype``, and every gradient has the
    dtype of its input."""
    assert got.keys() == want.keys()
    for name in got:
        if name.startswith("d"):
            assert got[name].dtype == inputs[name[1:]].dtype, name
        assert torch.isfinite(got[name]).all(), name
        assert_close(got[name], want[name], dtype=dtype)

def outputs_and_grads(backend: str, inputs: dict, edge_index: torch.Tensor,
                      **options) -> list[torch.Tensor]:
    """``edge_attention`` on ``inputs`` (q, k, v, then the other tensors by keyword) with the
    weights returned: out, the weights, and the gradients of every input of a fixed random
    loss on both."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    extra = {name: t for name, t in inputs.items() if name not in "qkv"}
    out, alpha = edge_attention(q, k, v, edge_index, return_attention=True, backend=backend,
                                **extra, **options)
    gen = torch.Generator().manual_seed(1)
    loss = ((out * torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)).sum()
            + (alpha * torch.randn(alpha.shape, generator=gen, dtype=alpha.dtype).to(
                alpha.device)).sum())
    return [out, alpha, *torch.autograd.grad(loss, list(inputs.values()))]


def assert_compiles_as_it_runs(attend, inputs: dict, edge_index: torch.Tensor) -> None:
    """``attend(*inputs.values(), edge_index)``, returning (out, weights), compiled
    (``fullgraph``, the aot_eager backend) and in eager: the same outputs and gradients."""
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, attend):
        out, alpha = fn(*inputs.values(), edge_index)
        loss = (out * out).sum() + (alpha * alpha).sum()
        results.append([out, alpha, *torch.autograd.grad(loss, list(inputs.values()))])
    for a, b in zip(*results, strict=True):
        assert_close(a, b)


def dense_mask(edge_index: torch.Tensor, num_dst: int, num_src: int) -> torch.Tensor:
    """``mask[i, j] = True`` for every edge j -> i (the convention of ``dense_attention``)."""
    mask = torch.zeros(num_dst, num_src, dtype=torch.bool)
    mask[edge_index[1], edge_index[0]] = True
    return mask


def assert_agrees_with_pyg(layer: torch.nn.Module, conv: torch.nn.Module,
                           x: torch.Tensor | tuple[torch.Tensor, torch.Tensor | None],
                           edge_index: torch.Tensor, edge_attr: torch.Tensor | None = None,
                           **options) -> None:
    """Run a graphattn layer and a PyG layer with copied weights on the same inputs (``x`` may
    be GATConv's ``(x_src, None)``; ``options`` go to both, ``size`` say): the same outputs,
    edge order, attention weights and input gradients (through a loss that weighs every output
    differently). Both layers' parameters keep their gradients for the caller."""
    extra = () if edge_attr is None else (edge_attr,)
    pair = isinstance(x, tuple)
    x_ours = tuple(t if t is None else t.clone().requires_grad_() for t in (x if pair else (x,)))
    x_ref = tuple(t if t is None else t.clone().requires_grad_() for t in (x if pair else (x,)))
    out, (ei, alpha) = layer(x_ours if pair else x_ours[0], edge_index, *extra,
                             return_attention_weights=True, **options)
    ref, (ei_ref, alpha_ref) = conv(x_ref if pair else x_ref[0], edge_index, *extra,
                                    return_attention_weights=True, **options)
    assert out.shape == ref.shape
    assert_close(out, ref)
    assert torch.equal(ei, ei_ref)
    assert_close(alpha, alpha_ref)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    for ours, theirs in zip(x_ours, x_ref, strict=True):
        if ours is not None:
            assert_close(ours.grad, theirs.grad)


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[tuple[int, int | None, bool]]:
    """Records ``(q.dim(), attn_mask.dim() or None, is_causal)`` of every forward that reaches
    SDPA: ``F.scaled_dot_product_attention``, or the operator of its CPU flash kernel that the
    ``"dense"`` backend calls itself when gradients are wanted."""
    import torch.nn.functional as F

    from graphattn.functional import dense_backend

    calls: list[tuple[int, int | None, bool]] = []
    sdpa, flash = F.scaled_dot_product_attention, dense_backend._flash_cpu_forward

    def record(q, attn_mask, is_causal) -> None:
        calls.append((q.dim(), None if attn_mask is None else attn_mask.dim(), is_causal))

    def spy_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        record(q, attn_mask, is_causal)
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                    **kwargs)

    def spy_flash(q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        record(q, attn_mask, is_causal)
        return flash(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy_sdpa)
    if flash is not None:
        monkeypatch.setattr(dense_backend, "_flash_cpu_forward", spy_flash)
    return calls


@pytest.fixture
def triton_interpreter(monkeypatch):
    """The triton backend's kernels in Triton's CPU interpreter, for this test (skipped without
    triton)."""
    from graphattn.functional import triton_kernels as tk

    if not tk.triton_available():
        pytest.skip("triton is not installed (pip install 'graphattn[gpu]')")
    if DEVICE.type == "cuda":  # a process that ran the interpreter cannot compile afterwards
        pytest.skip("an interpreter test, and GRAPHATTN_TRITON_DEVICE=cuda tests the compiled "
                    "kernels: after the interpreter, Triton's language stays patched in the "
                    "process, and the later compiled tests of its worker would fail")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not tk.interpret_mode():
        pytest.skip("TRITON_INTERPRET=1 did not switch this triton to its interpreter")
    failure = _interpreter_loop_bound_failure()
    if failure:
        pytest.skip(failure)


# The triton backend's two kinds of kernels: one node per program (the default) and row blocks
# (``launch_tiles(block_n=...)``), with a heavy_degree low enough that the graphs of the tests
# have rows of both kinds: those of at most 6 edges in blocks of 4, the others (star-in's hub,
# degree-40 and degree-200 rows) one per program.
TRITON_TILES = {"one-node": {}, "row-blocks": {"block_n": 4, "heavy_degree": 6}}


@pytest.fixture(params=list(TRITON_TILES))
def triton_tiles(request):
    """Each triton kernel test that takes it runs with both kinds of kernels."""
    from graphattn.functional import triton_kernels as tk

    with tk.launch_tiles(**TRITON_TILES[request.param]):
        yield request.param


def check_nan_score_pattern(backend: str, score: str, value: float, *, grads: bool = True,
                            device: torch.device | str = "cpu") -> None:
    """A NaN or +inf bias on one edge: every weight of that edge's target in that head is NaN,
    as torch.softmax makes its whole row, and so is the target's output there; the other
    targets and heads stay finite. With ``grads``, the gradients are NaN exactly where the
    target's edges reach: q of the target, k and v of its sources, the bias of its edges, and
    att, in that head."""
    edge_index = torch.tensor([[0, 1, 2, 0, 3], [0, 0, 0, 1, 2]])  # target 0 has 3 in-edges
    gen = torch.Generator().manual_seed(0)
    qk_shape = (4, 2) if score == "additive" else (4, 2, 3)
    leaves = {"q": torch.randn(qk_shape, generator=gen), "k": torch.randn(qk_shape, generator=gen),
              "v": torch.randn(4, 2, 3, generator=gen), "bias": torch.zeros(5, 2)}
    if score == "gatv2":
        leaves["att"] = torch.randn(2, 3, generator=gen)
    leaves["bias"][1, 0] = value
    leaves = {n: t.to(device).requires_grad_() for n, t in leaves.items()}
    out, alpha = edge_attention(leaves["q"], leaves["k"], leaves["v"], edge_index.to(device),
                                bias=leaves["bias"], score=score, att=leaves.get("att"),
                                return_attention=True, backend=backend)

    def nan_in_head_0(shape, rows):
        """The NaN pattern of a tensor of ``shape`` ``[N, H, ...]`` (``[H, C]`` when ``rows``
        is None) with NaN exactly in head 0 of ``rows``."""
        expected = torch.zeros(shape, dtype=torch.bool)
        expected[(0,) if rows is None else (rows, 0)] = True
        return expected

    assert torch.equal(out.isnan().cpu(), nan_in_head_0(out.shape, [0]))
    assert torch.equal(alpha.isnan().cpu(), nan_in_head_0(alpha.shape, [0, 1, 2]))
    if not grads:
        return
    (out.sum() + alpha.sum()).backward()
    reached = {"q": [0], "k": [0, 1, 2], "v": [0, 1, 2], "bias": [0, 1, 2], "att": None}
    for name, t in leaves.items():
        assert torch.equal(t.grad.isnan().cpu(), nan_in_head_0(t.shape, reached[name])), name


# The Triton kernel tests run in Triton's CPU interpreter; with GRAPHATTN_TRITON_DEVICE=cuda, on
# CUDA tensors with the compiled kernels instead (the reference backend then runs on the GPU too).
HAS_TRITON = tk.triton_available()
DEVICE = torch.device(os.environ.get("GRAPHATTN_TRITON_DEVICE", "cpu"))
needs_triton = pytest.mark.skipif(not HAS_TRITON,
                                  reason="triton is not installed (pip install 'graphattn[gpu]')")


@pytest.fixture
def triton_device(request) -> torch.device:
    """Where the Triton tests run: CPU tensors in Triton's interpreter, or with
    ``GRAPHATTN_TRITON_DEVICE=cuda`` CUDA tensors on the compiled kernels."""
    if DEVICE.type == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("GRAPHATTN_TRITON_DEVICE=cuda, but torch sees no CUDA device")
        return DEVICE
    request.getfixturevalue("triton_interpreter")
    return DEVICE


def _patch_the_language_once_per_launch() -> bool:
    """Make Triton's interpreter patch ``triton.language`` once per kernel launch, not again on
    every call of a ``@triton.jit`` device function from the kernel; ``False`` where this
    triton's interpreter is not built as the code below expects (it is then left as it is).

    Triton 3.6 to 3.9 swap the language's builtins for the interpreter's at each launch
    (``_patch_lang``: ``inspect.getmembers`` over ``tl``, ``tl.tensor`` and ``tl.math``) and
    put them back when the launch ends. A device function's call patches them again, though
    the launch running it already did, and never puts back what it set: 1.4 ms per call, and
    the kernels call their device functions thousands of times per test (40% of the
    interpreter's time in the Triton tests). Here a device function whose language modules
    (``tl``, ``tl.core``) are patched already in the running launch runs on that patch; any
    other call patches as before.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    if not all(hasattr(ti, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    patch_lang, launch = ti._patch_lang, ti.GridExecutor.__call__
    launches: list[set[int] | None] = []  # per running launch: the modules it patched

    def languages(fn) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if value is tl or value is tl.core}

    def patch_once(fn):
        modules = languages(fn)
        if launches and launches[-1] is not None and modules <= launches[-1]:
            return ti._LangPatchScope()  # nothing set, nothing to put back
        scope = patch_lang(fn)
        if launches:  # the launch's own patch, or a device call's, which stays to its end
            launches[-1] = modules | (launches[-1] or set())
        return scope

    def launch_patching_once(self, *args, **kwargs):
        launches.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    ti._patch_lang = patch_once
    ti.GridExecutor.__call__ = launch_patching_once
    return True


INTERPRETER_PATCHES_ONCE = HAS_TRITON and _patch_the_language_once_per_launch()


@pytest.fixture(scope="module")
def interpreter():
    """Triton's interpreter on for the tests of a module, restored afterwards; with
    ``GRAPHATTN_TRITON_DEVICE=cuda``, the compiled kernels on the GPU instead."""
    if DEVICE.type == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("GRAPHATTN_TRITON_DEVICE=cuda, but torch sees no CUDA device")
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        if not tk.interpret_mode():
            pytest.skip("TRITON_INTERPRET=1 did not switch this triton to its interpreter")
        failure = _interpreter_loop_bound_failure()
        if failure:
            pytest.skip(failure)
        yield


@functools.cache
def _interpreter_loop_bound_failure() -> str:
    """Why this triton's interpreter cannot run the kernels, or "" when it can.

    The kernels walk each row's edges in ``range(start, end)`` with the bounds loaded from the
    row pointers. Triton 3.6's interpreter (and older ones) hands a loaded scalar over as a
    one-element array, and numpy 2.4 no longer converts such an array to an int: every kernel
    then fails. Triton 3.7 or numpy < 2.4 runs them."""
    import numpy as np
    import triton
    import triton.language as tl

    @triton.jit
    def count(bounds, out):
        n = tl.full([1], 0, tl.int32)
        for _ in range(tl.load(bounds), tl.load(bounds + 1)):
            n += 1
        tl.store(out + tl.arange(0, 1), n)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        count[(1,)](torch.tensor([2, 5], dtype=torch.int32), out)
    except Exception as error:  # the interpreter wraps the TypeError in an InterpreterError
        return (f"triton {triton.__version__}'s interpreter cannot take a loop bound loaded "
                f"from memory under numpy {np.__version__} ({error}); triton >= 3.7 or "
                "numpy < 2.4 can")
    assert out.item() == 3, "the interpreter counted a loop of 3 steps wrongly"
    return ""


def on_device(inputs):
    """The inputs as fresh leaves on the device the kernels run on (``DEVICE``)."""
    return {n: None if t is None else t.detach().to(DEVICE).requires_grad_(t.requires_grad)
            for n, t in inputs.items()}



def record_out_dtypes(monkeypatch, module, name: str) -> list:
    """Wrap the forward launcher ``module.name`` (it returns out first) so that the dtype of
    each out it allocates is appended to the list returned."""
    launcher, written = getattr(module, name), []

    def recording(*args, **kwargs):
        result = launcher(*args, **kwargs)
        written.append(result[0].dtype)
        return result

    monkeypatch.setattr(module, name, recording)
    return written


def spy_on_launches(monkeypatch, names) -> list:
    """Replace the kernel module (``tk.kernels()``) by one whose kernels ``names`` launch as
    before and record ``(name, grid, keyword arguments)`` of each launch in the list
    returned."""
    module, launches = tk.kernels(), []

    class LaunchSpy:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            launch = getattr(module, self.name)[grid]

            def record(*args, **kwargs):
                launches.append((self.name, grid, kwargs))
                return launch(*args, **kwargs)
            return record

    monkeypatch.setattr(tk, "kernels", lambda: types.SimpleNamespace(
        **{name: LaunchSpy(name) for name in names}))
    return launches


@pytest.fixture
def transposes(monkeypatch):
    """The calls of sparse_linear's counting-sort transpose: its backward ran once for each."""
    from graphattn.functional import sparse_linear as module

    calls = []

    def counted(*args):
        calls.append(args)
        return transpose(*args)

    transpose = module.csr_transpose
    monkeypatch.setattr(module, "csr_transpose", counted)
    return calls
