"""``get_prefill_chunk_plan``: the sparse prefill's chunks, planned on the host."""
from __future__ import annotations

import numpy as np

from . import host
from .kinds import HOST_KINDS, describe, kind_of
from .scalars import check_int
from .spec import cdiv


def _host_lengths(name: str, values) -> list[int]:
    """A list or host int array of lengths >= 0, as Python ints."""
    if isinstance(values, (list, tuple)):
        return [check_int(f"{name}[{i}]", value, minimum=0) for i, value in enumerate(values)]
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
    return lengths.astype(np.int64).tolist()


def get_prefill_chunk_plan(seq_lens, query_lens, compress_ratio: int, chunk_size: int,
                           window_size: int, max_model_len: int,
                           max_num_batched_tokens: int) -> list[tuple[int, int, int, int]]:
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
        ``prefill_query_lens_cpu``). Device arrays are refused (a sync).
    compress_ratio : int
        4, 128, or 0/1 for SWA-only layers (no compressed rows).
    chunk_size : int
        ``PREFILL_CHUNK_SIZE``: requests' worth of workspace per chunk.
    window_size, max_model_len, max_num_batched_tokens : int

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
    seq = _host_lengths("seq_lens", seq_lens)
    queries = _host_lengths("query_lens", query_lens)
    if len(seq) != len(queries):
        raise ValueError(f"query_lens: expected one per request of seq_lens ({len(seq)}), "
                         f"got {len(queries)}")
    return plan_chunks(seq, queries, compress_ratio, chunk_size, window_size, max_model_len,
                       max_num_batched_tokens)


def plan_chunks(seq_lens: list, query_lens: list, compress_ratio: int, chunk_size: int,
                window_size: int, max_model_len: int,
                max_num_batched_tokens: int) -> list[tuple[int, int, int, int]]:
    """``get_prefill_chunk_plan`` of checked Python ints (the step builder's path)."""
    compresses = compress_ratio > 1
    compressed = [s // compress_ratio if compresses else 0 for s in seq_lens]
    gathered = [q + min(max(s - q, 0), window_size - 1) for s, q in zip(seq_lens, query_lens)]
    budget = chunk_size * ((cdiv(max_model_len, compress_ratio) if compresses else 0)
                           + window_size + max_num_batched_tokens)
    plan, start, count = [], 0, len(seq_lens)
    while start < count:
        end, most_compressed, most_gathered = start + 1, compressed[start], gathered[start]
        while end < count:
            wider_compressed = max(most_compressed, compressed[end])
            wider_gathered = max(most_gathered, gathered[end])
            if (end + 1 - start) * (wider_compressed + wider_gathered) > budget:
                break
            end, most_compressed, most_gathered = end + 1, wider_compressed, wider_gathered
        plan.append((start, end, most_compressed, most_compressed + most_gathered))
        start = end
    return plan
