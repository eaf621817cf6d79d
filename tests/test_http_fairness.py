"""Fair shares and drains through the HTTP frontend: each API key is its own client of the core's fair
shares, though all reach the core over the frontend's one connection; /health turns 503 the moment a
drain starts, /live stays 200. Plus the pieces alone: who a request is for, what the early length check
counts, what the probes answer."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import msgspec
import pytest

pytest.importorskip("httpx")         # the HTTP frontend's; absent on the GPU machine
pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402

from llmserve_client import Client  # noqa: E402
from llmserve_client.http import schemas  # noqa: E402
from llmserve_client.http.health import Health  # noqa: E402
from llmserve_client.http.identity import Requester  # noqa: E402
from llmserve_client.http.limits import (COUNT_FIRST_BYTES, MESSAGE_TOKENS, chat_size, fewest_tokens,  # noqa: E402
                                         message_count)
from helpers.http import start_core, start_serve, stop, wait_healthy  # noqa: E402

FAIRNESS_STEPS = 4
SLOTS = 4
FLOOD_TOKENS = 300


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("fair-http")
    endpoint, core_log, serve_log = f"ipc://{d}/core.sock", str(d / "core.log"), str(d / "serve.log")
    core = start_core(tiny_model_dir, endpoint, core_log, "--max-num-seqs", str(SLOTS),
                      "--fairness-preempt-steps", str(FAIRNESS_STEPS), "--max-queued-requests-per-client", "5000",
                      "--max-queued-requests", "5000")
    serve, base = start_serve(serve_log, "--endpoint", endpoint)
    try:
        wait_healthy(serve, base, serve_log)
        with Client(endpoint, connect_timeout=180) as c:
            yield c, base
    finally:
        assert stop(serve) == 0, open(serve_log).read()[-3000:]
        assert stop(core) == 0, open(core_log).read()[-3000:]


def test_a_key_flooding_over_http_holds_its_share_and_another_key_is_served_within_the_bound(stack):
    core, base = stack
    stop_flood = threading.Event()

    async def flood():
        # 8 requests of 16 choices each: 128 engine requests of one user, read as they finish.
        async with httpx.AsyncClient(timeout=None, headers={"Authorization": "Bearer flood-key"}) as h:
            tasks = [asyncio.ensure_future(h.post(base + "/v1/completions", json={
                "prompt": [9, 8, 7, i], "max_tokens": FLOOD_TOKENS, "n": 16, "ignore_eos": True}))
                for i in range(8)]
            while not stop_flood.is_set():
                await asyncio.sleep(0.1)
            for t in tasks:
                t.cancel()              # the frontend sees the disconnects and aborts them in the core
            await asyncio.gather(*tasks, return_exceptions=True)

    flooder = threading.Thread(target=lambda: asyncio.run(flood()))
    flooder.start()
    try:
        deadline = time.monotonic() + 120
        while (s := core.stats())["waiting"] < 100 or s["running"] < SLOTS:     # a lone user fills every slot
            assert time.monotonic() < deadline, s
            time.sleep(0.1)
        for _ in range(3):
            before = core.stats()
            t0 = time.monotonic()
            r = httpx.post(base + "/v1/completions", headers={"Authorization": "Bearer probe-key"}, timeout=120,
                           json={"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
            latency = time.monotonic() - t0
            after = core.stats()
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
            # Had the frontend sent both keys as one client, the probe would queue behind the 100+ flood
            # requests waiting (thousands of steps), and even as a client of its own without fairness
            # preemption it would wait for a flood request to end (up to FLOOD_TOKENS steps); it takes a slot
            # back within the bound. The slack covers the steps the core runs while the stats calls and the
            # HTTP request travel (each step is milliseconds here): the in-process tests count exactly.
            steps = after["num_steps"] - before["num_steps"]
            assert steps <= FAIRNESS_STEPS + 40, (steps, before, after)
            assert after["waiting"] >= 90 and after["num_fairness_preemptions"] >= 1, after
            assert latency < 10.0, latency
    finally:
        stop_flood.set()
        flooder.join(60)
    deadline = time.monotonic() + 60
    while core.stats()["live_requests"] > 0:        # the flood's disconnects aborted its requests
        assert time.monotonic() < deadline, core.stats()
        time.sleep(0.1)


def test_health_is_503_from_the_moment_a_core_drain_starts_and_live_stays_200(tiny_model_dir, tmp_path):
    endpoint, core_log, serve_log = f"ipc://{tmp_path}/core.sock", str(tmp_path / "core.log"), str(tmp_path / "s.log")
    core = start_core(tiny_model_dir, endpoint, core_log, "--max-model-len", "2048", "--drain-timeout", "120")
    serve, base = start_serve(serve_log, "--endpoint", endpoint)
    try:
        wait_healthy(serve, base, serve_log)
        assert httpx.get(base + "/live", timeout=30).json() == {"status": "alive"}
        with httpx.stream("POST", base + "/v1/completions", timeout=120, json={
                "prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True, "stream": True}) as running:
            lines = running.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))       # it runs
            core.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while (h := httpx.get(base + "/health", timeout=30)).status_code != 503:
                assert time.monotonic() < deadline, h.text
                time.sleep(0.05)
            assert h.json()["status"] == "draining" and h.headers["retry-after"].isdigit()
            assert httpx.get(base + "/live", timeout=30).status_code == 200     # do not restart a drain
            r = httpx.post(base + "/v1/completions", timeout=60, json={"prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 503 and "retry-after" in r.headers
            assert next(line for line in lines if line.startswith("data:"))       # the drain serves it on
    finally:
        assert stop(serve) == 0, open(serve_log).read()[-3000:]
        core.kill()
        core.wait()


# ---- the pieces alone ----------------------------------------------------------------------------------

def _scope(auth: bytes | None = None, client=("10.1.2.3", 5555)) -> dict:
    return {"headers": [(b"authorization", auth)] if auth is not None else [], "client": client}


def test_who_a_request_is_for():
    a, b = Requester(_scope(b"Bearer sk-alpha"), None), Requester(_scope(b"bearer  sk-beta "), None)
    assert a.user(None) != b.user(None) and a.user(None) == a.user("someone")     # the key comes first
    assert a.user(None).startswith("key:") and "alpha" not in a.user(None)        # hashed, never the raw key
    assert len(a.user(None)) == len(b.user("x" * 10_000)) < 64
    shared = Requester(_scope(b"Bearer server-key"), "server-key")                  # the server's own key
    assert shared.user("alice") != shared.user("bob") and shared.user("alice").startswith("user:")
    assert "alice" not in shared.user("alice")
    assert Requester(_scope(None), None).user(None) == "addr:10.1.2.3"
    assert Requester(_scope(b"Basic abc", client=None), None).user("") == "addr:"
    # OpenAI's `user` field reaches the chat pipeline from every endpoint (the Responses API's too).
    from llmserve_client.http.responses import ResponsesRequest, to_chat
    assert to_chat(ResponsesRequest(input="hi", user="carol"))["user"] == "carol"
    assert schemas.decode(b'{"prompt": "hi", "user": "dave"}', schemas.CompletionRequest).user == "dave"


def test_the_length_check_counts_every_role_tool_call_name_and_part():
    body = {"messages": [
        {"role": "system", "content": "s" * 10},
        {"role": "assistant", "content": "a" * 100, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f" * 5, "arguments": "{\"x\": \"" + "y" * 50 + "\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"k": "v" * 20}}}]},
        {"role": "tool", "content": "t" * 7, "tool_call_id": "c1"},
        {"role": "user", "content": [{"type": "text", "text": "p" * 30}, {"type": "text", "text": "q" * 3}],
         "name": "n" * 4}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    req = msgspec.json.decode(json.dumps(body), type=schemas.ChatRequest)
    tools = len(msgspec.json.encode(req.tools))
    chars, messages = chat_size(req)
    args = len("{\"x\": \"" + "y" * 50 + "\"}") + len(msgspec.json.encode({"k": "v" * 20}))
    assert (chars, messages) == (10 + 100 + 5 + 1 + args + 7 + 2 + 30 + 3 + 4 + tools, 4)
    assert fewest_tokens(chars, messages, 32) == chars // 32 + 4 * MESSAGE_TOKENS


def test_250000_messages_are_counted_in_well_under_a_second():
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * 250_000, "max_tokens": 2}).encode()
    assert len(body) > COUNT_FIRST_BYTES        # so the frontend counts before it decodes
    t0 = time.monotonic()
    n = message_count(body)
    took = time.monotonic() - t0
    assert n == 250_000 and fewest_tokens(0, n, 32) == 750_000
    assert took < 1.0, took
    assert message_count(b"{\"messages\": 3}") is None and message_count(b"[") is None
    assert message_count(b"{\"prompt\": \"hi\"}") == 0
    req = schemas.decode(body, schemas.ChatRequest)      # what a body under the threshold goes through
    assert chat_size(req) == (0, 250_000)


class _FakeClient:
    def __init__(self, stats=None, error=None):
        self._stats, self._error, self.gone_for_good = stats, error, None

    async def stats(self, timeout=None):
        if self._error is not None:
            raise self._error
        return self._stats


def _answer(response) -> tuple[int, dict]:
    return response.status_code, json.loads(response.body)


def test_probes_answer_readiness_and_liveness_apart():
    async def main():
        ok = Health(_FakeClient({"running": 1}))
        assert _answer(await ok.ready(None)) == (200, {"status": "ok"})
        draining = Health(_FakeClient({"running": 1, "draining": True}))
        status, body = _answer(await draining.ready(None))
        assert status == 503 and body["status"] == "draining"
        assert (await draining.ready(None)).headers["retry-after"].isdigit()
        assert _answer(await draining.live(None)) == (200, {"status": "alive"})
        ok.draining = True                       # this frontend's own SIGTERM
        assert _answer(await ok.ready(None))[0] == 503 and _answer(await ok.live(None))[0] == 200
        cores = [{"endpoint": "a", "up": True, "draining": True}, {"endpoint": "b", "up": True, "draining": False}]
        two = Health(_FakeClient({"num_cores": 2, "num_cores_up": 2, "cores": cores}))
        status, body = _answer(await two.ready(None))
        assert status == 200 and body["status"] == "degraded" and body["cores_up"] == 1
        cores[1]["draining"] = True
        assert _answer(await two.ready(None))[0] == 503
        dead = Health(_FakeClient(error=asyncio.TimeoutError()))
        dead.client.gone_for_good = RuntimeError("every core is gone")
        assert _answer(await dead.ready(None))[0] == 503 and _answer(await dead.live(None))[0] == 503
    asyncio.run(main())
