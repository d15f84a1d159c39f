// dequantize_and_gather_k_cache: the rows a prefill chunk's requests read, out
// of paged fp8_ds_mla caches into a bf16 workspace out[request, row, 512].
// A source (one cache) gives request b its last G rows (G = gather_lens[b], or
// every one of its seq_lens[b] / ratio rows), row i at out row first_row + i.
// One launch takes one source, or a layer's two (the compressed cache at rows
// [0, N), the SWA cache from row N), as vLLM's consumer gathers them. A row
// whose position, table column or block is outside its arrays is not written,
// nor is any row past G. One warp per output row: 8 dims (16 bytes) a lane, twice.
#pragma once
#include "fp8.cuh"

struct KCacheSource {            // one cache a gather reads
    const unsigned char* cache;  // [num_pages, page_stride] bytes, block-planar pages
    BlockTable table;            // [>= num_reqs, cols] int32: the requests' blocks
    const int* gather_lens;      // [num_reqs] int32 rows gathered, or null: seq_lens / ratio
    i64 page_stride;             // bytes between pages (a multiple of 16)
    i64 num_pages;
    i64 block_size;              // states per page
    i64 ratio;                   // a request's rows: seq_lens[b] / ratio
    i64 first_row;               // the out row of a request's first gathered row
};

struct KCacheGatherParams {      // dequantize_and_gather_k_cache
    unsigned short* out;         // [num_reqs, rows, 512] bf16 bits, rows 16-byte aligned
    const int* seq_lens;         // [num_reqs] int32
    i64 out_request_stride;      // elements between requests of out
    i64 out_row_stride;          // elements between rows of out (a multiple of 8)
    i64 num_reqs;
    i64 rows;                    // rows of out per request (M)
    i64 num_sources;             // 1, or 2: first the compressed cache, then the SWA cache
    KCacheSource first;
    KCacheSource second;         // from its first_row on (num_sources 2)
};

namespace dsv4 {
constexpr int kDimsPerChunk = 8;                         // a lane's 16-byte store
constexpr int kNopeChunks = DSV4_NOPE_DIM / kDimsPerChunk;

// 8 fp8 values of NoPE chunk `chunk` as 8 bf16 (one 16-byte store): in
// float32 pairs, or value by value in float64 for a NaN or an extreme scale.
__device__ __forceinline__ uint4 dequantized_chunk(uint2 values, unsigned long long scales, int chunk) {
    const unsigned char scale = (unsigned char)(scales >> (8 * (chunk * kDimsPerChunk / DSV4_QUANT_TILE)));
    if (exact_in_float32(scale) && !has_e4m3_nan(values.x) && !has_e4m3_nan(values.y))
        return make_uint4(dequantized_bf16x2(values.x & 0xFFFFu, scale), dequantized_bf16x2(values.x >> 16, scale),
                          dequantized_bf16x2(values.y & 0xFFFFu, scale), dequantized_bf16x2(values.y >> 16, scale));
    unsigned short bf16[kDimsPerChunk];
#pragma unroll
    for (int d = 0; d < kDimsPerChunk; ++d)
        bf16[d] = dequantized_bf16((unsigned char)((d < 4 ? values.x : values.y) >> (8 * (d % 4))), scale);
    return make_uint4(bf16[0] | ((unsigned)bf16[1] << 16), bf16[2] | ((unsigned)bf16[3] << 16),
                      bf16[4] | ((unsigned)bf16[5] << 16), bf16[6] | ((unsigned)bf16[7] << 16));
}

// State `state` of page `page` (an entry of the source's table) into out_row,
// nothing for a page outside the cache: every load first (the stores cannot
// hold them up), then the stores.
__device__ __forceinline__ void gather_state(const KCacheSource& s, i64 page, i64 state,
                                             unsigned short* __restrict__ out_row, int lane) {
    if (page < 0 || page >= s.num_pages) return;
    const unsigned char* __restrict__ page_base = s.cache + page * s.page_stride;
    const unsigned char* __restrict__ record = page_base + state * DSV4_FP8_RECORD;
    const unsigned long long scales = *reinterpret_cast<const unsigned long long*>(
        page_base + s.block_size * DSV4_FP8_RECORD + state * DSV4_SCALE_RECORD);
    // Chunk `lane` is NoPE; chunk `lane + 32` is NoPE for lanes below 24, RoPE after.
    const uint2 first = reinterpret_cast<const uint2*>(record)[lane];
    const int second_chunk = lane + DSV4_WARP_LANES;
    uint4 second;
    if (second_chunk < kNopeChunks) {
        const uint2 values = reinterpret_cast<const uint2*>(record)[second_chunk];
        second = make_uint4(values.x, values.y, 0, 0);
    } else {
        second = reinterpret_cast<const uint4*>(record + DSV4_NOPE_DIM)[second_chunk - kNopeChunks];
    }
    reinterpret_cast<uint4*>(out_row)[lane] = dequantized_chunk(first, scales, lane);
    reinterpret_cast<uint4*>(out_row)[second_chunk] =
        second_chunk < kNopeChunks ? dequantized_chunk(make_uint2(second.x, second.y), scales, second_chunk)
                                   : second;
}

// Row `row` of request b's output (out_row): the source whose rows it holds,
// its row i there, the position of that row in the request's rows; nothing
// when that is outside G, the request's rows or the source's table. A source
// gathered whole (no gather_lens) has row i at position i: its table entry is
// read beside seq_lens, not after it (one dependent load fewer).
__device__ __forceinline__ void gather_request_row(const KCacheSource& first, const KCacheSource& second,
                                                   i64 num_sources, const int* __restrict__ seq_lens,
                                                   i64 b, i64 row, unsigned short* __restrict__ out_row,
                                                   int lane) {
    const KCacheSource& s = (num_sources > 1 && row >= second.first_row) ? second : first;
    if (b >= s.table.rows) return;
    const int* __restrict__ table_row = s.table.entries + b * s.table.row_stride;
    const i64 i = row - s.first_row;
    if (s.gather_lens == nullptr) {
        const i64 column = quotient(i, s.block_size);
        if (column >= s.table.cols) return;
        const i64 page = table_row[column];
        if (i >= quotient((i64)seq_lens[b], s.ratio)) return;
        gather_state(s, page, i - column * s.block_size, out_row, lane);
        return;
    }
    const i64 gathered = s.gather_lens[b];
    const i64 position = quotient((i64)seq_lens[b], s.ratio) - gathered + i;
    if (i >= gathered || position < 0) return;
    const i64 column = quotient(position, s.block_size);
    if (column >= s.table.cols) return;
    gather_state(s, table_row[column], position - column * s.block_size, out_row, lane);
}

__device__ __forceinline__ void dequantize_and_gather_k_cache(const KCacheGatherParams& p,
                                                              const Blocks& blocks = whole_grid()) {
    const WarpRows warps(blocks);
    const i64 span = p.rows - p.first.first_row;              // rows of a request some source fills
    for (i64 item = warps.first; item < p.num_reqs * span; item += warps.step) {
        const i64 b = quotient(item, span), row = p.first.first_row + (item - b * span);
        gather_request_row(p.first, p.second, p.num_sources, p.seq_lens, b, row,
                           p.out + b * p.out_request_stride + row * p.out_row_stride, warps.lane);
    }
}

}  // namespace dsv4
