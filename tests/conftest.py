"""Test set-up: the GPU marker, array-kind helpers and the path to reference.py."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _gpu_capability():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() > 0:
            return int(cupy.cuda.Device(0).compute_capability)
    except Exception:
        pass
    return None


GPU_CC = _gpu_capability()
HAS_GPU = GPU_CC is not None

try:
    import torch  # noqa: F401
    HAS_TORCH = True
except ImportError:
    HAS_TORCH = False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "arch_hopper" in item.keywords and GPU_CC is not None and GPU_CC // 10 != 9:
            item.add_marker(pytest.mark.skip(reason="needs an sm_90 device"))
        if "arch_blackwell" in item.keywords and (GPU_CC is None or GPU_CC // 10 != 10):
            item.add_marker(pytest.mark.skip(reason="needs an sm_100 device"))


def pytest_terminal_summary(terminalreporter):
    """The skips in one line, by reason (the reasons of -rs, without a line each)."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons: dict = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.write_line(f"{len(skipped)} skipped: " + "; ".join(
        f"{count} {reason}" for reason, count in sorted(reasons.items(), key=lambda x: -x[1])))


def to_kind(x, kind):
    """numpy -> the array kind under test (a copy on GPU)."""
    if kind == "numpy":
        return np.array(x, copy=True)
    if kind == "cupy":
        import cupy
        return cupy.asarray(x)
    import torch
    tensor = torch.from_numpy(np.array(x, copy=True))
    return tensor.cuda() if kind == "torch_cuda" else tensor


def to_numpy(x):
    if x is None or isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("cupy"):
        return x.get()
    return x.cpu().numpy()


HOST_KINDS = ["numpy"] + (["torch_cpu"] if HAS_TORCH else [])
GPU_KINDS = ["cupy"] + (["torch_cuda"] if HAS_TORCH else [])
#: Every kind, the GPU ones marked (skipped without a device).
KINDS = HOST_KINDS + [pytest.param(k, marks=pytest.mark.gpu) for k in GPU_KINDS]


@pytest.fixture
def programmatic(monkeypatch):
    """PDL on, launches through cuLaunchKernelEx counted."""
    import dsv4_cupy as d4
    from dsv4_cupy import launch
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
