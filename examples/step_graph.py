"""A whole DeepSeek-V4 step's metadata inside a CUDA graph, with a consumer,
replayed step after step with new values.

``DeepseekV4StepMetadataBuilder.build_for_cudagraph_capture`` records one
kernel launch that writes every group's decode metadata (token map, SWA rows,
C4A and indexer slot mappings, indexer decode metadata, C128A rows). A
consumer kernel (here a sum of every row's lengths) is captured after it.
Each step refreshes the captured input arrays in place on the graph's stream
(a refresh on another stream races the replay), asks ``check_replay``
whether the step fits, replays, and compares against an eager numpy build.
GPU only: without a GPU it prints a message and exits 0.

Run:  python examples/step_graph.py
"""
import numpy as np

import dsv4_cupy as d4
from dsv4_cupy.device import has_gpu

MAX_MODEL_LEN, MAX_TOKENS = 1 << 17, 256
REQUESTS, QUERY, PADDING = 8, 2, 4           # MTP decodes, 4 graph-padding tokens
TOKENS = REQUESTS * QUERY + PADDING
COLUMNS = {"swa": MAX_MODEL_LEN // 64, "c4a": MAX_MODEL_LEN // 256,
           "indexer": MAX_MODEL_LEN // 256, "c128a": MAX_MODEL_LEN // 256}


def make_step(seed):
    """Numpy arrays of one uniform decode step of the captured shape, per group."""
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(QUERY, MAX_MODEL_LEN, REQUESTS).astype(np.int32)
    qsl = np.arange(0, (REQUESTS + 1) * QUERY, QUERY, dtype=np.int32)
    positions = np.concatenate([np.arange(s - QUERY, s) for s in seq_lens] +
                               [np.zeros(PADDING, int)]).astype(np.int64)
    groups = {}
    for group, columns in COLUMNS.items():
        slots = rng.integers(0, 1 << 30, TOKENS).astype(np.int64)
        slots[REQUESTS * QUERY:] = -1
        groups[group] = d4.CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.copy(), seq_lens=seq_lens,
            block_table_tensor=rng.integers(0, 50_000, (REQUESTS, columns), dtype=np.int32),
            slot_mapping=slots, positions=positions, num_reqs=REQUESTS, num_actual_tokens=TOKENS,
            max_query_len=QUERY, max_seq_len=int(seq_lens.max()))
    return groups


def on_device(groups, cupy):
    """The step's arrays on the GPU, the shared ones shared between the groups."""
    shared = {name: cupy.asarray(getattr(groups["c128a"], name))
              for name in ("query_start_loc", "seq_lens", "positions")}
    out = {}
    for group, cm in groups.items():
        out[group] = d4.CommonAttentionMetadata(**{**cm.__dict__, **shared,
            "block_table_tensor": cupy.asarray(cm.block_table_tensor),
            "slot_mapping": cupy.asarray(cm.slot_mapping)})
    return out


def main():
    if not has_gpu():
        print("no usable CUDA device: CUDA graphs need one; skipping this example")
        return
    import cupy
    d4.warmup()
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=QUERY - 1, like="cupy")
    reference = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                                 num_speculative_tokens=QUERY - 1,
                                                 width_policy="capacity", like="numpy")
    captured = on_device(make_step(0), cupy)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        builder.build(0, captured, capturing=True)          # loads everything before capture
        stream.begin_capture()
        metadata = builder.build_for_cudagraph_capture(captured)
        total = (metadata.swa_decode_lens.sum(dtype=cupy.int64)        # the consumer
                 + metadata.c128a.c128a_decode_topk_lens.sum(dtype=cupy.int64)
                 + metadata.indexer_context_lens.sum(dtype=cupy.int64))
        graph = stream.end_capture()
        for seed in range(1, 21):
            step = make_step(seed)
            for group, cm in captured.items():     # refresh in place, on the graph's stream
                new = step[group]
                cm.block_table_tensor[...] = cupy.asarray(new.block_table_tensor)
                cm.slot_mapping[...] = cupy.asarray(new.slot_mapping)
                cm.max_seq_len = new.max_seq_len
            captured["c128a"].seq_lens[...] = cupy.asarray(step["c128a"].seq_lens)
            captured["c128a"].positions[...] = cupy.asarray(step["c128a"].positions)
            builder.check_replay(captured)
            graph.launch(stream)
            stream.synchronize()
            want = reference.build(0, step, capturing=True)
            for field in ("req_id_per_token", "swa_decode_indices", "c4a_slot_mapping",
                          "indexer_slot_mapping", "indexer_block_rows"):
                assert np.array_equal(getattr(metadata, field).get(), getattr(want, field)), field
            assert np.array_equal(metadata.c128a.c128a_global_decode_topk_indices.get(),
                                  want.c128a.c128a_global_decode_topk_indices)
            expected = (int(want.swa_decode_lens.sum())
                        + int(want.c128a.c128a_decode_topk_lens.sum())
                        + int(want.indexer_context_lens.sum()))
            assert int(total.get()) == expected
    print("20 replays of the whole-step build and its consumer equal eager numpy builds")


if __name__ == "__main__":
    main()
