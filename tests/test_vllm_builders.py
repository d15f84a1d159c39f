"""The vLLM plugin's builders against vLLM 0.34 itself (the `vllm` tier: runs
where vLLM is installed, skipped elsewhere). vLLM's own builders are the
reference, their Triton kernels run on CPU tensors in the interpreter; the
plugin's builders run the library's numba path. Every field of every build is
compared on random batches of 1-token and MTP decodes, prefills, graph
padding, zero-length requests and no request at all.

With vLLM installed, importing this module points vLLM and Triton at the CPU
for the whole process (CUDA_VISIBLE_DEVICES=""): run the tier as its own
pytest invocation (the README's command)."""
from __future__ import annotations

import copy
import types
import dataclasses
import importlib.util
import os
import tempfile

import numpy as np
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (the vllm tier)", allow_module_level=True)
for _name, _value in {"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "",
                      "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(_name, _value)

import vllm  # noqa: E402,F401
import torch  # noqa: E402

from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig,  # noqa: E402,F401
                         VllmConfig, set_current_vllm_config)
import vllm.v1.attention.backends.mla.sparse_swa as sparse_swa  # noqa: E402
from vllm.models.deepseek_v4.attention import (DeepseekV4Attention,  # noqa: E402
                                               _resolve_dsv4_kv_cache_dtype)
from vllm.models.deepseek_v4.nvidia.flashmla import (  # noqa: E402
    DeepseekSparseSWAFlashMLABackend, DeepseekSparseSWAFlashMLAMetadataBuilder)
from vllm.models.deepseek_v4.attention import DeepseekV4IndexerCache  # noqa: E402
from vllm.models.deepseek_v4.compressor import (CompressorBackend,  # noqa: E402
                                                CompressorMetadataBuilder, CompressorStateCache)
from vllm.v1.attention.backends.mla.indexer import (  # noqa: E402
    DeepseekV4IndexerBackend, DeepseekV32IndexerMetadataBuilder)
from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache  # noqa: E402
from vllm.v1.attention.ops.flashmla import FlashMLASchedMeta  # noqa: E402
from vllm.models.deepseek_v4.sparse_mla import (DeepseekV4FlashMLABackend,  # noqa: E402
                                                DeepseekV4FlashMLAMetadataBuilder)
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.worker.utils import AttentionGroup  # noqa: E402

from dsv4_cupy.vllm.builders import (Dsv4CupyCompressorMetadataBuilder,  # noqa: E402
                                     Dsv4CupyFlashMLAMetadataBuilder,
                                     Dsv4CupyIndexerMetadataBuilder, Dsv4CupySWAMetadataBuilder)

pytestmark = pytest.mark.vllm

MAX_MODEL_LEN, MAX_TOKENS, MAX_SEQS, BLOCK = 4096, 256, 8, 256


@pytest.fixture(scope="module")
def config():
    CpuPlatform.check_and_update_config = classmethod(lambda cls, vllm_config: None)
    # FlashMLA's extension is absent on CPU: an empty tile-scheduler holder, as on a GPU
    # before its first decode call.
    sparse_swa.get_mla_metadata = lambda *args, **kwargs: (FlashMLASchedMeta(), None)
    import transformers
    folder = tempfile.mkdtemp(prefix="dsv4cfg_")
    transformers.DeepseekV4Config(architectures=["DeepseekV4ForCausalLM"]).save_pretrained(folder)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=folder, skip_tokenizer_init=True,
                                 max_model_len=MAX_MODEL_LEN, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=BLOCK, cache_dtype="fp8_ds_mla"),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=MAX_TOKENS,
                                         max_num_seqs=MAX_SEQS, max_model_len=MAX_MODEL_LEN,
                                         is_encoder_decoder=False))
    hf = vllm_config.model_config.hf_config
    dtype, torch_dtype = _resolve_dsv4_kv_cache_dtype(True, "fp8_ds_mla",
                                                      vllm_config.cache_config)
    specs = {}
    with set_current_vllm_config(vllm_config):
        for ratio in (4, 128):
            layer = dataclasses.make_dataclass("Layer", ["compress_ratio", "kv_cache_dtype",
                                                          "kv_cache_torch_dtype", "head_dim"])
            specs[ratio] = DeepseekV4Attention.get_kv_cache_spec(
                layer(ratio, dtype, torch_dtype, hf.head_dim), vllm_config)
        specs["swa"] = DeepseekV4SWACache(
            head_dim=hf.head_dim, window_size=hf.sliding_window, dtype=torch_dtype,
            prefix="model.layers.0.attn.swa_cache", cache_config=vllm_config.cache_config,
            backend_cls=DeepseekSparseSWAFlashMLABackend).get_kv_cache_spec(vllm_config)
        for ratio, state_dim in ((4, 1024), (128, 512)):
            specs[f"compressor{ratio}"] = CompressorStateCache(
                state_dim=state_dim, dtype=torch.float32, compress_ratio=ratio,
                prefix=f"model.layers.{ratio}.attn.compressor.state").get_kv_cache_spec(
                    vllm_config)
        specs["indexer"] = DeepseekV4IndexerCache(
            head_dim=hf.index_head_dim + hf.index_head_dim // 128 * 4, dtype=torch.uint8,
            prefix="model.layers.3.attn.indexer.k_cache", cache_config=vllm_config.cache_config,
            compress_ratio=4).get_kv_cache_spec(vllm_config)
    return vllm_config, specs


def builders(config, ratio):
    """vLLM's builder and the plugin's for the C4A (4), C128A (128), SWA ("swa"),
    indexer or compressor-state ("compressor4", "compressor128") group."""
    vllm_config, specs = config
    compressor = (CompressorMetadataBuilder, Dsv4CupyCompressorMetadataBuilder)
    classes = {"swa": (DeepseekSparseSWAFlashMLAMetadataBuilder, Dsv4CupySWAMetadataBuilder),
               "indexer": (DeepseekV32IndexerMetadataBuilder, Dsv4CupyIndexerMetadataBuilder),
               "compressor4": compressor, "compressor128": compressor}
    theirs, ours = classes.get(ratio, (DeepseekV4FlashMLAMetadataBuilder,
                                       Dsv4CupyFlashMLAMetadataBuilder))
    extra = {"block_table_width": -(-MAX_MODEL_LEN // BLOCK)} if ratio == "indexer" else {}
    with set_current_vllm_config(vllm_config):
        return (theirs(specs[ratio], ["layer"], vllm_config, torch.device("cpu"), **extra),
                ours(specs[ratio], ["layer"], vllm_config, torch.device("cpu"), **extra))


def random_batch(rng, decodes, decode_len, prefills, pad, zero_rows=0, block=BLOCK):
    """A CommonAttentionMetadata: decodes of 1..decode_len tokens first, then
    prefill chunks, zero-length rows, then pad graph-padding tokens (slot -1);
    block tables of ``block``-token blocks."""
    query = [int(q) for q in rng.integers(1, decode_len + 1, decodes)] + list(prefills) + \
        [0] * zero_rows
    seq = [q + int(rng.integers(0, MAX_MODEL_LEN - 300)) if q else 0 for q in query]
    qsl = np.concatenate([[0], np.cumsum(query)]).astype(np.int32)
    tokens = int(qsl[-1]) + pad
    blocks = -(-MAX_MODEL_LEN // block)
    table = rng.integers(0, 500, (len(query), blocks)).astype(np.int32)
    table[rng.random(table.shape) < 0.05] = -1
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query, seq)] +
                               [rng.integers(0, 2000, pad)]).astype(np.int64)
    slots = rng.integers(0, 1 << 20, tokens).astype(np.int64)
    slots[int(qsl[-1]):] = -1
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl.copy()), query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens=torch.tensor(seq, dtype=torch.int32), num_reqs=len(query),
        num_actual_tokens=tokens, max_query_len=max(query, default=0),
        max_seq_len=max(seq, default=0), block_table_tensor=torch.from_numpy(table),
        slot_mapping=torch.from_numpy(slots), positions=torch.from_numpy(positions),
        is_prefilling=torch.tensor([q > decode_len for q in query]),
        seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32))


def assert_same(ours, theirs):
    assert type(ours) is type(theirs)
    for field in dataclasses.fields(theirs):
        a, b = getattr(ours, field.name), getattr(theirs, field.name)
        if isinstance(b, FlashMLASchedMeta) or b is None:
            assert type(a) is type(b), field.name
        elif isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), field.name
            assert (a.shape, a.dtype) == (b.shape, b.dtype), field.name
            assert a.stride() == b.stride(), field.name
            assert torch.equal(a, b), field.name
        else:
            assert a == b, field.name


STEPS = [(3, 1, [], 0, 0), (4, 2, [], 3, 0), (2, 2, [40, 7], 0, 1), (0, 1, [60], 2, 0),
         (0, 1, [], 0, 0), (5, 1, [], 0, 2)]


@pytest.mark.parametrize("ratio", [4, 128])
def test_every_field_equals_vllms_builder(config, ratio):
    theirs, ours = builders(config, ratio)
    rng = np.random.default_rng(ratio)
    addresses = None
    for decodes, depth, prefills, pad, zero_rows in STEPS:
        cm = random_batch(rng, decodes, depth, prefills, pad, zero_rows)
        cm_ours = copy.copy(cm)
        cm_ours.block_table_tensor = cm.block_table_tensor.clone()
        want = theirs.build(0, cm)
        got = ours.build(0, cm_ours)
        assert_same(got, want)
        # the side effects later code relies on: the clamped table, the cached token map
        assert torch.equal(cm_ours.block_table_tensor, cm.block_table_tensor)
        assert torch.equal(cm_ours._token_to_req_indices_cache[:cm.num_actual_tokens],
                           want.req_id_per_token)
        buffers = (ours.req_id_per_token_buffer.data_ptr(),
                   ours.compressed_slot_mapping_buffer.data_ptr())
        assert addresses in (None, buffers)
        addresses = buffers


@pytest.mark.parametrize("replay", [False, True])
def test_the_swa_builder_equals_vllms(config, replay):
    theirs, ours = builders(config, "swa")
    rng = np.random.default_rng(7 + replay)
    for decodes, depth, prefills, pad, zero_rows in STEPS:
        cm = random_batch(rng, decodes, depth, prefills, pad, zero_rows, block=64)
        start = None
        if replay:               # a replay start at or before each request's first query
            start = torch.from_numpy(np.array(
                [int(rng.integers(0, max(s - q, 0) + 1)) for s, q in zip(
                    cm.seq_lens.tolist(), np.diff(cm.query_start_loc_cpu.numpy()))], np.int32))
        want = theirs.build(0, copy.copy(cm), replay_start=start)
        got = ours.build(0, copy.copy(cm), replay_start=start)
        assert_same(got, want)


@pytest.mark.parametrize("ratio", [4, 128])
def test_the_compressor_builder_equals_vllms(config, ratio):
    """The compressors' state-cache builder: the library's token map (built, or
    the one an earlier group cached), vLLM's clamp, split and C128 boundary."""
    theirs, ours = builders(config, f"compressor{ratio}")
    rng = np.random.default_rng(19 + ratio)
    for decodes, depth, prefills, pad, zero_rows in STEPS:
        cm = random_batch(rng, decodes, depth, prefills, pad, zero_rows, block=ours.block_size)
        cm_ours = copy.copy(cm)
        cm_ours.block_table_tensor = cm.block_table_tensor.clone()
        want, got = theirs.build(0, cm), ours.build(0, cm_ours)
        assert type(got) is type(want)
        for field in dataclasses.fields(want):
            a, b = getattr(got, field.name), getattr(want, field.name)
            assert torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b, field.name
        assert torch.equal(cm_ours.block_table_tensor, cm.block_table_tensor)


def test_the_swa_draft_refresh_equals_vllms(config):
    """update_draft_decode_metadata after the step's lengths and tables changed in
    place (a speculator's draft step replaying captured metadata)."""
    theirs, ours = builders(config, "swa")
    rng = np.random.default_rng(23)
    results = []
    cm = random_batch(rng, 5, 1, [], 3, block=64)
    fresh = random_batch(rng, 5, 1, [], 3, block=64)
    for builder in (theirs, ours):
        mine = copy.copy(cm)
        mine.seq_lens, mine.block_table_tensor = cm.seq_lens.clone(), cm.block_table_tensor.clone()
        metadata = builder.build(0, mine)
        metadata.seq_lens.copy_(fresh.seq_lens)          # the draft step's arrays, in place
        metadata.block_table.copy_(fresh.block_table_tensor)
        builder.update_draft_decode_metadata(metadata)
        results.append(metadata)
    want, got = results
    real = int(cm.query_start_loc_cpu[-1])
    assert torch.equal(got.decode_swa_indices, want.decode_swa_indices)
    assert torch.equal(got.decode_swa_lens, want.decode_swa_lens)
    assert torch.equal(got.is_valid_token, want.is_valid_token)
    assert torch.equal(got.token_to_req_indices[:real], want.token_to_req_indices[:real])


def assert_same_tree(ours, theirs, path="metadata"):
    """Dataclasses field by field, lists item by item, tensors by value and shape;
    DeepGEMM's schedule (vLLM's, an uninitialised buffer on CPU) is not compared."""
    if path.endswith("schedule_metadata"):
        return
    if dataclasses.is_dataclass(theirs):
        assert type(ours) is type(theirs), path
        for field in dataclasses.fields(theirs):
            assert_same_tree(getattr(ours, field.name), getattr(theirs, field.name),
                             f"{path}.{field.name}")
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_tree(a, b, f"{path}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype), path
        assert torch.equal(ours, theirs), path
    else:
        assert ours == theirs, path


def test_the_indexer_builder_equals_vllms(config, monkeypatch):
    """The plugin's indexer builder with the indexer module's functions patched as
    install() patches them, against vLLM's builder with its own."""
    import vllm.v1.attention.backends.mla.indexer as indexer

    from dsv4_cupy.vllm import builders as plugin_builders
    import dsv4_cupy
    theirs, ours = builders(config, "indexer")
    originals = {name: getattr(indexer, name) for name in ("get_compressed_slot_mapping",
                                                           "build_prefill_chunk_metadata")}
    library = {"get_compressed_slot_mapping": dsv4_cupy.get_compressed_slot_mapping,
               "build_prefill_chunk_metadata": plugin_builders.build_prefill_chunk_metadata}
    rng = np.random.default_rng(13)
    for decodes, depth, prefills, pad, zero_rows in STEPS + [(2, 1, [100, 130, 5], 0, 0)]:
        cm = random_batch(rng, decodes, depth, prefills, pad, zero_rows)
        for name, function in originals.items():
            monkeypatch.setattr(indexer, name, function)
        want = theirs.build(0, copy.copy(cm))
        for name, function in library.items():
            monkeypatch.setattr(indexer, name, function)
        got = ours.build(0, copy.copy(cm))
        assert_same_tree(got, want)


@pytest.mark.parametrize("native", [True, False])
def test_the_indexer_decode_lengths_equal_vllms(config, native):
    """vLLM's producers of the decode lengths, called as its build calls them (a
    builder configured for next_n 4: its offsets): the native [B, next_n]
    lengths, and the flattening of uniform decodes and of mixed ones with graph
    padding (torch varlen), within the expanded table's 8 rows."""
    theirs, ours = builders(config, "indexer")
    theirs.offsets_buffer = torch.arange(4, dtype=torch.int32)
    rng = np.random.default_rng(17)
    for decode_lens, padding in (([2, 2, 2], 0), ([3, 1, 2, 0], 2)):
        cm = random_batch(rng, 0, 1, decode_lens, 0)
        nd, ndt = len(decode_lens), sum(decode_lens) + padding
        results = []
        ours._step_query_start_loc = cm.query_start_loc      # as its build sets it
        for builder in (theirs, ours):
            builder.decode_lens_buffer[:nd] = torch.tensor(decode_lens, dtype=torch.int32)
            builder.expanded_block_table_buffer.fill_(-7)
            results.append(builder._prepare_decode_tensors(
                cm.seq_lens[:nd], cm.block_table_tensor[:nd], builder.decode_lens_buffer[:nd],
                torch.tensor(decode_lens, dtype=torch.int32), cm.query_start_loc[:nd], nd, ndt,
                native, 4, max(decode_lens)))
        (want_lens, want_rows, want_decode, want_n, want_pad), got = results
        assert got[3] == want_n and got[4] == want_pad
        assert torch.equal(got[0], want_lens) and torch.equal(got[2], want_decode)
        real = sum(decode_lens)                 # padding rows: only column 0 is vLLM's
        assert torch.equal(got[1][:real], want_rows[:real])
        assert torch.equal(got[1][real:, 0], want_rows[real:, 0])


def test_a_capture_batch_gets_the_capacity_width(config):
    theirs, ours = builders(config, 128)
    cm = random_batch(np.random.default_rng(3), 4, 1, [], 0)
    cm.slot_mapping[:] = -1
    cm.max_seq_len = MAX_MODEL_LEN
    want = theirs.build_for_cudagraph_capture(copy.copy(cm))
    got = ours.build_for_cudagraph_capture(cm)
    rows, their_rows = got.c128a_global_decode_topk_indices, want.c128a_global_decode_topk_indices
    assert rows.shape[-1] == ours.c128a_max_compressed == their_rows.shape[-1]
    assert rows.stride() == their_rows.stride()
    # every token is padding: vLLM keeps its slot ids, the library writes -1 (README,
    # "Differences"); the lengths, 0, are what the kernels read
    assert (rows == -1).all() and (got.c128a_decode_topk_lens == 0).all()
    got.c128a_global_decode_topk_indices = their_rows
    assert_same(got, want)


def test_the_runner_builds_the_patched_class(config, monkeypatch):
    from dsv4_cupy.vllm import builders as plugin_builders
    vllm_config, specs = config
    import vllm.v1.attention.backends.mla.indexer as indexer
    for backend in (DeepseekV4FlashMLABackend, DeepseekSparseSWAFlashMLABackend,
                    DeepseekV4IndexerBackend, CompressorBackend):
        monkeypatch.setattr(backend, "get_builder_cls", backend.get_builder_cls)
    for name in ("get_compressed_slot_mapping", "build_prefill_chunk_metadata"):
        monkeypatch.setattr(indexer, name, getattr(indexer, name))
    plugin_builders.install()                # undone by the monkeypatches above
    for backend, spec, block, cls in (
            (DeepseekV4FlashMLABackend, specs[128], BLOCK, Dsv4CupyFlashMLAMetadataBuilder),
            (DeepseekSparseSWAFlashMLABackend, specs["swa"], 64, Dsv4CupySWAMetadataBuilder),
            (DeepseekV4IndexerBackend, specs["indexer"], BLOCK, Dsv4CupyIndexerMetadataBuilder),
            (CompressorBackend, specs["compressor4"], None, Dsv4CupyCompressorMetadataBuilder)):
        group = AttentionGroup(backend, ["layer"], spec, kv_cache_group_id=0)
        with set_current_vllm_config(vllm_config):
            group.create_metadata_builders(vllm_config, torch.device("cpu"),
                                           kernel_block_size=block)
        assert type(group.metadata_builders[0]) is cls


# --- the per-layer ops, as vLLM's NVIDIA attention calls them ------------------------------
def test_the_ops_equal_vllms(monkeypatch):
    import vllm.models.deepseek_v4.attention as attention
    import vllm.models.deepseek_v4.nvidia.flashmla as flashmla
    from vllm.models.deepseek_v4.common.ops import (combine_topk_swa_indices,
                                                    compute_global_topk_indices_and_lens)

    from dsv4_cupy.vllm import ops
    for module, name in ((flashmla, "compute_global_topk_indices_and_lens"),
                         (flashmla, "combine_topk_swa_indices"),
                         (attention, "fill_short_context_topk_indices")):
        monkeypatch.setattr(module, name, getattr(module, name))
    theirs_fill = attention.fill_short_context_topk_indices
    ops.install()
    rng = np.random.default_rng(11)
    # C4A decode rows: local top-k (with -1 holes) to global slots, padding tokens length 0
    topk = torch.from_numpy(rng.integers(-1, 300, (12, 64)).astype(np.int32))
    t2r = torch.from_numpy(rng.integers(0, 3, 12).astype(np.int32))
    table = torch.from_numpy(rng.integers(0, 1000, (3, 8)).astype(np.int32))
    valid = torch.from_numpy(rng.random(12) < 0.8)
    want = compute_global_topk_indices_and_lens(topk, t2r, table, 64, valid)
    got = flashmla.compute_global_topk_indices_and_lens(topk, t2r, table, 64, valid)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0][valid], want[0][valid])
    assert (got[0][~valid] == -1).all()        # padding rows: the README's "Differences"
    # a prefill chunk's combined rows, top-k entries inside each request's compressed rows
    qsl = torch.tensor([5, 25, 60], dtype=torch.int32)
    seq = torch.tensor([300, 700], dtype=torch.int32)
    gather = torch.tensor([20 + 127, 35 + 127], dtype=torch.int32)
    positions = np.concatenate([np.arange(280, 300), np.arange(665, 700)])
    local = np.stack([rng.integers(0, max((p + 1) // 4, 1), 16) for p in positions])
    local = torch.from_numpy(local.astype(np.int32))
    N = 700 // 4
    M = N + 35 + 127
    for images in (False, True):
        visible = (torch.from_numpy(rng.integers(0, 8, 55).astype(np.int32)) if images else None,
                   torch.from_numpy(rng.integers(0, 8, 55).astype(np.int32)) if images else None)
        outs = [(torch.full((55, 256), -7, dtype=torch.int32), torch.empty(55, dtype=torch.int32))
                for _ in range(2)]
        args = (local, qsl, seq, gather, 128, 4, 16, M, N)
        want = combine_topk_swa_indices(*args, out=outs[0], left_visible=visible[0],
                                        right_visible=visible[1], max_image_tokens=8)
        got = flashmla.combine_topk_swa_indices(*args, out=outs[1], left_visible=visible[0],
                                                right_visible=visible[1], max_image_tokens=8)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), images
    # the short-context fill, launched as attention.py launches it
    fill_positions = torch.from_numpy(rng.integers(0, 3000, 9))
    buffers = [torch.full((12, 512), -7, dtype=torch.int32) for _ in range(2)]
    theirs_fill[(9,)](buffers[0], fill_positions, TOP_K=512, COMPRESS_RATIO=4, PADDED_TOP_K=512,
                      num_warps=8)
    attention.fill_short_context_topk_indices[(9,)](buffers[1], fill_positions, TOP_K=512,
                                                    COMPRESS_RATIO=4, PADDED_TOP_K=512,
                                                    num_warps=8)
    assert torch.equal(buffers[0], buffers[1])


# --- the whole step in one launch, through vLLM's runner function ---------------------------
GROUP_BLOCKS = {"swa": 64, 4: BLOCK, "indexer": BLOCK, 128: BLOCK}


def runner_step(rng, decodes, depth, prefills, pad, zero_rows):
    """build_attn_metadata's arguments for one step of the four KV-cache groups
    (SWA, C4A, indexer, C128A: each its own block table and slot mapping)."""
    cm = random_batch(rng, decodes, depth, prefills, pad, zero_rows)
    tables, slots = [], []
    for block in GROUP_BLOCKS.values():
        table = rng.integers(0, 500, (cm.num_reqs, -(-MAX_MODEL_LEN // block))).astype(np.int32)
        table[rng.random(table.shape) < 0.05] = -1
        tables.append(torch.from_numpy(table))
        slot = rng.integers(0, 1 << 20, cm.num_actual_tokens)
        slot[int(cm.query_start_loc_cpu[-1]):] = -1
        slots.append(torch.from_numpy(slot))
    return dict(num_reqs=cm.num_reqs, num_tokens=cm.num_actual_tokens,
                query_start_loc_gpu=cm.query_start_loc, query_start_loc_cpu=cm.query_start_loc_cpu,
                max_query_len=cm.max_query_len, seq_lens=cm.seq_lens, max_seq_len=cm.max_seq_len,
                block_tables=tables, slot_mappings=slots,
                kv_cache_config=types.SimpleNamespace(kv_cache_groups=[None] * 4),
                seq_lens_cpu_upper_bound=cm.seq_lens_cpu_upper_bound, positions=cm.positions,
                is_prefilling=cm.is_prefilling)


def attention_groups(config, which):
    """One attention group per KV-cache group, their builders vLLM's (0) or the plugin's (1)."""
    backends = {"swa": DeepseekSparseSWAFlashMLABackend, "indexer": DeepseekV4IndexerBackend}
    groups = []
    for index, name in enumerate(GROUP_BLOCKS):
        builder = builders(config, name)[which]
        groups.append([AttentionGroup(backends.get(name, DeepseekV4FlashMLABackend),
                                      [f"layer.{name}"], builder.kv_cache_spec, index,
                                      metadata_builders=[builder])])
    return groups


@pytest.mark.parametrize("graphs", ["NONE", "FULL_AND_PIECEWISE"])
def test_the_one_launch_step_equals_vllms_per_group_builds(config, monkeypatch, graphs):
    """vLLM's build_attn_metadata, wrapped: the C128A, C4A and SWA groups from one
    step build (their per-group paths refused), the indexer as before; every
    layer's metadata equal to vLLM's builders'. Under FULL graphs a uniform
    decode step (one the runner may replay) is built per group instead."""
    import vllm.v1.attention.backends.mla.indexer as indexer
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

    import dsv4_cupy
    from dsv4_cupy.vllm import builders as plugin_builders
    from dsv4_cupy.vllm.step import wrap
    vllm_config, _ = config
    monkeypatch.setattr(vllm_config.compilation_config, "cudagraph_mode",
                        getattr(CUDAGraphMode, graphs))
    monkeypatch.setattr(DeepseekV32IndexerMetadataBuilder, "get_cudagraph_support",
                        classmethod(lambda cls, *args: sparse_swa.AttentionCGSupport
                                    .UNIFORM_BATCH))    # sm_90's, as on an H200
    theirs_groups, our_groups = attention_groups(config, 0), attention_groups(config, 1)
    steps = []
    step_build = dsv4_cupy.DeepseekV4StepMetadataBuilder.build
    monkeypatch.setattr(dsv4_cupy.DeepseekV4StepMetadataBuilder, "build",
                        lambda self, *a, **k: steps.append(1) or step_build(self, *a, **k))
    per_group = []                  # the C128A, C4A and SWA groups' own launches
    for cls, name in ((Dsv4CupySWAMetadataBuilder, "_rows"),
                      (dsv4_cupy.DeepseekV4MetadataBuilder, "build")):
        own = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, own=own: per_group.append(1)
                            or own(self, *a))
    originals = {name: getattr(indexer, name) for name in ("get_compressed_slot_mapping",
                                                           "build_prefill_chunk_metadata")}
    ours_step = wrap(build_attn_metadata)
    rng = np.random.default_rng(29)
    for decodes, depth, prefills, pad, zero_rows in STEPS + [(3, 1, [90, 33], 2, 0)]:
        args = runner_step(rng, decodes, depth, prefills, pad, zero_rows)
        for name, function in originals.items():
            monkeypatch.setattr(indexer, name, function)
        theirs_args, our_args = copy.deepcopy(args), copy.deepcopy(args)
        want = build_attn_metadata(theirs_groups, **theirs_args)
        monkeypatch.setattr(indexer, "get_compressed_slot_mapping",
                            dsv4_cupy.get_compressed_slot_mapping)
        monkeypatch.setattr(indexer, "build_prefill_chunk_metadata",
                            plugin_builders.build_prefill_chunk_metadata)
        del steps[:], per_group[:]
        got = ours_step(our_groups, **our_args)
        replayable = graphs != "NONE" and args["max_query_len"] <= 1
        assert (len(steps), len(per_group)) == ((0, 3) if replayable else (1, 0))
        assert want.keys() == got.keys()
        for layer in want:
            if "indexer" in layer:
                assert_same_tree(got[layer], want[layer], layer)
            else:
                assert_same(got[layer], want[layer])
        for mine, vllms in zip(our_args["block_tables"], theirs_args["block_tables"]):
            assert torch.equal(mine, vllms)      # the compressed groups' tables clamped
        rows = got["layer.128"].c128a_prefill_topk_indices
        if rows is not None:                     # one set of C128A buffers, either path
            assert rows.data_ptr() == our_groups[3][0].metadata_builders[0] \
                .c128a_prefill_buffer.data_ptr()


@pytest.mark.parametrize("ratios", [(128, 4), (128, 2), (2, 4), (128, 4, 4)])
def test_the_step_serves_one_c128a_one_c4a_and_one_swa_group(ratios):
    """step_groups takes a step's groups only where one FlashMLA builder of
    ratio 128, one of ratio 4 and one SWA builder serve them (a C2A group's
    builder is not the C4A group's): else None, and the step is built per group."""
    from dsv4_cupy.vllm.step import step_groups

    def group(builder):
        return types.SimpleNamespace(kernel_block_size=None,
                                     get_metadata_builder=lambda ubatch_idx: builder)
    flashmla = []
    for ratio in ratios:
        builder = object.__new__(Dsv4CupyFlashMLAMetadataBuilder)
        builder._library, builder.compress_ratio = object(), ratio
        flashmla.append(builder)
    swa = object.__new__(Dsv4CupySWAMetadataBuilder)
    found = step_groups([[group(builder)] for builder in (*flashmla, swa)], 0)
    if ratios == (128, 4):
        assert found == {"c128a": (0, flashmla[0]), "c4a": (1, flashmla[1]), "swa": (2, swa)}
    else:
        assert found is None


def test_a_step_the_step_builder_refuses_builds_per_group(config, monkeypatch, caplog):
    """A C4A table wider than the step builder takes (cdiv(max_model_len, 256)
    columns): the step is built per group, as vLLM's builders build it."""
    import logging

    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu.attn_utils import build_attn_metadata

    from dsv4_cupy.vllm.step import wrap
    vllm_config, _ = config
    monkeypatch.setattr(vllm_config.compilation_config, "cudagraph_mode", CUDAGraphMode.NONE)
    args = runner_step(np.random.default_rng(31), 2, 1, [50], 1, 0)
    c4a = list(GROUP_BLOCKS).index(4)
    args["block_tables"][c4a] = torch.nn.functional.pad(args["block_tables"][c4a], (0, 3))
    want = build_attn_metadata(attention_groups(config, 0), **copy.deepcopy(args))
    with caplog.at_level(logging.INFO, logger="vllm.dsv4_cupy"):
        got = wrap(build_attn_metadata)(attention_groups(config, 1), **copy.deepcopy(args))
    assert "per-group builds for a step the step builder refuses" in caplog.text
    for layer in want:
        if "indexer" not in layer:
            assert_same(got[layer], want[layer])


def test_the_runner_modules_get_the_step_once(monkeypatch):
    import importlib

    from dsv4_cupy.vllm import step
    modules = [importlib.import_module(name) for name in step.RUNNER_MODULES]
    originals = [module.build_attn_metadata for module in modules]
    for module, original in zip(modules, originals):
        monkeypatch.setattr(module, "build_attn_metadata", original)
    step.install()
    step.install()
    for module, original in zip(modules, originals):
        assert module.build_attn_metadata.wrapped_by_dsv4_cupy
        assert module.build_attn_metadata.__wrapped__ is original
