"""GPU-only behaviour of the per-layer and indexer ops: a CUDA-graph capture of
every op replays new values correctly (no sync, no allocation inside), and
calls with all outputs given allocate nothing."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4
from conftest import HAS_TORCH, to_kind, to_numpy

pytestmark = pytest.mark.gpu
I32, I64 = np.int32, np.int64
QUERY_LENS = [2, 2, 1, 40]             # three MTP decodes and a prefill, same shape every step
DECODE_TOKENS, DECODES = 5, 3
TOKENS = sum(QUERY_LENS) + 3           # three padding tokens
TOP_K, WINDOW = 512, 128


def step_inputs(seed):
    """One step's numpy inputs; every seed gives the same shapes."""
    rng = np.random.default_rng(seed)
    seq = np.array(QUERY_LENS) + rng.integers(200, 1900, len(QUERY_LENS))
    qsl = np.concatenate([[0], np.cumsum(QUERY_LENS)]).astype(I32)
    token_to_req = np.concatenate([np.repeat(np.arange(4), QUERY_LENS), [0] * 3]).astype(I32)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(QUERY_LENS, seq)]
                               + [np.zeros(3, int)]).astype(I64)
    return dict(qsl=qsl, seq=seq.astype(I32), token_to_req=token_to_req, positions=positions,
                valid=np.arange(TOKENS) < TOKENS - 3,
                swa_table=rng.integers(0, 1 << 20, (4, 40)).astype(I32),
                c4a_table=rng.integers(0, 1 << 20, (4, 10)).astype(I32),
                gather=np.zeros(1, I32))


class Step:
    """Device inputs and outputs at fixed addresses, and every op of a C4A layer step."""

    def __init__(self, kind, inputs):
        self.kind = kind
        self.inputs = {name: to_kind(value, kind) for name, value in inputs.items()}
        empty = lambda *shape: to_kind(np.full(shape, -7, I32), kind)
        self.outputs = dict(
            swa=(empty(DECODE_TOKENS, 1, WINDOW), empty(DECODE_TOKENS)),
            topk=empty(TOKENS, TOP_K), lens=empty(DECODE_TOKENS),
            combined=(empty(TOKENS - DECODE_TOKENS, 640), empty(TOKENS - DECODE_TOKENS)),
            prefill=(empty(2), empty(600), empty(40), empty(40)),
            decode=(empty(16), empty(DECODE_TOKENS), empty(DECODE_TOKENS),
                    empty(DECODE_TOKENS, 10)))

    def run(self):
        i, o = self.inputs, self.outputs
        d4.compute_swa_indices_and_lens(WINDOW, i["qsl"], i["seq"], i["token_to_req"], i["valid"],
                                        i["swa_table"], 64, 0, DECODE_TOKENS, out=o["swa"])
        d4.compute_prefill_gather_lens(i["qsl"], i["seq"], DECODES, 1, out=i["gather"])
        d4.fill_short_context_topk_indices(i["positions"], TOP_K, 4, out=o["topk"])
        d4.compute_global_topk_indices_and_lens(o["topk"][:DECODE_TOKENS], i["token_to_req"],
                                                i["c4a_table"], 64, i["valid"],
                                                out=(o["topk"], o["lens"]))
        d4.combine_topk_swa_indices(o["topk"][DECODE_TOKENS:], i["qsl"][DECODES:],
                                    i["seq"][DECODES:], i["gather"], WINDOW, 4, TOP_K, 700, 500,
                                    out=o["combined"])
        d4.build_indexer_prefill_chunk_metadata(i["qsl"][DECODES:], i["seq"][DECODES:], 4, 0, 40,
                                                num_compressed=600, out=o["prefill"])
        d4.build_indexer_decode_metadata(i["qsl"][:DECODES + 1], i["seq"], i["c4a_table"],
                                         DECODE_TOKENS, 4, out=o["decode"])

    def load(self, inputs):
        for name, value in inputs.items():
            self.inputs[name][...] = to_kind(value, self.kind)

    def results(self):
        flat = []
        for value in self.outputs.values():
            flat += list(value) if isinstance(value, tuple) else [value]
        return [to_numpy(x) for x in flat + [self.inputs["gather"]]]


def expected(inputs):
    step = Step("numpy", inputs)
    step.run()
    return step.results()


@pytest.mark.skipif(not HAS_TORCH, reason="torch not installed")
def test_torch_graph_capture_of_every_op_replays_new_values():
    import torch
    first, second = step_inputs(1), step_inputs(2)
    step = Step("torch_cuda", first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run()                              # compiles and loads outside the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    for inputs in (second, first):
        step.load(inputs)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(step.results(), expected(inputs)):
            np.testing.assert_array_equal(got, want)


def test_calls_with_every_output_given_allocate_nothing():
    import cupy
    step = Step("cupy", step_inputs(3))
    step.run()
    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    before = pool.used_bytes()
    for _ in range(3):
        step.run()
    assert pool.used_bytes() == before
    for got, want in zip(step.results(), expected(step_inputs(3))):
        np.testing.assert_array_equal(got, want)
