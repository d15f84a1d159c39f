"""Every kernel family compiles for sm_90 and sm_100 with NVRTC from PyPI, no GPU
needed; the loader's source preparation and environment errors."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dsv4_cupy import (c128a, combine, device, errors, families, global_topk, loader,
                       short_context, slot_mapping, step_kernel, swa, token_map)
from dsv4_cupy.geometry import RUN_TIME

pytest.importorskip("cupy")
ARCHS = ["sm_90", "sm_100"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", families.ALL, ids=lambda f: f.function)
def test_kernel_compiles(family, arch):
    cubin = loader.compile_for(family, arch)
    assert cubin[:4] == b"\x7fELF" and len(cubin) > 1000
    for entry in family.entry_points():
        assert entry.encode() in cubin, f"{entry} missing from the {arch} cubin"


def test_every_kernel_file_belongs_to_a_family():
    assert sorted({f.file for f in families.ALL}) == loader.kernel_files()
    functions = [f.function for f in families.ALL]
    assert len(set(functions)) == len(functions)
    assert global_topk.COMPACT_FAMILY.file == global_topk.FAMILY.file


def test_entry_points_follow_the_declared_dtype_axes():
    assert token_map.FAMILY.entry_points() == ["token_to_req_indices"]
    assert slot_mapping.FAMILY.entry_points() == ["compressed_slot_mapping_s32",
                                                    "compressed_slot_mapping_s64"]
    assert c128a.FAMILY.entry_points() == [f"c128a_topk_metadata_p{p}_s{s}"
                                           for p in (32, 64) for s in (32, 64)]
    assert step_kernel.FAMILY.entry_points() == [f"step_metadata_p{p}_s{s}_r{r}"
                                                 for p in (32, 64) for s in (32, 64)
                                                 for r in (0, 1)]
    assert "step_metadata<long long, int, 1>(p)" in step_kernel.FAMILY.stubs()


def test_int_axes_compile_widths_in_beside_the_run_time_kernel():
    # Rows of four warps have a block of 128 threads each, a warp's rows share 256.
    assert swa.FAMILY.entry_points() == [f"swa_indices_and_lens_w{w}_b{b}_l{lanes}_t{threads}"
                                           for w in (0, 128) for b in (0, 64)
                                           for lanes, threads in ((32, 256), (128, 128))]
    assert global_topk.FAMILY.entry_points() == [
        f"global_topk_indices_and_lens_k{k}_b{b}_t{threads}"
        for k, threads in ((0, 256), (512, 128), (1024, 256)) for b in (0, 64)]
    assert [global_topk.FAMILY.threads(v) for v in global_topk.FAMILY.variants] == [
        256, 256, 128, 128, 256, 256]
    assert [swa.FAMILY.threads(v) for v in swa.FAMILY.variants] == [256, 128] * 4
    assert short_context.FAMILY.entry_points() == [
        f"fill_short_context_topk_indices_p{p}_l{lanes}_k{k}_r{r}_t{threads}" for p in (32, 64)
        for lanes, threads in ((32, 256), (128, 128)) for k in (0, 512, 1024) for r in (0, 4)]
    assert combine.FAMILY.entry_points() == [
        f"combine_topk_swa_indices_c{c}_w{w}_l{lanes}" for c in (0, 128, 640, 1152)
        for w in (0, 128) for lanes in ((32, 256) if c == 0 else (32,))]
    assert "swa_indices_and_lens<128, 0, 32, 256>(p)" in swa.FAMILY.stubs()
    assert ("fill_short_context_topk_indices<long long, 128, 512, 4, 128>(p)"
            in short_context.FAMILY.stubs())
    assert global_topk.COMPACT_FAMILY.entry_points() == ["global_topk_compact_indices_and_lens"]
    assert swa.FAMILY.compiled_in("window", 128) == 128
    assert swa.FAMILY.compiled_in("window", 127) == RUN_TIME
    assert global_topk.FAMILY.compiled_in("top_k", 1024) == 1024
    assert global_topk.FAMILY.compiled_in("block_size", 32) == RUN_TIME


def test_source_inlines_includes_with_line_marks_and_shared_constants():
    text = loader.source(c128a.FAMILY)
    assert text.startswith('#line 1 "kernels/c128a.cuh"')
    assert '#line 1 "kernels/common.cuh"' in text and '#line 1 "kernels/params.cuh"' in text
    assert "#include" not in text
    opts = loader.options()
    assert any(o.startswith("-DDSV4_KERNELS_HASH=0x") for o in opts)
    assert "-DDSV4_THREADS=256" in opts and "-DDSV4_PAD_SLOT_ID=-1" in opts
    assert "-DDSV4_WARP_LANES=32" in opts


def test_compile_failure_names_file_arch_and_options(monkeypatch):
    monkeypatch.setattr(loader, "file_source", lambda file: "this is not CUDA")
    with pytest.raises(errors.KernelCompileError) as info:
        loader.compile_for(c128a.FAMILY, "sm_90")
    message = str(info.value)
    assert "kernels/c128a.cu" in message and "sm_90" in message and "-std=c++17" in message


def test_bad_arch_is_a_value_error():
    with pytest.raises(ValueError, match="arch: expected a name like"):
        loader.compile_for(c128a.FAMILY, "hopper")


def test_missing_nvrtc_says_what_to_install(monkeypatch):
    import cupy

    def missing():
        raise RuntimeError("libnvrtc.so.13 not found")
    monkeypatch.setattr(cupy.cuda.nvrtc, "getVersion", missing)
    with pytest.raises(errors.NVRTCMissingError, match="pip install 'nvidia-cuda-nvrtc"):
        device.nvrtc_version()


def test_cli_compile_prints_a_table_and_fails_on_error():
    run = subprocess.run([sys.executable, "-m", "dsv4_cupy", "compile", "--arch", "sm_90",
                          "--arch", "sm_100"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 2 * len(families.ALL)
    bad = subprocess.run([sys.executable, "-m", "dsv4_cupy", "compile", "--arch", "90"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "argument --arch: expected a name like 'sm_90'" in bad.stderr and "got '90'" in bad.stderr
