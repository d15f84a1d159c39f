"""Bad input: a TypeError/ValueError naming the argument, raised before any
launch, with nothing written (outputs are poisoned and must stay so)."""
from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

import dsv4_cupy as d4

from helpers import POISON, assert_gaps_kept, common_metadata, make_batch, poison, poison_unseen

I32, I64 = np.int32, np.int64


def c128a_args(**changes):
    batch = make_batch([1, 1, 5], [1000, 200, 50], pad_tokens=1)
    nd = 2
    args = dict(positions=batch.positions, compress_ratio=128, num_decode_tokens=nd,
                token_to_req_indices=np.array([0, 1, 2, 2, 2, 2, 2, 0], I32),
                block_table=batch.block_table, block_size=2, slot_mapping=batch.slot_mapping,
                global_decode_buffer=np.full((4, 256), POISON, I32),
                decode_lens_buffer=np.full(4, POISON, I32),
                prefill_buffer=np.full((8, 256), POISON, I32), max_compressed_tokens=256)
    args.update(changes)
    return args


def assert_untouched(args):
    for name in ("global_decode_buffer", "decode_lens_buffer", "prefill_buffer"):
        buffer = args.get(name)
        if isinstance(buffer, np.ndarray):
            assert (buffer == POISON).all(), f"{name} was written before the error"


@pytest.mark.parametrize("changes,error,match", [
    (dict(positions=np.zeros(8, np.float32)), TypeError, "positions: expected dtype int32 or int64, got float32"),
    (dict(positions=np.zeros((8, 1), I64)), ValueError, "positions: expected a 1-D array"),
    (dict(token_to_req_indices=np.zeros(8, I64)), TypeError, "token_to_req_indices: expected dtype int32"),
    (dict(token_to_req_indices=np.zeros(1, I32)), ValueError, "token_to_req_indices: expected at least 2 elements"),
    (dict(block_table=np.zeros(5, I32)), ValueError, "block_table: expected a 2-D array"),
    (dict(block_table=np.zeros((3, 4), I64)), TypeError, "block_table: expected dtype int32"),
    (dict(slot_mapping=np.zeros(8, np.float64)), TypeError, "slot_mapping: expected dtype"),
    (dict(slot_mapping=np.zeros(1, I64)), ValueError, "slot_mapping: expected at least 2 elements"),
    (dict(num_decode_tokens=9), ValueError, "num_decode_tokens: expected an int <= 8, got 9"),
    (dict(num_decode_tokens=-1), ValueError, "num_decode_tokens: expected an int >= 0"),
    (dict(num_decode_tokens=2.0), TypeError, "num_decode_tokens: expected an int, got float"),
    (dict(compress_ratio=0), ValueError, "compress_ratio: expected an int >= 1, got 0"),
    (dict(block_size=0), ValueError, "block_size: expected an int >= 1, got 0"),
    (dict(block_size=True), TypeError, "block_size: expected an int, got bool"),
    (dict(max_compressed_tokens=257), ValueError, "max_compressed_tokens: expected at most the width"),
    (dict(decode_lens_buffer=np.full(1, POISON, I32)), ValueError, "decode_lens_buffer: expected at least 2 elements"),
    (dict(prefill_buffer=np.full((2, 256), POISON, I32)), ValueError, "prefill_buffer: expected at least 6 rows"),
    (dict(global_decode_buffer=np.full((4, 256), POISON, I64)), TypeError, "global_decode_buffer: expected dtype int32"),
    (dict(positions="positions"), TypeError, "positions: expected a numpy, cupy or torch array, got str"),
])
def test_c128a_rejects(changes, error, match):
    args = c128a_args(**changes)
    with pytest.raises(error, match=match):
        d4.build_c128a_topk_metadata(**args)
    assert_untouched(args)


def test_c128a_rejects_strided_and_aliased_arrays():
    args = c128a_args(positions=np.zeros(16, I64)[::2])
    with pytest.raises(ValueError, match="positions: expected a C-contiguous array"):
        d4.build_c128a_topk_metadata(**args)
    assert_untouched(args)
    shared = np.zeros((16, 256), I32)
    args = c128a_args(prefill_buffer=shared, block_table=shared[12:15, :8])   # output over input
    with pytest.raises(ValueError, match="prefill_buffer: output memory overlaps block_table"):
        d4.build_c128a_topk_metadata(**args)


def test_a_builders_buffers_refuse_inputs_inside_them():
    from dsv4_cupy.checks import OwnedBuffers
    from dsv4_cupy.kinds import probe
    buffers = [np.zeros(64, I32), np.zeros((4, 16), I32), np.zeros(8, I64),
               np.zeros((4, 1, 16), I32)]              # the SWA rows' [n, 1, W]
    owned = OwnedBuffers([probe(f"buffer{i}", b) for i, b in enumerate(buffers)])
    owned.check_inputs([probe("outside", np.zeros(64, I32)), None])
    for i, inside in enumerate((buffers[0][60:], buffers[1][2, 3:5], buffers[2][:1],
                                buffers[3][3, 0, 5:9])):
        with pytest.raises(ValueError, match=f"buffer{i}: output memory overlaps inside"):
            owned.check_inputs([probe("outside", np.zeros(4, I32)),
                                probe("inside", inside)])
    whole = np.zeros(64, I32)
    with pytest.raises(ValueError, match="b: a buffer overlaps another one"):
        OwnedBuffers([probe("a", whole[:40]), probe("b", whole[32:])])


def test_views_of_one_torch_block_are_watched_by_one_read():
    """Every view of a block of buffers (kinds.full_block_like_kind) shares its
    version counter: one read watches them all, and an in-place change of
    any is seen; the kernels' writes are not."""
    torch = pytest.importorskip("torch")
    from dsv4_cupy.keys import owned_state_reader, unchanged, watch
    from dsv4_cupy.kinds import full_block_like_kind
    block = full_block_like_kind(torch.zeros(1, dtype=torch.int32), {
        "a": ((8, 4), I32, 0), "b": ((5,), I64, -1), "c": ((3,), np.bool_, 0)})
    first, second, third = block["a"][:2], block["a"][2:5, :3], block["c"][1:]
    assert owned_state_reader(first)[0] == owned_state_reader(block["b"])[0]
    watched_all = watch(owned=(first, second, block["b"], third))
    assert len(watched_all) == 1
    block["a"].numpy()[...] = 7             # written outside torch, as the kernels write
    assert unchanged(watched_all)
    second.t_()                             # any in-place change through torch is seen
    assert not unchanged(watched_all)
    separate = watch(owned=(torch.zeros(3), torch.zeros(3)))
    assert len(separate) == 2               # two allocations: two reads


def test_a_launch_key_fixes_what_the_checks_read():
    """``keys.launch_key`` (torch tensors here; the GPU's are read the same way):
    equal for the same arrays and scalars, different for another address,
    shape, stride, dtype or scalar, a bool apart from its int, a torch
    subclass keyed as a tensor; None for host numpy arrays and floats."""
    torch = pytest.importorskip("torch")
    from dsv4_cupy.keys import launch_key
    buffer = torch.zeros(8, 6, dtype=torch.int32)
    view, rows = buffer[:4], buffer[:4, :3]

    def key(*first):
        return launch_key(*first, 3, None, "flat", (1, 2))
    same = key(view, buffer[0])
    assert same is not None and key(buffer[:4], buffer[0]) == same
    others = [key(buffer[1:5], buffer[0]), key(buffer[:3], buffer[0]), key(rows, buffer[0]),
              key(view.view(torch.float32), buffer[0]), key(view, buffer[:, 0]),
              launch_key(view, buffer[0], 4, None, "flat", (1, 2)),
              launch_key(view, buffer[0], 3, None, "native", (1, 2))]
    assert all(other is not None and other != same for other in others)
    assert key(buffer[:4, ::2], buffer[0]) != key(rows, buffer[0])     # strides alone
    assert launch_key(view, 1) != launch_key(view, True)
    assert launch_key(torch.nn.Parameter(view.float(), requires_grad=False)) is not None
    assert launch_key(view, np.zeros(2, I32)) is None
    assert launch_key(view, 1.0) is None


def test_token_map_and_slot_mapping_reject():
    out = np.full(4, POISON, I32)
    with pytest.raises(TypeError, match="query_start_loc: expected dtype int32, got int64"):
        d4.token_to_req_indices(np.array([0, 2], I64), 4, out=out)
    with pytest.raises(ValueError, match="out: expected at least 5 elements, got shape"):
        d4.token_to_req_indices(np.array([0, 2], I32), 5, out=out)
    with pytest.raises(ValueError, match="num_tokens: expected an int >= 0"):
        d4.token_to_req_indices(np.array([0, 2], I32), -1, out=out)
    assert (out == POISON).all()
    batch = make_batch([3, 4], [10, 20])
    slots = np.full(9, POISON, I64)
    base = (7, batch.slot_mapping, batch.qsl, batch.seq_lens, batch.block_table, 2, 128)
    bad = [(base[:2] + (batch.qsl[:2],) + base[3:], ValueError,
            "query_start_loc: expected at least 3 elements"),
           (base[:3] + (batch.seq_lens[:1],) + base[4:], ValueError,
            "seq_lens: expected at least 2"),
           (base[:5] + (0, 128), ValueError, "block_size: expected an int >= 1"),
           (base[:6] + (0,), ValueError, "compress_ratio: expected an int >= 1"),
           (base[:1] + (batch.slot_mapping[:6],) + base[2:], ValueError,
            "slot_mapping: expected at least 7 elements"),
           ((10, np.zeros(10, I64)) + base[2:], ValueError, "out: expected at least 10 elements")]
    for args, error, match in bad:
        with pytest.raises(error, match=match):
            d4.get_compressed_slot_mapping(*args, out=slots)
        assert (slots == POISON).all()
    with pytest.raises(TypeError, match="out: expected dtype int64, got int32"):
        d4.get_compressed_slot_mapping(*base, out=np.zeros(9, I32))
    with pytest.raises(ValueError, match="dcp_rank: expected an int <= 1"):
        d4.get_compressed_slot_mapping(*base, out=slots, dcp_world_size=2, cp_interleave=128,
                                       dcp_rank=2)


def test_split_refuses_device_and_bad_input():
    with pytest.raises(TypeError, match="query_start_loc: expected a host array"):
        d4.split_decodes_and_prefills([0, 1, 2])
    with pytest.raises(TypeError, match="query_start_loc: expected dtype"):
        d4.split_decodes_and_prefills(np.array([0, 1], np.float32))
    with pytest.raises(ValueError, match="decode_threshold: expected an int >= 0"):
        d4.split_decodes_and_prefills(np.array([0, 1], I32), decode_threshold=-1)


@pytest.mark.parametrize("validate", ["full"])
def test_full_validation_catches_bad_data(validate):
    batch = make_batch([3, 4], [10, 20])
    with pytest.raises(ValueError, match="query_start_loc: expected non-decreasing"):
        d4.token_to_req_indices(np.array([0, 5, 3], I32), 5, validate=validate)
    with pytest.raises(ValueError, match="seq_lens: expected seq_len >= query_len"):
        d4.get_compressed_slot_mapping(7, None, batch.qsl, np.array([1, 24], I32), batch.block_table, 2,
                                       128, validate=validate)
    with pytest.raises(ValueError, match="block_table: request 0 needs 2 blocks"), \
            pytest.warns(UserWarning, match="the ops take the storage block"):
        d4.get_compressed_slot_mapping(300, None, np.array([0, 300], I32), np.array([300], I32),
                                       np.zeros((1, 1), I32), 1, 128, validate=validate)
    with pytest.raises(ValueError, match=r"block_table: expected entries in \[0, 10\)"):
        table = np.full((1, 8), 50, I32)
        d4.build_c128a_topk_metadata(np.array([1000], I64), 128, 1, np.zeros(1, I32), table, 2,
                                     np.zeros(1, I64), max_compressed_tokens=128,
                                     validate=validate, num_cache_blocks=10)
    with pytest.raises(ValueError, match="validate: expected one of"):
        d4.token_to_req_indices(np.array([0, 1], I32), 1, validate="fast")


def test_full_validation_in_the_builder():
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, validate="full")
    batch = make_batch([30, 1], [0, 500])            # a decode after a prefill
    with pytest.raises(ValueError, match="query_start_loc_cpu: expected decodes before prefills"):
        builder.build(0, common_metadata(batch, "numpy"))
    ok = make_batch([1, 30], [500, 0])
    builder.build(0, common_metadata(ok, "numpy"))   # a well-formed step passes


@pytest.mark.parametrize("change,match", [
    (dict(max_seq_len=100), r"max_seq_len: expected at least every request's seq_len, got 100 "
                            r"< 500 for request 0"),
    (dict(max_query_len=1), r"max_query_len: expected at least every request's query length, "
                            r"got 1 < 30 for request 1"),
    (dict(query_start_loc_cpu=np.array([0, 1, 30], I32)),
     r"query_start_loc_cpu: expected the values of query_start_loc, got 30 at index 2 where "
     r"query_start_loc holds 31"),
])
def test_full_validation_checks_the_steps_host_values(change, match):
    """max_seq_len, max_query_len and query_start_loc_cpu decide the width, the
    split and the short-context rows on the host: full validation checks them
    against the arrays, in both builders, before any write."""
    cm = common_metadata(make_batch([1, 30], [499, 0]), "numpy")
    for name, value in change.items():
        setattr(cm, name, value)
    group = d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, validate="full")
    poison(group)
    with pytest.raises(ValueError, match=match):
        group.build(0, cm)
    assert all((buffer == POISON).all() for buffer in group.buffers().values())
    step = d4.DeepseekV4StepMetadataBuilder(1 << 16, 64, validate="full")
    cms = {name: dataclasses.replace(cm, seq_lens_cpu=cm.seq_lens) for name in
           ("swa", "c4a", "indexer", "c128a")}
    poison_unseen(step)
    before = {name: buffer.copy() for name, buffer in step.buffers().items()}
    with pytest.raises(ValueError, match=match):
        step.build(0, cms)
    for name, buffer in step.buffers().items():
        np.testing.assert_array_equal(buffer, before[name], err_msg=name)
    assert_gaps_kept(step)
    cm.__dict__.update(common_metadata(make_batch([1, 30], [499, 0]), "numpy").__dict__)
    group.build(0, cm)                                   # the same step, true values: passes


def test_builder_arguments():
    with pytest.raises(ValueError, match="width_policy"):
        d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, width_policy="packed")
    with pytest.raises(ValueError, match="like: expected"):
        d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, like="jax")
    with pytest.raises(ValueError, match="block_size: expected a multiple of compress_ratio"):
        d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, block_size=64)
    with pytest.raises(ValueError, match=r"compress_ratio: expected one of \(1, 2, 4, 128\), "
                                         r"got 64"):
        d4.DeepseekV4MetadataBuilder(64, 1 << 16, 64)
    assert d4.DeepseekV4MetadataBuilder(2, 1 << 16, 64).build(
        0, common_metadata(make_batch([1, 3], [40, 0], ratio=2), "numpy")).slot_mapping.shape == (4,)
    with pytest.raises(TypeError, match="common_attn_metadata: expected a CommonAttentionMetadata"):
        d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64).build(0, {"num_reqs": 1})
    with pytest.raises(TypeError, match="DeepseekV4MetadataBuilder: got an unexpected keyword "
                                        "argument 'blocksize'"):
        d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, blocksize=256)
    assert list(inspect.signature(d4.DeepseekV4MetadataBuilder).parameters)[:4] == [
        "compress_ratio", "max_model_len", "max_num_batched_tokens", "block_size"]


def test_builder_rejects_a_boundary_outside_the_step():
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64)
    cm = common_metadata(make_batch([1, 30], [500, 0]), "numpy")
    cm.query_start_loc_cpu = np.array([0, -5, 31], I32)       # garbage host boundaries
    with pytest.raises(ValueError, match="query_start_loc_cpu: expected the decode/prefill "
                                         "boundary inside"):
        builder.build(0, cm)
    assert (builder.c128a_prefill_buffer == -1).all()


def test_builder_reads_query_start_loc_up_to_num_reqs():
    """A padded query_start_loc (longer than num_reqs + 1) maps as on the GPU."""
    builder = d4.DeepseekV4MetadataBuilder(4, 1 << 16, 64)
    cm = common_metadata(make_batch([2, 2], [10, 20], ratio=4), "numpy")
    cm.query_start_loc = np.array([0, 2, 4, 8], I32)
    cm.num_actual_tokens = 8
    cm.slot_mapping = np.zeros(8, I64)
    md = builder.build(0, cm)
    assert md.req_id_per_token.tolist() == [0, 0, 1, 1, 0, 0, 0, 0]


def test_builder_rejects_step_arrays_inside_its_buffers():
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64)
    cm = common_metadata(make_batch([1, 1], [500, 700]), "numpy")
    cm.slot_mapping = builder.compressed_slot_mapping_buffer[:2]     # last step's result
    with pytest.raises(ValueError, match="compressed_slot_mapping_buffer: output memory overlaps "
                                         "slot_mapping"):
        builder.build(0, cm)


def test_builder_block_size_must_divide_by_the_ratio():
    with pytest.raises(ValueError, match="block_size: expected a multiple of compress_ratio"):
        d4.DeepseekV4MetadataBuilder(128, 1 << 16, 64, block_size=300)
