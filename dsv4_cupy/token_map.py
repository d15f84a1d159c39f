"""``token_to_req_indices``: the request of every flattened token."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, kernels
from .arrays import INT32


def token_to_req_indices(query_start_loc, num_tokens: int, *, out=None):
    """Map each flattened token to the index of the request that owns it.

    Parameters
    ----------
    query_start_loc : int32 array, shape ``[num_reqs + 1]``
        Cumulative query lengths (vLLM's ``query_start_loc``); read on the
        device for GPU arrays, so a stale host copy does not matter.
    num_tokens : int
        Tokens to map (``num_actual_tokens``, CUDA-graph padding included).
    out : int32 array, shape ``[>= num_tokens]``, optional
        Buffer to write into; only ``out[:num_tokens]`` is written.

    Returns
    -------
    int32 array ``[num_tokens]`` of the same kind as the input (a view of
    ``out`` when given). Token ``t`` gets the ``i`` with
    ``query_start_loc[i] <= t < query_start_loc[i + 1]``; tokens at or past
    ``query_start_loc[-1]`` (padding) get 0; zero-length requests own no token.
    """
    kind, device = arrays.common_kind({"query_start_loc": query_start_loc, "out": out})
    arrays.check("query_start_loc", query_start_loc, kind, (INT32,), 1, min_len=1)
    num_tokens = arrays.check_int("num_tokens", num_tokens, minimum=0)
    out = arrays.output("out", out, kind, device, INT32, num_tokens)
    arrays.check_no_alias(kind, {"out": out}, {"query_start_loc": query_start_loc})
    num_reqs = query_start_loc.shape[0] - 1
    if kind in arrays.GPU_KINDS:
        if num_tokens:
            kernels.launch("token_map.cu", "token_to_req_indices", device,
                           kernels.elementwise_blocks(num_tokens),
                           (arrays.kernel_arg(query_start_loc, kind), np.int32(num_reqs),
                            np.int64(num_tokens), arrays.kernel_arg(out, kind)),
                           arrays.launch_stream(kind, device))
    else:
        cpu.token_to_req_indices(arrays.host_view(query_start_loc, kind), np.int64(num_tokens),
                                 arrays.host_view(out, kind))
    return out[:num_tokens]
