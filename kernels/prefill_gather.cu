// compute_prefill_gather_lens: raw tokens each prefill request gathers from the
// SWA cache, q + min(max(L - q, 0), W - 1) (its queries and the window before
// them). One thread per prefill request.
#include "common.cuh"

namespace dsv4 {
__device__ __forceinline__ void prefill_gather_lens(const PrefillGatherParams& p) {
    const int* __restrict__ qsl = p.query.query_start_loc;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.num_prefills; i += stride) {
        const i64 b = p.num_decodes + i;
        const i64 query_len = (i64)qsl[b + 1] - qsl[b];
        const i64 prefix = (i64)p.query.seq_lens[b] - query_len;
        p.out[i] = (int)(query_len + clamp_i64(prefix, 0, p.window_size - 1));
    }
}

}  // namespace dsv4
