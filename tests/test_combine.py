"""combine_topk_swa_indices (hardened V4.1 form) on every array
kind: upstream's accuracy cases, SWA-only layers (topk 0, a [T, 0] input),
N = 0, a chunk layout not starting at 0, rows past the chunk's tokens,
zero-length requests, L < q, the 0x7FC00000 index, the C128A shape (C = 8320)
and workspace reuse; and bad input."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

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
    (dict(N=65), ValueError, "N: expected an int <= 64, got 65"),
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
