"""Programmatic dependent launch (``set_programmatic_launch``): the launch
configuration the driver reads, the switch, and on the GPU a run_chain of ops
that each read what the one before wrote, eager and in CUDA graphs, against
the CPU path with the outputs poisoned before every run."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import dsv4_cupy as d4
from dsv4_cupy import families, launch

from conftest import HAS_TORCH, to_kind
from helpers import assert_chain, chain_outputs, chain_step, run_chain

I32 = np.int32


def test_launch_config_has_cuda_h_layout():
    """CUlaunchConfig (56 bytes) then the CUlaunchAttribute it points at: id 6
    (programmatic stream serialization) and the value 1, 8 bytes after the id."""
    config = launch.launch_config(blocks=7, threads=128, stream=0x1234)
    words = config.view(np.uint32)
    assert config.nbytes == 56 + 72
    assert list(words[:7]) == [7, 1, 1, 128, 1, 1, 0]
    assert int(config.view(np.uint64)[4]) == 0x1234                  # hStream at 32
    assert int(config.view(np.uint64)[5]) == config.ctypes.data + 56  # attrs at 40
    assert words[12] == 1                                             # numAttrs at 48
    assert (words[14], words[16]) == (6, 1)                           # id at 56, value at 64


def test_every_entry_point_waits_for_earlier_grids_first():
    for family in families.ALL:
        for stub in family.stubs().splitlines():
            body = stub[stub.index("{"):]
            assert body.startswith("{ await_earlier_grids(); dsv4::"), stub


def test_the_switch_returns_the_previous_setting():
    previous = d4.set_programmatic_launch(True)
    try:
        assert d4.set_programmatic_launch(False) is True
        assert d4.set_programmatic_launch(False) is False
    finally:
        d4.set_programmatic_launch(previous)


@pytest.mark.parametrize("value,enabled", [(None, False), ("0", False), ("1", True)])
def test_it_is_off_unless_the_environment_turns_it_on(value, enabled):
    env = {k: v for k, v in os.environ.items() if k != "DSV4_CUPY_PDL"}
    if value is not None:
        env["DSV4_CUPY_PDL"] = value
    code = "from dsv4_cupy import launch; print(launch.ProgrammaticLaunch.enabled)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == str(enabled)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy"] + (["torch_cuda"] if HAS_TORCH else []))
def test_a_chain_of_dependent_ops_eager(kind, programmatic):
    import cupy
    rng = np.random.default_rng(1)
    for _ in range(20):
        step = chain_step(rng)
        inputs = {name: to_kind(value, kind) for name, value in step.items()}
        outputs = [to_kind(array, kind) for array in chain_outputs()]
        run_chain(inputs, outputs)
        cupy.cuda.Device().synchronize()
        assert_chain(outputs, step)
    assert len(programmatic) == 3 * 20


