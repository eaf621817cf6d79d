"""Reasoning parsers: split a thinking model's output into reasoning_content and content.

`qwen3` (vLLM's name): the text between `<think>` and `</think>` is reasoning, the rest content. Qwen3's
templates may open the block themselves (the prompt ends in `<think>`; the output then starts inside it)
or close it (`enable_thinking: false` renders an empty block), and a generation cut short may never
close it: then everything after `<think>` is reasoning. Streaming holds back a possible partial tag so a
tag split across steps never leaks into either field.
"""
from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3",)


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt leaves a `<think>` block open, so the output begins inside it."""
    tail = prompt_text.rstrip()
    return tail.endswith(START)


def prompt_closes_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends with a closed `<think>` block (`enable_thinking: false`): the output is the
    answer from its first token."""
    return prompt_text.rstrip().endswith(END)


def split_reasoning(text: str, opened: bool) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; a missing part is None."""
    parser = ReasoningStream(opened)
    reasoning, content = parser.feed(text)
    r2, c2 = parser.flush()
    reasoning, content = reasoning + r2, content + c2
    return (reasoning if parser.saw_reasoning else None), (content or None)


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Incremental split: feed text deltas, get (reasoning delta, content delta)."""

    def __init__(self, opened: bool):
        self.state = "reasoning" if opened else "start"    # start: before any text, a <think> may open
        self.saw_reasoning = opened
        self.buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning, content = [], []
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(START):
                    self.buf = stripped[len(START):]
                    self.state, self.saw_reasoning = "reasoning", True
                    continue
                if START.startswith(stripped):       # maybe the beginning of <think>: wait for more
                    break
                self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(END)
                if i >= 0:
                    reasoning.append(self.buf[:i])
                    self.buf = self.buf[i + len(END):]
                    self.state = "after"
                    continue
                keep = partial_tag_len(self.buf, END)
                reasoning.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            elif self.state == "after":             # the newlines Qwen3 writes after </think> are layout
                self.buf = self.buf.lstrip("\n")
                if self.buf:
                    self.state = "content"
                else:
                    break
            else:
                content.append(self.buf)
                self.buf = ""
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The output ended: what was held back belongs to the current part."""
        buf, self.buf = self.buf, ""
        if self.state == "reasoning":
            return buf, ""
        if self.state == "start" and buf.strip() == "":
            return "", buf
        return "", buf if self.state != "after" else buf.lstrip("\n")
