"""``python -m dsv4_cupy bench``: a benchmark, not a test.

GPU cases (DeepSeek-V4 shapes; W = 8192, max_model_len 1M): decode
batches of 1-1024 requests x query length 1-8, prefills of 2048-65536 tokens,
mixed batches. For ``build_c128a_topk_metadata`` and the per-step build it
reports GPU time (CUDA events, and CUDA-graph replay), host time per eager
call, achieved GB/s against the write/copy ceilings and the empty-launch floor
that it measures itself, and ratios against torch-eager (and vLLM's kernels
when vLLM is importable). The per-layer and indexer ops (``layers.py``) are
timed against Triton ports of upstream's kernels, and so are the fp8 cache
ops (``kv_cache.py``). CPU case: numba against NumPy for 16384 tokens at
W = 8192. Writes JSON and a PNG plot.
"""
from __future__ import annotations

import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

from .. import __version__
from . import latency
from .host_cost import host_rows, launch_floor, print_host_rows
from .kv_cache import print_cache_rows
from .layers import print_layer_rows
from .step import print_step_rows

MAX_MODEL_LEN = 1 << 20
WIDTH = 8192
MAX_TOKENS = 65536 + 1024
#: Buffers of the whole-step cases (their largest step has 2112 tokens).
STEP_MAX_TOKENS = 8192


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument("--cpu-only", action="store_true", help="only the numba vs NumPy case")
    parser.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def gpu_cases(quick: bool) -> list[tuple[str, int, int, list[int]]]:
    """(name, decode requests, decode query length, prefill lengths)."""
    if quick:
        return [("decode 1x1", 1, 1, []), ("decode 32x1", 32, 1, []), ("decode 256x2", 256, 2, []),
                ("prefill 8192", 0, 1, [8192]), ("mixed 128+4096", 128, 1, [4096])]
    cases = [(f"decode {r}x{q}", r, q, []) for r in (1, 8, 64, 256, 512, 1024) for q in (1, 2, 4, 8)]
    cases += [(f"prefill {n}", 0, 1, [n]) for n in (2048, 8192, 16384, 65536)]
    cases += [("mixed 128+4096", 128, 1, [4096]), ("mixed 256+8192", 256, 2, [4096, 4096]),
              ("mixed 8+2x16384", 8, 4, [16384, 16384])]
    return cases


def _progress(items, enabled: bool, desc: str):
    if not enabled:
        return items
    try:
        from tqdm import tqdm
        return tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        def plain():
            for i, item in enumerate(items):
                print(f"\r{desc}: {i + 1}/{len(items)}", end="", file=sys.stderr, flush=True)
                yield item
            print(file=sys.stderr)
        return plain()


def make_step(n_decode, q_decode, prefill_lens, seed):
    rng = np.random.default_rng(seed)
    q = [q_decode] * n_decode + list(prefill_lens)
    prefixes = [int(rng.integers(q_decode, MAX_MODEL_LEN - q_decode)) for _ in range(n_decode)]
    prefixes += [int(rng.integers(0, max(1, MAX_MODEL_LEN - p))) for p in prefill_lens]
    seq = np.array(prefixes, np.int64) + q
    qsl = np.zeros(len(q) + 1, np.int32)
    qsl[1:] = np.cumsum(q)
    positions = np.concatenate([np.arange(s - x, s) for x, s in zip(q, seq)]).astype(np.int64)
    table = rng.integers(0, 1 << 20, size=(len(q), MAX_MODEL_LEN // 256), dtype=np.int32)
    slots = rng.integers(0, 1 << 30, size=positions.shape[0]).astype(np.int64)
    return dict(qsl=qsl, seq=seq.astype(np.int32), positions=positions, table=table, slots=slots,
                nd=n_decode * q_decode, max_q=max(q), max_seq=int(seq.max()))


class GpuTimer:
    """CUDA-event and CUDA-graph timing on torch's current stream."""

    def __init__(self, torch):
        self.torch = torch

    def events_us(self, fn, reps=50):
        torch = self.torch
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps

    def graph_us(self, fn, reps=20):
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        times = []
        for _ in range(15):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / reps)
        return float(np.median(times))

    def host_us(self, fn, reps=400, rounds=5):
        """Eager wall time per call: the median of ``rounds`` rounds of ``reps``
        calls, each round from an idle stream (one slow round, a collection or
        a neighbour's burst, does not move it)."""
        for _ in range(10):
            fn()
        per_call = [self._round_us(fn, reps) for _ in range(rounds)]
        self.torch.cuda.synchronize()
        return float(np.median(per_call))

    def paired_host_us(self, fn, reference, reps=400, reference_reps=1000,
                       rounds=5) -> tuple[float, float, float]:
        """``(fn's us, reference's us, fn over reference)`` per call: ``host_us``'s
        rounds, each round of ``fn`` right after one of ``reference`` (the
        launch floor), so that a ratio compares the two at one speed of the
        host, which moves between rounds of one process too. The times are
        the medians over the rounds, the ratio the median of the rounds' ratios."""
        for _ in range(10):
            reference()
            fn()
        pairs = [(self._round_us(reference, reference_reps), self._round_us(fn, reps))
                 for _ in range(rounds)]
        self.torch.cuda.synchronize()
        references, times = np.array(pairs).T
        return (float(np.median(times)), float(np.median(references)),
                float(np.median(times / references)))

    def _round_us(self, fn, reps: int) -> float:
        """Wall time per call of ``reps`` calls of ``fn`` from an idle stream."""
        self.torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps * 1e6


def ceilings(torch, timer: GpuTimer) -> dict:
    """Write and copy bandwidth (GB/s), the empty-launch floor (us) and the
    floors of launches that chase dependent loads (``latency``), measured here."""
    import cupy

    from ..kinds import TORCH_CUDA
    from ..launch import stream_getter
    n = 1 << 28                                   # 1 GiB of int32
    a = torch.empty(n, dtype=torch.int32, device="cuda")
    b = torch.empty_like(a)
    write_us = timer.graph_us(lambda: a.fill_(-1), reps=5)
    copy_us = timer.graph_us(lambda: b.copy_(a), reps=5)
    empty = cupy.RawKernel('extern "C" __global__ void empty_kernel() {}', "empty_kernel").kernel
    stream = stream_getter(TORCH_CUDA, torch.cuda.current_device())

    def launch_empty():
        cupy.cuda.driver.launchKernel(empty.ptr, 1, 1, 1, 32, 1, 1, 0, stream(), 0, 0)
    floor_us = timer.graph_us(launch_empty)
    return {"write_GBps": 4 * n / write_us / 1e3, "copy_GBps": 2 * 4 * n / copy_us / 1e3,
            "empty_launch_us": floor_us,
            "dependent_loads_us": latency.dependent_load_floors(torch, timer)}


def gpu_rows(quick: bool, progress: bool) -> tuple[list[dict], dict]:
    import torch

    import dsv4_cupy as d4

    from .torch_eager import build_torch, c128a_torch
    try:
        import vllm  # noqa: F401
        vllm_note = "vLLM importable, but its DeepSeek-V4 kernels are not wired into this bench"
    except ImportError:
        vllm_note = "vLLM not importable: no vLLM column"
    timer = GpuTimer(torch)
    ceil = ceilings(torch, timer)
    dev = torch.device("cuda")
    d4.warmup()
    gd = torch.full((MAX_TOKENS, WIDTH), -1, dtype=torch.int32, device=dev)
    lens = torch.zeros(MAX_TOKENS, dtype=torch.int32, device=dev)
    pf = torch.full((MAX_TOKENS, WIDTH), -1, dtype=torch.int32, device=dev)
    req = torch.zeros(MAX_TOKENS, dtype=torch.int32, device=dev)
    csm = torch.full((MAX_TOKENS,), -1, dtype=torch.int64, device=dev)
    builder = d4.DeepseekV4MetadataBuilder(128, MAX_MODEL_LEN, MAX_TOKENS, like="torch")
    rows = []
    for i, (name, n_dec, q_dec, prefills) in enumerate(
            _progress(gpu_cases(quick), progress, "gpu cases")):
        s = make_step(n_dec, q_dec, prefills, seed=i)
        t = {k: torch.from_numpy(s[k]).to(dev) for k in ("qsl", "seq", "positions", "table", "slots")}
        T, nd = s["positions"].shape[0], s["nd"]
        t2r = torch.from_numpy(np.repeat(np.arange(len(s["seq"]), dtype=np.int32),
                                         np.diff(s["qsl"]))).to(dev)
        cm = d4.CommonAttentionMetadata(
            query_start_loc=t["qsl"], query_start_loc_cpu=torch.from_numpy(s["qsl"]),
            seq_lens=t["seq"], block_table_tensor=t["table"], slot_mapping=t["slots"],
            positions=t["positions"], num_reqs=len(s["seq"]), num_actual_tokens=T,
            max_query_len=s["max_q"], max_seq_len=s["max_seq"])

        def ours_c128a():
            d4.build_c128a_topk_metadata(t["positions"], 128, nd, t2r, t["table"], 2, t["slots"],
                                         gd, lens, pf, max_compressed_tokens=WIDTH)

        def eager_c128a():
            c128a_torch(t["positions"], 128, nd, t2r, t["table"], 2, t["slots"], WIDTH, gd, lens, pf)

        def ours_build():
            builder.build(0, cm)

        def eager_build():
            build_torch(t["qsl"], t["seq"], t["table"], t["positions"], t["slots"], T, nd, 128, 2,
                        WIDTH, req, csm, gd, lens, pf)

        written_mb = (T * WIDTH * 4 + nd * 4) / 1e6
        for op, ours, eager in (("c128a", ours_c128a, eager_c128a), ("build", ours_build, eager_build)):
            row = {"op": op, "case": name, "tokens": T, "W": WIDTH, "MB": written_mb}
            for who, fn in (("ours", ours), ("torch", eager)):
                row[f"{who}_event_us"] = timer.events_us(fn)
                row[f"{who}_graph_us"] = timer.graph_us(fn)
                row[f"{who}_host_us"] = timer.host_us(fn)
            row["ours_GBps"] = written_mb / row["ours_graph_us"] * 1e3
            row["write_ceiling_pct"] = 100 * row["ours_GBps"] / ceil["write_GBps"]
            row["x_torch_gpu"] = row["torch_graph_us"] / row["ours_graph_us"]
            row["x_torch_host"] = row["torch_host_us"] / row["ours_host_us"]
            rows.append(row)
    floor = launch_floor(torch)
    host, host_meta = host_rows(timer, torch, floor, make_step, MAX_MODEL_LEN, MAX_TOKENS)
    rows += host
    from .step import step_rows
    rows += step_rows(timer, torch, floor, make_step, MAX_MODEL_LEN, STEP_MAX_TOKENS)
    from .layers import layer_rows
    rows += layer_rows(quick, timer, ceil, floor,
                       lambda items: _progress(items, progress, "layer cases"))
    from .kv_cache import cache_rows
    rows += cache_rows(timer, ceil)
    meta = {"ceilings": ceil, "host": host_meta, "vllm": vllm_note, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name()}
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return rows, meta


def cpu_rows() -> list[dict]:
    """numba against NumPy, 16384 tokens (decodes and prefills) at W = 8192."""
    import dsv4_cupy as d4

    from .torch_eager import c128a_numpy
    s = make_step(4096, 2, [8192], seed=99)
    T, nd = s["positions"].shape[0], s["nd"]
    t2r = np.repeat(np.arange(len(s["seq"]), dtype=np.int32), np.diff(s["qsl"]))
    gd = np.empty((nd, WIDTH), np.int32)
    lens = np.empty(nd, np.int32)
    pf = np.empty((T - nd, WIDTH), np.int32)
    args = (s["positions"], 128, nd, t2r, s["table"], 2, s["slots"], WIDTH, gd, lens, pf)

    def best_of(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    # The public op on numpy arrays: the numba path as a caller gets it.
    numba_ms = best_of(lambda: d4.build_c128a_topk_metadata(
        s["positions"], 128, nd, t2r, s["table"], 2, s["slots"], gd, lens, pf,
        max_compressed_tokens=WIDTH))
    numpy_ms = best_of(lambda: c128a_numpy(*args))
    import numba
    return [{"op": "c128a cpu", "case": f"{T} tokens", "tokens": T, "W": WIDTH,
             "numba_ms": numba_ms, "numpy_ms": numpy_ms, "x_numpy": numpy_ms / numba_ms,
             "threads": numba.get_num_threads()}]


def print_table(rows: list[dict], meta: dict) -> None:
    if "ceilings" in meta:
        c = meta["ceilings"]
        print(f"\n{meta['gpu']}: write {c['write_GBps']:.0f} GB/s, copy {c['copy_GBps']:.0f} GB/s, "
              f"empty launch {c['empty_launch_us']:.2f} us; {meta['vllm']}")
        for mode, per_load in c.get("dependent_loads_us", {}).items():
            print(f"one launch, {mode}: " + ", ".join(
                f"{loads} dependent loads {us:.2f} us" for loads, us in enumerate(per_load)))
        print(f"{'op':6} {'case':16} {'T':>6} {'ours graph':>10} {'ours ev':>8} {'torch graph':>11} "
              f"{'x gpu':>6} {'ours host':>9} {'torch host':>10} {'x host':>6} {'GB/s':>6} {'%wr':>4}")
        for r in rows:
            if "torch_graph_us" not in r:
                continue
            print(f"{r['op']:6} {r['case']:16} {r['tokens']:6d} {r['ours_graph_us']:10.2f} "
                  f"{r['ours_event_us']:8.2f} {r['torch_graph_us']:11.2f} {r['x_torch_gpu']:6.1f} "
                  f"{r['ours_host_us']:9.1f} {r['torch_host_us']:10.1f} {r['x_torch_host']:6.1f} "
                  f"{r['ours_GBps']:6.0f} {r['write_ceiling_pct']:4.0f}")
    if "host" in meta:
        print_host_rows([r for r in rows if "x_floor" in r], meta["host"])
    step_rows = [r for r in rows if r.get("op") == "step"]
    if step_rows:
        print_step_rows(step_rows)
    print_layer_rows(rows)
    print_cache_rows(rows)
    for r in rows:
        if "numba_ms" in r:
            print(f"\nCPU c128a, {r['case']}, W={r['W']}, {r['threads']} threads: numba "
                  f"{r['numba_ms']:.1f} ms, NumPy {r['numpy_ms']:.1f} ms, {r['x_numpy']:.1f}x")


#: The plot's panels: (title, rows' op filter, our time, the other's time, its label).
PLOT_PANELS = (
    ("whole step: one launch vs vLLM's Triton/torch sequence",
     lambda r: r.get("op") == "step" and "upstream_graph_us" in r,
     "step_graph_us", "upstream_graph_us", "vLLM's sequence"),
    ("per-layer ops vs Triton ports of vLLM's kernels",
     lambda r: "triton_graph_us" in r and "ours_layer_graph_us" in r, "ours_layer_graph_us",
     "triton_graph_us", "vLLM Triton (port)"),
    ("fp8 cache ops vs Triton ports of vLLM 0.34's",
     lambda r: str(r.get("op", "")).startswith("kv_") and "triton_graph_us" in r,
     "ours_graph_us", "triton_graph_us", "vLLM Triton (port)"),
    ("C128A metadata vs torch eager", lambda r: r.get("op") == "build",
     "ours_graph_us", "torch_graph_us", "torch eager"),
)


def plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    panels = [(title, [r for r in rows if keep(r)], ours, theirs, label)
              for title, keep, ours, theirs, label in PLOT_PANELS]
    panels = [panel for panel in panels if panel[1]]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 5.5), squeeze=False)
    for ax, (title, sel, ours, theirs, label) in zip(axes[0], panels):
        x = np.arange(len(sel))
        ax.bar(x - 0.2, [r[ours] for r in sel], 0.4, label="dsv4_cupy")
        ax.bar(x + 0.2, [r[theirs] for r in sel], 0.4, label=label)
        names = [r["case"] if r["op"] in ("step", "build") else f"{r['op']} {r['case']}"
                 for r in sel]
        ax.set_xticks(x, names, rotation=70, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("GPU time per call, CUDA-graph replay (us)")
        ax.set_title(title, fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"bench: results go to {out.resolve() / 'bench.json'} (and bench.png with "
          f"matplotlib); --out changes the folder", file=sys.stderr)
    rows, meta = [], {}
    if not args.cpu_only:
        from ..device import require_gpu
        require_gpu()
        gpu, meta = gpu_rows(args.quick, not args.no_progress)
        rows += gpu
        print_table(gpu, meta)           # before the CPU case: a failure there keeps these
    print("bench: the CPU case (numba against NumPy, 16384 tokens at W = 8192; compiles "
          "the numba kernels on a first run)...", file=sys.stderr)
    cpu = cpu_rows()
    rows += cpu
    print_table(cpu, {})
    meta.update({"dsv4_cupy": __version__, "python": platform.python_version(),
                 "numpy": np.__version__, "date": time.strftime("%Y-%m-%d")})
    (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plotted = plot(rows, out / "bench.png")
    print(f"\nwrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if plotted else ""))
    return 0 if all(math.isfinite(v) for r in rows for v in r.values()
                    if isinstance(v, float)) else 1
