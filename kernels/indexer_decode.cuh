// build_indexer_decode_metadata (vLLM #56562, then DSv4's division by the
// ratio): one warp per piece of 2^piece_shift block-table columns of each
// token t < num_tokens (a 1M-context row is 4096 columns); piece 0 writes the
// token's scalars. A real token (t < qsl[R]) of
// request b at in-request offset j gets context length
// max(L - q + j + 1, 0) / ratio, request id b and a copy of block-table row b;
// a padding token gets length 0, the distinct id R + (t - qsl[R]) and a zero
// row. Every token's decode length is 1. Then the whole length buffer past
// num_tokens is zeroed (a persistent buffer longer than the step), and each
// request's query length goes to per_req_lens.
#pragma once
#include "common.cuh"

struct IndexerDecodeParams {     // build_indexer_decode_metadata
    QueryLayout query;
    BlockTable table;            // rows >= num_reqs
    int* context_lens;           // [context_lens_len] int32, zero past num_tokens
    int* req_ids;                // [num_tokens] int32
    int* decode_lens;            // [num_tokens] int32
    int* block_rows;             // [num_tokens, block_rows_stride] int32, table.cols written
    int* per_req_lens;           // [num_reqs] int32
    i64 block_rows_stride;
    i64 num_tokens;
    i64 context_lens_len;
    i64 ratio;
    i64 piece_shift;             // log2 of the columns per warp (geometry.indexer_piece)
};

namespace dsv4 {
__device__ __forceinline__ void indexer_decode_metadata(const IndexerDecodeParams& p,
                                                        const Blocks& blocks = whole_grid()) {
    const int* __restrict__ qsl = p.query.query_start_loc;
    const i64 num_reqs = p.query.num_reqs, mapped = qsl[num_reqs];
    const WarpRows rows(blocks);
    // Shifts, not a run-time division: its registers would cut the step kernel's occupancy.
    const i64 piece = 1ll << p.piece_shift;
    const i64 pieces = p.table.cols > piece ? (p.table.cols + piece - 1) >> p.piece_shift : 1;
    for (i64 r = rows.first; r < p.num_tokens * pieces; r += rows.step) {
        const i64 t = quotient(r, pieces);
        const int c0 = (int)((r - t * pieces) << p.piece_shift);
        const bool real = num_reqs > 0 && t < mapped;
        const int b = real ? request_of(qsl, num_reqs, t) : 0;
        const int* block_row = real ? p.table.entries + (i64)b * p.table.row_stride : nullptr;
        fill_columns<ColumnLoop::kCompact>(p.block_rows + t * p.block_rows_stride, c0,
                                           (int)min(p.table.cols, c0 + piece), rows.lane,
                                           DSV4_WARP_LANES,
                                           [&](int c) { return real ? block_row[c] : 0; });
        if (c0 == 0 && rows.lane == 0) {
            if (real) {
                const i64 length = token_position(p.query.seq_lens[b], qsl[b + 1], t) + 1;
                p.context_lens[t] = (int)quotient(length > 0 ? length : 0, p.ratio);
                p.req_ids[t] = b;
            } else {
                p.context_lens[t] = 0;
                p.req_ids[t] = (int)(num_reqs + (t - mapped));
            }
            p.decode_lens[t] = 1;
        }
    }
    const i64 stride = blocks.count * DSV4_THREADS;
    for (i64 t = p.num_tokens + blocks.index * DSV4_THREADS + threadIdx.x;
         t < p.context_lens_len; t += stride)
        p.context_lens[t] = 0;
    for (i64 b = blocks.index * DSV4_THREADS + threadIdx.x; b < num_reqs; b += stride)
        p.per_req_lens[b] = qsl[b + 1] - qsl[b];
}

}  // namespace dsv4

// build_indexer_native_decode_metadata (vLLM's native [B, next_n] decode
// layout, sm_90's default): element (b, j) of row b < num_reqs is
// max(L_b - max_decode_len + 1 + j, 0) / ratio, the compressed rows the j-th
// of the request's last max_decode_len query positions sees; rows past
// num_reqs (graph padding) are 0. Each request's query length goes to
// decode_lens. One thread per element.
struct IndexerNativeDecodeParams {   // build_indexer_native_decode_metadata
    QueryLayout query;               // the decode requests
    int* seq_lens_out;               // [num_rows, seq_lens_stride] int32, max_decode_len columns written
    int* decode_lens;                // [num_reqs] int32
    i64 seq_lens_stride;
    i64 num_rows;                    // >= num_reqs
    i64 max_decode_len;              // >= 1
    i64 ratio;
};

namespace dsv4 {
__device__ __forceinline__ void indexer_native_decode_metadata(const IndexerNativeDecodeParams& p,
                                                               const Blocks& blocks = whole_grid()) {
    const int* __restrict__ qsl = p.query.query_start_loc;
    const i64 num_reqs = p.query.num_reqs, elements = p.num_rows * p.max_decode_len;
    const i64 stride = blocks.count * DSV4_THREADS;
    for (i64 e = blocks.index * DSV4_THREADS + threadIdx.x; e < elements; e += stride) {
        const i64 b = quotient(e, p.max_decode_len), j = e - b * p.max_decode_len;
        i64 visible = 0;
        if (b < num_reqs) {
            const i64 length = (i64)p.query.seq_lens[b] - p.max_decode_len + 1 + j;
            visible = (length > 0 ? length : 0) / p.ratio;
        }
        p.seq_lens_out[b * p.seq_lens_stride + j] = (int)visible;
        if (e < num_reqs) p.decode_lens[e] = qsl[e + 1] - qsl[e];
    }
}

}  // namespace dsv4
