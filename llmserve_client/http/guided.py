"""Structured-output options of a request -> SamplingParams.guided (the core enforces it with a token mask).

OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` (extra_body) all become one GuidedDecoding; at most one may be given.
The returned param name is the one an error about the grammar names (the core reports `guided.<kind>`).
"""
from __future__ import annotations

import json

from llmserve_client.http.schemas import ApiError


def guided_from_request(req) -> tuple[dict | None, str | None]:
    """(guided dict or None, the request param it came from)."""
    given: list[tuple[str, dict]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            given.append(("response_format", {"kind": "json_object"}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise ApiError("response_format.json_schema must be an object with a `schema` object",
                               "response_format.json_schema")
            given.append(("response_format", {"kind": "json", "spec": json.dumps(js.get("schema", {}))}))
        elif kind != "text":
            raise ApiError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                           "response_format.type")
    if req.guided_json is not None:
        spec = req.guided_json
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except (json.JSONDecodeError, RecursionError) as e:   # text nested past the parser's depth
                raise ApiError(f"guided_json is not valid JSON: {e}", "guided_json") from None
        if not isinstance(spec, (dict, bool)):
            raise ApiError("guided_json must be a JSON schema (an object)", "guided_json")
        given.append(("guided_json", {"kind": "json", "spec": json.dumps(spec)}))
    if req.guided_regex is not None:
        given.append(("guided_regex", {"kind": "regex", "spec": req.guided_regex}))
    if req.guided_choice is not None:
        given.append(("guided_choice", {"kind": "choice", "choices": list(req.guided_choice)}))
    if req.guided_grammar is not None:
        given.append(("guided_grammar", {"kind": "grammar", "spec": req.guided_grammar}))
    if len(given) > 1:
        raise ApiError(f"give at most one of {', '.join(p for p, _ in given)}", given[1][0])
    return (given[0][1], given[0][0]) if given else (None, None)


def error_param(field: str, source: str | None) -> str | None:
    """The request param to name for a core error about `params.guided...`, else None."""
    field = field.removeprefix("params.")
    if field.startswith("guided") and source is not None:
        return source
    return None
