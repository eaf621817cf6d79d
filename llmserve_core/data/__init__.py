"""Text shipped with the package: corpus.txt, prose from the Python standard library's docstrings
(PSF License, see the file's header), used to train the tiny test tokenizer and model and for the
benchmark's natural-text prompts. Regenerate it with scripts/build_corpus.py."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("corpus.txt")


@lru_cache(maxsize=1)
def corpus_paragraphs() -> tuple[str, ...]:
    """The corpus as paragraphs in file order, without the license header."""
    text = CORPUS_PATH.read_text(encoding="utf-8")
    body = "\n".join(line for line in text.split("\n") if not line.startswith("#"))
    return tuple(p.strip() for p in body.split("\n\n") if p.strip())
