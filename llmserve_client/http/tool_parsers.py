"""Tool-call parsers: find a model's tool calls in its text and stream them as OpenAI does.

`hermes` (vLLM's name; Qwen3's format): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
`qwen3_coder` (qwen3_coder.py; Qwen3-Coder's format): `<tool_call><function=NAME><parameter=ARG>VALUE
</parameter>...</function></tool_call>`. `detect_parser` picks one from a chat template.

Each parser is a stream: `feed(text) -> (content, [tool_call deltas in OpenAI's shape])`, then `flush()` when
the output ends. A whole response is that stream folded (`parse_tool_calls`), so a request gets one answer
whether it streams or not:
- text before the first call is content (without the whitespace that leads into the call); text between or
  after calls is dropped, as vLLM does;
- a call that does not parse is text (content), unless a call went out before it or its own name already
  went out (a stream cannot take that back);
- a call cut off by the end of the output (max_tokens) whose name is known is a call, its arguments what the
  model wrote of them (so not JSON: the finish reason, "length", says why); one cut off before its name is
  dropped, markup and all (vLLM's choice for both).
While streaming, a hermes call's id, type and name go out once the name is complete, then its arguments as
fragments of the model's own text (held back where they might still turn out to be the wrapper's closing
brace), so the fragments concatenate to the arguments' JSON.
`required` and named tool choices are enforced with a grammar (`forced_call_guided`) in the hermes shape,
whatever the model's own format, and parsed as hermes.
"""
from __future__ import annotations

import json
import re
import uuid

from llmserve_client.http.reasoning import partial_tag_len

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "qwen3_coder")
# Qwen3 writes the name first; then the arguments value runs to the wrapper's closing brace.
_HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*', re.S)


def new_call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex


def detect_parser(chat_template) -> str | None:
    """The tool-call format a chat template teaches: Qwen3-Coder's XML (`<function=...>` with
    `<parameter=...>`), else Qwen3's hermes JSON in `<tool_call>` tags, else none."""
    if isinstance(chat_template, dict):         # a tokenizer may name several templates
        chat_template = "\n".join(t for t in chat_template.values() if isinstance(t, str))
    if not isinstance(chat_template, str):
        return None
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if START in chat_template:
        return "hermes"
    return None


def new_stream(parser: str, tools: list[dict] | None = None):
    """A fresh stream parser (tools: the request's, whose schemas type qwen3_coder's arguments)."""
    if parser == "qwen3_coder":
        from llmserve_client.http.qwen3_coder import CoderCallStream
        return CoderCallStream(tools)
    return ToolCallStream()


def parse_tool_calls(text: str, parser: str = "hermes", tools: list[dict] | None = None
                     ) -> tuple[str | None, list[dict]]:
    """(content or None, OpenAI tool_calls) of a whole output: its stream, folded."""
    stream = new_stream(parser, tools)
    content, deltas = stream.feed(text)
    tail, more = stream.flush()
    return (content + tail) or None, fold_deltas(deltas + more)


def fold_deltas(deltas: list[dict]) -> list[dict]:
    """Streamed tool_call deltas -> whole tool_calls (id, type and name from each call's first delta)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.get(d["index"])
        if call is None:
            calls[d["index"]] = {"id": d["id"], "type": d["type"],
                                 "function": {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}}
        else:
            call["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


class CallStream:
    """What both formats share: content before the first call, calls between START and END, call indexes.

    A subclass parses one call's text: `_progress()` (more of it arrived) and `_close(cut)` (its END came,
    or with cut the output ended inside it), each returning deltas, `_close` None for a call that is text."""

    def __init__(self):
        self.buf = ""
        self.in_call = False
        self.call = ""              # the current call's text so far
        self.index = -1             # OpenAI's tool_calls index of the last call sent: only calls sent count
        self.head_sent = False
        self.lead = ""              # whitespace before a call: dropped if it is a call, content if it is text

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
                    text = self.lead + self.buf[:i]
                    body = text.rstrip()
                    if not self.num_calls:
                        content.append(body)
                    self.lead = text[len(body):]
                    self.buf = self.buf[i + len(START):]
                    self.in_call, self.call, self.head_sent = True, "", False
                    self._start()
                    continue
                keep = partial_tag_len(self.buf, START)
                text = self.lead + self.buf[:len(self.buf) - keep]
                body = text.rstrip()
                if not self.num_calls:       # text between or after calls is dropped, as vLLM does
                    content.append(body)
                self.lead = text[len(body):]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            i = self.buf.find(END)
            if i >= 0:
                self.call += self.buf[:i]
                self.buf = self.buf[i + len(END):]
                text, done = self._end_call(cut=False)
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
        """The output ended: a call cut short is finished as far as it goes; held-back text is content."""
        if self.in_call:
            self.call += self.buf
            self.buf = ""
            return self._end_call(cut=True)
        buf, lead, self.buf, self.lead = self.buf, self.lead, "", ""
        return ("" if self.num_calls else lead + buf), []

    def _end_call(self, cut: bool) -> tuple[str, list[dict]]:
        self.in_call = False
        done = self._close(cut)
        if done is None:                        # not a call after all: its text, unless calls went out
            if cut or self.num_calls:
                return "", []
            text, self.lead = self.lead + START + self.call + END, ""
            return text, []
        self.lead = ""
        return "", done

    def _head(self, name: str) -> dict:
        self.head_sent = True
        self.index += 1
        return {"index": self.index, "id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _args(self, fragment: str) -> dict:
        return {"index": self.index, "function": {"arguments": fragment}}

    def _start(self) -> None:
        """A new call's START was seen."""

    def _progress(self) -> list[dict]:
        raise NotImplementedError

    def _close(self, cut: bool) -> list[dict] | None:
        """The call's remaining deltas (its END came, or with cut the output ended inside it); None when
        it is no call (it does not parse and its name never went out)."""
        raise NotImplementedError


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


class ToolCallStream(CallStream):
    """Incremental hermes parsing."""

    def _start(self) -> None:
        self.args_sent = ""

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
            out.append(self._send(safe[len(self.args_sent):]))
        return out

    def _send(self, fragment: str) -> dict:
        self.args_sent += fragment
        return self._args(fragment)

    def _close(self, cut: bool) -> list[dict] | None:
        out = self._progress()
        loaded = _load_call(self.call.strip())
        m = _HEAD.match(self.call)
        if loaded is None:
            if not self.head_sent:
                return None
            # Closed, it stays as sent; cut off, its arguments end as the model wrote them.
            return out + (self._rest(self.call[m.end():].rstrip()) if cut else [])
        name, args = loaded
        if not self.head_sent:
            out.append(self._head(name))
        raw = self.call[m.end():].rstrip() if m else ""
        if isinstance(args, dict) and raw.endswith("}") and raw[:-1].rstrip().startswith(self.args_sent):
            rest = raw[:-1].rstrip()[len(self.args_sent):]
        elif not self.args_sent:
            rest = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        else:
            rest = ""
        if rest:
            out.append(self._send(rest))
        return out

    def _rest(self, written: str) -> list[dict]:
        """What is left to send of a cut-off call's arguments, as the model wrote them."""
        if written.startswith(self.args_sent) and len(written) > len(self.args_sent):
            return [self._send(written[len(self.args_sent):])]
        return []


def forced_call_guided(tools: list[dict], name: str | None) -> dict:
    """The grammar (SamplingParams.guided) of exactly one hermes call of `name`, or of any tool."""
    options = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    schemas = [{"type": "object",
                "properties": {"name": {"const": f["name"]},
                               "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for f in options]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {"kind": "json", "spec": json.dumps(schema), "prefix": START + "\n", "suffix": "\n" + END}
