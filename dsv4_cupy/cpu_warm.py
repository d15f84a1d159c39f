"""Compile the numba CPU kernels for every signature the API accepts
(``warmup(cpu=True)``): inputs arrive as ``arrays.kernel_view`` normalises them
(1-D, contiguous, writable), so only the dtypes vary."""
from __future__ import annotations

import numpy as np

from . import cpu


def warm_cpu() -> list[str]:
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
    return done
