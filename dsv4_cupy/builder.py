"""``DeepseekV4MetadataBuilder``: the seed builder's per-step work, in one launch on GPU."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, kernels
from .arrays import INT32, INT64
from .c128a import POSITION_DTYPES, SLOT_DTYPES, check_request_ids, entry_name
from .metadata import CommonAttentionMetadata, DeepseekV4Metadata
from .spec import KV_BLOCK_SIZE, DeepseekV4FlashMLABackend, c128a_active_width, c128a_capacity
from .split import split_host

WIDTH_POLICIES = ("capacity", "active")
_MAX_CACHED_VIEWS = 512


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
    width_policy : "capacity" or "active"
        C128A columns written per row: the seed's fixed capacity
        ``round_up(cdiv(max_model_len, 128), 128)``, or the upstream #52823 live
        width ``c128a_active_width(max_seq_len, capacity)``. The row stride is
        the capacity either way (a batch-dependent stride broke captured
        decode consumers, vLLM #52448).
    like : "numpy", "cupy" or "torch"
        Kind of the persistent buffers; the step's arrays must be of that kind
        (torch: CUDA when available, else CPU).
    device : int, optional
        CUDA device for GPU buffers (default: the current one).

    Buffers: ``req_id_per_token_buffer`` int32 ``[max_num_batched_tokens]``;
    ``compressed_slot_mapping_buffer`` int64 ``[max_num_batched_tokens]`` (ratio > 1);
    ``c128a_global_decode_buffer``, ``c128a_prefill_buffer`` int32
    ``[max_num_batched_tokens, capacity]`` and ``c128a_decode_lens_buffer`` int32
    ``[max_num_batched_tokens]`` (ratio 128).
    """

    def __init__(self, compress_ratio: int, max_model_len: int, max_num_batched_tokens: int, *,
                 block_size: int = KV_BLOCK_SIZE, index_topk: int = 512,
                 num_speculative_tokens: int = 0, width_policy: str = "capacity",
                 like: str = "numpy", device: int | None = None):
        self.compress_ratio = arrays.check_int("compress_ratio", compress_ratio, minimum=1)
        self.max_model_len = arrays.check_int("max_model_len", max_model_len, minimum=1)
        self.max_num_batched_tokens = arrays.check_int("max_num_batched_tokens",
                                                       max_num_batched_tokens, minimum=1)
        self.block_size = arrays.check_int("block_size", block_size, minimum=1)
        self.topk_tokens = arrays.check_int("index_topk", index_topk, minimum=1)
        spec_tokens = arrays.check_int("num_speculative_tokens", num_speculative_tokens, minimum=0)
        self.decode_threshold = 1 + spec_tokens
        if width_policy not in WIDTH_POLICIES:
            raise ValueError(f"width_policy: expected one of {WIDTH_POLICIES}, got {width_policy!r}")
        self.width_policy = width_policy
        self.storage_block_size = self.block_size // self.compress_ratio
        if self.compress_ratio > 1 and self.storage_block_size < 1:
            raise ValueError(f"block_size: expected a multiple of compress_ratio "
                             f"({self.compress_ratio}), got {self.block_size}")
        self.capacity = c128a_capacity(self.max_model_len) if self.compress_ratio == 128 else 0

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
        self._views: dict = {}

    def width(self, max_seq_len: int) -> int:
        """C128A columns written this step (0 unless compress_ratio is 128)."""
        if self.compress_ratio != 128:
            return 0
        if self.width_policy == "capacity":
            return self.capacity
        return c128a_active_width(max_seq_len, self.capacity)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> DeepseekV4Metadata:
        """Build one step's metadata (``common_prefix_len`` and ``fast_build`` are
        accepted for vLLM compatibility and, as in the seed, unused).

        On GPU this is one kernel launch with no host sync and no allocation:
        the decode/prefill split comes from ``query_start_loc_cpu``. Returns
        views of the persistent buffers.
        """
        cm = common_attn_metadata
        kind, device = self.kind, self.device
        ratio = self.compress_ratio
        step = self._check_step(cm)
        num_tokens, positions, slot_mapping, block_table = step
        qsl_cpu = arrays.host_view(cm.query_start_loc_cpu, arrays.kind_of(cm.query_start_loc_cpu))
        if ratio == 128:
            num_decodes, num_prefills, nd, num_prefill = split_host(
                qsl_cpu, self.decode_threshold, False, num_tokens, cm.max_query_len)
        else:
            num_decodes = num_prefills = nd = num_prefill = 0
        # The C128A rows cover the split's tokens (none for a batch of padding only).
        c128a_tokens = nd + num_prefill
        width = self.width(cm.max_seq_len) if c128a_tokens else 0

        if kind in arrays.GPU_KINDS:
            self._launch(cm, num_tokens, c128a_tokens, nd, width, positions, slot_mapping,
                         block_table)
        else:
            self._run_cpu(cm, num_tokens, c128a_tokens, nd, num_decodes, width, positions,
                          slot_mapping, block_table)

        req_view, csm_view, gd_view, lens_view, pf_view = self._result_views(
            num_tokens, nd, num_prefill, width)
        return DeepseekV4Metadata(
            num_reqs=cm.num_reqs, max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
            num_actual_tokens=num_tokens, query_start_loc=cm.query_start_loc,
            slot_mapping=csm_view if ratio > 1 else slot_mapping, block_table=block_table,
            req_id_per_token=req_view, block_size=self.block_size, topk_tokens=self.topk_tokens,
            num_decodes=num_decodes, num_prefills=num_prefills, num_decode_tokens=nd,
            num_prefill_tokens=num_prefill,
            c128a_global_decode_topk_indices=gd_view if nd else None,
            c128a_decode_topk_lens=lens_view if nd else None,
            c128a_prefill_topk_indices=pf_view if num_prefill else None)

    def _check_step(self, cm: CommonAttentionMetadata):
        """Validate the step's arrays (kind, device, dtypes, lengths); no sync."""
        if not isinstance(cm, CommonAttentionMetadata):
            raise TypeError("common_attn_metadata: expected a CommonAttentionMetadata, "
                            f"got {type(cm).__name__}")
        num_tokens = arrays.check_int("num_actual_tokens", cm.num_actual_tokens, minimum=0,
                                      maximum=self.max_num_batched_tokens)
        num_reqs = arrays.check_int("num_reqs", cm.num_reqs, minimum=0)
        arrays.check_int("max_seq_len", cm.max_seq_len, minimum=0)
        arrays.check_int("max_query_len", cm.max_query_len, minimum=0)
        needs_positions = self.compress_ratio == 128 and num_tokens > 0
        if needs_positions and cm.positions is None:
            raise ValueError("positions: required for C128A metadata (compress_ratio 128), got None")
        step = {"query_start_loc": cm.query_start_loc, "seq_lens": cm.seq_lens,
                "block_table_tensor": cm.block_table_tensor, "slot_mapping": cm.slot_mapping,
                "positions": cm.positions if needs_positions else None}
        kind, device = arrays.common_kind(step)
        if (kind, device) != (self.kind, self.device):
            raise TypeError(f"common_attn_metadata: expected arrays like the builder's buffers "
                            f"({arrays.describe(self.req_id_per_token_buffer)}), got "
                            f"{arrays.describe(cm.query_start_loc)}")
        qsl_cpu_kind = arrays.kind_of(cm.query_start_loc_cpu)
        if qsl_cpu_kind not in (arrays.NUMPY, arrays.TORCH_CPU):
            raise TypeError("query_start_loc_cpu: expected a host array (numpy or torch CPU), "
                            f"got {arrays.describe(cm.query_start_loc_cpu)}")
        arrays.check("query_start_loc_cpu", cm.query_start_loc_cpu, qsl_cpu_kind, (INT32, INT64),
                     1, min_len=num_reqs + 1)
        block_table = cm.block_table_tensor
        arrays.check("block_table_tensor", block_table, kind, (INT32,), 2)
        if block_table.shape[0] > num_reqs:
            raise ValueError(f"block_table_tensor: expected at most num_reqs ({num_reqs}) rows, "
                             f"got shape {tuple(block_table.shape)}")
        arrays.check("query_start_loc", cm.query_start_loc, kind, (INT32,), 1, min_len=num_reqs + 1)
        arrays.check("seq_lens", cm.seq_lens, kind, (INT32,), 1, min_len=block_table.shape[0])
        arrays.check("slot_mapping", cm.slot_mapping, kind, SLOT_DTYPES, 1, min_len=num_tokens)
        if needs_positions:
            arrays.check("positions", cm.positions, kind, POSITION_DTYPES, 1, min_len=num_tokens)
            if block_table.shape[0] == 0 or block_table.shape[1] == 0:
                raise ValueError("block_table_tensor: expected at least one row and column for "
                                 f"C128A decode lookups, got shape {tuple(block_table.shape)}")
        return num_tokens, cm.positions, cm.slot_mapping, block_table

    def _launch(self, cm, num_tokens, c128a_tokens, nd, width, positions, slot_mapping,
                block_table):
        kind, device = self.kind, self.device
        a = arrays.kernel_arg
        csm = self.compressed_slot_mapping_buffer
        csm_len = csm.shape[0] if csm is not None else 0
        if c128a_tokens:
            per_block, chunks = kernels.row_geometry(c128a_tokens, width, device)
            positions_dtype = arrays.dtype_of(positions, kind)
        else:
            per_block, chunks, positions_dtype = 0, 1, INT64
        row_blocks = c128a_tokens * chunks if per_block else 0
        token_blocks = -(-max(num_tokens, csm_len) // kernels.THREADS)
        if row_blocks + token_blocks == 0:
            return
        gd, lens, pf = (self.c128a_global_decode_buffer, self.c128a_decode_lens_buffer,
                        self.c128a_prefill_buffer)
        stride = np.int64(self.capacity)
        name = entry_name("build_step", positions_dtype, arrays.dtype_of(slot_mapping, kind))
        kernels.launch("build_step.cu", name, device, row_blocks + token_blocks, (
            a(cm.query_start_loc, kind), np.int32(cm.num_reqs), a(cm.seq_lens, kind),
            a(block_table, kind), np.int64(block_table.shape[0]), np.int64(block_table.shape[1]),
            np.int64(arrays.row_stride(block_table, kind) if block_table.shape[0] else 0),
            a(positions, kind) if per_block else 0, a(slot_mapping, kind),
            np.int64(num_tokens), np.int64(nd), np.int64(self.compress_ratio),
            np.int64(max(self.storage_block_size, 1)), np.int64(1), np.int64(0), np.int64(1),
            a(self.req_id_per_token_buffer, kind), a(csm, kind) if csm is not None else 0,
            np.int64(csm_len), np.int32(width), a(gd, kind) if gd is not None else 0, stride,
            a(lens, kind) if lens is not None else 0, a(pf, kind) if pf is not None else 0,
            stride, np.int32(per_block), np.int32(chunks), np.int64(row_blocks)),
            arrays.launch_stream(kind, device))

    def _run_cpu(self, cm, num_tokens, c128a_tokens, nd, num_decodes, width, positions,
                 slot_mapping, block_table):
        kind = self.kind
        h = arrays.host_view
        qsl = h(cm.query_start_loc, kind)
        req = h(self.req_id_per_token_buffer, kind)[:num_tokens]
        cpu.token_to_req_indices(qsl, np.int64(num_tokens), req)
        table = h(block_table, kind)
        if self.compress_ratio > 1:
            cpu.compressed_slot_mapping(qsl, h(cm.seq_lens, kind), table,
                                        np.int64(self.storage_block_size),
                                        np.int64(self.compress_ratio), np.int64(1), np.int64(0),
                                        np.int64(1), h(self.compressed_slot_mapping_buffer, kind))
        if c128a_tokens:
            if nd:
                check_request_ids(req[:nd], num_decodes)
            cpu.c128a_topk_metadata(
                h(positions, kind)[:c128a_tokens], np.int64(128), np.int64(nd), req,
                table[:num_decodes], np.int64(self.storage_block_size), h(slot_mapping, kind),
                np.int64(width), h(self.c128a_global_decode_buffer, kind),
                h(self.c128a_decode_lens_buffer, kind), h(self.c128a_prefill_buffer, kind))

    def _result_views(self, num_tokens: int, nd: int, num_prefill: int, width: int):
        """Views of the persistent buffers for one step shape, cached: slicing
        costs more host time than the rest of a GPU build."""
        key = (num_tokens, nd, num_prefill, width)
        views = self._views.get(key)
        if views is None:
            csm = self.compressed_slot_mapping_buffer
            gd, lens, pf = (self.c128a_global_decode_buffer, self.c128a_decode_lens_buffer,
                            self.c128a_prefill_buffer)
            views = (self.req_id_per_token_buffer[:num_tokens],
                     csm[:num_tokens] if csm is not None else None,
                     gd[:nd, None, :width] if gd is not None else None,
                     lens[:nd] if lens is not None else None,
                     pf[:num_prefill, :width] if pf is not None else None)
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            self._views[key] = views
        return views
