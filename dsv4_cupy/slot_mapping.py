"""``get_compressed_slot_mapping``: where each token's compressed row is written."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import checks, validation
from .dcp import ContextParallel, check_cp, merge_aliases
from .family import SLOT_MAPPING_AXIS, KernelFamily
from .geometry import elementwise_blocks
from .kinds import INT32, INT64, Operand, probe_all
from .launch import Launch, NoArray, table_of
from .params import (BLOCK_TABLE, I64, PTR, QUERY_LAYOUT, SLOT_GEOMETRY, Params, QueryLayout,
                     SlotGeometry)
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

PARAMS = Params("SlotMappingParams", [
    ("query", QUERY_LAYOUT), ("table", BLOCK_TABLE), ("geometry", SLOT_GEOMETRY),
    ("token_slots", PTR), ("out", PTR), ("out_len", I64), ("num_tokens", I64)])


@njit(cache=True)
def cpu_compressed_slot_mapping(query, table, geometry, token_slots, out, num_tokens):
    """Fills all of ``out`` with -1, then writes each group-closing token's slot.

    Only tokens below ``min(num_tokens, len(out))`` get a slot, so the loop is
    bounded by the output whatever the query layout says. Block-table entries
    are read clamped at 0; a block index past the table's row is "no slot".
    With ``token_slots`` (not empty; single rank only), a token whose own slot
    is negative gets no compressed slot either.
    """
    out[:] = -1
    qsl, seq_lens = query.query_start_loc, query.seq_lens
    block_size, ratio = geometry.block_size, geometry.ratio
    world, interleave = geometry.cp_world_size, geometry.cp_interleave
    virtual_block = block_size * world
    limit = min(num_tokens, out.shape[0])
    own_slot_rule = token_slots.shape[0] > 0 and world == 1
    for b in range(table.rows):
        qs = np.int64(qsl[b])
        qe = np.int64(qsl[b + 1])
        start = np.int64(seq_lens[b]) - (qe - qs)
        for idx in range(max(qs, 0), min(qe, limit)):
            pos = start + (idx - qs)
            if pos < 0 or (pos + 1) % ratio != 0:
                continue
            if own_slot_rule and token_slots[idx] < 0:
                continue
            c = pos // ratio
            blk = c // virtual_block
            v = c - blk * virtual_block
            if (v // interleave) % world != geometry.cp_rank or blk >= table.cols:
                continue
            off = (v // (world * interleave)) * interleave + v % interleave
            entry = np.int64(table.entries[b * table.row_stride + blk])
            out[idx] = max(entry, 0) * block_size + off


FAMILY = KernelFamily("slot_mapping.cuh", "compressed_slot_mapping", PARAMS, (SLOT_MAPPING_AXIS,))
CPU_KERNEL = cpu_compressed_slot_mapping
FAMILIES = (FAMILY,)

_OP = PreparedOp("get_compressed_slot_mapping")


def get_compressed_slot_mapping(num_tokens: int, query_start_loc, seq_lens, block_table,
                                block_size: int, compress_ratio: int, out=None,
                                cp_world_size: int | None = None, cp_rank: int | None = None,
                                cp_kv_cache_interleave_size: int = 1, *,
                                dcp_world_size: int | None = None, dcp_rank: int | None = None,
                                token_slot_mapping=None, validate: str = "default",
                                num_cache_blocks: int | None = None):
    """Physical compressed-cache slot of every token that closes a compression group.

    Parameters
    ----------
    num_tokens : int
        Tokens in the step (``num_actual_tokens``); elements at or past it are -1.
    query_start_loc : int32 array ``[R + 1]`` (at least ``block_table.shape[0] + 1``)
    seq_lens : int32 array ``[>= R]``
        Sequence lengths including this step's queries.
    block_table : int32 array ``[R, max_blocks]`` (rows contiguous, any row stride)
        One row per request; negative entries are read as 0 (the builder's
        clamp) without changing the table.
    block_size : int
        The **storage** block size: compressed rows per cache block,
        ``256 // compress_ratio`` (64 for C4A, 2 for C128A). Not the builder's
        logical ``block_size`` of 256.
    compress_ratio : int
        4 (C4A) or 128 (C128A).
    out : int64 array ``[>= num_tokens]``, optional
        Persistent buffer: **all** of it is written (-1 where there is no slot).
    cp_world_size, cp_rank, cp_kv_cache_interleave_size : int
        Context-parallel sharding of the compressed cache (default 1, 0, 1: none),
        positional after ``out`` as in vLLM. ``dcp_world_size`` and ``dcp_rank``
        are keyword aliases (newer vLLM's names); a conflicting pair is an error.
        With more than one rank, ``block_size`` must be a multiple of the interleave.
    token_slot_mapping : int32 or int64 array ``[>= num_tokens]``, optional
        The tokens' own slot mapping (newer vLLM): on a single rank, a token
        whose own slot is negative gets -1. Ignored with more than one rank.
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
    key, results = _OP.replay(validate, (out,), num_tokens, query_start_loc, seq_lens,
                              block_table, block_size, compress_ratio, cp_world_size, cp_rank,
                              cp_kv_cache_interleave_size, dcp_world_size, dcp_rank,
                              token_slot_mapping)
    if results is not None:
        return results
    kind, device, ops = probe_all({"query_start_loc": query_start_loc, "seq_lens": seq_lens,
                                   "block_table": block_table, "out": out,
                                   "token_slot_mapping": token_slot_mapping})
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    cp = check_cp(merge_aliases("cp_world_size", cp_world_size, "dcp_world_size",
                                dcp_world_size, 1),
                  merge_aliases("cp_rank", cp_rank, "dcp_rank", dcp_rank, 0),
                  cp_kv_cache_interleave_size, block_size=block_size)
    table, qsl, seq = ops["block_table"], ops["query_start_loc"], ops["seq_lens"]
    checks.check(table, (INT32,), 2)
    num_rows = table.shape[0]
    checks.check(qsl, (INT32,), 1, min_len=num_rows + 1)
    checks.check(seq, (INT32,), 1, min_len=num_rows)
    token_slots = ops["token_slot_mapping"]
    if token_slots is not None:
        checks.check(token_slots, SLOT_MAPPING_AXIS.values, 1, min_len=num_tokens)
    out = checks.output("out", ops["out"], kind, device, INT64, num_tokens)
    checks.check_no_alias([out], [qsl, seq, table, token_slots])
    if validation.check_mode(validate, num_cache_blocks):
        validation.storage_block(block_size, compress_ratio)
        validation.slot_mapping_inputs(query_start_loc, seq_lens, block_table, kind, block_size,
                                       compress_ratio, cp.world_size, num_cache_blocks)
    result = out.array[:num_tokens]
    launch = slot_mapping_launch(qsl, seq, table, slot_geometry(block_size, compress_ratio, cp),
                                 out, num_tokens, token_slots)
    return _OP.run(key, Checked(kind, device, result, (launch,), (result,)))


def slot_geometry(block_size: int, compress_ratio: int, cp: ContextParallel) -> SlotGeometry:
    """Where a group's compressed rows live: its storage block, ratio and sharding."""
    return SlotGeometry(block_size=block_size, ratio=compress_ratio,
                        cp_world_size=cp.world_size, cp_rank=cp.rank,
                        cp_interleave=cp.interleave)


def slot_mapping_launch(query_start_loc: Operand, seq_lens: Operand, table: Operand,
                        geometry: SlotGeometry, out: Operand, num_tokens: int,
                        token_slots: Operand | None = None) -> Launch:
    """The compressed slot mapping of the first ``num_tokens`` tokens, written
    over the whole of ``out`` (-1 where there is no slot)."""
    out_len = out.shape[0]
    slot_dtype = INT64 if token_slots is None else token_slots.dtype
    return Launch(
        FAMILY, elementwise_blocks(out_len),
        dict(query=QueryLayout(query_start_loc, seq_lens, table.shape[0]), table=table_of(table),
             geometry=geometry, token_slots=NoArray(INT64) if token_slots is None else token_slots,
             out=out, out_len=out_len, num_tokens=num_tokens),
        variant={"slot_mapping": slot_dtype}, kernel=cpu_compressed_slot_mapping)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``):
    the tokens' own slots of either dtype (none is an empty int64 array)."""
    for slots in (tiny.out32, tiny.out64):
        yield (f"compressed_slot_mapping[s{slots.dtype.itemsize * 8}]",
               slot_mapping_launch(tiny.qsl, tiny.seq, tiny.table, tiny.geometry, tiny.out64, 1,
                                   slots))
