"""The C4A (ratio-4) layer ops: ``compute_global_topk_indices_and_lens`` (decode
rows, local -> global) and ``fill_short_context_topk_indices`` (the
dense-to-sparse shortcut)."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, families, geometry, validation
from .arrays import BOOL, INT32
from .families import POSITIONS_AXIS
from .loader import RUN_TIME
from .prepared import CheckedCall, PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

_GLOBAL_TOPK = PreparedOp("compute_global_topk_indices_and_lens")
_SHORT_CONTEXT = PreparedOp("fill_short_context_topk_indices")


def compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table,
                                         block_size: int, is_valid_token, *, out=None,
                                         compact: bool = False, validate: str = "default"):
    """Request-local compressed rows of each decode token to global slots, and their count.

    vLLM's ``compute_global_topk_indices_and_lens`` (upstream.md §4) with the
    later hardening: request and block-column bounds, all -1 padding rows, and
    optional compaction.

    Parameters
    ----------
    topk_indices : int32 array ``[T, K]`` (rows contiguous, any row stride)
        The indexer's top-k rows (request-local compressed rows; -1 or anything).
    token_to_req_indices : int32 array ``[>= T]``
    block_table : int32 array ``[R, max_blocks]`` (rows contiguous, any row stride)
        The C4A group's table.
    block_size : int
        Compressed rows per cache block (``256 // 4 = 64``).
    is_valid_token : bool array ``[>= T]``
        False for padding tokens.
    out : ``(indices, lens)``, optional
        ``indices``: int32 ``[>= T, >= K]``, which may be ``topk_indices`` itself
        (same first element and row stride: converted in place); ``lens``: int32
        ``[>= T]``. Any other overlap with an input is an error.
    compact : bool
        Pack the valid entries of a row to its front (in order), -1 after.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) that valid tokens' request ids are
        rows of the table.

    Returns
    -------
    ``(indices [T, K] int32, lens [T] int32)``. Entry ``x`` of token ``t``
    (request ``req``) is valid when ``x >= 0`` and ``x // bs < block_table.shape[1]``
    (the logical width, never the row stride): it becomes
    ``block_table[req, x // bs] * bs + x % bs`` (int32, wrapping); any other
    entry (the 0x7FC00000 NaN pattern included) becomes -1 and is not counted.
    ``lens`` counts the valid entries. A token that is not valid, or whose
    request is outside the table, gets an all -1 row and length 0.
    """
    key, results = _GLOBAL_TOPK.replay(validate, out, topk_indices, token_to_req_indices,
                                       block_table, block_size, is_valid_token, compact)
    if results is not None:
        return results
    return _GLOBAL_TOPK.run(key, global_topk_family(compact), check_global_topk(
        topk_indices, token_to_req_indices, block_table, block_size, is_valid_token, compact,
        out, validate))


def global_topk_family(compact: bool):
    """The kernels of ``compute_global_topk_indices_and_lens``'s rows, compacted or not."""
    return families.GLOBAL_TOPK_COMPACT if compact else families.GLOBAL_TOPK


def check_global_topk(topk_indices, token_to_req_indices, block_table, block_size,
                      is_valid_token, compact, out, validate) -> CheckedCall:
    """The checks of ``compute_global_topk_indices_and_lens``, and its launch or CPU call."""
    indices_out, lens_out = arrays.out_buffers(out, ("indices", "lens"))
    kind, device, ops = arrays.probe_all({
        "topk_indices": topk_indices, "token_to_req_indices": token_to_req_indices,
        "block_table": block_table, "is_valid_token": is_valid_token, "out[0]": indices_out,
        "out[1]": lens_out})
    topk, token_to_req, table, valid = (ops["topk_indices"], ops["token_to_req_indices"],
                                        ops["block_table"], ops["is_valid_token"])
    arrays.check(topk, (INT32,), 2)
    num_tokens, width = topk.shape
    arrays.check_row_width("topk_indices.shape[1]", width)
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    if not isinstance(compact, (bool, np.bool_)):
        raise TypeError(f"compact: expected a bool, got {type(compact).__name__}")
    arrays.check(token_to_req, (INT32,), 1, min_len=num_tokens)
    arrays.check(table, (INT32,), 2)
    arrays.check(valid, (BOOL,), 1, min_len=num_tokens)
    indices = arrays.output("out[0]", ops["out[0]"], kind, device, INT32, num_tokens, width)
    lens = arrays.output("out[1]", ops["out[1]"], kind, device, INT32, num_tokens)
    in_place = ops["out[0]"] is not None and arrays.is_same_rows(indices, topk)
    others = [token_to_req, table, valid]
    arrays.check_no_alias([indices], others + ([] if in_place else [topk]))
    arrays.check_no_alias([lens], others + [topk, indices])
    if validation.check_mode(validate):
        validation.request_ids(token_to_req_indices, kind, num_tokens, table.shape[0],
                               is_valid_token=is_valid_token)
    results = indices.array[:num_tokens, :width], lens.array[:num_tokens]

    if kind in arrays.GPU_KINDS:
        fields = dict(
            table=arrays.block_table_group(table), topk_indices=topk.ptr,
            token_to_req=token_to_req.ptr, is_valid_token=valid.ptr, out=indices.ptr,
            lens=lens.ptr, topk_stride=arrays.row_stride(topk),
            out_stride=arrays.row_stride(indices), width=width, num_tokens=num_tokens,
            block_size=block_size)
        # A compiled-in K also means rows of 16-byte vectors (kernels/global_topk.cu).
        width_in = (families.GLOBAL_TOPK.compiled_in("k", width)
                    if arrays.vector_rows(topk, indices) else RUN_TIME)
        variant = () if compact else (width_in, families.GLOBAL_TOPK.compiled_in("b", block_size),
                                      geometry.topk_row_threads(width_in))
        blocks = geometry.check_grid(geometry.block_rows(num_tokens), num_tokens, "topk_indices")
        return CheckedCall(kind, device, results, blocks, fields, None, variant)

    def run_cpu():
        view, view_2d = arrays.kernel_view, arrays.kernel_view_2d
        flat_topk, topk_stride = view_2d(topk_indices, kind)
        flat_table, table_stride = view_2d(block_table, kind)
        flat_out, out_stride = view_2d(indices.array, kind)
        cpu.global_topk_indices_and_lens(
            flat_topk, topk_stride, np.int64(num_tokens), np.int64(width),
            view(token_to_req_indices, kind), view(is_valid_token, kind), flat_table,
            table_stride, np.int64(table.shape[0]), np.int64(table.shape[1]),
            np.int64(block_size), bool(compact), flat_out, out_stride, view(lens.array, kind))
    return CheckedCall(kind, device, results, 0, None, run_cpu)


def fill_short_context_topk_indices(positions, top_k: int, compress_ratio: int,
                                    num_tokens: int | None = None, *, out=None,
                                    validate: str = "default"):
    """"Every candidate" top-k rows, for when no token sees more than ``top_k``
    compressed rows (vLLM's ``_fill_short_context_topk_indices``, upstream.md §5).

    Parameters
    ----------
    positions : int32 or int64 array ``[>= num_tokens]``
    top_k : int
        Columns per row (``index_topk``: 512 Flash, 1024 Pro).
    compress_ratio : int
        4 for C4A layers.
    num_tokens : int, optional
        Rows to write; default ``len(positions)``.
    out : int32 array ``[>= num_tokens, >= top_k]`` (rows contiguous, any row stride), optional
        Persistent buffer (upstream's ``topk_indices_buffer``); only the result
        region is written, so a wider buffer keeps its other columns.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the shortcut's precondition: no
        token sees more than ``top_k`` rows (vLLM #52492).

    Returns
    -------
    int32 array ``[num_tokens, top_k]``: row ``t`` holds ``k`` for
    ``k < (positions[t] + 1) // compress_ratio`` (truncating toward zero) and
    -1 after; rows are never longer than ``top_k``.
    """
    key, results = _SHORT_CONTEXT.replay(validate, (out,), positions, top_k, compress_ratio,
                                         num_tokens)
    if results is not None:
        return results
    kind, device, ops = arrays.probe_all({"positions": positions, "out": out})
    pos = ops["positions"]
    positions_dtype = arrays.check(pos, POSITIONS_AXIS[1], 1)
    top_k = arrays.check_row_width("top_k", top_k)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    num_tokens = check_int("num_tokens", pos.shape[0] if num_tokens is None else num_tokens,
                           minimum=0, maximum=pos.shape[0])
    rows = arrays.output("out", ops["out"], kind, device, INT32, num_tokens, top_k)
    arrays.check_no_alias([rows], [pos])
    if validation.check_mode(validate):
        validation.short_context_inputs(positions, kind, num_tokens, top_k, compress_ratio)

    result = rows.array[:num_tokens, :top_k]
    if kind in arrays.GPU_KINDS:
        plans = ()
        if num_tokens and top_k:        # rows of no columns: nothing to write, no grid to size
            lanes = geometry.row_lanes(num_tokens, device)
            threads = geometry.row_block_threads(lanes)
            family = families.SHORT_CONTEXT
            variant = (positions_dtype, lanes, family.compiled_in("k", top_k),
                       family.compiled_in("r", compress_ratio), threads)
            plans = (family.plan(
                device, geometry.row_lane_blocks(num_tokens, lanes, threads), variant,
                positions=pos.ptr, out=rows.ptr, out_stride=arrays.row_stride(rows),
                top_k=top_k, ratio=compress_ratio, num_tokens=num_tokens),)
        return _SHORT_CONTEXT.launch(key, plans, kind, device, result, (result,))
    else:
        flat_rows, rows_stride = arrays.kernel_view_2d(rows.array, kind)
        cpu.short_context_topk_indices(
            arrays.kernel_view(positions, kind), np.int64(num_tokens), np.int64(top_k),
            np.int64(compress_ratio), flat_rows, rows_stride)
    return result
