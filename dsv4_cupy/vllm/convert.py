"""vLLM's metadata to and from the library's, without importing vLLM (the
adapter's conversion, run by the builders in ``builders.py``)."""
from __future__ import annotations

import dsv4_cupy

#: vLLM's ``DeepseekV4FlashMLAMetadata`` fields, each the library metadata's of that name.
FLASHMLA_FIELDS = ("num_reqs", "max_query_len", "max_seq_len", "num_actual_tokens",
                   "query_start_loc", "slot_mapping", "block_table", "req_id_per_token",
                   "block_size", "topk_tokens", "c128a_global_decode_topk_indices",
                   "c128a_decode_topk_lens", "c128a_prefill_topk_indices")


def flashmla_metadata(metadata, into, **fields):
    """vLLM's ``DeepseekV4FlashMLAMetadata`` (the class ``into``) of a library
    ``DeepseekV4Metadata``, ``fields`` replacing its values by name."""
    return into(**{name: fields[name] if name in fields else getattr(metadata, name)
                   for name in FLASHMLA_FIELDS})


def library_cm(cm):
    """The library's ``CommonAttentionMetadata`` of vLLM's (the same arrays)."""
    return dsv4_cupy.CommonAttentionMetadata(
        query_start_loc=cm.query_start_loc, query_start_loc_cpu=cm.query_start_loc_cpu,
        seq_lens=cm.seq_lens, block_table_tensor=cm.block_table_tensor,
        slot_mapping=cm.slot_mapping, num_reqs=cm.num_reqs,
        num_actual_tokens=cm.num_actual_tokens, max_query_len=cm.max_query_len,
        max_seq_len=cm.max_seq_len, positions=cm.positions, is_prefilling=cm.is_prefilling,
        seq_lens_cpu_upper_bound=cm.seq_lens_cpu_upper_bound)


def flashmla_build(library, cm, into, common_prefix_len=0, fast_build=False):
    """A C128A/C4A group's build for vLLM: the in-place clamp of a compressed
    group's table that vLLM's later readers see, the library's one launch,
    its metadata as vLLM's (``into``), the token map cached on ``cm`` for
    the next group."""
    if library.compress_ratio > 1:
        cm.block_table_tensor.clamp_(min=0)
    served = flashmla_metadata(library.build(common_prefix_len, library_cm(cm), fast_build),
                               into)
    if cm._token_to_req_indices_cache is None:
        cm._token_to_req_indices_cache = served.req_id_per_token
    return served
