// fill_short_context_topk_indices: row t holds k for k < n = (positions[t] + 1)
// / ratio (truncating, clamped to [0, top_k]) and -1 after, over top_k columns:
// the C128A prefill row rule at another ratio and width.
#include "common.cuh"

namespace dsv4 {
struct ShortContextRow {
    int n;
    __device__ __forceinline__ int value(int k) const { return k < n ? k : DSV4_PAD_SLOT_ID; }
    __device__ __forceinline__ int length() const { return n; }
};

// kLanes threads take a row: a warp, or for few rows four warps, a 16-byte
// store each for 512 columns (geometry.short_context_lanes says when).
template <typename PosT, int kLanes>
__device__ __forceinline__ void fill_short_context_topk_indices(const ShortContextParams& p,
                                                                const Blocks& blocks = whole_grid()) {
    const PosT* __restrict__ positions = static_cast<const PosT*>(p.positions);
    fill_rows<ColumnLoop::kUnrolled, kLanes>(p.out, p.out_stride, nullptr, p.num_tokens,
                                             (int)p.top_k, blocks, [&](i64 t) {
        return ShortContextRow{visible_rows(positions[t], p.ratio, p.top_k)};
    });
}

}  // namespace dsv4
