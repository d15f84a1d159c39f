// compute_swa_indices_and_lens: row i is token t = i + token_offset; a valid
// token at position p gets the SWA-cache slots of positions max(p - W + 1, 0)
// .. p (block_table[b][pos / bs] * bs + pos % bs), then -1 to index_width
// columns. vLLM 0.34's extensions widen or move that window: image visibility
// (l, r: it starts max(l - W + 1, 0) earlier and ends r later), the request's
// replay start (no position before it), and DSpark's non-causal rows (every
// token of a request sees [max(L - q - W, 0), L)); the host compiles the window
// in only without them. One rule for what
// cannot be addressed: an invalid token, a request outside the table (or
// seq_lens) or a negative position gets an all -1 row and length 0; window
// positions past the table row's blocks are -1 and not counted. A warp per
// row (W = 128 is a vector per lane), or four warps for few rows (a column
// each). The layout of a guessed request (t >> guess_shift: token t's request
// in a batch of requests of 2^guess_shift tokens each, a decode batch's, MTP
// included) is read with token t's request and validity, so such a row's
// loads form a chain of two (request and layout, block table) where
// vLLM's kernel has three; any other row reads its own request's layout
// after them.
#pragma once
#include "common.cuh"

struct SwaParams {               // compute_swa_indices_and_lens
    QueryLayout query;           // num_reqs = min(query_start_loc rows, seq_lens length)
    BlockTable table;            // the SWA group's block table
    const int* token_to_req;     // [token_offset + num_rows] int32
    const void* is_valid_token;  // [token_offset + num_rows] bool (one byte each)
    int* indices;                // [num_rows, indices_stride] int32, index_width columns written
    int* lens;                   // [num_rows] int32
    const int* left_visible;     // [token_offset + num_rows] int32 image positions before the
    const int* right_visible;    // window and after the token, or both null
    const int* replay_start;     // [num_reqs] int32 first position with window KV, or null
    i64 indices_stride;
    i64 window_size;             // W (128)
    i64 index_width;             // columns per row, >= W (W + max_image_tokens, DSpark's width)
    i64 causal;                  // 0: DSpark's non-causal rows
    i64 block_size;              // SWA cache rows per block (64)
    i64 token_offset;            // row i is token i + token_offset
    i64 num_rows;
    i64 guess_shift;             // token t's request is guessed as t >> guess_shift
                                 // (geometry.request_guess_shift)
};

namespace dsv4 {
template <typename Divisor>
struct SwaRow {
    const int* __restrict__ first_block;   // the table entry of the window's first position
    int first_within, count;
    Divisor bs;

    // Window entry k sits first_within + k rows past the first block's start;
    // k < count keeps its block inside the table row.
    __device__ __forceinline__ int value(int k) const {
        if (k >= count) return DSV4_PAD_SLOT_ID;
        const int offset = first_within + k;
        return block_slot(__ldg(first_block + bs.div(offset)), bs.size, bs.mod(offset));
    }
    __device__ __forceinline__ int length() const { return count; }
};

// The window of `window` positions ending at `position` (>= 0), in a table
// row of `span` positions: its first position and how many of its positions
// the row holds (min(position + 1, span) - start, at most `window`).
template <typename IndexT>
struct Window {
    IndexT start;
    int count;
    __device__ __forceinline__ Window(IndexT position, IndexT span, int window)
        : start(max(position - (IndexT)window + 1, (IndexT)0)),
          count((int)max(min(position + 1, span) - start, (IndexT)0)) {}
    // The same window widened by `before` positions ahead of it and `after`
    // past `position`, starting at `floor` or later, at most `width` counted.
    __device__ __forceinline__ Window(i64 position, i64 span, i64 window, i64 before, i64 after,
                                      i64 floor, int width)
        : start(max(max(position - window + 1 - before, (i64)0), floor)),
          count((int)clamp_i64(min(position + 1 + after, span) - start, 0, width)) {}
};

// A token's validity and request, as a row of the SWA rows reads them.
struct SwaToken {
    bool valid;
    i64 request;
};

// token_position, out of line, for a row whose request is not the guessed one.
// Inline, ptxas merges its reads into the block of the row's first loads and
// puts the compare with the guess (a wait on the request's load) ahead of the
// guessed reads: three load levels again on every decode row.
__device__ __noinline__ i64 token_position_out_of_line(const int* seq_lens, const int* qsl,
                                                        i64 request, i64 t) {
    return token_position(seq_lens[request], qsl[request + 1], t);
}

// The rows of p, token t's validity and request from token_of(t): read from
// the arrays the op is given, or computed by the fused step kernel.
//
// kWindow and kBlockSize are W and the block size compiled in (DeepSeek-V4's,
// families.SWA_WINDOW_AXIS and SWA_BLOCK_AXIS), or DSV4_RUN_TIME for p's. A
// compiled-in window computes the window in 32 bits, the position clamped at
// DSV4_POSITION_LIMIT: the host picks it only when the table row's span plus W
// stays under that limit, so a clamped position sees no block either way; with
// both values compiled in, a row's code is one straight line. kLanes threads
// take a row: a warp, a 16-byte vector per lane, or (geometry.row_lanes, for
// few rows) four warps, a column per thread as in vLLM's kernel.
template <int kWindow, int kBlockSize, int kLanes, int kThreads = DSV4_THREADS, typename TokenOf>
__device__ __forceinline__ void swa_rows(const SwaParams& p, const Blocks& blocks,
                                         const TokenOf& token_of) {
    constexpr ColumnLoop kLoop =
        kLanes == DSV4_WARP_LANES ? ColumnLoop::kUnrolled : ColumnLoop::kScalar;
    const int* __restrict__ qsl = p.query.query_start_loc;
    const i64 requests = min(p.query.num_reqs, p.table.rows);
    const int window = compiled_or<kWindow>(p.window_size);
    const int width = kWindow != DSV4_RUN_TIME ? kWindow : (int)p.index_width;
    const i64 span = p.table.cols * p.block_size;
    with_block_divisor<kBlockSize>((int)p.block_size, [&](auto bs) {
        fill_rows<kLoop, kLanes, kThreads>(p.indices, p.indices_stride, p.lens, p.num_rows,
                                           width, blocks, [&](i64 i) {
            SwaRow<decltype(bs)> row{nullptr, 0, 0, bs};
            const i64 t = i + p.token_offset;
            if (requests <= 0) return row;
            const SwaToken token = token_of(t);
            const i64 guess = min(t >> p.guess_shift, requests - 1);
            i64 position = token_position(p.query.seq_lens[guess], qsl[guess + 1], t);
            const bool in_table = token.request >= 0 && token.request < requests;
            const i64 request = in_table ? token.request : guess;
            if (request != guess)
                position = token_position_out_of_line(p.query.seq_lens, qsl, request, t);
            // Branch-free from here: a row that cannot be addressed keeps the
            // window of position 0 in a row of the table, with no entry counted.
            const bool addressable = token.valid && in_table && position >= 0;
            position = addressable ? position : 0;
            const int* __restrict__ table_row = p.table.entries + request * p.table.row_stride;
            const auto place = [&](const auto& w) {
                const auto first_column = bs.div(w.start);
                row.count = addressable ? w.count : 0;
                row.first_block = table_row + first_column;
                row.first_within = (int)(w.start - first_column * bs.size);
            };
            if constexpr (kWindow != DSV4_RUN_TIME) {
                place(Window<int>((int)min(position, (i64)DSV4_POSITION_LIMIT), (int)span, window));
            } else {
                i64 last = position, reach = window, before = 0, after = 0, floor = 0;
                if (p.left_visible != nullptr) {
                    before = max((i64)p.left_visible[t] - (window - 1), (i64)0);
                    after = p.right_visible[t];
                }
                if (p.replay_start != nullptr) floor = p.replay_start[request];
                if (!p.causal) {        // the request's last position, reaching back over its query
                    const i64 query_len = (i64)qsl[request + 1] - qsl[request];
                    last = position + ((i64)qsl[request + 1] - 1 - t);
                    reach = window + query_len;
                }
                place(Window<i64>(last, span, reach, before, after, floor, width));
            }
            return row;
        });
    });
}

template <int kWindow, int kBlockSize, int kLanes, int kThreads>
__device__ __forceinline__ void swa_indices_and_lens(const SwaParams& p) {
    const unsigned char* __restrict__ is_valid =
        static_cast<const unsigned char*>(p.is_valid_token);
    swa_rows<kWindow, kBlockSize, kLanes, kThreads>(p, whole_grid(),
                      [&](i64 t) { return SwaToken{is_valid[t] != 0, (i64)p.token_to_req[t]}; });
}

}  // namespace dsv4
