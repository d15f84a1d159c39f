// build_c128a_topk_metadata: block b writes columns [c0, c1) of token
// t = b / chunks, so a long row is split over several blocks and a single
// decode token still spreads over the GPU. Entry points for int32/int64
// positions (p32/p64) and slot mappings (s32/s64).
#include "common.cuh"

template <typename PosT, typename SlotT>
__device__ __forceinline__ void c128a_topk_metadata(
        const PosT* __restrict__ positions, i64 num_tokens, i64 ratio, i64 num_decode_tokens,
        const int* __restrict__ token_to_req, const int* __restrict__ block_table, i64 bt_rows,
        i64 bt_cols, i64 bt_stride, int block_size, const SlotT* __restrict__ slot_mapping,
        int width, int* __restrict__ global_decode, i64 gd_stride, int* __restrict__ decode_lens,
        int* __restrict__ prefill, i64 pf_stride, int cols_per_block, int chunks) {
    const i64 t = (i64)blockIdx.x / chunks;
    if (t >= num_tokens) return;
    const int c0 = (int)((i64)blockIdx.x % chunks) * cols_per_block;
    const int c1 = min(width, c0 + cols_per_block);
    const int req = t < num_decode_tokens ? token_to_req[t] : 0;
    c128a_block(t, c0, c1, req, positions[t], ratio, num_decode_tokens, block_table, bt_rows,
                bt_cols, bt_stride, block_size, slot_mapping, width, global_decode, gd_stride,
                decode_lens, prefill, pf_stride);
}

#define C128A_ENTRY(NAME, PosT, SlotT)                                                          \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                     \
            const PosT* positions, i64 num_tokens, i64 ratio, i64 num_decode_tokens,            \
            const int* token_to_req, const int* block_table, i64 bt_rows, i64 bt_cols,          \
            i64 bt_stride, int block_size, const SlotT* slot_mapping, int width,                \
            int* global_decode, i64 gd_stride, int* decode_lens, int* prefill, i64 pf_stride,   \
            int cols_per_block, int chunks) {                                                   \
        c128a_topk_metadata<PosT, SlotT>(positions, num_tokens, ratio, num_decode_tokens,       \
                                         token_to_req, block_table, bt_rows, bt_cols, bt_stride, \
                                         block_size, slot_mapping, width, global_decode,        \
                                         gd_stride, decode_lens, prefill, pf_stride,            \
                                         cols_per_block, chunks);                               \
    }

C128A_ENTRY(c128a_topk_metadata_p32_s32, int, int)
C128A_ENTRY(c128a_topk_metadata_p32_s64, int, long long)
C128A_ENTRY(c128a_topk_metadata_p64_s32, long long, int)
C128A_ENTRY(c128a_topk_metadata_p64_s64, long long, long long)
