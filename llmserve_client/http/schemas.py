"""OpenAI request bodies as msgspec Structs, and their translation into the protocol's SamplingParams.

A wrong type or a value out of range becomes an ApiError naming the field, which the app turns into OpenAI's
400 shape. A request's top level may hold fields these Structs do not declare: request_fields.py decides
which of those are ignored (and says so) and which are refused. Fields that OpenAI defines but whose
honouring matters (best_of > 1, suffix, audio output, ...) are accepted only at their neutral values, so a
client never silently gets something other than what it asked for. Nested objects (messages, tools) stay
strict, and declare every field of the official SDK's types.
"""
from __future__ import annotations

import re
from typing import Any

import msgspec



class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool = False   # vLLM's: with include_usage, every chunk carries its choice's usage
    include_obfuscation: bool | None = None   # OpenAI pads its stream events against side channels: nothing to do here

    def __post_init__(self):
        self.include_usage = bool(self.include_usage)


class _Request(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints. top_k, min_p, stop_token_ids, ignore_eos and skip_special_tokens
    are vLLM's extensions, with vLLM's meaning."""
    model: str | None = None
    user: str | None = None        # whom the request is for, where no API key says (identity.py: fair shares)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1              # OpenAI's schema lets n, stream, echo and chat's logprobs be null: the default
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool = False
    # Structured outputs: OpenAI's response_format (chat) and vLLM's guided_* (both endpoints).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None   # vLLM's newer spelling of the guided_* options
    prompt_logprobs: int | None = None     # vLLM's: answered as the choice's (chat: the response's) prompt_logprobs

    def __post_init__(self):
        self.n = 1 if self.n is None else self.n
        self.stream = bool(self.stream)


class CompletionRequest(_Request):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def __post_init__(self):
        super().__post_init__()
        self.echo = bool(self.echo)


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    refusal: str | None = None                      # an assistant turn's refusal part: its text
    # Parts this text-only model refuses by their type (chat_messages); declared so the refusal says why.
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    prompt_cache_breakpoint: Any = None             # a caching hint: nothing to do here


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    function: FunctionCall | None = None
    id: str | None = None
    type: str = "function"
    custom: Any = None                              # a custom tool's call: refused by chat_messages


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None        # an assistant turn that called tools
    tool_call_id: str | None = None                 # a tool turn: the call it answers
    reasoning_content: str | None = None            # an assistant turn's thinking, as this server returned it
    # The rest of OpenAI's assistant message, which its SDK writes back (model_dump()) as null when unused:
    # accepted at that neutral value only, since the templates have no place for it. annotations describe
    # the content (citations) and ask for nothing, so any is accepted and left out.
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    annotations: list[Any] | None = None


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: FunctionDef | None = None
    custom: Any = None                              # a custom (free-text) tool: refused by tools.tool_setup


class ChatRequest(_Request):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None             # onto the template's thinking switch (request_fields.py)
    # OpenAI fields honoured only at their neutral values (request_fields.check_neutral).
    audio: Any = None
    modalities: list[str] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    moderation: Any = None

    def __post_init__(self):
        super().__post_init__()
        self.logprobs = bool(self.logprobs)


def decode(body: bytes, kind: type[_Request]) -> _Request:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(f"invalid request: {e}", param_of(str(e))) from None
    except msgspec.DecodeError as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError("the request body nests JSON too deeply") from None


def param_of(message: str) -> str | None:
    """msgspec says "... - at `$.messages[0].content`" or "unknown field `foo`" / "missing required field `x`"."""
    m = re.search(r"field `([^`]+)`", message)
    at = re.search(r"at `\$\.?([^`]*)`", message)
    path = at.group(1) if at else ""
    if m and ("unknown field" in message or "missing required field" in message):
        return f"{path}.{m.group(1)}" if path else m.group(1)
    return path or None


MAX_N = 16      # choices per request (n)
SEED_SPAN = 2**63   # the core's seeds are [0, 2^63); OpenAI's and vLLM's are any int64, so [-2^63, 2^63)


def _check_request(req: _Request) -> None:
    if not 1 <= req.n <= MAX_N:
        raise ApiError(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise ApiError("stream_options is only allowed when stream is true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise ApiError("prompt_logprobs are not available when stream is true (vLLM's rule)", "prompt_logprobs")


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI sends token ids as JSON object keys (strings): ASCII digits only, since int() would also take
    "5_0" as 50, " 5" and other scripts' digits."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


def sampling_fields(req: _Request) -> dict:
    """The SamplingParams fields both endpoints map the same way (max_tokens is decided by the caller)."""
    _check_request(req)
    out: dict = {"ignore_eos": req.ignore_eos, "include_stop_str_in_output": req.include_stop_str_in_output}
    for name in ("temperature", "top_p", "top_k", "min_p", "stop_token_ids", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_tokens"):
        value = getattr(req, name)
        if value is not None:
            out[name] = value
    if req.logit_bias:
        out["logit_bias"] = _logit_bias(req.logit_bias)
    if req.stop is not None:
        out["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.prompt_logprobs is not None:
        out["prompt_logprobs"] = req.prompt_logprobs
    if req.seed is not None:
        if not -SEED_SPAN <= req.seed < SEED_SPAN:
            raise ApiError(f"seed must be a 64-bit signed integer, got {req.seed}", "seed")
        out["seed"] = req.seed % SEED_SPAN    # a negative seed folds onto the core's range, still its own stream
    return out


def completion_sampling(req: CompletionRequest) -> dict:
    out = sampling_fields(req)
    if req.best_of not in (None, 1):
        raise ApiError(f"only best_of=1 is supported, got {req.best_of}", "best_of")
    if req.best_of is not None and req.best_of < req.n:     # OpenAI's rule: best_of candidates hold the n returned
        raise ApiError(f"best_of must be at least n ({req.n}), got {req.best_of}", "best_of")
    if req.suffix:
        # OpenAI's suffix asks for an insertion (fill-in-the-middle); Qwen3's templates have no such mode.
        raise ApiError("suffix needs a fill-in-the-middle model; Qwen3 has none", "suffix")
    if req.response_format is not None:
        raise ApiError("response_format belongs to chat completions; use guided_json here", "response_format")
    if req.logprobs is not None:
        out["logprobs"] = req.logprobs
        if req.echo:     # the echoed prompt's tokens get theirs too (OpenAI's legacy scoring, vLLM)
            out.setdefault("prompt_logprobs", req.logprobs)
    return out


def chat_sampling(req: ChatRequest) -> dict:
    out = sampling_fields(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.logprobs:
        out["logprobs"] = req.top_logprobs or 0
    return out


MAX_PROMPTS = 64   # prompts in one batched /v1/completions request


def prompt_param(index: int, count: int) -> str:
    """How an error names prompt `index` of a completion with `count` prompts."""
    return "prompt" if count == 1 else f"prompt[{index}]"


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, a list of token ids, or a batch (list) of either."""
    p = req.prompt
    batch = p if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p) else [p]
    if len(batch) > MAX_PROMPTS:
        raise ApiError(f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}", "prompt")
    for i, one in enumerate(batch):
        where = prompt_param(i, len(batch))
        if isinstance(one, str):
            if not one:
                raise ApiError(f"{where} must not be empty", where)
        elif not (isinstance(one, list) and one and all(isinstance(t, int) and not isinstance(t, bool) for t in one)):
            raise ApiError(f"{where} must be a non-empty string or a non-empty list of token ids", where)
    return batch


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(req: ChatRequest) -> list[dict]:
    """Messages as plain dicts for the chat template; text content parts are joined."""
    if not req.messages:
        raise ApiError("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise ApiError(f"role {m.role!r} is not supported; expected one of {', '.join(CHAT_ROLES)}",
                           f"messages[{i}].role")
        for name in ("refusal", "audio", "function_call"):
            if getattr(m, name) is not None:
                raise ApiError(f"{name} is not supported in messages (only null)", f"messages[{i}].{name}")
        if isinstance(m.content, list):
            content = "".join(_part_text(part, f"messages[{i}].content[{j}]") for j, part in enumerate(m.content))
        else:
            content = m.content or ""
        # Qwen's templates know system, user, assistant and tool; OpenAI's developer role means system.
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise ApiError("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            # Arguments arrive as JSON text; Qwen3's template writes a string as is and a mapping as JSON.
            for j, c in enumerate(m.tool_calls):
                if c.type != "function" or c.function is None:
                    raise ApiError(f"tool call of type {c.type!r} is not supported (function calls only)",
                                   f"messages[{i}].tool_calls[{j}]")
            msg["tool_calls"] = [{"id": c.id, "type": c.type,
                                  "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


TEXT_ONLY = "this model takes text only"


def _part_text(part: ContentPart, where: str) -> str:
    """A content part's text; a part of another kind (an image, audio, a file) is refused."""
    if part.type == "text" and part.text is not None:
        return part.text
    if part.type == "refusal" and part.refusal is not None:
        return part.refusal
    if part.type in ("image_url", "input_audio", "file", "input_image", "input_file"):
        raise ApiError(f"{TEXT_ONLY}: a content part of type {part.type!r} cannot be used", where)
    raise ApiError(f"content part of type {part.type!r} is not supported (text only)", where)


def _arguments(args: str | dict) -> dict | str:
    """Parsed arguments where they are JSON (templates render a mapping), else the text as given."""
    if isinstance(args, dict):
        return args
    try:
        value = msgspec.json.decode(args)
    except (msgspec.DecodeError, RecursionError):    # text nested past the parser's depth is still text
        return args
    return value if isinstance(value, dict) else args


def param_name(field: str, chat: bool) -> str:
    """A SamplingParams / protocol field name as the OpenAI request spells it."""
    field = field.removeprefix("params.")
    if field == "logprobs" and chat:
        return "top_logprobs"
    if field == "prompt_token_ids":
        return "messages" if chat else "prompt"
    return field

