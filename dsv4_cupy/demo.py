"""``python -m dsv4_cupy demo``: one realistic DeepSeek-V4 step, built end to end.

DeepSeek-V4-Flash at max_model_len 1M: 64 decode requests with one MTP draft
token (query length 2) and contexts up to 1M, then two 2048-token prefills
behind 32K-token prefixes. ``DeepseekV4StepMetadataBuilder`` builds every
KV-cache group's metadata (SWA, C4A, indexer, C128A) in one call: one kernel
launch on the GPU when there is one (torch arrays if torch is installed, else
cupy), else the numba CPU path. The kernels are warmed up first, as a server
would before taking requests.
"""
from __future__ import annotations

import time

import numpy as np

from .metadata import CommonAttentionMetadata
from .spec import KV_BLOCK_SIZE, SWA_BLOCK_SIZE, cdiv
from .step_builder import DeepseekV4StepMetadataBuilder
from .warmup import warmup

DECODES, DECODE_LEN = 64, 2                  # one MTP draft token each
PREFILLS, PREFILL_LEN, PREFILL_PREFIX = 2, 2048, 32768
#: The shortest max_model_len the demo's step fits in (its prefills reach this far).
MIN_MODEL_LEN = PREFILL_PREFIX + PREFILL_LEN
MAX_NUM_BATCHED_TOKENS = 8192
STEPS = 10


def realistic_step(max_model_len: int, seed: int = 0) -> dict:
    """The step's host arrays: the query layout, positions, and a block table and
    slot mapping of random physical blocks per KV-cache group."""
    rng = np.random.default_rng(seed)
    query_lens = [DECODE_LEN] * DECODES + [PREFILL_LEN] * PREFILLS
    prefixes = ([int(x) for x in rng.integers(1000, max_model_len - DECODE_LEN, DECODES)]
                + [PREFILL_PREFIX] * PREFILLS)
    seq = np.array(prefixes, np.int64) + query_lens
    qsl = np.zeros(len(query_lens) + 1, np.int32)
    qsl[1:] = np.cumsum(query_lens)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq)])
    tables, slots = {}, {}
    for group, block in (("swa", SWA_BLOCK_SIZE), ("c4a", KV_BLOCK_SIZE),
                         ("indexer", KV_BLOCK_SIZE), ("c128a", KV_BLOCK_SIZE)):
        tables[group] = rng.integers(0, 200_000, (len(query_lens), cdiv(max_model_len, block)),
                                     dtype=np.int32)
        request = np.repeat(np.arange(len(query_lens)), query_lens)
        slots[group] = (tables[group][request, positions // block].astype(np.int64) * block
                        + positions % block)
    return dict(qsl=qsl, seq_lens=seq.astype(np.int32), positions=positions.astype(np.int64),
                tables=tables, slots=slots, max_query_len=max(query_lens),
                max_seq_len=int(seq.max()))


def _pick_backend(device: str):
    """``(kind, host array -> device array)`` for the ``--device`` choice."""
    if device == "cpu":
        return "numpy", lambda x: x
    from .device import has_gpu
    if not has_gpu():
        if device == "gpu":
            from .device import require_gpu
            require_gpu()                    # raises NoGPUError, saying why
        print("no usable GPU: the numba CPU path")
        return "numpy", lambda x: x
    try:
        import torch
        if torch.cuda.is_available():
            return "torch", lambda x: torch.from_numpy(x).cuda()
    except ImportError:
        pass
    import cupy
    return "cupy", cupy.asarray


def step_metadata(step: dict, move) -> dict:
    """Each group's ``CommonAttentionMetadata``: the shared query layout, its own
    block table and slot mapping."""
    shared = dict(query_start_loc=move(step["qsl"]), query_start_loc_cpu=step["qsl"],
                  seq_lens=move(step["seq_lens"]), positions=move(step["positions"]),
                  seq_lens_cpu=step["seq_lens"], num_reqs=len(step["qsl"]) - 1,
                  num_actual_tokens=int(step["positions"].shape[0]),
                  max_query_len=step["max_query_len"], max_seq_len=step["max_seq_len"])
    return {group: CommonAttentionMetadata(block_table_tensor=move(step["tables"][group]),
                                           slot_mapping=move(step["slots"][group]), **shared)
            for group in ("swa", "c4a", "indexer", "c128a")}


def main(device: str = "auto", max_model_len: int = 1 << 20) -> int:
    if max_model_len < MIN_MODEL_LEN:
        raise ValueError(f"max_model_len: expected at least {MIN_MODEL_LEN}, got {max_model_len}")
    like, move = _pick_backend(device)
    cms = step_metadata(realistic_step(max_model_len), move)
    cm = cms["c128a"]
    print(f"DeepSeek-V4 step: {cm.num_reqs} requests, {cm.num_actual_tokens} tokens, "
          f"max_model_len {max_model_len}, arrays: {like}")
    start = time.perf_counter()
    warmup(gpu=like != "numpy", cpu=like == "numpy")
    print(f"warmup: {time.perf_counter() - start:.1f} s (compiles once per machine, then "
          f"reads the disk caches)")
    builder = DeepseekV4StepMetadataBuilder(max_model_len, MAX_NUM_BATCHED_TOKENS,
                                            num_speculative_tokens=DECODE_LEN - 1,
                                            combined_prefill=True, like=like)
    start = time.perf_counter()
    md = builder.build(0, cms)
    _synchronize(like)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(STEPS):
        md = builder.build(0, cms)
    _synchronize(like)
    steady = (time.perf_counter() - start) / STEPS
    print(f"build: {first * 1e6:,.0f} us the first time (every check), then "
          f"{steady * 1e6:,.0f} us per step (mean of {STEPS}; "
          + ("a repeated step reuses the first one's checks and launch)" if like != "numpy"
             else "the CPU path computes every row on the host)"))
    print(f"split: {md.num_decodes} decodes ({md.num_decode_tokens} tokens), "
          f"{md.num_prefills} prefills ({md.num_prefill_tokens} tokens)")
    c128a = md.c128a
    lens = _host(c128a.c128a_decode_topk_lens)
    print(f"C128A: decode rows {tuple(c128a.c128a_global_decode_topk_indices.shape)}, "
          f"lengths {lens[:4].tolist()} ...; combined prefill rows "
          f"{tuple(md.c128a_combined_indices.shape)} over {len(md.c128a_prefill_chunks)} "
          f"chunk(s)")
    print(f"SWA: decode rows {tuple(md.swa_decode_indices.shape)}, lengths "
          f"{_host(md.swa_decode_lens)[:4].tolist()} ...; prefill gather lengths "
          f"{_host(md.prefill_gather_lens).tolist()}")
    slots = _host(md.c4a_slot_mapping)
    print(f"C4A: {int((slots >= 0).sum())} of {cm.num_actual_tokens} tokens close a "
          f"compressed row; indexer: {md.indexer_token_to_seq.shape[0]} compressed rows over "
          f"the prefills, decode block rows {tuple(md.indexer_block_rows.shape)}")
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
