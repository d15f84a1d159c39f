// combine_topk_swa_indices (hardened V4.1 form): token t of the chunk (request
// b, position p; b counted from the first request of b's chunk) gets k_len =
// min((p + 1) / ratio, topk) compressed entries x + M * b (-1 unless 0 <= x <
// N, still counted), then the s_len window rows
// M * b + N + (swa_start - g0) + i with g0 = L - gather_len and swa_start =
// max(p - W + 1, 0, g0), then -1 to C columns. With image visibility (l, r
// image positions seen before the window and after the token) the window
// starts max(l - W + 1, 0) earlier and ends r later, s_len at most W + the
// image width. Tokens at or past the chunk's
// total get an all -1 row and length 0. Without topk_indices (null) the
// compressed entries are C128A's local prefill rows, x = k for k < k_len: the
// rows need no input, and one build serves every C128A layer of a step. A
// warp per row, or a block per wide row (fill_rows, the compact column loop);
// at 8192 tokens and C = 8320 this is a 272 MB write.
#pragma once
#include "common.cuh"

struct CombineParams {           // combine_topk_swa_indices
    QueryLayout query;           // the chunk's query_start_loc (any first value) and seq_lens
    const int* gather_lens;      // [num_reqs] int32
    const int* topk_indices;     // [num_tokens, topk_stride] int32, read below topk only
    int* out;                    // [num_tokens, out_stride] int32, width columns written
    int* lens;                   // [num_tokens] int32
    const int* left_visible;     // [num_tokens] int32, read when image_width > 0
    const int* right_visible;    // [num_tokens] int32, read when image_width > 0
    i64 topk_stride;
    i64 out_stride;
    i64 width;                   // C = round_up(topk + window_size + max_image_tokens, 128)
    i64 num_tokens;
    i64 window_size;
    i64 image_width;             // max_image_tokens with visibility given, else 0
    i64 ratio;                   // compress ratio (>= 1 when topk > 0)
    i64 topk;
    i64 rows_per_request;        // M: workspace rows per request
    i64 swa_offset;              // N: workspace row of a request's first SWA token
};

namespace dsv4 {
// A row's values are int32, so they are computed in 32 bits: the low 32 bits
// of the 64-bit sums (what the CPU path's wrap keeps), and N <= M < 2^31
// (checked on the host). Fewer instructions per entry and registers per
// thread (57 against 63 for sm_90).
struct CombineRow {
    const int* __restrict__ topk_row;
    unsigned request_base, swa_first;    // low 32 bits of M * b and of the first SWA row
    int swa_offset, topk_len, swa_len;

    __device__ __forceinline__ int value(int e) const {
        if (e < topk_len) {
            const int x = topk_row != nullptr ? topk_row[e] : e;
            return x >= 0 && x < swa_offset ? (int)((unsigned)x + request_base)
                                            : DSV4_PAD_SLOT_ID;
        }
        if (e < topk_len + swa_len) return (int)(swa_first + (unsigned)(e - topk_len));
        return DSV4_PAD_SLOT_ID;
    }
    __device__ __forceinline__ int length() const { return topk_len + swa_len; }
};

// The chunk of the prefill chunk plan that holds a request: its first
// request and its workspace geometry (M, N).
struct CombineChunk {
    i64 first_request, rows_per_request, swa_offset;
};

// The rows of p, request b's chunk from chunk_of(b): the one chunk of the op's
// arguments, or the step's plan. Without gather_lens (null) a request's
// gather length is computed (prefill_gather_len), as the fused step does.
//
// kWidth and kWindow are C and W compiled in (families.COMBINED_WIDTH_AXIS and
// SWA_WINDOW_AXIS) or DSV4_RUN_TIME; with both compiled in and equal the rows
// have no top-k part (C = round_up(topk + W, 128) >= topk + W), so nothing of
// it is in the code. kLanes threads take a row: a warp, or a block for wide
// rows (geometry.combine_lanes). kOneRequest: the chunk holds one request, b =
// 0 (request_of would read nothing either, but the set-up of its loop would
// wait for qsl[0] ahead of the layout's loads). The row's request layout is
// read with the row's first loads, before t < total is known (b is one of the
// chunk's requests whenever there is one), and the row is computed without
// branches: a conditional block would take those loads after total's.
template <int kWidth, int kWindow, int kLanes, bool kOneRequest, typename ChunkOf>
__device__ __forceinline__ void combine_rows(const CombineParams& p, const Blocks& blocks,
                                             const ChunkOf& chunk_of) {
    constexpr bool kNoTopk = kWidth != DSV4_RUN_TIME && kWidth == kWindow;
    const int* __restrict__ qsl = p.query.query_start_loc;
    const i64 num_reqs = p.query.num_reqs, window = compiled_or<kWindow>(p.window_size);
    fill_rows<ColumnLoop::kCompact, kLanes>(p.out, p.out_stride, p.lens, p.num_tokens,
                                            compiled_or<kWidth>(p.width), blocks, [&](i64 t) {
        const i64 chunk_start = qsl[0];
        const int* topk_row = !kNoTopk && p.topk_indices != nullptr
            ? p.topk_indices + t * p.topk_stride : nullptr;
        CombineRow row{topk_row, 0, 0, (int)p.swa_offset, 0, 0};
        const int b = kOneRequest ? 0 : request_of(qsl, num_reqs, chunk_start + t);
        i64 qs = 0, qe = 0, seq_len = 0, gather_len = 0;
        if (num_reqs > 0) {
            qs = qsl[b];
            qe = qsl[b + 1];
            seq_len = p.query.seq_lens[b];
            gather_len = p.gather_lens != nullptr ? (i64)p.gather_lens[b]
                                                  : prefill_gather_len(qe - qs, seq_len, window);
        }
        const bool in_chunk = num_reqs > 0 && t < (i64)qsl[num_reqs] - chunk_start;
        const i64 position = token_position(seq_len, qe, chunk_start + t);
        if constexpr (!kNoTopk)
            row.topk_len = in_chunk && p.topk > 0 ? visible_rows(position, p.ratio, p.topk) : 0;
        const CombineChunk chunk = chunk_of(b);
        const i64 gather_start = seq_len - gather_len;
        i64 left_extra = 0, right = 0;
        if (p.image_width > 0 && in_chunk) {
            left_extra = (i64)p.left_visible[t] - (window - 1);
            left_extra = left_extra > 0 ? left_extra : 0;
            right = p.right_visible[t];
        }
        i64 swa_start = position - window + 1 - left_extra;
        swa_start = swa_start > 0 ? swa_start : 0;
        swa_start = swa_start > gather_start ? swa_start : gather_start;
        row.swa_len = in_chunk
            ? (int)clamp_i64(position + right - swa_start + 1, 0, window + p.image_width) : 0;
        const i64 request_base = chunk.rows_per_request * (b - chunk.first_request);
        row.request_base = (unsigned)request_base;
        row.swa_offset = (int)chunk.swa_offset;
        row.swa_first = (unsigned)(request_base + chunk.swa_offset + (swa_start - gather_start));
        return row;
    });
}

template <int kWidth = DSV4_RUN_TIME, int kWindow = DSV4_RUN_TIME, int kLanes = DSV4_WARP_LANES>
__device__ __forceinline__ void combine_topk_swa_indices(const CombineParams& p,
                                                         const Blocks& blocks = whole_grid()) {
    const auto chunk_of = [&](i64) { return CombineChunk{0, p.rows_per_request, p.swa_offset}; };
    if (p.query.num_reqs == 1)
        combine_rows<kWidth, kWindow, kLanes, true>(p, blocks, chunk_of);
    else
        combine_rows<kWidth, kWindow, kLanes, false>(p, blocks, chunk_of);
}

}  // namespace dsv4
