// build_indexer_decode_metadata (vLLM #56562, then DSv4's division by the
// ratio): one warp per piece of 2^piece_shift block-table columns of each
// token t < num_tokens (a 1M-context row is 4096 columns); piece 0 writes the
// token's scalars. A real token (t < qsl[R]) of
// request b at in-request offset j gets context length
// max(L - q + j + 1, 0) / ratio, request id b and a copy of block-table row b;
// a padding token gets length 0, the distinct id R + (t - qsl[R]) and a zero
// row. Every token's decode length is 1. Then the whole length buffer past
// num_tokens is zeroed (a persistent buffer longer than the step), and each
// request's query length goes to per_req_lens. The grid has a thread for each
// of these writes and a warp for each piece (geometry.indexer_decode_blocks),
// so no loop: a loop's set-up sits ahead of a decode row's first load.
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
    i64 pieces;                  // pieces per token (geometry.warp_pieces); tokens * pieces < 2^31
};

namespace dsv4 {
__device__ __forceinline__ void indexer_decode_metadata(const IndexerDecodeParams& p,
                                                        const Blocks& blocks = whole_grid()) {
    const int* __restrict__ qsl = p.query.query_start_loc;
    const i64 num_reqs = p.query.num_reqs;
    const i64 thread = blocks.index * DSV4_THREADS + threadIdx.x;
    const i64 past = p.num_tokens + thread;
    if (past < p.context_lens_len) p.context_lens[past] = 0;
    if (thread < num_reqs) p.per_req_lens[thread] = qsl[thread + 1] - qsl[thread];
    const WarpRows warps(blocks);
    if (warps.first >= p.num_tokens * p.pieces) return;   // fewer than 2^31 (checked on the host)
    const RowPiece piece(warps.first, p.pieces, 1ll << p.piece_shift, p.table.cols);
    const i64 t = piece.t;
    const i64 mapped = qsl[num_reqs];
    const bool real = num_reqs > 0 && t < mapped;
    const int b = token_request(p.query, t);    // 0 for a padding token, whose row is not read
    const int* block_row = p.table.entries + (i64)b * p.table.row_stride;
    fill_columns<ColumnLoop::kCompact>(p.block_rows + t * p.block_rows_stride, piece.c0, piece.c1,
                                       warps.lane, DSV4_WARP_LANES,
                                       [&](int c) { return real ? block_row[c] : 0; });
    if (piece.c0 == 0 && warps.lane == 0) {
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
