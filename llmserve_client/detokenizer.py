"""Incremental detokenization: turn a growing list of token ids into text deltas.

The concatenation of every delta plus flush() equals decode(all ids) (skip_special_tokens as given,
no tokenization-space cleanup). Text is only released up to a character boundary: while the decoded
window ends in U+FFFD the last token(s) may be the first bytes of a multi-byte character, so they are
held back until a later token completes it (or the request ends).

Bytes that can never complete a character (a model emitting stray bytes) must not hold everything after
them back: with a byte-level decoder (GPT-2 style, Qwen's), which joins every token's bytes and decodes
them as UTF-8 with replacement, a split before the newest token is final once decoding the two sides
apart gives the same text as decoding them together (a partial character before the split would come
out as two replacements apart and as one, or a whole character, together). So the text before the
newest token is released then, and the window stays short.

Each push decodes two short windows (four while text is held back) rather than the whole sequence, so a
long generation costs O(n), not O(n^2). The window starts at the previous release point, which keeps the
context tokenizers such as SentencePiece need to place leading spaces.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.token_ids: list[int] = []
        self._prefix_offset = 0      # window start: the previous release point
        self._read_offset = 0        # tokens before this are released as text
        self._skip = skip_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is not None and hasattr(backend, "decode") and hasattr(backend, "get_vocab_size"):
            # A fast tokenizer: call the Rust decoder directly (transformers' wrapper costs more than the work).
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=self._skip)
            from tokenizers import decoders     # there is a backend, so the package is installed
            self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=self._skip,
                                                        clean_up_tokenization_spaces=False)
            self._byte_level = False

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly releasable text (possibly "")."""
        self.token_ids.extend(token_ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The request ended: release whatever is held back, complete character or not."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        ids = self.token_ids
        if self._read_offset == len(ids):
            return ""
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(ids[self._prefix_offset:])
        if final or (len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd")):
            return self._advance(len(ids), prefix_text, new_text)
        split = len(ids) - 1
        if self._byte_level and split > self._read_offset:
            head = self._decode(ids[self._prefix_offset:split])
            tail = self._decode(ids[split:])     # empty for a skipped special token: no byte shows anything
            if tail and len(head) > len(prefix_text) and head + tail == new_text:
                return self._advance(split, prefix_text, head)
        return ""

    def _advance(self, read_offset: int, prefix_text: str, text: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, read_offset
        return text[len(prefix_text):]
