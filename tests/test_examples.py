"""The example scripts run as a user runs them: python examples/<name>.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_numpy_pipeline():
    run_example("numpy_pipeline.py")


def test_torch_dlpack():
    pytest.importorskip("torch")
    run_example("torch_dlpack.py")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cupy_pipeline.py", "cuda_graph.py"])
def test_gpu_examples(name):
    assert "skipping this example" not in run_example(name)
