"""`POST /v1/responses`: OpenAI's Responses API, served through the chat pipeline.

A request becomes a chat request (`to_chat`): `instructions` a system message, `input` (text, or message,
function_call, function_call_output and reasoning items) the messages, `max_output_tokens`,
`temperature`, `top_p`, function `tools` and `tool_choice`, `text.format` (json_schema, json_object) and
`reasoning.effort` (onto the thinking switch) their chat twins. The chat shaper's output (reasoning,
content, tool calls) becomes output items by one builder (`ResponseBuilder`), streamed as the typed events
the SDK parses or folded into one response, so both answers agree.

No conversation state is kept (`store` is ignored): `previous_response_id`, `conversation`, `background`
and stored `prompt`s are refused with a 400 that says to send the whole conversation in `input`.
"""
from __future__ import annotations

import copy
import json
import logging
import time
import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from llmserve_client.errors import LLMServeError
from llmserve_client.http import schemas
from llmserve_client.http.identity import Requester
from llmserve_client.http.schemas import TEXT_ONLY, ApiError
from llmserve_client.http.streams import ClientGone, exhaust, merge, until_disconnect

log = logging.getLogger("llmserve_client.http")

NO_STATE = "this server keeps no conversation state (store is ignored): send the whole conversation in `input`"


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields that act (and those refused unless neutral); request_fields.IGNORED["responses"] the rest."""
    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None          # echoed in the response
    user: str | None = None                         # whom the request is for (the chat request's user)
    background: bool | None = None
    conversation: Any = None
    previous_response_id: str | None = None
    prompt: Any = None
    moderation: Any = None
    # vLLM's sampling and structured-output extensions act here as on chat completions (checked there).
    seed: Any = None
    stop: Any = None
    logit_bias: Any = None
    top_k: Any = None
    min_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    chat_template_kwargs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


EXTENSIONS = ("seed", "stop", "logit_bias", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "min_tokens", "ignore_eos", "chat_template_kwargs", "guided_json", "guided_regex",
              "guided_choice", "guided_grammar", "structured_outputs")


def _refuse_state(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise ApiError(f"previous_response_id cannot be used: {NO_STATE}", "previous_response_id")
    if req.conversation is not None:
        raise ApiError(f"conversation cannot be used: {NO_STATE}", "conversation")
    if req.background:
        raise ApiError(f"background responses are not served: {NO_STATE}; stream instead", "background")
    if req.prompt is not None:
        raise ApiError("stored prompts are not served: send the prompt's text in `instructions` and `input`", "prompt")
    if req.input is None:
        raise ApiError("input is required", "input")


def to_chat(req: ResponsesRequest) -> dict:
    """The chat request (as JSON-like data for schemas.ChatRequest) that serves this responses request."""
    _refuse_state(req)
    chat: dict = {"model": req.model, "messages": _messages(req), "stream": bool(req.stream),
                  "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
                  "parallel_tool_calls": req.parallel_tool_calls, "user": req.user}
    if req.tools:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(req.tool_choice)
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    chat.update({k: getattr(req, k) for k in EXTENSIONS})
    if req.max_tool_calls is not None and req.max_tool_calls < 1:
        raise ApiError(f"max_tool_calls must be at least 1, got {req.max_tool_calls}", "max_tool_calls")
    return {k: v for k, v in chat.items() if v is not None}


def _text(content, where: str) -> str:
    """The text of a message's content: a string or text parts (input_text, output_text, refusal)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError("content must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "reasoning_text") and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio", "image_url"):
            raise ApiError(f"{TEXT_ONLY}: a content part of type {kind!r} cannot be used", f"{where}[{j}]")
        else:
            raise ApiError(f"content part of type {kind!r} is not supported (text only)", f"{where}[{j}]")
    return "".join(out)


def _messages(req: ResponsesRequest) -> list[dict]:
    msgs: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    reasoning = None          # a reasoning item's text, for the assistant turn it belongs to
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError("input items must be objects", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(f"role {role!r} is not supported; expected user, assistant, system or developer",
                               f"{where}.role")
            msg = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            msgs.append(msg)
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise ApiError("a function_call item needs a call_id and a name (strings)", where)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": item.get("arguments") or "{}"}}
            last = msgs[-1] if msgs else None
            if last is not None and last["role"] == "assistant" and items[i - 1].get("type", "message") in \
                    ("message", "function_call"):
                last.setdefault("tool_calls", []).append(call)       # the same assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    msgs[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError("a function_call_output item needs a call_id (a string)", where)
            msgs.append({"role": "tool", "tool_call_id": item["call_id"],
                         "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, f"{where}.content")
        elif kind == "item_reference":
            raise ApiError(f"item references cannot be used: {NO_STATE}", where)
        else:
            raise ApiError(f"input item of type {kind!r} is not supported", f"{where}.type")
    return msgs


def _tool(t, i: int) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise ApiError(f"tool type {kind!r} is not supported (function tools only)", f"tools[{i}].type")
    if not isinstance(t.get("name"), str):
        raise ApiError("a function tool needs a name", f"tools[{i}].name")
    return {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                             if t.get(k) is not None}}


def _tool_choice(choice):
    if isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if kind == "allowed_tools":
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": choice.get("tools")}}
    raise ApiError(f"tool_choice of type {kind!r} is not supported (none, auto, required, a function or "
                   f"allowed_tools)", "tool_choice")


def _format(fmt) -> dict:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError("text.format json_schema needs a `schema` object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"]}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ApiError(f"text.format.type must be text, json_schema or json_object, got {kind!r}", "text.format.type")


class ResponseBuilder:
    """Output items from the chat shaper's deltas, and the typed events that build them."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest):
        self.rid, self.model, self.req = rid, model, req
        self.created = int(time.time())
        self.items: list[dict] = []
        self.open: dict | None = None        # the item taking deltas now
        self.seq = 0

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        snapshot = self.response("in_progress")
        return [self.event("response.created", response=snapshot), self.event("response.in_progress", response=snapshot)]

    def feed(self, delta: dict) -> list[dict]:
        out = []
        if delta.get("reasoning_content"):
            out += self._text_delta("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text_delta("message", delta["content"])
        for d in delta.get("tool_calls") or []:
            if "id" in d:
                out += self._close()
                item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": d["id"],
                        "name": d["function"]["name"], "arguments": "", "status": "in_progress"}
                out += self._add(item)
            if d["function"]["arguments"] and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += d["function"]["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, delta=d["function"]["arguments"]))
        return out

    def finish(self, finish_reason: str | None, usage: dict) -> tuple[dict, list[dict]]:
        """(the final response, the events that end the stream)."""
        incomplete = finish_reason == "length"
        out = self._close("incomplete" if incomplete else "completed")
        final = self.response("incomplete" if incomplete else "completed", usage)
        out.append(self.event("response.incomplete" if incomplete else "response.completed", response=final))
        return final, out

    def failed(self, message: str, code: str) -> list[dict]:
        self.open = None
        final = self.response("failed")
        final["error"] = {"code": code, "message": message}
        return [self.event("error", code=code, message=message, param=None), self.event("response.failed", response=final)]

    def response(self, status: str, usage: dict | None = None) -> dict:
        req = self.req
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": copy.deepcopy(self.items) if status != "in_progress" else [],
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": False, "temperature": req.temperature, "top_p": req.top_p,
            "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto",
            "tools": [{"type": "function", "name": t.get("name"), "description": t.get("description"),
                       "parameters": t.get("parameters"), "strict": t.get("strict")} for t in req.tools or []],
            "truncation": "disabled", "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        }

    # ---- items -------------------------------------------------------------------------------------------
    def _text_delta(self, kind: str, text: str) -> list[dict]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            if kind == "reasoning":
                item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                        "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            else:
                item = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant",
                        "status": "in_progress", "content": [{"type": "output_text", "text": "", "annotations": [],
                                                              "logprobs": []}]}
            out += self._add(item)
        part = self.open["content"][0]
        part["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self.event(name, item_id=self.open["id"], output_index=len(self.items) - 1, content_index=0,
                              delta=text, **extra))
        return out

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        out = [self.event("response.output_item.added", output_index=index, item=copy.deepcopy(item))]
        if item["type"] != "function_call":
            part = {**item["content"][0], "text": ""}
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        return out

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = self.items.index(item)
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"]))
            else:
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=copy.deepcopy(part)))
        out.append(self.event("response.output_item.done", output_index=index, item=copy.deepcopy(item)))
        return out


# The chat request's names for what this request calls otherwise, for errors the chat pipeline raises.
CHAT_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
              "reasoning_effort": "reasoning.effort"}


def _renamed(e: ApiError) -> ApiError:
    """An error of the chat pipeline, naming the field as this request spells it."""
    head = (e.param or "").split(".", 1)[0].split("[", 1)[0]
    if head not in CHAT_NAMES:
        return e
    name = CHAT_NAMES[head]
    param = "input" if head == "messages" else name + e.param[len(head):]
    return ApiError(e.message.replace(head, name), param, status=e.status, type=e.type, code=e.code)


def _usage(c) -> dict:
    u = c.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def serve(fe, request: Request) -> Response:
    """The endpoint, for Frontend `fe`."""
    try:
        req, ignored = fe.decode(request, await request.body(), ResponsesRequest, "responses")
        try:
            chat = msgspec.convert(to_chat(req), schemas.ChatRequest)
        except msgspec.ValidationError as e:     # e.g. a vLLM extension of the wrong type
            raise ApiError(f"invalid request: {e}", schemas.param_of(str(e))) from None
        except RecursionError:
            raise ApiError("the request nests JSON too deeply") from None
        try:
            streams, ctx = await fe._start(chat, True, ignored, endpoint="responses", max_calls=req.max_tool_calls,
                                           requester=Requester(request.scope, fe.api_key))
        except ApiError as e:
            raise _renamed(e) from None
    except ApiError as e:
        return fe._error(e)
    builder = ResponseBuilder("resp_" + uuid.uuid4().hex, ctx.model, req)
    shaper, merged = ctx.shapers[0], merge(streams)
    try:
        if not req.stream:
            await until_disconnect(request, exhaust(merged))
            [c] = ctx.completions(streams)
            fe.metrics.on_finished(c)
            msg, finish = shaper.message(c.text, c.finish_reason)
            builder.feed({**msg, "tool_calls": [{"index": i, **call} for i, call in enumerate(msg.get("tool_calls") or [])]})
            return JSONResponse(builder.finish(finish, _usage(c))[0], headers=ctx.headers)
        first = await until_disconnect(request, anext(merged, None))
    except ClientGone:
        for c in ctx.completions(streams):
            fe.metrics.on_finished(c)
        return Response(status_code=499)
    except LLMServeError as e:
        return fe._error(_renamed(fe._api_error(e, True, ctx.guided_source, ctx.error_names(e))))
    return StreamingResponse(_events(fe, ctx, streams, merged, first, builder, shaper), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **ctx.headers})


async def _events(fe, ctx, streams, merged, first, builder: ResponseBuilder, shaper):
    accounted = False
    try:
        for e in builder.start():
            yield _sse(e)
        item, finish = first, None
        while item is not None:
            chunk = item[1]
            final = chunk.finish_reason is not None
            for e in builder.feed(shaper.delta(chunk.text, final)):
                yield _sse(e)
            if final:
                finish = shaper.finish_reason(chunk.finish_reason)
            item = await anext(merged, None)
        [c] = ctx.completions(streams)
        fe.metrics.on_finished(c)
        accounted = True
        for e in builder.finish(finish, _usage(c))[1]:
            yield _sse(e)
    except LLMServeError as e:
        err = fe._api_error(e, True, ctx.guided_source, ctx.error_names(e))
        fe.metrics.on_error(err.status)
        accounted = True
        for ev in builder.failed(err.message, err.code or err.type):
            yield _sse(ev)
    except Exception:
        log.exception("responses stream failed")        # the stream still ends as a stream
        fe.metrics.on_error(500)
        accounted = True
        for ev in builder.failed("internal error", "server_error"):
            yield _sse(ev)
    finally:
        await merged.aclose()
        if not accounted:
            for c in ctx.completions(streams):
                fe.metrics.on_finished(c)
