// Launch parameters: one struct per kernel family, passed by value as the
// kernel's only argument (one argument costs the host far less than twenty).
// Structs are built from shared field groups. dsv4_cupy/params.py declares the
// same layouts; the loader compiles static_asserts of their sizes and offsets
// into every kernel, so the two cannot drift apart. Fields are 8 bytes, but for
// the int arrays of a prefill plan, which come last in their struct.
#pragma once

typedef long long i64;

// --- field groups ---------------------------------------------------------------------------
struct QueryLayout {
    const int* query_start_loc;  // [num_reqs + 1] int32, cumulative query lengths
    const int* seq_lens;         // [num_reqs] int32, context incl. this step (null if unused)
    i64 num_reqs;
};

struct BlockTable {              // one KV-cache group's block table
    const int* entries;          // [rows, row_stride] int32, rows contiguous
    i64 rows;
    i64 cols;                    // entries of a row that may be read
    i64 row_stride;              // elements between rows (>= cols)
};

struct SlotGeometry {            // where compressed rows live
    i64 block_size;              // storage rows per cache block (256 / ratio)
    i64 ratio;                   // compress ratio (4, 128)
    i64 cp_world_size;           // context-parallel ranks sharing the compressed rows
    i64 cp_rank;
    i64 cp_interleave;           // consecutive rows per rank (cp_kv_cache_interleave_size)
};

struct C128ARows {               // C128A top-k rows, row stride fixed by the buffers
    int* global_decode;          // [num_decode_tokens, decode_stride] int32
    int* decode_lens;            // [num_decode_tokens] int32
    int* prefill;                // [num_tokens - num_decode_tokens, prefill_stride] int32
    i64 decode_stride;
    i64 prefill_stride;
    i64 width;                   // columns written per row (<= both strides)
    i64 num_valid_tokens;        // under DCP: tokens t < this are real (-1: use slot_mapping)
};

struct RowChunks {               // long rows split over several blocks
    i64 cols_per_block;          // a multiple of 4, so 16-byte stores stay aligned
    i64 chunks;                  // blocks per row
    i64 row_blocks;              // blocks given to rows (rows * chunks)
};


// --- one struct per kernel family -------------------------------------------------------------
struct TokenMapParams {
    QueryLayout query;
    int* out;                    // [num_tokens] int32
    i64 num_tokens;
};

struct SlotMappingParams {
    QueryLayout query;
    BlockTable table;
    SlotGeometry geometry;
    const void* token_slots;     // [num_tokens] int32 or int64 (s32/s64) tokens' own slots,
                                 // or null; used when cp_world_size is 1
    long long* out;              // [out_len] int64, all of it written
    i64 out_len;
    i64 num_tokens;              // tokens that may get a slot (the rest of out is -1)
};

struct C128AParams {
    const void* positions;       // [num_tokens] int32 or int64 (entry suffix p32/p64)
    const int* token_to_req;     // [num_decode_tokens] int32
    const void* slot_mapping;    // [num_decode_tokens] int32 or int64 (s32/s64)
    BlockTable table;
    SlotGeometry geometry;
    C128ARows rows;
    RowChunks chunks;
    i64 num_tokens;
    i64 num_decode_tokens;
};

// --- the per-layer and indexer metadata families ----------------------------------------------
struct SwaParams {               // compute_swa_indices_and_lens
    QueryLayout query;           // num_reqs = min(query_start_loc rows, seq_lens length)
    BlockTable table;            // the SWA group's block table
    const int* token_to_req;     // [token_offset + num_rows] int32
    const void* is_valid_token;  // [token_offset + num_rows] bool (one byte each)
    int* indices;                // [num_rows, indices_stride] int32, window_size columns written
    int* lens;                   // [num_rows] int32
    i64 indices_stride;
    i64 window_size;             // W, columns per row (128)
    i64 block_size;              // SWA cache rows per block (64)
    i64 token_offset;            // row i is token i + token_offset
    i64 num_rows;
    i64 guess_shift;             // token t's request is guessed as t >> guess_shift
                                 // (geometry.request_guess_shift)
};

struct GlobalTopkParams {        // compute_global_topk_indices_and_lens
    BlockTable table;            // the C4A group's block table
    const int* topk_indices;     // [num_tokens, topk_stride] int32, request-local rows (may be out)
    const int* token_to_req;     // [num_tokens] int32
    const void* is_valid_token;  // [num_tokens] bool (one byte each)
    int* out;                    // [num_tokens, out_stride] int32, width columns written
    int* lens;                   // [num_tokens] int32
    i64 topk_stride;
    i64 out_stride;
    i64 width;                   // K, columns of topk_indices read and of out written
    i64 num_tokens;
    i64 block_size;              // compressed rows per cache block (64 for C4A)
};

struct ShortContextParams {      // fill_short_context_topk_indices
    const void* positions;       // [num_tokens] int32 or int64 (entry suffix p32/p64)
    int* out;                    // [num_tokens, out_stride] int32, top_k columns written
    i64 out_stride;
    i64 top_k;
    i64 ratio;
    i64 num_tokens;
};

struct CombineParams {           // combine_topk_swa_indices
    QueryLayout query;           // the chunk's query_start_loc (any first value) and seq_lens
    const int* gather_lens;      // [num_reqs] int32
    const int* topk_indices;     // [num_tokens, topk_stride] int32, read below topk only
    int* out;                    // [num_tokens, out_stride] int32, width columns written
    int* lens;                   // [num_tokens] int32
    i64 topk_stride;
    i64 out_stride;
    i64 width;                   // C = round_up(topk + window_size, 128)
    i64 num_tokens;
    i64 window_size;
    i64 ratio;                   // compress ratio (>= 1 when topk > 0)
    i64 topk;
    i64 rows_per_request;        // M: workspace rows per request
    i64 swa_offset;              // N: workspace row of a request's first SWA token
};

struct PrefillGatherParams {     // compute_prefill_gather_lens
    QueryLayout query;           // num_reqs >= num_decodes + num_prefills
    int* out;                    // [num_prefills] int32
    i64 num_decodes;
    i64 num_prefills;
    i64 window_size;
};

struct IndexerPrefillParams {    // build_indexer_prefill_chunk_metadata
    QueryLayout query;           // the chunk's query_start_loc (any first value) and seq_lens
    int* cu_compressed;          // [num_reqs + 1] int32
    int* token_to_seq;           // [num_compressed] int32, -1 past the true total
    int* seqlen_ks;              // [query_slice_stop - query_slice_start] int32
    int* seqlen_ke;              // [query_slice_stop - query_slice_start] int32
    i64 num_compressed;
    i64 ratio;
    i64 query_slice_start;
    i64 query_slice_stop;
};

struct IndexerDecodeParams {     // build_indexer_decode_metadata
    QueryLayout query;
    BlockTable table;            // rows >= num_reqs
    int* context_lens;           // [context_lens_len] int32, zero past num_tokens
    int* req_ids;                // [num_tokens] int32
    int* decode_lens;            // [num_tokens] int32
    int* block_rows;             // [num_tokens, block_rows_stride] int32, table.cols written
    i64 block_rows_stride;
    i64 num_tokens;
    i64 context_lens_len;
    i64 ratio;
};

struct C4ALayerParams {          // c4a_layer_topk: one launch per C4A layer
    GlobalTopkParams decode;     // the layer's top-k rows of the decode tokens
    CombineParams prefill;       // the layer's top-k rows of the chunk's prefill tokens
    i64 decode_blocks;           // blocks [0, decode_blocks) convert decode rows, the rest combine
    i64 decode_compact;          // 1: the decode rows' valid entries packed to the front
};

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

// --- the fused step kernel (kernels/step.cuh): a section per family -----------------------------
struct StepSections {            // cumulative block ends, in order; equal ends: section off
    i64 token_map;
    i64 group_slots;
    i64 c128a;
    i64 swa;
    i64 c4a_slots;
    i64 indexer_slots;
    i64 gather;
    i64 indexer_decode;
    i64 indexer_prefill;
    i64 c128a_combine;
    i64 swa_combine;
    i64 short_context;
};

struct StepParams {              // DeepseekV4StepMetadataBuilder.build (and the group builder)
    TokenMapParams token_map;    // the group's token->request map
    SlotMappingParams group_slots;   // the group's compressed slot mapping (ratio > 1)
    C128AParams c128a;           // token_to_req unused (computed from token_map.query)
    SwaParams swa;               // token_to_req and is_valid_token unused (computed)
    SlotMappingParams c4a_slots;
    SlotMappingParams indexer_slots;
    PrefillGatherParams gather;
    IndexerDecodeParams indexer_decode;
    IndexerPrefillParams indexer_prefill;
    PrefillCombineParams c128a_combine;
    PrefillCombineParams swa_combine;
    ShortContextParams short_context;
    StepSections sections;
    const void* swa_slot_mapping;  // [num_tokens] int32 or int64 (s32/s64): validity of SWA rows
    unsigned char* is_valid_out; // [num_tokens] bool: swa_slot_mapping >= 0
};
