"""The numbers of the fp8 KV caches on the CPU path: bf16 and FP8 E4M3 (OCP
e4m3fn) bits, the UE8M0 scale exponent, each exact and each the twin of
``kernels/fp8.cuh``.

Arrays of bf16 travel as their ``uint16`` bits; FP8 values and scale bytes as
``uint8``. Every conversion rounds to nearest even. Arithmetic runs in float64
where the result is exact there (a bf16 or e4m3 value times a power of two),
so no rounding but the one the rule names happens; the one float32 division
of the rule (``amax / 448``) is done in float32.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .spec import FP8_E4M3_MAX

E4M3_MAX = np.float32(FP8_E4M3_MAX)
#: UE8M0 scale bytes are 2^(byte - SCALE_BIAS); a tile holding an infinity
#: gets SCALE_NONFINITE, whose factor is infinite (float32's 2^128).
SCALE_BIAS, SCALE_NONFINITE = 127, 255
E4M3_NAN, BF16_NAN = 0x7F, 0x7FC0
#: The smallest |amax| of a tile (vLLM's floor: an all-zero tile has a finite scale).
AMAX_FLOOR = np.float32(1e-4)


def _e4m3_table() -> np.ndarray:
    """float64 value of every e4m3fn byte (NaN for 0x7F and 0xFF)."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0 ** -6,
                         (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    values = np.where(codes & 0x80, -magnitude, magnitude)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values


E4M3_VALUES = _e4m3_table()


@njit(cache=True, inline="always")
def bf16_value(bits):
    """The value of bf16 ``bits`` (uint16) as float64, exactly."""
    sign = -1.0 if bits & 0x8000 else 1.0
    exponent = (np.int64(bits) >> 7) & 0xFF
    mantissa = np.int64(bits) & 0x7F
    if exponent == 0xFF:
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == 0:
        return sign * math.ldexp(float(mantissa), -133)
    return sign * math.ldexp(float(mantissa + 128), exponent - 134)


@njit(cache=True, inline="always")
def bf16_bits(value):
    """float64 ``value`` rounded to bf16, as uint16 bits; NaN gives 0x7FC0."""
    if value != value:
        return np.uint16(BF16_NAN)
    sign = 0x8000 if math.copysign(1.0, value) < 0.0 else 0      # -0 too
    magnitude = abs(value)
    if magnitude == math.inf:
        return np.uint16(sign | 0x7F80)
    if magnitude < 2.0 ** -126:                  # subnormal: multiples of 2^-133
        return np.uint16(sign | np.int64(np.rint(magnitude * 2.0 ** 133)))
    fraction, exponent = math.frexp(magnitude)   # magnitude = fraction * 2^exponent
    significand = np.int64(np.rint(fraction * 256.0))     # 8 bits, in [128, 256]
    if significand == 256:
        significand, exponent = 128, exponent + 1
    field = exponent - 1 + 127
    if field >= 0xFF:
        return np.uint16(sign | 0x7F80)
    return np.uint16(sign | (field << 7) | (significand - 128))


@njit(cache=True, inline="always")
def e4m3_bits(value):
    """A value of ``[-448, 448]`` (or NaN) rounded to e4m3fn, as uint8 bits; NaN
    gives 0x7F and a magnitude that rounds past 448 saturates at it."""
    if value != value:
        return np.uint8(E4M3_NAN)
    sign = 0x80 if math.copysign(1.0, value) < 0.0 else 0      # -0 too
    magnitude = abs(value)
    if magnitude < 2.0 ** -6:                    # subnormal: multiples of 2^-9
        return np.uint8(sign | np.int64(np.rint(magnitude * 512.0)))
    fraction, exponent = math.frexp(magnitude)
    significand = np.int64(np.rint(fraction * 16.0))      # 4 bits, in [8, 16]
    if significand == 16:
        significand, exponent = 8, exponent + 1
    code = ((exponent - 1 + 7) << 3) | (significand - 8)
    return np.uint8(sign | min(code, 0x7E))


@njit(cache=True, inline="always")
def scale_factor(scale):
    """The factor of a scale byte, as vLLM's kernels read it: 2^(byte - 127),
    but 0 for byte 0 (their float32 2^-127 is flushed to zero) and an infinity
    for 255 (float32's 2^128)."""
    if scale == 0:
        return 0.0
    return math.inf if scale == SCALE_NONFINITE else math.ldexp(1.0, np.int64(scale) - SCALE_BIAS)


@njit(cache=True, inline="always")
def ue8m0_exponent(amax):
    """``ceil(log2(max(amax, 1e-4) / 448))`` for a finite float32 ``amax >= 0``,
    the division in float32."""
    quotient = np.float32(max(amax, AMAX_FLOOR)) / E4M3_MAX
    fraction, exponent = math.frexp(quotient)    # quotient = fraction * 2^exponent
    return exponent - 1 if fraction == 0.5 else exponent


@njit(cache=True, inline="always")
def quantized(bits, factor, nonfinite):
    """bf16 ``bits`` of a tile scaled by ``factor`` (2^-e) as e4m3: a NaN is
    +448; in a tile holding an infinity (``nonfinite``) the infinities are
    +448 and the rest +-0 (vLLM's Triton kernel: x / inf, then the clamp)."""
    magnitude = np.int64(bits) & 0x7FFF
    if magnitude > 0x7F80:
        return np.uint8(0x7E)
    if nonfinite:
        return np.uint8(0x7E if magnitude == 0x7F80 else (np.int64(bits) >> 8) & 0x80)
    value = bf16_value(bits) * factor                # exact: a bf16 times a power of two
    return e4m3_bits(min(max(value, -FP8_E4M3_MAX), FP8_E4M3_MAX))


@njit(cache=True, inline="always")
def dequantized(value, scale):
    """bf16 bits of e4m3 byte ``value`` times its scale byte's factor (one
    rounding: the product is exact in float64)."""
    return bf16_bits(E4M3_VALUES[value] * scale_factor(scale))


@njit(cache=True, inline="always")
def float32_bits(value):
    """The bits of a float32 ``value`` that is +0, positive normal or +inf (the
    indexer's scales)."""
    if value == math.inf:
        return np.int64(0x7F800000)
    if value == 0.0:
        return np.int64(0)
    fraction, exponent = math.frexp(np.float64(value))      # value = fraction * 2^exponent
    return np.int64(((exponent - 1 + 127) << 23) | np.int64((fraction * 2.0 - 1.0) * 2.0 ** 23))


@njit(cache=True, inline="always")
def cache_slot(slot, num_pages, block_size):
    """``(page, state)`` of a slot of a paged cache; page -1 for a slot outside
    the cache (-1 for padding), which is skipped (kernels/fp8.cuh's twin)."""
    if slot < 0 or slot >= num_pages * block_size:
        return np.int64(-1), np.int64(0)
    page = slot // block_size
    return page, slot - page * block_size
