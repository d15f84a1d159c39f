// build_c128a_topk_metadata: block b writes columns [c0, c1) of token
// t = b / chunks, so a long row is split over several blocks and a single
// decode token still spreads over the GPU. Entry points for int32/int64
// positions (p32/p64) and slot mappings (s32/s64).
#include "common.cuh"
#include "params.cuh"

template <typename PosT, typename SlotT>
__device__ __forceinline__ void c128a_topk_metadata(const C128AParams& p) {
    const i64 t = (i64)blockIdx.x / p.chunks;
    if (t >= p.num_tokens) return;
    const int c0 = (int)((i64)blockIdx.x % p.chunks) * p.cols_per_block;
    const int c1 = min(p.width, c0 + p.cols_per_block);
    const int req = t < p.num_decode_tokens ? p.token_to_req[t] : 0;
    c128a_block(t, c0, c1, req, static_cast<const PosT*>(p.positions)[t], p.ratio,
                p.num_decode_tokens, p.block_table, p.bt_rows, p.bt_cols, p.bt_stride,
                p.block_size, static_cast<const SlotT*>(p.slot_mapping), p.width,
                p.global_decode, p.gd_stride, p.decode_lens, p.prefill, p.pf_stride);
}

DSV4_DTYPE_ENTRIES(c128a_topk_metadata, C128AParams, c128a_topk_metadata)
