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
    int (read by the step builder's prefill planning; vLLM 0.34 has
    ``seq_lens_cpu_upper_bound``, exact for prefill requests, read when
    ``seq_lens_cpu`` is None).
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
    seq_lens_cpu_upper_bound: Any = None


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

    #: The fields a build writes (the others are the step's own arrays or counts).
    RESULTS = ("req_id_per_token", "slot_mapping", "c128a_global_decode_topk_indices",
               "c128a_decode_topk_lens", "c128a_prefill_topk_indices")

    def to_torch(self) -> "DeepseekV4Metadata":
        """The same metadata with every array exported to torch through DLPack
        (zero-copy; torch tensors pass through)."""
        return exported_to_torch(self)


@dataclass
class DeepseekV4StepMetadata:
    """What ``DeepseekV4StepMetadataBuilder.build`` returns: views of the
    builder's persistent buffers (valid until the next build), None where the
    step has no such rows. T is ``num_actual_tokens``; Td/Tp the decode and
    prefill tokens; P the prefill requests. All int32 unless noted.

    Shared: ``req_id_per_token [T]``, ``is_valid_token [T]`` bool (the SWA
    group's ``slot_mapping >= 0``). SWA: ``swa_decode_indices [Td, 1, W]``,
    ``swa_decode_lens [Td]``, ``swa_prefill_indices [Tp, 1, W]``,
    ``swa_prefill_lens [Tp]``, ``prefill_gather_lens [P]``. Compressed slot
    mappings, int64 ``[T]``: ``c4a_slot_mapping``, ``indexer_slot_mapping``,
    ``c128a.slot_mapping``. Indexer decode (``build_indexer_decode_metadata``
    over the decode requests): ``indexer_context_lens``, ``indexer_req_ids``,
    ``indexer_decode_lens`` ``[Td]``, ``indexer_block_rows [Td, cols]``,
    ``indexer_per_req_decode_lens [D]`` (D the decode requests). With
    ``indexer_decode_layout="native"``: ``indexer_context_lens [D, depth]`` (or
    ``[Td, 1]`` without speculative tokens), ``indexer_decode_lens`` and
    ``indexer_per_req_decode_lens`` ``[D]``; the block rows are the indexer
    group's table's first D rows, and there are no request ids.
    Indexer prefill (``build_indexer_prefill_chunk_metadata`` over all
    prefill requests as one chunk): ``indexer_cu_compressed [P + 1]``,
    ``indexer_token_to_seq [sum L // 4]``, ``indexer_cu_seqlen_ks``,
    ``indexer_cu_seqlen_ke`` ``[Tp]``. ``c128a``: the C128A group's
    ``DeepseekV4Metadata``. With ``combined_prefill``: the chunk plans
    (``get_prefill_chunk_plan``; chunk ``(start, end, N, M)`` covers prefill
    requests ``[start, end)``) and the combined rows of every prefill token,
    chunk after chunk: ``c128a_combined_indices [Tp, round_up(width + W, 128)]``,
    ``swa_combined_indices [Tp, round_up(W, 128)]`` and their ``*_lens [Tp]``.
    ``c4a_short_context_topk_indices [T, index_topk]`` when the step took the
    short-context shortcut (``max_seq_len // 4 <= index_topk``, not capturing).
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    req_id_per_token: Any
    is_valid_token: Any
    swa_decode_indices: Any = None
    swa_decode_lens: Any = None
    swa_prefill_indices: Any = None
    swa_prefill_lens: Any = None
    prefill_gather_lens: Any = None
    c4a_slot_mapping: Any = None
    indexer_slot_mapping: Any = None
    indexer_context_lens: Any = None
    indexer_req_ids: Any = None
    indexer_decode_lens: Any = None
    indexer_block_rows: Any = None
    indexer_per_req_decode_lens: Any = None
    indexer_cu_compressed: Any = None
    indexer_token_to_seq: Any = None
    indexer_cu_seqlen_ks: Any = None
    indexer_cu_seqlen_ke: Any = None
    c128a: Any = None
    c128a_prefill_chunks: list | None = None
    swa_prefill_chunks: list | None = None
    c128a_combined_indices: Any = None
    c128a_combined_lens: Any = None
    swa_combined_indices: Any = None
    swa_combined_lens: Any = None
    c4a_short_context_topk_indices: Any = None

    def to_torch(self) -> "DeepseekV4StepMetadata":
        """The same metadata with every array exported to torch through DLPack (zero-copy)."""
        return exported_to_torch(self)

    def arrays(self) -> tuple:
        """The builder's arrays in the metadata (the C128A group's results
        included, not the caller's arrays it holds), each once."""
        found = {}
        for value in (*vars(self).values(),
                      *(getattr(self.c128a, name) for name in DeepseekV4Metadata.RESULTS)):
            if value is not None and not isinstance(value, (int, list, DeepseekV4Metadata)):
                found.setdefault(id(value), value)
        return tuple(found.values())


def copied(metadata):
    """A shallow copy of a metadata dataclass (its fields' objects shared)."""
    copy = object.__new__(type(metadata))
    copy.__dict__ = metadata.__dict__.copy()     # a third of update()'s time
    return copy


def copied_step(metadata):
    """A shallow copy of a ``DeepseekV4StepMetadata`` whose C128A group
    metadata is a copy too (a step's values are set on both)."""
    copy = copied(metadata)
    copy.__dict__["c128a"] = copied(metadata.c128a)
    return copy


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
