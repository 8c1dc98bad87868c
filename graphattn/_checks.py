"""Argument checks shared by the functional API and the layers.

Every check raises before any indexing happens: on CUDA an out-of-range gather is an unrecoverable
device-side assert, so ``edge_index`` is validated against the node counts first.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch
from torch import Tensor

from graphattn._tensor_cache import TensorCache, capturing_cuda_graph

# The bounds of recently checked edge_index tensors (graphattn._tensor_cache): on CUDA, reading
# them back is a host synchronisation, which an unchanged graph needs only once.
_EDGE_INDEX_BOUNDS: TensorCache[tuple[int, int, int]] = TensorCache(max_entries=16)


def check_edge_index(edge_index: Tensor, num_src: int, num_dst: int) -> None:
    """Raise if ``edge_index`` is not an integer ``[2, E]`` tensor with valid node ids.

    Row 0 (sources j) must lie in ``[0, num_src)``, row 1 (targets i) in ``[0, num_dst)``.
    On CUDA the bounds read back for a tensor are kept while it lives unmodified (see
    ``graphattn._tensor_cache``): checking the same graph again costs no synchronisation.
    """
    check_tensors(edge_index=edge_index)
    if edge_index.layout != torch.strided:  # (the layers convert COO, CSR and CSC before)
        raise TypeError(f"edge_index must be a dense [2, E] tensor (or, for the layers, a "
                        f"sparse adjacency in COO, CSR or CSC layout), got layout "
                        f"{edge_index.layout}")
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(f"edge_index must have shape [2, E], got {list(edge_index.shape)}")
    # int64 or int32 only: a narrower dtype cannot hold the ids of the self-loops a layer adds
    # (torch.arange(300, dtype=torch.uint8) wraps around), and index_add_ refuses it.
    if edge_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"edge_index must have an integer dtype (int64 or int32), "
                        f"got {edge_index.dtype}")
    if edge_index.numel() == 0:
        return
    if torch.compiler.is_compiling() or capturing_cuda_graph():
        # Traced by torch.compile: the node ids are not known until the graph runs, so the
        # checks become asserts inside it, and their messages cannot quote the bad value. Nor
        # the node counts: formatting a traced size into a string would fix it to the value
        # traced, and every other graph size would compile again. Captured into a CUDA graph:
        # a read back to the host is not allowed there, and the asserts run at every replay.
        # (a column of -1 for the maxima and of 0 for the minimum: a program exported with a
        # dynamic edge count also takes a graph without edges, whose reductions are empty)
        pad = edge_index.new_zeros(2, 1)
        src_max, dst_max = torch.cat([edge_index, pad - 1], dim=1).amax(dim=1)
        torch._assert_async(torch.cat([edge_index, pad], dim=1).min() >= 0,
                            "edge_index must hold node ids >= 0")
        torch._assert_async(src_max < num_src, "edge_index[0] (sources) must be < the "
                                               "number of source nodes")
        torch._assert_async(dst_max < num_dst, "edge_index[1] (targets) must be < the "
                                               "number of target nodes")
        return
    # one read back to the host (on CUDA, one synchronisation) for the three bounds; on CUDA
    # kept for as long as this edge_index lives unmodified
    try:
        lo, src_max, dst_max = _EDGE_INDEX_BOUNDS.get(edge_index, None,
                                                      lambda: _edge_index_bounds(edge_index))
    except RuntimeError as error:  # (torch's own message speaks of .item())
        if not torch._C._are_functorch_transforms_active() or "vmap" not in str(error):
            raise
        raise ValueError("edge_index is batched by torch.func.vmap, and its node ids cannot "
                         "be read there: vmap over the features of one graph, or batch the "
                         "graphs as one graph without edges between them "
                         "(graphattn.graphs.repeat_graph, or PyG's Batch)") from error
    if lo < 0:
        raise ValueError(f"edge_index must hold node ids >= 0, got a minimum of {lo}")
    if src_max >= num_src:
        raise ValueError(f"edge_index[0] (sources) must be < the number of source nodes "
                         f"{num_src}, got a maximum of {src_max}")
    if dst_max >= num_dst:
        raise ValueError(f"edge_index[1] (targets) must be < the number of target nodes "
                         f"{num_dst}, got a maximum of {dst_max}")


def _edge_index_bounds(edge_index: Tensor) -> tuple[int, int, int]:
    """``(min, max of row 0, max of row 1)`` of a non-empty ``[2, E]`` edge_index."""
    return tuple(host_list(torch.cat([edge_index.min().view(1), edge_index.amax(dim=1)])))


def host_list(values: Tensor) -> list:
    """``values.tolist()`` of a 1-D tensor, in one read back to the host.

    Under ``torch.func``'s transforms torch 2.8 wraps the results of every operator, those of
    an integer tensor too, and ``tolist`` cannot read the wrapper ("Cannot access data
    pointer of Tensor that doesn't have storage"); ``item`` can, so there the values are read
    one by one."""
    if torch._C._are_functorch_transforms_active():
        return [value.item() for value in values.unbind()]
    return values.tolist()


def check_tensors(**tensors: object) -> None:
    """Raise unless each given argument is a tensor (``None`` included); the message names it."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            hint = ""
            if type(t).__name__ == "SparseTensor":  # torch_sparse's, as T.ToSparseTensor makes
                hint = (": convert it with adj_t.to_torch_sparse_csr_tensor(), or build it "
                        "with T.ToSparseTensor(layout=torch.sparse_csr)")
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}{hint}")


def check_strided(**tensors: Tensor | None) -> None:
    """Raise unless each given tensor (``None``: an optional argument not given) is dense, of
    torch's strided layout; the message names it and its layout."""
    for name, t in tensors.items():
        if t is not None and t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}: "
                            f"convert it with {name}.to_dense()")


def check_same_device(**tensors: Tensor | None) -> None:
    """Raise if the given tensors are not all tensors on one device (``None`` stands for an
    optional argument not given); the message names each."""
    present = {name: t for name, t in tensors.items() if t is not None}
    check_tensors(**present)
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in present.items())
        raise ValueError(f"all inputs must be on one device, got {where}")


def check_float_dtype(**tensors: Tensor | None) -> None:
    """Raise unless each given tensor has a floating-point dtype; the message names it."""
    for name, t in tensors.items():
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{name} must have a floating-point dtype, got {t.dtype}")


def autocasting(x: Tensor) -> bool:
    """Whether ``torch.autocast`` is on for ``x``'s device (which then casts the floating
    inputs of the ops it covers, float64 aside, to its dtype)."""
    return (torch.amp.is_autocast_available(x.device.type)
            and torch.is_autocast_enabled(x.device.type))


def check_bias_dtype(bias: Tensor, x: Tensor, name: str = "attn_bias") -> None:
    """Raise unless the floating score bias ``bias`` has the dtype of the features ``x``; under
    ``torch.autocast``, which casts both to its dtype, unless one is float64 (which it
    leaves)."""
    if bias.dtype == x.dtype:
        return
    if (bias.is_floating_point() and torch.float64 not in (bias.dtype, x.dtype)
            and autocasting(x)):
        return
    raise TypeError(f"{name} must have the dtype of the features, {x.dtype}, got {bias.dtype}")


def check_weight_dtype(x: Tensor, module: torch.nn.Module, name: str) -> None:
    """Raise unless ``x`` has the dtype of ``module.weight``, which computes on it: float64
    features read from numpy into an fp32 layer, say. Under ``torch.autocast`` for ``x``'s
    device, which casts both (float64 aside, as autocast leaves it), only a float64 ``x`` is
    refused; a weight that is not a plain tensor yet (a lazy or quantized module's) is not
    checked."""
    weight = getattr(module, "weight", None)
    # isinstance, not torch.nn.parameter.is_lazy: dynamo traces the one, not the other
    if (not isinstance(weight, Tensor)
            or isinstance(weight, torch.nn.parameter.UninitializedTensorMixin)
            or x.dtype == weight.dtype):
        return
    if x.dtype != torch.float64 and autocasting(x):
        return
    raise TypeError(f"{name} must have the dtype of the layer's weights, {weight.dtype}, got "
                    f"{x.dtype}: cast {name} with .to({weight.dtype}), or the layer with "
                    f".to({x.dtype})")


def check_dropout(p: float, name: str = "dropout") -> None:
    """Raise unless ``p`` is a real number with ``0 <= p < 1``."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise ValueError(f"{name} must be in [0, 1), got {p!r} (a {type(p).__name__}, not a "
                         f"number)")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p!r}")


def check_batch(batch: Tensor) -> None:
    """Raise unless ``batch`` is a 1-D integer tensor of graph ids >= 0 (PyG's ``data.batch``);
    reads its minimum back to the host."""
    if not isinstance(batch, Tensor):
        raise TypeError(f"batch must be a torch.Tensor, got {type(batch).__name__}")
    if batch.dim() != 1:
        raise ValueError(f"batch must have shape [N], got {list(batch.shape)}")
    if batch.is_floating_point() or batch.is_complex() or batch.dtype == torch.bool:
        raise TypeError(f"batch must be an integer tensor, got {batch.dtype}")
    if batch.numel() > 0 and batch.dtype.is_signed and int(batch.min()) < 0:
        raise ValueError(f"batch must hold graph ids >= 0, got {int(batch.min())}")


def dense_graph_ids(batch: Tensor) -> Tensor:
    """``batch`` (checked by :func:`check_batch`) as int64 graph ids below N, so that
    ``bincount`` has at most N bins: ids as large as 10^9 for a few nodes are renumbered in
    their order (only which nodes share a graph matters to the callers)."""
    batch = batch.long()
    if batch.numel() > 0 and int(batch.max()) >= batch.numel():
        batch = torch.unique(batch, return_inverse=True)[1]
    return batch


def check_generator(generator: object, name: str = "generator") -> None:
    """Raise unless ``generator`` is ``None`` or a ``torch.Generator``; the message names it."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"{name} must be a torch.Generator or None, got {generator!r} (a "
                        f"{type(generator).__name__})")


def check_flag(value: object, name: str) -> bool:
    """``value`` as a bool; raise unless it is one (a Python or numpy bool): a string such as
    ``"False"`` or a None would otherwise be read by its truth value."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r} (a {type(value).__name__})")


def as_integer(value: object) -> int | None:
    """``value`` as a Python int when it is an integer: an int, a numpy integer or a
    one-element integer tensor; ``None`` for anything else, bools included."""
    if isinstance(value, Tensor):
        if (value.numel() != 1 or value.is_floating_point() or value.is_complex()
                or value.dtype == torch.bool):
            return None
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def check_positive(value: int, name: str) -> int:
    """``value`` as an int; raise unless it is an integer (numpy and one-element tensor
    integers included) > 0."""
    n = as_integer(value)
    if n is None or n <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return n


def check_non_negative(value: int, name: str) -> int:
    """``value`` as an int; raise unless it is an integer (numpy and one-element tensor
    integers included) >= 0."""
    n = as_integer(value)
    if n is None or n < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return n


def check_finite(value: float, name: str) -> None:
    """Raise unless ``value`` is a finite real number (numpy scalars included)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not -math.inf < value < math.inf):  # (no graph break on a SymFloat)
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def score_factor(value: float | Tensor, name: str, *tensors: Tensor) -> float:
    """:func:`finite_float`, and finite in the dtype the scores are computed in: float64 when
    an input is float64, else float32 (half-precision inputs score in fp32); ``1e39`` with
    fp32 inputs became inf, and the scores NaN."""
    value = finite_float(value, name)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    if abs(value) > torch.finfo(dtype).max:
        raise ValueError(f"{name} must be finite in {dtype}, the dtype the scores of these "
                         f"inputs are computed in, got {value!r}")
    return value


def exact_repr(value: float) -> str:
    """``value`` for a ``repr``: short (``%g``) where that reads back as the same float, else
    every digit, so that a module rebuilt from its repr computes the same."""
    short = f"{value:g}"
    return short if float(short) == value else repr(float(value))


def finite_float(value: float | Tensor, name: str) -> float:
    """``value`` as a Python float: a real number or a one-element tensor that needs no
    gradient, finite. A tensor that requires grad is refused: the float would drop its
    gradient."""
    if isinstance(value, Tensor):
        if value.requires_grad:
            raise TypeError(f"{name} must be a number, got a tensor that requires grad: its "
                            f"gradient would be lost; multiply the inputs by the learnable "
                            f"factor instead")
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a finite number, got a tensor of shape "
                             f"{list(value.shape)} and dtype {value.dtype}")
        value = value.item()
    check_finite(value, name)
    return float(value)


def check_in_channels(value: int | tuple[int, int]) -> int | tuple[int, int]:
    """``value`` with Python ints; raise unless it is a positive integer or ``-1`` (lazy), or
    a pair of these."""
    pair = value if isinstance(value, (tuple, list)) else (value, value)
    ints = [as_integer(v) for v in pair]
    if len(pair) != 2 or any(v is None or v < -1 or v == 0 for v in ints):
        raise ValueError(f"in_channels must be a positive integer, or -1 to infer it from the "
                         f"first call (or a pair of these), got {value!r}")
    return tuple(ints) if isinstance(value, (tuple, list)) else ints[0]
