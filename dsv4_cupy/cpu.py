"""The CPU path: numba kernels, one per kernel family, shaped like the CUDA ones.

Each takes, by name, the fields of its family's CUDA struct (``params.py``)
that it reads, a field group as its record (``params.QueryLayout``, ...), as
``launch.Launch.run_cpu`` hands them: arrays the ops already checked, as
``host.kernel_view`` and ``kernel_view_2d`` give them (1-D, contiguous and
writable; a 2-D array as its flat view, its row stride a field of its own),
so any row stride or read-only input hits a signature ``warmup()``
compiled, and ints as int64. An absent array (a null pointer on the GPU) is
an empty one. Integer division of possibly negative values truncates toward
zero, as vLLM's Triton kernels do (C semantics), through ``_div_trunc``.
Values stored as int32 are cast with ``np.int32``, which wraps like the
kernels' 32-bit arithmetic. Row loops that can be long are
``ParallelKernel``s (a serial twin in forked children); they take every
array out of its record before their ``prange`` loop: numba's parallel
lowering loses the writes to an array reached through a tuple inside the
loop. ``KERNELS`` lists every kernel; ``cpu_warm`` compiles each of them.
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
def _div_trunc(a, b):
    """C-style a / b for b > 0 (numba's // floors)."""
    return -((-a) // b) if a < 0 else a // b


@njit(cache=True, inline="always")
def _request_of(qsl, num_reqs, t):
    """The first i with qsl[i + 1] > t, else num_reqs - 1: a binary search that never
    tests request num_reqs - 1, as the device kernel's (request_of, common.cuh)."""
    lo = 0
    hi = num_reqs - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if qsl[mid + 1] <= t:
            lo = mid + 1
        else:
            hi = mid
    return min(lo, num_reqs - 1)


@njit(cache=True)
def token_to_req_indices(query, out, num_tokens):
    qsl, num_reqs = query.query_start_loc, query.num_reqs
    num_mapped = qsl[num_reqs] if num_reqs > 0 else 0
    for t in range(num_tokens):
        out[t] = _request_of(qsl, num_reqs, t) if t < num_mapped else 0


@njit(cache=True)
def compressed_slot_mapping(query, table, geometry, token_slots, out, num_tokens):
    """Fills all of ``out`` with -1, then writes each group-closing token's slot.

    Only tokens below ``min(num_tokens, len(out))`` get a slot, so the loop is
    bounded by the output whatever the query layout says. Block-table entries
    are read clamped at 0; a block index past the table's row is "no slot".
    With ``token_slots`` (not empty; single rank only), a token whose own slot
    is negative gets no compressed slot either.
    """
    out[:] = -1
    qsl, seq_lens = query.query_start_loc, query.seq_lens
    block_size, ratio = geometry.block_size, geometry.ratio
    world, interleave = geometry.cp_world_size, geometry.cp_interleave
    virtual_block = block_size * world
    limit = min(num_tokens, out.shape[0])
    own_slot_rule = token_slots.shape[0] > 0 and world == 1
    for b in range(table.rows):
        qs = np.int64(qsl[b])
        qe = np.int64(qsl[b + 1])
        start = np.int64(seq_lens[b]) - (qe - qs)
        for idx in range(max(qs, 0), min(qe, limit)):
            pos = start + (idx - qs)
            if pos < 0 or (pos + 1) % ratio != 0:
                continue
            if own_slot_rule and token_slots[idx] < 0:
                continue
            c = pos // ratio
            blk = c // virtual_block
            v = c - blk * virtual_block
            if (v // interleave) % world != geometry.cp_rank or blk >= table.cols:
                continue
            off = (v // (world * interleave)) * interleave + v % interleave
            entry = np.int64(table.entries[b * table.row_stride + blk])
            out[idx] = max(entry, 0) * block_size + off


@njit(cache=True, inline="always")
def _owned_rows(n, geometry):
    """Rows among 0..n-1 owned by ``geometry.cp_rank`` (the kernels' owned_rows)."""
    world, interleave = geometry.cp_world_size, geometry.cp_interleave
    if world == 1:
        return n
    per_rank = n // interleave // world * interleave
    return per_rank + min(max(n - per_rank * world - geometry.cp_rank * interleave, 0), interleave)


@ParallelKernel
def c128a_topk_metadata(positions, token_to_req, slot_mapping, table, geometry, rows,
                        num_tokens, num_decode_tokens):
    """Rows of ``rows.width`` columns: decode rows get global (rank-local under
    DCP) slot ids and a length, prefill rows get local indices; -1 past the
    count. A decode token that is not valid (slot < 0, or t >=
    num_valid_tokens when that is >= 0) or whose request is outside the table
    gets -1 and length 0; rows past the table row's blocks are -1 and not
    counted."""
    block_size, ratio, width = geometry.block_size, geometry.ratio, rows.width
    entries, table_rows, table_cols, table_stride = table
    global_decode, decode_lens, prefill = rows.global_decode, rows.decode_lens, rows.prefill
    decode_stride, prefill_stride = rows.decode_stride, rows.prefill_stride
    num_valid_tokens = rows.num_valid_tokens
    for t in prange(num_tokens):
        n = max(min(_div_trunc(np.int64(positions[t]) + 1, ratio), width), 0)
        if t < num_decode_tokens:
            req = np.int64(token_to_req[t])
            valid = slot_mapping[t] >= 0 if num_valid_tokens < 0 else t < num_valid_tokens
            count = 0
            if valid and 0 <= req < table_rows:
                count = min(_owned_rows(n, geometry), table_cols * block_size)
            row = t * decode_stride
            for e in range(count):
                # int32 product as in vLLM (wraps the same way).
                global_decode[row + e] = np.int32(
                    entries[req * table_stride + e // block_size] * block_size + e % block_size)
            global_decode[row + count:row + width] = -1
            decode_lens[t] = count
        else:
            row = (t - num_decode_tokens) * prefill_stride
            for e in range(n):
                prefill[row + e] = e
            prefill[row + n:row + width] = -1


@ParallelKernel
def swa_indices_and_lens(query, table, token_to_req, is_valid_token, indices, lens,
                         indices_stride, window_size, block_size, token_offset, num_rows):
    """Row i (token i + token_offset): the SWA slots of the last min(p + 1, W)
    positions, -1 after; an invalid token, a request outside the table or
    seq_lens, or p < 0 gives an all -1 row and length 0; positions past the
    table row's blocks are -1 and not counted."""
    qsl, seq_lens, num_reqs = query
    entries, table_rows, table_cols, table_stride = table
    for i in prange(num_rows):
        t = i + token_offset
        b = np.int64(token_to_req[t])
        start = np.int64(0)
        count = np.int64(0)
        if is_valid_token[t] and 0 <= b < num_reqs and b < table_rows:
            qs = np.int64(qsl[b])
            position = np.int64(seq_lens[b]) - (np.int64(qsl[b + 1]) - qs) + (t - qs)
            if position >= 0:
                start = max(position - window_size + 1, 0)
                count = max(min(position + 1 - start, table_cols * block_size - start), 0)
        row = i * indices_stride
        for k in range(count):
            at = start + k
            indices[row + k] = np.int32(
                entries[b * table_stride + at // block_size] * block_size + at % block_size)
        indices[row + count:row + window_size] = -1
        lens[i] = count


@ParallelKernel
def global_topk_indices_and_lens(table, topk_indices, token_to_req, is_valid_token, out, lens,
                                 topk_stride, out_stride, width, num_tokens, block_size,
                                 compact):
    """Local compressed rows to global slots; -1 (not counted) for x < 0 or a
    block column past the table row. In place (out is topk_indices) is safe:
    entry k is read before anything at or below k is written."""
    entries, table_rows, table_cols, table_stride = table
    for t in prange(num_tokens):
        req = np.int64(token_to_req[t])
        source = t * topk_stride
        target = t * out_stride
        count = 0
        if is_valid_token[t] and 0 <= req < table_rows:
            for k in range(width):
                x = np.int64(topk_indices[source + k])
                if x >= 0 and x // block_size < table_cols:
                    out[target + (count if compact else k)] = np.int32(
                        entries[req * table_stride + x // block_size] * block_size
                        + x % block_size)
                    count += 1
                elif not compact:
                    out[target + k] = -1
            if compact:
                out[target + count:target + width] = -1
        else:
            out[target:target + width] = -1
        lens[t] = count


@ParallelKernel
def fill_short_context_topk_indices(positions, out, out_stride, top_k, ratio, num_tokens):
    """Row t: k for k < (p + 1) // ratio (truncating, clamped to [0, top_k]), -1 after."""
    for t in prange(num_tokens):
        n = max(min(_div_trunc(np.int64(positions[t]) + 1, ratio), top_k), 0)
        row = t * out_stride
        for k in range(n):
            out[row + k] = k
        out[row + n:row + top_k] = -1


@njit(cache=True, inline="always")
def _gather_len(query_len, seq_len, window_size):
    """Raw tokens a prefill request gathers: q + min(max(L - q, 0), W - 1)."""
    return query_len + min(max(seq_len - query_len, 0), window_size - 1)


@ParallelKernel
def combine_topk_swa_indices(query, gather_lens, topk_indices, out, lens, topk_stride,
                             out_stride, width, num_tokens, window_size, ratio, topk,
                             rows_per_request, swa_offset):
    """The hardened V4.1 combine (see kernels/combine.cuh). Without
    ``topk_indices`` (empty) the compressed entries are C128A's local prefill
    rows, ``x = k``; without ``gather_lens`` (empty) a request's gather length
    is computed."""
    qsl, seq_lens, num_reqs = query
    first = np.int64(qsl[0])
    total = np.int64(qsl[num_reqs]) - first if num_reqs > 0 else 0
    rule_rows = topk_indices.shape[0] == 0
    for t in prange(num_tokens):
        row = t * out_stride
        length = 0
        if t < total:
            b = _request_of(qsl, num_reqs, first + t)
            qs = np.int64(qsl[b])
            qe = np.int64(qsl[b + 1])
            seq_len = np.int64(seq_lens[b])
            position = seq_len - (qe - qs) + (first + t - qs)
            topk_len = 0
            if topk > 0:
                topk_len = max(min(_div_trunc(position + 1, ratio), topk), 0)
            request_base = rows_per_request * b
            for k in range(topk_len):
                x = np.int64(k) if rule_rows else np.int64(topk_indices[t * topk_stride + k])
                out[row + k] = np.int32(x + request_base) if 0 <= x < swa_offset else -1
            gather_len = (np.int64(gather_lens[b]) if gather_lens.shape[0] > 0
                          else _gather_len(qe - qs, seq_len, window_size))
            gather_start = seq_len - gather_len
            swa_start = max(position - window_size + 1, 0, gather_start)
            swa_len = max(position - swa_start + 1, 0)
            first_row = request_base + swa_offset + (swa_start - gather_start)
            for i in range(swa_len):
                out[row + topk_len + i] = np.int32(first_row + i)
            length = topk_len + swa_len
        out[row + length:row + width] = -1
        lens[t] = length


@njit(cache=True)
def prefill_gather_lens(query, out, num_decodes, num_prefills, window_size):
    """Prefill i (request num_decodes + i): q + min(max(L - q, 0), W - 1)."""
    qsl = query.query_start_loc
    for i in range(num_prefills):
        b = num_decodes + i
        out[i] = _gather_len(np.int64(qsl[b + 1]) - np.int64(qsl[b]),
                             np.int64(query.seq_lens[b]), window_size)


@njit(cache=True)
def indexer_prefill_chunk_metadata(query, cu_compressed, token_to_seq, seqlen_ks, seqlen_ke,
                                   num_compressed, ratio, query_slice_start, query_slice_stop):
    """cu_compressed, token_to_seq (-1 past the total), ks/ke of the query slice
    (ks = ke = total past the chunk's last token); see kernels/indexer_prefill.cuh."""
    qsl, num_reqs = query.query_start_loc, query.num_reqs
    first = np.int64(qsl[0])
    first_row = np.int64(0)
    for b in range(num_reqs):
        cu_compressed[b] = first_row
        seq_len = np.int64(query.seq_lens[b])
        rows = max(seq_len // ratio, 0)    # floor and truncation agree for L >= 0
        for x in range(first_row, min(first_row + rows, num_compressed)):
            token_to_seq[x] = b
        qs = np.int64(qsl[b]) - first
        qe = np.int64(qsl[b + 1]) - first
        prefix = seq_len - (qe - qs)
        for a in range(max(qs, query_slice_start), min(qe, query_slice_stop)):
            seqlen_ks[a - query_slice_start] = first_row
            seqlen_ke[a - query_slice_start] = first_row + _div_trunc(prefix + 1 + a - qs, ratio)
        first_row += rows
    cu_compressed[num_reqs] = first_row
    token_to_seq[min(first_row, num_compressed):num_compressed] = -1
    for a in range(max(np.int64(qsl[num_reqs]) - first, query_slice_start), query_slice_stop):
        seqlen_ks[a - query_slice_start] = first_row
        seqlen_ke[a - query_slice_start] = first_row


@ParallelKernel
def indexer_decode_metadata(query, table, context_lens, req_ids, decode_lens, block_rows,
                            block_rows_stride, num_tokens, context_lens_len, ratio):
    """Per token: context length // ratio (0 for padding), request id (distinct
    R + (t - qsl[R]) for padding), decode length 1, block-table row (zeros for
    padding); context_lens is zeroed past num_tokens to context_lens_len."""
    qsl, seq_lens, num_reqs = query
    entries, _, cols, table_stride = table
    mapped = np.int64(qsl[num_reqs])
    for t in prange(num_tokens):
        row = t * block_rows_stride
        if num_reqs > 0 and t < mapped:
            b = _request_of(qsl, num_reqs, t)
            qs = np.int64(qsl[b])
            length = np.int64(seq_lens[b]) - (np.int64(qsl[b + 1]) - qs) + (t - qs) + 1
            context_lens[t] = max(length, 0) // ratio
            req_ids[t] = b
            source = b * table_stride
            block_rows[row:row + cols] = entries[source:source + cols]
        else:
            context_lens[t] = 0
            req_ids[t] = np.int32(num_reqs + (t - mapped))
            block_rows[row:row + cols] = 0
        decode_lens[t] = 1
    context_lens[num_tokens:context_lens_len] = 0


@njit(cache=True)
def step_validity(swa_slot_mapping, is_valid_out):
    """The step kernel's own output: ``is_valid_out[t] = swa_slot_mapping[t] >= 0``
    for every element of ``is_valid_out`` (its sections run after it)."""
    for t in range(is_valid_out.shape[0]):
        is_valid_out[t] = swa_slot_mapping[t] >= 0


#: Every kernel of the CPU path (``warmup(cpu=True)`` compiles each of them).
KERNELS = (token_to_req_indices, compressed_slot_mapping, c128a_topk_metadata,
           swa_indices_and_lens, global_topk_indices_and_lens, fill_short_context_topk_indices,
           combine_topk_swa_indices, prefill_gather_lens, indexer_prefill_chunk_metadata,
           indexer_decode_metadata, step_validity)
