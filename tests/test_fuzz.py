"""Fuzzing: 10,000 random batches through every op, against the reference on
the CPU path (CI) and against the CPU path on the GPU (the H200), plus
adversarial batches: empty, all padding, one 65,536-token request, positions
near 2^20 and past max_model_len, block tables with -1 tails."""
from __future__ import annotations

import numpy as np
import pytest

import dsv4_cupy as d4

from conftest import GPU_KINDS, KINDS, to_kind, to_numpy
from helpers import check_c128a, check_slot_mapping, check_token_map, make_batch, random_batch

FUZZ_BATCHES = 10_000


def fuzz_batch(rng):
    ratio = 128 if rng.random() < 0.7 else 4
    return random_batch(rng, ratio=ratio, max_decodes=5, max_prefills=2, max_prefill_len=24,
                        max_prefix=(1 << 20) + 4096), int(rng.choice([0, 1, 17, 128, 256]))


def test_fuzz_cpu_against_reference():
    rng = np.random.default_rng(20261202)
    for _ in range(FUZZ_BATCHES):
        batch, width = fuzz_batch(rng)
        check_token_map(batch, "numpy")
        check_slot_mapping(batch, "numpy")
        check_c128a(batch, "numpy", width, rng.choice([np.int32, np.int64]),
                    rng.choice([np.int32, np.int64]))


def test_fuzz_split_against_reference():
    """``split_decodes_and_prefills`` (a numba scan) against the parity
    reference: decodes (0 to threshold tokens, padding rows of 0 among them)
    then prefills, every threshold, require_uniform, flag and is_prefilling,
    int32 and int64, the maximum given or read."""
    from reference_upstream import split_decodes_and_prefills_v2
    rng = np.random.default_rng(20261204)
    for _ in range(FUZZ_BATCHES):
        threshold = int(rng.integers(1, 5))
        decodes = rng.integers(0, threshold + 1, int(rng.integers(0, 6)))
        if rng.random() < 0.5:                    # uniform decodes, padding rows among them
            decodes = np.where(decodes == 0, 0, threshold)
        prefills = rng.integers(1, 3 * threshold, int(rng.integers(0, 4)))
        query = np.concatenate([decodes, prefills]).astype(np.int64)
        qsl = np.concatenate([[0], np.cumsum(query)]).astype(rng.choice([np.int32, np.int64]))
        tokens = int(qsl[-1]) + int(rng.integers(0, 3))
        uniform, flag = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
        prefilling = rng.random(len(query)) < 0.2
        longest = int(query.max(initial=0))
        want = split_decodes_and_prefills_v2(qsl.tolist(), tokens, longest, threshold, uniform,
                                             flag, None if flag else prefilling.tolist())
        got = d4.split_decodes_and_prefills(
            qsl, threshold, uniform, flag, is_prefilling=None if flag else prefilling,
            num_actual_tokens=tokens, max_query_len=longest if rng.random() < 0.5 else None)
        assert got == want, (qsl, threshold, uniform, flag, prefilling)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", GPU_KINDS)
def test_fuzz_gpu_against_cpu(kind):
    """GPU against the CPU path (itself fuzzed against the reference above); one
    in fifty batches also goes through the reference directly."""
    rng = np.random.default_rng(7 if kind == "cupy" else 8)
    for i in range(FUZZ_BATCHES // len(GPU_KINDS)):
        batch, width = fuzz_batch(rng)
        if i % 50 == 0:
            check_c128a(batch, kind, width)
            check_slot_mapping(batch, kind)
            continue
        num_decodes, _, nd, num_prefill = batch.split()
        total = nd + num_prefill
        t2r = batch.token_map()
        run = lambda k: [to_numpy(x) for x in d4.build_c128a_topk_metadata(
            to_kind(batch.positions[:total], k), batch.ratio, nd, to_kind(t2r, k),
            to_kind(batch.block_table[:max(num_decodes, 1)], k), batch.storage_block_size,
            to_kind(batch.slot_mapping, k), max_compressed_tokens=width)] + [
            to_numpy(d4.get_compressed_slot_mapping(
                batch.num_tokens, None, to_kind(batch.qsl, k), to_kind(batch.seq_lens, k),
                to_kind(batch.block_table, k), batch.storage_block_size, batch.ratio)),
            to_numpy(d4.token_to_req_indices(to_kind(batch.qsl, k), batch.num_tokens))]
        for got, want in zip(run(kind), run("numpy")):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_a_garbage_query_layout_maps_tokens_alike_on_every_path(kind):
    """request_of tries token t's request as t (a one-token decode step's),
    then as t // qsl[1] (uniform speculative decodes), before its binary
    search; on a query_start_loc that is not non-decreasing the guesses and
    the search may disagree, and every path answers as the CPU path's
    request_of does: within [0, R), a guess when it holds, the search's
    answer otherwise."""
    from dsv4_cupy.cpu import request_of
    rng = np.random.default_rng(5)
    for _ in range(30):
        num_reqs = int(rng.integers(2, 40))
        num_tokens = int(rng.integers(1, 80))
        qsl = rng.integers(-3, num_tokens, num_reqs + 1).astype(np.int32)
        qsl[-1] = num_tokens                        # every token before qsl[R]: mapped
        want = [request_of(qsl, num_reqs, t) for t in range(num_tokens)]
        got = d4.token_to_req_indices(to_kind(qsl, kind), num_tokens)
        np.testing.assert_array_equal(to_numpy(got), want)
        guessed = [t for t in range(min(num_tokens, num_reqs - 1)) if qsl[t] <= t < qsl[t + 1]]
        assert all(want[t] == t for t in guessed)


@pytest.mark.parametrize("kind", KINDS)
def test_request_of_answers_every_valid_layout_as_a_search_does(kind):
    """On a non-decreasing query_start_loc, empty requests and padding tokens
    included, request_of's guesses (the last request taken for any token at
    or past its start, so a padding token is answered in the first round)
    give the first i with qsl[i + 1] > t, clamped to R - 1: numpy's search.
    The token map maps padding tokens (t >= qsl[R]) to 0 on every path."""
    from dsv4_cupy.cpu import request_of
    rng = np.random.default_rng(6)
    for _ in range(40):
        num_reqs = int(rng.integers(1, 40))
        lengths = rng.integers(0, 4, num_reqs) * (rng.random(num_reqs) < 0.8)
        qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        num_tokens = int(qsl[-1]) + int(rng.integers(0, 6))        # padding tokens after
        tokens = np.arange(num_tokens)
        search = np.minimum(np.searchsorted(qsl[1:], tokens, side="right"), num_reqs - 1)
        np.testing.assert_array_equal([request_of(qsl, num_reqs, t) for t in tokens], search)
        got = d4.token_to_req_indices(to_kind(qsl, kind), num_tokens)
        np.testing.assert_array_equal(to_numpy(got), np.where(tokens < qsl[-1], search, 0))


@pytest.mark.parametrize("kind", KINDS)
def test_adversarial_empty_and_all_padding(kind):
    for batch in (make_batch([], []), make_batch([], [], pad_tokens=7),
                  make_batch([0, 0, 0], [0, 5, 10], pad_tokens=4)):
        check_token_map(batch, kind)
        check_slot_mapping(batch, kind)
        check_c128a(batch, kind, 128)


def check_one_long_request(kind, prefix, width):
    """One request of 65536 prefill tokens behind ``prefix``: its token map,
    slots and C128A prefill rows at ``width`` columns, compared a slab of rows
    at a time (the expected rows stay small)."""
    batch = make_batch([65536], [prefix], rng=np.random.default_rng(5))
    check_token_map(batch, kind)
    check_slot_mapping(batch, kind)
    gd, lens, pf = d4.build_c128a_topk_metadata(
        to_kind(batch.positions, kind), 128, 0, to_kind(batch.token_map(), kind),
        to_kind(batch.block_table, kind), 2, to_kind(batch.slot_mapping, kind),
        max_compressed_tokens=width)
    pf = to_numpy(pf)
    visible = np.minimum((batch.positions + 1) // 128, width)
    cols = np.arange(width)
    for start in range(0, pf.shape[0], 4096):
        rows = slice(start, start + 4096)
        np.testing.assert_array_equal(pf[rows], np.where(cols < visible[rows, None], cols, -1))


@pytest.mark.parametrize("kind", KINDS)
def test_adversarial_one_request_of_65536_tokens(kind):
    """Positions from 10 to 65545: every row length from 0 to the full width."""
    check_one_long_request(kind, 10, 512)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_adversarial_one_request_of_65536_tokens_at_two_to_the_20(kind):
    """Positions up to 2^20 - 11 at W = 8192 (2 GB of rows)."""
    check_one_long_request(kind, (1 << 20) - 65536 - 10, 8192)


@pytest.mark.parametrize("kind", KINDS)
def test_adversarial_positions_near_and_past_two_to_the_20(kind):
    rng = np.random.default_rng(11)
    prefixes = [(1 << 20) - 3, (1 << 20) - 1, 1 << 20, (1 << 20) + 777, 5]
    batch = make_batch([1, 1, 1, 1, 200], prefixes, rng=rng, negative_tail=True)
    for width in (128, 8192):
        check_c128a(batch, kind, width)
    check_slot_mapping(batch, kind)
    check_slot_mapping(make_batch([64] * 3, prefixes[:3], ratio=4, rng=rng, negative_tail=True),
                       kind)
