"""Tool-call parsers: find a model's tool calls in its text and stream them as OpenAI does.

`hermes` (vLLM's name; Qwen3's format): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
Text before the first call is content, and so is a call that does not parse (whole or streamed, unless
its name already went out). While streaming, a call's id, type and name go out as soon as the name is
complete, then its arguments as fragments of the model's own text (held back where they might still turn
out to be the wrapper's closing brace), so the fragments concatenate to the arguments' JSON.
`required` and named tool choices are enforced with a grammar (`forced_call_guided`), not hoped for.
"""
from __future__ import annotations

import json
import re
import uuid

from llmserve_client.http.reasoning import partial_tag_len

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)
_CALL = re.compile(re.escape(START) + r"\s*(.*?)\s*" + re.escape(END), re.S)
# Qwen3 writes the name first; then the arguments value runs to the wrapper's closing brace.
_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.S)


def new_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


def _load_call(text: str) -> tuple[str, object] | None:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):   # the model's text may nest past the parser's depth
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], obj.get("arguments", {})


def _json_string(body: str) -> str | None:
    """The text of a JSON string literal's body; None where JSON has no such string (a bad escape, a raw
    control character)."""
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return None


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content before the calls or None, OpenAI tool_calls). A call that is not valid JSON leaves the
    whole text as content, as vLLM does."""
    bodies = _CALL.findall(text)
    unclosed = text.rfind(START) > text.rfind(END)      # cut short inside a call
    if unclosed:
        bodies.append(text[text.rfind(START) + len(START):].strip())
    if not bodies:
        return (text or None), []
    calls = []
    for body in bodies:
        loaded = _load_call(body)
        if loaded is None:
            return (text or None), []
        name, args = loaded
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": name, "arguments": args if isinstance(args, str)
                                   else json.dumps(args, ensure_ascii=False)}})
    content = text[:text.find(START)].strip()
    return (content or None), calls


class ToolCallStream:
    """Incremental hermes parsing. feed(delta) -> (content delta, [tool_call deltas in OpenAI's shape])."""

    def __init__(self):
        self.buf = ""
        self.in_call = False
        self.call = ""              # the current call's text so far
        self.index = -1             # OpenAI's tool_calls index of the last call sent: only calls sent count
        self.head_sent = False
        self.args_sent = ""

    @property
    def num_calls(self) -> int:
        return self.index + 1

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buf += delta
        content, calls = [], []
        while self.buf:
            if not self.in_call:
                i = self.buf.find(START)
                if i >= 0:
                    if not self.num_calls:
                        content.append(self.buf[:i])
                    self.buf = self.buf[i + len(START):]
                    self.in_call, self.call, self.head_sent, self.args_sent = True, "", False, ""
                    continue
                keep = partial_tag_len(self.buf, START)
                if not self.num_calls:       # text between or after calls is dropped, as vLLM does
                    content.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            i = self.buf.find(END)
            if i >= 0:
                self.call += self.buf[:i]
                self.buf = self.buf[i + len(END):]
                text, done = self._end_call(END)
                content.append(text)
                calls.extend(done)
                continue
            keep = partial_tag_len(self.buf, END)
            self.call += self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            calls.extend(self._progress())
            break
        return "".join(content), calls

    def flush(self) -> tuple[str, list[dict]]:
        """The output ended. A call cut short is finished if its JSON is whole."""
        if self.in_call:
            self.call += self.buf
            self.buf = ""
            return self._end_call("")
        buf, self.buf = self.buf, ""
        return ("" if self.num_calls else buf), []

    def _head(self, name: str) -> dict:
        self.head_sent = True
        self.index += 1
        return {"index": self.index, "id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _args(self, fragment: str) -> dict:
        self.args_sent += fragment
        return {"index": self.index, "function": {"arguments": fragment}}

    def _progress(self) -> list[dict]:
        m = _HEAD.match(self.call)
        if m is None:
            return []
        out = []
        if not self.head_sent:
            name = _json_string(m.group(1))
            if name is None:
                return out   # the model's text is not JSON after all: the call is judged whole at its end
            out.append(self._head(name))
        value = self.call[m.end():]
        if not value.startswith("{"):
            return out       # arguments as a JSON string (or no object): their text goes out whole at the end
        safe = value.rstrip(" \t\r\n}")
        if len(safe) > len(self.args_sent) and safe.startswith(self.args_sent):
            out.append(self._args(safe[len(self.args_sent):]))
        return out

    def _end_call(self, closing: str) -> tuple[str, list[dict]]:
        """The current call's text is all in (closing: its end tag, "" when the output ended inside it) ->
        (content, tool_call deltas). A call that does not parse is text, as parse_tool_calls has it, unless
        its head already went out (a stream cannot take that back)."""
        self.in_call = False
        calls = self._finish_call()
        if calls is None:
            return ("" if self.num_calls else START + self.call + closing), []
        return "", calls

    def _finish_call(self) -> list[dict] | None:
        """The rest of the current call's deltas; None when it does not parse and nothing of it was sent."""
        loaded = _load_call(self.call.strip())
        if loaded is None:
            return [] if self.head_sent else None
        name, args = loaded
        out = [] if self.head_sent else [self._head(name)]
        m = _HEAD.match(self.call)
        raw = self.call[m.end():].rstrip() if m else ""
        if isinstance(args, dict) and raw.endswith("}") and raw[:-1].rstrip().startswith(self.args_sent):
            rest = raw[:-1].rstrip()[len(self.args_sent):]
        elif not self.args_sent:
            rest = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        else:
            rest = ""
        if rest:
            out.append(self._args(rest))
        return out


def forced_call_guided(tools: list[dict], name: str | None) -> dict:
    """The grammar (SamplingParams.guided) of exactly one hermes call of `name`, or of any tool."""
    options = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    schemas = [{"type": "object",
                "properties": {"name": {"const": f["name"]},
                               "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for f in options]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"kind": "json", "spec": json.dumps(schema), "prefix": START + "\n", "suffix": "\n" + END}
