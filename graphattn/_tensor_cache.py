"""Values derived from a tensor, kept for as long as that tensor lives unmodified.

A training loop passes the same ``edge_index`` at every step. What the fused GPU path derives
from it (the bounds that ``check_edge_index`` reads back, which costs a host synchronisation on
CUDA, and the CSR orderings, which cost a sort of E entries each) is then the same at every
step; :class:`TensorCache` keeps it, keyed by the tensor object itself.

An entry is valid while its tensor is the same object with the same storage, shape and strides
and the same version counter, which every in-place operation bumps (also through views), and
while the tensors of the kept value are unmodified too (a caller may have handed one out).
Writes that torch does not see are not detected: through ``.data``, through memory shared with
numpy or DLPack, through ``untyped_storage()``, through another tensor made to alias its
memory with ``set_`` (``alias.set_(edge_index)``: the two do not share a version counter), by a
custom kernel, or by ``torch.distributed``
(``broadcast``, ``recv``, ``all_gather`` into a tensor, DDP's buffer sync: the collectives fill
their tensors without a version bump). After such a write into an ``edge_index`` the caches
have seen, call :func:`clear_graph_caches`, or pass a new tensor. The entry is dropped when its
tensor is freed.

Values are kept per CUDA stream: work on a side stream derives its own.

An entry holds a weak reference to its tensor, and ``torch.utils.swap_tensors`` refuses a tensor
that has one: ``load_state_dict`` and ``module.to()`` swap a model's buffers under
``torch.__future__.set_swap_module_params_on_conversion(True)``, so with that setting, call
:func:`clear_graph_caches` first for an ``edge_index`` kept as a buffer.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")

# Where the caches apply. On CPU a re-check or a sort costs little next to the kernels, and
# tensors there often share memory with numpy arrays, whose writes torch does not see.
CACHED_DEVICE_TYPES = {"cuda"}


def _fingerprint(tensor: Tensor) -> tuple:
    """What must not change for a cached value of ``tensor`` to stay valid."""
    return (tensor._version, tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()),
            tensor.dtype, tensor.device)


def _value_versions(value: object) -> tuple[int, ...]:
    """The version counters of the tensors in ``value`` (a tuple, or an object's attributes)."""
    items = value if isinstance(value, (tuple, list)) else getattr(value, "__dict__", {}).values()
    return tuple(t._version for t in items if isinstance(t, Tensor))


def _stream(tensor: Tensor) -> int | None:
    """The CUDA stream a value derived from ``tensor`` is computed on now (``None`` off CUDA).
    Each stream keeps its own values: a value made on one stream and read on another would
    need an event to wait for it, and the allocator would hand its memory back to the first
    stream when the cache drops it, while the other's kernels may still read it."""
    return torch.cuda.current_stream(tensor.device).cuda_stream if tensor.is_cuda else None


def capturing_cuda_graph() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def cacheable(tensor: Tensor) -> bool:
    """Whether :class:`TensorCache` keys on ``tensor``: a plain tensor on a device type of
    ``CACHED_DEVICE_TYPES`` (CUDA), outside tracing and CUDA graph capture.

    Not while ``torch.compile`` traces (fake tensors), not under ``torch.func``'s transforms
    (``grad``, ``vmap``... wrap every tensor argument, the graph included, in a tensor without
    storage), not for inference tensors (they have no version counter) and not for tensor
    subclasses. Not while a CUDA graph is captured either: a
    replay runs the recorded kernels only, so a value served from the cache at capture would
    stay in the graph after its tensor's contents change (``static.copy_(new)`` between
    replays), where what is computed at capture is recorded and recomputed at every replay.
    """
    return (type(tensor) is Tensor and tensor.device.type in CACHED_DEVICE_TYPES
            and not torch.compiler.is_compiling() and not tensor.is_inference()
            and not capturing_cuda_graph() and not torch._C._are_functorch_transforms_active())


_CACHES: weakref.WeakSet[TensorCache] = weakref.WeakSet()  # every TensorCache, for clearing


def clear_graph_caches() -> None:
    """Drop every value kept from a graph's tensors.

    That is the CSR orderings of the ``triton`` backend, the bounds that the edge-index check
    read back, the int64 copies of int32 graphs, and the graphs with self-loops of
    :class:`~graphattn.nn.GraphSelfAttention` (CUDA tensors only). Their memory is freed, and
    the tensors lose the weak references their entries held, which
    ``torch.utils.swap_tensors`` refuses. The next call on a graph computes them again. Call
    it too after writing a new graph into a kept ``edge_index`` in a way torch does not count
    (``torch.distributed``'s collectives, ``.data``, numpy, the storage), which the caches
    cannot detect.
    """
    for cache in list(_CACHES):
        cache.clear()


class TensorCache(Generic[T]):
    """At most ``max_entries`` values, each computed once from a tensor and extra hashable
    arguments, the least recently used dropped first.

    Args:
        max_entries (int): the most values kept at once.
    """

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        # key -> (weak reference to the tensor, its fingerprint, value, the value's versions)
        self._entries: OrderedDict[tuple, tuple[weakref.ref, tuple, T, tuple]] = OrderedDict()
        # reentrant: dropping a value may free the tensor of another entry, whose callback locks
        self._lock = threading.RLock()
        _CACHES.add(self)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()

    def get(self, tensor: Tensor, extra: Hashable, compute: Callable[[], T]) -> T:
        """The value for ``(tensor, extra)``: the kept one when ``tensor`` and the value's
        tensors are unchanged since it was computed, else ``compute()`` (kept, when
        :func:`cacheable` allows)."""
        if not cacheable(tensor):
            return compute()
        key = (id(tensor), extra, _stream(tensor))
        fingerprint = _fingerprint(tensor)
        with self._lock:
            entry = self._entries.get(key)
            if (entry is not None and entry[0]() is tensor and entry[1] == fingerprint
                    and _value_versions(entry[2]) == entry[3]):
                self._entries.move_to_end(key)
                return entry[2]
        # Outside inference mode even within it: an inference tensor kept now could not be
        # saved for backward by a later training step, nor carry a version counter.
        with torch.inference_mode(False):
            value = compute()
        entries, lock = self._entries, self._lock

        def forget(ref: weakref.ref, key: tuple = key) -> None:
            # the tensor is freed; drop its entry unless a newer reference replaced it
            with lock:
                if key in entries and entries[key][0] is ref:
                    del entries[key]

        with lock:
            entries[key] = (weakref.ref(tensor, forget), fingerprint, value,
                            _value_versions(value))
            entries.move_to_end(key)
            while len(entries) > self.max_entries:
                entries.popitem(last=False)
        return value
