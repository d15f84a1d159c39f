"""The vLLM plugin at work: vLLM 0.34's runner builds its DeepSeek-V4 C128A
metadata builder (AttentionGroup.create_metadata_builders) with the plugin
registered, and the builder is dsv4_cupy's; one step is built and printed.

Runs where vLLM 0.34 is installed, on CPU too (vLLM's CPU port: the library's
numba path); elsewhere it says so and exits. See tests/requirements-vllm.txt.
"""
from __future__ import annotations

import os
import tempfile

for name, value in {"VLLM_TARGET_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "",
                    "HF_HUB_OFFLINE": "1", "DSV4_CUPY_VLLM": "1"}.items():
    os.environ.setdefault(name, value)


def main():
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("vLLM is not installed; skipping this example")
        return
    import dataclasses

    import torch
    import transformers
    from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.models.deepseek_v4.attention import (DeepseekV4Attention,
                                                   _resolve_dsv4_kv_cache_dtype)
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4FlashMLABackend
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.utils import AttentionGroup

    import dsv4_cupy.vllm

    # vLLM's CPU platform would refuse or reshape a GPU model's config; keep it as given.
    CpuPlatform.check_and_update_config = classmethod(lambda cls, vllm_config: None)
    dsv4_cupy.vllm.register()                # what vLLM's plugin loader does in each process
    print("patched:", dsv4_cupy.vllm.patched())

    folder = tempfile.mkdtemp(prefix="dsv4cfg_")
    transformers.DeepseekV4Config(architectures=["DeepseekV4ForCausalLM"]).save_pretrained(folder)
    config = VllmConfig(
        model_config=ModelConfig(model=folder, skip_tokenizer_init=True, max_model_len=8192,
                                 dtype="bfloat16"),
        cache_config=CacheConfig(block_size=256, cache_dtype="fp8_ds_mla"),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=8,
                                         max_model_len=8192, is_encoder_decoder=False))
    cache_dtype, torch_dtype = _resolve_dsv4_kv_cache_dtype(True, "fp8_ds_mla",
                                                            config.cache_config)
    layer = dataclasses.make_dataclass("Layer", ["compress_ratio", "kv_cache_dtype",
                                                  "kv_cache_torch_dtype", "head_dim"])
    with set_current_vllm_config(config):
        spec = DeepseekV4Attention.get_kv_cache_spec(
            layer(128, cache_dtype, torch_dtype, config.model_config.hf_config.head_dim), config)
        group = AttentionGroup(DeepseekV4FlashMLABackend, ["model.layers.0.attn"], spec,
                               kv_cache_group_id=0)
        group.create_metadata_builders(config, torch.device("cpu"), kernel_block_size=256)
    builder = group.metadata_builders[0]
    print("the runner's builder:", type(builder).__module__, type(builder).__name__)

    # Two decodes and a 20-token prefill chunk.
    seq, query = [1024, 3000, 600], [1, 1, 20]
    qsl = torch.tensor([0, 1, 2, 22], dtype=torch.int32)
    table = torch.arange(3 * 32, dtype=torch.int32).reshape(3, 32)
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq, query)])
    slots = torch.cat([table[r, positions[qsl[r]:qsl[r + 1]] // 256] * 256
                       + positions[qsl[r]:qsl[r + 1]] % 256 for r in range(3)]).to(torch.int64)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq, dtype=torch.int32), num_reqs=3, num_actual_tokens=22,
        max_query_len=20, max_seq_len=3000, block_table_tensor=table, slot_mapping=slots,
        positions=positions, seq_lens_cpu_upper_bound=torch.tensor(seq, dtype=torch.int32))
    md = builder.build(0, cm)
    print(type(md).__name__)
    print("  c128a_global_decode_topk_indices", tuple(md.c128a_global_decode_topk_indices.shape),
          md.c128a_global_decode_topk_indices[:, 0, :8].tolist())
    print("  c128a_decode_topk_lens", md.c128a_decode_topk_lens.tolist())
    print("  c128a_prefill_topk_indices", tuple(md.c128a_prefill_topk_indices.shape))
    print("  compressed slots", [int(s) for s in md.slot_mapping if s >= 0])


if __name__ == "__main__":
    main()
