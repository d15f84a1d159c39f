// Launch parameters: one struct per kernel family, passed by value as the
// kernel's only argument (one argument costs the host far less than twenty).
// dsv4_cupy/params.py declares the same layouts; tests/test_params.py checks
// that the two agree field by field. Fields go 8-byte first, then 4-byte, so
// the only padding is at the end.
#pragma once

struct TokenMapParams {
    const int* qsl;
    int* out;
    long long num_tokens;
    int num_reqs;
};

struct SlotMappingParams {
    const int* qsl;
    const int* seq_lens;
    const int* block_table;
    long long* out;
    long long bt_cols;
    long long bt_stride;
    long long block_size;
    long long ratio;
    long long cp_world_size;
    long long cp_rank;
    long long cp_interleave;
    long long out_len;
    int num_rows;
};

struct C128AParams {
    const void* positions;      // int or long long (entry point suffix p32/p64)
    const int* token_to_req;
    const int* block_table;
    const void* slot_mapping;   // int or long long (entry point suffix s32/s64)
    int* global_decode;
    int* decode_lens;
    int* prefill;
    long long num_tokens;
    long long ratio;
    long long num_decode_tokens;
    long long bt_rows;
    long long bt_cols;
    long long bt_stride;
    long long gd_stride;
    long long pf_stride;
    int block_size;
    int width;
    int cols_per_block;
    int chunks;
};

struct BuildStepParams {
    const int* qsl;
    const int* seq_lens;
    const int* block_table;
    const void* positions;      // int or long long (p32/p64)
    const void* slot_mapping;   // int or long long (s32/s64)
    int* req_out;
    long long* csm_out;         // null when compress_ratio is 1
    int* global_decode;         // the three C128A buffers: null unless ratio 128
    int* decode_lens;
    int* prefill;
    long long bt_rows;
    long long bt_cols;
    long long bt_stride;
    long long num_tokens;
    long long num_decode_tokens;
    long long ratio;
    long long block_size;       // storage block size
    long long cp_world_size;
    long long cp_rank;
    long long cp_interleave;
    long long csm_len;
    long long row_stride;       // of the C128A buffers (their capacity)
    long long row_blocks;
    int num_reqs;
    int width;
    int cols_per_block;
    int chunks;
};
