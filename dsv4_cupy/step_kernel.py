"""Launches of the fused step kernel (``kernels/step.cu``): sections by name."""
from __future__ import annotations

from . import families, params
from .loader import LaunchPlan

_LAYOUTS = dict(params.STEP.fields)


def step_plan(device: int, variant: tuple, sections: dict, swa_slot_mapping: int = 0,
              is_valid_out: int = 0) -> LaunchPlan | None:
    """The step kernel with ``sections`` on (``name: (values, blocks)``, the
    section's struct values and its blocks) and every other section off;
    None when no section has a block."""
    unknown = set(sections) - set(params.STEP_SECTION_NAMES)
    if unknown:
        raise KeyError(f"step_plan: no step-kernel section named {sorted(unknown)}")
    ends, total, fields = {}, 0, {}
    for name in params.STEP_SECTION_NAMES:
        values, blocks = sections.get(name, (None, 0))
        total += blocks
        ends[name] = total
        fields[name] = values if values is not None else _LAYOUTS[name].off
    if not total:
        return None
    return families.STEP.plan(device, total, variant, **fields,
                              sections=params.STEP_SECTIONS.values(**ends),
                              swa_slot_mapping=swa_slot_mapping, is_valid_out=is_valid_out)
