"""Context parallelism over the compressed cache: argument checks and
``get_dcp_local_seq_lens`` (vLLM's helper of the same name).

Under decode context parallelism (DCP) the compressed rows of every request are
dealt to ``world`` ranks ``interleave`` rows at a time; each rank stores its
rows densely in its own cache (``spec.compressed_row_owner``). Experimental:
vLLM has DeepSeek-V4 DCP on a branch only.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .kinds import INT32, describe, kind_of, probe, stack_columns
from .scalars import check_int

#: Bound of context-parallel world and interleave sizes.
MAX_CP_SIZE = 1 << 16


class ContextParallel(NamedTuple):
    world_size: int
    rank: int
    interleave: int


#: No context parallelism.
SINGLE_RANK = ContextParallel(world_size=1, rank=0, interleave=1)


def check_cp(world_size, rank, interleave, *, block_size: int | None = None,
             names=("cp_world_size", "cp_rank", "cp_kv_cache_interleave_size")) -> ContextParallel:
    """Checked context-parallel arguments. With ``block_size`` (the storage block)
    and more than one rank, the block must hold whole interleave groups: a larger
    interleave would land rows in blocks the request does not own."""
    world_name, rank_name, interleave_name = names
    world = check_int(world_name, world_size, minimum=1, maximum=MAX_CP_SIZE)
    rank = check_int(rank_name, rank, minimum=0, maximum=world - 1)
    interleave = check_int(interleave_name, interleave, minimum=1, maximum=MAX_CP_SIZE)
    if block_size is not None and world > 1 and block_size % interleave:
        raise ValueError(f"{interleave_name}: expected a divisor of the storage block size "
                         f"{block_size} when {world_name} > 1, got {interleave}")
    return ContextParallel(world, rank, interleave)


def get_dcp_local_seq_lens(seq_lens, dcp_size: int = 1, dcp_rank: int | None = None,
                           cp_kv_cache_interleave_size: int = 1):
    """Rows of each sequence that DCP rank ``dcp_rank`` stores.

    Parameters
    ----------
    seq_lens : int array ``[N]`` (numpy, cupy or torch) or an int
        Lengths, in the rows being sharded (tokens, or compressed rows).
    dcp_size, dcp_rank, cp_kv_cache_interleave_size : int
        ``dcp_rank=None`` returns every rank's count. ``dcp_rank`` may also be
        a one-element int32 array of ``seq_lens``'s kind and device (vLLM 0.34
        keeps it on the device: no host copy); the result then has the
        broadcast shape.

    Returns
    -------
    ``[N]`` (or ``[N, dcp_size]`` with ``dcp_rank=None``) of the input's kind and
    dtype: ``per_rank + clip(s - per_rank * dcp_size - rank * I, 0, I)`` with
    ``per_rank = s // I // dcp_size * I``.
    """
    world, _, interleave = check_cp(dcp_size, 0, cp_kv_cache_interleave_size,
                                    names=("dcp_size", "dcp_rank",
                                           "cp_kv_cache_interleave_size"))
    rank_kind = kind_of(dcp_rank) if dcp_rank is not None else None
    if rank_kind is not None:
        rank = probe("dcp_rank", dcp_rank)
        if (rank.kind, rank.device) != (kind_of(seq_lens), probe("seq_lens", seq_lens).device
                                        if kind_of(seq_lens) else -2):
            raise TypeError(f"dcp_rank: expected an array like seq_lens, got {describe(dcp_rank)}")
        if rank.dtype != INT32 or int(np.prod(rank.shape, dtype=np.int64)) != 1:
            raise ValueError(f"dcp_rank: expected one int32 value, got {rank.dtype} of shape "
                             f"{tuple(rank.shape)}")
    elif dcp_rank is not None:
        check_int("dcp_rank", dcp_rank, minimum=0, maximum=world - 1)
    if isinstance(seq_lens, int) or kind_of(seq_lens) is None:
        seq_lens = check_int("seq_lens", seq_lens, minimum=0)

    def local(rank):
        per_rank = seq_lens // interleave // world * interleave
        extra = seq_lens - per_rank * world - rank * interleave
        extra = extra * (extra > 0)                                   # clip at 0
        return per_rank + extra - (extra - interleave) * (extra > interleave)   # clip at I

    if dcp_rank is not None:
        return local(dcp_rank)
    columns = [local(rank) for rank in range(world)]
    if isinstance(seq_lens, int):
        return columns
    return stack_columns(columns)
