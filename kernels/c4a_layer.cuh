// c4a_layer_topk: one launch per C4A layer for both uses of the layer's
// indexer top-k. The first decode_blocks blocks turn the decode rows into
// global slots (compute_global_topk_indices_and_lens, in place or not), the
// others combine the chunk's prefill rows with their sliding windows
// (combine_topk_swa_indices): the two families' device functions, each on its
// own range of the grid. The two parts touch disjoint rows.
#pragma once
#include "global_topk.cuh"
#include "combine.cuh"

struct C4ALayerParams {          // c4a_layer_topk: one launch per C4A layer
    GlobalTopkParams decode;     // the layer's top-k rows of the decode tokens
    CombineParams prefill;       // the layer's top-k rows of the chunk's prefill tokens
    i64 decode_blocks;           // blocks [0, decode_blocks) convert decode rows, the rest combine
    i64 decode_compact;          // 1: the decode rows' valid entries packed to the front
};

namespace dsv4 {
__device__ __forceinline__ void c4a_layer_topk(const C4ALayerParams& p) {
    const i64 block = blockIdx.x;
    if (block < p.decode_blocks) {
        const Blocks blocks{block, p.decode_blocks};
        if (p.decode_compact)
            global_topk_compact_indices_and_lens(p.decode, blocks);
        else
            global_topk_indices_and_lens<DSV4_RUN_TIME, DSV4_RUN_TIME>(p.decode, blocks);
    } else                       // a warp per row (c4a_layer.py's block count)
        combine_topk_swa_indices(p.prefill,
                                 Blocks{block - p.decode_blocks, gridDim.x - p.decode_blocks});
}

}  // namespace dsv4
