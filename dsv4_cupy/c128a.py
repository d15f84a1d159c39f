"""``build_c128a_topk_metadata``: the C128A (ratio-128) top-k rows and lengths."""
from __future__ import annotations

import functools

import numpy as np

from . import arrays, cpu, kernels, params, validation
from .arrays import INT32, INT64
from .spec import C128A_TOPK_ALIGNMENT, round_up

POSITION_DTYPES = SLOT_DTYPES = (INT32, INT64)


@functools.lru_cache(maxsize=None)
def entry_name(prefix: str, positions_dtype: np.dtype, slot_dtype: np.dtype) -> str:
    """The kernel entry point for a (positions, slot mapping) dtype pair."""
    return f"{prefix}_p{positions_dtype.itemsize * 8}_s{slot_dtype.itemsize * 8}"


def build_c128a_topk_metadata(positions, compress_ratio: int, num_decode_tokens: int,
                              token_to_req_indices, block_table, block_size: int, slot_mapping,
                              global_decode_buffer=None, decode_lens_buffer=None,
                              prefill_buffer=None, max_compressed_tokens: int | None = None, *,
                              validate: str = "default", num_cache_blocks: int | None = None):
    """C128A metadata for all tokens of a step (decodes first, then prefills).

    Parameters
    ----------
    positions : int32 or int64 array ``[T]``
        Position of each token (decode tokens first).
    compress_ratio : int
        128 for C128A layers.
    num_decode_tokens : int
        ``nd`` in ``[0, T]``: tokens ``t < nd`` are decode tokens.
    token_to_req_indices : int32 array ``[>= nd]``
        Request of each token (from ``token_to_req_indices``).
    block_table : int32 array ``[R, max_blocks]`` (rows contiguous, any row stride)
        Read for decode tokens only; not clamped (as in the seed).
    block_size : int
        Compressed rows per cache block (``256 // 128 = 2``).
    slot_mapping : int32 or int64 array ``[>= nd]``
        The group's *uncompressed* slot mapping: a decode token with a negative
        slot is CUDA-graph padding and gets length 0.
    global_decode_buffer, prefill_buffer : int32 arrays ``[rows, >= W]``, optional
    decode_lens_buffer : int32 array ``[>= nd]``, optional
        Persistent outputs; results are views of them (their row stride kept).
        Missing ones are allocated, of the inputs' kind.
    max_compressed_tokens : int, optional
        ``W``, columns per row. Defaults to the buffers' width, or without
        buffers to the smallest multiple of 128 that holds every row (which
        reads ``positions``: pass ``W`` to keep a GPU call free of syncs).
    validate : "default" or "full"
        "full" also checks (a sync on GPU) that decode tokens' request ids are
        block-table rows and that their blocks lie inside the table row and,
        with ``num_cache_blocks``, inside the cache. By default the kernel
        clamps such indices instead (nothing is read or written out of range);
        the CPU path always checks request ids.

    Returns
    -------
    ``(global_decode [nd, W], decode_lens [nd], prefill_local [T - nd, W])``, int32.
    With ``n = min((p + 1) // compress_ratio, W)`` (division truncating toward
    zero, as the seed does): decode row ``e < n`` holds
    ``block_table[req, e // block_size] * block_size + e % block_size``, prefill
    row ``e < n`` holds ``e``, every other column of the ``W`` is -1; the
    length is ``max(n, 0)``, or 0 for padding. Columns at or past ``W`` and
    rows past the tokens are never written.
    """
    kind, device, ops = arrays.probe_all({
        "positions": positions, "token_to_req_indices": token_to_req_indices,
        "block_table": block_table, "slot_mapping": slot_mapping,
        "global_decode_buffer": global_decode_buffer, "decode_lens_buffer": decode_lens_buffer,
        "prefill_buffer": prefill_buffer})
    pos, t2r, table, slots = (ops["positions"], ops["token_to_req_indices"], ops["block_table"],
                              ops["slot_mapping"])
    positions_dtype = arrays.check(pos, POSITION_DTYPES, 1)
    num_tokens = pos.shape[0]
    compress_ratio = arrays.check_int("compress_ratio", compress_ratio, minimum=1)
    block_size = arrays.check_int("block_size", block_size, minimum=1, maximum=1 << 30)
    nd = arrays.check_int("num_decode_tokens", num_decode_tokens, minimum=0, maximum=num_tokens)
    num_prefill = num_tokens - nd
    arrays.check(t2r, (INT32,), 1, min_len=nd)
    arrays.check(table, (INT32,), 2, min_len=1 if nd else None, min_cols=1 if nd else None)
    slot_dtype = arrays.check(slots, SLOT_DTYPES, 1, min_len=nd)

    row_buffers = [op for op in (ops["global_decode_buffer"], ops["prefill_buffer"])
                   if op is not None and len(op.shape) == 2]
    if max_compressed_tokens is not None:
        width = arrays.check_int("max_compressed_tokens", max_compressed_tokens, minimum=0)
        for op in row_buffers:
            if width > op.shape[1]:
                raise ValueError(f"max_compressed_tokens: expected at most the width of {op.name} "
                                 f"({op.shape[1]}), got {width}; a wider row would be "
                                 "written into the next row")
    elif row_buffers:
        width = min(op.shape[1] for op in row_buffers)
    else:
        # Reads positions: a sync on GPU (documented; pass the width to avoid it).
        rows = validation.visible_rows(positions, kind, num_tokens, compress_ratio, 1 << 31)
        width = max(C128A_TOPK_ALIGNMENT, round_up(int(rows.max(initial=0)), C128A_TOPK_ALIGNMENT))

    gd = arrays.output("global_decode_buffer", ops["global_decode_buffer"], kind, device, INT32,
                       nd, width)
    lens = arrays.output("decode_lens_buffer", ops["decode_lens_buffer"], kind, device, INT32, nd)
    pf = arrays.output("prefill_buffer", ops["prefill_buffer"], kind, device, INT32, num_prefill,
                       width)
    arrays.check_no_alias([gd, lens, pf], [pos, t2r, table, slots])
    full = validation.check_mode(validate)
    if full:
        validation.c128a_inputs(positions, token_to_req_indices, block_table, kind, nd,
                                compress_ratio, width, block_size, num_cache_blocks)

    if kind in arrays.GPU_KINDS:
        if num_tokens:
            per_block, chunks = kernels.row_geometry(num_tokens, width, device)
            kernels.launch(
                "c128a.cu", entry_name("c128a_topk_metadata", positions_dtype, slot_dtype), device,
                num_tokens * chunks,
                params.C128A, (
                    pos.ptr, t2r.ptr, table.ptr, slots.ptr, gd.ptr, lens.ptr, pf.ptr, num_tokens,
                    compress_ratio, nd, table.shape[0], table.shape[1], arrays.row_stride(table),
                    arrays.row_stride(gd), arrays.row_stride(pf), block_size, width, per_block,
                    chunks),
                arrays.launch_stream(kind, device))
    else:
        h = arrays.host_view
        host_t2r = h(token_to_req_indices, kind)
        if not full:                  # the CPU path always checks request ids
            validation.request_ids(host_t2r, arrays.NUMPY, nd, table.shape[0])
        cpu.c128a_topk_metadata(h(positions, kind), np.int64(compress_ratio), np.int64(nd),
                                host_t2r, h(block_table, kind), np.int64(block_size),
                                h(slot_mapping, kind), np.int64(width), h(gd.array, kind),
                                h(lens.array, kind), h(pf.array, kind))
    return gd.array[:nd, :width], lens.array[:nd], pf.array[:num_prefill, :width]
