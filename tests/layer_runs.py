"""Run one per-layer or indexer op on one array kind with poisoned persistent
buffers (longer and wider than needed), check that only the result region was
written and that a call without buffers agrees, and compare with
tests/reference_upstream.py (``reference=False`` skips that, for GPU-against-CPU
runs on shapes too large for the plain-Python reference)."""
from __future__ import annotations

import numpy as np

import dsv4_cupy as d4
import reference_upstream as upstream
from batches import POISON
from conftest import to_kind, to_numpy

I32, I64 = np.int32, np.int64
EXTRA_ROWS, EXTRA_COLS = 3, 5


def poisoned(shape, dtype=I32):
    return np.full(shape, POISON, dtype)


def strided(table, kind, pad=EXTRA_COLS):
    """A 2-D array of ``kind`` whose row stride exceeds its width (a column slice)."""
    table = np.asarray(table, I32)
    rows, cols = table.shape if table.ndim == 2 else (0, 0)
    wide = np.full((rows, cols + pad), -99, I32)
    wide[:, :cols] = table
    return to_kind(wide, kind)[:, :cols]


def assert_poison_past(buffer, rows, cols=None):
    """Rows at or past ``rows`` and (2-D) columns at or past ``cols`` were not written."""
    buffer = to_numpy(buffer)
    assert (buffer[rows:] == POISON).all(), "wrote past the result rows"
    if cols is not None:
        assert (buffer[..., cols:] == POISON).all(), "wrote past the result columns"


def same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(to_numpy(g), to_numpy(w))


# --- §2 SWA ----------------------------------------------------------------------------------
def run_swa(kind, window, qsl, seq_lens, token_to_req, is_valid, table, block_size,
            token_offset=0, num_rows=None, reference=True):
    rows = len(token_to_req) - token_offset if num_rows is None else num_rows
    args = (window, to_kind(np.array(qsl, I32), kind), to_kind(np.array(seq_lens, I32), kind),
            to_kind(np.array(token_to_req, I32), kind), to_kind(np.array(is_valid, bool), kind),
            strided(table, kind), block_size, token_offset, num_rows)
    indices = to_kind(poisoned((rows + EXTRA_ROWS, 1, window + EXTRA_COLS)), kind)
    lens = to_kind(poisoned(rows + EXTRA_ROWS), kind)
    got = d4.compute_swa_indices_and_lens(*args, out=(indices, lens))
    assert tuple(got[0].shape) == (rows, 1, window) and tuple(got[1].shape) == (rows,)
    assert_poison_past(indices, rows, window)
    assert_poison_past(lens, rows)
    same(d4.compute_swa_indices_and_lens(*args), got)
    got = to_numpy(got[0])[:, 0], to_numpy(got[1])
    if reference:
        want = upstream.swa_indices_and_lens(window, list(qsl), list(seq_lens), list(token_to_req),
                                             [bool(v) for v in is_valid],
                                             np.asarray(table).tolist(), block_size, token_offset,
                                             num_rows)
        same(got, [np.array(want[0], I32).reshape(rows, window), np.array(want[1], I32)])
    return got


# --- §4 global top-k ---------------------------------------------------------------------------
def run_global_topk(kind, topk, token_to_req, table, block_size, is_valid, compact=False,
                    reference=True, pad=EXTRA_COLS):
    """``pad``: columns past the width in the rows of the input and the output
    (a multiple of 4 keeps their rows 16-byte aligned)."""
    topk = np.asarray(topk, I32)
    rows, width = topk.shape
    inputs = (to_kind(np.array(token_to_req, I32), kind), strided(table, kind), block_size,
              to_kind(np.array(is_valid, bool), kind))
    indices = to_kind(poisoned((rows + EXTRA_ROWS, width + pad)), kind)
    lens = to_kind(poisoned(rows + EXTRA_ROWS), kind)
    source = strided(topk, kind, pad)
    got = d4.compute_global_topk_indices_and_lens(source, *inputs, out=(indices, lens),
                                                  compact=compact)
    assert tuple(got[0].shape) == (rows, width)
    assert_poison_past(indices, rows, width)
    assert_poison_past(lens, rows)
    np.testing.assert_array_equal(to_numpy(source), topk)          # the input is untouched
    same(d4.compute_global_topk_indices_and_lens(source, *inputs, compact=compact), got)
    # In place: the output is the input buffer itself (any row stride).
    buffer = strided(topk, kind)
    in_place = d4.compute_global_topk_indices_and_lens(
        buffer, *inputs, out=(buffer, to_kind(poisoned(rows), kind)), compact=compact)
    same(in_place, got)
    same([buffer], [got[0]])
    got = to_numpy(got[0]), to_numpy(got[1])
    if reference:
        want = upstream.global_topk_indices_and_lens(
            topk.tolist(), list(token_to_req), np.asarray(table).tolist(), block_size,
            [bool(v) for v in is_valid], compact)
        same(got, [np.array(want[0], I32).reshape(rows, width), np.array(want[1], I32)])
    return got


# --- §5 short-context fill ---------------------------------------------------------------------
def run_short_context(kind, positions, top_k, ratio, num_tokens=None, dtype=I64,
                      reference=True):
    rows = len(positions) if num_tokens is None else num_tokens
    pos = to_kind(np.array(positions, dtype), kind)
    out = to_kind(poisoned((rows + EXTRA_ROWS, top_k + EXTRA_COLS)), kind)
    got = d4.fill_short_context_topk_indices(pos, top_k, ratio, num_tokens, out=out)
    assert tuple(got.shape) == (rows, top_k)
    assert_poison_past(out, rows, top_k)
    same([d4.fill_short_context_topk_indices(pos, top_k, ratio, num_tokens)], [got])
    got = to_numpy(got)
    if reference:
        want = upstream.fill_short_context_topk_indices(list(positions), top_k, ratio, num_tokens)
        np.testing.assert_array_equal(got, np.array(want, I32).reshape(rows, top_k))
    return got


# --- §6 combine ------------------------------------------------------------------------------
def run_combine(kind, topk_indices, qsl, seq_lens, gather_lens, window, ratio, topk, M, N,
                reference=True):
    topk_indices = np.asarray(topk_indices, I32)
    rows = topk_indices.shape[0]
    width = d4.combine.combined_width(topk, window)
    args = (strided(topk_indices, kind), to_kind(np.array(qsl, I32), kind),
            to_kind(np.array(seq_lens, I32), kind), to_kind(np.array(gather_lens, I32), kind),
            window, ratio, topk, M, N)
    indices = to_kind(poisoned((rows + EXTRA_ROWS, width + EXTRA_COLS)), kind)
    lens = to_kind(poisoned(rows + EXTRA_ROWS), kind)
    got = d4.combine_topk_swa_indices(*args, out=(indices, lens))
    assert tuple(got[0].shape) == (rows, width)
    assert_poison_past(indices, rows, width)
    assert_poison_past(lens, rows)
    same(d4.combine_topk_swa_indices(*args), got)
    got = to_numpy(got[0]), to_numpy(got[1])
    if reference:
        want = upstream.combine_topk_swa_indices(topk_indices.tolist(), list(qsl), list(seq_lens),
                                                 list(gather_lens), window, ratio, topk, M, N)
        same(got, [np.array(want[0], I32).reshape(rows, width), np.array(want[1], I32)])
    return got


# --- §8.3 gather lengths ---------------------------------------------------------------------
def run_gather_lens(kind, qsl, seq_lens, num_decodes, num_prefills, window=128, reference=True):
    args = (to_kind(np.array(qsl, I32), kind), to_kind(np.array(seq_lens, I32), kind),
            num_decodes, num_prefills, window)
    out = to_kind(poisoned(num_prefills + EXTRA_ROWS), kind)
    got = d4.compute_prefill_gather_lens(*args, out=out)
    assert_poison_past(out, num_prefills)
    same([d4.compute_prefill_gather_lens(*args)], [got])
    got = to_numpy(got)
    if reference:
        want = upstream.prefill_gather_lens(list(qsl), list(seq_lens), num_decodes, num_prefills,
                                            window)
        np.testing.assert_array_equal(got, np.array(want, I32))
    return got


# --- §8.1 indexer prefill chunk ----------------------------------------------------------------
def run_indexer_prefill(kind, qsl, seq_lens, ratio, start, stop, reference=True):
    num_reqs = len(qsl) - 1
    total = int(sum(max(s // ratio, 0) for s in seq_lens[:num_reqs]))
    queries = stop - start
    args = (to_kind(np.array(qsl, I32), kind), to_kind(np.array(seq_lens, I32), kind), ratio,
            start, stop)
    buffers = [to_kind(poisoned(n + EXTRA_ROWS), kind)
               for n in (num_reqs + 1, total, queries, queries)]
    got = d4.build_indexer_prefill_chunk_metadata(*args, num_compressed=total, out=buffers)
    for buffer, n in zip(buffers, (num_reqs + 1, total, queries, queries)):
        assert_poison_past(buffer, n)
    same(d4.build_indexer_prefill_chunk_metadata(*args, num_compressed=total), got)
    got = [to_numpy(x) for x in got]
    if reference:
        want = upstream.indexer_prefill_chunk_metadata(list(qsl), list(seq_lens), ratio, start,
                                                       stop)
        same(got, [np.array(w, I32) for w in want])
    return got


# --- §8.2 indexer decode -----------------------------------------------------------------------
def run_indexer_decode(kind, qsl, seq_lens, table, num_tokens, ratio, reference=True):
    table = np.asarray(table, I32)
    cols = table.shape[1]
    args = (to_kind(np.array(qsl, I32), kind), to_kind(np.array(seq_lens, I32), kind),
            strided(table, kind), num_tokens, ratio)
    context = to_kind(poisoned(num_tokens + EXTRA_ROWS), kind)
    others = [to_kind(poisoned(num_tokens + EXTRA_ROWS), kind) for _ in range(2)]
    rows = to_kind(poisoned((num_tokens + EXTRA_ROWS, cols + EXTRA_COLS)), kind)
    got = d4.build_indexer_decode_metadata(*args, out=(context, *others, rows))
    assert (to_numpy(context)[num_tokens:] == 0).all(), "the length buffer's tail is not zeroed"
    for buffer in others:
        assert_poison_past(buffer, num_tokens)
    assert_poison_past(rows, num_tokens, cols)
    same(d4.build_indexer_decode_metadata(*args), got)
    got = [to_numpy(x) for x in got]
    if reference:
        want = upstream.indexer_decode_metadata(list(qsl), list(seq_lens), table.tolist(),
                                                num_tokens, ratio)
        same(got[:3], [np.array(w, I32) for w in want[:3]])
        # A list-of-rows table without rows has no width: every row is padding then.
        want_rows = np.array(want[3], I32) if len(table) else np.zeros((num_tokens, cols), I32)
        np.testing.assert_array_equal(got[3], want_rows.reshape(num_tokens, cols))
    return got
