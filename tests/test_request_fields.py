"""The request field table against the installed `openai` SDK's own request types: every field the SDK can
send is accepted (acts or is ignored), so a new SDK field shows up here before a client gets a 400; and
the lenient decoding, the ignored-field header and log, and the reasoning-effort switch on their own."""
from __future__ import annotations

import logging
import typing

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")         # the responses endpoint's module answers through starlette

from llmserve_client.http import schemas  # noqa: E402
from llmserve_client.http.request_fields import IGNORED, IgnoredFieldLog, check_content_type, decode, \
    header_value, thinking_switch  # noqa: E402
from llmserve_client.http.responses import ResponsesRequest  # noqa: E402
from llmserve_client.http.schemas import ApiError  # noqa: E402


def typed_dict_keys(*types) -> set[str]:
    keys = set()
    for t in types:
        keys |= set(typing.get_type_hints(t))
    return keys


def union_members(alias) -> list:
    return [a for a in typing.get_args(alias) if isinstance(a, type)]


@pytest.mark.parametrize("endpoint, module, struct", [
    ("chat", "openai.types.chat.completion_create_params", schemas.ChatRequest),
    ("completions", "openai.types.completion_create_params", schemas.CompletionRequest),
    ("responses", "openai.types.responses.response_create_params", ResponsesRequest),
])
def test_every_field_the_sdk_can_send_is_accepted(endpoint, module, struct):
    import importlib
    m = importlib.import_module(module)
    prefix = "Response" if endpoint == "responses" else "Completion"
    sent = typed_dict_keys(getattr(m, f"{prefix}CreateParamsStreaming"), getattr(m, f"{prefix}CreateParamsNonStreaming"))
    accepted = set(struct.__struct_fields__) | IGNORED[endpoint]
    assert sent - accepted == set(), f"fields the SDK sends that {endpoint} neither serves nor ignores"
    assert not IGNORED[endpoint] & set(struct.__struct_fields__)      # a field acts or is ignored, not both
    assert IGNORED[endpoint] <= sent                                  # the table names only OpenAI's fields


def test_every_embeddings_field_the_sdk_can_send_is_accepted():
    from openai.types.embedding_create_params import EmbeddingCreateParams
    from llmserve_client.http.pooling import EmbeddingRequest
    sent = typed_dict_keys(EmbeddingCreateParams)
    accepted = set(EmbeddingRequest.__struct_fields__) | IGNORED["embeddings"]
    assert sent - accepted == set()
    assert not IGNORED["embeddings"] & set(EmbeddingRequest.__struct_fields__)
    assert IGNORED["embeddings"] <= sent


def test_every_nested_chat_field_the_sdk_can_send_is_declared():
    """Nested objects stay strict, so they must declare every field the SDK's types have."""
    from openai.types.chat import (ChatCompletionContentPartParam, ChatCompletionContentPartRefusalParam,
                                   ChatCompletionMessageParam, ChatCompletionMessageToolCallUnionParam,
                                   ChatCompletionStreamOptionsParam, ChatCompletionToolUnionParam)
    from openai.types.shared_params import FunctionDefinition
    pairs = [(union_members(ChatCompletionMessageParam), schemas.Message),
             (union_members(ChatCompletionContentPartParam) + [ChatCompletionContentPartRefusalParam],
              schemas.ContentPart),
             (union_members(ChatCompletionMessageToolCallUnionParam), schemas.ToolCall),
             (union_members(ChatCompletionToolUnionParam), schemas.Tool),
             ([FunctionDefinition], schemas.FunctionDef),
             ([ChatCompletionStreamOptionsParam], schemas.StreamOptions)]
    for sdk_types, struct in pairs:
        assert sdk_types
        missing = typed_dict_keys(*sdk_types) - set(struct.__struct_fields__)
        assert not missing, (struct.__name__, missing)


def test_unknown_fields_are_ignored_and_named_unless_strict():
    body = b'{"messages": [{"role": "user", "content": "hi"}], "store": true, "metadata": null, "my_extension": 1}'
    req, ignored = decode(body, schemas.ChatRequest, "chat", strict=False)
    assert req.messages[0].content == "hi" and ignored == ["store", "my_extension"]    # null is "not set"
    with pytest.raises(ApiError) as e:
        decode(body, schemas.ChatRequest, "chat", strict=True)
    assert e.value.param == "my_extension" and "--strict-requests" in e.value.message
    assert decode(body.replace(b', "my_extension": 1', b""), schemas.ChatRequest, "chat", strict=True)[1] == ["store"]
    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for bad, why in ((b"[1]", "JSON object"), (b"{nope", "not valid JSON"), (b'{"messages": 5}', "messages"),
                     (deep, "too deeply")):
        with pytest.raises(ApiError) as e:
            decode(bad, schemas.ChatRequest, "chat", strict=False)
        assert why in e.value.message or e.value.param == why
    with pytest.raises(ApiError) as e:      # nested objects stay strict
        decode(b'{"messages": [{"role": "user", "content": "hi", "colour": 1}]}', schemas.ChatRequest, "chat", False)
    assert e.value.param == "messages[0].colour"


def test_header_value_names_only_printable_names_and_caps_them():
    assert header_value(["store", "metadata"]) == "metadata, store"
    assert header_value(["x\r\nSet-Cookie: a=b", "ok"]) == "<unusual name>, ok"
    assert header_value([f"f{i:02}" for i in range(40)]).endswith("f15, and 24 more")


def test_ignored_field_log_is_rate_limited(caplog):
    now = [0.0]
    limiter = IgnoredFieldLog(clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="llmserve_client.http"):
        for _ in range(5):
            limiter.note("chat", ["store"])
        limiter.note("chat", ["metadata"])         # another set of fields: its own line
        limiter.note("chat", [])                   # nothing ignored: nothing said
        now[0] = 61.0
        limiter.note("chat", ["store"])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "store" in lines[0] and "metadata" in lines[1]
    assert "in 4 more request(s)" in lines[2]


@pytest.mark.parametrize("content_type, ok", [("application/json", True), ("application/json; charset=utf-8", True),
                                              ("Application/JSON", True), ("text/plain", False), (None, False),
                                              ("", False), ("application/x-www-form-urlencoded", False)])
def test_content_type_rule_matches_vllm(content_type, ok):
    if ok:
        check_content_type(content_type)
    else:
        with pytest.raises(ApiError, match="Only 'application/json' is allowed"):
            check_content_type(content_type)


def test_reasoning_effort_maps_onto_the_thinking_switch():
    assert thinking_switch(None, None, True, "reasoning_effort") == (None, False)
    assert thinking_switch("none", None, True, "reasoning_effort") == ({"enable_thinking": False}, False)
    assert thinking_switch("minimal", {"x": 1}, True, "p") == ({"x": 1, "enable_thinking": False}, False)
    assert thinking_switch("high", {"x": 1}, True, "p") == ({"x": 1}, False)           # thinking stays on
    assert thinking_switch("none", None, False, "p") == (None, True)                    # no switch: ignored
    assert thinking_switch("none", {"enable_thinking": False}, True, "p") == ({"enable_thinking": False}, False)
    for effort, kwargs in (("extreme", None), ("none", {"enable_thinking": True})):
        with pytest.raises(ApiError) as e:
            thinking_switch(effort, kwargs, True, "reasoning.effort")
        assert e.value.param == "reasoning.effort"
