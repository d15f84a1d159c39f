"""Array kinds: numpy, cupy and torch (CPU or CUDA) behind one set of calls.

What kind an array is, on which device, with which dtype, shape, strides and
address (``probe``: attribute reads only, no device memory), and arrays of a
kind made or exported (``empty``, ``full_like_kind``, ``to_torch``). cupy and
torch are imported only when an array of theirs shows up.
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np

from .device import require_gpu

NUMPY, TORCH_CPU, CUPY, TORCH_CUDA = "numpy", "torch_cpu", "cupy", "torch_cuda"
GPU_KINDS = (CUPY, TORCH_CUDA)
HOST_KINDS = (NUMPY, TORCH_CPU)
INT32 = np.dtype(np.int32)
#: The largest int32 value (kernels' int32 indices and counts stay within it).
INT32_MAX = int(np.iinfo(INT32).max)
INT64 = np.dtype(np.int64)
#: The largest int64 value (the host planners' integers).
INT64_MAX = int(np.iinfo(INT64).max)
BOOL = np.dtype(np.bool_)
#: Bytes (fp8 values, cache pages) and 16-bit words (bf16 values, as their bits).
UINT8, UINT16 = np.dtype(np.uint8), np.dtype(np.uint16)
KIND_TEXT = {NUMPY: "a numpy array", TORCH_CPU: "a torch CPU tensor",
             CUPY: "a cupy array", TORCH_CUDA: "a torch CUDA tensor"}


class Operand(NamedTuple):
    """One array argument, probed once: everything the checks and the launch need."""

    name: str
    array: Any
    kind: str
    device: int          # CUDA device index, -1 for host memory
    dtype: Any           # np.dtype, or the name of a dtype this library never takes
    shape: tuple
    strides: tuple       # in elements
    ptr: int             # address of the first element


TORCH_FAMILY, CUPY_FAMILY = "torch", "cupy"
FAMILY_OF_TYPE: dict = {np.ndarray: NUMPY}
_TORCH_TO_NUMPY: dict = {}


def loaded_torch():
    """The torch module if something imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def family_of(x) -> str | None:
    """``NUMPY``, ``TORCH_FAMILY`` or ``CUPY_FAMILY`` (memoised by type); None otherwise."""
    family = FAMILY_OF_TYPE.get(type(x))
    if family is None:
        module = type(x).__module__
        cupy, torch = sys.modules.get("cupy"), loaded_torch()
        if isinstance(x, np.ndarray):
            family = NUMPY
        elif module.startswith("cupy") and cupy is not None and isinstance(x, cupy.ndarray):
            family = CUPY_FAMILY
        elif module.startswith("torch") and torch is not None and isinstance(x, torch.Tensor):
            family = TORCH_FAMILY
        else:
            return None
        FAMILY_OF_TYPE[type(x)] = family
    return family


def _torch_dtype(dtype):
    found = _TORCH_TO_NUMPY.get(dtype)
    if found is None:
        torch = loaded_torch()
        _TORCH_TO_NUMPY.update({torch.int32: INT32, torch.int64: INT64,
                                torch.int16: np.dtype(np.int16), torch.int8: np.dtype(np.int8),
                                torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_),
                                torch.float16: np.dtype(np.float16),
                                torch.float32: np.dtype(np.float32),
                                torch.float64: np.dtype(np.float64), torch.uint16: UINT16})
        found = _TORCH_TO_NUMPY.get(dtype, str(dtype).replace("torch.", ""))
    return found


def probe(name: str, x) -> Operand | None:
    """Read kind, device, dtype, shape, strides and address of ``x`` (None stays None)."""
    if x is None:
        return None
    family = family_of(x)
    if family is TORCH_FAMILY:
        # torch.Size is a tuple already.
        if x.is_cuda:
            return Operand(name, x, TORCH_CUDA, x.get_device(), _torch_dtype(x.dtype), x.shape,
                           x.stride(), x.data_ptr())
        return Operand(name, x, TORCH_CPU, -1, _torch_dtype(x.dtype), x.shape, x.stride(),
                       x.data_ptr())
    if family is CUPY_FAMILY:
        return Operand(name, x, CUPY, x.data.device_id, x.dtype, x.shape,
                       _element_strides(x.strides, x.itemsize), x.data.ptr)
    if family is NUMPY:
        return Operand(name, x, NUMPY, -1, x.dtype, x.shape,
                       _element_strides(x.strides, x.itemsize), x.__array_interface__["data"][0])
    raise TypeError(f"{name}: expected a numpy, cupy or torch array, got {type(x).__name__}")


def _element_strides(byte_strides: tuple, itemsize: int) -> tuple:
    """Strides in elements; None for a byte stride that is not a whole number of
    elements (``check`` refuses it: a kernel would read the wrong elements)."""
    return tuple(s // itemsize if s % itemsize == 0 else None for s in byte_strides)


def kind_of(x) -> str | None:
    """The kind of ``x``, or None when it is not an array this library takes."""
    family = family_of(x)
    if family is TORCH_FAMILY:
        return TORCH_CUDA if x.is_cuda else TORCH_CPU
    return CUPY if family is CUPY_FAMILY else family


def describe(x) -> str:
    """'a torch CUDA tensor on cuda:0' and the like, for error messages."""
    op = probe("x", x) if family_of(x) else None
    if op is None:
        return type(x).__name__
    text = KIND_TEXT[op.kind]
    return text + (f" on cuda:{op.device}" if op.device >= 0 else "")


def device_of(x, kind: str) -> int:
    """CUDA device index, or -1 for host memory."""
    if kind == CUPY:
        return x.data.device_id
    if kind == TORCH_CUDA:
        return x.get_device()
    return -1


def _to_torch_dtype(dtype: np.dtype):
    torch = loaded_torch()
    return {INT32: torch.int32, INT64: torch.int64, BOOL: torch.bool, UINT8: torch.uint8,
            UINT16: torch.uint16}[np.dtype(dtype)]


#: Floating dtypes some arrays hold that the kernels take as bits: bf16 as
#: uint16, fp8 e4m3fn as uint8 (numpy and cupy know them through ml_dtypes).
_BITS_OF = {"bfloat16": (UINT16, "uint16"), "float8_e4m3fn": (UINT8, "uint8")}


def as_bits(x):
    """A bf16 or fp8 e4m3fn array as a view of its bits (uint16 or uint8) of
    the same kind; other arrays and None pass through."""
    if x is None:
        return x
    family = family_of(x)
    if family is TORCH_FAMILY:
        name = str(x.dtype).replace("torch.", "")
        return x.view(getattr(loaded_torch(), _BITS_OF[name][1])) if name in _BITS_OF else x
    if family is None:
        return x
    name = x.dtype.name
    return x.view(_BITS_OF[name][0]) if name in _BITS_OF else x


def probe_all(arrays: dict) -> tuple[str, int, dict]:
    """Probe every array (name -> array or None); all must share one kind and device.

    Returns ``(kind, device, {name: Operand or None})``. Mixed kinds or devices
    are an error: a silent copy would hide a sync.
    """
    ops = {}
    first = None
    for name, x in arrays.items():
        op = ops[name] = probe(name, x)
        if op is None:
            continue
        if first is None:
            first = op
        elif op.kind != first.kind or op.device != first.device:
            raise TypeError(f"{name}: expected {describe(first.array)} like {first.name}, "
                            f"got {describe(x)}; all arrays of one call must share kind and device")
    if first is None:
        raise TypeError("expected at least one array argument")
    return first.kind, first.device, ops



def stack_columns(columns: list):
    """``[N]`` arrays of one kind stacked as the columns of ``[N, len(columns)]``."""
    kind = kind_of(columns[0])
    if kind in (TORCH_CPU, TORCH_CUDA):
        return loaded_torch().stack(columns, dim=-1)
    if kind == CUPY:
        import cupy
        return cupy.stack(columns, axis=-1)
    return np.stack(columns, axis=-1)


def empty(kind: str, device: int, shape: tuple, dtype) -> object:
    """An uninitialised array of ``kind`` on ``device`` (torch allocates for torch,
    so CUDA-graph captures get torch's graph-private pool)."""
    if kind == NUMPY:
        return np.empty(shape, dtype)
    if kind == CUPY:
        import cupy
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype)
    torch = loaded_torch()
    dev = torch.device("cuda", device) if kind == TORCH_CUDA else torch.device("cpu")
    return torch.empty(shape, dtype=_to_torch_dtype(dtype), device=dev)


def full_like_kind(like, shape: tuple, dtype, value: int, device: int | None = None):
    """A ``value``-filled array of the kind ``like`` names: "numpy", "cupy",
    "torch" (CUDA when available, else CPU), or an array whose kind and device
    to follow. ``device`` None or -1 means the current one."""
    kind, device = _kind_and_device(like, device)
    return _filled(empty(kind, device, shape, dtype), kind, value)


#: A block's buffers start at offsets that are multiples of this many bytes
#: (any kernel's widest vector is 16), with at least this many unused bytes
#: before and after each: the tests poison them, so that a write past a
#: buffer's end shows.
BLOCK_ALIGNMENT = 256


def full_block_like_kind(like, buffers: dict, device: int | None = None) -> dict:
    """Buffers ``{name: (shape, dtype, value)}`` as ``value``-filled views of
    one allocation of the kind ``like`` names (as ``full_like_kind``), apart
    by ``BLOCK_ALIGNMENT``: torch's views of it share one version counter, so
    a builder watches all its result views with one read
    (``keys.owned_state_reader``)."""
    kind, device = _kind_and_device(like, device)
    places, end = {}, 0
    for name, (shape, dtype, _) in buffers.items():
        start = -(-(end + BLOCK_ALIGNMENT) // BLOCK_ALIGNMENT) * BLOCK_ALIGNMENT
        end = start + int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        places[name] = (start, end)
    block = empty(kind, device, (end + BLOCK_ALIGNMENT,), UINT8)
    out = {}
    for name, (shape, dtype, value) in buffers.items():
        start, stop = places[name]
        piece = block[start:stop]
        if kind in (TORCH_CPU, TORCH_CUDA):
            view = piece.view(_to_torch_dtype(np.dtype(dtype))).view(shape)
        else:
            view = piece.view(dtype).reshape(shape)
        out[name] = _filled(view, kind, value)
    return out


def _kind_and_device(like, device: int | None) -> tuple[str, int]:
    """The kind and device ``full_like_kind`` allocates on (``device`` -1: host)."""
    kind = kind_of(like)
    if kind is not None:
        device = device_of(like, kind)
    elif like in ("numpy", "cupy"):
        kind = like
    elif like == "torch":
        kind = TORCH_CUDA if require_torch().cuda.is_available() else TORCH_CPU
    else:
        raise ValueError(f"like: expected 'numpy', 'cupy', 'torch' or an array, got {like!r}")
    if device is None or device < 0:
        device = -1
        if kind == CUPY:
            device = require_gpu().id
        elif kind == TORCH_CUDA:
            device = loaded_torch().cuda.current_device()
    return kind, device


def _filled(array, kind: str, value: int):
    if kind in (TORCH_CPU, TORCH_CUDA):
        array.fill_(value)
    else:
        array.fill(value)
    return array


def require_torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("torch is not installed: pip install 'dsv4_cupy[torch]'") from None
    return torch


def to_torch(x):
    """Export an array to torch without a copy (DLPack; torch passes through)."""
    torch = require_torch()
    kind = kind_of(x)
    if kind in (TORCH_CPU, TORCH_CUDA):
        return x
    if kind == NUMPY:
        return torch.from_numpy(x)
    if kind == CUPY:
        return torch.from_dlpack(x)
    raise TypeError(f"x: expected a numpy, cupy or torch array, got {type(x).__name__}")

