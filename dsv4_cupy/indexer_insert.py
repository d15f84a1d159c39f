"""``indexer_k_quant_and_cache``: each token's indexer key into its slot of
the indexer's fp8 cache (C4A layers)."""
from __future__ import annotations

import numpy as np
from numba import prange

from . import checks, fp8, validation
from .cpu import ParallelKernel
from .family import SLOT_MAPPING_AXIS, KernelFamily
from .geometry import MAX_GRID_STRIDE_BLOCKS, WARP_LANES, row_lane_blocks
from .kinds import GPU_KINDS, UINT16, Operand, as_bits, probe_all
from .kv_cache import CachePages, check_pages
from .launch import Launch
from .params import I64, PTR, Params
from .prepared import Checked, PreparedOp
from .scalars import check_choice
from .spec import INDEXER_HEAD_DIM, INDEXER_ROW_BYTES, INDEXER_SCALE_BYTES

#: ``scale_fmt`` values and their kernel codes: a float32 amax / 448, a power of
#: two (float32), the power's UE8M0 byte four times (kernels/indexer_cache.cuh).
SCALE_FORMATS = {"": 0, "ue8m0": 1, "mxfp8": 2}

PARAMS = Params("IndexerInsertParams", [
    ("k", PTR), ("cache", PTR), ("slot_mapping", PTR), ("k_stride", I64), ("page_stride", I64),
    ("num_pages", I64), ("block_size", I64), ("num_tokens", I64), ("scale_format", I64)])

@ParallelKernel
def cpu_indexer_k_quant_and_cache(k, cache, slot_mapping, k_stride, page_stride, num_pages,
                                  block_size, num_tokens, scale_format):
    """Row t of k into slot slot_mapping[t]: kernels/indexer_cache.cuh's rule."""
    for t in prange(num_tokens):
        page, r = fp8.cache_slot(np.int64(slot_mapping[t]), num_pages, block_size)
        if page < 0:
            continue
        base = page * page_stride
        row = t * k_stride
        amax = 0
        for d in range(INDEXER_HEAD_DIM):
            magnitude = np.int64(k[row + d]) & 0x7FFF
            if magnitude <= 0x7F80 and magnitude > amax:
                amax = magnitude
        if amax == 0x7F80:
            scale = np.float32(np.inf)
        elif scale_format == 0:
            scale = np.float32(max(np.float32(fp8.bf16_value(amax)), fp8.AMAX_FLOOR)) \
                / fp8.E4M3_MAX
        else:
            scale = np.float32(2.0 ** fp8.ue8m0_exponent(np.float32(fp8.bf16_value(amax))))
        for d in range(INDEXER_HEAD_DIM):
            value = np.float32(fp8.bf16_value(k[row + d])) / scale
            cache[base + r * INDEXER_HEAD_DIM + d] = fp8.e4m3_bits(np.float64(value))
        bits = fp8.float32_bits(scale)
        scales = base + block_size * INDEXER_HEAD_DIM + r * INDEXER_SCALE_BYTES
        for i in range(INDEXER_SCALE_BYTES):
            cache[scales + i] = (bits >> 23) & 0xFF if scale_format == 2 else (bits >> (8 * i)) & 0xFF


FAMILY = KernelFamily("indexer_cache.cuh", "indexer_k_quant_and_cache", PARAMS,
                      (SLOT_MAPPING_AXIS,))
CPU_KERNEL = cpu_indexer_k_quant_and_cache
FAMILIES = (FAMILY,)

_OP = PreparedOp("indexer_k_quant_and_cache")


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size: int,
                              scale_fmt: str, *, validate: str = "default",
                              num_cache_blocks: int | None = None) -> None:
    """Quantise each token's indexer key and write it into its slot of the
    indexer's cache (vLLM's ``ops.indexer_k_quant_and_cache``).

    Parameters
    ----------
    k : bf16 array ``[T, 128]`` (rows contiguous, any row stride)
        As ``k`` of ``quantize_and_insert_k_cache``.
    kv_cache : uint8 array ``[num_blocks, block_size, 132]``
        vLLM's bound view (``kv_cache.kv_cache_view(pages, "indexer")``);
        the page stride is its ``stride(0)``. A page holds its rows' values,
        then their scales; written in place, nothing but the inserted rows.
    slot_mapping : int32 or int64 array ``[>= T]``
        A slot outside the cache (any negative one) is skipped.
    quant_block_size : int
        128: one scale per row (the only size, as in DeepSeek-V4).
    scale_fmt : "ue8m0", "mxfp8" or ""
        "ue8m0" (DeepSeek-V4's): the scale ``max(amax, 1e-4) / 448`` rounded up
        to a power of two, stored as float32; "mxfp8": the same power as its
        UE8M0 byte, four times; "": the float32 quotient itself.
    validate, num_cache_blocks
        "full" also checks (a sync on GPU) every slot but -1 to be inside.

    Values are ``e4m3fn(x / scale)`` rounded to nearest even and saturating;
    ``amax`` skips NaN; a NaN value stays NaN (0x7F); a row holding an
    infinity gets an infinite scale (finite values +-0, the infinities NaN).
    """
    key, results = _OP.replay(validate, (), k, kv_cache, slot_mapping, quant_block_size,
                                     scale_fmt, num_cache_blocks)
    if results is None:
        _OP.run(key, _insert_checked(k, kv_cache, slot_mapping, quant_block_size,
                                            scale_fmt, validate, num_cache_blocks))
    return None


def _insert_checked(k, kv_cache, slot_mapping, quant_block_size, scale_fmt, validate,
                    num_cache_blocks) -> Checked:
    if quant_block_size != INDEXER_HEAD_DIM:
        raise ValueError(f"quant_block_size: expected {INDEXER_HEAD_DIM} (one scale per row), "
                         f"got {quant_block_size!r}")
    scale_format = SCALE_FORMATS[check_choice("scale_fmt", scale_fmt, tuple(SCALE_FORMATS))]
    kind, device, ops = probe_all({"k": as_bits(k), "slot_mapping": slot_mapping})
    rows, slots = ops["k"], ops["slot_mapping"]
    checks.check(rows, (UINT16,), 2, min_cols=INDEXER_HEAD_DIM)
    num_tokens = rows.shape[0]
    checks.check(slots, SLOT_MAPPING_AXIS.values, 1, min_len=num_tokens)
    pages = check_pages("kv_cache", kv_cache, kind, device, None, INDEXER_ROW_BYTES)
    if kind in GPU_KINDS and (rows.ptr % 8 or checks.row_stride(rows) % 4):
        raise ValueError("k: expected rows at 8-byte aligned addresses (a row stride that is "
                         "a multiple of 4)")
    checks.check_no_alias([pages.op], [rows, slots])
    if validation.check_mode(validate, num_cache_blocks):
        validation.cache_slots(slot_mapping, kind, num_tokens, pages.num_pages,
                               pages.block_size, num_cache_blocks)
    # The cache stands for the results (a prepared call's are never None); the op returns None.
    return Checked(kind, device, kv_cache, (indexer_insert_launch(rows, pages, slots, num_tokens,
                                                                  scale_format, device),), ())


def indexer_insert_launch(k: Operand, pages: CachePages, slot_mapping: Operand,
                          num_tokens: int, scale_format: int, device: int) -> Launch:
    blocks, variant = 0, {}
    if device >= 0 and num_tokens:
        variant = {"slot_mapping": slot_mapping.dtype}
        blocks = min(row_lane_blocks(num_tokens, WARP_LANES), MAX_GRID_STRIDE_BLOCKS)
    return Launch(FAMILY, blocks,
                  dict(k=k, cache=pages.op, slot_mapping=slot_mapping,
                       k_stride=checks.row_stride(k), page_stride=pages.page_stride,
                       num_pages=pages.num_pages, block_size=pages.block_size,
                       num_tokens=num_tokens, scale_format=scale_format),
                  variant=variant, kernel=cpu_indexer_k_quant_and_cache)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    for slots in (tiny.out32, tiny.out64):
        yield (f"indexer_k_quant_and_cache[s{slots.dtype.itemsize * 8}]",
               indexer_insert_launch(tiny.bf16_rows, tiny.indexer_pages, slots, 1, 1, -1))
