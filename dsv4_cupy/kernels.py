"""The one place that finds, prepares and compiles the CUDA kernels.

* ``kernels/*.cu`` are read from the installed package (``dsv4_cupy/kernels_cu``)
  or, in a source checkout, from the top-level ``kernels/`` folder.
* Local ``#include "x.cuh"`` lines are inlined and the file starts with
  ``#line 1 "kernels/<file>.cu"``, so compiler messages point at the real file.
* A hash of all kernel sources goes into the options: CuPy's disk cache key
  ignores included files, and a stale cubin must never be reused.
* Modules are compiled once per device through ``cupy.memoize(for_each_device=True)``
  and cached on disk by CuPy (``CUPY_CACHE_DIR``), so only the first use in a
  fresh environment compiles; ``warmup()`` does that before serving.
* ``compile_for(file, arch)`` builds a cubin for any arch without a GPU
  (NVRTC from PyPI), for CI and ``python -m dsv4_cupy compile``.
"""
from __future__ import annotations

import functools
import hashlib
import re
import threading
from pathlib import Path

import numpy as np

from .errors import KernelCompileError, NoGPUError, NVRTCMissingError

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)
_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(')
_DTYPE_ENTRIES = re.compile(r"^DSV4_DTYPE_ENTRIES\((\w+),", re.M)
_DEFINE = re.compile(r"^\s*#\s*define(?:[^\n]*\\\n)*[^\n]*", re.M)
#: Options beyond CuPy's own (which adds -arch, -ftz, its include paths).
BASE_OPTIONS = ("-std=c++17",)
DEFAULT_ARCHS = ("sm_90", "sm_100")


def kernel_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels_cu", here.parent / "kernels"):
        if any(candidate.glob("*.cu")):
            return candidate
    raise FileNotFoundError(f"no kernel sources found next to {here}")


def kernel_files() -> list[str]:
    return sorted(p.name for p in kernel_dir().glob("*.cu"))


@functools.lru_cache(maxsize=None)
def source(file: str) -> str:
    """The compilable text of ``kernels/<file>``: includes inlined once, #line marks added."""
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


@functools.lru_cache(maxsize=None)
def sources_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(kernel_dir().iterdir()):
        if path.suffix in (".cu", ".cuh"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def options() -> tuple[str, ...]:
    return BASE_OPTIONS + (f"-DDSV4_KERNELS_HASH=0x{sources_hash()}",)


def entry_points(file: str) -> list[str]:
    """The extern "C" kernels a file defines: plain ones, and the four dtype
    variants ``PREFIX_p{32,64}_s{32,64}`` of each ``DSV4_DTYPE_ENTRIES(PREFIX, ...)``."""
    text = _DEFINE.sub("", source(file))
    names = _ENTRY.findall(text)
    for prefix in _DTYPE_ENTRIES.findall(text):
        names += [f"{prefix}_p{p}_s{s}" for p in (32, 64) for s in (32, 64)]
    return sorted(set(names))


def _cupy():
    try:
        import cupy
    except ImportError:
        raise NoGPUError("cupy is not installed: pip install 'dsv4_cupy[cuda13]' "
                         "(or [cuda12] for a CUDA 12 driver)") from None
    return cupy


def require_gpu():
    """CuPy's current device; ``NoGPUError`` saying what is missing otherwise."""
    cupy = _cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError: no driver / insufficient driver
        raise NoGPUError(f"no usable CUDA device ({error}); numpy and torch CPU arrays "
                         "run on the CPU path") from None
    if count == 0:
        raise NoGPUError("no CUDA device; numpy and torch CPU arrays run on the CPU path")
    return cupy.cuda.Device()


def nvrtc_version() -> tuple[int, int]:
    cupy = _cupy()
    try:
        return tuple(cupy.cuda.nvrtc.getVersion())
    except Exception as error:
        raise NVRTCMissingError(
            f"NVRTC could not be loaded ({error}); install it from PyPI: "
            "pip install 'nvidia-cuda-nvrtc==13.0.*' for cupy-cuda13x, or "
            "'nvidia-cuda-nvrtc-cu12==12.9.*' for cupy-cuda12x (the cuda13/cuda12 extras do)") from None


_load_module = None


def _module_loader():
    """``load(file) -> RawModule``, memoized per device by CuPy (built on first use,
    so ``import dsv4_cupy`` needs no cupy)."""
    global _load_module
    if _load_module is None:
        cupy = _cupy()

        @cupy.memoize(for_each_device=True)
        def load(file: str):
            nvrtc_version()
            opts = options()
            module = cupy.RawModule(code=source(file), options=opts)
            try:
                module.compile()
            except cupy.cuda.compiler.CompileException as error:
                cc = cupy.cuda.Device().compute_capability
                raise KernelCompileError(file, f"sm_{cc}", opts, str(error)) from None
            return module

        _load_module = load
    return _load_module


_KERNELS: dict = {}


def get(file: str, name: str, device: int):
    """The compiled kernel ``name`` of ``kernels/<file>``; ``device`` must be current."""
    key = (device, file, name)
    kernel = _KERNELS.get(key)
    if kernel is None:
        # The bare Function of this device: calling it skips RawKernel's
        # per-call lookups (a few microseconds on every launch).
        kernel = _module_loader()(file).get_function(name).kernel
        _KERNELS[key] = kernel
    return kernel


def warmup(*, gpu: bool | None = None, cpu: bool | None = None) -> dict:
    """Compile and load every kernel before serving, so no call compiles.

    ``gpu`` (default: when a GPU is usable) compiles every CUDA entry point for
    the current device; ``cpu`` (default: when no GPU is usable) compiles the
    numba CPU kernels for every accepted dtype. Returns what was prepared.
    """
    if gpu is None:
        try:
            require_gpu()
            gpu = True
        except NoGPUError:
            gpu = False
    if cpu is None:
        cpu = not gpu
    done: dict = {"gpu": [], "cpu": []}
    if gpu:
        device = require_gpu().id
        for file in kernel_files():
            for name in entry_points(file):
                get(file, name, device)
                done["gpu"].append(f"{file}:{name}")
    if cpu:
        from ._warm_cpu import warm_cpu
        done["cpu"] = warm_cpu()
    return done


def compile_for(file: str, arch: str) -> bytes:
    """A cubin of ``kernels/<file>`` for ``arch`` (e.g. ``"sm_100"``), no GPU needed.

    Uses NVRTC through CuPy with the same options as the run-time path plus the
    ones CuPy adds itself (``-ftz=true``, ``--device-as-default-execution-space``).
    """
    if not re.fullmatch(r"sm_\d+[af]?", arch):
        raise ValueError(f"arch: expected a name like 'sm_90' or 'sm_100a', got {arch!r}")
    nvrtc_version()
    cupy = _cupy()
    nvrtc = cupy.cuda.nvrtc
    opts = options() + ("-ftz=true", "--device-as-default-execution-space", f"-arch={arch}")
    program = nvrtc.createProgram(source(file), f"kernels/{file}", [], [])
    try:
        try:
            nvrtc.compileProgram(program, list(opts))
        except nvrtc.NVRTCError:
            raise KernelCompileError(file, arch, opts, nvrtc.getProgramLog(program)) from None
        return nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)


_SM_COUNT: dict = {}
THREADS = 256


def sm_count(device: int) -> int:
    count = _SM_COUNT.get(device)
    if count is None:
        cupy = _cupy()
        count = cupy.cuda.Device(device).attributes["MultiProcessorCount"]
        _SM_COUNT[device] = count
    return count


def elementwise_blocks(n: int) -> int:
    """Blocks of THREADS for a grid-stride loop over n elements."""
    return max(1, min(-(-n // THREADS), 1 << 20))


def row_geometry(num_rows: int, width: int, device: int) -> tuple[int, int]:
    """(columns per block, blocks per row) for C128A rows of ``width`` columns.

    The smallest piece (512..4096 columns; multiples of 512 keep 16-byte stores
    aligned) that keeps the grid within two blocks per SM: a single decode row
    spreads over 16 SMs, larger batches give each thread up to four 16-byte
    stores in flight. Measured on the H200 (W = 8192): 1 token 512, 32 tokens
    1024, 256 tokens and up 4096 were the fastest of the five sizes.
    """
    limit = 2 * sm_count(device)
    width = max(width, 1)
    for per_block in (512, 1024, 2048):
        if num_rows * -(-width // per_block) <= limit:
            return per_block, -(-width // per_block)
    return 4096, -(-width // 4096)


class _LaunchBuffers(threading.local):
    """Per-thread parameter buffers at fixed addresses: cuLaunchKernel copies the
    parameters during the call, so one buffer per layout can serve every launch."""

    def __init__(self):
        self.by_layout: dict = {}
        self.bound_devices: set = set()   # devices whose context this thread has made current

    def get(self, layout) -> tuple:
        found = self.by_layout.get(layout.c_name)
        if found is None:
            storage = np.zeros(layout.size, np.uint8)
            pointers = np.array([storage.ctypes.data], np.uint64)   # void* kernelParams[1]
            found = self.by_layout[layout.c_name] = (storage, pointers, pointers.ctypes.data)
        return found


_BUFFERS = _LaunchBuffers()


def launch(file: str, name: str, device: int, blocks: int, layout, values: tuple,
           stream: int) -> None:
    """Launch ``name`` of ``kernels/<file>`` on ``device`` (THREADS per block) with
    its parameter struct, on the stream handle ``stream``.

    Goes straight to ``cuLaunchKernel``: CuPy's generic argument handling costs
    several microseconds per launch, and the struct is already typed.
    """
    cupy = _cupy()
    if cupy.cuda.runtime.getDevice() != device:
        with cupy.cuda.Device(device):
            return launch(file, name, device, blocks, layout, values, stream)
    if device not in _BUFFERS.bound_devices:
        # cuLaunchKernel needs the device's context current on this thread;
        # cudaSetDevice makes it so (a new thread may not have it yet).
        cupy.cuda.runtime.setDevice(device)
        _BUFFERS.bound_devices.add(device)
    function = get(file, name, device)
    storage, _, kernel_params = _BUFFERS.get(layout)
    layout.pack_into(storage, values)
    cupy.cuda.driver.launchKernel(function.ptr, blocks, 1, 1, THREADS, 1, 1, 0, stream,
                                  kernel_params, 0)
