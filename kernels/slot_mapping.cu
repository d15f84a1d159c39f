// get_compressed_slot_mapping: one thread per element of the output buffer,
// so the -1 fill of the whole buffer and the slot writes are one pass with no
// write ordering to get wrong. Element i belongs to the block-table row b with
// qsl[b] <= i < qsl[b + 1]; everything else is -1.
#include "common.cuh"
#include "params.cuh"

extern "C" __global__ void __launch_bounds__(256) compressed_slot_mapping(const SlotMappingParams p) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.out_len; i += stride) {
        i64 slot = -1;
        if (p.num_rows > 0)
            slot = compressed_slot(p.qsl, p.seq_lens, request_of(p.qsl, p.num_rows, i), i,
                                   p.block_table, p.bt_cols, p.bt_stride, p.block_size, p.ratio,
                                   p.cp_world_size, p.cp_rank, p.cp_interleave);
        p.out[i] = slot;
    }
}
