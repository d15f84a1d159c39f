"""Opt-in full validation (``validate="full"``): data-dependent preconditions.

The default mode checks only what the host already knows (kinds, dtypes,
shapes, scalars) and never reads device memory; out-of-range data is then
contained by the kernels (clamped or masked), not reported. ``"full"`` copies
the inputs to the host (a sync, for debugging) and raises ``ValueError`` on
data a correct vLLM batch never has.
"""
from __future__ import annotations

import warnings

import numpy as np

from . import host, spec
from .kinds import INT32_MAX, NUMPY
from .scalars import check_int

MODES = ("default", "full")


def check_mode(validate: str, num_cache_blocks=None) -> bool:
    """True for full validation; ``num_cache_blocks`` (only read by it) must be an int."""
    if validate not in MODES:
        raise ValueError(f"validate: expected one of {MODES}, got {validate!r}")
    if num_cache_blocks is not None:
        check_int("num_cache_blocks", num_cache_blocks, minimum=1)
    return validate == "full"


def storage_block(block_size: int, compress_ratio: int, full: bool) -> None:
    """Warn when a storage block cannot be DeepSeek-V4's ``256 // compress_ratio``
    (a warning: other models may differ); without ``full`` only for the
    logical block itself (256 with a ratio above 1), which where the ops
    take the storage block silently gives wrong slots."""
    expected = spec.KV_BLOCK_SIZE // compress_ratio if compress_ratio > 1 else spec.KV_BLOCK_SIZE
    logical = block_size == spec.KV_BLOCK_SIZE and compress_ratio > 1
    if block_size != expected and (full or logical):
        warnings.warn(f"block_size: the ops take the storage block, {spec.KV_BLOCK_SIZE} // "
                      f"compress_ratio = {expected} for DeepSeek-V4, got {block_size}"
                      + (" (the logical block?)" if block_size == spec.KV_BLOCK_SIZE else ""),
                      UserWarning, stacklevel=3)


def query_layout(qsl, seq_lens, kind: str, num_rows: int, num_tokens: int | None = None) -> None:
    """qsl starts at 0 and never decreases; ``seq_len >= query_len`` for each of
    ``num_rows`` requests; ``num_tokens`` (if given) covers every mapped token."""
    q = host.host_copy(qsl, kind).astype(np.int64)
    if q.shape[0] and q[0] != 0:
        raise ValueError(f"query_start_loc: expected to start at 0, got {int(q[0])}")
    steps = np.diff(q)
    if (steps < 0).any():
        at = int(np.flatnonzero(steps < 0)[0])
        raise ValueError(f"query_start_loc: expected non-decreasing values, got {int(q[at])} "
                         f"then {int(q[at + 1])} at index {at}")
    if num_tokens is not None and q.shape[0] and q[-1] > num_tokens:
        raise ValueError(f"num_tokens: expected at least query_start_loc[-1] ({int(q[-1])}), "
                         f"got {num_tokens}")
    if seq_lens is not None and num_rows:
        seq = host.host_copy(seq_lens, kind)[:num_rows].astype(np.int64)
        short = seq < steps[:num_rows]
        if short.any():
            b = int(np.flatnonzero(short)[0])
            raise ValueError(f"seq_lens: expected seq_len >= query_len, got seq_len {int(seq[b])} "
                             f"< query_len {int(steps[b])} for request {b}")


def longest_query(qsl, kind: str, num_reqs: int, max_query_len: int,
                  name: str = "max_decode_len") -> None:
    """No request's query longer than ``max_query_len`` (the argument ``name``)."""
    steps = np.diff(_host_int64(qsl, kind)[:num_reqs + 1])
    if (steps > max_query_len).any():
        b = _first(steps > max_query_len)
        raise ValueError(f"{name}: expected at least every request's query length, got "
                         f"{max_query_len} < {int(steps[b])} for request {b}")


def step_host_values(host_qsl: np.ndarray, qsl, seq_lens, kind: str, num_reqs: int,
                     max_query_len: int, max_seq_len: int) -> None:
    """A step's host values agree with its arrays: ``query_start_loc_cpu``
    holds ``query_start_loc``'s values, and ``max_query_len``, ``max_seq_len``
    bound every request's (the split, the C128A width and the short-context
    rows are decided from them alone)."""
    device = _host_int64(qsl, kind)[:num_reqs + 1]
    differ = host_qsl[:num_reqs + 1].astype(np.int64) != device
    if differ.any():
        i = _first(differ)
        raise ValueError(f"query_start_loc_cpu: expected the values of query_start_loc, got "
                         f"{int(host_qsl[i])} at index {i} where query_start_loc holds "
                         f"{int(device[i])}")
    longest_query(host_qsl, "numpy", num_reqs, max_query_len, "max_query_len")
    seq = _host_int64(seq_lens, kind)[:num_reqs]
    if (seq > max_seq_len).any():
        b = _first(seq > max_seq_len)
        raise ValueError(f"max_seq_len: expected at least every request's seq_len, got "
                         f"{max_seq_len} < {int(seq[b])} for request {b}")


def max_lengths(seq_lens, kind: str, num_reqs: int, max_model_len: int) -> None:
    """No sequence longer than ``max_model_len``."""
    seq = _host_int64(seq_lens, kind)[:num_reqs]
    if (seq > max_model_len).any():
        b = _first(seq > max_model_len)
        raise ValueError(f"seq_lens: expected at most max_model_len ({max_model_len}), got "
                         f"{int(seq[b])} for request {b}")


def _host_int64(x, kind: str) -> np.ndarray:
    return host.host_copy(x, kind).astype(np.int64)


def _first(mask: np.ndarray) -> int:
    """Index of the first True."""
    return int(np.flatnonzero(mask)[0])


def token_requests(qsl: np.ndarray, count: int) -> np.ndarray:
    """The request of each of the first ``count`` tokens (padding: 0), from a host
    ``query_start_loc``; the token-map rule, for checking what the kernels will read."""
    num_reqs = qsl.shape[0] - 1
    tokens = np.arange(count)
    ids = np.searchsorted(qsl[1:].astype(np.int64), tokens, side="right")
    mapped = tokens < (qsl[num_reqs] if num_reqs > 0 else 0)
    return np.where(mapped, np.minimum(ids, max(num_reqs - 1, 0)), 0).astype(np.int32)


def request_ids(token_to_req, kind: str, count: int, num_rows: int, *, first: int = 0,
                is_valid_token=None) -> np.ndarray:
    """The request ids of tokens ``[first, first + count)``, checked to be
    block-table rows (only the valid tokens' when ``is_valid_token`` is given)."""
    ids = host.host_copy(token_to_req, kind)[first:first + count]
    bad = (ids < 0) | (ids >= num_rows)
    if is_valid_token is not None:
        bad &= host.host_copy(is_valid_token, kind)[first:first + count].astype(bool)
    if bad.any():
        t = _first(bad)
        which = "" if is_valid_token is None else " for valid tokens"
        raise ValueError(f"token_to_req_indices: expected request ids in [0, {num_rows}) "
                         f"(block_table rows){which}, got {int(ids[t])} at token {first + t}")
    return ids


def block_columns(block_table, kind: str, rows: np.ndarray, visible: np.ndarray,
                  block_size: int, num_cache_blocks: int | None, what: str) -> None:
    """Every block a lookup will use lies inside its table row and, when the
    cache size is known, inside the cache."""
    table = host.host_copy(block_table, kind)
    needed = np.where(visible > 0, (visible - 1) // block_size + 1, 0)
    wide = needed > table.shape[1]
    if wide.any():
        i = int(np.flatnonzero(wide)[0])
        raise ValueError(f"block_table: {what} {i} needs {int(needed[i])} blocks, the table rows "
                         f"have {table.shape[1]}")
    if num_cache_blocks is None:
        return
    for i in np.flatnonzero(needed):
        entries = table[rows[i], :needed[i]]
        if entries.min() < 0 or entries.max() >= num_cache_blocks:
            raise ValueError(f"block_table: expected entries in [0, {num_cache_blocks}) for the "
                             f"blocks {what} {int(i)} uses, got {entries.min()}..{entries.max()}")


def decodes_first(qsl_cpu: np.ndarray, threshold: int) -> None:
    """No decode (1..threshold query tokens) after the first prefill."""
    lens = np.diff(qsl_cpu.astype(np.int64))
    is_prefill = lens > threshold
    if is_prefill.any():
        first = int(np.flatnonzero(is_prefill)[0])
        late = np.flatnonzero((lens[first:] > 0) & (lens[first:] <= threshold))
        if late.size:
            raise ValueError(f"query_start_loc_cpu: expected decodes before prefills (vLLM "
                             f"reorders the batch), got a decode at request {first + int(late[0])} "
                             f"after the prefill at request {first}")


def visible_rows(positions, kind: str, count: int, ratio: int, width: int) -> np.ndarray:
    rows = spec.visible_rows(host.host_copy(positions, kind)[:count].astype(np.int64), ratio)
    return np.clip(rows, 0, width)


def slot_mapping_inputs(qsl, seq_lens, block_table, kind: str, block_size: int, ratio: int,
                        cp_world_size: int, num_cache_blocks: int | None,
                        num_tokens: int | None = None) -> None:
    """Full checks for ``get_compressed_slot_mapping``: query layout (see
    ``query_layout``), and the last compressed row each request closes lies
    inside its table row (and cache)."""
    rows = block_table.shape[0]
    query_layout(qsl, seq_lens, kind, rows, num_tokens)
    if not rows:
        return
    q = host.host_copy(qsl, kind)[:rows + 1].astype(np.int64)
    seq = host.host_copy(seq_lens, kind)[:rows].astype(np.int64)
    first = np.maximum(seq - np.diff(q), 0)
    closed_after = seq // ratio                 # groups closed by positions < seq
    closed_before = first // ratio              # groups closed by positions < first
    last_row = np.where(closed_after > closed_before, closed_after, 0)
    block_columns(block_table, kind, np.arange(rows), last_row, block_size * cp_world_size,
                  num_cache_blocks, "request")


def c128a_inputs(positions, token_to_req, block_table, kind: str, num_decode_tokens: int,
                 ratio: int, width: int, block_size: int, num_cache_blocks: int | None,
                 ids_kind: str | None = None) -> None:
    """Full checks for the C128A decode lookups: request ids and block columns."""
    if not num_decode_tokens:
        return
    ids = request_ids(token_to_req, ids_kind or kind, num_decode_tokens, block_table.shape[0])
    visible = visible_rows(positions, kind, num_decode_tokens, ratio, width)
    block_columns(block_table, kind, ids, visible, block_size, num_cache_blocks, "decode token")


# --- the per-layer and indexer ops -----------------------------------------------------------
def _rebased_query_layout(qsl, seq_lens, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's ``query_start_loc`` rebased to 0, checked with its seq_lens."""
    rebased = _host_int64(qsl, kind)
    rebased -= rebased[0]
    seq = _host_int64(seq_lens, kind)
    query_layout(rebased, seq, NUMPY, rebased.shape[0] - 1)
    return rebased, seq[:rebased.shape[0] - 1]


def swa_inputs(qsl, seq_lens, token_to_req, is_valid_token, block_table, kind: str,
               token_offset: int, num_rows: int, block_size: int) -> None:
    """Full checks for ``compute_swa_indices_and_lens``: query layout; valid
    tokens' requests inside the table, positions >= 0, and the block of each
    token's own position inside the table row."""
    requests = block_table.shape[0]
    query_layout(qsl, seq_lens, kind, min(requests, qsl.shape[0] - 1))
    request_ids(token_to_req, kind, num_rows, requests, first=token_offset,
                is_valid_token=is_valid_token)
    valid = host.host_copy(is_valid_token, kind)[token_offset:token_offset + num_rows]
    valid = valid.astype(bool)
    if not valid.any():
        return
    q, seq = _host_int64(qsl, kind), _host_int64(seq_lens, kind)
    tokens = np.arange(token_offset, token_offset + num_rows)[valid]
    ids = _host_int64(token_to_req, kind)[tokens]
    positions = seq[ids] - (q[ids + 1] - q[ids]) + (tokens - q[ids])
    if (positions < 0).any():
        i = _first(positions < 0)
        raise ValueError(f"seq_lens: expected token {int(tokens[i])} at a position >= 0, got "
                         f"{int(positions[i])}")
    columns = positions // block_size
    if (columns >= block_table.shape[1]).any():
        i = _first(columns >= block_table.shape[1])
        raise ValueError(f"block_table: token {int(tokens[i])} at position {int(positions[i])} "
                         f"needs block column {int(columns[i])}, the table rows have "
                         f"{block_table.shape[1]}")


def combine_inputs(qsl, seq_lens, gather_lens, kind: str, num_tokens: int, window_size: int,
                   rows_per_request: int, swa_offset: int) -> None:
    """Full checks for ``combine_topk_swa_indices``: query layout of the chunk
    (rebased), every chunk token has a row, the gathered SWA part fits the
    workspace row and every value fits int32."""
    rebased, seq = _rebased_query_layout(qsl, seq_lens, kind)
    if rebased[-1] > num_tokens:
        raise ValueError(f"topk_indices: expected a row for each of the chunk's "
                         f"{int(rebased[-1])} tokens, got {num_tokens} rows")
    requests = rebased.shape[0] - 1
    gather = _host_int64(gather_lens, kind)[:requests]
    query_lens = np.diff(rebased)
    expected = query_lens + np.clip(seq - query_lens, 0, window_size - 1)
    short = gather < expected
    if short.any():
        b = _first(short)
        raise ValueError(f"gather_lens: expected at least q + min(L - q, W - 1) = "
                         f"{int(expected[b])} for request {b}, got {int(gather[b])}")
    wide = swa_offset + gather > rows_per_request
    if wide.any():
        b = _first(wide)
        raise ValueError(f"M: expected at least N + gather_lens = {swa_offset + int(gather[b])} "
                         f"(request {b}'s workspace rows), got {rows_per_request}")
    if requests and rows_per_request * requests > INT32_MAX:
        raise ValueError(f"M: expected M * requests ({rows_per_request} * {requests}) to fit "
                         "int32 indices")


def indexer_prefill_inputs(qsl, seq_lens, kind: str, compress_ratio: int, slice_stop: int,
                           num_compressed: int) -> None:
    """Full checks for ``build_indexer_prefill_chunk_metadata``: query layout of
    the chunk (rebased), the slice inside its tokens and ``num_compressed``
    equal to the sum of its compressed lengths."""
    rebased, seq = _rebased_query_layout(qsl, seq_lens, kind)
    if slice_stop > rebased[-1]:
        raise ValueError(f"query_slice_stop: expected at most the chunk's {int(rebased[-1])} "
                         f"tokens, got {slice_stop}")
    total = int(np.maximum(seq // compress_ratio, 0).sum())
    if num_compressed != total:
        raise ValueError(f"num_compressed: expected sum(seq_lens // {compress_ratio}) = {total}, "
                         f"got {num_compressed}")


def short_context_inputs(positions, kind: str, num_tokens: int, top_k: int,
                         compress_ratio: int) -> None:
    """Full checks for ``fill_short_context_topk_indices``: its precondition, no
    token sees more than top_k compressed rows (else candidates are dropped
    unscored, vLLM #52492)."""
    positions = _host_int64(positions, kind)[:num_tokens]
    visible = spec.visible_rows(positions, compress_ratio)
    if (visible > top_k).any():
        t = _first(visible > top_k)
        raise ValueError(f"positions: the short-context fill needs (p + 1) // {compress_ratio} "
                         f"<= top_k = {top_k}, got position {int(positions[t])} at token {t}")


def cache_slots(slot_mapping, kind: str, num_tokens: int, num_pages: int, block_size: int,
                num_cache_blocks: int | None) -> None:
    """Every slot of the first ``num_tokens`` is -1 (padding) or inside the cache."""
    blocks = num_pages if num_cache_blocks is None else min(num_pages, num_cache_blocks)
    slots = _host_int64(slot_mapping, kind)[:num_tokens]
    bad = (slots != spec.PAD_SLOT_ID) & ((slots < 0) | (slots >= blocks * block_size))
    if bad.any():
        t = _first(bad)
        raise ValueError(f"slot_mapping: expected -1 or a slot in [0, {blocks * block_size}) "
                         f"({blocks} blocks of {block_size}), got {int(slots[t])} at token {t}")


def gather_rows(seq_lens, gather_lens, block_table, kind: str, num_reqs: int, block_size: int,
                ratio: int, offset: int, rows: int, num_pages: int,
                num_cache_blocks: int | None, what: str = "") -> None:
    """A gather's requests: ``0 <= gather_len <= seq_len // ratio``, the rows it
    writes inside ``out``, and the blocks of the positions it reads inside the
    table row and the cache."""
    seq = _host_int64(seq_lens, kind)[:num_reqs] // ratio
    gathered = seq if gather_lens is None else _host_int64(gather_lens, kind)[:num_reqs]
    name = "seq_lens" if gather_lens is None else "gather_lens"
    bad = (gathered < 0) | (gathered > seq)
    if bad.any():
        b = _first(bad)
        raise ValueError(f"{name}: expected 0 <= gather_len <= seq_len{what} for every "
                         f"request, got {int(gathered[b])} against {int(seq[b])} for request {b}")
    if num_reqs and int(gathered.max()) + offset > rows:
        b = int(np.argmax(gathered))
        raise ValueError(f"out: expected at least offset + {name}[{b}] = "
                         f"{offset + int(gathered[b])} rows per request, got {rows}")
    blocks = num_pages if num_cache_blocks is None else min(num_pages, num_cache_blocks)
    table = host.host_copy(block_table, kind)
    for b in np.flatnonzero(gathered):
        first, last = (seq[b] - gathered[b]) // block_size, (seq[b] - 1) // block_size
        if last >= table.shape[1]:
            raise ValueError(f"block_table{what}: request {int(b)} reads block column "
                             f"{int(last)}, the table rows have {table.shape[1]}")
        entries = table[b, first:last + 1]
        if entries.min() < 0 or entries.max() >= blocks:
            raise ValueError(f"block_table{what}: expected entries in [0, {blocks}) for the "
                             f"blocks request {int(b)} reads, got "
                             f"{int(entries.min())}..{int(entries.max())}")


def indexer_gather_rows(cu_seq_lens, block_table, kind: str, block_size: int, num_pages: int,
                        num_cache_blocks: int | None) -> None:
    """The blocks an indexer gather reads inside the table row and the cache."""
    requests = block_table.shape[0]
    lengths = np.diff(_host_int64(cu_seq_lens, kind)[:requests + 1])
    blocks = num_pages if num_cache_blocks is None else min(num_pages, num_cache_blocks)
    block_columns(block_table, kind, np.arange(requests), lengths, block_size, blocks, "request")
