"""Run one op on one array kind with poisoned outputs and compare it with the
reference (and, for GPU kinds, with the numpy CPU path)."""
from __future__ import annotations

import numpy as np

import dsv4_cupy as d4
import reference as ref
import reference_upstream as upstream
from batches import POISON, Batch, poisoned
from conftest import to_kind, to_numpy

EXTRA_ROWS, EXTRA_COLS = 3, 5


def check_token_map(batch: Batch, kind: str):
    want = np.array(ref.token_to_req(batch.qsl.tolist(), batch.num_tokens), np.int32)
    out = to_kind(poisoned(batch.num_tokens + EXTRA_ROWS), kind)
    got = d4.token_to_req_indices(to_kind(batch.qsl, kind), batch.num_tokens, out=out)
    np.testing.assert_array_equal(to_numpy(got), want)
    assert (to_numpy(out)[batch.num_tokens:] == POISON).all(), "wrote past num_tokens"
    fresh = to_numpy(d4.token_to_req_indices(to_kind(batch.qsl, kind), batch.num_tokens))
    np.testing.assert_array_equal(fresh, want)
    return got


def check_slot_mapping(batch: Batch, kind: str, cp=(1, 0, 1)):
    out_len = batch.num_tokens + EXTRA_ROWS
    world, rank, interleave = cp
    want = ref.compressed_slot_mapping(batch.num_tokens, batch.qsl.tolist(),
                                       batch.seq_lens.tolist(), batch.block_table.tolist(),
                                       batch.storage_block_size, batch.ratio, out_len, world, rank,
                                       interleave)
    table = to_kind(batch.block_table, kind)
    table_before = to_numpy(table).copy()
    out = to_kind(poisoned(out_len, np.int64), kind)
    got = d4.get_compressed_slot_mapping(batch.num_tokens, to_kind(batch.qsl, kind),
                                         to_kind(batch.seq_lens, kind), table,
                                         batch.storage_block_size, batch.ratio, out,
                                         cp_world_size=world, cp_rank=rank,
                                         cp_kv_cache_interleave_size=interleave)
    assert to_numpy(got).shape == (batch.num_tokens,)
    np.testing.assert_array_equal(to_numpy(out), np.array(want, np.int64))
    np.testing.assert_array_equal(to_numpy(table), table_before)  # the clamp is not in place
    return to_numpy(out)


def check_c128a(batch: Batch, kind: str, width: int, positions_dtype=np.int64,
                slot_dtype=np.int64):
    """Poisoned persistent buffers wider and longer than needed; returns numpy results."""
    num_decodes, _, nd, num_prefill = batch.split()
    total = nd + num_prefill
    t2r = ref.token_to_req(batch.qsl.tolist(), batch.num_tokens)
    want_gd, want_lens, want_pf = upstream.c128a_topk_v2(
        batch.positions[:total].tolist(), batch.ratio, nd, t2r,
        batch.block_table[:num_decodes].tolist(), batch.storage_block_size,
        batch.slot_mapping.tolist(), width)
    gd = to_kind(poisoned((nd + EXTRA_ROWS, width + EXTRA_COLS)), kind)
    lens = to_kind(poisoned(nd + EXTRA_ROWS), kind)
    pf = to_kind(poisoned((num_prefill + EXTRA_ROWS, width + EXTRA_COLS)), kind)
    got = d4.build_c128a_topk_metadata(
        to_kind(batch.positions[:total].astype(positions_dtype), kind), batch.ratio, nd,
        to_kind(np.array(t2r, np.int32), kind), to_kind(batch.block_table[:num_decodes], kind),
        batch.storage_block_size, to_kind(batch.slot_mapping.astype(slot_dtype), kind),
        gd, lens, pf, max_compressed_tokens=width)
    got_gd, got_lens, got_pf = (to_numpy(x) for x in got)
    assert got_gd.shape == (nd, width) and got_pf.shape == (num_prefill, width)
    np.testing.assert_array_equal(got_gd, np.array(want_gd, np.int32).reshape(nd, width))
    np.testing.assert_array_equal(got_lens, np.array(want_lens, np.int32))
    np.testing.assert_array_equal(got_pf, np.array(want_pf, np.int32).reshape(num_prefill, width))
    gd_all, lens_all, pf_all = to_numpy(gd), to_numpy(lens), to_numpy(pf)
    assert (gd_all[nd:] == POISON).all() and (gd_all[:, width:] == POISON).all()
    assert (lens_all[nd:] == POISON).all()
    assert (pf_all[num_prefill:] == POISON).all() and (pf_all[:, width:] == POISON).all()
    return got_gd, got_lens, got_pf
