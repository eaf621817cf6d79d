"""Qwen3 over the OpenAI API, end to end: llmserve-serve with --reasoning-parser qwen3 and
--tool-call-parser hermes in front of a real llmserve-core, driven by the official `openai` package, on
a random-weight tiny Qwen3 whose tokenizer and chat template (tests/helpers/chat_model.py) behave like
Qwen3's. A random model never thinks or calls tools by itself, so outputs are shaped with the grammar
engine (guided_regex, tool_choice required): that also shows the grammars hold. With the reasoning parser
on, a grammar holds only after the model's `</think>` unless the template closed the thinking
(`enable_thinking: false`, NO_THINK); a logit_bias makes the random model write `</think>`."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

pytest.importorskip("httpx")         # the HTTP frontend's; absent on the GPU machine
pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from helpers.chat_model import make_qwen3_chat_model  # noqa: E402
from helpers.daemon import ENV  # noqa: E402
from helpers.http import sdk, start_serve, stop, wait_healthy  # noqa: E402

from llmserve_client import Client  # noqa: E402

MAX_MODEL_LEN = 2048
CORE = ["--device", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "640", "--block-size", "16",
        "--log-interval", "0"]
TOOLS = [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
         {"type": "function", "function": {
            "name": "add", "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                                          "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
USER = [{"role": "user", "content": "What is the weather like?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}    # the grammar holds from the first token


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oai")
    model = make_qwen3_chat_model(tmp / "model")
    endpoint = f"ipc://{tmp}/core.sock"
    import subprocess
    core = subprocess.Popen([sys.executable, "-m", "llmserve_core", "--model", model, "--listen", endpoint, *CORE],
                            env=ENV, stdout=subprocess.DEVNULL, stderr=open(tmp / "core.log", "wb"))
    proc, base = start_serve(str(tmp / "serve.log"), "--endpoint", endpoint, "--served-model-name", "qwen3",
                             "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes")
    try:
        wait_healthy(proc, base, str(tmp / "serve.log"), timeout=120)
        yield base, endpoint, model
    finally:
        stop(proc)
        stop(core)


@pytest.fixture(scope="module")
def client(server):
    # Only a guard against a hang: the grammar-constrained requests here run to ~1,000 tokens x n on the
    # CPU, which on a busy machine takes longer than sdk()'s 30 s.
    return sdk(server[0]).with_options(timeout=300)


def chat(client, stream=False, **kw):
    kw.setdefault("model", "qwen3")
    kw.setdefault("messages", USER)
    return client.chat.completions.create(stream=stream, **kw)


def streamed(client, **kw):
    """(reasoning, content, tool call deltas, finish reason) of a streamed chat completion."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in chat(client, stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            calls += d.tool_calls or []
            finish = c.finish_reason or finish
    return reasoning, content, calls, finish


# ---- thinking -------------------------------------------------------------------------------------------
ANSWER = r"[a-z ]{3,30}"


@pytest.fixture(scope="module")
def think_end(server) -> int:
    """`</think>`'s token id: a logit_bias on it makes the random model end its thinking soon."""
    from transformers import AutoTokenizer
    [tid] = AutoTokenizer.from_pretrained(server[2]).encode("</think>", add_special_tokens=False)
    return tid


@pytest.mark.parametrize("template_kwargs, bias, has_reasoning", [
    ({"open_think": True}, 7.0, True),          # the template opened the block, the model closes it
    ({"open_think": True}, -100.0, True),       # never closed: all reasoning, the grammar never holds
    ({"enable_thinking": False}, 0.0, False),   # the template closed an empty block: the grammar holds at once
])
def test_reasoning_split_whole_and_streamed(client, think_end, template_kwargs, bias, has_reasoning):
    extra = {"guided_regex": ANSWER, "seed": 5, "chat_template_kwargs": template_kwargs}
    kw = dict(max_tokens=60, temperature=1.0, logit_bias={str(think_end): bias}, extra_body=extra)
    r = chat(client, **kw)
    msg = r.choices[0].message
    reasoning, content = getattr(msg, "reasoning_content", None), msg.content
    if has_reasoning:
        assert reasoning and "</think>" not in reasoning, reasoning
    else:
        assert reasoning is None
    if bias < 0:
        assert content is None and r.choices[0].finish_reason == "length"
    else:
        assert content and re.fullmatch(ANSWER, content), content
        assert r.choices[0].finish_reason == "stop"
    s_reasoning, s_content, _, finish = streamed(client, **kw)
    assert (s_reasoning or None, s_content or None) == (reasoning, content)
    assert finish == r.choices[0].finish_reason


# ---- tool calls -----------------------------------------------------------------------------------------
def check_call(name: str, args: dict) -> None:
    if name == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7
    else:
        assert name == "add" and set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_always_calls_and_streams_like_openai(client, seed):
    r = chat(client, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=1.0, seed=seed,
             extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    args = json.loads(call.function.arguments)
    check_call(call.function.name, args)
    _, content, deltas, finish = streamed(client, tools=TOOLS, tool_choice="required", max_tokens=300,
                                          temperature=1.0, seed=seed, extra_body=NO_THINK)
    assert finish == "tool_calls" and content == ""
    head, *fragments = deltas
    assert head.index == 0 and head.id and head.type == "function" and head.function.name == call.function.name
    assert fragments and all(f.id is None and f.function.name is None for f in fragments)
    assert json.loads("".join(f.function.arguments for f in fragments)) == args


def test_named_tool_choice_calls_that_tool(client):
    for seed in range(2):
        r = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                 max_tokens=300, temperature=1.0, seed=seed, extra_body=NO_THINK)
        [call] = r.choices[0].message.tool_calls
        assert call.function.name == "add"
        check_call("add", json.loads(call.function.arguments))


TWO_CALLS = (r'<tool_call>\n\{"name": "add", "arguments": \{"a": 1, "b": 2\}\}\n</tool_call>\n'
             r'<tool_call>\n\{"name": "add", "arguments": \{"a": 3, "b": 4\}\}\n</tool_call>')


def test_parallel_tool_calls_false_returns_one_call(client):
    """The model wrote two calls (a regex makes it): parallel_tool_calls=false gets the first only, whole and
    streamed, as from vLLM; the default gets both."""
    kw = dict(tools=TOOLS, max_tokens=200, extra_body={"guided_regex": TWO_CALLS, **NO_THINK})
    assert len(chat(client, **kw).choices[0].message.tool_calls) == 2
    r = chat(client, parallel_tool_calls=False, **kw)
    [call] = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2} and r.choices[0].finish_reason == "tool_calls"
    _, _, calls, finish = streamed(client, parallel_tool_calls=False, **kw)
    assert {c.index for c in calls} == {0} and finish == "tool_calls"
    assert json.loads("".join(c.function.arguments for c in calls)) == {"a": 1, "b": 2}


def test_tool_history_is_rendered_by_the_template(client, server):
    """An assistant turn with tool_calls and the tool's answer reach the template: the prompt the core got
    is exactly the template's rendering (its token count), and the model may continue from it."""
    from transformers import AutoTokenizer
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"}]
    r = chat(client, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    tok = AutoTokenizer.from_pretrained(server[2])
    text = tok.apply_chat_template(
        [history[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": {"city": "Oslo", "days": 2}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"}],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\nrain, 4 C\n</tool_response>" in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    # Arguments that are not JSON go to the template as text, even when they nest past any parser's depth.
    history[1]["tool_calls"][0]["function"]["arguments"] = "[" * 1500
    assert chat(client, messages=history, tools=TOOLS, max_tokens=2).usage.prompt_tokens > r.usage.prompt_tokens


def test_tool_errors_are_400s(client, server):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    for function in ("get_weather", ["get_weather"], None):     # not the {"name": ...} object
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, tools=TOOLS, tool_choice={"type": "function", "function": function})
        assert e.value.body["param"] == "tool_choice"


# ---- structured outputs ---------------------------------------------------------------------------------
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "score", "ok"],
          "properties": {"answer": {"enum": ["red", "green", "blue"]},
                         "score": {"type": "integer", "minimum": -5, "maximum": 5},
                         "ok": {"type": "boolean"}}}


def check_schema(obj) -> None:
    assert set(obj) == {"answer", "score", "ok"} and obj["answer"] in ("red", "green", "blue")
    assert isinstance(obj["score"], int) and -5 <= obj["score"] <= 5 and isinstance(obj["ok"], bool)


def test_every_structured_output_form_parses_and_validates(client, server):
    base = dict(temperature=1.0, seed=11, n=3, extra_body=NO_THINK)
    forms = {
        "json_schema": dict(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}),
        "guided_json": dict(extra_body={**base["extra_body"], "guided_json": SCHEMA}),
        "guided_regex": dict(extra_body={**base["extra_body"], "guided_regex": r"\d{3}-[A-Z]{2}"}),
        "guided_choice": dict(extra_body={**base["extra_body"], "guided_choice": ["left", "right"]}),
        "guided_grammar": dict(extra_body={**base["extra_body"],
                                           "guided_grammar": 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c]'}),
        # Any JSON object: unbounded, so a random model needs room (it finished in ~500-950 tokens here).
        "json_object": dict(response_format={"type": "json_object"}, max_tokens=1800, n=4),
    }
    for name, kw in forms.items():
        r = chat(client, **{"max_tokens": 200, **base, **kw})
        assert len(r.choices) == kw.get("n", 3)
        for c in r.choices:
            text = c.message.content
            assert c.finish_reason == "stop", (name, text)
            if name in ("json_schema", "guided_json"):
                check_schema(json.loads(text))
            elif name == "json_object":
                assert isinstance(json.loads(text), dict)
            elif name == "guided_regex":
                assert re.fullmatch(r"\d{3}-[A-Z]{2}", text)
            elif name == "guided_choice":
                assert text in ("left", "right")
            else:
                assert re.fullmatch(r"\[[a-c](,[a-c])*\]", text)
    # /v1/completions takes the guided_* options too.
    r = client.completions.create(model="qwen3", prompt="Colour:", max_tokens=50, temperature=1.0, seed=1,
                                  extra_body={"guided_json": SCHEMA})
    check_schema(json.loads(r.choices[0].text))


def test_structured_outputs_hold_after_the_thinking(client, think_end):
    """A template that opened <think> (the model thinks): a JSON schema, a choice and a forced tool call hold
    only after the model's </think>, so reasoning_content is its free thinking and content (or tool_calls)
    the answer the grammar made, whole and streamed alike."""
    kw = dict(max_tokens=200, temperature=1.0, seed=1, logit_bias={str(think_end): 7.0},
              extra_body={"chat_template_kwargs": {"open_think": True}})
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}
    r = chat(client, **schema, **kw)
    msg = r.choices[0].message
    assert msg.reasoning_content and "</think>" not in msg.reasoning_content and r.choices[0].finish_reason == "stop"
    check_schema(json.loads(msg.content))
    assert streamed(client, **schema, **kw)[:2] == (msg.reasoning_content, msg.content)
    choice = {**kw, "extra_body": {**kw["extra_body"], "guided_choice": ["yes", "no"]}}
    msg = chat(client, **choice).choices[0].message
    assert msg.reasoning_content and msg.content in ("yes", "no")
    r = chat(client, tools=TOOLS, tool_choice="required", **{**kw, "max_tokens": 300})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.reasoning_content
    [call] = r.choices[0].message.tool_calls
    check_call(call.function.name, json.loads(call.function.arguments))
    reasoning, content, calls, finish = streamed(client, tools=TOOLS, tool_choice="required", **{**kw, "max_tokens": 300})
    assert finish == "tool_calls" and calls and (reasoning, content) == (r.choices[0].message.reasoning_content, "")


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": {"type": 5}}, "guided_json"),
    ({"guided_json": "[" * 5000}, "guided_json"),            # JSON text nested past any parser's depth
    ({"guided_grammar": "root ::= nothing_defined"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_invalid_structured_output_is_a_400_naming_the_param(server, extra, param):
    r = httpx.post(server[0] + "/v1/chat/completions", json={"model": "qwen3", "messages": USER, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_unsatisfiable_grammar_ends_with_length(client):
    r = chat(client, max_tokens=6, temperature=1.0, extra_body={"guided_regex": "z{60}", **NO_THINK})
    assert r.choices[0].finish_reason == "length" and set(r.choices[0].message.content) == {"z"}


# ---- sampling parameters ----------------------------------------------------------------------------------
def test_logit_bias_penalties_and_min_tokens_reach_the_sampler(client, server):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(server[2])
    forced = tok.encode(" the")[0]
    r = client.completions.create(model="qwen3", prompt="x", max_tokens=5, temperature=1.0, seed=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == tok.decode([forced] * 5)
    # A forced token repeated is what frequency_penalty exists to stop: with it the repetition breaks.
    r = client.completions.create(model="qwen3", prompt="x", max_tokens=5, temperature=0, frequency_penalty=2.0,
                                  logit_bias={str(forced): 3})
    assert r.choices[0].text != tok.decode([forced] * 5)
    # EOS pushed to the top, held back by min_tokens.
    r = client.completions.create(model="qwen3", prompt="x", max_tokens=20, temperature=0,
                                  logit_bias={"2": 100}, extra_body={"min_tokens": 4, "skip_special_tokens": False})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "stop"


def test_stop_string_kept_with_include_stop_str_in_output(client):
    kw = dict(model="qwen3", prompt="x", max_tokens=30, temperature=1.0, seed=3,
              extra_body={"guided_regex": "ab;cd;ef"})
    assert client.completions.create(stop=[";"], **kw).choices[0].text == "ab"
    kw["extra_body"] = {**kw["extra_body"], "include_stop_str_in_output": True}
    assert client.completions.create(stop=[";"], **kw).choices[0].text == "ab;"


def test_echo_returns_prompt_then_completion(client):
    r = client.completions.create(model="qwen3", prompt="Echo me", max_tokens=3, temperature=0, echo=True)
    plain = client.completions.create(model="qwen3", prompt="Echo me", max_tokens=3, temperature=0)
    assert r.choices[0].text == "Echo me" + plain.choices[0].text
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="qwen3", prompt="Echo me", max_tokens=3, temperature=0, echo=True, stream=True))
    assert text == r.choices[0].text


def test_n_choices_share_the_prompts_kv_blocks(client, server):
    prompt = "A long shared prompt: " + "the quick brown fox jumps over the lazy dog " * 6
    with Client(server[1]) as c:
        before = c.stats()["prefix_hits"]
        r = client.completions.create(model="qwen3", prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3)
        after = c.stats()["prefix_hits"]
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert len({ch.text for ch in r.choices}) > 1                      # seed + i per choice
    n_prompt = r.usage.prompt_tokens
    assert after - before >= 2 * ((n_prompt - 1) // 16) * 16           # both copies hit every full block
    again = client.completions.create(model="qwen3", prompt=prompt, max_tokens=8, temperature=1.0, seed=8)
    assert again.choices[0].text == r.choices[1].text                  # choice 1 was seeded with 7 + 1
