// The numbers of the fp8 KV caches: bf16 and FP8 E4M3 (e4m3fn) bits and the
// UE8M0 scale exponent; dsv4_cupy/fp8.py is the CPU path's twin, bit for bit.
// CuPy compiles with -ftz=true, so nothing here lets a float32 subnormal
// decide a result: the exponent comes from integer bits, and the dequantised
// product runs in float64, where it is exact, or in float32 where every
// product is a normal float32.
#pragma once
#include <cuda_fp8.h>
#include <cuda_bf16.h>
#include "common.cuh"

namespace dsv4 {

constexpr float kE4m3Max = DSV4_FP8_E4M3_MAX;
constexpr float kAmaxFloor = 1e-4f;          // vLLM's floor: an all-zero tile has a finite scale
constexpr int kScaleBias = 127;              // a scale byte is 2^(byte - 127)
constexpr unsigned char kScaleNonfinite = 255;   // the tile of a NaN or an infinity
constexpr unsigned char kE4m3Nan = 0x7F;
constexpr unsigned short kBf16Nan = 0x7FC0;
constexpr unsigned kF32Infinity = 0x7F800000u;

__device__ __forceinline__ float bf16_value(unsigned short bits) {
    return __uint_as_float((unsigned)bits << 16);
}

// |bf16| as ordered integer bits: the larger magnitude has the larger bits,
// and a NaN is above the infinity (0x7F80).
__device__ __forceinline__ unsigned bf16_magnitude(unsigned short bits) { return bits & 0x7FFFu; }

// ceil(log2(max(amax, 1e-4) / 448)) for a finite amax >= 0 (the quotient is a
// normal float32: at least 1e-4 / 448).
__device__ __forceinline__ int ue8m0_exponent(float amax) {
    const float quotient = fmaxf(amax, kAmaxFloor) / kE4m3Max;
    const unsigned bits = __float_as_uint(quotient);
    const int exponent = (int)(bits >> 23) - 127;
    return (bits & 0x7FFFFFu) ? exponent + 1 : exponent;
}

// 2^e as a float32, for the exponents a finite tile has (-22..120: normal).
__device__ __forceinline__ float power_of_two(int e) {
    return __uint_as_float((unsigned)(e + 127) << 23);
}

// A value of [-448, 448] (or NaN) as e4m3fn, rounded to nearest even; NaN is 0x7F.
__device__ __forceinline__ unsigned char e4m3_bits(float v) {
    if (v != v) return kE4m3Nan;
    return (unsigned char)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// The value of an e4m3fn byte (NaN for 0x7F and 0xFF), exactly.
__device__ __forceinline__ double e4m3_value(unsigned char bits) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)bits, __NV_E4M3);
    return (double)__half2float(__half(h));
}

// The factor of a scale byte, as vLLM's kernels read it: 2^(byte - 127), but
// 0 for byte 0 (their float32 2^-127 is flushed to zero) and an infinity for
// 255 (float32's 2^128).
__device__ __forceinline__ double scale_factor(unsigned char scale) {
    if (scale == 0) return 0.0;
    return __longlong_as_double(scale == kScaleNonfinite ? 0x7FF0000000000000LL      // +inf
                                                         : (long long)(scale - kScaleBias + 1023) << 52);
}

// bf16 bits of byte's fp8 value times its scale factor: the product is exact
// in float64, so the one rounding is the bf16 one; NaN gives 0x7FC0.
__device__ __forceinline__ unsigned short dequantized_bf16(unsigned char value, unsigned char scale) {
    const double scaled = e4m3_value(value) * scale_factor(scale);
    if (scaled != scaled) return kBf16Nan;
    return __bfloat16_as_ushort(__double2bfloat16(scaled));
}

// Scale bytes whose factor times every finite e4m3 value is a normal float32
// and exactly a bf16 (e4m3 magnitudes are 0 or in [2^-9, 448], with at most 4
// significant bits): 2^(byte - 127 - 9) >= 2^-126, 448 * 2^(byte - 127) < 2^128.
constexpr int kExactScaleFirst = 10, kExactScaleLast = 246;

__device__ __forceinline__ bool exact_in_float32(unsigned char scale) {
    return scale >= kExactScaleFirst && scale <= kExactScaleLast;
}

// Whether one of the four e4m3 bytes of `word` is a NaN (kE4m3Nan, either sign).
__device__ __forceinline__ bool has_e4m3_nan(unsigned word) {
    constexpr unsigned kNanBytes = kE4m3Nan * 0x01010101u;        // kE4m3Nan in every byte
    const unsigned flipped = (word & kNanBytes) ^ kNanBytes;        // a zero byte per NaN
    return ((flipped - 0x01010101u) & ~flipped & 0x80808080u) != 0;
}

// dequantized_bf16 of two e4m3 bytes (the low one first) as bf16x2 bits, for
// a scale byte exact_in_float32 and no NaN: the float32 product is exact, so
// it gives the bf16 the float64 one does, with no float64 arithmetic.
__device__ __forceinline__ unsigned dequantized_bf16x2(unsigned short pair, unsigned char scale) {
    const float factor = power_of_two(scale - kScaleBias);
    const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
    const __nv_bfloat162_raw bf16 = __floats2bfloat162_rn(v.x * factor, v.y * factor);
    return bf16.x | ((unsigned)bf16.y << 16);
}

// Where a cache slot lives: its page and its row in the page. False for a
// slot outside the cache (-1 marks a padding token): nothing is written then.
struct CacheSlot {
    unsigned char* page;
    i64 row;
};
__device__ __forceinline__ bool cache_slot(unsigned char* cache, i64 page_stride, i64 num_pages,
                                           i64 block_size, i64 slot, CacheSlot& at) {
    if (slot < 0 || slot >= num_pages * block_size) return false;
    const i64 page = quotient(slot, block_size);
    at.page = cache + page * page_stride;
    at.row = slot - page * block_size;
    return true;
}

// body(t, at, lane) for each token t of a cache insert p (its slot_mapping,
// cache, page_stride, num_pages, block_size, num_tokens) whose slot lies in
// the cache, at: the slot's place; a warp per token, lane its thread.
template <typename SlotT, typename Params, typename Body>
__device__ __forceinline__ void for_each_slotted_token(const Params& p, const Blocks& blocks,
                                                       const Body& body) {
    const SlotT* __restrict__ slots = static_cast<const SlotT*>(p.slot_mapping);
    const WarpRows rows(blocks);
    for (i64 t = rows.first; t < p.num_tokens; t += rows.step) {
        CacheSlot at;
        if (cache_slot(p.cache, p.page_stride, p.num_pages, p.block_size, (i64)slots[t], at))
            body(t, at, rows.lane);
    }
}

}  // namespace dsv4
