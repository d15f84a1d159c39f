"""Host cost per call, next to the launch floor measured in the same run.

What a serving loop waits for before each step: the eager wall time of one
call (``GpuTimer.host_us``: the median of five rounds of calls back to back), with torch
CUDA tensors and ``out=`` buffers, for every op and builder case. The floor is
a bare ``cuLaunchKernel`` of an empty kernel taking one 256-byte struct, the
same launch path the library uses, timed in rounds paired with each case's
(``GpuTimer.paired_host_us``: "x floor" compares the two at one speed of the
host); Triton's launcher (7 tensors, 2 ints) is the upstream comparison.
"""
from __future__ import annotations

import numpy as np


def launch_floor(torch):
    """The launch floor: a no-argument call of one bare ``cuLaunchKernel`` of
    an empty kernel on torch's current stream, its handles read once, as a
    prepared launch reads them."""
    import cupy

    from ..kinds import TORCH_CUDA
    from ..launch import stream_getter
    module = cupy.RawModule(code='struct Params { long long field[32]; };\n'
                                 'extern "C" __global__ void empty_kernel(const Params p) {}')
    function = module.get_function("empty_kernel").kernel
    storage = np.zeros(256, np.uint8)
    pointers = np.array([storage.ctypes.data], np.uint64)
    stream = stream_getter(TORCH_CUDA, torch.cuda.current_device())
    launch = cupy.cuda.driver.launchKernel
    kernel, kernel_params = function.ptr, pointers.ctypes.data

    def floor(_alive=(module, storage, pointers)):     # what the handles point into
        launch(kernel, 1, 1, 1, 32, 1, 1, 0, stream(), kernel_params, 0)
    return floor


def triton_launcher_us(timer, torch) -> float | None:
    try:
        from .triton_ports import empty_launch
    except ImportError:
        return None
    x = torch.zeros(1024, dtype=torch.int32, device="cuda")
    return timer.host_us(lambda: empty_launch([x] * 7, 1, 2))


def op_cases(torch, make_step) -> list[tuple[str, object]]:
    """(name, call) for each op with torch CUDA inputs and out= buffers."""
    import dsv4_cupy as d4
    t = {k: (torch.from_numpy(np.ascontiguousarray(v)).cuda() if isinstance(v, np.ndarray)
             else v) for k, v in make_step(32, 1, [], 0).items()}
    T, nd = t["positions"].shape[0], t["nd"]
    req = torch.empty(T, dtype=torch.int32, device="cuda")
    slots = torch.empty(T, dtype=torch.int64, device="cuda")
    decode = torch.empty((T, 8192), dtype=torch.int32, device="cuda")
    lens = torch.empty(T, dtype=torch.int32, device="cuda")
    prefill = torch.empty((1, 8192), dtype=torch.int32, device="cuda")
    return [
        ("token_to_req_indices (32 tokens)",
         lambda: d4.token_to_req_indices(t["qsl"], T, out=req)),
        ("get_compressed_slot_mapping (32 tokens)",
         lambda: d4.get_compressed_slot_mapping(T, t["slots"], t["qsl"], t["seq"], t["table"], 2,
                                                 128, slots)),
        ("build_c128a_topk_metadata (32 decodes)",
         lambda: d4.build_c128a_topk_metadata(t["positions"], 128, nd, req, t["table"], 2,
                                              t["slots"], decode, lens, prefill,
                                              max_compressed_tokens=8192)),
    ]


def builder_cases(torch, make_step, max_model_len, max_tokens) -> list[tuple[str, object]]:
    import dsv4_cupy as d4
    cases = []
    for name, requests, query, prefills in (("decode 1x1", 1, 1, []), ("decode 32x1", 32, 1, []),
                                            ("decode 256x2", 256, 2, []),
                                            ("mixed 128+4096", 128, 1, [4096])):
        step = make_step(requests, query, prefills, 3)
        device = {k: torch.from_numpy(np.ascontiguousarray(step[k])).cuda()
                  for k in ("qsl", "seq", "table", "slots", "positions")}
        builder = d4.DeepseekV4MetadataBuilder(128, max_model_len, max_tokens,
                                               num_speculative_tokens=query - 1, like="torch")
        cm = d4.CommonAttentionMetadata(
            query_start_loc=device["qsl"], query_start_loc_cpu=torch.from_numpy(step["qsl"]),
            seq_lens=device["seq"], block_table_tensor=device["table"],
            slot_mapping=device["slots"], positions=device["positions"],
            num_reqs=len(step["seq"]), num_actual_tokens=step["positions"].shape[0],
            max_query_len=step["max_q"], max_seq_len=step["max_seq"])
        cases.append((f"builder.build {name}", lambda b=builder, c=cm: b.build(0, c)))
    return cases


def host_rows(timer, torch, floor, make_step, max_model_len,
              max_tokens) -> tuple[list[dict], dict]:
    """A row per op and builder case: its host us, and it over the launch
    floor (``launch_floor``) timed in paired rounds; the floor alone in the meta."""
    triton_us = triton_launcher_us(timer, torch)
    rows = []
    for name, call in (op_cases(torch, make_step)
                       + builder_cases(torch, make_step, max_model_len, max_tokens)):
        host, floor_us, x_floor = timer.paired_host_us(call, floor)
        rows.append({"op": "host", "case": name, "host_us": host, "floor_us": floor_us,
                     "x_floor": x_floor, "x_triton": host / triton_us if triton_us else None})
    return rows, {"launch_floor_us": timer.host_us(floor, reps=1000),
                  "triton_launcher_us": triton_us}


def print_host_rows(rows: list[dict], meta: dict) -> None:
    triton_us = meta["triton_launcher_us"]
    print(f"\nhost per call: launch floor {meta['launch_floor_us']:.2f} us, Triton launcher "
          + (f"{triton_us:.2f} us" if triton_us else "not available"))
    print(f"{'case':42} {'host us':>8} {'floor us':>8} {'x floor':>8} {'x triton':>9}")
    for row in rows:
        x_triton = f"{row['x_triton']:9.2f}" if row["x_triton"] is not None else f"{'-':>9}"
        print(f"{row['case']:42} {row['host_us']:8.2f} {row['floor_us']:8.2f} "
              f"{row['x_floor']:8.2f} {x_triton}")
