// Launch parameters: each kernel family's struct (in its own .cuh) is passed by
// value as the kernel's only argument (one argument costs the host far less
// than twenty), built from the field groups here, which several families share.
// The family's Python module declares the same layout (dsv4_cupy/params.py the
// groups'); the loader compiles static_asserts of their sizes into every
// kernel and tests/test_params.py compares them field by field, so the two
// cannot drift apart. Fields are 8 bytes, but for the int arrays of a prefill
// plan, which come last in their struct.
#pragma once

typedef long long i64;

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
    i64 cp_rank;                 // this rank; -1: the tokens' own slots say which rank holds a row
    i64 cp_interleave;           // consecutive compressed rows per rank
};
