"""The CPU path: numba kernels, one per op, shaped like the CUDA ones.

They receive arrays that the ops already checked (numpy views; torch CPU memory
arrives through DLPack) and scalars already typed as np.int64. Integer division
of possibly negative values truncates toward zero, as the seed's Triton kernel
does (C semantics), through ``_div_trunc``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange


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
def compressed_slot_mapping(qsl, seq_lens, block_table, block_size, compress_ratio,
                            cp_world_size, cp_rank, cp_interleave, out):
    """Fills all of ``out`` with -1, then writes each group-closing token's slot.

    Block-table entries are read clamped at 0; a block index past the table's
    row is treated as "no slot" (-1) instead of reading the next row.
    """
    out[:] = -1
    num_rows, num_cols = block_table.shape
    virtual_block = block_size * cp_world_size
    for b in range(num_rows):
        qs = np.int64(qsl[b])
        query_len = np.int64(qsl[b + 1]) - qs
        start = np.int64(seq_lens[b]) - query_len
        for j in range(query_len):
            idx = qs + j
            pos = start + j
            if idx < 0 or idx >= out.shape[0] or pos < 0 or (pos + 1) % compress_ratio != 0:
                continue
            c = pos // compress_ratio
            blk = c // virtual_block
            v = c - blk * virtual_block
            if (v // cp_interleave) % cp_world_size != cp_rank or blk >= num_cols:
                continue
            off = (v // (cp_world_size * cp_interleave)) * cp_interleave + v % cp_interleave
            out[idx] = np.int64(max(block_table[b, blk], 0)) * block_size + off


@njit(cache=True, parallel=True)
def c128a_topk_metadata(positions, compress_ratio, num_decode_tokens, token_to_req, block_table,
                        block_size, slot_mapping, width, global_decode, decode_lens, prefill):
    """Rows of ``width`` columns: decode rows get global slot ids and a length,
    prefill rows get local indices; -1 past the visible count."""
    num_cols = block_table.shape[1]
    for t in prange(positions.shape[0]):
        n = min(_div_trunc(np.int64(positions[t]) + 1, compress_ratio), width)
        valid = max(n, 0)
        if t < num_decode_tokens:
            req = token_to_req[t]
            row = global_decode[t]
            for e in range(valid):
                # int32 product as in the seed (wraps the same way); column
                # clamped so a garbage position cannot read past the row.
                blk = block_table[req, min(e // block_size, num_cols - 1)]
                row[e] = np.int32(blk * block_size + e % block_size)
            row[valid:width] = -1
            decode_lens[t] = valid if slot_mapping[t] >= 0 else 0
        else:
            row = prefill[t - num_decode_tokens]
            for e in range(valid):
                row[e] = e
            row[valid:width] = -1
