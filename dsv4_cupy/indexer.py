"""The C4A Lightning Indexer's metadata: ``build_indexer_prefill_chunk_metadata``
(per prefill chunk) and ``build_indexer_decode_metadata`` (per step)."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, families, geometry, params, validation
from .arrays import INT32
from .prepared import PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

_PREPARED_PREFILL = PreparedOp("build_indexer_prefill_chunk_metadata")
_PREPARED_DECODE = PreparedOp("build_indexer_decode_metadata")


def build_indexer_prefill_chunk_metadata(query_start_loc, seq_lens, compress_ratio: int,
                                         query_slice_start: int, query_slice_stop: int, *,
                                         num_compressed: int | None = None, out=None,
                                         validate: str = "default"):
    """Compressed-key ranges of one prefill chunk for the indexer's logits kernel.

    vLLM's ``BuildPrefillChunkMetadataKernel`` (upstream.md §8.1, no DCP), with
    the cumulative compressed lengths computed in the same launch (no separate
    cumsum, no sync).

    Parameters
    ----------
    query_start_loc : int32 array ``[R + 1]``
        The chunk's requests; rebased by its first element (which need not be 0).
    seq_lens : int32 array ``[>= R]``
    compress_ratio : int
        4.
    query_slice_start, query_slice_stop : int
        The chunk's query tokens ``[start, stop)`` (rebased offsets) to describe.
    num_compressed : int, optional
        Length of ``token_to_seq``: ``sum(seq_lens // compress_ratio)``, which
        the caller knows from the host copy of the sequence lengths. Required
        for device arrays (computing it would read ``seq_lens``: a sync);
        computed from the data on the CPU path when left out. Entries past the
        true total are -1; true entries past it are dropped (``validate="full"``
        refuses a mismatch).
    out : ``(cu_compressed, token_to_seq, cu_seqlen_ks, cu_seqlen_ke)``, optional
        int32 ``[>= R + 1]``, ``[>= num_compressed]``, ``[>= Q]``, ``[>= Q]``
        with ``Q = stop - start``; only the result regions are written.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the chunk's query layout, the slice
        inside its tokens and ``num_compressed``.

    Returns
    -------
    ``(cu_compressed [R + 1], token_to_seq [num_compressed], cu_seqlen_ks [Q],
    cu_seqlen_ke [Q])``, int32. ``cu_compressed = [0] + cumsum(max(L // r, 0))``;
    ``token_to_seq[cu[b] + x] = b`` for ``x < L[b] // r``; query token ``j`` of
    request ``b`` at rebased offset ``a = qsl[b] - qsl[0] + j`` in the slice
    gets ``ks[a - start] = cu[b]`` and ``ke[a - start] = cu[b] + (L[b] - q[b]
    + 1 + j) // r`` (so ``ke - ks`` is the rows its position sees). Slice
    offsets past the chunk's last token get ``ks = ke = cu[R]`` (an empty range).
    Each block of the launch sums the lengths before its request, so the work
    grows with ``R**2``: meant for a chunk's requests (hundreds), not more.
    """
    key, results = _PREPARED_PREFILL.replay(validate, out, query_start_loc, seq_lens,
                                            compress_ratio, query_slice_start, query_slice_stop,
                                            num_compressed)
    if results is not None:
        return results
    cu_out, token_to_seq_out, ks_out, ke_out = arrays.out_buffers(
        out, ("cu_compressed", "token_to_seq", "cu_seqlen_ks", "cu_seqlen_ke"))
    kind, device, ops = arrays.probe_all({
        "query_start_loc": query_start_loc, "seq_lens": seq_lens, "out[0]": cu_out,
        "out[1]": token_to_seq_out, "out[2]": ks_out, "out[3]": ke_out})
    qsl, seq = ops["query_start_loc"], ops["seq_lens"]
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    query_slice_start = check_int("query_slice_start", query_slice_start, minimum=0)
    query_slice_stop = check_int("query_slice_stop", query_slice_stop, minimum=query_slice_start)
    arrays.check(qsl, (INT32,), 1, min_len=1)
    num_reqs = qsl.shape[0] - 1
    arrays.check(seq, (INT32,), 1, min_len=num_reqs)
    if num_compressed is None:
        if kind in arrays.GPU_KINDS:
            raise ValueError("num_compressed: required for device arrays (sum(seq_lens // "
                             "compress_ratio) from the host copy of seq_lens); computing it "
                             "here would read seq_lens, a sync")
        host_seq = arrays.host_view(seq_lens, kind)[:num_reqs].astype(np.int64)
        num_compressed = int(np.maximum(host_seq // compress_ratio, 0).sum())
    num_compressed = check_int("num_compressed", num_compressed, minimum=0)
    num_queries = query_slice_stop - query_slice_start
    cu = arrays.output("out[0]", ops["out[0]"], kind, device, INT32, num_reqs + 1)
    token_to_seq = arrays.output("out[1]", ops["out[1]"], kind, device, INT32, num_compressed)
    ks = arrays.output("out[2]", ops["out[2]"], kind, device, INT32, num_queries)
    ke = arrays.output("out[3]", ops["out[3]"], kind, device, INT32, num_queries)
    arrays.check_no_alias([cu, token_to_seq, ks, ke], [qsl, seq])
    if validation.check_mode(validate):
        validation.indexer_prefill_inputs(query_start_loc, seq_lens, kind, compress_ratio,
                                          query_slice_stop, num_compressed)

    results = (cu.array[:num_reqs + 1], token_to_seq.array[:num_compressed],
               ks.array[:num_queries], ke.array[:num_queries])
    if kind in arrays.GPU_KINDS:
        plans = (families.INDEXER_PREFILL.plan(
            device, min(num_reqs + 1, geometry.MAX_GRID_STRIDE_BLOCKS),
            query=params.QUERY_LAYOUT.values(query_start_loc=qsl.ptr, seq_lens=seq.ptr,
                                             num_reqs=num_reqs),
            cu_compressed=cu.ptr, token_to_seq=token_to_seq.ptr, seqlen_ks=ks.ptr,
            seqlen_ke=ke.ptr, num_compressed=num_compressed, ratio=compress_ratio,
            query_slice_start=query_slice_start, query_slice_stop=query_slice_stop),)
        return _PREPARED_PREFILL.launch(key, plans, kind, device, results, results)
    view = arrays.kernel_view
    cpu.indexer_prefill_chunk_metadata(
        view(query_start_loc, kind), np.int64(num_reqs), view(seq_lens, kind),
        np.int64(compress_ratio), np.int64(query_slice_start), np.int64(query_slice_stop),
        view(cu.array, kind), view(token_to_seq.array, kind)[:num_compressed],
        view(ks.array, kind), view(ke.array, kind))
    return results


def build_indexer_decode_metadata(query_start_loc, seq_lens, block_table, num_tokens: int,
                                  compress_ratio: int, *, out=None, validate: str = "default"):
    """Per-token decode metadata for the indexer's paged MQA logits and top-k.

    vLLM's device-fused ``_indexer_decode_metadata_kernel`` (#56562, upstream.md
    §8.2) followed by DeepSeek-V4's division of the lengths by the ratio, in
    one launch; the request of each token comes from the device
    ``query_start_loc`` (a stale host copy does not matter).

    Parameters
    ----------
    query_start_loc : int32 array ``[R + 1]``
    seq_lens : int32 array ``[>= R]``
    block_table : int32 array ``[>= R, cols]`` (rows contiguous, any row stride)
    num_tokens : int
        Tokens to describe, CUDA-graph padding included (``>= query_start_loc[R]``).
    compress_ratio : int
        4.
    out : ``(context_lens, req_ids, decode_lens, block_rows)``, optional
        int32 ``[>= num_tokens]`` x3 and ``[>= num_tokens, >= cols]``. Persistent
        buffers: ``context_lens`` is written to its end (zeros past
        ``num_tokens``, so consumers that read the whole buffer see no stale
        length); the others only in the result region.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the query layout and that
        ``num_tokens`` covers every request's tokens.

    Returns
    -------
    ``(context_lens [num_tokens], req_ids [num_tokens], decode_lens [num_tokens],
    block_rows [num_tokens, cols])``, int32. Token ``t < query_start_loc[R]``
    of request ``b`` at in-request offset ``j``: ``max(L - q + j + 1, 0) //
    compress_ratio`` (the compressed rows its position sees; never negative,
    vLLM #51593), ``b``, 1, ``block_table[b]``. A padding token: 0, the distinct
    id ``R + (t - query_start_loc[R])``, 1, zeros.
    """
    key, results = _PREPARED_DECODE.replay(validate, out, query_start_loc, seq_lens,
                                           block_table, num_tokens, compress_ratio)
    if results is not None:
        return results
    context_out, req_out, decode_out, rows_out = arrays.out_buffers(
        out, ("context_lens", "req_ids", "decode_lens", "block_rows"))
    kind, device, ops = arrays.probe_all({
        "query_start_loc": query_start_loc, "seq_lens": seq_lens, "block_table": block_table,
        "out[0]": context_out, "out[1]": req_out, "out[2]": decode_out, "out[3]": rows_out})
    qsl, seq, table = ops["query_start_loc"], ops["seq_lens"], ops["block_table"]
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    arrays.check(qsl, (INT32,), 1, min_len=1)
    num_reqs = qsl.shape[0] - 1
    arrays.check(seq, (INT32,), 1, min_len=num_reqs)
    arrays.check(table, (INT32,), 2, min_len=num_reqs)
    cols = arrays.check_row_width("block_table.shape[1]", table.shape[1])
    context = arrays.output("out[0]", ops["out[0]"], kind, device, INT32, num_tokens)
    req_ids = arrays.output("out[1]", ops["out[1]"], kind, device, INT32, num_tokens)
    decode = arrays.output("out[2]", ops["out[2]"], kind, device, INT32, num_tokens)
    rows = arrays.output("out[3]", ops["out[3]"], kind, device, INT32, num_tokens, cols)
    arrays.check_no_alias([context, req_ids, decode, rows], [qsl, seq, table])
    if validation.check_mode(validate):
        validation.query_layout(query_start_loc, seq_lens, kind, num_reqs, num_tokens)

    context_len = context.shape[0]
    results = (context.array[:num_tokens], req_ids.array[:num_tokens],
               decode.array[:num_tokens], rows.array[:num_tokens, :cols])
    if kind in arrays.GPU_KINDS:
        plans = ()
        if context_len:
            plans = (families.INDEXER_DECODE.plan(
                device, geometry.indexer_decode_blocks(num_tokens, cols, context_len),
                query=params.QUERY_LAYOUT.values(query_start_loc=qsl.ptr, seq_lens=seq.ptr,
                                                 num_reqs=num_reqs),
                table=arrays.block_table_group(table), context_lens=context.ptr,
                req_ids=req_ids.ptr, decode_lens=decode.ptr, block_rows=rows.ptr,
                block_rows_stride=arrays.row_stride(rows), num_tokens=num_tokens,
                context_lens_len=context_len, ratio=compress_ratio),)
        return _PREPARED_DECODE.launch(key, plans, kind, device, results, results)
    view, view_2d = arrays.kernel_view, arrays.kernel_view_2d
    flat_table, table_stride = view_2d(block_table, kind)
    flat_rows, rows_stride = view_2d(rows.array, kind)
    cpu.indexer_decode_metadata(
        view(query_start_loc, kind), np.int64(num_reqs), view(seq_lens, kind), flat_table,
        table_stride, np.int64(cols), np.int64(num_tokens), np.int64(compress_ratio),
        view(context.array, kind), view(req_ids.array, kind), view(decode.array, kind),
        flat_rows, rows_stride)
    return results
