"""Every kernel file compiles for sm_90 and sm_100 with NVRTC from PyPI, no GPU
needed; the loader's source preparation and environment errors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dsv4_cupy import errors, kernels

pytest.importorskip("cupy")
ARCHS = ["sm_90", "sm_100"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("file", kernels.kernel_files())
def test_kernel_compiles(file, arch):
    cubin = kernels.compile_for(file, arch)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000


def test_every_family_has_its_file_and_entry_points():
    assert kernels.kernel_files() == ["build_step.cu", "c128a.cu", "slot_mapping.cu",
                                      "token_map.cu"]
    names = {f: kernels.entry_points(f) for f in kernels.kernel_files()}
    assert names["token_map.cu"] == ["token_to_req_indices"]
    assert names["slot_mapping.cu"] == ["compressed_slot_mapping"]
    for prefix, file in (("c128a_topk_metadata", "c128a.cu"), ("build_step", "build_step.cu")):
        assert names[file] == [f"{prefix}_p{p}_s{s}" for p in (32, 64) for s in (32, 64)]


def test_source_inlines_includes_with_line_marks():
    text = kernels.source("c128a.cu")
    assert text.startswith('#line 1 "kernels/c128a.cu"')
    assert '#line 1 "kernels/common.cuh"' in text and '#line 1 "kernels/params.cuh"' in text
    assert "#include" not in text
    assert any(o.startswith("-DDSV4_KERNELS_HASH=0x") for o in kernels.options())


def test_compile_failure_names_file_arch_and_options(monkeypatch):
    monkeypatch.setattr(kernels, "source", lambda file: "this is not CUDA")
    with pytest.raises(errors.KernelCompileError) as info:
        kernels.compile_for("c128a.cu", "sm_90")
    message = str(info.value)
    assert "kernels/c128a.cu" in message and "sm_90" in message and "-std=c++17" in message


def test_bad_arch_is_a_value_error():
    with pytest.raises(ValueError, match="arch: expected a name like"):
        kernels.compile_for("c128a.cu", "hopper")


def test_missing_nvrtc_says_what_to_install(monkeypatch):
    import cupy

    def missing():
        raise RuntimeError("libnvrtc.so.13 not found")
    monkeypatch.setattr(cupy.cuda.nvrtc, "getVersion", missing)
    with pytest.raises(errors.NVRTCMissingError, match="pip install 'nvidia-cuda-nvrtc"):
        kernels.nvrtc_version()


def test_cli_compile_prints_a_table_and_fails_on_error():
    run = subprocess.run([sys.executable, "-m", "dsv4_cupy", "compile", "--arch", "sm_90",
                          "--arch", "sm_100"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 2 * len(kernels.kernel_files())
    bad = subprocess.run([sys.executable, "-m", "dsv4_cupy", "compile", "--arch", "sm_1"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1 and "FAILED" in bad.stdout
