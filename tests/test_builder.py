"""DeepseekV4MetadataBuilder against the reference builder, for each array kind
and width policy, with poisoned persistent buffers."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

import reference as ref
from conftest import HOST_KINDS, KINDS, to_numpy
from helpers import (MAX_TOKENS, POISON, assert_gaps_kept, common_metadata, emulate_gpu_host,
                     make_batch, make_builder, poison, random_batch)


def check_build(builder, batch, kind):
    poison(builder)
    cm = common_metadata(batch, kind)
    md = builder.build(0, cm)
    width = builder.width(batch.max_seq_len)
    want = ref.build(builder.compress_ratio, 256, builder.decode_threshold - 1, width,
                     batch.qsl.tolist(), batch.seq_lens.tolist(), batch.block_table.tolist(),
                     batch.slot_mapping.tolist(), batch.positions.tolist(), batch.num_tokens,
                     batch.max_query_len, MAX_TOKENS)
    T = batch.num_tokens
    assert_gaps_kept(builder)
    np.testing.assert_array_equal(to_numpy(md.req_id_per_token), want["req_id_per_token"])
    assert (to_numpy(builder.req_id_per_token_buffer)[T:] == POISON).all()
    if builder.compress_ratio > 1:
        np.testing.assert_array_equal(to_numpy(builder.compressed_slot_mapping_buffer),
                                      want["slot_mapping"])
        np.testing.assert_array_equal(to_numpy(md.slot_mapping), want["slot_mapping"][:T])
    else:
        assert md.slot_mapping is cm.slot_mapping
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == (
        want["num_decodes"], want["num_prefills"], want["num_decode_tokens"],
        want["num_prefill_tokens"])
    nd, npf = md.num_decode_tokens, md.num_prefill_tokens
    if builder.compress_ratio != 128:
        assert md.c128a_global_decode_topk_indices is None and md.c128a_prefill_topk_indices is None
        return md
    gd_buf = to_numpy(builder.c128a_global_decode_buffer)
    pf_buf = to_numpy(builder.c128a_prefill_buffer)
    lens_buf = to_numpy(builder.c128a_decode_lens_buffer)
    if nd:
        gd = to_numpy(md.c128a_global_decode_topk_indices)
        assert gd.shape == (nd, 1, width)
        np.testing.assert_array_equal(gd.reshape(nd, width),
                                      np.array(want["c128a_global_decode"]).reshape(nd, width))
        np.testing.assert_array_equal(to_numpy(md.c128a_decode_topk_lens), want["c128a_decode_lens"])
    else:
        assert md.c128a_global_decode_topk_indices is None and md.c128a_decode_topk_lens is None
    if npf:
        pf = to_numpy(md.c128a_prefill_topk_indices)
        np.testing.assert_array_equal(pf, np.array(want["c128a_prefill"]).reshape(npf, width))
    else:
        assert md.c128a_prefill_topk_indices is None
    assert (gd_buf[nd:] == POISON).all() and (gd_buf[:, width:] == POISON).all()
    assert (pf_buf[npf:] == POISON).all() and (pf_buf[:, width:] == POISON).all()
    assert (lens_buf[nd:] == POISON).all()
    return md


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio,policy", [(128, "capacity"), (128, "active"), (4, "capacity"),
                                          (1, "capacity")])
def test_builder_random(kind, ratio, policy):
    rng = np.random.default_rng(ratio)
    max_model_len = 1 << 17   # capacity 1024
    builders = {}
    for _ in range(25):
        batch = random_batch(rng, ratio=ratio, max_prefix=max_model_len - 400)
        spec = batch.threshold - 1
        if spec not in builders:
            builders[spec] = make_builder(kind, ratio, max_model_len, policy, spec)
        check_build(builders[spec], batch, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_two_builds_share_memory_and_stride(kind):
    builder = make_builder(kind, 128, 1 << 17, "active")
    small = make_batch([1, 1], [100, 300])
    large = make_batch([1, 1], [100_000, 120_000])
    a = check_build(builder, small, kind)
    b = check_build(builder, large, kind)
    ga, gb = a.c128a_global_decode_topk_indices, b.c128a_global_decode_topk_indices
    assert ga.shape[-1] == 128 and gb.shape[-1] == 1024       # active widths differ...
    from dsv4_cupy.kinds import probe
    assert probe("a", ga).ptr == probe("b", gb).ptr   # ...same memory...
    stride = lambda x: x.stride(0) if hasattr(x, "stride") and callable(x.stride) else x.strides[0] // 4
    assert stride(ga) == stride(gb) == builder.capacity        # ...and the capacity stride


@pytest.mark.parametrize("kind", KINDS)
def test_empty_and_padding_only_steps(kind):
    builder = make_builder(kind, 128, 1 << 16)
    check_build(builder, make_batch([], []), kind)
    check_build(builder, make_batch([], [], pad_tokens=5), kind)
    check_build(builder, make_batch([0, 0], [10, 20], pad_tokens=3), kind)


def test_builder_rejects_other_kinds():
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, like="numpy")
    batch = make_batch([1], [10])
    cm = common_metadata(batch, "numpy")
    cm.positions = None
    with pytest.raises(ValueError, match="positions"):
        builder.build(0, cm)
    with pytest.raises(ValueError, match="num_actual_tokens"):
        builder.build(0, common_metadata(make_batch([100], [10]), "numpy").__class__(
            **{**common_metadata(make_batch([100], [10]), "numpy").__dict__, "num_actual_tokens": 65}))


@pytest.mark.skipif("torch_cpu" not in HOST_KINDS, reason="torch not installed")
def test_builder_torch_cpu_results_are_torch():
    import torch
    builder = make_builder("torch_cpu", 128, 1 << 16)
    md = builder.build(0, common_metadata(make_batch([1, 1, 40], [10, 300, 500]), "torch_cpu"))
    assert isinstance(md.c128a_prefill_topk_indices, torch.Tensor)
    assert md.c128a_prefill_topk_indices.data_ptr() == builder.c128a_prefill_buffer.data_ptr()
    exported = md.to_torch()
    assert exported.req_id_per_token.data_ptr() == md.req_id_per_token.data_ptr()


def test_a_prepared_group_build_returns_its_kept_metadata_on_the_cpu(monkeypatch):
    """The GPU path's host side, run on the CPU: torch CPU tensors counted as
    a GPU kind, launches packed without a device and run as a count. A
    repeated step takes the prepared launch and returns a copy of the kept
    metadata holding this step's arrays and maxima, the object returned before
    unchanged; a view the caller changed in place sends the step back to the
    checks, which keep new views."""
    torch = pytest.importorskip("torch")
    runs = emulate_gpu_host(monkeypatch)
    builder = make_builder("torch_cpu", 128, 1 << 20, spec=1)
    assert builder._prepared is not None
    batch = make_batch([2, 1, 2], [900, 40_000, 7], threshold=2, pad_tokens=1)
    cm = common_metadata(batch, "torch_cpu")
    first = builder.build(0, cm)
    first_fields = dict(vars(first))
    checked = builder._build_checked
    monkeypatch.setattr(builder, "_build_checked",
                        lambda cm: pytest.fail("a repeated step took the checked path"))
    for max_seq_len in (50_000, 60_000):
        cm.max_seq_len, cm.block_table_tensor = max_seq_len, cm.block_table_tensor[:]
        got = builder.build(0, cm)
        assert got is not first and got.max_seq_len == max_seq_len
        assert got.block_table is cm.block_table_tensor
        assert got.req_id_per_token is first.req_id_per_token
    assert vars(first) == first_fields
    assert len(runs) == 3 and runs[1] is runs[0] and runs[2] is runs[0]
    monkeypatch.setattr(builder, "_build_checked", checked)
    first.c128a_global_decode_topk_indices.unsqueeze_(0)
    again = builder.build(0, cm)
    assert again.c128a_global_decode_topk_indices.dim() == 3
    assert again.c128a_global_decode_topk_indices is not first.c128a_global_decode_topk_indices
    repeated = builder.build(0, cm)
    assert repeated.req_id_per_token is again.req_id_per_token and len(runs) == 5
    assert torch.equal(again.query_start_loc, cm.query_start_loc)
