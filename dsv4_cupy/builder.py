"""``DeepseekV4MetadataBuilder``: the seed builder's per-step work, in one launch on GPU."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, geometry, params, validation
from .arrays import INT32, INT64
from .families import POSITIONS_AXIS, SLOT_MAPPING_AXIS
from .dcp import check_cp
from .metadata import CommonAttentionMetadata, DeepseekV4Metadata
from .scalars import check_choice, check_int
from .spec import (INDEX_TOPKS, KV_BLOCK_SIZE, MAX_BLOCK_SIZE, DeepseekV4FlashMLABackend,
                   active_width_unchecked, c128a_active_width, c128a_capacity)
from .prepared import PlanCache, PreparedCall
from .step_kernel import step_plan
from .split import host_prefilling as host_prefilling_view
from .split import split_host

WIDTH_POLICIES = ("capacity", "active")


class _PreparedStep:
    """A step layout whose checks passed: host views of its host arrays, and the
    prepared launch of each (split, width, valid tokens) seen with it."""

    __slots__ = ("host_query_start_loc", "host_prefilling", "launches")

    def __init__(self, host_query_start_loc, host_prefilling):
        self.host_query_start_loc = host_query_start_loc
        self.host_prefilling = host_prefilling
        self.launches: dict = {}


#: Step layouts whose prepared launches a builder keeps.
_MAX_CACHED_STEPS = 512
#: Result views cached: five per step shape (_result_views).
_MAX_CACHED_VIEWS = 5 * _MAX_CACHED_STEPS


class DeepseekV4MetadataBuilder:
    """Builds ``DeepseekV4Metadata`` for one KV-cache group (one compress ratio).

    Parameters
    ----------
    compress_ratio : int
        1 (SWA-only), 4 (C4A) or 128 (C128A).
    max_model_len, max_num_batched_tokens : int
        Size the persistent buffers, allocated once here so every step sees the
        same addresses and row strides (CUDA-graph safe).
    block_size : int
        Logical KV block size (256); the storage block is ``block_size // compress_ratio``.
    index_topk : int
        ``hf_config.index_topk`` (512 Flash, 1024 Pro), reported as ``topk_tokens``.
    num_speculative_tokens : int
        Decode threshold is ``1 + num_speculative_tokens`` (MTP/DSpark decodes).
    treat_short_extends_as_decodes : bool
        vLLM's split flag: when False, a request still prefilling its prompt
        (``CommonAttentionMetadata.is_prefilling``) is a prefill.
    width_policy : "active" or "capacity"
        C128A columns written per row: upstream's live width (#52823, its
        default) ``c128a_active_width(max_seq_len, capacity)``, or the seed's
        fixed capacity ``round_up(cdiv(max_model_len, 128), 128)``. The row
        stride is the capacity either way (a batch-dependent stride broke
        captured decode consumers, vLLM #52448).
    dcp_world_size, dcp_rank, cp_kv_cache_interleave_size : int
        Decode context parallelism (experimental): the compressed slot mapping
        and the C128A decode rows are this rank's (see
        ``build_c128a_topk_metadata``); tokens past ``query_start_loc_cpu[num_reqs]``
        are padding.
    like : "numpy", "cupy", "torch" or an array
        Kind of the persistent buffers; the step's arrays must be of that kind
        ("torch" is CUDA when available, else CPU; an array gives its own kind
        and device).
    device : int, optional
        CUDA device for GPU buffers (default: the current one).
    validate : "default" or "full"
        "full" makes every build also check the step's data (a sync on GPU):
        query layout, ``seq_len >= query_len``, decodes before prefills,
        request ids and block columns inside the table and, with
        ``num_cache_blocks``, block ids inside the cache. For debugging.

    ``block_size`` here is the logical block (256), as in vLLM's builder; the
    array functions take the storage block (``block_size // compress_ratio``).

    The arrays a build returns are views of the persistent buffers, valid
    until the next build; a view changed in place by the caller (reshaped,
    flags changed) is replaced at the next build, never handed out again.

    Buffers: ``req_id_per_token_buffer`` int32 ``[max_num_batched_tokens]``;
    ``compressed_slot_mapping_buffer`` int64 ``[max_num_batched_tokens]`` (ratio > 1);
    ``c128a_global_decode_buffer``, ``c128a_prefill_buffer`` int32
    ``[max_num_batched_tokens, capacity]`` and ``c128a_decode_lens_buffer`` int32
    ``[max_num_batched_tokens]`` (ratio 128).
    """

    def __init__(self, compress_ratio: int, max_model_len: int, max_num_batched_tokens: int, *,
                 block_size: int = KV_BLOCK_SIZE, index_topk: int = INDEX_TOPKS[0],
                 num_speculative_tokens: int = 0, treat_short_extends_as_decodes: bool = True,
                 width_policy: str = "active", dcp_world_size: int = 1, dcp_rank: int = 0,
                 cp_kv_cache_interleave_size: int = 1, like="numpy", device: int | None = None,
                 validate: str = "default", num_cache_blocks: int | None = None):
        self.compress_ratio = check_int("compress_ratio", compress_ratio, minimum=1,
                                        maximum=MAX_BLOCK_SIZE)
        self.max_model_len = check_int("max_model_len", max_model_len, minimum=1)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens",
                                                max_num_batched_tokens, minimum=1)
        self.block_size = check_int("block_size", block_size, minimum=1,
                                    maximum=MAX_BLOCK_SIZE * KV_BLOCK_SIZE)
        self.topk_tokens = check_int("index_topk", index_topk, minimum=1)
        spec_tokens = check_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
        self.decode_threshold = 1 + spec_tokens
        self.treat_short_extends_as_decodes = bool(treat_short_extends_as_decodes)
        self.width_policy = check_choice("width_policy", width_policy, WIDTH_POLICIES)
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
        self.capacity = c128a_capacity(self.max_model_len) if self.compress_ratio == 128 else 0

        if device is not None:
            device = check_int("device", device, minimum=-1)
        n = self.max_num_batched_tokens
        self.req_id_per_token_buffer = arrays.full_like_kind(like, (n,), INT32, 0, device)
        self.kind = arrays.kind_of(self.req_id_per_token_buffer)
        self.device = arrays.device_of(self.req_id_per_token_buffer, self.kind)
        self.compressed_slot_mapping_buffer = None
        self.c128a_global_decode_buffer = self.c128a_decode_lens_buffer = None
        self.c128a_prefill_buffer = None
        if self.compress_ratio > 1:
            self.compressed_slot_mapping_buffer = arrays.full_like_kind(like, (n,), INT64, -1,
                                                                        self.device)
        if self.compress_ratio == 128:
            rows = (n, self.capacity)
            self.c128a_global_decode_buffer = arrays.full_like_kind(like, rows, INT32, -1,
                                                                    self.device)
            self.c128a_decode_lens_buffer = arrays.full_like_kind(like, (n,), INT32, 0,
                                                                  self.device)
            self.c128a_prefill_buffer = arrays.full_like_kind(like, rows, INT32, -1, self.device)
        if self.kind in arrays.GPU_KINDS:
            DeepseekV4FlashMLABackend.check_device()
        self._views = arrays.ViewCache(_MAX_CACHED_VIEWS)
        self._capturing = False
        self._captured = None
        # Prepared steps (GPU, default validation): see build().
        self._prepared = (PlanCache(_MAX_CACHED_STEPS) if self.kind in arrays.GPU_KINDS
                          and not self.full_validation else None)
        # The buffers never move, so their addresses are read once.
        self._buffer_ops = [arrays.probe(name, getattr(self, name)) for name in (
            "req_id_per_token_buffer", "compressed_slot_mapping_buffer",
            "c128a_global_decode_buffer", "c128a_decode_lens_buffer", "c128a_prefill_buffer")]
        self._buffers = arrays.OwnedBuffers(self._buffer_ops)
        self._buffer_ptrs = dict((name, op.ptr if op is not None else 0) for name, op in zip(
            ("req", "slots", "global_decode", "decode_lens", "prefill"), self._buffer_ops))
        self._slot_buffer_len = n if self.compressed_slot_mapping_buffer is not None else 0
        self._geometry = params.SLOT_GEOMETRY.values(
            block_size=max(self.storage_block_size, 1), ratio=self.compress_ratio,
            cp_world_size=self.cp.world_size, cp_rank=self.cp.rank,
            cp_interleave=self.cp.interleave)

    def width(self, max_seq_len: int) -> int:
        """C128A columns written this step (0 unless compress_ratio is 128)."""
        if self.compress_ratio != 128:
            return 0
        if self.width_policy == "capacity" or self._capturing:
            return self.capacity
        return c128a_active_width(max_seq_len, self.capacity)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> DeepseekV4Metadata:
        """``build`` for recording inside the caller's CUDA graph (torch's or CuPy's
        stream capture), so that a step costs no host time for metadata.

        The kernel reads every value that varies between steps of one captured
        shape from device memory on replay: the query layout, sequence lengths,
        positions, slot mapping and block table, at the addresses given here.
        The host values that fix the captured shape are the padded token count
        (``num_actual_tokens``), the request count (``num_reqs``), the split (a
        uniform decode batch: every request at most ``1 + num_speculative_tokens``
        tokens; prefills cannot be captured) and the C128A width, which is the
        capacity whatever ``width_policy`` says (a step's live width varies).
        Before each replay, ``check_replay(step)`` raises if the step does not
        fit; replaying a step that does not fit would give stale rows.
        """
        cm = common_attn_metadata
        self.check_capturable(cm)
        self._capturing = True
        try:
            metadata = self._build_checked(cm)
        finally:
            self._capturing = False
        self._captured = (self._step_key(cm), cm.num_reqs, cm.num_actual_tokens)
        return metadata

    def check_replay(self, common_attn_metadata: CommonAttentionMetadata) -> None:
        """Raise ``ValueError`` unless this step fits the graph captured by
        ``build_for_cudagraph_capture``: the same buffers (addresses, shapes,
        strides, dtypes), token and request counts, a uniform decode batch, and
        sequences no longer than ``max_model_len``. Host values only; no sync."""
        cm = common_attn_metadata
        if self._captured is None:
            raise ValueError("check_replay: nothing was captured (call "
                             "build_for_cudagraph_capture inside the graph capture first)")
        key, num_reqs, num_tokens = self._captured
        self.check_captured_shape(cm, num_reqs, num_tokens)
        if self._step_key(cm) != key:
            raise ValueError("common_attn_metadata: expected the buffers the graph was captured "
                             "with (same addresses, shapes, strides and dtypes); refresh them "
                             "in place")

    def uniform_decode(self, cm: CommonAttentionMetadata) -> bool:
        """Whether the step is decodes only, decided from host ints alone."""
        return bool(cm.num_reqs) and cm.max_query_len <= self.decode_threshold \
            and self.treat_short_extends_as_decodes

    def check_capturable(self, cm: CommonAttentionMetadata) -> None:
        """Raise unless a build of this step can be captured: GPU buffers and a
        uniform decode batch (the split of a prefill is a host decision)."""
        if self.kind not in arrays.GPU_KINDS:
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
        if cm.max_seq_len > self.capacity * 128:
            raise ValueError(f"max_seq_len: expected at most {self.capacity * 128} (the C128A "
                             f"capacity), got {cm.max_seq_len}")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> DeepseekV4Metadata:
        """Build one step's metadata (``common_prefix_len`` and ``fast_build`` are
        accepted for vLLM compatibility and, as in the seed, unused).

        On GPU this is one kernel launch with no host sync and no allocation:
        the decode/prefill split comes from ``query_start_loc_cpu``. Returns
        views of the persistent buffers. A step whose arrays have the layouts
        (addresses, shapes, strides, dtypes) and counts of an earlier step
        reuses that step's checks and prepared launch.
        """
        cm = common_attn_metadata
        if self._prepared is not None and type(cm) is CommonAttentionMetadata:
            metadata = self._build_prepared(cm)
            if metadata is not None:
                return metadata
        return self._build_checked(cm)

    def _step_key(self, cm: CommonAttentionMetadata, *more):
        """What the checks of a step depend on, from attributes alone, with
        ``more`` of the caller's (None: no fast path)."""
        return arrays.launch_key(
            cm.query_start_loc, cm.seq_lens, cm.block_table_tensor, cm.slot_mapping,
            cm.positions if self.compress_ratio == 128 else None, cm.num_reqs,
            cm.num_actual_tokens, arrays.host_key(cm.query_start_loc_cpu),
            None if self.treat_short_extends_as_decodes else arrays.host_key(cm.is_prefilling),
            *more)

    def _build_prepared(self, cm: CommonAttentionMetadata):
        """The step from a prepared launch, or None (then the full path runs)."""
        max_query_len, max_seq_len = cm.max_query_len, cm.max_seq_len
        if type(max_query_len) is not int or type(max_seq_len) is not int \
                or max_query_len < 0 or max_seq_len < 0:
            return None
        step = self._prepared.get(self._step_key(cm))
        if step is None:
            return None
        split = self._split(cm, step.host_query_start_loc, step.host_prefilling)
        if self.compress_ratio != 128:
            width = 0
        elif self.width_policy == "capacity":
            width = self.capacity
        else:
            width = active_width_unchecked(max_seq_len, self.capacity)
        launch = step.launches.get((split, width,
                                    self._valid_tokens(cm, step.host_query_start_loc)))
        if launch is None or not launch.run():
            return None
        return self._metadata(cm, split, launch.results)

    def _build_checked(self, cm: CommonAttentionMetadata) -> DeepseekV4Metadata:
        ratio = self.compress_ratio
        num_tokens, qsl_cpu, ops = self._check_step(cm)
        host_qsl = arrays.host_view(qsl_cpu.array, qsl_cpu.kind)
        host_prefilling = None
        if not self.treat_short_extends_as_decodes and cm.num_reqs:
            host_prefilling = host_prefilling_view(cm.is_prefilling, cm.num_reqs)
        split = self._split(cm, host_qsl, host_prefilling)
        num_decode_tokens, num_prefill_tokens = split[2], split[3]
        if self.full_validation:
            self._check_step_data(cm, qsl_cpu, num_tokens, num_decode_tokens)
        # The C128A rows cover the split's tokens (none for a batch of padding only).
        c128a_tokens = num_decode_tokens + num_prefill_tokens if ratio == 128 else 0
        width = self.width(cm.max_seq_len) if c128a_tokens else 0
        valid_tokens = self._valid_tokens(cm, host_qsl)
        views = self._result_views(num_tokens, num_decode_tokens, num_prefill_tokens, width)
        if self.kind in arrays.GPU_KINDS:
            launch = PreparedCall(
                self._plans(cm.num_reqs, ops, num_tokens, c128a_tokens, num_decode_tokens, width,
                            valid_tokens), self.kind, self.device, views, owned=views)
            if not launch.run():
                raise RuntimeError("DeepseekV4MetadataBuilder.build: the device changed during "
                                   "the build")
            if self._prepared is not None:
                key = self._step_key(cm)
                if key is not None:
                    step = self._prepared.get(key)
                    if step is None:
                        step = _PreparedStep(host_qsl, host_prefilling)
                        self._prepared.put(key, step)
                    step.launches[(split, width if ratio == 128 else 0, valid_tokens)] = launch
        else:
            self._run_cpu(cm, num_tokens, c128a_tokens, num_decode_tokens, width, valid_tokens)
        return self._metadata(cm, split, views)

    def _split(self, cm, host_qsl, host_prefilling) -> tuple[int, int, int, int]:
        """(num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)."""
        num_tokens = cm.num_actual_tokens
        if self.uniform_decode(cm):             # the usual case
            return cm.num_reqs, 0, num_tokens, 0
        split = split_host(host_qsl[:cm.num_reqs + 1], self.decode_threshold, False, num_tokens,
                           cm.max_query_len, host_prefilling)
        if not 0 <= split[2] <= num_tokens:
            raise ValueError(f"query_start_loc_cpu: expected the decode/prefill boundary inside "
                             f"[0, num_actual_tokens={num_tokens}], got token {split[2]}")
        return split

    def _valid_tokens(self, cm, host_qsl) -> int:
        """Under DCP the tokens before ``query_start_loc_cpu[num_reqs]`` are real;
        -1 (single rank) takes validity from the slot mapping."""
        return int(host_qsl[cm.num_reqs]) if self.cp.world_size > 1 else -1

    def _metadata(self, cm, split, views) -> DeepseekV4Metadata:
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split
        req_view, slots_view, decode_view, lens_view, prefill_view = views
        rows = self.compress_ratio == 128 and num_decode_tokens + num_prefill_tokens > 0
        return DeepseekV4Metadata(
            num_reqs=cm.num_reqs, max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
            num_actual_tokens=cm.num_actual_tokens, query_start_loc=cm.query_start_loc,
            slot_mapping=slots_view if self.compress_ratio > 1 else cm.slot_mapping,
            block_table=cm.block_table_tensor, req_id_per_token=req_view,
            block_size=self.block_size, topk_tokens=self.topk_tokens, num_decodes=num_decodes,
            num_prefills=num_prefills, num_decode_tokens=num_decode_tokens,
            num_prefill_tokens=num_prefill_tokens,
            c128a_global_decode_topk_indices=decode_view if rows and num_decode_tokens else None,
            c128a_decode_topk_lens=lens_view if rows and num_decode_tokens else None,
            c128a_prefill_topk_indices=prefill_view if rows and num_prefill_tokens else None)

    def _check_step(self, cm: CommonAttentionMetadata):
        """Validate the step's arrays (kind, device, dtypes, lengths); no sync.

        Returns ``(num_actual_tokens, probed query_start_loc_cpu, probed step arrays)``.
        """
        if not isinstance(cm, CommonAttentionMetadata):
            raise TypeError("common_attn_metadata: expected a CommonAttentionMetadata, "
                            f"got {type(cm).__name__}")
        num_tokens = check_int("num_actual_tokens", cm.num_actual_tokens, minimum=0,
                               maximum=self.max_num_batched_tokens)
        num_reqs = check_int("num_reqs", cm.num_reqs, minimum=0)
        check_int("max_seq_len", cm.max_seq_len, minimum=0)
        check_int("max_query_len", cm.max_query_len, minimum=0)
        needs_positions = self.compress_ratio == 128 and num_tokens > 0
        if needs_positions and cm.positions is None:
            raise ValueError("positions: required for C128A metadata (compress_ratio 128), got None")
        kind, device, ops = arrays.probe_all({
            "query_start_loc": cm.query_start_loc, "seq_lens": cm.seq_lens,
            "block_table_tensor": cm.block_table_tensor, "slot_mapping": cm.slot_mapping,
            "positions": cm.positions if needs_positions else None})
        if (kind, device) != (self.kind, self.device):
            raise TypeError(f"common_attn_metadata: expected arrays like the builder's buffers "
                            f"({arrays.describe(self.req_id_per_token_buffer)}), got "
                            f"{arrays.describe(cm.query_start_loc)}")
        qsl_cpu = arrays.probe("query_start_loc_cpu", cm.query_start_loc_cpu)
        if qsl_cpu.kind not in (arrays.NUMPY, arrays.TORCH_CPU):
            raise TypeError("query_start_loc_cpu: expected a host array (numpy or torch CPU), "
                            f"got {arrays.describe(cm.query_start_loc_cpu)}")
        arrays.check(qsl_cpu, (INT32, INT64), 1, min_len=num_reqs + 1)
        table = ops["block_table_tensor"]
        arrays.check(table, (INT32,), 2)
        if table.shape[0] > num_reqs:
            raise ValueError(f"block_table_tensor: expected at most num_reqs ({num_reqs}) rows, "
                             f"got shape {tuple(table.shape)}")
        arrays.check(ops["query_start_loc"], (INT32,), 1, min_len=num_reqs + 1)
        arrays.check(ops["seq_lens"], (INT32,), 1, min_len=table.shape[0])
        arrays.check(ops["slot_mapping"], SLOT_MAPPING_AXIS[1], 1, min_len=num_tokens)
        if needs_positions:
            arrays.check(ops["positions"], POSITIONS_AXIS[1], 1, min_len=num_tokens)
        self._buffers.check_inputs(ops.values())
        return num_tokens, qsl_cpu, ops

    def _check_step_data(self, cm, qsl_cpu, num_tokens, num_decode_tokens):
        """``validate="full"``: the step's data (reads device arrays). The decode
        lookups are checked against the whole table, as both paths read it."""
        kind, table = self.kind, cm.block_table_tensor
        qsl = cm.query_start_loc[:cm.num_reqs + 1]
        validation.decodes_first(arrays.host_view(qsl_cpu.array, qsl_cpu.kind)[:cm.num_reqs + 1],
                                 self.decode_threshold)
        if self.compress_ratio > 1:
            validation.slot_mapping_inputs(qsl, cm.seq_lens, table, kind,
                                           self.storage_block_size, self.compress_ratio,
                                           self.cp.world_size, self.num_cache_blocks, num_tokens)
        else:
            validation.query_layout(qsl, cm.seq_lens, kind, table.shape[0], num_tokens)
        if num_decode_tokens and self.compress_ratio == 128:
            ids = validation.token_requests(arrays.host_copy(qsl, kind), num_decode_tokens)
            outside = np.flatnonzero(ids >= table.shape[0])
            if outside.size:
                t = int(outside[0])
                raise ValueError(f"block_table_tensor: expected a row for every request with "
                                 f"decode tokens, got {table.shape[0]} rows; decode token {t} "
                                 f"belongs to request {int(ids[t])}")
            validation.c128a_inputs(cm.positions, ids, table, kind, num_decode_tokens, 128,
                                    self.width(cm.max_seq_len), self.storage_block_size,
                                    self.num_cache_blocks, ids_kind=arrays.NUMPY)

    def _plans(self, num_reqs, ops, num_tokens, c128a_tokens, num_decode_tokens, width,
               valid_tokens) -> tuple:
        """The step kernel with this group's section on."""
        values, blocks, variant = self.base_section(num_reqs, ops, num_tokens, c128a_tokens,
                                                    num_decode_tokens, width, valid_tokens)
        plan = step_plan(self.device, variant, {"base": (values, blocks)})
        return (plan,) if plan is not None else ()

    def base_section(self, num_reqs, ops, num_tokens, c128a_tokens, num_decode_tokens, width,
                     valid_tokens) -> tuple:
        """The step kernel's base section for this group: the token map, the whole
        slot-mapping buffer and the C128A rows, as ``(params.BUILD_STEP values,
        blocks, (positions dtype, slot-mapping dtype))``."""
        table, positions = ops["block_table_tensor"], ops["positions"]
        cols_per_block, chunks, row_blocks = geometry.row_chunks(c128a_tokens, width, self.device)
        positions_dtype = positions.dtype if row_blocks else POSITIONS_AXIS[1][-1]
        blocks = row_blocks + geometry.element_blocks(max(num_tokens, self._slot_buffer_len))
        buffers = self._buffer_ptrs
        values = params.BUILD_STEP.values(
            query=params.QUERY_LAYOUT.values(query_start_loc=ops["query_start_loc"].ptr,
                                             seq_lens=ops["seq_lens"].ptr, num_reqs=num_reqs),
            table=arrays.block_table_group(table), geometry=self._geometry,
            positions=positions.ptr if row_blocks else 0, slot_mapping=ops["slot_mapping"].ptr,
            req_out=buffers["req"], slots_out=buffers["slots"], slots_len=self._slot_buffer_len,
            rows=params.C128A_ROWS.values(
                global_decode=buffers["global_decode"], decode_lens=buffers["decode_lens"],
                prefill=buffers["prefill"], decode_stride=self.capacity,
                prefill_stride=self.capacity, width=width, num_valid_tokens=valid_tokens),
            chunks=params.ROW_CHUNKS.values(cols_per_block=cols_per_block, chunks=chunks,
                                            row_blocks=row_blocks),
            num_tokens=num_tokens, num_decode_tokens=num_decode_tokens)
        return values, blocks, (positions_dtype, ops["slot_mapping"].dtype)

    def _run_cpu(self, cm, num_tokens, c128a_tokens, num_decode_tokens, width, valid_tokens):
        kind, cp = self.kind, self.cp
        view, view_2d = arrays.kernel_view, arrays.kernel_view_2d
        qsl = view(cm.query_start_loc, kind)[:cm.num_reqs + 1]     # as the GPU path reads it
        req = view(self.req_id_per_token_buffer, kind)[:num_tokens]
        cpu.token_to_req_indices(qsl, np.int64(num_tokens), req)
        rows, cols = arrays.probe("block_table_tensor", cm.block_table_tensor).shape
        table, table_stride = view_2d(cm.block_table_tensor, kind)
        if self.compress_ratio > 1:
            slots = view(self.compressed_slot_mapping_buffer, kind)
            cpu.compressed_slot_mapping(
                qsl, view(cm.seq_lens, kind), table, table_stride, np.int64(rows),
                np.int64(cols), np.int64(self.storage_block_size), np.int64(self.compress_ratio),
                np.int64(cp.world_size), np.int64(cp.rank), np.int64(cp.interleave),
                np.int64(slots.shape[0]), slots, False, slots)
        if c128a_tokens:
            capacity = np.int64(self.capacity)
            cpu.c128a_topk_metadata(
                view(cm.positions, kind)[:c128a_tokens], np.int64(128),
                np.int64(num_decode_tokens), req, table, table_stride, np.int64(rows),
                np.int64(cols), np.int64(self.storage_block_size), view(cm.slot_mapping, kind),
                np.int64(width), view(self.c128a_global_decode_buffer.reshape(-1), kind),
                capacity, view(self.c128a_decode_lens_buffer, kind),
                view(self.c128a_prefill_buffer.reshape(-1), kind), capacity,
                np.int64(cp.world_size), np.int64(cp.rank), np.int64(cp.interleave),
                np.int64(valid_tokens))

    def _result_views(self, num_tokens: int, num_decode_tokens: int, num_prefill_tokens: int,
                      width: int):
        """Views of the persistent buffers for one step shape (cached)."""
        view = self._views.get
        slots = self.compressed_slot_mapping_buffer
        decode, lens, prefill = (self.c128a_global_decode_buffer, self.c128a_decode_lens_buffer,
                                 self.c128a_prefill_buffer)
        return (view(self.req_id_per_token_buffer, 0, num_tokens),
                None if slots is None else view(slots, 0, num_tokens),
                None if decode is None else view(decode, 0, num_decode_tokens, width,
                                                 unit_axis=True),
                None if lens is None else view(lens, 0, num_decode_tokens),
                None if prefill is None else view(prefill, 0, num_prefill_tokens, width))
