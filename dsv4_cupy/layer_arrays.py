"""Array checks that the per-layer and indexer ops share, on top of ``arrays``
(no device memory is read here either): bool inputs, tuples of ``out=``
buffers, ``[rows, 1, cols]`` index buffers, in-place outputs, row widths."""
from __future__ import annotations

import numpy as np

from . import arrays
from .scalars import check_int

BOOL = np.dtype(np.bool_)
#: Widest row any of these ops writes (columns are 32-bit inside the kernels).
MAX_COLUMNS = 1 << 24
#: Threads of the warp that writes one row in the warp-per-row kernels (a
#: launch-geometry fact: geometry.py is its home once that file is open to edits).
WARP_LANES = 32


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
    if buffer is None or arrays.kind_of(buffer) is None or buffer.ndim != 3:
        return buffer
    if buffer.shape[1] != 1:
        raise ValueError(f"{name}: expected shape [rows, 1, cols] or [rows, cols], got "
                         f"{tuple(buffer.shape)}")
    return buffer[:, 0]


def with_head_axis(rows_2d, num_rows: int, cols: int):
    """``[num_rows, 1, cols]``: a view of the first rows and columns of a 2-D array."""
    return rows_2d[:num_rows, None, :cols]


def is_same_rows(output: arrays.Operand, source: arrays.Operand) -> bool:
    """Whether row t of ``output`` is row t of ``source`` (an in-place call)."""
    if output.ptr != source.ptr:
        return False
    return source.shape[0] <= 1 or arrays.row_stride(output) == arrays.row_stride(source)


def check_columns(name: str, value, minimum: int = 0) -> int:
    """A row width in [minimum, MAX_COLUMNS]."""
    return check_int(name, value, minimum=minimum, maximum=MAX_COLUMNS)
