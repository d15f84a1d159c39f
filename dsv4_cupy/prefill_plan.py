"""``get_prefill_chunk_plan``: the sparse prefill's chunks, planned on the host."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import host
from .kinds import HOST_KINDS, INT32, INT32_MAX, INT64, INT64_MAX, describe, kind_of
from .scalars import check_int
from .spec import C4A_RATIO, C128A_RATIO, cdiv

#: vLLM 0.34's indexer prefill limits: the logits budget
#: (``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB``, 512 MiB), the fused MQA top-k's keys
#: and rows, the workspace's rows per token of context (576 * 2 // 132) and its
#: factor (5 up to a 256K context, else 2).
INDEXER_MAX_LOGITS_BYTES = 512 * 1024 * 1024
FUSED_MQA_TOPK_MAX_KEYS, FUSED_MQA_TOPK_MAX_ROWS = 1 << 20, 16384
INDEXER_WORKSPACE_ROWS_PER_TOKEN = 576 * 2 // 132
INDEXER_WORKSPACE_FACTORS, INDEXER_WORKSPACE_FACTOR_CONTEXT = (5, 2), 262144


def _host_lengths(name: str, values, maximum: int | None = None) -> list[int]:
    """A list or host int array of lengths >= 0 (and at most ``maximum``), as Python ints."""
    if isinstance(values, (list, tuple)):
        return [check_int(f"{name}[{i}]", value, minimum=0, maximum=maximum)
                for i, value in enumerate(values)]
    kind = kind_of(values)
    if kind not in HOST_KINDS:
        raise TypeError(f"{name}: expected a list or a host array (numpy or torch CPU; the "
                        f"host copies vLLM keeps), got {describe(values)}; reading a "
                        "device array would sync")
    lengths = host.host_view(values, kind)
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {lengths.dtype}")
    if lengths.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {lengths.shape}")
    if (lengths < 0).any():
        i = int(np.flatnonzero(lengths < 0)[0])
        raise ValueError(f"{name}: expected lengths >= 0, got {int(lengths[i])} at index {i}")
    if maximum is not None and lengths.size and lengths.max() > maximum:
        i = int(np.flatnonzero(lengths > maximum)[0])
        raise ValueError(f"{name}: expected lengths <= {maximum}, got {int(lengths[i])} at "
                         f"index {i}")
    return lengths.astype(np.int64).tolist()


def get_prefill_chunk_plan(seq_lens, query_lens, compress_ratio: int, chunk_size: int,
                           window_size: int, max_model_len: int, max_num_batched_tokens: int,
                           has_compressed: bool | None = None) -> list[tuple[int, int, int, int]]:
    """Split the prefill requests into chunks whose gathered workspace fits (host only).

    vLLM's ``get_prefill_chunk_plan`` (#45061): greedy over the
    prefill requests, a chunk takes the next request while ``count * (max
    compressed + max gather)`` stays within ``chunk_size * (cdiv(max_model_len,
    ratio) + window_size + max_num_batched_tokens)``; the first request of a
    chunk is always taken.

    Parameters
    ----------
    seq_lens, query_lens : lists or host int arrays ``[P]``
        The prefill requests' sequence and query lengths (``prefill_seq_lens_cpu``,
        ``prefill_query_lens_cpu``), each in ``[0, 2**31 - 1]`` (vLLM's int32).
        Device arrays are refused (a sync).
    compress_ratio : int
        4, 128, or 0/1 for SWA-only layers (no compressed rows).
    chunk_size : int
        ``PREFILL_CHUNK_SIZE``: requests' worth of workspace per chunk.
    window_size, max_model_len, max_num_batched_tokens : int
    has_compressed : bool, optional
        Whether the layers have compressed rows (vLLM 0.34; default
        ``compress_ratio > 1``, DeepSeek-V4.0's rule). DeepSeek-V4.1 passes
        True for its ratio-1 layers, whose compressed cache is full length
        (``L // 1`` rows).

    Returns
    -------
    ``[(start, end, N, M), ...]`` as ints: requests ``[start, end)``, ``N`` the
    chunk's largest compressed length ``L // ratio`` (0 for ratio <= 1) and
    ``M = N +`` its largest gather length ``q + min(L - q, W - 1)``.
    """
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=0)
    chunk_size = check_int("chunk_size", chunk_size, minimum=1)
    window_size = check_int("window_size", window_size, minimum=1)
    max_model_len = check_int("max_model_len", max_model_len, minimum=1)
    max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens,
                                       minimum=0)
    seq = _host_lengths("seq_lens", seq_lens, INT32_MAX)
    queries = _host_lengths("query_lens", query_lens, INT32_MAX)
    if len(seq) != len(queries):
        raise ValueError(f"query_lens: expected one per request of seq_lens ({len(seq)}), "
                         f"got {len(queries)}")
    if has_compressed is not None:
        if not isinstance(has_compressed, (bool, np.bool_)):
            raise TypeError(f"has_compressed: expected a bool or None, got "
                            f"{type(has_compressed).__name__}")
        if has_compressed and compress_ratio < 1:
            raise ValueError(f"compress_ratio: expected at least 1 with has_compressed=True, "
                             f"got {compress_ratio}")
    compresses = compress_ratio > 1 if has_compressed is None else bool(has_compressed)
    ratio = compress_ratio if compresses else 0
    seq, queries = np.array(seq, np.int64), np.array(queries, np.int64)
    if (seq < queries).any():
        i = int(np.flatnonzero(seq < queries)[0])
        raise ValueError(f"seq_lens: expected seq_len >= query_len (the context includes the "
                         f"query), got seq_len {seq[i]} < query_len {queries[i]} for prefill {i}")
    plan = _chunk_plan(seq, queries, ratio, window_size,
                       chunk_budget(ratio, chunk_size, window_size, max_model_len,
                                    max_num_batched_tokens))
    return list(map(tuple, plan.tolist()))


def chunk_budget(compress_ratio: int, chunk_size: int, window_size: int, max_model_len: int,
                 max_num_batched_tokens: int) -> int:
    """A chunk's workspace rows: ``chunk_size * (cdiv(max_model_len, ratio) +
    window_size + max_num_batched_tokens)``; ``compress_ratio`` 0 for layers
    without compressed rows. At most ``INT64_MAX`` (the planners' int64: a
    larger budget plans the same chunks)."""
    return min(chunk_size * ((cdiv(max_model_len, compress_ratio) if compress_ratio else 0)
                             + window_size + max_num_batched_tokens), INT64_MAX)


@njit(cache=True)
def _gathered_length(seq_len, query_len, window_size):
    """A request's gather length ``q + min(max(L - q, 0), W - 1)``."""
    back = seq_len - query_len
    return query_len + (0 if back <= 0 else min(back, window_size - 1))


@njit(cache=True)
def _greedy_chunks(compressed, gathered, budget, chunks):
    """``get_prefill_chunk_plan``'s greedy over the requests' compressed and
    gathered lengths (int64 ``[P]``): ``chunks[k, :4] = (start, end, N, M)``
    for each chunk ``k`` below the count returned."""
    count, start, k = compressed.shape[0], 0, 0
    while start < count:
        end, most_compressed, most_gathered = start + 1, compressed[start], gathered[start]
        while end < count:
            wider_compressed = max(most_compressed, compressed[end])
            wider_gathered = max(most_gathered, gathered[end])
            if (end + 1 - start) * (wider_compressed + wider_gathered) > budget:
                break
            end, most_compressed, most_gathered = end + 1, wider_compressed, wider_gathered
        chunks[k, 0], chunks[k, 1] = start, end
        chunks[k, 2], chunks[k, 3] = most_compressed, most_compressed + most_gathered
        k += 1
        start = end
    return k


@njit(cache=True)
def _chunk_plan(seq_lens, query_lens, compress_ratio, window_size, budget):
    """``get_prefill_chunk_plan`` on int64 arrays: ``[chunks, 4]`` int64."""
    count = seq_lens.shape[0]
    compressed, gathered = np.zeros(count, np.int64), np.empty(count, np.int64)
    for i in range(count):
        if compress_ratio:
            compressed[i] = seq_lens[i] // compress_ratio
        gathered[i] = _gathered_length(seq_lens[i], query_lens[i], window_size)
    chunks = np.empty((count, 4), np.int64)
    return chunks[:_greedy_chunks(compressed, gathered, budget, chunks)]


#: ``step_chunk_plans``' verdicts on the step's host data.
PLANNED, BAD_SEQ_LENS, BAD_QUERY_LENS, TOO_MANY_COMPRESSED, WORKSPACE_PAST_INT32 = range(5)


@njit(cache=True)
def step_chunk_plans(seq_lens, query_start_loc, first_request, count, num_prefill_tokens,
                     window_size, max_num_compressed, c128a_budget, swa_budget, with_plans):
    """A step's host decisions over its prefill requests ``[first_request,
    first_request + count)``: the indexer's compressed rows and, ``with_plans``,
    both chunk plans (the C128A layers', then the SWA-only layers') placed in
    the step's prefill rows, in one call (the step builder's path).

    ``seq_lens`` (``seq_lens_cpu``) and ``query_start_loc``
    (``query_start_loc_cpu``) are checked host views, int32 or int64.
    Returns ``(verdict, value, chunks, c128a_chunks)``: ``value`` is the
    compressed row count, or for ``WORKSPACE_PAST_INT32`` the chunk that
    breaks it; ``chunks[k] = (start, end, N, M, first_row, end_row)``
    (``combine.PlanChunk``'s fields), the C128A plan's ``c128a_chunks`` first.
    Any other verdict than ``PLANNED`` leaves the rest unset.
    """
    compressed = 0
    c128a_rows, gathered = np.empty(count, np.int64), np.empty(count, np.int64)
    chunks = np.empty((2 * count, 6), np.int64)
    first_token = query_start_loc[first_request]
    for i in range(count):
        seq_len = np.int64(seq_lens[first_request + i])
        query_len = np.int64(query_start_loc[first_request + i + 1]) - \
            query_start_loc[first_request + i]
        if seq_len < 0 or seq_len > INT32_MAX:
            return BAD_SEQ_LENS, 0, chunks, 0
        if query_len < 0:
            return BAD_QUERY_LENS, 0, chunks, 0
        compressed += seq_len // C4A_RATIO
        c128a_rows[i] = seq_len // C128A_RATIO
        gathered[i] = _gathered_length(seq_len, query_len, window_size)
    if query_start_loc[first_request + count] - first_token > num_prefill_tokens:
        return BAD_QUERY_LENS, 0, chunks, 0
    if compressed > max_num_compressed:
        return TOO_MANY_COMPRESSED, compressed, chunks, 0
    if not with_plans:
        return PLANNED, compressed, chunks[:0], 0
    c128a_chunks = _greedy_chunks(c128a_rows, gathered, c128a_budget, chunks)
    c128a_rows[:] = 0                          # the SWA-only layers have no compressed rows
    total = c128a_chunks + _greedy_chunks(c128a_rows, gathered, swa_budget,
                                          chunks[c128a_chunks:])
    for k in range(total):
        start, end = chunks[k, 0], chunks[k, 1]
        if chunks[k, 3] * (end - start) > INT32_MAX:
            return WORKSPACE_PAST_INT32, k, chunks, c128a_chunks
        # Rows [t0, t1) of the prefill tokens; the last chunk takes the padding rows too.
        chunks[k, 4] = query_start_loc[first_request + start] - first_token
        chunks[k, 5] = (num_prefill_tokens if end == count else
                        query_start_loc[first_request + end] - first_token)
    return PLANNED, compressed, chunks[:total], c128a_chunks


def indexer_prefill_workspace_rows(max_model_len: int, compress_ratio: int,
                                   workspace_factor: int | None = None) -> int:
    """Compressed rows of the indexer's prefill workspace, as vLLM 0.34 sizes
    it: ``max_model_len * 8 * factor // compress_ratio`` (8 = 576 * 2 // 132),
    ``factor`` (``sparse_mla_prefill_workspace_factor``) 5 up to a 256K
    context, else 2."""
    max_model_len = check_int("max_model_len", max_model_len, minimum=1)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1)
    if workspace_factor is None:
        workspace_factor = (INDEXER_WORKSPACE_FACTORS[0]
                            if max_model_len <= INDEXER_WORKSPACE_FACTOR_CONTEXT
                            else INDEXER_WORKSPACE_FACTORS[1])
    workspace_factor = check_int("workspace_factor", workspace_factor, minimum=2)
    return max_model_len * INDEXER_WORKSPACE_ROWS_PER_TOKEN * workspace_factor // compress_ratio


def split_indexer_prefill_chunks(compressed_seq_lens_cpu, prefill_query_lens_cpu,
                                 workspace_size: int,
                                 max_logits_bytes: int = INDEXER_MAX_LOGITS_BYTES,
                                 request_offset: int = 0,
                                 fused_mqa_topk_eligible: bool = False) -> list[tuple[slice, slice]]:
    """The indexer's prefill chunks (vLLM 0.34's ``_split_indexer_prefill_chunks``,
    host only): requests taken greedily while their compressed rows fit
    ``workspace_size`` and their logits (query rows x keys, float32) fit
    ``max_logits_bytes``, or, for the fused MQA top-k, at most
    ``FUSED_MQA_TOPK_MAX_KEYS`` keys and ``FUSED_MQA_TOPK_MAX_ROWS`` rows. A
    request that breaks a limit alone is a chunk of its own; a chunk's query
    rows are then cut to what one logits call holds.

    Parameters
    ----------
    compressed_seq_lens_cpu, prefill_query_lens_cpu : lists or host int arrays ``[P]``
        Each prefill request's compressed rows (``seq_len // ratio``) and query tokens.
    workspace_size : int
        Compressed rows of the workspace (``indexer_prefill_workspace_rows``).
    max_logits_bytes : int
        ``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`` (512) MiB.
    request_offset : int
        Added to the request slices (the decode requests before the prefills).
    fused_mqa_topk_eligible : bool
        The fused MQA top-k's limits instead of the logits budget where they apply
        (sm_100 with the default indexer shape; never on sm_90).

    Returns
    -------
    ``[(request slice, query slice), ...]``: absolute request rows, and query
    rows relative to the chunk's first query token.
    """
    keys = _host_lengths("compressed_seq_lens_cpu", compressed_seq_lens_cpu)
    queries = _host_lengths("prefill_query_lens_cpu", prefill_query_lens_cpu)
    if len(keys) != len(queries):
        raise ValueError(f"prefill_query_lens_cpu: expected one per request of "
                         f"compressed_seq_lens_cpu ({len(keys)}), got {len(queries)}")
    workspace_size = check_int("workspace_size", workspace_size, minimum=0)
    max_logits_bytes = check_int("max_logits_bytes", max_logits_bytes, minimum=0)
    request_offset = check_int("request_offset", request_offset, minimum=0)
    fused = bool(fused_mqa_topk_eligible)
    max_elements = max_logits_bytes // 4
    chunks, end, count = [], 0, len(keys)
    while end < count:
        start, rows, columns = end, 0, 0
        while end < count:
            more_rows, more_columns = rows + queries[end], columns + keys[end]
            if fused and more_columns <= FUSED_MQA_TOPK_MAX_KEYS:
                fits = more_rows <= FUSED_MQA_TOPK_MAX_ROWS
            else:
                fits = not fused and more_rows * more_columns <= max_elements
            if more_columns > workspace_size or not fits:
                break
            rows, columns, end = more_rows, more_columns, end + 1
        if end == start:                        # one request past a limit: alone
            rows, columns, end = queries[end], keys[end], end + 1
        if fused and columns <= FUSED_MQA_TOPK_MAX_KEYS:
            per_call = FUSED_MQA_TOPK_MAX_ROWS
        elif columns > 0:
            per_call = max(1, max_logits_bytes // (4 * columns))
        else:
            per_call = max(1, rows)
        requests = slice(start + request_offset, end + request_offset)
        chunks += [(requests, slice(first, min(first + per_call, rows)))
                   for first in range(0, rows, per_call)]
    return chunks


def indexer_prefill_chunk_tokens(query_start_loc_cpu, start_idx: int, end_idx: int,
                                 query_slice: slice | None = None,
                                 skip_kv_gather: bool = False) -> tuple[int, int, bool]:
    """The host fields of an indexer prefill chunk (vLLM 0.34's
    ``build_prefill_chunk_metadata``): ``(token_start, token_end,
    skip_kv_gather)`` of requests ``[start_idx, end_idx)`` and, with
    ``query_slice`` (rebased to the chunk's first token, clamped to its
    tokens), of that slice of them; a slice starting past the chunk's first
    token skips the KV gather (an earlier slice gathered it)."""
    qsl = _host_lengths("query_start_loc_cpu", query_start_loc_cpu)
    start_idx = check_int("start_idx", start_idx, minimum=0, maximum=len(qsl) - 1)
    end_idx = check_int("end_idx", end_idx, minimum=start_idx, maximum=len(qsl) - 1)
    first, last = qsl[start_idx], qsl[end_idx]
    if query_slice is None:
        return first, last, bool(skip_kv_gather)
    if not isinstance(query_slice, slice) or query_slice.step not in (None, 1):
        raise TypeError(f"query_slice: expected a slice of step 1, got {query_slice!r}")
    tokens = last - first
    slice_start = min(check_int("query_slice.start", query_slice.start or 0, minimum=0), tokens)
    slice_stop = min(check_int("query_slice.stop", tokens if query_slice.stop is None
                               else query_slice.stop, minimum=0), tokens)
    return first + slice_start, first + max(slice_stop, slice_start), \
        bool(skip_kv_gather) or slice_start > 0


def warm_planners() -> list[str]:
    """Compile the planners' numba functions for every signature their
    callers hand them (``warmup()``, on either path); returns their names."""
    get_prefill_chunk_plan([1], [1], C4A_RATIO, 1, 1, 1, 1)
    done = ["get_prefill_chunk_plan"]
    for seq_dtype in (INT32, INT64):
        for qsl_dtype in (INT32, INT64):
            step_chunk_plans(np.ones(1, seq_dtype), np.arange(2, dtype=qsl_dtype), 0, 1, 1, 1,
                             1, 1, 1, True)
            done.append(f"step_chunk_plans[{seq_dtype}, {qsl_dtype}]")
    return done

