"""docs/architecture.md against the code: the import table is each module's
imports exactly, the rooms are layered (a module imports only modules of the
rooms above, or of its own room listed before it), and every family module
follows the recipe for adding a family."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from dsv4_cupy import families

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dsv4_cupy"
DOC = (ROOT / "docs" / "architecture.md").read_text()


def library_modules() -> list[str]:
    return sorted(path.stem for path in PACKAGE.glob("*.py"))


def actual_imports(module: str) -> set[str]:
    """The library modules ``module`` imports (``from . import x``, ``from .x import y``)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    known = set(library_modules()) | {"bench"}
    return {name for name in found if name in known} - {module}


def table(heading: str) -> list[list[str]]:
    """The rows of the first table under ``## heading``, as lists of cells."""
    section = DOC.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


def names(cell: str) -> list[str]:
    return re.findall(r"`([\w.]+)`", cell)


DOCUMENTED_IMPORTS = {names(row[0])[0]: row[1] for row in table("Imports")}
ROOMS = [names(row[1]) for row in table("The rooms")]


def test_every_module_is_in_the_import_table_and_a_room():
    assert sorted(DOCUMENTED_IMPORTS) == library_modules()
    in_rooms = [module for room in ROOMS for module in room]
    assert sorted(in_rooms) == library_modules()
    assert len(in_rooms) == len(set(in_rooms))


@pytest.mark.parametrize("module", library_modules())
def test_the_import_table_is_what_the_module_imports(module):
    documented = DOCUMENTED_IMPORTS[module]
    if module == "families":
        assert documented == "the family modules"
        assert actual_imports(module) == set()
        return
    assert set(names(documented)) == actual_imports(module), module


@pytest.mark.parametrize("module", library_modules())
def test_a_module_imports_only_rooms_above_or_before_it(module):
    order = {name: index for index, name in enumerate(m for room in ROOMS for m in room)}
    room_of = {name: index for index, room in enumerate(ROOMS) for name in room}
    imported = actual_imports(module) | (set(families.MODULE_NAMES) if module == "families"
                                         else set())
    for other in imported - {"bench"}:
        assert (room_of[other] < room_of[module]
                or (room_of[other] == room_of[module] and order[other] < order[module])
                or module in ("__init__", "__main__")), f"{module} imports {other}"


@pytest.mark.parametrize("module", families.MODULES, ids=lambda m: m.__name__.split(".")[-1])
def test_every_family_module_follows_the_recipe(module):
    """One .cuh (its C struct and device function), one module (layout, numba
    kernel, declaration, description, warm-up), one line in families.py."""
    name = module.__name__.split(".")[-1]
    assert module.FAMILIES and all(family in families.ALL for family in module.FAMILIES)
    for family in module.FAMILIES:
        text = (PACKAGE.parent / "kernels" / family.file).read_text()
        assert re.search(rf"^struct {family.params.c_name} \{{", text, re.M), family.file
        assert re.search(rf"void {family.function}\b", text), family.function
        assert family.params is module.PARAMS
    assert any(callable(value) and key.endswith("_launch") for key, value in vars(module).items())
    assert callable(module.warm_launches)
    assert module.CPU_KERNEL is None or module.CPU_KERNEL in families.CPU_KERNELS
    assert families.MODULE_NAMES.count(name) == 1
