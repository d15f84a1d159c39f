// get_compressed_slot_mapping: one thread per element of the output buffer,
// so the -1 fill of the whole buffer and the slot writes are one pass with no
// write ordering to get wrong. Element i belongs to the block-table row b with
// qsl[b] <= i < qsl[b + 1]; everything else is -1.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
compressed_slot_mapping(const int* __restrict__ qsl, const int* __restrict__ seq_lens, int num_rows,
                        const int* __restrict__ block_table, i64 bt_cols, i64 bt_stride,
                        i64 block_size, i64 ratio, i64 cp_world_size, i64 cp_rank,
                        i64 cp_interleave, i64 out_len, long long* __restrict__ out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < out_len; i += stride) {
        i64 slot = -1;
        if (num_rows > 0)
            slot = compressed_slot(qsl, seq_lens, request_of(qsl, num_rows, i), i, block_table,
                                   bt_cols, bt_stride, block_size, ratio, cp_world_size, cp_rank,
                                   cp_interleave);
        out[i] = slot;
    }
}
