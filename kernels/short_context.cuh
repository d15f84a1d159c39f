// fill_short_context_topk_indices: row t holds k for k < n = (positions[t] + 1)
// / ratio (truncating, clamped to [0, top_k]) and -1 after, over top_k columns:
// the C128A prefill row rule at another ratio and width.
#pragma once
#include "common.cuh"

struct ShortContextParams {      // fill_short_context_topk_indices
    const void* positions;       // [num_tokens] int32 or int64 (entry suffix p32/p64)
    int* out;                    // [num_tokens, out_stride] int32, top_k columns written
    i64 out_stride;
    i64 top_k;
    i64 ratio;
    i64 num_tokens;
};

namespace dsv4 {
struct ShortContextRow {
    int n;
    __device__ __forceinline__ int value(int k) const { return k < n ? k : DSV4_PAD_SLOT_ID; }
    __device__ __forceinline__ int length() const { return n; }
};

// kLanes threads take a row: a warp, or for few rows four warps, a 16-byte
// store each for 512 columns (geometry.row_lanes says when). kTopK
// and kRatio are top_k and the ratio compiled in (families.TOP_K_AXIS and
// C4A_RATIO_AXIS) or DSV4_RUN_TIME: a compiled-in ratio divides by a shift
// with no other path in the code, a compiled-in width leaves no column loop.
template <typename PosT, int kLanes, int kTopK = DSV4_RUN_TIME, int kRatio = DSV4_RUN_TIME,
          int kThreads = DSV4_THREADS>
__device__ __forceinline__ void fill_short_context_topk_indices(const ShortContextParams& p,
                                                                const Blocks& blocks = whole_grid()) {
    const PosT* __restrict__ positions = static_cast<const PosT*>(p.positions);
    const int top_k = compiled_or<kTopK>(p.top_k);
    fill_rows<ColumnLoop::kUnrolled, kLanes, kThreads>(p.out, p.out_stride, nullptr, p.num_tokens,
                                                       top_k, blocks, [&](i64 t) {
        return ShortContextRow{visible_rows(positions[t], compiled_or<kRatio>(p.ratio), top_k)};
    });
}

}  // namespace dsv4
