"""The CPU path: numba kernels, one per op, shaped like the CUDA ones.

They receive arrays that the ops already checked, as ``arrays.kernel_view`` and
``kernel_view_2d`` give them: 1-D, contiguous and writable (torch CPU memory
arrives through DLPack), a 2-D array as its flat view plus its row stride, so
any row stride or read-only input hits a signature ``warmup()`` compiled.
Scalars are already typed as np.int64 (or bool). Integer division
of possibly negative values truncates toward zero, as the seed's Triton kernel
does (C semantics), through ``_div_trunc``. Values stored as int32 are cast
with ``np.int32``, which wraps like the kernels' 32-bit arithmetic. Row loops
that can be long are ``ParallelKernel``s (a serial twin in forked children).
``KERNELS`` lists every kernel; ``cpu_warm`` compiles each of them.
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
        self.__name__ = function.__name__
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


# --- the per-layer and indexer ops (kernels/{swa,global_topk,short_context,combine,
# prefill_gather,indexer_prefill,indexer_decode}.cu) ------------------------------------------
@ParallelKernel
def swa_indices_and_lens(qsl, num_reqs, seq_lens, token_to_req, is_valid_token, table,
                         table_stride, table_rows, table_cols, block_size, window_size,
                         token_offset, num_rows, indices, indices_stride, lens):
    """Row i (token i + token_offset): the SWA slots of the last min(p + 1, W)
    positions, -1 after; an invalid token, a request outside the table or
    seq_lens, or p < 0 gives an all -1 row and length 0; positions past the
    table row's blocks are -1 and not counted."""
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
            indices[row + k] = np.int32(table[b * table_stride + at // block_size] * block_size
                                        + at % block_size)
        indices[row + count:row + window_size] = -1
        lens[i] = count


@ParallelKernel
def global_topk_indices_and_lens(topk, topk_stride, num_tokens, width, token_to_req,
                                 is_valid_token, table, table_stride, table_rows, table_cols,
                                 block_size, compact, out, out_stride, lens):
    """Local compressed rows to global slots; -1 (not counted) for x < 0 or a
    block column past the table row. In place (out is topk) is safe: entry k is
    read before anything at or below k is written."""
    for t in prange(num_tokens):
        req = np.int64(token_to_req[t])
        source = t * topk_stride
        target = t * out_stride
        count = 0
        if is_valid_token[t] and 0 <= req < table_rows:
            for k in range(width):
                x = np.int64(topk[source + k])
                if x >= 0 and x // block_size < table_cols:
                    out[target + (count if compact else k)] = np.int32(
                        table[req * table_stride + x // block_size] * block_size + x % block_size)
                    count += 1
                elif not compact:
                    out[target + k] = -1
            if compact:
                out[target + count:target + width] = -1
        else:
            out[target:target + width] = -1
        lens[t] = count


@ParallelKernel
def short_context_topk_indices(positions, num_tokens, top_k, compress_ratio, out, out_stride):
    """Row t: k for k < (p + 1) // ratio (truncating, clamped to [0, top_k]), -1 after."""
    for t in prange(num_tokens):
        n = max(min(_div_trunc(np.int64(positions[t]) + 1, compress_ratio), top_k), 0)
        row = t * out_stride
        for k in range(n):
            out[row + k] = k
        out[row + n:row + top_k] = -1


@ParallelKernel
def combine_topk_swa_indices(topk, topk_stride, qsl, num_reqs, seq_lens, gather_lens,
                             window_size, compress_ratio, topk_count, rows_per_request,
                             swa_offset, num_tokens, width, out, out_stride, lens):
    """The hardened V4.1 combine (see kernels/combine.cu); ``topk_stride < 0``:
    C128A's local prefill rows, ``x = k``, are not read but computed."""
    base = np.int64(qsl[0])
    total = np.int64(qsl[num_reqs]) - base if num_reqs > 0 else 0
    for t in prange(num_tokens):
        row = t * out_stride
        length = 0
        if t < total:
            b = _request_of(qsl, num_reqs, base + t)
            qs = np.int64(qsl[b])
            seq_len = np.int64(seq_lens[b])
            position = seq_len - (np.int64(qsl[b + 1]) - qs) + (base + t - qs)
            topk_len = 0
            if topk_count > 0:
                topk_len = max(min(_div_trunc(position + 1, compress_ratio), topk_count), 0)
            request_base = rows_per_request * b
            for k in range(topk_len):
                x = np.int64(k) if topk_stride < 0 else np.int64(topk[t * topk_stride + k])
                out[row + k] = np.int32(x + request_base) if 0 <= x < swa_offset else -1
            gather_start = seq_len - gather_lens[b]
            swa_start = max(position - window_size + 1, 0, gather_start)
            swa_len = max(position - swa_start + 1, 0)
            first = request_base + swa_offset + (swa_start - gather_start)
            for i in range(swa_len):
                out[row + topk_len + i] = np.int32(first + i)
            length = topk_len + swa_len
        out[row + length:row + width] = -1
        lens[t] = length


@njit(cache=True)
def prefill_gather_lens(qsl, seq_lens, num_decodes, num_prefills, window_size, out):
    """Prefill i (request num_decodes + i): q + min(max(L - q, 0), W - 1)."""
    for i in range(num_prefills):
        b = num_decodes + i
        query_len = np.int64(qsl[b + 1]) - np.int64(qsl[b])
        prefix = np.int64(seq_lens[b]) - query_len
        out[i] = query_len + min(max(prefix, 0), window_size - 1)


@njit(cache=True)
def indexer_prefill_chunk_metadata(qsl, num_reqs, seq_lens, compress_ratio, slice_start,
                                   slice_stop, cu_compressed, token_to_seq, seqlen_ks, seqlen_ke):
    """cu_compressed, token_to_seq (-1 past the total), ks/ke of the query slice
    (ks = ke = total past the chunk's last token); see kernels/indexer_prefill.cu."""
    base = np.int64(qsl[0])
    num_compressed = token_to_seq.shape[0]
    first_row = np.int64(0)
    for b in range(num_reqs):
        cu_compressed[b] = first_row
        seq_len = np.int64(seq_lens[b])
        rows = max(seq_len // compress_ratio, 0)    # floor and truncation agree for L >= 0
        for x in range(first_row, min(first_row + rows, num_compressed)):
            token_to_seq[x] = b
        qs = np.int64(qsl[b]) - base
        qe = np.int64(qsl[b + 1]) - base
        prefix = seq_len - (qe - qs)
        for a in range(max(qs, slice_start), min(qe, slice_stop)):
            seqlen_ks[a - slice_start] = first_row
            seqlen_ke[a - slice_start] = first_row + _div_trunc(prefix + 1 + a - qs,
                                                                compress_ratio)
        first_row += rows
    cu_compressed[num_reqs] = first_row
    token_to_seq[min(first_row, num_compressed):] = -1
    for a in range(max(np.int64(qsl[num_reqs]) - base, slice_start), slice_stop):
        seqlen_ks[a - slice_start] = first_row
        seqlen_ke[a - slice_start] = first_row


@ParallelKernel
def indexer_decode_metadata(qsl, num_reqs, seq_lens, table, table_stride, table_cols,
                            num_tokens, compress_ratio, context_lens, req_ids, decode_lens,
                            block_rows, block_rows_stride):
    """Per token: context length // ratio (0 for padding), request id (distinct
    R + (t - qsl[R]) for padding), decode length 1, block-table row (zeros for
    padding); context_lens is zeroed past num_tokens to its end."""
    mapped = np.int64(qsl[num_reqs])
    for t in prange(num_tokens):
        row = t * block_rows_stride
        if num_reqs > 0 and t < mapped:
            b = _request_of(qsl, num_reqs, t)
            qs = np.int64(qsl[b])
            length = np.int64(seq_lens[b]) - (np.int64(qsl[b + 1]) - qs) + (t - qs) + 1
            context_lens[t] = max(length, 0) // compress_ratio
            req_ids[t] = b
            block_rows[row:row + table_cols] = table[b * table_stride:b * table_stride + table_cols]
        else:
            context_lens[t] = 0
            req_ids[t] = np.int32(num_reqs + (t - mapped))
            block_rows[row:row + table_cols] = 0
        decode_lens[t] = 1
    context_lens[num_tokens:] = 0


#: Every kernel of the CPU path (``warmup(cpu=True)`` compiles each of them).
KERNELS = (token_to_req_indices, compressed_slot_mapping, c128a_topk_metadata,
           swa_indices_and_lens, global_topk_indices_and_lens, short_context_topk_indices,
           combine_topk_swa_indices, prefill_gather_lens, indexer_prefill_chunk_metadata,
           indexer_decode_metadata)
