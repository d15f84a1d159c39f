"""``build_indexer_prefill_chunk_metadata``: the C4A Lightning Indexer's
compressed-key ranges of one prefill chunk."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import checks, geometry, host, validation
from .cpu import dcp_local_rows, div_trunc
from .dcp import SINGLE_RANK, ContextParallel, check_cp
from .family import POSITIONS_AXIS, KernelFamily
from .kinds import GPU_KINDS, INT32, INT64, Operand, probe_all
from .launch import Launch, optional
from .params import I64, PTR, QUERY_LAYOUT, Params, QueryLayout
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

PARAMS = Params("IndexerPrefillParams", [
    ("query", QUERY_LAYOUT), ("cu_compressed", PTR), ("token_to_seq", PTR), ("seqlen_ks", PTR),
    ("seqlen_ke", PTR), ("local_cu", PTR), ("positions", PTR), ("positions_int64", I64),
    ("num_compressed", I64), ("ratio", I64), ("query_slice_start", I64),
    ("query_slice_stop", I64), ("dcp_world_size", I64), ("dcp_rank", I64),
    ("cp_interleave", I64)])


@njit(cache=True)
def cpu_indexer_prefill_chunk_metadata(query, cu_compressed, token_to_seq, seqlen_ks, seqlen_ke,
                                       local_cu, positions, positions_int64, num_compressed,
                                       ratio, query_slice_start, query_slice_stop,
                                       dcp_world_size, dcp_rank, cp_interleave):
    """cu_compressed, token_to_seq (-1 past the total), ks/ke of the query slice
    (ks = ke = total past the chunk's last token; rank-local under DCP, with
    local_cu); see kernels/indexer_prefill.cuh."""
    qsl, num_reqs = query.query_start_loc, query.num_reqs
    first = np.int64(qsl[0])
    first_row = np.int64(0)
    first_key = np.int64(0)
    sharded = dcp_world_size > 1
    for b in range(num_reqs):
        cu_compressed[b] = first_row
        if sharded:
            local_cu[b] = first_key
        seq_len = np.int64(query.seq_lens[b])
        rows = max(seq_len // ratio, 0)    # floor and truncation agree for L >= 0
        for x in range(first_row, min(first_row + rows, num_compressed)):
            token_to_seq[x] = b
        qs = np.int64(qsl[b]) - first
        qe = np.int64(qsl[b + 1]) - first
        prefix = seq_len - (qe - qs)
        for a in range(max(qs, query_slice_start), min(qe, query_slice_stop)):
            context = prefix + 1 + a - qs
            if positions.shape[0] > 0:
                context = np.int64(positions[a]) + 1
            keys = div_trunc(context, ratio)
            if sharded:
                keys = dcp_local_rows(keys, dcp_world_size, dcp_rank, cp_interleave)
            seqlen_ks[a - query_slice_start] = first_key
            seqlen_ke[a - query_slice_start] = first_key + keys
        first_row += rows
        first_key += dcp_local_rows(rows, dcp_world_size, dcp_rank, cp_interleave)
    cu_compressed[num_reqs] = first_row
    if sharded:
        local_cu[num_reqs] = first_key
    token_to_seq[min(first_row, num_compressed):num_compressed] = -1
    for a in range(max(np.int64(qsl[num_reqs]) - first, query_slice_start), query_slice_stop):
        seqlen_ks[a - query_slice_start] = first_key
        seqlen_ke[a - query_slice_start] = first_key


FAMILY = KernelFamily("indexer_prefill.cuh", "indexer_prefill_chunk_metadata", PARAMS)
CPU_KERNEL = cpu_indexer_prefill_chunk_metadata
FAMILIES = (FAMILY,)

_OP = PreparedOp("build_indexer_prefill_chunk_metadata")


def build_indexer_prefill_chunk_metadata(query_start_loc, seq_lens, compress_ratio: int,
                                         query_slice_start: int, query_slice_stop: int, *,
                                         num_compressed: int | None = None, positions=None,
                                         dcp_rank: int = 0, dcp_world_size: int = 1,
                                         cp_kv_cache_interleave_size: int = 1, out=None,
                                         validate: str = "default"):
    """Compressed-key ranges of one prefill chunk for the indexer's logits kernel.

    vLLM 0.34's ``BuildPrefillChunkMetadataKernel`` with the arguments of its
    ``build_prefill_chunk_metadata`` (query slice, ShardQ positions, DCP), the
    cumulative compressed lengths computed in the same launch (no separate
    cumsum, no sync). ``indexer_prefill_chunk_tokens`` gives the chunk's
    host fields (token range, ``skip_kv_gather``).

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
    positions : int32 or int64 array ``[>= stop]``, optional
        The chunk's token positions (rebased like the slice; vLLM's ShardQ):
        a token's context is ``positions[a] + 1`` instead of its place in
        the request.
    dcp_rank, dcp_world_size, cp_kv_cache_interleave_size : int
        Decode context parallelism over the compressed rows (the interleave in
        compressed rows): ``ks``/``ke`` count this rank's rows (vLLM's
        ``get_dcp_local_seq_lens`` of the key count), from ``local_cu``.
    out : ``(cu_compressed, token_to_seq, cu_seqlen_ks, cu_seqlen_ke[, local_cu])``, optional
        int32 ``[>= R + 1]``, ``[>= num_compressed]``, ``[>= Q]``, ``[>= Q]``
        (and ``[>= R + 1]``, read under DCP only) with ``Q = stop - start``;
        only the result regions are written.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the chunk's query layout, the slice
        inside its tokens and ``num_compressed``.

    Returns
    -------
    ``(cu_compressed [R + 1], token_to_seq [num_compressed], cu_seqlen_ks [Q],
    cu_seqlen_ke [Q], local_cu_seq_lens [R + 1])``, int32; ``local_cu_seq_lens``
    is ``cu_compressed`` itself on one rank (as in vLLM), else ``[0] +
    cumsum`` of this rank's rows. ``cu_compressed = [0] + cumsum(max(L // r, 0))``;
    ``token_to_seq[cu[b] + x] = b`` for ``x < L[b] // r``; query token ``j`` of
    request ``b`` at rebased offset ``a = qsl[b] - qsl[0] + j`` in the slice
    gets ``ks[a - start] = cu[b]`` and ``ke[a - start] = cu[b] + (L[b] - q[b]
    + 1 + j) // r`` (so ``ke - ks`` is the rows its position sees). Slice
    offsets past the chunk's last token get ``ks = ke = cu[R]`` (an empty range).
    Each block of the launch sums the lengths before its request, so the work
    grows with ``R**2``: meant for a chunk's requests (hundreds), not more.
    """
    key, results = _OP.replay(validate, out, query_start_loc, seq_lens, compress_ratio,
                              query_slice_start, query_slice_stop, num_compressed, positions,
                              dcp_rank, dcp_world_size, cp_kv_cache_interleave_size)
    if results is not None:
        return results
    names = ("cu_compressed", "token_to_seq", "cu_seqlen_ks", "cu_seqlen_ke", "local_cu")
    cu_out, token_to_seq_out, ks_out, ke_out, local_out = checks.out_buffers(
        (*out, None) if isinstance(out, (tuple, list)) and len(out) == 4 else out, names)
    kind, device, ops = probe_all({
        "query_start_loc": query_start_loc, "seq_lens": seq_lens, "positions": positions,
        "out[0]": cu_out, "out[1]": token_to_seq_out, "out[2]": ks_out, "out[3]": ke_out,
        "out[4]": local_out})
    qsl, seq, positions_op = ops["query_start_loc"], ops["seq_lens"], ops["positions"]
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    query_slice_start = check_int("query_slice_start", query_slice_start, minimum=0)
    query_slice_stop = check_int("query_slice_stop", query_slice_stop, minimum=query_slice_start)
    cp = check_cp(dcp_world_size, dcp_rank, cp_kv_cache_interleave_size,
                  names=("dcp_world_size", "dcp_rank", "cp_kv_cache_interleave_size"))
    if positions_op is not None:
        checks.check(positions_op, POSITIONS_AXIS.values, 1, min_len=query_slice_stop)
    checks.check(qsl, (INT32,), 1, min_len=1)
    num_reqs = qsl.shape[0] - 1
    checks.check(seq, (INT32,), 1, min_len=num_reqs)
    if num_compressed is None:
        if kind in GPU_KINDS:
            raise ValueError("num_compressed: required for device arrays (sum(seq_lens // "
                             "compress_ratio) from the host copy of seq_lens); computing it "
                             "here would read seq_lens, a sync")
        host_seq = host.host_view(seq_lens, kind)[:num_reqs].astype(np.int64)
        num_compressed = int(np.maximum(host_seq // compress_ratio, 0).sum())
    num_compressed = check_int("num_compressed", num_compressed, minimum=0)
    num_queries = query_slice_stop - query_slice_start
    cu = checks.output("out[0]", ops["out[0]"], kind, device, INT32, num_reqs + 1)
    token_to_seq = checks.output("out[1]", ops["out[1]"], kind, device, INT32, num_compressed)
    ks = checks.output("out[2]", ops["out[2]"], kind, device, INT32, num_queries)
    ke = checks.output("out[3]", ops["out[3]"], kind, device, INT32, num_queries)
    local_cu = (checks.output("out[4]", ops["out[4]"], kind, device, INT32, num_reqs + 1)
                if cp.world_size > 1 else None)
    checks.check_no_alias([op for op in (cu, token_to_seq, ks, ke, local_cu) if op is not None],
                          [op for op in (qsl, seq, positions_op) if op is not None])
    if validation.check_mode(validate):
        validation.indexer_prefill_inputs(query_start_loc, seq_lens, kind, compress_ratio,
                                          query_slice_stop, num_compressed)
    cu_result = cu.array[:num_reqs + 1]
    results = (cu_result, token_to_seq.array[:num_compressed], ks.array[:num_queries],
               ke.array[:num_queries],
               cu_result if local_cu is None else local_cu.array[:num_reqs + 1])
    launch = indexer_prefill_launch(QueryLayout(qsl, seq, num_reqs), cu, token_to_seq, ks, ke,
                                    num_compressed, compress_ratio, query_slice_start,
                                    query_slice_stop, positions=positions_op, cp=cp,
                                    local_cu=local_cu)
    return _OP.run(key, Checked(kind, device, results, (launch,), results))


def indexer_prefill_launch(query: QueryLayout, cu_compressed: Operand, token_to_seq: Operand,
                           seqlen_ks: Operand, seqlen_ke: Operand, num_compressed: int,
                           compress_ratio: int, query_slice_start: int,
                           query_slice_stop: int, *, positions: Operand | None = None,
                           cp: ContextParallel = SINGLE_RANK,
                           local_cu: Operand | None = None) -> Launch:
    """The chunk's ranges: a block per request, and one for the tail; with
    ``positions`` the tokens' contexts from them, under ``cp`` rank-local
    ranges from ``local_cu``."""
    return Launch(FAMILY, geometry.grid_stride_row_blocks(query.num_reqs + 1),
                  dict(query=query, cu_compressed=cu_compressed, token_to_seq=token_to_seq,
                       seqlen_ks=seqlen_ks, seqlen_ke=seqlen_ke,
                       local_cu=optional(local_cu), positions=optional(positions),
                       positions_int64=int(positions is not None and positions.dtype == INT64),
                       num_compressed=num_compressed, ratio=compress_ratio,
                       query_slice_start=query_slice_start, query_slice_stop=query_slice_stop,
                       dcp_world_size=cp.world_size, dcp_rank=cp.rank,
                       cp_interleave=cp.interleave),
                  kernel=cpu_indexer_prefill_chunk_metadata)



def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    for positions in (None, tiny.out64):           # an absent array is an empty int32 one
        yield (f"indexer_prefill_chunk_metadata[{'none' if positions is None else 'p64'}]",
               indexer_prefill_launch(tiny.query, tiny.pair, tiny.out32, tiny.out32,
                                      tiny.out32, 1, 4, 0, 1, positions=positions))
