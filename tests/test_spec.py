"""DeepSeek-V4 constants, widths, KV-cache layout and the backend description."""
from __future__ import annotations

import pytest

import dsv4_cupy as d4

import reference as ref


@pytest.mark.parametrize("max_model_len,capacity", [
    (65_536, 512), (131_072, 1024), (262_144, 2048), (1_032_192, 8064), (1_048_320, 8192),
    (1_048_576, 8192), (2_136, 128), (1, 128)])
def test_capacity(max_model_len, capacity):
    assert d4.c128a_capacity(max_model_len) == capacity == ref.c128a_capacity(max_model_len)


@pytest.mark.parametrize("max_seq_len", [0, 1, 127, 128, 16_384, 16_511, 65_536, 131_073,
                                         1_048_576, 1_048_577, 1_100_000])
@pytest.mark.parametrize("capacity", [128, 512, 8064, 8192])
def test_active_width(max_seq_len, capacity):
    width = d4.c128a_active_width(max_seq_len, capacity)
    assert width == ref.c128a_active_width(max_seq_len, capacity)
    assert width % 128 == 0 and 128 <= width <= capacity


def test_active_width_at_every_length_near_the_width_steps():
    """Every max_seq_len within 300 of each power-of-two step of the width."""
    lengths = {n for step in range(7, 22) for n in range(max((128 << step) - 300, 0),
                                                         (128 << step) + 300)}
    for capacity in (128, 640, 8192):
        for max_seq_len in sorted(lengths):
            assert d4.c128a_active_width(max_seq_len, capacity) == \
                ref.c128a_active_width(max_seq_len, capacity), (max_seq_len, capacity)


def test_active_width_rejects_unaligned_capacity():
    with pytest.raises(ValueError, match="capacity"):
        d4.c128a_active_width(1000, 200)


def test_kv_cache_shape():
    assert d4.kv_cache_shape(10, 64, 1, 512, "fp8_ds_mla") == (10, 64, 584)
    assert d4.kv_cache_shape(10, 2, 1, 512, "fp8") == (10, 2, 584)
    with pytest.raises(ValueError, match=r"block_size: .* got 256 \(the logical block"):
        d4.kv_cache_shape(10, 256, 1, 512, "fp8_ds_mla")
    assert d4.kv_cache_shape(10, 256, 1, 512) == (10, 256, 512)
    assert d4.FP8_DS_MLA_BYTES_PER_TOKEN == 448 + 128 + 8
    with pytest.raises(ValueError, match="cache_dtype"):
        d4.kv_cache_shape(10, 256, 1, 512, "nvfp4_ds_mla")
    with pytest.raises(TypeError, match="num_blocks"):
        d4.kv_cache_shape(10.0, 256, 1, 512)


def test_backend_facts():
    b = d4.DeepseekV4FlashMLABackend
    assert b.get_name() == "FLASHMLA_SPARSE_DSV4"
    assert b.get_supported_kernel_block_sizes() == [256]
    assert b.get_supported_head_sizes() == [512] and d4.HEAD_SIZE == 448 + 64
    assert b.supported_dtypes == ("bfloat16",)
    assert set(b.supported_kv_cache_dtypes) == {"auto", "fp8_ds_mla", "fp8"}
    assert b.is_mla() and b.is_sparse() and b.supports_sink()
    assert b.supports_compute_capability((9, 0)) and b.supports_compute_capability((10, 3))
    assert not b.supports_compute_capability((12, 0)) and not b.supports_compute_capability((8, 9))
    assert b.get_kv_cache_shape(2, 64, 1, 512, "fp8_ds_mla") == (2, 64, 584)
