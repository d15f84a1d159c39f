"""``build_c128a_topk_metadata``: the C128A (ratio-128) top-k rows and lengths."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, kernels
from .arrays import INT32, INT64
from .spec import C128A_TOPK_ALIGNMENT, round_up

POSITION_DTYPES = SLOT_DTYPES = (INT32, INT64)


def entry_name(prefix: str, positions_dtype: np.dtype, slot_dtype: np.dtype) -> str:
    """The kernel entry point for a (positions, slot mapping) dtype pair."""
    return f"{prefix}_p{positions_dtype.itemsize * 8}_s{slot_dtype.itemsize * 8}"


def check_request_ids(token_to_req: np.ndarray, num_rows: int) -> None:
    """CPU-side check that every decode token's request has a block-table row."""
    if token_to_req.size and (token_to_req.min() < 0 or token_to_req.max() >= num_rows):
        bad = int(np.flatnonzero((token_to_req < 0) | (token_to_req >= num_rows))[0])
        raise ValueError(f"token_to_req_indices: expected request ids in [0, {num_rows}) "
                         f"(block_table rows), got {int(token_to_req[bad])} at token {bad}")


def _max_visible_rows(positions, kind: str, compress_ratio: int) -> int:
    """Largest visible-row count in the batch (reads positions: a sync on GPU)."""
    if positions.shape[0] == 0:
        return 0
    source = positions if kind in arrays.GPU_KINDS else arrays.host_view(positions, kind)
    return max((int(source.max()) + 1) // compress_ratio, 0)


def build_c128a_topk_metadata(positions, compress_ratio: int, num_decode_tokens: int,
                              token_to_req_indices, block_table, block_size: int, slot_mapping,
                              global_decode_buffer=None, decode_lens_buffer=None,
                              prefill_buffer=None, max_compressed_tokens: int | None = None):
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
    buffers = {"global_decode_buffer": global_decode_buffer,
               "decode_lens_buffer": decode_lens_buffer, "prefill_buffer": prefill_buffer}
    inputs = {"positions": positions, "token_to_req_indices": token_to_req_indices,
              "block_table": block_table, "slot_mapping": slot_mapping}
    kind, device = arrays.common_kind({**inputs, **buffers})
    positions_dtype = arrays.check("positions", positions, kind, POSITION_DTYPES, 1)
    num_tokens = positions.shape[0]
    compress_ratio = arrays.check_int("compress_ratio", compress_ratio, minimum=1)
    block_size = arrays.check_int("block_size", block_size, minimum=1)
    nd = arrays.check_int("num_decode_tokens", num_decode_tokens, minimum=0, maximum=num_tokens)
    num_prefill = num_tokens - nd
    arrays.check("token_to_req_indices", token_to_req_indices, kind, (INT32,), 1, min_len=nd)
    arrays.check("block_table", block_table, kind, (INT32,), 2,
                 min_len=1 if nd else None, min_cols=1 if nd else None)
    slot_dtype = arrays.check("slot_mapping", slot_mapping, kind, SLOT_DTYPES, 1, min_len=nd)

    widths = {name: buf.shape[1] for name, buf in buffers.items()
              if buf is not None and name != "decode_lens_buffer" and buf.ndim == 2}
    if max_compressed_tokens is not None:
        width = arrays.check_int("max_compressed_tokens", max_compressed_tokens, minimum=0)
        for name, buffer_width in widths.items():
            if width > buffer_width:
                raise ValueError(f"max_compressed_tokens: expected at most the width of {name} "
                                 f"({buffer_width}), got {width}; a wider row would be "
                                 "written into the next row")
    elif widths:
        width = min(widths.values())
    else:
        rows = _max_visible_rows(positions, kind, compress_ratio)
        width = max(C128A_TOPK_ALIGNMENT, round_up(rows, C128A_TOPK_ALIGNMENT))

    gd = arrays.output("global_decode_buffer", global_decode_buffer, kind, device, INT32, nd, width)
    lens = arrays.output("decode_lens_buffer", decode_lens_buffer, kind, device, INT32, nd)
    pf = arrays.output("prefill_buffer", prefill_buffer, kind, device, INT32, num_prefill, width)
    arrays.check_no_alias(kind, {"global_decode_buffer": gd, "decode_lens_buffer": lens,
                                 "prefill_buffer": pf}, inputs)

    if kind in arrays.GPU_KINDS:
        if num_tokens:
            per_block, chunks = kernels.row_geometry(num_tokens, width, device)
            a = arrays.kernel_arg
            kernels.launch(
                "c128a.cu", entry_name("c128a_topk_metadata", positions_dtype, slot_dtype), device,
                num_tokens * chunks,
                (a(positions, kind), np.int64(num_tokens), np.int64(compress_ratio), np.int64(nd),
                 a(token_to_req_indices, kind), a(block_table, kind),
                 np.int64(block_table.shape[0]), np.int64(block_table.shape[1]),
                 np.int64(arrays.row_stride(block_table, kind)), np.int32(block_size),
                 a(slot_mapping, kind), np.int32(width), a(gd, kind),
                 np.int64(arrays.row_stride(gd, kind)), a(lens, kind), a(pf, kind),
                 np.int64(arrays.row_stride(pf, kind)), np.int32(per_block), np.int32(chunks)),
                arrays.launch_stream(kind, device))
    else:
        h = arrays.host_view
        t2r = h(token_to_req_indices, kind)
        if nd:
            check_request_ids(t2r[:nd], block_table.shape[0])
        cpu.c128a_topk_metadata(h(positions, kind), np.int64(compress_ratio), np.int64(nd), t2r,
                                h(block_table, kind), np.int64(block_size), h(slot_mapping, kind),
                                np.int64(width), h(gd, kind), h(lens, kind), h(pf, kind))
    return gd[:nd, :width], lens[:nd], pf[:num_prefill, :width]
