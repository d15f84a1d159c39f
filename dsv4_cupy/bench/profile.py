"""Kernels under a profiler: ``python -m dsv4_cupy.bench.profile``.

Runs each case's calls once to warm up, then once more inside a profiler
range (``cudaProfilerStart``/``Stop``) and an NVTX range named after the
case, so that a profiler started with the range off records only those::

    ncu --profile-from-start off --set full --nvtx -o report \\
        python -m dsv4_cupy.bench.profile --op step

``--op step``: the whole step's kernel at the whole-step bench's decode
cases (``step.STEP_CASES``; ``--case`` picks others). ``--op selected``: the
full and the selective gathers of the bench's selective-gather cases
(``kv_cache.selected_rows``). A tool, not a benchmark: it times nothing.
"""
from __future__ import annotations

import argparse
import math

import numpy as np

from .cli import MAX_MODEL_LEN, STEP_MAX_TOKENS, make_step
from .step import STEP_CASES, step_case


class _Profiled:
    """Runs a call in its own profiled range (in place of a bench timer)."""

    def __init__(self, torch, cupy):
        self.torch, self.cupy = torch, cupy

    def run(self, name: str, call) -> None:
        torch, profiler = self.torch, self.cupy.cuda.profiler
        call()
        torch.cuda.synchronize()
        profiler.start()
        torch.cuda.nvtx.range_push(name)
        try:
            call()
            torch.cuda.synchronize()
        finally:
            torch.cuda.nvtx.range_pop()
            profiler.stop()

    def graph_us(self, call) -> float:        # the bench timer's interface
        self.run(call.__name__, call)
        return math.nan

    def host_us(self, call) -> float:
        return math.nan


def _step_cases(profiled, names) -> list[str]:
    import torch

    import dsv4_cupy as d4
    cases = [index for index, case in enumerate(STEP_CASES)
             if (case[0] in names if names else not case[3])]
    for index in cases:
        _, cms, builder = step_case(torch, d4, index, make_step, MAX_MODEL_LEN, STEP_MAX_TOKENS)
        profiled.run(STEP_CASES[index][0], lambda: builder.build(0, cms))
    return [STEP_CASES[index][0] for index in cases]


def _selected_cases(profiled) -> list[str]:
    from .kv_cache import selected_rows
    return [row["case"] for row in selected_rows(profiled, np.random.default_rng(0))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv4_cupy.bench.profile",
                                     description="Kernels under a profiler (see the module).")
    parser.add_argument("--op", choices=("step", "selected"), default="step")
    parser.add_argument("--case", action="append",
                        help="--op step: a STEP_CASES name (default: every decode case)")
    args = parser.parse_args(argv)
    known = [case[0] for case in STEP_CASES]
    if args.case and (args.op != "step" or not set(args.case) <= set(known)):
        parser.error(f"--case: expected --op step and names from {known}, got {args.case}")
    import cupy
    import torch

    profiled = _Profiled(torch, cupy)
    cases = (_step_cases(profiled, args.case) if args.op == "step"
             else _selected_cases(profiled))
    print(f"profiled ({args.op}):", ", ".join(cases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
