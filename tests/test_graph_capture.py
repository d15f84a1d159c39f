"""CUDA-graph capture and replay of every builder and op (torch and CuPy
graphs): each capture is replayed with new values written in place into the
captured arrays, and every replay equals an eager build or the CPU path.
Steps that do not fit a captured shape are refused by check_replay."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

from conftest import GPU_KINDS, HAS_TORCH, to_kind, to_numpy
from helpers import (GroupOpsStep, LayerOpsStep, assert_all_equal, assert_chain, builder_results,
                     capture_and_replay, chain_outputs, chain_step, common_metadata, expected_build,
                     group_ops_expected, group_ops_steps, layer_ops_expected, layer_step_inputs,
                     make_batch, make_step, random_bf16, refill_arrays, refresh_group_step,
                     run_chain, torch_capture)

pytestmark = pytest.mark.gpu
I32 = np.int32
STEP_MAX_MODEL_LEN, STEP_MAX_TOKENS, SPEC = 8192, 1024, 1
REQUESTS, QUERY, BUILDER_MAX_MODEL_LEN, BUILDER_MAX_TOKENS, TABLE_COLS = 24, 2, 1 << 18, 256, 600
FIELDS = ("query_start_loc", "seq_lens", "block_table_tensor", "positions", "slot_mapping")


def uniform_step(rng):
    """A uniform decode step (MTP, 2 tokens per request) with 3 padding tokens."""
    prefixes = rng.integers(0, BUILDER_MAX_MODEL_LEN - QUERY, REQUESTS)
    return make_batch([QUERY] * REQUESTS, prefixes, rng=rng, pad_tokens=3,
                      pad_position=int(rng.integers(0, 1 << 20)), table_cols=TABLE_COLS,
                      threshold=QUERY)


def builder(kind, policy="active"):
    return d4.DeepseekV4MetadataBuilder(128, BUILDER_MAX_MODEL_LEN, BUILDER_MAX_TOKENS, num_speculative_tokens=1,
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


# --- the C128A group's ops and builder ---

@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_graph_capture_replays_new_values():
    import torch
    first, second = group_ops_steps()
    step = GroupOpsStep(first, "torch_cuda")
    graph, _ = torch_capture(step.run)
    step.load(second)
    graph.replay()
    torch.cuda.synchronize()
    assert_all_equal(step.results(), group_ops_expected(second, "numpy"))
    step.load(first)
    graph.replay()
    torch.cuda.synchronize()
    assert_all_equal(step.results(), group_ops_expected(first, "numpy"))


def test_cupy_graph_capture_replays_new_values():
    import cupy
    first, second = group_ops_steps()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # Made on the stream: a non-blocking stream is not ordered after the
        # null stream, whose poison copies could land after the first run.
        step = GroupOpsStep(first, "cupy")
        step.run()
        stream.synchronize()
        stream.begin_capture()
        step.run()
        graph = stream.end_capture()
    with stream:                     # the copies must be ordered before the replay
        step.load(second)
    graph.launch(stream)
    stream.synchronize()
    assert_all_equal(step.results(), group_ops_expected(second, "numpy"))


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_graph_capture_of_builder():
    import torch
    first, second = group_ops_steps()
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 18, 64, num_speculative_tokens=1, like="torch")
    cm = common_metadata(first, "torch_cuda")
    graph, md = torch_capture(lambda: builder.build(0, cm))
    refresh_group_step(cm, second, "torch_cuda")
    graph.replay()
    torch.cuda.synchronize()
    assert_all_equal(builder_results(md), expected_build(second))


def test_cupy_graph_capture_of_builder():
    import cupy
    first, second = group_ops_steps()
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
        refresh_group_step(cm, second, "cupy")
    graph.launch(stream)
    stream.synchronize()
    assert_all_equal(builder_results(md), expected_build(second))


# --- the per-layer and indexer ops ---

@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_graph_capture_of_every_op_replays_new_values():
    import torch
    first, second = layer_step_inputs(1), layer_step_inputs(2)
    step = LayerOpsStep("torch_cuda", first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run()                              # compiles and loads outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    for inputs in (second, first):
        step.load(inputs)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(step.results(), layer_ops_expected(inputs)):
            np.testing.assert_array_equal(got, want)


# --- the step builder ---

@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_a_captured_step_replays_new_values_like_an_eager_build(kind):
    """50 replays of random decode steps of the captured shape, each against an
    eager build of the same step."""
    import cupy
    rng = np.random.default_rng(8)
    like = to_kind(np.zeros(1, I32), kind)
    captured = d4.DeepseekV4StepMetadataBuilder(STEP_MAX_MODEL_LEN, STEP_MAX_TOKENS,
                                                num_speculative_tokens=SPEC, like=like)
    eager = d4.DeepseekV4StepMetadataBuilder(STEP_MAX_MODEL_LEN, STEP_MAX_TOKENS,
                                             num_speculative_tokens=SPEC, like=like,
                                             width_policy="capacity")
    cms = make_step(rng, 8, [], 2, False, kind, decode_len=2)
    stream = cupy.cuda.Stream(non_blocking=True)
    if kind == "cupy":
        cupy.cuda.Device().synchronize()     # the null stream's copies land before the stream's work
        with stream:
            captured.build(0, cms, capturing=True)
            stream.begin_capture()
            got = captured.build_for_cudagraph_capture(cms)
            graph = stream.end_capture()

        def replay():
            cupy.cuda.Device().synchronize()     # the refresh's copies (null stream) land first
            graph.launch(stream)

        sync = stream.synchronize
    else:
        import torch
        torch_graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            captured.build(0, cms, capturing=True)
        torch.cuda.synchronize()
        with torch.cuda.graph(torch_graph):
            got = captured.build_for_cudagraph_capture(cms)
        replay, sync = torch_graph.replay, torch.cuda.synchronize
    for _ in range(50):
        fresh = make_step(rng, 8, [], 2, False, "numpy", decode_len=2)
        for group, cm in cms.items():       # refresh the captured arrays in place
            new = fresh[group]
            for name in ("block_table_tensor", "slot_mapping"):
                getattr(cm, name)[...] = to_kind(getattr(new, name), kind)
            cm.max_seq_len, cm.max_query_len = new.max_seq_len, new.max_query_len
            cm.query_start_loc_cpu[...] = new.query_start_loc_cpu
        cms["c128a"].query_start_loc[...] = to_kind(fresh["c128a"].query_start_loc_cpu, kind)
        cms["c128a"].seq_lens[...] = to_kind(fresh["c128a"].seq_lens_cpu, kind)
        cms["c128a"].positions[...] = to_kind(np.asarray(fresh["c128a"].positions), kind)
        captured.check_replay(cms)
        replay()
        sync()
        want = eager.build(0, cms, capturing=True)
        for field in ("req_id_per_token", "is_valid_token", "swa_decode_indices",
                      "swa_decode_lens", "c4a_slot_mapping", "indexer_slot_mapping",
                      "indexer_context_lens", "indexer_req_ids", "indexer_block_rows"):
            np.testing.assert_array_equal(to_numpy(getattr(got, field)),
                                          to_numpy(getattr(want, field)), err_msg=field)
        for field in ("c128a_global_decode_topk_indices", "c128a_decode_topk_lens"):
            np.testing.assert_array_equal(to_numpy(getattr(got.c128a, field)),
                                          to_numpy(getattr(want.c128a, field)), err_msg=field)
    bigger = make_step(rng, 9, [], 2, False, kind, decode_len=2)
    with pytest.raises(ValueError, match="captured shape"):
        captured.check_replay(bigger)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_a_capture_needs_groups_that_share_the_query_objects(kind):
    """Other objects over the same memory pass the build's checks, but a
    capture could not tell later arrays apart from them: it is refused before
    anything is recorded."""
    rng = np.random.default_rng(10)
    builder = d4.DeepseekV4StepMetadataBuilder(STEP_MAX_MODEL_LEN, STEP_MAX_TOKENS,
                                               num_speculative_tokens=SPEC,
                                               like=to_kind(np.zeros(1, I32), kind))
    cms = make_step(rng, 4, [], 0, False, kind, decode_len=2)
    cms["swa"].query_start_loc = cms["c128a"].query_start_loc[:]   # same memory, new object
    builder.build(0, cms)                                          # eager: accepted
    with pytest.raises(ValueError, match="captured build needs"):
        builder.build_for_cudagraph_capture(cms)
    with pytest.raises(ValueError, match="nothing was captured"):
        builder.check_replay(cms)


# --- a chain of dependent ops with programmatic dependent launch ---

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["cupy"] + (["torch_cuda"] if HAS_TORCH else []))
def test_a_chain_of_dependent_ops_replayed_from_a_graph(kind, programmatic):
    """Captured once with PDL on, replayed with new inputs written in place and
    the outputs poisoned before each replay."""
    import cupy
    rng = np.random.default_rng(2)
    step = chain_step(rng)
    inputs = {name: to_kind(value, kind) for name, value in step.items()}
    outputs = [to_kind(array, kind) for array in chain_outputs()]
    run_chain(inputs, outputs)                                  # compile, load, make the plans
    cupy.cuda.Device().synchronize()
    if kind == "cupy":
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            run_chain(inputs, outputs)
            graph = stream.end_capture()

        def replay():
            graph.launch(stream)
            stream.synchronize()
    else:
        import torch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_chain(inputs, outputs)

        def replay():
            graph.replay()
            torch.cuda.synchronize()
    captured = len(programmatic)
    assert captured >= 3
    for _ in range(20):
        step = chain_step(rng)
        refill_arrays([inputs[name] for name in step], step.values(), kind)
        refill_arrays(outputs, chain_outputs(), kind)
        cupy.cuda.Device().synchronize()
        replay()
        assert_chain(outputs, step)
    assert len(programmatic) == captured                    # replays launch nothing new


@pytest.mark.parametrize("gather", ["prefill_kv", "one_cache"])
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_a_captured_insert_and_gather_replay_new_keys_like_the_cpu_path(kind, gather):
    """quantize_and_insert_k_cache then dequantize_and_gather_prefill_kv (or
    dequantize_and_gather_k_cache at an offset) captured once, replayed with new
    keys, slots and lengths written into the captured arrays; each replay's cache
    and workspace equal the CPU path's."""
    rng = np.random.default_rng(21)
    tokens, requests, ratio, N, M = 40, 3, 4, 16, 16 + 70
    pages_host = np.full((24, 37440), 165, np.uint8)
    tables = rng.permutation(24).astype(I32).reshape(3, 8)

    def new_step():
        slots = rng.permutation(24 * 64)[:tokens].astype(np.int64)
        seq = rng.integers(100, 250, requests).astype(I32)         # inside 4 blocks of 64
        lens = np.minimum(rng.integers(1, 70, requests), seq).astype(I32)
        return random_bf16(rng, tokens, 512), slots, seq, lens

    def step(arrays, pages, out, tables_of):
        k, slots, seq, lens = arrays
        d4.quantize_and_insert_k_cache(k, pages, slots, 64)
        if gather == "prefill_kv":
            d4.dequantize_and_gather_prefill_kv(out, pages, tables_of[0], pages, tables_of[1],
                                                seq, lens, ratio, N, compressed_block_size=64)
        else:
            d4.dequantize_and_gather_k_cache(out, pages, seq, lens, tables_of[1], 64, N)

    first, second = new_step(), new_step()
    device = [to_kind(x, kind) for x in first]
    out_host = np.full((requests, M, 512), 7, np.uint16)
    pages, out = to_kind(pages_host, kind), to_kind(out_host, kind)
    host_tables = (tables[:, :4].copy(), tables[:, 4:].copy())
    tables_of = tuple(to_kind(t, kind) for t in host_tables)
    capture_and_replay(kind, lambda: step(device, pages, out, tables_of), device, second,
                       [(pages, pages_host), (out, out_host)])
    want_pages, want_out = pages_host.copy(), out_host.copy()
    step(second, want_pages, want_out, host_tables)
    np.testing.assert_array_equal(to_numpy(pages), want_pages)
    np.testing.assert_array_equal(to_numpy(out), want_out)


@pytest.mark.parametrize("kind", GPU_KINDS)
def test_a_captured_indexer_insert_and_gather_replay_like_the_cpu_path(kind):
    """indexer_k_quant_and_cache then cp_gather_indexer_k_quant_cache captured
    once, replayed with new keys, slots and request bounds; the replay's pages,
    keys and scales equal the CPU path's."""
    rng = np.random.default_rng(22)
    tokens, num_pages = 30, 6
    pages_host = np.full((num_pages, 8640), 165, np.uint8)
    table = rng.permutation(num_pages).astype(I32).reshape(3, 2)

    def new_step():
        slots = rng.permutation(num_pages * 64)[:tokens].astype(np.int64)
        bounds = np.concatenate([[0], np.sort(rng.integers(0, 100, 3))]).astype(I32)
        return random_bf16(rng, tokens, 128), slots, bounds

    def step(arrays, pages, dst_k, dst_scale, table):
        k, slots, bounds = arrays
        cache = d4.kv_cache_view(pages, "indexer")
        d4.indexer_k_quant_and_cache(k, cache, slots, 128, "ue8m0")
        d4.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale, table, bounds)

    first, second = new_step(), new_step()
    device = [to_kind(x, kind) for x in first]
    k_host, scale_host = np.full((100, 128), 123, np.uint8), np.full((100, 4), 123, np.uint8)
    pages, dst_k, dst_scale = (to_kind(x, kind) for x in (pages_host, k_host, scale_host))
    device_table = to_kind(table, kind)
    capture_and_replay(kind, lambda: step(device, pages, dst_k, dst_scale, device_table), device,
                       second, [(pages, pages_host), (dst_k, k_host), (dst_scale, scale_host)])
    want = [x.copy() for x in (pages_host, k_host, scale_host)]
    step(second, *want, table)
    for got, expected in zip((pages, dst_k, dst_scale), want):
        np.testing.assert_array_equal(to_numpy(got), expected)
