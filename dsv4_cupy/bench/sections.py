"""The step kernel's sections timed alone: ``python -m dsv4_cupy.bench.sections``.

For each decode case of the whole-step bench (``step.STEP_CASES``; ``--case``
picks), the step builder's prepared launch is timed in CUDA-graph replay as
it was built ("all"), with every section off on the same grid ("none": the
launch and the sections' dispatch), and each section alone on its own blocks
(the other sections' block ends rewritten in the launch's packed struct). A
section that takes the whole step's time alone is what bounds the step
(docs/performance.md). Last, "writes": a launch of the step's grid that only
stores as many bytes as the step writes into the builder's buffers (counted
here), with no load ahead of them: the least time of storing the step's
output. The step is the bench's, its indexer's decode rows in the flat layout
unless ``--indexer-decode-layout native`` (vLLM's sm_90 path) is given. A
tool, not a benchmark: programmatic launch is off, and the outputs are not
checked.
"""
from __future__ import annotations

import argparse
import struct

import numpy as np

from ..launch import set_programmatic_launch
from ..step_indexer import INDEXER_DECODE_LAYOUTS
from ..step_kernel import PARAMS, SECTION_NAMES
from .cli import MAX_MODEL_LEN, STEP_MAX_TOKENS, GpuTimer, make_step
from .latency import write_floor_us
from .step import INDEXER_DECODE_LAYOUT, STEP_CASES, prepared_launches, step_case

_END = struct.Struct("<q")     # StepSections' fields: int64 block ends
_END_AT = {name: PARAMS.offset_of("sections", name) for name in SECTION_NAMES}
_FIRST_BLOCK_AT = PARAMS.offset_of("first_block")


def section_ends(storage: np.ndarray) -> dict:
    """The cumulative block end of each section in a packed ``StepParams``."""
    return {name: _END.unpack_from(storage, at)[0] for name, at in _END_AT.items()}


def _with_ends(storage: np.ndarray, ends: dict) -> np.ndarray:
    """``storage`` with the block ends ``ends``, its grid run in order."""
    copy = storage.copy()
    for name, end in ends.items():
        _END.pack_into(copy, _END_AT[name], end)
    _END.pack_into(copy, _FIRST_BLOCK_AT, 0)
    return copy


def variants(storage: np.ndarray, blocks: int) -> list[tuple[str, np.ndarray, int]]:
    """``(name, packed struct, blocks)`` of the launch as built ("all"), with
    every section off ("none"), and of each section that has blocks alone:
    the sections before it end at block 0, it and those after it at its own
    block count, the grid that count."""
    ends = section_ends(storage)
    out = [("all", storage.copy(), blocks),
           ("none", _with_ends(storage, dict.fromkeys(ends, 0)), blocks)]
    start = 0
    for index, name in enumerate(SECTION_NAMES):
        size, start = ends[name] - start, ends[name]
        if size:
            alone = {other: 0 if before < index else size
                     for before, other in enumerate(SECTION_NAMES)}
            out.append((name, _with_ends(storage, alone), size))
    return out


def time_variants(timer: GpuTimer, torch, plan) -> dict:
    """``{name: (us, blocks)}`` of each of ``variants`` of the prepared launch
    ``plan``, run on torch's current stream; ``plan`` is left as it was."""
    original, blocks = plan.storage.copy(), plan.blocks
    times = {}
    try:
        for name, storage, count in variants(original, blocks):
            plan.storage[:] = storage
            plan.blocks = count
            times[name] = (timer.graph_us(
                lambda: plan.run(torch.cuda.current_stream().cuda_stream)), count)
    finally:
        plan.storage[:] = original
        plan.blocks = blocks
    return times


def bytes_written(torch, builder, run) -> int:
    """Bytes of the builder's buffers (their whole allocations) that ``run()``
    writes: those that differ, after a run, from a fill they were given
    before it, for either of two fills (no byte equals both)."""
    storages = {}
    for array in builder.buffers().values():
        storage = array.untyped_storage()
        storages[storage.data_ptr()] = (storage, array.device)
    whole = [torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
             for storage, device in storages.values()]
    written = [torch.zeros_like(x, dtype=torch.bool) for x in whole]
    for fill in (0x5A, 0xA5):
        for x in whole:
            x.fill_(fill)
        run()
        for x, seen in zip(whole, written):
            seen |= x != fill
    return int(sum(int(seen.sum()) for seen in written))


def main(argv=None) -> int:
    decode_cases = [case[0] for case in STEP_CASES if not case[3]]
    parser = argparse.ArgumentParser(prog="python -m dsv4_cupy.bench.sections",
                                     description="The step kernel's sections timed alone "
                                                 "(see the module).")
    parser.add_argument("--case", action="append", choices=decode_cases,
                        help="a decode case of the whole-step bench (default: all of them)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=STEP_MAX_TOKENS,
                        help=f"the builder's buffers (default {STEP_MAX_TOKENS}, the bench's)")
    parser.add_argument("--indexer-decode-layout", choices=INDEXER_DECODE_LAYOUTS,
                        default=INDEXER_DECODE_LAYOUT,
                        help="the indexer's decode rows: flat (vLLM's sm_100 and flattening "
                             "paths) or native (vLLM's sm_90 path); default the bench's, "
                             f"{INDEXER_DECODE_LAYOUT}")
    args = parser.parse_args(argv)
    import torch

    import dsv4_cupy as d4

    set_programmatic_launch(False)       # a launch configuration keeps its grid
    timer = GpuTimer(torch)
    for index, (name, *_) in enumerate(STEP_CASES):
        if name not in (args.case or decode_cases):
            continue
        _, cms, builder = step_case(torch, d4, index, make_step, MAX_MODEL_LEN,
                                    args.max_num_batched_tokens, args.indexer_decode_layout)
        plan, = prepared_launches(builder, cms)
        times = time_variants(timer, torch, plan)
        stream = torch.cuda.current_stream()
        nbytes = bytes_written(torch, builder, lambda: plan.run(stream.cuda_stream))
        writes = write_floor_us(torch, timer, nbytes, plan.blocks, plan.threads)
        print(f"{name}: " + " | ".join(f"{variant} {us:.2f} [{blocks}]"
                                        for variant, (us, blocks) in times.items())
              + f" | writes {writes:.2f} [{plan.blocks}] {nbytes / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
