"""Launches: a family's work described once, then prepared to run again and again.

* ``Launch``: what one family's module says about a call, from named inputs
  (probed arrays, ints, group records of ``params``): on the GPU the kernel
  struct's fields, the entry point (its variant, by axis name) and the
  blocks; on the CPU the numba kernel called with the same names (arrays as
  host views), or the launches it fuses, in order. A fused family's launch
  names its parts' launches as its fields.
* ``PreparedLaunch``: one kernel launch with every field packed once, bound
  to its function and CUDA context: ``cuLaunchKernel``, or with programmatic
  dependent launch turned on (``set_programmatic_launch``)
  ``cuLaunchKernelEx`` through ctypes; every entry point's first step
  (``await_earlier_grids``, kernels/common.cuh) makes the two give the same
  results.
* ``stream_getter``: the caller's current stream (CuPy's or torch's).
"""
from __future__ import annotations

import ctypes
import functools
import inspect
import os
from typing import NamedTuple

import numpy as np

from . import device as devices
from . import host, loader
from .checks import row_stride
from .kinds import INT32, TORCH_CUDA, Operand, loaded_torch
from .params import RECORD_LAYOUTS, BlockTable


class NoArray(NamedTuple):
    """An array input that is not there: a null pointer on the GPU, an empty
    array of ``dtype`` on the CPU."""

    dtype: np.dtype


def optional(op: Operand | None, dtype=INT32):
    """``op``, or for None the absent array of ``dtype`` (``NoArray``)."""
    return NoArray(dtype) if op is None else op


class FrozenLaunch(NamedTuple):
    """A GPU launch's struct values and blocks, converted once: a fused
    kernel's section that a caller keeps across calls (``Launch.frozen``)."""

    values: tuple
    blocks: int


_EMPTY: dict = {}


def table_of(table: Operand) -> BlockTable:
    """The ``BlockTable`` record of a checked 2-D int32 array."""
    rows, cols = table.shape
    return BlockTable(entries=table, rows=rows, cols=cols,
                      row_stride=row_stride(table) if rows else 0)


def _field(value):
    """A named input as its struct field's value (GPU)."""
    kind = type(value)
    if kind is int:
        return value
    if kind is Operand:
        return value.ptr
    if kind is tuple or kind is list:           # an off section's, an Array field's values
        return value
    if value is None or kind is NoArray:
        return 0
    if kind is Launch:                          # a fused family's part
        return value.values()
    if kind is FrozenLaunch:
        return value.values
    if kind in RECORD_LAYOUTS:                  # a group: its values in C order
        return _flattened(value)
    return int(value)                           # bool, numpy ints


def _flattened(items) -> tuple:
    """The struct values of named inputs in C order, nested ones flattened
    (ints and arrays, most of the inputs, without a call each)."""
    values = []
    append, extend = values.append, values.extend
    for item in items:
        kind = type(item)
        if kind is int:
            append(item)
        elif kind is Operand:
            append(item.ptr)
        elif kind is FrozenLaunch:
            extend(item.values)
        else:
            field = _field(item)
            if type(field) is tuple or type(field) is list:
                extend(field)
            else:
                append(field)
    return tuple(values)


def _argument(value):
    """A named input as its numba kernel's argument (CPU): arrays as the host
    views the kernels are compiled for, ints as int64."""
    kind = type(value)
    if kind is Operand:
        if len(value.shape) == 1:
            return host.kernel_view(value.array, value.kind)
        return host.kernel_view_flat(value.array, value.kind)
    if kind is bool or kind is np.bool_:
        return bool(value)
    if kind is NoArray:
        empty = _EMPTY.get(value.dtype)
        if empty is None:
            empty = _EMPTY[value.dtype] = np.empty(0, value.dtype)
        return empty
    if kind in RECORD_LAYOUTS:
        return kind(*map(_argument, value))
    return np.int64(value)


@functools.lru_cache(maxsize=None)
def _parameters(kernel) -> tuple[str, ...]:
    """The parameter names of a numba kernel (or of a ``cpu.ParallelKernel``)."""
    function = getattr(kernel, "py_func", None) or kernel.function
    return tuple(inspect.signature(function).parameters)


class Launch:
    """One family's work, described once from named inputs (see the module's
    docstring). ``blocks`` 0: nothing to launch on the GPU. A launch of
    ``family`` None is a section of a fused kernel with no entry point of its
    own: its struct is ``layout``."""

    __slots__ = ("family", "layout", "blocks", "inputs", "variant", "kernel", "parts")

    def __init__(self, family, blocks: int, inputs: dict, *, variant: dict | None = None,
                 kernel=None, parts: tuple = (), layout=None):
        self.family, self.blocks, self.inputs = family, blocks, inputs
        self.layout = family.params if layout is None else layout
        self.variant = {} if variant is None else variant
        self.kernel, self.parts = kernel, parts

    def fields(self) -> dict:
        """The kernel struct's fields by name."""
        inputs = self.inputs
        try:
            return {name: _field(inputs[name]) for name in self.layout.names}
        except KeyError as error:
            raise TypeError(f"{self.layout.c_name}: no input named {error}") from None

    def values(self) -> tuple:
        """The struct's values in C order, flattened (what is packed, and a
        fused family's field)."""
        inputs = self.inputs
        try:
            return _flattened([inputs[name] for name in self.layout.names])
        except KeyError as error:
            raise TypeError(f"{self.layout.c_name}: no input named {error}") from None

    def frozen(self) -> FrozenLaunch:
        """The launch's values and blocks, to nest in a fused launch again and again."""
        return FrozenLaunch(self.values(), self.blocks)

    def prepare(self, device: int) -> "PreparedLaunch":
        return PreparedLaunch(self.family, self.family.entry_name(self.variant), device,
                              self.blocks, self.values(), self.family.threads(self.variant))

    def cpu_arguments(self) -> dict:
        """The numba kernel's arguments by name."""
        inputs = self.inputs
        try:
            return {name: _argument(inputs[name]) for name in _parameters(self.kernel)}
        except KeyError as error:
            raise TypeError(f"{self.kernel.__name__}: no input named {error}") from None

    def run_cpu(self) -> None:
        if self.kernel is not None:
            self.kernel(**self.cpu_arguments())
        for part in self.parts:
            part.run_cpu()

    def cpu_launches(self) -> list["Launch"]:
        """The launches that call a numba kernel, in the order ``run_cpu`` calls them."""
        own = [self] if self.kernel is not None else []
        return own + [leaf for part in self.parts for leaf in part.cpu_launches()]


# --- programmatic dependent launch ------------------------------------------------------------
#: The CUDA driver that captures it into graphs (12.3) and the first device that has it (sm_90).
PROGRAMMATIC_LAUNCH_DRIVER, PROGRAMMATIC_LAUNCH_CAPABILITY = 12030, 90
#: ``CUlaunchConfig`` followed by the one ``CUlaunchAttribute`` it points at
#: (cuda.h: 56 and 72 bytes; the attribute's value is a 64-byte union).
_LAUNCH_CONFIG = np.dtype({
    "names": ["grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_bytes",
              "stream", "attributes", "num_attributes", "attribute_id", "attribute_value"],
    "formats": ["<u4"] * 7 + ["<u8", "<u8", "<u4", "<u4", "<i4"],
    "offsets": [0, 4, 8, 12, 16, 20, 24, 32, 40, 48, 56, 64], "itemsize": 56 + 72})
_ATTRIBUTE_OFFSET = _LAUNCH_CONFIG.fields["attribute_id"][1]
_PROGRAMMATIC_STREAM_SERIALIZATION = 6      # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class ProgrammaticLaunch:
    """Whether launches may overlap the kernel before them: off unless the
    environment sets ``DSV4_CUPY_PDL=1`` (``set_programmatic_launch`` at run time)."""
    enabled = os.environ.get("DSV4_CUPY_PDL", "0") == "1"


def set_programmatic_launch(enabled: bool) -> bool:
    """Turn programmatic dependent launch (PDL) on or off for every later
    launch, and return the previous setting.

    With it on, on sm_90 and later with a CUDA 12.3 or newer driver, kernels
    are launched with the programmatic-stream-serialization attribute: a
    kernel can be scheduled while the kernel before it on the stream still
    runs, waits as its first instruction until that kernel is done and its
    writes are visible, then lets the next kernel be scheduled. Results are the
    same either way; what overlaps is launch latency. CUDA graphs captured with
    it on keep it.

    It pays where the library's kernels follow one another (or other kernels
    that let dependents start early); after a kernel that does not, a launch
    costs a little more (docs/performance.md has the H200's figures), so it is
    off unless the environment sets ``DSV4_CUPY_PDL=1``.
    """
    previous, ProgrammaticLaunch.enabled = ProgrammaticLaunch.enabled, bool(enabled)
    return previous


@functools.lru_cache(maxsize=None)
def cu_launch_kernel_ex():
    """The driver's ``cuLaunchKernelEx`` (CUDA 12.0+), or None: CuPy has no
    binding for a launch with attributes."""
    return devices.driver_function("cuLaunchKernelEx", (ctypes.c_void_p,) * 4)


@functools.lru_cache(maxsize=None)
def programmatic_launch_supported(device: int) -> bool:
    """Whether ``device`` and the driver can launch programmatically."""
    cuda = devices.cupy_module().cuda
    return (cu_launch_kernel_ex() is not None
            and cuda.runtime.driverGetVersion() >= PROGRAMMATIC_LAUNCH_DRIVER
            and int(cuda.Device(device).compute_capability) >= PROGRAMMATIC_LAUNCH_CAPABILITY)


def launch_config(blocks: int, threads: int, stream: int) -> np.ndarray:
    """A programmatic launch's ``CUlaunchConfig`` on ``stream``, with its attribute."""
    config = np.zeros(1, _LAUNCH_CONFIG)
    config["grid_x"], config["grid_y"], config["grid_z"] = blocks, 1, 1
    config["block_x"], config["block_y"], config["block_z"] = threads, 1, 1
    config["stream"] = stream
    config["attributes"] = config.ctypes.data + _ATTRIBUTE_OFFSET
    config["num_attributes"] = 1
    config["attribute_id"] = _PROGRAMMATIC_STREAM_SERIALIZATION
    config["attribute_value"] = 1
    return config


class PreparedLaunch:
    """One launch of one entry point with every struct field fixed: packed once
    into storage it owns (the driver copies it at each call, so threads can
    share it), the function and the context it belongs to.

    ``run(stream)`` is the whole host cost of a repeated launch: a check that
    its context is current (else it is made current for the launch and the
    caller's device restored) and is still the one it was prepared in (a reset
    can give a new context the old handle: the ids differ), and
    ``cuLaunchKernel``, or ``cuLaunchKernelEx`` with a launch configuration
    made once per stream for a programmatic launch. It returns False, having
    launched nothing, when the device's context is no longer its own; the
    caller then takes its full path and prepares again.
    """

    __slots__ = ("function", "device", "context", "context_id", "blocks", "threads", "storage",
                 "pointers", "kernel_params", "programmatic", "_configs", "_read_id", "_cuda",
                 "_kernel")
    #: Streams whose launch configurations a launch keeps (then it starts again).
    MAX_STREAMS = 8

    def __init__(self, family, entry: str, device: int, blocks: int, values: tuple,
                 threads: int):
        self._cuda = devices.cupy_module().cuda
        self.storage = np.zeros(family.params.size, np.uint8)
        family.params.pack_values_into(self.storage, values)
        self.pointers = np.array([self.storage.ctypes.data], np.uint64)  # void* kernelParams[1]
        self.kernel_params = self.pointers.ctypes.data
        self.device, self.blocks, self.threads = device, blocks, threads
        self.programmatic = programmatic_launch_supported(device)
        self._configs: dict = {}    # stream -> (its CUlaunchConfig, the config's address)
        self._read_id = loader.read_context_id
        with self._cuda.Device(device):
            self.context = loader.current_context()
            self.context_id = self._read_id(self.context)
            # The Function object keeps its module loaded for as long as the launch lives.
            self._kernel = loader.get(family, entry, (self.context, self.context_id))
            self.function = self._kernel.ptr

    def run(self, stream: int) -> bool:
        cuda = self._cuda
        if cuda.driver.ctxGetCurrent() == self.context:
            return self._launch(stream)
        with cuda.Device(self.device):
            if loader.current_context() != self.context:
                return False
            return self._launch(stream)

    def _launch(self, stream: int) -> bool:
        if self._read_id(self.context) != self.context_id:
            return False
        driver = self._cuda.driver
        try:
            if self.programmatic and ProgrammaticLaunch.enabled:
                config = self._config(stream)   # held: another thread may drop the cache
                status = cu_launch_kernel_ex()(config[1], self.function, self.kernel_params,
                                                None)
                if status != 0:
                    raise driver.CUDADriverError(status)
            else:
                driver.launchKernel(self.function, self.blocks, 1, 1, self.threads, 1, 1, 0,
                                    stream, self.kernel_params, 0)
        except driver.CUDADriverError as error:
            if error.status not in loader.STALE_HANDLE_ERRORS:
                raise
            loader.forget_context((self.context, self.context_id))
            return False
        return True

    def _config(self, stream: int) -> tuple:
        """The launch configuration on ``stream`` and its address."""
        config = self._configs.get(stream)
        if config is None:
            if len(self._configs) >= self.MAX_STREAMS:
                self._configs = {}
            array = launch_config(self.blocks, self.threads, stream)
            config = self._configs[stream] = (array, array.ctypes.data)
        return config


def stream_getter(kind: str, device: int):
    """A no-argument function returning the stream handle a launch on ``device``
    must use now: CuPy's current stream for cupy, torch's current stream for
    torch, so launches follow ``with cupy.cuda.Stream()``,
    ``torch.cuda.stream(...)`` and graph captures (the lookups done once)."""
    if kind == TORCH_CUDA:
        torch = loaded_torch()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # no Stream object
        if raw is not None:
            return lambda: raw(device)
        return lambda: torch.cuda.current_stream(device).cuda_stream
    get_current_stream = devices.cupy_module().cuda.get_current_stream
    return lambda: get_current_stream(device).ptr
