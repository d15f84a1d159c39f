// compute_swa_indices_and_lens: row i is token t = i + token_offset; a valid
// token at position p gets the SWA-cache slots of positions max(p - W + 1, 0)
// .. p (block_table[b][pos / bs] * bs + pos % bs), then -1. One rule for what
// cannot be addressed: an invalid token, a request outside the table (or
// seq_lens) or a negative position gets an all -1 row and length 0; window
// positions past the table row's blocks are -1 and not counted. A warp per
// row (W = 128 is a vector per lane), and the request's layout is read from a clamped
// request before the validity is known, so the loads of a row form a chain of
// three (request, layout, block table), as in upstream's kernel.
#include "common.cuh"

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
        return block_slot(first_block[bs.div(offset)], bs.size, bs.mod(offset));
    }
    __device__ __forceinline__ int length() const { return count; }
};

// A token's validity and request, as a row of the SWA rows reads them.
struct SwaToken {
    bool valid;
    i64 request;
};

// The rows of p, token t's validity and request from token_of(t): read from
// the arrays the op is given, or computed by the fused step kernel.
template <typename TokenOf>
__device__ __forceinline__ void swa_rows(const SwaParams& p, const Blocks& blocks,
                                         const TokenOf& token_of) {
    const int* __restrict__ qsl = p.query.query_start_loc;
    const i64 requests = min(p.query.num_reqs, p.table.rows);
    with_block_divisor((int)p.block_size, [&](auto bs) {
        fill_warp_rows(p.indices, p.indices_stride, p.lens, p.num_rows, (int)p.window_size,
                       blocks, [&](i64 i) {
            SwaRow<decltype(bs)> row{nullptr, 0, 0, bs};
            const i64 t = i + p.token_offset;
            const SwaToken token = token_of(t);
            const bool valid = token.valid;
            const i64 b = token.request;
            if (requests <= 0) return row;
            const bool in_table = b >= 0 && b < requests;
            const i64 request = in_table ? b : 0;
            const i64 qs = qsl[request];
            const i64 position = (i64)p.query.seq_lens[request] - ((i64)qsl[request + 1] - qs) +
                                 (t - qs);
            if (!valid || !in_table || position < 0) return row;
            const i64 start = position - p.window_size + 1 > 0 ? position - p.window_size + 1 : 0;
            row.count = (int)clamp_i64(min(position + 1 - start, p.table.cols * p.block_size - start),
                                       0, p.window_size);
            const i64 first_column = bs.div(start);
            row.first_block = p.table.entries + request * p.table.row_stride + first_column;
            row.first_within = (int)(start - first_column * p.block_size);
            return row;
        });
    });
}

__device__ __forceinline__ void swa_indices_and_lens(const SwaParams& p) {
    const unsigned char* __restrict__ is_valid =
        static_cast<const unsigned char*>(p.is_valid_token);
    swa_rows(p, whole_grid(),
             [&](i64 t) { return SwaToken{is_valid[t] != 0, (i64)p.token_to_req[t]}; });
}

}  // namespace dsv4
