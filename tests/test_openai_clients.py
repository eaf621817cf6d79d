"""The OpenAI API as real clients use it, end to end: the official `openai` SDK and LangChain's `ChatOpenAI`
against llmserve-serve with no tool flag, in front of one real core on a random-weight tiny Qwen3
(tests/helpers/chat_model.py). Fields OpenAI defines are accepted (ignored ones named in a header), tools
work without --tool-call-parser (the format is read from the chat template: two more frontends on the same
core use the Qwen3-Coder and the 2507 Thinking templates), /v1/responses serves the SDK's create and
stream, a cut-off tool call answers the same streamed and whole, and a fresh server's first structured
request costs no more than a plain one. A random model calls no tool by itself: a grammar (tool_choice
required, or guided_regex) writes the calls.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

sys.path.insert(0, os.path.dirname(__file__))
from helpers.chat_model import QWEN3_CODER_TEMPLATE, QWEN3_THINKING_2507_TEMPLATE, make_qwen3_chat_model  # noqa: E402
from helpers.daemon import ENV  # noqa: E402
from helpers.http import sdk, start_serve, stop, wait_healthy  # noqa: E402

CORE = ["--device", "cpu", "--max-model-len", "2048", "--num-kv-blocks", "512", "--block-size", "16",
        "--log-interval", "0"]
NAME = "qwen3"
USER = [{"role": "user", "content": "What is the weather like?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "ok"],
          "properties": {"answer": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}}
# What a Qwen3 model writes for one call (the grammar makes the random model write it).
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": 2\}\}\n</tool_call>'
IDLE_CPU_SHARE = 0.05        # of one core, per process, over a couple of seconds
FIRST_STRUCTURED_SLACK_S = 1.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    stat = open(f"/proc/{pid}/stat").read()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_chat(base: str, **body) -> float:
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/chat/completions", json={"messages": USER, "max_tokens": 8, **NO_THINK, **body},
                   timeout=300)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(core, frontend, base URL, model dir, first-request timings, idle CPU shares) of a fresh core and a
    frontend started with no tool flag. The timings and the idle CPU are measured here, first thing."""
    tmp = tmp_path_factory.mktemp("clients")
    model = make_qwen3_chat_model(tmp / "model")
    endpoint = f"ipc://{tmp}/core.sock"
    core = subprocess.Popen([sys.executable, "-m", "llmserve_core", "--model", model, "--listen", endpoint, *CORE],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=open(tmp / "core.log", "wb"))
    serve, base = start_serve(str(tmp / "serve.log"), "--endpoint", endpoint, "--served-model-name", NAME)
    try:
        wait_healthy(serve, base, str(tmp / "serve.log"), timeout=300)
        plain = timed_chat(base, ignore_eos=True)
        structured = timed_chat(base, response_format={"type": "json_schema",
                                                       "json_schema": {"name": "s", "schema": SCHEMA}})
        plain_again = timed_chat(base, ignore_eos=True)
        time.sleep(0.5)                    # let the last request's stragglers (heartbeats, logs) settle
        before = {p.pid: cpu_seconds(p.pid) for p in (core, serve)}
        t0 = time.monotonic()
        time.sleep(2.0)
        idle = {p.pid: (cpu_seconds(p.pid) - before[p.pid]) / (time.monotonic() - t0) for p in (core, serve)}
        yield {"core": core, "serve": serve, "base": base, "endpoint": endpoint, "model": model, "tmp": tmp,
               "timings": (plain, structured, plain_again), "idle": idle}
    finally:
        stop(serve)
        stop(core)


@pytest.fixture(scope="module")
def client(stack):
    return sdk(stack["base"]).with_options(timeout=300)


def frontend(stack, name: str, template: str, *flags: str):
    """Another frontend on the same core, whose tokenizer has `template` (the same vocabulary)."""
    tok_dir = make_qwen3_chat_model(stack["tmp"] / name, template=template)
    proc, base = start_serve(str(stack["tmp"] / f"{name}.log"), "--endpoint", stack["endpoint"], "--tokenizer",
                             tok_dir, "--served-model-name", NAME, *flags)
    wait_healthy(proc, base, str(stack["tmp"] / f"{name}.log"), timeout=300)
    return proc, base


@pytest.fixture(scope="module")
def coder(stack):
    proc, base = frontend(stack, "coder", QWEN3_CODER_TEMPLATE)
    yield sdk(base).with_options(timeout=300)
    stop(proc)


@pytest.fixture(scope="module")
def thinking(stack):
    proc, base = frontend(stack, "thinking", QWEN3_THINKING_2507_TEMPLATE, "--reasoning-parser", "qwen3")
    yield sdk(base).with_options(timeout=300)
    stop(proc)


# ---- no stall, no spin -------------------------------------------------------------------------------------
def test_first_structured_request_on_a_fresh_server_costs_what_a_plain_one_does(stack):
    """Target: within 1 s of a plain request; the factor 2 is slack for a busy machine (where the grammar
    compiler built on the first request, beside a spinning step loop, took 2-25 s)."""
    plain, structured, plain_again = stack["timings"]
    assert structured < 2 * max(plain, plain_again) + FIRST_STRUCTURED_SLACK_S, stack["timings"]


def test_an_idle_server_uses_no_cpu(stack):
    assert all(share < IDLE_CPU_SHARE for share in stack["idle"].values()), stack["idle"]


# ---- fields ------------------------------------------------------------------------------------------------
def test_fields_openai_defines_are_accepted_and_the_ignored_ones_named(client):
    raw = client.chat.completions.with_raw_response.create(
        model=NAME, messages=USER, max_tokens=3, metadata={"k": "v"}, store=True, service_tier="auto",
        safety_identifier="u1", prompt_cache_key="p", verbosity="low", user="u", extra_body={"my_extension": 1})
    assert raw.parse().choices[0].message.content is not None
    assert raw.headers["llmserve-ignored-fields"] == \
        "metadata, my_extension, prompt_cache_key, safety_identifier, service_tier, store, verbosity"   # user acts
    raw = client.completions.with_raw_response.create(model=NAME, prompt="hi", max_tokens=2)
    assert "llmserve-ignored-fields" not in raw.headers
    raw = client.responses.with_raw_response.create(model=NAME, input="hi", max_output_tokens=3, store=True,
                                                    truncation="auto", include=["message.output_text.logprobs"])
    assert raw.headers["llmserve-ignored-fields"] == "include, store, truncation"


def test_reasoning_effort_none_turns_qwen3_thinking_off(client, stack):
    """LangChain's reasoning_effort: "none" renders the prompt as enable_thinking false does."""
    off = client.chat.completions.create(model=NAME, messages=USER, max_tokens=1, reasoning_effort="none")
    explicit = client.chat.completions.create(model=NAME, messages=USER, max_tokens=1, extra_body=NO_THINK)
    on = client.chat.completions.create(model=NAME, messages=USER, max_tokens=1, reasoning_effort="high")
    assert off.usage.prompt_tokens == explicit.usage.prompt_tokens > on.usage.prompt_tokens


@pytest.mark.parametrize("kw, param, words", [
    (dict(audio={"voice": "alloy", "format": "wav"}, modalities=["text", "audio"]), "audio", "text only"),
    (dict(modalities=["audio"]), "modalities", "text only"),
    (dict(functions=[{"name": "f", "parameters": {}}]), "functions", "use `tools`"),
    (dict(extra_body={"moderation": {"model": "omni-moderation-latest"}}), "moderation", "no moderation"),
    (dict(n=17), "n", "[1, 16]"),
    (dict(reasoning_effort="extreme"), "reasoning_effort", "must be one of"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
     "messages[0].content[0]", "this model takes text only"),
    (dict(tools=[{"type": "custom", "custom": {"name": "grep"}}]), "tools[0].type", "function tools only"),
])
def test_fields_whose_honouring_matters_are_refused_by_name(client, kw, param, words):
    kw = {"model": NAME, "messages": USER, "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**kw)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize("headers", [{"Content-Type": "text/plain"}, {}])
def test_a_body_that_does_not_say_it_is_json_is_refused_as_vllm_does(stack, headers):
    body = json.dumps({"model": NAME, "messages": USER, "max_tokens": 2}).encode()
    r = httpx.post(stack["base"] + "/v1/chat/completions", content=body, headers=headers, timeout=60)
    assert r.status_code == 400 and "Only 'application/json' is allowed" in r.json()["error"]["message"]


# ---- tools without a flag ----------------------------------------------------------------------------------
def test_required_named_and_auto_tools_work_with_no_tool_flag(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=80,
                                           temperature=0, extra_body=NO_THINK)
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city", "days"}
    # auto: the template is Qwen3's, so the model's <tool_call> JSON is read as hermes.
    r = client.chat.completions.create(model=NAME, messages=USER, tools=TOOLS, max_tokens=80,
                                       extra_body={"guided_regex": HERMES_CALL, **NO_THINK})
    [call] = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


def streamed_message(client, **kw) -> tuple[str, list[dict], str]:
    """(content, folded tool calls, finish reason) of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                call["name"] = call["name"] or d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("max_tokens", [3, 9, 14])
def test_a_cut_off_tool_call_answers_the_same_streamed_and_whole(client, max_tokens):
    """max_tokens ends a forced call early: before its name is complete (no call), or inside its
    arguments (a call whose arguments are what was written); streamed and whole agree, finish "length"."""
    kw = dict(model=NAME, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, temperature=0,
              extra_body=NO_THINK)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    whole = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]
    content, calls, finish = streamed_message(client, **kw)
    assert r.choices[0].finish_reason == finish == "length"
    assert (content or None, calls) == (msg.content, whole)
    assert msg.content is None or "<tool_call>" not in msg.content
    if whole:
        assert whole[0]["name"] == "get_weather"


# ---- LangChain -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model(stack):
    lc = pytest.importorskip("langchain_openai")
    return lambda **kw: lc.ChatOpenAI(**{"base_url": stack["base"] + "/v1", "api_key": "unused", "model": NAME,
                                         "max_retries": 0, "timeout": 300, "temperature": 0, "max_tokens": 120, **kw})


def test_langchain_with_structured_output(chat_model):
    from pydantic import BaseModel
    from typing import Literal

    class Answer(BaseModel):
        answer: Literal["red", "green", "blue"]
        ok: bool

    for method in ("json_schema", "function_calling"):
        llm = chat_model(extra_body=NO_THINK).with_structured_output(Answer, method=method)
        out = llm.invoke("Pick a colour.")
        assert isinstance(out, Answer), method


def test_langchain_bind_tools_auto_any_and_named(chat_model):
    from typing import Literal

    from pydantic import BaseModel, Field

    class get_weather(BaseModel):          # noqa: N801 - a tool's name, as the model sees it
        """Weather in a city for some days."""
        city: Literal["Paris", "Oslo", "Lima"]
        days: int = Field(ge=1, le=7)

    for choice in ("any", "get_weather"):
        msg = chat_model(extra_body=NO_THINK).bind_tools([get_weather], tool_choice=choice).invoke("Weather?")
        [call] = msg.tool_calls
        assert call["name"] == "get_weather" and set(call["args"]) == {"city", "days"}, choice
    forced = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo", "days": 2\}\}\n</tool_call>'
    msg = chat_model(extra_body={"guided_regex": forced, **NO_THINK}).bind_tools([get_weather], tool_choice="auto") \
        .invoke("Weather?")
    assert msg.tool_calls[0]["args"] == {"city": "Oslo", "days": 2}
    plain = chat_model(extra_body=NO_THINK, max_tokens=4).bind_tools([get_weather]).invoke("Hello")
    assert plain.tool_calls == [] and isinstance(plain.content, str)


def test_langchain_reasoning_effort_and_the_responses_api(chat_model):
    assert isinstance(chat_model(reasoning_effort="none", max_tokens=4).invoke("Hi").content, str)
    msg = chat_model(use_responses_api=True, max_tokens=4).invoke("Hi")
    assert msg.content


# ---- /v1/responses ---------------------------------------------------------------------------------------
def test_responses_create_and_stream_text(client):
    kw = dict(model=NAME, input="Say something.", instructions="Be brief.", max_output_tokens=6, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].type == "message" and r.output_text and r.usage.output_tokens == 6
    ends = {**kw, "max_output_tokens": 60, "extra_body": {"guided_regex": "[a-z ]{3,20}"}}    # ends by itself
    with client.responses.stream(**ends) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and final.status == "completed"
    again = client.responses.create(**ends)
    assert again.output_text == final.output_text


def test_responses_tools_and_function_call_history(client):
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    kw = dict(model=NAME, input="Weather in Oslo?", tools=tools, tool_choice="required", max_output_tokens=80,
              temperature=0, reasoning={"effort": "none"})
    r = client.responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    args = json.loads(call.arguments)
    with client.responses.stream(**kw) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
        final = s.get_final_response()
    assert json.loads(deltas) == args and final.output[0].arguments == call.arguments
    # The call and its result go back as input items; the named choice forces the call again.
    follow = client.responses.create(model=NAME, tools=tools, max_output_tokens=40, temperature=0,
                                     tool_choice={"type": "function", "name": "get_weather"},
                                     reasoning={"effort": "none"},
                                     input=[{"role": "user", "content": "Weather in Oslo?"},
                                            {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                             "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "rain"}])
    assert follow.output[0].type == "function_call" and follow.usage.input_tokens > r.usage.input_tokens


def test_responses_json_schema_text_format(client):
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    r = client.responses.create(model=NAME, input="Pick one.", text=fmt, max_output_tokens=60, temperature=1.0,
                                reasoning={"effort": "minimal"})
    assert set(json.loads(r.output_text)) == {"answer", "ok"}


@pytest.mark.parametrize("kw, param", [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(conversation="conv_1"), "conversation"),
    (dict(background=True), "background"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0]"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]),
     "input[0].content[0]"),
    (dict(tools=[{"type": "web_search"}]), "tools[0].type"),
    (dict(max_output_tokens=0), "max_output_tokens"),              # errors of the chat pipeline, renamed
    (dict(reasoning={"effort": "extreme"}), "reasoning.effort"),
    (dict(text={"format": {"type": "yaml"}}), "text.format.type"),
])
def test_responses_refusals_name_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": NAME, "input": "hi", "max_output_tokens": 2, **kw})
    assert e.value.body["param"] == param, e.value.body


# ---- the model's own tool format and thinking, from its template -----------------------------------------
CODER_CALL = (r"<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n"
              r"<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_template_gets_the_qwen3_coder_parser(coder):
    kw = dict(model=NAME, messages=USER, tools=TOOLS, max_tokens=120, extra_body={"guided_regex": CODER_CALL})
    r = coder.chat.completions.create(**kw)
    [call] = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Lima", "days": 4}        # days typed by its schema
    content, calls, finish = streamed_message(coder, **kw)
    assert (content, finish) == ("", "tool_calls") and calls == [{"name": "get_weather",
                                                                  "arguments": call.function.arguments}]


def test_thinking_2507_template_splits_reasoning_whole_streamed_and_in_responses(thinking, stack):
    from transformers import AutoTokenizer
    [end] = AutoTokenizer.from_pretrained(stack["model"]).encode("</think>", add_special_tokens=False)
    kw = dict(model=NAME, messages=USER, max_tokens=60, temperature=1.0, seed=3, logit_bias={str(end): 8.0},
              extra_body={"guided_regex": "[a-z ]{3,20}"})
    msg = thinking.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning_content and "</think>" not in msg.reasoning_content and msg.content
    reasoning, content = "", ""
    for chunk in thinking.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (msg.reasoning_content, msg.content)
    r = thinking.responses.create(model=NAME, input="What is the weather like?", max_output_tokens=60,
                                  temperature=1.0, extra_body={"seed": 3, "logit_bias": {str(end): 8.0},
                                                               "guided_regex": "[a-z ]{3,20}"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == msg.reasoning_content and r.output_text == msg.content
