"""The benchmark's plumbing without a GPU: the CPU case runs end to end, and
every per-layer case prepares and runs on small shapes (torch CPU tensors,
the library's numba path; the Triton ports need a GPU)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dsv4_cupy.bench import layers

SMALL = {"swa": [dict(decodes=6, query_len=2), dict(decodes=0, prefill=40)],
         "global_topk": [dict(tokens=5, width=300)], "short_fill": [dict(tokens=7, top_k=64)],
         "combine": [dict(tokens=20, topk=layers.C128A_WIDTH), dict(tokens=20, topk=64),
                     dict(tokens=20, topk=0)],
         "c4a_layer": [dict(decodes=4, prefill=30)], "c128a_combined": [dict(tokens=20, topk=256)],
         "gather_lens": [dict(prefills=5)], "indexer_prefill": [dict(tokens=30)],
         "indexer_decode": [dict(tokens=9)]}


def test_cpu_only_bench_runs(tmp_path):
    run = subprocess.run([sys.executable, "-m", "dsv4_cupy", "bench", "--cpu-only",
                          "--no-progress", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "CPU c128a, 16384 tokens" in run.stdout and (tmp_path / "bench.json").exists()


def test_every_layer_case_prepares_and_runs_on_small_shapes(monkeypatch):
    torch = pytest.importorskip("torch")
    import numpy as np
    monkeypatch.setattr(layers, "MAX_MODEL_LEN", 1 << 14)
    assert {op for op, _, _ in layers.layer_cases(False)} == set(SMALL)
    rng = np.random.default_rng(0)
    for op, cases in SMALL.items():
        for params in cases:
            ours, port, ours_out, _, written_mb = layers._prepare(op, params, torch,
                                                                  torch.device("cpu"), rng, None)
            ours()
            assert port is None and written_mb > 0
            assert any((out != -1).any() for out in ours_out), (op, params)   # it wrote
