"""What a careless or hostile HTTP peer can cost llmserve-serve, against the real frontend and core (CPU tiny
model): body size limit and read deadline, request-head deadline, huge prompts, integers no message can
carry, deeply nested JSON, bad flags; plus the Python client's checks of the same integers and its
tokenizer loading under threads.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest.importorskip("httpx")         # the HTTP frontend's; absent on the GPU machine
pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import httpx  # noqa: E402

from helpers.daemon import ENV  # noqa: E402
from helpers.http import start_core, start_serve, stop, wait_healthy  # noqa: E402
from llmserve_client import Client, RequestError  # noqa: E402
from llmserve_proto import GuidedDecoding  # noqa: E402

JSON = {"Content-Type": "application/json"}   # what the server requires of a body (as vLLM does)

MAX_BODY = 16 * 1024 * 1024
BODY_TIMEOUT = 2.0
HEAD_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    """(endpoint, serve process, base URL) of a core and a frontend with small limits."""
    d = tmp_path_factory.mktemp("limits")
    endpoint, core_log, serve_log = f"ipc://{d}/core.sock", str(d / "core.log"), str(d / "serve.log")
    core = start_core(tiny_model_dir, endpoint, core_log)
    serve, base = start_serve(serve_log, "--endpoint", endpoint, "--max-body-bytes", str(MAX_BODY),
                              "--body-timeout", str(BODY_TIMEOUT), "--header-timeout", str(HEAD_TIMEOUT))
    try:
        wait_healthy(serve, base, serve_log)
        yield endpoint, serve, base
    finally:
        assert stop(serve) == 0, open(serve_log).read()[-3000:]
        assert stop(core) == 0, open(core_log).read()[-3000:]


def _addr(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").split(":")
    return host, int(port)


def _post_head(path: str, extra: str = "", length: int | None = None) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode()


def _read_response(sock: socket.socket, timeout: float = 60.0) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length body, read off a raw socket."""
    sock.settimeout(timeout)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {buf!r}"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    n = int(headers.get("content-length", 0))
    while len(body) < n:
        chunk = sock.recv(65536)
        assert chunk, "connection closed inside a body"
        body += chunk
    return int(lines[0].split()[1]), headers, body[:n]


def _request(sock: socket.socket, path: str, payload: bytes) -> tuple[int, dict, bytes]:
    sock.sendall(_post_head(path, length=len(payload)) + payload)
    return _read_response(sock)


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


GOOD = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}).encode()


# ------------------------------------------------------------------------------------------ bodies

def test_declared_oversized_body_gets_413_unread(stack):
    _, serve, base = stack
    rss = _rss_bytes(serve.pid)
    with socket.create_connection(_addr(base)) as s:
        s.sendall(_post_head("/v1/completions", length=100 * 1024 * 1024) + b'{"prompt": "')
        status, headers, body = _read_response(s)
        assert status == 413 and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "request_too_large"
        assert _closed_by_peer(s, 30)
    assert _rss_bytes(serve.pid) - rss < 64 * 1024 * 1024


def test_chunked_body_is_cut_off_at_the_limit(stack):
    _, serve, base = stack
    rss = _rss_bytes(serve.pid)
    sent = 0
    chunk = b"a" * (1024 * 1024)
    with socket.create_connection(_addr(base)) as s:
        s.sendall(_post_head("/v1/completions", "Transfer-Encoding: chunked\r\n"))
        try:
            while sent < 100 * 1024 * 1024:    # a 100 MB body, unless the server stops taking it
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        else:
            status, _, _ = _read_response(s)
            assert status == 413
    # The server stopped reading soon after the limit (what the kernel's socket buffers hold aside).
    assert sent < MAX_BODY + 24 * 1024 * 1024, sent
    assert _rss_bytes(serve.pid) - rss < 96 * 1024 * 1024
    assert httpx.post(base + "/v1/completions", content=GOOD, headers=JSON, timeout=60).status_code == 200


def test_body_that_never_finishes_gets_408_and_frees_the_connection(stack):
    _, serve, base = stack
    before = _open_fds(serve.pid)
    socks = [socket.create_connection(_addr(base)) for _ in range(20)]
    try:
        for s in socks:
            s.sendall(_post_head("/v1/completions", length=1000) + b'{"prompt": ')
        for s in socks:
            status, headers, body = _read_response(s, timeout=BODY_TIMEOUT + 60)
            assert status == 408 and headers["connection"] == "close", body
            assert _closed_by_peer(s, 30)
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 30
    while _open_fds(serve.pid) > before:
        assert time.monotonic() < deadline, (before, _open_fds(serve.pid))
        time.sleep(0.1)


@pytest.mark.parametrize("partial", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"])
def test_incomplete_request_head_is_closed(stack, partial):
    _, serve, base = stack
    with socket.create_connection(_addr(base)) as s:
        if partial:
            s.sendall(partial)
        t0 = time.monotonic()
        assert _closed_by_peer(s, HEAD_TIMEOUT + 60)
        assert time.monotonic() - t0 >= HEAD_TIMEOUT * 0.5
    # ... and a keep-alive connection that starts a second head and stalls is closed as well.
    with socket.create_connection(_addr(base)) as s:
        assert _request(s, "/v1/completions", GOOD)[0] == 200
        s.sendall(b"GET /health HTTP/1.1\r\n")
        assert _closed_by_peer(s, HEAD_TIMEOUT + 60)


def _latencies_while(base: str, work) -> tuple[list[float], float, object]:
    """Run work() on a thread; meanwhile time GET /v1/models, which only the frontend's event loop answers
    (/health also waits for the core, which a loaded machine may slow). Returns (latencies, work's
    duration, its result)."""
    result, t = {}, {}

    def run():
        t0 = time.monotonic()
        result["value"] = work()
        t["took"] = time.monotonic() - t0

    worker = threading.Thread(target=run)
    latencies = []
    with httpx.Client(timeout=60) as h:
        worker.start()
        while worker.is_alive():
            t0 = time.monotonic()
            assert h.get(base + "/v1/models").status_code == 200
            latencies.append(time.monotonic() - t0)
            time.sleep(0.05)
    worker.join()
    return latencies, t["took"], result["value"]


def test_huge_prompt_is_refused_from_its_length_without_freezing(stack):
    _, serve, base = stack
    rss = _rss_bytes(serve.pid)
    body = json.dumps({"prompt": "def f(x):\n    return x\n" * 600_000, "max_tokens": 2}).encode()   # 14 MB
    latencies, _, r = _latencies_while(
        base, lambda: httpx.post(base + "/v1/completions", content=body, headers=JSON, timeout=120))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "prompt"
    assert max(latencies, default=0) < 5.0, latencies
    assert _rss_bytes(serve.pid) - rss < 256 * 1024 * 1024


def test_huge_tool_result_is_refused_from_its_length(stack):
    # A tool result goes into the prompt whole, so it counts before rendering and tokenizing: else each such
    # request holds the one tokenizer thread every request shares for seconds.
    _, _, base = stack
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "word " * 1_000_000}]
    r = httpx.post(base + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "characters" in err["message"], err      # refused from its length, not after tokenizing


def _chat_latency(base: str, user: str) -> float:
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {user}"},
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


@pytest.mark.parametrize("case", ["assistant-8mb", "250000-empty-messages"])
def test_huge_chats_get_400_at_once_while_another_user_is_served(stack, case):
    # Every role counts in the early length check, and so does every message (each costs the template
    # tokens): neither chat is rendered or tokenized, so four at once cost another user's chat nothing.
    _, serve, base = stack
    if case == "assistant-8mb":
        messages = [{"role": "assistant", "content": "x" * 8_000_000}, {"role": "user", "content": "hi"}]
    else:
        messages = [{"role": "user", "content": ""}] * 250_000
    body = json.dumps({"messages": messages, "max_tokens": 2}).encode()
    usual = sorted(_chat_latency(base, "other") for _ in range(3))[1]
    rss = _rss_bytes(serve.pid)
    results = []

    def huge():
        with httpx.Client(timeout=120, headers={"Authorization": "Bearer flood"}) as h:
            t0 = time.monotonic()
            r = h.post(base + "/v1/chat/completions", content=body, headers=JSON)
            results.append((r, time.monotonic() - t0))

    workers = [threading.Thread(target=huge) for _ in range(4)]
    for w in workers:
        w.start()
    beside = [_chat_latency(base, "other") for _ in range(3)]
    for w in workers:
        w.join()
    for r, took in results:
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages", err
        assert "characters" in err["message"], err          # refused from its size, not after tokenizing
        # Well under a second on an idle machine (the body's upload included); slack for a busy one, far
        # below tokenizing it (seconds each, one after another on one thread before).
        assert took < 3.0, [t for _, t in results]
    assert max(beside) < usual + 2.0, (usual, beside)
    assert _rss_bytes(serve.pid) - rss < 256 * 1024 * 1024


# ------------------------------------------------------------------------------------------ values no message can carry

WIDE = [2**64, 10**30, -(2**64)]


def _cases():
    for big in WIDE:
        yield "/v1/completions", {"prompt": [1, big, 3]}, "prompt"
        yield "/v1/completions", {"prompt": "hi", "seed": big}, "seed"
        yield "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": big}, "seed"
        yield "/v1/completions", {"prompt": "hi", "stop_token_ids": [big]}, "stop_token_ids"
        yield "/v1/completions", {"prompt": [[1, 2], [3, big]]}, "prompt[1]"      # the prompt at fault
        yield "/v1/completions", {"prompt": "hi", "logprobs": big}, "logprobs"
        yield "/v1/completions", {"prompt": "hi", "prompt_logprobs": big}, "prompt_logprobs"
        yield "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                       "top_logprobs": big}, "top_logprobs"
        yield "/v1/completions", {"prompt": "hi", "min_tokens": big}, "min_tokens"
        yield "/v1/completions", {"prompt": "hi", "n": big}, "n"
        yield "/v1/completions", {"prompt": "hi", "logit_bias": {str(big): 1.0}}, "logit_bias"
    deep = 100_000
    yield "/v1/completions", "{\"prompt\": " + "[" * deep + "]" * deep + "}", None
    yield "/v1/completions", "{\"prompt\": [" + "{\"a\": " * deep + "1" + "}" * deep + "]}", None


def test_out_of_range_integers_and_deep_json_get_400_on_a_connection_that_stays_usable(stack):
    _, _, base = stack
    with socket.create_connection(_addr(base)) as s:
        for path, payload, param in _cases():
            data = (payload if isinstance(payload, str) else json.dumps({**payload, "max_tokens": 2})).encode()
            status, headers, body = _request(s, path, data)
            err = json.loads(body)["error"]
            assert status == 400, (path, param, body[:300])
            assert err["param"] == param, (param, err)
            assert headers.get("connection") != "close"
            # The same keep-alive connection serves the next request.
            assert _request(s, "/v1/completions", GOOD)[0] == 200


@pytest.mark.parametrize("big", WIDE)
def test_client_names_the_field_of_an_integer_out_of_range(stack, big):
    endpoint = stack[0]
    with Client(endpoint, connect_timeout=60) as c:
        for kwargs, field in [({"seed": big}, "seed"), ({"stop_token_ids": [1, big]}, "stop_token_ids"),
                              ({"max_tokens": big}, "max_tokens"), ({"prompt_logprobs": big}, "prompt_logprobs"),
                              ({"min_tokens": big}, "min_tokens"), ({"logit_bias": {big: 1.0}}, "logit_bias"),
                              ({"guided": GuidedDecoding(kind="json_object", start_after=[big])},
                               "guided.start_after")]:
            with pytest.raises(ValueError) as e:
                c.generate([1, 2, 3], **kwargs)
            assert isinstance(e.value, RequestError) and e.value.field == field, e.value
        with pytest.raises(RequestError) as e:
            c.generate([1, big, 3], max_tokens=2)
        assert e.value.field == "prompt_token_ids"
        assert len(c.generate([1, 2, 3], max_tokens=2, temperature=0).token_ids) == 2


# ------------------------------------------------------------------------------------------ tokenizer loading

RACE = textwrap.dedent("""
    import sys, threading
    import llmserve_client.client as client_mod
    from llmserve_client import Client
    calls = []
    real = client_mod.load_tokenizer
    client_mod.load_tokenizer = lambda path: calls.append(path) or real(path)
    c = Client(sys.argv[1], connect_timeout=60)
    go = threading.Barrier(8)
    errors, texts = [], []
    def first_text_request():
        go.wait()
        try:
            texts.append(c.generate("def add(a, b):", max_tokens=2, temperature=0).text)
        except BaseException as e:
            errors.append(repr(e))
    threads = [threading.Thread(target=first_text_request) for _ in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    c.close()
    assert not errors, errors
    assert len(texts) == 8 and len(set(texts)) == 1, texts
    assert len(calls) == 1, calls
    print("ok")
""")


def test_first_text_requests_from_many_threads_load_one_tokenizer(stack):
    endpoint = stack[0]
    for _ in range(4):     # fresh processes: the race was in the first import of transformers
        r = subprocess.run([sys.executable, "-c", RACE, endpoint], env=ENV, capture_output=True, text=True,
                           timeout=180)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


# ------------------------------------------------------------------------------------------ flags

@pytest.mark.parametrize("args,env,needle", [
    (["--api-key", ""], {}, "--api-key: must not be empty"),
    (["--api-key", "  "], {}, "--api-key: must not be empty"),
    ([], {"LLMSERVE_API_KEY": ""}, "--api-key: must not be empty"),
    (["--max-body-bytes", "0"], {}, "--max-body-bytes"),
    (["--body-timeout", "0"], {}, "--body-timeout"),
    (["--header-timeout", "nan"], {}, "--header-timeout"),
])
def test_bad_limits_and_empty_api_key_exit_2(args, env, needle):
    r = subprocess.run([sys.executable, "-m", "llmserve_client.http", "--endpoint", "ipc:///nonexistent", *args],
                       env={**ENV, **env}, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


class _FakeStream:
    """An AsyncStream's surface for streams.merge: chunks, then an error or the end; close() recorded."""

    def __init__(self, chunks, error=None):
        self.chunks, self.error, self.closed = list(chunks), error, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for c in self.chunks:
            await asyncio.sleep(0)
            yield c
        if self.error is not None:
            raise self.error

    async def aclose(self):
        self.closed = True


def test_merge_ends_on_any_stream_failure_and_closes_every_stream():
    """n > 1 merges the choices' streams; a failure of any kind in one (not only the client's own errors)
    must end the merge and close the rest, not leave the response waiting for a stream that is gone."""
    from llmserve_client.http.streams import merge

    async def run():
        streams = [_FakeStream(["a0", "a1"]), _FakeStream(["b0"], error=ValueError("boom")),
                   _FakeStream(["c%d" % i for i in range(100)])]
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for item in merge(streams):
                got.append(item)
        return got, streams

    got, streams = asyncio.run(asyncio.wait_for(run(), 60))
    assert (1, "b0") in got and all(s.closed for s in streams)
