"""``DeepseekV4MetadataBuilder``: vLLM's per-group builder's per-step work, in one launch on GPU."""
from __future__ import annotations

import inspect

from .group import KVCacheGroup
from .kinds import GPU_KINDS
from .metadata import CommonAttentionMetadata, DeepseekV4Metadata, copied
from .prepared import PreparedCall, PreparedCalls
from .step_kernel import step_launch

#: The builder's arguments are its group's (help() and inspect show them).
_GROUP_SIGNATURE = inspect.signature(KVCacheGroup.__init__)


class DeepseekV4MetadataBuilder(KVCacheGroup):
    """Builds ``DeepseekV4Metadata`` for one KV-cache group (one compress ratio).

    Parameters
    ----------
    compress_ratio : int
        1 (SWA-only), 2 (C2A, DeepSeek-V4.1), 4 (C4A) or 128 (C128A): vLLM
        0.34's layer types (others are refused, as there).
    max_model_len, max_num_batched_tokens : int
        Size the persistent buffers, allocated once here so every step sees the
        same addresses and row strides (CUDA-graph safe).
    block_size : int
        Logical KV block size (256); the storage block is ``block_size // compress_ratio``.
    index_topk : int
        ``hf_config.index_topk`` (512 Flash, 1024 Pro), reported as ``topk_tokens``.
    num_speculative_tokens : int
        Decode threshold is ``1 + num_speculative_tokens`` (MTP/DSpark decodes).
    decode_threshold : int, optional
        The threshold itself, when it is not that: vLLM 0.34's
        ``max_decode_query_len`` adds the draft model's drafting slots
        (``1 + num_speculative_tokens + max_num_new_slots_for_drafting``).
    treat_short_extends_as_decodes : bool
        vLLM's split flag: when False, a request still prefilling its prompt
        (``CommonAttentionMetadata.is_prefilling``) is a prefill.
    width_policy : "active" or "capacity"
        C128A columns written per row: vLLM's live width (#52823, its
        default) ``c128a_active_width(max_seq_len, capacity)``, or the fixed
        capacity ``round_up(cdiv(max_model_len, 128), 128)`` of vLLM before it. The row
        stride is the capacity either way (a batch-dependent stride broke
        captured decode consumers, vLLM #52448).
    dcp_world_size, dcp_rank, cp_kv_cache_interleave_size : int
        Decode context parallelism (experimental): the compressed slot mapping
        and the C128A decode rows are this rank's (see
        ``build_c128a_topk_metadata``); tokens past ``query_start_loc_cpu[num_reqs]``
        are padding.
    padding_rows : "minus_one" or "slots"
        A padding decode token's C128A row: all -1 (the default), or vLLM
        0.34's slot ids at length 0, for byte-exact A/B runs against vLLM.
    like : "numpy", "cupy", "torch" or an array
        Kind of the persistent buffers; the step's arrays must be of that kind
        ("torch" is CUDA when available, else CPU; an array gives its own kind
        and device).
    device : int, optional
        CUDA device for GPU buffers (default: the current one).
    validate : "default" or "full"
        "default" checks what the host knows (kinds, dtypes, shapes, counts)
        and never reads device memory: data out of range is contained, not
        reported (a ``seq_len`` past ``max_model_len`` gets C128A rows cut at
        what the width and block table cover). "full" makes every build also
        check the step's data (a sync on GPU): query layout, ``seq_len >=
        query_len``, ``seq_len <= max_model_len``, ``query_start_loc_cpu``,
        ``max_query_len`` and ``max_seq_len`` against the arrays, decodes
        before prefills, request ids and block columns inside the table and, with
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

    def __init__(self, *args, **kwargs):
        try:
            _GROUP_SIGNATURE.bind(self, *args, **kwargs)
        except TypeError as error:      # else Python names KVCacheGroup.__init__
            raise TypeError(f"DeepseekV4MetadataBuilder: {error}") from None
        super().__init__(*args, **kwargs)
        self._capturing = False
        self._captured = None
        # Prepared steps (GPU, default validation): their keys, then one launch
        # per (split, width, valid tokens) seen with them; see build().
        self._prepared = (PreparedCalls() if self.kind in GPU_KINDS
                          and not self.full_validation else None)

    __init__.__signature__ = _GROUP_SIGNATURE

    def width(self, max_seq_len: int, capturing: bool = False) -> int:
        """C128A columns written this step (0 unless compress_ratio is 128)."""
        return super().width(max_seq_len, capturing or self._capturing)

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
        self._captured = (self.step_key(cm), cm.num_reqs, cm.num_actual_tokens)
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
        if self.step_key(cm) != key:
            raise ValueError("common_attn_metadata: expected the buffers the graph was captured "
                             "with (same addresses, shapes, strides and dtypes); refresh them "
                             "in place")

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> DeepseekV4Metadata:
        """Build one step's metadata (``common_prefix_len`` and ``fast_build`` are
        accepted for vLLM compatibility and, as in vLLM, unused).

        On GPU this is one kernel launch with no host sync and no allocation:
        the decode/prefill split comes from ``query_start_loc_cpu``. Returns
        views of the persistent buffers. A step whose arrays have the layouts
        (addresses, shapes, strides, dtypes) and counts of an earlier step
        reuses that step's checks and prepared launch, and returns a shallow
        copy of that step's ``DeepseekV4Metadata`` holding this step's arrays
        and maxima (an object returned earlier is never changed).
        """
        cm = common_attn_metadata
        if self._prepared is not None and type(cm) is CommonAttentionMetadata:
            metadata = self._build_prepared(cm)
            if metadata is not None:
                return metadata
        return self._build_checked(cm)

    def _build_prepared(self, cm: CommonAttentionMetadata):
        """The step from a prepared launch, or None (then the full path runs)."""
        max_query_len, max_seq_len = cm.max_query_len, cm.max_seq_len
        if type(max_query_len) is not int or type(max_seq_len) is not int \
                or max_query_len < 0 or max_seq_len < 0:
            return None
        prepared = self._prepared.get(self.step_key(cm))
        if prepared is None:
            return None
        host_qsl, prefilling, launches = prepared
        split = self.split(cm, host_qsl, prefilling)
        kept = launches.get((split, self.width(max_seq_len), self.valid_tokens(cm, host_qsl)))
        if kept is None or not kept[0].run():
            return None
        metadata = copied(kept[1])
        self.refresh(metadata, cm)
        return metadata

    def _build_checked(self, cm: CommonAttentionMetadata) -> DeepseekV4Metadata:
        step = self.check_step(cm)
        host_qsl, prefilling = step.host_query_start_loc, self.prefilling(cm)
        split = self.split(cm, host_qsl, prefilling)
        if self.full_validation:
            self.check_step_data(cm, step, split)
        # The C128A rows cover the split's tokens (none for a batch of padding only).
        c128a_tokens = (split.num_decode_tokens + split.num_prefill_tokens
                        if self.has_c128a_rows else 0)
        width = self.width(cm.max_seq_len) if c128a_tokens else 0
        valid_tokens = self.valid_tokens(cm, host_qsl)
        views = self.result_views(step.num_tokens, split, width)
        metadata = self.metadata(cm, split, views)
        launch = step_launch(self.step_variant(step),
                             self.sections(step, split, width, c128a_tokens, valid_tokens))
        if self.kind in GPU_KINDS:
            call = PreparedCall((launch.prepare(self.device),) if launch.blocks else (),
                                self.kind, self.device, views, owned=views)
            if not call.run():
                raise RuntimeError("DeepseekV4MetadataBuilder.build: the device changed during "
                                   "the build")
            key = self.step_key(cm) if self._prepared is not None else None
            if key is not None:
                prepared = self._prepared.get(key)
                if prepared is None:
                    prepared = (host_qsl, prefilling, {})
                    self._prepared.put(key, prepared)
                prepared[2][(split, width, valid_tokens)] = (call, metadata)
        else:
            launch.run_cpu()
        return metadata

