"""Programmatic dependent launch (``set_programmatic_launch``): the launch
configuration the driver reads, the switch, and on the GPU a chain of ops
that each read what the one before wrote, eager and in CUDA graphs, against
the CPU path with the outputs poisoned before every run."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import dsv4_cupy as d4
from conftest import HAS_TORCH, to_kind, to_numpy
from dsv4_cupy import families, launch

I32 = np.int32
POISON = 0x7A7A7A7A
REQUESTS, TOKENS, WINDOW, BLOCK, TABLE_COLS, TOP_K = 12, 40, 128, 64, 300, 512


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


def random_step(rng):
    """Query layout of REQUESTS requests over TOKENS tokens (one or more each),
    contexts, a few padding tokens and -1 table tails, the indexer's top-k."""
    cuts = np.sort(rng.choice(np.arange(1, TOKENS), REQUESTS - 1, replace=False))
    qsl = np.concatenate([[0], cuts, [TOKENS]]).astype(I32)
    seq = (np.diff(qsl) + rng.integers(0, TABLE_COLS * BLOCK - TOKENS, REQUESTS)).astype(I32)
    table = rng.integers(0, 1 << 20, (REQUESTS, TABLE_COLS)).astype(I32)
    table[:, rng.integers(100, TABLE_COLS):] = -1
    valid = rng.random(TOKENS) < 0.9
    topk = rng.integers(-1, TABLE_COLS * BLOCK // 4, (TOKENS, TOP_K)).astype(I32)
    return {"qsl": qsl, "seq": seq, "table": table, "valid": valid, "topk": topk}


def chain(inputs, outputs):
    """Token map, then SWA rows and global top-k rows that read the map."""
    token_map, swa_rows, swa_lens, topk_rows, topk_lens = outputs
    d4.token_to_req_indices(inputs["qsl"], TOKENS, out=token_map)
    d4.compute_swa_indices_and_lens(WINDOW, inputs["qsl"], inputs["seq"], token_map,
                                    inputs["valid"], inputs["table"], BLOCK,
                                    out=(swa_rows, swa_lens))
    d4.compute_global_topk_indices_and_lens(inputs["topk"], token_map, inputs["table"], BLOCK,
                                            inputs["valid"], out=(topk_rows, topk_lens))


def empty_outputs():
    return [np.full(shape, POISON, I32) for shape in
            ((TOKENS,), (TOKENS, 1, WINDOW), (TOKENS,), (TOKENS, TOP_K), (TOKENS,))]


def expected(step):
    outputs = empty_outputs()
    chain(step, outputs)
    return outputs


def assert_chain(outputs, step):
    for got, want in zip(outputs, expected(step)):
        np.testing.assert_array_equal(to_numpy(got), want)


@pytest.fixture
def programmatic(monkeypatch):
    """PDL on, launches through cuLaunchKernelEx counted."""
    assert launch.programmatic_launch_supported(0), "the H200 and driver 12.3+ have it"
    launch_ex = launch.cu_launch_kernel_ex()
    counted = []

    def counting(*args):
        counted.append(args[1])
        return launch_ex(*args)
    monkeypatch.setattr(launch, "cu_launch_kernel_ex", lambda: counting)
    previous = d4.set_programmatic_launch(True)
    yield counted
    d4.set_programmatic_launch(previous)


def refill(arrays, values, kind):
    for array, value in zip(arrays, values):
        array[...] = to_kind(value, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy"] + (["torch_cuda"] if HAS_TORCH else []))
def test_a_chain_of_dependent_ops_eager(kind, programmatic):
    import cupy
    rng = np.random.default_rng(1)
    for _ in range(20):
        step = random_step(rng)
        inputs = {name: to_kind(value, kind) for name, value in step.items()}
        outputs = [to_kind(array, kind) for array in empty_outputs()]
        chain(inputs, outputs)
        cupy.cuda.Device().synchronize()
        assert_chain(outputs, step)
    assert len(programmatic) == 3 * 20


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy"] + (["torch_cuda"] if HAS_TORCH else []))
def test_a_chain_of_dependent_ops_replayed_from_a_graph(kind, programmatic):
    """Captured once with PDL on, replayed with new inputs written in place and
    the outputs poisoned before each replay."""
    import cupy
    rng = np.random.default_rng(2)
    step = random_step(rng)
    inputs = {name: to_kind(value, kind) for name, value in step.items()}
    outputs = [to_kind(array, kind) for array in empty_outputs()]
    chain(inputs, outputs)                                  # compile, load, make the plans
    cupy.cuda.Device().synchronize()
    if kind == "cupy":
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            chain(inputs, outputs)
            graph = stream.end_capture()

        def replay():
            graph.launch(stream)
            stream.synchronize()
    else:
        import torch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(inputs, outputs)

        def replay():
            graph.replay()
            torch.cuda.synchronize()
    captured = len(programmatic)
    assert captured >= 3
    for _ in range(20):
        step = random_step(rng)
        refill([inputs[name] for name in step], step.values(), kind)
        refill(outputs, empty_outputs(), kind)
        cupy.cuda.Device().synchronize()
        replay()
        assert_chain(outputs, step)
    assert len(programmatic) == captured                    # replays launch nothing new
