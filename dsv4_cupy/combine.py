"""``combine_topk_swa_indices``: one sparse-prefill index row per token of a chunk."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, families, geometry, params, validation
from .arrays import INT32
from .prepared import CheckedCall, PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE, combined_width

_PREPARED = PreparedOp("combine_topk_swa_indices")
_C128A_ROWS = PreparedOp("build_c128a_combined_prefill_rows")


def combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens,
                             window_size: int, compress_ratio: int, topk: int, M: int, N: int,
                             *, out=None, validate: str = "default"):
    """Compressed top-k entries then the sliding window, as rows into a chunk's workspace.

    vLLM's ``combine_topk_swa_indices`` (upstream.md §6) in its hardened
    DeepSeek-V4.1 form: the -1 tail is written by the kernel (so persistent
    buffers work), local entries outside ``[0, N)`` become -1 in place, lengths
    are clamped at 0, the window never starts before the gathered region, and
    rows past the chunk's last token are all -1 with length 0.

    Parameters
    ----------
    topk_indices : int32 array ``[T, >= topk]`` (rows contiguous, any row stride)
        Request-local compressed rows of the chunk's tokens (the C4A indexer's
        top-k, the C128A prefill rows, the short-context fill); columns at or
        past ``topk`` are never read. SWA-only layers pass ``[T, 0]``.
    query_start_loc : int32 array ``[R + 1]``
        The chunk's slice of the step's ``query_start_loc``: rebased by its
        first element (which need not be 0).
    seq_lens, gather_lens : int32 arrays ``[>= R]``
        Sequence lengths and the raw tokens gathered per request
        (``compute_prefill_gather_lens``).
    window_size : int
        ``W`` (128).
    compress_ratio : int
        4 or 128; anything >= 0 when ``topk`` is 0 (SWA-only layers).
    topk : int
        Compressed entries per row at most (index_topk, or the C128A width; 0).
    M, N : int
        Workspace rows per request and the workspace row where a request's
        gathered SWA tokens start (``N = max compressed``, ``M = N + max gather``).
    out : ``(indices, lens)``, optional
        int32 ``[>= T, >= C]`` and ``[>= T]``; only the result region is written.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the chunk's query layout, a row for
        every chunk token, ``gather_lens`` at least ``q + min(L - q, W - 1)``
        and at most ``M - N``, and ``M * R`` within int32.

    Returns
    -------
    ``(indices [T, C] int32, lens [T] int32)`` with ``C = round_up(topk + W, 128)``.
    Token ``t`` of request ``b`` at position ``p = L - q + j``: ``k_len =
    min(max((p + 1) // ratio, 0), topk)`` entries ``x + M * b`` (``x`` the
    row's entry; -1 unless ``0 <= x < N``, still counted), then ``s_len =
    max(p - s + 1, 0)`` entries ``M * b + N + (s - g0) + i`` with
    ``g0 = L - gather_lens[b]`` and ``s = max(p - W + 1, 0, g0)``, then -1;
    ``lens = k_len + s_len``. Values are int32 (wrapping).
    """
    key, results = _PREPARED.replay(validate, out, topk_indices, query_start_loc, seq_lens,
                                    gather_lens, window_size, compress_ratio, topk, M, N)
    if results is not None:
        return results
    if topk_indices is None:
        raise TypeError("topk_indices: expected an int32 array [T, >= topk], got None (C128A "
                        "layers: build_c128a_combined_prefill_rows needs no input rows)")
    return _PREPARED.run(key, families.COMBINE, check_combine(
        topk_indices, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk,
        M, N, out, validate))


def build_c128a_combined_prefill_rows(num_tokens: int, query_start_loc, seq_lens, gather_lens,
                                      window_size: int, compress_ratio: int, topk: int, M: int,
                                      N: int, *, out=None, validate: str = "default"):
    """The combined prefill rows of every C128A layer of a step, built once.

    Equal to ``combine_topk_swa_indices(local, query_start_loc, seq_lens,
    gather_lens, window_size, compress_ratio, topk, M, N)`` where ``local`` are
    the chunk tokens' C128A local prefill rows (``k`` for ``k < min((p + 1) //
    compress_ratio, topk)``, -1 after: ``build_c128a_topk_metadata``'s prefill
    rows, or ``fill_short_context_topk_indices``). Those rows are computed,
    not read, and nothing here depends on the layer: one build per chunk
    serves all of the step's C128A layers (20 in DeepSeek-V4-Flash), where
    upstream combines once per layer (upstream.md §6, "Fusion").

    Parameters
    ----------
    num_tokens : int
        Rows: the chunk's tokens (``query_start_loc[-1] - query_start_loc[0]``,
        known on the host), or more (padding rows get -1 and length 0).
    query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N
        As for ``combine_topk_swa_indices``; ``topk`` is the C128A width.
    out : ``(indices, lens)``, optional
        int32 ``[>= num_tokens, >= C]`` and ``[>= num_tokens]``.
    validate : "default" or "full"
        As for ``combine_topk_swa_indices``.

    Returns
    -------
    ``(indices [num_tokens, C] int32, lens [num_tokens] int32)``, ``C = round_up(topk + W, 128)``.
    """
    key, results = _C128A_ROWS.replay(validate, out, num_tokens, query_start_loc, seq_lens,
                                      gather_lens, window_size, compress_ratio, topk, M, N)
    if results is not None:
        return results
    return _C128A_ROWS.run(key, families.COMBINE, check_combine(
        None, query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N,
        out, validate, num_tokens=num_tokens))


def check_combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                  compress_ratio, topk, M, N, out, validate, num_tokens=None,
                  lanes=None) -> CheckedCall:
    """The checks of ``combine_topk_swa_indices``, and its launch or CPU call.
    ``topk_indices=None`` stands for C128A's local prefill rows (``x = k``) of
    ``num_tokens`` tokens, which the kernel computes instead of reading.
    ``lanes``: threads per row of the kernel that runs the rows (default
    ``geometry.combine_lanes``; a fused kernel says its own)."""
    indices_out, lens_out = arrays.out_buffers(out, ("indices", "lens"))
    kind, device, ops = arrays.probe_all({
        "topk_indices": topk_indices, "query_start_loc": query_start_loc, "seq_lens": seq_lens,
        "gather_lens": gather_lens, "out[0]": indices_out, "out[1]": lens_out})
    topk_op, qsl, seq, gather = (ops["topk_indices"], ops["query_start_loc"], ops["seq_lens"],
                                 ops["gather_lens"])
    window_size = arrays.check_row_width("window_size", window_size, minimum=1)
    topk = arrays.check_row_width("topk", topk)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1 if topk else 0,
                               maximum=MAX_BLOCK_SIZE)
    M = check_int("M", M, minimum=0, maximum=np.iinfo(np.int32).max)   # values are int32
    N = check_int("N", N, minimum=0, maximum=M)
    if topk_op is not None:
        arrays.check(topk_op, (INT32,), 2, min_cols=topk)
        num_tokens = topk_op.shape[0]
    else:
        num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    arrays.check(qsl, (INT32,), 1, min_len=1)
    num_reqs = qsl.shape[0] - 1
    arrays.check(seq, (INT32,), 1, min_len=num_reqs)
    arrays.check(gather, (INT32,), 1, min_len=num_reqs)
    width = combined_width(topk, window_size)
    indices = arrays.output("out[0]", ops["out[0]"], kind, device, INT32, num_tokens, width)
    lens = arrays.output("out[1]", ops["out[1]"], kind, device, INT32, num_tokens)
    arrays.check_no_alias([indices, lens], [op for op in (topk_op, qsl, seq, gather) if op is not None])
    if validation.check_mode(validate):
        validation.combine_inputs(query_start_loc, seq_lens, gather_lens, kind, num_tokens,
                                  window_size, M, N)
    results = indices.array[:num_tokens, :width], lens.array[:num_tokens]

    if kind in arrays.GPU_KINDS:
        fields = dict(
            query=params.QUERY_LAYOUT.values(query_start_loc=qsl.ptr, seq_lens=seq.ptr,
                                             num_reqs=num_reqs),
            gather_lens=gather.ptr, topk_indices=0 if topk_op is None else topk_op.ptr, out=indices.ptr,
            lens=lens.ptr, topk_stride=0 if topk_op is None else arrays.row_stride(topk_op),
            out_stride=arrays.row_stride(indices), width=width, num_tokens=num_tokens,
            window_size=window_size, ratio=compress_ratio, topk=topk, rows_per_request=M,
            swa_offset=N)
        lanes = geometry.combine_lanes(width) if lanes is None else lanes
        return CheckedCall(kind, device, results,
                           geometry.row_lane_blocks(num_tokens, lanes) if num_tokens else 0,
                           fields, None, (families.COMBINE.compiled_in("c", width),
                                          families.COMBINE.compiled_in("w", window_size), lanes))

    def run_cpu():
        view, view_2d = arrays.kernel_view, arrays.kernel_view_2d
        if topk_op is not None:
            flat_topk, topk_stride = view_2d(topk_indices, kind)
        else:                               # the rule rows: nothing to read
            flat_topk, topk_stride = np.zeros(0, np.int32), np.int64(-1)
        flat_out, out_stride = view_2d(indices.array, kind)
        cpu.combine_topk_swa_indices(
            flat_topk, topk_stride, view(query_start_loc, kind), np.int64(num_reqs),
            view(seq_lens, kind), view(gather_lens, kind), np.int64(window_size),
            np.int64(compress_ratio), np.int64(topk), np.int64(M), np.int64(N),
            np.int64(num_tokens), np.int64(width), flat_out, out_stride, view(lens.array, kind))
    return CheckedCall(kind, device, results, 0, None, run_cpu)
