"""Typed errors, so callers can tell bad input from a missing toolkit or GPU."""
from __future__ import annotations


class Dsv4Error(RuntimeError):
    """Base class of dsv4_cupy's environment errors (bad input raises TypeError/ValueError)."""


class NoGPUError(Dsv4Error):
    """CuPy is missing, or it sees no usable CUDA device."""


class UnsupportedDeviceError(Dsv4Error):
    """The device's compute capability is outside what was asked for (9.x / 10.x)."""


class NVRTCMissingError(Dsv4Error):
    """CuPy cannot load NVRTC, so no kernel can be compiled."""


class KernelCompileError(Dsv4Error):
    """A kernel file failed to compile; the message names the file, arch and options."""

    def __init__(self, file: str, arch: str, options: tuple[str, ...], log: str):
        self.file, self.arch, self.options, self.log = file, arch, tuple(options), log
        super().__init__(f"failed to compile kernels/{file} for {arch} with options "
                         f"{' '.join(self.options)}:\n{log}")
