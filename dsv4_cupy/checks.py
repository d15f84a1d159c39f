"""Argument checks of probed arrays: dtype, rank, length, layout, outputs and
overlap, with errors that name the argument. Nothing here reads device memory,
so no check costs a sync."""
from __future__ import annotations

import bisect
import math

import numpy as np

from .kinds import GPU_KINDS, INT32, KIND_TEXT, NUMPY, UINT16, Operand, empty, kind_of, probe
from .scalars import check_int

#: Widest row an op writes (columns are 32-bit inside the kernels).
MAX_ROW_WIDTH = 1 << 24
#: How a dtype the checks take as bits is named to the caller (``kinds.as_bits``).
_DTYPE_TEXT = {UINT16: "bfloat16 (or its uint16 bits)"}


def check(op: Operand, dtypes: tuple, ndim: int, min_len: int | None = None,
          min_cols: int | None = None, min_len_of: str = "") -> np.dtype:
    """Check one probed array; returns its numpy dtype. ``min_len_of`` says
    what ``min_len`` counts (the arguments it comes from).

    1-D arrays must be contiguous; 2-D arrays need contiguous rows and may have
    any row stride (so slices of persistent buffers are taken as they are).
    """
    name, shape = op.name, op.shape
    if op.dtype not in dtypes:
        want = " or ".join(_DTYPE_TEXT.get(d, str(d)) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {want}, got {op.dtype}")
    if len(shape) != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {tuple(shape)}")
    if min_len is not None and shape[0] < min_len:
        what = "elements" if ndim == 1 else "rows"
        of = f" ({min_len_of})" if min_len_of else ""
        raise ValueError(f"{name}: expected at least {min_len} {what}{of}, got shape "
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
                              f"({size / 2**30:.1f} GiB) as {KIND_TEXT[kind]}; check the sizes "
                              f"that set its shape, or pass a buffer") from None
    check(op, (dtype,), len(shape), min_len=rows, min_cols=cols)
    check_writable(op)
    return op


def check_writable(op: Operand) -> None:
    """An array a kernel writes must be writable (a read-only numpy view is refused)."""
    if op.kind == NUMPY and not op.array.flags.writeable:
        raise ValueError(f"{op.name}: expected a writable array, got a read-only one")


def check_visibility(left: Operand | None, right: Operand | None, num_tokens: int) -> None:
    """Image visibility (vLLM's ``left_visible``/``right_visible``): both or
    neither, int32, a value per token."""
    if (left is None) != (right is None):
        missing = "right_visible" if right is None else "left_visible"
        raise ValueError(f"{missing}: expected an int32 array with the other visibility, "
                         f"got None")
    for visible in (left, right):
        if visible is not None:
            check(visible, (INT32,), 1, min_len=num_tokens)


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
    """A ``[rows, 1, cols]`` index buffer (vLLM's head axis) as the 2-D view
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


def rows_of(op: Operand, start: int, stop: int) -> Operand:
    """Rows ``[start, stop)`` of a checked array (elements of a 1-D one), as
    probing that view would give them; on the device kinds without the view
    itself (a launch needs its address alone, and slicing a torch tensor
    costs more host time than the rest)."""
    return Operand(op.name, op.array[start:stop] if op.kind not in GPU_KINDS else None,
                   op.kind, op.device, op.dtype, (stop - start, *op.shape[1:]), op.strides,
                   op.ptr + start * op.strides[0] * op.dtype.itemsize)


def as_rows(op: Operand, rows: int, row_length: int) -> Operand:
    """The first ``rows * row_length`` elements of a contiguous 1-D array as
    ``[rows, row_length]`` (no view made on the device kinds, as ``rows_of``)."""
    array = op.array[:rows * row_length].reshape(rows, row_length) \
        if op.kind not in GPU_KINDS else None
    return Operand(op.name, array, op.kind, op.device, op.dtype, (rows, row_length),
                   (row_length, 1), op.ptr)


def is_same_rows(output: Operand, source: Operand) -> bool:
    """Whether row t of ``output`` is row t of ``source`` (an in-place call)."""
    if output.ptr != source.ptr:
        return False
    return source.shape[0] <= 1 or row_stride(output) == row_stride(source)
