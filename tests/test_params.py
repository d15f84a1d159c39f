"""The launch-parameter structs: fields by name, and each family's C struct
(in its kernels/<family>.cuh; the shared groups in params.cuh) checked against
its Python layout field by field here and by size in the compiler."""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from dsv4_cupy import c128a, families, loader, params, token_map
from dsv4_cupy.family import KernelFamily

C_TYPES = {params.PTR: {"const int*", "int*", "long long*", "const long long*", "const void*",
                        "unsigned char*", "unsigned int*", "const unsigned char*", "unsigned short*",
                        "const unsigned short*"},
           params.I64: {"i64", "long long"}, params.I32: {"int"}}


def layouts() -> list:
    """Every launch struct and group: the families' structs and what they nest."""
    found, pending = {}, [family.params for family in families.ALL] + list(params.GROUPS)
    while pending:
        layout = pending.pop()
        if layout.c_name not in found:
            found[layout.c_name] = layout
            pending += [kind for _, kind in layout.fields if isinstance(kind, params._Layout)]
    return sorted(found.values(), key=lambda layout: layout.c_name)


def c_structs() -> dict:
    """{struct name: [(field, C type)]} parsed from every kernels/*.cuh."""
    text = "".join(path.read_text() for path in sorted(loader.kernel_dir().glob("*.cuh")))
    structs = {}
    for name, body in re.findall(r"^struct (\w+) \{(.*?)^\};", text, re.S | re.M):
        fields = re.findall(r"^\s*([\w\s\*]+?)\s*(\w+)(\[\w+\])?;", body, re.M)
        structs[name] = [(field, " ".join(ctype.split()) + ("[]" if array else ""))
                         for ctype, field, array in fields]
    return structs


@pytest.mark.parametrize("layout", layouts(), ids=lambda p: p.c_name)
def test_python_layout_matches_the_c_struct_field_by_field(layout):
    c_fields = c_structs()[layout.c_name]
    assert [name for name, _ in c_fields] == list(layout.names)
    for (name, ctype), (_, kind) in zip(c_fields, layout.fields):
        if isinstance(kind, (params.Group, params.Params)):
            assert ctype == kind.c_name, f"{layout.c_name}.{name}: {ctype} is not {kind.c_name}"
        elif isinstance(kind, params.Array):
            assert ctype.endswith("[]") and ctype[:-2] in C_TYPES[kind.kind], \
                f"{layout.c_name}.{name}: {ctype} is not an array of {kind.kind}"
        else:
            assert ctype in C_TYPES[kind], f"{layout.c_name}.{name}: {ctype} is not {kind}"


def test_every_c_parameter_struct_has_a_python_layout():
    names = {layout.c_name for layout in layouts()}
    assert {name for name in c_structs() if name.endswith("Params")} <= names
    assert names <= set(c_structs())

GEOMETRY = dict(block_size=2, ratio=128, cp_world_size=1, cp_rank=0, cp_interleave=1)


def token_map_fields(**changes):
    fields = dict(query=params.QUERY_LAYOUT.values(query_start_loc=16, seq_lens=0, num_reqs=3),
                  out=32, num_tokens=5)
    fields.update(changes)
    return fields


def test_fields_are_set_by_name_and_land_at_their_offsets():
    packed = token_map.PARAMS.pack(**token_map_fields())
    assert packed["query"]["query_start_loc"][0] == 16 and packed["query"]["num_reqs"][0] == 3
    assert packed["out"][0] == 32 and packed["num_tokens"][0] == 5
    assert token_map.PARAMS.size == 5 * 8


def test_a_missing_or_unknown_field_is_an_error_not_garbage():
    with pytest.raises(TypeError, match="num_tokens"):
        token_map.PARAMS.pack(query=(0, 0, 1), out=0)
    with pytest.raises(TypeError, match="num_token"):
        token_map.PARAMS.pack(**token_map_fields(num_token=5))
    with pytest.raises(TypeError, match="rank"):
        params.SLOT_GEOMETRY.values(block_size=2, ratio=4, cp_world_size=1, cp_interleave=1)


def test_a_group_of_the_wrong_size_or_a_value_too_large_is_refused():
    with pytest.raises(struct.error):
        token_map.PARAMS.pack(**token_map_fields(query=(0, 0)))
    with pytest.raises(struct.error):
        token_map.PARAMS.pack(**token_map_fields(num_tokens=1 << 63))


def test_layouts_put_8_byte_fields_first():
    with pytest.raises(ValueError, match="8-byte fields"):
        params.Params("Bad", [("a", params.I32), ("b", params.PTR)])



def test_a_nested_struct_packs_as_its_fields_in_place():
    outer = params.Params("Outer", [("inner", token_map.PARAMS), ("tail", params.I64)])
    inner = token_map.PARAMS.values(query=params.QUERY_LAYOUT.values(
        query_start_loc=16, seq_lens=32, num_reqs=3), out=48, num_tokens=7)
    assert inner == (16, 32, 3, 48, 7)
    packed = outer.pack(inner=inner, tail=9)
    assert bytes(packed) == struct.pack("<QQqQqq", 16, 32, 3, 48, 7, 9)


@pytest.mark.parametrize("family", families.ALL, ids=lambda f: f.function)
def test_every_struct_size_is_asserted_in_the_compiled_source(family):
    text = loader.source(family)
    for layout in (*family.params.groups, family.params):
        assert f"static_assert(sizeof({layout.c_name}) == {layout.size}," in text


def test_a_c_struct_of_another_size_fails_to_compile():
    pytest.importorskip("cupy")
    from dsv4_cupy import errors
    drifted = params.Params("TokenMapParams", [("query", params.QUERY_LAYOUT), ("out", params.PTR)])
    family = KernelFamily("token_map.cuh", "token_to_req_indices", drifted)
    with pytest.raises(errors.KernelCompileError, match="size differs from its Python layout"):
        loader.compile_for(family, "sm_90")


def test_the_structured_view_matches_numpy_alignment():
    for layout in layouts():
        assert layout.size % 8 == 0
        assert layout.dtype.itemsize == layout.size
    assert np.dtype(c128a.PARAMS.dtype).names[:3] == ("positions", "token_to_req", "slot_mapping")
