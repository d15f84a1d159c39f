"""compute_swa_indices_and_lens and compute_prefill_gather_lens
on every array kind: the golden positions, windows crossing a 64-token
block, MTP decodes, padding and zero-length requests, -1 table tails, prefill
rows after the decodes, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

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
    with pytest.raises(ValueError, match="query_start_loc: expected at least 3 elements"):
        d4.compute_prefill_gather_lens(np.array([0, 1], I32), np.array([3, 4], I32), 1, 1)
