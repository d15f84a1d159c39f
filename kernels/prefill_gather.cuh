// compute_prefill_gather_lens: raw tokens each prefill request gathers from the
// SWA cache, q + min(max(L - q - replay_start, 0), W - 1) (its queries and the
// window before them that exists). One thread per prefill request.
#pragma once
#include "common.cuh"

struct PrefillGatherParams {     // compute_prefill_gather_lens
    QueryLayout query;           // num_reqs >= num_decodes + num_prefills
    int* out;                    // [num_prefills] int32
    const int* replay_start;     // [num_reqs] int32 per request, or null (0)
    i64 num_decodes;
    i64 num_prefills;
    i64 window_size;
};

namespace dsv4 {
__device__ __forceinline__ void prefill_gather_lens(const PrefillGatherParams& p,
                                                    const Blocks& blocks = whole_grid()) {
    const int* __restrict__ qsl = p.query.query_start_loc;
    const i64 stride = blocks.count * DSV4_THREADS;
    for (i64 i = blocks.index * DSV4_THREADS + threadIdx.x; i < p.num_prefills; i += stride) {
        const i64 b = p.num_decodes + i;
        p.out[i] = (int)prefill_gather_len((i64)qsl[b + 1] - qsl[b], p.query.seq_lens[b],
                                           p.window_size,
                                           p.replay_start != nullptr ? p.replay_start[b] : 0);
    }
}

}  // namespace dsv4
