// token_to_req_indices: the request of each flattened token (padding -> 0).
// A per-token binary search over the device query_start_loc, so the map is
// right even when the host copy of the boundaries is stale (vLLM #56562).
#pragma once
#include "common.cuh"

struct TokenMapParams {
    QueryLayout query;
    int* out;                    // [num_tokens] int32
    i64 num_tokens;
};

namespace dsv4 {
__device__ __forceinline__ void token_to_req_indices(const TokenMapParams& p,
                                                     const Blocks& blocks = whole_grid()) {
    const i64 stride = blocks.count * DSV4_THREADS;
    for (i64 t = blocks.index * DSV4_THREADS + threadIdx.x; t < p.num_tokens; t += stride)
        p.out[t] = token_request(p.query, t);
}

}  // namespace dsv4
