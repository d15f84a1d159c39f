"""``get_compressed_slot_mapping``: where each token's compressed row is written."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import checks, validation
from .dcp import MAX_CP_SIZE, ContextParallel, check_cp
from .family import SLOT_MAPPING_AXIS, KernelFamily
from .geometry import elementwise_blocks
from .kinds import INT32, INT64, Operand, probe_all
from .launch import Launch, optional, table_of
from .params import (BLOCK_TABLE, I64, PTR, QUERY_LAYOUT, SLOT_GEOMETRY, Params, QueryLayout,
                     SlotGeometry)
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE, PAD_SLOT_ID

PARAMS = Params("SlotMappingParams", [
    ("query", QUERY_LAYOUT), ("table", BLOCK_TABLE), ("geometry", SLOT_GEOMETRY),
    ("token_slots", PTR), ("out", PTR), ("out_len", I64), ("num_tokens", I64)])


@njit(cache=True)
def cpu_compressed_slot_mapping(query, table, geometry, token_slots, out, num_tokens):
    """Fills all of ``out`` with -1, then writes each group-closing token's slot.

    Only tokens below ``min(num_tokens, len(out))`` get a slot, so the loop is
    bounded by the output whatever the query layout says. Block-table entries
    are read clamped at 0; a block index past the table's row is "no slot".
    With ``token_slots`` (not empty), a token whose own slot is -1 gets no
    compressed slot either; a negative ``cp_rank`` lets that rule alone decide
    which rank holds a row.
    """
    out[:] = -1
    qsl, seq_lens = query.query_start_loc, query.seq_lens
    block_size, ratio = geometry.block_size, geometry.ratio
    world, interleave = geometry.cp_world_size, geometry.cp_interleave
    virtual_block = block_size * world
    limit = min(num_tokens, out.shape[0])
    slot_rule = token_slots.shape[0] > 0
    for b in range(table.rows):
        qs = np.int64(qsl[b])
        qe = np.int64(qsl[b + 1])
        start = np.int64(seq_lens[b]) - (qe - qs)
        for idx in range(max(qs, 0), min(qe, limit)):
            pos = start + (idx - qs)
            if pos < 0 or (pos + 1) % ratio != 0:
                continue
            if slot_rule and token_slots[idx] == PAD_SLOT_ID:
                continue
            c = pos // ratio
            blk = c // virtual_block
            v = c - blk * virtual_block
            other_rank = geometry.cp_rank >= 0 and (v // interleave) % world != geometry.cp_rank
            if other_rank or blk >= table.cols:
                continue
            off = (v // (world * interleave)) * interleave + v % interleave
            entry = np.int64(table.entries[b * table.row_stride + blk])
            out[idx] = max(entry, 0) * block_size + off


FAMILY = KernelFamily("slot_mapping.cuh", "compressed_slot_mapping", PARAMS, (SLOT_MAPPING_AXIS,))
CPU_KERNEL = cpu_compressed_slot_mapping
FAMILIES = (FAMILY,)

_OP = PreparedOp("get_compressed_slot_mapping")


def get_compressed_slot_mapping(num_tokens: int, slot_mapping, query_start_loc, seq_lens,
                                block_table, block_size: int, compress_ratio: int, out=None,
                                dcp_world_size: int = 1, cp_interleave: int = 1, *,
                                dcp_rank: int | None = None, validate: str = "default",
                                num_cache_blocks: int | None = None):
    """Physical compressed-cache slot of every token that closes a compression group.

    vLLM 0.34's function, with its argument order.

    Parameters
    ----------
    num_tokens : int
        Tokens in the step (``num_actual_tokens``); elements at or past it are -1.
    slot_mapping : int32 or int64 array ``[>= num_tokens]``, or None
        The tokens' own slots: a token whose slot is -1 (padding, or under
        decode context parallelism a token another rank holds) gets -1. None
        (the library's extension) leaves every token eligible.
    query_start_loc : int32 array ``[R + 1]`` (at least ``block_table.shape[0] + 1``)
    seq_lens : int32 array ``[>= R]``
        Sequence lengths including this step's queries.
    block_table : int32 array ``[R, max_blocks]`` (rows contiguous, any row stride)
        One row per request (the rank's own table under DCP); negative entries
        are read as 0 (the builder's clamp) without changing the table.
    block_size : int
        The **storage** block size: compressed rows per cache block,
        ``256 // compress_ratio`` (64 for C4A, 2 for C128A). Not the builder's
        logical ``block_size`` of 256.
    compress_ratio : int
        4 (C4A) or 128 (C128A).
    out : int64 array ``[>= num_tokens]``, optional
        Persistent buffer: **all** of it is written (-1 where there is no slot).
    dcp_world_size, cp_interleave : int
        Decode context parallelism: ``dcp_world_size`` ranks hold the tokens
        ``cp_interleave`` tokens at a time (a multiple of ``compress_ratio``
        when there is more than one rank, so a group lives on one rank; the
        storage block holds whole ``cp_interleave // compress_ratio`` runs).
        Which rank holds a group comes from ``slot_mapping``, as in vLLM.
    dcp_rank : int, optional
        The library's rank-explicit form: this rank's slots only, whatever
        ``slot_mapping`` says about ownership (its -1 entries still count).
    validate : "default" or "full"
        "full" also checks (reading the inputs: a sync on GPU) that
        ``query_start_loc`` starts at 0 and never decreases, ``seq_len >=
        query_len``, and every block used lies inside its table row and, with
        ``num_cache_blocks``, inside the cache. The default never syncs.

    Returns
    -------
    int64 array ``[num_tokens]`` (``out[:num_tokens]`` when given). The token at
    ``pos = seq_len - query_len + j`` closing a group (``(pos + 1) %
    compress_ratio == 0``, ``pos >= 0``) whose slot is not -1 gets
    ``block_table[b, s // block_size] * block_size + s % block_size`` with
    ``s`` its rank-local state ``((pos // (I * W)) * I + pos % I) //
    compress_ratio`` (``s = pos // compress_ratio`` on one rank); anything else
    -1. A block index past the table row gives -1, never a read of the next row.
    """
    key, results = _OP.replay(validate, (out,), num_tokens, slot_mapping, query_start_loc,
                              seq_lens, block_table, block_size, compress_ratio, dcp_world_size,
                              cp_interleave, dcp_rank)
    if results is not None:
        return results
    kind, device, ops = probe_all({"slot_mapping": slot_mapping,
                                   "query_start_loc": query_start_loc, "seq_lens": seq_lens,
                                   "block_table": block_table, "out": out})
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    cp = token_interleaved_cp(dcp_world_size, dcp_rank, cp_interleave, block_size,
                              compress_ratio)
    token_slots = ops["slot_mapping"]
    if token_slots is None and cp.world_size > 1 and cp.rank < 0:
        raise ValueError("slot_mapping: expected the tokens' slots, which say the rank that "
                         "holds each group, when dcp_world_size > 1 and no dcp_rank is given; "
                         "got None")
    table, qsl, seq = ops["block_table"], ops["query_start_loc"], ops["seq_lens"]
    checks.check(table, (INT32,), 2)
    num_rows = table.shape[0]
    checks.check(qsl, (INT32,), 1, min_len=num_rows + 1)
    checks.check(seq, (INT32,), 1, min_len=num_rows)
    if token_slots is not None:
        checks.check(token_slots, SLOT_MAPPING_AXIS.values, 1, min_len=num_tokens)
    out = checks.output("out", ops["out"], kind, device, INT64, num_tokens)
    checks.check_no_alias([out], [qsl, seq, table, token_slots])
    full = validation.check_mode(validate, num_cache_blocks)
    validation.storage_block(block_size, compress_ratio, full)
    if full:
        validation.slot_mapping_inputs(query_start_loc, seq_lens, block_table, kind, block_size,
                                       compress_ratio, cp.world_size, num_cache_blocks)
    result = out.array[:num_tokens]
    launch = slot_mapping_launch(qsl, seq, table, slot_geometry(block_size, compress_ratio, cp),
                                 out, num_tokens, token_slots)
    return _OP.run(key, Checked(kind, device, result, (launch,), (result,)))


def token_interleaved_cp(world_size, rank, interleave, block_size: int,
                         compress_ratio: int) -> ContextParallel:
    """vLLM 0.34's DCP arguments (``cp_interleave`` in tokens) as the library's
    sharding of compressed rows; ``rank`` None is -1: any rank, the tokens'
    slots decide."""
    world = check_int("dcp_world_size", world_size, minimum=1, maximum=MAX_CP_SIZE)
    interleave = check_int("cp_interleave", interleave, minimum=1, maximum=MAX_CP_SIZE)
    if world == 1:
        interleave = compress_ratio        # one rank: the interleave changes nothing
    elif interleave % compress_ratio:
        raise ValueError(f"cp_interleave: expected a multiple of compress_ratio "
                         f"{compress_ratio} when dcp_world_size > 1 (a group must live on one "
                         f"rank), got {interleave}")
    cp = check_cp(world, 0 if rank is None else rank, interleave // compress_ratio,
                  block_size=block_size,
                  names=("dcp_world_size", "dcp_rank", "cp_interleave // compress_ratio"))
    return cp if rank is not None else cp._replace(rank=-1)


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
             geometry=geometry, token_slots=optional(token_slots, INT64),
             out=out, out_len=out_len, num_tokens=num_tokens),
        variant={"slot_mapping": slot_dtype}, kernel=cpu_compressed_slot_mapping)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``):
    the tokens' own slots of either dtype (none is an empty int64 array)."""
    for slots in (tiny.out32, tiny.out64):
        yield (f"compressed_slot_mapping[s{slots.dtype.itemsize * 8}]",
               slot_mapping_launch(tiny.qsl, tiny.seq, tiny.table, tiny.geometry, tiny.out64, 1,
                                   slots))
