"""Incremental detokenization: turn a growing list of token ids into text deltas.

The concatenation of every delta plus flush() equals decode(all ids) (skip_special_tokens as given,
no tokenization-space cleanup). Text is only released up to a character boundary: while the decoded
window ends in U+FFFD the last token(s) may be the first bytes of a multi-byte character, so they are
held back until a later token completes it (or the request ends).

Each push decodes two short windows rather than the whole sequence, so a long generation costs O(n), not
O(n^2). The window starts at the previous release point, which keeps the context tokenizers such as
SentencePiece need to place leading spaces.
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
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=self._skip,
                                                        clean_up_tokenization_spaces=False)

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
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd")):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return new_text[len(prefix_text):]
