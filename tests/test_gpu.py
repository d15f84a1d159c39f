"""GPU-only behaviour: CUDA-graph capture and replay (torch and CuPy), streams,
warm-up, and the no-allocation rule. Correctness over the random grid is in
test_ops_reference.py and test_builder.py (parametrised over GPU kinds)."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4
from batches import make_batch
from checks import EXTRA_COLS, EXTRA_ROWS
from conftest import HAS_TORCH, to_kind, to_numpy
from test_builder import common_metadata

pytestmark = pytest.mark.gpu
WIDTH = 1024


def two_steps():
    """Two batches of the same shape (same query lengths), different values."""
    q = [1, 2, 2, 1, 37]
    first = make_batch(q, [10, 500, 70_000, 3, 9_000], rng=np.random.default_rng(1), pad_tokens=2,
                       table_cols=600, threshold=2)
    second = make_batch(q, [130_000, 255, 126, 127_000, 0], rng=np.random.default_rng(2),
                        pad_tokens=2, table_cols=600, threshold=2)
    return first, second


class Step:
    """Device inputs and poisoned outputs for the three ops, kept at fixed addresses."""

    def __init__(self, batch, kind):
        self.kind = kind
        self.nd = batch.split()[2]
        T = batch.num_tokens
        self.T = T
        self.inputs = dict(qsl=to_kind(batch.qsl, kind), seq=to_kind(batch.seq_lens, kind),
                           bt=to_kind(batch.block_table, kind), pos=to_kind(batch.positions, kind),
                           sm=to_kind(batch.slot_mapping, kind))
        self.req = to_kind(np.full(T + EXTRA_ROWS, -7, np.int32), kind)
        self.csm = to_kind(np.full(T + EXTRA_ROWS, -7, np.int64), kind)
        self.gd = to_kind(np.full((self.nd + 1, WIDTH + EXTRA_COLS), -7, np.int32), kind)
        self.lens = to_kind(np.full(self.nd + 1, -7, np.int32), kind)
        self.pf = to_kind(np.full((T - self.nd + 1, WIDTH + EXTRA_COLS), -7, np.int32), kind)

    def run(self):
        i = self.inputs
        d4.token_to_req_indices(i["qsl"], self.T, out=self.req)
        d4.get_compressed_slot_mapping(self.T, i["qsl"], i["seq"], i["bt"], 2, 128, out=self.csm)
        d4.build_c128a_topk_metadata(i["pos"], 128, self.nd, self.req, i["bt"], 2, i["sm"], self.gd,
                                     self.lens, self.pf, max_compressed_tokens=WIDTH)

    def load(self, batch):
        """Overwrite the inputs in place with another batch of the same shape."""
        for key, value in (("qsl", batch.qsl), ("seq", batch.seq_lens), ("bt", batch.block_table),
                           ("pos", batch.positions), ("sm", batch.slot_mapping)):
            target = self.inputs[key]
            target[...] = to_kind(value, self.kind)

    def results(self):
        return [to_numpy(x) for x in (self.req, self.csm, self.gd, self.lens, self.pf)]


def expected(batch, kind_like):
    """The same ops on the numpy CPU path (itself checked against the reference)."""
    step = Step(batch, "numpy")
    step.run()
    return step.results()


def assert_same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def torch_capture(fn):
    """Warm ``fn`` up on a side stream (compiles and loads), then capture it;
    returns the graph and what the captured call returned."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_graph_capture_replays_new_values():
    import torch
    first, second = two_steps()
    step = Step(first, "torch_cuda")
    graph, _ = torch_capture(step.run)
    step.load(second)
    graph.replay()
    torch.cuda.synchronize()
    assert_same(step.results(), expected(second, "numpy"))
    step.load(first)
    graph.replay()
    torch.cuda.synchronize()
    assert_same(step.results(), expected(first, "numpy"))


def test_cupy_graph_capture_replays_new_values():
    import cupy
    first, second = two_steps()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # Made on the stream: a non-blocking stream is not ordered after the
        # null stream, whose poison copies could land after the first run.
        step = Step(first, "cupy")
        step.run()
        stream.synchronize()
        stream.begin_capture()
        step.run()
        graph = stream.end_capture()
    with stream:                     # the copies must be ordered before the replay
        step.load(second)
    graph.launch(stream)
    stream.synchronize()
    assert_same(step.results(), expected(second, "numpy"))


def builder_results(md):
    return [to_numpy(x) for x in (md.req_id_per_token, md.slot_mapping,
                                  md.c128a_global_decode_topk_indices,
                                  md.c128a_decode_topk_lens, md.c128a_prefill_topk_indices)]


def expected_build(batch):
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 18, 64, num_speculative_tokens=1, like="numpy")
    return builder_results(builder.build(0, common_metadata(batch, "numpy")))


def copy_step(cm, batch, kind):
    for field, value in (("query_start_loc", batch.qsl), ("seq_lens", batch.seq_lens),
                         ("block_table_tensor", batch.block_table), ("positions", batch.positions),
                         ("slot_mapping", batch.slot_mapping)):
        getattr(cm, field)[...] = to_kind(value, kind)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_graph_capture_of_builder():
    import torch
    first, second = two_steps()
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 18, 64, num_speculative_tokens=1, like="torch")
    cm = common_metadata(first, "torch_cuda")
    graph, md = torch_capture(lambda: builder.build(0, cm))
    copy_step(cm, second, "torch_cuda")
    graph.replay()
    torch.cuda.synchronize()
    assert_same(builder_results(md), expected_build(second))


def test_cupy_graph_capture_of_builder():
    import cupy
    first, second = two_steps()
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 18, 64, num_speculative_tokens=1, like="cupy")
    cm = common_metadata(first, "cupy")
    cupy.cuda.Device().synchronize()     # the null stream's copies land before the stream's work
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        builder.build(0, cm)
        stream.synchronize()
        stream.begin_capture()
        md = builder.build(0, cm)
        graph = stream.end_capture()
    with stream:                     # the copies must be ordered before the replay
        copy_step(cm, second, "cupy")
    graph.launch(stream)
    stream.synchronize()
    assert_same(builder_results(md), expected_build(second))


def test_given_buffers_mean_no_allocation():
    import cupy
    first, _ = two_steps()
    step = Step(first, "cupy")
    step.run()
    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    for _ in range(3):
        step.run()
    assert pool.used_bytes() == before


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_side_stream_is_followed():
    import torch
    first, _ = two_steps()
    step = Step(first, "torch_cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run()
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()          # only the side stream is waited for
    assert_same(step.results(), expected(first, "numpy"))


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
    first, _ = two_steps()
    results = {}

    def work():
        step = Step(first, "cupy")
        step.run()
        results["got"] = step.results()
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert_same(results["got"], expected(first, "numpy"))
