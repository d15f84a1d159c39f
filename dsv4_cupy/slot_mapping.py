"""``get_compressed_slot_mapping``: where each token's compressed row is written."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, families, geometry, params, validation
from .arrays import INT32, INT64
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

#: Bound of context-parallel world and interleave sizes.
MAX_CP_SIZE = 1 << 16


def check_cp(cp_world_size, cp_rank, cp_kv_cache_interleave_size) -> tuple[int, int, int]:
    world = check_int("cp_world_size", cp_world_size, minimum=1, maximum=MAX_CP_SIZE)
    rank = check_int("cp_rank", cp_rank, minimum=0, maximum=world - 1)
    interleave = check_int("cp_kv_cache_interleave_size", cp_kv_cache_interleave_size,
                           minimum=1, maximum=MAX_CP_SIZE)
    return world, rank, interleave


def get_compressed_slot_mapping(num_tokens: int, query_start_loc, seq_lens, block_table,
                                block_size: int, compress_ratio: int, out=None, *,
                                cp_world_size: int = 1, cp_rank: int = 0,
                                cp_kv_cache_interleave_size: int = 1, validate: str = "default",
                                num_cache_blocks: int | None = None):
    """Physical compressed-cache slot of every token that closes a compression group.

    Parameters
    ----------
    num_tokens : int
        Tokens in the step (``num_actual_tokens``).
    query_start_loc : int32 array ``[R + 1]`` (at least ``block_table.shape[0] + 1``)
    seq_lens : int32 array ``[>= R]``
        Sequence lengths including this step's queries.
    block_table : int32 array ``[R, max_blocks]`` (rows contiguous, any row stride)
        One row per request; negative entries are read as 0 (the builder's
        clamp) without changing the table.
    block_size : int
        *Storage* block size: rows per compressed block (``256 // compress_ratio``).
    compress_ratio : int
        4 (C4A) or 128 (C128A).
    out : int64 array ``[>= num_tokens]``, optional
        Persistent buffer: **all** of it is set to -1, then the slots are written.
    cp_world_size, cp_rank, cp_kv_cache_interleave_size : int
        Context-parallel sharding of the compressed cache (1, 0, 1: none).
    validate : "default" or "full"
        "full" also checks (reading the inputs: a sync on GPU) that
        ``query_start_loc`` starts at 0 and never decreases, ``seq_len >=
        query_len``, and every block used lies inside its table row and, with
        ``num_cache_blocks``, inside the cache. The default never syncs.

    Returns
    -------
    int64 array ``[num_tokens]`` (``out[:num_tokens]`` when given). The token at
    ``pos = seq_len - query_len + j`` gets ``block_table[b, blk] * block_size + off``
    when ``pos >= 0`` and ``(pos + 1) % compress_ratio == 0`` and this rank owns
    the row, else -1. A block index past the table row gives -1, never a read
    of the next row.
    """
    kind, device, ops = arrays.probe_all({"query_start_loc": query_start_loc,
                                          "seq_lens": seq_lens, "block_table": block_table,
                                          "out": out})
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    world, rank, interleave = check_cp(cp_world_size, cp_rank, cp_kv_cache_interleave_size)
    table, qsl, seq = ops["block_table"], ops["query_start_loc"], ops["seq_lens"]
    arrays.check(table, (INT32,), 2)
    num_rows = table.shape[0]
    arrays.check(qsl, (INT32,), 1, min_len=num_rows + 1)
    arrays.check(seq, (INT32,), 1, min_len=num_rows)
    out = arrays.output("out", ops["out"], kind, device, INT64, num_tokens)
    arrays.check_no_alias([out], [qsl, seq, table])
    if validation.check_mode(validate):
        validation.slot_mapping_inputs(query_start_loc, seq_lens, block_table, kind, block_size,
                                       compress_ratio, world, num_cache_blocks)
    out_len = out.shape[0]
    if kind in arrays.GPU_KINDS:
        if out_len:
            families.SLOT_MAPPING.launch(
                device, geometry.elementwise_blocks(out_len), arrays.launch_stream(kind, device),
                query=params.QUERY_LAYOUT.values(query_start_loc=qsl.ptr, seq_lens=seq.ptr,
                                                 num_reqs=num_rows),
                table=arrays.block_table_group(table),
                geometry=params.SLOT_GEOMETRY.values(
                    block_size=block_size, ratio=compress_ratio, cp_world_size=world,
                    cp_rank=rank, cp_interleave=interleave),
                token_slots=0, out=out.ptr, out_len=out_len, num_tokens=out_len)
    else:
        host = arrays.host_view
        cpu.compressed_slot_mapping(host(query_start_loc, kind), host(seq_lens, kind),
                                    host(block_table, kind), np.int64(block_size),
                                    np.int64(compress_ratio), np.int64(world), np.int64(rank),
                                    np.int64(interleave), host(out.array, kind))
    return out.array[:num_tokens]
