"""``combine_topk_swa_indices``: one sparse-prefill index row per token of a
chunk; ``build_c128a_combined_prefill_rows``: the same for every C128A layer
of a step at once; and the step kernel's combined rows over a prefill plan."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from numba import prange

from . import checks, geometry, validation
from .cpu import ParallelKernel, div_trunc, gather_len, request_of
from .family import COMBINE_LANES_AXIS, COMBINED_WIDTH_AXIS, SWA_WINDOW_AXIS, KernelFamily
from .geometry import MAX_PLAN_CHUNKS, RUN_TIME, combine_lanes
from .kinds import INT32, INT32_MAX, Operand, probe_all
from .launch import FrozenLaunch, Launch, optional
from .params import I32, I64, PTR, QUERY_LAYOUT, Array, Group, Params, QueryLayout
from .prepared import Checked, PreparedOp
from .scalars import check_int, check_window_start
from .spec import MAX_BLOCK_SIZE, combined_width

PARAMS = Params("CombineParams", [
    ("query", QUERY_LAYOUT), ("gather_lens", PTR), ("topk_indices", PTR), ("out", PTR),
    ("lens", PTR), ("left_visible", PTR), ("right_visible", PTR), ("topk_stride", I64),
    ("out_stride", I64), ("width", I64), ("num_tokens", I64), ("window_size", I64),
    ("image_width", I64), ("ratio", I64), ("topk", I64), ("rows_per_request", I64),
    ("swa_offset", I64)])
PREFILL_PLAN = Group("PrefillPlan", [
    ("chunks", I64), ("first_request", Array(I32, MAX_PLAN_CHUNKS)),
    ("rows_per_request", Array(I32, MAX_PLAN_CHUNKS)),
    ("swa_offset", Array(I32, MAX_PLAN_CHUNKS))], module=__name__)
PrefillPlan = PREFILL_PLAN.record
#: A layer type's combined prefill rows over a prefill plan (a section of the step kernel).
PREFILL_COMBINE = Params("PrefillCombineParams", [("rows", PARAMS), ("lanes", I64),
                                                  ("plan", PREFILL_PLAN)])


@ParallelKernel
def cpu_combine_topk_swa_indices(query, gather_lens, topk_indices, out, lens, left_visible,
                                 right_visible, topk_stride, out_stride, width, num_tokens,
                                 window_size, image_width, ratio, topk, rows_per_request,
                                 swa_offset):
    """The hardened V4.1 combine (see kernels/combine.cuh). Without
    ``topk_indices`` (empty) the compressed entries are C128A's local prefill
    rows, ``x = k``; without ``gather_lens`` (empty) a request's gather length
    is computed; with ``image_width`` the window widens by each token's image
    visibility."""
    qsl, seq_lens, num_reqs = query
    first = np.int64(qsl[0])
    total = np.int64(qsl[num_reqs]) - first if num_reqs > 0 else 0
    rule_rows = topk_indices.shape[0] == 0
    for t in prange(num_tokens):
        row = t * out_stride
        length = 0
        if t < total:
            b = request_of(qsl, num_reqs, first + t)
            qs = np.int64(qsl[b])
            qe = np.int64(qsl[b + 1])
            seq_len = np.int64(seq_lens[b])
            position = seq_len - (qe - qs) + (first + t - qs)
            topk_len = 0
            if topk > 0:
                topk_len = max(min(div_trunc(position + 1, ratio), topk), 0)
            request_base = rows_per_request * b
            for k in range(topk_len):
                x = np.int64(k) if rule_rows else np.int64(topk_indices[t * topk_stride + k])
                out[row + k] = np.int32(x + request_base) if 0 <= x < swa_offset else -1
            gathered = (np.int64(gather_lens[b]) if gather_lens.shape[0] > 0
                         else gather_len(qe - qs, seq_len, window_size))
            gather_start = seq_len - gathered
            left = np.int64(left_visible[t]) if image_width > 0 else 0
            right = np.int64(right_visible[t]) if image_width > 0 else 0
            left_extra = max(left - (window_size - 1), 0)
            swa_start = max(position - window_size + 1 - left_extra, 0, gather_start)
            swa_len = min(max(position + right - swa_start + 1, 0), window_size + image_width)
            first_row = request_base + swa_offset + (swa_start - gather_start)
            for i in range(swa_len):
                out[row + topk_len + i] = np.int32(first_row + i)
            length = topk_len + swa_len
        out[row + length:row + width] = -1
        lens[t] = length


#: A compiled-in width comes with its own lanes only (the run-time width with each).
FAMILY = KernelFamily("combine.cuh", "combine_topk_swa_indices", PARAMS,
                      (COMBINED_WIDTH_AXIS, SWA_WINDOW_AXIS, COMBINE_LANES_AXIS),
                      where=lambda width, window, lanes: (width == RUN_TIME
                                                          or lanes == combine_lanes(width)))
CPU_KERNEL = cpu_combine_topk_swa_indices
FAMILIES = (FAMILY,)

_OP = PreparedOp("combine_topk_swa_indices")
_C128A_ROWS = PreparedOp("build_c128a_combined_prefill_rows")


def combine_topk_swa_indices(topk_indices, query_start_loc, seq_lens, gather_lens,
                             window_size: int, compress_ratio: int, topk: int, M: int, N: int,
                             out=None, left_visible=None, right_visible=None,
                             max_image_tokens: int = 0, *, validate: str = "default"):
    """Compressed top-k entries then the sliding window, as rows into a chunk's workspace.

    vLLM's ``combine_topk_swa_indices`` in its hardened
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
    left_visible, right_visible : int32 arrays ``[>= T]``, optional
        Image visibility of the chunk's tokens (chunk-local rows; vLLM's
        ``prefill_left_visible[ndt + start:ndt + end]``): the image positions
        a token sees before its window and after itself. Both or neither.
    max_image_tokens : int
        Widens the rows (``C`` below); the window part holds at most
        ``W + max_image_tokens`` entries when visibility is given.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the chunk's query layout, a row for
        every chunk token, ``gather_lens`` at least ``q + min(L - q, W - 1)``
        and at most ``M - N``, and ``M * R`` within int32.

    Returns
    -------
    ``(indices [T, C] int32, lens [T] int32)`` with ``C = round_up(topk + W +
    max_image_tokens, 128)``. Token ``t`` of request ``b`` at position ``p = L
    - q + j``, seeing ``l, r`` image positions (0 without images): ``k_len =
    min(max((p + 1) // ratio, 0), topk)`` entries ``x + M * b`` (``x`` the
    row's entry; -1 unless ``0 <= x < N``, still counted), then ``s_len =
    min(max(p + r - s + 1, 0), W + max_image_tokens)`` entries ``M * b + N +
    (s - g0) + i`` with ``g0 = L - gather_lens[b]`` and ``s = max(p - W + 1 -
    max(l - W + 1, 0), 0, g0)``, then -1; ``lens = k_len + s_len``. Values are
    int32 (wrapping).
    """
    key, results = _OP.replay(validate, out, topk_indices, query_start_loc, seq_lens,
                              gather_lens, window_size, compress_ratio, topk, M, N,
                              left_visible, right_visible, max_image_tokens)
    if results is not None:
        return results
    if topk_indices is None:
        raise TypeError("topk_indices: expected an int32 array [T, >= topk], got None (C128A "
                        "layers: build_c128a_combined_prefill_rows needs no input rows)")
    return _OP.run(key, check_combine(topk_indices, query_start_loc, seq_lens, gather_lens,
                                      window_size, compress_ratio, topk, M, N, out, validate,
                                      images=(left_visible, right_visible, max_image_tokens)))


def build_c128a_combined_prefill_rows(num_tokens: int, query_start_loc, seq_lens, gather_lens,
                                      window_size: int, compress_ratio: int, topk: int, M: int,
                                      N: int, out=None, left_visible=None, right_visible=None,
                                      max_image_tokens: int = 0, *, validate: str = "default"):
    """The combined prefill rows of every C128A layer of a step, built once.

    Equal to ``combine_topk_swa_indices(local, query_start_loc, seq_lens,
    gather_lens, window_size, compress_ratio, topk, M, N)`` where ``local`` are
    the chunk tokens' C128A local prefill rows (``k`` for ``k < min((p + 1) //
    compress_ratio, topk)``, -1 after: ``build_c128a_topk_metadata``'s prefill
    rows, or ``fill_short_context_topk_indices``). Those rows are computed,
    not read, and nothing here depends on the layer: one build per chunk
    serves all of the step's C128A layers (20 in DeepSeek-V4-Flash), where
    vLLM combines once per layer.

    Parameters
    ----------
    num_tokens : int
        Rows: the chunk's tokens (``query_start_loc[-1] - query_start_loc[0]``,
        known on the host), or more (padding rows get -1 and length 0).
    query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, topk, M, N
        As for ``combine_topk_swa_indices``; ``topk`` is the C128A width.
    out : ``(indices, lens)``, optional
        int32 ``[>= num_tokens, >= C]`` and ``[>= num_tokens]``.
    left_visible, right_visible, max_image_tokens, validate
        As for ``combine_topk_swa_indices``.

    Returns
    -------
    ``(indices [num_tokens, C] int32, lens [num_tokens] int32)``, ``C = round_up(topk + W +
    max_image_tokens, 128)``.
    """
    key, results = _C128A_ROWS.replay(validate, out, num_tokens, query_start_loc, seq_lens,
                                      gather_lens, window_size, compress_ratio, topk, M, N,
                                      left_visible, right_visible, max_image_tokens)
    if results is not None:
        return results
    return _C128A_ROWS.run(key, check_combine(None, query_start_loc, seq_lens, gather_lens,
                                              window_size, compress_ratio, topk, M, N, out,
                                              validate, num_tokens=num_tokens,
                                              images=(left_visible, right_visible,
                                                      max_image_tokens)))


def check_combine(topk_indices, query_start_loc, seq_lens, gather_lens, window_size,
                  compress_ratio, topk, M, N, out, validate, num_tokens=None,
                  lanes=None, images=(None, None, 0)) -> Checked:
    """The checks of ``combine_topk_swa_indices``, and its launch.
    ``topk_indices=None`` stands for C128A's local prefill rows (``x = k``) of
    ``num_tokens`` tokens, which the kernel computes instead of reading.
    ``lanes``: threads per row of a fused kernel (default ``geometry.combine_lanes``).
    ``images``: ``(left_visible, right_visible, max_image_tokens)``."""
    indices_out, lens_out = checks.out_buffers(out, ("indices", "lens"))
    left_visible, right_visible, max_image_tokens = images
    kind, device, ops = probe_all({
        "topk_indices": topk_indices, "query_start_loc": query_start_loc, "seq_lens": seq_lens,
        "gather_lens": gather_lens, "out[0]": indices_out, "out[1]": lens_out,
        "left_visible": left_visible, "right_visible": right_visible})
    topk_op, qsl, seq, gather = (ops["topk_indices"], ops["query_start_loc"], ops["seq_lens"],
                                 ops["gather_lens"])
    window_size = checks.check_row_width("window_size", window_size, minimum=1)
    topk = checks.check_row_width("topk", topk)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1 if topk else 0,
                               maximum=MAX_BLOCK_SIZE)
    M = check_int("M", M, minimum=0, maximum=INT32_MAX)   # values are int32
    N = check_window_start(N, M, "a get_prefill_chunk_plan chunk is (start, end, N, M); "
                                 "this function takes M before N")
    max_image_tokens = checks.check_row_width("max_image_tokens", max_image_tokens)
    left, right = ops["left_visible"], ops["right_visible"]
    if topk_op is not None:
        checks.check(topk_op, (INT32,), 2, min_cols=topk)
        num_tokens = topk_op.shape[0]
    else:
        num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    checks.check(qsl, (INT32,), 1, min_len=1)
    num_reqs = qsl.shape[0] - 1
    checks.check(seq, (INT32,), 1, min_len=num_reqs)
    checks.check(gather, (INT32,), 1, min_len=num_reqs)
    checks.check_visibility(left, right, num_tokens)
    width = combined_width(topk, window_size, max_image_tokens)
    indices = checks.output("out[0]", ops["out[0]"], kind, device, INT32, num_tokens, width)
    lens = checks.output("out[1]", ops["out[1]"], kind, device, INT32, num_tokens)
    checks.check_no_alias([indices, lens], [op for op in (topk_op, qsl, seq, gather, left, right)
                                            if op is not None])
    if validation.check_mode(validate):
        validation.combine_inputs(query_start_loc, seq_lens, gather_lens, kind, num_tokens,
                                  window_size, M, N)
    results = indices.array[:num_tokens, :width], lens.array[:num_tokens]
    launch = combine_launch(QueryLayout(qsl, seq, num_reqs), gather, topk_op, indices, lens,
                            num_tokens, window_size, compress_ratio, topk, M, N, device, lanes,
                            max_image_tokens,
                            ImageVisibility(left, right) if left is not None else None)
    return Checked(kind, device, results, (launch,), results)


class ImageVisibility(NamedTuple):
    """Each token's view of the image spans around it (vLLM's visibility kernel)."""

    left: Operand                # [num_tokens] int32: image positions seen before the window
    right: Operand               # [num_tokens] int32: image positions seen after the token


def combine_launch(query: QueryLayout, gather_lens: Operand | None, topk_indices: Operand | None,
                   out: Operand, lens: Operand, num_tokens: int, window_size: int,
                   compress_ratio: int, topk: int, rows_per_request: int, swa_offset: int,
                   device: int, lanes: int | None = None, max_image_tokens: int = 0,
                   images: ImageVisibility | None = None) -> Launch:
    """The combined rows of a chunk's ``num_tokens`` tokens; without
    ``topk_indices`` C128A's local prefill rows, without ``gather_lens`` the
    gather lengths computed, without ``images`` no image visibility (the rows
    are as wide with ``max_image_tokens`` either way); ``device`` -1 for the
    CPU. ``lanes``: threads per row, a fused kernel's (default
    ``geometry.combine_lanes``)."""
    width = combined_width(topk, window_size, max_image_tokens)
    image_width = 0 if images is None else max_image_tokens
    variant = {}
    if lanes is None:       # the family's own entry point (a fused kernel has its own)
        lanes = geometry.combine_lanes(width)
        variant = {"width": FAMILY.compiled_in("width", width),
                   "window": FAMILY.compiled_in("window", window_size), "lanes": lanes}
    return Launch(
        FAMILY, geometry.row_lane_blocks(num_tokens, lanes) if device >= 0 and num_tokens else 0,
        dict(query=query, gather_lens=optional(gather_lens), topk_indices=optional(topk_indices),
             out=out, lens=lens, left_visible=optional(images and images.left),
             right_visible=optional(images and images.right),
             topk_stride=0 if topk_indices is None else checks.row_stride(topk_indices),
             out_stride=checks.row_stride(out), width=width, num_tokens=num_tokens,
             window_size=window_size, image_width=image_width, ratio=compress_ratio, topk=topk,
             rows_per_request=rows_per_request, swa_offset=swa_offset),
        variant=variant, kernel=cpu_combine_topk_swa_indices)



class PlanChunk(NamedTuple):
    """One chunk of a prefill chunk plan, placed in the step's rows."""

    start: int           # prefill requests [start, end)
    end: int
    swa_offset: int      # N: the chunk's largest compressed length
    rows_per_request: int  # M: N + its largest gather length
    first_row: int       # its prefill rows [first_row, end_row) of the step's prefill tokens
    end_row: int


def prefill_combine_launches(query_start_loc: Operand, seq_lens: Operand, num_decodes: int,
                             chunks: tuple[PlanChunk, ...], out: Operand, lens: Operand,
                             window_size: int, compress_ratio: int, topk: int,
                             device: int, kept=None) -> list:
    """The combined rows of a step's prefill tokens over its chunk plan,
    without reading a top-k (C128A's local rows, or none) or gather lengths:
    a launch of the step kernel's combine section per ``MAX_PLAN_CHUNKS``
    chunks (on the CPU, a combine per chunk). ``query_start_loc`` and
    ``seq_lens`` are the step's; prefill request ``i`` is request
    ``num_decodes + i``. ``kept(key, describe)``: a caller's cache of frozen
    launches (GPU), for the rows of a launch, which depend on its requests
    and rows alone (not on the chunks' ``N`` and ``M``); the launches are
    then ``FrozenLaunch``es."""
    width = combined_width(topk, window_size)
    lanes = geometry.combine_lanes(width)

    def requests(start, stop):
        return QueryLayout(checks.rows_of(query_start_loc, start, stop + 1),
                           checks.rows_of(seq_lens, start, stop), stop - start)

    launches = []
    for piece in plan_pieces(chunks):
        a, b = num_decodes + piece[0].start, num_decodes + piece[-1].end
        t0, t1 = piece[0].first_row, piece[-1].end_row

        def describe_rows():
            return combine_launch(requests(a, b), None, None, checks.rows_of(out, t0, t1),
                                  checks.rows_of(lens, t0, t1), t1 - t0, window_size,
                                  compress_ratio, topk, 0, 0, device, lanes)

        rows = describe_rows() if kept is None else kept(
            ("combine rows", out.ptr, a, b, t0, t1, compress_ratio, topk), describe_rows)
        if kept is None:
            per_chunk = () if device >= 0 else tuple(      # the CPU's: a combine per chunk
                combine_launch(requests(num_decodes + c.start, num_decodes + c.end), None, None,
                               checks.rows_of(out, c.first_row, c.end_row),
                               checks.rows_of(lens, c.first_row, c.end_row),
                               c.end_row - c.first_row, window_size, compress_ratio, topk,
                               c.rows_per_request, c.swa_offset, -1)
                for c in piece)
            launches.append(Launch(None, rows.blocks,
                                   dict(rows=rows, lanes=lanes, plan=plan_record(piece)),
                                   layout=PREFILL_COMBINE, parts=per_chunk))
        else:       # the rows frozen: the section's values as packed, with this plan's
            launches.append(FrozenLaunch(PREFILL_COMBINE.values(
                rows=rows.values, lanes=lanes, plan=PREFILL_PLAN.values_of(plan_record(piece))),
                rows.blocks))
    return launches


def plan_pieces(chunks: Sequence) -> list[Sequence]:
    """A chunk plan (or any sequence, one item per chunk) in pieces of at most
    ``MAX_PLAN_CHUNKS`` chunks: a launch each."""
    return [chunks[first:first + MAX_PLAN_CHUNKS]
            for first in range(0, len(chunks), MAX_PLAN_CHUNKS)]


def plan_record(piece: tuple[PlanChunk, ...]) -> PrefillPlan:
    """A piece's ``PrefillPlan``: its chunks' first requests (from the piece's
    first), M and N, padded to ``MAX_PLAN_CHUNKS``."""
    pad = [0] * (MAX_PLAN_CHUNKS - len(piece))
    first = piece[0].start
    return PrefillPlan(chunks=len(piece), first_request=[c.start - first for c in piece] + pad,
                       rows_per_request=[c.rows_per_request for c in piece] + pad,
                       swa_offset=[c.swa_offset for c in piece] + pad)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``): an
    absent top-k or gather length is an empty int32 array, the same signature."""
    yield "combine_topk_swa_indices", combine_launch(tiny.query, tiny.out32, tiny.rows,
                                                     tiny.rows, tiny.out32, 1, 2, 1, 1, 2, 1, -1)
