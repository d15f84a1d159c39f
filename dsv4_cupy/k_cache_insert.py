"""``quantize_and_insert_k_cache``: each token's latent KV into its slot of a
paged fp8_ds_mla cache (SWA, C4A or C128A)."""
from __future__ import annotations

import numpy as np
from numba import prange

from . import checks, fp8, validation
from .cpu import ParallelKernel
from .family import SLOT_MAPPING_AXIS, KernelFamily
from .geometry import WARP_LANES, row_lane_blocks
from .kinds import GPU_KINDS, UINT16, Operand, as_bits, probe_all
from .launch import Launch
from .params import I64, PTR, Params
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .kv_cache import CachePages, check_pages
from .spec import (FP8_RECORD_BYTES, HEAD_SIZE, MAX_BLOCK_SIZE, NOPE_HEAD_DIM, QUANT_TILE,
                   SCALE_RECORD_BYTES, SWA_BLOCK_SIZE)

PARAMS = Params("KCacheInsertParams", [
    ("k", PTR), ("cache", PTR), ("slot_mapping", PTR), ("k_stride", I64), ("page_stride", I64),
    ("num_pages", I64), ("block_size", I64), ("num_tokens", I64)])


@ParallelKernel
def cpu_quantize_and_insert_k_cache(k, cache, slot_mapping, k_stride, page_stride, num_pages,
                                    block_size, num_tokens):
    """Token t's row of k (bf16 bits) into slot slot_mapping[t] (skipped outside
    the cache): kernels/k_cache_insert.cuh's rule, value for value."""
    for t in prange(num_tokens):
        page, r = fp8.cache_slot(np.int64(slot_mapping[t]), num_pages, block_size)
        if page < 0:
            continue
        page_base = page * page_stride
        record = page_base + r * FP8_RECORD_BYTES
        row = t * k_stride
        scales = page_base + block_size * FP8_RECORD_BYTES + r * SCALE_RECORD_BYTES
        for j in range(NOPE_HEAD_DIM // QUANT_TILE):
            first = row + j * QUANT_TILE
            amax = 0
            for d in range(QUANT_TILE):
                magnitude = np.int64(k[first + d]) & 0x7FFF
                if magnitude <= 0x7F80 and magnitude > amax:
                    amax = magnitude
            nonfinite = amax == 0x7F80
            e = 0 if nonfinite else fp8.ue8m0_exponent(np.float32(fp8.bf16_value(amax)))
            cache[scales + j] = fp8.SCALE_NONFINITE if nonfinite else \
                min(max(e + fp8.SCALE_BIAS, 0), 255)
            factor = 2.0 ** -e
            for d in range(QUANT_TILE):
                bits = k[first + d]
                cache[record + j * QUANT_TILE + d] = fp8.quantized(bits, factor, nonfinite)
        cache[scales + NOPE_HEAD_DIM // QUANT_TILE] = 0
        for d in range(HEAD_SIZE - NOPE_HEAD_DIM):           # the RoPE dims, as they are
            bits = k[row + NOPE_HEAD_DIM + d]
            cache[record + NOPE_HEAD_DIM + 2 * d] = bits & 0xFF
            cache[record + NOPE_HEAD_DIM + 2 * d + 1] = bits >> 8


FAMILY = KernelFamily("k_cache_insert.cuh", "quantize_and_insert_k_cache", PARAMS,
                      (SLOT_MAPPING_AXIS,))
CPU_KERNEL = cpu_quantize_and_insert_k_cache
FAMILIES = (FAMILY,)

_OP = PreparedOp("quantize_and_insert_k_cache")


def quantize_and_insert_k_cache(k, k_cache, slot_mapping, block_size: int = SWA_BLOCK_SIZE,
                                is_ue8m0: bool = True, *, validate: str = "default",
                                num_cache_blocks: int | None = None) -> None:
    """Quantise each token's latent KV and write it into its slot of a paged
    fp8_ds_mla cache (vLLM's ``quantize_and_insert_k_cache``).

    Parameters
    ----------
    k : bf16 array ``[>= T, 512]`` (rows contiguous, any row stride)
        torch ``bfloat16``; on numpy and cupy, ``uint16`` bf16 bits or
        ``ml_dtypes.bfloat16``.
    k_cache : uint8 array
        The cache's pages: ``[num_blocks, >= block_size * 584]`` (rows are
        pages) or vLLM's bound view ``[num_blocks, block_size, 584]``; the
        page stride is its ``stride(0)``. Written in place: the record and
        scale bytes of each inserted slot, nothing else.
    slot_mapping : int32 or int64 array ``[T]``
        ``block * block_size + state``; ``T`` tokens are inserted. A slot
        outside the cache (-1 for padding) is skipped.
    block_size : int
        States per page: 64 (SWA, C4A), 2 (C128A).
    is_ue8m0 : bool
        Power-of-two scales, the only format (vLLM asserts it too).
    validate, num_cache_blocks
        "full" also checks (a sync on GPU) that every slot but -1 is inside the
        cache (vLLM writes another page's bytes for one that is not).

    Per 64-dim NoPE tile: ``amax`` over the tile's non-NaN ``|x|``, at least
    1e-4; ``e = ceil(log2(amax / 448))``; values ``e4m3fn(clamp(x / 2^e,
    -448, 448))`` rounded to nearest even; scale byte ``e + 127``. The RoPE
    dims are copied as bits and the pad byte is 0. As vLLM's Triton kernel: a
    NaN value is stored as +448; a tile holding an infinity gets scale byte
    255 (it reads back as infinities and NaN) and its finite values +-0.
    """
    key, results = _OP.replay(validate, (), k, k_cache, slot_mapping, block_size, is_ue8m0,
                              num_cache_blocks)
    if results is not None:
        return None
    _OP.run(key, _checked(k, k_cache, slot_mapping, block_size, is_ue8m0, validate,
                          num_cache_blocks))
    return None


def _checked(k, k_cache, slot_mapping, block_size, is_ue8m0, validate, num_cache_blocks
             ) -> Checked:
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    if is_ue8m0 is not True:
        raise ValueError(f"is_ue8m0: expected True (power-of-two scales are the only "
                         f"format), got {is_ue8m0!r}")
    kind, device, ops = probe_all({"k": as_bits(k), "slot_mapping": slot_mapping})
    rows, slots = ops["k"], ops["slot_mapping"]
    checks.check(rows, (UINT16,), 2, min_cols=HEAD_SIZE)
    checks.check(slots, SLOT_MAPPING_AXIS.values, 1)
    num_tokens = slots.shape[0]
    if rows.shape[0] < num_tokens:
        raise ValueError(f"k: expected a row for each of the {num_tokens} slots, got shape "
                         f"{tuple(rows.shape)}")
    pages = check_pages("k_cache", k_cache, kind, device, block_size)
    if kind in GPU_KINDS and (rows.ptr % 4 or checks.row_stride(rows) % 2):
        raise ValueError("k: expected rows at 4-byte aligned addresses (an even row stride)")
    checks.check_no_alias([pages.op], [rows, slots])
    if validation.check_mode(validate, num_cache_blocks):
        validation.cache_slots(slot_mapping, kind, num_tokens, pages.num_pages, block_size,
                               num_cache_blocks)
    launch = insert_launch(rows, pages, slots, num_tokens, device)
    # The cache stands for the results (a prepared call's are never None); the op returns None.
    return Checked(kind, device, k_cache, (launch,), ())


def insert_launch(k: Operand, pages: CachePages, slot_mapping: Operand, num_tokens: int,
                  device: int) -> Launch:
    """The inserts of the first ``num_tokens`` slots; ``device`` -1 for the CPU."""
    blocks, variant = 0, {}
    if device >= 0 and num_tokens:
        variant = {"slot_mapping": slot_mapping.dtype}
        blocks = row_lane_blocks(num_tokens, WARP_LANES)
    return Launch(FAMILY, blocks,
                  dict(k=k, cache=pages.op, slot_mapping=slot_mapping,
                       k_stride=checks.row_stride(k), page_stride=pages.page_stride,
                       num_pages=pages.num_pages, block_size=pages.block_size,
                       num_tokens=num_tokens),
                  variant=variant, kernel=cpu_quantize_and_insert_k_cache)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    for slots in (tiny.out32, tiny.out64):
        yield (f"quantize_and_insert_k_cache[s{slots.dtype.itemsize * 8}]",
               insert_launch(tiny.bf16_rows, tiny.pages, slots, 1, -1))
