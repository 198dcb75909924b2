"""Process exit after TorchScript forks: wait until torch's inter-op pool is idle before Python finalizes.

A scripted model that forks (``torch.jit.fork``: the sharded collection's devices, a CPU kernel's example
ranges) finishes on torch's inter-op threads after its caller has the result: a forked task completes its
future, then drops its frame, and a ``torch.jit.wait`` that found a future still running resumes the
caller's remaining code on a pool thread, which completes the call's future (the output Python receives)
and destroys it only afterwards. Those references include tensors Python holds (the inputs, the output);
since torch 2.10 dropping the second-last reference of such a tensor decrefs its PyObject, holding the GIL.
When the main thread is finalizing by then, CPython ends the thread asking for the GIL with
``pthread_exit``, whose unwinding through torch's ``noexcept`` destructor calls ``std::terminate``: the
process aborts ("terminate called without an active exception", exit code -6 / 134) after its work is done.

``drain_at_exit`` (called for every TorchScript model loaded or scripted) registers an ``atexit`` hook that
runs one task per inter-op thread, all meeting at a barrier: they can only run together once every thread
has finished and destroyed its earlier tasks, so nothing of a model's call is left to drop a tensor while
Python finalizes.
"""

# no ``from __future__ import annotations``: TorchScript reads the scripted functions' annotations
import atexit
import logging
import os
import threading
import warnings
from typing import Any

import torch

logger = logging.getLogger(__name__)

# a thread still busy after this long (a task that never ends) is left to itself; the exit goes on
DRAIN_TIMEOUT_S = 60.0

_registered_pid = 0  # the process that registered the hook: a fork()ed child has none of its pool threads
_register_lock = threading.Lock()
_barrier: threading.Barrier | None = None


@torch.jit.ignore  # type: ignore[misc]
def _meet() -> int:
    """One inter-op task: wait until a task runs on every inter-op thread."""
    barrier = _barrier
    if barrier is not None:
        barrier.wait()
    return 1


def _task(index: int) -> int:
    # TorchScript forks a scripted function taking arguments (a bare or ignored one fails to compile)
    return _meet() + index * 0


def _occupy_all(threads: int) -> int:
    futures: list[torch.jit.Future[int]] = []
    for index in range(threads):
        futures.append(torch.jit.fork(_task, index))
    met = 0
    for future in futures:
        met += torch.jit.wait(future)
    return met


def drain_inter_op_pool(timeout_s: float = DRAIN_TIMEOUT_S) -> bool:
    """Return once every thread of torch's inter-op pool finished (and destroyed) the tasks it had; False
    when one was still busy after ``timeout_s``. Called from the main thread with no model call running."""
    global _barrier
    threads = torch.get_num_interop_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch >= 2.11 warns that TorchScript is deprecated
        occupy: Any = torch.jit.script(_occupy_all)
    _barrier = threading.Barrier(threads, timeout=timeout_s)
    try:
        occupy(threads)  # releases the GIL while it waits: the pool threads take it to meet
    except Exception as err:  # noqa: BLE001 - a broken barrier comes back as TorchScript's RuntimeError
        logger.warning("torch's inter-op threads still busy after %.0f s at exit: %s", timeout_s, err)
        return False
    finally:
        _barrier = None
    return True


def _drain_at_exit() -> None:
    if os.getpid() == _registered_pid:
        drain_inter_op_pool()


def drain_at_exit() -> None:
    """Make this process wait for torch's inter-op pool to go idle before the interpreter finalizes (once)."""
    global _registered_pid
    with _register_lock:
        if _registered_pid == 0:
            atexit.register(_drain_at_exit)
            _registered_pid = os.getpid()
