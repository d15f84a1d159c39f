"""A whole step's plan: the checks of every group's arrays and the host
decisions of a step with prefills (the chunk plans, the indexer's compressed
rows), typed (``StepPlan``)."""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import checks, combine, host, keys, step_kernel, validation
from .combine import PlanChunk
from .family import POSITIONS_AXIS, SLOT_MAPPING_AXIS
from .group import KVCacheGroup, Split, StepArrays
from .kinds import (HOST_KINDS, INT32, INT32_MAX, INT64, NUMPY, Operand, describe, probe,
                    probe_all)
from .launch import FrozenLaunch, Launch
from .metadata import CommonAttentionMetadata
from .prefill_plan import (BAD_QUERY_LENS, BAD_SEQ_LENS, PLANNED, TOO_MANY_COMPRESSED,
                           chunk_budget, step_chunk_plans)
from .prepared import PreparedCall, PreparedCalls
from .spec import C4A_RATIO, C128A_RATIO

#: The KV-cache groups of a DeepSeek-V4 step, as the step builder takes them.
GROUPS = ("swa", "c4a", "indexer", "c128a")


#: Described sections a layout keeps (the least recently used go first).
MAX_LAYOUT_SECTIONS = 64
#: Prepared steps and result views a layout keeps, each by its host decisions.
MAX_LAYOUT_STEPS = 16


class SectionCache:
    """A layout's step-kernel sections, described once per set of host
    decisions and kept frozen (GPU): the layout fixes every array a section
    reads, so a section is a function of the host values its key lists (the
    arguments its description is given, under a name)."""

    __slots__ = ("_frozen",)

    def __init__(self):
        self._frozen: dict = {}

    def get(self, key: tuple, describe, **fields):
        """``describe()`` (a ``Launch``, or a dict or tuple of them) frozen, as
        described under ``key`` before (the least recently used key goes first
        past ``MAX_LAYOUT_SECTIONS``). ``fields``: single-valued fields of a
        ``Launch`` that ``key`` leaves out (values the blocks do not depend on),
        set in the frozen values; ``describe`` gives them these values."""
        cached = self._frozen
        entry = cached.pop(key, None)
        if entry is None:
            if len(cached) >= MAX_LAYOUT_SECTIONS:
                cached.pop(next(iter(cached)), None)     # another thread may have too
            described = describe()
            entry = (_frozen(described), getattr(described, "layout", None))
        cached[key] = entry
        frozen, layout = entry
        if fields:
            frozen = FrozenLaunch(layout.with_values(frozen.values, fields), frozen.blocks)
        return frozen


def _frozen(described):
    if type(described) is dict:
        return {name: _frozen(launch) for name, launch in described.items()}
    if type(described) is tuple:
        return tuple(map(_frozen, described))
    return described.frozen()


#: The step kernel's combine sections, whose plans a prepared step rewrites, and
#: the ``ChunkPlans`` field each takes its plan from.
COMBINE_SECTIONS = {"c128a_combine": "c128a", "swa_combine": "swa"}
_NUM_COMPRESSED = step_kernel.PARAMS.offset_of("indexer_prefill", "num_compressed")
#: Each combine section's plan arrays of M and N: their offsets in the step's struct.
_PLAN_ARRAYS = {name: tuple(step_kernel.PARAMS.offset_of(name, "plan", array)
                            for array in ("rows_per_request", "swa_offset"))
                for name in COMBINE_SECTIONS}
_PACK_INT64 = struct.Struct("<q").pack_into


@functools.lru_cache(maxsize=None)
def _int32s(count: int):
    """``pack_into`` of ``count`` int32 values."""
    return struct.Struct(f"<{count}i").pack_into


class PreparedStep:
    """A step's launches of the step kernel prepared on ``device`` (``call``
    runs those with blocks), and where in them each piece of its combine
    plans sits: a later step with the same host decisions but the chunks' N
    and M and the indexer's compressed rows (which neither the blocks nor any
    other field depend on) writes those into the same launches."""

    __slots__ = ("launches", "call", "_pieces")

    def __init__(self, launches: list[Launch], kind: str, device: int,
                 chunks: ChunkPlans | None):
        self.launches = tuple(launch.prepare(device) for launch in launches)
        self.call = PreparedCall(tuple(launch for launch in self.launches if launch.blocks),
                                 kind, device, None)
        # Each combine piece, in launch order: (its launch's storage, a pack of its
        # chunks' count, where its M and N go, its plan, its chunks [start, stop)).
        self._pieces = []
        if chunks is None:
            return
        pieces = {name: iter(combine.plan_pieces(range(len(getattr(chunks, plan)))))
                  for name, plan in COMBINE_SECTIONS.items()}
        for index, launch in enumerate(launches):
            for name, plan in COMBINE_SECTIONS.items():
                if type(launch.inputs[name]) is not tuple:      # an off section's values
                    piece = next(pieces[name])
                    self._pieces.append((self.launches[index].storage, _int32s(len(piece)),
                                         *_PLAN_ARRAYS[name], plan, piece.start, piece.stop))

    def patch(self, num_compressed: int, chunks: ChunkPlans | None) -> None:
        """Write the indexer's compressed rows and each piece's chunks' M and N
        (the rest of a ``combine.plan_record``, the chunks and their first
        requests, is fixed by the chunks' bounds, which the step's host
        decisions hold)."""
        _PACK_INT64(self.launches[0].storage, _NUM_COMPRESSED, num_compressed)
        for storage, pack, rows_at, offsets_at, plan, start, stop in self._pieces:
            piece = getattr(chunks, plan)[start:stop]
            pack(storage, rows_at, *[chunk.rows_per_request for chunk in piece])
            pack(storage, offsets_at, *[chunk.swa_offset for chunk in piece])


class StepLayout(NamedTuple):
    """What steps with the same arrays and counts share: their checks and
    (GPU) their described sections, result views and prepared launches."""

    arrays: StepArrays
    tables: dict
    swa_slot_mapping: Operand
    sections: SectionCache
    results: object              # prepared.PreparedCalls: the metadata views by host decisions
    steps: object                # prepared.PreparedCalls: a PreparedStep by host decisions


@dataclass
class ChunkPlans:
    """A step's prefill chunk plans (``get_prefill_chunk_plan``) placed in its rows."""

    c128a: tuple         # (PlanChunk, ...) of the C128A layers
    swa: tuple           # (PlanChunk, ...) of the SWA-only layers
    bounds: tuple        # (C128A chunks, then each chunk's (start, end, first_row, end_row)):
                         # the chunks but N, M


@dataclass
class StepPlan:
    """A step's checked arrays and host decisions: everything a build launches from."""

    cms: dict                    # the groups' CommonAttentionMetadata
    arrays: StepArrays           # the C128A group's (the step's shared query layout)
    tables: dict                 # group -> its probed block table
    swa_slot_mapping: Operand    # the SWA group's slot mapping (its tokens' validity)
    split: Split
    width: int                   # C128A columns written
    c128a_tokens: int            # tokens whose C128A rows are written
    valid_tokens: int
    compressed: int              # the indexer's compressed rows over the prefills
    chunks: ChunkPlans | None    # with combined_prefill and prefills
    short_context: bool          # the C4A short-context rows are built
    native_decode_shape: tuple | None   # the indexer's native decode lengths' (rows, columns)

    @property
    def num_tokens(self) -> int:
        return self.arrays.num_tokens


def shared_c128a_group(group, max_model_len: int, max_num_batched_tokens: int) -> KVCacheGroup:
    """A step builder's ``c128a_group``: a C128A group (a
    ``DeepseekV4MetadataBuilder``) sized as the step."""
    if not isinstance(group, KVCacheGroup) or group.compress_ratio != C128A_RATIO:
        raise TypeError(f"c128a_group: expected a DeepseekV4MetadataBuilder of ratio "
                        f"{C128A_RATIO}, got {describe(group)}")
    if (group.max_model_len, group.max_num_batched_tokens) != (max_model_len,
                                                               max_num_batched_tokens):
        raise ValueError(f"c128a_group: expected max_model_len {max_model_len} and "
                         f"max_num_batched_tokens {max_num_batched_tokens}, got "
                         f"{group.max_model_len} and {group.max_num_batched_tokens}")
    return group


def check_group_metadata(common_attn_metadata) -> dict:
    """The step's metadata: a dict of one ``CommonAttentionMetadata`` per group of ``GROUPS``."""
    if not isinstance(common_attn_metadata, dict) or set(common_attn_metadata) != set(GROUPS):
        got = (sorted(common_attn_metadata) if isinstance(common_attn_metadata, dict)
               else type(common_attn_metadata).__name__)
        raise TypeError(f"common_attn_metadata: expected a dict of one "
                        f"CommonAttentionMetadata per group {GROUPS}, got {got}")
    for group in GROUPS:
        if not isinstance(common_attn_metadata[group], CommonAttentionMetadata):
            raise TypeError(f"common_attn_metadata[{group!r}]: expected a "
                            f"CommonAttentionMetadata, got "
                            f"{type(common_attn_metadata[group]).__name__}")
    return common_attn_metadata


def check_groups(cms: dict, arrays: StepArrays, kind: str, device: int, like,
                 max_blocks: int) -> tuple[dict, Operand]:
    """The other groups' arrays: the C128A group's query layout, their own
    tables, slot mappings and positions (kind, dtype, length; the SWA group's
    slot mapping is read, for its tokens' validity). Returns ``({group:
    probed block table}, probed SWA slot mapping)``; ``check_group_data``
    compares their values under full validation."""
    cm128, ops128 = cms["c128a"], arrays.ops
    num_tokens = arrays.num_tokens
    # Every section reads the shared layout of every request.
    checks.check(ops128["seq_lens"], (INT32,), 1, min_len=cm128.num_reqs)
    tables = {"c128a": ops128["block_table_tensor"]}
    swa_slots = None
    for group in ("swa", "c4a", "indexer"):
        cm = cms[group]
        if (cm.num_reqs, cm.num_actual_tokens) != (cm128.num_reqs, cm128.num_actual_tokens):
            raise ValueError(f"common_attn_metadata[{group!r}]: expected the step's counts "
                             f"(num_reqs={cm128.num_reqs}, num_actual_tokens="
                             f"{cm128.num_actual_tokens}), got ({cm.num_reqs}, "
                             f"{cm.num_actual_tokens})")
        # The query layout is the C128A group's: the same objects need no second look.
        layout = [name for name in ("query_start_loc", "seq_lens")
                  if getattr(cm, name) is not getattr(cm128, name)]
        for name in ("block_table_tensor", "slot_mapping"):
            if getattr(cm, name) is None:
                raise TypeError(f"common_attn_metadata[{group!r}].{name}: expected an array, "
                                f"got None")
        positions = cm.positions if cm.positions is not cm128.positions else None
        owner = f"common_attn_metadata[{group!r}]"
        group_kind, group_device, ops = probe_all({
            **{f"{owner}.{name}": getattr(cm, name) for name in layout},
            f"{owner}.block_table_tensor": cm.block_table_tensor,
            f"{owner}.slot_mapping": cm.slot_mapping, f"{owner}.positions": positions})
        if (group_kind, group_device) != (kind, device):
            raise TypeError(f"common_attn_metadata[{group!r}]: expected arrays like the "
                            f"builder's buffers ({describe(like)}), "
                            f"got {describe(cm.block_table_tensor)}")
        for name in layout:
            mine, shared = ops[f"{owner}.{name}"], ops128[name]
            if (mine.ptr, mine.shape, mine.strides, mine.dtype) != \
                    (shared.ptr, shared.shape, shared.strides, shared.dtype):
                raise ValueError(f"common_attn_metadata[{group!r}].{name}: expected the "
                                 f"array the C128A group has (the groups share the query "
                                 f"layout)")
        table = ops[f"{owner}.block_table_tensor"]
        checks.check(table, (INT32,), 2)
        if table.shape[0] > cm.num_reqs:
            raise ValueError(f"common_attn_metadata[{group!r}].block_table_tensor: expected "
                             f"at most num_reqs ({cm.num_reqs}) rows, got shape "
                             f"{tuple(table.shape)}")
        tables[group] = table
        checks.check(ops[f"{owner}.slot_mapping"], SLOT_MAPPING_AXIS.values, 1,
                     min_len=num_tokens)
        if positions is not None:
            checks.check(ops[f"{owner}.positions"], POSITIONS_AXIS.values, 1,
                         min_len=num_tokens)
        if group == "swa":
            swa_slots = ops[f"{owner}.slot_mapping"]
    if swa_slots.dtype != ops128["slot_mapping"].dtype:
        raise TypeError(f"common_attn_metadata['swa'].slot_mapping: expected the C128A "
                        f"group's dtype {ops128['slot_mapping'].dtype}, got {swa_slots.dtype}")
    if tables["indexer"].shape[1] > max_blocks:
        raise ValueError(f"common_attn_metadata['indexer'].block_table_tensor: expected at "
                         f"most {max_blocks} columns (cdiv(max_model_len, block_size)),"
                         f" got shape {tuple(tables['indexer'].shape)}")
    return tables, swa_slots


def check_group_data(cms: dict, kind: str, *, c4a_block_size: int, swa_block_size: int,
                     num_cache_blocks: int | None) -> None:
    """``validate="full"``: the other groups' data (reads device arrays; the
    C128A group's is ``KVCacheGroup.check_step_data``'s). Their compressed
    slots' blocks lie inside their tables (and the cache), the SWA table
    covers each sequence, every group's positions equal the C128A group's,
    and every group marks the same tokens as padding (slot -1)."""
    cm128 = cms["c128a"]
    T = cm128.num_actual_tokens
    qsl = cm128.query_start_loc[:cm128.num_reqs + 1]
    for group in ("c4a", "indexer"):
        table = cms[group].block_table_tensor
        _naming(f"common_attn_metadata[{group!r}]", validation.slot_mapping_inputs, qsl,
                cm128.seq_lens, table, kind, c4a_block_size, C4A_RATIO, 1, num_cache_blocks, T)
    table = cms["swa"].block_table_tensor
    rows = table.shape[0]
    seq = host.host_copy(cm128.seq_lens, kind)[:rows].astype(np.int64)
    _naming("common_attn_metadata['swa']", validation.block_columns, table, kind,
            np.arange(rows), seq, swa_block_size, None, "request")
    padding = host.host_copy(cm128.slot_mapping, kind)[:T] < 0
    positions = (host.host_copy(cm128.positions, kind)[:T]
                 if cm128.positions is not None else None)
    for group in ("swa", "c4a", "indexer"):
        cm = cms[group]
        mine = host.host_copy(cm.slot_mapping, kind)[:T] < 0
        if (mine != padding).any():
            t = int(np.flatnonzero(mine != padding)[0])
            raise ValueError(f"common_attn_metadata[{group!r}].slot_mapping: expected the "
                             f"padding tokens (slot -1) of the C128A group's, got token {t} "
                             f"{'padding' if mine[t] else 'valid'} here and "
                             f"{'padding' if padding[t] else 'valid'} there")
        if cm.positions is None or cm.positions is cm128.positions:
            continue
        theirs = host.host_copy(cm.positions, kind)[:T]
        if positions is None or (theirs != positions).any():
            t = 0 if positions is None else int(np.flatnonzero(theirs != positions)[0])
            raise ValueError(f"common_attn_metadata[{group!r}].positions: expected the C128A "
                             f"group's positions, got {int(theirs[t])} at token {t}" +
                             ("" if positions is None else f" where it has {int(positions[t])}"))


def _naming(owner: str, check, *args) -> None:
    """Run a check of ``validation``, its error naming the group's array."""
    try:
        check(*args)
    except ValueError as error:
        message = str(error).replace("block_table:", "block_table_tensor:", 1)
        raise ValueError(f"{owner}.{message}") from None


def chunk_budgets(chunk_size: int, window_size: int, max_model_len: int,
                  max_num_batched_tokens: int) -> tuple[int, int]:
    """The workspace rows of a chunk of the C128A layers' and of the SWA-only layers' plans."""
    return tuple(chunk_budget(ratio, chunk_size, window_size, max_model_len,
                              max_num_batched_tokens) for ratio in (C128A_RATIO, 0))


#: Checked host views of ``seq_lens_cpu`` a step builder keeps.
MAX_HOST_VIEWS = 8


def prefill_plans(cm, host_qsl, split: Split, *, max_num_compressed: int,
                  window_size: int, budgets: tuple[int, int] | None,
                  kept: PreparedCalls | None = None) -> tuple[ChunkPlans | None, int]:
    """``(chunk plans, compressed rows of the indexer)`` from host data; no
    plans without ``budgets`` (``chunk_budgets``: no combined prefill rows).
    ``kept``: the host views of ``seq_lens_cpu`` checked before (``host_seq_lens``)."""
    num_decodes, num_prefills = split.num_decodes, split.num_prefills
    if not num_prefills:
        return None, 0
    seq_lens = host_seq_lens(cm, num_decodes + num_prefills, kept)
    verdict, value, chunks, c128a_chunks = step_chunk_plans(
        seq_lens, host.kernel_view(host_qsl, NUMPY), num_decodes, num_prefills,
        split.num_prefill_tokens, window_size, max_num_compressed,
        *(budgets or (0, 0)), budgets is not None)
    if verdict != PLANNED:
        _refuse(verdict, value, chunks, seq_lens[num_decodes:num_decodes + num_prefills],
                host_qsl[num_decodes:num_decodes + num_prefills + 1], split,
                max_num_compressed)
    if budgets is None:
        return None, value
    rows = chunks.tolist()
    placed = list(map(PlanChunk._make, rows))
    bounds = (c128a_chunks, *[(start, end, first_row, end_row)
                              for start, end, _, _, first_row, end_row in rows])
    return ChunkPlans(tuple(placed[:c128a_chunks]), tuple(placed[c128a_chunks:]), bounds), value


def host_seq_lens(cm, min_len: int, kept: PreparedCalls | None = None) -> np.ndarray:
    """The step's ``seq_lens_cpu`` (vLLM 0.34 has only the upper bound, exact
    for the prefill requests read here), checked, as the numba kernels take
    it. ``kept``: the views checked before, by ``keys.host_key``: an entry
    holds its array, so one with the same address, shape, strides and dtype
    is the same memory, and its checks but the length hold."""
    array = cm.seq_lens_cpu if cm.seq_lens_cpu is not None else cm.seq_lens_cpu_upper_bound
    key = keys.host_key(array) if kept is not None else None
    entry = kept.get(key) if key is not None else None
    if entry is not None and entry[1].shape[0] >= min_len:
        return entry[1]
    if array is None:
        raise ValueError("common_attn_metadata['c128a'].seq_lens_cpu: required for a step "
                         "with prefills (the chunk plans and the indexer's row count are "
                         "host decisions; or seq_lens_cpu_upper_bound), got None")
    seq_cpu = probe("seq_lens_cpu", array)
    if seq_cpu.kind not in HOST_KINDS:
        raise TypeError("seq_lens_cpu: expected a host array (numpy or torch CPU), got "
                        f"{describe(array)}")
    checks.check(seq_cpu, (INT32, INT64), 1, min_len=min_len)
    view = host.kernel_view(seq_cpu.array, seq_cpu.kind)
    if key is not None:
        kept.put(key, (array, view))
    return view


def _refuse(verdict: int, value: int, chunks, seq_lens, starts, split: Split,
            max_num_compressed: int) -> None:
    """Raise what ``step_chunk_plans``' ``verdict`` found wrong with the step's host data."""
    if verdict == BAD_SEQ_LENS:
        raise ValueError(f"seq_lens_cpu: expected the prefill requests' lengths in "
                         f"[0, {INT32_MAX}], got {seq_lens.tolist()}")
    if verdict == BAD_QUERY_LENS:
        raise ValueError(f"query_start_loc_cpu: expected the prefill requests' query "
                         f"lengths >= 0 and at most num_prefill_tokens="
                         f"{split.num_prefill_tokens} in all, got "
                         f"{(starts[1:].astype(np.int64) - starts[:-1]).tolist()}")
    if verdict == TOO_MANY_COMPRESSED:
        raise ValueError(f"seq_lens_cpu: expected at most max_num_compressed="
                         f"{max_num_compressed} compressed indexer rows over the "
                         f"prefills, got {value}")
    start, end, _, rows_per_request = chunks[value, :4].tolist()
    raise ValueError(f"seq_lens_cpu: a prefill chunk's workspace (M={rows_per_request} rows "
                     f"per request, {end - start} requests) exceeds int32")
