"""combine_topk_swa_indices (hardened V4.1 form) on every array
kind: upstream's accuracy cases, SWA-only layers (topk 0, a [T, 0] input),
N = 0, a chunk layout not starting at 0, rows past the chunk's tokens,
zero-length requests, L < q, the 0x7FC00000 index, the C128A shape (C = 8320)
and workspace reuse; and bad input."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

import reference_upstream as upstream
from conftest import KINDS, to_kind, to_numpy
from helpers import POISON, random_combine_case, run_combine

I32 = np.int32
TOPK_C1 = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]


def pad(values, width=128):
    return list(values) + [-1] * (width - len(values))


@pytest.mark.parametrize("kind", KINDS)
def test_upstream_case_one(kind):
    rows, lens = run_combine(kind, TOPK_C1, [0, 2, 3], [8, 10], [8, 10], 4, 2, 4, 64, 16)
    assert rows.tolist() == [pad([1, 2, 3, 19, 20, 21, 22]), pad([5, 6, 7, 8, 20, 21, 22, 23]),
                             pad([73, 74, 75, 76, 86, 87, 88, 89])]
    assert lens.tolist() == [7, 8, 8]


@pytest.mark.parametrize("kind", KINDS)
def test_upstream_case_two_short_gather_and_the_validity_filter(kind):
    topk = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [0, 1, 2, 3], [4, 5, 6, 7]]
    rows, lens = run_combine(kind, topk, [0, 3, 5], [6, 4], [4, 3], 3, 2, 4, 20, 8)
    assert rows[2].tolist() == pad([-1, -1, -1, 9, 10, 11])       # x >= N: -1, still counted
    assert lens.tolist() == [4, 5, 6, 3, 5]


@pytest.mark.parametrize("kind", KINDS)
def test_swa_only_layers(kind):
    rows, lens = run_combine(kind, np.zeros((4, 0), I32), [0, 4], [4], [4], 128, 0, 0, 0, 0)
    assert rows.tolist() == [pad(range(n)) for n in (1, 2, 3, 4)] and lens.tolist() == [1, 2, 3, 4]
    run_combine(kind, np.zeros((5, 0), I32), [0, 2, 5], [300, 3], [129, 3], 128, 1, 0, 0, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_chunk_layout_not_starting_at_zero_and_rows_past_its_tokens(kind):
    topk = TOPK_C1 + [[1, 2, 3, 4], [1, 2, 3, 4]]
    rows, lens = run_combine(kind, topk, [17, 19, 20], [8, 10], [8, 10], 4, 2, 4, 64, 16)
    assert rows[0].tolist() == pad([1, 2, 3, 19, 20, 21, 22])
    assert (rows[3:] == -1).all() and lens.tolist() == [7, 8, 8, 0, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_negative_positions_zero_length_requests_nan_index_and_n_zero(kind):
    rows, lens = run_combine(kind, [[0, 1], [0, 1], [0, 1]], [0, 0, 3], [5, 1], [5, 1], 4, 2, 2,
                             10, 4)
    assert rows.tolist() == [[-1] * 128, [-1] * 128, pad([14])] and lens.tolist() == [0, 0, 1]
    rows, lens = run_combine(kind, [[0x7FC00000, 3, -1]], [0, 1], [12], [4], 4, 2, 3, 20, 8)
    assert rows[0, :7].tolist() == [-1, 3, -1, 8, 9, 10, 11] and lens.tolist() == [7]
    rows, lens = run_combine(kind, [[0, 1, 2]], [0, 1], [12], [4], 4, 2, 3, 4, 0)   # N = 0
    assert rows[0, :7].tolist() == [-1, -1, -1, 0, 1, 2, 3] and lens.tolist() == [7]


@pytest.mark.parametrize("kind", KINDS)
def test_width_rounds_up_to_128(kind):
    rows, lens = run_combine(kind, [list(range(126))], [0, 1], [640], [129], 4, 128, 126, 200, 5)
    assert rows.shape == (1, 256)
    assert rows[0].tolist() == pad([0, 1, 2, 3, 4, 130, 131, 132, 133], 256)
    assert lens.tolist() == [9]


@pytest.mark.parametrize("kind", KINDS)
def test_random_chunks_against_the_reference(kind):
    rng = np.random.default_rng(6)
    for _ in range(15):
        run_combine(kind, *random_combine_case(rng))


# vLLM 0.34's test_deepseek_v4_swa_visible case 0: window 8, images of at most 6 tokens;
# request 0 (30 tokens) holds the inclusive spans [4, 12] and [20, 24], request 1 none.
IMAGE_CASE = dict(qsl=[0, 30, 42], seq=[30, 12], spans=[[(4, 12), (20, 24)], []], window=8,
                  max_image_tokens=6)
# its combine_topk_swa_indices lens (ratio 1 / top-k 0 and ratio 4 / top-k 16)
IMAGE_LENS = {(1, 0): [1, 2, 3, 4, 11, 12, 13, 13, 12, 11, 10, 9, 8, 8, 8, 8, 8, 8, 8, 8, 12, 11,
                       10, 9, 8, 8, 8, 8, 8, 8, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8, 8],
              (4, 16): [1, 2, 3, 5, 12, 13, 14, 15, 14, 13, 12, 12, 11, 11, 11, 12, 12, 12, 12,
                        13, 17, 16, 15, 15, 14, 14, 14, 15, 15, 15, 1, 2, 3, 5, 6, 7, 8, 10, 10,
                        10, 10, 11]}


def test_image_visibility_reference_is_vllm_034s():
    left, right = upstream.image_visibility(IMAGE_CASE["qsl"], IMAGE_CASE["seq"],
                                            IMAGE_CASE["spans"], 6)
    assert left[:30] == [0] * 5 + [1, 2, 3, 4, 5, 5, 5, 5] + [0] * 8 + [1, 2, 3, 4] + [0] * 5
    assert right[:30] == [0] * 4 + [6, 6, 6, 5, 4, 3, 2, 1] + [0] * 8 + [4, 3, 2, 1] + [0] * 6
    assert left[30:] == right[30:] == [0] * 12


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio,topk", [(1, 0), (4, 16)])
@pytest.mark.parametrize("with_image", [True, False])
def test_image_spans_widen_the_window_as_in_vllm_034(kind, ratio, topk, with_image):
    case = IMAGE_CASE
    left, right = upstream.image_visibility(case["qsl"], case["seq"], case["spans"], 6)
    N = -(-30 // ratio)
    rng = np.random.default_rng(0)
    topk_rows = rng.integers(0, 4096, (42, max(topk, 1)), dtype=I32)
    indices, lens = run_combine(kind, topk_rows, case["qsl"], case["seq"], [30, 12],
                                case["window"], ratio, topk, N + 30 + 8, N,
                                left=left if with_image else None,
                                right=right if with_image else None, max_image_tokens=6)
    assert indices.shape == (42, 128)      # round_up(topk + 8 + 6, 128), with or without spans
    if with_image:
        assert lens.tolist() == IMAGE_LENS[ratio, topk]
    else:
        plain = run_combine(kind, topk_rows, case["qsl"], case["seq"], [30, 12], 8, ratio, topk,
                            N + 30 + 8, N)
        np.testing.assert_array_equal(indices[:, :plain[0].shape[1]], plain[0])
        np.testing.assert_array_equal(lens, plain[1])


@pytest.mark.parametrize("kind", KINDS)
def test_random_image_spans_against_the_reference(kind):
    rng = np.random.default_rng(9)
    for _ in range(10):
        queries = rng.integers(1, 40, int(rng.integers(1, 5)))
        seq = queries + rng.integers(0, 60, queries.size)
        qsl = np.concatenate([[0], np.cumsum(queries)]).tolist()
        window, max_image = int(rng.choice([4, 8, 128])), int(rng.integers(1, 20))
        spans = []
        for L in seq:
            starts = np.sort(rng.integers(0, L, int(rng.integers(0, 3))))
            spans.append([(int(s), int(min(s + rng.integers(0, max_image), L - 1)))
                          for s in starts])
        left, right = upstream.image_visibility(qsl, seq.tolist(), spans, max_image)
        gather = (queries + np.minimum(seq - queries, window - 1)).tolist()
        topk = int(rng.choice([0, 3]))
        N = int(seq.max()) // 4
        topk_rows = rng.integers(-2, N + 2, (qsl[-1] + 2, max(topk, 1)), dtype=I32)
        run_combine(kind, topk_rows, qsl, seq.tolist(), gather, window, 4, topk,
                    N + max(gather) + 1, N, left=left + [0, 0], right=right + [0, 0],
                    max_image_tokens=max_image)


def test_image_visibility_needs_both_sides():
    args = (np.zeros((2, 1), I32), np.array([0, 2], I32), np.array([2], I32),
            np.array([2], I32), 8, 1, 0, 10, 0)
    out = (np.full((2, 128), POISON, I32), np.full(2, POISON, I32))
    with pytest.raises(ValueError, match="right_visible: expected an int32 array with the "
                                         "other visibility, got None"):
        d4.combine_topk_swa_indices(*args, out, np.zeros(2, I32), None, 6)
    with pytest.raises(ValueError, match="left_visible: expected at least 2 elements"):
        d4.combine_topk_swa_indices(*args, out, np.zeros(1, I32), np.zeros(2, I32), 6)
    assert all((o == POISON).all() for o in out)


@pytest.mark.parametrize("kind", KINDS)
def test_c128a_shape_and_workspace_reuse(kind):
    # C128A at 1M context: topk 8192, C = 8320; local rows 0..n-1 from the prefill build.
    positions = np.arange(600_000, 600_000 + 40)
    local = d4.fill_short_context_topk_indices(positions, 8192, 128)
    qsl, seq, gather = [0, 40], [600_040], [40 + 127]
    rows, lens = run_combine(kind, local, qsl, seq, gather, 128, 128, 8192, 9000, 4688,
                             reference=False)
    n = (positions + 1) // 128
    assert rows.shape == (40, 8320) and lens.tolist() == (n + 128).tolist()
    assert (rows[0, :n[0]] == np.arange(n[0])).all() and rows[0, n[0]] == 4688
    # The same persistent buffers, then a shorter step: its rows are rewritten
    # whole, the longer step's later rows and the spare cells stay.
    indices = to_kind(np.full((41, 8330), 5, I32), kind)
    lens_buffer = to_kind(np.full(41, 5, I32), kind)
    for tokens in (40, 3):
        got, got_lens = d4.combine_topk_swa_indices(
            to_kind(local[:tokens], kind), to_kind(np.array([0, tokens], I32), kind),
            to_kind(np.array([600_000 + tokens], I32), kind),
            to_kind(np.array([tokens + 127], I32), kind), 128, 128, 8192, 9000, 4688,
            out=(indices, lens_buffer))
        np.testing.assert_array_equal(to_numpy(got), rows[:tokens])
        np.testing.assert_array_equal(to_numpy(got_lens), lens[:tokens])
    written = to_numpy(indices)
    np.testing.assert_array_equal(written[3:40, :8320], rows[3:])
    assert (written[40] == 5).all() and (written[:, 8320:] == 5).all()


# --- bad input ---------------------------------------------------------------------------------
def combine_args(**changes):
    args = dict(topk_indices=np.zeros((3, 4), I32), query_start_loc=np.array([0, 2, 3], I32),
                seq_lens=np.array([8, 10], I32), gather_lens=np.array([8, 10], I32),
                window_size=4, compress_ratio=2, topk=4, M=64, N=16,
                out=(np.full((4, 130), POISON, I32), np.full(4, POISON, I32)))
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,error,match", [
    (dict(topk=5), ValueError, "topk_indices: expected at least 5 columns"),
    (dict(compress_ratio=0), ValueError, "compress_ratio: expected an int >= 1, got 0"),
    (dict(N=65), ValueError, r"N: expected at most M \(64\), a request.s workspace rows, got 65 \(a get_prefill_chunk_plan chunk is \(start, end, N, M\); this function takes M before N\)"),
    (dict(M=-1), ValueError, "M: expected an int >= 0"),
    (dict(window_size=0), ValueError, "window_size: expected an int >= 1"),
    (dict(seq_lens=np.array([8], I32)), ValueError, "seq_lens: expected at least 2 elements"),
    (dict(gather_lens=np.array([8, 10], np.int64)), TypeError, "gather_lens: expected dtype int32"),
    (dict(query_start_loc=np.zeros(0, I32)), ValueError,
     "query_start_loc: expected at least 1 elements"),
    (dict(out=(np.zeros((4, 127), I32), np.zeros(4, I32))), ValueError,
     r"out\[0\]: expected at least 128 columns"),
    (dict(out=(np.zeros((2, 128), I32), np.zeros(4, I32))), ValueError,
     r"out\[0\]: expected at least 3 rows"),
])
def test_bad_input_names_the_argument_and_writes_nothing(changes, error, match):
    args = combine_args(**changes)
    with pytest.raises(error, match=match):
        d4.combine_topk_swa_indices(**args)
    for buffer in combine_args()["out"]:
        assert (buffer == POISON).all()


def test_full_validation():
    for changes, match in [
        (dict(gather_lens=np.array([4, 10], I32)), r"gather_lens: expected at least q \+ "
                                                  r"min\(L - q, W - 1\) = 5 for request 0, "
                                                  "got 4"),
        (dict(M=20), r"M: expected at least N \+ gather_lens = 24 \(request 0.s workspace"),
        (dict(topk_indices=np.zeros((2, 4), I32)), "topk_indices: expected a row for each of "
                                                   "the chunk's 3 tokens, got 2 rows"),
        (dict(query_start_loc=np.array([5, 4, 8], I32)), "query_start_loc: expected "
                                                         "non-decreasing values"),
    ]:
        with pytest.raises(ValueError, match=match):
            d4.combine_topk_swa_indices(**combine_args(validate="full", **changes))
    d4.combine_topk_swa_indices(**combine_args(validate="full",
                                               query_start_loc=np.array([9, 11, 12], I32)))
