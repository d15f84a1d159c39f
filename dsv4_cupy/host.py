"""Host views: numpy views of host arrays as the numba kernels take them, and
host copies of device arrays (the one place that syncs: ``validate="full"``)."""
from __future__ import annotations

import numpy as np

from .kinds import CUPY, GPU_KINDS, NUMPY


def host_copy(x, kind: str) -> np.ndarray:
    """A numpy copy of device memory (a sync), or a view of host memory."""
    if kind in GPU_KINDS:
        return x.get() if kind == CUPY else x.cpu().numpy()
    return host_view(x, kind)


class _WritableAlias:
    """An ``__array_interface__`` that exports read-only memory as writable."""

    def __init__(self, array: np.ndarray):
        interface = dict(array.__array_interface__)
        interface["data"] = (interface["data"][0], False)
        self.__array_interface__ = interface
        self.owner = array


def kernel_view(x, kind: str) -> np.ndarray:
    """A checked 1-D host array as the numba kernels take it: contiguous and
    writable (a read-only input is aliased, never written), so every call hits
    a signature that ``warmup()`` compiled."""
    view = host_view(x, kind)
    return view if view.flags.writeable else np.asarray(_WritableAlias(view))


def kernel_view_flat(x, kind: str) -> np.ndarray:
    """A checked n-D host array (last axis contiguous, any other strides) as the
    numba kernels take it: the flat 1-D view from its first element to its
    last, writable (a read-only input is aliased, never written); element
    ``[i, j, k]`` is ``flat[i * s0 + j * s1 + k]`` (strides in elements)."""
    view = host_view(x, kind)
    if not view.flags.writeable:
        view = np.asarray(_WritableAlias(view))
    itemsize = view.itemsize
    length = 0 if 0 in view.shape else 1 + sum((n - 1) * s // itemsize
                                               for n, s in zip(view.shape, view.strides))
    return np.lib.stride_tricks.as_strided(view, shape=(length,), strides=(itemsize,))


def host_view(x, kind: str) -> np.ndarray:
    """A numpy view of host memory (torch CPU zero-copy, without autograd)."""
    return x if kind == NUMPY else x.detach().numpy()


