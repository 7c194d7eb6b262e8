"""Which thread of a server process runs torch's CPU threads.

torch's CPU ops and the native step run on OpenMP. libgomp gives every OS thread that
starts a parallel region its own pool of worker threads, and it sizes its barriers'
busy-wait by how many threads all pools hold together: once they outnumber the cores it
waits only briefly and then sleeps on a futex. The native step meets dozens of barriers a
layer, so a second pool on a 2-core machine slows every decode step, even when that pool
sits idle. A server loads its model on the main thread (one pool) and decodes on the
engine thread (a second): so the thread that starts the engine hands its pool over
(:func:`hand_over_cpu_threads`), the engine thread takes the CPU threads
(:func:`take_cpu_threads`), and helper threads that touch torch (image decoding) run
single-threaded (:func:`run_single_threaded`) so they never build a pool of their own.

``torch.set_num_threads`` is not the tool for the helpers: it also sets torch's
process-wide count, which the engine's step reads. OpenMP's own ``omp_set_num_threads``
sets the calling thread's count only, so this module calls it on torch's libgomp.
Where torch runs on no libgomp that this module can find, every function is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading

import torch

LOG = logging.getLogger(__name__)

_OPENMP_RUNTIMES = ("libgomp", "libiomp5", "libomp")


# per thread: how many CPU threads it had before it handed them over, and how many engines it started since
_handed = threading.local()


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """torch's OpenMP runtime, already loaded in this process (None if there is none to find)."""
    path = _loaded_openmp_path()
    if path is None:
        return None
    try:
        runtime = ctypes.CDLL(path)  # the same handle the loader already holds: no second copy
        runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
        runtime.omp_get_max_threads.restype = ctypes.c_int
        return runtime
    except (OSError, AttributeError) as err:
        LOG.debug("no OpenMP runtime to steer threads with (%s): thread placement left to torch", err)
        return None


def _loaded_openmp_path() -> str | None:
    """The path of the OpenMP runtime torch uses: the one in torch's own directory if several are loaded."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return None  # not Linux: torch's runtime stays as it is
    runtimes = sorted(p for p in paths if os.path.basename(p).startswith(_OPENMP_RUNTIMES))
    torch_dir = os.path.dirname(torch.__file__)
    # other wheels bundle their own copy (sentencepiece, for one); torch's is the one its ops use
    ours = [p for p in runtimes if p.startswith(torch_dir)]
    return (ours or runtimes or [None])[0]


def run_single_threaded() -> None:
    """Make the calling thread's torch ops run on it alone; other threads keep their counts.

    Use as a ``ThreadPoolExecutor`` initializer for helpers that touch torch beside the engine.
    """
    torch.get_num_threads()  # torch sets each thread's count on its first op: let that happen first, not after
    runtime = _openmp()
    if runtime is not None:
        runtime.omp_set_num_threads(1)


def take_cpu_threads(threads: int) -> None:
    """Make the calling thread run torch's ops (and the native step) on ``threads`` CPU threads.

    Only this thread's count changes: threads started later still begin from torch's process-wide one.
    """
    torch.get_num_threads()  # torch sets each thread's count on its first op: let that happen first, not after
    runtime = _openmp()
    if runtime is not None:
        runtime.omp_set_num_threads(threads)
    elif torch.get_num_threads() != threads:
        torch.set_num_threads(threads)  # no runtime to address one thread: the process-wide count it is


def hand_over_cpu_threads() -> int:
    """Free the calling thread's idle OpenMP pool, keep it from building another, and say how many threads to take.

    Call on the thread that loaded the model just before another thread (the engine's) starts
    decoding; that thread then calls :func:`take_cpu_threads` with the number returned (the
    count the calling thread had). Pair each call with :func:`take_back_cpu_threads` on the
    same thread once the engine thread has ended; calls nest (several engines started from one thread).
    """
    if getattr(_handed, "depth", 0) > 0:
        _handed.depth += 1
        return _handed.threads
    threads = torch.get_num_threads()
    runtime = _openmp()
    if runtime is not None and threads > 1 and _pause_pool(runtime):
        runtime.omp_set_num_threads(1)
    _handed.threads, _handed.depth = threads, 1
    return threads


def _pause_pool(runtime: ctypes.CDLL) -> bool:
    """Free the calling thread's idle worker threads (OpenMP 5.0's soft pause; libgomp 9 and later)."""
    pause = getattr(runtime, "omp_pause_resource_all", None)
    if pause is None or not os.path.basename(runtime._name).startswith("libgomp"):
        # An older runtime, or LLVM's or Intel's, whose pause reaches every thread's pool, not this
        # thread's alone: the pool stays, but the thread still stops using it.
        return True
    pause.argtypes = [ctypes.c_int]
    return pause(1) == 0  # 1 = omp_pause_soft; nonzero inside a parallel region, where nothing may change


def take_back_cpu_threads() -> None:
    """Undo :func:`hand_over_cpu_threads` on the thread that called it, once its engine thread has ended."""
    depth = getattr(_handed, "depth", 0)
    if depth == 0:
        return
    _handed.depth = depth - 1
    runtime = _openmp()
    if _handed.depth == 0 and runtime is not None:
        runtime.omp_set_num_threads(_handed.threads)
