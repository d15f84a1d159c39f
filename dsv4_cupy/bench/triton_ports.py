"""Triton ports of vLLM's DeepSeek-V4 metadata kernels, the benchmark's comparison
column (never used by the library). Written from the semantics of vLLM's
DeepSeek-V4 code, in vLLM's shape: one program per row (SWA rows, global
top-k, short-context fill) and a (requests, 256 workers) grid for the combine
(#52084) that writes its own -1 tail (#50298) and keeps the hardened
``0 <= x < N`` filter. Valid
inputs give the library's bytes. Import this module only where Triton is
installed (GPU machines): the benchmark does so lazily.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: Columns a program handles per step (upstream tiles rows by 1024).
TILE = 1024
#: Programs per request of the combine (#52084 raised it from 128 to 256).
COMBINE_WORKERS = 256


@triton.jit
def _swa_indices_kernel(indices_ptr, lens_ptr, indices_stride, qsl_ptr, seq_ptr, t2r_ptr,
                        valid_ptr, table_ptr, table_stride, token_offset,
                        WINDOW: tl.constexpr, PADDED_WINDOW: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr):
    i = tl.program_id(0)
    t = i + token_offset
    valid = tl.load(valid_ptr + t).to(tl.int32) != 0
    b = tl.load(t2r_ptr + t)
    qs = tl.load(qsl_ptr + b)
    position = tl.load(seq_ptr + b) - (tl.load(qsl_ptr + b + 1) - qs) + (t - qs)
    start = tl.maximum(position - WINDOW + 1, 0)
    count = tl.where(valid, position - start + 1, 0)
    tl.store(lens_ptr + i, count)
    k = tl.arange(0, PADDED_WINDOW)
    at = start + k
    inside = k < count
    block = tl.load(table_ptr + b.to(tl.int64) * table_stride + at // BLOCK_SIZE, mask=inside,
                    other=0)
    value = tl.where(inside, block * BLOCK_SIZE + at % BLOCK_SIZE, -1)
    # Upstream leaves an invalid token's row stale; the safer port writes -1 (same bytes).
    tl.store(indices_ptr + i.to(tl.int64) * indices_stride + k, value, mask=k < WINDOW)


@triton.jit
def _global_topk_kernel(out_ptr, lens_ptr, topk_ptr, topk_stride, out_stride, t2r_ptr,
                        valid_ptr, table_ptr, table_stride, table_rows, table_cols,
                        WIDTH: tl.constexpr, TILE_COLS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0)
    req = tl.load(t2r_ptr + t)
    usable = (tl.load(valid_ptr + t).to(tl.int32) != 0) & (req >= 0) & (req < table_rows)
    req = tl.where(usable, req, 0)
    columns = tl.where(usable, table_cols, 0)          # no column of an unusable row is valid
    count = 0
    for first in range(0, WIDTH, TILE_COLS):
        k = first + tl.arange(0, TILE_COLS)
        in_row = k < WIDTH
        x = tl.load(topk_ptr + t.to(tl.int64) * topk_stride + k, mask=in_row, other=-1)
        column = x // BLOCK_SIZE
        ok = in_row & (x >= 0) & (column < columns)
        block = tl.load(table_ptr + req.to(tl.int64) * table_stride + column, mask=ok, other=0)
        tl.store(out_ptr + t.to(tl.int64) * out_stride + k,
                 tl.where(ok, block * BLOCK_SIZE + x % BLOCK_SIZE, -1), mask=in_row)
        count += tl.sum(ok.to(tl.int32), axis=0)
    tl.store(lens_ptr + t, count)


@triton.jit
def _fill_short_context_kernel(out_ptr, positions_ptr, out_stride, TOP_K: tl.constexpr,
                               RATIO: tl.constexpr, PADDED_TOP_K: tl.constexpr):
    t = tl.program_id(0)
    n = (tl.load(positions_ptr + t) + 1) // RATIO
    k = tl.arange(0, PADDED_TOP_K)
    tl.store(out_ptr + t.to(tl.int64) * out_stride + k, tl.where(k < n, k, -1), mask=k < TOP_K)


@triton.jit
def _combine_kernel(out_ptr, lens_ptr, out_stride, topk_ptr, topk_stride, qsl_ptr, seq_ptr,
                    gather_ptr, rows_per_request, swa_offset, WINDOW: tl.constexpr,
                    RATIO: tl.constexpr, TOPK: tl.constexpr, WIDTH: tl.constexpr,
                    TILE_COLS: tl.constexpr, WORKERS: tl.constexpr):
    b = tl.program_id(0)
    worker = tl.program_id(1)
    base = tl.load(qsl_ptr)
    qs = tl.load(qsl_ptr + b) - base
    query_len = tl.load(qsl_ptr + b + 1) - base - qs
    seq_len = tl.load(seq_ptr + b)
    gather_start = seq_len - tl.load(gather_ptr + b)
    request_base = rows_per_request * b
    for j in range(worker, query_len, WORKERS):
        t = qs + j
        position = seq_len - query_len + j
        topk_len = tl.minimum(tl.maximum((position + 1) // RATIO, 0), TOPK)
        swa_start = tl.maximum(tl.maximum(position - WINDOW + 1, 0), gather_start)
        swa_len = tl.maximum(position - swa_start + 1, 0)
        swa_first = request_base + swa_offset + (swa_start - gather_start)
        for first in range(0, WIDTH, TILE_COLS):
            c = first + tl.arange(0, TILE_COLS)
            in_topk = c < topk_len
            x = tl.load(topk_ptr + t.to(tl.int64) * topk_stride + c, mask=in_topk, other=-1)
            local = tl.where((x >= 0) & (x < swa_offset), x + request_base, -1)
            window = tl.where(c < topk_len + swa_len, swa_first + c - topk_len, -1)
            tl.store(out_ptr + t.to(tl.int64) * out_stride + c,
                     tl.where(in_topk, local, window), mask=c < WIDTH)
        tl.store(lens_ptr + t, topk_len + swa_len)


def swa_indices_and_lens(indices, lens, window_size, query_start_loc, seq_lens,
                         token_to_req_indices, is_valid_token, block_table, block_size,
                         token_offset, num_rows):
    """``indices [>= num_rows, >= W]`` and ``lens`` written for rows ``[0, num_rows)``."""
    if num_rows:
        _swa_indices_kernel[(num_rows,)](
            indices, lens, indices.stride(0), query_start_loc, seq_lens, token_to_req_indices,
            is_valid_token, block_table, block_table.stride(0), token_offset,
            WINDOW=window_size, PADDED_WINDOW=triton.next_power_of_2(window_size),
            BLOCK_SIZE=block_size)


def global_topk_indices_and_lens(out, lens, topk_indices, token_to_req_indices, block_table,
                                 block_size, is_valid_token):
    tokens, width = topk_indices.shape
    if tokens:
        _global_topk_kernel[(tokens,)](
            out, lens, topk_indices, topk_indices.stride(0), out.stride(0), token_to_req_indices,
            is_valid_token, block_table, block_table.stride(0), block_table.shape[0],
            block_table.shape[1], WIDTH=width, TILE_COLS=min(TILE, triton.next_power_of_2(width)),
            BLOCK_SIZE=block_size)


def fill_short_context_topk_indices(out, positions, top_k, compress_ratio, num_tokens):
    if num_tokens:
        _fill_short_context_kernel[(num_tokens,)](
            out, positions, out.stride(0), TOP_K=top_k, RATIO=compress_ratio,
            PADDED_TOP_K=triton.next_power_of_2(top_k))


def combine_topk_swa_indices(out, lens, topk_indices, query_start_loc, seq_lens, gather_lens,
                             window_size, compress_ratio, topk, M, N):
    """Rows of the chunk's tokens (``qsl[-1] - qsl[0]`` of them) and their lengths."""
    requests = query_start_loc.shape[0] - 1
    width = out.shape[1]
    if requests:
        _combine_kernel[(requests, COMBINE_WORKERS)](
            out, lens, out.stride(0), topk_indices, max(topk_indices.stride(0), 1),
            query_start_loc, seq_lens, gather_lens, M, N, WINDOW=window_size,
            RATIO=compress_ratio if topk else 1, TOPK=topk, WIDTH=width,
            TILE_COLS=min(TILE, triton.next_power_of_2(width)), WORKERS=COMBINE_WORKERS)


@triton.jit
def _seven_tensors_kernel(p0, p1, p2, p3, p4, p5, p6, n, m, BLOCK: tl.constexpr):
    pass


def empty_launch(tensors, n, m):
    """Triton's launcher alone: an empty kernel taking vLLM's C128A kernel's
    arguments (7 tensors, 2 ints), for the host-cost comparison."""
    _seven_tensors_kernel[(1,)](*tensors, n, m, BLOCK=128)
