"""``token_to_req_indices``: the request of every flattened token."""
from __future__ import annotations

from numba import njit

from . import checks, geometry, validation
from .cpu import request_of
from .family import KernelFamily
from .kinds import INT32, Operand, probe_all
from .launch import Launch, NoArray
from .params import I64, PTR, QUERY_LAYOUT, Params, QueryLayout
from .prepared import Checked, PreparedOp
from .scalars import check_int

PARAMS = Params("TokenMapParams", [
    ("query", QUERY_LAYOUT), ("out", PTR), ("num_tokens", I64)])


@njit(cache=True)
def cpu_token_to_req_indices(query, out, num_tokens):
    qsl, num_reqs = query.query_start_loc, query.num_reqs
    num_mapped = qsl[num_reqs] if num_reqs > 0 else 0
    for t in range(num_tokens):
        out[t] = request_of(qsl, num_reqs, t) if t < num_mapped else 0


FAMILY = KernelFamily("token_map.cuh", "token_to_req_indices", PARAMS)
CPU_KERNEL = cpu_token_to_req_indices
FAMILIES = (FAMILY,)

_OP = PreparedOp("token_to_req_indices")


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
    key, results = _OP.replay(validate, (out,), query_start_loc, num_tokens)
    if results is not None:
        return results
    kind, device, ops = probe_all({"query_start_loc": query_start_loc, "out": out})
    qsl = ops["query_start_loc"]
    checks.check(qsl, (INT32,), 1, min_len=1)
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    out = checks.output("out", ops["out"], kind, device, INT32, num_tokens)
    checks.check_no_alias([out], [qsl])
    if validation.check_mode(validate):
        validation.query_layout(query_start_loc, None, kind, 0)
    result = out.array[:num_tokens]
    return _OP.run(key, Checked(kind, device, result,
                                (token_map_launch(qsl, qsl.shape[0] - 1, out, num_tokens),),
                                (result,)))


def token_map_launch(query_start_loc: Operand, num_reqs: int, out: Operand,
                     num_tokens: int) -> Launch:
    """The token map of ``num_tokens`` tokens over ``num_reqs`` requests, into ``out``."""
    return Launch(FAMILY, geometry.elementwise_blocks(num_tokens),
                  dict(query=QueryLayout(query_start_loc, NoArray(INT32), num_reqs), out=out,
                       num_tokens=num_tokens),
                  kernel=cpu_token_to_req_indices)


def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    yield "token_to_req_indices", token_map_launch(tiny.qsl, 1, tiny.out32, 1)
