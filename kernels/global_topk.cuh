// compute_global_topk_indices_and_lens: a block per token row;
// global_topk_compact_indices_and_lens: the same rows with `compact` (grid-stride).
// Entry x of a row becomes block_table[req][x / bs] * bs + x % bs when 0 <= x
// and x / bs is a column of the table row, else -1 (the 0x7FC00000 NaN
// pattern included); the length counts the valid entries. An invalid token or
// a request outside the table gets an all -1 row and length 0, reading no
// table entry. With `compact` the valid entries are packed to the front in
// order, -1 after.
//
// Without `compact` (the usual case) a thread converts four consecutive
// entries at a time with 16-byte loads and stores when the rows allow (else
// one entry at a time, a block's threads apart), and the row is counted once.
// A thread's first four are straight-line code, their four table reads in
// flight together while the block counts the row (validity needs no table
// entry) and written last: a row of a compiled-in K is one vector for each of
// its block's K / 4 threads (geometry.topk_row_threads). With `compact` a
// group of 4 * DSV4_THREADS entries at a time, entry k of a group on thread
// k % DSV4_THREADS, is read and looked up before any is written (one round of
// dependent loads per group, spread over the block's eight warps), then
// packed by the group's counts.
//
// In place (out == topk_indices) is safe: a thread writes only entries it has
// read, and with `compact` writes come after the group's barrier and land
// below the group's end (packing only moves entries left), so no unread entry
// is overwritten.
#pragma once
#include "common.cuh"

struct GlobalTopkParams {        // compute_global_topk_indices_and_lens
    BlockTable table;            // the C4A group's block table
    const int* topk_indices;     // [num_tokens, topk_stride] int32, request-local rows (may be out)
    const int* token_to_req;     // [num_tokens] int32
    const void* is_valid_token;  // [num_tokens] bool (one byte each)
    int* out;                    // [num_tokens, out_stride] int32, width columns written
    int* lens;                   // [num_tokens] int32
    i64 topk_stride;
    i64 out_stride;
    i64 width;                   // K, columns of topk_indices read and of out written
    i64 num_tokens;
    i64 block_size;              // compressed rows per cache block (64 for C4A)
};

namespace dsv4 {
constexpr int kGroupSlices = 4;                    // entries per thread per group
constexpr int kWarps = DSV4_THREADS / DSV4_WARP_LANES;

// `pointer`, hidden from the compiler's address arithmetic. A row's table row
// goes through it: otherwise the compiler folds the row's base into each
// entry's address, four 64-bit multiplies between the row's first loads and
// its table reads.
template <typename T>
__device__ __forceinline__ T* opaque(T* pointer) {
    asm("mov.b64 %0, %0;" : "+l"(pointer));
    return pointer;
}

// Entry x of a row whose table row has `columns` readable columns: whether it
// is valid, and (read only then) its table entry. Its slot is apart so that a
// row can count its entries while the table reads are in flight.
template <typename Divisor>
struct EntryLookup {
    int x;
    bool valid;
    int block;
    __device__ __forceinline__ EntryLookup(int x, const int* __restrict__ block_row, i64 columns,
                                           const Divisor& bs)
        : x(x), valid(x >= 0 && bs.div(x) < columns),
          block(valid ? __ldg(block_row + bs.div(x)) : 0) {}
    // The global slot (valid), or -1.
    __device__ __forceinline__ int slot(const Divisor& bs) const {
        return valid ? block_slot(block, bs.size, bs.mod(x)) : DSV4_PAD_SLOT_ID;
    }
};

// Entry x's global slot, or -1; `count` gains one when it is valid.
template <typename Divisor>
__device__ __forceinline__ int global_slot(int x, const int* __restrict__ block_row, i64 columns,
                                           const Divisor& bs, int& count) {
    const EntryLookup<Divisor> entry(x, block_row, columns, bs);
    count += entry.valid;
    return entry.slot(bs);
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
    const int lane = (int)(threadIdx.x % DSV4_WARP_LANES),
              warp = (int)(threadIdx.x / DSV4_WARP_LANES);
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

// Rows in place of their entries, a block per row (no grid-stride loop, whose
// set-up would wait ahead of the row's first loads), K / 4 threads for a
// compiled-in K. A row's first vector, its request and its validity are read
// together, before anything waits on one of them, and the row is counted
// while its table reads are in flight: at decode sizes the row's dependent
// loads are its whole cost (docs/performance.md).
// `columns` stays 64-bit: as an int it costs the fused C4A layer kernel
// registers, a block per SM.
template <int kWidth, int kThreads, typename Divisor>
__device__ __forceinline__ void global_topk_rows(const GlobalTopkParams& p, const Blocks& blocks,
                                                 const Divisor& bs) {
    __shared__ int row_counts[kThreads / DSV4_WARP_LANES];
    const unsigned char* __restrict__ is_valid =
        static_cast<const unsigned char*>(p.is_valid_token);
    const int width = compiled_or<kWidth>(p.width);
    const int first = 4 * (int)threadIdx.x;
    const i64 t = blocks.index;  // a block per row (geometry.block_rows): no loop to set up
    if (t >= p.num_tokens) return;
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
        opaque(p.table.entries + (usable ? req : 0) * p.table.row_stride);
    // The first vector's table reads (x is -1, invalid, where there is none).
    const EntryLookup<Divisor> e0(x.x, block_row, columns, bs), e1(x.y, block_row, columns, bs),
        e2(x.z, block_row, columns, bs), e3(x.w, block_row, columns, bs);
    int mine = e0.valid + e1.valid + e2.valid + e3.valid;  // this thread's valid entries
    if (vectors) {
        if (kWidth == DSV4_RUN_TIME || kWidth > 4 * kThreads) {
            for (int k = first + 4 * kThreads; k < width; k += 4 * kThreads)
                global_topk_vector(source, target, k, block_row, columns, bs, mine);
        }
    } else {
        for (int k = threadIdx.x; k < width; k += kThreads)
            target[k] = global_slot(source[k], block_row, columns, bs, mine);
    }
    const int count = block_sum_once<kThreads>(mine, row_counts);
    if (threadIdx.x == 0) p.lens[t] = count;
    if (vectors && first < width)
        *reinterpret_cast<int4*>(target + first) =
            make_int4(e0.slot(bs), e1.slot(bs), e2.slot(bs), e3.slot(bs));
}

// kWidth and kBlockSize are K and the block size compiled in (families.TOP_K_AXIS
// and C4A_BLOCK_AXIS), or DSV4_RUN_TIME for p's. The compact rows are their own
// entry point (families.GLOBAL_TOPK_COMPACT): a branch between the two, even on
// a struct field, puts the compact code first and the row's entry loads after
// its request's. A compiled-in K also means 16-byte rows (the host picks it
// only then), so its rows have one code path.
template <int kWidth, int kBlockSize, int kThreads = DSV4_THREADS>
__device__ __forceinline__ void global_topk_indices_and_lens(const GlobalTopkParams& p,
                                                             const Blocks& blocks = whole_grid()) {
    with_block_divisor<kBlockSize>((int)p.block_size, [&](auto bs) {
        global_topk_rows<kWidth, kThreads>(p, blocks, bs);
    });
}

__device__ __forceinline__ void global_topk_compact_indices_and_lens(
        const GlobalTopkParams& p, const Blocks& blocks = whole_grid()) {
    with_block_divisor((int)p.block_size,
                       [&](auto bs) { global_topk_compact_rows(p, blocks, bs); });
}

}  // namespace dsv4
