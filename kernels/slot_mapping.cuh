// get_compressed_slot_mapping: one thread per element of the output buffer,
// so the -1 fill of the whole buffer and the slot writes are one pass with no
// write ordering to get wrong. Element i < num_tokens belongs to the
// block-table row b with qsl[b] <= i < qsl[b + 1]; everything else is -1, and
// so is a token whose own slot is negative (vLLM's token_slot_mapping rule,
// single rank only: under context parallelism another rank may own it).
#pragma once
#include "common.cuh"

struct SlotMappingParams {
    QueryLayout query;
    BlockTable table;
    SlotGeometry geometry;
    const void* token_slots;     // [num_tokens] int32 or int64 (s32/s64) tokens' own slots,
                                 // or null; used when cp_world_size is 1
    long long* out;              // [out_len] int64, all of it written
    i64 out_len;
    i64 num_tokens;              // tokens that may get a slot (the rest of out is -1)
};

namespace dsv4 {
template <typename SlotT>
__device__ __forceinline__ void compressed_slot_mapping(const SlotMappingParams& p,
                                                        const Blocks& blocks = whole_grid()) {
    const SlotT* __restrict__ token_slots = static_cast<const SlotT*>(p.token_slots);
    const bool own_slot_rule = token_slots != nullptr && p.geometry.cp_world_size == 1;
    const i64 stride = blocks.count * DSV4_THREADS;
    for (i64 i = blocks.index * DSV4_THREADS + threadIdx.x; i < p.out_len; i += stride) {
        const bool slotted = i < p.num_tokens && !(own_slot_rule && token_slots[i] < 0);
        p.out[i] = slotted ? compressed_slot_at(p.query, p.table, p.geometry, i)
                           : DSV4_PAD_SLOT_ID;
    }
}

}  // namespace dsv4
