"""A build that lives inside the caller's CUDA graph (torch and CuPy capture):
random steps of the captured shape, each replay checked against an eager build;
steps that do not fit the captured shape are refused by check_replay."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4
from batches import make_batch
from conftest import HAS_TORCH, to_kind, to_numpy
from test_builder import common_metadata

pytestmark = pytest.mark.gpu
REQUESTS, QUERY, MAX_MODEL_LEN, MAX_TOKENS, TABLE_COLS = 24, 2, 1 << 18, 256, 600
FIELDS = ("query_start_loc", "seq_lens", "block_table_tensor", "positions", "slot_mapping")


def uniform_step(rng):
    """A uniform decode step (MTP, 2 tokens per request) with 3 padding tokens."""
    prefixes = rng.integers(0, MAX_MODEL_LEN - QUERY, REQUESTS)
    return make_batch([QUERY] * REQUESTS, prefixes, rng=rng, pad_tokens=3,
                      pad_position=int(rng.integers(0, 1 << 20)), table_cols=TABLE_COLS,
                      threshold=QUERY)


def builder(kind, policy="active"):
    return d4.DeepseekV4MetadataBuilder(128, MAX_MODEL_LEN, MAX_TOKENS, num_speculative_tokens=1,
                                        width_policy=policy, like=to_kind(np.zeros(1, np.int32), kind))


def buffers(b):
    return [to_numpy(getattr(b, name)) for name in (
        "req_id_per_token_buffer", "compressed_slot_mapping_buffer", "c128a_global_decode_buffer",
        "c128a_decode_lens_buffer")]


def refresh(cm, batch, kind):
    """Write a new step into the captured buffers, in place."""
    for field, value in zip(FIELDS, (batch.qsl, batch.seq_lens, batch.block_table,
                                     batch.positions, batch.slot_mapping)):
        getattr(cm, field)[...] = to_kind(value, kind)
    cm.query_start_loc_cpu[...] = batch.qsl
    cm.max_seq_len = batch.max_seq_len


def replay_steps(kind, capture, replay, sync):
    rng = np.random.default_rng(11)
    first = uniform_step(rng)
    captured = builder(kind)
    cm = common_metadata(first, kind)
    captured.build(0, cm)                                   # warm up (compile, load)
    capture(lambda: captured.build_for_cudagraph_capture(cm))
    eager = builder(kind, "capacity")
    for _ in range(50):
        batch = uniform_step(rng)
        refresh(cm, batch, kind)
        captured.check_replay(cm)
        replay()
        eager.build(0, common_metadata(batch, kind))
        sync()
        for got, want in zip(buffers(captured), buffers(eager)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_graph_replays_fifty_random_steps_like_eager_builds():
    import torch
    graph = torch.cuda.CUDAGraph()

    def capture(fn):
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            fn()

    replay_steps("torch_cuda", capture, graph.replay, torch.cuda.synchronize)


def test_cupy_graph_replays_fifty_random_steps_like_eager_builds():
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs = []

    def capture(fn):
        with stream:
            stream.begin_capture()
            fn()
            graphs.append(stream.end_capture())

    def replay():
        cupy.cuda.Device().synchronize()     # refresh's copies (null stream) land first
        graphs[0].launch(stream)

    replay_steps("cupy", capture, replay, stream.synchronize)


@pytest.mark.parametrize("kind", ["cupy"] + (["torch_cuda"] if HAS_TORCH else []))
def test_a_step_that_does_not_fit_the_captured_shape_is_refused(kind):
    rng = np.random.default_rng(3)
    captured = builder(kind)
    cm = common_metadata(uniform_step(rng), kind)
    with pytest.raises(ValueError, match="check_replay: nothing was captured"):
        captured.check_replay(cm)
    captured.build_for_cudagraph_capture(cm)              # not in a graph: checks only
    captured.check_replay(cm)
    fewer = common_metadata(make_batch([QUERY] * 3, [10, 20, 30], table_cols=TABLE_COLS), kind)
    with pytest.raises(ValueError, match="expected the captured shape num_reqs=24"):
        captured.check_replay(fewer)
    moved = common_metadata(uniform_step(rng), kind)      # same shape, other buffers
    with pytest.raises(ValueError, match="expected the buffers the graph was captured with"):
        captured.check_replay(moved)
    cm.max_query_len = 40
    with pytest.raises(ValueError, match="max_query_len: expected a uniform decode step"):
        captured.check_replay(cm)
    mixed = common_metadata(make_batch([1, 40], [10, 20]), kind)
    with pytest.raises(ValueError, match="a captured build needs a uniform decode batch"):
        builder(kind).build_for_cudagraph_capture(mixed)
