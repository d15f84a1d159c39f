"""``split_decodes_and_prefills``: where the decodes of a reordered batch end."""
from __future__ import annotations

import numpy as np

from . import arrays
from .arrays import INT32, INT64
from .scalars import check_int


def split_decodes_and_prefills(query_start_loc, *, decode_threshold: int = 1,
                               require_uniform: bool = False, num_actual_tokens: int | None = None,
                               max_query_len: int | None = None) -> tuple[int, int, int, int]:
    """Split a decodes-first batch into its decode and prefill parts (host only).

    Parameters
    ----------
    query_start_loc : int32 host array (numpy or torch CPU), shape ``[num_reqs + 1]``,
        or a ``CommonAttentionMetadata`` (its ``query_start_loc_cpu``,
        ``num_actual_tokens`` and ``max_query_len`` are used, as vLLM does).
        A device array is refused: reading it would force a sync.
    decode_threshold : int
        Requests with at most this many query tokens are decodes
        (``1 + num_speculative_tokens`` for DeepSeek-V4).
    require_uniform : bool
        Decodes must all have the same query length.
    num_actual_tokens, max_query_len : int, optional
        Defaults: ``query_start_loc[-1]`` and the longest query.

    Returns
    -------
    ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)`` as ints;
    ``(0, 0, 0, 0)`` for a batch with no request (its tokens, if any, are padding).
    The batch is assumed reordered decodes first (vLLM's runner does this); the
    first request over the threshold starts the prefills.
    """
    from .metadata import CommonAttentionMetadata
    if isinstance(query_start_loc, CommonAttentionMetadata):
        cm = query_start_loc
        query_start_loc = cm.query_start_loc_cpu
        num_actual_tokens = cm.num_actual_tokens if num_actual_tokens is None else num_actual_tokens
        max_query_len = cm.max_query_len if max_query_len is None else max_query_len
    kind = arrays.kind_of(query_start_loc)
    if kind not in (arrays.NUMPY, arrays.TORCH_CPU):
        raise TypeError("query_start_loc: expected a host array (numpy or torch CPU; vLLM's "
                        f"query_start_loc_cpu), got {arrays.describe(query_start_loc)}")
    arrays.check(arrays.probe("query_start_loc", query_start_loc), (INT32, INT64), 1, min_len=1)
    threshold = check_int("decode_threshold", decode_threshold, minimum=0)
    qsl = arrays.host_view(query_start_loc, kind)
    return split_host(qsl, threshold, bool(require_uniform), num_actual_tokens, max_query_len)


def split_host(qsl: np.ndarray, threshold: int, require_uniform: bool,
               num_actual_tokens: int | None, max_query_len: int | None) -> tuple[int, int, int, int]:
    """The split on a checked numpy ``query_start_loc`` (the builder's hot path)."""
    num_reqs = qsl.shape[0] - 1
    if num_reqs == 0:
        return 0, 0, 0, 0
    total = int(qsl[-1]) if num_actual_tokens is None else check_int(
        "num_actual_tokens", num_actual_tokens, minimum=0)
    query_lens = None
    if max_query_len is None:
        query_lens = np.diff(qsl)
        max_query_len = int(query_lens.max())
    if max_query_len <= threshold and (not require_uniform or threshold <= 1):
        return num_reqs, 0, total, 0
    first = int(qsl[1] - qsl[0])
    if first > threshold:
        return 0, num_reqs, 0, total
    if query_lens is None:
        query_lens = np.diff(qsl)
    if require_uniform:
        if np.all((query_lens == first) | (query_lens == 0)):
            return num_reqs, 0, total, 0
        is_prefill = query_lens != first
    else:
        is_prefill = query_lens > threshold
    boundary = int(is_prefill.argmax())
    if not is_prefill[boundary]:
        return num_reqs, 0, total, 0
    decode_tokens = int(qsl[boundary])
    return boundary, num_reqs - boundary, decode_tokens, total - decode_tokens
