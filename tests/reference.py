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
    if num_reqs <= 0:
        return (0, 0, 0, 0)
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
        is_pref = [q != qlen[0] for q in qlen]
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
