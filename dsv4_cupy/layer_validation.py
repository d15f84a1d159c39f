"""``validate="full"`` data checks of the per-layer and indexer ops (the
``validation`` module's rules, for these ops): they copy inputs to the host (a
sync on GPU) and raise ``ValueError`` on data a correct vLLM step never has.
The default mode never reads data; the kernels then contain what comes."""
from __future__ import annotations

import numpy as np

from . import arrays, validation


def _host(x, kind: str) -> np.ndarray:
    return arrays.host_copy(x, kind).astype(np.int64)


def _rebased_layout(qsl, seq_lens, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's ``query_start_loc`` rebased to 0, checked with its seq_lens."""
    rebased = _host(qsl, kind)
    rebased -= rebased[0]
    seq = _host(seq_lens, kind)
    validation.query_layout(rebased, seq, arrays.NUMPY, rebased.shape[0] - 1)
    return rebased, seq[:rebased.shape[0] - 1]


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def request_ids(token_to_req, is_valid_token, kind: str, first: int, count: int,
                num_rows: int) -> None:
    """Valid tokens' request ids are block-table rows."""
    ids = _host(token_to_req, kind)[first:first + count]
    valid = arrays.host_copy(is_valid_token, kind)[first:first + count].astype(bool)
    bad = valid & ((ids < 0) | (ids >= num_rows))
    if bad.any():
        t = _first(bad)
        raise ValueError(f"token_to_req_indices: expected request ids in [0, {num_rows}) (block "
                         f"table rows) for valid tokens, got {int(ids[t])} at token {first + t}")


def swa_inputs(qsl, seq_lens, token_to_req, is_valid_token, block_table, kind: str,
               token_offset: int, num_rows: int, block_size: int) -> None:
    """Query layout; valid tokens' requests inside the table, positions >= 0,
    and the block of each token's own position inside the table row."""
    requests = block_table.shape[0]
    validation.query_layout(qsl, seq_lens, kind, min(requests, qsl.shape[0] - 1))
    request_ids(token_to_req, is_valid_token, kind, token_offset, num_rows, requests)
    valid = arrays.host_copy(is_valid_token, kind)[token_offset:token_offset + num_rows]
    valid = valid.astype(bool)
    if not valid.any():
        return
    q, seq = _host(qsl, kind), _host(seq_lens, kind)
    tokens = np.arange(token_offset, token_offset + num_rows)[valid]
    ids = _host(token_to_req, kind)[tokens]
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
    """Query layout of the chunk (rebased), every chunk token has a row, the
    gathered SWA part fits the workspace row and every value fits int32."""
    rebased, seq = _rebased_layout(qsl, seq_lens, kind)
    if rebased[-1] > num_tokens:
        raise ValueError(f"topk_indices: expected a row for each of the chunk's "
                         f"{int(rebased[-1])} tokens, got {num_tokens} rows")
    requests = rebased.shape[0] - 1
    gather = _host(gather_lens, kind)[:requests]
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
    if requests and rows_per_request * requests > np.iinfo(np.int32).max:
        raise ValueError(f"M: expected M * requests ({rows_per_request} * {requests}) to fit "
                         "int32 indices")


def indexer_prefill_inputs(qsl, seq_lens, kind: str, compress_ratio: int, slice_stop: int,
                           num_compressed: int) -> None:
    """Query layout of the chunk (rebased), the slice inside its tokens and
    ``num_compressed`` equal to the sum of its compressed lengths."""
    rebased, seq = _rebased_layout(qsl, seq_lens, kind)
    if slice_stop > rebased[-1]:
        raise ValueError(f"query_slice_stop: expected at most the chunk's {int(rebased[-1])} "
                         f"tokens, got {slice_stop}")
    total = int(np.maximum(seq // compress_ratio, 0).sum())
    if num_compressed != total:
        raise ValueError(f"num_compressed: expected sum(seq_lens // {compress_ratio}) = {total}, "
                         f"got {num_compressed}")


def short_context_inputs(positions, kind: str, num_tokens: int, top_k: int,
                         compress_ratio: int) -> None:
    """The shortcut's precondition: no token sees more than top_k compressed rows
    (else candidates are dropped unscored, vLLM #52492)."""
    positions = _host(positions, kind)[:num_tokens]
    visible = (positions + 1) // compress_ratio
    if (visible > top_k).any():
        t = _first(visible > top_k)
        raise ValueError(f"positions: the short-context fill needs (p + 1) // {compress_ratio} "
                         f"<= top_k = {top_k}, got position {int(positions[t])} at token {t}")
