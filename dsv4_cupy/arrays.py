"""The array-kind adapter: numpy, cupy and torch (CPU or CUDA) behind one set of calls.

Every public op goes through here to learn what kind of arrays it got, to check
them (kind, device, dtype, rank, length, layout, aliasing) with errors that name
the argument, to allocate outputs of the same kind, and to turn arrays into
launch arguments. Nothing here reads device memory, so no check costs a sync.
cupy and torch are imported only when an array of theirs shows up.
"""
from __future__ import annotations

import operator
import sys

import numpy as np

NUMPY, TORCH_CPU, CUPY, TORCH_CUDA = "numpy", "torch_cpu", "cupy", "torch_cuda"
GPU_KINDS = (CUPY, TORCH_CUDA)
INT32 = np.dtype(np.int32)
INT64 = np.dtype(np.int64)
_KIND_TEXT = {NUMPY: "a numpy array", TORCH_CPU: "a torch CPU tensor",
              CUPY: "a cupy array", TORCH_CUDA: "a torch CUDA tensor"}


def _torch():
    return sys.modules.get("torch")


def kind_of(x) -> str | None:
    """The kind of ``x``, or None when it is not an array this library takes."""
    if isinstance(x, np.ndarray):
        return NUMPY
    module = type(x).__module__
    if module.startswith("cupy"):
        cp = sys.modules.get("cupy")
        if cp is not None and isinstance(x, cp.ndarray):
            return CUPY
    elif module.startswith("torch"):
        torch = _torch()
        if torch is not None and isinstance(x, torch.Tensor):
            return TORCH_CUDA if x.is_cuda else TORCH_CPU
    return None


def describe(x) -> str:
    kind = kind_of(x)
    if kind is None:
        return type(x).__name__
    text = _KIND_TEXT[kind]
    if kind in GPU_KINDS:
        text += f" on cuda:{device_of(x, kind)}"
    return text


def device_of(x, kind: str) -> int:
    """CUDA device index, or -1 for host memory."""
    if kind == CUPY:
        return x.device.id
    if kind == TORCH_CUDA:
        return x.get_device()
    return -1


_TORCH_TO_NUMPY: dict = {}


def dtype_of(x, kind: str) -> np.dtype:
    if kind in (NUMPY, CUPY):
        return x.dtype
    dt = _TORCH_TO_NUMPY.get(x.dtype)
    if dt is None:
        torch = _torch()
        table = {torch.int32: INT32, torch.int64: INT64, torch.int16: np.dtype(np.int16),
                 torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8),
                 torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                 torch.float16: np.dtype(np.float16), torch.bool: np.dtype(np.bool_)}
        _TORCH_TO_NUMPY.update(table)
        dt = table.get(x.dtype)
        if dt is None:
            return str(x.dtype).replace("torch.", "")  # an unsupported dtype, shown by name
    return dt


def _to_torch_dtype(dtype: np.dtype):
    torch = _torch()
    return {INT32: torch.int32, INT64: torch.int64}[np.dtype(dtype)]


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int in ``[minimum, maximum]``; bools and floats are refused."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected an int <= {maximum}, got {value}")
    return value


def common_kind(arrays: dict) -> tuple[str, int]:
    """The one kind and device shared by all non-None ``arrays`` (name -> array).

    Mixed kinds or devices are an error: a silent copy would hide a sync.
    """
    kind = device = first = None
    for name, x in arrays.items():
        if x is None:
            continue
        k = kind_of(x)
        if k is None:
            raise TypeError(f"{name}: expected a numpy, cupy or torch array, got {type(x).__name__}")
        d = device_of(x, k)
        if kind is None:
            kind, device, first = k, d, name
        elif k != kind or d != device:
            raise TypeError(f"{name}: expected {describe(arrays[first])} like {first}, "
                            f"got {describe(x)}; all arrays of one call must share kind and device")
    if kind is None:
        raise TypeError("expected at least one array argument")
    return kind, device


def check(name: str, x, kind: str, dtypes: tuple, ndim: int, min_len: int | None = None,
          min_cols: int | None = None) -> np.dtype:
    """Check one array that ``common_kind`` already matched; returns its numpy dtype.

    1-D arrays must be contiguous; 2-D arrays need contiguous rows and may have
    any row stride (so slices of persistent buffers are taken as they are).
    """
    dt = dtype_of(x, kind)
    if dt not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {dt}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(x.shape)}")
    if min_len is not None and x.shape[0] < min_len:
        raise ValueError(f"{name}: expected at least {min_len} rows, got shape {tuple(x.shape)}")
    if min_cols is not None and x.shape[1] < min_cols:
        raise ValueError(f"{name}: expected at least {min_cols} columns, got shape {tuple(x.shape)}")
    if not _rows_contiguous(x, kind, ndim, dt.itemsize):
        raise ValueError(f"{name}: expected a C-contiguous array (2-D: contiguous rows, any row "
                         f"stride), got strides {_strides(x, kind, dt.itemsize)} (elements); "
                         f"pass a contiguous copy")
    return dt


def _numel(x, kind: str) -> int:
    return x.numel() if kind in (TORCH_CPU, TORCH_CUDA) else x.size


def _strides(x, kind: str, itemsize: int) -> tuple:
    if kind in (TORCH_CPU, TORCH_CUDA):
        return tuple(x.stride())
    return tuple(s // itemsize for s in x.strides)


def _rows_contiguous(x, kind: str, ndim: int, itemsize: int) -> bool:
    if _numel(x, kind) == 0:
        return True
    strides = _strides(x, kind, itemsize)
    if ndim == 1:
        return x.shape[0] <= 1 or strides[0] == 1
    rows, cols = x.shape
    return (cols <= 1 or strides[1] == 1) and (rows <= 1 or strides[0] >= cols)


def row_stride(x, kind: str) -> int:
    """Elements between rows of a 2-D array (at least its width: a one-row view
    may report any stride)."""
    stride = x.stride(0) if kind in (TORCH_CPU, TORCH_CUDA) else x.strides[0] // x.itemsize
    return stride if x.shape[0] > 1 else max(stride, x.shape[1])


def data_ptr(x, kind: str) -> int:
    if kind in (TORCH_CPU, TORCH_CUDA):
        return x.data_ptr()
    if kind == CUPY:
        return x.data.ptr
    return x.__array_interface__["data"][0]


def _span(x, kind: str) -> tuple[int, int]:
    """Byte range [start, end) that ``x`` can touch."""
    start = data_ptr(x, kind)
    if _numel(x, kind) == 0:
        return start, start
    itemsize = dtype_of(x, kind).itemsize
    strides = _strides(x, kind, itemsize)
    last = sum((n - 1) * s for n, s in zip(x.shape, strides))
    return start, start + (last + 1) * itemsize


def check_no_alias(kind: str, outputs: dict, inputs: dict) -> None:
    """Outputs must not overlap inputs or each other (a kernel would read what it wrote)."""
    spans = [(name, _span(x, kind)) for name, x in inputs.items() if x is not None]
    for name, x in outputs.items():
        if x is None:
            continue
        lo, hi = _span(x, kind)
        for other, (olo, ohi) in spans:
            if lo < ohi and olo < hi:
                raise ValueError(f"{name}: output memory overlaps {other}; "
                                 f"pass separate buffers for outputs and inputs")
        spans.append((name, (lo, hi)))


def host_view(x, kind: str) -> np.ndarray:
    """A numpy view of host memory (torch CPU through DLPack, zero-copy)."""
    return x if kind == NUMPY else np.from_dlpack(x)


def empty(kind: str, device: int, shape: tuple, dtype) -> object:
    """An uninitialised array of ``kind`` on ``device`` (torch allocates for torch,
    so CUDA-graph captures get torch's graph-private pool)."""
    if kind == NUMPY:
        return np.empty(shape, dtype)
    if kind == CUPY:
        import cupy
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype)
    torch = _torch()
    dev = torch.device("cuda", device) if kind == TORCH_CUDA else torch.device("cpu")
    return torch.empty(shape, dtype=_to_torch_dtype(dtype), device=dev)


def full_like_kind(like: str, shape: tuple, dtype, value: int, device: int | None = None):
    """A ``value``-filled array of a kind named as in ``DeepseekV4MetadataBuilder(like=...)``
    ("torch" is CUDA when available); ``device`` None or -1 means the current one."""
    if like not in ("numpy", "cupy", "torch"):
        raise ValueError(f"like: expected 'numpy', 'cupy' or 'torch', got {like!r}")
    if device is not None and device < 0:
        device = None
    if like == "numpy":
        return np.full(shape, value, dtype)
    if like == "cupy":
        import cupy
        from .kernels import require_gpu
        require_gpu()
        with cupy.cuda.Device(device):
            return cupy.full(shape, value, dtype)
    torch = _require_torch()
    if torch.cuda.is_available():
        target = torch.device("cuda", torch.cuda.current_device() if device is None else device)
    else:
        target = torch.device("cpu")
    return torch.full(shape, value, dtype=_to_torch_dtype(dtype), device=target)


def _require_torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("torch is not installed: pip install 'dsv4_cupy[torch]'") from None
    return torch


_STREAMS: dict = {}


def launch_stream(kind: str, device: int):
    """The stream a launch must go on: CuPy's current stream for cupy (None),
    torch's current stream (wrapped once per handle) for torch, so launches
    follow ``torch.cuda.stream(...)`` and ``torch.cuda.graph`` captures."""
    if kind != TORCH_CUDA:
        return None
    handle = _torch().cuda.current_stream(device)
    key = (device, handle.cuda_stream)
    stream = _STREAMS.get(key)
    if stream is None:
        import cupy
        with cupy.cuda.Device(device):
            stream = cupy.cuda.Stream.from_external(handle)
        _STREAMS[key] = stream
    return stream


def kernel_arg(x, kind: str):
    """A pointer argument: cupy arrays pass themselves, torch passes data_ptr()
    (an int64 has pointer size; ~30x cheaper than a DLPack round trip)."""
    return x if kind == CUPY else x.data_ptr()


def to_torch(x):
    """Export an array to torch without a copy (DLPack; torch passes through)."""
    torch = _require_torch()
    kind = kind_of(x)
    if kind in (TORCH_CPU, TORCH_CUDA):
        return x
    if kind == NUMPY:
        return torch.from_numpy(x)
    if kind == CUPY:
        return torch.from_dlpack(x)
    raise TypeError(f"x: expected a numpy, cupy or torch array, got {type(x).__name__}")


def output(name: str, out, kind: str, device: int, dtype: np.dtype, rows: int,
           cols: int | None = None):
    """``out`` checked to hold ``rows`` (x ``cols``) of ``dtype``, or a new array."""
    if out is None:
        return empty(kind, device, (rows,) if cols is None else (rows, cols), dtype)
    check(name, out, kind, (dtype,), 1 if cols is None else 2, min_len=rows, min_cols=cols)
    return out
