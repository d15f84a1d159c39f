"""Launch geometry: the row kernels (fill_warp_rows) have no grid-stride loop,
so every row must get a warp of its own, within CUDA's grid limit."""
from __future__ import annotations

import pytest

from dsv4_cupy import geometry

MAX_GRID_X = 2**31 - 1


@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 8 << 20, (8 << 20) + 1, 2**31 - 1])
def test_every_row_gets_a_warp(rows):
    blocks = geometry.warp_row_blocks(rows)
    assert 1 <= blocks <= MAX_GRID_X
    assert blocks * geometry.THREADS // geometry.WARP_LANES >= rows
