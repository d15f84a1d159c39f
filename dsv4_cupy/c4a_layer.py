"""``c4a_layer_topk``: both uses of a C4A layer's indexer top-k in one launch."""
from __future__ import annotations

from . import checks, combine, geometry, global_topk
from .combine import check_combine
from .family import KernelFamily
from .global_topk import check_global_topk
from .kinds import INT32, probe
from .launch import Launch
from .params import I64, Params
from .prepared import Checked, PreparedOp
from .scalars import check_int

PARAMS = Params("C4ALayerParams", [
    ("decode", global_topk.PARAMS), ("prefill", combine.PARAMS), ("decode_blocks", I64),
    ("decode_compact", I64)])
#: Fused: the global top-k and the combine of one C4A layer in one launch.
FAMILY = KernelFamily("c4a_layer.cuh", "c4a_layer_topk", PARAMS)
CPU_KERNEL = None
FAMILIES = (FAMILY,)
_OP = PreparedOp("c4a_layer_topk")


def c4a_layer_topk(topk_indices, num_decode_tokens: int, token_to_req_indices, block_table,
                   block_size: int, is_valid_token, query_start_loc, seq_lens, gather_lens,
                   window_size: int, compress_ratio: int, M: int, N: int, *,
                   compact: bool = False, out=None, validate: str = "default"):
    """Decode rows to global slots and prefill rows combined, for one C4A layer.

    Upstream runs two kernels per C4A layer on its indexer output: the
    local-to-global conversion of the decode rows and the combine of the
    chunk's prefill rows. This is one
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
    key, results = _OP.replay(
        validate, [buffer for part in out for buffer in part] if parts else None, topk_indices,
        num_decode_tokens, token_to_req_indices, block_table, block_size, is_valid_token,
        query_start_loc, seq_lens, gather_lens, window_size, compress_ratio, M, N, compact)
    if results is not None:
        return results
    decode_out, prefill_out = (None, None) if out is None else _parts(out)
    topk = probe("topk_indices", topk_indices)
    checks.check(topk, (INT32,), 2)
    num_tokens, width = topk.shape
    num_decode_tokens = check_int("num_decode_tokens", num_decode_tokens, minimum=0,
                                  maximum=num_tokens)
    decode = check_global_topk(topk_indices[:num_decode_tokens], token_to_req_indices,
                               block_table, block_size, is_valid_token, compact, decode_out,
                               validate)
    prefill = check_combine(topk_indices[num_decode_tokens:], query_start_loc, seq_lens,
                            gather_lens, window_size, compress_ratio, width, M, N, prefill_out,
                            validate, lanes=geometry.WARP_LANES)   # c4a_layer.cuh's rows
    if decode.kind != prefill.kind or decode.device != prefill.device:
        raise TypeError("query_start_loc: expected arrays of the kind and device of "
                        "topk_indices for both parts")
    written = [probe(f"out[{part}][{i}]", result)
               for part, call in enumerate((decode, prefill)) for i, result in enumerate(call.results)]
    read = [probe(name, x) for name, x in (
        ("topk_indices", topk_indices[num_decode_tokens:]),
        ("token_to_req_indices", token_to_req_indices), ("block_table", block_table),
        ("is_valid_token", is_valid_token), ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens), ("gather_lens", gather_lens))]
    checks.check_no_alias(written[:2], written[2:] + read[:1] + read[4:])   # decode out vs prefill
    checks.check_no_alias(written[2:], read[1:4] + [probe(                  # prefill out
        "topk_indices", topk_indices[:num_decode_tokens])])                 # vs decode in
    (decode_launch,), (prefill_launch,) = decode.launches, prefill.launches
    launch = c4a_layer_launch(decode_launch, prefill_launch, bool(compact), num_tokens)
    results = (decode.results, prefill.results)
    return _OP.run(key, Checked(decode.kind, decode.device, results, (launch,),
                                (*decode.results, *prefill.results)))


def c4a_layer_launch(decode: Launch, prefill: Launch, compact: bool, num_tokens: int) -> Launch:
    """The fused launch of a layer's decode rows (a global top-k launch) and
    prefill rows (a combine launch of a warp per row), each on its own
    blocks; rows past one grid are refused naming ``topk_indices``."""
    blocks = geometry.check_grid(decode.blocks + prefill.blocks, num_tokens, "topk_indices")
    return Launch(FAMILY, blocks, dict(decode=decode, prefill=prefill,
                                       decode_blocks=decode.blocks, decode_compact=int(compact)),
                  parts=(decode, prefill))


def _parts(out):
    if type(out) not in (tuple, list) or len(out) != 2:
        raise TypeError(f"out: expected ((global, lens), (combined, combined_lens)), got "
                        f"{type(out).__name__}")
    return out[0], out[1]


def warm_launches(tiny):
    """No CPU kernel of its own: its parts' are its families'."""
    return iter(())
