"""Every kernel family, declared once: its ``.cu`` file, templated function,
parameter struct and variants (dtypes, widths compiled in). A file may hold
two families' functions (the global top-k's rows and its compacted rows).
Ops and the builder launch through these by field name; ``warmup()`` and
``python -m dsv4_cupy compile`` walk ``ALL``."""
from __future__ import annotations

import numpy as np

from . import params
from .geometry import (COMBINE_LANES, ROW_LANES, combine_lanes, row_block_threads,
                       topk_row_threads)
from .loader import RUN_TIME, KernelFamily
from .spec import (C4A_BLOCK_SIZE, C4A_RATIO, INDEX_TOPKS, SWA_BLOCK_SIZE, SWA_WINDOW_SIZE,
                   combined_width)

INT32, INT64 = np.dtype(np.int32), np.dtype(np.int64)
#: Axes of the families templated on the positions and slot-mapping dtypes.
POSITIONS_AXIS = ("p", (INT32, INT64))
SLOT_MAPPING_AXIS = ("s", (INT32, INT64))
#: Row widths and block sizes compiled in beside the run-time kernel: DeepSeek-V4's
#: (shorter code on a decode launch's chain; the kernels' comments carry the
#: measured gains).
SWA_WINDOW_AXIS = ("w", (RUN_TIME, SWA_WINDOW_SIZE))
SWA_BLOCK_AXIS = ("b", (RUN_TIME, SWA_BLOCK_SIZE))
TOP_K_AXIS = ("k", (RUN_TIME, *INDEX_TOPKS))
C4A_BLOCK_AXIS = ("b", (RUN_TIME, C4A_BLOCK_SIZE))
#: Combined row widths: SWA-only layers' (no top-k part), then the C4A layers'.
COMBINED_WIDTH_AXIS = ("c", (RUN_TIME, *(combined_width(topk, SWA_WINDOW_SIZE)
                                         for topk in (0, *INDEX_TOPKS))))
#: The C4A layers' compress ratio.
C4A_RATIO_AXIS = ("r", (RUN_TIME, C4A_RATIO))
#: Threads per combined row (geometry.combine_lanes).
COMBINE_LANES_AXIS = ("l", COMBINE_LANES)
#: Threads per SWA or short-context row (geometry.row_lanes).
ROW_LANES_AXIS = ("l", ROW_LANES)
#: Threads of an SWA or short-context block, by the lanes of its rows
#: (geometry.row_block_threads).
ROW_THREADS_AXIS = ("t", tuple(sorted({row_block_threads(lanes) for lanes in ROW_LANES})))
#: Threads per global top-k row, its block (geometry.topk_row_threads).
TOP_K_THREADS_AXIS = ("t", tuple(sorted({topk_row_threads(k) for k in TOP_K_AXIS[1]})))

TOKEN_MAP = KernelFamily("token_map.cu", "token_to_req_indices", params.TOKEN_MAP)
SLOT_MAPPING = KernelFamily("slot_mapping.cu", "compressed_slot_mapping", params.SLOT_MAPPING,
                           (SLOT_MAPPING_AXIS,))
C128A = KernelFamily("c128a.cu", "c128a_topk_metadata", params.C128A,
                     (POSITIONS_AXIS, SLOT_MAPPING_AXIS))
ALL = (TOKEN_MAP, SLOT_MAPPING, C128A)

# --- the per-layer and indexer metadata families -------------------------------------------
SWA = KernelFamily("swa.cu", "swa_indices_and_lens", params.SWA,
                  (SWA_WINDOW_AXIS, SWA_BLOCK_AXIS, ROW_LANES_AXIS, ROW_THREADS_AXIS),
                  where=lambda window, block_size, lanes, threads: (
                      threads == row_block_threads(lanes)),
                  threads_axis="t")
GLOBAL_TOPK = KernelFamily("global_topk.cu", "global_topk_indices_and_lens", params.GLOBAL_TOPK,
                           (TOP_K_AXIS, C4A_BLOCK_AXIS, TOP_K_THREADS_AXIS),
                           where=lambda width, block_size, threads: (
                               threads == topk_row_threads(width)),
                           threads_axis="t")
#: The same rows with their valid entries packed to the front (``compact=True``).
GLOBAL_TOPK_COMPACT = KernelFamily("global_topk.cu", "global_topk_compact_indices_and_lens",
                                   params.GLOBAL_TOPK)
SHORT_CONTEXT = KernelFamily("short_context.cu", "fill_short_context_topk_indices",
                             params.SHORT_CONTEXT,
                             (POSITIONS_AXIS, ROW_LANES_AXIS, TOP_K_AXIS, C4A_RATIO_AXIS,
                              ROW_THREADS_AXIS),
                             where=lambda positions, lanes, top_k, ratio, threads: (
                                 threads == row_block_threads(lanes)),
                             threads_axis="t")
#: A compiled-in width comes with its own lanes only (the run-time width with each).
COMBINE = KernelFamily("combine.cu", "combine_topk_swa_indices", params.COMBINE,
                       (COMBINED_WIDTH_AXIS, SWA_WINDOW_AXIS, COMBINE_LANES_AXIS),
                       where=lambda width, window, lanes: (width == RUN_TIME
                                                           or lanes == combine_lanes(width)))
PREFILL_GATHER = KernelFamily("prefill_gather.cu", "prefill_gather_lens", params.PREFILL_GATHER)
INDEXER_PREFILL = KernelFamily("indexer_prefill.cu", "indexer_prefill_chunk_metadata",
                               params.INDEXER_PREFILL)
INDEXER_DECODE = KernelFamily("indexer_decode.cu", "indexer_decode_metadata",
                              params.INDEXER_DECODE)
#: The fused per-layer family: the two above for one C4A layer in one launch.
C4A_LAYER = KernelFamily("c4a_layer.cu", "c4a_layer_topk", params.C4A_LAYER)
ALL += (SWA, GLOBAL_TOPK, GLOBAL_TOPK_COMPACT, SHORT_CONTEXT, COMBINE, PREFILL_GATHER,
        INDEXER_PREFILL, INDEXER_DECODE, C4A_LAYER)
#: The fused step kernel of both builders: every step-level output in one launch.
STEP = KernelFamily("step.cu", "step_metadata", params.STEP, (POSITIONS_AXIS, SLOT_MAPPING_AXIS))
ALL += (STEP,)
