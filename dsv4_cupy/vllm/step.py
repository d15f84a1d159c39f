"""The whole DeepSeek-V4 step in one launch inside vLLM (imported by ``register()``).

vLLM's model runner builds each KV-cache group's metadata in turn
(``build_attn_metadata``). Wrapped, it first runs one
``dsv4_cupy.DeepseekV4StepMetadataBuilder`` build for the step's C128A, C4A
and SWA groups, then lets vLLM's loop go on: those groups' builders
(the plugin's) return views of the step's buffers and launch nothing. The
indexer group and every other group build as before.

A step takes the per-group path instead when the one launch could change
what vLLM reads:

- a CUDA graph may replay it (a capture, or under FULL graphs a batch that
  one may replay: every batch where a group supports mixed graphs, else
  uniform decodes), since the captured kernels read the per-group buffers;
- it carries what the step builder does not build (non-causal drafts,
  image spans, SWA replay prefixes, model-specific kwargs, DCP, images'
  wider SWA rows), or a subset of the groups (a speculator's);
- a group kind appears in more than one KV-cache group;
- the step builder refuses its arrays (it raises before any write).
"""
from __future__ import annotations

import functools
import importlib
import inspect

from vllm.v1.attention.backend import AttentionCGSupport

import dsv4_cupy
from dsv4_cupy import spec
from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLAMetadata

from .builders import Dsv4CupyFlashMLAMetadataBuilder, Dsv4CupySWAMetadataBuilder, say_once
from .convert import flashmla_metadata

#: The runner modules that import ``build_attn_metadata`` by name.
RUNNER_MODULES = ("vllm.v1.worker.gpu.model_states.default",
                  "vllm.v1.worker.gpu.model_states.mamba_hybrid",
                  "vllm.v1.worker.gpu.model_states.encoder_decoder")
#: The step builder's groups, by the plugin builder that serves each.
STEP_GROUPS = ("c128a", "c4a", "swa")
#: The compressed groups among them, by their FlashMLA builder's compress ratio.
STEP_GROUP_OF_RATIO = {spec.C128A_RATIO: "c128a", spec.C4A_RATIO: "c4a"}


def step_groups(attn_groups, ubatch_idx: int) -> dict | None:
    """The step's C128A, C4A and SWA groups, ``{name: (kv_cache_group, builder)}``;
    None unless each is one plugin builder in one KV-cache group."""
    found: dict = {}
    for index, groups in enumerate(attn_groups):
        for attn_group in groups:
            builder = attn_group.get_metadata_builder(ubatch_idx)
            if attn_group.kernel_block_size is not None and isinstance(
                    builder, (Dsv4CupyFlashMLAMetadataBuilder, Dsv4CupySWAMetadataBuilder)):
                return None                      # its builder reads a mapped table
            if isinstance(builder, Dsv4CupyFlashMLAMetadataBuilder):
                if builder._library is None:
                    return None
                name = STEP_GROUP_OF_RATIO.get(builder.compress_ratio)
                if name is None:
                    return None                  # a ratio the step builder has no group for
            elif isinstance(builder, Dsv4CupySWAMetadataBuilder):
                name = "swa"
            else:
                continue
            if name in found:
                return None
            found[name] = (index, builder)
    return found if len(found) == len(STEP_GROUPS) else None


def full_graph_support(attn_groups, ubatch_idx: int, c128a) -> AttentionCGSupport | None:
    """The runner's CUDA-graph support (the least of every group's builder's)
    when FULL graphs are on, else None; found once per micro-batch."""
    if c128a._full_graph_support is None:
        config = c128a.vllm_config
        support = ()
        if config.compilation_config.cudagraph_mode.has_full_cudagraphs():
            builders = [g.get_metadata_builder(ubatch_idx) for groups in attn_groups
                        for g in groups]
            support = (min((type(b).get_cudagraph_support(config, b.kv_cache_spec)
                            for b in builders), key=lambda s: s.value),)
        c128a._full_graph_support = support
    return c128a._full_graph_support[0] if c128a._full_graph_support else None


def step_refusal(args: dict, groups: dict | None) -> str | None:
    """Why this call takes the per-group path, or None."""
    if groups is None:
        return "the groups are not one C128A, one C4A and one SWA group of the plugin"
    swa = groups["swa"][1]
    for name, refused in (("for_cudagraph_capture", args["for_cudagraph_capture"]),
                          ("non-causal", args["causal"] is not True),
                          ("mm_req_doc_ranges", bool(args["mm_req_doc_ranges"])),
                          ("rswa_prefix_lens", args["rswa_prefix_lens"] is not None),
                          ("model_specific_attn_metadata",
                           args["model_specific_attn_metadata"] is not None),
                          ("dcp_local_seq_lens", args["dcp_local_seq_lens"] is not None),
                          ("image tokens", swa.prefill_index_width != swa.window_size)):
        if refused:
            return name
    c128a = groups["c128a"][1]
    if swa.decode_threshold != c128a.reorder_batch_threshold:
        return "the SWA and C128A groups' decode thresholds differ"
    support = full_graph_support(args["attn_groups"], args["ubatch_idx"], c128a)
    if support is not None and (support == AttentionCGSupport.ALWAYS
                                or args["max_query_len"] <= c128a.reorder_batch_threshold):
        return "a FULL CUDA graph may replay the batch"
    return None


def step_builder(c128a: Dsv4CupyFlashMLAMetadataBuilder, swa: Dsv4CupySWAMetadataBuilder):
    """The step builder of this micro-batch's groups, made at its first step;
    its C128A rows are the C128A builder's own buffers (one set for both)."""
    if c128a._step_builder is None:
        library = c128a._library
        c128a._step_builder = dsv4_cupy.DeepseekV4StepMetadataBuilder(
            library.max_model_len, library.max_num_batched_tokens,
            block_size=int(c128a.kv_cache_spec.block_size), swa_block_size=swa.block_size,
            window_size=swa.window_size, index_topk=c128a.topk_tokens, c128a_group=library)
    return c128a._step_builder


def build_step(args: dict, groups: dict) -> None:
    """One launch for the step; each served builder is handed its views."""
    num_reqs = args["num_reqs"]
    seq_lens = args["seq_lens"][:num_reqs]
    upper = args["seq_lens_cpu_upper_bound"]

    def group_cm(index):
        return dsv4_cupy.CommonAttentionMetadata(
            query_start_loc=args["query_start_loc_gpu"],
            query_start_loc_cpu=args["query_start_loc_cpu"], seq_lens=seq_lens,
            block_table_tensor=args["block_tables"][index],
            slot_mapping=args["slot_mappings"][index], num_reqs=num_reqs,
            num_actual_tokens=args["num_tokens"], max_query_len=args["max_query_len"],
            max_seq_len=args["max_seq_len"], positions=args["positions"],
            is_prefilling=args["is_prefilling"],
            seq_lens_cpu_upper_bound=None if upper is None else upper[:num_reqs])

    cms = {name: group_cm(index) for name, (index, _) in groups.items()}
    cms["indexer"] = cms["c4a"]     # the indexer group builds on its own: its sections unread
    for name in ("c128a", "c4a"):                # vLLM's builders clamp before reading
        cms[name].block_table_tensor.clamp_(min=0)
    c128a, swa = groups["c128a"][1], groups["swa"][1]
    metadata = step_builder(c128a, swa).build(0, cms)
    c4a_metadata = flashmla_metadata(
        metadata.c128a, DeepseekV4FlashMLAMetadata, slot_mapping=metadata.c4a_slot_mapping,
        block_table=cms["c4a"].block_table_tensor,
        block_size=groups["c4a"][1]._library.block_size, c128a_global_decode_topk_indices=None,
        c128a_decode_topk_lens=None, c128a_prefill_topk_indices=None)
    for name, served in (("c128a", flashmla_metadata(metadata.c128a, DeepseekV4FlashMLAMetadata)),
                         ("c4a", c4a_metadata),
                         ("swa", metadata)):
        index, builder = groups[name]
        builder._step_views = (args["block_tables"][index], served)


def wrap(build_attn_metadata):
    """``build_attn_metadata`` that builds the step's groups in one launch when it can."""
    signature = inspect.signature(build_attn_metadata)

    @functools.wraps(build_attn_metadata)
    def build_attn_metadata_in_one_launch(*positional, **named):
        bound = signature.bind(*positional, **named)
        bound.apply_defaults()
        args = bound.arguments
        groups = step_groups(args["attn_groups"], args["ubatch_idx"])
        refusal = step_refusal(args, groups)
        if refusal is not None:
            if groups is not None:
                say_once(f"per-group builds for a step: {refusal}")
            return build_attn_metadata(*positional, **named)
        try:
            build_step(args, groups)
        except (TypeError, ValueError) as error:    # raised before any write
            say_once(f"per-group builds for a step the step builder refuses: {error}")
            return build_attn_metadata(*positional, **named)
        try:
            return build_attn_metadata(*positional, **named)
        finally:
            for _, builder in groups.values():
                builder._step_views = None

    build_attn_metadata_in_one_launch.wrapped_by_dsv4_cupy = True
    return build_attn_metadata_in_one_launch


def install() -> dict:
    """Wrap ``build_attn_metadata`` where the runners imported it; what was patched."""
    patched = {}
    for name in RUNNER_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        current = module.build_attn_metadata
        if not getattr(current, "wrapped_by_dsv4_cupy", False):
            module.build_attn_metadata = wrap(current)
        patched[f"{name}.build_attn_metadata"] = f"{__name__}.wrap(build_attn_metadata)"
    return patched
