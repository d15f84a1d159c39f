"""A metadata build that lives inside a CUDA graph, with a consumer, replayed
step after step with new values.

``build_for_cudagraph_capture`` records the builder's one kernel launch in the
caller's graph (torch.cuda.graph, or CuPy stream capture). The kernel reads
everything that varies between steps from device memory, so each step only
refreshes the captured input buffers in place, asks ``check_replay`` whether
the step fits the captured shape (a uniform decode batch of fixed token and
request counts, the same buffers), and replays: no host time goes to metadata.
Each replay is checked against an eager numpy build. GPU only: without a GPU it
prints a message and exits 0.

Run:  python examples/cuda_graph.py
"""
import numpy as np

import dsv4_cupy as d4
from dsv4_cupy.device import has_gpu

MAX_MODEL_LEN = 1 << 17          # C128A rows hold up to 1024 entries
MAX_TOKENS = 256
REQUESTS, QUERY = 8, 2           # MTP decodes: 1 + 1 speculative token each
PADDED_TOKENS = REQUESTS * QUERY + 4   # the captured shape: 4 graph-padding tokens
DEVICE_FIELDS = ("query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "positions")


def make_step(seed):
    """A uniform decode step of the captured shape, as numpy arrays."""
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(QUERY, MAX_MODEL_LEN, REQUESTS)
    qsl = np.arange(0, (REQUESTS + 1) * QUERY, QUERY, dtype=np.int32)
    positions = np.concatenate([np.arange(s - QUERY, s) for s in seq_lens] + [np.zeros(4, int)])
    table = rng.integers(0, 50_000, (REQUESTS, MAX_MODEL_LEN // 256), dtype=np.int32)
    slots = rng.integers(0, 1 << 30, PADDED_TOKENS)
    slots[REQUESTS * QUERY:] = -1                        # padding tokens
    return d4.CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.copy(), seq_lens=seq_lens.astype(np.int32),
        block_table_tensor=table, slot_mapping=slots.astype(np.int64),
        positions=positions.astype(np.int64), num_reqs=REQUESTS,
        num_actual_tokens=PADDED_TOKENS, max_query_len=QUERY, max_seq_len=int(seq_lens.max()))


def make_builder(like):
    return d4.DeepseekV4MetadataBuilder(128, MAX_MODEL_LEN, MAX_TOKENS, num_speculative_tokens=1,
                                        like=like)


def eager_rows(step):
    """The eager build of a step at the captured (capacity) width, for checking."""
    builder = d4.DeepseekV4MetadataBuilder(128, MAX_MODEL_LEN, MAX_TOKENS,
                                           num_speculative_tokens=1, width_policy="capacity")
    md = builder.build(0, step)
    return md.c128a_global_decode_topk_indices, md.c128a_decode_topk_lens


def run(module, to_device, to_numpy, capture, replay, synchronize):
    builder = make_builder(module)
    step = make_step(0)
    captured = dict((name, to_device(getattr(step, name))) for name in DEVICE_FIELDS)
    for name, value in captured.items():
        setattr(step, name, value)
    builder.build(0, step)                          # warm-up: compile and load outside the graph
    synchronize()
    md, visible = capture(lambda: consumer(builder.build_for_cudagraph_capture(step)))
    for seed in range(1, 6):
        new = make_step(seed)
        for name in DEVICE_FIELDS:                  # refresh the captured buffers in place
            captured[name][...] = to_device(getattr(new, name))
        step.max_seq_len = new.max_seq_len
        builder.check_replay(step)                  # the step fits the captured shape
        replay()
        synchronize()
        rows, lens = eager_rows(new)
        assert np.array_equal(to_numpy(md.c128a_global_decode_topk_indices), rows)
        assert np.array_equal(to_numpy(md.c128a_decode_topk_lens), lens)
        assert int(to_numpy(visible)) == int(lens.sum())
    print(f"{module}: 5 replays with new steps match eager builds")


def consumer(md):
    """Stands in for the attention kernels: reads the metadata inside the graph."""
    return md, md.c128a_decode_topk_lens.sum()


def main():
    if not has_gpu():
        print("no usable CUDA device: CUDA graphs need one; skipping this example")
        return
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    graphs = []

    def cupy_capture(fn):
        with stream:
            stream.begin_capture()
            result = fn()
            graphs.append(stream.end_capture())
        return result

    with stream:
        run("cupy", cupy.asarray, cupy.asnumpy, cupy_capture, lambda: graphs[0].launch(stream),
            stream.synchronize)
    try:
        import torch
        has_torch_cuda = torch.cuda.is_available()
    except ImportError:
        has_torch_cuda = False
    if has_torch_cuda:
        graph = torch.cuda.CUDAGraph()

        def torch_capture(fn):
            with torch.cuda.graph(graph):
                return fn()

        run("torch", lambda x: torch.from_numpy(np.ascontiguousarray(x)).cuda(),
            lambda t: t.cpu().numpy(), torch_capture, graph.replay, torch.cuda.synchronize)


if __name__ == "__main__":
    main()
