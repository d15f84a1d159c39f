"""The "whole step" cases: every group's metadata of a step from
``DeepseekV4StepMetadataBuilder`` against upstream's sequence for the same
step and against the C128A group's build alone: GPU (graph replay) and host
(eager) time, and launches per step.

Upstream's sequence (``upstream_sequence``) is what vLLM runs per step: one
builder per KV-cache group (the SWA builder's host token map copied to the
device, ``slot_mapping >= 0``, its length fill and its SWA kernels; the C4A,
indexer and C128A slot mappings; the indexer's decode metadata; the C128A
builder's own token-map copy and C128A kernel), then, with prefills, the
combine of every C128A and SWA-only layer per chunk (20 and 2 layers in
DeepSeek-V4-Flash). The SWA and combine kernels are the bench's Triton ports;
the others are this library's single ops, which are at least as fast as
upstream's kernels in this bench, so the comparison favours upstream.
"""
from __future__ import annotations

import time

import numpy as np

from ..spec import C4A_BLOCK_SIZE as C4A_BLOCK
from ..spec import SWA_BLOCK_SIZE as SWA_BLOCK
from ..spec import SWA_WINDOW_SIZE as WINDOW

#: DeepSeek-V4-Flash's layers whose prefill rows upstream combines once per layer.
C128A_LAYERS, SWA_ONLY_LAYERS = 20, 2
C128A_BLOCK = 2

#: Builds of a step with prefills before its contexts repeat (``advancing``).
ADVANCING_STEPS = 512

#: (case, decode requests, tokens per decode, prefill query lengths)
STEP_CASES = (("decode 1x1", 1, 1, []), ("decode 16x1", 16, 1, []), ("decode 64x1", 64, 1, []),
              ("decode 256x1", 256, 1, []), ("decode 128x2", 128, 2, []),
              ("mixed 64+2048", 64, 1, [2048]), ("mixed 64+4x512", 64, 1, [512] * 4),
              ("mixed 64+64x32", 64, 1, [32] * 64))   # 16 chunks of PREFILL_CHUNK_SIZE requests
#: The indexer's decode layout of the bench's steps: vLLM's sm_100 (and
#: flattening) path, as in every earlier run (``bench.sections`` can time the other).
INDEXER_DECODE_LAYOUT = "flat"
#: The decode step the mixed steps' host time is compared with (their decodes alone).
PREFILL_DECODES_CASE = "decode 64x1"

#: The host phases of a build, by the builder's steps they time. A decode
#: step's prepared path has its key (checks), its launch key (planning: the
#: width and the short-context choice) and the launch; a step with prefills
#: all of them, "prepare" being its kept launches with this step's values
#: written in (or, for new host decisions, the launches described and prepared).
PHASES = (("checks", ("_layout_key", "_layout")), ("planning", ("_plan", "_launch_key")),
          ("views", ("_metadata",)), ("prepare", ("_prepared_step",)),
          ("launch", ("PreparedCall.run",)))


def advancing(step: dict, nd_requests: int, max_model_len: int):
    """A function that moves the step's prefill contexts on by their query
    lengths, in place in the host copy the plans read (``step["seq"]``, which
    the metadata's ``seq_lens_cpu`` tensors share), as chunked prefill does
    step after step: every build plans new chunk sizes and indexer rows. A
    context without room for ``ADVANCING_STEPS`` queries below
    ``max_model_len`` moves back instead (to its query at the least)."""
    seq = step["seq"]
    query = np.diff(step["qsl"])[nd_requests:].astype(np.int64)
    first = seq[nd_requests:].astype(np.int64)
    forward = first + ADVANCING_STEPS * query <= max_model_len
    variants = [np.where(forward, first + k * query, np.maximum(first - k * query, query))
                .astype(seq.dtype) for k in range(ADVANCING_STEPS)]
    state = {"k": 0}

    def advance():
        state["k"] = (state["k"] + 1) % len(variants)
        seq[nd_requests:] = variants[state["k"]]

    return advance


def host_phases(builder, cms, advance, reps: int = 400) -> tuple[dict, dict]:
    """Host us of each phase of ``builder.build``, ``advance()`` before each
    build (a step with prefills: ``advancing``): the builder's own steps
    (``PHASES``) timed in place, the median per phase over ``reps`` builds,
    and "other", the rest of the build (its glue); then the whole builds'
    median, mean and 99th percentile (phase clocks included). ``host_us``
    is a mean: where it is far above the median, a tail of slow builds
    makes the difference, not a phase."""
    from .. import prepared
    clock = time.perf_counter_ns
    spent = dict.fromkeys((name for name, _ in PHASES), 0)

    def timed(phase, fn):
        def wrapper(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += clock() - start
        return wrapper

    patched = []
    for phase, steps in PHASES:
        for step in steps:
            owner, name = ((prepared.PreparedCall, step[13:]) if step.startswith("PreparedCall.")
                           else (builder, step))
            patched.append((owner, name, owner.__dict__.get(name)))
            setattr(owner, name, timed(phase, getattr(owner, name)))
    samples = {name: [] for name in (*spent, "other")}
    builds = []
    try:
        for _ in range(reps):
            advance()
            for name in spent:
                spent[name] = 0
            start = clock()
            builder.build(0, cms)
            total = clock() - start
            for name, ns in spent.items():
                samples[name].append(ns / 1e3)
            samples["other"].append((total - sum(spent.values())) / 1e3)
            builds.append(total / 1e3)
    finally:
        for owner, name, original in reversed(patched):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
    return ({name: float(np.median(values)) for name, values in samples.items()},
            {"median": float(np.median(builds)), "mean": float(np.mean(builds)),
             "p99": float(np.percentile(builds, 99))})


def prepared_launches(builder, cms) -> list:
    """The prepared launches (``launch.PreparedLaunch``) that one build of
    ``builder`` runs, in order (the build runs them)."""
    from .. import launch
    launches = []
    run = launch.PreparedLaunch.run
    launch.PreparedLaunch.run = lambda plan, stream: launches.append(plan) or run(plan, stream)
    try:
        builder.build(0, cms)
    finally:
        launch.PreparedLaunch.run = run
    return launches


def step_case(torch, d4, index: int, make_step, max_model_len: int, max_tokens: int,
              indexer_decode_layout: str = INDEXER_DECODE_LAYOUT) -> tuple:
    """``(step, cms, builder)`` of ``STEP_CASES[index]`` as the bench builds
    it: the step (``make_step``'s, seeded by the case), one
    ``CommonAttentionMetadata`` per group on the GPU, and the step builder
    (combined prefill rows when the case has prefills; the indexer's decode
    rows in ``indexer_decode_layout``)."""
    _, requests, query, prefills = STEP_CASES[index]
    step = make_step(requests, query, prefills, 40 + index)
    cms = _group_metadata(torch, d4, step, np.random.default_rng(index))
    builder = d4.DeepseekV4StepMetadataBuilder(max_model_len, max_tokens,
                                               num_speculative_tokens=query - 1,
                                               combined_prefill=bool(prefills), like="torch",
                                               indexer_decode_layout=indexer_decode_layout)
    return step, cms, builder


def _group_metadata(torch, d4, step, rng):
    """One CommonAttentionMetadata per group: the step's shared arrays, own tables and slots."""
    dev = torch.device("cuda")
    shared = {k: torch.from_numpy(np.ascontiguousarray(step[k])).to(dev)
              for k in ("qsl", "seq", "positions")}
    requests, tokens = len(step["seq"]), step["positions"].shape[0]
    groups = {}
    for group, columns in (("swa", step["table"].shape[1] * 4), ("c4a", step["table"].shape[1]),
                           ("indexer", step["table"].shape[1]), ("c128a", step["table"].shape[1])):
        table = torch.from_numpy(rng.integers(0, 1 << 20, (requests, columns), dtype=np.int32))
        groups[group] = d4.CommonAttentionMetadata(
            query_start_loc=shared["qsl"], query_start_loc_cpu=torch.from_numpy(step["qsl"]),
            seq_lens=shared["seq"], block_table_tensor=table.to(dev),
            slot_mapping=torch.from_numpy(step["slots"]).to(dev), positions=shared["positions"],
            num_reqs=requests, num_actual_tokens=tokens, max_query_len=step["max_q"],
            max_seq_len=step["max_seq"], seq_lens_cpu=torch.from_numpy(step["seq"]))
    return groups


def upstream_sequence(torch, d4, ports, step, cms, spec: int, max_model_len: int,
                      max_tokens: int):
    """``(run, launches, outputs)``: upstream's per-step sequence on this step's
    arrays, its launch count, and the outputs the bench compares with the step
    builder's (SWA decode rows and lengths; the combined rows with prefills)."""
    dev = torch.device("cuda")
    cm = cms["c128a"]
    qsl, seq, positions, T = cm.query_start_loc, cm.seq_lens, cm.positions, cm.num_actual_tokens
    host_qsl = step["qsl"]
    nr, npf, nd, ntp = d4.split_decodes_and_prefills(host_qsl, 1 + spec)
    host_t2r = torch.from_numpy(np.repeat(np.arange(len(step["seq"]), dtype=np.int32),
                                          np.diff(host_qsl))).pin_memory()
    i32 = dict(dtype=torch.int32, device=dev)
    t2r, t2r_c128a = torch.empty(T, **i32), torch.empty(T, **i32)
    valid = torch.empty(T, dtype=torch.bool, device=dev)
    swa_rows, swa_lens = torch.full((T, WINDOW), -1, **i32), torch.zeros(max_tokens, **i32)
    slots = {group: torch.full((max_tokens,), -1, dtype=torch.int64, device=dev)
             for group in ("c4a", "indexer", "c128a")}
    indexer_table = cms["indexer"].block_table_tensor
    indexer_out = (torch.zeros(max_tokens, **i32), torch.zeros(nd, **i32),
                   torch.zeros(nd, **i32), torch.zeros(nd, indexer_table.shape[1], **i32),
                   torch.zeros(nd, **i32))
    capacity = d4.c128a_capacity(max_model_len)
    width = d4.c128a_active_width(cm.max_seq_len, capacity)
    c128a_out = (torch.full((nd, width), -1, **i32), torch.zeros(nd, **i32),
                 torch.full((ntp, width), -1, **i32))
    decode_qsl = qsl[:nr + 1]
    gather = torch.zeros(max(npf, 1), **i32)
    combines = []            # (out, lens, local rows, qsl, seq, gather, ratio, topk, M, N, layers)
    outputs = [swa_rows[:nd], swa_lens[:nd]]
    if npf:
        host_seq = step["seq"][nr:].astype(np.int64)
        queries = np.diff(host_qsl[nr:]).astype(np.int64)
        first = int(host_qsl[nr])
        no_rows = torch.zeros(ntp, 0, **i32)
        for ratio, topk, local, layers in ((128, width, c128a_out[2], C128A_LAYERS),
                                           (1, 0, no_rows, SWA_ONLY_LAYERS)):
            out = (torch.full((ntp, d4.combine.combined_width(topk, WINDOW)), -1, **i32),
                   torch.zeros(ntp, **i32))
            outputs += out
            for start, end, N, M in d4.get_prefill_chunk_plan(
                    host_seq, queries, ratio, 4, WINDOW, max_model_len, max_tokens):
                a, b = nr + start, nr + end
                t0, t1 = int(host_qsl[a]) - first, int(host_qsl[b]) - first
                combines.append((out[0][t0:t1], out[1][t0:t1], local[t0:t1], qsl[a:b + 1],
                                 seq[a:b], gather[start:end], ratio, topk, M, N, layers))

    def run():
        t2r.copy_(host_t2r, non_blocking=True)                 # SWA builder
        torch.ge(cms["swa"].slot_mapping[:T], 0, out=valid)
        swa_lens[nd:].fill_(0)
        swa_table = cms["swa"].block_table_tensor
        ports.swa_indices_and_lens(swa_rows, swa_lens, WINDOW, qsl, seq, t2r, valid, swa_table,
                                   SWA_BLOCK, 0, nd)
        if ntp:
            ports.swa_indices_and_lens(swa_rows[nd:], swa_lens[nd:], WINDOW, qsl, seq, t2r,
                                       valid, swa_table, SWA_BLOCK, nd, ntp)
            d4.compute_prefill_gather_lens(qsl, seq, nr, npf, WINDOW, out=gather)
        for group, block, ratio in (("c4a", C4A_BLOCK, 4), ("indexer", C4A_BLOCK, 4),
                                    ("c128a", C128A_BLOCK, 128)):          # the other builders
            d4.get_compressed_slot_mapping(T, cms[group].slot_mapping, qsl, seq,
                                           cms[group].block_table_tensor, block, ratio,
                                           out=slots[group])
        if nd:
            d4.build_indexer_decode_metadata(decode_qsl, seq, indexer_table, nd, 4,
                                             out=indexer_out)
        t2r_c128a.copy_(host_t2r, non_blocking=True)
        d4.build_c128a_topk_metadata(positions, 128, nd, t2r_c128a, cm.block_table_tensor,
                                     C128A_BLOCK, cm.slot_mapping, *c128a_out)
        for out, lens, local, chunk_qsl, chunk_seq, chunk_gather, ratio, topk, M, N, layers \
                in combines:                                   # per layer, per chunk
            for _ in range(layers):
                ports.combine_topk_swa_indices(out, lens, local, chunk_qsl, chunk_seq,
                                               chunk_gather, WINDOW, ratio, topk, M, N)

    launches = (3 + bool(nd) + 2 * bool(ntp) + 3 + bool(nd) + 2
                + sum(layers for *_, layers in combines))
    return run, launches, outputs


def step_rows(timer, torch, floor, make_step, max_model_len: int,
              max_tokens: int) -> list[dict]:
    import dsv4_cupy as d4
    try:
        from . import triton_ports as ports
    except ImportError:
        ports = None

    rows = []
    for index, (name, requests, query, prefills) in enumerate(STEP_CASES):
        step, cms, whole = step_case(torch, d4, index, make_step, max_model_len, max_tokens)
        original_seq = step["seq"].copy()
        spec = query - 1
        c128a = d4.DeepseekV4MetadataBuilder(128, max_model_len, max_tokens,
                                             num_speculative_tokens=spec, like="torch")
        row = {"op": "step", "case": name, "tokens": step["positions"].shape[0],
               "launches": len(prepared_launches(whole, cms))}
        advance = advancing(step, requests, max_model_len) if prefills else (lambda: None)

        def advancing_build():
            advance()
            return whole.build(0, cms)

        timed = [("c128a", lambda: c128a.build(0, cms["c128a"])),
                 ("step", lambda: whole.build(0, cms))]
        if ports is not None:
            upstream, row["upstream_launches"], upstream_out = upstream_sequence(
                torch, d4, ports, step, cms, spec, max_model_len, max_tokens)
            timed.append(("upstream", upstream))
        for who, fn in timed:
            row[f"{who}_graph_us"] = timer.graph_us(fn)
            if who != "step":
                row[f"{who}_host_us"] = timer.host_us(fn)
        # The step on the host: its contexts advancing (a step with prefills plans
        # anew each build), in rounds paired with the launch floor's.
        row["step_host_us"], row["floor_us"], row["step_x_floor"] = timer.paired_host_us(
            advancing_build, floor)
        row["host_phases_us"], row["host_builds_us"] = host_phases(whole, cms, advance)
        step["seq"][:] = original_seq
        row["x_c128a_gpu"] = row["step_graph_us"] / row["c128a_graph_us"]
        if ports is not None:
            got = whole.build(0, cms)
            ours = [got.swa_decode_indices[:, 0], got.swa_decode_lens]
            if prefills:
                ours += [got.c128a_combined_indices, got.c128a_combined_lens,
                         got.swa_combined_indices, got.swa_combined_lens]
            row["upstream_same"] = all(bool(torch.equal(a, b)) for a, b in zip(ours, upstream_out))
            row["x_upstream_gpu"] = row["upstream_graph_us"] / row["step_graph_us"]
            row["x_upstream_host"] = row["upstream_host_us"] / row["step_host_us"]
        rows.append(row)
    decode = next((r for r in rows if r["case"] == PREFILL_DECODES_CASE), None)
    for row in rows:
        row["host_x_gpu"] = row["step_host_us"] / row["step_graph_us"]
        if decode is not None:      # each over its paired floor: one speed of the host
            row["host_x_decode"] = row["step_x_floor"] / decode["step_x_floor"]
    return rows


def print_step_rows(rows: list[dict]) -> None:
    if rows:
        names = list(rows[0]["host_phases_us"])
        print("\nwhole step: host us per phase of a build, the median over builds (with "
              "prefills: of advancing prefill contexts), and those builds' median, mean and "
              "99th percentile; the step's host us (a mean), the launch floor's in paired "
              "rounds and the step over it, over its GPU us and over "
              f"{PREFILL_DECODES_CASE}'s (each over its floor)")
        print(f"{'case':16} " + " ".join(f"{name:>9}" for name in names)
              + f" {'sum':>9} {'median':>9} {'mean':>9} {'p99':>9} {'host':>9} {'floor':>6} {'x floor':>7} "
              f"{'x gpu':>6} {'x decode':>8}")
        for r in rows:
            phases, builds = r["host_phases_us"], r["host_builds_us"]
            print(f"{r['case']:16} " + " ".join(f"{phases[name]:9.2f}" for name in names)
                  + f" {sum(phases.values()):9.2f} {builds['median']:9.2f} "
                  f"{builds['mean']:9.2f} {builds['p99']:9.2f} {r['step_host_us']:9.2f} "
                  f"{r['floor_us']:6.2f} {r['step_x_floor']:7.2f} {r['host_x_gpu']:6.2f} "
                  f"{r.get('host_x_decode', float('nan')):8.2f}")
    if rows and "upstream_graph_us" in rows[0]:
        print("\nwhole step against upstream's sequence (per-group builders, per-layer combines)")
        print(f"{'case':16} {'launches':>8} {'upstream':>8} {'step gpu':>9} {'upstream gpu':>12} "
              f"{'x':>6} {'step host':>10} {'upstream host':>13} {'x':>6} {'same':>5}")
        for r in rows:
            print(f"{r['case']:16} {r['launches']:8d} {r['upstream_launches']:8d} "
                  f"{r['step_graph_us']:9.2f} {r['upstream_graph_us']:12.2f} "
                  f"{r['x_upstream_gpu']:6.2f} {r['step_host_us']:10.2f} "
                  f"{r['upstream_host_us']:13.2f} {r['x_upstream_host']:6.2f} "
                  f"{str(r['upstream_same']):>5}")
    print("\nwhole step: every group's metadata in one build (DeepseekV4StepMetadataBuilder) "
          "against the C128A group's build alone")
    print(f"{'case':16} {'tokens':>6} {'launches':>8} {'c128a gpu':>10} {'step gpu':>9} "
          f"{'x c128a':>8} {'c128a host':>11} {'step host':>10} {'x floor':>8}")
    for r in rows:
        print(f"{r['case']:16} {r['tokens']:6d} {r['launches']:8d} {r['c128a_graph_us']:10.2f} "
              f"{r['step_graph_us']:9.2f} {r['x_c128a_gpu']:8.2f} {r['c128a_host_us']:11.2f} "
              f"{r['step_host_us']:10.2f} {r['step_x_floor']:8.2f}")
