"""``dequantize_and_gather_selected_kv``: only the rows of a prefill chunk's
workspace that its combined indices name, into a compact workspace, and the
indices remapped into it (beyond vLLM, which gathers every row)."""
from __future__ import annotations

import numpy as np
from numba import prange

from . import checks, validation
from .cpu import ParallelKernel
from .family import KernelFamily
from .geometry import MAX_GRID_STRIDE_BLOCKS, THREADS, WARP_LANES, elementwise_blocks, \
    row_lane_blocks
from .k_cache_gather import (K_CACHE_SOURCE, OUT_ROW_ALIGNMENT, _source, check_layer_caches,
                             cpu_gather_position, cpu_request_row_position, cpu_sources)
from .kinds import GPU_KINDS, INT32, INT32_MAX, UINT16, as_bits, probe, probe_all
from .kv_cache import check_pages
from .launch import Launch
from .params import I64, PTR, Params
from .prepared import Checked, PreparedOp
from .scalars import check_int, check_window_start
from .spec import HEAD_SIZE, SWA_BLOCK_SIZE, cdiv

PARAMS = Params("SelectedGatherParams", [
    ("out", PTR), ("remapped", PTR), ("indices", PTR), ("lens", PTR), ("seq_lens", PTR),
    ("flags", PTR), ("bitmap", PTR), ("word_prefix", PTR), ("tile_prefix", PTR), ("listed", PTR),
    ("num_selected", PTR),
    ("out_rows", I64), ("out_row_stride", I64), ("indices_stride", I64),
    ("remapped_stride", I64), ("num_tokens", I64), ("width", I64), ("num_reqs", I64),
    ("rows", I64), ("num_words", I64), ("num_tiles", I64), ("list_blocks", I64),
    ("num_sources", I64), ("first", K_CACHE_SOURCE), ("second", K_CACHE_SOURCE)])
#: Rows per bitmap word, and bitmap words per tile of the count (kernels' kTileWords).
WORD_ROWS, TILE_WORDS = 32, 4 * THREADS
#: int32 elements of scratch holding a word's 32 flag bytes, and the scratch's
#: alignment on the GPU (the flags' 16-byte vectors).
FLAG_INTS_PER_WORD, SCRATCH_ALIGNMENT = WORD_ROWS // 4, 16
#: The largest full workspace (rows, num_reqs * M) the int32 indices can name.
MAX_WORKSPACE_ROWS = INT32_MAX
#: The gather's blocks at most (a grid-stride loop over the listed rows, whose
#: number the device knows): about two waves of an H200's resident blocks.
MAX_GATHER_BLOCKS = 4096


@ParallelKernel
def cpu_dequantize_and_gather_selected_kv(out, remapped, indices, lens, seq_lens, flags, bitmap,
                                          word_prefix, tile_prefix, listed, num_selected,
                                          out_rows, out_row_stride, indices_stride,
                                          remapped_stride, num_tokens, width, num_reqs, rows,
                                          num_words, num_tiles, list_blocks, num_sources, first,
                                          second):
    """kernels/selected_gather.cuh's six launches in one: the rows the entries
    j < lens[t] name, their compact rows (rank in row order), the gather, the remap."""
    total_rows = num_reqs * rows
    named = np.zeros(total_rows, np.bool_)
    for t in range(num_tokens):
        for j in range(min(np.int64(lens[t]), width)):
            row = np.int64(indices[t * indices_stride + j])
            if 0 <= row < total_rows:
                named[row] = True
    compact = np.cumsum(named) - 1
    selected = np.nonzero(named)[0]
    num_selected[0] = selected.shape[0]
    caches, entries, gather_lens, table_rows, cols, row_strides, page_strides, num_pages, \
        block_sizes, ratios, first_rows = cpu_sources(first, second)
    for k in prange(min(selected.shape[0], out_rows)):
        b = selected[k] // rows
        row = selected[k] - b * rows
        s = 1 if num_sources > 1 and row >= first_rows[1] else 0
        if b >= table_rows[s]:
            continue
        position = cpu_request_row_position(seq_lens[b], ratios[s], gather_lens[s], b,
                                            first_rows[s], row)
        if position >= 0:
            cpu_gather_position(out, k * out_row_stride, caches[s], entries[s], row_strides[s],
                                cols[s], page_strides[s], num_pages[s], block_sizes[s], b,
                                position)
    for t in prange(num_tokens):
        for j in range(width):
            row = np.int64(indices[t * indices_stride + j]) if j < lens[t] else -1
            target = compact[row] if 0 <= row < total_rows else -1
            remapped[t * remapped_stride + j] = target if target < out_rows else -1


STAGES = ("select_rows_clear", "select_rows_mark", "select_rows_count", "select_rows_scan",
          "select_rows_list", "select_rows_gather")
FAMILIES = tuple(KernelFamily("selected_gather.cuh", stage, PARAMS) for stage in STAGES)
CPU_KERNEL = cpu_dequantize_and_gather_selected_kv

_OP = PreparedOp("dequantize_and_gather_selected_kv")


def selected_gather_scratch_len(num_reqs: int, M: int, out_rows: int) -> int:
    """int32 elements of ``dequantize_and_gather_selected_kv``'s scratch for a
    full workspace of ``num_reqs`` requests of ``M`` rows and an ``out`` of
    ``out_rows`` rows."""
    words = cdiv(num_reqs * M, WORD_ROWS)
    return FLAG_INTS_PER_WORD * words + 2 * words + cdiv(words, TILE_WORDS) + min(num_reqs * M,
                                                                                  out_rows)


def dequantize_and_gather_selected_kv(out, remapped_indices, combined_indices, combined_lens,
                                      compressed_k_cache, compressed_block_table, swa_k_cache,
                                      swa_block_table, seq_lens, gather_lens,
                                      compress_ratio: int, N: int, M: int, *,
                                      num_selected=None, scratch=None,
                                      compressed_block_size: int | None = None,
                                      swa_block_size: int = SWA_BLOCK_SIZE,
                                      validate: str = "default",
                                      num_cache_blocks: int | None = None):
    """Gather only the workspace rows a prefill chunk's combined indices name
    into a compact bf16 workspace, and remap the indices into it.

    ``dequantize_and_gather_prefill_kv`` fills the whole workspace ``[R, M,
    512]`` (every compressed row of every request, then its SWA rows from
    ``N``), and the sparse prefill reads the rows that
    ``combine_topk_swa_indices`` names (``b * M + row``). This reads and
    writes those rows only: ``out[remapped_indices[t, j]]`` is the full
    workspace's row ``combined_indices[t, j]``, row for row. On the GPU:
    six launches (a bitmap of the named rows, its prefix sums in two, the
    list of named rows with the remap, the gather), no host sync.

    Parameters
    ----------
    out : bf16 array ``[K, 512]`` (rows 16-byte aligned)
        The compact workspace: selected row k (rows in the full workspace's
        order) at ``out[k]``; a selected row past ``K`` is not written (its
        entries remap to -1; ``num_selected`` says how many there were). A
        row the full gather would not write either (outside its request's
        rows or the tables) is left as it was.
    remapped_indices : int32 array ``[T, width]`` (rows contiguous)
        Written: entry j < ``combined_lens[t]`` naming a workspace row, that
        row's compact row; -1 elsewhere.
    combined_indices : int32 array ``[T, width]`` (rows contiguous)
        Full-workspace rows, as ``combine_topk_swa_indices`` writes them.
    combined_lens : int32 array ``[T]``
        Valid entries of each row.
    compressed_k_cache, compressed_block_table, swa_k_cache, swa_block_table, seq_lens, gather_lens, compress_ratio, N
        As for ``dequantize_and_gather_prefill_kv``.
    M : int
        Rows per request of the full workspace (the chunk plan's ``M``).
    num_selected : int32 array ``[1]``, optional
        Written with the number of rows the indices name (allocated when None).
    scratch : int32 array ``[selected_gather_scratch_len(R, M, K)]``, optional
        The bitmap, its prefix sums and the list of named rows (allocated when
        None; pass one for a call that must not allocate, such as one in a
        CUDA-graph capture).
    compressed_block_size, swa_block_size, validate, num_cache_blocks
        As for ``dequantize_and_gather_prefill_kv``.

    Returns
    -------
    ``(out, remapped_indices, num_selected)``.
    """
    key, results = _OP.replay(
        validate, (out, remapped_indices, num_selected, scratch), combined_indices,
        combined_lens, compressed_k_cache, compressed_block_table, swa_k_cache, swa_block_table,
        seq_lens, gather_lens, compress_ratio, N, M, compressed_block_size, swa_block_size,
        num_cache_blocks)
    if results is not None:
        return results
    kind, device, ops = probe_all({
        "out": as_bits(out), "remapped_indices": remapped_indices,
        "combined_indices": combined_indices, "combined_lens": combined_lens,
        "seq_lens": seq_lens, "gather_lens": gather_lens,
        "compressed_block_table": compressed_block_table, "swa_block_table": swa_block_table,
        "num_selected": num_selected, "scratch": scratch})
    seq, lens = ops["seq_lens"], ops["gather_lens"]
    checks.check(seq, (INT32,), 1)
    num_reqs = seq.shape[0]
    if lens is None:
        raise TypeError("gather_lens: expected an int32 array [R] (the SWA rows), got None")
    checks.check(lens, (INT32,), 1, min_len=num_reqs)
    tables = [ops["compressed_block_table"], ops["swa_block_table"]]
    for table in tables:
        checks.check(table, (INT32,), 2)
    indices, index_lens = ops["combined_indices"], ops["combined_lens"]
    checks.check(indices, (INT32,), 2)
    num_tokens, width = indices.shape
    checks.check(index_lens, (INT32,), 1, min_len=num_tokens)
    rows_out = ops["out"]
    if rows_out is None or rows_out.dtype != UINT16 or len(rows_out.shape) != 2 \
            or rows_out.shape[1] != HEAD_SIZE or rows_out.strides[1] != 1:
        raise ValueError(f"out: expected a bf16 array [K, {HEAD_SIZE}] with contiguous rows, "
                         f"got {'None' if rows_out is None else rows_out.dtype} "
                         f"{() if rows_out is None else tuple(rows_out.shape)}")
    if kind in GPU_KINDS and (rows_out.ptr % (2 * OUT_ROW_ALIGNMENT)
                              or rows_out.strides[0] % OUT_ROW_ALIGNMENT):
        raise ValueError(f"out: expected rows at 16-byte aligned addresses (a row stride that "
                         f"is a multiple of {OUT_ROW_ALIGNMENT}), got stride "
                         f"{rows_out.strides[0]}")
    checks.check_writable(rows_out)
    remapped = checks.output("remapped_indices", ops["remapped_indices"], kind, device, INT32,
                             num_tokens, width)
    compress_ratio, compressed_block_size, swa_block_size = check_layer_caches(
        compress_ratio, compressed_block_size, swa_block_size)
    M = check_int("M", M, minimum=0, maximum=MAX_WORKSPACE_ROWS // max(num_reqs, 1))
    N = check_window_start(N, M)
    num_words = cdiv(num_reqs * M, WORD_ROWS)
    scratch_len = selected_gather_scratch_len(num_reqs, M, rows_out.shape[0])
    count = checks.output("num_selected", ops["num_selected"], kind, device, INT32, 1)
    scratch_op = checks.output("scratch", ops["scratch"], kind, device, INT32, scratch_len)
    if kind in GPU_KINDS and scratch_op.ptr % SCRATCH_ALIGNMENT:
        raise ValueError(f"scratch: expected a {SCRATCH_ALIGNMENT}-byte aligned address (its "
                         f"flags are cleared and read 16 bytes at a time), got "
                         f"{scratch_op.ptr:#x}")
    compressed = check_pages("compressed_k_cache", compressed_k_cache, kind, device,
                             compressed_block_size)
    swa = check_pages("swa_k_cache", swa_k_cache, kind, device, swa_block_size)
    written = [rows_out, remapped, count, scratch_op]
    checks.check_no_alias(written, [seq, lens, *tables, indices, index_lens, compressed.op,
                                    swa.op])
    checks.check_no_alias(written[1:], [rows_out])
    checks.check_no_alias(written[2:], [remapped])
    checks.check_no_alias(written[3:], [count])
    if validation.check_mode(validate, num_cache_blocks):
        validation.gather_rows(seq_lens, None, compressed_block_table, kind, num_reqs,
                               compressed_block_size, compress_ratio, 0, N, compressed.num_pages,
                               num_cache_blocks, " of the compressed cache")
        validation.gather_rows(seq_lens, gather_lens, swa_block_table, kind, num_reqs,
                               swa_block_size, 1, N, M, swa.num_pages, num_cache_blocks,
                               " of the SWA cache")
    scratch_array = scratch_op.array
    num_tiles = cdiv(num_words, TILE_WORDS)
    parts = np.cumsum([0, FLAG_INTS_PER_WORD * num_words, num_words, num_words, num_tiles,
                       min(num_reqs * M, rows_out.shape[0])])
    flags, bitmap, word_prefix, tile_prefix, listed = (
        probe("scratch", scratch_array[int(start):int(stop)])
        for start, stop in zip(parts[:-1], parts[1:]))
    fields = dict(
        out=rows_out, remapped=remapped, indices=indices, lens=index_lens, seq_lens=seq,
        flags=flags, bitmap=bitmap, word_prefix=word_prefix, tile_prefix=tile_prefix,
        listed=listed,
        num_selected=count,
        out_rows=rows_out.shape[0], out_row_stride=rows_out.strides[0],
        indices_stride=checks.row_stride(indices) if num_tokens else width,
        remapped_stride=checks.row_stride(remapped) if num_tokens else width,
        num_tokens=num_tokens, width=width, num_reqs=num_reqs, rows=M, num_words=num_words,
        num_tiles=num_tiles, num_sources=2,
        first=_source(compressed, tables[0], None, compress_ratio, 0),
        second=_source(swa, tables[1], lens, 1, N))
    results = (out, remapped.array if remapped_indices is None else remapped_indices,
               count.array if num_selected is None else num_selected)
    launches = tuple(selected_gather_launch(fields, device, stage)
                     for stage in range(len(STAGES)))
    return _OP.run(key, Checked(kind, device, results, launches, results[:2]))


def selected_gather_launch(fields: dict, device: int, stage: int) -> Launch:
    """Launch ``stage`` of the GPU's six (``STAGES``); the CPU's one kernel
    runs on the last."""
    entries = fields["num_tokens"] * fields["width"]
    words = fields["num_words"]
    list_blocks = elementwise_blocks(words)
    listed = min(fields["num_reqs"] * fields["rows"], fields["out_rows"])
    blocks = (elementwise_blocks(words), elementwise_blocks(entries),
              min(fields["num_tiles"], MAX_GRID_STRIDE_BLOCKS), 1,
              list_blocks + elementwise_blocks(entries),
              min(row_lane_blocks(listed, WARP_LANES), MAX_GATHER_BLOCKS))[stage]
    last = stage == len(STAGES) - 1
    return Launch(FAMILIES[stage], blocks if device >= 0 else 0,
                  dict(fields, list_blocks=list_blocks),
                  kernel=cpu_dequantize_and_gather_selected_kv if last else None)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    def written(shape, dtype=np.int32):
        return probe("out", np.zeros(shape, dtype))
    scratch = written(selected_gather_scratch_len(1, 1, 1))
    fields = dict(
        out=written((1, HEAD_SIZE), np.uint16), remapped=written((1, 4)), indices=tiny.rows,
        lens=tiny.seq, seq_lens=tiny.seq, flags=scratch, bitmap=scratch, word_prefix=scratch,
        tile_prefix=scratch, listed=scratch, num_selected=written(1), out_rows=1, out_row_stride=HEAD_SIZE, indices_stride=4,
        remapped_stride=4, num_tokens=1, width=1, num_reqs=1, rows=1, num_words=1, num_tiles=1,
        num_sources=2, first=_source(tiny.pages, tiny.table, None, 4, 0),
        second=_source(tiny.pages, tiny.table, tiny.seq, 1, 0))
    yield "dequantize_and_gather_selected_kv", selected_gather_launch(fields, -1,
                                                                      len(STAGES) - 1)


__all__ = ["dequantize_and_gather_selected_kv", "selected_gather_scratch_len"]
