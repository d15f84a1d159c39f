"""Launch geometry: threads per block, how the grids are cut, and which
shapes a kernel may have compiled in."""
from __future__ import annotations

from .device import sm_count
from .spec import cdiv

#: The value of a family's int axis whose kernel reads the quantity from its struct
#: (passed to kernels as DSV4_RUN_TIME).
RUN_TIME = 0
#: Threads per block of every kernel (the kernels' __launch_bounds__, passed as DSV4_THREADS).
THREADS = 256
#: Chunks of a prefill plan one step launch carries (a longer plan takes more launches;
#: passed to kernels as DSV4_MAX_PLAN_CHUNKS).
MAX_PLAN_CHUNKS = 32
#: Grid-stride kernels never ask for more blocks than this.
MAX_GRID_STRIDE_BLOCKS = 1 << 20
#: CUDA's largest grid (blocks in x): the bound of a kernel with no grid-stride loop.
MAX_GRID_BLOCKS = 2**31 - 1
#: int32 columns of a 16-byte store.
VECTOR_COLUMNS = 4
#: Columns per block of a row piece (multiples of VECTOR_COLUMNS keep 16-byte stores
#: aligned): at least a store for each thread, so no thread of a piece idles.
ROW_PIECE_SIZES = tuple(VECTOR_COLUMNS * THREADS << k for k in range(3))


#: Threads of a warp (passed to kernels as DSV4_WARP_LANES): kernels with one warp per
#: row give each row WARP_LANES threads.
WARP_LANES = 32
#: Columns a warp copies of a long row: at most four 16-byte stores per lane, so
#: a row of 4096 block ids (1M context) is copied by 8 warps at once instead of
#: one warp waiting on 8 round trips.
WARP_PIECE = 512
#: Narrower pieces for few rows: one or two stores per lane, a round trip each (a
#: lane's next load waits for its store before it: they may alias).
#: Every piece is a power of two (the kernel shifts).
NARROW_WARP_PIECES = (128, 256)
#: Warps per SM up to which the indexer's decode rows take narrower pieces.
NARROW_PIECE_WARPS_PER_SM = 8


def warp_pieces(columns: int, piece: int = WARP_PIECE) -> int:
    """Pieces of ``piece`` columns of a row (at least 1, which writes the row's scalars)."""
    return max(cdiv(columns, piece), 1)


def indexer_piece(num_tokens: int, columns: int, device: int) -> int:
    """Columns per warp of the indexer's decode rows (passed to kernels as
    IndexerDecodeParams.piece_shift, its log2): the narrowest piece whose warps stay
    within NARROW_PIECE_WARPS_PER_SM per SM (a decode step of 1-66 tokens at a
    1M context), else WARP_PIECE; WARP_PIECE on the CPU (device -1)."""
    if device >= 0:
        budget = NARROW_PIECE_WARPS_PER_SM * sm_count(device)
        for piece in NARROW_WARP_PIECES:
            if num_tokens * warp_pieces(columns, piece) <= budget:
                return piece
    return WARP_PIECE


def indexer_decode_blocks(num_tokens: int, pieces: int, lengths: int, num_reqs: int) -> int:
    """Blocks of the indexer's decode metadata, which has no grid-stride loop: a
    warp for each of a token's ``pieces`` (warp_pieces) pieces of its block-table
    row, and a thread for each length to zero past num_tokens and for each
    request's query length. Fewer than 2^31 pieces in all (the kernel divides
    in 32 bits), else a ValueError naming ``block_table``."""
    if num_tokens * pieces >= 2**31:
        raise ValueError(f"block_table: expected fewer than 2^31 row pieces of "
                         f"{num_tokens} tokens, got {pieces} pieces per row")
    return cdiv(max(num_tokens * pieces * WARP_LANES, lengths - num_tokens, num_reqs), THREADS)


#: Threads per row of the SWA and short-context rows: a warp, or for few rows four warps.
ROW_LANES = (WARP_LANES, 4 * WARP_LANES)


def row_lanes(num_rows: int, device: int) -> int:
    """Threads per SWA or short-context row: four warps while the rows are at
    most one per SM (few rows finish sooner spread over more threads), else a
    warp (many rows are faster a warp each, docs/performance.md)."""
    return ROW_LANES[num_rows <= sm_count(device)]


#: Threads per combined row: a warp, or a block for rows at least WIDE_ROW wide.
COMBINE_LANES = (WARP_LANES, THREADS)
WIDE_ROW = 2048


def combine_lanes(width: int) -> int:
    """Threads per combined row of ``width`` columns: a block for wide rows (the
    C128A layers', 8320 at a 1M context: near the write ceiling that way), a
    warp otherwise."""
    return COMBINE_LANES[width >= WIDE_ROW]


def request_guess_shift(num_tokens: int, num_reqs: int) -> int:
    """The SWA rows guess token t's request as ``t >> shift`` and read that
    request's layout beside t's own request (one load level less when right):
    ``log2(num_tokens / num_reqs)`` when the tokens are a power-of-two multiple
    of the requests (a decode batch of 1, 2, 4... tokens per request, MTP
    included, and padding that pads both alike), else 0 (a one-token decode's
    request). A wrong guess costs the row one more dependent read, nothing
    else."""
    if num_reqs <= 0 or num_tokens < num_reqs or num_tokens % num_reqs:
        return 0
    per_request = num_tokens // num_reqs
    return per_request.bit_length() - 1 if per_request & (per_request - 1) == 0 else 0


#: A kernel with its row width compiled in computes window positions in 32 bits,
#: clamped at this: the host picks it only when a table row's span plus the
#: window stays under it (the SWA rows, passed to kernels as DSV4_POSITION_LIMIT).
POSITION_LIMIT = 1 << 30


def row_block_threads(lanes: int) -> int:
    """Threads of the block of an SWA or short-context kernel whose rows take
    ``lanes`` threads: a row of several warps has a block of its own (the
    shape of vLLM's program per row), a warp's row shares THREADS."""
    return lanes if lanes > WARP_LANES else THREADS


def row_lane_blocks(num_rows: int, lanes: int = WARP_LANES, threads: int = THREADS) -> int:
    """Blocks of ``threads`` giving each of num_rows rows ``lanes`` threads (at
    least 1 block): the row kernels (fill_rows) have no grid-stride loop."""
    return max(1, cdiv(num_rows * lanes, threads))


def topk_row_threads(width: int) -> int:
    """Threads of a global top-k row's block: a 16-byte vector of the row each,
    at most THREADS (K = 512: 128); THREADS for a run-time width (0)."""
    return min(THREADS, width // VECTOR_COLUMNS) if width > 0 else THREADS


def grid_stride_row_blocks(num_rows: int) -> int:
    """Blocks of a grid-stride loop over rows, a block per row while they last
    (0 for no rows)."""
    return min(num_rows, MAX_GRID_STRIDE_BLOCKS)


def one_block_per_row(num_rows: int, name: str) -> int:
    """Blocks of a kernel that gives each row a block of its own and has no
    grid-stride loop (the global top-k rows; 0 for no rows), checked to fit
    one grid (``check_grid``, naming argument ``name``)."""
    return check_grid(num_rows, num_rows, name)


def check_grid(blocks: int, rows: int, name: str) -> int:
    """``blocks`` when one launch can have that many, else a ValueError about
    the ``rows`` rows of argument ``name`` (before anything is written)."""
    if blocks > MAX_GRID_BLOCKS:
        raise ValueError(f"{name}: expected rows that fit one grid of at most "
                         f"{MAX_GRID_BLOCKS} blocks, got {rows} rows ({blocks} blocks)")
    return blocks


def elementwise_blocks(n: int) -> int:
    """Blocks of THREADS for a grid-stride loop over n elements (0 for none)."""
    return min(cdiv(n, THREADS), MAX_GRID_STRIDE_BLOCKS)


def row_geometry(num_rows: int, width: int, device: int) -> tuple[int, int]:
    """(columns per block, blocks per row) for rows of ``width`` columns.

    The smallest piece that keeps the grid within two blocks per SM: a single
    decode row of a 1M context spreads over 8 SMs, larger batches give each
    thread up to four 16-byte stores. A grid of more blocks waits longer for
    their dispatch than it gains (docs/performance.md).
    """
    limit = 2 * sm_count(device)
    width = max(width, 1)
    for per_block in ROW_PIECE_SIZES[:-1]:
        if num_rows * cdiv(width, per_block) <= limit:
            return per_block, cdiv(width, per_block)
    return ROW_PIECE_SIZES[-1], cdiv(width, ROW_PIECE_SIZES[-1])


def row_chunks(num_rows: int, width: int, device: int) -> tuple:
    """``(cols_per_block, chunks, row_blocks)`` of ``num_rows`` rows: at least one
    block per row, so a row of width 0 still gets its length written."""
    if not num_rows:
        return 0, 1, 0
    per_block, chunks = row_geometry(num_rows, width, device)
    return per_block, chunks, num_rows * chunks
