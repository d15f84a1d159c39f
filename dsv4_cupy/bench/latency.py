"""The least GPU time one launch can take at decode sizes, measured here.

A kernel that only follows a chain of dependent loads (each from a new L2
line, as an op's inputs are in graph replay) and then stores once, launched
plainly and programmatically (with the library's prologue), timed as the ops
are: CUDA-graph replay, 20 calls back to back. An op that must read its
inputs in n rounds, each round's addresses coming from the one before, cannot
finish one launch in less time than this kernel with n loads. Where half a
port's time is below that, 2x the port is out of reach for any single launch.
"""
from __future__ import annotations

import numpy as np

from .. import loader
from ..kinds import TORCH_CUDA
from ..launch import (
    cu_launch_kernel_ex,
    launch_config,
    programmatic_launch_supported,
    stream_getter,
)

#: The longest chain timed.
MAX_LOADS = 3
#: Rounds of dependent loads between an op's launch and its stores on decode
#: rows: SWA rows read the token's request and validity and, in the same round,
#: a guessed request's layout, then the block table at the token's position;
#: global top-k rows read their entries and the token's request, then the
#: block table at each entry's block; short-context rows read the position.
DEPENDENT_LOADS = {"swa": 2, "global_topk": 2, "short_fill": 1}
#: Decode batches up to this many tokens are where launch and latency dominate.
DECODE_TOKENS = 64

_CHAIN = r'''
#line 1 "dsv4_cupy/bench/latency.py"
struct LoadChain {
    const int* next;   // [MAX_LOADS * 32] int32: next[32 i] = 32 (i + 1), a line per load
    int* out;          // [32] int32
    int loads;
};

extern "C" __global__ void dependent_loads(const LoadChain chain) {
    await_earlier_grids();
    int at = 0;
    for (int i = 0; i < chain.loads; ++i) at = chain.next[at];
    chain.out[threadIdx.x] = at;
}

struct Writes {
    int4* out;         // [vectors] 16-byte vectors
    long long vectors;
};

// Only the stores of a launch: its grid writes `vectors` vectors, grid-stride,
// with the streaming stores the library's row fills use.
extern "C" __global__ void only_writes(const Writes w) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < w.vectors; i += stride)
        __stcs(w.out + i, make_int4(-1, -1, -1, -1));
}
'''
_LOAD_CHAIN = np.dtype({"names": ["next", "out", "loads"], "formats": ["<u8", "<u8", "<i4"],
                        "offsets": [0, 8, 16], "itemsize": 24})
_WRITES = np.dtype({"names": ["out", "vectors"], "formats": ["<u8", "<i8"],
                    "offsets": [0, 8], "itemsize": 16})
_LANES = 32
_VECTOR_BYTES = 16


def source() -> str:
    """The chain kernel with the library's common header (its launch prologue)."""
    return loader.file_source("common.cuh") + _CHAIN


def _kernel(name: str):
    """An entry point of ``source()``, compiled for the current device (the
    Function object holds its module loaded while it lives)."""
    import cupy
    return cupy.RawModule(code=source(), options=loader.options()).get_function(name).kernel


def dependent_load_floors(torch, timer, rounds: int = 3) -> dict:
    """``{"plain": [us], "programmatic": [us]}``: GPU time per launch of the
    chain with 0..MAX_LOADS loads (index = loads), the median of ``rounds``
    interleaved rounds; "programmatic" only where the device and driver have it."""
    import cupy

    device = torch.cuda.current_device()
    kernel = _kernel("dependent_loads")
    function = kernel.ptr
    lines = torch.zeros(MAX_LOADS * _LANES, dtype=torch.int32, device="cuda")
    lines[::_LANES] = torch.arange(1, MAX_LOADS + 1, dtype=torch.int32, device="cuda") * _LANES
    out = torch.zeros(_LANES, dtype=torch.int32, device="cuda")
    chains = np.zeros(MAX_LOADS + 1, _LOAD_CHAIN)
    chains["next"], chains["out"], chains["loads"] = (lines.data_ptr(), out.data_ptr(),
                                                       np.arange(MAX_LOADS + 1))
    # void* kernelParams[1] of each chain: the address of its struct.
    params = [np.array([chains.ctypes.data + i * _LOAD_CHAIN.itemsize], np.uint64)
              for i in range(MAX_LOADS + 1)]
    stream = stream_getter(TORCH_CUDA, device)
    driver = cupy.cuda.driver
    configs = {}                                  # stream -> its programmatic launch config

    def plain(loads: int) -> None:
        driver.launchKernel(function, 1, 1, 1, _LANES, 1, 1, 0, stream(),
                            params[loads].ctypes.data, 0)

    def programmatic(loads: int) -> None:
        s = stream()
        if s not in configs:
            configs[s] = launch_config(1, _LANES, s)
        status = cu_launch_kernel_ex()(configs[s].ctypes.data, function,
                                              params[loads].ctypes.data, None)
        if status != 0:
            raise driver.CUDADriverError(status)

    launches = {"plain": plain}
    if programmatic_launch_supported(device):
        launches["programmatic"] = programmatic
    times = {mode: [[] for _ in range(MAX_LOADS + 1)] for mode in launches}
    for _ in range(rounds):
        for loads in range(MAX_LOADS + 1):
            for mode, launch in launches.items():
                times[mode][loads].append(timer.graph_us(lambda: launch(loads)))
    torch.cuda.synchronize()
    if int(out[0]) != MAX_LOADS * _LANES:        # the last graph replayed the longest chain
        raise RuntimeError(f"the load chain ended at {int(out[0])}, not {MAX_LOADS * _LANES}")
    return {mode: [float(np.median(t)) for t in per_load] for mode, per_load in times.items()}


def write_floor_us(torch, timer, nbytes: int, blocks: int, threads: int) -> float:
    """GPU time of one plain launch of ``blocks`` blocks of ``threads`` that
    only writes ``nbytes`` (rounded up to 16-byte vectors) and reads nothing,
    timed as ``dependent_load_floors``: what storing a launch's output costs
    with no load ahead of the stores."""
    import cupy

    kernel = _kernel("only_writes")
    vectors = -(-nbytes // _VECTOR_BYTES)
    out = torch.empty(max(vectors, 1) * _VECTOR_BYTES, dtype=torch.uint8, device="cuda")
    struct = np.zeros(1, _WRITES)
    struct["out"], struct["vectors"] = out.data_ptr(), vectors
    params = np.array([struct.ctypes.data], np.uint64)     # void* kernelParams[1]
    stream = stream_getter(TORCH_CUDA, torch.cuda.current_device())
    launch = cupy.cuda.driver.launchKernel
    us = timer.graph_us(lambda: launch(kernel.ptr, blocks, 1, 1, threads, 1, 1, 0, stream(),
                                       params.ctypes.data, 0))
    torch.cuda.synchronize()
    if vectors and int(out[-1]) != 0xFF:
        raise RuntimeError("the write floor's kernel did not write its last vector")
    return us


def decode_tokens(op: str, params: dict) -> int | None:
    """Tokens of a layer case made of decode rows only (None for any other)."""
    if op not in DEPENDENT_LOADS or params.get("prefill"):
        return None
    return params.get("tokens", params.get("decodes", 0) * params.get("query_len", 1))


def least_launch_us(floors: dict, loads: int) -> float:
    """The least time of one launch with ``loads`` rounds, either way of launching."""
    return min(per_load[loads] for per_load in floors.values())
