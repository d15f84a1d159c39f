"""The fp8 KV-cache ops against the reference (tests/reference.py) and vLLM
0.34's own tests of them (tests/kernels/test_compressor_kv_cache.py: the
round trips, the gather cases, the magnitudes, the indexer's), on every
array kind, with the caches and outputs poisoned so that every byte written
or left is checked."""
from __future__ import annotations

import math

import numpy as np
import pytest

import dsv4_cupy as d4
import reference as ref
from dsv4_cupy import fp8

from conftest import GPU_KINDS, HAS_TORCH, KINDS, to_kind, to_numpy
from helpers import bf16_bits, random_bf16

I32, I64, U8, U16 = np.int32, np.int64, np.uint8, np.uint16
POISON_BYTE, POISON_BF16 = 165, 0x7BAD
HEAD, NOPE, ROPE = 512, 448, 64


def bf16_float(bits) -> np.ndarray:
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def pages_of(kind, num_pages, block_size, row_bytes=584, stride_pad=576, fill=POISON_BYTE):
    """Pages [num_pages, page_stride] filled with a poison byte, the stride padded."""
    stride = -(-block_size * row_bytes // stride_pad) * stride_pad + stride_pad
    return to_kind(np.full((num_pages, stride), fill, U8), kind)


def insert_reference(k, pages, slots, block_size):
    pages_list = [list(row) for row in pages]
    ref.fp8_ds_mla_insert([list(map(int, row)) for row in k], pages_list,
                          [int(s) for s in slots], block_size)
    return np.array(pages_list, U8)


def insert(kind, k, pages, slots, block_size, view=False):
    """quantize_and_insert_k_cache on ``kind``; the pages as numpy after."""
    cache = to_kind(pages, kind)
    target = cache
    if view:
        target = d4.kv_cache_view(cache, "c4a" if block_size == 64 else "c128a") \
            if block_size in (64, 2) else cache
    d4.quantize_and_insert_k_cache(to_kind(k, kind), target, to_kind(slots, kind), block_size)
    return to_numpy(cache)


def random_k(rng, num_tokens, scale=1.0):
    return random_bf16(rng, num_tokens, HEAD, scale)


# --- the numbers ------------------------------------------------------------------------------
def test_e4m3_of_every_bf16_value_equals_torch_and_the_reference():
    torch = pytest.importorskip("torch")
    bits = np.arange(1 << 16, dtype=U16)
    with np.errstate(invalid="ignore"):
        clamped = np.clip(bf16_float(bits).astype(np.float64), -448.0, 448.0)
    ours = np.array([fp8.e4m3_bits(v) for v in clamped], U8)
    values = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float()
    theirs = values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    nan = np.isnan(clamped)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert set(ours[nan].tolist()) == {0x7F}          # torch keeps the sign bit: 0x7F or 0xFF
    sample = np.random.default_rng(0).choice(np.flatnonzero(~nan), 3000, replace=False)
    assert [ref.e4m3_code(clamped[i]) for i in sample] == ours[sample].tolist()


def test_bf16_rounding_of_every_e4m3_times_every_scale_byte_equals_the_reference():
    codes, scales = np.arange(256), np.arange(256)
    ours = np.array([[fp8.dequantized(c, s) for s in scales] for c in codes], U16)
    want = np.array([[ref.dequantized_bf16(int(c), int(s)) for s in scales] for c in codes], U16)
    np.testing.assert_array_equal(ours, want)


def test_the_scale_exponent_at_powers_of_two_and_the_floor():
    for amax, e in ((448.0, 0), (448.0 * 2.0 ** -10, -10), (0.0, -22), (1e-4, -22),
                    (1.75 * 2 ** 100, 92), (449.0, 1)):
        assert fp8.ue8m0_exponent(np.float32(amax)) == e, amax


# --- insert -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [16, 64, 2])
def test_insert_writes_exactly_the_reference_bytes(kind, block_size):
    rng = np.random.default_rng(block_size)
    num_pages = max(5, 32 // block_size)
    k = random_k(rng, 23, 3.0)
    slots = rng.permutation(num_pages * block_size)[:23].astype(I64)
    slots[[3, 11]] = -1
    pages = to_numpy(pages_of("numpy", num_pages, block_size))
    want = insert_reference(k, pages, slots, block_size)
    got = insert(kind, k, pages, slots, block_size)
    np.testing.assert_array_equal(got, want)     # written bytes, pad bytes, untouched poison


@pytest.mark.parametrize("kind", KINDS)
def test_insert_through_the_bound_view_and_int32_slots(kind):
    rng = np.random.default_rng(1)
    k = random_k(rng, 9)
    slots = rng.permutation(3 * 64)[:9].astype(I32)
    pages = to_numpy(pages_of("numpy", 3, 64))
    want = insert_reference(k, pages, slots, 64)
    np.testing.assert_array_equal(insert(kind, k, pages, slots, 64, view=True), want)


@pytest.mark.parametrize("kind", KINDS)
def test_insert_edge_values(kind):
    """Magnitudes 0.001, 1, 100; amax on a power of two; zero tiles; NaN and
    infinities (as vLLM's Triton kernel: NaN +448, an infinite tile scale 255)."""
    rows = [np.full(HEAD, 0.001), np.ones(HEAD), np.full(HEAD, 100.0), np.zeros(HEAD),
            np.full(HEAD, -0.0), np.linspace(-448, 448, HEAD), np.full(HEAD, 2.0 ** -20)]
    special = np.random.default_rng(2).standard_normal(HEAD)
    special[[0, 70, 130]] = [np.nan, np.inf, -np.inf]
    special[192:256] = np.nan                                   # an all-NaN tile
    rows.append(special)
    k = bf16_bits(np.array(rows))
    slots = np.arange(len(rows), dtype=I64)
    pages = to_numpy(pages_of("numpy", 1, 16))
    want = insert_reference(k, pages, slots, 16)
    got = insert(kind, k, pages, slots, 16)
    np.testing.assert_array_equal(got, want)
    scales = got[0, 16 * 576:16 * 576 + 8 * len(rows)].reshape(len(rows), 8)
    assert scales[3, 0] == 105 and scales[7, 1] == 255 and scales[7, 3] == 105
    assert (scales[:, 7] == 0).all() and scales[5, 0] == 127
    assert got[0, 7 * 576] == 0x7E                               # the NaN value: +448


@pytest.mark.parametrize("kind", KINDS)
def test_round_trips_of_vllms_test(kind):
    """vLLM's test_deepseek_v4_attention_quant_cache_roundtrip: 1/4/8/17 tokens,
    blocks of 16/64; NoPE within 16x the largest tile scale, RoPE exact."""
    rng = np.random.default_rng(3)
    for num_tokens in (1, 4, 8, 17):
        for block_size in (16, 64):
            num_pages = -(-num_tokens // block_size) + 1
            k = random_k(rng, num_tokens)
            cache = pages_of(kind, num_pages, block_size)
            d4.quantize_and_insert_k_cache(to_kind(k, kind), cache,
                                           to_kind(np.arange(num_tokens, dtype=I64), kind),
                                           block_size)
            out = to_kind(np.zeros((1, num_tokens, HEAD), U16), kind)
            d4.dequantize_and_gather_k_cache(
                out, cache, to_kind(np.array([num_tokens], I32), kind), None,
                to_kind(np.arange(num_pages, dtype=I32)[None], kind), block_size, 0)
            got = bf16_float(to_numpy(out)[0])
            original = bf16_float(k)
            for t in range(num_tokens):
                tiles = np.abs(original[t, :NOPE]).reshape(7, 64).max(axis=1)
                scale = 2.0 ** np.ceil(np.log2(np.maximum(tiles, 1e-4) / 448)).max()
                assert np.abs(got[t, :NOPE] - original[t, :NOPE]).max() <= 16 * scale
            np.testing.assert_array_equal(to_numpy(out)[0, :, NOPE:], k[:, NOPE:])


@pytest.mark.parametrize("kind", KINDS)
def test_magnitudes_of_vllms_test(kind):
    """vLLM's test_deepseek_v4_quant_magnitude_range: relative error under 0.15."""
    rng = np.random.default_rng(4)
    rows = np.stack([np.full(HEAD, 0.001), np.ones(HEAD), np.full(HEAD, 100.0),
                     rng.standard_normal(HEAD)])
    k = bf16_bits(rows)
    cache = pages_of(kind, 1, 16)
    d4.quantize_and_insert_k_cache(to_kind(k, kind), cache,
                                   to_kind(np.arange(4, dtype=I64), kind), 16)
    out = to_kind(np.zeros((1, 4, HEAD), U16), kind)
    d4.dequantize_and_gather_k_cache(out, cache, to_kind(np.array([4], I32), kind), None,
                                     to_kind(np.zeros((1, 1), I32), kind), 16, 0)
    got, original = bf16_float(to_numpy(out)[0]), bf16_float(k)
    np.testing.assert_array_equal(to_numpy(out)[0, :, NOPE:], k[:, NOPE:])
    big = np.abs(original[:, :NOPE]) > 0.01
    relative = np.abs(got[:, :NOPE] - original[:, :NOPE])[big] / np.abs(original[:, :NOPE])[big]
    assert relative.max() < 0.15


# --- gather -----------------------------------------------------------------------------------
def gather_case(rng, seq_lens, block_size=64, pad_value=int(-1e6)):
    """vLLM's test_dequantize_and_gather_k_cache set-up: random physical pages,
    padded table entries, every token inserted."""
    num_pages = sum(-(-s // block_size) for s in seq_lens)
    physical = rng.permutation(num_pages)
    cols = max(-(-s // block_size) for s in seq_lens)
    table = np.full((len(seq_lens), cols), pad_value, I32)
    start, slots = 0, []
    for b, seq in enumerate(seq_lens):
        n = -(-seq // block_size)
        table[b, :n] = physical[start:start + n]
        start += n
        positions = np.arange(seq)
        slots.append(table[b, positions // block_size].astype(I64) * block_size
                     + positions % block_size)
    slots = np.concatenate(slots)
    k = random_k(rng, len(slots), 2.0)
    # The CPU path's insert (checked against the reference above) fills the pages.
    pages = insert("numpy", k, to_numpy(pages_of("numpy", num_pages, block_size)), slots,
                   block_size)
    return pages, table


def gather_reference(out, pages, seq_lens, gather_lens, table, block_size, offset, ratio=1):
    rows = [[list(map(int, row)) for row in request] for request in out]
    ref.fp8_ds_mla_gather(rows, [list(map(int, p)) for p in pages], list(map(int, seq_lens)),
                          None if gather_lens is None else list(map(int, gather_lens)),
                          [list(map(int, r)) for r in table], block_size, offset, ratio)
    return np.array(rows, U16)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seq_lens, gather_lens, offset", [
    ([9, 23, 7], None, 0), ([19, 8, 257], [6, 8, 129], 5)])
def test_gather_cases_of_vllms_test(kind, seq_lens, gather_lens, offset):
    rng = np.random.default_rng(5)
    pages, table = gather_case(rng, seq_lens)
    rows = offset + max(gather_lens or seq_lens) + 3
    out = np.full((len(seq_lens), rows, HEAD), POISON_BF16, U16)
    want = gather_reference(out, pages, seq_lens, gather_lens, table, 64, offset)
    got = to_kind(out, kind)
    result = d4.dequantize_and_gather_k_cache(
        got, to_kind(pages, kind), to_kind(np.array(seq_lens, I32), kind),
        None if gather_lens is None else to_kind(np.array(gather_lens, I32), kind),
        to_kind(table, kind), 64, offset)
    assert result is got
    np.testing.assert_array_equal(to_numpy(got), want)   # valid rows exact, the rest poison


@pytest.mark.parametrize("kind", ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def test_ml_dtypes_arrays_are_taken_as_their_bits(kind):
    """On numpy and cupy, bf16 arrives as uint16 bits or ml_dtypes.bfloat16,
    and the indexer's fp8 keys as uint8 or ml_dtypes.float8_e4m3fn: the same
    bytes and rows either way, returned in the dtype they came in."""
    import ml_dtypes
    rng = np.random.default_rng(31)
    seq_lens, gather_lens, offset = [19, 8, 257], [6, 8, 129], 5
    pages, table = gather_case(rng, seq_lens)
    k = to_kind(random_k(rng, 9, 3.0), kind)
    slots = to_kind(rng.permutation(5 * 64)[:9].astype(I64), kind)
    inserted = [pages_of(kind, 5, 64) for _ in range(2)]
    d4.quantize_and_insert_k_cache(k, inserted[0], slots, 64)
    d4.quantize_and_insert_k_cache(k.view(ml_dtypes.bfloat16), inserted[1], slots, 64)
    np.testing.assert_array_equal(to_numpy(inserted[1]), to_numpy(inserted[0]))
    out = to_kind(np.full((3, offset + 260, HEAD), POISON_BF16, U16), kind)
    typed = out.copy().view(ml_dtypes.bfloat16)
    args = (to_kind(pages, kind), to_kind(np.array(seq_lens, I32), kind),
            to_kind(np.array(gather_lens, I32), kind), to_kind(table, kind), 64, offset)
    d4.dequantize_and_gather_k_cache(out, *args)
    result = d4.dequantize_and_gather_k_cache(typed, *args)
    assert result is typed and typed.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(to_numpy(typed.view(U16)), to_numpy(out))
    cache = to_kind(np.full((4, 64, 132), POISON_BYTE, U8), kind)
    d4.indexer_k_quant_and_cache(to_kind(random_k(rng, 20, 2.0)[:, :128].copy(), kind), cache,
                                 to_kind(rng.permutation(4 * 64)[:20].astype(I64), kind), 128,
                                 "ue8m0")
    bounds = to_kind(np.array([0, 7, 20], I32), kind)
    indexer_table = to_kind(np.array([[2, 0], [1, 3]], I32), kind)
    keys = to_kind(np.full((20, 128), 123, U8), kind)
    typed_keys = keys.copy().view(ml_dtypes.float8_e4m3fn)
    scales = [to_kind(np.full((20, 4), 123, U8), kind) for _ in range(2)]
    d4.cp_gather_indexer_k_quant_cache(cache, keys, scales[0], indexer_table, bounds)
    result = d4.cp_gather_indexer_k_quant_cache(cache, typed_keys, scales[1], indexer_table,
                                                bounds)
    assert result[0] is typed_keys and typed_keys.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(to_numpy(typed_keys.view(U8)), to_numpy(keys))
    np.testing.assert_array_equal(to_numpy(scales[1]), to_numpy(scales[0]))
    assert (to_numpy(keys) != 123).any()


@pytest.mark.parametrize("kind", KINDS)
def test_gather_leaves_rows_it_cannot_address(kind):
    """gather_len > seq_len, a block outside the cache, a request without a
    table row, rows past out's 50: not written (vLLM reads or writes out of
    bounds)."""
    rng = np.random.default_rng(6)
    pages, table = gather_case(rng, [70, 10, 40])
    table[2, 0] = 10_000                                     # outside the cache
    out = np.full((4, 50, HEAD), POISON_BF16, U16)
    seq, lens = [70, 10, 40, 5], [60, 12, 30, 5]             # request 1: G > L; 3: no table row
    want = gather_reference(out, pages, seq, lens, table, 64, 2)
    got = to_kind(out, kind)
    d4.dequantize_and_gather_k_cache(got, to_kind(pages, kind), to_kind(np.array(seq, I32), kind),
                                     to_kind(np.array(lens, I32), kind), to_kind(table, kind),
                                     64, 2)
    np.testing.assert_array_equal(to_numpy(got), want)
    assert (to_numpy(got)[3] == POISON_BF16).all() and (to_numpy(got)[:, :2] == POISON_BF16).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio", [1, 4])
def test_gather_of_garbage_lengths_writes_what_the_reference_does(kind, ratio):
    """Negative and int32-extreme seq_lens and gather_lens (garbage a
    validate="default" call takes unchecked): each path writes exactly the
    reference's rows, whole and as the one-launch form's SWA source."""
    rng = np.random.default_rng(9)
    pages, table = gather_case(rng, [70, 100, 40, 64, 30])
    seq = np.array([-5, 2**31 - 1, -2**31, 64 * ratio, 30], I32)
    lens = np.array([-7, 2**31 - 1, 4, 5, -2**31], I32)
    out = np.full((5, 12, HEAD), POISON_BF16, U16)
    for gather_lens in (None, lens):
        want = gather_reference(out, pages, seq // ratio, gather_lens, table, 64, 2)
        assert (want != POISON_BF16).any() and (want == POISON_BF16).any()   # rows of each
        got = to_kind(out, kind)
        d4.dequantize_and_gather_k_cache(got, to_kind(pages, kind), to_kind(seq // ratio, kind),
                                         None if gather_lens is None else to_kind(lens, kind),
                                         to_kind(table, kind), 64, 2)
        np.testing.assert_array_equal(to_numpy(got), want)
    if ratio > 1:
        compressed = gather_reference(out[:, :6], pages, seq, None, table, 64, 0, ratio)
        want = gather_reference(np.concatenate([compressed, out[:, 6:]], axis=1), pages, seq,
                                lens, table, 64, 6)             # the compressed rows end at N
        assert (want[:, :6] != POISON_BF16).any() and (want[:, 6:] != POISON_BF16).any()
        got = to_kind(out, kind)
        d4.dequantize_and_gather_prefill_kv(
            got, to_kind(pages, kind), to_kind(table, kind), to_kind(pages, kind),
            to_kind(table, kind), to_kind(seq, kind), to_kind(lens, kind), ratio, 6,
            compressed_block_size=64)
        np.testing.assert_array_equal(to_numpy(got), want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio", [4, 128])
def test_prefill_kv_equals_the_two_gathers(kind, ratio):
    """The one-launch form against vLLM's two calls (compressed at 0, SWA at N)."""
    rng = np.random.default_rng(7 + ratio)
    seq_lens = [600, 300, 900] if ratio == 4 else [1500, 700, 2100]
    block = 256 // ratio
    compressed_pages, compressed_table = gather_case(rng, [s // ratio for s in seq_lens], block)
    swa_pages, swa_table = gather_case(rng, seq_lens, 64)
    gather_lens = [q + 127 for q in (30, 1, 64)]
    N = max(s // ratio for s in seq_lens)
    M = N + max(gather_lens)
    out = np.full((3, M + 2, HEAD), POISON_BF16, U16)
    want = gather_reference(out, compressed_pages, seq_lens, None, compressed_table, block, 0,
                            ratio)
    want = gather_reference(want, swa_pages, seq_lens, gather_lens, swa_table, 64, N)
    got = to_kind(out, kind)
    d4.dequantize_and_gather_prefill_kv(
        got, to_kind(compressed_pages, kind), to_kind(compressed_table, kind),
        to_kind(swa_pages, kind), to_kind(swa_table, kind), to_kind(np.array(seq_lens, I32), kind),
        to_kind(np.array(gather_lens, I32), kind), ratio, N)
    np.testing.assert_array_equal(to_numpy(got), want)


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_insert_then_gather(kind):
    """Random shapes, magnitudes from 1e-3 to 1e30, NaN and infinities among
    the keys, slots and table entries outside the cache."""
    rng = np.random.default_rng(8)
    for _ in range(16):
        block_size = int(rng.choice([2, 16, 64]))
        num_pages = int(rng.integers(1, 6))
        num_tokens = int(rng.integers(0, min(40, num_pages * block_size + 6)))
        k = random_k(rng, num_tokens, float(rng.choice([1e-3, 1, 1e4, 1e30])))
        if k.size:                                       # a NaN, +inf, -inf among them
            k.reshape(-1)[rng.integers(0, k.size, 3)] = [0x7FC0, 0x7F80, 0xFF80]
        # Distinct slots (two tokens of one slot race, in vLLM too), some outside.
        slots = rng.permutation(np.arange(-3, num_pages * block_size + 3))[:num_tokens]
        slots = slots.astype(I64)
        pages = to_numpy(pages_of("numpy", num_pages, block_size))
        want_pages = insert_reference(k, pages, slots, block_size)
        got_pages = insert(kind, k, pages, slots, block_size)
        np.testing.assert_array_equal(got_pages, want_pages)
        num_reqs = int(rng.integers(1, 4))
        seq = rng.integers(0, num_pages * block_size + 1, num_reqs).astype(I32)
        lens = np.minimum(rng.integers(0, 30, num_reqs), seq).astype(I32)
        table = rng.integers(-1, num_pages + 1, (num_reqs, num_pages)).astype(I32)
        offset = int(rng.integers(0, 4))
        out = np.full((num_reqs, offset + 30, HEAD), POISON_BF16, U16)
        want = gather_reference(out, want_pages, seq, lens, table, block_size, offset)
        got = to_kind(out, kind)
        d4.dequantize_and_gather_k_cache(got, to_kind(want_pages, kind), to_kind(seq, kind),
                                         to_kind(lens, kind), to_kind(table, kind), block_size,
                                         offset)
        np.testing.assert_array_equal(to_numpy(got), want)


# --- the indexer's cache ----------------------------------------------------------------------
def indexer_pages(kind, num_pages, block_size, fill=POISON_BYTE):
    pages = to_kind(np.full((num_pages, 8640 if block_size == 64 else 2304), fill, U8), kind)
    if kind in ("torch_cpu", "torch_cuda"):
        return pages.as_strided((num_pages, block_size, 132), (pages.stride(0), 132, 1))
    if kind == "cupy":
        import cupy
        return cupy.lib.stride_tricks.as_strided(pages, (num_pages, block_size, 132),
                                                 (pages.strides[0], 132, 1))
    return np.lib.stride_tricks.as_strided(pages, (num_pages, block_size, 132),
                                           (pages.strides[0], 132, 1))


def page_bytes(view):
    """The pages under a bound indexer view, as numpy [num_pages, page bytes]."""
    array = to_numpy(view)
    base = array if array.base is None else array
    return np.lib.stride_tricks.as_strided(base, (array.shape[0], array.shape[1] * 132),
                                           (array.strides[0], 1)).copy()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scale_fmt", ["ue8m0", "mxfp8", ""])
def test_indexer_insert_and_gather_equal_the_reference(kind, scale_fmt):
    rng = np.random.default_rng(9)
    block_size, num_pages = 16, 4
    k = random_bf16(rng, 21, 128, 5.0)
    k[4, 3], k[5, 7] = 0x7FC0, 0x7F80                          # a NaN, an infinity
    slots = rng.permutation(num_pages * block_size)[:21].astype(I64)
    slots[[2, 9]] = [-1, -5]
    cache = indexer_pages(kind, num_pages, block_size)
    before = page_bytes(cache)
    d4.indexer_k_quant_and_cache(to_kind(k, kind), cache, to_kind(slots, kind), 128, scale_fmt)
    want = [list(map(int, p)) for p in before[:, :block_size * 132]]
    ref.indexer_insert([list(map(int, r)) for r in k], want, list(map(int, slots)), block_size,
                       scale_fmt)
    np.testing.assert_array_equal(page_bytes(cache)[:, :block_size * 132], np.array(want, U8))
    cu = np.array([0, 3, 3, 9, 14], I32)
    table = rng.integers(0, num_pages, (4, 2)).astype(I32)
    dst_k = np.full((17, 128), 123, U8)
    dst_scale = np.full((17, 4), 123, U8)
    want_k, want_scale = [list(r) for r in dst_k], [list(r) for r in dst_scale]
    ref.indexer_gather(want, want_k, want_scale, table.tolist(), cu.tolist(), block_size)
    got_k, got_scale = to_kind(dst_k, kind), to_kind(dst_scale, kind)
    result = d4.cp_gather_indexer_k_quant_cache(cache, got_k, got_scale, to_kind(table, kind),
                                                to_kind(cu, kind))
    assert result[0] is got_k and result[1] is got_scale
    np.testing.assert_array_equal(to_numpy(got_k), np.array(want_k, U8))
    np.testing.assert_array_equal(to_numpy(got_scale), np.array(want_scale, U8))
    assert (to_numpy(got_k)[14:] == 123).all()                 # vLLM's upper-bound test


@pytest.mark.parametrize("kind", KINDS)
def test_indexer_round_trips_of_vllms_test(kind):
    """vLLM's test_indexer_quant_cache_roundtrip: within 16x the row's scale."""
    rng = np.random.default_rng(10)
    for num_tokens in (1, 4, 8, 17):
        for block_size in (16, 64):
            for scale_fmt in ("ue8m0", "mxfp8"):
                num_pages = -(-num_tokens // block_size) + 1
                k = random_bf16(rng, num_tokens, 128)
                cache = indexer_pages(kind, num_pages, block_size, 0)
                d4.indexer_k_quant_and_cache(to_kind(k, kind), cache,
                                             to_kind(np.arange(num_tokens, dtype=I64), kind),
                                             128, scale_fmt)
                dst_k = to_kind(np.zeros((num_tokens, 128), U8), kind)
                dst_scale = to_kind(np.zeros((num_tokens, 4), U8), kind)
                d4.cp_gather_indexer_k_quant_cache(
                    cache, dst_k, dst_scale, to_kind(np.arange(num_pages, dtype=I32)[None], kind),
                    to_kind(np.array([0, num_tokens], I32), kind))
                scales = to_numpy(dst_scale)
                if scale_fmt == "mxfp8":
                    assert (scales == scales[:, :1]).all()
                    scale = (scales[:, 0].astype(np.uint32) << 23).view(np.float32)
                else:
                    scale = scales.copy().view(np.float32)[:, 0]
                values = fp8.E4M3_VALUES[to_numpy(dst_k)] * scale[:, None]
                original = bf16_float(k).astype(np.float64)
                amax = np.maximum(np.abs(original).max(axis=1), 1e-4)
                bound = 16 * 2.0 ** np.ceil(np.log2(amax / 448))
                assert (np.abs(values - original).max(axis=1) <= bound).all()


# --- layouts and bad input --------------------------------------------------------------------
def test_layouts_are_vllms_pages():
    assert [(c, d4.kv_cache_layout(c).page_bytes, d4.kv_cache_layout(c).page_stride)
            for c in ("swa", "c4a", "c128a", "indexer")] == [
        ("swa", 37376, 37440), ("c4a", 37376, 37440), ("c128a", 1168, 1728),
        ("indexer", 8448, 8640)]
    cache = d4.empty_kv_cache("c128a", 3, fill=7)
    assert cache.shape == (3, 2, 584) and cache.strides == (1728, 584, 1)
    with pytest.raises(ValueError, match="cache: expected one of"):
        d4.kv_cache_layout("c256a")


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_is_refused_before_any_write(kind):
    rng = np.random.default_rng(11)
    cache = pages_of(kind, 2, 64)
    before = to_numpy(cache).copy()
    k = to_kind(random_k(rng, 4), kind)
    slots = to_kind(np.arange(4, dtype=I64), kind)
    cases = [
        (dict(k=to_kind(np.zeros((4, 512), np.float32), kind)), TypeError, r"k: expected dtype bfloat16 \(or its uint16 bits\), got float32"),
        (dict(k=to_kind(random_k(rng, 4)[:, :100], kind)), ValueError, "k: expected at least 512"),
        (dict(slot_mapping=to_kind(np.arange(5, dtype=I64), kind)), ValueError,
         "k: expected a row for each of the 5 slots"),
        (dict(k_cache=to_kind(np.zeros((2, 100), U8), kind)), ValueError,
         "k_cache: expected at least 37376 columns"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(is_ue8m0=False), ValueError, "is_ue8m0: expected True"),
    ]
    for change, error, match in cases:
        arguments = dict(k=k, k_cache=cache, slot_mapping=slots, block_size=64)
        arguments.update(change)
        with pytest.raises(error, match=match):
            d4.quantize_and_insert_k_cache(**arguments)
    bad_slots = to_kind(np.array([0, 1, 500, -1], I64), kind)
    with pytest.raises(ValueError, match=r"slot_mapping: expected -1 or a slot in \[0, 128\)"):
        d4.quantize_and_insert_k_cache(k, cache, bad_slots, 64, validate="full")
    np.testing.assert_array_equal(to_numpy(cache), before)
    out = to_kind(np.full((1, 8, HEAD), POISON_BF16, U16), kind)
    with pytest.raises(ValueError, match="gather_lens: expected 0 <= gather_len <= seq_len"):
        d4.dequantize_and_gather_k_cache(out, cache, to_kind(np.array([5], I32), kind),
                                         to_kind(np.array([6], I32), kind),
                                         to_kind(np.zeros((1, 1), I32), kind), 64, 0,
                                         validate="full")
    with pytest.raises(ValueError, match=r"out: expected a bf16 array \[>= 2, M, 512\]"):
        d4.dequantize_and_gather_k_cache(out, cache, to_kind(np.array([5, 5], I32), kind), None,
                                         to_kind(np.zeros((2, 1), I32), kind), 64, 0)
    assert (to_numpy(out) == POISON_BF16).all()


@pytest.mark.parametrize("kind", KINDS)
def test_full_validation_of_the_indexer_gather_names_the_block(kind):
    cache = indexer_pages(kind, 2, 16)
    dst_k = to_kind(np.full((20, 128), 123, U8), kind)
    dst_scale = to_kind(np.full((20, 4), 123, U8), kind)
    cu = to_kind(np.array([0, 20], I32), kind)
    for table, match in (([[0]], r"block_table: request 0 needs 2 blocks, the table rows have 1"),
                         ([[0, 2]], r"block_table: expected entries in \[0, 2\)")):
        with pytest.raises(ValueError, match=match):
            d4.cp_gather_indexer_k_quant_cache(cache, dst_k, dst_scale,
                                               to_kind(np.array(table, I32), kind), cu,
                                               validate="full")
    assert (to_numpy(dst_k) == 123).all() and (to_numpy(dst_scale) == 123).all()


@pytest.mark.skipif(not HAS_TORCH, reason="torch bf16 tensors need torch")
def test_torch_bf16_and_fp8_tensors_are_taken_as_their_bits():
    import torch
    k = torch.randn(3, HEAD, dtype=torch.bfloat16)
    cache = d4.empty_kv_cache("c4a", 1, like=torch.zeros(1, dtype=torch.int32))
    d4.quantize_and_insert_k_cache(k, cache, torch.arange(3), 64)
    out = torch.zeros(1, 3, HEAD, dtype=torch.bfloat16)
    d4.dequantize_and_gather_k_cache(out, cache, torch.tensor([3], dtype=torch.int32), None,
                                     torch.zeros(1, 1, dtype=torch.int32), 64, 0)
    assert torch.equal(out[0, :, NOPE:], k[:, NOPE:])
    assert (out[0, :, :NOPE].float() - k[:, :NOPE].float()).abs().max() < 0.1 * k.abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_conversions_of_every_bf16_value_equal_the_cpu_path(kind):
    """Every bf16 value of magnitude <= 448 (and every NaN) through the GPU's
    e4m3 conversion: tiles whose amax is 448 (scale 2^0), CPU against GPU."""
    values = np.arange(1 << 16, dtype=U16)
    usable = values[(bf16_float(values) <= 448) & (bf16_float(values) >= -448)
                    | np.isnan(bf16_float(values))]
    per_row = 7 * 63
    rows = -(-len(usable) // per_row)
    k = np.zeros((rows, HEAD), U16)
    nope = np.zeros((rows, 7, 64), U16)
    nope[:, :, 0] = bf16_bits([448.0])[0]
    padded = np.resize(usable, rows * per_row).reshape(rows, 7, 63)
    nope[:, :, 1:] = padded
    k[:, :NOPE] = nope.reshape(rows, NOPE)
    k[:, NOPE:] = values[:ROPE]
    block = 64
    num_pages = -(-rows // block)
    slots = np.arange(rows, dtype=I64)
    pages = to_numpy(pages_of("numpy", num_pages, block))
    cpu = insert("numpy", k, pages, slots, block)
    np.testing.assert_array_equal(insert(kind, k, pages, slots, block), cpu)
    out = np.full((1, rows, HEAD), POISON_BF16, U16)
    table = np.arange(num_pages, dtype=I32)[None]
    want = out.copy()
    d4.dequantize_and_gather_k_cache(want, cpu, np.array([rows], I32), None, table, block, 0)
    got = to_kind(out, kind)
    d4.dequantize_and_gather_k_cache(got, to_kind(cpu, kind), to_kind(np.array([rows], I32), kind),
                                     None, to_kind(table, kind), block, 0)
    np.testing.assert_array_equal(to_numpy(got), want)
    assert math.isfinite(float(bf16_float(want[0, 0, :NOPE]).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_gpu_dequantisation_of_every_e4m3_byte_at_every_scale_byte_equals_the_cpu_path(kind):
    """Pages written byte by byte: under each scale byte, its 256 e4m3 codes
    in four tiles of 64 (the NaNs 0x7F and 0xFF among them), gathered on the
    GPU and on the CPU (equal to the reference for every pair, above): the
    float32 pairs and the float64 values (NaNs, extreme scales) alike."""
    block, record, tile = 64, ref.RECORD, ref.TILE
    tiles = 256 * 4
    rows = -(-tiles // (NOPE // tile))
    pages = to_numpy(pages_of("numpy", -(-rows // block), block, fill=0))
    for t in range(tiles):
        scale, quarter = divmod(t, 4)
        row, j = divmod(t, NOPE // tile)
        page, r = pages[row // block], row % block
        page[r * record + j * tile:r * record + (j + 1) * tile] = np.arange(tile) + tile * quarter
        page[block * record + r * ref.SCALES + j] = scale
    table = np.arange(pages.shape[0], dtype=I32)[None]
    want = np.full((1, rows, HEAD), POISON_BF16, U16)
    d4.dequantize_and_gather_k_cache(want, pages, np.array([rows], I32), None, table, block, 0)
    got = to_kind(np.full_like(want, POISON_BF16), kind)
    d4.dequantize_and_gather_k_cache(got, to_kind(pages, kind), to_kind(np.array([rows], I32), kind),
                                     None, to_kind(table, kind), block, 0)
    np.testing.assert_array_equal(to_numpy(got), want)
    nope = want[0, :, :NOPE]
    assert (nope == 0x7FC0).any() and ((nope & 0x7F80) == 0x7F80).sum() > (nope == 0x7FC0).sum()
    assert ((nope & 0x7F80) == 0).sum() > tiles      # zeros and bf16 subnormals


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_each_cache_op_launches_once_per_call_repeated_or_not(kind, monkeypatch):
    """A repeated call takes its prepared launch (one launch, no second full path)."""
    from dsv4_cupy.launch import PreparedLaunch
    launches = []
    run = PreparedLaunch.run
    monkeypatch.setattr(PreparedLaunch, "run",
                        lambda plan, stream: launches.append(plan) or run(plan, stream))
    rng = np.random.default_rng(12)
    k, slots = to_kind(random_k(rng, 5), kind), to_kind(np.arange(5, dtype=I64), kind)
    cache = pages_of(kind, 1, 64)
    indexer = indexer_pages(kind, 1, 64)
    k128 = to_kind(random_k(rng, 5)[:, :128].copy(), kind)
    out = to_kind(np.zeros((1, 5, HEAD), U16), kind)
    seq, table = to_kind(np.array([5], I32), kind), to_kind(np.zeros((1, 1), I32), kind)
    calls = [lambda: d4.quantize_and_insert_k_cache(k, cache, slots, 64),
             lambda: d4.dequantize_and_gather_k_cache(out, cache, seq, None, table, 64, 0),
             lambda: d4.indexer_k_quant_and_cache(k128, indexer, slots, 128, "ue8m0")]
    for call in calls:
        for _ in range(3):
            del launches[:]
            call()
            assert len(launches) == 1
