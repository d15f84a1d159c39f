"""``fill_short_context_topk_indices``: "every candidate" top-k rows of a C4A
layer whose tokens see at most ``top_k`` compressed rows."""
from __future__ import annotations

import numpy as np
from numba import prange

from . import checks, geometry, validation
from .cpu import ParallelKernel, div_trunc
from .family import (C4A_RATIO_AXIS, POSITIONS_AXIS, ROW_LANES_AXIS, ROW_THREADS_AXIS, TOP_K_AXIS,
                     KernelFamily)
from .geometry import row_block_threads
from .kinds import INT32, Operand, probe_all
from .launch import Launch
from .params import I64, PTR, Params
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

PARAMS = Params("ShortContextParams", [
    ("positions", PTR), ("out", PTR), ("out_stride", I64), ("top_k", I64), ("ratio", I64),
    ("num_tokens", I64)])


@ParallelKernel
def cpu_fill_short_context_topk_indices(positions, out, out_stride, top_k, ratio, num_tokens):
    """Row t: k for k < (p + 1) // ratio (truncating, clamped to [0, top_k]), -1 after."""
    for t in prange(num_tokens):
        n = max(min(div_trunc(np.int64(positions[t]) + 1, ratio), top_k), 0)
        row = t * out_stride
        for k in range(n):
            out[row + k] = k
        out[row + n:row + top_k] = -1


FAMILY = KernelFamily("short_context.cuh", "fill_short_context_topk_indices", PARAMS,
                      (POSITIONS_AXIS, ROW_LANES_AXIS, TOP_K_AXIS, C4A_RATIO_AXIS,
                       ROW_THREADS_AXIS),
                      where=lambda positions, lanes, top_k, ratio, threads: (
                          threads == row_block_threads(lanes)),
                      threads_axis="threads")
CPU_KERNEL = cpu_fill_short_context_topk_indices
FAMILIES = (FAMILY,)

_OP = PreparedOp("fill_short_context_topk_indices")


def fill_short_context_topk_indices(positions, top_k: int, compress_ratio: int,
                                    num_tokens: int | None = None, *, out=None,
                                    validate: str = "default"):
    """"Every candidate" top-k rows, for when no token sees more than ``top_k``
    compressed rows (vLLM's ``fill_short_context_topk_indices``).

    Parameters
    ----------
    positions : int32 or int64 array ``[>= num_tokens]``
    top_k : int
        Columns per row (``index_topk``: 512 Flash, 1024 Pro).
    compress_ratio : int
        4 for C4A layers.
    num_tokens : int, optional
        Rows to write; default ``len(positions)``.
    out : int32 array ``[>= num_tokens, >= top_k]`` (rows contiguous, any row stride), optional
        Persistent buffer (vLLM's ``topk_indices_buffer``); only the result
        region is written, so a wider buffer keeps its other columns.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the shortcut's precondition: no
        token sees more than ``top_k`` rows (vLLM #52492).

    Returns
    -------
    int32 array ``[num_tokens, top_k]``: row ``t`` holds ``k`` for
    ``k < (positions[t] + 1) // compress_ratio`` (truncating toward zero) and
    -1 after; rows are never longer than ``top_k``.
    """
    key, results = _OP.replay(validate, (out,), positions, top_k, compress_ratio, num_tokens)
    if results is not None:
        return results
    kind, device, ops = probe_all({"positions": positions, "out": out})
    pos = ops["positions"]
    checks.check(pos, POSITIONS_AXIS.values, 1)
    top_k = checks.check_row_width("top_k", top_k)
    compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                               maximum=MAX_BLOCK_SIZE)
    num_tokens = check_int("num_tokens", pos.shape[0] if num_tokens is None else num_tokens,
                           minimum=0, maximum=pos.shape[0])
    rows = checks.output("out", ops["out"], kind, device, INT32, num_tokens, top_k)
    checks.check_no_alias([rows], [pos])
    if validation.check_mode(validate):
        validation.short_context_inputs(positions, kind, num_tokens, top_k, compress_ratio)
    result = rows.array[:num_tokens, :top_k]
    launch = short_context_launch(pos, rows, top_k, compress_ratio, num_tokens, device)
    return _OP.run(key, Checked(kind, device, result, (launch,), (result,)))


def short_context_launch(positions: Operand, out: Operand, top_k: int, compress_ratio: int,
                         num_tokens: int, device: int, lanes: int | None = None) -> Launch:
    """The short-context rows of the first ``num_tokens`` tokens, ``top_k``
    columns of ``out``; ``device`` -1 for the CPU. ``lanes``: threads per row,
    a fused kernel's (default ``geometry.row_lanes``)."""
    blocks, variant = 0, {}
    if device >= 0 and num_tokens and top_k:   # rows of no columns: nothing to write
        lanes = geometry.row_lanes(num_tokens, device) if lanes is None else lanes
        threads = geometry.row_block_threads(lanes)
        family = FAMILY
        variant = {"positions": positions.dtype, "lanes": lanes,
                   "top_k": family.compiled_in("top_k", top_k),
                   "ratio": family.compiled_in("ratio", compress_ratio), "threads": threads}
        blocks = geometry.row_lane_blocks(num_tokens, lanes, threads)
    return Launch(FAMILY, blocks,
                  dict(positions=positions, out=out, out_stride=checks.row_stride(out),
                       top_k=top_k, ratio=compress_ratio, num_tokens=num_tokens),
                  variant=variant, kernel=cpu_fill_short_context_topk_indices)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    for positions in (tiny.out32, tiny.out64):
        yield (f"fill_short_context_topk_indices[p{positions.dtype.itemsize * 8}]",
               short_context_launch(positions, tiny.rows, 4, 4, 1, -1))
