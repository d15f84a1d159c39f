"""Environment faults give one clear error or warning saying what to do."""
from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest

import dsv4_cupy as d4
from dsv4_cupy import device, errors, families, spec

from conftest import HAS_GPU


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU error")
def test_no_gpu_is_a_typed_error():
    with pytest.raises(errors.NoGPUError, match="no usable CUDA device"):
        device.require_gpu()
    with pytest.raises(errors.NoGPUError):
        d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, like="cupy")
    with pytest.raises(errors.NoGPUError):
        d4.DeepseekV4FlashMLABackend.check_device()


def test_unsupported_gpu_warns_once_or_raises_when_strict(monkeypatch):
    monkeypatch.setattr(spec.DeepseekV4FlashMLABackend, "current_device_capability",
                        classmethod(lambda cls: spec.DeviceCapability(12, 0)))
    monkeypatch.setattr(spec, "_warned", set())
    with pytest.warns(UserWarning, match="supports compute capability 9.x and 10.x"):
        d4.DeepseekV4FlashMLABackend.check_device()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d4.DeepseekV4FlashMLABackend.check_device()          # once only
    with pytest.raises(errors.UnsupportedDeviceError, match="sm_120"):
        d4.DeepseekV4FlashMLABackend.check_device(strict=True)


def test_import_needs_neither_cupy_nor_torch():
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['torch'] = None; "
            "import numpy as np, dsv4_cupy as d; "
            "print(d.token_to_req_indices(np.array([0, 2], np.int32), 3).tolist())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[0, 0, 0]"


def test_cli_help_and_info():
    run = subprocess.run([sys.executable, "-m", "dsv4_cupy", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0
    for command in ("info", "compile", "warmup", "demo", "bench"):
        assert command in run.stdout
    info = subprocess.run([sys.executable, "-m", "dsv4_cupy", "info"], capture_output=True,
                          text=True, timeout=120)
    assert info.returncode == 0 and "dsv4_cupy 0.1.0" in info.stdout


def test_demo_runs_on_this_machine():
    run = subprocess.run([sys.executable, "-m", "dsv4_cupy", "demo", "--max-model-len", "65536"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "split: 64 decodes (128 tokens), 2 prefills (4096 tokens)" in run.stdout
    assert "C128A: decode rows (128, 1, 512)" in run.stdout


def test_cpu_warmup_covers_every_kernel_and_dtype():
    """warmup(cpu=True) names every kernel that families.CPU_KERNELS declares, each dtype
    variant once, and leaves no dispatcher (or parallel kernel's twin) uncompiled."""
    from dsv4_cupy import cpu
    done = d4.warmup(gpu=False, cpu=True)
    assert done["gpu"] == [] and len(set(done["cpu"])) == len(done["cpu"])
    names = {kernel.__name__.removeprefix("cpu_") for kernel in families.CPU_KERNELS}
    assert {name.split("[")[0] for name in done["cpu"]} == names
    variants = {"compressed_slot_mapping": 2, "c128a_topk_metadata": 4,
                "fill_short_context_topk_indices": 2, "step_validity": 2,
                "quantize_and_insert_k_cache": 2, "indexer_k_quant_and_cache": 2,
                "indexer_prefill_chunk_metadata": 2}   # dtype axes
    for kernel in families.CPU_KERNELS:
        name = kernel.__name__.removeprefix("cpu_")
        named = [entry for entry in done["cpu"] if entry.split("[")[0] == name]
        assert len(named) == variants.get(name, 1), name
        twins = kernel.variants() if isinstance(kernel, cpu.ParallelKernel) else (kernel,)
        assert all(len(twin.signatures) >= len(named) for twin in twins), kernel.__name__


def test_warmup_counts_on_stderr_when_asked_and_is_silent_when_not(capsys):
    d4.warmup(gpu=False, cpu=True, progress=True)
    err = capsys.readouterr().err
    assert "\rwarmup: CPU kernels 1 (" in err
    assert re.search(r"\rwarmup: warmed 0 GPU and \d+ CPU kernels, \d+ host planners *\n$", err)
    d4.warmup(gpu=False, cpu=True, progress=False)
    assert capsys.readouterr().err == ""
