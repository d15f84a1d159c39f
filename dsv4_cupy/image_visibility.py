"""``compute_image_visibility``: how much of the image spans around it each
prefill token sees (vision models), and the host CSR of a step's spans."""
from __future__ import annotations

import operator
from collections.abc import Mapping

import numpy as np
from numba import prange

from . import checks, geometry, validation
from .cpu import ParallelKernel
from .family import KernelFamily
from .kinds import INT32, INT32_MAX, Operand, probe_all
from .launch import Launch
from .params import I64, PTR, QUERY_LAYOUT, Params, QueryLayout
from .prepared import Checked, PreparedOp
from .scalars import check_int

PARAMS = Params("ImageVisibilityParams", [
    ("query", QUERY_LAYOUT), ("token_to_req", PTR), ("span_indptr", PTR), ("span_starts", PTR),
    ("span_ends", PTR), ("left_visible", PTR), ("right_visible", PTR), ("num_spans", I64),
    ("num_tokens", I64), ("token_offset", I64), ("max_image_tokens", I64)])


@ParallelKernel
def cpu_image_visibility(query, token_to_req, span_indptr, span_starts, span_ends, left_visible,
                         right_visible, num_spans, num_tokens, token_offset, max_image_tokens):
    """Token t >= token_offset at position p in the inclusive span [s, e] of its
    request (the last such span): min(p - s, max - 1) and min(e - p, max); 0, 0
    otherwise and before token_offset. Span indices clamped to the arrays."""
    qsl, seq_lens, num_reqs = query
    for t in prange(num_tokens):
        left = 0
        right = 0
        b = np.int64(token_to_req[t]) if t >= token_offset else -1
        if 0 <= b < num_reqs:
            position = np.int64(seq_lens[b]) - np.int64(qsl[b + 1]) + t
            first = min(max(np.int64(span_indptr[b]), 0), num_spans)
            last = min(max(np.int64(span_indptr[b + 1]), first), num_spans)
            for i in range(first, last):
                start, end = np.int64(span_starts[i]), np.int64(span_ends[i])
                if start <= position <= end:
                    left = min(position - start, max_image_tokens - 1)
                    right = min(end - position, max_image_tokens)
        left_visible[t] = left
        right_visible[t] = right


FAMILY = KernelFamily("image_visibility.cuh", "image_visibility", PARAMS)
CPU_KERNEL = cpu_image_visibility
FAMILIES = (FAMILY,)

_OP = PreparedOp("compute_image_visibility")


def image_span_csr(mm_req_doc_ranges, num_reqs: int) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """vLLM 0.34's ``mm_req_doc_ranges`` (a dict: request row -> its images'
    inclusive ``(start, end)`` prompt positions, or None) as ``(span_indptr
    [R + 1], span_starts, span_ends)``, int32 host arrays: request ``b``'s
    spans are ``[span_indptr[b], span_indptr[b + 1])``, in the order given.
    Rows at or past ``num_reqs`` are not read, as in vLLM."""
    num_reqs = check_int("num_reqs", num_reqs, minimum=0)
    if mm_req_doc_ranges is None:
        mm_req_doc_ranges = {}
    elif not isinstance(mm_req_doc_ranges, Mapping):
        raise TypeError("mm_req_doc_ranges: expected a dict of request row -> [(start, end), "
                        f"...] or None, got {type(mm_req_doc_ranges).__name__}")
    indptr = np.zeros(num_reqs + 1, np.int32)
    starts, ends = [], []
    for b in range(num_reqs):
        for start, end in _spans(b, mm_req_doc_ranges.get(b, ())):
            starts.append(start)
            ends.append(end)
        indptr[b + 1] = len(starts)
    return indptr, np.array(starts, np.int32), np.array(ends, np.int32)


def _spans(b: int, spans):
    """Request ``b``'s spans as checked ``(start, end)`` ints, ``0 <= start <= end``."""
    name = f"mm_req_doc_ranges[{b}]"
    try:
        pairs = [tuple(operator.index(value) for value in span) for span in spans]
    except TypeError:
        raise TypeError(f"{name}: expected a list of (start, end) int pairs, got "
                        f"{spans!r}") from None
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"{name}: expected (start, end) pairs, got {pair!r}")
        if not 0 <= pair[0] <= pair[1] <= INT32_MAX:
            raise ValueError(f"{name}: expected 0 <= start <= end <= {INT32_MAX} (inclusive "
                             f"positions), got {pair!r}")
    return pairs


def compute_image_visibility(span_indptr, span_starts, span_ends, query_start_loc, seq_lens,
                             token_to_req_indices, max_image_tokens: int, token_offset: int = 0,
                             num_rows: int | None = None, *, out=None,
                             validate: str = "default"):
    """Image positions each prefill token sees around it (vision models).

    vLLM 0.34's ``_compute_image_visibility_kernel``; its results widen the SWA
    rows (``compute_swa_indices_and_lens``'s ``left_visible``/``right_visible``)
    and the combined rows (``combine_topk_swa_indices``, sliced to a chunk).

    Parameters
    ----------
    span_indptr, span_starts, span_ends : int32 arrays ``[>= R + 1]``, ``[S]``, ``[S]``
        Each request's image spans, inclusive positions (``image_span_csr``).
    query_start_loc, seq_lens : int32 arrays ``[R + 1]``, ``[>= R]``
    token_to_req_indices : int32 array ``[>= token_offset + num_rows]``
    max_image_tokens : int
        The model's ``vision_max_n_token`` (``>= 1``).
    token_offset, num_rows : int
        The prefill tokens ``[token_offset, token_offset + num_rows)``
        (default: every token from ``token_offset`` on).
    out : ``(left_visible, right_visible)``, optional
        int32 ``[>= token_offset + num_rows]`` each; only the result region is
        written.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the query layout and the tokens'
        requests.

    Returns
    -------
    ``(left_visible, right_visible)``, int32 ``[token_offset + num_rows]``
    indexed by token: token ``t`` at position ``p`` inside the span ``[s, e]``
    of its request (the last one that holds it) gets ``min(p - s,
    max_image_tokens - 1)`` and ``min(e - p, max_image_tokens)``; 0 and 0
    outside every span and for the tokens before ``token_offset`` (vLLM leaves
    those stale).
    """
    key, results = _OP.replay(validate, out, span_indptr, span_starts, span_ends,
                              query_start_loc, seq_lens, token_to_req_indices, max_image_tokens,
                              token_offset, num_rows)
    if results is not None:
        return results
    left_out, right_out = checks.out_buffers(out, ("left_visible", "right_visible"))
    kind, device, ops = probe_all({
        "span_indptr": span_indptr, "span_starts": span_starts, "span_ends": span_ends,
        "query_start_loc": query_start_loc, "seq_lens": seq_lens,
        "token_to_req_indices": token_to_req_indices, "out[0]": left_out, "out[1]": right_out})
    qsl, seq, token_to_req = (ops["query_start_loc"], ops["seq_lens"],
                              ops["token_to_req_indices"])
    indptr, starts, ends = ops["span_indptr"], ops["span_starts"], ops["span_ends"]
    checks.check(qsl, (INT32,), 1, min_len=1)
    num_reqs = qsl.shape[0] - 1
    checks.check(seq, (INT32,), 1, min_len=num_reqs)
    checks.check(token_to_req, (INT32,), 1)
    checks.check(indptr, (INT32,), 1, min_len=num_reqs + 1)
    checks.check(starts, (INT32,), 1)
    checks.check(ends, (INT32,), 1, min_len=starts.shape[0])
    max_image_tokens = checks.check_row_width("max_image_tokens", max_image_tokens, minimum=1)
    available = token_to_req.shape[0]
    token_offset = check_int("token_offset", token_offset, minimum=0, maximum=available)
    num_rows = check_int("num_rows", available - token_offset if num_rows is None else num_rows,
                         minimum=0, maximum=available - token_offset)
    num_tokens = token_offset + num_rows
    left = checks.output("out[0]", ops["out[0]"], kind, device, INT32, num_tokens)
    right = checks.output("out[1]", ops["out[1]"], kind, device, INT32, num_tokens)
    checks.check_no_alias([left, right], [qsl, seq, token_to_req, indptr, starts, ends])
    if validation.check_mode(validate):
        validation.query_layout(query_start_loc, seq_lens, kind, num_reqs)
        validation.request_ids(token_to_req_indices, kind, num_rows, num_reqs,
                               first=token_offset)
    results = (left.array[:num_tokens], right.array[:num_tokens])
    launch = image_visibility_launch(QueryLayout(qsl, seq, num_reqs), token_to_req, indptr,
                                     starts, ends, left, right, num_tokens, token_offset,
                                     max_image_tokens)
    return _OP.run(key, Checked(kind, device, results, (launch,), results))


def image_visibility_launch(query: QueryLayout, token_to_req: Operand, span_indptr: Operand,
                            span_starts: Operand, span_ends: Operand, left: Operand,
                            right: Operand, num_tokens: int, token_offset: int,
                            max_image_tokens: int) -> Launch:
    """The visibility of tokens ``[0, num_tokens)`` (0 before ``token_offset``)."""
    return Launch(FAMILY, geometry.elementwise_blocks(num_tokens),
                  dict(query=query, token_to_req=token_to_req, span_indptr=span_indptr,
                       span_starts=span_starts, span_ends=span_ends, left_visible=left,
                       right_visible=right, num_spans=span_starts.shape[0],
                       num_tokens=num_tokens, token_offset=token_offset,
                       max_image_tokens=max_image_tokens),
                  kernel=cpu_image_visibility)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    yield "image_visibility", image_visibility_launch(
        tiny.query, tiny.out32, tiny.qsl, tiny.out32, tiny.out32, tiny.out32, tiny.out32, 1, 0,
        1)
