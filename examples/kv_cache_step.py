"""One C4A layer's KV-cache traffic of a step, from a NumPy pipeline.

1. The step's latent KV (bf16 [tokens, 512], here random) is quantised into the
   layer's SWA cache and its compressed cache (fp8_ds_mla pages of 64 states):
   quantize_and_insert_k_cache, per cache, with the step's slot mappings (the
   compressed one from get_compressed_slot_mapping).
2. One prefill chunk's workspace is gathered and dequantised for the sparse
   prefill: the compressed rows at [0, N), the last gather_len SWA rows from N,
   both caches in one call (dequantize_and_gather_prefill_kv).
   Or only the rows its tokens' top-k and windows name, into a compact
   workspace, the indices remapped into it (dequantize_and_gather_selected_kv).
3. The workspace goes to torch without a copy (dsv4_cupy.to_torch), viewed as
   bf16.

bf16 values travel as uint16 bits in NumPy (ml_dtypes.bfloat16 arrays work too).
Runs on the CPU path; with a GPU the same calls take cupy or torch CUDA arrays.

Run:  python examples/kv_cache_step.py
"""
import numpy as np

import dsv4_cupy as d4

RATIO, SWA_BLOCK, C4A_BLOCK, WINDOW, TOPK = 4, 64, 64, 128, 16
PREFILL_PREFIX, PREFILL_LEN = 1000, 200            # one request: 1000 cached, 200 new tokens


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16, as uint16 bits."""
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    rng = np.random.default_rng(0)
    seq_len = PREFILL_PREFIX + PREFILL_LEN
    swa = d4.empty_kv_cache("swa", 32)                 # [32, 64, 584] view of padded pages
    compressed = d4.empty_kv_cache("c4a", 8)
    swa_table = rng.permutation(32)[:-(-seq_len // SWA_BLOCK)].astype(np.int32)[None]
    c4a_table = rng.permutation(8)[:-(-(seq_len // RATIO) // C4A_BLOCK)].astype(np.int32)[None]
    layout = d4.kv_cache_layout("swa")
    print(f"SWA pages: {layout.num_states} states, {layout.page_bytes} bytes, stride "
          f"{layout.page_stride}; view {swa.shape}")

    # 1. Insert. Earlier steps wrote the prefix's latent KV and the compressed
    #    rows it closed; this step writes its tokens' KV into the SWA cache, and
    #    into the compressed cache the rows its tokens close (the compressor's
    #    output at every 4th position), at the slots get_compressed_slot_mapping
    #    gives (-1, which the insert skips, for a token that closes none).
    positions = np.arange(seq_len)
    kv = bf16_bits(rng.standard_normal((seq_len, 512)))
    compressor_out = bf16_bits(rng.standard_normal((seq_len, 512)))
    swa_slots = swa_table[0, positions // SWA_BLOCK].astype(np.int64) * SWA_BLOCK \
        + positions % SWA_BLOCK
    prefix_rows = np.arange(PREFILL_PREFIX // RATIO)
    d4.quantize_and_insert_k_cache(kv[:PREFILL_PREFIX], swa, swa_slots[:PREFILL_PREFIX],
                                   SWA_BLOCK)
    d4.quantize_and_insert_k_cache(
        compressor_out[RATIO - 1:PREFILL_PREFIX:RATIO], compressed,
        c4a_table[0, prefix_rows // C4A_BLOCK].astype(np.int64) * C4A_BLOCK
        + prefix_rows % C4A_BLOCK, C4A_BLOCK)
    step = slice(PREFILL_PREFIX, seq_len)                   # this step's tokens
    query_start_loc = np.array([0, PREFILL_LEN], np.int32)
    seq_lens = np.array([seq_len], np.int32)
    d4.quantize_and_insert_k_cache(kv[step], swa, swa_slots[step], SWA_BLOCK)
    c4a_slots = d4.get_compressed_slot_mapping(PREFILL_LEN, swa_slots[step], query_start_loc,
                                               seq_lens, c4a_table, C4A_BLOCK, RATIO)
    d4.quantize_and_insert_k_cache(compressor_out[step], compressed, c4a_slots, C4A_BLOCK)
    print(f"step: {PREFILL_LEN} tokens into the SWA cache, {int((c4a_slots >= 0).sum())} "
          f"compressed rows")

    # 2. Gather the chunk's workspace: N compressed rows, then the SWA rows.
    gather_lens = d4.compute_prefill_gather_lens(query_start_loc, seq_lens, 0, 1)
    N = seq_len // RATIO
    M = N + int(gather_lens[0])
    workspace = np.zeros((1, M, 512), np.uint16)
    d4.dequantize_and_gather_prefill_kv(workspace, compressed, c4a_table, swa, swa_table,
                                        seq_lens, gather_lens, RATIO, N)
    nope_error = np.abs(bits_to_float(workspace[0, :N, :448]) - bits_to_float(
        compressor_out[RATIO - 1::RATIO][:N, :448])).max()
    assert (workspace[0, N:, 448:] == kv[seq_len - int(gather_lens[0]):, 448:]).all()
    print(f"workspace {workspace.shape}: {N} compressed rows (NoPE error {nope_error:.3f}), "
          f"{int(gather_lens[0])} SWA rows (RoPE exact)")

    #    Or only the named rows: each token's top-k compressed rows (here random
    #    among those its position sees) and its window, combined as the sparse
    #    prefill reads them, then gathered into a compact workspace.
    visible = np.maximum((np.arange(PREFILL_PREFIX, seq_len) + 1) // RATIO, 1)
    local = (rng.random((PREFILL_LEN, TOPK)) * visible[:, None]).astype(np.int32)
    combined, lens = d4.combine_topk_swa_indices(local, query_start_loc, seq_lens, gather_lens,
                                                 WINDOW, RATIO, TOPK, M, N)
    compact = np.zeros((M, 512), np.uint16)
    remapped = np.empty_like(combined)
    _, _, count = d4.dequantize_and_gather_selected_kv(
        compact, remapped, combined, lens, compressed, c4a_table, swa, swa_table, seq_lens,
        gather_lens, RATIO, N, M)
    named = remapped >= 0
    assert (compact[remapped[named]] == workspace.reshape(-1, 512)[combined[named]]).all()
    print(f"selective gather: {int(count[0])} of the workspace's {M} rows named, gathered "
          f"row for row the same")

    # 3. Hand it to torch, zero-copy.
    try:
        import torch
    except ImportError:
        print("torch not installed: skipping the hand-off")
        return
    tensor = d4.to_torch(workspace).view(torch.bfloat16)
    assert tensor.data_ptr() == workspace.ctypes.data
    print(f"torch: {tensor.dtype} {tuple(tensor.shape)}, shared with the numpy workspace")


def bits_to_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


if __name__ == "__main__":
    main()
