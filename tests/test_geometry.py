"""Launch geometry: the row kernels (fill_rows) have no grid-stride loop,
so every row must get its threads (a warp, or four for few short-context rows),
within CUDA's grid limit; the SWA rows' request guess."""
from __future__ import annotations

import pytest

from dsv4_cupy import device, geometry

MAX_GRID_X = 2**31 - 1


ROW_SHAPES = sorted({*((lanes, geometry.row_block_threads(lanes)) for lanes in geometry.ROW_LANES),
                     *((lanes, geometry.THREADS) for lanes in geometry.COMBINE_LANES)})


@pytest.mark.parametrize("lanes,threads", ROW_SHAPES)
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 8 << 20, (8 << 20) + 1, 2**31 - 1])
def test_every_row_gets_its_lanes(rows, lanes, threads):
    blocks = geometry.row_lane_blocks(rows, lanes, threads)
    assert 1 <= blocks <= MAX_GRID_X
    assert blocks * threads // lanes >= rows
    assert threads % lanes == 0         # a block holds whole rows


@pytest.mark.parametrize("lanes,threads", [(32, 256), (128, 128)])
def test_rows_of_several_warps_have_a_block_each(lanes, threads):
    """An SWA or short-context row of four warps is a block of 128 threads, the
    shape of upstream's program per row; a warp's rows share a block of THREADS."""
    assert geometry.row_block_threads(lanes) == threads


@pytest.mark.parametrize("num_tokens,num_reqs,shift", [
    (1, 1, 0), (64, 64, 0), (512, 256, 1), (1024, 256, 2), (64, 8, 3), (8192, 1, 13),
    (12, 4, 0), (10, 3, 0), (65, 32, 0), (3, 6, 0), (0, 5, 0), (0, 0, 0), (5, 0, 0)])
def test_request_guess_shift(num_tokens, num_reqs, shift):
    """Token t of a batch of requests of 2^shift tokens each is in request
    t >> shift; any other batch keeps the one-token guess (shift 0)."""
    assert geometry.request_guess_shift(num_tokens, num_reqs) == shift
    if shift:
        assert all((t >> shift) == t // (num_tokens // num_reqs) for t in range(num_tokens))


@pytest.mark.parametrize("num_tokens,columns,piece", [
    (1, 4096, 128), (33, 4096, 128), (34, 4096, 256), (66, 4096, 256), (67, 4096, 512),
    (256, 4096, 512), (1056, 128, 128), (1057, 128, 512), (0, 0, 128)])
def test_the_indexer_takes_narrow_pieces_only_for_few_warps(monkeypatch, num_tokens, columns,
                                                           piece):
    """At most eight warps per SM (132 SMs: 1056): 128 columns a warp up to 33
    tokens at a 1M context (4096 columns, 32 pieces each), 256 up to 66."""
    monkeypatch.setitem(device._SM_COUNT, 0, 132)
    assert geometry.indexer_piece(num_tokens, columns, 0) == piece
    assert geometry.indexer_piece(num_tokens, columns, -1) == geometry.WARP_PIECE


@pytest.mark.parametrize("rows,width,per_block", [
    (1, 8192, 1024), (16, 8192, 1024), (33, 8192, 1024), (34, 8192, 2048), (64, 8192, 2048),
    (66, 8192, 2048), (67, 8192, 4096), (256, 8192, 4096), (1, 1, 1024), (300, 0, 4096)])
def test_c128a_row_pieces_give_every_thread_a_store_within_two_blocks_per_sm(
        monkeypatch, rows, width, per_block):
    """A C128A row piece holds a 16-byte store for each of a block's threads
    at least, and is the least piece whose grid stays within two blocks per SM
    (132 SMs: 264), or the largest; the pieces cover the row."""
    monkeypatch.setitem(device._SM_COUNT, 0, 132)
    got, chunks, blocks = geometry.row_chunks(rows, width, 0)
    assert (got, blocks) == (per_block, rows * chunks)
    assert got >= geometry.VECTOR_COLUMNS * geometry.THREADS and got % geometry.VECTOR_COLUMNS == 0
    assert (chunks - 1) * got < max(width, 1) <= chunks * got
    assert blocks <= 2 * 132 or got == geometry.ROW_PIECE_SIZES[-1]


@pytest.mark.parametrize("num_tokens,pieces,lengths,num_reqs", [
    (1, 32, 8192, 1), (64, 16, 8192, 64), (256, 8, 256, 256), (3, 1, 2, 5), (0, 1, 9, 0),
    (0, 1, 0, 0), (2**26 - 1, 32, 2**26, 2**20)])
def test_the_indexer_decode_grid_has_a_warp_per_piece_and_a_thread_per_write(
        num_tokens, pieces, lengths, num_reqs):
    """The indexer's decode rows have no loop: a warp for each piece of every
    token's row, a thread for each length past num_tokens and each request, and
    no block more than that."""
    blocks = geometry.indexer_decode_blocks(num_tokens, pieces, lengths, num_reqs)
    threads = blocks * geometry.THREADS
    needed = max(num_tokens * pieces * geometry.WARP_LANES, lengths - num_tokens, num_reqs)
    assert threads >= needed > threads - geometry.THREADS or blocks == needed == 0


def test_indexer_decode_pieces_past_32_bits_are_a_value_error():
    """The kernel divides a warp's index in 32 bits."""
    assert geometry.indexer_decode_blocks(2**26, 31, 0, 1) == 2**26 * 31 // 8
    with pytest.raises(ValueError, match=r"^block_table: expected fewer than 2\^31 row pieces "
                                         r"of 67108864 tokens, got 32 pieces per row$"):
        geometry.indexer_decode_blocks(2**26, 32, 0, 1)


@pytest.mark.parametrize("rows", [0, 1, 512, 2**31 - 1])
def test_a_block_per_row_within_the_grid(rows):
    """The global top-k rows have no grid-stride loop: a block each, none for no rows."""
    assert geometry.one_block_per_row(rows, "topk_indices") == rows <= MAX_GRID_X
    assert geometry.check_grid(rows, rows, "topk_indices") == rows


def test_rows_past_the_grid_limit_are_a_value_error():
    assert geometry.MAX_GRID_BLOCKS == MAX_GRID_X
    with pytest.raises(ValueError, match=r"^topk_indices: expected rows that fit one grid of "
                                         r"at most 2147483647 blocks, got 2147483648 rows "):
        geometry.one_block_per_row(2**31, "topk_indices")


@pytest.mark.parametrize("width,threads", [(0, 256), (512, 128), (1024, 256), (2048, 256)])
def test_a_global_top_k_row_is_a_vector_per_thread(width, threads):
    """A compiled-in K's row is one 16-byte vector per thread, whole warps, at
    most a block of THREADS; the run-time width (0) takes THREADS."""
    assert geometry.topk_row_threads(width) == threads
    assert threads % geometry.WARP_LANES == 0 and threads <= geometry.THREADS
