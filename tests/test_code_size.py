"""Small modules with one job: no file of llmserve_core over MAX_FILE_LINES lines, and no function
outside kernels/ over MAX_FUNCTION_LINES (the charter's "about 500" and "about 80", with a little slack
so a line of docstring does not fail the suite). A Triton kernel is one function by nature: kernels/
keeps only the file bound."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FILE_LINES = 520
MAX_FUNCTION_LINES = 90


def long_functions(source: str, where: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """'where:line name (N lines)' for each function or method, nested ones too, longer than `limit`
    (counted from its def line, decorators aside, to its last line)."""
    return [f"{where}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def core_files() -> list[Path]:
    return sorted(p for p in (ROOT / "llmserve_core").rglob("*.py") if "__pycache__" not in p.parts)


def test_no_core_file_is_too_long():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in core_files()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES]
    assert long == []


def test_no_core_function_outside_kernels_is_too_long():
    long = []
    for p in core_files():
        if "kernels" not in p.relative_to(ROOT / "llmserve_core").parts:
            long += long_functions(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))
    assert long == []


def test_a_long_method_is_found():
    body = "\n".join(f"        x = {i}" for i in range(6))
    source = f"class A:\n    @staticmethod\n    def f():\n{body}\n\n\ndef g():\n    pass\n"
    assert long_functions(source, "m.py", limit=6) == ["m.py:3 f (7 lines)"]
    assert long_functions(source, "m.py", limit=7) == []
