// The fused per-step build of DeepseekV4MetadataBuilder: one launch computes
// the token->request map, the compressed slot mapping (whole buffer) and the
// C128A decode and prefill rows, which the seed path does in 4-5 launches.
//
// Blocks [0, row_blocks) are C128A row chunks (as in c128a.cu); each finds its
// token's request itself, so no block waits for another. The remaining blocks
// take one element each of the request map and the slot-mapping buffer.
#include "common.cuh"

template <typename PosT, typename SlotT>
__device__ __forceinline__ void build_step(
        const int* __restrict__ qsl, int num_reqs, const int* __restrict__ seq_lens,
        const int* __restrict__ block_table, i64 bt_rows, i64 bt_cols, i64 bt_stride,
        const PosT* __restrict__ positions, const SlotT* __restrict__ slot_mapping,
        i64 num_tokens, i64 num_decode_tokens, i64 ratio, i64 block_size, i64 cp_world_size,
        i64 cp_rank, i64 cp_interleave, int* __restrict__ req_out, long long* __restrict__ csm_out,
        i64 csm_len, int width, int* __restrict__ global_decode, i64 gd_stride,
        int* __restrict__ decode_lens, int* __restrict__ prefill, i64 pf_stride,
        int cols_per_block, int chunks, i64 row_blocks) {
    const i64 block = blockIdx.x;
    if (block < row_blocks) {
        const i64 t = block / chunks;
        const int c0 = (int)(block % chunks) * cols_per_block;
        const int c1 = min(width, c0 + cols_per_block);
        const int req = t < num_decode_tokens ? token_request(qsl, num_reqs, t) : 0;
        c128a_block(t, c0, c1, req, positions[t], ratio, num_decode_tokens, block_table, bt_rows,
                    bt_cols, bt_stride, (int)block_size, slot_mapping, width, global_decode,
                    gd_stride, decode_lens, prefill, pf_stride);
        return;
    }
    const i64 i = (block - row_blocks) * blockDim.x + threadIdx.x;
    if (i < num_tokens) req_out[i] = token_request(qsl, num_reqs, i);
    if (csm_out != nullptr && i < csm_len) {
        i64 slot = -1;
        if (bt_rows > 0)
            slot = compressed_slot(qsl, seq_lens, request_of(qsl, (int)bt_rows, i), i, block_table,
                                   bt_cols, bt_stride, block_size, ratio, cp_world_size, cp_rank,
                                   cp_interleave);
        csm_out[i] = slot;
    }
}

#define BUILD_STEP_ENTRY(NAME, PosT, SlotT)                                                     \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                     \
            const int* qsl, int num_reqs, const int* seq_lens, const int* block_table,          \
            i64 bt_rows, i64 bt_cols, i64 bt_stride, const PosT* positions,                     \
            const SlotT* slot_mapping, i64 num_tokens, i64 num_decode_tokens, i64 ratio,        \
            i64 block_size, i64 cp_world_size, i64 cp_rank, i64 cp_interleave, int* req_out,    \
            long long* csm_out, i64 csm_len, int width, int* global_decode, i64 gd_stride,      \
            int* decode_lens, int* prefill, i64 pf_stride, int cols_per_block, int chunks,      \
            i64 row_blocks) {                                                                   \
        build_step<PosT, SlotT>(qsl, num_reqs, seq_lens, block_table, bt_rows, bt_cols,         \
                                bt_stride, positions, slot_mapping, num_tokens,                 \
                                num_decode_tokens, ratio, block_size, cp_world_size, cp_rank,   \
                                cp_interleave, req_out, csm_out, csm_len, width, global_decode, \
                                gd_stride, decode_lens, prefill, pf_stride, cols_per_block,     \
                                chunks, row_blocks);                                            \
    }

BUILD_STEP_ENTRY(build_step_p32_s32, int, int)
BUILD_STEP_ENTRY(build_step_p32_s64, int, long long)
BUILD_STEP_ENTRY(build_step_p64_s32, long long, int)
BUILD_STEP_ENTRY(build_step_p64_s64, long long, long long)
