"""The KV caches of a DeepSeek-V4 layer as vLLM 0.34 lays them out: each
cache's page (bytes, padded stride) and the ``[num_blocks, num_states, C]``
view vLLM binds, of any array kind.

A page holds ``num_states`` states, block-planar: every state's record, then
every state's scales (``spec``: fp8_ds_mla's 576-byte records and 8-byte
scale records, the indexer's 128 FP8 values and one float32 scale). vLLM
pads a page to a multiple of 576 bytes, and a cache that packs several
layers per block has a block stride larger still: the cache ops read the
stride from the array (``stride(0)``), never from here.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import checks
from .kinds import (CUPY, GPU_KINDS, TORCH_CPU, TORCH_CUDA, UINT8, Operand, describe,
                    full_like_kind, kind_of, probe)
from .scalars import check_choice, check_int
from .spec import (C4A_BLOCK_SIZE, C128A_BLOCK_SIZE, FP8_DS_MLA_BYTES_PER_TOKEN,
                   INDEXER_ROW_BYTES, PAGE_ALIGNMENT, SWA_BLOCK_SIZE, round_up)


class KVCacheLayout(NamedTuple):
    """One cache's page."""

    cache: str           # "swa", "c4a", "c128a" or "indexer"
    num_states: int      # states (rows) per block: vLLM's kernel block size
    row_bytes: int       # C of the bound view: 584 (fp8_ds_mla) or 132 (indexer)
    page_bytes: int      # num_states * row_bytes: what the cache ops touch
    page_stride: int     # page_bytes padded to PAGE_ALIGNMENT: one layer's block stride

    def view_shape(self, num_blocks: int) -> tuple[int, int, int]:
        return (num_blocks, self.num_states, self.row_bytes)


def _layout(cache: str, num_states: int, row_bytes: int) -> KVCacheLayout:
    page = num_states * row_bytes
    return KVCacheLayout(cache, num_states, row_bytes, page, round_up(page, PAGE_ALIGNMENT))


#: Every cache of a DeepSeek-V4 layer (the indexer's: C4A layers only).
KV_CACHE_LAYOUTS = {layout.cache: layout for layout in (
    _layout("swa", SWA_BLOCK_SIZE, FP8_DS_MLA_BYTES_PER_TOKEN),
    _layout("c4a", C4A_BLOCK_SIZE, FP8_DS_MLA_BYTES_PER_TOKEN),
    _layout("c128a", C128A_BLOCK_SIZE, FP8_DS_MLA_BYTES_PER_TOKEN),
    _layout("indexer", C4A_BLOCK_SIZE, INDEXER_ROW_BYTES))}


def kv_cache_layout(cache: str) -> KVCacheLayout:
    """The page of ``cache`` ("swa", "c4a", "c128a" or "indexer"): 37,440-byte
    pages of 64 states for SWA and C4A, 1,728 bytes of 2 states for C128A,
    8,640 bytes of 64 rows for the indexer."""
    return KV_CACHE_LAYOUTS[check_choice("cache", cache, tuple(KV_CACHE_LAYOUTS))]


def kv_cache_view(pages, cache: str):
    """The ``[num_blocks, num_states, C]`` uint8 view vLLM binds (strides
    ``(block stride, C, 1)``) of ``pages``: a uint8 array ``[num_blocks,
    >= page_bytes]`` whose rows are blocks (its row stride is the block
    stride: a padded page, or several layers' pages side by side)."""
    layout = kv_cache_layout(cache)
    kind = kind_of(pages)
    if kind is None:
        raise TypeError(f"pages: expected a numpy, cupy or torch array, got "
                        f"{type(pages).__name__}")
    dtype = str(pages.dtype).replace("torch.", "")
    if dtype != "uint8" or pages.ndim != 2 or pages.shape[1] < layout.page_bytes:
        raise ValueError(f"pages: expected a uint8 array [num_blocks, >= {layout.page_bytes}] "
                         f"({cache} pages), got {dtype} {tuple(pages.shape)}")
    shape = layout.view_shape(pages.shape[0])
    if kind in (TORCH_CPU, TORCH_CUDA):
        if pages.stride(1) != 1:
            raise ValueError("pages: expected contiguous rows")
        return pages.as_strided(shape, (pages.stride(0), layout.row_bytes, 1))
    if pages.strides[1] != 1:
        raise ValueError("pages: expected contiguous rows")
    strides = (pages.strides[0], layout.row_bytes, 1)
    if kind == CUPY:
        import cupy
        return cupy.lib.stride_tricks.as_strided(pages, shape, strides)
    return np.lib.stride_tricks.as_strided(pages, shape, strides)


def empty_kv_cache(cache: str, num_blocks: int, *, like="numpy", device: int | None = None,
                   fill: int = 0):
    """A new cache of ``num_blocks`` padded pages, filled with the byte ``fill``,
    as the bound view (``kv_cache_view``); ``like`` as for the builders."""
    layout = kv_cache_layout(cache)
    num_blocks = check_int("num_blocks", num_blocks, minimum=0)
    fill = check_int("fill", fill, minimum=0, maximum=255)
    pages = full_like_kind(like, (num_blocks, layout.page_stride), UINT8, fill, device)
    return kv_cache_view(pages, cache)


#: Cache pages start at addresses, and are strided by, multiples of this on the
#: GPU (the kernels' 16-byte vector loads and stores).
PAGE_ADDRESS_ALIGNMENT = 16


class CachePages(NamedTuple):
    """A checked cache argument: its pages as a 2-D uint8 operand (a page a row)."""

    op: Operand            # [num_pages, >= page_bytes] uint8, row stride = page_stride
    page_stride: int       # bytes between pages
    num_pages: int
    block_size: int        # states per page


def check_pages(name: str, cache, kind: str, device: int, block_size: int | None,
                row_bytes: int = FP8_DS_MLA_BYTES_PER_TOKEN) -> CachePages:
    """A cache argument of a call on ``kind``/``device``: uint8 pages
    ``[num_pages, >= block_size * row_bytes]`` or vLLM's bound view
    ``[num_pages, block_size, row_bytes]`` (``block_size`` None: the view's
    own, and only the view is taken), pages not overlapping, writable."""
    op = probe(name, cache)
    if (op.kind, op.device) != (kind, device):
        raise TypeError(f"{name}: expected an array like the call's others "
                        f"({'on the host' if device < 0 else f'on cuda:{device}'}, {kind}), "
                        f"got {describe(cache)}")
    if op.dtype != UINT8:
        raise TypeError(f"{name}: expected dtype uint8 (the cache's bytes), got {op.dtype}")
    if len(op.shape) == 3:
        view_block = op.shape[1]
        if block_size is not None and view_block != block_size:
            raise ValueError(f"{name}: expected [num_blocks, block_size={block_size}, "
                             f"{row_bytes}], got shape {tuple(op.shape)}")
        if op.shape[2] != row_bytes or tuple(op.strides[1:]) != (row_bytes, 1):
            raise ValueError(f"{name}: expected the bound view [num_blocks, {view_block}, "
                             f"{row_bytes}] with strides (page stride, {row_bytes}, 1), got "
                             f"shape {tuple(op.shape)} and strides {tuple(op.strides)}")
        block_size = view_block
        op = probe(name, _pages_2d(cache, op, block_size * row_bytes))
    elif len(op.shape) != 2 or block_size is None:
        want = f"[num_blocks, {block_size}, {row_bytes}] or [num_blocks, >= " \
               f"{(block_size or 0) * row_bytes}]" if block_size else \
            f"[num_blocks, block_size, {row_bytes}]"
        raise ValueError(f"{name}: expected {want} uint8, got shape {tuple(op.shape)}")
    page_bytes = block_size * row_bytes
    num_pages = op.shape[0]
    checks.check(op, (UINT8,), 2, min_cols=page_bytes)
    page_stride = checks.row_stride(op) if num_pages > 1 else page_bytes
    if num_pages > 1 and page_stride < page_bytes:
        raise ValueError(f"{name}: expected pages of {page_bytes} bytes that do not overlap, "
                         f"got a page stride of {page_stride}")
    if kind in GPU_KINDS and (op.ptr % PAGE_ADDRESS_ALIGNMENT or
                              page_stride % PAGE_ADDRESS_ALIGNMENT):
        raise ValueError(f"{name}: expected pages at addresses and strides that are multiples "
                         f"of {PAGE_ADDRESS_ALIGNMENT} bytes, got address {op.ptr:#x} and "
                         f"page stride {page_stride}")
    checks.check_writable(op)
    return CachePages(op, page_stride, num_pages, block_size)


def _pages_2d(cache, op: Operand, page_bytes: int):
    """The bound view's pages as ``[num_pages, page_bytes]`` of the same memory."""
    shape, strides = (op.shape[0], page_bytes), (op.strides[0], 1)
    if op.kind in (TORCH_CPU, TORCH_CUDA):
        return cache.as_strided(shape, strides, cache.storage_offset())
    if op.kind == CUPY:
        import cupy
        return cupy.lib.stride_tricks.as_strided(cache, shape, strides)
    return np.lib.stride_tricks.as_strided(cache, shape, strides, writeable=cache.flags.writeable)
