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
//  * no architecture-specific instructions: the same source serves sm_90 and
//    sm_100.
#pragma once

typedef long long i64;

// The request owning flattened token t: the first i with qsl[i + 1] > t,
// clamped to [0, num_reqs - 1]. Never reads qsl[num_reqs + 1].
__device__ __forceinline__ int request_of(const int* __restrict__ qsl, int num_reqs, i64 t) {
    int lo = 0, hi = num_reqs;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if ((i64)qsl[mid + 1] <= t) lo = mid + 1; else hi = mid;
    }
    return max(min(lo, num_reqs - 1), 0);
}

// token_to_req_indices for token t: padding tokens (t >= qsl[num_reqs]) map to 0.
__device__ __forceinline__ int token_request(const int* __restrict__ qsl, int num_reqs, i64 t) {
    if (num_reqs <= 0 || t >= (i64)qsl[num_reqs]) return 0;
    return request_of(qsl, num_reqs, t);
}

__device__ __forceinline__ i64 clamp_i64(i64 v, i64 lo, i64 hi) {
    return v < lo ? lo : (v > hi ? hi : v);
}

// Compressed-cache slot of the token at flattened index i of request b, or -1.
// A slot exists when pos >= 0 closes a group ((pos + 1) % ratio == 0) and the
// compressed row is owned by this context-parallel rank. Block-table entries
// are read clamped at 0 (the builder's clamp); a block past the row is -1.
__device__ __forceinline__ i64 compressed_slot(
        const int* __restrict__ qsl, const int* __restrict__ seq_lens, int b, i64 i,
        const int* __restrict__ block_table, i64 bt_cols, i64 bt_stride, i64 block_size,
        i64 ratio, i64 cp_world_size, i64 cp_rank, i64 cp_interleave) {
    const i64 qs = qsl[b], qe = qsl[b + 1];
    if (i < qs || i >= qe) return -1;
    const i64 pos = (i64)seq_lens[b] - (qe - qs) + (i - qs);
    if (pos < 0 || (pos + 1) % ratio != 0) return -1;
    const i64 c = pos / ratio;
    const i64 virtual_block = block_size * cp_world_size;
    const i64 blk = c / virtual_block;
    const i64 v = c - blk * virtual_block;
    if ((v / cp_interleave) % cp_world_size != cp_rank || blk >= bt_cols) return -1;
    const i64 off = (v / (cp_world_size * cp_interleave)) * cp_interleave + v % cp_interleave;
    const i64 entry = block_table[(i64)b * bt_stride + blk];
    return (entry > 0 ? entry : 0) * block_size + off;
}

// Visible compressed rows of a query at `position`, clamped to [0, width].
// Division truncates toward zero, as the seed's Triton kernel does.
template <typename PosT>
__device__ __forceinline__ int visible_rows(PosT position, i64 ratio, int width) {
    return (int)clamp_i64(((i64)position + 1) / ratio, 0, width);
}

// Writes columns [c0, c1) of one C128A row: value(e) for e < n, else -1.
// 16-byte stores when row + c0 is 16-byte aligned (then every vector is).
//  decode  (block_row != nullptr): value(e) = block_row[e / bs] * bs + e % bs,
//          computed in 32 bits like the seed; column clamped to the table row.
//  prefill (block_row == nullptr): value(e) = e.
struct BlockDivisor {
    int size, shift;  // shift >= 0 when size is a power of two (2 for C128A)
    __device__ __forceinline__ explicit BlockDivisor(int s)
        : size(s), shift(__popc(s) == 1 ? __ffs(s) - 1 : -1) {}
    __device__ __forceinline__ int div(int e) const { return shift >= 0 ? e >> shift : e / size; }
    __device__ __forceinline__ int mod(int e) const {
        return shift >= 0 ? e & (size - 1) : e % size;
    }
};

__device__ __forceinline__ int c128a_value(int e, int n, const int* __restrict__ block_row,
                                           const BlockDivisor& bs, i64 bt_cols) {
    if (e >= n) return -1;
    if (block_row == nullptr) return e;
    const i64 col = min((i64)bs.div(e), bt_cols - 1);
    return (int)((unsigned)block_row[col] * (unsigned)bs.size + (unsigned)bs.mod(e));
}

__device__ __forceinline__ void c128a_fill_columns(int* __restrict__ row, int c0, int c1, int n,
                                                   const int* __restrict__ block_row,
                                                   int block_size, i64 bt_cols) {
    const BlockDivisor bs(block_size);
    int e = c0;
    if ((reinterpret_cast<unsigned long long>(row + c0) & 15ull) == 0) {
        const int vec_end = c0 + ((c1 - c0) & ~3);
        // Unrolled so the block-table loads of several vectors are in flight
        // before the first store waits on them.
#pragma unroll 4
        for (int v = c0 + 4 * (int)threadIdx.x; v < vec_end; v += 4 * (int)blockDim.x) {
            int4 q;
            q.x = c128a_value(v, n, block_row, bs, bt_cols);
            q.y = c128a_value(v + 1, n, block_row, bs, bt_cols);
            q.z = c128a_value(v + 2, n, block_row, bs, bt_cols);
            q.w = c128a_value(v + 3, n, block_row, bs, bt_cols);
            // Streaming (evict-first) stores: measured 3-10% faster on the
            // H200 for rows of 8192 columns, which are far larger than L2.
            __stcs(reinterpret_cast<int4*>(row + v), q);
        }
        e = vec_end;
    }
    for (int s = e + (int)threadIdx.x; s < c1; s += (int)blockDim.x)
        row[s] = c128a_value(s, n, block_row, bs, bt_cols);
}

// One block's share of the C128A metadata: token t, columns [c0, c1).
// Decode tokens (t < num_decode_tokens) also write their length once.
template <typename PosT, typename SlotT>
__device__ __forceinline__ void c128a_block(
        i64 t, int c0, int c1, int req, PosT position, i64 ratio, i64 num_decode_tokens,
        const int* __restrict__ block_table, i64 bt_rows, i64 bt_cols, i64 bt_stride,
        int block_size, const SlotT* __restrict__ slot_mapping, int width,
        int* __restrict__ global_decode, i64 gd_stride, int* __restrict__ decode_lens,
        int* __restrict__ prefill, i64 pf_stride) {
    const int n = visible_rows(position, ratio, width);
    if (t < num_decode_tokens) {
        const i64 r = clamp_i64(req, 0, bt_rows - 1);
        c128a_fill_columns(global_decode + t * gd_stride, c0, c1, n, block_table + r * bt_stride,
                           block_size, bt_cols);
        if (c0 == 0 && threadIdx.x == 0) decode_lens[t] = slot_mapping[t] >= 0 ? n : 0;
    } else {
        c128a_fill_columns(prefill + (t - num_decode_tokens) * pf_stride, c0, c1, n, nullptr,
                           block_size, bt_cols);
    }
}

// The four extern "C" entry points of a kernel family templated on the
// positions and slot-mapping types: PREFIX_p32_s32 ... PREFIX_p64_s64.
#define DSV4_DTYPE_ENTRIES(PREFIX, PARAMS, BODY)                                                \
    DSV4_ENTRY(PREFIX##_p32_s32, PARAMS, (BODY<int, int>(p)))                                   \
    DSV4_ENTRY(PREFIX##_p32_s64, PARAMS, (BODY<int, long long>(p)))                             \
    DSV4_ENTRY(PREFIX##_p64_s32, PARAMS, (BODY<long long, int>(p)))                             \
    DSV4_ENTRY(PREFIX##_p64_s64, PARAMS, (BODY<long long, long long>(p)))
#define DSV4_ENTRY(NAME, PARAMS, CALL)                                                          \
    extern "C" __global__ void __launch_bounds__(256) NAME(const PARAMS p) { CALL; }
