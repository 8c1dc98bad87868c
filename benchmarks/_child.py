"""Run one timed call in a fresh process, with a time limit and an address-space limit."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import resource
import time
from collections.abc import Callable
from typing import Any


def _run(target: Callable[..., Any], args: tuple, memory_limit: int | None, results) -> None:
    if memory_limit is not None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    try:
        value = target(*args)
    except MemoryError:
        results.put(("out of memory", None))
    except RuntimeError as error:  # torch's allocators raise RuntimeError
        message = str(error)
        if "allocate" in message or "bad_alloc" in message:
            results.put(("out of memory", None))
        else:
            results.put((f"failed: {message.splitlines()[0] if message else type(error)}",
                         None))
    else:
        results.put(("ok", value))


def call_in_child(target: Callable[..., Any], args: tuple, timeout: float, *,
                  memory_limit: int | None = None) -> tuple[str, Any]:
    """``target(*args)`` in a child process: ``("ok", result)``, ``("timeout", None)`` past
    ``timeout`` seconds, ``("out of memory", None)`` when an allocation fails under
    ``memory_limit`` bytes of address space (``RLIMIT_AS``), or ``("failed: <message>", None)``
    for another ``RuntimeError``.

    The child forks from a server process that has imported what
    ``multiprocessing.set_forkserver_preload`` named and run nothing (a plain fork of this
    process could inherit a BLAS or OpenMP lock held by one of its threads). ``target`` must be
    a module-level function. The result is read while the child runs, so it may be large.

    Raises:
        RuntimeError: the child died without a result (another exception, or a signal).
    """
    ctx = mp.get_context("forkserver")
    results = ctx.Queue()
    proc = ctx.Process(target=_run, args=(target, args, memory_limit, results))
    proc.start()
    deadline = time.monotonic() + timeout
    while True:
        alive = proc.is_alive()  # before the read: a result put just before exit is seen
        try:
            outcome = results.get(timeout=0.1)
        except queue_module.Empty:
            if not alive:
                proc.join()
                raise RuntimeError(f"{getattr(target, '__name__', target)} exited with "
                                   f"{proc.exitcode} and no result") from None
            if time.monotonic() > deadline:
                proc.kill()
                proc.join()
                return "timeout", None
            continue
        proc.join()
        return outcome
