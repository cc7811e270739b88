"""No function of the library is over 80 lines (split into named helpers instead)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.paths import REPO

LIMIT = 80


def long_functions(root: Path) -> list[str]:
    """``path:line name: N lines`` of each function under ``root`` longer than ``LIMIT`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            length = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and length > LIMIT:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_library_function_over_80_lines():
    assert long_functions(REPO / "megatron_epp") == []


def test_a_long_nested_function_is_found(tmp_path):
    (tmp_path / "m.py").write_text("class C:\n    def f(self):\n" + "        x = 1\n" * LIMIT + "\n\ndef g():\n    pass\n")
    assert long_functions(tmp_path) == [f"m.py:2 f: {LIMIT + 1} lines"]
