"""Parity with newer vLLM (shared/spec/parity.md): every worked example on every
array kind, the short-extend split, padding rows, slot-mapping signatures and
decode context parallelism (brute force over world sizes, interleaves, ranks)."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

import reference as ref
import reference_upstream as upstream
from conftest import GPU_KINDS, HAS_TORCH, HOST_KINDS, KINDS, to_kind, to_numpy
from helpers import MAX_TOKENS, POISON, common_metadata, make_batch

I32, I64 = np.int32, np.int64
HOST_ARRAYS = ["numpy"] + (["torch_cpu"] if HAS_TORCH else [])


# --- the short-extend split ----------------------------------------------------------
SPLIT_CASES = [   # qsl, T, threshold, uniform, is_prefilling, flag False, flag True
    ("S1", [0, 1, 2], 2, 1, True, [False, True], (1, 1, 1, 1), (2, 0, 2, 0)),
    ("S2", [0, 2, 4, 6, 8], 8, 2, False, [False, False, True, False], (2, 2, 4, 4), (4, 0, 8, 0)),
    # parity.md's S3 flag-False answer was (3, 1, 6, 2); vLLM 0.34 no longer
    # counts a row of no tokens as a prefill under require_uniform.
    ("S3", [0, 2, 4, 6, 6], 8, 3, True, [False] * 4, (4, 0, 8, 0), (4, 0, 8, 0)),
    ("S4", [0, 1, 1], 1, 1, False, [True, False], (0, 2, 0, 1), None),
    ("S5", [0, 2, 4, 5, 105], 105, 2, False, [False, True, False, True], (1, 3, 2, 103),
     (3, 1, 5, 100)),
]


@pytest.mark.parametrize("kind", HOST_ARRAYS)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c[0])
def test_split_worked_examples(case, kind):
    _, qsl, total, threshold, uniform, prefilling, want_false, want_true = case
    q = np.array(qsl, I32)
    metadata = d4.CommonAttentionMetadata(
        query_start_loc=None, query_start_loc_cpu=to_kind(q, kind), seq_lens=None,
        block_table_tensor=None, slot_mapping=None, num_reqs=len(qsl) - 1,
        num_actual_tokens=total, max_query_len=int(np.diff(q).max()), max_seq_len=0,
        is_prefilling=to_kind(np.array(prefilling), kind))
    got = d4.split_decodes_and_prefills(metadata, threshold, uniform, False)
    assert got == want_false
    assert upstream.split_decodes_and_prefills_v2(qsl, total, int(np.diff(q).max()), threshold,
                                                  uniform, False, prefilling) == want_false
    if want_true is not None:
        assert d4.split_decodes_and_prefills(metadata, threshold, uniform) == want_true
    # a bare query_start_loc takes is_prefilling as a keyword
    bare = d4.split_decodes_and_prefills(to_kind(q, kind), threshold, uniform, False,
                                         is_prefilling=np.array(prefilling),
                                         num_actual_tokens=total)
    assert bare == want_false


def test_split_takes_the_threshold_positionally_and_an_empty_batch():
    assert d4.split_decodes_and_prefills(np.array([0, 1, 3], I32), 2) == (2, 0, 3, 0)
    assert d4.split_decodes_and_prefills(np.array([0], I32), 2, False, False) == (0, 0, 0, 0)


def test_split_without_is_prefilling_when_needed_is_a_clear_error():
    with pytest.raises(ValueError, match="is_prefilling: required when "
                                         "treat_short_extends_as_decodes is False"):
        d4.split_decodes_and_prefills(np.array([0, 1, 2], I32), 1, False, False)
    with pytest.raises(TypeError, match="is_prefilling: expected dtype bool"):
        d4.split_decodes_and_prefills(np.array([0, 1, 2], I32), 1, False, False,
                                      is_prefilling=np.array([0, 1], I32))


@pytest.mark.gpu
def test_split_refuses_a_device_is_prefilling():
    import cupy
    with pytest.raises(TypeError, match="is_prefilling: expected a host bool array"):
        d4.split_decodes_and_prefills(np.array([0, 1, 2], I32), 1, False, False,
                                      is_prefilling=cupy.zeros(2, bool))


@pytest.mark.parametrize("kind", KINDS)
def test_builder_passes_the_flag_and_is_prefilling(kind):
    batch = make_batch([1, 1, 1, 40], [500, 900, 3000, 0], threshold=1)
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 16, MAX_TOKENS, width_policy="capacity",
                                           treat_short_extends_as_decodes=False,
                                           like=to_kind(np.zeros(1, I32), kind))
    cm = common_metadata(batch, kind)
    cm.is_prefilling = np.array([False, True, False, True])
    md = builder.build(0, cm)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == (
        1, 3, 1, 42)
    want = upstream.c128a_topk_v2(batch.positions.tolist(), 128, 1, batch.token_map().tolist(),
                                  batch.block_table.tolist(), 2, batch.slot_mapping.tolist(),
                                  builder.capacity)
    np.testing.assert_array_equal(to_numpy(md.c128a_global_decode_topk_indices)[:, 0], want[0])
    np.testing.assert_array_equal(to_numpy(md.c128a_prefill_topk_indices), want[2])


# --- padding rows ---------------------------------------------------------------------
def run_c128a(kind, positions, nd, token_to_req, table, block_size, slots, width, **kwargs):
    gd = to_kind(np.full((nd + 2, width + 3), POISON, I32), kind)
    lens = to_kind(np.full(nd + 2, POISON, I32), kind)
    pf = to_kind(np.full((len(positions) - nd + 2, width + 3), POISON, I32), kind)
    d4.build_c128a_topk_metadata(
        to_kind(np.array(positions, I64), kind), 128, nd, to_kind(np.array(token_to_req, I32), kind),
        to_kind(np.array(table, I32), kind), block_size, to_kind(np.array(slots, I64), kind),
        gd, lens, pf, max_compressed_tokens=width, **kwargs)
    gd, lens, pf = to_numpy(gd), to_numpy(lens), to_numpy(pf)
    assert (gd[nd:] == POISON).all() and (gd[:, width:] == POISON).all()
    assert (lens[nd:] == POISON).all() and (pf[len(positions) - nd:] == POISON).all()
    return gd[:nd, :width], lens[:nd], pf[:len(positions) - nd, :width]


@pytest.mark.parametrize("kind", KINDS)
def test_padding_decode_row_is_all_minus_one(kind):
    gd, lens, pf = run_c128a(kind, [255, 511, 383, 639], 2, [0, 1, 0, 1], [[3], [5]], 512,
                             [0, -1, 2, 3], 4)
    assert gd.tolist() == [[1536, 1537, -1, -1], [-1, -1, -1, -1]]
    assert lens.tolist() == [2, 0] and pf.tolist() == [[0, 1, 2, -1], [0, 1, 2, 3]]


@pytest.mark.parametrize("kind", KINDS)
def test_padding_row_reads_no_table(kind):
    gd, lens, pf = run_c128a(kind, [1000, 300, 300], 2, [0, 1, 1],
                             [[7, 3, 9, 4], [2, 2, 2, 2]], 2, [5, -1, 9], 128)
    assert gd[0, :8].tolist() == [14, 15, 6, 7, 18, 19, 8, -1] and (gd[1] == -1).all()
    assert lens.tolist() == [7, 0] and pf[0, :3].tolist() == [0, 1, -1]


@pytest.mark.parametrize("kind", KINDS)
def test_padding_with_a_stale_huge_position_writes_minus_one_only(kind):
    gd, lens, _ = run_c128a(kind, [1_048_575], 1, [0], [[4]], 2, [-1], 8192)
    assert (gd == -1).all() and lens.tolist() == [0]


@pytest.mark.parametrize("kind", KINDS)
def test_padding_rows_as_vllm_034_writes_them(kind):
    # vLLM 0.34's BuildC128ATopkMetadataKernel: a padding token's row holds the slot ids its
    # (stale) position sees, at length 0
    gd, lens, pf = run_c128a(kind, [1000, 300, 300], 2, [0, 1, 0],
                             [[7, 3, 9, 4], [2, 2, 2, 2]], 2, [5, -1, 9], 128,
                             padding_rows="slots")
    assert gd[0, :8].tolist() == [14, 15, 6, 7, 18, 19, 8, -1]
    assert gd[1, :3].tolist() == [4, 5, -1] and (gd[1, 2:] == -1).all()
    assert lens.tolist() == [7, 0] and pf[0, :3].tolist() == [0, 1, -1]
    with pytest.raises(ValueError, match="padding_rows: expected one of"):
        run_c128a(kind, [1], 1, [0], [[1]], 2, [0], 128, padding_rows="vllm")


@pytest.mark.parametrize("kind", KINDS)
def test_builders_keep_vllms_padding_rows_on_request(kind):
    batch = make_batch([1, 1, 2], [70_000, 5_000, 1_000], pad_tokens=3, threshold=2)
    like = to_kind(np.zeros(1, I32), kind)
    default, keeping = (d4.DeepseekV4MetadataBuilder(128, 1 << 17, MAX_TOKENS,
                                                     num_speculative_tokens=1, like=like,
                                                     padding_rows=rows)
                        for rows in ("minus_one", "slots"))
    padding = np.flatnonzero(batch.slot_mapping < 0)
    batch.positions[padding] = 4_000                 # a stale position that sees 31 rows
    cm = common_metadata(batch, kind)
    kept = to_numpy(keeping.build(0, cm).c128a_global_decode_topk_indices)[:, 0]
    empty = to_numpy(default.build(0, cm).c128a_global_decode_topk_indices)[:, 0]
    lens = to_numpy(keeping.build(0, cm).c128a_decode_topk_lens)
    padding = padding[padding < len(lens)]
    assert padding.size and (lens[padding] == 0).all() and (empty[padding] == -1).all()
    assert (kept[padding, :31] >= 0).all() and (kept[padding, 31:] == -1).all()
    real = np.setdiff1d(np.arange(len(lens)), padding)
    np.testing.assert_array_equal(kept[real], empty[real])


# --- decode context parallelism ---------------------------------------------------------
D_TABLE = [[30 + 8 * i + j for j in range(8)] for i in range(3)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,rank,rows,lens", [
    (1, 0, [list(range(60, 68)), list(range(76, 92)), [92]], [8, 16, 1]),            # D1
    (2, 0, [[60, 61, 62, 63], list(range(76, 84)), [92]], [4, 8, 1]),                 # D2
    (2, 1, [[60, 61, 62, 63], list(range(76, 84)), []], [4, 8, 0]),
    (4, 0, [[60, 61], [76, 77, 78, 79], [92]], [2, 4, 1]),                             # D3
    (4, 3, [[60, 61], [76, 77, 78, 79], []], [2, 4, 0]),
])
def test_owned_rows_packed_to_the_front(kind, world, rank, rows, lens):
    gd, got_lens, _ = run_c128a(kind, [1023, 2047, 127], 3, [0, 1, 2], D_TABLE, 2, [0, 1, 2],
                                128, dcp_world_size=world, dcp_rank=rank)
    assert got_lens.tolist() == lens
    for row, want in zip(gd, rows):
        assert row[:len(want)].tolist() == want and (row[len(want):] == -1).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rank,want", [(0, [40, 41, 42, 43, 44, 45]), (1, [40, 41, 42, 43])])
def test_interleave_two(kind, rank, want):
    gd, lens, _ = run_c128a(kind, [1279], 1, [0], [list(range(10, 20))], 4, [0], 128,
                            dcp_world_size=2, dcp_rank=rank, cp_kv_cache_interleave_size=2)
    assert lens.tolist() == [len(want)] == [d4.get_dcp_local_seq_lens(10, 2, rank, 2)]
    assert gd[0, :len(want)].tolist() == want and (gd[0, len(want):] == -1).all()


@pytest.mark.parametrize("kind", KINDS)
def test_validity_under_dcp_is_num_valid_tokens_not_the_slot(kind):
    _, lens, _ = run_c128a(kind, [1023] * 3, 3, [0, 0, 0], D_TABLE, 2, [-1, 0, -1], 128,
                           dcp_world_size=2, dcp_rank=0, num_valid_tokens=2)
    assert lens.tolist() == [4, 4, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_get_dcp_local_seq_lens(kind):
    seq = to_kind(np.array([7, 1, 0, 13], I32), kind)
    assert to_numpy(d4.get_dcp_local_seq_lens(seq, 4)).tolist() == [
        [2, 2, 2, 1], [1, 0, 0, 0], [0, 0, 0, 0], [4, 3, 3, 3]]
    assert to_numpy(d4.get_dcp_local_seq_lens(seq, 4, 1)).tolist() == [2, 0, 0, 3]
    for s in range(0, 70):
        for world in (1, 2, 3, 4):
            for interleave in (1, 2, 4):
                assert d4.get_dcp_local_seq_lens(s, world, None, interleave) == \
                    upstream.dcp_local_seq_lens([s], world, None, interleave)[0]


def dcp_sweep(kind, worlds, interleaves):
    """Every rank's rows, mapped back to logical rows, cover each visible row of
    the single-rank row exactly once, with the single-rank local slot formula."""
    rng = np.random.default_rng(7)
    positions = [int(p) for p in rng.integers(0, 70_000, 12)] + [0, 127, 255, 65_535]
    nd = len(positions)
    width, bs = 640, 64
    table = rng.integers(0, 10_000, (nd, 20), dtype=I32)
    token_to_req = list(range(nd))
    single, single_lens, _ = run_c128a(kind, positions, nd, token_to_req, table, bs, [0] * nd,
                                       width)
    for world in worlds:
        for interleave in interleaves:
            if bs % interleave:
                continue
            seen = [[] for _ in range(nd)]
            for rank in range(world):
                gd, lens, _ = run_c128a(kind, positions, nd, token_to_req, table, bs, [0] * nd,
                                        width, dcp_world_size=world, dcp_rank=rank,
                                        cp_kv_cache_interleave_size=interleave)
                want = upstream.c128a_topk_v2(positions, 128, nd, token_to_req, table.tolist(),
                                              bs, [0] * nd, width, world, rank, interleave)
                np.testing.assert_array_equal(gd, want[0])
                np.testing.assert_array_equal(lens, want[1])
                for t in range(nd):
                    assert lens[t] == d4.get_dcp_local_seq_lens(int(single_lens[t]), world,
                                                                 rank, interleave)
                    for k in range(lens[t]):
                        e = (k // interleave * world + rank) * interleave + k % interleave
                        assert gd[t, k] == table[t, k // bs] * bs + k % bs
                        seen[t].append(e)
            for t in range(nd):
                assert sorted(seen[t]) == list(range(single_lens[t])), (world, interleave, t)


@pytest.mark.parametrize("kind", HOST_KINDS[:1])
def test_dcp_brute_force_every_world_interleave_and_rank_cpu(kind):
    dcp_sweep(kind, range(1, 9), (1, 2, 4, 8, 16, 32, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_dcp_brute_force_every_world_interleave_and_rank_gpu(kind):
    dcp_sweep(kind, range(1, 9), (1, 2, 4, 8, 16, 32, 64))


def test_dcp_interleave_must_divide_the_storage_block():
    with pytest.raises(ValueError, match="cp_kv_cache_interleave_size: expected a divisor of "
                                         "the storage block size 2"):
        run_c128a("numpy", [1023], 1, [0], D_TABLE, 2, [0], 128, dcp_world_size=2,
                  cp_kv_cache_interleave_size=4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,rank", [(2, 0), (2, 1), (4, 3)])
def test_builder_under_dcp_equals_the_ops(kind, world, rank):
    batch = make_batch([1, 1, 2, 30], [70_000, 5_000, 1_000, 9_000], pad_tokens=3, threshold=2)
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 17, MAX_TOKENS, width_policy="capacity",
                                           num_speculative_tokens=1, dcp_world_size=world,
                                           dcp_rank=rank, like=to_kind(np.zeros(1, I32), kind))
    md = builder.build(0, common_metadata(batch, kind))
    import reference as ref
    want = ref.build(128, 256, 1, builder.capacity, batch.qsl.tolist(), batch.seq_lens.tolist(),
                     batch.block_table.tolist(), batch.slot_mapping.tolist(),
                     batch.positions.tolist(), batch.num_tokens, batch.max_query_len, MAX_TOKENS,
                     dcp=(world, rank, 1))
    np.testing.assert_array_equal(to_numpy(builder.compressed_slot_mapping_buffer),
                                  want["slot_mapping"])
    nd = md.num_decode_tokens
    np.testing.assert_array_equal(to_numpy(md.c128a_global_decode_topk_indices)[:, 0],
                                  np.array(want["c128a_global_decode"]).reshape(nd, -1))
    np.testing.assert_array_equal(to_numpy(md.c128a_decode_topk_lens), want["c128a_decode_lens"])


# --- get_compressed_slot_mapping: vLLM 0.34's form ------------------------------------------
def slots(kind, num_tokens, own, qsl, seq, table, block_size, ratio, *args, **kwargs):
    """The op on ``kind`` arrays into a poisoned buffer two longer than the step;
    ``own`` (the tokens' slots) None or a list."""
    out = to_kind(np.full(num_tokens + 2, POISON, I64), kind)
    own = None if own is None else to_kind(np.array(own, I64), kind)
    table = np.asarray(table, I32)
    got = d4.get_compressed_slot_mapping(num_tokens, own, to_kind(np.array(qsl, I32), kind),
                                         to_kind(np.array(seq, I32), kind),
                                         to_kind(table, kind), block_size, ratio,
                                         out, *args, **kwargs)
    assert to_numpy(got).shape == (num_tokens,)
    return to_numpy(out)


@pytest.mark.parametrize("kind", KINDS)
def test_a_token_whose_own_slot_is_minus_one_gets_none(kind):
    # vLLM 0.34's test_compressed_slot_mapping_inherits_padded_token_slots
    own = list(range(8))
    own[:4] = [-1] * 4
    got = slots(kind, 8, own, [0, 8], [8], [[3]], 4, 2)
    np.testing.assert_array_equal(got, [-1, -1, -1, -1, -1, 14, -1, 15, -1, -1])
    assert (got == upstream.compressed_slot_mapping_034(8, own, [0, 8], [8], [[3]], 4, 2,
                                                        10)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_only_minus_one_marks_a_token_without_a_slot(kind):
    # vLLM 0.34's indexer builder test gives slots of -123: the rule is == -1, not < 0.
    # 40 tokens at positions 240..279, ratio 4, storage block 64: states 60..69
    got = slots(kind, 40, [-123] * 40, [0, 40], [280], [[5, 7]], 64, 4)
    assert [int(v) for v in got[:40] if v >= 0] == [*range(5 * 64 + 60, 5 * 64 + 64),
                                                    *range(7 * 64, 7 * 64 + 6)]
    np.testing.assert_array_equal(got, slots(kind, 40, None, [0, 40], [280], [[5, 7]], 64, 4))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rank", [0, 1])
def test_dcp_owner_from_the_tokens_slots_and_token_interleave(kind, rank):
    # vLLM 0.34's test_compressed_slot_mapping_dcp_uses_rank_local_state_positions:
    # W 2, I 4 tokens, ratio 2, block 4, 32 tokens; a token of another rank has slot -1.
    pos = np.arange(32)
    own = np.where((pos // 4) % 2 == rank, 0, -1)
    got = slots(kind, 32, own.tolist(), [0, 32], [32], [[5, 7]], 4, 2, 2, 4)   # positional
    state = (pos // 8 * 4 + pos % 4) // 2
    want = np.where(((pos // 4) % 2 == rank) & ((pos + 1) % 2 == 0),
                    np.array([5, 7])[np.minimum(state // 4, 1)] * 4 + state % 4, -1)
    np.testing.assert_array_equal(got[:32], want)
    np.testing.assert_array_equal(got, upstream.compressed_slot_mapping_034(
        32, own.tolist(), [0, 32], [32], [[5, 7]], 4, 2, 34, 2, 4))
    # the library's rank-explicit form agrees, with or without the slots
    explicit = slots(kind, 32, None, [0, 32], [32], [[5, 7]], 4, 2, 2, 4, dcp_rank=rank)
    np.testing.assert_array_equal(explicit, got)


@pytest.mark.parametrize("kind", KINDS[:1] + KINDS[len(HOST_KINDS):len(HOST_KINDS) + 1])
def test_slot_mapping_fuzz_against_vllm_034(kind):
    rng = np.random.default_rng(34)
    for trial in range(60):
        ratio = int(rng.choice([1, 2, 4, 128]))
        world = int(rng.choice([1, 1, 2, 4]))
        block = int(rng.choice([2, 4, 64]))
        interleave = ratio * int(rng.choice([d for d in (1, 2, 4) if block % d == 0]))
        num_reqs = int(rng.integers(0, 5))
        query = rng.integers(0, 40, num_reqs)
        seq = query + rng.integers(0, 600, num_reqs)
        qsl = np.concatenate([[0], np.cumsum(query)]).astype(int)
        T = int(qsl[-1]) + int(rng.integers(0, 4))
        cols = int(rng.integers(1, 6))
        table = rng.integers(-2, 50, (num_reqs, cols), dtype=I32)
        own = rng.choice([-1, 0, 7, -9], T).tolist()
        got = slots(kind, T, own, qsl.tolist(), seq.tolist(), table, block, ratio, world,
                    interleave)
        want = upstream.compressed_slot_mapping_034(T, own, qsl.tolist(), seq.tolist(),
                                                    table.tolist(),
                                                    block, ratio, T + 2, world, interleave)
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}")


def test_dcp_arguments_are_checked_before_any_write():
    out = np.full(18, POISON, I64)
    args = (16, np.zeros(16, I64), np.array([0, 16], I32), np.array([16], I32), np.array([[3, 8]], I32))
    with pytest.raises(ValueError, match="cp_interleave: expected a multiple of compress_ratio 4 "
                                         "when dcp_world_size > 1 .*, got 2"):
        d4.get_compressed_slot_mapping(*args, 64, 4, out, 2, 2)
    with pytest.raises(ValueError, match="slot_mapping: expected the tokens' slots"):
        d4.get_compressed_slot_mapping(16, None, *args[2:], 64, 4, out, 2, 4)
    with pytest.raises(ValueError, match="dcp_rank: expected an int <= 1"):
        d4.get_compressed_slot_mapping(*args, 64, 4, out, 2, 4, dcp_rank=2)
    assert (out == POISON).all()
    # one rank: the interleave changes nothing
    np.testing.assert_array_equal(d4.get_compressed_slot_mapping(*args, 64, 4, None, 1, 3),
                                  d4.get_compressed_slot_mapping(*args, 64, 4))


@pytest.mark.parametrize("kind", KINDS)
def test_world_two_ratio_128(kind):
    for rank, entries in ((0, [127, 383, 639, 895]), (1, [255, 511, 767, 1023])):
        got = slots(kind, 1024, None, [0, 1024], [1024], [[30, 31, 32, 33]], 2, 128, 2, 128,
                    dcp_rank=rank)
        assert {i: int(v) for i, v in enumerate(got[:1024]) if v >= 0} == dict(
            zip(entries, [60, 61, 62, 63]))


@pytest.mark.parametrize("kind", KINDS)
def test_tokens_at_or_past_num_tokens_get_no_slot(kind):
    got = slots(kind, 200, None, [0, 260], [260], [[7, 9, 11]], 2, 128)
    assert got[127] == 14 and (got[200:] == -1).all()


def test_c128a_width_defaults_to_8192_without_a_sync():
    gd, _, pf = d4.build_c128a_topk_metadata(np.array([5, 3000], I64), 128, 1,
                                            np.zeros(1, I32), np.zeros((1, 64), I32), 2,
                                            np.zeros(2, I64))
    assert gd.shape == (1, 8192) and pf.shape == (1, 8192)


@pytest.mark.parametrize("query_lens, threshold, uniform, tokens, want", [
    # vLLM 0.34's split (its own code, run on CPU; PARITY notes (g))
    ([2, 2, 2, 0], 3, True, 8, (4, 0, 8, 0)),
    ([2, 0, 2], 2, True, 4, (3, 0, 4, 0)),
    ([0, 2, 2], 2, True, 4, (1, 2, 0, 4)),
    ([0, 0], 2, True, 0, (2, 0, 0, 0)),
    ([0, 3], 2, True, 3, (1, 1, 0, 3)),
    ([0, 0, 5], 2, True, 5, (2, 1, 0, 5)),
    ([1, 0, 1], 1, True, 2, (3, 0, 2, 0)),
    ([2, 0, 1], 2, True, 3, (2, 1, 2, 1)),
    ([2, 0, 3], 3, True, 5, (2, 1, 2, 3)),
    ([2, 0, 3], 2, False, 5, (2, 1, 2, 3)),
    ([0, 1, 1], 1, False, 2, (3, 0, 2, 0)),
    ([], 1, False, 4, (0, 0, 4, 0)),
])
def test_split_is_vllm_034s(query_lens, threshold, uniform, tokens, want):
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(I32)
    got = d4.split_decodes_and_prefills(qsl, threshold, uniform, num_actual_tokens=tokens)
    assert got == want
    assert ref.split_decodes_and_prefills(qsl.tolist(), threshold, uniform, tokens) == want


def test_prefill_chunk_plan_has_compressed_is_vllm_034s():
    """vLLM 0.34's get_prefill_chunk_plan (PARITY notes (f)): has_compressed
    defaults to ratio > 1; True makes ratio-1 layers plan full-length rows."""
    seq, query = [80, 96, 112, 128, 144], [4] * 5
    assert d4.get_prefill_chunk_plan(seq, query, 4, 4, 64, 1024, 128) == [(0, 5, 36, 103)]
    assert d4.get_prefill_chunk_plan(seq, query, 4, 4, 64, 1024, 128, has_compressed=True) \
        == [(0, 5, 36, 103)]
    plain = d4.get_prefill_chunk_plan(seq, query, 1, 4, 64, 1024, 128)
    full = d4.get_prefill_chunk_plan(seq, query, 1, 4, 64, 1024, 128, has_compressed=True)
    assert plain == [(0, 5, 0, 67)]
    assert full == [(0, 5, 144, 144 + 67)]                 # N: the full-length rows
    with pytest.raises(ValueError, match="compress_ratio: expected at least 1"):
        d4.get_prefill_chunk_plan(seq, query, 0, 4, 64, 1024, 128, has_compressed=True)


@pytest.mark.parametrize("kind", KINDS)
def test_dcp_local_seq_lens_takes_a_device_rank(kind):
    """vLLM 0.34's get_dcp_local_seq_lens: an int32 rank array of the seq_lens'
    kind (PARITY notes (i): s [0, 1, 7, 8, 17], W 4, r 2, I 2 -> [0, 0, 2, 2, 4])."""
    seq = to_kind(np.array([0, 1, 7, 8, 17], I32), kind)
    for rank in (2, to_kind(np.array(2, I32), kind), to_kind(np.array([2], I32), kind)):
        got = d4.get_dcp_local_seq_lens(seq, 4, rank, 2)
        np.testing.assert_array_equal(to_numpy(got), [0, 0, 2, 2, 4])
    with pytest.raises(ValueError, match="dcp_rank: expected one int32 value"):
        d4.get_dcp_local_seq_lens(seq, 4, to_kind(np.array([2], I64), kind), 2)
    every = d4.get_dcp_local_seq_lens(seq, 4, None, 2)
    np.testing.assert_array_equal(to_numpy(every), [[0, 0, 0, 0], [1, 0, 0, 0], [2, 2, 2, 1],
                                                    [2, 2, 2, 2], [5, 4, 4, 4]])


def _slices(chunks):
    return [((r.start, r.stop), (q.start, q.stop)) for r, q in chunks]


@pytest.mark.parametrize("keys, queries, workspace, budget, want", [
    # vLLM 0.34's test_split_indexer_prefill_chunks, and PARITY notes (b)'s extras
    ([0], [0], 100, 1000, []),
    ([100, 100, 100], [10, 10, 10], 1000, 5000,
     [((0, 1), (0, 10)), ((1, 2), (0, 10)), ((2, 3), (0, 10))]),
    ([10, 10, 10], [5, 5, 5], 100, 10000, [((0, 3), (0, 15))]),
    ([50, 50, 50], [1, 1, 1], 50, 1000000, [((0, 1), (0, 1)), ((1, 2), (0, 1)), ((2, 3), (0, 1))]),
    ([10, 10, 10], [5, 5, 5], 100, 1000, [((0, 2), (0, 10)), ((2, 3), (0, 5))]),
    ([10, 10, 10], [5, 0, 5], 100, 1000, [((0, 2), (0, 5)), ((2, 3), (0, 5))]),
    ([300, 10], [4, 4], 100, 10 ** 9, [((0, 1), (0, 4)), ((1, 2), (0, 4))]),
])
def test_indexer_prefill_chunks_are_vllm_034s(keys, queries, workspace, budget, want):
    assert _slices(d4.split_indexer_prefill_chunks(keys, queries, workspace, budget)) == want
    shifted = d4.split_indexer_prefill_chunks(keys, queries, workspace, budget, request_offset=3)
    assert _slices(shifted) == [((a + 3, b + 3), q) for (a, b), q in want]


def test_indexer_prefill_chunks_single_request_overflow_and_fused_limits():
    chunks = _slices(d4.split_indexer_prefill_chunks([1000, 50], [100, 5], 2000, 1000))
    assert chunks == [((0, 1), (i, i + 1)) for i in range(100)] + [((1, 2), (0, 5))]
    fused = d4.split_indexer_prefill_chunks([1000, 2000, 3000], [9000, 9000, 100], 10 ** 7, 4096,
                                            fused_mqa_topk_eligible=True)
    assert _slices(fused) == [((0, 1), (0, 9000)), ((1, 3), (0, 9100))]
    assert d4.indexer_prefill_workspace_rows(1024, 1) == 40960
    assert d4.indexer_prefill_workspace_rows(1024, 4) == 10240
    assert d4.indexer_prefill_workspace_rows(1 << 20, 4) == 4194304
