"""The worked examples and boundaries of spec §2.10 (ratio 128, storage block 2)."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

from conftest import KINDS, to_kind, to_numpy
from helpers import check_c128a, check_slot_mapping, make_batch


def c128a(kind, positions, nd, table, slots=None, width=128):
    positions = np.array(positions, np.int64)
    slots = np.zeros(len(positions), np.int64) if slots is None else np.array(slots, np.int64)
    gd, lens, pf = d4.build_c128a_topk_metadata(
        to_kind(positions, kind), 128, nd, to_kind(np.zeros(len(positions), np.int32), kind),
        to_kind(np.array(table, np.int32), kind), 2, to_kind(slots, kind),
        max_compressed_tokens=width)
    return to_numpy(gd), to_numpy(lens), to_numpy(pf)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_position_1000(kind):
    table = [[7, 3, 9, 4] + [0] * 60]
    gd, lens, _ = c128a(kind, [1000, 1000], 2, table, slots=[5, -1])
    assert gd[0, :8].tolist() == [14, 15, 6, 7, 18, 19, 8, -1]
    assert (gd[0, 7:] == -1).all()
    assert (gd[1] == -1).all()              # newer vLLM: a padding token's row is all -1 ...
    assert lens.tolist() == [7, 0]          # ... and its length 0 (the seed kept the slots)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("position,visible", [(126, 0), (127, 1), (128, 1), (255, 2), (256, 2),
                                              (300, 2), (0, 0)])
def test_boundaries(kind, position, visible):
    table = [[5, 6, 7] + [0] * 10]
    gd, lens, pf = c128a(kind, [position, position], 1, table)
    assert lens.tolist() == [visible]
    assert gd[0, :visible].tolist() == [10, 11, 12][:visible] and (gd[0, visible:] == -1).all()
    assert pf[0, :visible].tolist() == list(range(visible)) and (pf[0, visible:] == -1).all()


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_position_300(kind):
    _, _, pf = c128a(kind, [300], 0, [[1]])
    assert pf[0, :3].tolist() == [0, 1, -1]


@pytest.mark.parametrize("kind", KINDS)
def test_groups_crossing_a_two_row_block(kind):
    """Compressed rows 1 and 2 sit in different storage blocks (2 rows each)."""
    table = [[40, 50, 60, 70] + [0] * 10]
    gd, lens, _ = c128a(kind, [128 * 3 - 1], 1, table)      # 3 visible rows
    assert gd[0, :4].tolist() == [80, 81, 100, -1] and lens.tolist() == [3]
    batch = make_batch([260], [0])
    batch.block_table[0, :3] = [40, 50, 60]
    out = check_slot_mapping(batch, kind)
    assert out[[127, 255]].tolist() == [80, 81] and out[259] == -1
    # ...and row 2 (closed by position 383) in the next block
    batch = make_batch([10], [375])
    batch.block_table[0, :3] = [40, 50, 60]
    assert check_slot_mapping(batch, kind)[383 - 375].tolist() == 100


@pytest.mark.parametrize("kind", KINDS)
def test_slot_mapping_examples(kind):
    batch = make_batch([4], [256])            # positions 256..259: no group closes
    assert (check_slot_mapping(batch, kind) == -1).all()
    batch = make_batch([133], [127])          # positions 127..259: rows 0 and 1
    out = check_slot_mapping(batch, kind)
    bt0 = int(batch.block_table[0, 0])
    assert out[0] == bt0 * 2 and out[128] == bt0 * 2 + 1
    assert (np.delete(out, [0, 128]) == -1).all()


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_batch_reference(kind):
    batch = make_batch([1, 2, 2, 0, 40, 7], [1000, 127, 250_000, 5, 126, 1 << 19], threshold=2,
                       pad_tokens=2)
    check_c128a(batch, kind, 8192)
