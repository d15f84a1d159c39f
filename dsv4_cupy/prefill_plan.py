"""Sparse-prefill planning: ``compute_prefill_gather_lens`` (device, no sync) and
``get_prefill_chunk_plan`` (host)."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, families, geometry, params, validation
from .arrays import INT32
from .prepared import PreparedOp
from .scalars import check_int
from .spec import SWA_WINDOW_SIZE, cdiv

_PREPARED_GATHER = PreparedOp("compute_prefill_gather_lens")


def compute_prefill_gather_lens(query_start_loc, seq_lens, num_decodes: int, num_prefills: int,
                                window_size: int = SWA_WINDOW_SIZE, *, out=None,
                                validate: str = "default"):
    """Raw tokens each prefill request gathers from the SWA cache (vLLM's
    ``ComputePrefillMetadataKernel``, upstream.md §8.3).

    Parameters
    ----------
    query_start_loc : int32 array ``[>= num_decodes + num_prefills + 1]``
    seq_lens : int32 array ``[>= num_decodes + num_prefills]``
    num_decodes, num_prefills : int
        Prefill ``i`` is request ``num_decodes + i`` (decodes first).
    window_size : int
        ``W`` (128).
    out : int32 array ``[>= num_prefills]``, optional
        Only ``out[:num_prefills]`` is written.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the query layout of those requests.

    Returns
    -------
    int32 array ``[num_prefills]``: ``q + min(max(L - q, 0), W - 1)`` for the
    request's query length ``q`` and sequence length ``L``: its queries and the
    window before the first one.
    """
    key, results = _PREPARED_GATHER.replay(validate, (out,), query_start_loc, seq_lens,
                                           num_decodes, num_prefills, window_size)
    if results is not None:
        return results
    kind, device, ops = arrays.probe_all({"query_start_loc": query_start_loc,
                                          "seq_lens": seq_lens, "out": out})
    qsl, seq = ops["query_start_loc"], ops["seq_lens"]
    num_decodes = check_int("num_decodes", num_decodes, minimum=0)
    num_prefills = check_int("num_prefills", num_prefills, minimum=0)
    window_size = arrays.check_row_width("window_size", window_size, minimum=1)
    num_reqs = num_decodes + num_prefills
    arrays.check(qsl, (INT32,), 1, min_len=num_reqs + 1)
    arrays.check(seq, (INT32,), 1, min_len=num_reqs)
    lens = arrays.output("out", ops["out"], kind, device, INT32, num_prefills)
    arrays.check_no_alias([lens], [qsl, seq])
    if validation.check_mode(validate):
        validation.query_layout(query_start_loc, seq_lens, kind, num_reqs)

    result = lens.array[:num_prefills]
    if kind in arrays.GPU_KINDS:
        plans = ()
        if num_prefills:
            plans = (families.PREFILL_GATHER.plan(
                device, geometry.elementwise_blocks(num_prefills),
                query=params.QUERY_LAYOUT.values(query_start_loc=qsl.ptr, seq_lens=seq.ptr,
                                                 num_reqs=num_reqs),
                out=lens.ptr, num_decodes=num_decodes, num_prefills=num_prefills,
                window_size=window_size),)
        return _PREPARED_GATHER.launch(key, plans, kind, device, result, (result,))
    cpu.prefill_gather_lens(
        arrays.kernel_view(query_start_loc, kind), arrays.kernel_view(seq_lens, kind),
        np.int64(num_decodes), np.int64(num_prefills), np.int64(window_size),
        arrays.kernel_view(lens.array, kind))
    return result


def _host_lengths(name: str, values) -> list[int]:
    """A list or host int array of lengths >= 0, as Python ints."""
    if isinstance(values, (list, tuple)):
        return [check_int(f"{name}[{i}]", value, minimum=0) for i, value in enumerate(values)]
    kind = arrays.kind_of(values)
    if kind not in (arrays.NUMPY, arrays.TORCH_CPU):
        raise TypeError(f"{name}: expected a list or a host array (numpy or torch CPU; the "
                        f"host copies vLLM keeps), got {arrays.describe(values)}; reading a "
                        "device array would sync")
    host = arrays.host_view(values, kind)
    if host.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {host.dtype}")
    if host.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence, got shape {host.shape}")
    if (host < 0).any():
        i = int(np.flatnonzero(host < 0)[0])
        raise ValueError(f"{name}: expected lengths >= 0, got {int(host[i])} at index {i}")
    return host.astype(np.int64).tolist()


def get_prefill_chunk_plan(seq_lens, query_lens, compress_ratio: int, chunk_size: int,
                           window_size: int, max_model_len: int,
                           max_num_batched_tokens: int) -> list[tuple[int, int, int, int]]:
    """Split the prefill requests into chunks whose gathered workspace fits (host only).

    vLLM's ``get_prefill_chunk_plan`` (#45061, upstream.md §8.4): greedy over the
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
    compresses = compress_ratio > 1
    compressed = [s // compress_ratio if compresses else 0 for s in seq]
    gathered = [q + min(max(s - q, 0), window_size - 1) for s, q in zip(seq, queries)]
    budget = chunk_size * ((cdiv(max_model_len, compress_ratio) if compresses else 0)
                           + window_size + max_num_batched_tokens)
    plan, start = [], 0
    while start < len(seq):
        end, most_compressed, most_gathered = start + 1, compressed[start], gathered[start]
        while end < len(seq):
            wider_compressed = max(most_compressed, compressed[end])
            wider_gathered = max(most_gathered, gathered[end])
            if (end + 1 - start) * (wider_compressed + wider_gathered) > budget:
                break
            end, most_compressed, most_gathered = end + 1, wider_compressed, wider_gathered
        plan.append((start, end, most_compressed, most_compressed + most_gathered))
        start = end
    return plan
