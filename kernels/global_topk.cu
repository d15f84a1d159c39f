// compute_global_topk_indices_and_lens: one block per token row (grid-stride);
// global_topk_compact_indices_and_lens: the same rows with `compact`.
// Entry x of a row becomes block_table[req][x / bs] * bs + x % bs when 0 <= x
// and x / bs is a column of the table row, else -1 (the 0x7FC00000 NaN
// pattern included); the length counts the valid entries. An invalid token or
// a request outside the table gets an all -1 row and length 0, reading no
// table entry. With `compact` the valid entries are packed to the front in
// order, -1 after.
//
// Without `compact` (the usual case) a thread converts four consecutive
// entries at a time with 16-byte loads and stores when the rows allow (else
// one entry at a time, DSV4_THREADS apart), and the row is counted once, at
// its end. A thread's first four are straight-line code, their four table
// reads in flight together: a row of K = 512 is one vector for each thread of
// the block's first half. With
// `compact` a group of 4 * DSV4_THREADS entries at a time, entry k of a group
// on thread k % DSV4_THREADS, is read and looked up before any is written
// (one round of dependent loads per group, spread over the block's eight
// warps), then packed by the group's counts.
//
// In place (out == topk_indices) is safe: a thread writes only entries it has
// read, and with `compact` writes come after the group's barrier and land
// below the group's end (packing only moves entries left), so no unread entry
// is overwritten.
#include "common.cuh"

namespace dsv4 {
constexpr int kGroupSlices = 4;                    // entries per thread per group
constexpr int kWarps = DSV4_THREADS / 32;

// Entry x of a row whose table row has `columns` readable columns: its global
// slot (valid), or -1 (invalid). `count` gains one per valid entry.
template <typename Divisor>
__device__ __forceinline__ int global_slot(int x, const int* __restrict__ block_row, i64 columns,
                                           const Divisor& bs, int& count) {
    const bool valid = x >= 0 && bs.div(x) < columns;
    count += valid;
    return valid ? block_slot(block_row[bs.div(x)], bs.size, bs.mod(x)) : DSV4_PAD_SLOT_ID;
}

// This thread's entries of one group of row t: values, and whether each is valid.
struct TopkGroup {
    int value[kGroupSlices];
    bool valid[kGroupSlices];

    template <typename Divisor>
    __device__ __forceinline__ TopkGroup(const int* source, i64 group, i64 width,
                                         const int* __restrict__ block_row, i64 columns,
                                         const Divisor& bs) {
#pragma unroll
        for (int s = 0; s < kGroupSlices; ++s) {
            const i64 k = group + s * DSV4_THREADS + threadIdx.x;
            int count = 0;
            value[s] = global_slot(k < width ? source[k] : -1, block_row, columns, bs, count);
            valid[s] = count != 0;
        }
    }
};

// Row t's entries [k, k + 4) as one vector, in place or not.
template <typename Divisor>
__device__ __forceinline__ void global_topk_vector(const int* source, int* target, i64 k,
                                                   const int* __restrict__ block_row,
                                                   i64 columns, const Divisor& bs, int& count) {
    const int4 x = *reinterpret_cast<const int4*>(source + k);
    int4 y;
    y.x = global_slot(x.x, block_row, columns, bs, count);
    y.y = global_slot(x.y, block_row, columns, bs, count);
    y.z = global_slot(x.z, block_row, columns, bs, count);
    y.w = global_slot(x.w, block_row, columns, bs, count);
    *reinterpret_cast<int4*>(target + k) = y;
}

// Rows packed to the front (`compact`): a group of 4 * DSV4_THREADS entries at a time.
template <typename Divisor>
__device__ __forceinline__ void global_topk_compact_rows(const GlobalTopkParams& p,
                                                         const Blocks& blocks, const Divisor& bs) {
    __shared__ int warp_counts[kGroupSlices][kWarps];
    const unsigned char* __restrict__ is_valid =
        static_cast<const unsigned char*>(p.is_valid_token);
    const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5);
    const unsigned lanes_before = (1u << lane) - 1u;
    for (i64 t = blocks.index; t < p.num_tokens; t += blocks.count) {
        const i64 req = p.token_to_req[t];
        const bool usable = is_valid[t] && req >= 0 && req < p.table.rows;
        const i64 columns = usable ? p.table.cols : 0;     // no entry of an unusable row is valid
        const int* __restrict__ block_row =
            p.table.entries + (usable ? req : 0) * p.table.row_stride;
        const int* source = p.topk_indices + t * p.topk_stride;
        int* target = p.out + t * p.out_stride;
        i64 count = 0;           // valid entries of the earlier groups (same in every thread)
        for (i64 group = 0; group < p.width; group += kGroupSlices * DSV4_THREADS) {
            const TopkGroup g(source, group, p.width, block_row, columns, bs);
            const int* value = g.value;
            const bool* valid = g.valid;
            unsigned ballots[kGroupSlices];
#pragma unroll
            for (int s = 0; s < kGroupSlices; ++s) {
                ballots[s] = __ballot_sync(0xffffffffu, valid[s]);
                if (lane == 0) warp_counts[s][warp] = __popc(ballots[s]);
            }
            __syncthreads();     // the group is read; its counts are visible
            i64 before = count;  // valid entries ahead of this thread's, slice by slice
#pragma unroll
            for (int s = 0; s < kGroupSlices; ++s) {
                const i64 k = group + s * DSV4_THREADS + threadIdx.x;
                i64 slice_before = 0, slice_total = 0;
                for (int w = 0; w < kWarps; ++w) {
                    slice_before += w < warp ? warp_counts[s][w] : 0;
                    slice_total += warp_counts[s][w];
                }
                if (k < p.width && valid[s])
                    target[before + slice_before + __popc(ballots[s] & lanes_before)] = value[s];
                before += slice_total;
            }
            count = before;
            __syncthreads();     // warp_counts is free for the next group
        }
        for (i64 k = count + threadIdx.x; k < p.width; k += DSV4_THREADS)
            target[k] = DSV4_PAD_SLOT_ID;
        if (threadIdx.x == 0) p.lens[t] = (int)count;
    }
}

// Rows in place of their entries. A row's first vector, its request and its
// validity are read together, before anything waits on one of them.
template <int kWidth, typename Divisor>
__device__ __forceinline__ void global_topk_rows(const GlobalTopkParams& p, const Blocks& blocks,
                                                 const Divisor& bs) {
    __shared__ int row_counts[kWarps];
    const unsigned char* __restrict__ is_valid =
        static_cast<const unsigned char*>(p.is_valid_token);
    const int width = compiled_or<kWidth>(p.width);
    const int first = 4 * (int)threadIdx.x;
    for (i64 t = blocks.index; t < p.num_tokens; t += blocks.count) {
        const int* source = p.topk_indices + t * p.topk_stride;
        int* target = p.out + t * p.out_stride;
        // A compiled-in width comes with 16-byte rows (the host picks it only then).
        const bool vectors = kWidth != DSV4_RUN_TIME ||
                             (((reinterpret_cast<unsigned long long>(source) |
                                reinterpret_cast<unsigned long long>(target)) & 15ull) |
                              (unsigned long long)(width & 3)) == 0;
        int4 x = make_int4(-1, -1, -1, -1);
        if (vectors && first < width) x = *reinterpret_cast<const int4*>(source + first);
        const i64 req = p.token_to_req[t];
        const bool usable = is_valid[t] && req >= 0 && req < p.table.rows;
        const i64 columns = usable ? p.table.cols : 0;     // no entry of an unusable row is valid
        const int* __restrict__ block_row =
            p.table.entries + (usable ? req : 0) * p.table.row_stride;
        int mine = 0;            // this thread's valid entries
        if (vectors) {
            if (first < width) {
                int4 y;
                y.x = global_slot(x.x, block_row, columns, bs, mine);
                y.y = global_slot(x.y, block_row, columns, bs, mine);
                y.z = global_slot(x.z, block_row, columns, bs, mine);
                y.w = global_slot(x.w, block_row, columns, bs, mine);
                *reinterpret_cast<int4*>(target + first) = y;
            }
            if (kWidth == DSV4_RUN_TIME || kWidth > 4 * DSV4_THREADS) {
                for (int k = first + 4 * DSV4_THREADS; k < width; k += 4 * DSV4_THREADS)
                    global_topk_vector(source, target, k, block_row, columns, bs, mine);
            }
        } else {
            for (int k = threadIdx.x; k < width; k += DSV4_THREADS)
                target[k] = global_slot(source[k], block_row, columns, bs, mine);
        }
        const int count = block_sum(mine, row_counts);
        if (threadIdx.x == 0) p.lens[t] = count;
    }
}

// kWidth and kBlockSize are K and the block size compiled in (families.TOP_K_AXIS
// and C4A_BLOCK_AXIS), or DSV4_RUN_TIME for p's. The compact rows are their own
// entry point (families.GLOBAL_TOPK_COMPACT): a branch between the two, even on
// a struct field, put the compact code first and the row's entry loads after
// its request's. A compiled-in K also means 16-byte rows (the host picks it
// only then), so its rows have one code path. Measured on the H200 at K = 512,
// each run in one process with the Triton port: 1 / 64 / 512 rows 1.92 / 2.03
// / 3.05 us against the port's 1.78 / 1.90 / 2.98; with the branch 2.14 / 2.24
// / 3.29 against 1.66 / 1.82 / 2.84.
template <int kWidth, int kBlockSize>
__device__ __forceinline__ void global_topk_indices_and_lens(const GlobalTopkParams& p,
                                                             const Blocks& blocks = whole_grid()) {
    with_block_divisor<kBlockSize>((int)p.block_size,
                                   [&](auto bs) { global_topk_rows<kWidth>(p, blocks, bs); });
}

__device__ __forceinline__ void global_topk_compact_indices_and_lens(
        const GlobalTopkParams& p, const Blocks& blocks = whole_grid()) {
    with_block_divisor((int)p.block_size,
                       [&](auto bs) { global_topk_compact_rows(p, blocks, bs); });
}

}  // namespace dsv4
