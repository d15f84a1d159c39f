"""GPU-only behaviour: CUDA-graph capture and replay (torch and CuPy), streams,
warm-up, and the no-allocation rule. Correctness over the random grid is in
test_ops_reference.py and test_builder.py (parametrised over GPU kinds)."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

from conftest import HAS_TORCH
from helpers import (GroupOpsStep, LayerOpsStep, assert_all_equal, group_ops_expected,
                     group_ops_steps, layer_ops_expected, layer_step_inputs)

pytestmark = pytest.mark.gpu


def assert_reruns_allocate_nothing(step):
    """After a first run, three more runs of ``step`` leave CuPy's pool as it was."""
    import cupy
    step.run()
    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    for _ in range(3):
        step.run()
    assert pool.used_bytes() == before


def test_given_buffers_mean_no_allocation():
    first, _ = group_ops_steps()
    assert_reruns_allocate_nothing(GroupOpsStep(first, "cupy"))


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_side_stream_is_followed():
    import torch
    first, _ = group_ops_steps()
    step = GroupOpsStep(first, "torch_cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run()
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()          # only the side stream is waited for
    assert_all_equal(step.results(), group_ops_expected(first, "numpy"))


def test_warmup_compiles_every_entry_point():
    from dsv4_cupy import families
    done = d4.warmup()
    expected_names = {f"{f.file}:{n}" for f in families.ALL for n in f.entry_points()}
    assert set(done["gpu"]) == expected_names
    # One entry point per dtype variant of each family, none named twice.
    assert len(expected_names) == sum(len(f.variants) for f in families.ALL) == len(done["gpu"])


def test_backend_reports_current_device():
    cap = d4.DeepseekV4FlashMLABackend.check_device()
    assert cap.major in (9, 10)


def test_mixed_devices_or_kinds_raise():
    import cupy
    q = cupy.zeros(3, cupy.int32)
    with pytest.raises(TypeError, match="share kind and device"):
        d4.token_to_req_indices(q, 2, out=np.zeros(2, np.int32))
    if HAS_TORCH:
        import torch
        with pytest.raises(TypeError, match="share kind and device"):
            d4.token_to_req_indices(q, 2, out=torch.zeros(2, dtype=torch.int32, device="cuda"))


def test_results_export_to_torch_without_copy():
    if not HAS_TORCH:
        pytest.skip("torch not installed")
    import cupy
    out = d4.token_to_req_indices(cupy.asarray(np.array([0, 2, 5], np.int32)), 6)
    tensor = d4.to_torch(out)
    assert tensor.data_ptr() == out.data.ptr and tensor.is_cuda


def test_launch_from_a_new_thread():
    """Launch parameters and the device context are per thread."""
    import threading
    first, _ = group_ops_steps()
    results = {}

    def work():
        step = GroupOpsStep(first, "cupy")
        step.run()
        results["got"] = step.results()
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert_all_equal(results["got"], group_ops_expected(first, "numpy"))


def test_calls_with_every_output_given_allocate_nothing():
    step = LayerOpsStep("cupy", layer_step_inputs(3))
    assert_reruns_allocate_nothing(step)
    for got, want in zip(step.results(), layer_ops_expected(layer_step_inputs(3))):
        np.testing.assert_array_equal(got, want)
