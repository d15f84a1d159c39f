"""The CPU path: numba kernels, one per op, shaped like the CUDA ones.

They receive arrays that the ops already checked, as ``arrays.kernel_view`` and
``kernel_view_2d`` give them: 1-D, contiguous and writable (torch CPU memory
arrives through DLPack), a 2-D array as its flat view plus its row stride, so
any row stride or read-only input hits a signature ``warmup()`` compiled.
Scalars are already typed as np.int64 (or bool). Integer division
of possibly negative values truncates toward zero, as the seed's Triton kernel
does (C semantics), through ``_div_trunc``.
"""
from __future__ import annotations

import os
import threading
import types

import numba
import numpy as np
from numba import njit, prange

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
        self.__doc__ = function.__doc__
        self._lock = threading.Lock()

    def __call__(self, *args):
        if _process["forked"]:
            return self.serial(*args)
        layer = _process["layer"]
        if layer is None:
            with _first_parallel_call:     # the layer is known after the first parallel run
                result = self.parallel(*args)
                _process["layer"] = numba.threading_layer()
            return result
        if layer == "workqueue":
            with self._lock:
                return self.parallel(*args)
        return self.parallel(*args)

    def variants(self):
        """Both compiled twins (for warm-up)."""
        return self.parallel, self.serial


@njit(cache=True, inline="always")
def _div_trunc(a, b):
    """C-style a / b for b > 0 (numba's // floors)."""
    return -((-a) // b) if a < 0 else a // b


@njit(cache=True, inline="always")
def _request_of(qsl, num_reqs, t):
    """Largest i with qsl[i + 1] > t (binary search, as the device kernel does)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if qsl[mid + 1] <= t:
            lo = mid + 1
        else:
            hi = mid
    return min(lo, num_reqs - 1)


@njit(cache=True)
def token_to_req_indices(qsl, num_tokens, out):
    num_reqs = qsl.shape[0] - 1
    num_mapped = qsl[num_reqs] if num_reqs > 0 else 0
    for t in range(num_tokens):
        out[t] = _request_of(qsl, num_reqs, t) if t < num_mapped else 0


@njit(cache=True)
def compressed_slot_mapping(qsl, seq_lens, table, table_stride, table_rows, table_cols,
                            block_size, compress_ratio, cp_world_size, cp_rank, cp_interleave,
                            num_tokens, token_slots, use_token_slots, out):
    """Fills all of ``out`` with -1, then writes each group-closing token's slot.

    Only tokens below ``min(num_tokens, len(out))`` get a slot, so the loop is
    bounded by the output whatever the query layout says. Block-table entries
    are read clamped at 0; a block index past the table's row is "no slot".
    With ``use_token_slots`` (single rank only), a token whose own slot is
    negative gets no compressed slot either.
    """
    out[:] = -1
    virtual_block = block_size * cp_world_size
    limit = min(num_tokens, out.shape[0])
    own_slot_rule = use_token_slots and cp_world_size == 1
    for b in range(table_rows):
        qs = np.int64(qsl[b])
        qe = np.int64(qsl[b + 1])
        start = np.int64(seq_lens[b]) - (qe - qs)
        for idx in range(max(qs, 0), min(qe, limit)):
            pos = start + (idx - qs)
            if pos < 0 or (pos + 1) % compress_ratio != 0:
                continue
            if own_slot_rule and token_slots[idx] < 0:
                continue
            c = pos // compress_ratio
            blk = c // virtual_block
            v = c - blk * virtual_block
            if (v // cp_interleave) % cp_world_size != cp_rank or blk >= table_cols:
                continue
            off = (v // (cp_world_size * cp_interleave)) * cp_interleave + v % cp_interleave
            entry = np.int64(table[b * table_stride + blk])
            out[idx] = max(entry, 0) * block_size + off


@njit(cache=True, inline="always")
def _owned_rows(n, cp_world_size, cp_rank, cp_interleave):
    """Rows among 0..n-1 owned by ``cp_rank`` (the kernels' owned_rows)."""
    if cp_world_size == 1:
        return n
    base = n // cp_interleave // cp_world_size * cp_interleave
    return base + min(max(n - base * cp_world_size - cp_rank * cp_interleave, 0), cp_interleave)


@ParallelKernel
def c128a_topk_metadata(positions, compress_ratio, num_decode_tokens, token_to_req, table,
                        table_stride, table_rows, table_cols, block_size, slot_mapping, width,
                        global_decode, decode_stride, decode_lens, prefill, prefill_stride,
                        cp_world_size, cp_rank, cp_interleave, num_valid_tokens):
    """Rows of ``width`` columns: decode rows get global (rank-local under DCP)
    slot ids and a length, prefill rows get local indices; -1 past the count.
    A decode token that is not valid (slot < 0, or t >= num_valid_tokens when
    that is >= 0) or whose request is outside the table gets -1 and length 0;
    rows past the table row's blocks are -1 and not counted."""
    for t in prange(positions.shape[0]):
        n = max(min(_div_trunc(np.int64(positions[t]) + 1, compress_ratio), width), 0)
        if t < num_decode_tokens:
            req = np.int64(token_to_req[t])
            valid = slot_mapping[t] >= 0 if num_valid_tokens < 0 else t < num_valid_tokens
            count = 0
            if valid and 0 <= req < table_rows:
                count = min(_owned_rows(n, cp_world_size, cp_rank, cp_interleave),
                            table_cols * block_size)
            row = t * decode_stride
            for e in range(count):
                # int32 product as in the seed (wraps the same way).
                global_decode[row + e] = np.int32(
                    table[req * table_stride + e // block_size] * block_size + e % block_size)
            global_decode[row + count:row + width] = -1
            decode_lens[t] = count
        else:
            row = (t - num_decode_tokens) * prefill_stride
            for e in range(n):
                prefill[row + e] = e
            prefill[row + n:row + width] = -1
