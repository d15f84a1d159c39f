"""vLLM 0.34's DeepSeek-V4 per-layer metadata ops, by the library, under the
names and signatures vLLM's NVIDIA attention code calls them with."""
from __future__ import annotations

import vllm.models.deepseek_v4.attention as attention
import vllm.models.deepseek_v4.nvidia.flashmla as flashmla

import dsv4_cupy

_vllm_fill_short_context = attention.fill_short_context_topk_indices


class ShortContextFill:
    """``fill_short_context_topk_indices[grid](output, positions, TOP_K=,
    COMPRESS_RATIO=, PADDED_TOP_K=, num_warps=)``, vLLM's Triton kernel launch,
    by the library's op: row t of ``output`` (rows of ``TOP_K``) holds
    ``0 .. (positions[t] + 1) // COMPRESS_RATIO - 1``, then -1."""

    def __getitem__(self, grid):
        rows = grid[0] if isinstance(grid, tuple) else grid

        def launch(output, positions, TOP_K, COMPRESS_RATIO, PADDED_TOP_K=None, **launch_options):
            if output.dim() != 2 or output.shape[1] != TOP_K:    # not the layout it knows
                return _vllm_fill_short_context[grid](output, positions, TOP_K=TOP_K,
                                                      COMPRESS_RATIO=COMPRESS_RATIO,
                                                      PADDED_TOP_K=PADDED_TOP_K, **launch_options)
            return dsv4_cupy.fill_short_context_topk_indices(positions, TOP_K, COMPRESS_RATIO,
                                                             rows, out=output)
        return launch


def install() -> dict:
    """Patch the module globals vLLM's NVIDIA DeepSeek-V4 attention calls."""
    flashmla.compute_global_topk_indices_and_lens = dsv4_cupy.compute_global_topk_indices_and_lens
    flashmla.combine_topk_swa_indices = dsv4_cupy.combine_topk_swa_indices
    attention.fill_short_context_topk_indices = ShortContextFill()
    return {f"{flashmla.__name__}.compute_global_topk_indices_and_lens":
            "dsv4_cupy.compute_global_topk_indices_and_lens",
            f"{flashmla.__name__}.combine_topk_swa_indices": "dsv4_cupy.combine_topk_swa_indices",
            f"{attention.__name__}.fill_short_context_topk_indices":
            f"{__name__}.ShortContextFill()"}
