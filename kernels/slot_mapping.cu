// get_compressed_slot_mapping: one thread per element of the output buffer,
// so the -1 fill of the whole buffer and the slot writes are one pass with no
// write ordering to get wrong. Element i belongs to the block-table row b with
// qsl[b] <= i < qsl[b + 1]; everything else is -1.
#include "common.cuh"

namespace dsv4 {
__device__ __forceinline__ void compressed_slot_mapping(const SlotMappingParams& p) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.out_len; i += stride)
        p.out[i] = compressed_slot_at(p.query, p.table, p.geometry, i);
}

}  // namespace dsv4
