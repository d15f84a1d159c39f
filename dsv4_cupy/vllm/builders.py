"""vLLM 0.34's DeepSeek-V4 builders, built by dsv4_cupy (imported by ``register()``)."""
from __future__ import annotations

import logging

import torch
from vllm.models.deepseek_v4.sparse_mla import (DeepseekV4FlashMLABackend,
                                                DeepseekV4FlashMLAMetadata,
                                                DeepseekV4FlashMLAMetadataBuilder)
from vllm.v1.attention.backend import AttentionMetadataBuilder

import dsv4_cupy

logger = logging.getLogger("vllm.dsv4_cupy")
_said: set = set()


def say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.info("dsv4_cupy: %s", message)


def context_parallel(vllm_config) -> bool:
    parallel = vllm_config.parallel_config
    return (getattr(parallel, "decode_context_parallel_size", 1) > 1
            or getattr(parallel, "prefill_context_parallel_size", 1) > 1)


class Dsv4CupyFlashMLAMetadataBuilder(DeepseekV4FlashMLAMetadataBuilder):
    """vLLM's C128A/C4A ``DeepseekV4FlashMLAMetadataBuilder``, its metadata
    built by ``dsv4_cupy.DeepseekV4MetadataBuilder``: the same fields, shapes,
    dtypes and row strides, views of persistent buffers; the in-place clamp of
    the block table and the token map cached on the step's metadata are kept.
    Under context parallelism (which vLLM 0.34 refuses for DeepSeek-V4) it is
    vLLM's own builder."""

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
        dsv4_cupy.warmup(progress=False)

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        if self._library is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        if self.compress_ratio > 1:
            cm.block_table_tensor.clamp_(min=0)      # vLLM's later readers see the clamped table
        md = self._library.build(common_prefix_len, dsv4_cupy.CommonAttentionMetadata(
            query_start_loc=cm.query_start_loc, query_start_loc_cpu=cm.query_start_loc_cpu,
            seq_lens=cm.seq_lens, block_table_tensor=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping, num_reqs=cm.num_reqs,
            num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len, positions=cm.positions, is_prefilling=cm.is_prefilling,
            seq_lens_cpu_upper_bound=cm.seq_lens_cpu_upper_bound), fast_build)
        if cm._token_to_req_indices_cache is None:
            cm._token_to_req_indices_cache = md.req_id_per_token
        return DeepseekV4FlashMLAMetadata(
            num_reqs=md.num_reqs, max_query_len=md.max_query_len, max_seq_len=md.max_seq_len,
            num_actual_tokens=md.num_actual_tokens, query_start_loc=md.query_start_loc,
            slot_mapping=md.slot_mapping, block_table=md.block_table,
            req_id_per_token=md.req_id_per_token, block_size=md.block_size,
            topk_tokens=md.topk_tokens,
            c128a_global_decode_topk_indices=md.c128a_global_decode_topk_indices,
            c128a_decode_topk_lens=md.c128a_decode_topk_lens,
            c128a_prefill_topk_indices=md.c128a_prefill_topk_indices)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        """vLLM builds outside the graph: an eager build (at capacity width, the
        capture batch's ``max_seq_len`` being ``max_model_len``)."""
        return self.build(0, common_attn_metadata)


def install() -> dict:
    """Patch the backends' ``get_builder_cls``; what was patched, by name."""
    DeepseekV4FlashMLABackend.get_builder_cls = staticmethod(
        lambda: Dsv4CupyFlashMLAMetadataBuilder)
    return {"vllm.models.deepseek_v4.sparse_mla.DeepseekV4FlashMLABackend.get_builder_cls":
            f"{__name__}.Dsv4CupyFlashMLAMetadataBuilder"}
