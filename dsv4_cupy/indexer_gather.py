"""``cp_gather_indexer_k_quant_cache``: the indexer cache's rows of a prefill
chunk's requests, as bytes."""
from __future__ import annotations

import numpy as np
from numba import prange

from . import checks, validation
from .cpu import ParallelKernel, page_state, request_of
from .family import KernelFamily
from .geometry import MAX_GRID_STRIDE_BLOCKS, WARP_LANES, row_lane_blocks
from .kinds import GPU_KINDS, INT32, UINT8, Operand, as_bits, probe_all
from .kv_cache import CachePages, check_pages
from .launch import Launch, table_of
from .params import BLOCK_TABLE, I64, PTR, Params
from .prepared import Checked, PreparedOp
from .spec import INDEXER_HEAD_DIM, INDEXER_ROW_BYTES, INDEXER_SCALE_BYTES

PARAMS = Params("IndexerGatherParams", [
    ("cache", PTR), ("table", BLOCK_TABLE), ("cu_seq_lens", PTR), ("dst_k", PTR),
    ("dst_scale", PTR), ("page_stride", I64), ("num_pages", I64), ("block_size", I64),
    ("dst_k_stride", I64), ("dst_scale_stride", I64), ("num_rows", I64)])



@ParallelKernel
def cpu_cp_gather_indexer_k_quant_cache(cache, table, cu_seq_lens, dst_k, dst_scale,
                                        page_stride, num_pages, block_size, dst_k_stride,
                                        dst_scale_stride, num_rows):
    """Out row t: the row of its request (cu[b] <= t < cu[b + 1]), as bytes."""
    entries, rows, cols, row_stride = table.entries, table.rows, table.cols, table.row_stride
    for t in prange(num_rows):
        if rows == 0:
            continue
        b = request_of(cu_seq_lens, rows, t)
        if t < cu_seq_lens[b] or t >= cu_seq_lens[b + 1]:
            continue
        page, r = page_state(entries, row_stride, cols, num_pages, block_size, b,
                             t - np.int64(cu_seq_lens[b]))
        if page < 0:
            continue
        base = page * page_stride
        dst_k[t * dst_k_stride:t * dst_k_stride + INDEXER_HEAD_DIM] = \
            cache[base + r * INDEXER_HEAD_DIM:base + (r + 1) * INDEXER_HEAD_DIM]
        scales = base + block_size * INDEXER_HEAD_DIM + r * INDEXER_SCALE_BYTES
        dst_scale[t * dst_scale_stride:t * dst_scale_stride + INDEXER_SCALE_BYTES] = \
            cache[scales:scales + INDEXER_SCALE_BYTES]


FAMILY = KernelFamily("indexer_cache.cuh", "cp_gather_indexer_k_quant_cache", PARAMS)
CPU_KERNEL = cpu_cp_gather_indexer_k_quant_cache
FAMILIES = (FAMILY,)

_OP = PreparedOp("cp_gather_indexer_k_quant_cache")


def cp_gather_indexer_k_quant_cache(kv_cache, dst_k, dst_scale, block_table, cu_seq_lens, *,
                                    validate: str = "default",
                                    num_cache_blocks: int | None = None):
    """Copy the indexer cache's rows of a prefill chunk's requests, as bytes
    (vLLM's ``ops.cp_gather_indexer_k_quant_cache``).

    Parameters
    ----------
    kv_cache : uint8 array ``[num_blocks, block_size, 132]``
        As for ``indexer_k_quant_and_cache``.
    dst_k : uint8 array ``[T, 128]`` (rows contiguous)
        Or its ``float8_e4m3fn`` view (torch's; ``ml_dtypes``' on numpy).
        Row ``t`` gets position ``t - cu_seq_lens[b]`` of the request ``b``
        with ``cu_seq_lens[b] <= t < cu_seq_lens[b + 1]``; a row of no request
        (past ``cu_seq_lens[-1]``), or whose block is outside the table or the
        cache, is left as it was.
    dst_scale : uint8 array ``[T, 4]``
        The rows' scale bytes (a float32, or four UE8M0 bytes).
    block_table : int32 array ``[R, cols]`` (rows contiguous)
    cu_seq_lens : int32 array ``[R + 1]``
        Each request's first row in ``dst_k`` (0 first, non-decreasing).
    validate, num_cache_blocks
        "full" also checks (a sync on GPU) ``cu_seq_lens`` and every block read.

    Returns
    -------
    ``(dst_k, dst_scale)``.
    """
    key, results = _OP.replay(validate, (dst_k, dst_scale), kv_cache, block_table,
                                     cu_seq_lens, num_cache_blocks)
    if results is not None:
        return results
    kind, device, ops = probe_all({"dst_k": as_bits(dst_k), "dst_scale": dst_scale,
                                   "block_table": block_table, "cu_seq_lens": cu_seq_lens})
    values, scales, table, cu = (ops["dst_k"], ops["dst_scale"], ops["block_table"],
                                 ops["cu_seq_lens"])
    if values is None or scales is None:
        raise TypeError("dst_k, dst_scale: expected uint8 arrays [T, 128] and [T, 4], got None")
    checks.check(table, (INT32,), 2)
    checks.check(cu, (INT32,), 1, min_len=table.shape[0] + 1)
    num_rows = values.shape[0] if len(values.shape) == 2 else 0
    values = checks.output("dst_k", values, kind, device, UINT8, num_rows, INDEXER_HEAD_DIM)
    scales = checks.output("dst_scale", scales, kind, device, UINT8, num_rows, INDEXER_SCALE_BYTES)
    pages = check_pages("kv_cache", kv_cache, kind, device, None, INDEXER_ROW_BYTES)
    if kind in GPU_KINDS and any(op.ptr % 4 or checks.row_stride(op) % 4
                                 for op in (values, scales)):
        raise ValueError("dst_k, dst_scale: expected rows at 4-byte aligned addresses")
    checks.check_no_alias([values, scales], [table, cu, pages.op])
    if validation.check_mode(validate, num_cache_blocks):
        validation.query_layout(cu_seq_lens, None, kind, table.shape[0])
        validation.indexer_gather_rows(cu_seq_lens, block_table, kind, pages.block_size,
                                       pages.num_pages, num_cache_blocks)
    launch = indexer_gather_launch(pages, table, cu, values, scales, num_rows, device)
    results = (dst_k, dst_scale)
    return _OP.run(key, Checked(kind, device, results, (launch,), results))


def indexer_gather_launch(pages: CachePages, table: Operand, cu_seq_lens: Operand,
                          dst_k: Operand, dst_scale: Operand, num_rows: int, device: int
                          ) -> Launch:
    blocks = 0
    if device >= 0 and num_rows and table.shape[0]:
        blocks = min(row_lane_blocks(num_rows, WARP_LANES), MAX_GRID_STRIDE_BLOCKS)
    return Launch(FAMILY, blocks,
                  dict(cache=pages.op, table=table_of(table), cu_seq_lens=cu_seq_lens,
                       dst_k=dst_k, dst_scale=dst_scale, page_stride=pages.page_stride,
                       num_pages=pages.num_pages, block_size=pages.block_size,
                       dst_k_stride=checks.row_stride(dst_k),
                       dst_scale_stride=checks.row_stride(dst_scale), num_rows=num_rows),
                  kernel=cpu_cp_gather_indexer_k_quant_cache)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    yield "cp_gather_indexer_k_quant_cache", indexer_gather_launch(
        tiny.indexer_pages, tiny.table, tiny.qsl, tiny.bytes_rows, tiny.bytes_rows, 1, -1)
