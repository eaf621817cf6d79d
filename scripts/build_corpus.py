"""Regenerate llmserve_core/data/corpus.txt from the prose in the Python standard library's docstrings.

The standard library is distributed under the PSF License Agreement, which allows redistribution of
derived text with its notice kept; the header of the output says so. Modules are parsed with `ast`,
never imported, and walked in sorted order, so the same Python release gives the same file.
Code samples (doctest lines, indented blocks, symbol-heavy lines) are dropped to keep the text prose-like.

    python scripts/build_corpus.py [--out llmserve_core/data/corpus.txt] [--max-bytes 400000]
"""
from __future__ import annotations

import argparse
import ast
import platform
import re
import sysconfig
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages",
             "ensurepip", "__pycache__", "pydoc_data", "config-3", "tkinter", "distutils"}
WORD = re.compile(r"[A-Za-z][a-z]+")


def header(version: str) -> str:
    return (
        "# Prose excerpted from docstrings of the Python " + version + " standard library.\n"
        "# Copyright (c) 2001-2024 Python Software Foundation; All Rights Reserved.\n"
        "# Redistributed under the PSF License Agreement (https://docs.python.org/3/license.html).\n"
        "# Regenerate with scripts/build_corpus.py. Lines starting with '#' are this header, not corpus text.\n"
    )


def docstrings(source: str):
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def is_prose(line: str) -> bool:
    stripped = line.strip()
    if not stripped or stripped.startswith((">>>", "...", "$ ", "#", "|", "+-", "==", "--", ":param", ":return")):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in stripped)
    return letters / len(stripped) > 0.85


def paragraphs(doc: str):
    """Blank-line separated paragraphs, reflowed to one line; code-like or indented blocks dropped."""
    for block in re.split(r"\n\s*\n", doc):
        lines = block.split("\n")
        if any(line.startswith((" ", "\t")) for line in lines):
            continue  # indented: code sample or argument table
        if not all(is_prose(line) for line in lines):
            continue
        text = " ".join(line.strip() for line in lines)
        text = re.sub(r"\s+", " ", text).strip()
        if len(text) < 60 or len(WORD.findall(text)) < 10 or text.endswith("::") or not text[0].isupper():
            continue
        if not text.endswith((".", "?", "!", ":")) or text.endswith(":"):
            continue
        yield text


def build(max_bytes: int) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not SKIP_DIRS & set(p.relative_to(stdlib).parts[:-1]) and "test" not in p.name)
    seen: set[str] = set()
    out = [header(platform.python_version())]
    size = len(out[0])
    for file in files:
        try:
            source = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for doc in docstrings(source):
            for para in paragraphs(doc):
                if para in seen or not para.isascii():
                    continue
                seen.add(para)
                out.append(para + "\n\n")
                size += len(para) + 2
                if size >= max_bytes:
                    return "".join(out)
    return "".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "llmserve_core/data/corpus.txt"))
    parser.add_argument("--max-bytes", type=int, default=400_000)
    args = parser.parse_args()
    text = build(args.max_bytes)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {len(text)} bytes, {text.count(chr(10) + chr(10))} paragraphs to {args.out}")


if __name__ == "__main__":
    main()
