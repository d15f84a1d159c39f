"""The fused step kernel (``kernels/step.cuh``): one launch of the sections a
step needs, each a single family's launch (``launch.Launch``) on its own
blocks, in the order of ``params.STEP_SECTIONS_OF``. On the CPU its sections'
kernels run in that order, after the step's own validity pass."""
from __future__ import annotations

from . import cpu, families
from .kinds import BOOL, INT64, Operand
from .launch import Launch, NoArray
from .params import STEP_SECTION_NAMES, STEP_SECTIONS, STEP_SECTIONS_OF


def step_launch(variant: dict, sections: dict, swa_slot_mapping: Operand | None = None,
                is_valid_out: Operand | None = None) -> Launch:
    """The step kernel with ``sections`` on (name: its family's ``Launch``) and
    every other section off. ``variant`` names the step's positions and
    slot-mapping dtypes. With an SWA section, its rows' validity comes from
    ``swa_slot_mapping`` (``>= 0``), written to ``is_valid_out`` (rows of the
    step's tokens)."""
    unknown = set(sections) - set(STEP_SECTION_NAMES)
    if unknown:
        raise KeyError(f"step_launch: no step-kernel section named {sorted(unknown)}")
    inputs, ends, total = {}, {}, 0
    for name, layout in STEP_SECTIONS_OF:
        section = sections.get(name)
        total += section.blocks if section is not None else 0
        ends[name] = total
        inputs[name] = section if section is not None else layout.off
    inputs.update(sections=STEP_SECTIONS.record(**ends),
                  swa_slot_mapping=NoArray(INT64) if swa_slot_mapping is None else swa_slot_mapping,
                  is_valid_out=NoArray(BOOL) if is_valid_out is None else is_valid_out)
    return Launch(families.STEP, total, inputs, variant=variant, kernel=cpu.step_validity,
                  parts=tuple(sections[name] for name in STEP_SECTION_NAMES if name in sections))
