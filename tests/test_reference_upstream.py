"""Hand-worked examples for tests/reference_upstream.py.

Every expected value below is a literal worked out by hand from parity.md / upstream.md
(not produced by running the reference). `list(range(a, b))` and `[-1] * n` are used as
shorthand for long runs of literals.
"""
from __future__ import annotations

import random

import pytest

import reference as ref
from reference_upstream import (
    c128a_topk_v2,
    combine_topk_swa_indices,
    compressed_slot_mapping_v2,
    dcp_local_seq_lens,
    fill_short_context_topk_indices,
    global_topk_indices_and_lens,
    indexer_decode_metadata,
    indexer_prefill_chunk_metadata,
    prefill_chunk_plan,
    prefill_gather_lens,
    split_decodes_and_prefills_v2,
    swa_indices_and_lens,
)

NEG = -1


def pad(xs, width):
    return list(xs) + [NEG] * (width - len(xs))


# ====================================================================== parity §1 (split)
def split(qsl, thr, T=None, uniform=False, flag=True, isp=None, mql=None):
    if T is None:
        T = qsl[-1]
    if mql is None:
        mql = max(qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1))
    return split_decodes_and_prefills_v2(qsl, T, mql, decode_threshold=thr,
                                         require_uniform=uniform,
                                         treat_short_extends_as_decodes=flag,
                                         is_prefilling=isp)


def test_split_S1():
    assert split([0, 1, 2], 1, uniform=True, flag=False, isp=[False, True]) == (1, 1, 1, 1)
    assert split([0, 1, 2], 1, uniform=True, flag=True, isp=[False, True]) == (2, 0, 2, 0)


def test_split_S2():
    isp = [False, False, True, False]
    assert split([0, 2, 4, 6, 8], 2, flag=False, isp=isp) == (2, 2, 4, 4)
    assert split([0, 2, 4, 6, 8], 2, flag=True, isp=isp) == (4, 0, 8, 0)


def test_split_S3_padded_uniform():
    assert split([0, 2, 4, 6, 6], 3, T=8, uniform=True, flag=True) == (4, 0, 8, 0)
    assert split([0, 2, 4, 6, 6], 3, T=8, uniform=True, flag=False,
                 isp=[False] * 4) == (4, 0, 8, 0)     # vLLM 0.34: a row of 0 is no prefill


def test_split_S4():
    assert split([0, 1, 1], 1, T=1, flag=False, isp=[True, False]) == (0, 2, 0, 1)


def test_split_S5_mtp():
    assert split([0, 2, 4, 5, 105], 2, flag=True) == (3, 1, 5, 100)
    assert split([0, 2, 4, 5, 105], 2, flag=False,
                 isp=[False, True, False, True]) == (1, 3, 2, 103)


def test_split_empty_and_errors():
    assert split_decodes_and_prefills_v2([0], 0, 0) == (0, 0, 0, 0)
    assert split_decodes_and_prefills_v2([0], 0, 0, treat_short_extends_as_decodes=False) \
        == (0, 0, 0, 0)
    with pytest.raises(ValueError):
        split([0, 1, 2], 1, flag=False, isp=None)
    with pytest.raises(ValueError):
        split([0, 1, 2], 1, flag=False, isp=[False])


def test_split_rule2_before_is_prefilling():
    # first request is a prefill: (0, R, 0, T), whatever is_prefilling says
    assert split([0, 5, 6], 1, T=7, flag=False, isp=[False, False]) == (0, 2, 0, 7)


def test_split_flag_true_matches_old_reference():
    rng = random.Random(11)
    for _ in range(300):
        R = rng.randint(1, 6)
        ql = [rng.choice([0, 1, 1, 2, 3, 7]) for _ in range(R)]
        qsl = [0]
        for q in ql:
            qsl.append(qsl[-1] + q)
        thr = rng.randint(1, 4)
        uni = rng.random() < 0.5
        T = qsl[-1] + rng.randint(0, 3)
        mql = max(ql)
        old = ref.split_decodes_and_prefills(qsl, thr, uni, T, mql)
        assert split_decodes_and_prefills_v2(qsl, T, mql, thr, uni) == old
        # flag False with no request still prefilling: only rules 1 and 3 differ
        new = split_decodes_and_prefills_v2(qsl, T, mql, thr, uni, False, [False] * R)
        assert new[0] <= old[0] and new[2] <= old[2]


# ====================================================================== parity §2/§3 (C128A)
BT_D = [[30 + 8 * i + c for c in range(8)] for i in range(3)]   # bt[i] = [30+8i .. 37+8i]
POS_D = [1023, 2047, 127]                                        # n = 8, 16, 1


def c128(positions, nd, t2r, bt, bs, slots, width, **kw):
    return c128a_topk_v2(positions, 128, nd, t2r, bt, bs, slots, width, **kw)


def test_c128a_D1_world1():
    rows, lens, pf = c128(POS_D, 3, [0, 1, 2], BT_D, 2, [0, 0, 0], 16)
    assert rows == [pad(range(60, 68), 16), list(range(76, 92)), pad([92], 16)]
    assert lens == [8, 16, 1] and pf == []


def test_c128a_D2_world2():
    rows, lens, _ = c128(POS_D, 3, [0, 1, 2], BT_D, 2, [0, 0, 0], 16, dcp_world_size=2,
                         dcp_rank=0)
    assert rows == [pad([60, 61, 62, 63], 16), pad(range(76, 84), 16), pad([92], 16)]
    assert lens == [4, 8, 1]
    rows, lens, _ = c128(POS_D, 3, [0, 1, 2], BT_D, 2, [0, 0, 0], 16, dcp_world_size=2,
                         dcp_rank=1)
    assert rows == [pad([60, 61, 62, 63], 16), pad(range(76, 84), 16), [NEG] * 16]
    assert lens == [4, 8, 0]


def test_c128a_D3_world4():
    expect = {0: [2, 4, 1], 1: [2, 4, 0], 2: [2, 4, 0], 3: [2, 4, 0]}
    for rank in range(4):
        rows, lens, _ = c128(POS_D, 3, [0, 1, 2], BT_D, 2, [0, 0, 0], 16, dcp_world_size=4,
                             dcp_rank=rank)
        assert lens == expect[rank]
        if rank == 0:
            assert rows == [pad([60, 61], 16), pad([76, 77, 78, 79], 16), pad([92], 16)]


def test_c128a_D4_interleave2():
    bt = [[10, 11, 12, 13]]
    rows, lens, _ = c128([1279], 1, [0], bt, 4, [0], 16, dcp_world_size=2, dcp_rank=0,
                         interleave=2)
    assert rows == [pad([40, 41, 42, 43, 44, 45], 16)] and lens == [6]
    rows, lens, _ = c128([1279], 1, [0], bt, 4, [0], 16, dcp_world_size=2, dcp_rank=1,
                         interleave=2)
    assert rows == [pad([40, 41, 42, 43], 16)] and lens == [4]
    assert dcp_local_seq_lens([10], 2, 0, 2) == [6]
    assert dcp_local_seq_lens([10], 2, 1, 2) == [4]


def test_c128a_D5_validity_under_dcp():
    rows, lens, _ = c128([1023] * 3, 3, [0, 0, 0], BT_D[:1], 2, [-1, 0, -1], 16,
                         dcp_world_size=2, dcp_rank=0, num_valid_tokens=2)
    assert lens == [4, 4, 0]
    assert rows == [pad([60, 61, 62, 63], 16)] * 2 + [[NEG] * 16]
    # None = all valid; slot_mapping ignored under DCP
    _, lens, _ = c128([1023] * 3, 3, [0, 0, 0], BT_D[:1], 2, [-1, 0, -1], 16,
                      dcp_world_size=2, dcp_rank=0)
    assert lens == [4, 4, 4]


def test_c128a_P1_padding_row_all_minus_one():
    rows, lens, pf = c128([255, 511, 383, 639], 2, [0, 1, 0, 1], [[3], [5]], 512,
                          [0, -1, 2, 3], 4)
    assert rows == [[1536, 1537, -1, -1], [-1, -1, -1, -1]]
    assert lens == [2, 0]
    assert pf == [[0, 1, 2, -1], [0, 1, 2, 3]]


def test_c128a_P2():
    rows, lens, pf = c128([1000, 300, 300], 2, [0, 1, 1], [[7, 3, 9, 4], [2, 2, 2, 2]], 2,
                          [5, -1, 9], 128)
    assert rows == [pad([14, 15, 6, 7, 18, 19, 8], 128), [NEG] * 128]
    assert lens == [7, 0]
    assert pf == [pad([0, 1], 128)]


def test_c128a_P3_stale_position_padding_token():
    rows, lens, pf = c128([1_048_575], 1, [0], [[9]], 2, [-1], 8192)
    assert rows == [[NEG] * 8192] and lens == [0] and pf == []


def test_c128a_request_and_column_bounds():
    # request outside the table -> all -1, len 0; columns past the row -> skipped
    rows, lens, _ = c128([1023, 1023, 1023, 1023], 4, [1, -1, 0, 0], [[4, 6]], 2,
                         [0, 0, 0, 0], 8, dcp_world_size=1)
    assert rows[0] == [NEG] * 8 and rows[1] == [NEG] * 8
    assert rows[2] == pad([8, 9, 12, 13], 8) and lens == [0, 0, 4, 4]
    # world 2 rank 1, bt one column (V = 4 rows): e = 1, 3 addressable, 5, 7 skipped
    rows, lens, _ = c128([1023], 1, [0], [[4]], 2, [0], 8, dcp_world_size=2, dcp_rank=1)
    assert rows == [pad([8, 9], 8)] and lens == [2]


def test_c128a_negative_position_and_width_clamp():
    # p = -300: c_div(-299, 128) = -2 -> n = 0; p = 5000: n = 39 clamped to width 4
    rows, lens, pf = c128([-300, 5000, -300, 5000], 2, [0, 0, 0, 0], [[1, 2, 3]], 2,
                          [0, 0, 0, 0], 4)
    assert rows == [[NEG] * 4, [2, 3, 4, 5]] and lens == [0, 4]
    assert pf == [[NEG] * 4, [0, 1, 2, 3]]


def test_c128a_int32_wrap():
    # 1_500_000_000 * 2 = 3_000_000_000 -> 3e9 - 2^32 = -1_294_967_296
    rows, lens, _ = c128([255], 1, [0], [[1_500_000_000]], 2, [0], 2)
    assert rows == [[-1_294_967_296, -1_294_967_295]] and lens == [2]


def test_c128a_world1_matches_old_reference():
    rng = random.Random(5)
    for _ in range(100):
        T = rng.randint(1, 6)
        nd = rng.randint(0, T)
        R = 3
        bt = [[rng.randint(0, 50) for _ in range(16)] for _ in range(R)]
        pos = [rng.randint(0, 2 * 128 * 16) for _ in range(T)]
        t2r = [rng.randrange(R) for _ in range(T)]
        slots = [rng.choice([-1, 3, 7]) for _ in range(T)]
        width = rng.choice([8, 16, 32])
        og, ol, op = ref.c128a_topk(pos, 128, nd, t2r, bt, 2, slots, width)
        ng, nl, np_ = c128a_topk_v2(pos, 128, nd, t2r, bt, 2, slots, width)
        assert nl == ol and np_ == op
        for t in range(nd):
            assert ng[t] == (og[t] if slots[t] >= 0 else [NEG] * width)


def test_c128a_dcp_union_and_counts():
    # lengths per rank = dcp_local_seq_lens(n); sum over ranks = n (union is 0..n-1)
    bt = [list(range(100, 140))]
    for world, I, bs in [(2, 1, 2), (4, 1, 2), (2, 2, 4), (4, 2, 8), (3, 1, 1)]:
        for p in [0, 127, 128, 1023, 2047, 4095, 5000]:
            n = min((p + 1) // 128, 64)
            tot = 0
            for rank in range(world):
                _, lens, _ = c128([p], 1, [0], bt, bs, [0], 64, dcp_world_size=world,
                                  dcp_rank=rank, interleave=I)
                assert lens == dcp_local_seq_lens([n], world, rank, I)
                tot += lens[0]
            assert tot == n


# ====================================================================== parity §2 D6 (local lens)
def test_dcp_local_seq_lens_D6():
    assert dcp_local_seq_lens([7], 4, None, 1) == [[2, 2, 2, 1]]
    assert dcp_local_seq_lens([1], 4, None, 1) == [[1, 0, 0, 0]]
    assert dcp_local_seq_lens([7, 1], 4, 3) == [1, 0]
    assert dcp_local_seq_lens([0, 5], 2, None, 2) == [[0, 0], [3, 2]]


def test_dcp_local_seq_lens_formula():
    # parity §2: base = (s // I // Wd) * I; local = base + clip(s - base*Wd - r*I, 0, I)
    for Wd in range(1, 5):
        for I in (1, 2, 4):
            for s in range(0, 200, 7):
                for r in range(Wd):
                    base = (s // I // Wd) * I
                    local = base + min(max(s - base * Wd - r * I, 0), I)
                    assert dcp_local_seq_lens([s], Wd, r, I) == [local]


# ====================================================================== parity §4 (slot mapping)
def test_slot_mapping_C1_and_rule_D():
    out = compressed_slot_mapping_v2(133, [0, 133], [260], [[7, 9]], 2, 128, 133)
    expect = [NEG] * 133
    expect[0], expect[128] = 14, 15
    assert out == expect
    tsm = [-1] + [0] * 132
    out = compressed_slot_mapping_v2(133, [0, 133], [260], [[7, 9]], 2, 128, 133,
                                     token_slot_mapping=tsm)
    expect[0] = NEG
    assert out == expect
    # rule D holds under CP too (vLLM 0.34): rank 0 owns state 0, but the token's slot is -1
    out = compressed_slot_mapping_v2(133, [0, 133], [260], [[7, 9]], 2, 128, 133,
                                     cp_world_size=2, cp_rank=0, token_slot_mapping=tsm)
    assert out[0] == NEG and out[128] == NEG
    # only -1 marks a token without a slot: -5 is a slot like any other
    out = compressed_slot_mapping_v2(133, [0, 133], [260], [[7, 9]], 2, 128, 133,
                                     token_slot_mapping=[-5] + [0] * 132)
    assert out[0] == 14


def test_slot_mapping_C2_world2_ratio4():
    out0 = compressed_slot_mapping_v2(16, [0, 16], [16], [[3, 8]], 64, 4, 16,
                                      cp_world_size=2, cp_rank=0)
    e0 = [NEG] * 16
    e0[3], e0[11] = 192, 193
    assert out0 == e0
    out1 = compressed_slot_mapping_v2(16, [0, 16], [16], [[3, 8]], 64, 4, 16,
                                      cp_world_size=2, cp_rank=1)
    e1 = [NEG] * 16
    e1[7], e1[15] = 192, 193
    assert out1 == e1


def test_slot_mapping_C3_world2_ratio128():
    bt = [[30, 31, 32, 33]]
    out0 = compressed_slot_mapping_v2(1024, [0, 1024], [1024], bt, 2, 128, 1024,
                                      cp_world_size=2, cp_rank=0)
    e0 = [NEG] * 1024
    e0[127], e0[383], e0[639], e0[895] = 60, 61, 62, 63
    assert out0 == e0
    out1 = compressed_slot_mapping_v2(1024, [0, 1024], [1024], bt, 2, 128, 1024,
                                      cp_world_size=2, cp_rank=1)
    e1 = [NEG] * 1024
    e1[255], e1[511], e1[767], e1[1023] = 60, 61, 62, 63
    assert out1 == e1


def test_slot_mapping_upstream_8_1_regression():
    # 40 tokens at positions 240..279, ratio 4, storage block 64: rows 60..69
    out = compressed_slot_mapping_v2(40, [0, 40], [280], [[5, 7]], 64, 4, 40)
    expect = [NEG] * 40
    for j, s in zip(range(3, 40, 4), [380, 381, 382, 383, 448, 449, 450, 451, 452, 453]):
        expect[j] = s
    assert out == expect


def test_slot_mapping_num_tokens_and_guards():
    # two requests, ratio 2, storage bs 2: req 0 positions 0..3 (closing 1, 3 -> c 0, 1);
    # req 1 positions 4..7 (closing 5, 7 -> c 2, 3 -> column 1)
    qsl, seq = [0, 4, 8], [4, 8]
    bt = [[5, 6], [-3, 9]]
    assert compressed_slot_mapping_v2(8, qsl, seq, bt, 2, 2, 10) == \
        [NEG, 10, NEG, 11, NEG, 18, NEG, 19, NEG, NEG]
    # num_tokens 6: indices >= 6 stay -1
    assert compressed_slot_mapping_v2(6, qsl, seq, bt, 2, 2, 10) == \
        [NEG, 10, NEG, 11, NEG, 18, NEG, NEG, NEG, NEG]
    # block table with one column: req 1's c = 2, 3 are past it -> -1; clamped entry -3 -> 0
    assert compressed_slot_mapping_v2(8, qsl, seq, [[5], [-3]], 2, 2, 8) == \
        [NEG, 10, NEG, 11, NEG, NEG, NEG, NEG]
    assert compressed_slot_mapping_v2(8, [0, 4, 6], [4, 2], [[5], [-3]], 2, 2, 8) == \
        [NEG, 10, NEG, 11, NEG, 0, NEG, NEG]
    # more block-table rows than requests: extra rows ignored
    assert compressed_slot_mapping_v2(4, [0, 4], [4], [[5, 6], [1, 1], [2, 2]], 2, 2, 4) == \
        [NEG, 10, NEG, 11]
    # graph padding request with L < q (negative positions) -> -1
    assert compressed_slot_mapping_v2(3, [0, 3], [2], [[4]], 2, 2, 3) == [NEG, NEG, 8]


def test_slot_mapping_matches_old_reference():
    rng = random.Random(3)
    for _ in range(60):
        R = rng.randint(1, 4)
        ql = [rng.randint(0, 20) for _ in range(R)]
        qsl = [0]
        for q in ql:
            qsl.append(qsl[-1] + q)
        seq = [q + rng.randint(0, 60) for q in ql]
        bt = [[rng.randint(-1, 30) for _ in range(40)] for _ in range(R)]
        cp = rng.choice([(1, 0, 1), (2, 1, 1), (4, 2, 2)])
        n = qsl[-1]
        old = ref.compressed_slot_mapping(n, qsl, seq, bt, 4, 4, n + 3, *cp)
        new = compressed_slot_mapping_v2(n, qsl, seq, bt, 4, 4, n + 3, *cp)
        assert new == old


# ====================================================================== upstream §2 (SWA)
def test_swa_small_window():
    rows, lens = swa_indices_and_lens(4, [0, 1, 3], [3, 6], [0, 1, 1], [True] * 3,
                                      [[10, 11], [20, 21, 22]], 2)
    assert rows == [[20, 21, 22, -1], [41, 42, 43, 44], [42, 43, 44, 45]]
    assert lens == [3, 4, 4]


def test_swa_token_offset_padding_and_unaddressable():
    rows, lens = swa_indices_and_lens(4, [0, 2, 3], [2, 5], [0, 0, 1, 0],
                                      [True, True, True, False], [[7], [4, 9]], 2,
                                      token_offset=1, num_rows=3)
    assert rows == [[14, 15, -1, -1], [9, 18, 19, -1], [-1, -1, -1, -1]]
    assert lens == [2, 3, 0]


BT_SWA = [3, 5, 8, 13]   # blocks of 64: positions 0..63 -> 192.., 64.. -> 320.., 128.. -> 512..,
                         # 192.. -> 832..


@pytest.mark.parametrize("p,expect", [
    (0, pad([192], 128)),
    (1, pad([192, 193], 128)),
    (126, pad(list(range(192, 256)) + list(range(320, 383)), 128)),
    (127, list(range(192, 256)) + list(range(320, 384))),
    (128, list(range(193, 256)) + list(range(320, 384)) + [512]),
    (255, list(range(512, 576)) + list(range(832, 896))),
])
def test_swa_golden_positions(p, expect):
    rows, lens = swa_indices_and_lens(128, [0, 1], [p + 1], [0], [True], [BT_SWA], 64)
    assert rows == [expect]
    assert lens == [min(p + 1, 128)]


def test_swa_mtp_decode_rows():
    rows, lens = swa_indices_and_lens(128, [0, 3], [130], [0, 0, 0], [True] * 3, [BT_SWA], 64)
    assert rows == [list(range(192, 256)) + list(range(320, 384)),
                    list(range(193, 256)) + list(range(320, 384)) + [512],
                    list(range(194, 256)) + list(range(320, 384)) + [512, 513]]
    assert lens == [128, 128, 128]


def test_swa_negative_position_and_bad_request():
    # L < q: token 0 at p = -1 -> all -1 / 0; token 1 at p = 0
    rows, lens = swa_indices_and_lens(4, [0, 2], [1], [0, 0], [True, True], [[6]], 2)
    assert rows == [[-1] * 4, [12, -1, -1, -1]] and lens == [0, 1]
    rows, lens = swa_indices_and_lens(4, [0, 2], [2], [5, -1], [True, True], [[6]], 2)
    assert rows == [[-1] * 4, [-1] * 4] and lens == [0, 0]


# ====================================================================== upstream §4 (global top-k)
TOPK_A = [[0, 5, -1, 9, 7], [3, 4, -1, 0, 2143289344], [1, 2, 3, 4, 5], [0, 1, 2, 3, 4],
          [0, 1, 2, 3, 4]]
T2R_A = [0, 1, 0, 2, -1]
VALID_A = [True, True, False, True, True]
BT_A = [[2, 5], [7, 1]]


def test_global_topk_in_place():
    rows, lens = global_topk_indices_and_lens(TOPK_A, T2R_A, BT_A, 4, VALID_A)
    assert rows == [[8, 21, -1, -1, 23], [31, 4, -1, 28, -1], [-1] * 5, [-1] * 5, [-1] * 5]
    assert lens == [3, 3, 0, 0, 0]


def test_global_topk_compact():
    rows, lens = global_topk_indices_and_lens(TOPK_A, T2R_A, BT_A, 4, VALID_A, compact=True)
    assert rows == [[8, 21, 23, -1, -1], [31, 4, 28, -1, -1], [-1] * 5, [-1] * 5, [-1] * 5]
    assert lens == [3, 3, 0, 0, 0]


def test_global_topk_wrap_and_empty_table():
    # 300_000_000 * 8 + 3 = 2_400_000_003 -> 2_400_000_003 - 2^32 = -1_894_967_293
    rows, lens = global_topk_indices_and_lens([[3, 8, -1]], [0], [[300_000_000]], 8, [True])
    assert rows == [[-1_894_967_293, -1, -1]] and lens == [1]
    rows, lens = global_topk_indices_and_lens([[0, 1]], [0], [], 8, [True])
    assert rows == [[-1, -1]] and lens == [0]


# ====================================================================== upstream §5 (short ctx)
def test_fill_short_context_small():
    rows = fill_short_context_topk_indices([0, 3, 7, 100, -5], 4, 4)
    assert rows == [[-1, -1, -1, -1], [0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, 3],
                    [-1, -1, -1, -1]]
    assert fill_short_context_topk_indices([0, 3, 7, 100, -5], 4, 4, num_tokens=2) == \
        [[-1, -1, -1, -1], [0, -1, -1, -1]]


@pytest.mark.parametrize("top_k", [512, 1024])
def test_fill_short_context_positions(top_k):
    rows = fill_short_context_topk_indices([0, 2, 3, 4, 2047], top_k, 4)
    assert rows[0] == [-1] * top_k and rows[1] == [-1] * top_k
    assert rows[2] == pad([0], top_k) and rows[3] == pad([0], top_k)
    assert rows[4] == pad(range(512), top_k)


# ====================================================================== upstream §6 (combine)
TOPK_C1 = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]


def test_combine_upstream_case1():
    rows, lens = combine_topk_swa_indices(TOPK_C1, [0, 2, 3], [8, 10], [8, 10], 4, 2, 4, 64, 16)
    assert rows == [pad([1, 2, 3, 19, 20, 21, 22], 128),
                    pad([5, 6, 7, 8, 20, 21, 22, 23], 128),
                    pad([73, 74, 75, 76, 86, 87, 88, 89], 128)]
    assert lens == [7, 8, 8]


def test_combine_upstream_case2_short_gather_and_filter():
    topk = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3], [4, 5, 6, 7]]
    rows, lens = combine_topk_swa_indices(topk, [0, 3, 5], [6, 4], [4, 3], 3, 2, 4, 20, 8)
    assert rows == [pad([0, 1, 8, 9], 128),
                    pad([4, 5, 8, 9, 10], 128),
                    pad([-1, -1, -1, 9, 10, 11], 128),   # x >= N -> -1, still counted
                    pad([20, 28, 29], 128),
                    pad([24, 25, 28, 29, 30], 128)]
    assert lens == [4, 5, 6, 3, 5]


def test_combine_swa_only():
    rows, lens = combine_topk_swa_indices([[], [], [], []], [0, 4], [4], [4], 128, 0, 0, 0, 0)
    assert rows == [pad([0], 128), pad([0, 1], 128), pad([0, 1, 2], 128),
                    pad([0, 1, 2, 3], 128)]
    assert lens == [1, 2, 3, 4]


def test_combine_rebased_qsl_and_rows_past_total():
    topk = TOPK_C1 + [[1, 2, 3, 4], [1, 2, 3, 4]]
    rows, lens = combine_topk_swa_indices(topk, [17, 19, 20], [8, 10], [8, 10], 4, 2, 4, 64, 16)
    assert rows[:3] == [pad([1, 2, 3, 19, 20, 21, 22], 128),
                        pad([5, 6, 7, 8, 20, 21, 22, 23], 128),
                        pad([73, 74, 75, 76, 86, 87, 88, 89], 128)]
    assert rows[3:] == [[-1] * 128, [-1] * 128]
    assert lens == [7, 8, 8, 0, 0]


def test_combine_negative_position_zero_length_request_and_width():
    # L < q: p = -2, -1, 0; a zero-length request first (b = 1 holds the tokens)
    rows, lens = combine_topk_swa_indices([[0, 1], [0, 1], [0, 1]], [0, 0, 3], [5, 1],
                                          [5, 1], 4, 2, 2, 10, 4)
    assert rows == [[-1] * 128, [-1] * 128, pad([14], 128)]
    assert lens == [0, 0, 1]
    # topk + W = 130 -> C = 256; C128A-style local rows 0..n-1
    rows, lens = combine_topk_swa_indices([list(range(126))], [0, 1], [640], [129], 4, 128,
                                          126, 200, 5)
    # p = 639: k_len = 5 (x = 0..4 < N = 5), g0 = 511, swa_start = 636, s_len 4
    assert len(rows[0]) == 256
    assert rows[0] == pad([0, 1, 2, 3, 4, 130, 131, 132, 133], 256) and lens == [9]
    with pytest.raises(ValueError):
        combine_topk_swa_indices([[0, 1]], [0, 1], [4], [4], 4, 2, 3, 10, 4)


# ====================================================================== upstream §8.3 / §8.4
def test_prefill_gather_lens():
    assert prefill_gather_lens([0, 4, 8, 12, 16, 20], [80, 96, 112, 128, 144], 0, 5, 64) == \
        [67] * 5
    assert prefill_gather_lens([0, 1, 2, 12, 15], [50, 60, 10, 300], 2, 2) == [10, 130]
    # L < q -> prefix clamped to 0
    assert prefill_gather_lens([0, 1, 6], [9, 3], 1, 1, 4) == [5]


def test_prefill_chunk_plan_golden():
    assert prefill_chunk_plan([80, 96, 112, 128, 144], [4] * 5, 4, 4, 64, 1024, 128) == \
        [(0, 5, 36, 103)]


def test_prefill_chunk_plan_splits():
    # budget = 1 * (4 + 4 + 8) = 16; compressed [2,2,10,50,1], gather [5,5,5,4,4]
    assert prefill_chunk_plan([8, 8, 40, 200, 4], [2, 2, 2, 1, 1], 4, 1, 4, 16, 8) == \
        [(0, 2, 2, 7), (2, 3, 10, 15), (3, 4, 50, 54), (4, 5, 1, 5)]
    # SWA-only (r 1): budget 2 * (0 + 4 + 6) = 20
    assert prefill_chunk_plan([10, 10, 10], [3, 3, 3], 1, 2, 4, 100, 6) == [(0, 3, 0, 6)]
    assert prefill_chunk_plan([10, 10, 10], [5, 5, 5], 0, 2, 4, 100, 6) == \
        [(0, 2, 0, 8), (2, 3, 0, 8)]
    assert prefill_chunk_plan([], [], 4, 4, 64, 1024, 128) == []


# ====================================================================== upstream §8.1
def test_indexer_prefill_chunk_metadata():
    cu, tts, ks, ke, local = indexer_prefill_chunk_metadata([10, 13, 15], [10, 7], 4, 0, 5)
    assert local == cu
    assert cu == [0, 2, 3] and tts == [0, 0, 1]
    assert ks == [0, 0, 0, 2, 2] and ke == [2, 2, 2, 3, 3]
    _, _, ks, ke, _ = indexer_prefill_chunk_metadata([0, 3, 5], [10, 7], 4, 2, 4)
    assert ks == [0, 2] and ke == [2, 3]
    cu, tts, ks, ke, _ = indexer_prefill_chunk_metadata([0, 8], [8], 4, 0, 8)
    assert cu == [0, 2] and tts == [0, 0]
    assert ks == [0] * 8 and ke == [0, 0, 0, 1, 1, 1, 1, 2]
    with pytest.raises(ValueError):
        indexer_prefill_chunk_metadata([0, 8], [8], 4, 0, 9)


def test_indexer_prefill_ke_minus_ks_is_visible_rows():
    qsl, seq = [0, 5, 5, 12], [9, 3, 40]
    _, _, ks, ke, _ = indexer_prefill_chunk_metadata(qsl, seq, 4, 0, 12)
    pos = [4, 5, 6, 7, 8] + list(range(33, 40))
    assert [ke[i] - ks[i] for i in range(12)] == [(p + 1) // 4 for p in pos]


# ====================================================================== upstream §8.2
def test_indexer_decode_metadata_mixed():
    qsl = [0, 0, 2, 8, 8, 12]                    # query lens [0, 2, 6, 0, 4]
    bt = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    ctx, req, dl, rows, per_req = indexer_decode_metadata(qsl, [5, 9, 20, 3, 7], bt, 14, 4)
    assert per_req == [0, 2, 6, 0, 4]
    assert ctx == [2, 2, 3, 4, 4, 4, 4, 5, 1, 1, 1, 1, 0, 0]
    assert req == [1, 1, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 5, 6]
    assert dl == [1] * 14
    assert rows == [[3, 4]] * 2 + [[5, 6]] * 6 + [[9, 10]] * 4 + [[0, 0]] * 2


def test_indexer_decode_metadata_clamp_and_all_padding():
    ctx, req, dl, rows, _ = indexer_decode_metadata([0, 3], [1], [[7]], 4, 1)
    assert ctx == [0, 0, 1, 0] and req == [0, 0, 0, 1] and dl == [1] * 4
    assert rows == [[7], [7], [7], [0]]
    assert indexer_decode_metadata([0, 0, 0, 0], [0, 0, 0], [[1], [2], [3]], 0, 4) == \
        ([], [], [], [], [0, 0, 0])
    ctx, req, dl, rows, _ = indexer_decode_metadata([0, 0, 0, 0], [0, 0, 0], [[1], [2], [3]], 17, 4)
    assert ctx == [0] * 17 and req == list(range(3, 20)) and dl == [1] * 17
    assert rows == [[0]] * 17
