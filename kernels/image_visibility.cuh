// compute_image_visibility (vLLM 0.34's _compute_image_visibility_kernel):
// token t < token_offset + num_rows of request b = token_to_req[t] at position
// p, inside the inclusive image span [s, e] of b (spans[indptr[b]] ..
// spans[indptr[b + 1] - 1]; the last such span wins), sees left = min(p - s,
// max_image_tokens - 1) image positions before it and right = min(e - p,
// max_image_tokens) after it; 0 and 0 outside every span, for the tokens
// before token_offset (decodes), and for a request outside the layout. Span
// indices are clamped to the span arrays. One thread per token.
#pragma once
#include "common.cuh"

struct ImageVisibilityParams {   // compute_image_visibility
    QueryLayout query;
    const int* token_to_req;     // [num_tokens] int32
    const int* span_indptr;      // [num_reqs + 1] int32, CSR of each request's spans
    const int* span_starts;      // [num_spans] int32, inclusive first position
    const int* span_ends;        // [num_spans] int32, inclusive last position
    int* left_visible;           // [num_tokens] int32
    int* right_visible;          // [num_tokens] int32
    i64 num_spans;
    i64 num_tokens;              // token_offset + num_rows
    i64 token_offset;            // tokens before it are decodes: 0 and 0
    i64 max_image_tokens;
};

namespace dsv4 {
__device__ __forceinline__ void image_visibility(const ImageVisibilityParams& p,
                                                 const Blocks& blocks = whole_grid()) {
    const int* __restrict__ qsl = p.query.query_start_loc;
    const i64 stride = blocks.count * DSV4_THREADS;
    for (i64 t = blocks.index * DSV4_THREADS + threadIdx.x; t < p.num_tokens; t += stride) {
        i64 left = 0, right = 0;
        const i64 b = t >= p.token_offset ? (i64)p.token_to_req[t] : -1;
        if (b >= 0 && b < p.query.num_reqs) {
            const i64 position = token_position(p.query.seq_lens[b], qsl[b + 1], t);
            const i64 first = clamp_i64(p.span_indptr[b], 0, p.num_spans);
            const i64 last = clamp_i64(p.span_indptr[b + 1], first, p.num_spans);
            for (i64 i = first; i < last; ++i) {
                const i64 start = p.span_starts[i], end = p.span_ends[i];
                if (start <= position && position <= end) {
                    left = min(position - start, p.max_image_tokens - 1);
                    right = min(end - position, p.max_image_tokens);
                }
            }
        }
        p.left_visible[t] = (int)left;
        p.right_visible[t] = (int)right;
    }
}

}  // namespace dsv4
