// dequantize_and_gather_selected_kv: only the workspace rows a prefill chunk's
// combined indices name, dequantised into a compact bf16 workspace, and the
// indices remapped into it. The full workspace is [num_reqs, M, 512]: request
// b's compressed rows at [0, N), its SWA rows from N (as
// dequantize_and_gather_k_cache with two sources fills it); index b * M + row
// names one of its rows. Six launches on one stream:
//   clear   the flags of named rows (a byte per row);
//   mark    the rows the indices name (entries j < lens[t] in [0, num_reqs * M)):
//           plain stores of 1, which many entries may race to make (atomics
//           on the few words of a window or a cluster serialise);
//   count   the flags as a bitmap word per 32 rows; each word's named rows
//           before it within its tile of kTileWords words, each tile's total;
//   scan    the tiles' totals into their first compact row; num_selected;
//   list    each named row at its compact row (its rank among the named rows,
//           in row order) of the list; in the launch's later blocks, the
//           remap: each index to its row's compact row, -1 for an entry past
//           lens, outside the workspace, or whose compact row is past out's;
//   gather  a warp per listed row, into out at its compact row.
// A named row that the full gather would not write (outside G, the
// request's rows or the tables) is not written here either.
#pragma once
#include "k_cache_gather.cuh"

struct SelectedGatherParams {    // every launch of dequantize_and_gather_selected_kv
    unsigned short* out;         // [out_rows, 512] bf16 bits, rows 16-byte aligned
    int* remapped;               // [num_tokens, width] int32: compact rows, or -1
    const int* indices;          // [num_tokens, width] int32: full-workspace rows (b * M + row)
    const int* lens;             // [num_tokens] int32: the valid entries of each index row
    const int* seq_lens;         // [num_reqs] int32
    unsigned char* flags;        // [num_words * 32]: row r is named
    unsigned int* bitmap;        // [num_words]: bit r % 32 of word r / 32: row r is named
    int* word_prefix;            // [num_words]: selected rows before the word within its tile
    int* tile_prefix;            // [num_tiles]: a tile's total, then the named rows before it
    int* listed;                 // [min(out_rows, num_reqs * M)]: the named rows, in row order
    int* num_selected;           // [1]: the named rows (some may be past out_rows)
    i64 out_rows;
    i64 out_row_stride;          // elements between rows of out (a multiple of 8)
    i64 indices_stride;          // elements between index rows
    i64 remapped_stride;         // elements between remapped rows
    i64 num_tokens;
    i64 width;                   // entries per index row
    i64 num_reqs;
    i64 rows;                    // M: rows of a request in the full workspace
    i64 num_words;               // ceil(num_reqs * M / 32)
    i64 num_tiles;               // ceil(num_words / kTileWords)
    i64 list_blocks;             // the list's blocks of its launch; the remap takes the others
    i64 num_sources;             // 2: the compressed cache, then the SWA cache
    KCacheSource first;
    KCacheSource second;
};

namespace dsv4 {
constexpr int kWordsPerThread = 4;
constexpr i64 kTileWords = (i64)kWordsPerThread * DSV4_THREADS;

// The sum of v over the threads of the block before this one, and the block's
// total in `total`. Every thread of the block must call; `warp_totals`
// (DSV4_THREADS / 32 values) is free after.
__device__ __forceinline__ int block_exclusive_sum(int v, int* warp_totals, int& total) {
    const int lane = threadIdx.x % DSV4_WARP_LANES, warp = threadIdx.x / DSV4_WARP_LANES;
    int inclusive = v;
#pragma unroll
    for (int offset = 1; offset < DSV4_WARP_LANES; offset <<= 1) {
        const int below = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += below;
    }
    if (lane == DSV4_WARP_LANES - 1) warp_totals[warp] = inclusive;
    __syncthreads();
    int before = 0;
    total = 0;
    for (int w = 0; w < DSV4_THREADS / DSV4_WARP_LANES; ++w) {
        before += w < warp ? warp_totals[w] : 0;
        total += warp_totals[w];
    }
    __syncthreads();
    return before + inclusive - v;
}

__device__ __forceinline__ i64 grid_thread() { return (i64)blockIdx.x * DSV4_THREADS + threadIdx.x; }
__device__ __forceinline__ i64 grid_threads() { return (i64)gridDim.x * DSV4_THREADS; }

__device__ __forceinline__ void select_rows_clear(const SelectedGatherParams& p) {
    uint4* flags = reinterpret_cast<uint4*>(p.flags);        // two 16-byte vectors a word
    for (i64 v = grid_thread(); v < 2 * p.num_words; v += grid_threads()) flags[v] = make_uint4(0, 0, 0, 0);
}

__device__ __forceinline__ void select_rows_mark(const SelectedGatherParams& p) {
    const i64 entries = p.num_tokens * p.width, total_rows = p.num_reqs * p.rows;
    for (i64 e = grid_thread(); e < entries; e += grid_threads()) {
        const i64 t = quotient(e, p.width), j = e - t * p.width;
        if (j >= (i64)p.lens[t]) continue;
        const i64 row = p.indices[t * p.indices_stride + j];
        if (row >= 0 && row < total_rows) p.flags[row] = 1;
    }
}

// Bit k of the word: byte k of the 32 flag bytes at `flags` is not 0.
__device__ __forceinline__ unsigned flag_bits(const unsigned char* flags) {
    const uint4 low = reinterpret_cast<const uint4*>(flags)[0];
    const uint4 high = reinterpret_cast<const uint4*>(flags)[1];
    const unsigned parts[8] = {low.x, low.y, low.z, low.w, high.x, high.y, high.z, high.w};
    unsigned bits = 0u;
#pragma unroll
    for (int k = 0; k < 32; ++k) bits |= ((parts[k / 4] >> (8 * (k % 4))) & 0xffu) ? 1u << k : 0u;
    return bits;
}

__device__ __forceinline__ void select_rows_count(const SelectedGatherParams& p) {
    __shared__ int warp_totals[DSV4_THREADS / DSV4_WARP_LANES];
    for (i64 tile = blockIdx.x; tile < p.num_tiles; tile += gridDim.x) {
        const i64 first_word = tile * kTileWords + (i64)threadIdx.x * kWordsPerThread;
        int counts[kWordsPerThread], sum = 0;
#pragma unroll
        for (int k = 0; k < kWordsPerThread; ++k) {
            const i64 w = first_word + k;
            const unsigned bits = w < p.num_words ? flag_bits(p.flags + 32 * w) : 0u;
            if (w < p.num_words) p.bitmap[w] = bits;
            counts[k] = __popc(bits);
            sum += counts[k];
        }
        int total;
        int before = block_exclusive_sum(sum, warp_totals, total);
#pragma unroll
        for (int k = 0; k < kWordsPerThread; ++k) {
            if (first_word + k < p.num_words) p.word_prefix[first_word + k] = before;
            before += counts[k];
        }
        if (threadIdx.x == 0) p.tile_prefix[tile] = total;
    }
}

// One block.
__device__ __forceinline__ void select_rows_scan(const SelectedGatherParams& p) {
    __shared__ int warp_totals[DSV4_THREADS / DSV4_WARP_LANES];
    int carry = 0;
    for (i64 first = 0; first < p.num_tiles; first += DSV4_THREADS) {
        const i64 tile = first + threadIdx.x;
        int total;
        const int before = block_exclusive_sum(tile < p.num_tiles ? p.tile_prefix[tile] : 0,
                                               warp_totals, total);
        if (tile < p.num_tiles) p.tile_prefix[tile] = carry + before;
        carry += total;
    }
    if (threadIdx.x == 0) *p.num_selected = carry;
}

// The compact row of full-workspace row `row` (its bit set in `word`).
__device__ __forceinline__ i64 compact_row(const SelectedGatherParams& p, i64 row, unsigned word) {
    const i64 w = row >> 5;
    return (i64)p.tile_prefix[w / kTileWords] + p.word_prefix[w] +
           __popc(word & ((1u << (row & 31)) - 1u));
}

__device__ __forceinline__ void select_rows_list(const SelectedGatherParams& p) {
    if ((i64)blockIdx.x < p.list_blocks) {
        const i64 listed = p.num_reqs * p.rows < p.out_rows ? p.num_reqs * p.rows : p.out_rows;
        for (i64 w = (i64)blockIdx.x * DSV4_THREADS + threadIdx.x; w < p.num_words;
             w += p.list_blocks * DSV4_THREADS) {
            unsigned bits = p.bitmap[w];
            if (bits == 0u) continue;
            i64 compact = (i64)p.tile_prefix[w / kTileWords] + p.word_prefix[w];
            for (; bits != 0u && compact < listed; bits &= bits - 1u, ++compact)
                p.listed[compact] = (int)(w * 32 + (__ffs(bits) - 1));
        }
        return;
    }
    const i64 entries = p.num_tokens * p.width, total_rows = p.num_reqs * p.rows;
    const i64 step = (i64)(gridDim.x - p.list_blocks) * DSV4_THREADS;
    for (i64 e = (i64)(blockIdx.x - p.list_blocks) * DSV4_THREADS + threadIdx.x; e < entries; e += step) {
        const i64 t = quotient(e, p.width), j = e - t * p.width;
        const i64 row = j < (i64)p.lens[t] ? (i64)p.indices[t * p.indices_stride + j] : -1;
        i64 compact = -1;
        if (row >= 0 && row < total_rows) {
            const unsigned word = p.bitmap[row >> 5];
            if ((word >> (row & 31)) & 1u) compact = compact_row(p, row, word);
        }
        p.remapped[t * p.remapped_stride + j] = (int)(compact < p.out_rows ? compact : -1);
    }
}

__device__ __forceinline__ void select_rows_gather(const SelectedGatherParams& p) {
    const WarpRows warps(whole_grid());
    const i64 selected = *p.num_selected;
    const i64 rows = selected < p.out_rows ? selected : p.out_rows;
    for (i64 k = warps.first; k < rows; k += warps.step) {
        const i64 row = p.listed[k];
        const i64 b = quotient(row, p.rows);
        gather_request_row(p.first, p.second, p.num_sources, p.seq_lens, b, row - b * p.rows,
                           p.out + k * p.out_row_stride, warps.lane);
    }
}

}  // namespace dsv4
