"""The SWA, C4A and C128A attention metadata of one DeepSeek-V4 step, handed to torch.

The step: three decode requests with one MTP draft token (query length 2),
then one 300-token prefill, then two CUDA-graph padding tokens; contexts stay
under 2K tokens so the C4A layers take the short-context shortcut (every
compressed row is a candidate, no indexer scoring). Built from NumPy arrays on
the CPU path, or from CuPy arrays on the GPU when there is one, and handed to
torch through dsv4_cupy.to_torch without copies.

Per step (once, for every layer of its type):
  SWA      sliding-window rows of the decode and prefill tokens, gather lengths
  C4A      indexer decode metadata, the prefill chunk plan and its indexer ranges
  C128A    top-k rows (decode: global slots; prefill: local rows)
Per layer (C4A layers take the shortcut rows; C128A and SWA-only rows are the
same for every layer of their type, so they are built once here):
  C4A      short-context rows -> global slots in place (decodes) and combined
           prefill rows (compressed top-k then the window): one launch
           (c4a_layer_topk)
  C128A    combined prefill rows, computed without the prefill rows
           (build_c128a_combined_prefill_rows); SWA-only: window-only rows

Run:  python examples/swa_c4a_step.py
"""
import numpy as np

import dsv4_cupy as d4
from dsv4_cupy.device import has_gpu

MAX_MODEL_LEN = 1 << 17
MAX_TOKENS = 512                          # persistent buffers' rows
QUERY_LENS = [2, 2, 2, 300]               # decodes first (vLLM's order)
PREFIXES = [1_700, 900, 2_000, 1_500]
PADDING = 2
WINDOW, SWA_BLOCK = 128, 64               # the SWA cache: 64 tokens per block
TOP_K, C4A_RATIO, C4A_BLOCK = 512, 4, 256 // 4
C128A_RATIO, C128A_BLOCK = 128, 256 // 128
SPEC_TOKENS = 1


def host_step(seed=0):
    """The step's host arrays (what the runner's CPU copies hold)."""
    rng = np.random.default_rng(seed)
    seq = np.array(PREFIXES) + QUERY_LENS
    qsl = np.zeros(len(QUERY_LENS) + 1, np.int32)
    qsl[1:] = np.cumsum(QUERY_LENS)
    tokens = int(qsl[-1]) + PADDING
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(QUERY_LENS, seq)]
                               + [np.zeros(PADDING, int)])
    request = np.concatenate([np.repeat(np.arange(len(QUERY_LENS)), QUERY_LENS),
                              np.zeros(PADDING, int)])
    # One block table per KV-cache group; random physical blocks.
    swa_table = rng.integers(0, 40_000, (len(QUERY_LENS), MAX_MODEL_LEN // SWA_BLOCK), np.int32)
    c4a_table = rng.integers(0, 40_000, (len(QUERY_LENS), MAX_MODEL_LEN // 256), np.int32)
    c128a_table = rng.integers(0, 40_000, (len(QUERY_LENS), MAX_MODEL_LEN // 256), np.int32)
    swa_slots = (swa_table[request, positions // SWA_BLOCK].astype(np.int64) * SWA_BLOCK
                 + positions % SWA_BLOCK)
    swa_slots[-PADDING:] = -1                                   # padding tokens
    return dict(qsl=qsl, seq_lens=seq.astype(np.int32), positions=positions.astype(np.int64),
                swa_table=swa_table, c4a_table=c4a_table, c128a_table=c128a_table,
                swa_slots=swa_slots, num_tokens=tokens)


def main():
    xp = np
    if has_gpu():
        import cupy as xp
    host = host_step()
    step = {name: xp.asarray(value) if isinstance(value, np.ndarray) else value
            for name, value in host.items()}
    tokens, qsl, seq = step["num_tokens"], step["qsl"], step["seq_lens"]
    print(f"{'GPU (cupy)' if xp is not np else 'CPU (numpy)'}: {len(QUERY_LENS)} requests, "
          f"{tokens} tokens (query lens {QUERY_LENS} + {PADDING} padding)")

    # --- once per step ----------------------------------------------------------------------
    num_decodes, num_prefills, nd, num_prefill_tokens = d4.split_decodes_and_prefills(
        host["qsl"], 1 + SPEC_TOKENS, num_actual_tokens=tokens)
    token_to_req = d4.token_to_req_indices(qsl, tokens)
    is_valid = step["swa_slots"] >= 0                           # the SWA builder's rule
    swa_decode = d4.compute_swa_indices_and_lens(WINDOW, qsl, seq, token_to_req, is_valid,
                                                 step["swa_table"], SWA_BLOCK, 0, nd)
    swa_prefill = d4.compute_swa_indices_and_lens(WINDOW, qsl, seq, token_to_req, is_valid,
                                                  step["swa_table"], SWA_BLOCK, nd,
                                                  tokens - nd)
    gather_lens = d4.compute_prefill_gather_lens(qsl, seq, num_decodes, num_prefills, WINDOW)
    print(f"SWA: decode rows {tuple(swa_decode[0].shape)} lens {swa_decode[1].tolist()}, "
          f"prefill rows {tuple(swa_prefill[0].shape)}, gather lens {gather_lens.tolist()}")

    context_lens, req_ids, _, block_rows, _ = d4.build_indexer_decode_metadata(
        qsl[:num_decodes + 1], seq, step["c4a_table"], nd, C4A_RATIO)
    # The prefill chunk plan comes from host lengths; N and M size the gathered workspace.
    prefill_seq = host["seq_lens"][num_decodes:]
    prefill_queries = np.diff(host["qsl"])[num_decodes:]
    plan = d4.get_prefill_chunk_plan(prefill_seq, prefill_queries, C4A_RATIO, 4, WINDOW,
                                     MAX_MODEL_LEN, MAX_TOKENS)
    print(f"C4A indexer: decode context lens {context_lens.tolist()}, request ids "
          f"{req_ids.tolist()}; prefill chunk plan (start, end, N, M) {plan}")

    # --- per C4A layer: the short-context shortcut (max context // 4 <= TOP_K) ---------------
    assert int(host["seq_lens"].max()) // C4A_RATIO <= TOP_K
    topk_buffer = xp.full((MAX_TOKENS, TOP_K), -1, np.int32)    # upstream's topk_indices_buffer
    local = d4.fill_short_context_topk_indices(step["positions"], TOP_K, C4A_RATIO,
                                               out=topk_buffer)
    for index, (start, end, N, M) in enumerate(plan):
        first, last = num_decodes + start, num_decodes + end
        chunk_qsl = qsl[first:last + 1]
        chunk_tokens = slice(int(host["qsl"][first]), int(host["qsl"][last]))
        if index == 0:      # the decode rows (in place) and the first chunk's rows, one launch
            (decode_global, decode_lens), (combined, combined_lens) = d4.c4a_layer_topk(
                local[:chunk_tokens.stop], nd, token_to_req, step["c4a_table"][:num_decodes],
                C4A_BLOCK, is_valid, chunk_qsl, seq[first:last], gather_lens[start:end],
                WINDOW, C4A_RATIO, M, N, out=((topk_buffer, None), None))
            print(f"C4A decode: global rows {tuple(decode_global.shape)}, "
                  f"lens {decode_lens.tolist()}")
        else:
            combined, combined_lens = d4.combine_topk_swa_indices(
                local[chunk_tokens], chunk_qsl, seq[first:last], gather_lens[start:end], WINDOW,
                C4A_RATIO, TOP_K, M, N)
        ranges = d4.build_indexer_prefill_chunk_metadata(
            chunk_qsl, seq[first:last], C4A_RATIO, 0, chunk_tokens.stop - chunk_tokens.start,
            num_compressed=int((host["seq_lens"][first:last] // C4A_RATIO).sum()))
        print(f"C4A chunk {start}:{end}: combined {tuple(combined.shape)}, last length "
              f"{int(combined_lens[-1])}; indexer cu_compressed {ranges[0].tolist()}")

    # --- C128A: per step, and its combined prefill rows (the same for every C128A layer) ----
    width = d4.c128a_active_width(int(host["seq_lens"].max()), d4.c128a_capacity(MAX_MODEL_LEN))
    c128a_decode, c128a_lens, c128a_prefill = d4.build_c128a_topk_metadata(
        step["positions"][:int(host["qsl"][-1])], C128A_RATIO, nd, token_to_req,
        step["c128a_table"], C128A_BLOCK, step["swa_slots"], max_compressed_tokens=width)
    start, end, N, M = d4.get_prefill_chunk_plan(prefill_seq, prefill_queries, C128A_RATIO, 4,
                                                 WINDOW, MAX_MODEL_LEN, MAX_TOKENS)[0]
    c128a_combined, _ = d4.build_c128a_combined_prefill_rows(
        num_prefill_tokens, qsl[num_decodes:], seq[num_decodes:], gather_lens, WINDOW,
        C128A_RATIO, width, M, N)                    # = combine_topk_swa_indices(c128a_prefill, ...)
    # SWA-only layers: no compressed rows (ratio 0, topk 0, N = 0), a [T, 0] top-k input.
    _, _, no_rows, window_rows = d4.get_prefill_chunk_plan(prefill_seq, prefill_queries, 0, 4,
                                                           WINDOW, MAX_MODEL_LEN, MAX_TOKENS)[0]
    swa_only, _ = d4.combine_topk_swa_indices(xp.zeros((num_prefill_tokens, 0), np.int32),
                                              qsl[num_decodes:], seq[num_decodes:], gather_lens,
                                              WINDOW, 0, 0, window_rows, no_rows)
    print(f"C128A: decode lens {c128a_lens.tolist()}, combined prefill rows "
          f"{tuple(c128a_combined.shape)}; SWA-only combined rows {tuple(swa_only.shape)}")

    # --- hand everything to torch, zero copy ------------------------------------------------
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch not installed: skipping the hand-off")
        return
    address = (lambda a: a.data.ptr) if xp is not np else (lambda a: a.ctypes.data)
    handed = {"swa_decode_indices": swa_decode[0], "c4a_decode_global": decode_global,
              "c4a_decode_lens": decode_lens, "c128a_combined": c128a_combined,
              "indexer_block_rows": block_rows}
    for name, array in handed.items():
        tensor = d4.to_torch(array)
        assert tensor.data_ptr() == address(array) and tuple(tensor.shape) == array.shape, name
    print(f"to_torch: {len(handed)} results shared with torch without a copy "
          f"({d4.to_torch(decode_global).device})")


if __name__ == "__main__":
    main()
