// The fused per-step kernel of the builders: every step-level output of a
// DeepSeek-V4 step in one launch. Each section is a family's device function
// on its own range of the grid (sections.* are the cumulative block ends; a
// section of no blocks is off), so no block waits for another: a section that
// needs another's output computes it itself (the SWA rows find their token's
// request by binary search and their validity from the SWA slot mapping; the
// combined rows compute their gather lengths).
//
// DeepseekV4MetadataBuilder turns on `base` alone (its group); the step
// builder turns on every section its step needs.
#include "common.cuh"
#include "swa.cu"
#include "slot_mapping.cu"
#include "prefill_gather.cu"
#include "indexer_decode.cu"
#include "indexer_prefill.cu"
#include "combine.cu"
#include "short_context.cu"

namespace dsv4 {
// The base section: the token->request map, one group's compressed slot
// mapping (whole buffer) and the C128A decode and prefill rows. Blocks
// [0, row_blocks) are C128A row pieces (as in c128a.cu), each finding its
// token's request itself; the others take one element each of the request map
// and the slot-mapping buffer.
template <typename PosT, typename SlotT>
__device__ __forceinline__ void build_step(const BuildStepParams& p, const Blocks& blocks) {
    if (blocks.index < p.chunks.row_blocks) {
        const RowPiece piece(p.chunks, p.rows.width, blocks.index);
        const int req = piece.t < p.num_decode_tokens ? token_request(p.query, piece.t) : 0;
        c128a_piece(piece, req, static_cast<const PosT*>(p.positions)[piece.t],
                    static_cast<const SlotT*>(p.slot_mapping), p.num_decode_tokens, p.table,
                    p.geometry, p.rows);
        return;
    }
    const i64 i = (blocks.index - p.chunks.row_blocks) * DSV4_THREADS + threadIdx.x;
    if (i < p.num_tokens) p.req_out[i] = token_request(p.query, i);
    if (p.slots_out != nullptr && i < p.slots_len)
        p.slots_out[i] = compressed_slot_at(p.query, p.table, p.geometry, i);
}

// Chunk c of a prefill plan holds the requests [first_request[c], first_request[c + 1]).
__device__ __forceinline__ CombineChunk plan_chunk(const PrefillPlan& plan, i64 request) {
    int c = 0;
    while (c + 1 < plan.chunks && plan.first_request[c + 1] <= request) ++c;
    return CombineChunk{plan.first_request[c], plan.rows_per_request[c], plan.swa_offset[c]};
}

// A layer type's combined prefill rows: a warp per row, or a block per wide row
// (p.lanes, geometry.combine_lanes).
__device__ __forceinline__ void prefill_combine(const PrefillCombineParams& p, const Blocks& blocks) {
    const auto chunk_of = [&](i64 b) { return plan_chunk(p.plan, b); };
    if (p.lanes == DSV4_THREADS)
        combine_rows<DSV4_RUN_TIME, DSV4_RUN_TIME, DSV4_THREADS, false>(p.rows, blocks, chunk_of);
    else
        combine_rows<DSV4_RUN_TIME, DSV4_RUN_TIME, DSV4_WARP_LANES, false>(p.rows, blocks, chunk_of);
}

template <typename PosT, typename SlotT>
__device__ __forceinline__ void step_metadata(const StepParams& p) {
    const StepSections& s = p.sections;
    const i64 block = blockIdx.x;
    if (block < s.base) {
        build_step<PosT, SlotT>(p.base, Blocks{block, s.base});
    } else if (block < s.swa) {
        const SlotT* __restrict__ swa_slots = static_cast<const SlotT*>(p.swa_slot_mapping);
        swa_rows<DSV4_RUN_TIME, DSV4_RUN_TIME, DSV4_WARP_LANES>(p.swa, Blocks{block - s.base, s.swa - s.base}, [&](i64 t) {
            const bool valid = swa_slots[t] >= 0;
            if (threadIdx.x % DSV4_WARP_LANES == 0) p.is_valid_out[t] = valid;
            return SwaToken{valid, (i64)token_request(p.swa.query, t)};
        });
    } else if (block < s.c4a_slots) {
        compressed_slot_mapping<SlotT>(p.c4a_slots, Blocks{block - s.swa, s.c4a_slots - s.swa});
    } else if (block < s.indexer_slots) {
        compressed_slot_mapping<SlotT>(p.indexer_slots, Blocks{block - s.c4a_slots,
                                                               s.indexer_slots - s.c4a_slots});
    } else if (block < s.gather) {
        prefill_gather_lens(p.gather, Blocks{block - s.indexer_slots, s.gather - s.indexer_slots});
    } else if (block < s.indexer_decode) {
        indexer_decode_metadata(p.indexer_decode,
                                Blocks{block - s.gather, s.indexer_decode - s.gather});
    } else if (block < s.indexer_prefill) {
        indexer_prefill_chunk_metadata(p.indexer_prefill, Blocks{block - s.indexer_decode,
                                                                 s.indexer_prefill - s.indexer_decode});
    } else if (block < s.c128a_combine) {
        prefill_combine(p.c128a_combine, Blocks{block - s.indexer_prefill,
                                                s.c128a_combine - s.indexer_prefill});
    } else if (block < s.swa_combine) {
        prefill_combine(p.swa_combine, Blocks{block - s.c128a_combine,
                                              s.swa_combine - s.c128a_combine});
    } else if (block < s.short_context) {
        fill_short_context_topk_indices<PosT, DSV4_WARP_LANES>(p.short_context, Blocks{block - s.swa_combine,
                                                                      s.short_context - s.swa_combine});
    }
}
}  // namespace dsv4
