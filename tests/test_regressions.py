"""One named test per bug of the original (spec §4) that applies to this library."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

from conftest import GPU_KINDS, HOST_KINDS, KINDS, to_kind, to_numpy
from helpers import (POISON, check_c128a, check_slot_mapping, common_metadata, make_batch,
                     make_builder)

I32, I64 = np.int32, np.int64


@pytest.mark.parametrize("kind", KINDS)
def test_width_overflow_never_spills_into_the_next_row(kind):
    """§4.1: the kernel's default width (8192) wrote past narrow rows."""
    batch = make_batch([1, 1, 3], [1 << 19, 1 << 19, 1 << 19])
    rows = to_kind(np.full((8, 512), POISON, I32), kind)
    with pytest.raises(ValueError, match="a wider row would be written into the next row"):
        d4.build_c128a_topk_metadata(to_kind(batch.positions, kind), 128, 2,
                                     to_kind(batch.token_map(), kind),
                                     to_kind(batch.block_table, kind), 2,
                                     to_kind(batch.slot_mapping, kind), rows, None, rows,
                                     max_compressed_tokens=8192)
    assert (to_numpy(rows) == POISON).all()
    gd, _, pf = check_c128a(batch, kind, 512)         # exactly the buffer width: fine, contained
    assert (gd[:, :512] >= 0).all() and (pf == np.arange(512)).all()


def test_unaligned_widths_are_padded_to_128():
    """§4.2: width 17 (max_model_len 2136) crashed the sm100 head-64 decode kernel."""
    assert d4.c128a_capacity(2136) == 128
    for max_model_len in (1, 2136, 65_537, 300_000, 1_032_192, 1_048_575):
        assert d4.c128a_capacity(max_model_len) % 128 == 0
    _, _, pf = d4.build_c128a_topk_metadata(np.array([17 * 128 - 1], I64), 128, 0,
                                            np.zeros(1, I32), np.zeros((1, 1), I32), 2,
                                            np.zeros(1, I64))
    assert pf.shape == (1, 8192)          # default width: upstream's 8192, a multiple of 128


@pytest.mark.parametrize("kind", KINDS)
def test_row_stride_is_the_capacity_whatever_the_batch(kind):
    """§4.3 (#52448): a packed, batch-dependent row stride broke captured decode consumers."""
    builder = make_builder(kind, 128, 1 << 20, "active")
    strides = set()
    for prefix in (10, 40_000, 300_000, 1_000_000):
        md = builder.build(0, common_metadata(make_batch([1, 1, 1], [prefix] * 3), kind))
        gd = md.c128a_global_decode_topk_indices
        strides.add(gd.stride(0) if hasattr(gd, "data_ptr") else gd.strides[0] // 4)
    assert strides == {builder.capacity} == {8192}


@pytest.mark.parametrize("kind", KINDS)
def test_capture_at_more_than_max_model_len_clamps_to_capacity(kind):
    """§4.4: capture-time max_seq_len // 128 beyond the 8192 cap tripped an assert at 1M."""
    assert d4.c128a_active_width(1 << 20, 8192) == 8192
    assert d4.c128a_active_width((1 << 20) + 4096, 8192) == 8192
    builder = make_builder(kind, 128, 1 << 20, "active")
    batch = make_batch([1], [(1 << 20) + 1000])        # a capture dummy past max_model_len
    md = builder.build(0, common_metadata(batch, kind))
    assert md.c128a_global_decode_topk_indices.shape[-1] == 8192


@pytest.mark.parametrize("kind", KINDS)
def test_padding_tokens_get_length_zero_and_request_zero(kind):
    """§4.12 / §2.9.3: padding decode tokens: length 0, request 0, slot -1."""
    batch = make_batch([1, 1], [5000, 9000], pad_tokens=3, pad_position=200_000)
    batch.block_table = np.ascontiguousarray(batch.block_table[:, :80])   # narrow rows
    md = make_builder(kind, 128, 1 << 16).build(0, common_metadata(batch, kind))
    lens = to_numpy(md.c128a_decode_topk_lens)
    assert lens[2:].tolist() == [0, 0, 0] and (lens[:2] > 0).all()
    assert to_numpy(md.req_id_per_token)[2:].tolist() == [0, 0, 0]
    assert (to_numpy(md.slot_mapping)[2:] == -1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_addresses_past_two_to_the_31_elements(kind):
    """§4.11: int32 address arithmetic overflowed past 2^31 elements. Rows are
    placed 2^30 elements apart inside an 8 GiB buffer, so row 2 starts at 2^31."""
    import cupy
    width, stride = 256, 1 << 30
    flat = cupy.full(2 * stride + width, POISON, cupy.int32)
    rows = cupy.lib.stride_tricks.as_strided(flat, shape=(3, width), strides=(stride * 4, 4))
    table = cupy.lib.stride_tricks.as_strided(flat, shape=(3, 4), strides=(stride * 4, 4))
    lens = cupy.full(3, POISON, cupy.int32)
    positions = cupy.asarray(np.array([128 * 5 - 1, 300, 128 * 7], I64))
    if kind == "torch_cuda":
        import torch
        rows, lens, positions = (torch.from_dlpack(x) for x in (rows, lens, positions))
    _, _, pf = d4.build_c128a_topk_metadata(positions, 128, 0, to_kind(np.zeros(3, I32), kind),
                                            to_kind(np.zeros((1, 1), I32), kind), 2,
                                            to_kind(np.zeros(3, I64), kind), None, None, rows,
                                            max_compressed_tokens=width)
    got = to_numpy(pf)
    assert got[0, :6].tolist() == [0, 1, 2, 3, 4, -1] and got[2, :8].tolist() == list(range(7)) + [-1]
    # 64-bit strides also on the read side: decode lookups through a table row at 2^31
    flat[2 * stride: 2 * stride + 4] = cupy.asarray(np.array([7, 8, 9, 10], I32))
    gd = cupy.full((3, width), POISON, cupy.int32)
    d4.build_c128a_topk_metadata(cupy.asarray(np.array([128 * 3 - 1] * 3, I64)), 128, 3,
                                 cupy.asarray(np.array([2, 2, 2], I32)), table, 2,
                                 cupy.zeros(3, cupy.int64), gd, cupy.zeros(3, cupy.int32), None,
                                 max_compressed_tokens=width)
    assert gd[0, :4].get().tolist() == [14, 15, 16, -1]
    del flat


@pytest.mark.parametrize("kind", KINDS)
def test_slot_ids_beyond_int32_stay_exact(kind):
    """§4.11: the compressed slot (block * block_size + offset) is int64."""
    batch = make_batch([128], [0], ratio=4, rng=np.random.default_rng(3))
    batch.block_table[:] = (1 << 30) + 5
    out = check_slot_mapping(batch, kind)
    assert out[3] == ((1 << 30) + 5) * 64 > (1 << 31)


@pytest.mark.parametrize("kind", KINDS)
def test_sentinel_is_minus_one_not_zero(kind):
    """§4.13 (SGLang #24872): non-closing tokens wrote slot 0 and clobbered row 0."""
    batch = make_batch([300, 5], [0, 1000], pad_tokens=4)
    out = check_slot_mapping(batch, kind)
    closing = np.flatnonzero(out >= 0)
    assert closing.tolist() == [127, 255] and (np.delete(out, closing) == -1).all()


@pytest.mark.parametrize("kind", KINDS)
def test_width_is_the_cache_capacity_not_index_topk(kind):
    """§4.14: truncating C128A to index_topk dropped the newest compressed rows."""
    builder = make_builder(kind, 128, 1 << 20)
    assert builder.topk_tokens == 512 and builder.capacity == 8192
    batch = make_batch([1], [900_000])
    md = builder.build(0, common_metadata(batch, kind))
    lens = to_numpy(md.c128a_decode_topk_lens)
    assert lens[0] == (900_000 + 1) // 128 > 512
    assert (to_numpy(md.c128a_global_decode_topk_indices)[0, 0, :lens[0]] >= 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_masked_lanes_never_address_out_of_range(kind):
    """§4.10/4.18: garbage positions of padding tokens and narrow block-table rows.
    Padding tokens read nothing; rows past the table row's blocks are -1 and not
    counted (one rule everywhere); under compute-sanitizer memcheck the GPU run
    shows no invalid access."""
    table = np.arange(1, 7, dtype=I32).reshape(2, 3)
    positions = np.array([(1 << 40), 1000, -5, 1 << 20], I64)
    t2r = np.array([0, 1, 1, 0], I32)
    args = (to_kind(positions, kind), 128, 3, to_kind(t2r, kind), to_kind(table, kind), 2,
            to_kind(np.array([-1, 0, 0, -1], I64), kind))
    gd, lens, pf = (to_numpy(x) for x in d4.build_c128a_topk_metadata(*args, max_compressed_tokens=128))
    assert (gd[0] == -1).all()                 # padding (slot -1) with a garbage position
    # token 1 sees 7 rows, but its table row holds 3 blocks (6 rows): the 7th is -1
    assert gd[1, :7].tolist() == [8, 9, 10, 11, 12, 13, -1] and (gd[1, 6:] == -1).all()
    assert lens.tolist() == [0, 6, 0] and pf[0, :3].tolist() == [0, 1, 2]
    assert (gd[2] == -1).all()                        # negative position: nothing visible


@pytest.mark.parametrize("kind", KINDS)
def test_token_map_follows_the_device_query_start_loc(kind):
    """§4.9 (#56562): the host copy of the boundaries can be stale."""
    batch = make_batch([1, 2, 1], [10, 20, 30], threshold=2)
    cm = common_metadata(batch, kind)
    cm.query_start_loc_cpu = np.array([0, 2, 3, 4], I32)    # stale: same total, old boundaries
    md = make_builder(kind, 128, 1 << 16, spec=1).build(0, cm)
    assert to_numpy(md.req_id_per_token).tolist() == [0, 1, 1, 2]


def test_missing_positions_is_a_clear_error():
    """§4.8 (#43964): 'positions is required' — here a ValueError naming it."""
    cm = common_metadata(make_batch([1], [10]), "numpy")
    cm.positions = None
    with pytest.raises(ValueError, match="positions: required for C128A"):
        make_builder("numpy", 128, 1 << 16).build(0, cm)


def test_decode_threshold_is_one_plus_speculative_tokens():
    """§4.17: the C128A split must match the SWA builder's 1 + num_speculative_tokens."""
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, num_speculative_tokens=3)
    assert builder.decode_threshold == 4
    md = builder.build(0, common_metadata(make_batch([4, 4, 5], [100, 200, 300], threshold=4),
                                          "numpy"))
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefill_tokens) == (2, 8, 5)


def test_no_compile_on_the_serving_path_cpu(monkeypatch):
    """§4.6: JIT compiles in the serving loop. After warmup(cpu=True) a build
    compiles nothing: numba's dispatchers gain no new signature."""
    from dsv4_cupy import c128a, slot_mapping, token_map
    d4.warmup(gpu=False, cpu=True)
    dispatchers = (token_map.CPU_KERNEL, slot_mapping.CPU_KERNEL, *c128a.CPU_KERNEL.variants())
    before = [len(f.signatures) for f in dispatchers]
    builder = make_builder("numpy", 128, 1 << 16)
    batch = make_batch([1, 2, 40], [100, 5000, 0], threshold=2)
    batch.positions = batch.positions.astype(I32)
    builder.build(0, common_metadata(batch, "numpy"))
    assert [len(f.signatures) for f in dispatchers] == before


def test_no_compile_in_the_host_planners_after_warmup():
    """The split and the host decisions of a step with prefills are numba
    functions on both paths: after ``warmup()`` (its host planners, whatever
    the path), steps whose ``seq_lens_cpu`` and ``query_start_loc_cpu`` are
    int32 or int64, numpy or torch CPU, read-only or not, with or without
    ``is_prefilling``, ``split_decodes_and_prefills``, and
    ``get_prefill_chunk_plan`` on lists and arrays of any int dtype, compile
    nothing."""
    from dsv4_cupy import prefill_plan, split
    from helpers import make_step
    done = d4.warmup(gpu=False, cpu=False)
    assert done["gpu"] == done["cpu"] == [] and len(done["host"]) == 7
    planners = (prefill_plan.step_chunk_plans, prefill_plan._chunk_plan, split._first_prefill)
    before = [len(planner.signatures) for planner in planners]
    assert before == [4, 1, 2]
    rng = np.random.default_rng(3)
    for extends_are_decodes in (True, False):
        builder = d4.DeepseekV4StepMetadataBuilder(
            1 << 14, 1024, combined_prefill=True,
            treat_short_extends_as_decodes=extends_are_decodes)
        for seq_dtype in (np.int32, np.int64):
            for qsl_dtype in (np.int32, np.int64):
                for kind in HOST_KINDS:
                    cms = make_step(rng, 2, [30, 40], decode_len=1, max_model_len=1 << 14)
                    cm = cms["c128a"]
                    seq = cm.seq_lens_cpu.astype(seq_dtype)
                    qsl = cm.query_start_loc_cpu.astype(qsl_dtype)
                    prefilling = np.array([False, True, True, True])
                    for array in (seq, qsl, prefilling):
                        array.flags.writeable = kind != "numpy"
                    cm.seq_lens_cpu, cm.query_start_loc_cpu, cm.is_prefilling = (
                        to_kind(array, kind) for array in (seq, qsl, prefilling))
                    got = builder.build(0, cms)
                    assert got.num_prefills == (2 if extends_are_decodes else 3)
                    assert d4.split_decodes_and_prefills(qsl, 1)[1] == 2
    for lengths in ([5, 9], np.array([5, 9], np.uint16), np.array([5, 9], np.int64)):
        d4.get_prefill_chunk_plan(lengths, lengths, 4, 4, 64, 1024, 128)
    assert [len(planner.signatures) for planner in planners] == before


@pytest.mark.gpu
def test_no_compile_on_the_serving_path_gpu(monkeypatch):
    """After warmup() no call reaches the compiler: the loader is replaced by one that fails."""
    from dsv4_cupy import loader
    d4.warmup()

    def refuse(family):
        raise AssertionError(f"compiled {family} on the serving path")
    monkeypatch.setattr(loader, "_load", refuse)
    for kind in GPU_KINDS:
        batch = make_batch([1, 2, 40], [100, 5000, 0], threshold=2)
        make_builder(kind, 128, 1 << 16, spec=1).build(0, common_metadata(batch, kind))
        check_c128a(batch, kind, 256, np.int32, np.int32)


@pytest.mark.gpu
def test_the_gpu_build_never_syncs():
    """§4.19: a forced device->host sync per step. A CuPy stream capture fails on
    any sync or D2H copy, so a build that captures has none."""
    import cupy
    builder = make_builder("cupy", 128, 1 << 16)
    cm = common_metadata(make_batch([1, 1, 30], [100, 200, 300]), "cupy")
    builder.build(0, cm)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        builder.build(0, cm)
        graph = stream.end_capture()
    assert graph is not None
