// The indexer's fp8 cache (C4A layers): pages of B rows, block-planar: every
// row's 128 FP8 E4M3 values, then every row's 4-byte scale.
//  * indexer_k_quant_and_cache: row t of k (bf16 [128]) into slot
//    slot_mapping[t] (skipped outside the cache, -1 for padding). amax over the
//    non-NaN |x|; scale = max(amax, 1e-4) / 448, a power of two 2^ceil(log2)
//    for "ue8m0" and "mxfp8"; values e4m3(x / scale), saturating (a NaN stays
//    NaN, 0x7F); the scale stored as float32, or for "mxfp8" as its UE8M0
//    exponent byte four times.
//  * cp_gather_indexer_k_quant_cache: out row t is position t - cu[b] of the
//    request b with cu[b] <= t < cu[b + 1]: its 128 value bytes and 4 scale
//    bytes, copied; a row of no request, or whose block is outside the table
//    or the cache, is not written.
// One warp per row.
#pragma once
#include "fp8.cuh"

struct IndexerInsertParams {     // indexer_k_quant_and_cache
    const unsigned short* k;     // [num_tokens, k_stride] bf16 bits, 128 dims read
    unsigned char* cache;        // [num_pages, page_stride] bytes
    const void* slot_mapping;    // [num_tokens] int32 or int64 (entry suffix s32/s64)
    i64 k_stride;                // elements between rows of k (a multiple of 4)
    i64 page_stride;             // bytes between pages (a multiple of 16)
    i64 num_pages;
    i64 block_size;              // rows per page
    i64 num_tokens;
    i64 scale_format;            // 0: float32 amax / 448, 1: power of two, 2: UE8M0 bytes
};

struct IndexerGatherParams {     // cp_gather_indexer_k_quant_cache
    const unsigned char* cache;  // [num_pages, page_stride] bytes
    BlockTable table;            // [num_reqs, cols] int32
    const int* cu_seq_lens;      // [num_reqs + 1] int32, the requests' first out rows
    unsigned char* dst_k;        // [num_rows, dst_k_stride] fp8 bytes, 128 written
    unsigned char* dst_scale;    // [num_rows, dst_scale_stride] bytes, 4 written
    i64 page_stride;
    i64 num_pages;
    i64 block_size;
    i64 dst_k_stride;            // a multiple of 4
    i64 dst_scale_stride;        // a multiple of 4
    i64 num_rows;
};

namespace dsv4 {
static_assert(DSV4_INDEXER_DIM == 4 * DSV4_WARP_LANES, "a lane quantises 4 values: one 8-byte load");
enum IndexerScale : int { kScaleFloat32 = 0, kScalePowerOfTwo = 1, kScaleUe8m0Bytes = 2 };

template <typename SlotT>
__device__ __forceinline__ void indexer_k_quant_and_cache(const IndexerInsertParams& p,
                                                          const Blocks& blocks = whole_grid()) {
    for_each_slotted_token<SlotT>(p, blocks, [&](i64 t, const CacheSlot& at, int lane) {
        const uint2 pair = reinterpret_cast<const uint2*>(p.k + t * p.k_stride)[lane];
        const unsigned short bits[4] = {(unsigned short)pair.x, (unsigned short)(pair.x >> 16),
                                        (unsigned short)pair.y, (unsigned short)(pair.y >> 16)};
        unsigned lane_max = 0;
#pragma unroll
        for (int d = 0; d < 4; ++d) {
            const unsigned m = bf16_magnitude(bits[d]);
            lane_max = max(lane_max, m > 0x7F80u ? 0u : m);
        }
        const unsigned amax = __reduce_max_sync(0xFFFFFFFFu, lane_max);
        float scale;
        if (amax == 0x7F80u) {
            scale = __uint_as_float(kF32Infinity);
        } else if (p.scale_format == kScaleFloat32) {
            scale = fmaxf(bf16_value((unsigned short)amax), kAmaxFloor) / kE4m3Max;
        } else {
            scale = power_of_two(ue8m0_exponent(bf16_value((unsigned short)amax)));
        }
        unsigned packed = 0;
#pragma unroll
        for (int d = 0; d < 4; ++d) {
            const float v = bf16_value(bits[d]) / scale;
            packed |= (unsigned)(v != v ? kE4m3Nan : e4m3_bits(v)) << (8 * d);
        }
        reinterpret_cast<unsigned*>(at.page + at.row * DSV4_INDEXER_DIM)[lane] = packed;
        if (lane == 0) {
            const unsigned scale_bits = __float_as_uint(scale);
            *reinterpret_cast<unsigned*>(at.page + p.block_size * DSV4_INDEXER_DIM + at.row * 4) =
                p.scale_format == kScaleUe8m0Bytes ? ((scale_bits >> 23) & 0xFFu) * 0x01010101u : scale_bits;
        }
    });
}

__device__ __forceinline__ void cp_gather_indexer_k_quant_cache(const IndexerGatherParams& p,
                                                                const Blocks& blocks = whole_grid()) {
    const WarpRows rows(blocks);
    const int* __restrict__ cu = p.cu_seq_lens;
    for (i64 t = rows.first; t < p.num_rows; t += rows.step) {
        if (p.table.rows == 0) return;
        const int b = request_of(cu, p.table.rows, t);
        if (t < (i64)cu[b] || t >= (i64)cu[b + 1]) continue;
        const i64 position = t - cu[b];
        const i64 column = quotient(position, p.block_size);
        if (column >= p.table.cols) continue;
        const i64 page = p.table.entries[b * p.table.row_stride + column];
        if (page < 0 || page >= p.num_pages) continue;
        const i64 r = position - column * p.block_size;
        const unsigned char* page_base = p.cache + page * p.page_stride;
        reinterpret_cast<unsigned*>(p.dst_k + t * p.dst_k_stride)[rows.lane] =
            reinterpret_cast<const unsigned*>(page_base + r * DSV4_INDEXER_DIM)[rows.lane];
        if (rows.lane == 0)
            *reinterpret_cast<unsigned*>(p.dst_scale + t * p.dst_scale_stride) =
                *reinterpret_cast<const unsigned*>(page_base + p.block_size * DSV4_INDEXER_DIM + r * 4);
    }
}

}  // namespace dsv4
