"""Which request fields act, which are ignored, and which are refused: the server's side of OpenAI's schema.

A client library may send any field of OpenAI's published request schema, and new ones appear with each SDK
release; refusing one it does not know would lock that client out. So a field the request Structs declare
acts (schemas.py, responses.py); a field OpenAI defines that this server does not implement, and whose
absence changes nothing a client could rely on, is accepted and ignored (IGNORED below); and one whose
honouring matters is accepted only at its neutral value, else refused with a 400 naming it (check_neutral).
A field no schema knows is ignored too, unless the server runs with --strict-requests (then a 400, as
before). Every ignored field that was set (not null) is named in the response's `llmserve-ignored-fields`
header and in a warning log line (at most one a minute per endpoint and set of fields). docs/openai.md
holds the same table for people; tests/test_request_fields.py checks it against the installed SDK's types.
"""
from __future__ import annotations

import logging
import re
import time

import msgspec

from llmserve_client.http.schemas import ApiError, decode as decode_struct

log = logging.getLogger("llmserve_client.http")

HEADER = "llmserve-ignored-fields"

# OpenAI's request fields this server accepts and ignores, per endpoint. What each would do at OpenAI:
# metadata/store/service_tier/prompt_cache_*: storage, billing and caching (prefix caching here is automatic);
# safety_identifier: abuse tracking (`user` acts: whom the core's fair shares count a request for);
# prediction: a latency hint (the output is the same);
# verbosity: a style hint; web_search_options: OpenAI's own search tool (the answer comes without it);
# include/top_logprobs (responses): extra output data; truncation "auto": drop old input instead of a 400.
IGNORED = {
    "chat": frozenset({"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                       "prompt_cache_options", "prompt_cache_retention", "prediction", "verbosity",
                       "web_search_options"}),
    "completions": frozenset(),
    "embeddings": frozenset(),
    "score": frozenset(),       # vLLM's endpoints: no OpenAI fields to ignore
    "rerank": frozenset(),
    "responses": frozenset({"access_programs", "background_options", "context_management", "image", "include",
                            "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
                            "safety_identifier", "service_tier", "store", "top_logprobs", "truncation"}),
}

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
LOG_EVERY_S = 60.0
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
MAX_NAMED = 16          # ignored fields a header or log line names; the rest are counted


def check_content_type(content_type: str | None) -> None:
    """Bodies are JSON and say so, as vLLM requires: a missing or other content type is a 400 (vLLM's message)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ApiError("Unsupported Media Type: Only 'application/json' is allowed", None)


def decode(body: bytes, kind: type, endpoint: str, strict: bool) -> tuple[object, list[str]]:
    """(the request Struct, the names of the set fields it ignores). Unknown fields are a 400 when strict."""
    try:
        top = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        raise ApiError("the request body must be a JSON object") from None
    except msgspec.DecodeError as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError("the request body nests JSON too deeply") from None
    known = kind.__struct_fields__
    if strict:
        unknown = [k for k in top if k not in known and k not in IGNORED[endpoint]]
        if unknown:
            raise ApiError(f"invalid request: Object contains unknown field `{_shown(unknown[0])}` "
                           f"(this server runs with --strict-requests)", _shown(unknown[0]))
    req = decode_struct(body, kind)
    ignored = [k for k in top if k not in known and bytes(top[k]) != b"null"]
    return req, ignored


def _shown(name: str) -> str:
    """A client's field name, safe in a header or a log line (anything else is summarised)."""
    return name if _NAME.fullmatch(name) else "<unusual name>"


def header_value(ignored: list[str]) -> str:
    names = sorted({_shown(n) for n in ignored})
    more = len(names) - MAX_NAMED
    return ", ".join(names[:MAX_NAMED]) + (f", and {more} more" if more > 0 else "")


class IgnoredFieldLog:
    """One warning per endpoint and set of ignored fields per LOG_EVERY_S, saying how many it held back."""

    MAX_KEYS = 256

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._last: dict[tuple, list] = {}     # key -> [time logged, requests since held back]

    def note(self, endpoint: str, ignored: list[str]) -> None:
        if not ignored:
            return
        names = header_value(ignored)
        key, now = (endpoint, names), self.clock()
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < LOG_EVERY_S:
            seen[1] += 1
            return
        held = seen[1] if seen is not None else 0
        if len(self._last) >= self.MAX_KEYS:
            self._last.clear()
        self._last[key] = [now, 0]
        log.warning("%s: ignored request field(s) this server does not implement: %s%s", endpoint, names,
                    f" (and in {held} more request(s) since the last such line)" if held else "")


def check_neutral(req, endpoint: str) -> None:
    """OpenAI fields honoured only at their neutral value: anything else is a 400 naming the field and why."""
    if endpoint == "chat":
        if req.audio is not None:
            raise ApiError("audio output is not available: this model outputs text only", "audio")
        if req.modalities is not None and any(m != "text" for m in req.modalities):
            raise ApiError("modalities: this model outputs text only", "modalities")
        if req.functions:
            raise ApiError("the deprecated `functions` are not served: use `tools` and `tool_choice`", "functions")
        if req.function_call is not None and req.function_call != "none":
            raise ApiError("the deprecated `function_call` is not served: use `tools` and `tool_choice`",
                           "function_call")
    if getattr(req, "moderation", None) is not None:
        raise ApiError("moderation is not available: this server runs no moderation model", "moderation")


def thinking_switch(effort: str | None, template_kwargs: dict | None, template_has_switch: bool, param: str
                    ) -> tuple[dict | None, bool]:
    """(chat_template_kwargs with OpenAI's reasoning effort applied, whether the effort was ignored).

    Qwen3's thinking is on or off (`enable_thinking`): efforts "none" and "minimal" turn it off, the others
    leave it on. A template without that switch (an Instruct or a Thinking-only model) ignores the effort."""
    if effort is None:
        return template_kwargs, False
    if effort not in REASONING_EFFORTS:
        raise ApiError(f"{param} must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", param)
    if not template_has_switch:
        return template_kwargs, True
    if effort not in ("none", "minimal"):
        return template_kwargs, False
    kwargs = dict(template_kwargs or {})
    if kwargs.get("enable_thinking", False) is not False:
        raise ApiError(f"{param} {effort!r} turns thinking off, but chat_template_kwargs.enable_thinking turns it on",
                       param)
    kwargs["enable_thinking"] = False
    return kwargs, False
