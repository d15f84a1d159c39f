// get_compressed_slot_mapping: one thread per element of the output buffer,
// so the -1 fill of the whole buffer and the slot writes are one pass with no
// write ordering to get wrong. Element i < num_tokens belongs to the
// block-table row b with qsl[b] <= i < qsl[b + 1]; everything else is -1, and
// so is a token whose own slot is -1 (vLLM 0.34's rule: a padding token, or
// under context parallelism a token another rank holds).
#pragma once
#include "common.cuh"

struct SlotMappingParams {
    QueryLayout query;
    BlockTable table;
    SlotGeometry geometry;
    const void* token_slots;     // [num_tokens] int32 or int64 (s32/s64) tokens' own slots, or null
    long long* out;              // [out_len] int64, all of it written
    i64 out_len;
    i64 num_tokens;              // tokens that may get a slot (the rest of out is -1)
};

namespace dsv4 {
template <typename SlotT>
__device__ __forceinline__ void compressed_slot_mapping(const SlotMappingParams& p,
                                                        const Blocks& blocks = whole_grid()) {
    const SlotT* __restrict__ token_slots = static_cast<const SlotT*>(p.token_slots);
    const i64 stride = blocks.count * DSV4_THREADS;
    for (i64 i = blocks.index * DSV4_THREADS + threadIdx.x; i < p.out_len; i += stride) {
        const bool slotted = i < p.num_tokens &&
                             !(token_slots != nullptr && token_slots[i] == DSV4_PAD_SLOT_ID);
        p.out[i] = slotted ? compressed_slot_at(p.query, p.table, p.geometry, i)
                           : DSV4_PAD_SLOT_ID;
    }
}

}  // namespace dsv4
