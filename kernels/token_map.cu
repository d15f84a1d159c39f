// token_to_req_indices: the request of each flattened token (padding -> 0).
// A per-token binary search over the device query_start_loc, so the map is
// right even when the host copy of the boundaries is stale (vLLM #56562).
#include "common.cuh"
#include "params.cuh"

extern "C" __global__ void __launch_bounds__(256) token_to_req_indices(const TokenMapParams p) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < p.num_tokens; t += stride)
        p.out[t] = token_request(p.qsl, p.num_reqs, t);
}
