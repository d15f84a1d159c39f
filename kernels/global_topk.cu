// compute_global_topk_indices_and_lens: one warp per token row, 128 entries
// (4 per lane) at a time. Entry x of a row becomes
// block_table[req][x / bs] * bs + x % bs when 0 <= x and x / bs is a column of
// the table row, else -1 (the 0x7FC00000 NaN pattern included); the length
// counts the valid entries. An invalid token or a request outside the table
// gets an all -1 row and length 0, reading no table entry. With `compact` the
// valid entries are packed to the front in order, -1 after.
//
// In place (out == topk_indices) is safe: a lane reads its entries of a group
// of slices before the warp synchronises and writes after, and a slice's writes
// land below the slice's end (packing only moves entries left), so no unread entry
// is overwritten. A warp needs no block barrier, so rows never wait on each
// other; the row's entries are read before its request is known, and a group
// of four slices is read before any of it is written.
#include "common.cuh"

namespace dsv4 {
constexpr int kSliceEntries = 4 * 32;   // a warp's entries per slice, 4 per lane
constexpr int kGroupSlices = 4;         // slices whose loads are all in flight together

__device__ __forceinline__ void global_topk_indices_and_lens(const GlobalTopkParams& p,
                                                             const Blocks& blocks = whole_grid()) {
    const unsigned char* __restrict__ is_valid =
        static_cast<const unsigned char*>(p.is_valid_token);
    const WarpRows rows(blocks);
    const int lane = rows.lane;
    const BlockDivisor bs((int)p.block_size);
    const bool aligned_in = ((reinterpret_cast<unsigned long long>(p.topk_indices) |
                              (unsigned long long)p.topk_stride * 4ull) & 15ull) == 0;
    const bool aligned_out = ((reinterpret_cast<unsigned long long>(p.out) |
                               (unsigned long long)p.out_stride * 4ull) & 15ull) == 0;
    for (i64 t = rows.first; t < p.num_tokens; t += rows.step) {
        const i64 req = p.token_to_req[t];
        const bool usable = is_valid[t] && req >= 0 && req < p.table.rows;
        const i64 columns = usable ? p.table.cols : 0;     // no entry of an unusable row is valid
        const int* __restrict__ block_row =
            p.table.entries + (usable ? req : 0) * p.table.row_stride;
        const int* source = p.topk_indices + t * p.topk_stride;
        int* target = p.out + t * p.out_stride;
        int count = 0;           // valid entries of the earlier slices (same in every lane)
        for (i64 group = 0; group < p.width; group += kGroupSlices * kSliceEntries) {
            // Every entry of the group is read (and its block looked up) before
            // anything is written: one round of loads, not one per slice.
            int x[kGroupSlices][4], value[kGroupSlices][4];
            unsigned valid_bits[kGroupSlices];
#pragma unroll
            for (int s = 0; s < kGroupSlices; ++s) {
                const i64 k = group + s * kSliceEntries + 4 * lane;
                if (aligned_in && k + 4 <= p.width) {
                    const int4 q = *reinterpret_cast<const int4*>(source + k);
                    x[s][0] = q.x; x[s][1] = q.y; x[s][2] = q.z; x[s][3] = q.w;
                } else {
#pragma unroll
                    for (int j = 0; j < 4; ++j) x[s][j] = k + j < p.width ? source[k + j] : -1;
                }
            }
#pragma unroll
            for (int s = 0; s < kGroupSlices; ++s) {
                valid_bits[s] = 0;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const bool valid = x[s][j] >= 0 && bs.div(x[s][j]) < columns;
                    value[s][j] = valid ? block_slot(block_row[bs.div(x[s][j])], bs.size,
                                                     bs.mod(x[s][j]))
                                        : DSV4_PAD_SLOT_ID;
                    valid_bits[s] |= (unsigned)valid << j;
                }
            }
            __syncwarp();        // every lane has read its entries of the group
#pragma unroll
            for (int s = 0; s < kGroupSlices; ++s) {
                const i64 k = group + s * kSliceEntries + 4 * lane;
                const int mine = __popc(valid_bits[s]);
                if (!p.compact) {
                    if (aligned_out && k + 4 <= p.width) {
                        *reinterpret_cast<int4*>(target + k) =
                            make_int4(value[s][0], value[s][1], value[s][2], value[s][3]);
                    } else {
                        for (int j = 0; j < 4; ++j)
                            if (k + j < p.width) target[k + j] = value[s][j];
                    }
                } else {
                    int before = mine;  // inclusive scan of the lanes' counts, then exclusive
                    for (int offset = 1; offset < 32; offset <<= 1) {
                        const int other = __shfl_up_sync(0xffffffffu, before, offset);
                        if (lane >= offset) before += other;
                    }
                    int at = count + before - mine;
                    for (int j = 0; j < 4; ++j)
                        if (valid_bits[s] >> j & 1u) target[at++] = value[s][j];
                }
                count += __reduce_add_sync(0xffffffffu, mine);
            }
        }
        if (p.compact) {
            __syncwarp();
            for (i64 k = count + lane; k < p.width; k += 32) target[k] = DSV4_PAD_SLOT_ID;
        }
        if (lane == 0) p.lens[t] = count;
    }
}

}  // namespace dsv4
