// build_c128a_topk_metadata: block b writes one piece (a token's columns
// [c0, c1)), so a long row is split over several blocks and a single decode
// token still spreads over the GPU. Templated on the positions and
// slot-mapping types; the loader instantiates the entry points.
#pragma once
#include "common.cuh"

struct C128ARows {               // C128A top-k rows, row stride fixed by the buffers
    int* global_decode;          // [num_decode_tokens, decode_stride] int32
    int* decode_lens;            // [num_decode_tokens] int32
    int* prefill;                // [num_tokens - num_decode_tokens, prefill_stride] int32
    i64 decode_stride;
    i64 prefill_stride;
    i64 width;                   // columns written per row (<= both strides)
    i64 num_valid_tokens;        // under DCP: tokens t < this are real (-1: use slot_mapping)
    i64 padding_slots;           // 1: a padding decode row holds its slot ids (length 0), as
                                 // vLLM 0.34 writes it; 0: all -1
};

struct RowChunks {               // long rows split over several blocks
    i64 cols_per_block;          // a multiple of 4, so 16-byte stores stay aligned
    i64 chunks;                  // blocks per row
    i64 row_blocks;              // blocks given to rows (rows * chunks)
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

// Column e < n of a decode row: compressed row e's slot in the row's blocks.
template <typename Divisor>
__device__ __forceinline__ int c128a_slot(int e, const int* __restrict__ block_row,
                                          const Divisor& bs) {
    return block_slot(block_row[bs.div(e)], bs.size, bs.mod(e));
}

// Column e of a C128A row with n addressable rows: -1 past n; a decode row
// (block_row != nullptr) holds its slot (c128a_slot), a prefill row e. n never
// exceeds the row's columns times bs, so the table read stays inside the row.
template <typename Divisor>
__device__ __forceinline__ int c128a_value(int e, int n, const int* __restrict__ block_row,
                                           const Divisor& bs) {
    if (e >= n) return DSV4_PAD_SLOT_ID;
    if (block_row == nullptr) return e;
    return c128a_slot(e, block_row, bs);
}

// Writes columns [c0, c1) of one C128A row, the block's threads sharing it.
template <typename Divisor>
__device__ __forceinline__ void c128a_columns(int* __restrict__ row, int c0, int c1, int n,
                                              const int* __restrict__ block_row,
                                              const Divisor& bs) {
    fill_columns(row, c0, c1, (int)threadIdx.x, (int)blockDim.x,
                 [&](int e) { return c128a_value(e, n, block_row, bs); });
}
// c128a_columns for any block size, out of line: the prefill rows and a block
// size that is not a power of two. A decode row's code, which bounds a decode
// step, then has no stretch to branch over (common.cuh's dcp_rank_rows).
__device__ __noinline__ void c128a_columns_out_of_line(int* __restrict__ row, int c0, int c1,
                                                       int n, const int* __restrict__ block_row,
                                                       int block_size) {
    with_block_divisor(block_size, [&](auto bs) { c128a_columns(row, c0, c1, n, block_row, bs); });
}
// A decode row's piece: its columns from one plain loop (a piece holds a few
// vectors per thread, and the unrolled loop's code is what a decode step waits
// on). Its block row is null only when n is 0, when no column reads it.
__device__ __forceinline__ void c128a_decode_columns(int* __restrict__ row, int c0, int c1, int n,
                                                     const int* __restrict__ block_row,
                                                     int block_size) {
    with_shift_divisor(
        block_size,
        [&](auto bs) {
            fill_columns<ColumnLoop::kCompact>(row, c0, c1, (int)threadIdx.x, (int)blockDim.x,
                                               [&](int e) {
                return e < n ? c128a_slot(e, block_row, bs) : DSV4_PAD_SLOT_ID;
            });
        },
        [&] { c128a_columns_out_of_line(row, c0, c1, n, block_row, block_size); });
}

// Rows among 0..n-1 that context-parallel rank g.cp_rank owns. Because the
// block size is a multiple of the interleave (checked on the host), the k-th
// owned row has local slot block_row[k / bs] * bs + k % bs: a rank's decode row
// is the single-rank formula over its own count.
__device__ __forceinline__ i64 owned_rows(i64 n, const SlotGeometry& g) {
    return dcp_local_rows(n, g.cp_world_size, g.cp_rank, g.cp_interleave);
}

// One block's piece of the C128A metadata. Decode tokens (t < num_decode_tokens)
// also write their length once. One rule for what cannot be addressed
// correctly: a decode token that is not valid (padding: slot < 0, or under
// DCP t >= num_valid_tokens) or whose request is outside the table gets an
// all -1 row and length 0, and rows past the table row's blocks are -1 and
// not counted; nothing is read for them. With rows.padding_slots a padding
// token in the table keeps vLLM 0.34's row (its slot ids) at length 0.
template <typename PosT, typename SlotT>
__device__ __forceinline__ void c128a_piece(const RowPiece& piece, int req, PosT position,
                                            const SlotT* __restrict__ slot_mapping,
                                            i64 num_decode_tokens, const BlockTable& table,
                                            const SlotGeometry& g, const C128ARows& rows) {
    const i64 t = piece.t;
    const int n = visible_rows(position, g.ratio, rows.width);
    if (t < num_decode_tokens) {
        const bool valid = rows.num_valid_tokens < 0 ? slot_mapping[t] >= 0
                                                     : t < rows.num_valid_tokens;
        const bool in_table = req >= 0 && (i64)req < table.rows;
        const int entries = in_table ? (int)min(owned_rows(n, g), table.cols * g.block_size) : 0;
        const int count = valid ? entries : 0;
        const int written = rows.padding_slots ? entries : count;
        const int* block_row = in_table ? table.entries + (i64)req * table.row_stride : nullptr;
        if (piece.c0 == 0 && threadIdx.x == 0) rows.decode_lens[t] = count;
        c128a_decode_columns(rows.global_decode + t * rows.decode_stride, piece.c0, piece.c1,
                             written, block_row, (int)g.block_size);
    } else {
        c128a_columns_out_of_line(rows.prefill + (t - num_decode_tokens) * rows.prefill_stride,
                                  piece.c0, piece.c1, n, nullptr, (int)g.block_size);
    }
}

namespace dsv4 {
// The rows of p, a decode token's request from request_of(t): read from the
// op's token_to_req, or found by the fused step kernel itself.
template <typename PosT, typename SlotT, typename RequestOf>
__device__ __forceinline__ void c128a_rows(const C128AParams& p, const Blocks& blocks,
                                           const RequestOf& request_of_token) {
    const RowPiece piece(blocks.index, p.chunks.chunks, p.chunks.cols_per_block, p.rows.width);
    if (piece.t >= p.num_tokens) return;
    const int req = piece.t < p.num_decode_tokens ? request_of_token(piece.t) : 0;
    c128a_piece(piece, req, static_cast<const PosT*>(p.positions)[piece.t],
                static_cast<const SlotT*>(p.slot_mapping), p.num_decode_tokens, p.table,
                p.geometry, p.rows);
}

template <typename PosT, typename SlotT>
__device__ __forceinline__ void c128a_topk_metadata(const C128AParams& p) {
    c128a_rows<PosT, SlotT>(p, whole_grid(), [&](i64 t) { return p.token_to_req[t]; });
}

}  // namespace dsv4
