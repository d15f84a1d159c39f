"""The numpy_pipeline.py step on the GPU with cupy arrays, checked against numpy.

cupy inputs give cupy results, computed by CuPy-compiled CUDA kernels launched
on CuPy's current stream (here a stream of our own). The calls never
synchronise; the example does, before reading the results back. Without a GPU
it prints a message and exits 0.

Run:  python examples/cupy_pipeline.py
"""
import numpy as np
from numpy_pipeline import (
    FIELDS,
    MAX_MODEL_LEN,
    RATIO,
    SPEC_TOKENS,
    STORAGE_BLOCK,
    assert_same_metadata,
    make_builder,
    make_step,
    move_step,
)

import dsv4_cupy as d4
from dsv4_cupy.device import require_gpu


def main():
    try:
        device = require_gpu()
    except d4.NoGPUError as error:
        print(f"no GPU ({error}); skipping this example")
        return
    import cupy
    print(f"GPU {device.id}, compute capability {device.compute_capability}")

    host = make_step()
    step = move_step(host, cupy.asarray)          # the same step, on the GPU
    T = step.num_actual_tokens
    builder = make_builder("cupy")                # persistent cupy buffers, allocated once

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # The ops one by one; their outputs are allocated by the calls.
        req = d4.token_to_req_indices(step.query_start_loc, T)
        nd = d4.split_decodes_and_prefills(step, decode_threshold=1 + SPEC_TOKENS)[2]
        slots = d4.get_compressed_slot_mapping(T, step.slot_mapping, step.query_start_loc,
                                               step.seq_lens, step.block_table_tensor,
                                               STORAGE_BLOCK, RATIO)
        gd, lens, pf = d4.build_c128a_topk_metadata(
            step.positions, RATIO, nd, req, step.block_table_tensor, STORAGE_BLOCK,
            step.slot_mapping, max_compressed_tokens=d4.c128a_capacity(MAX_MODEL_LEN))
        # The builder: the whole step in one kernel launch.
        md = builder.build(0, step)
        stream.synchronize()
    print(f"results are {type(md.req_id_per_token).__module__} arrays: decode rows "
          f"{md.c128a_global_decode_topk_indices.shape}, prefill rows "
          f"{md.c128a_prefill_topk_indices.shape}")

    want = make_builder("numpy").build(0, host)
    assert_same_metadata(md, want, to_numpy=cupy.asnumpy)
    for name, got in zip(FIELDS, (req, slots, gd[:, None, :], lens, pf)):
        np.testing.assert_array_equal(got.get(), getattr(want, name), err_msg=name)
    print("cupy ops and builder (like='cupy') match the numpy CPU path")


if __name__ == "__main__":
    main()
