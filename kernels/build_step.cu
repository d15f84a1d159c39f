// The fused per-step build of DeepseekV4MetadataBuilder: one launch computes
// the token->request map, the compressed slot mapping (whole buffer) and the
// C128A decode and prefill rows, which the seed path does in 4-5 launches.
//
// Blocks [0, row_blocks) are C128A row chunks (as in c128a.cu); each finds its
// token's request itself, so no block waits for another. The remaining blocks
// take one element each of the request map and the slot-mapping buffer.
#include "common.cuh"
#include "params.cuh"

template <typename PosT, typename SlotT>
__device__ __forceinline__ void build_step(const BuildStepParams& p) {
    const i64 block = blockIdx.x;
    if (block < p.row_blocks) {
        const i64 t = block / p.chunks;
        const int c0 = (int)(block % p.chunks) * p.cols_per_block;
        const int c1 = min(p.width, c0 + p.cols_per_block);
        const int req = t < p.num_decode_tokens ? token_request(p.qsl, p.num_reqs, t) : 0;
        c128a_block(t, c0, c1, req, static_cast<const PosT*>(p.positions)[t], p.ratio,
                    p.num_decode_tokens, p.block_table, p.bt_rows, p.bt_cols, p.bt_stride,
                    (int)p.block_size, static_cast<const SlotT*>(p.slot_mapping), p.width,
                    p.global_decode, p.row_stride, p.decode_lens, p.prefill, p.row_stride);
        return;
    }
    const i64 i = (block - p.row_blocks) * blockDim.x + threadIdx.x;
    if (i < p.num_tokens) p.req_out[i] = token_request(p.qsl, p.num_reqs, i);
    if (p.csm_out != nullptr && i < p.csm_len) {
        i64 slot = -1;
        if (p.bt_rows > 0)
            slot = compressed_slot(p.qsl, p.seq_lens, request_of(p.qsl, (int)p.bt_rows, i), i,
                                   p.block_table, p.bt_cols, p.bt_stride, p.block_size, p.ratio,
                                   p.cp_world_size, p.cp_rank, p.cp_interleave);
        p.csm_out[i] = slot;
    }
}

DSV4_DTYPE_ENTRIES(build_step, BuildStepParams, build_step)
