"""Structured-output options of a request -> SamplingParams.guided (the core enforces it with a token mask).

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` (extra_body) and vLLM's newer `structured_outputs` object (`json`,
`regex`, `choice`, `grammar`, `json_object`) all become one GuidedDecoding; at most one may be given.
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
    options = [("guided_json", req.guided_json), ("guided_regex", req.guided_regex),
               ("guided_choice", req.guided_choice), ("guided_grammar", req.guided_grammar)]
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError("structured_outputs must be an object", "structured_outputs")
        options += [(f"structured_outputs.{k}", so.get(k)) for k in ("json", "regex", "choice", "grammar")]
        if so.get("json_object"):
            given.append(("structured_outputs.json_object", {"kind": "json_object"}))
    for param, value in options:
        if value is not None:
            given.append((param, _guided(param, value)))
    if len(given) > 1:
        raise ApiError(f"give at most one of {', '.join(p for p, _ in given)}", given[1][0])
    return (given[0][1], given[0][0]) if given else (None, None)


def error_param(field: str, source: str | None) -> str | None:
    """The request param to name for a core error about `params.guided...`, else None."""
    field = field.removeprefix("params.")
    if field.startswith("guided") and source is not None:
        return source
    return None


def _guided(param: str, value) -> dict:
    kind = param.rsplit("_", 1)[-1].rsplit(".", 1)[-1]
    if kind == "json":
        spec = value
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except (json.JSONDecodeError, RecursionError) as e:   # text nested past the parser's depth
                raise ApiError(f"{param} is not valid JSON: {e}", param) from None
        if not isinstance(spec, (dict, bool)):
            raise ApiError(f"{param} must be a JSON schema (an object)", param)
        return {"kind": "json", "spec": json.dumps(spec)}
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ApiError(f"{param} must be a list of strings", param)
        return {"kind": "choice", "choices": list(value)}
    if not isinstance(value, str):
        raise ApiError(f"{param} must be a string", param)
    return {"kind": kind, "spec": value}
