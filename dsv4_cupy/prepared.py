"""Prepared GPU calls: what a repeated call with the same arguments needs.

A serving loop calls an op, or a builder's ``build``, with the same buffers
step after step. The first call checks everything and prepares the launch; a
later call whose ``arrays.launch_key`` is equal passes the same checks and makes
the same launch, so it only reads the caller's current stream, checks that the
result views were not changed in place, and launches. The key is built from
attributes alone: no device memory is read, and the full checks run whenever
anything differs.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from . import arrays
from .loader import LaunchPlan, PlanCache


class PreparedCall:
    """Launch plans run in order on the caller's stream, and the results to return."""

    __slots__ = ("plans", "stream", "results", "_watched")

    def __init__(self, plans: tuple[LaunchPlan, ...], kind: str, device: int, results,
                 views: tuple = (), *, owned: tuple = ()):
        """``results`` is returned by each run; the arrays inside it are checked
        for in-place changes before each run: ``views`` (any arrays, by
        ``arrays.view_state``) and ``owned`` (views of buffers only this
        library's kernels write, by ``arrays.owned_state_reader``: a torch
        buffer's views are watched by one read)."""
        self.plans = plans
        self.stream = arrays.stream_getter(kind, device)
        self.results = results
        watched = {id(view): (view, arrays.state_reader(view)) for view in views
                   if view is not None}
        for view in owned:
            if view is not None:
                target, read = arrays.owned_state_reader(view)
                watched[id(target)] = (target, read)
        self._watched = tuple((target, read, read(target)) for target, read in watched.values())

    def run(self) -> bool:
        """Launch and return True, or launch nothing and return False when a
        result view was changed in place or a plan cannot run here."""
        for view, read, state in self._watched:
            if read(view) != state:
                return False
        stream = self.stream()
        for index, plan in enumerate(self.plans):
            if not plan.run(stream):
                if index:       # only a context reset between two launches gets here
                    raise RuntimeError("the CUDA context changed during a call")
                return False
        return True


class CheckedCall(NamedTuple):
    """An op's arguments after its checks: what to return, and what to run for
    it: a kernel's struct fields and blocks on the GPU (a fused family nests
    them), a numba call on the CPU."""

    kind: str
    device: int
    results: tuple
    blocks: int                   # 0: nothing to launch
    fields: dict | None           # the kernel struct's fields (GPU)
    run_cpu: Callable | None      # the CPU kernel's call (CPU)
    variant: tuple = ()           # the kernel's entry point: a value per axis of its family


class PreparedOp:
    """The prepared calls of one op, by ``arrays.launch_key`` of its arguments."""

    __slots__ = ("name", "_calls")

    def __init__(self, name: str):
        self.name = name
        self._calls = PlanCache()

    def replay(self, validate: str, buffers, *args) -> tuple:
        """``(key, results)``: the results of a prepared call with these
        arguments and output ``buffers``, launched again, or None (the key is
        None: no fast path). Only a call with ``validate="default"`` and every
        output buffer given is prepared: a result the op allocated must not be
        written again by a later call."""
        if (validate != "default" or type(buffers) not in (tuple, list)
                or any(buffer is None for buffer in buffers)):
            return None, None
        key = arrays.launch_key(*args, *buffers)
        call = self._calls.get(key) if key is not None else None
        if call is not None and call.run():
            return key, call.results
        return key, None

    def run(self, key, family, call: CheckedCall):
        """Run a checked call of ``family``, keeping its launch under ``key`` on the GPU."""
        if call.kind not in arrays.GPU_KINDS:
            call.run_cpu()
            return call.results
        plans = ((family.plan(call.device, call.blocks, call.variant, **call.fields),)
                 if call.blocks else ())
        return self.launch(key, plans, call.kind, call.device, call.results, call.results)

    def launch(self, key, plans: tuple[LaunchPlan, ...], kind: str, device: int, results,
               views: tuple):
        """Launch ``plans`` (checked arguments) and keep them under ``key``."""
        call = PreparedCall(plans, kind, device, results, views)
        if not call.run():
            raise RuntimeError(f"{self.name}: the device changed during the call")
        if key is not None:
            self._calls.put(key, call)
        return results


__all__ = ["CheckedCall", "PreparedCall", "PreparedOp", "PlanCache"]
