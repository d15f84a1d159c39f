"""Compile the numba CPU kernels for every signature the API accepts
(``warmup(cpu=True)``): each family's launch, described by its own module
(``launch.Launch``) from tiny numpy inputs in every dtype variant, hands each
of its kernels the arguments a real call would (arrays as host views, ints as
int64), so the signatures compiled here are the ones calls hit. Both twins of
the parallel kernels are compiled. Each entry of the returned list is a
kernel's name, with its dtype variant in brackets where it has several."""
from __future__ import annotations

import numpy as np

from . import cpu
from .c128a import VALIDITY_FROM_SLOTS, c128a_launch
from .combine import combine_launch
from .global_topk import global_topk_launch
from .indexer_decode import indexer_decode_launch
from .indexer_prefill import indexer_prefill_launch
from .kinds import probe
from .params import C128ARows, QueryLayout, SlotGeometry
from .prefill_gather import gather_lens_launch
from .short_context import short_context_launch
from .slot_mapping import slot_mapping_launch
from .step_kernel import step_launch
from .swa import swa_launch
from .token_map import token_map_launch

_DTYPES = {np.dtype(np.int32): "32", np.dtype(np.int64): "64"}


def _array(name: str, values, dtype=np.int32):
    return probe(name, np.array(values, dtype))


def _launches():
    """(name, launch) for every CPU kernel signature the API accepts."""
    qsl, seq, table = _array("qsl", [0, 1]), _array("seq", [1]), _array("table", [[0]])
    query = QueryLayout(qsl, seq, 1)
    out32, out64 = _array("out", [0]), _array("out", [0], np.int64)
    rows = _array("rows", [[0] * 4])
    valid = _array("valid", [True], np.bool_)
    geometry = SlotGeometry(block_size=1, ratio=1, cp_world_size=1, cp_rank=0, cp_interleave=1)
    yield "token_to_req_indices", token_map_launch(qsl, 1, out32, 1)
    for slots in (out32, out64):     # no token slots: an empty int64 array
        yield (f"compressed_slot_mapping[s{_DTYPES[slots.dtype]}]",
               slot_mapping_launch(qsl, seq, table, geometry, out64, 1, slots))
    for positions in (out32, out64):
        for slots in (out32, out64):
            c128a_rows = C128ARows(global_decode=rows, decode_lens=out32, prefill=rows,
                                   decode_stride=4, prefill_stride=4, width=4,
                                   num_valid_tokens=VALIDITY_FROM_SLOTS)
            yield (f"c128a_topk_metadata[p{_DTYPES[positions.dtype]}_s{_DTYPES[slots.dtype]}]",
                   c128a_launch(positions, out32, slots, table, geometry, c128a_rows, 1, 1, -1))
        yield (f"fill_short_context_topk_indices[p{_DTYPES[positions.dtype]}]",
               short_context_launch(positions, rows, 4, 4, 1, -1))
    for slots in (out32, out64):
        yield f"step_validity[s{_DTYPES[slots.dtype]}]", step_launch({}, {}, slots, valid)
    yield "swa_indices_and_lens", swa_launch(query, table, out32, valid, rows, out32, 4, 1, 0, 1,
                                             1, -1)
    yield "global_topk_indices_and_lens", global_topk_launch(rows, out32, table, 1, valid, False,
                                                             rows, out32, -1)
    yield "combine_topk_swa_indices", combine_launch(query, out32, rows, rows, out32, 1, 2, 1, 1,
                                                     2, 1, -1)
    yield "prefill_gather_lens", gather_lens_launch(query, out32, 0, 1, 2)
    yield "indexer_prefill_chunk_metadata", indexer_prefill_launch(
        query, _array("cu", [0, 0]), out32, out32, out32, 1, 4, 0, 1)
    yield "indexer_decode_metadata", indexer_decode_launch(query, table, out32, out32, out32,
                                                           rows, 1, 4)


def _twins(kernel) -> tuple:
    """Both compiled twins of a ``ParallelKernel``, or the one dispatcher."""
    return kernel.variants() if isinstance(kernel, cpu.ParallelKernel) else (kernel,)


def warm_cpu() -> list[str]:
    """Compile every kernel of ``cpu.KERNELS`` for every signature; returns what was warmed."""
    done = []
    for name, launch in _launches():
        for leaf in launch.cpu_launches():
            arguments = leaf.cpu_arguments()
            for twin in _twins(leaf.kernel):
                twin(**arguments)
        done.append(name)
    return done
