"""``KernelFamily``: a kernel family's declaration (its ``kernels/<family>.cuh``
file, templated device function, parameter struct and variants), and the
template axes the families share. Each family is declared in its own module;
``families.py`` lists them."""
from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from .geometry import (COMBINE_LANES, ROW_LANES, RUN_TIME, THREADS, row_block_threads,
                       topk_row_threads)
from .params import Params
from .spec import (C4A_BLOCK_SIZE, C4A_RATIO, INDEX_TOPKS, SWA_BLOCK_SIZE, SWA_WINDOW_SIZE,
                   combined_width)

INT32, INT64 = np.dtype(np.int32), np.dtype(np.int64)
_C_TYPES = {INT32: "int", INT64: "long long"}
#: Entry points whose parameter struct is larger than this take it as a
#: ``__grid_constant__``: the kernel reads it in place instead of copying it.
GRID_CONSTANT_BYTES = 256


class Axis(NamedTuple):
    """A template parameter of a family's device function."""

    name: str        # how a launch picks its value: variant={"window": 128}
    letter: str      # its mark in entry-point names: ..._w128
    values: tuple    # numpy dtypes (a type parameter) or ints (an int parameter; RUN_TIME
                     # for the kernel that reads the quantity from its struct)


def _suffix(value) -> str:
    """An axis value in an entry name: a dtype's bits, or the int itself."""
    return str(value) if isinstance(value, int) else str(np.dtype(value).itemsize * 8)


def _template_argument(value) -> str:
    return str(value) if isinstance(value, int) else _C_TYPES[np.dtype(value)]


class KernelFamily:
    """The kernels of one function of a ``.cuh`` file: ``dsv4::function``
    templated over ``axes``, taking one ``params`` struct.

    Entry points are ``function`` followed by ``_<letter><bits or int>`` per
    axis, one for each combination of values that ``where`` (called with one
    keyword per axis name) keeps: by default every combination. The int axis
    named ``threads_axis`` is also the block's thread count of its kernels
    (else ``THREADS``). A launch names its variant by axis name.
    """

    def __init__(self, file: str, function: str, params: Params, axes: tuple = (),
                 where=None, threads_axis: str | None = None):
        self.file, self.function, self.params, self.axes = file, function, params, axes
        self.axis_names = tuple(axis.name for axis in axes)
        self._threads_axis = threads_axis
        self.variants = tuple(
            dict(zip(self.axis_names, values))
            for values in itertools.product(*(axis.values for axis in axes))
            if where is None or where(**dict(zip(self.axis_names, values))))
        self._names = {self.variant_key(variant): self._entry_name(variant)
                       for variant in self.variants}

    def variant_key(self, variant: dict) -> tuple:
        """The variant's values in axis order (a ``KeyError`` for a missing axis,
        a ``TypeError`` for an unknown one)."""
        if len(variant) != len(self.axes):
            unknown = sorted(set(variant) - set(self.axis_names))
            if unknown:
                raise TypeError(f"{self.function}: no axis named {unknown}")
        return tuple(variant[name] for name in self.axis_names)

    def _entry_name(self, variant: dict) -> str:
        return self.function + "".join(f"_{axis.letter}{_suffix(variant[axis.name])}"
                                       for axis in self.axes)

    def entry_name(self, variant: dict) -> str:
        """The entry point of ``variant`` (a value per axis name), one the family compiles."""
        key = self.variant_key(variant)
        name = self._names.get(key)
        if name is None:
            raise ValueError(f"{self.function}: no entry point for {variant}")
        return name

    def compiled_in(self, axis_name: str, value: int) -> int:
        """The value of the int axis ``axis_name`` whose kernel serves ``value``:
        ``value`` when it is compiled in, else ``RUN_TIME``."""
        (values,) = [axis.values for axis in self.axes if axis.name == axis_name]
        return value if value in values else RUN_TIME

    def entry_points(self) -> list[str]:
        return [self._names[self.variant_key(variant)] for variant in self.variants]

    def threads(self, variant: dict) -> int:
        """Threads per block of the kernel of ``variant``."""
        return THREADS if self._threads_axis is None else variant[self._threads_axis]

    def stubs(self) -> str:
        """The extern "C" entry points, generated from the declaration."""
        constant = "__grid_constant__ " if self.params.size > GRID_CONSTANT_BYTES else ""
        lines = []
        for variant in self.variants:
            values = self.variant_key(variant)
            targs = f"<{', '.join(_template_argument(v) for v in values)}>" if values else ""
            lines.append(f'extern "C" __global__ void __launch_bounds__(DSV4_THREADS) '
                         f"{self._names[values]}(const {constant}{self.params.c_name} p) "
                         f"{{ await_earlier_grids(); dsv4::{self.function}{targs}(p); }}")
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return f"KernelFamily({self.file!r}, {self.function!r})"


# --- axes -------------------------------------------------------------------------------------
POSITIONS_AXIS = Axis("positions", "p", (INT32, INT64))
SLOT_MAPPING_AXIS = Axis("slot_mapping", "s", (INT32, INT64))
#: Whether the step kernel's grid starts at StepParams.first_block (step_kernel.first_block).
ROTATED_GRID_AXIS = Axis("rotated", "r", (0, 1))
#: Row widths, block sizes and ratios compiled in beside the run-time kernel:
#: DeepSeek-V4's (shorter code on a decode launch's chain).
SWA_WINDOW_AXIS = Axis("window", "w", (RUN_TIME, SWA_WINDOW_SIZE))
SWA_BLOCK_AXIS = Axis("block_size", "b", (RUN_TIME, SWA_BLOCK_SIZE))
TOP_K_AXIS = Axis("top_k", "k", (RUN_TIME, *INDEX_TOPKS))
C4A_BLOCK_AXIS = Axis("block_size", "b", (RUN_TIME, C4A_BLOCK_SIZE))
#: Combined row widths: SWA-only layers' (no top-k part), then the C4A layers'.
COMBINED_WIDTH_AXIS = Axis("width", "c", (RUN_TIME, *(combined_width(topk, SWA_WINDOW_SIZE)
                                                      for topk in (0, *INDEX_TOPKS))))
C4A_RATIO_AXIS = Axis("ratio", "r", (RUN_TIME, C4A_RATIO))
#: Threads per combined row (geometry.combine_lanes).
COMBINE_LANES_AXIS = Axis("lanes", "l", COMBINE_LANES)
#: Threads per SWA or short-context row (geometry.row_lanes).
ROW_LANES_AXIS = Axis("lanes", "l", ROW_LANES)
#: Threads of an SWA or short-context block, by the lanes of its rows
#: (geometry.row_block_threads).
ROW_THREADS_AXIS = Axis("threads", "t", tuple(sorted({row_block_threads(lanes)
                                                     for lanes in ROW_LANES})))
#: Threads per global top-k row, its block (geometry.topk_row_threads).
TOP_K_THREADS_AXIS = Axis("threads", "t", tuple(sorted({topk_row_threads(k)
                                                       for k in TOP_K_AXIS.values})))
