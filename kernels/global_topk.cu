// compute_global_topk_indices_and_lens: one block per token row. Entry x of a
// row becomes block_table[req][x / bs] * bs + x % bs when 0 <= x and x / bs is
// a column of the table row, else -1 (the 0x7FC00000 NaN pattern included);
// the length counts the valid entries. An invalid token or a request outside
// the table gets an all -1 row and length 0, reading nothing. With `compact`
// the valid entries are packed to the front in order, -1 after.
//
// In place (out == topk_indices) is safe: the row is taken in slices of
// DSV4_THREADS entries, every thread reads its entry of a slice before the
// barrier and writes after it, and a slice's writes land below the slice's
// end (packing only moves entries left), so no unread entry is overwritten.
#include "common.cuh"

namespace dsv4 {
__device__ __forceinline__ void global_topk_indices_and_lens(const GlobalTopkParams& p) {
    constexpr int kWarps = DSV4_THREADS / 32;
    __shared__ int warp_counts[kWarps];
    const unsigned char* __restrict__ is_valid =
        static_cast<const unsigned char*>(p.is_valid_token);
    const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
    const BlockDivisor bs((int)p.block_size);
    for (i64 t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        const i64 req = p.token_to_req[t];
        const bool usable = is_valid[t] && req >= 0 && req < p.table.rows;
        const int* block_row = usable ? p.table.entries + req * p.table.row_stride : nullptr;
        const int* source = p.topk_indices + t * p.topk_stride;
        int* target = p.out + t * p.out_stride;
        int count = 0;           // valid entries of the earlier slices (same in every thread)
        for (i64 slice = 0; slice < p.width; slice += DSV4_THREADS) {
            const i64 k = slice + threadIdx.x;
            int value = DSV4_PAD_SLOT_ID;
            bool valid = false;
            if (usable && k < p.width) {
                const int x = source[k];
                valid = x >= 0 && bs.div(x) < p.table.cols;
                if (valid) value = block_slot(block_row[bs.div(x)], bs.size, bs.mod(x));
            }
            const unsigned ballot = __ballot_sync(0xffffffffu, valid);
            if (lane == 0) warp_counts[warp] = __popc(ballot);
            __syncthreads();     // the slice is read; its warp counts are visible
            int before = count, total = 0;
            for (int w = 0; w < kWarps; ++w) {
                before += w < warp ? warp_counts[w] : 0;
                total += warp_counts[w];
            }
            if (k < p.width) {
                if (!p.compact) target[k] = value;
                else if (valid) target[before + __popc(ballot & ((1u << lane) - 1u))] = value;
            }
            count += total;
            __syncthreads();     // warp_counts is free for the next slice
        }
        if (p.compact)
            for (i64 k = count + threadIdx.x; k < p.width; k += DSV4_THREADS)
                target[k] = DSV4_PAD_SLOT_ID;
        if (threadIdx.x == 0) p.lens[t] = count;
    }
}

}  // namespace dsv4
