"""Capturing DeepseekV4MetadataBuilder.build in a CUDA graph and replaying it.

A build makes no allocation and no host sync, and its launch arguments are the
fixed addresses of the step's arrays and the builder's buffers. So one build
can be captured (under torch.cuda.graph, and under CuPy stream capture), the
step's inputs overwritten in place with a new step of the same shape, and the
graph replayed: the results must equal a fresh numpy build of the new step.
width_policy="capacity" (the default) keeps the C128A width fixed, so the
graph stays valid whatever the new sequence lengths are. GPU only: without a
GPU it prints a message and exits 0.

Run:  python examples/cuda_graph.py
"""
import numpy as np

import dsv4_cupy as d4
from dsv4_cupy.device import require_gpu
from numpy_pipeline import (DEVICE_FIELDS, assert_same_metadata, make_builder, make_step,
                            move_step)


def capture_with_torch(first, second, want):
    import torch
    builder = make_builder("torch")
    step = move_step(first, lambda x: torch.from_numpy(x).cuda())
    # Warm up on a side stream (kernel compile and load happen outside the capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        builder.build(0, step)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        md = builder.build(0, step)
    for name in DEVICE_FIELDS:                     # the next step, at the same addresses
        getattr(step, name).copy_(torch.from_numpy(getattr(second, name)))
    graph.replay()
    torch.cuda.synchronize()
    assert_same_metadata(md, want, to_numpy=lambda t: t.cpu().numpy())
    print("torch.cuda.graph: replay with the new step's values matches numpy")


def capture_with_cupy(first, second, want):
    import cupy
    builder = make_builder("cupy")
    step = move_step(first, cupy.asarray)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        builder.build(0, step)                     # warm-up: compile and load the kernel
        stream.synchronize()
        stream.begin_capture()
        md = builder.build(0, step)
        graph = stream.end_capture()
        # The next step, copied on `stream` so that the replay comes after it.
        for name in DEVICE_FIELDS:
            getattr(step, name)[...] = cupy.asarray(getattr(second, name))
        graph.launch(stream)
        stream.synchronize()
    assert_same_metadata(md, want, to_numpy=cupy.asnumpy)
    print("CuPy stream capture: replay with the new step's values matches numpy")


def main():
    try:
        require_gpu()
    except d4.NoGPUError as error:
        print(f"no GPU ({error}); skipping this example")
        return
    first, second = make_step(seed=0), make_step(seed=1)   # same shapes, new values
    want = make_builder("numpy").build(0, second)
    # Make sure a replay that still held the first step's results would fail.
    assert not np.array_equal(make_builder("numpy").build(0, first).slot_mapping,
                              want.slot_mapping)
    print(f"captured step: {first.num_reqs} requests, {first.num_actual_tokens} tokens; "
          f"replayed with seq_lens {first.seq_lens.tolist()} -> {second.seq_lens.tolist()}")
    try:
        import torch
        has_torch_cuda = torch.cuda.is_available()
    except ImportError:
        has_torch_cuda = False
    if has_torch_cuda:
        capture_with_torch(first, second, want)
    capture_with_cupy(first, second, want)


if __name__ == "__main__":
    main()
