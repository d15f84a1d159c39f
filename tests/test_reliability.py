"""Reliability and first use (issue 13): one named test per item."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import dsv4_cupy as d4

from conftest import HAS_GPU, HAS_TORCH, KINDS, to_kind, to_numpy
from helpers import POISON, common_metadata, make_batch, make_builder

I32, I64 = np.int32, np.int64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, env: dict | None = None, timeout: int = 300):
    environment = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=environment)


def numba_dispatchers():
    """Every numba dispatcher of the CPU path (both twins of parallel kernels)."""
    from numba.core.registry import CPUDispatcher

    from dsv4_cupy import cpu
    found = []
    for value in vars(cpu).values():
        if isinstance(value, cpu.ParallelKernel):
            found += value.variants()
        elif isinstance(value, CPUDispatcher):
            found.append(value)
    return found


# --- 1, 2: fork and threads -----------------------------------------------------------------
FORK_SCRIPT = """
    import os, numpy as np, dsv4_cupy as d4
    pos = np.arange(100, 5000, 37, dtype=np.int64)
    args = (pos, 128, 10, np.zeros(len(pos), np.int32),
            np.arange(64, dtype=np.int32).reshape(1, 64), 2, np.zeros(len(pos), np.int64))
    want = d4.build_c128a_topk_metadata(*args, max_compressed_tokens=256)
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 16, 256)
    qsl = np.array([0, 1, 41], np.int32)
    cm = d4.CommonAttentionMetadata(qsl, qsl, np.array([900, 60], np.int32),
                                    np.arange(128, dtype=np.int32).reshape(2, 64),
                                    np.zeros(41, np.int64), 2, 41, 40, 900,
                                    positions=np.concatenate([[899], np.arange(20, 60)]))
    builder.build(0, cm)
    pid = os.fork()
    if pid == 0:
        got = d4.build_c128a_topk_metadata(*args, max_compressed_tokens=256)
        builder.build(0, cm)
        os._exit(0 if all((a == b).all() for a, b in zip(got, want)) else 3)
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_runs_the_cpu_path_after_its_parent():
    run = run_python(FORK_SCRIPT)
    assert run.returncode == 0, run.stderr
    assert "child exit 0" in run.stdout, run.stdout + run.stderr


THREADS_SCRIPT = """
    import threading, numpy as np, numba, dsv4_cupy as d4
    pos = np.arange(0, 60000, 61, dtype=np.int64)
    args = (pos, 128, 100, np.zeros(len(pos), np.int32),
            np.arange(512, dtype=np.int32).reshape(1, 512), 2, np.zeros(len(pos), np.int64))
    want = [x.copy() for x in d4.build_c128a_topk_metadata(*args, max_compressed_tokens=512)]
    bad = []
    def worker():
        for _ in range(150):
            got = d4.build_c128a_topk_metadata(*args, max_compressed_tokens=512)
            if not all((a == b).all() for a, b in zip(got, want)):
                bad.append(1)
    threads = [threading.Thread(target=worker) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("layer", numba.threading_layer(), "bad", len(bad))
"""


@pytest.mark.parametrize("layer", ["workqueue", "omp", "tbb"])
def test_eight_threads_under_each_threading_layer(layer):
    run = run_python(THREADS_SCRIPT, env={"NUMBA_THREADING_LAYER": layer})
    if "No threading layer could be loaded" in run.stderr or (
            run.returncode != 0 and "threading layer" in run.stderr.lower()
            and "not available" in run.stderr.lower()):
        pytest.skip(f"numba's {layer} layer is not installed here")
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"layer {layer} bad 0" in run.stdout


# --- 3: split and num_reqs ----------------------------------------------------------------
def test_split_reads_num_reqs_and_refuses_a_short_token_count():
    cm = common_metadata(make_batch([1, 1], [10, 20]), "numpy")
    cm.query_start_loc_cpu = np.array([0, 1, 2, 2, 2], I32)       # longer than num_reqs + 1
    assert d4.split_decodes_and_prefills(cm) == (2, 0, 2, 0)
    qsl = np.array([0, 1, 2, 40], I32)
    with pytest.raises(ValueError, match="num_actual_tokens: expected at least the 2 decode "
                                         "tokens"):
        d4.split_decodes_and_prefills(qsl, num_actual_tokens=1)


# --- 4: builder views -----------------------------------------------------------------------
def test_a_view_changed_in_place_is_not_handed_out_again():
    builder = make_builder("numpy", 128, 1 << 16)
    cm = common_metadata(make_batch([1, 1], [300, 700]), "numpy")
    first = builder.build(0, cm)
    first.req_id_per_token.flags.writeable = False
    first.c128a_global_decode_topk_indices.shape = (2, 512)        # reshaped in place
    second = builder.build(0, cm)
    assert second.req_id_per_token.flags.writeable
    assert second.c128a_global_decode_topk_indices.shape == (2, 1, builder.width(700))
    third = builder.build(0, cm)                                    # untouched views are reused
    assert third.c128a_global_decode_topk_indices is second.c128a_global_decode_topk_indices


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_torch_views_reshaped_in_place_are_replaced():
    builder = make_builder("torch_cpu", 128, 1 << 16)
    cm = common_metadata(make_batch([1, 1], [300, 700]), "torch_cpu")
    builder.build(0, cm).c128a_decode_topk_lens.unsqueeze_(0)
    assert tuple(builder.build(0, cm).c128a_decode_topk_lens.shape) == (2,)


@pytest.mark.skipif(not HAS_TORCH, reason="needs torch")
def test_a_builder_made_under_inference_mode_builds_and_watches_its_views():
    import torch
    with torch.inference_mode():           # inference tensors have no version counter
        builder = make_builder("torch_cpu", 128, 1 << 16)
        cm = common_metadata(make_batch([1, 1], [300, 700]), "torch_cpu")
        builder.build(0, cm).c128a_decode_topk_lens.unsqueeze_(0)
        assert tuple(builder.build(0, cm).c128a_decode_topk_lens.shape) == (2,)


# --- 5: a failed build leaves the last step intact; one -1 rule -----------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_request_outside_the_table_gets_minus_one_not_another_requests_blocks(kind):
    batch = make_batch([1, 1, 1], [900, 5000, 700])
    cm = common_metadata(batch, kind)
    cm.block_table_tensor = to_kind(batch.block_table[:2], kind)    # request 2 has no row
    md = make_builder(kind, 128, 1 << 16, "capacity").build(0, cm)
    rows = to_numpy(md.c128a_global_decode_topk_indices)[:, 0]
    lens = to_numpy(md.c128a_decode_topk_lens)
    assert lens.tolist() == [7, 39, 0] and (rows[2] == -1).all()
    assert (rows[1, :39] == batch.block_table[1, np.arange(39) // 2] * 2 + np.arange(39) % 2).all()


def test_a_failed_full_build_names_the_field_and_writes_nothing():
    batch = make_batch([1, 1, 1], [900, 5000, 700])
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, width_policy="capacity",
                                           validate="full")
    builder.build(0, common_metadata(batch, "numpy"))
    before = {name: getattr(builder, name).copy() for name in (
        "req_id_per_token_buffer", "compressed_slot_mapping_buffer",
        "c128a_global_decode_buffer", "c128a_decode_lens_buffer", "c128a_prefill_buffer")}
    cm = common_metadata(make_batch([1, 1, 1], [100, 200, 300]), "numpy")
    cm.block_table_tensor = cm.block_table_tensor[:2]
    with pytest.raises(ValueError, match="block_table_tensor: expected a row for every request"):
        builder.build(0, cm)
    for name, value in before.items():
        np.testing.assert_array_equal(getattr(builder, name), value, err_msg=name)


# --- 6: alignment and strides ------------------------------------------------------------------
def test_a_misaligned_pointer_or_an_odd_stride_is_refused():
    raw = np.zeros(4 * 9 + 1, np.uint8)
    misaligned = np.ndarray((9,), I32, buffer=raw, offset=1)
    with pytest.raises(ValueError, match="out: expected an address aligned to the item size"):
        d4.token_to_req_indices(np.array([0, 3], I32), 9, out=misaligned)
    odd = np.lib.stride_tricks.as_strided(np.zeros(40, I32), shape=(3,), strides=(6,))
    with pytest.raises(ValueError, match="query_start_loc: expected strides that are multiples "
                                         "of the item size"):
        d4.token_to_req_indices(odd, 3)
    if HAS_TORCH:
        import torch
        with pytest.raises(ValueError, match="out: expected an address aligned"):
            d4.token_to_req_indices(torch.tensor([0, 3], dtype=torch.int32), 9,
                                    out=torch.from_numpy(misaligned))


def test_interleaved_column_slices_of_one_buffer_do_not_overlap():
    buffer = np.full((8, 512), POISON, I32)
    decode, prefill = buffer[:, :256], buffer[:, 256:]
    gd, _, pf = d4.build_c128a_topk_metadata(
        np.array([300, 400], I64), 128, 1, np.zeros(1, I32), np.arange(64, dtype=I32)[None], 2,
        np.zeros(2, I64), decode, np.zeros(4, I32), prefill, max_compressed_tokens=256)
    assert gd[0, :3].tolist() == [0, 1, -1] and pf[0, :4].tolist() == [0, 1, 2, -1]
    with pytest.raises(ValueError, match="prefill_buffer: output memory overlaps "
                                         "global_decode_buffer"):
        d4.build_c128a_topk_metadata(
            np.array([300, 400], I64), 128, 1, np.zeros(1, I32), np.arange(64, dtype=I32)[None],
            2, np.zeros(2, I64), buffer[:, :256], np.zeros(4, I32), buffer[:, 255:],
            max_compressed_tokens=256)


@pytest.mark.gpu
def test_a_misaligned_device_pointer_is_refused():
    import cupy
    base = cupy.zeros(40, cupy.uint8)
    misaligned = cupy.ndarray((9,), cupy.int32, base.data + 1)
    with pytest.raises(ValueError, match="out: expected an address aligned"):
        d4.token_to_req_indices(cupy.asarray(np.array([0, 3], I32)), 9, out=misaligned)


# --- 7: kernels after a device reset ------------------------------------------------------------
@pytest.mark.gpu
def test_kernels_reload_after_a_device_reset():
    run = run_python("""
        import ctypes, cupy, numpy as np, dsv4_cupy as d4
        # No memory pools: CuPy's own pools do not survive a reset; allocations
        # then come straight from the current context (often at the old addresses,
        # which is the case that must not launch a stale kernel handle).
        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)
        qsl = np.array([0, 2, 5], np.int32)
        out = cupy.zeros(6, cupy.int32)
        first = d4.token_to_req_indices(cupy.asarray(qsl), 6, out=out).get().tolist()
        cupy.cuda.runtime.deviceSynchronize()
        # What cudaDeviceReset does: the device's primary context is destroyed.
        assert ctypes.CDLL("libcuda.so.1").cuDevicePrimaryCtxReset_v2(0) == 0
        out = cupy.zeros(6, cupy.int32)
        second = d4.token_to_req_indices(cupy.asarray(qsl), 6, out=out).get().tolist()
        print(first == second == [0, 0, 1, 1, 1, 0])
    """)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("True")


@pytest.mark.gpu
def test_threads_read_the_context_id_each_into_its_own_storage():
    from concurrent.futures import ThreadPoolExecutor

    from dsv4_cupy import loader
    context = loader.current_context()
    expected = loader.read_context_id(context)

    def reads(_):
        loader.current_context()     # binds the primary context in a new thread
        return {loader.read_context_id(context) for _ in range(20_000)}

    with ThreadPoolExecutor(8) as pool:
        seen = set().union(*pool.map(reads, range(8)))
    assert expected != 0 and seen == {expected}


# --- 8, 9, 10: bounded work on garbage --------------------------------------------------------
def test_a_garbage_position_does_not_size_the_output():
    gd, _, pf = d4.build_c128a_topk_metadata(np.array([1 << 40, 5], I64), 128, 1,
                                            np.zeros(1, I32), np.zeros((1, 8), I32), 2,
                                            np.full(2, -1, I64))
    assert gd.shape == (1, 8192) and pf.shape == (1, 8192)


def test_a_garbage_query_layout_costs_no_more_than_the_output():
    start = time.perf_counter()
    out = d4.get_compressed_slot_mapping(4, None, np.array([-2**31, 2**31 - 1], I32),
                                         np.array([2**31 - 1], I32), np.zeros((1, 4), I32), 2, 128)
    assert time.perf_counter() - start < 1.0 and to_numpy(out).shape == (4,)


def test_an_interleave_larger_than_the_storage_block_is_refused():
    with pytest.raises(ValueError, match=r"cp_interleave // compress_ratio: expected a divisor "
                                         r"of the storage block size 2 when dcp_world_size > 1, "
                                         r"got 4"):
        d4.get_compressed_slot_mapping(4, None, np.array([0, 4], I32), np.array([4], I32),
                                       np.zeros((1, 4), I32), 2, 128, None, 2, 512, dcp_rank=0)
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size: expected a divisor"):
        d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, dcp_world_size=2,
                                     cp_kv_cache_interleave_size=64)


# --- 11: no compile after warmup ------------------------------------------------------------
def test_read_only_and_column_sliced_inputs_compile_nothing_after_warmup():
    d4.warmup(gpu=False, cpu=True)
    before = [len(f.signatures) for f in numba_dispatchers()]
    batch = make_batch([1, 2, 40], [100, 5000, 0], threshold=2)
    wide = np.zeros((batch.num_reqs, batch.block_table.shape[1] + 7), I32)
    wide[:, :batch.block_table.shape[1]] = batch.block_table
    table = wide[:, :batch.block_table.shape[1]]                    # any row stride
    positions = batch.positions.copy()
    positions.flags.writeable = False                               # read-only input
    outputs = np.full((60, 300), POISON, I32)
    d4.build_c128a_topk_metadata(positions, 128, 5, batch.token_map(), table, 2,
                                 batch.slot_mapping, outputs[:5, :256], np.zeros(5, I32),
                                 outputs[10:, :256])
    qsl = batch.qsl.copy()
    qsl.flags.writeable = False
    d4.get_compressed_slot_mapping(batch.num_tokens, batch.slot_mapping.astype(I32), qsl,
                                   batch.seq_lens, table, 2, 128)
    d4.token_to_req_indices(qsl, 9)
    cm = common_metadata(batch, "numpy")
    cm.block_table_tensor, cm.positions = table, positions
    make_builder("numpy", 128, 1 << 16, spec=1).build(0, cm)
    assert [len(f.signatures) for f in numba_dispatchers()] == before


# --- 12, 13: errors a first user meets ------------------------------------------------------------
def check_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("call,error,match", [
    (lambda: d4.token_to_req_indices(np.array([0, 2], I32), 2, out=_read_only(np.zeros(2, I32))),
     ValueError, "out: expected a writable array"),
    (lambda: d4.split_decodes_and_prefills(np.array([0, 1], I32), max_query_len="3"),
     TypeError, "max_query_len: expected an int, got str '3'"),
    (lambda: d4.get_compressed_slot_mapping(1, None, np.array([0, 1], I32), np.array([1], I32),
                                            np.zeros((1, 1), I32), 2, 128, validate="full",
                                            num_cache_blocks="10"),
     TypeError, "num_cache_blocks: expected an int"),
    (lambda: d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, device="0"),
     TypeError, "device: expected an int"),
    (lambda: d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, block_size=2**38),
     ValueError, r"block_size: expected a storage block \(block_size // compress_ratio\) of "
                 r"at most 1073741824, got 2147483648"),
    (lambda: d4.c128a_active_width(100, -128), ValueError, "capacity: expected an int >= 128"),
    (lambda: d4.c128a_capacity(-5), ValueError, "max_model_len: expected an int >= 1"),
    (lambda: d4.kv_cache_shape(4, -256, 1, 512), ValueError, "block_size: expected an int >= 1"),
    (lambda: d4.token_to_req_indices(np.zeros(0, I32), 1), ValueError,
     "query_start_loc: expected at least 1 elements, got shape"),
    (lambda: d4.token_to_req_indices(np.array([0, 1], I32), 10**13), MemoryError,
     r"out: cannot allocate \(10000000000000,\) int32"),
], ids=["read-only out", "max_query_len str", "num_cache_blocks str", "device str",
        "block_size huge", "negative capacity", "negative max_model_len",
        "negative block_size", "1-D rows wording", "huge num_tokens"])
def test_first_use_errors_name_the_argument(call, error, match):
    check_error(call, error, match)


def _read_only(array):
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("argv, flag", [
    (["compile", "--arch", "90"], "--arch"),
    (["demo", "--max-model-len", "100"], "--max-model-len"),
    (["demo", "--max-model-len", "lots"], "--max-model-len"),
    (["demo", "--device", "tpu"], "--device"),
])
def test_a_bad_argument_is_one_argparse_line_naming_the_flag(argv, flag):
    run = subprocess.run([sys.executable, "-m", "dsv4_cupy", *argv], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert f"error: argument {flag}:" in run.stderr.splitlines()[-1]


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message")
@pytest.mark.parametrize("argv", [["warmup", "--gpu"], ["demo", "--device", "gpu"]])
def test_a_library_error_is_one_line_unless_debug(argv):
    run = subprocess.run([sys.executable, "-m", "dsv4_cupy", *argv], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    line, = run.stderr.strip().splitlines()
    assert line.startswith(f"python -m dsv4_cupy {argv[0]}: NoGPUError: no usable CUDA device")
    assert line.endswith("(--debug shows the traceback)")
    debug = subprocess.run([sys.executable, "-m", "dsv4_cupy", *argv, "--debug"],
                           capture_output=True, text=True, timeout=300)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message")
def test_bench_without_a_gpu_points_to_cpu_only():
    run = subprocess.run([sys.executable, "-m", "dsv4_cupy", "bench"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "--cpu-only" in run.stderr and "no GPU or no NVIDIA driver" in run.stderr


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU message")
def test_no_gpu_error_says_no_gpu_was_found():
    from dsv4_cupy import device, errors
    pytest.importorskip("cupy")
    with pytest.raises(errors.NoGPUError, match="no GPU or no NVIDIA driver was found") as info:
        device.require_gpu()
    assert "insufficient" not in str(info.value)


# --- 14 is tests/test_readme.py; 15, 16 -------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio", [1, 4, 128])
def test_split_counts_for_every_ratio(kind, ratio):
    batch = make_batch([1, 2, 30], [500, 900, 60], ratio=ratio, threshold=2)
    md = make_builder(kind, ratio, 1 << 16, spec=1).build(0, common_metadata(batch, kind))
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == (
        2, 1, 3, 30)


def test_a_logical_block_passed_to_an_op_warns():
    """The logical block (256) where the ops take the storage block warns in
    either mode; another block than DeepSeek-V4's only under full validation."""
    import warnings
    args = (4, None, np.array([0, 4], I32), np.array([4], I32), np.zeros((1, 4), I32))
    logical = (r"block_size: the ops take the storage block, 256 // compress_ratio = 2 for "
               r"DeepSeek-V4, got 256 \(the logical block\?\)")
    c128a_args = (np.arange(4), 128, 4, np.zeros(4, I32), np.zeros((1, 4), I32))
    for validate in ("default", "full"):
        with pytest.warns(UserWarning, match=logical):
            d4.get_compressed_slot_mapping(*args, 256, 128, validate=validate)
        with pytest.warns(UserWarning, match=logical):
            d4.build_c128a_topk_metadata(*c128a_args, 256, np.zeros(4, np.int64),
                                         validate=validate)
    with pytest.warns(UserWarning, match="compress_ratio = 2 for DeepSeek-V4, got 8$"):
        d4.get_compressed_slot_mapping(*args, 8, 128, validate="full")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d4.get_compressed_slot_mapping(*args, 2, 128, validate="full")
        d4.get_compressed_slot_mapping(*args, 8, 128)
        d4.build_c128a_topk_metadata(*c128a_args, 2, np.zeros(4, np.int64))
