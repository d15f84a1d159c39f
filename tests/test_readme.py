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
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "4 (4, 1, 512)" in out and "[ 39  39 468 468]" in out
