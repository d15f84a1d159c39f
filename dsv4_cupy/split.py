"""``split_decodes_and_prefills``: where the decodes of a reordered batch end."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import checks, host
from .kinds import HOST_KINDS, INT32, INT64, NUMPY, describe, kind_of, probe
from .scalars import check_int


def split_decodes_and_prefills(common_attn_metadata, decode_threshold: int = 1,
                               require_uniform: bool = False,
                               treat_short_extends_as_decodes: bool = True, *,
                               is_prefilling=None, num_actual_tokens: int | None = None,
                               max_query_len: int | None = None) -> tuple[int, int, int, int]:
    """Split a decodes-first batch into its decode and prefill parts (host only).

    Parameters
    ----------
    common_attn_metadata : ``CommonAttentionMetadata``, or an int32/int64 host array ``[R + 1]``
        With the metadata (as vLLM calls it), its ``query_start_loc_cpu`` up to
        ``num_reqs + 1``, ``num_actual_tokens``, ``max_query_len`` and
        ``is_prefilling`` are used. A bare ``query_start_loc`` must be a host
        array (numpy or torch CPU): reading a device array would sync.
    decode_threshold : int
        Requests with at most this many query tokens are decodes
        (``1 + num_speculative_tokens`` for DeepSeek-V4).
    require_uniform : bool
        Decodes must all have the same query length (or 0, CUDA-graph padding).
    treat_short_extends_as_decodes : bool
        When False, a request still prefilling its prompt (``is_prefilling``)
        is a prefill whatever its query length (newer vLLM).
    is_prefilling : bool host array ``[R]``, optional
        Keyword for a bare ``query_start_loc``; required when the flag is False.
    num_actual_tokens, max_query_len : int, optional
        Defaults: the metadata's, else ``query_start_loc[-1]`` and the longest query.

    Returns
    -------
    ``(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)`` as ints;
    ``(0, 0, T, 0)`` for a batch with no request (vLLM 0.34: its ``T`` tokens
    are padding, counted as decode tokens). The batch is assumed
    reordered decodes first (vLLM's runner does this); the first prefill
    starts the prefills. ``num_actual_tokens`` below the decode tokens is an error.
    """
    from .metadata import CommonAttentionMetadata
    query_start_loc = common_attn_metadata
    name = "query_start_loc"
    num_reqs = None
    if isinstance(common_attn_metadata, CommonAttentionMetadata):
        cm = common_attn_metadata
        name = "query_start_loc_cpu"
        query_start_loc = cm.query_start_loc_cpu
        num_reqs = check_int("num_reqs", cm.num_reqs, minimum=0)
        num_actual_tokens = cm.num_actual_tokens if num_actual_tokens is None else num_actual_tokens
        max_query_len = cm.max_query_len if max_query_len is None else max_query_len
        is_prefilling = cm.is_prefilling if is_prefilling is None else is_prefilling
    kind = kind_of(query_start_loc)
    if kind not in HOST_KINDS:
        raise TypeError(f"{name}: expected a host array (numpy or torch CPU; vLLM's "
                        f"query_start_loc_cpu), got {describe(query_start_loc)}")
    op = probe(name, query_start_loc)
    checks.check(op, (INT32, INT64), 1, min_len=1 if num_reqs is None else num_reqs + 1)
    threshold = check_int("decode_threshold", decode_threshold, minimum=0)
    qsl = host.host_view(query_start_loc, kind)
    if num_reqs is not None:
        qsl = qsl[:num_reqs + 1]
    if num_actual_tokens is not None:
        num_actual_tokens = check_int("num_actual_tokens", num_actual_tokens, minimum=0)
    if max_query_len is not None:
        max_query_len = check_int("max_query_len", max_query_len, minimum=0)
    prefilling = None
    if not treat_short_extends_as_decodes and qsl.shape[0] > 1:
        prefilling = host_prefilling(is_prefilling, qsl.shape[0] - 1)
    return split_host(qsl, threshold, bool(require_uniform), num_actual_tokens, max_query_len,
                      prefilling)


def host_prefilling(is_prefilling, num_reqs: int) -> np.ndarray:
    """``is_prefilling`` checked as a host bool array of at least ``num_reqs`` entries."""
    if is_prefilling is None:
        raise ValueError("is_prefilling: required when treat_short_extends_as_decodes is False "
                         "(one host bool per request: still processing its prompt), got None")
    kind = kind_of(is_prefilling)
    if kind not in HOST_KINDS:
        raise TypeError("is_prefilling: expected a host bool array (numpy or torch CPU), got "
                        f"{describe(is_prefilling)}")
    checks.check(probe("is_prefilling", is_prefilling), (np.dtype(np.bool_),), 1,
                 min_len=num_reqs)
    return host.host_view(is_prefilling, kind)[:num_reqs]


def split_host(qsl: np.ndarray, threshold: int, require_uniform: bool,
               num_actual_tokens: int | None, max_query_len: int | None,
               is_prefilling: np.ndarray | None = None) -> tuple[int, int, int, int]:
    """The split on a checked numpy ``query_start_loc`` ``[R + 1]`` (the builder's hot
    path). ``is_prefilling`` given means short extends are prefills (vLLM's
    ``treat_short_extends_as_decodes=False``)."""
    num_reqs = qsl.shape[0] - 1
    total = int(qsl[-1]) if num_actual_tokens is None else num_actual_tokens
    if num_reqs == 0:            # vLLM 0.34: every (padding) token is a decode token
        return 0, 0, total, 0
    short_extends_are_decodes = is_prefilling is None
    boundary = _first_prefill(host.kernel_view(qsl, NUMPY), threshold, require_uniform,
                              -1 if max_query_len is None else max_query_len,
                              _NOT_PREFILLING if short_extends_are_decodes
                              else host.kernel_view(is_prefilling, NUMPY),
                              short_extends_are_decodes)
    if boundary == num_reqs:
        return num_reqs, 0, _checked_tokens(total, total), 0
    if boundary == _FIRST_IS_PREFILL:
        return 0, num_reqs, 0, total
    decode_tokens = _checked_tokens(int(qsl[boundary]), total)
    return boundary, num_reqs - boundary, decode_tokens, total - decode_tokens


#: ``_first_prefill``'s answer when the first request's query alone makes it a prefill.
_FIRST_IS_PREFILL = -1
_NOT_PREFILLING = np.zeros(0, np.bool_)


@njit(cache=True)
def _first_prefill(qsl, threshold, require_uniform, max_query_len, is_prefilling,
                   short_extends_are_decodes):
    """The first prefill request of a decodes-first batch (``R`` when there is
    none; ``_FIRST_IS_PREFILL`` when the first request's query is past the
    threshold): with ``require_uniform`` a request whose query is neither the
    first's nor 0 (CUDA-graph padding), else one past ``threshold``; one
    still ``is_prefilling`` unless ``short_extends_are_decodes``.
    ``max_query_len`` -1: read from ``qsl``."""
    num_reqs = qsl.shape[0] - 1
    if max_query_len < 0:
        for i in range(num_reqs):
            max_query_len = max(max_query_len, qsl[i + 1] - qsl[i])
    if (max_query_len <= threshold and (not require_uniform or threshold <= 1)
            and short_extends_are_decodes):
        return num_reqs
    first = qsl[1] - qsl[0]
    if first > threshold:
        return _FIRST_IS_PREFILL
    for i in range(num_reqs):
        query = qsl[i + 1] - qsl[i]
        prefill = (query != first and query != 0) if require_uniform else query > threshold
        if prefill or (not short_extends_are_decodes and is_prefilling[i]):
            return i
    return num_reqs


def warm_split() -> list[str]:
    """Compile ``_first_prefill`` for the signatures ``split_host`` hands it
    (``warmup()``); returns their names."""
    done = []
    for dtype in (INT32, INT64):
        _first_prefill(np.arange(2, dtype=dtype), 1, False, -1, _NOT_PREFILLING, True)
        done.append(f"split_decodes_and_prefills[{dtype}]")
    return done


def _checked_tokens(decode_tokens: int, total: int) -> int:
    if decode_tokens > total:
        raise ValueError(f"num_actual_tokens: expected at least the {decode_tokens} decode tokens "
                         f"that query_start_loc places before the first prefill, got {total}")
    return decode_tokens
