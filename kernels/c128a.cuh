// build_c128a_topk_metadata: block b writes one piece (a token's columns
// [c0, c1)), so a long row is split over several blocks and a single decode
// token still spreads over the GPU. Templated on the positions and
// slot-mapping types; the loader instantiates the entry points.
#pragma once
#include "common.cuh"

namespace dsv4 {
// The rows of p, a decode token's request from request_of(t): read from the
// op's token_to_req, or found by the fused step kernel itself.
template <typename PosT, typename SlotT, typename RequestOf>
__device__ __forceinline__ void c128a_rows(const C128AParams& p, const Blocks& blocks,
                                           const RequestOf& request_of_token) {
    const RowPiece piece(p.chunks, p.rows.width, blocks.index);
    if (piece.t >= p.num_tokens) return;
    const int req = piece.t < p.num_decode_tokens ? request_of_token(piece.t) : 0;
    c128a_piece(piece, req, static_cast<const PosT*>(p.positions)[piece.t],
                static_cast<const SlotT*>(p.slot_mapping), p.num_decode_tokens, p.table,
                p.geometry, p.rows);
}

template <typename PosT, typename SlotT>
__device__ __forceinline__ void c128a_topk_metadata(const C128AParams& p) {
    c128a_rows<PosT, SlotT>(p, whole_grid(), [&](i64 t) { return p.token_to_req[t]; });
}

}  // namespace dsv4
