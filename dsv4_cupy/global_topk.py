"""``compute_global_topk_indices_and_lens``: a C4A layer's decode rows, from
request-local compressed rows to global slots."""
from __future__ import annotations

import numpy as np
from numba import prange

from . import checks, geometry, validation
from .cpu import ParallelKernel
from .family import C4A_BLOCK_AXIS, TOP_K_AXIS, TOP_K_THREADS_AXIS, KernelFamily
from .geometry import RUN_TIME, topk_row_threads
from .kinds import BOOL, INT32, Operand, probe_all
from .launch import Launch, table_of
from .params import BLOCK_TABLE, I64, PTR, Params
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .spec import MAX_BLOCK_SIZE

PARAMS = Params("GlobalTopkParams", [
    ("table", BLOCK_TABLE), ("topk_indices", PTR), ("token_to_req", PTR),
    ("is_valid_token", PTR), ("out", PTR), ("lens", PTR), ("topk_stride", I64),
    ("out_stride", I64), ("width", I64), ("num_tokens", I64), ("block_size", I64)])


@ParallelKernel
def cpu_global_topk_indices_and_lens(table, topk_indices, token_to_req, is_valid_token, out, lens,
                                 topk_stride, out_stride, width, num_tokens, block_size,
                                 compact):
    """Local compressed rows to global slots; -1 (not counted) for x < 0 or a
    block column past the table row. In place (out is topk_indices) is safe:
    entry k is read before anything at or below k is written."""
    entries, table_rows, table_cols, table_stride = table
    for t in prange(num_tokens):
        req = np.int64(token_to_req[t])
        source = t * topk_stride
        target = t * out_stride
        count = 0
        if is_valid_token[t] and 0 <= req < table_rows:
            for k in range(width):
                x = np.int64(topk_indices[source + k])
                if x >= 0 and x // block_size < table_cols:
                    out[target + (count if compact else k)] = np.int32(
                        entries[req * table_stride + x // block_size] * block_size
                        + x % block_size)
                    count += 1
                elif not compact:
                    out[target + k] = -1
            if compact:
                out[target + count:target + width] = -1
        else:
            out[target:target + width] = -1
        lens[t] = count


FAMILY = KernelFamily("global_topk.cuh", "global_topk_indices_and_lens", PARAMS,
                      (TOP_K_AXIS, C4A_BLOCK_AXIS, TOP_K_THREADS_AXIS),
                      where=lambda top_k, block_size, threads: (
                          threads == topk_row_threads(top_k)),
                      threads_axis="threads")
#: The same rows with their valid entries packed to the front (``compact=True``).
COMPACT_FAMILY = KernelFamily("global_topk.cuh", "global_topk_compact_indices_and_lens", PARAMS)
CPU_KERNEL = cpu_global_topk_indices_and_lens
FAMILIES = (FAMILY, COMPACT_FAMILY)

_OP = PreparedOp("compute_global_topk_indices_and_lens")


def compute_global_topk_indices_and_lens(topk_indices, token_to_req_indices, block_table,
                                         block_size: int, is_valid_token, *, out=None,
                                         compact: bool = False, validate: str = "default"):
    """Request-local compressed rows of each decode token to global slots, and their count.

    vLLM's ``compute_global_topk_indices_and_lens`` with the
    later hardening: request and block-column bounds, all -1 padding rows, and
    optional compaction.

    Parameters
    ----------
    topk_indices : int32 array ``[T, K]`` (rows contiguous, any row stride)
        The indexer's top-k rows (request-local compressed rows; -1 or anything).
    token_to_req_indices : int32 array ``[>= T]``
    block_table : int32 array ``[R, max_blocks]`` (rows contiguous, any row stride)
        The C4A group's table.
    block_size : int
        Compressed rows per cache block (``256 // 4 = 64``).
    is_valid_token : bool array ``[>= T]``
        False for padding tokens.
    out : ``(indices, lens)``, optional
        ``indices``: int32 ``[>= T, >= K]``, which may be ``topk_indices`` itself
        (same first element and row stride: converted in place); ``lens``: int32
        ``[>= T]``. Any other overlap with an input is an error.
    compact : bool
        Pack the valid entries of a row to its front (in order), -1 after.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) that valid tokens' request ids are
        rows of the table.

    Returns
    -------
    ``(indices [T, K] int32, lens [T] int32)``. Entry ``x`` of token ``t``
    (request ``req``) is valid when ``x >= 0`` and ``x // bs < block_table.shape[1]``
    (the logical width, never the row stride): it becomes
    ``block_table[req, x // bs] * bs + x % bs`` (int32, wrapping); any other
    entry (the 0x7FC00000 NaN pattern included) becomes -1 and is not counted.
    ``lens`` counts the valid entries. A token that is not valid, or whose
    request is outside the table, gets an all -1 row and length 0.
    """
    key, results = _OP.replay(validate, out, topk_indices, token_to_req_indices, block_table,
                              block_size, is_valid_token, compact)
    if results is not None:
        return results
    return _OP.run(key, check_global_topk(topk_indices, token_to_req_indices, block_table,
                                          block_size, is_valid_token, compact, out, validate))


def check_global_topk(topk_indices, token_to_req_indices, block_table, block_size,
                      is_valid_token, compact, out, validate) -> Checked:
    """The checks of ``compute_global_topk_indices_and_lens``, and its launch."""
    indices_out, lens_out = checks.out_buffers(out, ("indices", "lens"))
    kind, device, ops = probe_all({
        "topk_indices": topk_indices, "token_to_req_indices": token_to_req_indices,
        "block_table": block_table, "is_valid_token": is_valid_token, "out[0]": indices_out,
        "out[1]": lens_out})
    topk, token_to_req, table, valid = (ops["topk_indices"], ops["token_to_req_indices"],
                                        ops["block_table"], ops["is_valid_token"])
    checks.check(topk, (INT32,), 2)
    num_tokens, width = topk.shape
    checks.check_row_width("topk_indices.shape[1]", width)
    block_size = check_int("block_size", block_size, minimum=1, maximum=MAX_BLOCK_SIZE)
    if not isinstance(compact, (bool, np.bool_)):
        raise TypeError(f"compact: expected a bool, got {type(compact).__name__}")
    checks.check(token_to_req, (INT32,), 1, min_len=num_tokens)
    checks.check(table, (INT32,), 2)
    checks.check(valid, (BOOL,), 1, min_len=num_tokens)
    indices = checks.output("out[0]", ops["out[0]"], kind, device, INT32, num_tokens, width)
    lens = checks.output("out[1]", ops["out[1]"], kind, device, INT32, num_tokens)
    in_place = ops["out[0]"] is not None and checks.is_same_rows(indices, topk)
    others = [token_to_req, table, valid]
    checks.check_no_alias([indices], others + ([] if in_place else [topk]))
    checks.check_no_alias([lens], others + [topk, indices])
    if validation.check_mode(validate):
        validation.request_ids(token_to_req_indices, kind, num_tokens, table.shape[0],
                               is_valid_token=is_valid_token)
    results = indices.array[:num_tokens, :width], lens.array[:num_tokens]
    launch = global_topk_launch(topk, token_to_req, table, block_size, valid, bool(compact),
                                indices, lens, device)
    return Checked(kind, device, results, (launch,), results)


def global_topk_launch(topk_indices: Operand, token_to_req: Operand, table: Operand,
                       block_size: int, is_valid_token: Operand, compact: bool, out: Operand,
                       lens: Operand, device: int) -> Launch:
    """The global slots of the rows of ``topk_indices``, into ``out`` (which may
    be ``topk_indices``: in place) and ``lens``; ``device`` -1 for the CPU."""
    num_tokens, width = topk_indices.shape
    family = COMPACT_FAMILY if compact else FAMILY
    variant = {}
    if not compact:
        # A compiled-in K also means rows of 16-byte vectors (kernels/global_topk.cuh).
        width_in = (family.compiled_in("top_k", width)
                    if checks.vector_rows(topk_indices, out) else RUN_TIME)
        variant = {"top_k": width_in, "block_size": family.compiled_in("block_size", block_size),
                   "threads": geometry.topk_row_threads(width_in)}
    return Launch(
        family, geometry.one_block_per_row(num_tokens, "topk_indices") if device >= 0 else 0,
        dict(table=table_of(table), topk_indices=topk_indices, token_to_req=token_to_req,
             is_valid_token=is_valid_token, out=out, lens=lens,
             topk_stride=checks.row_stride(topk_indices), out_stride=checks.row_stride(out),
             width=width, num_tokens=num_tokens, block_size=block_size, compact=compact),
        variant=variant, kernel=cpu_global_topk_indices_and_lens)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    yield "global_topk_indices_and_lens", global_topk_launch(
        tiny.rows, tiny.out32, tiny.table, 1, tiny.valid, False, tiny.rows, tiny.out32, -1)
