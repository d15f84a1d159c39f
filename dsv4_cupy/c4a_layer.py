"""``c4a_layer_topk``: both uses of a C4A layer's indexer top-k in one launch."""
from __future__ import annotations

from . import arrays, families, geometry, params
from .arrays import INT32
from .c4a import check_global_topk
from .combine import check_combine
from .prepared import PreparedOp
from .scalars import check_int

_PREPARED = PreparedOp("c4a_layer_topk")


def c4a_layer_topk(topk_indices, num_decode_tokens: int, token_to_req_indices, block_table,
                   block_size: int, is_valid_token, query_start_loc, seq_lens, gather_lens,
                   window_size: int, compress_ratio: int, M: int, N: int, *,
                   compact: bool = False, out=None, validate: str = "default"):
    """Decode rows to global slots and prefill rows combined, for one C4A layer.

    Upstream runs two kernels per C4A layer on its indexer output: the
    local-to-global conversion of the decode rows and the combine of the
    chunk's prefill rows (upstream.md §4 and §6, "Fusion"). This is one
    launch, each part on its own blocks, with the same results as

    * ``compute_global_topk_indices_and_lens(topk_indices[:nd],
      token_to_req_indices, block_table, block_size, is_valid_token, compact=compact)``
    * ``combine_topk_swa_indices(topk_indices[nd:], query_start_loc, seq_lens,
      gather_lens, window_size, compress_ratio, K, M, N)``

    with ``nd = num_decode_tokens`` and ``K = topk_indices.shape[1]``.

    Parameters
    ----------
    topk_indices : int32 array ``[T, K]`` (rows contiguous, any row stride)
        The layer's request-local top-k: decode tokens first, then the chunk's
        prefill tokens.
    num_decode_tokens : int
        ``nd``, in ``[0, T]``.
    token_to_req_indices, block_table, block_size, is_valid_token, compact
        As for ``compute_global_topk_indices_and_lens`` (their first ``nd``
        entries are read).
    query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, M, N
        As for ``combine_topk_swa_indices``: the chunk of the prefill rows.
    out : ``((global, lens), (combined, combined_lens))``, optional
        The outputs of the two parts, as for the two ops; ``global`` may be
        ``topk_indices`` itself (the decode rows converted in place).
    validate : "default" or "full"
        As for the two ops.

    Returns
    -------
    ``((global [nd, K], lens [nd]), (combined [T - nd, C], combined_lens [T - nd]))``, int32.
    """
    parts = type(out) in (tuple, list) and len(out) == 2 and all(
        type(part) in (tuple, list) and len(part) == 2 for part in out)
    key, results = _PREPARED.replay(
        validate, [buffer for part in out for buffer in part] if parts else None, topk_indices,
        num_decode_tokens, token_to_req_indices, block_table, block_size, is_valid_token,
        query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, M, N, compact)
    if results is not None:
        return results
    decode_out, prefill_out = (None, None) if out is None else _parts(out)
    topk = arrays.probe("topk_indices", topk_indices)
    arrays.check(topk, (INT32,), 2)
    num_tokens, width = topk.shape
    num_decode_tokens = check_int("num_decode_tokens", num_decode_tokens, minimum=0,
                                  maximum=num_tokens)
    decode = check_global_topk(topk_indices[:num_decode_tokens], token_to_req_indices,
                               block_table, block_size, is_valid_token, compact, decode_out,
                               validate)
    prefill = check_combine(topk_indices[num_decode_tokens:], query_start_loc, seq_lens,
                            gather_lens, window_size, compress_ratio, width, M, N, prefill_out,
                            validate, lanes=geometry.WARP_LANES)   # c4a_layer.cu's rows
    if decode.kind != prefill.kind or decode.device != prefill.device:
        raise TypeError("query_start_loc: expected arrays of the kind and device of "
                        "topk_indices for both parts")
    written = [arrays.probe(f"out[{part}][{i}]", result)
               for part, call in enumerate((decode, prefill)) for i, result in enumerate(call.results)]
    read = [arrays.probe(name, x) for name, x in (
        ("topk_indices", topk_indices[num_decode_tokens:]),
        ("token_to_req_indices", token_to_req_indices), ("block_table", block_table),
        ("is_valid_token", is_valid_token), ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens), ("gather_lens", gather_lens))]
    arrays.check_no_alias(written[:2], written[2:] + read[:1] + read[4:])   # decode out vs prefill
    arrays.check_no_alias(written[2:], read[1:4] + [arrays.probe(               # prefill out
        "topk_indices", topk_indices[:num_decode_tokens])])                 # vs decode in
    results = (decode.results, prefill.results)

    if decode.kind not in arrays.GPU_KINDS:
        decode.run_cpu()
        prefill.run_cpu()
        return results
    plans = ()
    blocks = geometry.check_grid(decode.blocks + prefill.blocks, num_tokens, "topk_indices")
    if blocks:
        plans = (families.C4A_LAYER.plan(
            decode.device, blocks,
            decode=params.GLOBAL_TOPK.values(**decode.fields),
            prefill=params.COMBINE.values(**prefill.fields), decode_blocks=decode.blocks,
            decode_compact=int(compact)),)
    views = (*decode.results, *prefill.results)
    return _PREPARED.launch(key, plans, decode.kind, decode.device, results, views)


def _parts(out):
    if type(out) not in (tuple, list) or len(out) != 2:
        raise TypeError(f"out: expected ((global, lens), (combined, combined_lens)), got "
                        f"{type(out).__name__}")
    return out[0], out[1]
