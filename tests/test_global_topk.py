"""compute_global_topk_indices_and_lens on every array kind: holes, invalid
tokens, requests outside the table, block columns past the logical width
(never the row stride), the 0x7FC00000 index, compaction, in-place use over
several slices of a row, rows past CUDA's grid, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

from conftest import GPU_KINDS, KINDS, to_kind, to_numpy
from helpers import POISON, random_global_topk_case, run_global_topk

I32, I64 = np.int32, np.int64
NAN_INDEX = 0x7FC00000
TOPK_A = [[0, 5, -1, 9, 7], [3, 4, -1, 0, NAN_INDEX], [1, 2, 3, 4, 5], [0, 1, 2, 3, 4],
          [0, 1, 2, 3, 4]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compact", [False, True])
def test_holes_invalid_tokens_and_bad_requests(kind, compact):
    rows, lens = run_global_topk(kind, TOPK_A, [0, 1, 0, 2, -1], [[2, 5], [7, 1]], 4,
                                 [True, True, False, True, True], compact)
    first = [8, 21, 23, -1, -1] if compact else [8, 21, -1, -1, 23]
    assert rows[0].tolist() == first and lens.tolist() == [3, 3, 0, 0, 0]
    assert (rows[2:] == -1).all()                   # invalid token, request 2 and -1: all -1


@pytest.mark.parametrize("kind", KINDS)
def test_block_columns_past_the_logical_width_are_invalid(kind):
    # x = 8 is column 2 of a 2-column table whose row stride holds more: -1.
    for request in (2, 100, -1):
        rows, lens = run_global_topk(kind, [[0, 8, 7, NAN_INDEX]], [request], [[3, 4]] * 2, 4,
                                     [True])
        assert lens.tolist() == [0] and (rows == -1).all()
    rows, lens = run_global_topk(kind, [[0, 8, 7, NAN_INDEX]], [1], [[3, 4]] * 2, 4, [True])
    assert rows.tolist() == [[12, -1, 19, -1]] and lens.tolist() == [2]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("width", [1, 255, 256, 600, 1024])
def test_long_rows_in_place_over_several_slices(kind, compact, width):
    # Invalid entries before valid ones in every slice of the row, so packing
    # moves entries across the slices the kernel reads one after another.
    rng = np.random.default_rng(width)
    topk = rng.integers(0, 64 * 20, (6, width)).astype(I32)
    topk[rng.random(topk.shape) < 0.3] = -1
    topk[rng.random(topk.shape) < 0.05] = NAN_INDEX
    table = rng.integers(0, 10_000, (3, 16)).astype(I32)
    table[2, 10:] = -1                                             # a -1 tail
    run_global_topk(kind, topk, [0, 1, 2, 0, 1, 2], table, 64,
                    [True, True, True, False, True, True], compact)


@pytest.mark.parametrize("kind", KINDS)
def test_random_rows_and_int32_wrap(kind):
    rng = np.random.default_rng(9)
    for _ in range(15):
        run_global_topk(kind, *random_global_topk_case(rng))
    rows, lens = run_global_topk(kind, [[3, 8, -1]], [0], [[300_000_000]], 8, [True])
    assert rows.tolist() == [[-1_894_967_293, -1, -1]] and lens.tolist() == [1]
    rows, lens = run_global_topk(kind, np.zeros((0, 7), I32), [], [[1]], 8, [])
    assert rows.shape == (0, 7) and lens.shape == (0,)


@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.gpu
def test_compact_blocks_taking_several_rows_in_turn(kind, monkeypatch):
    """The compact rows' kernel has a grid-stride loop: on a grid smaller than
    the rows each block converts rows in turn, reusing its shared scratch for
    each row's count. (The other rows' kernel has a block per row, no loop.)"""
    monkeypatch.setattr(d4.geometry, "one_block_per_row", lambda num_rows, name: min(num_rows, 3))
    d4.global_topk._OP.calls.clear()         # no launch prepared under the usual grid
    rng = np.random.default_rng(12)
    try:
        table = rng.integers(-1, 1 << 20, (5, 9)).astype(I32)
        topk = rng.integers(-2, 64 * 10, (23, 512)).astype(I32)
        run_global_topk(kind, topk, rng.integers(-1, 6, 23).tolist(), table, 64,
                        (rng.random(23) < 0.9).tolist(), compact=True)
    finally:
        d4.global_topk._OP.calls.clear()


@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.gpu
def test_more_rows_than_one_grid_holds_are_refused_before_any_write(kind, monkeypatch):
    """A block per row: rows past CUDA's grid limit (here lowered to 3 blocks)
    are a ValueError naming topk_indices, with every output as it was, for the
    op and for the fused C4A layer (its decode and prefill blocks together)."""
    monkeypatch.setattr(d4.geometry, "MAX_GRID_BLOCKS", 3)
    for prepared in (d4.global_topk._OP, d4.c4a_layer._OP):
        prepared.calls.clear()                # every call below takes its checks
    topk = to_kind(np.zeros((4, 512), I32), kind)
    inputs = (to_kind(np.zeros(4, I32), kind), to_kind(np.zeros((1, 8), I32), kind), 64,
              to_kind(np.ones(4, bool), kind))
    for compact in (False, True):
        out = (to_kind(np.full((4, 512), POISON, I32), kind), to_kind(np.full(4, POISON, I32), kind))
        with pytest.raises(ValueError, match=r"topk_indices: expected rows that fit one grid "
                                             r"of at most 3 blocks, got 4 rows \(4 blocks\)"):
            d4.compute_global_topk_indices_and_lens(topk, *inputs, out=out, compact=compact)
        assert all((to_numpy(x) == POISON).all() for x in out)
    # Two decode rows (2 blocks) and two prefill rows (1 block of warps): 3 blocks fit.
    qsl, seq, gather = (to_kind(np.array(x, I32), kind) for x in ([2, 4], [300], [129]))
    layer_out = ((to_kind(np.full((2, 512), POISON, I32), kind),
                  to_kind(np.full(2, POISON, I32), kind)),
                 (to_kind(np.full((2, 640), POISON, I32), kind),
                  to_kind(np.full(2, POISON, I32), kind)))
    d4.c4a_layer_topk(topk, 2, *inputs, qsl, seq, gather, 128, 4, 204, 75, out=layer_out)
    assert (to_numpy(layer_out[0][1]) != POISON).all()
    monkeypatch.setattr(d4.geometry, "MAX_GRID_BLOCKS", 2)
    d4.c4a_layer._OP.calls.clear()
    refill = [to_kind(np.full(to_numpy(x).shape, POISON, I32), kind) for part in layer_out
              for x in part]
    with pytest.raises(ValueError, match=r"topk_indices: .* at most 2 blocks, got 4 rows "
                                         r"\(3 blocks\)"):
        d4.c4a_layer_topk(topk, 2, *inputs, qsl, seq, gather, 128, 4, 204, 75,
                          out=((refill[0], refill[1]), (refill[2], refill[3])))
    assert all((to_numpy(x) == POISON).all() for x in refill)


# --- short-context fill -----------------------------------------------------------------------


# --- bad input ---------------------------------------------------------------------------------
def topk_args(**changes):
    args = dict(topk_indices=np.zeros((2, 4), I32), token_to_req_indices=np.zeros(2, I32),
                block_table=np.ones((1, 2), I32), block_size=64,
                is_valid_token=np.ones(2, bool),
                out=(np.full((3, 5), POISON, I32), np.full(3, POISON, I32)))
    args.update(changes)
    return args


@pytest.mark.parametrize("changes,error,match", [
    (dict(topk_indices=np.zeros((2, 4), I64)), TypeError, "topk_indices: expected dtype int32"),
    (dict(topk_indices=np.zeros(4, I32)), ValueError, "topk_indices: expected a 2-D array"),
    (dict(topk_indices=np.zeros((4, 2), I32).T), ValueError,
     "topk_indices: expected a C-contiguous array"),
    (dict(is_valid_token=np.ones(2, np.uint8)), TypeError, "is_valid_token: expected dtype bool"),
    (dict(token_to_req_indices=np.zeros(1, I32)), ValueError,
     "token_to_req_indices: expected at least 2 elements"),
    (dict(compact=1), TypeError, "compact: expected a bool, got int"),
    (dict(block_size=-64), ValueError, "block_size: expected an int >= 1"),
    (dict(out=(np.zeros((3, 3), I32), np.zeros(3, I32))), ValueError,
     r"out\[0\]: expected at least 4 columns"),
    (dict(out=(np.zeros((3, 5), I32), np.zeros(1, I32))), ValueError,
     r"out\[1\]: expected at least 2 elements"),
    (dict(out=np.zeros((3, 5), I32)), TypeError, "out: expected a tuple of 2 arrays"),
])
def test_bad_input_names_the_argument_and_writes_nothing(changes, error, match):
    args = topk_args(**changes)
    with pytest.raises(error, match=match):
        d4.compute_global_topk_indices_and_lens(**args)
    for buffer in topk_args()["out"]:
        assert (buffer == POISON).all()


def test_only_exact_in_place_overlap_is_allowed():
    buffer = np.full((4, 4), 3, I32)
    lens = np.full(4, POISON, I32)
    # Shifted by a row: output row 0 is input row 1 (read after it is written).
    with pytest.raises(ValueError, match=r"out\[0\]: output memory overlaps topk_indices"):
        d4.compute_global_topk_indices_and_lens(**topk_args(topk_indices=buffer[:2],
                                                            out=(buffer[1:], lens)))
    with pytest.raises(ValueError, match=r"out\[1\]: output memory overlaps topk_indices"):
        d4.compute_global_topk_indices_and_lens(**topk_args(
            topk_indices=buffer[:2], out=(np.zeros((2, 4), I32), buffer[1])))
    assert (buffer == 3).all() and (lens == POISON).all()
    # The same buffer, longer than the input: converted in place.
    d4.compute_global_topk_indices_and_lens(**topk_args(topk_indices=buffer[:2],
                                                        out=(buffer, lens)))
    assert buffer[:2].tolist() == [[67, 67, 67, 67]] * 2 and (buffer[2:] == 3).all()


def test_full_validation_refuses_request_ids_outside_the_table():
    args = topk_args(token_to_req_indices=np.array([0, 1], I32), validate="full")
    with pytest.raises(ValueError, match="token_to_req_indices: expected request ids in"):
        d4.compute_global_topk_indices_and_lens(**args)
    assert all((out == POISON).all() for out in args["out"])
