"""The README's Python blocks run as written (CPU path)."""
from __future__ import annotations

import re
from pathlib import Path

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
