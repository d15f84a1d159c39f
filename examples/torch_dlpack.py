"""Handing DeepSeek-V4 metadata to torch without copies.

1. DeepseekV4MetadataBuilder(like="torch") keeps torch buffers (CUDA when
   torch sees a GPU, else CPU) and returns torch views of them.
2. cupy results (with a GPU) or numpy results (without) go to torch through
   dsv4_cupy.to_torch / DeepseekV4Metadata.to_torch, sharing their memory.
Runs on a CPU-only machine too (torch CPU tensors and numpy).

Run:  python examples/torch_dlpack.py
"""
from numpy_pipeline import assert_same_metadata, make_builder, make_step, move_step

import dsv4_cupy as d4
from dsv4_cupy.device import require_gpu


def has_cupy_gpu():
    try:
        require_gpu()
    except d4.NoGPUError:
        return False
    return True


def main():
    try:
        import torch
    except ImportError:
        print("torch not installed (pip install torch): skipping this example")
        return
    host = make_step()
    want = make_builder("numpy").build(0, host)       # the numpy CPU path, for checking

    # 1. torch buffers: the step's arrays must be torch tensors on the builder's device.
    builder = make_builder("torch")
    device = builder.req_id_per_token_buffer.device
    md = builder.build(0, move_step(host, lambda x: torch.from_numpy(x).to(device)))
    print(f"like='torch': results are {type(md.req_id_per_token).__name__}s on {device}")
    for result, buffer in (
            (md.req_id_per_token, builder.req_id_per_token_buffer),
            (md.slot_mapping, builder.compressed_slot_mapping_buffer),
            (md.c128a_global_decode_topk_indices, builder.c128a_global_decode_buffer),
            (md.c128a_decode_topk_lens, builder.c128a_decode_lens_buffer),
            (md.c128a_prefill_topk_indices, builder.c128a_prefill_buffer)):
        assert isinstance(result, torch.Tensor)
        assert result.data_ptr() == buffer.data_ptr()     # a view: no copy was made
    print("  every result is a view of its persistent buffer (same data_ptr)")
    assert_same_metadata(md, want, to_numpy=lambda t: t.cpu().numpy())
    print("  and matches the numpy CPU path")

    # 2. A cupy (GPU) or numpy (CPU) build, exported to torch through DLPack.
    if has_cupy_gpu():
        import cupy
        like, step, address = "cupy", move_step(host, cupy.asarray), lambda a: a.data.ptr
    else:
        like, step, address = "numpy", host, lambda a: a.ctypes.data
    other = make_builder(like).build(0, step)
    req = d4.to_torch(other.req_id_per_token)
    assert req.data_ptr() == address(other.req_id_per_token)
    print(f"to_torch({like} req_id_per_token): {req.dtype} tensor on {req.device}, "
          "same data_ptr")
    exported = other.to_torch()                      # every array field at once
    prefill = exported.c128a_prefill_topk_indices
    assert prefill.data_ptr() == address(other.c128a_prefill_topk_indices)
    assert prefill.stride() == (builder.capacity, 1)   # rows keep the buffer's stride
    assert_same_metadata(exported, want, to_numpy=lambda t: t.cpu().numpy())
    print(f"{like} metadata .to_torch(): zero-copy views, row stride kept "
          f"({prefill.stride()[0]}), values match")


if __name__ == "__main__":
    main()
