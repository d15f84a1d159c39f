"""``DeepseekV4StepMetadataBuilder``: every KV-cache group's per-step metadata in one launch."""
from __future__ import annotations

from . import checks, keys
from .combine import combined_width, prefill_combine_launches
from .geometry import WARP_LANES
from .group import MAX_CACHED_VIEWS, KVCacheGroup
from .indexer_prefill import indexer_prefill_launch
from .kinds import BOOL, GPU_KINDS, INT32, INT64, Operand, probe
from .launch import Launch
from .metadata import CommonAttentionMetadata, DeepseekV4StepMetadata, copied_step
from .params import QueryLayout, SlotGeometry
from .prefill_gather import gather_lens_launch
from .prepared import PreparedCall, PreparedCalls
from .scalars import check_int
from .short_context import short_context_launch
from .slot_mapping import slot_mapping_launch
from .spec import (C4A_RATIO, C128A_RATIO, INDEX_TOPKS, KV_BLOCK_SIZE, MAX_BLOCK_SIZE,
                   PREFILL_CHUNK_SIZE, SWA_BLOCK_SIZE, SWA_WINDOW_SIZE, cdiv)
from .step_indexer import IndexerDecode
from .step_kernel import step_launch
from .step_plan import (GROUPS, MAX_HOST_VIEWS, MAX_LAYOUT_STEPS, PreparedStep, SectionCache,
                        StepLayout, StepPlan, check_group_data, check_group_metadata,
                        check_groups, chunk_budgets, prefill_plans, shared_c128a_group)
from .swa import swa_launch

#: The builder's buffers kept as tuples, by their fields' names (``name[field]``).
BUFFER_TUPLES = {name: tuple(f"{name}[{field}]" for field in fields) for name, fields in {
    "indexer_decode_buffers": ("context_lens", "req_ids", "decode_lens", "block_rows",
                               "per_req_decode_lens"),
    "indexer_prefill_buffers": ("cu_compressed", "token_to_seq", "cu_seqlen_ks", "cu_seqlen_ke"),
    "c128a_combined_buffers": ("indices", "lens"),
    "swa_combined_buffers": ("indices", "lens")}.items()}
_TUPLE_FIELDS = {field for fields in BUFFER_TUPLES.values() for field in fields}


def _fields(name: str, *specs) -> dict:
    """The buffer specs of the tuple ``name``, by its fields' names."""
    return dict(zip(BUFFER_TUPLES[name], specs, strict=True))


class DeepseekV4StepMetadataBuilder:
    """Builds every KV-cache group's metadata of a DeepSeek-V4 step: on the GPU
    one kernel launch per ``build`` (``kernels/step.cuh``), on the CPU the single
    ops in turn. Each output equals the composition of the single ops.

    ``build`` takes each group's ``CommonAttentionMetadata`` as vLLM hands it
    to that group's builder, by group name: ``{"swa": ..., "c4a": ...,
    "indexer": ..., "c128a": ...}``. They share the query layout
    (``query_start_loc``, ``seq_lens``, ``positions``, counts); each has its
    own ``block_table_tensor`` and ``slot_mapping`` (read for the SWA and
    C128A groups; the C4A and indexer compressed slot mappings come from
    their block tables, as vLLM's builders do). A step with prefills
    needs ``seq_lens_cpu`` (host; vLLM 0.34's ``seq_lens_cpu_upper_bound``
    is taken in its place) on the C128A group's metadata: the chunk
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
    num_speculative_tokens, decode_threshold, treat_short_extends_as_decodes, width_policy, padding_rows
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
        ``40 * max_model_len // 4``, vLLM's workspace).
    indexer_decode_layout : "flat" or "native"
        The indexer's decode metadata per token (``build_indexer_decode_metadata``:
        sm_100's layout, sm_90's flattening) or vLLM's native ``[B, next_n]``
        (``build_indexer_native_decode_metadata``, sm_90's default for the
        depths DeepGEMM has: 1, 2, 4); the one the consumer takes.
    like, device
        As for ``DeepseekV4MetadataBuilder``.
    validate : "default" or "full"
        "default" checks what the host knows (kinds, dtypes, shapes, counts,
        every group's arrays) and never reads device memory: data out of
        range is contained, not reported (a ``seq_len`` past ``max_model_len``
        gets C128A rows cut at what the width and block table cover). "full"
        makes every build also check the step's data (a sync on GPU): each
        group's query layout and tables, ``seq_lens <= max_model_len``,
        ``query_start_loc_cpu``, ``max_query_len`` and ``max_seq_len`` against
        the arrays, the
        same positions and padding tokens (slot -1) in every group, and, with
        ``num_cache_blocks``, block ids inside the cache. For debugging.
    num_cache_blocks : int, optional
        Blocks of each group's cache (read by full validation only).
    c128a_group : DeepseekV4MetadataBuilder, optional
        A C128A group's builder whose buffers the step's C128A rows are written
        into (one set of buffers for both: a caller that also builds that group
        alone). Its own settings (block size, width policy, padding rows,
        decode threshold, validation, kind and device) then apply to the C128A
        rows, and the step's arguments for them are not read.
    """

    def __init__(self, max_model_len: int, max_num_batched_tokens: int, *,
                 block_size: int = KV_BLOCK_SIZE, swa_block_size: int = SWA_BLOCK_SIZE,
                 window_size: int = SWA_WINDOW_SIZE, index_topk: int = INDEX_TOPKS[0],
                 num_speculative_tokens: int = 0, treat_short_extends_as_decodes: bool = True,
                 width_policy: str = "active", combined_prefill: bool = False,
                 prefill_chunk_size: int = PREFILL_CHUNK_SIZE,
                 max_num_compressed: int | None = None, like="numpy", device: int | None = None,
                 validate: str = "default", num_cache_blocks: int | None = None,
                 decode_threshold: int | None = None, indexer_decode_layout: str = "flat",
                 padding_rows: str = "minus_one", c128a_group=None):
        group = self.c128a_group = shared_c128a_group(
            c128a_group, max_model_len, max_num_batched_tokens) if c128a_group is not None \
            else KVCacheGroup(
            C128A_RATIO, max_model_len, max_num_batched_tokens, block_size=block_size,
            index_topk=index_topk, num_speculative_tokens=num_speculative_tokens,
            treat_short_extends_as_decodes=treat_short_extends_as_decodes,
            width_policy=width_policy, like=like, device=device, validate=validate,
            num_cache_blocks=num_cache_blocks, decode_threshold=decode_threshold,
            padding_rows=padding_rows)
        self.kind, self.device = group.kind, group.device
        self.max_model_len = group.max_model_len
        self.max_num_batched_tokens = group.max_num_batched_tokens
        self.swa_block_size = check_int("swa_block_size", swa_block_size, minimum=1,
                                        maximum=MAX_BLOCK_SIZE)
        self.window_size = checks.check_row_width("window_size", window_size, minimum=1)
        self.index_topk = group.topk_tokens
        self.c4a_block_size = check_int("block_size", block_size, minimum=C4A_RATIO) // C4A_RATIO
        self.combined_prefill = bool(combined_prefill)
        self.prefill_chunk_size = check_int("prefill_chunk_size", prefill_chunk_size, minimum=1)
        self.max_num_compressed = check_int(
            "max_num_compressed", 40 * self.max_model_len // C4A_RATIO
            if max_num_compressed is None else max_num_compressed, minimum=1)
        self.max_blocks = cdiv(self.max_model_len, group.block_size)
        self._chunk_budgets = (chunk_budgets(self.prefill_chunk_size, self.window_size,
                                             self.max_model_len, self.max_num_batched_tokens)
                               if self.combined_prefill else None)
        n, W = self.max_num_batched_tokens, self.window_size

        specs = {"is_valid_token_buffer": ((n,), BOOL, 0),
                 "swa_indices_buffer": ((n, 1, W), INT32, -1),
                 "swa_lens_buffer": ((n,), INT32, 0),
                 "prefill_gather_lens_buffer": ((n,), INT32, 0),
                 "c4a_slot_mapping_buffer": ((n,), INT64, -1),
                 "indexer_slot_mapping_buffer": ((n,), INT64, -1),
                 "short_context_buffer": ((n, self.index_topk), INT32, -1),
                 **_fields("indexer_decode_buffers", ((n,), INT32, 0), ((n,), INT32, 0),
                           ((n,), INT32, 0), ((n, self.max_blocks), INT32, 0), ((n,), INT32, 0)),
                 **_fields("indexer_prefill_buffers", ((n + 1,), INT32, 0),
                           ((self.max_num_compressed,), INT32, -1), ((n,), INT32, 0),
                           ((n,), INT32, 0))}
        if self.combined_prefill:
            specs.update(_fields("c128a_combined_buffers",
                                 ((n, combined_width(group.capacity, W)), INT32, -1),
                                 ((n,), INT32, 0)),
                         **_fields("swa_combined_buffers", ((n, combined_width(0, W)), INT32, -1),
                                   ((n,), INT32, 0)))
        made = group.new_buffers(specs)
        for name in specs.keys() - _TUPLE_FIELDS:
            setattr(self, name, made[name])
        for name, fields in BUFFER_TUPLES.items():
            setattr(self, name, tuple(made[field] for field in fields) if fields[0] in made
                    else None)
        self._indexer_decode = IndexerDecode(
            indexer_decode_layout,
            1 + check_int("num_speculative_tokens", num_speculative_tokens, minimum=0),
            self.indexer_decode_buffers, n)
        self.indexer_decode_layout = self._indexer_decode.layout
        buffers = self.buffers()
        self._owned = checks.OwnedBuffers([probe(f"the builder's {name}", x)
                                           for name, x in buffers.items()])
        # Each buffer probed once, as the launches name it (the SWA rows without the head axis).
        self._ops = {id(x): probe(name, x[:, 0] if x is self.swa_indices_buffer else x)
                     for name, x in buffers.items() if not name.startswith("c128a_group.")}
        self._c4a_geometry = SlotGeometry(block_size=self.c4a_block_size, ratio=C4A_RATIO,
                                          cp_world_size=1, cp_rank=0, cp_interleave=1)
        # Steps whose checks are reused (GPU, default validation): see build().
        self._prepared = (PreparedCalls() if self.kind in GPU_KINDS
                          and not group.full_validation else None)
        self._captured = None
        self._views = keys.ViewCache(MAX_CACHED_VIEWS)
        # Steps that took the full path, by _layout_key(cms) (GPU): StepLayout.
        self._layouts = PreparedCalls() if self._prepared is not None else None
        self._host_seq_lens = PreparedCalls(MAX_HOST_VIEWS)

    def buffers(self) -> dict:
        """Every persistent buffer the builds write, by name (the C128A group's too)."""
        out = {"is_valid_token_buffer": self.is_valid_token_buffer,
               "swa_indices_buffer": self.swa_indices_buffer,
               "swa_lens_buffer": self.swa_lens_buffer,
               "prefill_gather_lens_buffer": self.prefill_gather_lens_buffer,
               "c4a_slot_mapping_buffer": self.c4a_slot_mapping_buffer,
               "indexer_slot_mapping_buffer": self.indexer_slot_mapping_buffer,
               "short_context_buffer": self.short_context_buffer}
        for name, fields in BUFFER_TUPLES.items():
            arrays = getattr(self, name)
            if arrays is not None:
                out.update(zip(fields, arrays))
        for name, x in self.c128a_group.buffers().items():
            out[f"c128a_group.{name}"] = x
        return out

    def _op(self, buffer) -> Operand:
        """A persistent buffer of this builder, as probed once."""
        return self._ops[id(buffer)]

    # --- the public build --------------------------------------------------------------------
    def build(self, common_prefix_len: int, common_attn_metadata: dict,
              fast_build: bool = False, *, capturing: bool = False) -> DeepseekV4StepMetadata:
        """Build the step's metadata of every group (``common_prefix_len`` and
        ``fast_build`` are accepted for vLLM compatibility, unused).

        ``capturing=True`` says the build is being recorded into a CUDA graph:
        the C128A width is the capacity and the short-context shortcut is not
        taken (vLLM #52492); use ``build_for_cudagraph_capture``. On the GPU,
        a decode step whose arrays have the layouts of an earlier one reuses
        its checks and prepared launch, and returns a shallow copy of that
        step's ``DeepseekV4StepMetadata`` (an object returned earlier is never
        changed); a step with prefills reuses the
        checks, and the launch of an earlier step that made the same host
        decisions but its chunks' sizes and the indexer's rows (written in).
        Any kind: the split of a step with prefills is kept by
        ``query_start_loc_cpu``'s contents, and the checked view of
        ``seq_lens_cpu`` by its address (the last ``MAX_HOST_VIEWS`` arrays
        are held, so an address seen again is the same memory).
        """
        capturing = bool(capturing)
        layout_key = key = None
        if self._prepared is not None and isinstance(common_attn_metadata, dict):
            layout_key = self._layout_key(common_attn_metadata)
            key = (self._launch_key(common_attn_metadata["c128a"], layout_key, capturing)
                   if layout_key is not None else None)
            prepared = self._prepared.get(key) if key is not None else None
            if prepared is not None:
                call, kept = prepared
                if call.run():
                    cm = common_attn_metadata["c128a"]     # host ints outside the key
                    metadata = copied_step(kept)
                    metadata.max_query_len, metadata.max_seq_len = cm.max_query_len, cm.max_seq_len
                    self.c128a_group.refresh(metadata.c128a, cm)
                    return metadata
        return self._build_checked(common_attn_metadata, capturing, layout_key, key)

    def build_for_cudagraph_capture(self, common_attn_metadata: dict) -> DeepseekV4StepMetadata:
        """``build`` for recording inside the caller's CUDA graph (torch's or
        CuPy's stream capture): a uniform decode step (prefills cannot be
        captured), the C128A width at its capacity and no short-context rows.
        The kernel reads every value that varies between steps of one captured
        shape from device memory on replay; the shape is fixed by
        ``num_reqs``, ``num_actual_tokens`` and the buffers' addresses.
        ``check_replay`` says whether a step fits the capture."""
        cm = check_group_metadata(common_attn_metadata)["c128a"]
        self.c128a_group.check_capturable(cm)
        layout_key = self._layout_key(common_attn_metadata)   # before anything is recorded
        key = None if layout_key is None else self._launch_key(cm, layout_key, True)
        if key is None:
            raise ValueError("common_attn_metadata: a captured build needs device arrays, every "
                             "group holding the C128A group's query_start_loc and seq_lens "
                             "objects, and max_query_len, max_seq_len ints >= 0 (check_replay "
                             "compares the arrays by their attributes)")
        metadata = self._build_checked(common_attn_metadata, True, layout_key, key)
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
        cms = check_group_metadata(common_attn_metadata)
        key, num_reqs, num_tokens = captured
        self.c128a_group.check_captured_shape(cms["c128a"], num_reqs, num_tokens)
        if self._step_key(cms, True) != key:
            raise ValueError("common_attn_metadata: expected the arrays the graph was captured "
                             "with (same addresses, shapes, strides and dtypes); refresh them "
                             "in place")

    # --- checks ------------------------------------------------------------------------------
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
        return self.c128a_group.step_key(cm, swa.block_table_tensor, swa.slot_mapping,
                                         c4a.block_table_tensor, indexer.block_table_tensor)

    def _launch_key(self, cm, layout, capturing: bool):
        """The prepared launch's key of a step whose checks are under ``layout``:
        a uniform decode step only (None for one with prefills)."""
        if layout is None or not self.c128a_group.uniform_decode(cm):
            return None
        return (layout, self.c128a_group.width(cm.max_seq_len, capturing),
                self._short_context(cm, capturing), capturing,
                cm.max_query_len if self.indexer_decode_layout == "native" else None)

    def _step_key(self, cms: dict, capturing: bool):
        """``_launch_key`` of a step, from its groups' metadata."""
        layout = self._layout_key(cms)
        return None if layout is None else self._launch_key(cms["c128a"], layout, capturing)

    def _short_context(self, cm, capturing: bool) -> bool:
        return not capturing and cm.num_actual_tokens > 0 and \
            cm.max_seq_len // C4A_RATIO <= self.index_topk

    # --- the build ---------------------------------------------------------------------------
    def _layout(self, cms: dict, layout_key) -> StepLayout:
        """The checks of the step's arrays: those of the last step with the same
        layouts when there was one (GPU), else the full checks."""
        layout = self._layouts.get(layout_key) if layout_key is not None else None
        if layout is None:
            arrays = self.c128a_group.check_step(cms["c128a"])
            tables, swa_slots = check_groups(cms, arrays, self.kind, self.device,
                                             self.swa_lens_buffer, self.max_blocks)
            self._owned.check_inputs([*arrays.ops.values(), *tables.values(), swa_slots])
            layout = StepLayout(arrays, tables, swa_slots, SectionCache(),
                                PreparedCalls(MAX_LAYOUT_STEPS), PreparedCalls(MAX_LAYOUT_STEPS))
            if layout_key is not None:
                self._layouts.put(layout_key, layout)
        return layout

    def _plan(self, cms: dict, layout: StepLayout, capturing: bool) -> StepPlan:
        """The step's host decisions: split, width, chunk plans, rows."""
        group, cm = self.c128a_group, cms["c128a"]
        host_qsl = layout.arrays.host_query_start_loc
        split = group.split(cm, host_qsl, group.prefilling(cm))
        if group.full_validation:
            group.check_step_data(cm, layout.arrays, split)
            check_group_data(cms, self.kind, c4a_block_size=self.c4a_block_size,
                             swa_block_size=self.swa_block_size,
                             num_cache_blocks=group.num_cache_blocks)
        if layout.tables["indexer"].shape[0] < split.num_decodes:
            raise ValueError(f"common_attn_metadata['indexer'].block_table_tensor: expected a "
                             f"row for each of the {split.num_decodes} decode requests, got "
                             f"{layout.tables['indexer'].shape[0]} rows")
        chunks, compressed = prefill_plans(
            cm, host_qsl, split, max_num_compressed=self.max_num_compressed,
            window_size=self.window_size, budgets=self._chunk_budgets, kept=self._host_seq_lens)
        nd, np_tokens = split.num_decode_tokens, split.num_prefill_tokens
        return StepPlan(
            cms=cms, arrays=layout.arrays, tables=layout.tables,
            swa_slot_mapping=layout.swa_slot_mapping, split=split,
            width=group.width(cm.max_seq_len, capturing) if nd + np_tokens else 0,
            # The combined rows replace the C128A local prefill rows: those are not written.
            c128a_tokens=nd if self.combined_prefill else nd + np_tokens,
            valid_tokens=group.valid_tokens(cm, host_qsl), compressed=compressed, chunks=chunks,
            short_context=self._short_context(cm, capturing),
            native_decode_shape=self._indexer_decode.native_shape(split, cm.max_query_len,
                                                                  host_qsl))

    def _build_checked(self, common_attn_metadata, capturing: bool, layout_key=None,
                       key=None) -> DeepseekV4StepMetadata:
        """A build that is not a prepared call's: ``layout_key`` and ``key`` are
        the step's ``_layout_key`` and ``_launch_key`` when the caller has them
        (GPU; None: none, or no reuse). A layout key is made only of the
        groups' metadata that ``check_group_metadata`` accepts."""
        cms = (common_attn_metadata if layout_key is not None
               else check_group_metadata(common_attn_metadata))
        layout = self._layout(cms, layout_key)
        plan = self._plan(cms, layout, capturing)
        metadata = self._metadata(plan, None if layout_key is None else layout.results)
        if self.kind not in GPU_KINDS:
            for launch in self._launches(plan, None):
                launch.run_cpu()
            return metadata
        if key is None and layout_key is not None:
            call = self._prepared_step(plan, layout).call
        else:
            launches = self._launches(plan, None if layout_key is None else layout.sections)
            call = PreparedCall(tuple(launch.prepare(self.device) for launch in launches
                                      if launch.blocks), self.kind, self.device, metadata,
                                owned=metadata.arrays() if key is not None else ())
        if not call.run():
            raise RuntimeError("DeepseekV4StepMetadataBuilder.build: the device changed "
                               "during the build")
        if key is not None:
            self._prepared.put(key, (call, metadata))
        return metadata

    def _prepared_step(self, plan: StepPlan, layout: StepLayout) -> PreparedStep:
        """The prepared launches of a step not kept whole (one with prefills)
        under a known layout: those of an earlier step with the same host
        decisions but its chunks' N and M and the indexer's compressed rows,
        with this step's written in (``PreparedStep.patch``); else described
        from the layout's sections and prepared."""
        chunks = plan.chunks
        key = (plan.split, plan.width, plan.c128a_tokens, plan.valid_tokens, plan.short_context,
               plan.native_decode_shape, None if chunks is None else chunks.bounds)
        step = layout.steps.get(key)
        if step is None:
            step = PreparedStep(self._launches(plan, layout.sections), self.kind, self.device,
                                chunks)
            layout.steps.put(key, step)
        elif plan.split.num_prefills:
            step.patch(plan.compressed, chunks)
        return step

    def _launches(self, plan: StepPlan, cache: SectionCache | None) -> list:
        """The step kernel with every section this step needs (a prefill plan
        longer than ``geometry.MAX_PLAN_CHUNKS`` chunks adds launches of its
        combine). ``cache``: the layout's sections (GPU; None: described here)."""
        group, split = self.c128a_group, plan.split

        def described(key: tuple, describe) -> dict:
            return describe() if cache is None else cache.get(key, describe)

        sections = dict(described(("layout",), lambda: self._layout_sections(plan)))
        if not plan.short_context:
            sections.pop("short_context", None)
        width, c128a_tokens, valid_tokens = plan.width, plan.c128a_tokens, plan.valid_tokens
        sections.update(described(
            ("c128a", split, width, c128a_tokens, valid_tokens),
            lambda: group.split_sections(plan.arrays, split, width, c128a_tokens, valid_tokens)))
        sections.update(described(("indexer_decode", split, plan.native_decode_shape),
                                  lambda: dict([self._indexer_decode.section(plan, self._op)])))
        extra = []
        if split.num_prefills:
            sections.update(described(("gather", split), lambda: self._gather_section(plan)))
            compressed = plan.compressed
            section = self._indexer_prefill_section
            sections["indexer_prefill"] = (
                section(plan, compressed) if cache is None else
                cache.get(("indexer_prefill", split), lambda: section(plan, compressed),
                          num_compressed=compressed))
            if plan.chunks is not None:
                for name, chunks, topk in (("c128a_combine", plan.chunks.c128a, width),
                                           ("swa_combine", plan.chunks.swa, 0)):
                    sections[name], *more = self._combine(plan, name, chunks, topk, cache)
                    extra += [(name, piece) for piece in more]
        variant = group.step_variant(plan.arrays)
        return [step_launch(variant, sections, plan.swa_slot_mapping,
                            checks.rows_of(self._op(self.is_valid_token_buffer), 0,
                                           plan.num_tokens),
                            self.device),
                *(step_launch(variant, {name: piece}) for name, piece in extra)]

    def _layout_sections(self, plan: StepPlan) -> dict:
        """The sections that depend on the step's arrays and counts alone."""
        cm, ops, op = plan.cms["c128a"], plan.arrays.ops, self._op
        qsl, seq, T = ops["query_start_loc"], ops["seq_lens"], plan.num_tokens
        device = self.device if self.kind in GPU_KINDS else -1
        sections = self.c128a_group.layout_sections(plan.arrays)
        sections["swa"] = swa_launch(
            QueryLayout(qsl, seq, cm.num_reqs), plan.tables["swa"],
            self.c128a_group.buffer_operand("req_id_per_token_buffer"),
            op(self.is_valid_token_buffer), op(self.swa_indices_buffer), op(self.swa_lens_buffer),
            self.window_size, self.swa_block_size, 0, T, T, device, lanes=WARP_LANES)
        for name, buffer in (("c4a", self.c4a_slot_mapping_buffer),
                             ("indexer", self.indexer_slot_mapping_buffer)):
            sections[f"{name}_slots"] = slot_mapping_launch(qsl, seq, plan.tables[name],
                                                            self._c4a_geometry, op(buffer), T)
        if T:
            sections["short_context"] = short_context_launch(
                ops["positions"], op(self.short_context_buffer), self.index_topk, C4A_RATIO, T,
                device, lanes=WARP_LANES)
        return sections

    def _gather_section(self, plan: StepPlan) -> dict:
        """The prefill requests' gather lengths."""
        ops, split = plan.arrays.ops, plan.split
        return {"gather": gather_lens_launch(
            QueryLayout(ops["query_start_loc"], ops["seq_lens"], plan.cms["c128a"].num_reqs),
            self._op(self.prefill_gather_lens_buffer), split.num_decodes, split.num_prefills,
            self.window_size)}

    def _indexer_prefill_section(self, plan: StepPlan, compressed: int) -> Launch:
        """The indexer's chunk metadata over the prefill requests."""
        ops, split = plan.arrays.ops, plan.split
        start, end = split.num_decodes, split.num_decodes + split.num_prefills
        return indexer_prefill_launch(
            QueryLayout(checks.rows_of(ops["query_start_loc"], start, end + 1),
                        checks.rows_of(ops["seq_lens"], start, end), split.num_prefills),
            *map(self._op, self.indexer_prefill_buffers), compressed, C4A_RATIO, 0,
            split.num_prefill_tokens)

    def _combine(self, plan: StepPlan, name: str, chunks: tuple, topk: int,
                 cache: SectionCache | None) -> list:
        """A combine section's launches over its chunk plan (``prefill_combine_launches``)."""
        ops = plan.arrays.ops
        buffers, ratio = ((self.c128a_combined_buffers, C128A_RATIO) if name == "c128a_combine"
                          else (self.swa_combined_buffers, 0))
        return prefill_combine_launches(
            ops["query_start_loc"], ops["seq_lens"], plan.split.num_decodes, chunks,
            *map(self._op, buffers), self.window_size, ratio, topk,
            self.device if self.kind in GPU_KINDS else -1,
            kept=None if cache is None else cache.get)

    def _metadata(self, plan: StepPlan, results: PreparedCalls | None = None
                  ) -> DeepseekV4StepMetadata:
        """The step's metadata. ``results``: the layout's (GPU), by the host
        decisions their views depend on: a step copies the one made for its
        decisions (none of whose views was changed in place since) and sets
        its own values (``_step_values``)."""
        if results is None:
            out = self._views_of(plan)
        else:
            key = (plan.split, plan.width, plan.short_context, plan.native_decode_shape)
            entry = results.get(key)
            if entry is None or not keys.unchanged(entry[1]):
                made = self._views_of(plan)
                entry = (made, keys.watch(owned=made.arrays()))
                results.put(key, entry)
            out = copied_step(entry[0])
        self._step_values(plan, out)
        return out

    def _step_values(self, plan: StepPlan, out: DeepseekV4StepMetadata) -> None:
        """What a step's metadata holds beyond its views of ``_views_of``'s
        decisions: the caller's maxima and arrays, the indexer's compressed
        rows, the chunk plans."""
        cm = plan.cms["c128a"]
        out.max_query_len, out.max_seq_len = cm.max_query_len, cm.max_seq_len
        self.c128a_group.refresh(out.c128a, cm)
        if plan.split.num_prefills:
            out.indexer_token_to_seq = self._views.get(self.indexer_prefill_buffers[1], 0,
                                                       plan.compressed)
            if plan.chunks is not None:
                out.c128a_prefill_chunks = [chunk[:4] for chunk in plan.chunks.c128a]
                out.swa_prefill_chunks = [chunk[:4] for chunk in plan.chunks.swa]

    def _views_of(self, plan: StepPlan) -> DeepseekV4StepMetadata:
        """The step's metadata but ``_step_values``: views of the buffers for its
        split, width, short-context and native decode shape."""
        cm, split = plan.cms["c128a"], plan.split
        num_decodes, num_prefills, nd, np_tokens = split
        T, view = plan.num_tokens, self._views.get
        c128a = self.c128a_group.metadata(cm, split, self.c128a_group.result_views(
            T, split, plan.width))
        if self.combined_prefill:
            c128a.c128a_prefill_topk_indices = None
        swa_rows, swa_lens = self.swa_indices_buffer, self.swa_lens_buffer
        cu, _, ks, ke = self.indexer_prefill_buffers
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
        self._indexer_decode.views(plan, view, out)
        if np_tokens:
            out.swa_prefill_indices = view(swa_rows, nd, nd + np_tokens)
            out.swa_prefill_lens = view(swa_lens, nd, nd + np_tokens)
        if num_prefills:
            out.prefill_gather_lens = view(self.prefill_gather_lens_buffer, 0, num_prefills)
            out.indexer_cu_compressed = view(cu, 0, num_prefills + 1)
            out.indexer_cu_seqlen_ks = view(ks, 0, np_tokens)
            out.indexer_cu_seqlen_ke = view(ke, 0, np_tokens)
            if plan.chunks is not None:
                rows, lens = self.c128a_combined_buffers
                out.c128a_combined_indices = view(
                    rows, 0, np_tokens, combined_width(plan.width, self.window_size))
                out.c128a_combined_lens = view(lens, 0, np_tokens)
                rows, lens = self.swa_combined_buffers
                out.swa_combined_indices = view(rows, 0, np_tokens,
                                                combined_width(0, self.window_size))
                out.swa_combined_lens = view(lens, 0, np_tokens)
        if plan.short_context:
            out.c4a_short_context_topk_indices = view(self.short_context_buffer, 0, T)
        return out


__all__ = ["DeepseekV4StepMetadataBuilder", "DeepseekV4StepMetadata", "GROUPS"]
