"""The README's Python blocks run as written (CPU path)."""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import dsv4_cupy as d4
from dsv4_cupy.group import KVCacheGroup

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_every_python_block_of_the_readme_runs(capsys):
    blocks = python_blocks()
    assert blocks, "the README has no Python block"
    namespace = {}                  # a block may build on the ones before it
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "4 (4, 1, 512)" in out and "[ 39  39 468 468]" in out
    assert "[(0, 1, 2, 302)]" in out and "(300, 640) [ 1249  1250 14999 15000]" in out


def _readme_signatures() -> dict:
    """``name -> inspect.Signature`` of each function the README's API table lists."""
    text = README.read_text()
    table = text[text.index("## API"):text.index("**`block_size`")]
    found = {}
    for name, arguments in re.findall(r"`([A-Za-z_0-9]+)\((.*?)\)`", table):
        if hasattr(d4, name) and name not in found:
            tree = ast.parse(f"def {name}({arguments}): pass")
            found[name] = inspect.signature(_compiled(tree, name))
    return found


def _compiled(tree, name):
    namespace = {}
    exec(compile(tree, str(README), "exec"), namespace)
    return namespace[name]


def _shape(signature: inspect.Signature) -> list:
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()
            if p.name != "self"]


def test_the_api_table_lists_every_public_function_with_its_signature():
    listed = _readme_signatures()
    public = {name for name in d4.__all__ if callable(getattr(d4, name))
              and (inspect.isfunction(getattr(d4, name)) or name.endswith("Builder"))}
    assert public <= set(listed), f"not in the README's API table: {sorted(public - set(listed))}"
    for name, signature in listed.items():
        # The builder takes KVCacheGroup's arguments through *args, **kwargs.
        target = KVCacheGroup if name == "DeepseekV4MetadataBuilder" else getattr(d4, name)
        assert _shape(signature) == _shape(inspect.signature(target)), name


def test_ci_runs_the_readme_commands_as_written():
    """The README's test command is the line .ci/run runs; the demo command installs
    the package and runs the demo."""
    install_and_demo, test = re.findall(r"```bash\n(.*?)\n```", README.read_text(), re.S)[:2]
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert test in ci
    assert install_and_demo.startswith("pip install ") and "dsv4_cupy demo" in install_and_demo
