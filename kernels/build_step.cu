// The fused per-step build of DeepseekV4MetadataBuilder: one launch computes
// the token->request map, the compressed slot mapping (whole buffer) and the
// C128A decode and prefill rows, which the seed path does in 4-5 launches.
//
// Blocks [0, row_blocks) are C128A row pieces (as in c128a.cu); each finds its
// token's request itself, so no block waits for another. The remaining blocks
// take one element each of the request map and the slot-mapping buffer.
#include "common.cuh"

namespace dsv4 {
template <typename PosT, typename SlotT>
__device__ __forceinline__ void build_step(const BuildStepParams& p) {
    const i64 block = blockIdx.x;
    if (block < p.chunks.row_blocks) {
        const RowPiece piece(p.chunks, p.rows.width, block);
        const int req = piece.t < p.num_decode_tokens ? token_request(p.query, piece.t) : 0;
        c128a_piece(piece, req, static_cast<const PosT*>(p.positions)[piece.t],
                    static_cast<const SlotT*>(p.slot_mapping), p.num_decode_tokens, p.table,
                    p.geometry, p.rows);
        return;
    }
    const i64 i = (block - p.chunks.row_blocks) * blockDim.x + threadIdx.x;
    if (i < p.num_tokens) p.req_out[i] = token_request(p.query, i);
    if (p.slots_out != nullptr && i < p.slots_len)
        p.slots_out[i] = compressed_slot_at(p.query, p.table, p.geometry, i);
}

}  // namespace dsv4
