"""vLLM 0.34's DeepSeek-V4 builders, built by dsv4_cupy (imported by ``register()``)."""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch
from vllm.models.deepseek_v4.compressor import CompressorBackend, CompressorMetadataBuilder
from vllm.models.deepseek_v4.nvidia.flashmla import (DeepseekSparseSWAFlashMLABackend,
                                                     DeepseekSparseSWAFlashMLAMetadataBuilder)
from vllm.models.deepseek_v4.sparse_mla import (DeepseekV4FlashMLABackend,
                                                DeepseekV4FlashMLAMetadata,
                                                DeepseekV4FlashMLAMetadataBuilder)
import vllm.v1.attention.backends.mla.indexer as indexer
from vllm.v1.attention.backend import AttentionMetadataBuilder
from vllm.v1.attention.backends.mla.indexer import (DeepseekV4IndexerBackend,
                                                    DeepseekV32IndexerMetadataBuilder,
                                                    DeepseekV32IndexerPrefillChunkMetadata)
from vllm.v1.attention.backends.mla.sparse_swa import (_LAYER_TYPE_C1A, _LAYER_TYPE_C2A,
                                                       _LAYER_TYPE_C4A, _LAYER_TYPE_C128A,
                                                       _LAYER_TYPE_SWAONLY,
                                                       DeepseekSparseSWAMetadata)

import dsv4_cupy
from .convert import flashmla_build

logger = logging.getLogger("vllm.dsv4_cupy")
_said: set = set()


def say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.info("dsv4_cupy: %s", message)


def warm_up_once() -> None:
    """The library's kernels prepared before the first step (once per process:
    vLLM makes a builder per group and micro-batch)."""
    if "kernels warmed up" not in _said:
        dsv4_cupy.warmup(progress=False)
        say_once("kernels warmed up")


def context_parallel(vllm_config) -> bool:
    parallel = vllm_config.parallel_config
    return (getattr(parallel, "decode_context_parallel_size", 1) > 1
            or getattr(parallel, "prefill_context_parallel_size", 1) > 1)


def served_step(builder, cm):
    """What the one-launch step (``dsv4_cupy.vllm.step``) built for this group's
    build, or None (no step, or a build of another table)."""
    views = builder._step_views
    if views is None or views[0] is not cm.block_table_tensor:
        return None
    if cm._token_to_req_indices_cache is None:      # as the first group built publishes it
        cm._token_to_req_indices_cache = views[1].req_id_per_token
    return views[1]


class Dsv4CupyFlashMLAMetadataBuilder(DeepseekV4FlashMLAMetadataBuilder):
    """vLLM's C128A/C4A ``DeepseekV4FlashMLAMetadataBuilder``, its metadata
    built by ``dsv4_cupy.DeepseekV4MetadataBuilder``: the same fields, shapes,
    dtypes and row strides, views of persistent buffers; the in-place clamp of
    the block table and the token map cached on the step's metadata are kept.
    Under context parallelism (which vLLM 0.34 refuses for DeepSeek-V4) it is
    vLLM's own builder."""

    _step_views = None          # (block table, metadata) handed over by the one-launch step
    _step_builder = None        # the step's builder, made by the first one-launch step
    _full_graph_support = None  # (the runner's support,) under FULL graphs, else (); found once

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        self._library = None
        if context_parallel(vllm_config):
            say_once("context parallelism: vLLM's own DeepSeek-V4 FlashMLA builder")
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            return
        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        self.model_config = vllm_config.model_config
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        self.topk_tokens = self.model_config.hf_config.index_topk
        self.compress_ratio = int(kv_cache_spec.tokens_per_state)
        library = self._library = dsv4_cupy.DeepseekV4MetadataBuilder(
            self.compress_ratio, self.model_config.max_model_len,
            vllm_config.scheduler_config.max_num_batched_tokens,
            block_size=int(kv_cache_spec.block_size), index_topk=self.topk_tokens,
            decode_threshold=self.reorder_batch_threshold or 1,
            like=torch.empty(0, dtype=torch.int32, device=device))
        # vLLM's buffer names, for code that reads them.
        self.req_id_per_token_buffer = library.req_id_per_token_buffer
        if self.compress_ratio > 1:
            self.compressed_slot_mapping_buffer = library.compressed_slot_mapping_buffer
        if library.has_c128a_rows:
            self.c128a_max_compressed = library.capacity
            self.c128a_global_decode_buffer = library.c128a_global_decode_buffer
            self.c128a_decode_lens_buffer = library.c128a_decode_lens_buffer
            self.c128a_prefill_buffer = library.c128a_prefill_buffer
        warm_up_once()

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        if self._library is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        served = served_step(self, common_attn_metadata)
        if served is None:
            served = flashmla_build(self._library, common_attn_metadata,
                                    DeepseekV4FlashMLAMetadata, common_prefix_len, fast_build)
        return served

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """vLLM builds outside the graph: an eager build (at capacity width, the
        capture batch's ``max_seq_len`` being ``max_model_len``)."""
        return self.build(0, common_attn_metadata)


def step_token_map(cm, buffer):
    """vLLM's ``cm.token_to_req_indices(buffer)`` by the library: the map cached on
    the step's metadata when an earlier group made it, else made into ``buffer``
    (``max(mapped tokens, num_actual_tokens)`` entries) and cached there."""
    if cm._token_to_req_indices_cache is None:
        tokens = max(int(cm.query_start_loc_cpu[-1]), cm.num_actual_tokens)
        cm._token_to_req_indices_cache = dsv4_cupy.token_to_req_indices(
            cm.query_start_loc[:cm.num_reqs + 1], tokens, out=buffer)
    return cm._token_to_req_indices_cache[:cm.num_actual_tokens]


class SWARows(NamedTuple):
    """One step's SWA rows and the arrays beside them, as vLLM's metadata names them."""
    token_map: torch.Tensor              # [T] int32
    is_valid: torch.Tensor               # [T] bool
    decode_rows: torch.Tensor            # [Td, 1, width] int32
    decode_lens: torch.Tensor            # [Td] int32
    prefill_rows: torch.Tensor | None    # [Tp, 1, W + image tokens] int32
    prefill_lens: torch.Tensor | None    # [Tp] int32
    gather_lens: torch.Tensor | None     # [P] int32
    left_visible: torch.Tensor | None = None
    right_visible: torch.Tensor | None = None


class Dsv4CupySWAMetadataBuilder(DeepseekSparseSWAFlashMLAMetadataBuilder):
    """vLLM's ``DeepseekSparseSWAFlashMLAMetadataBuilder`` whose rows come from the
    library's ops, written into vLLM's own persistent buffers: the token map,
    the decode and prefill SWA rows (image visibility, replay start and
    DSpark's non-causal rows included) and the prefill gather lengths. The
    split, the validity mask, the host slices and the FlashMLA tile-scheduler
    holders are vLLM's. ``update_draft_decode_metadata`` refreshes the decode
    rows with the same ops from the metadata's device arrays."""

    _step_views = None          # (block table, step metadata) handed over by the one-launch step

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        warm_up_once()

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False,
              replay_start=None):
        cm = common_attn_metadata
        qsl, seq, table = cm.query_start_loc, cm.seq_lens, cm.block_table_tensor
        num_decodes, num_prefills, nd, npt = dsv4_cupy.split_decodes_and_prefills(
            cm.query_start_loc_cpu[:cm.num_reqs + 1], self.decode_threshold,
            num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len)
        causal = bool(cm.causal)
        step = served_step(self, cm) if causal and replay_start is None else None
        rows = (self._step_rows(cm, step, nd) if step is not None else
                self._rows(cm, num_decodes, num_prefills, nd, npt, causal, replay_start))
        prefill = {}
        if num_prefills:
            prefill = dict(
                prefill_seq_lens=seq[num_decodes:],
                prefill_seq_lens_cpu=cm.seq_lens_cpu_upper_bound[num_decodes:],
                prefill_gather_lens=rows.gather_lens,
                prefill_query_lens_cpu=(
                    cm.query_start_loc_cpu[num_decodes + 1:num_decodes + num_prefills + 1]
                    - cm.query_start_loc_cpu[num_decodes:num_decodes + num_prefills]
                ).to(dtype=torch.int32),
                prefill_window_size=self.window_size, prefill_max_model_len=self.max_model_len,
                prefill_max_num_batched_tokens=self.max_num_batched_tokens)
        return DeepseekSparseSWAMetadata(
            seq_lens=seq, query_start_loc=qsl, query_start_loc_cpu=cm.query_start_loc_cpu,
            block_table=table, slot_mapping=cm.slot_mapping, is_valid_token=rows.is_valid,
            token_to_req_indices=rows.token_map, decode_swa_indices=rows.decode_rows,
            decode_swa_lens=rows.decode_lens,
            decode_swa_width=self.window_size if causal else self.noncausal_index_width,
            prefill_swa_indices=rows.prefill_rows, prefill_swa_lens=rows.prefill_lens,
            prefill_left_visible=rows.left_visible, prefill_right_visible=rows.right_visible,
            replay_start=self.no_replay_start if replay_start is None else replay_start,
            block_size=self.block_size, num_decodes=num_decodes, num_prefills=num_prefills,
            num_decode_tokens=nd, num_prefill_tokens=npt,
            max_decode_query_len=min(cm.max_query_len, self.decode_threshold),
            **self._tile_schedulers(nd), **prefill)

    def _step_rows(self, cm, step, nd) -> SWARows:
        """The rows the one-launch step built (empty views of vLLM's buffers for
        no decode token, as vLLM's build gives)."""
        decode = ((step.swa_decode_indices, step.swa_decode_lens) if nd else
                  (self.decode_swa_indices[:0], self.decode_swa_lens[:0]))
        return SWARows(cm._token_to_req_indices_cache[:cm.num_actual_tokens],
                       step.is_valid_token, *decode, step.swa_prefill_indices,
                       step.swa_prefill_lens, step.prefill_gather_lens)

    def _rows(self, cm, num_decodes, num_prefills, nd, npt, causal, replay_start) -> SWARows:
        """The step's rows by the library's ops, into vLLM's buffers."""
        qsl, seq = cm.query_start_loc, cm.seq_lens
        token_map = step_token_map(cm, self.token_to_req_indices)
        is_valid = self.is_valid_token[:cm.slot_mapping.shape[0]]
        torch.ge(cm.slot_mapping, 0, out=is_valid)
        rows = dict(query_start_loc=qsl, seq_lens=seq, token_to_req_indices=token_map,
                    is_valid_token=is_valid, block_table=cm.block_table_tensor,
                    block_size=self.block_size)
        decode_rows = self.decode_swa_indices
        if nd:
            self.decode_swa_lens[nd:] = 0
            if not causal:
                if self.decode_swa_indices_noncausal is None:
                    self.decode_swa_indices_noncausal = torch.zeros(
                        self._max_tokens, 1, self.noncausal_index_width, dtype=torch.int32,
                        device=self.device)
                decode_rows = self.decode_swa_indices_noncausal
            dsv4_cupy.compute_swa_indices_and_lens(
                self.window_size, token_offset=0, num_rows=nd,
                index_width=decode_rows.shape[-1], replay_start=replay_start, causal=causal,
                out=(decode_rows, self.decode_swa_lens), **rows)
        left = right = None
        spans = cm.mm_req_doc_ranges
        if self.max_image_tokens > 0 and npt and spans and any(spans.values()):
            left, right = self._image_visibility(cm, spans, nd, npt, token_map)
        if npt:
            dsv4_cupy.compute_swa_indices_and_lens(
                self.window_size, token_offset=nd, num_rows=npt,
                index_width=self.prefill_index_width, left_visible=left, right_visible=right,
                replay_start=replay_start, out=(self.prefill_swa_indices, self.prefill_swa_lens),
                **rows)
        gather_lens = dsv4_cupy.compute_prefill_gather_lens(
            qsl, seq, num_decodes, num_prefills, self.window_size,
            replay_start=replay_start) if num_prefills else None
        return SWARows(token_map, is_valid, decode_rows[:nd], self.decode_swa_lens[:nd],
                       self.prefill_swa_indices[:npt] if npt else None,
                       self.prefill_swa_lens[:npt] if npt else None, gather_lens, left, right)

    def update_draft_decode_metadata(self, metadata):
        """vLLM's capture-safe refresh of a draft step's decode rows (validity,
        token map, causal or DSpark rows), by the library's ops: the token map
        sends the tokens past the requests' to request 0, vLLM's to its search's
        last request (their rows are invalid either way)."""
        num_tokens = metadata.num_decode_tokens
        if num_tokens == 0:
            return
        torch.ge(metadata.slot_mapping, 0, out=metadata.is_valid_token)
        dsv4_cupy.token_to_req_indices(metadata.query_start_loc, num_tokens,
                                       out=metadata.token_to_req_indices)
        noncausal = self.decode_swa_indices_noncausal
        causal = not (noncausal is not None
                      and metadata.decode_swa_indices.data_ptr() == noncausal.data_ptr())
        width = metadata.decode_swa_indices.shape[-1]
        dsv4_cupy.compute_swa_indices_and_lens(
            width if causal else self.window_size, metadata.query_start_loc,
            metadata.seq_lens, metadata.token_to_req_indices, metadata.is_valid_token,
            metadata.block_table, self.block_size, 0, num_tokens, index_width=width,
            replay_start=metadata.replay_start if causal else None, causal=causal,
            out=(metadata.decode_swa_indices, metadata.decode_swa_lens))
        for field, holder in self._tile_schedulers(num_tokens).items():
            setattr(metadata, field, holder)
        metadata.flashinfer_sparse_index_cache.clear()

    def _tile_schedulers(self, num_decode_tokens: int) -> dict:
        """vLLM's FlashMLA tile-scheduler holders, by the metadata's field names."""
        holders = self.build_tile_scheduler(num_decode_tokens)
        return {f"tile_sched_{name}": holders[layer_type] for name, layer_type in (
            ("swaonly", _LAYER_TYPE_SWAONLY), ("c4a", _LAYER_TYPE_C4A),
            ("c128a", _LAYER_TYPE_C128A), ("c1a", _LAYER_TYPE_C1A), ("c2a", _LAYER_TYPE_C2A))}

    def _image_visibility(self, cm, spans, nd, npt, token_map):
        """vLLM's span CSR uploaded into its buffers, the library's visibility
        kernel into its left/right buffers: views of the step's tokens."""
        indptr, starts, ends = dsv4_cupy.image_span_csr(spans, cm.num_reqs)
        self.span_indptr[:cm.num_reqs + 1].copy_(torch.from_numpy(indptr))
        self.span_starts[:starts.size].copy_(torch.from_numpy(starts))
        self.span_ends[:ends.size].copy_(torch.from_numpy(ends))
        return dsv4_cupy.compute_image_visibility(
            self.span_indptr[:cm.num_reqs + 1], self.span_starts[:starts.size],
            self.span_ends[:ends.size], cm.query_start_loc[:cm.num_reqs + 1], cm.seq_lens,
            token_map, self.max_image_tokens, nd, npt,
            out=(self.left_visible, self.right_visible))


class Dsv4CupyIndexerMetadataBuilder(DeepseekV32IndexerMetadataBuilder):
    """vLLM's indexer builder for DeepSeek-V4 whose decode lengths and block rows
    come from the library's ops, written into vLLM's own buffers: the native
    ``[B, next_n]`` lengths (``build_indexer_native_decode_metadata``) and the
    flattened ones (``build_indexer_decode_metadata``, vLLM's uniform and
    torch-varlen producers); vLLM's build divides them by the ratio after, as
    it does its own. Its prefill chunks come from the library's planner; the
    compressed slot mapping and the chunk metadata from the library through
    the indexer module's functions (``install``). DeepGEMM's schedule and the
    sm_100 fused decode path stay vLLM's."""

    _step_query_start_loc = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        warm_up_once()

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        # vLLM hands the decode step the requests' starts only; the library's
        # kernels take the whole query layout.
        self._step_query_start_loc = common_attn_metadata.query_start_loc
        return super().build(common_prefix_len, common_attn_metadata, fast_build)

    @staticmethod
    def _split_indexer_prefill_chunks(compressed_seq_lens_cpu, prefill_query_lens_cpu,
                                      workspace_size, max_logits_bytes, request_offset=0,
                                      fused_mqa_topk_eligible=False):
        return dsv4_cupy.split_indexer_prefill_chunks(
            compressed_seq_lens_cpu, prefill_query_lens_cpu, workspace_size, max_logits_bytes,
            request_offset, fused_mqa_topk_eligible)

    def _prepare_decode_tensors(self, seq_lens, block_table, decode_lens, decode_lens_cpu,
                                query_start_loc, num_decodes, num_decode_tokens, use_native,
                                next_n, max_decode_len):
        if use_native and next_n == 1:           # no kernel: the step's own lengths
            return super()._prepare_decode_tensors(
                seq_lens, block_table, decode_lens, decode_lens_cpu, query_start_loc,
                num_decodes, num_decode_tokens, use_native, next_n, max_decode_len)
        qsl = self._step_query_start_loc[:num_decodes + 1]
        if use_native:
            lens, _ = dsv4_cupy.build_indexer_native_decode_metadata(
                qsl, seq_lens, max_decode_len, 1,
                out=(self.decode_seq_lens_buffer[:num_decodes * max_decode_len].view(
                    num_decodes, max_decode_len), self.decode_lens_buffer))
            requires_padding = int(decode_lens_cpu.min()) != max_decode_len
            return lens, block_table, decode_lens, num_decodes, requires_padding
        lens, _, ones, rows, _ = dsv4_cupy.build_indexer_decode_metadata(
            qsl, seq_lens, block_table, num_decode_tokens, 1,
            out=(self.decode_seq_lens_buffer, self.decode_indices_buffer,
                 self.decode_lens_buffer, self.expanded_block_table_buffer,
                 self.per_req_decode_lens_buffer))
        return lens, rows, ones, num_decode_tokens, False


class Dsv4CupyCompressorMetadataBuilder(CompressorMetadataBuilder):
    """vLLM's ``CompressorMetadataBuilder`` (the compressors' state caches)
    whose one kernel, the token map, is the library's (cached on the step's
    metadata, or made there when no group made it before); the clamp of the
    table, the split and the C128 boundary are vLLM's."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        step_token_map(common_attn_metadata, self.token_to_req_indices)
        return super().build(common_prefix_len, common_attn_metadata, fast_build)


_vllm_build_prefill_chunk_metadata = indexer.build_prefill_chunk_metadata


def build_prefill_chunk_metadata(start_idx, end_idx, query_start_loc, query_start_loc_cpu,
                                 uncompressed_seq_lens, compressed_seq_lens,
                                 compressed_seq_lens_cpu, block_table, compress_ratio,
                                 query_slice=None, skip_kv_gather=False, dcp_rank=0,
                                 dcp_world_size=1, cp_kv_cache_interleave_size=1, pcp_plan=None,
                                 positions=None):
    """vLLM 0.34's ``build_prefill_chunk_metadata`` (indexer.py) by the library's
    kernel: one launch, ``cu_seq_lens`` summed in it; vLLM's own under PCP."""
    if pcp_plan is not None:
        return _vllm_build_prefill_chunk_metadata(
            start_idx, end_idx, query_start_loc, query_start_loc_cpu, uncompressed_seq_lens,
            compressed_seq_lens, compressed_seq_lens_cpu, block_table, compress_ratio,
            query_slice, skip_kv_gather, dcp_rank, dcp_world_size, cp_kv_cache_interleave_size,
            pcp_plan, positions)
    chunk_lens = compressed_seq_lens_cpu[start_idx:end_idx]
    total = int(chunk_lens.sum())
    if total == 0:
        return None
    token_start, token_end, skip = dsv4_cupy.indexer_prefill_chunk_tokens(
        query_start_loc_cpu, start_idx, end_idx, query_slice, skip_kv_gather)
    first = int(query_start_loc_cpu[start_idx])
    cu, token_to_seq, ks, ke, local_cu = dsv4_cupy.build_indexer_prefill_chunk_metadata(
        query_start_loc[start_idx:end_idx + 1], uncompressed_seq_lens[start_idx:end_idx],
        compress_ratio, token_start - first, token_end - first, num_compressed=total,
        positions=None if positions is None else positions[first:], dcp_rank=dcp_rank,
        dcp_world_size=dcp_world_size, cp_kv_cache_interleave_size=cp_kv_cache_interleave_size)
    local_total = max_local_total = total
    if dcp_world_size > 1:                       # host counts, as vLLM keeps them
        per_rank = dsv4_cupy.get_dcp_local_seq_lens(chunk_lens.to(torch.int32), dcp_world_size,
                                                    None, cp_kv_cache_interleave_size)
        local_total = int(per_rank[:, dcp_rank].sum())
        max_local_total = int(per_rank.sum(dim=0).max())
    return DeepseekV32IndexerPrefillChunkMetadata(
        block_table=block_table[start_idx:end_idx], cu_seqlen_ks=ks, cu_seqlen_ke=ke,
        cu_seq_lens=cu, token_to_seq=token_to_seq, total_seq_lens=total,
        max_seqlen_k=int(chunk_lens.max()), token_start=token_start, token_end=token_end,
        num_reqs=end_idx - start_idx, skip_kv_gather=skip, local_cu_seq_lens=local_cu,
        local_total_seq_lens=local_total, max_local_total_seq_lens=max_local_total)


def install() -> dict:
    """Patch the backends' ``get_builder_cls`` and the indexer module's
    functions; what was patched, by name."""
    replaced = {}
    for backend, builder in ((DeepseekV4FlashMLABackend, Dsv4CupyFlashMLAMetadataBuilder),
                             (DeepseekSparseSWAFlashMLABackend, Dsv4CupySWAMetadataBuilder),
                             (DeepseekV4IndexerBackend, Dsv4CupyIndexerMetadataBuilder),
                             (CompressorBackend, Dsv4CupyCompressorMetadataBuilder)):
        backend.get_builder_cls = staticmethod(lambda builder=builder: builder)
        replaced[f"{backend.__module__}.{backend.__name__}.get_builder_cls"] = \
            f"{__name__}.{builder.__name__}"
    for name, function in (("get_compressed_slot_mapping", dsv4_cupy.get_compressed_slot_mapping),
                           ("build_prefill_chunk_metadata", build_prefill_chunk_metadata)):
        setattr(indexer, name, function)
        replaced[f"{indexer.__name__}.{name}"] = f"{function.__module__}.{name}"
    return replaced
