"""Launch parameters: the Python side of ``kernels/params.cuh``, set by field name.

Each kernel takes one struct by value. A struct is built from fields and from
field *groups* (a block table, a query layout, ...) declared once here and once
in ``params.cuh``. ``Params.pack_into(buffer, **fields)`` takes every field by
name: a missing or unknown name is a ``TypeError`` and a value that does not
fit its C type a ``struct.error``, both before anything reaches the GPU. The
loader compiles ``static_assert``s of every size and offset below into each
kernel, so a C struct that drifts from its Python twin fails to compile.
"""
from __future__ import annotations

import collections
import struct

import numpy as np

PTR, I64, I32 = "ptr", "i64", "i32"
_CODES = {PTR: ("Q", "u8", 8), I64: ("q", "i8", 8), I32: ("i", "i4", 4)}


class Array:
    """A fixed-length array field of PTR, I64 or I32 values (a C array)."""

    def __init__(self, kind: str, count: int):
        self.kind, self.count = kind, count
        code, dtype, size = _CODES[kind]
        self.format, self.dtype, self.item_size = f"{count}{code}", (dtype, (count,)), size
        self.size = size * count


class _Layout:
    """Fields (name, PTR | I64 | I32 | a nested layout), 8-byte ones first: no
    inner padding. ``values(**fields)`` gives the values in C order, flattened,
    for a field of a struct that nests this one."""

    def __init__(self, c_name: str, fields: list[tuple[str, object]]):
        self.c_name = c_name
        self.fields = tuple(fields)
        self.names = tuple(name for name, _ in fields)
        sizes = [kind.size if isinstance(kind, (_Layout, Array)) else _CODES[kind][2]
                 for _, kind in fields]
        alignments = [kind.item_size if isinstance(kind, Array) else size
                      for (_, kind), size in zip(fields, sizes)]
        if alignments != sorted(alignments, key=lambda s: s < 8):
            raise ValueError(f"{c_name}: put 8-byte fields and groups before 4-byte ones")
        self.format = "".join(kind.format if isinstance(kind, (_Layout, Array))
                              else _CODES[kind][0] for _, kind in fields)
        raw = sum(sizes)
        self.format += "x" * (-raw % 8)
        self.dtype = np.dtype([(name, kind.dtype if isinstance(kind, (_Layout, Array))
                                else _CODES[kind][1])
                               for name, kind in fields], align=True)
        self.size = self.dtype.itemsize
        assert self.size == struct.calcsize("<" + self.format), c_name
        #: The values of a section a fused kernel leaves off (every field 0).
        self.off = (0,) * len(struct.unpack("<" + self.format, bytes(self.size)))
        self.values = self._function("values", f"return ({self._flat()},)", {})

    def offsets(self) -> list[tuple[str, int]]:
        return [(name, self.dtype.fields[name][1]) for name in self.names]

    def _function(self, name: str, body: str, namespace: dict):
        args = ", ".join(self.names)
        source = f"def {name}({'buffer, ' if 'buffer' in body else ''}*, {args}):\n    {body}\n"
        exec(source, namespace)          # a fixed signature: checked by Python's own call
        return namespace[name]

    def _flat(self) -> str:
        return ", ".join(f"*{name}" if isinstance(kind, (_Layout, Array)) else name
                         for name, kind in self.fields)


class Group(_Layout):
    """A nested struct shared by several kernels' parameters. Its ``record``
    (a named tuple of the same fields) is how a launch names the group's
    values: ``launch.Launch`` turns it into the C struct's values on the GPU
    and hands it as it is (arrays as host views) to the numba kernels."""

    def __init__(self, c_name: str, fields: list[tuple[str, object]]):
        super().__init__(c_name, fields)
        # Bound below to a module-level name of its own: numba's disk cache
        # pickles the record's type by reference.
        self.record = collections.namedtuple(c_name, self.names, module=__name__)
        RECORD_LAYOUTS[self.record] = self


#: The layout of each group record.
RECORD_LAYOUTS: dict = {}


class Params(_Layout):
    """One kernel family's parameter struct; a fused family's struct nests those
    of the families it fuses."""

    def __init__(self, c_name: str, fields: list[tuple[str, object]]):
        super().__init__(c_name, fields)
        self.groups = tuple(kind for _, kind in fields if isinstance(kind, _Layout))
        self._struct = struct.Struct("<" + self.format)
        self.pack_into = self._function(
            "pack_into", f"_pack_into(buffer, 0, {self._flat()})",
            {"_pack_into": self._struct.pack_into})

    def pack_values_into(self, buffer, values: tuple) -> None:
        """Pack the struct's flattened ``values`` (in C order, as ``values()``
        gives them) into ``buffer``: a wrong count is a ``struct.error``."""
        self._struct.pack_into(buffer, 0, *values)

    def pack(self, **fields) -> np.ndarray:
        """The struct as a one-element structured array (tests and inspection)."""
        buffer = bytearray(self.size)
        self.pack_into(buffer, **fields)
        return np.frombuffer(bytes(buffer), self.dtype)


# --- field groups (params.cuh has the per-field comments) ---------------------------------
QUERY_LAYOUT = Group("QueryLayout", [
    ("query_start_loc", PTR), ("seq_lens", PTR), ("num_reqs", I64)])
BLOCK_TABLE = Group("BlockTable", [
    ("entries", PTR), ("rows", I64), ("cols", I64), ("row_stride", I64)])
SLOT_GEOMETRY = Group("SlotGeometry", [
    ("block_size", I64), ("ratio", I64), ("cp_world_size", I64), ("cp_rank", I64),
    ("cp_interleave", I64)])
C128A_ROWS = Group("C128ARows", [
    ("global_decode", PTR), ("decode_lens", PTR), ("prefill", PTR), ("decode_stride", I64),
    ("prefill_stride", I64), ("width", I64), ("num_valid_tokens", I64)])
ROW_CHUNKS = Group("RowChunks", [("cols_per_block", I64), ("chunks", I64), ("row_blocks", I64)])
#: Chunks of a prefill plan one step launch carries (a longer plan takes more launches).
MAX_PLAN_CHUNKS = 32
PREFILL_PLAN = Group("PrefillPlan", [
    ("chunks", I64), ("first_request", Array(I32, MAX_PLAN_CHUNKS)),
    ("rows_per_request", Array(I32, MAX_PLAN_CHUNKS)),
    ("swa_offset", Array(I32, MAX_PLAN_CHUNKS))])
GROUPS = (QUERY_LAYOUT, BLOCK_TABLE, SLOT_GEOMETRY, C128A_ROWS, ROW_CHUNKS, PREFILL_PLAN)
QueryLayout, BlockTable, SlotGeometry, C128ARows, RowChunks, PrefillPlan = (
    group.record for group in GROUPS)

# --- one struct per kernel family ---------------------------------------------------------
TOKEN_MAP = Params("TokenMapParams", [
    ("query", QUERY_LAYOUT), ("out", PTR), ("num_tokens", I64)])
SLOT_MAPPING = Params("SlotMappingParams", [
    ("query", QUERY_LAYOUT), ("table", BLOCK_TABLE), ("geometry", SLOT_GEOMETRY),
    ("token_slots", PTR), ("out", PTR), ("out_len", I64), ("num_tokens", I64)])
C128A = Params("C128AParams", [
    ("positions", PTR), ("token_to_req", PTR), ("slot_mapping", PTR), ("table", BLOCK_TABLE),
    ("geometry", SLOT_GEOMETRY), ("rows", C128A_ROWS), ("chunks", ROW_CHUNKS),
    ("num_tokens", I64), ("num_decode_tokens", I64)])
SWA = Params("SwaParams", [
    ("query", QUERY_LAYOUT), ("table", BLOCK_TABLE), ("token_to_req", PTR),
    ("is_valid_token", PTR), ("indices", PTR), ("lens", PTR), ("indices_stride", I64),
    ("window_size", I64), ("block_size", I64), ("token_offset", I64), ("num_rows", I64),
    ("guess_shift", I64)])
GLOBAL_TOPK = Params("GlobalTopkParams", [
    ("table", BLOCK_TABLE), ("topk_indices", PTR), ("token_to_req", PTR),
    ("is_valid_token", PTR), ("out", PTR), ("lens", PTR), ("topk_stride", I64),
    ("out_stride", I64), ("width", I64), ("num_tokens", I64), ("block_size", I64)])
SHORT_CONTEXT = Params("ShortContextParams", [
    ("positions", PTR), ("out", PTR), ("out_stride", I64), ("top_k", I64), ("ratio", I64),
    ("num_tokens", I64)])
COMBINE = Params("CombineParams", [
    ("query", QUERY_LAYOUT), ("gather_lens", PTR), ("topk_indices", PTR), ("out", PTR),
    ("lens", PTR), ("topk_stride", I64), ("out_stride", I64), ("width", I64),
    ("num_tokens", I64), ("window_size", I64), ("ratio", I64), ("topk", I64),
    ("rows_per_request", I64), ("swa_offset", I64)])
PREFILL_GATHER = Params("PrefillGatherParams", [
    ("query", QUERY_LAYOUT), ("out", PTR), ("num_decodes", I64), ("num_prefills", I64),
    ("window_size", I64)])
INDEXER_PREFILL = Params("IndexerPrefillParams", [
    ("query", QUERY_LAYOUT), ("cu_compressed", PTR), ("token_to_seq", PTR), ("seqlen_ks", PTR),
    ("seqlen_ke", PTR), ("num_compressed", I64), ("ratio", I64), ("query_slice_start", I64),
    ("query_slice_stop", I64)])
INDEXER_DECODE = Params("IndexerDecodeParams", [
    ("query", QUERY_LAYOUT), ("table", BLOCK_TABLE), ("context_lens", PTR), ("req_ids", PTR),
    ("decode_lens", PTR), ("block_rows", PTR), ("block_rows_stride", I64), ("num_tokens", I64),
    ("context_lens_len", I64), ("ratio", I64)])
#: A layer type's combined prefill rows over a prefill plan (a section of the step kernel).
PREFILL_COMBINE = Params("PrefillCombineParams", [("rows", COMBINE), ("lanes", I64),
                                                  ("plan", PREFILL_PLAN)])

# --- fused families: each nests the structs of the families it fuses ----------------------
C4A_LAYER = Params("C4ALayerParams", [
    ("decode", GLOBAL_TOPK), ("prefill", COMBINE), ("decode_blocks", I64),
    ("decode_compact", I64)])
#: The step kernel's sections, in grid order: each is one family's struct.
STEP_SECTIONS_OF = (("token_map", TOKEN_MAP), ("group_slots", SLOT_MAPPING), ("c128a", C128A),
                    ("swa", SWA), ("c4a_slots", SLOT_MAPPING), ("indexer_slots", SLOT_MAPPING),
                    ("gather", PREFILL_GATHER), ("indexer_decode", INDEXER_DECODE),
                    ("indexer_prefill", INDEXER_PREFILL), ("c128a_combine", PREFILL_COMBINE),
                    ("swa_combine", PREFILL_COMBINE), ("short_context", SHORT_CONTEXT))
STEP_SECTION_NAMES = tuple(name for name, _ in STEP_SECTIONS_OF)
STEP_SECTIONS = Group("StepSections", [(name, I64) for name in STEP_SECTION_NAMES])
GROUPS += (STEP_SECTIONS,)
STEP = Params("StepParams", [*STEP_SECTIONS_OF, ("sections", STEP_SECTIONS),
                             ("swa_slot_mapping", PTR), ("is_valid_out", PTR)])
ALL = (TOKEN_MAP, SLOT_MAPPING, C128A, SWA, GLOBAL_TOPK, SHORT_CONTEXT, COMBINE, PREFILL_GATHER,
       INDEXER_PREFILL, INDEXER_DECODE, PREFILL_COMBINE, C4A_LAYER, STEP)
