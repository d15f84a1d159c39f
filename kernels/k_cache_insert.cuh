// quantize_and_insert_k_cache: each token's latent KV (bf16 [512]) into its
// slot of the paged fp8_ds_mla cache. A page of B states is block-planar: the
// state's record at r * 576 (448 NoPE dims as FP8 E4M3, then 64 RoPE dims as
// raw bf16), its scales at B * 576 + r * 8 (a UE8M0 byte per 64-dim NoPE tile,
// then a zero pad byte). Per tile: amax over the non-NaN |x|, floored at 1e-4;
// e = ceil(log2(amax / 448)); values e4m3(clamp(x / 2^e, +-448)); byte e + 127.
// As vLLM's Triton kernel has it, a NaN value is stored as +448, and a tile
// holding an infinity gets scale byte 255, +448 for the infinities and +-0 for
// the rest. One warp per token; a slot outside the cache (-1 for padding) is
// skipped.
#pragma once
#include "fp8.cuh"

struct KCacheInsertParams {      // quantize_and_insert_k_cache
    const unsigned short* k;     // [num_tokens, k_stride] bf16 bits, 512 dims read
    unsigned char* cache;        // [num_pages, page_stride] bytes, block-planar pages
    const void* slot_mapping;    // [num_tokens] int32 or int64 (entry suffix s32/s64)
    i64 k_stride;                // elements between rows of k (even)
    i64 page_stride;             // bytes between pages (a multiple of 16)
    i64 num_pages;
    i64 block_size;              // states per page (B)
    i64 num_tokens;
};

namespace dsv4 {
constexpr int kNopeTiles = DSV4_NOPE_DIM / DSV4_QUANT_TILE;

// Value v of a tile with exponent e (or, nonfinite, a tile holding an infinity) as e4m3.
__device__ __forceinline__ unsigned char quantized(unsigned short bits, int e, bool nonfinite) {
    const float x = bf16_value(bits);
    if (bf16_magnitude(bits) > 0x7F80u) return 0x7E;                  // NaN: +448
    if (nonfinite) return bf16_magnitude(bits) == 0x7F80u ? 0x7E : (unsigned char)((bits >> 8) & 0x80);
    const float y = x * power_of_two(-e);                             // exact, or a tiny +-0
    return e4m3_bits(fminf(fmaxf(y, -kE4m3Max), kE4m3Max));
}

template <typename SlotT>
__device__ __forceinline__ void quantize_and_insert_k_cache(const KCacheInsertParams& p,
                                                            const Blocks& blocks = whole_grid()) {
    static_assert(DSV4_QUANT_TILE == 2 * DSV4_WARP_LANES && DSV4_ROPE_DIM == 2 * DSV4_WARP_LANES,
                  "two dims of a tile, and of the RoPE part, per lane");
    for_each_slotted_token<SlotT>(p, blocks, [&](i64 t, const CacheSlot& at, int lane) {
        unsigned char* __restrict__ record = at.page + at.row * DSV4_FP8_RECORD;
        const unsigned* __restrict__ row = reinterpret_cast<const unsigned*>(p.k + t * p.k_stride);
        // Every load of the row first: the stores below cannot hold them up.
        unsigned pairs[kNopeTiles];
#pragma unroll
        for (int j = 0; j < kNopeTiles; ++j) pairs[j] = row[(j * DSV4_QUANT_TILE) / 2 + lane];
        const unsigned rope = row[DSV4_NOPE_DIM / 2 + lane];
        unsigned long long scales = 0;                                // 7 bytes, then the pad byte 0
#pragma unroll
        for (int j = 0; j < kNopeTiles; ++j) {
            const unsigned pair = pairs[j];
            const unsigned short lo = (unsigned short)pair, hi = (unsigned short)(pair >> 16);
            const unsigned m_lo = bf16_magnitude(lo), m_hi = bf16_magnitude(hi);
            const unsigned lane_max = max(m_lo > 0x7F80u ? 0u : m_lo, m_hi > 0x7F80u ? 0u : m_hi);
            const unsigned amax = __reduce_max_sync(0xFFFFFFFFu, lane_max);
            const bool nonfinite = amax == 0x7F80u;
            const int e = nonfinite ? 0 : ue8m0_exponent(bf16_value((unsigned short)amax));
            const unsigned byte = nonfinite ? kScaleNonfinite : (unsigned)min(max(e + kScaleBias, 0), 255);
            scales |= (unsigned long long)byte << (8 * j);
            const unsigned short out = (unsigned short)(quantized(lo, e, nonfinite)
                                                         | (quantized(hi, e, nonfinite) << 8));
            reinterpret_cast<unsigned short*>(record + j * DSV4_QUANT_TILE)[lane] = out;
        }
        // The RoPE dims, copied as they are.
        reinterpret_cast<unsigned*>(record + DSV4_NOPE_DIM)[lane] = rope;
        if (lane == 0)
            *reinterpret_cast<unsigned long long*>(at.page + p.block_size * DSV4_FP8_RECORD
                                                   + at.row * DSV4_SCALE_RECORD) = scales;
    });
}

}  // namespace dsv4
