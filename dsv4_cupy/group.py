"""``KVCacheGroup``: what both builders share about one KV-cache group.

Its persistent buffers (allocated once: capture-stable addresses and row
strides), the checks of a step's arrays, the decode/prefill split, the C128A
width policy, its sections of the step kernel (the token map, its
compressed slot mapping, the C128A rows: each described by its family's
module) and the ``DeepseekV4Metadata`` views of its buffers.
``DeepseekV4MetadataBuilder`` is a group with a build; the step builder
holds one for its C128A group.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import checks, host, keys, validation
from .c128a import PADDING_ROWS, VALIDITY_FROM_SLOTS, C128ARows, c128a_launch
from .dcp import check_cp
from .family import POSITIONS_AXIS, SLOT_MAPPING_AXIS
from .kinds import (GPU_KINDS, HOST_KINDS, INT32, INT64, Operand, describe, device_of,
                    full_block_like_kind, kind_of, probe, probe_all)
from .launch import Launch
from .metadata import CommonAttentionMetadata, DeepseekV4Metadata
from .prepared import PreparedCalls
from .scalars import check_choice, check_int
from .slot_mapping import slot_geometry, slot_mapping_launch
from .spec import (C128A_RATIO, GROUP_RATIOS, INDEX_TOPKS, KV_BLOCK_SIZE, MAX_BLOCK_SIZE,
                   DeepseekV4FlashMLABackend, active_width, c128a_capacity)
from .split import host_prefilling, split_host
from .token_map import token_map_launch

WIDTH_POLICIES = ("capacity", "active")
#: A group's persistent buffers (the ratio's own: None for the others).
GROUP_BUFFERS = ("req_id_per_token_buffer", "compressed_slot_mapping_buffer",
                 "c128a_global_decode_buffer", "c128a_decode_lens_buffer", "c128a_prefill_buffer")
#: Result views a group keeps: five per step shape (``result_views``).
MAX_CACHED_VIEWS = 2048
#: Splits of steps with prefills a group keeps, by their query layout's contents.
MAX_CACHED_SPLITS = 64


class Split(NamedTuple):
    """A step's decode/prefill split (vLLM's ``split_decodes_and_prefills``)."""

    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int


class StepArrays(NamedTuple):
    """A step's arrays after the group's checks (no device memory read)."""

    num_reqs: int
    num_tokens: int                   # num_actual_tokens
    host_query_start_loc: np.ndarray  # query_start_loc_cpu, a numpy view
    ops: dict                         # probed: query_start_loc, seq_lens,
                                      # block_table_tensor, slot_mapping, positions


class GroupViews(NamedTuple):
    """Views of a group's buffers for one step shape (None: not a buffer of this group)."""

    req_id_per_token: object
    slot_mapping: object
    c128a_global_decode: object
    c128a_decode_lens: object
    c128a_prefill: object


class KVCacheGroup:
    """One KV-cache group (one compress ratio): its buffers, checks and sections.

    The arguments are ``DeepseekV4MetadataBuilder``'s (it documents them).
    """

    def __init__(self, compress_ratio: int, max_model_len: int, max_num_batched_tokens: int, *,
                 block_size: int = KV_BLOCK_SIZE, index_topk: int = INDEX_TOPKS[0],
                 num_speculative_tokens: int = 0, treat_short_extends_as_decodes: bool = True,
                 width_policy: str = "active", dcp_world_size: int = 1, dcp_rank: int = 0,
                 cp_kv_cache_interleave_size: int = 1, like="numpy", device: int | None = None,
                 validate: str = "default", num_cache_blocks: int | None = None,
                 decode_threshold: int | None = None, padding_rows: str = "minus_one"):
        self.compress_ratio = check_choice("compress_ratio", check_int(
            "compress_ratio", compress_ratio), GROUP_RATIOS)
        self.max_model_len = check_int("max_model_len", max_model_len, minimum=1)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens",
                                                max_num_batched_tokens, minimum=1)
        self.block_size = check_int("block_size", block_size, minimum=1,
                                    maximum=MAX_BLOCK_SIZE * KV_BLOCK_SIZE)
        self.topk_tokens = check_int("index_topk", index_topk, minimum=1)
        spec_tokens = check_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
        self.decode_threshold = 1 + spec_tokens if decode_threshold is None else check_int(
            "decode_threshold", decode_threshold, minimum=1)
        self.treat_short_extends_as_decodes = bool(treat_short_extends_as_decodes)
        self.width_policy = check_choice("width_policy", width_policy, WIDTH_POLICIES)
        self.padding_slots = check_choice("padding_rows", padding_rows, PADDING_ROWS) == "slots"
        self.full_validation = validation.check_mode(validate, num_cache_blocks)
        self.num_cache_blocks = num_cache_blocks
        self.storage_block_size = self.block_size // self.compress_ratio
        if self.compress_ratio > 1 and self.block_size % self.compress_ratio:
            raise ValueError(f"block_size: expected a multiple of compress_ratio "
                             f"({self.compress_ratio}), got {self.block_size}")
        if self.storage_block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size: expected a storage block (block_size // "
                             f"compress_ratio) of at most {MAX_BLOCK_SIZE}, got "
                             f"{self.storage_block_size}")
        self.cp = check_cp(dcp_world_size, dcp_rank, cp_kv_cache_interleave_size,
                           block_size=max(self.storage_block_size, 1),
                           names=("dcp_world_size", "dcp_rank", "cp_kv_cache_interleave_size"))
        self.has_c128a_rows = self.compress_ratio == C128A_RATIO
        self.capacity = c128a_capacity(self.max_model_len) if self.has_c128a_rows else 0

        if device is not None:
            device = check_int("device", device, minimum=-1)
        n, rows = self.max_num_batched_tokens, (self.max_num_batched_tokens, self.capacity)
        specs = {"req_id_per_token_buffer": ((n,), INT32, 0)}
        if self.compress_ratio > 1:
            specs["compressed_slot_mapping_buffer"] = ((n,), INT64, -1)
        if self.has_c128a_rows:
            specs.update(c128a_global_decode_buffer=(rows, INT32, -1),
                         c128a_decode_lens_buffer=((n,), INT32, 0),
                         c128a_prefill_buffer=(rows, INT32, -1))
        made = full_block_like_kind(like, specs, device)
        for name in GROUP_BUFFERS:
            setattr(self, name, made.get(name))
        self.kind = kind_of(self.req_id_per_token_buffer)
        self.device = device_of(self.req_id_per_token_buffer, self.kind)
        if self.kind in GPU_KINDS:
            DeepseekV4FlashMLABackend.check_device()
        self._views = keys.ViewCache(MAX_CACHED_VIEWS)
        self._splits = PreparedCalls(MAX_CACHED_SPLITS)
        # The buffers never move, so they are probed once.
        self._buffers = {name: probe(name, getattr(self, name)) for name in GROUP_BUFFERS}
        self.owned = checks.OwnedBuffers(list(self._buffers.values()))
        self._geometry = slot_geometry(max(self.storage_block_size, 1), self.compress_ratio,
                                       self.cp)

    # --- host decisions ----------------------------------------------------------------------
    def width(self, max_seq_len: int, capturing: bool = False) -> int:
        """C128A columns written this step (0 unless compress_ratio is 128): the
        capacity under the "capacity" policy and in a captured build (a step's
        live width varies), else ``c128a_active_width(max_seq_len, capacity)``."""
        if not self.has_c128a_rows:
            return 0
        if self.width_policy == "capacity" or capturing:
            return self.capacity
        return active_width(check_int("max_seq_len", max_seq_len, minimum=0), self.capacity)

    def uniform_decode(self, cm: CommonAttentionMetadata) -> bool:
        """Whether the step is decodes only, decided from host ints alone."""
        return bool(cm.num_reqs) and cm.max_query_len <= self.decode_threshold \
            and self.treat_short_extends_as_decodes

    def split(self, cm: CommonAttentionMetadata, host_qsl: np.ndarray,
              prefilling: np.ndarray | None) -> Split:
        """The step's split, from ``query_start_loc_cpu`` (``host_qsl``)."""
        num_tokens = cm.num_actual_tokens
        if self.uniform_decode(cm):             # the usual case
            return Split(cm.num_reqs, 0, num_tokens, 0)
        qsl = host_qsl[:cm.num_reqs + 1]
        # A serving loop's steps with prefills repeat their query lengths (the contents).
        key = (qsl.tobytes(), qsl.dtype.char, num_tokens, cm.max_query_len) \
            if prefilling is None else None
        split = self._splits.get(key) if key is not None else None
        if split is not None:
            return split
        split = Split(*split_host(qsl, self.decode_threshold, False, num_tokens,
                                  cm.max_query_len, prefilling))
        if not 0 <= split.num_decode_tokens <= num_tokens:
            raise ValueError(f"query_start_loc_cpu: expected the decode/prefill boundary inside "
                             f"[0, num_actual_tokens={num_tokens}], got token "
                             f"{split.num_decode_tokens}")
        if key is not None:
            self._splits.put(key, split)
        return split

    def prefilling(self, cm: CommonAttentionMetadata) -> np.ndarray | None:
        """``is_prefilling`` as a checked host view, where the split reads it."""
        if self.treat_short_extends_as_decodes or not cm.num_reqs:
            return None
        return host_prefilling(cm.is_prefilling, cm.num_reqs)

    def valid_tokens(self, cm: CommonAttentionMetadata, host_qsl: np.ndarray) -> int:
        """Under DCP the tokens before ``query_start_loc_cpu[num_reqs]`` are real;
        on one rank a decode token's validity comes from its slot."""
        return int(host_qsl[cm.num_reqs]) if self.cp.world_size > 1 else VALIDITY_FROM_SLOTS

    def step_key(self, cm: CommonAttentionMetadata, *more):
        """What the checks of a step depend on, from attributes alone, with
        ``more`` of the caller's (None: no fast path)."""
        return keys.launch_key(
            cm.query_start_loc, cm.seq_lens, cm.block_table_tensor, cm.slot_mapping,
            cm.positions if self.has_c128a_rows else None, cm.num_reqs,
            cm.num_actual_tokens, keys.host_key(cm.query_start_loc_cpu),
            None if self.treat_short_extends_as_decodes else keys.host_key(cm.is_prefilling),
            *more)

    # --- checks ------------------------------------------------------------------------------
    def check_step(self, cm: CommonAttentionMetadata) -> StepArrays:
        """Validate the step's arrays (kind, device, dtypes, lengths, no overlap
        with the buffers); no sync."""
        if not isinstance(cm, CommonAttentionMetadata):
            raise TypeError("common_attn_metadata: expected a CommonAttentionMetadata, "
                            f"got {type(cm).__name__}")
        num_tokens = check_int("num_actual_tokens", cm.num_actual_tokens, minimum=0,
                               maximum=self.max_num_batched_tokens)
        num_reqs = check_int("num_reqs", cm.num_reqs, minimum=0)
        check_int("max_seq_len", cm.max_seq_len, minimum=0)
        check_int("max_query_len", cm.max_query_len, minimum=0)
        needs_positions = self.has_c128a_rows and num_tokens > 0
        if needs_positions and cm.positions is None:
            raise ValueError("positions: required for C128A metadata (compress_ratio 128), got None")
        kind, device, ops = probe_all({
            "query_start_loc": cm.query_start_loc, "seq_lens": cm.seq_lens,
            "block_table_tensor": cm.block_table_tensor, "slot_mapping": cm.slot_mapping,
            "positions": cm.positions if needs_positions else None})
        if (kind, device) != (self.kind, self.device):
            raise TypeError(f"common_attn_metadata: expected arrays like the builder's buffers "
                            f"({describe(self.req_id_per_token_buffer)}), got "
                            f"{describe(cm.query_start_loc)}")
        qsl_cpu = probe("query_start_loc_cpu", cm.query_start_loc_cpu)
        if qsl_cpu.kind not in HOST_KINDS:
            raise TypeError("query_start_loc_cpu: expected a host array (numpy or torch CPU), "
                            f"got {describe(cm.query_start_loc_cpu)}")
        if len(qsl_cpu.shape) == 1 and qsl_cpu.shape[0] < num_reqs + 1:
            raise ValueError(f"num_reqs: expected at most len(query_start_loc_cpu) - 1 = "
                             f"{qsl_cpu.shape[0] - 1} requests, got {num_reqs}")
        checks.check(qsl_cpu, (INT32, INT64), 1, min_len=num_reqs + 1)
        table = ops["block_table_tensor"]
        checks.check(table, (INT32,), 2)
        if table.shape[0] > num_reqs:
            raise ValueError(f"block_table_tensor: expected at most num_reqs ({num_reqs}) rows, "
                             f"got shape {tuple(table.shape)}")
        checks.check(ops["query_start_loc"], (INT32,), 1, min_len=num_reqs + 1)
        checks.check(ops["seq_lens"], (INT32,), 1, min_len=table.shape[0])
        checks.check(ops["slot_mapping"], SLOT_MAPPING_AXIS.values, 1, min_len=num_tokens)
        if needs_positions:
            checks.check(ops["positions"], POSITIONS_AXIS.values, 1, min_len=num_tokens)
        self.owned.check_inputs(ops.values())
        return StepArrays(num_reqs, num_tokens, host.host_view(qsl_cpu.array, qsl_cpu.kind),
                          ops)

    def check_step_data(self, cm: CommonAttentionMetadata, step: StepArrays,
                        split: Split) -> None:
        """``validate="full"``: the step's data (reads device arrays). The decode
        lookups are checked against the whole table, as both paths read it."""
        kind, table = self.kind, cm.block_table_tensor
        num_tokens, num_decode_tokens = step.num_tokens, split.num_decode_tokens
        qsl = cm.query_start_loc[:cm.num_reqs + 1]
        validation.step_host_values(step.host_query_start_loc, qsl, cm.seq_lens, kind,
                                    cm.num_reqs, cm.max_query_len, cm.max_seq_len)
        validation.decodes_first(step.host_query_start_loc[:cm.num_reqs + 1],
                                 self.decode_threshold)
        validation.max_lengths(cm.seq_lens, kind, cm.num_reqs, self.max_model_len)
        if self.compress_ratio > 1:
            validation.slot_mapping_inputs(qsl, cm.seq_lens, table, kind,
                                           self.storage_block_size, self.compress_ratio,
                                           self.cp.world_size, self.num_cache_blocks, num_tokens)
        else:
            validation.query_layout(qsl, cm.seq_lens, kind, table.shape[0], num_tokens)
        if num_decode_tokens and self.has_c128a_rows:
            ids = validation.token_requests(host.host_copy(qsl, kind), num_decode_tokens)
            outside = np.flatnonzero(ids >= table.shape[0])
            if outside.size:
                t = int(outside[0])
                raise ValueError(f"block_table_tensor: expected a row for every request with "
                                 f"decode tokens, got {table.shape[0]} rows; decode token {t} "
                                 f"belongs to request {int(ids[t])}")
            validation.c128a_inputs(cm.positions, ids, table, kind, num_decode_tokens,
                                    C128A_RATIO, self.width(cm.max_seq_len),
                                    self.storage_block_size, self.num_cache_blocks,
                                    ids_kind="numpy")

    # --- the step kernel's sections and the results ------------------------------------------
    def sections(self, step: StepArrays, split: Split, width: int, c128a_tokens: int,
                 valid_tokens: int) -> dict[str, Launch]:
        """The group's sections of the step kernel: the token map, the whole
        compressed slot-mapping buffer (ratio > 1) and the C128A rows of the
        first ``c128a_tokens`` tokens (ratio 128)."""
        return {**self.layout_sections(step),
                **self.split_sections(step, split, width, c128a_tokens, valid_tokens)}

    def layout_sections(self, step: StepArrays) -> dict[str, Launch]:
        """The sections that depend on the step's arrays and counts alone: the
        token map and the whole compressed slot-mapping buffer (ratio > 1)."""
        ops, buffers = step.ops, self._buffers
        qsl, seq, table = ops["query_start_loc"], ops["seq_lens"], ops["block_table_tensor"]
        sections = {"token_map": token_map_launch(qsl, step.num_reqs,
                                                  buffers["req_id_per_token_buffer"],
                                                  step.num_tokens)}
        slots = buffers["compressed_slot_mapping_buffer"]
        if slots is not None:
            # Every element of the buffer may get a slot: padding rows stay -1.
            sections["group_slots"] = slot_mapping_launch(qsl, seq, table, self._geometry, slots,
                                                          slots.shape[0])
        return sections

    def split_sections(self, step: StepArrays, split: Split, width: int, c128a_tokens: int,
                       valid_tokens: int) -> dict[str, Launch]:
        """The sections that depend on the split: the C128A rows of the first
        ``c128a_tokens`` tokens (ratio 128), ``width`` columns each."""
        if not c128a_tokens:
            return {}
        ops, buffers = step.ops, self._buffers
        rows = C128ARows(global_decode=buffers["c128a_global_decode_buffer"],
                         decode_lens=buffers["c128a_decode_lens_buffer"],
                         prefill=buffers["c128a_prefill_buffer"], decode_stride=self.capacity,
                         prefill_stride=self.capacity, width=width, num_valid_tokens=valid_tokens,
                         padding_slots=int(self.padding_slots))
        return {"c128a": c128a_launch(ops["positions"], buffers["req_id_per_token_buffer"],
                                      ops["slot_mapping"], ops["block_table_tensor"],
                                      self._geometry, rows, c128a_tokens,
                                      split.num_decode_tokens,
                                      self.device if self.kind in GPU_KINDS else -1)}

    def result_views(self, num_tokens: int, split: Split, width: int) -> GroupViews:
        """Views of the persistent buffers for one step shape (cached)."""
        view = self._views.get
        nd, np_tokens = split.num_decode_tokens, split.num_prefill_tokens
        slots = self.compressed_slot_mapping_buffer
        decode, lens, prefill = (self.c128a_global_decode_buffer, self.c128a_decode_lens_buffer,
                                 self.c128a_prefill_buffer)
        return GroupViews(
            view(self.req_id_per_token_buffer, 0, num_tokens),
            None if slots is None else view(slots, 0, num_tokens),
            None if decode is None else view(decode, 0, nd, width, unit_axis=True),
            None if lens is None else view(lens, 0, nd),
            None if prefill is None else view(prefill, 0, np_tokens, width))

    def metadata(self, cm: CommonAttentionMetadata, split: Split,
                 views: GroupViews) -> DeepseekV4Metadata:
        nd, np_tokens = split.num_decode_tokens, split.num_prefill_tokens
        rows = self.has_c128a_rows and nd + np_tokens > 0
        return DeepseekV4Metadata(
            num_reqs=cm.num_reqs, max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens, query_start_loc=cm.query_start_loc,
            slot_mapping=views.slot_mapping if self.compress_ratio > 1 else cm.slot_mapping,
            block_table=cm.block_table_tensor, req_id_per_token=views.req_id_per_token,
            block_size=self.block_size, topk_tokens=self.topk_tokens,
            num_decodes=split.num_decodes, num_prefills=split.num_prefills,
            num_decode_tokens=nd, num_prefill_tokens=np_tokens,
            c128a_global_decode_topk_indices=views.c128a_global_decode if rows and nd else None,
            c128a_decode_topk_lens=views.c128a_decode_lens if rows and nd else None,
            c128a_prefill_topk_indices=views.c128a_prefill if rows and np_tokens else None)

    def refresh(self, metadata: DeepseekV4Metadata, cm: CommonAttentionMetadata) -> None:
        """A kept ``metadata`` of a step with ``cm``'s layout and split given
        ``cm``'s own arrays and maxima (its views and counts stay)."""
        metadata.max_query_len, metadata.max_seq_len = cm.max_query_len, cm.max_seq_len
        metadata.query_start_loc, metadata.block_table = cm.query_start_loc, cm.block_table_tensor
        if self.compress_ratio == 1:
            metadata.slot_mapping = cm.slot_mapping

    def buffer_operand(self, name: str) -> Operand | None:
        """A persistent buffer as probed once."""
        return self._buffers[name]

    def buffers(self) -> dict:
        """The group's persistent buffers by name (None: not one of this ratio's)."""
        return {name: op.array for name, op in self._buffers.items() if op is not None}

    def new_buffers(self, specs: dict) -> dict:
        """Persistent buffers ``{name: (shape, dtype, value)}`` of the group's kind
        and device, filled with their values (one block: ``full_block_like_kind``)."""
        return full_block_like_kind(self.req_id_per_token_buffer, specs, self.device)

    def step_variant(self, step: StepArrays) -> dict:
        """The step kernel's entry point for a step's positions and slot mapping."""
        positions = step.ops["positions"]
        return {"positions": INT64 if positions is None else positions.dtype,
                "slot_mapping": step.ops["slot_mapping"].dtype}

    # --- CUDA-graph capture ------------------------------------------------------------------
    def check_capturable(self, cm: CommonAttentionMetadata) -> None:
        """Raise unless a build of this step can be captured: GPU buffers and a
        uniform decode batch (the split of a prefill is a host decision)."""
        if self.kind not in GPU_KINDS:
            raise TypeError("build_for_cudagraph_capture: expected a builder of GPU buffers "
                            f"(like='torch' on CUDA or 'cupy'), this one holds {self.kind} arrays")
        if not self.uniform_decode(cm):
            raise ValueError(f"common_attn_metadata: a captured build needs a uniform decode "
                             f"batch (num_reqs > 0, max_query_len <= {self.decode_threshold}), "
                             f"got num_reqs={cm.num_reqs}, max_query_len={cm.max_query_len}")

    def check_captured_shape(self, cm: CommonAttentionMetadata, num_reqs: int,
                             num_tokens: int) -> None:
        """Raise unless the step has the captured counts, is a uniform decode
        step and fits the C128A capacity (host values only)."""
        if (cm.num_reqs, cm.num_actual_tokens) != (num_reqs, num_tokens):
            raise ValueError(f"common_attn_metadata: expected the captured shape num_reqs="
                             f"{num_reqs}, num_actual_tokens={num_tokens}, got "
                             f"{cm.num_reqs}, {cm.num_actual_tokens}; pad the step to it")
        if not self.uniform_decode(cm):
            raise ValueError(f"max_query_len: expected a uniform decode step (at most "
                             f"{self.decode_threshold}), got {cm.max_query_len}")
        if cm.max_seq_len > self.capacity * C128A_RATIO:
            raise ValueError(f"max_seq_len: expected at most {self.capacity * C128A_RATIO} (the "
                             f"C128A capacity), got {cm.max_seq_len}")
