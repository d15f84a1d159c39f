"""``compute_swa_indices_and_lens``: the sliding-window (SWA) rows of a step's tokens."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, families, geometry, params, validation
from .arrays import BOOL, INT32
from .loader import RUN_TIME
from .prepared import PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

_PREPARED = PreparedOp("compute_swa_indices_and_lens")


def compute_swa_indices_and_lens(window_size: int, query_start_loc, seq_lens,
                                 token_to_req_indices, is_valid_token, block_table,
                                 block_size: int, token_offset: int = 0,
                                 num_rows: int | None = None, *, out=None,
                                 validate: str = "default"):
    """SWA-cache slots of the last ``min(p + 1, window_size)`` positions of each token.

    vLLM's ``_compute_swa_indices_and_lens_kernel`` (upstream.md §2), hardened.
    Upstream launches it twice per step: decode rows (``token_offset=0``,
    ``num_rows=num_decode_tokens``) and prefill rows (``token_offset=
    num_decode_tokens``).

    Parameters
    ----------
    window_size : int
        ``W``, columns per row (128 for DeepSeek-V4).
    query_start_loc : int32 array ``[R + 1]``
    seq_lens : int32 array ``[R]``
        Sequence lengths including this step's queries.
    token_to_req_indices : int32 array ``[>= token_offset + num_rows]``
    is_valid_token : bool array ``[>= token_offset + num_rows]``
        ``slot_mapping >= 0`` of the SWA group (False for padding tokens).
    block_table : int32 array ``[R, max_blocks]`` (rows contiguous, any row stride)
        The **SWA group's** table.
    block_size : int
        SWA-cache rows per block (64).
    token_offset : int
        Output row ``i`` is token ``i + token_offset``.
    num_rows : int, optional
        Rows to write; default ``len(token_to_req_indices) - token_offset``.
    out : ``(indices, lens)``, optional
        ``indices``: int32 ``[>= num_rows, 1, >= W]`` (or ``[>= num_rows, >= W]``),
        ``lens``: int32 ``[>= num_rows]``; persistent buffers, results are views.
        Only the result region is written.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the query layout, that valid tokens'
        requests are table rows at positions >= 0 whose block is in the table.

    Returns
    -------
    ``(indices [num_rows, 1, W] int32, lens [num_rows] int32)``. With ``b`` the
    token's request and ``p = seq_lens[b] - q[b] + (t - query_start_loc[b])``,
    ``s = max(p - W + 1, 0)``: entry ``k < min(p + 1, W)`` is
    ``block_table[b, (s + k) // bs] * bs + (s + k) % bs`` (int32, wrapping), -1
    after; ``lens`` counts the entries. An invalid token, a request outside the
    table (or ``seq_lens``) or ``p < 0`` gets an all -1 row and length 0 (upstream
    leaves such rows stale); window positions past the table row's blocks are
    -1 and not counted.
    """
    key, results = _PREPARED.replay(validate, out, window_size, query_start_loc, seq_lens,
                                    token_to_req_indices, is_valid_token, block_table,
                                    block_size, token_offset, num_rows)
    if results is not None:
        return results
    indices_out, lens_out = arrays.out_buffers(out, ("indices", "lens"))
    kind, device, ops = arrays.probe_all({
        "query_start_loc": query_start_loc, "seq_lens": seq_lens,
        "token_to_req_indices": token_to_req_indices, "is_valid_token": is_valid_token,
        "block_table": block_table,
        "out[0]": arrays.head_axis_dropped("out[0]", indices_out), "out[1]": lens_out})
    qsl, seq, token_to_req, valid, table = (
        ops["query_start_loc"], ops["seq_lens"], ops["token_to_req_indices"],
        ops["is_valid_token"], ops["block_table"])
    window_size = arrays.check_row_width("window_size", window_size, minimum=1)
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    arrays.check(qsl, (INT32,), 1, min_len=1)
    arrays.check(seq, (INT32,), 1)
    arrays.check(table, (INT32,), 2)
    arrays.check(token_to_req, (INT32,), 1)
    num_tokens = token_to_req.shape[0]
    token_offset = check_int("token_offset", token_offset, minimum=0, maximum=num_tokens)
    num_rows = check_int("num_rows", num_tokens - token_offset if num_rows is None else num_rows,
                         minimum=0, maximum=num_tokens - token_offset)
    arrays.check(valid, (BOOL,), 1, min_len=token_offset + num_rows)
    indices = arrays.output("out[0]", ops["out[0]"], kind, device, INT32, num_rows, window_size)
    lens = arrays.output("out[1]", ops["out[1]"], kind, device, INT32, num_rows)
    arrays.check_no_alias([indices, lens], [qsl, seq, token_to_req, valid, table])
    if validation.check_mode(validate):
        validation.swa_inputs(query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
                              block_table, kind, token_offset, num_rows, block_size)
    num_reqs = min(qsl.shape[0] - 1, seq.shape[0])

    results = (arrays.with_head_axis(indices.array, num_rows, window_size),
               lens.array[:num_rows])
    if kind in arrays.GPU_KINDS:
        plans = ()
        if num_rows:
            # The compiled-in window's 32-bit positions need the table's span under the limit.
            fits = table.shape[1] * block_size + window_size <= geometry.POSITION_LIMIT
            lanes = geometry.row_lanes(num_rows, device)
            threads = geometry.row_block_threads(lanes)
            variant = (families.SWA.compiled_in("w", window_size) if fits else RUN_TIME,
                       families.SWA.compiled_in("b", block_size), lanes, threads)
            plans = (families.SWA.plan(
                device, geometry.row_lane_blocks(num_rows, lanes, threads), variant,
                query=params.QUERY_LAYOUT.values(query_start_loc=qsl.ptr, seq_lens=seq.ptr,
                                                 num_reqs=num_reqs),
                table=arrays.block_table_group(table), token_to_req=token_to_req.ptr,
                is_valid_token=valid.ptr, indices=indices.ptr, lens=lens.ptr,
                indices_stride=arrays.row_stride(indices), window_size=window_size,
                block_size=block_size, token_offset=token_offset, num_rows=num_rows,
                guess_shift=geometry.request_guess_shift(num_tokens, num_reqs)),)
        return _PREPARED.launch(key, plans, kind, device, results, results)
    else:
        view = arrays.kernel_view
        flat_table, table_stride = arrays.kernel_view_2d(block_table, kind)
        flat_indices, indices_stride = arrays.kernel_view_2d(indices.array, kind)
        cpu.swa_indices_and_lens(
            view(query_start_loc, kind), np.int64(num_reqs), view(seq_lens, kind),
            view(token_to_req_indices, kind), view(is_valid_token, kind), flat_table,
            table_stride, np.int64(table.shape[0]), np.int64(table.shape[1]),
            np.int64(block_size), np.int64(window_size), np.int64(token_offset),
            np.int64(num_rows), flat_indices, indices_stride, view(lens.array, kind))
    return results
