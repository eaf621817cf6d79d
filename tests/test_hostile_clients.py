"""Clients that send extreme values, never read, flood the core or try to forge log lines: each gets an
error or is disconnected, and the core keeps serving everyone else. Against the real daemon subprocess."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmserve_client import Client, RequestError
from llmserve_proto import Hello, Ping, decode_core, encode
from llmserve_proto.messages import (EngineError, Heartbeat, OutputBatch, RequestError as RequestErrorMsg, StatsReply,
                                     Welcome)
from llmserve_proto.sampling import SAMPLING_BOUNDS, SamplingParams

from helpers.daemon import (ENV, READY_TIMEOUT, free_port, recv_reply, rss_bytes, start_core, stop_core, wait_idle,
                            wait_ready)

VOCAB = 1024
PROMPT = [1, 2, 3]
MAX_MODEL_LEN = 512

# What a hostile client sends. msgpack integers stop below 2^64, so 2^64 and beyond go as floats (the
# nearest a wire frame can get); the Python client gets them as ints in test_client_*.
INTS = [2**63, -2**63, 2**64 - 1, 2**63 - 1, 2**31, 2**31 - 1, -(2**31), -1, -2, 0, 1, 10**6]
FLOATS = [math.nan, math.inf, -math.inf, 1e-300, -1e-300, 1e308, -1e308, 2.0**64, 1e-40, 0.5]
EXTREMES = INTS + FLOATS

FIELDS = list(SamplingParams.__struct_fields__)
DEFAULTS = {f: getattr(SamplingParams(), f) for f in FIELDS}


def _is_int(v) -> bool:
    return type(v) is int


def _num(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


# The documented ranges (PROTOCOL.md), written out here independently of the code that enforces them, so
# a bound dropped from the code fails this test.
def in_range(field: str, v, max_tokens=3) -> bool:
    if field == "max_tokens":
        return _is_int(v) and 1 <= v <= MAX_MODEL_LEN - len(PROMPT)
    if field == "temperature":
        return _num(v) and 0 <= v <= 100
    if field == "top_p":
        return _num(v) and 0 < v <= 1
    if field == "top_k":
        return _is_int(v) and -1 <= v < 2**31
    if field == "min_p":
        return _num(v) and 0 <= v <= 1
    if field == "seed":
        return v is None or (_is_int(v) and 0 <= v < 2**63)
    if field == "stop_token_ids":
        return isinstance(v, list) and all(_is_int(t) and 0 <= t < VOCAB for t in v)
    if field in ("logprobs", "prompt_logprobs"):
        return v is None or (_is_int(v) and 0 <= v <= 20)
    if field in ("ignore_eos", "speculative"):
        return type(v) is bool
    if field == "stop":
        return isinstance(v, list) and all(isinstance(s, str) and s for s in v)
    if field in ("presence_penalty", "frequency_penalty"):
        return _num(v) and -2 <= v <= 2
    if field == "repetition_penalty":
        return _num(v) and 0 < v <= 100
    if field == "logit_bias":
        return isinstance(v, dict) and len(v) <= 1024 and all(
            _is_int(t) and 0 <= t < VOCAB and _num(b) and -100 <= b <= 100 for t, b in v.items())
    if field == "min_tokens":
        return _is_int(v) and 0 <= v and (not _num(max_tokens) or v <= max_tokens)
    if field == "include_stop_str_in_output":
        return type(v) is bool
    if field == "guided":
        return v is None        # no extreme here is a grammar; test_guided_and_penalties covers those
    raise AssertionError(f"no documented range for SamplingParams.{field}: add one here and in PROTOCOL.md")


def wire(v):
    return float(v) if _is_int(v) and not -2**63 <= v < 2**64 else v


def params_frame(values: dict) -> list:
    """SamplingParams as its wire array, with `values` replacing the defaults (list fields take a value
    as their one element)."""
    base = dict(DEFAULTS, max_tokens=3)
    base.update(values)
    return [wire(base[f]) if not isinstance(base[f], list) else [wire(x) for x in base[f]] for f in FIELDS]


def bad_fields(values: dict) -> set[str]:
    full = {**DEFAULTS, "max_tokens": 3, **values}
    return {f for f in values if not in_range(f, full[f], full["max_tokens"])}


def field_matches(reported: str, fields: set[str]) -> bool:
    """The field, an element of it ("stop_token_ids[0]") or a field of a nested struct ("guided.kind")."""
    return any(reported == f or reported.startswith((f + "[", f + ".")) for f in fields)


@pytest.fixture(scope="module")
def core(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    endpoint, log = f"ipc://{d}/core.sock", str(d / "core.log")
    proc = start_core(tiny_model_dir, endpoint, log)
    try:
        wait_ready(endpoint, proc, log)
        yield endpoint, proc, log
    finally:
        assert stop_core(proc) == 0, open(log).read()[-3000:]


class Raw:
    """A bare DEALER speaking the protocol by hand (pinging while it waits, as PROTOCOL.md asks)."""

    def __init__(self, endpoint: str, name: str = "raw", rcvhwm: int | None = None):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
            self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.connect(endpoint)
        self.sock.send(encode(Hello(client_name=name)))
        assert isinstance(self.reply(), Welcome)
        self.n = 0

    def send(self, obj) -> None:
        self.sock.send(msgspec.msgpack.encode(obj))

    def reply(self, timeout: float = 120.0):
        """The next message that is not a heartbeat."""
        deadline = time.monotonic() + timeout
        while True:
            if self.sock.poll(500):
                msg = decode_core(self.sock.recv())
                if not isinstance(msg, Heartbeat):
                    return msg
            assert time.monotonic() < deadline, "no reply from the core"
            self.sock.send(encode(Ping(time=time.monotonic())))

    def finals(self, ids: set[str]) -> dict:
        """Collect each id's final item: the RequestError, or the finish_reason of its last output."""
        got: dict = {}
        while not ids <= got.keys():
            msg = self.reply()
            if isinstance(msg, RequestErrorMsg):
                got[msg.request_id] = msg
            elif isinstance(msg, OutputBatch):
                for o in msg.outputs:
                    if o.finish_reason is not None:
                        got[o.request_id] = o.finish_reason
            elif isinstance(msg, EngineError):
                raise AssertionError(f"unexpected engine_error: {msg}")
        return got

    def assert_serving(self) -> None:
        self.n += 1
        rid = f"alive-{self.n}"
        self.send(["generate", rid, PROMPT, [2, 0.0, 1.0, -1, 0.0, None, [], True]])
        assert self.finals({rid})[rid] == "length"

    def close(self) -> None:
        self.sock.close()


def check_generate_reply(reply, values: dict) -> None:
    bad = bad_fields(values)
    if bad:
        assert isinstance(reply, RequestErrorMsg), (values, reply)
        assert field_matches(reply.field, bad), (values, reply)
    else:
        assert reply in ("length", "stop"), (values, reply)


def test_every_sampling_field_at_every_extreme_over_the_wire(core):
    endpoint, proc, _ = core
    raw = Raw(endpoint)
    try:
        cases = {}
        for field in FIELDS:
            for v in EXTREMES:
                cases[f"{field}={v!r}"] = {field: [v] if isinstance(DEFAULTS[field], list) else v}
        for rid, values in cases.items():
            raw.send(["generate", rid, PROMPT, params_frame(values)])
        got = raw.finals(set(cases))
        for rid, values in cases.items():
            check_generate_reply(got[rid], values)
        raw.assert_serving()
    finally:
        raw.close()
    assert proc.poll() is None


def test_top_k_two_to_the_63_is_refused_and_the_core_lives(core):
    endpoint, proc, _ = core
    raw = Raw(endpoint)
    try:
        raw.send(["generate", "huge-k", PROMPT, params_frame({"top_k": 2**63})])     # once overflowed int64
        reply = raw.finals({"huge-k"})["huge-k"]
        assert isinstance(reply, RequestErrorMsg) and reply.field == "top_k"
        raw.assert_serving()
    finally:
        raw.close()
    assert proc.poll() is None


field_values = st.tuples(st.sampled_from(FIELDS), st.sampled_from(EXTREMES + [None, True, "x", [], [2**63]]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(field_values, min_size=1, max_size=4))
def test_random_extreme_combinations_get_an_error_naming_a_bad_field(core, pairs):
    endpoint, proc, _ = core
    values = {f: v for f, v in pairs}
    raw = Raw(endpoint)
    try:
        raw.send(["generate", "combo", PROMPT, params_frame(values)])
        check_generate_reply(raw.finals({"combo"})["combo"], values)
        raw.assert_serving()
    finally:
        raw.close()
    assert proc.poll() is None


def test_request_fields_and_other_messages_at_extremes(core):
    endpoint, proc, _ = core
    raw = Raw(endpoint)
    try:
        for i, v in enumerate(EXTREMES):
            rid = f"prompt-{i}"
            raw.send(["generate", rid, [1, wire(v)], [2]])
            reply = raw.finals({rid})[rid]
            if _is_int(v) and 0 <= v < VOCAB:
                assert reply == "length"
            else:
                assert isinstance(reply, RequestErrorMsg) and reply.field.startswith("prompt_token_ids"), (v, reply)
            # A request id that is not a string cannot be answered per request: an engine_error instead.
            raw.send(["generate", wire(v), PROMPT, [2]])
            reply = raw.reply()
            assert isinstance(reply, EngineError) and not reply.fatal and "request_id" in reply.message
            raw.send(["stats", wire(v)])
            reply = raw.reply()
            if _is_int(v) and -2**63 <= v < 2**63:
                assert isinstance(reply, StatsReply) and reply.nonce == v
            else:
                assert isinstance(reply, EngineError) and not reply.fatal and "nonce" in reply.message, (v, reply)
            raw.send(["ping", wire(v)])
            raw.send(["stats", 7])
            reply = raw.reply()
            if not _num(wire(v)):
                assert isinstance(reply, EngineError) and "time" in reply.message, (v, reply)
                reply = raw.reply()
            assert isinstance(reply, StatsReply) and reply.nonce == 7
            raw.send(["abort", [wire(v)]])
            reply = raw.reply()
            assert isinstance(reply, EngineError) and "request_ids" in reply.message
        raw.assert_serving()
    finally:
        raw.close()
    for v in EXTREMES:      # a hello with any other protocol version is refused, fatally for that session
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 60_000)
        s.connect(endpoint)
        s.send(msgspec.msgpack.encode(["hello", wire(v), "x"]))
        reply = recv_reply(s)
        s.close()
        assert isinstance(reply, Welcome) if v == 1 else isinstance(reply, EngineError), (v, reply)
    assert proc.poll() is None


def test_the_user_field_at_extremes(core):
    # Generate.user: a string of at most 256 characters (any characters: it is a key, never shown raw).
    endpoint, proc, _ = core
    raw = Raw(endpoint)
    try:
        for i, v in enumerate([*EXTREMES, "u" * 257, "", "u" * 256, "\x00\n\u202e\U0001f600", None, [1], {"a": 1}]):
            rid = f"user-{i}"
            raw.send(["generate", rid, PROMPT, [2], wire(v) if not isinstance(v, (str, list, dict, type(None))) else v])
            reply = raw.finals({rid})[rid]
            if isinstance(v, str) and len(v) <= 256:
                assert reply == "length", (v, reply)
            else:
                assert isinstance(reply, RequestErrorMsg) and reply.field == "user", (v, reply)
        raw.assert_serving()
    finally:
        raw.close()
    with Client(endpoint, client_name="users") as c:
        with pytest.raises(RequestError) as e:
            c.generate(PROMPT, max_tokens=2, user="u" * 257)
        assert e.value.field == "user"
        assert c.generate(PROMPT, max_tokens=2, user="alice").finish_reason == "length"
    assert proc.poll() is None


CLIENT_VALUES = [v for v in EXTREMES if not _is_int(v) or -2**63 <= v < 2**64]


def test_every_sampling_field_at_every_extreme_through_the_client(core):
    endpoint, proc, _ = core
    with Client(endpoint) as c:
        for field in FIELDS:
            for v in CLIENT_VALUES:
                value = [v] if isinstance(DEFAULTS[field], list) else v
                kw = {"max_tokens": 3, field: value}
                if in_range(field, value):
                    assert c.generate(PROMPT, **kw).finish_reason in ("length", "stop")
                else:
                    with pytest.raises(RequestError) as e:
                        c.generate(PROMPT, **kw)
                    assert field_matches(e.value.field, {field}), (field, v, e.value)
        for v in CLIENT_VALUES:
            if _is_int(v) and 0 <= v < VOCAB:
                continue
            with pytest.raises(RequestError) as e:
                c.generate([1, v], max_tokens=2)
            assert e.value.field.startswith("prompt"), (v, e.value)
        assert len(c.generate(PROMPT, max_tokens=3).token_ids) == 3
    assert proc.poll() is None


def test_every_sampling_field_has_a_bound():
    # A field added to SamplingParams must add its bound to the table validate() walks.
    assert list(SAMPLING_BOUNDS) == FIELDS
    for f in FIELDS:
        in_range(f, DEFAULTS[f])        # and its documented range here


# ---- clients that do not read -------------------------------------------------------------------------

@pytest.fixture
def small_outbox_core(tiny_model_dir, tmp_path):
    endpoint, log = f"ipc://{tmp_path}/core.sock", str(tmp_path / "core.log")
    proc = start_core(tiny_model_dir, endpoint, log, "--max-unread-bytes", str(256 * 1024))
    try:
        wait_ready(endpoint, proc, log)
        yield endpoint, proc, log
    finally:
        assert stop_core(proc) == 0, open(log).read()[-3000:]


def test_a_client_that_never_reads_is_disconnected_and_the_core_stays_small(small_outbox_core):
    endpoint, proc, log = small_outbox_core
    with Client(endpoint, client_name="good") as good:
        good.generate(PROMPT, max_tokens=4)
        rss0 = rss_bytes(proc.pid)
        gone0 = good.stats()["clients_gone"]        # wait_ready's handshake client is among them
        deaf = Raw(endpoint, name="deaf", rcvhwm=1)
        hush = threading.Event()

        def keep_talking():     # on its own thread, so the good client's calls below never hold it up
            while not hush.wait(0.2):
                try:
                    deaf.sock.send(encode(Ping()), zmq.NOBLOCK)
                except zmq.Again:
                    pass        # its queue is full: the core has plenty of its messages still to read

        talker = threading.Thread(target=keep_talking)
        try:
            # 20 logprobs make each step's outputs kilobytes, so the unread bytes pass the cap within a
            # hundred steps: dropped while its requests run, however fast the machine steps.
            for i in range(32):
                deaf.send(["generate", f"long-{i}", [5 + i, 6, 7], [400, 1.0, 1.0, -1, 0.0, None, [], True, 20]])
            # 100,000 stats queries would be about 80 MB of unread replies; the per-client stats rate keeps
            # all but a burst of them from ever being answered.
            for i in range(100_000):
                deaf.send(["stats", i])
            talker.start()      # still talking (not silent), still not reading
            deadline = time.monotonic() + 120
            while True:
                s = good.stats()
                if s["clients_gone"] > gone0 and s["live_requests"] == 0:
                    break
                assert time.monotonic() < deadline, s
                assert good.generate(PROMPT, max_tokens=2).finish_reason == "length"   # served meanwhile
                time.sleep(0.2)
            grown = rss_bytes(proc.pid) - rss0
            assert s["requests_aborted_disconnect"] >= 1
            assert grown < 40 * 2**20, f"core grew {grown / 2**20:.1f} MiB for a client that never reads"
            wait_idle(good)
        finally:
            hush.set()
            if talker.is_alive():
                talker.join(10)
            deaf.close()
    # Its unread backlog, not silence: it talked all along (a stall of the core does not count as silence).
    text = open(log).read()
    assert "(deaf) gone: not reading its socket" in text, text[-2000:]


# ---- floods -------------------------------------------------------------------------------------------

FAIRNESS_STEPS = 4
FLOOD_TOKENS = 400


@pytest.fixture
def flood_core(tiny_model_dir, tmp_path):
    endpoint, log = f"ipc://{tmp_path}/core.sock", str(tmp_path / "core.log")
    proc = start_core(tiny_model_dir, endpoint, log, "--max-num-seqs", "8", "--max-queued-requests-per-client",
                      "20000", "--max-queued-requests", "20000", "--log-interval", "0",
                      "--fairness-preempt-steps", str(FAIRNESS_STEPS))
    try:
        wait_ready(endpoint, proc, log)
        yield endpoint, proc
    finally:
        assert stop_core(proc) == 0, open(log).read()[-3000:]


def test_a_small_request_overtakes_a_10000_request_flood(flood_core):
    # The flooder reads its outputs and pings: only its volume is hostile. Its requests are long, so a slot
    # frees only when one of them ends (FLOOD_TOKENS steps): the probe must not wait for that.
    endpoint, proc = flood_core
    flood = Raw(endpoint, name="flood")
    stop = threading.Event()

    def drain():
        last_ping = 0.0
        while not stop.is_set():
            if flood.sock.poll(200):
                flood.sock.recv()
            if time.monotonic() - last_ping > 0.5:
                flood.send(["ping", 0.0])
                last_ping = time.monotonic()

    reader = threading.Thread(target=drain)
    try:
        for i in range(10_000):
            flood.send(["generate", f"f{i}", [9, 8, 7, i % 500], [FLOOD_TOKENS, 1.0, 1.0, -1, 0.0, None, [], True]])
        reader.start()
        with Client(endpoint, client_name="small") as c:
            deadline = time.monotonic() + 120
            while (s := c.stats())["waiting"] < 5000 or s["running"] < 8:     # queued, and holding every slot
                assert time.monotonic() < deadline, s
                time.sleep(0.1)
            for _ in range(3):
                t0 = time.monotonic()
                before = c.stats()
                stats_latency = time.monotonic() - t0
                t0 = time.monotonic()
                done = c.generate(PROMPT, max_tokens=2, ignore_eos=True)
                latency = time.monotonic() - t0
                after = c.stats()
                assert done.finish_reason == "length"
                # Fair shares: the flood gave a slot back within FAIRNESS_STEPS steps, not at the end of one of
                # its requests (FLOOD_TOKENS steps), nor behind its thousands waiting (arrival order: hours).
                # The slack covers the steps run between the stats replies and the request's arrival.
                steps = after["num_steps"] - before["num_steps"]
                assert steps <= FAIRNESS_STEPS + 2 + 10, (steps, before, after)
                assert after["waiting"] > 3000 and after["num_fairness_preemptions"] >= 1, after
                # Within a second on an idle machine; slack for a busy CI box, far below the FIFO wait.
                assert latency < 5.0 and stats_latency < 5.0, (latency, stats_latency)
    finally:
        stop.set()
        if reader.is_alive():
            reader.join(10)
        flood.close()
    assert proc.poll() is None


def test_requests_past_the_per_client_queue_cap_are_refused(tiny_model_dir, tmp_path):
    endpoint, log = f"ipc://{tmp_path}/core.sock", str(tmp_path / "core.log")
    proc = start_core(tiny_model_dir, endpoint, log, "--max-num-seqs", "2", "--max-queued-requests-per-client", "5")
    try:
        wait_ready(endpoint, proc, log)
        raw = Raw(endpoint, name="greedy")
        ids = {f"q{i}" for i in range(20)}
        for rid in sorted(ids):
            raw.send(["generate", rid, PROMPT, [50, 1.0, 1.0, -1, 0.0, None, [], True]])
        got = raw.finals(ids)
        refused = [r for r in got.values() if isinstance(r, RequestErrorMsg)]
        # 2 running + 5 waiting at most when the burst arrives; the rest are refused, clearly.
        assert 20 - 7 <= len(refused) < 20
        assert all(r.field == "" and r.message.startswith("queue full") for r in refused)
        with Client(endpoint, client_name="other") as other:        # another client's queue is its own
            assert other.generate(PROMPT, max_tokens=2).finish_reason == "length"
        raw.close()
    finally:
        assert stop_core(proc) == 0, open(log).read()[-3000:]


# ---- log injection ------------------------------------------------------------------------------------

def test_client_text_cannot_forge_or_flood_log_lines(core):
    endpoint, proc, log = core
    before = os.path.getsize(log)
    forged = "evil\n2026-01-01 00:00:00,000 INFO llmserve_core.server: client admin connected\x1b[2J"
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 60_000)
    s.connect(endpoint)
    try:
        s.send(encode(Hello(client_name=forged + "x" * 1_000_000)))
        assert isinstance(recv_reply(s), Welcome)
        s.send(msgspec.msgpack.encode(["generate", forged, PROMPT, [0]]))     # rejected: logged with its id
        assert isinstance(recv_reply(s), RequestErrorMsg)
        for i in range(5000):
            s.send(b"\xc1 garbage " + forged.encode())
        for _ in range(5000):
            assert isinstance(recv_reply(s), EngineError)
    finally:
        s.close()
    with Client(endpoint) as c:          # the core still serves, and its log has had time to be written
        c.generate(PROMPT, max_tokens=2)
    with open(log, "rb") as f:
        f.seek(before)
        text = f.read().decode()
    lines = text.splitlines()
    assert not any(line.startswith("2026-01-01") for line in lines), "a client forged a log line"
    assert "\x1b" not in text
    assert max(len(line) for line in lines) < 2000
    assert "evil\\x0a2026-01-01" in text         # logged, escaped
    assert len(text) < 100_000, f"{len(text)} bytes of log for one client's garbage"
    assert "suppressed" in text or text.count("bad message") <= 10


# ---- --listen checked before the model loads ----------------------------------------------------------

def _cli_error(model_dir: str, listen: str, capsys) -> str:
    """Run llmserve-core's command line in this process; it must exit 2 before loading anything."""
    from llmserve_core.cli import main
    with pytest.raises(SystemExit) as e:
        main(["--model", model_dir, "--listen", listen, "--device", "cpu"])
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("listen, needle", [
    ("ipc:///tmp/" + "d" * 100 + "/core.sock", "at most 107"),
    ("tcp://[::1]", "tcp://HOST:PORT"),
    ("tcp://::1:5555", "tcp://HOST:PORT"),
    ("tcp://[not-v6]:5555", "not an IPv6 address"),
    ("tcp://127.0.0.1:99999", "port in 1..65535"),
    ("ipc:///dev/null/sub/core.sock", "cannot use directory"),
])
def test_bad_listen_exits_2_with_one_line_before_loading(tiny_model_dir, listen, needle, capsys):
    err = _cli_error(tiny_model_dir, listen, capsys)
    assert err.count("\n") == 1 and needle in err and err.startswith("llmserve-core: error: listen"), err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any directory")
def test_listen_in_a_directory_we_cannot_write_exits_2(tiny_model_dir, tmp_path, capsys):
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    err = _cli_error(tiny_model_dir, f"ipc://{d}/core.sock", capsys)
    assert err.count("\n") == 1 and "listen" in err, err


def test_listen_on_a_port_in_use_exits_2_with_one_line(tiny_model_dir):
    # The whole command as a user runs it: exit 2, one line, no traceback, no model loaded.
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = subprocess.run([sys.executable, "-m", "llmserve_core", "--model", tiny_model_dir, "--device", "cpu",
                            "--listen", f"tcp://127.0.0.1:{taken.getsockname()[1]}"],
                           env=ENV, capture_output=True, text=True, timeout=READY_TIMEOUT)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Address already in use" in r.stderr and "engine loaded" not in r.stderr


def test_ipv6_loopback_listens(tiny_model_dir, tmp_path):
    endpoint, log = f"tcp://[::1]:{free_port()}", str(tmp_path / "core.log")
    proc = start_core(tiny_model_dir, endpoint, log)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IPV6, 1)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(encode(Hello(client_name="v6")))      # queued until the core binds, once loaded
        assert sock.poll(READY_TIMEOUT * 1000), open(log).read()[-3000:]
        assert isinstance(recv_reply(sock), Welcome)
    finally:
        sock.close()
        assert stop_core(proc) == 0, open(log).read()[-3000:]
