"""Launch parameters: how a kernel's struct is declared in Python, set by field
name, and the field groups several families share (``kernels/params.cuh``).

Each kernel takes one struct by value, declared in its family's module and
its ``.cuh``. A struct is built from fields and from field *groups* (a block
table, a query layout, ...). ``Params.pack_into(buffer, **fields)`` takes every field by
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
        namespace: dict = {}
        exec(f"def values_of(record):\n    {', '.join(self.names)}, = record\n"
             f"    return ({self._flat()},)\n", namespace)
        #: The flattened values of a record of the fields, in their order.
        self.values_of = namespace["values_of"]
        counts = [kind.count if isinstance(kind, Array) else len(kind.off)
                  if isinstance(kind, _Layout) else 1 for _, kind in fields]
        #: Each single-valued field's index in the flattened values.
        self.value_index = {name: sum(counts[:i]) for i, ((name, kind), count)
                            in enumerate(zip(fields, counts))
                            if not isinstance(kind, (_Layout, Array))}

    def with_values(self, values: tuple, fields: dict) -> tuple:
        """Flattened ``values`` with single-valued fields set by name."""
        values = list(values)
        for name, value in fields.items():
            values[self.value_index[name]] = value
        return tuple(values)

    def offsets(self) -> list[tuple[str, int]]:
        return [(name, self.dtype.fields[name][1]) for name in self.names]

    def offset_of(self, name: str, *inner: str) -> int:
        """A field's byte offset; with ``inner``, that of a field of the nested
        layout ``name`` (names in turn)."""
        offset = self.dtype.fields[name][1]
        return offset + dict(self.fields)[name].offset_of(*inner) if inner else offset

    def _function(self, name: str, body: str, namespace: dict):
        args = ", ".join(self.names)
        source = f"def {name}({'buffer, ' if 'buffer' in body else ''}*, {args}):\n    {body}\n"
        exec(source, namespace)          # a fixed signature: checked by Python's own call
        return namespace[name]

    def _flat(self) -> str:
        return ", ".join(f"*{name}" if isinstance(kind, (_Layout, Array)) else name
                         for name, kind in self.fields)


class Group(_Layout):
    """A nested struct: of several kernels' parameters (here), or of one
    family's (in its module, ``module`` naming it). Its ``record`` (a named
    tuple of the same fields) is how a launch names the group's values:
    ``launch.Launch`` turns it into the C struct's values on the GPU and hands
    it as it is (arrays as host views) to the numba kernels."""

    def __init__(self, c_name: str, fields: list[tuple[str, object]],
                 module: str = __name__):
        super().__init__(c_name, fields)
        # Bound to a module-level name of that module (named as the struct):
        # numba's disk cache pickles the record's type by reference.
        self.record = collections.namedtuple(c_name, self.names, module=module)
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


# --- the shared field groups (params.cuh has the per-field comments) ----------------------
QUERY_LAYOUT = Group("QueryLayout", [
    ("query_start_loc", PTR), ("seq_lens", PTR), ("num_reqs", I64)])
BLOCK_TABLE = Group("BlockTable", [
    ("entries", PTR), ("rows", I64), ("cols", I64), ("row_stride", I64)])
SLOT_GEOMETRY = Group("SlotGeometry", [
    ("block_size", I64), ("ratio", I64), ("cp_world_size", I64), ("cp_rank", I64),
    ("cp_interleave", I64)])
GROUPS = (QUERY_LAYOUT, BLOCK_TABLE, SLOT_GEOMETRY)
QueryLayout, BlockTable, SlotGeometry = (group.record for group in GROUPS)
