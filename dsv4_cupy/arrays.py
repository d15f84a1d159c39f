"""The array-kind adapter: numpy, cupy and torch (CPU or CUDA) behind one set of calls.

Every public op goes through here to learn what kind of arrays it got, to check
them (kind, device, dtype, rank, length, layout, aliasing) with errors that name
the argument, to allocate outputs of the same kind, and to turn arrays into
launch arguments. Nothing here reads device memory, so no check costs a sync.
cupy and torch are imported only when an array of theirs shows up.
"""
from __future__ import annotations

import bisect
import math
import sys
from typing import Any, NamedTuple

import numpy as np

from . import params
from .device import require_gpu
from .scalars import check_int

NUMPY, TORCH_CPU, CUPY, TORCH_CUDA = "numpy", "torch_cpu", "cupy", "torch_cuda"
GPU_KINDS = (CUPY, TORCH_CUDA)
INT32 = np.dtype(np.int32)
INT64 = np.dtype(np.int64)
BOOL = np.dtype(np.bool_)
#: Widest row an op writes (columns are 32-bit inside the kernels).
MAX_ROW_WIDTH = 1 << 24
_KIND_TEXT = {NUMPY: "a numpy array", TORCH_CPU: "a torch CPU tensor",
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


_TORCH, _CUPY = "torch", "cupy"
_FAMILY: dict = {np.ndarray: NUMPY}
_TORCH_TO_NUMPY: dict = {}


def _torch():
    return sys.modules.get("torch")


def _family(x) -> str | None:
    family = _FAMILY.get(type(x))
    if family is None:
        module = type(x).__module__
        cupy, torch = sys.modules.get("cupy"), _torch()
        if isinstance(x, np.ndarray):
            family = NUMPY
        elif module.startswith("cupy") and cupy is not None and isinstance(x, cupy.ndarray):
            family = _CUPY
        elif module.startswith("torch") and torch is not None and isinstance(x, torch.Tensor):
            family = _TORCH
        else:
            return None
        _FAMILY[type(x)] = family
    return family


def _torch_dtype(dtype):
    found = _TORCH_TO_NUMPY.get(dtype)
    if found is None:
        torch = _torch()
        _TORCH_TO_NUMPY.update({torch.int32: INT32, torch.int64: INT64,
                                torch.int16: np.dtype(np.int16), torch.int8: np.dtype(np.int8),
                                torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(np.bool_),
                                torch.float16: np.dtype(np.float16),
                                torch.float32: np.dtype(np.float32),
                                torch.float64: np.dtype(np.float64)})
        found = _TORCH_TO_NUMPY.get(dtype, str(dtype).replace("torch.", ""))
    return found


def probe(name: str, x) -> Operand | None:
    """Read kind, device, dtype, shape, strides and address of ``x`` (None stays None)."""
    if x is None:
        return None
    family = _family(x)
    if family is _TORCH:
        # torch.Size is a tuple already.
        if x.is_cuda:
            return Operand(name, x, TORCH_CUDA, x.get_device(), _torch_dtype(x.dtype), x.shape,
                           x.stride(), x.data_ptr())
        return Operand(name, x, TORCH_CPU, -1, _torch_dtype(x.dtype), x.shape, x.stride(),
                       x.data_ptr())
    if family is _CUPY:
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
    family = _family(x)
    if family is _TORCH:
        return TORCH_CUDA if x.is_cuda else TORCH_CPU
    return CUPY if family is _CUPY else family


def describe(x) -> str:
    """'a torch CUDA tensor on cuda:0' and the like, for error messages."""
    op = probe("x", x) if _family(x) else None
    if op is None:
        return type(x).__name__
    text = _KIND_TEXT[op.kind]
    return text + (f" on cuda:{op.device}" if op.device >= 0 else "")


def device_of(x, kind: str) -> int:
    """CUDA device index, or -1 for host memory."""
    if kind == CUPY:
        return x.data.device_id
    if kind == TORCH_CUDA:
        return x.get_device()
    return -1


def _to_torch_dtype(dtype: np.dtype):
    torch = _torch()
    return {INT32: torch.int32, INT64: torch.int64, BOOL: torch.bool}[np.dtype(dtype)]


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


def check(op: Operand, dtypes: tuple, ndim: int, min_len: int | None = None,
          min_cols: int | None = None) -> np.dtype:
    """Check one probed array; returns its numpy dtype.

    1-D arrays must be contiguous; 2-D arrays need contiguous rows and may have
    any row stride (so slices of persistent buffers are taken as they are).
    """
    name, shape = op.name, op.shape
    if op.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {op.dtype}")
    if len(shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(shape)}")
    if min_len is not None and shape[0] < min_len:
        what = "elements" if ndim == 1 else "rows"
        raise ValueError(f"{name}: expected at least {min_len} {what}, got shape "
                         f"{tuple(shape)}")
    if min_cols is not None and shape[1] < min_cols:
        raise ValueError(f"{name}: expected at least {min_cols} columns, got shape "
                         f"{tuple(shape)}")
    itemsize = op.dtype.itemsize
    if None in op.strides:
        raise ValueError(f"{name}: expected strides that are multiples of the item size "
                         f"({itemsize} bytes), got byte strides {op.array.strides}")
    if op.ptr % itemsize:
        raise ValueError(f"{name}: expected an address aligned to the item size ({itemsize} "
                         f"bytes), got 0x{op.ptr:x}")
    if not _rows_contiguous(op):
        raise ValueError(f"{name}: expected a C-contiguous array (2-D: contiguous rows, any row "
                         f"stride), got strides {op.strides} (elements); pass a contiguous copy")
    return op.dtype


def _rows_contiguous(op: Operand) -> bool:
    shape, strides = op.shape, op.strides
    if len(shape) == 1:
        return shape[0] <= 1 or strides[0] == 1
    rows, cols = shape
    if rows == 0 or cols == 0:
        return True
    return (cols <= 1 or strides[1] == 1) and (rows <= 1 or strides[0] >= cols)


def vector_rows(*ops) -> bool:
    """Whether every row of these 2-D arrays starts 16 bytes aligned (int4 loads and stores)."""
    return all(op.ptr % 16 == 0 and row_stride(op) * op.dtype.itemsize % 16 == 0 for op in ops)


def row_stride(op: Operand) -> int:
    """Elements between rows of a 2-D array (at least its width: a one-row view
    may report any stride)."""
    return op.strides[0] if op.shape[0] > 1 else max(op.strides[0], op.shape[1])


def _span(op: Operand) -> tuple[int, int]:
    """Byte range [start, end) that a checked (rows-contiguous) array can touch."""
    shape = op.shape
    if 0 in shape:
        return op.ptr, op.ptr
    last = (shape[0] - 1) * op.strides[0] + (shape[1] if len(shape) == 2 else 1)
    return op.ptr, op.ptr + last * op.dtype.itemsize


def _row_bytes(op: Operand) -> tuple[int, int, int]:
    """(rows, row stride, row width) in bytes of a checked array (1-D: one row)."""
    itemsize = op.dtype.itemsize
    if len(op.shape) == 1:
        return 1, 0, op.shape[0] * itemsize
    return op.shape[0], op.strides[0] * itemsize, op.shape[1] * itemsize


def _overlap(a: Operand, b: Operand, a_span: tuple, b_span: tuple) -> bool:
    """Whether two checked arrays share a byte. Exact for rows of one stride
    (interleaved column slices of one buffer do not overlap); otherwise the
    spans are compared."""
    (a_lo, a_hi), (b_lo, b_hi) = a_span, b_span
    if not (a_lo < b_hi and b_lo < a_hi):
        return False
    a_rows, a_stride, a_width = _row_bytes(a)
    b_rows, b_stride, b_width = _row_bytes(b)
    if a_rows > 1 and b_rows > 1 and a_stride != b_stride:
        return True
    stride = a_stride if a_rows > 1 else (b_stride if b_rows > 1 else 0)
    if stride == 0 or a_width > stride or b_width > stride:
        return True
    # Row i of a meets row k of b iff d - a_width < (i - k) * stride < d + b_width
    # with d = b_lo - a_lo: try the one or two row distances m = i - k that can.
    distance = b_lo - a_lo
    low, high = -(b_rows - 1), a_rows - 1
    first = max(low, (distance - a_width) // stride)
    for m in range(first, min(high, (distance + b_width) // stride + 1) + 1):
        if distance - a_width < m * stride < distance + b_width:
            return True
    return False


def check_no_alias(outputs: list, inputs: list) -> None:
    """Outputs must not overlap inputs or each other (a kernel would read what it
    wrote). Spans first; the exact row test only where spans meet."""
    others = [op for op in inputs if op is not None]
    spans = [_span(op) for op in others]
    for op in outputs:
        if op is None:
            continue
        span = _span(op)
        lo, hi = span
        for other, (other_lo, other_hi) in zip(others, spans):
            if lo < other_hi and other_lo < hi and _overlap(op, other, span, (other_lo, other_hi)):
                raise ValueError(f"{op.name}: output memory overlaps {other.name}; "
                                 f"pass separate buffers for outputs and inputs")
        others.append(op)
        spans.append(span)


class OwnedBuffers:
    """Buffers this library allocated, whole (they never overlap one another):
    ``check_inputs`` is ``check_no_alias`` of them against a call's inputs,
    with their spans computed once and a bisection per input."""

    def __init__(self, buffers: list):
        """``buffers``: probed whole, contiguous arrays (any number of axes)."""
        self._ops = sorted((op for op in buffers if op is not None and 0 not in op.shape),
                           key=lambda op: op.ptr)
        self._spans = [(op.ptr, op.ptr + math.prod(op.shape) * op.dtype.itemsize)
                       for op in self._ops]
        self._ends = [hi for _, hi in self._spans]
        for (_, end), (start, _), op in zip(self._spans, self._spans[1:], self._ops[1:]):
            if start < end:             # the bisection needs disjoint spans
                raise ValueError(f"{op.name}: a buffer overlaps another one")

    def check_inputs(self, inputs) -> None:
        """Raise ``ValueError`` naming the buffer and the input when a checked
        input shares a byte with a buffer (a buffer is written whole)."""
        ops, spans = self._ops, self._spans
        for other in inputs:
            if other is None:
                continue
            lo, hi = _span(other)
            index = bisect.bisect_right(self._ends, lo)
            if lo < hi and index < len(ops) and spans[index][0] < hi:
                raise ValueError(f"{ops[index].name}: output memory overlaps {other.name}; "
                                 f"pass separate buffers for outputs and inputs")


def block_table_group(op: Operand) -> tuple:
    """The ``BlockTable`` launch fields of a checked 2-D int32 array."""
    rows, cols = op.shape
    return params.BLOCK_TABLE.values(entries=op.ptr, rows=rows, cols=cols,
                                     row_stride=row_stride(op) if rows else 0)


def _numpy_state(x) -> tuple:
    return x.shape, x.strides, x.dtype, x.flags.writeable


def _torch_state(x) -> tuple:
    return x.shape, x.stride()


def _cupy_state(x) -> tuple:
    return x.shape, x.strides


def state_reader(x):
    """The function giving ``view_state`` of arrays of x's kind (chosen once,
    for a view read again and again)."""
    if type(x) is np.ndarray:
        return _numpy_state
    return _torch_state if _family(x) is _TORCH else _cupy_state


def view_state(x) -> tuple:
    """What a caller can change in place on a view: shape, strides and, for
    numpy, the writeable flag (cheap: attribute reads only)."""
    return state_reader(x)(x)


def _torch_version(x) -> int:
    return x._version


def owned_state_reader(x) -> tuple:
    """``(watched, read)`` for a view of a buffer that only this library's
    kernels write: ``read(watched)`` changes when the caller changes the view
    in place. For torch that is the version counter of the view's base, which
    all views of one buffer share and every in-place torch op on any of them
    bumps (``resize_``, ``t_``, ``as_strided_``, ``set_``, a write; not the
    kernels' writes, nor assigning ``.data``): one read covers every view of a
    buffer. Inference tensors have no version counter: their views are
    watched by ``view_state``, as are other kinds'."""
    if _family(x) is _TORCH and not x.is_inference():
        base = x._base
        return (x if base is None else base), _torch_version
    return x, state_reader(x)


class ViewCache:
    """Views of a builder's own buffers, cached: slicing a torch tensor costs
    more host time than a whole prepared build. A view is
    ``buffer[start:stop]``, ``buffer[start:stop, :cols]`` or, with
    ``unit_axis``, ``buffer[start:stop, None, :cols]``. A cached view that the
    caller changed in place (``owned_state_reader``) is replaced, never handed
    out again; past ``capacity`` views the cache starts over."""

    __slots__ = ("capacity", "_views")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._views: dict = {}

    def get(self, buffer, start: int, stop: int, cols: int | None = None,
            unit_axis: bool = False):
        key = (id(buffer), start, stop, cols, unit_axis)     # the builder keeps its buffers
        cached = self._views.get(key)
        if cached is not None:
            view, watched, read, state = cached
            if read(watched) == state:
                return view
        if unit_axis:
            view = buffer[start:stop, None, :cols]
        else:
            view = buffer[start:stop] if cols is None else buffer[start:stop, :cols]
        if len(self._views) >= self.capacity:
            self._views.clear()
        watched, read = owned_state_reader(view)
        self._views[key] = (view, watched, read, read(watched))
        return view


def stack_columns(columns: list):
    """``[N]`` arrays of one kind stacked as the columns of ``[N, len(columns)]``."""
    kind = kind_of(columns[0])
    if kind in (TORCH_CPU, TORCH_CUDA):
        return _torch().stack(columns, dim=-1)
    if kind == CUPY:
        import cupy
        return cupy.stack(columns, axis=-1)
    return np.stack(columns, axis=-1)


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


def kernel_view_2d(x, kind: str) -> tuple[np.ndarray, np.int64]:
    """A checked 2-D host array (contiguous rows, any row stride) as the numba
    kernels take it: ``(flat 1-D view from the first element to the last, row
    stride in elements)``; element ``[r, c]`` is ``flat[r * stride + c]``."""
    view = host_view(x, kind)
    if not view.flags.writeable:
        view = np.asarray(_WritableAlias(view))
    rows, cols = view.shape
    itemsize = view.itemsize
    stride = view.strides[0] // itemsize if rows > 1 else cols
    length = (rows - 1) * stride + cols if rows and cols else 0
    flat = np.lib.stride_tricks.as_strided(view, shape=(length,), strides=(itemsize,))
    return flat, np.int64(stride)


def host_view(x, kind: str) -> np.ndarray:
    """A numpy view of host memory (torch CPU zero-copy, without autograd)."""
    return x if kind == NUMPY else x.detach().numpy()


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


def full_like_kind(like, shape: tuple, dtype, value: int, device: int | None = None):
    """A ``value``-filled array of the kind ``like`` names: "numpy", "cupy",
    "torch" (CUDA when available, else CPU), or an array whose kind and device
    to follow. ``device`` None or -1 means the current one."""
    kind = kind_of(like)
    if kind is not None:
        device = device_of(like, kind)
    elif like in ("numpy", "cupy"):
        kind = like
    elif like == "torch":
        kind = TORCH_CUDA if _require_torch().cuda.is_available() else TORCH_CPU
    else:
        raise ValueError(f"like: expected 'numpy', 'cupy', 'torch' or an array, got {like!r}")
    if device is None or device < 0:
        device = -1
        if kind == CUPY:
            device = require_gpu().id
        elif kind == TORCH_CUDA:
            device = _torch().cuda.current_device()
    array = empty(kind, device, shape, dtype)
    if kind in (TORCH_CPU, TORCH_CUDA):
        array.fill_(value)
    else:
        array.fill(value)
    return array


def _require_torch():
    try:
        import torch
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("torch is not installed: pip install 'dsv4_cupy[torch]'") from None
    return torch


def stream_getter(kind: str, device: int):
    """A no-argument function returning the stream handle a launch on ``device``
    must use now: CuPy's current stream for cupy, torch's current stream for
    torch, so launches follow ``with cupy.cuda.Stream()``,
    ``torch.cuda.stream(...)`` and graph captures (the lookups done once)."""
    if kind == TORCH_CUDA:
        torch = _torch()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)   # no Stream object
        if raw is not None:
            return lambda: raw(device)
        return lambda: torch.cuda.current_stream(device).cuda_stream
    import cupy
    get_current_stream = cupy.cuda.get_current_stream
    return lambda: get_current_stream(device).ptr


# Not float: 1.0 == 1 as keys, but the checks refuse it (bools are keyed apart, below).
_SCALAR_TYPES = frozenset((int, str, tuple, type(None)))


def host_key(x) -> tuple | None:
    """``launch_key``'s entry for a host array read on the host (its type,
    address, shape, strides and dtype); None for None. A device array gets a
    key too, and the full checks then refuse it."""
    if x is None:
        return None
    family = _family(x)
    if family is _TORCH:
        return type(x), x.is_cuda, x.data_ptr(), x.shape, x.stride(), x.dtype
    if family is NUMPY:
        return type(x), x.__array_interface__["data"][0], x.shape, x.strides, x.dtype
    return (type(x), id(x))


def launch_key(*args) -> tuple | None:
    """A key that fixes everything the checks of a GPU call depend on: for each
    device array its address, shape, strides and dtype; scalars as they are,
    a bool apart from the int it equals (an int argument refuses a bool).
    None when an argument is a host array or anything else (no fast path).

    Two calls with equal keys pass the same checks and make the same launch
    (device addresses are unique across devices and never those of host
    memory, so a key found in a cache was validated as the same kind of GPU
    array), so their prepared launch can be reused; nothing here reads device
    memory. This runs on every prepared call: attribute reads only.
    """
    key = []
    append = key.append
    for x in args:
        kind = type(x)
        family = _FAMILY.get(kind)          # arrays first: most arguments are arrays
        if family is None:
            if kind in _SCALAR_TYPES:
                append(x)
                continue
            if kind is bool:
                append((bool, x))
                continue
            family = _family(x)
        if family is _TORCH:
            append((x.data_ptr(), x.shape, x.stride(), x.dtype))
        elif family is _CUPY:
            append((x.data.ptr, x.shape, x.strides, x.dtype))
        else:
            return None
    return tuple(key)


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


def output(name: str, op: Operand | None, kind: str, device: int, dtype: np.dtype, rows: int,
           cols: int | None = None) -> Operand:
    """A probed ``out`` checked to hold ``rows`` (x ``cols``) of ``dtype`` and to be
    writable, or a new array (a ``MemoryError`` naming it when it cannot be had)."""
    shape = (rows,) if cols is None else (rows, cols)
    if op is None:
        try:
            return probe(name, empty(kind, device, shape, dtype))
        except Exception as error:       # numpy MemoryError, cupy OutOfMemoryError, torch OOM
            if not isinstance(error, MemoryError) and "out of memory" not in str(error).lower():
                raise
            size = int(np.prod(shape, dtype=np.float64)) * np.dtype(dtype).itemsize
            raise MemoryError(f"{name}: cannot allocate {shape} {np.dtype(dtype)} "
                              f"({size / 2**30:.1f} GiB) as {_KIND_TEXT[kind]}; check the sizes "
                              f"that set its shape, or pass a buffer") from None
    check(op, (dtype,), len(shape), min_len=rows, min_cols=cols)
    if op.kind == NUMPY and not op.array.flags.writeable:
        raise ValueError(f"{name}: expected a writable array, got a read-only one")
    return op


def check_row_width(name: str, value, minimum: int = 0) -> int:
    """A row width (``window_size``, ``top_k``, a table's columns) as an int in
    ``[minimum, MAX_ROW_WIDTH]``."""
    return check_int(name, value, minimum=minimum, maximum=MAX_ROW_WIDTH)


def out_buffers(out, names: tuple) -> tuple:
    """``out=`` as one buffer (or None) per name: None, or a tuple or list of as
    many arrays (an entry may be None: that output is allocated)."""
    if out is None:
        return (None,) * len(names)
    if not isinstance(out, (tuple, list)) or len(out) != len(names):
        got = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) \
            else type(out).__name__
        raise TypeError(f"out: expected a tuple of {len(names)} arrays ({', '.join(names)}), "
                        f"got {got}")
    return tuple(out)


def head_axis_dropped(name: str, buffer):
    """A ``[rows, 1, cols]`` index buffer (upstream's head axis) as the 2-D view
    ``[rows, cols]`` of the same memory; a 2-D buffer or None passes through."""
    if buffer is None or kind_of(buffer) is None or buffer.ndim != 3:
        return buffer
    if buffer.shape[1] != 1:
        raise ValueError(f"{name}: expected shape [rows, 1, cols] or [rows, cols], got "
                         f"{tuple(buffer.shape)}")
    return buffer[:, 0]


def with_head_axis(rows_2d, num_rows: int, cols: int):
    """``[num_rows, 1, cols]``: a view of the first rows and columns of a 2-D array."""
    return rows_2d[:num_rows, None, :cols]


def is_same_rows(output: Operand, source: Operand) -> bool:
    """Whether row t of ``output`` is row t of ``source`` (an in-place call)."""
    if output.ptr != source.ptr:
        return False
    return source.shape[0] <= 1 or row_stride(output) == row_stride(source)
