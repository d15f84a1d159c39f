"""The "whole step" cases: every group's metadata of a step from
``DeepseekV4StepMetadataBuilder`` against the C128A group's build alone, GPU
(graph replay) and host (eager) time, and launches per step."""
from __future__ import annotations

import numpy as np

#: (case, decode requests, tokens per decode, prefill query lengths)
STEP_CASES = (("decode 1x1", 1, 1, []), ("decode 16x1", 16, 1, []), ("decode 64x1", 64, 1, []),
              ("decode 256x1", 256, 1, []), ("decode 128x2", 128, 2, []),
              ("mixed 64+2048", 64, 1, [2048]))


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


def step_rows(timer, torch, make_step, max_model_len: int, max_tokens: int,
              launch_floor_us: float) -> list[dict]:
    import dsv4_cupy as d4
    from dsv4_cupy import loader

    rows = []
    for index, (name, requests, query, prefills) in enumerate(STEP_CASES):
        step = make_step(requests, query, prefills, 40 + index)
        cms = _group_metadata(torch, d4, step, np.random.default_rng(index))
        spec = query - 1
        c128a = d4.DeepseekV4MetadataBuilder(128, max_model_len, max_tokens,
                                             num_speculative_tokens=spec, like="torch")
        whole = d4.DeepseekV4StepMetadataBuilder(max_model_len, max_tokens,
                                                 num_speculative_tokens=spec,
                                                 combined_prefill=bool(prefills), like="torch")
        launches = []
        run = loader.LaunchPlan.run
        loader.LaunchPlan.run = lambda plan, stream: launches.append(plan) or run(plan, stream)
        try:
            whole.build(0, cms)
        finally:
            loader.LaunchPlan.run = run
        row = {"op": "step", "case": name, "tokens": step["positions"].shape[0],
               "launches": len(launches)}
        for who, fn in (("c128a", lambda: c128a.build(0, cms["c128a"])),
                        ("step", lambda: whole.build(0, cms))):
            row[f"{who}_graph_us"] = timer.graph_us(fn)
            row[f"{who}_host_us"] = timer.host_us(fn)
        row["x_c128a_gpu"] = row["step_graph_us"] / row["c128a_graph_us"]
        row["step_x_floor"] = row["step_host_us"] / launch_floor_us
        rows.append(row)
    return rows


def print_step_rows(rows: list[dict]) -> None:
    print("\nwhole step: every group's metadata in one build (DeepseekV4StepMetadataBuilder) "
          "against the C128A group's build alone")
    print(f"{'case':16} {'tokens':>6} {'launches':>8} {'c128a gpu':>10} {'step gpu':>9} "
          f"{'x c128a':>8} {'c128a host':>11} {'step host':>10} {'x floor':>8}")
    for r in rows:
        print(f"{r['case']:16} {r['tokens']:6d} {r['launches']:8d} {r['c128a_graph_us']:10.2f} "
              f"{r['step_graph_us']:9.2f} {r['x_c128a_gpu']:8.2f} {r['c128a_host_us']:11.2f} "
              f"{r['step_host_us']:10.2f} {r['step_x_floor']:8.2f}")
