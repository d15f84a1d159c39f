"""Fuzzing the per-layer and indexer ops: hundreds of random cases per function
against the reference on the CPU path (CI), and the GPU kinds against the CPU
path (on the H200), on the random cases and on full-size DeepSeek-V4 shapes."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4
from dsv4_cupy import combine, families, global_topk, short_context, swa

from conftest import GPU_KINDS, to_kind, to_numpy
from helpers import (random_combine_case, random_global_topk_case, random_indexer_prefill_case,
                     random_swa_case, run_combine, run_gather_lens, run_global_topk,
                     run_indexer_decode, run_indexer_prefill, run_short_context, run_swa)

CASES_PER_FUNCTION = 300
I32 = np.int32


def random_short_context_case(rng):
    positions = rng.integers(-10, 5000, int(rng.integers(0, 10))).tolist()
    return (positions, int(rng.integers(0, 700)), int(rng.choice([1, 4, 128])),
            int(rng.integers(0, len(positions) + 1)), rng.choice([np.int32, np.int64]))


def random_gather_case(rng):
    count = int(rng.integers(0, 8))
    query_lens = rng.integers(0, 300, count)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(int).tolist()
    seq = (query_lens + rng.integers(-5, 500, count)).clip(0).tolist()
    decodes = int(rng.integers(0, count + 1))
    return (qsl, seq, decodes, int(rng.integers(0, count - decodes + 1)),
            int(rng.choice([1, 64, 128])))


def random_indexer_decode_case(rng):
    query_lens = rng.integers(0, 9, int(rng.integers(0, 8)))
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(int).tolist()
    seq = (query_lens + rng.integers(-3, 9000, len(query_lens))).clip(0).tolist()
    table = rng.integers(-1, 1 << 20, (len(query_lens), int(rng.integers(0, 40)))).astype(I32)
    return qsl, seq, table, qsl[-1] + int(rng.integers(0, 20)), int(rng.choice([1, 4, 128]))


#: (runner, case generator) per function.
FUNCTIONS = {
    "swa": (run_swa, random_swa_case),
    "global_topk": (run_global_topk, random_global_topk_case),
    "short_context": (lambda kind, *case, reference=True: run_short_context(
        kind, *case[:4], dtype=case[4], reference=reference), random_short_context_case),
    "combine": (run_combine, random_combine_case),
    "gather_lens": (run_gather_lens, random_gather_case),
    "indexer_prefill": (run_indexer_prefill, random_indexer_prefill_case),
    "indexer_decode": (run_indexer_decode, random_indexer_decode_case),
}


@pytest.mark.slow
@pytest.mark.parametrize("function", FUNCTIONS)
def test_fuzz_cpu_against_reference(function):
    run, make_case = FUNCTIONS[function]
    rng = np.random.default_rng(sorted(FUNCTIONS).index(function))
    for _ in range(CASES_PER_FUNCTION):
        run("numpy", *make_case(rng))


def assert_same_results(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(to_numpy(g), to_numpy(w))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("function", FUNCTIONS)
def test_fuzz_gpu_against_cpu(kind, function):
    """GPU against the CPU path (itself fuzzed against the reference above); one
    case in twenty also goes through the reference directly."""
    run, make_case = FUNCTIONS[function]
    rng = np.random.default_rng(100 + sorted(FUNCTIONS).index(function))
    for i in range(CASES_PER_FUNCTION):
        case = make_case(rng)
        got = run(kind, *case, reference=i % 20 == 0)
        got = got if isinstance(got, (tuple, list)) else [got]
        want = run("numpy", *case, reference=False)
        assert_same_results(got, want if isinstance(want, (tuple, list)) else [want])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_full_size_shapes_gpu_against_cpu(kind):
    """DeepSeek-V4 shapes: 8192-token SWA rows, 1024 decode rows of 512 (and a
    1024-wide Pro row), the 8192 x 8320 C128A combine, 4096-column block rows."""
    rng = np.random.default_rng(77)
    tokens = 8192
    query_lens = [4] * 256 + [tokens - 1024]
    seq = (np.array(query_lens) + rng.integers(0, 1 << 20, len(query_lens))).tolist()
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    token_to_req = np.repeat(np.arange(len(query_lens)), query_lens).tolist()
    valid = (rng.random(tokens) < 0.99).tolist()
    swa_table = rng.integers(0, 1 << 22, (len(query_lens), (1 << 20) // 64 + 2)).astype(I32)
    cases = [
        (run_swa, (128, qsl, seq, token_to_req, valid, swa_table, 64, 0, 1024)),
        (run_swa, (128, qsl, seq, token_to_req, valid, swa_table, 64, 1024, tokens - 1024)),
    ]
    for width in (512, 1024):
        topk = rng.integers(-1, (1 << 20) // 4, (1024, width)).astype(I32)
        table = rng.integers(0, 1 << 22, (256, (1 << 20) // 256)).astype(I32)
        cases.append((run_global_topk, (topk, token_to_req[:1024], table, 64, valid[:1024],
                                        bool(width == 1024))))
    positions = rng.integers(0, 1 << 20, tokens)
    cases.append((run_short_context, (positions.tolist(), 512, 4)))
    prefill_seq = seq[-1]
    local = d4.fill_short_context_topk_indices(np.arange(prefill_seq - 7168, prefill_seq), 8192,
                                               128)                  # the C128A prefill rows
    cases.append((run_combine, (local, [1024, tokens], [prefill_seq],
                                [7168 + 127], 128, 128, 8192, 8192 + 7168 + 127, 8192)))
    cases.append((run_indexer_decode, (qsl[:257], seq[:256], swa_table[:256, :4096], 1100, 4)))
    cases.append((run_indexer_prefill, (qsl[256:], seq[256:], 4, 0, tokens - 1024)))
    for run, case in cases:
        got, want = run(kind, *case, reference=False), run("numpy", *case, reference=False)
        assert_same_results(got if isinstance(got, (tuple, list)) else [got],
                            want if isinstance(want, (tuple, list)) else [want])


def kernel_dispatchers():
    """Every numba dispatcher of families.CPU_KERNELS (both twins of parallel kernels)."""
    from dsv4_cupy import cpu
    found = []
    for kernel in families.CPU_KERNELS:
        found += kernel.variants() if isinstance(kernel, cpu.ParallelKernel) else [kernel]
    return found


def test_nothing_compiles_after_warmup():
    from conftest import HOST_KINDS
    d4.warmup(gpu=False, cpu=True)
    before = [len(f.signatures) for f in kernel_dispatchers()]
    assert all(before)
    rng = np.random.default_rng(5)
    for kind in HOST_KINDS:
        for run, make_case in FUNCTIONS.values():
            run(kind, *make_case(rng), reference=False)
    assert [len(f.signatures) for f in kernel_dispatchers()] == before


def variants_launched(monkeypatch, family):
    """The variants (entry points) of ``family`` that ops launch from now on."""
    from dsv4_cupy.launch import Launch
    seen = []
    prepare = Launch.prepare

    def spy(launch, device):
        if launch.family is family:
            seen.append(family.variant_key(launch.variant))
        return prepare(launch, device)

    monkeypatch.setattr(Launch, "prepare", spy)
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_swa_window_compiled_in_up_to_the_32_bit_span(kind, monkeypatch):
    """W = 128 takes the compiled-in kernel (32-bit positions, clamped) while a
    table row's span plus W stays under geometry.POSITION_LIMIT, the run-time
    kernel past it; both agree with the CPU path and the reference on positions
    around the span, the limit and int32's end."""
    from dsv4_cupy import geometry
    seen = variants_launched(monkeypatch, swa.FAMILY)
    block_size = 1 << 23
    limit = geometry.POSITION_LIMIT
    rng = np.random.default_rng(3)
    for cols, window_kernel in ((limit // block_size - 1, 128), (limit // block_size, 0)):
        span = cols * block_size
        seq = [span - 5, span + 3, span + 130, limit - 1, limit, limit + 5, 2**31 - 1, 5, 130,
               limit - 129, span - 128]
        qsl = list(range(len(seq) + 1))
        table = rng.integers(-1, 1 << 20, (len(seq), cols)).astype(I32)
        case = (128, qsl, seq, list(range(len(seq))), [True] * len(seq), table, block_size)
        seen.clear()
        got = run_swa(kind, *case)
        assert set(seen) == {(window_kernel, 0, 128, 128)}
        assert_same_results(got, run_swa("numpy", *case, reference=False))
        assert to_numpy(got[1]).max() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_swa_row_lanes_against_cpu(kind, monkeypatch):
    """The SWA rows at each lane count (four warps, a column each, for rows up
    to the SM count; a warp of 16-byte vectors after), W and block size compiled
    in or not, with padding tokens, bad requests, negative positions and -1
    table entries, against the CPU path and the reference."""
    from dsv4_cupy import device
    seen = variants_launched(monkeypatch, swa.FAMILY)
    rng = np.random.default_rng(21)
    sms = device.sm_count(0)
    for rows in (1, sms, sms + 1, 700):
        for window, block_size in ((128, 64), (128, 16), (96, 64), (300, 64)):
            requests = int(rng.integers(1, 9))
            reqs = rng.integers(-1, requests + 1, rows).tolist()
            qsl = np.sort(rng.integers(0, rows + 1, requests + 1)).tolist()
            seq = rng.integers(-3, 4000, requests).tolist()
            valid = (rng.random(rows) < 0.9).tolist()
            table = rng.integers(-1, 1 << 20, (requests, 70)).astype(I32)
            case = (window, qsl, seq, reqs, valid, table, block_size)
            got = run_swa(kind, *case, reference=rows <= sms + 1)
            assert_same_results(got, run_swa("numpy", *case, reference=False))
    assert {v[2] for v in seen} == {32, 128}
    assert {v[:2] for v in seen} == {(128, 64), (128, 0), (0, 64)}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_swa_rows_guessing_the_token_s_request(kind, monkeypatch):
    """An SWA row reads a guessed request's layout (t >> guess_shift) beside
    token t's request and reads its own request's after only when they differ:
    queries of 1, 2, 3 and 4 tokens (guessed right for 1, 2 and 4), a token
    offset, fewer table rows than requests (the guess clamped), bad requests
    and padding, at each lane count, against the CPU path and the reference."""
    from dsv4_cupy import device
    seen = variants_launched(monkeypatch, swa.FAMILY)
    rng = np.random.default_rng(33)
    for rows in (1, 64, device.sm_count(0) + 1):
        for query_len, offset, missing_table_rows in ((1, 0, 0), (1, 3, 0), (1, 0, 2),
                                                      (2, 0, 0), (2, 2, 1), (3, 5, 1),
                                                      (4, 0, 0)):
            tokens = offset + rows
            requests = -(-tokens // query_len)
            qsl = [min(r * query_len, tokens) for r in range(requests + 1)]
            reqs = np.arange(tokens) // query_len
            bad = rng.random(tokens) < 0.05
            reqs[bad] = rng.choice([-1, requests, requests + 5], int(bad.sum()))
            seq = (rng.integers(0, 4000, requests) + query_len).tolist()
            valid = (rng.random(tokens) < 0.95).tolist()
            table = rng.integers(-1, 1 << 20, (max(requests - missing_table_rows, 0), 70))
            case = (128, qsl, seq, reqs.tolist(), valid, table.astype(I32), 64)
            got = run_swa(kind, *case, token_offset=offset)
            assert_same_results(got, run_swa("numpy", *case, token_offset=offset,
                                             reference=False))
    assert {v[2] for v in seen} == {32, 128}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_each_compiled_width_and_row_lanes_against_cpu(kind, monkeypatch):
    """The global top-k at K = 512 and 1024 and block size 64 (compiled in, for
    rows of 16-byte vectors; blocks of 128 and 256 threads) and others,
    compacted (their own kernel), the short-context rows at each lane count
    (four warps for rows up to the SM count, a warp after), width and ratio:
    every variant the ops pick, against the CPU path and the reference."""
    from dsv4_cupy import device
    rng = np.random.default_rng(11)
    topk_seen = variants_launched(monkeypatch, global_topk.FAMILY)
    compact_seen = variants_launched(monkeypatch, global_topk.COMPACT_FAMILY)
    for width in (512, 1024, 513, 4, 1):
        for rows, block_size in ((1, 64), (40, 64), (40, 3)):
            for compact in (False, True):
                topk = rng.integers(-1, 3000, (rows, width)).astype(I32)
                table = rng.integers(-1, 1 << 20, (8, 40)).astype(I32)
                reqs = rng.integers(-1, 9, rows).tolist()
                valid = (rng.random(rows) < 0.9).tolist()
                args = (topk, reqs, table, block_size, valid, compact)
                assert_same_results(run_global_topk(kind, *args, reference=rows == 1, pad=4),
                                    run_global_topk("numpy", *args, reference=False))
    assert set(topk_seen) == {(k, b, threads) for k, threads in ((512, 128), (1024, 256),
                                                                 (0, 256)) for b in (64, 0)}
    assert set(compact_seen) == {()}
    # K = 512 in rows that are not 16-byte aligned: the run-time kernel.
    topk_seen.clear()
    wide = rng.integers(-1, 3000, (40, 514)).astype(I32)
    table = rng.integers(-1, 1 << 20, (8, 40)).astype(I32)
    reqs, valid = rng.integers(-1, 9, 40).tolist(), (rng.random(40) < 0.9).tolist()
    got = d4.compute_global_topk_indices_and_lens(to_kind(wide, kind)[:, 1:513], to_kind(
        np.asarray(reqs, I32), kind), to_kind(table, kind), 64, to_kind(np.asarray(valid), kind))
    want = d4.compute_global_topk_indices_and_lens(wide[:, 1:513], np.asarray(reqs, I32), table,
                                                   64, np.asarray(valid))
    assert_same_results(got, want)
    assert set(topk_seen) == {(0, 64, 256)}
    short_seen = variants_launched(monkeypatch, short_context.FAMILY)
    sms = device.sm_count(0)
    for rows in (1, sms, sms + 1, 700):
        for top_k in (512, 1024, 100):
            for dtype, ratio in ((np.int32, 4), (np.int64, 4), (np.int64, 3)):
                positions = rng.integers(-10, 5000, rows).tolist()
                case = (positions, top_k, ratio)
                got = run_short_context(kind, *case, dtype=dtype, reference=rows == 1)
                np.testing.assert_array_equal(got, run_short_context("numpy", *case, dtype=dtype,
                                                                     reference=False))
    # A warp's rows share a block of 256 threads; four warps' rows have a block each.
    assert {(v[1], v[4]) for v in short_seen} == {(32, 256), (128, 128)}
    assert {v[2:4] for v in short_seen} == {(k, r) for k in (512, 1024, 0) for r in (4, 0)}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("requests", [31, 32, 33, 100, 1000])
def test_combine_of_many_requests_against_cpu(kind, requests):
    """Chunks of many requests (each row's request found by binary search), with
    empty requests and a query layout not starting at 0, against the CPU path
    and the reference."""
    rng = np.random.default_rng(requests)
    query_lens = rng.integers(0, 5, requests) * (rng.random(requests) < 0.8)
    seq = (query_lens + rng.integers(0, 600, requests)).tolist()
    qsl = (17 + np.concatenate([[0], np.cumsum(query_lens)])).tolist()
    gather = [q + min(max(s - q, 0), 127) for q, s in zip(query_lens.tolist(), seq)]
    tokens = int(query_lens.sum()) + 3
    for topk, ratio in ((0, 0), (40, 4)):
        local = rng.integers(-1, 160, (tokens, topk)).astype(I32)
        case = (local, qsl, seq, gather, 128, ratio, topk, 160 + max(gather) + 1, 160)
        got = run_combine(kind, *case, reference=requests <= 100)
        assert_same_results(got, run_combine("numpy", *case, reference=False))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.parametrize("requests", [1, 3])
def test_each_compiled_combined_width_against_cpu(kind, requests, monkeypatch):
    """The combine's compiled-in widths and window (SWA-only rows, C = W = 128,
    with no top-k part; the C4A rows of K = 512 and 1024) and the run-time
    kernel, a block per row for wide rows (C128A's), for a chunk of one request
    (no search) and of several, with padding rows and a query layout not
    starting at 0, against the CPU path and the reference."""
    seen = variants_launched(monkeypatch, combine.FAMILY)
    rng = np.random.default_rng(40 + requests)
    query_lens = rng.integers(1, 40, requests)
    seq = (query_lens + rng.integers(0, 3000, requests)).tolist()
    qsl = (9 + np.concatenate([[0], np.cumsum(query_lens)])).tolist()
    tokens = int(query_lens.sum()) + 5
    expected = {}
    for topk, window, ratio in ((0, 128, 0), (512, 128, 4), (1024, 128, 4), (0, 64, 1),
                                (40, 128, 4), (8192, 128, 128)):
        gather = [q + min(max(s - q, 0), window - 1) for q, s in zip(query_lens.tolist(), seq)]
        n = max(seq) // max(ratio, 1)
        local = rng.integers(-1, n + 3, (tokens, topk)).astype(I32)
        case = (local, qsl, seq, gather, window, ratio, topk, n + max(gather), n)
        seen.clear()
        got = run_combine(kind, *case, reference=True)
        assert_same_results(got, run_combine("numpy", *case, reference=False))
        expected[(topk, window)] = set(seen)
    assert expected == {(0, 128): {(128, 128, 32)}, (512, 128): {(640, 128, 32)},
                        (1024, 128): {(1152, 128, 32)}, (0, 64): {(128, 0, 32)},
                        (40, 128): {(0, 128, 32)}, (8192, 128): {(0, 128, 256)}}
