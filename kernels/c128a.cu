// build_c128a_topk_metadata: block b writes one piece (a token's columns
// [c0, c1)), so a long row is split over several blocks and a single decode
// token still spreads over the GPU. Templated on the positions and
// slot-mapping types; the loader instantiates the entry points.
#include "common.cuh"

namespace dsv4 {
template <typename PosT, typename SlotT>
__device__ __forceinline__ void c128a_topk_metadata(const C128AParams& p) {
    const RowPiece piece(p.chunks, p.rows.width, blockIdx.x);
    if (piece.t >= p.num_tokens) return;
    const int req = piece.t < p.num_decode_tokens ? p.token_to_req[piece.t] : 0;
    c128a_piece(piece, req, static_cast<const PosT*>(p.positions)[piece.t],
                static_cast<const SlotT*>(p.slot_mapping), p.num_decode_tokens, p.table,
                p.geometry, p.rows);
}

}  // namespace dsv4
