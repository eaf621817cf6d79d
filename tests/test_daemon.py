"""End to end: the real llmserve-core as a subprocess on the CPU tiny model, driven by the client library.

One shared core serves most tests; the tests that kill or stop a core start their own.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from llmserve_client import AsyncClient, Client, EngineDeadError, HandshakeTimeoutError, RequestError
from llmserve_proto import Hello, ModelInfo, decode_core, encode
from llmserve_proto.messages import EngineError as EngineErrorMsg
from llmserve_proto.messages import RequestError as RequestErrorMsg
from llmserve_proto.messages import Welcome

from helpers.daemon import (READY_TIMEOUT, ROOT, free_port, recv_reply, start_core, stop_core, wait_idle,
                            wait_ready)

PROMPTS = ["def add(a, b):", "Return the value of", "The quick brown fox", "import os\nimport sys\n",
           "class Stack:", "while True:", "for i in range(10):", "print('hello')"]


@pytest.fixture(scope="module")
def core(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("core")
    endpoint, log = f"ipc://{d}/core.sock", str(d / "core.log")
    proc = start_core(tiny_model_dir, endpoint, log)
    try:
        wait_ready(endpoint, proc, log)
        with Client(endpoint) as c:
            assert c.model_info.vocab_size == 1024
        yield endpoint, proc, log
    finally:
        code = stop_core(proc)
        assert code == 0, open(log).read()[-3000:]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from llmserve_core import Engine, EngineConfig
    return Engine(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=512, num_kv_blocks=256, block_size=16))


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def expected(engine, tok, prompts, max_tokens, **kw):
    from llmserve_proto import SamplingParams
    outs = engine.generate([tok.encode(p) for p in prompts], SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))
    return [o.token_ids for o in outs]


# ---- the shared core ----------------------------------------------------------------------------------

def test_streamed_tokens_equal_the_in_process_engine(core, engine, tok):
    endpoint, _, _ = core
    want = expected(engine, tok, PROMPTS[:3], 12, ignore_eos=True)
    with Client(endpoint) as c:
        for prompt, ids in zip(PROMPTS[:3], want):
            chunks = list(c.stream(prompt, max_tokens=12, temperature=0.0, ignore_eos=True))
            got = [t for ch in chunks for t in ch.token_ids]
            assert got == ids
            assert "".join(ch.text for ch in chunks) == tok.decode(ids, skip_special_tokens=True)
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
            t = chunks[-1].timings
            assert t.core_arrival <= t.core_first_token <= t.core_finish and t.ttft > 0


def test_generate_accepts_ids_text_and_chat_messages(core, engine, tok):
    endpoint, _, _ = core
    with Client(endpoint) as c:
        by_text = c.generate(PROMPTS[0], max_tokens=5, temperature=0.0, ignore_eos=True)
        by_ids = c.generate(tok.encode(PROMPTS[0]), max_tokens=5, temperature=0.0, ignore_eos=True)
        assert by_text.token_ids == by_ids.token_ids and by_text.text == by_ids.text
        chat = c.generate([{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert chat.prompt_token_ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
        assert chat.usage.prompt_tokens == len(chat.prompt_token_ids) and len(chat.token_ids) == 4
        lp = c.generate(PROMPTS[1], max_tokens=3, temperature=0.0, logprobs=2)
        assert len(lp.logprobs) == len(lp.token_ids)
        assert all(len(x.top_token_ids) == 2 and x.logprob <= 0.0 for x in lp.logprobs)
        assert [x.top_token_ids[0] for x in lp.logprobs] == lp.token_ids     # greedy takes the best token


def test_32_concurrent_clients_each_get_only_their_own_outputs(core, engine, tok):
    endpoint, _, _ = core
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    want = expected(engine, tok, prompts, 8, ignore_eos=True)
    results, errors = [None] * 32, []
    start = threading.Barrier(32)

    def run(i):
        try:
            with Client(endpoint, client_name=f"c{i}") as c:
                start.wait()
                results[i] = c.generate(prompts[i], request_id="same-id-everywhere", max_tokens=8, temperature=0.0,
                                        ignore_eos=True)
        except Exception as e:      # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert [r.token_ids for r in results] == want
    with Client(endpoint) as c:
        s = wait_idle(c)
        assert s["requests_aborted_disconnect"] == 0


def test_abort_ends_the_stream_and_frees_blocks(core):
    endpoint, _, _ = core
    with Client(endpoint) as c:
        # Aborted right after it is sent (not after its first token: by the time that reaches us on a busy
        # machine, the core may have finished all 400).
        s = c.stream(PROMPTS[2], max_tokens=400, temperature=0.0, ignore_eos=True)
        c.abort(s.request_id)
        chunks = list(s)
        assert chunks[-1].finish_reason == "abort" and all(ch.finish_reason is None for ch in chunks[:-1])
        assert s.completion.finish_reason == "abort" and len(s.completion.token_ids) < 400
        wait_idle(c)


def test_stop_string_trims_text_and_aborts_in_the_engine(core, engine, tok):
    endpoint, _, _ = core
    ids = expected(engine, tok, [PROMPTS[0]], 40, ignore_eos=True)[0]
    text = tok.decode(ids, skip_special_tokens=True)
    stop = text[len(text) // 3:len(text) // 3 + 3]
    with Client(endpoint) as c:
        comp = c.generate(PROMPTS[0], max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
        assert comp.finish_reason == "stop" and comp.stop_reason == stop
        assert comp.text == text[:text.index(stop)]
        s = wait_idle(c)
        assert s["requests_aborted_by_client"] >= 1


def test_bad_requests_are_rejected_with_the_field(core):
    endpoint, _, _ = core
    with Client(endpoint) as c:
        cases = [(dict(prompt=[5000]), "prompt_token_ids"), (dict(prompt=[1, 2], max_tokens=600), "max_tokens"),
                 (dict(prompt=[1, 2], temperature=-1.0), "temperature"), (dict(prompt=[1], top_p=0.0), "top_p"),
                 (dict(prompt=[1], max_tokens=0), "max_tokens"), (dict(prompt=[1], bogus=1), "bogus")]
        for kw, field in cases:
            with pytest.raises(RequestError) as e:
                c.generate(**kw)
            assert e.value.field == field, (kw, e.value)
        # A live request id may not be reused on the same connection.
        # The second is sent right after the first, long before the first's 400 tokens can be done.
        s = c.stream([1, 2, 3], request_id="dup", max_tokens=400, ignore_eos=True)
        with pytest.raises(RequestError) as e:
            c.generate([1, 2, 3], request_id="dup", max_tokens=2)
        assert e.value.field == "request_id"
        s.close()
        wait_idle(c)


def test_garbage_and_wrong_typed_messages_leave_the_engine_serving(core):
    endpoint, _, log = core
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 5000)
    raw.connect(endpoint)
    try:
        raw.send(encode(Hello(client_name="raw")))
        assert isinstance(recv_reply(raw), Welcome)
        frames = {
            "garbage": [b"\xc1\xff\x00garbage"],
            "empty": [b""],
            "core message from a client": [encode(Welcome(protocol_version=1, model_info=ModelInfo(model="x"),
                                                          heartbeat_interval_s=1.0, client_timeout_s=1.0))],
            "unknown tag": [msgspec.msgpack.encode(["launch_missiles", 1])],
            "unhashable tag": [b"\x92\x90\x00"],      # [[], 0]: once ended the socket thread, and the core
            "map tag": [msgspec.msgpack.encode([{"a": 1}, "x"])],
            "two frames": [encode(Hello()), b"extra"],
        }
        for name, parts in frames.items():
            raw.send_multipart(parts)
            reply = recv_reply(raw)
            assert isinstance(reply, EngineErrorMsg) and not reply.fatal, name
        raw.send(msgspec.msgpack.encode(["generate", "typed-badly", [1, 2], [4, "very hot"]]))
        reply = recv_reply(raw)
        assert isinstance(reply, RequestErrorMsg) and reply.request_id == "typed-badly" and reply.field == "temperature"
    finally:
        raw.close()
    # Bytes that are not even ZMTP, straight into the unix socket.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(endpoint[len("ipc://"):])
    s.sendall(os.urandom(4096))
    s.close()
    # A stranger that never said hello is told so, fatally, and gets nothing else.
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.setsockopt(zmq.RCVTIMEO, 5000)
    stranger.connect(endpoint)
    stranger.send(msgspec.msgpack.encode(["generate", "x", [1, 2]]))
    reply = decode_core(stranger.recv())
    assert isinstance(reply, EngineErrorMsg) and reply.fatal
    stranger.send(msgspec.msgpack.encode(["hello", 99, "from the future"]))
    reply = decode_core(stranger.recv())
    assert isinstance(reply, EngineErrorMsg) and reply.fatal and "protocol version" in reply.message
    stranger.close()
    with Client(endpoint) as c:
        assert len(c.generate([1, 2, 3], max_tokens=3).token_ids) == 3
    assert "bad message from client" in open(log).read()


def test_killed_client_leaves_no_kv_blocks_held(core):
    endpoint, _, log = core
    script = ("import sys\nfrom llmserve_client import Client\nc = Client(sys.argv[1], client_name='victim')\n"
              "s = c.stream([5, 6, 7, 8] * 20, max_tokens=400, ignore_eos=True)\nnext(s)\n"
              "print('streaming', flush=True)\nfor _ in s: pass\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    victim = subprocess.Popen([sys.executable, "-c", script, endpoint], env=env, stdout=subprocess.PIPE)
    try:
        assert victim.stdout.readline().strip() == b"streaming"
        with Client(endpoint) as c:
            before = c.stats()
            assert before["running"] >= 1 and before["used_kv_blocks"] > 0
            victim.kill()
            victim.wait()
            s = wait_idle(c)
            assert s["requests_aborted_disconnect"] >= 1
        # Noticed by the failing send to a dead peer, not by the 3 s silence timeout (the reason, not the
        # time it took, so a busy machine cannot fail this).
        text = open(log).read()
        assert "(victim) gone: connection lost" in text and "(victim) gone: silent" not in text, text[-2000:]
    finally:
        victim.kill()


def test_cancelling_an_async_stream_aborts_it_in_the_engine(core):
    endpoint, _, _ = core

    async def main():
        async with AsyncClient(endpoint) as c:
            got = []

            async def consume():
                async for chunk in await c.stream([9, 10, 11], max_tokens=400, ignore_eos=True):
                    got.append(chunk)

            task = asyncio.create_task(consume())
            while not got:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 60
            while (s := await c.stats())["live_requests"] or s["running"]:
                assert time.monotonic() < deadline, s
                await asyncio.sleep(0.05)
            many = await asyncio.gather(*[c.generate([1 + i, 2, 3], max_tokens=4, temperature=0.0) for i in range(8)])
            assert all(len(m.token_ids) == 4 for m in many)
            return s

    s = asyncio.run(main())
    assert s["requests_aborted_by_client"] >= 1


def test_many_short_lived_clients_in_one_process(core):
    # Clients share one ZMQ context; closing one (also after its core said goodbye or it timed out) must
    # never disturb the next.
    endpoint, _, _ = core
    for i in range(40):
        with Client(endpoint, connect_timeout=60) as c:
            if i % 10 == 0:
                assert len(c.generate([1, 2, i + 3], max_tokens=2).token_ids) == 2
    with pytest.raises(HandshakeTimeoutError):
        Client(endpoint + ".absent", connect_timeout=0.2)
    with Client(endpoint, connect_timeout=60) as c:
        assert c.stats()["running"] == 0


def test_periodic_log_line(core):
    _, _, log = core
    text = open(log).read()
    assert "generation" in text and "tok/s" in text and "KV usage" in text and "prefix hit rate" in text


# ---- cores of their own -------------------------------------------------------------------------------

def test_sigkill_of_the_core_makes_every_waiting_call_raise(tiny_model_dir, tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port()}"     # tcp here; the shared core covers ipc
    proc = start_core(tiny_model_dir, endpoint, str(tmp_path / "core.log"))
    try:
        c = Client(endpoint, connect_timeout=READY_TIMEOUT, heartbeat_timeout=2.0)
        # Stopped first, the core can finish neither request before the kill, however busy the machine.
        proc.send_signal(signal.SIGSTOP)
        s = c.stream([1, 2, 3], max_tokens=400, ignore_eos=True)
        raised = []

        def waiter():
            try:
                c.generate([4, 5, 6], max_tokens=400, ignore_eos=True)
            except EngineDeadError as e:
                raised.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.2)
        proc.kill()
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError):
            for _ in s:
                pass
        t.join(15)
        # The bound is the heartbeat timeout (2 s) plus the transport's poll; slack for a busy machine.
        assert raised and time.monotonic() - t0 < 2.0 + 8.0
        with pytest.raises(EngineDeadError):
            c.generate([1], max_tokens=2)
        with pytest.raises(EngineDeadError):
            c.stats()
        c.close()
    finally:
        proc.kill()
        proc.wait()


def test_sigterm_drains_then_aborts_and_exits_zero(make_random_qwen3_dir, tmp_path):
    # A context long enough that the long request cannot end inside the drain window however fast the
    # machine, and a window long enough for the short one's few steps however busy it is.
    model = make_random_qwen3_dir(seed=0, max_position_embeddings=1 << 16)
    endpoint = f"ipc://{tmp_path}/core.sock"
    early: list = []
    # A client started before the core waits for it.
    t = threading.Thread(target=lambda: early.append(Client(endpoint, connect_timeout=READY_TIMEOUT)))
    t.start()
    time.sleep(0.3)
    proc = start_core(model, endpoint, str(tmp_path / "core.log"), "--drain-timeout", "8",
                      "--max-model-len", str(1 << 16), "--num-kv-blocks", "4200")
    try:
        t.join(READY_TIMEOUT)
        c = early[0]
        c.generate([1, 2, 3], max_tokens=4)      # warm the engine up so the drain window measures steady steps
        short = c.stream([1, 2, 3], max_tokens=6, ignore_eos=True)
        long = c.stream([4, 5, 6], max_tokens=60_000, ignore_eos=True)
        next(short), next(long)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert [x for x in short][-1].finish_reason == "length"
        assert [x for x in long][-1].finish_reason == "abort"
        assert len(short.completion.token_ids) == 6
        assert not os.path.exists(endpoint[len("ipc://"):])
        with pytest.raises(EngineDeadError, match="shut down"):
            c.generate([1], max_tokens=2)
        c.close()
    finally:
        proc.kill()
        proc.wait()


def test_an_engine_failing_every_step_reaches_every_client_and_exits_1(tiny_model_dir, tmp_path):
    # One failing step fails only its requests (test_faults.py); steps failing in a row mean a broken
    # engine: the requests of the first failures get errors, then the core tells everyone and exits 1.
    from llmserve_core import Engine, EngineConfig
    from llmserve_core.server import DaemonConfig, serve
    from llmserve_core.server.busy_loop import MAX_CONSECUTIVE_STEP_FAILURES
    eng = Engine(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=512, num_kv_blocks=64))
    real_launch, calls = eng.runner.launch_forward, []

    def failing_launch(sched):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("device lost")
        return real_launch(sched)

    eng.runner.launch_forward = failing_launch
    endpoint = f"ipc://{tmp_path}/core.sock"
    codes = []
    t = threading.Thread(target=lambda: codes.append(serve(eng, DaemonConfig(heartbeat_interval=0.2), endpoint)),
                         daemon=True)   # a failing test must not leave the process unable to exit
    t.start()
    with Client(endpoint, connect_timeout=READY_TIMEOUT) as c:
        for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
            with pytest.raises(RequestError, match="device lost") as e:
                c.generate([1, 2, 3], max_tokens=50, ignore_eos=True)
            assert e.value.field == "" and "internal error" in e.value.message
        with pytest.raises(EngineDeadError) as e:
            c.generate([1, 2, 3], max_tokens=50, ignore_eos=True)
        assert "device lost" in str(e.value)
    t.join(60)
    assert codes == [1]


def test_no_core_means_a_bounded_wait():
    t0 = time.monotonic()
    with pytest.raises(HandshakeTimeoutError):
        Client("ipc:///nonexistent-dir/llmserve.sock", connect_timeout=0.5)
    assert time.monotonic() - t0 < 3.0


def test_an_infinite_connect_timeout_waits_for_a_core_instead_of_raising():
    from llmserve_client.transport import Transport
    t = Transport("ipc:///nonexistent-dir/llmserve.sock", connect_timeout=math.inf)
    got = []

    def wait():
        try:
            t.wait_ready(math.inf)
        except Exception as e:
            got.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(1.0)
    assert not got, got          # still waiting, as asked
    t.close()                    # ...until the client is closed
    waiter.join(10)
    assert len(got) == 1 and isinstance(got[0], EngineDeadError), got


@pytest.mark.parametrize("name, value", [("heartbeat_timeout", math.nan), ("heartbeat_timeout", 0.0),
                                         ("heartbeat_timeout", -1.0), ("connect_timeout", math.nan),
                                         ("connect_timeout", -1.0)])
def test_a_timeout_that_could_never_fire_or_always_fires_is_refused(name, value):
    # A NaN heartbeat timeout would never declare a stopped core dead: calls would hang on it.
    kw = {"connect_timeout": 0.1, name: value}
    for cls in (Client, AsyncClient):
        with pytest.raises(ValueError, match=name):
            cls("ipc:///nonexistent-dir/llmserve.sock", **kw)


@pytest.mark.parametrize("args, needle", [
    (["--model", "/nonexistent"], "--model"),
    (["--model", ".", "--block-size", "3"], "--block-size"),
    (["--model", ".", "--listen", "tcp://0.0.0.0:1"], "loopback"),
    (["--model", ".", "--max-num-seqs", "many"], "--max-num-seqs"),
])
def test_bad_command_lines_exit_2_with_a_message(args, needle):
    from llmserve_core.cli import main
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2


def test_make_tiny_model_subcommand(tmp_path, capsys):
    from llmserve_core.cli import main
    assert main(["make-tiny-model", str(tmp_path / "m"), "--seed", "1"]) == 0
    assert (tmp_path / "m" / "config.json").exists() and (tmp_path / "m" / "tokenizer.json").exists()
    assert str(tmp_path / "m") in capsys.readouterr().out
    assert main(["make-tiny-model", str(tmp_path / "deep"), "--num-hidden-layers", "3", "--untied"]) == 0
    cfg = json.loads((tmp_path / "deep" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["tie_word_embeddings"] is False


def test_closing_a_stream_over_a_transport_dead_of_a_protocol_error_does_not_raise():
    """A reconnect that finds a core on another protocol version leaves the transport dead of a
    ProtocolError: closing (or collecting) a stream there has nothing to abort, and must not raise."""
    from types import SimpleNamespace

    from llmserve_client.async_client import AsyncStream
    from llmserve_client.client import Stream
    from llmserve_client.cores import WireRequest
    from llmserve_client.errors import ProtocolError

    class DeadTransport:
        def send(self, msg):
            raise ProtocolError("the core speaks protocol 99")

    cores = SimpleNamespace(transports=[DeadTransport()], release=lambda req: None)
    for cls, close in ((Stream, lambda s: s.close()), (AsyncStream, lambda s: asyncio.run(s.aclose()))):
        stream = object.__new__(cls)
        stream._request, stream._done = WireRequest(cores, "r", "r#1", 0, None), False
        close(stream)
        assert stream._done
