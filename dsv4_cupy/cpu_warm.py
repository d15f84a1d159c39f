"""Compile the numba CPU kernels for every signature the API accepts
(``warmup(cpu=True)``): each family's module gives launches of its kernel on
tiny numpy inputs in every dtype variant (``warm_launches``), described as a
real call would be, so the arguments handed to the kernels here (arrays as
host views, ints as int64) have the signatures calls hit. Both twins of the
parallel kernels are compiled. Each entry of the returned list is a kernel's
name, with its dtype variant in brackets where it has several."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from . import cpu, families
from .kinds import NUMPY, probe
from .kv_cache import check_pages
from .params import QueryLayout, SlotGeometry
from .spec import FP8_DS_MLA_BYTES_PER_TOKEN, HEAD_SIZE, INDEXER_HEAD_DIM, INDEXER_ROW_BYTES


def tiny_inputs() -> SimpleNamespace:
    """Probed one-request arrays of every dtype the kernels take."""
    def array(name, values, dtype=np.int32):
        return probe(name, np.array(values, dtype))
    qsl, seq = array("qsl", [0, 1]), array("seq", [1])
    return SimpleNamespace(
        qsl=qsl, seq=seq, table=array("table", [[0]]), query=QueryLayout(qsl, seq, 1),
        out32=array("out", [0]), out64=array("out", [0], np.int64), pair=array("cu", [0, 0]),
        rows=array("rows", [[0] * 4]), valid=array("valid", [True], np.bool_),
        geometry=SlotGeometry(block_size=1, ratio=1, cp_world_size=1, cp_rank=0,
                              cp_interleave=1),
        bf16_rows=array("k", [[0] * HEAD_SIZE], np.uint16),
        bf16_rows_3d=array("out", [[[0] * HEAD_SIZE]], np.uint16),
        bytes_rows=array("dst", [[0] * INDEXER_HEAD_DIM], np.uint8),
        pages=check_pages("k_cache", np.zeros((1, FP8_DS_MLA_BYTES_PER_TOKEN), np.uint8),
                          NUMPY, -1, 1),
        indexer_pages=check_pages("kv_cache", np.zeros((1, 1, INDEXER_ROW_BYTES), np.uint8),
                                  NUMPY, -1, None, INDEXER_ROW_BYTES))


def _twins(kernel) -> tuple:
    """Both compiled twins of a ``ParallelKernel``, or the one dispatcher."""
    return kernel.variants() if isinstance(kernel, cpu.ParallelKernel) else (kernel,)


def warm_cpu(progress=None) -> list[str]:
    """Compile every kernel of ``families.CPU_KERNELS`` for every signature;
    returns what was warmed. ``progress(count, name)`` is told of each."""
    tiny, done = tiny_inputs(), []
    for module in families.MODULES:
        for name, launch in module.warm_launches(tiny):
            if progress is not None:
                progress(len(done) + 1, name)
            for leaf in launch.cpu_launches():
                arguments = leaf.cpu_arguments()
                for twin in _twins(leaf.kernel):
                    twin(**arguments)
            done.append(name)
    return done
