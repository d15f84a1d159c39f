"""``compute_swa_indices_and_lens``: the sliding-window (SWA) rows of a step's tokens."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import prange

from . import checks, geometry, validation
from .cpu import ParallelKernel
from .family import ROW_LANES_AXIS, ROW_THREADS_AXIS, SWA_BLOCK_AXIS, SWA_WINDOW_AXIS, KernelFamily
from .geometry import row_block_threads
from .kinds import BOOL, INT32, Operand, probe_all
from .launch import Launch, optional, table_of
from .params import BLOCK_TABLE, I64, PTR, QUERY_LAYOUT, Params, QueryLayout
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

PARAMS = Params("SwaParams", [
    ("query", QUERY_LAYOUT), ("table", BLOCK_TABLE), ("token_to_req", PTR),
    ("is_valid_token", PTR), ("indices", PTR), ("lens", PTR), ("left_visible", PTR),
    ("right_visible", PTR), ("replay_start", PTR), ("indices_stride", I64),
    ("window_size", I64), ("index_width", I64), ("causal", I64), ("block_size", I64),
    ("token_offset", I64), ("num_rows", I64), ("guess_shift", I64)])


@ParallelKernel
def cpu_swa_indices_and_lens(query, table, token_to_req, is_valid_token, indices, lens,
                             left_visible, right_visible, replay_start, indices_stride,
                             window_size, index_width, causal, block_size, token_offset,
                             num_rows):
    """Row i (token i + token_offset): the SWA slots of the last min(p + 1, W)
    positions (widened by the token's image visibility, from the request's
    replay start on; non-causal: the request's [max(L - q - W, 0), L)), -1
    after, index_width columns; an invalid token, a request outside the table
    or seq_lens, or p < 0 gives an all -1 row and length 0; positions past the
    table row's blocks are -1 and not counted."""
    qsl, seq_lens, num_reqs = query
    entries, table_rows, table_cols, table_stride = table
    for i in prange(num_rows):
        t = i + token_offset
        b = np.int64(token_to_req[t])
        start = np.int64(0)
        count = np.int64(0)
        if is_valid_token[t] and 0 <= b < num_reqs and b < table_rows:
            qs = np.int64(qsl[b])
            qe = np.int64(qsl[b + 1])
            position = np.int64(seq_lens[b]) - (qe - qs) + (t - qs)
            if position >= 0:
                last, reach, before, after, floor = position, window_size, 0, 0, 0
                if left_visible.shape[0] > 0:
                    before = max(np.int64(left_visible[t]) - (window_size - 1), 0)
                    after = np.int64(right_visible[t])
                if replay_start.shape[0] > 0:
                    floor = np.int64(replay_start[b])
                if not causal:
                    last = position + (qe - 1 - t)
                    reach = window_size + (qe - qs)
                start = max(last - reach + 1 - before, 0, floor)
                end = min(last + 1 + after, table_cols * block_size)
                count = min(max(end - start, 0), index_width)
        row = i * indices_stride
        for k in range(count):
            at = start + k
            indices[row + k] = np.int32(
                entries[b * table_stride + at // block_size] * block_size + at % block_size)
        indices[row + count:row + index_width] = -1
        lens[i] = count


FAMILY = KernelFamily("swa.cuh", "swa_indices_and_lens", PARAMS,
                      (SWA_WINDOW_AXIS, SWA_BLOCK_AXIS, ROW_LANES_AXIS, ROW_THREADS_AXIS),
                      where=lambda window, block_size, lanes, threads: (
                          threads == row_block_threads(lanes)),
                      threads_axis="threads")
CPU_KERNEL = cpu_swa_indices_and_lens
FAMILIES = (FAMILY,)

_OP = PreparedOp("compute_swa_indices_and_lens")


def compute_swa_indices_and_lens(window_size: int, query_start_loc, seq_lens,
                                 token_to_req_indices, is_valid_token, block_table,
                                 block_size: int, token_offset: int = 0,
                                 num_rows: int | None = None, *, index_width: int | None = None,
                                 left_visible=None, right_visible=None, replay_start=None,
                                 causal: bool = True, out=None, validate: str = "default"):
    """SWA-cache slots of the last ``min(p + 1, window_size)`` positions of each token.

    vLLM 0.34's ``_compute_swa_indices_and_lens_kernel`` (and, ``causal=False``,
    its ``ComputeDSparkNoncausalSWAIndicesKernel``), hardened. Upstream
    launches it twice per step: decode rows (``token_offset=0``,
    ``num_rows=num_decode_tokens``) and prefill rows (``token_offset=
    num_decode_tokens``, ``index_width = window + max_image_tokens``).

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
    index_width : int, optional
        Columns per row, ``>= W`` (default ``W``): ``W + max_image_tokens`` for
        prefill rows with images, ``get_dspark_swa_index_width`` for DSpark's.
    left_visible, right_visible : int32 arrays ``[>= token_offset + num_rows]``, optional
        Image visibility of the tokens (``compute_image_visibility``): ``l``
        image positions a token sees before its window and ``r`` after
        itself. Both or neither.
    replay_start : int32 array ``[R]``, optional
        Per request, the first position whose window KV exists (V4.1 bounded
        replay): no row entry lies before it.
    causal : bool
        False: DSpark's non-causal draft rows, every token of a request sees
        ``[max(L - q - W, 0), L)``; images and the replay start are not read
        (vLLM's DSpark kernel takes neither).
    out : ``(indices, lens)``, optional
        ``indices``: int32 ``[>= num_rows, 1, >= index_width]`` (or without the
        unit axis), ``lens``: int32 ``[>= num_rows]``; persistent buffers,
        results are views. Only the result region is written.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the query layout, that valid tokens'
        requests are table rows at positions >= 0 whose block is in the table.

    Returns
    -------
    ``(indices [num_rows, 1, index_width] int32, lens [num_rows] int32)``. With
    ``b`` the token's request and ``p = seq_lens[b] - q[b] + (t -
    query_start_loc[b])``, the window ``[s, e)`` is ``s = max(p - W + 1 -
    max(l - W + 1, 0), 0, replay_start[b])``, ``e = p + r + 1`` (``l = r = 0``
    without images): entry ``k < e - s`` is ``block_table[b, (s + k) // bs] *
    bs + (s + k) % bs`` (int32, wrapping), -1 after; ``lens`` counts the
    entries, at least 0 (vLLM's can go negative past a replay start) and at
    most ``index_width``. An invalid token, a request outside the table (or
    ``seq_lens``) or ``p < 0`` gets an all -1 row and length 0 (upstream
    leaves such rows stale); window positions past the table row's blocks are
    -1 and not counted.
    """
    key, results = _OP.replay(validate, out, window_size, query_start_loc, seq_lens,
                              token_to_req_indices, is_valid_token, block_table, block_size,
                              token_offset, num_rows, index_width, left_visible, right_visible,
                              replay_start, causal)
    if results is not None:
        return results
    indices_out, lens_out = checks.out_buffers(out, ("indices", "lens"))
    kind, device, ops = probe_all({
        "query_start_loc": query_start_loc, "seq_lens": seq_lens,
        "token_to_req_indices": token_to_req_indices, "is_valid_token": is_valid_token,
        "block_table": block_table, "left_visible": left_visible,
        "right_visible": right_visible, "replay_start": replay_start,
        "out[0]": checks.head_axis_dropped("out[0]", indices_out), "out[1]": lens_out})
    qsl, seq, token_to_req, valid, table = (
        ops["query_start_loc"], ops["seq_lens"], ops["token_to_req_indices"],
        ops["is_valid_token"], ops["block_table"])
    window_size = checks.check_row_width("window_size", window_size, minimum=1)
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    checks.check(qsl, (INT32,), 1, min_len=1)
    checks.check(seq, (INT32,), 1)
    checks.check(table, (INT32,), 2)
    checks.check(token_to_req, (INT32,), 1)
    num_tokens = token_to_req.shape[0]
    token_offset = check_int("token_offset", token_offset, minimum=0, maximum=num_tokens)
    num_rows = check_int("num_rows", num_tokens - token_offset if num_rows is None else num_rows,
                         minimum=0, maximum=num_tokens - token_offset)
    checks.check(valid, (BOOL,), 1, min_len=token_offset + num_rows)
    query = QueryLayout(qsl, seq, min(qsl.shape[0] - 1, seq.shape[0]))
    extended = check_extended_window(window_size, index_width, ops["left_visible"],
                                     ops["right_visible"], ops["replay_start"], causal,
                                     token_offset + num_rows, query.num_reqs)
    width = window_size if extended is None else extended.index_width
    indices = checks.output("out[0]", ops["out[0]"], kind, device, INT32, num_rows, width)
    lens = checks.output("out[1]", ops["out[1]"], kind, device, INT32, num_rows)
    checks.check_no_alias([indices, lens], [qsl, seq, token_to_req, valid, table] + [
        op for op in (ops["left_visible"], ops["right_visible"], ops["replay_start"])
        if op is not None])
    if validation.check_mode(validate):
        validation.swa_inputs(query_start_loc, seq_lens, token_to_req_indices, is_valid_token,
                              block_table, kind, token_offset, num_rows, block_size)
    results = (checks.with_head_axis(indices.array, num_rows, width), lens.array[:num_rows])
    launch = swa_launch(query, table, token_to_req, valid, indices, lens, window_size,
                        block_size, token_offset, num_rows, num_tokens, device,
                        extended=extended)
    return _OP.run(key, Checked(kind, device, results, (launch,), results))


class ExtendedWindow(NamedTuple):
    """vLLM 0.34's widened or moved SWA windows (``compute_swa_indices_and_lens``)."""

    index_width: int               # columns per row, >= the window
    left_visible: Operand | None   # [tokens] int32, with right_visible, or neither (causal)
    right_visible: Operand | None
    replay_start: Operand | None   # [requests] int32 (causal)
    causal: bool


def check_extended_window(window_size: int, index_width, left_visible: Operand | None,
                          right_visible: Operand | None, replay_start: Operand | None,
                          causal, num_tokens: int, num_reqs: int) -> ExtendedWindow | None:
    """The checked extensions of the SWA rows; None when there are none (the
    plain rows, whose window the kernel may compile in)."""
    index_width = checks.check_row_width("index_width", window_size if index_width is None
                                         else index_width, minimum=window_size)
    checks.check_visibility(left_visible, right_visible, num_tokens)
    if replay_start is not None:
        checks.check(replay_start, (INT32,), 1, min_len=num_reqs)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    if (index_width == window_size and left_visible is None and replay_start is None
            and causal):
        return None
    if not causal:       # vLLM's DSpark kernel takes neither images nor a replay start
        return ExtendedWindow(index_width, None, None, None, False)
    return ExtendedWindow(index_width, left_visible, right_visible, replay_start, True)


def swa_launch(query: QueryLayout, table: Operand, token_to_req: Operand,
               is_valid_token: Operand, indices: Operand, lens: Operand, window_size: int,
               block_size: int, token_offset: int, num_rows: int, num_tokens: int, device: int,
               lanes: int | None = None, extended: ExtendedWindow | None = None) -> Launch:
    """The SWA rows of tokens ``[token_offset, token_offset + num_rows)`` of
    ``num_tokens``; ``device`` -1 for the CPU. ``lanes``: threads per row, a
    fused kernel's (default ``geometry.row_lanes``); ``extended``: vLLM 0.34's
    widened or moved windows (the run-time window then)."""
    blocks, variant = 0, {}
    if device >= 0 and num_rows:
        lanes = geometry.row_lanes(num_rows, device) if lanes is None else lanes
        threads = geometry.row_block_threads(lanes)
        # The compiled-in window's 32-bit positions need the table's span under the limit.
        fits = (table.shape[1] * block_size + window_size <= geometry.POSITION_LIMIT
                and extended is None)
        family = FAMILY
        variant = {"window": family.compiled_in("window", window_size) if fits
                   else geometry.RUN_TIME,
                   "block_size": family.compiled_in("block_size", block_size), "lanes": lanes,
                   "threads": threads}
        blocks = geometry.row_lane_blocks(num_rows, lanes, threads)
    return Launch(
        FAMILY, blocks,
        dict(query=query, table=table_of(table), token_to_req=token_to_req,
             is_valid_token=is_valid_token, indices=indices, lens=lens,
             left_visible=optional(extended and extended.left_visible),
             right_visible=optional(extended and extended.right_visible),
             replay_start=optional(extended and extended.replay_start),
             indices_stride=checks.row_stride(indices), window_size=window_size,
             index_width=window_size if extended is None else extended.index_width,
             causal=1 if extended is None else int(extended.causal),
             block_size=block_size, token_offset=token_offset, num_rows=num_rows,
             guess_shift=geometry.request_guess_shift(num_tokens, query.num_reqs)),
        variant=variant, kernel=cpu_swa_indices_and_lens)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    yield "swa_indices_and_lens", swa_launch(tiny.query, tiny.table, tiny.out32, tiny.valid,
                                             tiny.rows, tiny.out32, 4, 1, 0, 1, 1, -1)
