"""The `qwen3_coder` tool-call parser (vLLM's name): Qwen3-Coder's XML-style calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A call's id, type and name go out as soon as `<function=NAME>` is complete; then each parameter as it
completes (at its `</parameter>`, or at the next `<parameter=` or `</function>` where the model left the
closing tag out, as vLLM allows), as a fragment of the arguments' JSON: `{"city": "Paris"`, `, "days": 3`,
and `}` at `</function>` (or at `</tool_call>` without one). A value loses one newline on each side and is
typed by the request's JSON schema for that parameter (`typed_value`): the text of a string, a number,
a boolean, null, or the object or array the text spells; text that is not what the schema says stays text.
A call cut off by the end of the output keeps the parameters it completed, without the closing brace.
The rest (content, calls that are text, cut-off calls) is CallStream's, shared with hermes.
"""
from __future__ import annotations

import ast
import json
import math
import re

from llmserve_client.http.tool_parsers import CallStream

FUNCTION, PARAMETER = "<function=", "<parameter="
END_FUNCTION, END_PARAMETER = "</function>", "</parameter>"
_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_INTEGER = re.compile(r"-?\d+")
MAX_LITERAL_CHARS = 100_000      # Python literals (ast) are parsed only up to this size


class CoderCallStream(CallStream):
    def __init__(self, tools: list[dict] | None):
        super().__init__()
        self.schemas = {}
        for t in tools or []:
            f = t.get("function") or {}
            props = (f.get("parameters") or {}).get("properties")
            self.schemas[f.get("name")] = props if isinstance(props, dict) else {}

    def _start(self) -> None:
        self.pos = 0              # where in self.call parsing goes on
        self.params = 0           # parameters sent
        self.closed = False       # the arguments' closing brace went out

    def _progress(self, final: bool = False) -> list[dict]:
        """Deltas for what the call's text completes now; final: the call's END came (values run to it)."""
        out = []
        if not self.head_sent:
            m = _HEAD.match(self.call)
            if m is None:
                return out
            out.append(self._head(m.group(1).strip()))
            self.pos = m.end()
        while not self.closed:
            rest = self.call[self.pos:]
            body = rest.lstrip()
            skipped = len(rest) - len(body)
            if body.startswith(END_FUNCTION):
                out.append(self._close_args())
                self.pos += skipped + len(END_FUNCTION)
            elif body.startswith(PARAMETER):
                sent = self._parameter(self.pos + skipped, final)
                if sent is None:
                    break
                out.append(sent)
            else:
                nxt = [i for i in (body.find(PARAMETER), body.find(END_FUNCTION)) if i > 0]
                if not nxt:          # stray text, or a tag still arriving: wait
                    break
                self.pos += skipped + min(nxt)
        return out

    def _parameter(self, at: int, final: bool) -> dict | None:
        """The fragment of the parameter whose tag starts at `at`, if it is complete (None: wait)."""
        start = at + len(PARAMETER)
        gt = self.call.find(">", start)
        if gt < 0:
            return None
        name = self.call[start:gt].strip()
        value_at = gt + 1
        ends = [(i, tag) for tag in (END_PARAMETER, PARAMETER, END_FUNCTION)
                if (i := self.call.find(tag, value_at)) >= 0]
        if ends:
            end, tag = min(ends)
            self.pos = end + (len(END_PARAMETER) if tag == END_PARAMETER else 0)
        elif final:
            end = self.pos = len(self.call)
        else:
            return None
        value = self.call[value_at:end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        typed = typed_value(value, self.schemas.get(self._name, {}).get(name))
        fragment = ("{" if not self.params else ", ") + json.dumps(name, ensure_ascii=False) + ": " + \
            json.dumps(typed, ensure_ascii=False)
        self.params += 1
        return self._args(fragment)

    def _close_args(self) -> dict:
        self.closed = True
        return self._args("}" if self.params else "{}")

    def _head(self, name: str) -> dict:
        self._name = name
        return super()._head(name)

    def _close(self, cut: bool) -> list[dict] | None:
        out = self._progress(final=not cut)
        if not self.head_sent:
            return None
        if not cut and not self.closed:        # </tool_call> closes a function left open
            out.append(self._close_args())
        return out


def _schema_types(schema) -> set[str]:
    """The JSON types a parameter's schema allows (empty: it does not say)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    types = {kind} if isinstance(kind, str) else {t for t in kind if isinstance(t, str)} if isinstance(kind, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= _schema_types(sub)
    for value in ([schema["const"]] if "const" in schema else []) + list(schema.get("enum") or []):
        types.add(_json_type(value))
    return types


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")


def typed_value(text: str, schema) -> object:
    """A parameter's value text as the JSON value its schema asks for; the text itself where the schema
    allows a string first, says nothing, or the text is not of any type it allows."""
    types = _schema_types(schema)
    if not types or types == {"string"}:
        return text
    s = text.strip()
    if "null" in types and s == "null":
        return None
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if "integer" in types and _INTEGER.fullmatch(s):
        return int(s)
    if ("number" in types or "integer" in types) and _NUMBER.fullmatch(s):
        number = float(s)
        if math.isfinite(number) and ("number" in types or number.is_integer()):
            return int(number) if "integer" in types and number.is_integer() else number
    if types & {"object", "array"}:
        value = _container(s)
        if (isinstance(value, dict) and "object" in types) or (isinstance(value, list) and "array" in types):
            return value
    return text


def _container(s: str):
    """The object or array `s` spells as JSON, or as a Python literal (models write both); else None."""
    try:
        return json.loads(s)
    except (json.JSONDecodeError, RecursionError):
        pass
    if len(s) > MAX_LITERAL_CHARS:
        return None
    try:
        return json.loads(json.dumps(ast.literal_eval(s), allow_nan=False))   # only what JSON can carry
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
