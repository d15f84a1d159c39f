"""DeepseekV4StepMetadataBuilder against the composition of the single ops, on
every array kind, with the builder's buffers poisoned before each build: every
group's outputs of random decode, mixed and prefill steps, the combined prefill
rows per chunk, the short-context rows, and one launch per step on the GPU."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import dsv4_cupy as d4
from dsv4_cupy.launch import PreparedLaunch

from conftest import GPU_KINDS, KINDS, to_kind, to_numpy
from helpers import (assert_gaps_kept, emulate_gpu_host, make_step, poison_unseen,
                     prepare_without_device)

I32, I64 = np.int32, np.int64
MAX_MODEL_LEN, MAX_TOKENS, W, SPEC = 8192, 1024, 128, 1


def composition(cms, builder):
    """The step's outputs from the single ops, each on fresh outputs."""
    cm = cms["c128a"]
    qsl, seq, T = cm.query_start_loc, cm.seq_lens, cm.num_actual_tokens
    host_qsl = cm.query_start_loc_cpu
    single = d4.DeepseekV4MetadataBuilder(
        128, builder.max_model_len, builder.max_num_batched_tokens,
        num_speculative_tokens=builder.c128a_group.decode_threshold - 1, like=cm.seq_lens)
    c128a = single.build(0, cm)
    nr, npf = c128a.num_decodes, c128a.num_prefills
    nd, ntp = c128a.num_decode_tokens, c128a.num_prefill_tokens
    req = d4.token_to_req_indices(qsl, T)
    valid = to_kind(to_numpy(cms["swa"].slot_mapping)[:T] >= 0, _kind(seq))
    out = {"req_id_per_token": req, "is_valid_token": valid, "c128a": c128a}
    rows, lens = d4.compute_swa_indices_and_lens(W, qsl, seq, req, valid,
                                                 cms["swa"].block_table_tensor, 64, 0, T)
    if nd:
        out.update(swa_decode_indices=rows[:nd], swa_decode_lens=lens[:nd])
    if ntp:
        out.update(swa_prefill_indices=rows[nd:], swa_prefill_lens=lens[nd:])
    for group in ("c4a", "indexer"):
        out[f"{group}_slot_mapping"] = d4.get_compressed_slot_mapping(
            T, None, qsl, seq, cms[group].block_table_tensor, 64, 4)[:T]
    if nd and builder.indexer_decode_layout == "native":
        depth = int(np.diff(host_qsl[:nr + 1]).max())
        lens, decode_lens = d4.build_indexer_native_decode_metadata(
            qsl[:nr + 1], seq,
            *((1, 4, nd) if builder.c128a_group.decode_threshold == 1 else (depth, 4)))
        out.update(indexer_context_lens=lens, indexer_decode_lens=decode_lens,
                   indexer_per_req_decode_lens=decode_lens)
    elif nd:
        (out["indexer_context_lens"], out["indexer_req_ids"], out["indexer_decode_lens"],
         out["indexer_block_rows"], out["indexer_per_req_decode_lens"]) = \
            d4.build_indexer_decode_metadata(
            qsl[:nr + 1], seq, cms["indexer"].block_table_tensor, nd, 4)
    if npf:
        gather = d4.compute_prefill_gather_lens(qsl, seq, nr, npf, W)
        out["prefill_gather_lens"] = gather
        host_seq = cm.seq_lens_cpu[nr:].astype(I64)
        (out["indexer_cu_compressed"], out["indexer_token_to_seq"], out["indexer_cu_seqlen_ks"],
         out["indexer_cu_seqlen_ke"], _) = d4.build_indexer_prefill_chunk_metadata(
            qsl[nr:], seq[nr:], 4, 0, ntp, num_compressed=int((host_seq // 4).sum()))
        if builder.combined_prefill:
            queries = np.diff(host_qsl[nr:]).astype(I64)
            width = c128a.c128a_prefill_topk_indices.shape[1]
            out["c128a"] = dataclasses.replace(c128a, c128a_prefill_topk_indices=None)
            for name, ratio, topk in (("c128a", 128, width), ("swa", 1, 0)):
                plan = d4.get_prefill_chunk_plan(host_seq, queries, ratio,
                                                 builder.prefill_chunk_size, W,
                                                 builder.max_model_len,
                                                 builder.max_num_batched_tokens)
                out[f"{name}_prefill_chunks"] = plan
                pieces, piece_lens = [], []
                for index, (start, end, N, M) in enumerate(plan):
                    a, b = nr + start, nr + end
                    # The last chunk also takes the step's padding rows.
                    rows = (ntp - int(host_qsl[a] - host_qsl[nr]) if index == len(plan) - 1
                            else int(host_qsl[b] - host_qsl[a]))
                    got = d4.build_c128a_combined_prefill_rows(
                        rows, qsl[a:b + 1], seq[a:b], gather[start:end],
                        W, 128 if ratio > 1 else 0, topk, M, N)
                    pieces.append(to_numpy(got[0]))
                    piece_lens.append(to_numpy(got[1]))
                out[f"{name}_combined_indices"] = np.concatenate(pieces)
                out[f"{name}_combined_lens"] = np.concatenate(piece_lens)
    if not builder._captured and cm.max_seq_len // 4 <= builder.index_topk and T:
        out["c4a_short_context_topk_indices"] = d4.fill_short_context_topk_indices(
            cm.positions, builder.index_topk, 4, T)
    return out


def _kind(x):
    module = type(x).__module__
    return "numpy" if module == "numpy" else "cupy" if module.startswith("cupy") else (
        "torch_cuda" if x.is_cuda else "torch_cpu")


def assert_equal(got, want):
    for name, expected in want.items():
        actual = getattr(got, name)
        if name == "c128a":
            for field in ("req_id_per_token", "slot_mapping", "c128a_global_decode_topk_indices",
                          "c128a_decode_topk_lens", "c128a_prefill_topk_indices"):
                a, e = getattr(actual, field), getattr(expected, field)
                assert (a is None) == (e is None), field
                if a is not None:
                    np.testing.assert_array_equal(to_numpy(a), to_numpy(e), err_msg=field)
        elif isinstance(expected, list):
            assert actual == expected, name
        else:
            assert actual is not None, name
            np.testing.assert_array_equal(to_numpy(actual), to_numpy(expected), err_msg=name)


def count_launches(monkeypatch):
    launches = []
    run = PreparedLaunch.run
    monkeypatch.setattr(PreparedLaunch, "run",
                        lambda plan, stream: launches.append(plan) or run(plan, stream))
    return launches


STEPS = [  # (decodes, prefill query lengths, padding tokens, short context)
    (6, [], 3, False), (1, [], 0, True), (4, [300, 17, 1, 64], 0, False),
    (0, [500, 2, 9, 33, 120, 7], 0, False), (3, [40, 60], 0, True), (0, [40, 60], 0, True),
    (2, [30, 50], 5, False)]


def checked_builds(builder, kind, rng, steps, monkeypatch):
    """Each step of ``steps`` built on poisoned buffers, in one launch on the GPU,
    and checked against the single ops; yields (short_context, the build)."""
    launches = count_launches(monkeypatch)
    for decodes, prefills, pad, short in steps:
        cms = make_step(rng, decodes, prefills, pad, short, kind)
        poison_unseen(builder)
        del launches[:]
        got = builder.build(0, cms)
        if kind in GPU_KINDS:
            assert len(launches) == 1
        assert_equal(got, composition(cms, builder))
        assert_gaps_kept(builder)
        yield short, got


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("combined", [False, True])
def test_the_step_equals_the_single_ops(kind, combined, monkeypatch):
    rng = np.random.default_rng(11 + combined)
    builder = d4.DeepseekV4StepMetadataBuilder(
        MAX_MODEL_LEN, MAX_TOKENS, num_speculative_tokens=SPEC, combined_prefill=combined,
        like=to_kind(np.zeros(1, I32), kind))
    for short, got in checked_builds(builder, kind, rng, STEPS * 2, monkeypatch):
        assert (got.c4a_short_context_topk_indices is not None) == short


@pytest.mark.parametrize("kind", KINDS)
def test_a_shared_c128a_group_writes_its_own_buffers(kind, monkeypatch):
    """c128a_group: the step's C128A rows in that builder's buffers, the same
    results as the step's own group, one launch; a group of another ratio or
    size refused."""
    like = to_kind(np.zeros(1, I32), kind)
    single = d4.DeepseekV4MetadataBuilder(128, MAX_MODEL_LEN, MAX_TOKENS,
                                          num_speculative_tokens=SPEC, like=like)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=SPEC, like=like,
                                               c128a_group=single)
    assert builder.c128a_group is single
    rng = np.random.default_rng(41)
    for _, got in checked_builds(builder, kind, rng, STEPS, monkeypatch):
        rows = got.c128a.c128a_global_decode_topk_indices
        if rows is not None:
            assert _kind(rows) == kind and d4.to_torch(rows).data_ptr() == d4.to_torch(
                single.c128a_global_decode_buffer).data_ptr()
    for group, error in ((d4.DeepseekV4MetadataBuilder(4, MAX_MODEL_LEN, MAX_TOKENS, like=like),
                          TypeError),
                         (d4.DeepseekV4MetadataBuilder(128, MAX_MODEL_LEN, 2 * MAX_TOKENS,
                                                       like=like), ValueError)):
        with pytest.raises(error, match="c128a_group"):
            d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS, like=like,
                                             c128a_group=group)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", [0, 1, 3])
def test_the_native_indexer_decode_layout_equals_its_op(kind, spec, monkeypatch):
    rng = np.random.default_rng(20 + spec)
    builder = d4.DeepseekV4StepMetadataBuilder(
        MAX_MODEL_LEN, MAX_TOKENS, num_speculative_tokens=spec, indexer_decode_layout="native",
        like=to_kind(np.zeros(1, I32), kind))
    launches = count_launches(monkeypatch)
    for decodes, prefills, pad, short in STEPS:
        cms = make_step(rng, decodes, prefills, pad, short, kind,
                        decode_len=None if spec else 1)
        poison_unseen(builder)
        del launches[:]
        got = builder.build(0, cms)
        if kind in GPU_KINDS:
            assert len(launches) == 1
        assert got.indexer_req_ids is None and got.indexer_block_rows is None
        if got.num_decode_tokens:
            rows = got.num_decodes if spec else got.num_decode_tokens
            assert to_numpy(got.indexer_context_lens).shape[0] == rows
        assert_equal(got, composition(cms, builder))


@pytest.mark.parametrize("kind", KINDS)
def test_wide_combined_rows_equal_the_ops(kind):
    """A 256K context: the C128A combined rows are at least geometry.WIDE_ROW wide,
    so the step's section gives each row a block (a warp below that)."""
    from dsv4_cupy import geometry
    rng = np.random.default_rng(12)
    max_model_len = 1 << 18
    builder = d4.DeepseekV4StepMetadataBuilder(max_model_len, MAX_TOKENS, combined_prefill=True,
                                               num_speculative_tokens=SPEC,
                                               like=to_kind(np.zeros(1, I32), kind))
    cms = make_step(rng, 3, [40, 300, 1], pad=3, kind=kind, max_model_len=max_model_len)
    poison_unseen(builder)
    got = builder.build(0, cms)
    assert geometry.combine_lanes(got.c128a_combined_indices.shape[1]) == geometry.THREADS
    assert geometry.combine_lanes(got.swa_combined_indices.shape[1]) == geometry.WARP_LANES
    assert_equal(got, composition(cms, builder))


@pytest.mark.parametrize("kind", KINDS)
def test_a_plan_longer_than_a_launch_carries_equals_the_ops(kind, monkeypatch):
    """1000 short prefills make more chunks than one launch carries: the GPU
    adds a launch of the combine sections per MAX_PLAN_CHUNKS chunks."""
    rng = np.random.default_rng(6)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, 4096, combined_prefill=True,
                                               prefill_chunk_size=1, max_num_compressed=1 << 21,
                                               like=to_kind(np.zeros(1, I32), kind))
    cms = make_step(rng, 2, [4] * 1000, kind=kind)
    poison_unseen(builder)
    launches = count_launches(monkeypatch)
    got = builder.build(0, cms)
    chunks = max(len(got.c128a_prefill_chunks), len(got.swa_prefill_chunks))
    assert chunks > d4.geometry.MAX_PLAN_CHUNKS
    if kind in GPU_KINDS:
        assert len(launches) == -(-chunks // d4.geometry.MAX_PLAN_CHUNKS)
    assert_equal(got, composition(cms, builder))


def test_a_step_builder_made_under_inference_mode_builds():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    with torch.inference_mode():           # inference tensors have no version counter
        builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                                   num_speculative_tokens=SPEC,
                                                   like=torch.zeros(1, dtype=torch.int32))
        cms = make_step(rng, 2, [30], kind="torch_cpu")
        builder.build(0, cms)
        assert_equal(builder.build(0, cms), composition(cms, builder))


def test_bad_steps_are_refused_naming_the_group():
    """Each refused before any write: every buffer keeps its first contents."""
    rng = np.random.default_rng(1)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=SPEC)
    before = [b.copy() for b in builder.buffers().values()]
    cms = make_step(rng, 2, [30])
    with pytest.raises(TypeError, match="one CommonAttentionMetadata per group"):
        builder.build(0, {k: v for k, v in cms.items() if k != "swa"})
    cms["swa"].slot_mapping = cms["swa"].slot_mapping.astype(I32)
    with pytest.raises(TypeError, match=r"\['swa'\].slot_mapping"):
        builder.build(0, cms)
    cms = make_step(rng, 2, [30, 40])
    cms["c128a"].query_start_loc_cpu = cms["c128a"].query_start_loc_cpu.copy()
    cms["c128a"].query_start_loc_cpu[-1] += 5000       # past the step's tokens
    with pytest.raises(ValueError, match="query_start_loc_cpu: expected the prefill"):
        builder.build(0, cms)
    cms = make_step(rng, 2, [30])
    cms["swa"].seq_lens = cms["swa"].seq_lens.copy()
    with pytest.raises(ValueError, match=r"\['swa'\].seq_lens.*share the query layout"):
        builder.build(0, cms)
    cms = make_step(rng, 2, [30])
    cms["c4a"].block_table_tensor = None
    with pytest.raises(TypeError, match=r"\['c4a'\].block_table_tensor: expected an array"):
        builder.build(0, cms)
    cms = make_step(rng, 2, [30])
    cms["c128a"].seq_lens_cpu = None
    with pytest.raises(ValueError, match="seq_lens_cpu: required"):
        builder.build(0, cms)
    cms = make_step(rng, 2, [30])
    cms["swa"].slot_mapping = builder.c4a_slot_mapping_buffer      # an output as an input
    with pytest.raises(ValueError, match="c4a_slot_mapping_buffer: output memory overlaps"):
        builder.build(0, cms)
    cms = make_step(rng, 2, [30])
    cms["indexer"].block_table_tensor = cms["indexer"].block_table_tensor[:1]
    with pytest.raises(ValueError, match=r"\['indexer'\].block_table_tensor"):
        builder.build(0, cms)
    for old, new in zip(before, builder.buffers().values()):
        np.testing.assert_array_equal(old, new)


@pytest.mark.parametrize("combined", [False, True])
def test_a_prefills_bad_host_lengths_are_refused_before_any_write(combined):
    """The host decisions over the prefills (one numba call) refuse a negative
    or past-int32 ``seq_lens_cpu``, more compressed rows than the indexer's
    buffer holds, and query lengths past the prefill tokens, naming the array."""
    rng = np.random.default_rng(9)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS, combined_prefill=combined,
                                               max_num_compressed=4000)
    for value, match in ((-1, r"seq_lens_cpu: expected the prefill requests' lengths in "
                              r"\[0, 2147483647\], got \[500, -1\]"),
                         (1 << 31, r"lengths in \[0, 2147483647\], got \[500, 2147483648\]"),
                         (16005, r"max_num_compressed=4000 compressed indexer rows over the "
                                 r"prefills, got 4126")):
        cms = make_step(rng, 2, [30, 40], decode_len=1)
        cms["c128a"].seq_lens_cpu = cms["c128a"].seq_lens_cpu.astype(I64)
        cms["c128a"].seq_lens_cpu[2:] = [500, value]
        _refused(builder, cms, ValueError, match)
    cms = make_step(rng, 2, [30, 40], decode_len=1)
    cms["c128a"].seq_lens_cpu[2:] = 500
    cms["c128a"].query_start_loc_cpu[3] = 80          # the last prefill's query: 72 - 80
    _refused(builder, cms, ValueError, r"query_start_loc_cpu: expected the prefill requests' "
                                       r"query lengths >= 0 .* got \[78, -8\]")


def test_a_chunk_whose_workspace_passes_int32_is_refused():
    """Unreachable with an indexer buffer that fits in memory (its compressed
    rows come first), so checked on the planner: 129 requests of 2**31 - 1
    tokens in one chunk need 129 * M > 2**31 rows."""
    from dsv4_cupy.group import Split
    from dsv4_cupy.metadata import CommonAttentionMetadata
    from dsv4_cupy.step_plan import prefill_plans
    qsl = np.arange(0, 2 * 131, 2, dtype=I32)
    seq = np.full(130, (1 << 31) - 1, I32)
    cm = CommonAttentionMetadata(query_start_loc=None, query_start_loc_cpu=qsl, seq_lens=None,
                                 block_table_tensor=None, slot_mapping=None, num_reqs=130,
                                 num_actual_tokens=260, max_query_len=2, max_seq_len=int(seq[0]),
                                 seq_lens_cpu=seq)
    split = Split(1, 129, 2, 258)
    rows_per_request = ((1 << 31) - 1) // 128 + 2 + W - 1
    plans, compressed = prefill_plans(cm, qsl, split, max_num_compressed=1 << 40, window_size=W,
                                      budgets=(rows_per_request, 1 << 40))
    assert compressed == 129 * (((1 << 31) - 1) // 4)
    assert len(plans.c128a) == 129 and len(plans.swa) == 1
    with pytest.raises(ValueError, match=rf"a prefill chunk's workspace \(M={rows_per_request} "
                                         r"rows per request, 129 requests\) exceeds int32"):
        prefill_plans(cm, qsl, split, max_num_compressed=1 << 40, window_size=W,
                      budgets=(1 << 40, 1 << 40))


def _refused(builder, cms, error, match):
    """The build raises ``error`` matching ``match`` and leaves every buffer as it was."""
    before = [to_numpy(b).copy() for b in builder.buffers().values()]
    with pytest.raises(error, match=match):
        builder.build(0, cms)
    for old, new in zip(before, builder.buffers().values()):
        np.testing.assert_array_equal(old, to_numpy(new))


@pytest.mark.parametrize("group", ["swa", "c4a", "indexer"])
def test_every_groups_slot_mapping_and_positions_are_checked(group):
    rng = np.random.default_rng(2)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=SPEC)
    poison_unseen(builder)
    for field, value, error, match in (
            ("slot_mapping", "abc", TypeError, "expected a numpy, cupy or torch array"),
            ("slot_mapping", None, TypeError, "expected an array, got None"),
            ("slot_mapping", np.zeros(5, np.float32), TypeError, "expected dtype int32 or int64"),
            ("slot_mapping", np.zeros(3, I64), ValueError, "expected at least"),
            ("positions", "abc", TypeError, "expected a numpy, cupy or torch array"),
            ("positions", np.zeros(40, np.float64), TypeError, "expected dtype int32 or int64"),
            ("positions", np.zeros((40, 2), I64), ValueError, "expected a 1-D array"),
            ("positions", np.zeros(3, I64), ValueError, "expected at least")):
        cms = make_step(rng, 2, [30])
        setattr(cms[group], field, value)
        _refused(builder, cms, error, rf"\[{group!r}\]\.{field}: {match}")


@pytest.mark.parametrize("kind", KINDS)
def test_full_validation_refuses_bad_data(kind):
    """Each bad step refused under ``validate="full"`` before any write; each
    builds under the default validation (data not read)."""
    rng = np.random.default_rng(3)
    builders = {mode: d4.DeepseekV4StepMetadataBuilder(
        MAX_MODEL_LEN, MAX_TOKENS, num_speculative_tokens=SPEC, like=to_kind(np.zeros(1, I32), kind), validate=mode,
        num_cache_blocks=1 << 16) for mode in ("default", "full")}
    poison_unseen(builders["full"])

    def shared(cms, name, change):
        value = to_numpy(getattr(cms["c128a"], name)).copy()
        change(value)
        value = to_kind(value, kind)
        for cm in cms.values():
            setattr(cm, name, value)
        return cms

    def own(cms, group, name, change):
        value = to_numpy(getattr(cms[group], name)).copy()
        change(value)
        setattr(cms[group], name, to_kind(value, kind))
        return cms

    def too_long(cms):
        cms = shared(cms, "seq_lens", lambda seq: seq.__setitem__(1, MAX_MODEL_LEN + 1))
        for cm in cms.values():
            cm.max_seq_len = MAX_MODEL_LEN + 1
        return cms

    def narrow(cms):
        cms["c4a"].block_table_tensor = to_kind(to_numpy(cms["c4a"].block_table_tensor)[:, :1],
                                                kind)
        return cms

    def first_position(positions):
        positions[0] += 1

    def first_slot_padding(slots):
        slots[0] = -1

    def first_block_outside(table):
        table[:] = 1 << 20

    cases = [
        (lambda cms: shared(cms, "seq_lens", lambda seq: seq.__setitem__(0, -5)),
         r"seq_lens: expected seq_len >= query_len"),
        (too_long, r"seq_lens: expected at most max_model_len \(8192\), got 8193 for request 1"),
        (lambda cms: own(cms, "swa", "positions", first_position),
         r"\['swa'\]\.positions: expected the C128A group's positions"),
        (lambda cms: own(cms, "indexer", "slot_mapping", first_slot_padding),
         r"\['indexer'\]\.slot_mapping: expected the padding tokens"),
        (narrow, r"\['c4a'\]\.block_table_tensor: request \d+ needs"),
        (lambda cms: own(cms, "indexer", "block_table_tensor", first_block_outside),
         r"\['indexer'\]\.block_table_tensor: expected entries in \[0, 65536\)"),
    ]
    for make_bad, match in cases:
        cms = make_bad(make_step(rng, 2, [30, 20], kind=kind))
        _refused(builders["full"], cms, ValueError, match)
        builders["default"].build(0, cms)


@pytest.mark.parametrize("kind", KINDS)
def test_full_validation_builds_what_the_default_builds(kind):
    rng = np.random.default_rng(4)
    full = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS, num_speculative_tokens=SPEC,
                                            like=to_kind(np.zeros(1, I32), kind), validate="full")
    default = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=SPEC,
                                               like=to_kind(np.zeros(1, I32), kind))
    for decodes, prefills in ((5, []), (3, [40, 7]), (0, [100])):
        cms = make_step(rng, decodes, prefills, kind=kind)
        assert_equal(full.build(0, cms), composition(cms, default))


def test_a_sequence_past_max_model_len_is_capped_by_default():
    """The documented default: C128A rows cut at what the width and table cover."""
    rng = np.random.default_rng(5)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=SPEC)
    cms = make_step(rng, 4, [], decode_len=1)
    seq = cms["c128a"].seq_lens.copy()
    seq[:] = 4 * MAX_MODEL_LEN
    for cm in cms.values():
        cm.seq_lens, cm.max_seq_len = seq, int(seq.max())
        cm.positions = None
    cms["c128a"].positions = (seq - 1).astype(I64)
    for cm in cms.values():
        cm.positions = cms["c128a"].positions
    lens = builder.build(0, cms).c128a.c128a_decode_topk_lens
    covered = cms["c128a"].block_table_tensor.shape[1] * builder.c128a_group.storage_block_size
    np.testing.assert_array_equal(lens, min(builder.c128a_group.capacity, covered))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_a_repeated_decode_step_takes_the_prepared_launch(kind, monkeypatch):
    """The second build of a step with the same arrays (new values) skips the
    checks and launches the prepared kernel into the same buffers, returning a
    new metadata object; its outputs are still the ops'. A returned view
    changed in place is never handed out again."""
    rng = np.random.default_rng(9)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=SPEC,
                                               like=to_kind(np.zeros(1, I32), kind))
    cms = make_step(rng, 8, [], 2, False, kind, decode_len=2)
    first = builder.build(0, cms)
    checked = builder._build_checked
    monkeypatch.setattr(builder, "_build_checked",
                        lambda *args: pytest.fail("a repeated step took the checked path"))
    fresh = make_step(rng, 8, [], 2, False, "numpy", decode_len=2)
    for group, cm in cms.items():
        for name in ("block_table_tensor", "slot_mapping"):
            getattr(cm, name)[...] = to_kind(getattr(fresh[group], name), kind)
    cms["c128a"].seq_lens[...] = to_kind(fresh["c128a"].seq_lens_cpu, kind)
    poison_unseen(builder)
    got = builder.build(0, cms)
    assert got is not first and got.swa_decode_indices is first.swa_decode_indices
    assert_equal(got, composition(cms, builder))
    monkeypatch.setattr(builder, "_build_checked", checked)
    if kind == "cupy":
        got.indexer_req_ids.shape = (1, got.indexer_req_ids.shape[0])
    else:
        got.indexer_req_ids.unsqueeze_(0)
    again = builder.build(0, cms)
    assert again.indexer_req_ids.shape == (cms["c128a"].num_actual_tokens,)
    if kind != "cupy":     # the same shape, other strides: torch's version counter sees it
        rows = again.swa_decode_indices
        rows.as_strided_(rows.shape, (1, 1, 1))
        assert builder.build(0, cms).swa_decode_indices.stride() == (128, 128, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_a_prefill_step_with_known_layouts_reuses_the_checks(kind, monkeypatch):
    """A step with prefills whose arrays have the layouts of an earlier one is
    not checked again, but its host decisions (split, chunk plans) are made
    from its own values: new query and sequence lengths give the ops' rows."""
    rng = np.random.default_rng(12)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=SPEC, combined_prefill=True,
                                               like=to_kind(np.zeros(1, I32), kind))
    cms = make_step(rng, 3, [40, 300], 2, False, kind, decode_len=2)
    builder.build(0, cms)
    monkeypatch.setattr(d4.step_builder, "check_groups",
                        lambda *args: pytest.fail("a step of known layouts was checked again"))
    fresh = make_step(rng, 3, [200, 140], 2, False, "numpy", decode_len=2)   # the same counts
    for group, cm in cms.items():
        for name in ("block_table_tensor", "slot_mapping"):
            getattr(cm, name)[...] = to_kind(getattr(fresh[group], name), kind)
    c128a, new = cms["c128a"], fresh["c128a"]
    for name in ("query_start_loc", "seq_lens", "positions"):
        getattr(c128a, name)[...] = to_kind(getattr(new, name), kind)
    c128a.query_start_loc_cpu[...] = new.query_start_loc_cpu
    c128a.seq_lens_cpu[...] = new.seq_lens_cpu
    for cm in cms.values():
        cm.max_query_len, cm.max_seq_len = new.max_query_len, new.max_seq_len
    poison_unseen(builder)
    got = builder.build(0, cms)
    assert got.num_decodes == 3 and got.num_prefills == 2
    assert_equal(got, composition(cms, builder))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_prefill_steps_of_one_layout_write_their_own_sizes(kind, monkeypatch):
    """Steps with prefills of one layout and split whose contexts move on
    replay the first one's prepared launch with their own chunk sizes (N, M)
    and indexer rows written in: one launch each, the single ops' rows, and
    no device memory allocated by the builds."""
    rng = np.random.default_rng(13)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=SPEC, combined_prefill=True,
                                               like=to_kind(np.zeros(1, I32), kind))
    cms = make_step(rng, 3, [40, 300], 2, False, kind, decode_len=2)
    for cm in cms.values():
        cm.max_seq_len = MAX_MODEL_LEN           # one width: the same host decisions
    builder.build(0, cms)
    if kind == "cupy":
        import cupy
        allocated = cupy.get_default_memory_pool().used_bytes
    else:
        import torch
        allocated = torch.cuda.memory_allocated
    launches = count_launches(monkeypatch)
    c128a = cms["c128a"]
    for _ in range(5):
        fresh = make_step(rng, 3, [40, 300], 2, False, "numpy", decode_len=2)["c128a"]
        for name in ("seq_lens", "positions"):
            getattr(c128a, name)[...] = to_kind(getattr(fresh, name), kind)
        c128a.seq_lens_cpu[...] = fresh.seq_lens_cpu
        poison_unseen(builder)
        del launches[:]
        before = allocated()
        got = builder.build(0, cms)
        assert allocated() == before and len(launches) == 1
        assert_equal(got, composition(cms, builder))
    (layout,) = builder._layouts._calls.values()
    assert len(layout.steps._calls) == 1


def test_the_step_kernel_refuses_a_section_it_does_not_have():
    from dsv4_cupy.step_kernel import step_launch
    with pytest.raises(KeyError, match="swa_rows"):
        step_launch({}, {"swa_rows": None})


def test_a_grid_past_one_wave_starts_at_the_indexers_decode_rows():
    from dsv4_cupy.step_kernel import SECTION_NAMES, first_block
    sizes = dict.fromkeys(SECTION_NAMES, 0) | {"token_map": 3, "c128a": 40, "swa": 5,
                                                "indexer_decode": 30}
    ends = dict(zip(SECTION_NAMES, np.cumsum(list(sizes.values())).tolist()))
    assert ends["gather"] == 48 and ends["short_context"] == 78
    assert first_block(ends, 77) == 48
    assert first_block(ends, 78) == 0                   # one wave: in order
    no_indexer = dict(ends, indexer_decode=48, indexer_native_decode=48, indexer_prefill=48,
                      c128a_combine=48, swa_combine=48, short_context=48)
    assert first_block(no_indexer, 1) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_steps_started_at_the_indexers_decode_rows_equal_the_single_ops(kind, monkeypatch):
    """With a wave of one block every step's grid starts at the indexer's
    decode rows (StepParams.first_block; every step has them: they zero the
    lengths past its tokens), wrapping round to the sections before them;
    what it writes is still the single ops'."""
    from dsv4_cupy import step_kernel
    from dsv4_cupy.bench.sections import section_ends
    monkeypatch.setattr(step_kernel, "resident_blocks", lambda *args: 1)
    first_at = step_kernel.PARAMS.offset_of("first_block")
    builder = d4.DeepseekV4StepMetadataBuilder(
        MAX_MODEL_LEN, MAX_TOKENS, num_speculative_tokens=SPEC, combined_prefill=True,
        like=to_kind(np.zeros(1, I32), kind))
    launches = count_launches(monkeypatch)    # the build's, then the single ops'
    for _ in checked_builds(builder, kind, np.random.default_rng(23), STEPS, monkeypatch):
        plan = launches[0]
        launches.clear()
        ends = section_ends(plan.storage)
        first = int(plan.storage[first_at:first_at + 8].view(np.int64)[0])
        assert 0 < first == ends["gather"] < ends["indexer_decode"]


@pytest.mark.gpu
def test_a_wave_is_the_step_kernels_resident_blocks():
    from dsv4_cupy import loader, step_kernel
    from dsv4_cupy.device import sm_count
    variant = {"positions": np.dtype(I64), "slot_mapping": np.dtype(I64), "rotated": 0}
    entry = step_kernel.FAMILY.entry_name(variant)
    threads = step_kernel.FAMILY.threads(variant)
    wave = loader.resident_blocks(step_kernel.FAMILY, entry, threads, 0)
    assert wave % sm_count(0) == 0 and 0 < wave <= 2048 // threads * sm_count(0)  # 2048 threads an SM


def test_the_combine_sections_carry_the_plans_rows_and_padding():
    """What the GPU launch packs for the combined rows (checked here, on the
    CPU, from the struct bytes): per launch at most MAX_PLAN_CHUNKS chunks,
    each chunk's first request, M and N, the rows it writes and where; the
    last chunk covers the step's padding rows."""
    import struct

    rng = np.random.default_rng(12)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, 4096, combined_prefill=True,
                                               prefill_chunk_size=1, max_num_compressed=1 << 21)
    cms = make_step(rng, 2, [4] * 1000 + [30], pad=7)
    got = builder.build(0, cms)
    plan = builder._plan(cms, builder._layout(cms, None), False)
    nr, npf, nd, ntp = plan.split
    host_qsl = cms["c128a"].query_start_loc_cpu
    launches = builder._launches(plan, None)
    layout = d4.combine.PREFILL_COMBINE
    for name, plan, buffers in (("c128a_combine", got.c128a_prefill_chunks,
                                 builder.c128a_combined_buffers),
                                ("swa_combine", got.swa_prefill_chunks,
                                 builder.swa_combined_buffers)):
        rows, lens = buffers
        stride = rows.strides[0] // 4
        chunks, covered = 0, 0
        for launch in launches:
            section = launch.inputs[name]
            if section == layout.off:                # a shorter plan needs fewer launches
                continue
            packed = np.frombuffer(struct.pack("<" + layout.format, *section.values()),
                                   layout.dtype)[0]
            count = int(packed["plan"]["chunks"])
            assert 0 < count <= d4.geometry.MAX_PLAN_CHUNKS
            piece = plan[chunks:chunks + count]
            first = nr + piece[0][0]
            t0 = int(host_qsl[first] - host_qsl[nr])
            assert t0 == covered                     # launches tile the prefill rows in order
            assert packed["rows"]["out"] == rows.ctypes.data + 4 * t0 * stride
            assert packed["rows"]["lens"] == lens.ctypes.data + 4 * t0
            assert packed["rows"]["query"]["num_reqs"] == piece[-1][1] - piece[0][0]
            assert packed["plan"]["first_request"][:count].tolist() == \
                [start - piece[0][0] for start, *_ in piece]
            assert packed["plan"]["swa_offset"][:count].tolist() == [N for _, _, N, _ in piece]
            assert packed["plan"]["rows_per_request"][:count].tolist() == \
                [M for *_, M in piece]
            covered = t0 + int(packed["rows"]["num_tokens"])
            chunks += count
        assert chunks == len(plan) and covered == ntp        # padding rows included
    assert len(launches) == -(-max(len(got.c128a_prefill_chunks),
                                   len(got.swa_prefill_chunks)) // d4.geometry.MAX_PLAN_CHUNKS) > 1




def assert_same_metadata(got, want):
    """Every field the same: arrays the same objects, the rest equal."""
    for field in dataclasses.fields(want):
        a, e = getattr(got, field.name), getattr(want, field.name)
        if dataclasses.is_dataclass(e):
            assert_same_metadata(a, e)
        elif isinstance(e, (int, list, type(None))):
            assert a == e, field.name
        else:
            assert a is e, field.name


@pytest.mark.parametrize("combined", [False, True])
def test_a_layouts_prepared_steps_pack_what_a_fresh_description_packs(combined, monkeypatch):
    """The GPU path of a step with prefills under a known layout: its
    sections kept frozen per set of host decisions (``SectionCache``: the
    indexer's compressed count set in its values, combine rows kept apart
    from their chunk plans), its prepared launches kept per set of host
    decisions but the chunks' N and M and the compressed count, which are
    written in (``PreparedStep``), and its result views, give the struct
    bytes, blocks and metadata a fresh description gives, step after step
    (checked on the CPU, the launches' storage without a device): new
    splits, query and sequence lengths, widths and chunk plans (more than a
    launch carries) under one layout, past the caches' size."""
    from dsv4_cupy.step_plan import MAX_LAYOUT_SECTIONS

    monkeypatch.setattr(d4.launch.Launch, "prepare", prepare_without_device)
    rng = np.random.default_rng(31)
    requests, tokens = 700, 2600
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, tokens + 7,
                                               num_speculative_tokens=SPEC,
                                               combined_prefill=combined, prefill_chunk_size=1,
                                               max_num_compressed=1 << 21)
    cms = make_step(rng, 0, [tokens - 3 * (requests - 1)] + [3] * (requests - 1), 7)
    layout = builder._layout(cms, None)
    c128a, most_launches = cms["c128a"], 0
    last, patched = {}, 0           # a kept PreparedStep's last values; hits with new ones
    for step in range(MAX_LAYOUT_SECTIONS + 40):
        if step % 3:                # the same split, contexts a few tokens on: new N, M
            seq = np.minimum(c128a.seq_lens_cpu + rng.integers(0, 3, requests), MAX_MODEL_LEN)
        else:                       # decodes of 2 tokens, prefills of 3 or more
            decodes = int(rng.integers(0, 40))
            prefills = requests - decodes
            query = np.concatenate([[2] * decodes, 3 + rng.multinomial(
                tokens - 2 * decodes - 3 * prefills, [1 / prefills] * prefills)])
            longest = int(rng.integers(2, MAX_MODEL_LEN - int(query.max())))
            seq = query + rng.integers(0, longest, requests)
            c128a.query_start_loc_cpu[...] = np.concatenate([[0], np.cumsum(query)])
            c128a.max_query_len, c128a.max_seq_len = int(query.max()), int(seq.max())
        c128a.seq_lens_cpu[...] = seq
        plan = builder._plan(cms, layout, False)
        kept = builder._prepared_step(plan, layout)
        values = (plan.compressed, plan.chunks)
        patched += id(kept) in last and last[id(kept)][1] is kept and last[id(kept)][0] != values
        last[id(kept)] = (values, kept)
        prepared, fresh = kept.launches, builder._launches(plan, None)
        assert len(prepared) == len(fresh)
        for ready, launch in zip(prepared, fresh):
            want = np.zeros(launch.layout.size, np.uint8)
            launch.layout.pack_values_into(want, launch.values())
            assert ready.storage.tobytes() == want.tobytes(), step
            assert ready.blocks == launch.blocks
        most_launches = max(most_launches, len(fresh))
        kept_metadata = builder._metadata(plan, layout.results)
        assert_same_metadata(kept_metadata, builder._metadata(plan))
        if step % 7 == 0:          # changed in place by the caller: not handed out again
            kept_metadata.c128a.req_id_per_token.shape = (1, plan.num_tokens)
            again = builder._metadata(plan, layout.results)
            assert again.c128a.req_id_per_token.shape == (plan.num_tokens,)
            assert again.req_id_per_token is again.c128a.req_id_per_token
            assert_same_metadata(again, builder._metadata(plan))
    assert most_launches > 1 if combined else most_launches == 1   # past MAX_PLAN_CHUNKS
    assert patched > MAX_LAYOUT_SECTIONS // 2   # most steps wrote new values into kept launches
    assert len(layout.sections._frozen) == MAX_LAYOUT_SECTIONS


def test_more_requests_than_the_query_layout_names_num_reqs():
    rng = np.random.default_rng(6)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=SPEC)
    cms = make_step(rng, 3, [])
    for cm in cms.values():
        cm.num_reqs = 5
    _refused(builder, cms, ValueError,
             r"num_reqs: expected at most len\(query_start_loc_cpu\) - 1 = 3 requests, got 5")


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_034s_upper_bound_and_decode_threshold(kind):
    """seq_lens_cpu_upper_bound stands for seq_lens_cpu (vLLM 0.34 has only it),
    and decode_threshold= sets the split's threshold directly."""
    rng = np.random.default_rng(7)
    like = to_kind(np.zeros(1, I32), kind)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS, combined_prefill=True,
                                               num_speculative_tokens=SPEC, like=like)
    cms = make_step(rng, 3, [40, 9], kind=kind)
    want = builder.build(0, cms)
    want_arrays = {f.name: to_numpy(getattr(want, f.name)) for f in dataclasses.fields(want)
                   if f.name != "c128a" and getattr(want, f.name) is not None
                   and not isinstance(getattr(want, f.name), (int, list))}
    bound = cms["c128a"].seq_lens_cpu
    cms["c128a"].seq_lens_cpu, cms["c128a"].seq_lens_cpu_upper_bound = None, bound
    got = builder.build(0, cms)
    for name, value in want_arrays.items():
        np.testing.assert_array_equal(to_numpy(getattr(got, name)), value, err_msg=name)
    assert got.c128a_prefill_chunks == want.c128a_prefill_chunks
    wide = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS, decode_threshold=3,
                                            like=like)
    three = make_step(rng, 2, [3, 3], kind=kind)                # 3-token rows: decodes at 3
    assert wide.build(0, three).num_prefills == 0
    assert wide.c128a_group.decode_threshold == 3


def _host_and_arrays(metadata) -> dict:
    """A step's metadata as host values: ints and lists as they are, arrays as numpy."""
    return {field.name: (value if isinstance(value, (int, list)) else to_numpy(value))
            for field in dataclasses.fields(metadata) if field.name != "c128a"
            and (value := getattr(metadata, field.name)) is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_host_arrays_refreshed_in_place_give_this_steps_split_and_plans(kind):
    """The split is kept by the query layout's contents and the checked view of
    seq_lens_cpu by its address (vLLM refreshes its persistent host buffers in
    place): a step whose query_start_loc_cpu and seq_lens_cpu are the last
    step's objects with new contents gets what a new builder makes of it."""
    rng = np.random.default_rng(11)
    like = to_kind(np.zeros(1, I32), kind)

    def builder():
        return d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS, combined_prefill=True,
                                                num_speculative_tokens=SPEC, like=like)

    kept = builder()
    first = make_step(rng, 3, [40, 9], kind=kind)
    kept.build(0, first)
    second = make_step(rng, 1, [12, 33, 700, 20], kind=kind)     # as many requests
    host = first["c128a"]
    for name in ("query_start_loc_cpu", "seq_lens_cpu"):
        getattr(host, name)[...] = getattr(second["c128a"], name)
        for cm in second.values():
            setattr(cm, name, getattr(host, name))
    got, want = kept.build(0, second), builder().build(0, second)
    assert (got.num_decodes, got.num_prefills) == (want.num_decodes, want.num_prefills) == (1, 4)
    got, want = _host_and_arrays(got), _host_and_arrays(want)
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_a_kept_host_seq_lens_view_is_the_callers_memory_and_rechecked_for_length():
    from types import SimpleNamespace

    from dsv4_cupy.prepared import PreparedCalls
    from dsv4_cupy.step_plan import MAX_HOST_VIEWS, host_seq_lens
    kept = PreparedCalls(MAX_HOST_VIEWS)
    seq = np.array([5, 9, 40], I32)
    cm = SimpleNamespace(seq_lens_cpu=seq, seq_lens_cpu_upper_bound=None)
    view = host_seq_lens(cm, 3, kept)
    assert host_seq_lens(cm, 2, kept) is view
    seq[1] = 77
    assert view[1] == 77
    with pytest.raises(ValueError, match=r"seq_lens_cpu: expected at least 4 elements, got "
                                         r"shape \(3,\)"):
        host_seq_lens(cm, 4, kept)
    cm.seq_lens_cpu = seq.astype(np.int64)                     # another array: checked anew
    assert host_seq_lens(cm, 3, kept).dtype == np.int64


def test_a_repeated_decode_step_returns_its_kept_metadata_on_the_cpu(monkeypatch):
    """The GPU path's host side on the CPU (``emulate_gpu_host``): a decode
    step laid out as the last one takes its prepared launch and returns a copy
    of the kept metadata, holding this step's maxima and the C128A group's
    arrays; the object returned before is unchanged."""
    torch = pytest.importorskip("torch")
    runs = emulate_gpu_host(monkeypatch)
    rng = np.random.default_rng(3)
    builder = d4.DeepseekV4StepMetadataBuilder(MAX_MODEL_LEN, MAX_TOKENS,
                                               num_speculative_tokens=SPEC,
                                               like=torch.zeros(1, dtype=torch.int32))
    cms = make_step(rng, 8, [], 2, False, "torch_cpu", decode_len=2)
    first = builder.build(0, cms)
    first_fields, first_c128a = dict(vars(first)), dict(vars(first.c128a))
    monkeypatch.setattr(builder, "_build_checked",
                        lambda *args: pytest.fail("a repeated step took the checked path"))
    c128a = cms["c128a"]
    for step in range(2):
        c128a.max_seq_len -= 1                      # the same width
        c128a.block_table_tensor = c128a.block_table_tensor[:]
        got = builder.build(0, cms)
        assert got is not first and got.c128a is not first.c128a
        assert got.max_seq_len == got.c128a.max_seq_len == c128a.max_seq_len
        assert got.c128a.block_table is c128a.block_table_tensor
        assert got.c128a.query_start_loc is c128a.query_start_loc
        assert got.swa_decode_indices is first.swa_decode_indices
    assert vars(first) == first_fields and vars(first.c128a) == first_c128a
    assert len(runs) == 3 and runs[1] is runs[0] is runs[2]
