// token_to_req_indices: the request of each flattened token (padding -> 0).
// A per-token binary search over the device query_start_loc, so the map is
// right even when the host copy of the boundaries is stale (vLLM #56562).
#include "common.cuh"

namespace dsv4 {
__device__ __forceinline__ void token_to_req_indices(const TokenMapParams& p) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < p.num_tokens; t += stride)
        p.out[t] = token_request(p.query, t);
}

}  // namespace dsv4
