"""Every kernel family, a line each. A family's module declares it (its
``KernelFamily``: the ``kernels/<family>.cuh`` file, templated function,
parameter struct and variants), and holds its struct's Python layout, its
numba kernel, its launch description (``*_launch``), its public op and the
examples ``warmup(cpu=True)`` compiles its kernel for. ``warmup()``,
``python -m dsv4_cupy compile`` and the tests walk ``ALL``."""
from __future__ import annotations

import importlib

#: The family modules (a fused family's after the families it fuses).
MODULE_NAMES = (
    "token_map",
    "slot_mapping",
    "c128a",
    "swa",
    "image_visibility",
    "global_topk",
    "short_context",
    "combine",
    "prefill_gather",
    "indexer_prefill",
    "indexer_decode",
    "indexer_native_decode",
    "c4a_layer",
    "step_kernel",
    "k_cache_insert",
    "k_cache_gather",
    "k_cache_select",
    "indexer_insert",
    "indexer_gather",
)
MODULES = tuple(importlib.import_module(f".{name}", __package__) for name in MODULE_NAMES)
#: Every kernel family (a module may declare two over one file: the global top-k's rows).
ALL = tuple(family for module in MODULES for family in module.FAMILIES)
#: Every numba kernel of the CPU path.
CPU_KERNELS = tuple(module.CPU_KERNEL for module in MODULES if module.CPU_KERNEL is not None)
