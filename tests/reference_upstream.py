"""Slow reference for the newer upstream-vLLM DeepSeek-V4 metadata (parity and upstream specs).

Written only from shared/spec/parity.md (§1-§4) and shared/spec/upstream.md (§2, §4, §5, §6,
§8), plus the conventions of the brief that asked for it. It never looks at the optimised
library. Like tests/reference.py it is deliberately plain Python: lists of ints in, lists /
tuples out, one element at a time, brute force wherever a closed form exists (the closed forms
are checked against the brute force in the tests, not used here).

Arithmetic: Triton-style truncating division (`c_div`, `c_mod`) where a numerator may be
negative; values a kernel stores as int32 go through `wrap_i32`.
"""
from __future__ import annotations

from reference import PAD_ID, c_div, c_mod, cdiv, round_up, wrap_i32

__all__ = [
    "split_decodes_and_prefills_v2", "c128a_topk_v2", "compressed_slot_mapping_v2",
    "compressed_slot_mapping_034", "swa_indices_and_lens_034",
    "dcp_local_seq_lens", "swa_indices_and_lens", "global_topk_indices_and_lens",
    "fill_short_context_topk_indices", "combine_topk_swa_indices", "prefill_gather_lens",
    "prefill_chunk_plan", "indexer_prefill_chunk_metadata", "indexer_decode_metadata",
]


# ---------------------------------------------------------------- small helpers
def _query_lens(qsl: list[int]) -> list[int]:
    return [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]


def _request_of(qsl: list[int], t: int) -> int:
    """The request b with qsl[b] <= t < qsl[b+1] (linear scan), or -1 if none."""
    for b in range(len(qsl) - 1):
        if qsl[b] <= t < qsl[b + 1]:
            return b
    return -1


# ---------------------------------------------------------------- parity §1
def split_decodes_and_prefills_v2(qsl: list[int], num_actual_tokens: int, max_query_len: int,
                                  decode_threshold: int = 1, require_uniform: bool = False,
                                  treat_short_extends_as_decodes: bool = True,
                                  is_prefilling: list[bool] | None = None
                                  ) -> tuple[int, int, int, int]:
    """parity.md §1, rules 1-5, with the GATED form of rule 3 (the padded-uniform early exit
    only when the flag is True). Returns (num_decodes, num_prefills, num_decode_tokens,
    num_prefill_tokens); T = num_actual_tokens (may include graph padding).

    Empty batch (len(qsl) == 1) -> (0, 0, T, 0) (vLLM 0.34). When the flag is False, `is_prefilling`
    (one bool per request row, length R) is required: ValueError if missing or of another
    length (checked for every non-empty batch, i.e. also when rule 2 would exit first).
    """
    R = len(qsl) - 1
    if R <= 0:
        return (0, 0, num_actual_tokens, 0)
    flag = treat_short_extends_as_decodes
    if not flag:
        if is_prefilling is None:
            raise ValueError("is_prefilling is required when treat_short_extends_as_decodes=False")
        if len(is_prefilling) != R:
            raise ValueError("is_prefilling must have one entry per request")
    T = num_actual_tokens
    thr = decode_threshold
    ql = _query_lens(qsl)
    all_decodes = (R, 0, T, 0)

    # rule 1
    if max_query_len <= thr and (not require_uniform or thr <= 1) and flag:
        return all_decodes
    # rule 2 (before is_prefilling)
    if ql[0] > thr:
        return (0, R, 0, T)
    # rule 3 (gated)
    if require_uniform:
        uniform = True
        for i in range(R):
            if not (ql[i] == ql[0] or ql[i] == 0):
                uniform = False
        if flag and uniform:
            return all_decodes
        is_prefill = [ql[i] != ql[0] and ql[i] != 0 for i in range(R)]   # vLLM 0.34
    else:
        is_prefill = [ql[i] > thr for i in range(R)]
    # rule 4
    if not flag:
        is_prefill = [bool(is_prefill[i]) or bool(is_prefilling[i]) for i in range(R)]
    # rule 5
    first = -1
    for i in range(R):
        if is_prefill[i]:
            first = i
            break
    if first < 0:
        return all_decodes
    return (first, R - first, qsl[first], T - qsl[first])


# ---------------------------------------------------------------- parity §2 / §3
def _owned(e: int, world: int, rank: int, interleave: int, block_size: int) -> bool:
    """parity §2: logical row e of a virtual block of V = bs*world rows is owned by rank iff
    (voff // I) % world == rank, voff = e % V."""
    V = block_size * world
    voff = e % V
    return (voff // interleave) % world == rank


def c128a_topk_v2(positions: list[int], compress_ratio: int, num_decode_tokens: int,
                  token_to_req: list[int], block_table: list[list[int]], block_size: int,
                  slot_mapping: list[int], width: int, dcp_world_size: int = 1,
                  dcp_rank: int = 0, interleave: int = 1, num_valid_tokens: int | None = None):
    """parity.md §2 (DCP owned enumeration, compacted local slots, num_valid_tokens) and §3
    (an invalid decode token's row is -1 in every column, length 0).

    Returns (decode_rows [nd][width], decode_lens [nd], prefill_rows [T-nd][width]) with
    T = len(positions), nd = num_decode_tokens, n(t) = max(min(c_div(p+1, r), width), 0).

    Decode token t: valid iff slot_mapping[t] >= 0 (world 1) or t < num_valid_tokens
    (world > 1; None = all valid). Invalid, or request outside the block table -> all -1,
    length 0. Else brute force over e < n: owned rows whose block column e // V exists in
    the request's row are written, compacted, in ascending e, as
    wrap_i32(bt[req][e // V] * bs + (voff // (world*I)) * I + voff % I); a row whose column
    does not exist is skipped (not written, not counted). Prefill token: e for e < n, -1 after.
    """
    Wd, rank, I, bs = dcp_world_size, dcp_rank, interleave, block_size
    V = bs * Wd
    decode_rows, decode_lens, prefill_rows = [], [], []
    for t in range(len(positions)):
        p = positions[t]
        n = max(min(c_div(p + 1, compress_ratio), width), 0)
        if t < num_decode_tokens:
            if Wd == 1:
                valid = slot_mapping[t] >= 0
            else:
                valid = num_valid_tokens is None or t < num_valid_tokens
            req = token_to_req[t]
            row = [PAD_ID] * width
            count = 0
            if valid and 0 <= req < len(block_table):
                bt_row = block_table[req]
                for e in range(n):
                    if not _owned(e, Wd, rank, I, bs):
                        continue
                    col = e // V
                    if col >= len(bt_row):          # not addressable: skip
                        continue
                    voff = e % V
                    local = (voff // (Wd * I)) * I + voff % I
                    row[count] = wrap_i32(bt_row[col] * bs + local)
                    count += 1
            decode_rows.append(row)
            decode_lens.append(count)
        else:
            prefill_rows.append([e if e < n else PAD_ID for e in range(width)])
    return decode_rows, decode_lens, prefill_rows


# ---------------------------------------------------------------- parity §4
def compressed_slot_mapping_v2(num_tokens: int, qsl: list[int], seq_lens: list[int],
                               block_table: list[list[int]], block_size: int, ratio: int,
                               out_len: int, cp_world_size: int = 1, cp_rank: int = 0,
                               interleave: int = 1,
                               token_slot_mapping: list[int] | None = None) -> list[int]:
    """parity.md §4 (semantics B + rule D + the hardening guards), on top of
    reference.compressed_slot_mapping (same slot formula, block-table entries clamped at 0,
    whole output -1 first, one pass per block-table row).

    `block_size` is the STORAGE block size. Additions:
    (a) token indices >= num_tokens (and >= out_len) stay -1;
    (b) rule D (vLLM 0.34): with token_slot_mapping given, a token whose own
        token_slot_mapping[idx] is -1 (PAD_SLOT_ID, exactly) gets -1, on any rank;
    guards (§4 hardening copy; only affect inputs the old reference would crash on):
        rows = min(len(block_table), len(seq_lens), len(qsl) - 1); pos < 0 -> -1;
        block column >= the row's length -> -1.
    """
    out = [PAD_ID] * out_len
    r = ratio
    W, rank, I = cp_world_size, cp_rank, interleave
    V = block_size * W
    rows = min(len(block_table), len(seq_lens), len(qsl) - 1)
    for b in range(rows):
        qs, qe = qsl[b], qsl[b + 1]
        start = seq_lens[b] - (qe - qs)
        for j in range(qe - qs):
            idx = qs + j
            if idx >= num_tokens or idx >= out_len or idx < 0:
                continue
            pos = start + j
            if pos < 0 or c_mod(pos + 1, r) != 0:
                continue
            if token_slot_mapping is not None and token_slot_mapping[idx] == PAD_ID:
                continue
            c = c_div(pos, r)
            blk = c_div(c, V)
            v = c - blk * V
            if c_mod(c_div(v, I), W) != rank:
                continue
            if blk >= len(block_table[b]):
                continue
            off = c_div(v, W * I) * I + c_mod(v, I)
            out[idx] = max(block_table[b][blk], 0) * block_size + off
    return out


def compressed_slot_mapping_034(num_tokens: int, slot_mapping: list[int], qsl: list[int],
                                seq_lens: list[int], block_table: list[list[int]],
                                block_size: int, ratio: int, out_len: int,
                                dcp_world_size: int = 1, cp_interleave: int = 1) -> list[int]:
    """vLLM 0.34's get_compressed_slot_mapping (compressor_utils.py), read as written:
    the whole output -1, then per block-table row b and token i of its query, with
    pos = seq - q + i: valid when (pos + 1) % ratio == 0 and the token's slot is not -1;
    the rank-local position (pos // (I * W)) * I + pos % I (I counts tokens) gives the
    state, and the slot is bt[b, state // bs] * bs + state % bs. Guards (for inputs vLLM
    would read out of bounds with): indices past num_tokens or out_len stay -1, pos < 0 and
    a block column past the row give -1, entries are read clamped at 0."""
    out = [PAD_ID] * out_len
    W, I = dcp_world_size, cp_interleave
    rows = min(len(block_table), len(seq_lens), len(qsl) - 1)
    for b in range(rows):
        qs, qe = qsl[b], qsl[b + 1]
        start = seq_lens[b] - (qe - qs)
        for i in range(qe - qs):
            idx = qs + i
            if idx < 0 or idx >= num_tokens or idx >= out_len:
                continue
            pos = start + i
            if pos < 0 or (pos + 1) % ratio != 0 or slot_mapping[idx] == PAD_ID:
                continue
            local_pos = (pos // (I * W)) * I + pos % I
            state = local_pos // ratio
            column = state // block_size
            if column >= len(block_table[b]):
                continue
            out[idx] = max(block_table[b][column], 0) * block_size + state % block_size
    return out


# ---------------------------------------------------------------- parity §2 (local seq lens)
def dcp_local_seq_lens(seq_lens: list[int], world: int, rank: int | None = None,
                       interleave: int = 1):
    """parity.md §2 `get_dcp_local_seq_lens`, by brute force: for each s, the number of rows
    e < s with (e // interleave) % world == rank. rank None -> for each s, the list of counts
    of every rank 0..world-1."""
    def count(s: int, rk: int) -> int:
        c = 0
        for e in range(s):
            if (e // interleave) % world == rk:
                c += 1
        return c

    if rank is None:
        return [[count(s, rk) for rk in range(world)] for s in seq_lens]
    return [count(s, rank) for s in seq_lens]


# ---------------------------------------------------------------- upstream §2
def swa_indices_and_lens(window_size: int, qsl: list[int], seq_lens: list[int],
                         token_to_req: list[int], is_valid_token: list[bool],
                         block_table: list[list[int]], block_size: int, token_offset: int = 0,
                         num_rows: int | None = None):
    """upstream.md §2 `_compute_swa_indices_and_lens_kernel`, hardened.

    Row i is token t = i + token_offset (num_rows default len(token_to_req) - token_offset).
    Invalid token, request outside the table (or outside seq_lens / qsl), or negative
    position p -> row all -1, length 0. Else window start s = max(p - W + 1, 0); for
    k < min(p+1, W) the entry is position s+k at block column (s+k) // bs; the first entry
    whose column is past the row's length and every later one are -1 and not counted;
    slot = wrap_i32(bt[b][col] * bs + (s+k) % bs). Returns (rows [num_rows][W], lens).
    """
    if num_rows is None:
        num_rows = len(token_to_req) - token_offset
    return swa_indices_and_lens_034(window_size, window_size, qsl, seq_lens, token_to_req,
                                    is_valid_token, block_table, block_size, token_offset,
                                    num_rows)


def swa_indices_and_lens_034(window_size: int, index_width: int, qsl: list[int],
                             seq_lens: list[int], token_to_req: list[int],
                             is_valid_token: list[bool], block_table: list[list[int]],
                             block_size: int, token_offset: int, num_rows: int,
                             left_visible: list[int] | None = None,
                             right_visible: list[int] | None = None,
                             replay_start: list[int] | None = None, causal: bool = True):
    """vLLM 0.34's _compute_swa_indices_and_lens_kernel (causal) and
    ComputeDSparkNoncausalSWAIndicesKernel (causal False), read as written, with the
    library's guards on inputs vLLM would read out of bounds with.

    Row i is token t = i + token_offset, index_width columns. Invalid token -> len 0, row -1.
    Causal: r = t2r[t], p = L[r] - q[r] + (t - qsl[r]); l, r' = left/right_visible[t] (0);
    start = max(p - (W-1) - max(l - (W-1), 0), 0, replay_start[r] (0)); end = p + r' + 1.
    Non-causal: start = max(L[r] - q[r] - W, 0), end = L[r], for every token of the request.
    len = end - start; row[k] = slot(start + k) for k < len, -1 after.
    Guards: a request outside the table/seq_lens/qsl or p < 0 -> -1 row, len 0; a block
    column past the row stops the row there; len clamped to [0, index_width] (vLLM's goes
    negative when replay_start > p).
    """
    W, bs = window_size, block_size
    R = len(qsl) - 1
    rows, lens = [], []
    for i in range(num_rows):
        t = i + token_offset
        row = [PAD_ID] * index_width
        length = 0
        b = token_to_req[t]
        if is_valid_token[t] and 0 <= b < len(block_table) and b < len(seq_lens) and b < R:
            q = qsl[b + 1] - qsl[b]
            p = (seq_lens[b] - q) + (t - qsl[b])
            if p >= 0:
                if causal:
                    left = left_visible[t] if left_visible is not None else 0
                    right = right_visible[t] if right_visible is not None else 0
                    floor = replay_start[b] if replay_start is not None else 0
                    start = max(p - (W - 1) - max(left - (W - 1), 0), 0, floor)
                    end = p + right + 1
                else:
                    start, end = max(seq_lens[b] - q - W, 0), seq_lens[b]
                for k in range(min(max(end - start, 0), index_width)):
                    col = (start + k) // bs
                    if col >= len(block_table[b]):
                        break
                    row[k] = wrap_i32(block_table[b][col] * bs + (start + k) % bs)
                    length += 1
        rows.append(row)
        lens.append(length)
    return rows, lens


# ---------------------------------------------------------------- upstream §4
def global_topk_indices_and_lens(topk_indices: list[list[int]], token_to_req: list[int],
                                 block_table: list[list[int]], block_size: int,
                                 is_valid_token: list[bool], compact: bool = False):
    """upstream.md §4 `compute_global_topk_indices_and_lens`, hardened (items 1-4).

    Entry x of token t (request req) is valid iff x >= 0, 0 <= req < len(block_table) and
    x // bs < the row's number of columns (logical shape[1]); valid -> wrap_i32(
    bt[req][x // bs] * bs + x % bs), invalid -> -1, not counted. Invalid token -> all -1,
    length 0. compact=True packs the valid entries to the front (in order), -1 after.
    Returns (rows [T][K], lens [T]), T = len(topk_indices).
    """
    bs = block_size
    rows, lens = [], []
    for t in range(len(topk_indices)):
        K = len(topk_indices[t])
        req = token_to_req[t]
        row = [PAD_ID] * K
        count = 0
        if is_valid_token[t] and 0 <= req < len(block_table):
            bt_row = block_table[req]
            for k in range(K):
                x = topk_indices[t][k]
                if x >= 0 and x // bs < len(bt_row):
                    g = wrap_i32(bt_row[x // bs] * bs + x % bs)
                    row[count if compact else k] = g
                    count += 1
        rows.append(row)
        lens.append(count)
    return rows, lens


# ---------------------------------------------------------------- upstream §5
def fill_short_context_topk_indices(positions: list[int], top_k: int, compress_ratio: int,
                                    num_tokens: int | None = None) -> list[list[int]]:
    """upstream.md §5 `_fill_short_context_topk_indices`: row t, column k < top_k is k if
    k < c_div(positions[t] + 1, ratio) else -1 (n not clamped; columns >= top_k absent)."""
    if num_tokens is None:
        num_tokens = len(positions)
    rows = []
    for t in range(num_tokens):
        n = c_div(positions[t] + 1, compress_ratio)
        rows.append([k if k < n else PAD_ID for k in range(top_k)])
    return rows


# ---------------------------------------------------------------- upstream §6
def combine_topk_swa_indices(topk_indices: list[list[int]], qsl: list[int], seq_lens: list[int],
                             gather_lens: list[int], window_size: int, compress_ratio: int,
                             topk: int, M: int, N: int, left_visible: list[int] | None = None,
                             right_visible: list[int] | None = None, max_image_tokens: int = 0):
    """upstream.md §6 `combine_topk_swa_indices`, hardened V4.1 form; with vLLM 0.34's image
    visibility as its test_deepseek_v4_swa_visible reference has it: the window of token t
    is [max(p - (W-1) - max(l - (W-1), 0), 0, g0), p + r + 1) with l, r = left_visible[t],
    right_visible[t], and C = round_up(topk + W + max_image_tokens, 128).

    T = len(topk_indices), C = round_up(topk + W, 128). qsl rebased by qsl[0]; token t of
    chunk request b (qsl[b]-qsl[0] <= t < qsl[b+1]-qsl[0]), j = t - (qsl[b]-qsl[0]),
    p = L[b] - q[b] + j; tokens at or past qsl[-1]-qsl[0] -> all -1, length 0.
    k_len = 0 if topk == 0 else max(min(c_div(p+1, r), topk), 0); for k < k_len:
    out[k] = x + M*b if 0 <= x < N else -1 (still counted), x = topk_indices[t][k].
    g0 = L[b] - gather_lens[b]; swa_start = max(p - W + 1, 0, g0);
    s_len = max(p - swa_start + 1, 0); out[k_len + i] = M*b + N + (swa_start - g0) + i.
    Everything else -1; lens = k_len + s_len. Every row must hold >= topk columns
    (ValueError otherwise); topk > 0 needs compress_ratio > 0.
    """
    W, r = window_size, compress_ratio
    T = len(topk_indices)
    C = round_up(topk + W + max_image_tokens, 128)
    if topk > 0 and r <= 0:
        raise ValueError("topk > 0 needs a positive compress ratio")
    for t in range(T):
        if len(topk_indices[t]) < topk:
            raise ValueError("topk exceeds the width of topk_indices")
    base = qsl[0]
    rq = [x - base for x in qsl]                      # rebased
    total = rq[-1]
    rows, lens = [], []
    for t in range(T):
        row = [PAD_ID] * C
        length = 0
        b = _request_of(rq, t) if t < total else -1
        if b >= 0:
            q = rq[b + 1] - rq[b]
            L = seq_lens[b]
            j = t - rq[b]
            p = L - q + j
            k_len = 0 if topk == 0 else max(min(c_div(p + 1, r), topk), 0)
            for k in range(k_len):
                x = topk_indices[t][k]
                row[k] = x + M * b if 0 <= x < N else PAD_ID
            g0 = L - gather_lens[b]
            left = left_visible[t] if left_visible is not None else 0
            right = right_visible[t] if right_visible is not None else 0
            swa_start = max(p - (W - 1) - max(left - (W - 1), 0), 0, g0)
            s_len = max(p + right + 1 - swa_start, 0)
            for i in range(s_len):
                row[k_len + i] = M * b + N + (swa_start - g0) + i
            length = k_len + s_len
        rows.append(row)
        lens.append(length)
    return rows, lens


def image_visibility(qsl: list[int], seq_lens: list[int], spans: list[list[tuple[int, int]]],
                     max_image_tokens: int) -> tuple[list[int], list[int]]:
    """vLLM 0.34's _compute_image_visibility_kernel over every token of the requests:
    position p of request b inside an inclusive span [s, e] of spans[b] (the last such span
    wins) sees left = min(p - s, max - 1) image positions before it and right = min(e - p,
    max) after it; 0 and 0 outside every span."""
    left, right = [], []
    for b in range(len(qsl) - 1):
        q = qsl[b + 1] - qsl[b]
        for j in range(q):
            p = seq_lens[b] - q + j
            lv = rv = 0
            for s, e in spans[b]:
                if s <= p <= e:
                    lv, rv = min(p - s, max_image_tokens - 1), min(e - p, max_image_tokens)
            left.append(lv)
            right.append(rv)
    return left, right


# ---------------------------------------------------------------- upstream §8.3
def prefill_gather_lens(qsl: list[int], seq_lens: list[int], num_decodes: int,
                        num_prefills: int, window_size: int = 128,
                        replay_start: list[int] | None = None) -> list[int]:
    """upstream.md §8.3 `ComputePrefillMetadataKernel` (vLLM 0.34's, with replay_start): for
    prefill i (request d = num_decodes + i), q + min(max(L - q - replay_start[d], 0), W - 1)."""
    out = []
    for i in range(num_prefills):
        b = num_decodes + i
        q = qsl[b + 1] - qsl[b]
        L = seq_lens[b]
        replay = replay_start[b] if replay_start is not None else 0
        out.append(q + min(max(L - q - replay, 0), window_size - 1))
    return out


# ---------------------------------------------------------------- upstream §8.4
def prefill_chunk_plan(seq_lens: list[int], query_lens: list[int], compress_ratio: int,
                       chunk_size: int, window_size: int, max_model_len: int,
                       max_num_batched_tokens: int) -> list[tuple[int, int, int, int]]:
    """upstream.md §8.4 `get_prefill_chunk_plan` (greedy, over the prefill requests given).

    compressed[i] = L // r (0 when r <= 1); gather[i] = q + min(max(L - q, 0), W - 1).
    budget = chunk_size * (cdiv(max_model_len, r) [0 when r <= 1] + W + max_num_batched_tokens).
    A chunk [start, end) starts with one request (always accepted) and takes request `end`
    while (end + 1 - start) * (max compressed + max gather over [start, end]) <= budget.
    Yields (start, end, N = max compressed, M = N + max gather) per chunk.
    """
    r, W = compress_ratio, window_size
    n = len(seq_lens)
    comp = [(seq_lens[i] // r if r > 1 else 0) for i in range(n)]
    gath = [query_lens[i] + min(max(seq_lens[i] - query_lens[i], 0), W - 1) for i in range(n)]
    budget = chunk_size * ((cdiv(max_model_len, r) if r > 1 else 0) + W + max_num_batched_tokens)
    plan = []
    start = 0
    while start < n:
        end = start + 1
        while end < n:
            cand = range(start, end + 1)
            mc = max(comp[i] for i in cand)
            mg = max(gath[i] for i in cand)
            if (end + 1 - start) * (mc + mg) <= budget:
                end += 1
            else:
                break
        N = max(comp[i] for i in range(start, end))
        M = N + max(gath[i] for i in range(start, end))
        plan.append((start, end, N, M))
        start = end
    return plan


# ---------------------------------------------------------------- upstream §8.1
def indexer_prefill_chunk_metadata(qsl: list[int], seq_lens: list[int], compress_ratio: int,
                                   query_slice_start: int, query_slice_stop: int,
                                   positions: list[int] | None = None, dcp_rank: int = 0,
                                   dcp_world_size: int = 1, interleave: int = 1):
    """upstream.md §8.1 `BuildPrefillChunkMetadataKernel`, with vLLM 0.34's
    build_prefill_chunk_metadata arguments: ShardQ positions and DCP.

    qsl rebased to 0. cu_compressed = [0] + cumsum(L // r); token_to_seq[cu[b] + x] = b for
    x < L[b] // r; for query token j of request b with a = qsl[b] + j in [start, stop):
    ctx = positions[a] + 1 (given) or prefix[b] + 1 + j, len = c_div(ctx, r), and under DCP
    len = dcp_local_seq_lens(len) and row_start = local_cu[b] (local_cu = [0] + cumsum of each
    request's rank-local rows), else row_start = cu[b]: ks = row_start, ke = row_start + len.
    Needs 0 <= start <= stop <= qsl[R] (ValueError otherwise) so every output is written.
    Returns (cu_compressed [R+1], token_to_seq, cu_seqlen_ks [stop-start], cu_seqlen_ke,
    local_cu [R+1] (cu_compressed on one rank)).
    """
    def local(n):
        if dcp_world_size == 1:
            return n
        return dcp_local_seq_lens([n], dcp_world_size, dcp_rank, interleave)[0]

    r = compress_ratio
    rq = [x - qsl[0] for x in qsl]
    R = len(rq) - 1
    if not (0 <= query_slice_start <= query_slice_stop <= rq[R]):
        raise ValueError("query slice outside the chunk's tokens")
    cu, local_cu = [0], [0]
    for b in range(R):
        cu.append(cu[-1] + c_div(seq_lens[b], r))
        local_cu.append(local_cu[-1] + local(c_div(seq_lens[b], r)))
    token_to_seq = []
    for b in range(R):
        for _ in range(c_div(seq_lens[b], r)):
            token_to_seq.append(b)
    Q = query_slice_stop - query_slice_start
    ks = [None] * Q
    ke = [None] * Q
    for b in range(R):
        q = rq[b + 1] - rq[b]
        prefix = seq_lens[b] - q
        for j in range(q):
            a = rq[b] + j
            if query_slice_start <= a < query_slice_stop:
                context = positions[a] + 1 if positions is not None else prefix + 1 + j
                ks[a - query_slice_start] = local_cu[b]
                ke[a - query_slice_start] = local_cu[b] + local(c_div(context, r))
    return cu, token_to_seq, ks, ke, local_cu


# ---------------------------------------------------------------- upstream §8.2
def indexer_decode_metadata(qsl: list[int], seq_lens: list[int], block_table: list[list[int]],
                            num_padded_tokens: int, compress_ratio: int):
    """upstream.md §8.2 device-fused `_indexer_decode_metadata_kernel` (#56562), then the
    DSv4 division by the compress ratio.

    For t < num_padded_tokens: valid = t < qsl[R]; b = the request with qsl[b] <= t < qsl[b+1];
    context_lens[t] = max(L[b] - q[b] + j + 1, 0) // r if valid else 0;
    req_ids[t] = b if valid else R + (t - qsl[R]); decode_lens[t] = 1;
    block_rows[t] = copy of bt[b] if valid else zeros (width = the table's column count);
    per_req_lens[b] = q[b] for b < R (vLLM 0.34's kernel writes it too).
    Returns (context_lens, req_ids, decode_lens, block_rows, per_req_lens).
    """
    R = len(qsl) - 1
    cols = len(block_table[0]) if block_table else 0
    ctx, req_ids, dlens, brows = [], [], [], []
    for t in range(num_padded_tokens):
        valid = t < qsl[R]
        if valid:
            b = _request_of(qsl, t)
            q = qsl[b + 1] - qsl[b]
            j = t - qsl[b]
            length = max(seq_lens[b] - q + j + 1, 0) // compress_ratio
            ctx.append(length)
            req_ids.append(b)
            brows.append(list(block_table[b]))
        else:
            ctx.append(0)
            req_ids.append(R + (t - qsl[R]))
            brows.append([0] * cols)
        dlens.append(1)
    per_req = [qsl[b + 1] - qsl[b] for b in range(R)]
    return ctx, req_ids, dlens, brows, per_req


def indexer_native_decode(qsl: list[int], seq_lens: list[int], max_decode_len: int,
                          compress_ratio: int, num_rows: int):
    """vLLM 0.34's native [B, next_n] decode lengths (indexer.py _prepare_decode_tensors, then
    the in-place division): S[b][j] = max(L[b] - mdl + 1 + j, 0) // r for the R decode
    requests; with next_n == 1 the rows past R up to num_decode_tokens are 0.
    Returns (S as num_rows lists, decode_lens = per-request query lengths)."""
    R = len(qsl) - 1
    rows = [[max(seq_lens[b] - max_decode_len + 1 + j, 0) // compress_ratio
             for j in range(max_decode_len)] if b < R else [0] * max_decode_len
            for b in range(num_rows)]
    return rows, [qsl[b + 1] - qsl[b] for b in range(R)]


def indexer_uniform_flatten(seq_lens: list[int], block_table: list[list[int]], num_decodes: int,
                            max_decode_len: int, compress_ratio: int):
    """vLLM 0.34's PrepareUniformDecodeKernel (every decode has max_decode_len tokens), then
    the division: token idx = b * mdl + j gets max(L[b] - mdl + j + 1, 0) // r, row bt[b]."""
    lens, rows = [], []
    for idx in range(num_decodes * max_decode_len):
        b, j = divmod(idx, max_decode_len)
        lens.append(max(seq_lens[b] - max_decode_len + j + 1, 0) // compress_ratio)
        rows.append(list(block_table[b]))
    return lens, rows


def indexer_torch_flatten(qsl: list[int], seq_lens: list[int], block_table: list[list[int]],
                          num_decode_tokens: int, compress_ratio: int):
    """vLLM 0.34's torch varlen flatten (indexer.py), then the division: the decode tokens'
    lengths L[b] - q[b] + (t - qsl[b]) + 1 (no clamp: use inputs with L >= q), rows repeated
    per token; past the requests' tokens length 0 and a row vLLM only clears column 0 of
    (None here)."""
    R = len(qsl) - 1
    lens, rows = [], []
    for b in range(R):
        q = qsl[b + 1] - qsl[b]
        for t in range(qsl[b], qsl[b + 1]):
            lens.append((seq_lens[b] - q + (t - qsl[b]) + 1) // compress_ratio)
            rows.append(list(block_table[b]))
    padding = num_decode_tokens - len(lens)
    return lens + [0] * padding, rows + [None] * padding
