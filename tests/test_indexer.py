"""The indexer metadata on every array kind and the
prefill chunk plan (host): upstream's cases, a chunk not starting at 0,
query slices, num_compressed past or short of the total, padding tokens with
distinct ids, padded block-table strides, the zeroed tail of a longer length
buffer (vLLM #56562), and bad input."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4
from dsv4_cupy import geometry
from dsv4_cupy.device import sm_count

import reference_upstream as upstream
from conftest import GPU_KINDS, HAS_TORCH, KINDS, to_kind, to_numpy
from helpers import POISON, random_indexer_prefill_case, run_indexer_decode, run_indexer_prefill

I32, I64 = np.int32, np.int64


# --- prefill chunks -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_chunk_upstream_cases(kind):
    cu, token_to_seq, ks, ke, _ = run_indexer_prefill(kind, [10, 13, 15], [10, 7], 4, 0, 5)
    assert cu.tolist() == [0, 2, 3] and token_to_seq.tolist() == [0, 0, 1]
    assert ks.tolist() == [0, 0, 0, 2, 2] and ke.tolist() == [2, 2, 2, 3, 3]
    _, _, ks, ke, _ = run_indexer_prefill(kind, [0, 3, 5], [10, 7], 4, 2, 4)
    assert ks.tolist() == [0, 2] and ke.tolist() == [2, 3]
    _, _, ks, ke, _ = run_indexer_prefill(kind, [0, 8], [8], 4, 0, 8)
    assert ke.tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    _, _, ks, ke, _ = run_indexer_prefill(kind, [0, 5, 5, 12], [9, 3, 40], 4, 0, 12)
    positions = [4, 5, 6, 7, 8] + list(range(33, 40))
    assert (ke - ks).tolist() == [(p + 1) // 4 for p in positions]
    run_indexer_prefill(kind, [7], [], 4, 0, 0)                        # no request


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_chunk_random_against_the_reference(kind):
    rng = np.random.default_rng(12)
    for _ in range(15):
        run_indexer_prefill(kind, *random_indexer_prefill_case(rng))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,rank,interleave,want_ke,want_local", [
    (1, 0, 1, [1, 2, 3, 4, 5, 6, 7, 8], [0, 8]),
    (4, 0, 1, [1, 1, 1, 1, 2, 2, 2, 2], [0, 2]),
    (4, 1, 1, [0, 1, 1, 1, 1, 2, 2, 2], [0, 2]),
    (2, 1, 1, [0, 1, 1, 2, 2, 3, 3, 4], [0, 4]),
    (4, 0, 2, [1, 2, 2, 2, 2, 2, 2, 2], [0, 2])])
def test_dcp_localises_the_causal_bounds_as_vllm_034(kind, world, rank, interleave, want_ke,
                                                     want_local):
    # vLLM 0.34's test_sparse_prefill_dcp_metadata_localizes_causal_bounds (ratio 1, L = q = 8)
    cu, token_to_seq, ks, ke, local_cu = run_indexer_prefill(kind, [0, 8], [8], 1, 0, 8,
                                                             dcp=(world, rank, interleave))
    assert ks.tolist() == [0] * 8 and ke.tolist() == want_ke
    assert local_cu.tolist() == want_local and cu.tolist() == [0, 8]
    assert token_to_seq.tolist() == [0] * 8                 # the global layout


@pytest.mark.parametrize("kind", KINDS)
def test_shardq_positions_and_chunk_slices_of_vllm_034(kind):
    # ratio 4; requests 1..2 of qsl [0, 1, 6, 14, 14], L [9, 21, 40, 0] as a chunk
    qsl, seq = [1, 6, 14], [21, 40]
    cu, token_to_seq, ks, ke, _ = run_indexer_prefill(kind, qsl, seq, 4, 0, 13)
    assert ke.tolist() == [4, 4, 4, 5, 5, 13, 13, 13, 14, 14, 14, 14, 15]
    assert cu.tolist() == [0, 5, 15] and token_to_seq.tolist() == [0] * 5 + [1] * 10
    _, _, ks, ke, _ = run_indexer_prefill(kind, qsl, seq, 4, 3, 10)
    assert ks.tolist() == [0, 0, 5, 5, 5, 5, 5] and ke.tolist() == [5, 5, 13, 13, 13, 14, 14]
    positions = [16, 17, 18, 19, 20, 30, 31, 32, 33, 34, 35, 36, 39]
    _, _, _, ke, _ = run_indexer_prefill(kind, qsl, seq, 4, 0, 13, positions=positions)
    assert ke.tolist() == [4, 4, 4, 5, 5, 12, 13, 13, 13, 13, 14, 14, 15]
    rng = np.random.default_rng(5)
    for _ in range(8):
        case = random_indexer_prefill_case(rng)
        queries = case[0][-1] - case[0][0]
        world = int(rng.choice([1, 2, 4]))
        run_indexer_prefill(kind, *case, positions=rng.integers(0, 500, max(queries, case[4]))
                            .tolist(), dcp=(world, int(rng.integers(0, world)),
                                            int(rng.choice([1, 2, 4]))))


def test_indexer_prefill_chunk_tokens_is_vllm_034s():
    qsl = np.array([0, 1, 6, 14, 14], I32)
    assert d4.indexer_prefill_chunk_tokens(qsl, 1, 3) == (1, 14, False)
    assert d4.indexer_prefill_chunk_tokens(qsl, 1, 3, slice(3, 10)) == (4, 11, True)
    assert d4.indexer_prefill_chunk_tokens(qsl, 1, 3, slice(0, 4)) == (1, 5, False)
    assert d4.indexer_prefill_chunk_tokens(qsl, 1, 3, slice(5, 100)) == (6, 14, True)
    assert d4.indexer_prefill_chunk_tokens(qsl, 1, 3, None, True) == (1, 14, True)
    with pytest.raises(ValueError, match="end_idx: expected an int <= 4"):
        d4.indexer_prefill_chunk_tokens(qsl, 1, 5)
    with pytest.raises(TypeError, match="query_slice: expected a slice of step 1"):
        d4.indexer_prefill_chunk_tokens(qsl, 1, 3, slice(0, 4, 2))


@pytest.mark.parametrize("kind", KINDS)
def test_num_compressed_past_or_short_of_the_total_and_a_slice_past_the_tokens(kind):
    qsl, seq = to_kind(np.array([0, 3, 5], I32), kind), to_kind(np.array([10, 7], I32), kind)
    cu, token_to_seq, _, _, _ = d4.build_indexer_prefill_chunk_metadata(qsl, seq, 4, 0, 5,
                                                                     num_compressed=6)
    assert to_numpy(cu).tolist() == [0, 2, 3]
    assert to_numpy(token_to_seq).tolist() == [0, 0, 1, -1, -1, -1]   # -1 past the total
    _, token_to_seq, _, _, _ = d4.build_indexer_prefill_chunk_metadata(qsl, seq, 4, 0, 5,
                                                                    num_compressed=2)
    assert to_numpy(token_to_seq).tolist() == [0, 0]
    # Slice offsets past the chunk's 5 tokens get an empty range at the total.
    _, _, ks, ke, _ = d4.build_indexer_prefill_chunk_metadata(qsl, seq, 4, 3, 8,
                                                              num_compressed=3)
    assert to_numpy(ks).tolist() == [2, 2, 3, 3, 3] and to_numpy(ke).tolist() == [3, 3, 3, 3, 3]


# --- decode -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_decode_mixed_query_lengths_and_padding(kind):
    qsl = [0, 0, 2, 8, 8, 12]                                        # query lens [0, 2, 6, 0, 4]
    table = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    context, req_ids, decode, rows, _ = run_indexer_decode(kind, qsl, [5, 9, 20, 3, 7], table,
                                                           14, 4)
    assert context.tolist() == [2, 2, 3, 4, 4, 4, 4, 5, 1, 1, 1, 1, 0, 0]
    assert req_ids.tolist() == [1, 1, 2, 2, 2, 2, 2, 2, 4, 4, 4, 4, 5, 6]
    assert decode.tolist() == [1] * 14 and rows[12:].tolist() == [[0, 0]] * 2


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("query_lens", [[1], [6] * 16, [0, 2, 6, 0, 4], [0, 0, 0]])
@pytest.mark.parametrize("padding", [0, 17])
def test_decode_upstream_grid(kind, query_lens, padding):
    rng = np.random.default_rng(len(query_lens) + padding)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(int).tolist()
    seq = (np.array(query_lens) + rng.integers(0, 5000, len(query_lens))).tolist()
    # A row past one warp's piece (geometry.indexer_piece columns) with padding.
    columns = 9 if not padding else 1100
    table = rng.integers(0, 1 << 20, (len(query_lens), columns)).astype(I32)
    run_indexer_decode(kind, qsl, seq, table, qsl[-1] + padding, 4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("piece", [128, 256, geometry.WARP_PIECE])
def test_decode_rows_in_each_piece_width(kind, piece):
    """The GPU copies each row in pieces of 128, 256 or 512 columns, by the
    warps the step needs (geometry.indexer_piece): every width, on rows whose
    last piece is short and ends off a 16-byte vector, with padding tokens."""
    columns = 4099
    budget = geometry.NARROW_PIECE_WARPS_PER_SM * sm_count(0)
    num_tokens = {128: 1, 256: budget // geometry.warp_pieces(columns, 128) + 1,
                  geometry.WARP_PIECE: budget // geometry.warp_pieces(columns, 256) + 1}[piece]
    assert geometry.indexer_piece(num_tokens, columns, 0) == piece
    rng = np.random.default_rng(piece)
    num_reqs = max(num_tokens - 3, 1)
    qsl = list(range(num_reqs + 1)) if num_tokens > 1 else [0, 1]
    seq = rng.integers(1, 1 << 20, num_reqs).tolist()
    table = rng.integers(0, 1 << 20, (num_reqs, columns)).astype(I32)
    run_indexer_decode(kind, qsl, seq, table, num_tokens, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_clamps_negative_lengths_and_all_padding(kind):
    context, req_ids, _, rows, _ = run_indexer_decode(kind, [0, 3], [1], [[7]], 4, 1)
    assert context.tolist() == [0, 0, 1, 0] and req_ids.tolist() == [0, 0, 0, 1]
    context, req_ids, _, rows, _ = run_indexer_decode(kind, [0, 0, 0, 0], [0, 0, 0],
                                                   [[1], [2], [3]], 17, 4)
    assert req_ids.tolist() == list(range(3, 20)) and (rows == 0).all()
    run_indexer_decode(kind, [0, 0, 0, 0], [0, 0, 0], [[1], [2], [3]], 0, 4)


@pytest.mark.parametrize("length", [64, 70_000])
@pytest.mark.parametrize("kind", KINDS)
def test_decode_zeroes_the_whole_tail_of_a_longer_length_buffer(kind, length):
    """Past the tokens' rows the GPU's grid has a thread for each length (274
    blocks for 70,000), and none of them loops."""
    context = to_kind(np.full(length, POISON, I32), kind)
    d4.build_indexer_decode_metadata(
        to_kind(np.array([0, 2], I32), kind), to_kind(np.array([9], I32), kind),
        to_kind(np.ones((1, 3), I32), kind), 5, 4,
        out=(context, None, None, to_kind(np.full((5, 3), POISON, I32), kind), None))
    assert to_numpy(context).tolist() == [2, 2, 0, 0, 0] + [0] * (length - 5)
    # Without tokens the whole buffer is zeroed too.
    context = to_kind(np.full(length, POISON, I32), kind)
    d4.build_indexer_decode_metadata(
        to_kind(np.array([0], I32), kind), to_kind(np.zeros(0, I32), kind),
        to_kind(np.zeros((0, 3), I32), kind), 0, 4, out=(context, None, None, None, None))
    assert (to_numpy(context) == 0).all()


# --- decode layouts of vLLM 0.34 ------------------------------------------------------------
def run_native_decode(kind, qsl, seq_lens, max_decode_len, ratio, num_rows=None):
    """The native op into poisoned buffers wider and longer than the result; checked
    against the reference, the allocating call and the poison past the result."""
    num_reqs = len(qsl) - 1
    rows = num_reqs if num_rows is None else num_rows
    args = (to_kind(np.array(qsl, I32), kind), to_kind(np.array(seq_lens, I32), kind),
            max_decode_len, ratio, num_rows)
    lens_buffer = to_kind(np.full((rows + 2, max_decode_len + 3), POISON, I32), kind)
    lens_view = lens_buffer[:, :max_decode_len + 1]                  # any row stride
    decode_buffer = to_kind(np.full(num_reqs + 2, POISON, I32), kind)
    got = d4.build_indexer_native_decode_metadata(*args, out=(lens_view, decode_buffer))
    lens_host, decode_host = to_numpy(lens_buffer), to_numpy(decode_buffer)
    assert (lens_host[rows:] == POISON).all() and (lens_host[:, max_decode_len:] == POISON).all()
    assert (decode_host[num_reqs:] == POISON).all()
    want = upstream.indexer_native_decode(list(qsl), list(seq_lens), max_decode_len, ratio, rows)
    np.testing.assert_array_equal(to_numpy(got[0]), np.array(want[0], I32).reshape(rows, max_decode_len))
    np.testing.assert_array_equal(to_numpy(got[1]), np.array(want[1], I32))
    for allocated, given in zip(d4.build_indexer_native_decode_metadata(*args), got):
        np.testing.assert_array_equal(to_numpy(allocated), to_numpy(given))
    return [to_numpy(x) for x in got]


# vLLM 0.34's indexer builder on sm_90, with DeepGEMM's native depths (1, 2, 4):
# (next_n, query lens, seq lens, num_decode_tokens, num_decodes, native lengths).
SM90_NATIVE_CASES = [
    (2, [2, 2, 2], [10, 7, 130], 6, 3, [[2, 2], [1, 1], [32, 32]]),
    (2, [2, 2, 0], [10, 7, 0], 6, 3, [[2, 2], [1, 1], [0, 0]]),
    (2, [2, 2, 5], [10, 7, 50], 4, 2, [[2, 2], [1, 1]]),
    (2, [1, 1], [10, 13], 2, 2, [[2], [3]]),
    (2, [2, 1, 2, 6], [10, 13, 20, 30], 2, 1, [[2, 2]]),
    (1, [1, 1, 0], [9, 13, 0], 4, 3, [[2], [3], [0], [0]]),
    (1, [1, 1, 12], [9, 13, 40], 2, 2, [[2], [3]]),
    (4, [4, 4, 0], [10, 20, 0], 10, 3, [[1, 2, 2, 2], [4, 4, 4, 5], [0, 0, 0, 0]]),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", SM90_NATIVE_CASES, ids=lambda c: f"n{c[0]}-q{c[1]}")
def test_native_decode_is_vllm_034s_sm90_layout(kind, case):
    next_n, query_lens, seq_lens, num_decode_tokens, num_decodes, want = case
    qsl = np.concatenate([[0], np.cumsum(query_lens[:num_decodes])]).tolist()
    decode_lens = query_lens[:num_decodes]
    if next_n == 1:                   # [num_decode_tokens, 1]: padding tokens' rows are 0
        lens, per_request = run_native_decode(kind, qsl, seq_lens, 1, 4, num_decode_tokens)
    else:
        lens, per_request = run_native_decode(kind, qsl, seq_lens, max(decode_lens), 4)
    assert lens.tolist() == want and per_request.tolist() == decode_lens


@pytest.mark.parametrize("kind", KINDS)
def test_native_decode_random_and_edges(kind):
    rng = np.random.default_rng(40)
    for _ in range(12):
        num_reqs = int(rng.integers(0, 9))
        depth = int(rng.integers(1, 6))
        query = rng.integers(0, depth + 1, num_reqs)
        seq = query + rng.integers(0, 3000, num_reqs)
        qsl = np.concatenate([[0], np.cumsum(query)]).tolist()
        run_native_decode(kind, qsl, seq.tolist(), depth, int(rng.choice([1, 4, 128])),
                          num_reqs + int(rng.integers(0, 4)))
    run_native_decode(kind, [0], [], 3, 4)                               # no request
    lens, _ = run_native_decode(kind, [0, 1], [2**31 - 1], 2, 1)        # int32 limits
    assert lens.tolist() == [[2**31 - 2, 2**31 - 1]]


def test_native_decode_refuses_bad_input_before_any_write():
    qsl, seq = np.array([0, 2, 5], I32), np.array([4, 9], I32)
    lens, decode = np.full((3, 4), POISON, I32), np.full(3, POISON, I32)
    for args, kwargs, match in [
        ((qsl, seq, 0, 4), {}, "max_decode_len: expected an int >= 1"),
        ((qsl, seq, 3, 4, 1), {}, "num_rows: expected an int >= 2"),
        ((qsl, seq[:1], 3, 4), {}, "seq_lens: expected at least 2"),
        ((qsl, seq, 5, 4), {}, r"out\[0\]: expected at least 5 columns"),
        ((qsl, seq, 2, 4), {"validate": "full"},
         r"max_decode_len: expected at least every request's query length, got 2 < 3"),
    ]:
        with pytest.raises(ValueError, match=match):
            d4.build_indexer_native_decode_metadata(*args, out=(lens, decode), **kwargs)
    assert (lens == POISON).all() and (decode == POISON).all()


@pytest.mark.parametrize("kind", KINDS)
def test_flat_decode_is_vllm_034s_flatten_producers(kind):
    # PrepareUniformDecodeKernel (every decode has next_n tokens): next_n 4, q [3, 3]
    lens, req_ids, ones, rows, per_req = run_indexer_decode(
        kind, [0, 3, 6], [10, 20], [[10, 11], [14, 15]], 6, 4)
    want_lens, want_rows = upstream.indexer_uniform_flatten([10, 20], [[10, 11], [14, 15]], 2, 3,
                                                            4)
    assert lens.tolist() == want_lens == [2, 2, 2, 4, 4, 5] and rows.tolist() == want_rows
    assert per_req.tolist() == [3, 3] and (ones == 1).all()
    # the torch varlen flatten (next_n 3 on sm_90): q [3, 1, 2, 0], 8 decode tokens
    qsl, seq, table = [0, 3, 4, 6, 6], [10, 13, 20, 0], [[10], [14], [18], [22]]
    lens, req_ids, _, rows, per_req = run_indexer_decode(kind, qsl, seq, table, 8, 4)
    want_lens, want_rows = upstream.indexer_torch_flatten(qsl, seq, table, 8, 4)
    assert lens.tolist() == want_lens == [2, 2, 2, 3, 4, 5, 0, 0]
    assert rows[:6].tolist() == want_rows[:6] and (rows[6:, 0] == 0).all()
    assert per_req.tolist() == [3, 1, 2, 0] and req_ids.tolist() == [0, 0, 0, 1, 2, 2, 4, 5]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("query_lens", [[1], [6] * 16, [0, 2, 6, 0, 4], [0, 0, 0]],
                         ids=["one", "sixteen", "mixed", "empty"])
@pytest.mark.parametrize("padding", [0, 17])
def test_fused_decode_metadata_cases_of_vllm_034(kind, query_lens, padding):
    # vLLM 0.34's test_fused_indexer_decode_metadata: seq = q + 4096, 65 of 74 table columns
    num_reqs, n = len(query_lens), sum(query_lens)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    table = np.arange(num_reqs * 74, dtype=I32).reshape(num_reqs, 74)[:, :65]
    lens, req_ids, ones, rows, per_req = run_indexer_decode(
        kind, qsl, [q + 4096 for q in query_lens], table, n + padding, 1)
    assert lens[:n].tolist() == [4096 + j + 1 for q in query_lens for j in range(q)]
    assert (lens[n:] == 0).all() and (ones == 1).all() and per_req.tolist() == query_lens
    owners = np.repeat(np.arange(num_reqs), query_lens)
    assert req_ids.tolist() == owners.tolist() + list(range(num_reqs, num_reqs + padding))
    np.testing.assert_array_equal(rows[:n], table[owners])
    assert (rows[n:] == 0).all()


# --- chunk plan ---------------------------------------------------------------------------
HOST_ARRAYS = [list, lambda x: np.array(x, I64)] + (
    [lambda x: __import__("torch").tensor(x, dtype=__import__("torch").int32)] if HAS_TORCH else [])


@pytest.mark.parametrize("host", HOST_ARRAYS, ids=["list", "numpy", "torch"][:len(HOST_ARRAYS)])
def test_chunk_plan_golden_and_splits(host):
    plan = d4.get_prefill_chunk_plan(host([80, 96, 112, 128, 144]), host([4] * 5), 4, 4, 64,
                                     1024, 128)
    assert plan == [(0, 5, 36, 103)] and all(type(x) is int for x in plan[0])
    assert d4.get_prefill_chunk_plan(host([8, 8, 40, 200, 4]), host([2, 2, 2, 1, 1]), 4, 1, 4,
                                     16, 8) == [(0, 2, 2, 7), (2, 3, 10, 15), (3, 4, 50, 54),
                                                (4, 5, 1, 5)]
    assert d4.get_prefill_chunk_plan(host([10, 10, 10]), host([5, 5, 5]), 0, 2, 4, 100, 6) == \
        [(0, 2, 0, 8), (2, 3, 0, 8)]
    assert d4.get_prefill_chunk_plan(host([]), host([]), 4, 4, 64, 1024, 128) == []


def test_chunk_plan_random_against_the_reference():
    rng = np.random.default_rng(21)
    for _ in range(300):
        count = int(rng.integers(0, 12))
        queries = rng.integers(0, 600, count)
        seq = (queries + rng.integers(0, 5000, count)).tolist()
        args = (int(rng.choice([0, 1, 4, 128])), int(rng.integers(1, 5)),
                int(rng.choice([1, 64, 128])), int(rng.integers(1, 9000)),
                int(rng.integers(0, 2000)))
        assert d4.get_prefill_chunk_plan(seq, queries.tolist(), *args) == \
            upstream.prefill_chunk_plan(seq, queries.tolist(), *args)


def test_chunk_plan_bad_input():
    for seq, queries, error, match in [
        ([10, 20], [1], ValueError, r"query_lens: expected one per request of seq_lens \(2\)"),
        ([10, -2], [1, 1], ValueError, r"seq_lens\[1\]: expected an int >= 0, got -2"),
        (np.array([10, 20]), np.array([1.0, 2.0]), TypeError, "query_lens: expected integers"),
        (np.array([[10]]), np.array([1]), ValueError, "seq_lens: expected a 1-D sequence"),
        (np.array([10, -1]), np.array([1, 1]), ValueError,
         "seq_lens: expected lengths >= 0, got -1 at index 1"),
        ("10", [1], TypeError, "seq_lens: expected a list or a host array"),
        ([10, 3], [1, 300], ValueError, r"seq_lens: expected seq_len >= query_len \(the context "
                                        r"includes the query\), got seq_len 3 < query_len 300 "
                                        r"for prefill 1"),
    ]:
        with pytest.raises(error, match=match):
            d4.get_prefill_chunk_plan(seq, queries, 4, 4, 64, 1024, 128)
    with pytest.raises(ValueError, match="chunk_size: expected an int >= 1, got 0"):
        d4.get_prefill_chunk_plan([10], [1], 4, 0, 64, 1024, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_device_arrays_that_would_sync_are_refused(kind):
    with pytest.raises(TypeError, match="seq_lens: expected a list or a host array"):
        d4.get_prefill_chunk_plan(to_kind(np.array([10], I32), kind), [1], 4, 4, 64, 1024, 128)
    with pytest.raises(ValueError, match="num_compressed: required for device arrays"):
        d4.build_indexer_prefill_chunk_metadata(to_kind(np.array([0, 3], I32), kind),
                                                to_kind(np.array([10], I32), kind), 4, 0, 3)


# --- bad input ---------------------------------------------------------------------------------
def test_indexer_bad_input_names_the_argument_and_writes_nothing():
    qsl, seq = np.array([0, 3, 5], I32), np.array([10, 7], I32)
    out = [np.full(n, POISON, I32) for n in (3, 3, 5, 5)]
    for kwargs, error, match in [
        (dict(query_slice_start=3, query_slice_stop=2), ValueError,
         "query_slice_stop: expected an int >= 3, got 2"),
        (dict(compress_ratio=0), ValueError, "compress_ratio: expected an int >= 1"),
        (dict(num_compressed=4), ValueError, r"out\[1\]: expected at least 4 elements"),
        (dict(seq_lens=np.array([10], I32)), ValueError, "seq_lens: expected at least 2"),
        (dict(validate="full", num_compressed=2), ValueError,
         r"num_compressed: expected sum\(seq_lens // 4\) = 3, got 2"),
        (dict(validate="full", query_slice_start=1, query_slice_stop=6), ValueError,
         "query_slice_stop: expected at most the chunk's 5 tokens, got 6"),
    ]:
        args = dict(query_start_loc=qsl, seq_lens=seq, compress_ratio=4, query_slice_start=0,
                    query_slice_stop=5, out=out)
        args.update(kwargs)
        with pytest.raises(error, match=match):
            d4.build_indexer_prefill_chunk_metadata(**args)
    assert all((buffer == POISON).all() for buffer in out)
    with pytest.raises(TypeError, match=r"out: expected a tuple of 5 arrays .*, got ndarray"):
        d4.build_indexer_prefill_chunk_metadata(qsl, seq, 4, 0, 5, out=np.zeros(4, I32))
    rows = np.full((4, 2), POISON, I32)
    for args, error, match in [
        ((qsl, seq, np.zeros((1, 2), I32), 4, 4), ValueError,
         "block_table: expected at least 2 rows"),
        ((qsl, seq, np.zeros((2, 2), I32), -1, 4), ValueError, "num_tokens: expected an int >= 0"),
        ((qsl, seq, np.zeros((2, 3), I32), 4, 4), ValueError,
         r"out\[3\]: expected at least 3 columns"),
        ((qsl, seq, np.zeros((2, 2), I32), 4, 4, "full"), ValueError,
         r"num_tokens: expected at least query_start_loc\[-1\] \(5\), got 4"),
    ]:
        with pytest.raises(error, match=match):
            d4.build_indexer_decode_metadata(*args[:5], out=(None, None, None, rows, None),
                                             validate=args[5] if len(args) > 5 else "default")
    assert (rows == POISON).all()
