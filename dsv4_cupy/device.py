"""The bottom of the GPU stack: is there CuPy, a device, NVRTC; device facts.

Nothing here compiles or launches (``loader`` does); everything that only
needs to know about the machine asks here, so no module has to import the
loader for it.
"""
from __future__ import annotations

import ctypes

from .errors import NoGPUError, NVRTCMissingError


def cupy_module():
    """The ``cupy`` module; ``NoGPUError`` saying what to install when it is missing."""
    try:
        import cupy
    except ImportError:
        raise NoGPUError("cupy is not installed: pip install 'dsv4_cupy[cuda13]' "
                         "(or [cuda12] for a CUDA 12 driver)") from None
    return cupy


def require_gpu():
    """CuPy's current device; ``NoGPUError`` saying what is missing otherwise."""
    cupy = cupy_module()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError
        # With no driver at all the runtime reports an "insufficient" driver
        # (35) or no device (100): say what is missing, not that it is old.
        detail = "" if getattr(error, "status", None) in (35, 100) else f" ({error})"
        raise NoGPUError(f"no usable CUDA device: no GPU or no NVIDIA driver was found"
                         f"{detail}; numpy and torch CPU arrays run on the CPU path") from None
    if count == 0:
        raise NoGPUError("no usable CUDA device: the driver sees no GPU; numpy and torch CPU "
                         "arrays run on the CPU path")
    return cupy.cuda.Device()


def has_gpu() -> bool:
    try:
        require_gpu()
    except NoGPUError:
        return False
    return True


def nvrtc_version() -> tuple[int, int]:
    cupy = cupy_module()
    try:
        return tuple(cupy.cuda.nvrtc.getVersion())
    except Exception as error:
        raise NVRTCMissingError(
            f"NVRTC could not be loaded ({error}); install it from PyPI: "
            "pip install 'nvidia-cuda-nvrtc==13.0.*' for cupy-cuda13x, or "
            "'nvidia-cuda-nvrtc-cu12==12.9.*' for cupy-cuda12x (the cuda13/cuda12 extras do)") from None


_SM_COUNT: dict = {}


def sm_count(device: int) -> int:
    count = _SM_COUNT.get(device)
    if count is None:
        count = _SM_COUNT[device] = cupy_module().cuda.Device(device).attributes[
            "MultiProcessorCount"]
    return count


def driver_function(name: str, argtypes: tuple, *, releases_gil: bool = True):
    """The CUDA driver's entry point ``name`` (ctypes, returning its status),
    or None where there is no driver or it is too old to have it: for what
    CuPy has no binding of. ``releases_gil=False`` for a query that returns at
    once: the call skips ctypes' release and take of the GIL."""
    library = ctypes.CDLL if releases_gil else ctypes.PyDLL
    try:
        function = getattr(library("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function
