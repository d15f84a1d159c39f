"""The launch-parameter structs: dsv4_cupy/params.py must match kernels/params.cuh."""
from __future__ import annotations

import re

import numpy as np
import pytest

from dsv4_cupy import kernels, params

C_TYPES = {"ptr": {"const int*", "int*", "long long*", "const void*"},
           "i64": {"long long"}, "i32": {"int"}}


def c_structs() -> dict:
    text = (kernels.kernel_dir() / "params.cuh").read_text()
    structs = {}
    for name, body in re.findall(r"struct (\w+) \{(.*?)\};", text, re.S):
        fields = re.findall(r"^\s*([\w\s\*]+?)\s*(\w+);", body, re.M)
        structs[name] = [(field, " ".join(ctype.split())) for ctype, field in fields]
    return structs


@pytest.mark.parametrize("layout", params.ALL, ids=lambda p: p.c_name)
def test_layout_matches_the_c_struct(layout):
    c_fields = c_structs()[layout.c_name]
    assert [name for name, _ in c_fields] == list(layout.names)
    for (name, ctype), (_, kind) in zip(c_fields, layout.fields):
        assert ctype in C_TYPES[kind], f"{layout.c_name}.{name}: {ctype} is not {kind}"


def test_every_c_struct_has_a_layout():
    assert set(c_structs()) == {layout.c_name for layout in params.ALL}


def test_pack_round_trip():
    packed = params.C128A.pack(*range(1, len(params.C128A.names) + 1))
    assert packed.shape == (1,) and packed.dtype.itemsize % 8 == 0
    assert [int(packed[0][n]) for n in params.C128A.names] == list(range(1, 20))
    assert params.C128A.dtype.itemsize == 7 * 8 + 8 * 8 + 4 * 4


def test_layout_rejects_misordered_fields():
    with pytest.raises(ValueError, match="8-byte fields"):
        params.Params("Bad", [("a", params.I32), ("b", params.PTR)])


def test_pack_refuses_values_out_of_range():
    with pytest.raises(Exception):
        params.TOKEN_MAP.pack(0, 0, 1, 1 << 40)      # num_reqs is a C int
    assert np.frombuffer(params.TOKEN_MAP.pack(0, 0, 5, 3).tobytes()[16:24], np.int64)[0] == 5
