"""What the numba kernels of the CPU path share: ``ParallelKernel`` and the
integer helpers.

Each family's kernel lives in its family's module, beside its struct. It
takes, by name, the fields of that struct that it reads, a field group as its
record (``params.QueryLayout``, ...), as ``launch.Launch.run_cpu`` hands them:
arrays the ops already checked, as ``host.kernel_view`` and
``kernel_view_flat`` give them (1-D, contiguous and writable; a 2-D array as its
flat view, its row stride a field of its own), so any row stride or
read-only input hits a signature ``warmup()`` compiled, and ints as int64.
An absent array (a null pointer on the GPU) is an empty one. Integer division
of possibly negative values truncates toward zero, as vLLM's Triton kernels
do (C semantics), through ``div_trunc``. Values stored as int32 are cast with
``np.int32``, which wraps like the kernels' 32-bit arithmetic. Row loops that
can be long are ``ParallelKernel``s (a serial twin in forked children); they
take every array out of its record before their ``prange`` loop: numba's
parallel lowering loses the writes to an array reached through a tuple
inside the loop.
"""
from __future__ import annotations

import os
import threading
import types

import numba
import numpy as np
from numba import njit

_process = {"forked": False, "layer": None}
_first_parallel_call = threading.Lock()


def _after_fork_in_child() -> None:
    _process["forked"] = True


os.register_at_fork(after_in_child=_after_fork_in_child)


class ParallelKernel:
    """A numba kernel whose loop is a ``prange``, compiled twice: parallel, and
    serial for where parallel is unsafe.

    * In a forked child (pre-forking servers, ``multiprocessing`` with fork),
      GNU OpenMP aborts the process ("fork() called from a process already
      using GNU OpenMP"): the serial twin runs there.
    * Under numba's ``workqueue`` threading layer (no OpenMP or TBB), concurrent
      calls abort ("Concurrent access has been detected"): calls are serialised.
    """

    def __init__(self, function):
        self.parallel = njit(cache=True, parallel=True)(function)
        # A renamed copy: numba's disk cache is keyed by the function's name.
        serial = types.FunctionType(function.__code__, function.__globals__,
                                    function.__name__ + "_serial", function.__defaults__)
        serial.__qualname__ = function.__qualname__ + "_serial"
        self.serial = njit(cache=True)(serial)
        self.function = function
        self.__doc__ = function.__doc__
        self.__name__ = function.__name__
        self._lock = threading.Lock()

    def __call__(self, **arguments):
        if _process["forked"]:
            return self.serial(**arguments)
        layer = _process["layer"]
        if layer is None:
            with _first_parallel_call:     # the layer is known after the first parallel run
                result = self.parallel(**arguments)
                _process["layer"] = numba.threading_layer()
            return result
        if layer == "workqueue":
            with self._lock:
                return self.parallel(**arguments)
        return self.parallel(**arguments)

    def variants(self):
        """Both compiled twins (for warm-up)."""
        return self.parallel, self.serial


@njit(cache=True, inline="always")
def div_trunc(a, b):
    """C-style a / b for b > 0 (numba's // floors)."""
    return -((-a) // b) if a < 0 else a // b


@njit(cache=True, inline="always")
def guessed_round(qsl, num_reqs, t, guess, lo, hi):
    """One round of request_of: ``(taken, lo, hi)``, the guess taken when
    qsl[guess] <= t < qsl[guess + 1] (or qsl[guess] <= t for the last request),
    else [lo, hi] narrowed by the search's probe (common.cuh's guessed_round)."""
    mid = (lo + hi) // 2
    if qsl[guess] <= t and (t < qsl[guess + 1] or guess == num_reqs - 1):
        return True, guess, hi
    if qsl[mid + 1] <= t:
        return False, mid + 1, hi
    return False, lo, mid


@njit(cache=True, inline="always")
def request_of(qsl, num_reqs, t):
    """The first i with qsl[i + 1] > t, else num_reqs - 1: request t, then
    request t // qsl[1] when qsl[1] > 1, each taken when it holds t (the last
    request: when t is at or past its start), else a
    binary search that never tests request num_reqs - 1, as the device
    kernel's (request_of, common.cuh: the same answer for a garbage qsl too)."""
    t = np.int64(t)                 # a prange index is unsigned
    lo = np.int64(0)
    hi = np.int64(num_reqs) - 1
    if lo < hi:
        first_len = np.int64(qsl[1])
        taken, lo, hi = guessed_round(qsl, num_reqs, t, t if t < hi else hi, lo, hi)
        if taken:
            return lo
        if first_len > 1 and lo < hi:
            guess = num_reqs - 1 if t >> 32 else t // first_len
            taken, lo, hi = guessed_round(qsl, num_reqs, t, min(guess, num_reqs - 1), lo, hi)
            if taken:
                return lo
    while lo < hi:
        mid = (lo + hi) // 2
        if qsl[mid + 1] <= t:
            lo = mid + 1
        else:
            hi = mid
    return min(lo, num_reqs - 1)


@njit(cache=True, inline="always")
def page_state(entries, row_stride, cols, num_pages, block_size, b, position):
    """The cache page and state holding position ``position`` of block-table row
    b (``entries`` flat, rows ``row_stride`` apart); page -1 when its column is
    past the row's ``cols`` or its entry outside the ``num_pages`` pages."""
    column = position // block_size
    if column >= cols:
        return -1, 0
    page = int(entries[b * row_stride + column])
    if page < 0 or page >= num_pages:
        return -1, 0
    return page, position - column * block_size


@njit(cache=True, inline="always")
def dcp_local_rows(n, world, rank, interleave):
    """Rows among 0..n-1 that rank ``rank`` of ``world`` holds, ``interleave`` at a
    time round robin (the kernels' dcp_local_rows, vLLM's get_dcp_local_seq_lens)."""
    if world == 1:
        return n
    per_rank = n // interleave // world * interleave
    return per_rank + min(max(n - per_rank * world - rank * interleave, 0), interleave)


@njit(cache=True, inline="always")
def gather_len(query_len, seq_len, window_size, replay_start=0):
    """Raw tokens a prefill request gathers: q + min(max(L - q - replay, 0), W - 1)."""
    return query_len + min(max(seq_len - query_len - replay_start, 0), window_size - 1)
