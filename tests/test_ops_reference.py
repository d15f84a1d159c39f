"""Every op against the slow reference on hundreds of random batches, for each
array kind: decodes first with MTP query lengths 1-8, prefixes up to 1M tokens,
zero-length and padding requests, ratios 4 and 128 (storage blocks 64 and 2).
GPU kinds are also compared with the numpy CPU path."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import KINDS
from helpers import check_c128a, check_slot_mapping, check_token_map, random_batch

BATCHES_PER_CASE = 60


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio", [128, 4])
def test_random_batches(kind, ratio):
    rng = np.random.default_rng(1000 + ratio)
    widths = [128, 256, 512] + ([8192] if ratio == 128 else [])
    for _ in range(BATCHES_PER_CASE):
        batch = random_batch(rng, ratio=ratio)
        width = int(rng.choice(widths))
        got = [check_token_map(batch, kind), check_slot_mapping(batch, kind),
               check_c128a(batch, kind, width)]
        if kind in ("cupy", "torch_cuda"):
            cpu = [check_token_map(batch, "numpy"), check_slot_mapping(batch, "numpy"),
                   check_c128a(batch, "numpy", width)]
            from conftest import to_numpy
            np.testing.assert_array_equal(to_numpy(got[0]), cpu[0])
            np.testing.assert_array_equal(got[1], cpu[1])
            for g, c in zip(got[2], cpu[2]):
                np.testing.assert_array_equal(g, c)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("positions_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("slot_dtype", [np.int32, np.int64])
def test_c128a_dtypes(kind, positions_dtype, slot_dtype):
    rng = np.random.default_rng(7)
    for _ in range(10):
        batch = random_batch(rng)
        check_c128a(batch, kind, 256, positions_dtype, slot_dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio, storage_block_size", [(4, 3), (4, 48), (6, 8), (128, 5)])
def test_sizes_that_are_not_powers_of_two(kind, ratio, storage_block_size):
    """DeepSeek-V4's ratios and storage blocks are powers of two, which the
    kernels' decode rows take as shifts and masks; any other size takes the
    divisions, with the same results."""
    rng = np.random.default_rng(ratio * storage_block_size)
    for _ in range(10):
        batch = random_batch(rng, ratio=ratio, max_prefill_len=300,
                             block_size=ratio * storage_block_size)
        assert batch.storage_block_size == storage_block_size
        check_slot_mapping(batch, kind)
        check_c128a(batch, kind, 256)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cp", [(2, 0, 1), (2, 1, 1), (4, 3, 2), (8, 5, 4)])
def test_slot_mapping_context_parallel(kind, cp):
    rng = np.random.default_rng(cp[0] * 10 + cp[1])
    for _ in range(20):
        check_slot_mapping(random_batch(rng, ratio=4, max_prefill_len=300), kind, cp)
