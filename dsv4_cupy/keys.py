"""Launch keys and view watching: what lets a repeated call skip its checks.

A key fixes everything a call's checks depend on, read from attributes alone;
a watched view says whether the caller changed it in place since it was
handed out."""
from __future__ import annotations

import sys

import numpy as np

from .kinds import CUPY_FAMILY, NUMPY, TORCH_FAMILY, family_of, loaded_torch


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
    return _torch_state if family_of(x) is TORCH_FAMILY else _cupy_state


def view_state(x) -> tuple:
    """What a caller can change in place on a view: shape, strides and, for
    numpy, the writeable flag (cheap: attribute reads only)."""
    return state_reader(x)(x)


def _torch_version(x) -> int:
    return x._version


def owned_state_reader(x) -> tuple:
    """``(identity, watched, read)`` for a view of a buffer that only this
    library's kernels write: ``read(watched)`` changes when the caller changes
    the view in place, and views of one ``identity`` share that state. For
    torch that is the version counter, which all views of one allocation
    share (a buffer's, or a block's of buffers: ``kinds.full_block_like_kind``)
    and every in-place torch op on any of them bumps (``resize_``, ``t_``,
    ``as_strided_``, ``set_``, a write; not the kernels' writes, nor assigning
    ``.data``): one read covers every view of a block, whose identity is its
    storage. Inference tensors have no version counter: their views are
    watched by ``view_state``, as are other kinds'."""
    if family_of(x) is TORCH_FAMILY and not x.is_inference():
        return ("storage", x.untyped_storage().data_ptr()), x, _torch_version
    return ("view", id(x)), x, state_reader(x)


def watch(views=(), owned=()) -> tuple:
    """``(target, read, state)`` per watched array: ``views`` (any arrays, by
    ``state_reader``) and ``owned`` (views of the library's buffers, by
    ``owned_state_reader``: one read per torch allocation); None skipped."""
    watched = {("view", id(view)): (view, state_reader(view)) for view in views
               if view is not None}
    for view in owned:
        if view is not None:
            identity, target, read = owned_state_reader(view)
            watched[identity] = (target, read)
    return tuple((target, read, read(target)) for target, read in watched.values())


def unchanged(watched: tuple) -> bool:
    """Whether no watched array (``watch``) was changed in place since."""
    for target, read, state in watched:
        if read(target) != state:
            return False
    return True


class ViewCache:
    """Views of a builder's own buffers, cached: slicing a torch tensor costs
    more host time than a whole prepared build. A view is
    ``buffer[start:stop]``, ``buffer[start:stop, :cols]``, with ``unit_axis``
    ``buffer[start:stop, None, :cols]`` or, with ``row_length``, the elements
    ``buffer[start:stop]`` as rows of that length. A cached view that the
    caller changed in place (``owned_state_reader``) is replaced, never handed
    out again; past ``capacity`` views the cache starts over."""

    __slots__ = ("capacity", "_views")

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._views: dict = {}

    def get(self, buffer, start: int, stop: int, cols: int | None = None,
            unit_axis: bool = False, row_length: int | None = None):
        # The builder keeps its buffers: their ids are theirs for its life.
        key = (id(buffer), start, stop, cols, unit_axis, row_length)
        cached = self._views.get(key)
        if cached is not None:
            view, watched, read, state = cached
            if read(watched) == state:
                return view
        if row_length is not None:
            view = buffer[start:stop].reshape(-1, row_length)
        elif unit_axis:
            view = buffer[start:stop, None, :cols]
        else:
            view = buffer[start:stop] if cols is None else buffer[start:stop, :cols]
        if len(self._views) >= self.capacity:
            self._views.clear()
        _, watched, read = owned_state_reader(view)
        self._views[key] = (view, watched, read, read(watched))
        return view


# Not float: 1.0 == 1 as keys, but the checks refuse it (bools are keyed apart, below).
_SCALAR_TYPES = frozenset((int, str, tuple, type(None)))


def host_key(x) -> tuple | None:
    """``launch_key``'s entry for a host array read on the host (its type,
    address, shape, strides and dtype); None for None. A device array gets a
    key too, and the full checks then refuse it."""
    if x is None:
        return None
    family = family_of(x)
    if family is TORCH_FAMILY:
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
    tensor, ndarray = _ARRAY_TYPES
    for x in args:
        kind = type(x)
        if kind is not tensor and kind is not ndarray:      # most arguments are arrays
            if kind in _SCALAR_TYPES:
                append(x)
                continue
            if kind is bool:
                append((bool, x))
                continue
            family = family_of(x)           # a subclass, or the first array of its kind
            if family is not TORCH_FAMILY and family is not CUPY_FAMILY:
                return None
            tensor, ndarray = _learn_array_types()
            kind = tensor if family is TORCH_FAMILY else ndarray
        if kind is tensor:
            append((x.data_ptr(), x.shape, x.stride(), x.dtype))
        else:
            append((x.data.ptr, x.shape, x.strides, x.dtype))
    return tuple(key)


#: ``torch.Tensor`` and ``cupy.ndarray``, once an array of either was keyed
#: (this module imports neither).
_ARRAY_TYPES = (None, None)


def _learn_array_types() -> tuple:
    global _ARRAY_TYPES
    torch, cupy = loaded_torch(), sys.modules.get("cupy")
    _ARRAY_TYPES = (torch and torch.Tensor, cupy and cupy.ndarray)
    return _ARRAY_TYPES
