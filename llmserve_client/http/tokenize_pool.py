"""Tokenizing and chat-template rendering off the event loop, in two lanes, so a large prompt never holds a
small one.

Prompts past max_model_len are refused before they get here (limits.py), so the largest job is bounded, but
it can still take a second. Small prompts (under SMALL_CHARS characters, nearly all chat turns) have a
thread of their own, and large ones another: any number of large prompts in the queue cost a small one
nothing but the CPU they share. HF fast tokenizers release the GIL while their Rust code encodes, so the two
lanes do run in parallel where it matters; rendering a chat template is Python, but cheap next to encoding.
Each thread works on its own copy of the tokenizer: the event loop's detokenizers use the original, and a
fast tokenizer's Rust object refuses a second borrower while one changes its settings.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("llmserve_client.http")

SMALL_CHARS = 32_768


class TokenizePool:
    def __init__(self):
        self.tokenizer = None                 # set by start(); the copies are made from it
        self._local = threading.local()
        self._small = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-tokenize-small")
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-tokenize-large")

    def start(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def run(self, size: int, fn, *args):
        """fn(tokenizer, *args) on the lane for a job of `size` characters, with that thread's tokenizer."""
        lane = self._small if size < SMALL_CHARS else self._large
        return await asyncio.get_running_loop().run_in_executor(lane, self._call, fn, args)

    def _call(self, fn, args):
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = _copy(self.tokenizer)
        return fn(tok, *args)

    def close(self) -> None:
        self._small.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)


def _copy(tokenizer):
    try:
        return copy.deepcopy(tokenizer)
    except Exception as e:     # a tokenizer that cannot be copied is shared (as it was with one thread)
        log.warning("tokenizer cannot be copied per thread (%r); the threads share it", e)
        return tokenizer
