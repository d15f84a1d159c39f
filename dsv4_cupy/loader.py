"""The one place that compiles, loads and launches CUDA kernels.

* A kernel family (``KernelFamily``: its ``.cu`` file, its templated device
  function, its parameter struct and its dtype variants) is declared once, in
  ``families.py``. Its entry points are generated here from the declaration,
  so the naming rule ``function_p32_s64`` (``function_p64_k512`` for a width
  compiled in) lives in ``KernelFamily.entry_name``
  alone, and no source is parsed to find them.
* The ``.cu`` files are read from the installed package (``dsv4_cupy/kernels_cu``)
  or, in a source checkout, from the top-level ``kernels/`` folder. Local
  ``#include "x.cuh"`` lines are inlined under ``#line`` marks, so compiler
  messages point at the real file, and ``static_assert``s of the parameter
  structs' sizes and offsets (from ``params.py``) are appended.
* The constants that Python and CUDA share (threads per block, the "no slot"
  sentinel) and a hash of every kernel source are passed as ``-D`` options:
  CuPy's disk cache key ignores included files, so a stale cubin is never reused.
* Modules are compiled once per device and cached on disk by CuPy
  (``CUPY_CACHE_DIR``), and loaded once per CUDA context (a device reset or a
  second context reloads instead of using a stale handle); ``warmup()`` does
  the first use before serving.
* ``compile_for(family, arch)`` builds a cubin for any arch without a GPU
  (NVRTC from PyPI), for CI and ``python -m dsv4_cupy compile``.
* Every launch is a ``LaunchPlan``'s: ``cuLaunchKernel``, or with programmatic
  dependent launch turned on (``set_programmatic_launch``) ``cuLaunchKernelEx``
  through ctypes; each entry point's first step (``await_earlier_grids`` in
  kernels/common.cuh) makes the two give the same results.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import re
import threading
from pathlib import Path

import numpy as np

from . import device as devices
from .errors import KernelCompileError
from .geometry import POSITION_LIMIT, THREADS, WARP_LANES, WARP_PIECE
from .params import MAX_PLAN_CHUNKS, Params
from .spec import PAD_SLOT_ID

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
#: Options beyond CuPy's own (which adds -arch, -ftz, its include paths).
BASE_OPTIONS = ("-std=c++17",)
DEFAULT_ARCHS = ("sm_90", "sm_100")
#: The value of an int axis whose kernel reads the quantity from its struct.
RUN_TIME = 0
#: The constants kernels share with Python, one definition each.
DEVICE_CONSTANTS = {"DSV4_THREADS": THREADS, "DSV4_PAD_SLOT_ID": PAD_SLOT_ID,
                    "DSV4_MAX_PLAN_CHUNKS": MAX_PLAN_CHUNKS, "DSV4_WARP_PIECE": WARP_PIECE,
                    "DSV4_RUN_TIME": RUN_TIME, "DSV4_POSITION_LIMIT": POSITION_LIMIT,
                    "DSV4_WARP_LANES": WARP_LANES}
_C_TYPES = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}


def _suffix(value) -> str:
    """An axis value in an entry name: a dtype's bits, or the int itself."""
    return str(value) if isinstance(value, int) else str(np.dtype(value).itemsize * 8)


def _template_argument(value) -> str:
    return str(value) if isinstance(value, int) else _C_TYPES[np.dtype(value)]


class KernelFamily:
    """The kernels of one function of a ``.cu`` file: ``dsv4::function``
    templated over ``axes``, taking one ``params`` struct.

    An axis is a ``(letter, values)`` pair. Its values are numpy dtypes (a type
    parameter) or ints (an ``int`` parameter: a width, window or ratio compiled in, or
    ``RUN_TIME`` for the kernel that reads it from the struct). Entry points are
    ``function`` followed by ``_<letter><bits or int>`` per axis, one for each
    combination of values that ``where`` (called with one value per axis) keeps:
    by default every combination. The int axis ``threads_axis``, when named, is
    also the block's thread count of its kernels (else ``THREADS``).
    """

    def __init__(self, file: str, function: str, params: Params, axes: tuple = (),
                 where=None, threads_axis: str | None = None):
        self.file, self.function, self.params, self.axes = file, function, params, axes
        self._threads_at = ([letter for letter, _ in axes].index(threads_axis)
                            if threads_axis is not None else None)
        self.variants = tuple(variant for variant in itertools.product(*(v for _, v in axes))
                              if where is None or where(*variant))
        self._names = {variant: self.entry_name(variant) for variant in self.variants}

    def entry_name(self, variant: tuple) -> str:
        """The entry point for one tuple of values (one per axis)."""
        return self.function + "".join(f"_{letter}{_suffix(value)}"
                                       for (letter, _), value in zip(self.axes, variant))

    def compiled_in(self, letter: str, value: int) -> int:
        """The value of the int axis ``letter`` whose kernel serves ``value``:
        ``value`` when it is compiled in, else ``RUN_TIME``."""
        (values,) = [values for axis, values in self.axes if axis == letter]
        return value if value in values else RUN_TIME

    def entry_points(self) -> list[str]:
        return [self._names[variant] for variant in self.variants]

    def stubs(self) -> str:
        """The extern "C" entry points, generated from the declaration."""
        lines = []
        for variant in self.variants:
            targs = f"<{', '.join(_template_argument(v) for v in variant)}>" if variant else ""
            lines.append(f'extern "C" __global__ void __launch_bounds__(DSV4_THREADS) '
                         f"{self._names[variant]}(const {self.params.c_name} p) "
                         f"{{ await_earlier_grids(); dsv4::{self.function}{targs}(p); }}")
        return "\n".join(lines) + "\n"

    def threads(self, variant: tuple = ()) -> int:
        """Threads per block of the kernel of ``variant``."""
        return THREADS if self._threads_at is None else variant[self._threads_at]

    def plan(self, device: int, blocks: int, variant: tuple = (), **fields) -> "LaunchPlan":
        """A launch with every field fixed, to run again and again (see ``LaunchPlan``)."""
        return LaunchPlan(self, self._names[variant], device, blocks, fields,
                          self.threads(variant))

    def __repr__(self) -> str:
        return f"KernelFamily({self.file!r}, {self.function!r})"


def kernel_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels"):
        if any(candidate.glob("*.cu")):
            return candidate
    raise FileNotFoundError(f"no kernel sources found next to {here}")


def kernel_files() -> list[str]:
    return sorted(p.name for p in kernel_dir().glob("*.cu"))


@functools.lru_cache(maxsize=None)
def file_source(file: str) -> str:
    """The text of ``kernels/<file>`` with includes inlined once and #line marks."""
    directory = kernel_dir()
    seen: set[str] = set()

    def expand(name: str) -> str:
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"kernels/{name} not found (included from kernels/{file})")
        text = path.read_text()
        out, last = [f'#line 1 "kernels/{name}"\n'], 0
        for match in _INCLUDE.finditer(text):
            out.append(text[last:match.start()])
            header = match.group(1)
            if header not in seen:
                seen.add(header)
                out.append(expand(header))
            line = text.count("\n", 0, match.end()) + 2
            out.append(f'\n#line {line} "kernels/{name}"')
            last = match.end()
        out.append(text[last:])
        return "".join(out)

    return expand(file)


def layout_asserts(params: Params) -> str:
    """static_asserts that the C structs have the sizes of ``params`` and its groups
    (NVRTC has no offsetof: tests/test_params.py compares the fields one by one)."""
    return "".join(f'static_assert(sizeof({layout.c_name}) == {layout.size}, '
                   f'"{layout.c_name}: size differs from dsv4_cupy/params.py");\n'
                   for layout in (*params.groups, params))


def source(family: KernelFamily) -> str:
    """The compilable text of a family: its file, the layout checks, its entry points."""
    return (file_source(family.file) + f'\n#line 1 "generated by dsv4_cupy/loader.py"\n'
            + layout_asserts(family.params) + family.stubs())


@functools.lru_cache(maxsize=None)
def sources_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(kernel_dir().iterdir()):
        if path.suffix in (".cu", ".cuh"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def options() -> tuple[str, ...]:
    defines = tuple(f"-D{name}={value}" for name, value in DEVICE_CONSTANTS.items())
    return BASE_OPTIONS + defines + (f"-DDSV4_KERNELS_HASH=0x{sources_hash()}",)


def _load(family: KernelFamily):
    """The family's module compiled for the current device and loaded into the
    current CUDA context. CuPy's ``compile_with_cache`` (what ``RawModule`` uses
    underneath) keeps the cubin on disk; the module is loaded per context, so a
    device reset or another context never sees a stale handle."""
    cupy = devices.cupy_module()
    devices.nvrtc_version()
    opts = options()
    try:
        return cupy._core.core.compile_with_cache(source(family), opts,
                                                  prepend_cupy_headers=False)
    except cupy.cuda.compiler.CompileException as error:
        cc = cupy.cuda.Device().compute_capability
        raise KernelCompileError(family.file, f"sm_{cc}", opts, str(error)) from None


_MODULES: dict = {}      # (context key, family) -> Module
_FUNCTIONS: dict = {}    # (context key, entry) -> Function
_LOADING = threading.RLock()     # loads and forgets of the two caches, one thread at a time
#: Driver errors that mean a handle belongs to a context that is gone.
_STALE_HANDLE_ERRORS = (201, 400, 709)   # INVALID_CONTEXT, INVALID_HANDLE, CONTEXT_IS_DESTROYED


def _context() -> int:
    """The current CUDA context, made current first if this thread has none
    (cudaSetDevice binds the device's primary context)."""
    cuda = devices.cupy_module().cuda
    context = cuda.driver.ctxGetCurrent()
    if context == 0:
        cuda.runtime.setDevice(cuda.runtime.getDevice())
        context = cuda.driver.ctxGetCurrent()
    return context


def _driver_function(name: str, argtypes: tuple):
    """The driver's entry point ``name`` (ctypes), or None where there is no
    driver or it is too old to have it."""
    try:
        function = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


@functools.lru_cache(maxsize=None)
def _cu_ctx_get_id():
    """The driver's ``cuCtxGetId`` (CUDA 12.0+), or None. A reset primary
    context can come back under the same handle with a new id, so (handle, id)
    names one context for the process's lifetime."""
    return _driver_function("cuCtxGetId", (ctypes.c_void_p, ctypes.c_void_p))


@functools.lru_cache(maxsize=None)
def cu_launch_kernel_ex():
    """The driver's ``cuLaunchKernelEx`` (CUDA 12.0+), or None: CuPy has no
    binding for a launch with attributes."""
    return _driver_function("cuLaunchKernelEx", (ctypes.c_void_p,) * 4)


#: Programmatic dependent launch: the CUDA driver that captures it into graphs
#: (12.3) and the first device that has it (sm_90).
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


class _ProgrammaticLaunch:
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
    costs a little more. Measured on the H200 in CUDA-graph replay, per call:
    the SWA, global top-k and short-context rows at 1-64 decode tokens
    0.35-0.45 us faster in a chain of the library's calls, each op 0.1-0.25 us
    slower after a torch kernel. So it is off unless the environment sets
    ``DSV4_CUPY_PDL=1``.
    """
    previous, _ProgrammaticLaunch.enabled = _ProgrammaticLaunch.enabled, bool(enabled)
    return previous


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


class ContextId(threading.local):
    """Reads a live context's id (0 where the driver cannot say) into storage
    of the calling thread's own (ctypes releases the GIL during the call)."""

    def __init__(self):
        self._read = _cu_ctx_get_id()
        self._value = np.zeros(1, np.uint64)
        self._address = self._value.ctypes.data

    def __call__(self, context: int) -> int:
        if self._read is None or self._read(context, self._address) != 0:
            return 0
        return int(self._value[0])


_READ_ID = ContextId()


def context_key(context: int) -> tuple[int, int]:
    """(handle, id) of the live context ``context``: what loaded handles belong to."""
    return context, _READ_ID(context)


def get(family: KernelFamily, entry: str, context: tuple | None = None):
    """The compiled entry point ``entry`` of ``family`` in the current context
    (``context``: its ``context_key``)."""
    context = context_key(_context()) if context is None else context
    key = (context, entry)
    function = _FUNCTIONS.get(key)
    if function is not None:
        return function
    with _LOADING:
        function = _FUNCTIONS.get(key)
        if function is None:
            module = _MODULES.get((context, family))
            if module is None:
                for replaced in {k[0] for k in _MODULES
                                 if k[0][0] == context[0] and k[0] != context}:
                    forget_context(replaced)    # the same handle, an older (reset) context
                module = _MODULES[(context, family)] = _load(family)
            function = _FUNCTIONS[key] = module.get_function(entry)
        return function


def forget_context(context: tuple) -> None:
    """Drop every module and function loaded into ``context`` (gone or reset). Its
    modules died with it, so they are not unloaded again (an invalid handle)."""
    with _LOADING:
        for key in [key for key in _FUNCTIONS if key[0] == context]:
            del _FUNCTIONS[key]
        for key in [key for key in _MODULES if key[0] == context]:
            _MODULES.pop(key).ptr = 0


def compile_for(family: KernelFamily, arch: str) -> bytes:
    """A cubin of ``family`` for ``arch`` (e.g. ``"sm_100"``), no GPU needed."""
    return compile_source(source(family), family.file, arch)


def compile_source(text: str, file: str, arch: str) -> bytes:
    """A cubin of ``text`` (named ``kernels/<file>`` in messages) for ``arch``.

    Uses NVRTC through CuPy with the same options as the run-time path plus the
    ones CuPy adds itself (``-ftz=true``, ``--device-as-default-execution-space``).
    """
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise ValueError(f"arch: expected a name like 'sm_90' or 'sm_100a', got {arch!r}")
    devices.nvrtc_version()
    nvrtc = devices.cupy_module().cuda.nvrtc
    opts = options() + ("-ftz=true", "--device-as-default-execution-space", f"-arch={arch}")
    program = nvrtc.createProgram(text, f"kernels/{file}", [], [])
    try:
        try:
            nvrtc.compileProgram(program, list(opts))
        except nvrtc.NVRTCError:
            raise KernelCompileError(file, arch, opts,
                                     nvrtc.getProgramLog(program)) from None
        return nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)


class LaunchPlan:
    """One launch of one entry point with every struct field fixed: packed once
    into storage the plan owns (the driver copies it at each call, so threads
    can share a plan), the function and the context it belongs to.

    ``run(stream)`` is the whole host cost of a repeated launch: a check that
    the plan's context is current (else it is made current for the launch and
    the caller's device restored) and is still the one the plan was made in
    (a reset can give a new context the old handle: the ids differ), and
    ``cuLaunchKernel``, or ``cuLaunchKernelEx`` with a launch configuration
    made once per stream for a programmatic launch. It returns False, having
    launched nothing, when the device's context is no longer the plan's; the
    caller then takes its full path and makes a new plan.
    """

    __slots__ = ("function", "device", "context", "context_id", "blocks", "threads", "storage",
                 "pointers", "kernel_params", "programmatic", "_configs", "_read_id", "_cuda",
                 "_kernel")
    #: Streams whose launch configurations a plan keeps (then it starts again).
    MAX_STREAMS = 8

    def __init__(self, family: KernelFamily, entry: str, device: int, blocks: int,
                 fields: dict, threads: int = THREADS):
        self._cuda = devices.cupy_module().cuda
        self.storage = np.zeros(family.params.size, np.uint8)
        family.params.pack_into(self.storage, **fields)
        self.pointers = np.array([self.storage.ctypes.data], np.uint64)  # void* kernelParams[1]
        self.kernel_params = self.pointers.ctypes.data
        self.device, self.blocks, self.threads = device, blocks, threads
        self.programmatic = programmatic_launch_supported(device)
        self._configs: dict = {}    # stream -> (its CUlaunchConfig, the config's address)
        self._read_id = _READ_ID
        with self._cuda.Device(device):
            self.context = _context()
            self.context_id = self._read_id(self.context)
            # The Function object keeps its module loaded for as long as the plan lives.
            self._kernel = get(family, entry, (self.context, self.context_id))
            self.function = self._kernel.ptr

    def run(self, stream: int) -> bool:
        cuda = self._cuda
        if cuda.driver.ctxGetCurrent() == self.context:
            return self._launch(stream)
        with cuda.Device(self.device):
            if _context() != self.context:
                return False
            return self._launch(stream)

    def _launch(self, stream: int) -> bool:
        if self._read_id(self.context) != self.context_id:
            return False
        driver = self._cuda.driver
        try:
            if self.programmatic and _ProgrammaticLaunch.enabled:
                config = self._config(stream)   # held: another thread may drop the cache
                status = cu_launch_kernel_ex()(config[1], self.function, self.kernel_params,
                                                None)
                if status != 0:
                    raise driver.CUDADriverError(status)
            else:
                driver.launchKernel(self.function, self.blocks, 1, 1, self.threads, 1, 1, 0,
                                    stream, self.kernel_params, 0)
        except driver.CUDADriverError as error:
            if error.status not in _STALE_HANDLE_ERRORS:
                raise
            forget_context((self.context, self.context_id))
            return False
        return True

    def _config(self, stream: int) -> tuple:
        """The plan's launch configuration on ``stream`` and its address."""
        config = self._configs.get(stream)
        if config is None:
            if len(self._configs) >= self.MAX_STREAMS:
                self._configs = {}
            array = launch_config(self.blocks, self.threads, stream)
            config = self._configs[stream] = (array, array.ctypes.data)
        return config


class PlanCache:
    """Prepared launches by argument key, at most ``capacity`` (the oldest goes first)."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._plans: dict = {}

    def get(self, key):
        return self._plans.get(key)

    def put(self, key, plan) -> None:
        if len(self._plans) >= self.capacity:
            self._plans.pop(next(iter(self._plans)), None)   # another thread may have too
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()

