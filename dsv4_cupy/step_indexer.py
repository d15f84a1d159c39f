"""The step builder's indexer decode metadata, in either of vLLM's layouts:
per token (``build_indexer_decode_metadata``) or vLLM's native ``[B, next_n]``
(``build_indexer_native_decode_metadata``)."""
from __future__ import annotations

from . import checks
from .indexer_decode import indexer_decode_launch
from .indexer_native_decode import native_decode_launch
from .launch import Launch
from .params import QueryLayout
from .scalars import check_choice
from .spec import C4A_RATIO
from .step_plan import StepPlan

#: "flat": a row per decode token; "native": a row per decode request.
INDEXER_DECODE_LAYOUTS = ("flat", "native")


class IndexerDecode:
    """The layout, the persistent buffers (context lengths, request ids, decode
    lengths, block rows, per-request lengths) and, per step, the section and
    the views of the indexer's decode metadata."""

    def __init__(self, layout: str, next_n: int, buffers: tuple, capacity: int):
        self.layout = check_choice("indexer_decode_layout", layout, INDEXER_DECODE_LAYOUTS)
        self.next_n, self.buffers, self.capacity = next_n, buffers, capacity

    def native_shape(self, split, max_query_len: int, host_qsl) -> tuple[int, int] | None:
        """(rows, columns) of the native lengths: vLLM's ``[decode requests, the
        longest decode query]``, ``[decode tokens, 1]`` at next_n 1; None in
        the flat layout."""
        if self.layout != "native":
            return None
        if self.next_n == 1:
            return split.num_decode_tokens, 1
        if not split.num_prefills:              # decodes only: max_query_len is the longest
            columns = max(max_query_len, 1)
        else:
            decode_qsl = host_qsl[:split.num_decodes + 1]
            columns = max(int((decode_qsl[1:] - decode_qsl[:-1]).max(initial=1)), 1)
        if split.num_decodes * columns > self.capacity:
            raise ValueError(f"num_reqs: expected the native indexer decode lengths, "
                             f"{split.num_decodes} decode requests x {columns} positions, to fit "
                             f"max_num_batched_tokens = {self.capacity}")
        return split.num_decodes, columns

    def section(self, plan: StepPlan, op) -> tuple[str, Launch]:
        """The step kernel's section (name, launch); ``op`` probes a buffer."""
        ops, split = plan.arrays.ops, plan.split
        query = QueryLayout(ops["query_start_loc"], ops["seq_lens"], split.num_decodes)
        if self.layout == "native":
            rows, columns = plan.native_decode_shape
            context, _, decode_lens, _, _ = self.buffers
            return "indexer_native_decode", native_decode_launch(
                query, checks.as_rows(op(context), rows, columns), op(decode_lens), rows,
                columns, C4A_RATIO)
        return "indexer_decode", indexer_decode_launch(
            query, plan.tables["indexer"], *map(op, self.buffers), split.num_decode_tokens,
            C4A_RATIO)

    def views(self, plan: StepPlan, view, out) -> None:
        """The step's views on ``out`` (a ``DeepseekV4StepMetadata``); ``view`` is
        the builder's view cache."""
        split = plan.split
        nd, num_decodes = split.num_decode_tokens, split.num_decodes
        if not nd:
            return
        context, req_ids, decode_lens, block_rows, per_req = self.buffers
        if self.layout == "native":
            rows, columns = plan.native_decode_shape
            # The block rows are the indexer group's own table, its first decode rows.
            out.indexer_context_lens = view(context, 0, rows * columns, row_length=columns)
            out.indexer_decode_lens = out.indexer_per_req_decode_lens = view(decode_lens, 0,
                                                                             num_decodes)
            return
        out.indexer_context_lens, out.indexer_req_ids = view(context, 0, nd), view(req_ids, 0, nd)
        out.indexer_decode_lens = view(decode_lens, 0, nd)
        out.indexer_block_rows = view(block_rows, 0, nd, plan.tables["indexer"].shape[1])
        out.indexer_per_req_decode_lens = view(per_req, 0, num_decodes)
