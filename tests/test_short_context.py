"""fill_short_context_topk_indices on every array kind: positions of both
dtypes and top-k widths, fewer rows than positions, a row-strided buffer
converted to global slots after, garbage positions, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

from conftest import KINDS, to_kind, to_numpy
from helpers import POISON, run_short_context, strided

I32, I64 = np.int32, np.int64


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("top_k", [512, 1024])
@pytest.mark.parametrize("dtype", [I32, I64])
def test_short_context_positions(kind, top_k, dtype):
    rows = run_short_context(kind, [0, 2, 3, 4, 2047, 4095, 9000, -5], top_k, 4, dtype=dtype)
    assert (rows[:2] == -1).all() and rows[2, :2].tolist() == [0, -1]
    assert rows[4, 511] == 511 and (rows[4, 512:] == -1).all()
    assert (rows[6] == np.arange(top_k)).all()                     # never longer than top_k
    assert (rows[7] == -1).all()


@pytest.mark.parametrize("kind", KINDS)
def test_short_context_num_tokens_and_small_widths(kind):
    run_short_context(kind, [0, 3, 7, 100, -5], 4, 4, num_tokens=2)
    run_short_context(kind, [0, 3, 7, 100, -5], 4, 4, num_tokens=0)
    run_short_context(kind, [100, 300], 0, 4)
    rng = np.random.default_rng(3)
    for _ in range(10):
        run_short_context(kind, rng.integers(-10, 3000, int(rng.integers(0, 9))).tolist(),
                          int(rng.integers(0, 700)), int(rng.choice([1, 4, 128])))


@pytest.mark.parametrize("kind", KINDS)
def test_short_context_into_a_row_strided_buffer_then_to_global(kind):
    # The C4A shortcut: fill a wide persistent buffer's rows, then convert them in place.
    positions = np.array([40, 700, 2000], I64)
    buffer = to_kind(np.full((4, 520), POISON, I32), kind)
    local = d4.fill_short_context_topk_indices(to_kind(positions, kind), 512, 4,
                                               out=buffer[:, :512])
    table = strided(np.arange(100, 112, dtype=I32).reshape(1, 12), kind)
    rows, lens = d4.compute_global_topk_indices_and_lens(
        local, to_kind(np.zeros(3, I32), kind), table, 64, to_kind(np.ones(3, bool), kind),
        out=(local, None))
    got = to_numpy(buffer)
    assert (got[3] == POISON).all() and (got[:, 512:] == POISON).all()
    visible = (positions + 1) // 4
    assert to_numpy(lens).tolist() == np.minimum(visible, 512).tolist()
    k = np.arange(512)
    want = np.where(k < visible[:, None], (100 + k // 64) * 64 + k % 64, -1)
    np.testing.assert_array_equal(to_numpy(rows), want)


def test_short_context_bad_input_and_full_validation():
    out = np.full((2, 8), POISON, I32)
    with pytest.raises(TypeError, match="positions: expected dtype int32 or int64, got float32"):
        d4.fill_short_context_topk_indices(np.zeros(2, np.float32), 8, 4, out=out)
    with pytest.raises(ValueError, match="num_tokens: expected an int <= 2, got 3"):
        d4.fill_short_context_topk_indices(np.zeros(2, I64), 8, 4, 3, out=out)
    with pytest.raises(ValueError, match="compress_ratio: expected an int >= 1"):
        d4.fill_short_context_topk_indices(np.zeros(2, I64), 8, 0, out=out)
    with pytest.raises(ValueError, match="out: expected at least 9 columns"):
        d4.fill_short_context_topk_indices(np.zeros(2, I64), 9, 4, out=out)
    with pytest.raises(ValueError, match=r"positions: the short-context fill needs \(p \+ 1\) "
                                         r"// 4 <= top_k = 8, got position 40 at token 1"):
        d4.fill_short_context_topk_indices(np.array([3, 40], I64), 8, 4, out=out,
                                           validate="full")
    assert (out == POISON).all()


@pytest.mark.parametrize("kind", KINDS)
def test_a_garbage_int64_position_gives_the_cpu_rows(kind):
    """position + 1 wraps (INT64_MAX): every kind gives the CPU path's row, at a
    ratio that is not a power of two too."""
    positions = np.array([np.iinfo(np.int64).max, -5, 11, np.iinfo(np.int64).min], np.int64)
    for ratio in (3, 4, 6):
        want = d4.fill_short_context_topk_indices(positions, 8, ratio)
        got = d4.fill_short_context_topk_indices(to_kind(positions, kind), 8, ratio)
        np.testing.assert_array_equal(to_numpy(got), want)
        assert (want[0] == -1).all() and (want[3] == -1).all()
