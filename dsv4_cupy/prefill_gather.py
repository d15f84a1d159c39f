"""``compute_prefill_gather_lens``: the raw tokens each prefill request gathers
from the SWA cache."""
from __future__ import annotations

import numpy as np
from numba import njit

from . import checks, geometry, validation
from .cpu import gather_len
from .family import KernelFamily
from .kinds import INT32, Operand, probe_all
from .launch import Launch, optional
from .params import I64, PTR, QUERY_LAYOUT, Params, QueryLayout
from .prepared import Checked, PreparedOp
from .scalars import check_int
from .spec import SWA_WINDOW_SIZE

PARAMS = Params("PrefillGatherParams", [
    ("query", QUERY_LAYOUT), ("out", PTR), ("replay_start", PTR), ("num_decodes", I64),
    ("num_prefills", I64), ("window_size", I64)])


@njit(cache=True)
def cpu_prefill_gather_lens(query, out, replay_start, num_decodes, num_prefills, window_size):
    """Prefill i (request num_decodes + i): q + min(max(L - q - replay, 0), W - 1)."""
    qsl = query.query_start_loc
    for i in range(num_prefills):
        b = num_decodes + i
        replay = np.int64(replay_start[b]) if replay_start.shape[0] > 0 else 0
        out[i] = gather_len(np.int64(qsl[b + 1]) - np.int64(qsl[b]),
                             np.int64(query.seq_lens[b]), window_size, replay)


FAMILY = KernelFamily("prefill_gather.cuh", "prefill_gather_lens", PARAMS)
CPU_KERNEL = cpu_prefill_gather_lens
FAMILIES = (FAMILY,)

_OP = PreparedOp("compute_prefill_gather_lens")


def compute_prefill_gather_lens(query_start_loc, seq_lens, num_decodes: int, num_prefills: int,
                                window_size: int = SWA_WINDOW_SIZE, *, replay_start=None,
                                out=None, validate: str = "default"):
    """Raw tokens each prefill request gathers from the SWA cache (vLLM 0.34's
    ``ComputePrefillMetadataKernel``).

    Parameters
    ----------
    query_start_loc : int32 array ``[>= num_decodes + num_prefills + 1]``
    seq_lens : int32 array ``[>= num_decodes + num_prefills]``
    num_decodes, num_prefills : int
        Prefill ``i`` is request ``num_decodes + i`` (decodes first).
    window_size : int
        ``W`` (128).
    replay_start : int32 array ``[>= num_decodes + num_prefills]``, optional
        Per request, the first position whose window KV exists (V4.1 bounded
        replay): nothing before it is gathered.
    out : int32 array ``[>= num_prefills]``, optional
        Only ``out[:num_prefills]`` is written.
    validate : "default" or "full"
        "full" also checks (a sync on GPU) the query layout of those requests.

    Returns
    -------
    int32 array ``[num_prefills]``: ``q + min(max(L - q - replay_start, 0), W -
    1)`` for the request's query length ``q`` and sequence length ``L``: its
    queries and the window before the first one.
    """
    key, results = _OP.replay(validate, (out,), query_start_loc, seq_lens, num_decodes,
                              num_prefills, window_size, replay_start)
    if results is not None:
        return results
    kind, device, ops = probe_all({"query_start_loc": query_start_loc, "seq_lens": seq_lens,
                                   "replay_start": replay_start, "out": out})
    qsl, seq = ops["query_start_loc"], ops["seq_lens"]
    num_decodes = check_int("num_decodes", num_decodes, minimum=0)
    num_prefills = check_int("num_prefills", num_prefills, minimum=0)
    window_size = checks.check_row_width("window_size", window_size, minimum=1)
    num_reqs = num_decodes + num_prefills
    checks.check(qsl, (INT32,), 1, min_len=num_reqs + 1,
                 min_len_of="num_decodes + num_prefills + 1")
    checks.check(seq, (INT32,), 1, min_len=num_reqs, min_len_of="num_decodes + num_prefills")
    replay = ops["replay_start"]
    if replay is not None:
        checks.check(replay, (INT32,), 1, min_len=num_reqs,
                     min_len_of="num_decodes + num_prefills")
    lens = checks.output("out", ops["out"], kind, device, INT32, num_prefills)
    checks.check_no_alias([lens], [op for op in (qsl, seq, replay) if op is not None])
    if validation.check_mode(validate):
        validation.query_layout(query_start_loc, seq_lens, kind, num_reqs)
    result = lens.array[:num_prefills]
    launch = gather_lens_launch(QueryLayout(qsl, seq, num_reqs), lens, num_decodes, num_prefills,
                                window_size, replay)
    return _OP.run(key, Checked(kind, device, result, (launch,), (result,)))


def gather_lens_launch(query: QueryLayout, out: Operand, num_decodes: int, num_prefills: int,
                       window_size: int, replay_start: Operand | None = None) -> Launch:
    """The gather lengths of prefill requests ``num_decodes + i``, ``i < num_prefills``
    (from their replay starts, when given)."""
    return Launch(FAMILY, geometry.elementwise_blocks(num_prefills),
                  dict(query=query, out=out,
                       replay_start=optional(replay_start),
                       num_decodes=num_decodes, num_prefills=num_prefills,
                       window_size=window_size),
                  kernel=cpu_prefill_gather_lens)



def warm_launches(tiny):
    """(name, launch) of every signature of the CPU kernel (``warmup(cpu=True)``)."""
    yield "prefill_gather_lens", gather_lens_launch(tiny.query, tiny.out32, 0, 1, 2)
