"""The CPU path of the per-layer and indexer metadata ops (numba), shaped like
``kernels/{swa,global_topk,short_context,combine,prefill_gather,indexer_prefill,
indexer_decode}.cu``.

Same conventions as ``cpu.py``: arrays arrive as ``arrays.kernel_view`` (1-D,
contiguous, writable) and ``kernel_view_2d`` (flat view plus row stride), bool
arrays as numpy bools, scalars as np.int64 (or bool); division of possibly
negative values truncates toward zero (``_div_trunc``). Values stored as int32
are cast with ``np.int32``, which wraps like the kernels' 32-bit arithmetic.
Row loops that can be long are ``ParallelKernel``s (a serial twin in forked
children).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu import ParallelKernel, _div_trunc, _request_of


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
    """The hardened V4.1 combine (see kernels/combine.cu)."""
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
                x = np.int64(topk[t * topk_stride + k])
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
