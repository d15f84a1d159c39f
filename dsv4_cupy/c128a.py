"""``build_c128a_topk_metadata``: the C128A (ratio-128) top-k rows and lengths."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, families, geometry, params, validation
from .arrays import INT32
from .families import POSITIONS_AXIS, SLOT_MAPPING_AXIS
from .scalars import check_int
from .spec import C128A_TOPK_ALIGNMENT, MAX_BLOCK_SIZE, round_up, visible_rows


def default_width(positions, kind: str, compress_ratio: int) -> int:
    """The smallest multiple of 128 that holds every row (reads positions: a sync on GPU)."""
    rows = visible_rows(arrays.host_copy(positions, kind).astype(np.int64), compress_ratio)
    return max(C128A_TOPK_ALIGNMENT, round_up(int(rows.max(initial=0)), C128A_TOPK_ALIGNMENT))


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
    pos, token_to_req, table, slots = (ops["positions"], ops["token_to_req_indices"],
                                       ops["block_table"], ops["slot_mapping"])
    positions_dtype = arrays.check(pos, POSITIONS_AXIS[1], 1)
    num_tokens = pos.shape[0]
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    num_decode_tokens = check_int("num_decode_tokens", num_decode_tokens, minimum=0,
                                  maximum=num_tokens)
    num_prefill_tokens = num_tokens - num_decode_tokens
    arrays.check(token_to_req, (INT32,), 1, min_len=num_decode_tokens)
    arrays.check(table, (INT32,), 2, min_len=1 if num_decode_tokens else None,
                 min_cols=1 if num_decode_tokens else None)
    slot_dtype = arrays.check(slots, SLOT_MAPPING_AXIS[1], 1, min_len=num_decode_tokens)

    row_buffers = [op for op in (ops["global_decode_buffer"], ops["prefill_buffer"])
                   if op is not None and len(op.shape) == 2]
    if max_compressed_tokens is not None:
        width = check_int("max_compressed_tokens", max_compressed_tokens, minimum=0)
        for op in row_buffers:
            if width > op.shape[1]:
                raise ValueError(f"max_compressed_tokens: expected at most the width of {op.name} "
                                 f"({op.shape[1]}), got {width}; a wider row would be "
                                 "written into the next row")
    elif row_buffers:
        width = min(op.shape[1] for op in row_buffers)
    else:
        width = default_width(positions, kind, compress_ratio)

    global_decode = arrays.output("global_decode_buffer", ops["global_decode_buffer"], kind,
                                  device, INT32, num_decode_tokens, width)
    lens = arrays.output("decode_lens_buffer", ops["decode_lens_buffer"], kind, device, INT32,
                         num_decode_tokens)
    prefill = arrays.output("prefill_buffer", ops["prefill_buffer"], kind, device, INT32,
                            num_prefill_tokens, width)
    arrays.check_no_alias([global_decode, lens, prefill], [pos, token_to_req, table, slots])
    full = validation.check_mode(validate)
    if full:
        validation.c128a_inputs(positions, token_to_req_indices, block_table, kind,
                                num_decode_tokens, compress_ratio, width, block_size,
                                num_cache_blocks)

    if kind in arrays.GPU_KINDS:
        if num_tokens:
            chunks = geometry.row_chunks(num_tokens, width, device)
            families.C128A.launch(
                device, chunks[2], arrays.launch_stream(kind, device), (positions_dtype, slot_dtype),
                positions=pos.ptr, token_to_req=token_to_req.ptr, slot_mapping=slots.ptr,
                table=arrays.block_table_group(table),
                geometry=params.SLOT_GEOMETRY.values(
                    block_size=block_size, ratio=compress_ratio, cp_world_size=1, cp_rank=0,
                    cp_interleave=1),
                rows=params.C128A_ROWS.values(
                    global_decode=global_decode.ptr, decode_lens=lens.ptr, prefill=prefill.ptr,
                    decode_stride=arrays.row_stride(global_decode),
                    prefill_stride=arrays.row_stride(prefill), width=width, num_valid_tokens=-1),
                chunks=params.ROW_CHUNKS.values(cols_per_block=chunks[0], chunks=chunks[1],
                                                row_blocks=chunks[2]),
                num_tokens=num_tokens, num_decode_tokens=num_decode_tokens)
    else:
        host = arrays.host_view
        host_token_to_req = host(token_to_req_indices, kind)
        if not full:                  # the CPU path always checks request ids
            validation.request_ids(host_token_to_req, arrays.NUMPY, num_decode_tokens,
                                   table.shape[0])
        cpu.c128a_topk_metadata(host(positions, kind), np.int64(compress_ratio),
                                np.int64(num_decode_tokens), host_token_to_req,
                                host(block_table, kind), np.int64(block_size),
                                host(slot_mapping, kind), np.int64(width),
                                host(global_decode.array, kind), host(lens.array, kind),
                                host(prefill.array, kind))
    return (global_decode.array[:num_decode_tokens, :width], lens.array[:num_decode_tokens],
            prefill.array[:num_prefill_tokens, :width])
