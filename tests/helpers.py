"""Builders of test data and runners shared by the test modules: batches
(random and hand-made, numpy, decodes first), the C128A group's ops checked
against the reference, the per-layer and indexer ops run on one array kind
with poisoned persistent buffers (longer and wider than needed: only the
result region may be written, and a call without buffers must agree), and
random cases of each op. Test modules import from here, never from each other."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

import dsv4_cupy as d4

import reference as ref
import reference_upstream as upstream
from conftest import to_kind, to_numpy

I32, I64 = np.int32, np.int64
#: Rows and columns of a persistent buffer past what a call writes.
EXTRA_ROWS, EXTRA_COLS = 3, 5


# --- batches: random and hand-made DeepSeek-V4 batches (numpy, decodes first) ---

POISON = -7


@dataclass
class Batch:
    qsl: np.ndarray            # int32 [R + 1]
    seq_lens: np.ndarray       # int32 [R]
    block_table: np.ndarray    # int32 [R, max_blocks]
    positions: np.ndarray      # int64 [T]
    slot_mapping: np.ndarray   # int64 [T], -1 = padding
    num_tokens: int            # T, padding tokens included
    max_query_len: int
    max_seq_len: int
    ratio: int
    storage_block_size: int
    threshold: int

    @property
    def num_reqs(self) -> int:
        return self.qsl.shape[0] - 1

    def split(self):
        return ref.split_decodes_and_prefills(self.qsl.tolist(), self.threshold, False,
                                              self.num_tokens, self.max_query_len)

    def token_map(self):
        return np.array(ref.token_to_req(self.qsl.tolist(), self.num_tokens), np.int32)


def make_batch(query_lens, prefixes, *, ratio=128, block_size=256, rng=None, pad_tokens=0,
               threshold=1, pad_position=0, table_cols=None, negative_tail=False):
    """A batch from per-request query lengths and cached-prefix lengths."""
    rng = rng or np.random.default_rng(0)
    query_lens = np.asarray(query_lens, np.int64)
    prefixes = np.asarray(prefixes, np.int64)
    seq = prefixes + query_lens
    qsl = np.zeros(len(query_lens) + 1, np.int32)
    qsl[1:] = np.cumsum(query_lens)
    storage = max(block_size // ratio, 1)
    # Enough columns for the compressed slot mapping (blocks of `storage`
    # compressed rows) and for C128A decode lookups of every visible row.
    need = max([int(s) // ratio // storage + 2 for s in seq] + [1])
    cols = table_cols or need
    table = rng.integers(0, 1 << 20, size=(len(query_lens), cols), dtype=np.int32)
    if negative_tail and len(query_lens):
        for r in range(len(query_lens)):
            used = int(seq[r]) // ratio // storage + 1
            table[r, used:] = -1
    positions = [np.arange(s - q, s) for q, s in zip(query_lens, seq)]
    positions.append(np.full(pad_tokens, pad_position))
    positions = np.concatenate(positions).astype(np.int64) if positions else np.zeros(0, np.int64)
    slots = rng.integers(0, 1 << 30, size=positions.shape[0]).astype(np.int64)
    if pad_tokens:
        slots[-pad_tokens:] = -1
    return Batch(qsl=qsl, seq_lens=seq.astype(np.int32), block_table=table, positions=positions,
                 slot_mapping=slots, num_tokens=int(positions.shape[0]),
                 max_query_len=int(query_lens.max()) if len(query_lens) else 0,
                 max_seq_len=int(seq.max()) if len(seq) else 0, ratio=ratio,
                 storage_block_size=storage, threshold=threshold)


def random_batch(rng, *, ratio=128, max_prefix=1 << 20, max_decodes=12, max_prefills=3,
                 max_prefill_len=96, block_size=256):
    """Decodes first (MTP query lengths 1-8), then prefills, zero-length requests
    sprinkled in, padding tokens at the end; prefixes up to ``max_prefix``."""
    spec = int(rng.integers(0, 8))                       # num_speculative_tokens 0..7
    threshold = 1 + spec
    n_dec = int(rng.integers(0, max_decodes + 1))
    n_pre = int(rng.integers(0, max_prefills + 1))
    q = [int(rng.integers(1, threshold + 1)) for _ in range(n_dec)]
    q += [int(rng.integers(threshold + 1, threshold + 1 + max_prefill_len)) for _ in range(n_pre)]
    if q and rng.random() < 0.3:                         # a zero-length request among decodes
        q.insert(int(rng.integers(0, n_dec + 1)), 0)
    q += [0] * int(rng.integers(0, 3))                   # padding requests
    small = rng.random() < 0.5
    top = 4096 if small else max_prefix
    prefixes = [int(rng.integers(0, max(1, top - x))) for x in q]
    pad = int(rng.integers(0, 4))
    return make_batch(q, prefixes, ratio=ratio, block_size=block_size, rng=rng, pad_tokens=pad,
                      threshold=threshold, pad_position=int(rng.integers(0, 200)),
                      negative_tail=rng.random() < 0.3)


def poisoned(shape, dtype=np.int32):
    return np.full(shape, POISON, dtype)


def bf16_bits(values) -> np.ndarray:
    """float values rounded to bf16 (nearest even), as uint16 bits."""
    bits = np.asarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(np.asarray(values, np.float32)), np.uint16(0x7FC0), rounded)


def random_bf16(rng, rows, width, scale=1.0) -> np.ndarray:
    """[rows, width] standard-normal keys times ``scale``, as bf16 bits."""
    return bf16_bits(rng.standard_normal((rows, width)) * scale)


# --- checks of the C128A group's ops against the reference ---



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
    got = d4.get_compressed_slot_mapping(batch.num_tokens, None, to_kind(batch.qsl, kind),
                                         to_kind(batch.seq_lens, kind), table,
                                         batch.storage_block_size, batch.ratio, out, world,
                                         interleave * batch.ratio, dcp_rank=rank)
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


# --- the per-layer and indexer ops, run with poisoned buffers ---



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


# --- SWA ----------------------------------------------------------------------------------
def run_swa(kind, window, qsl, seq_lens, token_to_req, is_valid, table, block_size,
            token_offset=0, num_rows=None, reference=True, **extensions):
    """The op into poisoned buffers, against the allocating call and the reference;
    ``extensions``: vLLM 0.34's index_width, left_visible, right_visible (lists),
    replay_start (a list), causal."""
    rows = len(token_to_req) - token_offset if num_rows is None else num_rows
    width = extensions.get("index_width") or window
    args = (window, to_kind(np.array(qsl, I32), kind), to_kind(np.array(seq_lens, I32), kind),
            to_kind(np.array(token_to_req, I32), kind), to_kind(np.array(is_valid, bool), kind),
            strided(table, kind), block_size, token_offset, num_rows)
    kwargs = {name: to_kind(np.array(value, I32), kind) if isinstance(value, list) else value
              for name, value in extensions.items()}
    indices = to_kind(poisoned((rows + EXTRA_ROWS, 1, width + EXTRA_COLS)), kind)
    lens = to_kind(poisoned(rows + EXTRA_ROWS), kind)
    got = d4.compute_swa_indices_and_lens(*args, out=(indices, lens), **kwargs)
    assert tuple(got[0].shape) == (rows, 1, width) and tuple(got[1].shape) == (rows,)
    assert_poison_past(indices, rows, width)
    assert_poison_past(lens, rows)
    same(d4.compute_swa_indices_and_lens(*args, **kwargs), got)
    got = to_numpy(got[0])[:, 0], to_numpy(got[1])
    if reference and extensions:
        want = upstream.swa_indices_and_lens_034(
            window, width, list(qsl), list(seq_lens), list(token_to_req),
            [bool(v) for v in is_valid], np.asarray(table).tolist(), block_size, token_offset,
            rows, extensions.get("left_visible"), extensions.get("right_visible"),
            extensions.get("replay_start"), extensions.get("causal", True))
        same(got, [np.array(want[0], I32).reshape(rows, width), np.array(want[1], I32)])
    elif reference:
        want = upstream.swa_indices_and_lens(window, list(qsl), list(seq_lens), list(token_to_req),
                                             [bool(v) for v in is_valid],
                                             np.asarray(table).tolist(), block_size, token_offset,
                                             num_rows)
        same(got, [np.array(want[0], I32).reshape(rows, window), np.array(want[1], I32)])
    return got


# --- global top-k ---------------------------------------------------------------------------
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


# --- short-context fill ---------------------------------------------------------------------
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


# --- combine ------------------------------------------------------------------------------
def run_combine(kind, topk_indices, qsl, seq_lens, gather_lens, window, ratio, topk, M, N,
                reference=True, left=None, right=None, max_image_tokens=0):
    """The op on ``kind`` arrays (``out`` by position, as vLLM passes it) into poisoned
    buffers, checked against the allocating call and the reference; ``left``/``right``
    the tokens' image visibility (lists, or None)."""
    topk_indices = np.asarray(topk_indices, I32)
    rows = topk_indices.shape[0]
    width = d4.combine.combined_width(topk, window, max_image_tokens)
    images = tuple(None if v is None else to_kind(np.array(v, I32), kind) for v in (left, right))
    args = (strided(topk_indices, kind), to_kind(np.array(qsl, I32), kind),
            to_kind(np.array(seq_lens, I32), kind), to_kind(np.array(gather_lens, I32), kind),
            window, ratio, topk, M, N)
    indices = to_kind(poisoned((rows + EXTRA_ROWS, width + EXTRA_COLS)), kind)
    lens = to_kind(poisoned(rows + EXTRA_ROWS), kind)
    got = d4.combine_topk_swa_indices(*args, (indices, lens), *images, max_image_tokens)
    assert tuple(got[0].shape) == (rows, width)
    assert_poison_past(indices, rows, width)
    assert_poison_past(lens, rows)
    same(d4.combine_topk_swa_indices(*args, None, *images, max_image_tokens), got)
    got = to_numpy(got[0]), to_numpy(got[1])
    if reference:
        want = upstream.combine_topk_swa_indices(topk_indices.tolist(), list(qsl), list(seq_lens),
                                                 list(gather_lens), window, ratio, topk, M, N,
                                                 left, right, max_image_tokens)
        same(got, [np.array(want[0], I32).reshape(rows, width), np.array(want[1], I32)])
    return got


# --- gather lengths ---------------------------------------------------------------------
def run_gather_lens(kind, qsl, seq_lens, num_decodes, num_prefills, window=128, reference=True,
                    replay_start=None):
    args = (to_kind(np.array(qsl, I32), kind), to_kind(np.array(seq_lens, I32), kind),
            num_decodes, num_prefills, window)
    replay = None if replay_start is None else to_kind(np.array(replay_start, I32), kind)
    out = to_kind(poisoned(num_prefills + EXTRA_ROWS), kind)
    got = d4.compute_prefill_gather_lens(*args, replay_start=replay, out=out)
    assert_poison_past(out, num_prefills)
    same([d4.compute_prefill_gather_lens(*args, replay_start=replay)], [got])
    got = to_numpy(got)
    if reference:
        want = upstream.prefill_gather_lens(list(qsl), list(seq_lens), num_decodes, num_prefills,
                                            window, replay_start)
        np.testing.assert_array_equal(got, np.array(want, I32))
    return got


# --- indexer prefill chunk ----------------------------------------------------------------
def run_indexer_prefill(kind, qsl, seq_lens, ratio, start, stop, reference=True,
                        positions=None, dcp=(1, 0, 1)):
    """The op into poisoned buffers (the local_cu buffer too under DCP), against the
    allocating call and the reference; ``positions`` a list or None, ``dcp`` (world
    size, rank, interleave in compressed rows)."""
    num_reqs = len(qsl) - 1
    total = int(sum(max(s // ratio, 0) for s in seq_lens[:num_reqs]))
    queries = stop - start
    world, rank, interleave = dcp
    args = (to_kind(np.array(qsl, I32), kind), to_kind(np.array(seq_lens, I32), kind), ratio,
            start, stop)
    kwargs = dict(num_compressed=total, dcp_rank=rank, dcp_world_size=world,
                  cp_kv_cache_interleave_size=interleave,
                  positions=None if positions is None else to_kind(np.array(positions, I64),
                                                                   kind))
    lengths = (num_reqs + 1, total, queries, queries, num_reqs + 1)
    buffers = [to_kind(poisoned(n + EXTRA_ROWS), kind) for n in lengths]
    got = d4.build_indexer_prefill_chunk_metadata(*args, out=buffers, **kwargs)
    for buffer, n in zip(buffers, lengths[:4] + ((num_reqs + 1 if world > 1 else 0),)):
        assert_poison_past(buffer, n)
    assert (got[4] is got[0]) == (world == 1)
    same(d4.build_indexer_prefill_chunk_metadata(*args, **kwargs), got)
    got = [to_numpy(x) for x in got]
    if reference:
        want = upstream.indexer_prefill_chunk_metadata(list(qsl), list(seq_lens), ratio, start,
                                                       stop, positions, rank, world, interleave)
        same(got, [np.array(w, I32) for w in want])
    return got


# --- indexer decode -----------------------------------------------------------------------
def run_indexer_decode(kind, qsl, seq_lens, table, num_tokens, ratio, reference=True):
    table = np.asarray(table, I32)
    cols = table.shape[1]
    args = (to_kind(np.array(qsl, I32), kind), to_kind(np.array(seq_lens, I32), kind),
            strided(table, kind), num_tokens, ratio)
    context = to_kind(poisoned(num_tokens + EXTRA_ROWS), kind)
    others = [to_kind(poisoned(num_tokens + EXTRA_ROWS), kind) for _ in range(2)]
    rows = to_kind(poisoned((num_tokens + EXTRA_ROWS, cols + EXTRA_COLS)), kind)
    num_reqs = len(qsl) - 1
    per_req = to_kind(poisoned(num_reqs + EXTRA_ROWS), kind)
    got = d4.build_indexer_decode_metadata(*args, out=(context, *others, rows, per_req))
    assert (to_numpy(context)[num_tokens:] == 0).all(), "the length buffer's tail is not zeroed"
    for buffer in others:
        assert_poison_past(buffer, num_tokens)
    assert_poison_past(rows, num_tokens, cols)
    assert_poison_past(per_req, num_reqs)
    same(d4.build_indexer_decode_metadata(*args), got)
    got = [to_numpy(x) for x in got]
    if reference:
        want = upstream.indexer_decode_metadata(list(qsl), list(seq_lens), table.tolist(),
                                                num_tokens, ratio)
        same(got[:3] + got[4:], [np.array(w, I32) for w in want[:3] + want[4:]])
        # A list-of-rows table without rows has no width: every row is padding then.
        want_rows = np.array(want[3], I32) if len(table) else np.zeros((num_tokens, cols), I32)
        np.testing.assert_array_equal(got[3], want_rows.reshape(num_tokens, cols))
    return got


# --- builders and random cases shared by several test modules ---

MAX_TOKENS = 1024


def common_metadata(batch, kind):
    return d4.CommonAttentionMetadata(
        query_start_loc=to_kind(batch.qsl, kind), query_start_loc_cpu=batch.qsl.copy(),
        seq_lens=to_kind(batch.seq_lens, kind), block_table_tensor=to_kind(batch.block_table, kind),
        slot_mapping=to_kind(batch.slot_mapping, kind), positions=to_kind(batch.positions, kind),
        num_reqs=batch.num_reqs, num_actual_tokens=batch.num_tokens,
        max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len)


def make_builder(kind, ratio, max_model_len, policy="capacity", spec=0):
    like = to_kind(np.zeros(1, np.int32), kind)
    return d4.DeepseekV4MetadataBuilder(ratio, max_model_len, MAX_TOKENS, width_policy=policy,
                                        num_speculative_tokens=spec, like=like)


def poison(builder):
    for name in ("req_id_per_token_buffer", "compressed_slot_mapping_buffer",
                 "c128a_global_decode_buffer", "c128a_decode_lens_buffer", "c128a_prefill_buffer"):
        buffer = getattr(builder, name)
        if buffer is not None:
            buffer[...] = POISON
    poison_gaps(builder)


def poison_unseen(builder):
    """Every buffer of a builder (``buffers()``) poisoned as the kernels write
    them: torch CUDA buffers through CuPy (DLPack), so torch sees no in-place
    change of the returned views (a prepared build hands out views that torch
    did not change). The gaps between them too (``poison_gaps``)."""
    for buffer in builder.buffers().values():
        value = True if str(buffer.dtype) in ("bool", "torch.bool") else POISON
        if type(buffer).__module__.startswith("torch") and buffer.is_cuda:
            import cupy
            buffer = cupy.from_dlpack(buffer)
        buffer[...] = value
    poison_gaps(builder)


#: The byte the gaps between a block's buffers hold (``poison_gaps``).
GAP_POISON = 0xA5


def poison_gaps(builder):
    """The bytes between the buffers of the builder's blocks
    (``kinds.full_block_like_kind``) set to ``GAP_POISON``, unseen by torch:
    a kernel writing past a buffer's end changes them (``assert_gaps_kept``),
    where the sanitizer, seeing one allocation, would not report it."""
    for block, gaps in _block_gaps(builder):
        for start, stop in gaps:
            block[start:stop] = GAP_POISON


def assert_gaps_kept(builder):
    for block, gaps in _block_gaps(builder):
        for start, stop in gaps:
            assert (to_numpy(block[start:stop]) == GAP_POISON).all(), (
                f"bytes [{start}, {stop}) between two buffers were written")


def _block_gaps(builder) -> list:
    """``(bytes, gaps)`` per block of the builder's buffers: the block as a
    uint8 array that torch does not watch (numpy or cupy), and the byte ranges
    in it that no buffer holds, before, between and after them."""
    blocks = {}
    for buffer in builder.buffers().values():
        block, start = _block_of(buffer)
        entry = blocks.setdefault(_address(block), (block, []))
        entry[1].append((start, start + buffer.nbytes if hasattr(buffer, "nbytes")
                         else start + buffer.numel() * buffer.element_size()))
    out = []
    for block, spans in blocks.values():
        gaps, end = [], 0
        for start, stop in sorted(spans):
            if start > end:
                gaps.append((end, start))
            end = max(end, stop)
        if end < block.shape[0]:
            gaps.append((end, block.shape[0]))
        out.append((block, gaps))
    return out


def _address(x) -> int:
    module = type(x).__module__
    if module.startswith("torch"):
        return x.data_ptr()
    return x.data.ptr if module.startswith("cupy") else x.ctypes.data


def _block_of(buffer) -> tuple:
    """The uint8 allocation ``buffer`` is a view of, and its byte offset there."""
    if type(buffer).__module__.startswith("torch"):
        storage = buffer.untyped_storage()
        if buffer.is_cuda:
            import cupy
            memory = cupy.cuda.UnownedMemory(storage.data_ptr(), storage.nbytes(), storage)
            block = cupy.ndarray((storage.nbytes(),), cupy.uint8,
                                 cupy.cuda.MemoryPointer(memory, 0))
        else:
            block = np.ctypeslib.as_array(
                (ctypes.c_uint8 * storage.nbytes()).from_address(storage.data_ptr()))
        return block, buffer.data_ptr() - storage.data_ptr()
    block = buffer
    while block.base is not None:
        block = block.base
    return block, _address(buffer) - _address(block)


def prepare_without_device(launch, device):
    """``Launch.prepare`` for the CPU: the launch's struct packed, its blocks."""
    from dsv4_cupy.launch import PreparedLaunch
    ready = object.__new__(PreparedLaunch)
    ready.storage = np.zeros(launch.layout.size, np.uint8)
    launch.layout.pack_values_into(ready.storage, launch.values())
    ready.blocks = launch.blocks
    return ready


def emulate_gpu_host(monkeypatch) -> list:
    """The builders' GPU path run on the CPU for its host side: torch CPU
    tensors counted as a GPU kind (132 SMs), launches packed without a
    device and run as a count. Returns the list each run appends its
    prepared launch to."""
    from dsv4_cupy import builder, checks, device, group, launch, prepared, step_builder
    gpu_kinds = (*d4.kinds.GPU_KINDS, d4.kinds.TORCH_CPU)
    for module in (builder, checks, group, prepared, step_builder):
        monkeypatch.setattr(module, "GPU_KINDS", gpu_kinds)
    monkeypatch.setattr(d4.DeepseekV4FlashMLABackend, "check_device",
                        classmethod(lambda cls: None))
    for ordinal in (None, -1, 0):
        monkeypatch.setitem(device._SM_COUNT, ordinal, 132)
    runs = []
    monkeypatch.setattr(launch.Launch, "prepare", prepare_without_device)
    monkeypatch.setattr(launch.PreparedLaunch, "run",
                        lambda self, stream: runs.append(self) or True)
    monkeypatch.setattr(prepared, "stream_getter", lambda kind, device: lambda: 0)
    return runs


def random_swa_case(rng):
    """(window, qsl, seq_lens, token_to_req, is_valid, table, block_size, token_offset,
    num_rows): decodes then prefills, zero-length requests, padding tokens."""
    window = int(rng.choice([1, 4, 16, 128]))
    block_size = int(rng.choice([1, 4, 64]))
    query_lens = [int(q) for q in rng.integers(0, 13, int(rng.integers(0, 9)))]
    prefixes = [int(p) for p in rng.integers(0, 300, len(query_lens))]
    qsl = np.concatenate([[0], np.cumsum(query_lens, dtype=np.int64)]).astype(int).tolist()
    seq = [q + p - int(rng.random() < 0.05) * (q + 1) for q, p in zip(query_lens, prefixes)]
    pad = int(rng.integers(0, 3))
    token_to_req = np.repeat(np.arange(len(query_lens)), query_lens).tolist() + [0] * pad
    valid = [bool(v) for v in rng.random(len(token_to_req)) < 0.9]
    cols = int(rng.integers(1, 12))
    table = rng.integers(-1, 1000, (max(len(query_lens), 1), cols)).astype(I32)
    offset = int(rng.integers(0, len(token_to_req) + 1))
    num_rows = int(rng.integers(0, len(token_to_req) - offset + 1))
    return window, qsl, seq, token_to_req, valid, table, block_size, offset, num_rows


def random_combine_case(rng):
    """(topk_indices, qsl, seq_lens, gather_lens, W, ratio, topk, M, N) of one chunk."""
    window = int(rng.choice([1, 3, 8, 128]))
    ratio = int(rng.choice([1, 2, 4, 128]))
    topk = int(rng.choice([0, 1, 5, 40, 300]))
    query_lens = rng.integers(0, 7, int(rng.integers(0, 5)))
    seq = query_lens + rng.integers(0, 400, len(query_lens))
    seq[rng.random(len(seq)) < 0.1] = 0                          # L < q: negative positions
    gather = query_lens + np.minimum(np.maximum(seq - query_lens, 0), window - 1)
    gather -= (rng.random(len(gather)) < 0.2) * rng.integers(0, 3, len(gather))
    first = int(rng.integers(0, 50))
    qsl = (first + np.concatenate([[0], np.cumsum(query_lens)])).tolist()
    tokens = int(query_lens.sum()) + int(rng.integers(0, 3))
    compressed = int((seq // ratio).max()) if len(seq) else 0
    swa_offset = max(compressed + int(rng.integers(-2, 3)), 0)
    rows_per_request = swa_offset + max(int(gather.max()) if len(gather) else 0, 0) + 1
    topk_indices = rng.integers(-1, compressed + 3, (tokens, topk + int(rng.integers(0, 3))))
    return (topk_indices.astype(I32), qsl, seq.tolist(), gather.tolist(), window, ratio, topk,
            rows_per_request, swa_offset)


def random_indexer_prefill_case(rng):
    """(qsl, seq_lens, ratio, start, stop) of one chunk."""
    query_lens = rng.integers(0, 20, int(rng.integers(0, 6)))
    seq = query_lens + rng.integers(0, 300, len(query_lens))
    qsl = (int(rng.integers(0, 30)) + np.concatenate([[0], np.cumsum(query_lens)])).tolist()
    total = int(query_lens.sum())
    start = int(rng.integers(0, total + 1))
    return qsl, seq.tolist(), int(rng.choice([1, 4, 128])), start, int(
        rng.integers(start, total + 1))


def random_global_topk_case(rng):
    """(topk, token_to_req, table, block_size, is_valid, compact)."""
    tokens, width = int(rng.integers(0, 8)), int(rng.choice([0, 1, 7, 40, 300]))
    block_size = int(rng.choice([1, 3, 4, 64]))
    requests, cols = int(rng.integers(0, 4)), int(rng.integers(0, 6))
    topk = rng.integers(-2, block_size * (cols + 1) + 1, (tokens, width)).astype(I32)
    token_to_req = rng.integers(-1, requests + 1, tokens).tolist()
    table = rng.integers(-1, 1000, (requests, cols)).astype(I32)
    valid = (rng.random(tokens) < 0.85).tolist()
    return topk, token_to_req, table, block_size, valid, bool(rng.random() < 0.5)


# --- the C128A group's ops at fixed addresses (graph capture, streams, allocation) ---

GROUP_OPS_WIDTH = 1024


def group_ops_steps():
    """Two batches of the same shape (same query lengths), different values."""
    q = [1, 2, 2, 1, 37]
    first = make_batch(q, [10, 500, 70_000, 3, 9_000], rng=np.random.default_rng(1), pad_tokens=2,
                       table_cols=600, threshold=2)
    second = make_batch(q, [130_000, 255, 126, 127_000, 0], rng=np.random.default_rng(2),
                        pad_tokens=2, table_cols=600, threshold=2)
    return first, second


class GroupOpsStep:
    """Device inputs and poisoned outputs for the three ops, kept at fixed addresses."""

    def __init__(self, batch, kind):
        self.kind = kind
        self.nd = batch.split()[2]
        T = batch.num_tokens
        self.T = T
        self.inputs = dict(qsl=to_kind(batch.qsl, kind), seq=to_kind(batch.seq_lens, kind),
                           bt=to_kind(batch.block_table, kind), pos=to_kind(batch.positions, kind),
                           sm=to_kind(batch.slot_mapping, kind))
        self.req = to_kind(np.full(T + EXTRA_ROWS, -7, np.int32), kind)
        self.csm = to_kind(np.full(T + EXTRA_ROWS, -7, np.int64), kind)
        self.gd = to_kind(np.full((self.nd + 1, GROUP_OPS_WIDTH + EXTRA_COLS), -7, np.int32), kind)
        self.lens = to_kind(np.full(self.nd + 1, -7, np.int32), kind)
        self.pf = to_kind(np.full((T - self.nd + 1, GROUP_OPS_WIDTH + EXTRA_COLS), -7, np.int32), kind)

    def run(self):
        i = self.inputs
        d4.token_to_req_indices(i["qsl"], self.T, out=self.req)
        d4.get_compressed_slot_mapping(self.T, i["sm"], i["qsl"], i["seq"], i["bt"], 2, 128,
                                       out=self.csm)
        d4.build_c128a_topk_metadata(i["pos"], 128, self.nd, self.req, i["bt"], 2, i["sm"], self.gd,
                                     self.lens, self.pf, max_compressed_tokens=GROUP_OPS_WIDTH)

    def load(self, batch):
        """Overwrite the inputs in place with another batch of the same shape."""
        for key, value in (("qsl", batch.qsl), ("seq", batch.seq_lens), ("bt", batch.block_table),
                           ("pos", batch.positions), ("sm", batch.slot_mapping)):
            target = self.inputs[key]
            target[...] = to_kind(value, self.kind)

    def results(self):
        return [to_numpy(x) for x in (self.req, self.csm, self.gd, self.lens, self.pf)]


def group_ops_expected(batch, kind_like):
    """The same ops on the numpy CPU path (itself checked against the reference)."""
    step = GroupOpsStep(batch, "numpy")
    step.run()
    return step.results()


def assert_all_equal(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def torch_capture(fn):
    """Warm ``fn`` up on a side stream (compiles and loads), then capture it;
    returns the graph and what the captured call returned."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def capture_and_replay(kind, run, inputs, second, outputs):
    """run() captured once on kind's stream (torch's graph or a CuPy stream
    capture), then the second step's host values written into the captured
    ``inputs``, each of ``outputs`` (device array, host start) reset, and the
    graph replayed."""
    if kind == "torch_cuda":
        import torch
        graph, _ = torch_capture(run)
        for array, value in zip(inputs, second):
            array.copy_(torch.from_numpy(value))
        for array, start in outputs:
            array.copy_(torch.from_numpy(start))
        graph.replay()
        torch.cuda.synchronize()
        return
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run()
        stream.synchronize()
        stream.begin_capture()
        run()
        graph = stream.end_capture()
        for array, value in zip(inputs, second):
            array[...] = cupy.asarray(value)
        for array, start in outputs:
            array[...] = cupy.asarray(start)
    graph.launch(stream)
    stream.synchronize()


def builder_results(md):
    return [to_numpy(x) for x in (md.req_id_per_token, md.slot_mapping,
                                  md.c128a_global_decode_topk_indices,
                                  md.c128a_decode_topk_lens, md.c128a_prefill_topk_indices)]


def expected_build(batch):
    builder = d4.DeepseekV4MetadataBuilder(128, 1 << 18, 64, num_speculative_tokens=1, like="numpy")
    return builder_results(builder.build(0, common_metadata(batch, "numpy")))


def refresh_group_step(cm, batch, kind):
    for field, value in (("query_start_loc", batch.qsl), ("seq_lens", batch.seq_lens),
                         ("block_table_tensor", batch.block_table), ("positions", batch.positions),
                         ("slot_mapping", batch.slot_mapping)):
        getattr(cm, field)[...] = to_kind(value, kind)


# --- every per-layer and indexer op of a C4A layer step at fixed addresses ---

LAYER_QUERY_LENS = [2, 2, 1, 40]             # three MTP decodes and a prefill, same shape every step


LAYER_DECODE_TOKENS, LAYER_DECODES = 5, 3


LAYER_TOKENS = sum(LAYER_QUERY_LENS) + 3           # three padding tokens


LAYER_TOP_K, LAYER_WINDOW = 512, 128


def layer_step_inputs(seed):
    """One step's numpy inputs; every seed gives the same shapes."""
    rng = np.random.default_rng(seed)
    seq = np.array(LAYER_QUERY_LENS) + rng.integers(200, 1900, len(LAYER_QUERY_LENS))
    qsl = np.concatenate([[0], np.cumsum(LAYER_QUERY_LENS)]).astype(I32)
    token_to_req = np.concatenate([np.repeat(np.arange(4), LAYER_QUERY_LENS), [0] * 3]).astype(I32)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(LAYER_QUERY_LENS, seq)]
                               + [np.zeros(3, int)]).astype(I64)
    return dict(qsl=qsl, seq=seq.astype(I32), token_to_req=token_to_req, positions=positions,
                valid=np.arange(LAYER_TOKENS) < LAYER_TOKENS - 3,
                swa_table=rng.integers(0, 1 << 20, (4, 40)).astype(I32),
                c4a_table=rng.integers(0, 1 << 20, (4, 10)).astype(I32),
                gather=np.zeros(1, I32))


class LayerOpsStep:
    """Device inputs and outputs at fixed addresses, and every op of a C4A layer step."""

    def __init__(self, kind, inputs):
        self.kind = kind
        self.inputs = {name: to_kind(value, kind) for name, value in inputs.items()}
        empty = lambda *shape: to_kind(np.full(shape, -7, I32), kind)
        self.outputs = dict(
            swa=(empty(LAYER_DECODE_TOKENS, 1, LAYER_WINDOW), empty(LAYER_DECODE_TOKENS)),
            topk=empty(LAYER_TOKENS, LAYER_TOP_K), lens=empty(LAYER_DECODE_TOKENS),
            combined=(empty(LAYER_TOKENS - LAYER_DECODE_TOKENS, 640), empty(LAYER_TOKENS - LAYER_DECODE_TOKENS)),
            prefill=(empty(2), empty(600), empty(40), empty(40)),
            decode=(empty(16), empty(LAYER_DECODE_TOKENS), empty(LAYER_DECODE_TOKENS),
                    empty(LAYER_DECODE_TOKENS, 10), empty(LAYER_DECODES)))

    def run(self):
        i, o = self.inputs, self.outputs
        d4.compute_swa_indices_and_lens(LAYER_WINDOW, i["qsl"], i["seq"], i["token_to_req"], i["valid"],
                                        i["swa_table"], 64, 0, LAYER_DECODE_TOKENS, out=o["swa"])
        d4.compute_prefill_gather_lens(i["qsl"], i["seq"], LAYER_DECODES, 1, out=i["gather"])
        d4.fill_short_context_topk_indices(i["positions"], LAYER_TOP_K, 4, out=o["topk"])
        d4.compute_global_topk_indices_and_lens(o["topk"][:LAYER_DECODE_TOKENS], i["token_to_req"],
                                                i["c4a_table"], 64, i["valid"],
                                                out=(o["topk"], o["lens"]))
        d4.combine_topk_swa_indices(o["topk"][LAYER_DECODE_TOKENS:], i["qsl"][LAYER_DECODES:],
                                    i["seq"][LAYER_DECODES:], i["gather"], LAYER_WINDOW, 4, LAYER_TOP_K, 700, 500,
                                    out=o["combined"])
        d4.build_indexer_prefill_chunk_metadata(i["qsl"][LAYER_DECODES:], i["seq"][LAYER_DECODES:], 4, 0, 40,
                                                num_compressed=600, out=o["prefill"])
        d4.build_indexer_decode_metadata(i["qsl"][:LAYER_DECODES + 1], i["seq"], i["c4a_table"],
                                         LAYER_DECODE_TOKENS, 4, out=o["decode"])

    def load(self, inputs):
        for name, value in inputs.items():
            self.inputs[name][...] = to_kind(value, self.kind)

    def results(self):
        flat = []
        for value in self.outputs.values():
            flat += list(value) if isinstance(value, tuple) else [value]
        return [to_numpy(x) for x in flat + [self.inputs["gather"]]]


def layer_ops_expected(inputs):
    step = LayerOpsStep("numpy", inputs)
    step.run()
    return step.results()


# --- the step builder's groups ---

STEP_MAX_MODEL_LEN, STEP_SPEC = 8192, 1

def make_step(rng, decodes, prefill_lens, pad=0, short=False, kind="numpy", decode_len=None,
              max_model_len=STEP_MAX_MODEL_LEN):
    """One CommonAttentionMetadata per group: shared layout, own tables and slots.
    Decodes have 1 to 1 + STEP_SPEC tokens (``decode_len`` each when given)."""
    decode_lens = (rng.integers(1, STEP_SPEC + 2, decodes) if decode_len is None
                   else [decode_len] * decodes)
    query = np.array(list(decode_lens) + list(prefill_lens), I64)
    top = 300 if short else max_model_len - int(query.max(initial=1))
    seq = query + rng.integers(0, top, len(query))
    if len(seq):
        seq[rng.integers(len(seq))] = min(int(seq.max()), max_model_len)
    qsl = np.concatenate([[0], np.cumsum(query)]).astype(I32)
    tokens = int(qsl[-1]) + pad
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query, seq)] +
                               [rng.integers(-5, 9, pad)]).astype(I32 if short else I64)
    padding = rng.random(tokens) < 0.05        # every group's tokens of slot -1
    padding[int(qsl[-1]):] = True
    groups = {}
    for group, block in (("swa", 64), ("c4a", 256), ("indexer", 256), ("c128a", 256)):
        table = rng.integers(0, 1 << 16, (len(query), -(-max_model_len // block)), dtype=I32)
        slots = rng.integers(0, 1 << 20, tokens).astype(I64)
        slots[padding] = -1
        groups[group] = d4.CommonAttentionMetadata(
            query_start_loc=None, query_start_loc_cpu=qsl.copy(), seq_lens=None,
            block_table_tensor=to_kind(table, kind), slot_mapping=to_kind(slots, kind),
            num_reqs=len(query), num_actual_tokens=tokens,
            max_query_len=int(query.max(initial=0)), max_seq_len=int(seq.max(initial=0)),
            positions=None, seq_lens_cpu=seq.astype(I32))
    shared = dict(query_start_loc=to_kind(qsl, kind), seq_lens=to_kind(seq.astype(I32), kind),
                  positions=to_kind(positions, kind))
    for cm in groups.values():
        for name, value in shared.items():
            setattr(cm, name, value)
    return groups


# --- a chain of ops that read what the op before wrote ---

CHAIN_POISON = 0x7A7A7A7A


CHAIN_REQUESTS, CHAIN_TOKENS, CHAIN_WINDOW, CHAIN_BLOCK, CHAIN_TABLE_COLS, CHAIN_TOP_K = 12, 40, 128, 64, 300, 512


def chain_step(rng):
    """Query layout of CHAIN_REQUESTS requests over CHAIN_TOKENS tokens (one or more each),
    contexts, a few padding tokens and -1 table tails, the indexer's top-k."""
    cuts = np.sort(rng.choice(np.arange(1, CHAIN_TOKENS), CHAIN_REQUESTS - 1, replace=False))
    qsl = np.concatenate([[0], cuts, [CHAIN_TOKENS]]).astype(I32)
    seq = (np.diff(qsl) + rng.integers(0, CHAIN_TABLE_COLS * CHAIN_BLOCK - CHAIN_TOKENS, CHAIN_REQUESTS)).astype(I32)
    table = rng.integers(0, 1 << 20, (CHAIN_REQUESTS, CHAIN_TABLE_COLS)).astype(I32)
    table[:, rng.integers(100, CHAIN_TABLE_COLS):] = -1
    valid = rng.random(CHAIN_TOKENS) < 0.9
    topk = rng.integers(-1, CHAIN_TABLE_COLS * CHAIN_BLOCK // 4, (CHAIN_TOKENS, CHAIN_TOP_K)).astype(I32)
    return {"qsl": qsl, "seq": seq, "table": table, "valid": valid, "topk": topk}


def run_chain(inputs, outputs):
    """Token map, then SWA rows and global top-k rows that read the map."""
    token_map, swa_rows, swa_lens, topk_rows, topk_lens = outputs
    d4.token_to_req_indices(inputs["qsl"], CHAIN_TOKENS, out=token_map)
    d4.compute_swa_indices_and_lens(CHAIN_WINDOW, inputs["qsl"], inputs["seq"], token_map,
                                    inputs["valid"], inputs["table"], CHAIN_BLOCK,
                                    out=(swa_rows, swa_lens))
    d4.compute_global_topk_indices_and_lens(inputs["topk"], token_map, inputs["table"], CHAIN_BLOCK,
                                            inputs["valid"], out=(topk_rows, topk_lens))


def chain_outputs():
    return [np.full(shape, CHAIN_POISON, I32) for shape in
            ((CHAIN_TOKENS,), (CHAIN_TOKENS, 1, CHAIN_WINDOW), (CHAIN_TOKENS,), (CHAIN_TOKENS, CHAIN_TOP_K), (CHAIN_TOKENS,))]


def chain_expected(step):
    outputs = chain_outputs()
    run_chain(step, outputs)
    return outputs


def assert_chain(outputs, step):
    for got, want in zip(outputs, chain_expected(step)):
        np.testing.assert_array_equal(to_numpy(got), want)


def refill_arrays(arrays, values, kind):
    for array, value in zip(arrays, values):
        array[...] = to_kind(value, kind)
