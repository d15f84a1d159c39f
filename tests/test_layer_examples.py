"""examples/swa_c4a_step.py runs as a user runs it: on the CPU path here, on
the GPU (cupy) where there is one."""
from __future__ import annotations

import pytest

from test_examples import run_example


def test_swa_c4a_step():
    output = run_example("swa_c4a_step.py")
    assert "shared with torch without a copy" in output or "torch not installed" in output


@pytest.mark.gpu
def test_swa_c4a_step_runs_on_the_gpu():
    assert run_example("swa_c4a_step.py").startswith("GPU (cupy)")
