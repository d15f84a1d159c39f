// compute_swa_indices_and_lens: one warp per output row. Row i is token
// t = i + token_offset; a valid token at position p gets the SWA-cache slots of
// positions max(p - W + 1, 0) .. p (block_table[b][pos / bs] * bs + pos % bs),
// then -1. One rule for what cannot be addressed: an invalid token, a request
// outside the table (or seq_lens) or a negative position gets an all -1 row and
// length 0; window positions past the table row's blocks are -1 and not counted.
// W = 128 is one 16-byte store per lane.
#include "common.cuh"

namespace dsv4 {
__device__ __forceinline__ void swa_indices_and_lens(const SwaParams& p) {
    const WarpRows rows;
    const unsigned char* __restrict__ is_valid =
        static_cast<const unsigned char*>(p.is_valid_token);
    const int* __restrict__ qsl = p.query.query_start_loc;
    const int block_size = (int)p.block_size;
    for (i64 i = rows.first; i < p.num_rows; i += rows.step) {
        const i64 t = i + p.token_offset;
        const i64 b = p.token_to_req[t];
        const int* block_row = nullptr;
        int count = 0;
        i64 first_column = 0;
        int first_within = 0;
        if (is_valid[t] && b >= 0 && b < p.query.num_reqs && b < p.table.rows) {
            const i64 qs = qsl[b];
            const i64 position = (i64)p.query.seq_lens[b] - ((i64)qsl[b + 1] - qs) + (t - qs);
            if (position >= 0) {
                const i64 start = position - p.window_size + 1 > 0 ? position - p.window_size + 1
                                                                    : 0;
                count = (int)clamp_i64(
                    min(position + 1 - start, p.table.cols * p.block_size - start), 0,
                    p.window_size);
                block_row = p.table.entries + b * p.table.row_stride;
                first_column = start / p.block_size;
                first_within = (int)(start - first_column * p.block_size);
            }
        }
        // Window entry k sits first_within + k rows past the first column's start;
        // k < count keeps its column inside the table row.
        const BlockDivisor bs(block_size);
        fill_columns(p.indices + i * p.indices_stride, 0, (int)p.window_size, rows.lane, 32,
                     [&](int k) {
                         if (k >= count) return DSV4_PAD_SLOT_ID;
                         const int offset = first_within + k;
                         return block_slot(block_row[first_column + bs.div(offset)], block_size,
                                           bs.mod(offset));
                     });
        if (rows.lane == 0) p.lens[i] = count;
    }
}

}  // namespace dsv4
