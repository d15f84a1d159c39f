// Launch parameters: one struct per kernel family, passed by value as the
// kernel's only argument (one argument costs the host far less than twenty).
// Structs are built from shared field groups. dsv4_cupy/params.py declares the
// same layouts; the loader compiles static_asserts of their sizes and offsets
// into every kernel, so the two cannot drift apart. Every field is 8 bytes.
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

struct BuildStepParams {
    QueryLayout query;
    BlockTable table;
    SlotGeometry geometry;
    const void* positions;       // [num_tokens] int32 or int64 (p32/p64)
    const void* slot_mapping;    // [num_tokens] int32 or int64 (s32/s64)
    int* req_out;                // [num_tokens] int32
    long long* slots_out;        // [slots_len] int64 compressed slots; null for ratio 1
    i64 slots_len;
    C128ARows rows;              // null pointers unless ratio 128
    RowChunks chunks;
    i64 num_tokens;
    i64 num_decode_tokens;
};
