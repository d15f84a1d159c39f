"""Compile the numba CPU kernels (every one of ``cpu.KERNELS``, both twins of
the parallel ones) for every signature the API accepts (``warmup(cpu=True)``):
inputs arrive as ``arrays.kernel_view`` normalises them (1-D, contiguous,
writable), so only the dtypes vary. Each entry of the returned list is a
kernel's name, with its dtype variant in brackets where it has several."""
from __future__ import annotations

import numpy as np

from . import cpu


def warm_cpu() -> list[str]:
    """Compile every kernel of ``cpu.KERNELS``; returns what was warmed."""
    i32, i64 = np.int32, np.int64
    qsl = np.array([0, 1], i32)
    table = np.zeros(1, i32)
    cpu.token_to_req_indices(qsl, i64(1), np.empty(1, i32))
    done = ["token_to_req_indices"]
    for token_slots in (np.zeros(1, i32), np.zeros(1, i64)):
        cpu.compressed_slot_mapping(qsl, np.ones(1, i32), table, i64(1), i64(1), i64(1), i64(1),
                                    i64(1), i64(1), i64(0), i64(1), i64(1), token_slots, True,
                                    np.empty(1, i64))
        done.append(f"compressed_slot_mapping[s{token_slots.itemsize * 8}]")
    rows = np.empty(1, i32)
    for positions_dtype in (i32, i64):
        for slot_dtype in (i32, i64):
            for twin in cpu.c128a_topk_metadata.variants():     # parallel, and serial (fork)
                twin(np.zeros(1, positions_dtype), i64(128), i64(1), np.zeros(1, i32), table,
                     i64(1), i64(1), i64(1), i64(2), np.zeros(1, slot_dtype), i64(1), rows, i64(1),
                     np.empty(1, i32), rows, i64(1), i64(1), i64(0), i64(1), i64(-1))
            done.append(f"c128a_topk_metadata[p{np.dtype(positions_dtype).itemsize * 8}"
                        f"_s{np.dtype(slot_dtype).itemsize * 8}]")
    return done + _warm_layer_kernels()


def _twins(kernel) -> tuple:
    """Both compiled twins of a ``ParallelKernel``, or the one dispatcher."""
    return kernel.variants() if isinstance(kernel, cpu.ParallelKernel) else (kernel,)


def _warm_layer_kernels() -> list[str]:
    """The per-layer and indexer kernels (both twins of the parallel ones)."""
    i32, i64 = np.int32, np.int64
    qsl, ones, valid = np.array([0, 1], i32), np.ones(1, i32), np.ones(1, np.bool_)
    table, out = np.zeros(1, i32), np.empty(1, i32)
    for twin in _twins(cpu.swa_indices_and_lens):
        twin(qsl, i64(1), ones, np.zeros(1, i32), valid, table, i64(1), i64(1), i64(1), i64(1),
             i64(1), i64(0), i64(1), out, i64(1), np.empty(1, i32))
    for twin in _twins(cpu.global_topk_indices_and_lens):
        twin(np.zeros(1, i32), i64(1), i64(1), i64(1), np.zeros(1, i32), valid, table, i64(1),
             i64(1), i64(1), i64(1), False, out, i64(1), np.empty(1, i32))
    done = ["swa_indices_and_lens", "global_topk_indices_and_lens"]
    for positions_dtype in (i32, i64):
        for twin in _twins(cpu.short_context_topk_indices):
            twin(np.zeros(1, positions_dtype), i64(1), i64(1), i64(4), out, i64(1))
        done.append(f"short_context_topk_indices[p{np.dtype(positions_dtype).itemsize * 8}]")
    for twin in _twins(cpu.combine_topk_swa_indices):
        twin(np.zeros(1, i32), i64(1), qsl, i64(1), ones, ones, i64(1), i64(1), i64(1), i64(2),
             i64(1), i64(1), i64(128), np.empty(128, i32), i64(128), np.empty(1, i32))
    for twin in _twins(cpu.prefill_gather_lens):
        twin(qsl, ones, i64(0), i64(1), i64(128), np.empty(1, i32))
    for twin in _twins(cpu.indexer_prefill_chunk_metadata):
        twin(qsl, i64(1), ones, i64(4), i64(0), i64(1), np.empty(2, i32), np.empty(0, i32),
             np.empty(1, i32), np.empty(1, i32))
    for twin in _twins(cpu.indexer_decode_metadata):
        twin(qsl, i64(1), ones, table, i64(1), i64(1), i64(1), i64(4), np.empty(1, i32),
             np.empty(1, i32), np.empty(1, i32), out, i64(1))
    return done + ["combine_topk_swa_indices", "prefill_gather_lens",
                   "indexer_prefill_chunk_metadata", "indexer_decode_metadata"]
