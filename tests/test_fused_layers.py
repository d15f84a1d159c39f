"""The fused per-step and per-layer ops against the single ops they fuse, on every
array kind, with poisoned outputs: ``c4a_layer_topk`` (decode rows to global
slots and prefill rows combined, one launch) and
``build_c128a_combined_prefill_rows`` (C128A's combined rows with no input rows)."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

from conftest import KINDS, to_kind, to_numpy
from helpers import POISON

I32 = np.int32
WINDOW, C4A_BLOCK = 128, 64


def step(rng, decodes, prefill_lens, topk_width=512):
    """A step of decodes (1-3 tokens) then prefills, with a C4A layer's top-k rows."""
    query_lens = np.array(list(rng.integers(1, 4, decodes)) + list(prefill_lens), np.int64)
    seq = query_lens + rng.integers(0, 5000, len(query_lens))
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(I32)
    tokens = int(qsl[-1])
    nd = int(qsl[decodes])
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq)])
    visible = np.maximum((positions + 1) // 4, 1)
    topk = (rng.random((tokens, topk_width)) * visible[:, None]).astype(I32)
    topk[rng.random(topk.shape) < 0.1] = -1
    topk[rng.random(topk.shape) < 0.01] = 0x7FC00000
    valid = rng.random(tokens) < 0.95
    table = rng.integers(0, 1 << 20, (len(query_lens), 100), dtype=I32)
    table[:, 90:] = -1
    chunk_qsl = qsl[decodes:]                       # the prefill chunk: does not start at 0
    chunk_seq = seq[decodes:].astype(I32)
    gather = d4.compute_prefill_gather_lens(qsl, seq.astype(I32), decodes, len(prefill_lens),
                                            WINDOW)
    N = int(chunk_seq.max(initial=0)) // 4
    M = N + int(gather.max(initial=0))
    return dict(topk=topk, nd=nd, t2r=np.repeat(np.arange(len(query_lens)), query_lens).astype(I32),
                table=table, valid=valid, qsl=chunk_qsl, seq=chunk_seq, gather=gather, M=M, N=N,
                positions=positions)


def poisoned(kind, *shape):
    return to_kind(np.full(shape, POISON, I32), kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_c4a_layer_topk_equals_the_two_ops(kind, compact, in_place):
    rng = np.random.default_rng(3 + compact + 2 * in_place)
    for decodes, prefills in ((5, [300, 40]), (0, [77]), (9, []), (1, [1, 2, 129])):
        s = step(rng, decodes, prefills)
        tokens, width = s["topk"].shape
        nd = s["nd"]
        x = {k: to_kind(v, kind) if isinstance(v, np.ndarray) else v for k, v in s.items()}
        combined_width = d4.combine.combined_width(width, WINDOW)
        global_out = x["topk"] if in_place else poisoned(kind, nd + 3, width + 8)
        out = ((global_out, poisoned(kind, nd + 3)),
               (poisoned(kind, tokens - nd + 3, combined_width + 4), poisoned(kind, tokens - nd + 3)))
        (glob, lens), (comb, comb_lens) = d4.c4a_layer_topk(
            x["topk"], nd, x["t2r"], x["table"], C4A_BLOCK, x["valid"], x["qsl"], x["seq"],
            x["gather"], WINDOW, 4, s["M"], s["N"], compact=compact, out=out)
        want_glob, want_lens = d4.compute_global_topk_indices_and_lens(
            s["topk"][:nd], s["t2r"], s["table"], C4A_BLOCK, s["valid"], compact=compact)
        want_comb, want_comb_lens = d4.combine_topk_swa_indices(
            s["topk"][nd:], s["qsl"], s["seq"], s["gather"], WINDOW, 4, width, s["M"], s["N"])
        for got, want in ((glob, want_glob), (lens, want_lens), (comb, want_comb),
                          (comb_lens, want_comb_lens)):
            np.testing.assert_array_equal(to_numpy(got), want)
        if not in_place:     # the cells past the results are untouched
            assert (to_numpy(out[0][0])[nd:] == POISON).all()
            assert (to_numpy(out[0][0])[:, width:] == POISON).all()
        assert (to_numpy(out[1][0])[tokens - nd:] == POISON).all()
        assert (to_numpy(out[1][1])[tokens - nd:] == POISON).all()
        if in_place:         # the prefill rows, read by the combine, are unchanged
            np.testing.assert_array_equal(to_numpy(x["topk"])[nd:], s["topk"][nd:])


@pytest.mark.parametrize("kind", KINDS)
def test_c128a_combined_rows_equal_the_combine_of_the_c128a_prefill_rows(kind):
    rng = np.random.default_rng(8)
    for decodes, prefills, width in ((3, [500, 64], 256), (0, [4096], 8192), (2, [1, 200], 128)):
        s = step(rng, decodes, prefills, topk_width=8)
        nd, tokens = s["nd"], s["topk"].shape[0]
        chunk = tokens - nd
        local = d4.fill_short_context_topk_indices(s["positions"][nd:], width, 128)
        want, want_lens = d4.combine_topk_swa_indices(local, s["qsl"], s["seq"], s["gather"],
                                                      WINDOW, 128, width, s["M"] * 40,
                                                      s["N"] * 40)
        C = d4.combine.combined_width(width, WINDOW)
        out = (poisoned(kind, chunk + 5, C + 4), poisoned(kind, chunk + 5))
        x = {k: to_kind(s[k], kind) for k in ("qsl", "seq", "gather")}
        rows, lens = d4.build_c128a_combined_prefill_rows(
            chunk + 2, x["qsl"], x["seq"], x["gather"], WINDOW, 128, width, s["M"] * 40,
            s["N"] * 40, out=out)
        np.testing.assert_array_equal(to_numpy(rows)[:chunk], want)
        np.testing.assert_array_equal(to_numpy(lens)[:chunk], want_lens)
        assert (to_numpy(rows)[chunk:] == -1).all() and (to_numpy(lens)[chunk:] == 0).all()
        assert (to_numpy(out[0])[chunk + 2:] == POISON).all()
        assert (to_numpy(out[0])[:, C:] == POISON).all()


@pytest.mark.parametrize("kind", KINDS)
def test_a_fused_call_with_overlapping_outputs_writes_nothing(kind):
    s = step(np.random.default_rng(1), 4, [50])
    x = {k: to_kind(v, kind) if isinstance(v, np.ndarray) else v for k, v in s.items()}
    tokens, width = s["topk"].shape
    nd = s["nd"]
    shared = poisoned(kind, tokens, 1280)        # the top-k rows, and the combined rows over them
    shared[:, :width] = x["topk"]
    glob, lens, comb_lens = poisoned(kind, nd, width), poisoned(kind, nd), poisoned(kind, tokens)
    before = to_numpy(shared).copy()
    with pytest.raises(ValueError, match="overlaps"):
        d4.c4a_layer_topk(shared[:, :width], nd, x["t2r"], x["table"], C4A_BLOCK, x["valid"],
                          x["qsl"], x["seq"], x["gather"], WINDOW, 4, s["M"], s["N"],
                          out=((glob, lens), (shared, comb_lens)))
    assert (to_numpy(glob) == POISON).all() and (to_numpy(lens) == POISON).all()
    assert (to_numpy(comb_lens) == POISON).all()
    np.testing.assert_array_equal(to_numpy(shared), before)
    with pytest.raises(ValueError, match="num_decode_tokens"):
        d4.c4a_layer_topk(x["topk"], tokens + 1, x["t2r"], x["table"], C4A_BLOCK, x["valid"],
                          x["qsl"], x["seq"], x["gather"], WINDOW, 4, s["M"], s["N"])
    with pytest.raises(TypeError, match="topk_indices"):
        d4.combine_topk_swa_indices(None, x["qsl"], x["seq"], x["gather"], WINDOW, 4, 8, 10, 5)
