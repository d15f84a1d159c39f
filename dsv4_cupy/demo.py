"""``python -m dsv4_cupy demo``: one realistic DeepSeek-V4 step, built end to end.

DeepSeek-V4-Flash at max_model_len 1M: 64 decode requests with one MTP draft
token (query length 2) and contexts up to 1M, then two 2048-token prefills
behind 32K-token prefixes. Builds the C128A group (ratio 128) and the C4A group
(ratio 4) on the GPU when there is one (torch if installed, else cupy), else on
the numba CPU path, and prints what came out.
"""
from __future__ import annotations

import time

import numpy as np

from .builder import DeepseekV4MetadataBuilder
from .metadata import CommonAttentionMetadata


def realistic_step(max_model_len: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    query_lens = [2] * 64 + [2048, 2048]
    prefixes = [int(x) for x in rng.integers(1000, max_model_len - 2, size=64)] + [32768, 32768]
    seq = np.array(prefixes, np.int64) + query_lens
    qsl = np.zeros(len(query_lens) + 1, np.int32)
    qsl[1:] = np.cumsum(query_lens)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq)])
    max_blocks = -(-max_model_len // 256)
    return dict(qsl=qsl, seq_lens=seq.astype(np.int32), positions=positions.astype(np.int64),
                block_table=rng.integers(0, 200_000, size=(len(query_lens), max_blocks),
                                         dtype=np.int32),
                slot_mapping=rng.integers(0, 1 << 30, size=positions.shape[0]).astype(np.int64),
                max_query_len=max(query_lens), max_seq_len=int(seq.max()))


def _pick_backend(device: str):
    if device == "cpu":
        return "numpy", None
    try:
        from .device import require_gpu
        require_gpu()
    except Exception as error:
        if device == "gpu":
            raise
        print(f"no GPU ({error}); using the numba CPU path")
        return "numpy", None
    try:
        import torch
        if torch.cuda.is_available():
            return "torch", lambda x: torch.from_numpy(x).cuda()
    except ImportError:
        pass
    import cupy
    return "cupy", cupy.asarray


def main(device: str = "auto", max_model_len: int = 1 << 20) -> int:
    like, move = _pick_backend(device)
    move = move or (lambda x: x)
    step = realistic_step(max_model_len)
    T = step["positions"].shape[0]
    cm = CommonAttentionMetadata(
        query_start_loc=move(step["qsl"]), query_start_loc_cpu=step["qsl"],
        seq_lens=move(step["seq_lens"]), block_table_tensor=move(step["block_table"]),
        slot_mapping=move(step["slot_mapping"]), positions=move(step["positions"]),
        num_reqs=len(step["qsl"]) - 1, num_actual_tokens=T,
        max_query_len=step["max_query_len"], max_seq_len=step["max_seq_len"])
    print(f"DeepSeek-V4 step: {cm.num_reqs} requests, {T} tokens, max_model_len {max_model_len}, "
          f"buffers: {like}")
    for ratio in (128, 4):
        builder = DeepseekV4MetadataBuilder(ratio, max_model_len, 8192, num_speculative_tokens=1,
                                            like=like)
        start = time.perf_counter()
        md = builder.build(0, cm)            # first build compiles (kernels or numba)
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(10):
            md = builder.build(0, cm)
        _synchronize(like)
        steady = (time.perf_counter() - start) / 10
        print(f"\nratio {ratio}: first build {first * 1e3:.1f} ms (compile + run), "
              f"then {steady * 1e6:.0f} us per build")
        print(f"  decodes {md.num_decodes} ({md.num_decode_tokens} tokens), prefills "
              f"{md.num_prefills} ({md.num_prefill_tokens} tokens)")
        slots = _host(md.slot_mapping)
        print(f"  compressed slot mapping: {int((slots >= 0).sum())} of {T} tokens close a group")
        if md.c128a_global_decode_topk_indices is not None:
            gd = _host(md.c128a_global_decode_topk_indices)
            lens = _host(md.c128a_decode_topk_lens)
            print(f"  c128a decode indices {tuple(gd.shape)}, lengths {lens[:4].tolist()} ..., "
                  f"row 0 starts {gd[0, 0, :4].tolist()}")
        if md.c128a_prefill_topk_indices is not None:
            pf = _host(md.c128a_prefill_topk_indices)
            print(f"  c128a prefill indices {tuple(pf.shape)}, last row visible "
                  f"{int((pf[-1] >= 0).sum())}")
    return 0


def _host(x):
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("cupy"):
        return x.get()
    return x.cpu().numpy()


def _synchronize(like: str) -> None:
    if like == "torch":
        import torch
        torch.cuda.synchronize()
    elif like == "cupy":
        import cupy
        cupy.cuda.Device().synchronize()
