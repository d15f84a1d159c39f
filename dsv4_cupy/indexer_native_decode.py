"""``build_indexer_native_decode_metadata``: the C4A Lightning Indexer's decode
metadata in vLLM's native ``[B, next_n]`` layout (sm_90's default)."""
from __future__ import annotations

import numpy as np
from numba import prange

from . import checks, geometry, validation
from .cpu import ParallelKernel
from .family import KernelFamily
from .kinds import INT32, Operand, probe_all
from .launch import Launch
from .params import I64, PTR, QUERY_LAYOUT, Params, QueryLayout
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

PARAMS = Params("IndexerNativeDecodeParams", [
    ("query", QUERY_LAYOUT), ("seq_lens_out", PTR), ("decode_lens", PTR),
    ("seq_lens_stride", I64), ("num_rows", I64), ("max_decode_len", I64), ("ratio", I64)])


@ParallelKernel
def cpu_indexer_native_decode_metadata(query, seq_lens_out, decode_lens, seq_lens_stride,
                                       num_rows, max_decode_len, ratio):
    """Row b < R: max(L_b - max_decode_len + 1 + j, 0) // ratio for j <
    max_decode_len; rows past R: 0. decode_lens[b] = the request's query length."""
    qsl, seq_lens, num_reqs = query
    for b in prange(num_rows):
        row = b * seq_lens_stride
        for j in range(max_decode_len):
            visible = 0
            if b < num_reqs:
                visible = max(np.int64(seq_lens[b]) - max_decode_len + 1 + j, 0) // ratio
            seq_lens_out[row + j] = visible
        if b < num_reqs:
            decode_lens[b] = qsl[b + 1] - qsl[b]


FAMILY = KernelFamily("indexer_decode.cuh", "indexer_native_decode_metadata", PARAMS)
CPU_KERNEL = cpu_indexer_native_decode_metadata
FAMILIES = (FAMILY,)

_OP = PreparedOp("build_indexer_native_decode_metadata")


def build_indexer_native_decode_metadata(query_start_loc, seq_lens, max_decode_len: int,
                                         compress_ratio: int, num_rows: int | None = None, *,
                                         out=None, validate: str = "default"):
    """Decode metadata for the indexer's paged MQA logits in vLLM's native layout.

    vLLM 0.34's ``DeepseekV32IndexerMetadataBuilder`` uses this layout on sm_90
    when the speculative depth ``next_n`` is 1, 2 or 4 (DeepGEMM's native
    depths) and no flattening is configured: one row per decode request, one
    column per query position, lengths divided by the compress ratio.
    ``build_indexer_decode_metadata`` gives the flattened layouts (vLLM's
    uniform ``PrepareUniformDecodeKernel``, its torch varlen flatten and sm_100's
    fused kernel describe the same per-token lengths).

    Parameters
    ----------
    query_start_loc : int32 array ``[R + 1]``
        The decode requests' query layout.
    seq_lens : int32 array ``[>= R]``
    max_decode_len : int
        Columns: the step's longest decode query (``>= 1``). vLLM's
        ``requires_padding`` is whether the requests' query lengths differ.
    compress_ratio : int
        4.
    num_rows : int, optional
        Rows to write, ``>= R`` (default ``R``); rows past ``R`` are 0. vLLM's
        ``next_n == 1`` form is ``max_decode_len=1, num_rows=num_decode_tokens``.
    out : ``(seq_lens_out, decode_lens)``, optional
        int32 ``[>= num_rows, >= max_decode_len]`` (rows contiguous, any row
        stride) and ``[>= R]``; only the result region is written.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the query layout and that no
        request's query is longer than ``max_decode_len``.

    Returns
    -------
    ``(seq_lens [num_rows, max_decode_len], decode_lens [R])``, int32: element
    ``(b, j)`` is ``max(seq_lens[b] - max_decode_len + 1 + j, 0) //
    compress_ratio``; ``decode_lens[b]`` is request ``b``'s query length (vLLM's
    ``decode_lens`` and ``per_req_decode_lens`` both hold it). The block table
    is the decode requests' rows of the group's table, as given.
    """
    key, results = _OP.replay(validate, out, query_start_loc, seq_lens, max_decode_len,
                              compress_ratio, num_rows)
    if results is not None:
        return results
    lens_out, decode_out = checks.out_buffers(out, ("seq_lens_out", "decode_lens"))
    kind, device, ops = probe_all({"query_start_loc": query_start_loc, "seq_lens": seq_lens,
                                   "out[0]": lens_out, "out[1]": decode_out})
    qsl, seq = ops["query_start_loc"], ops["seq_lens"]
    checks.check(qsl, (INT32,), 1, min_len=1)
    num_reqs = qsl.shape[0] - 1
    checks.check(seq, (INT32,), 1, min_len=num_reqs)
    max_decode_len = checks.check_row_width("max_decode_len", max_decode_len, minimum=1)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    num_rows = check_int("num_rows", num_reqs if num_rows is None else num_rows,
                         minimum=num_reqs)
    lens = checks.output("out[0]", ops["out[0]"], kind, device, INT32, num_rows, max_decode_len)
    decode = checks.output("out[1]", ops["out[1]"], kind, device, INT32, num_reqs)
    checks.check_no_alias([lens, decode], [qsl, seq])
    if validation.check_mode(validate):
        validation.query_layout(query_start_loc, seq_lens, kind, num_reqs)
        validation.longest_query(query_start_loc, kind, num_reqs, max_decode_len)
    results = (lens.array[:num_rows, :max_decode_len], decode.array[:num_reqs])
    launch = native_decode_launch(QueryLayout(qsl, seq, num_reqs), lens, decode, num_rows,
                                  max_decode_len, compress_ratio)
    return _OP.run(key, Checked(kind, device, results, (launch,), results))


def native_decode_launch(query: QueryLayout, seq_lens_out: Operand, decode_lens: Operand,
                         num_rows: int, max_decode_len: int, compress_ratio: int) -> Launch:
    """The native-layout lengths of ``num_rows`` rows of ``max_decode_len``."""
    return Launch(FAMILY, geometry.elementwise_blocks(num_rows * max_decode_len),
                  dict(query=query, seq_lens_out=seq_lens_out, decode_lens=decode_lens,
                       seq_lens_stride=checks.row_stride(seq_lens_out), num_rows=num_rows,
                       max_decode_len=max_decode_len, ratio=compress_ratio),
                  kernel=cpu_indexer_native_decode_metadata)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    yield "indexer_native_decode_metadata", native_decode_launch(
        tiny.query, tiny.rows, tiny.out32, 1, 1, 4)
