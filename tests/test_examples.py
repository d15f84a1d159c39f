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


def test_torch_dlpack_without_torch_says_it_skips():
    """torch blocked from importing: the example says why it skips and exits 0."""
    script = ("import runpy, sys; sys.modules['torch'] = None; "
              f"sys.path.insert(0, {str(EXAMPLES)!r}); "
              f"runpy.run_path({str(EXAMPLES / 'torch_dlpack.py')!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "torch not installed" in result.stdout and "skipping this example" in result.stdout


def test_kv_cache_step():
    output = run_example("kv_cache_step.py")
    assert "RoPE exact" in output and "row for row the same" in output
    assert "shared with the numpy workspace" in output or "torch not installed" in output


def test_swa_c4a_step():
    """On the CPU path here; on the GPU (cupy) where there is one."""
    output = run_example("swa_c4a_step.py")
    assert "shared with torch without a copy" in output or "torch not installed" in output


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cupy_pipeline.py", "cuda_graph.py", "step_graph.py"])
def test_gpu_examples(name):
    assert "skipping this example" not in run_example(name)


@pytest.mark.gpu
def test_swa_c4a_step_runs_on_the_gpu():
    assert run_example("swa_c4a_step.py").startswith("GPU (cupy)")


def test_vllm_plugin():
    """Builds vLLM's C128A builder through its runner with the plugin: where vLLM is
    installed it prints the library's builder and metadata; elsewhere it says it skips."""
    out = run_example("vllm_plugin.py")
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert "vLLM is not installed; skipping this example" in out
        return
    assert "the runner's builder: dsv4_cupy.vllm.builders Dsv4CupyFlashMLAMetadataBuilder" in out
    assert "c128a_decode_topk_lens [8, 23]" in out
