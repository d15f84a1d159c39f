"""Launch parameters, typed once: the Python side of ``kernels/params.cuh``.

Each kernel takes one struct by value. ``Params.pack_into`` writes the values
with the C layout (``struct`` format codes: a Python int that does not fit its
C type raises instead of being passed as the wrong type) into a buffer that
``kernels.launch`` hands to ``cuLaunchKernel`` as the kernel's only argument.
tests/test_params.py checks these layouts against params.cuh.
"""
from __future__ import annotations

import struct

import numpy as np

PTR, I64, I32 = "ptr", "i64", "i32"
_CODES = {PTR: ("Q", "u8", 8), I64: ("q", "i8", 8), I32: ("i", "i4", 4)}


class Params:
    """A C struct layout: ``fields`` are (name, PTR | I64 | I32), 8-byte ones first."""

    def __init__(self, c_name: str, fields: list[tuple[str, str]]):
        self.c_name = c_name
        self.fields = fields
        self.names = tuple(name for name, _ in fields)
        sizes = [_CODES[kind][2] for _, kind in fields]
        if sizes != sorted(sizes, reverse=True):
            raise ValueError(f"{c_name}: put 8-byte fields before 4-byte ones")
        size = sum(sizes)
        padding = -size % 8
        self._format = "<" + "".join(_CODES[kind][0] for _, kind in fields) + "x" * padding
        self.dtype = np.dtype([(name, _CODES[kind][1]) for name, kind in fields], align=True)
        assert self.dtype.itemsize == size + padding == struct.calcsize(self._format)

    @property
    def size(self) -> int:
        return self.dtype.itemsize

    def pack_into(self, buffer, values: tuple) -> None:
        """Write the struct for one launch (values in field order; pointers as
        ints, 0 = null) into ``buffer`` (at least ``size`` bytes)."""
        struct.pack_into(self._format, buffer, 0, *values)

    def pack(self, *values) -> np.ndarray:
        """The struct as a one-element structured array (for tests and inspection)."""
        buffer = bytearray(self.size)
        self.pack_into(buffer, values)
        return np.frombuffer(bytes(buffer), self.dtype)


TOKEN_MAP = Params("TokenMapParams", [("qsl", PTR), ("out", PTR), ("num_tokens", I64),
                                      ("num_reqs", I32)])

SLOT_MAPPING = Params("SlotMappingParams", [
    ("qsl", PTR), ("seq_lens", PTR), ("block_table", PTR), ("out", PTR), ("bt_cols", I64),
    ("bt_stride", I64), ("block_size", I64), ("ratio", I64), ("cp_world_size", I64),
    ("cp_rank", I64), ("cp_interleave", I64), ("out_len", I64), ("num_rows", I32)])

C128A = Params("C128AParams", [
    ("positions", PTR), ("token_to_req", PTR), ("block_table", PTR), ("slot_mapping", PTR),
    ("global_decode", PTR), ("decode_lens", PTR), ("prefill", PTR), ("num_tokens", I64),
    ("ratio", I64), ("num_decode_tokens", I64), ("bt_rows", I64), ("bt_cols", I64),
    ("bt_stride", I64), ("gd_stride", I64), ("pf_stride", I64), ("block_size", I32),
    ("width", I32), ("cols_per_block", I32), ("chunks", I32)])

BUILD_STEP = Params("BuildStepParams", [
    ("qsl", PTR), ("seq_lens", PTR), ("block_table", PTR), ("positions", PTR),
    ("slot_mapping", PTR), ("req_out", PTR), ("csm_out", PTR), ("global_decode", PTR),
    ("decode_lens", PTR), ("prefill", PTR), ("bt_rows", I64), ("bt_cols", I64),
    ("bt_stride", I64), ("num_tokens", I64), ("num_decode_tokens", I64), ("ratio", I64),
    ("block_size", I64), ("cp_world_size", I64), ("cp_rank", I64), ("cp_interleave", I64),
    ("csm_len", I64), ("row_stride", I64), ("row_blocks", I64), ("num_reqs", I32),
    ("width", I32), ("cols_per_block", I32), ("chunks", I32)])

ALL = (TOKEN_MAP, SLOT_MAPPING, C128A, BUILD_STEP)
