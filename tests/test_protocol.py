"""Wire messages: exact array layout, round trips, bad frames named precisely, default endpoint safety."""
from __future__ import annotations

import os
import stat

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from llmserve_proto import (Abort, BadMessage, EngineError, Generate, Goodbye, Heartbeat, Hello, Logprobs, ModelInfo,
                            OutputBatch, Ping, Pool, PooledBatch, PoolingOutput, PoolingParams, RequestError,
                            RequestMetrics, RequestOutput, SamplingParams, Shutdown, StatsReply, StatsRequest, Welcome,
                            ValidationError, decode_client, decode_client_checked, decode_core, encode)
from llmserve_proto.messages import validate_client_message
from llmserve_proto import endpoint as ep

CLIENT_MESSAGES = [
    Hello(client_name="bench"),
    Generate(request_id="r1", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=5, temperature=0.0,
                                                                                   stop=["\n\n"], logprobs=2)),
    Generate(request_id="r3", prompt_token_ids=[1, 2], params=SamplingParams(prompt_logprobs=0)),
    Generate(request_id="r2", prompt_token_ids=[7]),
    Pool(request_id="p1", prompt_token_ids=[4, 5]),
    Pool(request_id="p2", prompt_token_ids=[4], params=PoolingParams(dimensions=32, normalize=False)),
    Pool(request_id="p3", prompt_token_ids=[4], params=PoolingParams(task="score", token_ids=[9, 8]), user="u1"),
    Abort(request_ids=["r1", "r2"]),
    StatsRequest(nonce=7),
    Ping(time=12.5),
    Goodbye(),
]
CORE_MESSAGES = [
    Welcome(protocol_version=1, model_info=ModelInfo(model="/m", name="m", vocab_size=10, max_model_len=64,
                                                     eos_token_ids=[2], speculative=True, speculative_model="/e"),
            heartbeat_interval_s=0.5, client_timeout_s=15.0, core_pid=42, max_request_tokens=64, kv_block_size=16),
    OutputBatch(outputs=[
        RequestOutput(request_id="a", token_ids=[1, 2]),
        RequestOutput(request_id="b", token_ids=[3], finish_reason="length",
                      logprobs=[Logprobs(logprob=-0.5, top_token_ids=[3, 4], top_logprobs=[-0.5, -1.5])],
                      metrics=RequestMetrics(arrival_time=1.0, first_token_time=1.2, finish_time=2.0,
                                             num_prompt_tokens=5, num_cached_tokens=4, num_generated_tokens=1)),
        RequestOutput(request_id="c", token_ids=[5], prompt_logprobs=[Logprobs(logprob=-2.0, top_token_ids=[1],
                                                                               top_logprobs=[-0.1])]),
    ], step=3, time=9.0),
    Welcome(protocol_version=1, model_info=ModelInfo(model="/e", runner="pooling", tasks=["embed"], hidden_size=8),
            heartbeat_interval_s=0.5, client_timeout_s=15.0),
    PooledBatch(outputs=[
        PoolingOutput(request_id="e", embedding=b"\x00\x00\x80\x3f" * 8,
                      metrics=RequestMetrics(arrival_time=1.0, finish_time=2.0, num_prompt_tokens=5)),
        PoolingOutput(request_id="s", logits=[1.5, -2.0]),
        PoolingOutput(request_id="x", finish_reason="abort"),
    ], step=4, time=9.5),
    RequestError(request_id="a", field="temperature", message="must be >= 0"),
    EngineError(message="malformed frame", fatal=False),
    StatsReply(nonce=7, stats={"running": 1, "kv_usage": 0.5, "name": "x", "flag": True, "none": None}),
    Heartbeat(time=1.0),
    Shutdown(reason="received SIGTERM"),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda m: type(m).__name__)
def test_client_messages_round_trip(msg):
    assert decode_client(encode(msg)) == msg


@pytest.mark.parametrize("msg", CORE_MESSAGES, ids=lambda m: type(m).__name__)
def test_core_messages_round_trip(msg):
    assert decode_core(encode(msg)) == msg


def test_wire_layout_is_a_tagged_array_in_field_order():
    # PROTOCOL.md promises this layout to clients written in other languages; pin it.
    raw = msgspec.msgpack.decode(encode(Generate(request_id="r", prompt_token_ids=[5, 6],
                                                 params=SamplingParams(max_tokens=3, temperature=0.0))))
    assert raw[:3] == ["generate", "r", [5, 6]]
    assert raw[3][:2] == [3, 0.0]
    assert msgspec.msgpack.decode(encode(Goodbye())) == ["goodbye"]
    assert msgspec.msgpack.decode(encode(Hello(client_name="c"))) == ["hello", 1, "c"]


def test_trailing_fields_may_be_left_off():
    # A minimal foreign client can send just the required fields.
    msg = decode_client(msgspec.msgpack.encode(["generate", "r", [1, 2]]))
    assert msg == Generate(request_id="r", prompt_token_ids=[1, 2], params=SamplingParams())
    params = decode_client(msgspec.msgpack.encode(["generate", "r", [1], [4, 0.0]])).params
    assert params.max_tokens == 4 and params.temperature == 0.0 and params.top_p == 1.0
    assert decode_client(msgspec.msgpack.encode(["hello"])) == Hello()


def test_the_two_directions_do_not_mix():
    with pytest.raises(msgspec.ValidationError):
        decode_client(encode(Heartbeat()))
    with pytest.raises(msgspec.ValidationError):
        decode_core(encode(Ping()))


# Every SamplingParams field but `guided`, at its default, as the wire array.
PARAMS = [16, 1.0, 1.0, -1, 0.0, None, [], False, None, [], True, 0.0, 0.0, 1.0, {}, 0, False]


@pytest.mark.parametrize("frame, request_id, field", [
    (msgspec.msgpack.encode(["generate", "r1", [1, 2], [5, "hot"]]), "r1", "temperature"),
    (msgspec.msgpack.encode(["generate", "r2", [1, "x"]]), "r2", "prompt_token_ids[1]"),
    (msgspec.msgpack.encode(["generate", "r3", "not a list"]), "r3", "prompt_token_ids"),
    (msgspec.msgpack.encode(["generate", "r4", [1], [5, 1.0, 1.0, -1, 0.0, None, ["no"]]]), "r4", "stop_token_ids[0]"),
    (msgspec.msgpack.encode(["generate", 17, [1]]), None, "request_id"),
    # An empty field would tell the client its request was fine and may be retried (PROTOCOL.md §6).
    (msgspec.msgpack.encode(["generate", "r5"]), "r5", "prompt_token_ids"),
    (msgspec.msgpack.encode(["generate", "r6", [1], PARAMS[:14] + [{"a": 1.0}]]), "r6", "logit_bias"),
    (msgspec.msgpack.encode(["generate", "r7", [1], PARAMS[:14] + [{1: "a"}]]), "r7", "logit_bias"),
    (msgspec.msgpack.encode(["generate", "r8", [1], PARAMS + [["regex", 5]]]), "r8", "guided.spec"),
    (msgspec.msgpack.encode(["generate", "r9", [1], PARAMS + [["choice", "", ["a", 5]]]]), "r9", "guided.choices[1]"),
    (msgspec.msgpack.encode(["pool", "p1", [1], ["embed", True, "32"]]), "p1", "dimensions"),
    (msgspec.msgpack.encode(["pool", "p2", [1], ["score", True, None, [1, "x"]]]), "p2", "token_ids[1]"),
    (msgspec.msgpack.encode(["pool", "p3", [1], [7]]), "p3", "task"),
    (msgspec.msgpack.encode(["pool", "p4"]), "p4", "prompt_token_ids"),
    (msgspec.msgpack.encode(["pool", "p5", [1], [], 7]), "p5", "user"),
    (msgspec.msgpack.encode(["abort", "r1"]), None, "request_ids"),
    (msgspec.msgpack.encode(["no_such_tag", 1]), None, ""),
    (msgspec.msgpack.encode({"tag": "hello"}), None, ""),
    (b"\xc1\xc1garbage", None, ""),
    (b"", None, ""),
])
def test_bad_frames_name_the_request_and_field(frame, request_id, field):
    with pytest.raises(BadMessage) as e:
        decode_client_checked(frame)
    assert e.value.request_id == request_id
    assert e.value.field == field


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
@example(b"\x92\x90\x00")      # [[], 0]: an unhashable tag once escaped as a TypeError
def test_random_bytes_never_escape_as_anything_but_bad_message(data):
    try:
        decode_client_checked(data)
    except BadMessage:
        pass


wire_values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=3),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.integers(-1, 3) | st.text(max_size=2),
                                                                                       inner, max_size=2),
                           max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 4), st.integers(-1, len(PARAMS)), wire_values)
def test_a_bad_generate_whose_id_is_read_names_a_field(length, pos, value):
    # A generate cut short, or with any value in any field (pos -1: the prompt): the request_error it gets
    # names some field, never "" (which says the request was fine: retry it).
    ids, params = [1], PARAMS + [None]
    if pos < 0:
        ids = value
    else:
        params[pos] = value
    frame = msgspec.msgpack.encode(["generate", "r", ids, params][:length])
    try:
        decode_client_checked(frame)
    except BadMessage as e:
        assert e.request_id == "r" and e.field, e.message


@settings(max_examples=100, deadline=None)
@given(rid=st.text(min_size=1, max_size=50), ids=st.lists(st.integers(0, 2**31), max_size=50),
       max_tokens=st.integers(1, 10**6), temperature=st.floats(0, 5), seed=st.none() | st.integers(0, 2**63 - 1),
       stop=st.lists(st.text(min_size=1, max_size=5), max_size=3))
def test_generate_round_trips_any_values(rid, ids, max_tokens, temperature, seed, stop):
    msg = Generate(request_id=rid, prompt_token_ids=ids,
                   params=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, stop=stop))
    assert decode_client(encode(msg)) == msg


@pytest.mark.parametrize("params, field", [
    (PoolingParams(task="bogus"), "task"),
    (PoolingParams(task=""), "task"),
    (PoolingParams(dimensions=0), "dimensions"),
    (PoolingParams(dimensions=2**31), "dimensions"),
    (PoolingParams(dimensions=-2**63), "dimensions"),
    (PoolingParams(task="score"), "token_ids"),
    (PoolingParams(task="score", token_ids=[2**63]), "token_ids"),
    (PoolingParams(task="score", token_ids=[-1]), "token_ids"),
    (PoolingParams(token_ids=[1]), "token_ids"),
    (PoolingParams(normalize=1), "normalize"),
])
def test_pooling_params_out_of_bounds_name_the_field(params, field):
    msg = Pool(request_id="p", prompt_token_ids=[1], params=params)
    with pytest.raises(ValidationError) as e:
        validate_client_message(decode_client(encode(msg)) if field != "normalize" else msg)
    assert e.value.field == field


def test_an_older_peer_reads_a_newer_model_info():
    """ModelInfo's pooling fields are appended: a decoder that knows only the older fields skips them."""
    class OldModelInfo(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
        model: str
        name: str = ""
        vocab_size: int = 0
        max_model_len: int = 0
        eos_token_ids: list[int] = []
        speculative: bool = False
        speculative_model: str | None = None
        tokenizer: str | None = None
    new = ModelInfo(model="/e", vocab_size=5, runner="pooling", tasks=["embed"], hidden_size=8)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldModelInfo).vocab_size == 5
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(OldModelInfo(model="/o")), type=ModelInfo).tasks == []


def test_no_pickle_anywhere_on_the_wire():
    root = os.path.join(os.path.dirname(__file__), "..")
    for pkg in ("proto", "llmserve_client", os.path.join("llmserve_core", "server")):
        for dirpath, _, files in os.walk(os.path.join(root, pkg)):
            for f in files:
                if f.endswith(".py"):
                    src = open(os.path.join(dirpath, f)).read()
                    for banned in ("import pickle", "pickle.", "recv_pyobj", "send_pyobj", "cloudpickle"):
                        assert banned not in src, (f, banned)


def test_the_client_library_never_imports_torch_or_the_core():
    import subprocess
    import sys
    code = ("import sys, llmserve_client, llmserve_client.async_client; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('llmserve_core')]; "
            "assert not bad, bad")
    root = os.path.join(os.path.dirname(__file__), "..")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": root})


# ---- endpoints ----------------------------------------------------------------------------------------

def test_default_endpoint_lives_in_a_private_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    endpoint = ep.default_endpoint()
    assert endpoint == f"ipc://{tmp_path}/llmserve/core.sock"
    ep.ensure_private_dir(ep.runtime_dir())
    assert stat.S_IMODE(os.stat(ep.runtime_dir()).st_mode) == 0o700


def test_private_dir_is_tightened_when_too_open(tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    ep.ensure_private_dir(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_runtime_dir_falls_back_to_a_per_user_tmp_dir(monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert ep.runtime_dir().endswith(f"llmserve-{os.getuid()}")


@pytest.mark.parametrize("endpoint, ok", [
    ("ipc:///tmp/x.sock", True), ("tcp://127.0.0.1:5555", True), ("tcp://localhost:1", True), ("tcp://[::1]:80", True),
    ("tcp://0.0.0.0:5555", False), ("tcp://10.1.2.3:5555", False), ("tcp://127.0.0.1", False),
    ("tcp://127.0.0.1:99999", False), ("ipc://", False), ("http://127.0.0.1:80", False),
])
def test_listen_endpoints_are_checked(endpoint, ok):
    if ok:
        assert ep.check_listen_endpoint(endpoint) == endpoint
    else:
        with pytest.raises(ValueError, match="listen"):
            ep.check_listen_endpoint(endpoint)


def test_remote_tcp_needs_an_explicit_opt_in():
    assert ep.check_listen_endpoint("tcp://0.0.0.0:5555", allow_remote=True) == "tcp://0.0.0.0:5555"


@pytest.mark.parametrize("tag", [[], [1], {}, {"a": 1}, 1.5, None, b"x", True, -2**63, 2**64 - 1])
@pytest.mark.parametrize("rest", [[], [0], ["rid", {}], ["rid", [1, 2], "hot"]])
def test_any_value_where_the_tag_goes_is_a_bad_message(tag, rest):
    """Random bytes rarely spell an array whose first item is not a string; every kind of value there must
    come back as BadMessage (an unhashable one once raised TypeError, which ended the socket thread)."""
    with pytest.raises(BadMessage):
        decode_client_checked(msgspec.msgpack.encode([tag, *rest]))
