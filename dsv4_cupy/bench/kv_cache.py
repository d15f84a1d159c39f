"""The fp8_ds_mla cache ops against Triton ports of vLLM 0.34's
(``triton_ports``): the insert at 1, 64 and 8192 tokens; the gather of 8192
rows (4 requests of 2048) as bandwidth against the copy ceiling (bytes read
and written), with programmatic dependent launch off and on (a graph replays
20 calls back to back, so with it a call's launch overlaps the call before
it, as it would a serving step's kernel before it); a C4A layer's prefill
workspace, both caches in one launch against two gathers. Every case's bytes
are compared with the port's. The selective gather of one request's prefill
chunk (512 tokens, top-k 512 and the window) at 64K, 256K and 1M tokens of
context, random and clustered top-k rows, against the full gather of its
workspace: bytes, time, and the rows compared through the indices."""
from __future__ import annotations

import numpy as np

from ..launch import set_programmatic_launch
from ..spec import FP8_DS_MLA_BYTES_PER_TOKEN, HEAD_SIZE

BLOCK, RATIO = 64, 4
#: Bytes a gathered row moves: its record and scales read, 512 bf16 written (and a table entry).
GATHER_ROW_BYTES = FP8_DS_MLA_BYTES_PER_TOKEN + 2 * HEAD_SIZE + 4
INSERT_ROW_BYTES = 2 * HEAD_SIZE + FP8_DS_MLA_BYTES_PER_TOKEN + 8


def cache_rows(timer, ceilings: dict) -> list[dict]:
    import torch

    import dsv4_cupy as d4
    try:
        from . import triton_ports as ports
    except ImportError:
        ports = None
    dev = torch.device("cuda")
    rng = np.random.default_rng(3)
    rows = []
    pages = 8192 // BLOCK * 4 + 8

    def new_cache():
        return d4.empty_kv_cache("c4a", pages, like=torch.zeros(1, device=dev), fill=0)

    for tokens in (1, 64, 8192):
        k = torch.randn(tokens, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
        slots = torch.from_numpy(rng.permutation(pages * BLOCK)[:tokens].astype(np.int64)).to(dev)
        ours_cache, port_cache = new_cache(), new_cache()

        def ours():
            d4.quantize_and_insert_k_cache(k, ours_cache, slots, BLOCK)

        def port():
            ports.quantize_and_insert_k_cache(k, port_cache, slots, BLOCK)
        rows.append(_row("insert", f"{tokens} tokens", ours, port, ours_cache, port_cache,
                         tokens * INSERT_ROW_BYTES, timer, ceilings, ports))

    requests, length = 4, 2048
    cache = new_cache()
    k = torch.randn(requests * length, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
    table = torch.from_numpy(rng.permutation(pages)[:requests * length // BLOCK]
                             .reshape(requests, -1).astype(np.int32)).to(dev)
    positions = np.arange(length)
    slots = np.concatenate([table[b].cpu().numpy()[positions // BLOCK].astype(np.int64) * BLOCK
                            + positions % BLOCK for b in range(requests)])
    d4.quantize_and_insert_k_cache(k, cache, torch.from_numpy(slots).to(dev), BLOCK)
    seq = torch.full((requests,), length, dtype=torch.int32, device=dev)
    ours_out = torch.zeros(requests, length, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
    port_out = torch.zeros_like(ours_out)
    rows.append(_row(
        "gather", f"{requests} x {length} rows",
        lambda: d4.dequantize_and_gather_k_cache(ours_out, cache, seq, None, table, BLOCK, 0),
        lambda: ports.dequantize_and_gather_k_cache(port_out, cache, seq, None, table, BLOCK, 0),
        ours_out, port_out, requests * length * GATHER_ROW_BYTES, timer, ceilings, ports))

    # A C4A layer's prefill chunk: the compressed rows (seq // 4) then the SWA window.
    seq_lens = torch.full((requests,), 4 * length, dtype=torch.int32, device=dev)
    gather_lens = torch.full((requests,), 1024 + 127, dtype=torch.int32, device=dev)
    N = length
    M = N + 1024 + 127
    ours_out = torch.zeros(requests, M, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
    port_out = torch.zeros_like(ours_out)
    swa_table = table.repeat(1, 4)[:, :4 * length // BLOCK].contiguous()

    def two_gathers(gather, out):
        def run():
            gather(out, cache, seq_lens // RATIO, None, table, BLOCK, 0)
            gather(out, cache, seq_lens, gather_lens, swa_table, BLOCK, N)
        return run

    one = lambda: d4.dequantize_and_gather_prefill_kv(  # noqa: E731
        ours_out, cache, table, cache, swa_table, seq_lens, gather_lens, RATIO, N,
        compressed_block_size=BLOCK)
    moved = requests * (length + 1024 + 127) * GATHER_ROW_BYTES
    row = _row("prefill_kv", f"{requests} x ({length} + 1151) rows", one,
               two_gathers(ports.dequantize_and_gather_k_cache, port_out) if ports else None,
               ours_out, port_out, moved, timer, ceilings, ports)
    ours_twice = two_gathers(d4.dequantize_and_gather_k_cache, ours_out)
    row["ours_two_gathers_graph_us"] = timer.graph_us(ours_twice)
    row["x_ours_two_gathers"] = row["ours_two_gathers_graph_us"] / row["ours_graph_us"]
    rows.append(row)
    return rows + selected_rows(timer, rng)


#: The selective gather's chunk: tokens, top-k rows per token, SWA window, clustered regions.
SELECTED_CHUNK, SELECTED_TOPK, SELECTED_WINDOW, SELECTED_REGIONS = 512, 512, 128, (16, 1024)
SELECTED_CONTEXTS = (1 << 16, 1 << 18, 1 << 20)


def selected_rows(timer, rng) -> list[dict]:
    import torch

    import dsv4_cupy as d4
    dev = torch.device("cuda")
    rows = []
    tokens, topk, window = SELECTED_CHUNK, SELECTED_TOPK, SELECTED_WINDOW
    for context in SELECTED_CONTEXTS:
        N = context // RATIO                             # the request's compressed rows
        G = window - 1 + tokens                          # its SWA rows: the chunk's windows
        M = N + G
        compressed_pages, swa_pages = -(-N // BLOCK), -(-G // BLOCK) + 1
        like = torch.zeros(1, device=dev)
        compressed = d4.empty_kv_cache("c4a", compressed_pages, like=like, fill=0)
        compressed.copy_(torch.randint(0, 256, compressed.shape, dtype=torch.uint8, device=dev))
        swa = d4.empty_kv_cache("swa", swa_pages, like=like, fill=0)
        swa.copy_(torch.randint(0, 256, swa.shape, dtype=torch.uint8, device=dev))
        table = torch.from_numpy(rng.permutation(compressed_pages).astype(np.int32)[None]).to(dev)
        swa_table = (torch.arange(-(-context // BLOCK), dtype=torch.int32, device=dev)
                     % swa_pages)[None].contiguous()
        seq = torch.tensor([context], dtype=torch.int32, device=dev)
        gather_lens = torch.tensor([G], dtype=torch.int32, device=dev)
        windows = N + torch.arange(tokens, device=dev)[:, None] + torch.arange(window, device=dev)
        full = torch.empty(1, M, HEAD_SIZE, dtype=torch.bfloat16, device=dev)
        compact = torch.empty(min(M, tokens * (topk + window)), HEAD_SIZE, dtype=torch.bfloat16,
                              device=dev)
        count = torch.zeros(1, dtype=torch.int32, device=dev)
        scratch = torch.empty(d4.selected_gather_scratch_len(1, M, compact.shape[0]), dtype=torch.int32, device=dev)
        for pattern in ("random", "clustered"):
            if pattern == "random":
                top = torch.randint(0, N, (tokens, topk), device=dev)
            else:
                regions, size = SELECTED_REGIONS
                starts = torch.randint(0, N - size, (regions,), device=dev)
                top = starts[torch.randint(0, regions, (tokens, topk), device=dev)] + \
                    torch.randint(0, size, (tokens, topk), device=dev)
            indices = torch.cat([top, windows], 1).to(torch.int32).contiguous()
            lens = torch.full((tokens,), topk + window, dtype=torch.int32, device=dev)
            remapped = torch.empty_like(indices)

            def run_full():
                d4.dequantize_and_gather_prefill_kv(full, compressed, table, swa, swa_table, seq,
                                                    gather_lens, RATIO, N)

            def run_selected():
                d4.dequantize_and_gather_selected_kv(
                    compact, remapped, indices, lens, compressed, table, swa, swa_table, seq,
                    gather_lens, RATIO, N, M, num_selected=count, scratch=scratch)
            run_full()
            run_selected()
            torch.cuda.synchronize()
            selected = int(count[0])
            same = bool(torch.equal(compact[remapped.long()].view(torch.int16),
                                    full.view(M, HEAD_SIZE)[indices.long()].view(torch.int16)))
            full_bytes = M * GATHER_ROW_BYTES
            selected_bytes = (selected * GATHER_ROW_BYTES + 3 * indices.numel() * 4
                              + 3 * scratch.numel() * 4)
            row = {"op": "kv_selected", "case": f"{context >> 10}K {pattern}",
                   "workspace_rows": M, "selected_rows": selected,
                   "full_MB": full_bytes / 1e6, "selected_MB": selected_bytes / 1e6,
                   "full_graph_us": timer.graph_us(run_full),
                   "selected_graph_us": timer.graph_us(run_selected),
                   "selected_host_us": timer.host_us(run_selected), "same_rows": same}
            row["x_full"] = row["full_graph_us"] / row["selected_graph_us"]
            rows.append(row)
    return rows


def _row(op, case, ours, port, ours_out, port_out, moved_bytes, timer, ceilings, ports) -> dict:
    import torch
    row = {"op": f"kv_{op}", "case": case, "MB_moved": moved_bytes / 1e6}
    row["ours_graph_us"] = timer.graph_us(ours)
    previous = set_programmatic_launch(True)
    try:
        row["ours_pdl_graph_us"] = timer.graph_us(ours)
    finally:
        set_programmatic_launch(previous)
    row["ours_host_us"] = timer.host_us(ours)
    row["ours_GBps"] = moved_bytes / row["ours_graph_us"] / 1e3
    row["copy_ceiling_pct"] = 100 * row["ours_GBps"] / ceilings["copy_GBps"]
    row["pdl_copy_ceiling_pct"] = (100 * moved_bytes / row["ours_pdl_graph_us"] / 1e3
                                   / ceilings["copy_GBps"])
    if ports is not None and port is not None:
        ours()
        port()
        torch.cuda.synchronize()
        row["triton_same_bytes"] = bool(torch.equal(ours_out.view(torch.uint8),
                                                    port_out.view(torch.uint8)))
        row["triton_graph_us"] = timer.graph_us(port)
        row["x_triton"] = row["triton_graph_us"] / row["ours_graph_us"]
        row["triton_host_us"] = timer.host_us(port)
    return row


def print_cache_rows(rows: list[dict]) -> None:
    rows = [r for r in rows if str(r.get("op", "")).startswith("kv_")]
    if not rows:
        return
    print("\nfp8_ds_mla cache ops against Triton ports of vLLM 0.34's (CUDA-graph replay):")
    print(f"{'op':13} {'case':26} {'MB':>7} {'ours us':>8} {'GB/s':>6} {'%copy':>6} "
          f"{'pdl us':>7} {'%copy':>6} "
          f"{'port us':>8} {'port/ours':>9} {'same':>5} {'ours host':>9}")
    for r in (r for r in rows if r["op"] != "kv_selected"):
        print(f"{r['op']:13} {r['case']:26} {r['MB_moved']:7.2f} {r['ours_graph_us']:8.2f} "
              f"{r['ours_GBps']:6.0f} {r['copy_ceiling_pct']:6.1f} "
              f"{r['ours_pdl_graph_us']:7.2f} {r['pdl_copy_ceiling_pct']:6.1f} "
              f"{r.get('triton_graph_us', float('nan')):8.2f} "
              f"{r.get('x_triton', float('nan')):9.2f} {str(r.get('triton_same_bytes', '-')):>5} "
              f"{r['ours_host_us']:9.1f}")
        if "x_ours_two_gathers" in r:
            print(f"{'':13} our two gathers {r['ours_two_gathers_graph_us']:.2f} us: one launch "
                  f"{r['x_ours_two_gathers']:.2f}x faster")
    selected = [r for r in rows if r["op"] == "kv_selected"]
    if selected:
        print(f"\nselective gather of a prefill chunk ({SELECTED_CHUNK} tokens, top-k "
              f"{SELECTED_TOPK} + window {SELECTED_WINDOW}) against the full workspace gather:")
        print(f"{'case':15} {'rows':>8} {'selected':>8} {'full MB':>8} {'sel MB':>7} "
              f"{'full us':>8} {'sel us':>8} {'full/sel':>8} {'same':>5} {'sel host':>8}")
        for r in selected:
            print(f"{r['case']:15} {r['workspace_rows']:8d} {r['selected_rows']:8d} "
                  f"{r['full_MB']:8.1f} {r['selected_MB']:7.1f} {r['full_graph_us']:8.1f} "
                  f"{r['selected_graph_us']:8.1f} {r['x_full']:8.2f} {str(r['same_rows']):>5} "
                  f"{r['selected_host_us']:8.1f}")
