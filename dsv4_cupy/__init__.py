"""dsv4_cupy: DeepSeek-V4 sparse-MLA attention metadata, exact and CUDA-graph safe.

The public functions keep the names and argument order of vLLM's DeepSeek-V4
FlashMLA sparse metadata code. numpy and torch CPU arrays run on the numba CPU
path; cupy and torch CUDA arrays run CuPy-compiled CUDA kernels on the
caller's stream. Results are of the same kind as the inputs.
"""
from .builder import DeepseekV4MetadataBuilder
from .c4a_layer import c4a_layer_topk
from .c128a import build_c128a_topk_metadata
from .combine import build_c128a_combined_prefill_rows, combine_topk_swa_indices
from .dcp import get_dcp_local_seq_lens
from .errors import (Dsv4Error, KernelCompileError, NoGPUError, NVRTCMissingError,
                     UnsupportedDeviceError)
from .global_topk import compute_global_topk_indices_and_lens
from .indexer_decode import build_indexer_decode_metadata
from .image_visibility import compute_image_visibility, image_span_csr
from .indexer_native_decode import build_indexer_native_decode_metadata
from .indexer_gather import cp_gather_indexer_k_quant_cache
from .indexer_insert import indexer_k_quant_and_cache
from .indexer_prefill import build_indexer_prefill_chunk_metadata
from .k_cache_gather import dequantize_and_gather_k_cache, dequantize_and_gather_prefill_kv
from .k_cache_select import dequantize_and_gather_selected_kv, selected_gather_scratch_len
from .k_cache_insert import quantize_and_insert_k_cache
from .kinds import to_torch
from .kv_cache import KVCacheLayout, empty_kv_cache, kv_cache_layout, kv_cache_view
from .launch import set_programmatic_launch
from .metadata import CommonAttentionMetadata, DeepseekV4Metadata
from .prefill_gather import compute_prefill_gather_lens
from .prefill_plan import (get_prefill_chunk_plan, indexer_prefill_chunk_tokens,
                           indexer_prefill_workspace_rows, split_indexer_prefill_chunks)
from .short_context import fill_short_context_topk_indices
from .slot_mapping import get_compressed_slot_mapping
from .spec import (C128A_TOPK_ALIGNMENT, FP8_DS_MLA_BYTES_PER_TOKEN, HEAD_SIZE, KV_BLOCK_SIZE,
                   PAD_SLOT_ID, DeepseekV4FlashMLABackend, c128a_active_width, c128a_capacity,
                   get_dspark_swa_index_width, kv_cache_shape)
from .split import split_decodes_and_prefills
from .step_builder import DeepseekV4StepMetadata, DeepseekV4StepMetadataBuilder
from .swa import compute_swa_indices_and_lens
from .token_map import token_to_req_indices
from .warmup import warmup

__version__ = "0.1.0"

__all__ = [
    "token_to_req_indices", "split_decodes_and_prefills", "get_compressed_slot_mapping",
    "build_c128a_topk_metadata", "get_dcp_local_seq_lens", "CommonAttentionMetadata", "DeepseekV4Metadata",
    "DeepseekV4MetadataBuilder", "DeepseekV4StepMetadataBuilder", "DeepseekV4StepMetadata",
    "DeepseekV4FlashMLABackend", "c128a_capacity",
    "c128a_active_width", "kv_cache_shape", "warmup", "to_torch", "C128A_TOPK_ALIGNMENT",
    "FP8_DS_MLA_BYTES_PER_TOKEN", "HEAD_SIZE", "KV_BLOCK_SIZE", "PAD_SLOT_ID", "Dsv4Error",
    "KernelCompileError", "NoGPUError", "NVRTCMissingError", "UnsupportedDeviceError",
    "compute_swa_indices_and_lens", "compute_global_topk_indices_and_lens",
    "fill_short_context_topk_indices", "combine_topk_swa_indices", "compute_prefill_gather_lens",
    "get_prefill_chunk_plan", "build_indexer_prefill_chunk_metadata",
    "build_indexer_decode_metadata", "build_indexer_native_decode_metadata", "c4a_layer_topk",
    "build_c128a_combined_prefill_rows", "compute_image_visibility", "image_span_csr",
    "get_dspark_swa_index_width",
    "set_programmatic_launch", "quantize_and_insert_k_cache", "dequantize_and_gather_k_cache",
    "dequantize_and_gather_prefill_kv", "dequantize_and_gather_selected_kv",
    "selected_gather_scratch_len", "indexer_k_quant_and_cache",
    "cp_gather_indexer_k_quant_cache", "KVCacheLayout", "kv_cache_layout", "kv_cache_view",
    "empty_kv_cache", "split_indexer_prefill_chunks", "indexer_prefill_workspace_rows",
    "indexer_prefill_chunk_tokens",
    "__version__",
]
