"""Slow reference implementation of the DeepSeek-V4 sparse-MLA metadata functions.

Written only from the spec (shared/spec/semantics.md, sections 2.1-2.10) and the
seed's Triton kernel `_build_c128a_topk_metadata_kernel` (shared/spec/seed_sparse_mla.txt),
plus the `_seed_slot_mapping` kernel in shared/bench/compare_seed.py for the
compressed slot mapping. It is deliberately plain Python (lists and ints, one
element at a time) so that it is obviously correct. The tests trust it; it is
independent of the optimised library and must never be optimised.

Arithmetic: the seed is Triton, whose integer `//` and `%` on signed values truncate
toward zero (C semantics), not Python's floor semantics. `c_div` / `c_mod` model that.
Values the seed computes and stores as int32 are passed through `wrap_i32`.
"""
from __future__ import annotations

import functools as _functools
import math as _math
import struct as _struct
from fractions import Fraction as _Fraction

PAD_ID = -1


# ---------------------------------------------------------------- helpers
def c_div(a: int, b: int) -> int:
    """Integer division truncating toward zero (C / Triton)."""
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def c_mod(a: int, b: int) -> int:
    """Remainder with the sign of the dividend (C / Triton): a == b*c_div(a,b) + c_mod(a,b)."""
    return a - b * c_div(a, b)


def wrap_i32(x: int) -> int:
    """Two's-complement int32 wraparound."""
    return ((x + (1 << 31)) % (1 << 32)) - (1 << 31)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    p = 1
    while p < x:
        p *= 2
    return p


# ---------------------------------------------------------------- §2.1
def token_to_req(query_start_loc: list[int], num_tokens: int) -> list[int]:
    """req_id_per_token: request i with qsl[i] <= t < qsl[i+1]; padding tokens -> 0."""
    num_reqs = len(query_start_loc) - 1
    out = []
    for t in range(num_tokens):
        req = 0                                    # padding / unmatched tokens -> 0
        if num_reqs > 0 and t < query_start_loc[-1]:
            for i in range(num_reqs):              # linear scan, zero-length reqs never match
                if query_start_loc[i] <= t < query_start_loc[i + 1]:
                    req = i
                    break
        out.append(req)
    return out


# ---------------------------------------------------------------- §2.2
def split_decodes_and_prefills(query_start_loc: list[int], decode_threshold: int = 1,
                               require_uniform: bool = False,
                               num_actual_tokens: int | None = None,
                               max_query_len: int | None = None) -> tuple[int, int, int, int]:
    """(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens),
    with treat_short_extends_as_decodes=True."""
    qsl = query_start_loc
    num_reqs = len(qsl) - 1
    if num_reqs <= 0:                              # vLLM 0.34: the tokens are padding decodes
        return (0, 0, qsl[-1] if num_actual_tokens is None else num_actual_tokens, 0)
    qlen = [qsl[i + 1] - qsl[i] for i in range(num_reqs)]
    if num_actual_tokens is None:
        num_actual_tokens = qsl[-1]
    if max_query_len is None:
        max_query_len = max(qlen)
    thr = decode_threshold
    all_decode = (num_reqs, 0, num_actual_tokens, 0)

    if max_query_len <= thr and (not require_uniform or thr <= 1):
        return all_decode
    if qlen[0] > thr:                              # first request is not a decode
        return (0, num_reqs, 0, num_actual_tokens)
    if require_uniform:
        if all(q == qlen[0] or q == 0 for q in qlen):
            return all_decode                      # padded uniform batch
        is_pref = [q != qlen[0] and q != 0 for q in qlen]   # vLLM 0.34: 0 rows are not prefills
    else:
        is_pref = [q > thr for q in qlen]
    if not any(is_pref):
        return all_decode
    b = is_pref.index(True)                        # first prefill request
    return (b, num_reqs - b, qsl[b], num_actual_tokens - qsl[b])


# ---------------------------------------------------------------- §2.3
def compressed_slot_mapping(num_tokens: int, query_start_loc: list[int], seq_lens: list[int],
                            block_table: list[list[int]], block_size: int, compress_ratio: int,
                            out_len: int | None = None, cp_world_size: int = 1, cp_rank: int = 0,
                            cp_kv_cache_interleave_size: int = 1) -> list[int]:
    """Per input token: physical row in the compressed cache written by that token, else -1.

    `block_size` is the STORAGE block size (block_size // ratio). The whole output
    (length out_len, default num_tokens) starts as -1. Block-table entries are read
    clamped at 0 (the builder passes block_table.clamp(min=0)). Slot is int64 (the seed
    casts the block number to int64), so no wraparound.
    """
    if out_len is None:
        out_len = num_tokens
    out = [PAD_ID] * out_len
    r = compress_ratio
    W, rank, I = cp_world_size, cp_rank, cp_kv_cache_interleave_size
    V = block_size * W                             # virtual block under CP interleave
    for b in range(len(block_table)):              # one program per block-table ROW
        qs, qe = query_start_loc[b], query_start_loc[b + 1]
        start = seq_lens[b] - (qe - qs)
        for j in range(qe - qs):
            pos = start + j
            if pos < 0 or c_mod(pos + 1, r) != 0:  # token does not close a group
                continue
            c = c_div(pos, r)                      # compressed row index
            blk = c_div(c, V)
            v = c - blk * V
            if c_mod(c_div(v, I), W) != rank:      # row owned by another CP rank
                continue
            off = c_div(v, W * I) * I + c_mod(v, I)
            slot = max(block_table[b][blk], 0) * block_size + off
            if qs + j < out_len:
                out[qs + j] = slot
    return out


# ---------------------------------------------------------------- §2.6
def c128a_topk(positions: list[int], compress_ratio: int, num_decode_tokens: int,
               token_to_req_indices: list[int], block_table: list[list[int]], block_size: int,
               slot_mapping: list[int], width: int):
    """The seed's `_build_c128a_topk_metadata_kernel` with max_compressed_tokens = width.

    Returns (global_decode [nd_tok][width], decode_lens [nd_tok], prefill_local [np_tok][width]).
    `block_size` is the compressed block size (256 // 128 = 2). Block table is NOT clamped.
    """
    global_decode, decode_lens, prefill_local = [], [], []
    for t, p in enumerate(positions):              # one program per token
        n = min(c_div(p + 1, compress_ratio), width)   # may be <= 0 (then no valid entry)
        if t < num_decode_tokens:                  # ---- decode: global slot ids + count
            req = token_to_req_indices[t]
            row, count = [], 0
            for e in range(width):
                if e < n:                          # block table read only for valid e
                    blk = block_table[req][c_div(e, block_size)]
                    row.append(wrap_i32(blk * block_size + c_mod(e, block_size)))
                    count += 1
                else:
                    row.append(PAD_ID)
            global_decode.append(row)
            decode_lens.append(count if slot_mapping[t] >= 0 else 0)   # padding -> 0
        else:                                      # ---- prefill: request-local indices
            prefill_local.append([e if e < n else PAD_ID for e in range(width)])
    return global_decode, decode_lens, prefill_local


# ---------------------------------------------------------------- §2.5 / §2.8 widths
def c128a_capacity(max_model_len: int) -> int:
    """cap = round_up(cdiv(max_model_len, 128), 128)."""
    return round_up(cdiv(max_model_len, 128), 128)


def c128a_active_width(max_seq_len: int, capacity: int) -> int:
    """active = min(max(next_pow2(max(max_seq_len // 128, 1)), 128), cap)."""
    return min(max(next_pow2(max(max_seq_len // 128, 1)), 128), capacity)


# ---------------------------------------------------------------- §2.4 / §2.5
def build(compress_ratio: int, block_size: int, num_speculative_tokens: int, width: int,
          query_start_loc: list[int], seq_lens: list[int], block_table: list[list[int]],
          slot_mapping: list[int], positions: list[int], num_actual_tokens: int,
          max_query_len: int, buffer_len: int | None, dcp: tuple = (1, 0, 1),
          treat_short_extends_as_decodes: bool = True, is_prefilling=None) -> dict:
    """The whole per-step builder, composed from the functions above and, for
    newer vLLM's rules (padding rows all -1, DCP, the short-extend split), the
    ones in reference_upstream.py. ``dcp`` is (world size, rank, interleave)."""
    import reference_upstream as upstream
    world, rank, interleave = dcp
    req_id = token_to_req(query_start_loc, num_actual_tokens)          # §2.1

    slot = slot_mapping
    if compress_ratio > 1:                                              # §2.3
        slot = upstream.compressed_slot_mapping_v2(
            buffer_len if buffer_len is not None else num_actual_tokens, query_start_loc,
            seq_lens, block_table, block_size // compress_ratio, compress_ratio,
            buffer_len if buffer_len is not None else num_actual_tokens, world, rank, interleave)

    nd, npf, nd_tok, np_tok = upstream.split_decodes_and_prefills_v2(  # §2.2 / §2.5
        query_start_loc, num_actual_tokens, max_query_len, 1 + num_speculative_tokens, False,
        treat_short_extends_as_decodes, is_prefilling)
    res = dict(req_id_per_token=req_id, slot_mapping=slot,
               num_decodes=nd, num_prefills=npf, num_decode_tokens=nd_tok,
               num_prefill_tokens=np_tok, c128a_global_decode=None, c128a_decode_lens=None,
               c128a_prefill=None)
    if compress_ratio != 128:
        return res
    total = nd_tok + np_tok
    if total > 0:                                                       # §2.6
        gd, lens, pf = upstream.c128a_topk_v2(
            positions[:total], 128, nd_tok, req_id, block_table, block_size // 128,
            slot_mapping, width, world, rank, interleave,
            query_start_loc[-1] if world > 1 else None)   # the INPUT (uncompressed) mapping
        if nd_tok > 0:
            res["c128a_global_decode"] = gd
            res["c128a_decode_lens"] = lens
        if np_tok > 0:
            res["c128a_prefill"] = pf
    return res


# ---------------------------------------------------------------- the fp8 KV caches
# From shared/spec/vllm.md section 8 and vLLM 0.34's references
# (_ue8m0_reference, _dequantize_and_gather_k_cache_reference), as its Triton
# kernels behave on NaN and infinity: exact rationals, one value at a time.

NOPE, ROPE, TILE, RECORD, SCALES = 448, 64, 64, 576, 8
INDEXER_DIM = 128


def bf16_value(bits: int) -> float:
    return _struct.unpack("<f", _struct.pack("<I", bits << 16))[0]


def f32_bits(value: float) -> int:
    return _struct.unpack("<I", _struct.pack("<f", value))[0]


def bf16_of_f32(value: float) -> int:
    """torch's float32 -> bf16: round to nearest even on the bits; NaN 0x7FC0."""
    if value != value:
        return 0x7FC0
    bits = f32_bits(value)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def f32_round(exact: _Fraction) -> float:
    """An exact rational rounded to float32 (nearest even), as a float (normal range)."""
    if exact == 0:
        return 0.0
    sign = -1 if exact < 0 else 1
    magnitude = abs(exact)
    e = _math.floor(_math.log2(magnitude))
    while _Fraction(2) ** e > magnitude:
        e -= 1
    while _Fraction(2) ** (e + 1) <= magnitude:
        e += 1
    quantum = _Fraction(2) ** (e - 23)
    return sign * float(round(magnitude / quantum) * quantum)


def _e4m3_table():
    values = []
    for code in range(0x7F):                     # the finite non-negative codes
        exponent, mantissa = code >> 3, code & 7
        values.append(_Fraction(mantissa, 8) * _Fraction(2) ** -6 if exponent == 0
                      else (1 + _Fraction(mantissa, 8)) * _Fraction(2) ** (exponent - 7))
    return values


E4M3 = _e4m3_table()


@_functools.lru_cache(maxsize=None)
def e4m3_code(value) -> int:
    """The e4m3fn code nearest a finite value (ties to the even code), saturating at 448."""
    magnitude = abs(_Fraction(value))
    sign = 0x80 if (value < 0 or (value == 0 and _math.copysign(1.0, float(value)) < 0)) else 0
    if magnitude >= E4M3[-1]:
        return sign | 0x7E
    best = min(range(len(E4M3)), key=lambda c: (abs(E4M3[c] - magnitude), c & 1))
    return sign | best


def e4m3_float(code: int) -> float:
    if code & 0x7F == 0x7F:
        return float("nan")
    value = float(E4M3[code & 0x7F])
    return -value if code & 0x80 else value


def ue8m0_tile(bits: list[int]) -> tuple[list[int], int]:
    """A NoPE tile's (e4m3 codes, scale byte), vLLM's Triton rule: amax over the
    non-NaN |x| at least float32 1e-4, e = ceil(log2(f32(amax / 448))); a NaN
    value is +448; a tile holding an infinity has scale byte 255, +448 for its
    infinities and +-0 for the rest."""
    values = [bf16_value(b) for b in bits]
    finite_or_inf = [abs(v) for v in values if v == v]
    amax = max(finite_or_inf, default=0.0)
    if amax == _math.inf:
        return [0x7E if (v != v or abs(v) == _math.inf) else (0x80 if _math.copysign(1, v) < 0
                                                            else 0) for v in values], 255
    amax = max(amax, _struct.unpack("<f", _struct.pack("<f", 1e-4))[0])
    e = _math.ceil(_math.log2(f32_round(_Fraction(amax) / 448)))
    codes = []
    for v in values:
        if v != v:
            codes.append(0x7E)
            continue
        scaled = _Fraction(v) / _Fraction(2) ** e
        if scaled == 0:
            codes.append(0x80 if _math.copysign(1, v) < 0 else 0)
        else:
            codes.append(e4m3_code(max(min(scaled, 448), -448)))
    return codes, max(min(e + 127, 255), 0)


def fp8_ds_mla_insert(k_bits, pages, slot_mapping, block_size: int) -> None:
    """k_bits [T][512] bf16 bits into pages [num_pages][page_stride] (lists of bytes, in place)."""
    capacity = len(pages) * block_size
    for t, slot in enumerate(slot_mapping):
        if slot < 0 or slot >= capacity:
            continue
        page, r = pages[slot // block_size], slot % block_size
        row = k_bits[t]
        scales = []
        for j in range(NOPE // TILE):
            codes, scale = ue8m0_tile(row[j * TILE:(j + 1) * TILE])
            page[r * RECORD + j * TILE:r * RECORD + (j + 1) * TILE] = codes
            scales.append(scale)
        for d in range(ROPE):
            bits = row[NOPE + d]
            page[r * RECORD + NOPE + 2 * d] = bits & 0xFF
            page[r * RECORD + NOPE + 2 * d + 1] = bits >> 8
        at = block_size * RECORD + r * SCALES
        page[at:at + SCALES] = scales + [0]


@_functools.lru_cache(maxsize=None)
def dequantized_bf16(code: int, scale: int) -> int:
    """bf16 bits of float32(e4m3 * 2^(scale - 127)), as vLLM's kernels read it
    (scale byte 0: a zero factor, 255: an infinite one)."""
    value = e4m3_float(code)
    factor = 0.0 if scale == 0 else (_math.inf if scale == 255 else 2.0 ** (scale - 127))
    if value != value or (value == 0 and factor == _math.inf):
        return 0x7FC0
    if factor == _math.inf:
        return 0x7F80 | (0x8000 if value < 0 else 0)
    product = _Fraction(value) * _Fraction(factor)
    if product == 0:
        return 0x8000 if _math.copysign(1, value) * _math.copysign(1, factor) < 0 else 0
    if abs(product) >= _Fraction(2) ** 128:
        return 0x7F80 | (0x8000 if product < 0 else 0)
    if abs(product) < _Fraction(2) ** -126:     # float32 subnormal: exact at this size
        return bf16_of_f32(float(product))
    return bf16_of_f32(f32_round(product))


def fp8_ds_mla_gather(out, pages, seq_lens, gather_lens, block_table, block_size: int,
                      offset: int, ratio: int = 1) -> None:
    """out [R][M][512] bf16 bits (lists, in place): request b's last G rows of
    its seq_len // ratio at out rows offset + i; a row whose position, table
    column or block is outside is not written."""
    for b, length in enumerate(seq_lens):
        seq = c_div(length, ratio)
        gathered = seq if gather_lens is None else gather_lens[b]
        for i in range(max(min(gathered, len(out[b]) - offset), 0)):   # rows inside out
            position, row = seq - gathered + i, offset + i
            if position < 0 or b >= len(block_table):
                continue
            column = position // block_size
            if column >= len(block_table[b]):
                continue
            page_id = block_table[b][column]
            if page_id < 0 or page_id >= len(pages):
                continue
            page, r = pages[page_id], position % block_size
            scales = page[block_size * RECORD + r * SCALES:block_size * RECORD + r * SCALES + 7]
            record = page[r * RECORD:(r + 1) * RECORD]
            out[b][row] = ([dequantized_bf16(record[d], scales[d // TILE]) for d in range(NOPE)]
                           + [record[NOPE + 2 * d] | (record[NOPE + 2 * d + 1] << 8)
                              for d in range(ROPE)])


def selected_gather(workspace, indices, lens, out_rows: int):
    """The full workspace's rows that the indices name, compacted: workspace
    [R][M][512] (lists, a full gather's result), indices [T][width] naming rows
    b * M + row, lens [T] valid entries. Returns (compact rows, in row order,
    at most out_rows; remapped [T][width]: an entry's compact row, -1 past lens,
    outside the workspace or past out_rows; the number of named rows)."""
    flat = [row for request in workspace for row in request]
    named = sorted({indices[t][j] for t in range(len(indices)) for j in range(
        min(lens[t], len(indices[t]))) if 0 <= indices[t][j] < len(flat)})
    rank = {row: k for k, row in enumerate(named)}
    remapped = [[rank.get(indices[t][j], -1) if j < lens[t] else -1 for j in range(len(row))]
                for t, row in enumerate(indices)]
    remapped = [[k if k < out_rows else -1 for k in row] for row in remapped]
    return [flat[row] for row in named[:out_rows]], remapped, len(named)


def indexer_insert(k_bits, pages, slot_mapping, block_size: int, scale_fmt: str) -> None:
    """k_bits [T][128] into indexer pages (lists of bytes): amax over the non-NaN
    |x| (floor 1e-4), scale f32(amax / 448), for ue8m0/mxfp8 2^ceil(log2);
    values e4m3(f32(x / scale)) saturating, NaN 0x7F; the scale as float32
    bytes or (mxfp8) its exponent byte four times."""
    capacity = len(pages) * block_size
    for t, row in enumerate(k_bits):
        slot = slot_mapping[t]
        if slot < 0 or slot >= capacity:
            continue
        page, r = pages[slot // block_size], slot % block_size
        values = [bf16_value(b) for b in row]
        amax = max((abs(v) for v in values if v == v), default=0.0)
        if amax == _math.inf:
            scale = _math.inf
        else:
            quotient = f32_round(_Fraction(max(amax, _struct.unpack("<f", _struct.pack(
                "<f", 1e-4))[0])) / 448)
            scale = quotient if scale_fmt == "" else 2.0 ** _math.ceil(_math.log2(quotient))
        codes = []
        for v in values:
            if v != v or (scale == _math.inf and abs(v) == _math.inf):
                codes.append(0x7F)
            elif scale == _math.inf or v == 0:
                codes.append(0x80 if _math.copysign(1, v) < 0 else 0)
            else:
                scaled = f32_round(_Fraction(v) / _Fraction(scale)) \
                    if abs(_Fraction(v) / _Fraction(scale)) >= _Fraction(2) ** -126 else 0.0
                codes.append(e4m3_code(scaled) if scaled != 0
                             else (0x80 if v < 0 else 0))
        page[r * INDEXER_DIM:(r + 1) * INDEXER_DIM] = codes
        bits = f32_bits(scale)
        scale_bytes = [(bits >> 23) & 0xFF] * 4 if scale_fmt == "mxfp8" else \
            list(_struct.pack("<I", bits))
        at = block_size * INDEXER_DIM + r * 4
        page[at:at + 4] = scale_bytes


def indexer_gather(pages, dst_k, dst_scale, block_table, cu_seq_lens, block_size: int) -> None:
    """dst rows (lists of bytes, in place): row t is position t - cu[b] of the
    request b with cu[b] <= t < cu[b + 1]; other rows are not written."""
    for t in range(len(dst_k)):
        owners = [b for b in range(len(block_table)) if cu_seq_lens[b] <= t < cu_seq_lens[b + 1]]
        if not owners:
            continue
        b = owners[0]
        position = t - cu_seq_lens[b]
        column = position // block_size
        if column >= len(block_table[b]) or not 0 <= block_table[b][column] < len(pages):
            continue
        page, r = pages[block_table[b][column]], position % block_size
        dst_k[t] = page[r * INDEXER_DIM:(r + 1) * INDEXER_DIM]
        dst_scale[t] = page[block_size * INDEXER_DIM + r * 4:block_size * INDEXER_DIM + r * 4 + 4]
