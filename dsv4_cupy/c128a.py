"""``build_c128a_topk_metadata``: the C128A (ratio-128) top-k rows and lengths."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import checks, validation
from .cpu import ParallelKernel, dcp_local_rows, div_trunc
from .dcp import check_cp
from .family import POSITIONS_AXIS, SLOT_MAPPING_AXIS, KernelFamily
from .geometry import row_chunks
from .kinds import INT32, Operand, probe_all
from .launch import Launch, table_of
from .params import BLOCK_TABLE, I64, PTR, SLOT_GEOMETRY, Group, Params, SlotGeometry
from .prepared import Checked, PreparedOp
from .scalars import check_choice, check_int
from .slot_mapping import slot_geometry
from .spec import MAX_BLOCK_SIZE

#: vLLM's width when neither buffers nor a width are given.
DEFAULT_MAX_COMPRESSED_TOKENS = 8192
C128A_ROWS = Group("C128ARows", [
    ("global_decode", PTR), ("decode_lens", PTR), ("prefill", PTR), ("decode_stride", I64),
    ("prefill_stride", I64), ("width", I64), ("num_valid_tokens", I64),
    ("padding_slots", I64)], module=__name__)
ROW_CHUNKS = Group("RowChunks", [("cols_per_block", I64), ("chunks", I64), ("row_blocks", I64)],
                   module=__name__)
C128ARows, RowChunks = C128A_ROWS.record, ROW_CHUNKS.record
PARAMS = Params("C128AParams", [
    ("positions", PTR), ("token_to_req", PTR), ("slot_mapping", PTR), ("table", BLOCK_TABLE),
    ("geometry", SLOT_GEOMETRY), ("rows", C128A_ROWS), ("chunks", ROW_CHUNKS),
    ("num_tokens", I64), ("num_decode_tokens", I64)])


@njit(cache=True, inline="always")
def owned_rows(n, geometry):
    """Rows among 0..n-1 owned by ``geometry.cp_rank`` (the kernels' owned_rows)."""
    return dcp_local_rows(n, geometry.cp_world_size, geometry.cp_rank, geometry.cp_interleave)


@ParallelKernel
def cpu_c128a_topk_metadata(positions, token_to_req, slot_mapping, table, geometry, rows,
                        num_tokens, num_decode_tokens):
    """Rows of ``rows.width`` columns: decode rows get global (rank-local under
    DCP) slot ids and a length, prefill rows get local indices; -1 past the
    count. A decode token that is not valid (slot < 0, or t >=
    num_valid_tokens when that is >= 0) gets length 0 and -1 (its slot ids with
    rows.padding_slots), one whose request is outside the table -1 and length 0;
    rows past the table row's blocks are -1 and not counted."""
    block_size, ratio, width = geometry.block_size, geometry.ratio, rows.width
    entries, table_rows, table_cols, table_stride = table
    global_decode, decode_lens, prefill = rows.global_decode, rows.decode_lens, rows.prefill
    decode_stride, prefill_stride = rows.decode_stride, rows.prefill_stride
    num_valid_tokens = rows.num_valid_tokens
    for t in prange(num_tokens):
        n = max(min(div_trunc(np.int64(positions[t]) + 1, ratio), width), 0)
        if t < num_decode_tokens:
            req = np.int64(token_to_req[t])
            valid = slot_mapping[t] >= 0 if num_valid_tokens < 0 else t < num_valid_tokens
            written = 0
            if 0 <= req < table_rows:
                written = min(owned_rows(n, geometry), table_cols * block_size)
            count = written if valid else 0
            if not rows.padding_slots:
                written = count
            row = t * decode_stride
            for e in range(written):
                # int32 product as in vLLM (wraps the same way).
                global_decode[row + e] = np.int32(
                    entries[req * table_stride + e // block_size] * block_size + e % block_size)
            global_decode[row + written:row + width] = -1
            decode_lens[t] = count
        else:
            row = (t - num_decode_tokens) * prefill_stride
            for e in range(n):
                prefill[row + e] = e
            prefill[row + n:row + width] = -1


FAMILY = KernelFamily("c128a.cuh", "c128a_topk_metadata", PARAMS, (POSITIONS_AXIS, SLOT_MAPPING_AXIS))
CPU_KERNEL = cpu_c128a_topk_metadata
FAMILIES = (FAMILY,)

_OP = PreparedOp("build_c128a_topk_metadata")


def build_c128a_topk_metadata(positions, compress_ratio: int, num_decode_tokens: int,
                              token_to_req_indices, block_table, block_size: int, slot_mapping,
                              global_decode_buffer=None, decode_lens_buffer=None,
                              prefill_buffer=None, max_compressed_tokens: int | None = None, *,
                              dcp_world_size: int = 1, dcp_rank: int = 0,
                              cp_kv_cache_interleave_size: int = 1,
                              num_valid_tokens: int | None = None,
                              padding_rows: str = "minus_one", validate: str = "default",
                              num_cache_blocks: int | None = None):
    """C128A metadata for all tokens of a step (decodes first, then prefills).

    Parameters
    ----------
    positions : int32 or int64 array ``[T]``
        Position of each token (decode tokens first).
    compress_ratio : int
        128 for C128A layers.
    num_decode_tokens : int
        ``nd`` in ``[0, T]``: tokens ``t < nd`` are decode tokens.
    token_to_req_indices : int32 array ``[>= nd]``
        Request of each token (from ``token_to_req_indices``).
    block_table : int32 array ``[R, max_blocks]`` (rows contiguous, any row stride)
        Read for valid decode tokens only; not clamped (as in vLLM).
    block_size : int
        The **storage** block size: compressed rows per cache block
        (``256 // 128 = 2``), not the builder's logical 256.
    slot_mapping : int32 or int64 array ``[>= nd]``
        The group's *uncompressed* slot mapping: on a single rank, a decode
        token with a negative slot is CUDA-graph padding.
    global_decode_buffer, prefill_buffer : int32 arrays ``[rows, >= W]``, optional
    decode_lens_buffer : int32 array ``[>= nd]``, optional
        Persistent outputs; results are views of them (their row stride kept).
        Missing ones are allocated, of the inputs' kind.
    max_compressed_tokens : int, optional
        ``W``, columns per row: at most the buffers' width; defaults to it, or
        without buffers to 8192 (vLLM's default).
    dcp_world_size, dcp_rank, cp_kv_cache_interleave_size : int
        Decode context parallelism (experimental: vLLM has it on a branch
        only). Each rank's decode row lists the rank-local slots of the rows it
        owns, ascending and packed at the front; its length is the owned count
        (``get_dcp_local_seq_lens`` of the visible rows). ``block_size`` must be
        a multiple of the interleave. Prefill rows are unchanged.
    num_valid_tokens : int, optional
        With more than one rank, where ``slot_mapping < 0`` no longer marks
        padding: decode tokens ``t >= num_valid_tokens`` are padding (default:
        none). Ignored on a single rank.
    padding_rows : "minus_one" or "slots"
        A padding decode token's row: all -1 (the default: a persistent
        buffer then holds no stale slot), or, as vLLM 0.34 writes it, the slot
        ids its position would see; its length is 0 either way.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) that decode tokens' request ids are
        block-table rows and that their blocks lie inside the table row and,
        with ``num_cache_blocks``, inside the cache.

    Returns
    -------
    ``(global_decode [nd, W], decode_lens [nd], prefill_local [T - nd, W])``, int32.
    With ``n = min((p + 1) // compress_ratio, W)`` (division truncating toward
    zero, as vLLM does): decode row ``e < n`` holds
    ``block_table[req, e // block_size] * block_size + e % block_size``, prefill
    row ``e < n`` holds ``e``, every other column of the ``W`` is -1; the
    length is ``max(n, 0)``. One rule for what cannot be addressed: a padding
    decode token, or one whose request is outside the table, gets an all -1
    row and length 0, and rows past the table row's blocks are -1 and not
    counted. Columns at or past ``W`` and rows past the tokens are never written.
    """
    buffers = (global_decode_buffer, decode_lens_buffer, prefill_buffer)
    key, results = _OP.replay(validate, buffers, positions, compress_ratio, num_decode_tokens,
                              token_to_req_indices, block_table, block_size, slot_mapping,
                              max_compressed_tokens, dcp_world_size, dcp_rank,
                              cp_kv_cache_interleave_size, num_valid_tokens, padding_rows)
    if results is not None:
        return results
    kind, device, ops = probe_all({
        "positions": positions, "token_to_req_indices": token_to_req_indices,
        "block_table": block_table, "slot_mapping": slot_mapping,
        "global_decode_buffer": global_decode_buffer, "decode_lens_buffer": decode_lens_buffer,
        "prefill_buffer": prefill_buffer})
    pos, token_to_req, table, slots = (ops["positions"], ops["token_to_req_indices"],
                                       ops["block_table"], ops["slot_mapping"])
    checks.check(pos, POSITIONS_AXIS.values, 1)
    num_tokens = pos.shape[0]
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    num_decode_tokens = check_int("num_decode_tokens", num_decode_tokens, minimum=0,
                                  maximum=num_tokens)
    cp = check_cp(dcp_world_size, dcp_rank, cp_kv_cache_interleave_size, block_size=block_size,
                  names=("dcp_world_size", "dcp_rank", "cp_kv_cache_interleave_size"))
    padding_slots = check_choice("padding_rows", padding_rows, PADDING_ROWS) == "slots"
    valid_tokens = VALIDITY_FROM_SLOTS
    if cp.world_size > 1:
        valid_tokens = num_decode_tokens if num_valid_tokens is None else check_int(
            "num_valid_tokens", num_valid_tokens, minimum=0)
    num_prefill_tokens = num_tokens - num_decode_tokens
    checks.check(token_to_req, (INT32,), 1, min_len=num_decode_tokens)
    checks.check(table, (INT32,), 2)
    checks.check(slots, SLOT_MAPPING_AXIS.values, 1, min_len=num_decode_tokens)

    row_buffers = [op for op in (ops["global_decode_buffer"], ops["prefill_buffer"])
                   if op is not None and len(op.shape) == 2]
    if max_compressed_tokens is not None:
        width = check_int("max_compressed_tokens", max_compressed_tokens, minimum=0)
        for op in row_buffers:
            if width > op.shape[1]:
                raise ValueError(f"max_compressed_tokens: expected at most the width of {op.name} "
                                 f"({op.shape[1]}), got {width}; a wider row would be "
                                 "written into the next row")
    elif row_buffers:
        width = min(op.shape[1] for op in row_buffers)
    else:
        width = DEFAULT_MAX_COMPRESSED_TOKENS

    global_decode = checks.output("global_decode_buffer", ops["global_decode_buffer"], kind,
                                  device, INT32, num_decode_tokens, width)
    lens = checks.output("decode_lens_buffer", ops["decode_lens_buffer"], kind, device, INT32,
                         num_decode_tokens)
    prefill = checks.output("prefill_buffer", ops["prefill_buffer"], kind, device, INT32,
                            num_prefill_tokens, width)
    checks.check_no_alias([global_decode, lens, prefill], [pos, token_to_req, table, slots])
    full = validation.check_mode(validate, num_cache_blocks)
    validation.storage_block(block_size, compress_ratio, full)
    if full:
        validation.c128a_inputs(positions, token_to_req_indices, block_table, kind,
                                num_decode_tokens, compress_ratio, width, block_size,
                                num_cache_blocks)

    results = (global_decode.array[:num_decode_tokens, :width], lens.array[:num_decode_tokens],
               prefill.array[:num_prefill_tokens, :width])
    rows = C128ARows(global_decode=global_decode, decode_lens=lens, prefill=prefill,
                     decode_stride=checks.row_stride(global_decode),
                     prefill_stride=checks.row_stride(prefill), width=width,
                     num_valid_tokens=valid_tokens, padding_slots=int(padding_slots))
    launch = c128a_launch(pos, token_to_req, slots, table,
                          slot_geometry(block_size, compress_ratio, cp), rows, num_tokens,
                          num_decode_tokens, device)
    return _OP.run(key, Checked(kind, device, results, (launch,), results))


#: A padding decode token's C128A row: all -1 (the default: a persistent buffer
#: holds no stale slots), or vLLM 0.34's slot ids at length 0 (for byte-exact A/B runs).
PADDING_ROWS = ("minus_one", "slots")

#: ``C128ARows.num_valid_tokens`` that takes a decode token's validity from its
#: slot (``slot_mapping >= 0``); under DCP it is the count of real tokens.
VALIDITY_FROM_SLOTS = -1


def c128a_launch(positions: Operand, token_to_req: Operand, slot_mapping: Operand,
                 table: Operand, geometry: SlotGeometry, rows: C128ARows, num_tokens: int,
                 num_decode_tokens: int, device: int) -> Launch:
    """The C128A rows of the first ``num_tokens`` tokens (the first
    ``num_decode_tokens`` of them decode tokens); ``device`` -1 for the CPU."""
    cols_per_block, chunks, blocks = (row_chunks(num_tokens, rows.width, device)
                                      if device >= 0 and num_tokens else (0, 1, 0))
    return Launch(
        FAMILY, blocks,
        dict(positions=positions, token_to_req=token_to_req, slot_mapping=slot_mapping,
             table=table_of(table), geometry=geometry, rows=rows,
             chunks=RowChunks(cols_per_block=cols_per_block, chunks=chunks, row_blocks=blocks),
             num_tokens=num_tokens, num_decode_tokens=num_decode_tokens),
        variant={"positions": positions.dtype, "slot_mapping": slot_mapping.dtype},
        kernel=cpu_c128a_topk_metadata)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    rows = C128ARows(global_decode=tiny.rows, decode_lens=tiny.out32, prefill=tiny.rows,
                     decode_stride=4, prefill_stride=4, width=4,
                     num_valid_tokens=VALIDITY_FROM_SLOTS, padding_slots=0)
    for positions in (tiny.out32, tiny.out64):
        for slots in (tiny.out32, tiny.out64):
            yield (f"c128a_topk_metadata[p{positions.dtype.itemsize * 8}"
                   f"_s{slots.dtype.itemsize * 8}]",
                   c128a_launch(positions, tiny.out32, slots, tiny.table, tiny.geometry, rows,
                                1, 1, -1))
