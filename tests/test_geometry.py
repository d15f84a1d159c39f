"""Launch geometry: the row kernels (fill_rows) have no grid-stride loop,
so every row must get its threads (a warp, or four for few short-context rows),
within CUDA's grid limit."""
from __future__ import annotations

import pytest

from dsv4_cupy import geometry

MAX_GRID_X = 2**31 - 1


@pytest.mark.parametrize("lanes", sorted({*geometry.ROW_LANES, *geometry.COMBINE_LANES}))
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 8 << 20, (8 << 20) + 1, 2**31 - 1])
def test_every_row_gets_its_lanes(rows, lanes):
    blocks = geometry.row_lane_blocks(rows, lanes)
    assert 1 <= blocks <= MAX_GRID_X
    assert blocks * geometry.THREADS // lanes >= rows
