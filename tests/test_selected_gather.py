"""dequantize_and_gather_selected_kv against the full gather followed by the
index lookup (tests/reference.py's selected_gather over the reference's full
gather), on every array kind, with out, remapped and the caches poisoned."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4
import reference as ref
from conftest import GPU_KINDS, KINDS, to_kind, to_numpy
from helpers import capture_and_replay
from test_kv_cache import HEAD, I32, POISON_BF16, U16, gather_case, gather_reference

WINDOW = 128


def chunk(rng, seq_lens, ratio, width, clustered=False):
    """A prefill chunk's caches and combined indices: per token, top-k rows of
    its request's compressed rows (random, or runs of neighbours) and its SWA
    rows, then junk past lens; some entries outside the workspace."""
    block = 256 // ratio
    compressed_pages, compressed_table = gather_case(rng, [s // ratio for s in seq_lens], block)
    swa_pages, swa_table = gather_case(rng, seq_lens, 64)
    gather_lens = [min(s, WINDOW + int(q)) for s, q in zip(seq_lens,
                                                           rng.integers(1, 40, len(seq_lens)))]
    N = max(s // ratio for s in seq_lens)
    M = N + max(gather_lens)
    rows = []
    for b, seq in enumerate(seq_lens):
        for _ in range(int(rng.integers(1, 6))):
            compressed = max(seq // ratio, 1)
            if clustered:
                start = int(rng.integers(0, compressed))
                top = (start + np.arange(width // 2)) % compressed
            else:
                top = rng.integers(0, compressed, width // 2)
            window = N + rng.integers(0, gather_lens[b], width // 4)
            row = np.concatenate([b * M + top, b * M + window,
                                  rng.integers(-5, len(seq_lens) * M + 5, width - width // 2
                                               - width // 4)])
            rows.append(row)
    indices = np.array(rows, I32)
    lens = rng.integers(0, width + 1, len(rows)).astype(I32)
    return dict(compressed_pages=compressed_pages, compressed_table=compressed_table,
                swa_pages=swa_pages, swa_table=swa_table, seq_lens=np.array(seq_lens, I32),
                gather_lens=np.array(gather_lens, I32), N=N, M=M, ratio=ratio, indices=indices,
                lens=lens)


def full_workspace(case):
    out = np.full((len(case["seq_lens"]), case["M"], HEAD), POISON_BF16, U16)
    block = 256 // case["ratio"]
    out = gather_reference(out, case["compressed_pages"], case["seq_lens"], None,
                           case["compressed_table"], block, 0, case["ratio"])
    return gather_reference(out, case["swa_pages"], case["seq_lens"], case["gather_lens"],
                            case["swa_table"], 64, case["N"])


def selected(case, kind, out_rows, **extra):
    out = to_kind(np.full((out_rows, HEAD), POISON_BF16, U16), kind)
    remapped = to_kind(np.full(case["indices"].shape, -7, I32), kind)
    result = d4.dequantize_and_gather_selected_kv(
        out, remapped, to_kind(case["indices"], kind), to_kind(case["lens"], kind),
        to_kind(case["compressed_pages"], kind), to_kind(case["compressed_table"], kind),
        to_kind(case["swa_pages"], kind), to_kind(case["swa_table"], kind),
        to_kind(case["seq_lens"], kind), to_kind(case["gather_lens"], kind), case["ratio"],
        case["N"], case["M"], **extra)
    assert result[0] is out and result[1] is remapped
    return to_numpy(out), to_numpy(remapped), int(to_numpy(result[2])[0])


def expected(case, out_rows):
    rows, remapped, count = ref.selected_gather(full_workspace(case).tolist(),
                                                case["indices"].tolist(), case["lens"].tolist(),
                                                out_rows)
    out = np.full((out_rows, HEAD), POISON_BF16, U16)
    out[:len(rows)] = np.array(rows, U16).reshape(-1, HEAD)
    return out, np.array(remapped, I32).reshape(case["indices"].shape), count


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio, clustered", [(4, False), (4, True), (128, False)])
def test_equals_the_full_gather_then_the_lookup(kind, ratio, clustered):
    rng = np.random.default_rng(ratio + clustered)
    seq_lens = [700, 90, 1100] if ratio == 4 else [3000, 900, 260]
    case = chunk(rng, seq_lens, ratio, 48, clustered)
    want_out, want_remapped, want_count = expected(case, 600)
    got_out, got_remapped, got_count = selected(case, kind, 600)
    assert got_count == want_count
    np.testing.assert_array_equal(got_remapped, want_remapped)
    np.testing.assert_array_equal(got_out, want_out)      # unwritten rows: poison


@pytest.mark.parametrize("kind", KINDS)
def test_a_short_out_keeps_its_rows_and_counts_them_all(kind):
    rng = np.random.default_rng(3)
    case = chunk(rng, [500, 800], 4, 40)
    want_out, want_remapped, want_count = expected(case, 17)
    got_out, got_remapped, got_count = selected(case, kind, 17)
    assert got_count == want_count > 17
    np.testing.assert_array_equal(got_remapped, want_remapped)
    np.testing.assert_array_equal(got_out, want_out)


@pytest.mark.parametrize("kind", KINDS)
def test_nothing_named(kind):
    """No token, or every entry past lens or outside the workspace: nothing
    written but -1s and a count of 0."""
    rng = np.random.default_rng(4)
    case = chunk(rng, [300], 4, 16)
    case["lens"][:] = 0
    got_out, got_remapped, got_count = selected(case, kind, 8)
    assert got_count == 0 and (got_remapped == -1).all() and (got_out == POISON_BF16).all()
    case["lens"][:] = 16
    case["indices"][:] = case["M"] + 3
    assert selected(case, kind, 8)[2] == 0
    case["indices"], case["lens"] = case["indices"][:0], case["lens"][:0]
    assert selected(case, kind, 8)[2] == 0


@pytest.mark.parametrize("kind", GPU_KINDS)
@pytest.mark.gpu
def test_gpu_rows_equal_the_librarys_full_gather_row_for_row(kind):
    """The library's own full gather (one launch, both caches) and the lookup
    give the selected rows (a larger chunk than the reference can take)."""
    rng = np.random.default_rng(9)
    case = chunk(rng, [40_000, 9_000, 25_000, 3], 4, 640, clustered=False)
    full = to_kind(np.full((4, case["M"], HEAD), POISON_BF16, U16), kind)
    d4.dequantize_and_gather_prefill_kv(
        full, to_kind(case["compressed_pages"], kind), to_kind(case["compressed_table"], kind),
        to_kind(case["swa_pages"], kind), to_kind(case["swa_table"], kind),
        to_kind(case["seq_lens"], kind), to_kind(case["gather_lens"], kind), 4, case["N"])
    full = to_numpy(full).reshape(-1, HEAD)
    out, remapped, count = selected(case, kind, case["indices"].size)
    valid = np.arange(case["indices"].shape[1])[None, :] < case["lens"][:, None]
    valid &= (case["indices"] >= 0) & (case["indices"] < full.shape[0])
    assert ((remapped >= 0) == valid).all()
    np.testing.assert_array_equal(out[remapped[valid]], full[case["indices"][valid]])
    assert count == len(np.unique(case["indices"][valid]))
    assert (out[count:] == POISON_BF16).all()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_is_refused_before_any_write(kind):
    rng = np.random.default_rng(5)
    case = chunk(rng, [300, 200], 4, 16)
    out = to_kind(np.full((64, HEAD), POISON_BF16, U16), kind)
    remapped = to_kind(np.full(case["indices"].shape, -7, I32), kind)
    arrays = [to_kind(case[name], kind) for name in (
        "indices", "lens", "compressed_pages", "compressed_table", "swa_pages", "swa_table",
        "seq_lens", "gather_lens")]

    def call(**change):
        args = dict(out=out, remapped_indices=remapped, combined_indices=arrays[0],
                    combined_lens=arrays[1], compressed_k_cache=arrays[2],
                    compressed_block_table=arrays[3], swa_k_cache=arrays[4],
                    swa_block_table=arrays[5], seq_lens=arrays[6], gather_lens=arrays[7],
                    compress_ratio=4, N=case["N"], M=case["M"])
        args.update(change)
        return d4.dequantize_and_gather_selected_kv(**args)

    small = to_kind(np.zeros(3, I32), kind)
    for change, message in (
            (dict(out=to_kind(np.zeros((64, HEAD), I32), kind)), "out: expected a bf16"),
            (dict(remapped_indices=to_kind(np.zeros((1, 16), I32), kind)), "remapped_indices"),
            (dict(combined_lens=to_kind(np.zeros(1, I32), kind)), "combined_lens"),
            (dict(N=case["M"] + 1), rf"N: expected at most M \({case['M']}\), a request's "
                                    rf"workspace rows, got {case['M'] + 1}$"),
            (dict(M=2**31 // 2), "M"),
            (dict(scratch=small), "scratch"),
            *([(dict(scratch=to_kind(np.zeros(4096, I32), kind)[1:]), "aligned")]
              if kind in GPU_KINDS else []),
            (dict(remapped_indices=arrays[0]), "remapped_indices")):
        with pytest.raises((TypeError, ValueError), match=message):
            call(**change)
    assert (to_numpy(out) == POISON_BF16).all() and (to_numpy(remapped) == -7).all()


@pytest.mark.gpu
def test_a_captured_selected_gather_replays_new_indices():
    import cupy
    rng = np.random.default_rng(12)
    case = chunk(rng, [900, 400], 4, 32)
    num_reqs, M = 2, case["M"]
    arrays = {name: cupy.asarray(case[name]) for name in (
        "indices", "lens", "compressed_pages", "compressed_table", "swa_pages", "swa_table",
        "seq_lens", "gather_lens")}
    out = cupy.full((300, HEAD), POISON_BF16, U16)
    remapped = cupy.full(case["indices"].shape, -7, I32)
    count = cupy.zeros(1, I32)
    scratch = cupy.zeros(d4.selected_gather_scratch_len(num_reqs, M, 300), I32)

    def call():
        d4.dequantize_and_gather_selected_kv(
            out, remapped, arrays["indices"], arrays["lens"], arrays["compressed_pages"],
            arrays["compressed_table"], arrays["swa_pages"], arrays["swa_table"],
            arrays["seq_lens"], arrays["gather_lens"], 4, case["N"], M, num_selected=count,
            scratch=scratch)
    fresh = rng.integers(-3, num_reqs * M + 3, case["indices"].shape).astype(I32)
    capture_and_replay("cupy", call, [arrays["indices"]], [fresh],
                       [(out, np.full((300, HEAD), POISON_BF16, U16))])
    case["indices"] = fresh
    want_out, want_remapped, want_count = expected(case, 300)
    np.testing.assert_array_equal(remapped.get(), want_remapped)
    assert int(count.get()[0]) == want_count
    np.testing.assert_array_equal(out.get(), want_out)
