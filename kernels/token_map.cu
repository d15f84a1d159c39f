// token_to_req_indices: the request of each flattened token (padding -> 0).
// A per-token binary search over the device query_start_loc, so the map is
// right even when the host copy of the boundaries is stale (vLLM #56562).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
token_to_req_indices(const int* __restrict__ qsl, int num_reqs, i64 num_tokens,
                     int* __restrict__ out) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < num_tokens; t += stride)
        out[t] = token_request(qsl, num_reqs, t);
}
