"""compute_swa_indices_and_lens and compute_prefill_gather_lens
on every array kind: the golden positions, windows crossing a 64-token
block, MTP decodes, padding and zero-length requests, -1 table tails, prefill
rows after the decodes, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

import reference_upstream as upstream
from conftest import KINDS, to_kind, to_numpy
from helpers import POISON, random_swa_case, run_gather_lens, run_swa

I32 = np.int32
BT_SWA = [3, 5, 8, 13, -1, -1]   # blocks of 64 positions; a -1 tail past the used blocks


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("position", [0, 1, 63, 64, 126, 127, 128, 129, 191, 255])
def test_golden_positions_and_windows_crossing_a_block(kind, position):
    rows, lens = run_swa(kind, 128, [0, 1], [position + 1], [0], [True], [BT_SWA], 64)
    count = min(position + 1, 128)
    start = position + 1 - count
    want = [BT_SWA[(start + k) // 64] * 64 + (start + k) % 64 for k in range(count)]
    assert rows[0].tolist() == want + [-1] * (128 - count) and lens.tolist() == [count]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("query_len", [2, 3, 5, 8])
def test_mtp_decode_rows(kind, query_len):
    # Two MTP decode requests of query_len tokens each, the window crossing a block.
    seq = [130 + query_len, 64 + query_len]
    qsl = [0, query_len, 2 * query_len]
    token_to_req = [0] * query_len + [1] * query_len
    rows, lens = run_swa(kind, 128, qsl, seq, token_to_req, [True] * 2 * query_len,
                         [BT_SWA, [7, 9, 11, -1, -1, -1]], 64)
    assert lens.tolist() == [128] * query_len + [min(65 + j, 128) for j in range(query_len)]


@pytest.mark.parametrize("kind", KINDS)
def test_small_window_padding_zero_length_requests_and_token_offset(kind):
    # Requests: 2 decodes, a zero-length request, a 5-token prefill, then 2 padding tokens.
    qsl, seq = [0, 1, 2, 2, 7], [9, 3, 0, 12]
    token_to_req = [0, 1, 3, 3, 3, 3, 3, 0, 0]
    valid = [True] * 7 + [False] * 2
    table = [[4, 5, 6], [7, -1, -1], [-1, -1, -1], [8, 9, 10]]
    decode = run_swa(kind, 4, qsl, seq, token_to_req, valid, table, 4, 0, 2)
    assert decode[0].tolist() == [[21, 22, 23, 24], [28, 29, 30, -1]]
    prefill = run_swa(kind, 4, qsl, seq, token_to_req, valid, table, 4, token_offset=2)
    assert prefill[1].tolist() == [4, 4, 4, 4, 4, 0, 0]
    assert (prefill[0][5:] == -1).all()                           # padding rows: all -1


@pytest.mark.parametrize("kind", KINDS)
def test_unaddressable_rows_and_bad_requests(kind):
    # A table row too short for the window, a request outside the table and
    # seq_lens, a negative id, and L < q (negative position).
    rows, lens = run_swa(kind, 8, [0, 1, 2, 4], [20, 3, 1], [0, 1, 2, 3, -1, 2],
                         [True] * 6, [[1, 2], [3, 4], [5, 6]], 8)
    assert lens.tolist() == [4, 3, 0, 0, 0, 3]
    assert rows[0].tolist() == [20, 21, 22, 23, -1, -1, -1, -1]   # positions 12..15 of 12..19
    assert rows[5].tolist() == [40, 41, 42] + [-1] * 5
    assert (rows[2:5] == -1).all()


@pytest.mark.parametrize("kind", KINDS)
def test_random_steps_against_the_reference(kind):
    rng = np.random.default_rng(2)
    for _ in range(20):
        run_swa(kind, *random_swa_case(rng))


@pytest.mark.parametrize("kind", KINDS)
def test_a_two_d_buffer_and_int32_wrap(kind):
    indices = to_kind(np.full((2, 6), POISON, I32), kind)
    rows, lens = d4.compute_swa_indices_and_lens(
        2, to_kind(np.array([0, 1], I32), kind), to_kind(np.array([1], I32), kind),
        to_kind(np.zeros(1, I32), kind), to_kind(np.ones(1, bool), kind),
        to_kind(np.array([[1_500_000_000]], I32), kind), 2, out=(indices, None))
    assert tuple(rows.shape) == (1, 1, 2) and to_numpy(lens).tolist() == [1]
    assert to_numpy(indices)[0, :2].tolist() == [-1_294_967_296, -1]


# --- gather lengths -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_gather_lens(kind):
    assert run_gather_lens(kind, [0, 4, 8, 12, 16, 20], [80, 96, 112, 128, 144], 0, 5,
                           64).tolist() == [67] * 5
    assert run_gather_lens(kind, [0, 1, 2, 12, 15], [50, 60, 10, 300], 2, 2).tolist() == [10, 130]
    assert run_gather_lens(kind, [0, 1, 6], [9, 3], 1, 1, 4).tolist() == [5]      # L < q
    assert run_gather_lens(kind, [0, 1], [5], 1, 0).tolist() == []
    rng = np.random.default_rng(4)
    for _ in range(10):
        query_lens = rng.integers(0, 300, 6)
        qsl = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
        seq = (query_lens + rng.integers(0, 500, 6)).tolist()
        decodes = int(rng.integers(0, 7))
        run_gather_lens(kind, qsl, seq, decodes, int(rng.integers(0, 7 - decodes)),
                        int(rng.choice([1, 64, 128])))


# --- bad input ---------------------------------------------------------------------------------
def swa_args(**changes):
    args = dict(window_size=4, query_start_loc=np.array([0, 2], I32),
                seq_lens=np.array([9], I32), token_to_req_indices=np.zeros(2, I32),
                is_valid_token=np.ones(2, bool), block_table=np.array([[1, 2, 3]], I32),
                block_size=4, out=(np.full((3, 1, 5), POISON, I32), np.full(3, POISON, I32)))
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,error,match", [
    (dict(is_valid_token=np.ones(2, I32)), TypeError, "is_valid_token: expected dtype bool"),
    (dict(is_valid_token=np.ones(1, bool)), ValueError,
     "is_valid_token: expected at least 2 elements"),
    (dict(token_to_req_indices=np.zeros(2, np.int64)), TypeError,
     "token_to_req_indices: expected dtype int32"),
    (dict(block_table=np.zeros(3, I32)), ValueError, "block_table: expected a 2-D array"),
    (dict(window_size=0), ValueError, "window_size: expected an int >= 1, got 0"),
    (dict(block_size=0), ValueError, "block_size: expected an int >= 1"),
    (dict(token_offset=3), ValueError, "token_offset: expected an int <= 2, got 3"),
    (dict(num_rows=5), ValueError, "num_rows: expected an int <= 2, got 5"),
    (dict(out=(np.zeros((3, 2, 5), I32), np.zeros(3, I32))), ValueError,
     r"out\[0\]: expected shape \[rows, 1, cols\]"),
    (dict(out=(np.zeros((3, 1, 3), I32), np.zeros(3, I32))), ValueError,
     r"out\[0\]: expected at least 4 columns"),
    (dict(out=(np.zeros((3, 1, 5), I32),)), TypeError, "out: expected a tuple of 2 arrays"),
    (dict(validate="fast"), ValueError, "validate: expected one of"),
])
def test_bad_input_names_the_argument_and_writes_nothing(changes, error, match):
    args = swa_args(**changes)
    with pytest.raises(error, match=match):
        d4.compute_swa_indices_and_lens(**args)
    for buffer in swa_args()["out"]:
        assert (buffer == POISON).all()


def test_overlapping_outputs_and_mixed_kinds_are_refused():
    args = swa_args()
    lens = args["out"][1]
    with pytest.raises(ValueError, match=r"out\[1\]: output memory overlaps token_to_req_indices"):
        d4.compute_swa_indices_and_lens(**swa_args(token_to_req_indices=lens[:2].view(I32),
                                                   out=(args["out"][0], lens)))
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="seq_lens: expected a numpy array like query_start_loc"):
        d4.compute_swa_indices_and_lens(**swa_args(seq_lens=torch.tensor([9], dtype=torch.int32)))
    assert (args["out"][0] == POISON).all()


def test_full_validation():
    with pytest.raises(ValueError, match="token_to_req_indices: expected request ids in"):
        d4.compute_swa_indices_and_lens(**swa_args(token_to_req_indices=np.array([0, 1], I32),
                                                   validate="full"))
    with pytest.raises(ValueError, match="block_table: token 1 at position 8 needs block "
                                         "column 2"):
        d4.compute_swa_indices_and_lens(**swa_args(block_table=np.array([[1, 2]], I32),
                                                   validate="full"))
    with pytest.raises(ValueError, match="seq_lens: expected seq_len >= query_len"):
        d4.compute_swa_indices_and_lens(**swa_args(seq_lens=np.array([1], I32), validate="full"))
    d4.compute_swa_indices_and_lens(**swa_args(validate="full"))
    with pytest.raises(ValueError, match="num_decodes: expected an int >= 0"):
        d4.compute_prefill_gather_lens(np.array([0, 1], I32), np.array([3], I32), -1, 1)
    with pytest.raises(ValueError, match=r"query_start_loc: expected at least 3 elements "
                                         r"\(num_decodes \+ num_prefills \+ 1\), got shape"):
        d4.compute_prefill_gather_lens(np.array([0, 1], I32), np.array([3, 4], I32), 1, 1)
    with pytest.raises(ValueError, match=r"seq_lens: expected at least 2 elements "
                                         r"\(num_decodes \+ num_prefills\), got shape"):
        d4.compute_prefill_gather_lens(np.array([0, 1, 2], I32), np.array([3], I32), 1, 1)


# --- vLLM 0.34's windows: images, replay start, DSpark --------------------------------------
# test_deepseek_v4_swa_visible's CASES: (seq lens, query lens, inclusive image spans)
VISIBLE_CASES = [([30, 12], [30, 12], [[(4, 12), (20, 24)], []]),
                 ([26], [26], [[(2, 17)]]),
                 ([40, 9], [16, 9], [[(30, 38)], []]),
                 ([7, 15], [7, 15], [[(0, 6)], [(10, 14)]])]


def visible_batch(seq, queries):
    """That test's batch: all tokens valid, request r's block table r * blocks + k."""
    qsl = np.concatenate([[0], np.cumsum(queries)]).tolist()
    t2r = np.repeat(np.arange(len(queries)), queries).tolist()
    blocks = -(-max(seq) // 64)
    table = np.arange(len(queries) * blocks, dtype=I32).reshape(len(queries), blocks)
    return qsl, t2r, table


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", range(len(VISIBLE_CASES)))
def test_image_spans_widen_the_rows_as_in_vllm_034(kind, case):
    seq, queries, spans = VISIBLE_CASES[case]
    qsl, t2r, table = visible_batch(seq, queries)
    left, right = run_visibility(kind, qsl, seq, t2r, spans, 6)
    rows, lens = run_swa(kind, 8, qsl, seq, t2r, [True] * len(t2r), table, 64, index_width=14,
                         left_visible=left, right_visible=right)
    # that test's reference: the slots of [max(p - 7 - max(l - 7, 0), 0), p + r + 1)
    positions = [s - q + j for s, q in zip(seq, queries) for j in range(q)]
    for t, (p, b) in enumerate(zip(positions, t2r)):
        window = range(max(p - 7 - max(left[t] - 7, 0), 0), p + right[t] + 1)
        assert lens[t] == len(window)
        assert rows[t].tolist() == [table[b, x // 64] * 64 + x % 64 for x in window] + [-1] * (
            14 - len(window))
    plain = run_swa(kind, 8, qsl, seq, t2r, [True] * len(t2r), table, 64)
    no_image = run_swa(kind, 8, qsl, seq, t2r, [True] * len(t2r), table, 64, index_width=14)
    np.testing.assert_array_equal(no_image[0][:, :8], plain[0])
    assert (no_image[0][:, 8:] == -1).all() and (no_image[1] == plain[1]).all()


def run_visibility(kind, qsl, seq, t2r, spans, max_image_tokens, token_offset=0):
    """compute_image_visibility from the spans' CSR into poisoned buffers; checked
    against the reference; returns (left, right) as lists."""
    indptr, starts, ends = d4.image_span_csr(dict(enumerate(spans)), len(qsl) - 1)
    n = len(t2r)
    args = [to_kind(x, kind) for x in (indptr, starts, ends, np.array(qsl, I32),
                                       np.array(seq, I32), np.array(t2r, I32))]
    out = [to_kind(np.full(n + 3, POISON, I32), kind) for _ in range(2)]
    got = d4.compute_image_visibility(*args, max_image_tokens, token_offset, out=out)
    for buffer in out:
        assert (to_numpy(buffer)[n:] == POISON).all()
    left, right = (to_numpy(x).tolist() for x in got)
    want_left, want_right = upstream.image_visibility(qsl, seq, spans, max_image_tokens)
    assert left == [0] * token_offset + want_left[token_offset:]
    assert right == [0] * token_offset + want_right[token_offset:]
    same_again = d4.compute_image_visibility(*args, max_image_tokens, token_offset)
    assert [to_numpy(x).tolist() for x in same_again] == [left, right]
    return left, right


@pytest.mark.parametrize("kind", KINDS)
def test_image_visibility_is_vllm_034s(kind):
    seq, queries, spans = VISIBLE_CASES[0]
    qsl, t2r, _ = visible_batch(seq, queries)
    left, right = run_visibility(kind, qsl, seq, t2r, spans, 6)
    assert left[:13] == [0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 5, 5, 5]
    assert right[:13] == [0, 0, 0, 0, 6, 6, 6, 5, 4, 3, 2, 1, 0]
    run_visibility(kind, qsl, seq, t2r, spans, 6, token_offset=20)   # decodes before: 0, 0


def test_image_span_csr_and_its_refusals():
    indptr, starts, ends = d4.image_span_csr({0: [(4, 12), (20, 24)], 2: [(1, 1)]}, 3)
    assert indptr.tolist() == [0, 2, 2, 3] and starts.tolist() == [4, 20, 1]
    assert ends.tolist() == [12, 24, 1]
    assert [x.tolist() for x in d4.image_span_csr(None, 2)] == [[0, 0, 0], [], []]
    assert d4.image_span_csr({0: [(1, 2)], 5: [(3, 4)]}, 1)[1].tolist() == [1]   # as vLLM
    for ranges, error, match in (
            ({0: [(1, 2, 3)]}, ValueError, r"mm_req_doc_ranges\[0\]: expected \(start, end\) "
                                           r"pairs, got \(1, 2, 3\)"),
            ({0: [(10, 5)]}, ValueError, r"mm_req_doc_ranges\[0\]: expected 0 <= start <= end"),
            ({0: [(-1, 5)]}, ValueError, r"mm_req_doc_ranges\[0\]: expected 0 <= start"),
            ({0: [(0, 1 << 31)]}, ValueError, r"<= 2147483647 \(inclusive positions\)"),
            ({0: [0, 10]}, TypeError, r"mm_req_doc_ranges\[0\]: expected a list of \(start, "
                                      r"end\) int pairs, got \[0, 10\]"),
            ({0: [(0.5, 2)]}, TypeError, r"mm_req_doc_ranges\[0\]: expected a list"),
            ([[(0, 10)]], TypeError, r"mm_req_doc_ranges: expected a dict of request row -> "
                                     r"\[\(start, end\), \.\.\.\] or None, got list")):
        with pytest.raises(error, match=match):
            d4.image_span_csr(ranges, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_replay_start_bounds_the_window(kind):
    # vLLM 0.34's test_builder_replay_start_bounds_prefill_window_and_gather: window 8
    seq, queries = [40, 12, 30], [24, 12, 10]
    qsl, t2r, table = visible_batch(seq, queries)
    rows, lens = run_swa(kind, 8, qsl, seq, t2r, [True] * 46, table, 64,
                         replay_start=[12, 0, 0])
    assert lens[0] == 5 and lens[23] == 8              # position 16 sees 12..16
    gather = run_gather_lens(kind, qsl, seq, 0, 3, 8, replay_start=[12, 0, 0])
    assert gather.tolist() == [28, 12, 17]
    run_gather_lens(kind, [0, 1, 5, 9], [30, 9, 200], 1, 2, 128, replay_start=[3, 50, 150])
    # a replay start past the position: vLLM's length goes negative, here 0 and -1s
    rows, lens = run_swa(kind, 4, [0, 1, 13], [7, 12], [0] + [1] * 12, [True] * 13,
                         [[3, 5], [8, 9]], 8, replay_start=[0, 5])
    assert lens[1:9].tolist() == [0, 0, 0, 0, 0, 1, 2, 3] and (rows[1:6] == -1).all()
    assert rows[7].tolist() == [69, 70, -1, -1]


@pytest.mark.parametrize("kind", KINDS)
def test_dspark_noncausal_rows(kind):
    assert [d4.get_dspark_swa_index_width(*a) for a in ((128, 5), (512, 5), (1024, 0), (8, 4),
                                                         (-3, -1))] == [192, 576, 1024, 64, 0]
    rows, lens = run_swa(kind, 4, [0, 3], [9], [0, 0, 0], [True, True, False],
                         [[3, 5, 7]], 8, index_width=64, causal=False)
    assert lens.tolist() == [7, 7, 0]
    assert rows[0, :8].tolist() == [26, 27, 28, 29, 30, 31, 40, -1] and (rows[2] == -1).all()
    assert (rows[0] == rows[1]).all()
    # a replay start does not bound the non-causal rows (vLLM's DSpark kernel takes none)
    again = run_swa(kind, 4, [0, 3], [9], [0, 0, 0], [True, True, False], [[3, 5, 7]], 8,
                    index_width=64, causal=False, replay_start=[8], reference=False)
    np.testing.assert_array_equal(again[0], rows)


@pytest.mark.parametrize("kind", KINDS)
def test_extended_windows_random_against_the_reference(kind):
    rng = np.random.default_rng(31)
    for trial in range(12):
        queries = rng.integers(0, 30, int(rng.integers(1, 5)))
        seq = (queries + rng.integers(0, 300, queries.size)).tolist()
        qsl = np.concatenate([[0], np.cumsum(queries)]).tolist()
        t2r = np.repeat(np.arange(queries.size), queries).tolist() + [0, 0]
        valid = (rng.random(len(t2r)) < 0.9).tolist()
        window, block = int(rng.choice([4, 8, 128])), int(rng.choice([8, 64]))
        table = rng.integers(-1, 1000, (queries.size, int(rng.integers(1, 8))), dtype=I32)
        extensions = {"index_width": window + int(rng.integers(0, 20))}
        if trial % 3 == 0:
            extensions["left_visible"] = rng.integers(0, 20, len(t2r)).tolist()
            extensions["right_visible"] = rng.integers(0, 5, len(t2r)).tolist()
        if trial % 2 == 0:
            extensions["replay_start"] = rng.integers(0, 200, queries.size).tolist()
        if trial % 4 == 1:
            extensions["causal"] = False
        offset = int(rng.integers(0, 3))
        run_swa(kind, window, qsl, seq, t2r, valid, table, block, offset, **extensions)


def test_extended_window_refusals_write_nothing():
    args = (8, np.array([0, 2], I32), np.array([5], I32), np.zeros(2, I32),
            np.ones(2, bool), np.zeros((1, 1), I32), 64)
    out = (np.full((2, 1, 16), POISON, I32), np.full(2, POISON, I32))
    for kwargs, error, match in [
        ({"index_width": 4}, ValueError, "index_width: expected an int >= 8"),
        ({"left_visible": np.zeros(2, I32)}, ValueError, "right_visible: expected an int32"),
        ({"left_visible": np.zeros(1, I32), "right_visible": np.zeros(2, I32)}, ValueError,
         "left_visible: expected at least 2 elements"),
        ({"replay_start": np.zeros(1, np.int64)}, TypeError, "replay_start: expected dtype int32"),
        ({"causal": 0}, TypeError, "causal: expected a bool"),
        ({"index_width": 20}, ValueError, r"out\[0\]: expected at least 20 columns"),
    ]:
        with pytest.raises(error, match=match):
            d4.compute_swa_indices_and_lens(*args, out=out, **kwargs)
    assert all((o == POISON).all() for o in out)
