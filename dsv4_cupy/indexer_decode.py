"""``build_indexer_decode_metadata``: the C4A Lightning Indexer's per-token
decode metadata."""
from __future__ import annotations

import numpy as np
from numba import prange

from . import checks, geometry, validation
from .cpu import ParallelKernel, request_of
from .family import KernelFamily
from .kinds import INT32, Operand, probe_all
from .launch import Launch, table_of
from .params import BLOCK_TABLE, I64, PTR, QUERY_LAYOUT, Params, QueryLayout
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

PARAMS = Params("IndexerDecodeParams", [
    ("query", QUERY_LAYOUT), ("table", BLOCK_TABLE), ("context_lens", PTR), ("req_ids", PTR),
    ("decode_lens", PTR), ("block_rows", PTR), ("per_req_lens", PTR), ("block_rows_stride", I64),
    ("num_tokens", I64), ("context_lens_len", I64), ("ratio", I64), ("piece_shift", I64),
    ("pieces", I64)])


@ParallelKernel
def cpu_indexer_decode_metadata(query, table, context_lens, req_ids, decode_lens, block_rows,
                                per_req_lens, block_rows_stride, num_tokens, context_lens_len,
                                ratio):
    """Per token: context length // ratio (0 for padding), request id (distinct
    R + (t - qsl[R]) for padding), decode length 1, block-table row (zeros for
    padding); context_lens is zeroed past num_tokens to context_lens_len; per
    request: its query length."""
    qsl, seq_lens, num_reqs = query
    for b in prange(num_reqs):
        per_req_lens[b] = qsl[b + 1] - qsl[b]
    entries, _, cols, table_stride = table
    mapped = np.int64(qsl[num_reqs])
    for t in prange(num_tokens):
        row = t * block_rows_stride
        if num_reqs > 0 and t < mapped:
            b = request_of(qsl, num_reqs, t)
            qs = np.int64(qsl[b])
            length = np.int64(seq_lens[b]) - (np.int64(qsl[b + 1]) - qs) + (t - qs) + 1
            context_lens[t] = max(length, 0) // ratio
            req_ids[t] = b
            source = b * table_stride
            block_rows[row:row + cols] = entries[source:source + cols]
        else:
            context_lens[t] = 0
            req_ids[t] = np.int32(num_reqs + (t - mapped))
            block_rows[row:row + cols] = 0
        decode_lens[t] = 1
    context_lens[num_tokens:context_lens_len] = 0


FAMILY = KernelFamily("indexer_decode.cuh", "indexer_decode_metadata", PARAMS)
CPU_KERNEL = cpu_indexer_decode_metadata
FAMILIES = (FAMILY,)

_OP = PreparedOp("build_indexer_decode_metadata")


def build_indexer_decode_metadata(query_start_loc, seq_lens, block_table, num_tokens: int,
                                  compress_ratio: int, *, out=None, validate: str = "default"):
    """Per-token decode metadata for the indexer's paged MQA logits and top-k.

    vLLM 0.34's device-fused ``_indexer_decode_metadata_kernel`` (sm_100)
    followed by DeepSeek-V4's division of the lengths by the ratio, in one
    launch; the request of each token comes from the device
    ``query_start_loc`` (a stale host copy does not matter). The lengths are
    also those of vLLM's flattening producers on sm_90
    (``PrepareUniformDecodeKernel`` and the torch varlen flatten);
    ``build_indexer_native_decode_metadata`` gives its native layout.

    Parameters
    ----------
    query_start_loc : int32 array ``[R + 1]``
    seq_lens : int32 array ``[>= R]``
    block_table : int32 array ``[>= R, cols]`` (rows contiguous, any row stride)
    num_tokens : int
        Tokens to describe, CUDA-graph padding included (``>= query_start_loc[R]``).
    compress_ratio : int
        4.
    out : ``(context_lens, req_ids, decode_lens, block_rows, per_req_decode_lens)``, optional
        int32 ``[>= num_tokens]`` x3, ``[>= num_tokens, >= cols]`` and ``[>= R]``.
        Persistent buffers: ``context_lens`` is written to its end (zeros past
        ``num_tokens``, so consumers that read the whole buffer see no stale
        length); the others only in the result region.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the query layout and that
        ``num_tokens`` covers every request's tokens.

    Returns
    -------
    ``(context_lens [num_tokens], req_ids [num_tokens], decode_lens [num_tokens],
    block_rows [num_tokens, cols], per_req_decode_lens [R])``, int32. Token ``t <
    query_start_loc[R]`` of request ``b`` at in-request offset ``j``: ``max(L - q
    + j + 1, 0) // compress_ratio`` (the compressed rows its position sees;
    never negative), ``b``, 1, ``block_table[b]``. A padding token: 0, the
    distinct id ``R + (t - query_start_loc[R])`` (vLLM's ``indices``), 1, zeros
    (vLLM's flatten clears only column 0). ``per_req_decode_lens[b]`` is request
    ``b``'s query length.
    """
    key, results = _OP.replay(validate, out, query_start_loc, seq_lens, block_table, num_tokens,
                              compress_ratio)
    if results is not None:
        return results
    context_out, req_out, decode_out, rows_out, per_req_out = checks.out_buffers(
        out, ("context_lens", "req_ids", "decode_lens", "block_rows", "per_req_decode_lens"))
    kind, device, ops = probe_all({
        "query_start_loc": query_start_loc, "seq_lens": seq_lens, "block_table": block_table,
        "out[0]": context_out, "out[1]": req_out, "out[2]": decode_out, "out[3]": rows_out,
        "out[4]": per_req_out})
    qsl, seq, table = ops["query_start_loc"], ops["seq_lens"], ops["block_table"]
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    checks.check(qsl, (INT32,), 1, min_len=1)
    num_reqs = qsl.shape[0] - 1
    checks.check(seq, (INT32,), 1, min_len=num_reqs)
    checks.check(table, (INT32,), 2, min_len=num_reqs)
    cols = checks.check_row_width("block_table.shape[1]", table.shape[1])
    context = checks.output("out[0]", ops["out[0]"], kind, device, INT32, num_tokens)
    req_ids = checks.output("out[1]", ops["out[1]"], kind, device, INT32, num_tokens)
    decode = checks.output("out[2]", ops["out[2]"], kind, device, INT32, num_tokens)
    rows = checks.output("out[3]", ops["out[3]"], kind, device, INT32, num_tokens, cols)
    per_req = checks.output("out[4]", ops["out[4]"], kind, device, INT32, num_reqs)
    checks.check_no_alias([context, req_ids, decode, rows, per_req], [qsl, seq, table])
    if validation.check_mode(validate):
        validation.query_layout(query_start_loc, seq_lens, kind, num_reqs, num_tokens)
    results = (context.array[:num_tokens], req_ids.array[:num_tokens],
               decode.array[:num_tokens], rows.array[:num_tokens, :cols],
               per_req.array[:num_reqs])
    launch = indexer_decode_launch(QueryLayout(qsl, seq, num_reqs), table, context, req_ids,
                                   decode, rows, per_req, num_tokens, compress_ratio)
    return _OP.run(key, Checked(kind, device, results, (launch,), results))


def indexer_decode_launch(query: QueryLayout, table: Operand, context_lens: Operand,
                          req_ids: Operand, decode_lens: Operand, block_rows: Operand,
                          per_req_lens: Operand, num_tokens: int, compress_ratio: int) -> Launch:
    """The decode metadata of ``num_tokens`` tokens and ``query.num_reqs``
    requests; ``context_lens`` is written to its end (zeros past ``num_tokens``)."""
    context_len = context_lens.shape[0]
    piece = geometry.indexer_piece(num_tokens, table.shape[1], table.device)
    pieces = geometry.warp_pieces(table.shape[1], piece)
    blocks = geometry.indexer_decode_blocks(num_tokens, pieces, context_len, query.num_reqs)
    return Launch(FAMILY, blocks,
                  dict(query=query, table=table_of(table), context_lens=context_lens,
                       req_ids=req_ids, decode_lens=decode_lens, block_rows=block_rows,
                       per_req_lens=per_req_lens,
                       block_rows_stride=checks.row_stride(block_rows), num_tokens=num_tokens,
                       context_lens_len=context_len, ratio=compress_ratio,
                       piece_shift=piece.bit_length() - 1, pieces=pieces),
                  kernel=cpu_indexer_decode_metadata)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    yield "indexer_decode_metadata", indexer_decode_launch(
        tiny.query, tiny.table, tiny.out32, tiny.out32, tiny.out32, tiny.rows, tiny.out32, 1, 4)
