"""``dequantize_and_gather_k_cache``: the rows a prefill chunk reads, out of
paged fp8_ds_mla caches into a bf16 workspace; and
``dequantize_and_gather_prefill_kv``, a layer's two caches in one launch."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import checks, fp8, validation
from .cpu import ParallelKernel, div_trunc, page_state
from .family import KernelFamily
from .geometry import MAX_GRID_STRIDE_BLOCKS, WARP_LANES, row_lane_blocks
from .kinds import GPU_KINDS, INT32, UINT16, Operand, as_bits, probe_all
from .kv_cache import CachePages, check_pages
from .launch import Launch, optional, table_of
from .params import BLOCK_TABLE, I64, PTR, Group, Params
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .spec import (FP8_RECORD_BYTES, HEAD_SIZE, KV_BLOCK_SIZE, MAX_BLOCK_SIZE, NOPE_HEAD_DIM,
                   QUANT_TILE, SCALE_RECORD_BYTES, SWA_BLOCK_SIZE)

K_CACHE_SOURCE = Group("KCacheSource", [
    ("cache", PTR), ("table", BLOCK_TABLE), ("gather_lens", PTR), ("page_stride", I64),
    ("num_pages", I64), ("block_size", I64), ("ratio", I64), ("first_row", I64)],
    module=__name__)
KCacheSource = K_CACHE_SOURCE.record
PARAMS = Params("KCacheGatherParams", [
    ("out", PTR), ("seq_lens", PTR), ("out_request_stride", I64), ("out_row_stride", I64),
    ("num_reqs", I64), ("rows", I64), ("num_sources", I64), ("first", K_CACHE_SOURCE),
    ("second", K_CACHE_SOURCE)])
#: The GPU kernel's 16-byte stores: out's rows start at multiples of this many bf16 values.
OUT_ROW_ALIGNMENT = 8


@njit(cache=True)
def cpu_gather_position(out, target, cache, table, row_stride, cols, page_stride, num_pages,
                        block_size, b, position):
    """Row ``position`` of request b's rows in a cache into ``out[target:]``
    (kernels/k_cache_gather.cuh's gather_state); nothing for a block outside the
    table or the cache."""
    page, state = page_state(table, row_stride, cols, num_pages, block_size, b, position)
    if page < 0:
        return
    base = page * page_stride
    record = base + state * FP8_RECORD_BYTES
    scales = base + block_size * FP8_RECORD_BYTES + state * SCALE_RECORD_BYTES
    for d in range(NOPE_HEAD_DIM):
        out[target + d] = fp8.dequantized(cache[record + d], cache[scales + d // QUANT_TILE])
    for d in range(HEAD_SIZE - NOPE_HEAD_DIM):        # the RoPE dims, as they are
        out[target + NOPE_HEAD_DIM + d] = (
            np.uint16(cache[record + NOPE_HEAD_DIM + 2 * d])
            | (np.uint16(cache[record + NOPE_HEAD_DIM + 2 * d + 1]) << 8))


@njit(cache=True)
def cpu_request_row_position(seq_len, ratio, gather_lens, b, first_row, row):
    """The position in its source's rows of out row ``row`` of request b, or -1
    (outside G or the request's rows): gather_request_row's rule."""
    seq = div_trunc(np.int64(seq_len), ratio)
    gathered = np.int64(gather_lens[b]) if gather_lens.shape[0] else seq
    i = row - first_row
    position = seq - gathered + i
    return -1 if i >= gathered or position < 0 else position


@njit(cache=True)
def cpu_sources(first, second):
    """The fields of two ``KCacheSource`` records, each a pair indexed by source:
    caches, table entries, gather lengths, table rows, table columns, table row
    strides, page strides, pages, block sizes, ratios, first rows. A kernel
    takes them out of the records before its prange (see cpu.py)."""
    return ((first.cache, second.cache), (first.table.entries, second.table.entries),
            (first.gather_lens, second.gather_lens), (first.table.rows, second.table.rows),
            (first.table.cols, second.table.cols),
            (first.table.row_stride, second.table.row_stride),
            (first.page_stride, second.page_stride), (first.num_pages, second.num_pages),
            (first.block_size, second.block_size), (first.ratio, second.ratio),
            (first.first_row, second.first_row))


@ParallelKernel
def cpu_dequantize_and_gather_k_cache(out, seq_lens, out_request_stride, out_row_stride,
                                      num_reqs, rows, num_sources, first, second):
    """Row i of request b's gathered rows of a source into out[b, first_row + i]:
    kernels/k_cache_gather.cuh's rule, value for value."""
    caches, entries, lens, table_rows, cols, row_strides, page_strides, num_pages, \
        block_sizes, ratios, first_rows = cpu_sources(first, second)
    for b in prange(num_reqs):
        for s in range(num_sources):
            if b >= table_rows[s]:
                continue
            end_row = first_rows[1] if s == 0 and num_sources > 1 else rows
            for row in range(first_rows[s], end_row):
                position = cpu_request_row_position(seq_lens[b], ratios[s], lens[s], b,
                                                    first_rows[s], row)
                if position >= 0:
                    cpu_gather_position(out, b * out_request_stride + row * out_row_stride,
                                        caches[s], entries[s], row_strides[s], cols[s],
                                        page_strides[s], num_pages[s], block_sizes[s], b,
                                        position)


FAMILY = KernelFamily("k_cache_gather.cuh", "dequantize_and_gather_k_cache", PARAMS)
CPU_KERNEL = cpu_dequantize_and_gather_k_cache
FAMILIES = (FAMILY,)

_OP = PreparedOp("dequantize_and_gather_k_cache")
_PREFILL_OP = PreparedOp("dequantize_and_gather_prefill_kv")


def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table,
                                  block_size: int, offset: int, *, validate: str = "default",
                                  num_cache_blocks: int | None = None):
    """Dequantise the rows of each request out of a paged fp8_ds_mla cache
    into a bf16 workspace (vLLM's ``dequantize_and_gather_k_cache``).

    Parameters
    ----------
    out : bf16 array ``[R, M, 512]`` (last axis contiguous)
        torch ``bfloat16``; on numpy and cupy ``uint16`` bf16 bits or
        ``ml_dtypes.bfloat16``. Request ``b``'s rows go to
        ``out[b, offset:offset + G]``; every other row is left as it was.
    k_cache : uint8 array
        Pages ``[num_blocks, >= block_size * 584]`` or vLLM's bound view
        ``[num_blocks, block_size, 584]``; the page stride is its ``stride(0)``.
    seq_lens : int32 array ``[R]``
        Rows of each request in the cache.
    gather_lens : int32 array ``[R]`` or None
        ``G``: the last ``G`` rows of each request (None: all ``seq_lens``).
    block_table : int32 array ``[>= R, cols]`` (rows contiguous)
        Only the entries of the gathered rows are read.
    block_size : int
        States per page: 64 (SWA, C4A), 2 (C128A).
    offset : int
        The out row of each request's first gathered row.
    validate, num_cache_blocks
        "full" also checks (a sync on GPU) that ``0 <= G <= seq_len``, that
        ``offset + G <= M`` and that every block read is inside the table and
        the cache. By default a row outside them is not written.

    Returns
    -------
    ``out``. NoPE dims: ``bf16(e4m3 value * 2^(scale byte - 127))``, one
    rounding (scale byte 0 reads as 0 and 255 as an infinity, as in vLLM's
    kernels); RoPE dims as stored.
    """
    key, results = _OP.replay(validate, (out,), k_cache, seq_lens, gather_lens, block_table,
                              block_size, offset, num_cache_blocks)
    if results is not None:
        return results
    kind, device, ops = probe_all({"out": as_bits(out), "seq_lens": seq_lens,
                                   "gather_lens": gather_lens, "block_table": block_table})
    rows_out, seq, table = _check_common(ops, kind, device)
    num_reqs = seq.shape[0]
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    offset = check_int("offset", offset, minimum=0, maximum=rows_out.shape[1])
    lens = ops["gather_lens"]
    if lens is not None:
        checks.check(lens, (INT32,), 1, min_len=num_reqs)
    pages = check_pages("k_cache", k_cache, kind, device, block_size)
    checks.check_no_alias([rows_out], [seq, table, lens, pages.op])
    if validation.check_mode(validate, num_cache_blocks):
        validation.gather_rows(seq_lens, gather_lens, block_table, kind, num_reqs, block_size,
                               1, offset, rows_out.shape[1], pages.num_pages, num_cache_blocks)
    source = _source(pages, table, lens, 1, offset)
    launch = gather_launch(rows_out, seq, (source,), device)
    return _OP.run(key, Checked(kind, device, out, (launch,), (out,)))


def dequantize_and_gather_prefill_kv(out, compressed_k_cache, compressed_block_table,
                                     swa_k_cache, swa_block_table, seq_lens, gather_lens,
                                     compress_ratio: int, N: int, *,
                                     compressed_block_size: int | None = None,
                                     swa_block_size: int = SWA_BLOCK_SIZE,
                                     validate: str = "default",
                                     num_cache_blocks: int | None = None):
    """A C4A or C128A layer's workspace of one prefill chunk, both caches in one
    launch: what vLLM's prefill does with two ``dequantize_and_gather_k_cache``
    calls, ``(out, compressed_k_cache, seq_lens // compress_ratio, None,
    compressed_block_table, 256 // compress_ratio, 0)`` then ``(out,
    swa_k_cache, seq_lens, gather_lens, swa_block_table, 64, N)``.

    Parameters
    ----------
    out : bf16 array ``[R, M, 512]``
        Rows ``[0, seq_len // compress_ratio)`` of each request from the
        compressed cache, rows ``[N, N + gather_len)`` from the SWA cache.
    compressed_k_cache, swa_k_cache : uint8 arrays
        As ``k_cache`` of ``dequantize_and_gather_k_cache``.
    compressed_block_table, swa_block_table : int32 arrays ``[>= R, cols]``
    seq_lens, gather_lens : int32 arrays ``[R]``
        The chunk's requests' sequence lengths and SWA rows (the prefill
        gather lengths).
    compress_ratio : int
        4 (C4A) or 128 (C128A).
    N : int
        The chunk plan's ``N``: the first SWA row (at least every request's
        ``seq_len // compress_ratio``).
    compressed_block_size : int, optional
        States per compressed page (default ``256 // compress_ratio``).
    swa_block_size : int
        States per SWA page (64).
    validate, num_cache_blocks
        As for ``dequantize_and_gather_k_cache``, for both caches.

    Returns
    -------
    ``out``.
    """
    key, results = _PREFILL_OP.replay(
        validate, (out,), compressed_k_cache, compressed_block_table, swa_k_cache,
        swa_block_table, seq_lens, gather_lens, compress_ratio, N, compressed_block_size,
        swa_block_size, num_cache_blocks)
    if results is not None:
        return results
    kind, device, ops = probe_all({
        "out": as_bits(out), "seq_lens": seq_lens, "gather_lens": gather_lens,
        "block_table": compressed_block_table, "swa_block_table": swa_block_table})
    rows_out, seq, table = _check_common(ops, kind, device, table_name="compressed_block_table")
    num_reqs = seq.shape[0]
    compress_ratio, compressed_block_size, swa_block_size = check_layer_caches(
        compress_ratio, compressed_block_size, swa_block_size)
    N = check_int("N", N, minimum=0, maximum=rows_out.shape[1])
    lens, swa_table = ops["gather_lens"], ops["swa_block_table"]
    if lens is None:
        raise TypeError("gather_lens: expected an int32 array [R] (the SWA rows), got None")
    checks.check(lens, (INT32,), 1, min_len=num_reqs)
    checks.check(swa_table, (INT32,), 2)
    compressed = check_pages("compressed_k_cache", compressed_k_cache, kind, device,
                             compressed_block_size)
    swa = check_pages("swa_k_cache", swa_k_cache, kind, device, swa_block_size)
    checks.check_no_alias([rows_out], [seq, table, lens, swa_table, compressed.op, swa.op])
    if validation.check_mode(validate, num_cache_blocks):
        validation.gather_rows(seq_lens, None, compressed_block_table, kind, num_reqs,
                               compressed_block_size, compress_ratio, 0, N, compressed.num_pages,
                               num_cache_blocks, " of the compressed cache")
        validation.gather_rows(seq_lens, gather_lens, swa_block_table, kind, num_reqs,
                               swa_block_size, 1, N, rows_out.shape[1], swa.num_pages,
                               num_cache_blocks, " of the SWA cache")
    sources = (_source(compressed, table, None, compress_ratio, 0),
               _source(swa, swa_table, lens, 1, N))
    launch = gather_launch(rows_out, seq, sources, device)
    return _PREFILL_OP.run(key, Checked(kind, device, out, (launch,), (out,)))


def check_layer_caches(compress_ratio, compressed_block_size, swa_block_size
                       ) -> tuple[int, int, int]:
    """A layer's two caches' ints: the ratio, the compressed cache's states per
    page (None: ``256 // compress_ratio``) and the SWA cache's."""
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=2,
                               maximum=MAX_BLOCK_SIZE)
    if compressed_block_size is None:
        compressed_block_size = max(KV_BLOCK_SIZE // compress_ratio, 1)
    return (compress_ratio,
            check_int("compressed_block_size", compressed_block_size, minimum=1,
                      maximum=MAX_BLOCK_SIZE),
            check_int("swa_block_size", swa_block_size, minimum=1, maximum=MAX_BLOCK_SIZE))


def _check_common(ops: dict, kind: str, device: int, table_name: str = "block_table"
                  ) -> tuple[Operand, Operand, Operand]:
    """out, seq_lens and the (first) block table of a gather."""
    rows_out, seq, table = ops["out"], ops["seq_lens"], ops["block_table"]
    checks.check(seq, (INT32,), 1)
    checks.check(table, (INT32,), 2)
    table = table._replace(name=table_name)
    num_reqs = seq.shape[0]
    if rows_out is None:
        raise TypeError("out: expected a bf16 array [R, M, 512], got None")
    if rows_out.dtype != UINT16 or len(rows_out.shape) != 3 or rows_out.shape[2] != HEAD_SIZE \
            or rows_out.shape[0] < num_reqs or rows_out.strides[2] != 1:
        raise ValueError(f"out: expected a bf16 array [>= {num_reqs}, M, {HEAD_SIZE}] with a "
                         f"contiguous last axis, got {rows_out.dtype} {tuple(rows_out.shape)}")
    if kind in GPU_KINDS and (rows_out.ptr % (2 * OUT_ROW_ALIGNMENT)
                              or any(s % OUT_ROW_ALIGNMENT for s in rows_out.strides[:2])):
        raise ValueError(f"out: expected rows at 16-byte aligned addresses (strides multiples "
                         f"of {OUT_ROW_ALIGNMENT}), got strides {tuple(rows_out.strides)}")
    checks.check_writable(rows_out)
    return rows_out, seq, table


def _source(pages: CachePages, table: Operand, gather_lens: Operand | None, ratio: int,
            first_row: int) -> KCacheSource:
    return KCacheSource(cache=pages.op, table=table_of(table),
                        gather_lens=optional(gather_lens),
                        page_stride=pages.page_stride, num_pages=pages.num_pages,
                        block_size=pages.block_size, ratio=ratio, first_row=first_row)


def gather_launch(out: Operand, seq_lens: Operand, sources: tuple, device: int) -> Launch:
    """The gather of one source, or of two (the compressed cache's rows, then
    the SWA cache's from its ``first_row``); ``device`` -1 for the CPU."""
    num_reqs, rows = seq_lens.shape[0], out.shape[1]
    first = sources[0]
    blocks = 0
    if device >= 0:
        blocks = min(row_lane_blocks(num_reqs * (rows - first.first_row), WARP_LANES),
                     MAX_GRID_STRIDE_BLOCKS) if num_reqs and rows > first.first_row else 0
    return Launch(FAMILY, blocks,
                  dict(out=out, seq_lens=seq_lens, out_request_stride=out.strides[0],
                       out_row_stride=out.strides[1], num_reqs=num_reqs, rows=rows,
                       num_sources=len(sources), first=first,
                       second=sources[-1] if len(sources) > 1 else first),
                  kernel=cpu_dequantize_and_gather_k_cache)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    source = _source(tiny.pages, tiny.table, None, 1, 0)
    yield "dequantize_and_gather_k_cache", gather_launch(tiny.bf16_rows_3d, tiny.seq, (source,),
                                                         -1)
