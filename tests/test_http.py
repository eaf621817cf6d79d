"""End to end: llmserve-serve (the OpenAI-compatible HTTP frontend) in front of the real llmserve-core, both
as subprocesses on the CPU tiny model, driven by the official `openai` package (and httpx where the SDK
cannot express the request). One shared core and server serve most tests; the tests that kill a core or
let the frontend own one start their own.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time

import pytest

pytest.importorskip("httpx")         # the HTTP frontend's; absent on the GPU machine
pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402
import openai  # noqa: E402

from helpers.daemon import ENV  # noqa: E402
from helpers.http import CORE_ARGS, MAX_MODEL_LEN, children, sdk, start_core, start_serve, stop, wait_healthy  # noqa: E402
from llmserve_client import Client  # noqa: E402

NAME = "tiny-qwen3"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a Python keyword."}]


@pytest.fixture(scope="module")
def core_and_server(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("http")
    endpoint, core_log, serve_log = f"ipc://{d}/core.sock", str(d / "core.log"), str(d / "serve.log")
    core = start_core(tiny_model_dir, endpoint, core_log)
    serve, base = start_serve(serve_log, "--endpoint", endpoint, "--served-model-name", NAME)
    try:
        wait_healthy(serve, base, serve_log)
        with Client(endpoint, connect_timeout=180) as c:
            yield (endpoint, c), base
    finally:
        assert stop(serve) == 0, open(serve_log).read()[-3000:]
        assert stop(core) == 0, open(core_log).read()[-3000:]


@pytest.fixture(scope="module")
def core(core_and_server):
    """(endpoint, a Client of the shared core) for references and stats."""
    return core_and_server[0]


@pytest.fixture(scope="module")
def server(core_and_server):
    """Base URL of the llmserve-serve in front of the shared core."""
    return core_and_server[1]


@pytest.fixture(scope="module")
def oai(server):
    return sdk(server)


def wait_idle(client: Client, timeout: float = 60.0) -> dict:
    """The core's stats once nothing runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while True:
        s = client.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["used_kv_blocks"] == 0:
            return s
        assert time.monotonic() < deadline, f"core not idle: {s}"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ happy paths

def test_models(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [NAME]
    assert oai.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("other")


def test_completion_matches_client_library(oai, core):
    prompt = "def add(a, b):"
    r = oai.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    ref = core[1].generate(prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_stream_equals_non_stream(oai):
    kw = dict(model=NAME, prompt="Return the value of", max_tokens=20, temperature=0)
    full = oai.completions.create(**kw)
    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage there is no usage chunk.
    plain = list(oai.completions.create(**kw, stream=True))
    assert plain[-1].choices[0].finish_reason == "length" and plain[-1].usage is None


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_give_each_chunk_its_choices_running_usage(oai, chat):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage is its choice's prompt and the tokens
    it has generated so far; the last chunk still has the totals."""
    kw = dict(model=NAME, max_tokens=6, n=2, temperature=1.0, seed=1, stream=True, extra_body={"ignore_eos": True},
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    if chat:
        chunks = list(oai.chat.completions.create(messages=CHAT, **kw))
    else:
        chunks = list(oai.completions.create(prompt=["def add(a, b):", "import"], **kw))
    total = chunks[-1].usage
    seen: dict[int, list] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        seen.setdefault(choice.index, []).append((c.usage.prompt_tokens, c.usage.completion_tokens))
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert sorted(seen) == ([0, 1] if chat else [0, 1, 2, 3])
    for runs in seen.values():
        counts = [done for _, done in runs]
        assert counts == sorted(counts) and counts[-1] == 6 and len({p for p, _ in runs}) == 1
    prompts = {seen[i][0][0] for i in seen}
    assert total.prompt_tokens == sum(prompts) and total.completion_tokens == 6 * len(seen)


def test_chat_matches_client_library_streaming_and_not(oai, core):
    ref = core[1].generate(CHAT, max_tokens=16, temperature=0)
    r = oai.chat.completions.create(model=NAME, messages=CHAT, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 16
    chunks = list(oai.chat.completions.create(model=NAME, messages=CHAT, max_completion_tokens=16, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == len(ref.prompt_token_ids) + 16


def test_sdk_message_dumped_back_into_the_history(oai, core):
    """messages.append(r.choices[0].message.model_dump()) writes every field of the SDK's message, null
    where unused (refusal, annotations, audio, function_call): the next turn must take it."""
    r = oai.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4, temperature=0)
    history = [*CHAT, r.choices[0].message.model_dump(), {"role": "user", "content": "Another one."}]
    assert {"refusal", "annotations", "audio", "function_call"} <= set(history[2])
    ref = core[1].generate([*CHAT, {"role": "assistant", "content": r.choices[0].message.content},
                            {"role": "user", "content": "Another one."}], max_tokens=4, temperature=0)
    again = oai.chat.completions.create(model=NAME, messages=history, max_tokens=4, temperature=0)
    assert again.choices[0].message.content == ref.text
    # What a template cannot carry is refused, not dropped.
    for field, value in [("refusal", "I can't."), ("function_call", {"name": "f", "arguments": "{}"})]:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=NAME, messages=[*CHAT, {"role": "assistant", field: value}])
        assert e.value.response.json()["error"]["param"] == f"messages[2].{field}"


def test_seed_reproducible(oai):
    kw = dict(model=NAME, prompt="The quick brown fox", max_tokens=16, temperature=1.0)
    a = oai.completions.create(**kw, seed=7).choices[0].text
    b = oai.completions.create(**kw, seed=7).choices[0].text
    c = oai.completions.create(**kw, seed=8).choices[0].text
    assert a == b and a != c
    chat = [oai.chat.completions.create(model=NAME, messages=CHAT, max_tokens=16, temperature=0.8, top_p=0.9,
                                        seed=3).choices[0].message.content for _ in range(2)]
    assert chat[0] == chat[1]


def test_negative_seed_is_a_seed(oai):
    """OpenAI's and vLLM's seed is any int64: a negative one reproduces like any other."""
    kw = dict(model=NAME, prompt="The quick brown fox", max_tokens=16, temperature=1.0)
    a, b = (oai.completions.create(**kw, seed=-5).choices[0].text for _ in range(2))
    assert a == b and a != oai.completions.create(**kw, seed=5).choices[0].text
    assert len(oai.completions.create(**kw, seed=-2**63, n=2).choices) == 2
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(**kw, seed=2**63)
    assert e.value.response.json()["error"]["param"] == "seed"


def _stop_string(text: str) -> tuple[str, int]:
    """A 3-character piece of `text`, not at its start, found first where it is taken from."""
    for i in range(2, len(text) - 3):
        s = text[i:i + 3]
        if "\ufffd" not in s and s.strip() and text.find(s) == i:
            return s, i
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_trims_and_ends(oai, core, stream):
    kw = dict(model=NAME, prompt="class Stack:", max_tokens=40, temperature=1.0, seed=11)
    text = oai.completions.create(**kw).choices[0].text
    stop, at = _stop_string(text)
    if stream:
        chunks = list(oai.completions.create(**kw, stop=[stop, "\x00never"], stream=True))
        got = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = oai.completions.create(**kw, stop=stop)
        got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert r.usage.completion_tokens < 40
    assert got == text[:at] and reason == "stop"
    wait_idle(core[1])     # the request the stop string ended was aborted in the core


def test_logprobs(oai):
    r = oai.chat.completions.create(model=NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)    # greedy picks the best
        assert item.token == item.top_logprobs[0].token
    # Characters split across tokens: each token's text is U+FFFD, its bytes are its own, and the bytes of
    # the tokens (but the end-of-sequence token that ends the grammar) make up the text, as OpenAI's
    # `bytes` are meant to.
    text = "h\u00e9llo \U0001F600 \u4e2d\u6587"
    r = oai.chat.completions.create(model=NAME, messages=CHAT, max_tokens=40, temperature=0, logprobs=True,
                                    extra_body={"guided_regex": text})
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == "stop"
    assert any(item.token == "\ufffd" for item in content)
    assert b"".join(bytes(item.bytes) for item in content[:-1]).decode() == text
    c = oai.completions.create(model=NAME, prompt="while True:", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(len(d) <= 2 for d in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == c.choices[0].text or "\ufffd" in "".join(lp.tokens)


def test_echo_with_logprobs_scores_the_prompt(oai, server, core):
    """lm-evaluation-harness's loglikelihood call: echo the prompt with its tokens' logprobs leading the
    completion's, the first prompt token's null (OpenAI's legacy completions, vLLM)."""
    prompt = "The quick brown fox jumps"
    ids = core[1].tokenizer.encode(prompt)
    ref = core[1].generate(ids, max_tokens=3, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    assert ref.prompt_logprobs[0] is None and len(ref.prompt_logprobs) == len(ids)
    kw = dict(model=NAME, prompt=prompt, temperature=0, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    c = oai.completions.create(max_tokens=3, **kw)
    choice, lp = c.choices[0], c.choices[0].logprobs
    assert choice.text == prompt + ref.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [x.logprob for x in ref.prompt_logprobs[1:] + ref.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(len(d) == 2 for d in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[:len(ids)]) == prompt and lp.text_offset[len(ids)] == len(prompt)
    # Streamed, the prompt's come with the first chunk.
    chunks = list(oai.completions.create(max_tokens=3, stream=True, **kw))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(want, abs=1e-4)
    # max_tokens 0: the prompt alone, scored.
    for z in (oai.completions.create(max_tokens=0, **kw),
              *[ch for ch in oai.completions.create(max_tokens=0, stream=True, **kw) if ch.choices]):
        zc = z.choices[0]
        assert zc.text == prompt and zc.finish_reason == "length"
        assert zc.logprobs.token_logprobs[1:] == pytest.approx(want[:len(ids) - 1], abs=1e-4)
    assert oai.completions.create(max_tokens=0, **kw).usage.completion_tokens == 0
    # vLLM's prompt_logprobs field: per prompt token None or {token id: {logprob, decoded_token}}.
    r = httpx.post(server + "/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1}, timeout=30)
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i, entry in enumerate(got[1:], start=1):
        assert entry[str(ids[i])]["logprob"] == pytest.approx(want[i - 1], abs=1e-4) and 1 <= len(entry) <= 2
    r = httpx.post(server + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0},
                   timeout=30)
    assert r.status_code == 200 and r.json()["prompt_logprobs"][0] is None


def test_token_id_prompt_and_raw_http(server, core):
    ids = core[1].tokenizer.encode("for i in range(10):")
    r = httpx.post(server + "/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == NAME and body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["text"] == core[1].generate(ids, max_tokens=4, temperature=0).text
    # SSE framing as curl sees it: one JSON per data line, ending with [DONE].
    with httpx.stream("POST", server + "/v1/chat/completions", timeout=30,
                      json={"messages": CHAT, "max_tokens": 3, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[len("data: "):])["object"] == "chat.completion.chunk" for e in events[:-1])


def test_null_means_the_default_where_openai_allows_null(server):
    """OpenAI's schema makes n, stream, logprobs and echo nullable; clients generated from it send null for
    what they leave unset."""
    nulls = {"n": None, "stream": None, "logprobs": None, "max_tokens": 2, "temperature": 0}
    for path, body in [("/v1/chat/completions", {"messages": CHAT, **nulls, "top_logprobs": None}),
                       ("/v1/completions", {"prompt": "def f(x):", **nulls, "echo": None})]:
        r = httpx.post(server + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]                      # n: 1
        assert choice["logprobs"] is None and not choice.get("text", "").startswith("def f(x):")   # no echo


def test_concurrent_streams_each_get_their_own_tokens(server, core):
    prompts = ["def add(a, b):", "Return the value of", "The quick brown fox", "class Stack:", "while True:",
               "for i in range(10):", "print('hello')", "import os"]
    refs = [core[1].generate(p, max_tokens=10, temperature=0).text for p in prompts]

    async def one(client, prompt):
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(main()) == refs
    wait_idle(core[1])


def test_batched_prompts(oai, core):
    prompts = ["def add(a, b):", core[1].tokenizer.encode("while True:"), "class Stack:"]
    refs = [core[1].generate(p, max_tokens=8, temperature=0) for p in prompts]
    r = oai.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [ref.text for ref in refs]
    assert all(len(c.logprobs.tokens) == 8 for c in r.choices)
    assert r.usage.prompt_tokens == sum(len(ref.prompt_token_ids) for ref in refs) and r.usage.completion_tokens == 24
    texts, finished = ["", "", ""], set()
    for chunk in oai.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0, stream=True):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.finish_reason:
            finished.add(choice.index)
    assert texts == [ref.text for ref in refs] and finished == {0, 1, 2}
    wait_idle(core[1])


# ------------------------------------------------------------------------------------------ bad input

BAD_CHAT = [
    (dict(temperature=-1), "temperature", None),
    (dict(extra_body={"temperature": "hot"}), "temperature", None),
    (dict(top_p=0), "top_p", None),
    (dict(n=0), "n", None),
    (dict(n=17), "n", None),
    (dict(max_tokens=0), "max_tokens", None),
    (dict(max_tokens=MAX_MODEL_LEN), "max_tokens", "context_length_exceeded"),
    (dict(max_completion_tokens=MAX_MODEL_LEN), "max_completion_tokens", "context_length_exceeded"),
    (dict(top_logprobs=3), "top_logprobs", None),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs", None),
    (dict(presence_penalty=2.5), "presence_penalty", None),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty", None),
    (dict(logit_bias={"5": 101}), "logit_bias", None),
    (dict(logit_bias={"x": 1}), "logit_bias", None),
    (dict(logit_bias={"5_0": 1}), "logit_bias", None),
    (dict(logit_bias={" 5": 1}), "logit_bias", None),
    (dict(logit_bias={"\u0665": 1}), "logit_bias", None),        # ARABIC-INDIC DIGIT FIVE
    (dict(logit_bias={"-1": 1}), "logit_bias", None),
    (dict(stop=[""]), "stop", None),
    (dict(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), "messages[0].tool_calls", None),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role", None),
    (dict(messages=[]), "messages", None),
    (dict(messages=[{"role": "user", "content": "hi " * 1000}]), "messages", "context_length_exceeded"),
]


@pytest.mark.parametrize("kw,param,code", BAD_CHAT, ids=[p for _, p, _ in BAD_CHAT])
def test_bad_chat_requests_get_openai_400s(oai, kw, param, code):
    args = {"model": NAME, "messages": CHAT, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**args)
    err = e.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    # The message names the field too: the openai package's exception shows only the message.
    assert param.rsplit(".", 1)[-1].split("[")[0] in err["message"], err
    if code == "context_length_exceeded":
        assert str(MAX_MODEL_LEN) in err["message"]


def test_bad_completion_requests(oai, server):
    cases = [
        (dict(prompt="hi", logprobs=21), "logprobs"),
        (dict(prompt=[99999]), "prompt"),                       # outside the vocabulary: the core says so
        (dict(prompt=""), "prompt"),
        (dict(prompt=["a", ""]), "prompt[1]"),
        (dict(prompt="word " * 1000), "prompt"),
        # Several prompts: the error names the one at fault, whether the server or the core finds it.
        (dict(prompt=["hi", "word " * 1000]), "prompt[1]"),
        (dict(prompt=[[5, 6], [7, 99999]]), "prompt[1]"),
        (dict(prompt=["hi", "there"], max_tokens=MAX_MODEL_LEN), "max_tokens"),
        (dict(prompt="hi", extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
        (dict(prompt="hi", extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
        (dict(prompt="hi", stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
        (dict(prompt="hi", suffix="!"), "suffix"),
        (dict(prompt="hi", best_of=3), "best_of"),
        (dict(prompt="hi", best_of=1, n=2), "best_of"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=NAME, **kw)
        assert e.value.response.json()["error"]["param"] == param, kw
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt="hi")
    assert e.value.response.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json={"max_tokens": 3}, timeout=10)   # no prompt
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert httpx.get(server + "/v1/nothing-here", timeout=10).status_code == 404
    r = httpx.get(server + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------ disconnects

def test_stream_disconnect_aborts_in_core(server, core):
    before = core[1].stats()["requests_aborted_by_client"]
    # Two prompts in one request: both engine requests must go when the HTTP client does.
    body = {"prompt": ["import os\nimport sys\n", "def f(x):"], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") for line in got)
    stats = wait_idle(core[1])
    # Both aborted, not run to their 400 tokens (a count, not a time: a busy machine steps slowly either way)
    assert stats["requests_aborted_by_client"] == before + 2


def test_non_stream_disconnect_aborts_in_core(server, core):
    before = core[1].stats()["requests_aborted_by_client"]
    # Only the read times out (0.2 s for 500 tokens: no CPU step is that fast), never the connect or the send,
    # so the request always reaches the core and is still running when the client goes.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", timeout=httpx.Timeout(30.0, read=0.2),
                   json={"prompt": "print('hello')", "max_tokens": 500, "ignore_eos": True})
    stats = wait_idle(core[1])
    assert stats["requests_aborted_by_client"] == before + 1


# ------------------------------------------------------------------------------------------ health, metrics

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:[a-zA-Z_]+="(?:[^"\\]|\\.)*",?)*)\})? (\S+)$')


def parse_prometheus(text: str) -> tuple[dict, list[tuple[str, dict, float]]]:
    types, samples = {}, []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, f"not a Prometheus sample line: {line!r}"
            labels = dict(re.findall(r'([a-zA-Z_]+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            samples.append((m.group(1), labels, float(m.group(3))))
    return types, samples


def scrape(base: str) -> tuple[dict, list[tuple[str, dict, float]], dict]:
    r = httpx.get(base + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    types, samples = parse_prometheus(r.text)
    return types, samples, {(n, tuple(sorted(l.items()))): v for n, l, v in samples}


def test_health_and_metrics(server, oai):
    assert httpx.get(server + "/health", timeout=10).status_code == 200

    def get(values, name, **labels):
        return values.get((name, tuple(sorted({"model_name": NAME, **labels}.items()))), 0.0)

    _, _, before = scrape(server)
    oai.completions.create(model=NAME, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=NAME, prompt="hi", n=0)
    with httpx.stream("POST", server + "/v1/completions", timeout=30,
                      json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}) as resp:
        next(resp.iter_lines())
    deadline = time.monotonic() + 60
    while True:     # the frontend accounts the abandoned stream once it notices the disconnect
        types, samples, after = scrape(server)
        if get(after, "llmserve_requests_total", finish_reason="abort") > get(before, "llmserve_requests_total",
                                                                              finish_reason="abort"):
            break
        assert time.monotonic() < deadline, "the abandoned stream was never counted"
        time.sleep(0.05)
    for name, labels, _ in samples:
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, name
        assert labels.get("model_name") == NAME
    delta = lambda name, **labels: get(after, name, **labels) - get(before, name, **labels)
    assert types["llmserve_requests_total"] == "counter"
    assert delta("llmserve_requests_total", finish_reason="length") == 1
    assert delta("llmserve_requests_total", finish_reason="abort") == 1
    assert delta("llmserve_request_errors_total", status="400") == 1
    assert delta("llmserve_generation_tokens_total") >= 3 and delta("llmserve_prompt_tokens_total") >= 2
    for h in ("llmserve_time_to_first_token_seconds", "llmserve_e2e_request_latency_seconds"):
        assert types[h] == "histogram"
        buckets = [v for n, l, v in samples if n == h + "_bucket"]
        assert buckets == sorted(buckets) and buckets[-1] == get(after, h + "_count")
    assert delta("llmserve_time_to_first_token_seconds_count") == 2       # the aborted stream had a first token
    assert delta("llmserve_e2e_request_latency_seconds_count") == 1
    assert get(after, "llmserve_core_up") == 1 and 0 <= get(after, "llmserve_kv_cache_usage_ratio") <= 1
    assert 0 <= get(after, "llmserve_prefix_cache_hit_rate") <= 1
    assert types["llmserve_num_requests_running"] == types["llmserve_num_requests_waiting"] == "gauge"


def test_core_killed_gives_503(tiny_model_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/core.sock"
    # A long stream: on a busy machine the frontend can pass the first chunk on late, and a short
    # stream would have ended by the time the kill lands.
    core = start_core(tiny_model_dir, endpoint, str(tmp_path / "core.log"), "--max-model-len", "2048")
    try:
        proc, base = start_serve(str(tmp_path / "serve.log"), "--endpoint", endpoint)
        try:
            wait_healthy(proc, base, str(tmp_path / "serve.log"))
            model = sdk(base).models.list().data[0].id
            assert model == os.path.basename(tiny_model_dir)
            stream = sdk(base).completions.create(model=model, prompt="hi", max_tokens=2000, stream=True,
                                                  extra_body={"ignore_eos": True})
            core.kill()
            core.wait()
            with pytest.raises(openai.APIError, match="engine is unavailable"):   # an SSE error event
                for _ in stream:
                    pass
            deadline = time.monotonic() + 60
            while httpx.get(base + "/health", timeout=30).status_code != 503:
                assert time.monotonic() < deadline, "/health still 200 after the core died"
                time.sleep(0.1)
            with pytest.raises(openai.InternalServerError) as e:
                sdk(base).completions.create(model=model, prompt="hi", max_tokens=2)
            assert e.value.status_code == 503
            _, samples, _ = scrape(base)
            assert [v for n, _, v in samples if n == "llmserve_core_up"] == [0]
        finally:
            assert stop(proc) == 0
    finally:
        core.kill()
        core.wait()


# ------------------------------------------------------------------------------------------ llmserve-serve --model

def test_serve_owns_its_core(tiny_model_dir, tmp_path):
    proc, base = start_serve(str(tmp_path / "serve.log"), "--model", tiny_model_dir, "--served-model-name", "a", "b",
                             "--api-key", "sesame", *CORE_ARGS, "--max-model-len", "48")
    try:
        wait_healthy(proc, base, str(tmp_path / "serve.log"))    # probes need no key
        (core_pid,) = children(proc.pid)
        with pytest.raises(openai.AuthenticationError) as e:
            sdk(base).models.list()
        assert e.value.response.json()["error"]["code"] == "invalid_api_key"
        client = sdk(base, api_key="sesame")
        assert [m.id for m in client.models.list().data] == ["a", "b"]
        r = client.chat.completions.create(model="b", messages=CHAT, max_tokens=3)
        assert r.model == "b" and r.usage.completion_tokens == 3
        # OpenAI's chat default has no token cap: without max_tokens a request may fill the context.
        r = client.chat.completions.create(model="a", messages=CHAT, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == 48
    finally:
        assert stop(proc) == 0, open(tmp_path / "serve.log").read()[-3000:]
    assert not os.path.exists(f"/proc/{core_pid}") or open(f"/proc/{core_pid}/stat").read().split()[2] == "Z"


@pytest.mark.parametrize("args,needle", [
    (["--endpoint", "ipc:///x", "--model", "/y"], "not allowed with"),
    (["--endpoint", "ipc:///x", "--max-num-seqs", "4"], "need --model"),
    (["--model", "/no/such/dir"], "is not a directory"),
    (["--endpoint", "http://x"], "--endpoint"),
])
def test_bad_args_exit_2(args, needle):
    # A fresh interpreter importing the frontend: seconds alone, far longer on a busy machine.
    r = subprocess.run([sys.executable, "-m", "llmserve_client.http", *args], env=ENV, capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


def test_bad_core_flag_exits_2(tiny_model_dir):
    # Engine flags are the core's to judge; its verdict (exit 2, naming the flag) becomes ours.
    r = subprocess.run([sys.executable, "-m", "llmserve_client.http", "--model", tiny_model_dir, "--block-size", "3"],
                       env=ENV, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2 and "--block-size" in r.stderr, r.stderr[-2000:]


def test_a_failure_inside_a_stream_ends_it_with_an_error_event_and_done():
    """A bug while shaping a streamed chunk must not cut the connection mid-response (SSE clients read
    that as a network failure): an error event, then [DONE], and the engine streams are closed."""
    from llmserve_client.http import app as http_app
    from llmserve_client.http.metrics import Metrics
    fe = object.__new__(http_app.Frontend)
    fe.metrics = Metrics("m")
    closed = []

    async def merged_streams():
        try:
            yield 0, "a chunk"
            yield 0, "another"
        finally:
            closed.append(True)

    def broken(ctx, index, chunk):
        raise RuntimeError("a parser bug")
    fe._stream_choice = broken

    async def run():
        merged = merged_streams()
        first = await anext(merged)
        ctx = http_app._Ctx("r", "m", chat=False, include_usage=False)
        return [e async for e in fe._sse(ctx, [], merged, first)]

    events = asyncio.run(run())
    assert events[-1] == "data: [DONE]\n\n" and len(events) == 2, events
    assert json.loads(events[0].removeprefix("data: "))["error"]["type"] == "server_error"
    assert closed == [True]
