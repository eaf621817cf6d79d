"""Faults of the core and what its clients do about them, against real processes on the CPU tiny model:
a SIGKILLed or SIGSTOPped core fails what was in flight at once, and the same long-lived Client,
AsyncClient and llmserve-serve --endpoint serve again once a core with the same model is back on the
endpoint; a core with another model is refused; llmserve-serve --model exits non-zero when its own core
dies; a draining core's refusals reach HTTP clients as 503 with Retry-After.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import pytest

pytest.importorskip("httpx")         # the HTTP frontend's; absent on the GPU machine
pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402
import openai  # noqa: E402

from helpers.http import CORE_ARGS, children, sdk, start_core, start_serve, stop, wait_healthy  # noqa: E402
from llmserve_client import AsyncClient, Client, EngineDeadError, ModelChangedError  # noqa: E402

PROMPT = [5, 6, 7, 8]


def _wait_serving(call, timeout: float = 120.0):
    """call() until it stops raising EngineDeadError (a core is back); returns its result."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except EngineDeadError:
            assert time.monotonic() < deadline, "the client did not reconnect"
            time.sleep(0.1)


def _wait_health(base: str, status: int, timeout: float = 120.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(base + "/health", timeout=30)
        if r.status_code == status:
            return r
        assert time.monotonic() < deadline, f"/health stayed {r.status_code}"
        time.sleep(0.1)


def _kill(proc) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


class AsyncSide:
    """A long-lived AsyncClient on its own event loop thread, driven from the test's thread."""

    def __init__(self, endpoint: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client = self.run(self._make(endpoint))

    async def _make(self, endpoint):
        return await AsyncClient(endpoint, connect_timeout=60).connect()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generate(self, prompt, **kw):
        return self.run(self.client.generate(prompt, **kw))

    async def _drain(self, stream):
        async for _ in stream:
            pass

    def start_stream(self, prompt, **kw):
        stream = self.run(self.client.stream(prompt, **kw))
        return asyncio.run_coroutine_threadsafe(self._drain(stream), self.loop)

    def close(self):
        self.run(self.client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


# Room for streams long enough to be still running when the core is killed, however busy the machine.
LONG_CORE = ("--max-model-len", "2048", "--num-kv-blocks", "512")
LONG = 1500


def test_core_restart_and_pause_are_survived_by_long_lived_clients_and_frontend(tiny_model_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/core.sock"
    core = start_core(tiny_model_dir, endpoint, str(tmp_path / "core1.log"), *LONG_CORE)
    serve_log = str(tmp_path / "serve.log")
    serve, base = start_serve(serve_log, "--endpoint", endpoint, "--served-model-name", "m")
    c = side = None
    try:
        wait_healthy(serve, base, serve_log)
        c = Client(endpoint, connect_timeout=60)
        side = AsyncSide(endpoint)
        oai = sdk(base)
        reference = c.generate(PROMPT, max_tokens=8, temperature=0).token_ids
        http_ref = oai.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text

        # In flight on all three when the core dies: each fails promptly with EngineDeadError.
        sync_stream = c.stream(PROMPT, max_tokens=LONG, ignore_eos=True)
        async_run = side.start_stream(PROMPT, max_tokens=LONG, ignore_eos=True)
        # create() returns at the first chunk, so the kill lands LONG tokens before any of them can end.
        http_stream = oai.completions.create(model="m", prompt=PROMPT, max_tokens=LONG, stream=True,
                                             extra_body={"ignore_eos": True})
        core.kill()
        # Promptly: through the dropped connection, not after a heartbeat timeout (the reason says which;
        # a time bound would fail on a busy machine).
        lost = "connection to the core at .* was lost"
        with pytest.raises(EngineDeadError, match=lost):
            for _ in sync_stream:
                pass
        with pytest.raises(EngineDeadError, match=lost):
            async_run.result(60)
        with pytest.raises(openai.APIError, match="engine is unavailable: " + lost):
            for _ in http_stream:
                pass
        core.wait()
        # While no core is there, calls fail at once (with the same reason) and /health says so with a
        # Retry-After.
        with pytest.raises(EngineDeadError, match=lost):
            c.generate(PROMPT, max_tokens=2)
        with pytest.raises(EngineDeadError, match=lost):
            side.generate(PROMPT, max_tokens=2)
        r = _wait_health(base, 503)
        assert int(r.headers["retry-after"]) > 0
        with pytest.raises(openai.InternalServerError) as e:
            oai.completions.create(model="m", prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 503 and int(e.value.response.headers["retry-after"]) > 0

        # A new core on the same endpoint: the same three objects serve again, with the same results.
        core = start_core(tiny_model_dir, endpoint, str(tmp_path / "core2.log"), *LONG_CORE)
        assert _wait_serving(lambda: c.generate(PROMPT, max_tokens=8, temperature=0)).token_ids == reference
        assert _wait_serving(lambda: side.generate(PROMPT, max_tokens=8, temperature=0)).token_ids == reference
        _wait_health(base, 200)
        assert oai.completions.create(model="m", prompt=PROMPT, max_tokens=8,
                                      temperature=0).choices[0].text == http_ref
        assert c._cores.transports[0].sessions == 2 and side.client._cores.transports[0].sessions == 2

        # A paused core is dead to its clients after the heartbeat timeout, and alive again when resumed.
        core.send_signal(signal.SIGSTOP)
        try:
            stream = c.stream(PROMPT, max_tokens=400, ignore_eos=True)
            with pytest.raises(EngineDeadError):
                for _ in stream:
                    pass
            _wait_health(base, 503)
        finally:
            core.send_signal(signal.SIGCONT)
        assert _wait_serving(lambda: c.generate(PROMPT, max_tokens=8, temperature=0)).token_ids == reference
        _wait_health(base, 200)
        assert oai.completions.create(model="m", prompt=PROMPT, max_tokens=8,
                                      temperature=0).choices[0].text == http_ref
        assert serve.poll() is None
    finally:
        if side is not None:
            side.close()
        if c is not None:
            c.close()
        assert stop(serve) == 0, open(serve_log).read()[-3000:]
        _kill(core)


def test_core_back_with_another_model_is_refused(tiny_model_dir, make_random_qwen3_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/core.sock"
    core = start_core(tiny_model_dir, endpoint, str(tmp_path / "core1.log"))
    serve_log = str(tmp_path / "serve.log")
    serve, base = start_serve(serve_log, "--endpoint", endpoint)
    try:
        wait_healthy(serve, base, serve_log)
        with Client(endpoint, connect_timeout=60) as c:
            c.generate(PROMPT, max_tokens=2)
            _kill(core)
            core = start_core(make_random_qwen3_dir(seed=3), endpoint, str(tmp_path / "core2.log"))
            deadline = time.monotonic() + 120
            while True:
                with pytest.raises(EngineDeadError) as e:
                    c.generate(PROMPT, max_tokens=2)
                if isinstance(e.value, ModelChangedError):
                    break
                assert time.monotonic() < deadline, "never told that the model changed"
                time.sleep(0.1)
            assert "model" in str(e.value)
        # The frontend cannot serve the new model with the old one's tokenizer: it ends with status 1.
        assert serve.wait(120) == 1
        assert "another model" in open(serve_log).read()
    finally:
        stop(serve)
        _kill(core)


def test_chat_without_max_tokens_fits_the_pool_of_the_core_back_on_the_endpoint(tiny_model_dir, tmp_path):
    # A chat without max_tokens runs to what the KV pool holds: the pool of the core serving now, which
    # may be smaller than the one the frontend met first.
    endpoint = f"ipc://{tmp_path}/core.sock"
    core = start_core(tiny_model_dir, endpoint, str(tmp_path / "core1.log"))
    serve_log = str(tmp_path / "serve.log")
    serve, base = start_serve(serve_log, "--endpoint", endpoint, "--served-model-name", "m")
    messages = [{"role": "user", "content": "hi"}]
    try:
        wait_healthy(serve, base, serve_log)
        oai = sdk(base)
        assert oai.chat.completions.create(model="m", messages=messages, max_tokens=2).usage.completion_tokens == 2
        core.kill()
        core.wait()
        _wait_health(base, 503)
        core = start_core(tiny_model_dir, endpoint, str(tmp_path / "core2.log"), "--num-kv-blocks", "8")
        _wait_health(base, 200)
        r = oai.chat.completions.create(model="m", messages=messages, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == 8 * 16
    finally:
        assert stop(serve) == 0, open(serve_log).read()[-3000:]
        _kill(core)


def test_serve_with_model_exits_nonzero_when_its_core_dies(tiny_model_dir, tmp_path):
    # Also: on a pool smaller than max_model_len, a chat without max_tokens runs to what the pool holds.
    serve_log = str(tmp_path / "serve.log")
    serve, base = start_serve(serve_log, "--model", tiny_model_dir, "--served-model-name", "m", *CORE_ARGS,
                              "--num-kv-blocks", "8")
    try:
        wait_healthy(serve, base, serve_log)
        oai = sdk(base)
        r = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                        extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == 8 * 16
        (core_pid,) = children(serve.pid)
        # Stopped first, the core can neither finish this request nor refuse it: it is surely in flight
        # when the core goes silent (a running core can finish a short stream before a kill lands).
        os.kill(core_pid, signal.SIGSTOP)
        try:
            with pytest.raises(openai.APIError, match="engine is unavailable"):
                for _ in oai.completions.create(model="m", prompt=PROMPT, max_tokens=100, stream=True,
                                                extra_body={"ignore_eos": True}):
                    pass
        finally:
            os.kill(core_pid, signal.SIGKILL)
        assert serve.wait(120) == 1
        assert "llmserve-core exited" in open(serve_log).read()
    finally:
        stop(serve)


def test_draining_core_refusals_are_503_with_retry_after(tiny_model_dir, tmp_path):
    endpoint = f"ipc://{tmp_path}/core.sock"
    core = start_core(tiny_model_dir, endpoint, str(tmp_path / "core.log"))
    serve_log = str(tmp_path / "serve.log")
    serve, base = start_serve(serve_log, "--endpoint", endpoint, "--served-model-name", "m")
    try:
        wait_healthy(serve, base, serve_log)
        oai = sdk(base)
        # Long requests keep the drain going while new ones arrive.
        streams = [oai.completions.create(model="m", prompt=PROMPT, max_tokens=500, stream=True,
                                          extra_body={"ignore_eos": True}) for _ in range(4)]
        for s in streams:
            next(iter(s))
        core.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        refused = None
        while refused is None:
            try:
                oai.completions.create(model="m", prompt=PROMPT, max_tokens=2)
            except openai.APIStatusError as e:
                refused = e
            assert time.monotonic() < deadline, "the core never refused a request"
            time.sleep(0.02)
        assert refused.status_code == 503, refused.response.text
        assert "shutting down" in refused.response.json()["error"]["message"]
        assert int(refused.response.headers["retry-after"]) > 0
        for s in streams:       # they finish, or end in an abort when the drain times out
            with contextlib.suppress(openai.APIError):
                for _ in s:
                    pass
        assert core.wait(60) == 0
    finally:
        stop(serve)
        _kill(core)
