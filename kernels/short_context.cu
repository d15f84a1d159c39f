// fill_short_context_topk_indices: row t holds k for k < n = (positions[t] + 1)
// / ratio (truncating, clamped to [0, top_k]) and -1 after, over top_k columns:
// the C128A prefill row rule at another ratio and width. Block b writes one
// piece of a row, so long rows spread over several blocks.
#include "common.cuh"

namespace dsv4 {
template <typename PosT>
__device__ __forceinline__ void fill_short_context_topk_indices(const ShortContextParams& p) {
    const RowPiece piece(p.chunks, p.top_k, blockIdx.x);
    if (piece.t >= p.num_tokens) return;
    const int n = visible_rows(static_cast<const PosT*>(p.positions)[piece.t], p.ratio, p.top_k);
    c128a_fill_columns(p.out + piece.t * p.out_stride, piece.c0, piece.c1, n, nullptr, 1);
}

}  // namespace dsv4
