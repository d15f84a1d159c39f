"""``token_to_req_indices``: the request of every flattened token."""
from __future__ import annotations

import numpy as np

from . import arrays, cpu, families, geometry, params, validation
from .arrays import INT32
from .prepared import PlanCache, PreparedCall
from .scalars import check_int

_PREPARED = PlanCache()


def token_to_req_indices(query_start_loc, num_tokens: int, *, out=None, validate: str = "default"):
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
    validate : "default" or "full"
        "full" also checks that ``query_start_loc`` starts at 0 and never
        decreases (reads it: a sync on GPU). The default never syncs.

    Returns
    -------
    int32 array ``[num_tokens]`` of the same kind as the input (a view of
    ``out`` when given). Token ``t`` gets the ``i`` with
    ``query_start_loc[i] <= t < query_start_loc[i + 1]``; tokens at or past
    ``query_start_loc[-1]`` (padding) get 0; zero-length requests own no token.
    """
    key = None
    if validate == "default" and out is not None:
        key = arrays.launch_key(query_start_loc, num_tokens, out)
        prepared = _PREPARED.get(key) if key is not None else None
        if prepared is not None and prepared.run():
            return prepared.results
    kind, device, ops = arrays.probe_all({"query_start_loc": query_start_loc, "out": out})
    qsl = ops["query_start_loc"]
    arrays.check(qsl, (INT32,), 1, min_len=1)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    out = arrays.output("out", ops["out"], kind, device, INT32, num_tokens)
    arrays.check_no_alias([out], [qsl])
    full = validation.check_mode(validate)
    if full:
        validation.query_layout(query_start_loc, None, kind, 0)
    result = out.array[:num_tokens]
    if kind in arrays.GPU_KINDS:
        plans = ()
        if num_tokens:
            plans = (families.TOKEN_MAP.plan(
                device, geometry.elementwise_blocks(num_tokens),
                query=params.QUERY_LAYOUT.values(query_start_loc=qsl.ptr, seq_lens=0,
                                                 num_reqs=qsl.shape[0] - 1),
                out=out.ptr, num_tokens=num_tokens),)
        prepared = PreparedCall(plans, kind, device, result, (result,))
        if not prepared.run():
            raise RuntimeError("token_to_req_indices: the device changed during the call")
        if key is not None:
            _PREPARED.put(key, prepared)
    else:
        cpu.token_to_req_indices(arrays.kernel_view(query_start_loc, kind), np.int64(num_tokens),
                                 arrays.kernel_view(out.array, kind))
    return result
