"""Benchmark cases of the per-layer and indexer ops (GPU, torch CUDA arrays).

Each case times the library's op by CUDA-graph replay (and its eager host
time) and, for SWA, global top-k, the short-context fill and the combine, a
Triton port of upstream's kernel (``triton_ports``) on the same inputs, after
checking that both give the same bytes. GB/s counts the bytes the op writes.
The op is timed with programmatic dependent launch off (the default) and on
(``set_programmatic_launch``); a graph replays 20 calls back to back, so with
it on each call's launch overlaps the call before it. At 1-64 decode tokens
each such case is also set against the least time one launch with the op's
rounds of dependent loads takes on this GPU (``latency``).
"""
from __future__ import annotations

import numpy as np

from ..spec import C4A_BLOCK_SIZE as C4A_BLOCK
from ..spec import C4A_RATIO, INDEX_TOPKS
from ..spec import SWA_BLOCK_SIZE as SWA_BLOCK
from ..spec import SWA_WINDOW_SIZE as WINDOW
from . import latency

MAX_MODEL_LEN = 1 << 20
#: A vision prompt's image at most (vLLM's vision_max_n_token default).
MAX_IMAGE_TOKENS = 1024
INDEX_TOPK = INDEX_TOPKS[0]
C128A_RATIO, C128A_WIDTH = 128, 8192


def _requests(rng, query_lens):
    """qsl, seq_lens, token_to_req, positions of decodes-first requests with long contexts."""
    query_lens = np.asarray(query_lens)
    seq = query_lens + rng.integers(0, MAX_MODEL_LEN - query_lens.max(), len(query_lens))
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    token_to_req = np.repeat(np.arange(len(query_lens)), query_lens).astype(np.int32)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq)])
    return qsl, seq.astype(np.int32), token_to_req, positions.astype(np.int64)


def layer_cases(quick: bool) -> list[tuple[str, str, dict]]:
    """(op, case name, parameters)."""
    # Decode batches of 1-64 tokens, where launch and latency dominate, then larger ones.
    cases = [("swa", f"decode {n}x1", dict(decodes=n, query_len=1)) for n in (1, 16, 64)]
    cases += [("global_topk", f"decode {n} K=512", dict(tokens=n, width=512)) for n in (1, 16, 64)]
    cases += [("swa", "decode 256x2", dict(decodes=256, query_len=2)),
             ("swa", "prefill 8192", dict(decodes=0, prefill=8192)),
             ("global_topk", "decode 512 K=512", dict(tokens=512, width=512)),
             ("short_fill", "64 x 512", dict(tokens=64, top_k=512)),
             ("short_fill", "8192 x 512", dict(tokens=8192, top_k=512)),
             ("combine", "C128A 8192 C=8320", dict(tokens=8192, topk=C128A_WIDTH)),
             ("combine", "C4A 8192 C=640", dict(tokens=8192, topk=INDEX_TOPK)),
             ("combine", "SWA-only 8192 C=128", dict(tokens=8192, topk=0)),
             ("c4a_layer", "64 dec + 8192 pf K=512", dict(decodes=64, prefill=8192)),
             ("c4a_layer", "256 dec + 2048 pf", dict(decodes=256, prefill=2048)),
             ("c128a_combined", "8192 C=8320", dict(tokens=8192, topk=C128A_WIDTH)),
             ("gather_lens", "256 prefills", dict(prefills=256)),
             ("indexer_prefill", "8192 queries", dict(tokens=8192)),
             ("indexer_decode", "512 tokens", dict(tokens=512)),
             ("indexer_native", "decode 256x4", dict(decodes=256, depth=4)),
             ("swa_image", "prefill 8192, images", dict(prefill=8192, images=True)),
             ("swa_image", "prefill 8192, replay", dict(prefill=8192, images=False)),
             ("image_visibility", "8192 tokens", dict(prefill=8192))]
    if not quick:
        cases += [("swa", "decode 1024x4", dict(decodes=1024, query_len=4)),
                  ("global_topk", "decode 1024 K=1024", dict(tokens=1024, width=1024)),
                  ("combine", "C128A 16384 C=8320", dict(tokens=16384, topk=C128A_WIDTH))]
    return cases


def _prepare(op: str, params: dict, torch, dev, rng, ports):
    """(ours, port or None, outputs of ours, outputs of the port, MB written) for one
    case; ``ports`` is the ``triton_ports`` module, or None without Triton."""
    import dsv4_cupy as d4

    def cuda(array):
        return torch.from_numpy(np.ascontiguousarray(array)).to(dev)

    def empty(*shape):
        return torch.full(shape, -1, dtype=torch.int32, device=dev)

    if op == "swa":
        decodes = params["decodes"]
        query_lens = [params.get("query_len", 1)] * decodes + (
            [params["prefill"]] if "prefill" in params else [])
        qsl, seq, token_to_req, _ = (cuda(x) for x in _requests(rng, query_lens))
        rows = int(qsl[-1])
        valid = torch.ones(rows, dtype=torch.bool, device=dev)
        table = cuda(rng.integers(0, 1 << 22, (len(query_lens), MAX_MODEL_LEN // SWA_BLOCK),
                                  dtype=np.int32))
        args = (WINDOW, qsl, seq, token_to_req, valid, table, SWA_BLOCK, 0, rows)
        ours_out, port_out = (empty(rows, 1, WINDOW), empty(rows)), (empty(rows, WINDOW),
                                                                    empty(rows))
        return (lambda: d4.compute_swa_indices_and_lens(*args, out=ours_out),
                ports and (lambda: ports.swa_indices_and_lens(*port_out, *args)),
                (ours_out[0][:, 0], ours_out[1]), port_out, rows * (WINDOW + 1) * 4 / 1e6)
    if op == "global_topk":
        tokens, width = params["tokens"], params["width"]
        _, _, token_to_req, positions = _requests(rng, [1] * tokens)
        topk = rng.integers(0, MAX_MODEL_LEN // C4A_RATIO, (tokens, width), dtype=np.int32)
        topk[rng.random(topk.shape) < 0.1] = -1
        table = rng.integers(0, 1 << 22, (tokens, MAX_MODEL_LEN // 256), dtype=np.int32)
        args = (cuda(topk), cuda(token_to_req), cuda(table), C4A_BLOCK,
                torch.ones(tokens, dtype=torch.bool, device=dev))
        ours_out, port_out = (empty(tokens, width), empty(tokens)), (empty(tokens, width),
                                                                     empty(tokens))
        return (lambda: d4.compute_global_topk_indices_and_lens(*args, out=ours_out),
                ports and (lambda: ports.global_topk_indices_and_lens(*port_out, *args)),
                ours_out, port_out, tokens * (width + 1) * 4 / 1e6)
    if op == "short_fill":
        tokens, top_k = params["tokens"], params["top_k"]
        positions = cuda(rng.integers(0, 2048, tokens))
        ours_out, port_out = empty(tokens, top_k), empty(tokens, top_k)
        return (lambda: d4.fill_short_context_topk_indices(positions, top_k, C4A_RATIO,
                                                           out=ours_out),
                ports and (lambda: ports.fill_short_context_topk_indices(
                    port_out, positions, top_k, C4A_RATIO, tokens)),
                (ours_out,), (port_out,), tokens * top_k * 4 / 1e6)
    if op == "combine":
        tokens, topk = params["tokens"], params["topk"]
        qsl, seq, _, positions = _requests(rng, [tokens])
        ratio = C128A_RATIO if topk == C128A_WIDTH else (C4A_RATIO if topk else 0)
        if ratio == C128A_RATIO:        # the C128A prefill rows: 0..n-1, the same rule
            local = d4.fill_short_context_topk_indices(cuda(positions), topk, ratio)
        else:                           # an indexer's top-k (none for SWA-only layers)
            visible = int(positions.max() + 1) // max(ratio, 1)
            local = cuda(rng.integers(0, max(visible, 1), (tokens, topk), dtype=np.int32))
        gather = d4.compute_prefill_gather_lens(qsl, seq, 0, 1, WINDOW)
        swa_offset = int(seq.max()) // ratio if ratio > 1 else 0
        rows_per_request = swa_offset + int(gather.max())
        args = (local, cuda(qsl), cuda(seq), cuda(gather), WINDOW, ratio, topk, rows_per_request,
                swa_offset)
        width = d4.combine.combined_width(topk, WINDOW)
        ours_out, port_out = (empty(tokens, width), empty(tokens)), (empty(tokens, width),
                                                                     empty(tokens))
        return (lambda: d4.combine_topk_swa_indices(*args, out=ours_out),
                ports and (lambda: ports.combine_topk_swa_indices(*port_out, *args)),
                ours_out, port_out, tokens * (width + 1) * 4 / 1e6)
    if op == "c4a_layer":           # decode rows to global + prefill rows combined, one layer
        decodes, prefill = params["decodes"], params["prefill"]
        qsl, seq, token_to_req, positions = _requests(rng, [1] * decodes + [prefill])
        tokens = int(qsl[-1])
        visible = np.maximum((positions + 1) // C4A_RATIO, 1)
        topk = (rng.random((tokens, INDEX_TOPK)) * visible[:, None]).astype(np.int32)
        table = rng.integers(0, 1 << 22, (decodes + 1, MAX_MODEL_LEN // 256), dtype=np.int32)
        chunk_qsl, chunk_seq = qsl[decodes:], seq[decodes:]
        gather = d4.compute_prefill_gather_lens(qsl, seq, decodes, 1, WINDOW)
        N = int(chunk_seq.max()) // C4A_RATIO
        M = N + int(gather.max())
        topk, t2r, table, valid = (cuda(topk), cuda(token_to_req), cuda(table),
                                   torch.ones(tokens, dtype=torch.bool, device=dev))
        chunk_qsl, chunk_seq, gather = cuda(chunk_qsl), cuda(chunk_seq), cuda(gather)
        width = d4.combine.combined_width(INDEX_TOPK, WINDOW)
        prefill_rows = tokens - decodes
        ours_out = ((empty(decodes, INDEX_TOPK), empty(decodes)),
                    (empty(prefill_rows, width), empty(prefill_rows)))
        port_out = (empty(decodes, INDEX_TOPK), empty(decodes), empty(prefill_rows, width),
                    empty(prefill_rows))

        def port_layer():
            ports.global_topk_indices_and_lens(port_out[0], port_out[1], topk[:decodes], t2r,
                                               table, C4A_BLOCK, valid)
            ports.combine_topk_swa_indices(port_out[2], port_out[3], topk[decodes:], chunk_qsl,
                                           chunk_seq, gather, WINDOW, C4A_RATIO, INDEX_TOPK, M, N)
        return (lambda: d4.c4a_layer_topk(topk, decodes, t2r, table, C4A_BLOCK, valid, chunk_qsl,
                                          chunk_seq, gather, WINDOW, C4A_RATIO, M, N,
                                          out=ours_out),
                ports and port_layer, (*ours_out[0], *ours_out[1]), port_out,
                (decodes * (INDEX_TOPK + 1) + prefill_rows * (width + 1)) * 4 / 1e6)
    if op == "c128a_combined":      # C128A combined prefill rows: built once, no input rows
        tokens, topk = params["tokens"], params["topk"]
        qsl, seq, _, positions = _requests(rng, [tokens])
        local = d4.fill_short_context_topk_indices(cuda(positions), topk, C128A_RATIO)
        gather = d4.compute_prefill_gather_lens(qsl, seq, 0, 1, WINDOW)
        N = int(seq.max()) // C128A_RATIO
        M = N + int(gather.max())
        qsl, seq, gather = cuda(qsl), cuda(seq), cuda(gather)
        width = d4.combine.combined_width(topk, WINDOW)
        ours_out, port_out = (empty(tokens, width), empty(tokens)), (empty(tokens, width),
                                                                     empty(tokens))
        return (lambda: d4.build_c128a_combined_prefill_rows(tokens, qsl, seq, gather, WINDOW,
                                                             C128A_RATIO, topk, M, N,
                                                             out=ours_out),
                ports and (lambda: ports.combine_topk_swa_indices(
                    *port_out, local, qsl, seq, gather, WINDOW, C128A_RATIO, topk, M, N)),
                ours_out, port_out, tokens * (width + 1) * 4 / 1e6)
    if op == "gather_lens":
        prefills = params["prefills"]
        qsl, seq, _, _ = (cuda(x) for x in _requests(rng, [64] * prefills))
        out = empty(prefills)
        return (lambda: d4.compute_prefill_gather_lens(qsl, seq, 0, prefills, out=out),
                None, (out,), None, prefills * 4 / 1e6)
    if op == "indexer_prefill":
        tokens = params["tokens"]
        qsl, seq, _, _ = _requests(rng, [tokens])
        total = int(seq.sum()) // C4A_RATIO
        outs = (empty(2), empty(total), empty(tokens), empty(tokens))
        qsl, seq = cuda(qsl), cuda(seq)
        return (lambda: d4.build_indexer_prefill_chunk_metadata(
                    qsl, seq, C4A_RATIO, 0, tokens, num_compressed=total, out=outs),
                None, outs, None, (2 + total + 2 * tokens) * 4 / 1e6)
    if op == "indexer_decode":
        tokens = params["tokens"]
        qsl, seq, _, _ = (cuda(x) for x in _requests(rng, [1] * tokens))
        cols = MAX_MODEL_LEN // 256
        table = cuda(rng.integers(0, 1 << 22, (tokens, cols), dtype=np.int32))
        outs = (empty(tokens), empty(tokens), empty(tokens), empty(tokens, cols), empty(tokens))
        return (lambda: d4.build_indexer_decode_metadata(qsl, seq, table, tokens, C4A_RATIO,
                                                         out=outs),
                None, outs, None, tokens * (3 + cols) * 4 / 1e6)
    if op == "indexer_native":          # against vLLM's torch ops for the native layout
        decodes, depth = params["decodes"], params["depth"]
        qsl, seq, _, _ = (cuda(x) for x in _requests(rng, [depth] * decodes))
        ours_out = (empty(decodes, depth), empty(decodes))
        port_out = (empty(decodes * depth), empty(decodes))
        offsets = torch.arange(depth, dtype=torch.int32, device=dev)
        return (lambda: d4.build_indexer_native_decode_metadata(qsl, seq, depth, C4A_RATIO,
                                                                out=ours_out),
                ports and (lambda: ports.native_decode_lengths(*port_out, offsets, qsl, seq,
                                                               decodes, depth, C4A_RATIO)),
                (ours_out[0].reshape(-1), ours_out[1]), port_out, decodes * (depth + 1) * 4 / 1e6)
    if op in ("swa_image", "image_visibility"):   # a vision prompt: images in one prefill
        rows = params["prefill"]
        qsl, seq, token_to_req, _ = _requests(rng, [rows])
        first = int(seq[0]) - rows
        starts = np.sort(rng.choice(np.arange(first, first + rows - MAX_IMAGE_TOKENS),
                                    16, replace=False))
        starts = starts[np.concatenate([[True], np.diff(starts) > MAX_IMAGE_TOKENS])]
        ends = starts + rng.integers(MAX_IMAGE_TOKENS // 16 + 1, MAX_IMAGE_TOKENS, starts.size)
        indptr = np.array([0, starts.size], np.int32)
        spans = [cuda(x.astype(np.int32)) for x in (indptr, starts, ends)]
        qsl, seq, token_to_req = cuda(qsl), cuda(seq), cuda(token_to_req)
        if op == "image_visibility":
            ours_out, port_out = (empty(rows), empty(rows)), (empty(rows), empty(rows))
            args = (qsl, seq, token_to_req, MAX_IMAGE_TOKENS, 0, rows)
            return (lambda: d4.compute_image_visibility(*spans, *args, out=ours_out),
                    ports and (lambda: ports.image_visibility(*port_out, *spans, *args)),
                    ours_out, port_out, rows * 8 / 1e6)
        left, right = d4.compute_image_visibility(*spans, qsl, seq, token_to_req,
                                                  MAX_IMAGE_TOKENS)
        if not params["images"]:
            left = right = None
        replay = cuda(np.array([first - int(rng.integers(0, WINDOW))], np.int32))
        valid = torch.ones(rows, dtype=torch.bool, device=dev)
        table = cuda(rng.integers(0, 1 << 22, (1, MAX_MODEL_LEN // SWA_BLOCK), dtype=np.int32))
        width = WINDOW + MAX_IMAGE_TOKENS
        ours_out = (empty(rows, 1, width), empty(rows))
        port_out = (empty(rows, width), empty(rows))
        return (lambda: d4.compute_swa_indices_and_lens(
                    WINDOW, qsl, seq, token_to_req, valid, table, SWA_BLOCK, 0, rows,
                    index_width=width, left_visible=left, right_visible=right,
                    replay_start=replay, out=ours_out),
                ports and (lambda: ports.swa_extended_rows(
                    *port_out, WINDOW, width, left, right, qsl, seq, token_to_req, valid, table,
                    SWA_BLOCK, replay, 0, rows)),
                (ours_out[0][:, 0], ours_out[1]), port_out, rows * (width + 1) * 4 / 1e6)
    raise ValueError(f"unknown op {op!r}")


def layer_rows(quick: bool, timer, ceilings: dict, floor, progress) -> list[dict]:
    """A row per case; ``ceilings`` is ``cli.ceilings``'s (write bandwidth and
    the floors of one launch, against which the decode cases are set), ``floor``
    the host's launch floor (``host_cost.launch_floor``), timed paired with
    each case's host time."""
    import torch

    from ..launch import set_programmatic_launch
    try:
        from . import triton_ports as ports
    except ImportError:                          # no Triton: no comparison column
        ports = None
    dev = torch.device("cuda")
    rng = np.random.default_rng(5)
    rows = []
    for op, name, params in progress(layer_cases(quick)):
        ours, port, ours_out, port_out, written_mb = _prepare(op, params, torch, dev, rng, ports)
        row = {"op": op, "case": name, "MB": written_mb}
        previous = set_programmatic_launch(True)
        row["ours_pdl_graph_us"] = timer.graph_us(ours)
        set_programmatic_launch(False)
        row["ours_layer_graph_us"] = timer.graph_us(ours)
        row["ours_layer_host_us"], row["floor_us"], row["host_x_floor"] = \
            timer.paired_host_us(ours, floor)
        row["ours_layer_GBps"] = written_mb / row["ours_layer_graph_us"] * 1e3
        row["write_ceiling_pct"] = 100 * row["ours_layer_GBps"] / ceilings["write_GBps"]
        if port is not None:
            ours()
            port()
            torch.cuda.synchronize()
            row["triton_same_bytes"] = all(torch.equal(a, b) for a, b in zip(ours_out, port_out))
            row["triton_graph_us"] = timer.graph_us(port)
            row["x_triton"] = row["triton_graph_us"] / row["ours_layer_graph_us"]
            row["x_triton_pdl"] = row["triton_graph_us"] / row["ours_pdl_graph_us"]
            row["triton_host_us"] = timer.host_us(port)
            row["x_triton_host"] = row["triton_host_us"] / row["ours_layer_host_us"]
            tokens = latency.decode_tokens(op, params)
            if tokens is not None and tokens <= latency.DECODE_TOKENS:
                row["dependent_loads"] = loads = latency.DEPENDENT_LOADS[op]
                row["least_launch_us"] = latency.least_launch_us(
                    ceilings["dependent_loads_us"], loads)
        set_programmatic_launch(previous)
        rows.append(row)
    return rows


def combined_rows_per_step(tokens: int = 8192, c128a_layers: int = 20,
                           swa_only_layers: int = 2) -> dict:
    """Bytes of combined prefill rows (indices and lengths) one step writes at
    ``tokens`` prefill tokens and a 1M context (C128A width 8192), from the
    shapes: upstream combines once per layer, this library once per step for
    the C128A layers and once for the SWA-only layers."""
    import dsv4_cupy as d4
    row_bytes = {ratio: tokens * (d4.combine.combined_width(topk, WINDOW) + 1) * 4
                 for ratio, topk in ((C128A_RATIO, C128A_WIDTH), (0, 0))}
    upstream = c128a_layers * row_bytes[C128A_RATIO] + swa_only_layers * row_bytes[0]
    ours = row_bytes[C128A_RATIO] + row_bytes[0]
    return {"tokens": tokens, "c128a_layers": c128a_layers, "swa_only_layers": swa_only_layers,
            "upstream_bytes": upstream, "ours_bytes": ours, "saved_pct": 100 * (1 - ours / upstream)}


def print_layer_rows(rows: list[dict]) -> None:
    layer = [r for r in rows if "ours_layer_graph_us" in r]
    if not layer:
        return
    print(f"\n{'op':15} {'case':20} {'ours graph us':>13} {'triton graph us':>15} {'x':>5} "
          f"{'same':>5} {'ours pdl us':>11} {'x pdl':>5} {'ours host us':>12} {'x floor':>7} "
          f"{'triton host':>11} {'x host':>6} {'MB':>7} {'GB/s':>6} {'%wr':>4}")
    for r in layer:
        x_pdl = f"{r['x_triton_pdl']:5.2f}" if "x_triton_pdl" in r else f"{'-':>5}"
        triton = (f"{r['triton_graph_us']:15.2f} {r['x_triton']:5.2f} "
                  f"{str(r['triton_same_bytes']):>5}") if "triton_graph_us" in r else \
            f"{'-':>15} {'-':>5} {'-':>5}"
        triton += f" {r['ours_pdl_graph_us']:11.2f} {x_pdl}"
        triton_host = (f"{r['triton_host_us']:11.1f} {r['x_triton_host']:6.2f}"
                       if "triton_host_us" in r else f"{'-':>11} {'-':>6}")
        print(f"{r['op']:15} {r['case']:20} {r['ours_layer_graph_us']:13.2f} {triton} "
              f"{r['ours_layer_host_us']:12.1f} {r['host_x_floor']:7.2f} {triton_host} "
              f"{r['MB']:7.2f} {r['ours_layer_GBps']:6.0f} {r['write_ceiling_pct']:4.0f}")
    bounded = [r for r in layer if "least_launch_us" in r]
    if bounded:
        print(f"\n2x the port at 1-{latency.DECODE_TOKENS} decode tokens against the least time "
              "one launch takes (a kernel that only follows the op's rounds of dependent loads, "
              "then stores; plain or PDL, the lesser; ours likewise):")
        print(f"{'op':15} {'case':20} {'port / 2 us':>11} {'rounds':>6} {'least us':>8} "
              f"{'ours us':>7} {'2x possible':>11}")
        for r in bounded:
            half = r["triton_graph_us"] / 2
            ours = min(r["ours_layer_graph_us"], r["ours_pdl_graph_us"])
            print(f"{r['op']:15} {r['case']:20} {half:11.2f} {r['dependent_loads']:6d} "
                  f"{r['least_launch_us']:8.2f} {ours:7.2f} "
                  f"{'yes' if half >= r['least_launch_us'] else 'no':>11}")
    step = combined_rows_per_step()
    print(f"\ncombined prefill rows per step, {step['tokens']} prefill tokens, 1M context, "
          f"{step['c128a_layers']} C128A + {step['swa_only_layers']} SWA-only layers: upstream "
          f"{step['upstream_bytes'] / 1e9:.2f} GB (once per layer), dsv4_cupy "
          f"{step['ours_bytes'] / 1e9:.3f} GB (once per step): {step['saved_pct']:.1f}% less")
