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

from . import arrays
from .loader import LaunchPlan, PlanCache


class PreparedCall:
    """Launch plans run in order on the caller's stream, and the results to return."""

    __slots__ = ("plans", "stream", "results", "_watched")

    def __init__(self, plans: tuple[LaunchPlan, ...], kind: str, device: int, results,
                 views: tuple = ()):
        """``results`` is returned by each run; ``views`` (arrays inside it) are
        checked for in-place changes before each run."""
        self.plans = plans
        self.stream = arrays.stream_getter(kind, device)
        self.results = results
        self._watched = tuple((view, arrays.view_state(view)) for view in views
                              if view is not None)

    def run(self) -> bool:
        """Launch and return True, or launch nothing and return False when a
        result view was changed in place or a plan cannot run here."""
        for view, state in self._watched:
            if arrays.view_state(view) != state:
                return False
        stream = self.stream()
        for index, plan in enumerate(self.plans):
            if not plan.run(stream):
                if index:       # only a context reset between two launches gets here
                    raise RuntimeError("the CUDA context changed during a call")
                return False
        return True


__all__ = ["PreparedCall", "PlanCache"]
