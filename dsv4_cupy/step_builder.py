"""``DeepseekV4StepMetadataBuilder``: every KV-cache group's per-step metadata in one launch."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import arrays, geometry, params
from .arrays import BOOL, INT32, INT64
from .builder import DeepseekV4MetadataBuilder
from .c4a import fill_short_context_topk_indices
from .combine import build_c128a_combined_prefill_rows, combined_width
from .families import SLOT_MAPPING_AXIS
from .indexer import build_indexer_decode_metadata, build_indexer_prefill_chunk_metadata
from .metadata import CommonAttentionMetadata, exported_to_torch
from .prefill_plan import compute_prefill_gather_lens, get_prefill_chunk_plan
from .prepared import PlanCache, PreparedCall
from .scalars import check_int
from .slot_mapping import get_compressed_slot_mapping
from .split import host_prefilling as host_prefilling_view
from .spec import (INDEX_TOPKS, KV_BLOCK_SIZE, MAX_BLOCK_SIZE, SWA_WINDOW_SIZE,
                   active_width_unchecked, cdiv)
from .step_kernel import step_plan
from .swa import compute_swa_indices_and_lens

#: The KV-cache groups of a DeepSeek-V4 step, as ``build`` takes them.
GROUPS = ("swa", "c4a", "indexer", "c128a")
#: Compress ratio of the C4A layers and of their indexer's cache.
C4A_RATIO = 4
#: vLLM's ``PREFILL_CHUNK_SIZE``: requests' worth of gathered workspace per chunk.
DEFAULT_PREFILL_CHUNK_SIZE = 4
#: SWA-cache rows per block (DeepSeek-V4's sliding-window cache).
SWA_BLOCK_SIZE = 64
_MAX_CACHED_STEPS = 256
_MAX_CACHED_VIEWS = 2048
#: The C128A group's results (its other fields are the caller's arrays).
_C128A_RESULTS = ("req_id_per_token", "slot_mapping", "c128a_global_decode_topk_indices",
                  "c128a_decode_topk_lens", "c128a_prefill_topk_indices")


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
    ``indexer_decode_lens`` ``[Td]``, ``indexer_block_rows [Td, cols]``.
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


class DeepseekV4StepMetadataBuilder:
    """Builds every KV-cache group's metadata of a DeepSeek-V4 step: on the GPU
    one kernel launch per ``build`` (``kernels/step.cu``), on the CPU the single
    ops in turn. Each output equals the composition of the single ops.

    ``build`` takes each group's ``CommonAttentionMetadata`` as vLLM hands it
    to that group's builder, by group name: ``{"swa": ..., "c4a": ...,
    "indexer": ..., "c128a": ...}``. They share the query layout
    (``query_start_loc``, ``seq_lens``, ``positions``, counts); each has its
    own ``block_table_tensor`` and ``slot_mapping`` (read for the SWA and
    C128A groups; the C4A and indexer compressed slot mappings come from
    their block tables, as the seed builder's do). A step with prefills
    needs ``seq_lens_cpu`` (host) on the C128A group's metadata: the chunk
    plans and the indexer's compressed-row count are host decisions.

    Parameters
    ----------
    max_model_len, max_num_batched_tokens : int
        Size the persistent buffers (allocated once: capture-stable addresses
        and row strides).
    block_size : int
        Logical KV block (256): C4A and indexer storage blocks are
        ``block_size // 4``, C128A's ``block_size // 128``.
    swa_block_size : int
        SWA-cache rows per block (64).
    window_size : int
        ``W`` (128).
    index_topk : int
        The indexer's top-k (512 Flash, 1024 Pro): width of the short-context rows.
    num_speculative_tokens, treat_short_extends_as_decodes, width_policy
        As for ``DeepseekV4MetadataBuilder`` (the C128A group).
    combined_prefill : bool
        Build the combined prefill rows of the C128A and SWA-only layers once
        per step (per chunk of the prefill chunk plan), as
        ``combine_topk_swa_indices`` would per layer. They replace the C128A
        local prefill rows, which are then not written (``c128a.
        c128a_prefill_topk_indices`` is None).
    prefill_chunk_size : int
        ``PREFILL_CHUNK_SIZE`` of the chunk plan (4).
    max_num_compressed : int, optional
        Length of the indexer's ``token_to_seq`` buffer (default
        ``40 * max_model_len // 4``, upstream's workspace).
    like, device
        As for ``DeepseekV4MetadataBuilder``.
    """

    def __init__(self, max_model_len: int, max_num_batched_tokens: int, *,
                 block_size: int = KV_BLOCK_SIZE, swa_block_size: int = SWA_BLOCK_SIZE,
                 window_size: int = SWA_WINDOW_SIZE, index_topk: int = INDEX_TOPKS[0],
                 num_speculative_tokens: int = 0, treat_short_extends_as_decodes: bool = True,
                 width_policy: str = "active", combined_prefill: bool = False,
                 prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE,
                 max_num_compressed: int | None = None, like="numpy", device: int | None = None):
        self.c128a_builder = DeepseekV4MetadataBuilder(
            128, max_model_len, max_num_batched_tokens, block_size=block_size,
            index_topk=index_topk, num_speculative_tokens=num_speculative_tokens,
            treat_short_extends_as_decodes=treat_short_extends_as_decodes,
            width_policy=width_policy, like=like, device=device)
        base = self.c128a_builder
        self.kind, self.device = base.kind, base.device
        self.max_model_len, self.max_num_batched_tokens = base.max_model_len, base.max_num_batched_tokens
        self.swa_block_size = check_int("swa_block_size", swa_block_size, minimum=1,
                                        maximum=MAX_BLOCK_SIZE)
        self.window_size = arrays.check_row_width("window_size", window_size, minimum=1)
        self.index_topk = base.topk_tokens
        self.c4a_block_size = check_int("block_size", block_size, minimum=C4A_RATIO) // C4A_RATIO
        self.combined_prefill = bool(combined_prefill)
        self.prefill_chunk_size = check_int("prefill_chunk_size", prefill_chunk_size, minimum=1)
        self.max_num_compressed = check_int(
            "max_num_compressed", 40 * self.max_model_len // C4A_RATIO
            if max_num_compressed is None else max_num_compressed, minimum=1)
        self.max_blocks = cdiv(self.max_model_len, base.block_size)
        n, W = self.max_num_batched_tokens, self.window_size

        def buffer(shape, dtype, value):
            return arrays.full_like_kind(base.req_id_per_token_buffer, shape, dtype, value,
                                         self.device)

        self.is_valid_token_buffer = buffer((n,), BOOL, 0)
        self.swa_indices_buffer = buffer((n, 1, W), INT32, -1)
        self.swa_lens_buffer = buffer((n,), INT32, 0)
        self.prefill_gather_lens_buffer = buffer((n,), INT32, 0)
        self.c4a_slot_mapping_buffer = buffer((n,), INT64, -1)
        self.indexer_slot_mapping_buffer = buffer((n,), INT64, -1)
        self.indexer_decode_buffers = (buffer((n,), INT32, 0), buffer((n,), INT32, 0),
                                       buffer((n,), INT32, 0),
                                       buffer((n, self.max_blocks), INT32, 0))
        self.indexer_prefill_buffers = (buffer((n + 1,), INT32, 0),
                                        buffer((self.max_num_compressed,), INT32, -1),
                                        buffer((n,), INT32, 0), buffer((n,), INT32, 0))
        self.c128a_combined_buffers = self.swa_combined_buffers = None
        if self.combined_prefill:
            self.c128a_combined_buffers = (
                buffer((n, combined_width(base.capacity, W)), INT32, -1), buffer((n,), INT32, 0))
            self.swa_combined_buffers = (buffer((n, combined_width(0, W)), INT32, -1),
                                         buffer((n,), INT32, 0))
        self.short_context_buffer = buffer((n, self.index_topk), INT32, -1)
        buffers = self.buffers()
        owned = [arrays.probe(f"the builder's {name}", x) for name, x in buffers.items()]
        self._owned = arrays.OwnedBuffers(owned)
        self._ptr = {id(x): op.ptr for x, op in zip(buffers.values(), owned)}
        self._prepared = (PlanCache(_MAX_CACHED_STEPS) if self.kind in arrays.GPU_KINDS
                          else None)
        self._captured = None
        self._views = arrays.ViewCache(_MAX_CACHED_VIEWS)
        # The checks of steps that took the full path, by _layout_key(cms) (GPU).
        self._checked = PlanCache(_MAX_CACHED_STEPS) if self._prepared is not None else None

    def buffers(self) -> dict:
        """Every persistent buffer the builds write, by name (the C128A group's
        builder's too)."""
        out = {"is_valid_token_buffer": self.is_valid_token_buffer,
               "swa_indices_buffer": self.swa_indices_buffer,
               "swa_lens_buffer": self.swa_lens_buffer,
               "prefill_gather_lens_buffer": self.prefill_gather_lens_buffer,
               "c4a_slot_mapping_buffer": self.c4a_slot_mapping_buffer,
               "indexer_slot_mapping_buffer": self.indexer_slot_mapping_buffer,
               "short_context_buffer": self.short_context_buffer}
        for group, names in (
                ("indexer_decode_buffers", ("context_lens", "req_ids", "decode_lens", "block_rows")),
                ("indexer_prefill_buffers", ("cu_compressed", "token_to_seq", "cu_seqlen_ks",
                                             "cu_seqlen_ke")),
                ("c128a_combined_buffers", ("indices", "lens")),
                ("swa_combined_buffers", ("indices", "lens"))):
            arrays_of_group = getattr(self, group)
            if arrays_of_group is not None:
                out.update((f"{group}[{name}]", x) for name, x in zip(names, arrays_of_group))
        base = self.c128a_builder
        for name in ("req_id_per_token_buffer", "compressed_slot_mapping_buffer",
                     "c128a_global_decode_buffer", "c128a_decode_lens_buffer",
                     "c128a_prefill_buffer"):
            out[f"c128a_builder.{name}"] = getattr(base, name)
        return out

    # --- the public build --------------------------------------------------------------------
    def build(self, common_prefix_len: int, common_attn_metadata: dict,
              fast_build: bool = False, *, capturing: bool = False) -> DeepseekV4StepMetadata:
        """Build the step's metadata of every group (``common_prefix_len`` and
        ``fast_build`` are accepted for vLLM compatibility, unused).

        ``capturing=True`` says the build is being recorded into a CUDA graph:
        the C128A width is the capacity and the short-context shortcut is not
        taken (vLLM #52492); use ``build_for_cudagraph_capture``. On the GPU,
        a decode step whose arrays have the layouts of an earlier one reuses
        its checks and prepared launch, and returns the same
        ``DeepseekV4StepMetadata`` object.
        """
        if self._prepared is not None and isinstance(common_attn_metadata, dict):
            key = self._step_key(common_attn_metadata, bool(capturing))
            prepared = self._prepared.get(key) if key is not None else None
            if prepared is not None:
                call, metadata = prepared
                if call.run():
                    cm = common_attn_metadata["c128a"]     # host ints outside the key
                    for holder in (metadata, metadata.c128a):
                        holder.max_query_len, holder.max_seq_len = cm.max_query_len, cm.max_seq_len
                    return metadata
        return self._build_checked(common_attn_metadata, bool(capturing))

    def build_for_cudagraph_capture(self, common_attn_metadata: dict) -> DeepseekV4StepMetadata:
        """``build`` for recording inside the caller's CUDA graph (torch's or
        CuPy's stream capture): a uniform decode step (prefills cannot be
        captured), the C128A width at its capacity and no short-context rows.
        The kernel reads every value that varies between steps of one captured
        shape from device memory on replay; the shape is fixed by
        ``num_reqs``, ``num_actual_tokens`` and the buffers' addresses.
        ``check_replay`` says whether a step fits the capture."""
        cm = self._group_metadata(common_attn_metadata)["c128a"]
        self.c128a_builder.check_capturable(cm)
        key = self._step_key(common_attn_metadata, True)    # before anything is recorded
        if key is None:
            raise ValueError("common_attn_metadata: a captured build needs device arrays, every "
                             "group holding the C128A group's query_start_loc and seq_lens "
                             "objects, and max_query_len, max_seq_len ints >= 0 (check_replay "
                             "compares the arrays by their attributes)")
        metadata = self._build_checked(common_attn_metadata, True)
        self._captured = (key, cm.num_reqs, cm.num_actual_tokens)
        return metadata

    def check_replay(self, common_attn_metadata: dict) -> None:
        """Raise ``ValueError`` unless this step fits the captured graph: the same
        arrays (addresses, shapes, strides, dtypes) and counts, a uniform
        decode step, sequences within ``max_model_len``. Host values only."""
        captured = self._captured
        if captured is None:
            raise ValueError("check_replay: nothing was captured (call "
                             "build_for_cudagraph_capture inside the graph capture first)")
        cms = self._group_metadata(common_attn_metadata)
        key, num_reqs, num_tokens = captured
        self.c128a_builder.check_captured_shape(cms["c128a"], num_reqs, num_tokens)
        if self._step_key(cms, True) != key:
            raise ValueError("common_attn_metadata: expected the arrays the graph was captured "
                             "with (same addresses, shapes, strides and dtypes); refresh them "
                             "in place")

    # --- checks ------------------------------------------------------------------------------
    def _group_metadata(self, common_attn_metadata) -> dict:
        if not isinstance(common_attn_metadata, dict) or set(common_attn_metadata) != set(GROUPS):
            got = (sorted(common_attn_metadata) if isinstance(common_attn_metadata, dict)
                   else type(common_attn_metadata).__name__)
            raise TypeError(f"common_attn_metadata: expected a dict of one "
                            f"CommonAttentionMetadata per group {GROUPS}, got {got}")
        for group in GROUPS:
            if not isinstance(common_attn_metadata[group], CommonAttentionMetadata):
                raise TypeError(f"common_attn_metadata[{group!r}]: expected a "
                                f"CommonAttentionMetadata, got "
                                f"{type(common_attn_metadata[group]).__name__}")
        return common_attn_metadata

    def _layout_key(self, cms: dict):
        """What a step's checks depend on, from attributes alone; None for a step
        that is checked in full every time (groups that do not share the C128A
        group's query arrays as the same objects, maxima that are not ints >= 0)."""
        try:
            cm, swa, c4a, indexer = cms["c128a"], cms["swa"], cms["c4a"], cms["indexer"]
        except (KeyError, TypeError):
            return None
        if len(cms) != len(GROUPS) or type(cm) is not CommonAttentionMetadata \
                or type(cm.max_query_len) is not int or type(cm.max_seq_len) is not int \
                or cm.max_query_len < 0 or cm.max_seq_len < 0:
            return None
        for other in (swa, c4a, indexer):
            if type(other) is not CommonAttentionMetadata \
                    or other.query_start_loc is not cm.query_start_loc \
                    or other.seq_lens is not cm.seq_lens or other.num_reqs != cm.num_reqs \
                    or other.num_actual_tokens != cm.num_actual_tokens:
                return None
        return self.c128a_builder._step_key(cm, swa.block_table_tensor, swa.slot_mapping,
                                            c4a.block_table_tensor, indexer.block_table_tensor)

    def _launch_key(self, cm, layout, capturing: bool):
        """The prepared launch's key of a step whose checks are under ``layout``:
        a uniform decode step only (None for one with prefills)."""
        if layout is None or not self.c128a_builder.uniform_decode(cm):
            return None
        return layout, self._width(cm, capturing), self._short_context(cm, capturing), capturing

    def _step_key(self, cms: dict, capturing: bool):
        """``_launch_key`` of a step, from its groups' metadata."""
        layout = self._layout_key(cms)
        return None if layout is None else self._launch_key(cms["c128a"], layout, capturing)

    def _width(self, cm, capturing: bool) -> int:
        """C128A columns written (``max_seq_len`` an int >= 0): the capacity in a
        captured build (a step's live width varies), else the builder's width
        policy."""
        base = self.c128a_builder
        if capturing or base.width_policy == "capacity":
            return base.capacity
        return active_width_unchecked(cm.max_seq_len, base.capacity)

    def _short_context(self, cm, capturing: bool) -> bool:
        return not capturing and cm.num_actual_tokens > 0 and \
            cm.max_seq_len // C4A_RATIO <= self.index_topk

    def _check_groups(self, cms: dict, ops128) -> dict:
        """The other groups' arrays: the C128A group's query layout, their own
        tables and slot mappings. Returns ``{group: {name: Operand}}``."""
        cm128 = cms["c128a"]
        # Every section reads the shared layout of every request.
        arrays.check(ops128["seq_lens"], (INT32,), 1, min_len=cm128.num_reqs)
        probed = {}
        for group in ("swa", "c4a", "indexer"):
            cm = cms[group]
            if (cm.num_reqs, cm.num_actual_tokens) != (cm128.num_reqs, cm128.num_actual_tokens):
                raise ValueError(f"common_attn_metadata[{group!r}]: expected the step's counts "
                                 f"(num_reqs={cm128.num_reqs}, num_actual_tokens="
                                 f"{cm128.num_actual_tokens}), got ({cm.num_reqs}, "
                                 f"{cm.num_actual_tokens})")
            # Only the SWA group's slot mapping is read (its tokens' validity); the
            # compressed slot mappings come from the block tables. The query
            # layout is the C128A group's: the same objects need no second look.
            layout = [name for name in ("query_start_loc", "seq_lens")
                      if getattr(cm, name) is not getattr(cm128, name)]
            if cm.block_table_tensor is None:
                raise TypeError(f"common_attn_metadata[{group!r}].block_table_tensor: expected "
                                f"an int32 array [num_reqs, max_blocks], got None")
            kind, device, ops = arrays.probe_all({
                **{f"{group}.{name}": getattr(cm, name) for name in layout},
                f"{group}.block_table_tensor": cm.block_table_tensor,
                f"{group}.slot_mapping": cm.slot_mapping if group == "swa" else None})
            if (kind, device) != (self.kind, self.device):
                raise TypeError(f"common_attn_metadata[{group!r}]: expected arrays like the "
                                f"builder's buffers ({arrays.describe(self.swa_lens_buffer)}), "
                                f"got {arrays.describe(cm.block_table_tensor)}")
            for name in layout:
                mine, shared = ops[f"{group}.{name}"], ops128[name]
                if (mine.ptr, mine.shape, mine.strides, mine.dtype) != \
                        (shared.ptr, shared.shape, shared.strides, shared.dtype):
                    raise ValueError(f"common_attn_metadata[{group!r}].{name}: expected the "
                                     f"array the C128A group has (the groups share the query "
                                     f"layout)")
            table = ops[f"{group}.block_table_tensor"]
            arrays.check(table, (INT32,), 2)
            if table.shape[0] > cm.num_reqs:
                raise ValueError(f"common_attn_metadata[{group!r}].block_table_tensor: expected "
                                 f"at most num_reqs ({cm.num_reqs}) rows, got shape "
                                 f"{tuple(table.shape)}")
            probed[group] = ops
        slots = probed["swa"]["swa.slot_mapping"]
        arrays.check(slots, SLOT_MAPPING_AXIS[1], 1, min_len=cm128.num_actual_tokens)
        if slots.dtype != ops128["slot_mapping"].dtype:
            raise TypeError(f"common_attn_metadata['swa'].slot_mapping: expected the C128A "
                            f"group's dtype {ops128['slot_mapping'].dtype}, got {slots.dtype}")
        indexer_table = probed["indexer"]["indexer.block_table_tensor"]
        if indexer_table.shape[1] > self.max_blocks:
            raise ValueError(f"common_attn_metadata['indexer'].block_table_tensor: expected at "
                             f"most {self.max_blocks} columns (cdiv(max_model_len, block_size)),"
                             f" got shape {tuple(indexer_table.shape)}")
        return probed

    def _prefill_plans(self, cm, host_qsl, num_decodes: int, num_prefills: int,
                       num_prefill_tokens: int):
        """``(c128a plan, swa plan, compressed rows of the indexer)`` from host data."""
        if not num_prefills:
            return None, None, 0
        if cm.seq_lens_cpu is None:
            raise ValueError("common_attn_metadata['c128a'].seq_lens_cpu: required for a step "
                             "with prefills (the chunk plans and the indexer's row count are "
                             "host decisions), got None")
        seq_cpu = arrays.probe("seq_lens_cpu", cm.seq_lens_cpu)
        if seq_cpu.kind not in (arrays.NUMPY, arrays.TORCH_CPU):
            raise TypeError("seq_lens_cpu: expected a host array (numpy or torch CPU), got "
                            f"{arrays.describe(cm.seq_lens_cpu)}")
        arrays.check(seq_cpu, (INT32, INT64), 1, min_len=num_decodes + num_prefills)
        # Python ints: a handful of requests costs less than numpy calls.
        end = num_decodes + num_prefills
        seq = arrays.host_view(seq_cpu.array, seq_cpu.kind)[num_decodes:end].tolist()
        starts = host_qsl[num_decodes:end + 1].tolist()
        queries = [b - a for a, b in zip(starts, starts[1:])]
        if min(queries) < 0 or sum(queries) > num_prefill_tokens:
            raise ValueError(f"query_start_loc_cpu: expected the prefill requests' query "
                             f"lengths >= 0 and at most num_prefill_tokens="
                             f"{num_prefill_tokens} in all, got {queries}")
        compressed = sum(max(length // C4A_RATIO, 0) for length in seq)
        if compressed > self.max_num_compressed:
            raise ValueError(f"seq_lens_cpu: expected at most max_num_compressed="
                             f"{self.max_num_compressed} compressed indexer rows over the "
                             f"prefills, got {compressed}")
        if not self.combined_prefill:
            return None, None, compressed
        plan_args = (self.prefill_chunk_size, self.window_size, self.max_model_len,
                     self.max_num_batched_tokens)
        plans = (get_prefill_chunk_plan(seq, queries, 128, *plan_args),
                 get_prefill_chunk_plan(seq, queries, 1, *plan_args))
        for plan in plans:
            for start, end, _, M in plan:
                if M * (end - start) > np.iinfo(np.int32).max:
                    raise ValueError(f"seq_lens_cpu: a prefill chunk's workspace (M={M} rows "
                                     f"per request, {end - start} requests) exceeds int32")
        return plans[0], plans[1], compressed

    # --- the build ---------------------------------------------------------------------------
    def _build_checked(self, common_attn_metadata, capturing: bool) -> DeepseekV4StepMetadata:
        cms = self._group_metadata(common_attn_metadata)
        base, cm = self.c128a_builder, cms["c128a"]
        # A step with prefills makes its host decisions every time; the checks of
        # its arrays are those of the last step with the same layouts (GPU).
        layout = self._layout_key(cms) if self._prepared is not None else None
        checked = self._checked.get(layout) if layout is not None else None
        if checked is None:
            num_tokens, qsl_cpu, ops128 = base._check_step(cm)
            groups = self._check_groups(cms, ops128)
            self._owned.check_inputs([*ops128.values(),
                                      *(op for ops in groups.values() for op in ops.values())])
            if layout is not None:
                self._checked.put(layout, (num_tokens, qsl_cpu, ops128, groups))
        else:
            num_tokens, qsl_cpu, ops128, groups = checked
        host_qsl = arrays.host_view(qsl_cpu.array, qsl_cpu.kind)
        host_prefilling = None
        if not base.treat_short_extends_as_decodes and cm.num_reqs:
            host_prefilling = host_prefilling_view(cm.is_prefilling, cm.num_reqs)
        split = base._split(cm, host_qsl, host_prefilling)
        num_decodes, num_prefills, nd, np_tokens = split
        indexer_rows = groups["indexer"]["indexer.block_table_tensor"].shape[0]
        if indexer_rows < num_decodes:
            raise ValueError(f"common_attn_metadata['indexer'].block_table_tensor: expected a "
                             f"row for each of the {num_decodes} decode requests, got "
                             f"{indexer_rows} rows")
        c128a_plan, swa_plan, compressed = self._prefill_plans(cm, host_qsl, num_decodes,
                                                               num_prefills, np_tokens)
        short = self._short_context(cm, capturing)
        # The combined rows replace the C128A local prefill rows: those are not written.
        c128a_tokens = nd if self.combined_prefill else nd + np_tokens
        width = self._width(cm, capturing) if nd + np_tokens else 0
        valid_tokens = base._valid_tokens(cm, host_qsl)
        views = base._result_views(num_tokens, nd, np_tokens, width)
        step = dict(cms=cms, ops128=ops128, groups=groups, split=split, width=width,
                    num_tokens=num_tokens, c128a_plan=c128a_plan, swa_plan=swa_plan,
                    compressed=compressed, short=short, host_qsl=host_qsl)
        metadata = self._metadata(cm, split, views, step)
        if self.kind in arrays.GPU_KINDS:
            key = self._launch_key(cm, layout, capturing)
            call = PreparedCall(self._plans(step, c128a_tokens, valid_tokens), self.kind,
                                self.device, metadata,
                                owned=_arrays_of(metadata) if key is not None else ())
            if not call.run():
                raise RuntimeError("DeepseekV4StepMetadataBuilder.build: the device changed "
                                   "during the build")
            if key is not None:
                self._prepared.put(key, (call, metadata))
        else:
            base._run_cpu(cm, num_tokens, c128a_tokens, nd, width, valid_tokens)
            self._run_ops(metadata, step)
        return metadata

    def _metadata(self, cm, split, views, step) -> DeepseekV4StepMetadata:
        num_decodes, num_prefills, nd, np_tokens = split
        T, view = step["num_tokens"], self._views.get
        c128a = self.c128a_builder._metadata(cm, split, views)
        if self.combined_prefill:
            c128a.c128a_prefill_topk_indices = None
        swa_rows, swa_lens = self.swa_indices_buffer, self.swa_lens_buffer
        context, req_ids, decode_lens, block_rows = self.indexer_decode_buffers
        cu, token_to_seq, ks, ke = self.indexer_prefill_buffers
        cols = step["groups"]["indexer"]["indexer.block_table_tensor"].shape[1]
        out = DeepseekV4StepMetadata(
            num_reqs=cm.num_reqs, num_actual_tokens=T, max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len, num_decodes=num_decodes, num_prefills=num_prefills,
            num_decode_tokens=nd, num_prefill_tokens=np_tokens,
            req_id_per_token=c128a.req_id_per_token,
            is_valid_token=view(self.is_valid_token_buffer, 0, T),
            c4a_slot_mapping=view(self.c4a_slot_mapping_buffer, 0, T),
            indexer_slot_mapping=view(self.indexer_slot_mapping_buffer, 0, T), c128a=c128a)
        if nd:
            out.swa_decode_indices, out.swa_decode_lens = view(swa_rows, 0, nd), view(swa_lens, 0, nd)
            out.indexer_context_lens, out.indexer_req_ids = view(context, 0, nd), view(req_ids, 0, nd)
            out.indexer_decode_lens = view(decode_lens, 0, nd)
            out.indexer_block_rows = view(block_rows, 0, nd, cols)
        if np_tokens:
            out.swa_prefill_indices = view(swa_rows, nd, nd + np_tokens)
            out.swa_prefill_lens = view(swa_lens, nd, nd + np_tokens)
        if num_prefills:
            out.prefill_gather_lens = view(self.prefill_gather_lens_buffer, 0, num_prefills)
            out.indexer_cu_compressed = view(cu, 0, num_prefills + 1)
            out.indexer_token_to_seq = view(token_to_seq, 0, step["compressed"])
            out.indexer_cu_seqlen_ks = view(ks, 0, np_tokens)
            out.indexer_cu_seqlen_ke = view(ke, 0, np_tokens)
            if self.combined_prefill:
                out.c128a_prefill_chunks, out.swa_prefill_chunks = step["c128a_plan"], step["swa_plan"]
                rows, lens = self.c128a_combined_buffers
                out.c128a_combined_indices = view(
                    rows, 0, np_tokens, combined_width(step["width"], self.window_size))
                out.c128a_combined_lens = view(lens, 0, np_tokens)
                rows, lens = self.swa_combined_buffers
                out.swa_combined_indices = view(rows, 0, np_tokens,
                                                combined_width(0, self.window_size))
                out.swa_combined_lens = view(lens, 0, np_tokens)
        if step["short"]:
            out.c4a_short_context_topk_indices = view(self.short_context_buffer, 0, T)
        return out

    def _run_ops(self, out: DeepseekV4StepMetadata, step) -> None:
        """The CPU path: the single ops in turn, into the builder's buffers."""
        cms, T = step["cms"], step["num_tokens"]
        num_decodes, num_prefills, nd, np_tokens = step["split"]
        cm = cms["c128a"]
        qsl, seq = cm.query_start_loc, cm.seq_lens
        view = arrays.kernel_view
        valid = view(self.is_valid_token_buffer, self.kind)[:T]
        np.greater_equal(view(cms["swa"].slot_mapping, self.kind)[:T], 0, out=valid)
        compute_swa_indices_and_lens(
            self.window_size, qsl, seq, out.req_id_per_token, out.is_valid_token,
            cms["swa"].block_table_tensor, self.swa_block_size, 0, T,
            out=(self.swa_indices_buffer, self.swa_lens_buffer))
        for group, buffer in (("c4a", self.c4a_slot_mapping_buffer),
                              ("indexer", self.indexer_slot_mapping_buffer)):
            get_compressed_slot_mapping(T, qsl, seq, cms[group].block_table_tensor,
                                        self.c4a_block_size, C4A_RATIO, out=buffer)
        build_indexer_decode_metadata(qsl[:num_decodes + 1], seq, cms["indexer"].block_table_tensor,
                                      nd, C4A_RATIO, out=self.indexer_decode_buffers)
        if num_prefills:
            compute_prefill_gather_lens(qsl, seq, num_decodes, num_prefills, self.window_size,
                                        out=self.prefill_gather_lens_buffer)
            prefill_qsl = qsl[num_decodes:num_decodes + num_prefills + 1]
            build_indexer_prefill_chunk_metadata(
                prefill_qsl, seq[num_decodes:], C4A_RATIO, 0, np_tokens,
                num_compressed=step["compressed"], out=self.indexer_prefill_buffers)
            if self.combined_prefill:
                for _, plan, buffers, topk, ratio in self._combined_layer_types(step):
                    self._combine_chunks(step, num_decodes, buffers, plan, topk, ratio)
        if step["short"]:
            fill_short_context_topk_indices(cm.positions, self.index_topk, C4A_RATIO, T,
                                            out=self.short_context_buffer)

    def _combined_layer_types(self, step) -> tuple:
        """``(step-kernel section, plan, (rows, lens) buffers, topk, ratio)`` of the
        C128A and the SWA-only layers' combined rows."""
        return (("c128a_combine", step["c128a_plan"], self.c128a_combined_buffers,
                 step["width"], 128),
                ("swa_combine", step["swa_plan"], self.swa_combined_buffers, 0, 0))

    @staticmethod
    def _chunk_rows(step, num_decodes: int, plan) -> list[tuple]:
        """``(start, end, N, M, t0, t1)`` per chunk: its prefill rows ``[t0, t1)``;
        the last chunk also takes the step's padding rows (all -1, length 0)."""
        host_qsl, num_prefill_tokens = step["host_qsl"], step["split"][3]
        first = int(host_qsl[num_decodes])
        rows = [(start, end, N, M, int(host_qsl[num_decodes + start]) - first,
                 int(host_qsl[num_decodes + end]) - first) for start, end, N, M in plan]
        if rows:
            rows[-1] = rows[-1][:5] + (num_prefill_tokens,)
        return rows

    def _combine_chunks(self, step, num_decodes, buffers, plan, topk, ratio) -> None:
        cm = step["cms"]["c128a"]
        rows, lens = buffers
        gather = self.prefill_gather_lens_buffer
        for start, end, N, M, t0, t1 in self._chunk_rows(step, num_decodes, plan):
            a, b = num_decodes + start, num_decodes + end
            build_c128a_combined_prefill_rows(
                t1 - t0, cm.query_start_loc[a:b + 1], cm.seq_lens[a:b], gather[start:end],
                self.window_size, ratio, topk, M, N, out=(rows[t0:t1], lens[t0:t1]))

    # --- the GPU launch ----------------------------------------------------------------------
    def _plans(self, step, c128a_tokens: int, valid_tokens: int) -> tuple:
        """The step kernel's launch: every section this step needs (a prefill
        plan longer than params.MAX_PLAN_CHUNKS adds launches of its combine)."""
        cms, ops128, groups = step["cms"], step["ops128"], step["groups"]
        base = self.c128a_builder
        num_decodes, num_prefills, nd, np_tokens = step["split"]
        T, W = step["num_tokens"], self.window_size
        ptr = self._ptr
        query = _requests(ops128, 0, cms["c128a"].num_reqs)
        values, blocks, variant = base.base_section(cms["c128a"].num_reqs, ops128, T, c128a_tokens,
                                                    nd, step["width"], valid_tokens)
        if ops128["positions"] is not None:     # the short-context rows read them too
            variant = (ops128["positions"].dtype, variant[1])
        sections = {"base": (values, blocks)}
        swa_table = groups["swa"]["swa.block_table_tensor"]
        if T:
            sections["swa"] = (params.SWA.values(
                query=query, table=arrays.block_table_group(swa_table), token_to_req=0,
                is_valid_token=0, indices=ptr[id(self.swa_indices_buffer)],
                lens=ptr[id(self.swa_lens_buffer)], indices_stride=W, window_size=W,
                block_size=self.swa_block_size, token_offset=0, num_rows=T,
                guess_shift=geometry.request_guess_shift(T, cms["c128a"].num_reqs)),
                geometry.row_lane_blocks(T))
        n = self.max_num_batched_tokens
        for group, buffer in (("c4a", self.c4a_slot_mapping_buffer),
                              ("indexer", self.indexer_slot_mapping_buffer)):
            table = groups[group][f"{group}.block_table_tensor"]
            sections[f"{group}_slots"] = (params.SLOT_MAPPING.values(
                query=_requests(ops128, 0, table.shape[0]), table=arrays.block_table_group(table),
                geometry=params.SLOT_GEOMETRY.values(block_size=self.c4a_block_size,
                                                     ratio=C4A_RATIO, cp_world_size=1, cp_rank=0,
                                                     cp_interleave=1),
                token_slots=0, out=ptr[id(buffer)], out_len=n, num_tokens=T),
                geometry.element_blocks(n))
        context, req_ids, decode_lens, block_rows = (ptr[id(x)] for x in self.indexer_decode_buffers)
        indexer_table = groups["indexer"]["indexer.block_table_tensor"]
        sections["indexer_decode"] = (params.INDEXER_DECODE.values(
            query=_requests(ops128, 0, num_decodes), table=arrays.block_table_group(indexer_table),
            context_lens=context, req_ids=req_ids,
            decode_lens=decode_lens, block_rows=block_rows, block_rows_stride=self.max_blocks,
            num_tokens=nd, context_lens_len=n, ratio=C4A_RATIO),
            geometry.indexer_decode_blocks(nd, indexer_table.shape[1], n))
        if num_prefills:
            sections["gather"] = (params.PREFILL_GATHER.values(
                query=query, out=ptr[id(self.prefill_gather_lens_buffer)],
                num_decodes=num_decodes, num_prefills=num_prefills, window_size=W),
                geometry.elementwise_blocks(num_prefills))
            cu, token_to_seq, ks, ke = (ptr[id(x)] for x in self.indexer_prefill_buffers)
            sections["indexer_prefill"] = (params.INDEXER_PREFILL.values(
                query=_requests(ops128, num_decodes, num_prefills), cu_compressed=cu,
                token_to_seq=token_to_seq, seqlen_ks=ks,
                seqlen_ke=ke, num_compressed=step["compressed"], ratio=C4A_RATIO,
                query_slice_start=0, query_slice_stop=np_tokens),
                geometry.row_blocks(num_prefills + 1))
        if step["short"]:
            positions = ops128["positions"]
            sections["short_context"] = (params.SHORT_CONTEXT.values(
                positions=positions.ptr, out=ptr[id(self.short_context_buffer)],
                out_stride=self.index_topk, top_k=self.index_topk, ratio=C4A_RATIO,
                num_tokens=T), geometry.row_lane_blocks(T))
        swa_slots = groups["swa"]["swa.slot_mapping"].ptr
        valid_out = ptr[id(self.is_valid_token_buffer)]
        combine_launches = []
        if num_prefills and self.combined_prefill:
            combine_launches = self._combine_sections(step, num_decodes, ops128)
            sections.update(combine_launches.pop(0))
        plans = [step_plan(self.device, variant, sections, swa_slots, valid_out)]
        plans += [step_plan(self.device, variant, extra) for extra in combine_launches]
        return tuple(plan for plan in plans if plan is not None)

    def _combine_sections(self, step, num_decodes, ops128) -> list[dict]:
        """The combine sections of each launch: at most MAX_PLAN_CHUNKS chunks
        of each plan per launch."""
        W, limit = self.window_size, params.MAX_PLAN_CHUNKS
        launches = []
        for name, plan, buffers, topk, ratio in self._combined_layer_types(step):
            rows, lens = buffers
            width, stride = combined_width(topk, W), rows.shape[1]      # contiguous rows
            lanes = geometry.combine_lanes(width)
            chunk_rows = self._chunk_rows(step, num_decodes, plan)
            for index in range(0, len(chunk_rows), limit):
                piece = chunk_rows[index:index + limit]
                a, b = num_decodes + piece[0][0], num_decodes + piece[-1][1]
                t0, t1 = piece[0][4], piece[-1][5]
                pad = [0] * (limit - len(piece))
                values = params.PREFILL_COMBINE.values(
                    lanes=lanes, rows=params.COMBINE.values(
                        query=_requests(ops128, a, b - a), gather_lens=0, topk_indices=0,
                        out=self._ptr[id(rows)] + 4 * t0 * stride,
                        lens=self._ptr[id(lens)] + 4 * t0, topk_stride=0, out_stride=stride,
                        width=width, num_tokens=t1 - t0, window_size=W, ratio=ratio, topk=topk,
                        rows_per_request=0, swa_offset=0),
                    plan=params.PREFILL_PLAN.values(
                        chunks=len(piece),
                        first_request=[chunk[0] - piece[0][0] for chunk in piece] + pad,
                        rows_per_request=[chunk[3] for chunk in piece] + pad,
                        swa_offset=[chunk[2] for chunk in piece] + pad))
                if len(launches) <= index // limit:
                    launches.append({})
                launches[index // limit][name] = (values, geometry.row_lane_blocks(t1 - t0, lanes))
        return launches or [{}]


def _requests(ops128, first: int, count: int) -> tuple:
    """The ``QueryLayout`` values of the step's requests ``[first, first + count)``:
    the shared int32 ``query_start_loc`` and ``seq_lens`` from request ``first``."""
    item = INT32.itemsize
    return params.QUERY_LAYOUT.values(query_start_loc=ops128["query_start_loc"].ptr + item * first,
                                      seq_lens=ops128["seq_lens"].ptr + item * first,
                                      num_reqs=count)


def _arrays_of(metadata: DeepseekV4StepMetadata) -> tuple:
    """The arrays a build returns, each once (a prepared build watches them for
    in-place changes)."""
    found = {}
    values = [getattr(metadata, field.name) for field in dataclasses.fields(metadata)
              if field.name != "c128a"]
    values += [getattr(metadata.c128a, name) for name in _C128A_RESULTS]
    for value in values:
        if value is not None and not isinstance(value, (int, list)):
            found.setdefault(id(value), value)
    return tuple(found.values())


__all__ = ["DeepseekV4StepMetadataBuilder", "DeepseekV4StepMetadata", "GROUPS"]
