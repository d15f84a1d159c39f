// Shared device helpers for dsv4_cupy kernels.
//
// Rules every kernel here follows:
//  * indices and addresses are 64-bit (i64); a block table or an output with
//    more than 2^31 elements must not wrap;
//  * every data-dependent index that feeds an address (request ids, block
//    columns, qsl-derived output slots) is clamped or masked, for lanes whose
//    result is discarded too (vLLM bugs: masked-lane OOB, garbage positions of
//    padding tokens, out-of-range block-table columns); sizes such as the
//    decode/prefill boundary are checked on the host before the launch;
//  * no instruction that only one of sm_90 and sm_100 has: the same source
//    serves both (warp_sum's redux, sm_80 and later, falls back to shuffles
//    on older devices).
// DSV4_THREADS, DSV4_WARP_LANES, DSV4_PAD_SLOT_ID, DSV4_RUN_TIME and
// DSV4_POSITION_LIMIT come from the loader (one definition each, in Python).
#pragma once
#include "params.cuh"

// The first thing every entry point does. Under programmatic dependent launch
// (sm_90 and later; the loader sets the launch attribute) a grid can start
// while the grid before it on the stream still runs: it waits here until that
// grid is done and its writes are visible, then lets the next grid start, so
// the next launch overlaps this grid's work and the results do not change.
// Launched without the attribute, both instructions return at once. The next
// grid may start only once this one waits: letting it start first is faster
// at decode sizes but slower for large grids (docs/performance.md).
__device__ __forceinline__ void await_earlier_grids() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ i64 clamp_i64(i64 v, i64 lo, i64 hi) {
    return v < lo ? lo : (v > hi ? hi : v);
}

// Rows among 0..n-1 that context-parallel rank `rank` of `world` holds: rows
// go to the ranks `interleave` at a time, round robin (vLLM's
// get_dcp_local_seq_lens). Out of line under several ranks: a decode row's
// code then has no stretch to branch over. On a cold instruction cache every
// branch over code costs a fetch as long as a load (docs/performance.md).
__device__ __noinline__ i64 dcp_rank_rows(i64 n, i64 world, i64 rank, i64 interleave) {
    const i64 per_rank = n / interleave / world * interleave;
    return per_rank + clamp_i64(n - per_rank * world - rank * interleave, 0, interleave);
}
__device__ __forceinline__ i64 dcp_local_rows(i64 n, i64 world, i64 rank, i64 interleave) {
    return world == 1 ? n : dcp_rank_rows(n, world, rank, interleave);
}

// n / d for n >= 0, d > 0: a shift when d is a power of two (the ratios, block
// sizes and most row widths), 32-bit division when both fit. A 64-bit division
// by a run-time divisor is a long dependent instruction sequence, which on a
// latency-bound kernel costs as much as a memory round trip.
__device__ __forceinline__ i64 quotient(i64 n, i64 d) {
    if ((d & (d - 1)) == 0) return n >> (__ffsll(d) - 1);
    if (((unsigned long long)n | (unsigned long long)d) >> 32 == 0)
        return (unsigned)n / (unsigned)d;
    return n / d;
}

// One round of request_of's loads: the guessed request g (0 <= g < num_reqs),
// taken when qsl[g] <= t < qsl[g + 1], or qsl[g] <= t for the last request
// (for a non-decreasing qsl the answer: no earlier request holds t), and
// beside it the search's next probe, which narrows [lo, hi] when the guess
// fails. A padding token (t >= qsl[num_reqs]) is then answered in the first
// round.
__device__ __forceinline__ bool guessed_round(const int* __restrict__ qsl, i64 num_reqs, i64 t,
                                              i64 guess, i64& lo, i64& hi) {
    const i64 mid = (lo + hi) >> 1;
    const i64 start = qsl[guess], end = qsl[guess + 1], probe = qsl[mid + 1];
    if (start <= t && (t < end || guess == num_reqs - 1)) { lo = guess; return true; }
    if (probe <= t) lo = mid + 1; else hi = mid;
    return false;
}

// The request owning flattened token t: the first i with qsl[i + 1] > t,
// clamped to [0, num_reqs - 1]. Request num_reqs - 1 is the answer when no
// other is, so it is never tested: one request reads nothing, and qsl is read
// up to qsl[num_reqs]. A decode step finds its tokens in one or two rounds of
// loads instead of the search's log2(num_reqs): first request t (one token per
// request), then, when q = qsl[1] > 1 (the first request's tokens; uniform
// speculative decodes), request t / q; each guess is checked, and the
// search's probe rides beside it, so a wrong one costs no round.
// cpu.request_of is the same function.
__device__ __forceinline__ int request_of(const int* __restrict__ qsl, i64 num_reqs, i64 t) {
    i64 lo = 0, hi = num_reqs - 1;
    if (lo < hi) {
        const i64 first_len = qsl[1];
        if (guessed_round(qsl, num_reqs, t, t < hi ? t : hi, lo, hi)) return (int)lo;
        if (first_len > 1 && lo < hi) {
            const i64 guess = t >> 32 ? num_reqs - 1 : (unsigned)t / (unsigned)first_len;
            if (guessed_round(qsl, num_reqs, t, guess < num_reqs - 1 ? guess : num_reqs - 1,
                              lo, hi))
                return (int)lo;
        }
    }
    while (lo < hi) {
        const i64 mid = (lo + hi) >> 1;
        if ((i64)qsl[mid + 1] <= t) lo = mid + 1; else hi = mid;
    }
    return (int)clamp_i64(lo, 0, num_reqs - 1);
}

// token_to_req_indices for token t: padding tokens (t >= qsl[num_reqs]) map to 0.
// qsl[num_reqs] is read beside request_of's first round, not ahead of it: a
// decode token's request costs one round of loads.
__device__ __forceinline__ int token_request(const QueryLayout& q, i64 t) {
    if (q.num_reqs <= 0) return 0;
    const i64 mapped = q.query_start_loc[q.num_reqs];
    const int b = request_of(q.query_start_loc, q.num_reqs, t);
    return t < mapped ? b : 0;
}

// The position of the token at flattened index t in a request whose context
// is seq_len long and whose query ends at query_end (query_start_loc[b + 1]):
// the context less the query's tokens from t on.
__device__ __forceinline__ i64 token_position(i64 seq_len, i64 query_end, i64 t) {
    return seq_len - query_end + t;
}

// Slot `within` of column blk of block-table row b, or DSV4_PAD_SLOT_ID when
// blk is past the row. Entries are read clamped at 0 (vLLM's builder's clamp).
__device__ __forceinline__ i64 table_slot(const BlockTable& table, int b, i64 blk, i64 block_size,
                                          i64 within) {
    if (blk >= table.cols) return DSV4_PAD_SLOT_ID;
    const i64 entry = table.entries[(i64)b * table.row_stride + blk];
    return (entry > 0 ? entry : 0) * block_size + within;
}

// Compressed-cache slot of compressed row c (>= 0) of block-table row b under
// any geometry; -1 when another context-parallel rank owns it (cp_rank >= 0)
// or its block is past the row (table_slot). Out of line: a decode token's
// code, under one rank and power-of-two sizes (every DeepSeek-V4 geometry),
// has only shifts and masks and no stretch of 64-bit divisions to branch over
// (dcp_rank_rows).
__device__ __noinline__ i64 compressed_row_slot(const BlockTable& table, const SlotGeometry& g,
                                                int b, i64 c) {
    const i64 virtual_block = g.block_size * g.cp_world_size;
    const i64 blk = c / virtual_block;
    const i64 v = c - blk * virtual_block;
    const bool other_rank = g.cp_rank >= 0 && (v / g.cp_interleave) % g.cp_world_size != g.cp_rank;
    if (other_rank) return DSV4_PAD_SLOT_ID;
    const i64 within = (v / (g.cp_world_size * g.cp_interleave)) * g.cp_interleave +
                       v % g.cp_interleave;
    return table_slot(table, b, blk, g.block_size, within);
}

// Compressed-cache slot of the token at flattened index i of block-table row b,
// or DSV4_PAD_SLOT_ID. A slot exists when pos >= 0 closes a group
// ((pos + 1) % ratio == 0) and the compressed row pos / ratio is owned by
// this context-parallel rank (cp_rank < 0: by any rank; the token's own slot
// then says whether this one holds it): compressed_row_slot. Under one rank
// the row's slot is the k-th of its block, which with power-of-two sizes is
// shifts and masks, the same values.
__device__ __forceinline__ i64 compressed_slot(const QueryLayout& q, const BlockTable& table,
                                               const SlotGeometry& g, int b, i64 i) {
    const i64 qs = q.query_start_loc[b], qe = q.query_start_loc[b + 1];
    if (i < qs || i >= qe) return DSV4_PAD_SLOT_ID;
    const i64 pos = token_position(q.seq_lens[b], qe, i);
    if (pos < 0) return DSV4_PAD_SLOT_ID;
    if (g.cp_world_size == 1 && __popcll(g.ratio) == 1 && __popcll(g.block_size) == 1) {
        if (((pos + 1) & (g.ratio - 1)) != 0) return DSV4_PAD_SLOT_ID;
        const i64 c = pos >> (__ffsll(g.ratio) - 1);
        return table_slot(table, b, c >> (__ffsll(g.block_size) - 1), g.block_size,
                          c & (g.block_size - 1));
    }
    if ((pos + 1) % g.ratio != 0) return DSV4_PAD_SLOT_ID;
    return compressed_row_slot(table, g, b, pos / g.ratio);
}

// Element i of a compressed slot mapping: the slot of the token at flattened
// index i of the block-table row whose query holds it, or DSV4_PAD_SLOT_ID.
__device__ __forceinline__ i64 compressed_slot_at(const QueryLayout& q, const BlockTable& table,
                                                  const SlotGeometry& g, i64 i) {
    if (table.rows <= 0) return DSV4_PAD_SLOT_ID;
    return compressed_slot(q, table, g, request_of(q.query_start_loc, table.rows, i), i);
}

// Visible compressed rows of a query at `position`, clamped to [0, width].
// Division truncates toward zero, as vLLM's Triton kernel does (a
// numerator <= 0 gives 0 either way). position + 1 wraps as the CPU path's
// int64 does (a garbage INT64_MAX position): unsigned, so the compiler may not
// assume it does not.
template <typename PosT>
__device__ __forceinline__ int visible_rows(PosT position, i64 ratio, i64 width) {
    const i64 numerator = (i64)((unsigned long long)(i64)position + 1ull);
    return numerator <= 0 ? 0 : (int)clamp_i64(quotient(numerator, ratio), 0, width);
}

// Division by the storage block size: a shift for powers of two (every
// DeepSeek-V4 block size), a division otherwise. A kernel picks one of the two
// once, with with_block_divisor: chosen per element, the division's code sits
// between the loads of a row, and instruction fetches stall a one-row kernel.
struct ShiftDivisor {
    int size, shift;
    __device__ __forceinline__ int div(int e) const { return e >> shift; }
    __device__ __forceinline__ i64 div(i64 e) const { return e >> shift; }
    __device__ __forceinline__ int mod(int e) const { return e & (size - 1); }
};
struct PlainDivisor {
    int size;
    __device__ __forceinline__ int div(int e) const { return e / size; }
    __device__ __forceinline__ i64 div(i64 e) const { return e / size; }
    __device__ __forceinline__ int mod(int e) const { return e % size; }
};
// f(divisor) with the divisor that fits `size` (> 0): kSize compiled in (a
// power of two, an entry point's int axis), or DSV4_RUN_TIME for `size`.
__host__ __device__ constexpr int log2_of(int power_of_two) {
    return power_of_two <= 1 ? 0 : 1 + log2_of(power_of_two >> 1);
}
// f(ShiftDivisor) for a power-of-two `size`, else otherwise(): a caller whose
// other sizes are rare calls out of line there (c128a.cuh), so its code has
// no stretch to branch over.
template <typename F, typename Otherwise>
__device__ __forceinline__ void with_shift_divisor(int size, const F& f, const Otherwise& otherwise) {
    if (__popc(size) == 1) f(ShiftDivisor{size, __ffs(size) - 1});
    else otherwise();
}
template <int kSize = DSV4_RUN_TIME, typename F>
__device__ __forceinline__ void with_block_divisor(int size, const F& f) {
    if constexpr (kSize != DSV4_RUN_TIME) {
        static_assert((kSize & (kSize - 1)) == 0, "a compiled-in block size is a power of two");
        f(ShiftDivisor{kSize, log2_of(kSize)});
    } else {
        with_shift_divisor(size, f, [&] { f(PlainDivisor{size}); });
    }
}

// A value compiled into the kernel (an entry point's int axis, loader.py: a
// width, a window, a ratio), or the struct's run-time one when kValue is
// DSV4_RUN_TIME: with the shape compiled in, a row's chain of code is one
// straight line.
template <int kValue>
__device__ __forceinline__ int compiled_or(i64 run_time) {
    return kValue != DSV4_RUN_TIME ? kValue : (int)run_time;
}

// Writes value_of(e) to row[e] for e in [c0, c1), shared by `lanes` threads of
// which this is `lane`: 16-byte stores when row + c0 is 16-byte aligned (then
// every vector is), else one column at a time. A lane's first vector is
// straight-line code: a row of one vector per lane (SWA's W = 128, a warp's
// piece of a short row) runs no loop, and its four loads are in flight
// together. Later vectors are unrolled, so the loads of several are in flight
// before the first store waits on them. Stores are streaming (evict-first):
// the rows of a large step are far larger than L2.
//
// ColumnLoop::kCompact writes every vector from one plain loop instead: less
// code per vector, for the combined rows, whose entries branch (and may load),
// and for a decode step's rows, whose few vectors per lane wait on the fetch
// of the code they run (docs/performance.md).
//
// ColumnLoop::kScalar writes a column per lane at a time, no vectors: rows of
// one column per thread (vLLM's shape for SWA rows).
enum class ColumnLoop { kUnrolled, kCompact, kScalar };

template <ColumnLoop kLoop = ColumnLoop::kUnrolled, typename ValueOf>
__device__ __forceinline__ void fill_columns(int* __restrict__ row, int c0, int c1, int lane,
                                             int lanes, const ValueOf& value_of) {
    const auto store = [&](int v) {
        int4 q;
        q.x = value_of(v);
        q.y = value_of(v + 1);
        q.z = value_of(v + 2);
        q.w = value_of(v + 3);
        __stcs(reinterpret_cast<int4*>(row + v), q);
    };
    int e = c0;
    if (kLoop != ColumnLoop::kScalar && (reinterpret_cast<unsigned long long>(row + c0) & 15ull) == 0) {
        const int vec_end = c0 + ((c1 - c0) & ~3);
        const int first = c0 + 4 * lane;
        if constexpr (kLoop == ColumnLoop::kCompact) {
            for (int v = first; v < vec_end; v += 4 * lanes) store(v);
        } else {
            if (first < vec_end) store(first);
#pragma unroll 4
            for (int v = first + 4 * lanes; v < vec_end; v += 4 * lanes) store(v);
        }
        e = vec_end;
    }
    for (int s = e + lane; s < c1; s += lanes) row[s] = value_of(s);
}

// --- helpers of the per-layer and indexer metadata kernels -------------------------------------

// Raw tokens a prefill request gathers from the SWA cache: its queries and
// the window before the first one, from its replay start on:
// q + min(max(L - q - replay_start, 0), W - 1).
__device__ __forceinline__ i64 prefill_gather_len(i64 query_len, i64 seq_len, i64 window_size,
                                                  i64 replay_start = 0) {
    return query_len + clamp_i64(seq_len - query_len - replay_start, 0, window_size - 1);
}

// Global slot of row `within` of cache block `entry`, computed in 32 bits like
// vLLM (a product past 2^31 wraps the same way on every path).
__device__ __forceinline__ int block_slot(int entry, int block_size, int within) {
    return (int)((unsigned)entry * (unsigned)block_size + (unsigned)within);
}

// The blocks a device function works with: the whole grid, or a range of it
// when several functions share one launch (the fused kernels) and each gets
// its own blocks.
struct Blocks {
    i64 index, count;            // this block's place among the function's, and their number
};
__device__ __forceinline__ Blocks whole_grid() { return Blocks{blockIdx.x, gridDim.x}; }

// kLanes threads per row (a warp, or a multiple of one) in blocks of kThreads:
// this group's first row, its lane, and the row step of a grid-stride loop
// over rows (the cache kernels'; fill_rows has none).
template <int kLanes, int kThreads = DSV4_THREADS>
struct RowLanes {
    static_assert(kLanes % DSV4_WARP_LANES == 0 && kThreads % kLanes == 0, "whole warps, whole blocks");
    i64 first, step;
    int lane;
    __device__ __forceinline__ explicit RowLanes(const Blocks& blocks)
        : first((blocks.index * kThreads + threadIdx.x) / kLanes),
          step((blocks.count * kThreads) / kLanes), lane((int)(threadIdx.x % kLanes)) {}
};
using WarpRows = RowLanes<DSV4_WARP_LANES>;

// The piece of a grid of rows, each cut into `per_row` pieces of `cols`
// columns, that unit `index` (a block, or a warp) writes: row t, columns
// [c0, c1) of a row `width` wide. Units number below 2^31 (a launch's blocks;
// the indexer's pieces, checked on the host), so the division is a 32-bit one.
struct RowPiece {
    i64 t;
    int c0, c1;
    __device__ __forceinline__ RowPiece(i64 index, i64 per_row, i64 cols, i64 width) {
        const unsigned unit = (unsigned)index, pieces = (unsigned)per_row, row = unit / pieces;
        t = row;
        c0 = (int)((unit - row * pieces) * (unsigned)cols);
        c1 = (int)min(width, c0 + cols);
    }
};

// Row r of a row kernel is row_at(r): `.value(e)` gives column e and
// `.length()` the row's length. kLanes threads take a row (a warp unless the
// kernel says otherwise), every lane builds the row's state once (the same
// loads, in parallel), lane 0 writes the length and every lane its share of
// the row's 16-byte vectors (fill_columns):
//  * the state is built once per row, not once per vector (a flat mapping of
//    vectors to threads is instruction-bound on wide rows);
//  * the grid has a group for every row (geometry.row_lane_blocks), so there
//    is no grid-stride loop, whose set-up the compiler hoists ahead of the
//    first row's loads;
//  * the length is written before the columns, while the row's loads are in
//    flight.
template <ColumnLoop kLoop = ColumnLoop::kUnrolled, int kLanes = DSV4_WARP_LANES,
          int kThreads = DSV4_THREADS, typename RowAt>
__device__ __forceinline__ void fill_rows(int* __restrict__ out, i64 out_stride,
                                          int* __restrict__ lens, i64 num_rows, int width,
                                          const Blocks& blocks, const RowAt& row_at) {
    const RowLanes<kLanes, kThreads> rows(blocks);
    const i64 r = rows.first;
    if (r >= num_rows) return;
    const auto row = row_at(r);
    if (rows.lane == 0 && lens != nullptr) lens[r] = row.length();
    fill_columns<kLoop>(out + r * out_stride, 0, width, rows.lane, kLanes,
                        [&](int e) { return row.value(e); });
}

// The sum of v over the warp, in lane 0: five shuffles, or for an int one
// instruction (redux) on the devices that have it (sm_80 and later; an older
// device, which the kernels still serve, takes the shuffles).
template <typename T>
__device__ __forceinline__ T shuffle_sum(T v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    return v;
}
__device__ __forceinline__ i64 warp_sum(i64 v) { return shuffle_sum(v); }
__device__ __forceinline__ int warp_sum(int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_add_sync(0xffffffffu, v);
#else
    return shuffle_sum(v);
#endif
}

// The sum of v (int or i64) over the block (kThreads threads), returned to
// every thread, for a block that sums once: `scratch` (kThreads / 32 values)
// is not free after. Every thread of the block must call.
template <int kThreads = DSV4_THREADS, typename T>
__device__ __forceinline__ T block_sum_once(T v, T* scratch) {
    v = warp_sum(v);
    if (threadIdx.x % DSV4_WARP_LANES == 0) scratch[threadIdx.x / DSV4_WARP_LANES] = v;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < kThreads / DSV4_WARP_LANES; ++w) total += scratch[w];
    return total;
}

// block_sum_once for a block that sums again: `scratch` is free after.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
    const T total = block_sum_once(v, scratch);
    __syncthreads();
    return total;
}
