"""A chat request's tools and tool_choice -> what the template offers, the grammar that forces a call, and
the parser that reads the calls back.

- `none` offers no tools (OpenAI: the model calls none);
- `auto` offers them and parses the model's own format: the server's --tool-call-parser, else the one its
  chat template teaches (tool_parsers.detect_parser); a template that teaches none needs the flag;
- `required` and a named function force one call with a grammar (any server, no flag): the hermes shape,
  parsed as hermes, whatever the model's own format (as vLLM forces JSON for them);
- OpenAI's `allowed_tools` narrows the tools to those it lists (only they are offered), then acts as its
  mode (`auto` or `required`).
Only function tools are served; a custom (free-text) tool or a hosted one is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmserve_client.http.schemas import ApiError
from llmserve_client.http.tool_parsers import forced_call_guided

CHOICE_SHAPES = ('tool_choice must be none, auto, required, {"type": "function", "function": {"name": ...}} or '
                 '{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [...]}}')


@dataclass
class ToolSetup:
    tools: list[dict] | None = None      # for the chat template (None: offer none)
    guided: dict | None = None           # the grammar a required or named choice forces
    parser: str | None = None            # how the output's calls are read (None: it is all content)


def tool_setup(req_tools, choice, parser: str | None) -> ToolSetup:
    """req_tools: the request's schemas.Tool list (or None); choice: its tool_choice as sent; parser: the
    server's parser for `auto` (None: this model has no known format)."""
    choice = choice if choice is not None else ("auto" if req_tools else "none")
    if not req_tools:
        if choice != "none":
            raise ApiError("tool_choice needs tools", "tool_choice")
        return ToolSetup()
    if choice == "none":
        return ToolSetup()      # OpenAI: the model calls no tool, so the prompt offers none
    tools = []
    for i, t in enumerate(req_tools):
        if t.type != "function" or t.function is None:
            raise ApiError(f"tool type {t.type!r} is not supported (function tools only)", f"tools[{i}].type")
        f = t.function
        tools.append({"type": "function", "function": {k: v for k, v in (
            ("name", f.name), ("description", f.description), ("parameters", f.parameters)) if v is not None}})
    names = [t["function"]["name"] for t in tools]
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        tools, choice = _allowed(choice.get("allowed_tools"), tools, names)
    if choice == "auto":
        if parser is None:
            raise ApiError("tool_choice auto needs a tool-call format: this model's chat template shows none; start "
                           "the server with --tool-call-parser (hermes or qwen3_coder)", "tool_choice")
        return ToolSetup(tools, None, parser)
    if choice == "required":
        return ToolSetup(tools, forced_call_guided(tools, None), "hermes")
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None   # a client may send any JSON here
    if not isinstance(name, str) or (isinstance(choice, dict) and choice.get("type", "function") != "function"):
        raise ApiError(CHOICE_SHAPES, "tool_choice")
    if name not in names:
        raise ApiError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return ToolSetup(tools, forced_call_guided(tools, name), "hermes")


def _allowed(allowed, tools: list[dict], names: list[str]) -> tuple[list[dict], str]:
    if not isinstance(allowed, dict) or allowed.get("mode") not in ("auto", "required") \
            or not isinstance(allowed.get("tools"), list) or not allowed["tools"]:
        raise ApiError(CHOICE_SHAPES, "tool_choice")
    keep = []
    for t in allowed["tools"]:
        function = t.get("function") if isinstance(t, dict) else None
        name = function.get("name") if isinstance(function, dict) else t.get("name") if isinstance(t, dict) else None
        if name not in names:
            raise ApiError(f"tool_choice.allowed_tools names {name!r}, which is not among the tools", "tool_choice")
        keep.append(name)
    return [t for t in tools if t["function"]["name"] in keep], allowed["mode"]
