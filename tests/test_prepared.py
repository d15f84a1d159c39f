"""Prepared GPU calls: a repeated call with the same buffers skips the checks and
relaunches; results stay right when inputs change in place, when a scalar or a
buffer changes, and when the caller changes a returned view."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

from conftest import GPU_KINDS, to_kind, to_numpy
from helpers import (POISON, assert_gaps_kept, common_metadata, make_batch, make_builder,
                     poison_gaps, poison_unseen, random_batch)

pytestmark = pytest.mark.gpu
I32, I64 = np.int32, np.int64


def device_inputs(batch, kind):
    return dict(qsl=to_kind(batch.qsl, kind), seq=to_kind(batch.seq_lens, kind),
                table=to_kind(batch.block_table, kind), positions=to_kind(batch.positions, kind),
                slots=to_kind(batch.slot_mapping, kind), t2r=to_kind(batch.token_map(), kind))


def run_ops(inputs, outputs, num_tokens, num_decode_tokens):
    d4.token_to_req_indices(inputs["qsl"], num_tokens, out=outputs["req"])
    d4.get_compressed_slot_mapping(num_tokens, inputs["slots"], inputs["qsl"], inputs["seq"],
                                   inputs["table"], 2, 128, outputs["slots"])
    return d4.build_c128a_topk_metadata(inputs["positions"], 128, num_decode_tokens,
                                        inputs["t2r"], inputs["table"], 2, inputs["slots"],
                                        outputs["decode"], outputs["lens"], outputs["prefill"],
                                        max_compressed_tokens=256)


def host_results(batch, num_decode_tokens):
    inputs = device_inputs(batch, "numpy")
    outputs = fresh_outputs(batch, "numpy")
    run_ops(inputs, outputs, batch.num_tokens, num_decode_tokens)
    return outputs


def fresh_outputs(batch, kind):
    T = batch.num_tokens
    return dict(req=to_kind(np.full(T + 2, POISON, I32), kind),
                slots=to_kind(np.full(T + 2, POISON, I64), kind),
                decode=to_kind(np.full((T, 260), POISON, I32), kind),
                lens=to_kind(np.full(T, POISON, I32), kind),
                prefill=to_kind(np.full((T, 260), POISON, I32), kind))


def same_shape_step(rng):
    return make_batch([1, 2, 1, 30], rng.integers(0, 30_000, 4), rng=rng, pad_tokens=2,
                      table_cols=200, threshold=2)


@pytest.mark.parametrize("kind", GPU_KINDS)
def test_repeated_op_calls_follow_inputs_changed_in_place(kind):
    rng = np.random.default_rng(5)
    first = same_shape_step(rng)
    inputs, outputs = device_inputs(first, kind), fresh_outputs(first, kind)
    for step in range(12):
        batch = first if step == 0 else same_shape_step(rng)
        for name, value in device_inputs(batch, "numpy").items():
            inputs[name][...] = to_kind(value, kind)
        for buffer in outputs.values():                 # unwritten cells must stay poisoned
            buffer[...] = POISON
        nd = 4 if step % 3 else 3                       # a scalar change misses the cache
        results = run_ops(inputs, outputs, batch.num_tokens, nd)
        want = host_results(batch, nd)
        for name in want:
            np.testing.assert_array_equal(to_numpy(outputs[name]), want[name], err_msg=name)
        assert to_numpy(results[0]).shape == (nd, 256)


@pytest.mark.parametrize("kind", GPU_KINDS)
def test_a_returned_view_changed_in_place_is_not_returned_again(kind):
    batch = same_shape_step(np.random.default_rng(1))
    inputs, outputs = device_inputs(batch, kind), fresh_outputs(batch, kind)
    decode, _, _ = run_ops(inputs, outputs, batch.num_tokens, 4)
    if kind == "cupy":
        decode.shape = (4, 1, 256)          # a no-copy reshape, allowed on a strided view
    else:
        decode.unsqueeze_(0)
    again, _, _ = run_ops(inputs, outputs, batch.num_tokens, 4)
    assert tuple(again.shape) == (4, 256)


@pytest.mark.parametrize("kind", GPU_KINDS)
def test_one_builder_over_many_steps_equals_the_cpu_builder(kind):
    rng = np.random.default_rng(9)
    gpu = d4.DeepseekV4MetadataBuilder(128, 1 << 20, 512, num_speculative_tokens=3,
                                       like=to_kind(np.zeros(1, I32), kind))
    cpu = d4.DeepseekV4MetadataBuilder(128, 1 << 20, 512, num_speculative_tokens=3)
    table = to_kind(np.zeros((20, 1100), I32), kind)        # persistent, refreshed in place
    for _ in range(40):
        batch = random_batch(rng, max_decodes=16, max_prefills=2, max_prefix=1 << 18)
        if batch.num_reqs > 20 or batch.block_table.shape[1] > 1100 or not batch.num_reqs:
            continue
        batch.threshold = 4
        cm = common_metadata(batch, kind)
        table[:batch.num_reqs, :batch.block_table.shape[1]] = to_kind(batch.block_table, kind)
        cm.block_table_tensor = table[:batch.num_reqs]
        host = common_metadata(batch, "numpy")
        host.block_table_tensor = to_numpy(table)[:batch.num_reqs]
        for _ in range(2):                               # the second build is a prepared one
            got, want = gpu.build(0, cm), cpu.build(0, host)
            for field in ("req_id_per_token", "slot_mapping", "c128a_global_decode_topk_indices",
                          "c128a_decode_topk_lens", "c128a_prefill_topk_indices"):
                g, w = getattr(got, field), getattr(want, field)
                assert (g is None) == (w is None), field
                if w is not None:
                    np.testing.assert_array_equal(to_numpy(g), w, err_msg=field)
            assert (got.num_decodes, got.num_prefill_tokens) == (want.num_decodes,
                                                                 want.num_prefill_tokens)


@pytest.mark.parametrize("kind", GPU_KINDS)
def test_a_repeated_group_step_returns_its_kept_metadata(kind):
    """A prepared build returns a copy of the first build's metadata (that
    one unchanged) holding this step's arrays, max_query_len and max_seq_len
    and the CPU builder's rows, nothing written outside the group's buffers;
    a view the caller changed in place gets new views."""
    rng = np.random.default_rng(12)
    gpu = make_builder(kind, 128, 1 << 20, spec=1)
    cpu = make_builder("numpy", 128, 1 << 20, spec=1)
    batch = make_batch([2, 1, 2], rng.integers(0, 40_000, 3), rng=rng, pad_tokens=1,
                       threshold=2)
    cm, host = common_metadata(batch, kind), common_metadata(batch, "numpy")
    first = gpu.build(0, cm)
    first_fields = dict(vars(first))
    for max_query_len, max_seq_len in ((1, 70_000), (2, 90_000), (2, batch.max_seq_len)):
        poison_unseen(gpu)
        poison_gaps(gpu)
        cm.block_table_tensor = cm.block_table_tensor[:]    # the same layout, a new object
        cm.max_query_len = host.max_query_len = max_query_len
        cm.max_seq_len = host.max_seq_len = max_seq_len
        got, want = gpu.build(0, cm), cpu.build(0, host)
        assert_gaps_kept(gpu)
        assert got is not first and got.req_id_per_token is first.req_id_per_token
        assert (got.max_query_len, got.max_seq_len) == (max_query_len, max_seq_len)
        assert got.query_start_loc is cm.query_start_loc
        assert got.block_table is cm.block_table_tensor
        for field in d4.DeepseekV4Metadata.RESULTS:
            g, w = getattr(got, field), getattr(want, field)
            assert (g is None) == (w is None), field
            if w is not None:
                np.testing.assert_array_equal(to_numpy(g), w, err_msg=field)
    if kind == "cupy":
        first.req_id_per_token.shape = (1, batch.num_tokens)
    else:
        first.req_id_per_token.unsqueeze_(0)
    assert vars(first) == first_fields
    again = gpu.build(0, cm)
    assert again.req_id_per_token.shape == (batch.num_tokens,)
    assert again.req_id_per_token is not first.req_id_per_token
    assert gpu.build(0, cm).req_id_per_token is again.req_id_per_token


def _layer_calls(rng):
    """Host inputs of one step of the per-layer ops: 6 requests, decodes then prefills."""
    query_lens = np.array([1, 2, 1, 3, 40, 7])
    seq = query_lens + rng.integers(0, 3000, len(query_lens))
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    tokens = int(qsl[-1])
    token_to_req = np.repeat(np.arange(len(query_lens)), query_lens).astype(np.int32)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq)])
    valid = rng.random(tokens) < 0.9
    table = rng.integers(0, 1 << 16, (len(query_lens), 64), dtype=np.int32)
    topk = rng.integers(-1, 900, (tokens, 512), dtype=np.int32)
    gather = d4.compute_prefill_gather_lens(qsl, seq.astype(np.int32), 0, len(query_lens))
    return dict(qsl=qsl, seq=seq.astype(np.int32), t2r=token_to_req, positions=positions,
                valid=valid, table=table, topk=topk, gather=gather)


def _run_layer_ops(x, outs):
    return {
        "swa": d4.compute_swa_indices_and_lens(128, x["qsl"], x["seq"], x["t2r"], x["valid"],
                                               x["table"], 64, out=outs["swa"]),
        "global": d4.compute_global_topk_indices_and_lens(x["topk"], x["t2r"], x["table"], 64,
                                                          x["valid"], out=outs["global"]),
        "short": (d4.fill_short_context_topk_indices(x["positions"], 512, 4,
                                                     out=outs["short"]),),
        "combine": d4.combine_topk_swa_indices(x["topk"], x["qsl"], x["seq"], x["gather"], 128,
                                               4, 512, 4000, 1000, out=outs["combine"]),
    }


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_repeated_layer_op_calls_follow_inputs_changed_in_place(kind):
    rng = np.random.default_rng(11)
    first = _layer_calls(rng)
    inputs = {name: to_kind(value, kind) for name, value in first.items()}
    tokens = first["topk"].shape[0]
    outs = {"swa": (to_kind(np.zeros((tokens, 1, 128), np.int32), kind),
                    to_kind(np.zeros(tokens, np.int32), kind)),
            "global": (to_kind(np.zeros((tokens, 512), np.int32), kind),
                       to_kind(np.zeros(tokens, np.int32), kind)),
            "short": to_kind(np.zeros((tokens, 512), np.int32), kind),
            "combine": (to_kind(np.zeros((tokens, 640), np.int32), kind),
                        to_kind(np.zeros(tokens, np.int32), kind))}
    for step in range(6):
        host = first if step == 0 else _layer_calls(rng)
        for name, value in host.items():
            inputs[name][...] = to_kind(value, kind)
        for buffers in outs.values():
            for buffer in (buffers if isinstance(buffers, tuple) else (buffers,)):
                buffer[...] = POISON
        got = _run_layer_ops(inputs, outs)
        want = _run_layer_ops(host, {name: None for name in outs})
        for op in want:
            for a, b in zip(got[op], want[op]):
                np.testing.assert_array_equal(to_numpy(a), to_numpy(b), err_msg=f"{op} step {step}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_an_output_the_op_allocated_is_never_written_by_a_later_call(kind):
    x = {name: to_kind(value, kind) for name, value in _layer_calls(np.random.default_rng(4)).items()}
    tokens = x["topk"].shape[0]
    indices = to_kind(np.zeros((tokens, 1, 128), np.int32), kind)
    args = (128, x["qsl"], x["seq"], x["t2r"], x["valid"], x["table"], 64)
    _, first_lens = d4.compute_swa_indices_and_lens(*args, out=(indices, None))
    kept = to_numpy(first_lens).copy()
    assert kept.any()
    x["valid"][...] = False                             # every length 0 on the second call
    _, second_lens = d4.compute_swa_indices_and_lens(*args, out=(indices, None))
    assert not to_numpy(second_lens).any()
    np.testing.assert_array_equal(to_numpy(first_lens), kept)
