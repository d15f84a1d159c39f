"""The metadata objects: vLLM's per-step inputs and the DeepSeek-V4 results."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .kinds import to_torch


@dataclass
class CommonAttentionMetadata:
    """The per-step batch description a vLLM builder receives (same field names).

    Arrays are of one kind (numpy, cupy, or torch); ``query_start_loc_cpu`` is
    always a host array (numpy or torch CPU). Shapes: ``query_start_loc``
    ``[num_reqs + 1]`` int32, ``seq_lens`` ``[num_reqs]`` int32 (including
    this step's queries), ``block_table_tensor`` ``[num_reqs, max_blocks]``
    int32, ``slot_mapping`` ``[num_actual_tokens]`` int32/int64 (-1 = padding),
    ``positions`` ``[num_actual_tokens]`` int32/int64 (needed for C128A),
    ``is_prefilling`` ``[num_reqs]`` host bool (requests still processing their
    prompt; read only by ``split_decodes_and_prefills(...,
    treat_short_extends_as_decodes=False)``), ``seq_lens_cpu`` ``[num_reqs]`` host
    int (read by the step builder's prefill planning).
    """

    query_start_loc: Any
    query_start_loc_cpu: Any
    seq_lens: Any
    block_table_tensor: Any
    slot_mapping: Any
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    positions: Any = None
    is_prefilling: Any = None
    seq_lens_cpu: Any = None


@dataclass
class DeepseekV4Metadata:
    """What ``DeepseekV4MetadataBuilder.build`` returns (vLLM's
    ``DeepseekV4FlashMLAMetadata`` fields, plus the decode/prefill split).

    ``slot_mapping`` is the compressed slot mapping (int64) when
    ``compress_ratio > 1``, else the input one. The split counts are filled
    for every ratio. The C128A fields exist for
    ratio 128 only, and each is None when its token count is 0:
    ``c128a_global_decode_topk_indices`` ``[num_decode_tokens, 1, W]``,
    ``c128a_decode_topk_lens`` ``[num_decode_tokens]``,
    ``c128a_prefill_topk_indices`` ``[num_prefill_tokens, W]``, all int32
    views of the builder's buffers (row stride = capacity).
    """

    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    query_start_loc: Any
    slot_mapping: Any
    block_table: Any
    req_id_per_token: Any
    block_size: int
    topk_tokens: int
    num_decodes: int = 0
    num_prefills: int = 0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    c128a_global_decode_topk_indices: Any = None
    c128a_decode_topk_lens: Any = None
    c128a_prefill_topk_indices: Any = None

    def to_torch(self) -> "DeepseekV4Metadata":
        """The same metadata with every array exported to torch through DLPack
        (zero-copy; torch tensors pass through)."""
        return exported_to_torch(self)


def exported_to_torch(metadata):
    """A metadata dataclass with every array field exported to torch through
    DLPack (zero-copy), nested metadata too; ints, lists and None stay."""
    changes = {}
    for field in dataclasses.fields(metadata):
        value = getattr(metadata, field.name)
        if value is None or isinstance(value, (int, list)):
            continue
        changes[field.name] = (exported_to_torch(value) if dataclasses.is_dataclass(value)
                               else to_torch(value))
    return dataclasses.replace(metadata, **changes)
