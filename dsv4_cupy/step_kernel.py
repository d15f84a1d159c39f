"""The fused step kernel (``kernels/step.cuh``): one launch of the sections a
step needs, each a single family's launch (``launch.Launch``) on its own
blocks, in the order of ``SECTIONS``. On the CPU its sections' kernels run in
that order, after the step's own validity pass."""
from __future__ import annotations

from numba import njit

from . import (c128a, combine, indexer_decode, indexer_native_decode, indexer_prefill,
               prefill_gather, short_context, slot_mapping, swa, token_map)
from .family import POSITIONS_AXIS, ROTATED_GRID_AXIS, SLOT_MAPPING_AXIS, KernelFamily
from .kinds import BOOL, INT64, Operand
from .launch import Launch, optional
from .loader import resident_blocks
from .params import I64, PTR, Group, Params

#: The step kernel's sections, in grid order: each is one family's struct.
SECTIONS = (("token_map", token_map.PARAMS), ("group_slots", slot_mapping.PARAMS),
            ("c128a", c128a.PARAMS), ("swa", swa.PARAMS), ("c4a_slots", slot_mapping.PARAMS),
            ("indexer_slots", slot_mapping.PARAMS), ("gather", prefill_gather.PARAMS),
            ("indexer_decode", indexer_decode.PARAMS),
            ("indexer_native_decode", indexer_native_decode.PARAMS),
            ("indexer_prefill", indexer_prefill.PARAMS),
            ("c128a_combine", combine.PREFILL_COMBINE), ("swa_combine", combine.PREFILL_COMBINE),
            ("short_context", short_context.PARAMS))
SECTION_NAMES = tuple(name for name, _ in SECTIONS)
STEP_SECTIONS = Group("StepSections", [(name, I64) for name in SECTION_NAMES], module=__name__)
StepSections = STEP_SECTIONS.record
PARAMS = Params("StepParams", [("sections", STEP_SECTIONS), *SECTIONS,
                               ("swa_slot_mapping", PTR), ("is_valid_out", PTR),
                               ("first_block", I64)])


@njit(cache=True)
def cpu_step_validity(swa_slot_mapping, is_valid_out):
    """The step kernel's own output: ``is_valid_out[t] = swa_slot_mapping[t] >= 0``
    for every element of ``is_valid_out`` (its sections run after it)."""
    for t in range(is_valid_out.shape[0]):
        is_valid_out[t] = swa_slot_mapping[t] >= 0


#: Fused: every step-level output of both builders in one launch, a section per family.
FAMILY = KernelFamily("step.cuh", "step_metadata", PARAMS,
                      (POSITIONS_AXIS, SLOT_MAPPING_AXIS, ROTATED_GRID_AXIS))
CPU_KERNEL = cpu_step_validity
FAMILIES = (FAMILY,)


#: The section whose blocks a grid past one wave runs first: in a decode step
#: its blocks end last on their SMs, and past one wave they were the second
#: wave (docs/performance.md).
LEADING_SECTION = "indexer_decode"


def first_block(ends: dict, resident: int) -> int:
    """``StepParams.first_block`` of a grid of ``ends``' blocks (``StepSections``):
    ``LEADING_SECTION``'s first block when the grid is more than ``resident``
    blocks (a wave) and that section has blocks, else 0."""
    start = ends[SECTION_NAMES[SECTION_NAMES.index(LEADING_SECTION) - 1]]
    if ends[SECTION_NAMES[-1]] > resident and ends[LEADING_SECTION] > start:
        return start
    return 0


def step_launch(variant: dict, sections: dict, swa_slot_mapping: Operand | None = None,
                is_valid_out: Operand | None = None, device: int = -1) -> Launch:
    """The step kernel with ``sections`` on (name: its family's ``Launch``) and
    every other section off. ``variant`` names the step's positions and
    slot-mapping dtypes. With an SWA section, its rows' validity comes from
    ``swa_slot_mapping`` (``>= 0``), written to ``is_valid_out`` (rows of the
    step's tokens). On GPU ``device`` (not -1) a grid past one wave starts
    at ``first_block`` (the rotated entry point); elsewhere, and on the CPU,
    the grid runs the sections in order."""
    unknown = set(sections) - set(SECTION_NAMES)
    if unknown:
        raise KeyError(f"step_launch: no step-kernel section named {sorted(unknown)}")
    inputs, ends, total = {}, {}, 0
    for name, layout in SECTIONS:
        section = sections.get(name)
        total += section.blocks if section is not None else 0
        ends[name] = total
        inputs[name] = section if section is not None else layout.off
    in_order = {**variant, "rotated": 0}
    first = 0
    if device >= 0 and total:
        first = first_block(ends, resident_blocks(FAMILY, FAMILY.entry_name(in_order),
                                                  FAMILY.threads(in_order), device))
    variant = {**variant, "rotated": int(first > 0)}
    inputs.update(sections=StepSections(**ends), first_block=first,
                  swa_slot_mapping=optional(swa_slot_mapping, INT64),
                  is_valid_out=optional(is_valid_out, BOOL))
    return Launch(FAMILY, total, inputs, variant=variant, kernel=cpu_step_validity,
                  parts=tuple(sections[name] for name in SECTION_NAMES if name in sections))


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    for slots in (tiny.out32, tiny.out64):
        yield (f"step_validity[s{slots.dtype.itemsize * 8}]",
               step_launch({}, {}, slots, tiny.valid))
