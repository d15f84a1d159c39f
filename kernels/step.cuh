// The fused per-step kernel of the builders: every step-level output of a
// DeepSeek-V4 step in one launch. Each section is one family's device
// function, with that family's struct, on its own range of the grid
// (sections.* are the cumulative block ends; a section of no blocks is off),
// so no block waits for another: a section that needs another's output
// computes it itself (the C128A and SWA rows find their token's request by
// binary search, the SWA rows their validity from the SWA slot mapping, the
// combined rows their gather lengths).
//
// DeepseekV4MetadataBuilder turns on its group's sections (token map, slot
// mapping, C128A rows); the step builder every section its step needs.
#pragma once
#include "common.cuh"
#include "token_map.cuh"
#include "c128a.cuh"
#include "swa.cuh"
#include "slot_mapping.cuh"
#include "prefill_gather.cuh"
#include "indexer_decode.cuh"
#include "indexer_prefill.cuh"
#include "combine.cuh"
#include "short_context.cuh"

struct PrefillPlan {             // a prefill chunk plan (get_prefill_chunk_plan), chunks <= max
    i64 chunks;
    int first_request[DSV4_MAX_PLAN_CHUNKS];     // chunk c: [first_request[c], first_request[c + 1])
    int rows_per_request[DSV4_MAX_PLAN_CHUNKS];  // M of chunk c
    int swa_offset[DSV4_MAX_PLAN_CHUNKS];        // N of chunk c
};

struct PrefillCombineParams {    // combined prefill rows of a layer type, once per step
    CombineParams rows;          // the prefill requests; gather_lens null (computed)
    i64 lanes;                   // threads per row: DSV4_WARP_LANES or DSV4_THREADS (geometry.combine_lanes)
    PrefillPlan plan;            // rows_per_request and swa_offset of rows are unused
};

struct StepSections {            // cumulative block ends, in order; equal ends: section off
    i64 token_map;
    i64 group_slots;
    i64 c128a;
    i64 swa;
    i64 c4a_slots;
    i64 indexer_slots;
    i64 gather;
    i64 indexer_decode;
    i64 indexer_native_decode;
    i64 indexer_prefill;
    i64 c128a_combine;
    i64 swa_combine;
    i64 short_context;
};

struct StepParams {              // DeepseekV4StepMetadataBuilder.build (and the group builder)
    StepSections sections;       // first: every block reads it before its section's fields
    TokenMapParams token_map;    // the group's token->request map
    SlotMappingParams group_slots;   // the group's compressed slot mapping (ratio > 1)
    C128AParams c128a;           // token_to_req unused (computed from token_map.query)
    SwaParams swa;               // token_to_req and is_valid_token unused (computed)
    SlotMappingParams c4a_slots;
    SlotMappingParams indexer_slots;
    PrefillGatherParams gather;
    IndexerDecodeParams indexer_decode;
    IndexerNativeDecodeParams indexer_native_decode;
    IndexerPrefillParams indexer_prefill;
    PrefillCombineParams c128a_combine;
    PrefillCombineParams swa_combine;
    ShortContextParams short_context;
    const void* swa_slot_mapping;  // [num_tokens] int32 or int64 (s32/s64): validity of SWA rows
    unsigned char* is_valid_out; // [num_tokens] bool: swa_slot_mapping >= 0
    i64 first_block;             // kRotated: the block of the sections' order that grid
                                 // block 0 runs, < gridDim.x (step_kernel.first_block)
};

namespace dsv4 {
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

// The block range of the section that ends at block `end`, the previous ending at `start`.
// `in` is asked in grid order (earlier sections ruled out); `within` out of order.
struct Section {
    i64 block;
    __device__ __forceinline__ bool in(i64 start, i64 end, Blocks& blocks) const {
        blocks = Blocks{block - start, end - start};
        return block < end;
    }
    __device__ __forceinline__ bool within(i64 start, i64 end, Blocks& blocks) const {
        return block >= start && in(start, end, blocks);
    }
};

template <typename PosT, typename SlotT, int kRotated>
__device__ __forceinline__ void step_metadata(const StepParams& p) {
    const StepSections& s = p.sections;
    // A grid past one wave runs the sections' order from first_block on,
    // wrapping round, so its longest blocks start first; an entry point of
    // its own, so a grid of one wave runs code without it (docs/performance.md).
    unsigned block = blockIdx.x;
    if (kRotated) {
        block += (unsigned)p.first_block;
        if (block >= gridDim.x) block -= gridDim.x;
    }
    const Section at{(i64)block};
    Blocks b;
    // The C128A rows are tested first: a decode step's longest blocks reach
    // their code with one test (docs/performance.md).
    if (at.within(s.group_slots, s.c128a, b)) {
        c128a_rows<PosT, SlotT>(p.c128a, b,
                                [&](i64 t) { return token_request(p.token_map.query, t); });
    } else if (at.in(0, s.token_map, b)) {
        token_to_req_indices(p.token_map, b);
    } else if (at.in(s.token_map, s.group_slots, b)) {
        compressed_slot_mapping<SlotT>(p.group_slots, b);
    } else if (at.in(s.c128a, s.swa, b)) {
        const SlotT* __restrict__ swa_slots = static_cast<const SlotT*>(p.swa_slot_mapping);
        swa_rows<DSV4_RUN_TIME, DSV4_RUN_TIME, DSV4_WARP_LANES>(p.swa, b, [&](i64 t) {
            const bool valid = swa_slots[t] >= 0;
            if (threadIdx.x % DSV4_WARP_LANES == 0) p.is_valid_out[t] = valid;
            return SwaToken{valid, (i64)token_request(p.swa.query, t)};
        });
    } else if (at.in(s.swa, s.c4a_slots, b)) {
        compressed_slot_mapping<SlotT>(p.c4a_slots, b);
    } else if (at.in(s.c4a_slots, s.indexer_slots, b)) {
        compressed_slot_mapping<SlotT>(p.indexer_slots, b);
    } else if (at.in(s.indexer_slots, s.gather, b)) {
        prefill_gather_lens(p.gather, b);
    } else if (at.in(s.gather, s.indexer_decode, b)) {
        indexer_decode_metadata(p.indexer_decode, b);
    } else if (at.in(s.indexer_decode, s.indexer_native_decode, b)) {
        indexer_native_decode_metadata(p.indexer_native_decode, b);
    } else if (at.in(s.indexer_native_decode, s.indexer_prefill, b)) {
        indexer_prefill_chunk_metadata(p.indexer_prefill, b);
    } else if (at.in(s.indexer_prefill, s.c128a_combine, b)) {
        prefill_combine(p.c128a_combine, b);
    } else if (at.in(s.c128a_combine, s.swa_combine, b)) {
        prefill_combine(p.swa_combine, b);
    } else if (at.in(s.swa_combine, s.short_context, b)) {
        fill_short_context_topk_indices<PosT, DSV4_WARP_LANES>(p.short_context, b);
    }
}
}  // namespace dsv4
