// combine_topk_swa_indices (hardened V4.1 form): token t of the chunk (request
// b, position p; b counted from the first request of b's chunk) gets k_len =
// min((p + 1) / ratio, topk) compressed entries x + M * b (-1 unless 0 <= x <
// N, still counted), then the s_len window rows
// M * b + N + (swa_start - g0) + i with g0 = L - gather_len and swa_start =
// max(p - W + 1, 0, g0), then -1 to C columns. Tokens at or past the chunk's
// total get an all -1 row and length 0. Without topk_indices (null) the
// compressed entries are C128A's local prefill rows, x = k for k < k_len: the
// rows need no input, and one build serves every C128A layer of a step. A
// warp per row (fill_rows, the compact column loop); at 8192 tokens and
// C = 8320 this is a 272 MB write.
#include "common.cuh"

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
template <typename ChunkOf>
__device__ __forceinline__ void combine_rows(const CombineParams& p, const Blocks& blocks,
                                             const ChunkOf& chunk_of) {
    const int* __restrict__ qsl = p.query.query_start_loc;
    const i64 base = qsl[0];
    const i64 total = p.query.num_reqs > 0 ? (i64)qsl[p.query.num_reqs] - base : 0;
    fill_rows<ColumnLoop::kCompact>(p.out, p.out_stride, p.lens, p.num_tokens, (int)p.width,
                                    blocks, [&](i64 t) {
        const int* topk_row = p.topk_indices != nullptr ? p.topk_indices + t * p.topk_stride
                                                        : nullptr;
        CombineRow row{topk_row, 0, 0, (int)p.swa_offset, 0, 0};
        // Searched before t < total is known, so the search's loads need not
        // wait for those of total (any t reads inside qsl). With one request
        // the search's answer is 0 whatever qsl holds: skipped, 8192 rows of
        // one request took 3.63 us (SWA-only) and 8.59 (C4A) against 4.27 and
        // 8.93 on the H200.
        const int b = p.query.num_reqs == 1 ? 0 : request_of(qsl, p.query.num_reqs, base + t);
        if (t < total) {
            const i64 qs = qsl[b], seq_len = p.query.seq_lens[b];
            const i64 position = seq_len - ((i64)qsl[b + 1] - qs) + (base + t - qs);
            row.topk_len = p.topk > 0 ? visible_rows(position, p.ratio, p.topk) : 0;
            const CombineChunk chunk = chunk_of(b);
            const i64 gather_len = p.gather_lens != nullptr
                ? (i64)p.gather_lens[b]
                : prefill_gather_len((i64)qsl[b + 1] - qs, seq_len, p.window_size);
            const i64 gather_start = seq_len - gather_len;
            i64 swa_start = position - p.window_size + 1;
            swa_start = swa_start > 0 ? swa_start : 0;
            swa_start = swa_start > gather_start ? swa_start : gather_start;
            row.swa_len = (int)clamp_i64(position - swa_start + 1, 0, p.window_size);
            const i64 request_base = chunk.rows_per_request * (b - chunk.first_request);
            row.request_base = (unsigned)request_base;
            row.swa_offset = (int)chunk.swa_offset;
            row.swa_first =
                (unsigned)(request_base + chunk.swa_offset + (swa_start - gather_start));
        }
        return row;
    });
}

__device__ __forceinline__ void combine_topk_swa_indices(const CombineParams& p,
                                                         const Blocks& blocks = whole_grid()) {
    combine_rows(p, blocks,
                 [&](i64) { return CombineChunk{0, p.rows_per_request, p.swa_offset}; });
}

}  // namespace dsv4
