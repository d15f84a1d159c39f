"""Prepared calls: what a repeated call with the same arguments needs.

A serving loop calls an op, or a builder's ``build``, with the same buffers
step after step. The first call checks everything and prepares its launches;
a later call whose ``keys.launch_key`` is equal passes the same checks and
makes the same launches, so it only reads the caller's current stream,
checks that the result views were not changed in place, and launches. The
key is built from attributes alone: no device memory is read, and the full
checks run whenever anything differs.

Every public op has the same skeleton::

    _OP = PreparedOp("name")

    def name(..., out=None, validate="default"):
        key, results = _OP.replay(validate, out_buffers, *arguments)
        if results is not None:
            return results
        return _OP.run(key, check_name(...))      # a Checked: its family's Launches
"""
from __future__ import annotations

from typing import NamedTuple

from . import keys
from .kinds import GPU_KINDS
from .launch import PreparedLaunch, stream_getter

#: Prepared calls one op or builder keeps (then the oldest goes first).
MAX_PREPARED_CALLS = 256


class PreparedCalls:
    """Prepared calls by key, at most ``capacity`` (the oldest goes first)."""

    def __init__(self, capacity: int = MAX_PREPARED_CALLS):
        self.capacity = capacity
        self._calls: dict = {}

    def get(self, key):
        return self._calls.get(key)

    def put(self, key, call) -> None:
        if len(self._calls) >= self.capacity:
            self._calls.pop(next(iter(self._calls)), None)   # another thread may have too
        self._calls[key] = call

    def clear(self) -> None:
        self._calls.clear()


class PreparedCall:
    """Prepared launches run in order on the caller's stream, and the results to return."""

    __slots__ = ("launches", "stream", "results", "_watched")

    def __init__(self, launches: tuple[PreparedLaunch, ...], kind: str, device: int, results,
                 views: tuple = (), *, owned: tuple = ()):
        """``results`` is returned by each run; the arrays inside it are checked
        for in-place changes before each run: ``views`` (any arrays, by
        ``keys.view_state``) and ``owned`` (views of buffers only this
        library's kernels write, by ``keys.owned_state_reader``: a torch
        buffer's views are watched by one read)."""
        self.launches = launches
        self.stream = stream_getter(kind, device)
        self.results = results
        self._watched = keys.watch(views, owned)

    def run(self) -> bool:
        """Launch and return True, or launch nothing and return False when a
        result view was changed in place or a launch cannot run here."""
        if not keys.unchanged(self._watched):
            return False
        stream = self.stream()
        for index, launch in enumerate(self.launches):
            if not launch.run(stream):
                if index:       # only a context reset between two launches gets here
                    raise RuntimeError("the CUDA context changed during a call")
                return False
        return True


class Checked(NamedTuple):
    """An op's arguments after its checks: what to return and what to run for
    it (its family's launches), and the result views to watch."""

    kind: str
    device: int
    results: object
    launches: tuple          # launch.Launch, in order
    views: tuple             # the result arrays (watched for in-place changes)


def prepare(checked: Checked) -> PreparedCall:
    """The GPU launches of ``checked`` prepared on its device (none of 0 blocks)."""
    launches = tuple(launch.prepare(checked.device) for launch in checked.launches
                     if launch.blocks)
    return PreparedCall(launches, checked.kind, checked.device, checked.results, checked.views)


class PreparedOp:
    """The prepared calls of one op, by ``keys.launch_key`` of its arguments."""

    __slots__ = ("name", "calls")

    def __init__(self, name: str):
        self.name = name
        self.calls = PreparedCalls()

    def replay(self, validate: str, buffers, *args) -> tuple:
        """``(key, results)``: the results of a prepared call with these
        arguments and output ``buffers``, launched again, or None (the key is
        None: no fast path). Only a call with ``validate="default"`` and every
        output buffer given is prepared: a result the op allocated must not be
        written again by a later call."""
        if (validate != "default" or type(buffers) not in (tuple, list)
                or any(buffer is None for buffer in buffers)):
            return None, None
        key = keys.launch_key(*args, *buffers)
        call = self.calls.get(key) if key is not None else None
        if call is not None and call.run():
            return key, call.results
        return key, None

    def run(self, key, checked: Checked):
        """Run a checked call; on the GPU, keep its launches under ``key``."""
        if checked.kind not in GPU_KINDS:
            for launch in checked.launches:
                launch.run_cpu()
            return checked.results
        call = prepare(checked)
        if not call.run():
            raise RuntimeError(f"{self.name}: the device changed during the call")
        if key is not None:
            self.calls.put(key, call)
        return checked.results


__all__ = ["Checked", "PreparedCall", "PreparedCalls", "PreparedOp", "prepare"]
